//! [`RcTransport`]: the thin driver that runs one [`RcChannel`] per peer and port (a *lane*)
//! and one [`PeerStream`] per peer over one or more [`Provider`]s (ports), and implements
//! [`Transport`].
//!
//! Each rank has, per peer, one RC queue pair on each of its ports (lane *i* on port *i*,
//! connected to the peer's lane *i*), with [`RcSettings::window`] receive buffers of
//! [`RcSettings::buffer_len`] bytes posted on each; each port has one registered region of
//! send buffers shared by all peers and its own memory-registration cache (registrations
//! belong to one port's protection domain). The peer's [`PeerStream`] numbers the frames,
//! puts eager ones on the first live lane, stripes large ones across the live lanes, and
//! restores the order at the receiver. The driver posts what the channels produce, turns
//! completions back into channel and stream events, registers the buffers of incoming
//! rendezvous transfers (and deregisters them to hand their bytes over without a copy), and
//! registers outgoing payloads through the [`MrCache`] of the lane's port: for an RDMA write,
//! or, from [`RcSettings::read_min`] on, for the peer to read (released on the peer's Fin).
//!
//! A queue pair that fails (its port or the peer's is down, retries ran out) takes its lane
//! out: the stream re-sends on the surviving lanes every frame the lane had not delivered,
//! and the receiver drops the duplicates. When a peer's last lane fails, its frames already
//! complete are delivered, then [`Arrival::PeerLost`]. A peer that closes says BYE (with the
//! end of its stream) on every lane, and is reported lost once everything before that end has
//! been delivered.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rankweave_core::frame::Frame;
use rankweave_core::{Arrival, Capabilities, Transport, TransportError, TransportStats};
use rustc_hash::FxHashMap;

use super::channel::{ChannelConfig, ChannelCounters, RcChannel, Transmit};
use super::device_event::PortChange;
use super::error::VerbsError;
use super::message::StreamTag;
use super::mr_cache::{MrCache, MrCacheCounters};
use super::provider::{
    Buffer, Completion, CompletionKind, CompletionStatus, MemoryRegion, MrId, PortAddress,
    Provider, QpAddress, QpCaps, QpKind, QpNum, RemoteSlice, SendOp, SendRequest, Sge,
};
use super::stream::{MAX_LANES, PeerStream, StreamConfig, StreamCounters};

/// Settings of the RC transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RcSettings {
    /// Receive buffers posted per peer and lane (the credit window); at least 4.
    pub window: u32,
    /// Bytes of each receive and send buffer: frames whose message fits go eagerly, larger
    /// ones by rendezvous. At least 256.
    pub buffer_len: usize,
    /// Send buffers per port, shared by all peers; at least 1.
    pub send_buffers: u32,
    /// The largest rendezvous payload accepted from a peer.
    pub max_transfer: u64,
    /// Bytes of idle registrations each port's memory-registration cache keeps.
    pub mr_cache_bytes: usize,
    /// The largest single RDMA write or read (larger payloads move in pieces).
    pub max_write: usize,
    /// Frames with at least this many payload bytes are striped across the live lanes.
    pub stripe_min: usize,
    /// Rendezvous frames (or striped parts) with at least this many payload bytes go by RDMA
    /// read (receiver-driven) instead of RDMA write; `usize::MAX` never. See
    /// [`DEFAULT_READ_MIN`] for the reasoning behind the default.
    pub read_min: usize,
    /// How long a closed rank waits for its last sends to complete.
    pub linger: Duration,
}

impl Default for RcSettings {
    fn default() -> Self {
        RcSettings {
            window: 32,
            buffer_len: 8 * 1024,
            send_buffers: 128,
            max_transfer: 1 << 36,
            mr_cache_bytes: 256 << 20,
            max_write: 1 << 30,
            stripe_min: 1 << 20,
            read_min: DEFAULT_READ_MIN,
            linger: Duration::from_secs(5),
        }
    }
}

/// The default [`RcSettings::read_min`]: 4 MiB.
///
/// Both rendezvous protocols put the payload at the receiver after the same wire time (Rts,
/// then Cts and write, or read request and response: about 1.5 round trips), so the choice is
/// about who must act and what it costs:
///
/// * **RDMA read** avoids the Cts round trip *through the sender's progress engine*: once the
///   ReadRts is out, the sender need not poll again for the data to move, so a sender busy
///   computing does not delay a large transfer, and the receiver pulls when its buffer is
///   ready. It costs a completion message (Fin) the sender must see before it may release the
///   payload (half a round trip later than a write's completion), one more credit-consuming
///   message, and outstanding reads per queue pair are limited by the device (`max_rd_atomic`,
///   often 16), so small reads pipeline worse than writes.
/// * **RDMA write with immediate data** avoids the completion message: the write's own
///   completion tells both sides, so it is the cheaper protocol whenever the sender is
///   progressing anyway, which is the common case for medium frames.
///
/// For frames of several MiB the transfer time dwarfs the Fin's half round trip and the extra
/// message, while decoupling from the sender's progress matters most, so reads win there (MPI
/// libraries over verbs make the same choice: UCX's `get_zcopy` rendezvous, Open MPI's RDMA
/// get). 4 MiB leaves medium frames (up to the stripe size of striped frames below 8 MiB) on
/// the write path. The figure is a reasoned default, not a measurement: nothing here has run on
/// hardware; `RANKWEAVE_VERBS_READ_MIN` overrides it.
pub const DEFAULT_READ_MIN: usize = 4 << 20;

impl RcSettings {
    /// Checks the bounds documented on the fields.
    pub fn validate(&self) -> Result<(), VerbsError> {
        let bad = |what: String| Err(VerbsError::InvalidSetting(what));
        if self.window < 4 || self.window > u32::from(u16::MAX) {
            return bad(format!("window {} (4 to 65535)", self.window));
        }
        if self.buffer_len < 256 || u32::try_from(self.buffer_len).is_err() {
            return bad(format!("buffer length {} (256 to 4 GiB)", self.buffer_len));
        }
        if self.send_buffers == 0 {
            return bad("0 send buffers".into());
        }
        if self.max_write == 0 || self.max_write > 1 << 31 {
            return bad(format!("max write {} (1 to 2 GiB)", self.max_write));
        }
        Ok(())
    }
}

/// The addresses of a rank's RC queue pairs for one peer, one per lane (port), in lane
/// order: what the connection exchange carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RcAddress {
    count: u8,
    lanes: [QpAddress; MAX_LANES],
}

const NO_ADDRESS: QpAddress = QpAddress {
    port: PortAddress {
        lid: 0,
        gid: [0; 16],
    },
    qpn: QpNum(0),
};

impl RcAddress {
    /// Bytes of the longest encoding: a count byte and 22 bytes per lane.
    pub const MAX_ENCODED_LEN: usize = 1 + MAX_LANES * QpAddress::ENCODED_LEN;

