//! The `n x n` attention as PyTorch's autograd runs it: the probabilities
//! made whole and kept for the backward, nothing else of that size.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, InplaceOp1, Layout, Result, Tensor, D};
use candle_cpu_math::WorkerScratch;
use candle_custom_grad::{with_backward2, Backward2};
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use crate::config::FlashConfig;
use crate::cpu::rows;
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
        let (nq, nk, scale, causal) = (self.nq, self.nk, self.scale, self.causal);
        let row = |r: usize, row: &mut [f32]| softmax_row(row, r % nq, scale, causal);
        match s {
            CpuStorage::F32(s) => s[start..end]
                .par_chunks_mut(nk)
                .enumerate()
                .for_each(|(r, z)| row(r, z)),
            CpuStorage::BF16(s) => half_rows(&mut s[start..end], nk, row),
            CpuStorage::F16(s) => half_rows(&mut s[start..end], nk, row),
            other => bail!("scaled-softmax: f32, bf16 or f16, got {:?}", other.dtype()),
        }
        Ok(())
    }
}

/// `f` on each row of `nk` of half-precision `rows` (with the row's index),
/// widened to f32 and rounded back once: the f32 row kernels for bf16 and
/// f16. Each row's arithmetic is f32, where candle's composed operations
/// round to the half type after each one (the scale, the mask, the
/// exponentials, their sum, the division).
pub(crate) fn half_rows<T>(rows: &mut [T], nk: usize, f: impl Fn(usize, &mut [f32]) + Sync)
where
    T: Send + Sync,
    [T]: HalfFloatSliceExt,
{
    let scratch = WorkerScratch::new(nk, rows.len().div_ceil(nk.max(1)));
    rows.par_chunks_mut(nk).enumerate().for_each(|(r, row)| {
        scratch.with(|wide| {
            row.convert_to_f32_slice(wide);
            f(r, wide);
            row.convert_from_f32_slice(wide);
        })
    });
}

/// `f` on each row of `nk` of half-precision `rows`, beside the same row of
/// `other`, both widened to f32; `rows` rounded back once.
pub(crate) fn half_rows2<T>(
    rows: &mut [T],
    other: &[T],
    nk: usize,
    f: impl Fn(&mut [f32], &[f32]) + Sync,
) where
    T: Send + Sync,
    [T]: HalfFloatSliceExt,
{
    let scratch = WorkerScratch::new(2 * nk, rows.len().div_ceil(nk.max(1)));
    rows.par_chunks_mut(nk)
        .zip(other.par_chunks(nk))
        .for_each(|(row, other)| {
            scratch.with(|w| {
                let (wide, wide_other) = w.split_at_mut(nk);
                row.convert_to_f32_slice(wide);
                other.convert_to_f32_slice(wide_other);
                f(wide, wide_other);
                row.convert_from_f32_slice(wide);
            })
        });
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

/// Whether the CPU's row kernels take tensors of `dtype`.
pub(crate) fn rows_apply(t: &Tensor) -> bool {
    t.device().is_cpu() && matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16)
}

