//! A linear layer with its bias and activation fused.

use candle_core::{bail, DType, Module, Result, Tensor};
use candle_custom_grad::{with_backward2, with_backward3, Backward2, Backward3};

use crate::bias::add_bias;

/// The activation applied to a [`LeanLinear`]'s output; alone, a
/// [`Module`] (candle's `relu` and `gelu`). With the `serde` feature it
/// reads and writes as `"identity"`, `"relu"`, `"gelu"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "snake_case")
)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
pub enum Activation {
    /// None.
    Identity,
    /// `max(x, 0)`; its gradient is read from the output, so where the
    /// pre-activation is exactly 0 it is 0, as PyTorch's (candle's own relu
    /// passes the gradient there). A NaN input stays NaN in the f32 CPU
    /// kernel, as in PyTorch, and becomes 0 through candle's relu elsewhere;
    /// its gradient is 0 either way.
    Relu,
    /// GELU, tanh approximation (candle's `gelu`); its gradient needs its
    /// input, which the layer keeps.
    Gelu,
}

impl Module for Activation {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Activation::Identity => Ok(x.clone()),
            Activation::Relu => x.relu(),
            Activation::Gelu => x.gelu(),
        }
    }
}

/// What [`LeanLinear::forward_saved`] keeps for the layer's direct backward
/// beside its input: the activation, and the one tensor its derivative is
/// read from.
#[derive(Debug, Clone)]
pub enum Kept {
    /// No activation: the backward needs only the input.
    Identity,
    /// A ReLU's output, from which its derivative is read (shared with the
    /// output the forward returned: no copy).
    Relu(Tensor),
    /// GELU's input, the product plus the bias.
    Gelu(Tensor),
}

impl Kept {
    /// What the backward of a layer with activation `act` reads: the
    /// layer's `output` for a ReLU, GELU's input `gelu_input` for GELU
    /// (which must then be given), nothing otherwise. For a layer in
    /// candle's graph that keeps GELU's input itself and is handed its
    /// output by the backward, as `candle-offload`'s streamed layer is.
    pub fn new(act: Activation, output: &Tensor, gelu_input: Option<Tensor>) -> Result<Self> {
        Ok(match (act, gelu_input) {
            (Activation::Identity, _) => Kept::Identity,
            (Activation::Relu, _) => Kept::Relu(output.clone()),
            (Activation::Gelu, Some(z)) => Kept::Gelu(z),
            (Activation::Gelu, None) => bail!("a GELU layer's backward needs GELU's input"),
        })
    }

    /// The activation it was kept for.
    pub fn activation(&self) -> Activation {
        match self {
            Kept::Identity => Activation::Identity,
            Kept::Relu(_) => Activation::Relu,
            Kept::Gelu(_) => Activation::Gelu,
        }
    }

    /// The tensor the activation's derivative is read from, if any.
    pub fn tensor(&self) -> Option<&Tensor> {
        match self {
            Kept::Identity => None,
            Kept::Relu(t) | Kept::Gelu(t) => Some(t),
        }
    }
}

/// `act(x W^T + b)` as one autograd operation. See the crate's docs.
///
/// ```
/// use candle_core::{DType, Device, Module, Tensor};
/// use candle_lean_nn::{Activation, LeanLinear};
/// use candle_nn::{VarBuilder, VarMap};
/// let dev = Device::Cpu;
/// let map = VarMap::new();
/// let linear = candle_nn::linear(4, 3, VarBuilder::from_varmap(&map, DType::F32, &dev))?;
/// let lean = LeanLinear::from(&linear);
/// let x = Tensor::randn(0f32, 1.0, (2, 4), &dev)?;
/// let a = linear.forward(&x)?.relu()?;
/// let b = lean.forward_act(&x, Activation::Relu)?;
/// assert_eq!(a.to_vec2::<f32>()?, b.to_vec2::<f32>()?);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct LeanLinear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl From<&candle_nn::Linear> for LeanLinear {
    fn from(l: &candle_nn::Linear) -> Self {
        Self {
            weight: l.weight().clone(),
            bias: l.bias().cloned(),
        }
    }
}

/// A new [`LeanLinear`] from `in_dim` to `out_dim` features with a bias, its
/// variables (`weight`, `bias`) made by `vb` as `candle_nn::linear` makes
/// them: the same names and initialisation.
pub fn lean_linear(in_dim: usize, out_dim: usize, vb: candle_nn::VarBuilder) -> Result<LeanLinear> {
    Ok(LeanLinear::from(&candle_nn::linear(in_dim, out_dim, vb)?))
}

