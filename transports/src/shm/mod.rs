//! Shared memory between the processes of one host.
//!
//! Every rank owns a segment (`segment.rs`) holding one single-producer/single-consumer
//! ring (`ring.rs`) per possible sender; a rank sends to a local peer by writing records into the
//! ring for it in the peer's segment, which it maps through `/proc/<pid>/fd/<fd>` on first
//! contact (Yu's on-demand connection: a rank that talks to three neighbours maps three
//! segments). Small frames are copied into the ring; large payloads are read by the receiver
//! straight from the sender's memory with `process_vm_readv`, or pipelined through the ring in
//! pieces where that is not permitted (`outbound.rs`).
//!
//! A rank reads its rings whenever it polls; only when it has nothing to do does it arm its
//! doorbell (`doorbell.rs`) and sleep in tokio's reactor on its signal socket (`signal.rs`), so that
//! producers pay for a wake-up only when one is needed. A local peer that exits (even by
//! `kill -9`) is noticed through a `pidfd` and reported as [`Arrival::PeerLost`] after
//! everything it wrote has been read; a peer that closes says `BYE` in its rings.
//!
//! The transport is reliable and ordered (it is memory), so the message layer adds no
//! reliability; frames may be of any size.

mod arena;
mod cache_distance;
mod cma;
mod copy_path;
mod doorbell;
mod flags;
pub mod host;
mod inbound;
mod outbound;
mod record;
mod ring;
mod segment;
mod signal;
mod split_copy;

use std::future::Future;
use std::os::unix::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use rankweave_core::frame::{Envelope, Frame, Header};
use rankweave_core::{
    Arrival, Capabilities, Communicator, Config, DataWant, EagerTaken, EagerWant, Error, ShmConfig,
    ShmCounters, ShmNow, Transport, TransportError, TransportStats,
};
use rustc_hash::FxHashMap;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use crate::inproc::Mailbox;
use host::ProcessWatch;
use inbound::{Inbound, ReadInto};
use outbound::Outbound;
use rankweave_core::arena::{ArenaHolder, ArenaLease, PeerArena};
use rankweave_core::buffer_pool::BufferPool;
use rankweave_core::spin_lock::SpinLock;
use rankweave_core::transport::PeerFlag;
use ring::RingGeometry;
use segment::{Owner, SINGLE_COPY_NO, SINGLE_COPY_YES, Segment};
use signal::SignalSocket;

/// Records read from one ring before the next ring gets its turn (fairness between senders).
const READ_BUDGET: usize = 64;

/// Where a rank's segment can be found: what it publishes in the job's key-value space.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentAddress {
    /// The publisher's [`host::host_key`]: only ranks with the same key can map it.
    pub host: String,
    /// The publisher's process id.
    pub pid: u32,
    /// The descriptor of its segment in that process.
    pub fd: i32,
    /// The random number in the segment's header (and its signal socket's name): a mapped
    /// segment is trusted only if it matches.
    pub nonce: u64,
}

impl SegmentAddress {
    /// `host:pid:fd:nonce` (no spaces or `=`, so a valid PMI-1 value).
    pub fn encode(&self) -> String {
        format!("{}:{}:{}:{:016x}", self.host, self.pid, self.fd, self.nonce)
    }

    /// The inverse of [`encode`](Self::encode); `None` for anything else.
    pub fn decode(v: &str) -> Option<SegmentAddress> {
        let mut it = v.trim().split(':');
        let host = it.next().filter(|h| !h.is_empty())?.to_string();
        let pid = it.next()?.parse().ok()?;
        let fd = it.next()?.parse().ok()?;
        let nonce = u64::from_str_radix(it.next()?, 16).ok()?;
        it.next().is_none().then_some(SegmentAddress {
            host,
            pid,
            fd,
            nonce,
        })
    }
}

/// Where the ranks of a job published their segments; consulted once per peer, on first
/// contact. May block briefly; must give up with an error rather than block for long.
pub trait SegmentDirectory: Send + Sync + 'static {
    /// The segment address rank `rank` published.
    fn lookup_segment(&self, rank: u32) -> Result<SegmentAddress, TransportError>;

    /// Ranks that must hear of this rank's close even if it never talked to them. Processes
    /// learn of a peer they never contacted only when they contact it (the default: none);
    /// ranks of one process expect, as with the in-process transport, that a rank's end
    /// (a panic, say) reaches every other rank.
    fn told_on_close(&self) -> Vec<u32> {
        Vec::new()
    }
}

/// A local peer this rank has mapped.
struct Peer {
    rank: u32,
    pid: u32,
    /// This process may read the peer's memory (`process_vm_readv`, probed at connection).
    readable: bool,
    segment: Segment,
    out: SpinLock<Outbound>,
    signal_addr: SocketAddr,
    /// Becomes readable when the peer's process exits (`None` for ranks of this process).
    watch: Option<AsyncFd<ProcessWatch>>,
    /// The process exited, said BYE, or broke its ring.
    gone: AtomicBool,
    /// `PeerLost` has been reported for it.
    reported: AtomicBool,
}

/// The receive side: the rings of the senders that registered so far.
#[derive(Default)]
struct InboundSet {
    /// Sender-list entries consumed.
    known: usize,
    rings: Vec<Inbound>,
    /// Receive counters: plain integers, since every reader holds the lock (an atomic
    /// read-modify-write per frame costs more than the rest of the bookkeeping).
    frames_received: u64,
    bytes_received: u64,
    malformed_dropped: u64,
    /// Single-copy payloads read straight into a receive's buffer.
    read_into_receive: u64,
}

/// The progress task's parking state.
#[derive(Default)]
struct Park {
    /// The progress task's waker while it sleeps in `poll_arrival`.
    waker: Option<Waker>,
    /// While futures spin, the doorbell stays disarmed between their bursts too (arming it
    /// would make every producer pay a signal for a rank that is about to look anyway); this
    /// timer makes the sleeping progress task look again soon, in case they stopped without
    /// parking (see `waiter_parked`).
    recheck: Option<Pin<Box<tokio::time::Sleep>>>,
    /// A busy poller woke the sleeping progress task to set its recheck timer.
    nudged: bool,
    /// While the progress task sleeps trusting the doorbell, it still looks after
    /// [`LOOK_ANYWAY`]: a wake-up missed for whatever reason costs that long, not the job
    /// (counted in `wakeups_missed`: it finding work means a signal that should have come did
    /// not).
    look_anyway: Option<Pin<Box<tokio::time::Sleep>>>,
}

/// How soon a progress task that could not arm the doorbell (futures were spinning) looks
/// again.
const RECHECK: Duration = Duration::from_millis(1);

/// How long after helping a receiver with a split copy the progress task keeps looking for
/// the next offer instead of sleeping: the receiver of a window of large messages makes one
/// every few tens of microseconds, and a wake-up for each would cost about as much.
const HELP_LINGER: Duration = Duration::from_micros(200);

