//! The `n x n` attention as PyTorch's autograd runs it: the probabilities
//! made whole and kept for the backward, nothing else of that size.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Device, InplaceOp1, Layout, Result, Tensor, D};
use candle_custom_grad::{with_backward2, Backward2};
use rayon::prelude::*;

use crate::config::FlashConfig;
use crate::cpu::{rows, with_slices};
use crate::forward::{causal_mask, scale_of};
use crate::shapes::{repeat_kv, Dims};

/// The inputs' sizes and the scores' scale, once `cfg` and the shapes are
/// checked and there is a key to attend to: the start of both materialized
/// forwards.
pub(crate) fn checked(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cfg: &FlashConfig,
) -> Result<(Dims, f64)> {
    cfg.validate()?;
    let dims = Dims::of(q, k, v)?;
    if dims.nk == 0 {
        bail!("there are no keys to attend to (k and v have length 0)");
    }
    let scale = scale_of(cfg, dims.d);
    Ok((dims, scale))
}

/// `softmax(scores * scale)` row by row in place, keys after the query
/// masked out when causal (top-left aligned).
struct SoftmaxInPlace {
    scale: f32,
    causal: bool,
    nq: usize,
    nk: usize,
}

impl InplaceOp1 for SoftmaxInPlace {
    fn name(&self) -> &'static str {
        "scaled-softmax"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        let Some((start, end)) = l.contiguous_offsets() else {
            bail!("scaled-softmax: the scores must be contiguous");
        };
        let CpuStorage::F32(s) = s else {
            bail!("scaled-softmax: f32 only, got {:?}", s.dtype());
        };
        let (nq, nk, scale, causal) = (self.nq, self.nk, self.scale, self.causal);
        s[start..end]
            .par_chunks_mut(nk)
            .enumerate()
            .for_each(|(r, row)| softmax_row(row, r % nq, scale, causal));
        Ok(())
    }
}

/// Row `i` of the scores turned into probabilities in place: scaled, the
/// keys after query `i` masked out when causal (top-left aligned), then
/// the softmax.
pub(crate) fn softmax_row(row: &mut [f32], i: usize, scale: f32, causal: bool) {
    rows::scale(row, scale);
    if causal && i + 1 < row.len() {
        row[i + 1..].fill(f32::NEG_INFINITY);
    }
    let max = rows::max(row);
    let sum = rows::exp_sub_sum(row, max);
    rows::scale(row, 1.0 / sum);
}

/// The probabilities `softmax(q k^T * scale + mask)`, `(.., nq, nk)`.
pub(crate) fn probabilities(q: &Tensor, k: &Tensor, scale: f64, causal: bool) -> Result<Tensor> {
    let (nq, nk) = (q.dim(D::Minus2)?, k.dim(D::Minus2)?);
    let scores = q
        .contiguous()?
        .matmul(&k.transpose(D::Minus2, D::Minus1)?.contiguous()?)?;
    if scores.device().is_cpu() && scores.dtype() == DType::F32 && nk > 0 {
        let op = SoftmaxInPlace {
            scale: scale as f32,
            causal,
            nq,
            nk,
        };
        scores.inplace_op1(&op)?;
        return Ok(scores);
    }
    let scores = (scores * scale)?;
    let scores = if causal {
        let mask = causal_mask(0, nq, 0, nk, scores.dtype(), scores.device())?;
        scores.broadcast_add(&mask)?
    } else {
        scores
    };
    candle_nn::ops::softmax_last_dim(&scores)
}

/// The softmax's backward with the scores' scale: `P (dP - rowsum(dP P)) s`.
pub(crate) fn scores_grad(p: &Tensor, dp: &Tensor, scale: f64) -> Result<Tensor> {
    let (p, dp) = (p.contiguous()?, dp.contiguous()?);
    if p.device().is_cpu() && p.dtype() == DType::F32 && dp.dtype() == DType::F32 {
        let nk = p.dim(D::Minus1)?;
        let mut ds = vec![0f32; p.elem_count()];
        if nk > 0 {
            with_slices([&p, &dp], |[ps, gs]| {
                ds.par_chunks_mut(nk)
                    .zip(ps.par_chunks(nk))
                    .zip(gs.par_chunks(nk))
                    .for_each(|((ds, p), g)| {
                        let delta = rows::dot(g, p);
                        ds.copy_from_slice(p);
                        rows::softmax_grad(ds, g, delta);
                        rows::scale(ds, scale as f32);
                    });
            })?;
        }
        return Tensor::from_vec(ds, p.shape(), &Device::Cpu);
    }
    let delta = (&dp * &p)?.sum_keepdim(D::Minus1)?;
    (dp.broadcast_sub(&delta)? * &p)? * scale
}

/// The probabilities as one autograd operation over `q` and `k`.
struct Probabilities {
    scale: f64,
}

impl Backward2 for Probabilities {
    fn backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        p: &Tensor,
        dp: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let ds = scores_grad(p, dp, self.scale)?;
        let dq = ds.matmul(&k.contiguous()?)?;
        let dk = ds
            .transpose(D::Minus2, D::Minus1)?
            .matmul(&q.contiguous()?)?;
        Ok((Some(dq), Some(dk)))
    }
}

/// `softmax(Q K^T * s) V` with the `n x n` probabilities made whole and kept
/// for the backward, as PyTorch's autograd runs the plain computation: the
/// scores and the softmax are one operation whose backward is written out,
/// so the graph keeps the inputs and the probabilities, not the scores, the
/// scaled and masked scores and the exponentials that
/// [`naive_attention`](crate::naive_attention) (candle's operations) keeps.
/// The honest baseline for what tiling saves. Same shapes, heads and mask
/// as [`naive_attention`](crate::naive_attention), any device; on the CPU
/// in f32 the softmax and its backward are one parallel pass each.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use candle_tiled_attention::{materialized_attention, naive_attention, FlashConfig};
/// let dev = Device::Cpu;
/// let q = Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, 2, 9, 4), &dev)?)?;
/// let k = Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, 2, 9, 4), &dev)?)?;
/// let v = Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, 2, 9, 4), &dev)?)?;
/// let cfg = FlashConfig::causal(true);
/// let a = materialized_attention(&q, &k, &v, &cfg)?;
/// let b = naive_attention(&q, &k, &v, &cfg)?;
/// assert!((&a - &b)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-6);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn materialized_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cfg: &FlashConfig,
) -> Result<Tensor> {
    let (dims, scale) = checked(q, k, v, cfg)?;
    let (k, v) = (repeat_kv(k, dims.group())?, repeat_kv(v, dims.group())?);
    let p = probabilities(&q.detach(), &k.detach(), scale, cfg.causal)?;
    let p = with_backward2(p, [q, &k], Probabilities { scale })?;
    p.matmul(&v.contiguous()?)
}
