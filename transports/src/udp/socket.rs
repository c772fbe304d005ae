//! One route's socket: set-up, gathered and spliced sends, receives into caller buffers.
//!
//! A route has one socket bound to its address (the *route socket*) and, per peer it talks to,
//! possibly a *lane*: a socket bound to the same address and port (`SO_REUSEPORT`) and
//! connected to that peer's route. The kernel hands a datagram to the socket that matches it
//! best, so everything that peer sends arrives on its lane, found by the connection lookup
//! before routing (early demultiplexing); sends on a lane name no address, so the kernel uses
//! the route it keeps for the connection instead of looking one up per datagram. Measured
//! here, a plain busy-polling 1-byte ping-pong takes 3.15 µs one way between connected
//! sockets and 4.08 µs between unconnected ones (the book's "Lanes" section). Datagrams from
//! anyone else (a peer without a lane yet, a stranger) still arrive on the route socket.

use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};

use rankweave_core::TransportError;
use socket2::{Domain, Protocol, SockAddr, SockRef, Socket, Type};

use super::splice::{SPLICE_MIN, SpliceError, SplicePipe, segmentable};

/// A non-blocking UDP socket: a route socket or a lane (a socket connected to one peer's
/// route, sharing the route socket's port). Sends and receives are direct system calls;
/// readiness is watched by the carrier's epoll set, not per socket.
#[derive(Debug)]
pub struct RouteSocket {
    socket: Socket,
    local: SocketAddr,
    /// The peer a lane is connected to: sends to it go without an address, so the kernel
    /// uses the route it keeps for the connection instead of looking one up per datagram.
    connected: Option<SocketAddr>,
    splicing: std::sync::Mutex<Pipe>,
}

fn io_error(op: &'static str, e: io::Error) -> TransportError {
    TransportError::Io {
        op,
        message: e.to_string(),
    }
}

impl RouteSocket {
    /// Binds a route socket at `addr` (port 0: an ephemeral port) with `buffer` bytes of
    /// kernel send and receive buffer (forced past the system limit when permitted).
    pub fn bind(addr: SocketAddr, buffer: usize) -> Result<RouteSocket, TransportError> {
        let socket = new_socket(addr, buffer)?;
        socket
            .bind(&SockAddr::from(addr))
            .map_err(|e| io_error("bind UDP socket", e))?;
        // Lanes join this port later. Allowed only now that the port is chosen: a socket that
        // asks for an ephemeral port with `SO_REUSEPORT` already set may be given a port whose
        // holders all have it set too (same user), and would then share this one.
        socket
            .set_reuse_port(true)
            .map_err(|e| io_error("set SO_REUSEPORT", e))?;
        let local = RouteSocket::finish(socket)?;
        if let Err(e) = steer_unconnected_to_first(local.local) {
            tracing::debug!(error = %e, "no reuseport program: a lane being opened may catch a stray datagram");
        }
        Ok(local)
    }

    /// A lane: a socket bound to `local` (a route socket's address) and connected to `peer`,
    /// which then receives every datagram `peer` sends to `local`.
    pub fn lane(
        local: SocketAddr,
        peer: SocketAddr,
        buffer: usize,
    ) -> Result<RouteSocket, TransportError> {
        let socket = new_socket(local, buffer)?;
        socket
            .set_reuse_port(true)
            .map_err(|e| io_error("set SO_REUSEPORT", e))?;
        socket
            .bind(&SockAddr::from(local))
            .map_err(|e| io_error("bind UDP lane", e))?;
        socket
            .connect(&SockAddr::from(peer))
            .map_err(|e| io_error("connect UDP lane", e))?;
        let mut lane = RouteSocket::finish(socket)?;
        lane.connected = Some(peer);
        Ok(lane)
    }

    fn finish(socket: Socket) -> Result<RouteSocket, TransportError> {
        let local = socket
            .local_addr()
            .ok()
            .and_then(|a| a.as_socket())
            .ok_or_else(|| io_error("read UDP socket address", io::ErrorKind::Other.into()))?;
        Ok(RouteSocket {
            socket,
            local,
            connected: None,
            splicing: std::sync::Mutex::new(Pipe::Untried),
        })
    }

