//! What the CLI's `plan` and the chapters' cells share: a GPT's training
//! step measured by category (whole, in micro-batches, checkpointed, or one
//! rank's share under DDP or a ZeRO stage), what ZeRO's analysis says each
//! stage holds, and the planner that calibrates steps and fits one into a
//! memory budget; and for chapter 5's decoders, a step's peak predicted
//! in closed form and the option that fits a device.
#![warn(missing_docs)]

pub mod decoder;
pub mod margin;
pub mod plan;
pub mod stage;
pub mod step;

pub use stage::{ModelState, Precision, Stage};
