//! Errors of the verbs providers and transports.

use rankweave_core::TransportError;

/// An error of a verbs provider or transport.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum VerbsError {
    /// No RDMA device can be used: the kernel has no RDMA support (`ibv_get_device_list`
    /// failed), or it lists no device, or none with the requested name.
    #[error("no RDMA device: {reason}")]
    NoDevice {
        /// Why, with the operating system's word where there is one.
        reason: String,
    },
    /// A verbs call failed.
    #[error("{op} failed: {message}")]
    Verbs {
        /// The verbs call (`ibv_reg_mr`, `ibv_post_send`, ...).
        op: &'static str,
        /// The error text.
        message: String,
    },
    /// A queue pair number this provider does not know.
    #[error("unknown queue pair {0}")]
    UnknownQp(u32),
    /// A queue pair was used in a state that does not allow it (not connected, or in error).
    #[error("queue pair {qpn} cannot {op} in its current state")]
    QpState {
        /// The queue pair.
        qpn: u32,
        /// What was attempted.
        op: &'static str,
    },
    /// A memory region handle this provider does not know.
    #[error("unknown memory region {0}")]
    UnknownRegion(u64),
    /// A work request names bytes outside its region, or writes read-only memory.
    #[error("bad memory access: {0}")]
    BadAccess(String),
    /// A queue is full.
    #[error("{queue} queue of queue pair {qpn} is full")]
    QueueFull {
        /// The queue pair.
        qpn: u32,
        /// `send` or `receive`.
        queue: &'static str,
    },
    /// A work request that the queue pair's kind does not allow (RDMA on UD, say), or a UD
    /// message larger than the MTU.
    #[error("invalid work request: {0}")]
    InvalidRequest(String),
    /// An address handle this provider does not know.
    #[error("unknown address handle {0}")]
    UnknownAddressHandle(u64),
    /// The port is down.
    #[error("port is down")]
    PortDown,
    /// A setting is out of range.
    #[error("invalid verbs setting: {0}")]
    InvalidSetting(String),
    /// The job's key-value space failed a step of joining a multi-process job.
    #[error("{step}: {message}")]
    Directory {
        /// The step (publishing the UD endpoints, meeting the other ranks).
        step: &'static str,
        /// The key-value space's error.
        message: String,
    },
    /// This build has no device provider: it was compiled without the cargo feature `verbs`.
    #[error("this build lacks the cargo feature `verbs` (rebuild with `--features verbs`)")]
    NotBuilt,
}

impl From<VerbsError> for TransportError {
    fn from(e: VerbsError) -> Self {
        if matches!(e, VerbsError::NoDevice { .. } | VerbsError::NotBuilt) {
            return TransportError::Unavailable {
                transport: "verbs",
                reason: e.to_string(),
            };
        }
        TransportError::Io {
            op: "verbs",
            message: e.to_string(),
        }
    }
}
