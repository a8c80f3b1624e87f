//! The `predictors` cell: each predictor's figure against the measured
//! peak of a real training step, over sweeps of the model's sizes.

use serde::{Deserialize, Serialize};
use workbook_sdk::metric::MetricSpec;
use workbook_sdk::output::{Axis, Series};
use workbook_sdk::{anyhow, Category, Context, Figure, Plugin, Rules, Table, Unit, Violation};

use crate::gpt::GptConfig;
use crate::parse_dtype;
use crate::predict::{Measured, Predictor, Run};
use crate::saved::Recipe;
use crate::step::{calibrate, measured_step, StepShape};
use crate::training::{check_model, check_run};

/// One training run of the sweep: the base model with some sizes changed.
#[derive(Debug, Clone, Default, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Variant {
    /// Blocks (L), if not the base's.
    pub layers: Option<usize>,
    /// Hidden size (h), if not the base's.
    pub hidden: Option<usize>,
    /// Sequence length (s), if not the base's.
    pub seq: Option<usize>,
    /// Sequences per batch (b), if not the base's; at least 3.
    pub batch: Option<usize>,
    /// Dtype, if not the base's.
    pub dtype: Option<String>,
}

/// Parameters of the `predictors` cell.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Params {
    /// The base model (its `attention` and `lean` set by `recipe`).
    pub model: GptConfig,
    /// How the layers are computed.
    pub recipe: Recipe,
    /// Sequences per batch of the base run (b), at least 3.
    pub batch: usize,
    /// The base run's dtype: `f32`, `f16` or `bf16`.
    pub dtype: String,
    /// The runs: the base, then each variant.
    pub variants: Vec<Variant>,
    /// Seed of weights and data.
    pub seed: u64,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            model: GptConfig {
                layers: 2,
                hidden: 128,
                seq: 128,
                ..GptConfig::default()
            },
            recipe: Recipe::Lean,
            batch: 4,
            dtype: "f32".into(),
            variants: Vec::new(),
            seed: 9,
        }
    }
}

/// The `predictors` plugin.
#[derive(Debug, Default, Clone, Copy)]
pub struct Predictors;

fn label(v: &Variant) -> String {
    let mut parts = Vec::new();
    for (name, value) in [
        ("L", v.layers),
        ("h", v.hidden),
        ("s", v.seq),
        ("b", v.batch),
    ] {
        if let Some(x) = value {
            parts.push(format!("{name}={x}"));
        }
    }
    if let Some(d) = &v.dtype {
        parts.push(d.clone());
    }
    if parts.is_empty() {
        "base".into()
    } else {
        parts.join(", ")
    }
}

impl Plugin for Predictors {
    type Params = Params;

    fn name(&self) -> &str {
        "predictors"
    }

    fn description(&self) -> &str {
        "memory predictors (Korthikanti, Hugging Face, accelerate, DeepSpeed, the ledger) against measured training steps"
    }

    fn validate(&self, p: &Params) -> Vec<Violation> {
        let mut r = Rules::new();
        // The calibrated predictor measures batches 1 and 2: from 3 on, its
        // figure is an extrapolation, not one of its own measurements.
        check_run(&mut r, &p.model, p.batch, 3, &p.dtype);
        for (i, v) in p.variants.iter().enumerate() {
            let c = GptConfig {
                layers: v.layers.unwrap_or(p.model.layers),
                hidden: v.hidden.unwrap_or(p.model.hidden),
                seq: v.seq.unwrap_or(p.model.seq),
                ..p.model
            };
            check_model(&mut r, &format!("variants[{i}]"), &c);
            if let Some(b) = v.batch {
                r.at_least(&format!("variants[{i}].batch"), b, 3);
            }
            if let Some(d) = &v.dtype {
                r.one_of(&format!("variants[{i}].dtype"), d, &crate::DTYPES);
            }
        }
        r.into_violations()
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        let mut m = vec![
            MetricSpec::count("runs", "training steps measured"),
            MetricSpec::bytes(
                "peak_{run}",
                "measured peak of run number `run` (0 is the base)",
            ),
            MetricSpec::ratio(
                "unexplained_{run}",
                "share of run `run`'s peak the calibration's two parts leave unexplained (signed)",
            ),
            MetricSpec::bytes(
                "fixed_{run}",
                "run `run`'s peak that does not grow with the batch: 2 × peak(b=1) - peak(b=2)",
            ),
            MetricSpec::bytes(
                "per_sequence_{run}",
                "what each sequence of the batch adds to run `run`'s peak: peak(b=2) - peak(b=1)",
            ),
            MetricSpec::bytes(
                "ledger_{run}",
                "bytes run `run`'s graph holds at the end of the forward, from the ledger",
            ),
            MetricSpec::bytes(
                "states_{run}",
                "parameters, gradients and two moments of run `run`: 4·P·e",
            ),
        ];
        for pr in Predictor::ALL {
            m.push(MetricSpec::ratio(
                format!("error_{}_{{run}}", pr.id()),
                format!(
                    "{}'s signed error on run `run`: predicted / measured - 1",
                    pr.id()
                ),
            ));
            m.push(MetricSpec::ratio(
                format!("worst_{}", pr.id()),
                format!(
                    "{}'s largest error in absolute value over the runs",
                    pr.id()
                ),
            ));
            m.push(MetricSpec::ratio(
                format!("highest_{}", pr.id()),
                format!(
                    "{}'s largest signed error over the runs (below 0: it fell short of every run)",
                    pr.id()
                ),
            ));
        }
        m
    }

