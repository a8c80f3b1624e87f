//! Layer normalization's forward and backward on the CPU for f32, bf16 and
//! f16: one pass over a row for its statistics and one to write it, in f32,
//! and no tensor the input's size but the result. Composed of candle's
//! operations, the forward made five such tensors and the backward eight,
//! each in a pass of its own: at the head of a language model, where every
//! activation is still held, they were the step's peak.

use candle_core::{bail, DType, Device, Result, Tensor, D};
use candle_cpu_math::WorkerScratch;
use rayon::prelude::*;

use crate::cpu::{with_slice, Row, ROWS_PER_TASK};

/// Whether the kernels compute a layer norm of `x`: contiguous f32 or
/// half-precision rows on the CPU.
pub(crate) fn applies(x: &Tensor) -> bool {
    x.device().is_cpu()
        && matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && x.is_contiguous()
        && x.elem_count() > 0
        && x.dims().last().is_some_and(|&h| h > 0)
}

/// Lanes of the sums: independent partial sums the compiler keeps in one
/// vector register (a float sum in order would not vectorise).
const LANES: usize = 8;

candle_cpu_math::dispatch! {
    /// The sum of `a[i]`, in [`LANES`] partial sums.
    fn sum(a: &[f32]) -> f32 {
        let mut s = [0f32; LANES];
        let chunks = a.chunks_exact(LANES);
        let tail: f32 = chunks.remainder().iter().sum();
        for x in chunks {
            for l in 0..LANES {
                s[l] += x[l];
            }
        }
        s.iter().sum::<f32>() + tail
    }
}

candle_cpu_math::dispatch! {
    /// The sum of `(a[i] - shift)^2`, in [`LANES`] partial sums.
    fn squares_about(a: &[f32], shift: f32) -> f32 {
        let mut q = [0f32; LANES];
        let chunks = a.chunks_exact(LANES);
        let tail: f32 = chunks.remainder().iter().map(|&x| (x - shift) * (x - shift)).sum();
        for x in chunks {
            for l in 0..LANES {
                q[l] += (x[l] - shift) * (x[l] - shift);
            }
        }
        q.iter().sum::<f32>() + tail
    }
}

candle_cpu_math::dispatch! {
    /// `out[i] = (x[i] - mean) * rstd * w[i] + b[i]`.
    fn normalise(x: &[f32], mean: f32, rstd: f32, w: &[f32], b: &[f32], out: &mut [f32]) -> () {
        for (((o, &x), &w), &b) in out.iter_mut().zip(x).zip(w).zip(b) {
            *o = (x - mean) * rstd * w + b;
        }
    }
}

candle_cpu_math::dispatch! {
    /// One row of the backward: `xhat` written over `dx` (as scratch), the
    /// weight's and bias's parts added to `dw` and `db`, then `dx` itself
    /// (`dxhat = g w`, `dx = (dxhat - mean(dxhat) - xhat mean(dxhat xhat)) rstd`).
    fn backward_row(
        x: &[f32],
        g: &[f32],
        w: &[f32],
        stats: (f32, f32),
        dx: &mut [f32],
        sums: (&mut [f32], &mut [f32]),
    ) -> () {
        let ((mean, rstd), (dw, db)) = (stats, sums);
        let h = x.len() as f32;
        let (mut sd, mut sdx) = ([0f32; LANES], [0f32; LANES]);
        let mut i = 0;
        while i + LANES <= x.len() {
            for l in 0..LANES {
                let j = i + l;
                let xhat = (x[j] - mean) * rstd;
                let d = g[j] * w[j];
                dw[j] += g[j] * xhat;
                db[j] += g[j];
                sd[l] += d;
                sdx[l] += d * xhat;
                dx[j] = xhat;
            }
            i += LANES;
        }
        let (mut td, mut tdx) = (0f32, 0f32);
        for j in i..x.len() {
            let xhat = (x[j] - mean) * rstd;
            let d = g[j] * w[j];
            dw[j] += g[j] * xhat;
            db[j] += g[j];
            td += d;
            tdx += d * xhat;
            dx[j] = xhat;
        }
        let mean_d = (sd.iter().sum::<f32>() + td) / h;
        let mean_dx = (sdx.iter().sum::<f32>() + tdx) / h;
        for ((o, &g), &w) in dx.iter_mut().zip(g).zip(w) {
            *o = (g * w - mean_d - *o * mean_dx) * rstd;
        }
    }
}

/// A vector of `h` numbers as f32.
fn vector(t: &Tensor) -> Result<Vec<f32>> {
    t.detach().to_dtype(DType::F32)?.to_vec1::<f32>()
}

/// The shape of the statistics of `x`: its own with the last dimension 1.
fn stats_shape(x: &Tensor) -> Vec<usize> {
    let mut dims = x.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = 1;
    }
    dims
}

/// The output (in `x`'s dtype), each row's mean and reciprocal deviation
/// (f32, `(..., 1)`).
pub(crate) fn forward(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    match x.dtype() {
        DType::F32 => forward_typed::<f32>(x, weight, bias, eps),
        DType::BF16 => forward_typed::<half::bf16>(x, weight, bias, eps),
        DType::F16 => forward_typed::<half::f16>(x, weight, bias, eps),
        other => bail!("internal: no layer norm kernel for {other:?}"),
    }
}

