//! The HTML report: one self-contained page with the chapter's prose, each
//! cell's printed lines, tables, memory, assertions and plots (inline PNG,
//! drawn with an embedded font), and each plot beside it as SVG and PNG.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use workbook_sdk::output::Table;

use super::plot::{cell_plots, plot_file, Formats, Plot};
use super::text::{assertion_values, bytes, format_value};
use crate::report::{CellReport, ChapterReport, Status};

/// What [`write_report`] wrote.
#[derive(Debug, Clone)]
pub struct ReportFiles {
    /// The HTML page.
    pub html: PathBuf,
    /// Every plot file, SVG and PNG.
    pub plots: Vec<PathBuf>,
}

/// Draws every cell's plots and writes them and the page to `dir`, after
/// removing what an earlier report left there.
pub fn write_report(report: &ChapterReport, dir: &Path) -> anyhow::Result<ReportFiles> {
    let mut writer = ReportWriter::create(dir)?;
    for cell in &report.cells {
        writer.add_cell(cell)?;
    }
    writer.write_page(report)
}

/// Writes a report as a run goes: each cell's plots when it finishes, and
/// the page again after each, so a run that is stopped leaves a page of
/// what it did.
#[derive(Debug)]
pub struct ReportWriter {
    dir: PathBuf,
    plots: Vec<Vec<Plot>>,
    files: Vec<PathBuf>,
}

impl ReportWriter {
    /// Prepares `dir`: creates it, checks that a file can be written there,
    /// and removes the page and the plots of an earlier report (nothing
    /// else in it is touched). Run it before the first cell, so an
    /// unwritable folder is found at once.
    pub fn create(dir: &Path) -> anyhow::Result<Self> {
        use anyhow::Context as _;
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create the report folder {}", dir.display()))?;
        // A new file of a name no one can have planted (created exclusively,
        // never through a link), removed at once.
        let probe = tempfile::Builder::new()
            .prefix(".workbook-write-check")
            .tempfile_in(dir)
            .with_context(|| format!("cannot write in the report folder {}", dir.display()))?;
        drop(probe);
        // Nothing to remove is as good as removed.
        let gone = |r: std::io::Result<()>| match r {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            other => other,
        };
        let html = dir.join("report.html");
        gone(std::fs::remove_file(&html))
            .with_context(|| format!("cannot remove the earlier report {}", html.display()))?;
        // A link named `plots` is removed, never followed.
        let plot_dir = dir.join("plots");
        let removed = match std::fs::symlink_metadata(&plot_dir) {
            Ok(m) if m.is_dir() => std::fs::remove_dir_all(&plot_dir),
            Ok(_) => std::fs::remove_file(&plot_dir),
            Err(e) => Err(e),
        };
        gone(removed).with_context(|| {
            format!("cannot remove the earlier plots in {}", plot_dir.display())
        })?;
        std::fs::create_dir(&plot_dir)
            .with_context(|| format!("cannot create {}", plot_dir.display()))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            plots: Vec::new(),
            files: Vec::new(),
        })
    }

    /// Draws a finished cell's plots and writes them, SVG and PNG, each
    /// file new (never written through a link someone left in the
    /// folder). A plot that cannot be drawn or written keeps its error,
    /// which the page shows in its place.
    pub fn add_cell(&mut self, cell: &CellReport) -> anyhow::Result<()> {
        let mut drawn = cell_plots(cell, Formats::SvgAndPng);
        let plot_dir = self.dir.join("plots");
        for p in drawn.iter_mut().filter(|p| p.drawn()) {
            for (ext, data) in [("svg", p.svg.as_bytes()), ("png", p.png.as_slice())] {
                let path = plot_dir.join(plot_file(&cell.id, &p.id, ext));
                match write_new(&path, data) {
                    Ok(()) => self.files.push(path),
                    Err(e) => {
                        p.error = Some(format!("cannot write {}: {e}", path.display()));
                    }
                }
            }
        }
        self.plots.push(drawn);
        Ok(())
    }

    /// Writes the page of `report`, whose cells are those added, in order.
    /// The page is written to a new file of a random name beside it and
    /// then renamed over it, so it is never seen half-written and never
    /// written through a link.
    pub fn write_page(&self, report: &ChapterReport) -> anyhow::Result<ReportFiles> {
        use anyhow::Context as _;
        use std::io::Write as _;
        let html = self.dir.join("report.html");
        let mut partial = tempfile::Builder::new()
            .prefix(".report.html.")
            .tempfile_in(&self.dir)
            .with_context(|| format!("cannot write a page in {}", self.dir.display()))?;
        partial
            .write_all(page(report, &self.plots).as_bytes())
            .with_context(|| format!("cannot write {}", partial.path().display()))?;
        partial
            .persist(&html)
            .map_err(|e| e.error)
            .with_context(|| format!("cannot write {}", html.display()))?;
        Ok(ReportFiles {
            html,
            plots: self.files.clone(),
        })
    }
}

