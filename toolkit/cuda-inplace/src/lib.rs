//! candle's own CUDA kernels launched with an operand's buffer as their
//! output: the launches candle's operations make, in the same order on the
//! same values, so the same bits, without the new tensor each of them
//! allocates. For the `cuda_fwd` of candle's in-place operations
//! (`InplaceOp1`, `InplaceOp2`, `InplaceOp3`), which hand over the output's
//! storage and layout; [`add_assign`] is `sum += g` on tensors.
//!
//! An operand may be the output because each kernel reads an element (or
//! an aligned vector of elements) of its operands and then the same thread
//! writes that element; the softmax gives each row to one warp, whose
//! threads each read and write their own columns (`binary_op_macros.cuh`,
//! `affine.cu`, `unary.cu` and `reduce.cu` in candle-kernels 0.11.1).
//!
//! Everything is behind the `cuda` feature, so that a crate depending on
//! it builds where there is no CUDA toolkit: without it, [`add_assign`]
//! never applies and nothing else is there.

#[cfg(feature = "cuda")]
mod launch;
#[cfg(feature = "cuda")]
mod ops;

#[cfg(feature = "cuda")]
pub use launch::{assign, relu, scale, softmax_last_dim, writable, Binary, MAX_ELEMENTS};
#[cfg(feature = "cuda")]
pub use ops::add_assign;

/// `sum += g` in place on a CUDA GPU, which a build without the `cuda`
/// feature has none of: returns `false`, that it did not.
#[cfg(not(feature = "cuda"))]
pub fn add_assign(sum: &candle_core::Tensor, g: &candle_core::Tensor) -> candle_core::Result<bool> {
    let _ = (sum, g);
    Ok(false)
}
