use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use super::*;

fn pair() -> (UdpCarrier, UdpCarrier) {
    let s = UdpSettings::default();
    let a = UdpCarrier::bind(0, &s).unwrap();
    let b = UdpCarrier::bind(1, &s).unwrap();
    a.add_peer(1, &b.local_addrs());
    b.add_peer(0, &a.local_addrs());
    (a, b)
}

/// Receives until `n` datagrams arrived (loopback delivery is immediate, but allow a moment).
fn recv_n(c: &UdpCarrier, n: usize) -> Vec<Datagram> {
    let mut out = Vec::new();
    let until = Instant::now() + Duration::from_secs(5);
    while out.len() < n && Instant::now() < until {
        c.recv(&mut out).unwrap();
    }
    out
}

#[tokio::test]
async fn gathered_parts_arrive_as_one_datagram_from_a_known_rank() {
    let (a, b) = pair();
    a.send(0, 1, &[b"head", b"", b"payload"]).unwrap();
    let got = recv_n(&b, 1);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].from, Some(0));
    assert_eq!(got[0].route, 0);
    assert_eq!(&got[0].bytes[..], b"headpayload");
}

#[tokio::test]
async fn large_datagrams_keep_their_buffer_and_small_ones_are_copied() {
    let (a, b) = pair();
    let big = vec![7u8; COPY_THRESHOLD + 100];
    a.send(0, 1, &[&big]).unwrap();
    a.send(0, 1, &[b"x"]).unwrap();
    let got = recv_n(&b, 2);
    assert_eq!(got.len(), 2);
    assert_eq!(&got[0].bytes[..], &big[..]);
    assert_eq!(&got[1].bytes[..], b"x");
}

#[tokio::test]
async fn a_dropped_large_datagram_lends_its_buffer_to_the_next() {
    let (a, b) = pair();
    let first = vec![1u8; 50_000];
    a.send(0, 1, &[&first]).unwrap();
    let got = recv_n(&b, 1);
    assert_eq!(&got[0].bytes[..], &first[..]);
    let addr = got[0].bytes.as_ptr();
    // Still held: the next datagram needs a buffer of its own.
    let second = vec![2u8; 50_000];
    a.send(0, 1, &[&second]).unwrap();
    let held = recv_n(&b, 1);
    let addrs = [addr, held[0].bytes.as_ptr()];
    assert_ne!(addrs[0], addrs[1]);
    assert_eq!(&held[0].bytes[..], &second[..]);
    assert_eq!(b.buffers.kept(), 0);
    drop(got);
    drop(held);
    assert_eq!(
        b.buffers.kept(),
        2 << 16,
        "both 64 KiB buffers are back in the pool"
    );
    // Both went back to the pool (the carrier holds a third as its next receive buffer): of
    // the next two receives, one lands in one of them.
    let third = vec![3u8; 50_000];
    a.send(0, 1, &[&third]).unwrap();
    a.send(0, 1, &[&third]).unwrap();
    let again = recv_n(&b, 2);
    assert!(
        again.iter().any(|d| addrs.contains(&d.bytes.as_ptr())),
        "a pooled buffer is reused"
    );
    assert!(again.iter().all(|d| d.bytes[..] == third[..]));
}

/// Bytes `0..len` of a pattern that differs from page to page (a misplaced page shows).
fn pattern(len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i % 251) as u8 ^ (i >> 12) as u8)
        .collect()
}

fn pair_on(ip: IpAddr) -> Option<(UdpCarrier, UdpCarrier)> {
    let s = UdpSettings {
        routes: vec![ip],
        ..UdpSettings::default()
    };
    let a = UdpCarrier::bind(0, &s).ok()?;
    let b = UdpCarrier::bind(1, &s).ok()?;
    a.add_peer(1, &b.local_addrs());
    b.add_peer(0, &a.local_addrs());
    Some((a, b))
}

