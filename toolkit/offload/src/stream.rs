//! A linear layer whose weights stream from the host.

use std::sync::{Arc, Mutex};

use candle_core::backprop::GradStore;
use candle_core::{bail, DType, Device, Module, Result, Tensor, Var};
use candle_custom_grad::{with_backward2, Backward2};

use candle_observe::{scope, Kind, NoObserver, Observer, Place};

use crate::Transfers;

/// What the layer and its backward share: the copies made, and the weight
/// gradients sent to the host.
#[derive(Debug, Default)]
struct Shared {
    transfers: Transfers,
    grads: GradStore,
}

fn lock(shared: &Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    shared.lock().unwrap_or_else(|e| e.into_inner())
}

/// `y = x W^T + b` with `W` and `b` kept in host memory: copied to the
/// device for the forward, dropped there, copied again for the backward
/// (FSDP's two gathers of a layer), the weight gradients sent back to the
/// host. The device holds this layer's weights only while it runs.
///
/// It is a [`Module`] inside candle's autograd: `loss.backward()` gives the
/// input its gradient as a resident layer would; the weights' gradients are
/// collected on the host ([`take_grads`](Self::take_grads)), keyed by the
/// host variables ([`vars`](Self::vars)) for an optimizer there.
///
/// ```
/// use candle_core::{Device, Module, Tensor, Var};
/// use candle_offload::StreamedLinear;
/// let dev = Device::Cpu;
/// let w = Var::new(&[[1f32, 2.0], [3.0, 4.0]], &dev)?;
/// let layer = StreamedLinear::new(w.clone(), None, &dev, &dev)?;
/// let x = Var::new(&[[1f32, 1.0]], &dev)?;
/// let y = layer.forward(&x)?;
/// assert_eq!(y.to_vec2::<f32>()?, [[3.0, 7.0]]);
/// let grads = y.sum_all()?.backward()?;
/// assert_eq!(grads.get(&x).unwrap().to_vec2::<f32>()?, [[4.0, 6.0]]);
/// let host = layer.take_grads();
/// let w_host = &layer.vars()[0]; // the host copy of w
/// assert_eq!(host.get(w_host).unwrap().to_vec2::<f32>()?, [[1.0, 1.0], [1.0, 1.0]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Clone)]
pub struct StreamedLinear {
    weight: Var,
    bias: Option<Var>,
    device: Device,
    /// Makes the op part of the graph even when its input is plain data, so
    /// that the weights still get their gradients.
    anchor: Var,
    shared: Arc<Mutex<Shared>>,
    observer: Arc<dyn Observer + Send + Sync>,
}

impl std::fmt::Debug for StreamedLinear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamedLinear")
            .field("weight", &self.weight.dims())
            .field("bias", &self.bias.is_some())
            .field("device", &self.device)
            .finish()
    }
}

impl StreamedLinear {
    /// A layer computing on `device` from `weight` `(out, in)` and `bias`
    /// `(out,)`, copied to `host` (a CPU device) where the copies stay (a
    /// copy even when host and device are the same memory, so that what
    /// streaming costs shows on a CPU-only run).
    pub fn new(weight: Var, bias: Option<Var>, host: &Device, device: &Device) -> Result<Self> {
        Self::with_observer(weight, bias, host, device, NoObserver)
    }

    /// [`new`](Self::new), reporting memory to `observer`: the host copies
    /// as parameters on the host, each fetch as parameters on the device,
    /// the gradients sent back as gradients on the host.
    pub fn with_observer(
        weight: Var,
        bias: Option<Var>,
        host: &Device,
        device: &Device,
        observer: impl Observer + Send + Sync + 'static,
    ) -> Result<Self> {
        Self::from_tensors(
            weight.as_tensor(),
            bias.as_ref().map(Var::as_tensor),
            host,
            device,
            observer,
        )
    }

    fn from_tensors(
        weight: &Tensor,
        bias: Option<&Tensor>,
        host: &Device,
        device: &Device,
        observer: impl Observer + Send + Sync + 'static,
    ) -> Result<Self> {
        if !host.is_cpu() {
            bail!("the host of a StreamedLinear must be a CPU device, got {host:?}");
        }
        if weight.rank() != 2 {
            bail!(
                "the weight must be (out, in), got shape {:?}",
                weight.dims()
            );
        }
        if let Some(b) = &bias {
            if b.dims() != [weight.dim(0)?] {
                bail!(
                    "the bias has shape {:?}, the weight {:?}",
                    b.dims(),
                    weight.dims()
                );
            }
        }
        let mut shared = Shared::default();
        let (weight, bias) = {
            let _host = scope(&observer, Kind::Parameters, Place::Host);
            let mut to_host = |t: &Tensor| shared.transfers.to_host_var(t, host);
            (to_host(weight)?, bias.map(&mut to_host).transpose()?)
        };
        Ok(Self {
            weight,
            bias,
            device: device.clone(),
            anchor: Var::zeros(1, DType::F32, device)?,
            shared: Arc::new(Mutex::new(shared)),
            observer: Arc::new(observer),
        })
    }

