//! Chapters as Jupyter notebooks for the evcxr Rust kernel.
//!
//! `workbook notebook CHAPTER` writes a notebook ([`export`]). Where a
//! cell's plugin shows its experiment's source, the notebook holds that code
//! and runs it in the kernel through `live::Live`, measured by the "Rust
//! (workbook)" kernel's allocation interposer (`workbook kernel install`).
//! Other cells run in a child process through [`Notebook::run_cell`]: the
//! display side, which builds without the `runner` feature:
//!
//! ```text
//! :dep workbook = { path = "..", default-features = false }
//! :preserve_vars_on_panic 0
//! let wb = workbook::Notebook::new("chapter4.toml").check(true);
//! wb.run_cell("zero")
//! ```
//!
//! # Why a child process for those
//!
//! Measuring in the kernel needs the interposer, since evcxr compiles each
//! notebook cell as its own library with its own copy of a dependency's
//! statics, the counting allocator's included. A cell that runs in a fresh
//! `workbook run CHAPTER --cell ID --format json` process (chapter 4's ranks
//! under `mpirun`, for one) is measured exactly as in the terminal, and the
//! notebook renders the JSON report it prints.
//!
//! # How a failure fails the notebook cell
//!
//! An `Err` or a caught panic in an evcxr cell leaves the cell successful.
//! When a chapter cell fails, [`Notebook::run_cell`] and `live::Live::run`
//! print its results as text (evcxr drops the rich output of a cell that
//! fails), write what failed to stderr and end the cell's process, which
//! evcxr reports as the cell's error: Jupyter marks it, and an execution
//! (`jupyter nbconvert --execute`, `scripts/notebook_check.py`) stops there.
//! The kernel restarts its process: the learner runs the setup cell again.
//! Outside evcxr they panic instead. The setup cell's
//! `:preserve_vars_on_panic 0` makes any other panic fail its cell too.
//!
//! An exercise's grading cell is the exception: `live::Live::grade` shows
//! the failed results and leaves the process (and the learner's variables)
//! alone, since failing is what an unfinished exercise does.

#[cfg(feature = "runner")]
pub mod export;
#[cfg(feature = "runner")]
pub mod live;
#[cfg(feature = "runner")]
mod names;

use std::ffi::OsString;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use crate::render::html::{cell_section, escape, Embed, NOTEBOOK_STYLE};
use crate::render::plot::{cell_plots, Formats, Plot};
use crate::render::text::{assertion_values, TextRenderer};
use crate::report::{CellReport, ChapterReport, Mode, Status};

/// The variable that names the `workbook` binary when none is set.
pub const BINARY_ENV: &str = "WORKBOOK_BIN";
/// The variable that turns check mode on, as for `workbook run`.
pub const CHECK_ENV: &str = "WORKBOOK_CHECK_MODE";

/// Runs a chapter's cells, each in its own `workbook` process, and displays
/// their results.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notebook {
    chapter: String,
    binary: PathBuf,
    check: bool,
    device: Option<String>,
}

/// Why a cell could not be run or read.
#[derive(Debug, thiserror::Error)]
pub enum NotebookError {
    /// The binary could not be started.
    #[error(
        "cannot run the workbook binary `{binary}`: {cause}. Build it with \
         `cargo build --release` and pass its path to `Notebook::binary` \
         (or set {BINARY_ENV})"
    )]
    Spawn {
        /// The binary tried.
        binary: PathBuf,
        /// Why it did not start (said in the message, so not its `source`).
        cause: std::io::Error,
    },
    /// The binary refused the request (exit status 2): a bad chapter, an
    /// unknown cell id.
    #[error("`{command}` failed: {stderr}")]
    Refused {
        /// The command line run.
        command: String,
        /// What it wrote to stderr.
        stderr: String,
    },
    /// The binary printed no report, or one this version cannot read.
    #[error("`{command}` printed no readable report ({why}); its stderr: {stderr}")]
    BadReport {
        /// The command line run.
        command: String,
        /// What was wrong with its output.
        why: String,
        /// What it wrote to stderr.
        stderr: String,
    },
}

/// `$WORKBOOK_BIN`, else this source tree's release build when there is
/// one (a notebook's `:dep` builds this library from the tree the binary is
/// built in), else `workbook` on the `PATH`.
fn default_binary() -> PathBuf {
    if let Some(bin) = std::env::var_os(BINARY_ENV) {
        return PathBuf::from(bin);
    }
    let built = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/release/workbook");
    if built.is_file() {
        return built;
    }
    PathBuf::from("workbook")
}

fn env_flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| {
        !matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "" | "0" | "false" | "no" | "off"
        )
    })
}

