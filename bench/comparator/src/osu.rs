//! The benchmarks, what their numbers mean, and how to read OSU-format output.

/// Every benchmark, in report order (also the default `--bench` list). `ring` and `p2pbarrier`
/// are not OSU programs (their C baselines are `rw_ring` and `rw_p2pbarrier`) but print the same
/// format: µs per exchange by size, and one µs figure per barrier.
pub const ALL: [&str; 12] = [
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
    "ring",
    "p2pbarrier",
];

/// What a benchmark's figure is.
#[derive(Clone, Copy, Debug)]
pub struct Metric {
    /// Column of the OSU output row that holds the figure (0 is the size; for the barriers,
    /// which have no size column, 0 is the figure itself and the size reads as 0).
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
        "barrier" | "p2pbarrier" => Metric {
            column: 0,
            unit: "us",
            higher_is_better: false,
        },
        _ => Metric {
            column: 1,
            unit: "us",
            higher_is_better: false,
        },
    }
}

/// Whether a benchmark runs between two ranks (point-to-point) rather than all of them (`ring`
/// and `p2pbarrier` are made of point-to-point messages, but every rank takes part).
pub fn is_pt2pt(bench: &str) -> bool {
    matches!(bench, "latency" | "bw" | "bibw" | "mr")
}

/// Whether a benchmark takes message sizes (`-m`); the barriers do not.
pub fn is_sized(bench: &str) -> bool {
    !matches!(bench, "barrier" | "p2pbarrier")
}

/// The C baseline's program name in `target/bench-c/<mpi>/`.
pub fn c_program(bench: &str) -> String {
    match bench {
        // OSU names the message-rate test after its multi-pair original.
        "mr" => "osu_mbw_mr".to_string(),
        // Not OSU programs.
        "ring" | "p2pbarrier" => format!("rw_{bench}"),
        b => format!("osu_{b}"),
    }
}

/// Reads `(size, figure)` rows from OSU-format output: `#` lines are comments; a row is
/// whitespace-separated numbers, the size first. A row with a single number, or any row of a
/// metric in column 0 (the barriers' average latency, also with `-f`'s min / max / iterations
/// columns), has size 0.
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
            if metric.column == 0 || cols.len() == 1 {
                Some((0, *cols.first()?))
            } else {
                Some((cols[0] as u64, *cols.get(metric.column)?))
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
        // The C baselines' and rw-bench's ring and p2pbarrier output.
        let ring = "# rankweave C baseline: rw_ring (MPICH 4.0.2)\n# Size         Avg Latency(us)\n1                      4850.18\n8                         6.21\n";
        assert_eq!(parse(ring, metric("ring")), vec![(1, 4850.18), (8, 6.21)]);
        let full = "# Avg Latency(us)     Min Latency(us)     Max Latency(us)  Iterations\n            18.72               18.70               18.74        1000\n";
        assert_eq!(parse(full, metric("p2pbarrier")), vec![(0, 18.72)]);
    }

    #[test]
    fn names_units_and_programs() {
        for b in ["ring", "p2pbarrier"] {
            assert!(ALL.contains(&b));
            assert_eq!(metric(b).unit, "us");
            assert!(!metric(b).higher_is_better);
            assert!(!is_pt2pt(b));
        }
        assert!(is_sized("ring") && !is_sized("p2pbarrier") && !is_sized("barrier"));
        assert_eq!(c_program("latency"), "osu_latency");
        assert_eq!(c_program("mr"), "osu_mbw_mr");
        assert_eq!(c_program("ring"), "rw_ring");
        assert_eq!(c_program("p2pbarrier"), "rw_p2pbarrier");
    }
}
