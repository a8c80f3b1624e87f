//! What each launch passes and on what grid, worked out from the layouts
//! alone: `launch.rs` launches these numbers on a GPU, and the tests run
//! the same numbers through candle's own kernels on the CPU
//! (`emulated.rs`).

use candle_core::{bail, DType, Layout, Result};

/// The most elements one launch writes in place. candle's element-wise
/// kernels index with 32 bits and step by the whole grid: past 2^31
/// elements a step wraps round to an element already written, harmless when
/// the output is a new tensor, not when it is an operand.
pub const MAX_ELEMENTS: usize = 1 << 30;

/// A launch's grid (blocks along x) and block (threads along x and y).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Grid {
    pub(crate) blocks: u32,
    pub(crate) threads: (u32, u32),
}

impl Grid {
    /// One thread for each of `n` elements, in blocks of 1,024: the grid
    /// of candle's element-wise launches (cudarc's
    /// `LaunchConfig::for_num_elems`).
    fn elementwise(n: usize) -> Grid {
        Grid {
            blocks: (n as u32).div_ceil(1024),
            threads: (1024, 1),
        }
    }
}

/// The contiguous element range `(start, end)` of the output's layout,
/// checked against [`MAX_ELEMENTS`].
fn output_range(l: &Layout, op: &str) -> Result<(usize, usize)> {
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("{op} in place: the output must be contiguous");
    };
    if end - start > MAX_ELEMENTS {
        bail!(
            "{op} in place: at most 2^30 elements at once on a GPU, not {}",
            end - start
        );
    }
    Ok((start, end))
}

/// `out = out OP rhs` by candle's binary kernel (`BinaryAssign`'s
/// parameters): `numel` is the output range's length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Binary {
    /// The output's elements, `(start, end)` in its buffer: the left
    /// operand and the output.
    pub(crate) out: (usize, usize),
    /// Where `rhs`'s elements start in its buffer.
    pub(crate) rhs_start: usize,
    pub(crate) num_dims: usize,
    /// The output's dims and strides, then `rhs`'s strides, as candle's
    /// `binary_map` passes them; `None` (a null pointer) where `rhs` is
    /// contiguous too.
    pub(crate) dims_and_strides: Option<Vec<usize>>,
    pub(crate) grid: Grid,
}

/// The launch of `out = out OP rhs` (`name` the kernel's, for errors):
/// `out` contiguous, `rhs` of its shape and dtype, contiguous or not (a
/// broadcast, a transpose); `None` where there is no element to write.
pub(crate) fn binary(
    name: &str,
    (ol, out_dtype): (&Layout, DType),
    (rl, rhs_dtype): (&Layout, DType),
) -> Result<Option<Binary>> {
    if rl.shape() != ol.shape() {
        bail!(
            "{name} in place: an operand of shape {:?} for an output of shape {:?}",
            rl.dims(),
            ol.dims()
        );
    }
    if rhs_dtype != out_dtype {
        bail!("{name} in place: a {rhs_dtype:?} operand for a {out_dtype:?} output");
    }
    let out = output_range(ol, name)?;
    if out.0 == out.1 {
        return Ok(None);
    }
    let dims_and_strides =
        (!rl.is_contiguous()).then(|| [ol.dims(), ol.stride(), rl.stride()].concat());
    Ok(Some(Binary {
        out,
        rhs_start: rl.start_offset(),
        num_dims: ol.dims().len(),
        dims_and_strides,
        grid: Grid::elementwise(out.1 - out.0),
    }))
}

/// An element-wise kernel over the output alone (`UnaryInPlace`'s and
/// `AffineInPlace`'s parameters: `numel` the range's length, one
/// dimension, a null `info` and a null `inp`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct InPlace {
    pub(crate) out: (usize, usize),
    pub(crate) grid: Grid,
}

/// The launch of an element-wise kernel `op` over the contiguous `ol`;
/// `None` where there is no element to write.
pub(crate) fn in_place(ol: &Layout, op: &str) -> Result<Option<InPlace>> {
    let out = output_range(ol, op)?;
    Ok((out.0 < out.1).then(|| InPlace {
        out,
        grid: Grid::elementwise(out.1 - out.0),
    }))
}

/// The softmax over the last dimension (`SoftmaxInPlace`'s parameters), on
/// candle-nn's grid for `softmax_last_dim`: a block of one warp (1 x 32
/// threads) for each row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Softmax {
    pub(crate) out: (usize, usize),
    pub(crate) n_cols: i32,
    pub(crate) grid: Grid,
}

/// The softmax's launch over the contiguous `ol`; `None` where there is no
/// element to write.
pub(crate) fn softmax(ol: &Layout) -> Result<Option<Softmax>> {
    let out = output_range(ol, "softmax")?;
    let n_cols = ol.dims().last().copied().unwrap_or(1);
    if out.0 == out.1 || n_cols == 0 {
        return Ok(None);
    }
    let rows = (out.1 - out.0) / n_cols;
    Ok(Some(Softmax {
        out,
        // At most 2^30 elements, so the kernel's `int` indices hold them.
        n_cols: n_cols as i32,
        grid: Grid {
            blocks: rows as u32,
            threads: (1, 32),
        },
    }))
}
