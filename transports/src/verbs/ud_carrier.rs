//! [`UdCarrier`]: a [`Carrier`] over UD queue pairs, one per port (route), beneath the
//! reliability layer; and the side channel the connection manager's messages use.
//!
//! Each route is one port with one UD queue pair, [`UdSettings::recv_buffers`] receive buffers
//! of one MTU (plus the 40-byte GRH area) posted on it and [`UdSettings::send_buffers`] send
//! buffers. Route `r` of a rank talks to route `r` of every peer, as the UDP carrier's routes
//! do. A datagram is one byte of kind (a link packet, or a connection-management message) and
//! the bytes (a connection-management message also carries its sender's rank); the sender is
//! known by its port and queue pair number, looked up in the job's address table.
//!
//! The table is filled at once for the ranks of one process ([`UdCarrier::set_peers`]), or on
//! demand in a multi-process job ([`UdCarrier::with_directory`]): the first send to a rank, or
//! the first datagram from an unknown queue pair that claims to come from a rank of this job
//! (a link packet with the job's key, or a connection message), looks that rank's
//! [`UdEndpoints`] up once in a [`UdDirectory`]; the datagram is attributed to the rank only
//! if it comes from a queue pair the rank published. Datagrams from elsewhere are passed up
//! with no sender and dropped as foreign by the link layer (connection messages are dropped
//! here).
//!
//! Like every carrier it promises nothing: a datagram that finds no receive posted, goes to or
//! from a port that is down, or finds no free send buffer is lost, and the reliability layer
//! above repairs it (and, with several routes, moves traffic off a route that stays silent).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

use bytes::Bytes;
use rankweave_core::{Carrier, Datagram, TransportError};
use rustc_hash::FxHashMap;

use super::error::VerbsError;
use super::provider::{
    AhId, Completion, CompletionKind, CompletionStatus, MemoryRegion, Provider, QpAddress, QpNum,
    SendOp, SendRequest, Sge,
};
use super::sim::GRH_LEN;
use super::ud_directory::{UdDirectory, UdEndpoints};
use super::ud_queue::{UdQueue, recv_slot};
use crate::link::FailedLookups;

/// Settings of a [`UdCarrier`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UdSettings {
    /// Receive buffers posted per route (at least 1).
    pub recv_buffers: u32,
    /// Send buffers per route (at least 1).
    pub send_buffers: u32,
    /// The queue key of the job's UD queue pairs (datagrams with another are dropped).
    pub qkey: u32,
}

impl Default for UdSettings {
    fn default() -> Self {
        UdSettings {
            recv_buffers: 256,
            send_buffers: 64,
            qkey: 0x5257_0001,
        }
    }
}

/// The kind byte in front of every datagram.
const KIND_LINK: u8 = b'L';
const KIND_CONTROL: u8 = b'C';

/// `wr_id` top bit: a send (else a receive); the rest is the buffer index.
const WR_SEND: u64 = 1 << 63;

/// Counters of a [`UdCarrier`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UdCounters {
    /// Datagrams posted.
    pub sent: u64,
    /// Datagrams received.
    pub received: u64,
    /// Sends refused (no free send buffer, the port down, or a posting error).
    pub send_failures: u64,
    /// Receive or send completions with an error.
    pub failed_completions: u64,
    /// Received datagrams with an unknown kind byte, or empty.
    pub malformed: u64,
    /// Peers looked up in the job's directory ([`UdCarrier::with_directory`]).
    pub lookups: u64,
}

/// How a route reaches one peer.
#[derive(Clone, Copy, Debug)]
struct PeerRoute {
    /// The peer's UD queue pair on this route.
    address: QpAddress,
    /// The address handle to reach it.
    ah: AhId,
    /// The queue key it accepts.
    qkey: u32,
}

/// A datagram as received: its route, kind, source queue pair and, if that is in the
/// address table, its rank.
struct Received {
    route: usize,
    kind: u8,
    source: Option<QpAddress>,
    from: Option<u32>,
    /// Without the kind byte.
    bytes: Bytes,
}

/// On-demand peer discovery (see [`UdCarrier::with_directory`]).
struct Discovery {
    directory: Arc<dyn UdDirectory>,
    job_key: u64,
    failed: FailedLookups,
}

