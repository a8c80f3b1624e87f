//! A linear layer whose weights stream from the host.

use std::sync::{Arc, Mutex};

use candle_core::backprop::GradStore;
use candle_core::{bail, DType, Device, Module, Result, Tensor, Var};

use candle_observe::{scope, Kind, NoObserver, Observer, Place};

use crate::source::{fetched_linear, WeightSource};
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
/// let layer = StreamedLinear::new(w.clone(), None, &dev)?;
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
    host: Arc<Host>,
    /// Makes the op part of the graph even when its input is plain data, so
    /// that the weights still get their gradients.
    anchor: Var,
}

/// The host copies of a layer's weights: its [`WeightSource`].
#[derive(Clone)]
struct Host {
    weight: Var,
    bias: Option<Var>,
    device: Device,
    shared: Arc<Mutex<Shared>>,
    observer: Arc<dyn Observer + Send + Sync>,
}

impl std::fmt::Debug for StreamedLinear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamedLinear")
            .field("weight", &self.host.weight.dims())
            .field("bias", &self.host.bias.is_some())
            .field("device", &self.host.device)
            .finish()
    }
}

impl StreamedLinear {
    /// A layer computing on `device` from `weight` `(out, in)` and `bias`
    /// `(out,)`, copied to the host's memory (candle's CPU device) where the
    /// copies stay (a copy even when the device is the CPU too, so that
    /// what streaming costs shows on a CPU-only run).
    pub fn new(weight: Var, bias: Option<Var>, device: &Device) -> Result<Self> {
        Self::with_observer(weight, bias, device, NoObserver)
    }

    /// [`new`](Self::new), reporting memory to `observer`: the host copies
    /// as parameters on the host, each fetch as parameters on the device,
    /// the gradients sent back as gradients on the host.
    pub fn with_observer(
        weight: Var,
        bias: Option<Var>,
        device: &Device,
        observer: impl Observer + Send + Sync + 'static,
    ) -> Result<Self> {
        Self::from_tensors(
            weight.as_tensor(),
            bias.as_ref().map(Var::as_tensor),
            device,
            observer,
        )
    }

    fn from_tensors(
        weight: &Tensor,
        bias: Option<&Tensor>,
        device: &Device,
        observer: impl Observer + Send + Sync + 'static,
    ) -> Result<Self> {
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
            let mut to_host = |t: &Tensor| shared.transfers.to_host_var(t, &Device::Cpu);
            (to_host(weight)?, bias.map(&mut to_host).transpose()?)
        };
        Ok(Self {
            host: Arc::new(Host {
                weight,
                bias,
                device: device.clone(),
                shared: Arc::new(Mutex::new(shared)),
                observer: Arc::new(observer),
            }),
            anchor: Var::zeros(1, DType::F32, device)?,
        })
    }

    /// A streamed copy of a candle-nn layer, computing on its device.
    pub fn from_linear(layer: &candle_nn::Linear) -> Result<Self> {
        Self::from_tensors(
            layer.weight(),
            layer.bias(),
            layer.weight().device(),
            NoObserver,
        )
    }

    /// Reports memory to `observer` from now on.
    pub fn observed(mut self, observer: impl Observer + Send + Sync + 'static) -> Self {
        let mut host = (*self.host).clone();
        host.observer = Arc::new(observer);
        self.host = Arc::new(host);
        self
    }

    /// The host variables: the weight, then the bias if any.
    pub fn vars(&self) -> Vec<Var> {
        std::iter::once(self.host.weight.clone())
            .chain(self.host.bias.clone())
            .collect()
    }

    /// The weight gradients sent to the host since the last call, summed
    /// over backward passes, keyed by [`vars`](Self::vars).
    pub fn take_grads(&self) -> GradStore {
        std::mem::take(&mut lock(&self.host.shared).grads)
    }

    /// The copies made so far.
    pub fn transfers(&self) -> Transfers {
        lock(&self.host.shared).transfers
    }

    /// The bytes of its parameters.
    pub fn bytes(&self) -> u64 {
        self.vars()
            .iter()
            .map(|v| (v.elem_count() * v.dtype().size_in_bytes()) as u64)
            .sum()
    }
}

impl Host {
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

impl WeightSource for Host {
    fn device(&self) -> &Device {
        &self.device
    }

    fn fetch_weight(&self, dtype: DType) -> Result<Tensor> {
        self.fetch(&self.weight, dtype)
    }

    fn has_bias(&self) -> bool {
        self.bias.is_some()
    }

    fn fetch_bias(&self, dtype: DType) -> Result<Option<Tensor>> {
        self.bias.as_ref().map(|b| self.fetch(b, dtype)).transpose()
    }

    fn give_gradients(&self, dw: Tensor, db: Option<Tensor>) -> Result<()> {
        let _grads = scope(&*self.observer, Kind::Gradients, Place::Host);
        let mut s = lock(&self.shared);
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
        send(&self.weight, dw)?;
        if let (Some(b), Some(db)) = (&self.bias, db) {
            send(b, db)?;
        }
        Ok(())
    }
}

impl Module for StreamedLinear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        fetched_linear(x, &self.host, &self.anchor)
    }
}
