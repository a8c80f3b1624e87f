//! The attention as one operation of candle's autograd.

use std::sync::Mutex;

use candle_core::{
    bail, CpuStorage, CudaStorage, CustomOp3, Layout, MetalStorage, Result, Shape, Storage, Tensor,
};

use crate::backward::flash_backward;
use crate::config::FlashConfig;
use crate::forward::{flash_forward, Forward};

/// The op's forward hands candle an output computed beforehand with tensor
/// operations (on any device); its backward is [`flash_backward`]. The graph
/// keeps the inputs, the output and the log-sum-exp: no score matrix.
struct Flash {
    cfg: FlashConfig,
    /// Taken by the forward, so that the output is not held twice.
    out: Mutex<Option<Tensor>>,
    lse: Tensor,
    out_shape: Shape,
}

impl Flash {
    fn take(&self) -> Result<Storage> {
        let out = self
            .out
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| candle_core::Error::Msg("flash attention forward ran twice".into()))?;
        let out = if out.layout().is_contiguous() && out.layout().start_offset() == 0 {
            out
        } else {
            // `copy` would keep the layout; the storage must be laid out
            // from 0, in order.
            out.force_contiguous()?
        };
        let (storage, layout) = out.storage_and_layout();
        storage.try_clone(layout)
    }
}

impl CustomOp3 for Flash {
    fn name(&self) -> &'static str {
        "flash-attention"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        q: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        match self.take()? {
            Storage::Cpu(s) => Ok((s, self.shape(q)?)),
            _ => bail!("flash attention: the output is not on the CPU"),
        }
    }

    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        q: &Layout,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        match self.take()? {
            Storage::Cuda(s) => Ok((s, self.shape(q)?)),
            _ => bail!("flash attention: the output is not on the CUDA device"),
        }
    }

    fn metal_fwd(
        &self,
        _: &MetalStorage,
        q: &Layout,
        _: &MetalStorage,
        _: &Layout,
        _: &MetalStorage,
        _: &Layout,
    ) -> Result<(MetalStorage, Shape)> {
        match self.take()? {
            Storage::Metal(s) => Ok((s, self.shape(q)?)),
            _ => bail!("flash attention: the output is not on the Metal device"),
        }
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let fwd = Forward {
            out: res.detach(),
            lse: self.lse.clone(),
        };
        let (dq, dk, dv) = flash_backward(q, k, v, &fwd, grad_res, &self.cfg)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

impl Flash {
    /// The output's shape: q's, with v's head dimension.
    fn shape(&self, q: &Layout) -> Result<Shape> {
        let (q, out) = (q.shape().dims(), self.out_shape.dims());
        if q.len() != 4 || out.len() != 4 || q[..3] != out[..3] {
            bail!("flash attention: output shape {out:?} does not fit q's {q:?}");
        }
        Ok(self.out_shape.clone())
    }
}

/// Attention as one differentiable candle operation: the tiled forward, and
/// in the backward the recomputing [`flash_backward`]. A model's
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
    let Forward { out, lse } = flash_forward(q, k, v, cfg)?;
    let out_shape = out.shape().clone();
    let op = Flash {
        cfg: *cfg,
        out: Mutex::new(Some(out)),
        lse,
        out_shape,
    };
    q.apply_op3(k, v, op)
}
