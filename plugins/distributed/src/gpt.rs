//! The `gpt_ranks` cell: chapter 3's GPT trained on N MPI ranks under DDP
//! and ZeRO stages 1, 2 and 3, with the direct backward that hands each
//! gradient over as soon as it exists. For each stage and N, the planner
//! predicts a rank's peak from one rank rehearsed in this process
//! (`workbook plan --ranks N`), then the real ranks run the step and
//! measure their own (`workbook plan --ranks N --verify`), so the cell sets
//! what a stage saves beside whether the prediction held.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use workbook_models::{GptConfig, Recipe, StepFields};
use workbook_planner::plan::{plan, verify, Candidate, PlanRequest, Verification, VerifyRequest};
use workbook_planner::stage::Stage;
use workbook_sdk::candle::Device;
use workbook_sdk::metric::MetricSpec;
use workbook_sdk::output::{mib, Axis, Series, Unit};
use workbook_sdk::{anyhow, Context, Figure, Plugin, Rules, Table, Violation};

use crate::counts::{self, Split};
use crate::launch::{self, verify_on_ranks, CannotStart};

/// The budget each option is weighed against: none binds, so every stage
/// keeps its whole batch per rank.
const NO_BUDGET: u64 = 1 << 50;

/// Parameters of the `gpt_ranks` cell.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Params {
    /// The model (the recipe sets its attention kind and `lean`).
    pub model: GptConfig,
    /// How each rank computes the layers: `direct_tiled` (the direct
    /// backward with tiled attention) unless named.
    pub recipe: Recipe,
    /// Sequences of the whole batch, split evenly over the ranks.
    pub batch: usize,
    /// The dtype: `f32`, `f16` or `bf16`.
    pub dtype: String,
    /// The rank counts to run, each an MPI job per stage (1: this process
    /// alone, no stage).
    pub ranks: Vec<usize>,
    /// Measured steps on the ranks (after one to warm up); the peak is the
    /// highest.
    #[schemars(range(min = 1))]
    pub steps: usize,
    /// The time limit of one job, in seconds.
    pub timeout_seconds: f64,
    /// Seed of weights and data.
    pub seed: u64,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            model: GptConfig::default(),
            recipe: Recipe::DirectTiled,
            batch: 8,
            dtype: "f32".into(),
            ranks: vec![1, 2, 4],
            steps: 1,
            timeout_seconds: 300.0,
            seed: 11,
        }
    }
}

/// The `gpt_ranks` plugin.
#[derive(Debug, Default, Clone, Copy)]
pub struct GptRanks;

impl Plugin for GptRanks {
    type Params = Params;

    fn name(&self) -> &str {
        "gpt_ranks"
    }

    fn description(&self) -> &str {
        "a GPT on MPI ranks under DDP and ZeRO stages 1-3: each rank's peak planned from one rank rehearsed, then measured on the ranks"
    }

    fn validate(&self, p: &Params) -> Vec<Violation> {
        let mut r = Rules::new();
        p.model.check(&mut r, "model");
        r.at_least("batch", p.batch, 1)
            .one_of("dtype", &p.dtype, &workbook_sdk::DTYPES)
            .at_least("steps", p.steps, 1)
            .within("timeout_seconds", p.timeout_seconds, 1.0, 604_800.0);
        // Tiled attention never holds a sequence's whole score matrix.
        let scores = p.recipe.apply(p.model).holds_scores();
        p.model
            .check_step(&mut r, StepFields::MODEL, p.batch, scores);
        counts::check(&mut r, "ranks", &p.ranks, Split::Sequences(p.batch));
        r.into_violations()
    }

    fn memory_floor(&self, p: &Params) -> Option<(u64, String)> {
        // DDP holds the whole model's states on each rank: parameters,
        // gradients and AdamW's two moments, all in the cell's dtype (4
        // bytes each in f32, 2 in bf16 and f16).
        let psi = p.model.checked_param_count()?;
        let per = 4 * workbook_sdk::parse_dtype(&p.dtype).ok()?.size_in_bytes() as u64;
        Some((
            psi.saturating_mul(per),
            format!("each rank's DDP model states, {per} bytes for each of {psi} parameters"),
        ))
    }

