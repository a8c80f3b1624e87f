//! The `layer_profile` cell: memory and time per layer and per part of the
//! GPT, and its biggest consumers named.

use serde::{Deserialize, Serialize};
use workbook_sdk::metric::MetricSpec;
use workbook_sdk::{anyhow, Context, NotebookSource, Plugin, Rules, Violation};

use crate::training::{check_run, step_floor};
use workbook_models::{GptConfig, Recipe};

/// Parameters of the `layer_profile` cell.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Params {
    /// The model (its `attention` and `lean` set by `recipe`).
    pub model: GptConfig,
    /// How the layers are computed.
    pub recipe: Recipe,
    /// Sequences per batch (b).
    pub batch: usize,
    /// The dtype of parameters and activations: `f32`, `f16` or `bf16`.
    pub dtype: String,
    /// Timed forwards; each part's time is the median.
    pub repeats: usize,
    /// Seed of weights and data.
    pub seed: u64,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            model: GptConfig::default(),
            recipe: Recipe::Lean,
            batch: 4,
            dtype: "f32".into(),
            repeats: 5,
            seed: 13,
        }
    }
}

/// The parts of the model, in forward order, as the model labels them.
pub const PARTS: [&str; 14] = [
    "embedding",
    "ln1",
    "qkv",
    "attention",
    "proj",
    "residual",
    "ln2",
    "fc+gelu",
    "fc",
    "gelu",
    "fc2",
    "ln_f",
    "head",
    "loss",
];

/// A part's name as a metric name (`fc+gelu` -> `fc_gelu`).
pub fn metric_name(part: &str) -> String {
    part.replace('+', "_")
}

/// The `layer_profile` plugin.
#[derive(Debug, Default, Clone, Copy)]
pub struct LayerProfile;

impl Plugin for LayerProfile {
    type Params = Params;

    fn name(&self) -> &str {
        "layer_profile"
    }

    fn description(&self) -> &str {
        "a GPT's memory held for the backward and forward time, per layer and per part"
    }

    fn validate(&self, p: &Params) -> Vec<Violation> {
        let mut r = Rules::new();
        let scores = p.recipe.apply(p.model).holds_scores();
        check_run(&mut r, &p.model, (p.batch, 1), &p.dtype, scores);
        r.at_least("repeats", p.repeats, 1);
        if p.recipe.direct() {
            r.violation(
                "recipe",
                format!("{:?}", p.recipe.name()),
                "allowed: candle, lean, tiled (this cell walks the graph a backward keeps; the \
                 direct recipes keep none)",
            );
        }
        r.into_violations()
    }

    fn memory_floor(&self, p: &Params) -> Option<(u64, String)> {
        step_floor(&p.model, p.batch, &p.dtype)
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        vec![
            MetricSpec::ratio(
                "bytes_share_{part}",
                "the part's share of the bytes held for the backward, over all layers \
                 (parts: embedding, ln1, qkv, attention, proj, residual, ln2, fc_gelu, fc2, \
                 ln_f, head, loss)",
            ),
            MetricSpec::ratio(
                "time_share_{part}",
                "the part's share of the forward's time, over all layers",
            ),
            MetricSpec::bytes("bytes_{part}", "bytes the part holds, over all layers"),
            MetricSpec::bytes("held", "bytes the graph holds at the end of the forward"),
            MetricSpec::bytes("block_bytes_{layer}", "bytes block `layer` holds"),
            MetricSpec::ratio(
                "blocks_share",
                "the blocks' share of the bytes held (the rest: embeddings, final norm, head, loss)",
            ),
            MetricSpec::ratio("biggest_share", "the biggest consumer's share of the bytes held"),
            MetricSpec::seconds("forward_seconds", "the forward's time, the parts' medians summed"),
        ]
    }

    fn notebook(&self) -> Option<NotebookSource> {
        Some(workbook_sdk::notebook_source! {
            plugin: "workbook_transformer::LayerProfile",
            entry: "layer_profile_experiment",
            params: "LayerProfileParams",
            source: "experiment/profile.rs",
        })
    }

    fn run(&self, ctx: &mut Context, p: Params) -> anyhow::Result<()> {
        crate::experiment::profile::layer_profile_experiment(ctx, p)
    }
}
