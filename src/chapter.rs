//! Chapter files: their format, how they are found, and their validation.
//!
//! A chapter is a TOML file:
//!
//! ```toml
//! format_version = 1
//! id = "chapter2"
//! title = "Memory Optimization"
//! intro = "Why memory matters..."
//!
//! [[cells]]
//! id = "footprint"                       # unique in the chapter
//! title = "2.1 Parameter footprint"
//! plugin = "footprint"                   # a registered plugin
//! prose = "Markdown shown before the results."
//! assertions = ["large_params > small_params"]
//! full_size_assertions = ["large_params > 300000"]  # checked at full size only
//! [cells.params]                         # full-size parameters
//! batch = 32
//! [cells.check]                          # laid over `params` in check mode
//! batch = 8
//! ```
//!
//! Loading validates everything that can be checked without running: the
//! format version, unique cell ids, known plugins, parameters that fit each
//! plugin (in both modes), and assertions that parse. Each error names the
//! file, line and column, the cell, and what was expected.

use std::fmt;
use std::path::{Path, PathBuf};

use indexmap::IndexMap;
use serde::Deserialize;
use toml::Spanned;

use crate::assertion::Assertion;
use crate::excerpt::{excerpt, quote};

/// How many characters of a plugin's "allowed" a message quotes.
const ALLOWED: usize = 400;
use crate::registry::{Registry, Unusable};
use crate::suggest;

/// The chapter format this version reads.
pub const FORMAT_VERSION: u32 = 1;

/// A place in a chapter file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    /// The file.
    pub path: PathBuf,
    /// 1-based line.
    pub line: usize,
    /// 1-based column.
    pub column: usize,
}

impl Location {
    /// The place of byte `offset` of `text`, read from `path`.
    pub fn in_text(path: &Path, text: &str, offset: usize) -> Self {
        LineIndex::new(text).locate(path, text, offset)
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.path.display(), self.line, self.column)
    }
}

/// Why a chapter could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ChapterError {
    /// No chapter of that name.
    #[error(
        "chapter `{name}` not found (looked in {searched}){suggestion}; available chapters: \
         {available}"
    )]
    NotFound {
        /// What was asked for.
        name: String,
        /// `; did you mean ...?`, or nothing.
        suggestion: String,
        /// The folders searched, joined.
        searched: String,
        /// The chapters that exist, joined.
        available: String,
    },
    /// The file could not be read. The cause is part of the message, not
    /// a separate error source, so that it is said once.
    #[error("cannot read {path}: {cause}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        cause: std::io::Error,
    },
    /// Several problems in one chapter, in file order.
    #[error("{}", several(.0))]
    Several(Vec<ChapterError>),
    /// The path names something that is not a chapter file.
    #[error("{path} {what}; a chapter is a .toml file")]
    NotAFile {
        /// The path.
        path: PathBuf,
        /// What it is instead: a directory, a FIFO, a dangling link.
        what: String,
    },
    /// The file is not a valid chapter.
    #[error("{location}: {message}")]
    Invalid {
        /// Where.
        location: Location,
        /// The cell at fault, if any.
        cell: Option<String>,
        /// What is wrong and what was expected.
        message: String,
    },
}

fn several(errors: &[ChapterError]) -> String {
    let lines: Vec<String> = errors.iter().map(ToString::to_string).collect();
    format!("{} problems:\n{}", errors.len(), lines.join("\n"))
}

/// A chapter file.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(title = "workbook chapter")]
struct RawChapter {
    /// The chapter format's version: 1.
    #[schemars(with = "u32", range(min = 1, max = 1))]
    format_version: Spanned<u32>,
    /// The chapter's id (`chapter2`): letters, digits, `_` or `-`, starting
    /// with a letter. It names the files written for it.
    #[schemars(with = "String", regex(pattern = r"^[A-Za-z][A-Za-z0-9_-]{0,63}$"))]
    id: Spanned<String>,
    /// The chapter's title.
    title: String,
    /// Markdown shown before the cells.
    #[serde(default)]
    intro: String,
    /// The cells, run in order.
    #[serde(default)]
    cells: Vec<RawCell>,
}

