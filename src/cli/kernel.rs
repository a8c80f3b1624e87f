//! `workbook kernel install`: the "Rust (workbook)" Jupyter kernel spec.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Subcommand;

use super::say;

/// What `workbook kernel` does.
#[derive(Subcommand, Debug)]
pub enum KernelAction {
    /// Write the kernel spec into Jupyter's kernels folder.
    Install {
        /// evcxr's Jupyter kernel [default: workbook-kernel beside this
        /// executable (crates/kernel builds it), else evcxr_jupyter on PATH
        /// or in ~/.cargo/bin].
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

/// Runs `workbook kernel ACTION`.
pub fn kernel(action: &KernelAction) -> anyhow::Result<ExitCode> {
    let KernelAction::Install {
        evcxr,
        preload,
        dir,
    } = action;
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
