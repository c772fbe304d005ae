//! Property test: random programs of sends, receives (exact and wildcard), receive drops and
//! probes over 3-4 ranks and two communicators, checked against a small reference model of
//! MPI matching.
//!
//! All ranks are driven from one task of a current-thread runtime, in program order, so no
//! progress task runs until the end. Operations start when called. An in-process frame waits
//! in the destination's mailbox until that rank takes arrivals in (when it waits or probes;
//! posting or dropping a receive does not), and when that happens is a legitimate source of
//! different outcomes (MPI does not define arrival time). The model delivers at send time, so
//! after every send the program makes the destination take arrivals in with an `iprobe`. The
//! outcome is then deterministic and the model predicts it exactly:
//!
//! * a message goes to the earliest-posted matching receive at its destination, else it is
//!   queued as unexpected (in arrival order);
//! * a receive takes the earliest-arrived matching unexpected message, else it is posted;
//! * dropping an unmatched receive withdraws it; dropping a matched one gives its message back
//!   at its original arrival position (where the earliest-posted matching receive takes it);
//! * a probe reports the earliest-arrived matching unexpected message.
//!
//! At the end, receives the model leaves unmatched are dropped, matched ones are awaited and
//! compared, and the remaining unexpected messages are drained with wildcard receives in
//! arrival order.

mod common;

use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, RngSeed};
use rankweave::{Communicator, Config, RecvOp, Source, Status, Tag};

const CONTEXTS: usize = 2;

#[derive(Clone, Debug)]
enum Op {
    Send {
        from: usize,
        to: usize,
        ctx: usize,
        tag: u32,
        big: bool,
    },
    Recv {
        at: usize,
        ctx: usize,
        src: Option<usize>,
        tag: Option<u32>,
    },
    /// Drops the `pick % live`-th receive not yet dropped.
    Drop { pick: usize },
    Probe {
        at: usize,
        ctx: usize,
        src: Option<usize>,
        tag: Option<u32>,
    },
}

