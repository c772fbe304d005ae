//! A deterministic discrete-event simulation of a network, running the real sans-IO broadcast
//! machines: time is simulated, every message costs a fixed latency plus a per-byte time on
//! its sender's link (sends from one rank go one after another), a multicast costs its sender
//! one send whatever the group's size and reaches each other rank on its own with a chance of
//! loss, corruption or extra delay. Used by the tests (loss 0–100 %, corruption, reordering,
//! late ranks, 2–1024 ranks) and to draw the book's scaling plots.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rankweave_core::rng::SplitMix64;

use super::channels::Channels;
use super::two_stage::TwoStage;
use super::wire::Keys;
use super::{BcastStats, Event, Protocol, Settings, Transmit};
use crate::tree::BinomialTree;

/// Which broadcast to simulate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimAlgorithm {
    /// The two-stage multicast broadcast.
    TwoStage,
    /// LA-MPI's channel broadcast.
    Channels,
    /// A binomial tree over point-to-point sends (the baseline).
    Binomial,
}

/// The simulated network and workload.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Ranks.
    pub ranks: usize,
    /// Bytes per broadcast.
    pub bytes: usize,
    /// Broadcasts, one after another on every rank (roots rotate when `rotate_root`).
    pub broadcasts: usize,
    /// Root `i mod ranks` for broadcast `i` (else always 0).
    pub rotate_root: bool,
    /// Latency of every message, point-to-point or multicast.
    pub latency: Duration,
    /// Link time per byte, in nanoseconds.
    pub ns_per_byte: f64,
    /// Chance that a rank misses a multicast datagram.
    pub loss: f64,
    /// Chance that a rank gets a multicast datagram with one byte changed.
    pub corrupt: f64,
    /// Chance that a multicast datagram reaches a rank up to 4 latencies late.
    pub reorder: f64,
    /// Rank `r` starts its first broadcast this long after the others (`late[r]`; missing
    /// entries are 0).
    pub late: Vec<Duration>,
    /// Fragment, channel and timer settings of the machines.
    pub fragment: usize,
    /// Broadcast channels (channel broadcast).
    pub channels: usize,
    /// NACK timeout (channel broadcast).
    pub nack_timeout: Duration,
    /// Seed of every random choice.
    pub seed: u64,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            ranks: 8,
            bytes: 8,
            broadcasts: 1,
            rotate_root: false,
            latency: Duration::from_micros(2),
            ns_per_byte: 0.1,
            loss: 0.0,
            corrupt: 0.0,
            reorder: 0.0,
            late: Vec::new(),
            fragment: 8192,
            channels: 16,
            nack_timeout: Duration::from_micros(100),
            seed: 1,
        }
    }
}

/// What a simulation saw.
#[derive(Clone, Debug)]
pub struct SimReport {
    /// `done[b][r]`: when rank `r` completed broadcast `b`, from the start of the run.
    pub done: Vec<Vec<Duration>>,
    /// `data[b][r]`: the bytes rank `r` got for broadcast `b`.
    pub data: Vec<Vec<Bytes>>,
    /// `roots[b]`: the root of broadcast `b`.
    pub roots: Vec<usize>,
    /// The machines' counters, summed over ranks.
    pub stats: BcastStats,
    /// Whether every machine owed nothing at the end (all synchronised and forwarded).
    pub settled: bool,
}

impl SimReport {
    /// The latest completion of broadcast `b` minus its earliest start (the run's start for
    /// the first).
    pub fn latency(&self, b: usize) -> Duration {
        self.done[b].iter().copied().max().unwrap_or_default()
    }

    /// Latest minus earliest completion of broadcast `b` among the ranks other than its root
    /// (which has the data from the start): the skew the algorithm leaves between receivers.
    pub fn skew(&self, b: usize) -> Duration {
        let receivers = || {
            self.done[b]
                .iter()
                .enumerate()
                .filter(|&(r, _)| r != self.roots[b])
                .map(|(_, &t)| t)
        };
        let max = receivers().max().unwrap_or_default();
        let min = receivers().min().unwrap_or_default();
        max - min
    }
}

enum Delivery {
    Datagram {
        to: usize,
        bytes: Bytes,
    },
    Packet {
        to: usize,
        from: usize,
        bytes: Bytes,
    },
    Start {
        rank: usize,
    },
    Timer {
        rank: usize,
    },
}

