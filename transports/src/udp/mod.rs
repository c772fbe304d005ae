//! UDP: a [`Carrier`] with one non-blocking socket per route.
//!
//! Each route is a UDP socket bound to one local address (one adapter); route `r` of this rank
//! sends to route `r` of its peers. [`UdpCarrier`] only moves datagrams: sequence numbers, CRCs,
//! acknowledgements, striping and failover are the reliability layer's work
//! (`crate::link::LinkTransport` over this carrier).
//!
//! * Sockets are non-blocking, with large kernel buffers ([`UdpSettings::socket_buffer`]; as root
//!   the system limits are bypassed with `SO_RCVBUFFORCE`/`SO_SNDBUFFORCE`).
//! * A datagram is sent with one `sendmsg` from its parts (header and payload are never joined).
//!   A large payload the reliability layer holds until it is acknowledged
//!   ([`Carrier::send_held`]) is not even copied into the kernel: it is spliced by reference
//!   (`splice` module).
//! * Each peer a route talks to gets a *lane* (up to [`UdpSettings::max_lanes`]): a socket
//!   connected to that peer's route and bound to the route socket's own address and port
//!   (`SO_REUSEPORT`), so peers see one address per route. Sends to the peer go on its lane
//!   without a destination address, and the kernel hands the peer's datagrams to the lane:
//!   no route lookup per datagram on either side (`socket` module). Datagrams from anyone
//!   else arrive on the route socket.
//! * One level-triggered epoll set watches every socket (`poller` module): a busy poll first
//!   tries the lane that delivered last, then, every second empty try, asks the set about all
//!   the others (one system call however many sockets); the tokio reactor watches the set for
//!   a parked progress task. What a peer sent before its lane opened is read off the route
//!   socket first, so nothing is reordered.
//! * Receiving drains each ready socket until it would block. Datagrams up to
//!   [`COPY_THRESHOLD`] bytes are copied out of a reused buffer; longer ones keep the buffer they
//!   were received into, so large payloads are never copied in user space. Those buffers come
//!   from a [`BufferPool`] and go back to it when the layers above drop the datagram (once its
//!   fragment is reassembled): a stream of large datagrams reuses a few buffers instead of
//!   allocating, faulting in and freeing 64 KiB for each.
//! * Only datagrams from addresses of known peers are attributed to a rank; anything else is
//!   handed up with `from: None` and dropped there as foreign.
//! * Peers are learnt on demand in multi-process jobs ([`UdpCarrier::with_directory`]): the
//!   first send to a rank, or the first packet of this job from an address not yet known, looks
//!   the rank's published routes up once in a [`PeerDirectory`] (Yu's on-demand connection
//!   set-up: nothing is exchanged N² at start-up). A packet is attributed to the rank it claims
//!   only if it comes from an address that rank published.

pub mod interfaces;
pub(crate) mod poller;
pub(crate) mod socket;
pub(crate) mod splice;

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, RwLock};
use std::task::{Context, Poll};

use std::sync::Arc;

use rankweave_core::buffer_pool::BufferPool;
use rankweave_core::{
    Carrier, Communicator, Config, Datagram, Error, Transport, TransportError, TransportKind,
};
use rustc_hash::FxHashMap;

use crate::chaos::ChaosCarrier;
use crate::link::{FailedLookups, LinkTransport, LinkTransportConfig};

use poller::ReadyPoller;

pub use socket::RouteSocket;

/// Datagrams up to this many bytes are copied out of the receive buffer; longer ones keep it.
pub const COPY_THRESHOLD: usize = 16 * 1024;

/// The largest UDP payload over IPv4 (65 535 − 8 − 20).
pub const MAX_UDP_PAYLOAD: usize = 65_507;

/// The default datagram size: with reliability on, a DATA fragment's payload is then exactly
/// 14 pages (57 344 bytes), which spans at most 15 pages at any alignment, so that it can be
/// spliced as a segmentation-offload datagram and the kernel sums no payload byte (see the
/// `splice` module). Against the largest datagram (65 507 bytes) that is 14% more datagrams
/// for a large message, each cheaper by a pass over its payload on both sides.
pub const DEFAULT_DATAGRAM: usize = 14 * 4096
    + rankweave_core::reliability::Packet::max_data_header_len()
    + rankweave_core::wire::MAX_HEADER_LEN;

