//! Loom models of rankweave's lock-free structures.
//!
//! This crate does not depend on any rankweave crate. It compiles the real source files by path
//! (`#[path = ...]`) against its own [`sync`] module, which re-exports loom's primitives under
//! the same names as the `sync` modules of `rankweave-transports` and `rankweave-core` re-export
//! std's (including a loom-checked [`sync::SharedBytes`]). Where a modelled file's items are
//! only `pub(crate)`, [`ring_api`], [`doorbell_api`], [`flags_api`] and [`arena_api`] wrap them one-to-one for the models.
//! The models live in `tests/`; see `README.md` for how to run them and what each one checks.

/// loom's synchronization primitives under the names the modelled source files import
/// (`crate::sync::...`). Keep in step with `transports/src/sync.rs` and `core/src/sync.rs`.
pub mod sync {
    pub use loom::sync::{Arc, Mutex, MutexGuard};

    /// loom's atomic types, `Ordering` and fences.
    pub mod atomic {
        pub use loom::sync::atomic::{
            AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering, fence,
        };
    }

    /// loom's cell, whose accesses loom checks.
    pub mod cell {
        pub use loom::cell::{MutPtr, UnsafeCell};
    }

    /// loom's hints (its `spin_loop` yields to the model's scheduler).
    pub mod hint {
        pub use loom::hint::spin_loop;
    }

    /// loom's thread operations.
    pub mod thread {
        pub use loom::thread::yield_now;
    }

    use loom::cell::UnsafeCell;

    /// The loom build of `transports/src/sync.rs`'s `SharedBytes`: the same `write` and
    /// `with_slice`, over a zero-filled region that loom checks. The bytes are split into
    /// granules of `granule` bytes, each its own `loom::cell::UnsafeCell`, so a read of bytes
    /// that is not ordered (happens-before) with a write of them, or two unordered writes, make
    /// loom fail the model with a causality violation. Touching any byte of a granule counts as
    /// touching all of it: the granule must divide the unit in which the modelled code hands
    /// bytes between threads (the ring's `unit`), or the check reports races that are not there.
    ///
    /// There is no `from_raw`: it is std-only (the std build maps shared memory).
    pub struct SharedBytes {
        granule: usize,
        len: usize,
        cells: Vec<UnsafeCell<Vec<u8>>>,
        /// The word at the start of each granule, for `load_word` and `store_word`: kept apart
        /// from the granule's bytes (which `write` and `with_slice` reach), so the models use
        /// it only for words the modelled code never touches byte-wise while they are watched.
        words: Vec<super::sync::atomic::AtomicU64>,
    }

    // SAFETY: the cells are only reached through the `unsafe` methods, whose callers promise
    // the absence of conflicting concurrent access, and loom checks that promise.
    unsafe impl Send for SharedBytes {}
    // SAFETY: as for `Send`.
    unsafe impl Sync for SharedBytes {}

    impl SharedBytes {
        /// `len` zero bytes in granules of `granule` bytes (`granule` must divide `len`).
        pub fn new(len: usize, granule: usize) -> SharedBytes {
            assert!(
                granule > 0 && len % granule == 0,
                "granule {granule} must divide the length {len}"
            );
            SharedBytes {
                granule,
                len,
                cells: (0..len / granule)
                    .map(|_| UnsafeCell::new(vec![0u8; granule]))
                    .collect(),
                words: (0..len / granule)
                    .map(|_| super::sync::atomic::AtomicU64::new(0))
                    .collect(),
            }
        }

        /// The word of the granule that starts at `at`.
        fn word(&self, at: usize) -> &super::sync::atomic::AtomicU64 {
            assert!(
                at % self.granule == 0 && at < self.len,
                "word access at {at}: not the start of a granule of {} in {} bytes",
                self.granule,
                self.len
            );
            &self.words[at / self.granule]
        }

