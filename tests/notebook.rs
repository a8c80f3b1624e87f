//! Chapters as notebooks: the file written, nbformat's own validator, the
//! display side of the library, and (with `--features evcxr`) headless
//! execution through evcxr, passing and failing.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;
use workbook::{Notebook, NotebookError, Status};

mod common;
use common::{light, text, CELLS};

fn workbook(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_workbook"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("WORKBOOK_CHECK_MODE")
        .env_remove("WORKBOOK_CHAPTERS")
        .output()
        .expect("the binary runs")
}

/// nbformat's multiline text: a string or a list of lines.
fn joined(text: &Value) -> String {
    match text {
        Value::String(s) => s.clone(),
        Value::Array(lines) => lines.iter().map(|l| l.as_str().expect("a line")).collect(),
        other => panic!("not nbformat text: {other}"),
    }
}

fn source(cell: &Value) -> String {
    joined(&cell["source"])
}

/// What `text` holds between `start` and the next `end`.
fn between(text: &str, start: &str, end: &str) -> String {
    let from = text
        .find(start)
        .unwrap_or_else(|| panic!("no {start:?} in:\n{text}"))
        + start.len();
    let to = text[from..]
        .find(end)
        .unwrap_or_else(|| panic!("no {end:?} in:\n{text}"));
    text[from..from + to].to_string()
}

/// The notebooks committed beside their chapters are what `workbook
/// notebook CHAPTER -o chapters/CHAPTER.ipynb` writes today.
#[test]
fn the_committed_notebooks_are_current() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let chapters = root.join("chapters");
    let wb = workbook::Workbook::builtin().with_chapter_dirs(vec![chapters.clone()]);
    for (id, toml) in workbook::chapter::available(std::slice::from_ref(&chapters)) {
        let ch = wb.load(toml.to_str().unwrap()).unwrap();
        let options = workbook::notebook::export::ExportOptions::portable(&chapters, false);
        let nb = workbook::notebook::export::notebook(&ch, &options);
        let text = workbook::notebook::export::to_json(&nb).unwrap();
        let path = chapters.join(format!("{id}.ipynb"));
        if std::env::var_os("WORKBOOK_BLESS").is_some() {
            std::fs::write(&path, &text).unwrap();
        }
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == text,
            "{} is stale: regenerate it with `cargo run -- notebook {id} -o chapters/{id}.ipynb` \
             (or `WORKBOOK_BLESS=1 cargo test --test notebook`)",
            path.display()
        );
        assert!(
            !text.contains(root.to_str().unwrap()),
            "an absolute path in {id}.ipynb"
        );
    }
}

fn read(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("the notebook was written"))
        .expect("the notebook is JSON")
}

fn export(args: &[&str]) -> (Value, tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nb.ipynb");
    let mut all = vec!["notebook"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["-o", path.to_str().unwrap()]);
    let o = workbook(&all);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains("wrote"), "{out}");
    (read(&path), dir, path)
}

