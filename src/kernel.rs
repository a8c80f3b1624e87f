//! `workbook kernel install`: a Jupyter kernel spec, "Rust (workbook)",
//! that starts evcxr's kernel with the workbook's allocation interposer
//! preloaded, so that a notebook measures its own cells exactly.
//!
//! evcxr runs each cell as a library of its own, each with its own copy of
//! every crate's statics, in a child process whose allocator is the C one.
//! The interposer (the `workbook-preload` library) takes the C allocator's
//! place in that child and keeps one set of counters for all of them,
//! which `workbook_sdk`'s meter reads (see `workbook_sdk::meter::raw`).

use std::path::{Path, PathBuf};

use serde_json::json;

/// The interposer's file name.
pub const PRELOAD: &str = "libworkbook_preload.so";

/// The kernel spec's folder name, which notebooks name in their metadata.
pub const KERNEL_NAME: &str = "rust-workbook";

/// evcxr's kernel as `crates/kernel` builds it (a workspace of its own).
pub const KERNEL_BINARY: &str = "workbook-kernel";

/// `name` beside this executable, if it is there.
fn beside_this(name: &str) -> Option<PathBuf> {
    let path = std::env::current_exe().ok()?.with_file_name(name);
    path.is_file().then_some(path)
}

/// What to install, and where.
#[derive(Debug, Clone, Default)]
pub struct Install {
    /// evcxr's Jupyter kernel [default: `workbook-kernel` beside this
    /// executable, else `evcxr_jupyter` on PATH or in `~/.cargo/bin`].
    pub evcxr: Option<PathBuf>,
    /// The interposer [default: beside this executable].
    pub preload: Option<PathBuf>,
    /// The kernel spec's folder [default: Jupyter's user data folder's
    /// `kernels/rust-workbook`].
    pub dir: Option<PathBuf>,
}

fn home() -> Option<PathBuf> {
    std::env::var_os("HOME").map(PathBuf::from)
}

/// `name` on PATH, else in `~/.cargo/bin`.
fn find_program(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .chain(home().map(|h| h.join(".cargo/bin")))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Jupyter's user data folder, as `jupyter --data-dir` finds it on Linux.
fn jupyter_data_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("JUPYTER_DATA_DIR") {
        return Some(PathBuf::from(d));
    }
    let data = std::env::var_os("XDG_DATA_HOME")
        .map(PathBuf::from)
        .or_else(|| home().map(|h| h.join(".local/share")))?;
    Some(data.join("jupyter"))
}

fn absolute(path: &Path) -> anyhow::Result<PathBuf> {
    std::fs::canonicalize(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// Writes the kernel spec; returns its folder.
pub fn install(opts: &Install) -> anyhow::Result<PathBuf> {
    if !cfg!(target_os = "linux") {
        anyhow::bail!(
            "the workbook kernel counts allocations by taking the C allocator's place with \
             LD_PRELOAD, which this needs Linux (glibc) for"
        );
    }
    let evcxr = match &opts.evcxr {
        Some(p) if p.is_file() => absolute(p)?,
        Some(p) => anyhow::bail!("--evcxr {}: no such file", p.display()),
        None => beside_this(KERNEL_BINARY)
            .or_else(|| find_program("evcxr_jupyter"))
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "no evcxr kernel: neither {KERNEL_BINARY} beside this executable (`cargo \
                     build --release --manifest-path crates/kernel/Cargo.toml --target-dir \
                     target` builds it there) nor evcxr_jupyter on PATH or in ~/.cargo/bin \
                     (`cargo install --locked evcxr_jupyter`)"
                )
            })?,
    };
    let preload = match &opts.preload {
        Some(p) if p.is_file() => absolute(p)?,
        Some(p) => anyhow::bail!("--preload {}: no such file", p.display()),
        None => match beside_this(PRELOAD) {
            Some(p) => absolute(&p)?,
            None => anyhow::bail!(
                "{PRELOAD} is not beside this executable: build it with the same profile \
                 (`cargo build --release -p workbook-preload` for a release workbook), or \
                 name it with --preload"
            ),
        },
    };
    let dir = match &opts.dir {
        Some(d) => d.clone(),
        None => jupyter_data_dir()
            .ok_or_else(|| anyhow::anyhow!("no home folder to install into; name one with --dir"))?
            .join("kernels")
            .join(KERNEL_NAME),
    };
    std::fs::create_dir_all(&dir)
        .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", dir.display()))?;
    let spec = json!({
        "argv": [evcxr, "--control_file", "{connection_file}"],
        "display_name": "Rust (workbook)",
        "language": "rust",
        "interrupt_mode": "message",
        // evcxr's kernel and the compilers it starts run on glibc's
        // allocator unchanged; the interposer counts the child that runs
        // the cells (EVCXR_IS_RUNTIME in its environment).
        //
        // evcxr loads each cell from a library cargo builds incrementally;
        // with CARGO_INCREMENTAL=0 inherited (as CI sets it), the second
        // cell's library lacked its entry point ("dlsym failed").
        "env": { "LD_PRELOAD": preload, "CARGO_INCREMENTAL": "1" },
        "metadata": { "workbook": { "counts_allocations": true } },
    });
    let path = dir.join("kernel.json");
    std::fs::write(&path, serde_json::to_string_pretty(&spec)? + "\n")
        .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spec_starts_evcxr_with_the_interposer_preloaded() {
        let tmp = tempfile::tempdir().unwrap();
        let (evcxr, preload) = (tmp.path().join("evcxr_jupyter"), tmp.path().join(PRELOAD));
        std::fs::write(&evcxr, "").unwrap();
        std::fs::write(&preload, "").unwrap();
        let dir = install(&Install {
            evcxr: Some(evcxr.clone()),
            preload: Some(preload.clone()),
            dir: Some(tmp.path().join("kernels/rust-workbook")),
        })
        .unwrap();
        let spec: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("kernel.json")).unwrap()).unwrap();
        let evcxr = std::fs::canonicalize(evcxr).unwrap();
        assert_eq!(spec["argv"][0], evcxr.to_str().unwrap());
        assert_eq!(spec["argv"][2], "{connection_file}");
        let preload = std::fs::canonicalize(preload).unwrap();
        assert_eq!(spec["env"]["LD_PRELOAD"], preload.to_str().unwrap());
        assert_eq!(spec["display_name"], "Rust (workbook)");
        assert_eq!(spec["env"]["CARGO_INCREMENTAL"], "1");
    }

    #[test]
    fn missing_pieces_are_named_with_how_to_get_them() {
        let tmp = tempfile::tempdir().unwrap();
        let err = install(&Install {
            evcxr: Some(tmp.path().join("nope")),
            ..Install::default()
        })
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("--evcxr") && err.contains("no such file"),
            "{err}"
        );
        let evcxr = tmp.path().join("evcxr_jupyter");
        std::fs::write(&evcxr, "").unwrap();
        let err = install(&Install {
            evcxr: Some(evcxr),
            preload: Some(tmp.path().join("missing.so")),
            dir: Some(tmp.path().join("k")),
        })
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("--preload") && err.contains("missing.so"),
            "{err}"
        );
    }
}
