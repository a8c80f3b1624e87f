//! The "Rust (workbook)" Jupyter kernel through Jupyter itself
//! (`scripts/kernel_check.py`): a 1000 x 1000 f32 tensor made in a cell is
//! counted to the byte, and charged back when a later cell drops it; and a
//! notebook executed through it (`scripts/notebook_check.py`) stops at a
//! chapter cell that fails an assertion, naming it.
//!
//! Needs a Python with jupyter_client and nbclient (`WORKBOOK_PYTHON`, else
//! `python3`),
//! an evcxr kernel (`workbook-kernel` beside the workbook, which
//! `crates/kernel` builds, or evcxr_jupyter), and the interposer built (`cargo build -p
//! workbook-preload`, which `cargo test --workspace` does); skipped with a
//! notice when one is missing, unless `WORKBOOK_REQUIRE_KERNEL` is set.

use std::path::PathBuf;
use std::process::Command;
use std::sync::{Mutex, MutexGuard};

/// One kernel at a time. evcxr's compile cache (`:cache`, under the user's
/// cache folder) is shared by every kernel and is not safe for two writers:
/// a miss copies its artifacts over the entry in place while a hit reads
/// it, and the hit counter is truncated and rewritten while another kernel
/// parses it. Two kernels building the same crates on a cold cache can
/// fail each other's cells.
fn one_kernel() -> MutexGuard<'static, ()> {
    static KERNEL: Mutex<()> = Mutex::new(());
    // A test that panicked while holding it leaves nothing to repair.
    KERNEL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn python() -> String {
    std::env::var("WORKBOOK_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// What is missing to run the check, if anything.
fn missing() -> Option<String> {
    let has_client = Command::new(python())
        .args(["-c", "import jupyter_client, nbclient"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_client {
        return Some(format!("{} has no jupyter_client or nbclient", python()));
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
            "no evcxr kernel (workbook-kernel beside the workbook, or evcxr_jupyter)".into(),
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

/// Whether the kernel tests can run here; a skip is a notice, or an error
/// under `WORKBOOK_REQUIRE_KERNEL`.
fn can_run() -> bool {
    let Some(what) = missing() else {
        return true;
    };
    assert!(
        std::env::var_os("WORKBOOK_REQUIRE_KERNEL").is_none(),
        "WORKBOOK_REQUIRE_KERNEL is set and {what}"
    );
    eprintln!("notice: the kernel test is skipped: {what}");
    false
}

#[test]
fn a_failing_chapter_cell_fails_its_notebook_through_a_real_kernel() {
    if !can_run() {
        return;
    }
    let _kernel = one_kernel();
    let dir = tempfile::tempdir().unwrap();
    let workbook = env!("CARGO_BIN_EXE_workbook");
    let spec = dir.path().join("jupyter/kernels/rust-workbook");
    let notebook = dir.path().join("fails.ipynb");
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/notebook_fails.toml"
    );
    for args in [
        vec!["kernel", "install", "--dir", spec.to_str().unwrap()],
        vec!["notebook", fixture, "-o", notebook.to_str().unwrap()],
    ] {
        let mut cmd = Command::new(workbook);
        cmd.args(&args);
        if args[0] == "kernel" {
            cmd.arg("--preload").arg(preload().unwrap());
        }
        let o = cmd.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/notebook_check.py");
    let out = Command::new(python())
        .arg(script)
        .arg(&notebook)
        .env("JUPYTER_PATH", dir.path().join("jupyter"))
        .env("WORKBOOK_BIN", workbook)
        .env_remove("WORKBOOK_CHECK_MODE")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(
        stderr.contains(
            "cell `wrong` failed 1 of 2 assertions: `small_params > large_params` \
             (small_params = 17802, large_params = 333834): the expression is false"
        ),
        "{stderr}"
    );
    assert!(stdout.contains("FAIL  cell `wrong` errored"), "{stdout}");
    assert!(
        stdout.contains("FAIL  cell `after` did not run"),
        "{stdout}"
    );
    assert!(
        !stdout.contains("cell `first`"),
        "the first cell passed: {stdout}"
    );
}

#[test]
fn a_cell_is_measured_to_the_byte_through_a_real_kernel() {
    if !can_run() {
        return;
    }
    let _kernel = one_kernel();
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
