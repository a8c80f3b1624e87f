//! A chapter as a notebook (nbformat 4.5, for the evcxr kernel `rust`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use jupyter_protocol::media::{Media, MediaType};
use nbformat::v4::{Cell, CellId, CellMetadata, KernelSpec, LanguageInfo, Metadata, Output};

use workbook_sdk::NotebookSource;

use crate::chapter::Chapter;
use crate::notebook::names::{check_cell_order, check_names};
use crate::registry::Registry;

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

/// The experiment sources of `chapter`'s cells, where their plugins have
/// one (see `workbook_sdk::notebook`), in the order of the cells.
pub fn sources(chapter: &Chapter, registry: &Registry) -> Vec<Option<NotebookSource>> {
    chapter
        .cells
        .iter()
        .map(|c| registry.get(&c.plugin).and_then(|p| p.notebook_source()))
        .collect()
}

/// The crates of this source tree that the package at `dir` is or depends
/// on (its `[dependencies]` with a `path`, directly or through its
/// workspace's `[workspace.dependencies]`), as package names and folders:
/// every crate its experiment can name.
fn path_crates(dir: &Path) -> anyhow::Result<Vec<(String, PathBuf)>> {
    let read = |path: &Path| -> anyhow::Result<toml::Table> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
        toml::from_str(&text).map_err(|e| anyhow::anyhow!("cannot parse {}: {e}", path.display()))
    };
    let manifest = read(&dir.join("Cargo.toml"))?;
    let name = manifest
        .get("package")
        .and_then(|p| p.get("name"))
        .and_then(|n| n.as_str())
        .ok_or_else(|| anyhow::anyhow!("{} names no package", dir.join("Cargo.toml").display()))?;
    let mut crates = vec![(name.to_string(), dir.to_path_buf())];
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let workspace = read(&root.join("Cargo.toml"))?;
    let shared = workspace
        .get("workspace")
        .and_then(|w| w.get("dependencies"))
        .and_then(|d| d.as_table());
    let deps = manifest.get("dependencies").and_then(|d| d.as_table());
    for (package, entry) in deps.into_iter().flatten() {
        let path = match entry.get("path").and_then(|p| p.as_str()) {
            Some(path) => Some(dir.join(path)),
            None if entry.get("workspace").and_then(|w| w.as_bool()) == Some(true) => shared
                .and_then(|d| d.get(package))
                .and_then(|e| e.get("path"))
                .and_then(|p| p.as_str())
                .map(|p| root.join(p)),
            None => None,
        };
        if let Some(path) = path {
            crates.push((package.clone(), path));
        }
    }
    Ok(crates)
}

/// The `:dep` lines the experiments of `sources` need: their plugins' crates
/// and every crate of this source tree those depend on, once each.
pub fn dependencies(
    sources: &[NotebookSource],
    options: &ExportOptions,
) -> anyhow::Result<Vec<String>> {
    let mut lines: Vec<String> = Vec::new();
    for source in sources {
        for (package, dir) in path_crates(Path::new(source.dir))? {
            let line = format!(
                ":dep {package} = {{ path = {} }}",
                toml_str(&options.written(&dir))
            );
            if !lines.contains(&line) {
                lines.push(line);
            }
        }
    }
    Ok(lines)
}

/// The end of a setup cell: failures fail cells, and the chapter opened as
/// `constructor` (`workbook::Notebook::new`, `workbook::Live::open`) in the
/// mode and with the binary `options` ask for.
fn setup_tail(chapter: &Chapter, options: &ExportOptions, constructor: &str) -> String {
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
        "// A panic fails its cell (a failed chapter cell fails its notebook cell).\n\
         :preserve_vars_on_panic 0\n\
         let wb = {constructor}({chapter}){binary}{mode};\n\
         println!(\"{{}} cells at {{}} size\", {cells}, if wb.is_check() {{ \"check\" }} else {{ \"full\" }});",
        chapter = rust_str(&options.written(&chapter.path)),
        cells = chapter.cells.len(),
    )
}

/// The setup cell's source for a chapter whose cells all run in a child
/// process.
pub fn setup_source(chapter: &Chapter, options: &ExportOptions) -> String {
    format!(
        "// evcxr keeps compiled crates between kernel sessions (up to 500 MiB in the\n\
         // user's cache folder): a new session builds the library in seconds.\n\
         :cache 500\n\
         // The workbook library, built without candle: it only displays results.\n\
         :dep workbook = {{ path = {dep}, default-features = false }}\n\
         // Each cell runs in its own `workbook` process, which measures its memory\n\
         // exactly as `workbook run` does in a terminal.\n\
         {tail}",
        dep = toml_str(&options.written(&options.crate_dir)),
        tail = setup_tail(chapter, options, "workbook::Notebook::new"),
    )
}

/// The setup cell's source for a chapter some of whose cells show their
/// experiment: the crates the experiments of `sources` use, and a
/// [`crate::Live`] chapter.
pub fn live_setup_source(
    chapter: &Chapter,
    sources: &[NotebookSource],
    options: &ExportOptions,
) -> anyhow::Result<String> {
    Ok(format!(
        "// The workbook, and the crates the experiments below use: the kernel\n\
         // builds them when it starts (minutes), then each cell in seconds.\n\
         :dep workbook = {{ path = {dep} }}\n\
         {deps}\n\
         // The chapter, checked. Cells whose code is shown below run in this\n\
         // kernel, measured by its allocation interposer (the \"Rust (workbook)\"\n\
         // kernel); the others run in a `workbook` process of their own.\n\
         {tail}",
        dep = toml_str(&options.written(&options.crate_dir)),
        deps = dependencies(sources, options)?.join("\n"),
        tail = setup_tail(chapter, options, "workbook::Live::open"),
    ))
}