    /// The addresses of `lanes` (1 to [`MAX_LANES`]).
    pub fn new(lanes: &[QpAddress]) -> Result<RcAddress, VerbsError> {
        if lanes.is_empty() || lanes.len() > MAX_LANES {
            return Err(VerbsError::InvalidSetting(format!(
                "{} lanes (1 to {MAX_LANES})",
                lanes.len()
            )));
        }
        let mut a = RcAddress {
            count: lanes.len() as u8,
            lanes: [NO_ADDRESS; MAX_LANES],
        };
        a.lanes[..lanes.len()].copy_from_slice(lanes);
        Ok(a)
    }

    /// One lane.
    pub fn single(lane: QpAddress) -> RcAddress {
        let mut lanes = [NO_ADDRESS; MAX_LANES];
        lanes[0] = lane;
        RcAddress { count: 1, lanes }
    }

    /// The lanes' addresses.
    pub fn lanes(&self) -> &[QpAddress] {
        &self.lanes[..usize::from(self.count)]
    }

    /// Appends the encoding (count, then per lane: LID, GID, QPN; little-endian) to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.push(self.count);
        for a in self.lanes() {
            a.encode(out);
        }
    }

    /// Decodes an encoding at the start of `bytes`; returns it and its length, or `None` when
    /// `bytes` is too short or the count is out of range.
    pub fn decode(bytes: &[u8]) -> Option<(RcAddress, usize)> {
        let count = usize::from(*bytes.first()?);
        if count == 0 || count > MAX_LANES {
            return None;
        }
        let len = 1 + count * QpAddress::ENCODED_LEN;
        let body = bytes.get(1..len)?;
        let mut lanes = [NO_ADDRESS; MAX_LANES];
        for (slot, a) in lanes
            .iter_mut()
            .zip(body.chunks_exact(QpAddress::ENCODED_LEN))
        {
            *slot = QpAddress::decode(a)?;
        }
        Some((
            RcAddress {
                count: count as u8,
                lanes,
            },
            len,
        ))
    }
}

/// Counters of an [`RcTransport`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RcCounters {
    /// The channels' counters, summed over peers and lanes.
    pub channels: ChannelCounters,
    /// The streams' counters, summed over peers (striping, lane failures, replays,
    /// duplicates).
    pub stream: StreamCounters,
    /// The memory-registration caches' counters, summed over ports.
    pub mr_cache: MrCacheCounters,
    /// Messages from peers that broke the protocol (the peer is then treated as lost).
    pub protocol_errors: u64,
    /// Work requests that completed with an error.
    pub failed_completions: u64,
    /// Peers reported lost.
    pub peers_lost: u64,
    /// Failed lanes given a new queue pair (fail-back), the old one torn down.
    pub lanes_reopened: u64,
}

/// Kinds of work request, in the top byte of `wr_id`.
mod wr {
    pub(super) const RECV: u64 = 1;
    pub(super) const SEND: u64 = 2;
    pub(super) const WRITE_LAST: u64 = 3;
    pub(super) const WRITE_PIECE: u64 = 4;
    pub(super) const READ_LAST: u64 = 5;
    pub(super) const READ_PIECE: u64 = 6;

    pub(super) fn id(kind: u64, peer: u32, index: u32) -> u64 {
        (kind << 56) | (u64::from(peer & 0x00FF_FFFF) << 32) | u64::from(index)
    }

    pub(super) fn kind(id: u64) -> u64 {
        id >> 56
    }

    pub(super) fn peer(id: u64) -> u32 {
        ((id >> 32) & 0x00FF_FFFF) as u32
    }

    pub(super) fn index(id: u64) -> u32 {
        id as u32
    }
}

/// Where a lane stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LaneState {
    /// Made, waiting for the connection to the peer.
    Unconnected,
    /// Connected and carrying traffic.
    Live,
    /// Its queue pair failed (it stays in the error state); the lane waits for fail-back.
    Failed,
    /// A new queue pair replaced the failed one (receive buffers posted, fresh channel):
    /// connected once `remote` is set, carrying traffic once the lane exchange is established.
    Reopened,
    /// The peer has no lane of this number: never used.
    Absent,
}

/// One queue pair of a peer's connection, on one port.
struct Lane {
    qp: QpNum,
    /// The peer's queue pair this one is connected to (`None`: not yet, or not used).
    remote: Option<QpAddress>,
    channel: RcChannel,
    recv_region: MemoryRegion,
    state: LaneState,
}

struct Peer {
    lanes: Vec<Lane>,
    stream: PeerStream,
    connected: bool,
    /// Every lane failed, or the peer broke the protocol.
    failed: bool,
    lost_reported: bool,
}

impl Peer {
    fn usable(&self, lane: usize) -> bool {
        self.lanes
            .get(lane)
            .is_some_and(|l| l.state == LaneState::Live)
    }

    /// Lane `lane` failed: the stream moves its frames to the other lanes, and the first of
    /// them tells the peer (which may not notice on its own: a queue pair whose peer's port
    /// died fails only when it sends). Without a lane left, the peer has failed. A reopened
    /// lane that fails (its port flapped) carried nothing yet: it only tells the peer, in
    /// case the peer's side of it is connected already.
    fn fail_lane(&mut self, peer: u32, lane: usize) {
        let Some(l) = self.lanes.get_mut(lane) else {
            return;
        };
        let was = l.state;
        if !matches!(
            was,
            LaneState::Live | LaneState::Unconnected | LaneState::Reopened
        ) {
            return;
        }
        l.state = LaneState::Failed;
        let qpn = l.qp.0;
        let connected = l.remote.is_some();
        tracing::debug!(peer, lane, "verbs: RC lane failed");
        if was != LaneState::Reopened && !self.stream.lane_failed(lane) {
            self.failed = true;
            return;
        }
        if connected && let Some(other) = (0..self.lanes.len()).find(|&o| self.usable(o)) {
            self.lanes[other].channel.report_lane_down(lane as u32, qpn);
        }
    }
}

/// Creates a lane's queue pair for `peer` on `port`, registers its receive buffers and posts
/// them; the lane is [`LaneState::Unconnected`] with a fresh channel (full credits).
fn make_lane<P: Provider>(
    port: &mut Port<P>,
    peer: u32,
    settings: &RcSettings,
) -> Result<Lane, VerbsError> {
    let len = settings.buffer_len;
    let caps = QpCaps {
        max_send_wr: settings.window * 2 + 16,
        max_recv_wr: settings.window,
        rnr_retry: 7,
    };
    let qp = port.provider.create_qp(QpKind::Rc, caps)?;
    let recv_region =
        match port
            .provider
            .register(Buffer::Owned(vec![0; len * settings.window as usize]))
        {
            Ok(r) => r,
            Err(e) => {
                let _ = port.provider.destroy_qp(qp);
                return Err(e);
            }
        };
    for slot in 0..settings.window {
        let posted = port.provider.post_recv(
            qp,
            wr::id(wr::RECV, peer, slot),
            Sge {
                mr: recv_region.id,
                offset: slot as usize * len,
                len,
            },
        );
        if let Err(e) = posted {
            let _ = port.provider.destroy_qp(qp);
            let _ = port.provider.deregister(recv_region.id);
            return Err(e);
        }
    }
    Ok(Lane {
        qp,
        remote: None,
        channel: RcChannel::new(ChannelConfig {
            window: settings.window,
            buffer_len: len,
            max_transfer: settings.max_transfer,
            read_min: settings.read_min,
        }),
        recv_region,
        state: LaneState::Unconnected,
    })
}

