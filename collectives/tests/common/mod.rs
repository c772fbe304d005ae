//! Helpers shared by the collectives' integration tests.
#![allow(dead_code)]

use std::future::Future;
use std::time::Duration;

use rankweave_core::{Communicator, Config, TransportKind};
use rankweave_transports::{inproc, shm, udp};

/// How long a rank may take before the test counts it as hung.
pub const RANK_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs `f` on every rank of an `n`-rank in-process job built with `config` (over the
/// transport it names: in-process hand-off by default, shared-memory segments or UDP sockets)
/// and returns the results in rank order. A rank that does not finish within `limit` fails the test.
pub async fn job_within<T, F, Fut>(n: usize, config: &Config, limit: Duration, f: F) -> Vec<T>
where
    F: Fn(Communicator) -> Fut,
    Fut: Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let comms = match config.transport {
        TransportKind::Shm => shm::world(n, config),
        TransportKind::Udp => udp::world(n, config),
        _ => inproc::world(n, config),
    }
    .expect("world");
    let tasks: Vec<_> = comms.into_iter().map(|c| tokio::spawn(f(c))).collect();
    let mut out = Vec::new();
    for (rank, t) in tasks.into_iter().enumerate() {
        out.push(
            tokio::time::timeout(limit, t)
                .await
                .unwrap_or_else(|_| panic!("rank {rank} of {n} timed out"))
                .expect("rank panicked"),
        );
    }
    out
}

/// [`job_within`] with [`RANK_TIMEOUT`].
pub async fn job_with<T, F, Fut>(n: usize, config: &Config, f: F) -> Vec<T>
where
    F: Fn(Communicator) -> Fut,
    Fut: Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    job_within(n, config, RANK_TIMEOUT, f).await
}

/// [`job_with`] the default configuration.
pub async fn job<T, F, Fut>(n: usize, f: F) -> Vec<T>
where
    F: Fn(Communicator) -> Fut,
    Fut: Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    job_with(n, &Config::default(), f).await
}

/// What broadcast `b` of `len` bytes carries in the multicast broadcast tests.
pub fn bcast_payload(b: usize, len: usize) -> bytes::Bytes {
    bytes::Bytes::from(
        (0..len)
            .map(|i| (i as u8).wrapping_mul(13).wrapping_add(b as u8))
            .collect::<Vec<u8>>(),
    )
}

/// Runs `rounds` broadcasts on every rank of `comms` (root `b mod size`, sizes from 0 B to
/// 70 KB in turn), checks every rank's bytes, shuts each rank down and returns its multicast
/// counters. A rank that does not finish within [`RANK_TIMEOUT`] fails the test.
pub async fn broadcast_rounds(
    comms: Vec<Communicator>,
    rounds: usize,
) -> Vec<rankweave_collectives::BcastStats> {
    use rankweave_collectives::Collectives;
    let n = comms.len();
    let tasks: Vec<_> = comms
        .into_iter()
        .map(|comm| {
            tokio::spawn(async move {
                for b in 0..rounds {
                    let root = b % comm.size();
                    let len = [0, 1, 8, 5000, 70_000][b % 5];
                    let mine = if comm.rank() == root {
                        bcast_payload(b, len)
                    } else {
                        bytes::Bytes::new()
                    };
                    let got = comm.broadcast(root, mine).await.expect("broadcast");
                    assert_eq!(
                        got,
                        bcast_payload(b, len),
                        "rank {} broadcast {b}",
                        comm.rank()
                    );
                }
                let stats = comm.multicast_stats().expect("the engine ran");
                comm.shutdown().await;
                stats
            })
        })
        .collect();
    let mut out = Vec::new();
    for (rank, t) in tasks.into_iter().enumerate() {
        out.push(
            tokio::time::timeout(RANK_TIMEOUT, t)
                .await
                .unwrap_or_else(|_| panic!("rank {rank} of {n} timed out"))
                .expect("rank panicked"),
        );
    }
    out
}
