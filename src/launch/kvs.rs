//! Rendezvous key-value service: how the processes of a job find each other when no PMI server
//! does it for them (`rwrun`, Open MPI / Slurm / torchrun-style environments).
//!
//! One process serves a [`KvServer`]; every rank connects a [`KvClient`] to it, publishes its
//! endpoints with [`put`](KvClient::put), waits for everyone with [`fence`](KvClient::fence)
//! and reads the others' endpoints with [`get`](KvClient::get).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), rankweave::launch::kvs::KvError> {
//! use rankweave::launch::kvs::{KvClient, KvServer};
//!
//! let server = KvServer::bind("127.0.0.1:0", 2).await?;
//! let addr = server.local_addr();
//! let ranks: Vec<_> = (0..2)
//!     .map(|rank| {
//!         tokio::spawn(async move {
//!             let mut kv = KvClient::connect(addr).await?;
//!             kv.put(&format!("addr-{rank}"), format!("endpoint of {rank}").as_bytes()).await?;
//!             kv.fence().await?;
//!             let other = kv.get(&format!("addr-{}", 1 - rank)).await?;
//!             kv.close().await?;
//!             Ok::<_, rankweave::launch::kvs::KvError>(other)
//!         })
//!     })
//!     .collect();
//! for (rank, task) in ranks.into_iter().enumerate() {
//!     assert_eq!(task.await.unwrap()?, format!("endpoint of {}", 1 - rank).into_bytes());
//! }
//! server.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! # Semantics
//!
//! * `put(key, value)` stores a binary value (overwriting an earlier one) and wakes every `get`
//!   waiting for the key.
//! * `get(key)` answers as soon as the key exists, waiting for it if needed, at most the
//!   server's timeout ([`KvServerConfig::timeout`], default [`DEFAULT_TIMEOUT`]), after which it
//!   fails with [`KvError::Timeout`].
//! * `fence()` returns once `expected_ranks` calls to it (one per connection at a time) have
//!   arrived; the next call starts the next fence generation. If the generation does not fill
//!   within the timeout, every waiter gets [`KvError::Timeout`], and so does every later fence
//!   at once (a rank is missing; waiting again would only repeat the timeout).
//! * A connection that has put or fenced is a *participant*. If a participant disconnects
//!   without [`KvClient::close`] (its process died, or it dropped the client), the open fence
//!   generation fails at once for everyone waiting in it with [`KvError::FenceFailed`], and so
//!   does every later fence: the job has lost a rank. Connections that only `get` (monitoring
//!   tools) may come and go freely.
//! * Bad input (wrong magic, unknown operation, truncated or over-long frame, key over
//!   [`MAX_KEY_LEN`], value over [`MAX_VALUE_LEN`], a request sent before the previous reply
//!   arrived) is answered with an error frame when possible and the connection is closed;
//!   the server never panics on client input and keeps serving the others.
//!
//! # Wire format (version 1)
//!
//! TCP; every message is a *frame*: a 4-byte big-endian body length (1 to
//! 1 MiB + 1 KiB + 9) followed by the body. Inside bodies, `u32` is big-endian and
//! `bytes` is a `u32` length followed by that many bytes (binary-safe). The client sends one
//! request and waits for its reply before sending the next.
//!
//! | request body | meaning | reply body |
//! |---|---|---|
//! | `0x00` `"RWKV"` `version: u8` | hello, first frame of every connection (version 1) | `0x02` `expected_ranks: u32` |
//! | `0x01` `key: bytes` `value: bytes` | put (key UTF-8, ≤ 1 KiB; value ≤ 1 MiB) | `0x00` |
//! | `0x02` `key: bytes` | get | `0x01` `value: bytes` |
//! | `0x03` | fence | `0x00` |
//! | `0x04` | goodbye: the client leaves cleanly | `0x00`, then the server closes |
//!
//! Any request may instead be answered `0x10` `code: u8` `message: bytes` (UTF-8), with code
//! `1` timeout, `2` fence failed (a participant left, or an earlier fence failed), `3` bad
//! request (the server then closes the connection).

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio::sync::oneshot;
use tokio::task::{JoinHandle, JoinSet};

/// The first bytes of a client's hello.
pub const MAGIC: [u8; 4] = *b"RWKV";

/// The wire format version this module speaks.
pub const PROTOCOL_VERSION: u8 = 1;

/// Longest key, in bytes.
pub const MAX_KEY_LEN: usize = 1024;

/// Longest value, in bytes.
pub const MAX_VALUE_LEN: usize = 1024 * 1024;

/// Longest frame body: a put with the longest key and value.
const MAX_FRAME_LEN: usize = 1 + 4 + MAX_KEY_LEN + 4 + MAX_VALUE_LEN;