/// How a rank's UDP routes are set up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UdpSettings {
    /// One local address per route; each route binds a socket on an ephemeral port there.
    pub routes: Vec<IpAddr>,
    /// Largest datagram, in bytes (at most [`MAX_UDP_PAYLOAD`]; default [`DEFAULT_DATAGRAM`]).
    pub max_datagram: usize,
    /// Requested kernel send and receive buffer size per socket, in bytes.
    pub socket_buffer: usize,
    /// Most peers per route that get a lane (a socket connected to them: see the `socket`
    /// module); the others go through the route socket. Each lane is a descriptor (three
    /// once it splices).
    pub max_lanes: usize,
}

impl Default for UdpSettings {
    fn default() -> Self {
        UdpSettings {
            routes: vec![IpAddr::from([127, 0, 0, 1])],
            max_datagram: DEFAULT_DATAGRAM,
            socket_buffer: 64 << 20,
            max_lanes: DEFAULT_MAX_LANES,
        }
    }
}

/// Where the ranks of a multi-process job published their routes: consulted once per peer, on
/// first contact.
pub trait PeerDirectory: Send + Sync + 'static {
    /// The route addresses rank `rank` published, in route order. May block briefly (a
    /// round trip to the launcher's key-value service); must give up with an error rather than
    /// block for long.
    fn lookup(&self, rank: u32) -> Result<Vec<SocketAddr>, TransportError>;
}

/// On-demand peer discovery (see [`UdpCarrier::with_directory`]).
struct Discovery {
    directory: Arc<dyn PeerDirectory>,
    job_key: u64,
    size: u32,
    /// Ranks whose lookup failed just now.
    failed: FailedLookups,
}

/// Default of [`UdpSettings::max_lanes`].
pub const DEFAULT_MAX_LANES: usize = 32;

/// Where each peer's routes are, who an address belongs to, and the lanes to peers.
#[derive(Default)]
struct PeerTable {
    /// `addrs[rank][route]`.
    addrs: FxHashMap<u32, Box<[SocketAddr]>>,
    ranks: FxHashMap<SocketAddr, u32>,
    /// By `(rank, route)`.
    lanes: FxHashMap<(u32, usize), Lane>,
}

/// A peer's lane on one route.
enum Lane {
    /// Open, watched by the poller under `token`.
    Open {
        socket: Arc<RouteSocket>,
        token: usize,
    },
    /// Not to be tried again (the route has its most lanes, or opening one failed): the
    /// route socket serves this peer.
    Refused,
}

impl Lane {
    /// The lane's socket, `None` if the route socket serves the peer.
    fn socket(&self) -> Option<Arc<RouteSocket>> {
        match self {
            Lane::Open { socket, .. } => Some(Arc::clone(socket)),
            Lane::Refused => None,
        }
    }
}

/// The receiving side's state, behind one lock.
#[derive(Default)]
struct Receiving {
    /// The buffer the next datagram is received into (`max_datagram + 1` bytes, so a longer
    /// datagram shows up as one byte too long instead of silently truncated).
    scratch: Vec<u8>,
    /// The lane that delivered last: tried first, with a receive of its own, before asking
    /// the poller (a ping-pong then costs one system call per poll, as on a plain socket).
    hot: Option<Receiver>,
    /// Receives from `hot` in a row that found nothing.
    quiet: u32,
    /// Receives from `hot` in a row that found something.
    hot_streak: u32,
    /// [`UdpCarrier::lanes_closed`] when `hot` was chosen: if a lane closed since, `hot` may
    /// be it, and is dropped.
    hot_since: u64,
}

/// The tokens of the sockets to read, in order, when the poller reported `tokens[..ready]`
/// of a set whose route sockets have tokens `0..routes`.
///
/// Route sockets come first: when a lane opens, what its peer sent before is still queued on
/// the route socket and must be read before what the lane gets. When the poller filled
/// `tokens`, more sockets may be ready than it named, perhaps a route socket left out while
/// its lanes are in: every route socket is read then (an empty one costs one system call).
fn read_order(tokens: &mut [u64], ready: usize, routes: u64) -> impl Iterator<Item = u64> + '_ {
    let truncated = ready == tokens.len();
    let ready = &mut tokens[..ready];
    ready.sort_unstable();
    let route_tokens = (0..routes).filter(move |_| truncated);
    let named = ready.iter().copied();
    route_tokens.chain(named.filter(move |&t| !truncated || t >= routes))
}

