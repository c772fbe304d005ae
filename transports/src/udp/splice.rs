//! Sending a large payload by reference: `vmsplice` the payload's pages into a pipe, then
//! `splice` the pipe into the socket behind a corked header.
//!
//! A plain `sendmsg` copies every byte into kernel buffers, and on this kind of machine that
//! copy is the sender's bottleneck for large messages (about half its time at 1 MiB). With
//! `vmsplice` the pipe takes references to the payload's pages and `splice` hands them on to
//! the datagram, so the bytes are copied once, by the receiver's `recvmsg`, straight out of the
//! sender's memory (over loopback) or read by the adapter (on a network).
//!
//! The price is that the kernel reads the payload *after* the send returns, so the payload
//! must stay as it is until the datagram has been received. The reliability layer guarantees
//! that for DATA: it holds the payload in its retransmit queue until it is acknowledged, and
//! an acknowledgement is sent only once the datagram was read. Should the memory still change
//! (a stale duplicate read after the buffer was freed and reused), the payload CRC rejects the
//! datagram. Raw frames (reliability off) carry no payload CRC and are never spliced.
//!
//! One datagram takes three system calls (`vmsplice`, `sendmsg` with `MSG_MORE`, `splice`)
//! instead of one, so only payloads of at least [`SPLICE_MIN`] bytes go this way, and only
//! those that fit a segmentation-offload datagram ([`segmentable`]).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Payloads at least this long are spliced; shorter ones are cheaper to copy than the two
/// extra system calls (measured over loopback: even at 16 KiB, ahead at 32 KiB).
pub const SPLICE_MIN: usize = 32 * 1024;

/// Pipe capacity: a 64 KiB payload at any alignment spans 17 pages, more than a default pipe
/// (16 pages) holds.
const PIPE_BYTES: libc::c_int = 128 * 1024;

/// A pipe through which payload pages pass to a socket by reference.
#[derive(Debug)]
pub struct SplicePipe {
    read: OwnedFd,
    write: OwnedFd,
}

/// Why a spliced send did not happen.
#[derive(Debug)]
pub enum SpliceError {
    /// Nothing was sent and the pipe is empty: send the datagram the ordinary way (the payload
    /// could not be spliced, e.g. memory `vmsplice` cannot reference).
    Unsupported(io::Error),
    /// The send failed part-way; the pipe may hold pages and must be dropped. The datagram is
    /// lost (the reliability layer treats it like any loss).
    Failed(io::Error),
}

