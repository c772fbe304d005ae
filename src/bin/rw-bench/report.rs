//! Results in OSU's output format: a comment line, OSU's column header, one row per size.
//!
//! Widths are OSU 7.x's (`osu_util.h`): the size left-aligned in 10 columns, every value
//! right-aligned in `FIELD_WIDTH` = 20 with `FLOAT_PRECISION` = 2 decimals; barrier and
//! p2pbarrier, which have no size column, print its value right-aligned in 17; `-f`'s iteration count takes 12.

use std::io::Write;

use rankweave::{Communicator, ProgressPolicy};

use crate::cli::{Bench, Kind, Options};

pub const SIZE_WIDTH: usize = 10;
pub const FIELD_WIDTH: usize = 20;
const NO_SIZE_WIDTH: usize = 17;
const ITERATIONS_WIDTH: usize = 12;

/// One output row.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// The message size; `None` for barrier and p2pbarrier.
    pub size: Option<usize>,
    /// The values in column order (latency in µs, bandwidth in MB/s, messages/s, ...).
    pub values: Vec<f64>,
    /// The iteration count column of `-f`.
    pub iterations: Option<usize>,
}

impl Row {
    /// A row for `size` with `values` and no iteration column (every point-to-point test).
    pub fn sized(size: usize, values: Vec<f64>) -> Row {
        Row {
            size: Some(size),
            values,
            iterations: None,
        }
    }

    pub fn format(&self) -> String {
        let mut line = String::new();
        let mut values = self.values.iter();
        match self.size {
            Some(size) => line.push_str(&format!("{size:<SIZE_WIDTH$}")),
            None => {
                if let Some(v) = values.next() {
                    line.push_str(&format!("{v:>NO_SIZE_WIDTH$.2}"));
                }
            }
        }
        for v in values {
            line.push_str(&format!("{v:>FIELD_WIDTH$.2}"));
        }
        if let Some(n) = self.iterations {
            line.push_str(&format!("{n:>ITERATIONS_WIDTH$}"));
        }
        line
    }
}

/// A benchmark's output: the comment line, the header line and the rows.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    pub preamble: String,
    pub header: String,
    pub rows: Vec<Row>,
    /// Comment lines (each starting with `#`) printed after the rows.
    pub notes: Vec<String>,
}

impl Report {
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn to_text(&self) -> String {
        let mut s = format!("{}\n{}\n", self.preamble, self.header);
        for r in &self.rows {
            s.push_str(&r.format());
            s.push('\n');
        }
        for n in &self.notes {
            s.push_str(n);
            s.push('\n');
        }
        s
    }
}

/// OSU's column header for `bench`.
pub fn header(bench: Bench, full: bool) -> String {
    let size = format!("{:<SIZE_WIDTH$}", "# Size");
    let mut h = match bench {
        Bench::Latency => format!("{size}{:>FIELD_WIDTH$}", "Latency (us)"),
        Bench::Bw | Bench::Bibw => format!("{size}{:>FIELD_WIDTH$}", "Bandwidth (MB/s)"),
        Bench::Mr => format!(
            "{size}{:>FIELD_WIDTH$}{:>FIELD_WIDTH$}",
            "MB/s", "Messages/s"
        ),
        Bench::Barrier | Bench::P2pBarrier => "# Avg Latency(us)".to_string(),
        _ => format!("{size}{:>FIELD_WIDTH$}", "Avg Latency(us)"),
    };
    if full && bench.kind() == Kind::Collective {
        h.push_str(&format!(
            "{:>FIELD_WIDTH$}{:>FIELD_WIDTH$}{:>ITERATIONS_WIDTH$}",
            "Min Latency(us)", "Max Latency(us)", "Iterations"
        ));
    }
    h
}

