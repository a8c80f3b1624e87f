//! A figure a plugin declared: its series, markers and guides.

use super::*;

pub(super) struct FigurePlot<'a>(pub(super) &'a Figure);

/// Whether a point can be drawn on axes `xs` by `ys`: finite and within
/// them (a log axis leaves out what is not above 0).
fn inside((x, y): (f64, f64), xs: (f64, f64), ys: (f64, f64)) -> bool {
    x.is_finite() && y.is_finite() && x >= xs.0 && x <= xs.1 && y >= ys.0 && y <= ys.1
}

pub(super) fn bounds(values: impl Iterator<Item = f64>, log: bool) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values.filter(|v| v.is_finite() && (!log || *v > 0.0)) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() {
        return if log { (1.0, 10.0) } else { (0.0, 1.0) };
    }
    // Every bound stays a finite float: an axis that ends at infinity
    // (1.7e308 × 1.5) never finishes laying out its ticks.
    if log {
        // And their ratio: plotters lays out a log axis over hi / lo, so an
        // axis spans at most 300 decades, the lowest values left off.
        let hi = hi.clamp(f64::MIN_POSITIVE * 1e10, f64::MAX / 2.0);
        let lo = lo.clamp(hi / 1e300, hi);
        (lo / 1.5, hi * 1.5)
    } else {
        // Halves first: hi − lo itself may overflow.
        let pad = ((hi / 2.0 - lo / 2.0) * 0.16)
            .max(hi.abs() * 0.02)
            .max(1e-12);
        let low = if lo >= 0.0 {
            (lo - pad).min(0.0)
        } else {
            lo - pad
        };
        // The axis's span must stay finite too: plotters lays out ticks
        // over hi − lo. What lies beyond a quarter of the largest float
        // is left off the axis.
        const EDGE: f64 = f64::MAX / 4.0;
        let low = low.clamp(-EDGE, EDGE / 2.0);
        let high = (hi + pad).min(EDGE);
        let high = if high > low {
            high
        } else {
            low + low.abs().max(1e-12) * 1e-3
        };
        (low, high)
    }
}

impl Draw for FigurePlot<'_> {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        let f = self.0;
        root.fill(&WHITE)?;
        let xs = || f.series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
        let ys = || f.series.iter().flat_map(|s| s.points.iter().map(|p| p.1));
        let (xdiv, xunit) = scale(f.x.unit, xs().fold(0.0, f64::max));
        let (ydiv, yunit) = scale(f.y.unit, ys().fold(0.0, f64::max));
        let (x0, x1) = bounds(xs().map(|x| x / xdiv), f.x.log);
        let (y0, y1) = bounds(ys().map(|y| y / ydiv), f.y.log);
        let scaled: Vec<(f64, f64)> = f
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|&(x, y)| (x / xdiv, y / ydiv)))
            .collect();
        let xlabel = with_unit(&f.x.label, xunit);
        let ylabel = with_unit(&f.y.label, yunit);
        let mut builder = ChartBuilder::on(root);
        builder
            .caption(&f.title, title_font(20))
            .margin(14)
            .x_label_area_size(44)
            .y_label_area_size(70);
        // Four axis kinds: plotters types log and linear axes apart.
        macro_rules! body {
            ($chart:expr) => {{
                let mut chart = $chart;
                chart
                    .configure_mesh()
                    .x_desc(&xlabel)
                    .y_desc(&ylabel)
                    .x_labels(10)
                    .y_labels(8)
                    .x_label_formatter(&tick)
                    .y_label_formatter(&tick)
                    .light_line_style(TRANSPARENT)
                    .label_style(text_font(13))
                    .axis_desc_style(text_font(15))
                    .draw()?;
                for m in &f.markers {
                    let x = m.x / xdiv;
                    if !inside((x, y0), (x0, x1), (y0, y1)) {
                        continue;
                    }
                    chart.draw_series(DashedLineSeries::new(
                        vec![(x, y0), (x, y1)],
                        6,
                        4,
                        BLACK.mix(0.6).stroke_width(2),
                    ))?;
                    chart.draw_series(std::iter::once(Text::new(
                        m.label.clone(),
                        (x, y1),
                        text_font(14),
                    )))?;
                }
                // Reference slopes through the first point of the first series.
                if let Some(&(gx, gy)) = f.series.first().and_then(|s| s.points.first()) {
                    for (k, g) in f.guides.iter().enumerate() {
                        let pts: Vec<(f64, f64)> = f.series[0]
                            .points
                            .iter()
                            .map(|&(x, _)| (x / xdiv, gy * (x / gx).powf(g.power) / ydiv))
                            .filter(|&p| inside(p, (x0, x1), (y0, y1)))
                            .collect();
                        let style = RGBColor(90, 90, 90).mix(0.7).stroke_width(1);
                        chart
                            .draw_series(DashedLineSeries::new(pts, 3, 3 + 2 * k as u32, style))?
                            .label(g.label.clone())
                            .legend(move |(x, y)| {
                                PathElement::new(vec![(x, y), (x + 20, y)], style)
                            });
                    }
                }
                for (i, s) in f.series.iter().enumerate() {
                    let colour = SERIES[i % SERIES.len()];
                    // Each line thinner than the one before: lines that
                    // coincide show as nested stripes, not as the last alone.
                    let width = if f.series.len() == 1 {
                        3
                    } else {
                        [6, 4, 2][i.min(2)]
                    };
                    let pts: Vec<(f64, f64)> = s
                        .points
                        .iter()
                        .map(|&(x, y)| (x / xdiv, y / ydiv))
                        .filter(|&(x, y)| inside((x, y), (x0, x1), (y0, y1)))
                        .collect();
                    chart
                        .draw_series(LineSeries::new(pts.clone(), colour.stroke_width(width)))?
                        .label(s.name.clone())
                        .legend(move |(x, y)| {
                            PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(width))
                        });
                    if pts.len() <= 30 {
                        chart
                            .draw_series(pts.iter().map(|&p| Circle::new(p, 4, colour.filled())))?;
                    }
                }
                chart
                    .configure_series_labels()
                    .position(emptiest_corner(
                        &scaled,
                        (x0, x1, f.x.log),
                        (y0, y1, f.y.log),
                    ))
                    .background_style(WHITE.mix(0.85))
                    .border_style(BLACK.mix(0.3))
                    .label_font(text_font(14))
                    .draw()?;
            }};
        }
        match (f.x.log, f.y.log) {
            (true, true) => {
                body!(builder.build_cartesian_2d((x0..x1).log_scale(), (y0..y1).log_scale())?)
            }
            (true, false) => body!(builder.build_cartesian_2d((x0..x1).log_scale(), y0..y1)?),
            (false, true) => body!(builder.build_cartesian_2d(x0..x1, (y0..y1).log_scale())?),
            (false, false) => body!(builder.build_cartesian_2d(x0..x1, y0..y1)?),
        }
        Ok(())
    }
}