/// How long a progress task sleeping on its doorbell goes without looking at its rings anyway
/// (see `Park::look_anyway`).
const LOOK_ANYWAY: Duration = Duration::from_millis(20);

/// The rare counters (the per-frame ones live in each peer's [`Outbound`] and in the
/// [`InboundSet`], under the locks their writers hold anyway).
#[derive(Default)]
struct Counters {
    /// Frames to this rank itself or to a peer already gone (not counted by any `Outbound`).
    frames_sent: AtomicU64,
    bytes_sent: AtomicU64,
    signals_sent: AtomicU64,
    /// Times the progress task's look-anyway timer found work no signal had announced.
    wakeups_missed: AtomicU64,
    peers_lost: AtomicU64,
    /// Bytes written into receivers' buffers as this rank's share of split copies.
    split_bytes_written: AtomicU64,
    payloads_lent: AtomicU64,
    /// Records read from the rings and queued records published: [`Transport::traffic`].
    traffic: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn io_error(op: &'static str, message: String) -> TransportError {
    TransportError::Io { op, message }
}

/// One rank's shared-memory transport (see the [module docs](self)).
///
/// Dropping it before it has drained (see [`Transport::is_drained`]) hands its state to a
/// short-lived thread that keeps answering until local peers have read what it sent or the
/// linger time is up: a single-copy payload must stay in memory until its reader is done.
pub struct ShmTransport {
    rank: Arc<ShmRank>,
}

/// The state of one rank's transport.
pub struct ShmRank {
    me: Owner,
    settings: ShmConfig,
    geometry: RingGeometry,
    host: String,
    own: Segment,
    signal: SignalSocket,
    directory: Arc<dyn SegmentDirectory>,
    /// Connected peers by rank (set once each: looked up without a lock on every send).
    peers: Box<[OnceLock<Arc<Peer>>]>,
    /// The same peers, for iteration.
    connected: RwLock<Vec<Arc<Peer>>>,
    /// Peers marked gone and not yet reported lost.
    unreported: AtomicUsize,
    /// A future busy-polled since the progress task last looked (see `begin_busy_poll`).
    busy_seen: AtomicBool,
    /// Serializes connection set-up (so a peer is mapped once).
    connecting: Mutex<()>,
    inbound: SpinLock<InboundSet>,
    /// Receive buffers for large frames.
    pool: Arc<BufferPool>,
    /// Frames this rank sent to itself.
    loopback: Mailbox<Arrival>,
    /// Peers with records waiting for ring space.
    queued_peers: AtomicUsize,
    /// Peers holding single-copy payloads not read yet or timing a large send (see
    /// `Outbound::observe`).
    watching_peers: AtomicUsize,
    park: Mutex<Park>,
    closed: AtomicBool,
    closed_at: Mutex<Option<Instant>>,
    linger: Duration,
    counters: Counters,
    /// What is left of `settings.prefault_bytes` (see [`ShmRank::prefault`]).
    prefault_left: AtomicUsize,
    /// Until when (nanoseconds after `born`) the progress task keeps looking for offers to
    /// help with, without sleeping: set on each help (see [`HELP_LINGER`]).
    helping_until: AtomicU64,
    /// Flags raised to this rank as the progress task last saw them, and their waiters.
    flags: flags::FlagWatch,
    /// Whether an [`ArenaLease`] on this rank's arena exists.
    arena: arena::ArenaGate,
    born: Instant,
}

impl ArenaHolder for ShmRank {
    fn release(&self) {
        self.arena.give_back();
    }
}

impl std::fmt::Debug for ShmRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmTransport")
            .field("rank", &self.me.rank)
            .field("world", &self.me.world)
            .finish()
    }
}

impl ShmTransport {
    /// Creates rank `rank`'s segment and signal socket for a `world`-rank job. Peers are found through `directory` on first contact. After closing, the
    /// transport waits at most `linger` for local peers to take what it sent. Must run
    /// inside a tokio runtime.
    pub fn new(
        rank: u32,
        world: u32,
        settings: ShmConfig,
        linger: Duration,
        directory: Arc<dyn SegmentDirectory>,
    ) -> Result<ShmTransport, TransportError> {
        ShmRank::new(rank, world, settings, linger, directory)
            .map(|r| ShmTransport { rank: Arc::new(r) })
    }
}

impl std::ops::Deref for ShmTransport {
    type Target = ShmRank;

    fn deref(&self) -> &ShmRank {
        &self.rank
    }
}

impl std::fmt::Debug for ShmTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.rank.fmt(f)
    }
}

impl Drop for ShmTransport {
    fn drop(&mut self) {
        if !self.rank.closed.load(Ordering::Acquire) {
            self.rank.close();
        }
        if self.rank.is_drained() {
            return;
        }
        let rank = Arc::clone(&self.rank);
        let spawned = std::thread::Builder::new()
            .name("rankweave-shm-linger".into())
            .spawn(move || {
                while !rank.is_drained() {
                    std::thread::sleep(Duration::from_micros(200));
                }
            });
        if spawned.is_err() {
            tracing::warn!(
                "cannot start the linger thread: local peers may miss this rank's last data"
            );
        }
    }
}

impl Transport for ShmTransport {
    fn capabilities(&self) -> Capabilities {
        self.rank.capabilities()
    }

    fn send(&self, to: u32, frame: Frame) -> Result<(), TransportError> {
        self.rank.send(to, frame)
    }

    fn drain(&self, out: &mut Vec<Arrival>) -> Result<usize, TransportError> {
        self.rank.drain(out)
    }

    fn take_eager(&self, want: &EagerWant, into: Option<&mut [u8]>) -> Option<EagerTaken> {
        self.rank.take_eager(want, into)
    }

    fn take_data(&self, want: &DataWant, into: &mut [u8]) -> bool {
        self.rank.take_data(want, into)
    }

    fn send_eager(
        &self,
        to: u32,
        envelope: &Envelope,
        payload: &[&[u8]],
    ) -> Result<bool, TransportError> {
        self.rank.send_eager(to, envelope, payload)
    }

    fn reads_in_place(&self, to: u32, len: usize) -> bool {
        self.rank.reads_in_place(to, len)
    }

    fn can_read_peer_memory(&self, peer: u32) -> bool {
        self.rank.can_read_peer_memory(peer)
    }

    fn read_peer_memory(
        &self,
        peer: u32,
        addr: u64,
        dst: &mut [std::mem::MaybeUninit<u8>],
    ) -> Result<(), TransportError> {
        self.rank.read_peer_memory(peer, addr, dst)
    }

    fn has_flags_with(&self, peer: u32) -> bool {
        self.rank.has_flags_with(peer)
    }

    fn raise_flag(&self, peer: u32, value: u64) -> Result<(), TransportError> {
        self.rank.raise_flag(peer, value)
    }

    fn read_flag(&self, peer: u32) -> Result<PeerFlag, TransportError> {
        self.rank.read_flag(peer)
    }