/// The binomial tree as a machine (the baseline): the root sends the whole message to its
/// children, every rank forwards it to its own on receipt.
#[derive(Debug)]
struct Tree {
    rank: usize,
    size: usize,
    out: Vec<Transmit>,
    events: Vec<Event>,
    early: std::collections::HashMap<u64, Bytes>,
    started: std::collections::HashMap<u64, usize>,
}

impl Protocol for Tree {
    fn start(&mut self, _now: Instant, bid: u64, root: usize, data: Option<Bytes>) {
        let tree = BinomialTree::of(self.size, self.rank, root);
        let data = if root == self.rank {
            data
        } else {
            self.early.remove(&bid)
        };
        self.started.insert(bid, root);
        if let Some(d) = data {
            self.deliver(bid, &tree, d);
        }
    }
    fn handle_datagram(&mut self, _: Instant, _: &Bytes) {}
    fn handle_packet(&mut self, _now: Instant, _from: usize, packet: &Bytes) {
        let bid = u64::from_le_bytes(packet[..8].try_into().unwrap_or_default());
        let data = packet.slice(8..);
        match self.started.get(&bid) {
            Some(&root) => {
                let tree = BinomialTree::of(self.size, self.rank, root);
                self.deliver(bid, &tree, data);
            }
            None => {
                self.early.insert(bid, data);
            }
        }
    }
    fn handle_timeout(&mut self, _: Instant) {}
    fn poll_timeout(&self) -> Option<Instant> {
        None
    }
    fn poll_transmit(&mut self) -> Option<Transmit> {
        (!self.out.is_empty()).then(|| self.out.remove(0))
    }
    fn poll_event(&mut self) -> Option<Event> {
        self.events.pop()
    }
    fn wants_packets(&self) -> bool {
        true
    }
    fn owes_nothing(&self) -> bool {
        true
    }
    fn expects_from(&self, _: usize) -> bool {
        false
    }
    fn owner_gone(&mut self, _: Instant) {}
    fn stats(&self) -> BcastStats {
        BcastStats::default()
    }
}

impl Tree {
    fn deliver(&mut self, bid: u64, tree: &BinomialTree, data: Bytes) {
        let mut packet = bid.to_le_bytes().to_vec();
        packet.extend_from_slice(&data);
        let packet = Bytes::from(packet);
        for c in tree.children() {
            self.out.push(Transmit::Send {
                to: c.rank,
                packet: packet.clone(),
            });
        }
        self.events.push(Event::Complete { bid, data });
    }
}

