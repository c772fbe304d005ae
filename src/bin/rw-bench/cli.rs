//! rw-bench's command line, parsed by hand: a subcommand naming the benchmark and OSU's flags.

use crate::error::BenchError;

/// Ranks of an in-process run when `--ranks` is not given.
pub const DEFAULT_RANKS: usize = 2;
/// Upper bound of `--ranks` (in-process ranks are tokio tasks; this only stops absurd values).
pub const MAX_RANKS: usize = 1 << 16;
/// Messages larger than this many bytes use the "large" iteration and warm-up counts (OSU's
/// `LARGE_MESSAGE_SIZE`; the test is `size > 8192`).
pub const LARGE_MESSAGE_SIZE: usize = 8192;
/// Largest accepted `-m` maximum (each rank allocates one payload of this size).
pub const MAX_SIZE_LIMIT: usize = 1 << 30;
/// OSU's default window (`WINDOW_SIZE_LARGE`) for bw, bibw and mr.
pub const DEFAULT_WINDOW: usize = 64;
/// Largest accepted `-W` (the C baselines' bound too).
pub const MAX_WINDOW: usize = 4096;

/// The benchmarks, one per subcommand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bench {
    Latency,
    Bw,
    Bibw,
    Mr,
    Barrier,
    Bcast,
    Reduce,
    Allreduce,
    Allgather,
    Alltoall,
    Ring,
    P2pBarrier,
}

/// Point-to-point (ranks 0 and 1, or pairs) or collective (every rank; `ring` and `p2pbarrier`
/// too: every rank takes part, though only through sends and receives).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Pt2pt,
    Collective,
}

/// OSU 7.x defaults of one benchmark (osu_util.h / osu_util.c `process_options`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Defaults {
    pub min_size: usize,
    pub max_size: usize,
    pub iterations: usize,
    pub iterations_large: usize,
    pub warmup: usize,
    pub warmup_large: usize,
}

impl Bench {
    pub const ALL: [Bench; 12] = [
        Bench::Latency,
        Bench::Bw,
        Bench::Bibw,
        Bench::Mr,
        Bench::Barrier,
        Bench::Bcast,
        Bench::Reduce,
        Bench::Allreduce,
        Bench::Allgather,
        Bench::Alltoall,
        Bench::Ring,
        Bench::P2pBarrier,
    ];

