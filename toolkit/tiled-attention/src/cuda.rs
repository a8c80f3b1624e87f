//! The materialized attention's softmax and its backward in place on a CUDA
//! GPU: candle's own kernels (the scale's `affine`, the mask's `badd`,
//! `softmax`, the backward's `bsub` and `bmul`), launched by
//! `candle-inplace` with the scores' buffer, or their gradient's, as
//! their output. These are the launches candle's composed operations make,
//! in the same order on the same values, so the bits are the same; what
//! goes is the new matrix each of them allocates.

use candle_core::{
    bail, CpuStorage, CudaStorage, InplaceOp1, InplaceOp2, InplaceOp3, Layout, Result, Tensor,
};
use candle_inplace::{assign, scale, softmax_last_dim, Binary};

/// Whether the softmax's backward runs here on the probabilities' gradient
/// `dp` and the probabilities `p`: both writable by candle's kernels in
/// place (`candle_inplace::writable`), of one shape and dtype.
pub(crate) fn backward_applies(dp: &Tensor, p: &Tensor) -> bool {
    candle_inplace::writable(dp)
        && candle_inplace::writable(p)
        && (dp.shape(), dp.dtype()) == (p.shape(), p.dtype())
}

/// `softmax(scores * scale + mask)` over the last dimension, written over
/// `scores` (contiguous, held by nothing else). The mask, when given, is
/// broadcast over the leading dimensions as `broadcast_add` does.
pub(crate) fn softmax_in_place(scores: &Tensor, scale: f64, mask: Option<&Tensor>) -> Result<()> {
    let op = ScaledSoftmax { scale };
    match mask {
        Some(mask) => scores.inplace_op2(&mask.broadcast_as(scores.shape())?, &op),
        None => scores.inplace_op1(&op),
    }
}

/// `g = ((g - delta) * p) * scale`, `delta` broadcast over the last
/// dimension: the softmax's backward written over its incoming gradient `g`
/// (contiguous, held by nothing else), as `(g.broadcast_sub(delta) * p) *
/// scale` computes it.
pub(crate) fn sub_mul_scale_in_place(
    g: &Tensor,
    delta: &Tensor,
    p: &Tensor,
    scale: f64,
) -> Result<()> {
    g.inplace_op3(&delta.broadcast_as(g.shape())?, p, &SubMulScale { scale })
}

/// `g = (g * p) * scale`, written over `g` (contiguous, held by nothing
/// else).
pub(crate) fn mul_scale_in_place(g: &Tensor, p: &Tensor, scale: f64) -> Result<()> {
    g.inplace_op2(p, &MulScale { scale })
}

/// `softmax(x * scale (+ mask))` over the last dimension, in place.
struct ScaledSoftmax {
    scale: f64,
}

impl InplaceOp1 for ScaledSoftmax {
    fn name(&self) -> &'static str {
        "scaled-softmax-cuda"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
        bail!("scaled-softmax-cuda: a CUDA GPU's scores only")
    }

    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> Result<()> {
        scale(s, l, self.scale)?;
        softmax_last_dim(s, l)
    }
}

impl InplaceOp2 for ScaledSoftmax {
    fn name(&self) -> &'static str {
        "scaled-masked-softmax-cuda"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<()> {
        bail!("scaled-masked-softmax-cuda: a CUDA GPU's scores only")
    }

    fn cuda_fwd(
        &self,
        s: &mut CudaStorage,
        l: &Layout,
        mask: &CudaStorage,
        ml: &Layout,
    ) -> Result<()> {
        scale(s, l, self.scale)?;
        assign(Binary::Add, s, l, mask, ml)?;
        softmax_last_dim(s, l)
    }
}

/// `g = ((g - delta) * p) * scale`.
struct SubMulScale {
    scale: f64,
}

impl InplaceOp3 for SubMulScale {
    fn name(&self) -> &'static str {
        "softmax-grad-cuda"
    }

    fn cpu_fwd(
        &self,
        _: &mut CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<()> {
        bail!("softmax-grad-cuda: a CUDA GPU's gradients only")
    }

    fn cuda_fwd(
        &self,
        g: &mut CudaStorage,
        gl: &Layout,
        delta: &CudaStorage,
        dl: &Layout,
        p: &CudaStorage,
        pl: &Layout,
    ) -> Result<()> {
        assign(Binary::Sub, g, gl, delta, dl)?;
        assign(Binary::Mul, g, gl, p, pl)?;
        scale(g, gl, self.scale)
    }
}

/// `g = (g * p) * scale`.
struct MulScale {
    scale: f64,
}

impl InplaceOp2 for MulScale {
    fn name(&self) -> &'static str {
        "mul-scale-cuda"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<()> {
        bail!("mul-scale-cuda: a CUDA GPU's tensors only")
    }

    fn cuda_fwd(
        &self,
        g: &mut CudaStorage,
        gl: &Layout,
        p: &CudaStorage,
        pl: &Layout,
    ) -> Result<()> {
        assign(Binary::Mul, g, gl, p, pl)?;
        scale(g, gl, self.scale)
    }
}

/// `rowsum(dp p)` over the last dimension, shaped as `sum_keepdim` makes
/// it, from blocks of an eighth of the rows, so that the products held at
/// once are an eighth of an `n x n` matrix, not a whole one. The same bits
/// as `(dp * p).sum_keepdim(D::Minus1)`: the products are element-wise,
/// candle's sum picks its launch from a row's length alone, and each block
/// starts at a multiple of 8 rows, so that its rows keep their alignment
/// (the vector loads of candle's bf16 sum depend on it).
pub(crate) fn row_dots(dp: &Tensor, p: &Tensor) -> Result<Tensor> {
    let dims = dp.dims();
    let Some((&nk, lead)) = dims.split_last() else {
        bail!("row sums of a tensor with no dimension");
    };
    let rows: usize = lead.iter().product();
    let (dp2, p2) = (dp.reshape((rows, nk))?, p.reshape((rows, nk))?);
    let block = rows.div_ceil(8).next_multiple_of(8);
    let mut dots = Vec::with_capacity(rows.div_ceil(block));
    let mut start = 0;
    while start < rows {
        let n = block.min(rows - start);
        let products = (dp2.narrow(0, start, n)? * p2.narrow(0, start, n)?)?;
        dots.push(products.sum_keepdim(1)?);
        start += n;
    }
    let mut kept = lead.to_vec();
    kept.push(1);
    Tensor::cat(&dots, 0)?.reshape(kept)
}
