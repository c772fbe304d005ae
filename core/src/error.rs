//! Typed errors. Every failure a user can see is a variant here, with the context to act on it.

use std::time::Duration;

/// An error from a rankweave operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A rank outside `0..size` was named.
    #[error("invalid rank {rank}: the communicator has {size} ranks")]
    InvalidRank {
        /// The rank that was given.
        rank: usize,
        /// The communicator's size.
        size: usize,
    },
    /// A tag above [`MAX_TAG`](crate::MAX_TAG) was used.
    #[error("invalid tag {tag}: user tags range from 0 to {max}")]
    InvalidTag {
        /// The tag that was given.
        tag: u32,
        /// The largest valid tag.
        max: u32,
    },
    /// A message matched a receive whose buffer is too small. The message was not consumed: it
    /// stays first in line and a receive with a larger buffer gets it.
    #[error(
        "message of {len} bytes from rank {from} (tag {tag}) does not fit a {capacity}-byte buffer"
    )]
    Truncated {
        /// The message's length.
        len: usize,
        /// The buffer's capacity.
        capacity: usize,
        /// The sender's rank in the communicator.
        from: usize,
        /// The message's tag.
        tag: u32,
    },
    /// The payload is not a whole number of elements of the requested type.
    #[error("payload of {len} bytes is not a whole number of {elem}-byte elements")]
    Misaligned {
        /// The payload length.
        len: usize,
        /// The element size.
        elem: usize,
    },
    /// The peer rank failed or exited, so an operation involving it can never complete.
    #[error("peer rank {rank} failed or exited")]
    PeerFailed {
        /// The peer's rank in the communicator the operation was made on (world rank for
        /// operations not tied to a communicator).
        rank: usize,
    },
    /// An operation did not complete within its deadline.
    #[error("operation timed out after {0:?}")]
    Timeout(Duration),
    /// The transport could not move a frame.
    #[error("transport error: {0}")]
    Transport(#[from] TransportError),
    /// A peer sent something the protocol does not allow.
    #[error("protocol violation by rank {peer}: {detail}")]
    Protocol {
        /// The world rank of the peer.
        peer: usize,
        /// What was wrong.
        detail: String,
    },
    /// The configuration could not be read.
    #[error("configuration error: {0}")]
    Config(#[from] ConfigError),
    /// The communicator this operation was made on has been shut down.
    #[error("the rank has shut down")]
    Shutdown,
    /// No tokio runtime is running: rankweave needs one for its progress tasks.
    #[error("no tokio runtime: call rankweave from inside a tokio runtime")]
    NoRuntime,
    /// A rank of an in-process job panicked.
    #[error("rank {rank} panicked: {message}")]
    RankPanicked {
        /// The rank that panicked.
        rank: usize,
        /// The panic message, when it was a string.
        message: String,
    },
    /// A collective was given inputs that do not agree with the communicator (for example a
    /// scatter buffer whose length is not a multiple of the size).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Joining a multi-process job failed: the launcher's environment is incomplete or
    /// invalid, its PMI server or the rendezvous service answered with an error or not at all.
    #[error("{launcher}: {message}")]
    Launch {
        /// How the process was started (`PMI-1`, `rwrun`, `Open MPI`, ...).
        launcher: String,
        /// What went wrong, and what to do about it where known.
        message: String,
    },
}

/// An error of a transport.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The destination (world rank) is gone.
    #[error("peer {0} is unreachable")]
    PeerUnreachable(usize),
    /// The transport was closed.
    #[error("transport closed")]
    Closed,
    /// The transport cannot be used here: this build lacks it, or the hardware it needs is
    /// missing (for verbs: no RDMA device).
    #[error("the {transport} transport is unavailable: {reason}")]
    Unavailable {
        /// Which transport (`verbs`, ...).
        transport: &'static str,
        /// Why, and what to do about it where known.
        reason: String,
    },
    /// An operating-system error.
    #[error("{op}: {message}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The OS error text.
        message: String,
    },
}

/// A setting could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{variable}={value:?}: {expected}")]
pub struct ConfigError {
    /// The environment variable (or setting) name.
    pub variable: String,
    /// The value that was found.
    pub value: String,
    /// What would have been accepted.
    pub expected: String,
}

/// Shorthand for `Result<T, rankweave_core::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;
