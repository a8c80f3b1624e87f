//! The worker protocol: how a runner and the process that runs one cell talk.
//!
//! The runner starts a worker per cell, writes one [`Request`] as a line of
//! JSON to its standard input and closes it. The worker answers on its
//! standard output with one [`Message`] per line, as things happen:
//! [`Message::Hello`] once the device answers, then what the cell records
//! (printed lines, metrics, regions, tables, figures, progress), and last
//! [`Message::End`] with the cell's memory. What reached the runner before a
//! worker died (a panic, an abort, a signal, the kernel's out-of-memory
//! killer, the time limit) is kept: the cell reports it beside the error.
//!
//! Standard error is free text, for the runner to quote when the worker dies.
//!
//! The protocol is versioned by [`PROTOCOL_VERSION`]; a worker that reads a
//! request of another version answers [`Message::Fatal`] naming both.

use serde::{Deserialize, Serialize};

use crate::meter::ByCategory;
use crate::output::{json_float, Figure, PoolUse, RegionReport, Table};

/// The version of this protocol. A change that an older peer cannot read
/// takes a new version.
pub const PROTOCOL_VERSION: u32 = 1;

/// What a worker is asked to run: one cell.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Request {
    /// [`PROTOCOL_VERSION`] of the runner.
    pub protocol: u32,
    /// The plugin that runs the cell.
    pub plugin: String,
    /// The cell's parameters, for the mode asked for (check parameters
    /// already laid over the full ones).
    pub params: serde_json::Value,
    /// Whether the chapter runs at check sizes.
    pub check: bool,
    /// `auto`, `cpu` or `cuda`.
    pub device: String,
    /// A cap on the bytes the cell may hold at once (the counting
    /// allocator refuses an allocation past it); none when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_memory: Option<u64>,
}

/// One line from a worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
// One message lives at a time, on its way to a pipe: its size does not
// matter, and boxing the region would allocate inside what a cell measures.
#[allow(clippy::large_enum_variant)]
pub enum Message {
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
