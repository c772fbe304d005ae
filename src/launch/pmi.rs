//! PMI-1 client: how a process started by MPICH's Hydra (`mpiexec.mpich`) or by Slurm learns
//! its rank, the job's size, and exchanges small strings with the other processes.
//!
//! Written from the wire protocol (as MPICH's `simple_pmi.c` / `pmi_v1.c` speak it and Hydra
//! 4.0 answers it), in two layers:
//!
//! * [`PmiLine`], a pure, sans-IO parser and formatter for one protocol line, and
//!   [`PmiEnv`], which reads the launcher's environment variables;
//! * [`PmiClient`], an async request/response client over any tokio byte stream, with
//!   [`PmiClient::from_env`] connecting the way the launcher says.
//!
//! # Transport
//!
//! The launcher gives the process one of:
//!
//! | environment | meaning |
//! |---|---|
//! | `PMI_FD=<n>`, `PMI_RANK=<r>`, `PMI_SIZE=<s>` | fd `n` is an inherited, connected stream socket (Hydra's default; Slurm's `--mpi=pmi2` plugin serves PMI-1 on it too) |
//! | `PMI_PORT=<host>:<port>`, `PMI_ID=<id>` | connect over TCP and do the `initack` handshake below (Hydra's `-pmi-port`) |
//! | `PMI_PORT=<host>:<port>`, `PMI_RANK`, `PMI_SIZE` | connect over TCP, no handshake (older launchers) |
//!
//! Anything else with one of these variables set is a *half-set* environment and gives
//! [`PmiError::MissingEnv`] naming what is missing (for example `PMI_FD` without `PMI_RANK`).
//!
//! # Wire protocol
//!
//! Every message is one line: `key=value` pairs separated by single spaces, ended by `\n`, one
//! of them `cmd=<command>`. Values cannot contain spaces or newlines, and there is no escaping
//! that every server understands. Replies may carry `rc=<n>` (non-zero: failure, with
//! `msg=<reason>`); keys come in any order and unknown keys are ignored.
//!
//! | client sends | server answers |
//! |---|---|
//! | `cmd=initack pmiid=<id>` (`PMI_PORT` only, first) | `cmd=initack`, then `cmd=set size=<s>`, `cmd=set rank=<r>`, `cmd=set debug=<d>` |
//! | `cmd=init pmi_version=1 pmi_subversion=1` | `cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0` |
//! | `cmd=get_maxes` | `cmd=maxes kvsname_max=256 keylen_max=64 vallen_max=1024` |
//! | `cmd=get_my_kvsname` | `cmd=my_kvsname kvsname=<name>` |
//! | `cmd=put kvsname=<name> key=<k> value=<v>` | `cmd=put_result rc=0 msg=success` |
//! | `cmd=barrier_in` | `cmd=barrier_out` (once every process has sent `barrier_in`) |
//! | `cmd=get kvsname=<name> key=<k>` | `cmd=get_result rc=0 msg=success value=<v>`; unknown key: `rc=-1 msg=key_<k>_not_found value=unknown` (Hydra 4.0), `rc=1` (Slurm) or `rc=0 found=FALSE` (later MPICH) |
//! | `cmd=finalize` | `cmd=finalize_ack` |
//! | `cmd=abort exitcode=<n> message=<m>` | none: the launcher ends the job with that exit code |
//!
//! (The numbers are what Debian's Hydra 4.0.2 sends.) A put is only guaranteed to be visible
//! to other processes' gets after a barrier that both took part in.
//!
//! # Limits
//!
//! The maxima from `get_maxes` count C's terminating NUL, so a key may have at most
//! `keylen_max - 1` bytes and a value `vallen_max - 1`. Keys and values must be printable ASCII
//! without space, `=` or `\` (newer MPICH servers treat `\` as an escape); anything else is
//! refused with [`PmiError::InvalidValue`] before it is sent. Binary data can go through
//! [`hex_encode`] / [`hex_decode`]. Lines from the server longer than [`MAX_LINE_LEN`] end the
//! connection with [`PmiError::LineTooLong`], so a hostile server cannot exhaust memory; no
//! server input makes the client panic.
//!
//! # Example
//!
//! ```no_run
//! # async fn run() -> Result<(), rankweave::launch::pmi::PmiError> {
//! use rankweave::launch::pmi::PmiClient;
//!
//! let mut pmi = PmiClient::from_env().await?;
//! pmi.init().await?;
//! pmi.put(&format!("addr-{}", pmi.rank()), "127.0.0.1:4000").await?;
//! pmi.barrier().await?;
//! let addr_of_0 = pmi.get("addr-0").await?;
//! pmi.finalize().await?;
//! # let _ = addr_of_0; Ok(()) }
//! ```

use std::fmt;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};

/// Longest line (without its `\n`) the client accepts from a server or sends: 64 KiB.
pub const MAX_LINE_LEN: usize = 64 * 1024;

/// How much of an offending line error messages quote.
const QUOTED_LINE_LEN: usize = 200;

/// Longest `message=` the client puts into an `abort` line.
const MAX_ABORT_MESSAGE: usize = 1000;

/// The PMI version this client speaks (`pmi_version=1 pmi_subversion=1`).
pub const PMI_VERSION: (u32, u32) = (1, 1);

