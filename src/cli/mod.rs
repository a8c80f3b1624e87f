//! The `workbook` command line: the arguments, and one module per
//! subcommand that does its work through the library.

mod describe;
mod kernel;
mod list;
mod new_plugin;
mod notebook;
mod output;
mod parse;
mod plan;
mod progress;
pub mod rank;
mod run;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use workbook::Workbook;

pub use output::say;

/// Chapters that teach deep-learning memory optimisation by measuring it.
#[derive(Parser, Debug)]
#[command(version, about)]
pub struct Cli {
    /// Folder to find chapters in (default: ./chapters, then this source tree's).
    #[arg(long, global = true, env = "WORKBOOK_CHAPTERS", value_name = "DIR")]
    pub chapters: Option<PathBuf>,

    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// List the chapters and their cells.
    List,
    /// Check a chapter without running it: ids, plugins, parameters, assertions.
    Validate {
        /// A chapter id (`chapter2`) or a path to a .toml file.
        chapter: String,
    },
    /// Run a chapter and check its assertions.
    Run(run::RunArgs),
    /// Print a plugin's parameters (type, default, range, meaning) and the
    /// metrics it records; every plugin's when none is named.
    Describe(describe::DescribeArgs),
    /// Print the JSON Schema of chapter files, with every plugin's
    /// parameters (docs/chapter.schema.json holds the built-in plugins'),
    /// for editors that check TOML against a schema.
    Schema,
    /// Install the "Rust (workbook)" Jupyter kernel: evcxr's kernel with
    /// the workbook's allocation interposer preloaded, so that notebook
    /// cells measure their memory exactly, by category.
    Kernel {
        #[command(subcommand)]
        action: kernel::KernelAction,
    },
    /// Create a plugin crate that builds against the SDK and runs as it is:
    /// build it, put its binary on PATH, and name it in a chapter.
    NewPlugin(new_plugin::NewPluginArgs),
    /// Choose how to train a GPT within a memory budget: recipe (candle-nn
    /// or lean layers; naive, materialized or tiled attention), dtype,
    /// checkpointing and micro-batch, each option's peak predicted from
    /// measured steps at batch 1, 2 and 4 (and larger in bf16 on the CPU
    /// when sequences are short); with --verify, run the plan and check its peak. Exit code 1 when
    /// nothing fits or the plan did not keep its promise.
    Plan(plan::PlanArgs),
    /// Run one cell for a runner (the worker process; reads a request on
    /// standard input and answers on standard output).
    #[command(hide = true)]
    Worker,
    /// Serve as one rank of a data-parallel cell's MPI job (what the cell
    /// starts under `mpirun`).
    #[command(hide = true)]
    Rank(rank::RankArgs),
    /// Write a chapter as a Jupyter notebook for the evcxr Rust kernel.
    Notebook(notebook::NotebookArgs),
}

impl Command {
    /// The chapter the command is about, where it names one.
    pub fn chapter(&self) -> Option<&str> {
        match self {
            Command::Validate { chapter } => Some(chapter),
            Command::Run(args) => Some(&args.chapter),
            Command::Notebook(args) => Some(&args.chapter),
            _ => None,
        }
    }
}

/// The workbook the command works with: the built-in plugins, the chapter
/// folders, and the external plugins found for it.
pub fn workbook(cli: &Cli) -> Workbook {
    let mut wb = Workbook::builtin();
    if let Some(dir) = &cli.chapters {
        wb = wb.with_chapter_dirs(vec![dir.clone()]);
    }
    // External plugins: in a `plugins` folder beside the chapters (the
    // chapter named on the command line first), then on PATH. Without a
    // chapter to run, the chapter folders' plugins are started only where a
    // folder was named (`--chapters`): listing an untrusted checkout must
    // not run its programs.
    let named = cli.command.chapter();
    let trusted: &[PathBuf] = if named.is_some() || cli.chapters.is_some() {
        wb.chapter_dirs()
    } else {
        &[]
    };
    let dirs = workbook::external::search_dirs(named, trusted);
    wb.with_external_plugins(&dirs)
}

/// Runs a subcommand other than `worker` and `rank`.
pub fn dispatch(cli: &Cli, wb: &Workbook) -> anyhow::Result<ExitCode> {
    match &cli.command {
        Command::List => list::list(wb),
        Command::Worker | Command::Rank(_) => Ok(ExitCode::SUCCESS),
        Command::Schema => {
            let mut text =
                serde_json::to_string_pretty(&workbook::chapter::json_schema(wb.registry()))?;
            text.push('\n');
            say(&text)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Describe(args) => describe::describe(wb, args),
        Command::Plan(args) => plan::plan(args),
        Command::Kernel { action } => kernel::kernel(action),
        Command::NewPlugin(args) => new_plugin::new_plugin(wb, args),
        Command::Validate { chapter } => list::validate(wb, chapter),
        Command::Run(args) => run::run(wb, args),
        Command::Notebook(args) => notebook::notebook(wb, args),
    }
}
