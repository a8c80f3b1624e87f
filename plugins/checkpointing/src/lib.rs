//! The checkpointing cell: activation checkpointing (recomputation) for
//! candle, proven equal to plain backprop and measured.
//!
//! The technique is `candle_checkpoint::Sequential` from the
//! toolkit; this cell is its experiment. With `n` layers in `sqrt(n)`
//! segments, `O(sqrt(n))` activations for one extra forward (Chen et al.,
//! 2016).
#![warn(missing_docs)]

// The experiment names this crate by its name, as a notebook cell does.
extern crate self as workbook_checkpointing;

mod experiment;

pub use experiment::{
    checkpointing_experiment, heavy, measure_backprop, policies, policy_list, run_segment, sweep,
    Backprop, Heavy,
};

use serde::{Deserialize, Serialize};
use workbook_sdk::anyhow;
use workbook_sdk::metric::MetricSpec;
use workbook_sdk::{Context, NotebookSource, Plugin, Rules, Violation};

/// Parameters of the checkpointing cell.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Params {
    /// Width of the notebook's block (features).
    pub width: usize,
    /// The notebook's batch (rows).
    pub batch: usize,
    /// The notebook's classes.
    #[schemars(range(min = 2))]
    pub classes: usize,
    /// Seed of weights and data.
    pub seed: u64,
    /// Width of the deep stack (features).
    pub stack_width: usize,
    /// Depth (Linear + GELU blocks) of the deep stack.
    pub stack_depth: usize,
    /// Batch of the deep stack (rows).
    pub stack_batch: usize,
    /// Segment counts swept.
    pub segments: Vec<usize>,
    /// Timed repetitions of each variant (the median is reported).
    #[schemars(range(min = 1))]
    pub repeats: usize,
    /// Turns of plain backprop, the checkpointed backward and the forward
    /// alone timed for the recomputation's cost (the medians are reported).
    #[schemars(range(min = 1))]
    pub overhead_repeats: usize,
    /// Calls of the heavy function.
    pub heavy_calls: usize,
    /// Additions inside one call of the heavy function.
    pub heavy_adds: usize,
    /// Width of the transformer the selective policies are measured on (features).
    pub policy_width: usize,
    /// Blocks of the policies' transformer.
    #[schemars(range(min = 1))]
    pub policy_depth: usize,
    /// Attention heads of the policies' transformer (a divisor of `policy_width`).
    pub policy_heads: usize,
    /// Sequence length of the policies' transformer (tokens).
    pub policy_seq: usize,
    /// Batch of the policies' transformer (sequences).
    pub policy_batch: usize,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            width: 64,
            batch: 16,
            classes: 2,
            seed: 47,
            stack_width: 1024,
            stack_depth: 16,
            stack_batch: 1024,
            segments: vec![1, 2, 4, 8, 16],
            repeats: 3,
            overhead_repeats: 5,
            heavy_calls: 1000,
            heavy_adds: 100,
            policy_width: 256,
            policy_depth: 4,
            policy_heads: 4,
            policy_seq: 256,
            policy_batch: 4,
        }
    }
}

/// The checkpointing plugin.
#[derive(Debug, Default, Clone, Copy)]
pub struct Checkpointing;

impl Plugin for Checkpointing {
    type Params = Params;

    fn name(&self) -> &str {
        "checkpointing"
    }

    fn description(&self) -> &str {
        "activation checkpointing: equal gradients, peak per segment count, time overhead"
    }

