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

use std::path::PathBuf;
use std::sync::Arc;

use candle_core::DType;
use candle_distributed::{Comm, Rehearsal, Split};
use serde::{Deserialize, Serialize};
use workbook_sdk::observe::Tags;
use workbook_sdk::{anyhow, Context};

use workbook_models::{GptConfig, Recipe};

use crate::margin::fits;
use crate::stage::Stage;
use crate::step::{calibrate, measured_step, Parallel, StepShape};

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

/// The measured steps of one recipe in one dtype.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Calibration {
    /// The recipe.
    pub recipe: Recipe,
    /// Whether every layer is checkpointed.
    pub checkpointed: bool,
    /// The dtype's name.
    pub dtype: &'static str,
    /// How the ranks share the training (none: one process).
    pub stage: Option<Stage>,
    /// The batches measured: 1, 2, 4 and the doublings that follow where
    /// bf16's products need them (see the module).
    pub batches: Vec<usize>,
    /// Peak at each of `batches` (per rank).
    pub peaks: Vec<u64>,
    /// Step time at each of `batches`, seconds.
    pub seconds: Vec<f64>,
    /// At each of `batches`, the peak of each stretch of the step between
    /// two of its backward's marks
    /// ([`StepReport::phases`](crate::step::StepReport::phases)): a moment whose
    /// own line is steeper overtakes the step's peak at a larger batch.
    pub phase_peaks: Vec<Vec<u64>>,
    /// Bytes of the parameters' gradients held at the start of each
    /// stretch, where the calibrated step collected them as its backward
    /// handed them over
    /// ([`StepReport::phase_grads`](crate::step::StepReport::phase_grads));
    /// empty where it did not.
    pub phase_grads: Vec<u64>,
    /// Bytes of the whole model's parameters in the dtype (what DDP and
    /// stages 1 and 2 hold on each rank; under stage 3 a rank holds its f32
    /// blocks of them instead).
    pub param_bytes: u64,
    /// Bytes of the gradient sum held while micro-batches accumulate: the
    /// parameters' size, or under ZeRO stages 2 and 3 this rank's f32
    /// blocks.
    pub sum_bytes: u64,
    /// Bytes of one sequence's tokens and targets: the whole batch's are
    /// held while its micro-batches run one after another.
    pub batch_bytes_per_sequence: u64,
}

impl Calibration {
    /// The indices in `batches` of the two calibrated batches whose line
    /// predicts a micro-batch of `m >= 2`: the pair around it, or past the
    /// last, the last two.
    fn segment(&self, m: usize) -> (usize, usize) {
        let last = self.batches.len().saturating_sub(1).max(2);
        let mut i = 1;
        while i + 1 < last && self.batches.get(i + 1).is_some_and(|&b| b < m) {
            i += 1;
        }
        (i, i + 1)
    }

    /// The peak's line through the calibrated batches `i` and `j`: what it
    /// holds whatever the batch, and what each sequence adds.
    fn line(&self, (i, j): (usize, usize)) -> (u64, u64) {
        self.line_of(&self.peaks, (i, j))
    }

    /// The line through `peaks[i]` at batch `i`'s size and `peaks[j]`.
    fn line_of(&self, peaks: &[u64], (i, j): (usize, usize)) -> (u64, u64) {
        let span = (self.batches[j] - self.batches[i]).max(1) as u64;
        let per = peaks[j].saturating_sub(peaks[i]) / span;
        let fixed = peaks[i].saturating_sub(self.batches[i] as u64 * per);
        (fixed, per)
    }

    /// Each stretch's peak at `m` sequences: measured at one, on its own
    /// line through the calibrated batches `segment` past that, where every
    /// calibrated step had the same stretches.
    fn stretches_at(&self, m: usize, segment: (usize, usize)) -> Option<Vec<u64>> {
        let count = self.phase_peaks.first()?.len();
        if self.phase_peaks.len() != self.batches.len()
            || self.phase_peaks.iter().any(|p| p.len() != count)
        {
            return None;
        }
        if m <= 1 {
            return Some(self.phase_peaks[0].clone());
        }
        Some(
            (0..count)
                .map(|k| {
                    let peaks: Vec<u64> = self.phase_peaks.iter().map(|p| p[k]).collect();
                    let (fixed, per) = self.line_of(&peaks, segment);
                    fixed.saturating_add((m as u64).saturating_mul(per))
                })
                .collect(),
        )
    }

    /// What each sequence adds to the peak past the last calibrated batch
    /// (on the line through the last two).
    pub fn per_sequence(&self) -> u64 {
        self.line(self.segment(usize::MAX)).1
    }

    /// What the peak's line past the last calibrated batch holds whatever
    /// the batch.
    pub fn fixed(&self) -> u64 {
        self.line(self.segment(usize::MAX)).0
    }

