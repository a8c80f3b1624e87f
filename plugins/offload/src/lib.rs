//! The offload cell: optimizer state, gradients and parameters kept in host
//! memory and brought to the device only when needed.
//!
//! The reusable parts:
//!
//! * [`HostAdamW`]: an AdamW whose moments live on the host. Gradients go to
//!   the host, the update runs there, the parameters are written back. The
//!   same operations in the same order as `candle_nn::AdamW`, so the results
//!   are equal; it implements candle's `Optimizer`.
//! * [`layerwise_backward`]: back-propagation one layer at a time, handing
//!   each layer's parameter gradients to a callback as soon as they exist (to
//!   move them to the host), so the device never holds all of them.
//! * [`StreamedLinear`]: a linear layer whose weights live on the host and
//!   visit the device for its forward.
//!
//! Every copy goes through [`Transfers`], which counts bytes and time. On a
//! CPU-only run host and device are the same memory; the copies are still
//! made, and the meter files each under the side it stands for
//! ([`Residency`]), so the shift shows.
#![warn(missing_docs)]

use std::time::Instant;

use serde::{Deserialize, Serialize};
use workbook_sdk::anyhow;
use workbook_sdk::candle::backprop::GradStore;
use workbook_sdk::candle::{DType, Device, Module, Result, Tensor, Var};
use workbook_sdk::candle_nn::{AdamW, Optimizer, ParamsAdamW};
use workbook_sdk::output::{mib, Unit};
use workbook_sdk::train::{
    cross_entropy, max_abs_diff, param_grads, Activation, Layer, Linear, Mlp, Rng,
};
use workbook_sdk::{Category, Context, Plugin, Residency, Rules, Table, Violation};

/// Bytes and time of the copies between device and host.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Transfers {
    /// Bytes copied to the host.
    pub to_host_bytes: u64,
    /// Bytes copied to the device.
    pub to_device_bytes: u64,
    /// Seconds spent copying.
    pub seconds: f64,
}

impl Transfers {
    fn copy(&mut self, t: &Tensor, to: &Device, residency: Residency) -> Result<Tensor> {
        let start = Instant::now();
        // A transfer moves data, not autograd history: detached, or the copy
        // would keep a graph back to its source alive. On one device
        // `to_device` would share storage; a transfer copies.
        let t = t.detach();
        let out = residency.scope(|| {
            if t.device().same_device(to) {
                t.copy()
            } else {
                t.to_device(to)
            }
        })?;
        let bytes = (t.elem_count() * t.dtype().size_in_bytes()) as u64;
        match residency {
            Residency::Host => self.to_host_bytes += bytes,
            Residency::Device => self.to_device_bytes += bytes,
        }
        self.seconds += start.elapsed().as_secs_f64();
        Ok(out)
    }

    /// Copies `t` to `host`, tagged as host memory.
    pub fn to_host(&mut self, t: &Tensor, host: &Device) -> Result<Tensor> {
        self.copy(t, host, Residency::Host)
    }

    /// Copies `t` to `device`, tagged as device memory.
    pub fn to_device(&mut self, t: &Tensor, device: &Device) -> Result<Tensor> {
        self.copy(t, device, Residency::Device)
    }
}

struct HostState {
    var: Var,
    m: Tensor,
    v: Tensor,
}

/// AdamW with its moments in host memory.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use candle_nn::{AdamW, Optimizer, ParamsAdamW};
/// use workbook_offload::HostAdamW;
/// let (a, b) = (Var::new(&[1f32, -2.0], &Device::Cpu)?, Var::new(&[1f32, -2.0], &Device::Cpu)?);
/// let mut host = HostAdamW::new(vec![a.clone()], ParamsAdamW::default())?;
/// let mut reference = AdamW::new(vec![b.clone()], ParamsAdamW::default())?;
/// for _ in 0..3 {
///     host.backward_step(&a.sqr()?.sum_all()?)?;
///     reference.backward_step(&b.sqr()?.sum_all()?)?;
/// }
/// assert_eq!(a.to_vec1::<f32>()?, b.to_vec1::<f32>()?);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub struct HostAdamW {
    params: ParamsAdamW,
    step_t: usize,
    host: Device,
    states: Vec<HostState>,
    transfers: Transfers,
}

