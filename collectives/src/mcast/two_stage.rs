//! [`TwoStage`]: the two-stage multicast broadcast of Hoefler, Siebert and Rehm, as a sans-IO
//! state machine (one per communicator and rank).
//!
//! **Stage 1** — the root multicasts every fragment once (after the optional root delay, or
//! once the rank picked for the randomized single-rank synchronisation said it is ready).
//! **Stage 2** — the ranks form a virtual ring root → root+1 → … → root−1; whenever a rank
//! first holds a fragment, by multicast or from its predecessor, it forwards it to its
//! successor over the reliable point-to-point path (the root's predecessor forwards nothing:
//! the root needs nothing). So every rank other than the root gets every fragment exactly once
//! from its predecessor, whatever multicast did; whichever copy comes second is ignored. A rank
//! that got everything by multicast has forwarded everything at once and is done at once; a
//! rank that missed fragments waits for them along the ring ("penalty rounds").
//!
//! The machine keeps a broadcast until the rank has started it, holds all of it, and (not being
//! the root) has seen every fragment come from its predecessor; then it is retired, and stray
//! copies that arrive later are counted and dropped. Fragments of broadcasts this rank has not
//! started yet are kept (and forwarded: the ring does not wait for a late rank) up to an early
//! limit; past it, multicast copies are dropped (the ring repairs them) and the driver stops
//! taking point-to-point packets ([`wants_packets`](Protocol::wants_packets)), which leaves
//! them to the message layer's flow control.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Instant;

use bytes::Bytes;

use super::assembly::Assembly;
use super::wire::{Algorithm, Fragment, Keys, Packet, Reject};
use super::{BcastStats, Event, Protocol, Settings, Transmit, chosen_rank};

/// One broadcast as this rank sees it.
#[derive(Debug, Default)]
struct Bcast {
    started: bool,
    /// The fragments held; shaped by the first fragment seen (or the root's data).
    asm: Option<Assembly>,
    /// Which fragments came from the predecessor (each comes exactly once).
    from_ring: BTreeSet<u32>,
    completed: bool,
    /// Root only: the multicast waits until then (root delay) ...
    release_at: Option<Instant>,
    /// ... and, with the single-rank synchronisation, until this is set.
    ready: bool,
    /// Root only: stage 1 has not gone out yet.
    multicast_pending: bool,
}

/// The two-stage broadcast machine (see the [module docs](self)).
#[derive(Debug)]
pub(crate) struct TwoStage {
    rank: usize,
    size: usize,
    keys: Keys,
    settings: Settings,
    bcasts: BTreeMap<u64, Bcast>,
    /// Every broadcast id below this is retired; so are those in `retired`.
    retired_below: u64,
    retired: BTreeSet<u64>,
    /// Fragment bytes held for broadcasts this rank has not started.
    early_bytes: usize,
    transmits: VecDeque<Transmit>,
    events: VecDeque<Event>,
    stats: BcastStats,
}

impl TwoStage {
    pub fn new(rank: usize, size: usize, keys: Keys, settings: Settings) -> TwoStage {
        TwoStage {
            rank,
            size,
            keys,
            settings,
            bcasts: BTreeMap::new(),
            retired_below: 0,
            retired: BTreeSet::new(),
            early_bytes: 0,
            transmits: VecDeque::new(),
            events: VecDeque::new(),
            stats: BcastStats::default(),
        }
    }

    fn successor(&self) -> usize {
        (self.rank + 1) % self.size
    }

    fn predecessor(&self) -> usize {
        (self.rank + self.size - 1) % self.size
    }

    fn is_retired(&self, bid: u64) -> bool {
        bid < self.retired_below || self.retired.contains(&bid)
    }

    fn encode(&self, packet: &Packet) -> Bytes {
        packet.encode(self.keys, Algorithm::TwoStage)
    }

