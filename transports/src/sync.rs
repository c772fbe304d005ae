//! Synchronization primitives used by the lock-free pieces of this crate.
//!
//! Code such as `inproc::mailbox` and `shm::ring` imports every primitive it uses from here
//! rather than from `std` directly. The `loom-tests` crate compiles the same source files
//! against its own `crate::sync` module that re-exports `loom`'s versions of these types (and a
//! loom-checked [`SharedBytes`]), so the loom models check the real code. Keep this module and
//! `loom-tests/src/lib.rs` exporting the same names.

#![allow(unused_imports)]

pub(crate) use std::sync::{Arc, Mutex, MutexGuard};

/// Atomic types, [`Ordering`](std::sync::atomic::Ordering) and fences (std versions).
pub(crate) mod atomic {
    pub(crate) use std::sync::atomic::{
        AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering, fence,
    };
}

/// A region of memory that two parties (threads, or processes through a shared mapping) read
/// and write under a protocol of their own: the shared-memory ring's data area.
///
/// The methods copy bytes in and out through a raw pointer. They are `unsafe` because the
/// region is shared: the caller promises that nobody writes the bytes it touches at the same
/// time (the ring's head and tail, published with release and read with acquire, are what make
/// that so). The loom build replaces this type with one that checks the promise.
pub(crate) struct SharedBytes {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a `SharedBytes` is a pointer and a length; every access goes through the `unsafe`
// methods below, whose callers guarantee the absence of concurrent conflicting access.
unsafe impl Send for SharedBytes {}
// SAFETY: as for `Send`.
unsafe impl Sync for SharedBytes {}

impl SharedBytes {
    /// The region `[ptr, ptr + len)`.
    ///
    /// # Safety
    ///
    /// The region must stay mapped, readable and writable for as long as the value lives.
    pub(crate) unsafe fn from_raw(ptr: *mut u8, len: usize) -> SharedBytes {
        SharedBytes { ptr, len }
    }

    /// Copies `src` to offset `at`.
    ///
    /// # Safety
    ///
    /// `at + src.len() <= self.len()`, and nobody else reads or writes those bytes meanwhile.
    pub(crate) unsafe fn write(&self, at: usize, src: &[u8]) {
        debug_assert!(at + src.len() <= self.len);
        // SAFETY: in bounds and unshared for the duration, by the caller's promise.
        unsafe { rankweave_core::byte_copy::copy_raw(self.ptr.add(at), src.as_ptr(), src.len()) }
    }

    /// Loads the 8-byte word at offset `at` atomically.
    ///
    /// # Safety
    ///
    /// `at + 8 <= self.len()` and the address is 8-aligned; the word is only written through
    /// [`store_word`](Self::store_word) while anyone may load it.
    pub(crate) unsafe fn load_word(&self, at: usize, order: atomic::Ordering) -> u64 {
        debug_assert!(at + 8 <= self.len && (self.ptr as usize + at) % 8 == 0);
        // SAFETY: in bounds and aligned, by the caller's promise; an AtomicU64 has the size and
        // alignment of a u64, and concurrent writers use atomic stores too.
        unsafe { atomic::AtomicU64::from_ptr(self.ptr.add(at).cast()).load(order) }
    }

    /// Stores the 8-byte word at offset `at` atomically.
    ///
    /// # Safety
    ///
    /// As for [`load_word`](Self::load_word).
    pub(crate) unsafe fn store_word(&self, at: usize, value: u64, order: atomic::Ordering) {
        debug_assert!(at + 8 <= self.len && (self.ptr as usize + at) % 8 == 0);
        // SAFETY: as in `load_word`.
        unsafe { atomic::AtomicU64::from_ptr(self.ptr.add(at).cast()).store(value, order) }
    }

    /// Calls `f` with the `len` bytes at offset `at`.
    ///
    /// # Safety
    ///
    /// `at + len <= self.len()`, and nobody writes those bytes until `f` returns.
    pub(crate) unsafe fn with_slice<R>(
        &self,
        at: usize,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> R {
        debug_assert!(at + len <= self.len);
        // SAFETY: in bounds and not written for the duration, by the caller's promise.
        f(unsafe { std::slice::from_raw_parts(self.ptr.add(at), len) })
    }
}