impl std::fmt::Debug for HostAdamW {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostAdamW")
            .field("params", &self.params)
            .field("step_t", &self.step_t)
            .field("vars", &self.states.len())
            .field("transfers", &self.transfers)
            .finish()
    }
}

impl HostAdamW {
    /// An optimizer for `vars` with its state on `host`.
    pub fn on(vars: Vec<Var>, params: ParamsAdamW, host: Device) -> Result<Self> {
        let states = {
            let _where = (Category::OptimizerState.enter(), Residency::Host.enter());
            vars.into_iter()
                .filter(|v| v.dtype().is_float())
                .map(|var| {
                    let m = Tensor::zeros(var.shape(), var.dtype(), &host)?;
                    let v = Tensor::zeros(var.shape(), var.dtype(), &host)?;
                    Ok(HostState { var, m, v })
                })
                .collect::<Result<Vec<_>>>()?
        };
        Ok(Self {
            params,
            step_t: 0,
            host,
            states,
            transfers: Transfers::default(),
        })
    }

    /// The copies made so far.
    pub fn transfers(&self) -> Transfers {
        self.transfers
    }

    /// Steps with gradients already on the host (from [`layerwise_backward`]
    /// with an offloading callback, say).
    pub fn step_host(&mut self, host_grads: &GradStore) -> Result<()> {
        self.step_t += 1;
        let p = self.params.clone();
        let scale_m = 1f64 / (1f64 - p.beta1.powi(self.step_t as i32));
        let scale_v = 1f64 / (1f64 - p.beta2.powi(self.step_t as i32));
        for i in 0..self.states.len() {
            let Some(g) = host_grads.get(self.states[i].var.as_tensor()) else {
                continue;
            };
            let theta = self
                .transfers
                .to_host(self.states[i].var.as_tensor(), &self.host)?;
            let _where = (Category::OptimizerState.enter(), Residency::Host.enter());
            let st = &mut self.states[i];
            // candle_nn::AdamW's operations, in its order: equal results.
            let next_m = ((&st.m * p.beta1)? + (g * (1.0 - p.beta1))?)?;
            let next_v = ((&st.v * p.beta2)? + (g.sqr()? * (1.0 - p.beta2))?)?;
            let m_hat = (&next_m * scale_m)?;
            let v_hat = (&next_v * scale_v)?;
            let next_theta = (theta * (1f64 - p.lr * p.weight_decay))?;
            let adjusted = (m_hat / (v_hat.sqrt()? + p.eps)?)?;
            let next_theta = (next_theta - (adjusted * p.lr)?)?;
            st.m = next_m;
            st.v = next_v;
            let device = st.var.device().clone();
            drop(_where);
            let back = self.transfers.to_device(&next_theta, &device)?;
            self.states[i].var.set(&back)?;
        }
        Ok(())
    }
}

impl Optimizer for HostAdamW {
    type Config = ParamsAdamW;

    /// State on the CPU, the host of every candle device.
    fn new(vars: Vec<Var>, params: ParamsAdamW) -> Result<Self> {
        Self::on(vars, params, Device::Cpu)
    }

    /// Copies the gradients to the host, then steps there.
    fn step(&mut self, grads: &GradStore) -> Result<()> {
        let mut host_grads = GradStore::default();
        for st in &self.states {
            if let Some(g) = grads.get(st.var.as_tensor()) {
                let _grads = Category::Gradients.enter();
                let h = self.transfers.to_host(g, &self.host)?;
                host_grads.insert(st.var.as_tensor(), h);
            }
        }
        self.step_host(&host_grads)
    }

    fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr
    }
}

