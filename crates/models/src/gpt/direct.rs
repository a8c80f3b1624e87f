//! The GPT's backward without candle's graph: each stage's forward keeps
//! what its backward needs and the backward runs stage by stage from the
//! loss down (`candle_checkpoint::Sequential::direct` (`backward_with`)), freeing each
//! saved tensor once it is used and handing each parameter's gradient over
//! as soon as it exists.
//!
//! A block keeps its layer norms' statistics (two numbers per row) and the
//! second norm's input (the residual stream after the attention; the first
//! norm's is the block's input, which the driver keeps), the inputs of its
//! four products, the attention's `q`, `k`, `v` with its probabilities
//! (materialized) or its output and log-sum-exp (tiled), and GELU's input:
//! what PyTorch's autograd keeps for the same block, where candle's graph
//! also sums every gradient into a zeros tensor of its own.
//!
//! Under ZeRO stage 3 no stage keeps a parameter: each gathers its own for
//! the forward and again for the backward, as FSDP does.

use candle_checkpoint::{add_grad, Checkpointed, Observer, Sequential};
use candle_core::backprop::GradStore;
use candle_core::{bail, DType, Result, Tensor, Var};
use candle_custom_grad::{DirectBackward, DirectGrads};
use candle_lean_nn::{
    add, cross_entropy_and_grad, layer_norm_backward, layer_norm_saved, linear_backward,
    Activation, Kept, LeanLinear, NormStats,
};
use candle_tiled_attention::{
    flash_forward, materialized_forward, pack_heads, FlashConfig, Forward, Materialized,
};

use super::{AttentionKind, Dense, Gpt, Norm, Param};

