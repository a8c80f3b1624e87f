//! `workbook`: chapters that teach deep-learning memory optimisation by
//! measuring it.
//!
//! Data flows one way: a chapter file is [loaded and validated](chapter),
//! the [runner] runs each cell's plugin, the plugin records an outcome, the
//! [assertion]s are checked against its metrics, and [render]ers display the
//! [report]. The JSON form of the report is the contract for everything that
//! displays results.
//!
//! [`Workbook`] ties these together, and is how a plugin defined outside this
//! crate is registered:
//!
//! ```no_run
//! use workbook::{Workbook, RunOptions};
//! # struct MyPlugin;
//! # impl workbook_sdk::Plugin for MyPlugin {
//! #     type Params = ();
//! #     fn name(&self) -> &str { "mine" }
//! #     fn metrics(&self) -> Vec<workbook_sdk::MetricSpec> { Vec::new() }
//! #     fn run(&self, _: &mut workbook_sdk::Context, _: ()) -> anyhow::Result<()> { Ok(()) }
//! # }
//! let wb = Workbook::builtin().with_plugin(MyPlugin)?;
//! let chapter = wb.load("chapters/chapter2.toml")?;
//! let report = wb.run(&chapter, &RunOptions::default(), &mut workbook::runner::Quiet)?;
//! println!("{}", report.summary.line());
//! # Ok::<(), anyhow::Error>(())
//! ```
//!
//! # Features
//!
//! - `runner` (default): running chapters, with candle and the built-in
//!   plugins, and running a notebook's experiments in its kernel
//!   (`notebook::live`). Without it the crate only displays reports: the
//!   [`notebook`] view and the [`render`]ers, which is what the `:dep` of a
//!   notebook whose cells all run in child processes needs.
#![warn(missing_docs)]

pub mod assertion;
#[cfg(feature = "runner")]
pub mod chapter;
#[cfg(feature = "runner")]
pub mod child;
#[cfg(feature = "runner")]
pub mod describe;
pub mod excerpt;
#[cfg(feature = "runner")]
pub mod external;
#[cfg(feature = "runner")]
pub mod kernel;
#[cfg(feature = "runner")]
pub mod new_plugin;
pub mod notebook;
#[cfg(feature = "runner")]
pub mod plan;
#[cfg(feature = "runner")]
pub mod registry;
pub mod render;
pub mod report;
#[cfg(feature = "runner")]
pub mod runner;
pub mod suggest;
pub mod terminal;
#[cfg(feature = "runner")]
pub mod worker;

#[cfg(feature = "runner")]
use std::path::PathBuf;

#[cfg(feature = "runner")]
pub use chapter::{Chapter, ChapterError};
#[cfg(feature = "runner")]
pub use notebook::live::{Live, LiveError};
pub use notebook::{CellView, Notebook, NotebookError};
#[cfg(feature = "runner")]
pub use registry::{DuplicatePlugin, Registry};
pub use report::{CellReport, ChapterReport, Status};
#[cfg(feature = "runner")]
pub use runner::{DeviceChoice, Isolation, RunError, RunObserver, RunOptions, WorkerCommand};
pub use workbook_sdk as sdk;

/// Plugins and the folders chapters are found in.
#[cfg(feature = "runner")]
#[derive(Debug)]
pub struct Workbook {
    registry: Registry,
    chapter_dirs: Vec<PathBuf>,
}

#[cfg(feature = "runner")]
impl Workbook {
    /// A workbook with no plugins.
    pub fn empty() -> Self {
        Self {
            registry: Registry::new(),
            chapter_dirs: chapter::default_dirs(),
        }
    }

    /// A workbook with the built-in plugins.
    pub fn builtin() -> Self {
        Self {
            registry: Registry::builtin(),
            chapter_dirs: chapter::default_dirs(),
        }
    }

    /// Adds a plugin; a name already registered is an error.
    pub fn with_plugin(
        mut self,
        plugin: impl sdk::DynPlugin + 'static,
    ) -> Result<Self, DuplicatePlugin> {
        self.registry.add(Box::new(plugin))?;
        Ok(self)
    }

    /// Adds the external plugins (`workbook-plugin-NAME` executables) found
    /// in `dirs`, the first folder's first; see [`Registry::add_external`].
    pub fn with_external_plugins(mut self, dirs: &[PathBuf]) -> Self {
        self.registry.add_external(dirs);
        self
    }

    /// Looks for chapters in `dirs` instead of the default folders.
    pub fn with_chapter_dirs(mut self, dirs: Vec<PathBuf>) -> Self {
        self.chapter_dirs = dirs;
        self
    }

    /// The plugins.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The folders chapters are looked for in.
    pub fn chapter_dirs(&self) -> &[PathBuf] {
        &self.chapter_dirs
    }

    /// Finds a chapter by id (`chapter2`) or path, reads and validates it.
    pub fn load(&self, name: &str) -> Result<Chapter, ChapterError> {
        let path = chapter::resolve(name, &self.chapter_dirs)?;
        chapter::load_path(&path, &self.registry)
    }

    /// Runs a loaded chapter.
    pub fn run(
        &self,
        chapter: &Chapter,
        options: &RunOptions,
        observer: &mut dyn RunObserver,
    ) -> Result<ChapterReport, RunError> {
        runner::run(&self.registry, chapter, options, observer)
    }
}
