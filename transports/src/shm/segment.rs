//! A rank's shared-memory segment: what lives in it, creating it, and mapping a peer's.
//!
//! Every rank owns one segment, an anonymous `memfd` (no name in any file system, so nothing can
//! be left behind: the kernel frees it when the last process holding it exits, `kill -9`
//! included). It holds everything *other* local ranks write to this rank:
//!
//! | Offset              | Size             | What                                                       |
//! |---------------------|------------------|------------------------------------------------------------|
//! | 0                   | 64               | [`SegmentHeader`]: magic, version, owner, nonce, geometry   |
//! | 64                  | 64               | the owner's [`Doorbell`]                                   |
//! | 128                 | 64               | number of registered senders (`u32`)                       |
//! | 192                 | 4 × world, to 64 | registered senders, in registration order (rank + 1)       |
//! | `pairs`             | stride × world   | per possible sender: [`PairInfo`], [`SplitSlot`], [`FlagLine`], [`RingControl`], data |
//! | `arena`, to 4 KiB   | arena bytes      | the owner's arena: written by the owner, read by peers (`rankweave_core::arena`) |
//!
//! A peer maps the segment through `/proc/<owner pid>/fd/<fd>` (the owner publishes both) and
//! checks the header before trusting anything in it. The file is sized for every world rank,
//! but memory is only used for the rings that carry traffic: untouched pages of a `memfd` cost
//! nothing. Open MPI's shared-memory transport also gives every process a segment of its own;
//! one segment per rank means no leader, no election and no start-up barrier for it.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use super::doorbell::Doorbell;
use super::ring::{RingControl, RingGeometry, RingKey};
use super::split_copy::SplitSlot;
use crate::sync::SharedBytes;

/// "rankweav" in ASCII, little-endian.
const MAGIC: u64 = u64::from_le_bytes(*b"rankweav");
/// The layout version this module writes and accepts.
const VERSION: u32 = 5;
const LINE: usize = 64;

/// The first cache line of a segment. Written once by the owner before it publishes the
/// segment; read-only afterwards.
#[repr(C, align(64))]
pub(crate) struct SegmentHeader {
    magic: u64,
    version: u32,
    /// The owner's world rank.
    rank: u32,
    /// Ranks in the job: one pair area per rank.
    world: u32,
    /// The owner's process id.
    pid: u32,
    /// A random number the owner drew for this segment and published beside its address.
    nonce: u64,
    ring_capacity: u32,
    ring_unit: u32,
    /// The segment's length in bytes.
    len: u64,
    /// Where the owner mapped this segment in its own address space: peers read this word
    /// there with `process_vm_readv` to find out whether single-copy transfers are permitted.
    self_addr: u64,
    /// Bytes of the owner's arena, at the end of the segment.
    arena_len: u64,
}

/// Per-pair information beside a ring (one cache line, written by the segment's owner).
#[repr(C, align(64))]
pub(crate) struct PairInfo {
    /// Whether the owner can read the sender's memory with `process_vm_readv`: 0 while it has
    /// not checked (send through the ring), [`SINGLE_COPY_YES`] or [`SINGLE_COPY_NO`].
    pub(crate) single_copy: AtomicU32,
    /// Single-copy payloads of the sender the owner has read (or, closing, skipped), counted
    /// by token: the sender may let go of every payload whose token is below it. Tokens are
    /// read in ring order, so a count says it all; stored with `Release` after the read, loaded
    /// with `Acquire` before the sender reuses the memory. A record in the reverse ring would
    /// wait behind the owner's own traffic there (a whole window of large messages in a
    /// bidirectional exchange).
    pub(crate) tokens_read: AtomicU64,
}

/// The receiver can read the sender's memory: large payloads go by single copy.
pub(crate) const SINGLE_COPY_YES: u32 = 1;
/// It cannot (or single copy is switched off): large payloads are pipelined through the ring.
pub(crate) const SINGLE_COPY_NO: u32 = 2;