/// Back-propagates through `layers` one at a time, last first, calling
/// `on_grad(var, gradient)` for each parameter gradient as soon as its layer
/// is done; the device then holds one layer's parameter gradients at a time
/// (if the callback moves them away). `layer_vars[i]` are layer `i`'s
/// parameters. Returns the loss, detached.
///
/// Each layer's first operation must use one of its parameters (a linear
/// layer, say, or a linear layer and its activation): candle passes a
/// gradient to a layer's plain input only through such an operation. A layer
/// that passes none is an error, not a silently wrong result.
pub fn layerwise_backward<M: Module>(
    layers: &[M],
    layer_vars: &[Vec<Var>],
    input: &Tensor,
    head: impl FnOnce(&Tensor) -> Result<Tensor>,
    mut on_grad: impl FnMut(&Var, Tensor) -> Result<()>,
) -> Result<Tensor> {
    if layers.len() != layer_vars.len() || layers.is_empty() {
        workbook_sdk::candle::bail!("one list of variables per layer, and at least one layer");
    }
    // Forward: each layer's graph starts at a detached input, so each can be
    // back-propagated on its own.
    let mut inputs = Vec::with_capacity(layers.len());
    let mut outputs = Vec::with_capacity(layers.len());
    let mut h = input.detach();
    for layer in layers {
        let out = Category::Activations.scope(|| layer.forward(&h))?;
        inputs.push(h);
        h = out.detach();
        outputs.push(out);
    }
    drop(h);
    let mut upstream: Option<Tensor> = None;
    let mut loss_value = None;
    let mut head = Some(head);
    for i in (0..layers.len()).rev() {
        let out = outputs.pop().expect("one output per layer");
        let x = inputs.pop().expect("one input per layer");
        let store = {
            let _grads = Category::Gradients.enter();
            let root = match (upstream.take(), head.take()) {
                (None, Some(head)) => {
                    let loss = head(&out)?;
                    loss_value = Some(loss.detach());
                    loss
                }
                (Some(g), _) => (out * g)?.sum_all()?,
                (None, None) => unreachable!("the head runs on the last layer only"),
            };
            root.backward()?
        };
        for var in &layer_vars[i] {
            if let Some(g) = store.get(var.as_tensor()) {
                on_grad(var, g.detach())?;
            }
        }
        if i > 0 {
            match store.get(&x) {
                Some(g) => upstream = Some(g.detach()),
                None => workbook_sdk::candle::bail!(
                    "layer {i} passes no gradient to its input: its first operation must use one of its parameters"
                ),
            }
        }
    }
    loss_value.ok_or_else(|| workbook_sdk::candle::Error::Msg("no layers".into()))
}

/// A linear layer whose parameters live on the host and are copied to the
/// device for each forward, then dropped there.
#[derive(Debug, Clone)]
pub struct StreamedLinear {
    weight: Tensor,
    bias: Tensor,
}

impl StreamedLinear {
    /// Moves `layer`'s parameters to `host`.
    pub fn from_linear(layer: &Linear, host: &Device, transfers: &mut Transfers) -> Result<Self> {
        let _params = Category::Parameters.enter();
        Ok(Self {
            weight: transfers.to_host(layer.weight().as_tensor(), host)?,
            bias: transfers.to_host(layer.bias().as_tensor(), host)?,
        })
    }

    /// The bytes of its parameters.
    pub fn bytes(&self) -> u64 {
        ((self.weight.elem_count() + self.bias.elem_count()) * self.weight.dtype().size_in_bytes())
            as u64
    }

    /// `x W^T + b` on `x`'s device, with the parameters visiting it.
    pub fn forward(&self, x: &Tensor, transfers: &mut Transfers) -> Result<Tensor> {
        let (w, b) = {
            let _params = Category::Parameters.enter();
            (
                transfers.to_device(&self.weight, x.device())?,
                transfers.to_device(&self.bias, x.device())?,
            )
        };
        x.broadcast_matmul(&w.t()?)?.broadcast_add(&b)
    }
}

/// Parameters of the offload cell.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Params {
    /// Width of the model.
    pub width: usize,
    /// Depth (Linear + ReLU blocks).
    pub depth: usize,
    /// Batch.
    pub batch: usize,
    /// AdamW steps compared with candle_nn::AdamW.
    pub steps: usize,
    /// AdamW's learning rate.
    pub lr: f64,
    /// Seed of weights and data.
    pub seed: u64,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            width: 1024,
            depth: 8,
            batch: 64,
            steps: 10,
            lr: 1e-3,
            seed: 47,
        }
    }
}

/// The offload plugin.
#[derive(Debug, Default, Clone, Copy)]
pub struct Offload;

/// Linear + ReLU units of a stack, with their parameters: the layers of
/// [`layerwise_backward`].
struct Unit2 {
    linear: Linear,
    activation: Activation,
}

impl Module for Unit2 {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.activation.forward(&self.linear.forward(x)?)
    }
}

