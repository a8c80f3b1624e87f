//! Adding one tensor into another in place, and a sum on the products'
//! thread pool.

use candle_core::{DType, Result, Tensor, WithDType};
use candle_cpu_math::{add_assign, WorkerScratch};
use candle_custom_grad::{with_backward2, Backward2};
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use crate::cpu::with_slice;

/// Elements of a half-precision sum widened to f32 at once.
const HALF_SPAN: usize = 1 << 12;

/// Elements of an f32 sum each task adds at least.
const MIN_PER_TASK: usize = 1 << 14;

/// `sum + g`, added into `sum`'s storage when both are contiguous and of
/// one shape and dtype (`sum` must be held by nothing else): f32 on the
/// CPU, on rayon's pool, and with the `cuda` feature f32, f64, f16 or bf16
/// on a CUDA GPU ([`candle_inplace::add_assign`]); through candle's
/// addition otherwise.
pub(crate) fn add_into(sum: Tensor, g: &Tensor) -> Result<Tensor> {
    if candle_inplace::add_assign(&sum, g)? {
        return Ok(sum);
    }
    sum + g
}

/// `a + b` (one shape), as candle's addition computes it. Contiguous f32,
/// bf16 or f16 on the CPU is added on rayon's pool, the one the matrix
/// products and the lean layers' kernels run on (the half types in f32,
/// each sum rounded once, as candle does): candle 0.11 adds on a pool of
/// its own, whose worker spins for a while after each addition, on a core
/// the next product wants (a residual connection adds at every block,
/// forward and backward). When candle's autograd tracks an operand (a
/// variable, or a result of one), the sum is one operation of its graph
/// whose backward hands the sum's gradient to both operands, as candle's
/// addition's does; the graph holds the two operands, as it holds
/// candle's addition's. Anything else is candle's addition.
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let pooled = a.device().is_cpu()
        && a.dtype() == b.dtype()
        && a.shape() == b.shape()
        && a.is_contiguous()
        && b.is_contiguous()
        && a.elem_count() > 0;
    if !pooled {
        return a + b;
    }
    if a.track_op() || b.track_op() {
        let sum = add(&a.detach(), &b.detach())?;
        return with_backward2(sum, [a, b], Sum);
    }
    match a.dtype() {
        DType::F32 => {
            let mut out = Vec::new();
            with_slice::<f32, _>(a, |a| {
                with_slice::<f32, _>(b, |b| {
                    a.par_iter()
                        .zip(b.par_iter())
                        .with_min_len(MIN_PER_TASK)
                        .map(|(x, y)| x + y)
                        .collect_into_vec(&mut out)
                })
            })??;
            Tensor::from_vec(out, a.shape(), a.device())
        }
        DType::BF16 => add_half::<half::bf16>(a, b),
        DType::F16 => add_half::<half::f16>(a, b),
        _ => a + b,
    }
}

/// The backward of [`add`] under candle's autograd: the sum's gradient is
/// each operand's.
struct Sum;

impl Backward2 for Sum {
    fn backward(
        &self,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(grad.clone()), Some(grad.clone())))
    }
}

/// [`add`] of two half-precision tensors: each span widened, added in f32
/// and rounded once.
fn add_half<T>(a: &Tensor, b: &Tensor) -> Result<Tensor>
where
    T: WithDType,
    [T]: HalfFloatSliceExt,
{
    let mut out = vec![T::from_f64(0.0); a.elem_count()];
    // Two f32 spans for each worker (no wider than the tensors).
    let span = HALF_SPAN.min(a.elem_count());
    let scratch = WorkerScratch::new(2 * span, a.elem_count().div_ceil(HALF_SPAN));
    with_slice::<T, _>(a, |a| {
        with_slice::<T, _>(b, |b| {
            out.par_chunks_mut(HALF_SPAN)
                .zip(a.par_chunks(HALF_SPAN))
                .zip(b.par_chunks(HALF_SPAN))
                .for_each(|((out, a), b)| {
                    scratch.with(|w| {
                        let (x, y) = w.split_at_mut(span);
                        let (x, y) = (&mut x[..a.len()], &mut y[..a.len()]);
                        a.convert_to_f32_slice(x);
                        b.convert_to_f32_slice(y);
                        add_assign(x, y);
                        out.convert_from_f32_slice(x);
                    })
                })
        })
    })??;
    Tensor::from_vec(out, a.shape(), a.device())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn the_sum_is_candles_in_every_dtype_and_layout() -> Result<()> {
        let dev = Device::Cpu;
        // Past one task's share, and not a multiple of it.
        let a = Tensor::randn(0f32, 1.0, (3, 70_001), &dev)?;
        let b = Tensor::randn(0f32, 1.0, (3, 70_001), &dev)?;
        let bits = |t: &Tensor| -> Result<Vec<u32>> {
            Ok(t.to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?
                .iter()
                .map(|x| x.to_bits())
                .collect())
        };
        for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
            let (a, b) = (a.to_dtype(dtype)?, b.to_dtype(dtype)?);
            let ours = add(&a, &b)?;
            assert_eq!((ours.dims(), ours.dtype()), (a.dims(), dtype));
            assert_eq!(bits(&ours)?, bits(&(&a + &b)?)?, "{dtype:?}");
        }
        // A transposed view, and an empty tensor: candle's.
        let (at, bt) = (a.t()?, b.t()?);
        assert_eq!(bits(&add(&at, &bt)?)?, bits(&(&at + &bt)?)?);
        let empty = Tensor::zeros((0, 4), DType::F32, &dev)?;
        assert_eq!(add(&empty, &empty)?.dims(), [0, 4]);
        // Tracked operands: the same sum, and the gradients candle's
        // addition gives, one operand tracked or both, or one twice.
        let (va, vb) = (Var::from_tensor(&a)?, Var::from_tensor(&b)?);
        let w = Tensor::randn(0f32, 1.0, (3, 70_001), &dev)?;
        let cases: [(&Tensor, &Tensor); 3] = [
            (va.as_tensor(), &b),
            (va.as_tensor(), vb.as_tensor()),
            (va.as_tensor(), va.as_tensor()),
        ];
        for (i, (x, y)) in cases.into_iter().enumerate() {
            let ours = add(x, y)?;
            let theirs = (x + y)?;
            assert_eq!(bits(&ours)?, bits(&theirs)?, "case {i}");
            let ours = (ours * &w)?.sum_all()?.backward()?;
            let theirs = (theirs * &w)?.sum_all()?.backward()?;
            for v in [&va, &vb] {
                let (o, t) = (ours.get(v.as_tensor()), theirs.get(v.as_tensor()));
                assert_eq!(o.is_some(), t.is_some(), "case {i}");
                if let (Some(o), Some(t)) = (o, t) {
                    assert_eq!(bits(o)?, bits(t)?, "case {i}");
                }
            }
        }
        // Shapes that differ: candle's error.
        let err = add(&a, &a.narrow(1, 0, 5)?).unwrap_err().to_string();
        assert!(err.contains("shape mismatch"), "{err}");
        Ok(())
    }
}
