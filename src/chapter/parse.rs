//! A chapter file read and validated: its serde shape with spans, every
//! cell's plugin, parameters (both modes), assertions and time limit, each
//! error located in the file.

use std::path::Path;

use indexmap::IndexMap;
use serde::Deserialize;
use toml::Spanned;

use super::paths;
use super::raw_assertion::{AssertionSchema, RawAssertion};
use super::{Cell, Chapter, ChapterError, Location, FORMAT_VERSION};
use crate::assertion::{Assertion, OnDevice};
use crate::excerpt::{excerpt, quote};
use crate::registry::{Registry, Unusable};
use crate::suggest;

/// How many characters of a plugin's "allowed" a message quotes.
const ALLOWED: usize = 400;

/// A chapter file.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(title = "workbook chapter")]
pub(super) struct RawChapter {
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
    /// (`peak_ratio < 0.5`); one that states a fact of one kind of device
    /// is a table naming it (`{ expr = "...", device = "cpu" }`), checked
    /// where the cell ran there and reported as skipped elsewhere.
    #[serde(default)]
    #[schemars(with = "Vec<AssertionSchema>", extend("default" = []))]
    assertions: Vec<Spanned<RawAssertion>>,
    /// Assertions checked at full size only (reported as skipped in check
    /// mode), in either form.
    #[serde(default)]
    #[schemars(with = "Vec<AssertionSchema>", extend("default" = []))]
    full_size_assertions: Vec<Spanned<RawAssertion>>,
    /// The cell's time limit in seconds.
    #[schemars(with = "Option<f64>", range(min = 0.001))]
    timeout: Option<Spanned<f64>>,
}

/// Where each line of a text starts: a chapter of n cells is located n
/// times, each in O(log n) rather than by reading from the file's start.
pub(super) struct LineIndex {
    starts: Vec<usize>,
}

impl LineIndex {
    pub(super) fn new(text: &str) -> Self {
        Self {
            starts: std::iter::once(0)
                .chain(text.match_indices('\n').map(|(i, _)| i + 1))
                .collect(),
        }
    }

    /// Byte `offset` of `text` (the text indexed) as a 1-based line and
    /// column (in characters).
    pub(super) fn locate(&self, path: &Path, text: &str, offset: usize) -> Location {
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

/// `over` laid over `base`, as the check table over the full one: a table
/// merges key by key at any depth (`[cells.check.scaler] init_scale = 1.0`
/// keeps the full table's other scaler fields); any other value, a list
/// included, replaces the one beneath it.
fn lay_over(base: &mut toml::Table, over: toml::Table) {
    for (key, value) in over {
        match (base.get_mut(&key), value) {
            (Some(toml::Value::Table(below)), toml::Value::Table(above)) => lay_over(below, above),
            (_, value) => {
                base.insert(key, value);
            }
        }
    }
}

/// That the nested field `rest` (`.init_scale`, `.inner.x[2]`, or empty) is
/// written within `value`: each table on the way holds its key. An index
/// ends the walk: a list is written whole.
fn holds(value: &toml::Value, rest: &str) -> bool {
    let Some(rest) = rest.strip_prefix('.') else {
        return true;
    };
    let end = rest.find(['.', '[']).unwrap_or(rest.len());
    match value.get(&rest[..end]) {
        Some(inner) => holds(inner, &rest[end..]),
        None => false,
    }
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
        let mut params = plain(&rc.params);
        let mut check_params = params.clone();
        lay_over(&mut check_params, plain(&rc.check));
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
                let schema = plugin.info().params;
                let folder = path.parent().unwrap_or(Path::new(""));
                let mut joined = paths::from_folder(&mut params, &schema, folder);
                joined.extend(paths::from_folder(&mut check_params, &schema, folder));
                let cell = CellSource {
                    src: &src,
                    id: &shown_id,
                    params: &rc.params,
                    check: &rc.check,
                    plugin: rc.plugin.span(),
                };
                cell.check_params(plugin, &params, &check_params, &joined, &mut errors);
            }
        }
        let declared = registry.get(plugin_name).map(|p| p.declared_metrics());
        let mut parse_all = |list: &[Spanned<RawAssertion>]| {
            let mut parsed = Vec::new();
            for entry in list {
                let raw = entry.get_ref();
                let span = raw.expr_span.clone().unwrap_or_else(|| entry.span());
                let a = Spanned::new(span, raw.expr.clone());
                let device = match &entry.get_ref().device {
                    None => None,
                    Some(d) => match OnDevice::from_name(d.get_ref()) {
                        Some(kind) => Some(kind),
                        None => {
                            let names = OnDevice::ALL.map(OnDevice::name);
                            errors.push(src.error(
                                d.span(),
                                Some(&shown_id),
                                format!(
                                    "assertion `{}` names device `{}`, which is neither `cpu` \
                                     nor `cuda`{}",
                                    quote(a.get_ref()),
                                    quote(d.get_ref()),
                                    suggest::did_you_mean(d.get_ref(), names),
                                ),
                            ));
                            continue;
                        }
                    },
                };
                match Assertion::parse(a.get_ref()) {
                    Ok(assertion) => {
                        let assertion = match device {
                            Some(kind) => assertion.on(kind),
                            None => assertion,
                        };
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
    /// is written: in the check table when it is there and `check` is set
    /// (a nested field in the check table's copy of its table), else in the
    /// full-size table, else nowhere (its default: the error points at the
    /// plugin).
    fn locate(&self, field: &str, check: bool) -> (std::ops::Range<usize>, Written) {
        let end = field.find(['.', '[']).unwrap_or(field.len());
        let (key, rest) = field.split_at(end);
        let lookup = |t: &SpannedTable| {
            t.get_key_value(key)
                .map(|(k, v)| (k.span(), holds(v.get_ref(), rest)))
        };
        let in_check = if check { lookup(self.check) } else { None };
        match (in_check, lookup(self.params)) {
            (Some((span, true)), _) => (span, Written::Check),
            (_, Some((span, true))) => (span, Written::Full),
            // A table is written that does not write this field: its
            // default, pointed at the table.
            (Some((span, false)), _) | (None, Some((span, false))) => (span, Written::Default),
            (None, None) => (self.plugin.clone(), Written::Default),
        }
    }

    /// Checks both modes' tables: types first, then values. A violation
    /// that a value written once gives in both modes is reported once, and
    /// a path joined to the chapter's folder as it was written.
    fn check_params(
        &self,
        plugin: &dyn workbook_sdk::DynPlugin,
        params: &toml::Table,
        check_params: &toml::Table,
        joined: &[paths::Joined],
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
                                quote(
                                    joined
                                        .iter()
                                        .find(|j| j.joined == v.given)
                                        .map_or(&v.given, |j| &j.written)
                                ),
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