struct Route<P> {
    provider: P,
    qp: QpNum,
    address: QpAddress,
    recv_region: MemoryRegion,
    send_region: MemoryRegion,
    free_send: Vec<u32>,
    /// Per peer: how to reach it on this route.
    peers: Vec<Option<PeerRoute>>,
    slot_len: usize,
    mtu: usize,
}

struct State<P> {
    routes: Vec<Route<P>>,
    /// (LID, queue pair number) → rank, over all routes.
    ranks: FxHashMap<(u16, u32), u32>,
    /// Per peer: whether its endpoints are in the table.
    known: Vec<bool>,
    /// Datagrams from unknown queue pairs, for `recv` to identify.
    strangers: Vec<Received>,
    control: VecDeque<(u32, Bytes)>,
    /// Link datagrams received while reclaiming send buffers, for the next `recv`.
    pending: Vec<Datagram>,
    completions: Vec<Completion>,
    counters: UdCounters,
}

/// UD datagrams over one or more ports for one rank (see the [module docs](self)).
pub struct UdCarrier<P: Provider> {
    rank: u32,
    size: u32,
    qkey: u32,
    max_datagram: usize,
    closed: AtomicBool,
    discovery: Option<Discovery>,
    state: Mutex<State<P>>,
}

impl<P: Provider> std::fmt::Debug for UdCarrier<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UdCarrier")
            .field("rank", &self.rank)
            .field("routes", &self.addresses())
            .finish_non_exhaustive()
    }
}

