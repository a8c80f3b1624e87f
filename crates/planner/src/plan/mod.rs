//! The planner: fits a GPT's training step into a memory budget, predicts
//! the peak and the time of every option it weighed, and proves its choice
//! by running it.
//!
//! Each way of computing the model (a [`Recipe`]) in each dtype, with and
//! without checkpointing, is calibrated by measured steps at batch 1, 2
//! and 4. A step's peak is the largest of a few lines in the batch (each
//! moment of the step holds a fixed part, parameters, gradients so far and
//! optimizer state, and a part in proportion to the batch, activations and
//! working set), so it grows in steps of a slope that can only rise with
//! the batch; from batch 2 on, the line through batch 2 and 4 held within
//! a few percent in every case measured, where the one through 1 and 2 fell
//! 8% short at batch 16. One working set grows more slowly past a size:
//! bf16's products on the CPU widen to f32 at most
//! [`BF16_SLICE`](candle_lean_nn::BF16_SLICE) rows at once, so where batch
//! 2 is still below that many rows the line through 2 and 4 is too steep
//! (8 to 11% over at batch 8 on a 64-token model). There the calibration
//! goes on doubling the batch, up to the batch to plan, until its last two
//! batches are past that size. A micro-batch of `m >= 2` sequences is
//! predicted on the line through the two calibrated batches around it, or
//! past the last on the line through the last two. A checkpointed or direct
//! step marks each stage's backward, and each stretch between two marks has
//! a line of its own: the prediction is the highest of them and the whole
//! step's. The moments differ in what they hold: the last block's backward
//! holds fewer gradients than the first block's and more activations, so
//! at a larger batch it overtakes them (chapter 3's model, checkpointed
//! direct step: the whole step's line fell 9% short at batch 16 and 15% at
//! 32). Checkpointed, the head and each segment's recompute are stretches
//! apart from the segment's backward: the recompute's line is the steeper,
//! the backward's the higher at batch 4, and with the two in one stretch
//! the prediction fell 3.4% short at batch 16. One sequence at a time is
//! measured; when gradients are
//! accumulated over several micro-batches, the later micro-batches hold the
//! sum they are added into (the parameters' size, or under ZeRO stages 2
//! and 3 the rank's f32 blocks of it), and the step's peak is the first
//! micro-batch's or a later one's, whichever is higher. A direct backward
//! marks each layer's backward, and a later micro-batch adds each gradient
//! into the sum as it is made: at each stretch it holds the sum instead of
//! the gradients the calibrated step had collected before the stretch
//! (counting both, micro-batches of one sequence were predicted 5 to 12%
//! over).
//!
//! On N ranks (data parallelism, ZeRO stage 1, 2 or 3), the budget is each
//! rank's and each rank trains on `batch / N` sequences. A rank's steps are
//! calibrated in this one process over a [`Rehearsal`] of the job: the
//! collectives allocate what a real rank's do, the peers are stand-ins, so
//! the calibration measures what one rank allocates through Rust's
//! allocator without starting any (the MPI library's own buffers are
//! outside the count, in the calibration and on the real ranks alike); the
//! verification runs the real ranks.

use std::sync::Arc;

use candle_core::DType;
use candle_distributed::{Comm, Rehearsal, Split};
use serde::Serialize;
use workbook_sdk::observe::Tags;
use workbook_sdk::{anyhow, Context};

use workbook_models::{GptConfig, Recipe};

use crate::margin::fits;
use crate::stage::Stage;
use crate::step::{calibrate, Parallel, StepShape};

mod calibration;
mod verify;

use calibration::largest_micro;
pub use calibration::Calibration;
pub use verify::{of_ranks, verify, Verification, VerifyRequest};

/// What to plan for.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanRequest {
    /// The model (its `attention` and `lean` are the planner's to choose).
    pub model: GptConfig,
    /// Sequences per optimizer step.
    pub batch: usize,
    /// The most bytes the step may hold at once.
    pub budget: u64,
    /// The share of a prediction it may be off by: an option fits when its
    /// predicted peak, so much larger, is within the budget. With the
    /// verification's tolerance here, a plan whose measured peak is within
    /// that tolerance of its prediction is within the budget too.
    pub margin: f64,
    /// The dtypes to consider.
    pub dtypes: Vec<DType>,
    /// The recipes to consider.
    pub recipes: Vec<Recipe>,
    /// Whether to consider checkpointing every layer as well.
    pub checkpointing: bool,
    /// Seed of weights and data.
    pub seed: u64,
    /// Ranks sharing the batch (1: one process).
    pub ranks: usize,
    /// With more than one rank, the ways to share the training to
    /// consider: DDP, ZeRO stage 1, 2, 3.
    pub stages: Vec<Stage>,
}