    fn park_on_flags(&self, waker: &std::task::Waker) {
        self.rank.park_on_flags(waker);
    }

    fn lease_arena(&self) -> Option<ArenaLease> {
        ShmRank::lease_arena(&self.rank)
    }

    fn peer_arena(&self, peer: u32) -> Option<PeerArena> {
        self.rank.peer_arena(peer)
    }

    fn poll_arrival(&self, cx: &mut Context<'_>) -> Poll<()> {
        self.rank.poll_arrival(cx)
    }

    fn may_have_arrivals(&self) -> bool {
        self.rank.may_have_arrivals()
    }

    fn traffic(&self) -> u64 {
        self.rank.counters.traffic.load(Ordering::Relaxed)
    }

    fn begin_busy_poll(&self) {
        self.rank.begin_busy_poll();
    }

    fn end_busy_poll(&self) {
        self.rank.end_busy_poll();
    }

    fn waiter_parked(&self) {
        self.rank.waiter_parked();
    }

    fn close(&self) {
        self.rank.close();
    }

    fn is_drained(&self) -> bool {
        self.rank.is_drained()
    }

    fn stats(&self) -> TransportStats {
        self.rank.stats()
    }
}

impl ShmRank {
    fn new(
        rank: u32,
        world: u32,
        settings: ShmConfig,
        linger: Duration,
        directory: Arc<dyn SegmentDirectory>,
    ) -> Result<ShmRank, TransportError> {
        let geometry = RingGeometry {
            capacity: settings.ring_bytes,
            unit: 64,
        };
        let me = Owner {
            rank,
            world,
            nonce: rankweave_core::rng::random_u64(),
            pid: std::process::id(),
        };
        let own = Segment::create(me, geometry, settings.arena_bytes)
            .map_err(|m| io_error("creating the shm segment", m))?;
        let signal = SignalSocket::bind(me.nonce).map_err(|m| io_error("shm signal socket", m))?;
        Ok(ShmRank {
            me,
            settings,
            geometry,
            host: host::host_key(),
            own,
            signal,
            directory,
            peers: (0..world).map(|_| OnceLock::new()).collect(),
            connected: RwLock::new(Vec::new()),
            unreported: AtomicUsize::new(0),
            busy_seen: AtomicBool::new(false),
            connecting: Mutex::new(()),
            inbound: SpinLock::default(),
            pool: Arc::default(),
            loopback: Mailbox::new(),
            queued_peers: AtomicUsize::new(0),
            watching_peers: AtomicUsize::new(0),
            park: Mutex::new(Park::default()),
            closed: AtomicBool::new(false),
            closed_at: Mutex::new(None),
            linger,
            counters: Counters::default(),
            prefault_left: AtomicUsize::new(settings.prefault_bytes),
            helping_until: AtomicU64::new(0),
            flags: flags::FlagWatch::new(world),
            arena: arena::ArenaGate::new(),
            born: Instant::now(),
        })
    }
}

impl ShmRank {
    /// What peers need to find this rank's segment: publish it in the job's directory.
    pub fn address(&self) -> SegmentAddress {
        SegmentAddress {
            host: self.host.clone(),
            pid: self.me.pid,
            fd: self.own.fd().unwrap_or(-1),
            nonce: self.me.nonce,
        }
    }

    /// This rank's world rank.
    pub fn rank(&self) -> u32 {
        self.me.rank
    }

    /// The shared-memory counters.
    pub fn counters(&self) -> ShmCounters {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut s = ShmCounters::default();
        s.frames_sent = get(&c.frames_sent);
        s.bytes_sent = get(&c.bytes_sent);
        for peer in self.connected_peers() {
            let out = peer.out.lock();
            let o = &out.counts;
            s.frames_sent += o.frames;
            s.bytes_sent += o.bytes;
            s.single_copy_sent += o.single_copy;
            s.pipelined_sent += o.pipelined;
            s.ring_full += out.full_events;
        }
        {
            let inbound = self.inbound.lock();
            s.frames_received = inbound.frames_received;
            s.bytes_received = inbound.bytes_received;
            s.malformed_dropped = inbound.malformed_dropped;
            s.read_into_receive = inbound.read_into_receive;
        }
        s.signals_sent = get(&c.signals_sent);
        s.wakeups_missed = get(&c.wakeups_missed);
        s.peers_lost = get(&c.peers_lost);
        s.split_bytes_written = get(&c.split_bytes_written);
        s.payloads_lent = get(&c.payloads_lent);
        s.now = self.now();
        s
    }

    /// What this rank is doing now (see [`ShmNow`]).
    fn now(&self) -> ShmNow {
        let mut now = ShmNow::default();
        now.doorbell_armed = self.own.doorbell().is_armed();
        {
            let park = lock(&self.park);
            now.progress_asleep = park.waker.is_some() && park.recheck.is_none();
            now.progress_rechecking = park.waker.is_some() && park.recheck.is_some();
        }
        now.signal_pending = self.signal.is_pending();
        now.unread_rings = self.own.unread_rings() as u64;
        now.queued_peers = self.queued_peers.load(Ordering::Acquire) as u64;
        for peer in self.connected_peers() {
            now.peers_armed += u64::from(peer.segment.doorbell().is_armed());
            let out = peer.out.lock();
            now.queued_records += out.queued() as u64;
            now.blocked_peers += u64::from(out.is_blocked());
        }
        now.has_work = self.has_work_or_flags();
        now
    }

    fn peer_if_connected(&self, rank: u32) -> Option<&Arc<Peer>> {
        self.peers.get(rank as usize)?.get()
    }

    /// The peer `rank`, mapped on first use.
    #[inline]
    fn peer(&self, rank: u32) -> Result<&Arc<Peer>, TransportError> {
        match self.peer_if_connected(rank) {
            Some(p) => Ok(p),
            None => self.connect_peer(rank),
        }
    }

    /// This rank's arena, if it has one and no lease on it exists.
    fn lease_arena(self: &Arc<Self>) -> Option<ArenaLease> {
        let (start, len) = self.own.arena()?;
        if !self.arena.try_take() {
            return None;
        }
        // SAFETY: the arena lies in this rank's own segment, mapped while the `ShmRank` (kept
        // by the lease's holder) lives; the gate lets one lease exist at a time, and nothing
        // else in this process touches the arena.
        Some(unsafe { ArenaLease::new(start, len, self.clone()) })
    }

    /// `peer`'s arena as mapped here (connecting to it first), unless it is gone; never this
    /// rank's own (a rank is not its own peer: its lease is how it reaches its arena).
    fn peer_arena(&self, peer: u32) -> Option<PeerArena> {
        if peer == self.me.rank {
            return None;
        }
        let p = self.peer(peer).ok()?;
        if p.gone.load(Ordering::Acquire) {
            return None;
        }
        let (start, len) = p.segment.arena()?;
        // SAFETY: the arena lies in the peer's segment, mapped while the `Peer` (kept by the
        // view) lives.
        Some(unsafe { PeerArena::new(start, len, p.clone()) })
    }

