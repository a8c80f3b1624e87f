//! What a run shows as it goes: a spinner on a terminal, and the HTML
//! report and plots written as each cell finishes.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use workbook::chapter::Cell;
use workbook::render::html::ReportWriter as HtmlWriter;
use workbook::report::{CellReport, ChapterReport};
use workbook::terminal::printable;
use workbook::RunObserver;

/// A spinner on stderr while a cell runs; hidden when stderr is not a terminal.
pub struct Spinner {
    pub bar: ProgressBar,
    /// Cells this run runs (those `--cell` selects).
    total: usize,
    /// Cells begun so far.
    begun: usize,
}

impl Spinner {
    /// A spinner for a run of `total` cells.
    pub fn new(total: usize) -> Self {
        let bar = if std::io::stderr().is_terminal() {
            ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr())
        } else {
            ProgressBar::hidden()
        };
        bar.set_style(
            ProgressStyle::with_template("{spinner} {prefix} {msg} [{elapsed}]")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        Self {
            bar,
            total,
            begun: 0,
        }
    }
}

/// Writes the plots and the HTML report as cells finish, if asked to.
pub struct ReportWriter {
    pub html: Option<HtmlWriter>,
    /// The run so far, as the page shows it until the run ends.
    pub report: Option<ChapterReport>,
    /// The first write that failed: the run goes on, then fails with it.
    pub error: Option<anyhow::Error>,
}

impl ReportWriter {
    fn started(&mut self, report: &ChapterReport) {
        self.report = Some(report.clone());
    }

    fn cell_finished(&mut self, cell: &CellReport) {
        let (Some(html), Some(report)) = (&mut self.html, &mut self.report) else {
            return;
        };
        if self.error.is_some() {
            return;
        }
        report.cells.push(cell.clone());
        report.summary = ChapterReport::summarize(&report.cells);
        // Until the run ends, the page says it is not complete.
        report.incomplete = true;
        if let Err(e) = html.add_cell(cell).and_then(|_| html.write_page(report)) {
            self.error = Some(e);
        }
    }

    fn finished(&mut self, report: &ChapterReport) {
        let Some(html) = &self.html else {
            return;
        };
        if self.error.is_some() {
            return;
        }
        match html.write_page(report) {
            Ok(files) => eprintln!(
                "wrote {} and {} plot files in {}",
                files.html.display(),
                files.plots.len(),
                files.html.with_file_name("plots").display()
            ),
            Err(e) => self.error = Some(e),
        }
    }
}

/// The spinner and the report writer around another observer.
pub struct WithSpinner<'a, O> {
    pub spinner: Spinner,
    pub first: &'a mut ReportWriter,
    pub inner: O,
}

impl<O: RunObserver> RunObserver for WithSpinner<'_, O> {
    fn started(&mut self, report: &ChapterReport) {
        self.first.started(report);
        self.inner.started(report);
    }

    fn cell_started(&mut self, index: usize, cell: &Cell) {
        // Counted over the cells this run selected, not the chapter's.
        self.spinner.begun += 1;
        self.spinner.bar.set_prefix(format!(
            "[{}/{}] {}",
            self.spinner.begun,
            self.spinner.total,
            printable(&cell.id)
        ));
        self.spinner.bar.set_message("");
        self.spinner
            .bar
            .enable_steady_tick(Duration::from_millis(120));
        self.inner.cell_started(index, cell);
    }

    fn cell_finished(&mut self, report: &CellReport) {
        self.spinner.bar.disable_steady_tick();
        self.first.cell_finished(report);
        let inner = &mut self.inner;
        self.spinner.bar.suspend(|| inner.cell_finished(report));
    }

    fn finished(&mut self, report: &ChapterReport) {
        self.spinner.bar.finish_and_clear();
        self.first.finished(report);
        self.inner.finished(report);
    }
}
