//! The terminal renderer: each cell as it finishes, then the closing line.

use std::io::Write;

use workbook_sdk::output::{Table, Unit};

#[cfg(feature = "runner")]
use crate::report::ChapterReport;
use crate::report::{CellReport, Status};

/// Formats bytes with a binary unit: `512 B`, `3.5 KiB`, `1.27 MiB`.
pub fn bytes(b: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if b < 1024 {
        return format!("{b} B");
    }
    let mut v = b as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    let digits = if v >= 100.0 {
        0
    } else if v >= 10.0 {
        1
    } else {
        2
    };
    format!("{v:.digits$} {}", UNITS[unit])
}

/// Formats a table cell or metric value for people, by its unit.
pub fn format_value(v: &serde_json::Value, unit: Unit) -> String {
    match (v, unit) {
        (serde_json::Value::Number(n), Unit::Bytes) => {
            n.as_u64().map(bytes).unwrap_or_else(|| n.to_string())
        }
        (serde_json::Value::Number(n), Unit::Seconds) => n
            .as_f64()
            .map(|s| {
                if s < 1.0 {
                    format!("{:.1} ms", s * 1e3)
                } else {
                    format!("{s:.2} s")
                }
            })
            .unwrap_or_default(),
        (serde_json::Value::Number(n), Unit::Ratio) => {
            n.as_f64().map(|r| format!("{r:.2}")).unwrap_or_default()
        }
        (serde_json::Value::Number(n), _) => match n.as_f64() {
            Some(f) if f.fract() != 0.0 && f.abs() < 1e-3 => format!("{f:.1e}"),
            Some(f) if f.fract() != 0.0 => format!("{f:.4}"),
            Some(f) if f.abs() < 1e15 => format!("{}", f as i64),
            _ => n.to_string(),
        },
        (serde_json::Value::String(s), _) => s.clone(),
        (other, _) => other.to_string(),
    }
}

