//! The async side: the per-rank driver and its progress task.
//!
//! The protocol state machine ([`crate::protocol::Endpoint`]) knows nothing of tasks; this module
//! runs it. See [`driver`] for how data moves while futures are polled and while they are not.

pub(crate) mod driver;
mod shutdown;

pub(crate) use driver::{Driver, RankLife, RecvNow, SendData, Wait, Waiting};
