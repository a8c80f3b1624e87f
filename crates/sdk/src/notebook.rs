//! Plugins whose experiment a notebook shows and runs.
//!
//! A plugin keeps its experiment, the code a learner reads and changes, in
//! one module of its crate, `src/experiment.rs` (a long one in parts that
//! it `include!`s, see [`NotebookSource::parts`]), with a function such
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
//!
//! An exercise is a part of such a file that the learner writes: a
//! [`EXERCISE_BREAK`] line starts its cell, and its reference solution lies
//! between [`SOLUTION_BEGIN`] and [`SOLUTION_END`] lines. The plugin
//! compiles the solution (so `workbook run` checks that it passes); the
//! notebook shows [`TODO`] in its place ([`NotebookSource::cells`]).

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
    /// shown; a line `// notebook cell` starts a new notebook code cell, a
    /// line `// notebook cell: exercise` one the learner completes (see
    /// [`EXERCISE_BREAK`]).
    pub source: &'static str,
    /// Further files of the experiment, by the path its `include!` lines
    /// name (`("experiment/policies.rs", include_str!(...))`): a line
    /// `include!("experiment/policies.rs");` of [`NotebookSource::source`]
    /// includes that file's items in the crate, and the notebook shows
    /// them there, in its place. An experiment too long for one file stays
    /// one module, in the crate and in the notebook alike.
    pub parts: &'static [(&'static str, &'static str)],
}

/// The [`NotebookSource`] of the calling crate's plugin: its package and
/// folder from Cargo, and the experiment's file read at compile time
/// (`source` is relative to the file that invokes the macro, as
/// `include_str!`'s path is), with the files its `include!` lines name
/// (`parts`, relative to the same folder: keep the experiment's file and
/// the macro's call in one folder, so that both paths read the same).
///
/// ```ignore
/// fn notebook(&self) -> Option<NotebookSource> {
///     Some(workbook_sdk::notebook_source! {
///         plugin: "workbook_checkpointing::Checkpointing",
///         entry: "checkpointing_experiment",
///         params: "CheckpointingParams",
///         source: "experiment.rs",
///         parts: ["experiment/policies.rs"],
///     })
/// }
/// ```
#[macro_export]
macro_rules! notebook_source {
    (
        plugin: $plugin:literal,
        entry: $entry:literal,
        params: $params:literal,
        source: $source:literal
        $(, parts: [$($part:literal),* $(,)?])? $(,)?
    ) => {
        $crate::notebook::NotebookSource {
            package: env!("CARGO_PKG_NAME"),
            dir: env!("CARGO_MANIFEST_DIR"),
            plugin: $plugin,
            entry: $entry,
            params: $params,
            source: include_str!($source),
            parts: &[$($(($part, include_str!($part))),*)?],
        }
    };
}

/// The line that starts a new notebook code cell in an experiment's source.
pub const CELL_BREAK: &str = "// notebook cell";

/// The line that starts a new notebook code cell that is an exercise: the
/// learner completes it. Inside it, each part between a [`SOLUTION_BEGIN`]
/// and a [`SOLUTION_END`] line is the reference solution, which the plugin
/// compiles and `workbook run` executes, and which the notebook shows as
/// [`TODO`] for the learner to replace. Code after a solution must not use
/// what the solution defines: in the notebook it is not there.
pub const EXERCISE_BREAK: &str = "// notebook cell: exercise";

/// The line before a reference solution in an exercise cell.
pub const SOLUTION_BEGIN: &str = "// solution begin";

/// The line after a reference solution in an exercise cell.
pub const SOLUTION_END: &str = "// solution end";

/// What a notebook shows in place of a reference solution. Running it
/// panics with "not yet implemented: ..." (`todo!`), which a cell that
/// runs the experiment reports as its error.
pub const TODO: &str = "todo!(\"exercise: replace this line with your code\")";

/// One notebook code cell of an experiment's source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceCell {
    /// The code the notebook shows: the cell's text, each reference
    /// solution of an exercise replaced by [`TODO`].
    pub code: String,
    /// For an exercise cell, its text with the reference solutions (the
    /// marker lines left out): what `workbook run` executes.
    pub solution: Option<String>,
}

