//! The attention on the CPU as a kernel of its own, for f32, f16 and bf16.
//!
//! Built as PyTorch's CPU flash kernel is: the forward runs query blocks in
//! parallel, each against the keys a block at a time with an online softmax;
//! the backward runs the (batch, head) pairs in parallel and, per block,
//! recomputes the probabilities from the saved log-sum-exp and does four
//! matrix products. Products go through `gemm` on strided views (no copy of a
//! transposed key block); exponentials through a vectorised polynomial.
//! The outputs and the per-thread scratch are allocated by the calling
//! thread, so that an allocator charging allocations to the caller's context
//! sees them there (`gemm`'s own small packing buffers are allocated by the
//! worker threads).

pub(crate) mod materialized;
mod matmul;
pub(crate) mod rows;

use candle_core::{bail, DType, Device, Result, Storage, Tensor};
use candle_cpu_math::WorkerScratch;
use rayon::prelude::*;

use crate::config::FlashConfig;
use crate::forward::Forward;
use crate::shapes::Dims;
use matmul::{matmul, View};

/// Whether the kernel computes a call: CPU tensors of f32 or a half type,
/// with non-empty heads (the general path handles the rest).
pub(crate) fn applies(q: &Tensor, dims: &Dims) -> bool {
    q.device().is_cpu()
        && matches!(q.dtype(), DType::F32 | DType::F16 | DType::BF16)
        && dims.d > 0
        && dims.dv > 0
}

/// The sizes of a call with (batch, head) pairs folded into `heads`.
#[derive(Debug, Clone, Copy)]
struct Plan {
    heads: usize,
    q_heads: usize,
    kv_heads: usize,
    nq: usize,
    nk: usize,
    d: usize,
    dv: usize,
    qb: usize,
    kb: usize,
    causal: bool,
    scale: f32,
}

impl Plan {
    fn new(dims: &Dims, cfg: &FlashConfig, scale: f64) -> Self {
        Self {
            heads: dims.rows(),
            q_heads: dims.q_heads,
            kv_heads: dims.kv_heads,
            nq: dims.nq,
            nk: dims.nk,
            d: dims.d,
            dv: dims.dv,
            qb: cfg.q_block.min(dims.nq.max(1)),
            kb: cfg.k_block.min(dims.nk.max(1)),
            causal: cfg.causal,
            scale: scale as f32,
        }
    }

    fn group(&self) -> usize {
        self.q_heads / self.kv_heads
    }

    /// The key/value head that folded query head `head` reads.
    fn kv_head(&self, head: usize) -> usize {
        (head / self.q_heads) * self.kv_heads + (head % self.q_heads) / self.group()
    }

    /// Keys a query block starting at `qs` with `rows` rows can see.
    fn visible(&self, qs: usize, rows: usize) -> usize {
        if self.causal {
            (qs + rows).min(self.nk)
        } else {
            self.nk
        }
    }

    /// Minus infinity where key `ks + j` comes after query `qs + i`.
    fn mask(&self, scores: &mut [f32], qs: usize, ks: usize, cols: usize) {
        if !self.causal {
            return;
        }
        for (i, row) in scores.chunks_exact_mut(cols).enumerate() {
            let first_hidden = (qs + i + 1).saturating_sub(ks);
            if first_hidden < cols {
                row[first_hidden..].fill(f32::NEG_INFINITY);
            }
        }
    }
}

/// An f32 copy of `t` (none when it already is contiguous f32).
fn as_f32(t: &Tensor) -> Result<Tensor> {
    t.detach().to_dtype(DType::F32)?.contiguous()
}

