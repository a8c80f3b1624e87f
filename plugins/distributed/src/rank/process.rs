//! A rank as a process: its pid and report files, the faults a test asks
//! of it, and how it ends (never left behind by its launcher).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_distributed::Comm;
use workbook_sdk::anyhow::{self, Context as _};
use workbook_sdk::observe::Tags;

use workbook_planner::stage::Stage;

use super::RankReport;

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

pub(super) fn write_report(report: &RankReport, dir: &Path) -> anyhow::Result<()> {
    let path = report_path(dir, report.rank);
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec(report)?)
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// What a test asks a rank to do wrong: `RANK:STAGE:crash` exits at the
/// start of that stage, `RANK:STAGE:hang` sleeps there (from
/// `WORKBOOK_RANK_FAULT`, read by [`rank_main`] and by a plan's
/// verification on ranks, which strikes at the stage it verifies).
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

    /// Crashes or hangs this process if it is rank `rank` at `stage`.
    pub fn strike(&self, rank: usize, stage: Stage) {
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

/// Serves as one rank of a job started by [`crate::launch::run_ranks`]:
/// writes this rank's pid into `out` (for the launcher to stop it past the
/// time limit), runs `work` on the communicator, its allocations tagged by
/// category, and exits: 0 when it succeeded, else with the error said on
/// standard error and the whole job ended (`MPI_Abort`), so that no other
/// rank waits for this one in a collective. A panic is an error too.
pub fn serve(comm: Comm, out: &Path, work: impl FnOnce(&Arc<Comm>) -> anyhow::Result<()>) -> ! {
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
/// even by SIGKILL: a rank is never left behind computing for no one. A
/// rank calls it first, before MPI's initialisation: that waits on the
/// launcher and the other ranks, and a rank orphaned there would wait
/// forever.
pub fn die_with_launcher() {
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
