//! A small decoder-only transformer built from candle-nn layers and a
//! `VarBuilder`, its blocks computing through a checkpointing `Tape`, and a
//! synthetic next-token task it can learn: the model the toolkit crates are
//! tested on together (`tests/toolkit.rs`, `examples/train.rs`), and the
//! one chapter 2's selective-checkpointing policies run on.
//!
//! Pre-norm blocks: `h + attn(ln1(h))`, then `h + mlp(ln2(h))`, causal
//! multi-head attention (plain, or the tiled autograd op), an MLP with GELU.
//! Layer norm is written with candle's differentiable operations
//! (`candle_nn::ops::layer_norm_slow`): candle-nn's `LayerNorm` takes a fused
//! path without a backward on contiguous input.

use candle_checkpoint::{Tape, TapeModule};
use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::{embedding, linear, Embedding, Linear, VarBuilder, VarMap};
use candle_tiled_attention::{flash_attention, naive_attention, FlashConfig};

/// The model's sizes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Config {
    /// Tokens.
    pub vocab: usize,
    /// Model width.
    pub width: usize,
    /// Attention heads.
    pub heads: usize,
    /// Blocks.
    pub depth: usize,
    /// The tiled attention's blocks; `None` is the plain attention.
    pub tiled: Option<(usize, usize)>,
}

impl Config {
    /// A model small enough for a unit test.
    pub fn tiny() -> Self {
        Self {
            vocab: 32,
            width: 32,
            heads: 4,
            depth: 3,
            tiled: None,
        }
    }
}

/// Differentiable layer norm with a learned scale and shift.
#[derive(Debug, Clone)]
pub struct Norm {
    weight: Tensor,
    bias: Tensor,
}

impl Norm {
    fn new(width: usize, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            weight: vb.get_with_hints(width, "weight", candle_nn::Init::Const(1.0))?,
            bias: vb.get_with_hints(width, "bias", candle_nn::Init::Const(0.0))?,
        })
    }
}

impl Module for Norm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // In f32 for f16/bf16 input, as candle-nn's own slow path does.
        let dtype = x.dtype();
        let x32 = x.to_dtype(DType::F32)?;
        let y = candle_nn::ops::layer_norm_slow(
            &x32,
            &self.weight.to_dtype(DType::F32)?,
            &self.bias.to_dtype(DType::F32)?,
            1e-5,
        )?;
        y.to_dtype(dtype)
    }
}

/// One pre-norm transformer block: a [`Module`] from and to the residual
/// stream `(batch, seq, width)`.
#[derive(Debug, Clone)]
pub struct Block {
    ln1: Norm,
    qkv: Linear,
    proj: Linear,
    ln2: Norm,
    up: Linear,
    down: Linear,
    heads: usize,
    tiled: Option<(usize, usize)>,
}

impl Block {
    /// A block of `cfg`'s sizes from `vb`.
    pub fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        let w = cfg.width;
        Ok(Self {
            ln1: Norm::new(w, vb.pp("ln1"))?,
            qkv: linear(w, 3 * w, vb.pp("qkv"))?,
            proj: linear(w, w, vb.pp("proj"))?,
            ln2: Norm::new(w, vb.pp("ln2"))?,
            up: linear(w, 4 * w, vb.pp("up"))?,
            down: linear(4 * w, w, vb.pp("down"))?,
            heads: cfg.heads,
            tiled: cfg.tiled,
        })
    }

    /// The block with its products through `tape` (named `qkv`, `scores`,
    /// `mix`, `proj`, `up`, `down`), for selective checkpointing.
    fn forward_with(&self, h: &Tensor, tape: &Tape) -> Result<Tensor> {
        let lin =
            |name, l: &Linear, x: &Tensor| tape.named_linear(Some(name), x, l.weight(), l.bias());
        let x = self.ln1.forward(h)?;
        let (b, n, w) = x.dims3()?;
        let hd = w / self.heads;
        let (q, k, v) = split_heads(&lin("qkv", &self.qkv, &x)?, self.heads)?;
        let out = match self.tiled {
            // The tiled attention keeps no score matrix to begin with.
            Some((q_block, k_block)) => {
                let cfg = FlashConfig {
                    causal: true,
                    q_block,
                    k_block,
                    scale: None,
                };
                flash_attention(&q, &k, &v, &cfg)?
            }
            None => {
                let scores = (tape.named_matmul("scores", &q, &k.t()?)? / (hd as f64).sqrt())?;
                let mask = causal_mask(n, scores.dtype(), scores.device())?;
                let p = candle_nn::ops::softmax(&scores.broadcast_add(&mask)?, D::Minus1)?;
                tape.named_matmul("mix", &p, &v)?
            }
        };
        let out = out.transpose(1, 2)?.reshape((b, n, w))?;
        let h = (h + lin("proj", &self.proj, &out)?)?;
        let up = lin("up", &self.up, &self.ln2.forward(&h)?)?.gelu()?;
        h + lin("down", &self.down, &up)?
    }
}

