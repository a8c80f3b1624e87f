//! The offload cell's experiment: what `workbook run` executes and what
//! the chapter's notebook shows in its code cells (see
//! `workbook_sdk::notebook`). Crates are named by their names, this one's
//! included, so that the same text compiles in a notebook cell.

use std::time::Instant;

use candle_checkpoint::Sequential;
use candle_lean_optim::LeanAdamW;
use candle_offload::{HostAdamW, StreamedLinear, Transfers};
use workbook_models::{
    cross_entropy, max_abs_diff, param_grads, Activation, Layer, Linear, Mlp, Rng,
};
use workbook_offload::Params as OffloadParams;
use workbook_sdk::anyhow;
use workbook_sdk::candle::backprop::GradStore;
use workbook_sdk::candle::{DType, Device, Module, Result, Tensor, Var};
use workbook_sdk::candle_nn::{AdamW, Optimizer, ParamsAdamW};
use workbook_sdk::observe::Tags;
use workbook_sdk::output::{mib, RegionReport, Unit};
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

/// What the three comparisons share: the stack on the device, one batch,
/// their sizes and AdamW's settings.
pub struct OffloadSetup {
    /// The stack, trained in place.
    pub model: Mlp,
    /// Its parameters.
    pub vars: Vec<Var>,
    /// The batch's inputs.
    pub x: Tensor,
    /// The batch's labels.
    pub y: Tensor,
    /// The parameters' bytes.
    pub param_bytes: u64,
    /// The largest layer's weight and bias, in bytes.
    pub largest: u64,
    /// What the parameters took on the device as they were made.
    pub resident_params: u64,
    /// AdamW's settings, the same for every optimizer.
    pub config: ParamsAdamW,
}

// notebook cell
/// The stack, measured as it is made, a twin of it for the reference
/// optimizer, and a batch.
pub fn offload_setup(ctx: &mut Context, p: &OffloadParams) -> anyhow::Result<(OffloadSetup, Mlp)> {
    let device = ctx.device().clone();
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
    let setup = OffloadSetup {
        model,
        vars,
        x,
        y,
        param_bytes,
        largest,
        resident_params,
        config,
    };
    Ok((setup, twin))
}

// notebook cell
/// candle_nn's AdamW on the twin, its state on the device, each step
/// timed: the optimizer, what its steps left, and their seconds.
pub fn adamw_on_device(
    ctx: &mut Context,
    p: &OffloadParams,
    s: &OffloadSetup,
    twin: &Mlp,
) -> anyhow::Result<(AdamW, RegionReport, f64)> {
    let device = ctx.device().clone();
    ctx.progress("AdamW on the device");
    let mut region = ctx.region("AdamW, state on the device (candle_nn)");
    let mut reference =
        Category::OptimizerState.scope(|| AdamW::new(twin.vars(), s.config.clone()))?;
    let mut seconds = 0.0;
    for _ in 0..p.steps {
        let grads = param_grads(
            &cross_entropy(&twin.forward(&s.x)?, &s.y)?.backward()?,
            &twin.vars(),
        );
        // A device that runs asynchronously (CUDA) is waited for, so that
        // the time is the step's alone.
        device.synchronize()?;
        let start = Instant::now();
        Category::OptimizerState.scope(|| reference.step(&grads))?;
        device.synchronize()?;
        seconds += start.elapsed().as_secs_f64();
    }
    region.mark("after steps");
    Ok((reference, ctx.end_region(region), seconds))
}

/// The toolkit's HostAdamW on the stack, its state on the host: the
/// optimizer, what its masters' first copy moved (set-up, not a step's
/// cost), what its steps left, and their seconds.
pub fn adamw_on_host(
    ctx: &mut Context,
    p: &OffloadParams,
    s: &OffloadSetup,
) -> anyhow::Result<(HostAdamW, Transfers, RegionReport, f64)> {
    ctx.progress("AdamW on the host");
    let mut region = ctx.region("AdamW, state on the host");
    let mut offloaded = HostAdamW::on(s.vars.clone(), s.config.clone(), Device::Cpu, Tags)?;
    let first_copy = offloaded.transfers();
    let mut seconds = 0.0;
    for _ in 0..p.steps {
        let grads = param_grads(
            &cross_entropy(&s.model.forward(&s.x)?, &s.y)?.backward()?,
            &s.vars,
        );
        // The backward's kernels finish before the step's time starts.
        ctx.device().synchronize()?;
        let start = Instant::now();
        offloaded.step(&grads)?;
        // The parameters' copies back to a GPU may still be running.
        ctx.device().synchronize()?;
        seconds += start.elapsed().as_secs_f64();
    }
    region.mark("after steps");
    Ok((offloaded, first_copy, ctx.end_region(region), seconds))
}

