//! The "Rust (workbook)" Jupyter kernel through Jupyter itself
//! (`scripts/kernel_check.py`): a 1000 x 1000 f32 tensor made in a cell is
//! counted to the byte, and charged back when a later cell drops it.
//!
//! Needs a Python with jupyter_client (`WORKBOOK_PYTHON`, else `python3`),
//! an evcxr kernel (`workbook-kernel`, which `--features evcxr` builds, or
//! evcxr_jupyter), and the interposer built (`cargo build -p
//! workbook-preload`, which `cargo test --workspace` does); skipped with a
//! notice when one is missing, unless `WORKBOOK_REQUIRE_KERNEL` is set.

use std::path::PathBuf;
use std::process::Command;

fn python() -> String {
    std::env::var("WORKBOOK_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// What is missing to run the check, if anything.
fn missing() -> Option<String> {
    let has_client = Command::new(python())
        .args(["-c", "import jupyter_client"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_client {
        return Some(format!("{} has no jupyter_client", python()));
    }
    let built = PathBuf::from(env!("CARGO_BIN_EXE_workbook")).with_file_name("workbook-kernel");
    let on_path = built.is_file()
        || std::env::var_os("PATH")
            .into_iter()
            .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
            .chain(std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo/bin")))
            .any(|d| d.join("evcxr_jupyter").is_file());
    if !on_path {
        return Some(
            "no evcxr kernel (workbook-kernel, built with --features evcxr, or evcxr_jupyter)"
                .into(),
        );
    }
    if preload().is_none() {
        return Some("the interposer is not built (cargo build -p workbook-preload)".into());
    }
    None
}

/// The interposer built with this test's profile.
fn preload() -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_BIN_EXE_workbook"));
    let dir = dir.parent()?;
    [
        dir.join("libworkbook_preload.so"),
        dir.join("deps/libworkbook_preload.so"),
    ]
    .into_iter()
    .find(|p| p.is_file())
}

#[test]
fn a_cell_is_measured_to_the_byte_through_a_real_kernel() {
    if let Some(what) = missing() {
        assert!(
            std::env::var_os("WORKBOOK_REQUIRE_KERNEL").is_none(),
            "WORKBOOK_REQUIRE_KERNEL is set and {what}"
        );
        eprintln!("notice: the kernel test is skipped: {what}");
        return;
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/kernel_check.py");
    let out = Command::new(python())
        .arg(script)
        .args(["--workbook", env!("CARGO_BIN_EXE_workbook")])
        .arg("--preload")
        .arg(preload().unwrap())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let held = stdout.lines().filter(|l| l.starts_with("ok ")).count();
    assert_eq!(held, 3, "{stdout}");
    assert!(!stdout.contains("FAIL"), "{stdout}");
}
