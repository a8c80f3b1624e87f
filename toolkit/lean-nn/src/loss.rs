//! Cross-entropy as one operation.

use crate::accumulation;
use crate::indices::{class_indices, Indices};
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
    let (rows, classes) = check(logits, targets)?;
    if crate::cpu::applies_rows(logits) {
        // On the CPU: a pass per row, no tensor the logits' size.
        let t = class_indices(targets, classes)?;
        let loss = cpu_mean(logits, &t)?;
        return with_backward2(loss, [logits, targets], CrossEntropy);
    }
    #[cfg(feature = "cuda")]
    if crate::cuda_loss::applies(logits, targets) {
        // On a GPU: a block per row, no tensor the logits' size.
        let t = crate::cuda_loss::Targets::new(targets, classes)?;
        let loss = crate::cuda_loss::sum(logits, &t)?
            .affine(1.0 / rows as f64, 0.0)?
            .to_dtype(logits.dtype())?;
        return with_backward2(loss, [logits, targets], CrossEntropy);
    }
    let loss = composed_sum(&logits.detach(), targets)?
        .affine(1.0 / rows as f64, 0.0)?
        .to_dtype(logits.dtype())?;
    with_backward2(loss, [logits, targets], CrossEntropy)
}

/// The logits' rows and classes, once the targets are checked against
/// them.
fn check(logits: &Tensor, targets: &Tensor) -> Result<(usize, usize)> {
    let (rows, classes) = logits.dims2()?;
    check_targets(targets, rows, "the logits", logits.dims())?;
    if rows == 0 || classes == 0 {
        bail!("cross-entropy of {rows} rows of {classes} classes has no mean");
    }
    Ok((rows, classes))
}

/// Checks that `targets` hold one class index per row of `what` (of shape
/// `dims`, `rows` rows).
pub(crate) fn check_targets(
    targets: &Tensor,
    rows: usize,
    what: &str,
    dims: &[usize],
) -> Result<()> {
    if targets.dims() != [rows] {
        bail!(
            "targets have shape {:?}, {what} {dims:?}: one class index per row",
            targets.dims()
        );
    }
    if targets.dtype().is_float() {
        bail!(
            "targets must be class indices (u8, u32 or i64), got {:?}",
            targets.dtype()
        );
    }
    Ok(())
}

/// The sum over rows of `logsumexp(z) - z[target]`, composed of candle's
/// operations, as a scalar in the accumulation dtype.
pub(crate) fn composed_sum(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let z = logits.to_dtype(accumulation(logits.dtype()))?;
    let max = z.max_keepdim(D::Minus1)?;
    let lse = (z
        .broadcast_sub(&max)?
        .exp()?
        .sum_keepdim(D::Minus1)?
        .log()?
        + max)?;
    let t = targets.to_dtype(DType::U32)?.unsqueeze(1)?;
    (lse - z.gather(&t, 1)?)?.sum_all()
}

/// `(softmax(logits) - onehot(targets)) * factor`, in the logits' dtype,
/// composed of candle's operations in the accumulation dtype.
pub(crate) fn composed_grad(logits: &Tensor, targets: &Tensor, factor: f64) -> Result<Tensor> {
    let rows = logits.dim(0)?;
    let acc = accumulation(logits.dtype());
    let z = logits.to_dtype(acc)?;
    let max = z.max_keepdim(D::Minus1)?;
    let e = z.broadcast_sub(&max)?.exp()?;
    drop(z);
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    drop(e);
    let t = targets.to_dtype(DType::U32)?.unsqueeze(1)?;
    let minus = Tensor::full(-1.0, (rows, 1), logits.device())?.to_dtype(acc)?;
    p.scatter_add(&t, &minus, 1)?
        .affine(factor, 0.0)?
        .to_dtype(logits.dtype())
}

/// The mean cross-entropy of contiguous CPU logits against checked
/// class indices, as a scalar tensor.
fn cpu_mean(logits: &Tensor, targets: &[u32]) -> Result<Tensor> {
    let rows = logits.dim(0)?;
    let mean = crate::cpu::cross_entropy_sum(logits, targets)? / rows as f64;
    Tensor::new(mean as f32, logits.device())?.to_dtype(logits.dtype())
}