        /// Loads the word at offset `at` (the start of a granule) atomically.
        ///
        /// # Safety
        ///
        /// None beyond the std version's; kept `unsafe` to match it.
        pub unsafe fn load_word(&self, at: usize, order: super::sync::atomic::Ordering) -> u64 {
            self.word(at).load(order)
        }

        /// Stores the word at offset `at` (the start of a granule) atomically.
        ///
        /// # Safety
        ///
        /// None beyond the std version's; kept `unsafe` to match it.
        pub unsafe fn store_word(
            &self,
            at: usize,
            value: u64,
            order: super::sync::atomic::Ordering,
        ) {
            self.word(at).store(value, order)
        }

        /// Calls `f(granule, offset in it, offset in the access, bytes)` for each piece of
        /// `[at, at + len)`, one piece per touched granule.
        fn pieces(&self, at: usize, len: usize, mut f: impl FnMut(usize, usize, usize, usize)) {
            assert!(
                at.checked_add(len).is_some_and(|end| end <= self.len),
                "access [{at}, {at}+{len}) out of bounds of {} bytes",
                self.len
            );
            let mut done = 0;
            while done < len {
                let pos = at + done;
                let (g, off) = (pos / self.granule, pos % self.granule);
                let n = (self.granule - off).min(len - done);
                f(g, off, done, n);
                done += n;
            }
        }

        /// Copies `src` to offset `at`.
        ///
        /// # Safety
        ///
        /// As for the std version: `at + src.len()` is at most the region's length (checked
        /// here) and nobody else reads or writes those bytes meanwhile (checked by loom).
        pub unsafe fn write(&self, at: usize, src: &[u8]) {
            self.pieces(at, src.len(), |g, off, done, n| {
                self.cells[g].with_mut(|cell| {
                    // SAFETY: loom has checked that this access does not race; `cell` points
                    // to a live `Vec` of `granule` bytes and `off + n <= granule`.
                    let cell = unsafe { &mut *cell };
                    cell[off..off + n].copy_from_slice(&src[done..done + n]);
                })
            });
        }

        /// Calls `f` with a copy of the `len` bytes at offset `at`.
        ///
        /// # Safety
        ///
        /// As for the std version: `at + len` is at most the region's length (checked here)
        /// and nobody writes those bytes until `f` returns (checked by loom, for the copy).
        pub unsafe fn with_slice<R>(&self, at: usize, len: usize, f: impl FnOnce(&[u8]) -> R) -> R {
            let mut buf = Vec::with_capacity(len);
            self.pieces(at, len, |g, off, _, n| {
                self.cells[g].with(|cell| {
                    // SAFETY: as in `write`.
                    let cell = unsafe { &*cell };
                    buf.extend_from_slice(&cell[off..off + n]);
                })
            });
            f(&buf)
        }
    }
}

pub mod harness;

// The in-process transport's `Mailbox` (its own `//!` docs document the module).
#[path = "../../transports/src/inproc/mailbox.rs"]
pub mod mailbox;

// The per-rank driver's shutdown handshake, `ShutdownSignal` (its own `//!` docs document it).
#[path = "../../core/src/runtime/shutdown.rs"]
pub mod shutdown;

// The shared-memory transport's SPSC ring of variable-length records (its own `//!` docs
// document the protocol). Its items are `pub(crate)`, so the models use them through `ring_api`
// and the module is private (public, its docs' links to `pub(crate)` items would fail
// `cargo doc` with `-D warnings`). Not compiled with cfg(test): the file's own `#[cfg(test)]`
// unit tests use the std-only `SharedBytes::from_raw`, and although this library is never
// tested (`test = false`), `cargo clippy --all-targets` still builds it with cfg(test).
#[cfg(not(test))]
#[path = "../../transports/src/shm/ring.rs"]
mod shm_ring;

// The shared-memory transport's park/notify doorbell (its own `//!` docs document the
// handshake). Private and used through `doorbell_api`, for the same doc-link reason as
// `shm_ring` (it has no unit tests, so it is compiled with cfg(test) too).
#[path = "../../transports/src/shm/doorbell.rs"]
mod shm_doorbell;