    /// [`peer`](Self::peer) on first contact (kept apart so the common case stays a load).
    #[cold]
    #[inline(never)]
    fn connect_peer(&self, rank: u32) -> Result<&Arc<Peer>, TransportError> {
        let slot = self
            .peers
            .get(rank as usize)
            .ok_or(TransportError::PeerUnreachable(rank as usize))?;
        let _one_at_a_time = lock(&self.connecting);
        if let Some(p) = slot.get() {
            return Ok(p);
        }
        let peer = Arc::new(self.connect(rank).map_err(|why| {
            tracing::warn!(
                rank = self.me.rank,
                peer = rank,
                "shm connection failed: {why}"
            );
            TransportError::PeerUnreachable(rank as usize)
        })?);
        self.connected
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .push(Arc::clone(&peer));
        Ok(slot.get_or_init(|| peer))
    }

    /// Marks `peer` gone (exited, said BYE or broke its ring); it is reported lost once.
    fn mark_gone(&self, peer: &Peer) {
        if !peer.gone.swap(true, Ordering::AcqRel) {
            self.unreported.fetch_add(1, Ordering::AcqRel);
        }
    }

    fn connect(&self, rank: u32) -> Result<Peer, String> {
        if rank >= self.me.world || rank == self.me.rank {
            return Err(format!("no local peer {rank}"));
        }
        let addr = self
            .directory
            .lookup_segment(rank)
            .map_err(|e| format!("looking its segment up: {e}"))?;
        if addr.host != self.host {
            return Err(format!(
                "it runs on another host (key {} vs {})",
                addr.host, self.host
            ));
        }
        // Watch first, then map: if the process is replaced in between, the mapping's checks
        // fail; if it exits after, the watch fires.
        let watch = if addr.pid == self.me.pid {
            None
        } else {
            let w = host::watch_process(addr.pid)?;
            // SAFETY: the AsyncFd owns the pidfd, which stays open and the same until the
            // AsyncFd is dropped.
            let fd = unsafe { AsyncFd::register_with_interest(w, Interest::READABLE) };
            Some(fd.map_err(|e| format!("watching process {}: {}", addr.pid, e))?)
        };
        let expected = Owner {
            rank,
            world: self.me.world,
            nonce: addr.nonce,
            pid: addr.pid,
        };
        let segment = Segment::open_peer(
            addr.pid,
            addr.fd,
            expected,
            self.geometry,
            self.settings.arena_bytes,
        )?;
        // Can this rank read the peer's memory? Tell it, beside its ring into our segment.
        let readable = self.settings.single_copy
            && cma::probe(addr.pid, segment.owner_addr(), Segment::magic());
        if let Some(info) = self.own.pair_info(rank) {
            let v = if readable {
                SINGLE_COPY_YES
            } else {
                SINGLE_COPY_NO
            };
            info.single_copy.store(v, Ordering::Release);
        }
        let out = Outbound::new(&segment, self.me.rank, &self.settings)
            .ok_or("this rank has no ring in the peer's segment")?;
        self.prefault(&segment, self.me.rank);
        segment.register_sender(self.me.rank)?;
        Ok(Peer {
            rank,
            pid: addr.pid,
            readable,
            out: SpinLock::new(out),
            signal_addr: signal::address(addr.nonce)?,
            segment,
            watch,
            gone: AtomicBool::new(false),
            reported: AtomicBool::new(false),
        })
    }

    /// Wakes `peer` if it sleeps (after something was published in its ring).
    fn nudge(&self, peer: &Peer) {
        if peer.segment.doorbell().should_signal() {
            self.signal.signal(&peer.signal_addr);
            bump(&self.counters.signals_sent, 1);
        }
    }

    /// Runs `f` on `peer`'s sending side, keeps the count of peers with queued records right,
    /// and wakes the peer if anything was published.
    fn with_outbound<R>(&self, peer: &Peer, f: impl FnOnce(&mut Outbound) -> (R, bool)) -> R {
        let (r, published) = {
            let mut out = peer.out.lock();
            let before = (out.has_queued(), out.is_watching());
            let (r, published) = f(&mut out);
            let after = (out.has_queued(), out.is_watching());
            count_change(&self.queued_peers, before.0, after.0);
            count_change(&self.watching_peers, before.1, after.1);
            (r, published)
        };
        if published {
            self.nudge(peer);
        }
        r
    }

    /// Whether `peer` found at connection that it may use this process's memory (it says so in
    /// its own segment): it can then write its share of a split copy (the kernel checks
    /// writing another process's memory as it checks reading it).
    fn can_write_to_me(&self, peer: &Peer) -> bool {
        peer.segment
            .pair_info(self.me.rank)
            .is_some_and(|p| p.single_copy.load(Ordering::Relaxed) == SINGLE_COPY_YES)
    }

    /// Writes shares of the payloads this rank holds for receivers that offered them (see
    /// `split_copy`): a load per peer with held payloads when none is offered. One peer per
    /// call, and not under the list of peers (a chunk is a system call of tens of
    /// microseconds).
    fn help_receivers(&self) {
        // With records of its own to read (both ranks sending large messages at once), a
        // rank reads them rather than help: its core is busy either way, and the peer would
        // wait for its share.
        if self.watching_peers.load(Ordering::Acquire) == 0 || self.own.has_unread() {
            return;
        }
        let me = self.me.rank;
        let offered = self.connected_list().iter().find_map(|p| {
            let tag = (p.readable && !p.gone.load(Ordering::Acquire))
                .then(|| p.segment.split_slot(me)?.open_offer())??;
            Some((Arc::clone(p), tag))
        });
        let Some((peer, tag)) = offered else {
            return;
        };
        let Some(payload) = peer.out.lock().held_payload(tag) else {
            return;
        };
        let Some(slot) = peer.segment.split_slot(me) else {
            return;
        };
        self.helping_until.store(
            self.nanos_since_born() + HELP_LINGER.as_nanos() as u64,
            Ordering::Relaxed,
        );
        let written = slot.take_chunks(tag, |c| {
            c.total == payload.len() as u64
                && cma::write_slice(
                    peer.pid,
                    c.dst + c.offset,
                    &payload[c.offset as usize..(c.offset + c.len) as usize],
                )
                .is_ok()
        });
        bump(&self.counters.split_bytes_written, written);
    }

    /// Lets go of single-copy payloads the receivers have read and ends the timing of sends
    /// they have finished taking (one load when nothing is held or timed).
    fn observe_receivers(&self) {
        if self.watching_peers.load(Ordering::Acquire) == 0 {
            return;
        }
        let me = self.me.rank;
        for peer in self.connected_list().iter() {
            self.with_outbound(peer, |out| {
                out.observe(&peer.segment, me);
                ((), false)
            });
        }
    }

    fn connected_peers(&self) -> Vec<Arc<Peer>> {
        self.connected_list().clone()
    }

