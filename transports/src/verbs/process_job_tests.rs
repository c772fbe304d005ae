//! Multi-process jobs over verbs with the processes played by tasks: each runs [`join_rank`]
//! over its own ports of one simulated fabric and an in-memory key-value space (a map behind
//! a mutex, the fence a barrier), as the launcher's processes do over PMI-1 or the rendezvous
//! service. Checks that the ranks reach each other (eager and rendezvous-sized messages,
//! over UD then RC), and that a peer is looked up only when it is talked to, once.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rankweave_core::{Carrier, Communicator, Config, Source, Tag, TransportError};

use super::process_job::{JoinedRank, ProcessRendezvous, join_rank};
use super::test_support::pattern;
use super::ud_directory::{UdDirectory, UdEndpoints};
use super::*;

/// The job's key-value space, shared by the "processes".
struct KeyValueSpace {
    records: Mutex<HashMap<u32, String>>,
    job_key: Mutex<Option<u64>>,
    fence: tokio::sync::Barrier,
    /// (who looked up, whom), in order.
    lookups: Mutex<Vec<(u32, u32)>>,
}

impl KeyValueSpace {
    fn new(size: u32) -> Arc<KeyValueSpace> {
        Arc::new(KeyValueSpace {
            records: Mutex::new(HashMap::new()),
            job_key: Mutex::new(None),
            fence: tokio::sync::Barrier::new(size as usize),
            lookups: Mutex::new(Vec::new()),
        })
    }

    fn lookups_by(&self, rank: u32) -> Vec<u32> {
        let mut v: Vec<u32> = self
            .lookups
            .lock()
            .unwrap()
            .iter()
            .filter(|(who, _)| *who == rank)
            .map(|(_, whom)| *whom)
            .collect();
        v.sort_unstable();
        v
    }
}

/// One process's handle on the space.
struct ProcessView {
    space: Arc<KeyValueSpace>,
    rank: u32,
}

impl UdDirectory for ProcessView {
    fn lookup_ud(&self, rank: u32) -> Result<UdEndpoints, TransportError> {
        self.space.lookups.lock().unwrap().push((self.rank, rank));
        let record = self.space.records.lock().unwrap().get(&rank).cloned();
        let record = record.ok_or(TransportError::PeerUnreachable(rank as usize))?;
        UdEndpoints::decode(&record).map_err(|_| TransportError::PeerUnreachable(rank as usize))
    }
}

impl ProcessRendezvous for ProcessView {
    async fn publish_ud(&self, rank: u32, endpoints: &UdEndpoints) -> Result<(), String> {
        let mut records = self.space.records.lock().unwrap();
        records.insert(rank, endpoints.encode());
        Ok(())
    }

    async fn meet(&self) -> Result<u64, String> {
        // As the launcher does: rank 0 draws the key before the fence, the others read it after.
        if self.rank == 0 {
            *self.space.job_key.lock().unwrap() = Some(rankweave_core::rng::random_u64());
        }
        self.space.fence.wait().await;
        self.space
            .job_key
            .lock()
            .unwrap()
            .ok_or_else(|| "rank 0 published no job key".to_string())
    }
}

fn settings() -> AdaptiveSettings {
    AdaptiveSettings {
        connect_after: Some(4),
        ..AdaptiveSettings::default()
    }
}

/// Joins `size` ranks with `ports` ports each on `fabric`, each in its own task.
async fn join_all(
    fabric: &SimFabric,
    space: &Arc<KeyValueSpace>,
    size: u32,
    ports: usize,
) -> Vec<JoinedRank<SimProvider>> {
    let mut joins = tokio::task::JoinSet::new();
    for rank in 0..size {
        let providers: Vec<SimProvider> = (0..ports).map(|_| fabric.open_port()).collect();
        let view = Arc::new(ProcessView {
            space: space.clone(),
            rank,
        });
        joins.spawn(async move {
            let joined = join_rank(
                providers,
                rank,
                size,
                Duration::from_secs(20),
                settings(),
                view,
            )
            .await
            .expect("join");
            (rank, joined)
        });
    }
    let mut joined: Vec<_> = joins.join_all().await;
    joined.sort_by_key(|(rank, _)| *rank);
    joined.into_iter().map(|(_, j)| j).collect()
}

/// Message lengths: eager over UD, eager over RC, and a rendezvous by RDMA.
const LENGTHS: [usize; 3] = [100, 5000, 3 << 20];