fn forward_typed<T: Row>(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    let h = x.dim(D::Minus1)?;
    let rows = x.elem_count() / h;
    let (w, b) = (vector(weight)?, vector(bias)?);
    let eps = eps as f32;
    let mut out = vec![T::zero(); rows * h];
    let mut mean = vec![0f32; rows];
    let mut rstd = vec![0f32; rows];
    let scratch = WorkerScratch::new(2 * T::wide_len(h), rows.div_ceil(ROWS_PER_TASK));
    with_slice::<T, _>(x, |x| {
        out.par_chunks_mut(h * ROWS_PER_TASK)
            .zip(x.par_chunks(h * ROWS_PER_TASK))
            .zip(mean.par_chunks_mut(ROWS_PER_TASK))
            .zip(rstd.par_chunks_mut(ROWS_PER_TASK))
            .for_each(|(((out, x), mean), rstd)| {
                scratch.with(|s| {
                    let (row, wide) = s.split_at_mut(T::wide_len(h));
                    let rows = out.chunks_exact_mut(h).zip(x.chunks_exact(h));
                    for (((out, x), m), r) in rows.zip(mean.iter_mut()).zip(rstd.iter_mut()) {
                        let x = T::as_f32(x, wide);
                        // Two passes, as the composed form: the mean, then
                        // the squares about it (no cancellation).
                        *m = sum(x) / h as f32;
                        let squares = squares_about(x, *m);
                        *r = 1.0 / (squares / h as f32 + eps).sqrt();
                        T::write(out, row, |o| normalise(x, *m, *r, &w, &b, o));
                    }
                })
            });
    })?;
    let stats = stats_shape(x);
    Ok((
        Tensor::from_vec(out, x.shape(), &Device::Cpu)?,
        Tensor::from_vec(mean, stats.as_slice(), &Device::Cpu)?,
        Tensor::from_vec(rstd, stats.as_slice(), &Device::Cpu)?,
    ))
}

/// The gradients of the input (`x`'s dtype), the weight and the bias (the
/// weight's dtype) from the input, the weight, the statistics and the
/// output's gradient `grad` (of `x`'s dtype and shape, contiguous).
pub(crate) fn backward(
    x: &Tensor,
    weight: &Tensor,
    (mean, rstd): (&Tensor, &Tensor),
    grad: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    match x.dtype() {
        DType::F32 => backward_typed::<f32>(x, weight, (mean, rstd), grad),
        DType::BF16 => backward_typed::<half::bf16>(x, weight, (mean, rstd), grad),
        DType::F16 => backward_typed::<half::f16>(x, weight, (mean, rstd), grad),
        other => bail!("internal: no layer norm kernel for {other:?}"),
    }
}

fn backward_typed<T: Row>(
    x: &Tensor,
    weight: &Tensor,
    (mean, rstd): (&Tensor, &Tensor),
    grad: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let h = x.dim(D::Minus1)?;
    let rows = x.elem_count() / h;
    let w = vector(weight)?;
    let (mean, rstd) = (
        mean.flatten_all()?.to_vec1::<f32>()?,
        rstd.flatten_all()?.to_vec1::<f32>()?,
    );
    if w.len() != h || mean.len() != rows || rstd.len() != rows {
        bail!(
            "a layer norm over {rows} rows of {h}: the weight has {} numbers, the statistics {} \
             and {} (pass the forward's)",
            w.len(),
            mean.len(),
            rstd.len()
        );
    }
    let mut dx = vec![T::zero(); rows * h];
    let scratch = WorkerScratch::new(3 * T::wide_len(h), rows.div_ceil(ROWS_PER_TASK));
    // Each task's parts of the weight's and bias's gradients, summed in the
    // tasks' order afterwards: the same bits on any number of threads.
    let parts: Vec<Vec<f32>> = with_slice::<T, _>(x, |x| {
        with_slice::<T, _>(grad, |g| {
            dx.par_chunks_mut(h * ROWS_PER_TASK)
                .zip(x.par_chunks(h * ROWS_PER_TASK))
                .zip(g.par_chunks(h * ROWS_PER_TASK))
                .zip(mean.par_chunks(ROWS_PER_TASK))
                .zip(rstd.par_chunks(ROWS_PER_TASK))
                .map(|((((dx, x), g), mean), rstd)| {
                    let mut part = vec![0f32; 2 * h];
                    let (dw, db) = part.split_at_mut(h);
                    scratch.with(|s| {
                        let (row, wide) = s.split_at_mut(T::wide_len(h));
                        let (wide_x, wide_g) = wide.split_at_mut(T::wide_len(h));
                        let rows = dx.chunks_exact_mut(h).zip(x.chunks_exact(h));
                        for (((dx, x), g), stats) in rows
                            .zip(g.chunks_exact(h))
                            .zip(mean.iter().copied().zip(rstd.iter().copied()))
                        {
                            let (x, g) = (T::as_f32(x, wide_x), T::as_f32(g, wide_g));
                            T::write(dx, row, |d| {
                                backward_row(x, g, &w, stats, d, (&mut *dw, &mut *db))
                            });
                        }
                    });
                    part
                })
                .collect()
        })
    })??;
    let mut sums = vec![0f32; 2 * h];
    for part in &parts {
        for (s, p) in sums.iter_mut().zip(part) {
            *s += p;
        }
    }
    let db = sums.split_off(h);
    let wdtype = weight.dtype();
    Ok((
        Tensor::from_vec(dx, x.shape(), &Device::Cpu)?,
        Tensor::from_vec(sums, h, &Device::Cpu)?.to_dtype(wdtype)?,
        Tensor::from_vec(db, h, &Device::Cpu)?.to_dtype(wdtype)?,
    ))
}