    /// The connected peers, read in place: for the loops a busy poll runs on every turn while a
    /// payload is held or records wait (a copy of the list costs an allocation and a reference
    /// count per peer each time). Nothing done under it may connect a peer (which writes it).
    fn connected_list(&self) -> std::sync::RwLockReadGuard<'_, Vec<Arc<Peer>>> {
        self.connected.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether records wait for ring space that has been freed.
    #[inline]
    fn can_flush(&self) -> bool {
        self.queued_peers.load(Ordering::Acquire) != 0 && self.can_flush_queued()
    }

    /// [`can_flush`](Self::can_flush) once some peer has records queued (rare: kept out of
    /// the busy-poll loop's code).
    #[cold]
    #[inline(never)]
    fn can_flush_queued(&self) -> bool {
        let me = self.me.rank;
        self.connected_list().iter().any(|p| {
            !p.gone.load(Ordering::Acquire)
                && p.out
                    .try_lock()
                    .is_none_or(|mut o| o.can_flush(&p.segment, me))
        })
    }

    /// Sends what waits for ring space.
    #[inline]
    fn flush_queued(&self) {
        if self.queued_peers.load(Ordering::Acquire) != 0 {
            self.flush_queued_peers();
        }
    }

    /// [`flush_queued`](Self::flush_queued) once some peer has records queued.
    #[cold]
    #[inline(never)]
    fn flush_queued_peers(&self) {
        for peer in self.connected_list().iter() {
            if peer.gone.load(Ordering::Acquire) {
                continue;
            }
            let me = self.me.rank;
            let published = self.with_outbound(peer, |out| {
                let published = out.flush(&peer.segment, me);
                (published, published)
            });
            if published {
                bump(&self.counters.traffic, 1);
            }
        }
    }

    /// Whether anything needs the progress engine: records in a ring, frames to self, queued
    /// records that now fit, a peer to report lost, or split-copy offers likely on their way
    /// (see [`helping`](Self::helping)). Lock-free.
    fn has_work(&self) -> bool {
        if !self.loopback.is_empty() || self.can_flush() {
            return true;
        }
        // Rings of senders that said goodbye or broke may hold records never to be read;
        // they are rare, and the cost is one spurious pump.
        self.unreported.load(Ordering::Acquire) > 0 || self.own.has_unread() || self.helping()
    }

    /// [`has_work`](Self::has_work), or a flag raised to this rank that the progress task has
    /// not noted yet (its drain wakes the futures parked on flags). What the progress task
    /// checks before it sleeps, and after arming the doorbell. Busy-polling futures check only
    /// `has_work`: they wait for messages, a future waiting on a flag looks at it itself, and
    /// the scan of every sender's flag would lengthen each of their polls.
    fn has_work_or_flags(&self) -> bool {
        self.has_work() || self.flags.changed(self.own.flags())
    }

    fn nanos_since_born(&self) -> u64 {
        self.born.elapsed().as_nanos() as u64
    }

    /// Whether this rank helped a receiver lately and still holds payloads: more offers are
    /// likely on their way (see [`HELP_LINGER`]).
    fn helping(&self) -> bool {
        let until = self.helping_until.load(Ordering::Relaxed);
        until != 0
            && self.watching_peers.load(Ordering::Relaxed) != 0
            && self.nanos_since_born() < until
    }

    /// Reads every ring; frames go to `out` unless `discard`.
    fn read_rings(&self, out: &mut Vec<Arrival>, discard: bool) -> usize {
        let Some(mut inbound) = self.inbound.try_lock() else {
            // Another thread is reading; it will deliver what is there.
            return 0;
        };
        if self.own.has_senders_beyond(inbound.known) {
            self.add_senders(&mut inbound);
        }
        let before = out.len();
        let mut lost = Vec::new();
        let (mut malformed, mut bytes, mut records) = (0, 0, 0);
        for ring in inbound.rings.iter_mut() {
            if !ring.has_records(&self.own) {
                continue;
            }
            // A sender may have written its last records and exited (or closed) before this
            // rank ever looked: what it left is read even when it can no longer be mapped.
            let peer = self.peer(ring.sender()).ok();
            let outcome = self.with_read_into(ring.sender(), peer, discard, |into| {
                ring.read(&self.own, into, READ_BUDGET, out)
            });
            self.publish_tokens_read(ring.sender(), outcome.tokens_read);
            if outcome.lent > 0 {
                bump(&self.counters.payloads_lent, outcome.lent as u64);
            }
            malformed += outcome.malformed as u64;
            bytes += outcome.bytes as u64;
            records += outcome.records as u64;
            let Some(peer) = peer else {
                if !ring.has_records(&self.own) {
                    ring.break_off(&self.own);
                    bump(&self.counters.peers_lost, 1);
                    lost.push(ring.sender());
                }
                continue;
            };
            if ring.is_broken() || ring.said_bye() {
                self.mark_gone(peer);
            }
            if outcome.producer_waits {
                self.nudge(peer);
            }
        }
        if records > 0 {
            bump(&self.counters.traffic, records);
        }
        inbound.malformed_dropped += malformed;
        inbound.bytes_received += bytes;
        inbound.frames_received += (out.len() - before) as u64;
        out.extend(lost.into_iter().map(|rank| Arrival::PeerLost { rank }));
        out.len() - before
    }

    /// Takes something straight from the ring of sender `from` (the short cuts of a receive
    /// waiting for it): `take` runs on that ring under the inbound lock — not at all while the
    /// rank is closed or another thread reads the rings, which then delivers what is there —
    /// and what it took is counted (`len`: its payload's length), then the sender is signalled
    /// if it waits for space.
    fn take_from<T>(
        &self,
        from: u32,
        take: impl FnOnce(&mut Inbound) -> inbound::Direct<T>,
        len: impl FnOnce(&T) -> usize,
    ) -> Option<T> {
        if self.closed.load(Ordering::Acquire) {
            return None;
        }
        let mut inbound = self.inbound.try_lock()?;
        if self.own.has_senders_beyond(inbound.known) {
            self.add_senders(&mut inbound);
        }
        let ring = inbound.rings.iter_mut().find(|r| r.sender() == from)?;
        let direct = take(ring);
        if let Some(t) = &direct.taken {
            inbound.frames_received += 1;
            inbound.bytes_received += len(t) as u64;
            // A single-copy payload was read: straight into the receive's buffer.
            inbound.read_into_receive += u64::from(direct.tokens_read.is_some());
        }
        drop(inbound);
        if direct.producer_waits {
            if let Some(peer) = self.peer_if_connected(from) {
                self.nudge(peer);
            }
        }
        direct.taken
    }