    /// Forwards fragment `seq` of `bid` along the ring, unless the successor is the root.
    fn forward(&mut self, bid: u64, seq: u32) {
        let Some(b) = self.bcasts.get(&bid) else {
            return;
        };
        let Some(asm) = &b.asm else { return };
        if self.successor() == asm.root as usize {
            return;
        }
        if let Some(f) = asm.fragment(bid, seq) {
            let packet = self.encode(&Packet::Fragment(f));
            self.transmits.push_back(Transmit::Send {
                to: self.successor(),
                packet,
            });
            self.stats.ring_sent += 1;
        }
    }

    /// Takes a fragment from either stage; returns whether it was new.
    fn accept(&mut self, f: Fragment, from_ring: bool) -> bool {
        let bid = f.bid;
        let (seq, len) = (f.seq, f.data.len());
        let early_room = self.early_bytes + len <= self.settings.early_limit;
        let b = self.bcasts.entry(bid).or_default();
        if !b.started && !from_ring && !early_room {
            // Nobody waits for it here yet and memory is short: the ring will bring it.
            self.stats.early_dropped += 1;
            if b.asm.is_none() && b.from_ring.is_empty() {
                self.bcasts.remove(&bid);
            }
            return false;
        }
        let asm = b.asm.get_or_insert_with(|| Assembly::shaped_like(&f));
        if !asm.fits(&f) {
            self.stats.malformed += 1;
            return false;
        }
        if from_ring && !b.from_ring.insert(seq) {
            // The predecessor sends each fragment once; a second is a protocol violation.
            self.stats.malformed += 1;
            return false;
        }
        let new = asm.insert(f);
        if new {
            if !b.started {
                self.early_bytes += len;
            }
            if from_ring {
                self.stats.ring_repaired += 1;
            } else {
                self.stats.multicast_received += 1;
            }
            self.forward(bid, seq);
        } else {
            self.stats.redundant += 1;
        }
        self.progress(bid);
        new
    }

    /// Completes and retires `bid` when it can.
    fn progress(&mut self, bid: u64) {
        let me = self.rank;
        let Some(b) = self.bcasts.get_mut(&bid) else {
            return;
        };
        let Some(asm) = &b.asm else { return };
        if b.started && !b.completed && asm.is_complete() {
            b.completed = true;
            self.events.push_back(Event::Complete {
                bid,
                data: asm.data(),
            });
        }
        let ring_done = asm.root as usize == me || b.from_ring.len() == asm.count as usize;
        if b.completed && ring_done && !b.multicast_pending {
            self.bcasts.remove(&bid);
            self.retired.insert(bid);
            while self.retired.remove(&self.retired_below) {
                self.retired_below += 1;
            }
        }
    }

    /// Sends stage 1 of `bid` if this rank is its root and the delay and synchronisation allow
    /// (the caller then calls [`progress`](Self::progress), which may retire it).
    fn release_multicast(&mut self, now: Instant, bid: u64) {
        let Some(b) = self.bcasts.get_mut(&bid) else {
            return;
        };
        let due = b.release_at.is_none_or(|t| t <= now);
        if !(b.multicast_pending && due && b.ready) {
            return;
        }
        b.multicast_pending = false;
        if let Some(asm) = &b.asm {
            let frags: Vec<Fragment> = (0..asm.count)
                .filter_map(|s| asm.fragment(bid, s))
                .collect();
            for f in frags {
                let packet = self.encode(&Packet::Fragment(f));
                self.transmits.push_back(Transmit::Multicast(packet));
                self.stats.multicast_sent += 1;
            }
        }
    }

