//! The layer's element-wise work on the CPU for f32, in parallel and
//! vectorised: the bias and the activation in one pass over the product,
//! and in the backward the activation's derivative and the bias's gradient
//! in one pass over the output's gradient. candle's own element-wise CPU
//! operations are a pass and a tensor each (its unary ones on one thread),
//! and GELU goes through libm's `tanhf`, which does not vectorise: they took
//! most of a fused layer's time beside its matrix products.

use std::mem::MaybeUninit;

use candle_core::{bail, DType, Device, Result, Storage, Tensor, WithDType};
use candle_cpu_math::{add_assign, dispatch, exp, gelu, gelu_grad, WorkerScratch};
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use crate::bias::BiasAct;
use crate::linear::Activation;

/// Rows per task: enough work to outweigh a task's cost.
pub(crate) const ROWS_PER_TASK: usize = 16;

/// Whether the kernel does a layer's element-wise work: contiguous f32 on
/// the CPU.
pub(crate) fn applies(t: &Tensor) -> bool {
    t.device().is_cpu() && t.dtype() == DType::F32 && t.is_contiguous() && t.elem_count() > 0
}

/// The elements of a contiguous CPU tensor of type `T`, to `f`.
pub(crate) fn with_slice<T: WithDType, R>(t: &Tensor, f: impl FnOnce(&[T]) -> R) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        bail!("internal: the CPU kernel got a tensor on another device");
    };
    let Some((start, end)) = layout.contiguous_offsets() else {
        bail!("internal: the CPU kernel got a strided tensor");
    };
    Ok(f(&cpu.as_slice::<T>()?[start..end]))
}

dispatch! {
    /// `row += bias`, then the activation in place (GELU's input is kept
    /// elsewhere, so this is for the identity and ReLU).
    pub(crate) fn bias_act_row(row: &mut [f32], bias: &[f32], relu: bool) -> () {
        for (v, b) in row.iter_mut().zip(bias) {
            let z = *v + b;
            *v = if relu && z <= 0.0 { 0.0 } else { z };
        }
    }
}

dispatch! {
    /// `out = gelu(z)`, every element of `out` written (`out` may be
    /// uninitialised).
    pub(crate) fn gelu_row(z: &[f32], out: &mut [MaybeUninit<f32>]) -> () {
        for (o, &z) in out.iter_mut().zip(z) {
            o.write(gelu(z));
        }
    }
}

dispatch! {
    /// `dz = g * act'(...)` for one row: ReLU's derivative read from the
    /// output, GELU's from its input. Every element of `dz` is written
    /// (`dz` may be uninitialised).
    pub(crate) fn act_grad_row(g: &[f32], saved: &[f32], dz: &mut [MaybeUninit<f32>], gelu_input: bool) -> () {
        for ((d, &g), &s) in dz.iter_mut().zip(g).zip(saved) {
            d.write(if gelu_input {
                g * gelu_grad(s)
            } else if s > 0.0 {
                g
            } else {
                0.0
            });
        }
    }
}

/// `s` as a slice of possibly uninitialised elements, for a kernel that
/// only writes initialised values into it (so `s` stays initialised).
pub(crate) fn as_uninit(s: &mut [f32]) -> &mut [MaybeUninit<f32>] {
    // SAFETY: `MaybeUninit<f32>` has `f32`'s layout; the kernels that take
    // the result write values, never `MaybeUninit::uninit()`.
    unsafe { &mut *(s as *mut [f32] as *mut [MaybeUninit<f32>]) }
}

/// `len` elements made by `fill`, which is handed disjoint chunks of
/// `chunk` elements (the last may be shorter) on the pool with the offset
/// of each, and writes every element of each: a kernel's output that is
/// never zero-filled first (a serial pass over the whole output, on the
/// calling thread, before the parallel one that overwrites it).
///
/// # Safety
///
/// `fill` must write every element of each chunk it is given.
pub(crate) unsafe fn written(
    len: usize,
    chunk: usize,
    fill: impl Fn(usize, &mut [MaybeUninit<f32>]) + Sync,
) -> Vec<f32> {
    let mut out: Vec<f32> = Vec::with_capacity(len);
    out.spare_capacity_mut()[..len]
        .par_chunks_mut(chunk.max(1))
        .enumerate()
        .for_each(|(i, c)| fill(i * chunk.max(1), c));
    // SAFETY: `fill` wrote every one of the `len` elements (the caller's
    // promise).
    unsafe { out.set_len(len) };
    out
}

