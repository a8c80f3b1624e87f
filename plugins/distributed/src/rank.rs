//! What each rank runs: the four ways to train, one after the other, each
//! measured by the rank's own counting allocator and written to a report
//! file as soon as it is done (so that a rank that fails later keeps what
//! it measured).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use candle_checkpoint::lean_backward_with;
use candle_distributed::{Comm, DataParallel, Shard, ShardedLinear, Split, ZeroAdamW};
use candle_lean_optim::LeanAdamW;
use serde::{Deserialize, Serialize};
use workbook_models::Rng;
use workbook_sdk::anyhow::{self, Context as _};
use workbook_sdk::candle::backprop::GradStore;
use workbook_sdk::candle::{DType, Device, Module, Result, Tensor, Var};
use workbook_sdk::candle_nn::{self, Optimizer, ParamsAdamW};
use workbook_sdk::meter::CpuMeter;
use workbook_sdk::observe::Tags;
use workbook_sdk::{Category, Context};

use workbook_planner::stage::{ModelState, Precision, Stage};

/// What the cell asks of every rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankRequest {
    /// Linear + ReLU layers.
    pub layers: usize,
    /// Features in and out of each layer.
    pub width: usize,
    /// Rows of the whole batch, split over the ranks (the first `batch %
    /// ranks` take one more).
    pub batch: usize,
    /// Training steps per stage.
    pub steps: usize,
    /// Seed of the weights and the data (the same on every rank).
    pub seed: u64,
    /// The dtype the model trains in.
    #[serde(default)]
    pub precision: Precision,
    /// The folder each rank writes `rank-R.json` into.
    pub out: PathBuf,
    /// The most this rank may hold at once: the cell's cap (`--max-memory`)
    /// holds for every rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_memory: Option<u64>,
}

/// What one rank measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RankReport {
    /// This rank.
    pub rank: usize,
    /// The ranks of the job.
    pub ranks: usize,
    /// The collective library.
    pub engine: String,
    /// Each stage done so far.
    pub stages: Vec<StageReport>,
}

/// One stage on one rank.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StageReport {
    /// Which.
    pub stage: Stage,
    /// Parameters of the model.
    pub psi: u64,
    /// Parameters of this rank's blocks (Ψ/N, each tensor's split rounded up).
    pub block: u64,
    /// Parameters once each tensor is padded to a multiple of the ranks.
    pub padded: u64,
    /// Model states held, from the meter: parameters after the step,
    /// gradients when the optimizer is about to use them, optimizer state
    /// after the step.
    pub held: ModelState,
    /// The highest bytes live at once during the steps, above the stage's
    /// start (model states included, their set-up not).
    pub peak: u64,
    /// Communication buffers at their highest.
    pub comm_peak: u64,
    /// Activations at their highest.
    pub activations_peak: u64,
    /// Bytes this rank sent per step (ring algorithms).
    pub sent_per_step: u64,
    /// Bytes this rank received per step.
    pub received_per_step: u64,
    /// Collective calls per step.
    pub calls_per_step: u64,
    /// Mean time of a step.
    pub seconds_per_step: f64,
    /// The loss of this rank's shard at the last step.
    pub loss: f32,
    /// Tensors that hold the model states (each with candle's bookkeeping).
    pub tensors: u64,
    /// The same stage measured again at half the width, for one step: what
    /// grows with the model is the difference between the two.
    pub smaller: Option<Smaller>,
}

/// A stage's model states measured at half the width: the same tensors,
/// so the same bookkeeping, and a quarter of the weights' elements.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Smaller {
    /// Parameters of the smaller model.
    pub psi: u64,
    /// Parameters of this rank's blocks of it.
    pub block: u64,
    /// Model states held, from the meter, as [`StageReport::held`].
    pub held: ModelState,
}

