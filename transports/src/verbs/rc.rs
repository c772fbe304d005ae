//! [`RcTransport`]: the thin driver that runs one [`RcChannel`] per peer over a [`Provider`]
//! and implements [`Transport`].
//!
//! Each rank has one RC queue pair per peer, with [`RcSettings::window`] receive buffers of
//! [`RcSettings::buffer_len`] bytes posted for it (one registered region per peer), and one
//! registered region of send buffers shared by all peers. The driver posts what the channels
//! produce, turns completions back into channel events, registers the buffers of incoming
//! rendezvous transfers (and deregisters them to hand their bytes to the message layer without
//! a copy), and registers outgoing payloads through the [`MrCache`].
//!
//! A queue pair that fails (its peer's port is down, retries ran out) makes the peer lost: its
//! frames already complete are delivered, then [`Arrival::PeerLost`]. A peer that closes says
//! BYE, and is reported lost after everything it sent has been delivered.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rankweave_core::frame::Frame;
use rankweave_core::{Arrival, Capabilities, Transport, TransportError, TransportStats};
use rustc_hash::FxHashMap;

use super::channel::{ChannelConfig, ChannelCounters, RcChannel, Transmit};
use super::error::VerbsError;
use super::mr_cache::{MrCache, MrCacheCounters};
use super::provider::{
    Buffer, Completion, CompletionKind, CompletionStatus, MemoryRegion, MrId, Provider, QpAddress,
    QpCaps, QpKind, QpNum, SendOp, SendRequest, Sge,
};

/// Settings of the RC transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RcSettings {
    /// Receive buffers posted per peer (the credit window); at least 4.
    pub window: u32,
    /// Bytes of each receive and send buffer: frames whose message fits go eagerly, larger
    /// ones by rendezvous. At least 256.
    pub buffer_len: usize,
    /// Send buffers shared by all peers; at least 1.
    pub send_buffers: u32,
    /// The largest rendezvous payload accepted from a peer.
    pub max_transfer: u64,
    /// Bytes of idle registrations the memory-registration cache keeps.
    pub mr_cache_bytes: usize,
    /// The largest single RDMA write (larger payloads are written in pieces).
    pub max_write: usize,
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
            linger: Duration::from_secs(5),
        }
    }
}

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

/// Counters of an [`RcTransport`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RcCounters {
    /// The channels' counters, summed over peers.
    pub channels: ChannelCounters,
    /// The memory-registration cache's counters.
    pub mr_cache: MrCacheCounters,
    /// Messages from peers that broke the protocol (the peer is then treated as lost).
    pub protocol_errors: u64,
    /// Work requests that completed with an error.
    pub failed_completions: u64,
    /// Peers reported lost.
    pub peers_lost: u64,
}

/// Kinds of work request, in the top byte of `wr_id`.
mod wr {
    pub(super) const RECV: u64 = 1;
    pub(super) const SEND: u64 = 2;
    pub(super) const WRITE_LAST: u64 = 3;
    pub(super) const WRITE_PIECE: u64 = 4;

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

struct Peer {
    qp: QpNum,
    /// The peer's queue pair this one is connected to (`None`: not yet, nothing is posted).
    remote: Option<QpAddress>,
    channel: RcChannel,
    recv_region: MemoryRegion,
    failed: bool,
    lost_reported: bool,
}

/// A rank's queue pairs and buffers before they are connected: made first on every rank so
/// that each can tell the others its queue pair numbers.
pub struct PreparedRc<P: Provider> {
    state: State<P>,
}

impl<P: Provider> PreparedRc<P> {
    /// Creates one RC queue pair per peer of rank `rank` in a `size`-rank job on `provider`,
    /// registers the buffers and posts the receives.
    pub fn new(
        provider: P,
        rank: u32,
        size: u32,
        settings: RcSettings,
    ) -> Result<PreparedRc<P>, VerbsError> {
        let mut state = State::new(provider, rank, size, settings)?;
        for peer in 0..size {
            if peer != rank {
                state.open_peer(peer)?;
            }
        }
        Ok(PreparedRc { state })
    }

    /// The address of this rank's queue pair for `peer` (`None` for itself or out of range).
    pub fn address_for(&self, peer: u32) -> Option<QpAddress> {
        let p = self.state.peers.get(peer as usize)?.as_ref()?;
        Some(QpAddress {
            port: self.state.provider.port(),
            qpn: p.qp,
        })
    }