/// How long a `get` waits for its key and a fence for its generation to fill, by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

const OP_HELLO: u8 = 0x00;
const OP_PUT: u8 = 0x01;
const OP_GET: u8 = 0x02;
const OP_FENCE: u8 = 0x03;
const OP_BYE: u8 = 0x04;

const REPLY_OK: u8 = 0x00;
const REPLY_VALUE: u8 = 0x01;
const REPLY_WELCOME: u8 = 0x02;
const REPLY_ERROR: u8 = 0x10;

/// An error from the key-value service.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KvError {
    /// An argument cannot be used (for instance zero expected ranks).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A socket operation failed.
    #[error("rendezvous I/O error while {context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The other side closed the connection (for a client: the server shut down or dropped
    /// the connection).
    #[error("rendezvous connection closed while {context}")]
    Closed {
        /// What was being done.
        context: String,
    },
    /// A `get` found no key, or a fence did not fill, within the server's timeout.
    #[error("rendezvous timeout: {message}")]
    Timeout {
        /// The server's explanation (which key, how many ranks arrived).
        message: String,
    },
    /// A fence cannot complete: a participant disconnected, or an earlier fence failed.
    #[error("rendezvous fence failed: {message}")]
    FenceFailed {
        /// The server's explanation.
        message: String,
    },
    /// The server refused a request as malformed.
    #[error("rendezvous server rejected the request: {message}")]
    Rejected {
        /// The server's explanation.
        message: String,
    },
    /// A key or value is longer than the protocol allows.
    #[error("rendezvous {what} of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// `"key"` or `"value"`.
        what: &'static str,
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The other side sent something that does not follow the wire format.
    #[error("rendezvous protocol error: {reason}")]
    Protocol {
        /// What was wrong.
        reason: String,
    },
    /// An earlier failure or a cancelled request left this client's connection unusable.
    #[error("rendezvous connection unusable: {reason}")]
    Broken {
        /// The earlier failure.
        reason: String,
    },
}

/// What an error reply says went wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ErrorCode {
    Timeout = 1,
    FenceFailed = 2,
    BadRequest = 3,
}

impl ErrorCode {
    fn from_byte(b: u8) -> Option<ErrorCode> {
        match b {
            1 => Some(ErrorCode::Timeout),
            2 => Some(ErrorCode::FenceFailed),
            3 => Some(ErrorCode::BadRequest),
            _ => None,
        }
    }
}

/// A request, decoded (sans-IO).
#[derive(Debug, PartialEq, Eq)]
enum Request {
    Hello { version: u8 },
    Put { key: String, value: Vec<u8> },
    Get { key: String },
    Fence,
    Bye,
}

/// A reply, decoded (sans-IO).
#[derive(Debug, PartialEq, Eq)]
enum Reply {
    Ok,
    Value(Vec<u8>),
    Welcome { expected_ranks: u32 },
    Error { code: u8, message: String },
}

impl Reply {
    fn error(code: ErrorCode, message: impl Into<String>) -> Reply {
        Reply::Error {
            code: code as u8,
            message: message.into(),
        }
    }
}

/// Reads fields out of a frame body.
struct Fields<'a> {
    rest: &'a [u8],
}

impl<'a> Fields<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        if self.rest.len() < n {
            return Err(format!("frame ends inside the {what}"));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    fn u8(&mut self, what: &str) -> Result<u8, String> {
        Ok(self.take(1, what)?[0])
    }

    fn u32(&mut self, what: &str) -> Result<u32, String> {
        let b = self.take(4, what)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn bytes(&mut self, what: &str, max: usize) -> Result<&'a [u8], String> {
        let len = self.u32(what)? as usize;
        if len > max {
            return Err(format!("{what} of {len} bytes exceeds the limit of {max}"));
        }
        self.take(len, what)
    }

    fn key(&mut self) -> Result<String, String> {
        let raw = self.bytes("key", MAX_KEY_LEN)?;
        String::from_utf8(raw.to_vec()).map_err(|_| "key is not UTF-8".to_string())
    }

    fn end(self) -> Result<(), String> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "{} unexpected bytes after the fields",
                self.rest.len()
            ))
        }
    }
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
    out.extend_from_slice(bytes);
}

/// Prefixes `body` with its length.
fn frame(body: Vec<u8>) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    out
}