/// `act(z + b)` for a fresh product `z` `(rows, n)`: the output, and for
/// GELU its input (`z + b`), which the backward needs.
pub(crate) fn bias_act(
    z: Tensor,
    bias: Option<&Tensor>,
    act: Activation,
) -> Result<(Tensor, Option<Tensor>)> {
    let (_, n) = z.dims2()?;
    if bias.is_none() && act == Activation::Identity {
        return Ok((z, None));
    }
    let zeros;
    let bias = match bias {
        Some(b) if b.is_contiguous() => b,
        Some(b) => {
            zeros = b.contiguous()?;
            &zeros
        }
        None => {
            zeros = Tensor::zeros(n, DType::F32, z.device())?;
            &zeros
        }
    };
    match act {
        Activation::Identity | Activation::Relu => {
            z.inplace_op2(
                bias,
                &BiasAct {
                    relu: act == Activation::Relu,
                },
            )?;
            Ok((z, None))
        }
        Activation::Gelu => {
            z.inplace_op2(bias, &BiasAct { relu: false })?;
            let out = with_slice::<f32, _>(&z, |zs| {
                // SAFETY: `gelu_row` writes each element of its output, as
                // long as its input, the same span of `zs`.
                unsafe {
                    written(zs.len(), n * ROWS_PER_TASK, |at, o| {
                        gelu_row(&zs[at..at + o.len()], o)
                    })
                }
            })?;
            let out = Tensor::from_vec(out, z.shape(), &Device::Cpu)?;
            Ok((out, Some(z)))
        }
    }
}

/// The product's gradient `dz = grad * act'` `(rows, n)` and the bias's
/// gradient (its column sums), from the output (ReLU) or the activation's
/// input (GELU).
pub(crate) fn act_backward(
    grad: &Tensor,
    saved: &Tensor,
    act: Activation,
) -> Result<(Tensor, Tensor)> {
    let (rows, n) = grad.dims2()?;
    if act == Activation::Identity {
        // The bias's gradient as below; candle's `sum(0)` adds the same
        // rows in the same order a column at a time, strided and on one
        // thread: 4% of a GPT's training step.
        if !grad.is_contiguous() {
            return Ok((grad.clone(), grad.sum(0)?));
        }
        let db = with_slice::<f32, _>(grad, |g| column_sums(g, n))?;
        return Ok((grad.clone(), Tensor::from_vec(db, n, &Device::Cpu)?));
    }
    let grad = grad.contiguous()?;
    if saved.elem_count() != rows * n {
        bail!(
            "the activation's saved tensor has {} elements, its gradient {}",
            saved.elem_count(),
            rows * n
        );
    }
    let gelu_input = act == Activation::Gelu;
    let dz = with_slice::<f32, _>(&grad, |g| {
        with_slice::<f32, _>(saved, |s| {
            // SAFETY: `act_grad_row` writes each element of its output, as
            // long as its two inputs, spans of `rows * n` elements (checked
            // above for `saved`; `grad` is contiguous `(rows, n)`).
            unsafe {
                written(rows * n, n * ROWS_PER_TASK, |at, dz| {
                    let end = at + dz.len();
                    act_grad_row(&g[at..end], &s[at..end], dz, gelu_input)
                })
            }
        })
    })??;
    // The bias's gradient row after row, as candle's `sum(0)` adds them:
    // the same rounding, so that the layer's gradients equal candle-nn's
    // (an optimizer such as AdamW turns any difference near zero into a
    // visible one). One vectorised pass, shared by the pool a block of
    // columns a task.
    let db = column_sums(&dz, n);
    Ok((
        Tensor::from_vec(dz, (rows, n), &Device::Cpu)?,
        Tensor::from_vec(db, n, &Device::Cpu)?,
    ))
}

