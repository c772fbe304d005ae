//! InfiniBand verbs: the RC transport over a narrow provider interface, with a simulated
//! fabric for tests and (feature `verbs`) the device provider over `libibverbs`.
//!
//! * [`provider`]: the [`Provider`] trait, what the transports need from an RDMA port.
//! * [`sim`]: a simulated fabric with verbs semantics (RC reliable and ordered, RNR, UD
//!   unreliable and MTU-limited, multicast, immediate data, fault hooks). Always compiled.
//! * `device` (feature `verbs`): the provider over a real HCA through `libibverbs`; opening it
//!   without a device gives [`VerbsError::NoDevice`].
//! * [`channel`], [`credits`], [`message`], [`mr_cache`]: the sans-IO pieces of the RC
//!   protocol (eager messages under credit-based flow control, rendezvous by RDMA write with
//!   immediate data, the memory-registration cache).
//! * [`connection_manager`], [`lane_reconnect`]: the sans-IO control exchanges over UD (RC
//!   connection set-up, lane fail-back), sharing [`control_retry`] (retransmission timer,
//!   counters).
//! * [`stream`]: the sans-IO stream of one peer's frames over several lanes (one RC queue pair
//!   per port): sequence numbers, striping, replay after a lane failure, duplicate
//!   suppression and reordering at the receiver.
//! * [`rc`]: the driver, [`RcTransport`], which implements [`Transport`](rankweave_core::Transport).
//!
//! [`simulated_world`] builds an in-process job whose ranks talk through the simulated fabric,
//! exactly as they would through an HCA; the book's InfiniBand chapter says what is verified
//! in simulation and what has not run on hardware yet.

pub mod adaptive;
pub mod channel;
pub mod connection_manager;
pub mod control_retry;
pub mod credits;
#[cfg(feature = "verbs")]
pub mod device;
pub mod device_event;
pub mod device_job;
pub mod env;
pub mod lane_reconnect;

mod error;
pub mod message;
pub mod mr_cache;
pub mod process_job;
pub mod provider;
pub mod rc;
pub mod shared_port;
pub mod sim;
pub mod sim_job;
pub mod stream;
pub mod ud_carrier;
pub mod ud_directory;
pub mod ud_multicast;
mod ud_queue;

use std::sync::Arc;

use rankweave_core::{Communicator, Config, Error};

pub use adaptive::{AdaptiveSettings, AdaptiveTransport};
pub use device_job::{device_world, device_world_with};
pub use error::VerbsError;
pub use provider::Provider;
pub use rc::{
    DEFAULT_READ_MIN, RcAddress, RcSettings, RcTransport, connect_job, connect_job_ports,
};
pub use shared_port::{PortHandle, SharedPort};
pub use sim::{SimFabric, SimProvider};
pub use sim_job::{
    SimulatedJob, SimulatedTransports, adaptive_transports, simulated_adaptive_transports,
    simulated_adaptive_world,
};
pub use ud_directory::{UdDirectory, UdEndpoints};

/// The world communicators of an `n`-rank in-process job whose ranks talk over the RC
/// transport through a fresh [`SimFabric`] (one port per rank), with `settings`. Must be
/// called inside a tokio runtime.
pub fn simulated_world_with(
    n: usize,
    config: &Config,
    settings: RcSettings,
) -> Result<(SimFabric, Vec<Communicator>), Error> {
    if n == 0 {
        return Err(Error::InvalidArgument(
            "a job needs at least one rank".into(),
        ));
    }
    let fabric = SimFabric::default();
    let providers = (0..n).map(|_| fabric.open_port()).collect();
    let transports = connect_job(providers, settings).map_err(|e| Error::Transport(e.into()))?;
    let comms = transports
        .into_iter()
        .enumerate()
        .map(|(rank, t)| Communicator::world(rank, n, Arc::new(t), config.clone()))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((fabric, comms))
}

/// [`simulated_world_with`] the default [`RcSettings`] (linger: `config.peer_timeout`).
pub fn simulated_world(n: usize, config: &Config) -> Result<Vec<Communicator>, Error> {
    let settings = RcSettings {
        linger: config.peer_timeout,
        ..RcSettings::default()
    };
    simulated_world_with(n, config, settings).map(|(_, comms)| comms)
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod adaptive_tests;

#[cfg(test)]
mod process_job_tests;

#[cfg(test)]
mod test_support;