fn units(model: &Mlp) -> Vec<Unit2> {
    let mut out = Vec::new();
    let layers = model.layers();
    for (i, l) in layers.iter().enumerate() {
        if let Layer::Linear(linear) = l {
            let activation = match layers.get(i + 1) {
                Some(Layer::Activation(a)) => *a,
                _ => Activation::Relu,
            };
            out.push(Unit2 {
                linear: linear.clone(),
                activation,
            });
        }
    }
    out
}

impl Plugin for Offload {
    type Params = Params;

    fn name(&self) -> &str {
        "offload"
    }

    fn description(&self) -> &str {
        "optimizer state, gradients and parameters in host memory: equal results, device bytes, copies"
    }

    fn validate(&self, p: &Params) -> Vec<Violation> {
        let mut r = Rules::new();
        r.at_least("width", p.width, 1)
            .at_least("depth", p.depth, 1)
            .at_least("batch", p.batch, 1)
            .at_least("steps", p.steps, 1)
            .positive("lr", p.lr);
        let w = p.width as u64;
        r.elements("width", "depth × width × width", &[p.depth as u64, w, w])
            .elements("batch", "batch × width", &[p.batch as u64, w]);
        r.into_violations()
    }

    fn memory_floor(&self, p: &Params) -> Option<(u64, String)> {
        // Weights and AdamW's two moments, in f32.
        let weights = (p.depth as u64).checked_mul((p.width as u64).checked_pow(2)?)?;
        Some((
            weights.checked_mul(12)?,
            format!(
                "f32 weights and two moments, 3 × {} × {}²",
                p.depth, p.width
            ),
        ))
    }

