//! Communicators over the verbs RC transport on the simulated fabric: point-to-point and
//! collectives end to end, as an application would use them.

mod common;

use common::{assert_pattern, pattern};
use rankweave::prelude::*;
use rankweave::{Config, Op};
use rankweave_transports::verbs::{self, RcSettings};

async fn run_ranks<F, Fut>(comms: Vec<Communicator>, f: F)
where
    F: Fn(Communicator) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let mut tasks = tokio::task::JoinSet::new();
    for comm in comms {
        tasks.spawn(f(comm));
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collectives_run_over_the_simulated_rc_transport() {
    let comms = verbs::simulated_world(5, &Config::default()).unwrap();
    run_ranks(comms, |comm| async move {
        let me = comm.rank();
        let n = comm.size();
        comm.barrier().await.unwrap();
        let sum = comm.all_reduce(&[me as u64, 1], Op::Sum).await.unwrap();
        assert_eq!(sum, [(n * (n - 1) / 2) as u64, n as u64]);
        // A broadcast large enough for the transport's rendezvous.
        let data = if me == 2 {
            pattern(9, 3 << 20)
        } else {
            Vec::new()
        };
        let got = comm.broadcast(2, data).await.unwrap();
        assert_pattern(&got, 9, 3 << 20);
        comm.barrier().await.unwrap();
        comm.shutdown().await;
    })
    .await;
}

/// A 64 MiB message through the message layer and the transport's RDMA rendezvous, with a
/// tiny credit window so eager traffic around it runs into flow control.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_64_mib_message_and_eager_traffic_with_a_tiny_window() {
    let settings = RcSettings {
        window: 4,
        ..RcSettings::default()
    };
    let (_fabric, comms) = verbs::simulated_world_with(2, &Config::default(), settings).unwrap();
    run_ranks(comms, |comm| async move {
        if comm.rank() == 0 {
            for i in 0..100u32 {
                comm.send(1, 1, i.to_le_bytes().to_vec()).await.unwrap();
            }
            comm.send(1, 2, pattern(64, 64 << 20)).await.unwrap();
            let ack = comm.recv(Source::Rank(1), Tag::Value(3)).await.unwrap();
            assert_eq!(ack.data(), &b"ok"[..]);
        } else {
            for i in 0..100u32 {
                let m = comm.recv(Source::Rank(0), Tag::Value(1)).await.unwrap();
                assert_eq!(m.data(), &i.to_le_bytes()[..]);
            }
            let big = comm.recv(Source::Rank(0), Tag::Value(2)).await.unwrap();
            assert_pattern(big.data(), 64, 64 << 20);
            comm.send(0, 3, b"ok".to_vec()).await.unwrap();
        }
        comm.shutdown().await;
    })
    .await;
}