    /// The two batches whose line [`fixed`](Self::fixed) and
    /// [`per_sequence`](Self::per_sequence) give.
    pub fn last_line(&self) -> (usize, usize) {
        let (i, j) = self.segment(usize::MAX);
        (self.batches[i], self.batches[j])
    }

    /// The predicted peak of one micro-batch of `micro` sequences.
    fn micro_peak(&self, micro: usize) -> u64 {
        match micro {
            0 | 1 => self.peaks[0],
            m => {
                let segment = self.segment(m);
                let (fixed, per) = self.line(segment);
                let whole = fixed.saturating_add((m as u64).saturating_mul(per));
                let stretches = self.stretches_at(m, segment).unwrap_or_default();
                whole.max(stretches.into_iter().max().unwrap_or(0))
            }
        }
    }

    /// The predicted peak of a micro-batch of `micro` after the first,
    /// the gradient sum beside it. Where the calibrated steps collected the
    /// gradients as the backward handed them over, each stretch holds the
    /// sum instead of the gradients made before it (a later micro-batch adds
    /// each into the sum as it is made): counting both over-predicted
    /// micro-batches of one sequence by 5 to 12%. Elsewhere, the micro-batch's
    /// peak and the whole sum.
    fn later_micro_peak(&self, micro: usize) -> u64 {
        let whole = || self.micro_peak(micro).saturating_add(self.sum_bytes);
        let Some(stretches) = self.stretches_at(micro, self.segment(micro)) else {
            return whole();
        };
        if self.phase_grads.len() != stretches.len() {
            return whole();
        }
        stretches
            .iter()
            .zip(&self.phase_grads)
            .map(|(&peak, &grads)| peak.saturating_sub(grads))
            .max()
            .unwrap_or(0)
            .saturating_add(self.sum_bytes)
    }

    /// The predicted peak of a step of `batch` in micro-batches of `micro`:
    /// the first micro-batch's, or a later one's with the gradient sum
    /// beside it (the later micro-batches are `micro` again, or only the
    /// rest of the batch when there are two), whichever is higher; the
    /// whole batch's tokens are held throughout.
    pub fn peak(&self, batch: usize, micro: usize) -> u64 {
        let micro = micro.clamp(1, batch.max(1));
        if micro == batch {
            return self.micro_peak(micro);
        }
        let later = if batch / micro >= 2 {
            micro
        } else {
            batch - micro
        };
        let tokens = (batch - micro) as u64 * self.batch_bytes_per_sequence;
        self.micro_peak(micro).max(self.later_micro_peak(later)) + tokens
    }

