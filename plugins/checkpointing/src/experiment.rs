//! The checkpointing cell's experiment: what `workbook run` executes and
//! what the chapter's notebook shows in its code cells, a cell per
//! `// notebook cell` line (see `workbook_sdk::notebook`). Crates are named
//! by their names, this one's included, so that the same text compiles in a
//! notebook cell.

use std::time::Instant;

use candle_checkpoint::{DirectBackward, Policy, Sequential};
use workbook_checkpointing::Params as CheckpointingParams;
use workbook_models::taped::{batch, Config as TransformerConfig, Transformer};
use workbook_models::{
    cross_entropy, grads_max_abs_diff, max_abs_diff, param_grads, Activation, Mlp, Rng,
};
use workbook_sdk::anyhow;
use workbook_sdk::candle::backprop::GradStore;
use workbook_sdk::candle::{DType, Module, Result, Tensor, Var};
use workbook_sdk::candle_nn::VarMap;
use workbook_sdk::observe::{Marks, Tags};
use workbook_sdk::output::{mib, Axis, Marker, Series, Unit};
use workbook_sdk::timing::timed;
use workbook_sdk::{median, Category, Context, Figure, Table};

// notebook cell
/// Runs `layers` one after the other: a stack as one segment.
pub fn run_segment<M: Module>(layers: &[M], x: &Tensor) -> Result<Tensor> {
    layers.iter().try_fold(x.clone(), |h, l| l.forward(&h))
}

/// The checkpointing tip's "heavy function": `x + a`, `adds` times.
#[derive(Debug, Clone)]
pub struct Heavy {
    a: Var,
    adds: usize,
}

impl Heavy {
    /// A heavy function sharing the parameter `a`.
    pub fn new(a: Var, adds: usize) -> Self {
        Self { a, adds }
    }
}

impl Module for Heavy {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        (0..self.adds).try_fold(x.clone(), |h, _| h.broadcast_add(self.a.as_tensor()))
    }
}

/// One way of running a forward and backward, measured.
pub struct Backprop {
    /// The first run's peak above the region's start.
    pub peak: u64,
    /// The first run's peak of activations above the region's start.
    pub act: u64,
    /// The first run's peak of gradients above the region's start.
    pub grad: u64,
    /// The median time of the runs.
    pub time: f64,
    /// The first run's gradients.
    pub grads: GradStore,
}

/// `step` run `repeats` times, each in a region named `name`: the first
/// run's memory and gradients (later runs only time), the median time.
pub fn measure_backprop(
    ctx: &mut Context,
    name: &str,
    repeats: usize,
    mut step: impl FnMut(&mut workbook_sdk::Region) -> anyhow::Result<GradStore>,
) -> anyhow::Result<Backprop> {
    let mut first = None;
    let mut times = Vec::new();
    for rep in 0..repeats {
        ctx.progress(&format!("{name}, run {}", rep + 1));
        let mut region = ctx.region(name);
        let start = Instant::now();
        let grads = step(&mut region)?;
        // On a GPU the backward's last kernels may still be running.
        ctx.device().synchronize()?;
        times.push(start.elapsed().as_secs_f64());
        if first.is_none() {
            let r = ctx.end_region(region);
            first = Some(Backprop {
                peak: r.peak_above_baseline(),
                act: r.category_peak_above_baseline(Category::Activations),
                grad: r.category_peak_above_baseline(Category::Gradients),
                time: 0.0,
                grads,
            });
        }
    }
    let Some(first) = first else {
        anyhow::bail!("{name}: repeats must be at least 1");
    };
    Ok(Backprop {
        time: median(times),
        ..first
    })
}