/// One stage of a [`Gpt`] for the direct backward: the embeddings (token
/// ids in), a block, or the final norm with the head (logits out).
#[derive(Debug, Clone, Copy)]
pub enum DirectStage<'a> {
    /// Token and position embeddings.
    Embedding(&'a Gpt),
    /// Block `i`.
    Block(&'a Gpt, usize),
    /// The final layer norm and the head (on the token table when tied).
    Head(&'a Gpt),
}

/// What a stage's forward keeps for its backward.
#[derive(Debug)]
pub enum DirectSaved {
    /// The embeddings need only the token ids, their input.
    Embedding,
    /// A block's saved tensors.
    Block(Box<BlockSaved>),
    /// The final norm's statistics and output (the head's input).
    Head {
        /// The final norm's statistics.
        stats: NormStats,
        /// Its output, `(b·s, h)`.
        normed: Tensor,
    },
}

impl DirectSaved {
    /// Every tensor it holds, each once, with the part of the model that
    /// made it (as [`Gpt::logits`] labels its graph's): the direct step's
    /// ledger. The views the backward reads (q, k and v of the stacked
    /// projection, the tiled attention's output as the projection's input)
    /// share these tensors' storage and are not listed again.
    pub fn parts(&self) -> Vec<(&'static str, &Tensor)> {
        match self {
            DirectSaved::Embedding => Vec::new(),
            DirectSaved::Block(s) => {
                let mut parts = vec![
                    ("ln1", s.ln1.mean()),
                    ("ln1", s.ln1.rstd()),
                    ("ln1", &s.n1),
                    ("qkv", &s.qkv),
                ];
                parts.push(match &s.attention {
                    Attention::Materialized(m) => ("attention", &m.probs),
                    Attention::Tiled(f) => ("attention", &f.lse),
                });
                parts.extend([
                    ("attention", &s.y),
                    ("residual", &s.x2),
                    ("ln2", s.ln2.mean()),
                    ("ln2", s.ln2.rstd()),
                    ("ln2", &s.n2),
                ]);
                if let Some(z) = s.gelu_in.tensor() {
                    parts.push(("fc", z));
                }
                parts.push(("fc+gelu", &s.m));
                parts
            }
            DirectSaved::Head { stats, normed } => {
                vec![
                    ("ln_f", stats.mean()),
                    ("ln_f", stats.rstd()),
                    ("ln_f", normed),
                ]
            }
        }
    }
}

/// What a block's forward keeps.
#[derive(Debug)]
pub struct BlockSaved {
    ln1: NormStats,
    n1: Tensor,
    /// `(3, b, a, s, d)`: q, k and v, contiguous.
    qkv: Tensor,
    attention: Attention,
    /// The attention's output as the projection's input, `(b, s, h)`.
    y: Tensor,
    /// The residual stream after the attention.
    x2: Tensor,
    ln2: NormStats,
    n2: Tensor,
    /// GELU's input.
    gelu_in: Kept,
    /// The MLP's hidden activations, `fc2`'s input.
    m: Tensor,
}

/// What an attention's backward needs besides q, k and v.
#[derive(Debug)]
enum Attention {
    Materialized(Materialized),
    Tiled(Forward),
}

impl Param {
    /// The whole parameter with no graph: the variable's tensor (in the
    /// model's dtype), or under ZeRO stage 3 gathered from the ranks in
    /// `dtype` (and dropped by the caller once used: the backward gathers
    /// it again).
    fn whole(&self, dtype: DType) -> Result<Tensor> {
        match self {
            Param::Whole(v) => Ok(v.as_tensor().clone()),
            Param::Sharded(p) => p.gather_detached(dtype),
        }
    }

    /// Hands `grad`, the whole parameter's gradient, to the driver: as it
    /// is, or under ZeRO stage 3 reduce-scattered into this rank's block
    /// (the mean over the ranks), the block's variable's gradient.
    fn give(&self, grad: Tensor, params: &mut Vec<(Tensor, Tensor)>) -> Result<()> {
        match self {
            Param::Whole(v) => params.push((v.as_tensor().clone(), grad)),
            Param::Sharded(p) => {
                let block = p.reduce_gradient(&grad)?;
                drop(grad);
                params.push((p.var().as_tensor().clone(), block));
            }
        }
        Ok(())
    }
}

/// A linear layer's weight and bias as parameters.
fn dense_params(dense: &Dense) -> Result<(Param, Param)> {
    Ok(match dense {
        Dense::Whole { weight, bias } => (Param::Whole(weight.clone()), Param::Whole(bias.clone())),
        Dense::Sharded(layer) => {
            let Some(bias) = layer.bias_param() else {
                bail!("internal: a sharded linear layer of the GPT without its bias");
            };
            (Param::Sharded(layer.weight_param()), Param::Sharded(bias))
        }
    })
}

/// A linear layer on its whole weights in `dtype`, for a direct forward.
fn lean(dense: &Dense, dtype: DType) -> Result<LeanLinear> {
    let (w, b) = dense_params(dense)?;
    LeanLinear::new(w.whole(dtype)?, Some(b.whole(dtype)?))
}

fn norm_saved(n: &Norm, x: &Tensor) -> Result<(Tensor, NormStats)> {
    let dtype = x.dtype();
    layer_norm_saved(x, &n.weight.whole(dtype)?, &n.bias.whole(dtype)?, 1e-5)
}

/// A layer norm's backward: the input's gradient, the weight's and bias's
/// handed to `params`.
fn norm_backward(
    n: &Norm,
    x: &Tensor,
    stats: &NormStats,
    grad: &Tensor,
    params: &mut Vec<(Tensor, Tensor)>,
) -> Result<Tensor> {
    let w = n.weight.whole(x.dtype())?;
    let (dx, dw, db) = layer_norm_backward(x, &w, stats, grad)?;
    drop(w);
    n.weight.give(dw, params)?;
    n.bias.give(db, params)?;
    Ok(dx)
}

/// A linear layer's backward (identity, or GELU from its kept input): the
/// input's gradient, the weight's and bias's handed to `params`.
fn dense_backward(
    dense: &Dense,
    kept: Kept,
    x: &Tensor,
    grad: Tensor,
    params: &mut Vec<(Tensor, Tensor)>,
) -> Result<Tensor> {
    let (w, b) = dense_params(dense)?;
    // The weight alone (the bias's gradient needs no bias), dropped once
    // the input's gradient exists: under ZeRO stage 3 a gathered one.
    let (dx, dw, db) = linear_backward(kept, x, w.whole(x.dtype())?, grad)?;
    w.give(dw, params)?;
    b.give(db, params)?;
    Ok(dx)
}

impl Gpt {
    /// The model as stages for [`candle_checkpoint::Sequential::direct`]: the
    /// embeddings, each block, the final norm and head.
    pub fn direct_stages(&self) -> Vec<DirectStage<'_>> {
        std::iter::once(DirectStage::Embedding(self))
            .chain((0..self.blocks.len()).map(|i| DirectStage::Block(self, i)))
            .chain(std::iter::once(DirectStage::Head(self)))
            .collect()
    }

    /// The mean next-token cross-entropy of `tokens` against `targets`
    /// (both `(b, s)`) times `scale`, and its gradients, through the
    /// direct backward: each parameter's gradient is handed to `on_grad`
    /// as soon as its stage's backward has made it (a tied token table's
    /// twice, once from the head and once from the embedding: sum them).
    /// Needs the lean layers with materialized or tiled attention. Under
    /// ZeRO stage 3 ([`Gpt::sharded`]) each stage gathers the parameters it
    /// uses for its forward and again for its backward, dropping them once
    /// used, and what `on_grad` gets is each block's gradient (the mean
    /// over the ranks, reduce-scattered), keyed by the block's variable;
    /// every rank must run the same steps. `observer` is told what each
    /// allocation is for (activations in the forward, gradients in the
    /// backward).
    pub fn direct_loss_with(
        &self,
        tokens: &Tensor,
        targets: &Tensor,
        scale: f64,
        on_grad: impl FnMut(&Var, Tensor) -> Result<()>,
        observer: &dyn Observer,
    ) -> Result<Tensor> {
        self.direct_with(tokens, targets, scale, on_grad, observer, false)
    }

    /// [`Gpt::direct_loss_with`] with every stage checkpointed: each
    /// stage's gradients handed over as soon as its backward, after its
    /// forward is run again, has made them (as ZeRO's stage 2 and 3 take
    /// them).
    pub fn direct_checkpointed_with(
        &self,
        tokens: &Tensor,
        targets: &Tensor,
        scale: f64,
        on_grad: impl FnMut(&Var, Tensor) -> Result<()>,
        observer: &dyn Observer,
    ) -> Result<Tensor> {
        self.direct_with(tokens, targets, scale, on_grad, observer, true)
    }

    /// The direct step handing each gradient to `on_grad`, each stage its
    /// own segment when `checkpointed`: the loss.
    fn direct_with(
        &self,
        tokens: &Tensor,
        targets: &Tensor,
        scale: f64,
        on_grad: impl FnMut(&Var, Tensor) -> Result<()>,
        observer: &dyn Observer,
        checkpointed: bool,
    ) -> Result<Tensor> {
        self.check_direct()?;
        let targets = targets.flatten_all()?;
        let head = |logits: &Tensor| cross_entropy_and_grad(logits, &targets, scale);
        let stages = self.direct_stages();
        let direct = Sequential::direct(&stages).observer(observer);
        let direct = if checkpointed {
            direct.each_layer()
        } else {
            direct
        };
        let (loss, _) = direct.backward_with(tokens, &self.vars(), head, on_grad)?;
        Ok(loss)
    }

    /// [`Gpt::direct_loss_with`] collecting the gradients: the loss and
    /// every parameter's gradient (a tied token table's two summed), as a
    /// training loop hands them to its optimizer.
    pub fn direct_loss(
        &self,
        tokens: &Tensor,
        targets: &Tensor,
        scale: f64,
        observer: &dyn Observer,
    ) -> Result<Checkpointed> {
        self.direct_summed(tokens, targets, scale, observer, false)
    }

    /// [`Gpt::direct_loss_with`] with every stage checkpointed
    /// (`candle_checkpoint::Sequential::direct`, each layer its own
    /// segment): the forward keeps each
    /// stage's input only, the backward runs each stage again and calls
    /// its backward directly. The loss and the gradients, summed.
    pub fn direct_checkpointed(
        &self,
        tokens: &Tensor,
        targets: &Tensor,
        scale: f64,
        observer: &dyn Observer,
    ) -> Result<Checkpointed> {
        self.direct_summed(tokens, targets, scale, observer, true)
    }

    /// The direct step, each stage its own segment when `checkpointed`,
    /// the gradients summed.
    fn direct_summed(
        &self,
        tokens: &Tensor,
        targets: &Tensor,
        scale: f64,
        observer: &dyn Observer,
        checkpointed: bool,
    ) -> Result<Checkpointed> {
        let mut grads = GradStore::default();
        let add = |var: &Var, g: Tensor| add_grad(&mut grads, var, g);
        let loss = self.direct_with(tokens, targets, scale, add, observer, checkpointed)?;
        Ok(Checkpointed {
            loss,
            grads,
            // Token ids have no gradient.
            input_grad: None,
        })
    }

    fn check_direct(&self) -> Result<()> {
        if !self.config.lean || self.config.attention == AttentionKind::Naive {
            bail!(
                "the direct backward runs the lean layers with materialized or tiled attention; \
                 this model has lean {} and {:?} attention",
                self.config.lean,
                self.config.attention
            );
        }
        Ok(())
    }

    fn block_forward_saved(&self, i: usize, x: &Tensor) -> Result<(Tensor, BlockSaved)> {
        let (b, s, h) = x.dims3()?;
        let a = self.config.heads;
        let d = h / a;
        let blk = &self.blocks[i];
        let (n1, ln1) = norm_saved(&blk.ln1, x)?;
        let (qkv, _) = lean(&blk.qkv, n1.dtype())?.forward_saved(&n1, Activation::Identity)?;
        let qkv = qkv
            .reshape((b, s, 3, a, d))?
            .permute((2, 0, 3, 1, 4))?
            .contiguous()?;
        let (q, k, v) = (qkv.get(0)?, qkv.get(1)?, qkv.get(2)?);
        let cfg = FlashConfig::for_length(true, s);
        let (out, attention) = match self.config.attention {
            AttentionKind::Tiled => {
                let mut fwd = flash_forward(&q, &k, &v, &cfg)?;
                // The backward reads the output once more: a view of the
                // projection's input stands in for it, so that one tensor,
                // not two, holds it until then.
                let y = fwd.out.transpose(1, 2)?.reshape((b, s, h))?;
                let view = y.reshape((b, s, a, d))?.transpose(1, 2)?;
                drop(std::mem::replace(&mut fwd.out, view));
                (y, Attention::Tiled(fwd))
            }
            _ => {
                let mut fwd = materialized_forward(&q, &k, &v, &cfg)?;
                // The backward reads only the output's shape: a broadcast
                // scalar of that shape stands in, so the output itself goes
                // once the projection's input is made from it.
                let shape = fwd.out.shape().clone();
                let stand_in = Tensor::zeros((), fwd.out.dtype(), fwd.out.device())?;
                let out = std::mem::replace(&mut fwd.out, stand_in.broadcast_as(shape)?);
                (out, Attention::Materialized(fwd))
            }
        };
        // The projection's input, `(b, s, h)` (the tiled attention's output
        // is that already).
        let y = match &attention {
            Attention::Tiled(_) => out,
            Attention::Materialized(_) => out.transpose(1, 2)?.reshape((b, s, h))?,
        };
        let (p, _) = lean(&blk.proj, y.dtype())?.forward_saved(&y, Activation::Identity)?;
        let x2 = add(x, &p)?;
        drop(p);
        let (n2, ln2) = norm_saved(&blk.ln2, &x2)?;
        let (m, gelu_in) = lean(&blk.fc, n2.dtype())?.forward_saved(&n2, Activation::Gelu)?;
        let (m2, _) = lean(&blk.fc2, m.dtype())?.forward_saved(&m, Activation::Identity)?;
        let out = add(&x2, &m2)?;
        drop(m2);
        let saved = BlockSaved {
            ln1,
            n1,
            qkv,
            attention,
            y,
            x2,
            ln2,
            n2,
            gelu_in,
            m,
        };
        Ok((out, saved))
    }

    fn block_backward(
        &self,
        i: usize,
        x: &Tensor,
        s: BlockSaved,
        grad: Tensor,
    ) -> Result<DirectGrads> {
        let (b, sq, h) = x.dims3()?;
        let a = self.config.heads;
        let d = h / a;
        let blk = &self.blocks[i];
        let mut params = Vec::with_capacity(12);
        let BlockSaved {
            ln1,
            n1,
            qkv,
            attention,
            y,
            x2,
            ln2,
            n2,
            gelu_in,
            m,
        } = s;
        // The MLP: fc2, then fc with GELU, then the second norm.
        let dm = dense_backward(&blk.fc2, Kept::Identity, &m, grad.clone(), &mut params)?;
        drop(m);
        let dn2 = dense_backward(&blk.fc, gelu_in, &n2, dm, &mut params)?;
        drop(n2);
        let dx2 = {
            let dn = norm_backward(&blk.ln2, &x2, &ln2, &dn2, &mut params)?;
            add(&grad, &dn)?
        };
        drop((grad, dn2, x2));
        // The attention: the projection, the attention's own backward, qkv.
        let dy = dense_backward(&blk.proj, Kept::Identity, &y, dx2.clone(), &mut params)?;
        drop(y);
        let d_out = dy.reshape((b, sq, a, d))?.transpose(1, 2)?.contiguous()?;
        drop(dy);
        let (q, k, v) = (qkv.get(0)?, qkv.get(1)?, qkv.get(2)?);
        let (dq, dk, dv) = match attention {
            Attention::Materialized(fwd) => fwd.backward(&q, &k, &v, &d_out)?,
            Attention::Tiled(fwd) => fwd.backward(&q, &k, &v, &d_out)?,
        };
        drop((q, k, v, qkv, d_out));
        // In the product's layout, in one pass.
        let dqkv = pack_heads(&[dq, dk, dv])?;
        let dn1 = dense_backward(&blk.qkv, Kept::Identity, &n1, dqkv, &mut params)?;
        drop(n1);
        let dx = add(&dx2, &norm_backward(&blk.ln1, x, &ln1, &dn1, &mut params)?)?;
        Ok(DirectGrads {
            input: Some(dx),
            params,
        })
    }
}

impl DirectBackward for DirectStage<'_> {
    type Saved = DirectSaved;

    fn forward_saved(&self, x: &Tensor) -> Result<(Tensor, DirectSaved)> {
        match *self {
            DirectStage::Embedding(m) => {
                let (b, s) = x.dims2()?;
                let c = &m.config;
                if s > c.seq {
                    bail!("{s} tokens, the model's positions stop at {}", c.seq);
                }
                let positions = m.wpe.whole(m.dtype)?.detach().narrow(0, 0, s)?;
                // Detached: on the variables themselves candle would record
                // a graph that keeps every later tensor's inputs alive.
                let out = m
                    .wte
                    .whole(m.dtype)?
                    .detach()
                    .embedding(&x.flatten_all()?)?
                    .reshape((b, s, c.hidden))?
                    .broadcast_add(&positions)?;
                Ok((out, DirectSaved::Embedding))
            }
            DirectStage::Block(m, i) => {
                let (out, saved) = m.block_forward_saved(i, x)?;
                Ok((out, DirectSaved::Block(Box::new(saved))))
            }
            DirectStage::Head(m) => {
                let (b, s, h) = x.dims3()?;
                let (normed, stats) = norm_saved(&m.ln_f, x)?;
                let normed = normed.reshape((b * s, h))?;
                let table = m.head_table().whole(m.dtype)?.detach();
                let logits = normed.matmul(&table.t()?)?;
                Ok((logits, DirectSaved::Head { stats, normed }))
            }
        }
    }

    fn backward_saved(
        &self,
        x: &Tensor,
        saved: DirectSaved,
        grad: Tensor,
        want_input: bool,
    ) -> Result<DirectGrads> {
        match (*self, saved) {
            (DirectStage::Embedding(m), DirectSaved::Embedding) => {
                let (b, s) = x.dims2()?;
                let (v, h) = (m.config.vocab, m.config.hidden);
                let g = grad.reshape((b * s, h))?;
                let dwte = Tensor::zeros((v, h), grad.dtype(), grad.device())?.index_add(
                    &x.flatten_all()?,
                    &g,
                    0,
                )?;
                drop(g);
                let dpos = grad.sum(0)?;
                let dwpe = if s == m.config.seq {
                    dpos
                } else {
                    let rest = Tensor::zeros((m.config.seq - s, h), dpos.dtype(), dpos.device())?;
                    Tensor::cat(&[&dpos, &rest], 0)?
                };
                let mut params = Vec::with_capacity(2);
                m.wte.give(dwte, &mut params)?;
                m.wpe.give(dwpe, &mut params)?;
                Ok(DirectGrads {
                    input: None,
                    params,
                })
            }
            (DirectStage::Block(m, i), DirectSaved::Block(saved)) => {
                let mut g = m.block_backward(i, x, *saved, grad)?;
                if !want_input {
                    g.input = None;
                }
                Ok(g)
            }
            (DirectStage::Head(m), DirectSaved::Head { stats, normed }) => {
                let (b, s, h) = x.dims3()?;
                let head = m.head_table();
                let dtable = grad.t()?.matmul(&normed)?;
                drop(normed);
                let mut params = Vec::with_capacity(3);
                head.give(dtable, &mut params)?;
                let table = head.whole(m.dtype)?.detach();
                let dnormed = grad.matmul(&table)?.reshape((b, s, h))?;
                drop((grad, table));
                let dx = norm_backward(&m.ln_f, x, &stats, &dnormed, &mut params)?;
                Ok(DirectGrads {
                    input: want_input.then_some(dx),
                    params,
                })
            }
            _ => bail!("internal: a stage's saved tensors belong to another stage"),
        }
    }
}