/// An error from the PMI client.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PmiError {
    /// None of the PMI environment variables is set: the process was not started by a PMI-1
    /// launcher.
    #[error("not started by a PMI-1 launcher: neither PMI_FD nor PMI_PORT is set")]
    NotLaunched,
    /// Some PMI variables are set, but one the others need is not.
    #[error("half-set PMI environment: {present} is set but {missing} is not")]
    MissingEnv {
        /// The variable (or alternatives) that is missing.
        missing: &'static str,
        /// The variable that is set and needs it.
        present: &'static str,
    },
    /// A PMI variable has a value that cannot be used.
    #[error("invalid PMI environment: {var}={value:?}: {reason}")]
    InvalidEnv {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The file descriptor to use is not a connected stream socket.
    #[error("file descriptor {fd} cannot carry PMI: {reason}")]
    BadFd {
        /// The descriptor number.
        fd: i32,
        /// What is wrong with it.
        reason: String,
    },
    /// `PMI_FD` was already taken over by a client earlier in this process.
    #[error("the PMI_FD socket (fd {fd}) already belongs to a PmiClient of this process")]
    FdTaken {
        /// The descriptor number.
        fd: i32,
    },
    /// Reading from or writing to the server failed.
    #[error("PMI I/O error while {context}: {source}")]
    Io {
        /// What the client was doing.
        context: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The server closed the connection.
    #[error("PMI server closed the connection while {context}")]
    Closed {
        /// What the client was doing.
        context: String,
    },
    /// The server answered with a non-zero `rc`.
    #[error("PMI {command} failed: rc={rc}{}", msg.as_deref().map(|m| format!(", msg={m}")).unwrap_or_default())]
    Server {
        /// The request's command (`put`, `init`, …).
        command: String,
        /// The server's return code.
        rc: i64,
        /// The server's `msg=`, if it gave one.
        msg: Option<String>,
    },
    /// The server does not know the key.
    #[error("PMI key {key:?} not found{}", msg.as_deref().map(|m| format!(" ({m})")).unwrap_or_default())]
    NotFound {
        /// The key.
        key: String,
        /// The server's `msg=`, if it gave one.
        msg: Option<String>,
    },
    /// A line from the server does not follow the protocol.
    #[error("malformed PMI line {line:?}: {reason}")]
    Malformed {
        /// The line (shortened if long).
        line: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The server answered a request with a different command than the protocol says.
    #[error("unexpected PMI reply to {request}: expected cmd={expected}, got {line:?}")]
    Unexpected {
        /// The request's command.
        request: String,
        /// The reply command the protocol prescribes.
        expected: &'static str,
        /// The line received (shortened if long).
        line: String,
    },
    /// The server sent a line longer than [`MAX_LINE_LEN`], or a request would be one.
    #[error("PMI line longer than {limit} bytes")]
    LineTooLong {
        /// The limit.
        limit: usize,
    },
    /// A key, value or KVS name is longer than the server accepts.
    #[error("PMI {what} of {len} bytes is longer than the server's limit of {max} bytes")]
    TooLong {
        /// `"key"` or `"value"`.
        what: &'static str,
        /// Its length.
        len: usize,
        /// The largest length allowed.
        max: usize,
    },
    /// A key or value cannot be carried by PMI-1.
    #[error("PMI {what} {value:?} cannot be sent over PMI-1: {reason} (hex-encode binary data)")]
    InvalidValue {
        /// `"key"` or `"value"`.
        what: &'static str,
        /// The offending text (shortened if long).
        value: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The handshake on a `PMI_PORT` connection did not give a usable rank and size.
    #[error("PMI handshake failed: {reason}")]
    Handshake {
        /// What went wrong.
        reason: String,
    },
    /// An operation that needs [`PmiClient::init`] was called before it.
    #[error("PMI {operation} called before init")]
    NotInitialized {
        /// The operation.
        operation: &'static str,
    },
    /// An operation was called after [`PmiClient::finalize`].
    #[error("PMI {operation} called after finalize")]
    Finalized {
        /// The operation.
        operation: &'static str,
    },
    /// An earlier failure (I/O error, cancelled request, over-long or unexpected line) left
    /// the connection out of step with the server; it cannot be used any more.
    #[error("PMI connection unusable: {reason}")]
    Broken {
        /// The earlier failure.
        reason: String,
    },
}

/// Quotes a line for an error message: lossy UTF-8, shortened to a readable length.
fn quote(line: &[u8]) -> String {
    let text = String::from_utf8_lossy(line);
    if text.len() <= QUOTED_LINE_LEN {
        return text.into_owned();
    }
    let mut end = QUOTED_LINE_LEN;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", &text[..end], line.len())
}

/// One PMI-1 protocol line: a command and its `key=value` pairs.
///
/// [`PmiLine::parse`] accepts keys in any order and keeps the first of repeated keys;
/// [`PmiLine::encode`] writes `cmd=<command>` first and the pairs in the order they were added.
///
/// ```
/// use rankweave::launch::pmi::PmiLine;
///
/// let reply = PmiLine::parse(b"cmd=get_result rc=0 msg=success value=abc\n")?;
/// assert_eq!(reply.cmd(), "get_result");
/// assert_eq!(reply.get("value"), Some("abc"));
/// assert_eq!(reply.rc()?, 0);
///
/// let request = PmiLine::new("get").with("kvsname", "kvs_1").with("key", "k");
/// assert_eq!(request.encode()?, "cmd=get kvsname=kvs_1 key=k\n");
/// # Ok::<(), rankweave::launch::pmi::PmiError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PmiLine {
    cmd: String,
    pairs: Vec<(String, String)>,
}

impl PmiLine {
    /// A line with command `cmd` and no other pairs.
    pub fn new(cmd: impl Into<String>) -> Self {
        PmiLine {
            cmd: cmd.into(),
            pairs: Vec::new(),
        }
    }

    /// Adds `key=value` (checked by [`PmiLine::encode`], not here).
    pub fn with(mut self, key: impl Into<String>, value: impl ToString) -> Self {
        self.pairs.push((key.into(), value.to_string()));
        self
    }

    /// The command (the value of `cmd=`).
    pub fn cmd(&self) -> &str {
        &self.cmd
    }

    /// The value of `key` (the first, if repeated); `None` if absent.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.pairs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// All pairs except `cmd`, in line order.
    pub fn pairs(&self) -> impl Iterator<Item = (&str, &str)> {
        self.pairs.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    /// Parses one line, with or without its trailing `\n` (a `\r` before it is dropped too).
    ///
    /// Pairs are separated by one or more spaces; each must be `key=value` with a non-empty
    /// key (the value runs to the next space and may contain `=`); exactly one key must be
    /// `cmd`, with a non-empty value. Control characters and invalid UTF-8 are refused.
    pub fn parse(line: &[u8]) -> Result<PmiLine, PmiError> {
        let mut body = line.strip_suffix(b"\n").unwrap_or(line);
        body = body.strip_suffix(b"\r").unwrap_or(body);
        let malformed = |reason: &str| PmiError::Malformed {
            line: quote(body),
            reason: reason.to_string(),
        };
        if body.len() > MAX_LINE_LEN {
            return Err(PmiError::LineTooLong {
                limit: MAX_LINE_LEN,
            });
        }
        let text = std::str::from_utf8(body).map_err(|_| malformed("not valid UTF-8"))?;
        if text.chars().any(char::is_control) {
            return Err(malformed("contains a control character"));
        }
        let mut cmd = None;
        let mut pairs = Vec::new();
        for token in text.split(' ').filter(|t| !t.is_empty()) {
            let Some((key, value)) = token.split_once('=') else {
                return Err(malformed(&format!("{token:?} is not key=value")));
            };
            if key.is_empty() {
                return Err(malformed(&format!("{token:?} has an empty key")));
            }
            if key == "cmd" {
                if cmd.is_some() {
                    return Err(malformed("cmd= appears twice"));
                }
                if value.is_empty() {
                    return Err(malformed("cmd= is empty"));
                }
                cmd = Some(value.to_string());
            } else {
                pairs.push((key.to_string(), value.to_string()));
            }
        }
        match cmd {
            Some(cmd) => Ok(PmiLine { cmd, pairs }),
            None if text.trim().is_empty() => Err(malformed("empty line")),
            None => Err(malformed("no cmd= key")),
        }
    }

    /// The line on the wire, `\n` included.
    ///
    /// Fails with [`PmiError::InvalidValue`] if a key or value is empty or holds a space, a
    /// control character or (keys only) `=`, and with [`PmiError::LineTooLong`] if the line
    /// would exceed [`MAX_LINE_LEN`].
    pub fn encode(&self) -> Result<String, PmiError> {
        let check = |what: &'static str, s: &str, is_key: bool| {
            let reason = if s.is_empty() {
                Some("is empty")
            } else if s.contains(' ') {
                Some("contains a space")
            } else if s.chars().any(char::is_control) {
                Some("contains a control character")
            } else if is_key && s.contains('=') {
                Some("contains '='")
            } else {
                None
            };
            match reason {
                Some(reason) => Err(PmiError::InvalidValue {
                    what,
                    value: quote(s.as_bytes()),
                    reason,
                }),
                None => Ok(()),
            }
        };
        check("command", &self.cmd, true)?;
        let mut out = format!("cmd={}", self.cmd);
        for (key, value) in &self.pairs {
            check("key", key, true)?;
            check("value", value, false)?;
            out.push(' ');
            out.push_str(key);
            out.push('=');
            out.push_str(value);
        }
        if out.len() > MAX_LINE_LEN {
            return Err(PmiError::LineTooLong {
                limit: MAX_LINE_LEN,
            });
        }
        out.push('\n');
        Ok(out)
    }

    /// The value of `key`, which must be present.
    pub fn require(&self, key: &str) -> Result<&str, PmiError> {
        self.get(key).ok_or_else(|| PmiError::Malformed {
            line: quote(self.to_string().as_bytes()),
            reason: format!("no {key}= in a {} reply", self.cmd),
        })
    }

    /// The value of `key` as an integer; it must be present.
    pub fn int(&self, key: &str) -> Result<i64, PmiError> {
        let value = self.require(key)?;
        value.parse().map_err(|_| PmiError::Malformed {
            line: quote(self.to_string().as_bytes()),
            reason: format!("{key}={value:?} is not an integer"),
        })
    }

    /// The reply's `rc=`, 0 when absent (many replies carry none).
    pub fn rc(&self) -> Result<i64, PmiError> {
        match self.get("rc") {
            None => Ok(0),
            Some(_) => self.int("rc"),
        }
    }

    /// `Ok` if the reply's `rc` is 0 (or absent), otherwise [`PmiError::Server`] with `msg=`.
    pub fn check_rc(&self, command: &str) -> Result<(), PmiError> {
        match self.rc()? {
            0 => Ok(()),
            rc => Err(PmiError::Server {
                command: command.to_string(),
                rc,
                msg: self.get("msg").map(str::to_string),
            }),
        }
    }
}

impl fmt::Display for PmiLine {
    /// The wire form without the trailing `\n` and without checks.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cmd={}", self.cmd)?;
        for (key, value) in &self.pairs {
            write!(f, " {key}={value}")?;
        }
        Ok(())
    }
}

/// Checks a key or value the caller wants stored: non-empty, printable ASCII without space,
/// `=` or `\`, and shorter than `max` (which counts a NUL, as PMI servers do).
fn check_item(what: &'static str, s: &str, max: usize) -> Result<(), PmiError> {
    let limit = max.saturating_sub(1);
    if s.len() > limit {
        return Err(PmiError::TooLong {
            what,
            len: s.len(),
            max: limit,
        });
    }
    let reason = if s.is_empty() {
        Some("it is empty")
    } else {
        s.bytes().find_map(|b| match b {
            b' ' => Some("it contains a space"),
            b'=' => Some("it contains '='"),
            b'\\' => Some("it contains a backslash"),
            0x80.. => Some("it contains non-ASCII characters"),
            b if b < 0x21 || b == 0x7f => Some("it contains a control character"),
            _ => None,
        })
    };
    match reason {
        Some(reason) => Err(PmiError::InvalidValue {
            what,
            value: quote(s.as_bytes()),
            reason,
        }),
        None => Ok(()),
    }
}

/// Lowercase hexadecimal of `bytes`: a form of any data that PMI-1 can carry (twice as long).
pub fn hex_encode(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        out.push(DIGITS[usize::from(b >> 4)] as char);
        out.push(DIGITS[usize::from(b & 0xf)] as char);
    }
    out
}

