//! Chapters as notebooks: the file written, nbformat's own validator, and
//! the display side of the library. Executing them through a real Jupyter
//! kernel is tests/kernel.rs's.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;
use workbook::{Notebook, NotebookError, Status};

mod common;
use common::{light, python_with, text, CELLS};

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
        let nb = workbook::notebook::export::notebook(&ch, wb.registry(), &options).unwrap();
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
    let python = python_with("nbformat", "pip install nbformat")?;
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
    // Its checkpointing cell runs in the kernel, measured by the interposer
    // of the "Rust (workbook)" kernel.
    let ks = &nb["metadata"]["kernelspec"];
    assert_eq!(ks["name"], "rust-workbook");
    assert_eq!(ks["display_name"], "Rust (workbook)");
    assert_eq!(ks["language"], "rust");
    assert_eq!(nb["metadata"]["language_info"]["name"], "Rust");

    let cells = nb["cells"].as_array().unwrap();
    assert_eq!(cells[0]["cell_type"], "markdown");
    assert!(source(&cells[0]).starts_with("# 2. Memory Optimization\n\n"));
    assert_eq!(cells[1]["cell_type"], "code");
    assert_eq!(cells[1]["id"], "setup");
    let setup = source(&cells[1]);
    // Paths relative to the notebook's folder, where the kernel starts, and
    // no binary: the notebook can be moved with the source tree. Each `:dep`
    // names the package in that folder.
    let folder = path.parent().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut deps = Vec::new();
    for line in setup.lines().filter(|l| l.starts_with(":dep ")) {
        let name = between(line, ":dep ", " = { path = \"");
        let dep = between(line, " = { path = \"", "\" }");
        assert!(Path::new(&dep).is_relative(), "{line}");
        let manifest = std::fs::read_to_string(folder.join(&dep).join("Cargo.toml")).unwrap();
        assert!(
            manifest.contains(&format!("name = \"{name}\"")),
            "{line} names another package"
        );
        deps.push(name);
    }
    for want in [
        "workbook",
        "workbook-checkpointing",
        "candle-checkpoint",
        "workbook-sdk",
    ] {
        assert!(deps.iter().any(|d| d == want), "no :dep {want}:\n{setup}");
    }
    let ch = between(&setup, "workbook::Live::open(\"", "\")");
    assert!(Path::new(&ch).is_relative(), "{setup}");
    assert_eq!(
        folder.join(&ch).canonicalize().unwrap(),
        root.join("chapters/chapter2.toml").canonicalize().unwrap()
    );
    assert!(!setup.contains(".binary("), "{setup}");
    for want in [":preserve_vars_on_panic 0\n", ".check(true);"] {
        assert!(setup.contains(want), "setup lacks {want:?}:\n{setup}");
    }

    // Each chapter cell: its prose, its experiment as code cells, then the
    // cell that runs it.
    let mut rest = cells[2..].iter();
    for id in CELLS.iter().filter(|id| !id.starts_with("exercise-")) {
        let prose = rest.next().unwrap();
        assert_eq!(prose["cell_type"], "markdown");
        assert_eq!(prose["id"], format!("{id}-prose"));
        assert!(source(prose).starts_with("## "), "{}", source(prose));
        let mut shown = Vec::new();
        let run = loop {
            let code = rest.next().unwrap();
            assert_eq!(code["cell_type"], "code");
            assert_eq!(code["outputs"], Value::Array(vec![]));
            assert_eq!(code["execution_count"], Value::Null);
            if code["id"] == *id {
                break code;
            }
            assert_eq!(code["id"], format!("{id}-code-{}", shown.len() + 1));
            shown.push(source(code));
        };
        // What the notebook shows is the experiment `workbook run` executes:
        // the plugin's source file, the files it `include!`s in their
        // place, without its file docs and its cell breaks.
        let src = root.join(format!("plugins/{id}/src"));
        let file = std::fs::read_to_string(src.join("experiment.rs")).unwrap();
        let file: String = file
            .lines()
            .map(|l| match workbook_sdk::notebook::included_part(l) {
                Some(part) => std::fs::read_to_string(src.join(part)).unwrap(),
                None => format!("{l}\n"),
            })
            .collect();
        let expected: Vec<&str> = file
            .lines()
            .filter(|l| !l.starts_with("//!") && l.trim() != "// notebook cell")
            .filter(|l| !l.trim().is_empty())
            .collect();
        let joined = shown.join("\n");
        let got: Vec<&str> = joined.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(got, expected, "{id}");
        assert!(shown.len() >= 2, "{id}: the imports, then the experiment");
        assert!(
            shown
                .last()
                .unwrap()
                .contains(&format!("pub fn {id}_experiment(")),
            "{id}"
        );
        let code = source(run);
        assert!(
            code.contains(&format!("Params = wb.params(\"{id}\");")),
            "{code}"
        );
        assert!(
            code.ends_with(&format!("p.clone(), {id}_experiment)")),
            "{code}"
        );
    }
    // The exercises: each one's prose, its code with the solution as a
    // `todo!()` in the cell tagged as the exercise (the solution in that
    // cell's metadata), then the cell that grades it.
    for (id, file, function, solved, plugin, entry) in [
        (
            "exercise-policy",
            "policy.rs",
            "pub fn choose_kept(",
            "for choice in",
            "PolicyExercise",
            "policy_exercise",
        ),
        (
            "exercise-fit",
            "fit.rs",
            "pub fn choose_plan(",
            "plans.sort_by_key",
            "FitExercise",
            "fit_exercise",
        ),
    ] {
        let prose = rest.next().unwrap();
        assert_eq!(prose["id"], format!("{id}-prose"));
        let mut shown = Vec::new();
        let mut exercises = Vec::new();
        let grade = loop {
            let code = rest.next().unwrap();
            if code["id"] == id {
                break source(code);
            }
            assert_eq!(code["id"], format!("{id}-code-{}", shown.len() + 1));
            match code["metadata"]["workbook"]["solution"].as_str() {
                Some(solution) => {
                    assert_eq!(code["metadata"]["tags"], serde_json::json!(["exercise"]));
                    let stub = source(code);
                    assert!(
                        stub.contains("todo!(\"exercise: replace this line with your code\")"),
                        "{stub}"
                    );
                    assert!(!solution.contains("// solution"), "{solution}");
                    exercises.push(stub);
                    shown.push(solution.to_string());
                }
                None => shown.push(source(code)),
            }
        };
        assert_eq!(exercises.len(), 1, "{id}");
        assert!(
            exercises[0].contains(function) && !exercises[0].contains(solved),
            "{}",
            exercises[0]
        );
        // With its solution, the notebook shows the file `workbook run` runs.
        let file = std::fs::read_to_string(root.join("plugins/exercises/src").join(file)).unwrap();
        let expected: Vec<&str> = file
            .lines()
            .filter(|l| !l.starts_with("//!") && !l.trim().starts_with("// notebook cell"))
            .filter(|l| !matches!(l.trim(), "// solution begin" | "// solution end"))
            .filter(|l| !l.trim().is_empty())
            .collect();
        let joined = shown.join("\n");
        let got: Vec<&str> = joined.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(got, expected, "{id}");
        assert!(
            grade.ends_with(&format!(
                "wb.grade(\"{id}\", workbook_exercises::{plugin}, p.clone(), {entry})"
            )),
            "{grade}"
        );
    }
    assert!(rest.next().is_none());
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
