//! `workbook-kernel`: evcxr's Jupyter kernel (the `evcxr_jupyter` crate).
//! `workbook kernel install` finds it beside the `workbook` executable and
//! names it in the "Rust (workbook)" kernel spec, with the allocation
//! interposer preloaded.
//!
//! evcxr builds a session's crates in a temporary folder that goes when the
//! kernel ends, so every session would build candle, the toolkit and the
//! workbook again (minutes, when the setup cell runs). This kernel gives it
//! a build folder that outlives it instead (evcxr's `EVCXR_TMPDIR`):
//! `workbook/evcxr/N` in the user's cache folder (`$XDG_CACHE_HOME`, else
//! `~/.cache`), the first N that no running kernel holds, so that a new
//! session finds what the last one built and cargo rebuilds only what
//! changed. Deleting the folder is safe while no kernel runs. With
//! `EVCXR_TMPDIR` set, that folder is used as evcxr would use it.
//!
//! `workbook-kernel --warm NOTEBOOK...` builds what the notebooks' setup
//! cells add, in that folder, and exits: the README's notebook steps run
//! it, so that the first session's setup cell does not compile for minutes.

mod warm;

use std::fs::{File, TryLockError};
use std::path::{Path, PathBuf};

/// Kernels at once that get a build folder of their own; more than this
/// build in a temporary folder, as evcxr does by itself.
const SLOTS: usize = 16;

/// Where the build folders are.
fn cache_root() -> Option<PathBuf> {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(cache.join("workbook").join("evcxr"))
}

/// The cargo configuration beside the build folders, which cargo reads
/// for each of them (it looks in the folders above where it runs): evcxr
/// builds a session at `opt-level = 2`, dependencies and the crate of the
/// cells (which it names `ctx`) alike, and a cell that runs an experiment
/// instantiates the runner's generic code for the experiment's plugin,
/// optimised again on every run. Only the cells' crate is built without
/// optimisation: candle, the toolkit and the workbook stay optimised, and
/// what a cell allocates is the same at any level.
const CELL_PROFILE: &str = "\
# Written by workbook-kernel: the notebook cells' crate unoptimised, so
# that a cell compiles in seconds; its dependencies stay optimised.
[profile.dev.package.ctx]
opt-level = 0
";

/// Writes [`CELL_PROFILE`] into `root`'s `.cargo/config.toml` unless it
/// is there already; a failure leaves evcxr's own settings, still correct.
fn write_cell_profile(root: &Path) {
    let dir = root.join(".cargo");
    let path = dir.join("config.toml");
    if std::fs::read_to_string(&path).is_ok_and(|s| s == CELL_PROFILE) {
        return;
    }
    let _ = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, CELL_PROFILE));
}

/// A build folder that no other running kernel holds, and the lock that
/// holds it for as long as this process runs.
fn claim_build_folder() -> Option<(PathBuf, File)> {
    let root = cache_root()?;
    std::fs::create_dir_all(&root).ok()?;
    write_cell_profile(&root);
    for slot in 0..SLOTS {
        let lock = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(root.join(format!("{slot}.lock")))
            .ok()?;
        match lock.try_lock() {
            Ok(()) => {
                let folder = root.join(slot.to_string());
                std::fs::create_dir_all(&folder).ok()?;
                return Some((folder, lock));
            }
            Err(TryLockError::WouldBlock) => continue,
            Err(TryLockError::Error(_)) => return None,
        }
    }
    None
}

/// The folder of the standard library's shared object for the host, as
/// the `rustc` evcxr runs in `folder` has it (`rustc --print
/// target-libdir`, there, so that a toolchain override applies).
fn target_libdir(folder: &Path) -> Option<PathBuf> {
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let out = std::process::Command::new(rustc)
        .current_dir(folder)
        .args(["--print", "target-libdir"])
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    let dir = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    dir.is_dir().then_some(dir)
}

fn main() -> anyhow::Result<()> {
    // evcxr starts this executable again as the process that runs the cells
    // and as its compiler wrapper: this runs those and does not return, so
    // they claim no folder.
    evcxr::runtime_hook();
    let _held = if std::env::var_os("EVCXR_TMPDIR").is_some() {
        None
    } else {
        claim_build_folder().and_then(|(folder, lock)| {
            let libdir = target_libdir(&folder)?;
            // A cell's library finds the standard library's shared object
            // through a path relative to where rustc wrote it, one folder
            // below where evcxr loads it from: right only when the surplus
            // `..` is absorbed at `/`, as it is from evcxr's own folder in
            // /tmp but not from one beside the toolchain in the home
            // folder ("dlopen failed"). The process that loads the cells
            // (which inherits this) is told the folder instead.
            let mut paths = vec![libdir];
            if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
                paths.extend(std::env::split_paths(&old));
            }
            let joined = std::env::join_paths(paths).ok()?;
            // Both set before evcxr starts a thread of its own.
            std::env::set_var("LD_LIBRARY_PATH", joined);
            std::env::set_var("EVCXR_TMPDIR", &folder);
            Some(lock)
        })
    };
    let mut args = std::env::args_os().skip(1);
    if args.next().is_some_and(|a| a == "--warm") {
        return warm::warm(&args.map(PathBuf::from).collect::<Vec<_>>());
    }
    evcxr_jupyter::main()
}
