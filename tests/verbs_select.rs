//! `RANKWEAVE_TRANSPORT=verbs` in `rankweave::local_with`: on a machine without an RDMA device
//! (these), a typed "unavailable" error, never a panic or a silent fallback; `auto` is not
//! affected.

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
            let expected = if cfg!(feature = "verbs") {
                "no RDMA device"
            } else {
                "feature `verbs`"
            };
            assert!(reason.contains(expected), "{reason}");
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