    /// The subcommand.
    pub fn name(self) -> &'static str {
        match self {
            Bench::Latency => "latency",
            Bench::Bw => "bw",
            Bench::Bibw => "bibw",
            Bench::Mr => "mr",
            Bench::Barrier => "barrier",
            Bench::Bcast => "bcast",
            Bench::Reduce => "reduce",
            Bench::Allreduce => "allreduce",
            Bench::Allgather => "allgather",
            Bench::Alltoall => "alltoall",
            Bench::Ring => "ring",
            Bench::P2pBarrier => "p2pbarrier",
        }
    }

    pub fn from_name(name: &str) -> Option<Bench> {
        Bench::ALL.into_iter().find(|b| b.name() == name)
    }

    /// What the benchmark follows: the OSU 7.x program it reproduces, or for the two that OSU
    /// does not have, the pattern (their C baselines are `bench/c/rw_ring.c` and
    /// `bench/c/rw_p2pbarrier.c`).
    pub fn origin(self) -> &'static str {
        match self {
            Bench::Latency => "osu_latency 7.x",
            Bench::Bw => "osu_bw 7.x",
            Bench::Bibw => "osu_bibw 7.x",
            Bench::Mr => "osu_mbw_mr 7.x",
            Bench::Barrier => "osu_barrier 7.x",
            Bench::Bcast => "osu_bcast 7.x",
            Bench::Reduce => "osu_reduce 7.x",
            Bench::Allreduce => "osu_allreduce 7.x",
            Bench::Allgather => "osu_allgather 7.x",
            Bench::Alltoall => "osu_alltoall 7.x",
            Bench::Ring => "after IMB-MPI1 Sendrecv",
            Bench::P2pBarrier => "rounds of sends and receives",
        }
    }

    /// The title line (OSU's for the OSU programs; without the `# ` and version).
    pub fn title(self) -> &'static str {
        match self {
            Bench::Latency => "OSU MPI Latency Test",
            Bench::Bw => "OSU MPI Bandwidth Test",
            Bench::Bibw => "OSU MPI Bi-Directional Bandwidth Test",
            Bench::Mr => "OSU MPI Multiple Bandwidth / Message Rate Test",
            Bench::Barrier => "OSU MPI Barrier Latency Test",
            Bench::Bcast => "OSU MPI Broadcast Latency Test",
            Bench::Reduce => "OSU MPI Reduce Latency Test",
            Bench::Allreduce => "OSU MPI Allreduce Latency Test",
            Bench::Allgather => "OSU MPI Allgather Latency Test",
            Bench::Alltoall => "OSU MPI All-to-All Personalized Exchange Latency Test",
            Bench::Ring => "Ring Exchange Latency Test",
            Bench::P2pBarrier => "Point-to-Point Dissemination Barrier Latency Test",
        }
    }

    pub fn kind(self) -> Kind {
        match self {
            Bench::Latency | Bench::Bw | Bench::Bibw | Bench::Mr => Kind::Pt2pt,
            _ => Kind::Collective,
        }
    }

    /// Whether `-W` applies.
    pub fn windowed(self) -> bool {
        matches!(self, Bench::Bw | Bench::Bibw | Bench::Mr)
    }

    /// Whether the benchmark has message sizes (`-m`); barrier and p2pbarrier do not.
    pub fn sized(self) -> bool {
        !matches!(self, Bench::Barrier | Bench::P2pBarrier)
    }

    /// OSU 7.x defaults: `LAT_*` for osu_latency, `BW_*` for osu_bw / osu_bibw / osu_mbw_mr
    /// (osu_mbw_mr has no large-message switch), `COLL_*` for the collectives;
    /// `MAX_MESSAGE_SIZE` (4 MiB) for point-to-point, `MAX_MSG_SIZE_COLL` (1 MiB) for
    /// collectives (ring and p2pbarrier take the collectives' defaults). Sizes start at 1:
    /// osu_latency's minimum is 0, but OSU 7.x skips a size that holds no element, so its first
    /// row is 1 byte too. `latency -m 0:N` adds a 0-byte row (an extension, as in the C
    /// baselines of `bench/c`).
    pub fn defaults(self) -> Defaults {
        const MIB: usize = 1 << 20;
        match self {
            Bench::Latency => Defaults {
                min_size: 1,
                max_size: 4 * MIB,
                iterations: 10_000,
                iterations_large: 1_000,
                warmup: 100,
                warmup_large: 10,
            },
            Bench::Bw | Bench::Bibw => Defaults {
                min_size: 1,
                max_size: 4 * MIB,
                iterations: 100,
                iterations_large: 20,
                warmup: 10,
                warmup_large: 2,
            },
            Bench::Mr => Defaults {
                min_size: 1,
                max_size: 4 * MIB,
                iterations: 100,
                iterations_large: 100,
                warmup: 10,
                warmup_large: 10,
            },
            _ => Defaults {
                min_size: 1,
                max_size: MIB,
                iterations: 1_000,
                iterations_large: 100,
                warmup: 100,
                warmup_large: 10,
            },
        }
    }
}

/// Everything a benchmark run needs to know, identical on every rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    pub bench: Bench,
    /// `--ranks N` when given (in-process runs only).
    pub ranks: Option<usize>,
    pub min_size: usize,
    pub max_size: usize,
    pub iterations: usize,
    pub iterations_large: usize,
    pub warmup: usize,
    pub warmup_large: usize,
    pub window: usize,
    /// `-f`: collectives also print min / max latency and the iteration count.
    pub full: bool,
    /// `--skew` (bcast only): per iteration a barrier, then the broadcast; every rank records
    /// its completion instant and rank 0 also reports the median per-rank completion skew and
    /// the median time to the last rank's completion.
    pub skew: bool,
    /// `--stats`: every rank prints its traffic counters (`Communicator::stats`) to standard
    /// error when the benchmark ends: retransmissions, drops, per-route traffic.
    pub stats: bool,
    /// Whether rank 0 prints as it goes (the binary does; tests do not).
    pub print: bool,
    /// How the ranks were started, for the first output line ("in-process", ...).
    pub launch: String,
}

