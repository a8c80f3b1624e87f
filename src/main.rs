//! The `workbook` command.
//!
//! Exit codes: 0 when every assertion passed, 1 when an assertion or a cell
//! failed, 2 when the input was bad (a chapter that does not load, an unknown
//! cell, a device that cannot be used) or an output could not be written,
//! 130 when the run was interrupted (Ctrl-C).

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use workbook::chapter::Cell;
use workbook::registry::Unusable;
use workbook::render::html::ReportWriter as HtmlWriter;
use workbook::render::text::TextRenderer;
use workbook::report::{CellReport, ChapterReport};
use workbook::{DeviceChoice, Isolation, Observer, RunOptions, Workbook, WorkerCommand};

#[global_allocator]
static ALLOC: workbook_sdk::meter::CountingAllocator = workbook_sdk::meter::CountingAllocator;

/// Chapters that teach deep-learning memory optimisation by measuring it.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    /// Folder to find chapters in (default: ./chapters, then this source tree's).
    #[arg(long, global = true, env = "WORKBOOK_CHAPTERS", value_name = "DIR")]
    chapters: Option<PathBuf>,

    #[command(subcommand)]
    command: Command,
}

/// What `workbook kernel` does.
#[derive(Subcommand, Debug)]
enum KernelAction {
    /// Write the kernel spec into Jupyter's kernels folder.
    Install {
        /// evcxr's Jupyter kernel [default: workbook-kernel beside this
        /// executable (built with --features evcxr), else evcxr_jupyter on
        /// PATH or in ~/.cargo/bin].
        #[arg(long, value_name = "FILE")]
        evcxr: Option<PathBuf>,
        /// The interposer, libworkbook_preload.so [default: beside this
        /// executable].
        #[arg(long, value_name = "FILE")]
        preload: Option<PathBuf>,
        /// The kernel spec's folder [default: Jupyter's user data folder's
        /// kernels/rust-workbook].
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
    },
}

