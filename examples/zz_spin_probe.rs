use rankweave::{Config, ProgressPolicy};
use std::time::Instant;
fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let cfg = Config {
            progress: ProgressPolicy::Spin,
            ..Config::default()
        };
        rankweave::local_with(cfg, 2, |comm| async move {
            let other = 1 - comm.rank();
            for block in 0..60 {
                let t = Instant::now();
                for _ in 0..1000 {
                    if comm.rank() == 0 {
                        comm.send(other, 0, vec![1u8; 8]).await.unwrap();
                        comm.recv(other, 0).await.unwrap();
                    } else {
                        let m = comm.recv(other, 0).await.unwrap();
                        comm.send(other, 0, m.into_data()).await.unwrap();
                    }
                }
                if comm.rank() == 0 {
                    println!(
                        "block {block}: {:.3} us one-way",
                        t.elapsed().as_secs_f64() * 1e6 / 2000.0
                    );
                }
            }
        })
        .await
        .unwrap();
    });
}
