//! Memory-efficient attention for candle 0.11, on any device and dtype.
//!
//! `softmax(Q K^T * s) V` without the `n x n` score matrix: queries in blocks
//! against keys in blocks with an online softmax (a running maximum and sum
//! per row), as FlashAttention does. The forward keeps only its output and
//! each row's log-sum-exp; the backward recomputes each block of
//! probabilities from them (FlashAttention-2):
//!
//! ```text
//! P  = exp(Q K^T * s - L)         (one block)
//! dV += P^T dO
//! dP = dO V^T
//! dS = P * (dP - rowsum(dO * O))
//! dQ += dS K * s,   dK += dS^T Q * s
//! ```
//!
//! * [`flash_attention`]: the attention as one autograd operation, so a
//!   model's `loss.backward()` goes through the recomputing backward.
//! * [`flash_forward`] / [`Forward::backward`]: the two halves, for a
//!   training loop of one's own; the forward's result keeps its
//!   configuration, so the backward cannot be given another.
//! * [`naive_attention`]: the plain computation, the reference.
//! * [`materialized_attention`]: the plain computation as PyTorch's autograd
//!   keeps it (the probabilities only), the honest baseline for tiling.
//! * [`materialized_forward`] / [`Materialized::backward`]: the same without
//!   a graph, its backward holding under two `n x n` matrices on the CPU
//!   in f32 (more elsewhere: see the module's notes).
//!
//! On the CPU, f32, f16 and bf16 calls run a kernel of their own, built as
//! PyTorch's CPU flash kernel is: query blocks (forward) and heads
//! (backward) in parallel on rayon's threads, block products through `gemm`
//! on strided views, a vectorised exponential, and no buffer beyond the
//! outputs but one block of scores per thread (for f32 inputs: f16 and bf16
//! are widened to f32 copies first; with grouped key/value heads the
//! backward sums each query head's share of their gradients). [`FlashConfig::for_length`]
//! picks PyTorch's block sizes. With the `cuda` feature, f32, f16 and
//! bf16 calls with head dimensions up to 128 run kernels of their own on a
//! CUDA GPU (`kernels/flash_*.cu`: `D / 16` threads per query or key row,
//! summing across by warp shuffles, the other side streamed through
//! shared memory, f32 sums; the block sizes are the
//! kernels', not the configuration's), tested on the CPU through an
//! emulation of CUDA's threads (`candle-toolkit-cuda-emulation`); and the materialized
//! attention's softmax and its backward write in place (candle's own
//! kernels, through `candle-inplace`). Other devices, f64 and wider
//! heads compose candle operations block by block.
//!
//! This crate turns on `gemm`'s `x86-v4` feature, so that its products (and,
//! through feature unification, candle's own CPU matrix products in the same
//! build) use AVX-512 where the CPU has it: twice AVX2's width.
//!
//! Tensors are `(batch, heads, seq, head_dim)`. Keys and values may have
//! fewer heads than queries (grouped-query and multi-query attention): query
//! head `h` reads key head `h / (q_heads / kv_heads)`. f16, bf16 and f32
//! inputs are computed with f32 accumulation (f64 in f64) and the results
//! cast back. The causal mask is top-left aligned, as PyTorch's
//! `is_causal`: query `i` sees keys `0..=i`.
#![warn(missing_docs)]

mod backward;
mod config;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
mod flash_cuda;
#[cfg(test)]
mod flash_emulated;
#[cfg(any(feature = "cuda", test))]
mod flash_params;
#[cfg(any(feature = "cuda", test))]
mod flash_plan;
mod forward;
mod materialized;
mod materialized_direct;
mod op;
mod pack;
mod shapes;

pub use config::FlashConfig;
pub use forward::{flash_forward, naive_attention, Forward};
pub use materialized::materialized_attention;
pub use materialized_direct::{materialized_forward, Materialized};
pub use op::flash_attention;
pub use pack::pack_heads;

/// Bytes of the score matrices a naive attention materialises: `heads`
/// matrices of `n x n` elements of `dtype`.
///
/// ```
/// use candle_tiled_attention::score_matrix_bytes;
/// use candle_core::DType;
/// // 32 heads at 4096 tokens in f16: 1 GiB.
/// assert_eq!(score_matrix_bytes(32, 4096, DType::F16), 1 << 30);
/// ```
pub fn score_matrix_bytes(heads: u64, n: u64, dtype: candle_core::DType) -> u64 {
    heads * n * n * dtype.size_in_bytes() as u64
}
