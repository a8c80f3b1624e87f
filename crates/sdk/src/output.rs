//! What a plugin records while it runs: printed lines, named metrics, memory
//! regions with their timelines, tables and figures.
//!
//! These types are serialised as the `output` part of each cell in the JSON
//! report (see the `workbook` crate's `report` module), so field names here
//! are part of that contract.

use indexmap::IndexMap;
use serde::{Deserialize, Serialize};

use crate::meter::{ByCategory, MemorySnapshot};

pub mod json_float;

/// Bytes in MiB (2^20 bytes), for printed lines.
pub fn mib(bytes: u64) -> f64 {
    bytes as f64 / 1_048_576.0
}

/// Everything one cell recorded.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct CellOutput {
    /// Lines the cell printed, in order (the notebook's `print` output).
    pub printed: Vec<String>,
    /// Named measurements that assertions read, in the order recorded.
    pub metrics: IndexMap<String, f64>,
    /// Memory regions, one per variant measured.
    pub regions: Vec<RegionReport>,
    /// Tables of results (sweeps, per-dtype figures).
    pub tables: Vec<Table>,
    /// Data for plots.
    pub figures: Vec<Figure>,
}

/// One variant's memory, measured from a fresh peak.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct RegionReport {
    /// The variant's name, such as `plain` or `checkpointed, 4 segments`.
    pub name: String,
    /// Bytes live when the region began, by category.
    pub baseline: ByCategory,
    /// The highest total reached inside the region (absolute, baseline included).
    pub peak_bytes: u64,
    /// The split by category at that peak.
    pub peak_by_category: ByCategory,
    /// The highest each category reached on its own (absolute), each at its
    /// own moment.
    #[serde(default)]
    pub peak_each: ByCategory,
    /// The host-resident part of `baseline`.
    #[serde(default)]
    pub baseline_host: ByCategory,
    /// The highest each category reached on the device (absolute).
    #[serde(default)]
    pub device_peak_each: ByCategory,
    /// The highest each category reached on the host (absolute).
    #[serde(default)]
    pub host_peak_each: ByCategory,
    /// The highest device-resident total at one moment (absolute): the
    /// peak a device's memory must hold, host-resident bytes left out.
    #[serde(default)]
    pub device_peak_bytes: u64,
    /// Bytes live when the region ended, by category.
    pub end: ByCategory,
    /// The host-resident part of `end`.
    #[serde(default)]
    pub end_host: ByCategory,
    /// Blocks live when the region began.
    pub baseline_blocks: u64,
    /// The most blocks live at once inside the region.
    pub peak_blocks: u64,
    /// Wall time of the region, in seconds.
    #[serde(with = "json_float")]
    pub seconds: f64,
    /// Points of the memory timeline, in order.
    pub marks: Vec<Mark>,
    /// The analytic figure for this variant, in bytes, where there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub analytic: Option<u64>,
    /// On a GPU, the CUDA memory pool's own figures for the region.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<PoolUse>,
}

/// A stretch of a run (a region, a cell) as the CUDA memory pool saw it,
/// beside the bytes counted by category.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct PoolUse {
    /// Bytes in use from the pool when it began.
    pub baseline: u64,
    /// The most in use at once (absolute, baseline included).
    pub peak: u64,
    /// Bytes in use when it ended.
    pub end: u64,
    /// Bytes the pool held from the driver when it ended, in use or cached
    /// (`torch.cuda.memory_reserved`).
    pub reserved: u64,
}

impl PoolUse {
    /// The pool's figures between two snapshots, the peak having been reset
    /// at `start`; `None` without a pool.
    pub fn between(start: &MemorySnapshot, end: &MemorySnapshot) -> Option<Self> {
        let (a, b) = (start.pool?, end.pool?);
        Some(Self {
            baseline: a.used,
            // A high-water mark just reset reads zero until the next
            // allocation: what is in use is a floor for it.
            peak: b.used_high.max(b.used).max(a.used),
            end: b.used,
            reserved: b.reserved,
        })
    }

    /// The peak above the baseline: what the stretch itself cost, as
    /// `torch.cuda.max_memory_allocated` minus `memory_allocated` at its start.
    pub fn peak_above_baseline(&self) -> u64 {
        self.peak.saturating_sub(self.baseline)
    }
}

impl RegionReport {
    /// Bytes of the peak above what was live when the region began: what the
    /// variant itself cost at its worst moment.
    pub fn peak_above_baseline(&self) -> u64 {
        self.peak_bytes.saturating_sub(self.baseline.total())
    }

