//! The chapters' exercises: cells the learner completes in the notebook,
//! graded by the chapter's assertions over what the cell measured, as
//! rustlings grades an exercise by its tests.
//!
//! An exercise is an experiment (see `workbook_sdk::notebook`) with a
//! `// notebook cell: exercise` part whose reference solution, between
//! `// solution begin` and `// solution end`, the notebook shows as a
//! `todo!()` for the learner to replace. This crate compiles the reference
//! solution, so `workbook run` (and CI) checks that it passes.
//!
//! - [`PolicyExercise`] (`policy_exercise`): choose which products of a
//!   transformer block selective checkpointing keeps within a byte budget,
//!   recomputing as few multiply-adds as possible; then measured.
//! - [`FitExercise`] (`fit_exercise`): choose the micro-batches and
//!   checkpointed segments that fit a training step into a memory budget
//!   at the least cost, by measuring; graded against every plan measured.
#![warn(missing_docs)]

// The experiments name this crate by its name, as a notebook cell does.
extern crate self as workbook_exercises;

mod fit;
mod policy;

pub use fit::{
    choose_plan, fit_exercise, grade_plan, recomputed_layers, step_with_plan, StepPlan, StepShape,
};
pub use policy::{block_products, choose_kept, grade_choice, policy_exercise, Product};

use serde::{Deserialize, Serialize};
use workbook_sdk::anyhow;
use workbook_sdk::metric::MetricSpec;
use workbook_sdk::{Context, NotebookSource, Plugin, Rules, Violation};

/// The fewest multiply-adds left to recompute by any choice of `products`
/// (each `(bytes, multiply-adds)`) whose bytes add up to at most `budget`:
/// what the policy exercise's choice is graded against. Exhaustive, by
/// taking or leaving each product in turn.
pub fn fewest_recomputed(products: &[(u64, u64)], budget: u64) -> u64 {
    fn most_kept(products: &[(u64, u64)], budget: u64) -> u64 {
        match products.split_first() {
            None => 0,
            Some((&(bytes, macs), rest)) => {
                let leave = most_kept(rest, budget);
                if bytes <= budget {
                    leave.max(macs + most_kept(rest, budget - bytes))
                } else {
                    leave
                }
            }
        }
    }
    let all: u64 = products.iter().map(|&(_, macs)| macs).sum();
    all - most_kept(products, budget)
}

/// Parameters of the policy exercise.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyParams {
    /// Seed of weights and data.
    pub seed: u64,
    /// Width of the transformer (features).
    pub width: usize,
    /// Attention heads (a divisor of `width`).
    pub heads: usize,
    /// Blocks of the transformer.
    #[schemars(range(min = 2))]
    pub depth: usize,
    /// Sequence length (tokens).
    pub seq: usize,
    /// Batch (sequences).
    pub batch: usize,
    /// The bytes a block may keep, as a fraction of what keeping every
    /// product of the block would take.
    #[schemars(range(min = 0.0, max = 1.0))]
    pub budget_fraction: f64,
}

impl Default for PolicyParams {
    fn default() -> Self {
        Self {
            seed: 47,
            width: 256,
            heads: 4,
            depth: 4,
            seq: 256,
            batch: 4,
            budget_fraction: 0.5,
        }
    }
}

/// The policy exercise's plugin.
#[derive(Debug, Default, Clone, Copy)]
pub struct PolicyExercise;

impl Plugin for PolicyExercise {
    type Params = PolicyParams;

    fn name(&self) -> &str {
        "policy_exercise"
    }

    fn description(&self) -> &str {
        "exercise: the products selective checkpointing keeps within a budget, graded and measured"
    }

