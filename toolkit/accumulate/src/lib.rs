//! Gradient accumulation for candle 0.11: the gradients of a batch too large
//! for memory, from micro-batches run one after another.
//!
//! The loss of a batch of `N` rows is the mean over its rows. A micro-batch
//! of `n_i` rows gives the mean over its own rows, so its gradient enters the
//! sum with weight `n_i / N`, not `1 / K`: the two differ when the last
//! micro-batch is shorter. [`GradAccumulator`] weights by rows and checks
//! that they add up to the batch; [`Accumulating`] also owns the optimizer.
//!
//! Accumulation does not always save memory: it keeps a gradient sum beside
//! each micro-batch's gradients. It saves the activations of the rows it no
//! longer runs at once.
#![warn(missing_docs)]

mod accumulator;
mod owning;

pub use accumulator::{micro_batches, GradAccumulator};
/// The measurement hook that calls here accept, and the one that does
/// nothing (`&NoObserver`): re-exported, so that a caller needs no
/// `candle-observe` of its own for them.
pub use candle_observe::{NoObserver, Observer};
pub use owning::Accumulating;