impl RankRequest {
    /// The same request at half the width and for one step, if the width
    /// can be halved.
    fn smaller(&self) -> Option<RankRequest> {
        (self.width >= 2).then(|| RankRequest {
            width: self.width / 2,
            steps: 1,
            ..self.clone()
        })
    }
}

/// A Linear + ReLU layer over any linear map.
struct Layer<L>(L);

impl<L: Module> Module for Layer<L> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.0.forward(x)?.relu()
    }
}

fn forward<L: Module>(layers: &[Layer<L>], x: &Tensor) -> Result<Tensor> {
    layers.iter().try_fold(x.clone(), |h, l| l.forward(&h))
}

fn mse(out: &Tensor, y: &Tensor) -> Result<Tensor> {
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
fn shard_of(req: &RankRequest, comm: &Comm) -> Shard {
    Shard::new(req.batch, comm.size(), comm.rank())
}

/// `shard`'s rows of step `step`'s batch, in the dtype it trains in.
fn batch(req: &RankRequest, shard: Shard, step: usize, dev: &Device) -> Result<(Tensor, Tensor)> {
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
type Dense = (Vec<Layer<candle_nn::Linear>>, Vec<Var>);

fn dense(req: &RankRequest, dev: &Device) -> Result<Dense> {
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
    let (l, _) =
        Category::Gradients.scope(|| lean_backward_with(layers, x, vars, loss, on_grad, &Tags))?;
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
fn run_stage(
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
    let shard = shard_of(req, comm);
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

/// The pids the ranks of a job wrote into `dir`, for stopping them.
pub fn rank_pids(dir: &Path) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".pid"))
        .filter_map(|e| std::fs::read_to_string(e.path()).ok())
        .filter_map(|t| t.trim().parse().ok())
        .collect()
}

/// The report file of `rank` in `dir`.
pub fn report_path(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("rank-{rank}.json"))
}

fn write_report(report: &RankReport, dir: &Path) -> anyhow::Result<()> {
    let path = report_path(dir, report.rank);
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec(report)?)
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// What a test asks a rank to do wrong: `RANK:STAGE:crash` exits at the
/// start of that stage, `RANK:STAGE:hang` sleeps there (from
/// `WORKBOOK_RANK_FAULT`, read by [`rank_main`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    rank: usize,
    stage: Stage,
    hang: bool,
}

impl Fault {
    /// The fault that `WORKBOOK_RANK_FAULT` describes, if any.
    pub fn from_env() -> anyhow::Result<Option<Fault>> {
        let Ok(text) = std::env::var("WORKBOOK_RANK_FAULT") else {
            return Ok(None);
        };
        let bad = || {
            anyhow::anyhow!("WORKBOOK_RANK_FAULT is `{text}`; expected RANK:STAGE:crash or RANK:STAGE:hang, STAGE one of ddp, zero1, zero2, zero3")
        };
        let parts: Vec<&str> = text.split(':').collect();
        let [rank, stage, what] = parts[..] else {
            return Err(bad());
        };
        let stage = Stage::ALL
            .into_iter()
            .find(|s| s.name() == stage)
            .ok_or_else(bad)?;
        let hang = match what {
            "hang" => true,
            "crash" => false,
            _ => return Err(bad()),
        };
        Ok(Some(Fault {
            rank: rank.parse().map_err(|_| bad())?,
            stage,
            hang,
        }))
    }

    fn strike(&self, rank: usize, stage: Stage) {
        if self.rank != rank || self.stage != stage {
            return;
        }
        if self.hang {
            loop {
                std::thread::sleep(std::time::Duration::from_secs(3600));
            }
        }
        eprintln!(
            "error: rank {rank}: crashing at {} as WORKBOOK_RANK_FAULT asks",
            stage.name()
        );
        std::process::exit(3);
    }
}