#[tokio::test]
async fn held_payloads_arrive_intact_at_any_alignment_and_nothing_stays_corked() {
    let v6 = IpAddr::from(std::net::Ipv6Addr::LOCALHOST);
    for ip in [IpAddr::from([127, 0, 0, 1]), v6] {
        let Some((a, b)) = pair_on(ip) else {
            assert_eq!(ip, v6, "IPv4 loopback must work");
            continue; // no IPv6 loopback on this machine
        };
        let memory = pattern(300_000);
        let head = b"frame header";
        let max = a.max_datagram() - head.len();
        // At every alignment (spliced when the payload spans at most 15 pages, copied when
        // 16), odd and even lengths, at and around the splicing threshold, and a small one.
        let sweep = (0..4096)
            .step_by(97)
            .flat_map(|o| [(o, max), (o, max - 101)]);
        for (offset, len) in sweep.chain([
            (8192 + 7, 50_000),
            (1, splice::SPLICE_MIN),
            (3, splice::SPLICE_MIN - 1),
            (5, 10),
        ]) {
            let held = &memory[offset..offset + len];
            a.send_held(0, 1, &[head, b""], held).unwrap();
            // A plain send right behind it must be a datagram of its own.
            a.send(0, 1, &[b"next"]).unwrap();
            let got = recv_n(&b, 2);
            assert_eq!(got.len(), 2, "{ip} offset {offset} len {len}");
            assert_eq!(&got[0].bytes[..head.len()], head);
            assert!(
                got[0].bytes[head.len()..] == *held,
                "{ip} offset {offset} len {len}: payload differs"
            );
            assert_eq!(&got[1].bytes[..], b"next");
        }
        let (used, _) = a.destination(0, 1, 0).unwrap();
        assert_eq!(
            used.splices(),
            ip.is_ipv4(),
            "{ip}: large payloads are spliced over IPv4 (and copied over IPv6)"
        );
    }
}

#[tokio::test]
async fn a_spliced_payload_is_read_from_the_senders_memory_when_it_is_received() {
    // What makes splicing zero-copy is also its contract: the kernel reads the payload when
    // the receiver takes the datagram, so bytes changed before then arrive changed. (The
    // reliability layer holds DATA payloads until acknowledged, and its CRC would reject such
    // a datagram.) Over loopback the receiver reads at `recv`, so the change shows.
    let (a, b) = pair();
    let mut payload = vec![1u8; 40_000];
    a.send_held(0, 1, &[b"h"], &payload).unwrap();
    payload.fill(2);
    let got = recv_n(&b, 1);
    assert_eq!(got.len(), 1);
    assert!(
        got[0].bytes[1..].iter().all(|&x| x == 2),
        "read by reference"
    );
    // A copied send is not affected.
    let mut small = vec![1u8; 1000];
    a.send_held(0, 1, &[b"h"], &small).unwrap();
    small.fill(2);
    let got = recv_n(&b, 1);
    assert!(got[0].bytes[1..].iter().all(|&x| x == 1), "copied at send");
}

#[tokio::test]
async fn a_bounded_receive_stops_at_its_limit_and_says_more_may_wait() {
    let (a, b) = pair();
    for i in 0..3u8 {
        a.send(0, 1, &[&[i]]).unwrap();
    }
    // Loopback delivers before `send` returns; wait for all three all the same.
    let until = Instant::now() + Duration::from_secs(5);
    let mut out = Vec::new();
    let mut first = (0, false);
    while first.0 == 0 && Instant::now() < until {
        first = b.recv_up_to(&mut out, 1).unwrap();
    }
    assert_eq!(first, (1, true), "one datagram, and maybe more behind it");
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(
        b.recv_up_to(&mut out, 64).unwrap(),
        (2, false),
        "the rest, then empty"
    );
    assert_eq!(b.recv_up_to(&mut out, 64).unwrap(), (0, false));
    let got: Vec<u8> = out.iter().map(|d| d.bytes[0]).collect();
    assert_eq!(got, [0, 1, 2], "in order");
}

#[tokio::test]
async fn unknown_senders_are_not_attributed() {
    let (_a, b) = pair();
    let stranger = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    stranger.send_to(b"hello", b.local_addrs()[0]).unwrap();
    let got = recv_n(&b, 1);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].from, None);
}