impl Request {
    /// The whole frame, length prefix included.
    fn encode(&self) -> Vec<u8> {
        let mut body = Vec::new();
        match self {
            Request::Hello { version } => {
                body.push(OP_HELLO);
                body.extend_from_slice(&MAGIC);
                body.push(*version);
            }
            Request::Put { key, value } => {
                body.push(OP_PUT);
                put_bytes(&mut body, key.as_bytes());
                put_bytes(&mut body, value);
            }
            Request::Get { key } => {
                body.push(OP_GET);
                put_bytes(&mut body, key.as_bytes());
            }
            Request::Fence => body.push(OP_FENCE),
            Request::Bye => body.push(OP_BYE),
        }
        frame(body)
    }

    /// Decodes a frame body.
    fn decode(body: &[u8]) -> Result<Request, String> {
        let mut f = Fields { rest: body };
        let request = match f.u8("operation")? {
            OP_HELLO => {
                if f.take(4, "magic")? != MAGIC {
                    return Err("not a rankweave rendezvous client (bad magic)".to_string());
                }
                Request::Hello {
                    version: f.u8("version")?,
                }
            }
            OP_PUT => Request::Put {
                key: f.key()?,
                value: f.bytes("value", MAX_VALUE_LEN)?.to_vec(),
            },
            OP_GET => Request::Get { key: f.key()? },
            OP_FENCE => Request::Fence,
            OP_BYE => Request::Bye,
            op => return Err(format!("unknown operation 0x{op:02x}")),
        };
        f.end()?;
        Ok(request)
    }
}

impl Reply {
    /// The whole frame, length prefix included.
    fn encode(&self) -> Vec<u8> {
        let mut body = Vec::new();
        match self {
            Reply::Ok => body.push(REPLY_OK),
            Reply::Value(value) => {
                body.push(REPLY_VALUE);
                put_bytes(&mut body, value);
            }
            Reply::Welcome { expected_ranks } => {
                body.push(REPLY_WELCOME);
                body.extend_from_slice(&expected_ranks.to_be_bytes());
            }
            Reply::Error { code, message } => {
                body.push(REPLY_ERROR);
                body.push(*code);
                // Messages are short text; cut rather than exceed a frame.
                let mut end = message.len().min(4096);
                while !message.is_char_boundary(end) {
                    end -= 1;
                }
                put_bytes(&mut body, &message.as_bytes()[..end]);
            }
        }
        frame(body)
    }

    /// Decodes a frame body.
    fn decode(body: &[u8]) -> Result<Reply, String> {
        let mut f = Fields { rest: body };
        let reply = match f.u8("reply type")? {
            REPLY_OK => Reply::Ok,
            REPLY_VALUE => Reply::Value(f.bytes("value", MAX_VALUE_LEN)?.to_vec()),
            REPLY_WELCOME => Reply::Welcome {
                expected_ranks: f.u32("expected ranks")?,
            },
            REPLY_ERROR => Reply::Error {
                code: f.u8("error code")?,
                message: String::from_utf8_lossy(f.bytes("message", MAX_FRAME_LEN)?).into_owned(),
            },
            t => return Err(format!("unknown reply type 0x{t:02x}")),
        };
        f.end()?;
        Ok(reply)
    }
}

/// Why a frame could not be read.
#[derive(Debug)]
enum FrameError {
    Io(io::Error),
    /// The stream ended inside a frame.
    Truncated,
    /// The length prefix is 0 or above the limit.
    BadLength(usize),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::Io(e) => write!(f, "{e}"),
            FrameError::Truncated => write!(f, "connection closed inside a frame"),
            FrameError::BadLength(n) => write!(f, "frame length {n} outside 1..={MAX_FRAME_LEN}"),
        }
    }
}

/// Reads one frame body; `Ok(None)` if the stream ends cleanly before a frame starts. Memory
/// grows with the bytes that actually arrive, never beyond [`MAX_FRAME_LEN`].
async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> Result<Option<Vec<u8>>, FrameError> {
    let mut len = [0u8; 4];
    if r.read(&mut len[..1]).await.map_err(FrameError::Io)? == 0 {
        return Ok(None);
    }
    r.read_exact(&mut len[1..])
        .await
        .map_err(|e| match e.kind() {
            io::ErrorKind::UnexpectedEof => FrameError::Truncated,
            _ => FrameError::Io(e),
        })?;
    let n = u32::from_be_bytes(len) as usize;
    if n == 0 || n > MAX_FRAME_LEN {
        return Err(FrameError::BadLength(n));
    }
    let mut body = Vec::with_capacity(n.min(64 * 1024));
    (&mut *r)
        .take(n as u64)
        .read_to_end(&mut body)
        .await
        .map_err(FrameError::Io)?;
    if body.len() != n {
        return Err(FrameError::Truncated);
    }
    Ok(Some(body))
}

async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, frame: &[u8]) -> io::Result<()> {
    w.write_all(frame).await?;
    w.flush().await
}