    /// [`Inbound::take_single_copy`] on `ring`, read as `read_rings` reads (the sender mapped
    /// first if it is not yet), the sender told how far this rank has read.
    fn take_single_copy<T>(
        &self,
        ring: &mut Inbound,
        dst: &mut [u8],
        accept: impl FnOnce(&Header, usize) -> Option<T>,
    ) -> inbound::Direct<T> {
        let sender = ring.sender();
        let peer = self.peer(sender).ok();
        let single = self.with_read_into(sender, peer, false, |read| {
            ring.take_single_copy(&self.own, dst, read, accept)
        });
        self.publish_tokens_read(sender, single.tokens_read);
        single
    }

    /// Tells `sender` how many of its single-copy payloads this rank has read (`tokens`, after
    /// a read that took one). After the reads: the sender may reuse the memory once it sees
    /// this. No signal: nothing waits for it (the sender looks on its next drain).
    fn publish_tokens_read(&self, sender: u32, tokens: Option<u64>) {
        if let (Some(n), Some(info)) = (tokens, self.own.pair_info(sender)) {
            info.tokens_read.store(n, Ordering::Release);
        }
    }

    /// Runs `f` with where the ring from `sender` (whose peer is `peer`, if it can still be
    /// mapped) is read into: its sender's process, its split-copy slot and the pool.
    fn with_read_into<R>(
        &self,
        sender: u32,
        peer: Option<&Arc<Peer>>,
        discard: bool,
        f: impl FnOnce(&ReadInto<'_>) -> R,
    ) -> R {
        let wake_sender = || {
            if let Some(p) = peer {
                self.nudge(p);
            }
        };
        // Asked only for payloads long enough to split: nothing here on the path of a small
        // message.
        let sender_free = || {
            peer.is_some_and(|p| {
                self.can_write_to_me(p) && p.out.try_lock().is_some_and(|o| !o.holds_payloads())
            })
        };
        let into = ReadInto {
            wake_sender: &wake_sender,
            sender_free: &sender_free,
            sender_pid: peer.map_or(0, |p| p.pid),
            split: (peer.is_some() && !discard && self.settings.split_copy)
                .then(|| self.own.split_slot(sender))
                .flatten(),
            sender_watch: peer.and_then(|p| p.watch.as_ref()).map(|w| w.get_ref()),
            pool: &self.pool,
            discard,
        };
        f(&into)
    }

    /// Starts reading the rings of senders that registered since the last look.
    #[cold]
    #[inline(never)]
    fn add_senders(&self, inbound: &mut InboundSet) {
        let mut fresh = Vec::new();
        inbound.known = self.own.senders_from(inbound.known, &mut fresh);
        for sender in fresh.into_iter().flatten() {
            if sender == self.me.rank || inbound.rings.iter().any(|r| r.sender() == sender) {
                continue;
            }
            if let Some(r) = Inbound::new(&self.own, sender) {
                self.prefault(&self.own, sender);
                inbound.rings.push(r);
            }
        }
    }

    /// Maps in the pages of the ring from `sender` in `segment` (a peer's, when this rank
    /// starts sending to it; its own, when a sender appears) while the budget lasts: the
    /// first pass of records round the ring then takes no page faults. Once per pair and
    /// side, at connection.
    fn prefault(&self, segment: &Segment, sender: u32) {
        let bytes = segment.pair_bytes();
        let granted = self
            .prefault_left
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |left| {
                left.checked_sub(bytes)
            })
            .is_ok();
        if granted && !segment.prefault_pair(sender) {
            // The kernel cannot: do not ask again for every pair.
            self.prefault_left.store(0, Ordering::Relaxed);
        }
    }

    /// Peers that are gone and not yet reported (cheap when there are none).
    fn gone_unreported(&self) -> Vec<Arc<Peer>> {
        if self.unreported.load(Ordering::Acquire) == 0 {
            return Vec::new();
        }
        self.connected_peers()
            .into_iter()
            .filter(|p| p.gone.load(Ordering::Acquire) && !p.reported.load(Ordering::Acquire))
            .collect()
    }

    /// Reports `peers` lost (found gone before their rings were last read, so everything they
    /// wrote has been delivered), once each.
    fn report_lost(&self, peers: Vec<Arc<Peer>>, out: &mut Vec<Arrival>) -> usize {
        let mut n = 0;
        for peer in peers {
            if !peer.reported.swap(true, Ordering::AcqRel) {
                self.unreported.fetch_sub(1, Ordering::AcqRel);
                self.with_outbound(&peer, |o| {
                    o.abandon();
                    ((), false)
                });
                bump(&self.counters.peers_lost, 1);
                out.push(Arrival::PeerLost { rank: peer.rank });
                n += 1;
            }
        }
        n
    }

    /// A busy poller found the doorbell armed and turned it off. The progress task may be
    /// asleep trusting it (no recheck timer): wake it once so that it looks again after the
    /// pollers (it sets its recheck timer), since they may finish without parking and leave
    /// arrivals to it.
    #[cold]
    #[inline(never)]
    fn nudge_trusting_progress_task(&self) {
        let mut park = lock(&self.park);
        if park.recheck.is_none() && !park.nudged {
            if let Some(w) = &park.waker {
                w.wake_by_ref();
                park.nudged = true;
            }
        }
    }

    /// Makes the progress task look again within [`RECHECK`] (it could not arm the doorbell).
    fn poll_recheck(&self, park: &mut Park, cx: &mut Context<'_>) -> Poll<()> {
        let timer = park
            .recheck
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(RECHECK)));
        if timer.as_mut().poll(cx).is_ready() {
            park.recheck = None;
            // Ready: the engine pumps once and comes back, arming if nobody spins by then.
            return Poll::Ready(());
        }
        Poll::Pending
    }

    /// Looks at the exit watches of the connected peers (no system call: the reactor tracks
    /// their readiness); marks exited ones gone. Returns whether any was new.
    fn poll_exits(&self, cx: &mut Context<'_>) -> bool {
        let mut any = false;
        for peer in self
            .connected
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            if let Some(w) = &peer.watch {
                if let Poll::Ready(Ok(mut g)) = w.poll_read_ready(cx) {
                    // Readable means exited, and stays so.
                    g.retain_ready();
                    if !peer.gone.load(Ordering::Acquire) {
                        self.mark_gone(peer);
                        any = true;
                    }
                }
            }
        }
        any
    }
}

