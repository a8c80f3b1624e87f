//! Memory at each mark, stacked by category, one panel per region.

use super::*;

pub(super) struct Timeline<'a> {
    pub(super) title: &'a str,
    pub(super) regions: &'a [RegionReport],
}

impl Draw for Timeline<'_> {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        root.fill(&WHITE)?;
        let shown: Vec<&RegionReport> = self.regions.iter().take(MAX_PANELS).collect();
        let title = if self.regions.len() > shown.len() {
            format!(
                "{} (first {} of {} variants)",
                self.title,
                shown.len(),
                self.regions.len()
            )
        } else {
            self.title.to_string()
        };
        let root = root.titled(&title, title_font(20))?;
        let (legend, body) = root.split_vertically(28);
        let categories = used_categories(&shown);
        legend_row(&legend, &categories)?;
        // The peak-so-far line's key, after the categories.
        let x = legend.dim_in_pixel().0 as i32 - 190;
        legend.draw(&PathElement::new(
            vec![(x, 13), (x + 24, 13)],
            BLACK.stroke_width(2),
        ))?;
        legend.draw(&Text::new("peak so far", (x + 30, 6), text_font(14)))?;
        // What each variant allocated above its own start: memory that was
        // there before (other cells, warm-up buffers) is not its doing.
        let above = |r: &RegionReport, m: &workbook_sdk::output::Mark, c: Category| {
            m.current.get(c).saturating_sub(r.baseline.get(c))
        };
        let max = shown
            .iter()
            .flat_map(|r| {
                let base = r.baseline.total();
                r.marks
                    .iter()
                    .map(move |m| m.peak_so_far.saturating_sub(base))
            })
            .max()
            .unwrap_or(1)
            .max(1) as f64;
        let (div, unit) = scale(Unit::Bytes, max);
        let cols = shown.len().clamp(1, 3);
        let rows = shown.len().div_ceil(cols).max(1);
        for (panel, r) in body.split_evenly((rows, cols)).iter().zip(&shown) {
            let n = r.marks.len().max(2);
            let mut chart = ChartBuilder::on(panel)
                .caption(&r.name, text_font(15))
                .margin(6)
                .x_label_area_size(22)
                .y_label_area_size(58)
                .build_cartesian_2d(0f64..(n - 1) as f64, 0f64..max * 1.08 / div)?;
            let labels: Vec<String> = r.marks.iter().map(|m| m.label.to_string()).collect();
            chart
                .configure_mesh()
                .disable_x_mesh()
                .x_labels(n.min(6))
                .x_label_formatter(&|x| {
                    let i = x.round() as usize;
                    labels.get(i).map(|l| short(l)).unwrap_or_default()
                })
                .y_desc(unit)
                .y_labels(6)
                .y_label_formatter(&tick)
                .light_line_style(TRANSPARENT)
                .label_style(text_font(if n > 4 { 10 } else { 12 }))
                .draw()?;
            // Stacked areas: each category on top of the ones before it.
            let mut below = vec![0f64; r.marks.len()];
            for &c in &categories {
                let top: Vec<f64> = r
                    .marks
                    .iter()
                    .zip(&below)
                    .map(|(m, b)| b + above(r, m, c) as f64 / div)
                    .collect();
                let mut poly: Vec<(f64, f64)> = top
                    .iter()
                    .enumerate()
                    .map(|(i, y)| (i as f64, *y))
                    .collect();
                poly.extend(below.iter().enumerate().rev().map(|(i, y)| (i as f64, *y)));
                chart.draw_series(std::iter::once(Polygon::new(
                    poly,
                    category_colour(c).mix(0.85).filled(),
                )))?;
                below = top;
            }
            chart.draw_series(LineSeries::new(
                r.marks.iter().enumerate().map(|(i, m)| {
                    (
                        i as f64,
                        m.peak_so_far.saturating_sub(r.baseline.total()) as f64 / div,
                    )
                }),
                BLACK.stroke_width(2),
            ))?;
        }
        Ok(())
    }
}

/// Mark labels are short on the axis: "after forward" -> "forward",
/// "optimizer state" -> "optimizer".
fn short(label: &str) -> String {
    let label = label.strip_prefix("after ").unwrap_or(label);
    label.split_whitespace().next().unwrap_or(label).to_string()
}