    /// The address to put on a datagram to `to`: none if this is a lane connected to it.
    fn address_for<'a>(&self, to: &'a SockAddr) -> Option<&'a SockAddr> {
        (self.connected.is_none() || self.connected != to.as_socket()).then_some(to)
    }

    /// Whether this is a lane connected to `addr`.
    pub(crate) fn is_connected_to(&self, addr: SocketAddr) -> bool {
        self.connected == Some(addr)
    }

    /// The descriptor, for the readiness poller.
    pub(crate) fn raw_fd(&self) -> RawFd {
        self.socket.as_raw_fd()
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Sends one datagram made of `parts` to `to`. A full socket buffer is reported as an
    /// [`Io`](TransportError::Io) error (the reliability layer treats it as a loss).
    pub fn send_to(&self, parts: &[&[u8]], to: SocketAddr) -> Result<(), TransportError> {
        let _sending = self.lock_sending();
        self.send_gathered(parts, None, to)
    }

    /// Sends one datagram, `parts` followed by `held`, to `to`, where the caller keeps `held`
    /// unchanged until the datagram has been received: a `held` of at least 32 KiB
    /// goes by reference (`vmsplice` and `splice`), without the kernel copying it.
    pub fn send_to_held(
        &self,
        parts: &[&[u8]],
        held: &[u8],
        to: SocketAddr,
    ) -> Result<(), TransportError> {
        let mut sending = self.lock_sending();
        if held.len() >= SPLICE_MIN {
            if let Pipe::Untried = *sending {
                *sending = match SplicePipe::new() {
                    // Over IPv6 a spliced datagram that needs fragmenting (longer than the
                    // loopback MTU with its 48 header bytes) was seen to vanish: copy there.
                    _ if !self.local.is_ipv4() => Pipe::Off,
                    Ok(pipe) => Pipe::Ready(pipe),
                    Err(e) => {
                        tracing::debug!(error = %e, "no splice pipe: large payloads are copied");
                        Pipe::Off
                    }
                };
            }
            if let (Pipe::Ready(pipe), true) = (&*sending, segmentable(held)) {
                let sent = with_io_slices(parts, None, |head| {
                    let socket = SockRef::from(&self.socket);
                    let to = SockAddr::from(to);
                    pipe.send(&socket, head, held, self.address_for(&to))
                });
                match sent {
                    Ok(()) => return Ok(()),
                    Err(SpliceError::Unsupported(e)) => {
                        tracing::debug!(error = %e, "vmsplice refused: large payloads are copied");
                        *sending = Pipe::Off;
                    }
                    Err(SpliceError::Failed(e)) => {
                        // The pipe may still hold pages: start the next one afresh. A path MTU
                        // below the datagram, or a kernel without UDP segmentation offload,
                        // refuses every spliced datagram: copy from now on.
                        *sending = if segmentation_refused(&e) {
                            tracing::debug!(error = %e, "no segmentation offload: large payloads are copied");
                            Pipe::Off
                        } else {
                            Pipe::Untried
                        };
                        return Err(io_error("UDP send (spliced)", e));
                    }
                }
            }
        }
        self.send_gathered(parts, Some(held), to)
    }

    /// Whether large held payloads are being spliced (a pipe is set up and working).
    #[cfg(test)]
    pub(crate) fn splices(&self) -> bool {
        matches!(*self.lock_sending(), Pipe::Ready(_))
    }

    /// Holds the socket's send side: a spliced datagram is built by several system calls, and
    /// nothing else may be sent on the socket in between.
    fn lock_sending(&self) -> std::sync::MutexGuard<'_, Pipe> {
        self.splicing.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn send_gathered(
        &self,
        parts: &[&[u8]],
        last: Option<&[u8]>,
        to: SocketAddr,
    ) -> Result<(), TransportError> {
        with_io_slices(parts, last, |bufs| {
            let socket = SockRef::from(&self.socket);
            if self.connected == Some(to) {
                socket.send_vectored(bufs)
            } else {
                socket.send_to_vectored(bufs, &SockAddr::from(to))
            }
        })
        .map(|_| ())
        .map_err(|e| io_error("UDP send", e))
    }

    /// Receives one datagram into the spare capacity of `buf` (cleared first; at most `cap`
    /// bytes, which `buf` must have room for), returning its length and sender, or `None` when
    /// nothing is waiting.
    pub fn recv_into(
        &self,
        buf: &mut Vec<u8>,
        cap: usize,
    ) -> Result<Option<(usize, SocketAddr)>, TransportError> {
        buf.clear();
        buf.reserve(cap);
        loop {
            let spare = &mut buf.spare_capacity_mut()[..cap];
            let socket = SockRef::from(&self.socket);
            // A lane hears only from its peer: no need to have the kernel write the address.
            let received = match self.connected {
                Some(peer) => socket.recv(spare).map(|n| (n, SockAddr::from(peer))),
                None => socket.recv_from(spare),
            };
            match received {
                Ok((n, from)) => {
                    // SAFETY: `recv`/`recv_from` initialised the first `n` bytes of the spare
                    // capacity, and `n <= cap <= spare capacity`.
                    unsafe { buf.set_len(n) };
                    let Some(from) = from.as_socket() else {
                        // Not an IP sender (cannot happen on a UDP socket): ignore it.
                        buf.clear();
                        continue;
                    };
                    return Ok(Some((n, from)));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                // ICMP errors of earlier sends (port unreachable from a peer that is gone) are
                // reported on a later receive; they say nothing about this one.
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => continue,
                Err(e) => return Err(io_error("UDP receive", e)),
            }
        }
    }
}

/// Calls `f` with `parts` (and `last`, if any) as `IoSlice`s, without allocating for the usual
/// few parts.
fn with_io_slices<R>(
    parts: &[&[u8]],
    last: Option<&[u8]>,
    f: impl FnOnce(&[IoSlice<'_>]) -> R,
) -> R {
    let all = parts.iter().copied().chain(last);
    let n = parts.len() + usize::from(last.is_some());
    let mut slices = [IoSlice::new(&[]); 5];
    if n <= slices.len() {
        for (s, p) in slices.iter_mut().zip(all) {
            *s = IoSlice::new(p);
        }
        f(&slices[..n])
    } else {
        f(&all.map(IoSlice::new).collect::<Vec<_>>())
    }
}

/// Whether a failed spliced send says segmentation offload cannot be used on this socket
/// (`EMSGSIZE`: a segment longer than the path MTU; `EINVAL`/`EIO`/`ENOPROTOOPT`: refused).
fn segmentation_refused(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMSGSIZE | libc::EINVAL | libc::EIO | libc::ENOPROTOOPT)
    )
}

/// The pipe large held payloads are spliced through.
#[derive(Debug)]
enum Pipe {
    /// Not yet needed (or the last pipe was dropped after a failure).
    Untried,
    /// Splicing through this pipe.
    Ready(SplicePipe),
    /// Not available here: large payloads are copied.
    Off,
}

/// A non-blocking UDP socket for `addr`'s family with `buffer`-byte kernel buffers.
/// Makes the kernel give every datagram that no connected lane matches to the route socket
/// bound at `local`, however many sockets share its port.
///
/// A lane is bound to the port before it is connected; in between it is one more unconnected
/// socket of the port's `SO_REUSEPORT` group, and the kernel spreads datagrams over those by
/// a hash of their addresses. A datagram from another peer could land in the half-made lane,
/// be read as the lane's peer's and be dropped as foreign: a lost message without the
/// reliability layer (it hung 1 in ~200 runs of a 3-rank test). A reuseport program that
/// always answers "the first socket" (the route socket: it made the group) closes that gap;
/// connected lanes still win on their better match. The group is made here, by binding a
/// placeholder socket to the port while no peer knows it yet, and outlives the placeholder.
fn steer_unconnected_to_first(local: SocketAddr) -> io::Result<()> {
    let placeholder = Socket::new(Domain::for_address(local), Type::DGRAM, Some(Protocol::UDP))?;
    placeholder.set_reuse_port(true)?;
    placeholder.bind(&SockAddr::from(local))?;
    // `ret #0`: socket index 0 of the group.
    let mut code = [libc::sock_filter {
        code: (libc::BPF_RET | libc::BPF_K) as u16,
        jt: 0,
        jf: 0,
        k: 0,
    }];
    let prog = libc::sock_fprog {
        len: code.len() as u16,
        filter: code.as_mut_ptr(),
    };
    // SAFETY: `prog` points at `code`, one valid classic BPF instruction, both alive for the
    // call; the kernel copies the program. A refusal only returns an error code.
    let r = unsafe {
        libc::setsockopt(
            placeholder.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_ATTACH_REUSEPORT_CBPF,
            (&raw const prog).cast(),
            std::mem::size_of::<libc::sock_fprog>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn new_socket(addr: SocketAddr, buffer: usize) -> Result<Socket, TransportError> {
    let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))
        .map_err(|e| io_error("create UDP socket", e))?;
    socket
        .set_nonblocking(true)
        .map_err(|e| io_error("set UDP socket non-blocking", e))?;
    set_buffers(&socket, buffer);
    Ok(socket)
}

/// Asks for `size`-byte kernel buffers, first past the system limits (root only), then within.
pub(crate) fn set_buffers(socket: &Socket, size: usize) {
    let size_c = libc::c_int::try_from(size).unwrap_or(libc::c_int::MAX);
    for (force, normal) in [
        (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF),
        (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF),
    ] {
        // SAFETY: setsockopt reads `size_of::<c_int>()` bytes from a valid `c_int` on a socket
        // descriptor we own; failure only returns an error code.
        let forced = unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                force,
                (&raw const size_c).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        } == 0;
        if !forced {
            let r = if normal == libc::SO_RCVBUF {
                socket.set_recv_buffer_size(size)
            } else {
                socket.set_send_buffer_size(size)
            };
            if let Err(e) = r {
                tracing::debug!(error = %e, "could not set UDP socket buffer size");
            }
        }
    }
}
