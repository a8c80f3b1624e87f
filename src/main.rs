//! The `workbook` command.
//!
//! Exit codes: 0 when every assertion passed, 1 when an assertion or a cell
//! failed, 2 when the input was bad (a chapter that does not load, an unknown
//! cell, a device that cannot be used) or an output could not be written,
//! 130 when the run was interrupted (Ctrl-C).

mod cli;

use std::process::ExitCode;

use clap::Parser;

#[global_allocator]
static ALLOC: workbook_sdk::meter::CountingAllocator = workbook_sdk::meter::CountingAllocator;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    match &cli.command {
        cli::Command::Worker => {
            let wb = workbook::Workbook::builtin();
            return workbook::worker::serve(wb.registry(), std::io::stdin().lock());
        }
        cli::Command::Rank(args) => return cli::rank::serve(args),
        _ => {}
    }
    let wb = cli::workbook(&cli);
    match cli::dispatch(&cli, &wb) {
        Ok(code) => code,
        Err(e) => {
            eprintln!(
                "error: {}",
                workbook::terminal::printable(&format!("{e:#}"))
            );
            ExitCode::from(2)
        }
    }
}
