//! The simulated fabric's verbs semantics, one by one.

use std::task::{Context, Poll, Wake, Waker};

use bytes::Bytes;

use super::*;

const CAPS: QpCaps = QpCaps {
    max_send_wr: 64,
    max_recv_wr: 64,
    rnr_retry: 2,
};

/// Two ports with a connected RC pair and a registered buffer each.
struct RcPair {
    fabric: SimFabric,
    a: SimProvider,
    b: SimProvider,
    qa: QpNum,
    qb: QpNum,
    ma: MemoryRegion,
    mb: MemoryRegion,
}

fn rc_pair(caps: QpCaps) -> RcPair {
    let fabric = SimFabric::new(256);
    let mut a = fabric.open_port();
    let mut b = fabric.open_port();
    let qa = a.create_qp(QpKind::Rc, caps).unwrap();
    let qb = b.create_qp(QpKind::Rc, caps).unwrap();
    let (pa, pb) = (a.port(), b.port());
    a.connect(qa, QpAddress { port: pb, qpn: qb }, 0).unwrap();
    b.connect(qb, QpAddress { port: pa, qpn: qa }, 0).unwrap();
    let ma = a.register(Buffer::Owned(vec![0; 4096])).unwrap();
    let mb = b.register(Buffer::Owned(vec![0; 4096])).unwrap();
    RcPair {
        fabric,
        a,
        b,
        qa,
        qb,
        ma,
        mb,
    }
}

fn sge(mr: &MemoryRegion, offset: usize, len: usize) -> Sge {
    Sge {
        mr: mr.id,
        offset,
        len,
    }
}

fn send(wr_id: u64, local: Sge, imm: Option<u32>) -> SendRequest {
    SendRequest {
        wr_id,
        op: SendOp::Send { imm },
        local: Some(local),
    }
}

fn poll(p: &mut SimProvider) -> Vec<Completion> {
    let mut out = Vec::new();
    p.poll_completions(&mut out, 1000).unwrap();
    out
}

#[test]
fn rc_sends_arrive_in_order_with_immediate_data() {
    let mut t = rc_pair(CAPS);
    for i in 0..4u64 {
        t.b.post_recv(t.qb, 100 + i, sge(&t.mb, i as usize * 100, 100))
            .unwrap();
    }
    for i in 0..4u8 {
        t.a.write_local(t.ma.id, usize::from(i) * 10, &[i; 10])
            .unwrap();
        t.a.post_send(
            t.qa,
            send(
                u64::from(i),
                sge(&t.ma, usize::from(i) * 10, 10),
                Some(u32::from(i) + 7),
            ),
        )
        .unwrap();
    }
    let sent = poll(&mut t.a);
    assert_eq!(
        sent.iter().map(|c| c.wr_id).collect::<Vec<_>>(),
        [0, 1, 2, 3]
    );
    assert!(sent.iter().all(|c| c.status == CompletionStatus::Success));
    let got = poll(&mut t.b);
    assert_eq!(got.len(), 4);
    for (i, c) in got.iter().enumerate() {
        assert_eq!(
            c.wr_id,
            100 + i as u64,
            "receives are consumed in posting order"
        );
        assert_eq!(
            (c.kind, c.byte_len, c.imm),
            (CompletionKind::Recv, 10, Some(i as u32 + 7))
        );
        assert_eq!(
            t.b.read_local(t.mb.id, i * 100, 10).unwrap(),
            vec![i as u8; 10]
        );
    }
}

/// No receive posted: the send waits (RNR) and blocks the one behind it; posting a receive
/// lets both through in order.
#[test]
fn rnr_waits_for_a_receive_and_keeps_order() {
    let mut t = rc_pair(CAPS);
    t.a.post_send(t.qa, send(1, sge(&t.ma, 0, 8), None))
        .unwrap();
    t.a.post_send(t.qa, send(2, sge(&t.ma, 8, 8), None))
        .unwrap();
    assert!(poll(&mut t.b).is_empty());
    assert!(t.fabric.counters().rnr_naks >= 1);
    t.b.post_recv(t.qb, 10, sge(&t.mb, 0, 64)).unwrap();
    t.b.post_recv(t.qb, 11, sge(&t.mb, 64, 64)).unwrap();
    let got = poll(&mut t.b);
    assert_eq!(got.iter().map(|c| c.wr_id).collect::<Vec<_>>(), [10, 11]);
    let sent = poll(&mut t.a);
    assert_eq!(sent.iter().map(|c| c.wr_id).collect::<Vec<_>>(), [1, 2]);
}

