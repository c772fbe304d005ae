//! rankweave-core: the message layer of rankweave.
//!
//! * [`types`], [`error`], [`config`]: the API vocabulary, typed errors, typed settings.
//! * [`matching`]: MPI matching of messages to receives (posted and unexpected queues).
//! * [`protocol`]: eager and rendezvous protocols as a sans-IO state machine per rank.
//! * [`transport`]: the trait transports implement; [`frame`]: what they carry.
//! * [`multicast`]: the trait multicast fabrics implement (one group per communicator).
//! * [`Communicator`]: the application's handle, driven by a per-rank progress engine.
//!
//! Applications normally use the `rankweave` facade crate, which re-exports all of this.

#![warn(missing_docs)]

pub mod arena;
pub mod buffer_pool;
pub mod byte_copy;
pub mod carrier;
pub mod chaos;
pub mod comm;
pub mod config;
pub mod error;
pub mod frame;
pub mod matching;
pub mod multicast;
pub mod protocol;
pub mod reliability;
pub mod rng;
pub(crate) mod runtime;
pub mod spin_lock;
pub mod stats;
mod sync;
pub mod transport;
pub mod tuning;
pub mod types;
pub mod wire;

pub use arena::{ArenaLease, PeerArena};
pub use carrier::{Carrier, Datagram};
pub use chaos::ChaosSpec;
pub use comm::{Communicator, ExchangeRecv, ProbeOp, RecvIntoOp, RecvOp, SendOp};
pub use config::{
    Config, LONG_SPIN, ProgressPolicy, RouteSpec, SHORT_SPIN, ShmConfig, TransportKind,
};
pub use error::{ConfigError, Error, Result, TransportError};
pub use multicast::{GroupId, MulticastConfig, MulticastFabric, MulticastGroup, MulticastSetup};
pub use stats::{RouteCounters, ShmCounters, ShmNow, Stats, TransportStats};
pub use transport::{Arrival, Capabilities, DataWant, EagerTaken, EagerWant, PeerFlag, Transport};
pub use tuning::CollectiveTuning;
pub use types::{ContextId, MAX_TAG, Message, Payload, Source, Status, Tag};
