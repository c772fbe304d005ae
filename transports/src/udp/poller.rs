//! [`ReadyPoller`]: which of a carrier's sockets have datagrams waiting, in one system call.
//!
//! A carrier has a route socket per route and a lane per peer it talks to (see the `socket`
//! module). Trying a receive on each of them on every busy poll would cost one system call per
//! socket even when nothing came; a level-triggered epoll set answers for all of them at once
//! (measured: a 1-byte ping-pong over a lane and its route socket is as fast through one
//! `epoll_wait` as by receiving on the lane alone). The epoll descriptor is itself readable
//! while a member is, so the tokio reactor watches it, instead of every socket, for a parked
//! progress task.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::task::{Context, Poll};

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// A level-triggered epoll set of sockets, each known by a token.
#[derive(Debug)]
pub(crate) struct ReadyPoller {
    epoll: AsyncFd<OwnedFd>,
}

impl ReadyPoller {
    /// An empty set, registered with the current tokio runtime's reactor.
    pub(crate) fn new() -> io::Result<ReadyPoller> {
        // SAFETY: epoll_create1 takes no pointers; it returns a new descriptor or -1.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by epoll_create1, is open, and nothing else owns it.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: the `OwnedFd` keeps the epoll descriptor open, unchanged, for as long as the
        // `AsyncFd` that owns it exists.
        let epoll = unsafe { AsyncFd::register_with_interest(owned, Interest::READABLE)? };
        Ok(ReadyPoller { epoll })
    }

    fn ctl(&self, op: libc::c_int, fd: RawFd, token: u64) -> io::Result<()> {
        let mut event = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: token,
        };
        // SAFETY: `event` is a valid epoll_event for the duration of the call (the kernel
        // copies it); a bad descriptor only makes the call fail.
        let r = unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), op, fd, &raw mut event) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Watches `fd` (a socket that outlives its membership) under `token`.
    pub(crate) fn add(&self, fd: RawFd, token: u64) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_ADD, fd, token)
    }

    /// Stops watching `fd`.
    pub(crate) fn remove(&self, fd: RawFd) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_DEL, fd, 0)
    }

    /// Fills `tokens` with those of sockets that have a datagram waiting, without blocking;
    /// returns how many. As many as `tokens` holds means there may be more.
    pub(crate) fn ready(&self, tokens: &mut [u64]) -> io::Result<usize> {
        const MAX: usize = 16;
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; MAX];
        let max = tokens.len().min(MAX);
        loop {
            // SAFETY: `events` has room for `max` entries, which is what the kernel may write.
            let n = unsafe {
                libc::epoll_wait(
                    self.epoll.as_raw_fd(),
                    events.as_mut_ptr(),
                    max as libc::c_int,
                    0,
                )
            };
            if n >= 0 {
                let n = n as usize;
                for (t, e) in tokens.iter_mut().zip(&events[..n]) {
                    *t = e.u64;
                }
                return Ok(n);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    /// `Ready` if some socket has a datagram waiting; otherwise registers the waker with the
    /// reactor, which wakes it when one arrives.
    pub(crate) fn poll_ready(&self, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            let mut guard = match self.epoll.poll_read_ready(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(guard)) => guard,
                // The reactor is gone (runtime shutting down): let the caller look.
                Poll::Ready(Err(_)) => return Poll::Ready(()),
            };
            let mut one = [0u64; 1];
            match self.ready(&mut one) {
                Ok(0) => {
                    // Stale: clear it (a datagram that came meanwhile raised a newer event,
                    // which this does not clear) and poll again to register the waker.
                    guard.clear_ready();
                }
                _ => return Poll::Ready(()),
            }
        }
    }
}
