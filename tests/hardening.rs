//! The binary against hostile plugins and absurd inputs: each case ends in
//! a clear error or the right result, never an abort, a hang, a process
//! left behind or a write outside the output folder.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use workbook::sdk::output::{Axis, Series};
use workbook::sdk::protocol::{CellEnd, Message, PROTOCOL_VERSION};
use workbook::sdk::Figure;

mod common;
use common::{listed_plugin, none_left, output_within, text, RUN_LIMIT};

fn workbook(args: &[&str], cwd: &Path, env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_workbook"));
    cmd.args(args)
        .current_dir(cwd)
        .env_remove("WORKBOOK_CHECK_MODE")
        .env_remove("WORKBOOK_CHAPTERS")
        .env_remove("WORKBOOK_RANKS");
    for (k, v) in env {
        cmd.env(k, v);
    }
    output_within(&mut cmd, RUN_LIMIT)
}

fn line(m: &Message) -> String {
    serde_json::to_string(m).unwrap()
}

/// A plugin program `workbook-plugin-NAME` in `dir` that describes itself
/// (declaring `metrics`), accepts any parameters, and runs a cell as `run`
/// says, a shell fragment between its hello and its end.
fn plugin(dir: &Path, name: &str, run: &str) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let described = format!(
        r#"{{"type":"described","protocol":{PROTOCOL_VERSION},"plugins":[{{"name":"{name}","description":"a test plugin","params":{{}},"metrics":[]}}]}}"#
    );
    let checked = r#"{"type":"checked","verdicts":[{"params":{"Ok":{}},"violations":[],"memory_floor":null}]}"#;
    let hello = line(&Message::Hello {
        protocol: PROTOCOL_VERSION,
        device: "cpu".into(),
        meter: "none".into(),
    });
    let end = line(&Message::End(CellEnd {
        error: None,
        ..CellEnd::failed(String::new(), 0.0)
    }));
    let path = dir.join(format!("workbook-plugin-{name}"));
    std::fs::write(
        &path,
        format!(
            "#!/bin/sh\nread request\ncase \"$request\" in\n\
             *'\"request\":\"describe\"'*) echo '{described}' ;;\n\
             *'\"request\":\"check\"'*) echo '{checked}' ;;\n\
             *) echo '{hello}'\n{run}\necho '{end}' ;;\nesac\n"
        ),
    )
    .unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// A chapter in `dir` whose cells run `plugins` in turn, each cell named
/// after its plugin, with plugins found in `dir/plugins`.
fn chapter(dir: &Path, title: &str, plugins: &[&str]) -> PathBuf {
    let mut text = format!(
        "format_version = 1\nid = \"hostile\"\ntitle = {}\n",
        toml_string(title)
    );
    for p in plugins {
        text.push_str(&format!(
            "\n[[cells]]\nid = \"{p}\"\ntitle = \"{p}\"\nplugin = \"{p}\"\n"
        ));
    }
    let path = dir.join("hostile.toml");
    std::fs::write(&path, text).unwrap();
    path
}

fn toml_string(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}

/// Runs `chapter` from its folder with the JSON report on stdout and the
/// HTML report in `out`.
fn run_with_report(chapter: &Path, out: &Path) -> Output {
    workbook(
        &[
            "run",
            chapter.to_str().unwrap(),
            "--format",
            "json",
            "--out",
            out.to_str().unwrap(),
        ],
        chapter.parent().unwrap(),
        &[],
    )
}

fn report(o: &Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is the JSON report ({e}); stderr: {}",
            String::from_utf8_lossy(&o.stderr)
        )
    })
}

#[test]
fn a_line_past_the_protocols_cap_is_that_cells_error_and_the_run_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    let plugins = tmp.path().join("plugins");
    // 70 MB without a newline, then nothing more.
    plugin(
        &plugins,
        "endless",
        "echo '{\"type\":\"printed\",\"line\":\"before\"}'\n\
         head -c 70000000 /dev/zero | tr '\\0' x\nsleep 600",
    );
    plugin(&plugins, "fine", "");
    let path = chapter(tmp.path(), "t", &["endless", "fine"]);
    let out = tmp.path().join("out");
    let o = run_with_report(&path, &out);
    let r = report(&o);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o).1);
    let cell = &r["cells"][0];
    assert_eq!(
        cell["error"],
        "the cell's worker process broke the protocol: its line 3 ran past the protocol's cap \
         of 64.0 MiB without ending (what it sent before that line is kept)",
        "{cell}"
    );
    assert_eq!(cell["printed"][0], "before", "{cell}");
    assert_eq!(r["cells"][1]["status"], "passed", "{}", r["cells"][1]);
    assert!(out.join("report.html").is_file());
}