#[tokio::test]
async fn bad_sends_are_errors() {
    let (a, _b) = pair();
    assert_eq!(
        a.send(0, 5, &[b"x"]),
        Err(TransportError::PeerUnreachable(5))
    );
    assert_eq!(
        a.send(3, 1, &[b"x"]),
        Err(TransportError::PeerUnreachable(1))
    );
    let too_big = vec![0u8; a.max_datagram() + 1];
    assert!(matches!(
        a.send(0, 1, &[&too_big]),
        Err(TransportError::Io { .. })
    ));
    a.close();
    assert_eq!(a.send(0, 1, &[b"x"]), Err(TransportError::Closed));
}

#[tokio::test]
async fn oversized_datagrams_are_cut_to_one_byte_over_the_limit() {
    let s = UdpSettings {
        max_datagram: 1000,
        ..UdpSettings::default()
    };
    let b = UdpCarrier::bind(1, &s).unwrap();
    let stranger = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    stranger.send_to(&[1u8; 3000], b.local_addrs()[0]).unwrap();
    let got = recv_n(&b, 1);
    // The layer above sees a datagram longer than any packet it sends and drops it.
    assert_eq!(got[0].bytes.len(), 1001);
}

#[tokio::test]
async fn readiness_wakes_and_clears() {
    let (a, b) = pair();
    let waker = Waker::noop();
    let mut cx = Context::from_waker(waker);
    // Nothing there: pending (and the stale state is cleared).
    assert_eq!(b.poll_recv_ready(&mut cx), Poll::Pending);
    a.send(0, 1, &[b"ping"]).unwrap();
    let until = Instant::now() + Duration::from_secs(5);
    let ready = tokio::time::timeout(
        Duration::from_secs(5),
        std::future::poll_fn(|cx| b.poll_recv_ready(cx)),
    )
    .await;
    assert!(ready.is_ok() && Instant::now() < until);
    assert_eq!(recv_n(&b, 1).len(), 1);
    assert_eq!(b.poll_recv_ready(&mut cx), Poll::Pending);
}

#[tokio::test]
async fn several_routes_bind_on_their_own_addresses() {
    let s = UdpSettings {
        routes: vec![IpAddr::from([127, 0, 0, 1]), IpAddr::from([127, 0, 0, 2])],
        ..UdpSettings::default()
    };
    let a = UdpCarrier::bind(0, &s).unwrap();
    let b = UdpCarrier::bind(1, &s).unwrap();
    a.add_peer(1, &b.local_addrs());
    b.add_peer(0, &a.local_addrs());
    assert_eq!(a.routes(), 2);
    assert_eq!(b.local_addrs()[1].ip(), IpAddr::from([127, 0, 0, 2]));
    a.send(1, 1, &[b"second"]).unwrap();
    a.send(0, 1, &[b"first"]).unwrap();
    let mut got = recv_n(&b, 2);
    got.sort_by_key(|d| d.route);
    assert_eq!((got[0].route, &got[0].bytes[..]), (0, &b"first"[..]));
    assert_eq!((got[1].route, &got[1].bytes[..]), (1, &b"second"[..]));
    assert!(got.iter().all(|d| d.from == Some(0)));
}

/// A directory that answers from a table and counts the questions.
struct Table {
    addrs: std::collections::HashMap<u32, Vec<SocketAddr>>,
    asked: std::sync::atomic::AtomicUsize,
}

impl PeerDirectory for Table {
    fn lookup(&self, rank: u32) -> Result<Vec<SocketAddr>, TransportError> {
        self.asked.fetch_add(1, Ordering::Relaxed);
        self.addrs
            .get(&rank)
            .cloned()
            .ok_or(TransportError::PeerUnreachable(rank as usize))
    }
}

/// The first 24 bytes of a link packet of job `key` from `source` (all the carrier looks at).
fn header(key: u64, source: u32) -> Vec<u8> {
    let mut h = vec![0u8; 24];
    h[..2].copy_from_slice(b"RL");
    h[8..16].copy_from_slice(&key.to_le_bytes());
    h[16..20].copy_from_slice(&source.to_le_bytes());
    h
}

