//! Each region's peak above its start, stacked by category.

use super::*;

pub(super) struct Peaks<'a> {
    pub(super) title: &'a str,
    pub(super) regions: &'a [RegionReport],
}

impl Draw for Peaks<'_> {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        root.fill(&WHITE)?;
        let root = root.titled(self.title, title_font(20))?;
        let (legend, body) = root.split_vertically(28);
        let all: Vec<&RegionReport> = self.regions.iter().collect();
        let categories = used_categories(&all);
        legend_row(&legend, &categories)?;
        let max = self
            .regions
            .iter()
            .map(|r| r.peak_above_baseline().max(r.analytic.unwrap_or(0)))
            .max()
            .unwrap_or(1)
            .max(1) as f64;
        let (div, unit) = scale(Unit::Bytes, max);
        let n = self.regions.len();
        let names: Vec<String> = self.regions.iter().map(|r| r.name.clone()).collect();
        let longest = names.iter().map(|s| s.chars().count()).max().unwrap_or(4) as u32;
        let mut chart = ChartBuilder::on(&body)
            .margin(10)
            .x_label_area_size(40)
            .y_label_area_size((longest * 8 + 12).min(360))
            .build_cartesian_2d(0f64..max * 1.1 / div, -0.5f64..(n as f64 - 0.5))?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .light_line_style(TRANSPARENT)
            .y_labels(n.max(2) * 2 + 1)
            .y_label_formatter(&|y| {
                // A bar sits on each integer; the first variant at the top.
                let i = y.round();
                if (y - i).abs() > 1e-6 || i < 0.0 || i as usize >= n {
                    return String::new();
                }
                names.get(n - 1 - i as usize).cloned().unwrap_or_default()
            })
            .x_label_formatter(&tick)
            .x_desc(with_unit("peak above the variant's start", unit))
            .label_style(text_font(13))
            .draw()?;
        for (i, r) in self.regions.iter().enumerate() {
            let y = (n - 1 - i) as f64;
            let mut left = 0f64;
            for &c in &categories {
                let v = r.peak_by_category.get(c).saturating_sub(r.baseline.get(c)) as f64 / div;
                if v > 0.0 {
                    chart.draw_series(std::iter::once(Rectangle::new(
                        [(left, y - 0.35), (left + v, y + 0.35)],
                        category_colour(c).filled(),
                    )))?;
                    left += v;
                }
            }
            if let Some(a) = r.analytic {
                let x = a as f64 / div;
                chart.draw_series(std::iter::once(PathElement::new(
                    vec![(x, y - 0.45), (x, y + 0.45)],
                    BLACK.stroke_width(3),
                )))?;
                chart.draw_series(std::iter::once(
                    EmptyElement::at((x, y + 0.45))
                        + Text::new("analytic".to_string(), (4, -2), text_font(12)),
                ))?;
            }
        }
        Ok(())
    }
}