impl LeanLinear {
    /// A layer from `weight` `(out, in)` and `bias` `(out,)`, shared (not
    /// copied): pass variables' tensors to train them.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Result<Self> {
        let (out_f, _) = weight.dims2()?;
        if let Some(b) = &bias {
            if b.dims() != [out_f] {
                bail!(
                    "the bias has shape {:?}, the weight {:?}",
                    b.dims(),
                    weight.dims()
                );
            }
        }
        Ok(Self { weight, bias })
    }

    /// The weight, `(out, in)`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias, `(out,)`.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// `act(x W^T + b)` for `x` `(..., in)`.
    pub fn forward_act(&self, x: &Tensor, act: Activation) -> Result<Tensor> {
        let (out, z) = self.forward_graphless(x, act)?;
        // The graph's op keeps GELU's input only: a ReLU's output is handed
        // to its backward by candle (keeping it in the op would be a cycle).
        let backward = Linear { act, z };
        match &self.bias {
            Some(b) => with_backward3(out, [x, &self.weight, b], backward),
            None => with_backward2(out, [x, &self.weight], backward),
        }
    }

    /// [`LeanLinear::forward_act`] without a graph: the output, detached,
    /// and what [`LeanLinear::backward_saved`] needs beside the input
    /// (GELU's input, or a ReLU's output, which shares the returned
    /// output's storage).
    pub fn forward_saved(&self, x: &Tensor, act: Activation) -> Result<(Tensor, Kept)> {
        let (out, z) = self.forward_graphless(x, act)?;
        let kept = Kept::new(act, &out, z)?;
        Ok((out, kept))
    }

    /// The output, detached, and GELU's input for a GELU layer.
    fn forward_graphless(&self, x: &Tensor, act: Activation) -> Result<(Tensor, Option<Tensor>)> {
        let (out_f, in_f) = self.weight.dims2()?;
        if x.dims().last() != Some(&in_f) {
            bail!(
                "the input has shape {:?}, the layer takes {in_f} features",
                x.dims()
            );
        }
        let mut dims = x.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = out_f;
        }
        // On detached tensors: the forward builds no graph of its own.
        let x2 = x.detach().reshape(((), in_f))?;
        let z = crate::product::matmul(&x2, &self.weight.detach().t()?)?;
        let bias = self.bias.as_ref().map(Tensor::detach);
        let (out, kept) = if crate::cpu::applies(&z) {
            crate::cpu::bias_act(z, bias.as_ref(), act)?
        } else {
            let relu = act == Activation::Relu;
            let z = match &bias {
                Some(b) => add_bias(z, b, relu)?,
                None if relu => z.relu()?,
                None => z,
            };
            match act {
                Activation::Identity | Activation::Relu => (z, None),
                Activation::Gelu if crate::cpu_half::applies(&z, &z) => {
                    (crate::cpu_half::gelu(&z)?, Some(z))
                }
                Activation::Gelu => (z.gelu()?, Some(z)),
            }
        };
        Ok((out.reshape(dims)?, kept))
    }

    /// The backward of [`LeanLinear::forward_saved`], called directly: from
    /// the input `x`, what the forward kept and the output's gradient
    /// (handed over: freed before the matrix products), the input's
    /// gradient (when `want_input`: the first layer's data batch needs none,
    /// which saves a matrix product), the weight's and the bias's. The same
    /// arithmetic as the backward of [`LeanLinear::forward_act`] in candle's
    /// graph, so the same gradients.
    pub fn backward_saved(
        &self,
        x: &Tensor,
        kept: Kept,
        grad: Tensor,
        want_input: bool,
    ) -> Result<(Option<Tensor>, Tensor, Option<Tensor>)> {
        // Detached: products with a variable would record a graph, which
        // would keep the gradient alive.
        let w = self.weight.detach();
        let (dx, dw, db) = grads(kept.activation(), kept.tensor(), x, w, grad, want_input)?;
        Ok((dx, dw, self.bias.as_ref().map(|_| db)))
    }
}

/// The backward of [`LeanLinear::forward_saved`] for a layer whose weight
/// `w` is handed to it rather than kept (fetched again for the backward,
/// as an offloaded or sharded layer's is): `(dx, dW, db)`, `db` whether or
/// not the layer has a bias. `w` is handed over: dropped once the input's
/// gradient is made, before the weight's, so a fetched weight is freed
/// then. The arithmetic of [`LeanLinear::backward_saved`].
pub fn linear_backward(
    kept: Kept,
    x: &Tensor,
    w: Tensor,
    grad: Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (dx, dw, db) = grads(kept.activation(), kept.tensor(), x, w.detach(), grad, true)?;
    let dx = dx.ok_or_else(|| candle_core::Error::Msg("internal: no input gradient".into()))?;
    Ok((dx, dw, db))
}

impl Module for LeanLinear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_act(x, Activation::Identity)
    }
}

