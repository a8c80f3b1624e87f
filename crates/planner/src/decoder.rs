//! Chapter 5's decoders: the closed-form prediction of a lean training
//! step's peak, and the plan that picks an option to fit a device.
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

use serde::Serialize;
use workbook_models::llama::{LlamaConfig, Loss};
use workbook_sdk::candle::DType;

/// A step's predicted peak, by term, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
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
        self.state
            .saturating_add(self.saved)
            .saturating_add(self.working)
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
    saturate(saved_block(cfg, batch, seq, e as u128))
}

fn saved_block(cfg: &LlamaConfig, batch: usize, seq: usize, e: u128) -> u128 {
    let n = |x: usize| x as u128;
    let tokens = n(batch) * n(seq);
    let (h, i) = (n(cfg.hidden), n(cfg.intermediate));
    let q = n(cfg.heads) * n(cfg.head_dim);
    let kv = n(cfg.kv_heads) * n(cfg.head_dim);
    tokens * e * (6 * h + 5 * q + 5 * kv + 3 * i)
        + 4 * n(batch) * n(cfg.heads) * n(seq)
        + 2 * 4 * tokens
}

/// `x`, or `u64::MAX` past it: a prediction for an absurd size says "more
/// than any memory" rather than wrapping.
fn saturate(x: u128) -> u64 {
    u64::try_from(x).unwrap_or(u64::MAX)
}

/// The peak of a lean step of `cfg` at `batch` x `seq` tokens computing in
/// `compute` with `loss`: the toolkit's layers with tiled attention
/// (`Layers::Lean`, `Attention::Tiled`), f32 master weights, the toolkit's
/// in-place AdamW.
pub fn predict_peak(
    cfg: &LlamaConfig,
    batch: usize,
    seq: usize,
    compute: DType,
    loss: Loss,
) -> Prediction {
    let n = |x: usize| x as u128;
    let params = u128::from(cfg.parameter_count());
    let e = n(compute.size_in_bytes());
    let tokens = n(batch) * n(seq);
    let (h, v) = (n(cfg.hidden), n(cfg.vocab));
    let blocks = n(cfg.layers) * saved_block(cfg, batch, seq, e);
    // The embedding's output and the final norm's.
    let ends = 2 * tokens * h * e;
    let logits = match loss {
        Loss::Plain => tokens * v * e,
        Loss::Fused => 0,
    };
    let half = compute != DType::F32;
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
    let head = match loss {
        Loss::Plain => tokens * v * e + 5 * e * v * h,
        Loss::Fused => 3 * e * v * h,
    };
    Prediction {
        state: saturate(12 * params),
        saved: saturate(blocks + ends + logits + casts),
        working: saturate(end.max(head)),
    }
}

/// A device a plan is made for: its name and the memory a step may hold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Card {
    /// As `--device` names it.
    pub name: String,
    /// Bytes of memory, as `nvidia-smi` reports the card's total.
    pub bytes: u64,
    /// Whether bf16 arithmetic is the fast one (on the GPUs), or f32 (on a
    /// CPU, where candle widens bf16 products to f32: chapter 5 measured a
    /// bf16 step at twice the f32 one's time).
    pub bf16_fast: bool,
}

/// The cards `--device` knows, by name: total memory as `nvidia-smi`
/// reports it (MiB).
pub const CARDS: [(&str, u64); 5] = [
    ("h100-80gb", 81_559),
    ("a100-80gb", 81_920),
    ("a100-40gb", 40_960),
    ("l4", 23_034),
    ("rtx4090", 24_564),
];

impl Card {
    /// The named card of [`CARDS`].
    pub fn named(name: &str) -> Option<Self> {
        CARDS.iter().find(|(n, _)| *n == name).map(|(n, mib)| Self {
            name: n.to_string(),
            bytes: mib << 20,
            bf16_fast: true,
        })
    }

    /// This machine's CPU with `bytes` of memory.
    pub fn cpu(bytes: u64) -> Self {
        Self {
            name: "cpu".into(),
            bytes,
            bf16_fast: false,
        }
    }
}

/// One option of a decoder plan and its predicted peak.
#[derive(Debug, Clone, Serialize)]
pub struct DecoderOption {
    /// The compute dtype's name: `f32`, or `bf16` from f32 masters.
    pub compute: String,
    /// `plain` or `fused`.
    pub loss: String,
    /// The predicted peak, by term.
    pub prediction: Prediction,
    /// Whether it fits the budget.
    pub fits: bool,
}

/// The options weighed for a decoder at a batch, cheapest first, and the
/// one chosen: the first that fits.
#[derive(Debug, Clone, Serialize)]
pub struct DecoderPlan {
    /// Parameters of the model.
    pub params: u64,
    /// Sequences per step and tokens per sequence.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// The memory a step may hold.
    pub budget: u64,
    /// The options, cheapest first: the fast dtype before the other, the
    /// plain loss before the fused one (it computes the head's product once
    /// less).
    pub options: Vec<DecoderOption>,
    /// The index of the first option that fits, if any.
    pub chosen: Option<usize>,
}

/// Weighs every compute dtype of `dtypes` with both losses for `cfg` at
/// `batch` x `seq` tokens against `budget` bytes on `card`.
pub fn plan_decoder(
    cfg: &LlamaConfig,
    batch: usize,
    seq: usize,
    dtypes: &[DType],
    budget: u64,
    card: &Card,
) -> DecoderPlan {
    let mut order: Vec<DType> = dtypes.to_vec();
    // The fast dtype first.
    order.sort_by_key(|d| (*d == DType::BF16) != card.bf16_fast);
    let mut options = Vec::new();
    for compute in order {
        for loss in [Loss::Plain, Loss::Fused] {
            let prediction = predict_peak(cfg, batch, seq, compute, loss);
            options.push(DecoderOption {
                compute: format!("{compute:?}").to_lowercase(),
                loss: match loss {
                    Loss::Plain => "plain".into(),
                    Loss::Fused => "fused".into(),
                },
                fits: prediction.total() <= budget,
                prediction,
            });
        }
    }
    let chosen = options.iter().position(|o| o.fits);
    DecoderPlan {
        params: cfg.parameter_count(),
        batch,
        seq,
        budget,
        options,
        chosen,
    }
}
