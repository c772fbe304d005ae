//! Every available benchmark at tiny sizes through the rank body, and the error paths.

use rankweave::Config;

use crate::cli::{self, Bench, Command, Options};
use crate::collective::{median, skew_medians};
use crate::error::BenchError;
use crate::exchange::dissemination_rounds;
use crate::report::{self, Report, Row};
use crate::run;

fn parse(args: &[&str]) -> Result<Command, BenchError> {
    cli::parse(args)
}

fn options(args: &[&str]) -> Options {
    match parse(args) {
        Ok(Command::Run(mut opts)) => {
            opts.print = false;
            opts
        }
        other => panic!("{args:?} should parse to a run, got {other:?}"),
    }
}

fn usage_error(args: &[&str]) -> String {
    match parse(args) {
        Err(e @ BenchError::Usage(_)) => {
            assert_eq!(e.exit_code(), 2);
            e.to_string()
        }
        other => panic!("{args:?} should be a usage error, got {other:?}"),
    }
}

/// Runs the rank body on `n` in-process ranks and returns rank 0's report.
async fn bench(n: usize, args: &[&str]) -> Report {
    bench_with(Config::default(), n, args).await
}

/// [`bench`] with a configuration of its own.
async fn bench_with(config: Config, n: usize, args: &[&str]) -> Report {
    let opts = options(args);
    let results = rankweave::local_with(config, n, move |comm| run(comm, opts.clone()))
        .await
        .expect("the job runs");
    let mut reports = Vec::new();
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(Some(report)) => {
                assert_eq!(rank, 0, "only rank 0 reports");
                reports.push(report);
            }
            Ok(None) => assert_ne!(rank, 0, "rank 0 reports"),
            Err(e) => panic!("rank {rank} failed: {e}"),
        }
    }
    reports.pop().expect("a report")
}

const TINY: [&str; 6] = ["-m", "1:64", "-i", "5", "-x", "1"];

fn tiny(bench: &str) -> Vec<&str> {
    let mut v = vec![bench];
    v.extend_from_slice(&TINY);
    v
}

