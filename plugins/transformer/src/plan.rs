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
//! 8% short at batch 16. A micro-batch of `m >= 2` sequences is predicted
//! on that line, one sequence at a time is measured; when gradients are
//! accumulated over several micro-batches, the sum they are added into
//! (the parameters' size) comes on top.

use candle_core::DType;
use serde::Serialize;
use workbook_sdk::{anyhow, Context};

use crate::gpt::GptConfig;
use crate::saved::Recipe;
use crate::step::{calibrate, measured_step, StepShape};

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
}

/// Two measured steps of one recipe in one dtype.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Calibration {
    /// The recipe.
    pub recipe: Recipe,
    /// Whether every layer is checkpointed.
    pub checkpointed: bool,
    /// The dtype's name.
    pub dtype: &'static str,
    /// Peak at batch 1, 2 and 4.
    pub peaks: [u64; 3],
    /// Step time at batch 1, 2 and 4, seconds.
    pub seconds: [f64; 3],
    /// Bytes of the parameters (what an accumulated gradient sum takes).
    pub param_bytes: u64,
    /// Bytes of one sequence's tokens and targets: the whole batch's are
    /// held while its micro-batches run one after another.
    pub batch_bytes_per_sequence: u64,
}

impl Calibration {
    /// What each sequence adds to the peak, from batch 2 on.
    pub fn per_sequence(&self) -> u64 {
        self.peaks[2].saturating_sub(self.peaks[1]) / 2
    }

    /// What the peak's line from batch 2 on holds whatever the batch.
    pub fn fixed(&self) -> u64 {
        self.peaks[1].saturating_sub(2 * self.per_sequence())
    }

    /// The predicted peak of one micro-batch of `micro` sequences.
    fn micro_peak(&self, micro: usize) -> u64 {
        match micro {
            0 | 1 => self.peaks[0],
            m => self.fixed() + m as u64 * self.per_sequence(),
        }
    }

    /// The predicted peak of a step of `batch` in micro-batches of `micro`.
    pub fn peak(&self, batch: usize, micro: usize) -> u64 {
        let micro = micro.clamp(1, batch.max(1));
        let (sum, tokens) = if micro < batch {
            (
                self.param_bytes,
                (batch - micro) as u64 * self.batch_bytes_per_sequence,
            )
        } else {
            (0, 0)
        };
        self.micro_peak(micro) + sum + tokens
    }