/// The block through candle-nn's layers and the attention crate's
/// reference, independently of [`Block::forward_with`]: what the tape's
/// path is checked against.
impl Module for Block {
    fn forward(&self, h: &Tensor) -> Result<Tensor> {
        let x = self.ln1.forward(h)?;
        let (b, n, w) = x.dims3()?;
        let (q, k, v) = split_heads(&self.qkv.forward(&x)?, self.heads)?;
        let out = match self.tiled {
            Some((q_block, k_block)) => {
                let cfg = FlashConfig {
                    causal: true,
                    q_block,
                    k_block,
                    scale: None,
                };
                flash_attention(&q, &k, &v, &cfg)?
            }
            None => naive_attention(&q, &k, &v, &FlashConfig::causal(true))?,
        };
        let h = (h + self
            .proj
            .forward(&out.transpose(1, 2)?.reshape((b, n, w))?)?)?;
        let up = self.up.forward(&self.ln2.forward(&h)?)?.gelu()?;
        h + self.down.forward(&up)?
    }
}

/// The fused projection `(batch, seq, 3 * width)` as queries, keys and
/// values `(batch, heads, seq, head_dim)`.
fn split_heads(qkv: &Tensor, heads: usize) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, n, w3) = qkv.dims3()?;
    let qkv = qkv.reshape((b, n, 3, heads, w3 / 3 / heads))?;
    let part = |i| {
        qkv.narrow(2, i, 1)?
            .squeeze(2)?
            .transpose(1, 2)?
            .contiguous()
    };
    Ok((part(0)?, part(1)?, part(2)?))
}

/// A layer of the stack as a [`Module`]: the token embedding (from ids) or
/// a block (from the residual stream), so that the whole stack can be
/// checkpointed in segments.
#[derive(Debug, Clone)]
pub enum Layer {
    /// Token ids `(batch, seq)` to the residual stream.
    Embed(Embedding),
    /// A transformer block.
    Block(Box<Block>),
}

impl Module for Layer {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Layer::Embed(e) => e.forward(x),
            Layer::Block(b) => b.forward(x),
        }
    }
}

impl TapeModule for Layer {
    fn forward_t(&self, x: &Tensor, tape: &Tape) -> Result<Tensor> {
        match self {
            Layer::Embed(e) => e.forward(x),
            Layer::Block(b) => b.forward_with(x, tape),
        }
    }
}