/// Settings of a [`KvServer`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvServerConfig {
    /// How many fence calls complete a fence generation (the job's number of ranks).
    pub expected_ranks: usize,
    /// How long a `get` waits for its key and a fence for its generation to fill.
    pub timeout: Duration,
}

impl KvServerConfig {
    /// `expected_ranks` with the [`DEFAULT_TIMEOUT`].
    pub fn new(expected_ranks: usize) -> Self {
        KvServerConfig {
            expected_ranks,
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

/// Why a fence failed: the code to send and the explanation.
type Failure = (ErrorCode, String);

/// The current fence generation.
#[derive(Default)]
struct Fence {
    generation: u64,
    arrived: usize,
    waiters: Vec<oneshot::Sender<Result<(), Failure>>>,
    /// Set once a fence failed; every later fence fails with it.
    failed: Option<Failure>,
}

#[derive(Default)]
struct State {
    store: HashMap<String, Arc<[u8]>>,
    waiting: HashMap<String, Vec<oneshot::Sender<Arc<[u8]>>>>,
    fence: Fence,
}

/// What a fence call found.
enum Arrival {
    /// The fence is over (this call completed it, or it had failed before).
    Done(Result<(), Failure>),
    /// Wait for the generation to fill.
    Wait(u64, oneshot::Receiver<Result<(), Failure>>),
}

struct Shared {
    config: KvServerConfig,
    state: Mutex<State>,
    /// Connections that said goodbye, and a wake-up for [`KvServer::wait_for_goodbyes`].
    goodbyes: tokio::sync::watch::Sender<usize>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // No code holding the lock panics; if it ever did, the state is still consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn put(&self, key: String, value: Vec<u8>) {
        let value: Arc<[u8]> = value.into();
        let mut state = self.lock();
        if let Some(waiters) = state.waiting.remove(&key) {
            for waiter in waiters {
                let _ = waiter.send(value.clone());
            }
        }
        state.store.insert(key, value);
    }

    fn get(&self, key: &str) -> Result<Arc<[u8]>, oneshot::Receiver<Arc<[u8]>>> {
        let mut state = self.lock();
        if let Some(value) = state.store.get(key) {
            return Ok(value.clone());
        }
        let (tx, rx) = oneshot::channel();
        let waiters = state.waiting.entry(key.to_string()).or_default();
        waiters.retain(|w| !w.is_closed());
        waiters.push(tx);
        Err(rx)
    }

    fn arrive(&self) -> Arrival {
        let mut state = self.lock();
        let fence = &mut state.fence;
        if let Some(failure) = &fence.failed {
            return Arrival::Done(Err(failure.clone()));
        }
        fence.arrived += 1;
        if fence.arrived >= self.config.expected_ranks {
            for waiter in fence.waiters.drain(..) {
                let _ = waiter.send(Ok(()));
            }
            fence.arrived = 0;
            fence.generation += 1;
            return Arrival::Done(Ok(()));
        }
        let (tx, rx) = oneshot::channel();
        fence.waiters.push(tx);
        Arrival::Wait(fence.generation, rx)
    }

    /// Fails the open fence generation (if any ranks are in it) and every later fence.
    fn fail(fence: &mut Fence, failure: Failure) {
        fence.failed.get_or_insert_with(|| failure.clone());
        if fence.arrived > 0 {
            for waiter in fence.waiters.drain(..) {
                let _ = waiter.send(Err(failure.clone()));
            }
            fence.arrived = 0;
            fence.generation += 1;
        }
    }

    /// A waiter of `generation` ran out of time: fail that generation if it is still open.
    fn fence_timed_out(&self, generation: u64) {
        let mut state = self.lock();
        let fence = &mut state.fence;
        if fence.generation == generation && fence.arrived > 0 {
            let message = format!(
                "fence generation {generation} did not fill within {:?}: {} of {} ranks arrived",
                self.config.timeout, fence.arrived, self.config.expected_ranks
            );
            Shared::fail(fence, (ErrorCode::Timeout, message));
        }
    }

    /// A participant disconnected without saying goodbye.
    fn participant_left(&self, peer: SocketAddr) {
        let mut state = self.lock();
        let fence = &mut state.fence;
        let message = format!(
            "the participant at {peer} disconnected without closing (fence generation {}: {} of {} ranks had arrived)",
            fence.generation, fence.arrived, self.config.expected_ranks
        );
        tracing::debug!("rendezvous: {message}");
        Shared::fail(fence, (ErrorCode::FenceFailed, message));
    }
}

/// What happened while a request waited.
enum Waited<T> {
    Done(T),
    /// The client disconnected (or sent bytes before its reply, which the protocol forbids).
    Gone,
}

/// Runs `fut` while watching the client's side of the connection.
async fn watching<T>(rd: &mut BufReader<OwnedReadHalf>, fut: impl Future<Output = T>) -> Waited<T> {
    tokio::select! {
        biased;
        value = fut => Waited::Done(value),
        // `fill_buf` is cancel safe: if `fut` wins, nothing was consumed.
        _ = rd.fill_buf() => Waited::Gone,
    }
}

/// Before closing a connection that sent bad input: closing with unread input makes the kernel
/// reset the connection, which can destroy the error reply before the client reads it. So
/// send FIN and read (a bounded amount, for a bounded time) until the client closes too.
async fn linger(rd: &mut BufReader<OwnedReadHalf>, wr: &mut OwnedWriteHalf) {
    let _ = wr.shutdown().await;
    let drain = async {
        let mut buf = [0u8; 4096];
        let mut total = 0;
        while total < 256 * 1024 {
            match rd.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => total += n,
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_millis(200), drain).await;
}

/// Serves one client connection until it leaves or misbehaves.
async fn serve_connection(stream: TcpStream, peer: SocketAddr, shared: Arc<Shared>) {
    let _ = stream.set_nodelay(true);
    let (rd, mut wr) = stream.into_split();
    let mut rd = BufReader::new(rd);
    let mut participant = false;
    let mut greeted = false;
    loop {
        let request = match read_frame(&mut rd).await {
            Ok(Some(body)) => Request::decode(&body),
            Ok(None) => break,
            Err(e) => Err(e.to_string()),
        };
        let request = match request {
            Ok(Request::Hello { version }) if !greeted && version == PROTOCOL_VERSION => {
                greeted = true;
                let welcome = Reply::Welcome {
                    expected_ranks: u32::try_from(shared.config.expected_ranks).unwrap_or(u32::MAX),
                };
                if write_frame(&mut wr, &welcome.encode()).await.is_err() {
                    break;
                }
                continue;
            }
            Ok(Request::Hello { version }) if !greeted => Err(format!(
                "protocol version {version} is not supported (this server speaks {PROTOCOL_VERSION})"
            )),
            Ok(Request::Hello { .. }) => Err("hello sent twice".to_string()),
            Ok(_) if !greeted => Err("the first frame must be a hello".to_string()),
            Ok(request) => Ok(request),
            Err(reason) => Err(reason),
        };
        let request = match request {
            Ok(request) => request,
            Err(reason) => {
                tracing::debug!("rendezvous: bad request from {peer}: {reason}");
                let reply = Reply::error(ErrorCode::BadRequest, reason);
                if write_frame(&mut wr, &reply.encode()).await.is_ok() {
                    linger(&mut rd, &mut wr).await;
                }
                break;
            }
        };
        let reply = match request {
            Request::Hello { .. } => {
                // Only a repeated hello gets here, and that was turned into an error above;
                // answer it the same way should the two matches ever drift apart.
                let reply = Reply::error(ErrorCode::BadRequest, "hello sent twice");
                let _ = write_frame(&mut wr, &reply.encode()).await;
                break;
            }
            Request::Put { key, value } => {
                participant = true;
                shared.put(key, value);
                Reply::Ok
            }
            Request::Get { key } => match shared.get(&key) {
                Ok(value) => Reply::Value(value.to_vec()),
                Err(rx) => {
                    let timeout = shared.config.timeout;
                    match watching(&mut rd, tokio::time::timeout(timeout, rx)).await {
                        Waited::Done(Ok(Ok(value))) => Reply::Value(value.to_vec()),
                        Waited::Done(_) => Reply::error(
                            ErrorCode::Timeout,
                            format!("key {key:?} was not put within {timeout:?}"),
                        ),
                        Waited::Gone => break,
                    }
                }
            },
            Request::Fence => {
                participant = true;
                let outcome = match shared.arrive() {
                    Arrival::Done(outcome) => outcome,
                    Arrival::Wait(generation, mut rx) => {
                        let timeout = shared.config.timeout;
                        match watching(&mut rd, tokio::time::timeout(timeout, &mut rx)).await {
                            Waited::Done(Ok(Ok(outcome))) => outcome,
                            Waited::Done(Ok(Err(_))) => Err((
                                ErrorCode::FenceFailed,
                                "the server is shutting down".to_string(),
                            )),
                            Waited::Done(Err(_elapsed)) => {
                                shared.fence_timed_out(generation);
                                // Either the generation filled just in time, or it failed now;
                                // both sent their outcome to `rx`.
                                rx.try_recv().unwrap_or_else(|_| {
                                    Err((ErrorCode::Timeout, "fence timed out".to_string()))
                                })
                            }
                            Waited::Gone => break,
                        }
                    }
                };
                match outcome {
                    Ok(()) => Reply::Ok,
                    Err((code, message)) => Reply::error(code, message),
                }
            }
            Request::Bye => {
                let _ = write_frame(&mut wr, &Reply::Ok.encode()).await;
                shared.goodbyes.send_modify(|n| *n += 1);
                return;
            }
        };
        if write_frame(&mut wr, &reply.encode()).await.is_err() {
            break;
        }
    }
    if participant {
        shared.participant_left(peer);
    }
}

/// A rendezvous key-value server: a tokio task accepting clients on a TCP port.
///
/// Dropping it (or [`shutdown`](KvServer::shutdown)) stops accepting and closes every client
/// connection; clients then see [`KvError::Closed`].
#[derive(Debug)]
pub struct KvServer {
    local_addr: SocketAddr,
    config: KvServerConfig,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
    goodbyes: tokio::sync::watch::Receiver<usize>,
}

impl KvServer {
    /// Serves on `addr` (port 0 picks a free port) for a job of `expected_ranks` ranks, with
    /// the [`DEFAULT_TIMEOUT`]. Must be called inside a tokio runtime.
    pub async fn bind(addr: impl ToSocketAddrs, expected_ranks: usize) -> Result<Self, KvError> {
        KvServer::bind_with(addr, KvServerConfig::new(expected_ranks)).await
    }

    /// Serves on `addr` with explicit settings.
    pub async fn bind_with(
        addr: impl ToSocketAddrs,
        config: KvServerConfig,
    ) -> Result<Self, KvError> {
        if config.expected_ranks == 0 {
            return Err(KvError::InvalidArgument(
                "a rendezvous server needs at least one expected rank".to_string(),
            ));
        }
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| KvError::Io {
                context: "binding the rendezvous server".to_string(),
                source,
            })?;
        let local_addr = listener.local_addr().map_err(|source| KvError::Io {
            context: "reading the rendezvous server's address".to_string(),
            source,
        })?;
        let (goodbyes, _) = tokio::sync::watch::channel(0);
        let shared = Arc::new(Shared {
            config: config.clone(),
            state: Mutex::new(State::default()),
            goodbyes,
        });
        let (stop, stopped) = oneshot::channel();
        let goodbyes = shared.goodbyes.subscribe();
        let task = tokio::spawn(accept_loop(listener, shared, stopped));
        Ok(KvServer {
            local_addr,
            config,
            stop: Some(stop),
            task,
            goodbyes,
        })
    }

    /// The address clients connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The server's settings.
    pub fn config(&self) -> &KvServerConfig {
        &self.config
    }

    /// Waits until `n` connections in all have said goodbye ([`KvClient::close`]), for at most
    /// `patience`; returns how many have. A process serving its own job's rendezvous calls it
    /// before exiting, so that no peer loses the service in the middle of its last request.
    pub async fn wait_for_goodbyes(&mut self, n: usize, patience: Duration) -> usize {
        let _ = tokio::time::timeout(patience, self.goodbyes.wait_for(|&g| g >= n)).await;
        *self.goodbyes.borrow()
    }

    /// Stops accepting, closes every client connection and waits until all are closed.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.task).await;
    }
}

impl Drop for KvServer {
    fn drop(&mut self) {
        // Dropping the accept task drops its set of connection tasks, which aborts them.
        self.task.abort();
    }
}

async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    mut stopped: oneshot::Receiver<()>,
) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            _ = &mut stopped => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    connections.spawn(serve_connection(stream, peer, shared.clone()));
                }
                Err(e) => {
                    // Out of descriptors and the like: back off instead of spinning.
                    tracing::warn!("rendezvous server: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next() => {}
        }
    }
    drop(listener);
    connections.shutdown().await;
}

