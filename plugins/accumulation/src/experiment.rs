//! The accumulation cell's experiment: what `workbook run` executes and
//! what the chapter's notebook shows in its code cells (see
//! `workbook_sdk::notebook`). Crates are named by their names, this one's
//! included, so that the same text compiles in a notebook cell.

use candle_accumulate::{micro_batches, GradAccumulator};
use candle_checkpoint::Sequential;
use candle_lean_optim::LeanAdamW;
use workbook_accumulation::Params as AccumulationParams;
use workbook_models::{cross_entropy, grads_max_abs_diff, param_grads, Activation, Mlp, Rng};
use workbook_sdk::anyhow;
use workbook_sdk::candle::backprop::GradStore;
use workbook_sdk::candle::{DType, Module, Result, Tensor, Var};
use workbook_sdk::candle_nn::{AdamW, Optimizer, ParamsAdamW};
use workbook_sdk::observe::{Marks, Tags};
use workbook_sdk::output::{mib, Axis, RegionReport, Series, Unit};
use workbook_sdk::{Category, Context, Figure, Table};

// notebook cell
/// The forward and backward passes of one training step of `model` on
/// `(x, y)` in `steps` micro-batches, gradients summed, on the toolkit's
/// lean path: its fused layers and cross-entropy, whose backwards
/// `Sequential::direct(..).backward_with` calls one after the other without candle's graph,
/// freeing each layer's activations once the backward has passed it and
/// adding each layer's gradients to the sum as they are made. Returns the
/// summed gradients; the optimizer step is the caller's.
pub fn accumulate(
    model: &Mlp,
    x: &Tensor,
    y: &Tensor,
    steps: usize,
    region: &mut workbook_sdk::Region,
) -> anyhow::Result<GradAccumulator> {
    let rows = x.dim(0)?;
    let size = rows.div_ceil(steps);
    let layers = model.fused_layers()?;
    let vars = model.vars();
    let mut acc = GradAccumulator::new(vars.clone(), rows).observed(Tags);
    for (xb, yb) in micro_batches(x, size)?
        .iter()
        .zip(micro_batches(y, size)?.iter())
    {
        // The micro-batch's mean loss with its weight rows / N, as
        // `add_weighted` expects.
        let weight = xb.dim(0)? as f64 / rows as f64;
        let head = |h: &Tensor| candle_lean_nn::cross_entropy_and_grad(h, yb, weight);
        // Each layer's gradients go into the sum as the backward makes them.
        acc.add_weighted_with(xb.dim(0)?, |add| {
            Sequential::direct(&layers)
                .observer(&Marks::new(region))
                .backward_with(xb, &vars, head, add)
        })?;
        region.mark("after backward");
    }
    Ok(acc)
}

/// A batch of `rows` inputs of `width` features and class labels, as the
/// cell's inputs.
pub fn batch_of(
    rng: &mut Rng,
    rows: usize,
    width: usize,
    device: &workbook_sdk::candle::Device,
) -> Result<(Tensor, Tensor)> {
    Category::Inputs.scope(|| {
        Ok((
            rng.randn((rows, width), device)?,
            rng.labels(rows, width as u32, device)?,
        ))
    })
}

/// [`accumulate`] on candle-nn's layers and candle's own backward: what
/// the framework costs. Allocations are tagged by role.
pub fn accumulate_candle(
    model: &Mlp,
    x: &Tensor,
    y: &Tensor,
    steps: usize,
    region: &mut workbook_sdk::Region,
) -> anyhow::Result<GradAccumulator> {
    let rows = x.dim(0)?;
    let size = rows.div_ceil(steps);
    let mut acc = GradAccumulator::new(model.vars(), rows).observed(Tags);
    for (xb, yb) in micro_batches(x, size)?
        .iter()
        .zip(micro_batches(y, size)?.iter())
    {
        let loss = Category::Activations.scope(|| cross_entropy(&model.forward(xb)?, yb))?;
        region.mark("after forward");
        acc.backward(&loss, xb.dim(0)?)?;
        drop(loss);
        region.mark("after backward");
    }
    Ok(acc)
}

