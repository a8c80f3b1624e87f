//! Offload for candle 0.11: what training keeps, kept in host memory and
//! brought to the device only when needed.
//!
//! * [`HostAdamW`]: ZeRO-Offload's optimizer. f32 master weights and both
//!   moments live on the host and the update runs there, in place; a step
//!   moves the gradients out and the parameters back, twice the parameters'
//!   bytes.
//! * [`StreamedLinear`]: a linear layer whose weights live on the host and
//!   visit the device for its forward and again for its backward (as FSDP
//!   gathers a layer's shards twice); its weight gradients go straight back
//!   to the host. A [`Module`](candle_core::Module) inside candle's autograd.
//! * [`WeightSource`] and [`fetched_linear`] (or [`fetched_linear_act`], an
//!   activation fused): the mechanism under it, for
//!   weights kept anywhere (sharded over peers, for ZeRO stage 3).
//! * [`Transfers`]: the bytes and time of every copy.
#![warn(missing_docs)]

mod host;
mod source;
mod stream;
mod transfers;

/// The activation `fetched_linear_act` takes: re-exported, so that a
/// caller needs no `candle-lean-nn` of its own for it.
pub use candle_lean_nn::Activation;
/// The measurement hook that calls here accept, and the one that does
/// nothing (`&NoObserver`): re-exported, so that a caller needs no
/// `candle-observe` of its own for them.
pub use candle_observe::{NoObserver, Observer};
pub use host::HostAdamW;
pub use source::{fetched_linear, fetched_linear_act, WeightSource};
pub use stream::StreamedLinear;
pub use transfers::Transfers;