/// The probabilities `softmax(q k^T * scale + mask)`, `(.., nq, nk)`.
pub(crate) fn probabilities(q: &Tensor, k: &Tensor, scale: f64, causal: bool) -> Result<Tensor> {
    let (nq, nk) = (q.dim(D::Minus2)?, k.dim(D::Minus2)?);
    let scores = q
        .contiguous()?
        .matmul(&k.transpose(D::Minus2, D::Minus1)?.contiguous()?)?;
    if rows_apply(&scores) && nk > 0 {
        let op = SoftmaxInPlace {
            scale: scale as f32,
            causal,
            nq,
            nk,
        };
        scores.inplace_op1(&op)?;
        return Ok(scores);
    }
    #[cfg(feature = "cuda")]
    if candle_inplace::writable(&scores) {
        let mask = causal
            .then(|| causal_mask(0, nq, 0, nk, scores.dtype(), scores.device()))
            .transpose()?;
        crate::cuda::softmax_in_place(&scores, scale, mask.as_ref())?;
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
    let nk = p.dim(D::Minus1)?;
    if rows_apply(&p) && p.dtype() == dp.dtype() && nk > 0 {
        // The row kernel of the direct backward, over a copy of `dp`.
        let ds = dp.copy()?;
        ds.inplace_op2(
            &p,
            &crate::materialized_direct::SoftmaxGradOver::new(nk, scale),
        )?;
        return Ok(ds);
    }
    #[cfg(feature = "cuda")]
    if crate::cuda::backward_applies(&dp, &p) {
        // The composed operations' bits, with one new matrix: the result.
        let delta = crate::cuda::row_dots(&dp, &p)?;
        let ds = dp.broadcast_sub(&delta)?;
        crate::cuda::mul_scale_in_place(&ds, &p, scale)?;
        return Ok(ds);
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
/// the softmax and its backward are one parallel pass each, in f32 (bf16
/// and f16 rows widened to f32 and rounded once). With the `cuda` feature,
/// on a CUDA GPU they are candle's own kernels writing over the scores and
/// over the scores' gradient: candle's composed operations' bits, without
/// their intermediate matrices.
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Scores of mixed signs and sizes, `(2, nq, d)` and `(2, nk, d)`.
    fn operands(dtype: DType) -> Result<(Tensor, Tensor)> {
        let dev = Device::Cpu;
        let q = Tensor::randn(0f32, 1.5, (2, 24, 8), &dev)?.to_dtype(dtype)?;
        let k = Tensor::randn(0f32, 1.5, (2, 40, 8), &dev)?.to_dtype(dtype)?;
        Ok((q, k))
    }

    /// The largest difference from `want`, in units of the half type's last
    /// place at each value.
    fn ulps(got: &Tensor, want: &[f64], dtype: DType) -> Result<f64> {
        ulps_beyond(got, want, &vec![0.0; want.len()], dtype)
    }

    /// As [`ulps`], of what each difference exceeds its `slack` by.
    fn ulps_beyond(got: &Tensor, want: &[f64], slack: &[f64], dtype: DType) -> Result<f64> {
        // The last place's size relative to a value's binade, and its
        // smallest (f16's subnormals; bf16 has f32's range).
        let (eps, least) = if dtype == DType::BF16 {
            (2f64.powi(-7), 2f64.powi(-133))
        } else {
            (2f64.powi(-10), 2f64.powi(-24))
        };
        let got = got.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
        Ok(got
            .iter()
            .zip(want)
            .zip(slack)
            .map(|((g, w), slack)| {
                let ulp = (eps * 2f64.powi(w.abs().max(least).log2().floor() as i32)).max(least);
                ((g - w).abs() - slack).max(0.0) / ulp
            })
            .fold(0.0, f64::max))
    }

    #[test]
    fn half_precision_probabilities_round_the_f32_softmax_once() -> Result<()> {
        for dtype in [DType::BF16, DType::F16] {
            for causal in [false, true] {
                let (q, k) = operands(dtype)?;
                let scale = 0.35;
                let p = probabilities(&q, &k, scale, causal)?;
                assert_eq!(p.dtype(), dtype);
                // The exact softmax of the same half-precision scores.
                let scores = q.matmul(&k.t()?)?.to_dtype(DType::F64)?;
                let (nq, nk) = (24, 40);
                let mut want = Vec::new();
                for (r, row) in scores
                    .reshape((2 * nq, nk))?
                    .to_vec2::<f64>()?
                    .iter()
                    .enumerate()
                {
                    let i = r % nq;
                    let z: Vec<f64> = row
                        .iter()
                        .enumerate()
                        .map(|(j, &s)| {
                            if causal && j > i {
                                f64::NEG_INFINITY
                            } else {
                                s * scale
                            }
                        })
                        .collect();
                    let max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let sum: f64 = z.iter().map(|&v| (v - max).exp()).sum();
                    want.extend(z.iter().map(|&v| (v - max).exp() / sum));
                }
                // Rounded once: within half a unit (and the f32 kernel's
                // own error, far below it).
                let ours = ulps(&p, &want, dtype)?;
                assert!(ours <= 0.51, "{dtype:?}, causal {causal}: {ours} units");
                // candle's operations, each rounded to the half type.
                let mut z = (q.matmul(&k.t()?)? * scale)?;
                if causal {
                    let mask = causal_mask(0, nq, 0, nk, dtype, &Device::Cpu)?;
                    z = z.broadcast_add(&mask)?;
                }
                let composed = ulps(&candle_nn::ops::softmax_last_dim(&z)?, &want, dtype)?;
                assert!(ours < composed, "{dtype:?}: {ours} against {composed}");
            }
        }
        Ok(())
    }

    #[test]
    fn half_precision_scores_gradient_rounds_the_f32_one_once() -> Result<()> {
        for dtype in [DType::BF16, DType::F16] {
            let (q, k) = operands(dtype)?;
            let p = probabilities(&q, &k, 0.35, true)?;
            let dp = Tensor::randn(0f32, 1.0, p.shape(), &Device::Cpu)?.to_dtype(dtype)?;
            let ds = scores_grad(&p, &dp, 0.35)?;
            assert_eq!(ds.dtype(), dtype);
            let nk = 40;
            let p64 = p.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
            let g64 = dp.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
            let (mut want, mut slack) = (Vec::new(), Vec::new());
            for (p, g) in p64.chunks(nk).zip(g64.chunks(nk)) {
                let delta: f64 = p.iter().zip(g).map(|(p, g)| p * g).sum();
                want.extend(p.iter().zip(g).map(|(p, g)| p * (g - delta) * 0.35));
                // What f32 arithmetic may be off by before the one rounding:
                // the row's dot product (nk terms) and the subtraction. Where
                // `g - delta` cancels, that is more than half a unit of the
                // small result (seen: 1.17 units in bf16, on random inputs).
                let dot: f64 = p.iter().zip(g).map(|(p, g)| (p * g).abs()).sum();
                let f32_unit = 2f64.powi(-24);
                slack.extend(p.iter().zip(g).map(|(p, g)| {
                    p * 0.35 * (2.0 * f32_unit * g.abs() + (nk as f64 + 2.0) * f32_unit * dot)
                }));
            }
            let ours = ulps_beyond(&ds, &want, &slack, dtype)?;
            assert!(ours <= 0.51, "{dtype:?}: {ours} units");
        }
        Ok(())
    }
}
