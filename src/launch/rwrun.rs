//! `rwrun`: starts an N-process job on this host, like `mpirun`.
//!
//! ```text
//! rwrun -n N [--transport auto|udp|shm] [--routes ADDRS] [--chaos SPEC] [--peer-timeout SECS]
//!       [--timeout SECS] [--grace SECS] [--tag-output | --no-tag-output] [--] PROGRAM [ARGS...]
//! ```
//!
//! The `rwrun` binary is a thin shell around this module: [`parse_args`] turns the command line
//! into an [`Invocation`], [`run`] supervises the job and returns an [`ExitOutcome`] whose
//! [`exit_code`](ExitOutcome::exit_code) the process exits with.
//!
//! # What the supervisor does
//!
//! * Serves the job's rendezvous key-value service ([`KvServer`]) on
//!   `127.0.0.1` for the job's life and draws a random 64-bit job key.
//! * Starts N processes of PROGRAM, each in a process group of its own, with the
//!   [environment contract](#environment-contract) below. Rank 0's standard input is fed from
//!   rwrun's (unless rwrun's is a terminal it does not own); the other ranks read `/dev/null`.
//! * Copies every line the ranks write to their standard output and error to rwrun's, prefixed
//!   with the rank (`[2] hello`), or untagged with `--no-tag-output`. Lines are written whole, so
//!   lines of different ranks never interleave; a last line without a newline is completed;
//!   bytes need not be UTF-8. Lines over [`MAX_LINE`] bytes are written in pieces.
//! * Forwards SIGINT and SIGTERM to every running rank's process group; ranks still running
//!   after the grace period are killed (SIGKILL). A second SIGINT or SIGTERM kills at once.
//!   SIGUSR1 and SIGUSR2 are forwarded as they are and end nothing (as Open MPI's `mpirun`
//!   does; `rw-bench` prints each rank's counters on SIGUSR1).
//! * Ends the job when a rank fails (exits non-zero or is killed by a signal): names it, the
//!   first failure, on standard error, gives the others the grace period to exit on their own
//!   (they typically report `PeerFailed`), then kills the rest.
//! * With `--timeout`, ends the job when the wall-clock limit passes (SIGTERM, then SIGKILL
//!   after the grace period).
//!
//! # Exit status
//!
//! | situation | status |
//! |---|---|
//! | every rank exited 0 | 0 |
//! | the first rank to fail exited with status `s` | `s` |
//! | the first rank to fail was killed by signal `k` | 128 + `k` |
//! | rwrun received SIGINT / SIGTERM | 130 / 143 |
//! | `--timeout` passed | 124 ([`EXIT_TIMEOUT`]) |
//! | bad arguments, PROGRAM not found or not executable | 2 ([`EXIT_USAGE`]) |
//! | rwrun itself failed (rendezvous service, spawning) | 1 |
//!
//! Whichever of failure, signal or timeout comes first decides the status.
//!
//! # Environment contract
//!
//! Every rank's environment is rwrun's, plus:
//!
//! | variable | value |
//! |---|---|
//! | [`LAUNCHER_VAR`] `RANKWEAVE_LAUNCHER` | `rwrun` ([`LAUNCHER_NAME`]) |
//! | [`RANK_VAR`] `RANKWEAVE_RANK` | this process's rank, `0..N-1` |
//! | [`SIZE_VAR`] `RANKWEAVE_SIZE` | N |
//! | [`RENDEZVOUS_VAR`] `RANKWEAVE_RENDEZVOUS` | `ip:port` of the rendezvous service |
//! | [`JOB_KEY_VAR`] `RANKWEAVE_JOB_KEY` | the job key, 16 lowercase hexadecimal digits |
//! | [`TRANSPORT_VAR`] `RANKWEAVE_TRANSPORT` | `--transport`, when given |
//! | [`ROUTES_VAR`] `RANKWEAVE_ROUTES` | `--routes`, when given |
//! | [`CHAOS_VAR`] `RANKWEAVE_CHAOS` | `--chaos`, when given |
//! | [`PEER_TIMEOUT_VAR`] `RANKWEAVE_PEER_TIMEOUT` | `--peer-timeout`, when given |
//!
//! Without the flag, the last four pass through from rwrun's environment unchanged. The PMI-1
//! variables in [`CLEARED_VARS`] are removed, so ranks of an `rwrun` started under another
//! launcher (`srun rwrun ...`) join rwrun's job, not the outer one.

use std::ffi::OsString;
use std::fmt;
use std::io::{self, Read, Write};
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::kvs::{KvError, KvServer};
use crate::core::{ChaosSpec, Config, ConfigError};

/// `RANKWEAVE_LAUNCHER`: names the launcher that started the process.
pub const LAUNCHER_VAR: &str = "RANKWEAVE_LAUNCHER";
/// The value of [`LAUNCHER_VAR`] for ranks started by rwrun.
pub const LAUNCHER_NAME: &str = "rwrun";
/// `RANKWEAVE_RANK`: the rank of the process, `0..size`.
pub const RANK_VAR: &str = "RANKWEAVE_RANK";
/// `RANKWEAVE_SIZE`: the number of ranks in the job.
pub const SIZE_VAR: &str = "RANKWEAVE_SIZE";
/// `RANKWEAVE_RENDEZVOUS`: `ip:port` of the job's rendezvous key-value service.
pub const RENDEZVOUS_VAR: &str = "RANKWEAVE_RENDEZVOUS";
/// `RANKWEAVE_JOB_KEY`: the job key, 16 lowercase hexadecimal digits.
pub const JOB_KEY_VAR: &str = "RANKWEAVE_JOB_KEY";
/// `RANKWEAVE_TRANSPORT`: set from `--transport`.
pub const TRANSPORT_VAR: &str = "RANKWEAVE_TRANSPORT";
/// `RANKWEAVE_ROUTES`: set from `--routes`.
pub const ROUTES_VAR: &str = "RANKWEAVE_ROUTES";
/// `RANKWEAVE_CHAOS`: set from `--chaos`.
pub const CHAOS_VAR: &str = "RANKWEAVE_CHAOS";
/// `RANKWEAVE_PEER_TIMEOUT`: set from `--peer-timeout`.
pub const PEER_TIMEOUT_VAR: &str = "RANKWEAVE_PEER_TIMEOUT";

