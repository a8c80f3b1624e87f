//! `workbook list` and `workbook validate`: chapters and plugins, checked
//! without running anything.

use std::process::ExitCode;

use workbook::terminal::printable;
use workbook::Workbook;

use super::say;

/// `workbook list`: every chapter with its cells, then the plugins.
pub fn list(wb: &Workbook) -> anyhow::Result<ExitCode> {
    use std::fmt::Write as _;
    let found = workbook::chapter::available(wb.chapter_dirs());
    let mut text = String::new();
    if found.is_empty() {
        let _ = writeln!(text, "no chapters found in {:?}", wb.chapter_dirs());
    }
    let mut code = ExitCode::SUCCESS;
    for (id, path) in found {
        match workbook::chapter::load_path(&path, wb.registry()) {
            Ok(ch) => {
                let _ = writeln!(text, "{id}  {}  ({})", ch.title, path.display());
                for c in &ch.cells {
                    let _ = writeln!(text, "  {:<16} {:<14} {}", c.id, c.plugin, c.title);
                }
            }
            Err(e) => {
                let _ = writeln!(text, "{id}  (invalid: {e})");
                code = ExitCode::from(2);
            }
        }
    }
    let _ = writeln!(text, "\nplugins:");
    for p in wb.registry().iter() {
        let _ = writeln!(text, "  {:<16} {}", p.name(), p.description());
        if let Some(program) = wb.registry().program(p.name()) {
            let _ = writeln!(text, "  {:<16} (external: {})", "", program.display());
        }
    }
    for (name, why) in wb.registry().refused() {
        let _ = writeln!(text, "  {name:<16} (cannot be used: {why})");
    }
    say(&printable(&text))?;
    Ok(code)
}

/// `workbook validate CHAPTER`: loads the chapter, which checks it whole.
pub fn validate(wb: &Workbook, chapter: &str) -> anyhow::Result<ExitCode> {
    let ch = wb.load(chapter)?;
    let assertions: usize = ch.cells.iter().map(|c| c.assertions.len()).sum();
    say(&format!(
        "{}: {} cells, {assertions} assertions, valid\n",
        ch.path.display(),
        ch.cells.len()
    ))?;
    Ok(ExitCode::SUCCESS)
}
