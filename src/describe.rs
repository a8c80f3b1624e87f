//! What `workbook describe` prints: a plugin's parameters (from the JSON
//! Schema of its parameter type) and metrics (as it declares them), as
//! text or as the Markdown of docs/plugins.md.

use std::cell::Cell;

use serde_json::Value;
use workbook_sdk::protocol::PluginInfo;
use workbook_sdk::Unit;

/// One parameter, as read from the schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Param {
    /// Its name in the chapter's `params` table.
    pub name: String,
    /// Its type (`integer`, `array of integer`, `one of "f32", "bf16"`).
    pub kind: String,
    /// Its default, as TOML would write it; none when it must be given.
    pub default: Option<String>,
    /// Its range, where the schema states one.
    pub range: Option<String>,
    /// Its doc comment.
    pub meaning: String,
}

/// The parameters of a plugin, in the schema's order; a table's fields
/// follow it, named `table.field`.
pub fn params(info: &PluginInfo) -> Vec<Param> {
    let mut out = Vec::new();
    let work = Cell::new(WORK);
    fields(&info.params, &info.params, "", &mut out, 0, &work);
    out
}

/// How deep tables and types are followed: a schema (an external plugin's
/// is the plugin's to write) may refer to itself.
const DEPTH: usize = 8;

/// How many schema nodes one description may visit in all: depth alone
/// does not bound a schema whose every level refers to itself several
/// times (ten `anyOf` branches eight deep are 10^8 of them).
const WORK: usize = 20_000;

/// Takes one step of the work left; `false` once it is spent.
fn spend(work: &Cell<usize>) -> bool {
    match work.get() {
        0 => false,
        n => {
            work.set(n - 1);
            true
        }
    }
}

fn fields(
    root: &Value,
    object: &Value,
    prefix: &str,
    out: &mut Vec<Param>,
    depth: usize,
    work: &Cell<usize>,
) {
    if depth > DEPTH {
        return;
    }
    let required: Vec<&str> = object
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let Some(properties) = object.get("properties").and_then(Value::as_object) else {
        return;
    };
    for (name, p) in properties {
        if !spend(work) {
            return;
        }
        let resolved = resolve(root, p);
        let full = format!("{prefix}{name}");
        out.push(Param {
            name: full.clone(),
            kind: kind(root, p, 0, work),
            default: p
                .get("default")
                .map(toml_text)
                .or_else(|| (!required.contains(&name.as_str())).then(|| "(none)".to_string())),
            range: range(resolved),
            meaning: description(p)
                .or_else(|| description(resolved))
                .unwrap_or_default(),
        });
        if resolved.get("properties").is_some() {
            fields(root, resolved, &format!("{full}."), out, depth + 1, work);
        }
    }
}

fn description(v: &Value) -> Option<String> {
    v.get("description")
        .and_then(Value::as_str)
        .map(|d| d.split_whitespace().collect::<Vec<_>>().join(" "))
}

/// Follows a `$ref` into the schema's `$defs`.
fn resolve<'a>(root: &'a Value, v: &'a Value) -> &'a Value {
    match v.get("$ref").and_then(Value::as_str) {
        Some(r) => r
            .strip_prefix("#/$defs/")
            .and_then(|name| root.get("$defs")?.get(name))
            .unwrap_or(v),
        None => v,
    }
}