#[derive(Subcommand, Debug)]
enum Command {
    /// List the chapters and their cells.
    List,
    /// Check a chapter without running it: ids, plugins, parameters, assertions.
    Validate {
        /// A chapter id (`chapter2`) or a path to a .toml file.
        chapter: String,
    },
    /// Run a chapter and check its assertions.
    Run {
        /// A chapter id (`chapter2`) or a path to a .toml file.
        chapter: String,
        /// Use the small check-size parameters (as CI does).
        #[arg(long, env = "WORKBOOK_CHECK_MODE", value_parser = clap::builder::FalseyValueParser::new())]
        check: bool,
        /// Run only this cell (repeat for several).
        #[arg(long = "cell", value_name = "ID")]
        cells: Vec<String>,
        /// Where tensors go: auto (a CUDA GPU when this build has CUDA and
        /// one answers, else the CPU), cpu, or cuda.
        #[arg(long, default_value = "auto", value_parser = parse_device)]
        device: DeviceChoice,
        /// Output format on stdout.
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
        /// Stop after the first cell that does not pass.
        #[arg(long)]
        fail_fast: bool,
        /// Write plots (SVG and PNG) and an HTML report into this folder,
        /// as cells finish (an earlier report there is replaced).
        #[arg(long, value_name = "DIR")]
        out: Option<PathBuf>,
        /// A time limit for every cell, in seconds, over the chapter's own
        /// (`timeout` in a cell; one hour where neither sets one).
        #[arg(long, value_name = "SECONDS", value_parser = parse_seconds)]
        timeout: Option<Duration>,
        /// The most memory a cell may hold at once, such as `8GiB` or
        /// `500MB`: an allocation past it fails that cell [default: the
        /// machine's physical memory].
        #[arg(long, value_name = "SIZE", value_parser = parse_size)]
        max_memory: Option<u64>,
        /// Run every cell in this process instead of a worker process per
        /// cell: no time limit or memory cap, and a cell that crashes ends
        /// the run (for a debugger, and to measure what isolation costs).
        #[arg(long, conflicts_with_all = ["timeout", "max_memory"])]
        in_process: bool,
        /// Data-parallel cells (chapter 4) also run with N ranks, beside
        /// the counts their chapter names.
        #[arg(long, value_name = "N", env = "WORKBOOK_RANKS")]
        ranks: Option<usize>,
    },
    /// Print a plugin's parameters (type, default, range, meaning) and the
    /// metrics it records; every plugin's when none is named.
    Describe {
        /// A plugin's name.
        plugin: Option<String>,
        /// Output format on stdout.
        #[arg(long, value_enum, default_value_t = DescribeFormat::Text)]
        format: DescribeFormat,
    },
    /// Print the JSON Schema of chapter files, with every plugin's
    /// parameters (docs/chapter.schema.json holds the built-in plugins'),
    /// for editors that check TOML against a schema.
    Schema,
    /// Install the "Rust (workbook)" Jupyter kernel: evcxr's kernel with
    /// the workbook's allocation interposer preloaded, so that notebook
    /// cells measure their memory exactly, by category.
    Kernel {
        #[command(subcommand)]
        action: KernelAction,
    },
    /// Create a plugin crate that builds against the SDK and runs as it is:
    /// build it, put its binary on PATH, and name it in a chapter.
    NewPlugin {
        /// The plugin's name (lowercase letters, digits, `-`, `_`).
        name: String,
        /// The folder to create [default: ./workbook-plugin-NAME].
        #[arg(long, value_name = "DIR")]
        path: Option<PathBuf>,
        /// The SDK's folder (plugins/sdk of a workbook source tree)
        /// [default: the one this binary was built from].
        #[arg(long, value_name = "DIR")]
        sdk: Option<PathBuf>,
    },
    /// Choose how to train a GPT within a memory budget: recipe (candle-nn
    /// or lean layers; naive, materialized or tiled attention), dtype,
    /// checkpointing and micro-batch, each option's peak predicted from
    /// measured steps at batch 1, 2 and 4;
    /// with --verify, run the plan and check its peak. Exit code 1 when
    /// nothing fits or the plan did not keep its promise.
    Plan {
        /// The most memory a training step may hold: 2GiB, 500MB, or bytes.
        #[arg(long, value_parser = parse_budget)]
        budget: u64,
        /// Sequences per optimizer step.
        #[arg(long, default_value_t = 16)]
        batch: usize,
        /// A TOML file with the model's `layers`, `hidden`, `heads`, `seq`
        /// and `vocab` (the flags below then are not used).
        #[arg(long, value_name = "FILE", conflicts_with_all = ["layers", "hidden", "heads", "seq", "vocab"])]
        model: Option<PathBuf>,
        /// Transformer blocks.
        #[arg(long, default_value_t = 4)]
        layers: usize,
        /// Hidden size (a multiple of heads).
        #[arg(long, default_value_t = 256)]
        hidden: usize,
        /// Attention heads.
        #[arg(long, default_value_t = 4)]
        heads: usize,
        /// Sequence length.
        #[arg(long, default_value_t = 256)]
        seq: usize,
        /// Vocabulary.
        #[arg(long, default_value_t = 512)]
        vocab: usize,
        /// Ways of computing the layers to consider, comma-separated: candle
        /// (candle-nn's layers, naive attention), lean (the toolkit's lean
        /// layers, the probabilities kept), tiled (lean, tiled attention).
        #[arg(long, value_delimiter = ',', default_value = "candle,lean,tiled", value_parser = parse_recipe)]
        recipes: Vec<workbook_transformer::Recipe>,
        /// Leave checkpointing out of the options.
        #[arg(long)]
        no_checkpointing: bool,
        /// Dtypes to consider, comma-separated: f32, bf16, f16.
        #[arg(long, value_delimiter = ',', default_value = "f32,bf16", value_parser = parse_dtype)]
        dtypes: Vec<workbook_sdk::candle::DType>,
        /// Ranks sharing the batch (data parallelism): the budget is then
        /// each rank's, and each trains on batch / ranks sequences;
        /// --verify runs them under mpirun (a build with `--features mpi`).
        #[arg(long, default_value_t = 1, value_parser = parse_ranks)]
        ranks: usize,
        /// With --ranks, how they may share the training, comma-separated:
        /// ddp (everything replicated), zero1 (optimizer state
        /// partitioned), zero2 (gradients too), zero3 (parameters too)
        /// [default: all four].
        #[arg(long, value_delimiter = ',', value_parser = parse_stage)]
        stages: Option<Vec<workbook_distributed::stage::Stage>>,
        /// With --ranks and --verify, the ranks' time limit in seconds.
        #[arg(long, default_value_t = 1800, value_name = "SECONDS")]
        timeout: u64,
        /// Run the chosen plan and check that its measured peak is within
        /// the budget and within 5% of the prediction (exit code 1 if not).
        #[arg(long)]
        verify: bool,
        /// Steps the verification runs (at least 1).
        #[arg(long, default_value_t = 2, requires = "verify", value_parser = parse_steps)]
        steps: usize,
        /// Write the options' plot (plan.svg, plan.png) into this folder.
        #[arg(long, value_name = "DIR")]
        out: Option<PathBuf>,
        /// Print the plan as JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Run one cell for a runner (the worker process; reads a request on
    /// standard input and answers on standard output).
    #[command(hide = true)]
    Worker,
    /// Serve as one rank of a data-parallel cell's MPI job (what the cell
    /// starts under `mpirun`).
    #[command(hide = true)]
    Rank {
        /// The cell's job, as JSON.
        #[arg(long, required_unless_present = "verify", conflicts_with = "verify")]
        request: Option<String>,
        /// A plan's verification on this rank, as JSON.
        #[arg(long)]
        verify: Option<String>,
    },
    /// Write a chapter as a Jupyter notebook for the evcxr Rust kernel.
    Notebook {
        /// A chapter id (`chapter2`) or a path to a .toml file.
        chapter: String,
        /// The notebook file to write [default: CHAPTER.ipynb].
        #[arg(short, long, value_name = "FILE")]
        output: Option<PathBuf>,
        /// Run the notebook's cells at check size (written into its setup cell).
        #[arg(long, env = "WORKBOOK_CHECK_MODE", value_parser = clap::builder::FalseyValueParser::new())]
        check: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum DescribeFormat {
    /// Readable text.
    Text,
    /// The plugins' descriptions as JSON: name, description, the JSON
    /// Schema of the parameters, the metrics.
    Json,
    /// The Markdown reference page (docs/plugins.md).
    Markdown,
}

fn parse_budget(s: &str) -> Result<u64, String> {
    bytes_above_zero(s, "the budget")
}

fn parse_dtype(s: &str) -> Result<workbook_sdk::candle::DType, String> {
    workbook_transformer::parse_dtype(s)
        .map_err(|_| format!("`{s}` is not a dtype; expected one of: f32, bf16, f16"))
}

fn parse_steps(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!(
            "`{s}` is not a number of steps; allowed: 1 or more"
        )),
    }
}

fn parse_ranks(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=1024).contains(&n) => Ok(n),
        _ => Err(format!(
            "`{s}` is not a number of ranks; allowed: 1 to 1024"
        )),
    }
}

