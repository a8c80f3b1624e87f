//! The data-parallel cell: DDP and ZeRO stages 1, 2 and 3 on 1, 2, 4...
//! MPI ranks, each rank's memory measured by its own counting allocator by
//! category and its traffic counted, beside ZeRO's formulas.
//!
//! The cell starts the ranks itself: `mpirun -n N workbook rank ...` for
//! each N, where every rank runs the four stages in turn ([`rank`]) and
//! writes what it measured to a file. A rank that fails, or a job that runs
//! past the time limit, makes the cell's error; what the other ranks
//! reported is kept.
//!
//! The techniques are the toolkit's `candle-distributed`. The second
//! plugin, [`GptRanks`], runs chapter 3's GPT on the ranks the same way,
//! planned and then measured ([`gpt`]).
#![warn(missing_docs)]

pub mod counts;
pub mod gpt;
pub mod launch;
pub mod rank;

pub use counts::MAX_RANKS;
pub use gpt::GptRanks;

use serde::{Deserialize, Serialize};
use workbook_sdk::anyhow;
use workbook_sdk::metric::MetricSpec;
use workbook_sdk::output::{mib, Axis, Series, Unit};
use workbook_sdk::{Context, Figure, Plugin, Rules, Table, Violation};

use crate::counts::Split;
use crate::launch::{launch, Job};
use crate::rank::{RankReport, StageReport};
use workbook_planner::stage::{ModelState, Precision, Stage};

/// Parameters of the data-parallel cell.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Params {
    /// Linear + ReLU layers of the model.
    pub layers: usize,
    /// Features in and out of each layer.
    pub width: usize,
    /// Rows of the whole batch, split over the ranks (unevenly where the
    /// ranks do not divide it, each rank's loss weighted by its rows).
    pub batch: usize,
    /// Training steps per stage.
    #[schemars(range(min = 1))]
    pub steps: usize,
    /// The rank counts to run, each an MPI job.
    pub ranks: Vec<usize>,
    /// The per-rank memory budget that the model sizes which fit are
    /// computed for, in MiB.
    pub budget_mib: f64,
    /// The time limit of one job, in seconds.
    pub timeout_seconds: f64,
    /// Seed of weights and data.
    pub seed: u64,
    /// The dtype the model trains in: `f32`, or `bf16` for mixed precision
    /// (bf16 parameters and gradients, f32 master weights and moments).
    pub precision: Precision,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            layers: 4,
            width: 512,
            batch: 64,
            steps: 2,
            ranks: vec![1, 2, 4],
            budget_mib: 1024.0,
            timeout_seconds: 300.0,
            seed: 19,
            precision: Precision::F32,
        }
    }
}

/// The data-parallel plugin.
#[derive(Debug, Default, Clone, Copy)]
pub struct ZeroStages;

impl Plugin for ZeroStages {
    type Params = Params;

    fn name(&self) -> &str {
        "zero_stages"
    }

    fn description(&self) -> &str {
        "DDP and ZeRO stages 1-3 on MPI ranks: model states and bytes sent per rank, measured beside the formulas"
    }

    fn validate(&self, p: &Params) -> Vec<Violation> {
        let mut r = Rules::new();
        // Width 2 at least: each stage is measured again at half of it.
        r.at_least("layers", p.layers, 1)
            .at_least("width", p.width, 2)
            .at_least("batch", p.batch, 1)
            .at_least("steps", p.steps, 1)
            .positive("budget_mib", p.budget_mib)
            .within("timeout_seconds", p.timeout_seconds, 1.0, 604_800.0);
        let w = p.width as u64;
        r.elements("width", "layers × width × width", &[p.layers as u64, w, w])
            .elements("batch", "batch × width", &[p.batch as u64, w]);
        counts::check(&mut r, "ranks", &p.ranks, Split::Rows(p.batch));
        r.into_violations()
    }

    fn memory_floor(&self, p: &Params) -> Option<(u64, String)> {
        // Every rank runs DDP first, which holds the whole model's states:
        // 16 bytes a parameter in f32 (4 + 4 + 8) and in mixed precision
        // (2 + 2 + 12). Each rank is held to the cell's cap.
        let (l, w) = (p.layers as u64, p.width as u64);
        let psi = w.saturating_mul(w).saturating_add(w).saturating_mul(l);
        Some((
            psi.saturating_mul(16),
            format!(
                "each rank's DDP model states, 16 bytes for each of the {l} × ({w}² + {w}) \
                 parameters"
            ),
        ))
    }