impl PlanRequest {
    /// The sequences each rank trains on per step; an error when the batch
    /// does not split evenly.
    pub fn batch_per_rank(&self) -> anyhow::Result<usize> {
        if self.ranks == 0 {
            anyhow::bail!("0 ranks; allowed: at least 1");
        }
        if self.batch == 0 || !self.batch.is_multiple_of(self.ranks) {
            anyhow::bail!(
                "a batch of {} sequences does not split evenly over {} ranks; allowed: a \
                 positive multiple of {}",
                self.batch,
                self.ranks,
                self.ranks
            );
        }
        Ok(self.batch / self.ranks)
    }

    /// The sharings weighed: `None` alone for one process.
    fn sharings(&self) -> Vec<Option<Stage>> {
        if self.ranks > 1 {
            self.stages.iter().copied().map(Some).collect()
        } else {
            vec![None]
        }
    }
}

/// One option the planner weighed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Candidate {
    /// How the layers are computed.
    pub recipe: Recipe,
    /// Whether every layer is checkpointed.
    pub checkpointed: bool,
    /// The dtype's name.
    pub dtype: &'static str,
    /// How the ranks share the training (none: one process).
    pub stage: Option<Stage>,
    /// Sequences per micro-batch.
    pub micro_batch: usize,
    /// Micro-batches per step.
    pub micro_steps: usize,
    /// Predicted peak (per rank), bytes.
    pub peak: u64,
    /// Predicted step time, seconds: the computation's (on N ranks, one
    /// rank's on this machine; the time on the wire is not predicted).
    pub seconds: f64,
    /// Whether the peak, with the request's margin, is within the budget.
    pub fits: bool,
    /// Whether no other option is both smaller and faster.
    pub on_frontier: bool,
}

/// The planner's answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// The budget (per rank), bytes.
    pub budget: u64,
    /// Ranks sharing the batch.
    pub ranks: usize,
    /// Sequences each rank trains on per step.
    pub batch_per_rank: usize,
    /// The margin every option was held to.
    pub margin: f64,
    /// The calibrations it rests on.
    pub calibrations: Vec<Calibration>,
    /// Every option weighed: for each recipe and dtype, the whole batch and,
    /// when it does not fit, the largest micro-batch that does (or one
    /// sequence at a time, when none does); the direct recipes, the whole
    /// batch only.
    pub candidates: Vec<Candidate>,
    /// The fastest option that fits, if one does.
    pub chosen: Option<Candidate>,
}

/// Calibrates every recipe in every dtype of `req` and weighs the options.
pub fn plan(ctx: &mut Context, req: &PlanRequest) -> anyhow::Result<Plan> {
    if req.batch == 0 {
        anyhow::bail!("a batch of 0 sequences: nothing to plan");
    }
    req.batch_per_rank()?;
    if req.ranks > 1 && req.stages.is_empty() {
        anyhow::bail!(
            "{} ranks and no stage to weigh; allowed: ddp, zero1, zero2, zero3",
            req.ranks
        );
    }
    let mut calibrations = Vec::new();
    let checkpointing: &[bool] = if req.checkpointing {
        &[false, true]
    } else {
        &[false]
    };
    for stage in req.sharings() {
        for &recipe in &req.recipes {
            for &dtype in &req.dtypes {
                for &checkpointed in checkpointing {
                    let config = recipe.apply(req.model);
                    let what = format!(
                        "{}{} in {}{}",
                        stage
                            .map(|s| format!("{} on {} ranks, ", s.name(), req.ranks))
                            .unwrap_or_default(),
                        recipe.name(),
                        dtype.as_str(),
                        if checkpointed { ", checkpointed" } else { "" }
                    );
                    let parallel = stage.map(|s| rehearsal(req.ranks, s)).transpose()?;
                    let batches = calibration_batches(
                        config.seq,
                        dtype == DType::BF16 && ctx.device().is_cpu(),
                        req.batch_per_rank()?,
                    );
                    let steps = calibrate(
                        ctx,
                        &what,
                        config,
                        dtype,
                        &StepShape::wholes(&batches, checkpointed)
                            .into_iter()
                            .map(|s| StepShape {
                                direct: recipe.direct(),
                                ..s
                            })
                            .collect::<Vec<_>>(),
                        req.seed,
                        parallel.as_ref(),
                    )?;
                    let param_bytes = steps[0].params * dtype.size_in_bytes() as u64;
                    calibrations.push(Calibration {
                        recipe,
                        checkpointed,
                        dtype: dtype.as_str(),
                        stage,
                        peaks: steps.iter().map(|s| s.peak()).collect(),
                        seconds: steps.iter().map(|s| s.seconds).collect(),
                        phase_peaks: steps.iter().map(|s| s.phases.clone()).collect(),
                        // The same gradients at every batch.
                        phase_grads: steps[0].phase_grads.clone(),
                        batches,
                        param_bytes,
                        sum_bytes: match stage {
                            Some(Stage::Zero2 | Stage::Zero3) => config
                                .param_sizes()
                                .iter()
                                .map(|&n| 4 * Split::new(n, req.ranks).block() as u64)
                                .sum(),
                            _ => param_bytes,
                        },
                        // Token ids and targets, u32 each.
                        batch_bytes_per_sequence: (2 * config.seq * 4) as u64,
                    });
                }
            }
        }
    }
    Ok(weigh(req, calibrations))
}