/// Runs `f` over the f32 elements of contiguous CPU tensors.
pub(crate) fn with_slices<R, const N: usize>(
    ts: [&Tensor; N],
    f: impl FnOnce([&[f32]; N]) -> R,
) -> Result<R> {
    let guards = ts.map(|t| t.storage_and_layout());
    let mut slices: [&[f32]; N] = [&[]; N];
    for (slot, (storage, layout)) in slices.iter_mut().zip(&guards) {
        let Storage::Cpu(cpu) = &**storage else {
            bail!("internal: the CPU kernel got a tensor on another device");
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            bail!("internal: the CPU kernel got a strided tensor");
        };
        *slot = &cpu.as_slice::<f32>()?[start..end];
    }
    Ok(f(slices))
}

/// [`flash_forward`](crate::flash_forward) on the CPU.
pub(crate) fn forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    dims: &Dims,
    cfg: &FlashConfig,
    scale: f64,
) -> Result<Forward> {
    let plan = Plan::new(dims, cfg, scale);
    let (q32, k32, v32) = (as_f32(q)?, as_f32(k)?, as_f32(v)?);
    let (out, lse) = with_slices([&q32, &k32, &v32], |[q, k, v]| {
        forward_heads(q, k, v, &plan)
    })?;
    let (b, h) = (dims.batch, dims.q_heads);
    Ok(Forward {
        out: Tensor::from_vec(out, (b, h, dims.nq, dims.dv), &Device::Cpu)?.to_dtype(q.dtype())?,
        lse: Tensor::from_vec(lse, (b, h, dims.nq), &Device::Cpu)?,
        cfg: *cfg,
        inputs: crate::forward::shapes_of(q, k, v),
    })
}

fn forward_heads(q: &[f32], k: &[f32], v: &[f32], p: &Plan) -> (Vec<f32>, Vec<f32>) {
    let mut out = vec![0f32; p.heads * p.nq * p.dv];
    let mut lse = vec![0f32; p.heads * p.nq];
    // Scores of a block, then each row's running maximum and sum.
    let scratch = WorkerScratch::new(p.qb * p.kb + 2 * p.qb, p.heads * p.nq.div_ceil(p.qb));
    out.par_chunks_mut(p.nq * p.dv)
        .zip(lse.par_chunks_mut(p.nq))
        .enumerate()
        .for_each(|(head, (out, lse))| {
            let kv = p.kv_head(head);
            let q = &q[head * p.nq * p.d..][..p.nq * p.d];
            let k = &k[kv * p.nk * p.d..][..p.nk * p.d];
            let v = &v[kv * p.nk * p.dv..][..p.nk * p.dv];
            out.par_chunks_mut(p.qb * p.dv)
                .zip(lse.par_chunks_mut(p.qb))
                .enumerate()
                .for_each(|(block, (out, lse))| {
                    scratch.with(|buf| forward_block(p, block * p.qb, q, k, v, out, lse, buf));
                });
        });
    (out, lse)
}

/// The output rows and log-sum-exps of the query block starting at `qs`.
#[allow(clippy::too_many_arguments)]
fn forward_block(
    p: &Plan,
    qs: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
    lse: &mut [f32],
    buf: &mut [f32],
) {
    let rows = lse.len();
    let (scores, rest) = buf.split_at_mut(p.qb * p.kb);
    let (max, sum) = rest.split_at_mut(p.qb);
    max[..rows].fill(f32::NEG_INFINITY);
    sum[..rows].fill(0.0);
    out.fill(0.0);
    let qv = View::rows(&q[qs * p.d..(qs + rows) * p.d], p.d);
    let k_end = p.visible(qs, rows);
    for ks in (0..k_end).step_by(p.kb) {
        let cols = p.kb.min(k_end - ks);
        let s = &mut scores[..rows * cols];
        let kt = View::transposed(&k[ks * p.d..(ks + cols) * p.d], p.d);
        matmul(s, cols, false, qv, kt, rows, cols, p.d, p.scale);
        p.mask(s, qs, ks, cols);
        for (i, row) in s.chunks_exact_mut(cols).enumerate() {
            let new_max = rows::max(row).max(max[i]);
            if new_max == f32::NEG_INFINITY {
                row.fill(0.0); // nothing visible yet in this row
                continue;
            }
            // What was summed so far was exponentiated against the old maximum.
            let correction = (max[i] - new_max).exp();
            let block_sum = rows::exp_sub_sum(row, new_max);
            if correction != 1.0 {
                rows::scale(&mut out[i * p.dv..][..p.dv], correction);
            }
            sum[i] = sum[i] * correction + block_sum;
            max[i] = new_max;
        }
        let vb = View::rows(&v[ks * p.dv..(ks + cols) * p.dv], p.dv);
        matmul(
            out,
            p.dv,
            true,
            View::rows(s, cols),
            vb,
            rows,
            p.dv,
            cols,
            1.0,
        );
    }
    for (i, row) in out.chunks_exact_mut(p.dv).enumerate() {
        rows::scale(row, 1.0 / sum[i]);
        lse[i] = max[i] + sum[i].ln();
    }
}