/// Variables removed from the ranks' environment: an outer launcher's PMI-1 settings, which
/// detection would otherwise prefer to rwrun's.
pub const CLEARED_VARS: &[&str] = &["PMI_FD", "PMI_PORT", "PMI_ID", "PMI_RANK", "PMI_SIZE"];

/// How long ranks get to exit on their own after a failure, a forwarded signal or a timeout,
/// unless `--grace` says otherwise.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(2);

/// The largest `-n`.
pub const MAX_RANKS: usize = 65_536;

/// Longest piece of output written as one line; longer lines are written in pieces.
pub const MAX_LINE: usize = 64 * 1024;

/// Exit status for errors in rwrun's arguments (and a PROGRAM that cannot be started).
pub const EXIT_USAGE: i32 = 2;

/// Exit status when `--timeout` passed (as `timeout(1)`).
pub const EXIT_TIMEOUT: i32 = 124;

/// Exit status when rwrun itself failed.
pub const EXIT_INTERNAL: i32 = 1;

/// The transports `--transport` accepts.
pub const TRANSPORTS: &[&str] = &["auto", "udp", "shm"];

/// Bytes of output per stream that may wait for rwrun's standard output or error before the
/// ranks' pipes are no longer read (so a slow terminal slows the ranks instead of filling
/// rwrun's memory).
const OUTPUT_BUDGET: usize = 4 * 1024 * 1024;

/// After every rank exited, how long to keep reading pipes that a rank's leftover
/// background processes still hold open.
const DRAIN_PATIENCE: Duration = Duration::from_secs(1);

/// After SIGKILL, how long to wait for ranks to be reaped before giving up on them.
const REAP_PATIENCE: Duration = Duration::from_secs(5);

/// The `--help` text.
pub const HELP: &str = "\
rwrun: start an N-process rankweave job on this host

Usage: rwrun -n N [OPTIONS] [--] PROGRAM [ARGS...]

Starts N processes of PROGRAM with ARGS, serves the rendezvous key-value service the ranks
meet at, prefixes their output with their rank, forwards SIGINT, SIGTERM, SIGUSR1 and SIGUSR2
to them, and ends the job when a rank fails (or on SIGINT / SIGTERM).

Options:
  -n, --np N            number of ranks to start (required; also -n=N, -nN, --np=N, -np N)
      --transport KIND  transport between ranks: auto, udp or shm (sets RANKWEAVE_TRANSPORT)
      --routes ADDRS    comma-separated addresses, interface names or subnets for the ranks'
                        routes (sets RANKWEAVE_ROUTES)
      --chaos SPEC      fault injection spec, e.g. loss=0.01,seed=7 (sets RANKWEAVE_CHAOS)
      --peer-timeout SECS
                        how long a silent peer may stay silent before it is declared failed
                        (sets RANKWEAVE_PEER_TIMEOUT)
      --timeout SECS    wall-clock limit for the whole job; when it passes, the ranks get
                        SIGTERM, then SIGKILL after the grace period, and rwrun exits 124
      --grace SECS      how long ranks may take to exit after a rank failed, a signal was
                        forwarded or the timeout passed, before SIGKILL (default 2)
      --bind-to WHAT    core: pin rank r to core r mod the number of cores (as mpiexec's
                        -bind-to core); none: let the kernel place ranks (default)
      --tag-output      prefix every line of output with the rank, as \"[2] hello\" (default)
      --no-tag-output   pass output through without prefixes (still whole lines)
  -h, --help            print this help
  -V, --version         print the version
  --                    end of options: the next argument is PROGRAM

Option parsing stops at PROGRAM: the arguments after it are PROGRAM's.
SECS may have a fraction (0.5). Every option taking a value also accepts --option=VALUE.

Environment of each rank (besides rwrun's own):
  RANKWEAVE_LAUNCHER=rwrun
  RANKWEAVE_RANK        the rank, 0 to N-1
  RANKWEAVE_SIZE        N
  RANKWEAVE_RENDEZVOUS  ip:port of the rendezvous key-value service
  RANKWEAVE_JOB_KEY     the job key, 16 lowercase hexadecimal digits
  RANKWEAVE_TRANSPORT, RANKWEAVE_ROUTES, RANKWEAVE_CHAOS, RANKWEAVE_PEER_TIMEOUT
                        set from the options above; without the option, rwrun's own value
                        (if any) passes through
  PMI_FD, PMI_PORT, PMI_ID, PMI_RANK, PMI_SIZE are removed.
Rank 0's standard input is rwrun's; the other ranks' is /dev/null.

Exit status: 0 when every rank exited 0; the status of the first rank that failed (128+N if
it was killed by signal N); 130 on SIGINT, 143 on SIGTERM; 124 when --timeout passed;
2 for errors in the arguments or a PROGRAM that cannot be started; 1 if rwrun itself failed.
";

/// What the command line asks for.
#[derive(Clone, Debug, PartialEq)]
pub enum Invocation {
    /// Run a job.
    Run(RwrunOptions),
    /// Print [`HELP`] and exit 0.
    Help,
    /// Print the version and exit 0.
    Version,
}

/// A job to run: the parsed command line.
#[derive(Clone, Debug, PartialEq)]
pub struct RwrunOptions {
    /// Number of ranks (`-n`), 1 to [`MAX_RANKS`].
    pub np: usize,
    /// `--transport`, lowercase; one of [`TRANSPORTS`].
    pub transport: Option<String>,
    /// `--routes`, as given (validated like `RANKWEAVE_ROUTES`).
    pub routes: Option<String>,
    /// `--chaos`, as given (validated like `RANKWEAVE_CHAOS`).
    pub chaos: Option<String>,
    /// `--peer-timeout`, as given (a positive number of seconds).
    pub peer_timeout: Option<String>,
    /// `--timeout`: wall-clock limit for the whole job.
    pub timeout: Option<Duration>,
    /// `--grace`: how long ranks may take to exit before SIGKILL.
    pub grace: Duration,
    /// Prefix output lines with the rank (`--tag-output`, the default).
    pub tag_output: bool,
    /// `--bind-to core`: pin rank r to core r mod the number of cores, as MPI launchers do
    /// for benchmarks (`--bind-to none`, the default, lets the kernel place ranks).
    pub bind_to_core: bool,
    /// The program every rank runs.
    pub program: OsString,
    /// Its arguments.
    pub args: Vec<OsString>,
}

impl RwrunOptions {
    /// Options for `np` ranks of `program` with the defaults for everything else.
    pub fn new(np: usize, program: impl Into<OsString>) -> Self {
        RwrunOptions {
            np,
            transport: None,
            routes: None,
            chaos: None,
            peer_timeout: None,
            timeout: None,
            grace: DEFAULT_GRACE,
            tag_output: true,
            bind_to_core: false,
            program: program.into(),
            args: Vec::new(),
        }
    }
}

/// An error in rwrun's command line (exit status [`EXIT_USAGE`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UsageError {
    /// No `-n`.
    #[error("the number of ranks is missing: give -n N")]
    MissingNp,
    /// No PROGRAM after the options.
    #[error("no program to run: give PROGRAM after the options")]
    MissingProgram,
    /// An option that takes a value came last.
    #[error("option {option} needs a value")]
    MissingValue {
        /// The option.
        option: String,
    },
    /// An option with a value it cannot take.
    #[error("invalid value {value:?} for {option}: expected {expected}")]
    InvalidValue {
        /// The option.
        option: String,
        /// The value given.
        value: String,
        /// What would be accepted.
        expected: String,
    },
    /// An option rwrun does not know.
    #[error("unknown option {0:?}")]
    UnknownOption(String),
    /// A flag given a value (`--tag-output=yes`).
    #[error("option {0} takes no value")]
    UnexpectedValue(String),
    /// An option that is not valid UTF-8.
    #[error("option {0:?} is not valid UTF-8")]
    NotUtf8(OsString),
}

