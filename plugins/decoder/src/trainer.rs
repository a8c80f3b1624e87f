//! The optimizer a `decoder_step` variant steps with: AdamW with its state
//! on the device, on the host, or partitioned over ranks (ZeRO), behind one
//! interface.

use std::sync::Arc;

use candle_distributed::{Comm, Rehearsal, ZeroAdamW};
use candle_lean_optim::LeanAdamW;
use candle_offload::HostAdamW;
use workbook_models::llama::Llama;
use workbook_planner::decoder::Sharing;
use workbook_planner::Stage;
use workbook_sdk::candle::backprop::GradStore;
use workbook_sdk::candle::{bail, Device, Result, Tensor, Var};
use workbook_sdk::candle_nn::{Optimizer, ParamsAdamW};
use workbook_sdk::observe::Tags;

/// AdamW with its state where a [`Sharing`] says.
pub enum Trainer {
    /// Beside the parameters, updated in place.
    Device(LeanAdamW),
    /// f32 masters and moments on the host.
    Offload(HostAdamW),
    /// Rank 0 of a ZeRO job, its peers rehearsed in this process
    /// ([`Rehearsal`]): every collective fills the buffers a real rank's
    /// would, so the memory is a real rank's (the values outside its block
    /// are not). Stage 2 when it takes each layer's gradients.
    Zero(ZeroAdamW, Stage),
}

impl Trainer {
    /// The optimizer for `model`'s variables.
    pub fn new(model: &Llama, params: ParamsAdamW, sharing: Sharing) -> Result<Self> {
        let vars = model.vars();
        Ok(match sharing {
            Sharing::Device => Self::Device(LeanAdamW::with_observer(vars, params, Tags)?),
            Sharing::Offload => Self::Offload(HostAdamW::on(vars, params, Device::Cpu, Tags)?),
            Sharing::Zero1 { ranks } | Sharing::Zero2 { ranks } => {
                let stage = match sharing {
                    Sharing::Zero2 { .. } => Stage::Zero2,
                    _ => Stage::Zero1,
                };
                let comm = Comm::new(Rehearsal::new(ranks)?).observed(Tags);
                Self::Zero(ZeroAdamW::new(Arc::new(comm), vars, params)?, stage)
            }
        })
    }

    /// Takes one layer's gradient of `var` as the backward makes it: to the
    /// host, or reduce-scattered to this rank's block (stage 2).
    pub fn take(&mut self, var: &Var, grad: &Tensor) -> Result<()> {
        match self {
            Self::Offload(host) => host.receive(var, grad),
            Self::Zero(zero, Stage::Zero2) => zero.reduce_gradient(var, grad),
            _ => bail!("this optimizer takes the whole step's gradients, not a layer's"),
        }
    }

    /// Steps with the gradients [`take`](Self::take)n since the last step.
    pub fn step_taken(&mut self) -> Result<()> {
        match self {
            Self::Offload(host) => host.step_received(),
            Self::Zero(zero, Stage::Zero2) => zero.step_reduced(),
            _ => bail!("this optimizer takes no gradients one layer at a time"),
        }
    }

    /// Steps with a whole step's gradients.
    pub fn step(&mut self, grads: &GradStore) -> Result<()> {
        match self {
            Self::Device(adamw) => adamw.step(grads),
            Self::Offload(host) => host.step(grads),
            Self::Zero(zero, _) => zero.step(grads),
        }
    }
}
