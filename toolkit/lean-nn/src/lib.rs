//! Layers for candle 0.11 whose autograd keeps only what their backward
//! needs.
//!
//! candle's autograd keeps every intermediate tensor of an expression. A
//! `candle_nn::Linear` followed by ReLU keeps the matrix product, the sum
//! with the bias and the ReLU's output: three tensors the size of the
//! layer's output. [`LeanLinear::forward_act`] computes `act(x W^T + b)` as
//! one operation (the bias added in place on the CPU) whose backward is
//! written out: ReLU's gradient from its output, GELU's from its input, so
//! the graph keeps the output and, for GELU, the input of the activation.
//! That is what PyTorch keeps for `addmm` followed by an activation. On the
//! CPU in f32 the element-wise work (bias and activation, and in the
//! backward the activation's derivative and the bias's gradient) is one
//! parallel, vectorised pass each way.
//!
//! [`cross_entropy`] is the loss as one operation: its graph keeps the
//! logits, not a log-softmax beside them. [`layer_norm`] keeps its input
//! and two numbers per row, not five tensors the input's size;
//! [`LeanLayerNorm`] is it as a module, from a `candle_nn::LayerNorm`'s
//! variables or new ones ([`lean_layer_norm`]), and [`lean_linear`] makes a
//! [`LeanLinear`] as `candle_nn::linear` makes its layer.
//!
//! For Llama-family decoders, [`rms_norm`], [`rope`] and [`swiglu`] are
//! one operation each, keeping only what their backward needs, and
//! [`LinearCrossEntropy`] is the head and the loss over row chunks, never
//! holding the whole logits.
//!
//! Built from a `candle_nn::Linear`, a [`LeanLinear`] shares its variables,
//! so any optimizer steps it unchanged. Its gradients equal candle-nn's,
//! but where a ReLU's input is exactly 0: there the gradient is 0, as in
//! PyTorch (candle passes it), since the output cannot tell 0 from below.
#![warn(missing_docs)]

mod add;
mod bias;
mod cpu;
mod cpu_half;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
mod cuda_loss;
/// The PTX of `kernels/*.cu`, one constant per file (`build.rs`).
#[cfg(feature = "cuda")]
mod ptx {
    include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
}
#[cfg(test)]
mod emulated;
mod indices;
mod layer;
mod linear;
mod linear_loss;
mod loss;
mod norm;
mod norm_cpu;
#[cfg(any(feature = "cuda", test))]
mod params;
mod product;
mod rms_norm;
mod rope;
mod swiglu;

pub use add::add;
pub use layer::LeanLayer;
pub use linear::{lean_linear, linear_backward, Activation, Kept, LeanLinear};
pub use linear_loss::{linear_cross_entropy, LinearCrossEntropy, LossGrads};
pub use loss::{cross_entropy, cross_entropy_and_grad};
pub use norm::{
    layer_norm, layer_norm_backward, layer_norm_saved, lean_layer_norm, LeanLayerNorm, NormStats,
};
pub use product::BF16_SLICE;
pub use rms_norm::{lean_rms_norm, rms_norm, rms_norm_backward, rms_norm_saved, LeanRmsNorm};
pub use rope::{rope, rope_backward, RopeConfig};
pub use swiglu::{swiglu, swiglu_backward};

/// The dtype a layer sums and normalizes in: f64 for f64, f32 otherwise.
fn accumulation(dtype: candle_core::DType) -> candle_core::DType {
    if dtype == candle_core::DType::F64 {
        candle_core::DType::F64
    } else {
        candle_core::DType::F32
    }
}
