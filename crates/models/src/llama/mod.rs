//! Chapter 5's decoders: Llama, Qwen2 and Mistral, built from a Hugging Face
//! `config.json` ([`LlamaConfig`]) with seeded random weights (memory does
//! not depend on the weights' values), from the toolkit's lean layers: RMS
//! norm, rotary embeddings and SwiGLU as one operation each, grouped-query
//! attention tiled or with its probabilities kept, and the head with its
//! loss plain or fused over row chunks.

mod config;

pub use config::{ConfigError, Family, LlamaConfig, CONFIG_FILE, MAX_CONFIG_FILE};

use candle_checkpoint::{add_grad, Checkpointed, Observer, Sequential};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor, Var};
use candle_lean_nn::{Activation, LeanLinear, LinearCrossEntropy};
use candle_tiled_attention::{
    flash_attention, materialized_attention, naive_attention, FlashConfig,
};
use serde::{Deserialize, Serialize};

use crate::Rng;

/// How the attention runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Attention {
    /// Tiled (FlashAttention's schedule): each row's log-sum-exp kept, the
    /// probabilities recomputed in the backward.
    Tiled,
    /// The probabilities `(batch, heads, seq, seq)` kept for the backward.
    Materialized,
}

/// How the head and the loss run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Loss {
    /// The whole logits `(tokens, vocab)`, then the cross-entropy.
    Plain,
    /// [`LinearCrossEntropy`]: a chunk of rows at a time, the logits never
    /// whole.
    Fused,
}

/// Which layers compute the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Layers {
    /// Compositions of candle's operations (candle-nn's `rms_norm_slow`,
    /// `rope_slow`, `silu`, a product and a broadcast bias, the attention's
    /// scores and softmax whole, `candle_nn::loss::cross_entropy`): what a
    /// candle user writes first, the framework-cost baseline. The
    /// attention and loss options do not apply.
    Candle,
    /// The toolkit's one-operation layers.
    Lean,
}

/// How a step runs: the layers, the compute dtype (the parameters stay in
/// theirs), the attention and the loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepOptions {
    /// The layers.
    pub layers: Layers,
    /// The dtype the forward and backward compute in. Parameters kept in
    /// another dtype (f32 masters) are cast for each use, and their
    /// gradients come back in theirs.
    pub compute: DType,
    /// The attention.
    pub attention: Attention,
    /// The head and loss.
    pub loss: Loss,
}

/// A projection `x W^T (+ b)`.
#[derive(Debug, Clone)]
struct Proj {
    weight: Var,
    bias: Option<Var>,
}

impl Proj {
    fn forward(&self, x: &Tensor, options: &StepOptions) -> Result<Tensor> {
        let dtype = options.compute;
        let w = self.weight.as_tensor().to_dtype(dtype)?;
        let bias = match &self.bias {
            Some(b) => Some(b.as_tensor().to_dtype(dtype)?),
            None => None,
        };
        match options.layers {
            Layers::Lean => LeanLinear::new(w, bias)?.forward_act(x, Activation::Identity),
            Layers::Candle => {
                let y = x.broadcast_matmul(&w.t()?)?;
                match bias {
                    Some(b) => y.broadcast_add(&b),
                    None => Ok(y),
                }
            }
        }
    }
}

/// An RMS norm of `x` with `weight` cast to the compute dtype.
fn rms_norm(x: &Tensor, weight: &Var, eps: f64, options: &StepOptions) -> Result<Tensor> {
    let w = weight.as_tensor().to_dtype(options.compute)?;
    match options.layers {
        Layers::Lean => candle_lean_nn::rms_norm(x, &w, eps),
        Layers::Candle => candle_nn::ops::rms_norm_slow(x, &w, eps as f32),
    }
}

fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, layers: Layers) -> Result<Tensor> {
    match layers {
        Layers::Lean => candle_lean_nn::rope(x, cos, sin),
        Layers::Candle => candle_nn::rotary_emb::rope_slow(x, cos, sin),
    }
}