type SpannedTable = IndexMap<Spanned<String>, Spanned<toml::Value>>;

/// One cell: an experiment a plugin runs, and what must hold of what it
/// measured.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Cell")]
struct RawCell {
    /// Unique in the chapter: letters, digits, `_` or `-`, starting with a
    /// letter.
    #[schemars(with = "String", regex(pattern = r"^[A-Za-z][A-Za-z0-9_-]{0,63}$"))]
    id: Spanned<String>,
    /// The cell's heading.
    title: String,
    /// Markdown shown before the results.
    #[serde(default)]
    prose: String,
    /// The plugin that runs the cell (`workbook list` shows them).
    #[schemars(with = "String")]
    plugin: Spanned<String>,
    /// The plugin's parameters at full size (`workbook describe PLUGIN`).
    #[serde(default)]
    #[schemars(with = "std::collections::BTreeMap<String, serde_json::Value>")]
    params: SpannedTable,
    /// Parameters laid over `params` in check mode (`--check`, as CI runs).
    #[serde(default)]
    #[schemars(with = "std::collections::BTreeMap<String, serde_json::Value>")]
    check: SpannedTable,
    /// Expressions over the cell's metrics that must be true
    /// (`peak_ratio < 0.5`).
    #[serde(default)]
    #[schemars(with = "Vec<String>")]
    assertions: Vec<Spanned<String>>,
    /// Assertions checked at full size only (reported as skipped in check
    /// mode).
    #[serde(default)]
    #[schemars(with = "Vec<String>")]
    full_size_assertions: Vec<Spanned<String>>,
    /// The cell's time limit in seconds.
    #[schemars(with = "Option<f64>", range(min = 0.001))]
    timeout: Option<Spanned<f64>>,
}

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
                definitions[format!("{name}.{k}")] = v;
            }
        }
        rewrite_refs(&mut params, name);
        if let Some(o) = params.as_object_mut() {
            o.remove("$schema");
            o.remove("title");
        }
        // `check` takes the same fields, none of them required.
        let mut check = params.clone();
        if let Some(o) = check.as_object_mut() {
            o.remove("required");
        }
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

/// A validated chapter.
#[derive(Debug, Clone)]
pub struct Chapter {
    /// The file it was read from.
    pub path: PathBuf,
    /// Its id, such as `chapter2`.
    pub id: String,
    /// Its title.
    pub title: String,
    /// Markdown shown before the cells.
    pub intro: String,
    /// The cells, in order.
    pub cells: Vec<Cell>,
}

/// A validated cell.
#[derive(Debug, Clone)]
pub struct Cell {
    /// Unique within the chapter.
    pub id: String,
    /// The heading.
    pub title: String,
    /// Markdown shown before the results.
    pub prose: String,
    /// The plugin that runs it.
    pub plugin: String,
    /// Full-size parameters.
    pub params: toml::Table,
    /// Check-size parameters: `params` with the `check` table laid over it.
    pub check_params: toml::Table,
    /// The assertions, parsed.
    pub assertions: Vec<Assertion>,
    /// Assertions about effects that only show at full size (timings with a
    /// thin margin at check size, ratios that grow with size): checked in a
    /// full-size run, reported as skipped at check size.
    pub full_size_assertions: Vec<Assertion>,
    /// The cell's time limit, where the chapter sets one (`timeout`, in
    /// seconds); `--timeout` on the command line overrides it.
    pub timeout: Option<std::time::Duration>,
}

impl Cell {
    /// The parameters of the given mode.
    pub fn params_for(&self, check: bool) -> &toml::Table {
        if check {
            &self.check_params
        } else {
            &self.params
        }
    }
}

/// Where each line of a text starts: a chapter of n cells is located n
/// times, each in O(log n) rather than by reading from the file's start.
struct LineIndex {
    starts: Vec<usize>,
}

impl LineIndex {
    fn new(text: &str) -> Self {
        Self {
            starts: std::iter::once(0)
                .chain(text.match_indices('\n').map(|(i, _)| i + 1))
                .collect(),
        }
    }