    fn validate(&self, p: &PolicyParams) -> Vec<Violation> {
        let mut r = Rules::new();
        r.at_least("width", p.width, 1)
            .between("heads", p.heads, 1, p.width.max(1))
            .require(
                p.heads == 0 || p.width.is_multiple_of(p.heads),
                "heads",
                format!("{} with width = {}", p.heads, p.width),
                "allowed: a divisor of width",
            )
            // The forward keeps what the policy saves for all blocks but
            // the last (which runs once, in the backward): two at least, so
            // that the kept bytes are measured.
            .at_least("depth", p.depth, 2)
            .at_least("seq", p.seq, 1)
            .at_least("batch", p.batch, 1)
            .within("budget_fraction", p.budget_fraction, 0.0, 1.0)
            .elements(
                "seq",
                "batch × heads × seq × seq",
                &[p.batch as u64, p.heads as u64, p.seq as u64, p.seq as u64],
            )
            .elements(
                "width",
                "batch × seq × 4 × width × width (the MLP's multiply-adds)",
                &[
                    p.batch as u64,
                    p.seq as u64,
                    4,
                    p.width as u64,
                    p.width as u64,
                ],
            )
            .elements(
                "seq",
                "batch × seq × seq × width (the attention's multiply-adds)",
                &[p.batch as u64, p.seq as u64, p.seq as u64, p.width as u64],
            );
        r.into_violations()
    }

    fn memory_floor(&self, p: &PolicyParams) -> Option<(u64, String)> {
        // Keeping every product holds all but the last block's products at
        // the end of the forward. (Sizes the rules refuse could overflow.)
        if !self.validate(p).is_empty() {
            return None;
        }
        let block: u64 = block_products(p.batch, p.seq, p.width, p.heads)
            .iter()
            .try_fold(0u64, |sum, q| sum.checked_add(q.bytes))?;
        Some((
            block.checked_mul(p.depth.saturating_sub(1) as u64)?,
            format!(
                "keeping every product holds {} blocks' products ({block} bytes each)",
                p.depth.saturating_sub(1)
            ),
        ))
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        vec![
            MetricSpec::bytes(
                "budget_bytes",
                "bytes a block may keep: budget_fraction of all its products",
            ),
            MetricSpec::bytes("kept_bytes", "bytes of the products chosen, per block"),
            MetricSpec::count("kept_products", "products chosen"),
            MetricSpec::count(
                "recomputed_macs",
                "multiply-adds of the products not kept, per block",
            ),
            MetricSpec::count(
                "fewest_recomputed_macs",
                "the fewest multiply-adds any choice within the budget leaves, per block",
            ),
            MetricSpec::bytes(
                "kept_predicted",
                "kept_bytes times the blocks the forward keeps them for (depth - 1)",
            ),
            MetricSpec::bytes(
                "kept_measured",
                "bytes held after the forward, the choice's less keeping nothing's",
            ),
            MetricSpec::bytes(
                "held_{policy}",
                "bytes held after the forward over its start, per policy (nothing, chosen, dots)",
            ),
            MetricSpec::bytes(
                "peak_{policy}",
                "peak of the step over its start, per policy (plain, nothing, chosen, dots)",
            ),
            MetricSpec::number(
                "grad_max_abs_diff",
                "largest parameter-gradient difference, the chosen policy against plain backprop",
            ),
        ]
    }

    fn notebook(&self) -> Option<NotebookSource> {
        Some(workbook_sdk::notebook_source! {
            plugin: "workbook_exercises::PolicyExercise",
            entry: "policy_exercise",
            params: "PolicyExerciseParams",
            source: "policy.rs",
        })
    }

    fn run(&self, ctx: &mut Context, p: PolicyParams) -> anyhow::Result<()> {
        policy::policy_exercise(ctx, p)
    }
}

/// Parameters of the fit exercise.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct FitParams {
    /// Seed of weights and data.
    pub seed: u64,
    /// Width of every layer (features; also the classes).
    pub width: usize,
    /// Layers (Linear + ReLU each).
    pub depth: usize,
    /// Rows of the batch.
    pub batch: usize,
    /// The fewest rows a micro-batch may have.
    pub min_micro_batch: usize,
    /// The budget, as a fraction of the plain step's measured peak (one
    /// micro-batch, one segment).
    #[schemars(range(min = 0.0, max = 1.0))]
    pub budget_fraction: f64,
}

impl Default for FitParams {
    fn default() -> Self {
        Self {
            seed: 53,
            width: 256,
            depth: 16,
            batch: 4096,
            min_micro_batch: 512,
            budget_fraction: 0.18,
        }
    }
}

/// The fit exercise's plugin.
#[derive(Debug, Default, Clone, Copy)]
pub struct FitExercise;

