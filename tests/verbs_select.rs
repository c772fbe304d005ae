//! `RANKWEAVE_TRANSPORT=verbs` in `rankweave::local_with` and in processes started by `rwrun`:
//! on a machine without an RDMA device (these), a typed "unavailable" error, never a panic,
//! a hang or a silent fallback; `auto` is not affected. With a device (`#[ignore]`d here), a
//! job of two processes runs over it.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{assert_every_rank_reported, example, run_with_deadline};
use rankweave::TransportKind;
use rankweave::core::TransportError;
use rankweave::{Config, Error};

fn config(transport: &str) -> Config {
    let t = transport.to_string();
    Config::default()
        .with_env(move |name| (name == "RANKWEAVE_TRANSPORT").then(|| t.clone()))
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verbs_without_a_device_is_a_typed_error() {
    let c = config("verbs");
    assert_eq!(c.transport, TransportKind::Verbs);
    let e = rankweave::local_with(c, 2, |comm| async move { comm.rank() })
        .await
        .expect_err("this machine has no RDMA device");
    match e {
        Error::Transport(TransportError::Unavailable { transport, reason }) => {
            assert_eq!(transport, "verbs");
            // Without the feature the build says so; with it, the device list is empty (or
            // `ibv_get_device_list` fails with ENOSYS).
            assert!(reason.contains(unavailable_reason()), "{reason}");
        }
        other => panic!("not the typed unavailable error: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_still_runs_in_process_without_a_device() {
    let ranks = rankweave::local_with(config("auto"), 3, |comm| async move { comm.rank() })
        .await
        .unwrap();
    assert_eq!(ranks, [0, 1, 2]);
}

/// What a build without the feature, or a machine without a device, says.
fn unavailable_reason() -> &'static str {
    if cfg!(feature = "verbs") {
        "no RDMA device"
    } else {
        "feature `verbs`"
    }
}

/// `rwrun -n 2 ring` with `RANKWEAVE_TRANSPORT=verbs`.
fn ring_over_verbs() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rwrun"));
    cmd.args(["-n", "2", "--no-tag-output"])
        .arg(example("ring"))
        .env("RANKWEAVE_TRANSPORT", "verbs");
    cmd
}

#[test]
fn verbs_between_processes_without_a_device_is_a_typed_error() {
    let out = run_with_deadline(ring_over_verbs(), Duration::from_secs(60));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the job cannot run here: {stderr}");
    assert!(
        stderr.contains("Unavailable") && stderr.contains(unavailable_reason()),
        "not the typed unavailable error:\n{stderr}"
    );
}

/// Two processes over the RDMA device named by `RANKWEAVE_VERBS_DEVICE` (the first when
/// unset): each publishes its UD endpoints through `rwrun`'s rendezvous and finds the other
/// on first contact.
#[test]
#[ignore = "needs an RDMA device (RANKWEAVE_VERBS_DEVICE) and --features verbs"]
fn two_processes_run_a_ring_over_the_rdma_device() {
    let out = run_with_deadline(ring_over_verbs(), Duration::from_secs(60));
    assert_every_rank_reported(&out, 2, "5 hops, payload checked at every hop");
}
