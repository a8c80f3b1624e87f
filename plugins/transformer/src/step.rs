//! One training step measured: model, optimizer state, batch, forward,
//! backward and AdamW update, by category; whole or in micro-batches.

use std::time::Instant;

use candle_accumulate::GradAccumulator;
use candle_checkpoint::{checkpoint_sequential_with, Policy};
use candle_core::{DType, Device, Tensor};
use candle_lean_optim::LeanAdamW;
use candle_ledger::{Labeller, Ledger};
use candle_nn::{Optimizer, ParamsAdamW};
use workbook_models::{param_grads, Rng};
use workbook_sdk::meter::ByCategory;
use workbook_sdk::observe::Tags;
use workbook_sdk::{anyhow, Category, Context, RegionReport};

use crate::corpus;
use crate::gpt::{Gpt, GptConfig};

/// What one measured training step gave.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// The region: peak, its split by category, the timeline.
    pub region: RegionReport,
    /// Bytes live at the end of the (first micro-batch's) forward, above
    /// the region's start, by category.
    pub after_forward: ByCategory,
    /// Bytes the graph held at the end of that forward, from the ledger (0
    /// when checkpointed: no whole graph is ever held).
    pub ledger_bytes: u64,
    /// The largest tensor the graph held, in bytes.
    pub largest_held: u64,
    /// Parameters of the model.
    pub params: u64,
    /// The step's loss (the last micro-batch's).
    pub loss: f32,
    /// Wall time of the step itself: forwards, backwards and the update,
    /// without building the model and the batch.
    pub seconds: f64,
}

impl StepReport {
    /// The step's peak above the region's start: everything it allocated,
    /// model and optimizer state included.
    pub fn peak(&self) -> u64 {
        self.region.peak_above_baseline()
    }
}

/// How a step is run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepShape {
    /// Sequences per batch.
    pub batch: usize,
    /// Sequences per micro-batch: the batch, or fewer with gradients
    /// accumulated (the last micro-batch takes what is left).
    pub micro_batch: usize,
    /// Every layer of the stack (embeddings, each block) checkpointed by
    /// `candle-checkpoint`: the forward keeps the layers' inputs only, the
    /// backward recomputes one layer at a time (its products through a
    /// tape, the bias and GELU as candle's operations).
    pub checkpointed: bool,
}

impl StepShape {
    /// The whole batch at once, nothing recomputed.
    pub fn whole(batch: usize) -> Self {
        Self {
            batch,
            micro_batch: batch,
            checkpointed: false,
        }
    }
}

