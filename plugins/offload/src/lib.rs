//! The offload cell: optimizer state, gradients and parameters kept in host
//! memory and brought to the device only when needed.
//!
//! The techniques are the toolkit's: `candle_offload::HostAdamW` (f32
//! master weights and both moments on the host, twice the parameters' bytes
//! moved per step), `candle_checkpoint::Sequential::each_layer` (each layer's
//! gradients handed over as soon as they exist) and
//! `candle_offload::StreamedLinear` (weights that visit the device for the
//! forward and again for the backward).
//!
//! On a CPU-only run host and device are the same memory; the copies are
//! still made, and the meter files each under the side it stands for
//! ([`Residency`]), so the shift shows.
#![warn(missing_docs)]

// The experiment names this crate by its name, as a notebook cell does.
extern crate self as workbook_offload;

mod experiment;

pub use experiment::{copy_to, offload_experiment, units, Unit2};

use serde::{Deserialize, Serialize};
use workbook_sdk::anyhow;
use workbook_sdk::metric::MetricSpec;
use workbook_sdk::{Context, NotebookSource, Plugin, Rules, Violation};

/// Parameters of the offload cell.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Params {
    /// Width of the model (features).
    pub width: usize,
    /// Depth of the model (Linear + ReLU blocks).
    pub depth: usize,
    /// Batch (rows).
    pub batch: usize,
    /// AdamW steps compared with candle_nn::AdamW.
    #[schemars(range(min = 1))]
    pub steps: usize,
    /// AdamW's learning rate.
    pub lr: f64,
    /// Seed of weights and data.
    pub seed: u64,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            width: 1024,
            depth: 8,
            batch: 64,
            steps: 10,
            lr: 1e-3,
            seed: 47,
        }
    }
}

/// The offload plugin.
#[derive(Debug, Default, Clone, Copy)]
pub struct Offload;

impl Plugin for Offload {
    type Params = Params;

    fn name(&self) -> &str {
        "offload"
    }

    fn description(&self) -> &str {
        "optimizer state, gradients and parameters in host memory: equal results, device bytes, copies"
    }

    fn validate(&self, p: &Params) -> Vec<Violation> {
        let mut r = Rules::new();
        r.at_least("width", p.width, 1)
            .at_least("depth", p.depth, 1)
            .at_least("batch", p.batch, 1)
            .at_least("steps", p.steps, 1)
            .positive("lr", p.lr);
        let w = p.width as u64;
        r.elements("width", "depth × width × width", &[p.depth as u64, w, w])
            .elements("batch", "batch × width", &[p.batch as u64, w]);
        r.into_violations()
    }

    fn memory_floor(&self, p: &Params) -> Option<(u64, String)> {
        // Weights and AdamW's two moments, in f32.
        let weights = (p.depth as u64).checked_mul((p.width as u64).checked_pow(2)?)?;
        Some((
            weights.checked_mul(12)?,
            format!(
                "f32 weights and two moments, 3 × {} × {}²",
                p.depth, p.width
            ),
        ))
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        vec![
            MetricSpec::bytes("param_bytes", "bytes of the model's parameters"),
            MetricSpec::bytes(
                "largest_layer_bytes",
                "f32 bytes of the largest layer's weight and bias",
            ),
            MetricSpec::number(
                "adamw_max_abs_diff",
                "largest parameter difference after the steps, HostAdamW against candle_nn's",
            ),
            MetricSpec::bytes(
                "device_optimizer_bytes_plain",
                "optimizer state on the device after the steps, candle_nn::AdamW",
            ),
            MetricSpec::bytes(
                "device_optimizer_bytes_offload",
                "optimizer state on the device after the steps, HostAdamW",
            ),
            MetricSpec::bytes(
                "host_optimizer_bytes_offload",
                "optimizer state on the host after the steps, HostAdamW (masters and moments)",
            ),
            MetricSpec::bytes(
                "bytes_moved_per_step",
                "bytes HostAdamW copies per step, both ways, set-up excluded",
            ),
            MetricSpec::seconds(
                "copy_seconds_per_step",
                "time HostAdamW spends copying per step",
            ),
            MetricSpec::seconds(
                "step_seconds_device",
                "mean time of a candle_nn::AdamW step",
            ),
            MetricSpec::seconds(
                "step_seconds_device_lean",
                "mean time of a candle_lean_optim::LeanAdamW step (in place)",
            ),
            MetricSpec::seconds(
                "step_seconds_host",
                "mean time of a HostAdamW step, copies included",
            ),
            MetricSpec::number(
                "grad_offload_max_abs_diff",
                "largest gradient difference, offloaded layer by layer against plain backward",
            ),
            MetricSpec::bytes(
                "device_grad_peak_plain",
                "gradients on the device at their peak, all kept there",
            ),
            MetricSpec::bytes(
                "device_grad_peak_offload",
                "gradients on the device at their peak, offloaded layer by layer",
            ),
            MetricSpec::bytes(
                "host_grad_peak_offload",
                "gradients on the host at their peak, offloaded layer by layer",
            ),
            MetricSpec::seconds(
                "grad_copy_seconds",
                "time copying gradients to the host in the layer-by-layer backward",
            ),
            MetricSpec::number(
                "stream_max_abs_diff",
                "largest output difference, streamed layers against resident",
            ),
            MetricSpec::number(
                "stream_grad_max_abs_diff",
                "largest weight and bias gradient difference, streamed layers against resident",
            ),
            MetricSpec::bytes(
                "device_param_bytes_resident",
                "parameters on the device when the model is resident",
            ),
            MetricSpec::bytes(
                "device_param_peak_streamed",
                "parameters on the device at their peak, streamed forward and backward",
            ),
            MetricSpec::bytes(
                "stream_bytes_to_device",
                "bytes the streamed layers copy to the device in a forward and backward",
            ),
            MetricSpec::seconds(
                "stream_copy_seconds",
                "time the streamed layers spend copying in a forward and backward",
            ),
            MetricSpec::seconds(
                "stream_step_seconds",
                "time of the streamed forward and backward",
            ),
            MetricSpec::seconds(
                "resident_step_seconds",
                "time of the resident forward and backward",
            ),
        ]
    }

    fn notebook(&self) -> Option<NotebookSource> {
        Some(workbook_sdk::notebook_source! {
            plugin: "workbook_offload::Offload",
            entry: "offload_experiment",
            params: "OffloadParams",
            source: "experiment.rs",
        })
    }

    fn run(&self, ctx: &mut Context, p: Params) -> anyhow::Result<()> {
        experiment::offload_experiment(ctx, p)
    }
}