    /// A streamed copy of a candle-nn layer.
    pub fn from_linear(layer: &candle_nn::Linear, host: &Device) -> Result<Self> {
        Self::from_tensors(
            layer.weight(),
            layer.bias(),
            host,
            layer.weight().device(),
            NoObserver,
        )
    }

    /// Reports memory to `observer` from now on.
    pub fn observed(mut self, observer: impl Observer + Send + Sync + 'static) -> Self {
        self.observer = Arc::new(observer);
        self
    }

    /// The host variables: the weight, then the bias if any.
    pub fn vars(&self) -> Vec<Var> {
        std::iter::once(self.weight.clone())
            .chain(self.bias.clone())
            .collect()
    }

    /// The weight gradients sent to the host since the last call, summed
    /// over backward passes, keyed by [`vars`](Self::vars).
    pub fn take_grads(&self) -> GradStore {
        std::mem::take(&mut lock(&self.shared).grads)
    }

    /// The copies made so far.
    pub fn transfers(&self) -> Transfers {
        lock(&self.shared).transfers
    }

    /// The bytes of its parameters.
    pub fn bytes(&self) -> u64 {
        self.vars()
            .iter()
            .map(|v| (v.elem_count() * v.dtype().size_in_bytes()) as u64)
            .sum()
    }

    /// `var` copied to the device, in `dtype`: cast on the host first, so
    /// that only the compute dtype's bytes cross and land.
    fn fetch(&self, var: &Var, dtype: DType) -> Result<Tensor> {
        let cast = if var.dtype() == dtype {
            var.as_tensor().clone()
        } else {
            let _host = scope(&*self.observer, Kind::Parameters, Place::Host);
            var.as_tensor().to_dtype(dtype)?
        };
        let _params = scope(&*self.observer, Kind::Parameters, Place::Device);
        lock(&self.shared).transfers.to_device(&cast, &self.device)
    }
}

fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let y = x.broadcast_matmul(&w.t()?)?;
    match b {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

impl Module for StreamedLinear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if !x.device().same_device(&self.device) {
            bail!(
                "the input is on {:?}, the layer computes on {:?}",
                x.device(),
                self.device
            );
        }
        let out = {
            let w = self.fetch(&self.weight, x.dtype())?;
            let b = match &self.bias {
                Some(b) => Some(self.fetch(b, x.dtype())?),
                None => None,
            };
            linear(&x.detach(), &w, b.as_ref())?
            // The device copies of the weights are dropped here.
        };
        with_backward2(
            out,
            x,
            self.anchor.as_tensor(),
            Stream {
                layer: self.clone(),
            },
        )
    }
}

/// The backward: fetch the weight again, give the input its gradient, send
/// the weight's and the bias's to the host.
struct Stream {
    layer: StreamedLinear,
}

impl Backward2 for Stream {
    fn backward(
        &self,
        x: &Tensor,
        _anchor: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let l = &self.layer;
        // The backward needs the weight only, not the bias.
        let w = l.fetch(&l.weight, grad.dtype())?;
        let (out_f, in_f) = w.dims2()?;
        // Every leading dimension is a row.
        let g2 = grad.reshape(((), out_f))?;
        let x2 = x.detach().reshape(((), in_f))?;
        let dx = g2.matmul(&w)?.reshape(x.shape())?;
        drop(w);
        let dw = g2.t()?.matmul(&x2)?;
        let db = l.bias.as_ref().map(|_| g2.sum(0)).transpose()?;
        let _grads = scope(&*l.observer, Kind::Gradients, Place::Host);
        let mut s = lock(&l.shared);
        let mut send = |var: &Var, g: Tensor| -> Result<()> {
            let host = s
                .transfers
                .to_host(&g, var.device())?
                .to_dtype(var.dtype())?;
            let total = match s.grads.remove(var.as_tensor()) {
                Some(prev) => (prev + host)?,
                None => host,
            };
            s.grads.insert(var.as_tensor(), total);
            Ok(())
        };
        send(&l.weight, dw)?;
        if let (Some(b), Some(db)) = (&l.bias, db) {
            send(b, db)?;
        }
        Ok((Some(dx), None))
    }
}
