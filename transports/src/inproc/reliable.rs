//! In-process ranks over the reliability layer: each rank's frames are encoded, sent as
//! datagrams through an [`InprocCarrierFabric`] (optionally wrapped in a
//! [`ChaosCarrier`]) and checked, acknowledged and retransmitted like over UDP.
//!
//! This is what `RANKWEAVE_RELIABILITY=on` or a `RANKWEAVE_CHAOS` spec selects for an in-process
//! job: it measures what the reliability layer costs without any socket, and lets the layers
//! above be tested against loss, corruption and reordering inside one process.

use std::sync::Arc;

use rankweave_core::{Communicator, Config, Error, Transport};

use super::carrier::InprocCarrierFabric;
use crate::chaos::ChaosCarrier;
use crate::link::{LinkTransport, LinkTransportConfig};

/// Datagram size of the in-process carrier: what UDP allows, so both behave alike.
pub const DATAGRAM: usize = 65_507;

/// The world communicators of an `n`-rank in-process job whose frames go through the reliability
/// layer (if [`Config::reliability`] is not `Some(false)`) and `config.chaos`, rank order.
///
/// Must be called inside a tokio runtime with time enabled.
pub fn reliable_world(n: usize, config: &Config) -> Result<Vec<Communicator>, Error> {
    if n == 0 {
        return Err(Error::InvalidArgument(
            "a job needs at least one rank".into(),
        ));
    }
    let size = u32::try_from(n).map_err(|_| Error::InvalidArgument(format!("{n} ranks")))?;
    let routes = config.routes.len().max(1);
    let fabric = InprocCarrierFabric::new(n, routes, DATAGRAM);
    let job_key = rankweave_core::rng::random_u64();
    (0..n)
        .map(|rank| {
            let carrier = fabric
                .carrier(rank)
                .ok_or(Error::InvalidRank { rank, size: n })?;
            let mut lc = LinkTransportConfig::new(rank as u32, size, job_key)
                .with_peer_timeout(config.peer_timeout)
                .with_window(config.link_window);
            lc.reliability = config.reliability != Some(false);
            let transport: Arc<dyn Transport> = match &config.chaos {
                Some(spec) => {
                    let mut spec = spec.clone();
                    // Each rank draws its own faults.
                    spec.seed = spec.seed.wrapping_add(rank as u64);
                    Arc::new(LinkTransport::new(ChaosCarrier::new(carrier, spec), lc))
                }
                None => Arc::new(LinkTransport::new(carrier, lc)),
            };
            let multicast = crate::ipmcast::setup(config, rank as u32, job_key);
            Communicator::world_with_multicast(rank, n, transport, config.clone(), multicast)
        })
        .collect()
}
