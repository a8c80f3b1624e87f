//! One stage of a rank's training: the stack of Linear + ReLU layers, its
//! batches and optimizer as the stage shares them, measured.

use std::sync::Arc;
use std::time::Instant;

use candle_checkpoint::Sequential;
use candle_distributed::{Comm, DataParallel, Shard, ShardedLinear, Split, ZeroAdamW};
use candle_lean_optim::LeanAdamW;
use workbook_models::Rng;
use workbook_sdk::candle::backprop::GradStore;
use workbook_sdk::candle::{DType, Device, Module, Result, Tensor, Var};
use workbook_sdk::candle_nn::{self, Optimizer, ParamsAdamW};
use workbook_sdk::observe::Tags;
use workbook_sdk::{anyhow, Category, Context};

use workbook_planner::stage::{ModelState, Precision, Stage};

use super::{RankRequest, StageReport};

/// A Linear + ReLU layer over any linear map.
pub(super) struct Layer<L>(L);

impl<L: Module> Module for Layer<L> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.0.forward(x)?.relu()
    }
}

pub(super) fn forward<L: Module>(layers: &[Layer<L>], x: &Tensor) -> Result<Tensor> {
    layers.iter().try_fold(x.clone(), |h, l| l.forward(&h))
}

pub(super) fn mse(out: &Tensor, y: &Tensor) -> Result<Tensor> {
    (out - y)?.sqr()?.mean_all()
}

/// A loss's value, whatever its dtype.
fn scalar(loss: &Tensor) -> Result<f32> {
    loss.to_dtype(DType::F32)?.to_scalar()
}

/// The initial weights and biases, equal on every rank.
fn init(req: &RankRequest, dev: &Device) -> Result<Vec<(Tensor, Tensor)>> {
    let mut rng = Rng::seeded(req.seed);
    let scale = (1.0 / req.width as f64).sqrt();
    (0..req.layers)
        .map(|_| {
            let w = (rng.randn((req.width, req.width), dev)? * scale)?;
            let b = (rng.randn(req.width, dev)? * 0.1)?;
            Ok((w, b))
        })
        .collect()
}

/// This rank's share of the batch: its rows, and its loss's weight.
pub(super) fn shard_of(req: &RankRequest, comm: &Comm) -> anyhow::Result<Shard> {
    Ok(Shard::new(req.batch, comm.size(), comm.rank())?)
}

/// `shard`'s rows of step `step`'s batch, in the dtype it trains in.
pub(super) fn batch(
    req: &RankRequest,
    shard: Shard,
    step: usize,
    dev: &Device,
) -> Result<(Tensor, Tensor)> {
    let mut rng = Rng::seeded(req.seed ^ (0x9e37_79b9 + step as u64));
    let x = rng.randn((req.batch, req.width), dev)?;
    let y = rng.randn((req.batch, req.width), dev)?;
    let dtype = req.precision.dtype();
    Ok((
        shard.narrow(&x)?.to_dtype(dtype)?.copy()?,
        shard.narrow(&y)?.to_dtype(dtype)?.copy()?,
    ))
}

fn adamw() -> ParamsAdamW {
    ParamsAdamW {
        lr: 1e-3,
        ..Default::default()
    }
}

/// The model of the dense stages: whole parameters as variables.
pub(super) type Dense = (Vec<Layer<candle_nn::Linear>>, Vec<Var>);

pub(super) fn dense(req: &RankRequest, dev: &Device) -> Result<Dense> {
    Category::Parameters.scope(|| {
        let mut layers = Vec::new();
        let mut vars = Vec::new();
        let dtype = req.precision.dtype();
        for (w, b) in init(req, dev)? {
            let (w, b) = (
                Var::from_tensor(&w.to_dtype(dtype)?)?,
                Var::from_tensor(&b.to_dtype(dtype)?)?,
            );
            layers.push(Layer(candle_nn::Linear::new(
                w.as_tensor().clone(),
                Some(b.as_tensor().clone()),
            )));
            vars.extend([w, b]);
        }
        Ok((layers, vars))
    })
}

