//! Each cell in a worker process of its own: time limits, crashes, memory
//! caps and interruptions end one cell, and the others' results are kept.

use std::path::Path;
use std::process::{Command, Output, Stdio};

mod common;
use common::{light, text};

fn workbook() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_workbook"));
    c.current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("WORKBOOK_CHECK_MODE")
        .env_remove("WORKBOOK_CHAPTERS")
        .env_remove("RUST_BACKTRACE");
    c
}

fn run(args: &[&str]) -> Output {
    let _light = light();
    workbook().args(args).output().expect("the binary runs")
}

fn report(o: &Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is the JSON report ({e}); stderr: {}",
            String::from_utf8_lossy(&o.stderr)
        )
    })
}

fn cell<'a>(r: &'a serde_json::Value, id: &str) -> &'a serde_json::Value {
    r["cells"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == id)
        .unwrap_or_else(|| panic!("cell {id} in the report"))
}

#[test]
fn a_cell_past_its_time_limit_is_stopped_and_the_others_are_kept() {
    let start = std::time::Instant::now();
    let o = run(&["run", "tests/fixtures/time_limit.toml", "--format", "json"]);
    let elapsed = start.elapsed().as_secs_f64();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o).1);
    let r = report(&o);
    assert_eq!(cell(&r, "footprint")["status"], "passed");
    let slow = cell(&r, "slow");
    assert_eq!(slow["status"], "error");
    assert_eq!(
        slow["error"],
        "stopped at the time limit of 1 s (set `timeout` in the cell, or `--timeout SECONDS`)"
    );
    // Full-size checkpointing takes far longer than the limit.
    assert!(elapsed < 30.0, "the run took {elapsed} s");
    // The command line's limit overrides the chapter's.
    let o = run(&[
        "run",
        "tests/fixtures/time_limit.toml",
        "--format",
        "json",
        "--cell",
        "slow",
        "--timeout",
        "2",
    ]);
    assert_eq!(
        cell(&report(&o), "slow")["error"],
        "stopped at the time limit of 2 s (set `timeout` in the cell, or `--timeout SECONDS`)"
    );
}

#[test]
fn a_cell_that_needs_terabytes_is_refused_before_it_runs_and_the_others_pass() {
    let o = run(&["run", "tests/fixtures/huge.toml", "--format", "json"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o).1);
    let r = report(&o);
    assert_eq!(cell(&r, "footprint")["status"], "passed");
    assert_eq!(cell(&r, "again")["status"], "passed");
    let huge = cell(&r, "attention");
    assert_eq!(huge["status"], "error");
    let error = huge["error"].as_str().unwrap();
    assert!(
        error.starts_with(
            "refused before running: it needs at least 3.6 TiB (the f32 scores of naive \
             attention, 4 × 500000²), more than the "
        ),
        "{error}"
    );
    assert!(
        error.ends_with("a cell may hold here (`--max-memory`)"),
        "{error}"
    );
    assert_eq!(
        huge["printed"].as_array().unwrap().len(),
        0,
        "it did not run"
    );
    // With a cap above the floor, the cell is no longer refused up front.
    let o = run(&[
        "run",
        "tests/fixtures/huge.toml",
        "--format",
        "json",
        "--cell",
        "footprint",
        "--max-memory",
        "1TiB",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o).1);
}

#[test]
fn a_gpt_cell_whose_weights_pass_the_cap_is_refused_before_it_runs() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("wide_gpt.toml");
    std::fs::write(
        &f,
        "format_version = 1\nid = \"wide_gpt\"\ntitle = \"wide\"\n\n\
         [[cells]]\nid = \"wide\"\ntitle = \"wide\"\nplugin = \"gpt_training\"\n\
         [cells.params]\nbatch = 16\n\
         [cells.params.model]\nlayers = 4\nhidden = 4096\nheads = 4\nseq = 64\n\
         vocab = 128\nattention = \"tiled\"\nlean = true\n",
    )
    .unwrap();
    let o = run(&[
        "run",
        f.to_str().unwrap(),
        "--format",
        "json",
        "--max-memory",
        "1GiB",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o).1);
    let r = report(&o);
    let wide = cell(&r, "wide");
    assert_eq!(wide["status"], "error");
    // 4·(12·4096² + 13·4096) + 4096·128 + 64·4096 + 2·4096 weights and
    // 16 × 64 × 128 logits, in f32.
    assert_eq!(
        wide["error"],
        "refused before running: it needs at least 3.0 GiB (the 806313984 weights and the 16 × \
         64 × 128 logits of a step, 4 bytes each), more than the 1.0 GiB a cell may hold here \
         (`--max-memory`)"
    );
    assert_eq!(
        wide["printed"].as_array().unwrap().len(),
        0,
        "it did not run"
    );
}

