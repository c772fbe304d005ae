//! IP multicast: [`IpMulticast`], a [`MulticastFabric`] over UDP multicast sockets.
//!
//! A communicator's [`GroupId`] becomes an address inside the configured prefix (default
//! `239.192.0.0/14`, organization-local scope) and a port among the 1024 from the configured
//! base; each rank opens one socket per group:
//!
//! * bound to the group address itself (not the wildcard) with `SO_REUSEADDR`/`SO_REUSEPORT`,
//!   and `IP_MULTICAST_ALL` off, so it receives that group only, and every rank of the host
//!   gets its own copy;
//! * joined on the configured interface, sending from it with `IP_MULTICAST_LOOP` on (ranks of
//!   the same host, the sender included, receive) and the configured TTL (0 on loopback: the
//!   datagrams never leave the host);
//! * with a large receive buffer (`RANKWEAVE_MCAST_RCVBUF`, past the system limit when root),
//!   set before the join, so broadcasts that arrive before the rank looks wait in the kernel.
//!
//! Sends never block: a datagram the kernel will not take is dropped and counted, as the
//! network would drop it. Faults from `RANKWEAVE_MCAST_CHAOS` are injected by wrapping each
//! group in a [`ChaosGroup`].

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use rankweave_core::multicast::MulticastCounters;
use rankweave_core::{
    Config, GroupId, MulticastConfig, MulticastFabric, MulticastGroup, MulticastSetup,
    TransportError,
};
use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::UdpSocket;

use crate::chaos_group::ChaosGroup;

/// The largest UDP payload over IPv4.
const MAX_UDP_PAYLOAD: usize = 65_507;
/// Receive buffer carved into datagrams; one allocation serves many small ones.
const RECV_CHUNK: usize = 256 * 1024;

/// IP multicast groups for one rank (see the [module docs](self)).
#[derive(Clone, Debug)]
pub struct IpMulticast {
    config: MulticastConfig,
    rank: u32,
}

impl IpMulticast {
    /// The fabric of world rank `rank` with `config` (interface, prefix, port, TTL, buffers,
    /// chaos). Nothing is opened until a group is joined.
    pub fn new(config: &MulticastConfig, rank: u32) -> IpMulticast {
        IpMulticast {
            config: config.clone(),
            rank,
        }
    }

    /// The address and port `group` maps to.
    pub fn address_of(&self, group: GroupId) -> SocketAddrV4 {
        let (net, len) = self.config.prefix;
        let host_bits = 32 - u32::from(len);
        let host_mask = if host_bits == 0 {
            0
        } else {
            u32::MAX >> (32 - host_bits)
        };
        let addr = (u32::from(net) & !host_mask) | (group.0 as u32 & host_mask);
        let port = self.config.port + ((group.0 >> 32) % 1024) as u16;
        SocketAddrV4::new(Ipv4Addr::from(addr), port)
    }
}

impl MulticastFabric for IpMulticast {
    fn max_datagram(&self) -> usize {
        MAX_UDP_PAYLOAD
    }

    fn join(&self, group: GroupId) -> Result<Arc<dyn MulticastGroup>, TransportError> {
        let ip = IpGroup::join(
            self.address_of(group),
            self.config.interface,
            self.config.ttl(),
            self.config.recv_buffer,
        )?;
        Ok(match &self.config.chaos {
            // Every rank draws its own faults: receivers of one datagram lose different ones.
            Some(spec) => Arc::new(ChaosGroup::new(ip, spec, u64::from(self.rank))),
            None => Arc::new(ip),
        })
    }
}

/// The multicast setup of world rank `rank` in the job with key `job_key`: IP multicast with
/// `config.multicast`, or `None` when [`Config::multicast_enabled`] says no.
pub fn setup(config: &Config, rank: u32, job_key: u64) -> Option<MulticastSetup> {
    config.multicast_enabled().then(|| MulticastSetup {
        fabric: Arc::new(IpMulticast::new(&config.multicast, rank)),
        job_key,
    })
}

/// One rank's membership of one IP multicast group.
#[derive(Debug)]
pub struct IpGroup {
    /// Registered with tokio's reactor, only to learn when to look again.
    socket: UdpSocket,
    /// The same socket, for direct system calls: tokio's `try_*` methods trust readiness the
    /// reactor may not have seen yet (a fresh socket is "not writable" until it has run).
    raw: std::net::UdpSocket,
    group: SocketAddrV4,
    recv_buf: std::sync::Mutex<BytesMut>,
    datagrams_sent: AtomicU64,
    bytes_sent: AtomicU64,
    send_dropped: AtomicU64,
    datagrams_received: AtomicU64,
    bytes_received: AtomicU64,
}

