//! The materialized attention's two halves on the CPU in f32, one
//! (batch, head) pair per task: each pair's products through `gemm` on one
//! thread (`matmul`), its softmax and the softmax's backward row by row
//! between them. candle's batched `matmul` runs the pairs one after the
//! other, each product split over every thread: for a GPT's 256 x 64 heads
//! the threads spent more time meeting than multiplying. The backward's
//! probabilities' gradient is a per-thread block of scratch, not an `n x n`
//! tensor per pair.

use candle_core::{Device, Result, Tensor};
use candle_cpu_math::WorkerScratch;
use rayon::prelude::*;

use super::matmul::{matmul, View};
use super::{as_f32, rows, with_slices};
use crate::materialized::softmax_row;
use crate::shapes::Dims;

/// Whether the kernels compute a call: f32 on the CPU, every query head
/// with its own key/value head, and no empty dimension.
pub(crate) fn applies(q: &Tensor, dims: &Dims) -> bool {
    q.device().is_cpu()
        && q.dtype() == candle_core::DType::F32
        && dims.group() == 1
        && dims.rows() > 0
        && dims.nq > 0
        && dims.nk > 0
        && dims.d > 0
        && dims.dv > 0
}

/// The output `(batch, heads, nq, dv)` and the probabilities `(batch,
/// heads, nq, nk)` of `softmax(q k^T * scale + mask) v`.
pub(crate) fn forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    dims: &Dims,
    scale: f64,
    causal: bool,
) -> Result<(Tensor, Tensor)> {
    let (heads, nq, nk, d, dv) = (dims.rows(), dims.nq, dims.nk, dims.d, dims.dv);
    let (q32, k32, v32) = (as_f32(q)?, as_f32(k)?, as_f32(v)?);
    let mut probs = vec![0f32; heads * nq * nk];
    let mut out = vec![0f32; heads * nq * dv];
    with_slices([&q32, &k32, &v32], |[q, k, v]| {
        probs
            .par_chunks_mut(nq * nk)
            .zip(out.par_chunks_mut(nq * dv))
            .enumerate()
            .for_each(|(h, (p, o))| {
                let (qh, kh) = (&q[h * nq * d..][..nq * d], &k[h * nk * d..][..nk * d]);
                let vh = &v[h * nk * dv..][..nk * dv];
                let (qv, kt) = (View::rows(qh, d), View::transposed(kh, d));
                matmul(p, nk, false, qv, kt, nq, nk, d, 1.0);
                for (i, row) in p.chunks_exact_mut(nk).enumerate() {
                    softmax_row(row, i, scale as f32, causal);
                }
                let (pv, vv) = (View::rows(p, nk), View::rows(vh, dv));
                matmul(o, dv, false, pv, vv, nq, dv, nk, 1.0);
            });
    })?;
    let (b, a) = (dims.batch, dims.q_heads);
    Ok((
        Tensor::from_vec(out, (b, a, nq, dv), &Device::Cpu)?,
        Tensor::from_vec(probs, (b, a, nq, nk), &Device::Cpu)?,
    ))
}

/// The gradients of `q`, `k` and `v` from the probabilities and the
/// output's gradient `d_out`.
pub(crate) fn backward(
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    probs: &Tensor,
    d_out: &Tensor,
    dims: &Dims,
    scale: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (heads, nq, nk, d, dv) = (dims.rows(), dims.nq, dims.nk, dims.d, dims.dv);
    let (q32, k32, v32) = (as_f32(q)?, as_f32(k)?, as_f32(v)?);
    let (p32, do32) = (as_f32(probs)?, as_f32(d_out)?);
    let mut dq = vec![0f32; heads * nq * d];
    let mut dk = vec![0f32; heads * nk * d];
    let mut dvs = vec![0f32; heads * nk * dv];
    // One pair's probabilities' gradient, turned into the scores' in place.
    let scratch = WorkerScratch::new(nq * nk, heads);
    let scale = scale as f32;
    with_slices([&q32, &k32, &v32, &p32, &do32], |[q, k, v, p, g]| {
        dq.par_chunks_mut(nq * d)
            .zip(dk.par_chunks_mut(nk * d))
            .zip(dvs.par_chunks_mut(nk * dv))
            .enumerate()
            .for_each(|(h, ((dq, dk), dvh))| {
                let (qh, kh) = (&q[h * nq * d..][..nq * d], &k[h * nk * d..][..nk * d]);
                let vh = &v[h * nk * dv..][..nk * dv];
                let (ph, gh) = (&p[h * nq * nk..][..nq * nk], &g[h * nq * dv..][..nq * dv]);
                let gv = View::rows(gh, dv);
                // dV = P^T dO
                matmul(
                    dvh,
                    dv,
                    false,
                    View::transposed(ph, nk),
                    gv,
                    nk,
                    dv,
                    nq,
                    1.0,
                );
                scratch.with(|ds| {
                    // dP = dO V^T, then dS = P (dP - rowsum(dP P)) s over it.
                    matmul(ds, nk, false, gv, View::transposed(vh, dv), nq, nk, dv, 1.0);
                    for (row, pr) in ds.chunks_exact_mut(nk).zip(ph.chunks_exact(nk)) {
                        let delta = rows::dot(row, pr);
                        rows::softmax_grad_over(row, pr, delta, scale);
                    }
                    let dsv = View::rows(ds, nk);
                    // dQ = dS K, dK = dS^T Q
                    matmul(dq, d, false, dsv, View::rows(kh, d), nq, d, nk, 1.0);
                    let dst = View::transposed(ds, nk);
                    matmul(dk, d, false, dst, View::rows(qh, d), nk, d, nq, 1.0);
                });
            });
    })?;
    let (b, a) = (dims.batch, dims.q_heads);
    let cpu = Device::Cpu;
    Ok((
        Tensor::from_vec(dq, (b, a, nq, d), &cpu)?,
        Tensor::from_vec(dk, (b, a, nk, d), &cpu)?,
        Tensor::from_vec(dvs, (b, a, nk, dv), &cpu)?,
    ))
}