/// Builds a model of `config` in `dtype` and trains it one step on a batch
/// of `config.seq`-token sequences with the toolkit's in-place AdamW, all
/// inside one region named `name`. With micro-batches, their gradients are
/// summed by `candle-accumulate` (weighted by their rows) before the update.
pub fn measured_step(
    ctx: &mut Context,
    name: String,
    config: GptConfig,
    dtype: DType,
    shape: StepShape,
    seed: u64,
) -> anyhow::Result<StepReport> {
    let device: Device = ctx.device().clone();
    let mut rng = Rng::seeded(seed);
    let mut region = ctx.region(name);
    let model = Gpt::new(config, dtype, &mut rng, &device)?;
    let params = model.param_count();
    let mut opt = Category::OptimizerState.scope(|| {
        LeanAdamW::new(
            model.vars(),
            ParamsAdamW {
                lr: 1e-3,
                ..Default::default()
            },
        )
    })?;
    let (x, y) = Category::Inputs
        .scope(|| corpus::batch(&mut rng, shape.batch, config.seq, config.vocab, &device))?;
    region.mark("model, optimizer state, batch");
    let start = Instant::now();
    let micro = shape.micro_batch.clamp(1, shape.batch.max(1));
    let vars = model.vars();
    let stack = model.stack();
    let mut accumulator = (micro < shape.batch)
        .then(|| GradAccumulator::new(vars.clone(), shape.batch).with_observer(Tags));
    let mut first = None;
    let mut ledger_time = std::time::Duration::ZERO;
    let mut loss_value = 0f32;
    let mut grads = None;
    for start_row in (0..shape.batch).step_by(micro) {
        let rows = micro.min(shape.batch - start_row);
        let (xm, ym) = (x.narrow(0, start_row, rows)?, y.narrow(0, start_row, rows)?);
        if shape.checkpointed {
            // The accumulator takes gradients already weighted by the
            // micro-batch's share of the rows.
            let weight = if accumulator.is_some() {
                rows as f64 / shape.batch as f64
            } else {
                1.0
            };
            let head = |h: &Tensor| model.head_loss(h, &ym)? * weight;
            let out = Category::Activations.scope(|| {
                checkpoint_sequential_with(
                    &stack,
                    stack.len(),
                    &xm,
                    &vars,
                    head,
                    &Policy::Nothing,
                    &Tags,
                )
            })?;
            loss_value =
                (out.loss.to_dtype(DType::F32)?.to_scalar::<f32>()? as f64 / weight) as f32;
            match accumulator.as_mut() {
                Some(acc) => Category::Gradients.scope(|| acc.add_weighted(&out.grads, rows))?,
                None => grads = Some(out.grads),
            }
            continue;
        }
        // Notes what the toolkit's fused operations keep beside the graph
        // (a few bytes each), for the ledger.
        let labels = Labeller::unlabelled();
        let loss: Tensor = Category::Activations.scope(|| model.loss(&xm, &ym, &labels))?;
        if first.is_none() {
            region.mark("after forward");
            let walking = Instant::now();
            let after = region.current_above_baseline();
            let (bytes, largest) = Category::Other.scope(|| -> anyhow::Result<_> {
                let ledger = Ledger::of(&loss, &labels)?;
                let largest = ledger.held.iter().map(|h| h.bytes).max().unwrap_or(0);
                Ok((ledger.total_bytes(), largest))
            })?;
            first = Some((after, bytes, largest));
            // The ledger's walk is not the step's time.
            ledger_time += walking.elapsed();
        }
        loss_value = loss.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        match accumulator.as_mut() {
            Some(acc) => Category::Gradients.scope(|| acc.backward(&loss, rows))?,
            None => {
                grads = Some(Category::Gradients.scope(|| -> anyhow::Result<_> {
                    let store = loss.backward()?;
                    Ok(param_grads(&store, &vars))
                })?);
            }
        }
        drop((loss, labels));
    }
    region.mark("after backward");
    match (&accumulator, &grads) {
        (Some(acc), _) => Category::OptimizerState.scope(|| opt.step(acc.grads()?))?,
        (None, Some(g)) => Category::OptimizerState.scope(|| opt.step(g))?,
        (None, None) => anyhow::bail!("a step of an empty batch"),
    }
    let seconds = start.elapsed().saturating_sub(ledger_time).as_secs_f64();
    region.mark("after AdamW step");
    drop((grads, accumulator, opt, x, y, model));
    let region = ctx.end_region(region);
    let (after_forward, ledger_bytes, largest_held) = first.unwrap_or_default();
    Ok(StepReport {
        region,
        after_forward,
        ledger_bytes,
        largest_held,
        params,
        loss: loss_value,
        seconds,
    })
}

/// Measured steps of `config` in `dtype`, whole batches of each size in
/// `batches`, named `what`, after one step at the largest whose peak is not
/// used: what a process sets up once for these shapes (thread pools, the
/// matrix products' per-thread buffers) is not a part of a step's peak.
pub fn calibrate(
    ctx: &mut Context,
    what: &str,
    config: GptConfig,
    dtype: DType,
    checkpointed: bool,
    batches: &[usize],
    seed: u64,
) -> anyhow::Result<Vec<StepReport>> {
    let shape = |batch| StepShape {
        checkpointed,
        ..StepShape::whole(batch)
    };
    let largest = batches.iter().copied().max().unwrap_or(1);
    ctx.progress(&format!("warming up {what}"));
    measured_step(
        ctx,
        format!("{what}, warm-up"),
        config,
        dtype,
        shape(largest),
        seed,
    )?;
    batches
        .iter()
        .map(|&b| {
            ctx.progress(&format!("calibrating {what}, batch {b}"));
            measured_step(
                ctx,
                format!("{what}, batch {b}"),
                config,
                dtype,
                shape(b),
                seed,
            )
        })
        .collect()
}
