//! The `gpt_training` cell: the model counts the parameters the formula
//! says, and it learns.

use serde::{Deserialize, Serialize};
use workbook_sdk::metric::MetricSpec;
use workbook_sdk::{anyhow, Context, NotebookSource, Plugin, Rules, Violation};

use workbook_models::{AttentionKind, GptConfig, Recipe, StepFields};

/// Parameters of the `gpt_training` cell.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Params {
    /// The model (its `attention` and `lean` set by `recipe`).
    pub model: GptConfig,
    /// How its step is computed: `direct_tiled` and `direct` with no graph
    /// (each stage's backward called directly, PyTorch's saved tensors),
    /// `tiled` and `lean` through candle's graph on the toolkit's layers,
    /// `candle` on candle-nn's.
    pub recipe: Recipe,
    /// Sequences per batch.
    pub batch: usize,
    /// Training steps.
    pub steps: usize,
    /// AdamW's learning rate.
    pub lr: f64,
    /// The parameters' dtype: `f32`, `f16` or `bf16`.
    pub dtype: String,
    /// Seed of weights and data.
    pub seed: u64,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            model: GptConfig {
                layers: 2,
                hidden: 64,
                seq: 32,
                vocab: 64,
                attention: AttentionKind::Tiled,
                ..GptConfig::default()
            },
            recipe: Recipe::DirectTiled,
            batch: 16,
            steps: 60,
            lr: 3e-3,
            dtype: "f32".into(),
            seed: 3,
        }
    }
}

/// Checks what every cell of this crate takes: the model, a batch of at
/// least `least` sequences, a dtype by name, and a step whose tensors can
/// be allocated at all (with every head's scores held when `scores`: an
/// attention that is not tiled).
pub(crate) fn check_run(
    r: &mut Rules,
    model: &GptConfig,
    (batch, least): (usize, usize),
    dtype: &str,
    scores: bool,
) {
    model.check(r, "model");
    r.at_least("batch", batch, least);
    r.one_of("dtype", dtype, &workbook_sdk::DTYPES);
    model.check_step(r, StepFields::MODEL, batch, scores);
}

/// The least a step of `model` on `batch` sequences holds in `dtype`, for
/// the runner's pre-flight against the memory it may use: the weights and
/// one batch's logits. `None` for a dtype that is not one (validation
/// refuses it).
pub(crate) fn step_floor(model: &GptConfig, batch: usize, dtype: &str) -> Option<(u64, String)> {
    let size = workbook_sdk::parse_dtype(dtype).ok()?.size_in_bytes() as u64;
    // Saturating: a count past u64 is still more than any machine has.
    let psi = model.param_count();
    let logits = (batch as u64)
        .saturating_mul(model.seq as u64)
        .saturating_mul(model.vocab as u64);
    Some((
        psi.saturating_add(logits).saturating_mul(size),
        format!(
            "the {psi} weights and the {batch} × {} × {} logits of a step, {size} bytes each",
            model.seq, model.vocab
        ),
    ))
}

/// The `gpt_training` plugin.
#[derive(Debug, Default, Clone, Copy)]
pub struct GptTraining;

impl Plugin for GptTraining {
    type Params = Params;

    fn name(&self) -> &str {
        "gpt_training"
    }

    fn description(&self) -> &str {
        "a GPT-style decoder: its parameter count against the formula, and its loss as it trains"
    }

    fn validate(&self, p: &Params) -> Vec<Violation> {
        let mut r = Rules::new();
        let scores = p.recipe.apply(p.model).holds_scores();
        check_run(&mut r, &p.model, (p.batch, 1), &p.dtype, scores);
        r.at_least("steps", p.steps, 2);
        r.positive("lr", p.lr);
        r.into_violations()
    }

    fn memory_floor(&self, p: &Params) -> Option<(u64, String)> {
        step_floor(&p.model, p.batch, &p.dtype)
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        vec![
            MetricSpec::count(
                "params_counted",
                "parameters, counted from the model's variables",
            ),
            MetricSpec::count(
                "params_formula",
                "parameters by the formula h·v + s·h + L·(12h² + 13h) + 2h (with an untied \
                 head, h·v more)",
            ),
            MetricSpec::number("loss_first", "the loss of the first step"),
            MetricSpec::number("loss_last", "the mean loss of the last five steps"),
            MetricSpec::number("loss_uniform", "ln(vocab): the loss of a uniform guess"),
            MetricSpec::seconds("step_seconds", "median wall time of a training step"),
        ]
    }

    fn notebook(&self) -> Option<NotebookSource> {
        Some(workbook_sdk::notebook_source! {
            plugin: "workbook_transformer::GptTraining",
            entry: "gpt_training_experiment",
            params: "GptTrainingParams",
            source: "experiment/training.rs",
        })
    }

    fn run(&self, ctx: &mut Context, p: Params) -> anyhow::Result<()> {
        crate::experiment::training::gpt_training_experiment(ctx, p)
    }
}
