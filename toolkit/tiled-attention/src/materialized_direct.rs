//! The materialized attention's two halves, for a training loop of one's
//! own: no graph, so the backward frees what it no longer needs as it goes.
//! The forward keeps the probabilities; the backward makes the scores'
//! gradient from them. On the CPU in f32, with a key/value head per query
//! head, both halves are kernels that take one (batch, head) pair at a time
//! (`cpu::materialized`): the backward holds the probabilities and one
//! pair's gradient block per thread, less than two `n x n` matrices where
//! an autograd graph holds three (PyTorch: the probabilities, their
//! gradient and the scores' gradient). Otherwise the softmax's gradient is
//! written over the probabilities' gradient where it can be (the CPU in
//! f32), and elsewhere it is a new tensor made of candle's operations, and
//! the peak is higher.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, InplaceOp2, Layout, Result, Tensor, D};
use rayon::prelude::*;

use crate::config::FlashConfig;
use crate::cpu::rows;
use crate::materialized::{checked, half_rows2, probabilities, rows_apply, scores_grad};
use crate::shapes::{repeat_kv, sum_kv_group, Dims};

/// What [`materialized_forward`] returns and [`Materialized::backward`]
/// consumes.
#[derive(Debug, Clone)]
pub struct Materialized {
    /// The attention's output, `(batch, q_heads, nq, dv)`.
    pub out: Tensor,
    /// The probabilities `softmax(q k^T * scale + mask)`, `(batch, q_heads,
    /// nq, nk)`: the one `n x n` matrix kept for the backward.
    pub probs: Tensor,
    /// The scale the scores were multiplied by.
    scale: f64,
    /// The shapes of `q`, `k` and `v` it ran on, which its backward must be
    /// given: fewer key/value heads or a wider head (with a scale given)
    /// would pass every other check and return wrong gradients.
    inputs: [Vec<usize>; 3],
}

/// `softmax(Q K^T * s) V` as [`materialized_attention`](crate::materialized_attention)
/// computes it, returning the probabilities beside the output instead of
/// recording a graph. Same shapes, heads, mask and devices.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_tiled_attention::{materialized_forward, FlashConfig};
/// let dev = Device::Cpu;
/// let q = Tensor::randn(0f32, 1.0, (1, 2, 9, 4), &dev)?;
/// let k = Tensor::randn(0f32, 1.0, (1, 2, 9, 4), &dev)?;
/// let v = Tensor::randn(0f32, 1.0, (1, 2, 9, 4), &dev)?;
/// let cfg = FlashConfig::causal(true);
/// let fwd = materialized_forward(&q, &k, &v, &cfg)?;
/// let out = fwd.out.clone();
/// let (dq, dk, dv) = fwd.backward(&q, &k, &v, &out.ones_like()?)?;
/// assert_eq!((dq.dims(), dk.dims(), dv.dims()), (q.dims(), k.dims(), v.dims()));
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn materialized_forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cfg: &FlashConfig,
) -> Result<Materialized> {
    let (dims, scale) = checked(q, k, v, cfg)?;
    if crate::cpu::materialized::applies(q, &dims) {
        let (out, probs) = crate::cpu::materialized::forward(q, k, v, &dims, scale, cfg.causal)?;
        return Ok(Materialized {
            out,
            probs,
            scale,
            inputs: crate::forward::shapes_of(q, k, v),
        });
    }
    let inputs = crate::forward::shapes_of(q, k, v);
    let (k, v) = (
        repeat_kv(&k.detach(), dims.group())?,
        repeat_kv(&v.detach(), dims.group())?,
    );
    let probs = probabilities(&q.detach(), &k, scale, cfg.causal)?;
    let out = probs.matmul(&v.contiguous()?)?;
    Ok(Materialized {
        out,
        probs,
        scale,
        inputs,
    })
}

impl Materialized {
    /// The gradients of `q`, `k` and `v` (the forward's inputs) given the
    /// output's gradient `d_out`, with the forward's configuration; taken
    /// by value, so that the probabilities are freed here once used.
    /// Grouped key/value heads get their group's sum. An error for inputs
    /// of other shapes than the forward's.
    pub fn backward(
        self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        d_out: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        backward(q, k, v, self, d_out)
    }
}