/// With no receive ever posted the RNR retries run out: an error completion, then the
/// queue pair is in error and flushes what follows, receives included.
#[test]
fn rnr_retries_run_out_into_an_error_and_flush() {
    let mut t = rc_pair(CAPS);
    t.a.post_recv(t.qa, 50, sge(&t.ma, 1000, 100)).unwrap();
    t.a.post_send(t.qa, send(1, sge(&t.ma, 0, 8), None))
        .unwrap();
    t.a.post_send(t.qa, send(2, sge(&t.ma, 0, 8), None))
        .unwrap();
    let mut all = Vec::new();
    for _ in 0..5 {
        all.extend(poll(&mut t.a));
    }
    let statuses: Vec<_> = all.iter().map(|c| (c.wr_id, c.status)).collect();
    assert_eq!(
        statuses,
        [
            (1, CompletionStatus::RnrRetryExceeded),
            (2, CompletionStatus::Flushed),
            (50, CompletionStatus::Flushed)
        ]
    );
    // Later requests are flushed at once.
    t.a.post_send(t.qa, send(3, sge(&t.ma, 0, 8), None))
        .unwrap();
    assert_eq!(poll(&mut t.a)[0].status, CompletionStatus::Flushed);
}

#[test]
fn rdma_write_with_immediate_places_bytes_before_its_completion() {
    let mut t = rc_pair(CAPS);
    t.a.write_local(t.ma.id, 0, b"rdma payload").unwrap();
    t.b.post_recv(t.qb, 9, sge(&t.mb, 0, 16)).unwrap();
    let remote = RemoteSlice {
        addr: t.mb.addr + 100,
        rkey: t.mb.rkey,
    };
    t.a.post_send(
        t.qa,
        SendRequest {
            wr_id: 1,
            op: SendOp::Write {
                remote,
                imm: Some(0xabc),
            },
            local: Some(sge(&t.ma, 0, 12)),
        },
    )
    .unwrap();
    let got = poll(&mut t.b);
    assert_eq!(got.len(), 1);
    assert_eq!(
        (got[0].kind, got[0].imm, got[0].byte_len),
        (CompletionKind::RecvWriteImm, Some(0xabc), 12)
    );
    assert_eq!(t.b.read_local(t.mb.id, 100, 12).unwrap(), b"rdma payload");
    assert_eq!(
        t.b.read_local(t.mb.id, 0, 4).unwrap(),
        [0; 4],
        "the receive buffer is untouched"
    );
    // A plain write consumes no receive and completes only at the writer.
    t.a.post_send(
        t.qa,
        SendRequest {
            wr_id: 2,
            op: SendOp::Write { remote, imm: None },
            local: Some(sge(&t.ma, 0, 4)),
        },
    )
    .unwrap();
    assert!(poll(&mut t.b).is_empty());
    assert_eq!(poll(&mut t.a).len(), 2);
}

fn write_to(t: &mut RcPair, remote: RemoteSlice) -> CompletionStatus {
    let request = SendRequest {
        wr_id: 1,
        op: SendOp::Write { remote, imm: None },
        local: Some(sge(&t.ma, 0, 8)),
    };
    t.a.post_send(t.qa, request).unwrap();
    poll(&mut t.a)[0].status
}

