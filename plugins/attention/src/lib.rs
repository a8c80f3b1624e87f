//! The attention cell: scaled dot-product attention four ways, down to a
//! backward that never holds the N x N score matrix.
//!
//! The techniques are the toolkit's `candle_tiled_attention`: naive
//! attention (the whole score matrix, through candle's composed operations
//! and autograd) as the reference, materialized attention (the same, kept
//! as PyTorch's autograd keeps it: the probabilities only), and the tiled
//! forward with its recomputing backward. Chunked
//! attention, a block of queries against all keys at once, is the tiled one
//! with the key block as long as the sequence.
#![warn(missing_docs)]

// The experiment names this crate by its name, as a notebook cell does.
extern crate self as workbook_attention;

mod experiment;

pub use experiment::{attention_experiment, forward_backward, qkv, Method, Qkv};

use serde::{Deserialize, Serialize};
use workbook_sdk::anyhow;
use workbook_sdk::metric::MetricSpec;
use workbook_sdk::{Context, NotebookSource, Plugin, Rules, Violation};

/// Parameters of the attention cell.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Params {
    /// Attention heads.
    pub heads: usize,
    /// Dimension per head (features).
    pub head_dim: usize,
    /// Sequence lengths swept (tokens).
    pub lengths: Vec<usize>,
    /// Query rows per chunk (chunked) and per tile (tiled).
    #[schemars(range(min = 1))]
    pub q_block: usize,
    /// Key columns per tile (tiled).
    #[schemars(range(min = 1))]
    pub k_block: usize,
    /// Sequence length of the equality checks (tokens).
    pub check_length: usize,
    /// Timed repetitions per point, methods taking turns (the best is reported).
    #[schemars(range(min = 1))]
    pub repeats: usize,
    /// Seed of the data.
    pub seed: u64,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            heads: 8,
            head_dim: 64,
            lengths: vec![256, 512, 1024, 2048, 4096],
            q_block: 256,
            k_block: 256,
            check_length: 256,
            repeats: 3,
            seed: 47,
        }
    }
}

/// The attention plugin.
#[derive(Debug, Default, Clone, Copy)]
pub struct AttentionCell;

impl Plugin for AttentionCell {
    type Params = Params;

    fn name(&self) -> &str {
        "attention"
    }

    fn description(&self) -> &str {
        "naive (candle operations), materialized, chunked and tiled attention: equal outputs and gradients, peak and time over N"
    }

    fn validate(&self, p: &Params) -> Vec<Violation> {
        let mut r = Rules::new();
        r.at_least("heads", p.heads, 1)
            .at_least("head_dim", p.head_dim, 1)
            .list("lengths", &p.lengths, 1, 1)
            .at_least("q_block", p.q_block, 1)
            .at_least("k_block", p.k_block, 1)
            .at_least("check_length", p.check_length, 1)
            .at_least("repeats", p.repeats, 1);
        for &n in p.lengths.iter().chain([&p.check_length]) {
            let (h, n, d) = (p.heads as u64, n as u64, p.head_dim as u64);
            // Naive attention holds heads × N × N scores.
            r.elements("lengths", "heads × N × N", &[h, n, n]).elements(
                "lengths",
                "heads × N × head_dim",
                &[h, n, d],
            );
        }
        r.into_violations()
    }

    fn memory_floor(&self, p: &Params) -> Option<(u64, String)> {
        // Naive attention computes the f32 scores of every head at once.
        let n = *p.lengths.iter().chain([&p.check_length]).max()? as u64;
        let bytes = (p.heads as u64)
            .checked_mul(n)?
            .checked_mul(n)?
            .checked_mul(4)?;
        Some((
            bytes,
            format!("the f32 scores of naive attention, {} × {n}²", p.heads),
        ))
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        let mut specs = Vec::new();
        // Each method against naive attention at check_length, unmasked then causal.
        for (suffix, mask) in [("", "no mask"), ("_causal", "causal mask")] {
            for m in ["materialized", "chunked", "tiled"] {
                specs.extend([
                    MetricSpec::number(
                        format!("out_diff_{m}{suffix}"),
                        format!("largest output difference, {m} against naive, {mask}"),
                    ),
                    MetricSpec::number(
                        format!("grad_diff_{m}{suffix}"),
                        format!("largest gradient difference (q, k, v), {m} against naive, {mask}"),
                    ),
                ]);
            }
        }
        for dtype in ["f16", "bf16"] {
            specs.extend([
                MetricSpec::number(
                    format!("out_diff_tiled_causal_{dtype}"),
                    format!("largest output difference, {dtype} tiled against f32 naive, causal"),
                ),
                MetricSpec::number(
                    format!("grad_diff_tiled_causal_{dtype}"),
                    format!("largest gradient difference, {dtype} tiled against f32 naive, causal"),
                ),
            ]);
        }
        // The sweep, read at the last length and between the first and last.
        for m in ["naive", "materialized", "chunked", "tiled"] {
            specs.extend([
                MetricSpec::bytes(
                    format!("peak_{m}"),
                    format!("peak of {m} attention's forward and backward, last length"),
                ),
                MetricSpec::seconds(
                    format!("time_{m}"),
                    format!("best wall time of {m} attention's forward and backward, last length"),
                ),
                MetricSpec::number(
                    format!("growth_{m}"),
                    format!("exponent of N in {m} attention's peak, first length to last"),
                ),
            ]);
        }
        specs.extend([
            MetricSpec::ratio("peak_ratio_naive_tiled", "peak_naive over peak_tiled"),
            MetricSpec::ratio(
                "peak_ratio_materialized_tiled",
                "peak_materialized over peak_tiled",
            ),
            MetricSpec::ratio(
                "peak_ratio_naive_materialized",
                "peak_naive over peak_materialized",
            ),
            MetricSpec::number(
                "naive_peak_in_score_matrices",
                "peak_naive in f32 score matrices of all heads at the last length",
            ),
            MetricSpec::number(
                "materialized_peak_in_score_matrices",
                "peak_materialized in f32 score matrices of all heads at the last length",
            ),
            MetricSpec::ratio("time_ratio_tiled_naive", "time_tiled over time_naive"),
            MetricSpec::ratio(
                "time_ratio_tiled_materialized",
                "time_tiled over time_materialized",
            ),
            MetricSpec::ratio(
                "cpu_time_ratio_tiled_naive",
                "best CPU time of tiled attention over naive's at the last length",
            ),
            MetricSpec::count("largest_n", "the last sequence length swept (tokens)"),
            MetricSpec::number(
                "scores_32h_4096_f16_gb",
                "one 4096 × 4096 f16 score matrix for 32 heads, in GB (1e9 bytes), analytic",
            ),
        ]);
        specs
    }

    fn notebook(&self) -> Option<NotebookSource> {
        Some(workbook_sdk::notebook_source! {
            plugin: "workbook_attention::AttentionCell",
            entry: "attention_experiment",
            params: "AttentionParams",
            source: "experiment.rs",
        })
    }

    fn run(&self, ctx: &mut Context, p: Params) -> anyhow::Result<()> {
        experiment::attention_experiment(ctx, p)
    }
}
