//! `workbook-kernel --warm NOTEBOOK...`: builds the crates a notebook's
//! setup cell adds (its `:dep` lines), as the kernel would in a session,
//! in the build folder a session then finds, so that a learner's first
//! Jupyter session links instead of compiling candle and the workbook.
//!
//! A session builds its dependencies in evcxr's own profile (`opt-level =
//! 2`, no debug info, `rpath`, its own target folder and target triple):
//! nothing `cargo build` made for the workspace can be reused there, so the
//! build is done here, once, as one of the README's build steps.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

/// The `:dep` lines of `notebook`'s first code cell that has any: what
/// the kernel builds when that cell runs.
fn setup_deps(notebook: &Path) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(notebook)
        .with_context(|| format!("reading the notebook {}", notebook.display()))?;
    let nb: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a notebook (JSON)", notebook.display()))?;
    let cells = nb["cells"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    for cell in cells.iter().filter(|c| c["cell_type"] == "code") {
        // A cell's source is a string or a list of lines.
        let source = match &cell["source"] {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Array(lines) => lines.iter().filter_map(|l| l.as_str()).collect(),
            _ => continue,
        };
        let deps: Vec<&str> = source
            .lines()
            .filter(|l| l.trim_start().starts_with(":dep "))
            .collect();
        if !deps.is_empty() {
            return Ok(deps.join("\n"));
        }
    }
    bail!(
        "{} has no code cell with `:dep` lines: nothing to build",
        notebook.display()
    )
}

/// Builds each notebook's `:dep` lines in evcxr, from the notebook's own
/// folder (where Jupyter starts the kernel: the lines' paths are relative
/// to it). Expects the build folder already claimed (`EVCXR_TMPDIR` set).
pub fn warm(notebooks: &[PathBuf]) -> anyhow::Result<()> {
    if notebooks.is_empty() {
        bail!("usage: workbook-kernel --warm NOTEBOOK.ipynb...");
    }
    let folder = std::env::var_os("EVCXR_TMPDIR").map(PathBuf::from);
    let Some(folder) = folder else {
        bail!("no build folder could be claimed for the kernel (is every one in use?)");
    };
    // As the kernel spec sets it (`workbook kernel install`): cargo's
    // incremental setting is part of what a build is reused for.
    std::env::set_var("CARGO_INCREMENTAL", "1");
    // Found before the first one changes the folder the others are named from.
    let found = notebooks
        .iter()
        .map(|given| {
            let path = given
                .canonicalize()
                .with_context(|| format!("finding the notebook {}", given.display()))?;
            Ok((given, path))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    for (given, notebook) in found {
        let deps = setup_deps(&notebook)?;
        let dir = notebook.parent().unwrap_or(Path::new("/"));
        std::env::set_current_dir(dir)
            .with_context(|| format!("entering the notebook's folder {}", dir.display()))?;
        eprintln!(
            "Building {}'s crates in {} (the first time takes minutes)",
            given.display(),
            folder.display()
        );
        let started = std::time::Instant::now();
        let (mut ctx, outputs) =
            evcxr::CommandContext::new().map_err(|e| anyhow::anyhow!("starting evcxr: {e}"))?;
        // What the cells' own process prints, passed on as it comes.
        for channel in [outputs.stdout, outputs.stderr] {
            std::thread::spawn(move || channel.iter().for_each(|line| eprintln!("{line}")));
        }
        // As the kernel starts a session: the user's evcxr configuration
        // first, so that its settings (an opt-level) shape the same build.
        for code in [":load_config", deps.as_str()] {
            ctx.execute(code)
                .map_err(|e| anyhow::anyhow!("building {}'s crates: {e}", given.display()))?;
        }
        eprintln!(
            "Built in {:.0} s; a Jupyter session now finds them",
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}