/// `drop_weight` sets how often receives are dropped; `narrow` uses one context and two tags,
/// so that operations collide more often.
fn op_strategy(drop_weight: u32, narrow: bool) -> impl Strategy<Value = Op> {
    let rank = 0usize..4;
    let ctx = 0usize..if narrow { 1 } else { CONTEXTS };
    let tag = 0u32..if narrow { 2 } else { 3 };
    let src = prop::option::weighted(0.6, 0usize..4);
    let sel_tag = prop::option::weighted(0.6, tag.clone());
    let send = (rank.clone(), rank.clone(), ctx.clone(), tag, any::<bool>()).prop_map(
        |(from, to, ctx, tag, big)| Op::Send {
            from,
            to,
            ctx,
            tag,
            big,
        },
    );
    let recv = (rank.clone(), ctx.clone(), src.clone(), sel_tag.clone())
        .prop_map(|(at, ctx, src, tag)| Op::Recv { at, ctx, src, tag });
    let probe =
        (rank, ctx, src, sel_tag).prop_map(|(at, ctx, src, tag)| Op::Probe { at, ctx, src, tag });
    let drop = any::<usize>().prop_map(|pick| Op::Drop { pick });
    prop_oneof![
        5 => send,
        5 => recv,
        drop_weight => drop,
        1 => probe,
    ]
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Msg {
    id: u64,
    src: usize,
    ctx: usize,
    tag: u32,
    len: usize,
    arrival: u64,
}

#[derive(Clone, Copy, Debug)]
struct Sel {
    ctx: usize,
    src: Option<usize>,
    tag: Option<u32>,
}

impl Sel {
    fn matches(&self, m: &Msg) -> bool {
        self.ctx == m.ctx
            && self.src.is_none_or(|s| s == m.src)
            && self.tag.is_none_or(|t| t == m.tag)
    }
}

#[derive(Clone, Debug)]
enum RecvState {
    Pending,
    Matched(Msg),
    Dropped,
}

/// The reference model of one job's matching.
struct Model {
    /// Per rank: posted receives (receive index, selector) in posting order.
    posted: Vec<Vec<(usize, Sel)>>,
    /// Per rank: unexpected messages in arrival order.
    unexpected: Vec<Vec<Msg>>,
    arrivals: Vec<u64>,
    /// Per receive: its rank and state.
    recvs: Vec<(usize, RecvState)>,
}

impl Model {
    fn new(n: usize) -> Model {
        Model {
            posted: vec![Vec::new(); n],
            unexpected: vec![Vec::new(); n],
            arrivals: vec![0; n],
            recvs: Vec::new(),
        }
    }

    /// A message `m` is offered at rank `at`: the earliest-posted matching receive takes it,
    /// else it is queued by arrival number.
    fn offer(&mut self, at: usize, m: Msg) {
        if let Some(i) = self.posted[at].iter().position(|(_, s)| s.matches(&m)) {
            let (r, _) = self.posted[at].remove(i);
            self.recvs[r].1 = RecvState::Matched(m);
        } else {
            let q = &mut self.unexpected[at];
            let pos = q.partition_point(|u| u.arrival < m.arrival);
            q.insert(pos, m);
        }
    }

    fn send(&mut self, id: u64, from: usize, to: usize, ctx: usize, tag: u32, len: usize) {
        let arrival = self.arrivals[to];
        self.arrivals[to] += 1;
        let m = Msg {
            id,
            src: from,
            ctx,
            tag,
            len,
            arrival,
        };
        self.offer(to, m);
    }

    fn recv(&mut self, at: usize, sel: Sel) -> usize {
        let r = self.recvs.len();
        if let Some(i) = self.unexpected[at].iter().position(|m| sel.matches(m)) {
            let m = self.unexpected[at].remove(i);
            self.recvs.push((at, RecvState::Matched(m)));
        } else {
            self.recvs.push((at, RecvState::Pending));
            self.posted[at].push((r, sel));
        }
        r
    }

    fn drop_recv(&mut self, r: usize) {
        let (at, state) = std::mem::replace(&mut self.recvs[r], (0, RecvState::Dropped));
        self.recvs[r].0 = at;
        match state {
            RecvState::Pending => self.posted[at].retain(|(p, _)| *p != r),
            RecvState::Matched(m) => self.offer(at, m),
            RecvState::Dropped => unreachable!("dropped twice"),
        }
    }

    fn probe(&self, at: usize, sel: Sel) -> Option<Status> {
        self.unexpected[at]
            .iter()
            .find(|m| sel.matches(m))
            .map(|m| Status {
                source: m.src,
                tag: m.tag,
                len: m.len,
            })
    }
}

fn payload(id: u64, len: usize) -> Vec<u8> {
    let mut v = id.to_le_bytes().to_vec();
    v.resize(len, id as u8);
    v
}

/// What a receive yielded: (source, tag, message id, length).
type Got = (usize, u32, u64, usize);

/// Runs `program` on `n` ranks and returns, for comparison, (what happened, what the model
/// predicts): the probe results and receive results in order, then the drained leftovers.
/// `big` messages are `big_len` bytes and more; others 8 to 31 bytes.
fn run(n: usize, program: &[Op], eager_limit: usize, big_len: usize) -> (Vec<String>, Vec<String>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        common::within(async {
            let config = Config {
                eager_limit,
                ..Config::default()
            };
            let world = rankweave::transports::inproc::world(n, &config).unwrap();
            let mut comms: Vec<[Communicator; CONTEXTS]> = Vec::new();
            for w in world {
                let d = w.dup().await.unwrap();
                comms.push([w, d]);
            }
            let mut model = Model::new(n);
            let mut recv_ops: Vec<Option<RecvOp>> = Vec::new();
            let mut send_ops = Vec::new();
            let (mut real, mut want) = (Vec::new(), Vec::new());
            let mut next_id = 0u64;
            for op in program {
                match *op {
                    Op::Send {
                        from,
                        to,
                        ctx,
                        tag,
                        big,
                    } => {
                        let (from, to) = (from % n, to % n);
                        let id = next_id;
                        next_id += 1;
                        let len = if big {
                            big_len + (id as usize % 64)
                        } else {
                            8 + (id as usize % 24)
                        };
                        send_ops.push(comms[from][ctx].send(to, tag, payload(id, len)));
                        // Deliver now, as the model does: the destination takes in what
                        // arrived (a probe makes progress).
                        comms[to][0].iprobe(Source::Any, Tag::Any).unwrap();
                        model.send(id, from, to, ctx, tag, len);
                    }
                    Op::Recv { at, ctx, src, tag } => {
                        let at = at % n;
                        let src = src.map(|s| s % n);
                        let op = comms[at][ctx].recv(
                            src.map_or(Source::Any, Source::Rank),
                            tag.map_or(Tag::Any, Tag::Value),
                        );
                        recv_ops.push(Some(op));
                        model.recv(at, Sel { ctx, src, tag });
                    }
                    Op::Drop { pick } => {
                        let live: Vec<usize> = (0..recv_ops.len())
                            .filter(|&r| recv_ops[r].is_some())
                            .collect();
                        if live.is_empty() {
                            continue;
                        }
                        let r = live[pick % live.len()];
                        drop(recv_ops[r].take());
                        model.drop_recv(r);
                    }
                    Op::Probe { at, ctx, src, tag } => {
                        let at = at % n;
                        let src = src.map(|s| s % n);
                        let got = comms[at][ctx]
                            .iprobe(
                                src.map_or(Source::Any, Source::Rank),
                                tag.map_or(Tag::Any, Tag::Value),
                            )
                            .unwrap();
                        real.push(format!("probe {op:?}: {got:?}"));
                        want.push(format!(
                            "probe {op:?}: {:?}",
                            model.probe(at, Sel { ctx, src, tag })
                        ));
                    }
                }
            }
            // Receives the model leaves unmatched are dropped (withdrawn) first.
            for (r, (_, state)) in model.recvs.iter().enumerate() {
                if matches!(state, RecvState::Pending) {
                    drop(recv_ops[r].take());
                }
            }
            for (r, (at, state)) in model.recvs.iter().enumerate() {
                let RecvState::Matched(m) = state else {
                    continue;
                };
                let op = recv_ops[r].take().expect("matched receive was dropped");
                let got = match tokio::time::timeout(Duration::from_millis(500), op).await {
                    Ok(Ok(msg)) => {
                        let id = u64::from_le_bytes(msg.data()[..8].try_into().unwrap());
                        assert_eq!(msg.data()[..], payload(id, msg.len())[..]);
                        format!("{:?}", (msg.source(), msg.tag(), id, msg.len()))
                    }
                    Ok(Err(e)) => format!("error {e:?}"),
                    Err(_) => "timed out".to_string(),
                };
                let w: Got = (m.src, m.tag, m.id, m.len);
                real.push(format!("recv #{r} at {at}: {got}"));
                want.push(format!("recv #{r} at {at}: {w:?}"));
            }
            // The leftovers, in arrival order per rank and context.
            for (at, rank_comms) in comms.iter().enumerate() {
                for (ctx, comm) in rank_comms.iter().enumerate() {
                    for m in model.unexpected[at].iter().filter(|m| m.ctx == ctx) {
                        let op = comm.recv(Source::Any, Tag::Any);
                        let got = match tokio::time::timeout(Duration::from_millis(500), op).await {
                            Ok(Ok(msg)) => {
                                let id = u64::from_le_bytes(msg.data()[..8].try_into().unwrap());
                                format!("{:?}", (msg.source(), msg.tag(), id, msg.len()))
                            }
                            Ok(Err(e)) => format!("error {e:?}"),
                            Err(_) => "timed out".to_string(),
                        };
                        real.push(format!("left at {at}/{ctx}: {got}"));
                        want.push(format!(
                            "left at {at}/{ctx}: {:?}",
                            (m.src, m.tag, m.id, m.len)
                        ));
                    }
                    real.push(format!(
                        "empty at {at}/{ctx}: {:?}",
                        comm.iprobe(Source::Any, Tag::Any).unwrap()
                    ));
                    want.push(format!("empty at {at}/{ctx}: None"));
                }
                let st = rank_comms[0].stats();
                real.push(format!(
                    "queues at {at}: {} {}",
                    st.posted_receives, st.unexpected_messages
                ));
                want.push(format!("queues at {at}: 0 0"));
            }
            // Every send, rendezvous ones included, has been received by now.
            for (i, op) in send_ops.into_iter().enumerate() {
                let r = tokio::time::timeout(Duration::from_millis(500), op).await;
                real.push(format!("send #{i}: {r:?}"));
                want.push(format!("send #{i}: Ok(Ok(()))"));
            }
            (real, want)
        })
        .await
    })
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 64,
        rng_seed: RngSeed::Fixed(0x5EED_2024),
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    /// Eager messages only, with receive drops.
    #[test]
    fn eager_programs_match_the_model(
        n in 3usize..=4,
        program in prop::collection::vec(op_strategy(2, false), 1..80),
    ) {
        let (real, want) = run(n, &program, 1 << 20, 2000);
        prop_assert_eq!(real, want);
    }

    /// Eager messages only, one context and two tags (more collisions), many drops.
    #[test]
    fn eager_narrow_programs_match_the_model(
        n in 3usize..=4,
        program in prop::collection::vec(op_strategy(4, true), 1..80),
    ) {
        let (real, want) = run(n, &program, 1 << 20, 2000);
        prop_assert_eq!(real, want);
    }

    /// Eager and rendezvous messages (eager limit 64 bytes), no drops.
    #[test]
    fn rendezvous_programs_match_the_model(
        n in 3usize..=4,
        program in prop::collection::vec(op_strategy(0, false), 1..80),
    ) {
        let (real, want) = run(n, &program, 64, 65);
        prop_assert_eq!(real, want);
    }

    /// Eager and rendezvous messages with drops (one context, two tags).
    #[test]
        fn rendezvous_programs_with_drops_match_the_model(
        n in 3usize..=4,
        program in prop::collection::vec(op_strategy(4, true), 1..80),
    ) {
        let (real, want) = run(n, &program, 64, 65);
        prop_assert_eq!(real, want);
    }
}
