//! Layer normalization as one operation.

use crate::accumulation;
use candle_core::{bail, DType, Module, Result, Tensor, D};
use candle_custom_grad::{with_backward3, Backward3, DirectBackward, DirectGrads};

/// Layer normalization over the last dimension, `(x - mean) / sqrt(var +
/// eps) * weight + bias`, as one autograd operation. Its graph keeps the
/// input (and the weight and bias) and, beside them, each row's mean and
/// reciprocal deviation: what PyTorch's `layer_norm` saves. candle-nn's
/// differentiable layer norm (its fused kernel has no backward) keeps five
/// tensors the size of the input. Computed in f32 for f16 and bf16 inputs.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let dev = Device::Cpu;
/// let x = Tensor::new(&[[1f32, 2.0, 4.0], [0.5, -1.0, 3.0]], &dev)?;
/// let (w, b) = (Tensor::new(&[1f32, 0.5, 2.0], &dev)?, Tensor::new(&[0f32, 1.0, -1.0], &dev)?);
/// let lean = candle_lean_nn::layer_norm(&x, &w, &b, 1e-5)?;
/// let plain = candle_nn::ops::layer_norm_slow(&x, &w, &b, 1e-5)?;
/// let diff = (lean - plain)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(diff < 1e-6);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let (out, stats) = layer_norm_saved(x, weight, bias, eps)?;
    with_backward3(out, [x, weight, bias], Norm(stats))
}

/// Each row's mean and reciprocal deviation (`(..., 1)`, in f32, or f64
/// for f64 input): what a layer norm's backward needs beside its input.
#[derive(Debug, Clone)]
pub struct NormStats {
    mean: Tensor,
    rstd: Tensor,
}

impl NormStats {
    /// Each row's mean, `(..., 1)`.
    pub fn mean(&self) -> &Tensor {
        &self.mean
    }

    /// Each row's reciprocal deviation, `(..., 1)`.
    pub fn rstd(&self) -> &Tensor {
        &self.rstd
    }
}

/// [`layer_norm`]'s forward with no graph: the output and the statistics
/// its backward ([`layer_norm_backward`]) needs beside the input.
pub fn layer_norm_saved(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
) -> Result<(Tensor, NormStats)> {
    let h = x.dim(D::Minus1)?;
    if weight.dims() != [h] || bias.dims() != [h] {
        bail!(
            "layer norm over {h} features: the weight has shape {:?}, the bias {:?}",
            weight.dims(),
            bias.dims()
        );
    }
    if crate::norm_cpu::applies(x) {
        let (out, mean, rstd) = crate::norm_cpu::forward(x, weight, bias, eps)?;
        return Ok((out, NormStats { mean, rstd }));
    }
    let dtype = x.dtype();
    let acc = accumulation(dtype);
    let xf = x.detach().to_dtype(acc)?;
    let mean = xf.mean_keepdim(D::Minus1)?;
    let centred = xf.broadcast_sub(&mean)?;
    drop(xf);
    let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
    let rstd = (var + eps)?.sqrt()?.recip()?;
    let out = centred
        .broadcast_mul(&rstd)?
        .broadcast_mul(&weight.detach().to_dtype(acc)?)?
        .broadcast_add(&bias.detach().to_dtype(acc)?)?
        .to_dtype(dtype)?;
    Ok((out, NormStats { mean, rstd }))
}

/// The gradients of a layer norm's input, weight and bias from its input
/// `x`, its weight, the statistics [`layer_norm_saved`] returned and the
/// output's gradient.
pub fn layer_norm_backward(
    x: &Tensor,
    weight: &Tensor,
    stats: &NormStats,
    grad: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let dtype = x.dtype();
    let acc = stats.rstd.dtype();
    if crate::norm_cpu::applies(x) && grad.dtype() == dtype && acc == DType::F32 {
        let grad = grad.contiguous()?;
        if grad.dims() != x.dims() {
            bail!(
                "the layer norm's input has shape {:?}, the output's gradient {:?}",
                x.dims(),
                grad.dims()
            );
        }
        return crate::norm_cpu::backward(x, weight, (&stats.mean, &stats.rstd), &grad);
    }
    let h = x.dim(D::Minus1)?;
    let rows = x.elem_count() / h.max(1);
    let xhat = x
        .detach()
        .to_dtype(acc)?
        .broadcast_sub(&stats.mean)?
        .broadcast_mul(&stats.rstd)?;
    let g = grad.to_dtype(acc)?;
    let g2 = g.reshape((rows, h))?;
    let dw = (&g2 * xhat.reshape((rows, h))?)?.sum(0)?;
    let db = g2.sum(0)?;
    drop(g2);
    let dxhat = g.broadcast_mul(&weight.detach().to_dtype(acc)?)?;
    drop(g);
    let mean_d = dxhat.mean_keepdim(D::Minus1)?;
    let mean_dx = (&dxhat * &xhat)?.mean_keepdim(D::Minus1)?;
    let dx = dxhat
        .broadcast_sub(&mean_d)?
        .sub(&xhat.broadcast_mul(&mean_dx)?)?
        .broadcast_mul(&stats.rstd)?;
    Ok((
        dx.to_dtype(dtype)?,
        dw.to_dtype(weight.dtype())?,
        db.to_dtype(weight.dtype())?,
    ))
}

