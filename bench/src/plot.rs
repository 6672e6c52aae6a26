//! PNG line charts with no font or image library linked at build time: plotters' bitmap backend
//! draws into a buffer, `png` encodes it, text is drawn with a TTF found at run time (DejaVu or
//! Liberation). Without one the charts are drawn without text, and the caller is told.

use std::path::Path;
use std::sync::OnceLock;

use plotters::prelude::*;

const W: u32 = 960;
const H: u32 = 600;

static FONT: OnceLock<bool> = OnceLock::new();

/// Registers a system TTF as "sans-serif" once; false if none was found.
pub fn font_available() -> bool {
    *FONT.get_or_init(|| {
        let cands = [
            "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
            "/usr/share/fonts/TTF/DejaVuSans.ttf",
            "/usr/share/fonts/dejavu/DejaVuSans.ttf",
            "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
            "/usr/share/fonts/liberation/LiberationSans-Regular.ttf",
            "/System/Library/Fonts/Supplemental/Arial.ttf",
        ];
        for c in cands {
            if let Ok(bytes) = std::fs::read(c) {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        false
    })
}

pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    /// Markers only (measured points), else a line with markers.
    pub markers_only: bool,
}

pub struct Chart<'a> {
    pub title: &'a str,
    pub x_desc: &'a str,
    pub y_desc: &'a str,
    pub log_x: bool,
    pub log_y: bool,
    pub series: Vec<Series>,
    /// Category names of x = 0, 1, 2... (x is then an index, not a value).
    pub x_names: Option<Vec<String>>,
}

fn tx(v: f64, log: bool) -> f64 {
    if log {
        v.max(1e-12).log10()
    } else {
        v
    }
}

fn fmt_tick(v: f64, log: bool) -> String {
    let x = if log { 10f64.powf(v) } else { v };
    if x.abs() >= 1e4 || (x != 0.0 && x.abs() < 1e-2) {
        format!("{x:.0e}")
    } else if x.fract().abs() < 1e-9 {
        format!("{x:.0}")
    } else {
        format!("{x:.2}")
    }
}

pub fn line_chart(path: &Path, c: &Chart) -> anyhow::Result<()> {
    let text = font_available();
    let pts: Vec<(f64, f64)> = c
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|&(x, y)| (tx(x, c.log_x), tx(y, c.log_y))))
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .collect();
    anyhow::ensure!(!pts.is_empty(), "nothing to plot for {}", path.display());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for (x, y) in &pts {
        x0 = x0.min(*x);
        x1 = x1.max(*x);
        y0 = y0.min(*y);
        y1 = y1.max(*y);
    }
    let pad = |a: f64, b: f64| if (b - a).abs() < 1e-12 { 1.0 } else { (b - a) * 0.05 };
    let (px, py) = (pad(x0, x1), pad(y0, y1));
    let (x0, x1) = (x0 - px, x1 + px);
    let (y0, y1) = if c.log_y { (y0 - py, y1 + py) } else { (y0.min(0.0), y1 + py) };
    let mut buf = vec![255u8; (W * H * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut buf, (W, H)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut b = ChartBuilder::on(&root);
        b.margin(16);
        if text {
            b.caption(c.title, ("sans-serif", 22)).x_label_area_size(48).y_label_area_size(72);
        }
        let mut chart = b.build_cartesian_2d(x0..x1, y0..y1)?;
        let (lx, ly) = (c.log_x, c.log_y);
        let names = c.x_names.clone();
        let fx = move |v: &f64| match &names {
            Some(n) if (v - v.round()).abs() < 1e-6 && v.round() >= 0.0 => {
                n.get(v.round() as usize).cloned().unwrap_or_default()
            }
            Some(_) => String::new(),
            None => fmt_tick(*v, lx),
        };
        let fy = move |v: &f64| fmt_tick(*v, ly);
        let mut mesh = chart.configure_mesh();
        if text {
            if let Some(n) = &c.x_names {
                mesh.x_labels(4 * n.len().max(1) - 3);
            }
            mesh.x_desc(c.x_desc)
                .y_desc(c.y_desc)
                .x_label_formatter(&fx)
                .y_label_formatter(&fy)
                .label_style(("sans-serif", 14));
        } else {
            mesh.x_labels(0).y_labels(0);
        }
        mesh.draw()?;
        for (i, s) in c.series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let data: Vec<(f64, f64)> = s
                .points
                .iter()
                .map(|&(x, y)| (tx(x, c.log_x), tx(y, c.log_y)))
                .filter(|(x, y)| x.is_finite() && y.is_finite())
                .collect();
            let style = ShapeStyle::from(&color).stroke_width(2);
            let ann = if s.markers_only {
                chart.draw_series(data.iter().map(|&p| Circle::new(p, 6, color.filled())))?
            } else {
                chart.draw_series(LineSeries::new(data.clone(), style))?;
                chart.draw_series(data.iter().map(|&p| Circle::new(p, 3, color.filled())))?
            };
            if text {
                ann.label(s.name.clone()).legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], ShapeStyle::from(&color).stroke_width(3))
                });
            }
        }
        if text {
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .label_font(("sans-serif", 13))
                .position(SeriesLabelPosition::UpperLeft)
                .draw()?;
        }
        root.present()?;
    }
    let f = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut enc = png::Encoder::new(f, W, H);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    enc.write_header()?.write_image_data(&buf)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_a_png() {
        let dir = std::env::temp_dir().join(format!("kvtier-bench-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.png");
        let chart = Chart {
            title: "test",
            x_desc: "x",
            y_desc: "y",
            log_x: true,
            log_y: false,
            series: vec![
                Series { name: "a".into(), points: vec![(1.0, 1.0), (10.0, 2.0), (100.0, 1.5)], markers_only: false },
                Series { name: "b".into(), points: vec![(5.0, 0.5)], markers_only: true },
            ],
            x_names: None,
        };
        line_chart(&p, &chart).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
