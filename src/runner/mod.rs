//! The runner: turns a validated chapter into a [`ChapterReport`], one cell
//! at a time. It formats nothing; an [`RunObserver`] sees each cell as it ends,
//! so renderers can stream results and nothing shown is lost if a later cell
//! fails.

mod device;
mod process;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use workbook_sdk::protocol::{Body, Request, RunCell};
use workbook_sdk::worker::{execute, panicked, CELL_STACK};
use workbook_sdk::Context;

use crate::assertion::AssertionResult;
use crate::chapter::{Cell, Chapter};
use crate::registry::Registry;
use crate::report::{CellMemory, CellReport, ChapterInfo, ChapterReport, Mode, Status};

pub use device::DeviceChoice;
use device::{device_name, select_device, select_meter};
pub use process::{interrupt_flag, WorkerCommand};
pub use workbook_sdk::worker::CellOutcome;

/// A cell's time limit when neither the chapter nor the command line sets
/// one: far above any cell of the chapters here at full size, so that only
/// a cell that hangs meets it.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(3600);

/// Where cells run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Isolation {
    /// Each cell in a worker process of its own, started with this command:
    /// a crash or the time limit ends that cell alone, and each cell starts
    /// from a clean allocator. What the `workbook` command does.
    Process(WorkerCommand),
    /// Every cell on one thread of this process: for plugins registered in
    /// a program of one's own. A cell that aborts the process takes the run
    /// with it, and time limits are not enforced.
    #[default]
    InProcess,
}

/// A receiver of progress messages.
pub type ProgressFn = Arc<dyn Fn(&str) + Send + Sync>;

/// How to run a chapter.
#[derive(Clone, Default)]
pub struct RunOptions {
    /// Check-size parameters.
    pub check: bool,
    /// Run only these cells (all when empty).
    pub cells: Vec<String>,
    /// The device.
    pub device: DeviceChoice,
    /// Stop after the first cell that does not pass.
    pub fail_fast: bool,
    /// Receives progress messages of long cells.
    pub progress: Option<ProgressFn>,
    /// Where cells run.
    pub isolation: Isolation,
    /// A time limit for every cell, over the chapter's own (`timeout`).
    pub timeout: Option<Duration>,
    /// A cap on the bytes a cell may hold at once, for cells in worker
    /// processes: an allocation past it fails, and so does the cell.
    pub max_memory: Option<u64>,
    /// Set when the run is to stop (Ctrl-C): the cell running is stopped and
    /// the rest are not run; the report is marked incomplete.
    pub interrupt: Option<Arc<AtomicBool>>,
    /// A cell this build cannot run (see
    /// [`Plugin::unavailable`](workbook_sdk::Plugin::unavailable)) fails
    /// instead of being reported as not run: for CI, where a skip would
    /// hide what is missing.
    pub require_all: bool,
}

impl std::fmt::Debug for RunOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunOptions")
            .field("check", &self.check)
            .field("cells", &self.cells)
            .field("device", &self.device)
            .field("fail_fast", &self.fail_fast)
            .field("isolation", &self.isolation)
            .field("timeout", &self.timeout)
            .field("max_memory", &self.max_memory)
            .field("require_all", &self.require_all)
            .finish()
    }
}

/// Errors that stop a run before any cell runs.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// `--cell` named a cell the chapter does not have.
    #[error("chapter `{chapter}` has no cell `{cell}`{suggestion}; its cells: {available}")]
    UnknownCell {
        /// The chapter.
        chapter: String,
        /// The cell asked for.
        cell: String,
        /// `; did you mean ...?`, or nothing.
        suggestion: String,
        /// The cells it has.
        available: String,
    },
    /// The device asked for cannot be used.
    #[error("{0}")]
    Device(String),
    /// No meter can measure here.
    #[error(transparent)]
    Meter(#[from] workbook_sdk::meter::MeterError),
}

