//! Layers whose backward a driver calls directly, without candle's graph.
//!
//! candle's backward sums every gradient it makes into a fresh zeros tensor,
//! one for each node of the graph, so a layer whose backward is written out
//! still costs, through candle, a zeros tensor and a sum for its output's
//! gradient and another pair for its input's: two tensors the size of the
//! activations beside the gradients themselves, each filled and added in a
//! pass of its own. A layer that implements [`DirectBackward`] runs its
//! forward without recording a graph, keeps what its backward needs, and
//! hands its gradients straight back: a driver (`candle_checkpoint`'s
//! `Sequential::direct(..).backward`) calls it layer after layer, as PyTorch's autograd
//! calls a node's backward and moves its result on.

use candle_core::{Result, Tensor};

/// The gradients one [`DirectBackward::backward_saved`] call made.
#[derive(Debug)]
pub struct DirectGrads {
    /// The gradient of the layer's input, when it was asked for.
    pub input: Option<Tensor>,
    /// Each parameter the layer used (the tensor itself, shared with its
    /// `Var`) with its gradient. Each gradient is a fresh tensor that
    /// nothing else holds, one per parameter: a driver may hand it on to be
    /// added into in place (`candle_accumulate`'s `add_weighted_with`).
    pub params: Vec<(Tensor, Tensor)>,
}

/// A layer whose forward runs without a graph and whose backward a driver
/// calls directly.
///
/// ```
/// use candle_core::{Device, Result, Tensor, Var};
/// use candle_custom_grad::{DirectBackward, DirectGrads};
/// /// `x W` (no bias).
/// struct Product(Var);
/// impl DirectBackward for Product {
///     type Saved = ();
///     fn forward_saved(&self, x: &Tensor) -> Result<(Tensor, ())> {
///         Ok((x.matmul(&self.0.as_tensor().detach())?, ()))
///     }
///     fn backward_saved(&self, x: &Tensor, _: (), grad: Tensor, want_input: bool)
///         -> Result<DirectGrads> {
///         let w = self.0.as_tensor();
///         let input = if want_input { Some(grad.matmul(&w.t()?)?) } else { None };
///         Ok(DirectGrads { input, params: vec![(w.clone(), x.t()?.matmul(&grad)?)] })
///     }
/// }
/// let dev = Device::Cpu;
/// let layer = Product(Var::new(&[[2f32], [3.0]], &dev)?);
/// let x = Tensor::new(&[[1f32, 4.0]], &dev)?;
/// let (out, saved) = layer.forward_saved(&x)?;
/// assert_eq!(out.to_vec2::<f32>()?, [[14.0]]);
/// let g = layer.backward_saved(&x, saved, Tensor::new(&[[1f32]], &dev)?, true)?;
/// assert_eq!(g.input.unwrap().to_vec2::<f32>()?, [[2.0, 3.0]]);
/// assert_eq!(g.params[0].1.to_vec2::<f32>()?, [[1.0], [4.0]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub trait DirectBackward {
    /// What the forward keeps for the backward beside its input (a layer
    /// whose backward reads its output keeps it here: a handle, no copy).
    type Saved;

    /// The output, with no graph behind it, and what the backward needs.
    fn forward_saved(&self, x: &Tensor) -> Result<(Tensor, Self::Saved)>;

    /// From the forward's input `x`, what it saved, and the output's
    /// gradient `grad`: the parameters' gradients, and the
    /// input's when `want_input`. `grad` is handed over, so that the layer
    /// can free it as soon as it is done with it, as PyTorch's autograd
    /// frees a gradient once the node that consumes it has.
    fn backward_saved(
        &self,
        x: &Tensor,
        saved: Self::Saved,
        grad: Tensor,
        want_input: bool,
    ) -> Result<DirectGrads>;
}