/// A rank's whole run (what `workbook rank` does under `mpirun`): every
/// stage in turn, the report rewritten after each. A rank that fails ends
/// the whole job (`MPI_Abort`), so that no other rank waits for it in a
/// collective.
pub fn rank_main(comm: Comm, req: &RankRequest) -> ! {
    workbook_sdk::meter::set_limit(req.max_memory);
    serve(comm, &req.out, |comm| run_rank(comm, req))
}

/// Serves as one rank of a job started by [`crate::launch::run_ranks`]:
/// writes this rank's pid into `out` (for the launcher to stop it past the
/// time limit), runs `work` on the communicator, its allocations tagged by
/// category, and exits: 0 when it succeeded, else with the error said on
/// standard error and the whole job ended (`MPI_Abort`), so that no other
/// rank waits for this one in a collective. A panic is an error too.
pub fn serve(comm: Comm, out: &Path, work: impl FnOnce(&Arc<Comm>) -> anyhow::Result<()>) -> ! {
    die_with_launcher();
    let comm = Arc::new(comm.observed(Tags));
    let run = || -> anyhow::Result<()> {
        std::fs::write(
            out.join(format!("rank-{}.pid", comm.rank())),
            std::process::id().to_string(),
        )
        .context("writing the rank's pid")?;
        work(&comm)
    };
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run))
        .unwrap_or_else(|payload| Err(workbook_sdk::worker::panicked(payload.as_ref())));
    match result {
        Ok(()) => {
            drop(comm);
            std::process::exit(0)
        }
        Err(e) => {
            eprintln!("error: rank {} of {}: {e:#}", comm.rank(), comm.size());
            comm.abort(1)
        }
    }
}

/// Makes this rank end when the process that started it (mpirun) ends,
/// even by SIGKILL: a rank is never left behind computing for no one.
fn die_with_launcher() {
    #[cfg(target_os = "linux")]
    // SAFETY: prctl(2) and getppid(2) with plain integer arguments.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        // The launcher may have died before the prctl: then this rank was
        // handed to init (or a subreaper), and is alone.
        if libc::getppid() == 1 {
            std::process::exit(1);
        }
    }
}

fn run_rank(comm: &Arc<Comm>, req: &RankRequest) -> anyhow::Result<()> {
    let fault = Fault::from_env()?;
    if req.batch < comm.size() {
        anyhow::bail!(
            "a batch of {} rows cannot give each of {} ranks a row",
            req.batch,
            comm.size()
        );
    }
    let meter = Arc::new(CpuMeter::new()?);
    let mut ctx = Context::new(Device::Cpu, meter, false);
    let mut report = RankReport {
        rank: comm.rank(),
        ranks: comm.size(),
        engine: comm.describe(),
        stages: Vec::new(),
    };
    // The first products and backward allocate workspaces that live as
    // long as the process (the matrix-product library's per-thread
    // buffers): allocate them here, untagged, not in the first stage.
    Category::Other.scope(|| -> anyhow::Result<()> {
        let (layers, vars) = dense(req, &Device::Cpu)?;
        let (x, y) = batch(req, shard_of(req, comm), 0, &Device::Cpu)?;
        let grads = mse(&forward(&layers, &x)?, &y)?.backward()?;
        drop((grads, layers, vars));
        Ok(())
    })?;
    for stage in Stage::ALL {
        if let Some(f) = &fault {
            f.strike(comm.rank(), stage);
        }
        let what = || format!("rank {} of {}, {}", comm.rank(), comm.size(), stage.name());
        let mut s = run_stage(&mut ctx, comm, stage, req).with_context(what)?;
        if let Some(smaller) = req.smaller() {
            let m = run_stage(&mut ctx, comm, stage, &smaller)
                .with_context(|| format!("{} at half the width", what()))?;
            s.smaller = Some(Smaller {
                psi: m.psi,
                block: m.block,
                held: m.held,
            });
        }
        report.stages.push(s);
        write_report(&report, &req.out)?;
        // Every rank's report of this stage is written before any rank
        // goes on, so a failure later keeps all of them.
        comm.barrier()?;
    }
    Ok(())
}
