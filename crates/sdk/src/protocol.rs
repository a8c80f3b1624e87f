//! The worker protocol: how a runner and the process that serves a plugin
//! talk. The `workbook` binary's own worker (`workbook worker`) and an
//! external plugin (an executable `workbook-plugin-NAME`, whose `main` is
//! [`crate::main!`]) speak it alike.
//!
//! The runner starts the process, writes one [`Request`] as a line of JSON
//! to its standard input and closes it. The process answers on its standard
//! output with one [`Message`] per line:
//!
//! - to [`Body::Describe`], one [`Message::Described`]: the plugin's
//!   name, description, parameters and metrics (the handshake: it names the
//!   protocol version the plugin speaks);
//! - to [`Body::Check`], one [`Message::Checked`] with a verdict per
//!   parameter table;
//! - to [`Body::Run`], [`Message::Hello`] once the device answers, then
//!   what the cell records (printed lines, metrics, regions, tables,
//!   figures, progress) as it happens, and last [`Message::End`] with the
//!   cell's memory. What reached the runner before the process died (a
//!   panic, an abort, a signal, the kernel's out-of-memory killer, the time
//!   limit) is kept: the cell reports it beside the error.
//!
//! Standard error is free text, for the runner to quote when the process
//! dies.
//!
//! The protocol is versioned by [`PROTOCOL_VERSION`]: a process that reads
//! a request of another version answers [`Message::Fatal`] naming both, and
//! a runner refuses an answer of another version the same way.

use serde::{Deserialize, Serialize};

use crate::meter::ByCategory;
use crate::metric::MetricSpec;
use crate::output::{json_float, Figure, PoolUse, RegionReport, Table};
use crate::rules::Violation;

/// The version of this protocol. A change that an older peer cannot read
/// takes a new version.
pub const PROTOCOL_VERSION: u32 = 3;

/// The longest line either side may write, newline included: a runner
/// stops reading a process past it (a plugin that never ends its line
/// must not exhaust the runner's memory), and reports the line as the
/// cell's error.
pub const MAX_LINE_BYTES: usize = 64 << 20;

/// One request: the protocol version and what is asked.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Request {
    /// [`PROTOCOL_VERSION`] of the runner.
    pub protocol: u32,
    /// What is asked.
    #[serde(flatten)]
    pub body: Body,
}

impl Request {
    /// A request of this protocol version.
    pub fn new(body: Body) -> Self {
        Self {
            protocol: PROTOCOL_VERSION,
            body,
        }
    }
}

/// What a runner asks of a plugin's process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "request", rename_all = "snake_case")]
pub enum Body {
    /// Describe the plugin(s) served: answered by [`Message::Described`].
    Describe,
    /// Check parameter tables: answered by [`Message::Checked`], one
    /// verdict per table, in order.
    Check {
        /// The plugin.
        plugin: String,
        /// The tables, as a chapter gives them (JSON objects).
        tables: Vec<serde_json::Value>,
    },
    /// Run one cell.
    Run(RunCell),
}

/// What a process is asked to run: one cell.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunCell {
    /// The plugin that runs the cell.
    pub plugin: String,
    /// The cell's parameters, for the mode asked for (check parameters
    /// already laid over the full ones).
    pub params: serde_json::Value,
    /// Whether the chapter runs at check sizes.
    pub check: bool,
    /// `auto`, `cpu` or `cuda`.
    pub device: String,
    /// A cap on the bytes the cell may hold at once on its device; none
    /// when absent. On the CPU the counting allocator refuses an
    /// allocation past it (the machine's memory where absent); on a GPU
    /// the meter's interposer does, and the heap is held to the machine's
    /// memory. (Version 3: in version 2 it always capped the heap.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_memory: Option<u64>,
}

/// A plugin as it describes itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PluginInfo {
    /// The name chapters use in `plugin = "..."`.
    pub name: String,
    /// One line on what it measures.
    pub description: String,
    /// The JSON Schema of its parameters.
    pub params: serde_json::Value,
    /// The metrics it records.
    pub metrics: Vec<MetricSpec>,
}

/// A parameter table that does not fit a plugin's parameters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct ParamError {
    /// The path of the field at fault (`batch`, `sizes[2]`), empty when the
    /// table as a whole is at fault.
    pub field: String,
    /// What was wrong, naming the expected type or the valid fields.
    pub message: String,
}

