//! The accumulation cell: gradient accumulation over micro-batches, shown to
//! give the full batch's gradients, and measured against the full batch.
//!
//! The technique is the toolkit's `candle_accumulate::GradAccumulator`: each
//! micro-batch's mean loss enters with weight `rows / batch`, so an uneven
//! last micro-batch still gives the batch's gradients. The cell also
//! measures a whole training step with candle's AdamW against the toolkit's
//! in-place `candle_lean_optim::LeanAdamW`.
//!
//! Accumulation does not always save memory. It keeps one gradient per
//! parameter across micro-batches, and while a micro-batch's own gradients
//! are being added there are two. It saves the activations of the batch it
//! no longer runs at once. When activations are small beside the parameters
//! (a small batch), it costs more than it saves; the cell measures both sides
//! of that crossover.
#![warn(missing_docs)]

// The experiment names this crate by its name, as a notebook cell does.
extern crate self as workbook_accumulation;

mod experiment;

pub use experiment::{
    accumulate, accumulate_candle, accumulation_experiment, batch_of, candle_nn_path, lean_step,
    rebind, training_step,
};

use serde::{Deserialize, Serialize};
use workbook_sdk::anyhow;
use workbook_sdk::metric::MetricSpec;
use workbook_sdk::{Context, NotebookSource, Plugin, Rules, Violation};

/// Parameters of the accumulation cell.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Params {
    /// Widths of the notebook's model, input to output (features).
    pub widths: Vec<usize>,
    /// The notebook's batch (rows).
    pub batch: usize,
    /// The notebook's micro-batch (rows; the last may be smaller).
    pub micro_batch: usize,
    /// AdamW's learning rate.
    pub lr: f64,
    /// Seed of weights and data.
    pub seed: u64,
    /// Width of the sweep's model, where activations can dominate (features).
    pub sweep_width: usize,
    /// Depth (Linear + ReLU blocks) of the sweep's model.
    #[schemars(range(min = 1))]
    pub sweep_depth: usize,
    /// A batch small enough that accumulation costs memory (rows).
    pub small_batch: usize,
    /// A batch large enough that accumulation saves memory (rows).
    pub large_batch: usize,
    /// Micro-batch counts swept on the large batch (1 = the full batch).
    pub steps: Vec<usize>,
    /// The micro-batch count compared on both batches.
    pub compare_steps: usize,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            widths: vec![64, 128, 2],
            batch: 32,
            micro_batch: 8,
            lr: 1e-2,
            seed: 47,
            sweep_width: 1024,
            sweep_depth: 8,
            small_batch: 256,
            large_batch: 2048,
            steps: vec![1, 2, 4, 8, 16],
            compare_steps: 4,
        }
    }
}

/// The accumulation plugin.
#[derive(Debug, Default, Clone, Copy)]
pub struct Accumulation;

impl Plugin for Accumulation {
    type Params = Params;

    fn name(&self) -> &str {
        "accumulation"
    }

    fn description(&self) -> &str {
        "gradient accumulation: equal gradients, and peak memory per micro-batch size"
    }

    fn validate(&self, p: &Params) -> Vec<Violation> {
        let mut r = Rules::new();
        r.widths("widths", &p.widths, p.batch)
            .at_least("batch", p.batch, 1)
            .between("micro_batch", p.micro_batch, 1, p.batch.max(1))
            .positive("lr", p.lr)
            .at_least("sweep_width", p.sweep_width, 1)
            .at_least("sweep_depth", p.sweep_depth, 1)
            .at_least("small_batch", p.small_batch, 1)
            .at_least("large_batch", p.large_batch, 1)
            .list("steps", &p.steps, 1, 1)
            .between(
                "compare_steps",
                p.compare_steps,
                1,
                p.small_batch.min(p.large_batch).max(1),
            );
        for (i, &s) in p.steps.iter().enumerate() {
            r.between(&format!("steps[{i}]"), s, 1, p.large_batch.max(1));
        }
        let width = p.sweep_width as u64;
        r.elements("sweep_width", "sweep_width × sweep_width", &[width, width])
            .elements(
                "large_batch",
                "large_batch × sweep_width",
                &[p.large_batch as u64, width],
            )
            .elements(
                "small_batch",
                "small_batch × sweep_width",
                &[p.small_batch as u64, width],
            );
        r.into_violations()
    }