/// Adds `r` to the sockets `poller` watches, under the next token; returns the token.
fn watch(
    poller: &ReadyPoller,
    receivers: &mut Vec<Option<Receiver>>,
    r: Receiver,
) -> Result<usize, TransportError> {
    let token = receivers.len();
    poller
        .add(r.socket.raw_fd(), token as u64)
        .map_err(|e| TransportError::Io {
            op: "watch UDP socket",
            message: e.to_string(),
        })?;
    receivers.push(Some(r));
    Ok(token)
}

/// After this many empty receives from the hot lane in a row, the poller is asked about the
/// other sockets too: a datagram elsewhere (another peer, a stranger) waits at most that many
/// polls.
const ASK_POLLER_EVERY: u32 = 2;

/// After this many receives from the hot lane in a row that found something, the poller is
/// asked too: a peer streaming into its lane does not starve the others.
const HOT_STREAK: u32 = 2;

/// Most datagrams taken from one socket per receive: with several sockets ready, each gets a
/// turn (a socket filled faster than it is read would otherwise hold the others up).
const PER_SOCKET: usize = 8;

/// A socket the poller watches: a route socket (`peer: None`) or a lane.
#[derive(Clone)]
struct Receiver {
    socket: Arc<RouteSocket>,
    route: usize,
    peer: Option<u32>,
}

/// One rank's UDP routes (see the [module docs](self)).
pub struct UdpCarrier {
    rank: u32,
    /// The route sockets, in route order.
    sockets: Vec<Arc<RouteSocket>>,
    /// What the poller's tokens stand for: the route sockets first (token = route), then lanes
    /// (`None` once a lane is closed).
    receivers: RwLock<Vec<Option<Receiver>>>,
    poller: ReadyPoller,
    socket_buffer: usize,
    max_lanes: usize,
    /// Lanes closed so far (see [`Receiving::hot_since`]).
    lanes_closed: AtomicU64,
    peers: RwLock<PeerTable>,
    max_datagram: usize,
    closed: AtomicBool,
    /// The receive buffer and which socket to try first.
    receiving: Mutex<Receiving>,
    /// Where receive buffers come from, and go back to once a large datagram is dropped.
    buffers: Arc<BufferPool>,
    discovery: Option<Discovery>,
}

impl UdpCarrier {
    /// Binds one socket per route for world rank `rank`. Must run inside a tokio runtime with IO
    /// enabled.
    pub fn bind(rank: u32, settings: &UdpSettings) -> Result<UdpCarrier, TransportError> {
        if settings.routes.is_empty() {
            return Err(TransportError::Io {
                op: "bind UDP routes",
                message: "no route addresses given".into(),
            });
        }
        let max_datagram = settings.max_datagram.clamp(512, MAX_UDP_PAYLOAD);
        let sockets = settings
            .routes
            .iter()
            .map(|ip| {
                RouteSocket::bind(SocketAddr::new(*ip, 0), settings.socket_buffer).map(Arc::new)
            })
            .collect::<Result<Vec<_>, _>>()?;
        // Registering with a runtime whose IO driver is disabled panics inside tokio; turn that
        // into an error that says what to do.
        let poller = std::panic::catch_unwind(ReadyPoller::new)
            .map_err(|_| TransportError::Io {
                op: "register UDP sockets",
                message: "the tokio runtime has IO disabled (build it with enable_all())".into(),
            })?
            .map_err(|e| TransportError::Io {
                op: "register UDP sockets",
                message: e.to_string(),
            })?;
        let mut receivers = Vec::new();
        for (route, socket) in sockets.iter().enumerate() {
            let socket = Arc::clone(socket);
            watch(
                &poller,
                &mut receivers,
                Receiver {
                    socket,
                    route,
                    peer: None,
                },
            )?;
        }
        Ok(UdpCarrier {
            rank,
            sockets,
            receivers: RwLock::new(receivers),
            poller,
            socket_buffer: settings.socket_buffer,
            max_lanes: settings.max_lanes,
            lanes_closed: AtomicU64::new(0),
            peers: RwLock::new(PeerTable::default()),
            max_datagram,
            closed: AtomicBool::new(false),
            receiving: Mutex::new(Receiving::default()),
            buffers: Arc::default(),
            discovery: None,
        })
    }