/// Releases what the replaced lane `old` of `peer` on `port` held: its queue pair (destroyed;
/// it has been in the error state since the lane failed, so its flushed completions are
/// behind), its receive buffers, the buffers of incoming transfers not completed, and the
/// payload registrations of its outgoing transfers. Completions of the old queue pair that
/// come later are ignored (it is no longer in `by_qp`, its RDMA requests are forgotten).
fn tear_down_lane<P: Provider>(port: &mut Port<P>, peer: u32, old: &mut Lane) {
    port.by_qp.remove(&old.qp);
    port.reads.retain(|_, (p, _)| *p != peer);
    let writes: Vec<u32> = port
        .writes
        .iter()
        .filter(|(_, (_, p, _))| *p == peer)
        .map(|(&id, _)| id)
        .collect();
    for id in writes {
        if let Some((mr, _, _)) = port.writes.remove(&id) {
            port.cache.release(mr);
        }
    }
    for mr in old.channel.take_read_sources() {
        port.cache.release(mr);
    }
    let buffers = old
        .channel
        .take_incoming_writes()
        .into_iter()
        .chain(old.channel.take_incoming_reads())
        .chain([old.recv_region.id]);
    for mr in buffers {
        if let Err(e) = port.provider.deregister(mr) {
            tracing::debug!(peer, error = %e, "verbs: old lane's buffer not deregistered");
        }
    }
    if let Err(e) = port.provider.destroy_qp(old.qp) {
        tracing::debug!(peer, error = %e, "verbs: old lane's queue pair not destroyed");
    }
    for id in port.cache.evict() {
        let _ = port.provider.deregister(id);
    }
}

/// One port: its provider and what the transport keeps per port.
struct Port<P> {
    provider: P,
    send_region: MemoryRegion,
    free_send: Vec<u32>,
    /// Per send buffer in flight: the frame its message delivers.
    sending: Vec<Option<(u32, StreamTag)>>,
    cache: MrCache,
    /// Outstanding final RDMA writes: their cached source region and the frame they deliver.
    writes: FxHashMap<u32, (MrId, u32, StreamTag)>,
    next_write: u32,
    /// Outstanding final RDMA reads (read rendezvous as the receiver): their peer and transfer.
    reads: FxHashMap<u32, (u32, u32)>,
    next_read: u32,
    by_qp: FxHashMap<QpNum, u32>,
}

/// A rank's queue pairs and buffers before they are connected: made first on every rank so
/// that each can tell the others its queue pair numbers.
pub struct PreparedRc<P: Provider> {
    state: State<P>,
}

impl<P: Provider> PreparedRc<P> {
    /// Creates one RC queue pair per peer and port of rank `rank` in a `size`-rank job on
    /// `ports` (1 to [`MAX_LANES`]), registers the buffers and posts the receives.
    pub fn new(
        ports: Vec<P>,
        rank: u32,
        size: u32,
        settings: RcSettings,
    ) -> Result<PreparedRc<P>, VerbsError> {
        let mut state = State::new(ports, rank, size, settings)?;
        for peer in 0..size {
            if peer != rank {
                state.open_peer(peer)?;
            }
        }
        Ok(PreparedRc { state })
    }

    /// The addresses of this rank's queue pairs for `peer` (`None` for itself or out of
    /// range).
    pub fn address_for(&self, peer: u32) -> Option<RcAddress> {
        let p = self.state.peers.get(peer as usize)?.as_ref()?;
        Some(self.state.address_of(p))
    }

    /// Connects every queue pair: `remotes[peer]` is `peer`'s addresses for this rank.
    pub fn connect(mut self, remotes: &[Option<RcAddress>]) -> Result<RcTransport<P>, VerbsError> {
        let size = self.state.peers.len();
        let mut pending = Vec::new();
        for (peer, slot) in self.state.peers.iter().enumerate() {
            if slot.is_none() {
                continue;
            }
            let remote =
                remotes.get(peer).copied().flatten().ok_or_else(|| {
                    VerbsError::InvalidSetting(format!("no address for rank {peer}"))
                })?;
            pending.push((peer as u32, remote));
        }
        for (peer, remote) in pending {
            self.state.connect_peer(peer, remote)?;
        }
        Ok(RcTransport {
            rank: self.state.rank,
            size: size as u32,
            state: Mutex::new(self.state),
        })
    }
}

/// One rank's RC transport (see the [module docs](self)).
pub struct RcTransport<P: Provider> {
    rank: u32,
    size: u32,
    state: Mutex<State<P>>,
}

impl<P: Provider> std::fmt::Debug for RcTransport<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RcTransport")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish_non_exhaustive()
    }
}

struct State<P: Provider> {
    rank: u32,
    settings: RcSettings,
    ports: Vec<Port<P>>,
    peers: Vec<Option<Peer>>,
    arrivals: VecDeque<Arrival>,
    completions: Vec<Completion>,
    closed_at: Option<Instant>,
    counters: RcCounters,
    /// Per port: whether it is up, as its device events tell.
    port_up: Vec<bool>,
    /// Failed lanes whose port came back: `(peer, lane)`, until they are live again.
    reopen_wanted: Vec<(u32, usize)>,
}

impl<P: Provider> RcTransport<P> {
    fn lock(&self) -> MutexGuard<'_, State<P>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// This transport's counters.
    pub fn counters(&self) -> RcCounters {
        let s = self.lock();
        let mut c = s.counters;
        for p in s.peers.iter().flatten() {
            for l in &p.lanes {
                let pc = l.channel.counters();
                c.channels.eager_sent += pc.eager_sent;
                c.channels.rendezvous_sent += pc.rendezvous_sent;
                c.channels.read_rendezvous_sent += pc.read_rendezvous_sent;
                c.channels.rdma_bytes_read += pc.rdma_bytes_read;
                c.channels.rdma_bytes_sent += pc.rdma_bytes_sent;
                c.channels.credit_updates_sent += pc.credit_updates_sent;
                c.channels.credit_stalls += pc.credit_stalls;
                c.channels.frames_delivered += pc.frames_delivered;
            }
            let sc = p.stream.counters();
            c.stream.frames_sent += sc.frames_sent;
            c.stream.frames_striped += sc.frames_striped;
            for i in 0..MAX_LANES {
                c.stream.parts_per_lane[i] += sc.parts_per_lane[i];
                c.stream.bytes_per_lane[i] += sc.bytes_per_lane[i];
            }
            c.stream.lane_failures += sc.lane_failures;
            c.stream.lane_restorations += sc.lane_restorations;
            c.stream.replayed += sc.replayed;
            c.stream.duplicates += sc.duplicates;
            c.stream.frames_delivered += sc.frames_delivered;
        }
        for port in &s.ports {
            let mc = port.cache.counters();
            c.mr_cache.hits += mc.hits;
            c.mr_cache.misses += mc.misses;
            c.mr_cache.evictions += mc.evictions;
        }
        c
    }