/// Parses rwrun's command line, without the program name (`std::env::args_os().skip(1)`).
///
/// Validates what can be checked without starting anything: `-n` is 1 to [`MAX_RANKS`],
/// seconds are positive numbers, `--transport` is one of [`TRANSPORTS`], and `--routes`,
/// `--chaos` and `--peer-timeout` parse as the library will parse them in the ranks.
/// `--help` and `--version` win over everything else before PROGRAM.
pub fn parse_args<I, S>(args: I) -> Result<Invocation, UsageError>
where
    I: IntoIterator<Item = S>,
    S: Into<OsString>,
{
    let mut args = args.into_iter().map(Into::into);
    let mut np = None;
    let mut opts = RwrunOptions::new(0, OsString::new());
    let mut program = None;
    let mut help = false;
    let mut version = false;
    while let Some(arg) = args.next() {
        if arg == "--" {
            program = args.next();
            if program.is_none() {
                return Err(UsageError::MissingProgram);
            }
            break;
        }
        let Some(text) = arg.to_str() else {
            if arg.as_encoded_bytes().starts_with(b"-") {
                return Err(UsageError::NotUtf8(arg));
            }
            program = Some(arg);
            break;
        };
        if !text.starts_with('-') || text == "-" {
            program = Some(arg);
            break;
        }
        let text = text.to_string();
        // `--name=value`, `-n=N`, `-nN`: split off an attached value.
        let (name, attached) = if let Some(long) = text.strip_prefix("--") {
            match long.split_once('=') {
                Some((n, v)) => (format!("--{n}"), Some(v.to_string())),
                None => (text.clone(), None),
            }
        } else if text == "-np" {
            ("-np".to_string(), None)
        } else if text.len() > 2 && text.starts_with("-n") {
            let rest = &text[2..];
            let v = rest.strip_prefix('=').unwrap_or(rest);
            ("-n".to_string(), Some(v.to_string()))
        } else {
            (text.clone(), None)
        };
        let value = |args: &mut dyn Iterator<Item = OsString>| -> Result<String, UsageError> {
            if let Some(v) = attached.clone() {
                return Ok(v);
            }
            match args.next() {
                None => Err(UsageError::MissingValue {
                    option: name.clone(),
                }),
                Some(v) => v.into_string().map_err(UsageError::NotUtf8),
            }
        };
        let flag = |attached: &Option<String>| match attached {
            Some(_) => Err(UsageError::UnexpectedValue(name.clone())),
            None => Ok(()),
        };
        match name.as_str() {
            "-h" | "--help" => {
                flag(&attached)?;
                help = true;
            }
            "-V" | "--version" => {
                flag(&attached)?;
                version = true;
            }
            "--tag-output" => {
                flag(&attached)?;
                opts.tag_output = true;
            }
            "--no-tag-output" => {
                flag(&attached)?;
                opts.tag_output = false;
            }
            "-n" | "--np" | "-np" => {
                let v = value(&mut args)?;
                np = Some(parse_np(&name, &v)?);
            }
            "--transport" => {
                let v = value(&mut args)?;
                let kind = v.trim().to_ascii_lowercase();
                if !TRANSPORTS.contains(&kind.as_str()) {
                    return Err(UsageError::InvalidValue {
                        option: name.clone(),
                        value: v,
                        expected: format!("one of {}", TRANSPORTS.join(", ")),
                    });
                }
                opts.transport = Some(kind);
            }
            "--routes" => {
                let v = value(&mut args)?;
                check_with_library(&name, ROUTES_VAR, &v)?;
                opts.routes = Some(v);
            }
            "--chaos" => {
                let v = value(&mut args)?;
                ChaosSpec::parse(&v).map_err(|e| library_error(&name, &v, e))?;
                opts.chaos = Some(v);
            }
            "--peer-timeout" => {
                let v = value(&mut args)?;
                check_with_library(&name, PEER_TIMEOUT_VAR, &v)?;
                opts.peer_timeout = Some(v.trim().to_string());
            }
            "--timeout" => {
                let v = value(&mut args)?;
                opts.timeout = Some(parse_secs(&name, &v, false)?);
            }
            "--grace" => {
                let v = value(&mut args)?;
                opts.grace = parse_secs(&name, &v, true)?;
            }
            "--bind-to" => {
                let v = value(&mut args)?;
                opts.bind_to_core = match v.trim() {
                    "core" => true,
                    "none" => false,
                    _ => {
                        return Err(UsageError::InvalidValue {
                            option: name.clone(),
                            value: v,
                            expected: "core or none".into(),
                        });
                    }
                };
            }
            _ => return Err(UsageError::UnknownOption(text)),
        }
    }
    if help {
        return Ok(Invocation::Help);
    }
    if version {
        return Ok(Invocation::Version);
    }
    let np = np.ok_or(UsageError::MissingNp)?;
    opts.np = np;
    opts.program = program.ok_or(UsageError::MissingProgram)?;
    opts.args = args.collect();
    Ok(Invocation::Run(opts))
}