    /// Learns peers on demand from `directory` (multi-process jobs): a send to a rank whose
    /// routes are unknown looks them up first, and a packet of job `job_key` from an unknown
    /// address that claims to come from rank `r < size` makes the carrier look `r` up; the
    /// packet is attributed to `r` only if its address is one `r` published.
    #[must_use]
    pub fn with_directory(
        mut self,
        directory: Arc<dyn PeerDirectory>,
        job_key: u64,
        size: u32,
    ) -> Self {
        self.discovery = Some(Discovery {
            directory,
            job_key,
            size,
            failed: FailedLookups::default(),
        });
        self
    }

    /// This rank's world rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The address of each route, in route order: what peers need to reach this rank.
    pub fn local_addrs(&self) -> Vec<SocketAddr> {
        self.sockets.iter().map(|s| s.local_addr()).collect()
    }

    /// Tells the carrier where rank `rank`'s routes are (one address per route, in route order).
    /// Datagrams from these addresses are attributed to `rank`.
    pub fn add_peer(&self, rank: u32, addrs: &[SocketAddr]) {
        let mut t = self.peers.write().unwrap_or_else(|p| p.into_inner());
        if let Some(old) = t.addrs.insert(rank, addrs.into()) {
            for a in old.iter() {
                t.ranks.remove(a);
            }
            // Lanes are connected to the old addresses.
            for route in 0..self.sockets.len() {
                if let Some(Lane::Open { socket, token }) = t.lanes.remove(&(rank, route)) {
                    self.close_lane(&socket, token);
                }
            }
        }
        for a in addrs {
            t.ranks.insert(*a, rank);
        }
    }

    /// The lane to `rank` on `route` (whose address is `addr`), opened now if it has none
    /// yet and may have one; `None` if the route socket serves it.
    fn lane(&self, rank: u32, route: usize, addr: SocketAddr) -> Option<Arc<RouteSocket>> {
        {
            // Usually decided already (every batch from a peer without a lane asks).
            let t = self.peers.read().unwrap_or_else(|p| p.into_inner());
            if let Some(lane) = t.lanes.get(&(rank, route)) {
                return lane.socket();
            }
        }
        let mut t = self.peers.write().unwrap_or_else(|p| p.into_inner());
        if t.addrs.get(&rank).and_then(|a| a.get(route)) != Some(&addr) {
            return None; // not (or no longer) this rank's address
        }
        if let Some(lane) = t.lanes.get(&(rank, route)) {
            return lane.socket(); // opened meanwhile
        }
        let open = t
            .lanes
            .iter()
            .filter(|((_, r), l)| *r == route && matches!(l, Lane::Open { .. }))
            .count();
        let lane = if self.closed.load(Ordering::Relaxed) || open >= self.max_lanes {
            Lane::Refused
        } else {
            match self.open_lane(rank, route, addr) {
                Ok(lane) => lane,
                Err(e) => {
                    tracing::debug!(rank, route, error = %e, "no lane: the route socket serves this peer");
                    Lane::Refused
                }
            }
        };
        let socket = lane.socket();
        t.lanes.insert((rank, route), lane);
        socket
    }

    fn open_lane(&self, rank: u32, route: usize, addr: SocketAddr) -> Result<Lane, TransportError> {
        let local = self.sockets[route].local_addr();
        let socket = Arc::new(RouteSocket::lane(local, addr, self.socket_buffer)?);
        let mut rx = self.receivers.write().unwrap_or_else(|p| p.into_inner());
        let lane = Receiver {
            socket: Arc::clone(&socket),
            route,
            peer: Some(rank),
        };
        let token = watch(&self.poller, &mut rx, lane)?;
        Ok(Lane::Open { socket, token })
    }

    fn close_lane(&self, socket: &RouteSocket, token: usize) {
        self.lanes_closed.fetch_add(1, Ordering::Release);
        let _ = self.poller.remove(socket.raw_fd());
        let mut rx = self.receivers.write().unwrap_or_else(|p| p.into_inner());
        if let Some(slot) = rx.get_mut(token) {
            *slot = None;
        }
    }

    /// Lanes open now.
    #[cfg(test)]
    pub(crate) fn lanes_open(&self) -> usize {
        let t = self.peers.read().unwrap_or_else(|p| p.into_inner());
        t.lanes
            .values()
            .filter(|l| matches!(l, Lane::Open { .. }))
            .count()
    }