fn assert_sizes(report: &Report, columns: usize) {
    let sizes: Vec<_> = report.rows.iter().map(|r| r.size).collect();
    let expected: Vec<_> = [1, 2, 4, 8, 16, 32, 64].into_iter().map(Some).collect();
    assert_eq!(sizes, expected, "one row per size:\n{}", report.to_text());
    for row in &report.rows {
        assert_eq!(row.values.len(), columns);
        for v in &row.values {
            assert!(v.is_finite() && *v > 0.0, "{row:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latency_reports_every_size() {
    let report = bench(2, &tiny("latency")).await;
    assert_eq!(report.header, "# Size            Latency (us)");
    assert!(
        report
            .preamble
            .starts_with("# rw-bench latency (OSU MPI Latency Test")
    );
    assert!(report.preamble.contains("2 ranks (in-process)"));
    assert!(report.preamble.contains("progress "));
    assert_sizes(&report, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latency_zero_byte_row_on_request_and_extra_ranks_idle() {
    let report = bench(3, &["latency", "-m", "4", "-i", "3", "-x", "0"]).await;
    let sizes: Vec<_> = report.rows.iter().filter_map(|r| r.size).collect();
    assert_eq!(sizes, [1, 2, 4]);
    let report = bench(3, &["latency", "-m", "0:4", "-i", "3", "-x", "0"]).await;
    let sizes: Vec<_> = report.rows.iter().filter_map(|r| r.size).collect();
    assert_eq!(sizes, [0, 1, 2, 4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bw_reports_every_size() {
    let report = bench(2, &tiny("bw")).await;
    assert_eq!(report.header, "# Size        Bandwidth (MB/s)");
    assert!(report.preamble.contains("window size: 64"));
    assert_sizes(&report, 1);
    // A small window and rendezvous-sized messages too.
    let report = bench(
        2,
        &["bw", "-m", "128k:256k", "-i", "2", "-x", "1", "-W", "4"],
    )
    .await;
    assert_eq!(report.rows.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bibw_reports_every_size() {
    let report = bench(2, &tiny("bibw")).await;
    assert_eq!(report.header, "# Size        Bandwidth (MB/s)");
    assert_sizes(&report, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mr_reports_every_size() {
    let report = bench(2, &tiny("mr")).await;
    assert_eq!(
        report.header,
        "# Size                    MB/s          Messages/s"
    );
    assert!(report.preamble.contains("pairs: 1"));
    assert_sizes(&report, 2);
    // Message rate = bandwidth / size.
    for row in &report.rows {
        let size = row.size.unwrap() as f64;
        let (bw, rate) = (row.values[0], row.values[1]);
        assert!((rate - 1e6 * bw / size).abs() <= 1e-6 * rate);
    }
    // Two pairs.
    let report = bench(4, &tiny("mr")).await;
    assert!(report.preamble.contains("pairs: 2"));
    assert_sizes(&report, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn barrier_reports_one_value() {
    let report = bench(4, &["barrier", "-i", "5", "-x", "1"]).await;
    assert_eq!(report.header, "# Avg Latency(us)");
    assert_eq!(report.rows.len(), 1);
    assert_eq!(report.rows[0].size, None);
    assert_eq!(report.rows[0].values.len(), 1);
    let full = bench(3, &["barrier", "-i", "5", "-x", "1", "-f"]).await;
    assert_eq!(full.rows[0].values.len(), 3);
    assert_eq!(full.rows[0].iterations, Some(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bcast_reports_every_size() {
    let report = bench(4, &tiny("bcast")).await;
    assert_eq!(report.header, "# Size         Avg Latency(us)");
    assert_sizes(&report, 1);
    let mut args = tiny("bcast");
    args.push("-f");
    let full = bench(3, &args).await;
    assert!(
        full.header
            .ends_with("Min Latency(us)     Max Latency(us)  Iterations")
    );
    for row in &full.rows {
        let (avg, min, max) = (row.values[0], row.values[1], row.values[2]);
        assert!(min <= avg && avg <= max, "{row:?}");
    }
}

/// `bcast --skew`: a row per size with the average latency, the median skew and the median
/// last completion; the skew of 2 ranks is 0 (one non-root rank), and last ≥ skew (every
/// completion is after the root's t0, iteration by iteration, so the medians keep the order).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bcast_skew_reports_latency_skew_and_last() {
    let report = bench(4, &["bcast", "--skew", "-m", "8:64", "-i", "5", "-x", "1"]).await;
    assert_eq!(report.header, report::skew_header());
    assert!(report.header.ends_with("Skew(us)            Last(us)"));
    assert!(
        report
            .preamble
            .contains("completion skew over the 3 non-root ranks")
    );
    let sizes: Vec<_> = report.rows.iter().map(|r| r.size).collect();
    assert_eq!(sizes, [8, 16, 32, 64].map(Some), "{}", report.to_text());
    for row in &report.rows {
        let [latency, skew, last] = row.values[..] else {
            panic!("three figures: {row:?}");
        };
        assert!(latency > 0.0 && skew >= 0.0 && last >= skew, "{row:?}");
        assert!(last < 10e6, "a broadcast of 64 bytes took 10 s: {row:?}");
    }
    // No multicast broadcast ran, so no counter line.
    assert!(report.notes.is_empty(), "{:?}", report.notes);
    let report = bench(2, &["bcast", "--skew", "-m", "1k:1k", "-i", "3", "-x", "0"]).await;
    assert_eq!(report.rows.len(), 1);
    assert_eq!(
        report.rows[0].values[1], 0.0,
        "one non-root rank has no skew"
    );
    assert!(report.rows[0].values[2] > 0.0);
}

/// `bcast --skew` over the two-stage multicast broadcast (in-process ranks join a group on
/// loopback too): a sane row, and the counter line says multicast carried the fragments.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bcast_skew_over_multicast_prints_the_counters() {
    let mut config = Config::default();
    config.collectives.bcast = Some(rankweave::core::tuning::BcastAlgorithm::Multicast);
    config.multicast.min_ranks = 2;
    let report = bench_with(
        config,
        3,
        &["bcast", "--skew", "-m", "64k:64k", "-i", "4", "-x", "1"],
    )
    .await;
    assert_eq!(report.rows.len(), 1, "{}", report.to_text());
    let [latency, skew, last] = report.rows[0].values[..] else {
        panic!("three figures: {report:?}");
    };
    assert!(latency > 0.0 && skew >= 0.0 && last >= skew, "{report:?}");
    assert_eq!(report.notes.len(), 1, "{report:?}");
    assert!(
        report.notes[0].starts_with("# multicast counters (sum over 3 ranks"),
        "{:?}",
        report.notes
    );
    assert!(report.notes[0].contains(" fragments multicast"));
}

#[test]
fn skew_is_the_spread_of_the_non_root_completions() {
    // Two iterations, t0 at 0 and 100 µs; ranks 1 and 2 complete at (10, 30) and (150, 120) µs.
    let t0 = [0, 100_000];
    let done = [vec![10_000, 150_000], vec![30_000, 120_000]];
    let (skew, last) = skew_medians(&t0, &done);
    // Skews 20 and 30 µs, last completions 30 and 50 µs after t0: medians of two are means.
    assert_eq!((skew, last), (25.0, 40.0));
    let (skew, last) = skew_medians(&t0[..1], &done[..1]);
    assert_eq!((skew, last), (0.0, 10.0));
    assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
    assert_eq!(median(&mut []), 0.0);
}

/// The sized collectives run at small sizes and print one row per size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sized_collectives_print_a_row_per_size() {
    for name in ["bcast", "reduce", "allreduce", "allgather", "alltoall"] {
        for n in [2, 3] {
            let report = bench(n, &[name, "-m", "1:16", "-i", "3", "-x", "1"]).await;
            let sizes: Vec<_> = report.rows.iter().map(|r| r.size).collect();
            assert_eq!(
                sizes,
                [1, 2, 4, 8, 16].map(Some),
                "{name} on {n} ranks: {report:?}"
            );
            assert!(report.rows.iter().all(|r| r.values[0] > 0.0));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ring_reports_every_size() {
    let report = bench(4, &tiny("ring")).await;
    assert_eq!(report.header, "# Size         Avg Latency(us)");
    assert!(
        report
            .preamble
            .starts_with("# rw-bench ring (Ring Exchange Latency Test, after IMB-MPI1 Sendrecv)")
    );
    assert!(report.preamble.contains("4 ranks (in-process)"));
    assert_sizes(&report, 1);
    // Two ranks (left and right neighbour are the same rank), an odd ring, and -f.
    let report = bench(2, &tiny("ring")).await;
    assert_sizes(&report, 1);
    let mut args = tiny("ring");
    args.push("-f");
    let full = bench(3, &args).await;
    assert_sizes(&full, 3);
    for row in &full.rows {
        let (avg, min, max) = (row.values[0], row.values[1], row.values[2]);
        assert!(min <= avg && avg <= max, "{row:?}");
        assert_eq!(row.iterations, Some(5));
    }
    // Rendezvous-sized messages too.
    let report = bench(3, &["ring", "-m", "128k:256k", "-i", "2", "-x", "1"]).await;
    assert_eq!(report.rows.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2pbarrier_reports_one_value() {
    for n in [2, 3, 4, 5, 8] {
        let report = bench(n, &["p2pbarrier", "-i", "5", "-x", "1"]).await;
        assert_eq!(report.header, "# Avg Latency(us)");
        assert!(report.preamble.starts_with(
            "# rw-bench p2pbarrier (Point-to-Point Dissemination Barrier Latency Test"
        ));
        assert!(report.preamble.contains("iterations 5 / warm-up 1"));
        assert_eq!(report.rows.len(), 1, "{n} ranks");
        assert_eq!(report.rows[0].size, None);
        assert_eq!(report.rows[0].values.len(), 1);
        assert!(report.rows[0].values[0] > 0.0);
    }
    let full = bench(3, &["p2pbarrier", "-i", "5", "-x", "0", "-f"]).await;
    assert_eq!(full.rows[0].values.len(), 3);
    assert_eq!(full.rows[0].iterations, Some(5));
}

/// Round k pairs rank r with r + 2^k and r - 2^k, on its own tag, for ⌈log2 N⌉ rounds; what a
/// rank sends in a round is what its target receives from it in that round.
#[test]
fn dissemination_rounds_pair_up() {
    assert!(dissemination_rounds(0, 1).is_empty());
    assert_eq!(dissemination_rounds(0, 2), [(1, 1, 300)]);
    assert_eq!(dissemination_rounds(0, 4), [(1, 3, 300), (2, 2, 301)]);
    assert_eq!(
        dissemination_rounds(1, 5),
        [(2, 0, 300), (3, 4, 301), (0, 2, 302)]
    );
    for n in 1usize..=17 {
        let expected_rounds = (usize::BITS - (n - 1).leading_zeros()) as usize;
        for r in 0..n {
            let rounds = dissemination_rounds(r, n);
            assert_eq!(rounds.len(), expected_rounds, "n = {n}");
            for (k, &(to, _, tag)) in rounds.iter().enumerate() {
                assert_eq!(tag, 300 + k as u32);
                assert_eq!(dissemination_rounds(to, n)[k].1, r, "n = {n}, round {k}");
            }
        }
    }
}

#[test]
fn unknown_subcommands_and_bad_flags_are_usage_errors() {
    assert!(usage_error(&["pingpong"]).contains("unknown benchmark `pingpong`"));
    assert!(usage_error(&[]).contains("no benchmark given"));
    assert!(usage_error(&["latency", "bw"]).contains("unexpected argument `bw`"));
    assert!(usage_error(&["latency", "--bogus"]).contains("unknown option `--bogus`"));
    assert!(usage_error(&["latency", "-q"]).contains("unknown option `-q`"));
    assert!(usage_error(&["latency", "-m"]).contains("-m needs a value"));
    assert!(usage_error(&["latency", "-m", "64:1"]).contains("larger than the maximum"));
    assert!(usage_error(&["latency", "-m", "abc"]).contains("is not a message size"));
    assert!(usage_error(&["latency", "-m", "1:2:3"]).contains("more than one"));
    assert!(usage_error(&["latency", "-m", "2g"]).contains("larger than the limit"));
    assert!(usage_error(&["bw", "-m", "0:8"]).contains("must be at least 1"));
    assert!(usage_error(&["latency", "-i", "0"]).contains("at least 1"));
    assert!(usage_error(&["latency", "-i", "-5"]).contains("not a non-negative whole number"));
    assert!(usage_error(&["latency", "-x", "many"]).contains("not a non-negative whole number"));
    assert!(usage_error(&["latency", "-W", "8"]).contains("-W does not apply"));
    assert!(usage_error(&["bw", "-W", "0"]).contains("between 1 and 4096"));
    assert!(usage_error(&["mr", "-W", "4097"]).contains("between 1 and 4096"));
    assert!(usage_error(&["latency", "-f"]).contains("-f does not apply"));
    assert!(usage_error(&["barrier", "-m", "8"]).contains("-m does not apply"));
    assert!(usage_error(&["p2pbarrier", "-m", "8"]).contains("-m does not apply"));
    assert!(usage_error(&["ring", "-m", "0:8"]).contains("must be at least 1"));
    assert!(usage_error(&["ring", "-W", "8"]).contains("-W does not apply"));
    assert!(usage_error(&["ring", "--ranks", "1"]).contains("its right neighbour"));
    assert!(usage_error(&["p2pbarrier", "--ranks", "1"]).contains("needs at least 2 ranks"));
    assert!(usage_error(&["latency", "--ranks", "1"]).contains("needs at least 2 ranks"));
    assert!(usage_error(&["bcast", "--ranks", "0"]).contains("out of range"));
    assert!(usage_error(&["latency", "--ranks"]).contains("--ranks needs a value"));
    assert!(usage_error(&["latency", "--help=yes"]).contains("takes no value"));
    assert!(usage_error(&["-é"]).contains("unknown option"));
    assert!(usage_error(&["latency", "--skew"]).contains("--skew does not apply to `latency`"));
    assert!(usage_error(&["barrier", "--skew"]).contains("only bcast"));
    assert!(usage_error(&["bcast", "--skew", "-f"]).contains("do not combine"));
    assert!(usage_error(&["bcast", "--skew=yes"]).contains("takes no value"));
}

#[test]
fn flags_parse_like_osu() {
    let o = options(&["bw", "-m", "1:64"]);
    assert_eq!((o.min_size, o.max_size), (1, 64));
    let o = options(&["bw", "-m128"]);
    assert_eq!((o.min_size, o.max_size), (1, 128));
    let o = options(&["latency", "-m", "16:"]);
    assert_eq!((o.min_size, o.max_size), (16, 4 << 20));
    let o = options(&["latency", "--message-size=:1k"]);
    assert_eq!((o.min_size, o.max_size), (1, 1024));
    let o = options(&["latency", "-m", "0:8"]);
    assert_eq!(o.sizes(), [0, 1, 2, 4, 8]);
    let o = options(&["bcast", "-i", "7", "-x", "3", "--ranks", "5", "-f"]);
    assert_eq!((o.iterations, o.iterations_large), (7, 7));
    assert_eq!((o.warmup, o.warmup_large), (3, 3));
    assert_eq!(o.ranks, Some(5));
    assert!(o.full);
    let o = options(&["mr", "-W", "16"]);
    assert_eq!(o.window, 16);
    assert_eq!(parse(&["--help"]).unwrap(), Command::Help);
    assert_eq!(parse(&["bw", "-h"]).unwrap(), Command::Help);
    assert_eq!(parse(&["help"]).unwrap(), Command::Help);
    assert_eq!(options(&["allreduce"]).bench, Bench::Allreduce);
    assert_eq!(options(&["ring"]).bench, Bench::Ring);
    assert_eq!(options(&["p2pbarrier", "-f"]).bench, Bench::P2pBarrier);
    let o = options(&["ring", "-m", "8:8"]);
    assert_eq!(o.sizes(), [8]);
    let o = options(&["bcast", "--skew", "-m", "8:8"]);
    assert!(o.skew && !o.full);
    assert!(!options(&["bcast"]).skew);
}

#[test]
fn osu_7_defaults() {
    let o = options(&["latency"]);
    assert_eq!((o.min_size, o.max_size), (1, 4 << 20));
    assert_eq!(o.loops(8192), (10_000, 100));
    assert_eq!(o.loops(8193), (1_000, 10));
    let o = options(&["bw"]);
    assert_eq!((o.min_size, o.max_size, o.window), (1, 4 << 20, 64));
    assert_eq!(o.loops(1), (100, 10));
    assert_eq!(o.loops(1 << 20), (20, 2));
    let o = options(&["mr"]);
    assert_eq!(o.loops(1 << 20), (100, 10));
    let o = options(&["bcast"]);
    assert_eq!((o.min_size, o.max_size), (1, 1 << 20));
    assert_eq!(o.loops(1), (1_000, 100));
    assert_eq!(o.loops(1 << 20), (100, 10));
    assert_eq!(options(&["latency"]).sizes().len(), 23);
    assert_eq!(options(&["bw"]).sizes().len(), 23);
    assert_eq!(options(&["bcast"]).sizes().len(), 21);
    // ring and p2pbarrier take the collectives' defaults.
    let o = options(&["ring"]);
    assert_eq!((o.min_size, o.max_size), (1, 1 << 20));
    assert_eq!(o.loops(8), (1_000, 100));
    assert_eq!(o.loops(1 << 20), (100, 10));
    let o = options(&["p2pbarrier"]);
    assert_eq!((o.iterations, o.warmup), (1_000, 100));
    assert_eq!(
        report::header(Bench::P2pBarrier, false),
        report::header(Bench::Barrier, false)
    );
}

#[test]
fn rows_use_osu_column_widths() {
    let row = Row {
        size: Some(1024),
        values: vec![1.234],
        iterations: None,
    };
    assert_eq!(row.format(), format!("{:<10}{:>20}", 1024, "1.23"));
    let barrier = Row {
        size: None,
        values: vec![2.5],
        iterations: None,
    };
    assert_eq!(barrier.format(), format!("{:>17}", "2.50"));
    let full = Row {
        size: Some(1),
        values: vec![1.0, 0.5, 2.0],
        iterations: Some(100),
    };
    assert_eq!(
        full.format(),
        format!(
            "{:<10}{:>20}{:>20}{:>20}{:>12}",
            1, "1.00", "0.50", "2.00", 100
        )
    );
    assert_eq!(
        report::header(Bench::Barrier, true),
        format!(
            "# Avg Latency(us){:>20}{:>20}{:>12}",
            "Min Latency(us)", "Max Latency(us)", "Iterations"
        )
    );
}

#[test]
fn exit_codes() {
    assert_eq!(BenchError::Usage("x".into()).exit_code(), 2);
    assert_eq!(BenchError::Verify("x".into()).exit_code(), 1);
    assert_eq!(BenchError::Comm(rankweave::Error::Shutdown).exit_code(), 1);
}

#[test]
fn send_buffers_start_on_a_page_as_osus_do() {
    for len in [0, 1, 4095, 65536] {
        let b = crate::pt2pt::send_buffer(len, b'a');
        assert_eq!(b.len(), len);
        assert_eq!(b.as_ptr() as usize % 4096, 0, "{len} bytes");
        assert!(b.iter().all(|&x| x == b'a'));
    }
}