fn parse_np(option: &str, v: &str) -> Result<usize, UsageError> {
    v.trim()
        .parse::<usize>()
        .ok()
        .filter(|n| (1..=MAX_RANKS).contains(n))
        .ok_or_else(|| UsageError::InvalidValue {
            option: option.to_string(),
            value: v.to_string(),
            expected: format!("a number of ranks from 1 to {MAX_RANKS}"),
        })
}

fn parse_secs(option: &str, v: &str, zero_ok: bool) -> Result<Duration, UsageError> {
    v.trim()
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && (*s > 0.0 || (zero_ok && *s == 0.0)) && *s <= 1e9)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| UsageError::InvalidValue {
            option: option.to_string(),
            value: v.to_string(),
            expected: if zero_ok {
                "a number of seconds, 0 or more, such as 2 or 0.5".to_string()
            } else {
                "a number of seconds above 0, such as 10 or 0.5".to_string()
            },
        })
}

/// Parses `value` as the ranks will (as the variable `var`), so mistakes show up here.
fn check_with_library(option: &str, var: &str, value: &str) -> Result<(), UsageError> {
    if value.trim().is_empty() {
        return Err(UsageError::InvalidValue {
            option: option.to_string(),
            value: value.to_string(),
            expected: "a non-empty value".to_string(),
        });
    }
    Config::default()
        .with_env(|name| (name == var).then(|| value.to_string()))
        .map(|_| ())
        .map_err(|e| library_error(option, value, e))
}

fn library_error(option: &str, value: &str, e: ConfigError) -> UsageError {
    UsageError::InvalidValue {
        option: option.to_string(),
        value: value.to_string(),
        expected: e.expected,
    }
}

/// How a rank's process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Death {
    /// It exited with this status.
    Exited(i32),
    /// A signal killed it.
    Signaled {
        /// The signal number.
        signal: i32,
        /// Whether it dumped core.
        core_dumped: bool,
    },
}

impl Death {
    /// Reads a process's exit status.
    pub fn from_status(status: ExitStatus) -> Death {
        use std::os::unix::process::ExitStatusExt;
        match (status.code(), status.signal()) {
            (Some(code), _) => Death::Exited(code),
            (None, Some(signal)) => Death::Signaled {
                signal,
                core_dumped: status.core_dumped(),
            },
            // Stopped or continued: wait() does not report those; treat as a failure.
            (None, None) => Death::Exited(EXIT_INTERNAL),
        }
    }

    /// Whether the process succeeded (exited 0).
    pub fn is_success(&self) -> bool {
        *self == Death::Exited(0)
    }

    /// The shell's convention: the exit status, or 128 + the signal.
    pub fn exit_code(&self) -> i32 {
        match *self {
            Death::Exited(code) => code,
            Death::Signaled { signal, .. } => 128 + signal,
        }
    }
}

impl fmt::Display for Death {
    /// `exited with status 3`, `was killed by signal 9 (SIGKILL)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Death::Exited(code) => write!(f, "exited with status {code}"),
            Death::Signaled {
                signal,
                core_dumped,
            } => {
                write!(f, "was killed by signal {signal}")?;
                if let Some(name) = signal_name(signal) {
                    write!(f, " ({name})")?;
                }
                if core_dumped {
                    write!(f, ", core dumped")?;
                }
                Ok(())
            }
        }
    }
}

/// The name of a signal number (`SIGKILL` for 9), for the common ones.
pub fn signal_name(signal: i32) -> Option<&'static str> {
    Some(match signal {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGCHLD => "SIGCHLD",
        libc::SIGCONT => "SIGCONT",
        libc::SIGSTOP => "SIGSTOP",
        libc::SIGTSTP => "SIGTSTP",
        libc::SIGTTIN => "SIGTTIN",
        libc::SIGTTOU => "SIGTTOU",
        libc::SIGURG => "SIGURG",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        libc::SIGVTALRM => "SIGVTALRM",
        libc::SIGPROF => "SIGPROF",
        libc::SIGWINCH => "SIGWINCH",
        libc::SIGSYS => "SIGSYS",
        _ => return None,
    })
}