/// The additive causal mask `(n, n)`: 0 on and below the diagonal, minus
/// infinity above.
fn causal_mask(n: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let data: Vec<f32> = (0..n)
        .flat_map(|i| (0..n).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Tensor::from_vec(data, (n, n), device)?.to_dtype(dtype)
}

/// The transformer: embedding, blocks, final norm and the head.
#[derive(Debug, Clone)]
pub struct Transformer {
    layers: Vec<Layer>,
    ln_f: Norm,
    head: Linear,
}

impl Transformer {
    /// A model of `cfg`'s sizes from `vb` (a `VarMap`'s builder, or
    /// `candle_amp::MasterWeights::var_builder` for mixed precision).
    pub fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        let mut layers = vec![Layer::Embed(embedding(
            cfg.vocab,
            cfg.width,
            vb.pp("embed"),
        )?)];
        for i in 0..cfg.depth {
            layers.push(Layer::Block(Box::new(Block::new(
                cfg,
                vb.pp(format!("block{i}")),
            )?)));
        }
        Ok(Self {
            layers,
            ln_f: Norm::new(cfg.width, vb.pp("ln_f"))?,
            head: linear(cfg.width, cfg.vocab, vb.pp("head"))?,
        })
    }

    /// A model of `cfg`'s sizes in f32 on `device`, its variables added to
    /// `map` and their values drawn by [`seed_weights`] from `seed`: the same
    /// model for the same seed on every run.
    pub fn seeded(cfg: &Config, seed: u64, map: &VarMap, device: &Device) -> Result<Self> {
        let model = Self::new(cfg, VarBuilder::from_varmap(map, DType::F32, device))?;
        seed_weights(map, seed)?;
        Ok(model)
    }

    /// The embedding and the blocks, in order.
    pub fn layers(&self) -> &[Layer] {
        &self.layers
    }

    /// The mean cross-entropy of the next-token logits of the residual
    /// stream `h` against `targets` `(batch, seq)`, computed in f32.
    pub fn loss(&self, h: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let logits = self.head.forward(&self.ln_f.forward(h)?)?;
        let (b, n, v) = logits.dims3()?;
        let logits = logits.to_dtype(DType::F32)?.reshape((b * n, v))?;
        candle_nn::loss::cross_entropy(&logits, &targets.flatten_all()?)
    }

    /// The plain forward and loss, without checkpointing.
    pub fn forward_loss(&self, ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let h = self
            .layers
            .iter()
            .try_fold(ids.clone(), |h, l| l.forward(&h))?;
        self.loss(&h, targets)
    }
}

/// A batch of the synthetic task: each row counts up from a random start
/// by a random stride, modulo the vocabulary; the target is the next token.
/// Deterministic in `seed`.
pub fn batch(
    seed: u64,
    rows: usize,
    seq: usize,
    vocab: usize,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    // A small LCG: reproducible without a random-number crate.
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut next = || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) as usize
    };
    let mut ids = Vec::with_capacity(rows * (seq + 1));
    for _ in 0..rows {
        let (start, stride) = (next() % vocab, 1 + next() % 3);
        ids.extend((0..=seq).map(|i| ((start + i * stride) % vocab) as u32));
    }
    let all = Tensor::from_vec(ids, (rows, seq + 1), device)?;
    Ok((all.narrow(1, 0, seq)?, all.narrow(1, 1, seq)?.contiguous()?))
}

/// Overwrites the weights of `map` with values drawn from `seed` (candle's
/// CPU generator cannot be seeded): linear weights and biases uniform in
/// `±1/sqrt(fan_in)` as PyTorch's `nn.Linear`, embeddings uniform with unit
/// variance; layer norms keep their ones and zeros.
pub fn seed_weights(map: &VarMap, seed: u64) -> Result<()> {
    let mut vars: Vec<(String, candle_core::Var)> = map
        .data()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let mut state = seed ^ 0x9e37_79b9_7f4a_7c15;
    let mut uniform = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
    };
    for (name, var) in vars {
        if name.contains(".ln") || name.starts_with("ln_f") {
            continue;
        }
        let bound = if name.starts_with("embed") {
            3f64.sqrt()
        } else {
            let weight = name.trim_end_matches("bias").to_string() + "weight";
            let fan_in = map
                .data()
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&weight)
                .map(|w| w.dim(1))
                .transpose()?
                .unwrap_or(1);
            1.0 / (fan_in as f64).sqrt()
        };
        let data: Vec<f32> = (0..var.elem_count())
            .map(|_| (uniform() * bound) as f32)
            .collect();
        var.set(&Tensor::from_vec(data, var.shape(), var.device())?.to_dtype(var.dtype())?)?;
    }
    Ok(())
}