impl Transport for ShmRank {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            reliable: true,
            ordered: true,
            max_payload: usize::MAX,
            multicast: false,
            rdma: false,
            by_reference: false,
        }
    }

    fn send(&self, to: u32, frame: Frame) -> Result<(), TransportError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(TransportError::Closed);
        }
        if to == self.me.rank {
            bump(&self.counters.frames_sent, 1);
            bump(&self.counters.bytes_sent, frame.payload.len() as u64);
            return self
                .loopback
                .push(Arrival::Frame {
                    from: self.me.rank,
                    frame,
                })
                .map_err(|_| TransportError::Closed);
        }
        let peer = self.peer(to)?;
        if peer.gone.load(Ordering::Acquire) {
            // Dropped, as a network drops datagrams to a host that is gone: `drain` reports the
            // loss after reading what the peer sent before leaving. An error here would make
            // the driver declare it lost at once, failing receives those frames would match.
            bump(&self.counters.frames_sent, 1);
            bump(&self.counters.bytes_sent, frame.payload.len() as u64);
            return Ok(());
        }
        let me = self.me.rank;
        self.with_outbound(peer, |out| ((), out.send(&peer.segment, me, frame)));
        Ok(())
    }

    fn send_eager(
        &self,
        to: u32,
        envelope: &Envelope,
        payload: &[&[u8]],
    ) -> Result<bool, TransportError> {
        // Anything out of the ordinary (closed, to self, a peer not connected yet or gone)
        // goes the usual way, which reports or handles it.
        if to == self.me.rank || self.closed.load(Ordering::Acquire) {
            return Ok(false);
        }
        let Some(peer) = self.peer_if_connected(to) else {
            return Ok(false);
        };
        if peer.gone.load(Ordering::Acquire) {
            return Ok(false);
        }
        let me = self.me.rank;
        if !peer
            .out
            .lock()
            .send_eager(&peer.segment, me, envelope, payload)
        {
            return Ok(false);
        }
        self.nudge(peer);
        Ok(true)
    }

    fn reads_in_place(&self, to: u32, len: usize) -> bool {
        // The length first: every eager send asks.
        if len < self.settings.idle_single_copy || self.settings.idle_single_copy == 0 {
            return false;
        }
        let Some(peer) = self.peer_if_connected(to) else {
            return false;
        };
        let me = self.me.rank;
        !peer.gone.load(Ordering::Acquire) && peer.out.lock().reads_in_place(&peer.segment, me, len)
    }

    fn drain(&self, out: &mut Vec<Arrival>) -> Result<usize, TransportError> {
        let mut n = 0;
        if !self.loopback.is_empty() {
            n += self.loopback.drain_into(out);
        }
        self.flush_queued();
        // Peers found gone before their rings are read (so everything they wrote is
        // delivered before their loss): rare, hence the check first.
        let gone = if self.unreported.load(Ordering::Acquire) == 0 {
            Vec::new()
        } else {
            self.gone_unreported()
        };
        n += self.read_rings(out, false);
        self.observe_receivers();
        self.help_receivers();
        // A peer gone wakes flag waiters too: the flag they wait for may never come.
        self.flags.observe(self.own.flags(), !gone.is_empty());
        if !gone.is_empty() {
            n += self.report_lost(gone, out);
        }
        Ok(n)
    }

    fn take_eager(&self, want: &EagerWant, mut into: Option<&mut [u8]>) -> Option<EagerTaken> {
        let take = |ring: &mut Inbound| {
            let direct = ring.take_eager(&self.own, want, into.as_deref_mut());
            let (true, Some(dst)) = (direct.single_copy_next, into) else {
                return direct;
            };
            // A large message, to be read from the sender's memory: straight into the
            // receive's buffer.
            let single = self.take_single_copy(ring, dst, |header, len| match *header {
                Header::Eager(envelope) if want.accepts(&envelope, len) => Some(EagerTaken {
                    tag: envelope.tag,
                    len,
                    data: bytes::Bytes::new(),
                }),
                _ => None,
            });
            inbound::Direct {
                producer_waits: direct.producer_waits || single.producer_waits,
                ..single
            }
        };
        self.take_from(want.from, take, |t| t.len)
    }

    fn take_data(&self, want: &DataWant, into: &mut [u8]) -> bool {
        let take = |ring: &mut Inbound| {
            self.take_single_copy(ring, into, |header, len| match *header {
                Header::Data { recv_id, offset: 0 }
                    if recv_id == want.recv_id && len == want.len =>
                {
                    Some(())
                }
                _ => None,
            })
        };
        self.take_from(want.from, take, |()| want.len).is_some()
    }

    fn poll_arrival(&self, cx: &mut Context<'_>) -> Poll<()> {
        let doorbell = self.own.doorbell();
        let ready = |park: &mut Park| {
            park.waker = None;
            park.recheck = None;
            park.look_anyway = None;
            doorbell.disarm();
            Poll::Ready(())
        };
        // Always looked at (it also registers the waker for exits), even when busy.
        self.poll_exits(cx);
        let signalled = self.signal.poll_signalled(cx).is_ready();
        let mut park = lock(&self.park);
        // Still armed: no producer took the doorbell, so work found now came unannounced.
        let looked_anyway = doorbell.is_armed()
            && park
                .look_anyway
                .as_mut()
                .is_some_and(|t| t.as_mut().poll(cx).is_ready());
        park.look_anyway = None;
        park.waker = Some(cx.waker().clone());
        park.nudged = false;
        if signalled || self.has_work_or_flags() {
            if looked_anyway && !signalled {
                bump(&self.counters.wakeups_missed, 1);
                tracing::warn!(
                    rank = self.me.rank,
                    "shm: found work after {LOOK_ANYWAY:?} asleep on the doorbell without a signal"
                );
            }
            return ready(&mut park);
        }
        // Futures polled since the last look: they poll in short bursts, and arming the
        // doorbell in a gap between two would only make producers pay for signals. Look again
        // after the recheck time instead (a future that parks arms it at once).
        if self.busy_seen.swap(false, Ordering::Relaxed) {
            return self.poll_recheck(&mut park, cx);
        }
        doorbell.arm();
        if self.has_work_or_flags() {
            return ready(&mut park);
        }
        park.recheck = None;
        let mut timer = Box::pin(tokio::time::sleep(LOOK_ANYWAY));
        // Registers the waker (a fresh timer is never ready).
        let _ = timer.as_mut().poll(cx);
        park.look_anyway = Some(timer);
        Poll::Pending
    }

    /// Also `true` while a send is held or timed: a busy poller then drains, and so observes
    /// the receivers, on every turn, and a timed send's time ends when the receiver is done,
    /// not when something next arrives (see `copy_path`).
    fn may_have_arrivals(&self) -> bool {
        self.has_work() || self.watching_peers.load(Ordering::Acquire) != 0
    }

    /// Takes no lock and no atomic read-modify-write in the common case, where a burst follows
    /// another and the doorbell is off already: a flag for the progress task and one load.
    /// Nothing here decides whether a message is seen — producers signal exactly when the
    /// doorbell is armed, and an armed doorbell is the only state in which the progress task
    /// sleeps without a recheck timer — so the flag needs no ordering: read late, it costs a
    /// signal or a recheck, never a lost wake-up.
    fn begin_busy_poll(&self) {
        if !self.busy_seen.load(Ordering::Relaxed) {
            self.busy_seen.store(true, Ordering::Relaxed);
        }
        if self.own.doorbell().disarm() {
            self.nudge_trusting_progress_task();
        }
    }

    fn end_busy_poll(&self) {
        // Nothing to undo. The doorbell stays disarmed: the poller usually starts its next
        // burst at once. If it parks instead, `waiter_parked` arms it; if it finished, the
        // progress task's recheck timer does.
    }

    fn waiter_parked(&self) {
        let park = lock(&self.park);
        // The future will not poll in bursts any more: the progress task may arm the
        // doorbell as soon as it next looks (if it is running now), or here (if it sleeps).
        self.busy_seen.store(false, Ordering::Relaxed);
        if park.waker.is_some() {
            self.own.doorbell().arm();
            // Anything that arrived before the arm is taken in by the parking future's own
            // check (the driver pumps after this) or wakes the progress task here.
            if self.has_work_or_flags() {
                self.own.doorbell().disarm();
                if let Some(w) = &park.waker {
                    w.wake_by_ref();
                }
            }
        }
    }

    fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        *lock(&self.closed_at) = Some(Instant::now());
        let me = self.me.rank;
        for rank in self.directory.told_on_close() {
            if rank != me {
                let _ = self.peer(rank);
            }
        }
        for peer in self.connected_peers() {
            if !peer.gone.load(Ordering::Acquire) {
                self.with_outbound(&peer, |o| {
                    ((), o.send_control(&peer.segment, me, record::BYE, &[]))
                });
            }
        }
    }

    fn is_drained(&self) -> bool {
        if !self.closed.load(Ordering::Acquire) {
            return true;
        }
        // Nobody drains a closed rank: keep answering single-copy reads and flushing.
        self.flush_queued();
        let mut discarded = Vec::new();
        self.read_rings(&mut discarded, true);
        for peer in self.connected_peers() {
            if peer
                .watch
                .as_ref()
                .is_some_and(|w| w.get_ref().has_exited())
            {
                peer.gone.store(true, Ordering::Release);
            }
        }
        self.observe_receivers();
        let settled = self
            .connected_peers()
            .iter()
            .all(|p| p.gone.load(Ordering::Acquire) || p.out.lock().is_idle());
        let expired = lock(&self.closed_at).is_some_and(|t| t.elapsed() >= self.linger);
        settled || expired
    }

    fn stats(&self) -> TransportStats {
        let mut s = TransportStats::default();
        s.shm = self.counters();
        s
    }

    fn can_read_peer_memory(&self, peer: u32) -> bool {
        self.peer(peer)
            .is_ok_and(|p| p.readable && !p.gone.load(Ordering::Acquire))
    }

    fn read_peer_memory(
        &self,
        peer: u32,
        addr: u64,
        dst: &mut [std::mem::MaybeUninit<u8>],
    ) -> Result<(), TransportError> {
        let p = self.peer(peer)?;
        if p.gone.load(Ordering::Acquire) {
            return Err(TransportError::PeerUnreachable(peer as usize));
        }
        if !p.readable {
            return Err(TransportError::Unavailable {
                transport: "shared memory",
                reason: format!("the kernel does not let this process read rank {peer}'s memory"),
            });
        }
        cma::read_slice(p.pid, addr, dst).map_err(|message| {
            if p.gone.load(Ordering::Acquire) {
                TransportError::PeerUnreachable(peer as usize)
            } else {
                TransportError::Io {
                    op: "reading a local peer's memory",
                    message,
                }
            }
        })
    }

    /// Every other rank of the job: they are all on this host (a job that also has ranks
    /// elsewhere reaches this transport through the split one, which says which are local).
    /// Decided without connecting, so that every rank answers alike whatever state its peers
    /// are in.
    fn has_flags_with(&self, peer: u32) -> bool {
        peer < self.me.world && peer != self.me.rank
    }

    fn raise_flag(&self, peer: u32, value: u64) -> Result<(), TransportError> {
        let p = self.peer(peer)?;
        if p.gone.load(Ordering::Acquire) {
            return Err(TransportError::PeerUnreachable(peer as usize));
        }
        let line = p
            .segment
            .flag_line(self.me.rank)
            .ok_or(TransportError::PeerUnreachable(peer as usize))?;
        // Release: what this rank did before raising is visible to a peer that sees the value.
        line.value.store(value, Ordering::Release);
        // A peer asleep on its doorbell is woken as for a record (see `flags.rs`).
        self.nudge(p);
        Ok(())
    }

    fn park_on_flags(&self, waker: &std::task::Waker) {
        self.flags.park(waker);
    }

    fn read_flag(&self, peer: u32) -> Result<PeerFlag, TransportError> {
        let p = self.peer(peer)?;
        let line = self
            .own
            .flag_line(peer)
            .ok_or(TransportError::PeerUnreachable(peer as usize))?;
        let value = line.value.load(Ordering::Acquire);
        Ok(PeerFlag {
            value,
            peer_gone: p.gone.load(Ordering::Acquire),
        })
    }
}