/// `(softmax(logits) - onehot(targets)) * upstream / rows` for contiguous
/// CPU logits and checked class indices.
fn cpu_grad(logits: &Tensor, targets: &[u32], upstream: f32) -> Result<Tensor> {
    let rows = logits.dim(0)?;
    // As `affine(1 / rows)` rounds it.
    let scale = upstream * (1.0 / rows as f64) as f32;
    crate::cpu::cross_entropy_grad(logits, targets, scale)
}

/// `scale` times the mean cross-entropy of `logits` against `targets` (see
/// [`cross_entropy`]) and its gradient with respect to the logits, computed
/// directly, with no graph: for a driver that calls each layer's backward
/// itself (`candle_checkpoint::Sequential::direct`). `scale` is 1 for the loss
/// itself, or a micro-batch's share of the batch in gradient accumulation.
/// On the CPU, and on a GPU with the `cuda` feature, the gradient is the
/// one tensor the logits' size it allocates.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// let dev = Device::Cpu;
/// let logits = Var::new(&[[2f32, 0.0, -1.0], [0.5, 0.5, 0.5]], &dev)?;
/// let targets = Tensor::new(&[0u32, 2], &dev)?;
/// let (loss, grad) = candle_lean_nn::cross_entropy_and_grad(&logits, &targets, 0.5)?;
/// let plain = (candle_nn::loss::cross_entropy(&logits, &targets)? * 0.5)?;
/// assert!((loss.to_scalar::<f32>()? - plain.to_scalar::<f32>()?).abs() < 1e-6);
/// let expected = plain.backward()?.get(&logits).unwrap().clone();
/// let d = (grad - expected)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(d < 1e-7);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn cross_entropy_and_grad(
    logits: &Tensor,
    targets: &Tensor,
    scale: f64,
) -> Result<(Tensor, Tensor)> {
    let logits = logits.detach();
    if crate::cpu::applies_rows(&logits) {
        // The targets converted and checked once for both.
        let (_, classes) = check(&logits, targets)?;
        let t = class_indices(targets, classes)?;
        let loss = cpu_mean(&logits, &t)?.affine(scale, 0.0)?;
        return Ok((loss, cpu_grad(&logits, &t, scale as f32)?));
    }
    #[cfg(feature = "cuda")]
    if crate::cuda_loss::applies(&logits, targets) {
        // The targets checked and moved once for both.
        let (rows, classes) = check(&logits, targets)?;
        let t = crate::cuda_loss::Targets::new(targets, classes)?;
        let mean = crate::cuda_loss::sum(&logits, &t)?.affine(1.0 / rows as f64, 0.0)?;
        let loss = mean.to_dtype(logits.dtype())?.affine(scale, 0.0)?;
        let grad = crate::cuda_loss::grad(&logits, &t, factor(logits.dtype(), scale, rows))?;
        return Ok((loss, grad));
    }
    let loss = cross_entropy(&logits, targets)?.affine(scale, 0.0)?;
    let upstream = Tensor::new(scale as f32, logits.device())?.to_dtype(logits.dtype())?;
    let (grad, _) = CrossEntropy.backward(&logits, targets, &loss, &upstream)?;
    let Some(grad) = grad else {
        bail!("internal: the cross-entropy's backward gave no gradient");
    };
    Ok((loss, grad))
}

/// The gradient's factor for an upstream gradient `upstream` of the mean
/// over `rows` rows of logits of `dtype`.
fn factor(dtype: DType, upstream: f64, rows: usize) -> f64 {
    if dtype == DType::F64 {
        upstream / rows as f64
    } else {
        // As `affine(1 / rows)` rounds it in f32.
        f64::from(upstream as f32 * (1.0 / rows as f64) as f32)
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
        let rows = logits.dim(0)?;
        let upstream = grad.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let factor = factor(logits.dtype(), upstream, rows);
        let indices = Indices::new(targets, logits.dim(1)?)?;
        Ok((Some(indices.grad(logits, factor)?), None))
    }
}
