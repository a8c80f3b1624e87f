//! Plugins whose experiment a notebook shows and runs.
//!
//! A plugin keeps its experiment, the code a learner reads and changes, in
//! one source file of its crate, `src/experiment.rs`, with a function such
//! as
//!
//! ```text
//! pub fn checkpointing_experiment(ctx: &mut Context, p: CheckpointingParams) -> anyhow::Result<()>
//! ```
//!
//! that its [`Plugin::run`] calls. A notebook keeps every cell's items by
//! name, so the experiments of one chapter name their items, the parameters'
//! type included (`use workbook_checkpointing::Params as
//! CheckpointingParams;`), each differently: the export refuses two that
//! define one name twice. The file names crates only by their
//! names (the plugin's own crate through `extern crate self as ...;` in its
//! `lib.rs`), so that the same text compiles in the crate and in a notebook
//! cell, which depends on the plugin's crate and on every crate of its
//! source tree that the plugin depends on. [`Plugin::notebook`] hands the file's text to the notebook export,
//! which shows it as the cell's code; [`Edited`] runs the code a learner
//! edited under the plugin's name, rules and metrics. What the notebook
//! shows is what `workbook run` executes, by construction.

use crate::{Context, MetricSpec, Plugin, Violation};

/// The experiment of a plugin as a notebook shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotebookSource {
    /// The plugin's package (`workbook-checkpointing`), which the notebook
    /// adds as a dependency.
    pub package: &'static str,
    /// The package's folder (`env!("CARGO_MANIFEST_DIR")`).
    pub dir: &'static str,
    /// The plugin value, by its path from the crate
    /// (`workbook_checkpointing::Checkpointing`).
    pub plugin: &'static str,
    /// The experiment function (`checkpointing_experiment`).
    pub entry: &'static str,
    /// The parameters' type as the source names it (`CheckpointingParams`).
    pub params: &'static str,
    /// The experiment's source text (`include_str!("experiment.rs")`). The
    /// `//!` lines it starts with are its file's documentation and are not
    /// shown; a line `// notebook cell` starts a new notebook code cell.
    pub source: &'static str,
}

/// The line that starts a new notebook code cell in an experiment's source.
pub const CELL_BREAK: &str = "// notebook cell";

impl NotebookSource {
    /// The source as notebook code cells: the file's documentation (the
    /// `//!` lines it starts with) dropped, cut at each [`CELL_BREAK`] line,
    /// each part trimmed; empty parts are left out.
    pub fn cells(&self) -> Vec<String> {
        let mut cells = vec![String::new()];
        let mut in_docs = true;
        for line in self.source.lines() {
            in_docs &= line.starts_with("//!");
            if in_docs {
                continue;
            }
            if line.trim() == CELL_BREAK {
                cells.push(String::new());
                continue;
            }
            let cell = cells.last_mut().expect("there is always a cell");
            cell.push_str(line);
            cell.push('\n');
        }
        cells
            .into_iter()
            .map(|c| c.trim().to_string())
            .filter(|c| !c.is_empty())
            .collect()
    }
}

/// A plugin with its experiment replaced: what a notebook runs when a
/// learner has edited the experiment's code. The name, parameters, rules,
/// memory floor and metrics stay the plugin's, so the edited code is held to
/// the same chapter as the original.
pub struct Edited<P, F> {
    plugin: P,
    experiment: F,
}

impl<P: Plugin, F> Edited<P, F>
where
    F: Fn(&mut Context, P::Params) -> anyhow::Result<()> + Send + Sync + 'static,
{
    /// `plugin` running `experiment` instead of its own.
    pub fn new(plugin: P, experiment: F) -> Self {
        Self { plugin, experiment }
    }
}

impl<P: std::fmt::Debug, F> std::fmt::Debug for Edited<P, F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Edited")
            .field("plugin", &self.plugin)
            .finish_non_exhaustive()
    }
}

impl<P: Plugin, F> Plugin for Edited<P, F>
where
    F: Fn(&mut Context, P::Params) -> anyhow::Result<()> + Send + Sync + 'static,
{
    type Params = P::Params;

    fn name(&self) -> &str {
        self.plugin.name()
    }

    fn description(&self) -> &str {
        self.plugin.description()
    }

    fn validate(&self, params: &Self::Params) -> Vec<Violation> {
        self.plugin.validate(params)
    }

    fn memory_floor(&self, params: &Self::Params) -> Option<(u64, String)> {
        self.plugin.memory_floor(params)
    }

    fn metrics(&self) -> Vec<MetricSpec> {
        self.plugin.metrics()
    }

    fn notebook(&self) -> Option<NotebookSource> {
        self.plugin.notebook()
    }

    fn run(&self, ctx: &mut Context, params: Self::Params) -> anyhow::Result<()> {
        (self.experiment)(ctx, params)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOURCE: NotebookSource = NotebookSource {
        package: "workbook-example",
        dir: "/nowhere",
        plugin: "workbook_example::Example",
        entry: "experiment",
        params: "Params",
        source: "//! The file's documentation.\n\
                 //! More of it.\n\
                 use std::time::Instant;\n\
                 use workbook_example::Params;\n\
                 use ::candle_checkpoint::{checkpoint, Policy};\n\
                 pub use workbook_sdk::anyhow;\n\
                 use workbook_example::Other;\n\
                 \n\
                 // notebook cell\n\
                 /// Runs it.\n\
                 pub fn experiment() {}\n\
                 // notebook cell\n\
                 \n\
                 // notebook cell\n\
                 fn helper() {}\n",
    };

    #[test]
    fn cells_drop_the_file_docs_and_cut_at_each_break() {
        assert_eq!(
            SOURCE.cells(),
            [
                "use std::time::Instant;\nuse workbook_example::Params;\n\
                 use ::candle_checkpoint::{checkpoint, Policy};\npub use workbook_sdk::anyhow;\n\
                 use workbook_example::Other;",
                "/// Runs it.\npub fn experiment() {}",
                "fn helper() {}",
            ]
        );
    }

    /// A plugin whose own experiment records `own`.
    #[derive(Debug)]
    struct Original;

    impl Plugin for Original {
        type Params = usize;
        fn name(&self) -> &str {
            "original"
        }
        fn validate(&self, p: &usize) -> Vec<Violation> {
            let mut r = crate::Rules::new();
            r.at_least("p", *p, 2);
            r.into_violations()
        }
        fn metrics(&self) -> Vec<MetricSpec> {
            vec![MetricSpec::number("value", "what ran, times the parameter")]
        }
        fn notebook(&self) -> Option<NotebookSource> {
            Some(SOURCE)
        }
        fn run(&self, ctx: &mut Context, p: usize) -> anyhow::Result<()> {
            ctx.metric("value", p as f64);
            Ok(())
        }
    }

    #[test]
    fn edited_keeps_the_plugins_name_rules_metrics_and_source() {
        // Running it is tested with the counting allocator, in
        // tests/run_cell.rs.
        let edited = Edited::new(Original, |ctx: &mut Context, p: usize| {
            ctx.metric("value", 10.0 * p as f64);
            Ok(())
        });
        assert_eq!(Plugin::name(&edited), "original");
        assert_eq!(edited.metrics(), Original.metrics());
        assert_eq!(edited.notebook(), Some(SOURCE));
        assert_eq!(edited.validate(&1).len(), 1);
        assert!(edited.validate(&2).is_empty());
    }
}