    fn unavailable(&self, p: &Params) -> Option<String> {
        // Every count, one rank included, is an MPI job. A `--ranks` that
        // cannot be read is the cell's error when it runs.
        let (counts, _) = counts::with_flag(&p.ranks, Split::Rows(p.batch)).ok()?;
        launch::unavailable(&counts)
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        vec![
            MetricSpec::count("psi", "parameters of the model, Ψ"),
            MetricSpec::bytes(
                "{stage}_n{ranks}_state",
                "model states one rank holds (parameters + gradients + optimizer state), measured, highest over the ranks",
            ),
            MetricSpec::bytes(
                "{stage}_n{ranks}_state_spread",
                "the most model states a rank holds less the fewest: 0 when every rank holds the same (the other metrics are the highest over the ranks)",
            ),
            MetricSpec::bytes(
                "{stage}_n{ranks}_formula",
                "model states per rank by ZeRO's formula as the toolkit holds them: in f32 4 + 4 + 8 bytes per parameter, in bf16 2 + 2 + 12 (stage 2's gradient blocks and stage 3's parameter blocks in f32), the partitioned parts over N",
            ),
            MetricSpec::bytes(
                "{stage}_n{ranks}_paper",
                "model states per rank by Rajbhandari et al. 2020 as printed: (2 + 2 + K)Ψ, 4Ψ + KΨ/N, 2Ψ + (2 + K)Ψ/N, (2 + 2 + K)Ψ/N with K = 12 in bf16; the f32 form (the formula) in f32",
            ),
            MetricSpec::bytes("{stage}_n{ranks}_params", "parameters one rank holds, measured"),
            MetricSpec::bytes("{stage}_n{ranks}_grads", "gradients one rank holds at the step, measured"),
            MetricSpec::bytes("{stage}_n{ranks}_optim", "optimizer state one rank holds, measured"),
            MetricSpec::bytes("{stage}_n{ranks}_peak", "one rank's highest memory during the steps, above the stage's start (model states included, their set-up not)"),
            MetricSpec::bytes("{stage}_n{ranks}_comm_peak", "communication buffers at their highest on one rank"),
            MetricSpec::bytes("{stage}_n{ranks}_activations", "activations at their highest on one rank, above the stage's start"),
            MetricSpec::bytes("{stage}_n{ranks}_sent", "bytes one rank sends per step (ring algorithms), counted"),
            MetricSpec::bytes(
                "{stage}_n{ranks}_sent_formula",
                "bytes per rank per step by the formula: 2Ψ (DDP, stages 1 and 2) or 3Ψ (stage 3) f32 elements times (N - 1)/N",
            ),
            MetricSpec::count("{stage}_n{ranks}_calls", "collective calls per step on one rank"),
            MetricSpec::seconds("{stage}_n{ranks}_seconds", "time of a step, slowest rank"),
            MetricSpec::count(
                "{stage}_n{ranks}_fits",
                "parameters whose model states fit the per-rank budget at the measured bytes per parameter",
            ),
            MetricSpec::bytes(
                "{stage}_n{ranks}_excess_per_tensor",
                "measured model states minus the formula, per tensor that holds them: candle's bookkeeping",
            ),
            MetricSpec::bytes(
                "{stage}_n{ranks}_scaled_excess",
                "what the measured model states grow by from half the width to the whole, less what the formula grows by: 0 when every byte that grows with the model is the formula's (the rank whose difference is largest in magnitude, its sign kept)",
            ),
            MetricSpec::count("{stage}_n{ranks}_ranks_reported", "ranks that wrote a report for the stage"),
        ]
    }

