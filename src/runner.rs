//! The runner: turns a validated chapter into a [`ChapterReport`], one cell
//! at a time. It formats nothing; an [`Observer`] sees each cell as it ends,
//! so renderers can stream results and nothing shown is lost if a later cell
//! fails.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Instant;

use workbook_sdk::candle::Device;
use workbook_sdk::meter::CpuMeter;
use workbook_sdk::output::PoolUse;
use workbook_sdk::{Context, Meter};

use crate::assertion::AssertionResult;
use crate::chapter::{Cell, Chapter};
use crate::registry::Registry;
use crate::report::{CellMemory, CellReport, ChapterInfo, ChapterReport, Mode, Status};

/// Where tensors go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum DeviceChoice {
    /// A CUDA GPU when this build has CUDA and one answers, else the CPU.
    #[default]
    Auto,
    /// The CPU.
    Cpu,
    /// A CUDA GPU (builds with the `cuda` feature).
    Cuda,
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
}

impl std::fmt::Debug for RunOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunOptions")
            .field("check", &self.check)
            .field("cells", &self.cells)
            .field("device", &self.device)
            .field("fail_fast", &self.fail_fast)
            .finish()
    }
}

/// Errors that stop a run before any cell runs.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// `--cell` named a cell the chapter does not have.
    #[error("chapter `{chapter}` has no cell `{cell}`; its cells: {available}")]
    UnknownCell {
        /// The chapter.
        chapter: String,
        /// The cell asked for.
        cell: String,
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

/// Sees a run as it goes.
pub trait Observer {
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
impl Observer for Quiet {}

#[cfg(not(feature = "cuda"))]
fn select_device(choice: DeviceChoice) -> Result<Device, RunError> {
    match choice {
        DeviceChoice::Cpu | DeviceChoice::Auto => Ok(Device::Cpu),
        DeviceChoice::Cuda => Err(RunError::Device(
            "this workbook was built without CUDA support; rebuild it with `--features cuda` \
             (scripts/build-cuda.sh builds it without a CUDA toolkit) to use `--device cuda`"
                .to_string(),
        )),
    }
}

#[cfg(feature = "cuda")]
fn select_device(choice: DeviceChoice) -> Result<Device, RunError> {
    // candle's errors carry a backtrace when RUST_BACKTRACE is set: keep the
    // first line, the driver's answer.
    let first_line = |e: candle_core::Error| {
        e.to_string()
            .lines()
            .next()
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    match choice {
        DeviceChoice::Cpu => Ok(Device::Cpu),
        DeviceChoice::Cuda => Device::new_cuda(0).map_err(|e| {
            RunError::Device(format!(
                "no CUDA GPU answered ({}); use `--device cpu`, or check the driver and \
                 that LD_LIBRARY_PATH holds the CUDA libraries",
                first_line(e)
            ))
        }),
        DeviceChoice::Auto => Device::new_cuda(0).or_else(|e| {
            // The one line a user of `--device auto` needs to read the numbers.
            eprintln!(
                "notice: no CUDA GPU answered ({}); running on the CPU",
                first_line(e)
            );
            Ok(Device::Cpu)
        }),
    }
}

/// The meter for `device`: the CUDA memory pool on a GPU, the counting
/// allocator on the CPU.
fn select_meter(device: &Device) -> Result<Arc<dyn Meter>, RunError> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        let meter = workbook_sdk::meter::cuda::CudaMeter::new(d.cuda_stream())?;
        return Ok(Arc::new(meter));
    }
    let _ = device;
    Ok(Arc::new(CpuMeter::new()?))
}

/// How a report names `device`.
fn device_name(device: &Device) -> String {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => {
            let stream = d.cuda_stream();
            let ctx = stream.context();
            match ctx.name() {
                Ok(name) => format!("cuda:{} ({name})", ctx.ordinal()),
                Err(_) => format!("cuda:{}", ctx.ordinal()),
            }
        }
        other => format!("{other:?}").to_lowercase(),
    }
}

fn panicked(payload: &(dyn std::any::Any + Send)) -> anyhow::Error {
    let message = if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with no message".to_string()
    };
    anyhow::anyhow!("panicked: {message}")
}

