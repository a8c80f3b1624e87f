//! Activation checkpointing for candle.
//!
//! candle's autograd keeps every intermediate tensor of a forward until the
//! backward. Checkpointing keeps only the inputs of chosen functions and
//! recomputes the rest during the backward, one function at a time: memory
//! for time.
//!
//! candle has no hooks into its autograd, so this crate drives the backward
//! itself. Its one primitive is [`recompute`]: run a function again from
//! saved input(s) and back-propagate an upstream gradient through it, giving
//! the inputs' gradients and the parameters' gradients (a vector-Jacobian
//! product). On it:
//!
//! * [`Sequential`]: a stack of layers in `k` segments, as PyTorch's
//!   `checkpoint_sequential`, configured by name (segments, one per layer,
//!   observer); on [`TapeModule`] layers with a [`Policy`]: selective
//!   checkpointing, keeping the outputs of matrix products (or of named
//!   ones) so that only the element-wise operations are recomputed;
//! * its `_with` calls, which hand each parameter gradient over as soon as
//!   it exists (to add it to a running sum, or move it off the device);
//! * [`Sequential::lean`]: no recomputation, but one layer's graph at a
//!   time, each freed once the backward has passed it (as PyTorch's
//!   autograd frees what it saved), where candle's `backward` keeps them
//!   all; and [`Sequential::direct`], for layers whose backward is written
//!   out ([`DirectBackward`]), with no graph between the layers at all;
//! * [`missing_grads`] / [`ensure_grads`]: that no trainable variable of a
//!   `VarMap` was left without a gradient.
//!
//! A checkpointed function must compute the same thing each time it runs:
//! a layer that draws random numbers (dropout) would draw others in the
//! recomputation, and its gradients would not be those of its forward.
//! Give such a layer its mask or seed as an input ([`Arg::Const`]).
//!
//! Supports candle 0.11. Measurement attaches through an [`Observer`],
//! set on the builder when wanted (both it and `NoObserver` are
//! re-exported here).
#![warn(missing_docs)]

mod builder;
mod direct;
mod grads;
mod lean;
mod policy;
mod sequential;
mod vjp;

pub use builder::{Direct, Plain, Sequential, Taped};
pub use candle_custom_grad::{DirectBackward, DirectGrads};
/// The measurement hook that calls here accept, and the one that does
/// nothing (`&NoObserver`): re-exported, so that a caller needs no
/// `candle-observe` of its own for them.
pub use candle_observe::{NoObserver, Observer};
pub use direct::autograd_head;
pub use grads::{accumulate, add_grad, ensure_grads, missing_grads, named_vars};
pub use policy::{Policy, Tape, TapeModule};
pub use sequential::{segment_bounds, Checkpointed};
pub use vjp::{recompute, Arg, Seed, Vjp};
