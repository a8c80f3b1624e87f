//! The precision cell: bytes per dtype, mixed-precision training with f32
//! master weights, and a dynamic loss scaler for f16.
//!
//! The techniques are the toolkit's: `candle_amp::GradScaler`, with
//! torch.amp's protocol (scale the loss, unscale once, a step skipped on
//! inf/NaN, a separate update), and `candle_amp::clip_grad_norm`. The
//! forward in f16 or bf16 from f32 master weights is `Mlp::forward_as` here
//! (candle's `to_dtype` is differentiable, so gradients arrive in f32);
//! `candle_amp::MasterWeights` does the same for any candle-nn model.
#![warn(missing_docs)]

// The experiment names this crate by its name, as a notebook cell does.
extern crate self as workbook_precision;

mod experiment;

pub use experiment::{
    activations, bytes_per_dtype, flushed, precision_experiment, task, training, underflow, HALVES,
};

use candle_amp::ScalerConfig;
use serde::{Deserialize, Serialize};
use workbook_sdk::anyhow;
use workbook_sdk::metric::MetricSpec;
use workbook_sdk::{Context, NotebookSource, Plugin, Rules, Violation};

/// Parameters of the precision cell.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Params {
    /// Seed of weights and data.
    pub seed: u64,
    /// Width of the model whose activations are measured (features).
    pub act_width: usize,
    /// Depth (Linear + GELU blocks) of the model whose activations are measured.
    pub act_depth: usize,
    /// Batch of the model whose activations are measured (rows).
    pub act_batch: usize,
    /// Widths of the trained model, input to output (features).
    pub train_widths: Vec<usize>,
    /// Batch of the trained model (rows).
    pub train_batch: usize,
    /// Training steps in each dtype.
    #[schemars(range(min = 1))]
    pub train_steps: usize,
    /// AdamW's learning rate.
    pub lr: f64,
    /// Global gradient norm the gradients are clipped to, after unscaling.
    pub max_grad_norm: f64,
    /// The scaler's settings for f16 training.
    pub scaler: ScalerConfig,
    /// The size of each output's gradient in the underflow demonstration.
    pub small_gradient: f64,
    /// The fraction of training labels replaced at random (0 to 1).
    #[schemars(range(min = 0.0, max = 1.0))]
    pub label_noise: f64,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            seed: 47,
            act_width: 512,
            act_depth: 8,
            act_batch: 1024,
            train_widths: vec![32, 64, 4],
            train_batch: 4096,
            train_steps: 200,
            lr: 3e-3,
            max_grad_norm: 1.0,
            scaler: ScalerConfig::default(),
            small_gradient: 1e-8,
            label_noise: 0.2,
        }
    }
}

/// The precision plugin.
#[derive(Debug, Default, Clone, Copy)]
pub struct Precision;

impl Plugin for Precision {
    type Params = Params;

    fn name(&self) -> &str {
        "precision"
    }

    fn description(&self) -> &str {
        "bytes per dtype, half-precision activations, f16 underflow and the loss scaler, mixed-precision training"
    }

    fn validate(&self, p: &Params) -> Vec<Violation> {
        let mut r = Rules::new();
        r.at_least("act_width", p.act_width, 1)
            .at_least("act_depth", p.act_depth, 1)
            .at_least("act_batch", p.act_batch, 1)
            .widths("train_widths", &p.train_widths, p.train_batch)
            .at_least("train_batch", p.train_batch, 1)
            .at_least("train_steps", p.train_steps, 1)
            .positive("lr", p.lr)
            .positive("max_grad_norm", p.max_grad_norm)
            .positive("small_gradient", p.small_gradient)
            .within("label_noise", p.label_noise, 0.0, 1.0)
            .positive("scaler.init_scale", p.scaler.init_scale)
            .require(
                p.scaler.growth_factor.is_finite() && p.scaler.growth_factor > 1.0,
                "scaler.growth_factor",
                p.scaler.growth_factor.to_string(),
                "allowed: a finite number above 1 (as torch.amp.GradScaler)",
            )
            .require(
                p.scaler.backoff_factor > 0.0 && p.scaler.backoff_factor < 1.0,
                "scaler.backoff_factor",
                p.scaler.backoff_factor.to_string(),
                "allowed: a number above 0 and below 1 (as torch.amp.GradScaler)",
            )
            .at_least(
                "scaler.growth_interval",
                p.scaler.growth_interval as usize,
                1,
            );
        let w = p.act_width as u64;
        r.elements("act_width", "act_width × act_width", &[w, w])
            .elements(
                "act_batch",
                "act_depth × act_batch × act_width",
                &[p.act_depth as u64, p.act_batch as u64, w],
            );
        r.into_violations()
    }

