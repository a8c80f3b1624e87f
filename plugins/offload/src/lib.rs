//! The offload cell: optimizer state, gradients and parameters kept in host
//! memory and brought to the device only when needed.
//!
//! The techniques are the toolkit's: `candle_offload::HostAdamW` (f32
//! master weights and both moments on the host, twice the parameters' bytes
//! moved per step), `candle_checkpoint::layerwise_backward` (each layer's
//! gradients handed over as soon as they exist) and
//! `candle_offload::StreamedLinear` (weights that visit the device for the
//! forward and again for the backward).
//!
//! On a CPU-only run host and device are the same memory; the copies are
//! still made, and the meter files each under the side it stands for
//! ([`Residency`]), so the shift shows.
#![warn(missing_docs)]

use std::time::Instant;

use candle_checkpoint::layerwise_backward;
use candle_offload::{HostAdamW, StreamedLinear, Transfers};
use serde::{Deserialize, Serialize};
use workbook_models::{
    cross_entropy, max_abs_diff, param_grads, Activation, Layer, Linear, Mlp, Rng,
};
use workbook_sdk::anyhow;
use workbook_sdk::candle::backprop::GradStore;
use workbook_sdk::candle::{DType, Device, Module, Result, Tensor};
use workbook_sdk::candle_nn::{AdamW, Optimizer, ParamsAdamW};
use workbook_sdk::metric::MetricSpec;
use workbook_sdk::observe::Tags;
use workbook_sdk::output::{mib, Unit};
use workbook_sdk::{Category, Context, Plugin, Residency, Rules, Table, Violation};

/// Copies `t` to `to`, counted in `transfers` and tagged as living there.
fn copy_to(
    transfers: &mut Transfers,
    t: &Tensor,
    to: &Device,
    residency: Residency,
) -> Result<Tensor> {
    residency.scope(|| match residency {
        Residency::Host => transfers.to_host(t, to),
        Residency::Device => transfers.to_device(t, to),
    })
}

/// Parameters of the offload cell.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Params {
    /// Width of the model (features).
    pub width: usize,
    /// Depth of the model (Linear + ReLU blocks).
    pub depth: usize,
    /// Batch (rows).
    pub batch: usize,
    /// AdamW steps compared with candle_nn::AdamW.
    #[schemars(range(min = 1))]
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

