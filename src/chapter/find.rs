//! Where chapters are found, and a chapter file read from its path.

use std::path::{Path, PathBuf};

use indexmap::IndexMap;

use super::{parse, Chapter, ChapterError};
use crate::excerpt::quote;
use crate::registry::Registry;
use crate::suggest;
use workbook_sdk::file::not_a_regular_file;

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
