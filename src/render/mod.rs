//! Renderers: siblings that read a [`ChapterReport`](crate::report::ChapterReport)
//! and write to any `io::Write`. They never run experiments.

pub mod html;
pub mod plot;
pub mod text;

use std::io::Write;

use crate::report::ChapterReport;

/// Writes `report` as pretty JSON followed by a newline.
pub fn json(out: &mut dyn Write, report: &ChapterReport) -> std::io::Result<()> {
    serde_json::to_writer_pretty(&mut *out, report)?;
    writeln!(out)
}
