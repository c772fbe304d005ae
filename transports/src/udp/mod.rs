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
//! * Receiving drains each socket until it would block. Datagrams up to
//!   [`COPY_THRESHOLD`] bytes are copied out of a reused buffer; longer ones keep the buffer they
//!   were received into, so large payloads are never copied in user space.
//! * Only datagrams from addresses of known peers are attributed to a rank; anything else is
//!   handed up with `from: None` and dropped there as foreign.

mod socket;

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, RwLock};
use std::task::{Context, Poll};

use std::sync::Arc;

use bytes::BytesMut;
use rankweave_core::{
    Carrier, Communicator, Config, Datagram, Error, Transport, TransportError, TransportKind,
};
use rustc_hash::FxHashMap;

use crate::chaos::ChaosCarrier;
use crate::link::{LinkTransport, LinkTransportConfig};

pub use socket::RouteSocket;

/// Datagrams up to this many bytes are copied out of the receive buffer; longer ones keep it.
pub const COPY_THRESHOLD: usize = 16 * 1024;

/// The largest UDP payload over IPv4 (65 535 − 8 − 20).
pub const MAX_UDP_PAYLOAD: usize = 65_507;

/// How a rank's UDP routes are set up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UdpSettings {
    /// One local address per route; each route binds a socket on an ephemeral port there.
    pub routes: Vec<IpAddr>,
    /// Largest datagram, in bytes (at most [`MAX_UDP_PAYLOAD`]).
    pub max_datagram: usize,
    /// Requested kernel send and receive buffer size per socket, in bytes.
    pub socket_buffer: usize,
}

impl Default for UdpSettings {
    fn default() -> Self {
        UdpSettings {
            routes: vec![IpAddr::from([127, 0, 0, 1])],
            max_datagram: MAX_UDP_PAYLOAD,
            socket_buffer: 64 << 20,
        }
    }
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
    scratch: Mutex<BytesMut>,
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
            scratch: Mutex::new(BytesMut::with_capacity(max_datagram + 1)),
        })
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

    fn rank_of(&self, addr: &SocketAddr) -> Option<u32> {
        let t = self.peers.read().unwrap_or_else(|p| p.into_inner());
        t.ranks.get(addr).copied()
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
        if self.closed.load(Ordering::Relaxed) {
            return Err(TransportError::Closed);
        }
        let len: usize = parts.iter().map(|p| p.len()).sum();
        if len > self.max_datagram {
            return Err(TransportError::Io {
                op: "UDP send",
                message: format!("datagram of {len} bytes exceeds {}", self.max_datagram),
            });
        }
        let (Some(socket), Some(addr)) = (self.sockets.get(route), self.peer_addr(to, route))
        else {
            return Err(TransportError::PeerUnreachable(to as usize));
        };
        socket.send_to(parts, addr)
    }

    fn recv(&self, out: &mut Vec<Datagram>) -> Result<usize, TransportError> {
        if self.closed.load(Ordering::Relaxed) {
            return Ok(0);
        }
        let before = out.len();
        let mut scratch = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        for (route, socket) in self.sockets.iter().enumerate() {
            loop {
                if scratch.capacity() < self.max_datagram + 1 {
                    *scratch = BytesMut::with_capacity(self.max_datagram + 1);
                }
                let Some((n, addr)) = socket.recv_into(&mut scratch, self.max_datagram + 1)? else {
                    break;
                };
                let bytes = if n <= COPY_THRESHOLD {
                    let b = bytes::Bytes::copy_from_slice(&scratch[..n]);
                    scratch.clear();
                    b
                } else {
                    scratch.split().freeze()
                };
                out.push(Datagram {
                    route,
                    from: self.rank_of(&addr),
                    bytes,
                });
            }
        }
        Ok(out.len() - before)
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
    let mut settings = UdpSettings::default();
    if !config.routes.is_empty() {
        settings.routes = config.routes.clone();
    }
    if let Some(m) = config.max_frame {
        settings.max_datagram = settings.max_datagram.min(m + 512);
    }
    let carriers = bind_job(size, &settings).map_err(Error::Transport)?;
    let job_key = rankweave_core::rng::random_u64();
    let reliability = config.reliability_for(TransportKind::Udp);
    carriers
        .into_iter()
        .enumerate()
        .map(|(rank, carrier)| {
            let mut lc = LinkTransportConfig::new(rank as u32, size, job_key);
            lc.reliability = reliability;
            let transport: Arc<dyn Transport> = match &config.chaos {
                Some(spec) => Arc::new(LinkTransport::new(
                    ChaosCarrier::new(carrier, spec.clone()),
                    lc,
                )),
                None => Arc::new(LinkTransport::new(carrier, lc)),
            };
            Communicator::world(rank, n, transport, config.clone())
        })
        .collect()
}
