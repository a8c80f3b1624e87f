//! Checking shapes and folding heads into the batch.

use candle_core::{bail, DType, Result, Tensor, D};

/// The dimensions of a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Dims {
    pub batch: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub nq: usize,
    pub nk: usize,
    pub d: usize,
    pub dv: usize,
}

impl Dims {
    pub fn of(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Self> {
        let (b, hq, nq, d) = match q.dims() {
            &[b, h, n, d] => (b, h, n, d),
            other => bail!("q must be (batch, heads, seq, head_dim), got shape {other:?}"),
        };
        let (bk, hk, nk, dk) = match k.dims() {
            &[b, h, n, d] => (b, h, n, d),
            other => bail!("k must be (batch, heads, seq, head_dim), got shape {other:?}"),
        };
        let (bv, hv, nv, dv) = match v.dims() {
            &[b, h, n, d] => (b, h, n, d),
            other => bail!("v must be (batch, heads, seq, head_dim), got shape {other:?}"),
        };
        if bk != b || bv != b {
            bail!("batch differs: q {b}, k {bk}, v {bv}");
        }
        if dk != d {
            bail!("head_dim differs: q {d}, k {dk}");
        }
        if hk != hv || nk != nv {
            bail!(
                "k is {:?} and v {:?}: their heads and lengths must agree",
                k.dims(),
                v.dims()
            );
        }
        if hk == 0 || hq % hk != 0 {
            bail!("{hq} query heads cannot share {hk} key/value heads: q heads must be a multiple");
        }
        if q.dtype() != k.dtype() || q.dtype() != v.dtype() {
            bail!(
                "dtypes differ: q {:?}, k {:?}, v {:?}",
                q.dtype(),
                k.dtype(),
                v.dtype()
            );
        }
        if !q.dtype().is_float() {
            bail!("attention needs float tensors, got {:?}", q.dtype());
        }
        Ok(Self {
            batch: b,
            q_heads: hq,
            kv_heads: hk,
            nq,
            nk,
            d,
            dv,
        })
    }

    pub fn group(&self) -> usize {
        self.q_heads / self.kv_heads
    }

    pub fn rows(&self) -> usize {
        self.batch * self.q_heads
    }
}

/// The dtype the arithmetic runs in: f64 for f64, f32 otherwise.
pub(crate) fn accumulation(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// `(batch, heads, n, d)` to `(batch * q_heads, n, d)` in `acc`, key/value
/// heads repeated for their query group.
pub(crate) fn fold(t: &Tensor, dims: &Dims, acc: DType) -> Result<Tensor> {
    let (b, h, n, d) = t.dims4()?;
    let t = t.to_dtype(acc)?;
    let g = dims.q_heads / h;
    let t = if g > 1 {
        t.unsqueeze(2)?
            .broadcast_as((b, h, g, n, d))?
            .contiguous()?
    } else {
        t.contiguous()?
    };
    t.reshape((b * h * g, n, d))
}

/// The gradient of a folded key/value back to `(batch, kv_heads, n, d)`:
/// the group's query heads add up.
pub(crate) fn unfold_kv(t: &Tensor, dims: &Dims, dtype: DType) -> Result<Tensor> {
    sum_kv_group(t, dims)?.to_dtype(dtype)
}

/// A gradient computed per query head, `(batch, q_heads, n, d)` or folded
/// `(batch * q_heads, n, d)`, back to its key/value heads, `(batch,
/// kv_heads, n, d)`: each group's query heads add up (the inverse of
/// [`repeat_kv`] for gradients).
pub(crate) fn sum_kv_group(t: &Tensor, dims: &Dims) -> Result<Tensor> {
    let (n, d) = (t.dim(D::Minus2)?, t.dim(D::Minus1)?);
    if dims.group() == 1 {
        return t.reshape((dims.batch, dims.kv_heads, n, d));
    }
    t.reshape((dims.batch, dims.kv_heads, dims.group(), n, d))?
        .sum(2)
}

/// Key/value heads repeated for their query group, `(batch, heads * group,
/// n, d)`: a graph of candle's operations, so that gradients sum back.
pub(crate) fn repeat_kv(t: &Tensor, group: usize) -> Result<Tensor> {
    if group == 1 {
        return Ok(t.clone());
    }
    let (b, h, n, d) = t.dims4()?;
    t.unsqueeze(2)?
        .broadcast_as((b, h, group, n, d))?
        .reshape((b, h * group, n, d))
}
