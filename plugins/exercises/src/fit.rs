//! The fit exercise: what `workbook run` executes (with the reference
//! solution) and what the chapter's notebook shows (with a `todo!()` in its
//! place, for the learner to write), a cell per `// notebook cell` line
//! (see `workbook_sdk::notebook`). Crates are named by their names, this
//! one's included, so that the same text compiles in a notebook cell.

use candle_accumulate::{micro_batches, GradAccumulator};
use candle_checkpoint::{checkpoint_sequential, segment_bounds};
use workbook_exercises::FitParams as FitExerciseParams;
use workbook_models::{grads_max_abs_diff, param_grads, Activation, FusedLayer, Mlp, Rng};
use workbook_sdk::anyhow;
use workbook_sdk::candle::backprop::GradStore;
use workbook_sdk::candle::{DType, Tensor, Var};
use workbook_sdk::observe::Tags;
use workbook_sdk::output::Unit;
use workbook_sdk::{Category, Context, Table};

// notebook cell
/// How one training step runs: its batch in `micro_batches` equal parts,
/// gradients summed (section 2.2), each part's forward and backward
/// checkpointed in `segments` equal segments of layers (section 2.3; one
/// segment is plain backprop).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepPlan {
    /// Parts of the batch, one after another.
    pub micro_batches: usize,
    /// Segments of the layers; each but the last runs its forward twice.
    pub segments: usize,
}

/// The step the plan is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepShape {
    /// Layers of the model (Linear + ReLU each).
    pub depth: usize,
    /// Rows of the batch.
    pub batch: usize,
    /// The fewest rows a micro-batch may have: smaller matrix products
    /// leave the cores idle, so the chapter does not go below it.
    pub min_micro_batch: usize,
}

impl StepShape {
    /// Every plan the step allows: micro-batches that split the batch into
    /// equal parts of at least `min_micro_batch` rows, segments that split
    /// the layers into equal parts; fewest micro-batches first, then fewest
    /// segments.
    pub fn plans(&self) -> Vec<StepPlan> {
        let divisors = |n: usize| (1..=n).filter(move |d| n.is_multiple_of(*d));
        divisors(self.batch)
            .filter(|m| self.batch / m >= self.min_micro_batch)
            .flat_map(|m| {
                divisors(self.depth).map(move |s| StepPlan {
                    micro_batches: m,
                    segments: s,
                })
            })
            .collect()
    }
}

/// The layers whose forward a plan runs a second time: all but those of
/// the last segment, which runs once, in the backward.
pub fn recomputed_layers(shape: &StepShape, plan: StepPlan) -> anyhow::Result<usize> {
    let bounds = segment_bounds(shape.depth, plan.segments)?;
    Ok(shape.depth - bounds.last().map_or(0, |last| last.len()))
}

/// One training step of `layers` on `(x, y)` under `plan`: the forward and
/// backward of each micro-batch, checkpointed, its gradients (weighted by
/// its share of the rows) added to the sum. Allocations are tagged by role.
pub fn step_with_plan(
    layers: &[FusedLayer],
    vars: &[Var],
    (x, y): (&Tensor, &Tensor),
    plan: StepPlan,
) -> anyhow::Result<GradStore> {
    let rows = x.dim(0)?;
    anyhow::ensure!(
        plan.micro_batches > 0 && rows.is_multiple_of(plan.micro_batches),
        "{} micro-batches do not split {rows} rows into equal parts",
        plan.micro_batches
    );
    let size = rows / plan.micro_batches;
    let weight = size as f64 / rows as f64;
    let mut sum = GradAccumulator::new(vars.to_vec(), rows).with_observer(Tags);
    for (xb, yb) in micro_batches(x, size)?.iter().zip(&micro_batches(y, size)?) {
        let head = |h: &Tensor| candle_lean_nn::cross_entropy(h, yb)? * weight;
        let grads = checkpoint_sequential(layers, plan.segments, xb, vars, head, &Tags)?.grads;
        sum.add_weighted(&grads, size)?;
    }
    Ok(sum.take()?)
}