#[derive(Debug, Clone)]
struct Block {
    attn_norm: Var,
    q: Proj,
    k: Proj,
    v: Proj,
    o: Proj,
    mlp_norm: Var,
    gate: Proj,
    up: Proj,
    down: Proj,
}

/// A Llama-family decoder with its variables.
#[derive(Debug, Clone)]
pub struct Llama {
    config: LlamaConfig,
    embed: Var,
    blocks: Vec<Block>,
    norm: Var,
    head: Option<Var>,
}

impl Llama {
    /// The decoder `config` describes, its variables in `dtype`: matrices
    /// normal with standard deviation 0.02 (the families'
    /// `initializer_range`), biases zero, norms one. Made in
    /// [`LlamaConfig::parameters`]' order.
    pub fn new(config: &LlamaConfig, dtype: DType, rng: &mut Rng, device: &Device) -> Result<Self> {
        let mut matrix = |rows: usize, cols: usize| -> Result<Var> {
            Var::from_tensor(&(rng.randn((rows, cols), device)? * 0.02)?.to_dtype(dtype)?)
        };
        let (h, d, i) = (config.hidden, config.head_dim, config.intermediate);
        let (q, kv) = (config.heads * d, config.kv_heads * d);
        let embed = matrix(config.vocab, h)?;
        let zeros = |n: usize| Var::zeros(n, dtype, device);
        let ones = |n: usize| Var::from_tensor(&Tensor::ones(n, dtype, device)?);
        let mut blocks = Vec::with_capacity(config.layers);
        for _ in 0..config.layers {
            let attn_norm = ones(h)?;
            let mut proj = |rows: usize, cols: usize, bias: bool| -> Result<Proj> {
                Ok(Proj {
                    weight: matrix(rows, cols)?,
                    bias: if bias { Some(zeros(rows)?) } else { None },
                })
            };
            let (qp, kp, vp) = (
                proj(q, h, config.qkv_bias)?,
                proj(kv, h, config.qkv_bias)?,
                proj(kv, h, config.qkv_bias)?,
            );
            let o = proj(h, q, config.o_bias)?;
            let mlp_norm = ones(h)?;
            let (gate, up, down) = (proj(i, h, false)?, proj(i, h, false)?, proj(h, i, false)?);
            blocks.push(Block {
                attn_norm,
                q: qp,
                k: kp,
                v: vp,
                o,
                mlp_norm,
                gate,
                up,
                down,
            });
        }
        let norm = ones(h)?;
        let head = if config.tied {
            None
        } else {
            Some(matrix(config.vocab, h)?)
        };
        Ok(Self {
            config: config.clone(),
            embed,
            blocks,
            norm,
            head,
        })
    }

    /// The shape it was built from.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// Every variable, in [`LlamaConfig::parameters`]' order.
    pub fn vars(&self) -> Vec<Var> {
        let mut out = vec![self.embed.clone()];
        let proj = |out: &mut Vec<Var>, p: &Proj| {
            out.push(p.weight.clone());
            out.extend(p.bias.clone());
        };
        for b in &self.blocks {
            out.push(b.attn_norm.clone());
            for p in [&b.q, &b.k, &b.v, &b.o] {
                proj(&mut out, p);
            }
            out.push(b.mlp_norm.clone());
            for p in [&b.gate, &b.up, &b.down] {
                proj(&mut out, p);
            }
        }
        out.push(self.norm.clone());
        out.extend(self.head.clone());
        out
    }

    /// Parameters counted from the variables.
    pub fn param_count(&self) -> u64 {
        self.vars().iter().map(|v| v.elem_count() as u64).sum()
    }

    /// The final norm's output `(batch * seq, hidden)` for `tokens` `(batch,
    /// seq)`, in the compute dtype.
    pub fn hidden_states(&self, tokens: &Tensor, options: &StepOptions) -> Result<Tensor> {
        let pass = Pass::new(&self.config, tokens, options)?;
        let mut x = self.embed(tokens, options)?;
        for block in &self.blocks {
            x = self.block(block, &x, &pass)?;
        }
        self.final_norm(&x, options)
    }

