//! External plugins as their authors make them: `workbook new-plugin`
//! outside the workspace, built with cargo, put on PATH, and used by the
//! stock binary; and programs that break the protocol, refused with a reason.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;
use common::{heavy, listed_plugin, text};

fn workbook(args: &[&str], path: &str, cwd: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_workbook"))
        .args(args)
        .current_dir(cwd)
        .env("PATH", path)
        .env_remove("WORKBOOK_CHECK_MODE")
        .env_remove("WORKBOOK_CHAPTERS")
        .output()
        .expect("the binary runs")
}

fn path_with(dir: &Path) -> String {
    let mut dirs = vec![dir.to_path_buf()];
    dirs.extend(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    ));
    std::env::join_paths(dirs).unwrap().into_string().unwrap()
}

/// Where the generated crate builds: beside this workspace's own outputs
/// (which stay locked while its tests run), kept between runs.
fn plugin_target() -> PathBuf {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_workbook"));
    // <target>/<profile>/workbook
    exe.parent()
        .and_then(Path::parent)
        .map(|t| t.join("external-plugin-test"))
        .expect("the binary lies in a target folder")
}

fn cargo(args: &[&str], dir: &Path) {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let o = Command::new(cargo)
        .args(args)
        .current_dir(dir)
        .env("CARGO_TARGET_DIR", plugin_target())
        .env_remove("RUSTFLAGS")
        .output()
        .expect("cargo runs");
    let (out, err) = text(&o);
    assert!(o.status.success(), "cargo {args:?} failed:\n{out}\n{err}");
}

#[test]
fn a_new_plugin_builds_runs_and_is_measured_like_a_built_in_one() {
    let _machine = heavy();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    let o = workbook(
        &["new-plugin", "demo", "--path", dir.to_str().unwrap()],
        &std::env::var("PATH").unwrap_or_default(),
        tmp.path(),
    );
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(out.contains("cargo build"), "{out}");
    let export = out
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("export PATH="))
        .unwrap_or_else(|| panic!("no PATH line in the next steps:\n{out}"))
        .to_string();

    // A panic and an abort on cue, to show each is its cell's error alone,
    // and a `print!` that must not garble the protocol's next line (the
    // region's).
    let lib = dir.join("src/lib.rs");
    let code = std::fs::read_to_string(&lib).unwrap();
    let cue = "let elements = usize::try_from(p.elements)?;";
    assert!(code.contains(cue), "the template's run changed: {code}");
    std::fs::write(
        &lib,
        code.replace(
            cue,
            &format!(
                "print!(\"a stray print, no newline\");\n        \
                 if p.elements == 13 {{ panic!(\"thirteen is unlucky\") }}\n        \
                 if p.elements == 17 {{ std::process::abort() }}\n        {cue}"
            ),
        ),
    )
    .unwrap();
    cargo(&["test", "--quiet"], &dir);
    cargo(&["build", "--quiet"], &dir);
    let bin = plugin_target().join("debug");
    assert!(bin.join("workbook-plugin-demo").is_file());
    // The printed PATH line finds what `cargo build` built, in the target
    // folder cargo was told to use.
    let found = Command::new("bash")
        .arg("-c")
        .arg(format!("{export}\ncommand -v workbook-plugin-demo"))
        .current_dir(&dir)
        .env("CARGO_TARGET_DIR", plugin_target())
        .output()
        .expect("bash runs");
    assert_eq!(
        String::from_utf8_lossy(&found.stdout).trim(),
        bin.join("workbook-plugin-demo").display().to_string(),
        "{export}"
    );
    let path = path_with(&bin);

    let o = workbook(&["list"], &path, &dir);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    // Run in the crate's folder, `list` shows its chapter too.
    assert!(
        out.starts_with("demo  The demo plugin  (chapters/demo.toml)\n  buffer "),
        "{out}"
    );
    let plugins = out.split("\nplugins:\n").nth(1).unwrap_or_default();
    let line = plugins
        .lines()
        .find(|l| l.trim_start().starts_with("demo "))
        .unwrap_or_else(|| panic!("`list` does not show the plugin:\n{out}"));
    assert!(line.contains("Allocates a buffer of f32 values"), "{line}");
    assert!(out.contains("(external: "), "{out}");

    let o = workbook(&["describe", "demo"], &path, &dir);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        out.contains("  elements (integer, default 1000000, at least 1)\n      How many f32 values the buffer holds."),
        "{out}"
    );
    for metric in [
        "peak_bytes (bytes)",
        "expected_bytes (bytes)",
        "sum (number)",
    ] {
        assert!(out.contains(metric), "{metric} in:\n{out}");
    }

    let chapter = dir.join("chapters/demo.toml");
    let chapter_arg = chapter.to_str().unwrap();
    let o = workbook(&["validate", chapter_arg], &path, &dir);
    let (_, err) = text(&o);
    assert!(o.status.success(), "{err}");

    let out_dir = tmp.path().join("report");
    let o = workbook(
        &[
            "run",
            chapter_arg,
            "--check",
            "--out",
            out_dir.to_str().unwrap(),
            "--format",
            "json",
        ],
        &path,
        &dir,
    );
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    let cell = &report["cells"][0];
    assert_eq!(cell["status"], "passed", "{cell:#}");
    // 1000 f32 values: the meter counts the buffer to the byte.
    assert_eq!(cell["metrics"]["peak_bytes"], 4000.0);
    assert_eq!(cell["metrics"]["expected_bytes"], 4000.0);
    assert_eq!(report["meter"], "cpu-allocator");
    let region = &cell["memory"]["regions"][0];
    assert_eq!(region["name"], "buffer", "{cell:#}");
    assert_eq!(region["analytic"], 4000);
    assert!(out_dir.join("report.html").is_file());

    // A panic and a crash inside the plugin are those cells' errors; the
    // cells around them run.
    let crashes = dir.join("chapters/crashes.toml");
    std::fs::write(
        &crashes,
        r#"format_version = 1
id = "crashes"
title = "Crashes"

[[cells]]
id = "panics"
title = "Panics"
plugin = "demo"
params = { elements = 13 }

[[cells]]
id = "aborts"
title = "Aborts"
plugin = "demo"
params = { elements = 17 }

[[cells]]
id = "fine"
title = "Fine"
plugin = "demo"
params = { elements = 10 }
assertions = ["peak_bytes == 40"]
"#,
    )
    .unwrap();
    let o = workbook(
        &["run", crashes.to_str().unwrap(), "--format", "json"],
        &path,
        &dir,
    );
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    let cells = report["cells"].as_array().unwrap();
    assert_eq!(cells[0]["status"], "error");
    assert_eq!(cells[0]["error"], "panicked: thirteen is unlucky");
    assert_eq!(cells[1]["status"], "error");
    let aborted = cells[1]["error"].as_str().unwrap();
    assert!(
        aborted.starts_with("the cell's worker process aborted (SIGABRT) before the cell ended"),
        "{aborted}"
    );
    assert_eq!(cells[2]["status"], "passed", "{:#}", cells[2]);
}