// notebook cell
/// The deep stack, one forward and backward four ways: what the framework
/// itself costs, before any technique.
pub fn framework_cost(
    ctx: &mut Context,
    p: &CheckpointingParams,
    model: &Mlp,
    x: &Tensor,
    y: &Tensor,
) -> anyhow::Result<Backprop> {
    let vars = model.vars();
    // candle-nn's layers (a Linear, then a GELU) or the toolkit's fused
    // ones, then candle's own backward.
    let candle_backward = |fused: bool, region: &mut workbook_sdk::Region| {
        let loss = Category::Activations.scope(|| {
            let h = if fused {
                model.forward_fused(x)?
            } else {
                model.forward(x)?
            };
            cross_entropy(&h, y)
        })?;
        region.mark("after forward");
        let grads = Category::Gradients
            .scope(|| -> anyhow::Result<_> { Ok(param_grads(&loss.backward()?, &vars)) })?;
        drop(loss);
        region.mark("after backward");
        Ok(grads)
    };
    let candle = measure_backprop(
        ctx,
        "candle-nn's layers, candle's backward",
        p.repeats,
        |r| candle_backward(false, r),
    )?;
    let name = "fused layers (candle-lean-nn), candle's backward";
    let fused = measure_backprop(ctx, name, p.repeats, |r| candle_backward(true, r))?;
    let fused_diff = grads_max_abs_diff(&candle.grads, &fused.grads, &vars)?;

    // The fused layers under the toolkit's lean backward (each layer's
    // graph dropped once the backward has passed it, as PyTorch frees what
    // it saved) and its one-operation cross-entropy.
    let layers = model.fused_layers()?;
    let lean_head = |h: &Tensor| candle_lean_nn::cross_entropy(h, y);
    let name = "fused layers, lean backward";
    let layered = measure_backprop(ctx, name, p.repeats, |region| {
        Ok(Sequential::new(&layers)
            .observer(&Marks::new(region))
            .lean(x, &vars, lean_head)?
            .grads)
    })?;
    let layered_diff = grads_max_abs_diff(&candle.grads, &layered.grads, &vars)?;

    // The lean path: each layer's backward (and the loss's) called
    // directly, no candle graph at all: no zeros tensor and sum per
    // gradient.
    let direct_head = |h: &Tensor| candle_lean_nn::cross_entropy_and_grad(h, y, 1.0);
    let name = "fused layers, direct backward";
    let lean = measure_backprop(ctx, name, p.repeats, |region| {
        Ok(Sequential::direct(&layers)
            .observer(&Marks::new(region))
            .backward(x, &vars, direct_head)?
            .grads)
    })?;
    let lean_diff = grads_max_abs_diff(&candle.grads, &lean.grads, &vars)?;
    framework_report(
        ctx,
        p,
        [&candle, &fused, &layered, &lean],
        [fused_diff, layered_diff, lean_diff],
    );
    Ok(lean)
}

/// The four paths as a table beside candle-nn's, and their metrics:
/// candle-nn's layers, then the fused layers under candle's backward, the
/// lean backward and the direct one; each one's gradients against
/// candle-nn's (`diffs`, for the last three).
pub fn framework_report(
    ctx: &mut Context,
    p: &CheckpointingParams,
    [candle, fused, layered, lean]: [&Backprop; 4],
    [fused_diff, layered_diff, lean_diff]: [f64; 3],
) {
    let mut table = Table::new(
        format!(
            "What the framework costs: {} x (Linear({w},{w}) + GELU), batch {}, forward and backward",
            p.stack_depth,
            p.stack_batch,
            w = p.stack_width
        ),
        &[
            ("path", Unit::None),
            ("peak", Unit::Bytes),
            ("vs candle-nn", Unit::Ratio),
            ("activations at their peak", Unit::Bytes),
            ("gradients at their peak", Unit::Bytes),
            ("median time", Unit::Seconds),
            ("max |grad diff|", Unit::None),
        ],
    );
    for (label, run, diff) in [
        ("candle-nn's layers, candle's backward", candle, 0.0),
        ("fused layers, candle's backward", fused, fused_diff),
        ("fused layers, lean backward", layered, layered_diff),
        ("fused layers, direct backward", lean, lean_diff),
    ] {
        table.row(vec![
            label.into(),
            run.peak.into(),
            (run.peak as f64 / candle.peak as f64).into(),
            run.act.into(),
            run.grad.into(),
            run.time.into(),
            diff.into(),
        ]);
    }
    ctx.table(table);
    for (suffix, run) in [
        ("_candle", candle),
        ("_fused", fused),
        ("_layered", layered),
        ("", lean),
    ] {
        ctx.metric(format!("peak_plain{suffix}"), run.peak as f64);
        ctx.metric(format!("activation_peak_plain{suffix}"), run.act as f64);
        ctx.metric(format!("gradient_peak_plain{suffix}"), run.grad as f64);
    }
    ctx.metric("time_plain_candle", candle.time);
    ctx.metric("time_plain", lean.time);
    ctx.metric("fused_grad_max_abs_diff", fused_diff);
    ctx.metric("layered_grad_max_abs_diff", layered_diff);
    ctx.metric("lean_grad_max_abs_diff", lean_diff);
}