/// The bytes [`hex_encode`] made `text` from (either case accepted); `None` if `text` is not
/// an even number of hex digits.
pub fn hex_decode(text: &str) -> Option<Vec<u8>> {
    fn digit(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            b'A'..=b'F' => Some(c - b'A' + 10),
            _ => None,
        }
    }
    let bytes = text.as_bytes();
    if bytes.len() % 2 != 0 {
        return None;
    }
    bytes
        .chunks_exact(2)
        .map(|pair| Some(digit(pair[0])? << 4 | digit(pair[1])?))
        .collect()
}

/// Splits a byte stream into lines, refusing lines longer than a limit (sans-IO).
#[derive(Debug)]
struct LineDecoder {
    buf: Vec<u8>,
    /// Bytes of `buf` already searched for `\n`.
    scanned: usize,
    limit: usize,
}

impl LineDecoder {
    fn new(limit: usize) -> Self {
        LineDecoder {
            buf: Vec::new(),
            scanned: 0,
            limit,
        }
    }

    fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next complete line without its `\n`; `Ok(None)` if more bytes are needed.
    fn next_line(&mut self) -> Result<Option<Vec<u8>>, PmiError> {
        let too_long = PmiError::LineTooLong { limit: self.limit };
        match self.buf[self.scanned..].iter().position(|&b| b == b'\n') {
            Some(offset) => {
                let end = self.scanned + offset;
                if end > self.limit {
                    return Err(too_long);
                }
                let line = self.buf[..end].to_vec();
                self.buf.drain(..=end);
                self.scanned = 0;
                Ok(Some(line))
            }
            None if self.buf.len() > self.limit => Err(too_long),
            None => {
                self.scanned = self.buf.len();
                Ok(None)
            }
        }
    }
}