    /// Byte `offset` of `text` (the text indexed) as a 1-based line and
    /// column (in characters).
    fn locate(&self, path: &Path, text: &str, offset: usize) -> Location {
        let mut offset = offset.min(text.len());
        while !text.is_char_boundary(offset) {
            offset -= 1;
        }
        let line = self.starts.partition_point(|&s| s <= offset);
        let start = self.starts[line - 1];
        Location {
            path: path.to_path_buf(),
            line,
            column: text[start..offset].chars().count() + 1,
        }
    }
}

fn plain(table: &SpannedTable) -> toml::Table {
    table
        .iter()
        .map(|(k, v)| (k.get_ref().clone(), v.get_ref().clone()))
        .collect()
}

struct Source<'a> {
    path: &'a Path,
    text: &'a str,
    lines: LineIndex,
}

impl<'a> Source<'a> {
    fn new(path: &'a Path, text: &'a str) -> Self {
        Self {
            path,
            text,
            lines: LineIndex::new(text),
        }
    }

    fn at(&self, span: std::ops::Range<usize>) -> Location {
        self.lines.locate(self.path, self.text, span.start)
    }

    fn error(
        &self,
        span: std::ops::Range<usize>,
        cell: Option<&str>,
        message: String,
    ) -> ChapterError {
        let message = match cell {
            Some(id) => format!("cell `{id}`: {message}"),
            None => message,
        };
        ChapterError::Invalid {
            location: self.at(span),
            cell: cell.map(str::to_string),
            message,
        }
    }
}