    /// A transport of rank `rank` in a `size`-rank job over `ports` (1 to [`MAX_LANES`]) with
    /// no connection yet: queue pairs are made by [`open_peer`](Self::open_peer) and
    /// connected by [`connect_peer`](Self::connect_peer) when the connection manager says so.
    /// Frames to a peer that is not connected wait until it is.
    pub fn on_demand(
        ports: Vec<P>,
        rank: u32,
        size: u32,
        settings: RcSettings,
    ) -> Result<RcTransport<P>, VerbsError> {
        Ok(RcTransport {
            rank,
            size,
            state: Mutex::new(State::new(ports, rank, size, settings)?),
        })
    }

    /// Creates the queue pairs for `peer` (one per port) with their receive buffers posted,
    /// if it has none yet; returns their addresses (what the peer connects to).
    pub fn open_peer(&self, peer: u32) -> Result<RcAddress, VerbsError> {
        self.lock().open_peer(peer)
    }

    /// Connects the queue pairs for `peer` (made by [`open_peer`](Self::open_peer)) to the
    /// peer's `remote`, lane by lane (as many lanes as both sides have); a repeat with the
    /// same `remote` does nothing, another `remote` is an error.
    pub fn connect_peer(&self, peer: u32, remote: RcAddress) -> Result<(), VerbsError> {
        self.lock().connect_peer(peer, remote)
    }

    /// The lanes to re-establish, `(peer, lane)`: failed lanes whose port came back
    /// ([`PortChange::Up`]) and that are not live again, while the port is up and the peer not
    /// lost. The driver runs the lane exchange for each (see
    /// [`lane_reconnect`](super::lane_reconnect)); a lane stays in this list until
    /// [`lane_established`](Self::lane_established), so a failed exchange is tried again.
    pub fn lanes_to_reopen(&self) -> Vec<(u32, usize)> {
        self.lock().lanes_to_reopen()
    }

    /// Gives lane `lane` of `peer` a new RC queue pair with its receive buffers posted and a
    /// fresh channel (full credits), not connected yet, and returns its address; the old
    /// queue pair is destroyed and its buffers deregistered. A lane that is still live fails
    /// first (its frames move to the other lanes). A lane reopened already and not connected
    /// keeps its new queue pair (a repeat returns the same address). An error if the peer or
    /// the lane does not exist, was never connected, or the peer is lost.
    pub fn reopen_lane(&self, peer: u32, lane: usize) -> Result<QpAddress, VerbsError> {
        self.lock().reopen_lane(peer, lane)
    }

    /// Connects the new queue pair of lane `lane` of `peer` (from
    /// [`reopen_lane`](Self::reopen_lane)) to the peer's new one, `remote`; it receives from
    /// now on but sends only after [`lane_established`](Self::lane_established). A repeat
    /// with the same `remote` does nothing; another `remote`, or a lane not reopened, is an
    /// error.
    pub fn connect_lane(
        &self,
        peer: u32,
        lane: usize,
        remote: QpAddress,
    ) -> Result<(), VerbsError> {
        self.lock().connect_lane(peer, lane, remote)
    }

    /// The lane exchange for lane `lane` of `peer` is complete: the lane carries traffic
    /// again (striping resumes over it). Returns whether the lane was waiting for that (a
    /// lane that failed again meanwhile stays down).
    pub fn lane_established(&self, peer: u32, lane: usize) -> bool {
        self.lock().lane_established(peer, lane)
    }

    /// The lane exchange for lane `lane` of `peer` ran out of retransmissions: a reopened lane
    /// fails again (and tells the peer); it is tried again while its port is up.
    pub fn abandon_reopened_lane(&self, peer: u32, lane: usize) {
        self.lock().abandon_reopened_lane(peer, lane);
    }

    /// Whether the connection to `peer` is made and some lane of it has not failed.
    pub fn is_connected(&self, peer: u32) -> bool {
        let s = self.lock();
        matches!(s.peers.get(peer as usize), Some(Some(p)) if p.connected && !p.failed)
    }

    /// Whether lane `lane` of the connection to `peer` is connected and has not failed.
    pub fn lane_up(&self, peer: u32, lane: usize) -> bool {
        let s = self.lock();
        matches!(s.peers.get(peer as usize), Some(Some(p)) if p.usable(lane))
    }

    /// Credits this rank holds for `peer` on its first lane now (`None` for itself or out of
    /// range).
    pub fn credits_for(&self, peer: u32) -> Option<u32> {
        let s = self.lock();
        let p = s.peers.get(peer as usize)?.as_ref()?;
        Some(p.lanes.first()?.channel.credits().available())
    }

    /// Runs the protocol: takes in completions, registers buffers, posts what can be sent.
    pub fn progress(&self) -> Result<(), TransportError> {
        self.lock().progress()
    }
}

impl<P: Provider> State<P> {
    fn new(
        providers: Vec<P>,
        rank: u32,
        size: u32,
        settings: RcSettings,
    ) -> Result<Self, VerbsError> {
        settings.validate()?;
        if providers.is_empty() || providers.len() > MAX_LANES {
            return Err(VerbsError::InvalidSetting(format!(
                "{} ports (1 to {MAX_LANES})",
                providers.len()
            )));
        }
        let len = settings.buffer_len;
        let mut ports = Vec::with_capacity(providers.len());
        for mut provider in providers {
            let send_region =
                provider.register(Buffer::Owned(vec![0; len * settings.send_buffers as usize]))?;
            ports.push(Port {
                provider,
                send_region,
                free_send: (0..settings.send_buffers).rev().collect(),
                sending: vec![None; settings.send_buffers as usize],
                cache: MrCache::new(settings.mr_cache_bytes),
                writes: FxHashMap::default(),
                next_write: 0,
                reads: FxHashMap::default(),
                next_read: 0,
                by_qp: FxHashMap::default(),
            });
        }
        let port_up = vec![true; ports.len()];
        Ok(State {
            rank,
            settings,
            ports,
            peers: (0..size).map(|_| None).collect(),
            arrivals: VecDeque::new(),
            completions: Vec::new(),
            closed_at: None,
            counters: RcCounters::default(),
            port_up,
            reopen_wanted: Vec::new(),
        })
    }

    fn stream_config(&self) -> StreamConfig {
        StreamConfig {
            stripe_min: self.settings.stripe_min,
        }
    }