    fn validate(&self, p: &Params) -> Vec<Violation> {
        let mut r = Rules::new();
        r.at_least("width", p.width, 1)
            .at_least("batch", p.batch, 1)
            // Labels are drawn as u32.
            .between("classes", p.classes, 2, u32::MAX as usize)
            .at_least("stack_width", p.stack_width, 1)
            .at_least("stack_depth", p.stack_depth, 1)
            .at_least("stack_batch", p.stack_batch, 1)
            .list("segments", &p.segments, 1, 1)
            .at_least("repeats", p.repeats, 1)
            .at_least("overhead_repeats", p.overhead_repeats, 1)
            .at_least("heavy_calls", p.heavy_calls, 1)
            .at_least("heavy_adds", p.heavy_adds, 1)
            .at_least("policy_width", p.policy_width, 1)
            .at_least("policy_depth", p.policy_depth, 1)
            .between("policy_heads", p.policy_heads, 1, p.policy_width.max(1))
            .require(
                p.policy_heads == 0 || p.policy_width.is_multiple_of(p.policy_heads),
                "policy_heads",
                format!("{} with policy_width = {}", p.policy_heads, p.policy_width),
                "allowed: a divisor of policy_width",
            )
            .at_least("policy_seq", p.policy_seq, 1)
            .at_least("policy_batch", p.policy_batch, 1);
        // The stack is stack_depth blocks of Linear + GELU: 2 × stack_depth
        // modules to cut into segments.
        let modules = p.stack_depth.saturating_mul(2);
        for (i, &s) in p.segments.iter().enumerate() {
            if s > modules {
                r.violation(
                    format!("segments[{i}]"),
                    s.to_string(),
                    format!(
                        "allowed: at most the {modules} modules of the stack (2 × stack_depth)"
                    ),
                );
            }
        }
        let (w, sw) = (p.width as u64, p.stack_width as u64);
        r.elements("width", "width × width", &[w, w])
            .elements("batch", "batch × width", &[p.batch as u64, w])
            .elements("classes", "width × classes", &[w, p.classes as u64])
            .elements(
                "batch",
                "batch × classes",
                &[p.batch as u64, p.classes as u64],
            )
            .elements("stack_width", "stack_width × stack_width", &[sw, sw])
            .elements(
                "stack_batch",
                "stack_depth × stack_batch × stack_width",
                &[p.stack_depth as u64, p.stack_batch as u64, sw],
            )
            .elements(
                "heavy_calls",
                "heavy_calls × heavy_adds",
                &[p.heavy_calls as u64, p.heavy_adds as u64],
            )
            .elements(
                "policy_seq",
                "policy_batch × policy_heads × policy_seq × policy_seq",
                &[
                    p.policy_batch as u64,
                    p.policy_heads as u64,
                    p.policy_seq as u64,
                    p.policy_seq as u64,
                ],
            );
        r.into_violations()
    }

