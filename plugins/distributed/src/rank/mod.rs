//! What each rank runs: the four ways to train, one after the other, each
//! measured by the rank's own counting allocator and written to a report
//! file as soon as it is done (so that a rank that fails later keeps what
//! it measured).

use std::path::PathBuf;
use std::sync::Arc;

use candle_distributed::Comm;
use serde::{Deserialize, Serialize};
use workbook_sdk::anyhow::{self, Context as _};
use workbook_sdk::candle::Device;
use workbook_sdk::meter::CpuMeter;
use workbook_sdk::{Category, Context};

use workbook_planner::stage::{ModelState, Precision, Stage};

mod process;
mod train;

use process::write_report;
pub use process::{die_with_launcher, rank_pids, report_path, serve, Fault};
use train::{batch, dense, forward, mse, run_stage, shard_of};

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

/// A rank's whole run (what `workbook rank` does under `mpirun`): every
/// stage in turn, the report rewritten after each. A rank that fails ends
/// the whole job (`MPI_Abort`), so that no other rank waits for it in a
/// collective.
pub fn rank_main(comm: Comm, req: &RankRequest) -> ! {
    workbook_sdk::meter::set_limit(req.max_memory);
    serve(comm, &req.out, |comm| run_rank(comm, req))
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
        let (x, y) = batch(req, shard_of(req, comm)?, 0, &Device::Cpu)?;
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
