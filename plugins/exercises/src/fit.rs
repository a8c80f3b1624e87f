//! The fit exercise: what `workbook run` executes (with the reference
//! solution) and what the chapter's notebook shows (with a `todo!()` in its
//! place, for the learner to write), a cell per `// notebook cell` line
//! (see `workbook_sdk::notebook`). Crates are named by their names, this
//! one's included, so that the same text compiles in a notebook cell.

use candle_accumulate::{micro_batches, GradAccumulator};
use candle_checkpoint::{segment_bounds, Sequential};
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
    let mut sum = GradAccumulator::new(vars.to_vec(), rows).observed(Tags);
    for (xb, yb) in micro_batches(x, size)?.iter().zip(&micro_batches(y, size)?) {
        let head = |h: &Tensor| candle_lean_nn::cross_entropy(h, yb)? * weight;
        let grads = Sequential::new(layers)
            .segments(plan.segments)
            .observer(&Tags)
            .backward(xb, vars, head)?
            .grads;
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
/// The grader's bench: the model, one batch and the step's shape.
pub struct FitBench {
    /// The stack of Linear + ReLU layers.
    pub model: Mlp,
    /// Its layers, fused.
    pub layers: Vec<FusedLayer>,
    /// Its parameters.
    pub vars: Vec<Var>,
    /// The batch's inputs.
    pub x: Tensor,
    /// The batch's labels.
    pub y: Tensor,
    /// The step the plans are for.
    pub shape: StepShape,
}

impl FitBench {
    /// The exercise's model and batch, tagged by role.
    pub fn new(ctx: &Context, p: &FitExerciseParams) -> anyhow::Result<Self> {
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
        Ok(Self {
            model,
            layers,
            vars,
            x,
            y,
            shape,
        })
    }

    /// A step under `plan`, measured: its peak; its gradients dropped in
    /// the region.
    pub fn measured(&self, ctx: &mut Context, plan: StepPlan) -> anyhow::Result<u64> {
        let region = ctx.region(format!(
            "{} micro-batch(es), {} segment(s)",
            plan.micro_batches, plan.segments
        ));
        drop(step_with_plan(
            &self.layers,
            &self.vars,
            (&self.x, &self.y),
            plan,
        )?);
        Ok(ctx.end_region(region).peak_above_baseline())
    }
}

/// Why a plan outside `plans` is refused: the values each field allows.
pub fn not_a_plan(p: &FitExerciseParams, plans: &[StepPlan]) -> String {
    let list = |values: std::collections::BTreeSet<usize>| {
        values
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "is not a plan of this step: micro_batches must be one of {} (equal parts of {} rows, \
         each at least {}), segments one of {} (equal parts of {} layers)",
        list(plans.iter().map(|q| q.micro_batches).collect()),
        p.batch,
        p.min_micro_batch,
        list(plans.iter().map(|q| q.segments).collect()),
        p.depth
    )
}

/// What measuring every plan found: the cheapest that fits (fewest
/// recomputed layers, then fewest micro-batches), the chosen plan's peak,
/// and the lowest peak of all with its plan.
pub struct EveryPlan {
    /// (recomputed layers, micro-batches) of the cheapest plan that fits.
    pub cheapest: Option<(usize, usize)>,
    /// The chosen plan's peak.
    pub chosen_peak: Option<u64>,
    /// The lowest peak and its plan.
    pub lowest: Option<(u64, StepPlan)>,
}

// notebook cell
/// Every plan measured, as a table, against the budget and the chosen plan.
pub fn every_plan(
    ctx: &mut Context,
    p: &FitExerciseParams,
    bench: &FitBench,
    budget: u64,
    chosen: StepPlan,
) -> anyhow::Result<EveryPlan> {
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
    let mut found = EveryPlan {
        cheapest: None,
        chosen_peak: None,
        lowest: None,
    };
    for plan in bench.shape.plans() {
        let peak = bench.measured(ctx, plan)?;
        if found.lowest.is_none_or(|(l, _)| peak < l) {
            found.lowest = Some((peak, plan));
        }
        let recomputed = recomputed_layers(&bench.shape, plan)?;
        let fits = peak <= budget;
        if fits {
            let cost = (recomputed, plan.micro_batches);
            found.cheapest = Some(found.cheapest.map_or(cost, |c| c.min(cost)));
        }
        if plan == chosen {
            found.chosen_peak = Some(peak);
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
    Ok(found)
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
    let bench = FitBench::new(ctx, p)?;
    let plans = bench.shape.plans();
    let plain = StepPlan {
        micro_batches: 1,
        segments: 1,
    };
    let budget = (p.budget_fraction * bench.measured(ctx, plain)? as f64) as u64;
    ctx.metric("budget_bytes", budget as f64);

    // Your plan, and the steps it measured on the way.
    let not_a_plan = not_a_plan(p, &plans);
    let allowed = |plan: StepPlan| -> anyhow::Result<()> {
        anyhow::ensure!(plans.contains(&plan), "{plan:?} {not_a_plan}");
        Ok(())
    };
    let mut measurements = 0usize;
    let chosen = choose(&bench.shape, budget, &mut |plan| {
        allowed(plan)?;
        measurements += 1;
        bench.measured(ctx, plan)
    })?;
    allowed(chosen)?;
    ctx.print(format!(
        "your plan: {} micro-batch(es), {} segment(s), after {measurements} measured step(s)",
        chosen.micro_batches, chosen.segments
    ));
    ctx.metric("measurements", measurements as f64);

    let found = every_plan(ctx, p, &bench, budget, chosen)?;
    let (fewest_recomputed, fewest_micro) = found.cheapest.ok_or_else(|| {
        let (peak, plan) = found.lowest.unwrap_or((0, plain));
        anyhow::anyhow!(
            "no plan fits {budget} bytes: the lowest peak is {peak} bytes, with {} \
             micro-batch(es) and {} segment(s); raise budget_fraction or lower min_micro_batch",
            plan.micro_batches,
            plan.segments
        )
    })?;
    let chosen_peak = found
        .chosen_peak
        .ok_or_else(|| anyhow::anyhow!("{chosen:?} was not among the plans"))?;
    ctx.metric("chosen_peak", chosen_peak as f64);
    ctx.metric(
        "chosen_recomputed_layers",
        recomputed_layers(&bench.shape, chosen)? as f64,
    );
    ctx.metric("chosen_micro_batches", chosen.micro_batches as f64);
    ctx.metric("cheapest_recomputed_layers", fewest_recomputed as f64);
    ctx.metric("cheapest_micro_batches", fewest_micro as f64);

    // The plan changes when work happens, not what is computed.
    let (layers, vars, x, y) = (&bench.layers, &bench.vars, &bench.x, &bench.y);
    let grads = step_with_plan(layers, vars, (x, y), chosen)?;
    let plain = Category::Gradients.scope(|| -> anyhow::Result<GradStore> {
        let logits = Category::Activations.scope(|| bench.model.forward_fused(x))?;
        let loss = candle_lean_nn::cross_entropy(&logits, y)?;
        Ok(param_grads(&loss.backward()?, vars))
    })?;
    ctx.metric(
        "grad_max_abs_diff",
        grads_max_abs_diff(&plain, &grads, vars)?,
    );
    Ok(())
}

/// The exercise: your `choose_plan`, graded and measured.
pub fn fit_exercise(ctx: &mut Context, p: FitExerciseParams) -> anyhow::Result<()> {
    grade_plan(ctx, &p, choose_plan)
}
