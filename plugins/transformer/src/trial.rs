//! The `predictors` cell: each predictor's figure against the measured
//! peak of a real training step, over sweeps of the model's sizes.

use serde::{Deserialize, Serialize};
use workbook_sdk::metric::MetricSpec;
use workbook_sdk::{anyhow, Context, NotebookSource, Plugin, Rules, Violation};

use crate::predict::Predictor;
use crate::training::{check_run, step_floor};
use workbook_models::{GptConfig, Recipe, StepFields};

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

impl Params {
    /// The model of run `v`: the base with its sizes changed.
    fn variant_model(&self, v: &Variant) -> GptConfig {
        GptConfig {
            layers: v.layers.unwrap_or(self.model.layers),
            hidden: v.hidden.unwrap_or(self.model.hidden),
            seq: v.seq.unwrap_or(self.model.seq),
            ..self.model
        }
    }
}

/// The `predictors` plugin.
#[derive(Debug, Default, Clone, Copy)]
pub struct Predictors;

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
        let scores = p.recipe.apply(p.model).holds_scores();
        check_run(&mut r, &p.model, (p.batch, 3), &p.dtype, scores);
        if p.recipe.direct() {
            r.violation(
                "recipe",
                format!("{:?}", p.recipe.name()),
                "allowed: candle, lean, tiled (the ledger's predictor reads the graph a backward \
                     keeps; the direct recipes keep none)",
            );
        }
        for (i, v) in p.variants.iter().enumerate() {
            let c = p.variant_model(v);
            c.check(&mut r, &format!("variants[{i}]"));
            if let Some(b) = v.batch {
                r.at_least(&format!("variants[{i}].batch"), b, 3);
            }
            // A variant that changes no size is the base, checked above.
            if v.layers.is_some() || v.hidden.is_some() || v.seq.is_some() || v.batch.is_some() {
                let (model, hidden) = (format!("variants[{i}]"), format!("variants[{i}].hidden"));
                let batch = match v.batch {
                    Some(_) => format!("variants[{i}].batch"),
                    None => "batch".to_string(),
                };
                let fields = StepFields {
                    model: &model,
                    // The vocabulary is the base's: the variant's hidden
                    // size is what it changes.
                    table: &hidden,
                    batch: &batch,
                };
                c.check_step(&mut r, fields, v.batch.unwrap_or(p.batch), scores);
            }
            if let Some(d) = &v.dtype {
                r.one_of(&format!("variants[{i}].dtype"), d, &workbook_sdk::DTYPES);
            }
        }
        r.into_violations()
    }

    fn memory_floor(&self, p: &Params) -> Option<(u64, String)> {
        // The largest of the runs, each of which the cell trains in turn.
        let variants = p.variants.iter().map(|v| {
            let dtype = v.dtype.as_deref().unwrap_or(&p.dtype);
            step_floor(&p.variant_model(v), v.batch.unwrap_or(p.batch), dtype)
        });
        std::iter::once(step_floor(&p.model, p.batch, &p.dtype))
            .chain(variants)
            .collect::<Option<Vec<_>>>()?
            .into_iter()
            .max_by_key(|(bytes, _)| *bytes)
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

    fn notebook(&self) -> Option<NotebookSource> {
        Some(workbook_sdk::notebook_source! {
            plugin: "workbook_transformer::Predictors",
            entry: "predictors_experiment",
            params: "PredictorsParams",
            source: "experiment/predictors.rs",
        })
    }

    fn run(&self, ctx: &mut Context, p: Params) -> anyhow::Result<()> {
        crate::experiment::predictors::predictors_experiment(ctx, p)
    }
}