/// rwrun's own failures (not the job's).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// The rendezvous service could not be started.
    #[error("cannot start the rendezvous service: {0}")]
    Rendezvous(#[from] KvError),
    /// Signal handlers could not be installed.
    #[error("cannot install signal handlers: {0}")]
    Signals(#[source] io::Error),
    /// The threads copying the ranks' output could not be started.
    #[error("cannot start the output threads: {0}")]
    Output(#[source] io::Error),
    /// A rank's process could not be started.
    #[error("cannot start rank {rank} ({program}): {}", spawn_reason(source))]
    Spawn {
        /// The rank.
        rank: usize,
        /// The program, as given.
        program: String,
        /// Why.
        #[source]
        source: io::Error,
    },
}

fn spawn_reason(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::NotFound => "program not found".to_string(),
        io::ErrorKind::PermissionDenied => "not executable (permission denied)".to_string(),
        _ => e.to_string(),
    }
}

impl RunError {
    /// Whether the user can fix it by correcting the command line (a PROGRAM that does not
    /// exist or cannot be executed): exit status [`EXIT_USAGE`].
    pub fn is_usage(&self) -> bool {
        match self {
            RunError::Spawn { source, .. } => {
                matches!(
                    source.kind(),
                    io::ErrorKind::NotFound | io::ErrorKind::PermissionDenied
                ) || source.raw_os_error() == Some(libc::ENOEXEC)
            }
            _ => false,
        }
    }
}

/// How a job ended.
#[derive(Debug)]
#[non_exhaustive]
pub enum ExitOutcome {
    /// Every rank exited 0.
    Success,
    /// A rank failed first.
    RankFailed {
        /// The rank.
        rank: usize,
        /// Its process id.
        pid: u32,
        /// How it ended.
        death: Death,
    },
    /// rwrun received a signal (and forwarded it).
    Signaled {
        /// The signal number (SIGINT or SIGTERM).
        signal: i32,
    },
    /// `--timeout` passed.
    TimedOut {
        /// The limit.
        after: Duration,
    },
    /// rwrun itself failed.
    Error(RunError),
}

impl ExitOutcome {
    /// The status rwrun exits with (see the [module documentation](self)).
    pub fn exit_code(&self) -> i32 {
        match self {
            ExitOutcome::Success => 0,
            ExitOutcome::RankFailed { death, .. } => death.exit_code(),
            ExitOutcome::Signaled { signal } => 128 + signal,
            ExitOutcome::TimedOut { .. } => EXIT_TIMEOUT,
            ExitOutcome::Error(e) if e.is_usage() => EXIT_USAGE,
            ExitOutcome::Error(_) => EXIT_INTERNAL,
        }
    }
}

/// The job key as rwrun writes it into [`JOB_KEY_VAR`]: 16 lowercase hexadecimal digits.
pub fn format_job_key(key: u64) -> String {
    format!("{key:016x}")
}

/// Seconds for messages: `2`, `0.5`.
fn secs(d: Duration) -> String {
    format!("{}", d.as_secs_f64())
}

fn rank_list(ranks: impl IntoIterator<Item = usize>) -> String {
    ranks
        .into_iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Who wrote a piece of output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Origin {
    Rank(usize),
    Rwrun,
}

/// A piece of output on its way to rwrun's standard output or error: whole lines, or a piece
/// of a line over [`MAX_LINE`].
struct Chunk {
    origin: Origin,
    bytes: Vec<u8>,
    /// Returned to the stream's budget once written.
    _permit: Option<OwnedSemaphorePermit>,
}

/// One of rwrun's output streams: a thread writes what the ranks (and rwrun) send it, in
/// order, so lines never interleave.
#[derive(Clone)]
struct Sink {
    tx: mpsc::UnboundedSender<Chunk>,
    budget: Arc<Semaphore>,
}

impl Sink {
    fn start(
        name: &str,
        mut out: impl Write + Send + 'static,
    ) -> io::Result<(Sink, std::thread::JoinHandle<()>)> {
        let (tx, mut rx) = mpsc::unbounded_channel::<Chunk>();
        let thread = std::thread::Builder::new()
            .name(format!("rwrun-{name}"))
            .spawn(move || {
                // Whether the last byte written ended a line, and who wrote it.
                let mut last: Option<(Origin, bool)> = None;
                let mut broken = false;
                while let Some(chunk) = rx.blocking_recv() {
                    if broken || chunk.bytes.is_empty() {
                        continue;
                    }
                    let mut result = Ok(());
                    if matches!(last, Some((origin, false)) if origin != chunk.origin) {
                        // Someone else's piece of an unfinished line: start a new one.
                        result = out.write_all(b"\n");
                    }
                    result = result.and_then(|()| out.write_all(&chunk.bytes));
                    last = Some((chunk.origin, chunk.bytes.ends_with(b"\n")));
                    if rx.is_empty() {
                        result = result.and_then(|()| out.flush());
                    }
                    // A closed stdout (`rwrun ... | head`): keep draining so the ranks are not
                    // blocked, but write nothing more.
                    broken = result.is_err();
                }
                let _ = out.flush();
            })?;
        let budget = Arc::new(Semaphore::new(OUTPUT_BUDGET));
        Ok((Sink { tx, budget }, thread))
    }

    /// Queues output of a rank, waiting while the stream's budget is used up.
    async fn send(&self, origin: Origin, bytes: Vec<u8>) {
        let n = bytes.len().clamp(1, OUTPUT_BUDGET) as u32;
        let permit = self.budget.clone().acquire_many_owned(n).await.ok();
        let _ = self.tx.send(Chunk {
            origin,
            bytes,
            _permit: permit,
        });
    }

    /// Queues a message of rwrun's own (never waits).
    fn note(&self, message: &str) {
        let _ = self.tx.send(Chunk {
            origin: Origin::Rwrun,
            bytes: format!("rwrun: {message}\n").into_bytes(),
            _permit: None,
        });
    }
}

/// Copies a rank's output stream to `sink` in whole lines, prefixed with `[rank] ` when
/// tagging.
async fn pump(rank: usize, stream: impl AsyncRead + Unpin, sink: Sink, tag: bool) {
    let prefix = format!("[{rank}] ").into_bytes();
    let mut rd = BufReader::with_capacity(MAX_LINE, stream);
    // The unfinished last line.
    let mut partial: Vec<u8> = Vec::new();
    loop {
        let buf = match rd.fill_buf().await {
            Ok(buf) => buf,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => &[][..],
        };
        if buf.is_empty() {
            if !partial.is_empty() {
                let mut piece = std::mem::take(&mut partial);
                if tag {
                    piece.push(b'\n');
                    sink.send(Origin::Rank(rank), tag_lines(&prefix, &piece))
                        .await;
                } else {
                    sink.send(Origin::Rank(rank), piece).await;
                }
            }
            return;
        }
        let len = buf.len();
        match buf.iter().rposition(|&b| b == b'\n') {
            Some(i) => {
                let mut lines = std::mem::take(&mut partial);
                lines.extend_from_slice(&buf[..=i]);
                partial.extend_from_slice(&buf[i + 1..]);
                rd.consume(len);
                let out = if tag {
                    tag_lines(&prefix, &lines)
                } else {
                    lines
                };
                sink.send(Origin::Rank(rank), out).await;
            }
            None => {
                partial.extend_from_slice(buf);
                rd.consume(len);
            }
        }
        if partial.len() >= MAX_LINE {
            // A very long line: write what there is as a piece of its own.
            let mut piece = std::mem::take(&mut partial);
            if tag {
                piece.push(b'\n');
                piece = tag_lines(&prefix, &piece);
            }
            sink.send(Origin::Rank(rank), piece).await;
        }
    }
}

/// `lines` (each ending in `\n`) with `prefix` before each.
fn tag_lines(prefix: &[u8], lines: &[u8]) -> Vec<u8> {
    let count = lines.iter().filter(|&&b| b == b'\n').count();
    let mut out = Vec::with_capacity(lines.len() + count * prefix.len());
    for line in lines.split_inclusive(|&b| b == b'\n') {
        out.extend_from_slice(prefix);
        out.extend_from_slice(line);
    }
    out
}

/// Sends `sig` to the process group a rank leads. Returns whether it was delivered.
fn signal_group(pid: u32, sig: i32) -> bool {
    let Ok(pgid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pgid <= 1 {
        return false;
    }
    // SAFETY: kill(2) takes no pointers and has no memory-safety preconditions. The negative
    // pid names the process group the rank leads (it was started with `process_group(0)`);
    // callers only signal ranks not yet reaped, so the group id still belongs to this job.
    unsafe { libc::kill(-pgid, sig) == 0 }
}

/// Whether rwrun's standard input is a terminal whose foreground is someone else (rwrun runs
/// in the background): reading it would stop rwrun with SIGTTIN.
fn stdin_is_background_terminal() -> bool {
    // SAFETY: isatty, tcgetpgrp and getpgrp take no pointers; on a descriptor that is not a
    // terminal (or not open) they fail without side effects.
    unsafe { libc::isatty(0) == 1 && libc::tcgetpgrp(0) != libc::getpgrp() }
}

/// Feeds rwrun's standard input to a rank (rank 0) until either side closes.
fn forward_stdin(mut child: ChildStdin) {
    let (tx, mut rx) = mpsc::channel::<Vec<u8>>(4);
    let reader = std::thread::Builder::new()
        .name("rwrun-stdin".into())
        .spawn(move || {
            let mut stdin = io::stdin().lock();
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                match stdin.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        if tx.blocking_send(buf[..n].to_vec()).is_err() {
                            break;
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
        });
    if reader.is_err() {
        return; // Dropping `child` closes the rank's standard input.
    }
    tokio::spawn(async move {
        while let Some(bytes) = rx.recv().await {
            if child.write_all(&bytes).await.is_err() {
                break;
            }
        }
        // Dropping `child` closes the pipe: the rank sees end of input.
    });
}

/// A started rank.
struct Rank {
    pid: u32,
    /// `None` while it runs.
    death: Option<Death>,
}

/// What ends the job early (the first one decides the exit status).
enum Ending {
    Failure { rank: usize, pid: u32, death: Death },
    Signal(i32),
    Timeout(Duration),
}

/// Runs the job `opts` describes and reports how it ended. Writes the ranks' output and
/// rwrun's messages to this process's standard output and error. Call it inside a tokio
/// runtime with I/O, time and signal support (`enable_all`); a current-thread runtime is
/// enough.
pub async fn run(opts: RwrunOptions) -> ExitOutcome {
    let (out, out_thread) = match Sink::start("stdout", io::stdout()) {
        Ok(s) => s,
        Err(e) => return internal(RunError::Output(e)),
    };
    let (err, err_thread) = match Sink::start("stderr", io::stderr()) {
        Ok(s) => s,
        Err(e) => return internal(RunError::Output(e)),
    };
    let outcome = supervise(&opts, &out, &err).await;
    if let ExitOutcome::Error(e) = &outcome {
        err.note(&e.to_string());
        if e.is_usage() {
            err.note("try 'rwrun --help' for more information");
        }
    }
    drop(out);
    drop(err);
    // The writer threads end once every sender is gone (the pumps have ended or were aborted).
    let _ = tokio::task::spawn_blocking(move || {
        let _ = out_thread.join();
        let _ = err_thread.join();
    })
    .await;
    outcome
}

fn internal(e: RunError) -> ExitOutcome {
    eprintln!("rwrun: {e}");
    ExitOutcome::Error(e)
}

async fn supervise(opts: &RwrunOptions, out: &Sink, err: &Sink) -> ExitOutcome {
    let n = opts.np;
    let (mut sigint, mut sigterm, mut sigusr1, mut sigusr2) = match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
        signal(SignalKind::user_defined1()),
        signal(SignalKind::user_defined2()),
    ) {
        (Ok(i), Ok(t), Ok(u1), Ok(u2)) => (i, t, u1, u2),
        (Err(e), ..) | (_, Err(e), ..) | (.., Err(e), _) | (.., Err(e)) => {
            return ExitOutcome::Error(RunError::Signals(e));
        }
    };
    let server = match KvServer::bind("127.0.0.1:0", n).await {
        Ok(s) => s,
        Err(e) => return ExitOutcome::Error(RunError::Rendezvous(e)),
    };
    let rendezvous = server.local_addr().to_string();
    let job_key = format_job_key(crate::core::rng::random_u64());
    let size = n.to_string();
    let feed_stdin = !stdin_is_background_terminal();

    let mut ranks: Vec<Rank> = Vec::with_capacity(n);
    let mut waits: JoinSet<(usize, io::Result<ExitStatus>)> = JoinSet::new();
    let mut pumps: JoinSet<()> = JoinSet::new();
    for rank in 0..n {
        let mut cmd = Command::new(&opts.program);
        cmd.args(&opts.args)
            .env(LAUNCHER_VAR, LAUNCHER_NAME)
            .env(RANK_VAR, rank.to_string())
            .env(SIZE_VAR, &size)
            .env(RENDEZVOUS_VAR, &rendezvous)
            .env(JOB_KEY_VAR, &job_key);
        for (var, value) in [
            (TRANSPORT_VAR, &opts.transport),
            (ROUTES_VAR, &opts.routes),
            (CHAOS_VAR, &opts.chaos),
            (PEER_TIMEOUT_VAR, &opts.peer_timeout),
        ] {
            if let Some(v) = value {
                cmd.env(var, v);
            }
        }
        for var in CLEARED_VARS {
            cmd.env_remove(var);
        }
        cmd.stdin(if rank == 0 && feed_stdin {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // A group of its own per rank: signals reach the rank's children too (`sh -c` running
        // `sleep`), and a terminal's Ctrl-C reaches rwrun only, which forwards it once.
        .process_group(0);
        if opts.bind_to_core {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let core = rank % cores;
            // SAFETY: the closure runs in the child between fork and exec and calls only
            // sched_setaffinity(2), which is async-signal-safe, on a mask on its own stack.
            unsafe {
                cmd.pre_exec(move || {
                    let mut set: libc::cpu_set_t = std::mem::zeroed();
                    libc::CPU_SET(core, &mut set);
                    if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0
                    {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let mut child: Child = match cmd.spawn() {
            Ok(c) => c,
            Err(source) => {
                for r in &ranks {
                    signal_group(r.pid, libc::SIGKILL);
                }
                while waits.join_next().await.is_some() {}
                pumps.abort_all();
                server.shutdown().await;
                return ExitOutcome::Error(RunError::Spawn {
                    rank,
                    program: opts.program.to_string_lossy().into_owned(),
                    source,
                });
            }
        };
        let pid = child.id().unwrap_or(0);
        if let Some(stdin) = child.stdin.take() {
            forward_stdin(stdin);
        }
        if let Some(stdout) = child.stdout.take() {
            pumps.spawn(pump(rank, stdout, out.clone(), opts.tag_output));
        }
        if let Some(stderr) = child.stderr.take() {
            pumps.spawn(pump(rank, stderr, err.clone(), opts.tag_output));
        }
        waits.spawn(async move { (rank, child.wait().await) });
        ranks.push(Rank { pid, death: None });
    }

    let grace = opts.grace;
    let timeout_at = opts.timeout.map(|t| Instant::now() + t);
    let mut ending: Option<Ending> = None;
    let mut kill_at: Option<Instant> = None;
    let mut killed_at: Option<Instant> = None;
    let mut signals_seen = 0usize;
    let mut running = n;
    let running_ranks = |ranks: &[Rank]| -> Vec<usize> {
        ranks
            .iter()
            .enumerate()
            .filter(|(_, r)| r.death.is_none())
            .map(|(i, _)| i)
            .collect()
    };

    while running > 0 {
        let timeout_due = async {
            match timeout_at {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        let kill_due = async {
            match kill_at {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        let give_up_due = async {
            match killed_at {
                Some(t) => tokio::time::sleep_until(t + REAP_PATIENCE).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            Some(joined) = waits.join_next() => {
                let Ok((rank, status)) = joined else { continue };
                let death = match status {
                    Ok(status) => Death::from_status(status),
                    Err(e) => {
                        err.note(&format!("cannot wait for rank {rank}: {e}"));
                        Death::Exited(EXIT_INTERNAL)
                    }
                };
                ranks[rank].death = Some(death);
                running -= 1;
                let pid = ranks[rank].pid;
                if death.is_success() {
                    continue;
                }
                match &ending {
                    None => {
                        err.note(&format!("rank {rank} (pid {pid}) {death}"));
                        if running > 0 {
                            err.note(&format!(
                                "waiting up to {} s for the other {running} rank(s) to exit",
                                secs(grace)
                            ));
                            kill_at = Some(Instant::now() + grace);
                        }
                        ending = Some(Ending::Failure { rank, pid, death });
                    }
                    Some(Ending::Failure { rank: first, .. }) if killed_at.is_none() => {
                        err.note(&format!(
                            "rank {rank} (pid {pid}) {death} (after rank {first} failed)"
                        ));
                    }
                    // Ended by rwrun's own SIGTERM / SIGKILL or the forwarded signal: expected.
                    _ => {}
                }
            }
            Some(()) = sigint.recv() => {
                on_signal(libc::SIGINT, &mut ending, &mut signals_seen, &mut kill_at, &mut killed_at, &ranks, grace, err);
            }
            Some(()) = sigterm.recv() => {
                on_signal(libc::SIGTERM, &mut ending, &mut signals_seen, &mut kill_at, &mut killed_at, &ranks, grace, err);
            }
            Some(()) = sigusr1.recv() => {
                for r in running_ranks(&ranks) {
                    signal_group(ranks[r].pid, libc::SIGUSR1);
                }
            }
            Some(()) = sigusr2.recv() => {
                for r in running_ranks(&ranks) {
                    signal_group(ranks[r].pid, libc::SIGUSR2);
                }
            }
            () = timeout_due, if ending.is_none() => {
                let limit = opts.timeout.unwrap_or_default();
                let still = running_ranks(&ranks);
                err.note(&format!(
                    "job timed out after {} s; ranks still running: {}",
                    secs(limit),
                    rank_list(still.iter().copied())
                ));
                for &r in &still {
                    signal_group(ranks[r].pid, libc::SIGTERM);
                }
                ending = Some(Ending::Timeout(limit));
                kill_at = Some(Instant::now() + grace);
            }
            () = kill_due, if killed_at.is_none() => {
                let still = running_ranks(&ranks);
                for &r in &still {
                    signal_group(ranks[r].pid, libc::SIGKILL);
                }
                err.note(&format!(
                    "killed {} rank(s) still running after the grace period of {} s: {}",
                    still.len(),
                    secs(grace),
                    rank_list(still.iter().copied())
                ));
                killed_at = Some(Instant::now());
            }
            () = give_up_due => {
                let still = running_ranks(&ranks);
                err.note(&format!(
                    "rank(s) {} did not exit after SIGKILL; giving up on them",
                    rank_list(still.iter().copied())
                ));
                break;
            }
        }
    }

    // Every rank has exited; their pipes close with them, unless processes they left behind
    // still hold them.
    let drained = tokio::time::timeout(DRAIN_PATIENCE, async {
        while pumps.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        pumps.abort_all();
        while pumps.join_next().await.is_some() {}
    }
    waits.abort_all();
    server.shutdown().await;

    match ending {
        None => ExitOutcome::Success,
        Some(Ending::Failure { rank, pid, death }) => {
            err.note(&format!(
                "job failed: rank {rank} (pid {pid}) {death}; exit status {}",
                death.exit_code()
            ));
            ExitOutcome::RankFailed { rank, pid, death }
        }
        Some(Ending::Signal(signal)) => {
            err.note(&format!(
                "job ended by {}; exit status {}",
                signal_name(signal).unwrap_or("a signal"),
                128 + signal
            ));
            ExitOutcome::Signaled { signal }
        }
        Some(Ending::Timeout(after)) => {
            err.note(&format!("exit status {EXIT_TIMEOUT} (timed out)"));
            ExitOutcome::TimedOut { after }
        }
    }
}

/// rwrun received `sig`: forward it to every running rank; the second time, kill them.
#[allow(clippy::too_many_arguments)]
fn on_signal(
    sig: i32,
    ending: &mut Option<Ending>,
    signals_seen: &mut usize,
    kill_at: &mut Option<Instant>,
    killed_at: &mut Option<Instant>,
    ranks: &[Rank],
    grace: Duration,
    err: &Sink,
) {
    let name = signal_name(sig).unwrap_or("a signal");
    *signals_seen += 1;
    if ending.is_none() {
        *ending = Some(Ending::Signal(sig));
    }
    if killed_at.is_some() {
        return;
    }
    let still: Vec<usize> = (0..ranks.len())
        .filter(|&r| ranks[r].death.is_none())
        .collect();
    if *signals_seen > 1 {
        for &r in &still {
            signal_group(ranks[r].pid, libc::SIGKILL);
        }
        err.note(&format!(
            "received {name} again: killed {} rank(s): {}",
            still.len(),
            rank_list(still.iter().copied())
        ));
        *killed_at = Some(Instant::now());
        return;
    }
    for &r in &still {
        signal_group(ranks[r].pid, sig);
    }
    err.note(&format!(
        "received {name}; forwarded it to {} running rank(s); waiting up to {} s for them to exit",
        still.len(),
        secs(grace)
    ));
    let deadline = Instant::now() + grace;
    *kill_at = Some(kill_at.map_or(deadline, |t| t.min(deadline)));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_opts(args: &[&str]) -> RwrunOptions {
        match parse_args(args.iter().copied()) {
            Ok(Invocation::Run(o)) => o,
            other => panic!("{args:?}: {other:?}"),
        }
    }

    #[test]
    fn parses_np_forms() {
        for args in [
            &["-n", "4", "prog"][..],
            &["-n=4", "prog"],
            &["-n4", "prog"],
            &["--np", "4", "prog"],
            &["--np=4", "prog"],
            &["-np", "4", "prog"],
        ] {
            let o = run_opts(args);
            assert_eq!(o.np, 4, "{args:?}");
            assert_eq!(o.program, "prog");
        }
    }

    #[test]
    fn stops_at_program() {
        let o = run_opts(&["-n", "2", "prog", "-n", "3", "--help"]);
        assert_eq!(o.np, 2);
        assert_eq!(
            o.args,
            vec![OsString::from("-n"), "3".into(), "--help".into()]
        );
        let o = run_opts(&["-n", "2", "--", "-weird", "x"]);
        assert_eq!(o.program, "-weird");
        assert_eq!(o.args, vec![OsString::from("x")]);
    }

    #[test]
    fn parses_every_option() {
        let o = run_opts(&[
            "-n",
            "3",
            "--transport=UDP",
            "--chaos",
            "loss=0.1,seed=3",
            "--peer-timeout",
            "1.5",
            "--timeout",
            "10",
            "--grace=0",
            "--no-tag-output",
            "--routes",
            "127.0.0.1",
            "--bind-to",
            "core",
            "prog",
        ]);
        assert!(o.bind_to_core);
        assert!(!run_opts(&["-n", "1", "--bind-to=none", "p"]).bind_to_core);
        assert!(matches!(
            parse_args(["-n", "1", "--bind-to", "socket", "p"]),
            Err(UsageError::InvalidValue { .. })
        ));
        assert_eq!(o.transport.as_deref(), Some("udp"));
        assert_eq!(o.chaos.as_deref(), Some("loss=0.1,seed=3"));
        assert_eq!(o.peer_timeout.as_deref(), Some("1.5"));
        assert_eq!(o.timeout, Some(Duration::from_secs(10)));
        assert_eq!(o.grace, Duration::ZERO);
        assert!(!o.tag_output);
        assert_eq!(o.routes.as_deref(), Some("127.0.0.1"));
    }

    #[test]
    fn usage_errors() {
        let err = |args: &[&str]| parse_args(args.iter().copied()).unwrap_err();
        assert_eq!(err(&["prog"]), UsageError::MissingNp);
        assert_eq!(err(&["-n", "2"]), UsageError::MissingProgram);
        assert_eq!(err(&["-n", "2", "--"]), UsageError::MissingProgram);
        assert!(matches!(
            err(&["-n", "0", "p"]),
            UsageError::InvalidValue { .. }
        ));
        assert!(matches!(
            err(&["-n", "x", "p"]),
            UsageError::InvalidValue { .. }
        ));
        assert!(matches!(err(&["-n"]), UsageError::MissingValue { .. }));
        assert!(matches!(
            err(&["--bogus", "p"]),
            UsageError::UnknownOption(_)
        ));
        assert!(matches!(
            err(&["-n", "1", "--transport", "carrier-pigeon", "p"]),
            UsageError::InvalidValue { .. }
        ));
        assert!(matches!(
            err(&["-n", "1", "--timeout", "0", "p"]),
            UsageError::InvalidValue { .. }
        ));
        assert!(matches!(
            err(&["-n", "1", "--grace", "-1", "p"]),
            UsageError::InvalidValue { .. }
        ));
        assert!(matches!(
            err(&["-n", "1", "--chaos", "loss=2", "p"]),
            UsageError::InvalidValue { .. }
        ));
        assert!(matches!(
            err(&["-n", "1", "--peer-timeout", "soon", "p"]),
            UsageError::InvalidValue { .. }
        ));
        assert!(matches!(
            err(&["--tag-output=yes"]),
            UsageError::UnexpectedValue(_)
        ));
    }

    #[test]
    fn help_and_version() {
        assert_eq!(parse_args(["--help"]).unwrap(), Invocation::Help);
        assert_eq!(parse_args(["-n", "2", "-h"]).unwrap(), Invocation::Help);
        assert_eq!(parse_args(["--version"]).unwrap(), Invocation::Version);
    }

    #[test]
    fn deaths_read_well() {
        assert_eq!(Death::Exited(3).to_string(), "exited with status 3");
        let killed = Death::Signaled {
            signal: 9,
            core_dumped: false,
        };
        assert_eq!(killed.to_string(), "was killed by signal 9 (SIGKILL)");
        assert_eq!(killed.exit_code(), 137);
    }

    #[test]
    fn tags_each_line() {
        assert_eq!(
            tag_lines(b"[1] ", b"a\n\nb\n"),
            b"[1] a\n[1] \n[1] b\n".to_vec()
        );
    }

    #[test]
    fn job_key_is_16_hex_digits() {
        assert_eq!(format_job_key(0xab), "00000000000000ab");
    }
}
