//! External plugins: executables named `workbook-plugin-NAME`, found on
//! PATH or in a `plugins` folder beside the chapters, that speak the worker
//! protocol ([`workbook_sdk::protocol`]). The runner asks one for its
//! description once, checks parameters through it, and runs each of its
//! cells in a process of its own, as it runs a built-in plugin's.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Mutex;
use std::time::Duration;

use workbook_sdk::protocol::{
    Body, Message, ParamError, PluginInfo, Request, Verdict, MAX_LINE_BYTES, PROTOCOL_VERSION,
};
use workbook_sdk::{Context, DynPlugin, MetricSpec, Violation};

use crate::child::{Group, Line};
use crate::excerpt::excerpt;

/// The start of an external plugin's file name.
pub const PREFIX: &str = "workbook-plugin-";

/// How long a plugin may take to describe itself or check parameters.
const ANSWER_LIMIT: Duration = Duration::from_secs(60);

/// Why an external plugin cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("plugin program {program}: {message}")]
pub struct ExternalError {
    /// The executable.
    pub program: PathBuf,
    /// What went wrong.
    pub message: String,
}

/// The executables named `workbook-plugin-NAME` in `dirs`, by NAME, the
/// first folder's first: as cargo finds `cargo-NAME` subcommands.
pub fn discover(dirs: &[PathBuf]) -> Vec<(String, PathBuf)> {
    use std::os::unix::fs::PermissionsExt;
    let mut found: Vec<(String, PathBuf)> = Vec::new();
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        let mut here: Vec<(String, PathBuf)> = entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let file = e.file_name().into_string().ok()?;
                let name = file.strip_prefix(PREFIX)?.to_string();
                let path = e.path();
                // Executable regular files (through links) only.
                let meta = std::fs::metadata(&path).ok()?;
                (meta.is_file() && meta.permissions().mode() & 0o111 != 0 && !name.is_empty())
                    .then_some((name, path))
            })
            .collect();
        here.sort();
        for (name, path) in here {
            if !found.iter().any(|(n, _)| *n == name) {
                found.push((name, path));
            }
        }
    }
    found
}

/// Where external plugins are looked for, first first: a `plugins` folder
/// beside the chapter named (when it is named by its `.toml` path), then
/// beside each folder chapters are looked for in, then the folders of PATH.
pub fn search_dirs(chapter: Option<&str>, chapter_dirs: &[PathBuf]) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = chapter
        .map(std::path::Path::new)
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .and_then(|p| p.parent())
        .map(|d| d.join("plugins"))
        .into_iter()
        .collect();
    dirs.extend(chapter_dirs.iter().map(|d| d.join("plugins")));
    dirs.extend(path_dirs());
    dirs
}

/// The folders of the PATH environment variable.
pub fn path_dirs() -> Vec<PathBuf> {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default()
}

/// An external plugin: its program and what it said of itself.
#[derive(Debug)]
pub struct ExternalPlugin {
    program: PathBuf,
    info: PluginInfo,
    /// Verdicts by table (as JSON text): a chapter asks for the same table
    /// several times (types, values, the memory floor, the report).
    verdicts: Mutex<HashMap<String, Verdict>>,
}

impl ExternalPlugin {
    /// Asks `program` to describe itself; `name` is the NAME of its file
    /// name, which must be the name it gives.
    pub fn load(name: &str, program: &Path) -> Result<Self, ExternalError> {
        let fail = |message: String| ExternalError {
            program: program.to_path_buf(),
            message,
        };
        let answer = ask(program, &Request::new(Body::Describe)).map_err(fail)?;
        let Message::Described { protocol, plugins } = answer else {
            return Err(fail("did not answer the request to describe itself".into()));
        };
        if protocol != PROTOCOL_VERSION {
            return Err(fail(format!(
                "it speaks protocol version {protocol}; this workbook speaks version \
                 {PROTOCOL_VERSION} (rebuild the plugin against this workbook's SDK)"
            )));
        }
        let mut plugins = plugins.into_iter();
        let (Some(info), None) = (plugins.next(), plugins.next()) else {
            return Err(fail("must describe exactly one plugin".into()));
        };
        if info.name != name {
            return Err(fail(format!(
                "calls itself `{}`, but its file name says `{name}`; name the executable \
                 `{PREFIX}{}`",
                info.name, info.name
            )));
        }
        Ok(Self {
            program: program.to_path_buf(),
            info,
            verdicts: Mutex::default(),
        })
    }

    /// The executable.
    pub fn program(&self) -> &Path {
        &self.program
    }

    /// The plugin's verdict on `params`, asked once per table.
    fn verdict_of(&self, params: &toml::Table) -> Verdict {
        let json = serde_json::to_value(params).unwrap_or_default();
        let key = json.to_string();
        if let Some(v) = self.verdicts.lock().ok().and_then(|m| m.get(&key).cloned()) {
            return v;
        }
        let request = Request::new(Body::Check {
            plugin: self.info.name.clone(),
            tables: vec![json],
        });
        let verdict = match ask(&self.program, &request) {
            Ok(Message::Checked { mut verdicts }) if verdicts.len() == 1 => verdicts.remove(0),
            Ok(_) => failed_check(format!(
                "plugin program {} answered the check of its parameters with another message",
                self.program.display()
            )),
            Err(e) => failed_check(format!(
                "plugin program {} cannot check parameters: {e}",
                self.program.display()
            )),
        };
        if let Ok(mut m) = self.verdicts.lock() {
            m.insert(key, verdict.clone());
        }
        verdict
    }
}