    /// The predicted time of such a step: each micro-batch's time on the
    /// line through the calibrated batches around it, as its peak (measured
    /// for one sequence), the update's
    /// share of the fixed time counted each time, which errs on the slow
    /// side.
    pub fn seconds(&self, batch: usize, micro: usize) -> f64 {
        let micro = micro.clamp(1, batch.max(1));
        let time = |m: usize| match m {
            1 => self.seconds[0],
            m => {
                let (i, j) = self.segment(m);
                let span = (self.batches[j] - self.batches[i]).max(1) as f64;
                let per = ((self.seconds[j] - self.seconds[i]) / span).max(0.0);
                let fixed = (self.seconds[i] - self.batches[i] as f64 * per).max(0.0);
                fixed + per * m as f64
            }
        };
        let (whole, rest) = (batch / micro, batch % micro);
        whole as f64 * time(micro) + if rest > 0 { time(rest) } else { 0.0 }
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

/// The largest micro-batch below `batch` whose predicted step `fits`, by
/// bisection rather than by trying every size (a batch may be 10^11).
/// [`Calibration::peak`] has two regimes. Past half the batch, the later
/// micro-batch is the remainder: the first micro-batch's peak grows with
/// `m` and the later one's shrinks, so the sizes that fit form a range and
/// its top is where the first stops fitting. Up to half the batch, every
/// micro-batch is `m` and the peak grows with it.
fn largest_micro(c: &Calibration, batch: usize, fits: impl Fn(u64) -> bool) -> Option<usize> {
    // The last m in lo..=hi for which `ok` holds, where it holds up to a
    // point and not past it.
    let last = |lo: usize, hi: usize, ok: &dyn Fn(usize) -> bool| -> Option<usize> {
        if lo > hi || !ok(lo) {
            return None;
        }
        let (mut good, mut bad) = (lo, hi + 1);
        while bad - good > 1 {
            let mid = good + (bad - good) / 2;
            if ok(mid) {
                good = mid;
            } else {
                bad = mid;
            }
        }
        Some(good)
    };
    let half = batch / 2;
    let tokens = |m: usize| (batch - m) as u64 * c.batch_bytes_per_sequence;
    let first_fits = |m: usize| fits(c.micro_peak(m).saturating_add(tokens(m)));
    if let Some(m) = last(half + 1, batch.saturating_sub(1), &first_fits) {
        if fits(c.peak(batch, m)) {
            return Some(m);
        }
    }
    last(1, half, &|m| fits(c.peak(batch, m)))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn calibration(sum_bytes: u64) -> Calibration {
        Calibration {
            recipe: Recipe::Tiled,
            checkpointed: false,
            dtype: "f32",
            stage: None,
            // Fixed 100, 10 a sequence from batch 2 on; 115 for one.
            batches: vec![1, 2, 4],
            peaks: vec![115, 120, 140],
            seconds: vec![1.0, 2.0, 4.0],
            phase_peaks: Vec::new(),
            phase_grads: Vec::new(),
            param_bytes: 50,
            sum_bytes,
            batch_bytes_per_sequence: 1,
        }
    }

    #[test]
    fn a_step_peaks_in_its_first_micro_batch_or_a_later_one_with_the_sum() {
        let c = calibration(50);
        assert_eq!(c.peak(8, 8), 180);
        // 2 x 4: the second holds the sum: 140 + 50, and 4 tokens.
        assert_eq!(c.peak(8, 4), 140 + 50 + 4);
        // 5 then 3: 150 for the first, 130 + 50 for the second.
        assert_eq!(c.peak(8, 5), 180 + 3);
        // 7 then 1: 170 for the first, 115 + 50 for the second.
        assert_eq!(c.peak(8, 7), 170 + 1);
        // One at a time: the measured one-sequence peak and the sum.
        assert_eq!(c.peak(8, 1), 115 + 50 + 7);
        // A sum that outweighs the micro-batches' difference.
        assert_eq!(calibration(500).peak(8, 7), 115 + 500 + 1);
    }

    #[test]
    fn a_later_micro_batch_holds_the_sum_instead_of_the_gradients_made_so_far() {
        // Two stretches, the forward and the backward; the backward's
        // starts with 30 bytes of gradients collected.
        let c = Calibration {
            phase_peaks: vec![vec![70, 112], vec![80, 118], vec![96, 130]],
            phase_grads: vec![0, 30],
            ..calibration(50)
        };
        // One at a time: the backward holds the sum, not its 30 bytes:
        // 112 - 30 + 50, and 7 sequences' tokens.
        assert_eq!(c.peak(8, 1), 112 - 30 + 50 + 7);
        // 2 x 4: each stretch on its own line at 4.
        assert_eq!(c.peak(8, 4), 130 - 30 + 50 + 4);
        // The forward, which holds no gradients, where it is the higher.
        let forward = Calibration {
            phase_grads: vec![0, 60],
            ..c.clone()
        };
        assert_eq!(forward.peak(8, 1), 70 + 50 + 7);
        // Unknown gradients (a step that did not collect them): the whole
        // sum beside the micro-batch's peak.
        let unknown = Calibration {
            phase_grads: Vec::new(),
            ..c.clone()
        };
        assert_eq!(unknown.peak(8, 1), 115 + 50 + 7);
        assert_eq!(unknown.peak(8, 4), 140 + 50 + 4);
        // Gradients noted for a different number of stretches: the same.
        let uneven = Calibration {
            phase_grads: vec![0],
            ..c
        };
        assert_eq!(uneven.peak(8, 1), 115 + 50 + 7);
    }

    #[test]
    fn the_micro_batch_search_finds_what_trying_every_size_finds() {
        // Calibrations as steps give them: the peak grows by more per
        // sequence than a sequence's tokens, one sequence at most the line
        // through batch 2 and 4.
        let mut seed = 7u64;
        let mut next = |n: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        for _ in 0..2000 {
            let fixed = 1000 + next(5000);
            let per = 20 + next(400);
            let token = 1 + next(per / 2);
            let mut c = calibration(next(4000));
            c.peaks = vec![
                fixed + per - next(per / 2 + 1),
                fixed + 2 * per,
                fixed + 4 * per,
            ];
            if next(2) == 1 {
                // Calibrated on (bf16's products): the slope falls past 4
                // and rises again, still growing.
                let at8 = fixed + 4 * per + 4 * (per / 2 + next(per / 2 + 1));
                c.batches = vec![1, 2, 4, 8, 16];
                c.peaks.extend([at8, at8 + 8 * (per / 2 + next(per))]);
                c.seconds = vec![1.0, 2.0, 4.0, 8.0, 16.0];
            }
            c.batch_bytes_per_sequence = token;
            let batch = 1 + next(120) as usize;
            let budget = fixed + next(per * batch as u64 + 6000);
            let fits = |peak: u64| peak <= budget;
            let scan = (1..batch).rev().find(|&m| fits(c.peak(batch, m)));
            assert_eq!(
                largest_micro(&c, batch, fits),
                scan,
                "{c:?} batch {batch} budget {budget}"
            );
        }
        // A batch of 10^11 sequences is weighed at once.
        let c = calibration(50);
        // Up to half the batch: 10^11 + 150 + 9m, so m = 1094 is the last.
        assert_eq!(
            largest_micro(&c, 100_000_000_000, |p| p <= 100_000_000_000 + 10_000),
            Some(1094)
        );
        assert_eq!(
            largest_micro(&c, 100_000_000_000, |p| p <= 1 << 62),
            Some(99_999_999_999)
        );
    }

    #[test]
    fn bf16_on_the_cpu_is_calibrated_past_the_products_slice() {
        // 64 tokens: batch 4 is 256 rows, the slice; then 8 and 16, up to
        // the batch, until the last line starts past it.
        assert_eq!(calibration_batches(64, true, 8), [1, 2, 4, 8]);
        assert_eq!(calibration_batches(64, true, 5), [1, 2, 4, 8]);
        assert_eq!(calibration_batches(64, true, 16), [1, 2, 4, 8, 16]);
        assert_eq!(calibration_batches(64, true, 1000), [1, 2, 4, 8, 16]);
        assert_eq!(calibration_batches(64, true, 4), [1, 2, 4]);
        assert_eq!(calibration_batches(128, true, 1000), [1, 2, 4, 8]);
        // 16 tokens: batch 16 is the slice, so the line starts at 32.
        assert_eq!(
            calibration_batches(16, true, 1000),
            [1, 2, 4, 8, 16, 32, 64]
        );
        // Past the slice at batch 2 already, or not sliced.
        assert_eq!(calibration_batches(256, true, 1000), [1, 2, 4]);
        assert_eq!(calibration_batches(64, false, 1000), [1, 2, 4]);
    }

    #[test]
    fn a_micro_batch_is_predicted_on_the_line_through_the_batches_around_it() {
        let c = Calibration {
            batches: vec![1, 2, 4, 8, 16],
            // 10 a sequence from 2 to 4, then 5.
            peaks: vec![115, 120, 140, 160, 200],
            seconds: vec![1.0, 2.0, 4.0, 6.0, 10.0],
            ..calibration(0)
        };
        let at = |m: usize| c.peak(m, m);
        assert_eq!([at(1), at(2), at(3), at(4)], [115, 120, 130, 140]);
        assert_eq!([at(6), at(8), at(12), at(16)], [150, 160, 180, 200]);
        // Past the last, on the line through the last two.
        assert_eq!(at(32), 120 + 32 * 5);
        assert_eq!(
            (c.fixed(), c.per_sequence(), c.last_line()),
            (120, 5, (8, 16))
        );
        assert_eq!(c.seconds(6, 6), 5.0);
        assert_eq!(c.seconds(32, 32), 18.0);
        // Three batches: the line through 2 and 4 throughout.
        let three = calibration(0);
        assert_eq!(
            (three.fixed(), three.per_sequence(), three.last_line()),
            (100, 10, (2, 4))
        );
        assert_eq!(three.peak(64, 64), 100 + 640);
    }

    #[test]
    fn a_moment_whose_line_is_steeper_sets_the_larger_batches_peak() {
        // Two stretches: the first holds 100 + 10 a sequence, the second
        // 90 + 12. At batch 2 and 4 the first is the step's peak (120,
        // 140); past 5 the second overtakes it.
        let c = Calibration {
            peaks: vec![115, 120, 140],
            phase_peaks: vec![vec![110, 102], vec![120, 114], vec![140, 138]],
            ..calibration(0)
        };
        assert_eq!(c.peak(4, 4), 140);
        assert_eq!(c.peak(16, 16), 90 + 16 * 12);
        // Stretches that differ in number from batch to batch are not read.
        let uneven = Calibration {
            phase_peaks: vec![vec![110, 102], vec![120], vec![140, 138]],
            ..c.clone()
        };
        assert_eq!(uneven.peak(16, 16), 100 + 16 * 10);
    }

    #[test]
    fn a_batch_must_split_evenly_over_the_ranks() {
        let req = PlanRequest {
            model: GptConfig::default(),
            batch: 16,
            budget: 1 << 30,
            margin: 0.05,
            dtypes: vec![DType::F32],
            recipes: vec![Recipe::Tiled],
            checkpointing: false,
            seed: 1,
            ranks: 4,
            stages: vec![Stage::Ddp],
        };
        assert_eq!(req.batch_per_rank().unwrap(), 4);
        let three = PlanRequest {
            ranks: 3,
            ..req.clone()
        };
        assert!(three
            .batch_per_rank()
            .unwrap_err()
            .to_string()
            .contains("a batch of 16 sequences does not split evenly over 3 ranks"));
        assert_eq!(PlanRequest { ranks: 1, ..req }.sharings(), vec![None]);
    }
}