/// The metrics an assertion read, as `name = value, ...` (`?` for missing).
pub fn assertion_values(a: &crate::assertion::AssertionResult) -> String {
    a.values
        .iter()
        .map(|(k, v)| match v {
            Some(v) => format!("{k} = {}", format_value(&serde_json::json!(v), Unit::None)),
            None => format!("{k} = ?"),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Writes `table` with aligned columns, indented by `indent`.
pub fn write_table(out: &mut dyn Write, table: &Table, indent: &str) -> std::io::Result<()> {
    let header: Vec<String> = table.columns.iter().map(|c| c.name.clone()).collect();
    let rows: Vec<Vec<String>> = table
        .rows
        .iter()
        .map(|r| {
            r.iter()
                .zip(&table.columns)
                .map(|(v, c)| format_value(v, c.unit))
                .collect()
        })
        .collect();
    grid(out, &table.title, &header, &rows, indent)
}

fn grid(
    out: &mut dyn Write,
    title: &str,
    header: &[String],
    rows: &[Vec<String>],
    indent: &str,
) -> std::io::Result<()> {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    if !title.is_empty() {
        writeln!(out, "{indent}{title}")?;
    }
    let line = |cells: &[String]| {
        cells
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(i, (c, w))| {
                if i == 0 {
                    format!("{c:<w$}")
                } else {
                    format!("{c:>w$}")
                }
            })
            .collect::<Vec<_>>()
            .join("  ")
    };
    writeln!(out, "{indent}  {}", line(header))?;
    for r in rows {
        writeln!(out, "{indent}  {}", line(r))?;
    }
    Ok(())
}

/// Renders a run to a terminal or any writer, cell by cell.
pub struct TextRenderer<W: Write> {
    out: W,
    error: Option<std::io::Error>,
}

impl<W: Write> TextRenderer<W> {
    /// A renderer writing to `out`.
    pub fn new(out: W) -> Self {
        Self { out, error: None }
    }

    /// The first write that failed, if any: the run goes on (its report is
    /// still written with `--out`), and the caller says it and fails.
    pub fn take_error(&mut self) -> Option<std::io::Error> {
        self.error.take()
    }

    #[cfg(feature = "runner")]
    fn keep(&mut self, result: std::io::Result<()>) {
        if let Err(e) = result {
            self.error.get_or_insert(e);
        }
    }

    /// Writes what `write` writes, with the control characters of
    /// chapter and plugin text escaped (see [`crate::terminal`]).
    fn emit(
        &mut self,
        write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        let mut buf = Vec::new();
        write(&mut buf)?;
        let text = String::from_utf8_lossy(&buf);
        self.out
            .write_all(crate::terminal::printable(&text).as_bytes())?;
        self.out.flush()
    }

    /// Writes one cell's report.
    pub fn cell(&mut self, c: &CellReport) -> std::io::Result<()> {
        self.emit(|out| write_cell(out, c))
    }
}

fn write_cell(out: &mut dyn Write, c: &CellReport) -> std::io::Result<()> {
    if c.id == c.plugin {
        writeln!(out, "\n== {}  [{}]", c.title, c.id)?;
    } else {
        writeln!(out, "\n== {}  [{}, plugin {}]", c.title, c.id, c.plugin)?;
    }
    for line in c.prose.trim().lines() {
        writeln!(out, "  {line}")?;
    }
    if c.status == Status::Skipped {
        match &c.not_run {
            Some(why) => writeln!(out, "  (not run: {why})")?,
            None => writeln!(out, "  (not run)")?,
        }
        return Ok(());
    }
    if !c.printed.is_empty() {
        writeln!(out)?;
        for line in &c.printed {
            writeln!(out, "  > {line}")?;
        }
    }
    for t in &c.tables {
        writeln!(out)?;
        write_table(out, t, "  ")?;
    }
    writeln!(out)?;
    write_table(out, &super::memory_table(c), "  ")?;
    if let Some(e) = &c.error {
        writeln!(out, "\n  ERROR: {e}")?;
    }
    writeln!(out)?;
    for a in &c.assertions {
        let mark = if a.passed {
            "✓"
        } else if a.skipped {
            "-"
        } else {
            "✗"
        };
        let values = match assertion_values(a) {
            v if v.is_empty() => v,
            v => format!("   ({v})"),
        };
        writeln!(out, "  {mark} {}{values}", a.expr)?;
        if let Some(m) = &a.message {
            if a.skipped {
                writeln!(out, "      (skipped: {m})")?;
            } else if !a.passed {
                writeln!(out, "      {m}")?;
            }
        }
    }
    writeln!(out, "  [{:.2} s]", c.seconds)
}

#[cfg(feature = "runner")]
impl<W: Write> crate::runner::RunObserver for TextRenderer<W> {
    fn started(&mut self, r: &ChapterReport) {
        let result = self.emit(|out| {
            writeln!(
                out,
                "{}  ({}, {} mode, device {}, meter {})",
                r.chapter.title,
                r.chapter.id,
                mode_name(r),
                r.device,
                r.meter
            )?;
            for line in r.chapter.intro.trim().lines() {
                writeln!(out, "{line}")?;
            }
            Ok(())
        });
        self.keep(result);
    }

    fn cell_started(&mut self, _index: usize, _cell: &crate::chapter::Cell) {}

    fn cell_finished(&mut self, c: &CellReport) {
        let result = self.cell(c);
        self.keep(result);
    }

    fn finished(&mut self, r: &ChapterReport) {
        let result = self.emit(|out| {
            if r.incomplete {
                writeln!(
                    out,
                    "\nincomplete: the run was stopped after {} of {} cells",
                    r.cells_run(),
                    r.cells.len()
                )?;
            }
            // Each reason a cell did not run, said once under the cells.
            let mut not_run: indexmap::IndexMap<&str, Vec<&str>> = Default::default();
            for c in &r.cells {
                if let Some(why) = &c.not_run {
                    not_run.entry(why).or_default().push(&c.id);
                }
            }
            for (why, ids) in &not_run {
                let cells = if ids.len() == 1 { "cell" } else { "cells" };
                writeln!(out, "\nnot run ({cells} {}): {why}", ids.join(", "))?;
            }
            writeln!(out, "\n{}", r.summary.line())
        });
        self.keep(result);
    }
}

#[cfg(feature = "runner")]
fn mode_name(r: &ChapterReport) -> &'static str {
    match r.mode {
        crate::report::Mode::Full => "full",
        crate::report::Mode::Check => "check",
    }
}
