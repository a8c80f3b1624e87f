//! candle's operations written over an operand instead of into a new
//! tensor. [`add_assign`] is `sum += g` on the CPU or a CUDA GPU; with the
//! `cuda` feature, candle's own CUDA kernels launched with an operand's
//! buffer as their output: the launches candle's operations make, in the
//! same order on the same values, so the same bits, without the new tensor
//! each of them allocates. For the `cuda_fwd` of candle's in-place operations
//! (`InplaceOp1`, `InplaceOp2`, `InplaceOp3`), which hand over the output's
//! storage and layout.
//!
//! An operand may be the output because each kernel reads an element (or
//! an aligned vector of elements) of its operands and then the same thread
//! writes that element; the softmax gives each row to one warp, whose
//! threads each read and write their own columns (`binary_op_macros.cuh`,
//! `affine.cu`, `unary.cu` and `reduce.cu` in candle-kernels 0.11.1).
//!
//! Everything CUDA is behind the `cuda` feature, so that a crate depending
//! on it builds where there is no CUDA toolkit: without it, [`add_assign`]
//! adds f32 tensors on the CPU, and nothing else is there.

mod add;
#[cfg(test)]
mod emulated;
#[cfg(feature = "cuda")]
mod launch;
#[cfg(any(test, feature = "cuda"))]
mod params;
#[cfg(any(test, feature = "cuda"))]
mod plan;

pub use add::add_assign;
#[cfg(feature = "cuda")]
pub use launch::{assign, relu, scale, softmax_last_dim, writable, Binary};
#[cfg(feature = "cuda")]
pub use plan::MAX_ELEMENTS;
