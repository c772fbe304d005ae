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
//! * Receiving drains each socket until it would block. Datagrams up to
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
pub(crate) mod socket;
pub(crate) mod splice;

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
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
}

impl Default for UdpSettings {
    fn default() -> Self {
        UdpSettings {
            routes: vec![IpAddr::from([127, 0, 0, 1])],
            max_datagram: DEFAULT_DATAGRAM,
            socket_buffer: 64 << 20,
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

/// Where each peer's routes are, and who an address belongs to.
#[derive(Default)]
struct PeerTable {
    /// `addrs[rank][route]`.
    addrs: FxHashMap<u32, Box<[SocketAddr]>>,
    ranks: FxHashMap<SocketAddr, u32>,
}

/// One rank's UDP routes (see the [module docs](self)).
pub struct UdpCarrier {
    rank: u32,
    sockets: Vec<RouteSocket>,
    peers: RwLock<PeerTable>,
    max_datagram: usize,
    closed: AtomicBool,
    /// The buffer the next datagram is received into (`max_datagram + 1` bytes, so a longer
    /// datagram shows up as one byte too long instead of silently truncated).
    scratch: Mutex<Vec<u8>>,
    /// Where `scratch` comes from, and goes back to once a large datagram is dropped.
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
            .map(|ip| RouteSocket::bind(SocketAddr::new(*ip, 0), settings.socket_buffer))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(UdpCarrier {
            rank,
            sockets,
            peers: RwLock::new(PeerTable::default()),
            max_datagram,
            closed: AtomicBool::new(false),
            scratch: Mutex::new(Vec::new()),
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
        self.sockets.iter().map(RouteSocket::local_addr).collect()
    }

    /// Tells the carrier where rank `rank`'s routes are (one address per route, in route order).
    /// Datagrams from these addresses are attributed to `rank`.
    pub fn add_peer(&self, rank: u32, addrs: &[SocketAddr]) {
        let mut t = self.peers.write().unwrap_or_else(|p| p.into_inner());
        if let Some(old) = t.addrs.insert(rank, addrs.into()) {
            for a in old.iter() {
                t.ranks.remove(a);
            }
        }
        for a in addrs {
            t.ranks.insert(*a, rank);
        }
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
    /// The socket and peer address a `len`-byte datagram to `to` over `route` goes by.
    fn destination(
        &self,
        route: usize,
        to: u32,
        len: usize,
    ) -> Result<(&RouteSocket, SocketAddr), TransportError> {
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
        let addr = match self.peer_addr(to, route) {
            Some(a) => a,
            None if !self.knows(to) && self.discover(to) => self
                .peer_addr(to, route)
                .ok_or(TransportError::PeerUnreachable(to as usize))?,
            None => return Err(TransportError::PeerUnreachable(to as usize)),
        };
        Ok((socket, addr))
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
        if self.closed.load(Ordering::Relaxed) {
            return Ok((0, false));
        }
        let before = out.len();
        let mut scratch = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        for (route, socket) in self.sockets.iter().enumerate() {
            loop {
                if out.len() - before >= max {
                    return Ok((out.len() - before, true));
                }
                let cap = self.max_datagram + 1;
                if scratch.capacity() < cap {
                    *scratch = self.buffers.take(cap).ok_or_else(|| TransportError::Io {
                        op: "UDP receive",
                        message: format!("no memory for a {cap}-byte receive buffer"),
                    })?;
                }
                let Some((n, addr)) = socket.recv_into(&mut scratch, cap)? else {
                    break;
                };
                let bytes = if n <= COPY_THRESHOLD {
                    let b = bytes::Bytes::copy_from_slice(&scratch[..n]);
                    scratch.clear();
                    b
                } else {
                    self.buffers.freeze(std::mem::take(&mut *scratch))
                };
                let from = self.rank_of(&addr).or_else(|| self.identify(&addr, &bytes));
                out.push(Datagram { route, from, bytes });
            }
        }
        Ok((out.len() - before, false))
    }

    fn poll_recv_ready(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.closed.load(Ordering::Relaxed) {
            return Poll::Pending;
        }
        let mut ready = false;
        for s in &self.sockets {
            // Poll every socket, so each one has our waker registered.
            ready |= s.poll_readable(cx).is_ready();
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
