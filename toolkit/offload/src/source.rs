//! Layers whose weights live elsewhere and visit the device only while
//! used: the mechanism that offload (weights on the host) and ZeRO stage 3
//! / FSDP (weights sharded over peers) share.

use std::sync::Arc;

use candle_core::{bail, DType, Device, Result, Tensor, Var};
use candle_custom_grad::{with_backward2, Backward2};
use candle_lean_nn::{linear_backward, Activation, Kept, LeanLinear};

/// Where a linear layer's weights are kept between uses, and where its
/// weight gradients go.
///
/// [`fetched_linear`] calls it twice per step: the forward fetches the
/// weight and the bias, the backward the weight again, then hands over the
/// gradients. What is fetched is dropped as soon as the product is done.
pub trait WeightSource: Send + Sync + 'static {
    /// The device the layer computes on.
    fn device(&self) -> &Device;
    /// The weight `(out, in)` on [`device`](Self::device), in `dtype`.
    fn fetch_weight(&self, dtype: DType) -> Result<Tensor>;
    /// Whether the layer has a bias.
    fn has_bias(&self) -> bool;
    /// The bias `(out,)` on the device in `dtype`, if the layer has one.
    fn fetch_bias(&self, dtype: DType) -> Result<Option<Tensor>>;
    /// The gradients of one backward: the weight's and the bias's (when
    /// there is a bias), on the device.
    fn give_gradients(&self, weight: Tensor, bias: Option<Tensor>) -> Result<()>;
}

/// `y = x W^T + b`, `W` and `b` fetched from `source` for this product and
/// dropped after it, as one operation of candle's autograd: its backward
/// fetches `W` again, gives `x` its gradient and hands the weight
/// gradients to `source`. `anchor` (any variable on the device) makes the
/// operation part of the graph when `x` itself needs no gradient, so that
/// the weights still get theirs.
pub fn fetched_linear<S: WeightSource>(
    x: &Tensor,
    source: &Arc<S>,
    anchor: &Var,
) -> Result<Tensor> {
    fetched_linear_act(x, source, anchor, Activation::Identity)
}

/// [`fetched_linear`] with an activation fused as `candle_lean_nn`'s
/// [`LeanLinear`] fuses it: `act(x W^T + b)`, the graph keeping the input
/// and, for GELU, the activation's input, and nothing of the weights.
pub fn fetched_linear_act<S: WeightSource>(
    x: &Tensor,
    source: &Arc<S>,
    anchor: &Var,
    act: Activation,
) -> Result<Tensor> {
    if !x.device().same_device(source.device()) {
        bail!(
            "the input is on {:?}, the layer computes on {:?}",
            x.device(),
            source.device()
        );
    }
    let (out, kept) = {
        let w = source.fetch_weight(x.dtype())?;
        let b = source.fetch_bias(x.dtype())?;
        LeanLinear::new(w, b)?.forward_saved(x, act)?
        // The fetched weights are dropped here.
    };
    // The op keeps GELU's input only: a ReLU's output is the graph's own
    // output, which candle hands to the backward (kept here, it would be a
    // cycle).
    let kept = match kept {
        Kept::Gelu(z) => Some(z),
        Kept::Identity | Kept::Relu(_) => None,
    };
    with_backward2(
        out,
        [x, anchor.as_tensor()],
        Fetch {
            source: Arc::clone(source),
            act,
            kept,
        },
    )
}

/// The backward: fetch the weight again, give the input its gradient, hand
/// the weight's and the bias's to the source.
struct Fetch<S> {
    source: Arc<S>,
    act: Activation,
    /// GELU's input, kept by the forward.
    kept: Option<Tensor>,
}

impl<S: WeightSource> Backward2 for Fetch<S> {
    fn backward(
        &self,
        x: &Tensor,
        _anchor: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // The backward needs the weight only, not the bias.
        let w = self.source.fetch_weight(grad.dtype())?;
        // Handed over: freed once the input's gradient is made.
        let kept = Kept::new(self.act, out, self.kept.clone())?;
        let (dx, dw, db) = linear_backward(kept, x, w, grad.clone())?;
        self.source
            .give_gradients(dw, self.source.has_bias().then_some(db))?;
        Ok((Some(dx), None))
    }

    fn kept(&self) -> Vec<Tensor> {
        self.kept.iter().cloned().collect()
    }
}