/// nbformat's reference validator, when Python has it.
fn nbformat_validate(path: &Path) -> Option<Result<(), String>> {
    let python = std::env::var("WORKBOOK_PYTHON").unwrap_or_else(|_| "python3".into());
    let has = Command::new(&python)
        .args(["-c", "import nbformat"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has {
        assert!(
            std::env::var("WORKBOOK_REQUIRE_NBFORMAT").is_err(),
            "WORKBOOK_REQUIRE_NBFORMAT is set but `{python}` cannot import nbformat"
        );
        eprintln!("skipped: `{python}` cannot import nbformat (pip install nbformat)");
        return None;
    }
    let o = Command::new(&python)
        .args([
            "-c",
            "import sys, nbformat\n\
             nb = nbformat.read(sys.argv[1], as_version=nbformat.NO_CONVERT)\n\
             nbformat.validate(nb)\n\
             print(nb.nbformat, nb.nbformat_minor)",
        ])
        .arg(path)
        .output()
        .expect("python runs");
    let (out, err) = text(&o);
    Some(if o.status.success() && out.trim() == "4 5" {
        Ok(())
    } else {
        Err(format!("{out}\n{err}"))
    })
}

#[test]
fn chapter2_exports_as_a_valid_notebook_mirroring_the_chapter() {
    let (nb, _dir, path) = export(&["chapter2", "--check"]);
    assert_eq!(nb["nbformat"], 4);
    assert_eq!(nb["nbformat_minor"], 5);
    let ks = &nb["metadata"]["kernelspec"];
    assert_eq!(ks["name"], "rust");
    assert_eq!(ks["language"], "rust");
    assert_eq!(nb["metadata"]["language_info"]["name"], "Rust");

    let cells = nb["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 2 + 2 * CELLS.len());
    assert_eq!(cells[0]["cell_type"], "markdown");
    assert!(source(&cells[0]).starts_with("# 2. Memory Optimization\n\n"));
    assert_eq!(cells[1]["cell_type"], "code");
    assert_eq!(cells[1]["id"], "setup");
    let setup = source(&cells[1]);
    // Paths relative to the notebook's folder, where the kernel starts, and
    // no binary: the notebook can be moved with the source tree.
    let folder = path.parent().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dep = between(
        &setup,
        ":dep workbook = { path = \"",
        "\", default-features = false }\n",
    );
    assert!(Path::new(&dep).is_relative(), "{setup}");
    assert_eq!(
        folder.join(&dep).canonicalize().unwrap(),
        root.canonicalize().unwrap()
    );
    let ch = between(&setup, "workbook::Notebook::new(\"", "\")");
    assert!(Path::new(&ch).is_relative(), "{setup}");
    assert_eq!(
        folder.join(&ch).canonicalize().unwrap(),
        root.join("chapters/chapter2.toml").canonicalize().unwrap()
    );
    assert!(!setup.contains(".binary("), "{setup}");
    for want in [
        ":cache 500\n",
        ":preserve_vars_on_panic 0\n",
        ".check(true);",
    ] {
        assert!(setup.contains(want), "setup lacks {want:?}:\n{setup}");
    }
    for (i, id) in CELLS.iter().enumerate() {
        let prose = &cells[2 + 2 * i];
        let code = &cells[3 + 2 * i];
        assert_eq!(prose["cell_type"], "markdown");
        assert_eq!(prose["id"], format!("{id}-prose"));
        assert!(source(prose).starts_with("## "), "{}", source(prose));
        assert_eq!(code["cell_type"], "code");
        assert_eq!(code["id"], *id);
        assert_eq!(source(code), format!("wb.run_cell(\"{id}\")"));
        assert_eq!(code["outputs"], Value::Array(vec![]));
        assert_eq!(code["execution_count"], Value::Null);
    }
    if let Some(r) = nbformat_validate(&path) {
        r.expect("nbformat validates the notebook");
    }
}

#[test]
fn without_check_the_mode_is_left_to_the_environment() {
    let (nb, _dir, _) = export(&["chapter2"]);
    let setup = source(&nb["cells"][1]);
    assert!(!setup.contains(".check("), "{setup}");
}

#[test]
fn notebook_rejects_an_unknown_chapter_with_the_choices() {
    let o = workbook(&["notebook", "no_such_chapter"]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("no_such_chapter") && err.contains("chapter2"),
        "{err}"
    );
}

fn chapter(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(name)
        .display()
        .to_string()
}

fn notebook() -> Notebook {
    Notebook::new(chapter("chapters/chapter2.toml"))
        .binary(env!("CARGO_BIN_EXE_workbook"))
        .check(true)
}

#[test]
fn a_cell_view_is_one_html_block_with_its_plots_as_inline_svg() {
    let _light = light();
    let view = notebook().run("checkpointing").expect("the cell runs");
    assert!(view.passed(), "{:?}", view.failure());
    assert_eq!(view.failure(), None);
    assert_eq!(view.cell().id, "checkpointing");
    let html = view.html();
    assert!(html.starts_with("<div class=\"workbook\"><style>"));
    assert!(view.plots().len() >= 3, "timeline, peaks and a sweep");
    assert_eq!(html.matches("<svg").count(), view.plots().len());
    assert!(!html.contains("<img"), "no PNG in a notebook");
    assert!(html.contains("check size"));
    for a in &view.cell().assertions {
        assert!(html.contains(&pulldown_escape(&a.expr)), "{}", a.expr);
    }
    // The block evcxr reads: one text/html content, whole.
    assert!(!html.contains("EVCXR_END_CONTENT"));
}

fn pulldown_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[test]
fn a_failed_assertion_is_reported_with_its_cell_and_values_and_run_cell_panics() {
    let _light = light();
    let nb = Notebook::new(chapter("tests/fixtures/notebook_fails.toml"))
        .binary(env!("CARGO_BIN_EXE_workbook"));
    let view = nb.run("wrong").expect("the cell runs");
    assert_eq!(view.cell().status, Status::Failed);
    let why = view.failure().expect("it failed");
    assert_eq!(
        why,
        "cell `wrong` failed 1 of 2 assertions: `small_params > large_params` \
         (small_params = 17802, large_params = 333834): the expression is false"
    );
    let panic = std::panic::catch_unwind(|| nb.run_cell("wrong")).expect_err("run_cell panics");
    let message = panic.downcast_ref::<String>().expect("a formatted message");
    assert_eq!(message, &why);
    assert!(nb.run_cell("first").passed());
}

#[test]
fn a_missing_binary_or_unknown_cell_is_an_error_that_says_what_to_do() {
    let _light = light();
    let err = notebook()
        .binary("/nonexistent/workbook")
        .run("footprint")
        .expect_err("no binary");
    assert!(matches!(err, NotebookError::Spawn { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("/nonexistent/workbook") && msg.contains("cargo build --release"),
        "{msg}"
    );

    let err = notebook().run("no_such_cell").expect_err("unknown cell");
    assert!(matches!(err, NotebookError::Refused { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("no_such_cell") && msg.contains("footprint"),
        "{msg}"
    );
}

#[test]
fn the_notebook_setting_decides_the_mode_not_the_kernel_environment() {
    let nb = notebook().check(false);
    let cmd = nb.command("footprint");
    let args: Vec<_> = cmd
        .get_args()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    assert!(!args.contains(&"--check".to_string()), "{args:?}");
    assert!(cmd
        .get_envs()
        .any(|(k, v)| k == "WORKBOOK_CHECK_MODE" && v.is_none()));
    let args: Vec<_> = notebook()
        .command("footprint")
        .get_args()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        args,
        [
            "run",
            &chapter("chapters/chapter2.toml"),
            "--cell",
            "footprint",
            "--format",
            "json",
            "--check"
        ]
    );
}

#[cfg(not(feature = "evcxr"))]
#[test]
fn execute_without_the_evcxr_feature_says_how_to_get_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nb.ipynb");
    let o = workbook(&[
        "notebook",
        "chapter2",
        "--execute",
        "-o",
        path.to_str().unwrap(),
    ]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--features evcxr"), "{err}");
    assert!(!path.exists(), "nothing written");
}

#[cfg(feature = "evcxr")]
mod execute {
    use super::*;

    /// Kept in the target folder, so later test runs reuse evcxr's builds.
    fn cache() -> String {
        Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join("evcxr")
            .display()
            .to_string()
    }

    fn execute(args: &[&str]) -> (Output, Value, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nb.ipynb");
        let cache = cache();
        let mut all = vec!["notebook"];
        all.extend_from_slice(args);
        all.extend_from_slice(&[
            "--execute",
            "--cache-dir",
            &cache,
            "-o",
            path.to_str().unwrap(),
        ]);
        let o = workbook(&all);
        let nb = read(&path);
        if let Some(r) = nbformat_validate(&path) {
            r.expect("nbformat validates the executed notebook");
        }
        (o, nb, dir)
    }

    fn code_cell<'a>(nb: &'a Value, id: &str) -> &'a Value {
        nb["cells"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["id"] == id)
            .unwrap_or_else(|| panic!("no cell {id}"))
    }

    fn outputs<'a>(cell: &'a Value, kind: &str) -> Vec<&'a Value> {
        cell["outputs"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|o| o["output_type"] == kind)
            .collect()
    }

    fn html(cell: &Value) -> String {
        let results = outputs(cell, "execute_result");
        assert_eq!(results.len(), 1, "{cell:#}");
        joined(&results[0]["data"]["text/html"])
    }

    #[test]
    fn chapter2_executes_at_check_size_with_every_cell_displayed() {
        let _heavy = common::heavy();
        let (o, nb, _dir) = execute(&["chapter2", "--check"]);
        let (out, err) = text(&o);
        assert!(o.status.success(), "{out}\n{err}");
        assert!(out.contains("7 code cells executed"), "{out}");
        for cell in nb["cells"].as_array().unwrap() {
            if cell["cell_type"] == "code" {
                assert!(outputs(cell, "error").is_empty(), "{cell:#}");
                assert!(cell["execution_count"].is_number(), "{cell:#}");
            }
        }
        let setup = code_cell(&nb, "setup");
        let printed = joined(&outputs(setup, "stream")[0]["text"]);
        assert_eq!(printed, "6 cells at check size\n");
        for id in CELLS {
            let h = html(code_cell(&nb, id));
            assert!(h.starts_with("<div class=\"workbook\">"), "{id}");
            assert!(h.contains(&format!("<section id=\"{id}\">")), "{id}");
            assert!(
                h.contains("<span class=\"badge passed\">passed</span>"),
                "{id}"
            );
            assert!(h.contains("check size"), "{id}");
            assert!(h.matches("<svg").count() >= 2, "{id}: timeline and peaks");
            assert!(!h.contains("class=\"bad\""), "{id}: no failed assertion");
        }
    }

    #[test]
    fn a_failing_assertion_fails_the_execution_and_names_the_cell_and_assertion() {
        let _light = light();
        let fixture = chapter("tests/fixtures/notebook_fails.toml");
        let (o, nb, _dir) = execute(&[&fixture]);
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(1), "{out}\n{err}");
        assert!(
            err.contains("error: notebook cell `wrong` failed (1 later cells not run)"),
            "{err}"
        );
        assert!(
            err.contains(
                "cell `wrong` failed 1 of 2 assertions: `small_params > large_params` \
                 (small_params = 17802, large_params = 333834): the expression is false"
            ),
            "{err}"
        );

        assert!(html(code_cell(&nb, "first")).contains("badge passed"));
        let wrong = code_cell(&nb, "wrong");
        let errors = outputs(wrong, "error");
        assert_eq!(errors.len(), 1, "{wrong:#}");
        let traceback: Vec<&str> = errors[0]["traceback"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l.as_str().unwrap())
            .collect();
        assert!(
            traceback
                .iter()
                .any(|l| l.starts_with("cell `wrong` failed 1 of 2 assertions")),
            "{traceback:?}"
        );
        // The results stay readable as text: the failed assertion is marked.
        let stdout = outputs(wrong, "stream")
            .into_iter()
            .find(|s| s["name"] == "stdout")
            .map(|s| joined(&s["text"]))
            .unwrap_or_default();
        assert!(stdout.contains("✗ small_params > large_params"), "{stdout}");
        let after = code_cell(&nb, "after");
        assert_eq!(after["outputs"], Value::Array(vec![]));
        assert_eq!(after["execution_count"], Value::Null);
    }
}
