//! A GPT-style decoder: token and position embeddings, blocks of layer norm,
//! causal multi-head attention and a GELU MLP with residuals, a final layer
//! norm and a head tied to the token embedding (or, with
//! [`GptConfig::tied_head`] false, a table of its own).

use std::sync::Arc;

mod config;
mod direct;
mod recipe;

pub use config::{AttentionKind, GptConfig, StepFields};
pub use direct::{BlockSaved, DirectSaved, DirectStage};
pub use recipe::Recipe;

use crate::Rng;
use candle_checkpoint::{Tape, TapeModule};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Module, Result, Tensor, Var};
use candle_distributed::{Comm, ShardedLinear, ShardedParam};
use candle_lean_nn::{Activation, LeanLinear};
use candle_ledger::Labeller;
use candle_tiled_attention::{
    flash_attention, materialized_attention, naive_attention, FlashConfig,
};
use workbook_sdk::Category;

/// Where the parameters live: whole in this process, or partitioned over
/// ranks under ZeRO stage 3 (each rank a block in f32, gathered for use).
#[derive(Clone)]
enum Placement {
    Whole,
    Sharded(Arc<Comm>),
}

impl Placement {
    /// A parameter made whole (equal on every rank), kept as placed.
    fn param(&self, whole: Tensor, device: &Device) -> Result<Param> {
        Ok(match self {
            Placement::Whole => Param::Whole(Var::from_tensor(&whole)?),
            Placement::Sharded(comm) => {
                Param::Sharded(ShardedParam::new(Arc::clone(comm), &whole, device)?)
            }
        })
    }
}

/// A parameter that is not a linear layer's: whole, or this rank's block.
#[derive(Debug, Clone)]
enum Param {
    Whole(Var),
    Sharded(ShardedParam),
}

impl Param {
    /// The whole parameter in `dtype` (the model's): the variable itself,
    /// or gathered from the ranks, its gradient reduce-scattered back.
    fn tensor(&self, dtype: DType) -> Result<Tensor> {
        match self {
            Param::Whole(v) => Ok(v.as_tensor().clone()),
            Param::Sharded(p) => p.gather(dtype),
        }
    }

    /// Elements of the whole parameter.
    fn elem_count(&self) -> usize {
        match self {
            Param::Whole(v) => v.elem_count(),
            Param::Sharded(p) => p.shape().elem_count(),
        }
    }

    /// What the optimizer updates.
    fn var(&self) -> Var {
        match self {
            Param::Whole(v) => v.clone(),
            Param::Sharded(p) => p.var().clone(),
        }
    }
}

/// A layer norm's scale and shift.
#[derive(Debug, Clone)]
struct Norm {
    weight: Param,
    bias: Param,
}

impl Norm {
    fn new(h: usize, dtype: DType, device: &Device, place: &Placement) -> Result<Self> {
        Ok(Self {
            weight: place.param(Tensor::ones(h, dtype, device)?, device)?,
            bias: place.param(Tensor::zeros(h, dtype, device)?, device)?,
        })
    }

    /// candle-nn's layer norm as differentiable operations (its fused
    /// kernel has no backward), or the toolkit's as one operation.
    fn forward(&self, x: &Tensor, lean: bool) -> Result<Tensor> {
        let (w, b) = (self.weight.tensor(x.dtype())?, self.bias.tensor(x.dtype())?);
        if lean {
            candle_lean_nn::layer_norm(x, &w, &b, 1e-5)
        } else {
            candle_nn::ops::layer_norm_slow(x, &w, &b, 1e-5)
        }
    }
}

/// A linear layer `x W^T + b` with GPT-2's initialisation: whole, or under
/// ZeRO stage 3 this rank's blocks, gathered for the forward and again for
/// the backward.
#[derive(Debug, Clone)]
enum Dense {
    Whole { weight: Var, bias: Var },
    Sharded(ShardedLinear),
}

