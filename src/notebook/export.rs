//! A chapter as a notebook (nbformat 4.5, for the evcxr kernel `rust`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use jupyter_protocol::media::{Media, MediaType};
use nbformat::v4::{Cell, CellId, CellMetadata, KernelSpec, LanguageInfo, Metadata, Output};

use crate::chapter::Chapter;

/// What the setup cell points at.
#[derive(Debug, Clone)]
pub struct ExportOptions {
    /// The source tree of this crate, for the `:dep`.
    pub crate_dir: PathBuf,
    /// The `workbook` binary that runs each cell; when `None`, the
    /// notebook finds one itself (see [`crate::Notebook::new`]).
    pub binary: Option<PathBuf>,
    /// Write `.check(true)` into the setup cell; otherwise the mode follows
    /// `WORKBOOK_CHECK_MODE` in the kernel's environment.
    pub check: bool,
    /// The notebook's folder, where the kernel starts: paths are written
    /// relative to it, so that the notebook can be committed, shared and
    /// opened anywhere the source tree is. Absolute paths when `None`.
    pub notebook_dir: Option<PathBuf>,
}

impl ExportOptions {
    /// This crate's source tree and the running binary, by absolute paths.
    pub fn current(check: bool) -> std::io::Result<Self> {
        Ok(Self {
            crate_dir: PathBuf::from(env!("CARGO_MANIFEST_DIR")),
            binary: Some(std::env::current_exe()?),
            check,
            notebook_dir: None,
        })
    }

    /// A notebook to be written into `notebook_dir`: this crate's source
    /// tree and the chapter by paths relative to it, and no binary (the
    /// notebook finds one). What `workbook notebook` writes, and what
    /// `chapters/*.ipynb` are.
    pub fn portable(notebook_dir: &Path, check: bool) -> Self {
        Self {
            crate_dir: PathBuf::from(env!("CARGO_MANIFEST_DIR")),
            binary: None,
            check,
            notebook_dir: Some(notebook_dir.to_path_buf()),
        }
    }

    /// `path` as the notebook writes it.
    fn written(&self, path: &Path) -> PathBuf {
        let absolute = |p: &Path| {
            let p = std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
            p.canonicalize().unwrap_or(p)
        };
        let target = absolute(path);
        match &self.notebook_dir {
            Some(dir) => pathdiff::diff_paths(&target, absolute(dir))
                .map(|p| {
                    if p.as_os_str().is_empty() {
                        PathBuf::from(".")
                    } else {
                        p
                    }
                })
                .unwrap_or(target),
            None => target,
        }
    }
}

/// The id of the setup cell, the first code cell.
pub const SETUP_CELL: &str = "setup";

/// Notebook cell ids for each chapter cell: its own id (chapter ids are
/// letters, digits, `_` and `-`, as nbformat's are) unless that is too long
/// or taken, then `cell-N`. The prose cell is the code cell's id + `-prose`.
pub fn code_cell_ids(chapter: &Chapter) -> Vec<String> {
    let mut taken: std::collections::HashSet<String> =
        [SETUP_CELL.to_string(), "intro".to_string()].into();
    let mut ids = Vec::with_capacity(chapter.cells.len());
    for (i, c) in chapter.cells.iter().enumerate() {
        let mut id = c.id.clone();
        let valid = id.len() <= 50
            && id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        if !valid || taken.contains(&id) || taken.contains(&format!("{id}-prose")) {
            id = format!("cell-{}", i + 1);
        }
        taken.insert(format!("{id}-prose"));
        taken.insert(id.clone());
        ids.push(id);
    }
    ids
}

fn id(s: &str) -> CellId {
    // Ids are built by `code_cell_ids`: [A-Za-z0-9_-], at most 64 long.
    CellId::new(s).expect("notebook cell ids are sanitised")
}

/// Splits `text` into nbformat's source lines, each keeping its newline.
fn lines(text: &str) -> Vec<String> {
    text.split_inclusive('\n').map(str::to_string).collect()
}

fn markdown(cell_id: &str, text: &str) -> Cell {
    Cell::Markdown {
        id: id(cell_id),
        metadata: CellMetadata::default(),
        source: lines(text.trim_end()),
        attachments: None,
    }
}

