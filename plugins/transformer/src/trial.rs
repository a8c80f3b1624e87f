//! The `predictors` cell: each predictor's figure against the measured
//! peak of a real training step, over sweeps of the model's sizes.

use serde::{Deserialize, Serialize};
use workbook_sdk::metric::MetricSpec;
use workbook_sdk::output::{Axis, Series};
use workbook_sdk::{anyhow, Category, Context, Figure, Plugin, Rules, Table, Unit, Violation};

use crate::gpt::{AttentionKind, GptConfig};
use crate::parse_dtype;
use crate::predict::{Measured, Predictor, Run};
use crate::saved::Recipe;
use crate::step::measured_step;
use crate::training::check_model;

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
    /// Sequences per batch (b), if not the base's.
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
    /// Sequences per batch of the base run (b).
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
                heads: 4,
                seq: 128,
                vocab: 512,
                attention: AttentionKind::Naive,
                lean: false,
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
        check_model(&mut r, "model", &p.model);
        r.at_least("batch", p.batch, 1);
        r.one_of("dtype", &p.dtype, &["f32", "f16", "bf16"]);
        for (i, v) in p.variants.iter().enumerate() {
            let c = GptConfig {
                layers: v.layers.unwrap_or(p.model.layers),
                hidden: v.hidden.unwrap_or(p.model.hidden),
                seq: v.seq.unwrap_or(p.model.seq),
                ..p.model
            };
            check_model(&mut r, &format!("variants[{i}]"), &c);
            if let Some(b) = v.batch {
                r.at_least(&format!("variants[{i}].batch"), b, 1);
            }
            if let Some(d) = &v.dtype {
                r.one_of(&format!("variants[{i}].dtype"), d, &["f32", "f16", "bf16"]);
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
                "share of run `run`'s peak the ledger's terms leave unexplained (signed)",
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
            "The measured peak, by category at that moment, beside the ledger's terms",
            &[
                ("run", Unit::None),
                ("peak", Unit::Bytes),
                ("parameters", Unit::Bytes),
                ("gradients", Unit::Bytes),
                ("optimizer state", Unit::Bytes),
                ("activations", Unit::Bytes),
                ("inputs", Unit::Bytes),
                ("ledger", Unit::Bytes),
                ("unexplained", Unit::Ratio),
            ],
        );
        let mut worst = vec![0f64; Predictor::ALL.len()];
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
            ctx.progress(&format!("training step, {name}"));
            let step = measured_step(ctx, name.clone(), config, dtype, batch, p.seed)?;
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
            };
            let peak = step.peak();
            ctx.metric(format!("peak_{i}"), peak as f64);
            let mut row = vec![name.clone().into(), peak.into()];
            for (k, pr) in Predictor::ALL.iter().enumerate() {
                let predicted = pr.predict(&run, &known);
                let error = predicted as f64 / peak as f64 - 1.0;
                ctx.metric(format!("error_{}_{i}", pr.id()), error);
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
            let ledger_terms = Predictor::Ledger.predict(&run, &known);
            let unexplained = peak as f64 / ledger_terms as f64 - 1.0;
            ctx.metric(format!("unexplained_{i}"), unexplained);
            terms.row(vec![
                name.into(),
                peak.into(),
                at.get(Category::Parameters).into(),
                at.get(Category::Gradients).into(),
                at.get(Category::OptimizerState).into(),
                at.get(Category::Activations).into(),
                at.get(Category::Inputs).into(),
                step.ledger_bytes.into(),
                unexplained.into(),
            ]);
        }
        ctx.metric("runs", variants.len() as f64);
        for (k, pr) in Predictor::ALL.iter().enumerate() {
            ctx.metric(format!("worst_{}", pr.id()), worst[k]);
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