impl Notebook {
    /// Cells of `chapter`, a chapter id (`chapter2`, looked for as `workbook
    /// run` does, from the kernel's working directory) or a file's path
    /// (relative to that directory, which Jupyter makes the notebook's
    /// folder). The binary is `$WORKBOOK_BIN`, else the release build of the
    /// source tree this library was built from, else `workbook` on the
    /// `PATH`; check mode is on when `WORKBOOK_CHECK_MODE` is set (to
    /// anything but 0, false, no, off).
    pub fn new(chapter: impl Into<String>) -> Self {
        Self {
            chapter: chapter.into(),
            binary: default_binary(),
            check: env_flag(CHECK_ENV),
            device: None,
        }
    }

    /// Runs cells with this `workbook` binary.
    pub fn binary(mut self, path: impl Into<PathBuf>) -> Self {
        self.binary = path.into();
        self
    }

    /// Check-size parameters (`true`) or full-size ones.
    pub fn check(mut self, on: bool) -> Self {
        self.check = on;
        self
    }

    /// The device to run on (`cpu`, `cuda`, `auto`); the binary's default
    /// when not set.
    pub fn device(mut self, device: impl Into<String>) -> Self {
        self.device = Some(device.into());
        self
    }

    /// Whether cells run at check size.
    pub fn is_check(&self) -> bool {
        self.check
    }

    /// The command line that runs cell `id`.
    pub fn command(&self, id: &str) -> Command {
        let mut cmd = Command::new(&self.binary);
        cmd.args(["run", &self.chapter, "--cell", id, "--format", "json"]);
        if self.check {
            cmd.arg("--check");
        }
        if let Some(d) = &self.device {
            cmd.args(["--device", d]);
        }
        // The notebook's own setting decides, not the kernel's environment.
        cmd.env_remove(CHECK_ENV);
        // The child is not a notebook cell: evcxr's variables (one of which
        // turns the kernel's allocation interposer on) stay in the kernel.
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("EVCXR_") {
                cmd.env_remove(name);
            }
        }
        cmd
    }

    /// Runs cell `id` in a child process and reads its report. A cell that
    /// failed an assertion or errored is `Ok`: see [`CellView::failure`].
    pub fn run(&self, id: &str) -> Result<CellView, NotebookError> {
        let mut cmd = self.command(id);
        let command = shell_line(&cmd);
        let out = cmd
            .stdin(Stdio::null())
            .output()
            .map_err(|cause| NotebookError::Spawn {
                binary: self.binary.clone(),
                cause,
            })?;
        let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
        if out.status.code() == Some(2) {
            return Err(NotebookError::Refused { command, stderr });
        }
        let bad = |why: String| NotebookError::BadReport {
            command: command.clone(),
            why,
            stderr: stderr.clone(),
        };
        let report: ChapterReport = serde_json::from_slice(&out.stdout)
            .map_err(|e| bad(format!("{e}; the process ended with {}", out.status)))?;
        if report.cells.len() != 1 || report.cells[0].id != id {
            return Err(bad(format!(
                "expected the report of cell `{id}` alone, got cells {:?}",
                report.cells.iter().map(|c| &c.id).collect::<Vec<_>>()
            )));
        }
        CellView::new(report).map_err(|e| bad(format!("cannot draw its plots: {e:#}")))
    }

    /// Runs cell `id` for a notebook: returns its view when it passed, and
    /// otherwise prints its results as text and fails the notebook cell with
    /// the cell and what failed (see the module docs).
    ///
    /// # Panics
    ///
    /// Outside an evcxr kernel, when the cell could not be run, errored or
    /// failed an assertion. Inside one, it ends the cell's process instead.
    pub fn run_cell(&self, id: &str) -> CellView {
        match self.run(id) {
            Ok(v) => shown(v),
            Err(e) => fail(&e.to_string()),
        }
    }
}

/// `view` when its cell passed; otherwise prints its results as text (evcxr
/// drops the rich output of a cell that fails) and fails the notebook cell.
fn shown(view: CellView) -> CellView {
    if let Some(why) = view.failure() {
        let mut text = Vec::new();
        let _ = TextRenderer::new(&mut text).cell(view.cell());
        print!("{}", String::from_utf8_lossy(&text));
        let _ = std::io::stdout().flush();
        fail(&why);
    }
    view
}

/// Set by evcxr in the process that runs a kernel's cells.
const EVCXR_RUNTIME_ENV: &str = "EVCXR_IS_RUNTIME";

/// How long a failing cell waits for evcxr to forward what it wrote.
const FORWARDING_PAUSE: std::time::Duration = std::time::Duration::from_millis(300);