    /// The highest bytes of one category above its baseline, whenever in the
    /// region that was.
    pub fn category_peak_above_baseline(&self, category: crate::Category) -> u64 {
        self.peak_each
            .get(category)
            .saturating_sub(self.baseline.get(category))
    }

    /// The device-resident peak above the device-resident baseline: what
    /// the variant cost the device at its worst moment.
    pub fn device_total_peak_above_baseline(&self) -> u64 {
        let base = self.baseline.total() - self.baseline_host.total();
        self.device_peak_bytes.saturating_sub(base)
    }

    /// Like [`Self::category_peak_above_baseline`], for device-resident bytes.
    pub fn device_peak_above_baseline(&self, category: crate::Category) -> u64 {
        let base = self.baseline.get(category) - self.baseline_host.get(category);
        self.device_peak_each.get(category).saturating_sub(base)
    }

    /// Like [`Self::category_peak_above_baseline`], for host-resident bytes.
    pub fn host_peak_above_baseline(&self, category: crate::Category) -> u64 {
        self.host_peak_each
            .get(category)
            .saturating_sub(self.baseline_host.get(category))
    }

    /// Blocks of the peak above those live when the region began.
    pub fn blocks_above_baseline(&self) -> u64 {
        self.peak_blocks.saturating_sub(self.baseline_blocks)
    }
}

/// One point of a memory timeline.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Mark {
    /// What had just happened, such as `after forward`.
    pub label: std::borrow::Cow<'static, str>,
    /// Seconds since the region began.
    #[serde(with = "json_float")]
    pub seconds: f64,
    /// Bytes live at this point, by category.
    pub current: ByCategory,
    /// The highest total since the region began, up to this point.
    pub peak_so_far: u64,
}

/// What a number measures, so renderers can format it.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Unit {
    /// A plain number.
    #[default]
    None,
    /// Bytes (shown as KiB, MiB, GiB).
    Bytes,
    /// Seconds.
    Seconds,
    /// A count of things.
    Count,
    /// A ratio (1.0 = equal).
    Ratio,
}

/// A column of a [`Table`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Column {
    /// The header.
    pub name: String,
    /// The unit of the column's numbers.
    #[serde(default)]
    pub unit: Unit,
}

/// A table of results. Cells are numbers or strings.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Table {
    /// The caption.
    pub title: String,
    /// The columns.
    pub columns: Vec<Column>,
    /// The rows, each as long as `columns`.
    pub rows: Vec<Vec<serde_json::Value>>,
}

impl Table {
    /// A table with the given caption and columns of the given units.
    pub fn new(title: impl Into<String>, columns: &[(&str, Unit)]) -> Self {
        Self {
            title: title.into(),
            columns: columns
                .iter()
                .map(|(n, u)| Column {
                    name: n.to_string(),
                    unit: *u,
                })
                .collect(),
            rows: Vec::new(),
        }
    }

    /// Appends a row.
    pub fn row(&mut self, cells: Vec<serde_json::Value>) -> &mut Self {
        self.rows.push(cells);
        self
    }
}

/// An axis of a [`Figure`].
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Axis {
    /// The label, without the unit.
    pub label: String,
    /// The unit of the values.
    #[serde(default)]
    pub unit: Unit,
    /// Whether the axis is logarithmic.
    #[serde(default)]
    pub log: bool,
}

/// One line of a [`Figure`].
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Series {
    /// The legend entry.
    pub name: String,
    /// `(x, y)` points in x order. A diverging loss is NaN or infinite:
    /// such values are kept (see [`json_float`]).
    #[serde(with = "json_float::points")]
    pub points: Vec<(f64, f64)>,
}

/// A vertical marker on a [`Figure`], such as the sqrt(n) point of a sweep.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Marker {
    /// Where on the x axis.
    #[serde(with = "json_float")]
    pub x: f64,
    /// What it marks.
    pub label: String,
}

/// A reference line `y = c * x^power` drawn through a figure's first point,
/// such as the N and N^2 slopes of a scaling curve.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Guide {
    /// The power of x.
    #[serde(with = "json_float")]
    pub power: f64,
    /// The legend entry, such as `N^2`.
    pub label: String,
}

/// The data of a plot: renderers draw it, plugins only fill it.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Figure {
    /// A stable identifier, used for file names.
    pub id: String,
    /// The title.
    pub title: String,
    /// The x axis.
    pub x: Axis,
    /// The y axis.
    pub y: Axis,
    /// The lines.
    pub series: Vec<Series>,
    /// Vertical markers.
    #[serde(default)]
    pub markers: Vec<Marker>,
    /// Reference slopes.
    #[serde(default)]
    pub guides: Vec<Guide>,
}