// The lock with a plain-store unlock of the driver and the shared-memory transport (its own
// `//!` docs explain it). Private and used through `spin_lock_api`, for the same doc-link
// reason as `shm_ring`.
#[path = "../../core/src/spin_lock.rs"]
mod spin_lock_impl;

/// Public wrappers over the `SpinLock` of `core/src/spin_lock.rs` (compiled here as the private
/// module `spin_lock_impl`), for the models in `tests/spin_lock.rs`. The guard is passed to a
/// closure instead of returned.
pub mod spin_lock_api {
    use crate::spin_lock_impl as spin_lock;

    /// `spin_lock_impl::SpinLock`.
    pub struct SpinLock<T>(spin_lock::SpinLock<T>);

    impl<T> SpinLock<T> {
        /// `SpinLock::new`.
        pub fn new(value: T) -> SpinLock<T> {
            SpinLock(spin_lock::SpinLock::new(value))
        }

        /// `SpinLock::lock`, running `f` with the guarded value before the guard drops.
        pub fn with_lock<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
            f(&mut self.0.lock())
        }

        /// `SpinLock::try_lock`, running `f` with the guarded value if the lock was free.
        pub fn with_try_lock<R>(&self, f: impl FnOnce(&mut T) -> R) -> Option<R> {
            self.0.try_lock().map(|mut g| f(&mut g))
        }
    }
}

/// Public, one-to-one wrappers over the `pub(crate)` items of `transports/src/shm/ring.rs`
/// (compiled here as the private module `shm_ring`; `pub(crate)` items cannot be re-exported as
/// `pub`), with the same names, arguments and results, for the models in `tests/shm_ring.rs`.
/// Each method only forwards to the real one.
#[cfg(not(test))]
pub mod ring_api {
    use crate::shm_ring as ring;
    use crate::sync::SharedBytes;

    /// `shm_ring::RECORD_HEADER`.
    pub const RECORD_HEADER: usize = ring::RECORD_HEADER;
    /// `shm_ring::PAD`.
    pub const PAD: u8 = ring::PAD;