/// Sends every length to each of `peers` and receives every length from each, checking the
/// bytes (seed: sender · 1000 + receiver · 10 + length index).
async fn exchange(comm: &Communicator, peers: &[usize]) {
    let me = comm.rank();
    for (i, &len) in LENGTHS.iter().enumerate() {
        let tag = i as u32;
        let sends: Vec<_> = peers
            .iter()
            .map(|&p| comm.send(p, tag, pattern((me * 1000 + p * 10 + i) as u64, len)))
            .collect();
        for &p in peers {
            let m = comm.recv(Source::Rank(p), Tag::Value(tag)).await.unwrap();
            let want = pattern((p * 1000 + me * 10 + i) as u64, len);
            assert!(m.data() == &want[..], "{len} B from {p} at {me}");
        }
        for s in sends {
            s.await.unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_of_separate_processes_meet_in_the_key_value_space_and_look_peers_up_lazily() {
    let fabric = SimFabric::default();
    let space = KeyValueSpace::new(4);
    let joined = join_all(&fabric, &space, 4, 2).await;
    let key = joined[0].job_key;
    assert!(joined.iter().all(|j| j.job_key == key), "one job key");
    assert!(
        space.lookups.lock().unwrap().is_empty(),
        "nothing read at start-up"
    );
    let transports: Vec<_> = joined.iter().map(|j| j.transport.clone()).collect();
    // Ranks 0, 1 and 2 talk to each other; rank 3 only to rank 0.
    let peers: [&[usize]; 4] = [&[1, 2, 3], &[0, 2], &[0, 1], &[0]];
    let mut tasks = tokio::task::JoinSet::new();
    for (rank, j) in joined.into_iter().enumerate() {
        let comm = Communicator::world(rank, 4, j.transport, Config::default()).unwrap();
        tasks.spawn(async move {
            exchange(&comm, peers[rank]).await;
            comm.shutdown().await;
        });
    }
    tokio::time::timeout(Duration::from_secs(60), tasks.join_all())
        .await
        .expect("no hang");
    for (rank, t) in (0u32..).zip(&transports) {
        let want: Vec<u32> = peers[rank as usize].iter().map(|&p| p as u32).collect();
        assert_eq!(space.lookups_by(rank), want, "rank {rank} looked up");
        assert_eq!(t.counters().ud.lookups, want.len() as u64);
        for &p in &want {
            assert!(t.is_over_rc(p), "rank {rank} to {p} moved to RC");
        }
    }
    assert!(
        transports[0].rc().counters().channels.rendezvous_sent
            + transports[0].rc().counters().channels.read_rendezvous_sent
            > 0
    );
}

#[tokio::test]
async fn a_peer_missing_from_the_directory_is_unreachable_and_asked_again_later() {
    let fabric = SimFabric::default();
    let space = KeyValueSpace::new(2);
    let joined = join_all(&fabric, &space, 2, 1).await;
    // Rank 1's record disappears (a key-value space that lost it).
    let record = space.records.lock().unwrap().remove(&1).unwrap();
    let carrier = joined[0].transport.ud().carrier();
    assert_eq!(
        carrier.send(0, 1, &[&[0u8; 8]]),
        Err(TransportError::PeerUnreachable(1))
    );
    // Within the retry interval the directory is not asked again.
    assert_eq!(
        carrier.send(0, 1, &[&[0u8; 8]]),
        Err(TransportError::PeerUnreachable(1))
    );
    assert_eq!(space.lookups_by(0), [1]);
    // Out of range and itself: never asked.
    assert_eq!(
        carrier.send(0, 7, &[&[0u8; 8]]),
        Err(TransportError::PeerUnreachable(7))
    );
    assert!(carrier.send(0, 0, &[&[0u8; 8]]).is_err());
    assert_eq!(space.lookups_by(0), [1]);
    tokio::time::sleep(Duration::from_millis(250)).await;
    // The record is back: the next send asks again and gets through.
    space.records.lock().unwrap().insert(1, record);
    assert_eq!(carrier.send(0, 1, &[&[0u8; 8]]), Ok(()));
    assert_eq!(space.lookups_by(0), [1, 1]);
}

#[tokio::test]
async fn a_rank_outside_the_job_cannot_join() {
    let fabric = SimFabric::default();
    let space = KeyValueSpace::new(1);
    let view = Arc::new(ProcessView { space, rank: 2 });
    let e = join_rank(
        vec![fabric.open_port()],
        2,
        2,
        Duration::from_secs(1),
        settings(),
        view,
    )
    .await
    .err()
    .expect("rank 2 of 2");
    assert!(matches!(e, VerbsError::InvalidSetting(_)), "{e}");
}