/// One whole training step (forward, backward, optimizer step) as a region.
pub fn training_step<O: Optimizer>(
    ctx: &mut Context,
    name: &str,
    (model, fused): (&Mlp, bool),
    x: &Tensor,
    y: &Tensor,
    optimizer: &mut O,
) -> anyhow::Result<workbook_sdk::RegionReport> {
    let mut region = ctx.region(name);
    let loss = Category::Activations.scope(|| {
        let h = if fused {
            model.forward_fused(x)?
        } else {
            model.forward(x)?
        };
        cross_entropy(&h, y)
    })?;
    region.mark("after forward");
    let grads = Category::Gradients.scope(|| -> anyhow::Result<GradStore> {
        Ok(param_grads(&loss.backward()?, &model.vars()))
    })?;
    drop(loss);
    region.mark("after backward");
    Category::OptimizerState.scope(|| optimizer.step(&grads))?;
    drop(grads);
    region.mark("after step");
    Ok(ctx.end_region(region))
}

/// The gradients of `from` filed under the matching variables of `to`.
pub fn rebind(grads: &GradStore, from: &[Var], to: &[Var]) -> GradStore {
    let mut out = GradStore::default();
    for (a, b) in from.iter().zip(to) {
        if let Some(g) = grads.get(a.as_tensor()) {
            out.insert(b.as_tensor(), g.clone());
        }
    }
    out
}

// notebook cell
/// What the framework costs: the large batch's steps on candle-nn's layers
/// and candle's own backward, beside the lean path's peaks (`lean_peaks`,
/// whole and in `p.compare_steps` micro-batches); and the gradients of the
/// two paths against each other, micro-batch for micro-batch.
pub fn candle_nn_path(
    ctx: &mut Context,
    p: &AccumulationParams,
    sweep: &Mlp,
    rng: &mut Rng,
    lean_peaks: [u64; 2],
) -> anyhow::Result<()> {
    let device = ctx.device().clone();
    let (x, y) = batch_of(rng, p.large_batch, p.sweep_width, &device)?;
    let mut table = Table::new(
        format!(
            "What the framework costs: the same steps on candle-nn's layers and candle's backward, batch {}",
            p.large_batch
        ),
        &[
            ("micro-batches", Unit::Count),
            ("peak, candle-nn", Unit::Bytes),
            ("peak, lean path", Unit::Bytes),
            ("lean / candle-nn", Unit::Ratio),
        ],
    );
    let mut peaks = Vec::new();
    let mut worst = 0f64;
    for (steps, lean_peak) in [(1, lean_peaks[0]), (p.compare_steps, lean_peaks[1])] {
        ctx.progress(&format!("candle-nn path, {steps} micro-batch(es)"));
        let mut region = ctx.region(format!("candle-nn path, {steps} micro-batch(es)"));
        let reference = accumulate_candle(sweep, &x, &y, steps, &mut region)?;
        let peak = ctx.end_region(region).peak_above_baseline();
        // The lean path on the same batch and micro-batches.
        let mut lean = ctx.region("lean path, for its gradients");
        let acc = accumulate(sweep, &x, &y, steps, &mut lean)?;
        drop(lean);
        let diff = grads_max_abs_diff(reference.grads()?, acc.grads()?, &sweep.vars())?;
        drop((reference, acc));
        worst = worst.max(diff);
        table.row(vec![
            (steps as u64).into(),
            peak.into(),
            lean_peak.into(),
            (lean_peak as f64 / peak as f64).into(),
        ]);
        peaks.push(peak);
    }
    ctx.table(table);
    ctx.metric("lean_path_grad_max_abs_diff", worst);
    ctx.metric("peak_full_large_candle", peaks[0] as f64);
    ctx.metric("peak_accum_large_candle", peaks[1] as f64);
    Ok(())
}

