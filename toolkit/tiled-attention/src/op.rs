//! The attention as one operation of candle's autograd.

use candle_core::{Result, Tensor};
use candle_custom_grad::{with_backward3, Backward3};

use crate::config::FlashConfig;
use crate::forward::{flash_forward, Forward};

/// The recomputing backward, from the log-sum-exp the forward saved. The
/// graph keeps the inputs, the output and the log-sum-exp: no score matrix.
struct Flash {
    cfg: FlashConfig,
    lse: Tensor,
}

impl Backward3 for Flash {
    fn kept(&self) -> Vec<Tensor> {
        vec![self.lse.clone()]
    }

    fn backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let fwd = Forward {
            out: out.detach(),
            lse: self.lse.clone(),
            cfg: self.cfg,
            // candle hands the backward the forward's own inputs.
            inputs: crate::forward::shapes_of(q, k, v),
        };
        let (dq, dk, dv) = fwd.backward(q, k, v, grad)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

/// Attention as one differentiable candle operation: the tiled forward, and
/// in the backward the recomputing [`Forward::backward`](crate::Forward::backward). A model's
/// `loss.backward()` goes through it like any candle op.
///
/// ```
/// use candle_core::{DType, Device, Tensor, Var};
/// use candle_tiled_attention::{flash_attention, naive_attention, FlashConfig};
/// let dev = Device::Cpu;
/// let q = Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, 4, 10, 8), &dev)?)?;
/// let k = Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, 2, 10, 8), &dev)?)?; // 2 kv heads
/// let v = Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, 2, 10, 8), &dev)?)?;
/// let cfg = FlashConfig { causal: true, q_block: 3, k_block: 4, scale: None };
/// let tiled = flash_attention(&q, &k, &v, &cfg)?;
/// let plain = naive_attention(&q, &k, &v, &cfg)?;
/// let diff = (&tiled - &plain)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(diff < 1e-5);
/// let (g1, g2) = (tiled.sum_all()?.backward()?, plain.sum_all()?.backward()?);
/// let dk = (g1.get(&k).unwrap() - g2.get(&k).unwrap())?.abs()?.max_all()?;
/// assert!(dk.to_scalar::<f32>()? < 1e-4);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn flash_attention(q: &Tensor, k: &Tensor, v: &Tensor, cfg: &FlashConfig) -> Result<Tensor> {
    let Forward { out, lse, .. } = flash_forward(q, k, v, cfg)?;
    with_backward3(out, [q, k, v], Flash { cfg: *cfg, lse })
}