impl Options {
    /// The defaults of `bench`.
    pub fn new(bench: Bench) -> Options {
        let d = bench.defaults();
        Options {
            bench,
            ranks: None,
            min_size: d.min_size,
            max_size: d.max_size,
            iterations: d.iterations,
            iterations_large: d.iterations_large,
            warmup: d.warmup,
            warmup_large: d.warmup_large,
            window: DEFAULT_WINDOW,
            full: false,
            skew: false,
            stats: false,
            print: true,
            launch: "in-process".into(),
        }
    }

    /// The message sizes, as OSU walks them: from the minimum, doubling (0 is followed by 1).
    pub fn sizes(&self) -> Vec<usize> {
        let mut sizes = Vec::new();
        let mut size = self.min_size;
        while size <= self.max_size {
            sizes.push(size);
            size = match size {
                0 => 1,
                s => match s.checked_mul(2) {
                    Some(next) => next,
                    None => break,
                },
            };
        }
        sizes
    }

    /// (iterations, warm-up iterations) for messages of `size` bytes.
    pub fn loops(&self, size: usize) -> (usize, usize) {
        if size > LARGE_MESSAGE_SIZE {
            (self.iterations_large, self.warmup_large)
        } else {
            (self.iterations, self.warmup)
        }
    }
}

/// What the command line asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    Help,
    Run(Options),
}

fn usage(msg: impl Into<String>) -> BenchError {
    BenchError::Usage(msg.into())
}

