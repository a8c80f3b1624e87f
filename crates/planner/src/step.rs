//! One training step measured: model, optimizer state, batch, forward,
//! backward and AdamW update, by category; whole or in micro-batches.

use std::cell::{Cell, RefCell};
use std::sync::Arc;
use std::time::Instant;

use candle_accumulate::GradAccumulator;
use candle_checkpoint::{add_grad, Sequential};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_distributed::{Comm, DataParallel, ZeroAdamW};
use candle_lean_optim::LeanAdamW;
use candle_ledger::{Labeller, Ledger};
use candle_nn::{Optimizer, ParamsAdamW};
use workbook_models::{param_grads, Rng};
use workbook_sdk::candle_observe::{Kind, Observer, Place, Token};
use workbook_sdk::meter::ByCategory;
use workbook_sdk::observe::{Phases, Tags};
use workbook_sdk::{anyhow, Category, Context, RegionReport};

use workbook_models::corpus;
use workbook_models::{Gpt, GptConfig};

use crate::stage::Stage;

/// What one measured training step gave.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// The region: peak, its split by category, the timeline.
    pub region: RegionReport,
    /// Bytes live at the end of the (first micro-batch's) forward, above
    /// the region's start, by category (none for a direct step, whose
    /// forward and backward are one call).
    pub after_forward: ByCategory,
    /// Bytes the graph held at the end of that forward, from the ledger (0
    /// when checkpointed: no whole graph is ever held; 0 for a direct step,
    /// which has no graph).
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
    /// The peak of each stretch of the forwards and backwards between two
    /// marks of the technique (each stage's backward, checkpointed or
    /// direct), above the region's start: one stretch where it makes none.
    pub phases: Vec<u64>,
    /// Bytes of the parameters' gradients held at the start of each of
    /// [`phases`](Self::phases)' stretches, where the step collects the
    /// gradients its backward hands over (a direct step of the whole batch
    /// on one process, or under DDP or ZeRO stage 1); empty where it does
    /// not.
    pub phase_grads: Vec<u64>,
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
    /// The backward with no graph: each stage's backward called directly
    /// ([`Gpt::direct_loss_with`]; checkpointed,
    /// [`Gpt::direct_checkpointed`]). The lean layers, under any stage.
    pub direct: bool,
}

impl StepShape {
    /// The whole batch at once, nothing recomputed.
    pub fn whole(batch: usize) -> Self {
        Self {
            batch,
            micro_batch: batch,
            checkpointed: false,
            direct: false,
        }
    }

    /// A whole batch of each size in `batches`, checkpointed or not.
    pub fn wholes(batches: &[usize], checkpointed: bool) -> Vec<Self> {
        batches
            .iter()
            .map(|&b| Self {
                checkpointed,
                ..Self::whole(b)
            })
            .collect()
    }
}

/// One rank of a data-parallel job: its ranks and how they share the
/// training.
#[derive(Debug, Clone)]
pub struct Parallel {
    /// The ranks (real ones under `mpirun`, or one rehearsed:
    /// [`candle_distributed::Rehearsal`]).
    pub comm: Arc<Comm>,
    /// DDP, or ZeRO stage 1, 2 or 3 (the model then partitioned:
    /// [`Gpt::sharded`]).
    pub stage: Stage,
}

impl Parallel {
    /// `stage` on `comm`.
    pub fn new(comm: Arc<Comm>, stage: Stage) -> Self {
        Self { comm, stage }
    }
}

/// The optimizer of a step: the toolkit's AdamW on whole parameters, after
/// DDP's averaging when data-parallel; ZeRO's on this rank's blocks of the
/// state (stages 1, 2); or the toolkit's on this rank's blocks of the
/// parameters (stage 3), with the gradient blocks summed over micro-batches.
enum Update {
    Whole(LeanAdamW, Option<DataParallel>),
    Zero(ZeroAdamW, Stage),
    Sharded(LeanAdamW, GradStore),
}

