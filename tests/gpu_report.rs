//! `scripts/gpu_report.py`, the GPU run's report, on results a card could
//! give: metrics that are NaN or infinite (written as strings), a GPT recipe
//! whose plan failed, a step that wrote no file and one whose file is not
//! what the report expects. Each costs its own row or section, never the
//! report.

use std::fs;
use std::path::Path;
use std::process::Command;

mod common;
use common::python_with;

fn calibration(recipe: &str, peaks: [u64; 3], seconds: [f64; 3]) -> String {
    format!(
        r#"{{"plan": {{"calibrations": [{{"recipe": "{recipe}", "checkpointed": false,
            "batches": [1, 2, 4], "peaks": {peaks:?}, "seconds": {seconds:?}}}]}}}}"#
    )
}

fn results(dir: &Path) {
    let write = |name: &str, text: &str| fs::write(dir.join(name), text).unwrap();
    write(
        "summary.tsv",
        "step\tstatus\tseconds\tlimit\nchapter2\tran; assertions failed (see its report)\t20.1\t90\n\
         gpt\tfailed (1)\t9.0\t60\n",
    );
    write("info.out", "NVIDIA H200, 143771 MiB, 580.159.04\n");
    write(
        "meter.out",
        "running 3 tests\ntest a ... ok\ntest b ... FAILED\n\ntest result: FAILED. 2 passed; 1 failed\n",
    );
    write(
        "meter.err",
        "thread 'b' panicked at tests/cuda.rs:10:5:\nboom\n",
    );
    write(
        "chapter2.json",
        r#"{"workbook_version": "0.1.0", "device": "cuda:0", "meter": "cuda-pool", "mode": "full",
            "cells": [{"id": "attention", "status": "failed",
              "metrics": {"peak_naive": "NaN", "time_ratio_tiled_naive": "inf",
                          "peak_tiled": 2097152, "time_tiled": 0.002},
              "assertions": [{"expr": "time_ratio_tiled_naive < 1", "passed": false}]}]}"#,
    );
    write(
        "torch-chapter2.json",
        r#"{"torch": "2.11.0", "device": "NVIDIA H200", "mode": "full",
            "metrics": {"attention": {"peak_naive": 4194304, "time_ratio_tiled_naive": 0.5,
                                      "peak_tiled": 1048576, "time_tiled": "-inf"}}}"#,
    );
    // The lean recipe measured, the tiled one cut off mid-write, the others
    // never written (their processes failed before printing).
    write(
        "gpt-f32-lean.json",
        &calibration("lean", [1 << 20, 2 << 20, 4 << 20], [0.1, 0.2, 0.4]),
    );
    write("gpt-f32-tiled.json", r#"{"plan": {"calibrations": [{"reci"#);
    write(
        "torch-gpt-f32.json",
        r#"{"torch": "2.11.0", "device": "NVIDIA H200",
            "config": {"batch": 4, "layers": 4, "hidden": 256, "heads": 4, "seq": 256, "vocab": 96},
            "metrics": {"peak_materialized": 2097152, "time_materialized": 0.2, "peak_sdpa": 1048576}}"#,
    );
    // Not the shape `plan --verify --json` writes.
    write("plan-verify.json", r#"{"plan": {}}"#);
}

#[test]
fn a_run_with_non_finite_metrics_and_failed_steps_still_gets_its_whole_report() {
    // The standard library's json: any Python 3.
    let Some(python) = python_with("json", "install Python 3") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    results(dir.path());
    let out = Command::new(python)
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/gpu_report.py"))
        .arg(dir.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}\n{text}");
    let lines: Vec<&str> = text.lines().collect();
    let has = |line: &str| {
        assert!(
            lines.contains(&line),
            "no line\n  {line}\nin the report:\n{text}"
        )
    };
    // NaN and the infinities: shown as such, and no ratio made of them.
    has("| attention | peak_naive | n/a | 4.00 MiB | n/a |");
    has("| attention | time_ratio_tiled_naive | inf | 0.5 | n/a |");
    has("| attention | peak_tiled | 2.00 MiB | 1.00 MiB | 2.00 |");
    has("| attention | time_tiled | 2.00 ms | -inf | n/a |");
    has("| chapter2 | attention | failed | `time_ratio_tiled_naive < 1` |  |");
    has("| chapter3 | - | not run or no report (see summary.tsv) |  |  |");
    // The meter's failure is named, with where it panicked.
    has("test b ... FAILED");
    has("thread 'b' panicked at tests/cuda.rs:10:5:");
    // One GPT recipe measured beside PyTorch; the others say they were not.
    has("| lean | materialized | 4.00 MiB | 2.00 MiB | 2.00 | 400.00 ms | 200.00 ms | 2.00 |");
    has("| tiled | sdpa | not measured |  |  |  |  |  |");
    has("| candle | materialized | not measured |  |  |  |  |  |");
    has("Not measured in bf16: the workbook's result is missing (see summary.tsv).");
    // A file of another shape costs its section only, which says so.
    has("## The plan, verified on the card");
    has("Could not be read: KeyError: 'chosen'");
}