/// A whole training step of the sweep's model with candle's AdamW, with
/// the in-place LeanAdamW, and with LeanAdamW on the fused layers: peaks
/// against the analytic minimum, parameters + gradients + two moments +
/// the forward's activations.
pub fn lean_step(
    ctx: &mut Context,
    p: &AccumulationParams,
    sweep: &Mlp,
    rng: &mut Rng,
) -> anyhow::Result<()> {
    let device = ctx.device().clone();
    let (x, y) = batch_of(rng, p.small_batch, p.sweep_width, &device)?;
    let params = ParamsAdamW {
        lr: p.lr,
        ..Default::default()
    };
    let (a, b, f) = Category::Parameters.scope(|| -> anyhow::Result<_> {
        Ok((
            sweep.deep_clone()?,
            sweep.deep_clone()?,
            sweep.deep_clone()?,
        ))
    })?;
    let (mut candle, mut lean, mut fused) =
        Category::OptimizerState.scope(|| -> anyhow::Result<_> {
            Ok((
                AdamW::new(a.vars(), params.clone())?,
                LeanAdamW::with_observer(b.vars(), params.clone(), Tags)?,
                LeanAdamW::with_observer(f.vars(), params, Tags)?,
            ))
        })?;
    let param_bytes: u64 = a.vars().iter().map(|v| v.elem_count() as u64 * 4).sum();
    let mut rows = Vec::new();
    for step in 0..2 {
        let c = training_step(
            ctx,
            "training step, candle_nn::AdamW",
            (&a, false),
            &x,
            &y,
            &mut candle,
        )?;
        let l = training_step(
            ctx,
            "training step, LeanAdamW",
            (&b, false),
            &x,
            &y,
            &mut lean,
        )?;
        let u = training_step(
            ctx,
            "training step, LeanAdamW, fused layers",
            (&f, true),
            &x,
            &y,
            &mut fused,
        )?;
        // The first step of each is a warm-up: the second is reported.
        if step == 1 {
            rows = vec![
                ("candle_nn::AdamW", "candle", c),
                ("LeanAdamW", "lean", l),
                ("LeanAdamW, fused layers", "fused", u),
            ];
        }
    }
    let mut diff = 0f64;
    let mut fused_diff = 0f64;
    for ((u, v), w) in a.vars().iter().zip(b.vars().iter()).zip(f.vars().iter()) {
        diff = diff.max(workbook_models::max_abs_diff(u.as_tensor(), v.as_tensor())?);
        fused_diff = fused_diff.max(workbook_models::max_abs_diff(v.as_tensor(), w.as_tensor())?);
    }
    ctx.metric("fused_step_max_abs_diff", fused_diff);
    step_table(ctx, p, &rows, param_bytes);
    ctx.metric("lean_adamw_max_abs_diff", diff);
    Ok(())
}

/// Each optimizer's measured step (`rows`: name, metric key, region) as a
/// table beside the analytic minimum: parameters, gradients and both
/// moments (4P) plus the activations at their peak.
pub fn step_table(
    ctx: &mut Context,
    p: &AccumulationParams,
    rows: &[(&str, &str, RegionReport)],
    param_bytes: u64,
) {
    let mut table = Table::new(
        format!(
            "One training step, batch {} on {} Linear({w},{w}) + ReLU",
            p.small_batch,
            p.sweep_depth,
            w = p.sweep_width
        ),
        &[
            ("optimizer", Unit::None),
            ("peak, state included", Unit::Bytes),
            ("analytic minimum", Unit::Bytes),
            ("peak / analytic", Unit::Ratio),
        ],
    );
    for (name, key, r) in rows {
        let acts = r.category_peak_above_baseline(Category::Activations);
        // Parameters and both moments are live before the step: 3P.
        let whole = 3 * param_bytes + r.peak_above_baseline();
        let analytic = 4 * param_bytes + acts;
        let ratio = whole as f64 / analytic as f64;
        table.row(vec![
            (*name).into(),
            whole.into(),
            analytic.into(),
            ratio.into(),
        ]);
        ctx.metric(format!("step_peak_{key}"), whole as f64);
        ctx.metric(format!("step_ratio_{key}"), ratio);
        ctx.metric(
            format!("step_optimizer_peak_{key}"),
            r.category_peak_above_baseline(Category::OptimizerState) as f64,
        );
        ctx.metric(format!("step_analytic_{key}"), analytic as f64);
    }
    ctx.table(table);
}