impl Update {
    fn new(vars: Vec<Var>, parallel: Option<&Parallel>) -> anyhow::Result<Self> {
        let params = ParamsAdamW {
            lr: 1e-3,
            ..Default::default()
        };
        Ok(match parallel {
            None => Update::Whole(LeanAdamW::new(vars, params)?, None),
            Some(p) if p.stage == Stage::Ddp => {
                let ddp = DataParallel::new(Arc::clone(&p.comm), vars.clone());
                Update::Whole(LeanAdamW::new(vars, params)?, Some(ddp))
            }
            Some(p) if p.stage == Stage::Zero3 => {
                Update::Sharded(LeanAdamW::new(vars, params)?, GradStore::default())
            }
            Some(p) => Update::Zero(ZeroAdamW::new(Arc::clone(&p.comm), vars, params)?, p.stage),
        })
    }

    /// Stage 2 reduce-scatters each gradient once the backward has made
    /// it, keeping its block only. candle's backward hands all of them over
    /// at its end; `candle_checkpoint::Sequential::lean_with` hands them over
    /// layer by layer, but this model's blocks give a gradient to tensors
    /// without a graph of their own (the attention's), so it would run
    /// each block twice: measured at chapter 3's model, twice the bytes per
    /// sequence and twice the time of the plain backward.
    /// Stage 3's backward reduce-scatters every gradient itself.
    fn reduces_each_gradient(&self) -> bool {
        matches!(self, Update::Zero(_, Stage::Zero2) | Update::Sharded(..))
    }

    /// Stage 2: reduce-scatters one gradient as soon as a direct backward
    /// hands it over (the tied table's twice: the blocks are summed).
    /// Stage 3: adds one gradient block, which the direct backward has
    /// reduce-scattered already, to the sum.
    fn reduce_one(&mut self, var: &Var, grad: Tensor) -> anyhow::Result<()> {
        match self {
            Update::Zero(opt, Stage::Zero2) => Ok(opt.reduce_gradient(var, &grad)?),
            Update::Sharded(_, sum) => Ok(add_grad(sum, var, grad)?),
            _ => anyhow::bail!(
                "internal: only ZeRO stages 2 and 3 reduce each gradient as it is made"
            ),
        }
    }

    /// Stages 2 and 3: the direct step of `model` on `(x, y)`, every stage
    /// checkpointed or none, its loss weighted by `weight`, each gradient
    /// reduced as it is made ([`Update::reduce_one`]): the loss.
    fn direct_reduced(
        &mut self,
        model: &Gpt,
        (x, y): (&Tensor, &Tensor),
        weight: f64,
        checkpointed: bool,
    ) -> anyhow::Result<Tensor> {
        let reduce = |var: &Var, g: Tensor| {
            self.reduce_one(var, g)
                .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))
        };
        Ok(if checkpointed {
            model.direct_checkpointed_with(x, y, weight, reduce, &Tags)?
        } else {
            model.direct_loss_with(x, y, weight, reduce, &Tags)?
        })
    }

    /// Stage 2: reduce-scatters every gradient in `grads`, dropping each
    /// whole one as soon as its block is kept. Stage 3: adds the gradient
    /// blocks in `grads` to the sum.
    fn reduce_all(&mut self, mut grads: GradStore, vars: &[Var]) -> anyhow::Result<()> {
        for var in vars {
            let Some(g) = grads.remove(var.as_tensor()) else {
                continue;
            };
            match self {
                Update::Zero(opt, _) => opt.reduce_gradient(var, &g)?,
                Update::Sharded(_, sum) => add_grad(sum, var, g)?,
                Update::Whole(..) => {}
            }
        }
        Ok(())
    }

    /// The update: from whole gradients, or for stages 2 and 3 (`grads`
    /// `None`) from the blocks held already (stage 3's linear layers' in
    /// `model`). Stage 1 keeps the whole gradients until its update ends,
    /// as ZeRO's stage 1 does: that, and no more, is what stage 2 saves
    /// here.
    fn step(&mut self, grads: Option<GradStore>, model: &Gpt) -> anyhow::Result<()> {
        match (self, grads) {
            (Update::Sharded(opt, sum), None) => {
                let mut grads = std::mem::take(sum);
                model.take_grads_into(&mut grads);
                opt.step(&grads)?;
            }
            (Update::Sharded(..), Some(_)) => {
                anyhow::bail!("ZeRO stage 3 was handed whole gradients at its update")
            }
            (Update::Whole(opt, None), Some(g)) => opt.step(&g)?,
            (Update::Whole(opt, Some(ddp)), Some(mut g)) => {
                ddp.average(&mut g)?;
                opt.step(&g)?;
            }
            (Update::Zero(opt, Stage::Zero2), None) => opt.step_reduced()?,
            (Update::Zero(_, Stage::Zero2), Some(_)) => {
                anyhow::bail!("ZeRO stage 2 was handed whole gradients at its update")
            }
            (Update::Zero(opt, _), Some(g)) => opt.step(&g)?,
            (_, None) => anyhow::bail!("a step of an empty batch"),
        }
        Ok(())
    }
}

