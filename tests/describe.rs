//! `workbook describe`: what each plugin takes and records, derived from
//! its code; the reference page generated from it; and assertions checked
//! against the metrics a plugin declares.

use std::path::Path;
use std::process::{Command, Output};

mod common;
use common::{light, text};

fn workbook(args: &[&str]) -> Output {
    let _light = light();
    Command::new(env!("CARGO_BIN_EXE_workbook"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("WORKBOOK_CHECK_MODE")
        .env_remove("WORKBOOK_CHAPTERS")
        // The built-in plugins alone, whatever external ones PATH holds.
        .env("PATH", "")
        .output()
        .expect("the binary runs")
}

#[test]
fn the_plugin_reference_page_is_current() {
    let infos: Vec<_> = workbook::Registry::builtin()
        .iter()
        .map(|p| p.info())
        .collect();
    let page = workbook::describe::markdown(&infos);
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/plugins.md");
    if std::env::var_os("WORKBOOK_BLESS").is_some() {
        std::fs::write(&path, &page).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == page,
        "docs/plugins.md is stale: regenerate it with `WORKBOOK_BLESS=1 cargo test --test describe`"
    );
    // The page is what the command prints.
    let o = workbook(&["describe", "--format", "markdown"]);
    assert!(o.status.success());
    assert_eq!(text(&o).0, page);
}

#[test]
fn every_built_in_plugin_is_described_from_its_code() {
    for plugin in workbook::Registry::builtin().iter() {
        let info = plugin.info();
        let params = workbook::describe::params(&info);
        assert!(!params.is_empty(), "{}", info.name);
        for p in &params {
            assert!(
                !p.meaning.is_empty(),
                "{}.{} has no doc comment",
                info.name,
                p.name
            );
        }
        assert!(!info.metrics.is_empty(), "{}", info.name);
        for m in &info.metrics {
            assert!(!m.meaning.is_empty(), "{}: {}", info.name, m.name);
        }
    }
    let o = workbook(&["describe", "precision"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(out.starts_with("precision: "), "{out}");
    for line in [
        "  train_steps (integer, default 200, at least 1)\n      Training steps in each dtype.",
        "  scaler.growth_interval (integer, default 2000, at least 1)",
        "  label_noise (number, default 0.2, 0.0 to 1.0)",
        "  skipped_steps_f16 (count)",
    ] {
        assert!(out.contains(line), "{line:?} in:\n{out}");
    }
    let o = workbook(&["describe", "attention", "--format", "json"]);
    let info: serde_json::Value = serde_json::from_str(&text(&o).0).unwrap();
    assert_eq!(info["name"], "attention");
    assert_eq!(info["params"]["properties"]["heads"]["default"], 8);
    assert!(info["metrics"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| m["name"] == "peak_ratio_naive_tiled" && m["unit"] == "ratio"));
}

#[test]
fn an_unknown_plugin_is_refused_with_the_closest_names() {
    let o = workbook(&["describe", "atention"]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        err.starts_with(
            "error: unknown plugin `atention`; did you mean `attention`?; plugins: footprint, \
             accumulation, checkpointing, precision, offload, attention"
        ),
        "{err}"
    );
}

#[test]
fn an_assertion_on_a_metric_the_plugin_never_records_fails_validation() {
    let dir = tempfile::tempdir().unwrap();
    let chapter = dir.path().join("misspelt.toml");
    std::fs::write(
        &chapter,
        "format_version = 1\nid = \"misspelt\"\ntitle = \"t\"\n\n[[cells]]\nid = \"params\"\n\
         title = \"t\"\nplugin = \"footprint\"\nassertions = [\"small_parms == 17802\"]\n",
    )
    .unwrap();
    let o = workbook(&["validate", chapter.to_str().unwrap()]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains(
            "misspelt.toml:9:15: cell `params`: assertion `small_parms == 17802` reads \
             `small_parms`, which plugin `footprint` does not record; did you mean \
             `small_params`?; its metrics: small_params, large_params"
        ),
        "{err}"
    );
}

#[test]
fn a_misspelt_parameter_or_chapter_gets_the_closest_names() {
    let dir = tempfile::tempdir().unwrap();
    let chapter = dir.path().join("param.toml");
    std::fs::write(
        &chapter,
        "format_version = 1\nid = \"param\"\ntitle = \"t\"\n\n[[cells]]\nid = \"a\"\n\
         title = \"t\"\nplugin = \"footprint\"\nparams = { bacth = 4 }\n",
    )
    .unwrap();
    let o = workbook(&["validate", chapter.to_str().unwrap()]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("; did you mean `batch`?"), "{err}");
    let o = workbook(&["validate", "chapter"]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("; did you mean `chapter2` or `chapter3` or `chapter4`?"),
        "{err}"
    );
    let o = workbook(&["run", "chapter2", "--cell", "footprnt"]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("chapter `chapter2` has no cell `footprnt`; did you mean `footprint`?"),
        "{err}"
    );
}

/// The chapter schema, as generated from the chapter format and the
/// built-in plugins.
fn chapter_schema() -> serde_json::Value {
    workbook::chapter::json_schema(&workbook::Registry::builtin())
}

#[test]
fn the_chapter_schema_is_current() {
    let mut text = serde_json::to_string_pretty(&chapter_schema()).unwrap();
    text.push('\n');
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/chapter.schema.json");
    if std::env::var_os("WORKBOOK_BLESS").is_some() {
        std::fs::write(&path, &text).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == text,
        "docs/chapter.schema.json is stale: regenerate it with `WORKBOOK_BLESS=1 cargo test \
         --test describe`"
    );
}

fn toml_as_json(text: &str) -> serde_json::Value {
    serde_json::to_value(toml::from_str::<toml::Table>(text).unwrap()).unwrap()
}

#[test]
fn the_chapter_schema_accepts_the_chapters_and_catches_what_validate_catches() {
    let schema = chapter_schema();
    let validator = jsonschema::draft7::new(&schema).unwrap();
    // Every chapter, check tables that override one field of a nested
    // table included.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("chapters");
    let mut chapters: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    chapters.sort();
    assert!(chapters.len() >= 4, "{chapters:?}");
    for path in chapters {
        let text = std::fs::read_to_string(&path).unwrap();
        let errors: Vec<String> = validator
            .iter_errors(&toml_as_json(&text))
            .map(|e| format!("{}: {e}", e.instance_path()))
            .collect();
        assert!(errors.is_empty(), "{}: {errors:?}", path.display());
    }
    let cell = |plugin: &str, params: &str| {
        toml_as_json(&format!(
            "format_version = 1\nid = \"c\"\ntitle = \"t\"\n[[cells]]\nid = \"a\"\n\
             title = \"t\"\nplugin = \"{plugin}\"\n{params}\n"
        ))
    };
    assert!(validator.is_valid(&cell("footprint", "params = { batch = 4 }")));
    assert!(validator.is_valid(&cell("gpt_training", "check = { model = { seq = 16 } }")));
    // A misspelt parameter, a parameter of the wrong type, one out of its
    // range, a misspelt field of the cell.
    for (plugin, params) in [
        ("footprint", "params = { bacth = 4 }"),
        ("footprint", "params = { batch = \"four\" }"),
        ("attention", "check = { q_block = 0 }"),
        (
            "precision",
            "params = { scaler = { init_scale = 2.0, growth = 2 } }",
        ),
        ("footprint", "asserts = [\"x > 1\"]"),
        ("gpt_training", "check = { model = { sq = 16 } }"),
    ] {
        assert!(
            !validator.is_valid(&cell(plugin, params)),
            "{plugin}: {params}"
        );
    }
}