impl SplicePipe {
    /// A non-blocking pipe large enough for one datagram's payload.
    pub fn new() -> io::Result<SplicePipe> {
        let mut fds: [RawFd; 2] = [-1; 2];
        // SAFETY: `pipe2` writes two descriptors into the two-element array on success.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: both descriptors were just created by `pipe2` and nothing else owns them.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // SAFETY: `fcntl(F_SETPIPE_SZ)` on a pipe descriptor we own; failure only returns -1.
        if unsafe { libc::fcntl(write.as_raw_fd(), libc::F_SETPIPE_SZ, PIPE_BYTES) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(SplicePipe { read, write })
    }

    /// Sends one datagram, `head` (copied, corked with `MSG_MORE` as a one-segment
    /// segmentation-offload datagram) followed by `payload` (by reference), to `to` over
    /// `socket`. `payload` must be [`segmentable`].
    ///
    /// `payload` must stay unchanged until the datagram has been received (see the module
    /// documentation); the caller must not send anything else on `socket` meanwhile (a corked
    /// datagram would swallow it).
    pub fn send(
        &self,
        socket: &socket2::SockRef<'_>,
        head: &[io::IoSlice<'_>],
        payload: &[u8],
        to: Option<&socket2::SockAddr>,
    ) -> Result<(), SpliceError> {
        let iov = libc::iovec {
            iov_base: payload.as_ptr().cast_mut().cast(),
            iov_len: payload.len(),
        };
        // SAFETY: `iov` describes `payload`, readable for the duration of the call; without
        // SPLICE_F_GIFT the kernel only takes references to the pages and never writes them.
        // (That it reads them later is the contract above, not a memory-safety matter.)
        let moved = unsafe { libc::vmsplice(self.write.as_raw_fd(), &iov, 1, 0) };
        if moved < 0 {
            return Err(SpliceError::Unsupported(io::Error::last_os_error()));
        }
        if moved as usize != payload.len() {
            return Err(SpliceError::Failed(io::Error::new(
                io::ErrorKind::WriteZero,
                format!("vmsplice took {moved} of {} bytes", payload.len()),
            )));
        }
        // A failed corked send discards the pending datagram (the kernel flushes it on error).
        let len = head.iter().map(|h| h.len()).sum::<usize>() + payload.len();
        let control = SegmentControl::new(len);
        let msg = socket2::MsgHdr::new()
            .with_buffers(head)
            .with_control(control.as_bytes());
        let msg = match to {
            Some(to) => msg.with_addr(to),
            None => msg, // a connected socket
        };
        socket
            .sendmsg(&msg, libc::MSG_MORE)
            .map_err(SpliceError::Failed)?;
        let mut left = payload.len();
        while left > 0 {
            // SAFETY: both descriptors are open and owned (the pipe here, the socket by the
            // caller); null offsets mean "current position", as pipes and sockets require.
            let n = unsafe {
                libc::splice(
                    self.read.as_raw_fd(),
                    std::ptr::null_mut(),
                    socket.as_raw_fd(),
                    std::ptr::null_mut(),
                    left,
                    libc::SPLICE_F_NONBLOCK,
                )
            };
            if n <= 0 {
                let e = if n < 0 {
                    io::Error::last_os_error()
                } else {
                    io::Error::new(io::ErrorKind::UnexpectedEof, "splice moved nothing")
                };
                uncork(socket);
                return Err(SpliceError::Failed(e));
            }
            left -= n as usize;
        }
        Ok(())
    }
}

/// Whether this `payload` can be spliced: corked as a segmentation-offload (GSO) datagram of
/// one segment.
///
/// A plainly corked datagram (`MSG_MORE`) is checksummed in software while its pages are
/// appended (the kernel leaves a checksum to the adapter only for a datagram sent in one
/// call), a pass over every payload byte on the sender, and another on the receiver to check
/// it; and with spliced pages that sum was seen to come out wrong now and then (odd lengths,
/// under load: the receiver's kernel dropped the datagram, `UdpInCsumErrors`). Declaring the
/// datagram a GSO datagram whose one segment is the whole of it (a `UDP_SEGMENT` control
/// message) lets the kernel leave the checksum to the adapter (over loopback: to nobody), so
/// only such datagrams are spliced. One must fit a socket buffer's fragment slots
/// (`MAX_SKB_FRAGS`, 17 by default): the corked header may take two, so the payload may span
/// at most [`SEGMENT_MAX_PAGES`] pages. The UDP carrier's default datagram size is chosen so
/// that a DATA fragment's payload always does; longer payloads are copied.
pub fn segmentable(payload: &[u8]) -> bool {
    let start = payload.as_ptr() as usize;
    let pages = (start + payload.len()).div_ceil(PAGE) - start / PAGE;
    pages <= SEGMENT_MAX_PAGES
}

/// The page size the span of [`segmentable`] is counted in (the smallest Linux uses; a larger
/// one only makes the count an overestimate).
const PAGE: usize = 4096;

/// The most pages a segmented datagram's payload may span.
pub const SEGMENT_MAX_PAGES: usize = 15;

/// A `UDP_SEGMENT` control message: segments of `size` bytes.
#[repr(C)]
struct SegmentControl {
    header: libc::cmsghdr,
    size: u16,
    padding: [u8; 6],
}

impl SegmentControl {
    fn new(size: usize) -> SegmentControl {
        // SAFETY: an all-zero `cmsghdr` is a valid value (integers only).
        let mut header: libc::cmsghdr = unsafe { std::mem::zeroed() };
        header.cmsg_level = libc::SOL_UDP;
        header.cmsg_type = libc::UDP_SEGMENT;
        // SAFETY: CMSG_LEN only computes a length.
        header.cmsg_len = unsafe { libc::CMSG_LEN(std::mem::size_of::<u16>() as u32) } as _;
        SegmentControl {
            header,
            size: u16::try_from(size).unwrap_or(u16::MAX),
            padding: [0; 6],
        }
    }

    fn as_bytes(&self) -> &[u8] {
        // SAFETY: `SegmentControl` is `repr(C)` with every byte initialised (the explicit
        // padding fills it to CMSG_SPACE(2)), so viewing it as bytes for its lifetime is sound.
        unsafe {
            std::slice::from_raw_parts(
                (self as *const SegmentControl).cast::<u8>(),
                std::mem::size_of::<SegmentControl>(),
            )
        }
    }
}

/// Pushes out whatever is still corked on `socket`, so that a datagram left half-built by a
/// failed splice does not swallow the next send (the receiver drops the short datagram and
/// counts it as malformed).
fn uncork(socket: &socket2::SockRef<'_>) {
    let off: libc::c_int = 0;
    // SAFETY: setsockopt reads `size_of::<c_int>()` bytes from a valid `c_int`, on a socket
    // the caller owns; failure only returns an error code.
    unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_UDP,
            libc::UDP_CORK,
            (&raw const off).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}
