//! The JSON Schema of chapter files, with each plugin's parameters.

use super::parse::RawChapter;
use crate::registry::Registry;

/// The JSON Schema of chapter files, for editors that complete and check
/// TOML against one (taplo, Even Better TOML): the format, and each of
/// `registry`'s plugins' parameters under the cells that name it.
/// Draft 7, which those editors read.
pub fn json_schema(registry: &Registry) -> serde_json::Value {
    use serde_json::{json, Value};
    let mut schema = schemars::generate::SchemaSettings::draft07()
        .into_generator()
        .into_root_schema_for::<RawChapter>()
        .to_value();
    let mut definitions = schema
        .get("definitions")
        .cloned()
        .unwrap_or_else(|| json!({}));
    let mut per_plugin = Vec::new();
    for plugin in registry.iter() {
        let info = plugin.info();
        let name = &info.name;
        let mut params = info.params.clone();
        // The plugin's own definitions join the document's, under its name.
        if let Some(Value::Object(defs)) = params.as_object_mut().and_then(|o| o.remove("$defs")) {
            for (k, v) in defs {
                let mut v = v;
                rewrite_refs(&mut v, name);
                // A check table's nested tables are merged over the full
                // one's key by key: their fields are optional too.
                let mut optional = v.clone();
                all_optional(&mut optional);
                definitions[format!("{name}.{k}{OPTIONAL}")] = optional;
                definitions[format!("{name}.{k}")] = v;
            }
        }
        rewrite_refs(&mut params, name);
        if let Some(o) = params.as_object_mut() {
            o.remove("$schema");
            o.remove("title");
        }
        // `check` takes the same fields, none of them required at any depth.
        let mut check = params.clone();
        all_optional(&mut check);
        per_plugin.push(json!({
            "if": { "properties": { "plugin": { "const": name } }, "required": ["plugin"] },
            "then": { "properties": { "params": params, "check": check } }
        }));
    }
    schema["definitions"] = definitions;
    if let Some(cell) = schema.pointer_mut("/definitions/Cell") {
        cell["allOf"] = Value::Array(per_plugin);
    }
    schema
}

/// What the name of a definition whose fields are all optional ends with.
const OPTIONAL: &str = ".optional";

/// `schema` with no field required at any depth, its references pointing
/// at the definitions' optional copies.
fn all_optional(schema: &mut serde_json::Value) {
    use serde_json::Value;
    match schema {
        Value::Object(o) => {
            o.remove("required");
            for (k, x) in o.iter_mut() {
                match (k.as_str(), x) {
                    ("$ref", Value::String(r)) => r.push_str(OPTIONAL),
                    // Keys here are field names, each value a schema.
                    ("properties", Value::Object(fields)) => {
                        fields.values_mut().for_each(all_optional)
                    }
                    // Values, not schemas.
                    ("default" | "examples" | "const" | "enum", _) => {}
                    (_, x) => all_optional(x),
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(all_optional),
        _ => {}
    }
}

/// Points a plugin schema's `#/$defs/X` at the document's
/// `#/definitions/PLUGIN.X`.
fn rewrite_refs(v: &mut serde_json::Value, plugin: &str) {
    use serde_json::Value;
    match v {
        Value::Object(o) => {
            for (k, x) in o.iter_mut() {
                match (k.as_str(), x) {
                    ("$ref", Value::String(r)) => {
                        if let Some(def) = r.strip_prefix("#/$defs/") {
                            *r = format!("#/definitions/{plugin}.{def}");
                        }
                    }
                    (_, x) => rewrite_refs(x, plugin),
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(|x| rewrite_refs(x, plugin)),
        _ => {}
    }
}
