//! The worker: the process that runs one cell of a built-in plugin for a
//! runner, speaking the protocol of [`workbook_sdk::protocol`] over its
//! standard input and output. `workbook worker` is this; the runner starts
//! one per cell. An external plugin's process serves the same protocol
//! through [`workbook_sdk::main!`].

use std::io::BufRead;
use std::process::ExitCode;

use crate::registry::Registry;

/// Reads one request from `input` and answers it with `registry`'s
/// plugins, on standard output.
pub fn serve(registry: &Registry, input: impl BufRead) -> ExitCode {
    let plugins: Vec<_> = registry.iter().collect();
    workbook_sdk::worker::serve(&plugins, input)
}