/// A connection to a [`KvServer`].
///
/// Requests are one at a time (`&mut self`). A request future dropped before its reply arrived
/// leaves the connection out of step: later requests fail with [`KvError::Broken`]. Call
/// [`close`](KvClient::close) when done, or the server treats a client that put or fenced as a
/// lost rank and fails the job's fences.
#[derive(Debug)]
pub struct KvClient {
    rd: BufReader<OwnedReadHalf>,
    wr: OwnedWriteHalf,
    server: SocketAddr,
    expected_ranks: usize,
    broken: Option<String>,
}

impl KvClient {
    /// Connects to the server at `addr` and exchanges the hello.
    pub async fn connect(addr: impl ToSocketAddrs) -> Result<Self, KvError> {
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|source| KvError::Io {
                context: "connecting to the rendezvous server".to_string(),
                source,
            })?;
        let _ = stream.set_nodelay(true);
        let server = stream.peer_addr().map_err(|source| KvError::Io {
            context: "reading the rendezvous server's address".to_string(),
            source,
        })?;
        let (rd, wr) = stream.into_split();
        let mut client = KvClient {
            rd: BufReader::new(rd),
            wr,
            server,
            expected_ranks: 0,
            broken: None,
        };
        match client
            .request(&Request::Hello {
                version: PROTOCOL_VERSION,
            })
            .await?
        {
            Reply::Welcome { expected_ranks } => {
                client.expected_ranks = expected_ranks as usize;
                Ok(client)
            }
            other => Err(client.unexpected("hello", &other)),
        }
    }

    /// Like [`connect`](KvClient::connect), retrying while the connection is refused (the
    /// server may not be up yet) for up to `patience`.
    pub async fn connect_retry(
        addr: impl ToSocketAddrs + Clone,
        patience: Duration,
    ) -> Result<Self, KvError> {
        let deadline = tokio::time::Instant::now() + patience;
        let mut pause = Duration::from_millis(5);
        loop {
            match KvClient::connect(addr.clone()).await {
                Err(KvError::Io { source, .. })
                    if source.kind() == io::ErrorKind::ConnectionRefused
                        && tokio::time::Instant::now() + pause < deadline =>
                {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(200));
                }
                result => return result,
            }
        }
    }

    /// The server's address.
    pub fn server_addr(&self) -> SocketAddr {
        self.server
    }

    /// The number of ranks the server expects in each fence.
    pub fn expected_ranks(&self) -> usize {
        self.expected_ranks
    }

    /// Stores `value` under `key` (replacing an earlier value).
    pub async fn put(&mut self, key: &str, value: &[u8]) -> Result<(), KvError> {
        check_len("key", key.len(), MAX_KEY_LEN)?;
        check_len("value", value.len(), MAX_VALUE_LEN)?;
        let request = Request::Put {
            key: key.to_string(),
            value: value.to_vec(),
        };
        match self.request(&request).await? {
            Reply::Ok => Ok(()),
            other => Err(self.unexpected("put", &other)),
        }
    }

    /// The value stored under `key`, waiting (up to the server's timeout) until it is put.
    pub async fn get(&mut self, key: &str) -> Result<Vec<u8>, KvError> {
        check_len("key", key.len(), MAX_KEY_LEN)?;
        match self
            .request(&Request::Get {
                key: key.to_string(),
            })
            .await?
        {
            Reply::Value(value) => Ok(value),
            other => Err(self.unexpected("get", &other)),
        }
    }

    /// Waits until every expected rank has called `fence` (this generation).
    pub async fn fence(&mut self) -> Result<(), KvError> {
        match self.request(&Request::Fence).await? {
            Reply::Ok => Ok(()),
            other => Err(self.unexpected("fence", &other)),
        }
    }

    /// Leaves cleanly: the server does not count this as a lost rank.
    pub async fn close(mut self) -> Result<(), KvError> {
        match self.request(&Request::Bye).await? {
            Reply::Ok => Ok(()),
            other => Err(self.unexpected("goodbye", &other)),
        }
    }

    async fn request(&mut self, request: &Request) -> Result<Reply, KvError> {
        if let Some(reason) = &self.broken {
            return Err(KvError::Broken {
                reason: reason.clone(),
            });
        }
        let what = match request {
            Request::Hello { .. } => "hello",
            Request::Put { .. } => "put",
            Request::Get { .. } => "get",
            Request::Fence => "fence",
            Request::Bye => "goodbye",
        };
        self.broken = Some(format!("a {what} was cancelled before its reply arrived"));
        if let Err(source) = write_frame(&mut self.wr, &request.encode()).await {
            let err = KvError::Io {
                context: format!("sending a {what}"),
                source,
            };
            self.broken = Some(err.to_string());
            return Err(err);
        }
        let body = match read_frame(&mut self.rd).await {
            Ok(Some(body)) => body,
            Ok(None) | Err(FrameError::Truncated) => {
                let err = KvError::Closed {
                    context: format!("waiting for the reply to a {what}"),
                };
                self.broken = Some(err.to_string());
                return Err(err);
            }
            Err(FrameError::Io(source)) => {
                let err = KvError::Io {
                    context: format!("waiting for the reply to a {what}"),
                    source,
                };
                self.broken = Some(err.to_string());
                return Err(err);
            }
            Err(e @ FrameError::BadLength(_)) => {
                let err = KvError::Protocol {
                    reason: e.to_string(),
                };
                self.broken = Some(err.to_string());
                return Err(err);
            }
        };
        self.broken = None;
        let reply = Reply::decode(&body).map_err(|reason| KvError::Protocol { reason })?;
        match reply {
            Reply::Error { code, message } => {
                let err = match ErrorCode::from_byte(code) {
                    Some(ErrorCode::Timeout) => KvError::Timeout { message },
                    Some(ErrorCode::FenceFailed) => KvError::FenceFailed { message },
                    Some(ErrorCode::BadRequest) => {
                        self.broken = Some(format!("the server rejected a {what}: {message}"));
                        KvError::Rejected { message }
                    }
                    None => KvError::Rejected {
                        message: format!("error code {code}: {message}"),
                    },
                };
                Err(err)
            }
            reply => Ok(reply),
        }
    }

    fn unexpected(&mut self, what: &str, reply: &Reply) -> KvError {
        let err = KvError::Protocol {
            reason: format!("unexpected reply to a {what}: {reply:?}"),
        };
        self.broken = Some(err.to_string());
        err
    }
}

