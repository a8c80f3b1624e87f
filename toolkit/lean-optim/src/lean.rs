//! AdamW updating in place.

use std::path::Path;

use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor, Var};
use candle_nn::{Optimizer, ParamsAdamW};
use candle_observe::{scope, Kind, NoObserver, Observer, Place};

use crate::kernel::{AdamWStep, Moment1, Moment2, Theta};
use crate::state::{save_state, StateFile};

struct Slot {
    var: Var,
    m: Var,
    v: Var,
}

/// `candle_nn::AdamW`'s update without its temporaries: on the CPU each
/// step rewrites the moments and the parameter in place, allocating
/// nothing, as it does on a CUDA GPU with the `cuda` feature. On other
/// devices it falls back to candle's own operations.
///
/// ```
/// use candle_core::{Device, Var};
/// use candle_lean_optim::LeanAdamW;
/// use candle_nn::{AdamW, Optimizer, ParamsAdamW};
/// let dev = Device::Cpu;
/// let (a, b) = (Var::new(&[1f32, -2.0, 3.0], &dev)?, Var::new(&[1f32, -2.0, 3.0], &dev)?);
/// let p = ParamsAdamW { lr: 0.1, weight_decay: 0.1, ..Default::default() };
/// let mut lean = LeanAdamW::new(vec![a.clone()], p.clone())?;
/// let mut reference = AdamW::new(vec![b.clone()], p)?;
/// for _ in 0..10 {
///     lean.backward_step(&a.sqr()?.sum_all()?)?;
///     reference.backward_step(&b.sqr()?.sum_all()?)?;
/// }
/// assert_eq!(a.to_vec1::<f32>()?, b.to_vec1::<f32>()?);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub struct LeanAdamW {
    slots: Vec<Slot>,
    step_t: usize,
    params: ParamsAdamW,
    observer: Box<dyn Observer>,
}

impl std::fmt::Debug for LeanAdamW {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeanAdamW")
            .field("params", &self.params)
            .field("step", &self.step_t)
            .field("vars", &self.slots.len())
            .finish()
    }
}

impl LeanAdamW {
    /// An optimizer for the float variables of `vars`, reporting its state's
    /// memory to `observer`.
    pub fn with_observer(
        vars: Vec<Var>,
        params: ParamsAdamW,
        observer: impl Observer + 'static,
    ) -> Result<Self> {
        let slots = {
            let _state = scope(&observer, Kind::OptimizerState, Place::Device);
            vars.into_iter()
                .filter(|v| v.dtype().is_float())
                .map(|var| {
                    let m = Var::zeros(var.shape(), var.dtype(), var.device())?;
                    let v = Var::zeros(var.shape(), var.dtype(), var.device())?;
                    Ok(Slot { var, m, v })
                })
                .collect::<Result<Vec<_>>>()?
        };
        Ok(Self {
            slots,
            step_t: 0,
            params,
            observer: Box::new(observer),
        })
    }

    /// The hyper-parameters.
    pub fn params(&self) -> &ParamsAdamW {
        &self.params
    }

    /// Sets the hyper-parameters (a schedule, say).
    pub fn set_params(&mut self, params: ParamsAdamW) {
        self.params = params;
    }

    /// Steps taken.
    pub fn step_count(&self) -> usize {
        self.step_t
    }

    /// Writes the step count, hyper-parameters and moments to `path`
    /// (safetensors).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let tensors = self.slots.iter().enumerate().flat_map(|(i, s)| {
            [
                (format!("m.{i}"), s.m.as_tensor().clone()),
                (format!("v.{i}"), s.v.as_tensor().clone()),
            ]
        });
        save_state(path.as_ref(), self.step_t, &self.params, tensors)
    }

    /// Restores what [`save`](Self::save) wrote, for the same variables in
    /// the same order. A file saved for other variables is refused before
    /// anything is restored.
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let mut loaded = StateFile::read(path.as_ref())?;
        loaded.check(
            self.slots
                .iter()
                .enumerate()
                .flat_map(|(i, s)| [(format!("m.{i}"), &s.m), (format!("v.{i}"), &s.v)]),
        )?;
        for (i, s) in self.slots.iter().enumerate() {
            loaded.restore(&format!("m.{i}"), &s.m)?;
            loaded.restore(&format!("v.{i}"), &s.v)?;
        }
        self.step_t = loaded.step();
        self.params = loaded.params().clone();
        loaded.finish()
    }
}