/// The column header of `bcast --skew`: OSU's average latency, then the two medians over the
/// iterations (per-rank completion skew, and the last rank's completion after the root's t0).
pub fn skew_header() -> String {
    format!(
        "{:<SIZE_WIDTH$}{:>FIELD_WIDTH$}{:>FIELD_WIDTH$}{:>FIELD_WIDTH$}",
        "# Size", "Avg Latency(us)", "Skew(us)", "Last(us)"
    )
}

fn progress_name(p: ProgressPolicy) -> &'static str {
    match p {
        ProgressPolicy::Spin => "spin",
        ProgressPolicy::SpinThenPark => "spin-then-park",
        ProgressPolicy::Park => "park",
    }
}

/// The first line: which benchmark, after which OSU program, and the configuration.
pub fn preamble(comm: &Communicator, opts: &Options) -> String {
    let cfg = comm.config();
    let n = comm.size();
    let bench = opts.bench;
    let mut parts = vec![format!(
        "{n} ranks ({})",
        if opts.launch.is_empty() {
            "in-process"
        } else {
            &opts.launch
        }
    )];
    match bench {
        Bench::Latency | Bench::Bw | Bench::Bibw => parts.push("ranks 0 and 1".into()),
        Bench::Mr => parts.push(format!("pairs: {}", n / 2)),
        _ => {}
    }
    if bench.windowed() {
        parts.push(format!("window size: {}", opts.window));
    }
    if opts.skew {
        parts.push(format!(
            "completion skew over the {} non-root ranks (medians over the iterations)",
            n.saturating_sub(1)
        ));
    }
    let progress = match cfg.progress {
        ProgressPolicy::SpinThenPark => format!(
            "progress {} ({} us)",
            progress_name(cfg.progress),
            cfg.spin_window().as_micros()
        ),
        p => format!("progress {}", progress_name(p)),
    };
    parts.push(progress);
    parts.push(format!("eager limit {} B", cfg.eager_limit));
    let loops = if !bench.sized() || opts.iterations == opts.iterations_large {
        format!("iterations {} / warm-up {}", opts.iterations, opts.warmup)
    } else {
        format!(
            "iterations {} / warm-up {} (> 8192 B: {} / {})",
            opts.iterations, opts.warmup, opts.iterations_large, opts.warmup_large
        )
    };
    parts.push(loops);
    format!(
        "# rw-bench {} ({}, {}): {}",
        bench.name(),
        bench.title(),
        bench.origin(),
        parts.join(", ")
    )
}

/// Collects rank 0's rows and, when asked, prints them as they come.
pub struct Reporter {
    report: Option<Report>,
    print: bool,
}

impl Reporter {
    /// On rank 0, starts the report (and prints the two header lines); elsewhere does nothing.
    pub fn new(comm: &Communicator, opts: &Options) -> Reporter {
        if comm.rank() != 0 {
            return Reporter {
                report: None,
                print: false,
            };
        }
        let report = Report {
            preamble: preamble(comm, opts),
            header: if opts.skew {
                skew_header()
            } else {
                header(opts.bench, opts.full)
            },
            rows: Vec::new(),
            notes: Vec::new(),
        };
        if opts.print {
            print_line(&report.preamble);
            print_line(&report.header);
        }
        Reporter {
            report: Some(report),
            print: opts.print,
        }
    }

    /// Adds a row (rank 0 only; ignored elsewhere).
    pub fn row(&mut self, row: Row) {
        if let Some(report) = &mut self.report {
            if self.print {
                print_line(&row.format());
            }
            report.rows.push(row);
        }
    }

    /// Adds a comment line after the rows (rank 0 only; ignored elsewhere).
    pub fn note(&mut self, line: String) {
        if let Some(report) = &mut self.report {
            if self.print {
                print_line(&line);
            }
            report.notes.push(line);
        }
    }

    pub fn finish(self) -> Option<Report> {
        self.report
    }
}

/// Writes a line and flushes, ignoring errors (a closed pipe must not panic the benchmark).
fn print_line(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}