    /// Connects every queue pair: `remotes[peer]` is `peer`'s queue pair for this rank.
    pub fn connect(mut self, remotes: &[Option<QpAddress>]) -> Result<RcTransport<P>, VerbsError> {
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
    provider: P,
    peers: Vec<Option<Peer>>,
    by_qp: FxHashMap<QpNum, u32>,
    send_region: MemoryRegion,
    free_send: Vec<u32>,
    cache: MrCache,
    /// Outstanding final RDMA writes: their cached source region.
    writes: FxHashMap<u32, MrId>,
    next_write: u32,
    arrivals: VecDeque<Arrival>,
    completions: Vec<Completion>,
    closed_at: Option<Instant>,
    counters: RcCounters,
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
            let pc = p.channel.counters();
            c.channels.eager_sent += pc.eager_sent;
            c.channels.rendezvous_sent += pc.rendezvous_sent;
            c.channels.rdma_bytes_sent += pc.rdma_bytes_sent;
            c.channels.credit_updates_sent += pc.credit_updates_sent;
            c.channels.credit_stalls += pc.credit_stalls;
            c.channels.frames_delivered += pc.frames_delivered;
        }
        c.mr_cache = s.cache.counters();
        c
    }

    /// A transport of rank `rank` in a `size`-rank job with no connection yet: queue pairs are
    /// made by [`open_peer`](Self::open_peer) and connected by
    /// [`connect_peer`](Self::connect_peer) when the connection manager says so. Frames to a
    /// peer that is not connected are dropped (the caller sends only to connected peers).
    pub fn on_demand(
        provider: P,
        rank: u32,
        size: u32,
        settings: RcSettings,
    ) -> Result<RcTransport<P>, VerbsError> {
        Ok(RcTransport {
            rank,
            size,
            state: Mutex::new(State::new(provider, rank, size, settings)?),
        })
    }

    /// Creates the queue pair for `peer` with its receive buffers posted, if it has none yet;
    /// returns its address (what the peer connects to).
    pub fn open_peer(&self, peer: u32) -> Result<QpAddress, VerbsError> {
        self.lock().open_peer(peer)
    }

    /// Connects the queue pair for `peer` (made by [`open_peer`](Self::open_peer)) to the
    /// peer's `remote`; a repeat with the same `remote` does nothing, another `remote` is an
    /// error.
    pub fn connect_peer(&self, peer: u32, remote: QpAddress) -> Result<(), VerbsError> {
        self.lock().connect_peer(peer, remote)
    }

    /// Whether the queue pair for `peer` is connected and has not failed.
    pub fn is_connected(&self, peer: u32) -> bool {
        let s = self.lock();
        matches!(s.peers.get(peer as usize), Some(Some(p)) if p.remote.is_some() && !p.failed)
    }

    /// Credits this rank holds for `peer` now (`None` for itself or out of range).
    pub fn credits_for(&self, peer: u32) -> Option<u32> {
        let s = self.lock();
        let p = s.peers.get(peer as usize)?.as_ref()?;
        Some(p.channel.credits().available())
    }

    /// Runs the protocol: takes in completions, registers buffers, posts what can be sent.
    pub fn progress(&self) -> Result<(), TransportError> {
        self.lock().progress()
    }
}

impl<P: Provider> State<P> {
    fn new(
        mut provider: P,
        rank: u32,
        size: u32,
        settings: RcSettings,
    ) -> Result<Self, VerbsError> {
        settings.validate()?;
        let len = settings.buffer_len;
        let send_region =
            provider.register(Buffer::Owned(vec![0; len * settings.send_buffers as usize]))?;
        Ok(State {
            rank,
            settings,
            cache: MrCache::new(settings.mr_cache_bytes),
            free_send: (0..settings.send_buffers).rev().collect(),
            send_region,
            provider,
            peers: (0..size).map(|_| None).collect(),
            by_qp: FxHashMap::default(),
            writes: FxHashMap::default(),
            next_write: 0,
            arrivals: VecDeque::new(),
            completions: Vec::new(),
            closed_at: None,
            counters: RcCounters::default(),
        })
    }

    /// Creates the queue pair for `peer` (if it has none yet), registers its receive buffers
    /// and posts them; returns the queue pair's address.
    fn open_peer(&mut self, peer: u32) -> Result<QpAddress, VerbsError> {
        let port = self.provider.port();
        let slot = self
            .peers
            .get(peer as usize)
            .filter(|_| peer != self.rank)
            .ok_or_else(|| VerbsError::InvalidSetting(format!("no peer {peer}")))?;
        if let Some(p) = slot {
            return Ok(QpAddress { port, qpn: p.qp });
        }
        let settings = self.settings;
        let len = settings.buffer_len;
        let caps = QpCaps {
            max_send_wr: settings.window * 2 + 16,
            max_recv_wr: settings.window,
            rnr_retry: 7,
        };
        let qp = self.provider.create_qp(QpKind::Rc, caps)?;
        let recv_region =
            self.provider
                .register(Buffer::Owned(vec![0; len * settings.window as usize]))?;
        for slot in 0..settings.window {
            self.provider.post_recv(
                qp,
                wr::id(wr::RECV, peer, slot),
                Sge {
                    mr: recv_region.id,
                    offset: slot as usize * len,
                    len,
                },
            )?;
        }
        self.by_qp.insert(qp, peer);
        self.peers[peer as usize] = Some(Peer {
            qp,
            remote: None,
            channel: RcChannel::new(ChannelConfig {
                window: settings.window,
                buffer_len: len,
                max_transfer: settings.max_transfer,
            }),
            recv_region,
            failed: false,
            lost_reported: false,
        });
        Ok(QpAddress { port, qpn: qp })
    }

