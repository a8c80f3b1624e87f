//! Inputs that once crashed the binary, escaped its folder or said the wrong
//! thing: each gives a clear message and exit code 2.

use std::path::Path;
use std::process::{Command, Output};

mod common;
use common::{light, output_within, text, RUN_LIMIT};

fn workbook(args: &[&str], dir: &Path) -> Output {
    let _light = light();
    output_within(
        Command::new(env!("CARGO_BIN_EXE_workbook"))
            .args(args)
            .current_dir(dir)
            .env_remove("WORKBOOK_CHECK_MODE")
            .env_remove("WORKBOOK_CHAPTERS"),
        RUN_LIMIT,
    )
}

/// Runs `args` in `dir`, asserts exit code 2 and no panic, returns stderr.
fn refused(args: &[&str], dir: &Path) -> String {
    let o = workbook(args, dir);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

const CELL: &str = r#"
[[cells]]
id = "footprint"
title = "Footprint"
plugin = "footprint"
"#;

#[test]
fn a_chapter_id_that_is_a_path_is_refused_before_a_notebook_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir(&work).unwrap();
    let chapter = format!("format_version = 1\nid = \"../escaped\"\ntitle = \"T\"\n{CELL}");
    std::fs::write(work.join("escape.toml"), chapter).unwrap();
    let err = refused(&["notebook", "escape.toml"], &work);
    assert!(
        err.contains(
            "escape.toml:2:6: chapter id `../escaped` must be letters, digits, `_` or `-`"
        ),
        "{err}"
    );
    assert!(!dir.path().join("escaped.ipynb").exists());
}

#[test]
fn a_directory_a_fifo_and_a_dangling_link_say_what_they_are() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir(d.join("folder.toml")).unwrap();
    let fifo = std::ffi::CString::new(d.join("pipe.toml").to_str().unwrap()).unwrap();
    // SAFETY: mkfifo(3) with a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);
    std::os::unix::fs::symlink("nowhere.toml", d.join("dangling.toml")).unwrap();
    for (name, says) in [
        (
            "folder.toml",
            "folder.toml is a directory; a chapter is a .toml file",
        ),
        (
            "pipe.toml",
            "pipe.toml is a FIFO (a named pipe); a chapter is a .toml file",
        ),
        (
            "dangling.toml",
            "dangling.toml is a link to nowhere.toml, which does not exist",
        ),
    ] {
        let err = refused(&["validate", name], d);
        assert!(err.contains(says), "{name}: {err}");
    }
    // `list` skips what is not a file, and does not wait on the FIFO.
    let o = workbook(&["list", "--chapters", d.to_str().unwrap()], d);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(out.starts_with("no chapters found"), "{out}");
}

#[test]
fn an_unreadable_chapter_says_why_once() {
    // /proc/self/mem is a regular file that no one can read from its start,
    // root included.
    let err = refused(&["validate", "/proc/self/mem"], Path::new("/"));
    assert!(
        err.contains("cannot read /proc/self/mem: Input/output error (os error 5)"),
        "{err}"
    );
    assert_eq!(err.matches("os error").count(), 1, "{err}");
}

#[test]
fn an_assertion_of_fifty_thousand_terms_is_refused_not_a_stack_overflow() {
    let dir = tempfile::tempdir().unwrap();
    let long = vec!["large_params"; 50_000].join(" + ");
    let chapter = format!(
        "format_version = 1\nid = \"long\"\ntitle = \"T\"\n{CELL}assertions = [\"{long} > 0\"]\n"
    );
    std::fs::write(dir.path().join("long.toml"), chapter).unwrap();
    let err = refused(&["validate", "long.toml"], dir.path());
    assert!(
        err.contains("an assertion is at most 1000 (split a longer claim"),
        "{err}"
    );
    // The message quotes a short excerpt, not the whole expression.
    assert!(err.len() < 1_000, "{} bytes: {err}", err.len());
    assert!(err.contains("bytes in all)"), "{err}");
}

#[test]
fn a_megabyte_plugin_name_is_quoted_short() {
    let dir = tempfile::tempdir().unwrap();
    let name = "p".repeat(1_000_000);
    let chapter = format!(
        "format_version = 1\nid = \"big\"\ntitle = \"T\"\n[[cells]]\nid = \"a\"\ntitle = \"A\"\nplugin = \"{name}\"\n"
    );
    std::fs::write(dir.path().join("big.toml"), chapter).unwrap();
    let err = refused(&["validate", "big.toml"], dir.path());
    assert!(err.contains("unknown plugin `ppp"), "{}", &err[..200]);
    assert!(err.len() < 1_000, "{} bytes", err.len());
}