/// A plugin's verdict on one parameter table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    /// The table with defaults filled in, or why it does not fit.
    pub params: Result<serde_json::Value, ParamError>,
    /// Values the experiment cannot run with (when the table fits).
    pub violations: Vec<Violation>,
    /// The least memory the cell must hold, and what it is.
    pub memory_floor: Option<(u64, String)>,
    /// Why this build of the plugin cannot run the cell, if it cannot (see
    /// [`Plugin::unavailable`](crate::Plugin::unavailable)); absent from
    /// the answers of plugins built before it was added.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unavailable: Option<String>,
}

/// One line from a worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
// One message lives at a time, on its way to a pipe: its size does not
// matter, and boxing the region would allocate inside what a cell measures.
#[allow(clippy::large_enum_variant)]
pub enum Message {
    /// The answer to [`Body::Describe`]: the plugins served.
    Described {
        /// The process's [`PROTOCOL_VERSION`].
        protocol: u32,
        /// The plugins.
        plugins: Vec<PluginInfo>,
    },
    /// The answer to [`Body::Check`].
    Checked {
        /// One verdict per table, in order.
        verdicts: Vec<Verdict>,
    },
    /// The worker is ready: the device answered and was warmed up.
    Hello {
        /// The worker's [`PROTOCOL_VERSION`].
        protocol: u32,
        /// The device tensors go on, as a report names it.
        device: String,
        /// The meter's name.
        meter: String,
    },
    /// A line the cell printed.
    Printed {
        /// The line.
        line: String,
    },
    /// A metric the cell recorded.
    Metric {
        /// Its name.
        name: String,
        /// Its value (NaN and infinities included).
        #[serde(with = "json_float")]
        value: f64,
    },
    /// A measured region, when it ended.
    Region(RegionReport),
    /// A table.
    Table(Table),
    /// A figure.
    Figure(Figure),
    /// Progress of a long cell, for a spinner.
    Progress {
        /// What the cell is doing.
        message: String,
    },
    /// The cell ended, with or without an error.
    End(CellEnd),
    /// The worker cannot run the cell at all (a device that does not
    /// answer, a request of another protocol version).
    Fatal {
        /// Why.
        message: String,
    },
}

/// How a cell ended, and its memory over the whole cell.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CellEnd {
    /// The plugin's error or panic, if any.
    pub error: Option<String>,
    /// Wall time of the cell, in seconds.
    #[serde(with = "json_float")]
    pub seconds: f64,
    /// Bytes live when the cell began, by category.
    pub baseline: ByCategory,
    /// The highest total during the cell (baseline included).
    pub peak_bytes: u64,
    /// The split at that peak.
    pub peak_by_category: ByCategory,
    /// Bytes live when the cell ended, by category.
    pub end: ByCategory,
    /// On a GPU, the memory pool's own figures for the cell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<PoolUse>,
}

impl CellEnd {
    /// A cell that ended before it measured anything, with `error`.
    pub fn failed(error: String, seconds: f64) -> Self {
        Self {
            error: Some(error),
            seconds,
            baseline: ByCategory::default(),
            peak_bytes: 0,
            peak_by_category: ByCategory::default(),
            end: ByCategory::default(),
            pool: None,
        }
    }
}

impl Message {
    /// Writes the message as one line of JSON and flushes. It serialises
    /// straight into `w`: into a buffered standard output, it allocates
    /// nothing, so streaming a cell's records does not show in what the
    /// cell measures.
    pub fn write_line(&self, w: &mut impl std::io::Write) -> std::io::Result<()> {
        serde_json::to_writer(&mut *w, self).map_err(std::io::Error::other)?;
        w.write_all(b"\n")?;
        w.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn written(m: &Message) -> String {
        let mut out = Vec::new();
        m.write_line(&mut out).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn messages_are_tagged_lines_that_read_back() {
        let m = Message::Metric {
            name: "loss".into(),
            value: f64::INFINITY,
        };
        let line = written(&m);
        assert_eq!(
            line,
            "{\"type\":\"metric\",\"name\":\"loss\",\"value\":\"inf\"}\n"
        );
        assert_eq!(serde_json::from_str::<Message>(&line).unwrap(), m);
        let hello = Message::Hello {
            protocol: PROTOCOL_VERSION,
            device: "cpu".into(),
            meter: "cpu-allocator".into(),
        };
        assert_eq!(
            serde_json::from_str::<Message>(&written(&hello)).unwrap(),
            hello
        );
    }
}