/// Writes `data` to `path`, which must not exist yet (not even as a link).
fn write_new(path: &Path, data: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)?
        .write_all(data)
}

pub(crate) fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    // Infallible: writing into a String.
    let _ = pulldown_cmark_escape::escape_html(&mut out, s);
    out
}

/// Markdown as HTML that is safe to open: a chapter may come from anyone,
/// and markdown passes raw HTML through, so the result goes through
/// ammonia's allow-list (no scripts, no event handlers, no `javascript:`
/// links).
pub(crate) fn markdown(s: &str) -> String {
    let mut out = String::new();
    pulldown_cmark::html::push_html(&mut out, pulldown_cmark::Parser::new(s));
    ammonia::clean(&out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn markdown_keeps_its_formatting_and_loses_script() {
        assert_eq!(
            super::markdown("Some *emphasis* and `code`."),
            "<p>Some <em>emphasis</em> and <code>code</code>.</p>\n"
        );
        let hostile = "Hi <script>alert(1)</script> <img src=x onerror=\"alert(2)\"> \
                       [link](javascript:alert(3)) <a href=\"https://example.org\" onclick=\"x()\">ok</a>";
        let html = super::markdown(hostile);
        for gone in ["<script", "alert(1)", "onerror", "javascript:", "onclick"] {
            assert!(!html.contains(gone), "{gone} in {html}");
        }
        assert!(html.contains("href=\"https://example.org\""), "{html}");
    }
}

const STYLE: &str = r#"
body { font-family: "DejaVu Sans", "Segoe UI", Helvetica, Arial, sans-serif; max-width: 1040px; margin: 2em auto; padding: 0 1em; color: #222; line-height: 1.5; }
header { border-bottom: 2px solid #ddd; margin-bottom: 1em; }
.meta { color: #666; font-size: 0.9em; }
nav ul { list-style: none; padding: 0; display: flex; flex-wrap: wrap; gap: 0.4em 1.2em; }
section { border-top: 1px solid #e4e4e4; padding-top: 0.5em; margin-top: 2em; }
h2 .badge { font-size: 0.6em; vertical-align: middle; padding: 0.15em 0.5em; border-radius: 0.6em; color: white; margin-left: 0.5em; }
.passed { background: #2e7d32; } .failed { background: #c62828; } .error { background: #6a1b9a; } .skipped { background: #757575; }
pre.printed { background: #f6f8fa; padding: 0.6em 0.8em; border-radius: 4px; overflow-x: auto; }
table { border-collapse: collapse; margin: 0.6em 0 1.2em; font-size: 0.9em; }
caption { text-align: left; font-weight: bold; padding-bottom: 0.3em; }
th, td { border-bottom: 1px solid #e4e4e4; padding: 0.2em 0.7em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
figure { margin: 1em 0; }
figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { font-size: 0.85em; color: #555; }
ul.assertions { list-style: none; padding-left: 0; }
ul.assertions li { font-family: "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: 0.88em; margin: 0.2em 0; }
li.ok::before { content: "✓ "; color: #2e7d32; } li.bad::before { content: "✗ "; color: #c62828; } li.skip::before { content: "– "; color: #757575; }
.why { color: #c62828; font-family: sans-serif; }
.values { color: #666; }
"#;

/// The styles of a [`cell_section`] outside the report's page, scoped to an
/// element of class `workbook` so that they leave a notebook's own alone.
pub const NOTEBOOK_STYLE: &str = r#"
.workbook { font-family: "DejaVu Sans", "Segoe UI", Helvetica, Arial, sans-serif; line-height: 1.45; }
.workbook h2 { font-size: 1.2em; margin: 0.2em 0 0.6em; }
.workbook h2 .badge { font-size: 0.7em; vertical-align: middle; padding: 0.15em 0.5em; border-radius: 0.6em; color: white; margin-left: 0.5em; }
.workbook .passed { background: #2e7d32; } .workbook .failed { background: #c62828; } .workbook .error { background: #6a1b9a; } .workbook .skipped { background: #757575; }
.workbook pre.printed { background: #f6f8fa; padding: 0.5em 0.8em; border-radius: 4px; overflow-x: auto; }
.workbook table { border-collapse: collapse; margin: 0.5em 0 1em; font-size: 0.9em; }
.workbook caption { text-align: left; font-weight: bold; padding-bottom: 0.3em; }
.workbook th, .workbook td { border-bottom: 1px solid #e4e4e4; padding: 0.2em 0.7em; text-align: right; }
.workbook th:first-child, .workbook td:first-child { text-align: left; }
.workbook figure { margin: 0.8em 0; }
.workbook figure svg { max-width: 100%; height: auto; border: 1px solid #eee; }
.workbook figcaption { font-size: 0.85em; color: #555; }
.workbook ul.assertions { list-style: none; padding-left: 0; }
.workbook ul.assertions li { font-family: "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: 0.88em; margin: 0.2em 0; }
.workbook li.ok::before { content: "✓ "; color: #2e7d32; } .workbook li.bad::before { content: "✗ "; color: #c62828; } .workbook li.skip::before { content: "– "; color: #757575; }
.workbook .why { color: #c62828; font-family: sans-serif; }
.workbook .values, .workbook .meta { color: #666; }
"#;

/// Marks the page with what loaded, for people and for tests: the body's
/// `data-plots`, `data-plots-loaded`, `data-plots-non-blank` and `data-errors`.
const SCRIPT: &str = r#"
(function () {
  var errors = 0;
  window.addEventListener('error', function () { errors += 1; document.body.dataset.errors = errors; }, true);
  window.addEventListener('load', function () {
    var imgs = Array.prototype.slice.call(document.querySelectorAll('img[data-plot]'));
    var loaded = 0, nonBlank = 0;
    imgs.forEach(function (img) {
      if (!img.complete || img.naturalWidth === 0) return;
      loaded += 1;
      var c = document.createElement('canvas');
      c.width = img.naturalWidth; c.height = img.naturalHeight;
      var g = c.getContext('2d');
      g.drawImage(img, 0, 0);
      var d = g.getImageData(0, 0, c.width, c.height).data, ink = 0;
      for (var k = 0; k < d.length; k += 4) { if (d[k] < 240 || d[k + 1] < 240 || d[k + 2] < 240) ink += 1; }
      if (ink > 2000) nonBlank += 1;
    });
    document.body.dataset.plots = imgs.length;
    document.body.dataset.plotsLoaded = loaded;
    document.body.dataset.plotsNonBlank = nonBlank;
    document.body.dataset.errors = errors;
  });
})();
"#;

fn status_name(s: Status) -> &'static str {
    match s {
        Status::Passed => "passed",
        Status::Failed => "failed",
        Status::Error => "error",
        Status::Skipped => "skipped",
    }
}

fn table_html(out: &mut String, t: &Table) {
    let _ = write!(out, "<table><caption>{}</caption><tr>", escape(&t.title));
    for c in &t.columns {
        let _ = write!(out, "<th>{}</th>", escape(&c.name));
    }
    out.push_str("</tr>");
    for row in &t.rows {
        out.push_str("<tr>");
        for (v, c) in row.iter().zip(&t.columns) {
            let _ = write!(out, "<td>{}</td>", escape(&format_value(v, c.unit)));
        }
        out.push_str("</tr>");
    }
    out.push_str("</table>");
}

/// How a cell's plots go into its HTML.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Embed {
    /// The report: PNG data URLs, with links to the SVG and PNG files
    /// written beside the page.
    PngWithLinks,
    /// A notebook: inline SVG, nothing outside the fragment.
    Svg,
}

/// One cell as an HTML `<section>`: its title and status, prose (unless
/// `prose` is false: a notebook shows it in its own markdown cell), printed
/// lines, tables, plots, memory table and assertions. Styled by the report's
/// page or by [`NOTEBOOK_STYLE`].
pub fn cell_section(c: &CellReport, plots: &[Plot], embed: Embed, prose: bool) -> String {
    let mut out = String::new();
    cell_html(&mut out, c, plots, embed, prose);
    out
}

fn cell_html(out: &mut String, c: &CellReport, plots: &[Plot], embed: Embed, prose: bool) {
    let status = status_name(c.status);
    let _ = write!(
        out,
        "<section id=\"{id}\"><h2>{title}<span class=\"badge {status}\">{status}</span></h2>",
        id = escape(&c.id),
        title = escape(&c.title)
    );
    if prose {
        out.push_str(&markdown(&c.prose));
    }
    if let Some(e) = &c.error {
        let _ = write!(out, "<p class=\"why\">Error: {}</p>", escape(e));
    }
    if let Some(why) = &c.not_run {
        let _ = write!(out, "<p class=\"why\">Not run: {}</p>", escape(why));
    }
    if !c.printed.is_empty() {
        let _ = write!(
            out,
            "<pre class=\"printed\">{}</pre>",
            escape(&c.printed.join("\n"))
        );
    }
    for t in &c.tables {
        table_html(out, t);
    }
    for p in plots {
        if !p.drawn() {
            let _ = write!(
                out,
                "<figure class=\"plot-error\"><figcaption>{title}: <span class=\"why\">not \
                 drawn: {why}</span></figcaption></figure>",
                title = escape(&p.title),
                why = escape(p.error.as_deref().unwrap_or_default()),
            );
            continue;
        }
        if embed == Embed::Svg {
            let _ = write!(
                out,
                "<figure data-plot=\"{id}\">{svg}<figcaption>{title}</figcaption></figure>",
                id = escape(&p.id),
                svg = p.svg,
                title = escape(&p.title),
            );
            continue;
        }
        let data = base64::engine::general_purpose::STANDARD.encode(&p.png);
        let files = match &p.error {
            None => format!(
                " · <a href=\"plots/{svg}\">SVG</a> · <a href=\"plots/{png}\">PNG</a>",
                svg = escape(&plot_file(&c.id, &p.id, "svg")),
                png = escape(&plot_file(&c.id, &p.id, "png")),
            ),
            Some(why) => format!(" · <span class=\"why\">{}</span>", escape(why)),
        };
        let _ = write!(
            out,
            "<figure><img data-plot=\"{id}\" alt=\"{title}\" width=\"{w}\" height=\"{h}\" src=\"data:image/png;base64,{data}\">\
             <figcaption>{title}{files}</figcaption></figure>",
            id = escape(&p.id),
            title = escape(&p.title),
            w = super::plot::SIZE.0,
            h = super::plot::SIZE.1,
        );
    }
    if !c.memory.regions.is_empty() || c.memory.peak_bytes > 0 {
        let mut t = super::memory_table(c);
        t.title = "Memory: peak above each variant's start, by category at that peak".into();
        table_html(out, &t);
    }
    out.push_str("<ul class=\"assertions\">");
    for a in &c.assertions {
        let values = assertion_values(a);
        let _ = write!(
            out,
            "<li class=\"{}\">{} <span class=\"values\">{}</span>",
            if a.passed {
                "ok"
            } else if a.skipped {
                "skip"
            } else {
                "bad"
            },
            escape(&a.expr),
            escape(&if values.is_empty() {
                values
            } else {
                format!("({values})")
            })
        );
        if let (false, Some(m)) = (a.passed, &a.message) {
            if a.skipped {
                let _ = write!(
                    out,
                    "<br><span class=\"values\">skipped: {}</span></li>",
                    escape(m)
                );
                continue;
            }
            let _ = write!(out, "<br><span class=\"why\">{}</span>", escape(m));
        }
        out.push_str("</li>");
    }
    let _ = write!(
        out,
        "</ul><p class=\"meta\">{:.2} s · peak {}</p></section>",
        c.seconds,
        bytes(c.memory.peak_bytes.saturating_sub(c.memory.baseline_bytes))
    );
}

/// The page, with `plots[i]` drawn for `report.cells[i]`.
pub fn page(report: &ChapterReport, plots: &[Vec<Plot>]) -> String {
    let mut out = String::new();
    let mode = match report.mode {
        crate::report::Mode::Full => "full size",
        crate::report::Mode::Check => "check size",
    };
    let _ = write!(
        out,
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{title}</title><style>{STYLE}</style></head><body>\
         <header><h1>{title}</h1><p class=\"meta\">{mode} · device {device} · memory measured by {meter} · workbook {version} · <strong>{summary}</strong></p></header>",
        title = escape(&report.chapter.title),
        device = escape(&report.device),
        meter = escape(&report.meter),
        version = escape(&report.workbook_version),
        summary = escape(&report.summary.line()),
    );
    if report.incomplete {
        let _ = write!(
            out,
            "<p class=\"why\"><strong>This report is incomplete:</strong> {} cells ran; \
             the run was stopped, or is still going.</p>",
            report.cells_run()
        );
    }
    out.push_str(&markdown(&report.chapter.intro));
    out.push_str("<nav><ul>");
    for c in &report.cells {
        let _ = write!(
            out,
            "<li><a href=\"#{}\">{}</a> <span class=\"meta\">{}</span></li>",
            escape(&c.id),
            escape(&c.title),
            status_name(c.status)
        );
    }
    out.push_str("</ul></nav>");
    for (i, c) in report.cells.iter().enumerate() {
        let plots = plots.get(i).map(Vec::as_slice).unwrap_or(&[]);
        cell_html(&mut out, c, plots, Embed::PngWithLinks, true);
    }
    let _ = writeln!(out, "<script>{SCRIPT}</script></body></html>");
    out
}