    fn peer_addr(&self, rank: u32, route: usize) -> Option<SocketAddr> {
        let t = self.peers.read().unwrap_or_else(|p| p.into_inner());
        t.addrs.get(&rank).and_then(|a| a.get(route)).copied()
    }

    fn knows(&self, rank: u32) -> bool {
        let t = self.peers.read().unwrap_or_else(|p| p.into_inner());
        t.addrs.contains_key(&rank)
    }

    /// Looks `rank` up in the directory (if there is one and it was not asked in vain just
    /// now) and records its routes. True if the rank is known afterwards.
    fn discover(&self, rank: u32) -> bool {
        let Some(d) = &self.discovery else {
            return false;
        };
        if rank >= d.size || rank == self.rank {
            return false;
        }
        if d.failed.recently_failed(rank) {
            return false;
        }
        match d.directory.lookup(rank) {
            Ok(addrs) if addrs.len() >= self.sockets.len() => {
                self.add_peer(rank, &addrs[..self.sockets.len()]);
                true
            }
            Ok(addrs) => {
                tracing::warn!(
                    rank,
                    published = addrs.len(),
                    local = self.sockets.len(),
                    "peer published fewer routes than this rank has"
                );
                d.failed.remember(rank);
                false
            }
            Err(e) => {
                tracing::warn!(rank, error = %e, "peer lookup failed");
                d.failed.remember(rank);
                false
            }
        }
    }

    /// The rank an unknown address's datagram claims to come from, if it is a packet of this
    /// job (magic, job key and source of the link header) and the claim checks out against
    /// the directory.
    fn identify(&self, addr: &SocketAddr, bytes: &[u8]) -> Option<u32> {
        let d = self.discovery.as_ref()?;
        let (key, source) = crate::link::packet_sender(bytes)?;
        if key != d.job_key || self.knows(source) || !self.discover(source) {
            return None;
        }
        self.rank_of(addr).filter(|&r| r == source)
    }

    fn rank_of(&self, addr: &SocketAddr) -> Option<u32> {
        let t = self.peers.read().unwrap_or_else(|p| p.into_inner());
        t.ranks.get(addr).copied()
    }
}

impl UdpCarrier {
    /// Receives from `r` into `out` until it would block or `out` holds `limit` datagrams
    /// (then returns `true`: more may wait). Datagrams a route socket receives from a known
    /// peer add that peer to `lanes_wanted`.
    fn recv_from(
        &self,
        st: &mut Receiving,
        r: &Receiver,
        out: &mut Vec<Datagram>,
        limit: usize,
        lanes_wanted: &mut Vec<(u32, usize, SocketAddr)>,
    ) -> Result<bool, TransportError> {
        loop {
            if out.len() >= limit {
                return Ok(true);
            }
            let cap = self.max_datagram + 1;
            if st.scratch.capacity() < cap {
                st.scratch = self.buffers.take(cap).ok_or_else(|| TransportError::Io {
                    op: "UDP receive",
                    message: format!("no memory for a {cap}-byte receive buffer"),
                })?;
            }
            let Some((n, addr)) = r.socket.recv_into(&mut st.scratch, cap)? else {
                return Ok(false);
            };
            let bytes = if n <= COPY_THRESHOLD {
                let b = bytes::Bytes::copy_from_slice(&st.scratch[..n]);
                st.scratch.clear();
                b
            } else {
                self.buffers.freeze(std::mem::take(&mut st.scratch))
            };
            // A lane receives only from the address it is connected to, once connected (see
            // `socket::steer_unconnected_to_first`): anything else is told apart by address.
            let lane_peer = r.peer.filter(|_| r.socket.is_connected_to(addr));
            let from = lane_peer.or_else(|| {
                let from = self.rank_of(&addr).or_else(|| self.identify(&addr, &bytes));
                if let Some(rank) = from {
                    if !lanes_wanted.iter().any(|w| w.0 == rank && w.1 == r.route) {
                        lanes_wanted.push((rank, r.route, addr));
                    }
                }
                from
            });
            out.push(Datagram {
                route: r.route,
                from,
                bytes,
            });
        }
    }