fn failed_check(message: String) -> Verdict {
    Verdict {
        params: Err(ParamError {
            field: String::new(),
            message,
        }),
        violations: Vec::new(),
        memory_floor: None,
        unavailable: None,
    }
}

impl DynPlugin for ExternalPlugin {
    fn name(&self) -> &str {
        &self.info.name
    }

    fn description(&self) -> &str {
        &self.info.description
    }

    fn info(&self) -> PluginInfo {
        self.info.clone()
    }

    fn declared_metrics(&self) -> Vec<MetricSpec> {
        self.info.metrics.clone()
    }

    fn check_params(&self, params: &toml::Table) -> Result<serde_json::Value, ParamError> {
        self.verdict_of(params).params
    }

    fn validate_params(&self, params: &toml::Table) -> Result<Vec<Violation>, ParamError> {
        let v = self.verdict_of(params);
        v.params.map(|_| v.violations)
    }

    fn memory_floor_of(&self, params: &toml::Table) -> Option<(u64, String)> {
        self.verdict_of(params).memory_floor
    }

    fn unavailable_with(&self, params: &toml::Table) -> Option<String> {
        self.verdict_of(params).unavailable
    }

    fn run_with(&self, _ctx: &mut Context, _params: &toml::Table) -> anyhow::Result<()> {
        anyhow::bail!(
            "plugin `{}` is an external program ({}); its cells run in their own processes",
            self.info.name,
            self.program.display()
        )
    }

    fn verdict(&self, params: &toml::Table) -> Verdict {
        self.verdict_of(params)
    }
}

/// Sends `request` to a new process of `program` and reads its one answer:
/// the first line it writes, at most [`MAX_LINE_BYTES`]. Its standard
/// input, output and error are each served by a thread of their own, so
/// that no pipe can fill and stall it, and its process group is ended at
/// [`ANSWER_LIMIT`] whatever it does.
fn ask(program: &Path, request: &Request) -> Result<Message, String> {
    let mut command = crate::child::command(program);
    command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut group = Group::spawn(&mut command).map_err(|e| format!("cannot start it: {e}"))?;
    if let Some(mut stdin) = group.child().stdin.take() {
        let mut line = serde_json::to_vec(request).unwrap_or_default();
        line.push(b'\n');
        // A program that does not read its input must not stall the runner;
        // one that died at once is reported from its exit below.
        std::thread::spawn(move || {
            let _ = stdin.write_all(&line);
        });
    }
    let (tx, rx) = mpsc::channel();
    if let Some(stdout) = group.child().stdout.take() {
        std::thread::spawn(move || {
            crate::child::read_lines(stdout, MAX_LINE_BYTES, |line| match line {
                Line::Text(t) if t.trim().is_empty() => true,
                Line::Text(t) => {
                    let _ = tx.send(Ok(t));
                    false
                }
                bad => {
                    let _ = tx.send(Err(bad.problem().unwrap_or_default()));
                    false
                }
            });
        });
    }
    let tail_rx = crate::child::read_tail(group.child().stderr.take());
    let answer = rx.recv_timeout(ANSWER_LIMIT);
    // Whatever it answered, the process has nothing more to say: it has a
    // moment to exit, then its group is ended and it is reaped.
    let status = group.wait(Duration::from_millis(100));
    let line = match answer {
        Ok(Ok(line)) => line,
        Ok(Err(problem)) => {
            return Err(format!(
                "its answer is not protocol version {PROTOCOL_VERSION}'s: {problem}"
            ))
        }
        Err(RecvTimeoutError::Timeout) => {
            return Err(format!(
                "it did not answer within {} s",
                ANSWER_LIMIT.as_secs()
            ))
        }
        Err(RecvTimeoutError::Disconnected) => {
            // Its output ended without a line: why is on its standard error.
            // (A process it started may hold the pipe open: not for long.)
            let tail = tail_rx
                .recv_timeout(Duration::from_secs(1))
                .unwrap_or_default();
            let said = String::from_utf8_lossy(&tail)
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .map(|l| format!("; it said: {}", excerpt(l.trim(), 300)))
                .unwrap_or_default();
            let how = match status {
                Ok(s) => s.to_string(),
                Err(e) => e.to_string(),
            };
            return Err(format!("it ended ({how}) without an answer{said}"));
        }
    };
    match serde_json::from_str::<Message>(&line) {
        Ok(Message::Fatal { message }) => Err(message),
        Ok(m) => Ok(m),
        Err(e) => Err(format!(
            "its answer is not protocol version {PROTOCOL_VERSION}'s ({e}): {}",
            excerpt(line.trim(), 200)
        )),
    }
}
