//! Cross-entropy as one operation.

use candle_core::{bail, DType, Result, Tensor, D};
use candle_custom_grad::{with_backward2, Backward2};

/// The mean cross-entropy of `logits` `(rows, classes)` against class
/// indices `targets` `(rows,)`, as one autograd operation computed in f32
/// (f64 for f64 logits): its graph keeps the logits and the targets, and
/// its backward, `(softmax(logits) - onehot(targets)) / rows`, recomputes
/// the softmax. candle-nn's `cross_entropy` keeps its log-softmax and the
/// intermediates of it, each the size of the logits. The result is a
/// scalar of the logits' dtype.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let dev = Device::Cpu;
/// let logits = Tensor::new(&[[2f32, 0.0, -1.0], [0.5, 0.5, 0.5]], &dev)?;
/// let targets = Tensor::new(&[0u32, 2], &dev)?;
/// let lean = candle_lean_nn::cross_entropy(&logits, &targets)?.to_scalar::<f32>()?;
/// let plain = candle_nn::loss::cross_entropy(&logits, &targets)?.to_scalar::<f32>()?;
/// assert!((lean - plain).abs() < 1e-6);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let (rows, classes) = logits.dims2()?;
    if targets.dims() != [rows] {
        bail!(
            "targets have shape {:?}, the logits {:?}: one class index per row",
            targets.dims(),
            logits.dims()
        );
    }
    if targets.dtype().is_float() {
        bail!(
            "targets must be class indices (u8, u32 or i64), got {:?}",
            targets.dtype()
        );
    }
    if rows == 0 || classes == 0 {
        bail!("cross-entropy of {rows} rows of {classes} classes has no mean");
    }
    let acc = accumulation(logits.dtype());
    let z = logits.detach().to_dtype(acc)?;
    let t = targets.detach().to_dtype(DType::U32)?.unsqueeze(1)?;
    let max = z.max_keepdim(D::Minus1)?;
    let lse = (z
        .broadcast_sub(&max)?
        .exp()?
        .sum_keepdim(D::Minus1)?
        .log()?
        + max)?;
    let picked = z.gather(&t, 1)?;
    let loss = (lse - picked)?.mean_all()?.to_dtype(logits.dtype())?;
    with_backward2(loss, logits, targets, CrossEntropy)
}

fn accumulation(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

struct CrossEntropy;

impl Backward2 for CrossEntropy {
    fn backward(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (rows, classes) = logits.dims2()?;
        let acc = accumulation(logits.dtype());
        let z = logits.to_dtype(acc)?;
        let max = z.max_keepdim(D::Minus1)?;
        let e = z.broadcast_sub(&max)?.exp()?;
        let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
        let t = targets.to_dtype(DType::U32)?.unsqueeze(1)?;
        let ones = Tensor::ones((rows, 1), acc, logits.device())?;
        let onehot =
            Tensor::zeros((rows, classes), acc, logits.device())?.scatter_add(&t, &ones, 1)?;
        let scale = grad.to_dtype(acc)?.affine(1.0 / rows as f64, 0.0)?;
        let d = (p - onehot)?.broadcast_mul(&scale)?;
        Ok((Some(d.to_dtype(logits.dtype())?), None))
    }
}
