//! Input files read safely: what a path is when it is not a regular file,
//! and a small text file read with a bound on its size.
//!
//! Every file a user names (a chapter, a model, a decoder's `config.json`)
//! is checked before it is read: reading a FIFO waits for a writer forever,
//! a device such as `/dev/zero` never ends, and a multi-gigabyte weights
//! file given for a config would be read whole before it is refused.

use std::io::Read as _;
use std::path::Path;

/// The JSON Schema `format` of a parameter that names a file. A chapter
/// gives such a path from its own folder, as a `Cargo.toml` does: where the
/// file is there, the runner hands the plugin that path instead (an
/// absolute path, or a file the chapter's folder does not hold, is handed
/// on as written). Mark the field with `#[schemars(extend("format" = "path"))]`.
pub const PATH_FORMAT: &str = "path";

/// What `path` is when it is not a regular file (through links): `is a
/// directory`, `is a FIFO (a named pipe)`, a dangling link...; `None` for
/// a regular file.
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

/// A kind of small input file, as its errors name it.
#[derive(Debug, Clone, Copy)]
pub struct FileKind {
    /// As the file is named in an error: "a model file".
    pub name: &'static str,
    /// What it is: "a regular .toml file".
    pub is: &'static str,
    /// What it holds, said when it is too large.
    pub holds: &'static str,
    /// The most bytes it may have.
    pub max_bytes: u64,
}

/// Why a small file was not read.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// The file could not be opened or read (absent, no permission, not
    /// UTF-8).
    #[error("cannot read {path}: {cause}")]
    Io {
        /// The file.
        path: String,
        /// Why. (Not the error's `source`: the message says it already, and
        /// a chain printed whole would say it twice.)
        cause: std::io::Error,
    },
    /// A directory, a pipe, a device or a dangling link.
    #[error("{path} {what}; {name} is {is}", name = kind.name, is = kind.is)]
    NotRegular {
        /// The file.
        path: String,
        /// What it is instead.
        what: String,
        /// What it should be.
        kind: FileKind,
    },
    /// Larger than its kind may be.
    #[error(
        "{path} is larger than {name} may be ({max} bytes at most): it holds {holds}",
        name = kind.name,
        max = kind.max_bytes,
        holds = kind.holds
    )]
    TooLarge {
        /// The file.
        path: String,
        /// What it should be.
        kind: FileKind,
    },
}

/// The text of `path`, a regular file of at most `kind.max_bytes` bytes: a
/// pipe, a device or a larger file is refused before it is read.
pub fn read_small(path: &Path, kind: FileKind) -> Result<String, FileError> {
    let shown = || path.display().to_string();
    let io = |cause| FileError::Io {
        path: shown(),
        cause,
    };
    if let Some(what) = not_a_regular_file(path).map_err(io)? {
        return Err(FileError::NotRegular {
            path: shown(),
            what,
            kind,
        });
    }
    let too_large = || FileError::TooLarge {
        path: shown(),
        kind,
    };
    // By the opened file's size first, so that a large binary file is named
    // as large, not as text that is not UTF-8; then as read, in case it grew.
    let file = std::fs::File::open(path).map_err(io)?;
    if file.metadata().map_err(io)?.len() > kind.max_bytes {
        return Err(too_large());
    }
    let mut text = String::new();
    file.take(kind.max_bytes.saturating_add(1))
        .read_to_string(&mut text)
        .map_err(io)?;
    if text.len() as u64 > kind.max_bytes {
        return Err(too_large());
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIND: FileKind = FileKind {
        name: "a test file",
        is: "a regular .txt file",
        holds: "a few words",
        max_bytes: 8,
    };

    #[test]
    fn reads_a_file_of_the_bound_and_refuses_one_byte_more() {
        let dir = std::env::temp_dir().join(format!("workbook-sdk-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let at = dir.join("eight.txt");
        std::fs::write(&at, "12345678").unwrap();
        assert_eq!(read_small(&at, KIND).unwrap(), "12345678");
        std::fs::write(&at, "123456789").unwrap();
        assert_eq!(
            read_small(&at, KIND).unwrap_err().to_string(),
            format!(
                "{} is larger than a test file may be (8 bytes at most): it holds a few words",
                at.display()
            )
        );
        assert_eq!(
            read_small(&dir, KIND).unwrap_err().to_string(),
            format!(
                "{} is a directory; a test file is a regular .txt file",
                dir.display()
            )
        );
        let dangling = dir.join("dangling.txt");
        std::os::unix::fs::symlink(dir.join("absent"), &dangling).unwrap();
        assert_eq!(
            read_small(&dangling, KIND).unwrap_err().to_string(),
            format!(
                "{} is a link to {}, which does not exist; a test file is a regular .txt file",
                dangling.display(),
                dir.join("absent").display()
            )
        );
        std::fs::write(&at, [0xff_u8, 0xfe]).unwrap();
        let not_text = read_small(&at, KIND).unwrap_err().to_string();
        assert!(
            not_text.starts_with(&format!("cannot read {}: ", at.display())),
            "{not_text}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
        let absent = read_small(&dir.join("absent"), KIND)
            .unwrap_err()
            .to_string();
        assert!(
            absent.starts_with(&format!("cannot read {}: ", dir.join("absent").display())),
            "{absent}"
        );
    }
}