#[test]
fn a_bad_remote_key_range_or_right_is_a_remote_access_error() {
    let mut t = rc_pair(CAPS);
    let bad_key = RemoteSlice {
        addr: t.mb.addr,
        rkey: t.mb.rkey + 1000,
    };
    assert_eq!(
        write_to(&mut t, bad_key),
        CompletionStatus::RemoteAccessError
    );
    let mut t = rc_pair(CAPS);
    let past_end = RemoteSlice {
        addr: t.mb.addr + 4090,
        rkey: t.mb.rkey,
    };
    assert_eq!(
        write_to(&mut t, past_end),
        CompletionStatus::RemoteAccessError
    );
    let mut t = rc_pair(CAPS);
    let shared =
        t.b.register(Buffer::Shared(Bytes::from_static(b"read only")))
            .unwrap();
    let read_only = RemoteSlice {
        addr: shared.addr,
        rkey: shared.rkey,
    };
    assert_eq!(
        write_to(&mut t, read_only),
        CompletionStatus::RemoteAccessError
    );
    // Reading it is allowed.
    let mut t = rc_pair(CAPS);
    let shared =
        t.b.register(Buffer::Shared(Bytes::from_static(b"read only")))
            .unwrap();
    let request = SendRequest {
        wr_id: 5,
        op: SendOp::Read {
            remote: RemoteSlice {
                addr: shared.addr,
                rkey: shared.rkey,
            },
        },
        local: Some(sge(&t.ma, 0, 9)),
    };
    t.a.post_send(t.qa, request).unwrap();
    assert_eq!(poll(&mut t.a)[0].status, CompletionStatus::Success);
    assert_eq!(t.a.read_local(t.ma.id, 0, 9).unwrap(), b"read only");
}

#[test]
fn a_message_longer_than_the_receive_buffer_fails_both_sides() {
    let mut t = rc_pair(CAPS);
    t.b.post_recv(t.qb, 1, sge(&t.mb, 0, 4)).unwrap();
    t.a.post_send(t.qa, send(2, sge(&t.ma, 0, 8), None))
        .unwrap();
    assert_eq!(poll(&mut t.b)[0].status, CompletionStatus::LocalLengthError);
    assert_eq!(
        poll(&mut t.a)[0].status,
        CompletionStatus::RemoteInvalidRequest
    );
}

#[test]
fn bad_work_requests_are_refused_when_posted() {
    let mut t = rc_pair(CAPS);
    assert!(matches!(
        t.a.post_send(t.qa, send(1, sge(&t.ma, 4000, 200), None)),
        Err(VerbsError::BadAccess(_))
    ));
    assert!(matches!(
        t.a.post_send(QpNum(9999), send(1, sge(&t.ma, 0, 1), None)),
        Err(VerbsError::UnknownQp(9999))
    ));
    assert!(
        matches!(
            t.a.post_recv(t.qb, 1, sge(&t.ma, 0, 1)),
            Err(VerbsError::UnknownQp(_))
        ),
        "another port's queue pair"
    );
    let unconnected = t.a.create_qp(QpKind::Rc, CAPS).unwrap();
    assert!(matches!(
        t.a.post_send(unconnected, send(1, sge(&t.ma, 0, 1), None)),
        Err(VerbsError::QpState { .. })
    ));
    assert!(matches!(
        t.a.deregister(t.mb.id),
        Err(VerbsError::UnknownRegion(_))
    ));
}

/// UD pair on a fabric with a 256-byte MTU.
fn ud_ports(n: usize) -> (SimFabric, Vec<(SimProvider, QpNum, MemoryRegion)>) {
    let fabric = SimFabric::new(256);
    let ports = (0..n)
        .map(|_| {
            let mut p = fabric.open_port();
            let qp = p.create_qp(QpKind::Ud, CAPS).unwrap();
            p.connect(
                qp,
                QpAddress {
                    port: p.port(),
                    qpn: qp,
                },
                0x1111,
            )
            .unwrap();
            let mr = p.register(Buffer::Owned(vec![0; 64 * 1024])).unwrap();
            (p, qp, mr)
        })
        .collect();
    (fabric, ports)
}