#[test]
fn an_attention_sweep_of_one_length_records_no_growth_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("one_length.toml");
    std::fs::write(
        &f,
        "format_version = 1\nid = \"one_length\"\ntitle = \"one\"\n\n\
         [[cells]]\nid = \"attention\"\ntitle = \"attention\"\nplugin = \"attention\"\n\
         assertions = [\"peak_ratio_naive_tiled > 1\"]\n\
         [cells.params]\nheads = 2\nhead_dim = 16\nlengths = [64]\nq_block = 32\n\
         k_block = 32\ncheck_length = 32\nrepeats = 1\n",
    )
    .unwrap();
    let o = run(&["run", f.to_str().unwrap(), "--format", "json"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o).1);
    let r = report(&o);
    let one = cell(&r, "attention");
    let metrics = one["metrics"].as_object().unwrap();
    assert!(metrics.contains_key("peak_naive"), "{one}");
    assert!(!metrics.keys().any(|k| k.starts_with("growth_")), "{one}");
    assert!(
        one["printed"].as_array().unwrap().iter().any(|l| l
            == "no growth_* metrics: the sweep's first and last lengths are both 64, \
                 and how a peak grows with N needs two"),
        "{one}"
    );
}

#[test]
fn a_cell_that_passes_the_memory_cap_while_it_runs_fails_alone() {
    let o = run(&[
        "run",
        "tests/fixtures/over_cap.toml",
        "--format",
        "json",
        "--max-memory",
        "8GiB",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o).1);
    let r = report(&o);
    assert_eq!(cell(&r, "footprint")["status"], "passed");
    assert_eq!(cell(&r, "again")["status"], "passed");
    let over = cell(&r, "attention");
    assert_eq!(over["status"], "error");
    let error = over["error"].as_str().unwrap();
    assert!(
        error.starts_with("out of memory: the cell's worker process aborted (SIGABRT)"),
        "{error}"
    );
    assert!(error.contains("memory allocation of"), "{error}");
    assert!(
        error.ends_with("a cell may hold at most 8.0 GiB at once here (`--max-memory`)"),
        "{error}"
    );
    // What the cell measured before it ran out is kept.
    assert!(
        over["metrics"]["out_diff_tiled"].as_f64().unwrap() < 1e-5,
        "{over}"
    );
    assert_eq!(r["summary"]["cells_errored"], 1);
}

#[test]
fn a_bad_memory_limit_or_time_limit_is_refused() {
    for (args, says) in [
        (vec!["--max-memory", "lots"], "`lots` is not a size"),
        (
            vec!["--max-memory", "0"],
            "the memory limit must be above 0 bytes",
        ),
        (
            vec!["--timeout", "0"],
            "a time limit is a number of seconds from 0.001 (a millisecond) to 604800 (a week)",
        ),
        (
            vec!["--timeout", "1e-300"],
            "a time limit is a number of seconds from 0.001 (a millisecond)",
        ),
        (
            vec!["--timeout", "soon"],
            "`soon` is not a number of seconds",
        ),
    ] {
        let mut all = vec!["run", "chapter2", "--check"];
        all.extend(args);
        let o = run(&all);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{all:?}: {err}");
        assert!(err.contains(says), "{all:?}: {err}");
    }
    let o = run(&["validate", "tests/fixtures/bad_timeout.toml"]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("bad_timeout.toml:9:11: cell `footprint`: `timeout` is 0; a time limit"),
        "{err}"
    );
}

#[test]
fn an_unwritable_report_folder_is_found_before_any_cell_runs() {
    let o = run(&[
        "run",
        "chapter2",
        "--check",
        "--out",
        "/proc/workbook-report",
    ]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("cannot create the report folder /proc/workbook-report"),
        "{err}"
    );
    assert!(out.is_empty(), "no cell ran: {out}");
}

#[test]
fn an_earlier_reports_files_are_removed_and_the_rest_is_left() {
    let dir = tempfile::tempdir().unwrap();
    let plots = dir.path().join("plots");
    std::fs::create_dir_all(&plots).unwrap();
    std::fs::write(plots.join("gone-stale.svg"), "<svg/>").unwrap();
    std::fs::write(dir.path().join("notes.txt"), "mine").unwrap();
    let o = run(&[
        "run",
        "chapter2",
        "--check",
        "--cell",
        "footprint",
        "--out",
        dir.path().to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o).1);
    assert!(!plots.join("gone-stale.svg").exists());
    assert!(dir.path().join("notes.txt").exists());
    let page = std::fs::read_to_string(dir.path().join("report.html")).unwrap();
    assert!(!page.contains("This report is incomplete"));
}

#[test]
fn output_that_cannot_be_written_is_an_error_not_a_panic_or_a_success() {
    let _light = light();
    let full = std::fs::File::create("/dev/full");
    let Ok(full) = full else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let notebook = dir.path().join("chapter2.ipynb");
    for args in [
        vec!["validate", "chapter2"],
        vec!["list"],
        vec!["notebook", "chapter2", "-o", notebook.to_str().unwrap()],
        vec!["run", "chapter2", "--check", "--cell", "footprint"],
        vec![
            "run",
            "chapter2",
            "--check",
            "--cell",
            "footprint",
            "--format",
            "json",
        ],
    ] {
        let o = workbook()
            .args(&args)
            .stdout(full.try_clone().unwrap())
            .output()
            .unwrap();
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains("cannot write to standard output"),
            "{args:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        // Said once, not twice.
        assert_eq!(err.matches("No space left on device").count(), 1, "{err}");
    }
}

