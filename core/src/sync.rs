//! Synchronization primitives used by the lock-free pieces of this crate.
//!
//! Code such as `runtime::shutdown` imports every primitive it uses from here rather than from
//! `std` directly. The `loom-tests` crate compiles the same source files against its own
//! `crate::sync` module that re-exports `loom`'s versions of these types, so the loom models
//! check the real code. Keep this module and `loom-tests/src/lib.rs` exporting the same names.

#![allow(unused_imports)]

pub(crate) use std::sync::{Arc, Mutex, MutexGuard};

/// Atomic types, [`Ordering`](std::sync::atomic::Ordering) and fences (std versions).
pub(crate) mod atomic {
    pub(crate) use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering, fence};
}