/// Runs `chapter` with `registry`'s plugins.
pub fn run(
    registry: &Registry,
    chapter: &Chapter,
    options: &RunOptions,
    observer: &mut dyn Observer,
) -> Result<ChapterReport, RunError> {
    for id in &options.cells {
        if !chapter.cells.iter().any(|c| &c.id == id) {
            return Err(RunError::UnknownCell {
                chapter: chapter.id.clone(),
                cell: id.clone(),
                available: chapter
                    .cells
                    .iter()
                    .map(|c| c.id.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
    }
    let device = select_device(options.device)?;
    let meter = select_meter(&device)?;
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
        device: device_name(&device),
        meter: meter.name().to_string(),
        cells: Vec::new(),
        summary: Default::default(),
    };
    let selected: Vec<(usize, &Cell)> = chapter
        .cells
        .iter()
        .enumerate()
        .filter(|(_, c)| options.cells.is_empty() || options.cells.contains(&c.id))
        .collect();

    // Every cell runs on one worker thread: it has the large stack candle's
    // recursive graph walks need, and it is warmed up itself, since gemm's
    // packing buffers are per thread and must not appear in a measurement.
    std::thread::scope(|scope| {
        let (tx, rx) = std::sync::mpsc::channel::<Event>();
        let worker = std::thread::Builder::new()
            .name("workbook cells".into())
            .stack_size(CELL_STACK)
            .spawn_scoped(scope, || {
                let tx = tx;
                if let Err(e) = workbook_sdk::train::warm_up(&device) {
                    let _ = tx.send(Event::WarmUp(Err(format!(
                        "the device does not answer: {e}"
                    ))));
                    return;
                }
                let _ = tx.send(Event::WarmUp(Ok(())));
                let mut stop = false;
                for &(index, cell) in &selected {
                    let cell_report = if stop {
                        skipped(registry, cell, options.check)
                    } else {
                        let _ = tx.send(Event::Started(index));
                        run_cell(registry, cell, options, &device, &meter)
                    };
                    stop |= options.fail_fast && cell_report.status != Status::Passed;
                    if tx.send(Event::Finished(Box::new(cell_report))).is_err() {
                        return;
                    }
                }
            })
            .map_err(|e| RunError::Device(format!("cannot start the cells' thread: {e}")))?;
        for event in rx {
            match event {
                Event::WarmUp(Ok(())) => observer.started(&report),
                Event::WarmUp(Err(e)) => return Err(RunError::Device(e)),
                Event::Started(index) => observer.cell_started(index, &chapter.cells[index]),
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
    })?;
    report.summary = ChapterReport::summarize(&report.cells);
    observer.finished(&report);
    Ok(report)
}

/// What the worker thread tells the observer's thread.
enum Event {
    WarmUp(Result<(), String>),
    Started(usize),
    Finished(Box<CellReport>),
}

fn params_json(registry: &Registry, cell: &Cell, check: bool) -> serde_json::Value {
    registry
        .get(&cell.plugin)
        .and_then(|p| p.check_params(cell.params_for(check)).ok())
        .unwrap_or(serde_json::Value::Null)
}

fn skipped(registry: &Registry, cell: &Cell, check: bool) -> CellReport {
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
            .map(|a| a.skip("not run: an earlier cell failed and --fail-fast is set"))
            .collect(),
        memory: CellMemory::default(),
        tables: Vec::new(),
        figures: Vec::new(),
    }
}

/// The stack of a cell's thread. candle walks and drops autograd graphs
/// recursively, one frame per op: a graph of 100,000 ops (the checkpointing
/// cell's "heavy function") overflows the usual 8 MiB, and a stack overflow
/// aborts the process where a panic would not. The memory is reserved, not
/// committed, until used.
const CELL_STACK: usize = 1 << 30;

/// Runs one cell; errors and panics of the plugin become its `error`.
fn run_cell(
    registry: &Registry,
    cell: &Cell,
    options: &RunOptions,
    device: &Device,
    meter: &Arc<dyn Meter>,
) -> CellReport {
    let mut ctx = Context::new(device.clone(), meter.clone(), options.check);
    if let Some(progress) = &options.progress {
        let progress = progress.clone();
        ctx = ctx.with_progress(move |m| progress(m));
    }
    let params = cell.params_for(options.check);
    let start = Instant::now();
    meter.reset_peak();
    let before = meter.snapshot();
    let outcome = match registry.get(&cell.plugin) {
        Some(plugin) => catch_unwind(AssertUnwindSafe(|| plugin.run_with(&mut ctx, params)))
            .unwrap_or_else(|payload| Err(panicked(payload.as_ref()))),
        None => Err(anyhow::anyhow!(
            "plugin `{}` is not registered",
            cell.plugin
        )),
    };
    let seconds = start.elapsed().as_secs_f64();
    let after = meter.snapshot();
    let output = ctx.into_output();
    // Regions reset the peak; the cell's peak is the highest of theirs and the rest.
    let (peak_bytes, peak_by_category) = output
        .regions
        .iter()
        .map(|r| (r.peak_bytes, r.peak_by_category))
        .chain(std::iter::once((after.peak, after.peak_by_category)))
        .max_by_key(|(bytes, _)| *bytes)
        .unwrap_or((after.peak, after.peak_by_category));
    let pool = PoolUse::between(&before, &after).map(|cell| PoolUse {
        peak: output
            .regions
            .iter()
            .filter_map(|r| r.pool)
            .fold(cell.peak, |peak, r| peak.max(r.peak)),
        ..cell
    });
    let error = outcome.err().map(|e| format!("{e:#}"));
    let mut assertions: Vec<AssertionResult> = cell
        .assertions
        .iter()
        .map(|a| a.evaluate(&output.metrics))
        .collect();
    assertions.extend(cell.full_size_assertions.iter().map(|a| {
        if options.check {
            a.skip("checked at full size only")
        } else {
            a.evaluate(&output.metrics)
        }
    }));
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
        seconds,
        params: params_json(registry, cell, options.check),
        printed: output.printed,
        metrics: output.metrics,
        assertions,
        memory: CellMemory {
            baseline_bytes: before.current_total(),
            baseline_by_category: before.current,
            peak_bytes,
            current_bytes: after.current_total(),
            peak_by_category,
            current_by_category: after.current,
            pool,
            regions: output.regions,
        },
        tables: output.tables,
        figures: output.figures,
    }
}