    fn run(&self, ctx: &mut Context, p: Params) -> anyhow::Result<()> {
        let budget = p.budget_mib * 1_048_576.0;
        // A `--ranks` that cannot split the batch is the cell's error once
        // its own counts have run.
        let (to_run, refused) = counts::with_flag(&p.ranks, Split::Rows(p.batch))?;
        let mut failures: Vec<String> = refused.into_iter().collect();
        let mut rows: Vec<(usize, Vec<StageReport>)> = Vec::new();
        // Every rank's reports of the largest job that ran, for the table
        // rank by rank.
        let mut largest: Vec<RankReport> = Vec::new();
        for &n in &to_run {
            ctx.progress(&counts::ranks(n));
            let job = Job {
                ranks: n,
                layers: p.layers,
                width: p.width,
                batch: p.batch,
                steps: p.steps,
                seed: p.seed,
                precision: p.precision,
                timeout: std::time::Duration::from_secs_f64(p.timeout_seconds),
                max_memory: workbook_sdk::meter::limit(),
            };
            // A job that cannot start ends the cell's runs, but what the
            // earlier rank counts measured still goes into the table.
            let outcome = match launch(&job) {
                Ok(o) => o,
                Err(e) => {
                    failures.push(format!("{}: {e:#}", counts::ranks(n)));
                    break;
                }
            };
            if let Some(e) = &outcome.error {
                failures.push(format!("{}: {e}", counts::ranks(n)));
            }
            for stage in Stage::ALL {
                let per_rank = stage_reports(&outcome.reports, stage);
                let key = |what: &str| format!("{}_n{n}_{what}", stage.name());
                ctx.metric(key("ranks_reported"), per_rank.len() as f64);
                let Some(first) = per_rank.first() else {
                    continue;
                };
                let max = |f: &dyn Fn(&StageReport) -> u64| {
                    per_rank.iter().map(|s| f(s)).max().unwrap_or(0)
                };
                let state = max(&|s| s.held.total());
                let least = per_rank.iter().map(|s| s.held.total()).min().unwrap_or(0);
                let formula = stage.formula(first.psi, first.block, p.precision);
                ctx.metric("psi", first.psi as f64);
                ctx.metric(key("state"), state as f64);
                ctx.metric(key("state_spread"), (state - least) as f64);
                ctx.metric(key("formula"), formula.total() as f64);
                ctx.metric(
                    key("paper"),
                    stage.paper(first.psi, first.block, p.precision) as f64,
                );
                ctx.metric(key("params"), max(&|s| s.held.params) as f64);
                ctx.metric(key("grads"), max(&|s| s.held.grads) as f64);
                ctx.metric(key("optim"), max(&|s| s.held.optim) as f64);
                ctx.metric(key("peak"), max(&|s| s.peak) as f64);
                ctx.metric(key("comm_peak"), max(&|s| s.comm_peak) as f64);
                ctx.metric(key("activations"), max(&|s| s.activations_peak) as f64);
                ctx.metric(key("sent"), max(&|s| s.sent_per_step) as f64);
                ctx.metric(
                    key("sent_formula"),
                    stage.sent_formula(first.psi, first.padded, n as u64) as f64,
                );
                ctx.metric(key("calls"), max(&|s| s.calls_per_step) as f64);
                let seconds = per_rank
                    .iter()
                    .map(|s| s.seconds_per_step)
                    .fold(0.0, f64::max);
                ctx.metric(key("seconds"), seconds);
                let per_param = state as f64 / first.psi as f64;
                ctx.metric(key("fits"), (budget / per_param).floor());
                ctx.metric(
                    key("excess_per_tensor"),
                    (state as f64 - formula.total() as f64) / first.tensors as f64,
                );
                if let Some(excess) = per_rank
                    .iter()
                    .map(|s| scaled_excess(s, stage, p.precision))
                    .collect::<Option<Vec<i64>>>()
                    .and_then(|e| e.into_iter().max_by_key(|x| x.abs()))
                {
                    ctx.metric(key("scaled_excess"), excess as f64);
                }
            }
            let full: Vec<StageReport> = Stage::ALL
                .iter()
                .filter_map(|&st| {
                    stage_reports(&outcome.reports, st)
                        .into_iter()
                        .max_by_key(|s| s.held.total())
                        .cloned()
                })
                .collect();
            rows.push((n, full));
            largest = outcome.reports;
        }
        if !rows.is_empty() {
            table(ctx, &rows, p.precision);
            rank_table(ctx, &largest, p.precision);
            figures(ctx, &rows, p.precision);
        }
        if !failures.is_empty() {
            anyhow::bail!("{}", failures.join("; "));
        }
        Ok(())
    }
}

/// Each rank's report of `stage`, for the ranks that got that far.
fn stage_reports(reports: &[RankReport], stage: Stage) -> Vec<&StageReport> {
    reports
        .iter()
        .filter_map(|r| r.stages.iter().find(|s| s.stage == stage))
        .collect()
}

/// What a rank's model states grew by from half the width to the whole,
/// less what the formula grew by; `None` where the stage was not measured
/// at half the width.
fn scaled_excess(s: &StageReport, stage: Stage, precision: Precision) -> Option<i64> {
    let m = s.smaller.as_ref()?;
    let grown = s.held.total() as i64 - m.held.total() as i64;
    let formula = stage.formula(s.psi, s.block, precision).total() as i64
        - stage.formula(m.psi, m.block, precision).total() as i64;
    Some(grown - formula)
}

fn table(ctx: &mut Context, rows: &[(usize, Vec<StageReport>)], precision: Precision) {
    let mut t = Table::new(
        format!(
            "Per rank, {}: model states measured against ZeRO's formula, and bytes sent per step",
            precision.describe()
        ),
        &[
            ("stage", Unit::None),
            ("N", Unit::None),
            ("params", Unit::Bytes),
            ("grads", Unit::Bytes),
            ("optim", Unit::Bytes),
            ("measured", Unit::Bytes),
            ("formula", Unit::Bytes),
            ("peak", Unit::Bytes),
            ("comm buffers", Unit::Bytes),
            ("sent / step", Unit::Bytes),
            ("formula", Unit::Bytes),
            ("step", Unit::Seconds),
        ],
    );
    for (n, stages) in rows {
        for s in stages {
            let f: ModelState = s.stage.formula(s.psi, s.block, precision);
            t.row(vec![
                s.stage.name().into(),
                (*n).into(),
                s.held.params.into(),
                s.held.grads.into(),
                s.held.optim.into(),
                s.held.total().into(),
                f.total().into(),
                s.peak.into(),
                s.comm_peak.into(),
                s.sent_per_step.into(),
                s.stage.sent_formula(s.psi, s.padded, *n as u64).into(),
                s.seconds_per_step.into(),
            ]);
        }
    }
    ctx.table(t);
}

