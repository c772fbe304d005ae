//! Arenas: a window of shared memory per rank that the rank writes and the other ranks of its
//! host read with plain loads.
//!
//! A collective that exposes a buffer to its peers' reads ([`Transport::read_peer_memory`],
//! `process_vm_readv`) has to copy the caller's input first anyway: the caller may reuse its
//! slice once the call returns. Copied into the arena instead of a private vector, the input
//! is in memory the peers have mapped: they combine it straight from there and copy results
//! out of it with ordinary loads — no system call, no pinning of pages, and no scratch copy
//! before a combine (on this machine a 512 KiB read of a peer's freshly written data took
//! 35 µs by `memcpy` from shared memory against 46 µs by `process_vm_readv`).
//!
//! One user at a time holds a rank's arena, through an [`ArenaLease`] taken without waiting:
//! a collective that finds it taken (another one in flight) copies into private memory and is
//! read the old way. What the peers read, and when, is the collective's protocol: the
//! arena only gives the memory.
//!
//! [`Transport::read_peer_memory`]: crate::Transport::read_peer_memory

use std::ops::Range;
use std::ptr::NonNull;
use std::sync::Arc;

/// What keeps an arena mapped and takes its lease back (the transport that owns it).
pub trait ArenaHolder: Send + Sync {
    /// The lease on the arena ended: the next [`Transport::lease_arena`] may have it.
    ///
    /// [`Transport::lease_arena`]: crate::Transport::lease_arena
    fn release(&self);
}

/// This rank's arena, held by one user: it may write the bytes, which the other local ranks
/// may read (see the [module docs](self)). Dropping it gives the arena back.
pub struct ArenaLease {
    ptr: NonNull<u8>,
    len: usize,
    holder: Arc<dyn ArenaHolder>,
}

// SAFETY: the lease is the only handle in this process through which the arena's bytes are
// written (the holder hands out one at a time), and the memory stays mapped while `holder`
// lives; moving or sharing the handle between threads changes neither.
unsafe impl Send for ArenaLease {}
// SAFETY: as for `Send`: shared references only read.
unsafe impl Sync for ArenaLease {}

impl ArenaLease {
    /// The arena `[ptr, ptr + len)`, given back to `holder` on drop.
    ///
    /// # Safety
    ///
    /// The bytes must stay mapped, readable and writable while `holder` lives, and nothing else
    /// in this process may access them until the lease is dropped.
    pub unsafe fn new(ptr: NonNull<u8>, len: usize, holder: Arc<dyn ArenaHolder>) -> ArenaLease {
        ArenaLease { ptr, len, holder }
    }

    /// The arena's size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the arena has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where the arena is in this process's address space (for peers that read it with
    /// `process_vm_readv` because they have not mapped it).
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// The arena's bytes, to read.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: mapped and readable while the lease lives (`new`'s contract); peers only
        // read it, and writes in this process go through `&mut self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The arena's bytes, to write (say, before peers are told to read any of them).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: mapped and writable while the lease lives, and nothing else in this process
        // accesses it but peers' reads, which the user's protocol keeps off bytes it writes.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Bytes `range` of the arena, to write while peers may read others (the user's protocol
    /// says which), or `None` past its end. Only these bytes are borrowed: peers of this very
    /// process (ranks in one process) read the others through their own views meanwhile.
    pub fn range_mut(&mut self, range: Range<usize>) -> Option<&mut [u8]> {
        if range.start > range.end || range.end > self.len {
            return None;
        }
        // SAFETY: in bounds (checked) of memory mapped and writable while the lease lives;
        // nothing else in this process writes it, and readers keep off these bytes (above).
        Some(unsafe {
            std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(range.start), range.len())
        })
    }
}

impl Drop for ArenaLease {
    fn drop(&mut self) {
        self.holder.release();
    }
}

impl std::fmt::Debug for ArenaLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArenaLease")
            .field("addr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

/// Another rank's arena as this process mapped it: read-only.
pub struct PeerArena {
    ptr: NonNull<u8>,
    len: usize,
    _mapping: Arc<dyn Send + Sync>,
}

// SAFETY: a pointer into a mapping that `_mapping` keeps alive; it is only read, through the
// `unsafe` `bytes`, whose callers promise nobody writes what they read.
unsafe impl Send for PeerArena {}
// SAFETY: as for `Send`.
unsafe impl Sync for PeerArena {}

impl PeerArena {
    /// The arena `[ptr, ptr + len)`, kept mapped by `mapping`.
    ///
    /// # Safety
    ///
    /// The bytes must stay mapped and readable while `mapping` lives.
    pub unsafe fn new(ptr: NonNull<u8>, len: usize, mapping: Arc<dyn Send + Sync>) -> PeerArena {
        PeerArena {
            ptr,
            len,
            _mapping: mapping,
        }
    }

    /// The arena's size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the arena has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes `range` of the arena, or `None` past its end.
    ///
    /// # Safety
    ///
    /// The owner must not write these bytes while the slice lives, and must have written them
    /// before something this rank saw with acquire ordering (a message from it, say) said so.
    pub unsafe fn bytes(&self, range: Range<usize>) -> Option<&[u8]> {
        if range.start > range.end || range.end > self.len {
            return None;
        }
        // SAFETY: in bounds of a mapping that stays readable while `self` lives (`new`'s
        // contract); unchanged while the slice lives, by the caller's promise.
        Some(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(range.start), range.len()) })
    }
}

impl std::fmt::Debug for PeerArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerArena")
            .field("addr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// A holder that counts the leases given back.
    struct Returns(AtomicUsize);

    impl ArenaHolder for Returns {
        fn release(&self) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn a_lease_lends_what_is_asked_within_bounds_and_gives_the_arena_back() {
        let mut memory = vec![0u8; 64];
        let start = NonNull::new(memory.as_mut_ptr()).unwrap();
        let holder = Arc::new(Returns(AtomicUsize::new(0)));
        // SAFETY: `memory` outlives the lease and the view, and nothing else touches it.
        let mut lease = unsafe { ArenaLease::new(start, 64, holder.clone()) };
        assert_eq!((lease.len(), lease.addr()), (64, start.as_ptr() as u64));
        lease.range_mut(8..16).unwrap().fill(7);
        assert!(lease.range_mut(60..65).is_none());
        assert_eq!(lease.bytes()[6..18], [0, 0, 7, 7, 7, 7, 7, 7, 7, 7, 0, 0]);
        // SAFETY: as above.
        let view = unsafe { PeerArena::new(start, 64, Arc::new(())) };
        // SAFETY: nothing writes the arena while the view reads it.
        assert_eq!(unsafe { view.bytes(14..17) }, Some(&[7u8, 7, 0][..]));
        // SAFETY: as above (out of bounds: nothing is read).
        assert_eq!(unsafe { view.bytes(0..65) }, None);
        assert_eq!(holder.0.load(Ordering::Relaxed), 0);
        drop(lease);
        assert_eq!(
            holder.0.load(Ordering::Relaxed),
            1,
            "given back once, on drop"
        );
    }
}
