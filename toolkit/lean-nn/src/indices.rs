//! A cross-entropy's class indices, checked once and read by whichever of
//! the loss's paths the logits take.

use std::borrow::Cow;

use candle_core::{DType, Result, Tensor};

/// Class indices checked against the logits' classes once, in the form
/// the loss's kernels read them: `u32`s on the host for the CPU's row
/// kernels or, with the `cuda` feature and targets on a GPU, `u32`s on
/// that GPU for its kernels. The targets as given stay beside them for
/// candle's composed operations, which the other logits take.
/// [`Indices::narrow`] gives a chunk's rows without checking or copying
/// them again: [`crate::LinearCrossEntropy`] checks its targets once per
/// call, not once per chunk and operation.
pub(crate) struct Indices<'a> {
    targets: Tensor,
    form: Form<'a>,
}

enum Form<'a> {
    Host(Cow<'a, [u32]>),
    #[cfg(feature = "cuda")]
    Device(crate::cuda_loss::Targets),
}

impl Indices<'static> {
    /// `targets` checked against `classes` (see [`class_indices`]).
    pub(crate) fn new(targets: &Tensor, classes: usize) -> Result<Self> {
        #[cfg(feature = "cuda")]
        if targets.device().is_cuda() {
            let form = Form::Device(crate::cuda_loss::Targets::new(targets, classes)?);
            return Ok(Self {
                targets: targets.clone(),
                form,
            });
        }
        let form = Form::Host(Cow::Owned(class_indices(targets, classes)?));
        Ok(Self {
            targets: targets.clone(),
            form,
        })
    }
}

impl Indices<'_> {
    /// The `len` indices from `start` on, as checked as these.
    pub(crate) fn narrow(&self, start: usize, len: usize) -> Result<Indices<'_>> {
        let form = match &self.form {
            Form::Host(t) => Form::Host(Cow::Borrowed(&t[start..start + len])),
            #[cfg(feature = "cuda")]
            Form::Device(t) => Form::Device(t.narrow(start, len)?),
        };
        Ok(Indices {
            targets: self.targets.narrow(0, start, len)?,
            form,
        })
    }

    /// The indices on the host, for the CPU's row kernels, when the
    /// targets are there.
    pub(crate) fn host(&self) -> Option<&[u32]> {
        match &self.form {
            Form::Host(t) => Some(t),
            #[cfg(feature = "cuda")]
            Form::Device(_) => None,
        }
    }

    /// The indices on a GPU, for its kernels, when they apply to `logits`.
    #[cfg(feature = "cuda")]
    pub(crate) fn device(&self, logits: &Tensor) -> Option<&crate::cuda_loss::Targets> {
        match &self.form {
            Form::Device(t) if crate::cuda_loss::applies(logits, &self.targets) => Some(t),
            _ => None,
        }
    }

    /// The sum over rows of `logsumexp(z) - z[target]`, as an f64 scalar on
    /// the logits' device: one pass per row for contiguous CPU logits (f32,
    /// bf16 or f16), and with the `cuda` feature a block per row for
    /// contiguous GPU logits; candle's operations elsewhere.
    pub(crate) fn sum(&self, logits: &Tensor) -> Result<Tensor> {
        if let (true, Some(t)) = (crate::cpu::applies_rows(logits), self.host()) {
            return Tensor::new(crate::cpu::cross_entropy_sum(logits, t)?, logits.device());
        }
        #[cfg(feature = "cuda")]
        if let Some(t) = self.device(logits) {
            return crate::cuda_loss::sum(logits, t);
        }
        crate::loss::composed_sum(logits, &self.targets)?.to_dtype(DType::F64)
    }

    /// `(softmax(logits) - onehot(targets)) * factor`, in the logits' dtype,
    /// by the same paths as [`Indices::sum`].
    pub(crate) fn grad(&self, logits: &Tensor, factor: f64) -> Result<Tensor> {
        if let (true, Some(t)) = (crate::cpu::applies_rows(logits), self.host()) {
            return crate::cpu::cross_entropy_grad(logits, t, factor as f32);
        }
        #[cfg(feature = "cuda")]
        if let Some(t) = self.device(logits) {
            return crate::cuda_loss::grad(logits, t, factor);
        }
        crate::loss::composed_grad(logits, &self.targets, factor)
    }
}

/// The targets as `u32` class indices, each checked against `classes`.
pub(crate) fn class_indices(targets: &Tensor, classes: usize) -> Result<Vec<u32>> {
    let t = targets.to_dtype(DType::U32)?.to_vec1::<u32>()?;
    crate::cpu::check_targets(&t, classes)?;
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// A chunk's sum and gradient from narrowed indices, by the CPU's row
    /// kernels (f32) and by candle's operations (f64), against candle's
    /// operations on the same rows with the targets narrowed as a tensor.
    #[test]
    fn a_chunk_of_the_indices_is_the_chunk_of_the_targets() -> Result<()> {
        let dev = Device::Cpu;
        let targets = Tensor::new(&[4u32, 0, 2, 1, 3], &dev)?;
        let indices = Indices::new(&targets, 5)?;
        let chunk = indices.narrow(1, 3)?;
        assert_eq!(chunk.host(), Some(&[0u32, 2, 1][..]));
        for dtype in [DType::F32, DType::F64] {
            let logits = Tensor::randn(0f64, 2.0, (3, 5), &dev)?.to_dtype(dtype)?;
            let plain = targets.narrow(0, 1, 3)?;
            let sum = chunk.sum(&logits)?.to_scalar::<f64>()?;
            let want = crate::loss::composed_sum(&logits, &plain)?
                .to_dtype(DType::F64)?
                .to_scalar::<f64>()?;
            assert!(
                (sum - want).abs() <= 1e-6 * want.abs(),
                "{dtype:?}: {sum} against {want}"
            );
            let grad = chunk.grad(&logits, 0.25)?;
            let want = crate::loss::composed_grad(&logits, &plain, 0.25)?;
            let d = (grad.to_dtype(DType::F64)? - want.to_dtype(DType::F64)?)?
                .abs()?
                .max_all()?
                .to_scalar::<f64>()?;
            assert!(d <= 1e-7, "{dtype:?}: the gradients differ by {d}");
        }
        Ok(())
    }

    #[test]
    fn an_index_past_the_classes_is_refused_with_its_row() {
        let targets = Tensor::new(&[1u8, 5, 0], &Device::Cpu).unwrap();
        let err = Indices::new(&targets, 5).err().unwrap().to_string();
        // `starts_with`: with `RUST_BACKTRACE` set, candle appends one.
        assert!(
            err.starts_with("target 5 of row 1 is not a class index: the logits have 5 classes"),
            "{err}"
        );
    }
}