/// A folder holding one executable script named `workbook-plugin-NAME`.
fn script(dir: &Path, name: &str, body: &str) {
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join(format!("workbook-plugin-{name}"));
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

#[test]
fn a_plugin_of_another_protocol_version_is_named_with_both_versions() {
    let tmp = tempfile::tempdir().unwrap();
    let bin = tmp.path().join("bin");
    script(
        &bin,
        "old",
        r#"read line; echo '{"type":"described","protocol":1,"plugins":[]}'"#,
    );
    let path = path_with(&bin);
    let o = workbook(&["list"], &path, tmp.path());
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert_eq!(
        listed_plugin(&out, "old"),
        Some(
            format!(
                "(cannot be used: plugin program {}: it speaks protocol version 1; this \
                 workbook speaks version 3 (rebuild the plugin against this workbook's SDK))",
                bin.join("workbook-plugin-old").display()
            )
            .as_str()
        ),
        "{out}"
    );
    // A chapter that names it says why it cannot run.
    let chapter = tmp.path().join("uses-old.toml");
    std::fs::write(
        &chapter,
        "format_version = 1\nid = \"x\"\ntitle = \"x\"\n[[cells]]\nid = \"a\"\ntitle = \"a\"\n\
         plugin = \"old\"\n",
    )
    .unwrap();
    let o = workbook(&["validate", chapter.to_str().unwrap()], &path, tmp.path());
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        err.contains("plugin `old` cannot be used: plugin program")
            && err.contains("it speaks protocol version 1; this workbook speaks version 3"),
        "{err}"
    );
}

#[test]
fn an_external_plugin_with_a_built_in_name_is_an_error_naming_both() {
    let tmp = tempfile::tempdir().unwrap();
    let bin = tmp.path().join("bin");
    script(&bin, "footprint", "exit 1");
    let path = path_with(&bin);
    let both = format!(
        "plugin `footprint` is both built in and an external program ({}); rename or remove \
         the external one",
        bin.join("workbook-plugin-footprint").display()
    );
    // `list` still works, to show what is wrong (with no chapter to load
    // beside it)...
    let o = workbook(
        &["list", "--chapters", tmp.path().to_str().unwrap()],
        &path,
        tmp.path(),
    );
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    // Listed twice: the built-in one, then the external one it shadows.
    let wanted = format!("(cannot be used: {both})");
    assert!(
        out.lines().any(|l| l
            .strip_prefix("  footprint  ")
            .is_some_and(|rest| rest.trim_start() == wanted)),
        "{out}"
    );
    // ...and a chapter that names it is refused.
    let o = workbook(
        &["validate", "chapter2"],
        &path,
        Path::new(env!("CARGO_MANIFEST_DIR")),
    );
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        err.contains(&format!(
            "cell `footprint`: plugin `footprint` cannot be used: {both}"
        )),
        "{err}"
    );
}

