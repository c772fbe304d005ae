use std::time::Instant;
use bytes::Bytes;
use rankweave_core::protocol::{Endpoint, EndpointConfig};
use rankweave_core::matching::Selector;
use rankweave_core::{Arrival, ContextId};
fn main() {
    let cfg = |rank| EndpointConfig { rank, size: 2, eager_limit: 65536, unexpected_limit: 64 << 20, max_payload: usize::MAX };
    let mut a = Endpoint::new(cfg(0));
    let mut b = Endpoint::new(cfg(1));
    let payload = Bytes::from_static(&[7u8; 8]);
    let sel = Selector { context: ContextId(0), source: Some(0), tag: Some(0) };
    for mode in std::env::args().skip(1).collect::<Vec<_>>().iter().map(|s| s.as_str()).chain(if std::env::args().len() > 1 { vec![] } else { vec!["unexpected-first", "posted-first"] }) {
        let n = 2_000_000;
        let t = Instant::now();
        let mut ids = Vec::with_capacity(64);
        for _ in 0..n / 64 {
            if mode == "posted-first" { for _ in 0..64 { ids.push(b.post_recv(sel, None)); } }
            for _ in 0..64 {
                a.post_send(1, ContextId(0), 0, payload.clone()).unwrap();
                while let Some((_, f)) = a.poll_transmit() { b.handle(Arrival::Frame { from: 0, frame: f }); }
            }
            if mode == "unexpected-first" { for _ in 0..64 { ids.push(b.post_recv(sel, None)); } }
            for id in ids.drain(..) { b.take_recv(id).unwrap().unwrap(); }
            while let Some(_) = b.poll_event() {}
            while let Some((_, f)) = b.poll_transmit() { a.handle(Arrival::Frame { from: 1, frame: f }); }
        }
        println!("{mode}: {:.1} ns per message", t.elapsed().as_nanos() as f64 / n as f64);
    }
}