/// [`Materialized::backward`].
fn backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    fwd: Materialized,
    d_out: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let Materialized {
        out,
        probs,
        scale,
        inputs,
    } = fwd;
    crate::forward::same_inputs(&inputs, q, k, v)?;
    // Validated by the forward (`checked`).
    let dims = Dims::of(q, k, v)?;
    let out_dims = [dims.batch, dims.q_heads, dims.nq, dims.dv];
    if d_out.dims() != out_dims || out.dims() != out_dims {
        bail!(
            "d_out has shape {:?}, the forward's output {:?}; these inputs make {out_dims:?}",
            d_out.dims(),
            out.dims()
        );
    }
    if d_out.dtype() != q.dtype() {
        bail!("d_out is {:?}, the inputs {:?}", d_out.dtype(), q.dtype());
    }
    let expected = [dims.batch, dims.q_heads, dims.nq, dims.nk];
    if probs.dims() != expected {
        bail!(
            "the probabilities have shape {:?}, these inputs make {expected:?}",
            probs.dims()
        );
    }
    drop(out);
    if crate::cpu::materialized::applies(q, &dims) {
        return crate::cpu::materialized::backward((q, k, v), &probs, d_out, &dims, scale);
    }
    let group = dims.group();
    let d_out = d_out.detach().contiguous()?;
    // dV = P^T dO, per query head.
    let dv = probs.transpose(D::Minus2, D::Minus1)?.matmul(&d_out)?;
    // dP = dO V^T, then dS = P (dP - rowsum(dP P)) s written over it.
    let vr = repeat_kv(&v.detach(), group)?.contiguous()?;
    let dp = d_out.matmul(&vr.transpose(D::Minus2, D::Minus1)?)?;
    drop((vr, d_out));
    let ds = softmax_backward(dp, &probs, scale)?;
    drop(probs);
    let kr = repeat_kv(&k.detach(), group)?.contiguous()?;
    let dq = ds.matmul(&kr)?;
    drop(kr);
    let dk = ds
        .transpose(D::Minus2, D::Minus1)?
        .matmul(&q.detach().contiguous()?)?;
    drop(ds);
    Ok((dq, sum_kv_group(&dk, &dims)?, sum_kv_group(&dv, &dims)?))
}

/// The scores' gradient from the probabilities' gradient `dp`: over `dp`
/// itself on the CPU (f32, bf16 or f16) and, with the `cuda` feature, on a
/// CUDA GPU; a new tensor elsewhere.
fn softmax_backward(dp: Tensor, probs: &Tensor, scale: f64) -> Result<Tensor> {
    let contiguous = dp.is_contiguous() && probs.is_contiguous();
    if rows_apply(&dp) && dp.dtype() == probs.dtype() && contiguous {
        let nk = dp.dim(D::Minus1)?;
        if nk > 0 {
            dp.inplace_op2(probs, &SoftmaxGradOver::new(nk, scale))?;
        }
        return Ok(dp);
    }
    #[cfg(feature = "cuda")]
    if crate::cuda::backward_applies(&dp, probs) {
        // The composed operations' bits, with no new matrix.
        let delta = crate::cuda::row_dots(&dp, probs)?;
        crate::cuda::sub_mul_scale_in_place(&dp, &delta, probs, scale)?;
        return Ok(dp);
    }
    scores_grad(probs, &dp, scale)
}

/// `dp = p (dp - rowsum(dp p)) scale`, row by row, in place: f32 rows, or
/// bf16 and f16 ones widened to f32 and rounded once.
pub(crate) struct SoftmaxGradOver {
    nk: usize,
    scale: f32,
}

impl SoftmaxGradOver {
    /// Over rows of `nk`, with the scores' scale.
    pub(crate) fn new(nk: usize, scale: f64) -> Self {
        Self {
            nk,
            scale: scale as f32,
        }
    }
}

impl InplaceOp2 for SoftmaxGradOver {
    fn name(&self) -> &'static str {
        "softmax-grad-over"
    }

    fn cpu_fwd(&self, g: &mut CpuStorage, gl: &Layout, p: &CpuStorage, pl: &Layout) -> Result<()> {
        let (Some((gs, ge)), Some((ps, pe))) = (gl.contiguous_offsets(), pl.contiguous_offsets())
        else {
            bail!("softmax-grad-over: both tensors must be contiguous");
        };
        if ge - gs != pe - ps {
            bail!(
                "softmax-grad-over: the gradient has {} elements, the probabilities {}",
                ge - gs,
                pe - ps
            );
        }
        let (nk, scale) = (self.nk, self.scale);
        let row = |g: &mut [f32], p: &[f32]| {
            let delta = rows::dot(g, p);
            rows::softmax_grad_over(g, p, delta, scale);
        };
        match (g, p) {
            (CpuStorage::F32(g), CpuStorage::F32(p)) => g[gs..ge]
                .par_chunks_mut(nk)
                .zip(p[ps..pe].par_chunks(nk))
                .for_each(|(g, p)| row(g, p)),
            (CpuStorage::BF16(g), CpuStorage::BF16(p)) => {
                half_rows2(&mut g[gs..ge], &p[ps..pe], nk, row)
            }
            (CpuStorage::F16(g), CpuStorage::F16(p)) => {
                half_rows2(&mut g[gs..ge], &p[ps..pe], nk, row)
            }
            (g, p) => bail!(
                "softmax-grad-over: f32, bf16 or f16 of one dtype, got {:?} and {:?}",
                g.dtype(),
                p.dtype()
            ),
        }
        Ok(())
    }
}
