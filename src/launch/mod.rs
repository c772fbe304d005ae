//! Starting ranks: in-process jobs ([`local`]) and multi-process jobs ([`init`]) started by
//! `rwrun`, MPICH's `mpiexec` (PMI-1), Open MPI's `mpirun`, Slurm or torchrun-style launchers.

pub mod detect;
mod directory;
mod job;
pub mod kvs;
pub mod pmi;
pub mod rwrun;

use std::future::Future;

use rankweave_core::{Communicator, Config, Error, TransportKind};
use rankweave_transports::{inproc, shm, udp};

/// Runs `n` ranks as tokio tasks of this process and returns their results in rank order.
///
/// Each rank gets its world [`Communicator`]; traffic between them goes over the in-process
/// transport (zero-copy), with `RANKWEAVE_TRANSPORT=udp` over UDP sockets of their own
/// (one per route in `RANKWEAVE_ROUTES`), or with `RANKWEAVE_TRANSPORT=shm` through
/// shared-memory segments of their own, exactly as processes would; with
/// `RANKWEAVE_TRANSPORT=verbs` over the RDMA device (`RANKWEAVE_VERBS_DEVICE`, the first when
/// unset; a build without the feature `verbs`, or a machine without a device, gives
/// [`Error::Transport`] with `TransportError::Unavailable`). `auto` never picks verbs. With `RANKWEAVE_RELIABILITY=on` or a
/// `RANKWEAVE_CHAOS` spec, in-process ranks exchange datagrams through the reliability layer
/// instead of handing frames over. Settings come from the environment ([`Config::from_env`]). If a rank
/// panics, its peers see [`Error::PeerFailed`] for operations that involve it, and `local`
/// returns [`Error::RankPanicked`] naming the first rank that did.
pub async fn local<F, Fut, T>(n: usize, f: F) -> Result<Vec<T>, Error>
where
    F: FnMut(Communicator) -> Fut,
    Fut: Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    local_with(Config::from_env()?, n, f).await
}

/// [`local`] with an explicit configuration.
pub async fn local_with<F, Fut, T>(config: Config, n: usize, mut f: F) -> Result<Vec<T>, Error>
where
    F: FnMut(Communicator) -> Fut,
    Fut: Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let comms = match config.transport {
        TransportKind::Udp => udp::world(n, &config)?,
        TransportKind::Shm => shm::world(n, &config)?,
        TransportKind::Auto | TransportKind::Inproc
            if config.reliability_for(TransportKind::Inproc) || config.chaos.is_some() =>
        {
            inproc::reliable::reliable_world(n, &config)?
        }
        TransportKind::Auto | TransportKind::Inproc => inproc::world(n, &config)?,
        // The real device only: the simulated fabric is for tests. Without the feature or a
        // device this is a typed `TransportError::Unavailable`.
        TransportKind::Verbs => rankweave_transports::verbs::device_world(n, &config)?,
    };
    let mut tasks = tokio::task::JoinSet::new();
    let mut rank_of = std::collections::HashMap::new();
    for (rank, comm) in comms.into_iter().enumerate() {
        let handle = tasks.spawn(f(comm));
        rank_of.insert(handle.id(), rank);
    }
    let mut results: Vec<Option<T>> = (0..n).map(|_| None).collect();
    let mut failure = None;
    // In completion order, so the rank reported is the first to fail, not the lowest-numbered
    // (whose failure may only be a consequence).
    while let Some(joined) = tasks.join_next_with_id().await {
        match joined {
            Ok((id, v)) => {
                if let Some(&rank) = rank_of.get(&id) {
                    results[rank] = Some(v);
                }
            }
            Err(e) => {
                let rank = rank_of.get(&e.id()).copied().unwrap_or(usize::MAX);
                let message = if e.is_panic() {
                    let p = e.into_panic();
                    p.downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| p.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "non-string panic".into())
                } else {
                    "task cancelled".into()
                };
                failure.get_or_insert(Error::RankPanicked { rank, message });
            }
        }
    }
    match failure {
        Some(e) => Err(e),
        None => Ok(results.into_iter().flatten().collect()),
    }
}

/// Joins the job this process belongs to and returns its world communicator.
///
/// How the process was started is read from its environment, in this order (see
/// [`detect`](detect::detect) and the book's "Launching" chapter): explicit
/// `RANKWEAVE_RANK`/`RANKWEAVE_SIZE`/`RANKWEAVE_RENDEZVOUS`; PMI-1 (`mpiexec.mpich`, Slurm's
/// PMI-1 plugin); `rwrun`; Open MPI, Slurm or torchrun-style variables plus a rendezvous
/// address; otherwise a singleton (rank 0 of 1). A half-set environment is an
/// [`Error::Launch`] naming what is missing.
///
/// Processes talk over UDP with the reliability layer. Start-up publishes this rank's
/// endpoints and waits for every rank once; peers are looked up and linked on first contact.
/// Call [`finalize`] before the process exits.
pub async fn init() -> Result<Communicator, Error> {
    init_with(Config::from_env()?).await
}

/// [`init`] with an explicit configuration (the launcher is still read from the environment).
pub async fn init_with(config: Config) -> Result<Communicator, Error> {
    let bootstrap = detect::detect_from_env()?;
    init_job(config, bootstrap).await
}

/// Joins the job `bootstrap` describes, with `config`: the fully explicit form of [`init`].
pub async fn init_job(config: Config, bootstrap: detect::Bootstrap) -> Result<Communicator, Error> {
    match bootstrap {
        detect::Bootstrap::Singleton => {
            let mut comms = inproc::world(1, &config)?;
            comms.pop().ok_or(Error::Shutdown)
        }
        other => job::join(config, other).await,
    }
}

/// Ends this process's part in the job: waits until everything this rank sent was delivered
/// ([`Communicator::shutdown`]), meets every other rank once more (so no one exits while a
/// peer may still need it, as with `MPI_Finalize`) and leaves the launcher's key-value space.
/// Call it once, with no operation outstanding, before the process exits; the communicator
/// and its clones stop working.
pub async fn finalize(world: Communicator) -> Result<(), Error> {
    world.shutdown().await;
    job::leave().await
}