#[test]
fn script_in_prose_does_not_reach_the_report_as_markup() {
    let dir = tempfile::tempdir().unwrap();
    let chapter =
        "format_version = 1\nid = \"hostile\"\ntitle = \"T\"\nintro = \"<script>alert('intro')</script>\"\n\
         [[cells]]\nid = \"footprint\"\ntitle = \"Footprint\"\nplugin = \"footprint\"\n\
         prose = \"Hi <img src=x onerror=\\\"alert(1)\\\"> <script>alert(2)</script>\"\n";
    std::fs::write(dir.path().join("hostile.toml"), chapter).unwrap();
    let o = workbook(
        &["run", "hostile.toml", "--check", "--out", "report"],
        dir.path(),
    );
    assert!(o.status.success(), "{}", text(&o).1);
    let page = std::fs::read_to_string(dir.path().join("report/report.html")).unwrap();
    for gone in ["alert('intro')", "onerror", "alert(2)"] {
        assert!(!page.contains(gone), "{gone} reached the page");
    }
}

#[test]
fn every_bad_parameter_value_of_a_chapter_is_reported_before_anything_runs() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let f = "tests/fixtures/bad_values.toml";
    let expected = [
        "error: 13 problems:",
        "8:10: cell `accumulation`: parameter `compare_steps` (its default, at check size) is 4; allowed: from 1 to 1",
        "10:1: cell `accumulation`: parameter `steps[0]` is 0; allowed: at least 1",
        "11:1: cell `accumulation`: parameter `widths` is []; allowed: a list of at least 2 entries",
        "12:1: cell `accumulation`: parameter `lr` is NaN; allowed: a finite number above 0",
        "14:1: cell `accumulation`: check parameter `large_batch` is 0; allowed: at least 1",
        "21:1: cell `checkpointing`: parameter `segments` is []; allowed: a list of at least 1 entry",
        "23:1: cell `checkpointing`: parameter `classes` is 4294967296; allowed: from 2 to 4294967295",
        "25:1: cell `checkpointing`: check parameter `segments[1]` is 9; allowed: at most the 8 modules of the stack (2 × stack_depth)",
        "26:1: cell `checkpointing`: check parameter `overhead_repeats` is 0; allowed: at least 1",
        "33:1: cell `footprint`: parameter `dtypes[0]` is \"fp16\"; allowed: one of f32, f16, bf16",
        "34:1: cell `footprint`: parameter `small` is a layer's weight = 4294967296 × 4294967296; allowed: a product of at most 1099511627776 elements (2^40)",
        "41:1: cell `attention`: parameter `heads` is 0; allowed: at least 1",
        "42:1: cell `attention`: parameter `lengths` is []; allowed: a list of at least 1 entry",
    ];
    for command in ["validate", "run"] {
        let (_, err) = text(&workbook(&[command, f], root));
        let lines: Vec<&str> = err.lines().collect();
        assert_eq!(lines[0], expected[0], "{err}");
        assert_eq!(lines.len(), expected.len(), "{err}");
        for (line, want) in lines[1..].iter().zip(&expected[1..]) {
            assert_eq!(*line, format!("{f}:{want}"));
        }
        refused(&[command, f], root);
    }
}

/// A GPT cell whose check table overrides the model's fields in `check`.
fn nested_chapter(check: &str) -> String {
    format!(
        "format_version = 1\nid = \"nested\"\ntitle = \"nested\"\n\n\
         [[cells]]\nid = \"saved\"\ntitle = \"saved\"\nplugin = \"saved_tensors\"\n\
         [cells.params.model]\nlayers = 2\nhidden = 64\nheads = 4\nseq = 64\nvocab = 128\n\
         attention = \"naive\"\nlean = false\n\
         [cells.check.model]\n{check}\n"
    )
}

