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
//! assertions = [
//!   "large_params > small_params",
//!   # a fact of one kind of device (cpu, cuda): skipped elsewhere
//!   { expr = "seconds_tiled < seconds_naive", device = "cpu" },
//! ]
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

use crate::assertion::Assertion;

mod find;
mod parse;
mod paths;
mod raw_assertion;
mod schema;

pub use find::{available, default_dirs, load_path, resolve};
pub use parse::{parse, seconds, MAX_ID};
pub use schema::json_schema;

use parse::LineIndex;

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
    /// Check-size parameters: `params` with the `check` table laid over it,
    /// nested tables merged key by key.
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
