//! The PMI-1 client against a scripted fake server (error replies, malformed and unexpected
//! lines, over-long lines, the `PMI_PORT` handshake, half-set environments), and, when MPICH is
//! installed, under the real `mpiexec.mpich`.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rankweave::launch::pmi::{MAX_LINE_LEN, PmiClient, PmiEnv, PmiError};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, UnixStream};
use tokio::task::JoinHandle;

/// One step of a fake server's script.
enum Step {
    /// Read a line and check it is exactly this (without `\n`).
    Expect(&'static str),
    /// Write this line (a `\n` is appended).
    Send(&'static str),
    /// Write these bytes as they are.
    Raw(Vec<u8>),
    /// Read until the client closes, failing if it sends anything.
    ExpectEof,
    /// Wait until the client closes, ignoring what it sends.
    Drain,
}
use Step::*;

async fn run_script<S: AsyncRead + AsyncWrite + Unpin>(
    stream: S,
    script: Vec<Step>,
) -> Result<(), String> {
    let mut stream = BufReader::new(stream);
    for (i, step) in script.into_iter().enumerate() {
        match step {
            Expect(want) => {
                let mut line = String::new();
                let n = stream
                    .read_line(&mut line)
                    .await
                    .map_err(|e| format!("step {i}: {e}"))?;
                if n == 0 {
                    return Err(format!("step {i}: client closed, expected {want:?}"));
                }
                if line.strip_suffix('\n') != Some(want) {
                    return Err(format!("step {i}: expected {want:?}, got {line:?}"));
                }
            }
            Send(line) => {
                let wire = format!("{line}\n");
                stream
                    .get_mut()
                    .write_all(wire.as_bytes())
                    .await
                    .map_err(|e| format!("step {i}: {e}"))?;
            }
            Raw(bytes) => {
                stream
                    .get_mut()
                    .write_all(&bytes)
                    .await
                    .map_err(|e| format!("step {i}: {e}"))?;
            }
            ExpectEof => {
                let mut line = String::new();
                match stream.read_line(&mut line).await {
                    Ok(0) => {}
                    Ok(_) => return Err(format!("step {i}: expected nothing, got {line:?}")),
                    Err(e) => return Err(format!("step {i}: {e}")),
                }
            }
            Drain => {
                let mut line = String::new();
                while let Ok(n) = stream.read_line(&mut line).await {
                    if n == 0 {
                        break;
                    }
                }
            }
        }
    }
    Ok(())
}

/// A client over a socketpair whose other end runs `script`.
fn scripted(script: Vec<Step>) -> (PmiClient<UnixStream>, JoinHandle<Result<(), String>>) {
    let (client, server) = UnixStream::pair().unwrap();
    let task = tokio::spawn(run_script(server, script));
    (PmiClient::new(client, 1, 3), task)
}

/// Drops the client and checks the server's script ran to its end.
async fn finish<S>(client: PmiClient<S>, server: JoinHandle<Result<(), String>>) {
    drop(client);
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("fake server did not finish")
        .unwrap()
        .unwrap();
}

/// Hydra 4.0.2's exact answers to `PmiClient::init`.
fn init_steps() -> Vec<Step> {
    vec![
        Expect("cmd=init pmi_version=1 pmi_subversion=1"),
        Send("cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0"),
        Expect("cmd=get_maxes"),
        Send("cmd=maxes kvsname_max=256 keylen_max=64 vallen_max=1024"),
        Expect("cmd=get_my_kvsname"),
        Send("cmd=my_kvsname kvsname=kvs_15588_0_262781002_vm"),
    ]
}

fn with_init(rest: Vec<Step>) -> Vec<Step> {
    let mut steps = init_steps();
    steps.extend(rest);
    steps
}

#[tokio::test]
async fn hydra_session_end_to_end() {
    let (mut pmi, server) = scripted(with_init(vec![
        Expect("cmd=put kvsname=kvs_15588_0_262781002_vm key=addr-1 value=127.0.0.1:4000"),
        Send("cmd=put_result rc=0 msg=success"),
        Expect("cmd=barrier_in"),
        Send("cmd=barrier_out"),
        Expect("cmd=get kvsname=kvs_15588_0_262781002_vm key=addr-0"),
        Send("cmd=get_result rc=0 msg=success value=127.0.0.1:4001"),
        Expect("cmd=get kvsname=kvs_15588_0_262781002_vm key=PMI_process_mapping"),
        Send("cmd=get_result rc=0 msg=success value=(vector,(0,1,1))"),
        Expect("cmd=finalize"),
        Send("cmd=finalize_ack"),
        ExpectEof,
    ]));
    assert_eq!((pmi.rank(), pmi.size()), (1, 3));
    assert_eq!(pmi.kvsname(), None);
    pmi.init().await.unwrap();
    pmi.init().await.unwrap(); // idempotent: sends nothing
    assert_eq!(pmi.kvsname(), Some("kvs_15588_0_262781002_vm"));
    let maxes = pmi.maxes().unwrap();
    assert_eq!(
        (maxes.kvsname_max, maxes.keylen_max, maxes.vallen_max),
        (256, 64, 1024)
    );
    pmi.put("addr-1", "127.0.0.1:4000").await.unwrap();
    pmi.barrier().await.unwrap();
    assert_eq!(pmi.get("addr-0").await.unwrap(), "127.0.0.1:4001");
    assert_eq!(
        pmi.get("PMI_process_mapping").await.unwrap(),
        "(vector,(0,1,1))"
    );
    pmi.finalize().await.unwrap();
    assert!(matches!(
        pmi.put("k", "v").await,
        Err(PmiError::Finalized { operation: "put" })
    ));
    assert!(matches!(pmi.init().await, Err(PmiError::Finalized { .. })));
    finish(pmi, server).await;
}

#[tokio::test]
async fn replies_with_keys_in_any_order_and_unknown_keys() {
    let (mut pmi, server) = scripted(vec![
        Expect("cmd=init pmi_version=1 pmi_subversion=1"),
        Send("rc=0 pmi_subversion=1 cmd=response_to_init pmi_version=1"),
        Expect("cmd=get_maxes"),
        Send("vallen_max=1024  keylen_max=64 future=yes cmd=maxes kvsname_max=256 rc=0"),
        Expect("cmd=get_my_kvsname"),
        Send("cmd=my_kvsname rc=0 kvsname=kvs_7"),
        Expect("cmd=put kvsname=kvs_7 key=k value=v"),
        Send("msg=success rc=0 cmd=put_result"),
        Expect("cmd=get kvsname=kvs_7 key=k"),
        Send("value=v found=TRUE cmd=get_result rc=0 thrid=0x1"),
        Expect("cmd=barrier_in"),
        Send("cmd=barrier_out rc=0\r"),
        ExpectEof,
    ]);
    pmi.init().await.unwrap();
    pmi.put("k", "v").await.unwrap();
    assert_eq!(pmi.get("k").await.unwrap(), "v");
    pmi.barrier().await.unwrap();
    finish(pmi, server).await;
}

#[tokio::test]
async fn error_replies_are_typed_and_leave_the_client_usable() {
    let (mut pmi, server) = scripted(with_init(vec![
        Expect("cmd=put kvsname=kvs_15588_0_262781002_vm key=PMI_x value=1"),
        Send("cmd=put_result rc=1 msg=Keys_with_PMI_prefix_are_reserved"),
        Expect("cmd=get kvsname=kvs_15588_0_262781002_vm key=nokey"),
        Send("cmd=get_result rc=-1 msg=key_nokey_not_found value=unknown"),
        Expect("cmd=get kvsname=kvs_15588_0_262781002_vm key=nokey"),
        Send("cmd=get_result rc=0 found=FALSE"),
        Expect("cmd=get kvsname=kvs_15588_0_262781002_vm key=nokey"),
        Send("cmd=get_result rc=1"),
        Expect("cmd=get kvsname=kvs_15588_0_262781002_vm key=k"),
        Send("cmd=get_result rc=2 msg=kvs_gone"),
        Expect("cmd=barrier_in"),
        Send("cmd=barrier_out rc=5 msg=barrier_failed"),
        Expect("cmd=finalize"),
        Send("cmd=finalize_ack"),
        ExpectEof,
    ]));
    pmi.init().await.unwrap();
    match pmi.put("PMI_x", "1").await {
        Err(PmiError::Server { command, rc, msg }) => {
            assert_eq!(command, "put");
            assert_eq!(rc, 1);
            assert_eq!(msg.as_deref(), Some("Keys_with_PMI_prefix_are_reserved"));
        }
        other => panic!("{other:?}"),
    }
    match pmi.get("nokey").await {
        Err(PmiError::NotFound { key, msg }) => {
            assert_eq!(key, "nokey");
            assert_eq!(msg.as_deref(), Some("key_nokey_not_found"));
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        pmi.get("nokey").await,
        Err(PmiError::NotFound { msg: None, .. })
    ));
    // Slurm's answer for an unknown key.
    assert!(matches!(
        pmi.get("nokey").await,
        Err(PmiError::NotFound { msg: None, .. })
    ));
    let err = pmi.get("k").await.unwrap_err();
    assert!(matches!(err, PmiError::Server { rc: 2, .. }), "{err:?}");
    assert_eq!(err.to_string(), "PMI get failed: rc=2, msg=kvs_gone");
    assert!(matches!(
        pmi.barrier().await,
        Err(PmiError::Server { rc: 5, .. })
    ));
    pmi.finalize().await.unwrap();
    finish(pmi, server).await;
}

#[tokio::test]
async fn init_error_replies() {
    let (mut pmi, server) = scripted(vec![
        Expect("cmd=init pmi_version=1 pmi_subversion=1"),
        Send("cmd=response_to_init pmi_version=2 pmi_subversion=0 rc=-1 msg=version_mismatch"),
        ExpectEof,
    ]);
    match pmi.init().await {
        Err(PmiError::Server {
            command, rc: -1, ..
        }) => assert_eq!(command, "init"),
        other => panic!("{other:?}"),
    }
    assert_eq!(pmi.kvsname(), None);
    finish(pmi, server).await;

    let (mut pmi, server) = scripted(vec![
        Expect("cmd=init pmi_version=1 pmi_subversion=1"),
        Send("cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0"),
        Expect("cmd=get_maxes"),
        Send("cmd=maxes kvsname_max=256 keylen_max=sixty-four vallen_max=1024"),
        ExpectEof,
    ]);
    match pmi.init().await {
        Err(PmiError::Malformed { line, reason }) => {
            assert!(line.contains("keylen_max=sixty-four"), "{line}");
            assert!(reason.contains("keylen_max"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    finish(pmi, server).await;

    let (mut pmi, server) = scripted(vec![
        Expect("cmd=init pmi_version=1 pmi_subversion=1"),
        Send("cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0"),
        Expect("cmd=get_maxes"),
        Send("cmd=maxes kvsname_max=256 vallen_max=1024"),
        ExpectEof,
    ]);
    assert!(matches!(pmi.init().await, Err(PmiError::Malformed { .. })));
    finish(pmi, server).await;
}

#[tokio::test]
async fn malformed_replies_name_the_line() {
    let (mut pmi, server) = scripted(with_init(vec![
        Expect("cmd=put kvsname=kvs_15588_0_262781002_vm key=k value=v"),
        Send("cmd=put_result rc=abc"),
        Expect("cmd=get kvsname=kvs_15588_0_262781002_vm key=k"),
        Send("this is not pmi"),
        Expect("cmd=get kvsname=kvs_15588_0_262781002_vm key=k"),
        Send("cmd=get_result rc=0 msg=success"),
        Expect("cmd=get kvsname=kvs_15588_0_262781002_vm key=k"),
        Raw(b"cmd=get_result rc=0 value=\xff\xfe\n".to_vec()),
        Expect("cmd=get kvsname=kvs_15588_0_262781002_vm key=k"),
        Send("cmd=get_result rc=0 =oops value=x"),
        Expect("cmd=barrier_in"),
        Send("cmd=barrier_out"),
        ExpectEof,
    ]));
    pmi.init().await.unwrap();
    let err = pmi.put("k", "v").await.unwrap_err();
    match &err {
        PmiError::Malformed { line, reason } => {
            assert_eq!(line, "cmd=put_result rc=abc");
            assert!(reason.contains("not an integer"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    assert!(err.to_string().contains("cmd=put_result rc=abc"));
    match pmi.get("k").await {
        Err(PmiError::Malformed { line, .. }) => assert_eq!(line, "this is not pmi"),
        other => panic!("{other:?}"),
    }
    match pmi.get("k").await {
        Err(PmiError::Malformed { reason, .. }) => assert!(reason.contains("value="), "{reason}"),
        other => panic!("{other:?}"),
    }
    match pmi.get("k").await {
        Err(PmiError::Malformed { reason, .. }) => assert!(reason.contains("UTF-8"), "{reason}"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        pmi.get("k").await,
        Err(PmiError::Malformed { .. })
    ));
    // Each bad line was one whole reply: the client is still in step.
    pmi.barrier().await.unwrap();
    finish(pmi, server).await;
}

#[tokio::test]
async fn unexpected_reply_breaks_the_connection() {
    let (mut pmi, server) = scripted(with_init(vec![
        Expect("cmd=barrier_in"),
        Send("cmd=put_result rc=0 msg=success"),
        ExpectEof,
    ]));
    pmi.init().await.unwrap();
    match pmi.barrier().await {
        Err(PmiError::Unexpected {
            request,
            expected,
            line,
        }) => {
            assert_eq!(request, "barrier_in");
            assert_eq!(expected, "barrier_out");
            assert_eq!(line, "cmd=put_result rc=0 msg=success");
        }
        other => panic!("{other:?}"),
    }
    // Out of step: nothing more is sent (the script expects EOF).
    assert!(matches!(pmi.get("k").await, Err(PmiError::Broken { .. })));
    assert!(matches!(pmi.barrier().await, Err(PmiError::Broken { .. })));
    finish(pmi, server).await;
}

#[tokio::test]
async fn over_long_lines_are_refused_without_unbounded_buffering() {
    // No newline at all: the client gives up once the line passes the limit.
    let (mut pmi, server) = scripted(with_init(vec![
        Expect("cmd=get kvsname=kvs_15588_0_262781002_vm key=k"),
        Raw(vec![b'x'; MAX_LINE_LEN + 10_000]),
        Drain,
    ]));
    pmi.init().await.unwrap();
    let result = tokio::time::timeout(Duration::from_secs(10), pmi.get("k"))
        .await
        .expect("client kept reading an endless line");
    assert!(matches!(result, Err(PmiError::LineTooLong { limit }) if limit == MAX_LINE_LEN));
    assert!(matches!(pmi.barrier().await, Err(PmiError::Broken { .. })));
    finish(pmi, server).await;

    // A complete line that is too long.
    let mut long = b"cmd=get_result rc=0 value=".to_vec();
    long.extend(vec![b'y'; MAX_LINE_LEN]);
    long.push(b'\n');
    let (mut pmi, server) = scripted(with_init(vec![
        Expect("cmd=get kvsname=kvs_15588_0_262781002_vm key=k"),
        Raw(long),
        Drain,
    ]));
    pmi.init().await.unwrap();
    assert!(matches!(
        pmi.get("k").await,
        Err(PmiError::LineTooLong { .. })
    ));
    finish(pmi, server).await;
}

#[tokio::test]
async fn server_closing_mid_request() {
    let (mut pmi, server) = scripted(with_init(vec![Expect("cmd=barrier_in")]));
    pmi.init().await.unwrap();
    let err = pmi.barrier().await.unwrap_err();
    assert!(matches!(err, PmiError::Closed { .. }), "{err:?}");
    assert!(err.to_string().contains("barrier_in"), "{err}");
    assert!(matches!(pmi.barrier().await, Err(PmiError::Broken { .. })));
    finish(pmi, server).await;

    // Closed before the first line.
    let (mut pmi, server) = scripted(vec![Expect("cmd=init pmi_version=1 pmi_subversion=1")]);
    assert!(matches!(pmi.init().await, Err(PmiError::Closed { .. })));
    finish(pmi, server).await;
}

#[tokio::test]
async fn operations_before_init_send_nothing() {
    let (mut pmi, server) = scripted(vec![ExpectEof]);
    assert!(matches!(
        pmi.put("k", "v").await,
        Err(PmiError::NotInitialized { operation: "put" })
    ));
    assert!(matches!(
        pmi.get("k").await,
        Err(PmiError::NotInitialized { operation: "get" })
    ));
    assert!(matches!(
        pmi.barrier().await,
        Err(PmiError::NotInitialized { .. })
    ));
    assert!(matches!(
        pmi.finalize().await,
        Err(PmiError::NotInitialized { .. })
    ));
    finish(pmi, server).await;
}

#[tokio::test]
async fn unsendable_keys_and_values_are_refused_before_sending() {
    let (mut pmi, server) = scripted(vec![
        Expect("cmd=init pmi_version=1 pmi_subversion=1"),
        Send("cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0"),
        Expect("cmd=get_maxes"),
        Send("cmd=maxes kvsname_max=256 keylen_max=8 vallen_max=16"),
        Expect("cmd=get_my_kvsname"),
        Send("cmd=my_kvsname kvsname=kvs"),
        Expect("cmd=put kvsname=kvs key=1234567 value=123456789abcdef"),
        Send("cmd=put_result rc=0"),
        ExpectEof,
    ]);
    pmi.init().await.unwrap();
    match pmi.put("12345678", "v").await {
        Err(PmiError::TooLong { what, len, max }) => assert_eq!((what, len, max), ("key", 8, 7)),
        other => panic!("{other:?}"),
    }
    match pmi.put("k", &"v".repeat(16)).await {
        Err(PmiError::TooLong { what, len, max }) => {
            assert_eq!((what, len, max), ("value", 16, 15))
        }
        other => panic!("{other:?}"),
    }
    for (key, value) in [
        ("k", "has space"),
        ("k", "a=b"),
        ("k", ""),
        ("k", "a\nb"),
        ("k", "back\\slash"),
        ("k", "naïve"),
        ("a b", "v"),
        ("a=b", "v"),
        ("", "v"),
    ] {
        let err = pmi.put(key, value).await.unwrap_err();
        assert!(
            matches!(err, PmiError::InvalidValue { .. }),
            "{key:?} {value:?}: {err:?}"
        );
    }
    assert!(matches!(
        pmi.get("bad key").await,
        Err(PmiError::InvalidValue { what: "key", .. })
    ));
    // At the limits exactly, it goes through.
    pmi.put("1234567", "123456789abcdef").await.unwrap();
    finish(pmi, server).await;
}

#[tokio::test]
async fn cancelled_request_breaks_the_connection() {
    let (mut pmi, server) = scripted(with_init(vec![Expect("cmd=barrier_in"), Drain]));
    pmi.init().await.unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(50), pmi.barrier())
            .await
            .is_err()
    );
    match pmi.get("k").await {
        Err(PmiError::Broken { reason }) => assert!(reason.contains("cancelled"), "{reason}"),
        other => panic!("{other:?}"),
    }
    finish(pmi, server).await;
}

#[tokio::test]
async fn abort_sends_exit_code_and_a_carriable_message() {
    let (mut pmi, server) = scripted(vec![
        Expect("cmd=abort exitcode=7 message=rank_1_failed:_x_y_(caf_)"),
        Expect("cmd=abort exitcode=-1"),
        ExpectEof,
    ]);
    pmi.abort(7, "rank 1 failed: x=y\n(café)").await.unwrap();
    pmi.abort(-1, "").await.unwrap();
    finish(pmi, server).await;
}

/// Accepts one TCP connection and runs `script` on it.
async fn tcp_server(script: Vec<Step>) -> (String, JoinHandle<Result<(), String>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let task = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.map_err(|e| e.to_string())?;
        run_script(stream, script).await
    });
    (addr, task)
}

#[tokio::test]
async fn pmi_port_handshake() {
    let mut script = vec![
        Expect("cmd=initack pmiid=3"),
        // Hydra writes all four lines at once.
        Send("cmd=initack\ncmd=set size=4\ncmd=set rank=3\ncmd=set debug=0"),
    ];
    script.extend(init_steps());
    script.extend([Expect("cmd=finalize"), Send("cmd=finalize_ack"), ExpectEof]);
    let (addr, server) = tcp_server(script).await;
    let env = PmiEnv::from_lookup(|var| match var {
        "PMI_PORT" => Some(addr.clone()),
        "PMI_ID" => Some("3".into()),
        _ => None,
    })
    .unwrap()
    .unwrap();
    let mut pmi = PmiClient::from_pmi_env(env).await.unwrap();
    assert_eq!((pmi.rank(), pmi.size()), (3, 4));
    pmi.init().await.unwrap();
    pmi.finalize().await.unwrap();
    finish(pmi, server).await;
}

#[tokio::test]
async fn pmi_port_handshake_in_any_order_with_rc() {
    let (addr, server) = tcp_server(vec![
        Expect("cmd=initack pmiid=1"),
        Send("cmd=initack rc=0"),
        Send("cmd=set rank=1"),
        Send("cmd=set debug=1"),
        Send("cmd=set size=2"),
        ExpectEof,
    ])
    .await;
    let pmi = PmiClient::from_pmi_env(PmiEnv::Port { addr, id: 1 })
        .await
        .unwrap();
    assert_eq!((pmi.rank(), pmi.size(), pmi.debug_level()), (1, 2, 1));
    finish(pmi, server).await;
}

#[tokio::test]
async fn pmi_port_handshake_failures() {
    type Check = fn(&PmiError) -> bool;
    let cases: Vec<(Vec<Step>, Check)> = vec![
        (
            vec![
                Expect("cmd=initack pmiid=0"),
                Send("cmd=initack rc=1 msg=unknown_pmiid"),
                Drain,
            ],
            |e| matches!(e, PmiError::Server { rc: 1, .. }),
        ),
        (
            vec![Expect("cmd=initack pmiid=0"), Send("cmd=welcome"), Drain],
            |e| {
                matches!(
                    e,
                    PmiError::Unexpected {
                        expected: "initack",
                        ..
                    }
                )
            },
        ),
        (
            vec![
                Expect("cmd=initack pmiid=0"),
                Send("cmd=initack\ncmd=set size=2\ncmd=set rank=5\ncmd=set debug=0"),
                Drain,
            ],
            |e| matches!(e, PmiError::Handshake { reason } if reason.contains("rank 5")),
        ),
        (
            vec![
                Expect("cmd=initack pmiid=0"),
                Send("cmd=initack\ncmd=set size=2\ncmd=set debug=0\ncmd=set debug=0"),
                Drain,
            ],
            |e| matches!(e, PmiError::Handshake { reason } if reason.contains("no rank")),
        ),
        (
            vec![
                Expect("cmd=initack pmiid=0"),
                Send("cmd=initack\ncmd=set size=two"),
                Drain,
            ],
            |e| matches!(e, PmiError::Malformed { .. }),
        ),
        (
            vec![Expect("cmd=initack pmiid=0"), Send("cmd=initack")],
            |e| matches!(e, PmiError::Closed { .. }),
        ),
    ];
    for (i, (script, check)) in cases.into_iter().enumerate() {
        let (addr, server) = tcp_server(script).await;
        match PmiClient::from_pmi_env(PmiEnv::Port { addr, id: 0 }).await {
            Err(e) => assert!(check(&e), "case {i}: {e:?}"),
            Ok(_) => panic!("case {i}: handshake succeeded"),
        }
        server.await.unwrap().unwrap();
    }

    // Nobody listening.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    drop(listener);
    let err = PmiClient::from_pmi_env(PmiEnv::Port { addr, id: 0 })
        .await
        .unwrap_err();
    assert!(matches!(err, PmiError::Io { .. }), "{err:?}");
    assert!(err.to_string().contains("PMI_PORT"), "{err}");
}

#[tokio::test]
async fn pmi_port_without_handshake_uses_rank_and_size() {
    let mut script = init_steps();
    script.push(ExpectEof);
    let (addr, server) = tcp_server(script).await;
    let env = PmiEnv::from_lookup(|var| match var {
        "PMI_PORT" => Some(addr.clone()),
        "PMI_RANK" => Some("2".into()),
        "PMI_SIZE" => Some("5".into()),
        _ => None,
    })
    .unwrap()
    .unwrap();
    let mut pmi = PmiClient::from_pmi_env(env).await.unwrap();
    assert_eq!((pmi.rank(), pmi.size()), (2, 5));
    pmi.init().await.unwrap();
    finish(pmi, server).await;
}

fn env_of(vars: &[(&str, &str)]) -> Result<Option<PmiEnv>, PmiError> {
    PmiEnv::from_lookup(|var| {
        vars.iter()
            .find(|(name, _)| *name == var)
            .map(|(_, value)| value.to_string())
    })
}

#[test]
fn half_set_environment_names_what_is_missing() {
    type Vars<'a> = &'a [(&'a str, &'a str)];
    let cases: &[(Vars, &str, &str)] = &[
        (&[("PMI_FD", "6")], "PMI_RANK", "PMI_FD"),
        (&[("PMI_FD", "6"), ("PMI_SIZE", "2")], "PMI_RANK", "PMI_FD"),
        (&[("PMI_FD", "6"), ("PMI_RANK", "0")], "PMI_SIZE", "PMI_FD"),
        (
            &[("PMI_PORT", "host:5000")],
            "PMI_ID (or PMI_RANK and PMI_SIZE)",
            "PMI_PORT",
        ),
        (
            &[("PMI_PORT", "host:5000"), ("PMI_RANK", "0")],
            "PMI_SIZE",
            "PMI_PORT",
        ),
        (&[("PMI_ID", "0")], "PMI_FD or PMI_PORT", "PMI_ID"),
        (
            &[("PMI_RANK", "0"), ("PMI_SIZE", "2")],
            "PMI_FD or PMI_PORT",
            "PMI_RANK",
        ),
    ];
    for &(vars, want_missing, want_present) in cases {
        match env_of(vars) {
            Err(e @ PmiError::MissingEnv { missing, present }) => {
                assert_eq!((missing, present), (want_missing, want_present), "{vars:?}");
                assert_eq!(
                    e.to_string(),
                    format!(
                        "half-set PMI environment: {want_present} is set but {want_missing} is not"
                    )
                );
            }
            other => panic!("{vars:?}: {other:?}"),
        }
    }
}

#[test]
fn invalid_environment_values() {
    for (vars, var) in [
        (
            &[("PMI_FD", "six"), ("PMI_RANK", "0"), ("PMI_SIZE", "1")][..],
            "PMI_FD",
        ),
        (
            &[("PMI_FD", "-1"), ("PMI_RANK", "0"), ("PMI_SIZE", "1")][..],
            "PMI_FD",
        ),
        (
            &[("PMI_FD", "6"), ("PMI_RANK", "3"), ("PMI_SIZE", "3")][..],
            "PMI_RANK",
        ),
        (
            &[("PMI_FD", "6"), ("PMI_RANK", "0"), ("PMI_SIZE", "0")][..],
            "PMI_SIZE",
        ),
        (
            &[("PMI_FD", "6"), ("PMI_RANK", "x"), ("PMI_SIZE", "2")][..],
            "PMI_RANK",
        ),
        (&[("PMI_PORT", "no-port"), ("PMI_ID", "0")][..], "PMI_PORT"),
        (&[("PMI_PORT", ":5000"), ("PMI_ID", "0")][..], "PMI_PORT"),
        (
            &[("PMI_PORT", "host:99999"), ("PMI_ID", "0")][..],
            "PMI_PORT",
        ),
        (
            &[("PMI_PORT", "host:5000"), ("PMI_ID", "zero")][..],
            "PMI_ID",
        ),
    ] {
        match env_of(vars) {
            Err(PmiError::InvalidEnv { var: got, .. }) => assert_eq!(got, var, "{vars:?}"),
            other => panic!("{vars:?}: {other:?}"),
        }
    }
    assert!(matches!(env_of(&[]), Ok(None)));
}

#[tokio::test]
async fn owned_unix_and_tcp_sockets_and_non_sockets() {
    // A Unix-domain socketpair, as Hydra passes in PMI_FD.
    let (client, server) = std::os::unix::net::UnixStream::pair().unwrap();
    server.set_nonblocking(true).unwrap();
    let server = UnixStream::from_std(server).unwrap();
    let task = tokio::spawn(run_script(
        server,
        with_init(vec![
            Expect("cmd=barrier_in"),
            Send("cmd=barrier_out"),
            ExpectEof,
        ]),
    ));
    let mut pmi = PmiClient::from_owned_fd(client.into(), 0, 2).unwrap();
    pmi.init().await.unwrap();
    pmi.barrier().await.unwrap();
    finish(pmi, task).await;

    // An inherited TCP socket works too.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (server, _) = listener.accept().unwrap();
    server.set_nonblocking(true).unwrap();
    let server = tokio::net::TcpStream::from_std(server).unwrap();
    let task = tokio::spawn(run_script(server, with_init(vec![ExpectEof])));
    let mut pmi = PmiClient::from_owned_fd(client.into(), 0, 1).unwrap();
    pmi.init().await.unwrap();
    finish(pmi, task).await;

    // Not a socket.
    let file = std::fs::File::open("/dev/null").unwrap();
    match PmiClient::from_owned_fd(file.into(), 0, 1) {
        Err(PmiError::BadFd { reason, .. }) => assert_eq!(reason, "not a socket"),
        other => panic!("{other:?}"),
    }
    // A datagram socket.
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    match PmiClient::from_owned_fd(udp.into(), 0, 1) {
        Err(PmiError::BadFd { reason, .. }) => assert_eq!(reason, "not a stream socket"),
        other => panic!("{other:?}"),
    }
}

/// Set in the environment of the processes `mpiexec.mpich` starts for [`pmi_child`].
const CHILD_VAR: &str = "RANKWEAVE_PMI_TEST_CHILD";

/// The body of each process under `mpiexec.mpich`; does nothing in an ordinary test run.
#[tokio::test]
async fn pmi_child() {
    if std::env::var_os(CHILD_VAR).is_none() {
        return;
    }
    let mut pmi = PmiClient::from_env()
        .await
        .expect("connecting to the PMI server");
    pmi.init().await.expect("PMI init");
    let (rank, size) = (pmi.rank(), pmi.size());
    pmi.put(&format!("rw-key-{rank}"), &format!("value-of-{rank}:x"))
        .await
        .expect("put");
    pmi.barrier().await.expect("barrier");
    for r in 0..size {
        assert_eq!(
            pmi.get(&format!("rw-key-{r}")).await.expect("get"),
            format!("value-of-{r}:x")
        );
    }
    assert!(matches!(
        pmi.get("rw-no-such-key").await,
        Err(PmiError::NotFound { .. })
    ));
    pmi.barrier().await.expect("second barrier");
    pmi.finalize().await.expect("finalize");
    if std::env::var_os("PMI_FD").is_some() {
        assert!(matches!(
            PmiClient::from_env().await,
            Err(PmiError::FdTaken { .. })
        ));
    }
    println!("PMI-CHILD-OK rank={rank} size={size}");
}

fn find_in_path(program: &str) -> Option<std::path::PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(program))
        .find(|path| path.is_file())
}

/// Runs [`pmi_child`] in 3 processes under `mpiexec.mpich` with `extra` arguments.
fn run_under_mpiexec(mpiexec: &std::path::Path, extra: &[&str]) {
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(mpiexec)
        .args(extra)
        .args(["-n", "3"])
        .arg(&exe)
        .args(["pmi_child", "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_VAR, "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if start.elapsed() > Duration::from_secs(120) {
            child.kill().ok();
            let out = child.wait_with_output().unwrap();
            panic!(
                "mpiexec {extra:?} timed out\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "mpiexec {extra:?} failed: {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    for rank in 0..3 {
        let want = format!("PMI-CHILD-OK rank={rank} size=3");
        assert!(
            stdout.contains(&want),
            "mpiexec {extra:?}: no {want:?}\nstdout:\n{stdout}\nstderr:\n{stderr}"
        );
    }
}

#[test]
fn under_mpiexec_mpich() {
    let Some(mpiexec) = find_in_path("mpiexec.mpich") else {
        println!("skipped: mpiexec.mpich not installed (apt-get install mpich)");
        return;
    };
    // Hydra's default: an inherited socketpair in PMI_FD.
    run_under_mpiexec(&mpiexec, &[]);
    // PMI_PORT + PMI_ID with the initack handshake.
    run_under_mpiexec(&mpiexec, &["-pmi-port"]);
}