/// The sweep's table, its first row plain backprop's.
pub fn sweep_table(p: &CheckpointingParams, plain: &Backprop) -> Table {
    let mut table = Table::new(
        format!(
            "Checkpointing {} fused layers of Linear({w},{w}) + GELU, batch {}",
            p.stack_depth,
            p.stack_batch,
            w = p.stack_width
        ),
        &[
            ("segments", Unit::Count),
            ("peak", Unit::Bytes),
            ("vs plain", Unit::Ratio),
            ("activations at their peak", Unit::Bytes),
            ("median time", Unit::Seconds),
            ("time vs plain", Unit::Ratio),
            ("max |grad diff|", Unit::None),
        ],
    );
    table.row(vec![
        "plain".into(),
        plain.peak.into(),
        1.0.into(),
        plain.act.into(),
        plain.time.into(),
        1.0.into(),
        0.0.into(),
    ]);
    table
}

// notebook cell
/// Checkpointing on the lean path (`Sequential::direct(..).segments(k).backward`: each recomputed
/// segment's backward called layer by layer, no graph): plain backprop
/// (`plain`, from [`framework_cost`]) against every segment count of
/// `p.segments`. Returns the segment count with the lowest peak.
pub fn sweep(
    ctx: &mut Context,
    p: &CheckpointingParams,
    model: &Mlp,
    x: &Tensor,
    y: &Tensor,
    plain: &Backprop,
) -> anyhow::Result<usize> {
    let vars = model.vars();
    let layers = model.fused_layers()?;
    let head = |h: &Tensor| candle_lean_nn::cross_entropy_and_grad(h, y, 1.0);
    let mut table = sweep_table(p, plain);
    let mut points = Vec::new();
    let mut worst_diff = 0f64;
    let mut best = (u64::MAX, 0usize, 0f64);
    let mut best_act = (u64::MAX, 0usize);
    let mut act_points = Vec::new();
    for &segments in &p.segments {
        let name = format!("checkpointed, {segments} segment(s)");
        let run = measure_backprop(ctx, &name, p.repeats, |region| {
            let out = Sequential::direct(&layers)
                .segments(segments)
                .observer(&Marks::new(region))
                .backward(x, &vars, head)?;
            region.mark("after backward");
            Ok(out.grads)
        })?;
        worst_diff = worst_diff.max(grads_max_abs_diff(&plain.grads, &run.grads, &vars)?);
        if run.peak < best.0 {
            best = (run.peak, segments, run.time);
        }
        if run.act < best_act.0 {
            best_act = (run.act, segments);
        }
        points.push((segments as f64, run.peak as f64));
        act_points.push((segments as f64, run.act as f64));
        table.row(vec![
            segments.into(),
            run.peak.into(),
            (run.peak as f64 / plain.peak as f64).into(),
            run.act.into(),
            run.time.into(),
            (run.time / plain.time).into(),
            worst_diff.into(),
        ]);
    }
    ctx.table(table);
    // What is cut into segments is the fused layers, one per block.
    let sqrt_n = (layers.len() as f64).sqrt();
    segments_figure(ctx, p, plain.peak, [points, act_points], sqrt_n);
    ctx.print(format!(
        "plain backprop peak {:.1} MiB; best {} segments {:.1} MiB ({:.0}% of plain), median wall time x{:.2}",
        mib(plain.peak),
        best.1,
        mib(best.0),
        100.0 * best.0 as f64 / plain.peak as f64,
        best.2 / plain.time
    ));
    ctx.metric("peak_best", best.0 as f64);
    ctx.metric("best_segments", best.1 as f64);
    ctx.metric("activation_peak_best", best_act.0 as f64);
    ctx.metric("best_activation_segments", best_act.1 as f64);
    ctx.metric("sqrt_layers", sqrt_n);
    ctx.metric("stack_grad_max_abs_diff", worst_diff);
    ctx.metric("time_best", best.2);
    ctx.metric("time_overhead", best.2 / plain.time);
    Ok(best.1)
}