impl RunError {
    /// `chapter` has no cell `id`: the error, with the cells it has.
    pub fn unknown_cell(chapter: &Chapter, id: &str) -> Self {
        RunError::UnknownCell {
            chapter: chapter.id.clone(),
            cell: id.to_string(),
            suggestion: crate::suggest::did_you_mean(
                id,
                chapter.cells.iter().map(|c| c.id.as_str()),
            ),
            available: chapter
                .cells
                .iter()
                .map(|c| c.id.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        }
    }
}

/// Sees a chapter run as it goes (cell by cell; the toolkit's
/// `candle_observe::Observer` sees memory instead).
pub trait RunObserver {
    /// Before the first cell.
    fn started(&mut self, _report: &ChapterReport) {}
    /// Before a cell runs.
    fn cell_started(&mut self, _index: usize, _cell: &Cell) {}
    /// After a cell, with its report.
    fn cell_finished(&mut self, _report: &CellReport) {}
    /// After the last cell.
    fn finished(&mut self, _report: &ChapterReport) {}
}

/// An observer that does nothing.
#[derive(Debug, Default)]
pub struct Quiet;
impl RunObserver for Quiet {}

/// That every id of `cells` (a `--cell` selection) names a cell of
/// `chapter`; the first that does not is the error, with the ids it has.
pub fn check_cells(chapter: &Chapter, cells: &[String]) -> Result<(), RunError> {
    match cells
        .iter()
        .find(|id| !chapter.cells.iter().any(|c| &c.id == *id))
    {
        Some(id) => Err(RunError::unknown_cell(chapter, id)),
        None => Ok(()),
    }
}

/// Runs `chapter` with `registry`'s plugins.
pub fn run(
    registry: &Registry,
    chapter: &Chapter,
    options: &RunOptions,
    observer: &mut dyn RunObserver,
) -> Result<ChapterReport, RunError> {
    check_cells(chapter, &options.cells)?;
    let selected: Vec<(usize, &Cell)> = chapter
        .cells
        .iter()
        .enumerate()
        .filter(|(_, c)| options.cells.is_empty() || options.cells.contains(&c.id))
        .collect();
    let mut report = ChapterReport {
        format_version: crate::report::FORMAT_VERSION,
        workbook_version: env!("CARGO_PKG_VERSION").to_string(),
        chapter: ChapterInfo {
            id: chapter.id.clone(),
            title: chapter.title.clone(),
            path: chapter.path.display().to_string(),
            intro: chapter.intro.clone(),
        },
        mode: if options.check {
            Mode::Check
        } else {
            Mode::Full
        },
        device: options.device.name().to_string(),
        meter: String::new(),
        cells: Vec::new(),
        summary: Default::default(),
        incomplete: false,
    };
    match &options.isolation {
        Isolation::InProcess => {
            run_in_process(registry, &selected, options, &mut report, observer)?
        }
        Isolation::Process(command) => {
            run_in_workers(registry, command, &selected, options, &mut report, observer)?
        }
    }
    report.incomplete = interrupted(options);
    report.summary = ChapterReport::summarize(&report.cells);
    observer.finished(&report);
    Ok(report)
}

fn interrupted(options: &RunOptions) -> bool {
    options
        .interrupt
        .as_ref()
        .is_some_and(|i| i.load(Ordering::SeqCst))
}

/// Whether the cells after one that ended with `status` are not run.
fn stops(options: &RunOptions, status: Status) -> bool {
    // A cell this build cannot run is not a failure.
    (options.fail_fast && matches!(status, Status::Failed | Status::Error)) || interrupted(options)
}

/// Every cell on one thread of this process.
fn run_in_process(
    registry: &Registry,
    selected: &[(usize, &Cell)],
    options: &RunOptions,
    report: &mut ChapterReport,
    observer: &mut dyn RunObserver,
) -> Result<(), RunError> {
    let device = select_device(options.device)?;
    let meter = select_meter(&device)?;
    report.device = device_name(&device);
    report.meter = meter.name().to_string();
    // Where the cells that run in this process ran, for their assertions.
    let here = report.device.clone();
    // Every cell runs on one thread: it has the large stack candle's
    // recursive graph walks need, and it is warmed up itself, since gemm's
    // packing buffers are per thread and must not appear in a measurement.
    std::thread::scope(|scope| {
        let (tx, rx) = std::sync::mpsc::channel::<Event>();
        let worker = std::thread::Builder::new()
            .name("workbook cells".into())
            .stack_size(CELL_STACK)
            .spawn_scoped(scope, || {
                let tx = tx;
                if let Err(e) = workbook_sdk::device::warm_up(&device) {
                    let _ = tx.send(Event::WarmUp(Err(format!(
                        "the device does not answer: {e}"
                    ))));
                    return;
                }
                let _ = tx.send(Event::WarmUp(Ok(())));
                let mut stop = false;
                for (position, &(_, cell)) in selected.iter().enumerate() {
                    let cell_report = if stop {
                        skipped(registry, cell, options.check, not_run_reason(options))
                    } else if let Some(why) = unavailable(registry, cell, options) {
                        skipped(registry, cell, options.check, &why)
                    } else {
                        let _ = tx.send(Event::Started(position));
                        let plugin = registry.get(&cell.plugin);
                        let external = registry.program(&cell.plugin);
                        let (outcome, ran_on) =
                            match (not_started(registry, cell, options), plugin, external) {
                                (Some(why), _, _) => (not_run(why), None),
                                (None, Some(_), Some(program)) => {
                                    // An external plugin runs in its own
                                    // process whatever the isolation.
                                    let command = WorkerCommand::external(program);
                                    match in_worker(&command, cell, options) {
                                        process::WorkerResult::Ran(outcome, hello) => {
                                            (*outcome, hello.map(|h| h.device))
                                        }
                                        process::WorkerResult::Fatal(message) => {
                                            (not_run(message), None)
                                        }
                                    }
                                }
                                (None, Some(plugin), None) => {
                                    let mut ctx =
                                        Context::new(device.clone(), meter.clone(), options.check);
                                    if let Some(progress) = &options.progress {
                                        let progress = progress.clone();
                                        ctx = ctx.with_progress(move |m| progress(m));
                                    }
                                    let params = cell.params_for(options.check);
                                    (execute(plugin, params, ctx, &meter), Some(here.clone()))
                                }
                                (None, None, _) => (not_registered(cell), None),
                            };
                        assemble(registry, cell, options.check, ran_on.as_deref(), outcome)
                    };
                    stop |= stops(options, cell_report.status);
                    if tx.send(Event::Finished(Box::new(cell_report))).is_err() {
                        return;
                    }
                }
            })
            .map_err(|e| RunError::Device(format!("cannot start the cells' thread: {e}")))?;
        for event in rx {
            match event {
                Event::WarmUp(Ok(())) => observer.started(report),
                Event::WarmUp(Err(e)) => return Err(RunError::Device(e)),
                Event::Started(position) => {
                    let (index, cell) = selected[position];
                    observer.cell_started(index, cell)
                }
                Event::Finished(cell_report) => {
                    observer.cell_finished(&cell_report);
                    report.cells.push(*cell_report);
                }
            }
        }
        worker.join().map_err(|payload| {
            RunError::Device(format!(
                "the cells' thread failed: {}",
                panicked(payload.as_ref())
            ))
        })
    })
}

/// Each cell in a worker process of its own.
fn run_in_workers(
    registry: &Registry,
    command: &WorkerCommand,
    selected: &[(usize, &Cell)],
    options: &RunOptions,
    report: &mut ChapterReport,
    observer: &mut dyn RunObserver,
) -> Result<(), RunError> {
    let mut started = false;
    let mut stop = false;
    for &(index, cell) in selected {
        let cell_report = if stop {
            skipped(registry, cell, options.check, not_run_reason(options))
        } else if let Some(why) = unavailable(registry, cell, options) {
            skipped(registry, cell, options.check, &why)
        } else if let Some(why) = not_started(registry, cell, options) {
            begin(&mut started, observer, report);
            observer.cell_started(index, cell);
            assemble(registry, cell, options.check, None, not_run(why))
        } else {
            if started {
                observer.cell_started(index, cell);
            }
            let external = registry.program(&cell.plugin).map(WorkerCommand::external);
            let mut ran_on = None;
            let outcome = match in_worker(external.as_ref().unwrap_or(command), cell, options) {
                // An external plugin that cannot run is its cells' failure;
                // the workbook's own worker that cannot, the run's.
                process::WorkerResult::Fatal(message) if external.is_some() => not_run(message),
                process::WorkerResult::Fatal(message) => return Err(RunError::Device(message)),
                process::WorkerResult::Ran(mut outcome, hello) => {
                    ran_on = hello.as_ref().map(|h| h.device.clone());
                    match hello {
                        // The report names the device of its first cell...
                        Some(h) if report.meter.is_empty() => {
                            report.device = h.device;
                            report.meter = h.meter;
                        }
                        // ...and a cell that ran elsewhere says so (an
                        // external plugin built without CUDA runs on the CPU
                        // under `--device auto`).
                        Some(h) if h.device != report.device || h.meter != report.meter => {
                            outcome.output.printed.push(format!(
                                "(this cell ran on {} measured by {}, not on {} as the \
                                 chapter's first cell did)",
                                h.device, h.meter, report.device
                            ));
                        }
                        _ => {}
                    }
                    *outcome
                }
            };
            if !started {
                // The header names the device, which the first worker found.
                begin(&mut started, observer, report);
                observer.cell_started(index, cell);
            }
            assemble(registry, cell, options.check, ran_on.as_deref(), outcome)
        };
        begin(&mut started, observer, report);
        stop |= stops(options, cell_report.status);
        observer.cell_finished(&cell_report);
        report.cells.push(cell_report);
    }
    begin(&mut started, observer, report);
    Ok(())
}

/// Runs `cell` in a new process of `command`.
fn in_worker(command: &WorkerCommand, cell: &Cell, options: &RunOptions) -> process::WorkerResult {
    let progress = |m: &str| {
        if let Some(p) = &options.progress {
            p(m)
        }
    };
    let request = Request::new(Body::Run(RunCell {
        plugin: cell.plugin.clone(),
        params: serde_json::to_value(cell.params_for(options.check))
            .unwrap_or(serde_json::Value::Null),
        check: options.check,
        device: options.device.name().to_string(),
        max_memory: options.max_memory,
    }));
    let watch = process::Watch {
        limit: options.timeout.or(cell.timeout).unwrap_or(DEFAULT_TIMEOUT),
        interrupt: options.interrupt.as_deref(),
        progress: &progress,
        max_memory: options.max_memory,
    };
    process::run(command, &request, &watch)
}

/// Tells the observer the run has started, once.
fn begin(started: &mut bool, observer: &mut dyn RunObserver, report: &ChapterReport) {
    if !*started {
        observer.started(report);
        *started = true;
    }
}

/// What a cell that did not run says, and why.
fn not_run_reason(options: &RunOptions) -> &'static str {
    if interrupted(options) {
        "the run was interrupted"
    } else {
        "an earlier cell failed and --fail-fast is set"
    }
}