/// Where the launcher's environment says the PMI server is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PmiEnv {
    /// `PMI_FD`, `PMI_RANK`, `PMI_SIZE`: an inherited connected socket.
    Fd {
        /// The inherited descriptor.
        fd: i32,
        /// This process's rank.
        rank: usize,
        /// The number of processes.
        size: usize,
    },
    /// `PMI_PORT`, `PMI_ID`: connect, then learn rank and size from the `initack` handshake.
    Port {
        /// `host:port` of the server.
        addr: String,
        /// The id to present in `cmd=initack pmiid=<id>`.
        id: i64,
    },
    /// `PMI_PORT`, `PMI_RANK`, `PMI_SIZE`: connect; rank and size come from the environment.
    PortWithRank {
        /// `host:port` of the server.
        addr: String,
        /// This process's rank.
        rank: usize,
        /// The number of processes.
        size: usize,
    },
}

impl PmiEnv {
    /// Reads this process's environment; `Ok(None)` when no PMI variable is set.
    pub fn from_env() -> Result<Option<PmiEnv>, PmiError> {
        PmiEnv::from_lookup(|var| match std::env::var(var) {
            Ok(value) => Some(value),
            Err(std::env::VarError::NotPresent) => None,
            Err(std::env::VarError::NotUnicode(value)) => {
                Some(value.to_string_lossy().into_owned())
            }
        })
    }

    /// Like [`PmiEnv::from_env`], reading variables through `lookup` (for tests and for
    /// callers that keep their own environment).
    ///
    /// Errors: [`PmiError::MissingEnv`] for a half-set environment (`PMI_FD` without
    /// `PMI_RANK` or `PMI_SIZE`; `PMI_PORT` without `PMI_ID` or the pair; `PMI_ID`, `PMI_RANK`
    /// or `PMI_SIZE` without `PMI_FD` or `PMI_PORT`), [`PmiError::InvalidEnv`] for a value
    /// that is not a number, a `PMI_PORT` that is not `host:port`, or a rank not below the size.
    pub fn from_lookup(
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<PmiEnv>, PmiError> {
        let rank_size = |present: &'static str| {
            let rank = lookup("PMI_RANK").ok_or(PmiError::MissingEnv {
                missing: "PMI_RANK",
                present,
            })?;
            let size = lookup("PMI_SIZE").ok_or(PmiError::MissingEnv {
                missing: "PMI_SIZE",
                present,
            })?;
            let rank = parse_env_int("PMI_RANK", &rank, 0)?;
            let size = parse_env_int("PMI_SIZE", &size, 1)?;
            if rank >= size {
                return Err(PmiError::InvalidEnv {
                    var: "PMI_RANK",
                    value: rank.to_string(),
                    reason: format!("not below PMI_SIZE={size}"),
                });
            }
            Ok((rank as usize, size as usize))
        };

        if let Some(fd) = lookup("PMI_FD") {
            let fd = parse_env_int("PMI_FD", &fd, 0)?;
            let (rank, size) = rank_size("PMI_FD")?;
            return Ok(Some(PmiEnv::Fd {
                fd: fd as i32,
                rank,
                size,
            }));
        }
        if let Some(addr) = lookup("PMI_PORT") {
            let bad = |reason: &str| PmiError::InvalidEnv {
                var: "PMI_PORT",
                value: addr.clone(),
                reason: reason.to_string(),
            };
            let (host, port) = addr.rsplit_once(':').ok_or_else(|| bad("not host:port"))?;
            if host.is_empty() {
                return Err(bad("the host is empty"));
            }
            match port.parse::<u16>() {
                Ok(p) if p > 0 => {}
                _ => return Err(bad("the port is not a number from 1 to 65535")),
            }
            if let Some(id) = lookup("PMI_ID") {
                let id = id.trim().parse::<i64>().map_err(|_| PmiError::InvalidEnv {
                    var: "PMI_ID",
                    value: id.clone(),
                    reason: "not an integer".to_string(),
                })?;
                return Ok(Some(PmiEnv::Port { addr, id }));
            }
            if lookup("PMI_RANK").is_none() && lookup("PMI_SIZE").is_none() {
                return Err(PmiError::MissingEnv {
                    missing: "PMI_ID (or PMI_RANK and PMI_SIZE)",
                    present: "PMI_PORT",
                });
            }
            let (rank, size) = rank_size("PMI_PORT")?;
            return Ok(Some(PmiEnv::PortWithRank { addr, rank, size }));
        }
        for var in ["PMI_ID", "PMI_RANK", "PMI_SIZE"] {
            if lookup(var).is_some() {
                return Err(PmiError::MissingEnv {
                    missing: "PMI_FD or PMI_PORT",
                    present: var,
                });
            }
        }
        Ok(None)
    }
}

/// Parses a non-negative integer variable that must be at least `min` and fit an `i32`.
fn parse_env_int(var: &'static str, value: &str, min: i64) -> Result<i64, PmiError> {
    let bad = |reason: String| PmiError::InvalidEnv {
        var,
        value: value.to_string(),
        reason,
    };
    let n: i64 = value
        .trim()
        .parse()
        .map_err(|_| bad("not an integer".to_string()))?;
    if n < min || n > i64::from(i32::MAX) {
        return Err(bad(format!("out of range {min}..={}", i32::MAX)));
    }
    Ok(n)
}

/// The connection [`PmiClient::from_env`] makes: a Unix-domain or TCP stream socket.
#[derive(Debug)]
pub enum PmiStream {
    /// An inherited Unix-domain socket (Hydra's socketpair).
    Unix(tokio::net::UnixStream),
    /// A TCP connection (`PMI_PORT`, or an inherited TCP socket).
    Tcp(tokio::net::TcpStream),
}