/// Parses and validates chapter text read from `path`.
pub fn parse(path: &Path, text: &str, registry: &Registry) -> Result<Chapter, ChapterError> {
    let src = Source::new(path, text);
    let raw: RawChapter = toml::from_str(text).map_err(|e| {
        let span = e.span().unwrap_or(0..0);
        src.error(span, None, e.message().trim().to_string())
    })?;
    if *raw.format_version.get_ref() != FORMAT_VERSION {
        return Err(src.error(
            raw.format_version.span(),
            None,
            format!(
                "format_version {} is not supported; this workbook reads format_version {FORMAT_VERSION} (upgrade workbook for newer chapters)",
                raw.format_version.get_ref()
            ),
        ));
    }
    // Every problem of the chapter is reported, not only the first: each
    // cell is checked whatever its neighbours hold.
    let mut errors: Vec<ChapterError> = Vec::new();
    if !is_identifier(raw.id.get_ref()) {
        errors.push(src.error(
            raw.id.span(),
            None,
            format!(
                "chapter id `{}` must be letters, digits, `_` or `-`, starting with a letter, \
                 at most {MAX_ID} characters (it names files such as CHAPTER.ipynb)",
                quote(raw.id.get_ref())
            ),
        ));
    }
    let mut cells: Vec<Cell> = Vec::with_capacity(raw.cells.len());
    let mut seen: IndexMap<String, Location> = IndexMap::new();
    for rc in raw.cells {
        let before = errors.len();
        let id = rc.id.get_ref().clone();
        if !is_identifier(&id) {
            errors.push(src.error(
                rc.id.span(),
                None,
                format!(
                    "cell id `{}` must be letters, digits, `_` or `-`, starting with a letter, \
                     at most {MAX_ID} characters",
                    quote(&id)
                ),
            ));
        } else if let Some(first) = seen.get(&id) {
            errors.push(src.error(
                rc.id.span(),
                Some(&id),
                format!("duplicate cell id; first defined at line {}", first.line),
            ));
        } else {
            seen.insert(id.clone(), src.at(rc.id.span()));
        }
        let shown_id = quote(&id);
        let params = plain(&rc.params);
        let mut check_params = params.clone();
        check_params.extend(plain(&rc.check));
        let plugin_name = rc.plugin.get_ref();
        match registry.resolve(plugin_name) {
            Err(unusable) => errors.push(src.error(
                rc.plugin.span(),
                Some(&shown_id),
                match unusable {
                    Unusable::Refused(why) => {
                        format!("plugin `{}` cannot be used: {why}", quote(plugin_name))
                    }
                    Unusable::Unknown => format!(
                        "unknown plugin `{}`{}; registered plugins: {} (an external plugin is \
                         an executable `workbook-plugin-NAME` on PATH or in a `plugins` folder \
                         beside the chapter)",
                        quote(plugin_name),
                        suggest::did_you_mean(plugin_name, registry.names()),
                        registry.names().join(", ")
                    ),
                },
            )),
            Ok(plugin) => {
                let cell = CellSource {
                    src: &src,
                    id: &shown_id,
                    params: &rc.params,
                    check: &rc.check,
                    plugin: rc.plugin.span(),
                };
                cell.check_params(plugin, &params, &check_params, &mut errors);
            }
        }
        let declared = registry.get(plugin_name).map(|p| p.declared_metrics());
        let mut parse_all = |list: &[Spanned<String>]| {
            let mut parsed = Vec::new();
            for a in list {
                match Assertion::parse(a.get_ref()) {
                    Ok(assertion) => {
                        if let Some(declared) = &declared {
                            for metric in assertion.reads() {
                                if declared.iter().any(|d| d.matches(metric)) {
                                    continue;
                                }
                                errors.push(src.error(
                                    a.span(),
                                    Some(&shown_id),
                                    format!(
                                        "assertion `{}` reads `{metric}`, which plugin `{}` does \
                                         not record{}; its metrics: {} (`workbook describe {}` \
                                         says what each is)",
                                        quote(a.get_ref()),
                                        quote(plugin_name),
                                        suggest::did_you_mean(
                                            metric,
                                            declared.iter().map(|d| d.name.as_str())
                                        ),
                                        declared
                                            .iter()
                                            .map(|d| d.name.as_str())
                                            .collect::<Vec<_>>()
                                            .join(", "),
                                        quote(plugin_name),
                                    ),
                                ));
                            }
                        }
                        parsed.push(assertion)
                    }
                    Err(message) => errors.push(src.error(
                        a.span(),
                        Some(&shown_id),
                        format!(
                            "assertion `{}` does not parse: {}",
                            quote(a.get_ref()),
                            quote(&message)
                        ),
                    )),
                }
            }
            parsed
        };
        let assertions = parse_all(&rc.assertions);
        let full_size_assertions = parse_all(&rc.full_size_assertions);
        let timeout = match &rc.timeout {
            None => None,
            Some(t) => match seconds(*t.get_ref()) {
                Ok(d) => Some(d),
                Err(allowed) => {
                    errors.push(src.error(
                        t.span(),
                        Some(&shown_id),
                        format!("`timeout` is {}; {allowed}", t.get_ref()),
                    ));
                    None
                }
            },
        };
        if errors.len() > before {
            continue;
        }
        cells.push(Cell {
            id,
            title: rc.title,
            prose: rc.prose,
            plugin: plugin_name.clone(),
            params,
            check_params,
            assertions,
            full_size_assertions,
            timeout,
        });
    }
    match errors.len() {
        0 => Ok(Chapter {
            path: path.to_path_buf(),
            id: raw.id.into_inner(),
            title: raw.title,
            intro: raw.intro,
            cells,
        }),
        1 => Err(errors.remove(0)),
        _ => {
            errors.sort_by_key(|e| match e {
                ChapterError::Invalid { location, .. } => (location.line, location.column),
                _ => (0, 0),
            });
            Err(ChapterError::Several(errors))
        }
    }
}

/// A cell's parameter tables, where they are in the file.
struct CellSource<'a> {
    src: &'a Source<'a>,
    id: &'a str,
    params: &'a SpannedTable,
    check: &'a SpannedTable,
    plugin: std::ops::Range<usize>,
}