/// Why this build cannot run `cell`, as its plugin says, where the run
/// skips such a cell (without `require_all`).
fn unavailable(registry: &Registry, cell: &Cell, options: &RunOptions) -> Option<String> {
    if options.require_all {
        return None;
    }
    registry
        .get(&cell.plugin)?
        .unavailable_with(cell.params_for(options.check))
}

/// Why `cell` fails before it starts, if it does: it cannot run in this
/// build and every cell is required to, or its plugin's floor is above
/// the cap.
fn not_started(registry: &Registry, cell: &Cell, options: &RunOptions) -> Option<String> {
    let params = cell.params_for(options.check);
    let plugin = registry.get(&cell.plugin)?;
    if options.require_all {
        if let Some(why) = plugin.unavailable_with(params) {
            return Some(format!(
                "this build cannot run it, and --require-all is set: {why}"
            ));
        }
    }
    refused(registry, cell, options)
}

fn not_registered(cell: &Cell) -> CellOutcome {
    not_run(format!("plugin `{}` is not registered", cell.plugin))
}

/// The memory pre-flight: why `cell` is refused before it runs, when the
/// least its plugin says it must hold is more than a cell may hold.
fn refused(registry: &Registry, cell: &Cell, options: &RunOptions) -> Option<String> {
    let cap = options.max_memory?;
    let plugin = registry.get(&cell.plugin)?;
    let floor = plugin.memory_floor_of(cell.params_for(options.check))?;
    workbook_sdk::plugin::refusal(&floor, cap, "a cell may hold here (`--max-memory`)")
}