#[tokio::test]
async fn peers_are_discovered_on_first_contact_and_claims_are_checked() {
    let s = UdpSettings::default();
    let a = UdpCarrier::bind(0, &s).unwrap();
    let b = UdpCarrier::bind(1, &s).unwrap();
    let stranger = UdpCarrier::bind(2, &s).unwrap();
    let table = Arc::new(Table {
        addrs: [
            (0, a.local_addrs()),
            (1, b.local_addrs()),
            (2, stranger.local_addrs()),
        ]
        .into_iter()
        .collect(),
        asked: Default::default(),
    });
    let key = 0xfeed_beef;
    let a = a.with_directory(table.clone(), key, 3);
    let b = b.with_directory(table.clone(), key, 3);

    // a has never heard of b: the send looks b up, once.
    a.send(0, 1, &[&header(key, 0), b"hello"]).unwrap();
    a.send(0, 1, &[&header(key, 0), b"again"]).unwrap();
    assert_eq!(table.asked.load(Ordering::Relaxed), 1);
    // b has never heard of a: the packet's claim (job key, source 0) is checked against the
    // directory and a's address, so it is attributed to rank 0; the second needs no lookup.
    let got = recv_n(&b, 2);
    assert_eq!(
        got.iter().map(|d| d.from).collect::<Vec<_>>(),
        [Some(0), Some(0)]
    );
    assert_eq!(table.asked.load(Ordering::Relaxed), 2);

    // Another job's key, a packet claiming to be rank 0 from rank 2's address, a rank outside
    // the job and a non-link datagram all stay foreign.
    stranger.add_peer(1, &b.local_addrs());
    stranger.send(0, 1, &[&header(key + 1, 2)]).unwrap();
    stranger.send(0, 1, &[&header(key, 0)]).unwrap();
    stranger.send(0, 1, &[&header(key, 7)]).unwrap();
    stranger.send(0, 1, &[b"not a link packet at all"]).unwrap();
    let got = recv_n(&b, 4);
    assert_eq!(got.len(), 4);
    assert!(got.iter().all(|d| d.from.is_none()), "{got:?}");

    // A rank the directory does not know: the send fails with a typed error, and the failure
    // is remembered for a moment instead of asking again at once.
    let lonely = UdpCarrier::bind(0, &s).unwrap().with_directory(
        Arc::new(Table {
            addrs: Default::default(),
            asked: Default::default(),
        }),
        key,
        3,
    );
    for _ in 0..3 {
        assert!(matches!(
            lonely.send(0, 2, &[b"x"]),
            Err(TransportError::PeerUnreachable(2))
        ));
    }
}

#[test]
fn a_default_data_fragment_can_always_be_sent_segmented() {
    // The default datagram leaves a DATA fragment 14 pages of payload: at any alignment that
    // spans at most `SEGMENT_MAX_PAGES` pages.
    let payload = DEFAULT_DATAGRAM
        - rankweave_core::reliability::Packet::max_data_header_len()
        - rankweave_core::wire::MAX_HEADER_LEN;
    assert_eq!(payload, 14 * 4096);
    let memory = vec![0u8; payload + 3 * 4096];
    // Offsets from the first page boundary in `memory`.
    let page = (4096 - memory.as_ptr() as usize % 4096) % 4096;
    for offset in [0, 1, 100, 4095, 4096, 8191] {
        let at = page + offset;
        assert!(splice::segmentable(&memory[at..at + payload]), "{offset}");
    }
    let at = page + 4095;
    assert!(
        !splice::segmentable(&memory[at..at + payload + 2]),
        "two bytes more from the end of a page span 16 pages"
    );
}