    /// The socket and peer address a `len`-byte datagram to `to` over `route` goes by: the
    /// peer's lane (opened on first use), else the route socket.
    fn destination(
        &self,
        route: usize,
        to: u32,
        len: usize,
    ) -> Result<(Arc<RouteSocket>, SocketAddr), TransportError> {
        if self.closed.load(Ordering::Relaxed) {
            return Err(TransportError::Closed);
        }
        if len > self.max_datagram {
            return Err(TransportError::Io {
                op: "UDP send",
                message: format!("datagram of {len} bytes exceeds {}", self.max_datagram),
            });
        }
        let Some(socket) = self.sockets.get(route) else {
            return Err(TransportError::PeerUnreachable(to as usize));
        };
        let found = {
            let t = self.peers.read().unwrap_or_else(|p| p.into_inner());
            t.addrs
                .get(&to)
                .and_then(|a| a.get(route))
                .map(|&addr| (addr, t.lanes.get(&(to, route)).map(Lane::socket)))
        };
        let (addr, lane) = match found {
            Some(f) => f,
            None if !self.knows(to) && self.discover(to) => (
                self.peer_addr(to, route)
                    .ok_or(TransportError::PeerUnreachable(to as usize))?,
                None,
            ),
            None => return Err(TransportError::PeerUnreachable(to as usize)),
        };
        let lane = lane.unwrap_or_else(|| self.lane(to, route, addr));
        Ok((lane.unwrap_or_else(|| Arc::clone(socket)), addr))
    }
}

impl Carrier for UdpCarrier {
    fn routes(&self) -> usize {
        self.sockets.len()
    }

    fn max_datagram(&self) -> usize {
        self.max_datagram
    }

    fn send(&self, route: usize, to: u32, parts: &[&[u8]]) -> Result<(), TransportError> {
        let len = parts.iter().map(|p| p.len()).sum();
        let (socket, addr) = self.destination(route, to, len)?;
        socket.send_to(parts, addr)
    }

    fn send_held(
        &self,
        route: usize,
        to: u32,
        parts: &[&[u8]],
        held: &[u8],
    ) -> Result<(), TransportError> {
        let len = parts.iter().map(|p| p.len()).sum::<usize>() + held.len();
        let (socket, addr) = self.destination(route, to, len)?;
        socket.send_to_held(parts, held, addr)
    }

    fn recv(&self, out: &mut Vec<Datagram>) -> Result<usize, TransportError> {
        self.recv_up_to(out, usize::MAX).map(|(n, _)| n)
    }

    fn recv_up_to(
        &self,
        out: &mut Vec<Datagram>,
        max: usize,
    ) -> Result<(usize, bool), TransportError> {
        if self.closed.load(Ordering::Relaxed) || max == 0 {
            return Ok((0, max == 0));
        }
        let before = out.len();
        let end = before.saturating_add(max);
        let mut st = self.receiving.lock().unwrap_or_else(|p| p.into_inner());
        if st.hot.is_some() && self.lanes_closed.load(Ordering::Acquire) != st.hot_since {
            st.hot = None;
        }
        if let (Some(hot), true) = (st.hot.clone(), st.hot_streak < HOT_STREAK) {
            let limit = end.min(before + PER_SOCKET);
            let stopped = self.recv_from(&mut st, &hot, out, limit, &mut Vec::new())?;
            if out.len() > before {
                st.quiet = 0;
                st.hot_streak += 1;
                return Ok((out.len() - before, stopped));
            }
            st.quiet += 1;
            if st.quiet % ASK_POLLER_EVERY != 0 {
                return Ok((0, false));
            }
        }
        st.hot_streak = 0;
        let mut tokens = [0u64; 16];
        let ready = self
            .poller
            .ready(&mut tokens)
            .map_err(|e| TransportError::Io {
                op: "UDP readiness",
                message: e.to_string(),
            })?;
        if ready == 0 {
            return Ok((0, false));
        }
        let sockets: Vec<Receiver> = {
            let rx = self.receivers.read().unwrap_or_else(|p| p.into_inner());
            read_order(&mut tokens, ready, self.sockets.len() as u64)
                .filter_map(|t| rx.get(t as usize).cloned().flatten())
                .collect()
        };
        let mut lanes_wanted = Vec::new();
        let mut more = ready == tokens.len();
        for r in &sockets {
            let got = out.len();
            let limit = end.min(got + PER_SOCKET);
            let stopped = self.recv_from(&mut st, r, out, limit, &mut lanes_wanted)?;
            more |= stopped;
            // A route socket left with datagrams may hold what a peer sent before its lane
            // opened: reading that lane now would put newer datagrams first. Come back.
            if stopped && r.peer.is_none() {
                break;
            }
            // A lane becomes the hot one only while no route socket had anything: what came
            // before it opened has been read by then.
            if out.len() > got && r.peer.is_some() && sockets.iter().all(|s| s.peer.is_some()) {
                st.hot = Some(r.clone());
                st.quiet = 0;
                st.hot_since = self.lanes_closed.load(Ordering::Acquire);
            }
            if out.len() >= end {
                break;
            }
        }
        drop(st);
        for (rank, route, addr) in lanes_wanted {
            self.lane(rank, route, addr);
        }
        Ok((out.len() - before, more))
    }

