//! Plots and the HTML report: drawn from the report alone, deterministic,
//! and loaded without errors by a real browser.

use std::path::{Path, PathBuf};
use std::process::Command;

use workbook::render::plot::{cell_plots, Formats};
use workbook::ChapterReport;

fn workbook(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_workbook"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("WORKBOOK_CHECK_MODE")
        .output()
        .expect("the binary runs")
}

/// One run of chapter 2 at check size, shared by the tests: its JSON
/// report, the folder it wrote plots and the page into, and its stderr.
struct Run {
    report: ChapterReport,
    out: PathBuf,
    stderr: String,
    _dir: tempfile::TempDir,
}

fn chapter2() -> &'static Run {
    static RUN: std::sync::OnceLock<Run> = std::sync::OnceLock::new();
    RUN.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("report");
        let o = workbook(&[
            "run",
            "chapter2",
            "--check",
            "--format",
            "json",
            "--out",
            out.to_str().unwrap(),
        ]);
        let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
        if !o.status.success() {
            let failed: Vec<String> = serde_json::from_slice::<ChapterReport>(&o.stdout)
                .map(|r| {
                    r.cells
                        .iter()
                        .flat_map(|c| {
                            c.assertions
                                .iter()
                                .filter(|a| !a.passed)
                                .map(move |a| format!("{}: {a:?}", c.id))
                        })
                        .collect()
                })
                .unwrap_or_default();
            panic!("chapter 2 failed: {failed:#?}\n{stderr}");
        }
        Run {
            report: serde_json::from_slice(&o.stdout).expect("stdout is the JSON report"),
            out,
            stderr,
            _dir: dir,
        }
    })
}

/// Pixels of a PNG that are not near-white.
fn ink(png_bytes: &[u8]) -> usize {
    let decoder = png::Decoder::new(std::io::Cursor::new(png_bytes));
    let mut reader = decoder.read_info().expect("a PNG");
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).expect("a frame");
    let channels = info.color_type.samples();
    buf[..info.buffer_size()]
        .chunks(channels)
        .filter(|px| px.iter().take(3).any(|&v| v < 240))
        .count()
}

#[test]
fn every_cell_is_plotted_deterministically_and_no_plot_is_blank() {
    let report = &chapter2().report;
    let mut count = 0;
    for cell in &report.cells {
        let first = cell_plots(cell, Formats::SvgAndPng);
        let second = cell_plots(cell, Formats::SvgAndPng);
        assert_eq!(
            first, second,
            "{}: the same data draws the same bytes",
            cell.id
        );
        let ids: Vec<&str> = first.iter().map(|p| p.id.as_str()).collect();
        assert!(
            ids.contains(&"timeline") && ids.contains(&"peaks"),
            "{}: {ids:?}",
            cell.id
        );
        for f in &cell.figures {
            assert!(ids.contains(&f.id.as_str()), "{}: figure {}", cell.id, f.id);
        }
        for p in &first {
            assert!(
                p.svg.starts_with("<svg") && p.svg.contains(&p.title.replace('&', "&amp;")[..10]),
                "{}",
                p.id
            );
            let pixels = ink(&p.png);
            assert!(
                pixels > 5_000,
                "{}-{} is nearly blank: {pixels} inked pixels",
                cell.id,
                p.id
            );
        }
        count += first.len();
    }
    // Six cells, each a timeline and peaks, plus the sweeps' figures.
    assert!(count >= 6 * 2 + 6, "{count} plots");
}

fn chromium() -> Option<PathBuf> {
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .find_map(|name| {
            let out = Command::new("which").arg(name).output().ok()?;
            out.status
                .success()
                .then(|| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
        })
}

fn attribute(dom: &str, name: &str) -> Option<usize> {
    let start = dom.find(&format!("{name}=\""))? + name.len() + 2;
    let end = start + dom[start..].find('"')?;
    dom[start..end].parse().ok()
}

#[test]
fn the_report_loads_in_headless_chromium_with_every_plot() {
    let Some(browser) = chromium() else {
        assert!(
            std::env::var("WORKBOOK_REQUIRE_CHROMIUM").is_err(),
            "WORKBOOK_REQUIRE_CHROMIUM is set but no chromium was found"
        );
        eprintln!(
            "skipped: no chromium on this machine (apt-get install chromium; CI installs it)"
        );
        return;
    };
    let run = chapter2();
    let (out, stderr) = (&run.out, &run.stderr);
    assert!(
        stderr.contains("report.html"),
        "the terminal says where the report went: {stderr}"
    );
    let page = out.join("report.html");
    let plots = std::fs::read_dir(out.join("plots")).unwrap().count();
    assert!(plots >= 36, "SVG and PNG of every plot: {plots}");

    let profile = tempfile::tempdir().unwrap();
    let dom = Command::new(&browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--virtual-time-budget=10000",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg("--dump-dom")
        .arg(format!("file://{}", absolute(&page).display()))
        .output()
        .expect("chromium runs");
    let dom = String::from_utf8_lossy(&dom.stdout);
    let total = attribute(&dom, "data-plots").unwrap_or_else(|| {
        panic!(
            "the page's script did not run: {}",
            &dom[..dom.len().min(500)]
        )
    });
    assert_eq!(total, plots / 2, "one image per plot");
    assert_eq!(
        attribute(&dom, "data-plots-loaded"),
        Some(total),
        "every plot decoded"
    );
    assert_eq!(
        attribute(&dom, "data-plots-non-blank"),
        Some(total),
        "no plot is blank"
    );
    assert_eq!(
        attribute(&dom, "data-errors"),
        Some(0),
        "no errors on the page"
    );
    assert!(
        dom.contains("2. Memory Optimization") && dom.contains("2.6 Memory-efficient attention")
    );
}

fn absolute(p: &Path) -> PathBuf {
    std::fs::canonicalize(p).unwrap()
}