    fn unavailable(&self, p: &Params) -> Option<String> {
        // One process runs here; the counts above it are MPI jobs.
        let (counts, _) = counts::with_flag(&p.ranks, Split::Sequences(p.batch)).ok()?;
        let jobs: Vec<usize> = counts.into_iter().filter(|&n| n > 1).collect();
        launch::unavailable(&jobs)
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        vec![
            MetricSpec::count("psi", "parameters of the model, Ψ"),
            MetricSpec::bytes(
                "single_predicted",
                "one process's peak, predicted by the planner",
            ),
            MetricSpec::bytes("single_peak", "one process's peak, measured"),
            MetricSpec::ratio(
                "single_error",
                "one process's measured peak over the prediction, less one",
            ),
            MetricSpec::seconds("single_seconds", "one process's step time, median"),
            MetricSpec::bytes(
                "{stage}_n{ranks}_predicted",
                "one rank's peak, predicted from one rank rehearsed in the cell's process",
            ),
            MetricSpec::bytes(
                "{stage}_n{ranks}_peak",
                "one rank's peak measured on the real ranks, the highest over the ranks and steps",
            ),
            MetricSpec::ratio(
                "{stage}_n{ranks}_error",
                "the measured peak over the prediction, less one",
            ),
            MetricSpec::seconds(
                "{stage}_n{ranks}_seconds",
                "step time, median, slowest rank",
            ),
        ]
    }

    fn run(&self, ctx: &mut Context, p: Params) -> anyhow::Result<()> {
        let dtype = workbook_sdk::parse_dtype(&p.dtype)?;
        ctx.metric("psi", p.model.param_count() as f64);
        let timeout = Duration::from_secs_f64(p.timeout_seconds);
        // A `--ranks` that cannot split the batch is the cell's error once
        // its own counts have run.
        let (to_run, refused) = counts::with_flag(&p.ranks, Split::Sequences(p.batch))?;
        let mut failures: Vec<String> = refused.into_iter().collect();
        // The ranks compute on the CPU whatever the cell's device, so the
        // plan rehearses its rank there too, in a context of its own: the
        // cell's outcome is the plans and the ranks' peaks, not each
        // calibration step.
        let meter = workbook_sdk::device::meter_for(&Device::Cpu)?;
        let mut own = Context::new(Device::Cpu, meter, ctx.is_check());
        let mut rows: Vec<Row> = Vec::new();
        // Why no job can start (no MPI), once known: the counts above one
        // are then skipped, and it is said once.
        let mut cannot_start = launch::cannot_start().map(|e| e.to_string());
        let mut skipped = Vec::new();
        for &n in &to_run {
            if n > 1 && cannot_start.is_some() {
                skipped.push(n);
                continue;
            }
            let req = PlanRequest {
                model: p.model,
                batch: p.batch,
                budget: NO_BUDGET,
                margin: 0.05,
                dtypes: vec![dtype],
                recipes: vec![p.recipe],
                checkpointing: false,
                seed: p.seed,
                ranks: n,
                stages: Stage::ALL.to_vec(),
            };
            ctx.progress(&format!("planning {} from one rehearsed", counts::ranks(n)));
            // A plan that fails loses only its own count's rows.
            let planned = match plan(&mut own, &req) {
                Ok(planned) => planned,
                Err(e) => {
                    failures.push(format!("planning {}: {e:#}", counts::ranks(n)));
                    continue;
                }
            };
            let stages: Vec<Option<Stage>> = if n == 1 {
                vec![None]
            } else {
                Stage::ALL.into_iter().map(Some).collect()
            };
            for stage in stages {
                let name = stage.map_or("one process", |s| s.name());
                let Some(option) = whole_batch(&planned.candidates, stage, planned.batch_per_rank)
                else {
                    failures.push(format!(
                        "{name} on {}: no plan of the whole batch",
                        counts::ranks(n)
                    ));
                    continue;
                };
                let v = VerifyRequest {
                    // Each rank is held to the cell's cap, as this process is.
                    max_memory: workbook_sdk::meter::limit(),
                    ..VerifyRequest::new(&req, option, p.steps)?
                };
                ctx.progress(&format!("{name} on {}", counts::ranks(n)));
                let measured = match stage {
                    None => {
                        // A warm-up step first, as each rank runs.
                        verify(
                            &mut own,
                            &VerifyRequest {
                                steps: 1,
                                ..v.clone()
                            },
                            None,
                        )
                        .and_then(|_| verify(&mut own, &v, None))
                    }
                    Some(_) => verify_on_ranks(v, n, timeout),
                };
                match measured {
                    Ok(m) => {
                        let key = |what: &str| match stage {
                            None => format!("single_{what}"),
                            Some(s) => format!("{}_n{n}_{what}", s.name()),
                        };
                        ctx.metric(key("predicted"), m.predicted as f64);
                        ctx.metric(key("peak"), m.peak as f64);
                        ctx.metric(key("error"), m.error());
                        ctx.metric(key("seconds"), m.seconds);
                        rows.push(Row {
                            stage,
                            ranks: n,
                            measured: m,
                        });
                    }
                    // No stage of this count, nor any count after it,
                    // can start either.
                    Err(e) if e.is::<CannotStart>() => {
                        skipped.push(n);
                        cannot_start = Some(e.to_string());
                        break;
                    }
                    Err(e) => failures.push(format!("{name} on {}: {e:#}", counts::ranks(n))),
                }
            }
        }
        if let (Some(why), false) = (&cannot_start, skipped.is_empty()) {
            let listed: Vec<String> = skipped.iter().map(|n| n.to_string()).collect();
            failures.push(format!("{} ranks: {why}", listed.join(" and ")));
        }
        if !rows.is_empty() {
            table(ctx, &rows, &p);
            figure(ctx, &rows);
        }
        if !failures.is_empty() {
            anyhow::bail!("{}", failures.join("; "));
        }
        Ok(())
    }
}

