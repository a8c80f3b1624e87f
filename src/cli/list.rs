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
    let loaded: Vec<_> = found
        .into_iter()
        .map(|(id, path)| {
            let chapter = workbook::chapter::load_path(&path, wb.registry());
            (id, path, chapter)
        })
        .collect();
    // Columns as wide as their longest entry, over every chapter.
    let cells = || {
        loaded
            .iter()
            .filter_map(|(.., ch)| ch.as_ref().ok())
            .flat_map(|ch| &ch.cells)
    };
    let id_width = cells().map(|c| c.id.chars().count()).max().unwrap_or(0);
    let plugin_width = cells().map(|c| c.plugin.chars().count()).max().unwrap_or(0);
    for (id, path, chapter) in &loaded {
        match chapter {
            Ok(ch) => {
                let _ = writeln!(text, "{id}  {}  ({})", ch.title, path.display());
                for c in &ch.cells {
                    let _ = writeln!(
                        text,
                        "  {:<id_width$}  {:<plugin_width$}  {}",
                        c.id, c.plugin, c.title
                    );
                }
            }
            Err(e) => {
                let _ = writeln!(text, "{id}  (invalid: {e})");
                code = ExitCode::from(2);
            }
        }
    }
    let _ = writeln!(text, "\nplugins:");
    let refused = wb.registry().refused();
    let width = wb
        .registry()
        .iter()
        .map(|p| p.name().chars().count())
        .chain(refused.iter().map(|(name, _)| name.chars().count()))
        .max()
        .unwrap_or(0);
    for p in wb.registry().iter() {
        let _ = writeln!(text, "  {:<width$}  {}", p.name(), p.description());
        if let Some(program) = wb.registry().program(p.name()) {
            let _ = writeln!(text, "  {:<width$}  (external: {})", "", program.display());
        }
    }
    for (name, why) in refused {
        let _ = writeln!(text, "  {name:<width$}  (cannot be used: {why})");
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