#[test]
fn an_external_plugin_that_this_machine_cannot_run_is_reported_as_not_run() {
    let tmp = tempfile::tempdir().unwrap();
    let plugins = tmp.path().join("plugins");
    let ran = tmp.path().join("ran");
    let program = plugin(&plugins, "needy", &format!("touch '{}'", ran.display()));
    let script = std::fs::read_to_string(&program).unwrap();
    std::fs::write(
        &program,
        script.replace(
            r#""memory_floor":null"#,
            r#""memory_floor":null,"unavailable":"it needs a frobnicator: install one""#,
        ),
    )
    .unwrap();
    plugin(&plugins, "fine", "");
    let path = chapter(tmp.path(), "t", &["needy", "fine"]);
    let o = run_with_report(&path, &tmp.path().join("out"));
    let r = report(&o);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o).1);
    let cell = &r["cells"][0];
    assert_eq!(cell["status"], "skipped", "{cell}");
    assert_eq!(
        cell["not_run"], "it needs a frobnicator: install one",
        "{cell}"
    );
    assert!(!ran.exists(), "the cell was started");
    assert_eq!(r["cells"][1]["status"], "passed", "{}", r["cells"][1]);

    // Where every cell must run, it is the cell's error, and the rest run.
    let o = workbook(
        &[
            "run",
            path.to_str().unwrap(),
            "--format",
            "json",
            "--require-all",
        ],
        tmp.path(),
        &[],
    );
    let r = report(&o);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o).1);
    assert_eq!(
        r["cells"][0]["error"],
        "this build cannot run it, and --require-all is set: it needs a frobnicator: install one"
    );
    assert!(!ran.exists(), "the cell was started");
    assert_eq!(r["cells"][1]["status"], "passed", "{}", r["cells"][1]);
}

#[test]
fn a_line_that_is_not_utf8_is_named_with_its_offset() {
    let tmp = tempfile::tempdir().unwrap();
    plugin(
        &tmp.path().join("plugins"),
        "latin",
        "printf 'caf\\351 au lait\\n'\nexit 0",
    );
    let path = chapter(tmp.path(), "t", &["latin"]);
    let o = workbook(
        &["run", path.to_str().unwrap(), "--format", "json"],
        tmp.path(),
        &[],
    );
    let cell = &report(&o)["cells"][0];
    let error = cell["error"].as_str().unwrap();
    assert!(
        error.contains(
            "it wrote a line that is not the protocol's: its line 2 is not UTF-8 (an invalid \
             byte at offset 3): caf\u{fffd} au lait"
        ),
        "{error}"
    );
}

#[test]
fn a_process_a_plugin_leaves_holding_its_output_cannot_stall_the_run() {
    let tmp = tempfile::tempdir().unwrap();
    let plugins = tmp.path().join("plugins");
    // One hangs with a child that holds its output; one ends its cell at
    // once and leaves such a child behind.
    plugin(&plugins, "hangs", "sleep 600 &\nsleep 600");
    plugin(&plugins, "leaves", "sleep 600 &");
    let path = chapter(tmp.path(), "t", &["hangs", "leaves"]);
    let mark = format!("{}-stall", std::process::id());
    let start = Instant::now();
    let o = workbook(
        &[
            "run",
            path.to_str().unwrap(),
            "--format",
            "json",
            "--timeout",
            "2",
        ],
        tmp.path(),
        &[("WORKBOOK_TEST_MARK", &mark)],
    );
    let took = start.elapsed();
    let r = report(&o);
    assert_eq!(
        r["cells"][0]["error"],
        "stopped at the time limit of 2 s (set `timeout` in the cell, or `--timeout SECONDS`)"
    );
    assert_eq!(r["cells"][1]["status"], "passed", "{}", r["cells"][1]);
    // Seconds, not the 600 the children would live.
    assert!(took < Duration::from_secs(60), "{took:?}");
    none_left(&mark, Duration::from_secs(10));
}

