//! Mixed-precision training for candle 0.11.
//!
//! * [`MasterWeights`]: the model's variables stay f32 in a `VarMap`; a
//!   [`VarBuilder`](candle_nn::VarBuilder) hands any candle-nn layer casts
//!   of them in f16 or bf16. The cast is differentiable, so the backward
//!   runs in the compute dtype and the gradients arrive in f32, on the
//!   masters, where the optimizer steps.
//! * [`GradScaler`]: dynamic loss scaling with the protocol of
//!   `torch.amp.GradScaler`: `scale` the loss, `unscale` the gradients once
//!   per step (or let `step` do it), a step whose gradients hold an inf or
//!   NaN is skipped, and `update` grows or backs off the scale. Inf/NaN is
//!   found on the device, with one host synchronisation per step.
//! * [`InfCheck`]: whether any of many tensors holds an inf or NaN, with
//!   one number read back (the scaler's check, for optimizers that hold
//!   their own gradients too).
//! * [`clip_grad_norm`]: clipping by the global L2 norm, one host
//!   synchronisation.
#![warn(missing_docs)]

mod clip;
mod inf_check;
mod master;
mod scaler;

pub use clip::clip_grad_norm;
pub use inf_check::InfCheck;
pub use master::MasterWeights;
pub use scaler::{GradScaler, ScaleChange, ScalerConfig, ScalerState, StepOutcome};

// The README's whole training loop, run by `cargo test --doc`.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
