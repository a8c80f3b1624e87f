//! Starting the ranks: `mpirun -n N` over this very executable, with a time
//! limit, and reading back what each rank reported.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use workbook_sdk::anyhow::{self, Context as _};

use workbook_planner::plan::{of_ranks, Verification, VerifyRequest};

use crate::rank::{report_path, RankReport, RankRequest};

/// One MPI job.
#[derive(Debug, Clone)]
pub struct Job {
    /// Ranks to start.
    pub ranks: usize,
    /// Linear + ReLU layers.
    pub layers: usize,
    /// Width of each.
    pub width: usize,
    /// Rows of the whole batch.
    pub batch: usize,
    /// Steps per stage.
    pub steps: usize,
    /// Seed.
    pub seed: u64,
    /// The dtype the model trains in.
    pub precision: workbook_planner::stage::Precision,
    /// The job's time limit.
    pub timeout: Duration,
    /// The most each rank may hold at once (the cell's cap), if any.
    pub max_memory: Option<u64>,
}

/// What came back from a job: every report that was written, and what went
/// wrong, if anything.
#[derive(Debug, Default)]
pub struct Outcome {
    /// The reports of the ranks that wrote one, in rank order.
    pub reports: Vec<RankReport>,
    /// Why the job failed: a rank's error, a crash, the time limit, missing
    /// reports.
    pub error: Option<String>,
}

/// How to install what a job needs.
pub const INSTALL: &str = "install Open MPI and libclang (Debian and Ubuntu: apt install openmpi-bin libopenmpi-dev libclang-dev) and build with `--features mpi`";

/// Whether this executable can run ranks.
pub fn built_with_mpi() -> bool {
    cfg!(feature = "mpi")
}

/// Why a job could not start at all (no MPI in this build, no `mpirun`),
/// as against a job that started and failed: a cell tries no more jobs.
#[derive(Debug)]
pub struct CannotStart(String);

impl std::fmt::Display for CannotStart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CannotStart {}

/// Why this build cannot start ranks, if it cannot: it was built without
/// MPI, or no `mpirun` is on the `PATH`.
pub fn cannot_start() -> Option<CannotStart> {
    if !built_with_mpi() {
        return Some(CannotStart(format!(
            "this runs MPI ranks, and this workbook was built without the `mpi` feature: \
             {INSTALL}"
        )));
    }
    which::which("mpirun").err().map(|e| {
        CannotStart(format!(
            "this runs MPI ranks, and no `mpirun` was found on the PATH ({e}): install Open MPI \
             (Debian and Ubuntu: apt install openmpi-bin)"
        ))
    })
}

/// Why a cell that starts MPI jobs of these rank counts cannot run in this
/// build (see [`Plugin::unavailable`](workbook_sdk::Plugin::unavailable));
/// `None` when it can, or starts none. The same for every such cell, so
/// that a run says it once for them all.
pub fn unavailable(counts: &[usize]) -> Option<String> {
    if counts.is_empty() {
        return None;
    }
    cannot_start().map(|why| why.to_string())
}

/// The executable that serves as a rank: `$WORKBOOK_BIN`, else this one.
fn rank_executable() -> anyhow::Result<PathBuf> {
    if let Some(bin) = std::env::var_os("WORKBOOK_BIN") {
        use std::os::unix::fs::PermissionsExt;
        let path = PathBuf::from(bin);
        let executable = std::fs::metadata(&path)
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
        if !executable {
            anyhow::bail!(
                "WORKBOOK_BIN is {}, which is not an executable file; point it at a workbook \
                 built with `--features mpi`, or unset it to start this one",
                path.display()
            );
        }
        return Ok(path);
    }
    std::env::current_exe().context("finding the workbook executable to start as ranks")
}

/// What the ranks said that matters: their `error:` lines, a failed
/// allocation, a panic, and which rank mpirun saw fail (MPI's own abort
/// banner would push these out of a plain tail), else the last lines.
fn said(log: &str) -> String {
    let telling = |l: &str| {
        l.trim_start().starts_with("error:")
            || l.contains("mpirun noticed that process rank")
            || workbook_sdk::worker::DYING_WORDS
                .iter()
                .any(|t| l.contains(t))
    };
    let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
    let errors: Vec<&str> = lines.iter().copied().filter(|l| telling(l)).collect();
    if errors.is_empty() {
        lines[lines.len().saturating_sub(8)..].join("\n")
    } else {
        errors.join("\n")
    }
}

