//! The benchmarks, what their numbers mean, and how to read OSU-format output.

/// Every benchmark, in report order.
pub const ALL: [&str; 10] = [
    "latency",
    "bw",
    "bibw",
    "mr",
    "barrier",
    "bcast",
    "reduce",
    "allreduce",
    "allgather",
    "alltoall",
];

/// What a benchmark's figure is.
#[derive(Clone, Copy, Debug)]
pub struct Metric {
    /// Column of the OSU output row that holds the figure (0 is the size).
    pub column: usize,
    /// Unit, for headers.
    pub unit: &'static str,
    /// Whether a larger figure is better (bandwidth, rate) or worse (latency).
    pub higher_is_better: bool,
}

/// The figure each benchmark reports.
pub fn metric(bench: &str) -> Metric {
    match bench {
        "bw" | "bibw" => Metric {
            column: 1,
            unit: "MB/s",
            higher_is_better: true,
        },
        "mr" => Metric {
            column: 2,
            unit: "messages/s",
            higher_is_better: true,
        },
        _ => Metric {
            column: 1,
            unit: "us",
            higher_is_better: false,
        },
    }
}

/// Whether a benchmark runs between two ranks (point-to-point) rather than all of them.
pub fn is_pt2pt(bench: &str) -> bool {
    matches!(bench, "latency" | "bw" | "bibw" | "mr")
}

/// Reads `(size, figure)` rows from OSU-format output: `#` lines are comments; a row is
/// whitespace-separated numbers, the size first. A row with a single number (the barrier's
/// average latency) has size 0.
pub fn parse(output: &str, metric: Metric) -> Vec<(u64, f64)> {
    output
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(|l| {
            let cols: Vec<f64> = l
                .split_whitespace()
                .map(|c| c.parse::<f64>())
                .collect::<Result<_, _>>()
                .ok()?;
            match cols.len() {
                1 => Some((0, cols[0])),
                _ => Some((cols[0] as u64, *cols.get(metric.column)?)),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_rows_and_skips_comments() {
        let out = "# OSU MPI Latency Test\n# Size          Latency (us)\n0                       0.16\n1 0.17\nnoise\n";
        assert_eq!(parse(out, metric("latency")), vec![(0, 0.16), (1, 0.17)]);
        let mr = "# Size MB/s Messages/s\n8  10.00  1250000.00\n";
        assert_eq!(parse(mr, metric("mr")), vec![(8, 1_250_000.0)]);
        assert_eq!(
            parse("# Avg Latency(us)\n0.39\n", metric("barrier")),
            vec![(0, 0.39)]
        );
    }
}