#[test]
fn plugins_are_asked_to_describe_themselves_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let bin = tmp.path().join("bin");
    for name in ["slow-a", "slow-b", "slow-c"] {
        let path = plugin(&bin, name, "");
        let script = std::fs::read_to_string(&path).unwrap();
        std::fs::write(
            &path,
            script.replace("read request\n", "read request\nsleep 4\n"),
        )
        .unwrap();
    }
    let mut path = bin.into_os_string();
    path.push(":");
    path.push(std::env::var_os("PATH").unwrap_or_default());
    let start = Instant::now();
    let o = workbook(&["list"], tmp.path(), &[("PATH", path.to_str().unwrap())]);
    let took = start.elapsed();
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    for name in ["slow-a", "slow-b", "slow-c"] {
        assert_eq!(listed_plugin(&out, name), Some("a test plugin"), "{out}");
    }
    // One after another they would take 12 s.
    assert!(took < Duration::from_secs(11), "{took:?}");
}

/// A plugin whose parameters' schema is `schema`.
fn schema_plugin(dir: &Path, name: &str, schema: &str) {
    let path = plugin(dir, name, "");
    let script = std::fs::read_to_string(&path).unwrap();
    std::fs::write(
        &path,
        script.replace(r#""params":{}"#, &format!(r#""params":{schema}"#)),
    )
    .unwrap();
}

#[test]
fn a_schema_that_refers_to_itself_is_described_within_bounds() {
    let tmp = tempfile::tempdir().unwrap();
    let bin = tmp.path().join("bin");
    let ten = |value: &str| {
        (0..10)
            .map(|i| format!(r#""p{i}":{value}"#))
            .collect::<Vec<_>>()
            .join(",")
    };
    let node = format!(
        r#"{{"type":"object","properties":{{{}}}}}"#,
        ten(r##"{"$ref":"#/$defs/n"}"##)
    );
    schema_plugin(
        &bin,
        "recursive",
        &format!(
            r#"{{"type":"object","properties":{{{}}},"$defs":{{"n":{node}}}}}"#,
            ten(r##"{"$ref":"#/$defs/n"}"##)
        ),
    );
    let branches = (0..10)
        .map(|_| r##"{"$ref":"#/$defs/k"}"##)
        .collect::<Vec<_>>()
        .join(",");
    schema_plugin(
        &bin,
        "branching",
        &format!(
            r##"{{"type":"object","properties":{{"x":{{"$ref":"#/$defs/k"}}}},"$defs":{{"k":{{"anyOf":[{branches}]}}}}}}"##
        ),
    );
    let mut path = bin.into_os_string();
    path.push(":");
    path.push(std::env::var_os("PATH").unwrap_or_default());
    for name in ["recursive", "branching"] {
        let o = workbook(
            &["describe", name],
            tmp.path(),
            &[("PATH", path.to_str().unwrap())],
        );
        let (out, err) = text(&o);
        assert!(o.status.success(), "{name}: {err}");
        assert!(out.starts_with(&format!("{name}: a test plugin")), "{out}");
        // Bounded by the work allowed, not by 10^8 expansions.
        assert!(out.len() < 8 << 20, "{name}: {} bytes", out.len());
    }
}

#[test]
fn control_sequences_from_a_chapter_or_a_plugin_reach_the_terminal_escaped() {
    let tmp = tempfile::tempdir().unwrap();
    plugin(
        &tmp.path().join("plugins"),
        "noisy",
        r#"echo '{"type":"printed","line":"\u001b[2Jcleared\u009b31m"}'"#,
    );
    let path = chapter(tmp.path(), "\u{1b}]0;owned\u{7}Title", &["noisy"]);
    let o = workbook(&["run", path.to_str().unwrap()], tmp.path(), &[]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(!out.contains('\u{1b}') && !out.contains('\u{9b}') && !out.contains('\u{7}'));
    assert!(out.starts_with("\\x1b]0;owned\\x07Title"), "{out}");
    assert!(out.contains("> \\x1b[2Jcleared\\u{9b}31m"), "{out}");
}

#[test]
fn list_does_not_start_programs_of_the_folder_it_runs_in() {
    let tmp = tempfile::tempdir().unwrap();
    let started = tmp.path().join("started");
    let path = plugin(&tmp.path().join("chapters/plugins"), "stranger", "");
    let script = std::fs::read_to_string(&path).unwrap();
    std::fs::write(
        &path,
        script.replace(
            "read request\n",
            &format!("touch '{}'\nread request\n", started.display()),
        ),
    )
    .unwrap();
    let o = workbook(&["list"], tmp.path(), &[]);
    assert!(o.status.success(), "{}", text(&o).1);
    assert!(!text(&o).0.contains("stranger"), "{}", text(&o).0);
    assert!(
        !started.exists(),
        "`list` ran a program of ./chapters/plugins"
    );
    // Named, the folder is trusted.
    let o = workbook(&["list", "--chapters", "chapters"], tmp.path(), &[]);
    assert!(text(&o).0.contains("stranger"), "{}", text(&o).0);
    assert!(started.exists());
}

/// A plugin that records one figure, `figure`.
fn figure_plugin(dir: &Path, name: &str, figure: &Figure) {
    let json = line(&Message::Figure(figure.clone()));
    plugin(dir, name, &format!("echo '{json}'"));
}

fn figure(id: &str, points: Vec<(f64, f64)>, log: (bool, bool)) -> Figure {
    Figure {
        id: id.into(),
        title: "extremes".into(),
        x: Axis {
            label: "x".into(),
            log: log.0,
            ..Axis::default()
        },
        y: Axis {
            label: "y".into(),
            log: log.1,
            ..Axis::default()
        },
        series: vec![Series {
            name: "s".into(),
            points,
        }],
        markers: Vec::new(),
        guides: Vec::new(),
    }
}

#[test]
fn figures_with_hostile_ids_or_extreme_values_do_not_cost_the_report() {
    let tmp = tempfile::tempdir().unwrap();
    let plugins = tmp.path().join("plugins");
    let long = "f".repeat(300);
    figure_plugin(
        &plugins,
        "slash",
        &figure("a/b", vec![(1.0, 2.0)], (false, false)),
    );
    figure_plugin(
        &plugins,
        "dots",
        &figure("../../escape", vec![(1.0, 2.0)], (false, false)),
    );
    figure_plugin(
        &plugins,
        "long",
        &figure(&long, vec![(1.0, 2.0)], (false, false)),
    );
    figure_plugin(
        &plugins,
        "huge",
        &figure("huge", vec![(1.0, 1.7e308), (2.0, 1e-300)], (true, true)),
    );
    let path = chapter(tmp.path(), "t", &["slash", "dots", "long", "huge"]);
    let out = tmp.path().join("out");
    let o = run_with_report(&path, &out);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o).1);
    assert!(out.join("report.html").is_file());
    let plots = out.join("plots");
    for name in ["slash-a_b.svg", "dots-______escape.svg", "huge-huge.png"] {
        assert!(plots.join(name).is_file(), "{name}");
    }
    assert!(plots.join(format!("long-{}.svg", "f".repeat(64))).is_file());
    // Nothing was written above the folder.
    assert!(!tmp.path().join("escape.svg").exists());
    assert_eq!(
        std::fs::read_dir(tmp.path()).unwrap().count(),
        3,
        "plugins, hostile.toml and out only"
    );
}

#[test]
fn links_planted_in_the_output_folder_are_never_written_through() {
    let tmp = tempfile::tempdir().unwrap();
    plugin(&tmp.path().join("plugins"), "fine", "");
    let path = chapter(tmp.path(), "t", &["fine"]);
    let victim = tmp.path().join("victim");
    std::fs::write(&victim, "precious").unwrap();
    let victims = tmp.path().join("victims");
    std::fs::create_dir(&victims).unwrap();
    std::fs::write(victims.join("keep"), "precious").unwrap();
    let out = tmp.path().join("out");
    std::fs::create_dir(&out).unwrap();
    for name in [
        ".workbook-write-check",
        ".report.html.partial",
        "report.html",
    ] {
        std::os::unix::fs::symlink(&victim, out.join(name)).unwrap();
    }
    std::os::unix::fs::symlink(&victims, out.join("plots")).unwrap();
    let o = workbook(
        &[
            "run",
            path.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ],
        tmp.path(),
        &[],
    );
    assert!(o.status.success(), "{}", text(&o).1);
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    assert_eq!(
        std::fs::read_to_string(victims.join("keep")).unwrap(),
        "precious"
    );
    let page = std::fs::symlink_metadata(out.join("report.html")).unwrap();
    assert!(page.is_file(), "the page replaced the link, not its target");
    assert!(std::fs::symlink_metadata(out.join("plots"))
        .unwrap()
        .is_dir());
}

#[test]
fn plan_refuses_absurd_models_before_allocating_them() {
    let tmp = tempfile::tempdir().unwrap();
    let big = tmp.path().join("big.toml");
    std::fs::write(
        &big,
        "layers = 4\nhidden = 1000000\nheads = 4\nseq = 256\nvocab = 512\n",
    )
    .unwrap();
    let cases: Vec<Vec<String>> = vec![
        vec![
            "--hidden".into(),
            "100000".into(),
            "--heads".into(),
            "4".into(),
        ],
        vec!["--seq".into(), "1000000000".into()],
        vec!["--vocab".into(), "10000000000".into()],
        vec!["--layers".into(), "100000000".into()],
        vec!["--model".into(), big.display().to_string()],
    ];
    for case in cases {
        // The host's memory: on a GPU build with a card, auto would weigh the card's.
        let mut args = vec!["plan", "--device", "cpu", "--budget", "2GiB"];
        args.extend(case.iter().map(String::as_str));
        let o = workbook(&args, tmp.path(), &[]);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{case:?}: {err}");
        assert!(
            err.starts_with("error: this model cannot be planned on this machine: its "),
            "{case:?}: {err}"
        );
        assert!(err.contains("of memory available there"), "{case:?}: {err}");
    }
    let o = workbook(
        &[
            "plan",
            "--budget",
            "2GiB",
            "--layers",
            "18446744073709551615",
        ],
        tmp.path(),
        &[],
    );
    assert!(
        text(&o).1.contains("parameter count overflows 64 bits"),
        "{}",
        text(&o).1
    );
}

#[test]
fn plan_reads_only_small_regular_files_and_refuses_a_timeout_of_zero() {
    let tmp = tempfile::tempdir().unwrap();
    let fifo = tmp.path().join("fifo");
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    let large = tmp.path().join("large.toml");
    std::fs::write(&large, format!("# {}\n", "x".repeat(100_000))).unwrap();
    // A decoder's config.json is held to the same.
    let fifo_json = tmp.path().join("fifo.json");
    let made = Command::new("mkfifo").arg(&fifo_json).status().unwrap();
    assert!(made.success());
    let large_json = tmp.path().join("large.json");
    std::fs::write(
        &large_json,
        format!("{{\"x\": \"{}\"}}", "x".repeat(100_000)),
    )
    .unwrap();
    // Weights given for a config: large, and not UTF-8 where it is cut.
    let weights = tmp.path().join("model.safetensors.json");
    std::fs::write(&weights, vec![0xff_u8; 100_000]).unwrap();
    for (file, says) in [
        (
            fifo_json.display().to_string(),
            "is a FIFO (a named pipe); a decoder's config.json is a regular .json file",
        ),
        (
            large_json.display().to_string(),
            "is larger than a decoder's config.json may be (65536 bytes at most): it holds the decoder's shape",
        ),
        (
            weights.display().to_string(),
            "is larger than a decoder's config.json may be (65536 bytes at most)",
        ),
        (
            fifo.display().to_string(),
            "is a FIFO (a named pipe); a model file is a regular .toml file",
        ),
        (
            "/dev/zero".to_string(),
            "is a device, not a regular file; a model file is a regular .toml file",
        ),
        (
            large.display().to_string(),
            "is larger than a model file may be (65536 bytes at most)",
        ),
    ] {
        let o = workbook(
            &["plan", "--budget", "1GiB", "--model", &file],
            tmp.path(),
            &[],
        );
        assert_eq!(o.status.code(), Some(2), "{file}: {}", text(&o).1);
        assert!(text(&o).1.contains(says), "{file}: {}", text(&o).1);
        assert!(!text(&o).1.contains("chapter"), "{file}: {}", text(&o).1);
    }
    let o = workbook(
        &[
            "plan",
            "--budget",
            "1GiB",
            "--ranks",
            "2",
            "--verify",
            "--timeout",
            "0",
        ],
        tmp.path(),
        &[],
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o).1);
    assert!(
        text(&o)
            .1
            .contains("`0` is not a time limit; allowed: a whole number of seconds, at least 1"),
        "{}",
        text(&o).1
    );
    // A count of steps past what a verification needs is refused before
    // anything is reserved for its measurements.
    for steps in ["0", "10001", "2305843009213693952"] {
        let o = workbook(
            &["plan", "--budget", "1GiB", "--verify", "--steps", steps],
            tmp.path(),
            &[],
        );
        assert_eq!(o.status.code(), Some(2), "{}", text(&o).1);
        let want = format!("`{steps}` is not a number of steps; allowed: 1 to 10000");
        assert!(text(&o).1.contains(&want), "{}", text(&o).1);
    }
}

#[test]
fn a_decoder_cell_reads_only_a_small_regular_config() {
    let tmp = tempfile::tempdir().unwrap();
    let fifo = tmp.path().join("fifo.json");
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    let large = tmp.path().join("model.safetensors");
    std::fs::write(&large, vec![0xff_u8; 100_000]).unwrap();
    let chapter = tmp.path().join("decoder.toml");
    std::fs::write(
        &chapter,
        format!(
            "format_version = 1\nid = \"decoder\"\ntitle = \"decoder\"\n\n\
             [[cells]]\nid = \"step\"\ntitle = \"step\"\nplugin = \"decoder_step\"\n\
             [cells.params]\nconfig = {}\n\n\
             [[cells]]\nid = \"shapes\"\ntitle = \"shapes\"\nplugin = \"decoder_shapes\"\n\
             [cells.params]\nmodels = [{{ config = {}, published = 1 }}]\n",
            toml_string(&fifo.display().to_string()),
            toml_string(&large.display().to_string()),
        ),
    )
    .unwrap();
    let o = workbook(
        &["validate", &chapter.display().to_string()],
        tmp.path(),
        &[],
    );
    let err = text(&o).1;
    assert_eq!(o.status.code(), Some(2), "{err}");
    let at = chapter.display();
    let (fifo, large) = (fifo.display(), large.display());
    assert_eq!(
        err.lines().collect::<Vec<_>>(),
        [
            "error: 2 problems:".to_string(),
            format!(
                "{at}:10:1: cell `step`: parameter `config` is {fifo}; allowed: a Llama-family \
                 config.json ({fifo} is a FIFO (a named pipe); a decoder's config.json is a \
                 regular .json file)"
            ),
            format!(
                "{at}:17:1: cell `shapes`: parameter `models[0].config` is {large}; allowed: a \
                 Llama-family config.json ({large} is larger than a decoder's config.json may \
                 be (65536 bytes at most): it holds the decoder's shape (`hidden_size`, \
                 `num_hidden_layers`, `vocab_size`, ...))"
            ),
        ],
    );
}

#[test]
fn a_decoder_cell_reads_the_config_beside_its_chapter_from_any_working_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let (folder, elsewhere) = (tmp.path().join("mine"), tmp.path().join("elsewhere"));
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::create_dir_all(&elsewhere).unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    std::fs::copy(
        root.join("models/smollm2-135m.config.json"),
        folder.join("mine.json"),
    )
    .unwrap();
    let chapter = |config: &str| {
        format!(
            "format_version = 1\nid = \"mine\"\ntitle = \"mine\"\n\n\
             [[cells]]\nid = \"step\"\ntitle = \"step\"\nplugin = \"decoder_step\"\n\
             assertions = [\"params > 0\"]\n\
             [cells.params]\nconfig = \"{config}\"\nlayers = 1\ndivisor = 32\nbatch = 1\n\
             seq = 16\nsteps = 2\ndtypes = [\"f32\"]\nlosses = [\"plain\"]\n\
             checkpointing = [false]\nmicro_batches = [1]\n"
        )
    };
    std::fs::write(folder.join("mine.toml"), chapter("mine.json")).unwrap();
    // The chapter named from another folder: its config is found beside it,
    // by validation and by the worker that runs the cell.
    let o = workbook(&["run", "../mine/mine.toml", "--check"], &elsewhere, &[]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}{err}");
    assert!(out.contains("1 passed, 0 failed"), "{out}");

    // A config found nowhere says where it was looked for.
    std::fs::write(folder.join("absent.toml"), chapter("absent.json")).unwrap();
    let o = workbook(&["validate", "../mine/absent.toml"], &elsewhere, &[]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(
        text(&o).1.trim_end(),
        "error: ../mine/absent.toml:11:1: cell `step`: parameter `config` is absent.json; \
         allowed: a Llama-family config.json, from the chapter's folder, the working directory \
         or the repository's root (cannot read absent.json: No such file or directory (os \
         error 2))"
    );

    // A config beside the chapter that is refused: the parameter is said as
    // written, the file's own error where the file is.
    let mut bad: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(folder.join("mine.json")).unwrap()).unwrap();
    bad["num_key_value_heads"] = 4.into();
    std::fs::write(folder.join("bad.json"), bad.to_string()).unwrap();
    std::fs::write(folder.join("bad.toml"), chapter("bad.json")).unwrap();
    let o = workbook(&["validate", "../mine/bad.toml"], &elsewhere, &[]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(
        text(&o).1.trim_end(),
        "error: ../mine/bad.toml:11:1: cell `step`: parameter `config` is bad.json; allowed: a \
         Llama-family config.json (../mine/bad.json: `num_key_value_heads` is 4: a divisor of \
         num_attention_heads (9): query heads share key/value heads in equal groups)"
    );
}

#[test]
fn plan_weighs_a_batch_of_a_hundred_billion_sequences_by_arithmetic() {
    let tmp = tempfile::tempdir().unwrap();
    let o = workbook(
        &[
            "plan",
            "--budget",
            "1TiB",
            "--batch",
            "100000000000",
            "--layers",
            "1",
            "--hidden",
            "16",
            "--heads",
            "2",
            "--seq",
            "8",
            "--vocab",
            "16",
            "--recipes",
            "tiled",
            "--dtypes",
            "f32",
            "--no-checkpointing",
            "--json",
        ],
        tmp.path(),
        &[],
    );
    let (out, err) = text(&o);
    let plan: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {err}"));
    // The whole batch's tokens alone are 6.4 TB, over the budget: no
    // micro-batch fits, and the search says so at once rather than trying
    // each of 10^11 sizes.
    let candidates = plan["plan"]["candidates"].as_array().unwrap();
    assert_eq!(candidates.len(), 2, "{plan}");
    assert_eq!(candidates[0]["micro_batch"], 100_000_000_000u64);
    assert_eq!(candidates[0]["fits"], false);
}

#[test]
fn a_chapter_of_ten_thousand_cells_validates_and_locates_its_last_error() {
    let tmp = tempfile::tempdir().unwrap();
    let mut source = String::from("format_version = 1\nid = \"big\"\ntitle = \"Big\"\n");
    for i in 0..10_000 {
        source.push_str(&format!(
            "\n[[cells]]\nid = \"c{i}\"\ntitle = \"é{i}\"\nplugin = \"footprint\"\n"
        ));
    }
    let path = tmp.path().join("big.toml");
    std::fs::write(&path, &source).unwrap();
    let o = workbook(&["validate", path.to_str().unwrap()], tmp.path(), &[]);
    assert!(o.status.success(), "{}", text(&o).1);
    assert!(
        text(&o)
            .0
            .ends_with("big.toml: 10000 cells, 0 assertions, valid\n"),
        "{}",
        text(&o).0
    );
    // A duplicate id at the very end: located by line and column.
    source.push_str("\n[[cells]]\nid = \"c7\"\ntitle = \"again\"\nplugin = \"footprint\"\n");
    std::fs::write(&path, &source).unwrap();
    let o = workbook(&["validate", path.to_str().unwrap()], tmp.path(), &[]);
    assert_eq!(o.status.code(), Some(2));
    let line = source.lines().count() - 2;
    assert!(
        text(&o).1.contains(&format!(
            "big.toml:{line}:6: cell `c7`: duplicate cell id; first defined at line 41"
        )),
        "{}",
        text(&o).1
    );
}

#[cfg(not(feature = "mpi"))]
#[test]
fn a_rank_started_from_a_build_without_mpi_names_workbook_bin() {
    let tmp = tempfile::tempdir().unwrap();
    let bin = env!("CARGO_BIN_EXE_workbook");
    let request = format!(
        r#"{{"layers":1,"width":8,"batch":8,"steps":1,"seed":1,"out":"{}"}}"#,
        tmp.path().display()
    );
    let o = workbook(
        &["rank", "--request", &request],
        tmp.path(),
        &[("WORKBOOK_BIN", bin)],
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o).1.starts_with(&format!(
            "error: {bin} was built without the `mpi` feature (WORKBOOK_BIN={bin} chose it as \
             the ranks' executable: point WORKBOOK_BIN at a build with `--features mpi`, or \
             unset it)"
        )),
        "{}",
        text(&o).1
    );
}
