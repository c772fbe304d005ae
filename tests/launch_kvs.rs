//! The rendezvous key-value service: many concurrent clients, waiting gets, fence generations,
//! failures (timeouts, clients dying mid-fence, bad input) and shutdown.

use std::time::{Duration, Instant};

use rankweave::launch::kvs::{
    DEFAULT_TIMEOUT, KvClient, KvError, KvServer, KvServerConfig, MAX_KEY_LEN, MAX_VALUE_LEN,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

async fn start(expected: usize, timeout: Duration) -> KvServer {
    KvServer::bind_with(
        "127.0.0.1:0",
        KvServerConfig {
            expected_ranks: expected,
            timeout,
        },
    )
    .await
    .unwrap()
}

/// Runs `f` with a deadline so a hang fails the test instead of stalling it.
async fn within<T>(secs: u64, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .expect("test step hung")
}

#[tokio::test]
async fn put_get_fence_with_binary_values() {
    let server = KvServer::bind("127.0.0.1:0", 2).await.unwrap();
    assert_eq!(server.config().timeout, DEFAULT_TIMEOUT);
    let addr = server.local_addr();
    let mut a = KvClient::connect(addr).await.unwrap();
    let mut b = KvClient::connect(addr).await.unwrap();
    assert_eq!(a.expected_ranks(), 2);
    assert_eq!(a.server_addr(), addr);

    let binary: Vec<u8> = (0..=255).cycle().take(5000).collect();
    let big = vec![0xa5; MAX_VALUE_LEN];
    a.put("binary", &binary).await.unwrap();
    a.put("empty", b"").await.unwrap();
    a.put("with space=and\nnewline", b"v").await.unwrap();
    b.put("big", &big).await.unwrap();
    let (ra, rb) = within(10, async { tokio::join!(a.fence(), b.fence()) }).await;
    ra.unwrap();
    rb.unwrap();
    assert_eq!(b.get("binary").await.unwrap(), binary);
    assert_eq!(b.get("empty").await.unwrap(), b"");
    assert_eq!(b.get("with space=and\nnewline").await.unwrap(), b"v");
    assert_eq!(a.get("big").await.unwrap(), big);

    // Last write wins.
    a.put("binary", b"new").await.unwrap();
    assert_eq!(b.get("binary").await.unwrap(), b"new");

    a.close().await.unwrap();
    b.close().await.unwrap();
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_clients_put_fence_get_everyones_keys() {
    const N: usize = 96;
    let server = start(N, Duration::from_secs(30)).await;
    let addr = server.local_addr();
    let mut tasks = tokio::task::JoinSet::new();
    for rank in 0..N {
        tasks.spawn(async move {
            let mut kv = KvClient::connect(addr).await?;
            // Two rounds: the second fence generation must work like the first.
            for round in 0..2u8 {
                let value = [rank.to_le_bytes().as_slice(), &[round; 100]].concat();
                kv.put(&format!("r{round}/rank-{rank}"), &value).await?;
                kv.fence().await?;
                for other in 0..N {
                    let got = kv.get(&format!("r{round}/rank-{other}")).await?;
                    let want = [other.to_le_bytes().as_slice(), &[round; 100]].concat();
                    assert_eq!(got, want, "rank {rank} reading rank {other}");
                }
            }
            kv.fence().await?;
            kv.close().await?;
            Ok::<_, KvError>(rank)
        });
    }
    let mut done = [false; N];
    within(60, async {
        while let Some(joined) = tasks.join_next().await {
            done[joined.unwrap().unwrap()] = true;
        }
    })
    .await;
    assert!(done.iter().all(|&d| d));
    server.shutdown().await;
}

#[tokio::test]
async fn get_waits_until_the_key_is_put() {
    let server = start(2, Duration::from_secs(30)).await;
    let addr = server.local_addr();
    let waiter = tokio::spawn(async move {
        let mut kv = KvClient::connect(addr).await.unwrap();
        let started = Instant::now();
        let value = kv.get("late").await.unwrap();
        (value, started.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let mut putter = KvClient::connect(addr).await.unwrap();
    putter.put("late", b"here").await.unwrap();
    let (value, waited) = within(10, waiter).await.unwrap();
    assert_eq!(value, b"here");
    assert!(waited >= Duration::from_millis(100), "{waited:?}");
    putter.close().await.unwrap();
}

#[tokio::test]
async fn get_times_out_with_a_typed_error_and_the_client_stays_usable() {
    let server = start(1, Duration::from_millis(200)).await;
    let mut kv = KvClient::connect(server.local_addr()).await.unwrap();
    let started = Instant::now();
    match within(10, kv.get("never")).await {
        Err(KvError::Timeout { message }) => assert!(message.contains("\"never\""), "{message}"),
        other => panic!("{other:?}"),
    }
    assert!(started.elapsed() >= Duration::from_millis(150));
    kv.put("k", b"v").await.unwrap();
    assert_eq!(kv.get("k").await.unwrap(), b"v");
    // One expected rank: a fence completes at once.
    kv.fence().await.unwrap();
    kv.close().await.unwrap();
}

#[tokio::test]
async fn fence_that_never_fills_times_out_for_everyone() {
    let server = start(3, Duration::from_millis(300)).await;
    let addr = server.local_addr();
    let mut a = KvClient::connect(addr).await.unwrap();
    let mut b = KvClient::connect(addr).await.unwrap();
    let (ra, rb) = within(10, async { tokio::join!(a.fence(), b.fence()) }).await;
    for r in [ra, rb] {
        match r {
            Err(KvError::Timeout { message }) => {
                assert!(message.contains("2 of 3 ranks"), "{message}")
            }
            other => panic!("{other:?}"),
        }
    }
    // The job is broken: a late third rank fails at once instead of waiting.
    let mut c = KvClient::connect(addr).await.unwrap();
    let started = Instant::now();
    assert!(matches!(c.fence().await, Err(KvError::Timeout { .. })));
    assert!(started.elapsed() < Duration::from_millis(250));
}

#[tokio::test]
async fn client_dying_mid_fence_fails_the_others_fence_promptly() {
    // Four ranks expected; three enter the fence and one of them dies there.
    let server = start(4, Duration::from_secs(30)).await;
    let addr = server.local_addr();
    let mut a = KvClient::connect(addr).await.unwrap();
    let mut b = KvClient::connect(addr).await.unwrap();
    let started = Instant::now();
    let fences = tokio::spawn(async move {
        let (ra, rb) = tokio::join!(a.fence(), b.fence());
        (ra, rb, a)
    });
    // The third rank enters the fence, then its process "dies" (the connection is dropped).
    let dying = tokio::spawn(async move {
        let mut c = KvClient::connect(addr).await.unwrap();
        c.put("rank-2", b"x").await.unwrap();
        c.fence().await
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    dying.abort();
    let (ra, rb, mut a) = within(5, fences).await.unwrap();
    for r in [ra, rb] {
        match r {
            Err(KvError::FenceFailed { message }) => {
                assert!(message.contains("disconnected"), "{message}");
                assert!(message.contains("3 of 4 ranks"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(started.elapsed() < Duration::from_secs(5));
    // Later fences fail too, but gets still work.
    assert!(matches!(a.fence().await, Err(KvError::FenceFailed { .. })));
    assert_eq!(a.get("rank-2").await.unwrap(), b"x");
}

#[tokio::test]
async fn participant_dying_before_the_fence_fails_it() {
    let server = start(3, Duration::from_secs(30)).await;
    let addr = server.local_addr();
    let mut c = KvClient::connect(addr).await.unwrap();
    c.put("rank-2", b"x").await.unwrap();
    drop(c); // died after publishing, before the fence
    let mut a = KvClient::connect(addr).await.unwrap();
    let mut b = KvClient::connect(addr).await.unwrap();
    let (ra, rb) = within(5, async { tokio::join!(a.fence(), b.fence()) }).await;
    assert!(matches!(ra, Err(KvError::FenceFailed { .. })), "{ra:?}");
    assert!(matches!(rb, Err(KvError::FenceFailed { .. })), "{rb:?}");
}

#[tokio::test]
async fn clean_leavers_and_readers_do_not_fail_fences() {
    let server = start(2, Duration::from_secs(30)).await;
    let addr = server.local_addr();
    // A client that published and then left cleanly.
    let mut helper = KvClient::connect(addr).await.unwrap();
    helper.put("config", b"c").await.unwrap();
    helper.close().await.unwrap();
    // A monitoring client that only reads and is dropped.
    let mut reader = KvClient::connect(addr).await.unwrap();
    assert_eq!(reader.get("config").await.unwrap(), b"c");
    drop(reader);
    // A reader dropped while its get waits.
    let waiting = tokio::spawn(async move {
        let mut kv = KvClient::connect(addr).await.unwrap();
        kv.get("nothing").await
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    waiting.abort();
    tokio::time::sleep(Duration::from_millis(50)).await;

    let mut a = KvClient::connect(addr).await.unwrap();
    let mut b = KvClient::connect(addr).await.unwrap();
    let (ra, rb) = within(10, async { tokio::join!(a.fence(), b.fence()) }).await;
    ra.unwrap();
    rb.unwrap();
}

/// Sends raw bytes and returns what the server answers before closing (bounded).
async fn raw_exchange(addr: std::net::SocketAddr, bytes: &[u8]) -> Vec<u8> {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(bytes).await.unwrap();
    let mut answer = Vec::new();
    let _ = within(10, stream.read_to_end(&mut answer)).await;
    answer
}

fn hello() -> Vec<u8> {
    [&[0, 0, 0, 6, 0][..], b"RWKV", &[1]].concat()
}

#[tokio::test]
async fn bad_input_is_answered_or_closed_and_others_keep_working() {
    let server = start(2, Duration::from_secs(30)).await;
    let addr = server.local_addr();
    let mut good = KvClient::connect(addr).await.unwrap();
    good.put("k", b"v").await.unwrap();

    // An HTTP request: the length prefix "GET " is far over the limit.
    let answer = raw_exchange(addr, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert_eq!(answer.get(4), Some(&0x10), "{answer:?}"); // error reply
    assert_eq!(answer.get(5), Some(&3)); // bad request
    // Maximum length prefix.
    let answer = raw_exchange(addr, &[0xff, 0xff, 0xff, 0xff]).await;
    assert_eq!(answer.get(4), Some(&0x10), "{answer:?}");
    // A valid frame that is not a hello.
    let answer = raw_exchange(addr, &[0, 0, 0, 1, 3]).await;
    assert!(
        String::from_utf8_lossy(&answer).contains("hello"),
        "{answer:?}"
    );
    // Wrong magic and wrong version.
    let answer = raw_exchange(addr, &[&[0, 0, 0, 6, 0][..], b"HTTP", &[1]].concat()).await;
    assert!(
        String::from_utf8_lossy(&answer).contains("magic"),
        "{answer:?}"
    );
    let answer = raw_exchange(addr, &[&[0, 0, 0, 6, 0][..], b"RWKV", &[9]].concat()).await;
    assert!(
        String::from_utf8_lossy(&answer).contains("version 9"),
        "{answer:?}"
    );
    // Hello, then an unknown operation, a truncated put and a repeated hello.
    for bad in [
        vec![0, 0, 0, 1, 0x7f],
        vec![0, 0, 0, 7, 1, 0, 0, 0, 9, b'k', b'k'],
        hello(),
    ] {
        let answer = raw_exchange(addr, &[hello(), bad.clone()].concat()).await;
        // Welcome (9 bytes), then an error reply, then the server closes.
        assert_eq!(&answer[..5], &[0, 0, 0, 5, 2], "{bad:?}: {answer:?}");
        assert_eq!(answer.get(9 + 4), Some(&0x10), "{bad:?}: {answer:?}");
    }
    // A frame cut short by the client closing.
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(&[0, 0, 0, 200, 1, 2, 3]).await.unwrap();
    drop(stream);
    // Random garbage of various sizes.
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for len in [1usize, 3, 4, 5, 17, 300, 5000] {
        let garbage: Vec<u8> = (0..len)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed as u8
            })
            .collect();
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let _ = stream.write_all(&garbage).await;
        drop(stream);
    }

    // The server still works, and none of that counted as a lost rank.
    assert_eq!(good.get("k").await.unwrap(), b"v");
    let mut other = KvClient::connect(addr).await.unwrap();
    let (ra, rb) = within(10, async { tokio::join!(good.fence(), other.fence()) }).await;
    ra.unwrap();
    rb.unwrap();
}

#[tokio::test]
async fn oversized_keys_and_values_are_refused_before_sending() {
    let server = start(1, Duration::from_secs(30)).await;
    let mut kv = KvClient::connect(server.local_addr()).await.unwrap();
    let long_key = "k".repeat(MAX_KEY_LEN + 1);
    assert!(matches!(
        kv.put(&long_key, b"v").await,
        Err(KvError::TooLarge { what: "key", .. })
    ));
    assert!(matches!(
        kv.get(&long_key).await,
        Err(KvError::TooLarge { what: "key", .. })
    ));
    assert!(matches!(
        kv.put("k", &vec![0; MAX_VALUE_LEN + 1]).await,
        Err(KvError::TooLarge { what: "value", .. })
    ));
    kv.put(&"k".repeat(MAX_KEY_LEN), b"ok").await.unwrap();
    assert_eq!(kv.get(&"k".repeat(MAX_KEY_LEN)).await.unwrap(), b"ok");
}

#[tokio::test]
async fn cancelled_request_breaks_the_client() {
    let server = start(2, Duration::from_secs(30)).await;
    let mut kv = KvClient::connect(server.local_addr()).await.unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(50), kv.get("absent"))
            .await
            .is_err()
    );
    match kv.put("k", b"v").await {
        Err(KvError::Broken { reason }) => assert!(reason.contains("cancelled"), "{reason}"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn shutdown_and_drop_close_client_connections() {
    let server = start(2, Duration::from_secs(30)).await;
    let addr = server.local_addr();
    let waiter = tokio::spawn(async move {
        let mut kv = KvClient::connect(addr).await.unwrap();
        kv.get("never").await
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    within(10, server.shutdown()).await;
    assert!(matches!(
        within(10, waiter).await.unwrap(),
        Err(KvError::Closed { .. })
    ));
    assert!(matches!(
        KvClient::connect(addr).await,
        Err(KvError::Io { .. })
    ));

    let server = start(2, Duration::from_secs(30)).await;
    let mut kv = KvClient::connect(server.local_addr()).await.unwrap();
    let fence = tokio::spawn(async move { kv.fence().await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(server);
    assert!(matches!(
        within(10, fence).await.unwrap(),
        Err(KvError::Closed { .. })
    ));
}

#[tokio::test]
async fn connect_retry_waits_for_a_late_server() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let client = tokio::spawn({
        let addr = addr.clone();
        async move { KvClient::connect_retry(addr, Duration::from_secs(10)).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let server = KvServer::bind(addr.as_str(), 1).await.unwrap();
    let mut kv = within(10, client).await.unwrap().unwrap();
    kv.fence().await.unwrap();
    kv.close().await.unwrap();
    server.shutdown().await;

    // Nobody ever listens: the retry gives up with the connection error.
    let started = Instant::now();
    let err = KvClient::connect_retry(addr.as_str(), Duration::from_millis(300))
        .await
        .unwrap_err();
    assert!(matches!(err, KvError::Io { .. }), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test]
async fn zero_expected_ranks_is_refused() {
    assert!(matches!(
        KvServer::bind("127.0.0.1:0", 0).await,
        Err(KvError::InvalidArgument(_))
    ));
}
