//! Runs a notebook's code cells through the evcxr crate, without a Jupyter
//! server, and records their outputs in the notebook as Jupyter would.
//!
//! Like `jupyter nbconvert --execute`, execution stops at the first cell that
//! fails; that cell gets an `error` output and the cells after it keep no
//! outputs. The program that calls [`execute`] must call
//! [`evcxr::runtime_hook`] first thing in `main`: evcxr runs cells in a child
//! process started from the same executable.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use jupyter_protocol::media::{Media, MediaType};
use nbformat::v4::{Cell, ErrorOutput, MultilineString, Output};

/// How to execute.
#[derive(Debug, Clone, Default)]
pub struct ExecuteOptions {
    /// Where evcxr builds cells and their dependencies. Kept between runs,
    /// later executions reuse the compiled dependencies; a fresh temporary
    /// folder when `None`.
    pub cache_dir: Option<PathBuf>,
}

/// What happened to one code cell.
#[derive(Debug, Clone)]
pub struct CellRun {
    /// The notebook cell's id.
    pub id: String,
    /// Compile and run time, in seconds.
    pub seconds: f64,
    /// The error, when it failed: evcxr's message after what the cell wrote
    /// to stderr (a panic's message among it).
    pub error: Option<String>,
}

/// The result of [`execute`].
#[derive(Debug, Clone)]
pub struct Execution {
    /// The code cells that ran, in order; the last one failed when any did.
    pub cells: Vec<CellRun>,
    /// The code cells not run after a failure.
    pub not_run: usize,
    /// Total seconds, starting evcxr included.
    pub seconds: f64,
}

impl Execution {
    /// The cell that failed, if one did.
    pub fn failure(&self) -> Option<&CellRun> {
        self.cells.last().filter(|c| c.error.is_some())
    }
}

/// The default build cache: `$XDG_CACHE_HOME/workbook/evcxr`, else
/// `~/.cache/workbook/evcxr`.
pub fn default_cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("workbook").join("evcxr"))
}

fn lock_cache(dir: &Path) -> anyhow::Result<File> {
    use anyhow::Context as _;
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create the evcxr cache {}", dir.display()))?;
    let lock = File::create(dir.join(".workbook-lock"))
        .with_context(|| format!("cannot create a lock in {}", dir.display()))?;
    // Two executions sharing one build folder would overwrite each other's
    // cell sources.
    lock.lock()
        .with_context(|| format!("cannot lock {}", dir.display()))?;
    Ok(lock)
}

/// Collects the lines of one of evcxr's output channels as they come: evcxr
/// waits for its stdout channel to be emptied before a cell returns.
struct Collector {
    lines: Arc<Mutex<Vec<String>>>,
}