impl AsyncRead for PmiStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            PmiStream::Unix(s) => Pin::new(s).poll_read(cx, buf),
            PmiStream::Tcp(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for PmiStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            PmiStream::Unix(s) => Pin::new(s).poll_write(cx, buf),
            PmiStream::Tcp(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            PmiStream::Unix(s) => Pin::new(s).poll_flush(cx),
            PmiStream::Tcp(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            PmiStream::Unix(s) => Pin::new(s).poll_shutdown(cx),
            PmiStream::Tcp(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

#[cfg(unix)]
mod fd {
    //! Taking over the inherited `PMI_FD` socket.

    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::{PmiError, PmiStream};

    /// Set once `PMI_FD` has been turned into an [`OwnedFd`], so it is never owned twice.
    static TAKEN: AtomicBool = AtomicBool::new(false);

    /// Checks that `fd` is an open stream socket.
    pub(super) fn check_stream_socket(fd: RawFd) -> Result<(), PmiError> {
        let bad = |reason: String| PmiError::BadFd { fd, reason };
        let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: `fstat` writes at most one `struct stat` through the pointer, which points at
        // storage of exactly that type; an invalid `fd` makes it fail with EBADF, nothing worse.
        if unsafe { libc::fstat(fd, st.as_mut_ptr()) } != 0 {
            return Err(bad(format!(
                "not an open file descriptor ({})",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: `fstat` returned 0, so it filled in `st`.
        let st = unsafe { st.assume_init() };
        if st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
            return Err(bad("not a socket".to_string()));
        }
        let mut ty: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: SO_TYPE yields one `c_int`; `ty` and `len` are valid for writes of their
        // types and `len` holds the size of `ty`.
        let rc = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_TYPE,
                (&raw mut ty).cast(),
                &raw mut len,
            )
        };
        if rc != 0 {
            return Err(bad(format!(
                "cannot query the socket type ({})",
                std::io::Error::last_os_error()
            )));
        }
        if ty != libc::SOCK_STREAM {
            return Err(bad("not a stream socket".to_string()));
        }
        Ok(())
    }

    /// Takes ownership of the inherited `PMI_FD` descriptor, once per process.
    pub(super) fn take_inherited(fd: RawFd) -> Result<OwnedFd, PmiError> {
        if TAKEN.swap(true, Ordering::SeqCst) {
            return Err(PmiError::FdTaken { fd });
        }
        if let Err(e) = check_stream_socket(fd) {
            TAKEN.store(false, Ordering::SeqCst);
            return Err(e);
        }
        // SAFETY: the launcher opened `fd` for this process's PMI client and nothing else in
        // the process uses it: it is only reachable through `PMI_FD`, which `TAKEN` lets this
        // function turn into an owner once. `check_stream_socket` confirmed it is open (and a
        // stream socket), so the `OwnedFd` closes a descriptor that really is ours.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        // Keep programs this process runs from inheriting the job's PMI connection.
        // SAFETY: F_SETFD with FD_CLOEXEC only changes the flags of a descriptor we own.
        unsafe { libc::fcntl(owned.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
        Ok(owned)
    }

    /// Wraps an owned stream socket for tokio, as Unix-domain or TCP by its address family.
    pub(super) fn into_stream(fd: OwnedFd) -> Result<PmiStream, PmiError> {
        let raw = fd.as_raw_fd();
        check_stream_socket(raw)?;
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(PmiError::Io {
                context: format!("wrapping fd {raw}"),
                source: std::io::Error::other("no tokio runtime is running"),
            });
        }
        let io_err = |context: &str, source| PmiError::Io {
            context: format!("{context} fd {raw}"),
            source,
        };
        let unix = std::os::unix::net::UnixStream::from(fd);
        // `local_addr` only succeeds for an AF_UNIX socket (named or not).
        if unix.local_addr().is_ok() {
            unix.set_nonblocking(true)
                .map_err(|e| io_err("setting non-blocking mode on", e))?;
            let stream =
                tokio::net::UnixStream::from_std(unix).map_err(|e| io_err("registering", e))?;
            return Ok(PmiStream::Unix(stream));
        }
        let tcp = std::net::TcpStream::from(OwnedFd::from(unix));
        tcp.set_nonblocking(true)
            .map_err(|e| io_err("setting non-blocking mode on", e))?;
        let _ = tcp.set_nodelay(true);
        let stream = tokio::net::TcpStream::from_std(tcp).map_err(|e| io_err("registering", e))?;
        Ok(PmiStream::Tcp(stream))
    }
}

/// Where the client is in the PMI session.
#[derive(Debug)]
enum Session {
    Connected,
    Ready { kvsname: String, maxes: PmiMaxes },
    Finalized,
}

/// The server's length limits, from `get_maxes`. Each counts C's terminating NUL, so the
/// longest key is `keylen_max - 1` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PmiMaxes {
    /// Longest KVS name.
    pub kvsname_max: usize,
    /// Longest key.
    pub keylen_max: usize,
    /// Longest value.
    pub vallen_max: usize,
}

/// A PMI-1 client over a byte stream `S` (by default the socket the launcher provided).
///
/// Requests are strictly one at a time (`&mut self`). Dropping a request's future before it
/// completes (for instance through `tokio::time::timeout`) leaves the reply unread, so the
/// client refuses further requests with [`PmiError::Broken`]; so do I/O errors and over-long
/// or unexpected lines. Error replies (`rc≠0`) and malformed lines leave it usable.
#[derive(Debug)]
pub struct PmiClient<S = PmiStream> {
    io: S,
    lines: LineDecoder,
    rank: usize,
    size: usize,
    debug: i64,
    session: Session,
    broken: Option<String>,
}

impl PmiClient<PmiStream> {
    /// Connects the way the launcher's environment says ([`PmiEnv::from_env`]); call
    /// [`init`](PmiClient::init) next.
    ///
    /// Fails with [`PmiError::NotLaunched`] when no PMI variable is set, [`PmiError::MissingEnv`]
    /// / [`PmiError::InvalidEnv`] for a half-set or invalid environment, and
    /// [`PmiError::FdTaken`] when `PMI_FD` was taken over by an earlier call.
    pub async fn from_env() -> Result<Self, PmiError> {
        match PmiEnv::from_env()? {
            Some(env) => PmiClient::from_pmi_env(env).await,
            None => Err(PmiError::NotLaunched),
        }
    }

    /// Connects as `env` describes. For [`PmiEnv::Fd`], the descriptor is taken over (once per
    /// process: a second attempt gives [`PmiError::FdTaken`]) after checking it is an open
    /// stream socket.
    pub async fn from_pmi_env(env: PmiEnv) -> Result<Self, PmiError> {
        match env {
            PmiEnv::Fd { fd, rank, size } => {
                #[cfg(unix)]
                {
                    let owned = fd::take_inherited(fd)?;
                    Ok(PmiClient::new(fd::into_stream(owned)?, rank, size))
                }
                #[cfg(not(unix))]
                {
                    let _ = (rank, size);
                    Err(PmiError::BadFd {
                        fd,
                        reason: "inherited descriptors are only supported on Unix".to_string(),
                    })
                }
            }
            PmiEnv::Port { addr, id } => {
                let stream = PmiClient::connect_tcp(&addr).await?;
                PmiClient::handshake(stream, id).await
            }
            PmiEnv::PortWithRank { addr, rank, size } => {
                let stream = PmiClient::connect_tcp(&addr).await?;
                Ok(PmiClient::new(stream, rank, size))
            }
        }
    }

    /// A client over `fd`, an open connected stream socket owned by the caller (checked).
    ///
    /// Must be called inside a tokio runtime (an error otherwise).
    ///
    /// # Panics
    ///
    /// If the runtime was built without its I/O driver (as tokio's own `from_std` does).
    #[cfg(unix)]
    pub fn from_owned_fd(
        fd: std::os::fd::OwnedFd,
        rank: usize,
        size: usize,
    ) -> Result<Self, PmiError> {
        Ok(PmiClient::new(fd::into_stream(fd)?, rank, size))
    }

    async fn connect_tcp(addr: &str) -> Result<PmiStream, PmiError> {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|source| PmiError::Io {
                context: format!("connecting to PMI_PORT {addr}"),
                source,
            })?;
        let _ = stream.set_nodelay(true);
        Ok(PmiStream::Tcp(stream))
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> PmiClient<S> {
    /// A client over an already connected stream, with rank and size known (as with `PMI_FD`).
    pub fn new(io: S, rank: usize, size: usize) -> Self {
        PmiClient {
            io,
            lines: LineDecoder::new(MAX_LINE_LEN),
            rank,
            size,
            debug: 0,
            session: Session::Connected,
            broken: None,
        }
    }

    /// A client over a fresh `PMI_PORT` connection: sends `cmd=initack pmiid=<id>` and reads
    /// `cmd=initack` and the `cmd=set` lines giving size, rank and debug level (in any order).
    pub async fn handshake(io: S, id: i64) -> Result<Self, PmiError> {
        let mut client = PmiClient::new(io, 0, 1);
        client
            .send(
                &PmiLine::new("initack").with("pmiid", id),
                "sending initack",
            )
            .await?;
        let ack = client.receive("waiting for initack").await?;
        if ack.cmd() != "initack" {
            return Err(client.unexpected("initack", "initack", &ack));
        }
        ack.check_rc("initack")?;
        let (mut size, mut rank, mut debug) = (None, None, None);
        for _ in 0..3 {
            if size.is_some() && rank.is_some() && debug.is_some() {
                break;
            }
            let set = client.receive("reading the handshake's set lines").await?;
            if set.cmd() != "set" {
                return Err(client.unexpected("initack", "set", &set));
            }
            for (key, _) in set.pairs() {
                match key {
                    "size" => size = Some(set.int("size")?),
                    "rank" => rank = Some(set.int("rank")?),
                    "debug" => debug = Some(set.int("debug")?),
                    _ => {}
                }
            }
        }
        let handshake = |reason: String| PmiError::Handshake { reason };
        let size = size.ok_or_else(|| handshake("the server sent no size".to_string()))?;
        let rank = rank.ok_or_else(|| handshake("the server sent no rank".to_string()))?;
        if size < 1 || size > i64::from(i32::MAX) {
            return Err(handshake(format!("size {size} out of range")));
        }
        if rank < 0 || rank >= size {
            return Err(handshake(format!("rank {rank} not in 0..{size}")));
        }
        client.rank = rank as usize;
        client.size = size as usize;
        client.debug = debug.unwrap_or(0);
        Ok(client)
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of processes in the job.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The debug level the server gave in the `PMI_PORT` handshake (0 otherwise).
    pub fn debug_level(&self) -> i64 {
        self.debug
    }

    /// The job's KVS name, known after [`init`](PmiClient::init).
    pub fn kvsname(&self) -> Option<&str> {
        match &self.session {
            Session::Ready { kvsname, .. } => Some(kvsname),
            _ => None,
        }
    }

    /// The server's length limits, known after [`init`](PmiClient::init).
    pub fn maxes(&self) -> Option<PmiMaxes> {
        match &self.session {
            Session::Ready { maxes, .. } => Some(*maxes),
            _ => None,
        }
    }

    /// Starts the PMI session: `init` (version 1.1), `get_maxes` and `get_my_kvsname`. Calling
    /// it again after it succeeded does nothing.
    pub async fn init(&mut self) -> Result<(), PmiError> {
        match self.session {
            Session::Connected => {}
            Session::Ready { .. } => return Ok(()),
            Session::Finalized => return Err(PmiError::Finalized { operation: "init" }),
        }
        let (version, subversion) = PMI_VERSION;
        let reply = self
            .request(
                &PmiLine::new("init")
                    .with("pmi_version", version)
                    .with("pmi_subversion", subversion),
                "response_to_init",
            )
            .await?;
        reply.check_rc("init")?;
        if let Some(v) = reply
            .get("pmi_version")
            .filter(|v| *v != version.to_string())
        {
            return Err(PmiError::Server {
                command: "init".to_string(),
                rc: 0,
                msg: Some(format!(
                    "the server speaks PMI version {v}, this client {version}"
                )),
            });
        }

        let reply = self.request(&PmiLine::new("get_maxes"), "maxes").await?;
        reply.check_rc("get_maxes")?;
        let max = |key: &str| -> Result<usize, PmiError> {
            let n = reply.int(key)?;
            if n < 2 {
                return Err(PmiError::Malformed {
                    line: quote(reply.to_string().as_bytes()),
                    reason: format!("{key}={n} leaves no room for any text"),
                });
            }
            // Larger limits than a line can hold are limited by the line instead.
            Ok(n.min(MAX_LINE_LEN as i64) as usize)
        };
        let maxes = PmiMaxes {
            kvsname_max: max("kvsname_max")?,
            keylen_max: max("keylen_max")?,
            vallen_max: max("vallen_max")?,
        };

        let reply = self
            .request(&PmiLine::new("get_my_kvsname"), "my_kvsname")
            .await?;
        reply.check_rc("get_my_kvsname")?;
        let kvsname = reply.require("kvsname")?;
        if kvsname.is_empty() {
            return Err(PmiError::Malformed {
                line: quote(reply.to_string().as_bytes()),
                reason: "empty kvsname".to_string(),
            });
        }
        self.session = Session::Ready {
            kvsname: kvsname.to_string(),
            maxes,
        };
        Ok(())
    }

    /// Stores `key=value` in the job's key-value space (visible to others after a
    /// [`barrier`](PmiClient::barrier)).
    ///
    /// Both must be non-empty printable ASCII without space, `=` or `\`
    /// ([`PmiError::InvalidValue`]) and within the server's limits ([`PmiError::TooLong`]);
    /// nothing is sent otherwise.
    pub async fn put(&mut self, key: &str, value: &str) -> Result<(), PmiError> {
        let (kvsname, maxes) = self.ready("put")?;
        check_item("key", key, maxes.keylen_max)?;
        check_item("value", value, maxes.vallen_max)?;
        let line = PmiLine::new("put")
            .with("kvsname", kvsname)
            .with("key", key)
            .with("value", value);
        let reply = self.request(&line, "put_result").await?;
        reply.check_rc("put")
    }

    /// Waits until every process of the job has entered the barrier.
    pub async fn barrier(&mut self) -> Result<(), PmiError> {
        self.ready("barrier")?;
        let reply = self
            .request(&PmiLine::new("barrier_in"), "barrier_out")
            .await?;
        reply.check_rc("barrier")
    }

    /// The value stored under `key`; [`PmiError::NotFound`] if there is none (a non-zero `rc`
    /// without `msg=` or with a "not found" message, or `found=FALSE`).
    pub async fn get(&mut self, key: &str) -> Result<String, PmiError> {
        let (kvsname, maxes) = self.ready("get")?;
        check_item("key", key, maxes.keylen_max)?;
        let line = PmiLine::new("get")
            .with("kvsname", kvsname)
            .with("key", key);
        let reply = self.request(&line, "get_result").await?;
        let rc = reply.rc()?;
        let msg = reply.get("msg").map(str::to_string);
        let not_found = || PmiError::NotFound {
            key: key.to_string(),
            msg: msg.clone(),
        };
        if rc != 0 {
            // Hydra 4.0 answers `rc=-1 msg=key_<key>_not_found`, Slurm a bare `rc=1`.
            if msg
                .as_deref()
                .is_none_or(|m| m.contains("not_found") || m.contains("not found"))
            {
                return Err(not_found());
            }
            return Err(PmiError::Server {
                command: "get".to_string(),
                rc,
                msg,
            });
        }
        // Later MPICH answers `rc=0 found=FALSE`.
        if reply
            .get("found")
            .is_some_and(|f| f.eq_ignore_ascii_case("false") || f == "0")
        {
            return Err(not_found());
        }
        Ok(reply.require("value")?.to_string())
    }

    /// Ends the PMI session (`finalize` / `finalize_ack`). Further operations fail with
    /// [`PmiError::Finalized`].
    pub async fn finalize(&mut self) -> Result<(), PmiError> {
        self.ready("finalize")?;
        let reply = self
            .request(&PmiLine::new("finalize"), "finalize_ack")
            .await?;
        self.session = Session::Finalized;
        reply.check_rc("finalize")
    }

    /// Asks the launcher to end the whole job with exit code `code`, reporting `message`.
    ///
    /// Sends `cmd=abort exitcode=<code> message=<message>` and returns once it is written: the
    /// server does not answer. Characters PMI-1 cannot carry in `message` become `_`, and it is
    /// shortened to 1000 bytes. The caller should exit with `code` itself in case the launcher
    /// does not end the process. Works in any state, even on a connection that is out of step.
    pub async fn abort(&mut self, code: i32, message: &str) -> Result<(), PmiError> {
        let mut line = PmiLine::new("abort").with("exitcode", code);
        let text: String = message
            .chars()
            .map(|c| match c {
                '!'..='~' if c != '=' && c != '\\' => c,
                _ => '_',
            })
            .take(MAX_ABORT_MESSAGE)
            .collect();
        if !text.is_empty() {
            line = line.with("message", text);
        }
        let wire = line.encode()?;
        self.write(wire.as_bytes(), "sending abort").await
    }

    fn ready(&self, operation: &'static str) -> Result<(String, PmiMaxes), PmiError> {
        match &self.session {
            Session::Ready { kvsname, maxes } => Ok((kvsname.clone(), *maxes)),
            Session::Connected => Err(PmiError::NotInitialized { operation }),
            Session::Finalized => Err(PmiError::Finalized { operation }),
        }
    }

    /// Sends `line` and reads the reply, which must be `cmd=<expected>`.
    async fn request(
        &mut self,
        line: &PmiLine,
        expected: &'static str,
    ) -> Result<PmiLine, PmiError> {
        let context = format!("waiting for the reply to {}", line.cmd());
        self.send(line, &format!("sending {}", line.cmd())).await?;
        let reply = self.receive(&context).await?;
        if reply.cmd() != expected {
            return Err(self.unexpected(line.cmd(), expected, &reply));
        }
        Ok(reply)
    }

    fn unexpected(&mut self, request: &str, expected: &'static str, reply: &PmiLine) -> PmiError {
        let err = PmiError::Unexpected {
            request: request.to_string(),
            expected,
            line: quote(reply.to_string().as_bytes()),
        };
        // The reply to the request may still be on its way: the stream is out of step.
        self.broken = Some(err.to_string());
        err
    }

    async fn send(&mut self, line: &PmiLine, context: &str) -> Result<(), PmiError> {
        if let Some(reason) = &self.broken {
            return Err(PmiError::Broken {
                reason: reason.clone(),
            });
        }
        let wire = line.encode()?;
        self.write(wire.as_bytes(), context).await?;
        // Until the reply has been read, a cancelled future leaves it in the stream.
        self.broken = Some(format!(
            "a {} request was cancelled before its reply arrived",
            line.cmd()
        ));
        Ok(())
    }

    async fn write(&mut self, bytes: &[u8], context: &str) -> Result<(), PmiError> {
        let result = async {
            self.io.write_all(bytes).await?;
            self.io.flush().await
        }
        .await;
        result.map_err(|source| {
            let err = PmiError::Io {
                context: context.to_string(),
                source,
            };
            self.broken = Some(err.to_string());
            err
        })
    }

    /// Reads and parses the next line.
    async fn receive(&mut self, context: &str) -> Result<PmiLine, PmiError> {
        let raw = self.read_line(context).await.inspect_err(|e| {
            self.broken = Some(e.to_string());
        })?;
        self.broken = None;
        PmiLine::parse(&raw)
    }

    async fn read_line(&mut self, context: &str) -> Result<Vec<u8>, PmiError> {
        let mut chunk = [0u8; 4096];
        loop {
            if let Some(line) = self.lines.next_line()? {
                return Ok(line);
            }
            let n = self
                .io
                .read(&mut chunk)
                .await
                .map_err(|source| PmiError::Io {
                    context: context.to_string(),
                    source,
                })?;
            if n == 0 {
                return Err(PmiError::Closed {
                    context: context.to_string(),
                });
            }
            self.lines.push(&chunk[..n]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_keys_in_any_order_and_ignores_unknown_ones() {
        let line =
            PmiLine::parse(b"vallen_max=1024 cmd=maxes extra=1 kvsname_max=256 keylen_max=64\n")
                .unwrap();
        assert_eq!(line.cmd(), "maxes");
        assert_eq!(line.int("vallen_max").unwrap(), 1024);
        assert_eq!(line.int("keylen_max").unwrap(), 64);
        assert_eq!(line.get("missing"), None);
        assert_eq!(line.rc().unwrap(), 0);
    }

    #[test]
    fn values_may_contain_equals_and_lines_may_end_in_crlf() {
        let line = PmiLine::parse(b"cmd=get_result rc=0 value=a=b  msg=success\r\n").unwrap();
        assert_eq!(line.get("value"), Some("a=b"));
        assert_eq!(line.get("msg"), Some("success"));
    }

    #[test]
    fn first_of_repeated_keys_wins() {
        let line = PmiLine::parse(b"cmd=x k=1 k=2").unwrap();
        assert_eq!(line.get("k"), Some("1"));
    }

    #[test]
    fn malformed_lines_are_errors_naming_the_line() {
        for bad in [
            &b""[..],
            b"\n",
            b"   ",
            b"garbage",
            b"cmd=x noequals",
            b"cmd=x =value",
            b"key=value",
            b"cmd= k=v",
            b"cmd=a cmd=b",
            b"cmd=x k=\x00",
            b"cmd=x k=\xff\xfe",
            b"cmd=x\tk=v",
        ] {
            match PmiLine::parse(bad) {
                Err(PmiError::Malformed { line, .. }) => {
                    assert_eq!(line, String::from_utf8_lossy(bad).trim_end_matches('\n'))
                }
                other => panic!("{bad:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn rc_must_be_an_integer() {
        let line = PmiLine::parse(b"cmd=put_result rc=zero").unwrap();
        assert!(matches!(line.rc(), Err(PmiError::Malformed { .. })));
        let line = PmiLine::parse(b"cmd=put_result rc=1 msg=no").unwrap();
        match line.check_rc("put") {
            Err(PmiError::Server { command, rc, msg }) => {
                assert_eq!(
                    (command.as_str(), rc, msg.as_deref()),
                    ("put", 1, Some("no"))
                )
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn encode_round_trips_and_refuses_unsendable_text() {
        let line = PmiLine::new("put")
            .with("kvsname", "kvs_1")
            .with("key", "k")
            .with("value", "v=1");
        let wire = line.encode().unwrap();
        assert_eq!(wire, "cmd=put kvsname=kvs_1 key=k value=v=1\n");
        assert_eq!(PmiLine::parse(wire.as_bytes()).unwrap(), line);
        for bad in [
            PmiLine::new("put").with("key", "a b"),
            PmiLine::new("put").with("key", ""),
            PmiLine::new("put").with("k=y", "v"),
            PmiLine::new("put").with("key", "a\nb"),
            PmiLine::new("bad cmd"),
        ] {
            assert!(
                matches!(bad.encode(), Err(PmiError::InvalidValue { .. })),
                "{bad:?}"
            );
        }
        let huge = PmiLine::new("put").with("value", "x".repeat(MAX_LINE_LEN));
        assert!(matches!(huge.encode(), Err(PmiError::LineTooLong { .. })));
    }

    #[test]
    fn item_checks() {
        assert!(check_item("key", "rank-0.addr_1:x", 64).is_ok());
        assert!(matches!(
            check_item("key", &"k".repeat(64), 64),
            Err(PmiError::TooLong {
                len: 64,
                max: 63,
                ..
            })
        ));
        assert!(check_item("key", &"k".repeat(63), 64).is_ok());
        for (bad, reason) in [
            ("", "it is empty"),
            ("a b", "it contains a space"),
            ("a=b", "it contains '='"),
            ("a\\b", "it contains a backslash"),
            ("é", "it contains non-ASCII characters"),
            ("a\tb", "it contains a control character"),
        ] {
            match check_item("value", bad, 64) {
                Err(PmiError::InvalidValue { reason: r, .. }) => assert_eq!(r, reason),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn hex_round_trip() {
        let data: Vec<u8> = (0..=255).collect();
        let text = hex_encode(&data);
        assert!(check_item("value", &text, 1024).is_ok());
        assert_eq!(hex_decode(&text).unwrap(), data);
        assert_eq!(hex_decode("0A0b").unwrap(), vec![10, 11]);
        assert_eq!(hex_decode("abc"), None);
        assert_eq!(hex_decode("zz"), None);
    }

    #[test]
    fn decoder_splits_lines_across_chunks_and_bounds_them() {
        let mut d = LineDecoder::new(16);
        d.push(b"cmd=a\ncmd=");
        assert_eq!(d.next_line().unwrap().unwrap(), b"cmd=a");
        assert_eq!(d.next_line().unwrap(), None);
        d.push(b"b\n");
        assert_eq!(d.next_line().unwrap().unwrap(), b"cmd=b");
        assert_eq!(d.next_line().unwrap(), None);

        let mut d = LineDecoder::new(16);
        d.push(&[b'x'; 17]);
        assert!(matches!(
            d.next_line(),
            Err(PmiError::LineTooLong { limit: 16 })
        ));
        let mut d = LineDecoder::new(16);
        d.push(b"0123456789abcdefg\n");
        assert!(matches!(
            d.next_line(),
            Err(PmiError::LineTooLong { limit: 16 })
        ));
        let mut d = LineDecoder::new(16);
        d.push(b"0123456789abcdef\n");
        assert_eq!(d.next_line().unwrap().unwrap().len(), 16);
    }

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }

    #[test]
    fn environment_detection() {
        assert_eq!(PmiEnv::from_lookup(lookup(&[])).unwrap(), None);
        assert_eq!(
            PmiEnv::from_lookup(lookup(&[
                ("PMI_FD", "6"),
                ("PMI_RANK", "1"),
                ("PMI_SIZE", "3")
            ]))
            .unwrap(),
            Some(PmiEnv::Fd {
                fd: 6,
                rank: 1,
                size: 3
            })
        );
        assert_eq!(
            PmiEnv::from_lookup(lookup(&[("PMI_PORT", "vm:42655"), ("PMI_ID", "2")])).unwrap(),
            Some(PmiEnv::Port {
                addr: "vm:42655".into(),
                id: 2
            })
        );
        assert_eq!(
            PmiEnv::from_lookup(lookup(&[
                ("PMI_PORT", "127.0.0.1:1"),
                ("PMI_RANK", "0"),
                ("PMI_SIZE", "1")
            ]))
            .unwrap(),
            Some(PmiEnv::PortWithRank {
                addr: "127.0.0.1:1".into(),
                rank: 0,
                size: 1
            })
        );
    }
}
