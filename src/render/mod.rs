//! Renderers: siblings that read a [`ChapterReport`](crate::report::ChapterReport)
//! and write to any `io::Write`. They never run experiments.

pub mod html;
pub mod plot;
pub mod text;

use std::io::Write;

use workbook_sdk::meter::{ByCategory, Category};
use workbook_sdk::output::{PoolUse, Table, Unit};

use crate::report::{CellReport, ChapterReport};

/// Writes `report` as pretty JSON followed by a newline.
pub fn json(out: &mut dyn Write, report: &ChapterReport) -> std::io::Result<()> {
    serde_json::to_writer_pretty(&mut *out, report)?;
    writeln!(out)
}

/// A category's column heading.
fn short_name(c: Category) -> &'static str {
    match c {
        Category::Parameters => "params",
        Category::Gradients => "grads",
        Category::OptimizerState => "optim",
        Category::Activations => "activ",
        Category::Inputs => "inputs",
        Category::Communication => "comm",
        Category::Other => "other",
    }
}

/// A cell's memory as a table, for every renderer: each variant's peak above
/// its start, split by category at that peak, what it left behind, and the
/// whole cell. On a GPU a last column gives the CUDA memory pool's own peak
/// above the start, the figure `torch.cuda.max_memory_allocated` would give,
/// beside the counted one.
pub fn memory_table(cell: &CellReport) -> Table {
    let m = &cell.memory;
    let on_gpu = m.pool.is_some();
    let mut columns = vec![
        ("memory (peak above start)", Unit::None),
        ("peak", Unit::Bytes),
    ];
    // Communication buffers exist only in distributed cells: elsewhere the
    // column would be zeros.
    let communicates = m
        .regions
        .iter()
        .map(|r| &r.peak_by_category)
        .chain([&m.peak_by_category])
        .any(|c| c.get(Category::Communication) > 0);
    let shown: Vec<Category> = Category::ALL
        .into_iter()
        .filter(|&c| c != Category::Communication || communicates)
        .collect();
    columns.extend(shown.iter().map(|&c| (short_name(c), Unit::Bytes)));
    columns.push(("after", Unit::Bytes));
    if on_gpu {
        columns.push(("pool peak", Unit::Bytes));
    }
    let mut table = Table::new("", &columns);
    let mut row = |name: &str,
                   peak: u64,
                   at_peak: &ByCategory,
                   base: &ByCategory,
                   after: &ByCategory,
                   pool: Option<PoolUse>| {
        let mut r = vec![name.into(), peak.saturating_sub(base.total()).into()];
        r.extend(
            shown
                .iter()
                .map(|&c| at_peak.get(c).saturating_sub(base.get(c)).into()),
        );
        r.push(after.total().saturating_sub(base.total()).into());
        if on_gpu {
            r.push(pool.map_or(serde_json::Value::Null, |p| p.peak_above_baseline().into()));
        }
        table.row(r);
    };
    for r in &m.regions {
        row(
            &r.name,
            r.peak_bytes,
            &r.peak_by_category,
            &r.baseline,
            &r.end,
            r.pool,
        );
    }
    row(
        "whole cell",
        m.peak_bytes,
        &m.peak_by_category,
        &m.baseline_by_category,
        &m.current_by_category,
        m.pool,
    );
    table
}