/// A cell that ended before it began, with `error`.
fn not_run(error: String) -> CellOutcome {
    CellOutcome {
        output: Default::default(),
        end: workbook_sdk::protocol::CellEnd::failed(error, 0.0),
    }
}

/// What the worker thread tells the observer's thread.
enum Event {
    WarmUp(Result<(), String>),
    /// The cell at this position of the selection began.
    Started(usize),
    Finished(Box<CellReport>),
}

fn params_json(registry: &Registry, cell: &Cell, check: bool) -> serde_json::Value {
    registry
        .get(&cell.plugin)
        .and_then(|p| p.check_params(cell.params_for(check)).ok())
        .unwrap_or(serde_json::Value::Null)
}

/// The report of a cell that did not run, and `why`.
fn skipped(registry: &Registry, cell: &Cell, check: bool, why: &str) -> CellReport {
    let not_run = format!("not run: {why}");
    CellReport {
        id: cell.id.clone(),
        title: cell.title.clone(),
        prose: cell.prose.clone(),
        plugin: cell.plugin.clone(),
        status: Status::Skipped,
        error: None,
        seconds: 0.0,
        params: params_json(registry, cell, check),
        printed: Vec::new(),
        metrics: Default::default(),
        assertions: cell
            .assertions
            .iter()
            .chain(&cell.full_size_assertions)
            .map(|a| a.skip(&not_run))
            .collect(),
        not_run: Some(why.to_string()),
        memory: CellMemory::default(),
        tables: Vec::new(),
        figures: Vec::new(),
    }
}