fn ud_send(p: &mut SimProvider, qp: QpNum, mr: &MemoryRegion, ah: AhId, dest: QpNum, data: &[u8]) {
    p.write_local(mr.id, 0, data).unwrap();
    p.post_send(
        qp,
        SendRequest {
            wr_id: 1,
            op: SendOp::SendTo {
                ah,
                qpn: dest,
                qkey: 0x1111,
                imm: None,
            },
            local: Some(sge(mr, 0, data.len())),
        },
    )
    .unwrap();
}

#[test]
fn ud_is_mtu_limited_dropped_without_a_receive_and_carries_a_grh_area() {
    let (fabric, mut ports) = ud_ports(2);
    let (dest_port, dest_qp) = (ports[1].0.port(), ports[1].1);
    let (p, qp, mr) = &mut ports[0];
    let ah = p.create_ah(dest_port).unwrap();
    assert!(matches!(
        p.post_send(
            *qp,
            SendRequest {
                wr_id: 1,
                op: SendOp::SendTo {
                    ah,
                    qpn: dest_qp,
                    qkey: 0x1111,
                    imm: None
                },
                local: Some(sge(mr, 0, 257))
            }
        ),
        Err(VerbsError::InvalidRequest(_))
    ));
    ud_send(p, *qp, mr, ah, dest_qp, b"lost");
    assert_eq!(fabric.counters().datagrams_dropped_no_receive, 1);
    let (p1, q1, m1) = &mut ports[1];
    p1.post_recv(*q1, 7, sge(m1, 0, 300)).unwrap();
    let (p, qp, mr) = &mut ports[0];
    ud_send(p, *qp, mr, ah, dest_qp, b"found");
    let sender = ports[0].1;
    let (p1, _, m1) = &mut ports[1];
    let got = poll(p1);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].byte_len, GRH_LEN + 5);
    assert_eq!(got[0].source.map(|s| s.qpn), Some(sender));
    assert_eq!(p1.read_local(m1.id, GRH_LEN, 5).unwrap(), b"found");
}

#[test]
fn ud_faults_drop_and_reorder_datagrams() {
    let (fabric, mut ports) = ud_ports(2);
    let (dest_port, dest_qp) = (ports[1].0.port(), ports[1].1);
    for i in 0..4 {
        let (p, q, m) = &mut ports[1];
        p.post_recv(*q, i, sge(m, i as usize * 512, 512)).unwrap();
    }
    let (p, qp, mr) = &mut ports[0];
    let ah = p.create_ah(dest_port).unwrap();
    fabric.drop_next_datagrams(1);
    ud_send(p, *qp, mr, ah, dest_qp, b"one");
    fabric.hold_next_datagram();
    ud_send(p, *qp, mr, ah, dest_qp, b"two");
    ud_send(p, *qp, mr, ah, dest_qp, b"three");
    let (p1, _, m1) = &mut ports[1];
    let got = poll(p1);
    let texts: Vec<Vec<u8>> = got
        .iter()
        .map(|c| {
            p1.read_local(
                m1.id,
                c.wr_id as usize * 512 + GRH_LEN,
                c.byte_len - GRH_LEN,
            )
            .unwrap()
        })
        .collect();
    assert_eq!(texts, [b"three".to_vec(), b"two".to_vec()]);
    assert_eq!(fabric.counters().datagrams_dropped_fault, 1);
}

#[test]
fn multicast_reaches_every_attached_queue_pair_but_the_sender() {
    let (_, mut ports) = ud_ports(4);
    let group = PortAddress {
        lid: FIRST_MULTICAST_LID + 5,
        gid: [0xff; 16],
    };
    for (i, (p, q, m)) in ports.iter_mut().enumerate() {
        if i != 3 {
            p.attach_multicast(*q, group).unwrap();
        }
        p.post_recv(*q, 1, sge(m, 0, 512)).unwrap();
    }
    let (p, qp, mr) = &mut ports[0];
    let ah = p.create_ah(group).unwrap();
    ud_send(p, *qp, mr, ah, MULTICAST_QPN, b"to all");
    let received: Vec<usize> = ports
        .iter_mut()
        .map(|(p, _, _)| {
            poll(p)
                .into_iter()
                .filter(|c| c.kind == CompletionKind::Recv)
                .count()
        })
        .collect();
    assert_eq!(received, [0, 1, 1, 0], "not the sender, not the unattached");
    let (p, q, _) = &mut ports[0];
    assert!(
        p.attach_multicast(
            *q,
            PortAddress {
                lid: 3,
                gid: [0; 16]
            }
        )
        .is_err()
    );
}

