//! Parameters that name files, given from the chapter's folder.
//!
//! A plugin marks such a parameter in its schema with
//! [`PATH_FORMAT`](workbook_sdk::file::PATH_FORMAT). A relative path the
//! chapter's folder holds is handed to the plugin joined to that folder, so
//! a chapter and the `config.json` beside it run from any working
//! directory; any other path is handed on as written, for the plugin to
//! find (a decoder's config tries the working directory, then the
//! repository's root).

use std::path::Path;

use serde_json::Value as Json;
use workbook_sdk::file::PATH_FORMAT;

/// A path as the chapter wrote it, and as the plugin is handed it.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Joined {
    /// As written in the chapter: what an error says was given.
    pub written: String,
    /// From the chapter's folder: what the plugin reads.
    pub joined: String,
}

/// Joins every relative path in `params` that `schema` (a plugin's
/// parameters' JSON Schema) marks as a path, at any depth, to `folder`
/// where the file is there, and returns what it joined. A chapter in the
/// working directory (`folder` empty) is left as it is: its paths already
/// name its folder's files.
pub(super) fn from_folder(params: &mut toml::Table, schema: &Json, folder: &Path) -> Vec<Joined> {
    let mut joined = Vec::new();
    if !folder.as_os_str().is_empty() {
        table(params, schema, schema, folder, &mut joined);
    }
    joined
}

type Found<'a> = &'a mut Vec<Joined>;

fn table(values: &mut toml::Table, schema: &Json, root: &Json, folder: &Path, found: Found) {
    let alternatives = alternatives(schema, root);
    for (key, value) in values.iter_mut() {
        let field = alternatives
            .iter()
            .find_map(|s| s.get("properties")?.get(key.as_str()));
        if let Some(field) = field {
            visit(value, field, root, folder, found);
        }
    }
}

fn visit(value: &mut toml::Value, schema: &Json, root: &Json, folder: &Path, found: Found) {
    let alternatives = alternatives(schema, root);
    match value {
        toml::Value::String(path)
            if alternatives
                .iter()
                .any(|s| s.get("format").and_then(Json::as_str) == Some(PATH_FORMAT)) =>
        {
            if let Some(there) = in_folder(path, folder) {
                found.push(Joined {
                    written: std::mem::replace(path, there.clone()),
                    joined: there,
                });
            }
        }
        toml::Value::Table(values) => table(values, schema, root, folder, found),
        toml::Value::Array(items) => {
            if let Some(item) = alternatives.iter().find_map(|s| s.get("items")) {
                for value in items {
                    visit(value, item, root, folder, found);
                }
            }
        }
        _ => {}
    }
}

/// `path` from `folder` when it is relative and something is there (a
/// dangling link or a pipe too, so that the plugin's error names it).
fn in_folder(path: &str, folder: &Path) -> Option<String> {
    let given = Path::new(path);
    if given.is_absolute() {
        return None;
    }
    let there = folder.join(given);
    std::fs::symlink_metadata(&there).ok()?;
    there.to_str().map(str::to_string)
}

/// The schemas a value of `schema` may follow: the schema itself and the
/// members of its `anyOf`, `oneOf` and `allOf` (an `Option`'s is
/// `anyOf: [T, null]`), each `$ref` followed once.
fn alternatives<'a>(schema: &'a Json, root: &'a Json) -> Vec<&'a Json> {
    let mut found = vec![follow(schema, root)];
    for key in ["anyOf", "oneOf", "allOf"] {
        if let Some(members) = found[0].get(key).and_then(Json::as_array) {
            found.extend(members.iter().map(|m| follow(m, root)));
        }
    }
    found
}

/// The schema a `$ref` (`#/$defs/Published`) names within `root`, or
/// `schema` itself.
fn follow<'a>(schema: &'a Json, root: &'a Json) -> &'a Json {
    schema
        .get("$ref")
        .and_then(Json::as_str)
        .and_then(|r| r.strip_prefix('#'))
        .and_then(|pointer| root.pointer(pointer))
        .unwrap_or(schema)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schema() -> Json {
        json!({
            "type": "object",
            "properties": {
                "config": { "type": "string", "format": "path" },
                "label": { "type": "string" },
                "maybe": { "type": ["string", "null"], "format": "path" },
                "models": { "type": "array", "items": { "$ref": "#/$defs/Published" } },
                "inner": { "anyOf": [{ "$ref": "#/$defs/Published" }, { "type": "null" }] }
            },
            "$defs": {
                "Published": {
                    "type": "object",
                    "properties": { "config": { "type": "string", "format": "path" } }
                }
            }
        })
    }

    #[test]
    fn a_marked_path_the_folder_holds_is_joined_to_it_at_any_depth_and_nothing_else_is() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("mine.json"), "{}").unwrap();
        let mut params: toml::Table = toml::from_str(
            r#"
            config = "mine.json"
            label = "mine.json"
            maybe = "absent.json"
            models = [{ config = "mine.json" }, { config = "absent.json" }]
            inner = { config = "mine.json" }
            "#,
        )
        .unwrap();
        let joined = from_folder(&mut params, &schema(), dir.path());
        let there = dir.path().join("mine.json").to_str().unwrap().to_string();
        let mine = Joined {
            written: "mine.json".into(),
            joined: there.clone(),
        };
        assert_eq!(joined, vec![mine.clone(), mine.clone(), mine]);
        let expected: toml::Table = toml::from_str(&format!(
            r#"
            config = "{there}"
            label = "mine.json"
            maybe = "absent.json"
            models = [{{ config = "{there}" }}, {{ config = "absent.json" }}]
            inner = {{ config = "{there}" }}
            "#
        ))
        .unwrap();
        assert_eq!(params, expected);
    }

    #[test]
    fn an_absolute_path_a_chapter_in_the_working_directory_and_a_dangling_link() {
        let dir = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(dir.path().join("gone"), dir.path().join("link.json")).unwrap();
        std::fs::write(dir.path().join("mine.json"), "{}").unwrap();
        let absolute = dir.path().join("mine.json").to_str().unwrap().to_string();
        let text = format!("config = \"{absolute}\"\nmaybe = \"link.json\"");
        let mut params: toml::Table = toml::from_str(&text).unwrap();
        let joined = from_folder(&mut params, &schema(), dir.path());
        assert_eq!(params["config"].as_str(), Some(absolute.as_str()));
        let link = dir.path().join("link.json");
        assert_eq!(params["maybe"].as_str(), link.to_str());
        let link = Joined {
            written: "link.json".into(),
            joined: link.to_str().unwrap().into(),
        };
        assert_eq!(joined, vec![link]);

        let mut here: toml::Table = toml::from_str("config = \"mine.json\"").unwrap();
        assert_eq!(from_folder(&mut here, &schema(), Path::new("")), vec![]);
        assert_eq!(here["config"].as_str(), Some("mine.json"));
    }
}