    fn poll_recv_ready(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.closed.load(Ordering::Relaxed) {
            return Poll::Pending;
        }
        self.poller.poll_ready(cx)
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
    }
}

impl std::fmt::Debug for UdpCarrier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UdpCarrier")
            .field("rank", &self.rank)
            .field("routes", &self.local_addrs())
            .field("max_datagram", &self.max_datagram)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests;

/// Binds the routes of `n` ranks of one process and tells each where the others are (the
/// building block of [`world`], public for tests and tools that wrap the carriers).
pub fn bind_job(n: u32, settings: &UdpSettings) -> Result<Vec<UdpCarrier>, TransportError> {
    let carriers = (0..n)
        .map(|rank| UdpCarrier::bind(rank, settings))
        .collect::<Result<Vec<_>, _>>()?;
    let addrs: Vec<Vec<SocketAddr>> = carriers.iter().map(UdpCarrier::local_addrs).collect();
    for c in &carriers {
        for (peer, a) in (0u32..).zip(&addrs) {
            c.add_peer(peer, a);
        }
    }
    Ok(carriers)
}

/// The world communicators of an `n`-rank job whose ranks are tasks of this process, each with
/// its own UDP sockets (one per route in `config.routes`, loopback when empty), rank order.
///
/// Reliability follows [`Config::reliability_for`]; a `config.chaos` spec wraps every rank's
/// routes in a [`ChaosCarrier`]. Must be called inside a tokio
/// runtime with IO and time enabled.
pub fn world(n: usize, config: &Config) -> Result<Vec<Communicator>, Error> {
    if n == 0 {
        return Err(Error::InvalidArgument(
            "a job needs at least one rank".into(),
        ));
    }
    let size = u32::try_from(n).map_err(|_| Error::InvalidArgument(format!("{n} ranks")))?;
    let settings = settings_for(config).map_err(Error::Transport)?;
    let carriers = bind_job(size, &settings).map_err(Error::Transport)?;
    let job_key = rankweave_core::rng::random_u64();
    carriers
        .into_iter()
        .enumerate()
        .map(|(rank, carrier)| {
            let transport = rank_transport(carrier, size, job_key, config);
            let multicast = crate::ipmcast::setup(config, rank as u32, job_key);
            Communicator::world_with_multicast(rank, n, transport, config.clone(), multicast)
        })
        .collect()
}

/// The settings `config` asks for: its routes (loopback when it names none; interface names
/// and subnets resolved to local addresses) and a datagram size that respects its `max_frame`.
pub fn settings_for(config: &Config) -> Result<UdpSettings, TransportError> {
    let mut settings = UdpSettings::default();
    if !config.routes.is_empty() {
        settings.routes = config
            .routes
            .iter()
            .map(interfaces::resolve)
            .collect::<Result<_, _>>()?;
    }
    if let Some(m) = config.max_frame {
        settings.max_datagram = settings.max_datagram.min(m + 512);
    }
    Ok(settings)
}

/// One rank's transport over `carrier` in a `size`-rank job with key `job_key`: the link layer
/// with reliability per [`Config::reliability_for`], the peer timeout and window of `config`, and the
/// chaos layer in between when `config.chaos` asks for it.
pub fn rank_transport(
    carrier: UdpCarrier,
    size: u32,
    job_key: u64,
    config: &Config,
) -> Arc<dyn Transport> {
    let mut lc = LinkTransportConfig::new(carrier.rank(), size, job_key)
        .with_peer_timeout(config.peer_timeout)
        .with_window(config.link_window);
    lc.reliability = config.reliability_for(TransportKind::Udp);
    match &config.chaos {
        Some(spec) => Arc::new(LinkTransport::new(
            ChaosCarrier::new(carrier, spec.clone()),
            lc,
        )),
        None => Arc::new(LinkTransport::new(carrier, lc)),
    }
}
