//! The four ways to train on N ranks, and what ZeRO's analysis says each
//! holds and sends.

use serde::{Deserialize, Serialize};

/// Data parallelism or a ZeRO stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Stage {
    /// DistributedDataParallel: everything replicated, gradients all-reduced.
    Ddp,
    /// ZeRO stage 1: optimizer state partitioned.
    Zero1,
    /// ZeRO stage 2: gradients partitioned too.
    Zero2,
    /// ZeRO stage 3 (FSDP): parameters partitioned too.
    Zero3,
}

impl Stage {
    /// All four, in order of what they partition.
    pub const ALL: [Stage; 4] = [Stage::Ddp, Stage::Zero1, Stage::Zero2, Stage::Zero3];

    /// The name in metrics and tables.
    pub fn name(self) -> &'static str {
        match self {
            Stage::Ddp => "ddp",
            Stage::Zero1 => "zero1",
            Stage::Zero2 => "zero2",
            Stage::Zero3 => "zero3",
        }
    }

    /// Bytes per rank of parameters, gradients and optimizer state for `psi`
    /// parameters split in blocks of `block` over the ranks, trained in f32
    /// with AdamW (4 bytes per parameter, 4 per gradient, 8 of moments):
    /// Rajbhandari et al.'s formulas with 4-byte parameters and gradients
    /// and K = 8 (an f32 parameter is its own master copy).
    pub fn formula(self, psi: u64, block: u64) -> ModelState {
        let (whole, part) = (4 * psi, 4 * block);
        match self {
            Stage::Ddp => ModelState::new(whole, whole, 2 * whole),
            Stage::Zero1 => ModelState::new(whole, whole, 2 * part),
            Stage::Zero2 => ModelState::new(whole, part, 2 * part),
            Stage::Zero3 => ModelState::new(part, part, 2 * part),
        }
    }

    /// Bytes a rank sends per step under the ring algorithms: 2Ψ f32
    /// elements times (N - 1)/N for DDP (an all-reduce of the gradients as
    /// they are) and for stages 1 and 2 (a reduce-scatter and an all-gather
    /// of each tensor padded to a multiple of N, `padded` in all), 3Ψ for
    /// stage 3 (two all-gathers of the parameters and a reduce-scatter of
    /// the gradients). The count rounds each call down to the byte, so the
    /// two agree to the byte where every bucket and tensor divides by N.
    pub fn sent_formula(self, psi: u64, padded: u64, ranks: u64) -> u64 {
        let (volumes, elements) = match self {
            Stage::Ddp => (2, psi),
            Stage::Zero1 | Stage::Zero2 => (2, padded),
            Stage::Zero3 => (3, padded),
        };
        volumes * 4 * elements * (ranks - 1) / ranks
    }
}

/// Bytes of model states.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelState {
    /// Parameters.
    pub params: u64,
    /// Gradients.
    pub grads: u64,
    /// Optimizer state.
    pub optim: u64,
}

impl ModelState {
    /// The three.
    pub fn new(params: u64, grads: u64, optim: u64) -> Self {
        Self {
            params,
            grads,
            optim,
        }
    }

    /// Their sum.
    pub fn total(&self) -> u64 {
        self.params + self.grads + self.optim
    }
}
