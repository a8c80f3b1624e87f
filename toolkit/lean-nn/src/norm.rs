//! Layer normalization as one operation.

use candle_core::{bail, DType, Result, Tensor, D};
use candle_custom_grad::{with_backward3, Backward3};

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
    let h = x.dim(D::Minus1)?;
    if weight.dims() != [h] || bias.dims() != [h] {
        bail!(
            "layer norm over {h} features: the weight has shape {:?}, the bias {:?}",
            weight.dims(),
            bias.dims()
        );
    }
    let dtype = x.dtype();
    let acc = accumulation(dtype);
    let xf = x.detach().to_dtype(acc)?;
    let mean = xf.mean_keepdim(D::Minus1)?;
    let centred = xf.broadcast_sub(&mean)?;
    let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
    let rstd = (var + eps)?.sqrt()?.recip()?;
    let out = centred
        .broadcast_mul(&rstd)?
        .broadcast_mul(&weight.detach().to_dtype(acc)?)?
        .broadcast_add(&bias.detach().to_dtype(acc)?)?
        .to_dtype(dtype)?;
    drop(centred);
    with_backward3(out, x, weight, bias, Norm { mean, rstd })
}

fn accumulation(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// The backward, from the input and each row's mean and reciprocal
/// deviation (`(..., 1)`, in the accumulation type).
struct Norm {
    mean: Tensor,
    rstd: Tensor,
}

impl Backward3 for Norm {
    fn kept(&self) -> Vec<Tensor> {
        vec![self.mean.clone(), self.rstd.clone()]
    }

    fn backward(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dtype = x.dtype();
        let acc = self.rstd.dtype();
        let h = x.dim(D::Minus1)?;
        let rows = x.elem_count() / h.max(1);
        let xhat = x
            .to_dtype(acc)?
            .broadcast_sub(&self.mean)?
            .broadcast_mul(&self.rstd)?;
        let g = grad.to_dtype(acc)?;
        let g2 = g.reshape((rows, h))?;
        let dw = (&g2 * xhat.reshape((rows, h))?)?.sum(0)?;
        let db = g2.sum(0)?;
        let dxhat = g.broadcast_mul(&w.to_dtype(acc)?)?;
        let mean_d = dxhat.mean_keepdim(D::Minus1)?;
        let mean_dx = (&dxhat * &xhat)?.mean_keepdim(D::Minus1)?;
        let dx = dxhat
            .broadcast_sub(&mean_d)?
            .sub(&xhat.broadcast_mul(&mean_dx)?)?
            .broadcast_mul(&self.rstd)?;
        Ok((
            Some(dx.to_dtype(dtype)?),
            Some(dw.to_dtype(w.dtype())?),
            Some(db.to_dtype(w.dtype())?),
        ))
    }
}