/// The dense model's layer-wise backward (candle-checkpoint's), each
/// parameter's gradient handed to `on_grad` as soon as it exists, as DDP's
/// hooks and ZeRO's reduce-scatters take them: the loss.
fn layerwise_backward(
    layers: &[Layer<candle_nn::Linear>],
    vars: &[Var],
    (x, y): (&Tensor, &Tensor),
    shard: Shard,
    on_grad: impl FnMut(&Var, Tensor) -> Result<()>,
) -> Result<f32> {
    let loss = |h: &Tensor| shard.weigh(&mse(h, y)?);
    let (l, _) = Category::Gradients.scope(|| {
        Sequential::new(layers)
            .observer(&Tags)
            .lean_with(x, vars, loss, on_grad)
    })?;
    scalar(&l)
}

/// DDP's optimizer: in f32 the parameters are their own masters; in mixed
/// precision every rank keeps whole f32 masters and moments, which is
/// `ZeroAdamW` on a communicator of one rank (its block is the whole).
enum DdpOptimizer {
    Lean(LeanAdamW),
    Masters(ZeroAdamW),
}

/// What a stage's optimizer and model are.
enum Trainer {
    Ddp(Dense, DataParallel, DdpOptimizer),
    Zero1(Dense, ZeroAdamW),
    Zero2(Dense, ZeroAdamW),
    Zero3(Vec<Layer<ShardedLinear>>, LeanAdamW),
}

fn trainer(stage: Stage, comm: &Arc<Comm>, req: &RankRequest, dev: &Device) -> Result<Trainer> {
    Ok(match stage {
        Stage::Ddp => {
            let model = dense(req, dev)?;
            let ddp = DataParallel::new(Arc::clone(comm), model.1.clone());
            let opt = match req.precision {
                Precision::F32 => {
                    DdpOptimizer::Lean(LeanAdamW::with_observer(model.1.clone(), adamw(), Tags)?)
                }
                Precision::Bf16 => DdpOptimizer::Masters(ZeroAdamW::new(
                    Arc::new(Comm::solo().observed(Tags)),
                    model.1.clone(),
                    adamw(),
                )?),
            };
            Trainer::Ddp(model, ddp, opt)
        }
        Stage::Zero1 | Stage::Zero2 => {
            let model = dense(req, dev)?;
            let opt = ZeroAdamW::new(Arc::clone(comm), model.1.clone(), adamw())?;
            if stage == Stage::Zero1 {
                Trainer::Zero1(model, opt)
            } else {
                Trainer::Zero2(model, opt)
            }
        }
        Stage::Zero3 => {
            // Every rank makes the whole initial weights, keeps its blocks
            // and drops the rest (a real job would load its blocks only).
            // In mixed precision the f32 blocks start from the bf16
            // weights, as the other stages' masters do.
            let dtype = req.precision.dtype();
            let init = init(req, dev)?
                .into_iter()
                .map(|(w, b)| {
                    let round = |t: Tensor| t.to_dtype(dtype)?.to_dtype(DType::F32);
                    Ok((round(w)?, round(b)?))
                })
                .collect::<Result<Vec<_>>>()?;
            let layers = Category::Parameters.scope(|| {
                init.iter()
                    .map(|(w, b)| {
                        Ok(Layer(ShardedLinear::new(
                            Arc::clone(comm),
                            w,
                            Some(b),
                            dev,
                        )?))
                    })
                    .collect::<Result<Vec<_>>>()
            })?;
            drop(init);
            let blocks = layers.iter().flat_map(|l| l.0.vars()).collect();
            let opt = LeanAdamW::with_observer(blocks, adamw(), Tags)?;
            Trainer::Zero3(layers, opt)
        }
    })
}

fn tensors_bytes(vars: &[Var]) -> u64 {
    vars.iter().map(|v| (v.elem_count() * 4) as u64).sum()
}