/// An experiment source whose exercise markers do not pair up, or that
/// includes a file that is not among its parts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{package}'s experiment, {}line {line}: {why}", file.as_ref().map(|f| format!("{f} ")).unwrap_or_default())]
pub struct SourceError {
    /// The plugin's package.
    pub package: String,
    /// The part the line is in, by the path its `include!` line names
    /// (`experiment/policies.rs`); `None` for the experiment's own file.
    pub file: Option<String>,
    /// The line (from 1) of that file.
    pub line: usize,
    /// What is wrong there.
    pub why: String,
}

/// The path a line `include!("PATH");` of an experiment names, if the line
/// is one: where [`NotebookSource::text`] puts that part.
pub fn included_part(line: &str) -> Option<&str> {
    line.trim()
        .strip_prefix("include!(\"")
        .and_then(|rest| rest.strip_suffix("\");"))
}

impl NotebookSource {
    /// The experiment's whole text: [`NotebookSource::source`] with each
    /// `include!("PATH");` line replaced by the text of the part at PATH.
    /// Errors where a line includes a file that is not among the parts.
    pub fn text(&self) -> Result<String, SourceError> {
        let mut text = String::with_capacity(
            self.source.len() + self.parts.iter().map(|(_, t)| t.len()).sum::<usize>(),
        );
        for (i, line) in self.source.lines().enumerate() {
            match included_part(line) {
                None => text.push_str(line),
                Some(path) => match self.parts.iter().find(|(p, _)| *p == path) {
                    Some((_, part)) => text.push_str(part.trim_end()),
                    None => {
                        return Err(SourceError {
                            package: self.package.to_string(),
                            file: None,
                            line: i + 1,
                            why: format!(
                                "`include!(\"{path}\")` names a file that is not among the \
                                 experiment's parts: add it to `parts` in the plugin's \
                                 `notebook_source!`"
                            ),
                        })
                    }
                },
            }
            text.push('\n');
        }
        Ok(text)
    }

    /// Where line `line` (from 1) of [`NotebookSource::text`] was written:
    /// the part it comes from (by the path its `include!` line names, `None`
    /// for the experiment's own file) and its line there.
    pub fn place(&self, line: usize) -> (Option<&'static str>, usize) {
        let mut at = 0;
        for (i, own) in self.source.lines().enumerate() {
            let part =
                included_part(own).and_then(|path| self.parts.iter().find(|(p, _)| *p == path));
            // A part takes the lines of its trimmed text, or one if empty.
            let taken = part.map_or(1, |(_, t)| t.trim_end().lines().count().max(1));
            if line <= at + taken {
                return match part {
                    Some((path, _)) => (Some(path), line - at),
                    None => (None, i + 1),
                };
            }
            at += taken;
        }
        (None, line - at + self.source.lines().count())
    }

    /// A [`SourceError`] at line `line` of [`NotebookSource::text`], placed
    /// in the file that line was written in.
    pub fn error_at(&self, line: usize, why: &str) -> SourceError {
        let (file, line) = self.place(line);
        SourceError {
            package: self.package.to_string(),
            file: file.map(str::to_string),
            line,
            why: why.to_string(),
        }
    }