fn fail(message: &str) -> ! {
    if std::env::var_os(EVCXR_RUNTIME_ENV).is_some() {
        // A panic there prints evcxr's forced backtrace around the message,
        // and is caught unless `:preserve_vars_on_panic 0`; ending the process
        // fails the cell either way and leaves the message alone.
        let mut stderr = std::io::stderr().lock();
        let _ = writeln!(stderr, "{message}");
        let _ = stderr.flush();
        drop(stderr);
        // evcxr forwards the process's output from threads of its own, and
        // reports the cell failed when the process ends: without a pause,
        // what was just written can be lost to that race. A pause narrows
        // it, on a loaded machine perhaps not to nothing; evcxr offers no
        // way to wait for its forwarding.
        std::thread::sleep(FORWARDING_PAUSE);
        std::process::exit(1);
    }
    panic!("{message}");
}

fn shell_line(cmd: &Command) -> String {
    let mut parts: Vec<OsString> = vec![cmd.get_program().to_owned()];
    parts.extend(cmd.get_args().map(|a| a.to_owned()));
    parts
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// One cell's results, displayed in a notebook as one HTML block: printed
/// lines, tables, plots as inline SVG, the memory table and the assertions.
#[derive(Debug, Clone)]
pub struct CellView {
    report: ChapterReport,
    plots: Vec<Plot>,
    place: &'static str,
}

impl CellView {
    /// The view of the first cell of `report`, with its plots drawn.
    pub fn new(report: ChapterReport) -> anyhow::Result<Self> {
        let cell = report
            .cells
            .first()
            .ok_or_else(|| anyhow::anyhow!("the report has no cell"))?;
        let plots = cell_plots(cell, Formats::Svg);
        Ok(Self {
            report,
            plots,
            place: "in a child process",
        })
    }

    /// Says where the cell was measured (`in a child process`, `in this
    /// kernel`) in the line under its results.
    pub fn measured_in(mut self, place: &'static str) -> Self {
        self.place = place;
        self
    }

    /// The cell's report.
    pub fn cell(&self) -> &CellReport {
        &self.report.cells[0]
    }

    /// The whole report the child process printed.
    pub fn report(&self) -> &ChapterReport {
        &self.report
    }

    /// The plots drawn.
    pub fn plots(&self) -> &[Plot] {
        &self.plots
    }

    /// Whether the cell ran and every assertion held.
    pub fn passed(&self) -> bool {
        self.cell().status == Status::Passed
    }

    /// What went wrong, naming the cell and each failed assertion with its
    /// values; `None` when it passed.
    pub fn failure(&self) -> Option<String> {
        let c = self.cell();
        match c.status {
            Status::Passed => None,
            Status::Error => Some(format!(
                "cell `{}` errored: {}",
                c.id,
                c.error.as_deref().unwrap_or("no message")
            )),
            Status::Skipped => Some(match &c.not_run {
                Some(why) => format!("cell `{}` did not run: {why}", c.id),
                None => format!("cell `{}` did not run", c.id),
            }),
            Status::Failed => {
                let failed: Vec<String> = c
                    .assertions
                    .iter()
                    .filter(|a| !a.passed && !a.skipped)
                    .map(|a| {
                        let values = assertion_values(a);
                        let mut s = format!("`{}`", a.expr);
                        if !values.is_empty() {
                            s.push_str(&format!(" ({values})"));
                        }
                        if let Some(m) = &a.message {
                            s.push_str(&format!(": {m}"));
                        }
                        s
                    })
                    .collect();
                Some(format!(
                    "cell `{}` failed {} of {} assertions: {}",
                    c.id,
                    failed.len(),
                    c.assertions.len(),
                    failed.join("; ")
                ))
            }
        }
    }

    /// The HTML block: scoped styles, a line saying how it was measured, and
    /// the cell's section.
    pub fn html(&self) -> String {
        let r = &self.report;
        let mode = match r.mode {
            Mode::Full => "full size",
            Mode::Check => "check size",
        };
        let meta = format!(
            "<p class=\"meta\">{mode} · device {} · memory measured by {} {} · workbook {}</p>",
            escape(&r.device),
            escape(&r.meter),
            self.place,
            escape(&r.workbook_version)
        );
        format!(
            "<div class=\"workbook\"><style>{NOTEBOOK_STYLE}</style>{}{meta}</div>",
            cell_section(self.cell(), &self.plots, Embed::Svg, false)
        )
    }

    /// Displays the view in evcxr: prints it as one `text/html` block.
    pub fn evcxr_display(&self) {
        let mut stdout = std::io::stdout().lock();
        let _ = writeln!(
            stdout,
            "EVCXR_BEGIN_CONTENT text/html\n{}\nEVCXR_END_CONTENT",
            self.html()
        );
        let _ = stdout.flush();
    }
}