impl Collector {
    fn spawn(rx: crossbeam_channel::Receiver<String>) -> Self {
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&lines);
        std::thread::spawn(move || {
            while let Ok(line) = rx.recv() {
                sink.lock().unwrap_or_else(|e| e.into_inner()).push(line);
            }
        });
        Self { lines }
    }

    /// The lines received since the last call, after `settle` for those
    /// still on their way.
    fn take(&self, settle: Duration) -> Vec<String> {
        std::thread::sleep(settle);
        std::mem::take(&mut *self.lines.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

fn stream(name: &str, lines: &[String]) -> Option<Output> {
    (!lines.is_empty()).then(|| Output::Stream {
        name: name.to_string(),
        text: MultilineString(lines.iter().map(|l| format!("{l}\n")).collect()),
    })
}

/// `code` without evcxr's `:cache` command. Here the build folder is kept
/// between executions (`--cache-dir`), and evcxr's artifact cache on top of
/// a kept folder hands a later execution a cell library built from an
/// earlier one's code (`dlsym failed`); a Jupyter kernel builds in a fresh
/// folder each session, where the cache is what makes it fast.
fn without_artifact_cache(code: &str) -> String {
    code.split_inclusive('\n')
        .filter(|line| !line.trim_start().starts_with(":cache"))
        .collect()
}

/// Executes every code cell of `nb` in order, writing their outputs and
/// execution counts into it. `progress` hears each cell as it starts and ends.
pub fn execute(
    nb: &mut nbformat::v4::Notebook,
    options: &ExecuteOptions,
    progress: &mut dyn FnMut(Progress<'_>),
) -> anyhow::Result<Execution> {
    let started = Instant::now();
    let _lock = match &options.cache_dir {
        Some(dir) => {
            let lock = lock_cache(dir)?;
            // evcxr reads its build folder from this variable only.
            std::env::set_var("EVCXR_TMPDIR", dir);
            Some(lock)
        }
        None => None,
    };
    let (mut ctx, outputs) =
        evcxr::CommandContext::new().map_err(|e| anyhow::anyhow!("cannot start evcxr: {e}"))?;
    let stdout = Collector::spawn(outputs.stdout);
    let stderr = Collector::spawn(outputs.stderr);
    let mut runs = Vec::new();
    let mut count = 0;
    let mut failed = false;
    let mut not_run = 0;
    for cell in nb.cells.iter_mut() {
        let Cell::Code {
            id,
            source,
            outputs: cell_outputs,
            execution_count,
            ..
        } = cell
        else {
            continue;
        };
        cell_outputs.clear();
        *execution_count = None;
        if failed {
            not_run += 1;
            continue;
        }
        count += 1;
        progress(Progress::Started {
            id: id.as_str(),
            index: count,
        });
        let t = Instant::now();
        let result = ctx.execute(&without_artifact_cache(&source.concat()));
        let seconds = t.elapsed().as_secs_f64();
        // Lines reach the collectors through evcxr's reader threads; a
        // failed cell's stderr may still be on its way when `execute` returns.
        let settle = Duration::from_millis(if result.is_err() { 300 } else { 30 });
        let out_lines = stdout.take(settle);
        let err_lines = stderr.take(Duration::ZERO);
        cell_outputs.extend(stream("stdout", &out_lines));
        cell_outputs.extend(stream("stderr", &err_lines));
        *execution_count = Some(count as i32);
        let error = match result {
            Ok(out) => {
                let mut media = Vec::new();
                let mut kinds: Vec<_> = out.content_by_mime_type.into_iter().collect();
                kinds.sort();
                for (mime, content) in kinds {
                    media.push(match mime.as_str() {
                        "text/html" => MediaType::Html(content),
                        "image/svg+xml" => MediaType::Svg(content),
                        "image/png" => MediaType::Png(content),
                        "text/markdown" => MediaType::Markdown(content),
                        _ => MediaType::Plain(content),
                    });
                }
                if !media.is_empty() {
                    cell_outputs.push(Output::ExecuteResult(nbformat::v4::ExecuteResult {
                        execution_count: jupyter_protocol::ExecutionCount::new(count),
                        data: Media::new(media),
                        metadata: serde_json::Map::new(),
                    }));
                }
                None
            }
            Err(e) => {
                let evalue = e.to_string();
                let mut traceback = err_lines.clone();
                traceback.push(evalue.clone());
                cell_outputs.push(Output::Error(ErrorOutput {
                    ename: "Error".into(),
                    evalue: evalue.clone(),
                    traceback,
                }));
                failed = true;
                let mut message = err_lines.join("\n");
                if !message.is_empty() {
                    message.push('\n');
                }
                message.push_str(&evalue);
                Some(message)
            }
        };
        progress(Progress::Finished {
            id: id.as_str(),
            index: count,
            seconds,
            failed: error.is_some(),
        });
        runs.push(CellRun {
            id: id.to_string(),
            seconds,
            error,
        });
    }
    Ok(Execution {
        cells: runs,
        not_run,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// What [`execute`] reports as it goes.
#[derive(Debug, Clone, Copy)]
pub enum Progress<'a> {
    /// Code cell number `index` (from 1) started.
    Started {
        /// Its id.
        id: &'a str,
        /// Its number among code cells.
        index: usize,
    },
    /// It ended.
    Finished {
        /// Its id.
        id: &'a str,
        /// Its number among code cells.
        index: usize,
        /// How long it took.
        seconds: f64,
        /// Whether it failed.
        failed: bool,
    },
}