/// A layer norm module whose forward is [`layer_norm`]: one autograd
/// operation that keeps the input and two numbers per row.
///
/// Use it in place of `candle_nn::LayerNorm` in a model that trains: in
/// candle 0.11, `candle_nn::LayerNorm::forward` on a contiguous input runs
/// a fused kernel that has no backward, so its weight and bias silently get
/// no gradient (`candle_checkpoint::ensure_grads` names them).
/// [`LeanLayerNorm::try_from`] takes an existing one's variables (shared,
/// not copied); [`lean_layer_norm`] makes new ones as `candle_nn::layer_norm`
/// does.
///
/// ```
/// use candle_core::{DType, Device, Module, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// let dev = Device::Cpu;
/// let map = VarMap::new();
/// let vb = VarBuilder::from_varmap(&map, DType::F32, &dev);
/// let plain = candle_nn::layer_norm(3, 1e-5, vb.pp("ln"))?;
/// let lean = candle_lean_nn::LeanLayerNorm::try_from(&plain)?;
/// let x = Tensor::new(&[[1f32, 2.0, 4.0]], &dev)?;
/// let y = lean.forward(&x)?;
/// // Gradients reach both variables of the VarMap.
/// let grads = y.sqr()?.sum_all()?.backward()?;
/// assert!(map.all_vars().iter().all(|v| grads.get(v.as_tensor()).is_some()));
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct LeanLayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f64,
}

impl LeanLayerNorm {
    /// A layer norm over `weight.dims() == [h]` features with `bias` of the
    /// same shape, shared (not copied): pass variables' tensors to train
    /// them.
    pub fn new(weight: Tensor, bias: Tensor, eps: f64) -> Result<Self> {
        if weight.rank() != 1 || bias.dims() != weight.dims() {
            bail!(
                "a layer norm's weight and bias are vectors of one shape: the weight has shape \
                 {:?}, the bias {:?}",
                weight.dims(),
                bias.dims()
            );
        }
        Ok(Self { weight, bias, eps })
    }

    /// The weight, `(h,)`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias, `(h,)`.
    pub fn bias(&self) -> &Tensor {
        &self.bias
    }

    /// The epsilon added to the variance.
    pub fn eps(&self) -> f64 {
        self.eps
    }
}

impl TryFrom<&candle_nn::LayerNorm> for LeanLayerNorm {
    type Error = candle_core::Error;

    /// The same variables and epsilon. A `candle_nn::LayerNorm` without a
    /// bias is refused: candle-nn does not say whether it is a bias-less
    /// layer norm or an RMS norm, which compute different things.
    fn try_from(ln: &candle_nn::LayerNorm) -> Result<Self> {
        let Some(bias) = ln.bias() else {
            bail!(
                "this candle_nn::LayerNorm has no bias, and candle-nn does not say whether it \
                 subtracts the mean (LayerNorm::new_no_bias) or not (LayerNorm::rms_norm); build \
                 a LeanLayerNorm with LeanLayerNorm::new(weight, bias, eps)"
            );
        };
        Self::new(ln.weight().clone(), bias.clone(), ln.eps())
    }
}

impl Module for LeanLayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        layer_norm(x, &self.weight, &self.bias, self.eps)
    }
}

/// A new [`LeanLayerNorm`] over `size` features, its variables made by `vb`
/// as `candle_nn::layer_norm` makes them (`weight` ones, `bias` zeros).
pub fn lean_layer_norm(size: usize, eps: f64, vb: candle_nn::VarBuilder) -> Result<LeanLayerNorm> {
    let ln = candle_nn::layer_norm(size, eps, vb)?;
    LeanLayerNorm::try_from(&ln)
}

/// The backward of [`layer_norm`]'s graph operation.
struct Norm(NormStats);

impl Backward3 for Norm {
    fn kept(&self) -> Vec<Tensor> {
        vec![self.0.mean.clone(), self.0.rstd.clone()]
    }

    fn backward(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, db) = layer_norm_backward(x, w, &self.0, grad)?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

impl DirectBackward for LeanLayerNorm {
    type Saved = NormStats;

    fn forward_saved(&self, x: &Tensor) -> Result<(Tensor, NormStats)> {
        layer_norm_saved(x, &self.weight, &self.bias, self.eps)
    }

    fn backward_saved(
        &self,
        x: &Tensor,
        stats: NormStats,
        grad: Tensor,
        want_input: bool,
    ) -> Result<DirectGrads> {
        let (dx, dw, db) = layer_norm_backward(x, &self.weight, &stats, &grad)?;
        Ok(DirectGrads {
            input: want_input.then_some(dx),
            params: vec![(self.weight.clone(), dw), (self.bias.clone(), db)],
        })
    }
}