/// One variable's update with candle's operations, for devices without an
/// in-place kernel.
fn out_of_place(var: &Var, m: &Var, v: &Var, g: &Tensor, k: &AdamWStep) -> Result<()> {
    let next_m = ((m.as_tensor() * k.beta1)? + (g * (1.0 - k.beta1))?)?;
    m.set(&next_m)?;
    drop(next_m);
    let next_v = ((v.as_tensor() * k.beta2)? + (g.sqr()? * (1.0 - k.beta2))?)?;
    v.set(&next_v)?;
    drop(next_v);
    let adjusted =
        ((m.as_tensor() * k.scale_m)? / ((v.as_tensor() * k.scale_v)?.sqrt()? + k.eps)?)?;
    let next = ((var.as_tensor() * (1.0 - k.lr * k.weight_decay))? - (adjusted * k.lr)?)?;
    var.set(&next)
}

/// AdamW's update of one variable `var` with moments `m` and `v` from its
/// gradient `g`: in place on the CPU and, with the `cuda` feature, on a
/// CUDA GPU (no allocation); through candle's operations on other devices. `var`, `m` and `v` share a dtype; `g` is
/// cast to it if needed.
///
/// ```
/// use candle_core::{DType, Device, Var};
/// use candle_lean_optim::{adamw_update, AdamWStep};
/// use candle_nn::ParamsAdamW;
/// let dev = Device::Cpu;
/// let w = Var::new(&[1f32, 2.0], &dev)?;
/// let (m, v) = (Var::zeros(2, DType::F32, &dev)?, Var::zeros(2, DType::F32, &dev)?);
/// let g = candle_core::Tensor::new(&[0.5f32, -0.5], &dev)?;
/// let p = ParamsAdamW { lr: 0.1, weight_decay: 0.0, ..Default::default() };
/// adamw_update(&w, (&m, &v), &g, &AdamWStep::new(&p, 1)?)?;
/// // The first step moves each weight by about lr against its gradient's sign.
/// let w = w.to_vec1::<f32>()?;
/// assert!((w[0] - 0.9).abs() < 1e-6 && (w[1] - 2.1).abs() < 1e-6);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn adamw_update(var: &Var, (m, v): (&Var, &Var), g: &Tensor, k: &AdamWStep) -> Result<()> {
    let g = if g.dtype() == var.dtype() {
        g.contiguous()?
    } else {
        g.to_dtype(var.dtype())?
    };
    // In place where the toolkit has the kernels: the CPU, and a CUDA GPU
    // in a build with the `cuda` feature.
    if var.device().is_cpu() || (cfg!(feature = "cuda") && var.device().is_cuda()) {
        m.inplace_op2(&g, &Moment1(*k))?;
        v.inplace_op2(&g, &Moment2(*k))?;
        var.inplace_op3(m, v, &Theta(*k))
    } else {
        out_of_place(var, m, v, &g, k)
    }
}

impl Optimizer for LeanAdamW {
    type Config = ParamsAdamW;

    fn new(vars: Vec<Var>, params: ParamsAdamW) -> Result<Self> {
        Self::with_observer(vars, params, NoObserver)
    }

    fn step(&mut self, grads: &GradStore) -> Result<()> {
        self.step_t += 1;
        let k = AdamWStep::new(&self.params, self.step_t)?;
        let _state = scope(&*self.observer, Kind::OptimizerState, Place::Device);
        for s in &self.slots {
            if let Some(g) = grads.get(s.var.as_tensor()) {
                adamw_update(&s.var, (&s.m, &s.v), g, &k)?;
            }
        }
        Ok(())
    }

    fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr
    }
}
