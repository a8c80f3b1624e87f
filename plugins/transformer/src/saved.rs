//! The `saved_tensors` cell: what the graph holds for the backward, part
//! by part, beside Korthikanti et al.'s terms.

use serde::{Deserialize, Serialize};
use workbook_sdk::metric::MetricSpec;
use workbook_sdk::{anyhow, Context, NotebookSource, Plugin, Rules, Violation};

use crate::training::{check_run, step_floor};
use workbook_models::{GptConfig, Recipe};

/// Parameters of the `saved_tensors` cell.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Params {
    /// The model (its `attention` and `lean` are set by each recipe).
    pub model: GptConfig,
    /// Sequences per batch (b).
    pub batch: usize,
    /// The dtype of parameters and activations: `f32`, `f16` or `bf16`.
    pub dtype: String,
    /// The ways of computing the layers to compare.
    pub recipes: Vec<Recipe>,
    /// Seed of weights and data.
    pub seed: u64,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            model: GptConfig::default(),
            batch: 4,
            dtype: "f32".into(),
            recipes: vec![Recipe::Candle, Recipe::Lean, Recipe::Tiled],
            seed: 5,
        }
    }
}

/// The `saved_tensors` plugin.
#[derive(Debug, Default, Clone, Copy)]
pub struct SavedTensors;

impl Plugin for SavedTensors {
    type Params = Params;

    fn name(&self) -> &str {
        "saved_tensors"
    }

    fn description(&self) -> &str {
        "every tensor a GPT holds for the backward (its graph's, or a direct recipe's saved \
         ones), per part, beside Korthikanti's terms"
    }

    fn validate(&self, p: &Params) -> Vec<Violation> {
        let mut r = Rules::new();
        let scores = p
            .recipes
            .iter()
            .any(|recipe| recipe.apply(p.model).holds_scores());
        check_run(&mut r, &p.model, (p.batch, 1), &p.dtype, scores);
        if p.recipes.is_empty() {
            let names: Vec<&str> = Recipe::ALL.iter().map(|r| r.name()).collect();
            r.violation(
                "recipes",
                "[]",
                format!("allowed: a list of at least 1 of {}", names.join(", ")),
            );
        }
        r.into_violations()
    }

    fn memory_floor(&self, p: &Params) -> Option<(u64, String)> {
        step_floor(&p.model, p.batch, &p.dtype)
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        vec![
            MetricSpec::bytes(
                "ledger_{recipe}",
                "bytes held for the backward at the end of the forward, from the ledger (the \
                 graph's; a direct recipe's stages' saved tensors), per recipe",
            ),
            MetricSpec::bytes(
                "measured_{recipe}",
                "activation bytes live at the end of the forward, counted by the allocator",
            ),
            MetricSpec::ratio(
                "coverage_{recipe}",
                "ledger bytes over the allocator's activation bytes at the end of the forward",
            ),
            MetricSpec::number(
                "linear_units_{recipe}",
                "one block's held bytes without the s x s matrices over s·b·h·e/2 (Korthikanti: 34; 32 without dropout)",
            ),
            MetricSpec::number(
                "quadratic_units_{recipe}",
                "one block's s x s matrices over a·s²·b·e/2 (Korthikanti: 5; 2 without dropout)",
            ),
            MetricSpec::count("tensors_{recipe}", "storages one block holds"),
            MetricSpec::bytes("korthikanti_layer", "s·b·h·(34 + 5·a·s/h) scaled to the dtype"),
            MetricSpec::bytes("block_{recipe}", "bytes one block holds, from the ledger"),
        ]
    }

    fn notebook(&self) -> Option<NotebookSource> {
        Some(workbook_sdk::notebook_source! {
            plugin: "workbook_transformer::SavedTensors",
            entry: "saved_tensors_experiment",
            params: "SavedTensorsParams",
            source: "experiment/saved.rs",
        })
    }

    fn run(&self, ctx: &mut Context, p: Params) -> anyhow::Result<()> {
        crate::experiment::saved::saved_tensors_experiment(ctx, p)
    }
}