    /// `shm_ring::RingGeometry`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct RingGeometry {
        /// Bytes in the data area.
        pub capacity: usize,
        /// Records start on multiples of this.
        pub unit: usize,
    }

    impl RingGeometry {
        fn real(self) -> ring::RingGeometry {
            ring::RingGeometry {
                capacity: self.capacity,
                unit: self.unit,
            }
        }

        /// `RingGeometry::is_valid`.
        pub fn is_valid(&self) -> bool {
            self.real().is_valid()
        }

        /// `RingGeometry::max_body`.
        pub fn max_body(&self) -> usize {
            self.real().max_body()
        }
    }

    /// `shm_ring::RingKey`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct RingKey(ring::RingKey);

    impl RingKey {
        /// `RingKey::new`.
        pub fn new(nonce: u64, sender: u32) -> RingKey {
            RingKey(ring::RingKey::new(nonce, sender))
        }
    }

    /// `shm_ring::RingControl`.
    #[derive(Default)]
    pub struct RingControl(ring::RingControl);

    impl RingControl {
        /// `RingControl::new`.
        pub fn new() -> RingControl {
            RingControl(ring::RingControl::new())
        }

        /// `RingControl::has_unreleased`.
        pub fn has_unreleased(
            &self,
            data: &SharedBytes,
            geometry: RingGeometry,
            key: RingKey,
        ) -> bool {
            self.0.has_unreleased(data, geometry.real(), key.0)
        }
    }

    /// `shm_ring::Pushed`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Pushed {
        /// `Pushed::Done`.
        Done,
        /// `Pushed::Full`.
        Full,
        /// `Pushed::TooLarge`.
        TooLarge,
    }

    /// `shm_ring::RingProducer`.
    #[derive(Debug)]
    pub struct RingProducer(ring::RingProducer);

    impl RingProducer {
        /// `RingProducer::new`.
        pub fn new(control: &RingControl, geometry: RingGeometry, key: RingKey) -> RingProducer {
            RingProducer(ring::RingProducer::new(&control.0, geometry.real(), key.0))
        }

        /// `RingProducer::with_hot_window`.
        pub fn with_hot_window(self, bytes: usize) -> RingProducer {
            RingProducer(self.0.with_hot_window(bytes))
        }

        /// `RingProducer::max_body`.
        pub fn max_body(&self) -> usize {
            self.0.max_body()
        }

        /// `RingProducer::position`.
        pub fn position(&self) -> u64 {
            self.0.position()
        }

        /// `RingProducer::consumed_to`.
        pub fn consumed_to(&self, control: &RingControl, position: u64) -> bool {
            self.0.consumed_to(&control.0, position)
        }

        /// `RingProducer::unread`.
        pub fn unread(&self, control: &RingControl) -> u64 {
            self.0.unread(&control.0)
        }

        /// `RingProducer::look_at_tail`.
        pub fn look_at_tail(&mut self, control: &RingControl) {
            self.0.look_at_tail(&control.0)
        }

        /// `RingProducer::set_early_wraps`.
        pub fn set_early_wraps(&mut self, on: bool) {
            self.0.set_early_wraps(on)
        }

        /// `RingProducer::try_push`.
        pub fn try_push(
            &mut self,
            control: &RingControl,
            data: &SharedBytes,
            kind: u8,
            parts: &[&[u8]],
        ) -> Pushed {
            match self.0.try_push(&control.0, data, kind, parts) {
                ring::Pushed::Done => Pushed::Done,
                ring::Pushed::Full => Pushed::Full,
                ring::Pushed::TooLarge => Pushed::TooLarge,
            }
        }

        /// `RingProducer::has_room_now`.
        pub fn has_room_now(&mut self, control: &RingControl, body: usize) -> bool {
            self.0.has_room_now(&control.0, body)
        }

        /// `RingProducer::request_space`.
        pub fn request_space(&mut self, control: &RingControl, body: usize) -> bool {
            self.0.request_space(&control.0, body)
        }
    }

    /// `shm_ring::Popped`.
    #[derive(Debug, PartialEq, Eq)]
    pub enum Popped<R> {
        /// `Popped::Empty`.
        Empty,
        /// `Popped::Record`.
        Record(R),
        /// `Popped::Corrupt`.
        Corrupt,
    }

    /// `shm_ring::RingConsumer`.
    #[derive(Debug)]
    pub struct RingConsumer(ring::RingConsumer);

    impl RingConsumer {
        /// `RingConsumer::new`.
        pub fn new(control: &RingControl, geometry: RingGeometry, key: RingKey) -> RingConsumer {
            RingConsumer(ring::RingConsumer::new(&control.0, geometry.real(), key.0))
        }

        /// `RingConsumer::has_records`.
        pub fn has_records(&self, data: &SharedBytes) -> bool {
            self.0.has_records(data)
        }

        /// `RingConsumer::pop`.
        pub fn pop<R>(&mut self, data: &SharedBytes, f: impl FnOnce(u8, &[u8]) -> R) -> Popped<R> {
            match self.0.pop(data, f) {
                ring::Popped::Empty => Popped::Empty,
                ring::Popped::Record(r) => Popped::Record(r),
                ring::Popped::Corrupt => Popped::Corrupt,
            }
        }

        /// `RingConsumer::pop_if`.
        pub fn pop_if<R>(
            &mut self,
            data: &SharedBytes,
            f: impl FnOnce(u8, &[u8]) -> Option<R>,
        ) -> Popped<Option<R>> {
            match self.0.pop_if(data, f) {
                ring::Popped::Empty => Popped::Empty,
                ring::Popped::Record(r) => Popped::Record(r),
                ring::Popped::Corrupt => Popped::Corrupt,
            }
        }

        /// `RingConsumer::discard_all`: whether the producer asked for space.
        pub fn discard_all(&mut self, control: &RingControl, data: &SharedBytes) -> bool {
            self.0.discard_all(&control.0, data)
        }

        /// `RingConsumer::release`.
        pub fn release(&mut self, control: &RingControl) -> bool {
            self.0.release(&control.0)
        }
    }
}