#[test]
fn a_failed_port_fails_outstanding_and_later_rc_requests() {
    let mut t = rc_pair(CAPS);
    t.a.post_recv(t.qa, 1, sge(&t.ma, 0, 64)).unwrap();
    t.fabric.fail_port(t.a.port().lid);
    assert_eq!(poll(&mut t.a)[0].status, CompletionStatus::Flushed);
    // The peer's sends towards the dead port fail.
    t.b.post_send(t.qb, send(2, sge(&t.mb, 0, 8), None))
        .unwrap();
    assert_eq!(poll(&mut t.b)[0].status, CompletionStatus::RetryExceeded);
    assert!(matches!(
        t.a.create_qp(QpKind::Rc, CAPS),
        Err(VerbsError::PortDown)
    ));
}

/// A port that comes back raises `Up` after its `Down`; its failed RC queue pairs stay in
/// error, new ones connect and carry traffic; its UD queue pair lost the datagrams sent while
/// it was down but was never broken.
#[test]
fn a_restored_port_raises_up_and_takes_new_rc_and_old_ud_queue_pairs() {
    let mut t = rc_pair(CAPS);
    let lid = t.a.port().lid;
    let ud_a = t.a.create_qp(QpKind::Ud, CAPS).unwrap();
    let ud_b = t.b.create_qp(QpKind::Ud, CAPS).unwrap();
    for (p, q) in [(&mut t.a, ud_a), (&mut t.b, ud_b)] {
        let own = QpAddress {
            port: p.port(),
            qpn: q,
        };
        p.connect(q, own, 0x1111).unwrap();
    }
    t.b.post_recv(ud_b, 50, sge(&t.mb, 1024, 512)).unwrap();
    t.b.post_recv(ud_b, 51, sge(&t.mb, 1536, 512)).unwrap();
    let ah = t.a.create_ah(t.b.port()).unwrap();
    // Restoring a port that is up does nothing.
    t.fabric.restore_port(lid);
    assert_eq!(t.a.poll_port_change(), None);
    t.fabric.fail_port(lid);
    assert!(!t.fabric.is_port_up(lid));
    assert_eq!(t.a.poll_port_change(), Some(PortChange::Down));
    // A datagram from the dead port is lost; the UD send completes anyway.
    ud_send(&mut t.a, ud_a, &t.ma, ah, ud_b, b"lost");
    let done = poll(&mut t.a);
    assert!(
        done.iter().all(|c| c.status == CompletionStatus::Success),
        "{done:?}"
    );
    assert!(poll(&mut t.b).is_empty());
    t.fabric.restore_port(lid);
    t.fabric.restore_port(lid);
    assert!(t.fabric.is_port_up(lid));
    assert_eq!(t.a.poll_port_change(), Some(PortChange::Up));
    assert_eq!(t.a.poll_port_change(), None);
    // The old RC queue pair stays in error.
    t.a.post_send(t.qa, send(3, sge(&t.ma, 0, 8), None))
        .unwrap();
    assert_eq!(poll(&mut t.a)[0].status, CompletionStatus::Flushed);
    // The UD queue pair works again.
    ud_send(&mut t.a, ud_a, &t.ma, ah, ud_b, b"back");
    let got = poll(&mut t.b);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(t.b.read_local(t.mb.id, 1024 + GRH_LEN, 4).unwrap(), b"back");
    // A new RC pair on the restored port connects and carries a message.
    let qa = t.a.create_qp(QpKind::Rc, CAPS).unwrap();
    let qb = t.b.create_qp(QpKind::Rc, CAPS).unwrap();
    let (pa, pb) = (t.a.port(), t.b.port());
    t.a.connect(qa, QpAddress { port: pb, qpn: qb }, 0).unwrap();
    t.b.connect(qb, QpAddress { port: pa, qpn: qa }, 0).unwrap();
    t.b.post_recv(qb, 9, sge(&t.mb, 0, 64)).unwrap();
    t.a.write_local(t.ma.id, 0, b"again").unwrap();
    t.a.post_send(qa, send(4, sge(&t.ma, 0, 5), None)).unwrap();
    assert_eq!(poll(&mut t.a)[0].status, CompletionStatus::Success);
    let got = poll(&mut t.b);
    assert_eq!(
        (got[0].wr_id, got[0].status),
        (9, CompletionStatus::Success)
    );
    assert_eq!(t.b.read_local(t.mb.id, 0, 5).unwrap(), b"again");
}