/// Ends a job: SIGTERM to mpirun, which passes it on to its ranks; after a
/// grace period, SIGKILL to mpirun if it is still there and to every rank
/// that wrote its pid into `dir` and still runs (Open MPI puts ranks in
/// process groups of their own, so a group signal would miss them).
fn stop(child: &mut std::process::Child, dir: &std::path::Path) {
    let signal = |pid: u32, sig: libc::c_int| {
        // SAFETY: kill(2) on a pid this function has checked is ours.
        unsafe { libc::kill(pid as libc::pid_t, sig) };
    };
    signal(child.id(), libc::SIGTERM);
    let grace = Instant::now();
    let mut ended = false;
    while grace.elapsed() < Duration::from_secs(3) {
        if let Ok(Some(_)) = child.try_wait() {
            ended = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if !ended {
        let _ = child.kill();
    }
    let _ = child.wait();
    let marker = dir.to_string_lossy().into_owned();
    for pid in crate::rank::rank_pids(dir) {
        // Only a process whose command line names this job's folder: the
        // pid may have been reused since.
        let ours = std::fs::read(format!("/proc/{pid}/cmdline"))
            .map(|c| String::from_utf8_lossy(&c).contains(&marker))
            .unwrap_or(false);
        if ours {
            signal(pid, libc::SIGKILL);
        }
    }
}

/// How a job's ranks ended.
#[derive(Debug)]
pub struct Ran {
    /// mpirun's exit status; `None` when the job ran past its time limit
    /// and was stopped.
    pub status: Option<ExitStatus>,
    /// What the ranks and mpirun wrote.
    pub log: String,
    /// The time limit it ran under.
    pub timeout: Duration,
}

impl Ran {
    /// What went wrong with the job as a whole: the time limit, a failed
    /// mpirun.
    pub fn problems(&self) -> Vec<String> {
        match self.status {
            None => vec![format!(
                "the job ran past its time limit of {:.0} s and was stopped",
                self.timeout.as_secs_f64()
            )],
            Some(s) if !s.success() => vec![format!("mpirun ended with {s}")],
            Some(_) => Vec::new(),
        }
    }

    /// `problems` with what the ranks said, as one error; `None` when
    /// there are none.
    pub fn error(&self, problems: &[String]) -> Option<String> {
        if problems.is_empty() {
            return None;
        }
        let said = said(&self.log);
        Some(if said.is_empty() {
            problems.join("; ")
        } else {
            format!("{}; the ranks said:\n{said}", problems.join("; "))
        })
    }
}

/// Sets `command` (an `mpirun`) to start `exe` as `ranks` ranks on this
/// machine, each on one thread; the rank's own arguments follow.
pub fn mpirun_args<'c>(command: &'c mut Command, ranks: usize, exe: &Path) -> &'c mut Command {
    command
        .args(["--oversubscribe", "-n", &ranks.to_string()])
        // Open MPI refuses to start as root unless told.
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        // Each rank computes on one thread: N ranks share this machine's cores.
        .env("RAYON_NUM_THREADS", "1")
        // Shared memory between ranks without cross-process copies, which
        // containers often forbid.
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
        .arg(exe)
}

/// Runs `mpirun -n ranks` over this executable with `args`, each rank
/// writing its pid into `dir` (as [`crate::rank::serve`] does) so that a
/// job past `timeout` can be stopped whole.
pub fn run_ranks(
    ranks: usize,
    timeout: Duration,
    dir: &Path,
    args: &[String],
) -> anyhow::Result<Ran> {
    if let Some(why) = cannot_start() {
        return Err(why.into());
    }
    let exe = rank_executable()?;
    let log = dir.join("mpirun.log");
    let log_file = std::fs::File::create(&log).context("making the job's log")?;
    let mut command = Command::new("mpirun");
    // If this process dies (the runner stopped its cell), mpirun is told to
    // end its job, as Ctrl-C would.
    #[cfg(target_os = "linux")]
    // SAFETY: prctl is async-signal-safe, as a pre_exec closure requires.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut command, || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
    let mut child = mpirun_args(&mut command, ranks, &exe)
        .args(args)
        .stdin(Stdio::null())
        .stdout(log_file.try_clone()?)
        .stderr(log_file)
        .spawn()
        .map_err(|e| CannotStart(format!("mpirun could not be started ({e}): {INSTALL}")))?;
    let start = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) => {}
            Err(e) => {
                stop(&mut child, dir);
                return Err(e).context("waiting for mpirun");
            }
        }
        if start.elapsed() > timeout {
            stop(&mut child, dir);
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Ok(Ran {
        status,
        log: std::fs::read_to_string(&log).unwrap_or_default(),
        timeout,
    })
}