    fn address_of(&self, p: &Peer) -> RcAddress {
        let lanes: Vec<QpAddress> = p
            .lanes
            .iter()
            .zip(&self.ports)
            .map(|(l, port)| QpAddress {
                port: port.provider.port(),
                qpn: l.qp,
            })
            .collect();
        RcAddress::new(&lanes).unwrap_or_else(|_| RcAddress::single(lanes[0]))
    }

    /// Creates the queue pairs for `peer` (if it has none yet), registers their receive
    /// buffers and posts them; returns their addresses.
    fn open_peer(&mut self, peer: u32) -> Result<RcAddress, VerbsError> {
        let slot = self
            .peers
            .get(peer as usize)
            .filter(|_| peer != self.rank)
            .ok_or_else(|| VerbsError::InvalidSetting(format!("no peer {peer}")))?;
        if let Some(p) = slot {
            return Ok(self.address_of(p));
        }
        let mut lanes = Vec::with_capacity(self.ports.len());
        for port in &mut self.ports {
            let lane = make_lane(port, peer, &self.settings)?;
            port.by_qp.insert(lane.qp, peer);
            lanes.push(lane);
        }
        let stream = PeerStream::new(lanes.len(), self.stream_config());
        let p = Peer {
            lanes,
            stream,
            connected: false,
            failed: false,
            lost_reported: false,
        };
        let address = self.address_of(&p);
        self.peers[peer as usize] = Some(p);
        Ok(address)
    }

    /// Connects the queue pairs for `peer` to `remote`, lane by lane; a repeat with the same
    /// `remote` does nothing.
    fn connect_peer(&mut self, peer: u32, remote: RcAddress) -> Result<(), VerbsError> {
        let config = self.stream_config();
        let Some(Some(p)) = self.peers.get_mut(peer as usize) else {
            return Err(VerbsError::InvalidSetting(format!(
                "no queue pair for rank {peer}"
            )));
        };
        let used = p.lanes.len().min(remote.lanes().len());
        if p.connected {
            let same = (0..used).all(|i| p.lanes[i].remote == Some(remote.lanes()[i]));
            return if same {
                Ok(())
            } else {
                Err(VerbsError::InvalidSetting(format!(
                    "queue pairs for rank {peer} are connected to other queue pairs than {remote:?}"
                )))
            };
        }
        for (i, r) in remote.lanes().iter().enumerate().take(used) {
            let qp = p.lanes[i].qp;
            self.ports[i].provider.connect(qp, *r, 0)?;
            p.lanes[i].remote = Some(*r);
            if p.lanes[i].state == LaneState::Unconnected {
                p.lanes[i].state = LaneState::Live;
            }
        }
        // Lanes the peer does not have stay unused.
        for l in &mut p.lanes[used..] {
            l.state = LaneState::Absent;
        }
        if used < p.lanes.len() && p.stream.end() == 0 {
            p.stream = PeerStream::new(used, config);
        }
        p.connected = true;
        self.service(peer);
        Ok(())
    }

    fn progress(&mut self) -> Result<(), TransportError> {
        loop {
            let mut total = 0;
            for port in 0..self.ports.len() {
                while let Some(change) = self.ports[port].provider.poll_port_change() {
                    total += 1;
                    self.port_changed(port, change);
                }
                let mut batch = std::mem::take(&mut self.completions);
                batch.clear();
                total += self.ports[port].provider.poll_completions(&mut batch, 64)?;
                for c in &batch {
                    self.on_completion(port, c);
                }
                self.completions = batch;
            }
            for peer in 0..self.peers.len() {
                self.service(peer as u32);
            }
            if total == 0 {
                return Ok(());
            }
        }
    }

    /// The device reported a change of port `port`. Down: every lane on it fails now rather
    /// than when its next work request times out. Up: every failed lane on it is to be
    /// re-established ([`RcTransport::lanes_to_reopen`]); this side's port was the one down,
    /// so this side asks.
    fn port_changed(&mut self, port: usize, change: PortChange) {
        let up = change == PortChange::Up;
        self.port_up[port] = up;
        self.reopen_wanted.retain(|&(_, lane)| lane != port);
        for peer in 0..self.peers.len() as u32 {
            if !up {
                self.lane_failed(peer, port);
            } else if let Some(Some(p)) = self.peers.get(peer as usize)
                && p.connected
                && !p.failed
                && p.lanes
                    .get(port)
                    .is_some_and(|l| matches!(l.state, LaneState::Failed | LaneState::Reopened))
            {
                self.reopen_wanted.push((peer, port));
            }
        }
    }

    /// The failed lanes whose port came back and that are not live again yet, while their
    /// port is up and their peer not lost: `(peer, lane)`.
    fn lanes_to_reopen(&self) -> Vec<(u32, usize)> {
        self.reopen_wanted
            .iter()
            .copied()
            .filter(|&(peer, lane)| {
                self.port_up[lane]
                    && matches!(self.peers.get(peer as usize), Some(Some(p))
                        if !p.failed && p.lanes.get(lane).is_some_and(|l| l.state != LaneState::Live))
            })
            .collect()
    }

    /// Gives lane `lane` of `peer` a new queue pair, not connected (see
    /// [`RcTransport::reopen_lane`]).
    fn reopen_lane(&mut self, peer: u32, lane: usize) -> Result<QpAddress, VerbsError> {
        let no_lane = || VerbsError::InvalidSetting(format!("no lane {lane} to rank {peer}"));
        let Some(Some(p)) = self.peers.get_mut(peer as usize) else {
            return Err(no_lane());
        };
        let Some(l) = p.lanes.get(lane) else {
            return Err(no_lane());
        };
        if !p.connected || p.failed || matches!(l.state, LaneState::Absent | LaneState::Unconnected)
        {
            return Err(no_lane());
        }
        let port_address = self.ports[lane].provider.port();
        if l.state == LaneState::Reopened && l.remote.is_none() {
            return Ok(QpAddress {
                port: port_address,
                qpn: l.qp,
            });
        }
        // Still live (the peer's side failed, this side had not noticed) or reopened and
        // connected to a queue pair the peer has replaced since: it fails first.
        p.fail_lane(peer, lane);
        if p.failed {
            return Err(no_lane());
        }
        let fresh = make_lane(&mut self.ports[lane], peer, &self.settings)?;
        let Some(Some(p)) = self.peers.get_mut(peer as usize) else {
            return Err(no_lane());
        };
        let mut old = std::mem::replace(&mut p.lanes[lane], fresh);
        p.lanes[lane].state = LaneState::Reopened;
        let qp = p.lanes[lane].qp;
        let port = &mut self.ports[lane];
        port.by_qp.insert(qp, peer);
        tear_down_lane(port, peer, &mut old);
        self.counters.lanes_reopened += 1;
        Ok(QpAddress {
            port: port_address,
            qpn: qp,
        })
    }