/// Who a segment belongs to, as its header says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Owner {
    pub(crate) rank: u32,
    pub(crate) world: u32,
    pub(crate) nonce: u64,
    pub(crate) pid: u32,
}

/// A word the sender of a pair raises for the owner to watch (see
/// [`Transport::raise_flag`](rankweave_core::transport::Transport::raise_flag)): a line of its
/// own, written only by the sender, so that raising it takes the line from nobody but the
/// owner, who reads it.
#[repr(C, align(64))]
pub(crate) struct FlagLine {
    pub(crate) value: AtomicU64,
}

/// Bytes before a pair's ring control block: its [`PairInfo`], [`SplitSlot`] and [`FlagLine`]
/// lines.
const PAIR_LINES: usize = 3 * LINE;
const _: () = assert!(
    std::mem::size_of::<PairInfo>() == LINE
        && std::mem::size_of::<SplitSlot>() == LINE
        && std::mem::size_of::<FlagLine>() == LINE
);

/// Offsets of the parts of a segment, from its world size and ring geometry.
#[derive(Clone, Copy, Debug)]
struct Layout {
    senders: usize,
    pairs: usize,
    stride: usize,
    arena: usize,
    arena_len: usize,
    len: usize,
}

/// The arena starts on a page of its own (4 KiB, whatever the page size: only alignment for
/// the elements read from it and the cache lines matter).
const ARENA_ALIGN: usize = 4096;

impl Layout {
    fn new(world: u32, geometry: RingGeometry, arena_len: usize) -> Option<Layout> {
        let world = world as usize;
        let senders = 3 * LINE;
        let pairs = (senders + 4 * world).next_multiple_of(LINE);
        let stride = PAIR_LINES + std::mem::size_of::<RingControl>() + geometry.capacity;
        let arena = pairs
            .checked_add(stride.checked_mul(world)?)?
            .checked_next_multiple_of(ARENA_ALIGN)?;
        let len = arena.checked_add(arena_len)?;
        Some(Layout {
            senders,
            pairs,
            stride,
            arena,
            arena_len,
            len,
        })
    }
}

/// A mapped segment: this rank's own, or a peer's.
pub(crate) struct Segment {
    base: *mut u8,
    layout: Layout,
    geometry: RingGeometry,
    owner: Owner,
    /// Kept open for the owner's own segment: peers open it through `/proc/<pid>/fd/<fd>`.
    fd: Option<OwnedFd>,
}

// SAFETY: the mapping is shared memory accessed only through atomics, through the ring's
// protocol (`SharedBytes`) and through the read-only header; the pointer stays valid until
// `Drop` unmaps it.
unsafe impl Send for Segment {}
// SAFETY: as for `Send`.
unsafe impl Sync for Segment {}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment")
            .field("owner", &self.owner)
            .field("len", &self.layout.len)
            .finish()
    }
}

fn os_error(op: &str) -> String {
    format!("{op}: {}", std::io::Error::last_os_error())
}

/// Maps `len` bytes of `fd` shared and read-write.
fn map(fd: &impl AsRawFd, len: usize) -> Result<*mut u8, String> {
    // SAFETY: a fresh shared mapping of a file we hold open; the kernel picks the address, so
    // no existing mapping is replaced.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(os_error("mmap"));
    }
    Ok(p.cast())
}

