//! Writing to standard output, where a failure is an error to report.

use std::io::Write;

/// Writes to standard output; a failure (a closed pipe, a full disk) is an
/// error to report, never a panic or a silent success.
pub fn say(text: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|_| out.flush())
        .map_err(stdout_failed)
}

pub fn stdout_failed(e: std::io::Error) -> anyhow::Error {
    anyhow::anyhow!("cannot write to standard output: {e}")
}
