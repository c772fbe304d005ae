//! The [`Carrier`] trait: unreliable datagrams over one or more routes, beneath the reliability
//! layer.
//!
//! A [`Transport`](crate::transport::Transport) moves whole [`Frame`](crate::frame::Frame)s and
//! says what it guarantees. A carrier is one level lower: it moves opaque byte datagrams to a
//! world rank over a numbered *route* (one UDP socket bound to one local address or adapter, say)
//! and guarantees nothing — datagrams may be lost, duplicated, reordered or corrupted. The link
//! transport (`rankweave_transports::link`) turns a carrier into a transport by running a
//! [`ReliableLink`](crate::reliability::ReliableLink) per peer over it (or, with reliability off,
//! by framing each frame in one raw datagram). Fault injection (`ChaosCarrier`) is a carrier
//! decorator, so it corrupts bytes *after* the CRC was computed, as a real wire would.
//!
//! Routes are numbered `0..routes()`; route `r` of this rank talks to route `r` of every peer.

use std::task::{Context, Poll};

use bytes::Bytes;

use crate::error::TransportError;

/// A datagram a carrier received.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Datagram {
    /// The route it arrived on.
    pub route: usize,
    /// The world rank the carrier knows it came from (by its address), or `None` when the sender
    /// is not a known peer of this job: such datagrams are dropped and counted as foreign.
    pub from: Option<u32>,
    /// The bytes, as received.
    pub bytes: Bytes,
}

/// Moves unreliable datagrams for one rank over one or more routes.
///
/// Implementations never block: `send` hands off or fails, `recv` takes what is there.
pub trait Carrier: Send + Sync + 'static {
    /// Number of routes (at least 1).
    fn routes(&self) -> usize;

    /// The largest datagram, in bytes, that `send` accepts.
    fn max_datagram(&self) -> usize;

    /// Sends one datagram, the concatenation of `parts`, to world rank `to` over `route`.
    ///
    /// Errors: [`TransportError::PeerUnreachable`] for an unknown peer or route, [`TransportError::Closed`] after `close`,, and
    /// [`TransportError::Io`] when the route refused it (callers treat that like a loss).
    fn send(&self, route: usize, to: u32, parts: &[&[u8]]) -> Result<(), TransportError>;

    /// Sends one datagram, `parts` followed by `held`, like [`send`](Self::send), where the
    /// caller keeps `held` allocated and unchanged until the peer has received the datagram
    /// (the reliability layer holds a DATA payload until it is acknowledged).
    ///
    /// A carrier may then pass `held` to the kernel by reference instead of copying it (UDP:
    /// `vmsplice` and `splice`), which makes the copy into the kernel, the sender's largest
    /// cost for large messages, go away. Should the bytes change anyway, they arrive changed,
    /// and the payload CRC rejects them. The default sends the parts and `held` gathered.
    fn send_held(
        &self,
        route: usize,
        to: u32,
        parts: &[&[u8]],
        held: &[u8],
    ) -> Result<(), TransportError> {
        match *parts {
            [] => self.send(route, to, &[held]),
            [a] => self.send(route, to, &[a, held]),
            [a, b] => self.send(route, to, &[a, b, held]),
            [a, b, c] => self.send(route, to, &[a, b, c, held]),
            _ => {
                let mut all = parts.to_vec();
                all.push(held);
                self.send(route, to, &all)
            }
        }
    }

    /// Appends every datagram that has arrived to `out`; returns how many were added.
    fn recv(&self, out: &mut Vec<Datagram>) -> Result<usize, TransportError>;

    /// Like [`recv`](Self::recv), but may stop once it has added `max` datagrams (at least 1);
    /// returns how many it added and whether it stopped before finding every route empty
    /// (`true`: more may be waiting).
    ///
    /// For carriers that need a system call to learn that a route is empty (UDP: a `recvfrom`
    /// that would block), so that a busy poller that has just received its datagram does not
    /// pay one more call, on the critical path of every message, to find nothing behind it.
    /// The default reads everything and reports nothing left.
    fn recv_up_to(
        &self,
        out: &mut Vec<Datagram>,
        max: usize,
    ) -> Result<(usize, bool), TransportError> {
        let _ = max;
        self.recv(out).map(|n| (n, false))
    }

    /// Registers the task to be woken when a datagram may have arrived; `Ready` if one already
    /// has (a `Ready` may be spurious: `recv` then finds nothing).
    fn poll_recv_ready(&self, cx: &mut Context<'_>) -> Poll<()>;

    /// This rank is going away: release the routes (datagrams sent later are dropped).
    fn close(&self) {}
}