fn kind(root: &Value, v: &Value, depth: usize, work: &Cell<usize>) -> String {
    if depth > DEPTH || !spend(work) {
        return "…".to_string();
    }
    let v = resolve(root, v);
    if let Some(values) = v.get("enum").and_then(Value::as_array) {
        return one_of(values.iter());
    }
    if let Some(c) = v.get("const") {
        return toml_text(c);
    }
    for key in ["oneOf", "anyOf"] {
        if let Some(options) = v.get(key).and_then(Value::as_array) {
            // `Option<T>` is `T` or null: say optional instead.
            let is_null = |o: &Value| o.get("type").and_then(Value::as_str) == Some("null");
            let optional = options.iter().any(is_null);
            let options: Vec<&Value> = options.iter().filter(|o| !is_null(o)).collect();
            // An enum of documented variants: each option a `const` or an
            // `enum`, read as one list of values.
            let values: Option<Vec<&Value>> = options
                .iter()
                .map(|o| {
                    let o = resolve(root, o);
                    match (o.get("const"), o.get("enum").and_then(Value::as_array)) {
                        (Some(c), _) => Some(vec![c]),
                        (None, Some(e)) => Some(e.iter().collect()),
                        _ => None,
                    }
                })
                .collect::<Option<Vec<_>>>()
                .map(|v| v.concat());
            let text = match values {
                Some(values) if !values.is_empty() => one_of(values.into_iter()),
                _ => options
                    .iter()
                    .map(|o| kind(root, o, depth + 1, work))
                    .collect::<Vec<_>>()
                    .join(" or "),
            };
            return if optional {
                format!("{text} (optional)")
            } else {
                text
            };
        }
    }
    match v.get("type") {
        Some(Value::String(t)) if t == "array" => match v.get("items") {
            Some(items) => format!("array of {}", kind(root, items, depth + 1, work)),
            None => "array".to_string(),
        },
        Some(Value::String(t)) if t == "string" && is_path(v) => "path".to_string(),
        Some(Value::String(t)) => t.clone(),
        Some(Value::Array(ts)) => {
            let ts: Vec<&str> = ts
                .iter()
                .filter_map(Value::as_str)
                .filter(|t| *t != "null")
                .collect();
            let base = match ts.join(" or ") {
                base if base == "string" && is_path(v) => "path".to_string(),
                base => base,
            };
            if base == "array" {
                match v.get("items") {
                    Some(items) => {
                        format!("array of {} (optional)", kind(root, items, depth + 1, work))
                    }
                    None => "array (optional)".to_string(),
                }
            } else {
                format!("{base} (optional)")
            }
        }
        _ => "any".to_string(),
    }
}

/// A string that names a file, which a chapter gives from its folder.
fn is_path(v: &Value) -> bool {
    v.get("format").and_then(Value::as_str) == Some(workbook_sdk::file::PATH_FORMAT)
}

fn one_of<'a>(values: impl Iterator<Item = &'a Value>) -> String {
    let names: Vec<String> = values.map(toml_text).collect();
    format!("one of {}", names.join(", "))
}

fn range(v: &Value) -> Option<String> {
    // schemars states that unsigned integers are at least 0: the type says so.
    let unsigned = v
        .get("format")
        .and_then(Value::as_str)
        .is_some_and(|f| f.starts_with("uint"));
    let min = v
        .get("minimum")
        .filter(|m| !(unsigned && m.as_f64() == Some(0.0)))
        .map(toml_text);
    let max = v.get("maximum").map(toml_text);
    match (min, max) {
        (Some(a), Some(b)) => Some(format!("{a} to {b}")),
        (Some(a), None) => Some(format!("at least {a}")),
        (None, Some(b)) => Some(format!("at most {b}")),
        (None, None) => None,
    }
}