impl Dense {
    fn new(
        rng: &mut Rng,
        (input, output): (usize, usize),
        dtype: DType,
        device: &Device,
        place: &Placement,
    ) -> Result<Self> {
        let w = (rng.randn((output, input), device)? * 0.02)?.to_dtype(dtype)?;
        let b = Tensor::zeros(output, dtype, device)?;
        Ok(match place {
            Placement::Whole => Dense::Whole {
                weight: Var::from_tensor(&w)?,
                bias: Var::from_tensor(&b)?,
            },
            Placement::Sharded(comm) => {
                Dense::Sharded(ShardedLinear::new(Arc::clone(comm), &w, Some(&b), device)?)
            }
        })
    }

    /// `act(x W^T + b)`: candle-nn's `Linear` and activation, or the lean
    /// layer's one operation; sharded, on weights gathered for it.
    fn forward(&self, x: &Tensor, gelu: bool, lean: bool) -> Result<Tensor> {
        let act = if gelu {
            Activation::Gelu
        } else {
            Activation::Identity
        };
        let (weight, bias) = match self {
            Dense::Whole { weight, bias } => (weight, bias),
            Dense::Sharded(linear) if lean => return linear.forward_act(x, act),
            Dense::Sharded(linear) => {
                let y = linear.forward(x)?;
                return if gelu { y.gelu() } else { Ok(y) };
            }
        };
        if lean {
            let layer =
                LeanLinear::new(weight.as_tensor().clone(), Some(bias.as_tensor().clone()))?;
            return layer.forward_act(x, act);
        }
        let linear =
            candle_nn::Linear::new(weight.as_tensor().clone(), Some(bias.as_tensor().clone()));
        let y = linear.forward(x)?;
        if gelu {
            y.gelu()
        } else {
            Ok(y)
        }
    }

    fn vars(&self) -> Vec<Var> {
        match self {
            Dense::Whole { weight, bias } => vec![weight.clone(), bias.clone()],
            Dense::Sharded(linear) => linear.vars(),
        }
    }

    /// Elements of the whole weight and bias.
    fn param_count(&self) -> usize {
        match self {
            Dense::Whole { weight, bias } => weight.elem_count() + bias.elem_count(),
            Dense::Sharded(linear) => linear.param_count(),
        }
    }
}

/// One of a model's parameters as it holds it: a norm's or embedding's, or
/// a linear layer's weight and bias.
#[derive(Clone, Copy)]
enum Part<'a> {
    Param(&'a Param),
    Dense(&'a Dense),
}

impl Part<'_> {
    /// What the optimizer updates.
    fn vars(self) -> Vec<Var> {
        match self {
            Part::Param(p) => vec![p.var()],
            Part::Dense(d) => d.vars(),
        }
    }

    /// Elements of the whole parameters.
    fn param_count(self) -> usize {
        match self {
            Part::Param(p) => p.elem_count(),
            Part::Dense(d) => d.param_count(),
        }
    }
}

/// One transformer block.
#[derive(Debug, Clone)]
struct Block {
    ln1: Norm,
    qkv: Dense,
    proj: Dense,
    ln2: Norm,
    fc: Dense,
    fc2: Dense,
}

/// A GPT-style decoder. See the module's docs.
#[derive(Debug, Clone)]
pub struct Gpt {
    config: GptConfig,
    wte: Param,
    wpe: Param,
    blocks: Vec<Block>,
    ln_f: Norm,
    /// The head's own table `(v, h)`; `None` when it is tied to `wte`.
    lm_head: Option<Param>,
    dtype: DType,
}

impl Gpt {
    /// A model of `config` with parameters in `dtype`, initialised as GPT-2
    /// (weights normal with deviation 0.02, biases 0, norms 1 and 0) from
    /// `rng`. Its allocations are tagged [`Category::Parameters`].
    pub fn new(config: GptConfig, dtype: DType, rng: &mut Rng, device: &Device) -> Result<Self> {
        Self::placed(config, dtype, rng, device, Placement::Whole)
    }