#[test]
fn a_program_that_does_not_answer_is_set_aside_with_what_it_said() {
    let tmp = tempfile::tempdir().unwrap();
    let bin = tmp.path().join("bin");
    script(&bin, "mute", "echo 'no protocol here' >&2; exit 3");
    let o = workbook(&["list"], &path_with(&bin), tmp.path());
    let (out, _) = text(&o);
    assert_eq!(
        listed_plugin(&out, "mute"),
        Some(
            format!(
                "(cannot be used: plugin program {}: it ended (exit status: 3) without an \
                 answer; it said: no protocol here)",
                bin.join("workbook-plugin-mute").display()
            )
            .as_str()
        ),
        "{out}"
    );
}

#[test]
fn plugins_beside_a_chapter_are_found() {
    let tmp = tempfile::tempdir().unwrap();
    // A plugin folder beside the chapter: found without PATH.
    script(
        &tmp.path().join("plugins"),
        "local",
        r#"read line; echo '{"type":"described","protocol":3,"plugins":[{"name":"local","description":"a local plugin","params":{},"metrics":[]}]}'"#,
    );
    let chapter = tmp.path().join("c.toml");
    std::fs::write(
        &chapter,
        "format_version = 1\nid = \"c\"\ntitle = \"c\"\n[[cells]]\nid = \"a\"\ntitle = \"a\"\n\
         plugin = \"lokal\"\n",
    )
    .unwrap();
    let o = workbook(
        &["validate", chapter.to_str().unwrap()],
        &std::env::var("PATH").unwrap_or_default(),
        Path::new(env!("CARGO_MANIFEST_DIR")),
    );
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        err.contains("unknown plugin `lokal`; did you mean `local`?"),
        "{err}"
    );
}

#[test]
fn a_plugin_that_floods_its_error_stream_is_still_heard() {
    let tmp = tempfile::tempdir().unwrap();
    let bin = tmp.path().join("bin");
    // 1 MiB on standard error before the answer: far past a pipe's buffer.
    script(
        &bin,
        "loud",
        r#"head -c 1048576 /dev/zero | tr '\0' 'x' >&2; read line; echo '{"type":"described","protocol":3,"plugins":[{"name":"loud","description":"a loud plugin","params":{},"metrics":[]}]}'"#,
    );
    let o = workbook(&["describe", "loud"], &path_with(&bin), tmp.path());
    let (out, err) = text(&o);
    assert!(o.status.success(), "{}", &err[..err.len().min(500)]);
    assert!(out.starts_with("loud: a loud plugin\n"), "{out}");
}

#[test]
fn new_plugin_refuses_a_taken_name_and_a_bad_one() {
    let tmp = tempfile::tempdir().unwrap();
    let path = std::env::var("PATH").unwrap_or_default();
    let o = workbook(&["new-plugin", "attention"], &path, tmp.path());
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(
        text(&o).1.trim(),
        "error: a plugin named `attention` exists already (`workbook list` shows the plugins); \
         choose another name"
    );
    let o = workbook(&["new-plugin", "Kv Cache"], &path, tmp.path());
    assert_eq!(o.status.code(), Some(2));
    assert!(
        text(&o)
            .1
            .starts_with("error: plugin name `Kv Cache` must be lowercase letters"),
        "{}",
        text(&o).1
    );
    assert!(std::fs::read_dir(tmp.path()).unwrap().next().is_none());
}

#[test]
fn an_external_plugin_is_started_only_when_needed() {
    let tmp = tempfile::tempdir().unwrap();
    let bin = tmp.path().join("bin");
    let started = tmp.path().join("started");
    script(
        &bin,
        "idle",
        &format!(
            r#"touch "{}"; read line; echo '{{"type":"described","protocol":3,"plugins":[{{"name":"idle","description":"d","params":{{}},"metrics":[]}}]}}'"#,
            started.display()
        ),
    );
    let path = path_with(&bin);
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    for args in [
        &["describe", "footprint"][..],
        &["validate", "chapter2"],
        &[
            "notebook",
            "chapter2",
            "-o",
            tmp.path().join("c.ipynb").to_str().unwrap(),
        ],
    ] {
        let o = workbook(args, &path, repo);
        assert!(o.status.success(), "{args:?}: {}", text(&o).1);
        assert!(
            !started.exists(),
            "{args:?} started a plugin it does not use"
        );
    }
    let o = workbook(&["describe", "idle"], &path, repo);
    assert!(o.status.success(), "{}", text(&o).1);
    assert!(started.exists());
}