    /// Connects the reopened lane `lane` of `peer` to the peer's new queue pair `remote`; a
    /// repeat with the same `remote` does nothing.
    fn connect_lane(
        &mut self,
        peer: u32,
        lane: usize,
        remote: QpAddress,
    ) -> Result<(), VerbsError> {
        let Some(Some(p)) = self.peers.get_mut(peer as usize) else {
            return Err(VerbsError::InvalidSetting(format!("no peer {peer}")));
        };
        let Some(l) = p
            .lanes
            .get_mut(lane)
            .filter(|l| l.state == LaneState::Reopened)
        else {
            return Err(VerbsError::InvalidSetting(format!(
                "lane {lane} to rank {peer} has no new queue pair to connect"
            )));
        };
        match l.remote {
            None => {
                self.ports[lane].provider.connect(l.qp, remote, 0)?;
                l.remote = Some(remote);
                Ok(())
            }
            Some(r) if r == remote => Ok(()),
            Some(r) => Err(VerbsError::InvalidSetting(format!(
                "lane {lane} to rank {peer} is connected to {r:?}, not {remote:?}"
            ))),
        }
    }

    /// The reopened, connected lane `lane` of `peer` carries traffic again; returns whether it
    /// was waiting for that.
    fn lane_established(&mut self, peer: u32, lane: usize) -> bool {
        let Some(Some(p)) = self.peers.get_mut(peer as usize) else {
            return false;
        };
        match p.lanes.get_mut(lane) {
            Some(l) if l.state == LaneState::Reopened && l.remote.is_some() && !p.failed => {
                l.state = LaneState::Live;
            }
            _ => return false,
        }
        p.stream.lane_restored(lane);
        tracing::debug!(peer, lane, "verbs: RC lane back");
        self.reopen_wanted.retain(|&(q, l)| (q, l) != (peer, lane));
        self.service(peer);
        true
    }

    /// The lane exchange for the reopened lane `lane` of `peer` failed: the lane fails again
    /// (telling the peer, whose side may be connected already).
    fn abandon_reopened_lane(&mut self, peer: u32, lane: usize) {
        if let Some(Some(p)) = self.peers.get_mut(peer as usize)
            && p.lanes
                .get(lane)
                .is_some_and(|l| l.state == LaneState::Reopened)
        {
            p.fail_lane(peer, lane);
        }
    }

    /// Lane `lane` of `peer` failed: the stream moves its frames to the other lanes; without
    /// one left, the peer has failed.
    fn lane_failed(&mut self, peer: u32, lane: usize) {
        if let Some(Some(p)) = self.peers.get_mut(peer as usize) {
            p.fail_lane(peer, lane);
        }
    }

    fn peer_failed(&mut self, peer: u32) {
        if let Some(Some(p)) = self.peers.get_mut(peer as usize) {
            p.failed = true;
        }
    }

    fn delivered(&mut self, peer: u32, tag: StreamTag) {
        if let Some(Some(p)) = self.peers.get_mut(peer as usize) {
            p.stream.on_delivered(tag);
        }
    }

    fn on_completion(&mut self, port: usize, c: &Completion) {
        let kind = wr::kind(c.wr_id);
        let index = wr::index(c.wr_id);
        if c.status != CompletionStatus::Success {
            self.counters.failed_completions += 1;
            let pt = &mut self.ports[port];
            if kind == wr::SEND {
                if let Some(s) = pt.sending.get_mut(index as usize) {
                    *s = None;
                }
                pt.free_send.push(index);
            }
            if kind == wr::WRITE_LAST
                && let Some((mr, _, _)) = pt.writes.remove(&index)
            {
                pt.cache.release(mr);
            }
            if kind == wr::READ_LAST
                && let Some((peer, transfer)) = pt.reads.remove(&index)
                && let Some(Some(p)) = self.peers.get_mut(peer as usize)
                && let Some(l) = p.lanes.get_mut(port)
                && l.qp == c.qpn
                && let Some(mr) = l.channel.abandon_read(transfer)
            {
                // The lane fails below; the sender sends the frame again on another lane.
                let _ = self.ports[port].provider.deregister(mr);
            }
            if let Some(&peer) = self.ports[port].by_qp.get(&c.qpn) {
                self.lane_failed(peer, port);
            }
            return;
        }
        match kind {
            wr::RECV => {
                let peer = wr::peer(c.wr_id);
                if let Err(e) = self.on_receive(port, peer, index, c) {
                    tracing::warn!(peer, error = %e, "verbs: peer broke the protocol");
                    self.counters.protocol_errors += 1;
                    self.peer_failed(peer);
                }
            }
            wr::SEND => {
                let pt = &mut self.ports[port];
                let done = pt.sending.get_mut(index as usize).and_then(Option::take);
                pt.free_send.push(index);
                if let Some((peer, tag)) = done {
                    self.delivered(peer, tag);
                }
            }
            wr::WRITE_LAST => {
                let pt = &mut self.ports[port];
                let done = pt.writes.remove(&index);
                if let Some((mr, _, _)) = done {
                    pt.cache.release(mr);
                }
                for id in pt.cache.evict() {
                    let _ = pt.provider.deregister(id);
                }
                if let Some((_, peer, tag)) = done {
                    self.delivered(peer, tag);
                }
            }
            wr::READ_LAST => {
                if let Some((peer, transfer)) = self.ports[port].reads.remove(&index)
                    && let Err(e) = self.on_read_done(port, peer, transfer)
                {
                    tracing::warn!(peer, error = %e, "verbs: read rendezvous failed");
                    self.counters.protocol_errors += 1;
                    self.peer_failed(peer);
                }
            }
            _ => {}
        }
    }

    /// A receive completed on lane `lane`: hand what came to the lane's channel, then repost
    /// its buffer (a lane whose queue pair is in error cannot take it back: it has failed).
    fn on_receive(
        &mut self,
        lane: usize,
        peer: u32,
        slot: u32,
        c: &Completion,
    ) -> Result<(), VerbsError> {
        let len = self.settings.buffer_len;
        let Some(Some(p)) = self.peers.get_mut(peer as usize) else {
            return Ok(());
        };
        // A completion of a queue pair the lane has replaced since is stale.
        let Some(l) = p.lanes.get_mut(lane).filter(|l| l.qp == c.qpn) else {
            return Ok(());
        };
        let (qp, region) = (l.qp, l.recv_region.id);
        let provider = &mut self.ports[lane].provider;
        let message = match c.kind {
            CompletionKind::Recv => {
                Some(provider.read_local(region, slot as usize * len, c.byte_len.min(len))?)
            }
            _ => None,
        };
        let channel_error = |e| VerbsError::InvalidRequest(format!("rank {peer}: {e}"));
        match (message, c.imm) {
            (Some(bytes), _) => l
                .channel
                .on_message(Bytes::from(bytes))
                .map_err(channel_error)?,
            (None, Some(transfer)) => {
                let mr = l
                    .channel
                    .on_write_done(transfer, c.byte_len)
                    .map_err(channel_error)?;
                match provider.deregister(mr)? {
                    Buffer::Owned(v) => l.channel.deliver_transfer(transfer, Bytes::from(v)),
                    Buffer::Shared(_) => {
                        return Err(VerbsError::BadAccess(
                            "a transfer buffer came back read-only".into(),
                        ));
                    }
                }
            }
            (None, None) => {
                return Err(VerbsError::InvalidRequest(
                    "a write-with-immediate completion without immediate data".into(),
                ));
            }
        }
        let repost = provider.post_recv(
            qp,
            c.wr_id,
            Sge {
                mr: region,
                offset: slot as usize * len,
                len,
            },
        );
        if let Err(e) = repost {
            tracing::debug!(peer, lane, error = %e, "verbs: receive not reposted");
            self.lane_failed(peer, lane);
        }
        Ok(())
    }

