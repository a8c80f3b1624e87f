//! The closed-form prediction of a lean decoder step's peak.
//!
//! Every term is a count of tensors: the training state, what the lean
//! graph keeps for the backward (read off the graph with `candle-ledger`,
//! tensor by tensor), and what the backward holds beside them at its peak.
//! In candle the graph keeps every saved tensor until the loss is dropped,
//! so a step peaks at one of two moments: at the head's backward, when the
//! head weight's gradient passes through candle's gradient store (the
//! product, the zeros it is added to, and their sum; for the plain head,
//! whose weight is used transposed, five tensors the weight's size at
//! once, counted by the allocator), or at the end, when every gradient
//! exists and the embedding's is added to the tied head's.

use workbook_models::llama::{LlamaConfig, Loss, StepOptions};
use workbook_sdk::candle::DType;

/// A step's predicted peak, by term, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prediction {
    /// f32 master parameters and AdamW's two moments: 12 bytes a
    /// parameter.
    pub state: u64,
    /// What the forward keeps for the backward.
    pub saved: u64,
    /// What the backward holds beside them at the peak: every f32 gradient
    /// and the embedding's as it is made, or the head's gradients.
    pub working: u64,
}

impl Prediction {
    /// All terms.
    pub fn total(&self) -> u64 {
        self.state + self.saved + self.working
    }
}

/// What one block keeps for the backward, in bytes, at `batch` x `seq`
/// tokens with elements of `e` bytes. With tiled attention, each block
/// keeps six tensors of the residual stream's width h (the first norm's
/// output, the attention's projection, the sum after it, the second norm's
/// output, the MLP's projection, the sum after it), five of the queries'
/// width a*d (the q projection, its copy in heads-first order, q after
/// RoPE, the attention's output and its copy back in tokens-first order),
/// five of the keys' and values' kv*d (k and v projected and copied, and k
/// after RoPE), three of the MLP's width i (gate, up and their SwiGLU
/// product) and, in f32, each head's log-sum-exp per row and each norm's
/// reciprocal root mean square per token.
pub fn saved_per_block(cfg: &LlamaConfig, batch: usize, seq: usize, e: u64) -> u64 {
    let tokens = (batch * seq) as u64;
    let (h, i) = (cfg.hidden as u64, cfg.intermediate as u64);
    let q = (cfg.heads * cfg.head_dim) as u64;
    let kv = (cfg.kv_heads * cfg.head_dim) as u64;
    tokens * e * (6 * h + 5 * q + 5 * kv + 3 * i)
        + 4 * (batch * cfg.heads * seq) as u64
        + 2 * 4 * tokens
}

/// The peak of a lean step (tiled attention, f32 master weights, the
/// toolkit's in-place AdamW) of `cfg` at `batch` x `seq` tokens.
pub fn predict_peak(
    cfg: &LlamaConfig,
    batch: usize,
    seq: usize,
    options: &StepOptions,
) -> Prediction {
    let params = cfg.parameter_count();
    let e = options.compute.size_in_bytes() as u64;
    let tokens = (batch * seq) as u64;
    let (h, v) = (cfg.hidden as u64, cfg.vocab as u64);
    let blocks = cfg.layers as u64 * saved_per_block(cfg, batch, seq, e);
    // The embedding's output and the final norm's.
    let ends = 2 * tokens * h * e;
    let logits = match options.loss {
        Loss::Plain => tokens * v * e,
        Loss::Fused => 0,
    };
    let half = options.compute != DType::F32;
    // In bf16 every parameter's cast is an input the graph keeps, and a tied
    // embedding is cast twice: for the lookup and for the head.
    let casts = if half {
        e * params + if cfg.tied { e * v * h } else { 0 }
    } else {
        0
    };
    // At the end: every f32 gradient, and the embedding's f32 gradient being
    // made; in bf16 also its bf16 gradient and the cast between.
    let end = 4 * params
        + if half {
            2 * 4 * v * h + e * v * h
        } else {
            4 * v * h
        };
    // At the head: the logits' gradient (plain) and the head weight's
    // gradient in the compute dtype, in candle's gradient store.
    let head = match options.loss {
        Loss::Plain => tokens * v * e + 5 * e * v * h,
        Loss::Fused => 3 * e * v * h,
    };
    Prediction {
        state: 12 * params,
        saved: blocks + ends + logits + casts,
        working: end.max(head),
    }
}
