//! `workbook run`: a chapter's cells, each in a worker process, with the
//! terminal's text or the JSON report, and the HTML report as it goes.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, ValueEnum};
use workbook::render::html::ReportWriter as HtmlWriter;
use workbook::render::text::TextRenderer;
use workbook::terminal::printable;
use workbook::{DeviceChoice, Isolation, RunOptions, Workbook, WorkerCommand};

use super::output::stdout_failed;
use super::parse::{parse_device, parse_run_ranks, parse_seconds, parse_size};
use super::progress::{ReportWriter, Spinner, WithSpinner};

/// The arguments of `workbook run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    /// A chapter id (`chapter2`) or a path to a .toml file.
    pub chapter: String,
    /// Use the small check-size parameters (as CI does).
    #[arg(long, env = "WORKBOOK_CHECK_MODE", value_parser = clap::builder::FalseyValueParser::new())]
    pub check: bool,
    /// Run only this cell (repeat for several).
    #[arg(long = "cell", value_name = "ID")]
    pub cells: Vec<String>,
    /// Where tensors go: auto (a CUDA GPU when this build has CUDA and
    /// one answers, else the CPU), cpu, or cuda.
    #[arg(long, default_value = "auto", value_parser = parse_device)]
    pub device: DeviceChoice,
    /// Output format on stdout.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    /// Stop after the first cell that does not pass.
    #[arg(long)]
    pub fail_fast: bool,
    /// Write plots (SVG and PNG) and an HTML report into this folder,
    /// as cells finish (an earlier report there is replaced).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// A time limit for every cell, in seconds, over the chapter's own
    /// (`timeout` in a cell; one hour where neither sets one).
    #[arg(long, value_name = "SECONDS", value_parser = parse_seconds)]
    pub timeout: Option<Duration>,
    /// The most memory a cell may hold at once on its device, such as
    /// `8GiB` or `500MB`: an allocation past it fails that cell, and a
    /// cell whose plugin needs more is not started [default: on the CPU,
    /// the machine's physical memory; on a GPU, what the card has free].
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub max_memory: Option<u64>,
    /// Run every cell in this process instead of a worker process per
    /// cell: no time limit or memory cap, and a cell that crashes ends
    /// the run (for a debugger, and to measure what isolation costs).
    #[arg(long, conflicts_with_all = ["timeout", "max_memory"])]
    pub in_process: bool,
    /// A cell this build cannot run (chapter 4's MPI ranks without the
    /// `mpi` feature) fails instead of being reported as not run, as CI
    /// wants.
    #[arg(long)]
    pub require_all: bool,
    /// Data-parallel cells (chapter 4) also run with N ranks (1 to
    /// 64), beside the counts their chapter names.
    #[arg(long, value_name = "N", env = "WORKBOOK_RANKS", value_parser = parse_run_ranks)]
    pub ranks: Option<usize>,
}

/// What `run` prints on standard output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Readable text, cell by cell.
    Text,
    /// The JSON report (see the `workbook::report` docs).
    Json,
}

/// `workbook run CHAPTER`.
pub fn run(wb: &Workbook, args: &RunArgs) -> anyhow::Result<ExitCode> {
    let RunArgs {
        chapter,
        check,
        cells,
        device,
        format,
        fail_fast,
        out,
        timeout,
        max_memory,
        in_process,
        require_all,
        ranks,
    } = args;
    if let Some(n) = ranks {
        // Read by the data-parallel plugin, in this process or a
        // worker started from it.
        std::env::set_var("WORKBOOK_RANKS", n.to_string());
    }
    let ch = wb.load(chapter)?;
    // A misspelt `--cell`, or `--device cuda` in a build without CUDA, is
    // refused before an earlier report is removed. (A CUDA build asks its
    // worker, so that this process never holds a context on the card.)
    workbook::runner::check_cells(&ch, cells)?;
    if !cfg!(feature = "cuda") {
        workbook_sdk::device::select(*device).map_err(workbook::RunError::Device)?;
    }
    // An unwritable folder is found before any cell runs, and an
    // earlier report there is removed.
    let html = match out {
        Some(dir) => Some(HtmlWriter::create(dir)?),
        None => None,
    };
    let selected = ch
        .cells
        .iter()
        .filter(|c| cells.is_empty() || cells.contains(&c.id))
        .count();
    let spinner = Spinner::new(selected);
    let bar = spinner.bar.clone();
    let options =
        RunOptions {
            check: *check,
            cells: cells.clone(),
            device: *device,
            fail_fast: *fail_fast,
            progress: Some(Arc::new(move |m: &str| {
                bar.set_message(printable(m).into_owned())
            })),
            isolation: if *in_process {
                Isolation::InProcess
            } else {
                Isolation::Process(WorkerCommand::current_exe().map_err(|e| {
                    anyhow::anyhow!("cannot tell where this workbook binary is: {e}")
                })?)
            },
            timeout: *timeout,
            // In process, there is no cap to enforce nor a worker to stop:
            // Ctrl-C ends the process as usual.
            max_memory: if *in_process {
                None
            } else if device.is_cpu_here() {
                // The machine's physical memory by default.
                max_memory.or_else(|| workbook_sdk::device::meminfo("MemTotal:"))
            } else {
                // A GPU's worker holds its heap to the machine's memory and
                // the cell to what the card has free.
                *max_memory
            },
            interrupt: (!*in_process).then(workbook::runner::interrupt_flag),
            require_all: *require_all,
        };
    let mut writer = ReportWriter {
        html,
        report: None,
        error: None,
    };
    let (report, printing) = match format {
        Format::Text => {
            let mut obs = WithSpinner {
                spinner,
                first: &mut writer,
                inner: TextRenderer::new(std::io::stdout()),
            };
            let report = wb.run(&ch, &options, &mut obs)?;
            (report, obs.inner.take_error())
        }
        Format::Json => {
            let mut obs = WithSpinner {
                spinner,
                first: &mut writer,
                inner: workbook::runner::Quiet,
            };
            let report = wb.run(&ch, &options, &mut obs)?;
            let mut out = std::io::stdout().lock();
            let printed = workbook::render::json(&mut out, &report).and_then(|_| out.flush());
            eprintln!("{}", report.summary.line());
            (report, printed.err())
        }
    };
    if let Some(e) = writer.error {
        return Err(e);
    }
    if let Some(e) = printing {
        return Err(stdout_failed(e));
    }
    Ok(if report.incomplete {
        eprintln!(
            "interrupted: {} of {} cells ran",
            report.cells_run(),
            report.cells.len()
        );
        ExitCode::from(130)
    } else if report.summary.all_passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