impl CellSource<'_> {
    /// Where the parameter behind `field` (`steps[2]`, `scaler.init_scale`)
    /// is written: in the check table when it is there and `check` is set,
    /// else in the full-size table, else nowhere (its default: the error
    /// points at the plugin).
    fn locate(&self, field: &str, check: bool) -> (std::ops::Range<usize>, Written) {
        let key = field.split(['.', '[']).next().unwrap_or_default();
        let lookup = |t: &SpannedTable| t.get_key_value(key).map(|(k, _)| k.span());
        match (
            check.then(|| lookup(self.check)).flatten(),
            lookup(self.params),
        ) {
            (Some(span), _) => (span, Written::Check),
            (None, Some(span)) => (span, Written::Full),
            (None, None) => (self.plugin.clone(), Written::Default),
        }
    }

    /// Checks both modes' tables: types first, then values. A violation
    /// that a value written once gives in both modes is reported once.
    fn check_params(
        &self,
        plugin: &dyn workbook_sdk::DynPlugin,
        params: &toml::Table,
        check_params: &toml::Table,
        errors: &mut Vec<ChapterError>,
    ) {
        let mut said: Vec<(String, String)> = Vec::new();
        for (table, check) in [(params, false), (check_params, true)] {
            match plugin.validate_params(table) {
                Err(e) => {
                    let key = Some(e.field.split(['.', '[']).next().unwrap_or_default())
                        .filter(|k| !k.is_empty())
                        .map(str::to_string)
                        .or_else(|| unknown_field(&e.message));
                    let (span, what) = match &key {
                        Some(k) => match self.locate(k, check) {
                            (span, Written::Check) => (span, format!("check parameter `{k}`")),
                            (span, _) => (span, format!("parameter `{k}`")),
                        },
                        None => (self.plugin.clone(), "parameters".to_string()),
                    };
                    let hint = match &key {
                        Some(k) if unknown_field(&e.message).is_some() => {
                            suggest::did_you_mean(k, expected_fields(&e.message))
                        }
                        _ => String::new(),
                    };
                    errors.push(self.src.error(
                        span,
                        Some(self.id),
                        format!("{what}: {}{hint}", quote(&e.message)),
                    ));
                    // Values are checked once the types are right.
                    return;
                }
                Ok(violations) => {
                    for v in violations {
                        let seen = (v.field.clone(), v.given.clone());
                        if said.contains(&seen) {
                            continue;
                        }
                        said.push(seen);
                        let f = &v.field;
                        let (span, what) = match (self.locate(f, check), check) {
                            ((span, Written::Check), _) => (span, format!("check parameter `{f}`")),
                            ((span, Written::Full), false) => (span, format!("parameter `{f}`")),
                            ((span, Written::Full), true) => {
                                (span, format!("parameter `{f}` (at check size)"))
                            }
                            ((span, Written::Default), false) => {
                                (span, format!("parameter `{f}` (its default)"))
                            }
                            ((span, Written::Default), true) => (
                                span,
                                format!("parameter `{f}` (its default, at check size)"),
                            ),
                        };
                        errors.push(self.src.error(
                            span,
                            Some(self.id),
                            // The value is the user's, quoted short; what is
                            // allowed is the plugin's, and may name a file's
                            // own error at length.
                            format!(
                                "{what} is {}; {}",
                                quote(&v.given),
                                excerpt(&v.allowed, ALLOWED)
                            ),
                        ));
                    }
                }
            }
        }
    }
}

/// Where a cell's parameter is written.
enum Written {
    /// In the `check` table.
    Check,
    /// In the full-size `params` table.
    Full,
    /// Nowhere: it takes the plugin's default.
    Default,
}

/// A time limit in seconds, as a duration; the error says what is allowed.
/// A millisecond is the least: below it no worker could even start, and
/// the limit would read as "0 s" when it stops one.
pub fn seconds(s: f64) -> Result<std::time::Duration, String> {
    const MIN: f64 = 0.001;
    const MAX: f64 = 7.0 * 24.0 * 3600.0;
    if s.is_finite() && (MIN..=MAX).contains(&s) {
        Ok(std::time::Duration::from_secs_f64(s))
    } else {
        Err(format!(
            "a time limit is a number of seconds from {MIN} (a millisecond) to {MAX} (a week)"
        ))
    }
}

/// The longest chapter or cell id.
pub const MAX_ID: usize = 64;

fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    if s.len() > MAX_ID {
        return false;
    }
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// The field named in serde's "unknown field `x`, expected ..." message.
fn unknown_field(message: &str) -> Option<String> {
    let rest = message.strip_prefix("unknown field `")?;
    Some(rest[..rest.find('`')?].to_string())
}

/// The fields serde lists after an unknown one (`expected one of `a`, `b``).
fn expected_fields(message: &str) -> Vec<&str> {
    let Some((_, list)) = message.split_once("expected ") else {
        return Vec::new();
    };
    list.split('`').skip(1).step_by(2).collect()
}