    fn run(&self, ctx: &mut Context, p: Params) -> anyhow::Result<()> {
        let device = ctx.device().clone();
        let host = Device::Cpu;
        let mut rng = Rng::seeded(p.seed);
        let region = ctx.region("parameters");
        let model = Mlp::stack(
            &mut rng,
            p.width,
            p.depth,
            Activation::Relu,
            DType::F32,
            &device,
        )?;
        let resident_params = region.current_above_baseline().get(Category::Parameters);
        drop(region);
        let twin = model.deep_clone()?;
        let (x, y) = Category::Inputs.scope(|| -> Result<_> {
            Ok((
                rng.randn((p.batch, p.width), &device)?,
                rng.labels(p.batch, p.width as u32, &device)?,
            ))
        })?;
        let vars = model.vars();
        let param_bytes: u64 = vars
            .iter()
            .map(|v| (v.elem_count() * v.dtype().size_in_bytes()) as u64)
            .sum();
        let largest = units(&model)
            .iter()
            .map(|u| ((u.linear.weight().elem_count() + u.linear.bias().elem_count()) * 4) as u64)
            .max()
            .unwrap_or(0);
        ctx.metric("param_bytes", param_bytes as f64);
        ctx.metric("largest_layer_bytes", largest as f64);
        let config = ParamsAdamW {
            lr: p.lr,
            ..Default::default()
        };

        // 1. AdamW with its moments on the host, against candle_nn::AdamW.
        ctx.progress("AdamW on the device");
        let mut region = ctx.region("AdamW, state on the device (candle_nn)");
        let mut reference =
            Category::OptimizerState.scope(|| AdamW::new(twin.vars(), config.clone()))?;
        let mut device_step_time = 0.0;
        for _ in 0..p.steps {
            let grads = param_grads(
                &cross_entropy(&twin.forward(&x)?, &y)?.backward()?,
                &twin.vars(),
            );
            let start = Instant::now();
            Category::OptimizerState.scope(|| reference.step(&grads))?;
            device_step_time += start.elapsed().as_secs_f64();
        }
        region.mark("after steps");
        let on_device = ctx.end_region(region);

        ctx.progress("AdamW on the host");
        let mut region = ctx.region("AdamW, state on the host");
        let mut offloaded = HostAdamW::on(vars.clone(), config.clone(), host.clone())?;
        let mut host_step_time = 0.0;
        for _ in 0..p.steps {
            let grads = param_grads(&cross_entropy(&model.forward(&x)?, &y)?.backward()?, &vars);
            let start = Instant::now();
            offloaded.step(&grads)?;
            host_step_time += start.elapsed().as_secs_f64();
        }
        region.mark("after steps");
        let on_host = ctx.end_region(region);
        let mut diff = 0f64;
        for (a, b) in vars.iter().zip(twin.vars().iter()) {
            diff = diff.max(max_abs_diff(a.as_tensor(), b.as_tensor())?);
        }
        let moved = offloaded.transfers();
        ctx.metric("adamw_max_abs_diff", diff);
        let device_state = |r: &workbook_sdk::RegionReport| {
            r.end.get(Category::OptimizerState)
                - r.end_host.get(Category::OptimizerState)
                - (r.baseline.get(Category::OptimizerState)
                    - r.baseline_host.get(Category::OptimizerState))
        };
        ctx.metric(
            "device_optimizer_bytes_plain",
            device_state(&on_device) as f64,
        );
        ctx.metric(
            "device_optimizer_bytes_offload",
            device_state(&on_host) as f64,
        );
        ctx.metric(
            "host_optimizer_bytes_offload",
            (on_host.end_host.get(Category::OptimizerState)
                - on_host.baseline_host.get(Category::OptimizerState)) as f64,
        );
        ctx.metric(
            "bytes_moved_per_step",
            (moved.to_host_bytes + moved.to_device_bytes) as f64 / p.steps as f64,
        );
        ctx.metric("copy_seconds_per_step", moved.seconds / p.steps as f64);
        ctx.metric("step_seconds_device", device_step_time / p.steps as f64);
        ctx.metric("step_seconds_host", host_step_time / p.steps as f64);
        ctx.print(format!(
            "AdamW with host state: {} steps equal candle_nn::AdamW to {diff:e}; per step {:.1} MiB moved in {:.1} ms, step {:.1} ms against {:.1} ms on the device",
            p.steps,
            mib(moved.to_host_bytes + moved.to_device_bytes) / p.steps as f64,
            1e3 * moved.seconds / p.steps as f64,
            1e3 * host_step_time / p.steps as f64,
            1e3 * device_step_time / p.steps as f64,
        ));

        drop((reference, twin));

        // 2. Gradients: all on the device, or each to the host as it appears.
        ctx.progress("gradients on the device");
        let mut region = ctx.region("backward, gradients kept on the device");
        let grads = Category::Gradients.scope(|| -> Result<GradStore> {
            Ok(param_grads(
                &cross_entropy(&model.forward(&x)?, &y)?.backward()?,
                &vars,
            ))
        })?;
        region.mark("after backward");
        let plain_grads = ctx.end_region(region);
        drop(grads);
        ctx.progress("gradients offloaded layer by layer");
        let us = units(&model);
        let layer_vars: Vec<Vec<Var>> = us
            .iter()
            .map(|u| vec![u.linear.weight().clone(), u.linear.bias().clone()])
            .collect();
        let mut transfers = Transfers::default();
        let mut host_grads = GradStore::default();
        let mut region = ctx.region("backward, gradients offloaded layer by layer");
        layerwise_backward(
            &us,
            &layer_vars,
            &x,
            |h| cross_entropy(h, &y),
            |var, g| {
                let _grads = Category::Gradients.enter();
                let on_host = transfers.to_host(&g, &host)?;
                host_grads.insert(var.as_tensor(), on_host);
                Ok(())
            },
        )?;
        region.mark("after backward");
        let offload_grads = ctx.end_region(region);
        let offload_check = workbook_sdk::train::grads_max_abs_diff(
            &param_grads(&cross_entropy(&model.forward(&x)?, &y)?.backward()?, &vars),
            &host_grads,
            &vars,
        )?;
        drop(host_grads);
        ctx.metric("grad_offload_max_abs_diff", offload_check);
        ctx.metric(
            "device_grad_peak_plain",
            plain_grads.device_peak_above_baseline(Category::Gradients) as f64,
        );
        ctx.metric(
            "device_grad_peak_offload",
            offload_grads.device_peak_above_baseline(Category::Gradients) as f64,
        );
        ctx.metric(
            "host_grad_peak_offload",
            offload_grads.host_peak_above_baseline(Category::Gradients) as f64,
        );
        ctx.metric("grad_copy_seconds", transfers.seconds);
        ctx.print(format!(
            "gradients on the device at their peak: {:.1} MiB kept, {:.1} MiB offloaded layer by layer ({:.1}x the largest layer's {:.1} MiB)",
            mib(plain_grads.device_peak_above_baseline(Category::Gradients)),
            mib(offload_grads.device_peak_above_baseline(Category::Gradients)),
            offload_grads.device_peak_above_baseline(Category::Gradients) as f64 / largest as f64,
            mib(largest)
        ));

        // 3. Parameters: resident, or streamed from the host layer by layer.
        ctx.progress("parameters streamed from the host");
        let mut transfers = Transfers::default();
        let streamed: Vec<(StreamedLinear, Activation)> = us
            .iter()
            .map(|u| {
                Ok((
                    StreamedLinear::from_linear(&u.linear, &host, &mut transfers)?,
                    u.activation,
                ))
            })
            .collect::<Result<_>>()?;
        let mut transfers = Transfers::default();
        let mut region = ctx.region("forward, parameters streamed from the host");
        let start = Instant::now();
        let streamed_out = streamed
            .iter()
            .try_fold(x.clone(), |h, (l, a)| -> Result<Tensor> {
                let out =
                    Category::Activations.scope(|| a.forward(&l.forward(&h, &mut transfers)?))?;
                Ok(out)
            })?;
        let streamed_time = start.elapsed().as_secs_f64();
        region.mark("after forward");
        let streamed_region = ctx.end_region(region);
        let mut region = ctx.region("forward, parameters resident on the device");
        let start = Instant::now();
        let resident_out = Category::Activations.scope(|| model.forward(&x))?.detach();
        let resident_time = start.elapsed().as_secs_f64();
        region.mark("after forward");
        ctx.end_region(region);
        ctx.metric(
            "stream_max_abs_diff",
            max_abs_diff(&streamed_out, &resident_out)?,
        );
        ctx.metric("device_param_bytes_resident", resident_params as f64);
        ctx.metric(
            "device_param_peak_streamed",
            streamed_region.device_peak_above_baseline(Category::Parameters) as f64,
        );
        ctx.metric("stream_copy_seconds", transfers.seconds);
        ctx.metric("stream_forward_seconds", streamed_time);
        ctx.metric("resident_forward_seconds", resident_time);

        let mut table = Table::new(
            "Where the bytes are (device / host), measured",
            &[
                ("what", Unit::None),
                ("on the device", Unit::Bytes),
                ("on the host", Unit::Bytes),
                ("copied", Unit::Bytes),
                ("copy time", Unit::Seconds),
            ],
        );
        let metrics = ctx.output().metrics.clone();
        let m = |k: &str| metrics.get(k).copied().unwrap_or(f64::NAN);
        table.row(vec![
            "AdamW moments, candle_nn".into(),
            (m("device_optimizer_bytes_plain") as u64).into(),
            0u64.into(),
            0u64.into(),
            0.0.into(),
        ]);
        table.row(vec![
            "AdamW moments, HostAdamW".into(),
            (m("device_optimizer_bytes_offload") as u64).into(),
            (m("host_optimizer_bytes_offload") as u64).into(),
            (moved.to_host_bytes + moved.to_device_bytes).into(),
            moved.seconds.into(),
        ]);
        table.row(vec![
            "gradients at their peak, kept".into(),
            (m("device_grad_peak_plain") as u64).into(),
            0u64.into(),
            0u64.into(),
            0.0.into(),
        ]);
        table.row(vec![
            "gradients at their peak, offloaded".into(),
            (m("device_grad_peak_offload") as u64).into(),
            (m("host_grad_peak_offload") as u64).into(),
            (m("host_grad_peak_offload") as u64).into(),
            m("grad_copy_seconds").into(),
        ]);
        table.row(vec![
            "parameters, resident".into(),
            resident_params.into(),
            0u64.into(),
            0u64.into(),
            0.0.into(),
        ]);
        table.row(vec![
            "parameters at their peak, streamed".into(),
            (m("device_param_peak_streamed") as u64).into(),
            param_bytes.into(),
            transfers.to_device_bytes.into(),
            transfers.seconds.into(),
        ]);
        ctx.table(table);
        ctx.print(format!(
            "streamed forward: {:.1} MiB of parameters on the device at most (largest layer {:.1} MiB, all {:.1} MiB); {:.1} ms against {:.1} ms resident, {:.1} ms of it copying",
            mib(m("device_param_peak_streamed") as u64),
            mib(largest),
            mib(param_bytes),
            1e3 * streamed_time,
            1e3 * resident_time,
            1e3 * transfers.seconds
        ));
        Ok(())
    }
}
