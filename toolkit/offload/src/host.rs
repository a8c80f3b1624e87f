//! AdamW with f32 master weights and moments on the host.

use std::path::Path;

use candle_core::backprop::GradStore;
use candle_core::{bail, DType, Device, Result, Tensor, Var};
use candle_nn::{Optimizer, ParamsAdamW};
use candle_observe::{scope, Kind, NoObserver, Observer, Place};

use candle_lean_optim::{adamw_update, save_state, AdamWStep, StateFile};

use crate::Transfers;

struct Slot {
    var: Var,
    master: Var,
    m: Var,
    v: Var,
}

/// ZeRO-Offload's AdamW: the device keeps the parameters (in their own
/// dtype) and computes the gradients; the host keeps an f32 master copy of
/// each parameter and both moments, and runs the update there, in place.
///
/// A step moves each gradient to the host and each updated parameter back:
/// twice the parameters' bytes, where keeping the masters on the device
/// would also move them. Gradients can also arrive one at a time during the
/// backward ([`receive`](Self::receive), with
/// `candle_checkpoint::Sequential::each_layer`), so the device never holds
/// them all.
///
/// ```
/// use candle_core::{Device, Var};
/// use candle_offload::HostAdamW;
/// use candle_nn::{AdamW, Optimizer, ParamsAdamW};
/// let dev = Device::Cpu;
/// let (a, b) = (Var::new(&[1f32, -2.0], &dev)?, Var::new(&[1f32, -2.0], &dev)?);
/// let mut host = HostAdamW::new(vec![a.clone()], ParamsAdamW::default())?;
/// let mut reference = AdamW::new(vec![b.clone()], ParamsAdamW::default())?;
/// let before = host.transfers();
/// host.backward_step(&a.sqr()?.sum_all()?)?;
/// reference.backward_step(&b.sqr()?.sum_all()?)?;
/// assert_eq!(a.to_vec1::<f32>()?, b.to_vec1::<f32>()?);
/// // 2 parameters of 4 bytes: the gradient out, the parameter back.
/// assert_eq!(host.transfers().since(&before).bytes(), 2 * 8);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub struct HostAdamW {
    slots: Vec<Slot>,
    step_t: usize,
    params: ParamsAdamW,
    host: Device,
    transfers: Transfers,
    received: GradStore,
    observer: Box<dyn Observer>,
}

impl std::fmt::Debug for HostAdamW {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostAdamW")
            .field("params", &self.params)
            .field("step", &self.step_t)
            .field("vars", &self.slots.len())
            .field("transfers", &self.transfers)
            .finish()
    }
}

impl HostAdamW {
    /// An optimizer for the float variables of `vars` with its state on
    /// `host` (a CPU device), reporting memory to `observer`.
    pub fn on(
        vars: Vec<Var>,
        params: ParamsAdamW,
        host: Device,
        observer: impl Observer + 'static,
    ) -> Result<Self> {
        if !host.is_cpu() {
            bail!("the host of HostAdamW must be a CPU device, got {host:?}");
        }
        let mut transfers = Transfers::default();
        let mut slots = Vec::new();
        for var in vars.into_iter().filter(|v| v.dtype().is_float()) {
            let _state = scope(&observer, Kind::OptimizerState, Place::Host);
            let master = if var.dtype() == DType::F32 {
                transfers.to_host_var(var.as_tensor(), &host)?
            } else {
                // The cast is the master's own copy.
                let copy = transfers.to_host(var.as_tensor(), &host)?;
                Var::from_tensor(&copy.to_dtype(DType::F32)?)?
            };
            let m = Var::zeros(var.shape(), DType::F32, &host)?;
            let v = Var::zeros(var.shape(), DType::F32, &host)?;
            slots.push(Slot { var, master, m, v });
        }
        Ok(Self {
            slots,
            step_t: 0,
            params,
            host,
            transfers,
            received: GradStore::default(),
            observer: Box::new(observer),
        })
    }

    /// The copies made so far, the masters' first copy included.
    pub fn transfers(&self) -> Transfers {
        self.transfers
    }

    /// The hyper-parameters.
    pub fn params(&self) -> &ParamsAdamW {
        &self.params
    }

    /// Sets the hyper-parameters.
    pub fn set_params(&mut self, params: ParamsAdamW) {
        self.params = params;
    }

