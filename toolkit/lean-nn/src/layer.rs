//! A fused layer ready for either backward.

use candle_core::{Module, Result, Tensor};
use candle_custom_grad::{DirectBackward, DirectGrads};

use crate::linear::{Activation, Kept, LeanLinear};

/// A [`LeanLinear`] and its activation as one layer: a `Module`, whose
/// backward runs through candle's graph, and a [`DirectBackward`], whose
/// backward a driver such as `candle_checkpoint::Sequential::direct` calls
/// directly. The same gradients either way.
///
/// ```
/// use candle_core::{Device, Module, Tensor};
/// use candle_custom_grad::DirectBackward;
/// use candle_lean_nn::{Activation, LeanLayer, LeanLinear};
/// let dev = Device::Cpu;
/// let w = Tensor::new(&[[1f32, -1.0], [0.5, 2.0]], &dev)?;
/// let layer = LeanLayer::new(LeanLinear::new(w, None)?, Activation::Relu);
/// let x = Tensor::new(&[[1f32, 2.0]], &dev)?;
/// let (out, kept) = layer.forward_saved(&x)?;
/// assert_eq!(out.to_vec2::<f32>()?, layer.forward(&x)?.to_vec2::<f32>()?);
/// let g = layer.backward_saved(&x, kept, Tensor::ones((1, 2), candle_core::DType::F32, &dev)?, true)?;
/// // ReLU passes only the second output (the first is -1): d/dx = W's second row.
/// assert_eq!(g.input.unwrap().to_vec2::<f32>()?, [[0.5, 2.0]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct LeanLayer {
    linear: LeanLinear,
    act: Activation,
}

impl LeanLayer {
    /// `act(x W^T + b)` of `linear`.
    pub fn new(linear: LeanLinear, act: Activation) -> Self {
        Self { linear, act }
    }

    /// The linear part.
    pub fn linear(&self) -> &LeanLinear {
        &self.linear
    }

    /// The activation.
    pub fn activation(&self) -> Activation {
        self.act
    }
}

impl Module for LeanLayer {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.linear.forward_act(x, self.act)
    }
}

impl DirectBackward for LeanLayer {
    /// GELU's input, or a ReLU's output.
    type Saved = Kept;

    fn forward_saved(&self, x: &Tensor) -> Result<(Tensor, Self::Saved)> {
        self.linear.forward_saved(x, self.act)
    }

    fn backward_saved(
        &self,
        x: &Tensor,
        kept: Kept,
        grad: Tensor,
        want_input: bool,
    ) -> Result<DirectGrads> {
        let (input, dw, db) = self.linear.backward_saved(x, kept, grad, want_input)?;
        let mut params = vec![(self.linear.weight().clone(), dw)];
        params.extend(self.linear.bias().cloned().zip(db));
        Ok(DirectGrads { input, params })
    }
}