/// The batches to calibrate at for sequences of `seq` tokens and a batch
/// per rank of `batch`: 1, 2 and 4; where bf16's products slice (`sliced`:
/// bf16 on the CPU), doubled on while the last line would start at or
/// below [`BF16_SLICE`](candle_lean_nn::BF16_SLICE) rows and the batch is
/// not yet reached, so that the line the larger micro-batches are
/// predicted on lies where the products' working set has stopped growing.
fn calibration_batches(seq: usize, sliced: bool, batch: usize) -> Vec<usize> {
    let mut batches: Vec<usize> = vec![1, 2, 4];
    if !sliced {
        return batches;
    }
    loop {
        let (before, last) = (batches[batches.len() - 2], batches[batches.len() - 1]);
        if before.saturating_mul(seq) > candle_lean_nn::BF16_SLICE || last >= batch {
            return batches;
        }
        batches.push(last * 2);
    }
}

/// Rank 0 of a rehearsed job of `ranks`, sharing the training as `stage`.
fn rehearsal(ranks: usize, stage: Stage) -> anyhow::Result<Parallel> {
    let comm = Comm::new(Rehearsal::new(ranks)?).observed(Tags);
    Ok(Parallel::new(Arc::new(comm), stage))
}

/// The options from calibrations: for each, the whole batch and the
/// largest micro-batch that fits; the fastest that fits is chosen.
/// `req`'s batch must split evenly over its ranks ([`plan`] checks it).
pub fn weigh(req: &PlanRequest, calibrations: Vec<Calibration>) -> Plan {
    let mut candidates = Vec::new();
    debug_assert!(req.batch_per_rank().is_ok(), "a batch that splits evenly");
    let batch = req.batch / req.ranks.max(1);
    for c in &calibrations {
        let mut micros = vec![batch];
        let within = |peak: u64| fits(peak, req.budget, req.margin);
        let largest_fitting = largest_micro(c, batch, within);
        if !within(c.peak(batch, batch)) && batch > 1 {
            // The largest micro-batch that fits, or, when none does, one
            // sequence at a time: the least this recipe and dtype can need.
            micros.push(largest_fitting.unwrap_or(1));
        }
        for m in micros {
            let peak = c.peak(batch, m);
            candidates.push(Candidate {
                recipe: c.recipe,
                checkpointed: c.checkpointed,
                dtype: c.dtype,
                stage: c.stage,
                micro_batch: m,
                micro_steps: batch.div_ceil(m),
                peak,
                seconds: c.seconds(batch, m),
                fits: within(peak),
                on_frontier: false,
            });
        }
    }
    let all = candidates.clone();
    for c in &mut candidates {
        c.on_frontier = !all.iter().any(|o| {
            o.peak <= c.peak && o.seconds <= c.seconds && (o.peak < c.peak || o.seconds < c.seconds)
        });
    }
    let chosen = candidates
        .iter()
        .filter(|c| c.fits)
        .min_by(|a, b| a.seconds.total_cmp(&b.seconds).then(a.peak.cmp(&b.peak)))
        .cloned();
    Plan {
        budget: req.budget,
        ranks: req.ranks,
        batch_per_rank: batch,
        margin: req.margin,
        calibrations,
        candidates,
        chosen,
    }
}

#[cfg(test)]
mod tests;