/// Parses the arguments after the program name.
pub fn parse<S: AsRef<str>>(args: &[S]) -> Result<Command, BenchError> {
    let args: Vec<&str> = args.iter().map(|a| a.as_ref()).collect();
    let mut bench: Option<Bench> = None;
    let mut sizes: Option<(Option<usize>, Option<usize>)> = None;
    let mut iterations = None;
    let mut warmup = None;
    let mut window = None;
    let mut ranks = None;
    let mut full = false;
    let mut skew = false;
    let mut stats = false;
    let mut help = false;

    let mut i = 0;
    while i < args.len() {
        let arg = args[i];
        i += 1;
        // A flag that takes a value: `-m 1:64`, `-m1:64`, `--message-size 1:64` or
        // `--message-size=1:64`.
        let mut value_for = |flag: &str, attached: Option<&str>| -> Result<String, BenchError> {
            if let Some(v) = attached {
                return Ok(v.to_string());
            }
            match args.get(i) {
                Some(v) => {
                    i += 1;
                    Ok(v.to_string())
                }
                None => Err(usage(format!("{flag} needs a value"))),
            }
        };
        let (name, attached): (&str, Option<&str>) = if let Some(long) = arg.strip_prefix("--") {
            match long.split_once('=') {
                Some((n, v)) => (n, Some(v)),
                None => (long, None),
            }
        } else if let Some(short) = arg.strip_prefix('-').filter(|s| !s.is_empty()) {
            // One character names the flag; the rest, if any, is its value (`-m1:64`).
            let split = short.chars().next().map_or(0, char::len_utf8);
            let (flag, rest) = short.split_at(split);
            (flag, if rest.is_empty() { None } else { Some(rest) })
        } else {
            if arg == "help" && bench.is_none() {
                help = true;
                continue;
            }
            match (bench, Bench::from_name(arg)) {
                (None, Some(b)) => bench = Some(b),
                (None, None) => {
                    return Err(usage(format!(
                        "unknown benchmark `{arg}` (expected one of: {})",
                        names()
                    )));
                }
                (Some(b), _) => {
                    return Err(usage(format!(
                        "unexpected argument `{arg}` after benchmark `{}`",
                        b.name()
                    )));
                }
            }
            continue;
        };
        match name {
            "h" | "help" => {
                no_value(arg, attached)?;
                help = true;
            }
            "f" | "full" => {
                no_value(arg, attached)?;
                full = true;
            }
            "skew" => {
                no_value(arg, attached)?;
                skew = true;
            }
            "stats" => {
                no_value(arg, attached)?;
                stats = true;
            }
            "m" | "message-size" => {
                let v = value_for(arg, attached)?;
                sizes = Some(parse_sizes(&v)?);
            }
            "i" | "iterations" => {
                let v = value_for(arg, attached)?;
                let n = parse_count("-i", &v)?;
                if n < 1 {
                    return Err(usage("-i: the number of iterations must be at least 1"));
                }
                iterations = Some(n);
            }
            "x" | "warmup" => {
                let v = value_for(arg, attached)?;
                warmup = Some(parse_count("-x", &v)?);
            }
            "W" | "window-size" => {
                let v = value_for(arg, attached)?;
                let n = parse_count("-W", &v)?;
                if !(1..=MAX_WINDOW).contains(&n) {
                    return Err(usage(format!(
                        "-W: the window size must be between 1 and {MAX_WINDOW}"
                    )));
                }
                window = Some(n);
            }
            "ranks" => {
                let v = value_for("--ranks", attached)?;
                let n = parse_count("--ranks", &v)?;
                if !(1..=MAX_RANKS).contains(&n) {
                    return Err(usage(format!(
                        "--ranks: {n} is out of range (1 to {MAX_RANKS})"
                    )));
                }
                ranks = Some(n);
            }
            _ => return Err(usage(format!("unknown option `{arg}`"))),
        }
    }

    if help {
        return Ok(Command::Help);
    }
    let Some(bench) = bench else {
        return Err(usage(format!(
            "no benchmark given (expected one of: {})",
            names()
        )));
    };
    let mut opts = Options::new(bench);
    if let Some((min, max)) = sizes {
        if !bench.sized() {
            return Err(usage(format!(
                "-m does not apply to `{}`: it has no message size",
                bench.name()
            )));
        }
        if let Some(min) = min {
            opts.min_size = min;
        }
        if let Some(max) = max {
            opts.max_size = max;
        }
        if opts.max_size > MAX_SIZE_LIMIT {
            return Err(usage(format!(
                "-m: the maximum message size {} is larger than the limit {MAX_SIZE_LIMIT}",
                opts.max_size
            )));
        }
        if opts.min_size > opts.max_size {
            return Err(usage(format!(
                "-m: the minimum message size {} is larger than the maximum {}",
                opts.min_size, opts.max_size
            )));
        }
        if opts.min_size == 0 && bench != Bench::Latency {
            return Err(usage(format!(
                "-m: the minimum message size of `{}` must be at least 1",
                bench.name()
            )));
        }
    }
    // As in OSU, -i and -x set the small- and the large-message counts alike.
    if let Some(n) = iterations {
        opts.iterations = n;
        opts.iterations_large = n;
    }
    if let Some(n) = warmup {
        opts.warmup = n;
        opts.warmup_large = n;
    }
    if let Some(w) = window {
        if !bench.windowed() {
            return Err(usage(format!(
                "-W does not apply to `{}` (only bw, bibw and mr have a window)",
                bench.name()
            )));
        }
        opts.window = w;
    }
    if full && bench.kind() != Kind::Collective {
        return Err(usage(format!(
            "-f does not apply to `{}` (only the collective benchmarks have min/max columns)",
            bench.name()
        )));
    }
    opts.full = full;
    if skew {
        if bench != Bench::Bcast {
            return Err(usage(format!(
                "--skew does not apply to `{}` (only bcast measures completion skew)",
                bench.name()
            )));
        }
        if full {
            return Err(usage(
                "--skew and -f do not combine (--skew prints its own columns)",
            ));
        }
    }
    opts.skew = skew;
    opts.stats = stats;
    if let Some(n) = ranks {
        check_ranks(bench, n)?;
    }
    opts.ranks = ranks;
    Ok(Command::Run(opts))
}