    /// The predicted time of such a step: each micro-batch's time on the
    /// line through batch 2 and 4 (measured for one sequence), the update's
    /// share of the fixed time counted each time, which errs on the slow
    /// side.
    pub fn seconds(&self, batch: usize, micro: usize) -> f64 {
        let micro = micro.clamp(1, batch.max(1));
        let per_sequence = ((self.seconds[2] - self.seconds[1]) / 2.0).max(0.0);
        let fixed = (self.seconds[1] - 2.0 * per_sequence).max(0.0);
        let time = |m: usize| match m {
            1 => self.seconds[0],
            m => fixed + per_sequence * m as f64,
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
    /// Sequences per micro-batch.
    pub micro_batch: usize,
    /// Micro-batches per step.
    pub micro_steps: usize,
    /// Predicted peak, bytes.
    pub peak: u64,
    /// Predicted step time, seconds.
    pub seconds: f64,
    /// Whether the peak, with the request's margin, is within the budget.
    pub fits: bool,
    /// Whether no other option is both smaller and faster.
    pub on_frontier: bool,
}

/// The planner's answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// The budget, bytes.
    pub budget: u64,
    /// The margin every option was held to.
    pub margin: f64,
    /// The calibrations it rests on.
    pub calibrations: Vec<Calibration>,
    /// Every option weighed: for each recipe and dtype, the whole batch and,
    /// when it does not fit, the largest micro-batch that does (or one
    /// sequence at a time, when none does).
    pub candidates: Vec<Candidate>,
    /// The fastest option that fits, if one does.
    pub chosen: Option<Candidate>,
}

/// Calibrates every recipe in every dtype of `req` and weighs the options.
pub fn plan(ctx: &mut Context, req: &PlanRequest) -> anyhow::Result<Plan> {
    if req.batch == 0 {
        anyhow::bail!("a batch of 0 sequences: nothing to plan");
    }
    let mut calibrations = Vec::new();
    let checkpointing: &[bool] = if req.checkpointing {
        &[false, true]
    } else {
        &[false]
    };
    for &recipe in &req.recipes {
        for &dtype in &req.dtypes {
            for &checkpointed in checkpointing {
                let config = recipe.apply(req.model);
                let what = format!(
                    "{} in {}{}",
                    recipe.name(),
                    dtype.as_str(),
                    if checkpointed { ", checkpointed" } else { "" }
                );
                let steps = calibrate(
                    ctx,
                    &what,
                    config,
                    dtype,
                    checkpointed,
                    &[1, 2, 4],
                    req.seed,
                )?;
                calibrations.push(Calibration {
                    recipe,
                    checkpointed,
                    dtype: dtype.as_str(),
                    peaks: [steps[0].peak(), steps[1].peak(), steps[2].peak()],
                    seconds: [steps[0].seconds, steps[1].seconds, steps[2].seconds],
                    param_bytes: steps[0].params * dtype.size_in_bytes() as u64,
                    // Token ids and targets, u32 each.
                    batch_bytes_per_sequence: (2 * config.seq * 4) as u64,
                });
            }
        }
    }
    Ok(weigh(req, calibrations))
}

/// The options from calibrations: for each, the whole batch and the
/// largest micro-batch that fits; the fastest that fits is chosen.
pub fn weigh(req: &PlanRequest, calibrations: Vec<Calibration>) -> Plan {
    let mut candidates = Vec::new();
    for c in &calibrations {
        let mut micros = vec![req.batch];
        let fits = |peak: u64| peak as f64 * (1.0 + req.margin) <= req.budget as f64;
        let largest_fitting = (1..req.batch).rev().find(|&m| fits(c.peak(req.batch, m)));
        if !fits(c.peak(req.batch, req.batch)) && req.batch > 1 {
            // The largest micro-batch that fits, or, when none does, one
            // sequence at a time: the least this recipe and dtype can need.
            micros.push(largest_fitting.unwrap_or(1));
        }
        for m in micros {
            let peak = c.peak(req.batch, m);
            candidates.push(Candidate {
                recipe: c.recipe,
                checkpointed: c.checkpointed,
                dtype: c.dtype,
                micro_batch: m,
                micro_steps: req.batch.div_ceil(m),
                peak,
                seconds: c.seconds(req.batch, m),
                fits: fits(peak),
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
        margin: req.margin,
        calibrations,
        candidates,
        chosen,
    }
}

/// What running the chosen option measured.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Verification {
    /// The measured peak, bytes (the largest of the steps run).
    pub peak: u64,
    /// The predicted peak, bytes.
    pub predicted: u64,
    /// The budget, bytes.
    pub budget: u64,
    /// The median measured step time, seconds.
    pub seconds: f64,
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

/// Runs `steps` training steps of `chosen` (each from a fresh model, as the
/// calibration's) and measures them.
pub fn verify(
    ctx: &mut Context,
    req: &PlanRequest,
    chosen: &Candidate,
    steps: usize,
) -> anyhow::Result<Verification> {
    let config = chosen.recipe.apply(req.model);
    let dtype = crate::parse_dtype(chosen.dtype)?;
    let mut peak = 0;
    let mut times = Vec::new();
    for i in 0..steps.max(1) {
        ctx.progress(&format!("verifying: step {} of {steps}", i + 1));
        let step = measured_step(
            ctx,
            format!("plan, step {}", i + 1),
            config,
            dtype,
            StepShape {
                batch: req.batch,
                micro_batch: chosen.micro_batch,
                checkpointed: chosen.checkpointed,
            },
            req.seed,
        )?;
        peak = peak.max(step.peak());
        times.push(step.seconds);
    }
    Ok(Verification {
        peak,
        predicted: chosen.peak,
        budget: req.budget,
        seconds: crate::median(times),
    })
}