    /// Connects the queue pair for `peer` to `remote`; a repeat with the same `remote` does
    /// nothing.
    fn connect_peer(&mut self, peer: u32, remote: QpAddress) -> Result<(), VerbsError> {
        let Some(Some(p)) = self.peers.get_mut(peer as usize) else {
            return Err(VerbsError::InvalidSetting(format!(
                "no queue pair for rank {peer}"
            )));
        };
        match p.remote {
            Some(r) if r == remote => Ok(()),
            Some(r) => Err(VerbsError::InvalidSetting(format!(
                "queue pair for rank {peer} is connected to {r:?}, not {remote:?}"
            ))),
            None => {
                let qp = p.qp;
                self.provider.connect(qp, remote, 0)?;
                if let Some(Some(p)) = self.peers.get_mut(peer as usize) {
                    p.remote = Some(remote);
                }
                self.service(peer);
                Ok(())
            }
        }
    }

    fn progress(&mut self) -> Result<(), TransportError> {
        loop {
            let mut batch = std::mem::take(&mut self.completions);
            batch.clear();
            let n = self.provider.poll_completions(&mut batch, 64)?;
            for c in &batch {
                self.on_completion(c);
            }
            self.completions = batch;
            for peer in 0..self.peers.len() {
                self.service(peer as u32);
            }
            if n == 0 {
                return Ok(());
            }
        }
    }

    fn peer_failed(&mut self, peer: u32) {
        if let Some(Some(p)) = self.peers.get_mut(peer as usize) {
            p.failed = true;
        }
    }

    fn on_completion(&mut self, c: &Completion) {
        let kind = wr::kind(c.wr_id);
        if c.status != CompletionStatus::Success {
            self.counters.failed_completions += 1;
            if kind == wr::SEND {
                self.free_send.push(wr::index(c.wr_id));
            }
            if kind == wr::WRITE_LAST
                && let Some(mr) = self.writes.remove(&wr::index(c.wr_id))
            {
                self.cache.release(mr);
            }
            if let Some(&peer) = self.by_qp.get(&c.qpn) {
                self.peer_failed(peer);
            }
            return;
        }
        match kind {
            wr::RECV => {
                let peer = wr::peer(c.wr_id);
                if let Err(e) = self.on_receive(peer, wr::index(c.wr_id), c) {
                    tracing::warn!(peer, error = %e, "verbs: peer broke the protocol");
                    self.counters.protocol_errors += 1;
                    self.peer_failed(peer);
                }
            }
            wr::SEND => self.free_send.push(wr::index(c.wr_id)),
            wr::WRITE_LAST => {
                if let Some(mr) = self.writes.remove(&wr::index(c.wr_id)) {
                    self.cache.release(mr);
                }
                for id in self.cache.evict() {
                    let _ = self.provider.deregister(id);
                }
            }
            _ => {}
        }
    }