impl IpGroup {
    /// Opens a socket for `group`, joined on `interface` (must run inside a tokio runtime).
    pub fn join(
        group: SocketAddrV4,
        interface: Ipv4Addr,
        ttl: u32,
        recv_buffer: usize,
    ) -> Result<IpGroup, TransportError> {
        let io = |op: &'static str| {
            move |e: std::io::Error| TransportError::Io {
                op,
                message: format!("{e} (group {group}, interface {interface})"),
            }
        };
        let socket = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP))
            .map_err(io("multicast socket"))?;
        socket
            .set_reuse_address(true)
            .map_err(io("multicast SO_REUSEADDR"))?;
        socket
            .set_reuse_port(true)
            .map_err(io("multicast SO_REUSEPORT"))?;
        crate::udp::socket::set_buffers(&socket, recv_buffer);
        socket
            .bind(&SocketAddr::V4(group).into())
            .map_err(io("multicast bind"))?;
        socket
            .set_multicast_all_v4(false)
            .map_err(io("multicast IP_MULTICAST_ALL"))?;
        socket
            .join_multicast_v4(group.ip(), &interface)
            .map_err(io("multicast join"))?;
        socket
            .set_multicast_if_v4(&interface)
            .map_err(io("multicast IP_MULTICAST_IF"))?;
        socket
            .set_multicast_loop_v4(true)
            .map_err(io("multicast IP_MULTICAST_LOOP"))?;
        socket
            .set_multicast_ttl_v4(ttl)
            .map_err(io("multicast IP_MULTICAST_TTL"))?;
        socket
            .set_nonblocking(true)
            .map_err(io("multicast non-blocking"))?;
        let raw = socket
            .try_clone()
            .map_err(io("multicast socket clone"))?
            .into();
        let socket = UdpSocket::from_std(socket.into()).map_err(io("multicast tokio socket"))?;
        Ok(IpGroup {
            socket,
            raw,
            group,
            recv_buf: std::sync::Mutex::new(BytesMut::new()),
            datagrams_sent: AtomicU64::new(0),
            bytes_sent: AtomicU64::new(0),
            send_dropped: AtomicU64::new(0),
            datagrams_received: AtomicU64::new(0),
            bytes_received: AtomicU64::new(0),
        })
    }

    /// The group's address.
    pub fn address(&self) -> SocketAddrV4 {
        self.group
    }
}

impl MulticastGroup for IpGroup {
    fn send(&self, datagram: &[u8]) -> Result<(), TransportError> {
        match self.raw.send_to(datagram, SocketAddr::V4(self.group)) {
            Ok(_) => {
                self.datagrams_sent.fetch_add(1, Ordering::Relaxed);
                self.bytes_sent
                    .fetch_add(datagram.len() as u64, Ordering::Relaxed);
                Ok(())
            }
            // A full send buffer (or a transient ENOBUFS) is a lost datagram, as on the wire.
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.raw_os_error() == Some(libc::ENOBUFS) =>
            {
                self.send_dropped.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => Err(TransportError::Io {
                op: "multicast send",
                message: format!("{e} (group {})", self.group),
            }),
        }
    }

    fn drain(&self, out: &mut Vec<Bytes>, max: usize) -> Result<usize, TransportError> {
        let mut buf = self.recv_buf.lock().unwrap_or_else(|p| p.into_inner());
        let mut n = 0;
        while n < max {
            // `buf` holds initialised bytes to receive into; datagrams are split off its front.
            if buf.len() < MAX_UDP_PAYLOAD {
                *buf = BytesMut::zeroed(RECV_CHUNK);
            }
            match self.raw.recv_from(&mut buf[..]) {
                Ok((len, _from)) => {
                    let datagram = buf.split_to(len).freeze();
                    self.datagrams_received.fetch_add(1, Ordering::Relaxed);
                    self.bytes_received.fetch_add(len as u64, Ordering::Relaxed);
                    out.push(datagram);
                    n += 1;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    return Err(TransportError::Io {
                        op: "multicast receive",
                        message: format!("{e} (group {})", self.group),
                    });
                }
            }
        }
        Ok(n)
    }

    fn poll_readable(&self, cx: &mut Context<'_>) -> Poll<()> {
        // A peek clears tokio's readiness when nothing is there (receives go around tokio),
        // so this never reports old events again and again.
        self.socket.poll_peek_sender(cx).map(|_| ())
    }

    fn max_datagram(&self) -> usize {
        MAX_UDP_PAYLOAD
    }

    fn stats(&self) -> MulticastCounters {
        MulticastCounters {
            datagrams_sent: self.datagrams_sent.load(Ordering::Relaxed),
            bytes_sent: self.bytes_sent.load(Ordering::Relaxed),
            send_dropped: self.send_dropped.load(Ordering::Relaxed),
            datagrams_received: self.datagrams_received.load(Ordering::Relaxed),
            bytes_received: self.bytes_received.load(Ordering::Relaxed),
            faults_injected: 0,
        }
    }
}

#[cfg(test)]
mod tests;
