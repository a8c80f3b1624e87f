//! The SwiGLU gate as one operation.

use candle_core::{bail, Result, Tensor};
use candle_custom_grad::{with_backward2, Backward2};

use crate::accumulation;

/// `silu(gate) * up`, the gate of a Llama-family MLP, whose output is
/// `down(silu(gate(x)) * up(x))`, as one autograd operation. Its graph keeps
/// `gate` and `up`;
/// the SiLU's output, which a composition of candle's operations (and
/// PyTorch's autograd) keeps beside them, is recomputed in the backward.
///
/// ```
/// use candle_core::{Device, Var};
/// let dev = Device::Cpu;
/// let (g, u) = (Var::randn(0f32, 1.0, (2, 5), &dev)?, Var::randn(0f32, 1.0, (2, 5), &dev)?);
/// let lean = candle_lean_nn::swiglu(&g, &u)?;
/// let plain = (candle_nn::ops::silu(&g)? * u.as_tensor())?;
/// assert!((&lean - &plain)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-6);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.dims() != up.dims() || gate.dtype() != up.dtype() {
        bail!(
            "SwiGLU multiplies gate and up element by element: gate is {:?} {:?}, up {:?} {:?}",
            gate.dtype(),
            gate.dims(),
            up.dtype(),
            up.dims()
        );
    }
    let out = (gate.detach().silu()? * up.detach())?;
    with_backward2(out, [gate, up], SwiGlu)
}

/// The gradients of [`swiglu`]'s `gate` and `up` from the output's
/// gradient, computed in f32 (f64 for f64) and rounded once.
pub fn swiglu_backward(gate: &Tensor, up: &Tensor, grad: &Tensor) -> Result<(Tensor, Tensor)> {
    let dtype = gate.dtype();
    let acc = accumulation(dtype);
    let g = gate.detach().to_dtype(acc)?;
    let dy = grad.to_dtype(acc)?;
    // sigmoid(g), and silu(g) = g * sigmoid(g).
    let s = (g.neg()?.exp()? + 1.0)?.recip()?;
    let silu = (&g * &s)?;
    let dup = (&dy * &silu)?.to_dtype(dtype)?;
    // d silu / dg = s + g s (1 - s) = s + silu - silu s.
    let dsilu = ((&s + &silu)? - (&silu * &s)?)?;
    drop((s, silu, g));
    let dgate = ((dy * up.detach().to_dtype(acc)?)? * dsilu)?.to_dtype(dtype)?;
    Ok((dgate, dup))
}

struct SwiGlu;

impl Backward2 for SwiGlu {
    fn backward(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dgate, dup) = swiglu_backward(gate, up, grad)?;
        Ok((Some(dgate), Some(dup)))
    }
}