// notebook cell
/// One step over `p.batch` rows in micro-batches of `p.micro_batch`: its
/// summed gradients against the full batch's, and AdamW's step from each
/// set against the other.
pub fn one_step(ctx: &mut Context, p: &AccumulationParams, rng: &mut Rng) -> anyhow::Result<()> {
    let device = ctx.device().clone();
    let model = Mlp::new(rng, &p.widths, Activation::Relu, DType::F32, &device)?;
    let classes = *p.widths.last().unwrap_or(&2) as u32;
    let x = rng.randn((p.batch, p.widths[0]), &device)?;
    let y = rng.labels(p.batch, classes, &device)?;
    anyhow::ensure!(p.micro_batch > 0, "micro_batch must be at least 1");
    let mut acc = GradAccumulator::new(model.vars(), p.batch);
    let mut loss = f32::NAN;
    let mut sizes = Vec::new();
    for (xb, yb) in micro_batches(&x, p.micro_batch)?
        .iter()
        .zip(micro_batches(&y, p.micro_batch)?.iter())
    {
        let l = cross_entropy(&model.forward(xb)?, yb)?;
        let rows = xb.dim(0)?;
        acc.backward(&l, rows)?;
        loss = l.to_scalar::<f32>()?;
        sizes.push(rows.to_string());
    }
    let full = param_grads(
        &cross_entropy(&model.forward(&x)?, &y)?.backward()?,
        &model.vars(),
    );
    let diff = grads_max_abs_diff(&full, acc.grads()?, &model.vars())?;

    // The same step through candle's AdamW, from the two gradient sets.
    let twin = model.deep_clone()?;
    let mut opt_acc = AdamW::new_lr(model.vars(), p.lr)?;
    let mut opt_full = AdamW::new_lr(twin.vars(), p.lr)?;
    let micro = acc.micro_batches();
    opt_acc.step(&acc.take()?)?;
    opt_full.step(&rebind(&full, &model.vars(), &twin.vars()))?;
    let mut param_diff = 0f64;
    for (a, b) in model.vars().iter().zip(twin.vars().iter()) {
        param_diff = param_diff.max(workbook_models::max_abs_diff(a.as_tensor(), b.as_tensor())?);
    }
    ctx.print(format!(
        "micro-batches: {micro} of {} rows",
        sizes.join(", ")
    ));
    ctx.print(format!("last micro-batch's mean loss: {loss:.4}"));
    ctx.metric("micro_batches", micro as f64);
    ctx.metric("loss", loss as f64);
    ctx.metric("grad_max_abs_diff", diff);
    ctx.metric("param_max_abs_diff_after_step", param_diff);
    ctx.metric("lr", p.lr);
    Ok(())
}

include!("experiment/large_batch.rs");

// notebook cell
/// The experiment: accumulated gradients against the full batch's, the
/// peaks of the full batch and of its micro-batches at two batch sizes, and
/// the lean path and whole training steps beside candle-nn's.
pub fn accumulation_experiment(ctx: &mut Context, p: AccumulationParams) -> anyhow::Result<()> {
    let device = ctx.device().clone();
    let mut rng = Rng::seeded(p.seed);
    one_step(ctx, &p, &mut rng)?;
    let model = Mlp::stack(
        &mut rng,
        p.sweep_width,
        p.sweep_depth,
        Activation::Relu,
        DType::F32,
        &device,
    )?;
    let optimizer = Category::OptimizerState.scope(|| AdamW::new_lr(model.vars(), p.lr))?;
    let mut s = Sweeper {
        model,
        optimizer,
        step_peak: None,
    };
    // A first, unrecorded step, so that every measured step is alike.
    s.measure(ctx, &p, &mut rng, (p.small_batch, 1), false)?;
    let full_small = s.measure(ctx, &p, &mut rng, (p.small_batch, 1), true)?;
    let accum_small = s.measure(ctx, &p, &mut rng, (p.small_batch, p.compare_steps), true)?;
    let LargeBatch {
        points,
        full: full_large,
        accum: accum_large,
    } = large_batch_sweep(ctx, &p, &mut rng, &mut s)?;
    candle_nn_path(ctx, &p, &s.model, &mut rng, [full_large, accum_large])?;
    lean_step(ctx, &p, &s.model, &mut rng)?;
    let peaks = Peaks {
        full_small,
        accum_small,
        full_large,
        accum_large,
    };
    accumulation_report(ctx, &p, &s, &peaks, points);
    Ok(())
}
