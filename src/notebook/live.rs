//! A chapter's cells run inside the notebook's kernel, from the code the
//! notebook shows.
//!
//! A cell whose plugin has an experiment source (`Plugin::notebook`, see
//! `workbook_sdk::notebook`) is shown as that source, in code cells the
//! learner can edit, and run by [`Live::run`]: the experiment function as
//! the notebook last defined it, with the parameters the notebook passes, in
//! this process, measured by the allocation interposer of the "Rust
//! (workbook)" kernel (`workbook kernel install`), and held to the chapter's
//! assertions as in a terminal. Cells without one run in a child process
//! ([`Live::run_cell`], as [`Notebook`] does).

use serde::de::DeserializeOwned;
use workbook_sdk::{Context, Edited, Plugin};

use super::{fail, CellView, Notebook, NotebookError};
use crate::chapter::{Cell, Chapter, ChapterError};
use crate::registry::Registry;
use crate::runner::{DeviceChoice, Isolation, Quiet, RunError, RunOptions};

/// A chapter opened in a notebook kernel.
#[derive(Debug, Clone)]
pub struct Live {
    chapter: Chapter,
    check: bool,
    device: DeviceChoice,
    child: Notebook,
}

/// Why a cell could not be run in the kernel.
#[derive(Debug, thiserror::Error)]
pub enum LiveError {
    /// The plugin passed is not the cell's.
    #[error("cell `{cell}` runs plugin `{expected}`, not `{given}`")]
    WrongPlugin {
        /// The cell.
        cell: String,
        /// Its plugin.
        expected: String,
        /// The plugin passed.
        given: String,
    },
    /// The parameters do not fit the type asked for, or cannot be written
    /// as a chapter's table.
    #[error("cell `{cell}`'s parameters: {why}")]
    Params {
        /// The cell.
        cell: String,
        /// What did not fit.
        why: String,
    },
    /// The run could not start (the device, the meter).
    #[error(transparent)]
    Run(#[from] RunError),
    /// Its plots could not be drawn.
    #[error("cell `{cell}`: cannot draw its plots: {why}")]
    Plots {
        /// The cell.
        cell: String,
        /// Why.
        why: String,
    },
    /// A cell run in a child process failed to run.
    #[error(transparent)]
    Child(#[from] NotebookError),
}

impl Live {
    /// Opens `chapter`, an id (`chapter2`) or a path relative to the
    /// kernel's folder (the notebook's), and validates it; check mode as for
    /// [`Notebook::new`] (`WORKBOOK_CHECK_MODE`).
    pub fn try_open(chapter: &str) -> Result<Self, ChapterError> {
        let child = Notebook::new(chapter);
        let dirs = crate::chapter::default_dirs();
        let path = crate::chapter::resolve(chapter, &dirs)?;
        // The plugins `workbook run` would find, external ones included.
        let mut registry = Registry::builtin();
        registry.add_external(&crate::external::search_dirs(Some(chapter), &dirs));
        let chapter = crate::chapter::load_path(&path, &registry)?;
        Ok(Self {
            chapter,
            check: child.is_check(),
            device: DeviceChoice::default(),
            child,
        })
    }

    /// [`Live::try_open`], failing the notebook cell with the error.
    pub fn open(chapter: &str) -> Self {
        Self::try_open(chapter).unwrap_or_else(|e| fail(&e.to_string()))
    }

    /// Runs the cells that run in a child process with this `workbook`
    /// binary (see [`Notebook::binary`]).
    pub fn binary(mut self, path: impl Into<std::path::PathBuf>) -> Self {
        self.child = self.child.binary(path);
        self
    }

    /// Check-size parameters (`true`) or full-size ones.
    pub fn check(mut self, on: bool) -> Self {
        self.check = on;
        self.child = self.child.check(on);
        self
    }

    /// Whether cells run at check size.
    pub fn is_check(&self) -> bool {
        self.check
    }

    /// The device cells run on in the kernel.
    pub fn device(mut self, device: DeviceChoice) -> Self {
        self.device = device;
        self.child = self.child.device(device.name());
        self
    }

    /// The chapter.
    pub fn chapter(&self) -> &Chapter {
        &self.chapter
    }

    fn cell(&self, id: &str) -> Result<&Cell, LiveError> {
        self.chapter
            .cells
            .iter()
            .find(|c| c.id == id)
            .ok_or_else(|| RunError::unknown_cell(&self.chapter, id).into())
    }

    /// Cell `id`'s parameters in the chapter, at the current size, as the
    /// plugin's type (defaults filled in).
    pub fn try_params<P: DeserializeOwned>(&self, id: &str) -> Result<P, LiveError> {
        let cell = self.cell(id)?;
        toml::Value::Table(cell.params_for(self.check).clone())
            .try_into()
            .map_err(|e: toml::de::Error| LiveError::Params {
                cell: id.to_string(),
                why: e.message().to_string(),
            })
    }

    /// [`Live::try_params`], failing the notebook cell with the error.
    pub fn params<P: DeserializeOwned>(&self, id: &str) -> P {
        self.try_params(id).unwrap_or_else(|e| fail(&e.to_string()))
    }

    /// Runs cell `id` in this process: `experiment` with `params`, under
    /// `plugin`'s name, rules and metrics, held to the cell's assertions. A
    /// cell that failed an assertion or errored is `Ok`: see
    /// [`CellView::failure`].
    pub fn try_run<P, F>(
        &self,
        id: &str,
        plugin: P,
        params: P::Params,
        experiment: F,
    ) -> Result<CellView, LiveError>
    where
        P: Plugin,
        F: Fn(&mut Context, P::Params) -> anyhow::Result<()> + Send + Sync + 'static,
    {
        let cell = self.cell(id)?;
        if plugin.name() != cell.plugin {
            return Err(LiveError::WrongPlugin {
                cell: id.to_string(),
                expected: cell.plugin.clone(),
                given: plugin.name().to_string(),
            });
        }
        let table = params_table(&params).map_err(|why| LiveError::Params {
            cell: id.to_string(),
            why,
        })?;
        // The chapter with this cell's parameters replaced by the ones
        // passed, at either size, and its plugin by the edited experiment.
        let mut chapter = self.chapter.clone();
        for c in chapter.cells.iter_mut().filter(|c| c.id == id) {
            c.params = table.clone();
            c.check_params = table.clone();
        }
        let mut registry = Registry::new();
        registry
            .add(Box::new(Edited::new(plugin, experiment)))
            .expect("a new registry holds no plugin");
        let options = RunOptions {
            check: self.check,
            cells: vec![id.to_string()],
            device: self.device,
            isolation: Isolation::InProcess,
            ..RunOptions::default()
        };
        let report =
            without_panic_output(|| crate::runner::run(&registry, &chapter, &options, &mut Quiet))?;
        CellView::new(report)
            .map(|v| v.measured_in("in this kernel"))
            .map_err(|e| LiveError::Plots {
                cell: id.to_string(),
                why: format!("{e:#}"),
            })
    }

    /// [`Live::try_run`] for an exercise: returns the cell's view, passed
    /// or not, so that the notebook shows what failed (an unfinished
    /// exercise's `todo!` as the cell's error) and the kernel keeps its
    /// state for the learner's next try. Only a call that cannot run the
    /// cell at all (an unknown cell, another plugin's, parameters the
    /// chapter's table cannot hold) fails the notebook cell.
    pub fn grade<P, F>(&self, id: &str, plugin: P, params: P::Params, experiment: F) -> CellView
    where
        P: Plugin,
        F: Fn(&mut Context, P::Params) -> anyhow::Result<()> + Send + Sync + 'static,
    {
        self.try_run(id, plugin, params, experiment)
            .unwrap_or_else(|e| fail(&e.to_string()))
    }

    /// [`Live::try_run`] for a notebook: returns the cell's view when it
    /// passed, and otherwise prints its results as text and fails the
    /// notebook cell with what failed (see the module docs of
    /// [`crate::notebook`]).
    pub fn run<P, F>(&self, id: &str, plugin: P, params: P::Params, experiment: F) -> CellView
    where
        P: Plugin,
        F: Fn(&mut Context, P::Params) -> anyhow::Result<()> + Send + Sync + 'static,
    {
        match self.try_run(id, plugin, params, experiment) {
            Ok(view) => super::shown(view),
            Err(e) => fail(&e.to_string()),
        }
    }

    /// Runs cell `id` in a child process, as [`Notebook::run_cell`] does:
    /// for the cells whose code the notebook does not show.
    pub fn run_cell(&self, id: &str) -> CellView {
        self.child.run_cell(id)
    }
}

/// Runs `f` with panics kept off standard error. A panic inside a cell is
/// the cell's error, shown in its results; the default hook would print it
/// again with a backtrace on the kernel's standard error, which Jupyter
/// shows late, under whichever cell runs next (seen after an unfinished
/// exercise's `todo!()`). The kernel runs one cell at a time, so the hook
/// is swapped for the call and put back.
fn without_panic_output<T>(f: impl FnOnce() -> T) -> T {
    type Hook = Box<dyn Fn(&std::panic::PanicHookInfo<'_>) + Sync + Send>;
    struct Restore(Option<Hook>);
    impl Drop for Restore {
        fn drop(&mut self) {
            // (`set_hook` may not be called while unwinding.)
            if let Some(hook) = self.0.take().filter(|_| !std::thread::panicking()) {
                std::panic::set_hook(hook);
            }
        }
    }
    let _restore = Restore(Some(std::panic::take_hook()));
    std::panic::set_hook(Box::new(|_| {}));
    f()
}

/// Parameters as a chapter's table, as the runner takes them: a plugin
/// without parameters (`()`) has an empty one.
fn params_table<T: serde::Serialize>(params: &T) -> Result<toml::Table, String> {
    match toml::Table::try_from(params) {
        Ok(table) => Ok(table),
        Err(_) if serde_json::to_value(params).is_ok_and(|v| v.is_null()) => Ok(toml::Table::new()),
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Serialize)]
    struct Params {
        norm: f64,
        not_a_number: f64,
        widths: Vec<usize>,
        name: Option<String>,
    }

    #[test]
    fn parameters_become_the_chapters_table_infinities_and_all() {
        let table = params_table(&Params {
            norm: f64::INFINITY,
            not_a_number: f64::NAN,
            widths: vec![2, 3],
            name: None,
        })
        .unwrap();
        assert_eq!(table["norm"].as_float(), Some(f64::INFINITY));
        assert!(table["not_a_number"].as_float().unwrap().is_nan());
        assert_eq!(
            table["widths"],
            toml::Value::Array(vec![2.into(), 3.into()])
        );
        assert!(!table.contains_key("name"));
        assert_eq!(params_table(&()).unwrap(), toml::Table::new());
        assert_eq!(params_table(&5u32).unwrap_err(), "unsupported rust type");
    }
}