/// The layer's backward: the activation's gradient, then the product's.
struct Linear {
    act: Activation,
    /// GELU's input, `(rows, out)`.
    z: Option<Tensor>,
}

impl Linear {
    /// What the activation's derivative is read from: the output for a
    /// ReLU, the kept input for GELU.
    fn saved<'a>(&'a self, out: &'a Tensor) -> Option<&'a Tensor> {
        match self.act {
            Activation::Identity => None,
            Activation::Relu => Some(out),
            Activation::Gelu => self.z.as_ref(),
        }
    }
}

/// `(dx, dW, db)` of `act(x W^T + b)` from the output's gradient and what
/// the activation's derivative is read from (`saved`: a ReLU's output,
/// GELU's input); `dx` only when `want_input`. The output's gradient is
/// dropped once the product's is made, before the matrix products, and the
/// weight once the input's gradient is made: each freed then when the
/// caller handed it over.
fn grads(
    act: Activation,
    saved: Option<&Tensor>,
    x: &Tensor,
    w: Tensor,
    grad: Tensor,
    want_input: bool,
) -> Result<(Option<Tensor>, Tensor, Tensor)> {
    let (out_f, in_f) = w.dims2()?;
    let (g, db) = {
        let g = grad.reshape(((), out_f))?;
        drop(grad);
        let saved = match (act, saved) {
            (Activation::Identity, _) => g.clone(),
            (_, Some(t)) => t.reshape(((), out_f))?,
            (_, None) => bail!("internal: the {act:?} derivative's tensor was not kept"),
        };
        if crate::cpu::applies(&saved) && g.dtype() == DType::F32 {
            crate::cpu::act_backward(&g, &saved, act)?
        } else if crate::cpu_half::applies(&g, &saved) {
            crate::cpu_half::act_backward(&g, &saved, act)?
        } else {
            let g = match gpu_act_grad(&g, &saved, act)? {
                Some(on_gpu) => on_gpu,
                None => composed_act_grad(&g, &saved, act)?,
            };
            let db = g.sum(0)?;
            (g, db)
        }
    };
    let x2 = x.reshape(((), in_f))?;
    let dx = if want_input {
        Some(crate::product::matmul(&g, &w)?.reshape(x.shape())?)
    } else {
        None
    };
    drop(w);
    let dw = crate::product::matmul(&g.t()?, &x2)?;
    Ok((dx, dw, db))
}

/// `g * act'(saved)` composed of candle's operations: what runs where no
/// kernel of the toolkit's applies, and what `kernels/activation.cu`
/// computes in one pass with the same roundings.
pub(crate) fn composed_act_grad(g: &Tensor, saved: &Tensor, act: Activation) -> Result<Tensor> {
    match act {
        Activation::Identity => Ok(g.clone()),
        Activation::Relu => g * saved.gt(0.0)?.to_dtype(saved.dtype())?,
        Activation::Gelu => g * gelu_grad(saved)?,
    }
}

/// `g * act'(saved)` in one kernel on a CUDA GPU (with the `cuda`
/// feature): the composed operations' bits in one new tensor; `None` where
/// it does not apply.
fn gpu_act_grad(g: &Tensor, saved: &Tensor, act: Activation) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    return crate::cuda::act_grad(g, saved, act);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (g, saved, act);
        Ok(None)
    }
}

/// The derivative of candle's tanh-approximated GELU, in f32 for half
/// types (the arithmetic `kernels/activation.cu` repeats on a GPU).
fn gelu_grad(z: &Tensor) -> Result<Tensor> {
    let dtype = z.dtype();
    let z = if dtype == DType::F64 {
        z.clone()
    } else {
        z.to_dtype(DType::F32)?
    };
    let cube = (z.sqr()? * &z)?;
    let tanh = ((&cube * 0.0356774)? + (&z * 0.797885)?)?.tanh()?;
    let d = (((&tanh * 0.5)?
        + (((cube * 0.0535161)? + (&z * 0.398942)?)? * (1.0 - tanh.sqr()?)?)?)?
        + 0.5)?;
    d.to_dtype(dtype)
}

impl Backward3 for Linear {
    fn kept(&self) -> Vec<Tensor> {
        self.z.iter().cloned().collect()
    }

    fn backward(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, db) = grads(self.act, self.saved(out), x, w.clone(), grad.clone(), true)?;
        Ok((dx, Some(dw), Some(db)))
    }
}

impl Backward2 for Linear {
    fn kept(&self) -> Vec<Tensor> {
        self.z.iter().cloned().collect()
    }

    fn backward(
        &self,
        x: &Tensor,
        w: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = grads(self.act, self.saved(out), x, w.clone(), grad.clone(), true)?;
        Ok((dx, Some(dw)))
    }
}