/// The option of `stage` that trains the whole batch per rank at once.
fn whole_batch(
    candidates: &[Candidate],
    stage: Option<Stage>,
    per_rank: usize,
) -> Option<&Candidate> {
    candidates
        .iter()
        .find(|c| c.stage == stage && !c.checkpointed && c.micro_batch == per_rank)
}

/// What one stage on one rank count measured.
struct Row {
    stage: Option<Stage>,
    ranks: usize,
    measured: Verification,
}

fn table(ctx: &mut Context, rows: &[Row], p: &Params) {
    let mut t = Table::new(
        format!(
            "Per rank, {} in {}: the plan from one rank rehearsed, and the real ranks",
            p.recipe.name(),
            p.dtype
        ),
        &[
            ("stage", Unit::None),
            ("N", Unit::None),
            ("predicted", Unit::Bytes),
            ("measured", Unit::Bytes),
            ("measured / predicted", Unit::Ratio),
            ("step", Unit::Seconds),
        ],
    );
    for r in rows {
        let m = &r.measured;
        t.row(vec![
            r.stage.map_or("one process", |s| s.name()).into(),
            r.ranks.into(),
            m.predicted.into(),
            m.peak.into(),
            (m.peak as f64 / m.predicted as f64).into(),
            m.seconds.into(),
        ]);
    }
    ctx.table(t);
}

fn figure(ctx: &mut Context, rows: &[Row]) {
    let single = rows.iter().find(|r| r.stage.is_none());
    let series = Stage::ALL
        .iter()
        .map(|&st| Series {
            name: st.name().to_string(),
            points: single
                .map(|r| (1.0, mib(r.measured.peak)))
                .into_iter()
                .chain(
                    rows.iter()
                        .filter(|r| r.stage == Some(st))
                        .map(|r| (r.ranks as f64, mib(r.measured.peak))),
                )
                .collect(),
        })
        .collect();
    ctx.figure(Figure {
        id: "gpt-ranks-peak".into(),
        title: "The GPT's peak per rank, measured on the ranks".into(),
        x: Axis {
            label: "ranks N".into(),
            unit: Unit::None,
            log: true,
        },
        y: Axis {
            label: "MiB per rank".into(),
            unit: Unit::None,
            log: false,
        },
        series,
        ..Default::default()
    });
}
