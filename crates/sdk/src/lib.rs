//! The plugin SDK of `workbook`.
//!
//! A cell kind is a [`Plugin`]: a name, typed parameters read from the chapter
//! file, and a `run` that records what it measured into a [`Context`]. This
//! crate is the one dependency a plugin needs: it re-exports candle and holds
//! the memory [`meter`] and the recorded [`output`] types; the models the
//! built-in cells experiment on are in `workbook-models`, the techniques in
//! the toolkit's crates.
//!
//! # Features
//!
//! `candle` (on by default) brings the plugin API, candle and the training
//! helpers. Without it the crate is the [`meter`], the [`output`] types and
//! the plain-data modules ([`metric`], [`protocol`], [`rules`], [`timing`],
//! [`file`]), which is all that displaying a report needs.
//!
//! # Why the trait lives here
//!
//! The `workbook` crate depends on the built-in plugins to register them, so
//! the trait cannot live in `workbook` without a dependency cycle. Plugins
//! depend on this crate, `workbook` depends on both: data flows one way.
//!
//! # Why `run` records into a context
//!
//! A plugin that fails or panics half-way must not lose what it printed and
//! measured before. Recording into the context as it goes keeps every line and
//! metric up to the failure; the runner reads them whatever happens.
//!
//! # Memory
//!
//! Plugins measure through [`Meter`], never through a particular meter, so the
//! same plugin reads the CPU counting allocator or a GPU memory pool. They tag
//! what they allocate with a [`Category`] and measure each variant as a
//! [`Region`] with timeline marks.
#![warn(missing_docs)]

#[cfg(feature = "candle")]
pub mod device;
pub mod file;
pub mod meter;
pub mod metric;
#[cfg(feature = "candle")]
pub mod notebook;
#[cfg(feature = "candle")]
pub mod observe;
pub mod output;
#[cfg(feature = "candle")]
pub mod plugin;
pub mod protocol;
pub mod rules;
pub mod timing;
#[cfg(feature = "candle")]
pub mod values;
#[cfg(feature = "candle")]
pub mod worker;

pub use anyhow;
#[cfg(feature = "candle")]
pub use candle_core as candle;
#[cfg(feature = "candle")]
pub use candle_nn;
#[cfg(feature = "candle")]
pub use candle_observe;
#[cfg(feature = "candle")]
pub use schemars;
pub use serde_json;

pub use meter::{Category, Meter, Residency};
pub use metric::MetricSpec;
#[cfg(feature = "candle")]
pub use notebook::{Edited, NotebookSource, SourceCell, SourceError};
pub use output::{CellOutput, Figure, PoolUse, RegionReport, Table, Unit};
#[cfg(feature = "candle")]
pub use plugin::{Context, DynPlugin, Plugin, Region};
pub use protocol::{ParamError, PluginInfo};
pub use rules::{Rules, Violation};
#[cfg(feature = "candle")]
pub use values::{median, parse_dtype, DTYPES};
