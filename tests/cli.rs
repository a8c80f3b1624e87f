//! The `workbook` binary, run as a user runs it.

use std::path::PathBuf;
use std::process::{Command, Output};

mod common;
use common::{heavy, light, text, CELLS};

/// The built-in plugins, in registration order.
const PLUGINS: [&str; 17] = [
    "footprint",
    "accumulation",
    "checkpointing",
    "precision",
    "offload",
    "attention",
    "gpt_training",
    "saved_tensors",
    "layer_profile",
    "gpt_checkpointing",
    "predictors",
    "zero_stages",
    "gpt_ranks",
    "policy_exercise",
    "fit_exercise",
    "decoder_shapes",
    "decoder_step",
];

fn workbook(args: &[&str]) -> Output {
    let _light = if args.contains(&"chapter2")
        && !args.contains(&"--cell")
        && args.first() == Some(&"run")
    {
        None
    } else {
        Some(light())
    };
    Command::new(env!("CARGO_BIN_EXE_workbook"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("WORKBOOK_CHECK_MODE")
        .env_remove("WORKBOOK_CHAPTERS")
        .output()
        .expect("the binary runs")
}

fn fixture(name: &str) -> String {
    PathBuf::from("tests/fixtures")
        .join(name)
        .display()
        .to_string()
}

/// Runs a bad chapter and returns stderr, asserting exit code 2 and no panic.
fn bad_input(args: &[&str]) -> String {
    let o = workbook(args);
    let (_, err) = text(&o);
    assert_eq!(
        o.status.code(),
        Some(2),
        "exit code of {args:?}; stderr: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    err
}

#[test]
fn chapter2_check_mode_passes_with_the_notebooks_values() {
    let _machine = heavy();
    let o = workbook(&["run", "chapter2", "--check"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout:\n{out}\nstderr:\n{err}");
    for line in [
        "> small params: 17802",
        "> large params: 333834",
        "> micro-batches: 4",
    ] {
        assert!(out.contains(line), "missing `{line}` in:\n{out}");
    }
    let last = out.lines().last().unwrap_or_default();
    let (passed, failed) = last
        .split_once(" passed, ")
        .map(|(p, f)| (p.to_string(), f.to_string()))
        .unwrap_or_else(|| panic!("no closing line: {last}"));
    assert!(passed.parse::<usize>().unwrap() >= 50, "{last}");
    // Claims that only hold at scale are checked at full size, skipped here.
    let skipped = out.matches("(skipped: checked at full size only)").count();
    assert!(skipped > 0, "{out}");
    assert_eq!(failed, format!("0 failed, {skipped} skipped"));
    assert!(!out.contains('✗'), "{out}");
}

#[test]
fn footprint_at_full_size_measures_the_analytic_state() {
    // The first backward on a fresh thread made gemm allocate its packing
    // buffer inside the measurement (1 MiB counted as gradients): the thread
    // that runs cells must be warmed up itself. Full size shows it.
    let o = workbook(&["run", "chapter2", "--cell", "footprint"]);
    let (out, _) = text(&o);
    assert!(o.status.success(), "{out}");
    assert!(out.contains("✓ abs(state_ratio_f32 - 1) < 0.05"), "{out}");
}

#[test]
fn check_mode_is_also_set_by_the_environment() {
    let _machine = light();
    let o = Command::new(env!("CARGO_BIN_EXE_workbook"))
        .args(["run", "chapter2", "--cell", "footprint", "--format", "json"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("WORKBOOK_CHECK_MODE", "1")
        .output()
        .unwrap();
    assert!(o.status.success());
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["mode"], "check");
    // The check table sets batch = 8 for this cell.
    assert_eq!(v["cells"][0]["params"]["batch"], 8);
}

#[test]
fn json_output_carries_the_contract() {
    let o = workbook(&[
        "run",
        "chapter2",
        "--check",
        "--format",
        "json",
        "--cell",
        "accumulation",
    ]);
    let (_, err) = text(&o);
    assert!(o.status.success(), "{err}");
    // "N passed, 0 failed", and ", N skipped" when full-size assertions wait.
    let summary = err.trim_end().lines().last().unwrap_or_default();
    let counts: Vec<&str> = summary.split(", ").collect();
    assert!(
        counts.len() >= 2 && counts[0].ends_with(" passed") && counts[1] == "0 failed",
        "summary on stderr: {err}"
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("stdout is only JSON");
    assert_eq!(v["format_version"], 1);
    assert_eq!(v["workbook_version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(v["chapter"]["id"], "chapter2");
    assert_eq!(v["device"], "cpu");
    assert_eq!(v["meter"], "cpu-allocator");
    let cells = v["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 1, "--cell selects one cell");
    let c = &cells[0];
    assert_eq!(c["id"], "accumulation");
    assert_eq!(c["plugin"], "accumulation");
    assert_eq!(c["status"], "passed");
    assert_eq!(c["metrics"]["micro_batches"], 4.0);
    let a = &c["assertions"][0];
    assert_eq!(a["expr"], "micro_batches == 4");
    assert_eq!(a["passed"], true);
    assert_eq!(a["values"]["micro_batches"], 4.0);
    let mem = &c["memory"];
    assert!(mem["peak_bytes"].as_u64().unwrap() > 0);
    for cat in [
        "parameters",
        "gradients",
        "optimizer_state",
        "activations",
        "inputs",
        "other",
    ] {
        assert!(mem["peak_by_category"][cat].is_u64(), "{cat}");
        assert!(mem["current_by_category"][cat].is_u64(), "{cat}");
    }
    let region = &mem["regions"][0];
    assert!(region["name"].is_string());
    let labels: Vec<&str> = region["marks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["label"].as_str().unwrap())
        .collect();
    assert!(
        labels.contains(&"after forward") && labels.contains(&"after backward"),
        "{labels:?}"
    );
    assert!(
        c["figures"][0]["series"][0]["points"]
            .as_array()
            .unwrap()
            .len()
            >= 2
    );
    assert_eq!(v["summary"]["failed"], 0);
}

#[test]
fn failed_assertions_fail_the_run_and_list_the_metrics_produced() {
    let o = workbook(&["run", &fixture("failing.toml")]);
    let (out, _) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(out.contains("✗ small_params > large_params"), "{out}");
    assert!(out.contains("metric `state_measured_f16` was not produced; the cell produced: small_params, large_params,"), "{out}");
    // The second cell still ran.
    assert!(out.contains("✓ small_params == 17802"), "{out}");
    assert_eq!(out.lines().last(), Some("2 passed, 2 failed"));
}

#[test]
fn an_assertion_for_another_device_is_skipped_in_a_worker_run_and_says_why() {
    let o = workbook(&["run", &fixture("on_device.toml"), "--device", "cpu"]);
    let (out, _) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}");
    assert!(out.contains("✓ small_params == 17802"), "{out}");
    assert!(
        out.contains("(skipped: checked on a CUDA GPU only; this cell ran on cpu)"),
        "{out}"
    );
    assert_eq!(out.lines().last(), Some("2 passed, 0 failed, 1 skipped"));
}

#[test]
fn fail_fast_skips_the_cells_after_a_failure() {
    let o = workbook(&["run", &fixture("failing.toml"), "--fail-fast"]);
    let (out, _) = text(&o);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        out.contains("  (not run: an earlier cell failed and --fail-fast is set)\n"),
        "{out}"
    );
    assert_eq!(out.lines().last(), Some("1 passed, 2 failed, 1 skipped"));
}

#[test]
fn malformed_toml_names_file_line_and_column() {
    let err = bad_input(&["run", &fixture("malformed.toml")]);
    assert!(err.contains("tests/fixtures/malformed.toml:5:"), "{err}");
    assert!(
        err.contains("invalid table header") || err.contains("expected"),
        "{err}"
    );
}

#[test]
fn unknown_plugin_lists_the_registered_ones() {
    let err = bad_input(&["run", &fixture("unknown_plugin.toml")]);
    let expected = format!(
        "unknown_plugin.toml:8:10: cell `first`: unknown plugin `footprnt`; did you mean \
         `footprint`?; registered plugins: {} (an external plugin is an executable \
         `workbook-plugin-NAME` on PATH or in a `plugins` folder beside the chapter)\n",
        PLUGINS.join(", ")
    );
    assert!(err.contains(&expected), "{err}");
}

#[test]
fn unknown_parameter_names_cell_field_and_valid_fields() {
    let err = bad_input(&["validate", &fixture("unknown_param.toml")]);
    assert!(err.contains("unknown_param.toml:11:1: cell `sizes`: parameter `bacth`: unknown field `bacth`, expected one of"), "{err}");
    assert!(err.contains("`batch`"), "{err}");
}

#[test]
fn mistyped_parameter_names_cell_field_and_expected_type() {
    let err = bad_input(&["validate", &fixture("mistyped_param.toml")]);
    assert!(err.contains("mistyped_param.toml:12:1: cell `sizes`: check parameter `batch`: invalid type: string \"eight\", expected usize"), "{err}");
}

#[test]
fn duplicate_cell_id_points_at_both() {
    let err = bad_input(&["validate", &fixture("duplicate.toml")]);
    assert!(
        err.contains(
            "duplicate.toml:11:6: cell `sizes`: duplicate cell id; first defined at line 6"
        ),
        "{err}"
    );
}

#[test]
fn assertion_that_does_not_parse_is_located() {
    let err = bad_input(&["validate", &fixture("bad_assertion.toml")]);
    assert!(
        err.contains(
            "bad_assertion.toml:11:3: cell `sizes`: assertion `large_params > ` does not parse"
        ),
        "{err}"
    );
}

#[test]
fn newer_format_version_asks_for_an_upgrade() {
    let err = bad_input(&["validate", &fixture("future_version.toml")]);
    assert!(err.contains("future_version.toml:1:18: format_version 7 is not supported; this workbook reads format_version 1"), "{err}");
}

#[test]
fn unknown_key_in_a_cell_lists_the_valid_keys() {
    let err = bad_input(&["validate", &fixture("unknown_field.toml")]);
    assert!(
        err.contains("unknown_field.toml:9:1: unknown field `asertions`, expected one of"),
        "{err}"
    );
    assert!(err.contains("`assertions`"), "{err}");
}

#[test]
fn chapter_not_found_lists_the_available_chapters() {
    let err = bad_input(&["run", "chapter9"]);
    assert!(err.contains("chapter `chapter9` not found"), "{err}");
    assert!(err.contains("available chapters: chapter2"), "{err}");
}

#[test]
fn unknown_cell_lists_the_chapters_cells() {
    let err = bad_input(&["run", "chapter2", "--cell", "nope"]);
    let expected = format!(
        "chapter `chapter2` has no cell `nope`; its cells: {}\n",
        CELLS.join(", ")
    );
    assert!(err.contains(&expected), "{err}");
}

#[test]
fn a_refused_run_leaves_the_earlier_report_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let page = dir.path().join("report.html");
    std::fs::write(&page, "the earlier report").unwrap();
    let out = dir.path().to_str().unwrap();
    let mut refused = vec![vec![
        "run",
        "chapter2",
        "--out",
        out,
        "--cell",
        "chekpointing",
    ]];
    if !cfg!(feature = "cuda") {
        refused.push(vec!["run", "chapter2", "--out", out, "--device", "cuda"]);
    }
    for args in refused {
        bad_input(&args);
        assert_eq!(
            std::fs::read_to_string(&page).unwrap(),
            "the earlier report",
            "{args:?}"
        );
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_on_a_cpu_build_says_how_to_get_it() {
    let err = bad_input(&["run", "chapter2", "--check", "--device", "cuda"]);
    assert!(err.contains("built without CUDA support"), "{err}");
    assert!(err.contains("--features cuda"), "{err}");
}

#[test]
fn list_and_validate_describe_chapter2() {
    let o = workbook(&["list"]);
    let (out, _) = text(&o);
    assert!(o.status.success());
    assert!(out.contains("chapter2  2. Memory Optimization"), "{out}");
    for cell in CELLS {
        assert!(out.contains(&format!("  {cell}")), "{out}");
    }
    // Every column starts where the others of its kind do, over all the
    // chapters (a cell's plugin, its title) and all the plugins.
    let (chapters, plugins) = out.split_once("\nplugins:\n").unwrap();
    let starts = |line: &str| -> Vec<usize> {
        let mut starts = Vec::new();
        let mut gap = 0;
        for (i, ch) in line.char_indices() {
            if ch == ' ' {
                gap += 1;
            } else {
                if gap >= 2 && i > gap {
                    starts.push(i);
                }
                gap = 0;
            }
        }
        starts
    };
    let cell_columns: std::collections::BTreeSet<Vec<usize>> = chapters
        .lines()
        .filter(|l| l.starts_with("  "))
        .map(|l| starts(l).into_iter().take(2).collect())
        .collect();
    assert_eq!(cell_columns.len(), 1, "{cell_columns:?} in:\n{out}");
    let plugin_columns: std::collections::BTreeSet<usize> =
        plugins.lines().map(|l| starts(l)[0]).collect();
    assert_eq!(plugin_columns.len(), 1, "{plugin_columns:?} in:\n{out}");
    let o = workbook(&["validate", "chapter2"]);
    let (out, _) = text(&o);
    assert!(o.status.success());
    assert!(
        out.contains(&format!("{} cells", CELLS.len())) && out.contains("valid"),
        "{out}"
    );
}

/// Chapter 4 in a build without MPI: each cell is reported as not run, the
/// reason and what to install said once under them, and the run passes;
/// `--require-all` makes each a failure.
#[cfg(not(feature = "mpi"))]
#[test]
fn chapter4_without_mpi_is_not_run_and_says_what_to_install_once() {
    let why = "this runs MPI ranks, and this workbook was built without the `mpi` feature: \
               install Open MPI and libclang (Debian and Ubuntu: apt install openmpi-bin \
               libopenmpi-dev libclang-dev) and build with `--features mpi`";
    let o = workbook(&["run", "chapter4", "--check"]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(
        out.matches(&format!("  (not run: {why})\n")).count(),
        3,
        "{out}"
    );
    assert_eq!(
        out.matches(why).count(),
        4,
        "each cell and the line under them, nothing else:\n{out}"
    );
    assert!(
        out.contains(&format!(
            "\nnot run (cells zero, zero_mixed, gpt_ranks): {why}\n"
        )),
        "{out}"
    );
    let last = out.lines().last().unwrap();
    assert!(
        last.starts_with("0 passed, 0 failed, ") && last.ends_with(" skipped"),
        "{out}"
    );
    assert!(!out.contains("= ?") && !out.contains("1 ranks"), "{out}");

    let o = workbook(&[
        "run",
        "chapter4",
        "--check",
        "--require-all",
        "--cell",
        "zero",
    ]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "stdout:\n{out}\nstderr:\n{err}");
    assert!(
        out.contains(&format!(
            "ERROR: this build cannot run it, and --require-all is set: {why}"
        )),
        "{out}"
    );
}