/// A JSON value as a chapter's TOML would write it.
fn toml_text(v: &Value) -> String {
    match v {
        Value::Null => "(none)".to_string(),
        Value::String(s) => format!("\"{s}\""),
        Value::Array(a) => format!(
            "[{}]",
            a.iter().map(toml_text).collect::<Vec<_>>().join(", ")
        ),
        Value::Object(o) => format!(
            "{{ {} }}",
            o.iter()
                .map(|(k, v)| format!("{k} = {}", toml_text(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        other => other.to_string(),
    }
}

fn unit(u: Unit) -> &'static str {
    match u {
        Unit::None => "number",
        Unit::Bytes => "bytes",
        Unit::Seconds => "seconds",
        Unit::Count => "count",
        Unit::Ratio => "ratio",
    }
}

/// A plugin as readable text.
pub fn text(info: &PluginInfo) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(out, "{}: {}", info.name, info.description);
    let params = params(info);
    let _ = writeln!(out, "\nparameters:");
    if params.is_empty() {
        let _ = writeln!(out, "  (none)");
    }
    for p in &params {
        let _ = write!(out, "  {} ({}", p.name, p.kind);
        if let Some(d) = &p.default {
            let _ = write!(out, ", default {d}");
        }
        if let Some(r) = &p.range {
            let _ = write!(out, ", {r}");
        }
        let _ = writeln!(out, ")");
        if !p.meaning.is_empty() {
            let _ = writeln!(out, "      {}", p.meaning);
        }
    }
    let _ = writeln!(out, "\nmetrics:");
    for m in &info.metrics {
        let _ = writeln!(out, "  {} ({})", m.name, unit(m.unit));
        if !m.meaning.is_empty() {
            let _ = writeln!(out, "      {}", m.meaning);
        }
    }
    out
}

fn cell(s: &str) -> String {
    s.replace('|', "\\|")
}

/// The reference page of `plugins`: docs/plugins.md.
pub fn markdown(plugins: &[PluginInfo]) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(out, "# Plugins\n");
    let _ = writeln!(
        out,
        "Each plugin's parameters and the metrics it records, generated by `workbook \
         describe --format markdown` from the plugins' code (their parameter types' JSON \
         Schema and the metrics they declare). In this repository, docs/plugins.md holds the \
         built-in plugins': do not edit it; `cargo test --test describe` fails when it is \
         stale, and `WORKBOOK_BLESS=1 cargo test --test describe` rewrites it.\n"
    );
    for info in plugins {
        let _ = writeln!(out, "## `{}`\n\n{}\n", info.name, info.description);
        let params = params(info);
        let _ = writeln!(out, "### Parameters\n");
        if params.is_empty() {
            let _ = writeln!(out, "None.\n");
        } else {
            let _ = writeln!(
                out,
                "| name | type | default | meaning |\n|---|---|---|---|"
            );
            for p in &params {
                let mut meaning = p.meaning.clone();
                if let Some(r) = &p.range {
                    meaning = format!("{meaning} ({r})");
                }
                let _ = writeln!(
                    out,
                    "| `{}` | {} | {} | {} |",
                    p.name,
                    cell(&p.kind),
                    p.default
                        .as_deref()
                        .map(|d| format!("`{}`", cell(d)))
                        .unwrap_or_else(|| "required".to_string()),
                    cell(&meaning)
                );
            }
            let _ = writeln!(out);
        }
        let _ = writeln!(out, "### Metrics\n");
        let _ = writeln!(out, "| name | unit | meaning |\n|---|---|---|");
        for m in &info.metrics {
            let _ = writeln!(
                out,
                "| `{}` | {} | {} |",
                m.name,
                unit(m.unit),
                cell(&m.meaning)
            );
        }
        let _ = writeln!(out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn info(params: Value) -> PluginInfo {
        PluginInfo {
            name: "p".into(),
            description: String::new(),
            params,
            metrics: Vec::new(),
        }
    }

    fn kinds(params: Value) -> Vec<(String, String)> {
        super::params(&info(params))
            .into_iter()
            .map(|p| (p.name, p.kind))
            .collect()
    }

    #[test]
    fn enums_options_and_mixed_types_read_as_written() {
        let schema = json!({
            "properties": {
                "mode": { "$ref": "#/$defs/Mode" },
                "maybe_mode": { "anyOf": [{ "$ref": "#/$defs/Mode" }, { "type": "null" }] },
                "size": { "anyOf": [{ "type": "integer" }, { "const": "auto" }] },
                "widths": { "type": ["array", "null"], "items": { "type": "integer" } }
            },
            "$defs": {
                "Mode": { "oneOf": [{ "const": "fast" }, { "enum": ["slow", "exact"] }] }
            }
        });
        assert_eq!(
            kinds(schema),
            [
                ("mode", "one of \"fast\", \"slow\", \"exact\""),
                (
                    "maybe_mode",
                    "one of \"fast\", \"slow\", \"exact\" (optional)"
                ),
                ("size", "integer or \"auto\""),
                ("widths", "array of integer (optional)"),
            ]
            .map(|(a, b)| (a.to_string(), b.to_string()))
        );
    }

    #[test]
    fn a_schema_that_refers_to_itself_is_read_to_a_bounded_depth() {
        let schema = json!({
            "properties": { "node": { "$ref": "#/$defs/Node" } },
            "$defs": {
                "Node": {
                    "type": "object",
                    "properties": {
                        "next": { "$ref": "#/$defs/Node" },
                        "list": { "type": "array", "items": { "$ref": "#/$defs/List" } }
                    }
                },
                "List": { "type": "array", "items": { "$ref": "#/$defs/List" } }
            }
        });
        let read = kinds(schema);
        // `node`, then `node.next`, `node.next.next`, ... down to the bound.
        assert!(
            read.len() > DEPTH && read.len() < 4 * DEPTH,
            "{}",
            read.len()
        );
        assert!(read.iter().any(|(_, k)| k.ends_with("…")), "{read:?}");
    }
}
