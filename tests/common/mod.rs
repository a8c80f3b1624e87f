//! What the tests of the binary share.

// Each test crate compiles this module and uses part of it.
#![allow(dead_code)]

use std::process::{Command, Output, Stdio};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

/// Chapter 2's cells, in order: the techniques, then the exercises.
pub const CELLS: [&str; 8] = [
    "footprint",
    "accumulation",
    "checkpointing",
    "precision",
    "offload",
    "attention",
    "exercise-policy",
    "exercise-fit",
];

/// Chapter 2 times its techniques against each other: a test that runs it
/// whole has the machine to itself (`heavy`), the others share it (`light`).
static MACHINE: RwLock<()> = RwLock::new(());

/// The machine to this test alone.
pub fn heavy() -> RwLockWriteGuard<'static, ()> {
    MACHINE.write().unwrap_or_else(|e| e.into_inner())
}

/// The machine shared with other light tests.
pub fn light() -> RwLockReadGuard<'static, ()> {
    MACHINE.read().unwrap_or_else(|e| e.into_inner())
}

/// A finished process's stdout and stderr, as text.
pub fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// What `workbook list` says of plugin `name`, after the padding that
/// aligns the plugins' column; `None` where it lists no such plugin.
pub fn listed_plugin<'a>(list: &'a str, name: &str) -> Option<&'a str> {
    let plugins = list.split("\nplugins:\n").nth(1)?;
    plugins.lines().find_map(|l| {
        let rest = l.strip_prefix("  ")?.strip_prefix(name)?;
        rest.starts_with("  ").then(|| rest.trim_start())
    })
}

/// The longest a test waits for one run of the binary.
pub const RUN_LIMIT: Duration = Duration::from_secs(300);

/// `cmd`'s output as `Command::output` gives it, except that a process
/// still running after `limit` is killed and the test fails: a regression
/// that makes the binary wait (reading a FIFO, say) fails its test instead
/// of hanging the suite.
pub fn output_within(cmd: &mut Command, limit: Duration) -> Output {
    use std::io::Read;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary runs");
    let drain = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            bytes
        })
    };
    let stdout = drain(Box::new(child.stdout.take().expect("piped")));
    let stderr = drain(Box::new(child.stderr.take().expect("piped")));
    let until = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().expect("the binary is waited for") {
            break status;
        }
        if Instant::now() >= until {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{cmd:?} still ran after {limit:?}; it was killed");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: stdout.join().expect("stdout read"),
        stderr: stderr.join().expect("stderr read"),
    }
}

/// The processes whose environment holds `WORKBOOK_TEST_MARK=mark` (a
/// runner run with that variable, and whatever it started), zombies left
/// out: they run nothing.
pub fn marked(mark: &str) -> Vec<u32> {
    let needle = format!("WORKBOOK_TEST_MARK={mark}");
    std::fs::read_dir("/proc")
        .expect("/proc")
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.split(|&b| b == 0).any(|v| v == needle.as_bytes()))
        })
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
                s.rsplit(')')
                    .next()
                    .and_then(|r| r.split_whitespace().next())
                    != Some("Z")
            })
        })
        .collect()
}

/// Waits up to `limit` until no process is marked `mark`; fails naming
/// those still running.
pub fn none_left(mark: &str, limit: std::time::Duration) {
    let until = std::time::Instant::now() + limit;
    loop {
        let left = marked(mark);
        if left.is_empty() {
            return;
        }
        assert!(std::time::Instant::now() < until, "left running: {left:?}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// The Python that runs the repository's scripts (`WORKBOOK_PYTHON`, else
/// `python3`) when it can import `module`; `None`, the test to be skipped,
/// where it cannot, unless CI (`WORKBOOK_REQUIRE_NBFORMAT`) requires it.
pub fn python_with(module: &str, install: &str) -> Option<String> {
    let python = std::env::var("WORKBOOK_PYTHON").unwrap_or_else(|_| "python3".into());
    let has = Command::new(&python)
        .args(["-c", &format!("import {module}")])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has {
        assert!(
            std::env::var("WORKBOOK_REQUIRE_NBFORMAT").is_err(),
            "WORKBOOK_REQUIRE_NBFORMAT is set but `{python}` cannot import {module}"
        );
        eprintln!("skipped: `{python}` cannot import {module} ({install})");
        return None;
    }
    Some(python)
}
