//! Multi-process jobs over verbs: one process is one rank, and the ranks meet in the job's
//! key-value space (what `RANKWEAVE_TRANSPORT=verbs` selects in `rankweave::init`).
//!
//! Start-up follows Yu's scalable pattern ([`join_rank`]): each rank opens its ports, creates
//! one UD queue pair per port, publishes its [`UdEndpoints`] (O(1) data: the queue key and one
//! LID, GID and queue pair number per port), waits once for everyone (the fence, which also
//! agrees on the job key), and builds an [`AdaptiveTransport`] whose UD carrier looks a
//! peer's endpoints up the first time it sends to that peer or hears from it. RC connections
//! are made later still, on demand, by the connection manager over UD. A rank that talks to
//! three neighbours looks up three records and holds three link states, not N.
//!
//! The routine is generic over the [`Provider`] and the key-value space
//! ([`ProcessRendezvous`]): the launcher implements it over PMI-1 or its rendezvous service,
//! the tests over a map in memory with the ranks as tasks on one simulated fabric.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::adaptive::{AdaptiveParts, AdaptiveSettings, AdaptiveTransport};
use super::error::VerbsError;
use super::provider::Provider;
use super::shared_port::SharedPort;
use super::ud_directory::{UdDirectory, UdEndpoints};

/// The job's key-value space as a joining rank uses it: publish, meet everyone once, and
/// (through [`UdDirectory`]) read a peer's endpoints on first contact.
pub trait ProcessRendezvous: UdDirectory {
    /// Publishes rank `rank`'s UD endpoints.
    fn publish_ud(
        &self,
        rank: u32,
        endpoints: &UdEndpoints,
    ) -> impl Future<Output = Result<(), String>> + Send;

    /// Waits for every rank of the job (the start-up fence, after which every rank's
    /// endpoints can be read) and returns the job key every rank agreed on.
    fn meet(&self) -> impl Future<Output = Result<u64, String>> + Send;
}

/// A rank that joined a multi-process job over verbs.
pub struct JoinedRank<P: Provider> {
    /// Its transport.
    pub transport: Arc<AdaptiveTransport<P>>,
    /// Its ports (route order), for multicast groups and fault injection.
    pub ports: Vec<SharedPort<P>>,
    /// The job's key.
    pub job_key: u64,
}

/// Joins rank `rank` of a `size`-rank job over `providers` (its ports: at least one, at most
/// [`MAX_LANES`](super::stream::MAX_LANES)) with `settings` and the link layer's
/// `peer_timeout`, meeting the other ranks in `directory` (see the [module docs](self)). Must
/// be called inside a tokio runtime.
pub async fn join_rank<P: Provider, D: ProcessRendezvous>(
    providers: Vec<P>,
    rank: u32,
    size: u32,
    peer_timeout: Duration,
    settings: AdaptiveSettings,
    directory: Arc<D>,
) -> Result<JoinedRank<P>, VerbsError> {
    if rank >= size {
        return Err(VerbsError::InvalidSetting(format!(
            "rank {rank} of a job of {size}"
        )));
    }
    let ports: Vec<SharedPort<P>> = providers.into_iter().map(SharedPort::new).collect();
    let parts = AdaptiveParts::open(&ports, rank, size, &settings)?;
    directory
        .publish_ud(rank, &parts.carrier.endpoints())
        .await
        .map_err(|message| VerbsError::Directory {
            step: "publishing this rank's UD endpoints",
            message,
        })?;
    let job_key = directory
        .meet()
        .await
        .map_err(|message| VerbsError::Directory {
            step: "waiting for the other ranks at start-up",
            message,
        })?;
    let parts = AdaptiveParts {
        carrier: parts.carrier.with_directory(directory, job_key),
        rc: parts.rc,
    };
    Ok(JoinedRank {
        transport: parts.into_transport(job_key, peer_timeout, settings),
        ports,
        job_key,
    })
}
