//! Chapter 3's model and cells: a GPT-style decoder on candle, what its
//! graph keeps for the backward, and the memory predictors people use set
//! against the measured peak of a real training step.
#![warn(missing_docs)]

// The experiments name this crate by its name, as a notebook cell does.
extern crate self as workbook_transformer;

pub mod corpus;
/// The cells' experiments: what `workbook run` executes and chapter 3's
/// notebook shows.
mod experiment {
    pub mod predictors;
    pub mod profile;
    pub mod recompute;
    pub mod saved;
    pub mod training;
}
mod gpt;
pub mod plan;
pub mod predict;
pub mod profile;
pub mod recompute;
pub mod saved;
pub mod step;
pub mod training;
pub mod trial;

pub use gpt::{AttentionKind, Gpt, GptConfig, GptLayer};
pub use profile::LayerProfile;
pub use recompute::GptCheckpointing;
pub use saved::{Recipe, SavedTensors};
pub use training::GptTraining;
pub use trial::Predictors;

pub use experiment::predictors::{predictors_experiment, variant_label};
pub use experiment::profile::{layer_profile_experiment, order_in_forward, Totals};
pub use experiment::recompute::{gpt_checkpointing_experiment, Strategy, PRODUCTS};
pub use experiment::saved::{is_quadratic, saved_tensors_experiment};
pub use experiment::training::gpt_training_experiment;

use workbook_sdk::anyhow;
use workbook_sdk::candle::DType;

/// The median of `values` (the upper one of an even count); 0 for none.
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

/// The dtypes the cells and the planner take, by name.
pub const DTYPES: [&str; 3] = ["f32", "f16", "bf16"];

/// A dtype by its name in [`DTYPES`].
pub fn parse_dtype(name: &str) -> anyhow::Result<DType> {
    match name {
        "f32" => Ok(DType::F32),
        "f16" => Ok(DType::F16),
        "bf16" => Ok(DType::BF16),
        other => anyhow::bail!("unknown dtype `{other}`, expected one of `f32`, `f16`, `bf16`"),
    }
}
