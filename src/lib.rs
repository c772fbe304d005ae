//! # rankweave
//!
//! Async-native message passing for Rust: MPI's model — ranks, tags, communicators,
//! collectives — inside ordinary tokio code, with failures reported as errors instead of hangs.
//!
//! ```
//! # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
//! # async fn main() -> Result<(), rankweave::Error> {
//! let sums = rankweave::local(4, |comm| async move {
//!     let next = (comm.rank() + 1) % comm.size();
//!     let prev = (comm.rank() + comm.size() - 1) % comm.size();
//!     // Both operations start here; awaiting only waits for them.
//!     let send = comm.send(next, 7, vec![comm.rank() as u8]);
//!     let msg = comm.recv(prev, 7).await?;
//!     send.await?;
//!     Ok::<_, rankweave::Error>(msg.data()[0] as usize)
//! })
//! .await?;
//! assert_eq!(sums.into_iter().collect::<Result<Vec<_>, _>>()?, vec![3, 0, 1, 2]);
//! # Ok(())
//! # }
//! ```
//!
//! The [book](https://example.invalid/rankweave) explains the concepts; this crate re-exports
//! [`rankweave_core`] (the message layer), [`rankweave_collectives`] and
//! [`rankweave_transports`].

#![warn(missing_docs)]

pub mod launch;

pub use launch::{finalize, init, init_job, init_with, local, local_with};
pub use rankweave_collectives as collectives;
pub use rankweave_collectives::{CollectiveOp, Collectives, Op, ReduceOp, Reducible, UserOp};
pub use rankweave_core as core;
pub use rankweave_core::{
    Communicator, Config, ConfigError, ContextId, Error, LONG_SPIN, MAX_TAG, Message, Payload,
    ProbeOp, ProgressPolicy, RecvIntoOp, RecvOp, Result, SHORT_SPIN, SendOp, Source, Stats, Status,
    Tag, TransportKind,
};
pub use rankweave_transports as transports;

/// `use rankweave::prelude::*;` brings the communicator, selectors and collective methods into
/// scope.
pub mod prelude {
    pub use crate::{Collectives, Communicator, Error, Message, Op, Source, Status, Tag, UserOp};
}