/// Public, one-to-one wrappers over the `pub(crate)` `Doorbell` of
/// `transports/src/shm/doorbell.rs` (compiled here as the private module `shm_doorbell`), for
/// the models in `tests/shm_doorbell.rs`.
pub mod doorbell_api {
    use crate::shm_doorbell as doorbell;

    /// `shm_doorbell::Doorbell`.
    #[derive(Default)]
    pub struct Doorbell(doorbell::Doorbell);

    impl Doorbell {
        /// `Doorbell::new`.
        pub fn new() -> Doorbell {
            Doorbell(doorbell::Doorbell::new())
        }

        /// `Doorbell::arm`.
        pub fn arm(&self) {
            self.0.arm()
        }

        /// `Doorbell::disarm`: whether it was armed.
        pub fn disarm(&self) -> bool {
            self.0.disarm()
        }

        /// `Doorbell::should_signal`.
        pub fn should_signal(&self) -> bool {
            self.0.should_signal()
        }

        /// `Doorbell::is_armed`.
        pub fn is_armed(&self) -> bool {
            self.0.is_armed()
        }
    }
}

// How a rank notices flags raised to it while it sleeps (its own `//!` docs explain it).
// Private and used through `flags_api`, for the same doc-link reason as `shm_ring`.
#[path = "../../transports/src/shm/flags.rs"]
mod shm_flags;

/// Public wrappers over `FlagWatch` of `transports/src/shm/flags.rs` (compiled here as the
/// private module `shm_flags`), for the models in `tests/shm_flags.rs`.
pub mod flags_api {
    use std::task::Waker;

    use crate::shm_flags as flags;
    use crate::sync::atomic::AtomicU64;

    /// `shm_flags::FlagWatch`.
    pub struct FlagWatch(flags::FlagWatch);

    impl FlagWatch {
        /// `FlagWatch::new`.
        pub fn new(world: u32) -> FlagWatch {
            FlagWatch(flags::FlagWatch::new(world))
        }

        /// `FlagWatch::changed`.
        pub fn changed<'a>(&self, flags: impl IntoIterator<Item = (u32, &'a AtomicU64)>) -> bool {
            self.0.changed(flags)
        }

        /// `FlagWatch::observe`.
        pub fn observe<'a>(
            &self,
            flags: impl IntoIterator<Item = (u32, &'a AtomicU64)>,
            anyway: bool,
        ) {
            self.0.observe(flags, anyway)
        }

        /// `FlagWatch::park`.
        pub fn park(&self, waker: &Waker) {
            self.0.park(waker)
        }
    }
}

// The shared-memory transport's arena gate: one lease on a rank's arena at a time (its own
// `//!` docs explain it). Private and used through `arena_api`, for the same doc-link reason
// as `shm_ring`.
#[path = "../../transports/src/shm/arena.rs"]
mod shm_arena;

/// Public wrappers over `ArenaGate` of `transports/src/shm/arena.rs` (compiled here as the
/// private module `shm_arena`), for the models in `tests/shm_arena.rs`.
pub mod arena_api {
    use crate::shm_arena as arena;

    /// `shm_arena::ArenaGate`.
    #[derive(Debug, Default)]
    pub struct ArenaGate(arena::ArenaGate);

    impl ArenaGate {
        /// `ArenaGate::new`.
        pub fn new() -> ArenaGate {
            ArenaGate(arena::ArenaGate::new())
        }

        /// `ArenaGate::try_take`.
        pub fn try_take(&self) -> bool {
            self.0.try_take()
        }

        /// `ArenaGate::give_back`.
        pub fn give_back(&self) {
            self.0.give_back()
        }
    }
}

