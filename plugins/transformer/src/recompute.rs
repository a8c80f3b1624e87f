//! The `gpt_checkpointing` cell: what to recompute, chosen by measured
//! bytes per unit of recompute time, against no checkpointing, full
//! checkpointing and checkpoints every k blocks.

use serde::{Deserialize, Serialize};
use workbook_sdk::metric::MetricSpec;
use workbook_sdk::{anyhow, Context, NotebookSource, Plugin, Rules, Violation};

use crate::training::{check_run, step_floor};
use workbook_models::GptConfig;

/// Parameters of the `gpt_checkpointing` cell.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Params {
    /// The model; its blocks' products go through a checkpointing tape.
    pub model: GptConfig,
    /// Sequences per batch (b).
    pub batch: usize,
    /// The dtype: `f32`, `f16` or `bf16`.
    pub dtype: String,
    /// Checkpoints every k layers of the stack (embeddings and blocks), for
    /// each k listed.
    pub every: Vec<usize>,
    /// Timed runs of each strategy; times are medians.
    pub repeats: usize,
    /// Seed of weights and data.
    pub seed: u64,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            model: GptConfig::default(),
            batch: 4,
            dtype: "f32".into(),
            every: vec![2],
            repeats: 5,
            seed: 17,
        }
    }
}

/// The `gpt_checkpointing` plugin.
#[derive(Debug, Default, Clone, Copy)]
pub struct GptCheckpointing;

impl Plugin for GptCheckpointing {
    type Params = Params;

    fn name(&self) -> &str {
        "gpt_checkpointing"
    }

    fn description(&self) -> &str {
        "a GPT's backward with no, full, every-k and selective checkpointing (what to recompute chosen from measured bytes and time)"
    }

    fn validate(&self, p: &Params) -> Vec<Violation> {
        let mut r = Rules::new();
        let scores = p.model.holds_scores();
        check_run(&mut r, &p.model, (p.batch, 1), &p.dtype, scores);
        r.at_least("repeats", p.repeats, 1);
        for (i, k) in p.every.iter().enumerate() {
            r.between(&format!("every[{i}]"), *k, 1, p.model.layers + 1);
        }
        r.into_violations()
    }

    fn memory_floor(&self, p: &Params) -> Option<(u64, String)> {
        step_floor(&p.model, p.batch, &p.dtype)
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        vec![
            MetricSpec::bytes("peak_{strategy}", "the backward's peak above the start, per strategy (none, full, every_K, selective, dots)"),
            MetricSpec::seconds("seconds_{strategy}", "median time of forward and backward, per strategy"),
            MetricSpec::number("grad_diff_{strategy}", "largest difference of a gradient from candle's plain backward, per strategy"),
            MetricSpec::count("kept_products", "products the selective policy keeps per block (of 4)"),
            MetricSpec::count("kept_{product}", "1 when the selective policy keeps the product's output (qkv, proj, fc, fc2), else 0"),
            MetricSpec::ratio("cost_{product}", "the product's forward time per byte of output over the four products' average: kept when at least 1"),
        ]
    }

    fn notebook(&self) -> Option<NotebookSource> {
        Some(workbook_sdk::notebook_source! {
            plugin: "workbook_transformer::GptCheckpointing",
            entry: "gpt_checkpointing_experiment",
            params: "GptCheckpointingParams",
            source: "experiment/recompute.rs",
        })
    }

    fn run(&self, ctx: &mut Context, p: Params) -> anyhow::Result<()> {
        crate::experiment::recompute::gpt_checkpointing_experiment(ctx, p)
    }
}
