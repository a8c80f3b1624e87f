//! Running a plan's chosen option and measuring what it held.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use workbook_sdk::{anyhow, Context};

use workbook_models::{GptConfig, Recipe};

use super::{Candidate, PlanRequest};
use crate::stage::Stage;
use crate::step::{measured_step, Parallel, StepShape};

/// What running the chosen option measured.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Verification {
    /// The measured peak, bytes (the largest of the steps run, on the
    /// rank that held the most).
    pub peak: u64,
    /// The predicted peak, bytes.
    pub predicted: u64,
    /// The budget, bytes.
    pub budget: u64,
    /// The median measured step time, seconds (on N ranks, the slowest
    /// rank's).
    pub seconds: f64,
    /// Ranks it ran on (1: one process).
    pub ranks: usize,
}

impl Verification {
    /// Measured over predicted, less one.
    pub fn error(&self) -> f64 {
        self.peak as f64 / self.predicted as f64 - 1.0
    }

    /// Whether the plan kept its promise: within the budget and within
    /// `tolerance` of the prediction.
    pub fn kept(&self, tolerance: f64) -> bool {
        self.peak <= self.budget && self.error().abs() <= tolerance
    }
}

/// What a verification runs: the chosen option of a plan, for one process
/// or for each rank of a job (which reads it as JSON).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VerifyRequest {
    /// The model (the recipe sets its attention kind and `lean`).
    pub model: GptConfig,
    /// How the layers are computed.
    pub recipe: Recipe,
    /// The dtype's name.
    pub dtype: String,
    /// Whether every layer is checkpointed.
    pub checkpointed: bool,
    /// How the ranks share the training (none: one process).
    pub stage: Option<Stage>,
    /// Sequences each rank (or the one process) trains on per step.
    pub batch: usize,
    /// Sequences per micro-batch.
    pub micro_batch: usize,
    /// The predicted peak, bytes.
    pub predicted: u64,
    /// The budget, bytes.
    pub budget: u64,
    /// Steps to run (each from a fresh model, as the calibration's).
    pub steps: usize,
    /// Seed of weights and data.
    pub seed: u64,
    /// Where each rank writes its `verify-R.json` (ranks only).
    pub out: Option<PathBuf>,
    /// The most heap each rank may hold at once (a cell's cap), if any.
    #[serde(default)]
    pub max_memory: Option<u64>,
}

impl VerifyRequest {
    /// The verification of `chosen`, an option of a plan for `req`.
    pub fn new(req: &PlanRequest, chosen: &Candidate, steps: usize) -> anyhow::Result<Self> {
        Ok(Self {
            model: req.model,
            recipe: chosen.recipe,
            dtype: chosen.dtype.to_string(),
            checkpointed: chosen.checkpointed,
            stage: chosen.stage,
            batch: req.batch_per_rank()?,
            micro_batch: chosen.micro_batch,
            predicted: chosen.peak,
            budget: req.budget,
            steps: steps.max(1),
            seed: req.seed,
            out: None,
            max_memory: None,
        })
    }
}

/// Runs the steps of `req` (one rank's, with `parallel`) and measures them.
pub fn verify(
    ctx: &mut Context,
    req: &VerifyRequest,
    parallel: Option<&Parallel>,
) -> anyhow::Result<Verification> {
    let config = req.recipe.apply(req.model);
    let dtype = workbook_sdk::parse_dtype(&req.dtype)?;
    // Each thread's packing buffers are made before the measurement, as
    // in the calibration.
    workbook_sdk::device::warm_up(ctx.device())?;
    let mut peak = 0;
    let mut times = Vec::new();
    for i in 0..req.steps.max(1) {
        ctx.progress(&format!("verifying: step {} of {}", i + 1, req.steps));
        let step = measured_step(
            ctx,
            format!("plan, step {}", i + 1),
            config,
            dtype,
            StepShape {
                batch: req.batch,
                micro_batch: req.micro_batch,
                checkpointed: req.checkpointed,
                direct: req.recipe.direct(),
            },
            req.seed,
            parallel,
        )?;
        peak = peak.max(step.peak());
        times.push(step.seconds);
    }
    Ok(Verification {
        peak,
        predicted: req.predicted,
        budget: req.budget,
        seconds: workbook_sdk::median(times),
        ranks: parallel.map_or(1, |p| p.comm.size()),
    })
}

/// The verification of a job from its ranks': the largest peak, the
/// slowest rank's time.
pub fn of_ranks(each: &[Verification]) -> Option<Verification> {
    let first = *each.first()?;
    Some(Verification {
        peak: each.iter().map(|v| v.peak).max().unwrap_or(0),
        seconds: each.iter().map(|v| v.seconds).fold(0.0, f64::max),
        ranks: each.len(),
        ..first
    })
}
