//! The offload cell's experiment: what `workbook run` executes and what
//! the chapter's notebook shows in its code cells (see
//! `workbook_sdk::notebook`). Crates are named by their names, this one's
//! included, so that the same text compiles in a notebook cell.

use std::time::Instant;

use candle_checkpoint::layerwise_backward;
use candle_lean_optim::LeanAdamW;
use candle_offload::{HostAdamW, StreamedLinear, Transfers};
use workbook_models::{
    cross_entropy, max_abs_diff, param_grads, Activation, Layer, Linear, Mlp, Rng,
};
use workbook_offload::Params as OffloadParams;
use workbook_sdk::anyhow;
use workbook_sdk::candle::backprop::GradStore;
use workbook_sdk::candle::{DType, Device, Module, Result, Tensor};
use workbook_sdk::candle_nn::{AdamW, Optimizer, ParamsAdamW};
use workbook_sdk::observe::Tags;
use workbook_sdk::output::{mib, Unit};
use workbook_sdk::{Category, Context, Residency, Table};

// notebook cell
/// Copies `t` to `to`, counted in `transfers` and tagged as living there.
pub fn copy_to(
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

/// Linear + ReLU units of a stack: the layers of the layer-wise backward.
pub struct Unit2 {
    /// The linear layer.
    pub linear: Linear,
    /// The activation after it.
    pub activation: Activation,
}

impl Module for Unit2 {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.activation.forward(&self.linear.forward(x)?)
    }
}

/// The stack `model` as its Linear + activation units.
pub fn units(model: &Mlp) -> Vec<Unit2> {
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

// notebook cell
/// The experiment: AdamW's state on the host (`HostAdamW`), gradients handed
/// to the host layer by layer, and weights streamed to the device per layer,
/// each against training on the device, with what each moves.
pub fn offload_experiment(ctx: &mut Context, p: OffloadParams) -> anyhow::Result<()> {
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
        // A device that runs asynchronously (CUDA) is waited for, so that
        // the time is the step's alone.
        device.synchronize()?;
        let start = Instant::now();
        Category::OptimizerState.scope(|| reference.step(&grads))?;
        device.synchronize()?;
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
    // The toolkit's in-place AdamW on the device, timed the same way: what
    // a step with the state on the device costs without candle_nn's
    // temporaries (compared with PyTorch's AdamW by scripts/compare.py).
    ctx.progress("LeanAdamW on the device");
    let lean_twin = model.deep_clone()?;
    let mut lean = LeanAdamW::new(lean_twin.vars(), config.clone())?;
    let mut lean_step_time = 0.0;
    // A first step untimed, as PyTorch's script has taken one before it
    // times: its moments' pages are touched for the first time there.
    for step in 0..=p.steps {
        let grads = param_grads(
            &cross_entropy(&lean_twin.forward(&x)?, &y)?.backward()?,
            &lean_twin.vars(),
        );
        device.synchronize()?;
        let start = Instant::now();
        lean.step(&grads)?;
        device.synchronize()?;
        if step > 0 {
            lean_step_time += start.elapsed().as_secs_f64();
        }
    }
    drop((lean, lean_twin));
    ctx.metric("step_seconds_device_lean", lean_step_time / p.steps as f64);
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
    let transfers = streamed
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