/// Bytes of `t`'s elements.
fn bytes_of(t: &Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

/// Observes like the step's [`Phases`] and notes, at each of its marks, the
/// bytes of parameter gradients the step has collected so far. A later
/// micro-batch adds each gradient into the sum as it is made, so at that
/// moment it holds the sum instead of them.
struct Handed<'a> {
    phases: &'a Phases,
    held: Cell<u64>,
    at_marks: RefCell<Vec<u64>>,
}

impl Handed<'_> {
    /// The gradients held at the start of each stretch (none at the
    /// first's), where `collected`; nothing otherwise.
    fn finish(self, collected: bool) -> Vec<u64> {
        if !collected {
            return Vec::new();
        }
        let mut at = self.at_marks.into_inner();
        at.insert(0, 0);
        at
    }
}

impl Observer for Handed<'_> {
    fn enter(&self, kind: Kind, place: Place) -> Token {
        Tags.enter(kind, place)
    }

    fn leave(&self, token: Token) {
        Tags.leave(token)
    }

    fn mark(&self, label: &'static str) {
        // Within the capacity made beforehand up to 256 marks.
        let mut at = self.at_marks.borrow_mut();
        Category::Other.scope(|| at.push(self.held.get()));
        self.phases.mark(label);
    }
}

/// Builds a model of `config` in `dtype` and trains it one step on a batch
/// of `config.seq`-token sequences with the toolkit's in-place AdamW, all
/// inside one region named `name`. With micro-batches, their gradients are
/// summed by `candle-accumulate` (weighted by their rows) before the update.
///
/// With `parallel`, the step is one rank's: `shape.batch` is this rank's
/// share of the batch (its own sequences), and the gradients are averaged
/// over the ranks (DDP) or reduce-scattered into this rank's blocks, which
/// it updates and all-gathers (ZeRO stage 1 at the update, the whole
/// gradients kept until it ends; stage 2 after each micro-batch's backward,
/// each whole gradient dropped once its block is kept). Under stage 3 the
/// model itself is partitioned ([`Gpt::sharded`]): its backward
/// reduce-scatters each gradient as it is made, and this rank updates its
/// blocks, which no all-gather follows.
pub fn measured_step(
    ctx: &mut Context,
    name: String,
    config: GptConfig,
    dtype: DType,
    shape: StepShape,
    seed: u64,
    parallel: Option<&Parallel>,
) -> anyhow::Result<StepReport> {
    let device: Device = ctx.device().clone();
    let mut rng = Rng::seeded(seed);
    let mut region = ctx.region(name);
    let model = match parallel {
        Some(p) if p.stage == Stage::Zero3 => {
            Gpt::sharded(config, dtype, &mut rng, &device, Arc::clone(&p.comm))?
        }
        _ => Gpt::new(config, dtype, &mut rng, &device)?,
    };
    let params = model.param_count();
    let mut opt = Category::OptimizerState.scope(|| Update::new(model.vars(), parallel))?;
    // Every rank starts from the same model and trains on its own
    // sequences.
    let mut data_rng = match parallel {
        Some(p) => Rng::seeded(seed.wrapping_add(1 + p.comm.rank() as u64)),
        None => rng,
    };
    let (x, y) = Category::Inputs.scope(|| {
        corpus::batch(
            &mut data_rng,
            shape.batch,
            config.seq,
            config.vocab,
            &device,
        )
    })?;
    region.mark("model, optimizer state, batch");
    // The step's peak stretch by stretch, between the marks the direct and
    // checkpointed backwards make (one stretch where there are none), and
    // the gradients collected at each mark: room for a deep model's marks
    // is made before the stretches' frames open (as `Phases` does).
    let marks = Category::Other.scope(|| Vec::with_capacity(256));
    let phases = region.phases();
    let handed = Handed {
        phases: &phases,
        held: Cell::new(0),
        at_marks: RefCell::new(marks),
    };
    let start = Instant::now();
    let micro = shape.micro_batch.clamp(1, shape.batch.max(1));
    let vars = model.vars();
    let stack = model.stack();
    // Stages 2 and 3 sum the micro-batches' gradient blocks themselves.
    let mut accumulator = (micro < shape.batch && !opt.reduces_each_gradient())
        .then(|| GradAccumulator::new(vars.clone(), shape.batch).observed(Tags));
    let mut first = None;
    let mut ledger_time = std::time::Duration::ZERO;
    let mut loss_value = 0f32;
    let mut grads = None;
    for start_row in (0..shape.batch).step_by(micro) {
        let rows = micro.min(shape.batch - start_row);
        let (xm, ym) = (x.narrow(0, start_row, rows)?, y.narrow(0, start_row, rows)?);
        if shape.direct {
            let weight = if micro < shape.batch {
                rows as f64 / shape.batch as f64
            } else {
                1.0
            };
            // The direct backward, checkpointed or not, handing each
            // gradient to `add` as it makes it.
            let direct = |add: &mut dyn FnMut(&Var, Tensor) -> candle_core::Result<()>,
                          observer: &dyn Observer| {
                if shape.checkpointed {
                    model.direct_checkpointed_with(&xm, &ym, weight, add, observer)
                } else {
                    model.direct_loss_with(&xm, &ym, weight, add, observer)
                }
            };
            let loss = match accumulator.as_mut() {
                // Stage 2: each gradient reduce-scattered as it is made;
                // stage 3: each block, reduce-scattered by the backward,
                // summed. Checkpointed or not.
                _ if opt.reduces_each_gradient() => {
                    opt.direct_reduced(&model, (&xm, &ym), weight, shape.checkpointed)?
                }
                // Each gradient added into the sum as it is made.
                Some(acc) => acc.add_weighted_with(rows, |add| direct(add, &Tags))?,
                None => {
                    let mut store = GradStore::default();
                    let loss = direct(
                        &mut |var, g| {
                            if store.get(var.as_tensor()).is_none() {
                                handed.held.set(handed.held.get() + bytes_of(&g));
                            }
                            add_grad(&mut store, var, g)
                        },
                        &handed,
                    )?;
                    grads = Some(store);
                    loss
                }
            };
            loss_value = (loss.to_dtype(DType::F32)?.to_scalar::<f32>()? as f64 / weight) as f32;
            continue;
        }
        if shape.checkpointed {
            // The accumulator (or stage 2's or 3's sum) takes gradients already
            // weighted by the micro-batch's share of the rows.
            let weight = if micro < shape.batch {
                rows as f64 / shape.batch as f64
            } else {
                1.0
            };
            let head = |h: &Tensor| model.head_loss(h, &ym)? * weight;
            let out = Category::Activations.scope(|| {
                Sequential::taped(&stack)
                    .segments(stack.len())
                    .observer(&phases)
                    .backward(&xm, &vars, head)
            })?;
            loss_value =
                (out.loss.to_dtype(DType::F32)?.to_scalar::<f32>()? as f64 / weight) as f32;
            match accumulator.as_mut() {
                // The checkpointed backward hands its gradients over at
                // its end: stage 2 reduces them then (stage 3's are
                // blocks already).
                _ if opt.reduces_each_gradient() => {
                    Category::Gradients.scope(|| opt.reduce_all(out.grads, &vars))?
                }
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
            _ if opt.reduces_each_gradient() => {
                let weight = rows as f64 / shape.batch as f64;
                Category::Gradients.scope(|| -> anyhow::Result<()> {
                    let store = (&loss * weight)?.backward()?;
                    let grads = param_grads(&store, &vars);
                    // The intermediate gradients go; the parameters' stay
                    // until each is reduced.
                    drop(store);
                    opt.reduce_all(grads, &vars)
                })?
            }
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
    // Closed before the region's next mark, whose peak so far is then the
    // region's (the update's own peak is in the region's, not among them).
    let phase_grads = handed.finish(grads.is_some() && shape.direct);
    let phases = phases.finish();
    region.mark("after backward");
    let whole = match accumulator.as_mut() {
        Some(acc) => Some(acc.take()?),
        None => grads,
    };
    Category::OptimizerState.scope(|| opt.step(whole, &model))?;
    // A GPU runs the update's kernels after their launch returns: the step
    // ends when they have.
    device.synchronize()?;
    let seconds = start.elapsed().saturating_sub(ledger_time).as_secs_f64();
    region.mark("after AdamW step");
    drop((accumulator, opt, x, y, model));
    let region = ctx.end_region(region);
    let (after_forward, ledger_bytes, largest_held) = first.unwrap_or_default();
    let baseline = region.baseline.total();
    Ok(StepReport {
        phases: phases.iter().map(|p| p.saturating_sub(baseline)).collect(),
        phase_grads,
        region,
        after_forward,
        ledger_bytes,
        largest_held,
        params,
        loss: loss_value,
        seconds,
    })
}

/// Measured steps of `config` in `dtype`, one of each shape in `shapes`,
/// named `what`, after the device's warm-up and a step of the smallest and
/// of the largest batch whose peaks are not used: what a process sets up
/// once for these shapes (thread pools, the matrix products' buffers) is
/// not a part of a step's peak. The largest batch's warm-up step alone left
/// some: on the planner's test model (hidden 64) the first step of one
/// sequence then held 0.5 MiB more than every later one. The warm-up steps
/// alone left some too: a pool thread they happened not to give a product
/// made gemm's packing buffer (the size of its L2 cache) inside a measured
/// step, 2 MiB on one of them in about half the runs.
pub fn calibrate(
    ctx: &mut Context,
    what: &str,
    config: GptConfig,
    dtype: DType,
    shapes: &[StepShape],
    seed: u64,
    parallel: Option<&Parallel>,
) -> anyhow::Result<Vec<StepReport>> {
    let (Some(&smallest), Some(&largest)) = (
        shapes.iter().min_by_key(|s| s.batch),
        shapes.iter().max_by_key(|s| s.batch),
    ) else {
        return Ok(Vec::new());
    };
    ctx.progress(&format!("warming up {what}"));
    workbook_sdk::device::warm_up(ctx.device())?;
    let warm_ups = if smallest == largest {
        vec![largest]
    } else {
        vec![smallest, largest]
    };
    for shape in warm_ups {
        measured_step(
            ctx,
            format!("{what}, warm-up at batch {}", shape.batch),
            config,
            dtype,
            shape,
            seed,
            parallel,
        )?;
    }
    shapes
        .iter()
        .map(|&shape| {
            ctx.progress(&format!("calibrating {what}, batch {}", shape.batch));
            measured_step(
                ctx,
                format!("{what}, batch {}", shape.batch),
                config,
                dtype,
                shape,
                seed,
                parallel,
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use candle_distributed::{Split, Threads};
    use candle_ledger::Labeller;

    use super::*;
    use workbook_models::gpt::testing::{assert_close, flat, gradients, SMALL};
    const BATCH: usize = 8;

    /// The gradients of one process on the whole batch, in `vars` order.
    fn one_process(config: GptConfig, x: &Tensor, y: &Tensor) -> anyhow::Result<Vec<Vec<f32>>> {
        let model = Gpt::new(config, DType::F32, &mut Rng::seeded(3), &Device::Cpu)?;
        let store = model.loss(x, y, &Labeller::default())?.backward()?;
        Ok(gradients(&model, store)?)
    }

    /// One rank's backward under ZeRO stage 3 as [`measured_step`] runs it:
    /// its rows of the batch in micro-batches of `micro`, each loss weighted
    /// by its share of the rows, the gradient blocks summed in the update's
    /// store; then each block all-gathered into the whole gradient it is of.
    /// (The parameters after AdamW's first step are no test: it divides
    /// each gradient by its own size, so a gradient that is zero but for
    /// rounding, as the key bias's is, moves its parameter by the
    /// rounding's sign.)
    /// With `direct` `Some(checkpointed)`, each micro-batch runs the direct
    /// backward ([`Gpt::direct_loss_with`], or checkpointed
    /// [`Gpt::direct_checkpointed_with`]), which gathers each stage's
    /// parameters and hands over each gradient block as soon as it is
    /// reduced.
    fn stage3_rank(
        comm: Arc<Comm>,
        config: GptConfig,
        (x, y): (&Tensor, &Tensor),
        micro: usize,
        direct: Option<bool>,
    ) -> anyhow::Result<Vec<Vec<f32>>> {
        let parallel = Parallel::new(Arc::clone(&comm), Stage::Zero3);
        let model = Gpt::sharded(
            config,
            DType::F32,
            &mut Rng::seeded(3),
            &Device::Cpu,
            Arc::clone(&comm),
        )?;
        let vars = model.vars();
        let mut opt = Update::new(vars.clone(), Some(&parallel))?;
        assert!(opt.reduces_each_gradient());
        let rows = BATCH / comm.size();
        let (x, y) = (
            x.narrow(0, comm.rank() * rows, rows)?,
            y.narrow(0, comm.rank() * rows, rows)?,
        );
        for start in (0..rows).step_by(micro) {
            let m = micro.min(rows - start);
            let (xm, ym) = (x.narrow(0, start, m)?, y.narrow(0, start, m)?);
            let weight = m as f64 / rows as f64;
            if let Some(checkpointed) = direct {
                opt.direct_reduced(&model, (&xm, &ym), weight, checkpointed)?;
                continue;
            }
            let loss = model.loss(&xm, &ym, &Labeller::default())?;
            let store = (loss * weight)?.backward()?;
            opt.reduce_all(param_grads(&store, &vars), &vars)?;
        }
        let Update::Sharded(_, sum) = &mut opt else {
            anyhow::bail!("stage 3's update is not the sharded one");
        };
        model.take_grads_into(sum);
        let sizes = config.param_sizes();
        let mut whole = Vec::new();
        for (var, &len) in vars.iter().zip(&sizes) {
            let block = flat(sum.get(var.as_tensor()).expect("a gradient block"))?;
            let mut all = vec![0f32; Split::new(len, comm.size()).padded()];
            comm.all_gather(&block, &mut all)?;
            all.truncate(len);
            whole.push(all);
        }
        Ok(whole)
    }

    /// ZeRO stage 3 on 2 and 4 ranks (threads of this process, exchanging
    /// real values), whole and in micro-batches (3 then 1 of a rank's 4
    /// rows: unequal weights), through candle's graph or the direct
    /// backward, the head tied or with its own table, gives the gradients
    /// of one process on the whole batch: every block the mean over the
    /// ranks.
    #[test]
    fn stage_3_on_ranks_has_the_gradients_of_one_process_on_the_whole_batch() -> anyhow::Result<()>
    {
        let (x, y) = corpus::batch(
            &mut Rng::seeded(4),
            BATCH,
            SMALL.seq,
            SMALL.vocab,
            &Device::Cpu,
        )?;
        let untied = GptConfig {
            tied_head: false,
            ..SMALL
        };
        let cases = [(2, 4), (2, 3), (4, 1)]
            .into_iter()
            .flat_map(|(ranks, micro)| {
                [None, Some(false), Some(true)].map(|direct| (SMALL, ranks, micro, direct))
            })
            .chain([None, Some(false), Some(true)].map(|direct| (untied, 2, 3, direct)));
        for (config, ranks, micro, direct) in cases {
            let want = one_process(config, &x, &y)?;
            let got = std::thread::scope(|s| {
                let handles: Vec<_> = Threads::world(ranks)
                    .into_iter()
                    .map(|t| {
                        let (x, y) = (&x, &y);
                        let comm = Arc::new(Comm::new(t));
                        s.spawn(move || stage3_rank(comm, config, (x, y), micro, direct))
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("a rank panicked"))
                    .collect::<anyhow::Result<Vec<_>>>()
            })?;
            for (rank, grads) in got.iter().enumerate() {
                let what = format!(
                    "{ranks} ranks, micro-batches of {micro}, direct (checkpointed) {direct:?}, \
                     tied head {}, \
                     rank {rank}",
                    config.tied_head
                );
                assert_close(grads, &want, &what);
            }
        }
        Ok(())
    }
}
