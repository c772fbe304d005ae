//! Loom models of rankweave's lock-free structures.
//!
//! This crate does not depend on any rankweave crate. It compiles the real source files by path
//! (`#[path = ...]`) against its own [`sync`] module, which re-exports loom's primitives under
//! the same names as the `sync` modules of `rankweave-transports` and `rankweave-core` re-export
//! std's. The models live in `tests/`; see `README.md` for how to run them and what each one
//! checks.

/// loom's synchronization primitives under the names the modelled source files import
/// (`crate::sync::...`). Keep in step with `transports/src/sync.rs` and `core/src/sync.rs`.
pub mod sync {
    pub use loom::sync::{Arc, Mutex, MutexGuard};

    /// loom's atomic types, `Ordering` and fences.
    pub mod atomic {
        pub use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering, fence};
    }
}

// The in-process transport's `Mailbox` (its own `//!` docs document the module).
pub mod harness;

#[path = "../../transports/src/inproc/mailbox.rs"]
pub mod mailbox;

// The per-rank driver's shutdown handshake, `ShutdownSignal` (its own `//!` docs document it).
#[path = "../../core/src/runtime/shutdown.rs"]
pub mod shutdown;