/// The by-category plot's lines.
const CATEGORIES: [&str; 5] = [
    "parameters",
    "gradients",
    "optimizer state",
    "activations (peak)",
    "communication buffers (peak)",
];

/// What a rank held of each of [`CATEGORIES`].
fn by_category(s: &StageReport) -> [u64; CATEGORIES.len()] {
    [
        s.held.params,
        s.held.grads,
        s.held.optim,
        s.activations_peak,
        s.comm_peak,
    ]
}

/// What each rank of one job measured, stage by stage: the first table
/// keeps the highest rank of each.
fn rank_table(ctx: &mut Context, reports: &[RankReport], precision: Precision) {
    let Some(ranks) = reports.first().map(|r| r.ranks) else {
        return;
    };
    let mut t = Table::new(
        format!(
            "Each of {ranks} ranks, {}: what it held and its peak",
            precision.describe()
        ),
        &[
            ("stage", Unit::None),
            ("rank", Unit::None),
            ("params", Unit::Bytes),
            ("grads", Unit::Bytes),
            ("optim", Unit::Bytes),
            ("activations", Unit::Bytes),
            ("comm buffers", Unit::Bytes),
            ("peak", Unit::Bytes),
            ("sent / step", Unit::Bytes),
        ],
    );
    for stage in Stage::ALL {
        for r in reports {
            let Some(s) = r.stages.iter().find(|s| s.stage == stage) else {
                continue;
            };
            t.row(vec![
                stage.name().into(),
                r.rank.into(),
                s.held.params.into(),
                s.held.grads.into(),
                s.held.optim.into(),
                s.activations_peak.into(),
                s.comm_peak.into(),
                s.peak.into(),
                s.sent_per_step.into(),
            ]);
        }
    }
    ctx.table(t);
}

fn figures(ctx: &mut Context, rows: &[(usize, Vec<StageReport>)], precision: Precision) {
    // The f32 plots keep the titles they had before bf16 was measured.
    let dtype = match precision {
        Precision::F32 => String::new(),
        other => format!(", {}", other.describe()),
    };
    let series = |f: &dyn Fn(&StageReport) -> f64| -> Vec<Series> {
        Stage::ALL
            .iter()
            .map(|&st| Series {
                name: st.name().to_string(),
                points: rows
                    .iter()
                    .filter_map(|(n, ss)| {
                        ss.iter().find(|s| s.stage == st).map(|s| (*n as f64, f(s)))
                    })
                    .collect(),
            })
            .collect()
    };
    let ranks = Axis {
        label: "ranks N".into(),
        unit: Unit::None,
        log: true,
    };
    ctx.figure(Figure {
        id: "zero-model-states".into(),
        title: format!("Model states per rank, measured{dtype}"),
        x: ranks.clone(),
        y: Axis {
            label: "MiB per rank".into(),
            unit: Unit::None,
            log: false,
        },
        series: series(&|s| mib(s.held.total())),
        ..Default::default()
    });
    // What each stage partitions, one category at a time, at the most ranks.
    if let Some((n, stages)) = rows.last() {
        ctx.figure(Figure {
            id: "zero-by-category".into(),
            title: format!("What one rank holds on {n} ranks, by category{dtype}"),
            x: Axis {
                label: "stage (0: DDP, 1-3: ZeRO)".into(),
                unit: Unit::None,
                log: false,
            },
            y: Axis {
                label: "MiB per rank".into(),
                unit: Unit::None,
                log: false,
            },
            series: CATEGORIES
                .iter()
                .enumerate()
                .map(|(i, name)| Series {
                    name: name.to_string(),
                    points: stages
                        .iter()
                        .map(|s| (s.stage as usize as f64, mib(by_category(s)[i])))
                        .collect(),
                })
                .collect(),
            ..Default::default()
        });
    }
    ctx.figure(Figure {
        id: "zero-bytes-sent".into(),
        title: format!("Bytes each rank sends per step{dtype}"),
        x: ranks,
        y: Axis {
            label: "MiB per step".into(),
            unit: Unit::None,
            log: false,
        },
        series: series(&|s| mib(s.sent_per_step)),
        ..Default::default()
    });
}
