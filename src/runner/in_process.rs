//! Running one cell's plugin in this process: what the in-process runner
//! does for every cell, and what a worker process does for its one.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Instant;

use workbook_sdk::output::{CellOutput, PoolUse};
use workbook_sdk::protocol::CellEnd;
use workbook_sdk::{Context, DynPlugin, Meter};

/// What a cell's run produced: what it recorded, and how it ended.
#[derive(Debug, Clone)]
pub struct CellOutcome {
    /// What the plugin recorded, up to its end or its failure.
    pub output: CellOutput,
    /// How it ended, and its memory over the whole cell.
    pub end: CellEnd,
}

/// A panic's payload as an error.
pub(crate) fn panicked(payload: &(dyn std::any::Any + Send)) -> anyhow::Error {
    let message = if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with no message".to_string()
    };
    anyhow::anyhow!("panicked: {message}")
}

/// Runs `plugin` with `params` in `ctx`; its errors and panics become the
/// outcome's error, and what it recorded before them is kept.
pub(crate) fn execute(
    plugin: &dyn DynPlugin,
    params: &toml::Table,
    mut ctx: Context,
    meter: &Arc<dyn Meter>,
) -> CellOutcome {
    let start = Instant::now();
    // The cell's own frame: its peak is the true high-water mark of the
    // cell, its regions' included, whatever they open and close inside it.
    meter.push_peak();
    let before = meter.snapshot();
    let result = catch_unwind(AssertUnwindSafe(|| plugin.run_with(&mut ctx, params)))
        .unwrap_or_else(|payload| Err(panicked(payload.as_ref())));
    let seconds = start.elapsed().as_secs_f64();
    let after = meter.snapshot();
    meter.pop_peak();
    CellOutcome {
        output: ctx.into_output(),
        end: CellEnd {
            error: result.err().map(|e| format!("{e:#}")),
            seconds,
            baseline: before.current,
            peak_bytes: after.peak,
            peak_by_category: after.peak_by_category,
            end: after.current,
            pool: PoolUse::between(&before, &after),
        },
    }
}
