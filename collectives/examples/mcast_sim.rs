//! Draws the multicast broadcast chapter's scaling plots from the discrete-event simulation
//! (`rankweave_collectives::mcast::sim`), which runs the real sans-IO broadcast machines on
//! simulated time: broadcast latency (until the last rank has the data) and per-rank
//! completion skew against communicator size, 2 to 1024 ranks, for the two-stage and channel
//! broadcasts and the binomial tree; and latency against multicast loss rate at 64 ranks.
//!
//! ```text
//! cargo run --release -p rankweave-collectives --example mcast_sim -- book/src/multicast
//! ```
//!
//! Writes `sim.csv`, `sim-latency-8.svg`, `sim-latency-65536.svg`, `sim-skew-8.svg`,
//! `sim-skew-65536.svg` and `sim-loss.svg` into the directory given (default `.`). The run is
//! deterministic: the same code gives the same files.

use std::fmt::Write as _;
use std::time::Duration;

use rankweave_collectives::mcast::sim::{SimAlgorithm, SimConfig, simulate};

const ALGORITHMS: [(SimAlgorithm, &str, &str); 3] = [
    (SimAlgorithm::TwoStage, "two-stage", "#1f77b4"),
    (SimAlgorithm::Channels, "channels", "#2ca02c"),
    (SimAlgorithm::Binomial, "binomial tree", "#d62728"),
];

/// The network every plot assumes: 2 µs per message, 10 GB/s links, 8 KiB fragments.
fn network(ranks: usize, bytes: usize) -> SimConfig {
    SimConfig {
        ranks,
        bytes,
        broadcasts: 1,
        latency: Duration::from_micros(2),
        ns_per_byte: 0.1,
        fragment: 8192,
        ..SimConfig::default()
    }
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// One line of a plot: a label, a colour and its points.
struct Series {
    label: &'static str,
    colour: &'static str,
    points: Vec<(f64, f64)>,
}

/// A line chart as SVG; `log2_x` puts x on a log2 axis (ranks).
fn svg(title: &str, x_label: &str, y_label: &str, log2_x: bool, series: &[Series]) -> String {
    let (w, h) = (640.0, 400.0);
    let (left, right, top, bottom) = (70.0, 20.0, 40.0, 60.0);
    let fx = |x: f64| if log2_x { x.log2() } else { x };
    let all = series.iter().flat_map(|s| s.points.iter());
    let (x0, x1) = all.clone().fold((f64::MAX, f64::MIN), |(a, b), p| {
        (a.min(fx(p.0)), b.max(fx(p.0)))
    });
    let y1 = all.fold(0.0f64, |m, p| m.max(p.1)) * 1.1;
    let y1 = if y1 > 0.0 { y1 } else { 1.0 };
    let px = |x: f64| left + (fx(x) - x0) / (x1 - x0).max(1e-9) * (w - left - right);
    let py = |y: f64| h - bottom - y / y1 * (h - top - bottom);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="14">{title}</text>"#,
        w / 2.0
    );
    // Axes, with ticks: powers of two on a log axis, five steps otherwise.
    let _ = writeln!(
        s,
        r#"<path d="M{left},{top} V{} H{}" stroke="black" fill="none"/>"#,
        h - bottom,
        w - right
    );
    let xticks: Vec<f64> = if log2_x {
        (x0.round() as i32..=x1.round() as i32)
            .map(|e| 2f64.powi(e))
            .collect()
    } else {
        (0..=5).map(|i| x0 + (x1 - x0) * i as f64 / 5.0).collect()
    };
    for x in xticks {
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
            px(x),
            h - bottom + 16.0,
            x.round()
        );
    }
    for i in 0..=5 {
        let y = y1 * i as f64 / 5.0;
        let _ = writeln!(
            s,
            r##"<text x="{}" y="{:.1}" text-anchor="end">{y:.1}</text><path d="M{left},{:.1} H{}" stroke="#ddd"/>"##,
            left - 6.0,
            py(y) + 4.0,
            py(y),
            w - right
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">{x_label}</text>"#,
        (left + w - right) / 2.0,
        h - 20.0
    );
    let _ = writeln!(
        s,
        r#"<text transform="translate(18,{}) rotate(-90)" text-anchor="middle">{y_label}</text>"#,
        (top + h - bottom) / 2.0
    );
    for (i, line) in series.iter().enumerate() {
        let d: Vec<String> = line
            .points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline points="{}" fill="none" stroke="{}" stroke-width="2"/>"#,
            d.join(" "),
            line.colour
        );
        let ly = top + 14.0 + 16.0 * i as f64;
        let _ = writeln!(
            s,
            r#"<path d="M{},{ly} h20" stroke="{}" stroke-width="2"/><text x="{}" y="{}">{}</text>"#,
            left + 10.0,
            line.colour,
            left + 36.0,
            ly + 4.0,
            line.label
        );
    }
    s.push_str("</svg>\n");
    s
}