    /// The source as notebook code cells: the file's documentation (the
    /// `//!` lines it starts with) dropped, cut at each [`CELL_BREAK`] and
    /// [`EXERCISE_BREAK`] line, each part trimmed; empty parts are left out.
    ///
    /// Errors where a line starting `// notebook cell` is neither break,
    /// where a [`SOLUTION_BEGIN`] is outside an exercise cell, inside
    /// another solution, or without its [`SOLUTION_END`] in the same cell,
    /// where a solution is empty, or where an exercise cell holds no
    /// solution.
    pub fn cells(&self) -> Result<Vec<SourceCell>, SourceError> {
        struct Draft {
            code: String,
            solution: Option<String>,
            start: usize,
            solved: bool,
        }
        let error = |line: usize, why: &str| self.error_at(line, why);
        let mut drafts = vec![Draft {
            code: String::new(),
            solution: None,
            start: 1,
            solved: false,
        }];
        // The line a solution being read began on, and whether it holds
        // more than blank lines yet.
        let mut open: Option<(usize, bool)> = None;
        let mut in_docs = true;
        let text = self.text()?;
        for (i, line) in text.lines().enumerate() {
            let number = i + 1;
            in_docs &= line.starts_with("//!");
            if in_docs {
                continue;
            }
            let marker = line.trim();
            if marker == CELL_BREAK || marker == EXERCISE_BREAK {
                if let Some((begun, _)) = open {
                    return Err(error(begun, "a solution ends at no `// solution end` line"));
                }
                drafts.push(Draft {
                    code: String::new(),
                    solution: (marker == EXERCISE_BREAK).then(String::new),
                    start: number,
                    solved: false,
                });
                continue;
            }
            if marker.starts_with(CELL_BREAK) {
                return Err(error(
                    number,
                    "a line that starts like a cell break but is none: write \
                     `// notebook cell` or `// notebook cell: exercise`",
                ));
            }
            let draft = drafts.last_mut().expect("there is always a cell");
            if marker == SOLUTION_BEGIN {
                if draft.solution.is_none() {
                    return Err(error(
                        number,
                        "a solution outside an exercise cell (one begun by a \
                         `// notebook cell: exercise` line)",
                    ));
                }
                if open.is_some() {
                    return Err(error(number, "a solution inside another"));
                }
                open = Some((number, false));
                let indent = &line[..line.len() - line.trim_start().len()];
                draft.code.push_str(indent);
                draft.code.push_str(TODO);
                draft.code.push('\n');
                continue;
            }
            if marker == SOLUTION_END {
                match open.take() {
                    None => {
                        return Err(error(
                            number,
                            "`// solution end` without its `// solution begin`",
                        ))
                    }
                    Some((begun, false)) => {
                        return Err(error(begun, "an empty solution: write the reference one"))
                    }
                    Some((_, true)) => draft.solved = true,
                }
                continue;
            }
            match &mut open {
                None => {
                    draft.code.push_str(line);
                    draft.code.push('\n');
                }
                Some((_, content)) => *content |= !marker.is_empty(),
            }
            if let Some(solution) = &mut draft.solution {
                solution.push_str(line);
                solution.push('\n');
            }
        }
        if let Some((begun, _)) = open {
            return Err(error(begun, "a solution ends at no `// solution end` line"));
        }
        let mut cells = Vec::new();
        for draft in drafts {
            let code = draft.code.trim().to_string();
            let solution = draft.solution.map(|s| s.trim().to_string());
            if solution.is_some() && !draft.solved {
                return Err(error(
                    draft.start,
                    "an exercise cell without a solution (`// solution begin` ... \
                     `// solution end`) for the learner to write",
                ));
            }
            if code.is_empty() {
                continue;
            }
            cells.push(SourceCell { code, solution });
        }
        Ok(cells)
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
        parts: &[],
    };

    #[test]
    fn cells_drop_the_file_docs_and_cut_at_each_break() {
        let cells = SOURCE.cells().unwrap();
        let code: Vec<&str> = cells.iter().map(|c| c.code.as_str()).collect();
        assert_eq!(
            code,
            [
                "use std::time::Instant;\nuse workbook_example::Params;\n\
                 use ::candle_checkpoint::{checkpoint, Policy};\npub use workbook_sdk::anyhow;\n\
                 use workbook_example::Other;",
                "/// Runs it.\npub fn experiment() {}",
                "fn helper() {}",
            ]
        );
        assert!(cells.iter().all(|c| c.solution.is_none()));
    }

    #[test]
    fn a_part_is_shown_where_its_include_line_is() {
        let source = NotebookSource {
            source: "//! Docs.\nuse a::B;\n// notebook cell\nfn one() {}\n\
                     include!(\"experiment/two.rs\");\n// notebook cell\nfn three() {}\n",
            parts: &[("experiment/two.rs", "// notebook cell\nfn two() {}\n")],
            ..SOURCE
        };
        let cells = source.cells().unwrap();
        let code: Vec<&str> = cells.iter().map(|c| c.code.as_str()).collect();
        assert_eq!(
            code,
            ["use a::B;", "fn one() {}", "fn two() {}", "fn three() {}"]
        );

        let missing = NotebookSource {
            parts: &[],
            ..source
        };
        assert_eq!(
            missing.cells().unwrap_err().to_string(),
            "workbook-example's experiment, line 5: `include!(\"experiment/two.rs\")` names a \
             file that is not among the experiment's parts: add it to `parts` in the plugin's \
             `notebook_source!`"
        );

        // Lines are placed in the file they were written in.
        assert_eq!(source.place(4), (None, 4));
        assert_eq!(source.place(5), (Some("experiment/two.rs"), 1));
        assert_eq!(source.place(6), (Some("experiment/two.rs"), 2));
        assert_eq!(source.place(7), (None, 6));
        assert_eq!(source.place(8), (None, 7));
        let broken = NotebookSource {
            parts: &[(
                "experiment/two.rs",
                "// notebook cell\nfn two() {}\n// solution end\n",
            )],
            ..source
        };
        assert_eq!(
            broken.cells().unwrap_err().to_string(),
            "workbook-example's experiment, experiment/two.rs line 3: `// solution end` without \
             its `// solution begin`"
        );
        let err = broken.cells().unwrap_err();
        assert_eq!(
            (err.file.as_deref(), err.line),
            (Some("experiment/two.rs"), 3)
        );
    }