    fn run(&self, ctx: &mut Context, p: Params) -> anyhow::Result<()> {
        let mut variants = vec![Variant::default()];
        variants.extend(p.variants.iter().cloned());
        let mut columns = vec![("run", Unit::None), ("measured peak", Unit::Bytes)];
        let ids: Vec<String> = Predictor::ALL.iter().map(|p| p.id().to_string()).collect();
        for id in &ids {
            columns.push((id.as_str(), Unit::Ratio));
        }
        let mut table = Table::new(
            "Signed error of each predictor against the measured peak (predicted / measured - 1)",
            &columns,
        );
        let mut terms = Table::new(
            "The measured peak: by category at that moment, the ledger, the model states, \
             and the calibration's two parts",
            &[
                ("run", Unit::None),
                ("peak", Unit::Bytes),
                ("parameters", Unit::Bytes),
                ("gradients", Unit::Bytes),
                ("optimizer state", Unit::Bytes),
                ("activations", Unit::Bytes),
                ("ledger", Unit::Bytes),
                ("4·P·e", Unit::Bytes),
                ("fixed part", Unit::Bytes),
                ("per sequence", Unit::Bytes),
                ("unexplained", Unit::Ratio),
            ],
        );
        let mut worst = vec![0f64; Predictor::ALL.len()];
        let mut highest = vec![f64::NEG_INFINITY; Predictor::ALL.len()];
        let mut series: Vec<Series> = Predictor::ALL
            .iter()
            .map(|pr| Series {
                name: pr.id().into(),
                points: Vec::new(),
            })
            .collect();
        for (i, v) in variants.iter().enumerate() {
            let config = p.recipe.apply(GptConfig {
                layers: v.layers.unwrap_or(p.model.layers),
                hidden: v.hidden.unwrap_or(p.model.hidden),
                seq: v.seq.unwrap_or(p.model.seq),
                ..p.model
            });
            let batch = v.batch.unwrap_or(p.batch);
            let dtype_name = v.dtype.clone().unwrap_or_else(|| p.dtype.clone());
            let dtype = parse_dtype(&dtype_name)?;
            let name = label(v);
            let steps = calibrate(
                ctx,
                &name,
                config,
                dtype,
                &StepShape::wholes(&[1, 2], false),
                p.seed,
                None,
            )?;
            let calibration = [steps[0].peak(), steps[1].peak()];
            ctx.progress(&format!("training step, {name}"));
            let step = measured_step(
                ctx,
                name.clone(),
                config,
                dtype,
                StepShape::whole(batch),
                p.seed,
                None,
            )?;
            let run = Run {
                layers: config.layers as u64,
                hidden: config.hidden as u64,
                heads: config.heads as u64,
                seq: config.seq as u64,
                batch: batch as u64,
                vocab: config.vocab as u64,
                params: step.params,
                elem: dtype.size_in_bytes() as u64,
            };
            let inputs = (2 * batch * config.seq * 4) as u64;
            let known = Measured {
                inputs,
                ledger: step.ledger_bytes,
                largest_held: step.largest_held,
                calibration: (calibration[0], calibration[1]),
            };
            let peak = step.peak();
            ctx.metric(format!("peak_{i}"), peak as f64);
            let mut row = vec![name.clone().into(), peak.into()];
            for (k, pr) in Predictor::ALL.iter().enumerate() {
                let predicted = pr.predict(&run, &known);
                let error = predicted as f64 / peak as f64 - 1.0;
                ctx.metric(format!("error_{}_{i}", pr.id()), error);
                highest[k] = highest[k].max(error);
                worst[k] = if error.abs() > worst[k].abs() {
                    error
                } else {
                    worst[k]
                };
                row.push(error.into());
                series[k]
                    .points
                    .push((peak as f64, predicted as f64 / peak as f64));
            }
            table.row(row);
            let at = step
                .region
                .peak_by_category
                .saturating_sub(&step.region.baseline);
            // The calibration's two parts: what does not grow with the batch
            // and what each sequence adds; the rest of the peak is what no
            // term explains.
            let per_sequence = calibration[1].saturating_sub(calibration[0]);
            let fixed = calibration[0].saturating_sub(per_sequence);
            let explained = Predictor::Calibrated.predict(&run, &known);
            let unexplained = (peak as f64 - explained as f64) / peak as f64;
            ctx.metric(format!("unexplained_{i}"), unexplained);
            ctx.metric(format!("fixed_{i}"), fixed as f64);
            ctx.metric(format!("per_sequence_{i}"), per_sequence as f64);
            ctx.metric(format!("ledger_{i}"), step.ledger_bytes as f64);
            ctx.metric(format!("states_{i}"), run.model_states() as f64);
            terms.row(vec![
                name.into(),
                peak.into(),
                at.get(Category::Parameters).into(),
                at.get(Category::Gradients).into(),
                at.get(Category::OptimizerState).into(),
                at.get(Category::Activations).into(),
                step.ledger_bytes.into(),
                run.model_states().into(),
                fixed.into(),
                per_sequence.into(),
                unexplained.into(),
            ]);
        }
        ctx.metric("runs", variants.len() as f64);
        for (k, pr) in Predictor::ALL.iter().enumerate() {
            ctx.metric(format!("worst_{}", pr.id()), worst[k]);
            ctx.metric(format!("highest_{}", pr.id()), highest[k]);
        }
        ctx.table(table);
        ctx.table(terms);
        for s in &mut series {
            s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
        ctx.figure(Figure {
            id: "predictors".into(),
            title: "Each predictor's figure over the measured peak, per run".into(),
            x: Axis {
                label: "measured peak".into(),
                unit: Unit::Bytes,
                log: true,
            },
            y: Axis {
                label: "predicted / measured".into(),
                unit: Unit::Ratio,
                log: false,
            },
            series,
            ..Figure::default()
        });
        Ok(())
    }
}