fn code(cell_id: &str, text: &str) -> Cell {
    Cell::Code {
        id: id(cell_id),
        metadata: CellMetadata::default(),
        execution_count: None,
        source: lines(text.trim_end()),
        outputs: Vec::new(),
    }
}

fn rust_str(path: &Path) -> String {
    // Debug formatting of a str is a valid Rust string literal.
    format!("{:?}", path.to_string_lossy())
}

fn toml_str(path: &Path) -> String {
    toml::Value::String(path.to_string_lossy().into_owned()).to_string()
}

/// The setup cell's source.
pub fn setup_source(chapter: &Chapter, options: &ExportOptions) -> String {
    let mode = if options.check {
        "\n    .check(true)"
    } else {
        ""
    };
    let binary = match &options.binary {
        Some(b) => format!("\n    .binary({})", rust_str(b)),
        None => String::new(),
    };
    format!(
        "// evcxr keeps compiled crates between kernel sessions (up to 500 MiB in the\n\
         // user's cache folder): a new session builds the library in seconds.\n\
         :cache 500\n\
         // The workbook library, built without candle: it only displays results.\n\
         :dep workbook = {{ path = {dep}, default-features = false }}\n\
         // A panic fails its cell (a failed chapter cell fails its notebook cell).\n\
         :preserve_vars_on_panic 0\n\
         // Each cell runs in its own `workbook` process, which measures its memory\n\
         // exactly as `workbook run` does in a terminal.\n\
         let wb = workbook::Notebook::new({chapter}){binary}{mode};\n\
         println!(\"{{}} cells at {{}} size\", {cells}, if wb.is_check() {{ \"check\" }} else {{ \"full\" }});",
        dep = toml_str(&options.written(&options.crate_dir)),
        chapter = rust_str(&options.written(&chapter.path)),
        cells = chapter.cells.len(),
    )
}

/// `chapter` as a notebook: its introduction, the setup cell, then for each
/// chapter cell a markdown cell with its title and prose and a code cell that
/// runs it.
pub fn notebook(chapter: &Chapter, options: &ExportOptions) -> nbformat::v4::Notebook {
    let mut cells = vec![
        markdown(
            "intro",
            &format!("# {}\n\n{}", chapter.title, chapter.intro.trim()),
        ),
        code(SETUP_CELL, &setup_source(chapter, options)),
    ];
    for (c, cid) in chapter.cells.iter().zip(code_cell_ids(chapter)) {
        cells.push(markdown(
            &format!("{cid}-prose"),
            &format!("## {}\n\n{}", c.title, c.prose.trim()),
        ));
        cells.push(code(&cid, &format!("wb.run_cell({:?})", c.id)));
    }
    let mut additional = HashMap::new();
    additional.insert(
        "workbook".to_string(),
        serde_json::json!({ "chapter": chapter.id, "check": options.check }),
    );
    nbformat::v4::Notebook {
        metadata: Metadata {
            kernelspec: Some(KernelSpec {
                display_name: "Rust".into(),
                name: "rust".into(),
                language: Some("rust".into()),
                additional: HashMap::new(),
            }),
            language_info: Some(LanguageInfo {
                name: "Rust".into(),
                version: None,
                codemirror_mode: Some(nbformat::v4::CodemirrorMode::String("rust".into())),
                additional: HashMap::from([
                    ("file_extension".to_string(), serde_json::json!(".rs")),
                    ("mimetype".to_string(), serde_json::json!("text/rust")),
                    ("pygment_lexer".to_string(), serde_json::json!("rust")),
                ]),
            }),
            authors: None,
            additional,
        },
        nbformat: 4,
        nbformat_minor: 5,
        cells,
    }
}

/// The notebook as nbformat's JSON text (sorted keys, one-space indent, as
/// Jupyter writes it).
pub fn to_json(nb: &nbformat::v4::Notebook) -> anyhow::Result<String> {
    nbformat::serialize_notebook(&nbformat::Notebook::V4(nb.clone()))
        .map_err(|e| anyhow::anyhow!("cannot serialise the notebook: {e}"))
}

/// An HTML rich output, as an executed cell holds it.
pub fn html_output(execution_count: usize, html: String) -> Output {
    Output::ExecuteResult(nbformat::v4::ExecuteResult {
        execution_count: jupyter_protocol::ExecutionCount::new(execution_count),
        data: Media::new(vec![MediaType::Html(html)]),
        metadata: serde_json::Map::new(),
    })
}