/// Rank-count requirement shared by `--ranks` and launched jobs: every benchmark needs two ranks
/// (OSU's "This test requires at least two processes").
pub fn check_ranks(bench: Bench, n: usize) -> Result<(), BenchError> {
    if n < 2 {
        let what = match bench.kind() {
            Kind::Pt2pt if bench == Bench::Mr => "it runs between pairs of ranks",
            Kind::Pt2pt => "it runs between ranks 0 and 1",
            Kind::Collective if bench == Bench::Ring => "every rank sends to its right neighbour",
            Kind::Collective if bench == Bench::P2pBarrier => {
                "every rank exchanges messages with others"
            }
            Kind::Collective => "a collective needs more than one rank",
        };
        return Err(usage(format!(
            "`{}` needs at least 2 ranks ({what}); got {n}",
            bench.name()
        )));
    }
    Ok(())
}

fn names() -> String {
    Bench::ALL
        .iter()
        .map(|b| b.name())
        .collect::<Vec<_>>()
        .join(", ")
}

fn no_value(arg: &str, attached: Option<&str>) -> Result<(), BenchError> {
    match attached {
        Some(v) => Err(usage(format!("{arg} takes no value (got `{v}`)"))),
        None => Ok(()),
    }
}

/// A non-negative decimal integer.
fn parse_count(flag: &str, v: &str) -> Result<usize, BenchError> {
    let t = v.trim();
    if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
        return Err(usage(format!(
            "{flag}: `{v}` is not a non-negative whole number"
        )));
    }
    t.parse()
        .map_err(|_| usage(format!("{flag}: `{v}` is too large")))
}