#[test]
fn a_check_table_overrides_nested_fields_one_by_one_and_errors_say_where_each_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("nested.toml");
    // `seq` alone: the full table's other fields stay.
    std::fs::write(&f, nested_chapter("seq = 32")).unwrap();
    let o = workbook(&["validate", f.to_str().unwrap()], dir.path());
    assert!(o.status.success(), "{}", text(&o).1);
    // A field the check table writes is its; one it leaves is the full
    // table's, read at check size.
    std::fs::write(&f, nested_chapter("seq = 0\nheads = 3")).unwrap();
    let err = refused(&["validate", f.to_str().unwrap()], dir.path());
    let at = f.display();
    assert_eq!(
        err.lines().collect::<Vec<_>>(),
        [
            "error: 2 problems:".to_string(),
            format!(
                "{at}:9:15: cell `saved`: parameter `model.hidden` (at check size) is 64; \
                 allowed: a positive multiple of heads (3)"
            ),
            format!(
                "{at}:17:14: cell `saved`: check parameter `model.seq` is 0; allowed: at least 1"
            ),
        ]
    );
}

#[test]
fn a_gpt_cell_whose_step_cannot_be_allocated_is_refused_by_its_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("huge_gpt.toml");
    std::fs::write(
        &f,
        "format_version = 1\nid = \"huge_gpt\"\ntitle = \"huge\"\n\n\
         [[cells]]\nid = \"logits\"\ntitle = \"logits\"\nplugin = \"gpt_training\"\n\
         [cells.params]\nbatch = 4\nrecipe = \"direct_tiled\"\n\
         [cells.params.model]\nlayers = 2\nhidden = 64\nheads = 4\nseq = 1000000\n\
         vocab = 2000000\nattention = \"tiled\"\nlean = true\n\n\
         [[cells]]\nid = \"scores\"\ntitle = \"scores\"\nplugin = \"saved_tensors\"\n\
         [cells.params]\nbatch = 4\nrecipes = [\"candle\"]\n\
         [cells.params.model]\nlayers = 2\nhidden = 64\nheads = 4\nseq = 600000\n\
         vocab = 128\nattention = \"naive\"\nlean = false\n\n\
         [[cells]]\nid = \"wide\"\ntitle = \"wide\"\nplugin = \"predictors\"\n\
         [cells.params]\nvariants = [{ layers = 1 }, { hidden = 1048576 }]\n",
    )
    .unwrap();
    let err = refused(&["validate", f.to_str().unwrap()], dir.path());
    let at = f.display();
    let most = "allowed: a product of at most 1099511627776 elements (2^40)";
    assert_eq!(
        err.lines().collect::<Vec<_>>(),
        [
            "error: 3 problems:".to_string(),
            format!(
                "{at}:10:1: cell `logits`: parameter `batch` is batch × seq × vocab = 4 × \
                 1000000 × 2000000; {most}"
            ),
            format!(
                "{at}:26:1: cell `scores`: parameter `batch` is batch × heads × seq × seq = 4 × \
                 4 × 600000 × 600000; {most}"
            ),
            // Named by the variant's own field; the first variant, whose
            // sizes fit, adds nothing.
            format!(
                "{at}:42:1: cell `wide`: parameter `variants[1].hidden` is 4 × hidden × hidden = \
                 4 × 1048576 × 1048576; {most}"
            ),
        ]
    );
}

