//! In-process jobs over a [`SimFabric`] with adaptive connections: what the tests (and anyone
//! trying the verbs protocol without hardware) build worlds with.

use std::sync::Arc;

use rankweave_core::{Communicator, Config, Error, MulticastSetup};

use super::adaptive::{self, AdaptiveParts, AdaptiveSettings, AdaptiveTransport};
use super::error::VerbsError;
use super::provider::Provider;
use super::shared_port::SharedPort;
use super::sim::{SimFabric, SimProvider};
use super::ud_multicast::{UdMulticast, UdMulticastSettings};

/// An in-process job over a simulated fabric with adaptive connections (see
/// [`simulated_adaptive_world`]).
pub struct SimulatedJob {
    /// The fabric, for fault injection.
    pub fabric: SimFabric,
    /// The world communicators, rank order.
    pub comms: Vec<Communicator>,
    /// Each rank's transport, rank order.
    pub transports: Vec<Arc<AdaptiveTransport<SimProvider>>>,
    /// Each rank's ports (route order): their LIDs name them to [`SimFabric::fail_port`].
    pub ports: Vec<Vec<SharedPort<SimProvider>>>,
}

/// The transports of an in-process job over a simulated fabric (see
/// [`simulated_adaptive_transports`]).
pub struct SimulatedTransports {
    /// The fabric, for fault injection.
    pub fabric: SimFabric,
    /// Each rank's transport, rank order.
    pub transports: Vec<Arc<AdaptiveTransport<SimProvider>>>,
    /// Each rank's ports (route order).
    pub ports: Vec<Vec<SharedPort<SimProvider>>>,
    /// The job's key.
    pub job_key: u64,
}

/// The transports of an `n`-rank in-process job over a fresh [`SimFabric`] with `ports`
/// ports per rank: UD on every port (one route each), RC connections made on demand with one
/// lane per port (at most [`MAX_LANES`](super::stream::MAX_LANES) ports). Must be called
/// inside a tokio runtime.
pub fn simulated_adaptive_transports(
    n: usize,
    ports: usize,
    peer_timeout: std::time::Duration,
    settings: AdaptiveSettings,
) -> Result<SimulatedTransports, VerbsError> {
    let size = u32::try_from(n)
        .ok()
        .filter(|&s| s > 0)
        .ok_or_else(|| VerbsError::InvalidSetting(format!("{n} ranks")))?;
    if ports == 0 {
        return Err(VerbsError::InvalidSetting("0 ports per rank".into()));
    }
    let fabric = SimFabric::default();
    let shared: Vec<Vec<SharedPort<SimProvider>>> = (0..n)
        .map(|_| {
            (0..ports)
                .map(|_| SharedPort::new(fabric.open_port()))
                .collect()
        })
        .collect();
    let (transports, job_key) = adaptive_transports(&shared, size, peer_timeout, settings)?;
    Ok(SimulatedTransports {
        fabric,
        transports,
        ports: shared,
        job_key,
    })
}

/// Each rank's adaptive transport, rank order.
pub type RankTransports<P> = Vec<Arc<AdaptiveTransport<P>>>;

/// The adaptive transports of a `size`-rank in-process job whose rank `r` has the ports
/// `ports[r]` (simulated or devices): UD on every port (one route each), RC connections
/// made on demand with one lane per port; with a fresh job key, which it returns too.
pub fn adaptive_transports<P: Provider>(
    ports: &[Vec<SharedPort<P>>],
    size: u32,
    peer_timeout: std::time::Duration,
    settings: AdaptiveSettings,
) -> Result<(RankTransports<P>, u64), VerbsError> {
    if ports.len() != size as usize || ports.iter().any(Vec::is_empty) {
        return Err(VerbsError::InvalidSetting(format!(
            "{} ranks with ports for {size}, each needs at least one",
            ports.len()
        )));
    }
    let job_key = rankweave_core::rng::random_u64();
    let parts = (0u32..)
        .zip(ports)
        .map(|(rank, rank_ports)| AdaptiveParts::open(rank_ports, rank, size, &settings))
        .collect::<Result<Vec<_>, _>>()?;
    let carriers: Vec<_> = parts.iter().map(|p| &p.carrier).collect();
    adaptive::introduce(&carriers)?;
    let transports = parts
        .into_iter()
        .map(|p| p.into_transport(job_key, peer_timeout, settings))
        .collect();
    Ok((transports, job_key))
}

/// The world communicators of an `n`-rank in-process job over the simulated fabric with
/// adaptive connections ([`AdaptiveTransport`]), `ports` ports per rank, with `settings`.
/// When `config` turns multicast on ([`Config::multicast_enabled`]), every communicator also
/// gets a UD multicast group ([`UdMulticast`]) on its rank's first port. Must be called inside a tokio runtime.
pub fn simulated_adaptive_world(
    n: usize,
    ports: usize,
    config: &Config,
    settings: AdaptiveSettings,
) -> Result<SimulatedJob, Error> {
    let SimulatedTransports {
        fabric,
        transports,
        ports,
        job_key,
    } = simulated_adaptive_transports(n, ports, config.peer_timeout, settings)
        .map_err(|e| Error::Transport(e.into()))?;
    let comms = transports
        .iter()
        .enumerate()
        .map(|(rank, t)| {
            let multicast = config.multicast_enabled().then(|| MulticastSetup {
                fabric: Arc::new(UdMulticast::new(
                    ports[rank][0].clone(),
                    UdMulticastSettings::default(),
                )),
                job_key,
            });
            Communicator::world_with_multicast(
                rank,
                n,
                t.clone() as Arc<dyn rankweave_core::Transport>,
                config.clone(),
                multicast,
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(SimulatedJob {
        fabric,
        comms,
        transports,
        ports,
    })
}