    fn with_text(source: &'static str) -> NotebookSource {
        NotebookSource { source, ..SOURCE }
    }

    #[test]
    fn an_exercise_shows_todo_where_its_solution_is() {
        let source = with_text(
            "use std::fmt;\n\
             // notebook cell: exercise\n\
             /// Exercise: add them.\n\
             pub fn add(a: u32, b: u32) -> u32 {\n    \
                 // solution begin\n    \
                 a + b\n    \
                 // solution end\n\
             }\n\
             // notebook cell\n\
             pub fn run() {}\n",
        );
        let cells = source.cells().unwrap();
        assert_eq!(cells.len(), 3);
        assert_eq!(
            cells[1].code,
            format!(
                "/// Exercise: add them.\npub fn add(a: u32, b: u32) -> u32 {{\n    {TODO}\n}}"
            )
        );
        assert_eq!(
            cells[1].solution.as_deref(),
            Some("/// Exercise: add them.\npub fn add(a: u32, b: u32) -> u32 {\n    a + b\n}")
        );
        assert_eq!(cells[0].solution, None);
        assert_eq!(cells[2].solution, None);
    }

    #[test]
    fn exercise_markers_that_do_not_pair_up_are_refused() {
        let cases: [(&'static str, usize, &str); 5] = [
            (
                "fn f() {\n// solution begin\n}\n// solution end\n",
                2,
                "a solution outside an exercise cell",
            ),
            (
                "// notebook cell: exercise\nfn f() {\n// solution begin\n1\n}\n",
                3,
                "a solution ends at no `// solution end` line",
            ),
            (
                "// notebook cell: exercise\n// solution begin\n// notebook cell\n// solution end\n",
                2,
                "a solution ends at no `// solution end` line",
            ),
            (
                "// notebook cell: exercise\n// solution begin\n// solution begin\n",
                3,
                "a solution inside another",
            ),
            (
                "// notebook cell: exercise\nfn f() {}\n",
                1,
                "an exercise cell without a solution",
            ),
        ];
        for (text, line, why) in cases {
            let err = with_text(text).cells().unwrap_err();
            assert_eq!(err.line, line, "{text:?}: {err}");
            assert!(err.why.starts_with(why), "{text:?}: {err}");
            assert!(
                err.to_string()
                    .starts_with(&format!("workbook-example's experiment, line {line}: ")),
                "{err}"
            );
        }
        let near_miss = with_text("fn f() {}\n// notebook cell: Exercise\nfn g() {}\n");
        let err = near_miss.cells().unwrap_err();
        assert_eq!(err.line, 2);
        assert!(
            err.why.starts_with("a line that starts like a cell break"),
            "{err}"
        );
        let empty = with_text("fn f() {}\n// notebook cell: exercise\n");
        assert!(empty
            .cells()
            .unwrap_err()
            .why
            .starts_with("an exercise cell without"));
        let blank = with_text(
            "// notebook cell: exercise\nfn f() {\n// solution begin\n\n// solution end\n}\n",
        );
        let err = blank.cells().unwrap_err();
        assert_eq!(
            (err.line, err.why.as_str()),
            (3, "an empty solution: write the reference one")
        );
        let stray_end = with_text("// notebook cell: exercise\n// solution end\n");
        assert_eq!(
            stray_end.cells().unwrap_err().why,
            "`// solution end` without its `// solution begin`"
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