    /// The token embeddings `(batch, seq, hidden)` in the compute dtype.
    fn embed(&self, tokens: &Tensor, options: &StepOptions) -> Result<Tensor> {
        let (b, s) = tokens.dims2()?;
        self.embed
            .as_tensor()
            .to_dtype(options.compute)?
            .embedding(&tokens.flatten_all()?)?
            .reshape((b, s, self.config.hidden))
    }

    /// One block on the residual stream `x` `(batch, seq, hidden)`.
    fn block(&self, block: &Block, x: &Tensor, pass: &Pass) -> Result<Tensor> {
        let (c, options) = (&self.config, &pass.options);
        let (b, s, _) = x.dims3()?;
        let eps = c.rms_norm_eps;
        let heads = |t: Tensor, n: usize| -> Result<Tensor> {
            t.reshape((b, s, n, c.head_dim))?
                .transpose(1, 2)?
                .contiguous()
        };
        let n = rms_norm(x, &block.attn_norm, eps, options)?;
        let q = heads(block.q.forward(&n, options)?, c.heads)?;
        let k = heads(block.k.forward(&n, options)?, c.kv_heads)?;
        let v = heads(block.v.forward(&n, options)?, c.kv_heads)?;
        drop(n);
        let q = rope(&q, &pass.cos, &pass.sin, options.layers)?;
        let k = rope(&k, &pass.cos, &pass.sin, options.layers)?;
        let a = match (options.layers, options.attention) {
            (Layers::Candle, _) => naive_attention(&q, &k, &v, &pass.flash)?,
            (Layers::Lean, Attention::Tiled) => flash_attention(&q, &k, &v, &pass.flash)?,
            (Layers::Lean, Attention::Materialized) => {
                materialized_attention(&q, &k, &v, &pass.flash)?
            }
        };
        let a = a.transpose(1, 2)?.reshape((b, s, c.heads * c.head_dim))?;
        let x = (x + block.o.forward(&a, options)?)?;
        let n = rms_norm(&x, &block.mlp_norm, eps, options)?;
        let (g, u) = (
            block.gate.forward(&n, options)?,
            block.up.forward(&n, options)?,
        );
        let m = match options.layers {
            Layers::Lean => candle_lean_nn::swiglu(&g, &u)?,
            Layers::Candle => (candle_nn::ops::silu(&g)? * u)?,
        };
        x + block.down.forward(&m, options)?
    }

    /// The final norm of the last block's output, as `(batch * seq,
    /// hidden)` rows.
    fn final_norm(&self, x: &Tensor, options: &StepOptions) -> Result<Tensor> {
        let (b, s, h) = x.dims3()?;
        rms_norm(x, &self.norm, self.config.rms_norm_eps, options)?.reshape((b * s, h))
    }

    /// The head's weight `(vocab, hidden)`: the embedding's when tied.
    fn head_weight(&self) -> &Var {
        self.head.as_ref().unwrap_or(&self.embed)
    }

    /// The mean next-token cross-entropy of `tokens` `(batch, seq)` against
    /// `targets` `(batch, seq)`, a scalar in f32.
    pub fn loss(&self, tokens: &Tensor, targets: &Tensor, options: &StepOptions) -> Result<Tensor> {
        let hidden = self.hidden_states(tokens, options)?;
        self.head_loss(&hidden, targets, options)
    }

    /// The head and the loss on the final norm's rows `hidden`.
    fn head_loss(
        &self,
        hidden: &Tensor,
        targets: &Tensor,
        options: &StepOptions,
    ) -> Result<Tensor> {
        let w = self.head_weight().as_tensor().to_dtype(options.compute)?;
        let t = targets.flatten_all()?;
        let loss = match (options.layers, options.loss) {
            (Layers::Candle, _) => {
                let logits = hidden.matmul(&w.t()?)?.to_dtype(DType::F32)?;
                candle_nn::loss::cross_entropy(&logits, &t)?
            }
            (Layers::Lean, Loss::Plain) => {
                candle_lean_nn::cross_entropy(&hidden.matmul(&w.t()?)?, &t)?
            }
            (Layers::Lean, Loss::Fused) => LinearCrossEntropy::new().loss(hidden, &w, &t)?,
        };
        loss.to_dtype(DType::F32)
    }

