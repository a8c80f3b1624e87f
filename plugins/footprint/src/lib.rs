//! The footprint cell: how many parameters a model has, and how many bytes
//! training it holds (parameters, gradients, AdamW's two moments) per dtype,
//! computed analytically and measured by materialising all of it.
//!
//! [`TrainingState::analytic`] is the reusable part: the same function gives
//! the tutorial's 7B figures (112 GB in f32) and the small models' bytes.
#![warn(missing_docs)]

// The experiment names this crate by its name, as a notebook cell does.
extern crate self as workbook_footprint;

mod experiment;

pub use experiment::footprint_experiment;

use serde::{Deserialize, Serialize};
use workbook_sdk::anyhow;
use workbook_sdk::candle::DType;
use workbook_sdk::metric::MetricSpec;
use workbook_sdk::{Context, NotebookSource, Plugin, Rules, Violation};

/// The bytes that training with AdamW holds, by part.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrainingState {
    /// The parameters.
    pub parameters: u64,
    /// One gradient per parameter.
    pub gradients: u64,
    /// AdamW's first and second moments.
    pub optimizer: u64,
}

impl TrainingState {
    /// The analytic figure for `params` parameters stored in `dtype`, with
    /// gradients and AdamW moments in the same dtype (as `candle_nn::AdamW`
    /// keeps them).
    ///
    /// ```
    /// use workbook_footprint::TrainingState;
    /// use candle_core::DType;
    /// let s = TrainingState::analytic(7_000_000_000, DType::F32);
    /// assert_eq!((s.parameters, s.gradients, s.optimizer, s.total()),
    ///            (28_000_000_000, 28_000_000_000, 56_000_000_000, 112_000_000_000));
    /// ```
    pub fn analytic(params: u64, dtype: DType) -> Self {
        let bytes = params * dtype.size_in_bytes() as u64;
        Self {
            parameters: bytes,
            gradients: bytes,
            optimizer: 2 * bytes,
        }
    }

    /// All parts together.
    pub fn total(&self) -> u64 {
        self.parameters + self.gradients + self.optimizer
    }
}

/// Parameters of the footprint cell.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Params {
    /// Widths of the small model, input to output (features).
    pub small: Vec<usize>,
    /// Widths of the large model, input to output (features).
    pub large: Vec<usize>,
    /// Widths of the model whose training state is materialised (features).
    pub state_model: Vec<usize>,
    /// Batch of the backward pass that materialises the gradients (rows).
    pub batch: usize,
    /// Dtypes to measure: `f32`, `f16`, `bf16`.
    pub dtypes: Vec<String>,
    /// Parameter count of the large language model of the analytic example.
    pub llm_params: u64,
    /// Seed of weights and data.
    pub seed: u64,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            small: vec![128, 128, 10],
            large: vec![128, 512, 512, 10],
            state_model: vec![128, 512, 512, 10],
            batch: 32,
            dtypes: vec!["f32".into(), "f16".into(), "bf16".into()],
            llm_params: 7_000_000_000,
            seed: 47,
        }
    }
}

/// The footprint plugin.
#[derive(Debug, Default, Clone, Copy)]
pub struct Footprint;

impl Plugin for Footprint {
    type Params = Params;

    fn name(&self) -> &str {
        "footprint"
    }

    fn description(&self) -> &str {
        "parameter counts, and training-state bytes per dtype, analytic and measured"
    }

    fn validate(&self, p: &Params) -> Vec<Violation> {
        let mut r = Rules::new();
        r.widths("small", &p.small, 1)
            .widths("large", &p.large, 1)
            .widths("state_model", &p.state_model, p.batch)
            .at_least("batch", p.batch, 1);
        if p.dtypes.is_empty() {
            r.violation("dtypes", "[]", "allowed: a list of at least 1 entry");
        }
        for (i, d) in p.dtypes.iter().enumerate() {
            r.one_of(&format!("dtypes[{i}]"), d, &["f32", "f16", "bf16"]);
        }
        // Parameters, gradients and two moments of 4 bytes each.
        r.require(
            p.llm_params >= 1 && p.llm_params.checked_mul(16).is_some(),
            "llm_params",
            p.llm_params.to_string(),
            "allowed: from 1 to u64::MAX / 16 (its training state is 16 bytes a parameter)",
        );
        r.into_violations()
    }

    fn memory_floor(&self, p: &Params) -> Option<(u64, String)> {
        // The state model's parameters, gradients and two moments, in the
        // smallest dtype it is materialised in.
        let params = p.state_model.windows(2).try_fold(0u64, |sum, w| {
            let (i, o) = (w[0] as u64, w[1] as u64);
            sum.checked_add(i.checked_mul(o)?.checked_add(o)?)
        })?;
        let bytes = p
            .dtypes
            .iter()
            .filter_map(|d| workbook_sdk::parse_dtype(d).ok())
            .map(|d| d.size_in_bytes() as u64)
            .min()?;
        Some((
            params.checked_mul(4)?.checked_mul(bytes)?,
            format!("the training state of {params} parameters, 4 × {bytes} bytes each"),
        ))
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        vec![
            MetricSpec::count("small_params", "parameters of the small model"),
            MetricSpec::count("large_params", "parameters of the large model"),
            MetricSpec::bytes(
                "params_bytes_{dtype}",
                "state model's parameters, measured, per dtype of `dtypes` (f32, f16, bf16)",
            ),
            MetricSpec::bytes(
                "grads_bytes_{dtype}",
                "state model's gradients after one backward, measured, per dtype of `dtypes`",
            ),
            MetricSpec::bytes(
                "optimizer_bytes_{dtype}",
                "state model's AdamW moments, measured, per dtype of `dtypes`",
            ),
            MetricSpec::bytes(
                "state_measured_{dtype}",
                "parameters + gradients + AdamW moments, measured, per dtype of `dtypes`",
            ),
            MetricSpec::bytes(
                "state_analytic_{dtype}",
                "parameters + gradients + AdamW moments, analytic, per dtype of `dtypes`",
            ),
            MetricSpec::ratio(
                "state_ratio_{dtype}",
                "measured training state over the analytic one, per dtype of `dtypes`",
            ),
            MetricSpec::number(
                "llm_params_gb",
                "parameters of an llm_params model in f32, in GB (1e9 bytes), analytic",
            ),
            MetricSpec::number(
                "llm_grads_gb",
                "gradients of an llm_params model in f32, in GB (1e9 bytes), analytic",
            ),
            MetricSpec::number(
                "llm_adam_gb",
                "AdamW's two moments of an llm_params model in f32, in GB (1e9 bytes), analytic",
            ),
            MetricSpec::number(
                "llm_total_gb",
                "training state of an llm_params model in f32, in GB (1e9 bytes), analytic",
            ),
        ]
    }

    fn notebook(&self) -> Option<NotebookSource> {
        Some(workbook_sdk::notebook_source! {
            plugin: "workbook_footprint::Footprint",
            entry: "footprint_experiment",
            params: "FootprintParams",
            source: "experiment.rs",
        })
    }

    fn run(&self, ctx: &mut Context, p: Params) -> anyhow::Result<()> {
        experiment::footprint_experiment(ctx, p)
    }
}
