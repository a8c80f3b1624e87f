//! AdamW for candle 0.11 with the memory a training step can afford.
//!
//! `candle_nn::AdamW` computes each update out of place: about ten
//! temporaries the size of the parameter before it writes the results back.
//! At the end of a backward, when every gradient is alive, those temporaries
//! set the step's peak.
//!
//! * [`LeanAdamW`]: the same update, in place: the moments and the parameter
//!   are rewritten element by element, no temporary at all (CPU). Equal to
//!   `candle_nn::AdamW` in f32; f16 and bf16 parameters are updated through
//!   f32 arithmetic.
//! * [`HostAdamW`]: ZeRO-Offload's optimizer. f32 master weights and both
//!   moments live on the host; a step copies the gradients to the host,
//!   updates there in place and copies the parameters back: twice the
//!   parameters' bytes cross per step, counted in [`Transfers`].
//!
//! Both implement [`candle_nn::Optimizer`], expose their hyper-parameters
//! (`params`, `set_params`) and save and load their state as safetensors.
#![warn(missing_docs)]

mod host;
mod kernel;
mod lean;
mod state;
mod transfers;

pub use host::HostAdamW;
pub use lean::LeanAdamW;
pub use transfers::Transfers;