fn parse_stage(s: &str) -> Result<workbook_distributed::stage::Stage, String> {
    use workbook_distributed::stage::Stage;
    match Stage::ALL.into_iter().find(|stage| stage.name() == s) {
        Some(stage) => Ok(stage),
        None => Err(format!(
            "`{s}` is not a stage; allowed: {}",
            Stage::ALL.map(Stage::name).join(", ")
        )),
    }
}

fn parse_recipe(s: &str) -> Result<workbook_transformer::Recipe, String> {
    use workbook_transformer::Recipe;
    [Recipe::Candle, Recipe::Lean, Recipe::Tiled]
        .into_iter()
        .find(|r| r.name() == s)
        .ok_or_else(|| format!("`{s}` is not a recipe; expected one of: candle, lean, tiled"))
}

fn parse_device(s: &str) -> Result<DeviceChoice, String> {
    DeviceChoice::from_name(s).ok_or_else(|| {
        format!(
            "`{s}` is not a device; expected one of: {}",
            DeviceChoice::ALL.map(DeviceChoice::name).join(", ")
        )
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Format {
    /// Readable text, cell by cell.
    Text,
    /// The JSON report (see the `workbook::report` docs).
    Json,
}

fn parse_seconds(s: &str) -> Result<Duration, String> {
    let value: f64 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds"))?;
    workbook::chapter::seconds(value)
}

/// A size such as `8GiB`, above zero; `what` names it in the error.
fn bytes_above_zero(s: &str, what: &str) -> Result<u64, String> {
    let size: bytesize::ByteSize = s.parse().map_err(|e| {
        format!("`{s}` is not a size ({e}); write it as bytes or with a unit: 8GiB, 500MB")
    })?;
    if size.as_u64() == 0 {
        return Err(format!("{what} must be above 0 bytes"));
    }
    Ok(size.as_u64())
}

fn parse_size(s: &str) -> Result<u64, String> {
    bytes_above_zero(s, "the memory limit")
}

/// The machine's physical memory, the default cap on what a cell may hold.
fn physical_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Writes to standard output; a failure (a closed pipe, a full disk) is an
/// error to report, never a panic or a silent success.
fn say(text: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|_| out.flush())
        .map_err(stdout_failed)
}

fn stdout_failed(e: std::io::Error) -> anyhow::Error {
    anyhow::anyhow!("cannot write to standard output: {e}")
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::Worker = cli.command {
        return workbook::worker::serve(Workbook::builtin().registry(), std::io::stdin().lock());
    }
    if let Command::Rank { request, verify } = &cli.command {
        let served = match (request, verify) {
            (Some(request), _) => rank(request),
            (None, Some(verify)) => verify_rank(verify),
            (None, None) => unreachable!("clap requires one of them"),
        };
        return served.unwrap_or_else(|e| {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        });
    }
    let mut wb = Workbook::builtin();
    if let Some(dir) = &cli.chapters {
        wb = wb.with_chapter_dirs(vec![dir.clone()]);
    }
    // External plugins: in a `plugins` folder beside the chapters (the
    // chapter named on the command line first), then on PATH.
    let named = match &cli.command {
        Command::Validate { chapter }
        | Command::Run { chapter, .. }
        | Command::Notebook { chapter, .. } => Some(chapter.as_str()),
        _ => None,
    };
    let dirs = workbook::external::search_dirs(named, wb.chapter_dirs());
    wb = wb.with_external_plugins(&dirs);
    match run(&cli, &wb) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn run(cli: &Cli, wb: &Workbook) -> anyhow::Result<ExitCode> {
    match &cli.command {
        Command::List => list(wb),
        Command::Worker | Command::Rank { .. } => Ok(ExitCode::SUCCESS),
        Command::Schema => {
            let mut text =
                serde_json::to_string_pretty(&workbook::chapter::json_schema(wb.registry()))?;
            text.push('\n');
            say(&text)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Describe { plugin, format } => describe(wb, plugin.as_deref(), *format),
        Command::Plan { .. } => plan(&cli.command),
        Command::Kernel {
            action:
                KernelAction::Install {
                    evcxr,
                    preload,
                    dir,
                },
        } => {
            let dir = workbook::kernel::install(&workbook::kernel::Install {
                evcxr: evcxr.clone(),
                preload: preload.clone(),
                dir: dir.clone(),
            })?;
            say(&format!(
                "Installed the \"Rust (workbook)\" kernel ({}) in {}\n",
                workbook::kernel::KERNEL_NAME,
                dir.display()
            ))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::NewPlugin { name, path, sdk } => {
            new_plugin(wb, name, path.as_deref(), sdk.as_deref())
        }
        Command::Validate { chapter } => {
            let ch = wb.load(chapter)?;
            let assertions: usize = ch.cells.iter().map(|c| c.assertions.len()).sum();
            say(&format!(
                "{}: {} cells, {assertions} assertions, valid\n",
                ch.path.display(),
                ch.cells.len()
            ))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Run {
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
            ranks,
        } => {
            if let Some(n) = ranks {
                // Read by the data-parallel plugin, in this process or a
                // worker started from it.
                std::env::set_var("WORKBOOK_RANKS", n.to_string());
            }
            let ch = wb.load(chapter)?;
            // An unwritable folder is found before any cell runs, and an
            // earlier report there is removed.
            let html = match out {
                Some(dir) => Some(HtmlWriter::create(dir)?),
                None => None,
            };
            let spinner = Spinner::new(ch.cells.len());
            let bar = spinner.bar.clone();
            let options = RunOptions {
                check: *check,
                cells: cells.clone(),
                device: *device,
                fail_fast: *fail_fast,
                progress: Some(Arc::new(move |m: &str| bar.set_message(m.to_string()))),
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
                } else {
                    max_memory.or_else(physical_memory)
                },
                interrupt: (!*in_process).then(workbook::runner::interrupt_flag),
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
                    let printed =
                        workbook::render::json(&mut out, &report).and_then(|_| out.flush());
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
        Command::Notebook {
            chapter,
            output,
            check,
        } => notebook(wb, chapter, output.as_deref(), *check),
    }
}

fn notebook(
    wb: &Workbook,
    chapter: &str,
    output: Option<&std::path::Path>,
    check: bool,
) -> anyhow::Result<ExitCode> {
    use anyhow::Context as _;
    use workbook::notebook::export;
    let ch = wb.load(chapter)?;
    let path = output
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(format!("{}.ipynb", ch.id)));
    // Paths in the notebook are relative to its folder, where Jupyter
    // starts its kernel: the notebook works wherever the source tree is.
    let path =
        std::path::absolute(&path).with_context(|| format!("cannot resolve {}", path.display()))?;
    let folder = path
        .parent()
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    let options = export::ExportOptions::portable(&folder, check);
    let nb = export::notebook(&ch, wb.registry(), &options)?;
    std::fs::write(&path, export::to_json(&nb)?)
        .with_context(|| format!("cannot write {}", path.display()))?;
    say(&format!(
        "wrote {} ({} cells)\n",
        path.display(),
        nb.cells.len()
    ))?;
    Ok(ExitCode::SUCCESS)
}

fn describe(
    wb: &Workbook,
    plugin: Option<&str>,
    format: DescribeFormat,
) -> anyhow::Result<ExitCode> {
    let registry = wb.registry();
    let infos: Vec<workbook::sdk::PluginInfo> = match plugin {
        Some(name) => match registry.resolve(name) {
            Ok(p) => vec![p.info()],
            Err(Unusable::Refused(why)) => anyhow::bail!("plugin `{name}` cannot be used: {why}"),
            Err(Unusable::Unknown) => anyhow::bail!(
                "unknown plugin `{}`{}; plugins: {}",
                workbook::excerpt::quote(name),
                workbook::suggest::did_you_mean(name, registry.names()),
                registry.names().join(", ")
            ),
        },
        None => registry.iter().map(|p| p.info()).collect(),
    };
    let text = match format {
        DescribeFormat::Text => infos
            .iter()
            .map(workbook::describe::text)
            .collect::<Vec<_>>()
            .join("\n"),
        DescribeFormat::Json => {
            let mut json = match (plugin, infos.as_slice()) {
                (Some(_), [one]) => serde_json::to_string_pretty(one)?,
                _ => serde_json::to_string_pretty(&infos)?,
            };
            json.push('\n');
            json
        }
        DescribeFormat::Markdown => workbook::describe::markdown(&infos),
    };
    say(&text)?;
    Ok(ExitCode::SUCCESS)
}

fn new_plugin(
    wb: &Workbook,
    name: &str,
    path: Option<&std::path::Path>,
    sdk: Option<&std::path::Path>,
) -> anyhow::Result<ExitCode> {
    let dir = path
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(format!("workbook-plugin-{name}")));
    let sdk = match sdk {
        Some(s) => s.to_path_buf(),
        None => workbook::new_plugin::built_sdk().ok_or_else(|| {
            anyhow::anyhow!(
                "the SDK's source is not where this workbook was built from; give its folder \
                 with --sdk DIR (plugins/sdk of a workbook source tree)"
            )
        })?,
    };
    workbook::new_plugin::write(name, &dir, &sdk, &wb.registry().names())?;
    let d = dir.display();
    say(&format!(
        "created {d}: the `{name}` plugin, its test, and chapters/{name}.toml\n\n\
         next:\n  \
         cd {d}\n  \
         cargo test                      # its test: the buffer counted to the byte\n  \
         cargo build\n  \
         export PATH=\"$PWD/target/debug:$PATH\"\n  \
         workbook describe {name}\n  \
         workbook run chapters/{name}.toml --check\n"
    ))?;
    Ok(ExitCode::SUCCESS)
}

fn list(wb: &Workbook) -> anyhow::Result<ExitCode> {
    use std::fmt::Write as _;
    let found = workbook::chapter::available(wb.chapter_dirs());
    let mut text = String::new();
    if found.is_empty() {
        let _ = writeln!(text, "no chapters found in {:?}", wb.chapter_dirs());
    }
    let mut code = ExitCode::SUCCESS;
    for (id, path) in found {
        match workbook::chapter::load_path(&path, wb.registry()) {
            Ok(ch) => {
                let _ = writeln!(text, "{id}  {}  ({})", ch.title, path.display());
                for c in &ch.cells {
                    let _ = writeln!(text, "  {:<16} {:<14} {}", c.id, c.plugin, c.title);
                }
            }
            Err(e) => {
                let _ = writeln!(text, "{id}  (invalid: {e})");
                code = ExitCode::from(2);
            }
        }
    }
    let _ = writeln!(text, "\nplugins:");
    for p in wb.registry().iter() {
        let _ = writeln!(text, "  {:<16} {}", p.name(), p.description());
        if let Some(program) = wb.registry().program(p.name()) {
            let _ = writeln!(text, "  {:<16} (external: {})", "", program.display());
        }
    }
    for (name, why) in wb.registry().refused() {
        let _ = writeln!(text, "  {name:<16} (cannot be used: {why})");
    }
    say(&text)?;
    Ok(code)
}

/// A spinner on stderr while a cell runs; hidden when stderr is not a terminal.
struct Spinner {
    bar: ProgressBar,
    total: usize,
}

impl Spinner {
    fn new(total: usize) -> Self {
        let bar = if std::io::stderr().is_terminal() {
            ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr())
        } else {
            ProgressBar::hidden()
        };
        bar.set_style(
            ProgressStyle::with_template("{spinner} {prefix} {msg} [{elapsed}]")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        Self { bar, total }
    }
}

/// Writes the plots and the HTML report as cells finish, if asked to.
struct ReportWriter {
    html: Option<HtmlWriter>,
    /// The run so far, as the page shows it until the run ends.
    report: Option<ChapterReport>,
    error: Option<anyhow::Error>,
}

impl ReportWriter {
    fn started(&mut self, report: &ChapterReport) {
        self.report = Some(report.clone());
    }

    fn cell_finished(&mut self, cell: &CellReport) {
        let (Some(html), Some(report)) = (&mut self.html, &mut self.report) else {
            return;
        };
        if self.error.is_some() {
            return;
        }
        report.cells.push(cell.clone());
        report.summary = ChapterReport::summarize(&report.cells);
        // Until the run ends, the page says it is not complete.
        report.incomplete = true;
        if let Err(e) = html.add_cell(cell).and_then(|_| html.write_page(report)) {
            self.error = Some(e);
        }
    }

    fn finished(&mut self, report: &ChapterReport) {
        let Some(html) = &self.html else {
            return;
        };
        if self.error.is_some() {
            return;
        }
        match html.write_page(report) {
            Ok(files) => eprintln!(
                "wrote {} and {} plot files in {}",
                files.html.display(),
                files.plots.len(),
                files.html.with_file_name("plots").display()
            ),
            Err(e) => self.error = Some(e),
        }
    }
}

struct WithSpinner<'a, O> {
    spinner: Spinner,
    first: &'a mut ReportWriter,
    inner: O,
}

impl<O: Observer> Observer for WithSpinner<'_, O> {
    fn started(&mut self, report: &ChapterReport) {
        self.first.started(report);
        self.inner.started(report);
    }

    fn cell_started(&mut self, index: usize, cell: &Cell) {
        self.spinner.bar.set_prefix(format!(
            "[{}/{}] {}",
            index + 1,
            self.spinner.total,
            cell.id
        ));
        self.spinner.bar.set_message("");
        self.spinner
            .bar
            .enable_steady_tick(Duration::from_millis(120));
        self.inner.cell_started(index, cell);
    }

    fn cell_finished(&mut self, report: &CellReport) {
        self.spinner.bar.disable_steady_tick();
        self.first.cell_finished(report);
        let inner = &mut self.inner;
        self.spinner.bar.suspend(|| inner.cell_finished(report));
    }

    fn finished(&mut self, report: &ChapterReport) {
        self.spinner.bar.finish_and_clear();
        self.first.finished(report);
        self.inner.finished(report);
    }
}

/// The tolerance `plan --verify` holds a plan's measured peak to.
const PLAN_TOLERANCE: f64 = 0.05;

fn plan(command: &Command) -> anyhow::Result<ExitCode> {
    let Command::Plan {
        budget,
        batch,
        model,
        layers,
        hidden,
        heads,
        seq,
        vocab,
        recipes,
        no_checkpointing,
        dtypes,
        ranks,
        stages,
        timeout,
        verify,
        steps,
        out,
        json,
    } = command
    else {
        unreachable!("plan() is called for the plan command")
    };
    use workbook::plan as view;
    use workbook_transformer::plan::{
        plan as weigh, verify as run_plan, PlanRequest, VerifyRequest,
    };
    let file = match model {
        Some(path) => view::ModelFile::read(path)?,
        None => view::ModelFile {
            layers: *layers,
            hidden: *hidden,
            heads: *heads,
            seq: *seq,
            vocab: *vocab,
        },
    };
    let config = file.config()?;
    if *batch == 0 {
        anyhow::bail!("`--batch` is 0; allowed: at least 1");
    }
    let request = PlanRequest {
        model: config,
        batch: *batch,
        budget: *budget,
        margin: PLAN_TOLERANCE,
        dtypes: dtypes.clone(),
        recipes: recipes.clone(),
        checkpointing: !no_checkpointing,
        seed: 11,
        ranks: *ranks,
        stages: stages.clone().unwrap_or_else(|| {
            use workbook_distributed::stage::Stage;
            Stage::ALL.to_vec()
        }),
    };
    if stages.is_some() && *ranks == 1 {
        anyhow::bail!("`--stages` shares the training between ranks; give `--ranks` 2 or more");
    }
    request.batch_per_rank()?;
    if *verify && *ranks > 1 && !workbook_distributed::launch::built_with_mpi() {
        anyhow::bail!(
            "--verify with --ranks runs MPI ranks, and this workbook was built without the \
             `mpi` feature: {}",
            workbook_distributed::launch::INSTALL
        );
    }
    let meter = workbook_sdk::device::meter_for(&workbook_sdk::candle::Device::Cpu)?;
    let progress = Spinner::new(0).bar;
    progress.enable_steady_tick(Duration::from_millis(120));
    let mut ctx = {
        let progress = progress.clone();
        workbook_sdk::Context::new(workbook_sdk::candle::Device::Cpu, meter, false)
            .with_progress(move |m| progress.set_message(m.to_string()))
    };
    let plan = weigh(&mut ctx, &request)?;
    let verification = match (&plan.chosen, verify) {
        (Some(chosen), true) => {
            let v = VerifyRequest::new(&request, chosen, *steps)?;
            Some(if *ranks > 1 {
                progress.set_message(format!("verifying on {ranks} ranks"));
                verify_on_ranks(v, *ranks, Duration::from_secs(*timeout))?
            } else {
                run_plan(&mut ctx, &v, None)?
            })
        }
        _ => None,
    };
    progress.finish_and_clear();
    if let Some(dir) = out {
        std::fs::create_dir_all(dir)
            .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", dir.display()))?;
        let plot = workbook::render::plot::figure_plot(
            &view::figure(&plan),
            workbook::render::plot::Formats::SvgAndPng,
        )?;
        for (name, data) in [
            ("plan.svg", plot.svg.as_bytes()),
            ("plan.png", &plot.png[..]),
        ] {
            let path = dir.join(name);
            std::fs::write(&path, data)
                .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
        }
    }
    if *json {
        let value = serde_json::json!({ "plan": plan, "verification": verification });
        say(&format!("{}\n", serde_json::to_string_pretty(&value)?))?;
    } else {
        say(&view::text(&plan, *batch))?;
        if let Some(v) = &verification {
            say(&view::verified(v, PLAN_TOLERANCE))?;
        }
    }
    if plan.chosen.is_none() {
        if *json {
            eprintln!("error: {}", view::nothing_fits(&plan, *batch));
        }
        return Ok(ExitCode::from(1));
    }
    Ok(match verification {
        Some(v) if !v.kept(PLAN_TOLERANCE) => ExitCode::from(1),
        _ => ExitCode::SUCCESS,
    })
}

/// Runs a plan's verification on `ranks` MPI ranks and gathers what each
/// measured.
fn verify_on_ranks(
    mut v: workbook_transformer::plan::VerifyRequest,
    ranks: usize,
    timeout: Duration,
) -> anyhow::Result<workbook_transformer::plan::Verification> {
    use anyhow::Context as _;
    use workbook_transformer::plan::{of_ranks, Verification};
    let dir = tempfile::tempdir().context("making a folder for the ranks' reports")?;
    v.out = Some(dir.path().to_path_buf());
    let args = [
        "rank".to_string(),
        "--verify".into(),
        serde_json::to_string(&v)?,
    ];
    let ran = workbook_distributed::launch::run_ranks(ranks, timeout, dir.path(), &args)?;
    let (each, unread): (Vec<Verification>, _) =
        workbook_distributed::launch::gather(dir.path(), ranks, |dir, rank| {
            dir.join(format!("verify-{rank}.json"))
        });
    let mut problems = ran.problems();
    problems.extend(unread);
    if let Some(error) = ran.error(&problems) {
        anyhow::bail!("the verification on {ranks} ranks failed: {error}");
    }
    of_ranks(&each).context("no rank reported")
}

/// One rank of a plan's verification: a warm-up step, then the steps,
/// measured by this rank's counting allocator, written to `verify-R.json`.
fn verify_rank(request: &str) -> anyhow::Result<ExitCode> {
    use anyhow::Context as _;
    let request: workbook_transformer::plan::VerifyRequest =
        serde_json::from_str(request).context("reading the rank's request")?;
    let Some(out) = request.out.clone() else {
        anyhow::bail!("a rank's verification needs the folder to report in");
    };
    #[cfg(feature = "mpi")]
    {
        use std::sync::Arc;
        use workbook_transformer::plan::verify;
        use workbook_transformer::step::Parallel;
        let comm = candle_distributed::Comm::mpi()?;
        workbook_distributed::rank::serve(comm, &out, |comm| {
            let stage = request
                .stage
                .context("a rank's verification names how the ranks share the training")?;
            let parallel = Parallel::new(Arc::clone(comm), stage);
            let meter = Arc::new(workbook_sdk::meter::CpuMeter::new()?);
            let mut ctx =
                workbook_sdk::Context::new(workbook_sdk::candle::Device::Cpu, meter, false);
            // What a process sets up once (the products' per-thread
            // buffers) is not a step's, as in the calibration.
            verify(
                &mut ctx,
                &workbook_transformer::plan::VerifyRequest {
                    steps: 1,
                    ..request.clone()
                },
                Some(&parallel),
            )?;
            let measured = verify(&mut ctx, &request, Some(&parallel))?;
            let path = out.join(format!("verify-{}.json", comm.rank()));
            std::fs::write(&path, serde_json::to_vec(&measured)?)
                .with_context(|| format!("writing {}", path.display()))?;
            Ok(())
        })
    }
    #[cfg(not(feature = "mpi"))]
    {
        let _ = out;
        anyhow::bail!(
            "this workbook was built without the `mpi` feature: {}",
            workbook_distributed::launch::INSTALL
        )
    }
}

/// One rank of a data-parallel cell's job.
fn rank(request: &str) -> anyhow::Result<ExitCode> {
    use anyhow::Context as _;
    let request: workbook_distributed::rank::RankRequest =
        serde_json::from_str(request).context("reading the rank's request")?;
    #[cfg(feature = "mpi")]
    {
        let comm = candle_distributed::Comm::mpi()?;
        workbook_distributed::rank::rank_main(comm, &request)
    }
    #[cfg(not(feature = "mpi"))]
    {
        let _ = request;
        anyhow::bail!(
            "this workbook was built without the `mpi` feature: {}",
            workbook_distributed::launch::INSTALL
        )
    }
}