/// Columns of a bias's gradient each task of the pool sums: 1 KiB of each
/// row, a run the prefetcher follows from one row to the next.
pub(crate) const SUM_COLUMNS: usize = 256;

/// The sums of the columns of `rows` rows of `n`, adding the rows in order
/// (candle's `sum(0)`'s rounding). A block of columns a task, so the pool
/// shares the pass without changing any column's order of addition.
fn column_sums(rows: &[f32], n: usize) -> Vec<f32> {
    column_sums_by(rows, n, 0, |_, sums, row| add_assign(sums, row))
}

/// The f32 sums of the columns of `rows` rows of `n` of any element type,
/// each row's part added into a task's block of sums by `add` (with
/// `scratch` f32 elements of scratch from a [`WorkerScratch`]), the rows in
/// order.
pub(crate) fn column_sums_by<T: Sync>(
    rows: &[T],
    n: usize,
    scratch: usize,
    add: impl Fn(&mut [f32], &mut [f32], &[T]) + Sync + Send,
) -> Vec<f32> {
    let mut sums = vec![0f32; n];
    let scratch = WorkerScratch::new(scratch, n.div_ceil(SUM_COLUMNS));
    sums.par_chunks_mut(SUM_COLUMNS)
        .enumerate()
        .for_each(|(i, sums)| {
            scratch.with(|w| {
                let first = i * SUM_COLUMNS;
                for row in rows.chunks_exact(n) {
                    add(w, sums, &row[first..first + sums.len()]);
                }
            })
        });
    sums
}

/// Lanes of the partial maxima and sums, so that the row loops vectorise.
const LANES: usize = 16;

dispatch! {
    /// The largest element of a row (NaN elements are skipped, and show in
    /// the sum instead).
    fn row_max(z: &[f32]) -> f32 {
        let mut parts = [f32::NEG_INFINITY; LANES];
        for chunk in z.chunks(LANES) {
            for (p, &v) in parts.iter_mut().zip(chunk) {
                *p = p.max(v);
            }
        }
        parts.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b))
    }
}

dispatch! {
    /// `out[i] = exp(z[i] - max)`; returns their sum.
    fn exp_shifted_row(z: &[f32], max: f32, out: &mut [f32]) -> f32 {
        let mut parts = [0f32; LANES];
        for (o, z) in out.chunks_mut(LANES).zip(z.chunks(LANES)) {
            for ((p, o), &z) in parts.iter_mut().zip(o.iter_mut()).zip(z) {
                let e = exp(z - max);
                *o = e;
                *p += e;
            }
        }
        parts.iter().sum()
    }
}

dispatch! {
    /// `row *= k`.
    fn scale_row(row: &mut [f32], k: f32) -> () {
        for v in row.iter_mut() {
            *v *= k;
        }
    }
}

/// Checks that every target is a class index of `classes`.
pub(crate) fn check_targets(targets: &[u32], classes: usize) -> Result<()> {
    if let Some((row, t)) = targets
        .iter()
        .enumerate()
        .find(|(_, &t)| t as usize >= classes)
    {
        bail!("target {t} of row {row} is not a class index: the logits have {classes} classes");
    }
    Ok(())
}

/// Whether the cross-entropy's row kernels apply: contiguous f32, bf16 or
/// f16 logits on the CPU. Half-precision rows are widened to f32 one row
/// at a time, as the composed operations would widen the whole logits.
pub(crate) fn applies_rows(t: &Tensor) -> bool {
    t.device().is_cpu()
        && matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && t.is_contiguous()
        && t.elem_count() > 0
}

/// The sum over rows of `logsumexp(z) - z[target]`, for contiguous logits
/// `(rows, classes)` (see [`applies_rows`]), in one pass per row with a row
/// or two of scratch per worker: no tensor the logits' size.
pub(crate) fn cross_entropy_sum(logits: &Tensor, targets: &[u32]) -> Result<f64> {
    match logits.dtype() {
        DType::F32 => rows_sum::<f32>(logits, targets),
        DType::BF16 => rows_sum::<half::bf16>(logits, targets),
        DType::F16 => rows_sum::<half::f16>(logits, targets),
        other => bail!("internal: no cross-entropy row kernel for {other:?}"),
    }
}