impl Plugin for FitExercise {
    type Params = FitParams;

    fn name(&self) -> &str {
        "fit_exercise"
    }

    fn description(&self) -> &str {
        "exercise: micro-batches and segments that fit a step into a budget, graded by measurement"
    }

    fn validate(&self, p: &FitParams) -> Vec<Violation> {
        let mut r = Rules::new();
        r.at_least("width", p.width, 1)
            .at_least("depth", p.depth, 1)
            .at_least("batch", p.batch, 1)
            .between("min_micro_batch", p.min_micro_batch, 1, p.batch.max(1))
            .within("budget_fraction", p.budget_fraction, 0.0, 1.0)
            .elements(
                "batch",
                "batch × width (a layer's output)",
                &[p.batch as u64, p.width as u64],
            )
            .elements(
                "width",
                "depth × width × width (the weights)",
                &[p.depth as u64, p.width as u64, p.width as u64],
            );
        r.into_violations()
    }

    fn memory_floor(&self, p: &FitParams) -> Option<(u64, String)> {
        if !self.validate(p).is_empty() {
            return None;
        }
        // The plain step, whose peak sets the budget, keeps every layer's
        // output (f32).
        let outputs = (p.depth as u64)
            .checked_mul(p.batch as u64)?
            .checked_mul(p.width as u64)?
            .checked_mul(4)?;
        Some((
            outputs,
            format!(
                "the plain step keeps {} layers' outputs of {} x {} f32",
                p.depth, p.batch, p.width
            ),
        ))
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        vec![
            MetricSpec::bytes(
                "budget_bytes",
                "the budget: budget_fraction of the plain step's measured peak",
            ),
            MetricSpec::count("measurements", "steps your plan measured to choose"),
            MetricSpec::bytes("chosen_peak", "the measured peak of your plan's step"),
            MetricSpec::count(
                "chosen_recomputed_layers",
                "layers whose forward your plan runs twice",
            ),
            MetricSpec::count("chosen_micro_batches", "micro-batches of your plan"),
            MetricSpec::count(
                "cheapest_recomputed_layers",
                "the fewest recomputed layers of any plan that fits, every plan measured",
            ),
            MetricSpec::count(
                "cheapest_micro_batches",
                "the fewest micro-batches of those plans",
            ),
            MetricSpec::number(
                "grad_max_abs_diff",
                "largest parameter-gradient difference, your plan against plain backprop",
            ),
        ]
    }

    fn notebook(&self) -> Option<NotebookSource> {
        Some(workbook_sdk::notebook_source! {
            plugin: "workbook_exercises::FitExercise",
            entry: "fit_exercise",
            params: "FitExerciseParams",
            source: "fit.rs",
        })
    }