/// Reads and validates the chapter at `path`.
pub fn load_path(path: &Path, registry: &Registry) -> Result<Chapter, ChapterError> {
    check_file(path)?;
    let text = std::fs::read_to_string(path).map_err(|cause| ChapterError::Io {
        path: path.to_path_buf(),
        cause,
    })?;
    parse(path, &text, registry)
}

/// That `path` is a regular file (through links), or what it is instead.
/// Reading a FIFO would wait for a writer forever.
fn check_file(path: &Path) -> Result<(), ChapterError> {
    match not_a_regular_file(path) {
        Ok(None) => Ok(()),
        Ok(Some(what)) => Err(ChapterError::NotAFile {
            path: path.to_path_buf(),
            what,
        }),
        Err(cause) => Err(ChapterError::Io {
            path: path.to_path_buf(),
            cause,
        }),
    }
}

/// What `path` is when it is not a regular file (through links): `is a
/// directory`, `is a FIFO (a named pipe)`, a dangling link...; `None` for
/// a regular file. Any input file is checked so before it is read: reading
/// a FIFO would wait for a writer forever, a device such as /dev/zero
/// would never end.
pub fn not_a_regular_file(path: &Path) -> std::io::Result<Option<String>> {
    use std::os::unix::fs::FileTypeExt;
    let link = std::fs::symlink_metadata(path)?;
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(_) if link.file_type().is_symlink() => {
            let target = std::fs::read_link(path)
                .map(|t| t.display().to_string())
                .unwrap_or_default();
            return Ok(Some(format!("is a link to {target}, which does not exist")));
        }
        Err(cause) => return Err(cause),
    };
    let kind = meta.file_type();
    Ok(if kind.is_file() {
        None
    } else if kind.is_dir() {
        Some("is a directory".into())
    } else if kind.is_fifo() {
        Some("is a FIFO (a named pipe)".into())
    } else if kind.is_socket() {
        Some("is a socket".into())
    } else {
        Some("is a device, not a regular file".into())
    })
}

/// Where chapters are looked for, in order: `./chapters`, then the
/// `chapters` folder of this source tree.
pub fn default_dirs() -> Vec<PathBuf> {
    let mut dirs = vec![PathBuf::from("chapters")];
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("chapters");
    if built.canonicalize().ok() != Path::new("chapters").canonicalize().ok() {
        dirs.push(built);
    }
    dirs
}

/// The chapter files in `dirs`, by id (file stem), first folder first.
pub fn available(dirs: &[PathBuf]) -> IndexMap<String, PathBuf> {
    let mut found = IndexMap::new();
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        // Regular files only (through links): a FIFO would block a read.
        let mut paths: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "toml"))
            .filter(|p| std::fs::metadata(p).is_ok_and(|m| m.is_file()))
            .collect();
        paths.sort();
        for p in paths {
            if let Some(stem) = p.file_stem().and_then(|s| s.to_str()) {
                found.entry(stem.to_string()).or_insert(p);
            }
        }
    }
    found
}

/// Finds a chapter by id (`chapter2`) in `dirs`, or by path to a `.toml` file.
pub fn resolve(name: &str, dirs: &[PathBuf]) -> Result<PathBuf, ChapterError> {
    let as_path = Path::new(name);
    if name.ends_with(".toml") || as_path.components().count() > 1 {
        // A path that names something (a directory, a FIFO, a dangling
        // link) says what it is; only a path to nothing is "not found".
        if std::fs::symlink_metadata(as_path).is_ok() {
            check_file(as_path)?;
            return Ok(as_path.to_path_buf());
        }
    } else if let Some(p) = available(dirs).get(name) {
        return Ok(p.clone());
    }
    let names: Vec<String> = available(dirs).keys().cloned().collect();
    Err(ChapterError::NotFound {
        name: quote(name),
        suggestion: suggest::did_you_mean(name, names.iter().map(String::as_str)),
        searched: dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
        available: if names.is_empty() {
            "none".to_string()
        } else {
            names.join(", ")
        },
    })
}
