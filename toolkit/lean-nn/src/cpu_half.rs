//! The layer's element-wise work on the CPU for f16 and bf16: GELU
//! forward, and the backward's.
//!
//! candle computes a half-precision GELU element by element in the half
//! type's arithmetic (each product and sum rounded, `tanh` through the C
//! library's), on one thread and a second pool's: 30% of a bf16 GPT step's
//! time on two cores. Here each row is widened into a scratch row, GELU
//! applied as in f32 ([`crate::cpu`]'s vectorised kernel) and the result
//! rounded once, which is also nearer the exact value.
//!
//! Through candle's operations a half-precision GELU derivative is computed
//! in f32 over the whole input, a tensor per step (cube, tanh, its square,
//! products and sums): about a dozen tensors the size of the layer's output
//! at once. Here each row is widened into a scratch row, the derivative
//! applied as in f32 ([`crate::cpu`]'s kernel) and the result rounded once
//! into the one tensor returned; the bias's gradient is summed in f32 from
//! the rounded rows and rounded once.

use candle_core::{bail, DType, Device, Result, Tensor, WithDType};
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use candle_cpu_math::{add_assign, WorkerScratch};

use crate::cpu::{
    act_grad_row, as_uninit, column_sums_by, gelu_row, with_slice, ROWS_PER_TASK, SUM_COLUMNS,
};
use crate::linear::Activation;

/// Whether [`act_backward`] takes `grad` and `saved`: contiguous f16 or
/// bf16 tensors of one dtype on the CPU.
pub(crate) fn applies(grad: &Tensor, saved: &Tensor) -> bool {
    saved.device().is_cpu()
        && matches!(saved.dtype(), DType::F16 | DType::BF16)
        && grad.dtype() == saved.dtype()
        && saved.is_contiguous()
        && saved.elem_count() > 0
}

/// GELU (the tanh approximation) of `z` `(rows, n)`, contiguous f16 or
/// bf16 on the CPU (see [`applies`]), in its dtype (see the module).
pub(crate) fn gelu(z: &Tensor) -> Result<Tensor> {
    match z.dtype() {
        DType::BF16 => gelu_typed::<half::bf16>(z),
        DType::F16 => gelu_typed::<half::f16>(z),
        other => bail!("internal: the half-precision kernel got {other:?}"),
    }
}

fn gelu_typed<T>(z: &Tensor) -> Result<Tensor>
where
    T: WithDType,
    [T]: HalfFloatSliceExt,
{
    let (rows, n) = z.dims2()?;
    let mut out = vec![T::from_f64(0.0); rows * n];
    let scratch = WorkerScratch::new(2 * n, rows.div_ceil(ROWS_PER_TASK));
    with_slice::<T, _>(z, |zs| {
        out.par_chunks_mut(n * ROWS_PER_TASK)
            .zip(zs.par_chunks(n * ROWS_PER_TASK))
            .for_each(|(out, z)| {
                scratch.with(|w| {
                    let (wide, done) = w.split_at_mut(n);
                    for (out, z) in out.chunks_exact_mut(n).zip(z.chunks_exact(n)) {
                        z.convert_to_f32_slice(wide);
                        gelu_row(wide, as_uninit(done));
                        out.convert_from_f32_slice(done);
                    }
                })
            })
    })?;
    Tensor::from_vec(out, (rows, n), &Device::Cpu)
}

/// The product's gradient `dz = grad * act'` `(rows, n)` and the bias's
/// gradient, in the inputs' half dtype (see the module).
pub(crate) fn act_backward(
    grad: &Tensor,
    saved: &Tensor,
    act: Activation,
) -> Result<(Tensor, Tensor)> {
    let grad = grad.contiguous()?;
    if act == Activation::Identity {
        // The bias's gradient summed in f32 and rounded once, as for the
        // other activations: candle's `sum(0)` adds in the half type,
        // rounding after each row, on one thread.
        let db = match grad.dtype() {
            DType::BF16 => column_sums::<half::bf16>(&grad)?,
            DType::F16 => column_sums::<half::f16>(&grad)?,
            other => bail!("internal: the half-precision kernel got {other:?}"),
        };
        return Ok((grad, db));
    }
    match saved.dtype() {
        DType::BF16 => typed::<half::bf16>(&grad, saved, act),
        DType::F16 => typed::<half::f16>(&grad, saved, act),
        other => bail!("internal: the half-precision kernel got {other:?}"),
    }
}

/// The column sums of a contiguous half-precision `(rows, n)`, in f32 and
/// rounded to its dtype once.
fn column_sums<T>(grad: &Tensor) -> Result<Tensor>
where
    T: WithDType,
    [T]: HalfFloatSliceExt,
{
    let (_, n) = grad.dims2()?;
    let sums = with_slice::<T, _>(grad, |g| half_column_sums(g, n))?;
    narrow::<T>(&sums)
}