/// A byte count: a whole number, optionally with a binary suffix k/K, m/M or g/G.
fn parse_size(v: &str) -> Result<usize, BenchError> {
    let t = v.trim();
    let (digits, mult) = match t.as_bytes().last() {
        Some(b'k' | b'K') => (&t[..t.len() - 1], 1usize << 10),
        Some(b'm' | b'M') => (&t[..t.len() - 1], 1 << 20),
        Some(b'g' | b'G') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    let n = parse_count("-m", digits).map_err(|_| {
        usage(format!(
            "-m: `{v}` is not a message size (a whole number of bytes, optionally with k, m or g)"
        ))
    })?;
    n.checked_mul(mult)
        .ok_or_else(|| usage(format!("-m: `{v}` is too large")))
}

/// OSU's `-m` forms: `MAX`, `MIN:MAX`, `MIN:` and `:MAX`.
fn parse_sizes(v: &str) -> Result<(Option<usize>, Option<usize>), BenchError> {
    match v.split_once(':') {
        None => Ok((None, Some(parse_size(v)?))),
        Some((a, b)) => {
            if b.contains(':') {
                return Err(usage(format!(
                    "-m: `{v}` is not MIN:MAX (more than one `:`)"
                )));
            }
            let min = if a.is_empty() {
                None
            } else {
                Some(parse_size(a)?)
            };
            let max = if b.is_empty() {
                None
            } else {
                Some(parse_size(b)?)
            };
            if min.is_none() && max.is_none() {
                return Err(usage("-m: `:` gives neither a minimum nor a maximum"));
            }
            Ok((min, max))
        }
    }
}

pub const HELP: &str = "\
rw-bench: OSU-style micro-benchmarks over rankweave

USAGE:
    rw-bench <BENCHMARK> [OPTIONS]
    rw-bench --help

BENCHMARKS (each follows the OSU 7.x program or the pattern in brackets):
    latency    ping-pong between ranks 0 and 1; one-way latency = round trip / 2  [osu_latency]
    bw         rank 0 sends a window of non-blocking sends to rank 1, which answers
               each window with a 4-byte ack; bandwidth in MB/s (10^6 B/s)        [osu_bw]
    bibw       both ranks send a window to each other at once                     [osu_bibw]
    mr         multiple bandwidth and message rate: ranks 0..N/2-1 send windows to
               ranks N/2..N-1 (one pair with 2 ranks)                             [osu_mbw_mr]
    barrier    barrier latency                                                    [osu_barrier]
    bcast      broadcast latency from rank 0                                      [osu_bcast]
    reduce     reduce (sum of one-byte elements) to rank 0                        [osu_reduce]
    allreduce  allreduce (sum of one-byte elements)                               [osu_allreduce]
    allgather  every rank contributes SIZE bytes and gets SIZE from each          [osu_allgather]
    alltoall   every rank sends SIZE bytes to each rank                           [osu_alltoall]
    ring       every rank sends SIZE bytes to its right neighbour (rank + 1 mod N)
               and receives from its left one, both started at once; time per
               exchange                                                           [IMB-MPI1 Sendrecv]
    p2pbarrier a dissemination barrier of sends and receives: in round k every
               rank sends 0 bytes to rank + 2^k and receives from rank - 2^k
               (mod N; tag 300 + k) while 2^k < N; time per barrier               [no OSU program]

OPTIONS (OSU's, where they apply):
    -m, --message-size SIZES   MAX, MIN:MAX, MIN: or :MAX in bytes (k, m, g suffixes
                               accepted). Sizes double from MIN up to MAX.
                               Defaults: latency, bw, bibw, mr 1:4M; collectives
                               and ring 1:1M. Only latency accepts a minimum of 0 (a
                               0-byte row, which OSU 7.x itself skips). Not for
                               barrier and p2pbarrier.
    -i, --iterations N         timed iterations per size (sets the small- and the
                               large-message count alike, as OSU does)
    -x, --warmup N             untimed warm-up iterations per size (likewise)
    -W, --window-size N        messages per window for bw, bibw and mr (default 64,
                               at most 4096)
    -f, --full                 collectives, ring and p2pbarrier: also print min and
                               max latency over the ranks and the iteration count
    --skew                     bcast only: per iteration a barrier, then rank 0 takes
                               t0 (CLOCK_MONOTONIC) and broadcasts, and every rank
                               records the instant its broadcast completed (one clock:
                               every rank is on this host). Columns: Avg Latency(us)
                               as without --skew, Skew(us) = median over iterations of
                               max - min completion over the non-root ranks (0 on 2
                               ranks), Last(us) = median of the last non-root
                               completion - t0. Instants are gathered after the
                               iterations, untimed. C baseline: rw_bcast_skew
    --stats                    every rank prints its traffic counters (messages, bytes,
                               retransmissions, drops, per-route traffic) to standard
                               error at the end
    --ranks N                  in-process runs only: number of ranks (default 2; every
                               benchmark needs at least 2; latency, bw and bibw use
                               ranks 0 and 1 while the others only join the barriers)
    -h, --help                 print this help

DEFAULT ITERATIONS / WARM-UP (OSU 7.x; \"large\" means more than 8192 bytes):
    latency              10000 / 100, large 1000 / 10
    bw, bibw             100 / 10,    large 20 / 2
    mr                   100 / 10     (all sizes, as osu_mbw_mr)
    barrier, p2pbarrier  1000 / 100
    bcast and others     1000 / 100,  large 100 / 10   (ring too)

OUTPUT:
    Only rank 0 prints. The first line is a comment naming the benchmark and the
    configuration (ranks, launch, progress policy, window); the second is OSU's
    column header; then one row per message size with two decimals, in OSU's
    column widths (size left-aligned in 10 columns, values right-aligned in 20),
    so rows line up with the OSU micro-benchmarks' output.

RUNNING:
    Without a launcher, rw-bench runs its ranks in this process (tokio tasks over
    the in-process transport; --ranks N). Under rwrun, mpiexec.mpich or
    mpirun.openmpi each process is one rank, on a current-thread runtime.

ENVIRONMENT:
    RANKWEAVE_PROGRESS (spin | spin-then-park | park), RANKWEAVE_SPIN_US,
    RANKWEAVE_SPIN_YIELD, RANKWEAVE_EAGER_LIMIT, RANKWEAVE_UNEXPECTED_LIMIT,
    RANKWEAVE_MAX_FRAME, RANKWEAVE_TRANSPORT and the collectives' choices such as
    RANKWEAVE_BCAST (binomial | multicast | channels | ...) and
    RANKWEAVE_MCAST_MIN_RANKS are read as by any rankweave program
    (Config::from_env). With RANKWEAVE_BCAST=multicast or channels, bcast --skew
    ends with a comment line of the multicast counters summed over the ranks.

EXIT STATUS:
    0 success; 1 a run-time failure; 2 a bad command line or a bad RANKWEAVE_* value.
";