impl<P: Provider> UdCarrier<P> {
    /// Opens one UD queue pair on each of `providers` (route `r` on `providers[r]`) for rank
    /// `rank` of a `size`-rank job and posts its receive buffers. Peers are added by
    /// [`set_peers`](Self::set_peers).
    pub fn new(
        providers: Vec<P>,
        rank: u32,
        size: u32,
        settings: UdSettings,
    ) -> Result<UdCarrier<P>, VerbsError> {
        if providers.is_empty() {
            return Err(VerbsError::InvalidSetting(
                "a UD carrier needs a port".into(),
            ));
        }
        if settings.recv_buffers == 0 || settings.send_buffers == 0 {
            return Err(VerbsError::InvalidSetting(format!(
                "{} receive and {} send buffers (at least 1 each)",
                settings.recv_buffers, settings.send_buffers
            )));
        }
        let mut routes = Vec::with_capacity(providers.len());
        for mut provider in providers {
            let mtu = provider.ud_mtu();
            if mtu < 64 {
                return Err(VerbsError::InvalidSetting(format!("UD MTU of {mtu} bytes")));
            }
            let q = UdQueue::open(
                &mut provider,
                settings.qkey,
                settings.send_buffers,
                settings.recv_buffers,
            )?;
            routes.push(Route {
                provider,
                qp: q.qp,
                address: q.address,
                recv_region: q.recv_region,
                send_region: q.send_region,
                free_send: (0..settings.send_buffers).rev().collect(),
                peers: vec![None; size as usize],
                slot_len: q.slot_len,
                mtu: q.mtu,
            });
        }
        let max_datagram = routes.iter().map(|r| r.mtu).min().unwrap_or(0) - 1;
        Ok(UdCarrier {
            rank,
            size,
            qkey: settings.qkey,
            max_datagram,
            closed: AtomicBool::new(false),
            discovery: None,
            state: Mutex::new(State {
                routes,
                ranks: FxHashMap::default(),
                known: vec![false; size as usize],
                strangers: Vec::new(),
                control: VecDeque::new(),
                pending: Vec::new(),
                completions: Vec::new(),
                counters: UdCounters::default(),
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State<P>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The job's size.
    pub fn size(&self) -> u32 {
        self.size
    }

    /// The UD queue pair of each route: what this rank publishes for its peers.
    pub fn addresses(&self) -> Vec<QpAddress> {
        self.lock().routes.iter().map(|r| r.address).collect()
    }

    /// What this rank publishes for its peers in a multi-process job: its queue key and the
    /// UD queue pair of each route.
    pub fn endpoints(&self) -> UdEndpoints {
        UdEndpoints {
            qkey: self.qkey,
            routes: self.addresses(),
        }
    }

    /// Learns peers on demand from `directory` (multi-process jobs, see the
    /// [module docs](self)); `job_key` is the key of this job's link packets.
    #[must_use]
    pub fn with_directory(mut self, directory: Arc<dyn UdDirectory>, job_key: u64) -> Self {
        self.discovery = Some(Discovery {
            directory,
            job_key,
            failed: FailedLookups::default(),
        });
        self
    }

    /// Tells the carrier where the peers are: `table[rank][route]` (this rank's own entry is
    /// ignored), all with this carrier's queue key. A peer with fewer routes than this rank
    /// is unreachable on the missing ones.
    pub fn set_peers(&self, table: &[Vec<QpAddress>]) -> Result<(), VerbsError> {
        let mut guard = self.lock();
        for (peer, routes) in (0u32..).zip(table) {
            let endpoints = UdEndpoints {
                qkey: self.qkey,
                routes: routes.clone(),
            };
            self.add_peer(&mut guard, peer, &endpoints)?;
        }
        Ok(())
    }

    /// Enters `peer`'s endpoints in the table (not this rank, nor a rank out of range, nor
    /// one already known).
    fn add_peer(
        &self,
        s: &mut State<P>,
        peer: u32,
        endpoints: &UdEndpoints,
    ) -> Result<(), VerbsError> {
        if peer == self.rank || peer >= self.size || s.known[peer as usize] {
            return Ok(());
        }
        if endpoints.routes.is_empty() {
            return Err(VerbsError::InvalidSetting(format!(
                "rank {peer} published no UD route"
            )));
        }
        for (route, address) in s.routes.iter_mut().zip(&endpoints.routes) {
            let ah = route.provider.create_ah(address.port)?;
            route.peers[peer as usize] = Some(PeerRoute {
                address: *address,
                ah,
                qkey: endpoints.qkey,
            });
            s.ranks.insert((address.port.lid, address.qpn.0), peer);
        }
        s.known[peer as usize] = true;
        Ok(())
    }

    /// Looks `rank` up in the directory (if there is one, and it was not asked in vain just
    /// now) and enters it in the table. True if it is known afterwards.
    fn discover(&self, rank: u32) -> bool {
        let Some(d) = &self.discovery else {
            return false;
        };
        if rank == self.rank || rank >= self.size || d.failed.recently_failed(rank) {
            return false;
        }
        self.lock().counters.lookups += 1;
        let added = d.directory.lookup_ud(rank).and_then(|endpoints| {
            let mut guard = self.lock();
            self.add_peer(&mut guard, rank, &endpoints)
                .map_err(TransportError::from)
        });
        match added {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(rank = self.rank, peer = rank, error = %e, "UD peer lookup failed");
                d.failed.remember(rank);
                false
            }
        }
    }

    /// Identifies the datagrams from unknown queue pairs (looking the ranks they claim up in
    /// the directory): link packets go to `link`, with their sender if the claim checks
    /// out; connection messages whose claim checks out go to the control queue.
    fn identify(&self, strangers: Vec<Received>, link: &mut Vec<Datagram>) {
        let claims: Vec<Option<u32>> = strangers.iter().map(|d| self.claimed(d)).collect();
        for &claimed in claims.iter().flatten() {
            let known = self.lock().known.get(claimed as usize).copied();
            if known == Some(false) {
                self.discover(claimed);
            }
        }
        let mut s = self.lock();
        for (d, claimed) in strangers.into_iter().zip(claims) {
            let from = d
                .source
                .and_then(|a| s.ranks.get(&(a.port.lid, a.qpn.0)).copied())
                .filter(|r| Some(*r) == claimed);
            match (d.kind, from) {
                (KIND_LINK, _) => link.push(Datagram {
                    route: d.route,
                    from,
                    bytes: d.bytes,
                }),
                (_, Some(from)) => s.control.push_back((from, d.bytes.slice(4..))),
                // Control messages from strangers are dropped.
                (_, None) => {}
            }
        }
    }

    /// The rank a datagram from an unknown queue pair claims to come from: a link packet's
    /// source if it carries this job's key, a connection message's sender. None without a
    /// directory to check the claim against.
    fn claimed(&self, d: &Received) -> Option<u32> {
        let discovery = self.discovery.as_ref()?;
        match d.kind {
            KIND_LINK => crate::link::packet_sender(&d.bytes)
                .filter(|(key, _)| *key == discovery.job_key)
                .map(|(_, source)| source),
            _ => control_sender(&d.bytes),
        }
    }

    /// Its counters.
    pub fn counters(&self) -> UdCounters {
        self.lock().counters
    }

    /// Sends a connection-management message to `to` over the first route that takes it.
    pub fn send_control(&self, to: u32, message: &[u8]) -> Result<(), TransportError> {
        let mut last = TransportError::PeerUnreachable(to as usize);
        for route in 0..self.routes() {
            match self.send_kind(
                route,
                to,
                KIND_CONTROL,
                &[&self.rank.to_le_bytes(), message],
            ) {
                Ok(()) => return Ok(()),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// Moves the connection-management messages received so far (sender, bytes) to `out`.
    pub fn take_control(&self, out: &mut Vec<(u32, Bytes)>) {
        out.extend(self.lock().control.drain(..));
    }

    fn send_kind(
        &self,
        route: usize,
        to: u32,
        kind: u8,
        parts: &[&[u8]],
    ) -> Result<(), TransportError> {
        if self.closed.load(Ordering::Relaxed) {
            return Err(TransportError::Closed);
        }
        let len = 1 + parts.iter().map(|p| p.len()).sum::<usize>();
        let mut guard = self.lock();
        if self.discovery.is_some() && guard.known.get(to as usize) == Some(&false) {
            drop(guard);
            self.discover(to);
            guard = self.lock();
        }
        let s = &mut *guard;
        let Some(r) = s.routes.get_mut(route) else {
            return Err(TransportError::PeerUnreachable(to as usize));
        };
        let Some(Some(dest)) = r.peers.get(to as usize).copied() else {
            return Err(TransportError::PeerUnreachable(to as usize));
        };
        if len > r.mtu {
            return Err(TransportError::Io {
                op: "UD send",
                message: format!("datagram of {len} bytes exceeds the MTU of {}", r.mtu),
            });
        }
        if r.free_send.is_empty() {
            // Reclaim the buffers of completed sends first (keeping what was received).
            let got = Self::poll_route(r, route, &mut s.completions, &mut s.counters, &s.ranks);
            s.file(got);
        }
        let Some(r) = s.routes.get_mut(route) else {
            return Err(TransportError::PeerUnreachable(to as usize));
        };
        let Some(slot) = r.free_send.pop() else {
            s.counters.send_failures += 1;
            return Err(TransportError::Io {
                op: "UD send",
                message: "no free send buffer".into(),
            });
        };
        let offset = slot as usize * r.mtu;
        let mut bytes = Vec::with_capacity(len);
        bytes.push(kind);
        for p in parts {
            bytes.extend_from_slice(p);
        }
        let posted = r
            .provider
            .write_local(r.send_region.id, offset, &bytes)
            .and_then(|()| {
                r.provider.post_send(
                    r.qp,
                    SendRequest {
                        wr_id: WR_SEND | u64::from(slot),
                        op: SendOp::SendTo {
                            ah: dest.ah,
                            qpn: dest.address.qpn,
                            qkey: dest.qkey,
                            imm: None,
                        },
                        local: Some(Sge {
                            mr: r.send_region.id,
                            offset,
                            len,
                        }),
                    },
                )
            });
        match posted {
            Ok(()) => {
                s.counters.sent += 1;
                Ok(())
            }
            Err(e) => {
                r.free_send.push(slot);
                s.counters.send_failures += 1;
                Err(TransportError::Io {
                    op: "UD send",
                    message: e.to_string(),
                })
            }
        }
    }

    /// Takes one route's completions: frees send buffers, reposts receive buffers, and
    /// returns the datagrams received (for [`State::file`]).
    fn poll_route(
        r: &mut Route<P>,
        route: usize,
        scratch: &mut Vec<Completion>,
        counters: &mut UdCounters,
        ranks: &FxHashMap<(u16, u32), u32>,
    ) -> Vec<Received> {
        let mut received = Vec::new();
        loop {
            scratch.clear();
            let n = match r.provider.poll_completions(scratch, 64) {
                Ok(n) => n,
                Err(e) => {
                    tracing::debug!(route, error = %e, "UD completion poll failed");
                    0
                }
            };
            for c in scratch.iter() {
                if c.wr_id & WR_SEND != 0 {
                    r.free_send.push((c.wr_id & !WR_SEND) as u32);
                    if c.status != CompletionStatus::Success {
                        counters.failed_completions += 1;
                    }
                    continue;
                }
                let slot = recv_slot(&r.recv_region, r.slot_len, c.wr_id);
                // Read the datagram out before its slot is posted again.
                let bytes = (c.status == CompletionStatus::Success).then(|| {
                    let len = c.byte_len.saturating_sub(GRH_LEN).min(r.mtu);
                    r.provider
                        .read_local(r.recv_region.id, slot.offset + GRH_LEN, len)
                });
                // A flushed slot is not reposted: the queue pair is in error (port down).
                if c.status != CompletionStatus::Flushed {
                    let _ = r.provider.post_recv(r.qp, c.wr_id, slot);
                }
                // Flushed or too long: a lost datagram.
                let Some(Ok(mut bytes)) = bytes else {
                    counters.failed_completions += 1;
                    continue;
                };
                counters.received += 1;
                if c.kind != CompletionKind::Recv || bytes.is_empty() {
                    counters.malformed += 1;
                    continue;
                }
                let from = c
                    .source
                    .and_then(|a| ranks.get(&(a.port.lid, a.qpn.0)).copied());
                let kind = bytes.remove(0);
                if kind != KIND_LINK && kind != KIND_CONTROL {
                    counters.malformed += 1;
                    continue;
                }
                received.push(Received {
                    route,
                    kind,
                    source: c.source,
                    from,
                    bytes: Bytes::from(bytes),
                });
            }
            if n == 0 {
                return received;
            }
        }
    }
}

impl<P> State<P> {
    /// Files received datagrams: a known sender's link packets for the next `recv`, its
    /// connection messages (without the sender's rank in front) in the control queue, and
    /// unknown senders' datagrams for identification.
    fn file(&mut self, received: Vec<Received>) {
        for d in received {
            match (d.kind, d.from) {
                (KIND_LINK, Some(from)) => self.pending.push(Datagram {
                    route: d.route,
                    from: Some(from),
                    bytes: d.bytes,
                }),
                (_, Some(from)) => match control_sender(&d.bytes) {
                    Some(_) => self.control.push_back((from, d.bytes.slice(4..))),
                    None => self.counters.malformed += 1,
                },
                (_, None) => self.strangers.push(d),
            }
        }
    }
}

/// The sender's rank in front of a connection message, if there are four bytes for it.
fn control_sender(bytes: &[u8]) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(..4)?.try_into().ok()?))
}

impl<P: Provider> Carrier for UdCarrier<P> {
    fn routes(&self) -> usize {
        self.lock().routes.len()
    }

    fn max_datagram(&self) -> usize {
        self.max_datagram
    }

    fn send(&self, route: usize, to: u32, parts: &[&[u8]]) -> Result<(), TransportError> {
        self.send_kind(route, to, KIND_LINK, parts)
    }

    fn recv(&self, out: &mut Vec<Datagram>) -> Result<usize, TransportError> {
        if self.closed.load(Ordering::Relaxed) {
            return Ok(0);
        }
        let mut guard = self.lock();
        let s = &mut *guard;
        let before = out.len();
        for route in 0..s.routes.len() {
            let got = Self::poll_route(
                &mut s.routes[route],
                route,
                &mut s.completions,
                &mut s.counters,
                &s.ranks,
            );
            s.file(got);
        }
        out.append(&mut s.pending);
        let strangers = std::mem::take(&mut s.strangers);
        drop(guard);
        if !strangers.is_empty() {
            self.identify(strangers, out);
        }
        Ok(out.len() - before)
    }

    fn poll_recv_ready(&self, cx: &mut Context<'_>) -> Poll<()> {
        let s = self.lock();
        if !s.control.is_empty() || !s.pending.is_empty() || !s.strangers.is_empty() {
            return Poll::Ready(());
        }
        let mut ready = false;
        for r in &s.routes {
            // Poll every route, so each has the waker registered.
            ready |= r.provider.poll_ready(cx).is_ready();
        }
        if ready {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
    }
}