/// Linear + ReLU units of a stack: the layers of the layer-wise backward.
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

    fn metrics(&self) -> Vec<MetricSpec> {
        vec![
            MetricSpec::bytes("param_bytes", "bytes of the model's parameters"),
            MetricSpec::bytes(
                "largest_layer_bytes",
                "f32 bytes of the largest layer's weight and bias",
            ),
            MetricSpec::number(
                "adamw_max_abs_diff",
                "largest parameter difference after the steps, HostAdamW against candle_nn's",
            ),
            MetricSpec::bytes(
                "device_optimizer_bytes_plain",
                "optimizer state on the device after the steps, candle_nn::AdamW",
            ),
            MetricSpec::bytes(
                "device_optimizer_bytes_offload",
                "optimizer state on the device after the steps, HostAdamW",
            ),
            MetricSpec::bytes(
                "host_optimizer_bytes_offload",
                "optimizer state on the host after the steps, HostAdamW (masters and moments)",
            ),
            MetricSpec::bytes(
                "bytes_moved_per_step",
                "bytes HostAdamW copies per step, both ways, set-up excluded",
            ),
            MetricSpec::seconds(
                "copy_seconds_per_step",
                "time HostAdamW spends copying per step",
            ),
            MetricSpec::seconds(
                "step_seconds_device",
                "mean time of a candle_nn::AdamW step",
            ),
            MetricSpec::seconds(
                "step_seconds_host",
                "mean time of a HostAdamW step, copies included",
            ),
            MetricSpec::number(
                "grad_offload_max_abs_diff",
                "largest gradient difference, offloaded layer by layer against plain backward",
            ),
            MetricSpec::bytes(
                "device_grad_peak_plain",
                "gradients on the device at their peak, all kept there",
            ),
            MetricSpec::bytes(
                "device_grad_peak_offload",
                "gradients on the device at their peak, offloaded layer by layer",
            ),
            MetricSpec::bytes(
                "host_grad_peak_offload",
                "gradients on the host at their peak, offloaded layer by layer",
            ),
            MetricSpec::seconds(
                "grad_copy_seconds",
                "time copying gradients to the host in the layer-by-layer backward",
            ),
            MetricSpec::number(
                "stream_max_abs_diff",
                "largest output difference, streamed layers against resident",
            ),
            MetricSpec::number(
                "stream_grad_max_abs_diff",
                "largest weight and bias gradient difference, streamed layers against resident",
            ),
            MetricSpec::bytes(
                "device_param_bytes_resident",
                "parameters on the device when the model is resident",
            ),
            MetricSpec::bytes(
                "device_param_peak_streamed",
                "parameters on the device at their peak, streamed forward and backward",
            ),
            MetricSpec::bytes(
                "stream_bytes_to_device",
                "bytes the streamed layers copy to the device in a forward and backward",
            ),
            MetricSpec::seconds(
                "stream_copy_seconds",
                "time the streamed layers spend copying in a forward and backward",
            ),
            MetricSpec::seconds(
                "stream_step_seconds",
                "time of the streamed forward and backward",
            ),
            MetricSpec::seconds(
                "resident_step_seconds",
                "time of the resident forward and backward",
            ),
        ]
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
        let mut offloaded = HostAdamW::on(vars.clone(), config.clone(), host.clone(), Tags)?;
        // The masters' first copy to the host is set-up, not a step's cost.
        let setup = offloaded.transfers();
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
        let moved = offloaded.transfers().since(&setup);
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
        let mut transfers = Transfers::default();
        let mut host_grads = GradStore::default();
        let mut region = ctx.region("backward, gradients offloaded layer by layer");
        layerwise_backward(
            &us,
            &x,
            &vars,
            |h| cross_entropy(h, &y),
            |var, g| {
                let _grads = Category::Gradients.enter();
                let on_host = copy_to(&mut transfers, &g, &host, Residency::Host)?;
                host_grads.insert(var.as_tensor(), on_host);
                Ok(())
            },
            &Tags,
        )?;
        region.mark("after backward");
        let offload_grads = ctx.end_region(region);
        let offload_check = workbook_models::grads_max_abs_diff(
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

        // 3. Parameters: resident, or streamed from the host layer by layer,
        // for the forward and again for the backward.
        ctx.progress("parameters streamed from the host");
        let streamed: Vec<(StreamedLinear, Activation)> = us
            .iter()
            .map(|u| {
                let layer = StreamedLinear::with_observer(
                    u.linear.weight().clone(),
                    Some(u.linear.bias().clone()),
                    &host,
                    &device,
                    Tags,
                )?;
                Ok((layer, u.activation))
            })
            .collect::<Result<_>>()?;
        let before: Vec<Transfers> = streamed.iter().map(|(l, _)| l.transfers()).collect();
        let mut region = ctx.region("forward and backward, parameters streamed from the host");
        let start = Instant::now();
        let streamed_out = Category::Activations.scope(|| {
            streamed
                .iter()
                .try_fold(x.clone(), |h, (l, a)| a.forward(&l.forward(&h)?))
        })?;
        region.mark("after forward");
        let streamed_loss = Category::Activations.scope(|| cross_entropy(&streamed_out, &y))?;
        Category::Gradients.scope(|| streamed_loss.backward())?;
        let streamed_time = start.elapsed().as_secs_f64();
        region.mark("after backward");
        let streamed_region = ctx.end_region(region);
        let streamed_out = streamed_out.detach();
        drop(streamed_loss);
        let mut region = ctx.region("forward and backward, parameters resident on the device");
        let start = Instant::now();
        let resident_out = Category::Activations.scope(|| model.forward(&x))?;
        region.mark("after forward");
        let resident_grads = Category::Gradients.scope(|| -> Result<GradStore> {
            Ok(param_grads(
                &cross_entropy(&resident_out, &y)?.backward()?,
                &vars,
            ))
        })?;
        let resident_time = start.elapsed().as_secs_f64();
        region.mark("after backward");
        ctx.end_region(region);
        ctx.metric(
            "stream_max_abs_diff",
            max_abs_diff(&streamed_out, &resident_out)?,
        );
        let mut grad_diff = 0f64;
        for ((layer, _), u) in streamed.iter().zip(&us) {
            let host_grads = layer.take_grads();
            let (w, b) = (&layer.vars()[0], &layer.vars()[1]);
            for (host_var, resident) in [(w, u.linear.weight()), (b, u.linear.bias())] {
                let (Some(a), Some(r)) = (host_grads.get(host_var), resident_grads.get(resident))
                else {
                    anyhow::bail!("a streamed or resident layer got no gradient");
                };
                grad_diff = grad_diff.max(max_abs_diff(a, r)?);
            }
        }
        ctx.metric("stream_grad_max_abs_diff", grad_diff);
        let transfers =
            streamed
                .iter()
                .zip(&before)
                .fold(Transfers::default(), |acc, ((l, _), b)| {
                    let t = l.transfers().since(b);
                    Transfers {
                        to_host_bytes: acc.to_host_bytes + t.to_host_bytes,
                        to_device_bytes: acc.to_device_bytes + t.to_device_bytes,
                        seconds: acc.seconds + t.seconds,
                    }
                });
        ctx.metric("device_param_bytes_resident", resident_params as f64);
        ctx.metric(
            "device_param_peak_streamed",
            streamed_region.device_peak_above_baseline(Category::Parameters) as f64,
        );
        ctx.metric("stream_bytes_to_device", transfers.to_device_bytes as f64);
        ctx.metric("stream_copy_seconds", transfers.seconds);
        ctx.metric("stream_step_seconds", streamed_time);
        ctx.metric("resident_step_seconds", resident_time);

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
            "streamed forward and backward: {:.1} MiB of parameters on the device at most (largest layer {:.1} MiB, all {:.1} MiB); {:.1} ms against {:.1} ms resident, {:.1} ms of it copying",
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
