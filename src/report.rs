//! The outcome of a chapter run: the JSON contract between the runner and
//! everything that displays results (terminal, report, notebooks).
//!
//! `workbook run CHAPTER --format json` prints one [`ChapterReport`]:
//!
//! ```json
//! {
//!   "format_version": 1,
//!   "workbook_version": "0.1.0",
//!   "chapter": { "id": "chapter2", "title": "...", "path": "chapters/chapter2.toml", "intro": "..." },
//!   "mode": "check",                      // or "full"
//!   "device": "cpu",
//!   "meter": "cpu-allocator",
//!   "cells": [{
//!     "id": "footprint", "title": "...", "prose": "...", "plugin": "footprint",
//!     "status": "passed",                 // "passed" | "failed" | "error" | "skipped"
//!     "error": null,                      // the plugin's error or panic message
//!     "seconds": 0.01,
//!     "params": { ... },                  // the parameters used, defaults filled in
//!     "printed": ["small params: 17802"],
//!     "metrics": { "small_params": 17802.0 },   // every float in the report: NaN and
//!                                         // infinities as "NaN", "inf", "-inf"
//!     "assertions": [{ "expr": "...", "passed": true, "values": { "small_params": 17802.0 } }],
//!                                         // "skipped": true when not checked, with a "message" saying why
//!     "memory": {
//!       "baseline_bytes": 0, "peak_bytes": 0, "current_bytes": 0, "baseline_by_category": {..},
//!       "peak_by_category": { "parameters": 0, "gradients": 0, "optimizer_state": 0,
//!                             "activations": 0, "inputs": 0, "communication": 0,
//!                             "other": 0 },
//!       "current_by_category": { ... },
//!       "pool": { "baseline": 0, "peak": 0, "end": 0, "reserved": 0 },
//!                                         // on a GPU only: the CUDA memory pool's own figures
//!       "regions": [{ "name": "plain", "baseline": {..}, "peak_bytes": 0, "peak_by_category": {..},
//!                     "end": {..}, "baseline_blocks": 0, "peak_blocks": 0, "seconds": 0.0,
//!                     "marks": [{ "label": "after forward", "seconds": 0.0,
//!                                 "current": {..}, "peak_so_far": 0 }],
//!                     "pool": {..} }]                 // on a GPU only, as the cell's
//!     },
//!     "tables": [{ "title": "...", "columns": [{ "name": "...", "unit": "bytes" }], "rows": [[...]] }],
//!     "figures": [{ "id": "...", "title": "...", "x": { "label": "...", "unit": "count", "log": true },
//!                   "y": {..}, "series": [{ "name": "...", "points": [[1.0, 2.0]] }], "markers": [] }]
//!   }],
//!   "incomplete": false,                  // true when the run was stopped (Ctrl-C) before its end
//!   "summary": { "passed": 12, "failed": 0, "skipped": 0, "cells_passed": 3, "cells_failed": 0, "cells_errored": 0 }
//! }
//! ```
//!
//! Bytes are exact integers; `peak_bytes` of a region includes its baseline
//! (subtract `baseline`'s total for what the variant cost). A field is added
//! without changing `format_version`; a field is renamed or removed only with
//! a new `format_version`.

use indexmap::IndexMap;
use serde::{Deserialize, Serialize};
use workbook_sdk::meter::ByCategory;
use workbook_sdk::output::{json_float, Figure, PoolUse, RegionReport, Table};

use crate::assertion::AssertionResult;

/// The version of this JSON format.
pub const FORMAT_VERSION: u32 = 1;

/// Full-size or check-size parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Full-size parameters.
    Full,
    /// Check-size parameters.
    Check,
}

/// The whole run.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ChapterReport {
    /// [`FORMAT_VERSION`].
    pub format_version: u32,
    /// The version of the workbook that ran.
    pub workbook_version: String,
    /// Which chapter.
    pub chapter: ChapterInfo,
    /// Which parameters.
    pub mode: Mode,
    /// The device tensors were on.
    pub device: String,
    /// The meter that measured memory.
    pub meter: String,
    /// One report per cell, in chapter order.
    pub cells: Vec<CellReport>,
    /// Counts over all cells.
    pub summary: Summary,
    /// Whether the run was stopped before every cell ran (Ctrl-C): the
    /// cells it holds are those that ran, or began to.
    #[serde(default)]
    pub incomplete: bool,
}

