//! The wake-up signal of a parked rank: a datagram on its abstract Unix socket.
//!
//! A rank's progress task sleeps in tokio's reactor (epoll) on this socket when its doorbell is
//! armed; a producer that finds the doorbell armed sends one byte to it (see `doorbell.rs`).
//! UCX's shared-memory transport wakes its peers the same way. A futex would need a thread of
//! its own to block on (the progress engine is a task, and tasks must not block), and an
//! eventfd cannot be opened by an unrelated process without passing descriptors; a socket
//! in the abstract namespace has a name peers can compute (from the segment's nonce), wakes the task in
//! one kernel hand-off, and, having no file, is gone when the process is.

use std::io::ErrorKind;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::task::{Context, Poll};

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// The abstract socket address of the rank whose segment has nonce `nonce`.
pub(crate) fn address(nonce: u64) -> Result<SocketAddr, String> {
    SocketAddr::from_abstract_name(format!("rankweave.{nonce:016x}"))
        .map_err(|e| format!("signal address: {e}"))
}

/// A rank's signal socket: it receives wake-ups and sends them to peers.
#[derive(Debug)]
pub(crate) struct SignalSocket {
    socket: AsyncFd<UnixDatagram>,
}

impl SignalSocket {
    /// Binds the socket of the rank whose segment has nonce `nonce`. Must run inside a tokio
    /// runtime.
    pub(crate) fn bind(nonce: u64) -> Result<SignalSocket, String> {
        let addr = address(nonce)?;
        let socket =
            UnixDatagram::bind_addr(&addr).map_err(|e| format!("binding {addr:?}: {e}"))?;
        socket
            .set_nonblocking(true)
            .map_err(|e| format!("signal socket: {e}"))?;
        // SAFETY: the AsyncFd owns the socket, whose descriptor stays open and the same until
        // the AsyncFd is dropped.
        let socket = unsafe { AsyncFd::register_with_interest(socket, Interest::READABLE) }
            .map_err(|e| format!("signal socket: {e}"))?;
        Ok(SignalSocket { socket })
    }

    /// Wakes the rank at `to`. A full socket buffer means wake-ups are already pending there,
    /// and a missing socket means the rank is gone: neither is an error worth reporting.
    pub(crate) fn signal(&self, to: &SocketAddr) {
        let _ = self.socket.get_ref().send_to_addr(&[1], to);
    }

    /// Whether a signal waits unread (a snapshot for diagnostics; consumes nothing).
    pub(crate) fn is_pending(&self) -> bool {
        use std::os::fd::AsRawFd;
        let mut buf = [0u8; 1];
        // SAFETY: `buf` is valid for one byte's write; the descriptor is the open socket.
        let n = unsafe {
            libc::recv(
                self.socket.get_ref().as_raw_fd(),
                buf.as_mut_ptr().cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        n >= 0
    }

    /// `Ready` once a signal has arrived since the last `Ready` (the signals are consumed);
    /// otherwise registers `cx`'s waker with the reactor.
    pub(crate) fn poll_signalled(&self, cx: &mut Context<'_>) -> Poll<()> {
        let mut buf = [0u8; 16];
        loop {
            let mut guard = match self.socket.poll_read_ready(cx) {
                Poll::Ready(Ok(g)) => g,
                // The reactor failed: report readiness so the caller looks at its rings
                // rather than sleeping forever.
                Poll::Ready(Err(_)) => return Poll::Ready(()),
                Poll::Pending => return Poll::Pending,
            };
            let mut any = false;
            loop {
                match guard.get_inner().recv(&mut buf) {
                    Ok(_) => any = true,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        guard.clear_ready();
                        break;
                    }
                    // Not a wake-up, but not something to sleep on either: let the caller look.
                    Err(_) => return Poll::Ready(()),
                }
            }
            if any {
                return Poll::Ready(());
            }
        }
    }
}