/// Peak against segments (log axis): the total and the activations at the
/// peak, plain backprop's as a line, and a marker at sqrt(n).
pub fn segments_figure(
    ctx: &mut Context,
    p: &CheckpointingParams,
    plain_peak: u64,
    [points, act_points]: [Vec<(f64, f64)>; 2],
    sqrt_n: f64,
) {
    let plain: Vec<(f64, f64)> = points
        .iter()
        .map(|(x, _)| (*x, plain_peak as f64))
        .collect();
    let series = |name: &str, points| Series {
        name: name.into(),
        points,
    };
    ctx.figure(Figure {
        id: "checkpointing-segments".into(),
        title: format!(
            "Peak memory against checkpoint segments ({} layers)",
            p.stack_depth
        ),
        x: Axis {
            label: "segments".into(),
            unit: Unit::Count,
            log: true,
        },
        y: Axis {
            label: "peak memory".into(),
            unit: Unit::Bytes,
            log: false,
        },
        series: vec![
            series("checkpointed, total peak", points),
            series("checkpointed, activations at their peak", act_points),
            series("plain backprop", plain),
        ],
        markers: vec![Marker {
            x: sqrt_n,
            label: format!("sqrt(n) = {sqrt_n:.1}"),
        }],
        guides: Vec::new(),
    });
}

// notebook cell
/// What the recomputation costs, counted in forward passes: plain backprop,
/// the backward checkpointed in `segments` and the forward alone take turns
/// `p.overhead_repeats` times, each turn starting with the next of the
/// three, so that neither load from elsewhere on the machine nor what ran
/// just before falls on one of them alone. Each turn gives the checkpointed
/// time over plain's, the time it adds over one forward's, and plain
/// backprop's backward in forwards; the medians are reported. CPU time on a
/// CPU (this process's work on all its threads, not the machine's),
/// synchronized wall time on a GPU (its kernels are not this process's CPU
/// time).
pub fn recompute_cost(
    ctx: &mut Context,
    p: &CheckpointingParams,
    model: &Mlp,
    x: &Tensor,
    y: &Tensor,
    segments: usize,
) -> anyhow::Result<()> {
    let vars = model.vars();
    let layers = model.fused_layers()?;
    let head = |h: &Tensor| candle_lean_nn::cross_entropy_and_grad(h, y, 1.0);
    let device = ctx.device().clone();
    let clock = if device.is_cpu() { "CPU" } else { "wall" };
    let plain = || -> Result<()> {
        Sequential::direct(&layers).backward(x, &vars, head)?;
        Ok(())
    };
    let checkpointed = || -> Result<()> {
        Sequential::direct(&layers)
            .segments(segments)
            .backward(x, &vars, head)?;
        Ok(())
    };
    // The forward the recomputation repeats: each layer's, keeping what its
    // backward would need, dropped at once.
    let forward = || -> Result<()> {
        layers
            .iter()
            .try_fold(x.clone(), |h, l| l.forward_saved(&h).map(|(out, _)| out))?;
        Ok(())
    };
    let runs: [&dyn Fn() -> Result<()>; 3] = [&plain, &checkpointed, &forward];
    let (mut ratios, mut extra, mut backward) = (Vec::new(), Vec::new(), Vec::new());
    for turn in 0..p.overhead_repeats {
        ctx.progress(&format!("recomputation's cost, turn {}", turn + 1));
        let mut t = [0f64; 3];
        for k in 0..3 {
            let i = (turn + k) % 3;
            let (out, took) = timed(|| -> Result<()> {
                runs[i]()?;
                device.synchronize()
            });
            out?;
            t[i] = if device.is_cpu() { took.cpu } else { took.wall };
        }
        let [plain, checkpointed, forward] = t;
        ratios.push(checkpointed / plain);
        extra.push((checkpointed - plain) / forward);
        backward.push(plain / forward - 1.0);
    }
    let (ratio, extra, backward) = (median(ratios), median(extra), median(backward));
    ctx.print(format!(
        "{segments} segments take x{ratio:.2} plain backprop's {clock} time: {extra:.2} forward \
         passes more, where plain backprop's backward takes {backward:.2} (medians of {} turns)",
        p.overhead_repeats
    ));
    ctx.metric("recompute_time_ratio", ratio);
    ctx.metric("extra_forwards", extra);
    ctx.metric("backward_forwards", backward);
    Ok(())
}

