//! Plots of a cell's outcome, drawn with plotters from the report alone:
//!
//! * `timeline`: memory at each mark, stacked by category, one panel per
//!   variant (region), with the peak so far as a line;
//! * `peaks`: each variant's peak above its start, stacked by category, with
//!   the analytic figure marked where the variant has one;
//! * one plot per figure the plugin declared (sweeps), with its markers and
//!   reference slopes.
//!
//! Each plot is drawn twice from the same data: as SVG (text kept as text)
//! and as PNG, whose text is drawn with DejaVu Sans embedded in the binary,
//! so a machine with no fonts draws the same pixels. Drawing is
//! deterministic: the same report gives the same bytes.

use std::error::Error;
use std::sync::Once;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::FontStyle;
use workbook_sdk::meter::Category;
use workbook_sdk::output::{Figure, RegionReport, Unit};

use crate::report::CellReport;

mod figure;
mod peaks;
mod timeline;

use figure::FigurePlot;
use peaks::Peaks;
use timeline::Timeline;

/// A drawn plot.
#[derive(Debug, Clone, PartialEq)]
pub struct Plot {
    /// A file-name-safe id, unique within its cell (`timeline`, `peaks`, a figure's id).
    pub id: String,
    /// The title.
    pub title: String,
    /// The SVG document.
    pub svg: String,
    /// The PNG file; empty when only SVG was asked for.
    pub png: Vec<u8>,
    /// What went wrong: the plot could not be drawn (then `svg` and `png`
    /// are empty), or its files could not be written. A plot's failure is
    /// its own, shown where it would be; the report goes on without it.
    pub error: Option<String>,
}

impl Plot {
    /// Whether there is a picture to show.
    pub fn drawn(&self) -> bool {
        !self.svg.is_empty() || !self.png.is_empty()
    }
}

/// The longest plot id in a file name.
const MAX_FILE_ID: usize = 64;

/// `id` as a file name's part: letters, digits, `-` and `_` kept, anything
/// else (`/`, `..`, spaces, control characters) as `_`, cut to
/// [`MAX_FILE_ID`] characters, and made unique among `taken` with a
/// numbered suffix.
pub fn file_id(id: &str, taken: &[String]) -> String {
    let mut base: String = id
        .chars()
        .take(MAX_FILE_ID)
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if base.is_empty() {
        base.push_str("figure");
    }
    let mut name = base.clone();
    let mut n = 2;
    while taken.contains(&name) {
        name = format!("{base}-{n}");
        n += 1;
    }
    name
}

/// The file name of the plot `plot` (its id) of the cell `cell`, of
/// extension `ext`, in a report's `plots` folder: what the report writes
/// and what its page links to.
pub fn plot_file(cell: &str, plot: &str, ext: &str) -> String {
    format!("{}-{}.{ext}", file_id(cell, &[]), file_id(plot, &[]))
}

/// Plot size in pixels.
pub const SIZE: (u32, u32) = (960, 540);
/// The most variants one timeline shows.
const MAX_PANELS: usize = 6;

const FONT: &str = "sans-serif";

type DrawResult = Result<(), Box<dyn Error>>;

fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // DejaVu Sans is valid OpenType: registering it cannot fail.
        let _ = plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular());
        let _ = plotters::style::register_font(FONT, FontStyle::Bold, dejavu::sans::bold());
    });
}

/// Colours of the categories (Okabe-Ito, readable by colour-blind readers).
fn category_colour(c: Category) -> RGBColor {
    match c {
        Category::Parameters => RGBColor(0, 114, 178),
        Category::Gradients => RGBColor(213, 94, 0),
        Category::OptimizerState => RGBColor(0, 158, 115),
        Category::Activations => RGBColor(230, 159, 0),
        Category::Inputs => RGBColor(86, 180, 233),
        Category::Communication => RGBColor(140, 86, 75),
        Category::Other => RGBColor(160, 160, 160),
    }
}

/// Colours of series, in order (Okabe and Ito's palette, safe for colour
/// blindness; yellow last, as it is the faintest on white).
const SERIES: [RGBColor; 8] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
    RGBColor(0, 0, 0),
    RGBColor(240, 228, 66),
];

/// The divisor and unit label for values of `unit` whose largest is `max`.
fn scale(unit: Unit, max: f64) -> (f64, &'static str) {
    match unit {
        Unit::Bytes if max >= 4.0 * 1024f64.powi(3) => (1024f64.powi(3), "GiB"),
        Unit::Bytes if max >= 4.0 * 1024f64.powi(2) => (1024f64.powi(2), "MiB"),
        Unit::Bytes => (1024.0, "KiB"),
        Unit::Seconds if max < 1.0 => (1e-3, "ms"),
        Unit::Seconds => (1.0, "s"),
        _ => (1.0, ""),
    }
}