struct Flag(std::sync::atomic::AtomicBool);
impl Wake for Flag {
    fn wake(self: std::sync::Arc<Self>) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

#[test]
fn a_completion_wakes_the_registered_task() {
    let mut t = rc_pair(CAPS);
    let flag = std::sync::Arc::new(Flag(false.into()));
    let waker = Waker::from(flag.clone());
    let mut cx = Context::from_waker(&waker);
    assert_eq!(t.b.poll_ready(&mut cx), Poll::Pending);
    t.b.post_recv(t.qb, 1, sge(&t.mb, 0, 64)).unwrap();
    t.a.post_send(t.qa, send(2, sge(&t.ma, 0, 8), None))
        .unwrap();
    assert!(flag.0.load(std::sync::atomic::Ordering::SeqCst));
    assert_eq!(t.b.poll_ready(&mut cx), Poll::Ready(()));
}

/// RDMA read: the peer's shared bytes land in the local buffer; reading owned memory (not
/// registered for remote read), past a region's end or with a bad key is a remote access
/// error that also takes the responder's queue pair down, as on InfiniBand.
#[test]
fn rdma_read_checks_keys_ranges_and_rights_and_fails_both_sides() {
    fn read(t: &mut RcPair, remote: RemoteSlice, len: usize) -> CompletionStatus {
        let request = SendRequest {
            wr_id: 3,
            op: SendOp::Read { remote },
            local: Some(sge(&t.ma, 0, len)),
        };
        t.a.post_send(t.qa, request).unwrap();
        poll(&mut t.a)[0].status
    }
    let mut t = rc_pair(CAPS);
    let shared =
        t.b.register(Buffer::Shared(Bytes::from_static(b"pull me, please")))
            .unwrap();
    let at = RemoteSlice {
        addr: shared.addr + 5,
        rkey: shared.rkey,
    };
    assert_eq!(read(&mut t, at, 2), CompletionStatus::Success);
    assert_eq!(t.a.read_local(t.ma.id, 0, 2).unwrap(), b"me");
    for bad in [
        // Owned memory is registered for remote write only.
        RemoteSlice {
            addr: t.mb.addr,
            rkey: t.mb.rkey,
        },
        // Past the end.
        RemoteSlice {
            addr: shared.addr + 10,
            rkey: shared.rkey,
        },
        // Unknown key.
        RemoteSlice {
            addr: shared.addr,
            rkey: shared.rkey + 1000,
        },
    ] {
        let mut t = rc_pair(CAPS);
        let _ =
            t.b.register(Buffer::Shared(Bytes::from_static(b"pull me, please")));
        t.b.post_recv(t.qb, 77, sge(&t.mb, 0, 8)).unwrap();
        // (A fresh fabric hands out the same addresses and keys.)
        assert_eq!(read(&mut t, bad, 8), CompletionStatus::RemoteAccessError);
        // The responder's queue pair failed too: its posted receive is flushed.
        let flushed = poll(&mut t.b);
        assert_eq!(flushed.len(), 1, "{flushed:?}");
        assert_eq!(
            (flushed[0].wr_id, flushed[0].status),
            (77, CompletionStatus::Flushed)
        );
    }
}
