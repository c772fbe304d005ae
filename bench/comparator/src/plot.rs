//! SVG plots: the figure against message size, log scales, one line per implementation.

use std::path::Path;

use plotters::prelude::*;

use crate::osu;
use crate::report::summarize;
use crate::run::{Config, Impl, Plan, Samples};

pub fn file_name(config: Config, bench: &str) -> String {
    format!("{}-{}.svg", config.name(), bench)
}

/// Draws every (config, benchmark) with more than one size; returns the file names written.
pub fn all(plan: &Plan, samples: &Samples, dir: &Path) -> Result<Vec<String>, String> {
    let mut written = Vec::new();
    for &config in &plan.configs {
        for bench in &plan.benches {
            let lines: Vec<(Impl, Vec<(f64, f64)>)> = [Impl::Rankweave, Impl::Mpich, Impl::OpenMpi]
                .into_iter()
                .filter_map(|imp| {
                    let by_size = samples.get(&(config, bench.clone(), imp))?;
                    let pts: Vec<(f64, f64)> = by_size
                        .iter()
                        .filter(|(size, _)| **size > 0)
                        .filter_map(|(size, v)| Some((*size as f64, summarize(v)?.median)))
                        .filter(|&(_, y)| y > 0.0)
                        .collect();
                    (pts.len() > 1).then_some((imp, pts))
                })
                .collect();
            if lines.is_empty() {
                continue;
            }
            let name = file_name(config, bench);
            draw(&dir.join(&name), config, bench, &lines)
                .map_err(|e| format!("plot {name}: {e}"))?;
            written.push(name);
        }
    }
    Ok(written)
}

fn draw(
    path: &Path,
    config: Config,
    bench: &str,
    lines: &[(Impl, Vec<(f64, f64)>)],
) -> Result<(), Box<dyn std::error::Error>> {
    let xs = lines.iter().flat_map(|(_, p)| p.iter().map(|&(x, _)| x));
    let ys = lines.iter().flat_map(|(_, p)| p.iter().map(|&(_, y)| y));
    let (x0, x1) = xs.fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(x), b.max(x)));
    let (y0, y1) = ys.fold((f64::MAX, f64::MIN), |(a, b), y| (a.min(y), b.max(y)));
    let root = SVGBackend::new(path, (800, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let metric = osu::metric(bench);
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("{bench} ({})", config.name()), ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(
            (x0..x1 * 1.01).log_scale(),
            (y0 * 0.8..y1 * 1.25).log_scale(),
        )?;
    chart
        .configure_mesh()
        .x_desc("message size (bytes)")
        .y_desc(metric.unit)
        .draw()?;
    let colors = [
        RGBColor(214, 39, 40),
        RGBColor(31, 119, 180),
        RGBColor(44, 160, 44),
    ];
    for (i, (imp, pts)) in lines.iter().enumerate() {
        let color = colors[i % colors.len()];
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))?
            .label(imp.name())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