    fn memory_floor(&self, p: &Params) -> Option<(u64, String)> {
        // Plain backprop keeps every block's output of the stack.
        workbook_sdk::rules::f32_outputs_floor(
            "the plain stack keeps",
            p.stack_depth,
            p.stack_batch,
            p.stack_width,
        )
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        let mut specs = vec![
            MetricSpec::number("loss", "loss of the notebook's checkpointed block and head"),
            MetricSpec::number(
                "input_grad_present",
                "1 if plain backprop gives the block's input a gradient, else 0",
            ),
            MetricSpec::number(
                "input_grad_max_abs_diff",
                "largest input-gradient difference, checkpointed block against plain",
            ),
            MetricSpec::number(
                "block_grad_max_abs_diff",
                "largest parameter-gradient difference, checkpointed block against plain",
            ),
            MetricSpec::bytes(
                "peak_plain_candle",
                "peak of plain backprop on the deep stack, candle-nn's layers and candle's backward",
            ),
            MetricSpec::bytes(
                "activation_peak_plain_candle",
                "activations at their peak, candle-nn's layers and candle's backward",
            ),
            MetricSpec::bytes(
                "gradient_peak_plain_candle",
                "gradients at their peak, candle-nn's layers and candle's backward",
            ),
            MetricSpec::seconds(
                "time_plain_candle",
                "median time of plain backprop, candle-nn's layers and candle's backward",
            ),
            MetricSpec::bytes(
                "peak_plain_fused",
                "peak of plain backprop on the fused layers and candle's backward",
            ),
            MetricSpec::bytes(
                "activation_peak_plain_fused",
                "activations at their peak, fused layers and candle's backward",
            ),
            MetricSpec::bytes(
                "gradient_peak_plain_fused",
                "gradients at their peak, fused layers and candle's backward",
            ),
            MetricSpec::number(
                "fused_grad_max_abs_diff",
                "largest gradient difference, fused layers against candle-nn's",
            ),
            MetricSpec::bytes(
                "peak_plain_layered",
                "peak of plain backprop on the fused layers under the lean backward",
            ),
            MetricSpec::bytes(
                "activation_peak_plain_layered",
                "activations at their peak, fused layers under the lean backward",
            ),
            MetricSpec::bytes(
                "gradient_peak_plain_layered",
                "gradients at their peak, fused layers under the lean backward",
            ),
            MetricSpec::number(
                "layered_grad_max_abs_diff",
                "largest gradient difference, the lean backward against candle-nn's",
            ),
            MetricSpec::bytes(
                "peak_plain",
                "peak of plain backprop on the lean path (fused layers, direct backward)",
            ),
            MetricSpec::bytes(
                "activation_peak_plain",
                "activations at their peak, plain backprop on the lean path",
            ),
            MetricSpec::bytes(
                "gradient_peak_plain",
                "gradients at their peak, plain backprop on the lean path",
            ),
            MetricSpec::seconds(
                "time_plain",
                "median time of plain backprop on the lean path",
            ),
            MetricSpec::number(
                "lean_grad_max_abs_diff",
                "largest gradient difference, the lean path against candle-nn's",
            ),
            MetricSpec::bytes(
                "peak_best",
                "lowest checkpointed peak of the segment sweep (lean path)",
            ),
            MetricSpec::count("best_segments", "segment count with the lowest peak"),
            MetricSpec::bytes(
                "activation_peak_best",
                "lowest activations at their peak of the segment sweep",
            ),
            MetricSpec::count(
                "best_activation_segments",
                "segment count with the lowest activations at their peak",
            ),
            MetricSpec::number(
                "sqrt_layers",
                "square root of the fused layers (stack_depth) cut into segments",
            ),
            MetricSpec::number(
                "stack_grad_max_abs_diff",
                "largest gradient difference of the checkpointed stack and plain, over the sweep",
            ),
            MetricSpec::seconds(
                "time_best",
                "median time of the segment count with the lowest peak",
            ),
            MetricSpec::ratio("time_overhead", "time_best over time_plain"),
            MetricSpec::ratio(
                "recompute_time_ratio",
                "checkpointed time over plain backprop's at the best segment count, median of \
                 turns taken in turn (CPU time on a CPU, wall time on a GPU)",
            ),
            MetricSpec::number(
                "extra_forwards",
                "time checkpointing adds at the best segment count, in forward passes, median of turns",
            ),
            MetricSpec::number(
                "backward_forwards",
                "plain backprop's time less one forward's, in forward passes, median of turns",
            ),
            MetricSpec::count("heavy_ops", "additions of the heavy function, calls × adds"),
            MetricSpec::number(
                "heavy_blocks_per_tensor",
                "heap blocks one tensor made by an addition occupies, measured",
            ),
            MetricSpec::count(
                "heavy_live_tensors_plain",
                "tensors live at the peak, heavy function without checkpointing",
            ),
            MetricSpec::count(
                "heavy_live_tensors_checkpointed",
                "tensors live at the peak, heavy function checkpointed a call per segment",
            ),
            MetricSpec::count(
                "heavy_expected_checkpointed",
                "segment inputs plus one segment's intermediates: heavy_calls + heavy_adds",
            ),
            MetricSpec::number(
                "heavy_grad_abs_diff",
                "gradient difference, checkpointed heavy function against plain",
            ),
        ];
        // The policies, in the order they are measured.
        for (key, what) in [
            ("plain", "plain backprop"),
            ("nothing", "keeping nothing (nothing_saveable)"),
            ("dots", "keeping every product (dots_saveable)"),
            ("names", "keeping the linear layers' products"),
        ] {
            specs.extend([
                MetricSpec::bytes(
                    format!("policy_peak_{key}"),
                    format!("peak of the transformer's forward and backward, {what}"),
                ),
                MetricSpec::bytes(
                    format!("policy_activations_{key}"),
                    format!("activations at their peak in the transformer, {what}"),
                ),
                MetricSpec::seconds(
                    format!("policy_time_{key}"),
                    format!("median time of the transformer's forward and backward, {what}"),
                ),
            ]);
        }
        specs.push(MetricSpec::number(
            "policy_grad_max_abs_diff",
            "largest gradient difference of a policy against plain backprop, worst policy",
        ));
        specs
    }

    fn notebook(&self) -> Option<NotebookSource> {
        Some(workbook_sdk::notebook_source! {
            plugin: "workbook_checkpointing::Checkpointing",
            entry: "checkpointing_experiment",
            params: "CheckpointingParams",
            source: "experiment.rs",
            parts: ["experiment/policies.rs"],
        })
    }

    fn run(&self, ctx: &mut Context, p: Params) -> anyhow::Result<()> {
        experiment::checkpointing_experiment(ctx, p)
    }
}