// The shared-memory transport's split copy: receiver and sender claiming chunks of one
// payload (its own `//!` docs document the protocol). Private and used through `split_api`,
// for the same doc-link reason as `shm_ring`.
#[path = "../../transports/src/shm/split_copy.rs"]
mod shm_split_copy;

/// Public, one-to-one wrappers over the `pub(crate)` items of
/// `transports/src/shm/split_copy.rs` (compiled here as the private module `shm_split_copy`),
/// for the models in `tests/shm_split_copy.rs`.
pub mod split_api {
    use crate::shm_split_copy as split;

    /// `shm_split_copy::SPLIT_MIN`.
    pub const SPLIT_MIN: u64 = split::SPLIT_MIN;
    /// `shm_split_copy::LEND_MAX`.
    pub const LEND_MAX: u64 = split::LEND_MAX;
    /// `shm_split_copy::WAKE_MIN`.
    pub const WAKE_MIN: u64 = split::WAKE_MIN;

    /// `shm_split_copy::tag_of`.
    pub fn tag_of(token: u64) -> u64 {
        split::tag_of(token)
    }

    /// `shm_split_copy::chunks_for`.
    pub fn chunks_for(len: u64) -> u64 {
        split::chunks_for(len)
    }

    /// `shm_split_copy::Offer`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Offer(split::Offer);

    impl Offer {
        /// `Offer::tag`.
        pub fn tag(&self) -> u64 {
            self.0.tag
        }

        /// `Offer::chunks`.
        pub fn chunks(&self) -> u64 {
            self.0.chunks
        }
    }

    /// `shm_split_copy::Chunk`, as a plain struct.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Chunk {
        /// `Chunk::dst`.
        pub dst: u64,
        /// `Chunk::offset`.
        pub offset: u64,
        /// `Chunk::len`.
        pub len: u64,
        /// `Chunk::total`.
        pub total: u64,
        /// `Chunk::count`.
        pub count: u64,
    }

    fn plain(c: split::Chunk) -> Chunk {
        Chunk {
            dst: c.dst,
            offset: c.offset,
            len: c.len,
            total: c.total,
            count: c.count,
        }
    }

    /// `shm_split_copy::SplitSlot`.
    #[derive(Default)]
    pub struct SplitSlot(split::SplitSlot);

    impl SplitSlot {
        /// `SplitSlot::offer`.
        pub fn offer(&self, token: u64, dst: u64, len: u64) -> Offer {
            Offer(self.0.offer(token, dst, len))
        }

        /// `SplitSlot::lend`.
        pub fn lend(&self, token: u64, dst: u64, len: u64) -> Offer {
            Offer(self.0.lend(token, dst, len))
        }

        /// `SplitSlot::open_offer`.
        pub fn open_offer(&self) -> Option<u64> {
            self.0.open_offer()
        }

        /// `SplitSlot::claim` and `SplitSlot::finish`: claims a chunk and finishes it with
        /// `copy`'s result.
        pub fn claim_one(&self, tag: u64, copy: impl FnOnce(Chunk) -> bool) -> Option<Chunk> {
            let c = self.0.claim(tag)?;
            let ok = copy(plain(c));
            self.0.finish(c, ok);
            Some(plain(c))
        }

        /// `SplitSlot::take_chunks`.
        pub fn take_chunks(&self, tag: u64, mut copy: impl FnMut(Chunk) -> bool) -> u64 {
            self.0.take_chunks(tag, |c| copy(plain(c)))
        }

        /// `SplitSlot::read_chunks`.
        pub fn read_chunks(&self, tag: u64, mut copy: impl FnMut(Chunk) -> bool) -> u64 {
            self.0.read_chunks(tag, |c| copy(plain(c)))
        }

        /// `SplitSlot::is_finished`.
        pub fn is_finished(&self, offer: Offer) -> bool {
            self.0.is_finished(offer.0)
        }

        /// `SplitSlot::failed`.
        pub fn failed(&self) -> bool {
            self.0.failed()
        }
    }
}