// notebook cell
/// The tip's heavy function: how many tensors each way keeps alive.
pub fn heavy(ctx: &mut Context, p: &CheckpointingParams) -> anyhow::Result<()> {
    let device = ctx.device().clone();
    let a = Category::Parameters.scope(|| Var::new(1f32, &device))?;
    let layers: Vec<Heavy> = (0..p.heavy_calls)
        .map(|_| Heavy::new(a.clone(), p.heavy_adds))
        .collect();
    let x0 = Var::new(0f32, &device)?;
    let head = |h: &Tensor| Ok(h.clone());

    // How many blocks one tensor made by an op occupies, measured.
    let per_tensor = {
        let n = 1000;
        let mut region = ctx.region("calibration");
        let chain = Heavy::new(a.clone(), n).forward(x0.as_tensor())?;
        region.mark("chain");
        // Calibration is not shown; only its block count is used.
        let blocks = region.blocks_above_baseline();
        drop(chain);
        blocks as f64 / n as f64
    };

    ctx.progress("heavy function, plain");
    let mut region = ctx.region("heavy function, plain");
    let y = Category::Activations.scope(|| run_segment(&layers, x0.as_tensor()))?;
    region.mark("after forward");
    let plain_store = Category::Gradients.scope(|| y.backward())?;
    let plain_grad = plain_store.get(a.as_tensor()).map(|g| g.detach());
    drop((y, plain_store));
    let plain_blocks = ctx.end_region(region).blocks_above_baseline();

    ctx.progress("heavy function, checkpointed");
    let mut region = ctx.region("heavy function, checkpointed");
    let out = Sequential::new(&layers)
        .segments(p.heavy_calls)
        .observer(&Tags)
        .backward(x0.as_tensor(), std::slice::from_ref(&a), head)?;
    region.mark("after backward");
    let ckpt_grad = out.grads.get(a.as_tensor()).map(|g| g.detach());
    drop(out);
    let ckpt_blocks = ctx.end_region(region).blocks_above_baseline();

    let plain_tensors = (plain_blocks as f64 / per_tensor).round();
    let ckpt_tensors = (ckpt_blocks as f64 / per_tensor).round();
    let ops = (p.heavy_calls * p.heavy_adds) as f64;
    ctx.print(format!(
        "heavy function, {} calls of {} additions: about {plain_tensors} live tensors at the peak plain, {ckpt_tensors} checkpointed",
        p.heavy_calls, p.heavy_adds
    ));
    ctx.metric("heavy_ops", ops);
    ctx.metric("heavy_blocks_per_tensor", per_tensor);
    ctx.metric("heavy_live_tensors_plain", plain_tensors);
    ctx.metric("heavy_live_tensors_checkpointed", ckpt_tensors);
    ctx.metric(
        "heavy_expected_checkpointed",
        (p.heavy_calls + p.heavy_adds) as f64,
    );
    let grad_diff = match (plain_grad, ckpt_grad) {
        (Some(a), Some(b)) => max_abs_diff(&a, &b)?,
        _ => f64::INFINITY,
    };
    ctx.metric("heavy_grad_abs_diff", grad_diff);
    Ok(())
}