/// The toolkit's in-place AdamW on the device, timed the same way: what a
/// step with the state on the device costs without candle_nn's temporaries
/// (compared with PyTorch's AdamW by scripts/compare.py). Seconds a step.
pub fn lean_adamw_seconds(
    ctx: &mut Context,
    p: &OffloadParams,
    s: &OffloadSetup,
) -> anyhow::Result<f64> {
    let device = ctx.device().clone();
    ctx.progress("LeanAdamW on the device");
    let lean_twin = s.model.deep_clone()?;
    let mut lean = LeanAdamW::new(lean_twin.vars(), s.config.clone())?;
    let mut seconds = 0.0;
    // A first step untimed, as PyTorch's script has taken one before it
    // times: its moments' pages are touched for the first time there.
    for step in 0..=p.steps {
        let grads = param_grads(
            &cross_entropy(&lean_twin.forward(&s.x)?, &s.y)?.backward()?,
            &lean_twin.vars(),
        );
        device.synchronize()?;
        let start = Instant::now();
        lean.step(&grads)?;
        device.synchronize()?;
        if step > 0 {
            seconds += start.elapsed().as_secs_f64();
        }
    }
    Ok(seconds / p.steps as f64)
}

// notebook cell
/// Step 1: AdamW with its moments on the host, against candle_nn::AdamW
/// on the device: equal to it, and what each keeps where, moves and takes.
/// Returns HostAdamW (its state stays for the rest of the experiment, as
/// in training) and what its steps moved.
pub fn optimizer_on_host(
    ctx: &mut Context,
    p: &OffloadParams,
    s: &OffloadSetup,
    twin: Mlp,
) -> anyhow::Result<(HostAdamW, Transfers)> {
    let (reference, on_device, device_step_time) = adamw_on_device(ctx, p, s, &twin)?;
    let (offloaded, first_copy, on_host, host_step_time) = adamw_on_host(ctx, p, s)?;
    let mut diff = 0f64;
    for (a, b) in s.vars.iter().zip(twin.vars().iter()) {
        diff = diff.max(max_abs_diff(a.as_tensor(), b.as_tensor())?);
    }
    let lean_step_time = lean_adamw_seconds(ctx, p, s)?;
    ctx.metric("step_seconds_device_lean", lean_step_time);
    let moved = offloaded.transfers().since(&first_copy);
    ctx.metric("adamw_max_abs_diff", diff);
    let device_state = |r: &RegionReport| {
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
    Ok((offloaded, moved))
}

// notebook cell
/// Step 2: gradients all on the device, or each to the host as the
/// layer-wise backward makes it. Returns the stack's units, which step 3
/// streams.
pub fn gradients_offloaded(ctx: &mut Context, s: &OffloadSetup) -> anyhow::Result<Vec<Unit2>> {
    let host = Device::Cpu;
    let (x, y, vars) = (&s.x, &s.y, &s.vars);
    ctx.progress("gradients on the device");
    let mut region = ctx.region("backward, gradients kept on the device");
    let grads = Category::Gradients.scope(|| -> Result<GradStore> {
        Ok(param_grads(
            &cross_entropy(&s.model.forward(x)?, y)?.backward()?,
            vars,
        ))
    })?;
    region.mark("after backward");
    let plain_grads = ctx.end_region(region);
    drop(grads);
    ctx.progress("gradients offloaded layer by layer");
    let us = units(&s.model);
    let mut transfers = Transfers::default();
    let mut host_grads = GradStore::default();
    let mut region = ctx.region("backward, gradients offloaded layer by layer");
    Sequential::new(&us)
        .each_layer()
        .observer(&Tags)
        .backward_with(
            x,
            vars,
            |h| cross_entropy(h, y),
            |var, g| {
                let _grads = Category::Gradients.enter();
                let on_host = copy_to(&mut transfers, &g, &host, Residency::Host)?;
                host_grads.insert(var.as_tensor(), on_host);
                Ok(())
            },
        )
        .map(|(loss, _)| loss)?;
    region.mark("after backward");
    let offload_grads = ctx.end_region(region);
    let offload_check = workbook_models::grads_max_abs_diff(
        &param_grads(&cross_entropy(&s.model.forward(x)?, y)?.backward()?, vars),
        &host_grads,
        vars,
    )?;
    drop(host_grads);
    let kept = plain_grads.device_peak_above_baseline(Category::Gradients);
    let offloaded = offload_grads.device_peak_above_baseline(Category::Gradients);
    ctx.metric("grad_offload_max_abs_diff", offload_check);
    ctx.metric("device_grad_peak_plain", kept as f64);
    ctx.metric("device_grad_peak_offload", offloaded as f64);
    ctx.metric(
        "host_grad_peak_offload",
        offload_grads.host_peak_above_baseline(Category::Gradients) as f64,
    );
    ctx.metric("grad_copy_seconds", transfers.seconds);
    ctx.print(format!(
        "gradients on the device at their peak: {:.1} MiB kept, {:.1} MiB offloaded layer by layer ({:.1}x the largest layer's {:.1} MiB)",
        mib(kept),
        mib(offloaded),
        offloaded as f64 / s.largest as f64,
        mib(s.largest)
    ));
    Ok(us)
}

/// What streaming the parameters moved and took, against the resident
/// stack's step.
pub struct Streamed {
    /// What the streamed layers copied, and how long it took.
    pub transfers: Transfers,
    /// The streamed forward and backward's seconds.
    pub streamed_seconds: f64,
    /// The resident forward and backward's seconds.
    pub resident_seconds: f64,
}

/// The units' layers with their weights kept on the host and streamed to
/// `device` when they compute.
pub fn streamed_layers(us: &[Unit2], device: &Device) -> Result<Vec<(StreamedLinear, Activation)>> {
    us.iter()
        .map(|u| {
            let layer = StreamedLinear::with_observer(
                u.linear.weight().clone(),
                Some(u.linear.bias().clone()),
                device,
                Tags,
            )?;
            Ok((layer, u.activation))
        })
        .collect()
}

/// The largest difference between the streamed layers' gradients (on the
/// host) and the resident stack's.
pub fn grads_max_diff(
    streamed: &[(StreamedLinear, Activation)],
    us: &[Unit2],
    resident_grads: &GradStore,
) -> anyhow::Result<f64> {
    let mut diff = 0f64;
    for ((layer, _), u) in streamed.iter().zip(us) {
        let host_grads = layer.take_grads();
        let (w, b) = (&layer.vars()[0], &layer.vars()[1]);
        for (host_var, resident) in [(w, u.linear.weight()), (b, u.linear.bias())] {
            let (Some(a), Some(r)) = (host_grads.get(host_var), resident_grads.get(resident))
            else {
                anyhow::bail!("a streamed or resident layer got no gradient");
            };
            diff = diff.max(max_abs_diff(a, r)?);
        }
    }
    Ok(diff)
}

// notebook cell
/// Step 3: the parameters resident, or streamed from the host layer by
/// layer, for the forward and again for the backward: equal results, and
/// the device's parameters at their peak.
pub fn parameters_streamed(
    ctx: &mut Context,
    s: &OffloadSetup,
    us: &[Unit2],
) -> anyhow::Result<Streamed> {
    let (x, y) = (&s.x, &s.y);
    ctx.progress("parameters streamed from the host");
    let streamed = streamed_layers(us, ctx.device())?;
    let before: Vec<Transfers> = streamed.iter().map(|(l, _)| l.transfers()).collect();
    let mut region = ctx.region("forward and backward, parameters streamed from the host");
    let start = Instant::now();
    let streamed_out = Category::Activations.scope(|| {
        streamed
            .iter()
            .try_fold(x.clone(), |h, (l, a)| a.forward(&l.forward(&h)?))
    })?;
    region.mark("after forward");
    let streamed_loss = Category::Activations.scope(|| cross_entropy(&streamed_out, y))?;
    Category::Gradients.scope(|| streamed_loss.backward())?;
    ctx.device().synchronize()?;
    let streamed_seconds = start.elapsed().as_secs_f64();
    region.mark("after backward");
    let streamed_region = ctx.end_region(region);
    let streamed_out = streamed_out.detach();
    drop(streamed_loss);
    let mut region = ctx.region("forward and backward, parameters resident on the device");
    let start = Instant::now();
    let resident_out = Category::Activations.scope(|| s.model.forward(x))?;
    region.mark("after forward");
    let resident_grads = Category::Gradients.scope(|| -> Result<GradStore> {
        Ok(param_grads(
            &cross_entropy(&resident_out, y)?.backward()?,
            &s.vars,
        ))
    })?;
    ctx.device().synchronize()?;
    let resident_seconds = start.elapsed().as_secs_f64();
    region.mark("after backward");
    ctx.end_region(region);
    ctx.metric(
        "stream_max_abs_diff",
        max_abs_diff(&streamed_out, &resident_out)?,
    );
    ctx.metric(
        "stream_grad_max_abs_diff",
        grads_max_diff(&streamed, us, &resident_grads)?,
    );
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
    ctx.metric("device_param_bytes_resident", s.resident_params as f64);
    ctx.metric(
        "device_param_peak_streamed",
        streamed_region.device_peak_above_baseline(Category::Parameters) as f64,
    );
    ctx.metric("stream_bytes_to_device", transfers.to_device_bytes as f64);
    ctx.metric("stream_copy_seconds", transfers.seconds);
    ctx.metric("stream_step_seconds", streamed_seconds);
    ctx.metric("resident_step_seconds", resident_seconds);
    Ok(Streamed {
        transfers,
        streamed_seconds,
        resident_seconds,
    })
}

// notebook cell
/// The three comparisons in one table: where the bytes are, what was
/// copied and how long it took.
pub fn where_the_bytes_are(
    ctx: &mut Context,
    s: &OffloadSetup,
    moved: &Transfers,
    streamed: &Streamed,
) {
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
    let m = |k: &str| metrics.get(k).copied().unwrap_or(f64::NAN) as u64;
    let seconds = |k: &str| metrics.get(k).copied().unwrap_or(f64::NAN);
    let rows: [(&str, u64, u64, u64, f64); 6] = [
        (
            "AdamW moments, candle_nn",
            m("device_optimizer_bytes_plain"),
            0,
            0,
            0.0,
        ),
        (
            "AdamW moments, HostAdamW",
            m("device_optimizer_bytes_offload"),
            m("host_optimizer_bytes_offload"),
            moved.to_host_bytes + moved.to_device_bytes,
            moved.seconds,
        ),
        (
            "gradients at their peak, kept",
            m("device_grad_peak_plain"),
            0,
            0,
            0.0,
        ),
        (
            "gradients at their peak, offloaded",
            m("device_grad_peak_offload"),
            m("host_grad_peak_offload"),
            m("host_grad_peak_offload"),
            seconds("grad_copy_seconds"),
        ),
        ("parameters, resident", s.resident_params, 0, 0, 0.0),
        (
            "parameters at their peak, streamed",
            m("device_param_peak_streamed"),
            s.param_bytes,
            streamed.transfers.to_device_bytes,
            streamed.transfers.seconds,
        ),
    ];
    for (what, device, host, copied, copy_seconds) in rows {
        table.row(vec![
            what.into(),
            device.into(),
            host.into(),
            copied.into(),
            copy_seconds.into(),
        ]);
    }
    ctx.table(table);
    ctx.print(format!(
        "streamed forward and backward: {:.1} MiB of parameters on the device at most (largest layer {:.1} MiB, all {:.1} MiB); {:.1} ms against {:.1} ms resident, {:.1} ms of it copying",
        mib(m("device_param_peak_streamed")),
        mib(s.largest),
        mib(s.param_bytes),
        1e3 * streamed.streamed_seconds,
        1e3 * streamed.resident_seconds,
        1e3 * streamed.transfers.seconds
    ));
}

// notebook cell
/// The experiment: AdamW's state on the host (`HostAdamW`), gradients handed
/// to the host layer by layer, and weights streamed to the device per layer,
/// each against training on the device, with what each moves.
pub fn offload_experiment(ctx: &mut Context, p: OffloadParams) -> anyhow::Result<()> {
    let (setup, twin) = offload_setup(ctx, &p)?;
    // HostAdamW's state stays on the host through steps 2 and 3.
    let (_optimizer, moved) = optimizer_on_host(ctx, &p, &setup, twin)?;
    let units = gradients_offloaded(ctx, &setup)?;
    let streamed = parameters_streamed(ctx, &setup, &units)?;
    where_the_bytes_are(ctx, &setup, &moved, &streamed);
    Ok(())
}