/// An axis tick: integers without decimals, large numbers with K/M/G.
fn tick(v: &f64) -> String {
    let v = *v;
    let a = v.abs();
    if a >= 1e15 {
        return format!("{v:.1e}");
    }
    let (x, suffix) = if a >= 1e9 {
        (v / 1e9, "G")
    } else if a >= 1e6 {
        (v / 1e6, "M")
    } else if a >= 1e4 {
        (v / 1e3, "K")
    } else {
        (v, "")
    };
    let s = if (x - x.round()).abs() < 1e-9 {
        format!("{}", x.round() as i64)
    } else if x.abs() >= 100.0 {
        format!("{x:.0}")
    } else if x.abs() >= 10.0 {
        format!("{x:.1}")
    } else if x.abs() >= 0.01 || x == 0.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.1e}")
    };
    let s = if s.contains('.') && !s.contains('e') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    };
    format!("{s}{suffix}")
}

/// The corner of the plot with the fewest points, for the legend. `points`
/// are in axis units, `(x0, x1, y0, y1)` the axis ranges.
fn emptiest_corner(
    points: &[(f64, f64)],
    x: (f64, f64, bool),
    y: (f64, f64, bool),
) -> SeriesLabelPosition {
    let norm = |v: f64, (lo, hi, log): (f64, f64, bool)| {
        if log {
            (v.ln() - lo.ln()) / (hi.ln() - lo.ln())
        } else {
            (v - lo) / (hi - lo)
        }
    };
    let mut counts = [0usize; 4];
    for &(px, py) in points {
        let (nx, ny) = (norm(px, x), norm(py, y));
        // Only the corners where a legend box would sit.
        let left = nx < 0.45;
        let right = nx > 0.55;
        let top = ny > 0.6;
        let bottom = ny < 0.4;
        if top && left {
            counts[0] += 1;
        }
        if top && right {
            counts[1] += 1;
        }
        if bottom && left {
            counts[2] += 1;
        }
        if bottom && right {
            counts[3] += 1;
        }
    }
    let order = [
        SeriesLabelPosition::UpperLeft,
        SeriesLabelPosition::UpperRight,
        SeriesLabelPosition::LowerLeft,
        SeriesLabelPosition::LowerRight,
    ];
    let best = (0..4).min_by_key(|&i| counts[i]).unwrap_or(0);
    order
        .into_iter()
        .nth(best)
        .unwrap_or(SeriesLabelPosition::UpperLeft)
}

fn with_unit(text: &str, unit: &str) -> String {
    if unit.is_empty() {
        text.to_string()
    } else {
        format!("{text} ({unit})")
    }
}

/// Something that draws itself on any plotters backend.
trait Draw {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static;
}

/// Which files [`cell_plots`] draws.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Formats {
    /// SVG and PNG (the report and its plot files).
    SvgAndPng,
    /// SVG only (a notebook inlines it).
    Svg,
}

fn render(id: &str, title: &str, d: &impl Draw, formats: Formats) -> anyhow::Result<Plot> {
    register_font();
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        d.draw(&root)
            .map_err(|e| anyhow::anyhow!("drawing {id}: {e}"))?;
        root.present()
            .map_err(|e| anyhow::anyhow!("drawing {id}: {e}"))?;
    }
    if formats == Formats::Svg {
        return Ok(Plot {
            id: id.to_string(),
            title: title.to_string(),
            svg,
            png: Vec::new(),
            error: None,
        });
    }
    let (w, h) = SIZE;
    let mut rgb = vec![0u8; (w * h * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, SIZE).into_drawing_area();
        d.draw(&root)
            .map_err(|e| anyhow::anyhow!("drawing {id}: {e}"))?;
        root.present()
            .map_err(|e| anyhow::anyhow!("drawing {id}: {e}"))?;
    }
    let mut png = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut png, w, h);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        enc.set_compression(png::Compression::Best);
        enc.set_adaptive_filter(png::AdaptiveFilterType::Adaptive);
        let mut writer = enc.write_header()?;
        writer.write_image_data(&rgb)?;
    }
    Ok(Plot {
        id: id.to_string(),
        title: title.to_string(),
        svg,
        png,
        error: None,
    })
}

/// [`render`], a failure kept as the plot's error.
fn render_or_say(id: &str, title: &str, d: &impl Draw, formats: Formats) -> Plot {
    render(id, title, d, formats).unwrap_or_else(|e| Plot {
        id: id.to_string(),
        title: title.to_string(),
        svg: String::new(),
        png: Vec::new(),
        error: Some(format!("{e:#}")),
    })
}

/// One figure, drawn.
pub fn figure_plot(f: &Figure, formats: Formats) -> anyhow::Result<Plot> {
    render(&f.id, &f.title, &FigurePlot(f), formats)
}

