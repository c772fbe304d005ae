//! One-way latency of the shared-memory transport alone: two threads, pinned to cores 0 and
//! 1, ping-pong one-byte eager frames through two `ShmTransport`s of one process with
//! `Transport::send_eager` and `Transport::take_eager` — the calls the engine makes on a small
//! message's path — busy-polling `may_have_arrivals` in between, with no engine, futures or
//! runtime on the path. Set beside `rw-bench latency` (the whole stack) and
//! `bench/ring-publication.c` (the bare cache-line protocol), it says which layer a small
//! message's time goes to (the book's Performance chapter).
//!
//! ```text
//! cargo run --release -p rankweave-transports --example shm_transport_latency [ROUND_TRIPS]
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rankweave_core::frame::{Envelope, Frame, Header};
use rankweave_core::{ContextId, EagerWant, ShmConfig, Transport};
use rankweave_transports::shm::{LocalSegments, ShmTransport};

/// Pins the calling thread to `cpu` (best effort: unpinned if the call fails).
fn pin(cpu: usize) {
    // SAFETY: a zeroed `cpu_set_t` is a valid empty set; `CPU_SET` and `sched_setaffinity`
    // only read and write that local set, and 0 names the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

fn envelope(seq: u64) -> Envelope {
    Envelope {
        context: ContextId(1),
        tag: 1,
        seq,
        len: 1,
    }
}

/// Busy-polls until the frame `seq` from `from` is taken.
fn wait_for(t: &ShmTransport, from: u32, seq: u64) {
    let want = EagerWant {
        from,
        context: ContextId(1),
        tag: Some(1),
        seq,
        max_len: 64,
    };
    loop {
        if t.may_have_arrivals() && t.take_eager(&want, None).is_some() {
            return;
        }
        std::hint::spin_loop();
    }
}

fn main() {
    let n: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    // The transports' signal sockets need a tokio runtime to be created in.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let dir = Arc::new(LocalSegments::default());
    let ts: Vec<Arc<ShmTransport>> = rt.block_on(async {
        (0..2u32)
            .map(|r| {
                let t = ShmTransport::new(
                    r,
                    2,
                    ShmConfig::default(),
                    Duration::from_secs(5),
                    dir.clone(),
                )
                .expect("shared-memory transport");
                dir.publish(r, t.address());
                Arc::new(t)
            })
            .collect()
    });
    for t in &ts {
        // As while a rank busy-polls: nobody is signalled.
        t.begin_busy_poll();
    }
    // The first frame each way goes the usual way: it maps the peer's segment.
    for (a, b) in [(0usize, 1u32), (1, 0)] {
        let frame = Frame {
            header: Header::Eager(envelope(0)),
            payload: Bytes::from_static(b"x"),
        };
        ts[a].send(b, frame).expect("send");
    }
    wait_for(&ts[1], 0, 0);
    wait_for(&ts[0], 1, 0);
    let other = ts[1].clone();
    let echo = std::thread::spawn(move || {
        pin(1);
        for seq in 1..=n {
            wait_for(&other, 0, seq);
            assert_eq!(other.send_eager(0, &envelope(seq), &[b"x"]), Ok(true));
        }
    });
    pin(0);
    let start = Instant::now();
    for seq in 1..=n {
        assert_eq!(ts[0].send_eager(1, &envelope(seq), &[b"x"]), Ok(true));
        wait_for(&ts[0], 1, seq);
    }
    let elapsed = start.elapsed();
    echo.join().expect("echo thread");
    println!(
        "shared-memory transport, 1 byte: {:.1} ns one way ({n} round trips)",
        elapsed.as_nanos() as f64 / n as f64 / 2.0
    );
}
