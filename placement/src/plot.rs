//! PNG line charts of simulation results (plotters' bitmap backend; text in DejaVu Sans,
//! embedded from the `dejavu` crate, so nothing depends on the machine's fonts).

use std::path::Path;
use std::sync::Once;

use plotters::prelude::*;
use plotters::style::FontStyle;

use crate::Error;

/// One line of a chart: its label and its (x, y) points.
pub type Line = (String, Vec<(f64, f64)>);

static FONT: Once = Once::new();

fn register_font() {
    FONT.call_once(|| {
        // The bytes are DejaVu Sans, a valid TrueType font: registration cannot fail; if
        // it did, text would be missing from the chart, not wrong.
        let _ = plotters::style::register_font(
            "sans-serif",
            FontStyle::Normal,
            dejavu::sans::regular(),
        );
    });
}

fn err(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Plot {
        path: path.display().to_string(),
        why: e.to_string(),
    }
}

/// A chart of `lines` written to `path` (PNG, 960×600), with a legend.
pub fn line_chart(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    lines: &[Line],
) -> Result<(), Error> {
    register_font();
    let pts = || {
        lines
            .iter()
            .flat_map(|(_, p)| p.iter())
            .filter(|(x, y)| x.is_finite() && y.is_finite())
    };
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in pts() {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x0 > x1 {
        return Err(err(path, "nothing to plot"));
    }
    if x1 - x0 < 1e-9 {
        x1 = x0 + 1.0;
    }
    // max/mean charts: start at 1.0 when the data does, with a little headroom.
    y0 = y0.min(1.0);
    let pad = ((y1 - y0) * 0.05).max(0.01);
    y1 += pad;
    let root = BitMapBackend::new(path, (960, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(path, e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(|e| err(path, e))?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(|e| err(path, e))?;
    for (i, (label, points)) in lines.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let style = ShapeStyle::from(color).stroke_width(2);
        let finite: Vec<(f64, f64)> = points
            .iter()
            .copied()
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .collect();
        let marks = finite.len() <= 24;
        chart
            .draw_series(LineSeries::new(finite.clone(), style))
            .map_err(|e| err(path, e))?
            .label(label.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        if marks {
            chart
                .draw_series(
                    finite
                        .into_iter()
                        .map(|p| Circle::new(p, 3, color.filled())),
                )
                .map_err(|e| err(path, e))?;
        }
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(|e| err(path, e))?;
    root.present().map_err(|e| err(path, e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_a_png() {
        let dir = std::env::temp_dir().join(format!("placement-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.png");
        let lines = vec![
            ("a".to_string(), vec![(0.0, 1.0), (1.0, 1.2), (2.0, 1.1)]),
            ("b".to_string(), vec![(0.0, 1.0), (1.0, 2.0)]),
        ];
        line_chart(&path, "test", "x", "y", &lines).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        assert!(bytes.len() > 2_000, "{} bytes", bytes.len());
        assert!(line_chart(&path, "t", "x", "y", &[]).is_err());
    }
}