fn check_len(what: &'static str, len: usize, max: usize) -> Result<(), KvError> {
    if len > max {
        return Err(KvError::TooLarge { what, len, max });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(frame: &[u8]) -> &[u8] {
        let len = u32::from_be_bytes([frame[0], frame[1], frame[2], frame[3]]) as usize;
        assert_eq!(frame.len(), 4 + len);
        &frame[4..]
    }

    #[test]
    fn requests_round_trip() {
        for request in [
            Request::Hello { version: 1 },
            Request::Put {
                key: "addr-0".into(),
                value: vec![0, 1, 2, 255, b'\n', b' '],
            },
            Request::Put {
                key: String::new(),
                value: Vec::new(),
            },
            Request::Get { key: "k".into() },
            Request::Fence,
            Request::Bye,
        ] {
            assert_eq!(Request::decode(body(&request.encode())).unwrap(), request);
        }
    }

    #[test]
    fn replies_round_trip() {
        for reply in [
            Reply::Ok,
            Reply::Value(vec![9; 1000]),
            Reply::Welcome { expected_ranks: 64 },
            Reply::error(ErrorCode::Timeout, "slow"),
        ] {
            assert_eq!(Reply::decode(body(&reply.encode())).unwrap(), reply);
        }
    }

    #[test]
    fn bad_request_bodies_are_errors() {
        let mut huge_key = vec![OP_GET];
        huge_key.extend_from_slice(&(MAX_KEY_LEN as u32 + 1).to_be_bytes());
        huge_key.extend(vec![b'k'; MAX_KEY_LEN + 1]);
        let mut lying_len = vec![OP_PUT];
        lying_len.extend_from_slice(&u32::MAX.to_be_bytes());
        for (bad, want) in [
            (vec![], "operation"),
            (vec![0x7f], "unknown operation 0x7f"),
            (b"\x00HTTP\x01".to_vec(), "bad magic"),
            (b"\x00RWKV".to_vec(), "version"),
            (vec![OP_FENCE, 0], "unexpected bytes"),
            (vec![OP_GET, 0, 0, 0, 5, b'a'], "inside the key"),
            (vec![OP_GET, 0, 0, 0, 2, 0xff, 0xfe], "not UTF-8"),
            (huge_key, "exceeds the limit"),
            (lying_len, "exceeds the limit"),
            (vec![OP_PUT, 0, 0, 0, 1, b'k', 0, 0], "inside the value"),
        ] {
            let err = Request::decode(&bad).unwrap_err();
            assert!(err.contains(want), "{bad:?}: {err}");
        }
    }

    #[tokio::test]
    async fn frames_are_bounded_and_truncation_is_detected() {
        let mut input: &[u8] = &[0, 0, 0, 0];
        assert!(matches!(
            read_frame(&mut input).await,
            Err(FrameError::BadLength(0))
        ));
        let mut input: &[u8] = &[0xff, 0xff, 0xff, 0xff];
        assert!(matches!(
            read_frame(&mut input).await,
            Err(FrameError::BadLength(_))
        ));
        let mut input: &[u8] = &[0, 0, 0, 9, 1, 2];
        assert!(matches!(
            read_frame(&mut input).await,
            Err(FrameError::Truncated)
        ));
        let mut input: &[u8] = &[0, 0];
        assert!(matches!(
            read_frame(&mut input).await,
            Err(FrameError::Truncated)
        ));
        let mut input: &[u8] = &[];
        assert!(matches!(read_frame(&mut input).await, Ok(None)));
        let mut input: &[u8] = &[0, 0, 0, 1, OP_FENCE, 0, 0, 0, 1, OP_BYE];
        assert_eq!(read_frame(&mut input).await.unwrap().unwrap(), [OP_FENCE]);
        assert_eq!(read_frame(&mut input).await.unwrap().unwrap(), [OP_BYE]);
        assert!(matches!(read_frame(&mut input).await, Ok(None)));
    }
}