    /// Copies one gradient of `var` to the host now (during a layer-wise
    /// backward), adding it to what was received for the next
    /// [`step_received`](Self::step_received).
    pub fn receive(&mut self, var: &Var, grad: &Tensor) -> Result<()> {
        let _grads = scope(&*self.observer, Kind::Gradients, Place::Host);
        let g = self
            .transfers
            .to_host(grad, &self.host)?
            .to_dtype(DType::F32)?;
        let total = match self.received.remove(var.as_tensor()) {
            Some(prev) => (prev + g)?,
            None => g,
        };
        self.received.insert(var.as_tensor(), total);
        Ok(())
    }

    /// Drops the gradients [`receive`](Self::receive)d since the last step
    /// (after a backward that failed half-way, say).
    pub fn discard_received(&mut self) {
        self.received = GradStore::default();
    }

    /// Steps with the gradients [`receive`](Self::receive)d since the last
    /// step.
    pub fn step_received(&mut self) -> Result<()> {
        let grads = std::mem::take(&mut self.received);
        self.step_host(&grads)
    }

    /// Steps with f32 gradients already on the host.
    fn step_host(&mut self, grads: &GradStore) -> Result<()> {
        self.step_t += 1;
        let k = AdamWStep::new(&self.params, self.step_t)?;
        for s in &self.slots {
            let Some(g) = grads.get(s.var.as_tensor()) else {
                continue;
            };
            {
                let _state = scope(&*self.observer, Kind::OptimizerState, Place::Host);
                adamw_update(&s.master, (&s.m, &s.v), g, &k)?;
            }
            let back = {
                let _params = scope(&*self.observer, Kind::Parameters, Place::Device);
                let cast = s.master.as_tensor().to_dtype(s.var.dtype())?;
                self.transfers.to_device(&cast, s.var.device())?
            };
            s.var.set(&back)?;
        }
        Ok(())
    }

    /// Writes the step count, hyper-parameters, masters and moments to
    /// `path` (safetensors).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let tensors = self.slots.iter().enumerate().flat_map(|(i, s)| {
            [
                (format!("master.{i}"), s.master.as_tensor().clone()),
                (format!("m.{i}"), s.m.as_tensor().clone()),
                (format!("v.{i}"), s.v.as_tensor().clone()),
            ]
        });
        save_state(path.as_ref(), self.step_t, &self.params, tensors)
    }

    /// Restores what [`save`](Self::save) wrote, for the same variables in
    /// the same order, and copies the masters to the device's parameters.
    /// A file saved for other variables is refused before anything is
    /// restored. Gradients received before it are dropped: they are not
    /// the restored state's.
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let mut loaded = StateFile::read(path.as_ref())?;
        loaded.check(self.slots.iter().enumerate().flat_map(|(i, s)| {
            [
                (format!("master.{i}"), &s.master),
                (format!("m.{i}"), &s.m),
                (format!("v.{i}"), &s.v),
            ]
        }))?;
        for (i, s) in self.slots.iter().enumerate() {
            loaded.restore(&format!("master.{i}"), &s.master)?;
            loaded.restore(&format!("m.{i}"), &s.m)?;
            loaded.restore(&format!("v.{i}"), &s.v)?;
            let back = s.master.as_tensor().to_dtype(s.var.dtype())?;
            s.var
                .set(&self.transfers.to_device(&back, s.var.device())?)?;
        }
        self.received = GradStore::default();
        self.step_t = loaded.step();
        self.params = loaded.params().clone();
        loaded.finish()
    }
}

impl Optimizer for HostAdamW {
    type Config = ParamsAdamW;

    /// State on the CPU, the host of every candle device.
    fn new(vars: Vec<Var>, params: ParamsAdamW) -> Result<Self> {
        Self::on(vars, params, Device::Cpu, NoObserver)
    }

    /// Copies the gradients to the host, then steps there.
    fn step(&mut self, grads: &GradStore) -> Result<()> {
        let mut host = GradStore::default();
        for s in &self.slots {
            if let Some(g) = grads.get(s.var.as_tensor()) {
                let _grads = scope(&*self.observer, Kind::Gradients, Place::Host);
                let h = self
                    .transfers
                    .to_host(g, &self.host)?
                    .to_dtype(DType::F32)?;
                host.insert(s.var.as_tensor(), h);
            }
        }
        self.step_host(&host)
    }

    fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr
    }
}
