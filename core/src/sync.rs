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

/// Cells whose access is guarded by a protocol of the caller's (the loom build checks it).
pub(crate) mod cell {
    /// `std::cell::UnsafeCell` with loom's interface: access through a [`MutPtr`].
    #[derive(Debug, Default)]
    pub(crate) struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

    impl<T> UnsafeCell<T> {
        /// A cell holding `value`.
        pub(crate) fn new(value: T) -> UnsafeCell<T> {
            UnsafeCell(std::cell::UnsafeCell::new(value))
        }

        /// A pointer for mutable access (loom tracks the access while it lives).
        pub(crate) fn get_mut(&self) -> MutPtr<T> {
            MutPtr(self.0.get())
        }
    }

    /// Mutable access to an [`UnsafeCell`]'s value.
    #[derive(Debug)]
    pub(crate) struct MutPtr<T>(*mut T);

    impl<T> MutPtr<T> {
        /// The value.
        ///
        /// # Safety
        ///
        /// The cell outlives the reference, and nothing else reads or writes the value while it
        /// lives.
        #[allow(clippy::mut_from_ref)]
        pub(crate) unsafe fn deref(&self) -> &mut T {
            // SAFETY: the caller's promise.
            unsafe { &mut *self.0 }
        }
    }
}

/// Hints to the processor (std versions; loom's yield to its scheduler).
pub(crate) mod hint {
    pub(crate) use std::hint::spin_loop;
}

/// Thread operations (std versions).
pub(crate) mod thread {
    pub(crate) use std::thread::yield_now;
}