include!("experiment/policies.rs");

// notebook cell
/// The experiment: a small block checkpointed and checked against plain
/// backprop, then the sections above.
pub fn checkpointing_experiment(ctx: &mut Context, p: CheckpointingParams) -> anyhow::Result<()> {
    let device = ctx.device().clone();
    let mut rng = Rng::seeded(p.seed);
    anyhow::ensure!(p.repeats > 0, "repeats must be at least 1");
    anyhow::ensure!(
        p.overhead_repeats > 0,
        "overhead_repeats must be at least 1"
    );

    // The notebook's cell: a checkpointed block, a head, an input that needs a gradient.
    let block = Mlp::new(
        &mut rng,
        &[p.width, p.width, p.width],
        Activation::Relu,
        DType::F32,
        &device,
    )?;
    let block_layers: Vec<_> = block
        .layers()
        .iter()
        .cloned()
        .chain(std::iter::once(workbook_models::Layer::Activation(
            Activation::Relu,
        )))
        .collect();
    let head = Mlp::new(
        &mut rng,
        &[p.width, p.classes],
        Activation::Relu,
        DType::F32,
        &device,
    )?;
    let input = Var::from_tensor(&rng.randn((p.batch, p.width), &device)?)?;
    let target = rng.labels(p.batch, p.classes as u32, &device)?;
    let loss_of = |h: &Tensor| cross_entropy(&head.forward(h)?, &target);
    let mut vars = block.vars();
    vars.extend(head.vars());

    let plain = loss_of(&run_segment(&block_layers, input.as_tensor())?)?;
    let plain_store = plain.backward()?;
    let plain_input_grad = plain_store.get(input.as_tensor()).map(|g| g.detach());
    let ckpt = Sequential::new(&block_layers)
        .segments(1)
        .observer(&Tags)
        .backward(input.as_tensor(), &vars, loss_of)?;
    let loss = ckpt.loss.to_scalar::<f32>()?;
    ctx.print(format!("{loss:.4}"));
    ctx.metric("loss", loss as f64);
    ctx.metric(
        "input_grad_present",
        f64::from(u8::from(plain_input_grad.is_some())),
    );
    let input_diff = match (&plain_input_grad, &ckpt.input_grad) {
        (Some(a), Some(b)) => max_abs_diff(a, b)?,
        _ => f64::INFINITY,
    };
    ctx.metric("input_grad_max_abs_diff", input_diff);
    ctx.metric(
        "block_grad_max_abs_diff",
        grads_max_abs_diff(&param_grads(&plain_store, &vars), &ckpt.grads, &vars)?,
    );
    drop((plain, plain_store));

    // The deep stack: its data a batch of inputs and class labels.
    let model = Mlp::stack(
        &mut rng,
        p.stack_width,
        p.stack_depth,
        Activation::Gelu,
        DType::F32,
        &device,
    )?;
    let (x, y) = Category::Inputs.scope(|| -> anyhow::Result<_> {
        Ok((
            rng.randn((p.stack_batch, p.stack_width), &device)?,
            rng.labels(p.stack_batch, p.stack_width as u32, &device)?,
        ))
    })?;
    let plain = framework_cost(ctx, &p, &model, &x, &y)?;
    let best = sweep(ctx, &p, &model, &x, &y, &plain)?;
    drop(plain);
    recompute_cost(ctx, &p, &model, &x, &y, best)?;
    drop((model, x, y));
    heavy(ctx, &p)?;
    policies(ctx, &p)?;
    Ok(())
}
