//! The tiled forward and the plain reference.

use candle_core::{bail, DType, Device, Result, Tensor, D};

use crate::config::FlashConfig;
use crate::shapes::{accumulation, fold, repeat_kv, Dims};

/// What [`flash_forward`] returns: all its backward needs besides the
/// inputs, the configuration it ran with included.
#[derive(Debug, Clone)]
pub struct Forward {
    /// `(batch, q_heads, seq, v_dim)`, in the inputs' dtype.
    pub out: Tensor,
    /// `(batch, q_heads, seq)`: each row's log-sum-exp of its scaled
    /// scores, in f32 (f64 for f64 inputs).
    pub lse: Tensor,
    /// The forward's configuration, validated when it ran, which its
    /// backward uses.
    pub(crate) cfg: FlashConfig,
    /// The shapes of `q`, `k` and `v` it ran on: its backward must be given
    /// the same (a key of another length or width would recompute other
    /// scores against this log-sum-exp, and return wrong gradients).
    pub(crate) inputs: [Vec<usize>; 3],
}

/// The shapes of `q`, `k` and `v`, as [`Forward`] keeps them.
pub(crate) fn shapes_of(q: &Tensor, k: &Tensor, v: &Tensor) -> [Vec<usize>; 3] {
    [q, k, v].map(|t| t.dims().to_vec())
}

/// An error naming both when `q`, `k` and `v` are not of the shapes a
/// forward ran on (`inputs`, from [`shapes_of`]): what each backward checks
/// first.
pub(crate) fn same_inputs(
    inputs: &[Vec<usize>; 3],
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Result<()> {
    let given = shapes_of(q, k, v);
    if &given != inputs {
        let [q, k, v] = inputs;
        bail!(
            "q, k and v (of shapes {:?}, {:?}, {:?}) are not the forward's inputs (of shapes \
             {q:?}, {k:?}, {v:?})",
            given[0],
            given[1],
            given[2],
        );
    }
    Ok(())
}

impl Forward {
    /// The gradients of `q`, `k` and `v` (the forward's inputs) given the
    /// output's gradient `d_out`, recomputing each block of probabilities
    /// from the saved log-sum-exp: one block of scores at a time, never the
    /// whole matrix, with the forward's configuration. Gradients come in
    /// the inputs' dtype; grouped key/value heads get their group's sum.
    /// An error for inputs of other shapes than the forward's.
    pub fn backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        d_out: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        crate::backward::backward(q, k, v, self, d_out)
    }
}

pub(crate) fn scale_of(cfg: &FlashConfig, d: usize) -> f64 {
    cfg.scale.unwrap_or(1.0 / (d.max(1) as f64).sqrt())
}