// notebook cell: exercise
/// Exercise: fit the step into `budget` bytes, at the least cost.
///
/// Accumulation and checkpointing both lower a step's peak. Micro-batches
/// cost next to nothing (the same multiply-adds, in smaller products, down
/// to `min_micro_batch` rows); segments cost time: every layer outside the
/// last segment runs its forward twice (`recomputed_layers`). So of the
/// plans whose peak fits the budget, return the cheapest: the fewest
/// recomputed layers, and of those, the fewest micro-batches.
///
/// `shape.plans()` lists the plans the step allows. `measure(plan)` runs
/// one step under `plan` and returns the peak the meter counted, in bytes
/// above the step's start: each call is a real training step, so measure
/// what you need, not more.
///
/// Hints: more micro-batches lower the peak; more segments lower it only
/// up to a point (each segment's input is kept), so do not skip a plan for
/// its segments' sake. A `for` loop lets `measure(plan)?` hand a failed
/// measurement on, which a closure inside `find` cannot.
pub fn choose_plan(
    shape: &StepShape,
    budget: u64,
    measure: &mut dyn FnMut(StepPlan) -> anyhow::Result<u64>,
) -> anyhow::Result<StepPlan> {
    // solution begin
    let mut plans = Vec::new();
    for plan in shape.plans() {
        plans.push((recomputed_layers(shape, plan)?, plan));
    }
    plans.sort_by_key(|(recomputed, plan)| (*recomputed, plan.micro_batches));
    for (_, plan) in plans {
        if measure(plan)? <= budget {
            return Ok(plan);
        }
    }
    anyhow::bail!("no plan fits {budget} bytes")
    // solution end
}