/// The tag of a notebook cell that is an exercise (Jupyter's cell tags).
pub const EXERCISE_TAG: &str = "exercise";

/// Marks `cell` as an exercise whose reference solution is `solution`: the
/// tag [`EXERCISE_TAG`], and the solution under the cell's `workbook`
/// metadata, where a checker (and a learner who gives up) finds it.
fn mark_exercise(cell: &mut Cell, solution: &str) {
    if let Cell::Code { metadata, .. } = cell {
        metadata.tags = Some(vec![EXERCISE_TAG.to_string()]);
        metadata.additional.insert(
            "workbook".to_string(),
            serde_json::json!({ "solution": solution }),
        );
    }
}

/// The code cell that runs a chapter cell from the experiment shown above
/// it; for an experiment with an exercise, one that grades it.
fn run_source(cell: &crate::chapter::Cell, source: &NotebookSource, exercise: bool) -> String {
    let (comment, call) = if exercise {
        (
            "// Grades the exercise above: runs the experiment with your code and\n\
             // holds it to the chapter's assertions. Until they pass, it shows what\n\
             // failed and the kernel keeps its state: change your code and run both\n\
             // cells again."
                .to_string(),
            "grade",
        )
    } else {
        // A field that check size changes, as the example of an edit.
        let example = cell
            .check_params
            .iter()
            .filter(|(k, v)| cell.params.get(*k) != Some(*v))
            .find_map(|(k, v)| v.as_integer().map(|i| format!("{k}: {i}")))
            .map(|field| {
                format!(
                    " For example:\n// let p = {} {{ {field}, ..p }};",
                    source.params
                )
            })
            .unwrap_or_default();
        (
            format!(
                "// This cell's parameters from the chapter, at the notebook's size (`p`\n\
                 // prints them). Change any, or the code above, and run again.{example}"
            ),
            "run",
        )
    };
    format!(
        "{comment}\n\
         let p: {params} = wb.params({id:?});\n\
         wb.{call}({id:?}, {plugin}, p.clone(), {entry})",
        id = cell.id,
        plugin = source.plugin,
        params = source.params,
        entry = source.entry,
    )
}

/// `chapter` as a notebook: its introduction, the setup cell, then for each
/// chapter cell a markdown cell with its title and prose and the code that
/// runs it: the experiment's source and a cell that runs it where the
/// plugin has one (`registry`'s), else a cell that runs it in a child
/// process.
pub fn notebook(
    chapter: &Chapter,
    registry: &Registry,
    options: &ExportOptions,
) -> anyhow::Result<nbformat::v4::Notebook> {
    let sources = sources(chapter, registry);
    let shown: Vec<NotebookSource> = sources.iter().flatten().copied().collect();
    check_names(&shown, |s| {
        Ok(path_crates(Path::new(s.dir))?
            .into_iter()
            .map(|(name, _)| name)
            .collect())
    })?;
    for source in &shown {
        check_cell_order(source)?;
    }
    let live = !shown.is_empty();
    let setup = if live {
        // Every notebook adds the same crates, those of every plugin that
        // shows its experiment, so that what one kernel session builds
        // serves them all. (Not through evcxr's `:cache`: with these crates
        // it hands a session in another folder builds that do not link,
        // "can't find crate for `candle_core`".)
        // The built-in plugins: listing the registry would start every
        // external plugin to ask what it is.
        let all: Vec<NotebookSource> = Registry::builtin()
            .iter()
            .filter_map(|p| p.notebook_source())
            .collect();
        live_setup_source(chapter, &all, options)?
    } else {
        setup_source(chapter, options)
    };
    let mut cells = vec![
        markdown(
            "intro",
            &format!("# {}\n\n{}", chapter.title, chapter.intro.trim()),
        ),
        code(SETUP_CELL, &setup),
    ];
    let mut shown_once = std::collections::HashSet::new();
    for ((c, cid), source) in chapter
        .cells
        .iter()
        .zip(code_cell_ids(chapter))
        .zip(&sources)
    {
        cells.push(markdown(
            &format!("{cid}-prose"),
            &format!("## {}\n\n{}", c.title, c.prose.trim()),
        ));
        match source {
            Some(source) => {
                // Shown once, at its plugin's first cell: a copy shown again
                // would replace the learner's edits of the first.
                let parts = source.cells()?;
                if shown_once.insert((source.package, source.entry)) {
                    for (i, part) in parts.iter().enumerate() {
                        let mut cell = code(&format!("{cid}-code-{}", i + 1), &part.code);
                        if let Some(solution) = &part.solution {
                            mark_exercise(&mut cell, solution);
                        }
                        cells.push(cell);
                    }
                }
                let exercise = parts.iter().any(|p| p.solution.is_some());
                cells.push(code(&cid, &run_source(c, source, exercise)));
            }
            None => cells.push(code(&cid, &format!("wb.run_cell({:?})", c.id))),
        }
    }
    let kernel = if live {
        ("Rust (workbook)", crate::kernel::KERNEL_NAME)
    } else {
        ("Rust", "rust")
    };
    let mut additional = HashMap::new();
    additional.insert(
        "workbook".to_string(),
        serde_json::json!({ "chapter": chapter.id, "check": options.check }),
    );
    Ok(nbformat::v4::Notebook {
        metadata: Metadata {
            kernelspec: Some(KernelSpec {
                display_name: kernel.0.into(),
                name: kernel.1.into(),
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
    })
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