    /// The loss of `tokens` against `targets` scaled by `weight`, with the
    /// gradients of [`Llama::vars`], by activation checkpointing: the
    /// forward keeps only each block's input, and the backward runs each
    /// block again from it, last first, the embedding and every block a
    /// layer of its own. `weight` is a micro-batch's share of its batch's
    /// rows, or 1. `observer` is told of each block's forward and backward
    /// (`&NoObserver` for none). A tied embedding's two gradients are
    /// summed.
    pub fn checkpointed_backward(
        &self,
        tokens: &Tensor,
        targets: &Tensor,
        options: &StepOptions,
        weight: f64,
        observer: &dyn Observer,
    ) -> Result<Checkpointed> {
        let mut grads = GradStore::default();
        let loss = self.checkpointed_backward_with(
            tokens,
            targets,
            options,
            weight,
            |var, g| add_grad(&mut grads, var, g),
            observer,
        )?;
        Ok(Checkpointed {
            loss,
            grads,
            input_grad: None,
        })
    }

    /// [`Llama::checkpointed_backward`], each gradient handed to `on_grad`
    /// as soon as its layer's backward is done ([`candle_checkpoint::Sequential::each_layer`]), so
    /// that the device never holds more than one layer's gradients when
    /// `on_grad` moves them away (ZeRO-2's reduce-scatter, an offloaded
    /// optimizer). A tied embedding's gradient is handed over twice, for
    /// the head and for the lookup: sum them. Returns the scaled loss.
    pub fn checkpointed_backward_with(
        &self,
        tokens: &Tensor,
        targets: &Tensor,
        options: &StepOptions,
        weight: f64,
        on_grad: impl FnMut(&Var, Tensor) -> Result<()>,
        observer: &dyn Observer,
    ) -> Result<Tensor> {
        let pass = Pass::new(&self.config, tokens, options)?;
        let mut layers: Vec<Segment<'_>> = Vec::with_capacity(self.blocks.len() + 1);
        layers.push(Box::new(|t| self.embed(t, options)));
        for block in &self.blocks {
            let pass = &pass;
            layers.push(Box::new(move |x| self.block(block, x, pass)));
        }
        let head = |x: &Tensor| {
            self.head_loss(&self.final_norm(x, options)?, targets, options)?
                .affine(weight, 0.)
        };
        Sequential::new(&layers)
            .each_layer()
            .observer(observer)
            .backward_with(tokens, &self.vars(), head, on_grad)
            .map(|(loss, _)| loss)
    }

    /// Logits `(batch * seq, vocab)` of `tokens`, for checking the model
    /// against a plain composition.
    pub fn logits(&self, tokens: &Tensor, options: &StepOptions) -> Result<Tensor> {
        let hidden = self.hidden_states(tokens, options)?;
        let w = self.head_weight().as_tensor().to_dtype(options.compute)?;
        hidden.matmul(&w.t()?)
    }
}

/// One layer of a checkpointed step: the embedding or a block.
type Segment<'a> = Box<dyn Fn(&Tensor) -> Result<Tensor> + 'a>;

/// What every block of one forward shares: the rotary tables for its
/// length, the attention's configuration and the step's options.
struct Pass {
    cos: Tensor,
    sin: Tensor,
    flash: FlashConfig,
    options: StepOptions,
}

impl Pass {
    fn new(c: &LlamaConfig, tokens: &Tensor, options: &StepOptions) -> Result<Self> {
        let (_, s) = tokens.dims2()?;
        if let Some(window) = c.sliding_window.filter(|w| s > *w) {
            candle_core::bail!(
                "sequences of {s} tokens are longer than the attention window ({window}), which \
                 this model does not apply: use at most {window}"
            );
        }
        let (cos, sin) = candle_lean_nn::RopeConfig {
            positions: s,
            head_dim: c.head_dim,
            theta: c.rope_theta,
        }
        .tables(options.compute, tokens.device())?;
        Ok(Self {
            cos,
            sin,
            flash: FlashConfig::for_length(true, s),
            options: *options,
        })
    }
}