    fn run(&self, ctx: &mut Context, p: FitParams) -> anyhow::Result<()> {
        fit::fit_exercise(ctx, p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fewest recomputed by listing every choice, written apart from
    /// [`fewest_recomputed`].
    fn by_listing(products: &[(u64, u64)], budget: u64) -> u64 {
        let all: u64 = products.iter().map(|p| p.1).sum();
        (0u32..1 << products.len())
            .filter_map(|choice| {
                let kept = products
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| choice >> i & 1 == 1);
                let bytes: u64 = kept.clone().map(|(_, p)| p.0).sum();
                (bytes <= budget).then(|| all - kept.map(|(_, p)| p.1).sum::<u64>())
            })
            .min()
            .unwrap_or(all)
    }

    #[test]
    fn the_grader_finds_the_fewest_recomputed() {
        // Chapter 2's block, in units of batch × seq × width (f32 bytes
        // over 4, and multiply-adds over width): qkv, scores, mix, proj,
        // up, down at seq = width and 4 heads.
        let block = [(3, 3), (4, 1), (1, 1), (1, 1), (4, 4), (1, 4)];
        // Half of 14: down, up, proj and mix (7 bytes) leave qkv and the
        // scores (4); a greedy by multiply-adds per byte takes qkv and
        // leaves 5.
        assert_eq!(fewest_recomputed(&block, 7), 4);
        assert_eq!(fewest_recomputed(&block, 14), 0);
        assert_eq!(fewest_recomputed(&block, 0), 14);
        assert_eq!(fewest_recomputed(&[], 5), 0);
        // Against listing every choice, on pseudo-random products.
        let mut state = 12345u64;
        let mut next = |m: u64| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) % m
        };
        for _ in 0..200 {
            let n = next(8) as usize;
            let products: Vec<(u64, u64)> = (0..n).map(|_| (next(50), next(100))).collect();
            let budget = next(150);
            assert_eq!(
                fewest_recomputed(&products, budget),
                by_listing(&products, budget),
                "{products:?} within {budget}"
            );
        }
    }

    #[test]
    fn the_reference_solution_is_optimal() {
        for (b, n, w, h) in [
            (4, 64, 64, 4),
            (4, 256, 256, 4),
            (2, 128, 64, 8),
            (1, 32, 96, 3),
        ] {
            let products = block_products(b, n, w, h);
            let all: u64 = products.iter().map(|p| p.bytes).sum();
            let pairs: Vec<(u64, u64)> = products.iter().map(|p| (p.bytes, p.macs)).collect();
            for fraction in [0.0, 0.1, 0.3, 0.5, 0.7, 1.0] {
                let budget = (fraction * all as f64) as u64;
                let kept = choose_kept(&products, budget);
                let (bytes, recomputed) = products.iter().fold((0, 0), |(b, m), p| {
                    if kept.contains(&p.name) {
                        (b + p.bytes, m)
                    } else {
                        (b, m + p.macs)
                    }
                });
                assert!(bytes <= budget, "{kept:?}: {bytes} > {budget}");
                assert_eq!(recomputed, fewest_recomputed(&pairs, budget), "{kept:?}");
            }
        }
    }

    #[test]
    fn bad_parameters_are_refused_by_name() {
        let p = PolicyParams {
            depth: 1,
            heads: 3,
            budget_fraction: 1.5,
            ..PolicyParams::default()
        };
        let fields: Vec<String> = PolicyExercise
            .validate(&p)
            .into_iter()
            .map(|v| v.field)
            .collect();
        assert_eq!(fields, ["heads", "depth", "budget_fraction"]);
        assert!(PolicyExercise.validate(&PolicyParams::default()).is_empty());
    }

    #[test]
    fn a_step_allows_equal_parts_and_recomputes_all_but_the_last_segment() {
        let shape = StepShape {
            depth: 6,
            batch: 12,
            min_micro_batch: 4,
        };
        let plans: Vec<(usize, usize)> = shape
            .plans()
            .iter()
            .map(|q| (q.micro_batches, q.segments))
            .collect();
        // 12 rows in parts of 4 rows or more: 1, 2 or 3 parts; 6 layers in
        // 1, 2, 3 or 6 segments.
        assert_eq!(
            plans,
            [
                (1, 1),
                (1, 2),
                (1, 3),
                (1, 6),
                (2, 1),
                (2, 2),
                (2, 3),
                (2, 6),
                (3, 1),
                (3, 2),
                (3, 3),
                (3, 6)
            ]
        );
        let recomputed: Vec<usize> = [1, 2, 3, 6]
            .into_iter()
            .map(|segments| {
                recomputed_layers(
                    &shape,
                    StepPlan {
                        micro_batches: 1,
                        segments,
                    },
                )
                .unwrap()
            })
            .collect();
        assert_eq!(recomputed, [0, 3, 4, 5]);
        let err = recomputed_layers(
            &shape,
            StepPlan {
                micro_batches: 1,
                segments: 0,
            },
        )
        .unwrap_err();
        assert!(err.to_string().contains("segment"), "{err}");
    }

    #[test]
    fn bad_fit_parameters_are_refused_by_name() {
        let p = FitParams {
            depth: 0,
            min_micro_batch: 8192,
            budget_fraction: -0.5,
            ..FitParams::default()
        };
        let fields: Vec<String> = FitExercise
            .validate(&p)
            .into_iter()
            .map(|v| v.field)
            .collect();
        assert_eq!(fields, ["depth", "min_micro_batch", "budget_fraction"]);
        assert!(FitExercise.validate(&FitParams::default()).is_empty());
    }
}