    /// The RDMA read of read rendezvous `transfer` from `peer` on lane `lane` completed: the
    /// payload is in place; hand it over without a copy (the channel queues the Fin).
    fn on_read_done(&mut self, lane: usize, peer: u32, transfer: u32) -> Result<(), VerbsError> {
        let Some(Some(p)) = self.peers.get_mut(peer as usize) else {
            return Ok(());
        };
        let Some(l) = p.lanes.get_mut(lane) else {
            return Ok(());
        };
        let mr = l
            .channel
            .on_read_done(transfer)
            .map_err(|e| VerbsError::InvalidRequest(format!("rank {peer}: {e}")))?;
        match self.ports[lane].provider.deregister(mr)? {
            Buffer::Owned(v) => l.channel.deliver_transfer(transfer, Bytes::from(v)),
            Buffer::Shared(_) => {
                return Err(VerbsError::BadAccess(
                    "a transfer buffer came back read-only".into(),
                ));
            }
        }
        Ok(())
    }

    /// Read rendezvous sends of `p` that the peer finished (Fin) are delivered and their
    /// payloads released; on failed lanes, the payloads of read rendezvous sends are released
    /// (the stream sends them again) and the receive buffers of unfinished write rendezvous
    /// transfers deregistered (the peer sends those again).
    fn finish_transfers(&mut self, p: &mut Peer) {
        for (lane, l) in p.lanes.iter_mut().enumerate() {
            let port = &mut self.ports[lane];
            while let Some((tag, mr)) = l.channel.poll_read_finished() {
                port.cache.release(mr);
                p.stream.on_delivered(tag);
            }
            if l.state == LaneState::Failed {
                for mr in l.channel.take_read_sources() {
                    port.cache.release(mr);
                }
                for mr in l.channel.take_incoming_writes() {
                    if let Err(e) = port.provider.deregister(mr) {
                        tracing::debug!(lane, error = %e, "verbs: transfer buffer not deregistered");
                    }
                }
            }
            for id in port.cache.evict() {
                let _ = port.provider.deregister(id);
            }
        }
    }

    /// Hands the peer's queued frames to its lanes, registers buffers for its incoming
    /// transfers, posts what its channels have to send, and moves its frames (in stream
    /// order) and its loss to the arrivals.
    fn service(&mut self, peer: u32) {
        let Some(mut p) = self.peers.get_mut(peer as usize).and_then(Option::take) else {
            return;
        };
        self.finish_transfers(&mut p);
        while !p.failed && p.connected {
            while let Some((lane, tag, frame)) = p.stream.poll_transmit() {
                p.lanes[lane].channel.send(tag, frame);
            }
            let mut broken = None;
            for lane in 0..p.lanes.len() {
                if p.usable(lane)
                    && let Err(e) = self.post_for(lane, peer, &mut p.lanes[lane])
                {
                    tracing::warn!(peer, lane, error = %e, "verbs: RC lane failed");
                    broken = Some(lane);
                    break;
                }
            }
            let Some(lane) = broken else { break };
            p.fail_lane(peer, lane);
        }
        let mut protocol_error = false;
        let mut down = Vec::new();
        for l in &mut p.lanes {
            while let Some((tag, frame)) = l.channel.poll_frame() {
                if let Err(e) = p.stream.on_part(tag, frame) {
                    tracing::warn!(peer, error = %e, "verbs: peer broke the protocol");
                    protocol_error = true;
                }
            }
            while let Some(report) = l.channel.poll_lane_down() {
                down.push(report);
            }
        }
        // A report about a queue pair the lane is no longer connected to is stale: the lane
        // was re-established since.
        let down: Vec<usize> = down
            .into_iter()
            .filter_map(|(lane, qpn)| {
                let lane = usize::try_from(lane).ok()?;
                let l = p.lanes.get(lane)?;
                (l.remote.map(|r| r.qpn.0) == Some(qpn)).then_some(lane)
            })
            .collect();
        if !down.is_empty() {
            for lane in down {
                p.fail_lane(peer, lane);
            }
            // Its frames go out on the other lanes now.
            self.peers[peer as usize] = Some(p);
            return self.service(peer);
        }
        if protocol_error {
            self.counters.protocol_errors += 1;
            p.failed = true;
        }
        while let Some(frame) = p.stream.poll_frame() {
            self.arrivals
                .push_back(Arrival::Frame { from: peer, frame });
        }
        let finished = p
            .lanes
            .iter()
            .filter_map(|l| l.channel.peer_end())
            .any(|end| p.stream.delivered_below(end));
        if (p.failed || finished) && !p.lost_reported {
            p.lost_reported = true;
            self.counters.peers_lost += 1;
            self.arrivals.push_back(Arrival::PeerLost { rank: peer });
        }
        self.peers[peer as usize] = Some(p);
    }

