//! AdamW for candle 0.11 with the memory a training step can afford.
//!
//! `candle_nn::AdamW` computes each update out of place: fifteen
//! temporaries the size of the parameter (counted by the tests, candle
//! 0.11.1) before it writes the results back.
//! At the end of a backward, when every gradient is alive, those temporaries
//! set the step's peak.
//!
//! [`LeanAdamW`] takes the same update in place: the moments and the
//! parameter are rewritten element by element, no temporary at all (on the
//! CPU, and on CUDA with the `cuda` feature).
//! Equal to `candle_nn::AdamW` in f32; f16 and bf16 parameters are updated
//! through f32 arithmetic. It implements [`candle_nn::Optimizer`], exposes
//! its hyper-parameters (`params`, `set_params`) and saves and loads its
//! state as safetensors ([`save_state`], [`StateFile`]).
//!
//! [`adamw_update`] is the update of one variable, for optimizers that keep
//! their state elsewhere (on the host, say).
#![warn(missing_docs)]

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(test)]
mod emulated;
mod kernel;
mod lean;
#[cfg(any(feature = "cuda", test))]
mod params;
mod state;

/// The measurement hook that calls here accept, and the one that does
/// nothing (`&NoObserver`): re-exported, so that a caller needs no
/// `candle-observe` of its own for them.
pub use candle_observe::{NoObserver, Observer};
pub use kernel::AdamWStep;
pub use lean::{adamw_update, LeanAdamW};
pub use state::{save_state, StateFile};