/// Reads the JSON report each of `ranks` ranks wrote into `dir` (`path(dir,
/// rank)`): those that read, in rank order, and what is wrong with the
/// others (one line for the missing ones).
pub fn gather<T: serde::de::DeserializeOwned>(
    dir: &Path,
    ranks: usize,
    path: impl Fn(&Path, usize) -> PathBuf,
) -> (Vec<T>, Vec<String>) {
    let (mut reports, mut problems, mut missing) = (Vec::new(), Vec::new(), Vec::new());
    for rank in 0..ranks {
        match std::fs::read(path(dir, rank)) {
            Ok(bytes) => match serde_json::from_slice(&bytes) {
                Ok(report) => reports.push(report),
                Err(e) => problems.push(format!("rank {rank}'s report does not read: {e}")),
            },
            Err(_) => missing.push(rank),
        }
    }
    if !missing.is_empty() {
        problems.push(format!("no report from rank(s) {missing:?}"));
    }
    (reports, problems)
}

/// Runs `job` under `mpirun` and gathers the ranks' reports. Fails only
/// when the job cannot start at all; a job that starts and fails comes
/// back with its error and the reports written before it.
pub fn launch(job: &Job) -> anyhow::Result<Outcome> {
    let dir = tempfile::tempdir().context("making a folder for the ranks' reports")?;
    let request = RankRequest {
        layers: job.layers,
        width: job.width,
        batch: job.batch,
        steps: job.steps,
        seed: job.seed,
        precision: job.precision,
        out: dir.path().to_path_buf(),
        max_memory: job.max_memory,
    };
    let args = [
        "rank".to_string(),
        "--request".into(),
        serde_json::to_string(&request)?,
    ];
    let ran = run_ranks(job.ranks, job.timeout, dir.path(), &args)?;
    let (reports, unread) = gather(dir.path(), job.ranks, report_path);
    let mut outcome = Outcome {
        reports,
        error: None,
    };
    let mut problems = ran.problems();
    problems.extend(unread);
    let complete = outcome
        .reports
        .iter()
        .filter(|r| r.stages.len() == 4)
        .count();
    if problems.is_empty() && complete < job.ranks {
        problems.push(format!(
            "{} of {} ranks finished every stage",
            complete, job.ranks
        ));
    }
    outcome.error = ran.error(&problems);
    Ok(outcome)
}

/// Runs a plan's verification on `ranks` MPI ranks (`workbook rank
/// --verify`, each rank measured by its own counting allocator) and gathers
/// what each measured: the highest peak, the slowest rank's time.
pub fn verify_on_ranks(
    mut v: VerifyRequest,
    ranks: usize,
    timeout: Duration,
) -> anyhow::Result<Verification> {
    let dir = tempfile::tempdir().context("making a folder for the ranks' reports")?;
    v.out = Some(dir.path().to_path_buf());
    let args = [
        "rank".to_string(),
        "--verify".into(),
        serde_json::to_string(&v)?,
    ];
    let ran = run_ranks(ranks, timeout, dir.path(), &args)?;
    let (each, unread): (Vec<Verification>, _) = gather(dir.path(), ranks, |dir, rank| {
        dir.join(format!("verify-{rank}.json"))
    });
    let mut problems = ran.problems();
    problems.extend(unread);
    if let Some(error) = ran.error(&problems) {
        anyhow::bail!("the job on {ranks} ranks failed: {error}");
    }
    of_ranks(&each).context("no rank reported")
}
