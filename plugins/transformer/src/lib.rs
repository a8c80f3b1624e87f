//! Chapter 3's model and cells: a GPT-style decoder on candle, what its
//! graph keeps for the backward, and the memory predictors people use set
//! against the measured peak of a real training step.
#![warn(missing_docs)]

// The experiments name this crate by its name, as a notebook cell does.
extern crate self as workbook_transformer;

/// The cells' experiments: what `workbook run` executes and chapter 3's
/// notebook shows.
mod experiment {
    pub mod predictors;
    pub mod profile;
    pub mod recompute;
    pub mod saved;
    pub mod training;
}
pub mod predict;
pub mod profile;
pub mod recompute;
pub mod saved;
pub mod training;
pub mod trial;

pub use profile::LayerProfile;
pub use recompute::GptCheckpointing;
pub use saved::SavedTensors;
pub use training::GptTraining;
pub use trial::Predictors;

pub use experiment::predictors::{predictors_experiment, variant_label};
pub use experiment::profile::{layer_profile_experiment, order_in_forward, Totals};
pub use experiment::recompute::{gpt_checkpointing_experiment, Strategy, PRODUCTS};
pub use experiment::saved::{is_quadratic, saved_tensors_experiment};
pub use experiment::training::gpt_training_experiment;