    fn post_for(&mut self, lane: usize, peer: u32, l: &mut Lane) -> Result<(), VerbsError> {
        let max_write = self.settings.max_write;
        let len = self.settings.buffer_len;
        let port = &mut self.ports[lane];
        while let Some((transfer, payload)) = l.channel.poll_source() {
            let provider = &mut port.provider;
            let region = port
                .cache
                .acquire(&payload, |b| provider.register(Buffer::Shared(b)))?;
            l.channel.source_ready(transfer, &region);
        }
        while let Some((transfer, size)) = l.channel.poll_allocation() {
            let size = usize::try_from(size)
                .map_err(|_| VerbsError::InvalidRequest(format!("transfer of {size} bytes")))?;
            let region = port.provider.register(Buffer::Owned(vec![0; size]))?;
            l.channel.buffer_ready(transfer, &region);
        }
        while let Some(t) = l.channel.poll_transmit(!port.free_send.is_empty()) {
            match t {
                Transmit::Message { bytes, delivers } => {
                    let Some(slot) = port.free_send.pop() else {
                        return Err(VerbsError::InvalidRequest("no send buffer".into()));
                    };
                    let offset = slot as usize * len;
                    port.provider
                        .write_local(port.send_region.id, offset, &bytes)?;
                    port.sending[slot as usize] = delivers.map(|tag| (peer, tag));
                    port.provider.post_send(
                        l.qp,
                        SendRequest {
                            wr_id: wr::id(wr::SEND, peer, slot),
                            op: SendOp::Send { imm: None },
                            local: Some(Sge {
                                mr: port.send_region.id,
                                offset,
                                len: bytes.len(),
                            }),
                        },
                    )?;
                }
                Transmit::Write {
                    tag,
                    transfer,
                    payload,
                    remote,
                } => {
                    let provider = &mut port.provider;
                    let region = port
                        .cache
                        .acquire(&payload, |b| provider.register(Buffer::Shared(b)))?;
                    let id = port.next_write;
                    port.next_write = port.next_write.wrapping_add(1);
                    port.writes.insert(id, (region.id, peer, tag));
                    let total = payload.len();
                    let mut offset = 0;
                    loop {
                        let piece = (total - offset).min(max_write);
                        let last = offset + piece == total;
                        port.provider.post_send(
                            l.qp,
                            SendRequest {
                                wr_id: wr::id(
                                    if last {
                                        wr::WRITE_LAST
                                    } else {
                                        wr::WRITE_PIECE
                                    },
                                    peer,
                                    id,
                                ),
                                op: SendOp::Write {
                                    remote: RemoteSlice {
                                        addr: remote.addr + offset as u64,
                                        rkey: remote.rkey,
                                    },
                                    imm: last.then_some(transfer),
                                },
                                local: Some(Sge {
                                    mr: region.id,
                                    offset,
                                    len: piece,
                                }),
                            },
                        )?;
                        offset += piece;
                        if last {
                            break;
                        }
                    }
                }
                Transmit::Read {
                    transfer,
                    region,
                    len,
                    remote,
                } => {
                    let total = usize::try_from(len).map_err(|_| {
                        VerbsError::InvalidRequest(format!("transfer of {len} bytes"))
                    })?;
                    let id = port.next_read;
                    port.next_read = port.next_read.wrapping_add(1);
                    port.reads.insert(id, (peer, transfer));
                    let mut offset = 0;
                    loop {
                        let piece = (total - offset).min(max_write);
                        let last = offset + piece == total;
                        let kind = if last { wr::READ_LAST } else { wr::READ_PIECE };
                        port.provider.post_send(
                            l.qp,
                            SendRequest {
                                wr_id: wr::id(kind, peer, id),
                                op: SendOp::Read {
                                    remote: RemoteSlice {
                                        addr: remote.addr + offset as u64,
                                        rkey: remote.rkey,
                                    },
                                },
                                local: Some(Sge {
                                    mr: region,
                                    offset,
                                    len: piece,
                                }),
                            },
                        )?;
                        offset += piece;
                        if last {
                            break;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn is_drained(&self) -> bool {
        let idle = self.peers.iter().flatten().all(|p| {
            p.failed
                || !p.connected
                || (p.stream.is_idle()
                    && p.lanes
                        .iter()
                        .all(|l| l.state != LaneState::Live || l.channel.is_idle()))
        });
        let sends_done = self
            .ports
            .iter()
            .all(|p| p.free_send.len() == self.settings.send_buffers as usize);
        let writes_done = self
            .ports
            .iter()
            .all(|p| p.writes.is_empty() && p.reads.is_empty());
        let expired = self
            .closed_at
            .is_some_and(|t| t.elapsed() >= self.settings.linger);
        (idle && sends_done && writes_done) || expired
    }
}

impl<P: Provider> Transport for RcTransport<P> {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            reliable: true,
            ordered: true,
            max_payload: usize::MAX,
            multicast: false,
            rdma: true,
            by_reference: false,
        }
    }

    fn send(&self, to: u32, frame: Frame) -> Result<(), TransportError> {
        if to >= self.size {
            return Err(TransportError::PeerUnreachable(to as usize));
        }
        let mut s = self.lock();
        if s.closed_at.is_some() {
            return Err(TransportError::Closed);
        }
        if to == self.rank {
            s.arrivals.push_back(Arrival::Frame { from: to, frame });
            return Ok(());
        }
        if let Some(Some(p)) = s.peers.get_mut(to as usize) {
            // A frame to a failed peer is dropped: its `PeerLost` tells the message layer.
            if !p.failed {
                p.stream.send(frame);
            }
        }
        s.service(to);
        Ok(())
    }

    fn drain(&self, out: &mut Vec<Arrival>) -> Result<usize, TransportError> {
        let mut s = self.lock();
        s.progress()?;
        let n = s.arrivals.len();
        out.extend(s.arrivals.drain(..));
        Ok(n)
    }

    fn poll_arrival(&self, cx: &mut Context<'_>) -> Poll<()> {
        let s = self.lock();
        if !s.arrivals.is_empty() {
            return Poll::Ready(());
        }
        // Every port registers the waker.
        let mut ready = false;
        for port in &s.ports {
            ready |= port.provider.poll_ready(cx).is_ready();
        }
        if ready {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    fn close(&self) {
        let mut s = self.lock();
        if s.closed_at.is_some() {
            return;
        }
        s.closed_at = Some(Instant::now());
        for p in s.peers.iter_mut().flatten() {
            let end = p.stream.end();
            for l in &mut p.lanes {
                l.channel.close(end);
            }
        }
        let _ = s.progress();
    }

    fn is_drained(&self) -> bool {
        let mut s = self.lock();
        let _ = s.progress();
        s.is_drained()
    }

    fn stats(&self) -> TransportStats {
        let mut stats = TransportStats::default();
        stats.peers_lost = self.lock().counters.peers_lost;
        stats
    }
}

/// Connects `providers.len()` ranks of one process (rank `i` on the one port
/// `providers[i]`): every rank prepares its queue pairs, then each connects to the others'
/// (the out-of-band exchange a multi-process job does through its key-value store).
pub fn connect_job<P: Provider>(
    providers: Vec<P>,
    settings: RcSettings,
) -> Result<Vec<RcTransport<P>>, VerbsError> {
    connect_job_ports(providers.into_iter().map(|p| vec![p]).collect(), settings)
}

/// [`connect_job`] with several ports per rank (`ports[i]` are rank `i`'s, lane order).
pub fn connect_job_ports<P: Provider>(
    ports: Vec<Vec<P>>,
    settings: RcSettings,
) -> Result<Vec<RcTransport<P>>, VerbsError> {
    let size = u32::try_from(ports.len())
        .map_err(|_| VerbsError::InvalidSetting(format!("{} ranks", ports.len())))?;
    let prepared = ports
        .into_iter()
        .zip(0..)
        .map(|(p, rank)| PreparedRc::new(p, rank, size, settings))
        .collect::<Result<Vec<_>, _>>()?;
    let addresses: Vec<Vec<Option<RcAddress>>> = (0..size)
        .map(|me| prepared.iter().map(|p| p.address_for(me)).collect())
        .collect();
    prepared
        .into_iter()
        .zip(addresses)
        .map(|(p, remotes)| p.connect(&remotes))
        .collect()
}