fn typed<T>(grad: &Tensor, saved: &Tensor, act: Activation) -> Result<(Tensor, Tensor)>
where
    T: WithDType,
    [T]: HalfFloatSliceExt,
{
    let (rows, n) = grad.dims2()?;
    let gelu_input = act == Activation::Gelu;
    let mut dz = vec![T::from_f64(0.0); rows * n];
    let scratch = WorkerScratch::new(3 * n, rows.div_ceil(ROWS_PER_TASK));
    with_slice::<T, _>(grad, |g| {
        with_slice::<T, _>(saved, |s| {
            dz.par_chunks_mut(n * ROWS_PER_TASK)
                .zip(g.par_chunks(n * ROWS_PER_TASK))
                .zip(s.par_chunks(n * ROWS_PER_TASK))
                .for_each(|((dz, g), s)| {
                    scratch.with(|w| {
                        let (wg, rest) = w.split_at_mut(n);
                        let (ws, wd) = rest.split_at_mut(n);
                        for ((dz, g), s) in dz
                            .chunks_exact_mut(n)
                            .zip(g.chunks_exact(n))
                            .zip(s.chunks_exact(n))
                        {
                            g.convert_to_f32_slice(wg);
                            s.convert_to_f32_slice(ws);
                            act_grad_row(wg, ws, as_uninit(wd), gelu_input);
                            dz.convert_from_f32_slice(wd);
                        }
                    })
                })
        })
    })??;
    // Freed before the column sums make scratch of their own.
    drop(scratch);
    // The bias's gradient from the rounded values: the column sums of the
    // `dz` returned, each column's rows added in order.
    let db = narrow::<T>(&half_column_sums(&dz, n))?;
    Ok((Tensor::from_vec(dz, (rows, n), &Device::Cpu)?, db))
}

/// The f32 sums of the columns of half-precision `rows` rows of `n`, each
/// row widened and the rows added in order.
fn half_column_sums<T>(rows: &[T], n: usize) -> Vec<f32>
where
    T: Sync,
    [T]: HalfFloatSliceExt,
{
    column_sums_by(rows, n, SUM_COLUMNS, |wide, sums, row| {
        let wide = &mut wide[..row.len()];
        row.convert_to_f32_slice(wide);
        add_assign(sums, wide);
    })
}

/// f32 `sums` rounded once to `T`, as a vector.
fn narrow<T>(sums: &[f32]) -> Result<Tensor>
where
    T: WithDType,
    [T]: HalfFloatSliceExt,
{
    let mut narrow = vec![T::from_f64(0.0); sums.len()];
    narrow.convert_from_f32_slice(sums);
    Tensor::from_vec(narrow, sums.len(), &Device::Cpu)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bias_gradient_is_the_rounded_gradients_column_sums_on_any_pool() -> Result<()> {
        // More rows than three workers' tasks, more columns than a task's
        // block of sums.
        let (rows, n) = (200, 300);
        let dev = Device::Cpu;
        let grad = Tensor::randn(0f32, 1.0, (rows, n), &dev)?;
        let saved = Tensor::randn(0f32, 2.0, (rows, n), &dev)?;
        let bits = |t: &Tensor| -> Result<Vec<u32>> {
            let v = t.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            Ok(v.iter().map(|v| v.to_bits()).collect())
        };
        for dtype in [DType::BF16, DType::F16] {
            let (g, s) = (grad.to_dtype(dtype)?, saved.to_dtype(dtype)?);
            for act in [Activation::Gelu, Activation::Relu, Activation::Identity] {
                for threads in [1, 3] {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .unwrap();
                    let (dz, db) = pool.install(|| act_backward(&g, &s, act))?;
                    // candle's f32 sum over the rows adds them in order;
                    // rounded once to the dtype.
                    let want = dz.to_dtype(DType::F32)?.sum(0)?.to_dtype(dtype)?;
                    assert_eq!(bits(&db)?, bits(&want)?, "{dtype:?} {act:?} on {threads}");
                }
            }
        }
        Ok(())
    }

    #[test]
    fn half_gelu_is_within_a_rounding_of_the_exact_and_nearer_than_candles() -> Result<()> {
        // Values from -8 to 8 in steps finer than the half types', and rows
        // past one task's.
        let (rows, n) = (40, 1001);
        let v: Vec<f32> = (0..rows * n)
            .map(|i| -8.0 + 16.0 * i as f32 / (rows * n) as f32)
            .collect();
        let z32 = Tensor::from_vec(v, (rows, n), &Device::Cpu)?;
        let values = |t: &Tensor| t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>();
        for dtype in [DType::BF16, DType::F16] {
            let z = z32.to_dtype(dtype)?;
            assert!(applies(&z, &z));
            let ours = gelu(&z)?;
            assert_eq!((ours.dims(), ours.dtype()), (z.dims(), dtype));
            // The value in f32 rounded once: within a relative step of the
            // dtype of the exact value, or, where `1 + tanh` cancels, f32's
            // rounding of tanh times |x| / 2 <= 4.
            let step = if dtype == DType::BF16 {
                2f64.powi(-8)
            } else {
                2f64.powi(-11)
            };
            let theirs = values(&z.gelu()?)?;
            let (mut ours_off, mut theirs_off) = (0f64, 0f64);
            for ((x, ours), theirs) in values(&z)?.iter().zip(values(&ours)?).zip(theirs) {
                let u = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
                let exact = 0.5 * x * (1.0 + u.tanh());
                assert!(
                    (ours - exact).abs() <= step * exact.abs() + 1e-6,
                    "{dtype:?}: gelu({x}) = {exact}, got {ours}"
                );
                ours_off += (ours - exact).abs();
                theirs_off += (theirs - exact).abs();
            }
            // candle's GELU of the half types (0 where the exact value is
            // -4e-5, for one) is further from the exact, summed over every
            // value.
            assert!(
                ours_off < theirs_off,
                "{dtype:?}: {ours_off} from the exact, candle's {theirs_off}"
            );
        }
        Ok(())
    }
}