    fn memory_floor(&self, p: &Params) -> Option<(u64, String)> {
        // The f32 forward keeps every block's output.
        workbook_sdk::rules::f32_outputs_floor(
            "the forward keeps",
            p.act_depth,
            p.act_batch,
            p.act_width,
        )
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        let mut specs = Vec::new();
        for dtype in ["f32", "f16", "bf16", "u8"] {
            specs.push(MetricSpec::number(
                format!("tensor_mb_{dtype}"),
                format!("a 1000 × 1000 {dtype} tensor, measured, in MB (1e6 bytes)"),
            ));
        }
        specs.extend([
            MetricSpec::count(
                "underflow_elements",
                "elements of the weight gradient of the underflow demonstration",
            ),
            MetricSpec::count(
                "flushed_f16_unscaled",
                "weight-gradient elements nonzero in f32 but zero with an f16 forward, unscaled",
            ),
            MetricSpec::count(
                "flushed_f16_scaled",
                "weight-gradient elements nonzero in f32 but zero in f16, scaled by init_scale",
            ),
            MetricSpec::count(
                "flushed_bf16_unscaled",
                "weight-gradient elements nonzero in f32 but zero with a bf16 forward, unscaled",
            ),
        ]);
        for (suffix, path) in [
            ("", "on the lean path (fused layers)"),
            ("_candle", "on candle-nn's layers"),
        ] {
            for dtype in ["f32", "f16", "bf16"] {
                specs.extend([
                    MetricSpec::bytes(
                        format!("act_held_{dtype}{suffix}"),
                        format!("activations a forward in {dtype} {path} holds when it ends"),
                    ),
                    MetricSpec::bytes(
                        format!("act_peak_{dtype}{suffix}"),
                        format!("activations at their peak during a forward in {dtype} {path}"),
                    ),
                ]);
            }
        }
        for dtype in ["f16", "bf16"] {
            specs.extend([
                MetricSpec::ratio(
                    format!("act_held_ratio_{dtype}"),
                    format!("act_held_{dtype} over act_held_f32"),
                ),
                MetricSpec::ratio(
                    format!("act_peak_ratio_{dtype}"),
                    format!("act_peak_{dtype} over act_peak_f32"),
                ),
            ]);
        }
        for dtype in ["f32", "bf16", "f16"] {
            specs.push(MetricSpec::number(
                format!("final_loss_{dtype}"),
                format!("loss after training in {dtype}, evaluated with an f32 forward"),
            ));
        }
        specs.extend([
            MetricSpec::number("final_scale", "the f16 loss scale after the last step"),
            MetricSpec::count(
                "scale_decreases_f16",
                "times the f16 loss scale fell from one step to the next (the final included)",
            ),
            MetricSpec::number(
                "initial_loss",
                "loss before training, evaluated with an f32 forward",
            ),
            MetricSpec::count(
                "skipped_steps_f16",
                "f16 steps the scaler skipped for inf or NaN gradients",
            ),
        ]);
        for dtype in ["bf16", "f16"] {
            specs.push(MetricSpec::number(
                format!("loss_gap_{dtype}"),
                format!("|final_loss_{dtype} - final_loss_f32|"),
            ));
        }
        specs
    }

    fn notebook(&self) -> Option<NotebookSource> {
        Some(workbook_sdk::notebook_source! {
            plugin: "workbook_precision::Precision",
            entry: "precision_experiment",
            params: "PrecisionParams",
            source: "experiment.rs",
        })
    }

    fn run(&self, ctx: &mut Context, p: Params) -> anyhow::Result<()> {
        experiment::precision_experiment(ctx, p)
    }
}
