//! A decoder's training step as a recipe says: the optimizer (AdamW with
//! its state on the device, on the host, or partitioned over ranks) behind
//! one interface, and the step itself, in micro-batches, checkpointed or
//! not. What chapter 5's cells and `workbook plan --verify` run.

use std::sync::Arc;

use candle_accumulate::{micro_batches, GradAccumulator};
use candle_distributed::{Comm, Rehearsal, ZeroAdamW};
use candle_lean_optim::LeanAdamW;
use candle_offload::HostAdamW;
use workbook_models::llama::{Attention, Layers, Llama, LlamaConfig, StepOptions};
use workbook_models::Rng;
use workbook_sdk::anyhow;
use workbook_sdk::candle::DType;
use workbook_sdk::{Category, Context, RegionReport};

use super::predict::{predict, DecoderRecipe, Sharing};
use crate::stage::Stage;
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

/// One training step; returns its mean loss. The batch goes in
/// `recipe.micro_batches` equal parts, each back-propagated through
/// candle's graph or checkpointed block by block. Their gradients are
/// summed with each part's share of the rows and handed to the optimizer;
/// for ZeRO-2, checkpointed, each layer's are handed over as they are made
/// and summed there, in this rank's blocks.
pub fn train_step(
    model: &Llama,
    x: &Tensor,
    y: &Tensor,
    recipe: &DecoderRecipe,
    opt: &mut Trainer,
) -> anyhow::Result<f64> {
    let options = StepOptions {
        layers: Layers::Lean,
        compute: recipe.compute,
        attention: Attention::Tiled,
        loss: recipe.loss,
    };
    let batch = x.dim(0)?;
    let parts = recipe.micro_batches;
    anyhow::ensure!(
        parts > 0 && batch.is_multiple_of(parts),
        "{parts} micro-batches do not split {batch} sequences evenly"
    );
    let rows = batch / parts;
    let weight = rows as f64 / batch as f64;
    let parts = micro_batches(x, rows)?
        .into_iter()
        .zip(micro_batches(y, rows)?);
    let mut loss = 0.0;
    if recipe.sharing.takes_each_layer(recipe.checkpoint) {
        for (x, y) in parts {
            let take = |var: &_, g: _| opt.take(var, &g);
            let l = model.checkpointed_backward_with(&x, &y, &options, weight, take, &Tags)?;
            loss += l.to_scalar::<f32>()? as f64;
        }
        opt.step_taken()?;
        return Ok(loss);
    }
    let mut sum = GradAccumulator::new(model.vars(), batch).observed(Tags);
    for (x, y) in parts {
        if recipe.checkpoint {
            let c = model.checkpointed_backward(&x, &y, &options, weight, &Tags)?;
            loss += c.loss.to_scalar::<f32>()? as f64;
            sum.add_weighted(&c.grads, rows)?;
        } else {
            let l = Category::Activations.scope(|| model.loss(&x, &y, &options))?;
            sum.backward(&l, rows)?;
            loss += weight * l.to_scalar::<f32>()? as f64;
        }
    }
    let grads: GradStore = sum.take()?;
    opt.step(&grads)?;
    Ok(loss)
}

/// A decoder trained a few steps under measurement: what to train, and how.
#[derive(Debug, Clone)]
pub struct Run<'a> {
    /// The model's shape.
    pub config: &'a LlamaConfig,
    /// Sequences per step, over all ranks (a ZeRO rank trains on its share).
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Steps, the first (which makes AdamW's moments) included.
    pub steps: usize,
    /// Seed of the weights and the tokens.
    pub seed: u64,
    /// AdamW's learning rate.
    pub lr: f64,
    /// How each step runs.
    pub recipe: DecoderRecipe,
}

/// What a [`Run`] measured.
#[derive(Debug, Clone)]
pub struct Measured {
    /// The recipe's name (see [`DecoderRecipe::name`]).
    pub name: String,
    /// The region: its peaks, on the device and by category, with the
    /// prediction as its analytic figure.
    pub report: RegionReport,
    /// The loss at each step.
    pub losses: Vec<f64>,
    /// Median seconds per step.
    pub seconds: f64,
}

/// Builds the model with f32 master weights and AdamW, and trains it
/// `run.steps` steps on one batch of seeded tokens (so the loss must fall),
/// all inside one measured region of `ctx`.
pub fn train_measured(ctx: &mut Context, run: &Run) -> anyhow::Result<Measured> {
    let (cfg, recipe) = (run.config, &run.recipe);
    let (device, name) = (ctx.device().clone(), recipe.name());
    let mut rng = Rng::seeded(run.seed);
    let mut region = ctx.region(name.clone());
    let model = Category::Parameters.scope(|| Llama::new(cfg, DType::F32, &mut rng, &device))?;
    let adamw = ParamsAdamW {
        lr: run.lr,
        ..Default::default()
    };
    let mut opt = Trainer::new(&model, adamw, recipe.sharing)?;
    // A rank's share of the batch (the whole batch on one device).
    let batch = run.batch / recipe.sharing.ranks();
    let (x, y) = Category::Inputs.scope(|| -> anyhow::Result<_> {
        let x = rng.labels(batch * run.seq, cfg.vocab as u32, &device)?;
        let y = rng.labels(batch * run.seq, cfg.vocab as u32, &device)?;
        Ok((x.reshape((batch, run.seq))?, y.reshape((batch, run.seq))?))
    })?;
    region.mark("model, optimizer and batch");
    let mut losses = Vec::with_capacity(run.steps);
    let mut times = Vec::with_capacity(run.steps);
    for step in 0..run.steps {
        ctx.progress(&format!("{name}: step {} of {}", step + 1, run.steps));
        let start = std::time::Instant::now();
        losses.push(train_step(&model, &x, &y, recipe, &mut opt)?);
        times.push(start.elapsed().as_secs_f64());
    }
    region.set_analytic(predict(cfg, run.batch, run.seq, recipe).total());
    Ok(Measured {
        name,
        report: ctx.end_region(region),
        losses,
        seconds: workbook_sdk::median(times),
    })
}