// notebook cell
/// The plan of `choose` graded: its peak measured against the budget, its
/// cost against the cheapest plan that fits, found by measuring every plan;
/// its gradients against plain backprop of the whole batch. The budget is
/// `budget_fraction` of the plain step's peak (one micro-batch, one
/// segment).
pub fn grade_plan(
    ctx: &mut Context,
    p: &FitExerciseParams,
    choose: impl Fn(
        &StepShape,
        u64,
        &mut dyn FnMut(StepPlan) -> anyhow::Result<u64>,
    ) -> anyhow::Result<StepPlan>,
) -> anyhow::Result<()> {
    let device = ctx.device().clone();
    let mut rng = Rng::seeded(p.seed);
    let model = Category::Parameters.scope(|| {
        Mlp::stack(
            &mut rng,
            p.width,
            p.depth,
            Activation::Relu,
            DType::F32,
            &device,
        )
    })?;
    let (layers, vars) = (model.fused_layers()?, model.vars());
    let (x, y) = Category::Inputs.scope(|| -> anyhow::Result<_> {
        Ok((
            rng.randn((p.batch, p.width), &device)?,
            rng.labels(p.batch, p.width as u32, &device)?,
        ))
    })?;
    let shape = StepShape {
        depth: p.depth,
        batch: p.batch,
        min_micro_batch: p.min_micro_batch,
    };
    let plans = shape.plans();
    // A step under `plan`, measured; its gradients dropped in the region.
    let measured = |ctx: &mut Context, plan: StepPlan| -> anyhow::Result<u64> {
        let region = ctx.region(format!(
            "{} micro-batch(es), {} segment(s)",
            plan.micro_batches, plan.segments
        ));
        drop(step_with_plan(&layers, &vars, (&x, &y), plan)?);
        Ok(ctx.end_region(region).peak_above_baseline())
    };
    let plain = StepPlan {
        micro_batches: 1,
        segments: 1,
    };
    let budget = (p.budget_fraction * measured(ctx, plain)? as f64) as u64;
    ctx.metric("budget_bytes", budget as f64);

    // Your plan, and the steps it measured on the way.
    let list = |values: std::collections::BTreeSet<usize>| {
        values
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let not_a_plan = format!(
        "is not a plan of this step: micro_batches must be one of {} (equal parts of {} rows, \
         each at least {}), segments one of {} (equal parts of {} layers)",
        list(plans.iter().map(|q| q.micro_batches).collect()),
        p.batch,
        p.min_micro_batch,
        list(plans.iter().map(|q| q.segments).collect()),
        p.depth
    );
    let allowed = |plan: StepPlan| -> anyhow::Result<()> {
        anyhow::ensure!(plans.contains(&plan), "{plan:?} {not_a_plan}");
        Ok(())
    };
    let mut measurements = 0usize;
    let chosen = choose(&shape, budget, &mut |plan| {
        allowed(plan)?;
        measurements += 1;
        measured(ctx, plan)
    })?;
    allowed(chosen)?;
    ctx.print(format!(
        "your plan: {} micro-batch(es), {} segment(s), after {measurements} measured step(s)",
        chosen.micro_batches, chosen.segments
    ));
    ctx.metric("measurements", measurements as f64);

    // Every plan, measured, and the cheapest that fits.
    let mut table = Table::new(
        format!(
            "Peak of one step, {} layers of width {}, batch {}, budget {budget} bytes",
            p.depth, p.width, p.batch
        ),
        &[
            ("micro-batches", Unit::None),
            ("segments", Unit::None),
            ("recomputed layers", Unit::None),
            ("peak", Unit::Bytes),
            ("fits", Unit::None),
        ],
    );
    let mut cheapest: Option<(usize, usize)> = None;
    let mut chosen_peak = None;
    let mut lowest: Option<(u64, StepPlan)> = None;
    for &plan in &plans {
        let peak = measured(ctx, plan)?;
        if lowest.is_none_or(|(l, _)| peak < l) {
            lowest = Some((peak, plan));
        }
        let recomputed = recomputed_layers(&shape, plan)?;
        let fits = peak <= budget;
        if fits {
            let cost = (recomputed, plan.micro_batches);
            cheapest = Some(cheapest.map_or(cost, |c| c.min(cost)));
        }
        if plan == chosen {
            chosen_peak = Some(peak);
        }
        table.row(vec![
            (plan.micro_batches as f64).into(),
            (plan.segments as f64).into(),
            (recomputed as f64).into(),
            peak.into(),
            if plan == chosen {
                "yes, your plan"
            } else if fits {
                "yes"
            } else {
                ""
            }
            .into(),
        ]);
    }
    ctx.table(table);
    let (fewest_recomputed, fewest_micro) = cheapest.ok_or_else(|| {
        let (peak, plan) = lowest.unwrap_or((0, plain));
        anyhow::anyhow!(
            "no plan fits {budget} bytes: the lowest peak is {peak} bytes, with {} \
             micro-batch(es) and {} segment(s); raise budget_fraction or lower min_micro_batch",
            plan.micro_batches,
            plan.segments
        )
    })?;
    let chosen_peak =
        chosen_peak.ok_or_else(|| anyhow::anyhow!("{chosen:?} was not among the plans"))?;
    ctx.metric("chosen_peak", chosen_peak as f64);
    ctx.metric(
        "chosen_recomputed_layers",
        recomputed_layers(&shape, chosen)? as f64,
    );
    ctx.metric("chosen_micro_batches", chosen.micro_batches as f64);
    ctx.metric("cheapest_recomputed_layers", fewest_recomputed as f64);
    ctx.metric("cheapest_micro_batches", fewest_micro as f64);

    // The plan changes when work happens, not what is computed.
    let grads = step_with_plan(&layers, &vars, (&x, &y), chosen)?;
    let plain = Category::Gradients.scope(|| -> anyhow::Result<GradStore> {
        let logits = Category::Activations.scope(|| model.forward_fused(&x))?;
        let loss = candle_lean_nn::cross_entropy(&logits, &y)?;
        Ok(param_grads(&loss.backward()?, &vars))
    })?;
    ctx.metric(
        "grad_max_abs_diff",
        grads_max_abs_diff(&plain, &grads, &vars)?,
    );
    Ok(())
}

/// The exercise: your `choose_plan`, graded and measured.
pub fn fit_exercise(ctx: &mut Context, p: FitExerciseParams) -> anyhow::Result<()> {
    grade_plan(ctx, &p, choose_plan)
}