    fn memory_floor(&self, p: &Params) -> Option<(u64, String)> {
        // The full large batch keeps every block's output of the stack.
        workbook_sdk::rules::f32_outputs_floor(
            "the full batch keeps",
            p.sweep_depth,
            p.large_batch,
            p.sweep_width,
        )
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        let mut specs = vec![
            MetricSpec::count(
                "micro_batches",
                "micro-batches the notebook's batch is split into",
            ),
            MetricSpec::number("loss", "mean cross-entropy loss of the last micro-batch"),
            MetricSpec::number(
                "grad_max_abs_diff",
                "largest difference of accumulated and full-batch gradients, element by element",
            ),
            MetricSpec::number(
                "param_max_abs_diff_after_step",
                "largest parameter difference after one AdamW step from each gradient set",
            ),
            MetricSpec::number("lr", "AdamW's learning rate (the `lr` parameter)"),
            MetricSpec::number(
                "lean_path_grad_max_abs_diff",
                "largest gradient difference, lean path against candle-nn's, whole and split",
            ),
            MetricSpec::bytes(
                "peak_full_large_candle",
                "forward and backward peak on candle-nn's layers and backward, large batch whole",
            ),
            MetricSpec::bytes(
                "peak_accum_large_candle",
                "peak on candle-nn's layers and backward, large batch in compare_steps micro-batches",
            ),
            MetricSpec::number(
                "fused_step_max_abs_diff",
                "largest weight difference after two LeanAdamW steps, fused layers against not",
            ),
        ];
        // The step's optimizers, in the order they are reported.
        for (key, what) in [
            ("candle", "candle_nn::AdamW"),
            ("lean", "LeanAdamW"),
            ("fused", "LeanAdamW on fused layers"),
        ] {
            specs.extend([
                MetricSpec::bytes(
                    format!("step_peak_{key}"),
                    format!("peak of a training step, parameters and moments included, {what}"),
                ),
                MetricSpec::ratio(
                    format!("step_ratio_{key}"),
                    format!("step_peak_{key} over step_analytic_{key}, {what}"),
                ),
                MetricSpec::bytes(
                    format!("step_optimizer_peak_{key}"),
                    format!("peak of optimizer-state allocations in a training step, {what}"),
                ),
                MetricSpec::bytes(
                    format!("step_analytic_{key}"),
                    format!(
                        "analytic minimum of a step: 4 × parameter bytes + activation peak, {what}"
                    ),
                ),
            ]);
        }
        specs.extend([
            MetricSpec::number(
                "lean_adamw_max_abs_diff",
                "largest weight difference after two steps, LeanAdamW against candle_nn::AdamW",
            ),
            MetricSpec::bytes(
                "peak_full_small",
                "peak of forward and backward on the lean path, small batch whole",
            ),
            MetricSpec::bytes(
                "peak_accum_small",
                "peak of forward and backward on the lean path, small batch in compare_steps micro-batches",
            ),
            MetricSpec::bytes(
                "peak_full_large",
                "peak of forward and backward on the lean path, large batch whole",
            ),
            MetricSpec::bytes(
                "peak_accum_large",
                "peak of forward and backward on the lean path, large batch in compare_steps micro-batches",
            ),
            MetricSpec::bytes(
                "gradient_bytes",
                "bytes of one f32 gradient per parameter of the sweep's model",
            ),
            MetricSpec::bytes(
                "peak_adamw_step",
                "peak of one candle_nn::AdamW step on the sweep's model",
            ),
            MetricSpec::ratio(
                "adamw_step_in_weights",
                "peak_adamw_step over the bytes of one sweep_width² f32 weight",
            ),
        ]);
        specs
    }

    fn notebook(&self) -> Option<NotebookSource> {
        Some(workbook_sdk::notebook_source! {
            plugin: "workbook_accumulation::Accumulation",
            entry: "accumulation_experiment",
            params: "AccumulationParams",
            source: "experiment.rs",
            parts: ["experiment/large_batch.rs"],
        })
    }

    fn run(&self, ctx: &mut Context, p: Params) -> anyhow::Result<()> {
        experiment::accumulation_experiment(ctx, p)
    }
}