fn rows_sum<T: Row>(logits: &Tensor, targets: &[u32]) -> Result<f64> {
    let (rows, n) = logits.dims2()?;
    let scratch = WorkerScratch::new(n + T::wide_len(n), rows.div_ceil(ROWS_PER_TASK));
    with_slice::<T, _>(logits, |z| {
        z.par_chunks(n * ROWS_PER_TASK)
            .zip(targets.par_chunks(ROWS_PER_TASK))
            .map(|(rows, targets)| {
                scratch.with(|w| {
                    let (exps, wide) = w.split_at_mut(n);
                    rows.chunks_exact(n)
                        .zip(targets)
                        .map(|(z, &t)| {
                            let z = T::as_f32(z, wide);
                            let max = row_max(z);
                            let sum = exp_shifted_row(z, max, exps);
                            f64::from(max + sum.ln() - z[t as usize])
                        })
                        .sum::<f64>()
                })
            })
            .sum()
    })
}

/// `(softmax(z) - onehot(targets)) * scale` for contiguous logits `(rows,
/// classes)` (see [`applies_rows`]): the cross-entropy's gradient, computed
/// in f32 and written straight into the one tensor it returns, in the
/// logits' dtype.
pub(crate) fn cross_entropy_grad(logits: &Tensor, targets: &[u32], scale: f32) -> Result<Tensor> {
    match logits.dtype() {
        DType::F32 => rows_grad::<f32>(logits, targets, scale),
        DType::BF16 => rows_grad::<half::bf16>(logits, targets, scale),
        DType::F16 => rows_grad::<half::f16>(logits, targets, scale),
        other => bail!("internal: no cross-entropy row kernel for {other:?}"),
    }
}

fn rows_grad<T: Row>(logits: &Tensor, targets: &[u32], scale: f32) -> Result<Tensor> {
    let (rows, n) = logits.dims2()?;
    let mut d = vec![T::zero(); rows * n];
    let scratch = WorkerScratch::new(2 * T::wide_len(n), rows.div_ceil(ROWS_PER_TASK));
    with_slice::<T, _>(logits, |z| {
        d.par_chunks_mut(n * ROWS_PER_TASK)
            .zip(z.par_chunks(n * ROWS_PER_TASK))
            .zip(targets.par_chunks(ROWS_PER_TASK))
            .for_each(|((d, z), targets)| {
                scratch.with(|w| {
                    let (row, wide) = w.split_at_mut(T::wide_len(n));
                    for ((d, z), &t) in d.chunks_exact_mut(n).zip(z.chunks_exact(n)).zip(targets) {
                        let z = T::as_f32(z, wide);
                        T::write(d, row, |out| {
                            let max = row_max(z);
                            let sum = exp_shifted_row(z, max, out);
                            scale_row(out, scale / sum);
                            out[t as usize] -= scale;
                        });
                    }
                })
            });
    })?;
    Tensor::from_vec(d, (rows, n), &Device::Cpu)
}

/// An element type the cross-entropy's row kernels read and write: f32
/// rows as they are, half-precision ones through an f32 row.
pub(crate) trait Row: WithDType {
    /// The f32 scratch elements a row of `n` needs to be widened: none for
    /// f32, `n` for the half types.
    fn wide_len(n: usize) -> usize;
    /// The row `z` as f32: itself, or widened into `wide` (of
    /// [`wide_len`](Self::wide_len)).
    fn as_f32<'a>(z: &'a [Self], wide: &'a mut [f32]) -> &'a [f32];
    /// Runs `f` on an f32 row that ends up in `d`: `d` itself, or `row`
    /// narrowed into it.
    fn write(d: &mut [Self], row: &mut [f32], f: impl FnOnce(&mut [f32]));
}

impl Row for f32 {
    fn wide_len(_: usize) -> usize {
        0
    }

    fn as_f32<'a>(z: &'a [f32], _: &'a mut [f32]) -> &'a [f32] {
        z
    }

