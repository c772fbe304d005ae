use bytes::Bytes;
use rankweave::{Config, ProgressPolicy};
use std::time::Instant;
fn main() {
    let policy = match std::env::args().nth(1).as_deref() {
        Some("park") => ProgressPolicy::Park,
        Some("spin") => ProgressPolicy::Spin,
        _ => ProgressPolicy::SpinThenPark,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let cfg = Config {
            progress: policy,
            ..Config::default()
        };
        let messages = 64 * 50_000usize;
        let r = rankweave::local_with(cfg, 2, move |comm| async move {
            let payload = Bytes::from_static(&[7u8; 8]);
            let start = Instant::now();
            if comm.rank() == 0 {
                for _ in 0..messages {
                    comm.send(1, 0, payload.clone()).await.unwrap();
                }
            } else {
                let mut left = messages;
                while left > 0 {
                    let n = left.min(64);
                    let w: Vec<_> = (0..n).map(|_| comm.recv(0, 0)).collect();
                    for r in w {
                        r.await.unwrap();
                    }
                    left -= n;
                }
            }
            messages as f64 / start.elapsed().as_secs_f64() / 1e6
        })
        .await
        .unwrap();
        println!("{:?} Mmsg/s {:.3} (sender {:.3})", policy, r[1], r[0]);
    });
}
