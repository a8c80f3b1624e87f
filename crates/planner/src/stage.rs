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
    /// parameters split in blocks of `block` over the ranks, with AdamW, as
    /// this workbook's stages hold them.
    ///
    /// In f32 (4 bytes per parameter, 4 per gradient, 8 of moments) these
    /// are Rajbhandari et al.'s formulas with 4-byte parameters and
    /// gradients and K = 8: an f32 parameter is its own master copy. In
    /// bf16 they are the paper's with K = 12 (an f32 master and two
    /// moments) but for two things the toolkit does otherwise: stage 2
    /// keeps its gradient blocks in f32 (4Ψ/N, where the paper has 2Ψ/N),
    /// and stage 3 keeps its parameter blocks in f32 as the master copies
    /// themselves, so they count as parameters (4Ψ/N) and the optimizer
    /// state is the moments (8Ψ/N): the paper's 16Ψ/N in all. See
    /// [`Stage::paper`].
    pub fn formula(self, psi: u64, block: u64, precision: Precision) -> ModelState {
        let (whole, part) = (psi, block);
        match (precision, self) {
            (Precision::F32, Stage::Ddp) => ModelState::new(4 * whole, 4 * whole, 8 * whole),
            (Precision::F32, Stage::Zero1) => ModelState::new(4 * whole, 4 * whole, 8 * part),
            (Precision::F32, Stage::Zero2) => ModelState::new(4 * whole, 4 * part, 8 * part),
            (Precision::F32, Stage::Zero3) => ModelState::new(4 * part, 4 * part, 8 * part),
            (Precision::Bf16, Stage::Ddp) => ModelState::new(2 * whole, 2 * whole, 12 * whole),
            (Precision::Bf16, Stage::Zero1) => ModelState::new(2 * whole, 2 * whole, 12 * part),
            (Precision::Bf16, Stage::Zero2) => ModelState::new(2 * whole, 4 * part, 12 * part),
            (Precision::Bf16, Stage::Zero3) => ModelState::new(4 * part, 4 * part, 8 * part),
        }
    }

    /// Model-state bytes per rank by Rajbhandari et al. 2020 as printed,
    /// for 2-byte parameters and gradients and K = 12 in mixed precision:
    /// (2 + 2 + K)Ψ, 4Ψ + KΨ/N, 2Ψ + (2 + K)Ψ/N, (2 + 2 + K)Ψ/N, with
    /// `block` for Ψ/N; in f32 the same with 4-byte parameters and
    /// gradients and K = 8, which is [`Stage::formula`].
    pub fn paper(self, psi: u64, block: u64, precision: Precision) -> u64 {
        match precision {
            Precision::F32 => self.formula(psi, block, precision).total(),
            Precision::Bf16 => match self {
                Stage::Ddp => 16 * psi,
                Stage::Zero1 => 4 * psi + 12 * block,
                Stage::Zero2 => 2 * psi + 14 * block,
                Stage::Zero3 => 16 * block,
            },
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

/// The dtype the model trains in.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything in f32.
    #[default]
    F32,
    /// Mixed precision: bf16 parameters and gradients, f32 master weights
    /// and moments (in blocks over the ranks from stage 1 on).
    Bf16,
}

impl Precision {
    /// How tables and plots name it.
    pub fn describe(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16 mixed precision",
        }
    }

    /// The dtype of the parameters and the compute.
    pub fn dtype(self) -> workbook_sdk::candle::DType {
        match self {
            Precision::F32 => workbook_sdk::candle::DType::F32,
            Precision::Bf16 => workbook_sdk::candle::DType::BF16,
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The paper's figures for Ψ = 7.5 B on N = 64 (its Figure 1: 120 GB,
    /// 31.4 GB, 16.6 GB and 1.9 GB per device with K = 12), and the
    /// toolkit's own split where it differs.
    #[test]
    fn mixed_precision_matches_the_papers_figure_one() {
        let (psi, n) = (7_500_000_000u64, 64u64);
        let block = psi / n;
        // To the figure's printed precision: tenths of a GB.
        let gb = |b: u64| (b as f64 / 1e8).round() / 10.0;
        let paper: Vec<f64> = Stage::ALL
            .iter()
            .map(|s| gb(s.paper(psi, block, Precision::Bf16)))
            .collect();
        assert_eq!(paper, [120.0, 31.4, 16.6, 1.9]);
        let ours: Vec<f64> = Stage::ALL
            .iter()
            .map(|s| gb(s.formula(psi, block, Precision::Bf16).total()))
            .collect();
        // Stage 2's gradient blocks in f32: 2Ψ/N more.
        assert_eq!(ours, [120.0, 31.4, 16.9, 1.9]);
        assert_eq!(
            Stage::Zero3.formula(psi, block, Precision::Bf16),
            ModelState::new(4 * block, 4 * block, 8 * block)
        );
    }

    /// In f32, K = 8 and 4-byte parameters and gradients: 16Ψ, 8Ψ + 8Ψ/N,
    /// 4Ψ + 12Ψ/N, 16Ψ/N.
    #[test]
    fn in_f32_the_paper_is_the_formula() {
        let (psi, block) = (1000, 250);
        let totals: Vec<u64> = Stage::ALL
            .iter()
            .map(|s| s.formula(psi, block, Precision::F32).total())
            .collect();
        assert_eq!(totals, [16_000, 10_000, 7_000, 4_000]);
        for s in Stage::ALL {
            assert_eq!(s.paper(psi, block, Precision::F32), totals[s as usize]);
        }
    }
}