    /// The same model (equal to [`Gpt::new`]'s from the same `rng`) under
    /// ZeRO stage 3 on `comm`: each rank keeps a `1/N` block of every
    /// parameter in f32, the master weights, which [`Gpt::vars`] returns.
    /// The linear layers gather their weights for the forward and again
    /// for the backward and hand their gradient blocks to
    /// [`Gpt::take_grads_into`]; the embeddings and norms are gathered for
    /// the forward and held by the graph until the backward, which puts
    /// their gradient blocks in candle's store. The direct backward
    /// ([`Gpt::direct_loss_with`]) instead gathers each stage's parameters
    /// for its forward and again for its backward and hands every block's
    /// gradient to its caller. Each parameter is made whole (in `dtype`)
    /// and partitioned before the next is made.
    pub fn sharded(
        config: GptConfig,
        dtype: DType,
        rng: &mut Rng,
        device: &Device,
        comm: Arc<Comm>,
    ) -> Result<Self> {
        Self::placed(config, dtype, rng, device, Placement::Sharded(comm))
    }

    fn placed(
        config: GptConfig,
        dtype: DType,
        rng: &mut Rng,
        device: &Device,
        place: Placement,
    ) -> Result<Self> {
        if config.heads == 0 || !config.hidden.is_multiple_of(config.heads) {
            candle_core::bail!(
                "hidden size {} is not a multiple of {} heads",
                config.hidden,
                config.heads
            );
        }
        let _params = Category::Parameters.enter();
        let (h, v, s) = (config.hidden, config.vocab, config.seq);
        let table = |rng: &mut Rng, rows: usize| -> Result<Param> {
            place.param(
                (rng.randn((rows, h), device)? * 0.02)?.to_dtype(dtype)?,
                device,
            )
        };
        let wte = table(rng, v)?;
        let wpe = table(rng, s)?;
        let blocks = (0..config.layers)
            .map(|_| {
                Ok(Block {
                    ln1: Norm::new(h, dtype, device, &place)?,
                    qkv: Dense::new(rng, (h, 3 * h), dtype, device, &place)?,
                    proj: Dense::new(rng, (h, h), dtype, device, &place)?,
                    ln2: Norm::new(h, dtype, device, &place)?,
                    fc: Dense::new(rng, (h, 4 * h), dtype, device, &place)?,
                    fc2: Dense::new(rng, (4 * h, h), dtype, device, &place)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let ln_f = Norm::new(h, dtype, device, &place)?;
        // Drawn last: a tied model's weights are the same whatever follows.
        let lm_head = (!config.tied_head).then(|| table(rng, v)).transpose()?;
        Ok(Self {
            config,
            wte,
            wpe,
            blocks,
            ln_f,
            lm_head,
            dtype,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &GptConfig {
        &self.config
    }

    /// The parameters' dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Every parameter as the model holds it, in one order: the tables,
    /// each block's norms and linear layers, the final norm, the head's
    /// table when it has its own.
    fn parts(&self) -> Vec<Part<'_>> {
        let mut parts = vec![Part::Param(&self.wte), Part::Param(&self.wpe)];
        for b in &self.blocks {
            parts.extend([
                Part::Param(&b.ln1.weight),
                Part::Param(&b.ln1.bias),
                Part::Dense(&b.qkv),
                Part::Dense(&b.proj),
                Part::Param(&b.ln2.weight),
                Part::Param(&b.ln2.bias),
                Part::Dense(&b.fc),
                Part::Dense(&b.fc2),
            ]);
        }
        parts.extend([Part::Param(&self.ln_f.weight), Part::Param(&self.ln_f.bias)]);
        parts.extend(self.lm_head.as_ref().map(Part::Param));
        parts
    }

    /// The head's table: its own, or the token embedding's.
    fn head_table(&self) -> &Param {
        self.lm_head.as_ref().unwrap_or(&self.wte)
    }

    /// The head's weight for a forward through the graph: `wte` itself
    /// when tied (the table the embedding used, gathered once under ZeRO
    /// stage 3), else the head's own.
    fn head_weight(&self, wte: &Tensor) -> Result<Tensor> {
        match &self.lm_head {
            None => Ok(wte.clone()),
            Some(table) => table.tensor(self.dtype),
        }
    }

    /// Every trainable variable (under ZeRO stage 3, this rank's blocks).
    pub fn vars(&self) -> Vec<Var> {
        self.parts().into_iter().flat_map(Part::vars).collect()
    }

    /// Parameters, counted from the tensors the model made (under ZeRO
    /// stage 3, the whole parameters its blocks are of).
    pub fn param_count(&self) -> u64 {
        self.parts()
            .into_iter()
            .map(Part::param_count)
            .sum::<usize>() as u64
    }

    /// Whether the parameters are partitioned over ranks (ZeRO stage 3).
    pub fn is_sharded(&self) -> bool {
        matches!(self.wte, Param::Sharded(_))
    }

    /// Under ZeRO stage 3, moves the linear layers' gradient blocks reduced
    /// by candle's backwards since the last call into `store` (the other
    /// parameters' are in the store candle's backward returns), replacing
    /// any held there; nothing for a whole model, nor after a direct
    /// backward, which hands every block to its caller.
    pub fn take_grads_into(&self, store: &mut GradStore) {
        for part in self.parts() {
            if let Part::Dense(Dense::Sharded(linear)) = part {
                linear.take_grads_into(store);
            }
        }
    }

    /// The logits `(b·s, v)` for `tokens` `(b, s)`, each part labelled in
    /// `labels` (block index and part; embeddings and head have no block).
    pub fn logits(&self, tokens: &Tensor, labels: &Labeller) -> Result<Tensor> {
        // A tied table, gathered once under ZeRO stage 3 for both uses.
        let wte = self.wte.tensor(self.dtype)?;
        let mut x = self.embed(tokens, labels, &wte)?;
        for i in 0..self.blocks.len() {
            x = self.block(i, &x, labels, None)?;
        }
        self.head(&x, labels, &self.head_weight(&wte)?)
    }

    /// [`Gpt::logits`] with the blocks' products through `tape` (see
    /// [`GptLayer`]): the computation checkpointing policies apply to.
    pub fn logits_taped(&self, tokens: &Tensor, labels: &Labeller, tape: &Tape) -> Result<Tensor> {
        let wte = self.wte.tensor(self.dtype)?;
        let mut x = self.embed(tokens, labels, &wte)?;
        for i in 0..self.blocks.len() {
            x = self.block(i, &x, labels, Some(tape))?;
        }
        self.head(&x, labels, &self.head_weight(&wte)?)
    }

    /// The token and position embeddings of `tokens` `(b, s)`: `(b, s, h)`,
    /// `wte` the token table (the variable, or gathered).
    fn embed(&self, tokens: &Tensor, labels: &Labeller, wte: &Tensor) -> Result<Tensor> {
        let (b, s) = tokens.dims2()?;
        let c = &self.config;
        if s > c.seq {
            candle_core::bail!("{s} tokens, the model's positions stop at {}", c.seq);
        }
        let positions = self.wpe.tensor(self.dtype)?.narrow(0, 0, s)?;
        let x = wte
            .embedding(&tokens.flatten_all()?)?
            .reshape((b, s, c.hidden))?
            .broadcast_add(&positions)?;
        Ok(labels.label(x, None, "embedding"))
    }

    /// Block `i` on the residual stream `x` `(b, s, h)`. With a `tape`, its
    /// four products (named `qkv`, `proj`, `fc`, `fc2`) go through it, so a
    /// checkpointing policy can keep them; the bias and GELU are then
    /// candle's operations.
    fn block(
        &self,
        i: usize,
        x: &Tensor,
        labels: &Labeller,
        tape: Option<&Tape>,
    ) -> Result<Tensor> {
        let (b, s, h) = x.dims3()?;
        let c = &self.config;
        let (a, lean) = (c.heads, c.lean);
        let d = h / a;
        let blk = &self.blocks[i];
        let dense = |name: &str, layer: &Dense, x: &Tensor, gelu: bool| -> Result<Tensor> {
            match (tape, layer) {
                // A sharded layer's weight exists only while it computes:
                // no tape can keep its product.
                (Some(tape), Dense::Whole { weight, bias }) => {
                    let y = tape.named_linear(
                        Some(name),
                        x,
                        weight.as_tensor(),
                        Some(bias.as_tensor()),
                    )?;
                    if gelu {
                        y.gelu()
                    } else {
                        Ok(y)
                    }
                }
                _ => layer.forward(x, gelu, lean),
            }
        };
        // The lean model adds on the pool its products and kernels run on;
        // candle-nn's on candle's own (see `candle_lean_nn::add`).
        let residual = |x: &Tensor, y: &Tensor| {
            if lean {
                candle_lean_nn::add(x, y)
            } else {
                x + y
            }
        };
        let l = Some(i);
        let n = labels.label(blk.ln1.forward(x, lean)?, l, "ln1");
        let qkv = labels.label(dense("qkv", &blk.qkv, &n, false)?, l, "qkv");
        // (b, s, 3, a, d) -> (3, b, a, s, d), one copy: q, k and v are then
        // contiguous views of it.
        let qkv = qkv
            .reshape((b, s, 3, a, d))?
            .permute((2, 0, 3, 1, 4))?
            .contiguous()?;
        let (q, k, v) = (qkv.get(0)?, qkv.get(1)?, qkv.get(2)?);
        let attn_cfg = FlashConfig::for_length(true, s);
        let y = match c.attention {
            AttentionKind::Naive => naive_attention(&q, &k, &v, &attn_cfg)?,
            AttentionKind::Materialized => materialized_attention(&q, &k, &v, &attn_cfg)?,
            AttentionKind::Tiled => flash_attention(&q, &k, &v, &attn_cfg)?,
        };
        let y = labels.label(y, l, "attention");
        let y = y.transpose(1, 2)?.reshape((b, s, h))?;
        let y = labels.label(dense("proj", &blk.proj, &y, false)?, l, "proj");
        let x = labels.label(residual(x, &y)?, l, "residual");
        let n = labels.label(blk.ln2.forward(&x, lean)?, l, "ln2");
        let m = match tape {
            // Through a tape the product and the GELU are two operations,
            // timed and counted apart.
            Some(_) => {
                let m = labels.label(dense("fc", &blk.fc, &n, false)?, l, "fc");
                labels.label(m.gelu()?, l, "gelu")
            }
            None => labels.label(dense("fc", &blk.fc, &n, true)?, l, "fc+gelu"),
        };
        let m = labels.label(dense("fc2", &blk.fc2, &m, false)?, l, "fc2");
        Ok(labels.label(residual(&x, &m)?, l, "residual"))
    }

    /// The final norm and the head on the table `table` `(v, h)`: the
    /// logits `(b·s, v)`.
    fn head(&self, x: &Tensor, labels: &Labeller, table: &Tensor) -> Result<Tensor> {
        let (b, s, h) = x.dims3()?;
        let x = labels.label(self.ln_f.forward(x, self.config.lean)?, None, "ln_f");
        let logits = x.reshape((b * s, h))?.matmul(&table.t()?)?;
        Ok(labels.label(logits, None, "head"))
    }

    /// The model as a stack for `candle-checkpoint`: the embeddings (token
    /// ids in), then each block; [`Gpt::head_loss`] closes it.
    pub fn stack(&self) -> Vec<GptLayer<'_>> {
        std::iter::once(GptLayer::Embedding(self))
            .chain((0..self.blocks.len()).map(|i| GptLayer::Block(self, i)))
            .collect()
    }

    /// The final norm, the head and the loss on the last block's output.
    /// Under ZeRO stage 3 it gathers a tied table again: the stack's
    /// embedding layer and the head are computed apart.
    pub fn head_loss(&self, x: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let table = self.head_table().tensor(self.dtype)?;
        let logits = self.head(x, &Labeller::default(), &table)?;
        self.cross_entropy(&logits, targets)
    }

    fn cross_entropy(&self, logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let targets = targets.flatten_all()?;
        if self.config.lean {
            candle_lean_nn::cross_entropy(logits, &targets)
        } else {
            candle_nn::loss::cross_entropy(&logits.to_dtype(DType::F32)?, &targets)
        }
    }

    /// The mean next-token cross-entropy of `tokens` `(b, s)` against
    /// `targets` `(b, s)`, computed in f32.
    pub fn loss(&self, tokens: &Tensor, targets: &Tensor, labels: &Labeller) -> Result<Tensor> {
        let logits = self.logits(tokens, labels)?;
        let loss = self.cross_entropy(&logits, targets)?;
        Ok(labels.label(loss, None, "loss"))
    }
}

/// One layer of a [`Gpt`] as a stack (see [`Gpt::stack`]).
#[derive(Debug, Clone, Copy)]
pub enum GptLayer<'a> {
    /// The token and position embeddings: token ids in, `(b, s, h)` out.
    Embedding(&'a Gpt),
    /// Block `i`: `(b, s, h)` in and out.
    Block(&'a Gpt, usize),
}

impl TapeModule for GptLayer<'_> {
    fn forward_t(&self, x: &Tensor, tape: &Tape) -> Result<Tensor> {
        match *self {
            GptLayer::Embedding(gpt) => {
                gpt.embed(x, &Labeller::default(), &gpt.wte.tensor(gpt.dtype)?)
            }
            GptLayer::Block(gpt, i) => gpt.block(i, x, &Labeller::default(), Some(tape)),
        }
    }
}

impl Module for GptLayer<'_> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_t(x, &Tape::plain())
    }
}

#[doc(hidden)]
pub mod testing;

#[cfg(test)]
mod tests {
    use super::testing::{assert_close, gradients, SMALL};
    use super::*;

    #[test]
    fn param_sizes_are_the_variables_in_order() -> Result<()> {
        let config = GptConfig {
            layers: 2,
            hidden: 8,
            heads: 2,
            seq: 5,
            vocab: 11,
            ..GptConfig::default()
        };
        for tied_head in [true, false] {
            let config = GptConfig {
                tied_head,
                ..config
            };
            let model = Gpt::new(config, DType::F32, &mut Rng::seeded(1), &Device::Cpu)?;
            let made: Vec<usize> = model.vars().iter().map(|v| v.elem_count()).collect();
            assert_eq!(config.param_sizes(), made, "tied head {tied_head}");
            assert_eq!(made.iter().sum::<usize>() as u64, config.param_count());
            assert_eq!(model.param_count(), config.param_count());
        }
        // Sizes whose count passes u64 are `None`, never a wrapped count.
        let huge = GptConfig {
            layers: usize::MAX,
            ..config
        };
        assert_eq!(huge.checked_param_count(), None);
        assert_eq!(huge.param_count(), u64::MAX);
        Ok(())
    }

    /// Partitioned over one rank, every block is its whole parameter, so
    /// the gradients (gathered, reduce-scattered: a mean over one rank)
    /// equal the whole model's, on the plain path and the checkpointed one,
    /// with the lean layers and candle-nn's.
    #[test]
    fn a_model_sharded_over_one_rank_has_the_whole_models_gradients() -> Result<()> {
        let dev = Device::Cpu;
        for lean in [true, false] {
            let config = GptConfig { lean, ..SMALL };
            let whole = Gpt::new(config, DType::F32, &mut Rng::seeded(3), &dev)?;
            let comm = Arc::new(Comm::solo());
            let sharded = Gpt::sharded(config, DType::F32, &mut Rng::seeded(3), &dev, comm)?;
            assert!(sharded.is_sharded() && !whole.is_sharded());
            assert_eq!(sharded.param_count(), whole.param_count());
            let (x, y) = crate::corpus::batch(&mut Rng::seeded(4), 3, 6, 13, &dev)?;
            let plain = |m: &Gpt| -> Result<Vec<Vec<f32>>> {
                let store = m.loss(&x, &y, &Labeller::default())?.backward()?;
                gradients(m, store)
            };
            let want = plain(&whole)?;
            assert_close(&plain(&sharded)?, &want, &format!("plain, lean {lean}"));
            let checkpointed = |m: &Gpt| -> Result<Vec<Vec<f32>>> {
                let stack = m.stack();
                let head = |h: &Tensor| m.head_loss(h, &y);
                let out = candle_checkpoint::Sequential::taped(&stack)
                    .segments(stack.len())
                    .observer(&workbook_sdk::observe::Tags)
                    .backward(&x, &m.vars(), head)?;
                gradients(m, out.grads)
            };
            assert_close(
                &checkpointed(&sharded)?,
                &want,
                &format!("checkpointed, lean {lean}"),
            );
        }
        Ok(())
    }
}
