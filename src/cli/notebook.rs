//! `workbook notebook`: a chapter as a Jupyter notebook for the evcxr
//! Rust kernel.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use workbook::Workbook;

use super::say;

/// The arguments of `workbook notebook`.
#[derive(Args, Debug)]
pub struct NotebookArgs {
    /// A chapter id (`chapter2`) or a path to a .toml file.
    pub chapter: String,
    /// The notebook file to write [default: CHAPTER.ipynb].
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Run the notebook's cells at check size (written into its setup cell).
    #[arg(long, env = "WORKBOOK_CHECK_MODE", value_parser = clap::builder::FalseyValueParser::new())]
    pub check: bool,
}

/// `workbook notebook CHAPTER`.
pub fn notebook(wb: &Workbook, args: &NotebookArgs) -> anyhow::Result<ExitCode> {
    let (chapter, output, check) = (&args.chapter, args.output.as_deref(), args.check);
    use anyhow::Context as _;
    use workbook::notebook::export;
    let ch = wb.load(chapter)?;
    let path = output
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(format!("{}.ipynb", ch.id)));
    // Paths in the notebook are relative to its folder, where Jupyter
    // starts its kernel: the notebook works wherever the source tree is.
    let path =
        std::path::absolute(&path).with_context(|| format!("cannot resolve {}", path.display()))?;
    let folder = path
        .parent()
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    let options = export::ExportOptions::portable(&folder, check);
    let nb = export::notebook(&ch, wb.registry(), &options)?;
    std::fs::write(&path, export::to_json(&nb)?)
        .with_context(|| format!("cannot write {}", path.display()))?;
    say(&format!(
        "wrote {} ({} cells)\n",
        path.display(),
        nb.cells.len()
    ))?;
    Ok(ExitCode::SUCCESS)
}