/// An in-memory [`SegmentDirectory`] for the ranks of one process.
#[derive(Debug, Default)]
pub struct LocalSegments {
    entries: Mutex<FxHashMap<u32, SegmentAddress>>,
}

impl LocalSegments {
    /// Records rank `rank`'s address.
    pub fn publish(&self, rank: u32, addr: SegmentAddress) {
        lock(&self.entries).insert(rank, addr);
    }
}

impl SegmentDirectory for LocalSegments {
    fn lookup_segment(&self, rank: u32) -> Result<SegmentAddress, TransportError> {
        lock(&self.entries)
            .get(&rank)
            .cloned()
            .ok_or(TransportError::PeerUnreachable(rank as usize))
    }

    fn told_on_close(&self) -> Vec<u32> {
        lock(&self.entries).keys().copied().collect()
    }
}

/// The world communicators of an `n`-rank job whose ranks are tasks of this process but talk
/// through shared-memory segments, exactly as processes would (for tests and measurements).
/// Must be called inside a tokio runtime.
pub fn world(n: usize, config: &Config) -> Result<Vec<Communicator>, Error> {
    let size = u32::try_from(n)
        .ok()
        .filter(|&s| s > 0)
        .ok_or_else(|| Error::InvalidArgument(format!("{n} ranks")))?;
    let directory = Arc::new(LocalSegments::default());
    let transports = (0..size)
        .map(|rank| {
            let t = ShmTransport::new(
                rank,
                size,
                config.shm,
                config.peer_timeout,
                directory.clone(),
            )?;
            directory.publish(rank, t.address());
            Ok(Arc::new(t))
        })
        .collect::<Result<Vec<_>, TransportError>>()?;
    let job_key = rankweave_core::rng::random_u64();
    transports
        .into_iter()
        .enumerate()
        .map(|(rank, t)| {
            let multicast = crate::ipmcast::setup(config, rank as u32, job_key);
            Communicator::world_with_multicast(rank, n, t, config.clone(), multicast)
        })
        .collect()
}

/// Moves `counter` (of peers in some state) by a peer's change of state from `before` to
/// `after`.
fn count_change(counter: &AtomicUsize, before: bool, after: bool) {
    match (before, after) {
        (false, true) => {
            counter.fetch_add(1, Ordering::AcqRel);
        }
        (true, false) => {
            counter.fetch_sub(1, Ordering::AcqRel);
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests;