impl Segment {
    /// Creates this rank's segment (zero-filled: every ring empty, the doorbell awake), with an
    /// arena of `arena_len` bytes.
    pub(crate) fn create(
        owner: Owner,
        geometry: RingGeometry,
        arena_len: usize,
    ) -> Result<Segment, String> {
        if !geometry.is_valid() {
            return Err(format!("unusable ring geometry {geometry:?}"));
        }
        let layout = Layout::new(owner.world, geometry, arena_len)
            .ok_or_else(|| format!("a segment for {} ranks is too large", owner.world))?;
        // The creator's pid in the name lets anyone check that no process still holds a
        // segment of a job that is gone (see /proc/*/maps).
        let name =
            CString::new(format!("rankweave-{}-r{}", owner.pid, owner.rank)).unwrap_or_default();
        // SAFETY: plain system call with a valid C string.
        let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(os_error("memfd_create"));
        }
        // SAFETY: `raw` is a fresh descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        File::from(fd.try_clone().map_err(|e| format!("dup: {e}"))?)
            .set_len(layout.len as u64)
            .map_err(|e| format!("sizing the segment to {} bytes: {e}", layout.len))?;
        let base = map(&fd, layout.len)?;
        let segment = Segment {
            base,
            layout,
            geometry,
            owner,
            fd: Some(fd),
        };
        // SAFETY: the header is the first line of a fresh mapping that no one else has yet
        // (the segment is published only after this returns).
        unsafe {
            base.cast::<SegmentHeader>().write(SegmentHeader {
                magic: MAGIC,
                version: VERSION,
                rank: owner.rank,
                world: owner.world,
                pid: owner.pid,
                nonce: owner.nonce,
                ring_capacity: geometry.capacity as u32,
                ring_unit: geometry.unit as u32,
                len: layout.len as u64,
                self_addr: base as u64,
                arena_len: arena_len as u64,
            });
        }
        Ok(segment)
    }

    /// Maps the segment of a peer that published process id `pid` and descriptor `fd`, and
    /// checks that it belongs to `expected` and has the geometry and arena size this rank uses.
    pub(crate) fn open_peer(
        pid: u32,
        fd: i32,
        expected: Owner,
        geometry: RingGeometry,
        arena_len: usize,
    ) -> Result<Segment, String> {
        let path = format!("/proc/{pid}/fd/{fd}");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| format!("opening {path}: {e}"))?;
        let layout = Layout::new(expected.world, geometry, arena_len)
            .ok_or_else(|| format!("a segment for {} ranks is too large", expected.world))?;
        let actual = file.metadata().map_err(|e| format!("{path}: {e}"))?.len();
        if actual != layout.len as u64 {
            return Err(format!(
                "{path} is {actual} bytes, not the {} of a rankweave segment for {} ranks",
                layout.len, expected.world
            ));
        }
        let base = map(&file, layout.len)?;
        let segment = Segment {
            base,
            layout,
            geometry,
            owner: expected,
            fd: None,
        };
        let h = segment.header();
        let found = Owner {
            rank: h.rank,
            world: h.world,
            nonce: h.nonce,
            pid: h.pid,
        };
        if h.magic != MAGIC
            || h.version != VERSION
            || found != expected
            || h.ring_capacity as usize != geometry.capacity
            || h.ring_unit as usize != geometry.unit
            || h.len != layout.len as u64
            || h.arena_len != arena_len as u64
        {
            return Err(format!(
                "{path} is not rank {}'s segment of this job (found {found:?}, version {})",
                expected.rank, h.version
            ));
        }
        Ok(segment)
    }

    fn header(&self) -> &SegmentHeader {
        // SAFETY: the first line of the mapping; written before publication, read-only after.
        unsafe { &*self.base.cast::<SegmentHeader>() }
    }

    /// The descriptor peers open (own segment only).
    pub(crate) fn fd(&self) -> Option<i32> {
        self.fd.as_ref().map(AsRawFd::as_raw_fd)
    }

    /// Where the owner mapped the segment (for the single-copy probe).
    pub(crate) fn owner_addr(&self) -> u64 {
        self.header().self_addr
    }

    /// Where this process mapped the segment.
    #[cfg(test)]
    pub(crate) fn base_addr(&self) -> usize {
        self.base as usize
    }

    /// The magic word peers expect to read at [`owner_addr`](Self::owner_addr).
    pub(crate) fn magic() -> u64 {
        MAGIC
    }

    /// The owner's doorbell.
    pub(crate) fn doorbell(&self) -> &Doorbell {
        // SAFETY: line 1 of the mapping, a `Doorbell` (one atomic; all zeros is valid), only
        // ever accessed atomically.
        unsafe { &*self.base.add(LINE).cast::<Doorbell>() }
    }

    fn sender_count(&self) -> &AtomicU32 {
        // SAFETY: line 2 of the mapping holds one atomic u32, accessed only atomically.
        unsafe { &*self.base.add(2 * LINE).cast::<AtomicU32>() }
    }

    fn sender_slot(&self, i: usize) -> Option<&AtomicU32> {
        let world = self.owner.world as usize;
        // SAFETY: slot i < world lies in the sender list, inside the mapping; accessed only
        // atomically.
        (i < world).then(|| unsafe {
            &*self
                .base
                .add(self.layout.senders + 4 * i)
                .cast::<AtomicU32>()
        })
    }

    /// Registers `rank` as a sender to the owner (once per sender), so the owner scans its ring.
    pub(crate) fn register_sender(&self, rank: u32) -> Result<(), String> {
        let i = self.sender_count().fetch_add(1, Ordering::AcqRel) as usize;
        let slot = self
            .sender_slot(i)
            .ok_or_else(|| format!("rank {}'s sender list is full", self.owner.rank))?;
        slot.store(rank + 1, Ordering::Release);
        Ok(())
    }

    /// Senders registered from index `from` on, in order, up to the first one still being
    /// written. Entries naming ranks outside the job are skipped (returned as `None`).
    pub(crate) fn senders_from(&self, from: usize, out: &mut Vec<Option<u32>>) -> usize {
        let count =
            (self.sender_count().load(Ordering::Acquire) as usize).min(self.owner.world as usize);
        let mut i = from;
        while i < count {
            let Some(v) = self.sender_slot(i).map(|s| s.load(Ordering::Acquire)) else {
                break;
            };
            if v == 0 {
                break;
            }
            out.push((v <= self.owner.world).then(|| v - 1));
            i += 1;
        }
        i
    }

    /// Whether more than `known` senders have started registering (one load): then
    /// [`senders_from`](Self::senders_from) has news.
    pub(crate) fn has_senders_beyond(&self, known: usize) -> bool {
        (self.sender_count().load(Ordering::Acquire) as usize).min(self.owner.world as usize)
            > known
    }

    /// Whether any registered sender's ring holds records not yet released by the owner (a
    /// lock-free look: two loads per sender that has registered).
    pub(crate) fn has_unread(&self) -> bool {
        (0..self.senders()).any(|i| self.is_unread(i))
    }

    /// The flag words of the registered senders, by sender rank.
    pub(crate) fn flags(&self) -> impl Iterator<Item = (u32, &AtomicU64)> {
        (0..self.senders()).filter_map(move |i| {
            let rank = self
                .sender_slot(i)?
                .load(Ordering::Acquire)
                .checked_sub(1)?;
            Some((rank, &self.flag_line(rank)?.value))
        })
    }

    /// How many rings hold records not released yet (for diagnostics).
    pub(crate) fn unread_rings(&self) -> usize {
        (0..self.senders()).filter(|&i| self.is_unread(i)).count()
    }

    fn senders(&self) -> usize {
        (self.sender_count().load(Ordering::Acquire) as usize).min(self.owner.world as usize)
    }

    /// Whether the ring of the `i`th registered sender holds records not released yet.
    fn is_unread(&self, i: usize) -> bool {
        let rank = self.sender_slot(i).map_or(0, |s| s.load(Ordering::Acquire));
        rank != 0
            && self.ring(rank - 1).is_some_and(|(control, data)| {
                control.has_unreleased(&data, self.geometry, self.ring_key(rank - 1))
            })
    }

    fn pair_base(&self, sender: u32) -> Option<*mut u8> {
        // SAFETY: pair areas of ranks < world lie inside the mapping (Layout::new).
        (sender < self.owner.world).then(|| unsafe {
            self.base
                .add(self.layout.pairs + sender as usize * self.layout.stride)
        })
    }

    /// Bytes of one pair area (its information line, ring control block and data), as
    /// [`prefault_pair`](Self::prefault_pair) maps them in.
    pub(crate) fn pair_bytes(&self) -> usize {
        self.layout.stride
    }

    /// Maps in, in this process, every page of the pair area of `sender` (the ring from it
    /// and its control block), so that records going round the ring the first time take no
    /// page faults: without this, each process faults once a page (every 64 small records),
    /// on the message's path. Nothing is written. Returns `false` where the kernel cannot
    /// (`MADV_POPULATE_WRITE` came with Linux 5.14): the pages then fault in on first use.
    pub(crate) fn prefault_pair(&self, sender: u32) -> bool {
        let Some(base) = self.pair_base(sender) else {
            return false;
        };
        // SAFETY: plain system call.
        let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
            p if p > 0 => p as usize,
            _ => return false,
        };
        let start = base as usize & !(page - 1);
        let end = (base as usize + self.layout.stride).next_multiple_of(page);
        // SAFETY: the range covers the pair area rounded out to whole pages: it lies inside
        // this mapping, which starts on a page and extends to the end of its last page. The
        // advice only maps pages in (as a write would, without writing); contents and other
        // processes' views are unchanged.
        unsafe {
            libc::madvise(
                start as *mut libc::c_void,
                end - start,
                libc::MADV_POPULATE_WRITE,
            ) == 0
        }
    }

    /// The per-pair information of the ring from `sender`.
    pub(crate) fn pair_info(&self, sender: u32) -> Option<&PairInfo> {
        // SAFETY: the first line of the pair area: one atomic u32, only accessed atomically.
        self.pair_base(sender)
            .map(|p| unsafe { &*p.cast::<PairInfo>() })
    }

    /// The split-copy slot of the pair from `sender` (see `split_copy`).
    pub(crate) fn split_slot(&self, sender: u32) -> Option<&SplitSlot> {
        // SAFETY: the second line of the pair area, made of atomics (all zeros is a valid
        // slot with no offer), only accessed atomically; it lives as long as the mapping.
        self.pair_base(sender)
            .map(|p| unsafe { &*p.add(LINE).cast::<SplitSlot>() })
    }

    /// The flag line of the pair from `sender`.
    pub(crate) fn flag_line(&self, sender: u32) -> Option<&FlagLine> {
        // SAFETY: the third line of the pair area, one atomic (all zeros: never raised), only
        // accessed atomically; it lives as long as the mapping.
        self.pair_base(sender)
            .map(|p| unsafe { &*p.add(2 * LINE).cast::<FlagLine>() })
    }

    /// The ring from `sender` to the owner: its control block and data area.
    pub(crate) fn ring(&self, sender: u32) -> Option<(&RingControl, SharedBytes)> {
        self.pair_base(sender).map(|p| {
            // SAFETY: the control block follows the pair-info, split-copy and flag lines; it is made of atomics,
            // for which all zeros is a valid empty ring. The data area follows it, `capacity`
            // bytes inside the mapping, which lives as long as `self` (the returned values
            // borrow or are used only while the segment is held).
            unsafe {
                let control = &*p.add(PAIR_LINES).cast::<RingControl>();
                let data = SharedBytes::from_raw(
                    p.add(PAIR_LINES + std::mem::size_of::<RingControl>()),
                    self.geometry.capacity,
                );
                (control, data)
            }
        })
    }

    /// The stamp key of the ring from `sender` (see the ring's docs).
    pub(crate) fn ring_key(&self, sender: u32) -> RingKey {
        RingKey::new(self.owner.nonce, sender)
    }

    /// The owner's arena: where it starts in this mapping and its length; `None` if it has
    /// none.
    pub(crate) fn arena(&self) -> Option<(std::ptr::NonNull<u8>, usize)> {
        if self.layout.arena_len == 0 {
            return None;
        }
        // SAFETY: the arena lies inside the mapping (Layout::new).
        let start = unsafe { self.base.add(self.layout.arena) };
        std::ptr::NonNull::new(start).map(|p| (p, self.layout.arena_len))
    }

    /// The ring geometry.
    pub(crate) fn geometry(&self) -> RingGeometry {
        self.geometry
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: `base` and `len` are exactly what mmap returned and was given; nothing
        // borrowed from the mapping outlives `self`.
        unsafe { libc::munmap(self.base.cast(), self.layout.len) };
    }
}