/// Runs one stage for `req.steps` steps, measured in a region of `ctx`.
pub(super) fn run_stage(
    ctx: &mut Context,
    comm: &Arc<Comm>,
    stage: Stage,
    req: &RankRequest,
) -> anyhow::Result<StageReport> {
    let dev = Device::Cpu;
    let ranks = comm.size();
    // Regions named by stage and width: the half-width run has its own.
    let name = format!("{} at width {}", stage.name(), req.width);
    let region = ctx.region(name.clone());
    let mut t = trainer(stage, comm, req, &dev)?;
    // The training's own peak, set-up left out (stage 3 makes the whole
    // initial model once to keep its blocks).
    let steps_region = ctx.region(format!("{name}, steps"));
    let sizes: Vec<usize> = (0..req.layers)
        .flat_map(|_| [req.width * req.width, req.width])
        .collect();
    let splits: Vec<Split> = sizes.iter().map(|&n| Split::new(n, ranks)).collect();
    let mut held = ModelState::default();
    let mut loss = f32::NAN;
    let traffic_start = comm.traffic();
    let shard = shard_of(req, comm)?;
    let start = Instant::now();
    for step in 0..req.steps {
        let (x, y) = Category::Inputs.scope(|| batch(req, shard, step, &dev))?;
        let rows = (&x, &y);
        let grads_now = |region: &workbook_sdk::Region| {
            region.current_above_baseline().get(Category::Gradients)
        };
        match &mut t {
            Trainer::Ddp((layers, vars), ddp, opt) => {
                // Gradients averaged a bucket at a time as the layer-wise
                // backward hands them over, where DDP's hooks launch theirs.
                let mut buckets = ddp.bucketing();
                loss =
                    layerwise_backward(layers, vars, rows, shard, |var, g| buckets.push(var, g))?;
                let grads = Category::Gradients.scope(|| buckets.finish())?;
                held.grads = grads_now(&region);
                match opt {
                    DdpOptimizer::Lean(opt) => opt.step(&grads)?,
                    DdpOptimizer::Masters(opt) => opt.step(&grads)?,
                }
            }
            Trainer::Zero1((layers, vars), opt) => {
                // Every gradient whole until the step reduce-scatters them.
                let mut grads = GradStore::default();
                loss = layerwise_backward(layers, vars, rows, shard, |var, g| {
                    grads.insert(var.as_tensor(), g);
                    Ok(())
                })?;
                held.grads = grads_now(&region);
                opt.step(&grads)?;
            }
            Trainer::Zero2((layers, vars), opt) => {
                loss = layerwise_backward(layers, vars, rows, shard, |var, g| {
                    opt.reduce_gradient(var, &g)
                })?;
                held.grads = grads_now(&region);
                opt.step_reduced()?;
            }
            Trainer::Zero3(layers, opt) => {
                let l = Category::Activations
                    .scope(|| shard.weigh(&mse(&forward(layers, &x)?, &y)?))?;
                let all = Category::Gradients.scope(|| l.backward())?;
                loss = scalar(&l)?;
                drop(l);
                drop(all);
                let mut grads = GradStore::default();
                for layer in layers.iter() {
                    layer.0.take_grads_into(&mut grads);
                }
                held.grads = grads_now(&region);
                opt.step(&grads)?;
            }
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let traffic = comm.traffic().since(&traffic_start).total();
    let now = region.current_above_baseline();
    held.params = now.get(Category::Parameters);
    held.optim = now.get(Category::OptimizerState);
    let block_bytes = match &t {
        Trainer::Zero3(layers, _) => {
            tensors_bytes(&layers.iter().flat_map(|l| l.0.vars()).collect::<Vec<_>>())
        }
        _ => splits.iter().map(|s| (s.block() * 4) as u64).sum(),
    };
    // Weights and biases, their gradients, two moments each; stage 3 adds
    // a one-element anchor per layer, mixed precision an f32 master of each
    // below stage 3 (whose f32 blocks are the masters).
    let layers = req.layers as u64;
    let tensors = 8 * layers
        + match (stage, req.precision) {
            (Stage::Zero3, _) => layers,
            (_, Precision::Bf16) => 2 * layers,
            (_, Precision::F32) => 0,
        };
    let trained = ctx.end_region(steps_region);
    drop(t);
    let report = ctx.end_region(region);
    // Above the stage's start: the steps' peaks, less what was live when
    // the stage began.
    let above = |peak: u64, category: Option<Category>| {
        let base = match category {
            Some(c) => report.baseline.get(c),
            None => report.baseline.total(),
        };
        peak.saturating_sub(base)
    };
    let steps = req.steps.max(1) as u64;
    Ok(StageReport {
        stage,
        psi: sizes.iter().sum::<usize>() as u64,
        block: block_bytes / 4,
        padded: splits.iter().map(|s| s.padded() as u64).sum(),
        held,
        peak: above(trained.peak_bytes, None),
        comm_peak: above(
            trained.peak_each.get(Category::Communication),
            Some(Category::Communication),
        ),
        activations_peak: above(
            trained.peak_each.get(Category::Activations),
            Some(Category::Activations),
        ),
        sent_per_step: traffic.sent / steps,
        received_per_step: traffic.received / steps,
        calls_per_step: traffic.calls / steps,
        seconds_per_step: seconds / steps as f64,
        loss,
        tensors,
        smaller: None,
    })
}