/// Runs `algorithm` on the network and workload of `config`.
pub fn simulate(algorithm: SimAlgorithm, config: &SimConfig) -> SimReport {
    let n = config.ranks.max(1);
    let keys = Keys {
        job_key: 0x5157,
        context: 2,
    };
    let settings = Settings {
        fragment: config.fragment.max(1),
        early_limit: usize::MAX,
        root_delay: Duration::ZERO,
        sync: false,
        channels: config.channels.max(1),
        nack_timeout: config.nack_timeout,
        retries: 3,
    };
    let mut machines: Vec<Box<dyn Protocol>> = (0..n)
        .map(|r| -> Box<dyn Protocol> {
            match algorithm {
                SimAlgorithm::TwoStage => Box::new(TwoStage::new(r, n, keys, settings)),
                SimAlgorithm::Channels => Box::new(Channels::new(r, n, keys, settings)),
                SimAlgorithm::Binomial => Box::new(Tree {
                    rank: r,
                    size: n,
                    out: Vec::new(),
                    events: Vec::new(),
                    early: Default::default(),
                    started: Default::default(),
                }),
            }
        })
        .collect();
    let base = Instant::now();
    let mut rng = SplitMix64(config.seed);
    let mut queue: BinaryHeap<Reverse<(Duration, u64, usize)>> = BinaryHeap::new();
    let mut deliveries: Vec<Option<Delivery>> = Vec::new();
    let push = |queue: &mut BinaryHeap<_>, deliveries: &mut Vec<Option<Delivery>>, at, d| {
        deliveries.push(Some(d));
        let id = deliveries.len() - 1;
        queue.push(Reverse((at, id as u64, id)));
    };
    let payload = |b: usize| -> Bytes {
        Bytes::from(
            (0..config.bytes)
                .map(|i| (i as u8).wrapping_mul(31).wrapping_add(b as u8))
                .collect::<Vec<u8>>(),
        )
    };
    let root_of = |b: usize| if config.rotate_root { b % n } else { 0 };
    let mut next_bid = vec![0usize; n];
    let mut link_free = vec![Duration::ZERO; n];
    let mut done = vec![vec![Duration::MAX; n]; config.broadcasts];
    let mut data = vec![vec![Bytes::new(); n]; config.broadcasts];
    let mut gone = vec![false; n];
    let mut timers: Vec<Option<Instant>> = vec![None; n];
    for (r, _) in machines.iter().enumerate() {
        let at = config.late.get(r).copied().unwrap_or_default();
        if config.broadcasts > 0 {
            push(&mut queue, &mut deliveries, at, Delivery::Start { rank: r });
        }
    }
    let mut stats = BcastStats::default();
    let mut steps = 0u64;
    while let Some(Reverse((t, _, id))) = queue.pop() {
        steps += 1;
        if steps > 50_000_000 {
            break;
        }
        let now = base + t;
        let Some(d) = deliveries[id].take() else {
            continue;
        };
        let rank = match d {
            Delivery::Datagram { to, bytes } => {
                machines[to].handle_datagram(now, &bytes);
                to
            }
            Delivery::Packet { to, from, bytes } => {
                machines[to].handle_packet(now, from, &bytes);
                to
            }
            Delivery::Start { rank } => {
                let b = next_bid[rank];
                next_bid[rank] += 1;
                let root = root_of(b);
                let d = (root == rank).then(|| payload(b));
                machines[rank].start(now, b as u64, root, d);
                rank
            }
            Delivery::Timer { rank } => {
                if timers[rank].is_some_and(|at| at <= now) {
                    timers[rank] = None;
                    machines[rank].handle_timeout(now);
                }
                rank
            }
        };
        // Everything the machine wants sent leaves its link one after another; point-to-point
        // packets between two ranks therefore arrive in order, as over the reliable path.
        while let Some(tx) = machines[rank].poll_transmit() {
            let (bytes, to) = match tx {
                Transmit::Multicast(b) => (b, None),
                Transmit::Send { to, packet } => (packet, Some(to)),
            };
            let start = link_free[rank].max(t);
            let wire = Duration::from_nanos((bytes.len() as f64 * config.ns_per_byte) as u64);
            link_free[rank] = start + wire;
            let arrive = start + wire + config.latency;
            match to {
                Some(to) => push(
                    &mut queue,
                    &mut deliveries,
                    arrive,
                    Delivery::Packet {
                        to,
                        from: rank,
                        bytes,
                    },
                ),
                None => {
                    for to in (0..n).filter(|&r| r != rank) {
                        // The same draws for every copy, whatever happens to it.
                        let lose = rng.chance(config.loss);
                        let corrupt = rng.chance(config.corrupt);
                        let late = rng.chance(config.reorder);
                        let (position, extra) = (rng.next_u64(), rng.below(4) + 1);
                        if lose {
                            continue;
                        }
                        let mut copy = bytes.clone();
                        if corrupt && !copy.is_empty() {
                            let mut v = copy.to_vec();
                            let at = (position % v.len() as u64) as usize;
                            v[at] ^= 0x5a;
                            copy = Bytes::from(v);
                        }
                        let at = if late {
                            arrive + config.latency * extra as u32
                        } else {
                            arrive
                        };
                        push(
                            &mut queue,
                            &mut deliveries,
                            at,
                            Delivery::Datagram { to, bytes: copy },
                        );
                    }
                }
            }
        }
        while let Some(Event::Complete { bid, data: got }) = machines[rank].poll_event() {
            let b = bid as usize;
            if b < config.broadcasts {
                done[b][rank] = t;
                data[b][rank] = got;
            }
            if next_bid[rank] < config.broadcasts {
                push(&mut queue, &mut deliveries, t, Delivery::Start { rank });
            } else if !gone[rank] && next_bid[rank] == config.broadcasts {
                gone[rank] = true;
                machines[rank].owner_gone(now);
            }
        }
        if let Some(at) = machines[rank].poll_timeout() {
            if timers[rank].is_none_or(|cur| at < cur) {
                timers[rank] = Some(at);
                push(
                    &mut queue,
                    &mut deliveries,
                    at.saturating_duration_since(base),
                    Delivery::Timer { rank },
                );
            }
        }
    }
    for m in &machines {
        stats.add(&m.stats());
    }
    SimReport {
        done,
        data,
        roots: (0..config.broadcasts).map(root_of).collect(),
        stats,
        // Once everything is done nobody may wait for anybody: a rank leaving then is no loss.
        settled: machines
            .iter()
            .all(|m| m.owes_nothing() && (0..config.ranks).all(|peer| !m.expects_from(peer))),
    }
}