fn main() -> std::io::Result<()> {
    let out = std::path::PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| ".".into()));
    std::fs::create_dir_all(&out)?;
    let ranks: Vec<usize> = (1..=10).map(|e| 1usize << e).collect();
    let mut csv = String::from("plot,algorithm,ranks,bytes,loss,latency_us,skew_us\n");
    for bytes in [8usize, 65536] {
        let mut latency = Vec::new();
        let mut skew = Vec::new();
        for (algorithm, label, colour) in ALGORITHMS {
            let mut lat = Vec::new();
            let mut sk = Vec::new();
            for &n in &ranks {
                let report = simulate(algorithm, &network(n, bytes));
                let (l, k) = (micros(report.latency(0)), micros(report.skew(0)));
                let _ = writeln!(csv, "size,{label},{n},{bytes},0,{l:.3},{k:.3}");
                lat.push((n as f64, l));
                sk.push((n as f64, k));
            }
            latency.push(Series {
                label,
                colour,
                points: lat,
            });
            skew.push(Series {
                label,
                colour,
                points: sk,
            });
        }
        // Without loss every receiver takes the same multicast at the same (simulated)
        // instant; with loss the skew is the repair time.
        for (algorithm, label, colour) in [
            (SimAlgorithm::TwoStage, "two-stage at 10% loss", "#9ecae1"),
            (SimAlgorithm::Channels, "channels at 10% loss", "#a1d99b"),
        ] {
            let mut sk = Vec::new();
            for &n in &ranks {
                let config = SimConfig {
                    loss: 0.1,
                    seed: 3 + n as u64,
                    ..network(n, bytes)
                };
                let report = simulate(algorithm, &config);
                let (l, k) = (micros(report.latency(0)), micros(report.skew(0)));
                let _ = writeln!(csv, "size,{label},{n},{bytes},0.1,{l:.3},{k:.3}");
                sk.push((n as f64, k));
            }
            skew.push(Series {
                label,
                colour,
                points: sk,
            });
        }
        let size = if bytes == 8 { "8 B" } else { "64 KiB" };
        std::fs::write(
            out.join(format!("sim-latency-{bytes}.svg")),
            svg(
                &format!("Broadcast latency, {size} (simulated)"),
                "ranks",
                "µs until the last rank has it",
                true,
                &latency,
            ),
        )?;
        std::fs::write(
            out.join(format!("sim-skew-{bytes}.svg")),
            svg(
                &format!("Per-rank completion skew, {size} (simulated)"),
                "ranks",
                "µs, last minus first completion",
                true,
                &skew,
            ),
        )?;
    }
    let mut by_loss = Vec::new();
    for (algorithm, label, colour) in ALGORITHMS {
        let mut points = Vec::new();
        for percent in [0u32, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100] {
            let loss = f64::from(percent) / 100.0;
            let config = SimConfig {
                loss,
                seed: 7 + u64::from(percent),
                ..network(64, 65536)
            };
            let report = simulate(algorithm, &config);
            let (l, k) = (micros(report.latency(0)), micros(report.skew(0)));
            let _ = writeln!(csv, "loss,{label},64,65536,{loss},{l:.3},{k:.3}");
            points.push((f64::from(percent), l));
        }
        by_loss.push(Series {
            label,
            colour,
            points,
        });
    }
    std::fs::write(
        out.join("sim-loss.svg"),
        svg(
            "64 KiB to 64 ranks against multicast loss (simulated)",
            "% of multicast datagrams each rank misses",
            "µs until the last rank has it",
            false,
            &by_loss,
        ),
    )?;
    std::fs::write(out.join("sim.csv"), csv)?;
    println!("wrote the simulation plots to {}", out.display());
    Ok(())
}