/// A cell's report from what its run produced on the device `ran_on` (as
/// the report names it; `None` where it did not start): its assertions are
/// checked against the metrics it recorded.
fn assemble(
    registry: &Registry,
    cell: &Cell,
    check: bool,
    ran_on: Option<&str>,
    outcome: CellOutcome,
) -> CellReport {
    let CellOutcome { output, end } = outcome;
    let error = end.error;
    let mut assertions: Vec<AssertionResult> = cell
        .assertions
        .iter()
        .map(|a| a.evaluate_on(ran_on, &output.metrics))
        .collect();
    assertions.extend(cell.full_size_assertions.iter().map(|a| {
        if check {
            a.skip("checked at full size only")
        } else {
            a.evaluate_on(ran_on, &output.metrics)
        }
    }));
    // The plugin is held to the metrics it declares: what `validate`
    // checked the assertions against.
    if let Some(plugin) = registry.get(&cell.plugin) {
        let declared = plugin.declared_metrics();
        let extra =
            workbook_sdk::metric::undeclared(&declared, output.metrics.keys().map(String::as_str));
        if !extra.is_empty() {
            assertions.push(AssertionResult {
                expr: "<the plugin records only the metrics it declares>".to_string(),
                passed: false,
                skipped: false,
                values: Default::default(),
                message: Some(format!(
                    "plugin `{}` recorded {} that it does not declare in `Plugin::metrics`",
                    cell.plugin,
                    extra
                        .iter()
                        .map(|m| format!("`{m}`"))
                        .collect::<Vec<_>>()
                        .join(", ")
                )),
            });
        }
    }
    if let Some(e) = &error {
        assertions.push(AssertionResult {
            expr: "<the cell runs to completion>".to_string(),
            passed: false,
            skipped: false,
            values: Default::default(),
            message: Some(e.clone()),
        });
    }
    let status = if error.is_some() {
        Status::Error
    } else if assertions.iter().all(|a| a.passed || a.skipped) {
        Status::Passed
    } else {
        Status::Failed
    };
    CellReport {
        id: cell.id.clone(),
        title: cell.title.clone(),
        prose: cell.prose.clone(),
        plugin: cell.plugin.clone(),
        status,
        error,
        seconds: end.seconds,
        params: params_json(registry, cell, check),
        printed: output.printed,
        metrics: output.metrics,
        assertions,
        memory: CellMemory {
            baseline_bytes: end.baseline.total(),
            baseline_by_category: end.baseline,
            peak_bytes: end.peak_bytes,
            current_bytes: end.end.total(),
            peak_by_category: end.peak_by_category,
            current_by_category: end.end,
            pool: end.pool,
            regions: output.regions,
        },
        tables: output.tables,
        figures: output.figures,
        not_run: None,
    }
}