    fn write(d: &mut [f32], _: &mut [f32], f: impl FnOnce(&mut [f32])) {
        f(d)
    }
}

macro_rules! half_row {
    ($t:ty) => {
        impl Row for $t {
            fn wide_len(n: usize) -> usize {
                n
            }

            fn as_f32<'a>(z: &'a [$t], wide: &'a mut [f32]) -> &'a [f32] {
                z.convert_to_f32_slice(wide);
                wide
            }

            fn write(d: &mut [$t], row: &mut [f32], f: impl FnOnce(&mut [f32])) {
                f(row);
                for (d, &v) in d.iter_mut().zip(row.iter()) {
                    *d = <$t>::from_f32(v);
                }
            }
        }
    };
}

half_row!(half::bf16);
half_row!(half::f16);

#[cfg(test)]
mod tests {
    use super::*;

    fn data(rows: usize, n: usize, seed: u32) -> Vec<f32> {
        // Values of mixed signs and magnitudes, so that the order of
        // addition shows in the last bits.
        (0..rows * n)
            .map(|i| {
                let v = ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8) as f32;
                (v / 16_777_216.0 - 0.5) * 10f32.powi((i % 7) as i32 - 3)
            })
            .collect()
    }

    fn bits(t: &Tensor) -> Result<Vec<u32>> {
        Ok(t.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect())
    }

    #[test]
    fn column_sums_equal_candles_sum_over_rows_to_the_bit() -> Result<()> {
        // One block of columns, several, and a last one cut short.
        for (rows, n) in [(37, 5), (300, SUM_COLUMNS), (300, 3 * SUM_COLUMNS + 17)] {
            let g = data(rows, n, 7);
            let ours = Tensor::from_vec(column_sums(&g, n), n, &Device::Cpu)?;
            let candle = Tensor::from_vec(g, (rows, n), &Device::Cpu)?.sum(0)?;
            assert_eq!(bits(&ours)?, bits(&candle)?, "{rows} x {n}");
        }
        Ok(())
    }

    #[test]
    fn every_element_of_a_kernels_output_is_written() -> Result<()> {
        // Rows that do not fill the last task's chunk, through both
        // kernels that write into an output never zeroed.
        let (rows, n) = (2 * ROWS_PER_TASK + 3, 33);
        let z = Tensor::from_vec(data(rows, n, 3), (rows, n), &Device::Cpu)?;
        let g = Tensor::from_vec(data(rows, n, 5), (rows, n), &Device::Cpu)?;
        let (out, kept) = bias_act(z.clone(), None, Activation::Gelu)?;
        let exact = z.to_vec2::<f32>()?;
        for (r, row) in out.to_vec2::<f32>()?.iter().enumerate() {
            for (c, &v) in row.iter().enumerate() {
                assert_eq!(v.to_bits(), gelu(exact[r][c]).to_bits(), "gelu at {r}, {c}");
            }
        }
        let (dz, db) = act_backward(&g, kept.as_ref().unwrap(), Activation::Gelu)?;
        let (g, dz) = (g.to_vec2::<f32>()?, dz.to_vec2::<f32>()?);
        for r in 0..rows {
            for c in 0..n {
                let want = g[r][c] * gelu_grad(exact[r][c]);
                assert_eq!(dz[r][c].to_bits(), want.to_bits(), "dz at {r}, {c}");
            }
        }
        let sums = Tensor::new(dz, &Device::Cpu)?.sum(0)?;
        assert_eq!(bits(&db)?, bits(&sums)?);
        Ok(())
    }

    #[test]
    fn a_saved_tensor_of_another_size_is_an_error() -> Result<()> {
        let g = Tensor::zeros((4, 3), DType::F32, &Device::Cpu)?;
        let saved = Tensor::zeros((4, 2), DType::F32, &Device::Cpu)?;
        let e = act_backward(&g, &saved, Activation::Relu).unwrap_err();
        assert!(
            e.to_string()
                .contains("the activation's saved tensor has 8 elements, its gradient 12"),
            "{e}"
        );
        Ok(())
    }
}