/// A `(rows, cols)` mask in `dtype`: 0 where key `ks + j` may be seen from
/// query `qs + i`, minus infinity elsewhere.
pub(crate) fn causal_mask(
    qs: usize,
    rows: usize,
    ks: usize,
    cols: usize,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let data: Vec<f32> = (0..rows)
        .flat_map(|i| {
            (0..cols).map(move |j| {
                if ks + j <= qs + i {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    Tensor::from_vec(data, (rows, cols), device)?.to_dtype(dtype)
}

/// Scores of a block, scaled and masked: `(rows_total, rows, cols)`, in the
/// dtype of `q` (whose mask is made in that dtype).
pub(crate) fn block_scores(
    q: &Tensor,
    k: &Tensor,
    qs: usize,
    ks: usize,
    causal: bool,
    s: f64,
) -> Result<Tensor> {
    let scores = (q.matmul(&k.transpose(1, 2)?)? * s)?;
    if causal && ks + k.dim(1)? > qs + 1 {
        let mask = causal_mask(qs, q.dim(1)?, ks, k.dim(1)?, q.dtype(), q.device())?;
        scores.broadcast_add(&mask)
    } else {
        Ok(scores)
    }
}

/// Keys a query block starting at `qs` with `rows` rows can see.
pub(crate) fn visible_keys(cfg: &FlashConfig, qs: usize, rows: usize, nk: usize) -> usize {
    if cfg.causal {
        (qs + rows).min(nk)
    } else {
        nk
    }
}

/// The forward: the output and each row's log-sum-exp, one
/// `(q_block x k_block)` block of scores at a time. Keeps no autograd graph:
/// use [`Forward::backward`] for gradients, or
/// [`flash_attention`](crate::flash_attention) for both through candle's
/// autograd.
pub fn flash_forward(q: &Tensor, k: &Tensor, v: &Tensor, cfg: &FlashConfig) -> Result<Forward> {
    cfg.validate()?;
    let dims = Dims::of(q, k, v)?;
    let acc = accumulation(q.dtype());
    let lse_shape = (dims.batch, dims.q_heads, dims.nq);
    if dims.nq == 0 || dims.rows() == 0 {
        return Ok(Forward {
            out: Tensor::zeros(
                (dims.batch, dims.q_heads, dims.nq, dims.dv),
                q.dtype(),
                q.device(),
            )?,
            lse: Tensor::zeros(lse_shape, acc, q.device())?,
            cfg: *cfg,
            inputs: shapes_of(q, k, v),
        });
    }
    if dims.nk == 0 {
        bail!("there are no keys to attend to (k and v have length 0)");
    }
    let s = scale_of(cfg, dims.d);
    if crate::cpu::applies(q, &dims) {
        return crate::cpu::forward(q, k, v, &dims, cfg, s);
    }
    #[cfg(feature = "cuda")]
    if let Some(plan) = crate::flash_cuda::applies(q, &dims) {
        return crate::flash_cuda::forward([q, k, v], &dims, &plan, cfg, s);
    }
    let (q3, k3, v3) = (
        fold(&q.detach(), &dims, acc)?,
        fold(&k.detach(), &dims, acc)?,
        fold(&v.detach(), &dims, acc)?,
    );
    let mut outs = Vec::new();
    let mut lses = Vec::new();
    for qs in (0..dims.nq).step_by(cfg.q_block) {
        let rows = cfg.q_block.min(dims.nq - qs);
        let qb = q3.narrow(1, qs, rows)?;
        let mut state: Option<(Tensor, Tensor, Tensor)> = None; // (max, sum, acc)
        let k_end = visible_keys(cfg, qs, rows, dims.nk);
        for ks in (0..k_end).step_by(cfg.k_block) {
            let cols = cfg.k_block.min(k_end - ks);
            let scores = block_scores(&qb, &k3.narrow(1, ks, cols)?, qs, ks, cfg.causal, s)?;
            let block_max = scores.max_keepdim(D::Minus1)?;
            let new_m = match &state {
                Some((m, _, _)) => m.maximum(&block_max)?,
                None => block_max,
            };
            let p = scores.broadcast_sub(&new_m)?.exp()?;
            let pv = p.matmul(&v3.narrow(1, ks, cols)?)?;
            let p_sum = p.sum_keepdim(D::Minus1)?;
            state = Some(match state {
                // Earlier blocks were exponentiated against the old maximum.
                Some((old_m, l, a)) => {
                    let correction = (old_m - &new_m)?.exp()?;
                    (
                        new_m,
                        (l * &correction)?.add(&p_sum)?,
                        a.broadcast_mul(&correction)?.add(&pv)?,
                    )
                }
                None => (new_m, p_sum, pv),
            });
        }
        let Some((m, l, a)) = state else {
            bail!("internal: no keys for queries {qs}..{}", qs + rows);
        };
        outs.push(a.broadcast_div(&l)?);
        lses.push((m + l.log()?)?);
    }
    let out = Tensor::cat(&outs, 1)?
        .reshape((dims.batch, dims.q_heads, dims.nq, dims.dv))?
        .to_dtype(q.dtype())?;
    let lse = Tensor::cat(&lses, 1)?.reshape(lse_shape)?;
    Ok(Forward {
        out,
        lse,
        cfg: *cfg,
        inputs: shapes_of(q, k, v),
    })
}

/// `softmax(Q K^T * s) V` with every score matrix whole, differentiable
/// through candle's own operations: the reference. Same shapes, heads and
/// mask as [`flash_forward`]; the softmax runs in the inputs' dtype.
pub fn naive_attention(q: &Tensor, k: &Tensor, v: &Tensor, cfg: &FlashConfig) -> Result<Tensor> {
    let dims = Dims::of(q, k, v)?;
    let s = scale_of(cfg, dims.d);
    let (k, v) = (repeat_kv(k, dims.group())?, repeat_kv(v, dims.group())?);
    let scores = (q.contiguous()?.matmul(&k.transpose(2, 3)?.contiguous()?)? * s)?;
    let scores = if cfg.causal {
        let mask = causal_mask(0, dims.nq, 0, dims.nk, q.dtype(), q.device())?;
        scores.broadcast_add(&mask)?
    } else {
        scores
    };
    candle_nn::ops::softmax(&scores, candle_core::D::Minus1)?.matmul(&v.contiguous()?)
}