/// The chapter a report is of.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ChapterInfo {
    /// Its id.
    pub id: String,
    /// Its title.
    pub title: String,
    /// The file it was read from.
    pub path: String,
    /// Its introduction (markdown).
    pub intro: String,
}

/// How a cell ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// It ran and every assertion held.
    Passed,
    /// It ran and an assertion failed.
    Failed,
    /// The plugin returned an error or panicked.
    Error,
    /// It did not run: this build cannot run it, or it came after a failure
    /// with `--fail-fast` or an interruption (see [`CellReport::not_run`]).
    Skipped,
}

/// One cell's results.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CellReport {
    /// The cell's id.
    pub id: String,
    /// Its title.
    pub title: String,
    /// Its prose (markdown).
    pub prose: String,
    /// The plugin that ran it.
    pub plugin: String,
    /// How it ended.
    pub status: Status,
    /// The plugin's error or panic message.
    pub error: Option<String>,
    /// Wall time, in seconds.
    #[serde(with = "json_float")]
    pub seconds: f64,
    /// The parameters used, with defaults filled in.
    pub params: serde_json::Value,
    /// Lines printed.
    pub printed: Vec<String>,
    /// Metrics recorded; NaN and infinities are written as `"NaN"`,
    /// `"inf"` and `"-inf"` (see [`json_float`]).
    #[serde(with = "json_float::map")]
    pub metrics: IndexMap<String, f64>,
    /// The assertions and their results.
    pub assertions: Vec<AssertionResult>,
    /// Memory measured.
    pub memory: CellMemory,
    /// Tables recorded.
    pub tables: Vec<Table>,
    /// Figures recorded.
    pub figures: Vec<Figure>,
    /// Why the cell did not run, when it was skipped: this build cannot
    /// run it (what to install is said), an earlier cell failed under
    /// `--fail-fast`, or the run was interrupted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_run: Option<String>,
}

/// A cell's memory: over the whole cell, and per measured region.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct CellMemory {
    /// Bytes live when the cell began.
    pub baseline_bytes: u64,
    /// The split when the cell began.
    pub baseline_by_category: ByCategory,
    /// The highest total during the cell (baseline included).
    pub peak_bytes: u64,
    /// Bytes live when the cell ended.
    pub current_bytes: u64,
    /// The split at the peak.
    pub peak_by_category: ByCategory,
    /// The split at the end.
    pub current_by_category: ByCategory,
    /// On a GPU, the CUDA memory pool's own figures for the cell (its peak is
    /// the highest of its regions' and the rest); absent on the CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<PoolUse>,
    /// The regions the plugin measured, with their timelines.
    pub regions: Vec<RegionReport>,
}

/// Counts over a run.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Summary {
    /// Assertions that held.
    pub passed: usize,
    /// Assertions that failed (including those of cells that errored).
    pub failed: usize,
    /// Assertions not checked: of cells that did not run, or checked at
    /// full size only in a check-size run.
    pub skipped: usize,
    /// Cells that passed.
    pub cells_passed: usize,
    /// Cells with a failed assertion.
    pub cells_failed: usize,
    /// Cells whose plugin errored or panicked.
    pub cells_errored: usize,
}

impl Summary {
    /// Whether everything that ran passed.
    pub fn all_passed(&self) -> bool {
        self.failed == 0 && self.cells_errored == 0 && self.cells_failed == 0
    }

    /// The closing line, `N passed, N failed`, with `, N skipped` when any were.
    pub fn line(&self) -> String {
        let mut s = format!("{} passed, {} failed", self.passed, self.failed);
        if self.skipped > 0 {
            s.push_str(&format!(", {} skipped", self.skipped));
        }
        s
    }
}

impl ChapterReport {
    /// How many cells ran, or began to (those not skipped).
    pub fn cells_run(&self) -> usize {
        self.cells
            .iter()
            .filter(|c| c.status != Status::Skipped)
            .count()
    }

    /// The summary recomputed from the cells.
    pub fn summarize(cells: &[CellReport]) -> Summary {
        let mut s = Summary::default();
        for c in cells {
            s.skipped += c.assertions.iter().filter(|a| a.skipped).count();
            s.passed += c.assertions.iter().filter(|a| a.passed).count();
            s.failed += c
                .assertions
                .iter()
                .filter(|a| !a.passed && !a.skipped)
                .count();
            match c.status {
                Status::Passed => s.cells_passed += 1,
                Status::Failed => s.cells_failed += 1,
                Status::Error => s.cells_errored += 1,
                Status::Skipped => {}
            }
        }
        s
    }
}