/// [`Forward::backward`](crate::Forward::backward) on the CPU.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    fwd: &Forward,
    d_out: &Tensor,
    dims: &Dims,
    cfg: &FlashConfig,
    scale: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    let plan = Plan::new(dims, cfg, scale);
    let (q32, k32, v32) = (as_f32(q)?, as_f32(k)?, as_f32(v)?);
    let (o32, do32, lse32) = (as_f32(&fwd.out)?, as_f32(d_out)?, as_f32(&fwd.lse)?);
    if lse32.elem_count() != plan.heads * plan.nq {
        bail!(
            "lse has shape {:?}, expected ({}, {}, {})",
            fwd.lse.dims(),
            dims.batch,
            dims.q_heads,
            dims.nq
        );
    }
    let (dq, dk, dv) = with_slices(
        [&q32, &k32, &v32, &o32, &do32, &lse32],
        |[q, k, v, o, d_out, lse]| backward_heads(q, k, v, o, d_out, lse, &plan),
    )?;
    let cpu = Device::Cpu;
    Ok((
        Tensor::from_vec(dq, q.dims(), &cpu)?.to_dtype(q.dtype())?,
        Tensor::from_vec(dk, k.dims(), &cpu)?.to_dtype(k.dtype())?,
        Tensor::from_vec(dv, v.dims(), &cpu)?.to_dtype(v.dtype())?,
    ))
}

#[allow(clippy::too_many_arguments)]
fn backward_heads(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    o: &[f32],
    d_out: &[f32],
    lse: &[f32],
    p: &Plan,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut dq = vec![0f32; p.heads * p.nq * p.d];
    // Each query head's share of its key/value head's gradient; a group's
    // shares are added after.
    let mut dk = vec![0f32; p.heads * p.nk * p.d];
    let mut dv = vec![0f32; p.heads * p.nk * p.dv];
    // Probabilities and their gradient for a block, and a head's
    // rowsum(dO * O).
    let scratch = WorkerScratch::new(2 * p.qb * p.kb + p.nq, p.heads);
    dq.par_chunks_mut(p.nq * p.d)
        .zip(dk.par_chunks_mut(p.nk * p.d))
        .zip(dv.par_chunks_mut(p.nk * p.dv))
        .enumerate()
        .for_each(|(head, ((dq, dk), dv))| {
            let kv = p.kv_head(head);
            let inputs = HeadInputs {
                q: &q[head * p.nq * p.d..][..p.nq * p.d],
                k: &k[kv * p.nk * p.d..][..p.nk * p.d],
                v: &v[kv * p.nk * p.dv..][..p.nk * p.dv],
                o: &o[head * p.nq * p.dv..][..p.nq * p.dv],
                d_out: &d_out[head * p.nq * p.dv..][..p.nq * p.dv],
                lse: &lse[head * p.nq..][..p.nq],
            };
            scratch.with(|buf| backward_head(p, &inputs, dq, dk, dv, buf));
        });
    if p.group() == 1 {
        return (dq, dk, dv);
    }
    (dq, sum_groups(&dk, p, p.d), sum_groups(&dv, p, p.dv))
}