#[test]
fn ctrl_c_stops_the_run_and_keeps_a_report_marked_incomplete() {
    let _light = light();
    let dir = tempfile::tempdir().unwrap();
    let child = workbook()
        .args([
            "run",
            "chapter2",
            "--cell",
            "footprint",
            "--cell",
            "checkpointing",
            "--cell",
            "attention",
            "--out",
            dir.path().to_str().unwrap(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Footprint finishes in well under a second; full-size checkpointing
    // runs for many.
    let page = dir.path().join("report.html");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !page.exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    std::thread::sleep(std::time::Duration::from_millis(500));
    // SAFETY: kill(2) on our own child's pid.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGINT);
    }
    let o = child.wait_with_output().unwrap();
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(130), "{err}");
    assert!(
        out.contains("incomplete: the run was stopped after 2 of 3 cells"),
        "{out}"
    );
    assert!(err.contains("interrupted: 2 of 3 cells ran"), "{err}");
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(
        html.contains("This report is incomplete"),
        "the page says so"
    );
    assert!(
        html.contains("interrupted: the run was stopped (Ctrl-C) while this cell ran"),
        "the cell that was running says why"
    );
    assert!(Path::new(&dir.path().join("plots")).is_dir());
}

#[test]
fn a_worker_of_another_protocol_version_is_named() {
    let _light = light();
    let mut child = workbook()
        .arg("worker")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(br#"{"protocol": 99, "request": "run", "plugin": "footprint", "params": {}, "check": true, "device": "cpu"}"#)
        .unwrap();
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        "{\"type\":\"fatal\",\"message\":\"the runner speaks protocol version 99; this process \
         speaks version 3\"}\n"
    );
}

/// The worker processes of `parent`.
fn children(parent: u32) -> Vec<u32> {
    let path = format!("/proc/{parent}/task/{parent}/children");
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

#[test]
fn a_worker_killed_by_a_signal_is_that_cells_error_and_the_run_goes_on() {
    let _light = light();
    let child = workbook()
        .args(["run", "tests/fixtures/killed.toml", "--format", "json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Full-size checkpointing runs for many seconds: its worker is there.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let worker = loop {
        if let Some(&w) = children(child.id()).first() {
            break w;
        }
        assert!(std::time::Instant::now() < deadline, "no worker appeared");
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    std::thread::sleep(std::time::Duration::from_millis(1500));
    // SAFETY: kill(2) on the worker the test's own child started.
    unsafe {
        libc::kill(worker as libc::pid_t, libc::SIGKILL);
    }
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o).1);
    let r = report(&o);
    let killed = cell(&r, "checkpointing");
    assert_eq!(killed["status"], "error");
    assert!(
        killed["error"].as_str().unwrap().starts_with(
            "the cell's worker process was killed by SIGKILL (the kernel's out-of-memory \
             killer does this when memory runs out) before the cell ended"
        ),
        "{killed}"
    );
    // What it printed before is kept, and the next cell ran.
    assert!(
        !killed["printed"].as_array().unwrap().is_empty(),
        "{killed}"
    );
    assert_eq!(cell(&r, "footprint")["status"], "passed");
}

/// `v` without its null values, at any depth.
fn drop_nulls(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(o) => {
            o.retain(|_, x| !x.is_null());
            o.values_mut().for_each(drop_nulls);
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(drop_nulls),
        _ => {}
    }
}

#[test]
fn each_memory_floor_is_below_what_its_cell_measured() {
    // A floor above the real peak would refuse cells that fit: at check size
    // each built-in plugin's floor must not exceed its cell's measured peak,
    // chapter 2's techniques and chapter 3's GPT cells.
    let _heavy = common::heavy();
    let registry = workbook::Registry::builtin();
    let mut without: Vec<String> = Vec::new();
    for chapter in ["chapter2", "chapter3"] {
        let o = workbook()
            .args(["run", chapter, "--check", "--format", "json"])
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(0), "{}", text(&o).1);
        let r = report(&o);
        for c in r["cells"].as_array().unwrap() {
            let plugin = registry.get(c["plugin"].as_str().unwrap()).unwrap();
            // The report writes an absent option as null, which TOML has not.
            let mut params = c["params"].clone();
            drop_nulls(&mut params);
            let params: toml::Table = serde_json::from_value(params).unwrap();
            let Some((floor, what)) = plugin.memory_floor_of(&params) else {
                without.push(c["plugin"].to_string());
                continue;
            };
            let memory = &c["memory"];
            let peak =
                memory["peak_bytes"].as_u64().unwrap() - memory["baseline_bytes"].as_u64().unwrap();
            assert!(
                floor <= peak,
                "{chapter}, cell {}: floor {floor} ({what}) above its measured peak {peak}",
                c["id"]
            );
        }
    }
    assert!(without.is_empty(), "without a floor: {without:?}");
}
