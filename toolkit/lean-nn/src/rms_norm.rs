//! RMS normalization as one operation.

use crate::accumulation;
use candle_core::{bail, Module, Result, Tensor, D};
use candle_custom_grad::{with_backward2, Backward2, DirectBackward, DirectGrads};

/// RMS normalization over the last dimension as Llama-family models define
/// it, `weight * (x / sqrt(mean(x^2) + eps))`, the normalized value rounded
/// to the input's dtype before the weight multiplies it. One autograd
/// operation: its graph keeps the input, the weight and one number per row
/// (the reciprocal root mean square, in f32), what PyTorch's fused
/// `rms_norm` saves. candle-nn's `ops::rms_norm` has no backward at all
/// (its weight and input silently get no gradient), and its
/// differentiable `rms_norm_slow` keeps four tensors the input's size.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let dev = Device::Cpu;
/// let x = Tensor::new(&[[1f32, 2.0, 4.0], [0.5, -1.0, 3.0]], &dev)?;
/// let w = Tensor::new(&[1f32, 0.5, 2.0], &dev)?;
/// let lean = candle_lean_nn::rms_norm(&x, &w, 1e-5)?;
/// let plain = candle_nn::ops::rms_norm_slow(&x, &w, 1e-5)?;
/// let diff = (lean - plain)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(diff < 1e-6);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let (out, rstd) = rms_norm_saved(x, weight, eps)?;
    with_backward2(out, [x, weight], Rms(rstd))
}

/// [`rms_norm`]'s forward with no graph: the output and each row's
/// reciprocal root mean square (`(..., 1)`, f32, or f64 for f64 input),
/// which its backward ([`rms_norm_backward`]) needs beside the input.
pub fn rms_norm_saved(x: &Tensor, weight: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let h = x.dim(D::Minus1)?;
    if weight.dims() != [h] {
        bail!(
            "RMS norm over {h} features: the weight has shape {:?}, it must be ({h},)",
            weight.dims()
        );
    }
    if weight.dtype() != x.dtype() {
        bail!(
            "RMS norm of {:?} input with a {:?} weight: give both one dtype",
            x.dtype(),
            weight.dtype()
        );
    }
    let acc = accumulation(x.dtype());
    let xf = x.detach().to_dtype(acc)?;
    let rstd = (xf.sqr()?.mean_keepdim(D::Minus1)? + eps)?
        .sqrt()?
        .recip()?;
    let out = xf
        .broadcast_mul(&rstd)?
        .to_dtype(x.dtype())?
        .broadcast_mul(&weight.detach())?;
    Ok((out, rstd))
}

/// The gradients of an RMS norm's input and weight from its input `x`, its
/// weight, the reciprocal root mean squares [`rms_norm_saved`] returned and
/// the output's gradient.
pub fn rms_norm_backward(
    x: &Tensor,
    weight: &Tensor,
    rstd: &Tensor,
    grad: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let dtype = x.dtype();
    let acc = rstd.dtype();
    let h = x.dim(D::Minus1)?;
    let rows = x.elem_count() / h.max(1);
    let xhat = x.detach().to_dtype(acc)?.broadcast_mul(rstd)?;
    let g = grad.to_dtype(acc)?;
    // The weight multiplied the normalized value rounded to the dtype.
    let rounded = xhat.to_dtype(dtype)?.to_dtype(acc)?;
    let dw = (g.reshape((rows, h))? * rounded.reshape((rows, h))?)?.sum(0)?;
    drop(rounded);
    let dxhat = g.broadcast_mul(&weight.detach().to_dtype(acc)?)?;
    drop(g);
    let mean = (&dxhat * &xhat)?.mean_keepdim(D::Minus1)?;
    let dx = dxhat
        .sub(&xhat.broadcast_mul(&mean)?)?
        .broadcast_mul(rstd)?;
    Ok((dx.to_dtype(dtype)?, dw.to_dtype(weight.dtype())?))
}

/// An RMS norm module whose forward is [`rms_norm`]: one autograd operation
/// that keeps the input and one number per row. [`lean_rms_norm`] makes its
/// weight as `candle_nn::rms_norm` does (`weight`, ones).
///
/// ```
/// use candle_core::{DType, Device, Module, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// let dev = Device::Cpu;
/// let map = VarMap::new();
/// let norm = candle_lean_nn::lean_rms_norm(3, 1e-6, VarBuilder::from_varmap(&map, DType::F32, &dev))?;
/// let y = norm.forward(&Tensor::new(&[[3f32, 0.0, -3.0]], &dev)?)?;
/// let grads = y.sqr()?.sum_all()?.backward()?;
/// assert!(grads.get(norm.weight()).is_some());
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct LeanRmsNorm {
    weight: Tensor,
    eps: f64,
}

impl LeanRmsNorm {
    /// An RMS norm with `weight` `(h,)`, shared (not copied): pass a
    /// variable's tensor to train it.
    pub fn new(weight: Tensor, eps: f64) -> Result<Self> {
        if weight.rank() != 1 {
            bail!(
                "an RMS norm's weight is a vector, got shape {:?}",
                weight.dims()
            );
        }
        Ok(Self { weight, eps })
    }

    /// The weight, `(h,)`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The epsilon added to the mean square.
    pub fn eps(&self) -> f64 {
        self.eps
    }
}

impl Module for LeanRmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        rms_norm(x, &self.weight, self.eps)
    }
}

/// A new [`LeanRmsNorm`] over `size` features, its weight made by `vb` as
/// `candle_nn::rms_norm` makes it (`weight`, ones).
pub fn lean_rms_norm(size: usize, eps: f64, vb: candle_nn::VarBuilder) -> Result<LeanRmsNorm> {
    let weight = vb.get_with_hints(size, "weight", candle_nn::Init::Const(1.0))?;
    LeanRmsNorm::new(weight, eps)
}

/// The backward of [`rms_norm`]'s graph operation.
struct Rms(Tensor);

impl Backward2 for Rms {
    fn kept(&self) -> Vec<Tensor> {
        vec![self.0.clone()]
    }

    fn backward(
        &self,
        x: &Tensor,
        w: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = rms_norm_backward(x, w, &self.0, grad)?;
        Ok((Some(dx), Some(dw)))
    }
}

impl DirectBackward for LeanRmsNorm {
    type Saved = Tensor;

    fn forward_saved(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        rms_norm_saved(x, &self.weight, self.eps)
    }

    fn backward_saved(
        &self,
        x: &Tensor,
        rstd: Tensor,
        grad: Tensor,
        want_input: bool,
    ) -> Result<DirectGrads> {
        let (dx, dw) = rms_norm_backward(x, &self.weight, &rstd, &grad)?;
        Ok(DirectGrads {
            input: want_input.then_some(dx),
            params: vec![(self.weight.clone(), dw)],
        })
    }
}