#[tokio::test]
async fn a_peers_datagrams_move_to_its_lane_without_reordering() {
    let (a, b) = pair();
    // More than one receive call reads from a socket, so the route socket still holds some
    // when the lane has datagrams too.
    let before = 2 * PER_SOCKET as u8 + 3;
    for i in 0..before {
        a.send(0, 1, &[&[i]]).unwrap();
    }
    assert_eq!(a.lanes_open(), 1, "the first send opened a lane to b");
    // b has no lane yet: these wait on its route socket. Taking one makes b open a lane to a.
    let mut out = Vec::new();
    let until = Instant::now() + Duration::from_secs(5);
    while out.is_empty() && Instant::now() < until {
        b.recv_up_to(&mut out, 1).unwrap();
    }
    assert_eq!(b.lanes_open(), 1, "a known peer heard from gets a lane");
    for i in before..before + 3 {
        a.send(0, 1, &[&[i]]).unwrap();
    }
    std::thread::sleep(Duration::from_millis(20));
    out.extend(recv_n(&b, usize::from(before) + 2));
    let got: Vec<u8> = out.iter().map(|d| d.bytes[0]).collect();
    let sent: Vec<u8> = (0..before + 3).collect();
    assert_eq!(got, sent, "in order across the move");
    assert!(out.iter().all(|d| d.from == Some(0) && d.route == 0));
    // The lane, not the route socket, gets what a sends now; a stranger still reaches the
    // route socket and stays a stranger.
    a.send(0, 1, &[b"lane"]).unwrap();
    let stranger = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    stranger.send_to(b"who", b.local_addrs()[0]).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let mut buf = Vec::new();
    let (n, from) = b.sockets[0].recv_into(&mut buf, 100).unwrap().unwrap();
    assert_eq!(
        (&buf[..n], from),
        (&b"who"[..], stranger.local_addr().unwrap())
    );
    assert_eq!(b.sockets[0].recv_into(&mut buf, 100).unwrap(), None);
    let got = recv_n(&b, 1);
    assert_eq!((&got[0].bytes[..], got[0].from), (&b"lane"[..], Some(0)));
}

#[tokio::test]
async fn lanes_stop_at_the_limit_and_the_route_socket_serves_the_rest() {
    let s = UdpSettings {
        max_lanes: 1,
        ..UdpSettings::default()
    };
    let c: Vec<UdpCarrier> = (0..3).map(|r| UdpCarrier::bind(r, &s).unwrap()).collect();
    for (i, x) in c.iter().enumerate() {
        for (j, y) in c.iter().enumerate() {
            if i != j {
                x.add_peer(j as u32, &y.local_addrs());
            }
        }
    }
    c[0].send(0, 1, &[b"to 1"]).unwrap();
    c[0].send(0, 2, &[b"to 2"]).unwrap();
    assert_eq!(c[0].lanes_open(), 1);
    for r in [1, 2] {
        let got = recv_n(&c[r], 1);
        assert_eq!(got[0].from, Some(0));
        c[r].send(0, 0, &[&[r as u8]]).unwrap();
    }
    let mut from: Vec<_> = recv_n(&c[0], 2).iter().map(|d| d.from).collect();
    from.sort();
    assert_eq!(from, [Some(1), Some(2)], "with and without a lane");
    assert_eq!(c[0].lanes_open(), 1);
}

#[tokio::test]
async fn a_peer_that_moves_gets_a_new_lane() {
    let (a, _b) = pair();
    a.send(0, 1, &[b"old"]).unwrap();
    assert_eq!(a.lanes_open(), 1);
    let moved = UdpCarrier::bind(1, &UdpSettings::default()).unwrap();
    moved.add_peer(0, &a.local_addrs());
    a.add_peer(1, &moved.local_addrs());
    assert_eq!(a.lanes_open(), 0, "the lane to the old address is closed");
    a.send(0, 1, &[b"new"]).unwrap();
    assert_eq!(a.lanes_open(), 1);
    let got = recv_n(&moved, 1);
    assert_eq!((&got[0].bytes[..], got[0].from), (&b"new"[..], Some(0)));
}