    fn on_packet(&mut self, now: Instant, from: Option<usize>, bytes: &Bytes) {
        let packet = match Packet::decode(bytes, self.keys, Algorithm::TwoStage) {
            Ok(p) => p,
            Err(reason) => {
                self.stats.count_reject(reason);
                return;
            }
        };
        match (packet, from) {
            (Packet::Fragment(f), _) if self.is_retired(f.bid) => self.stats.redundant += 1,
            (Packet::Fragment(f), None) => {
                self.accept(f, false);
            }
            (Packet::Fragment(f), Some(from)) => {
                if from != self.predecessor() || f.root as usize == self.rank {
                    self.stats.malformed += 1;
                } else {
                    self.accept(f, true);
                }
            }
            (Packet::Ready { bid }, Some(from))
                if !self.is_retired(bid)
                    && from == chosen_rank(self.keys, bid, self.rank, self.size) =>
            {
                self.bcasts.entry(bid).or_default().ready = true;
                self.release_multicast(now, bid);
                self.progress(bid);
            }
            (Packet::Ready { .. }, Some(_)) => self.stats.redundant += 1,
            _ => self.stats.count_reject(Reject::Malformed),
        }
    }
}

impl Protocol for TwoStage {
    fn start(&mut self, now: Instant, bid: u64, root: usize, data: Option<Bytes>) {
        let me = self.rank;
        let sync = self.settings.sync && self.size > 1;
        let chosen = chosen_rank(self.keys, bid, root, self.size);
        let delay = self.settings.root_delay;
        let b = self.bcasts.entry(bid).or_default();
        b.started = true;
        if let Some(asm) = &b.asm {
            self.early_bytes -= asm.held_bytes().min(self.early_bytes);
        }
        if root == me {
            let data = data.unwrap_or_default();
            let asm = Assembly::whole(bid, root as u32, &data, self.settings.fragment);
            let count = asm.count;
            b.asm = Some(asm);
            b.multicast_pending = self.size > 1;
            b.release_at = (!delay.is_zero()).then(|| now + delay);
            b.ready |= !sync;
            // Stage 1 first: the ring copy to the successor should be the redundant one.
            self.release_multicast(now, bid);
            for seq in 0..count {
                self.forward(bid, seq);
            }
        } else if sync && chosen == me {
            let packet = self.encode(&Packet::Ready { bid });
            self.transmits
                .push_back(Transmit::Send { to: root, packet });
        }
        self.progress(bid);
    }

    fn handle_datagram(&mut self, now: Instant, datagram: &Bytes) {
        self.on_packet(now, None, datagram);
    }

    fn handle_packet(&mut self, now: Instant, from: usize, packet: &Bytes) {
        self.on_packet(now, Some(from), packet);
    }

    fn handle_timeout(&mut self, now: Instant) {
        let due: Vec<u64> = self
            .bcasts
            .iter()
            .filter(|(_, b)| b.multicast_pending && b.release_at.is_some_and(|t| t <= now))
            .map(|(bid, _)| *bid)
            .collect();
        for bid in due {
            self.release_multicast(now, bid);
            self.progress(bid);
        }
    }

    fn poll_timeout(&self) -> Option<Instant> {
        self.bcasts
            .values()
            .filter(|b| b.multicast_pending && b.ready)
            .filter_map(|b| b.release_at)
            .min()
    }

    fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    fn wants_packets(&self) -> bool {
        self.early_bytes < self.settings.early_limit
    }

    fn owes_nothing(&self) -> bool {
        // Broadcasts never started here are a program error (mismatched collectives), not a debt.
        self.bcasts.values().all(|b| !b.started)
    }

    fn expects_from(&self, rank: usize) -> bool {
        // Held broadcasts need nothing more once the ring has brought every fragment (or this
        // rank is the root, past its synchronisation): a late rank's unstarted broadcast whose
        // fragments are all here must not turn a peer's orderly exit into a failure.
        let me = self.rank;
        let from_ring = rank == self.predecessor();
        self.bcasts.iter().any(|(&bid, b)| match &b.asm {
            None => b.started && from_ring,
            Some(asm) => {
                let root = asm.root as usize;
                (from_ring && root != me && b.from_ring.len() < asm.count as usize)
                    || (b.multicast_pending
                        && !b.ready
                        && rank == chosen_rank(self.keys, bid, root, self.size))
            }
        })
    }

    fn owner_gone(&mut self, _now: Instant) {}

    fn stats(&self) -> BcastStats {
        self.stats
    }
}