    /// A receive completed: repost its buffer, then hand what came to the channel.
    fn on_receive(&mut self, peer: u32, slot: u32, c: &Completion) -> Result<(), VerbsError> {
        let len = self.settings.buffer_len;
        let Some(Some(p)) = self.peers.get_mut(peer as usize) else {
            return Ok(());
        };
        let (qp, region) = (p.qp, p.recv_region.id);
        let message = match c.kind {
            CompletionKind::Recv => Some(self.provider.read_local(
                region,
                slot as usize * len,
                c.byte_len.min(len),
            )?),
            _ => None,
        };
        self.provider.post_recv(
            qp,
            c.wr_id,
            Sge {
                mr: region,
                offset: slot as usize * len,
                len,
            },
        )?;
        let Some(Some(p)) = self.peers.get_mut(peer as usize) else {
            return Ok(());
        };
        let channel_error = |e| VerbsError::InvalidRequest(format!("rank {peer}: {e}"));
        match (message, c.imm) {
            (Some(bytes), _) => p
                .channel
                .on_message(Bytes::from(bytes))
                .map_err(channel_error)?,
            (None, Some(transfer)) => {
                let mr = p
                    .channel
                    .on_write_done(transfer, c.byte_len)
                    .map_err(channel_error)?;
                match self.provider.deregister(mr)? {
                    Buffer::Owned(v) => {
                        if let Some(Some(p)) = self.peers.get_mut(peer as usize) {
                            p.channel.deliver_transfer(transfer, Bytes::from(v));
                        }
                    }
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
        Ok(())
    }

    /// Registers buffers for a peer's incoming transfers, posts what its channel has to send,
    /// and moves its complete frames (and its loss) to the arrivals.
    fn service(&mut self, peer: u32) {
        let Some(mut p) = self.peers.get_mut(peer as usize).and_then(Option::take) else {
            return;
        };
        if !p.failed
            && p.remote.is_some()
            && let Err(e) = self.post_for(peer, &mut p)
        {
            tracing::warn!(peer, error = %e, "verbs: connection failed");
            p.failed = true;
        }
        while let Some(frame) = p.channel.poll_frame() {
            self.arrivals
                .push_back(Arrival::Frame { from: peer, frame });
        }
        if (p.failed || p.channel.peer_finished()) && !p.lost_reported {
            p.lost_reported = true;
            self.counters.peers_lost += 1;
            self.arrivals.push_back(Arrival::PeerLost { rank: peer });
        }
        self.peers[peer as usize] = Some(p);
    }

    fn post_for(&mut self, peer: u32, p: &mut Peer) -> Result<(), VerbsError> {
        while let Some((transfer, len)) = p.channel.poll_allocation() {
            let len = usize::try_from(len)
                .map_err(|_| VerbsError::InvalidRequest(format!("transfer of {len} bytes")))?;
            let region = self.provider.register(Buffer::Owned(vec![0; len]))?;
            p.channel.buffer_ready(transfer, &region);
        }
        let len = self.settings.buffer_len;
        while let Some(t) = p.channel.poll_transmit(!self.free_send.is_empty()) {
            match t {
                Transmit::Message(bytes) => {
                    let Some(slot) = self.free_send.pop() else {
                        return Err(VerbsError::InvalidRequest("no send buffer".into()));
                    };
                    let offset = slot as usize * len;
                    self.provider
                        .write_local(self.send_region.id, offset, &bytes)?;
                    self.provider.post_send(
                        p.qp,
                        SendRequest {
                            wr_id: wr::id(wr::SEND, peer, slot),
                            op: SendOp::Send { imm: None },
                            local: Some(Sge {
                                mr: self.send_region.id,
                                offset,
                                len: bytes.len(),
                            }),
                        },
                    )?;
                }
                Transmit::Write {
                    transfer,
                    payload,
                    remote,
                } => {
                    let provider = &mut self.provider;
                    let region = self
                        .cache
                        .acquire(&payload, |b| provider.register(Buffer::Shared(b)))?;
                    let id = self.next_write;
                    self.next_write = self.next_write.wrapping_add(1);
                    self.writes.insert(id, region.id);
                    let total = payload.len();
                    let mut offset = 0;
                    while offset < total {
                        let piece = (total - offset).min(self.settings.max_write);
                        let last = offset + piece == total;
                        self.provider.post_send(
                            p.qp,
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
                                    remote: super::provider::RemoteSlice {
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
                    }
                }
            }
        }
        Ok(())
    }

    fn is_drained(&self) -> bool {
        let idle = self
            .peers
            .iter()
            .flatten()
            .all(|p| p.failed || p.remote.is_none() || p.channel.is_idle());
        let sends_done = self.free_send.len() == self.settings.send_buffers as usize;
        let expired = self
            .closed_at
            .is_some_and(|t| t.elapsed() >= self.settings.linger);
        (idle && sends_done && self.writes.is_empty()) || expired
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
                p.channel.send(frame);
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
        s.provider.poll_ready(cx)
    }

    fn close(&self) {
        let mut s = self.lock();
        if s.closed_at.is_some() {
            return;
        }
        s.closed_at = Some(Instant::now());
        for p in s.peers.iter_mut().flatten() {
            p.channel.close();
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

/// Connects `providers.len()` ranks of one process (rank `i` on `providers[i]`): every rank
/// prepares its queue pairs, then each connects to the others' (the out-of-band exchange a
/// multi-process job does through its key-value store).
pub fn connect_job<P: Provider>(
    providers: Vec<P>,
    settings: RcSettings,
) -> Result<Vec<RcTransport<P>>, VerbsError> {
    let size = u32::try_from(providers.len())
        .map_err(|_| VerbsError::InvalidSetting(format!("{} ranks", providers.len())))?;
    let prepared = providers
        .into_iter()
        .zip(0..)
        .map(|(p, rank)| PreparedRc::new(p, rank, size, settings))
        .collect::<Result<Vec<_>, _>>()?;
    let addresses: Vec<Vec<Option<QpAddress>>> = (0..size)
        .map(|me| prepared.iter().map(|p| p.address_for(me)).collect())
        .collect();
    prepared
        .into_iter()
        .zip(addresses)
        .map(|(p, remotes)| p.connect(&remotes))
        .collect()
}