/// The plots of one cell: its timeline and peaks when it measured regions,
/// and one per figure it declared, each with a file-name-safe id unique in
/// the cell. A plot that cannot be drawn carries its error instead.
pub fn cell_plots(cell: &CellReport, formats: Formats) -> Vec<Plot> {
    let mut plots = Vec::new();
    let regions = &cell.memory.regions;
    if !regions.is_empty() {
        let title = format!("{}: memory over time", cell.title);
        plots.push(render_or_say(
            "timeline",
            &title,
            &Timeline {
                title: &title,
                regions,
            },
            formats,
        ));
        let title = format!("{}: peak memory per variant", cell.title);
        plots.push(render_or_say(
            "peaks",
            &title,
            &Peaks {
                title: &title,
                regions,
            },
            formats,
        ));
    }
    for f in &cell.figures {
        let taken: Vec<String> = plots.iter().map(|p| p.id.clone()).collect();
        let id = file_id(&f.id, &taken);
        plots.push(render_or_say(&id, &f.title, &FigurePlot(f), formats));
    }
    plots
}

fn title_font(size: u32) -> TextStyle<'static> {
    (FONT, size).into_font().style(FontStyle::Bold).into()
}

fn text_font(size: u32) -> TextStyle<'static> {
    (FONT, size).into_font().into()
}

/// The categories that take a visible share (0.5% of the largest value) of
/// any of `regions` above its start, in display order: a category of a few
/// bytes would only crowd the legend.
fn used_categories(regions: &[&RegionReport]) -> Vec<Category> {
    let above = |r: &RegionReport, c: Category| {
        let marks = r.marks.iter().map(|m| m.current.get(c)).max().unwrap_or(0);
        marks
            .max(r.peak_by_category.get(c))
            .saturating_sub(r.baseline.get(c))
    };
    let largest = regions
        .iter()
        .map(|r| r.peak_above_baseline())
        .max()
        .unwrap_or(0);
    let threshold = largest / 200;
    Category::ALL
        .into_iter()
        .filter(|&c| regions.iter().any(|r| above(r, c) > threshold))
        .collect()
}

fn legend_row<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    categories: &[Category],
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    let mut x = 10;
    for &c in categories {
        area.draw(&Rectangle::new(
            [(x, 6), (x + 14, 20)],
            category_colour(c).filled(),
        ))?;
        area.draw(&Text::new(
            c.name().replace('_', " "),
            (x + 20, 6),
            text_font(14),
        ))?;
        x += 24 + 9 * c.name().len() as i32;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::figure::bounds;
    use super::*;
    use workbook_sdk::output::{Axis, Series};

    fn figure(points: Vec<(f64, f64)>, log: (bool, bool)) -> Figure {
        let axis = |label: &str, log: bool| Axis {
            label: label.into(),
            log,
            ..Axis::default()
        };
        Figure {
            id: "f".into(),
            title: "extremes".into(),
            x: axis("x", log.0),
            y: axis("y", log.1),
            series: vec![Series {
                name: "s".into(),
                points,
            }],
            markers: Vec::new(),
            guides: Vec::new(),
        }
    }

    #[test]
    fn bounds_stay_finite_for_every_extreme_float() {
        let extremes = [
            f64::MAX,
            -f64::MAX,
            f64::MIN_POSITIVE,
            5e-324,
            0.0,
            -0.0,
            1.0,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::NAN,
        ];
        for log in [false, true] {
            for &a in &extremes {
                for &b in &extremes {
                    let (lo, hi) = bounds([a, b].into_iter(), log);
                    assert!(
                        lo.is_finite() && hi.is_finite() && lo < hi,
                        "{a} {b} {log}: {lo} {hi}"
                    );
                    if log {
                        assert!(lo > 0.0, "{a} {b}: {lo}");
                    }
                }
            }
        }
    }

    #[test]
    fn figures_of_extreme_values_are_drawn_on_every_axis_kind() {
        let sets = [
            vec![(1.0, 1.7e308), (2.0, 1e-300)],
            vec![(f64::MAX, f64::MAX), (-f64::MAX, -f64::MAX)],
            vec![(5e-324, f64::MIN_POSITIVE), (1.0, 1.0)],
            vec![
                (f64::NAN, f64::INFINITY),
                (0.0, f64::NEG_INFINITY),
                (1.0, 0.0),
            ],
        ];
        for log in [(false, false), (false, true), (true, false), (true, true)] {
            for points in &sets {
                let plot = figure_plot(&figure(points.clone(), log), Formats::Svg)
                    .unwrap_or_else(|e| panic!("{points:?} {log:?}: {e}"));
                assert!(plot.svg.contains("extremes"), "{points:?} {log:?}");
            }
        }
        assert_eq!(tick(&1.7e308), "1.7e308");
    }

    #[test]
    fn figure_ids_become_safe_distinct_file_names() {
        assert_eq!(file_id("a/b", &[]), "a_b");
        assert_eq!(file_id("../../x", &[]), "______x");
        assert_eq!(file_id("", &[]), "figure");
        assert_eq!(file_id(&"é".repeat(300), &[]).len(), MAX_FILE_ID);
        let taken = vec!["a_b".to_string(), "a_b-2".to_string()];
        assert_eq!(file_id("a/b", &taken), "a_b-3");
    }
}