#[test]
fn a_decoder_cell_names_the_config_field_that_cannot_be_built() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let f = "tests/fixtures/bad_decoder.toml";
    let gpt2 = "tests/fixtures/gpt2.config.json";
    let not_llama = format!(
        "allowed: a Llama-family config.json ({gpt2}: `model_type` is \"gpt2\": this builds \
         \"llama\", \"qwen2\" and \"mistral\" decoders)"
    );
    let expected = [
        "error: 19 problems:".to_string(),
        format!("{f}:10:1: cell `step`: parameter `config` is {gpt2}; {not_llama}"),
        format!("{f}:11:1: cell `step`: parameter `batch` is 0; allowed: from 1 to 65536"),
        format!("{f}:12:1: cell `step`: parameter `steps` is 1; allowed: at least 2"),
        format!(
            "{f}:13:1: cell `step`: parameter `dtypes[0]` is \"f16\"; allowed: one of f32, bf16"
        ),
        format!(
            "{f}:14:1: cell `step`: parameter `losses` is []; allowed: a list of at least 1 entry"
        ),
        format!(
            "{f}:16:1: cell `step`: check parameter `config` is models/no-such.config.json; \
             allowed: a Llama-family config.json, from the chapter's folder, the working \
             directory or the repository's root (cannot read models/no-such.config.json: No such \
             file or directory (os error 2))"
        ),
        format!(
            "{f}:23:1: cell `shapes`: parameter `device_gib` is 0; allowed: a finite number above 0"
        ),
        format!("{f}:24:1: cell `shapes`: parameter `models[0].config` is {gpt2}; {not_llama}"),
        format!("{f}:32:1: cell `deep`: parameter `layers` is 31; allowed: from 1 to 30"),
        format!(
            "{f}:33:1: cell `deep`: parameter `checkpointing` is []; allowed: a list of at least \
             1 entry"
        ),
        format!(
            "{f}:34:1: cell `deep`: parameter `micro_batches[0]` is 3; allowed: a divisor of \
             batch (1)"
        ),
        format!(
            "{f}:34:1: cell `deep`: parameter `micro_batches[1]` is 0; allowed: a divisor of \
             batch (1)"
        ),
        format!(
            "{f}:43:1: cell `shared`: parameter `optimizers[1]` is \"gpu\"; allowed: one of \
             device, offload, zero1, zero2"
        ),
        format!(
            "{f}:44:1: cell `shared`: parameter `ranks` is 4; allowed with zero1 or zero2: at \
             least 2, dividing batch (6)"
        ),
        format!(
            "{f}:45:1: cell `shared`: parameter `checkpointing` is [false]; allowed with zero2: \
             [true] (stage 2 reduce-scatters each layer's gradients as the checkpointed \
             backward makes them)"
        ),
        format!(
            "{f}:54:1: cell `windowed`: parameter `seq` is 8192; allowed: at most the config's \
             attention window (`sliding_window` 4096), which this decoder does not slide past"
        ),
        format!(
            "{f}:55:1: cell `windowed`: parameter `dtypes[2]` is \"f32\"; allowed: each at \
             most once (dtypes[0] is \"f32\" already)"
        ),
        format!(
            "{f}:56:1: cell `windowed`: parameter `micro_batches[1]` is 1; allowed: each at most \
             once (micro_batches[0] is 1 already)"
        ),
        format!(
            "{f}:63:1: cell `same_name`: parameter `models[1].config` is \
             tests/fixtures/../../models/smollm2-135m.config.json; allowed: a file whose name is \
             not models[0]'s: each model's metrics are named by its file's name \
             (`params_smollm2_135m`), so rename one (a Hugging Face download's config.json to \
             the model's name, say)"
        ),
    ];
    let (_, err) = text(&workbook(&["validate", f], root));
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines, expected, "{err}");
}

#[test]
fn an_assertions_device_must_be_cpu_or_cuda_and_its_table_take_expr_and_device() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            r#"assertions = [{ expr = "large_params > 0", device = "gpu" }]"#,
            "dv.toml:9:53: cell `footprint`: assertion `large_params > 0` names device `gpu`, \
             which is neither `cpu` nor `cuda`; did you mean `cpu`?",
        ),
        (
            r#"assertions = [{ expr = "large_params > 0", on = "cpu" }]"#,
            "dv.toml:9:44: unknown field `on`, expected `expr` or `device`",
        ),
        (
            r#"assertions = [{ device = "cpu" }]"#,
            "dv.toml:9:15: missing field `expr`",
        ),
        (
            r#"assertions = ["large_params > 0", 42]"#,
            "dv.toml:9:35: invalid type: integer `42`, expected an expression (\"peak < 0.5 * \
             plain\"), or a table naming the device it holds on ({ expr = \"...\", device = \
             \"cpu\" })",
        ),
        (
            r#"full_size_assertions = [{ expr = "large_params >", device = "cuda" }]"#,
            "dv.toml:9:34: cell `footprint`: assertion `large_params >` does not parse",
        ),
        (
            r#"assertions = [{ expr = "nope > 0", device = "cpu" }]"#,
            "dv.toml:9:24: cell `footprint`: assertion `nope > 0` reads `nope`, which plugin \
             `footprint` does not record",
        ),
    ];
    for (line, expected) in cases {
        let chapter = format!("format_version = 1\nid = \"dv\"\ntitle = \"T\"\n{CELL}{line}\n");
        std::fs::write(dir.path().join("dv.toml"), chapter).unwrap();
        let err = refused(&["validate", "dv.toml"], dir.path());
        assert!(err.contains(expected), "{line}: {err}");
    }
    // Both forms, a device or none, validate.
    let good = r#"assertions = ["large_params > 0", { expr = "small_params > 0" }, { expr = "large_params > small_params", device = "cuda" }]"#;
    let chapter = format!("format_version = 1\nid = \"dv\"\ntitle = \"T\"\n{CELL}{good}\n");
    std::fs::write(dir.path().join("dv.toml"), chapter).unwrap();
    let o = workbook(&["validate", "dv.toml"], dir.path());
    assert!(o.status.success(), "{}", text(&o).1);
}