/// One head's slices of what the backward reads.
struct HeadInputs<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    o: &'a [f32],
    d_out: &'a [f32],
    lse: &'a [f32],
}

fn backward_head(
    p: &Plan,
    x: &HeadInputs,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    buf: &mut [f32],
) {
    let (probs, rest) = buf.split_at_mut(p.qb * p.kb);
    let (dprobs, delta) = rest.split_at_mut(p.qb * p.kb);
    // rowsum(dO * O): the softmax backward's correction term.
    for (i, delta) in delta[..p.nq].iter_mut().enumerate() {
        let row = i * p.dv..(i + 1) * p.dv;
        *delta = rows::dot(&x.d_out[row.clone()], &x.o[row]);
    }
    for qs in (0..p.nq).step_by(p.qb) {
        let rows = p.qb.min(p.nq - qs);
        let qv = View::rows(&x.q[qs * p.d..(qs + rows) * p.d], p.d);
        let dov = View::rows(&x.d_out[qs * p.dv..(qs + rows) * p.dv], p.dv);
        let k_end = p.visible(qs, rows);
        for ks in (0..k_end).step_by(p.kb) {
            let cols = p.kb.min(k_end - ks);
            let (kb, vb) = (
                &x.k[ks * p.d..(ks + cols) * p.d],
                &x.v[ks * p.dv..(ks + cols) * p.dv],
            );
            // P = exp(Q K^T s - L), recomputed.
            let pr = &mut probs[..rows * cols];
            matmul(
                pr,
                cols,
                false,
                qv,
                View::transposed(kb, p.d),
                rows,
                cols,
                p.d,
                p.scale,
            );
            p.mask(pr, qs, ks, cols);
            for (i, row) in pr.chunks_exact_mut(cols).enumerate() {
                rows::exp_sub(row, x.lse[qs + i]);
            }
            // dV += P^T dO
            let dv_block = &mut dv[ks * p.dv..(ks + cols) * p.dv];
            matmul(
                dv_block,
                p.dv,
                true,
                View::transposed(pr, cols),
                dov,
                cols,
                p.dv,
                rows,
                1.0,
            );
            // dP = dO V^T
            let dp = &mut dprobs[..rows * cols];
            matmul(
                dp,
                cols,
                false,
                dov,
                View::transposed(vb, p.dv),
                rows,
                cols,
                p.dv,
                1.0,
            );
            // dS = P * (dP - delta), in place of P
            for (i, (row, g)) in pr
                .chunks_exact_mut(cols)
                .zip(dp.chunks_exact(cols))
                .enumerate()
            {
                rows::softmax_grad(row, g, delta[qs + i]);
            }
            let ds = View::rows(pr, cols);
            // dQ += dS K s
            let dq_block = &mut dq[qs * p.d..(qs + rows) * p.d];
            matmul(
                dq_block,
                p.d,
                true,
                ds,
                View::rows(kb, p.d),
                rows,
                p.d,
                cols,
                p.scale,
            );
            // dK += dS^T Q s
            let dk_block = &mut dk[ks * p.d..(ks + cols) * p.d];
            let dst = View::transposed(pr, cols);
            matmul(dk_block, p.d, true, dst, qv, cols, p.d, rows, p.scale);
        }
    }
}

/// Query heads' shares `(batch, q_heads, nk, width)` summed per key/value
/// head: `(batch, kv_heads, nk, width)`.
fn sum_groups(shares: &[f32], p: &Plan, width: usize) -> Vec<f32> {
    let size = p.nk * width;
    let mut out = vec![0f32; p.heads / p.group() * size];
    out.par_chunks_mut(size).enumerate().for_each(|(kv, dst)| {
        let (batch, j) = (kv / p.kv_heads, kv % p.kv_heads);
        for g in 0..p.group() {
            let head = batch * p.q_heads + j * p.group() + g;
            for (d, s) in dst.iter_mut().zip(&shares[head * size..][..size]) {
                *d += s;
            }
        }
    });
    out
}