#[tokio::test]
async fn a_peer_streaming_into_its_lane_does_not_starve_the_others() {
    let c: Vec<UdpCarrier> = (0..3)
        .map(|r| UdpCarrier::bind(r, &UdpSettings::default()).unwrap())
        .collect();
    for (i, x) in c.iter().enumerate() {
        for (j, y) in c.iter().enumerate() {
            if i != j {
                x.add_peer(j as u32, &y.local_addrs());
            }
        }
    }
    // Rank 0's datagrams reach rank 2 on a lane, which becomes the one tried first.
    for _ in 0..2 {
        c[0].send(0, 2, &[b"warm"]).unwrap();
        assert_eq!(recv_n(&c[2], 1).len(), 1);
    }
    for i in 0..40u8 {
        c[0].send(0, 2, &[&[i]]).unwrap();
    }
    c[1].send(0, 2, &[b"other"]).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let got = recv_n(&c[2], 41);
    assert_eq!(got.len(), 41);
    let other = got.iter().position(|d| d.from == Some(1)).unwrap();
    assert!(
        other < 24,
        "rank 1's datagram came {other}th, behind a stream"
    );
    let stream: Vec<u8> = got
        .iter()
        .filter(|d| d.from == Some(0))
        .map(|d| d.bytes[0])
        .collect();
    assert_eq!(stream, (0..40).collect::<Vec<u8>>(), "the stream in order");
}

#[test]
fn route_sockets_are_read_first_and_all_of_them_when_the_poller_named_too_few() {
    let mut tokens = [7, 2, 0, 5, 0, 0];
    let order: Vec<u64> = read_order(&mut tokens, 4, 2).collect();
    assert_eq!(order, [0, 2, 5, 7], "named ones, the route socket first");
    // A full answer: route socket 1 may be ready and unnamed; both are read, then the lanes.
    let mut tokens = [9, 4, 0, 3];
    let order: Vec<u64> = read_order(&mut tokens, 4, 2).collect();
    assert_eq!(order, [0, 1, 3, 4, 9]);
}

#[test]
fn a_lane_between_its_bind_and_its_connect_catches_no_stray_datagram() {
    use socket2::{Domain, Protocol, SockAddr, Socket, Type};
    let route = socket::RouteSocket::bind("127.0.0.1:0".parse().unwrap(), 1 << 20).unwrap();
    // What a lane is before its connect: one more unconnected socket on the route's port.
    let half = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP)).unwrap();
    half.set_reuse_port(true).unwrap();
    half.bind(&SockAddr::from(route.local_addr())).unwrap();
    half.set_nonblocking(true).unwrap();
    // Senders on 64 ports: a hash of the addresses would spread them over both sockets.
    let senders: Vec<std::net::UdpSocket> = (0..64)
        .map(|_| std::net::UdpSocket::bind("127.0.0.1:0").unwrap())
        .collect();
    for (i, s) in (0u8..).zip(&senders) {
        s.send_to(&[i], route.local_addr()).unwrap();
    }
    std::thread::sleep(Duration::from_millis(20));
    let mut buf = Vec::new();
    let mut got = Vec::new();
    while let Some((n, _)) = route.recv_into(&mut buf, 100).unwrap() {
        got.extend_from_slice(&buf[..n]);
    }
    let mut stray = [std::mem::MaybeUninit::new(0u8); 8];
    assert!(
        half.recv(&mut stray).is_err(),
        "the half-made lane got a datagram"
    );
    got.sort_unstable();
    assert_eq!(got, (0..64).collect::<Vec<u8>>(), "all on the route socket");
}

#[tokio::test]
async fn a_datagram_on_a_lane_from_another_address_is_told_by_its_address() {
    let (a, b) = pair();
    // A socket taken for rank 1's lane that is not connected to it (as a lane is before its
    // connect): what comes on it from rank 0 is rank 0's.
    let r = Receiver {
        socket: Arc::clone(&b.sockets[0]),
        route: 0,
        peer: Some(1),
    };
    a.send(0, 1, &[b"x"]).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let mut out = Vec::new();
    let mut st = b.receiving.lock().unwrap();
    b.recv_from(&mut st, &r, &mut out, 8, &mut Vec::new())
        .unwrap();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].from, Some(0));
}
