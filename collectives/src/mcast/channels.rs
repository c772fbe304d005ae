//! [`Channels`]: LA-MPI's channel broadcast (Yu, Sur, Panda, Aulwes and Graham) over an
//! unreliable multicast group, as a sans-IO state machine (one per communicator and rank).
//!
//! * **Channels.** A communicator has `k` broadcast channels (`RANKWEAVE_MCAST_CHANNELS`);
//!   broadcast `b` uses channel `b mod k`, and the broadcasts `e·k .. (e+1)·k` form epoch `e`.
//!   The root multicasts its fragments (CRC-protected) and its broadcast returns at once: the
//!   data is buffered in the channel. A receiver's broadcast returns when it holds every
//!   fragment.
//! * **NACKs.** A receiver still missing fragments `RANKWEAVE_MCAST_NACK` after it started a
//!   broadcast asks the root for them (then again with doubling back-off). The root resends
//!   them by multicast the first `RANKWEAVE_MCAST_RETRIES` times, then straight to the asking
//!   rank over point-to-point.
//! * **Delayed split-phase synchronisation.** A channel is reused only after every rank holds
//!   the broadcast it carried. A rank that wants to start the first broadcast of epoch `e+1`
//!   (its channels have run out) or whose communicator is dropped synchronises epoch `e`:
//!   *sync-up* along a binomial tree rooted at rank 0 (the manager) — each rank sends its
//!   parent which broadcasts of the epoch it and its subtree still miss, combining its
//!   children's reports: these double as the ACKs — then *sync-down*, the manager's combined
//!   result down the same tree. Every broadcast someone misses is then repaired along the
//!   point-to-point binomial tree rooted at its root, through the subtrees that need it, and
//!   the epoch's channels are released. One synchronisation per `k` broadcasts amortises its
//!   cost.
//! * **Fail-over.** When `RANKWEAVE_MCAST_RETRIES` synchronisations in a row find most of
//!   their epoch missing, multicast is deemed broken: the sync-down says so, and from the next
//!   epoch on every broadcast goes down the point-to-point tree (no channels, no
//!   synchronisation).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Instant;

use bytes::Bytes;

use super::assembly::Assembly;
use super::wire::{Algorithm, Fragment, Keys, MissingList, Packet};
use super::{BcastStats, Event, Protocol, Settings, Transmit};
use crate::tree::BinomialTree;

/// Fragments one NACK asks for at most.
const NACK_MAX: usize = 256;
/// Longest NACK back-off: this many NACK timeouts.
const NACK_BACKOFF_MAX: u32 = 64;

#[derive(Debug, Default)]
struct Bcast {
    started: bool,
    root: Option<usize>,
    asm: Option<Assembly>,
    completed: bool,
    /// Receiver: when to NACK next, and the current back-off factor.
    nack_at: Option<Instant>,
    backoff: u32,
    /// Root: multicast resends so far.
    resends: u32,
    /// Tree forwards owed once the data is whole (sync repairs, fail-over broadcasts).
    forward_to: Vec<usize>,
    /// Receiver: multicast failed for it at first (a NACK went out).
    troubled: bool,
}

/// An epoch's synchronisation in progress on this rank.
#[derive(Debug)]
struct Sync {
    epoch: u64,
    /// One past the last broadcast it covers.
    end: u64,
    children: Vec<usize>,
    /// Reports received from children so far.
    reports: usize,
    missing: BTreeMap<u64, BTreeSet<u32>>,
    /// (broadcast, rank) pairs of the subtree for which multicast failed at first.
    trouble: u64,
    sent_up: bool,
    /// After the sync-down: tree fragments still expected, per broadcast.
    expect: BTreeMap<u64, u32>,
    down: bool,
}

/// The channel broadcast machine (see the [module docs](self)).
#[derive(Debug)]
pub(crate) struct Channels {
    rank: usize,
    size: usize,
    keys: Keys,
    settings: Settings,
    k: u64,
    bcasts: BTreeMap<u64, Bcast>,
    /// Broadcasts below this are synchronised and their channels free.
    released_below: u64,
    /// Broadcasts started here so far (queued ones included).
    next_start: u64,
    /// Starts waiting for a channel.
    queued: VecDeque<(u64, usize, Option<Bytes>)>,
    sync: Option<Sync>,
    /// Sync-up reports from children for epochs this rank has not reached.
    early_reports: BTreeMap<u64, Vec<(u64, MissingList)>>,
    /// Point-to-point packets for broadcasts past the window, kept until it moves.
    deferred: Vec<(usize, Packet)>,
    /// From this broadcast on, everything goes down the point-to-point tree.
    failover_from: Option<u64>,
    failed_syncs: u32,
    owner_gone: bool,
    early_bytes: usize,
    transmits: VecDeque<Transmit>,
    events: VecDeque<Event>,
    stats: BcastStats,
}

impl Channels {
    pub fn new(rank: usize, size: usize, keys: Keys, settings: Settings) -> Channels {
        Channels {
            rank,
            size,
            keys,
            k: settings.channels as u64,
            settings,
            bcasts: BTreeMap::new(),
            released_below: 0,
            next_start: 0,
            queued: VecDeque::new(),
            sync: None,
            early_reports: BTreeMap::new(),
            deferred: Vec::new(),
            failover_from: None,
            failed_syncs: 0,
            owner_gone: false,
            early_bytes: 0,
            transmits: VecDeque::new(),
            events: VecDeque::new(),
            stats: BcastStats::default(),
        }
    }

    fn is_tree_bcast(&self, bid: u64) -> bool {
        self.failover_from.is_some_and(|f| bid >= f)
    }

    /// Whether `bid` may use its channel now.
    fn channel_free(&self, bid: u64) -> bool {
        self.is_tree_bcast(bid) || bid < self.released_below + self.k
    }

    fn send(&mut self, to: usize, packet: &Packet) {
        let packet = packet.encode(self.keys, Algorithm::Channels);
        self.transmits.push_back(Transmit::Send { to, packet });
    }

    fn multicast(&mut self, f: Fragment) {
        let packet = Packet::Fragment(f).encode(self.keys, Algorithm::Channels);
        self.transmits.push_back(Transmit::Multicast(packet));
        self.stats.multicast_sent += 1;
    }

    /// Every fragment of `bid` down the tree to `child`.
    fn send_tree(&mut self, bid: u64, child: usize) {
        let frags: Vec<Fragment> = match self.bcasts.get(&bid).and_then(|b| b.asm.as_ref()) {
            Some(asm) => (0..asm.count)
                .filter_map(|s| asm.fragment(bid, s))
                .collect(),
            None => return,
        };
        for f in frags {
            self.send(child, &Packet::Tree(f));
            self.stats.ring_sent += 1;
        }
    }

    fn begin(&mut self, now: Instant, bid: u64, root: usize, data: Option<Bytes>) {
        let me = self.rank;
        let tree = self.is_tree_bcast(bid);
        let b = self.bcasts.entry(bid).or_default();
        b.started = true;
        b.root = Some(root);
        if let Some(asm) = &b.asm {
            self.early_bytes -= asm.held_bytes().min(self.early_bytes);
        }
        if root == me {
            let data = data.unwrap_or_default();
            let asm = Assembly::whole(bid, root as u32, &data, self.settings.fragment);
            let frags: Vec<Fragment> = (0..asm.count)
                .filter_map(|s| asm.fragment(bid, s))
                .collect();
            b.asm = Some(asm);
            if tree {
                b.forward_to = BinomialTree::of(self.size, me, root)
                    .children()
                    .map(|c| c.rank)
                    .collect();
            } else if self.size > 1 {
                for f in frags {
                    self.multicast(f);
                }
            }
        } else if tree {
            // The data comes from the tree parent; forward it to the children once whole.
            b.forward_to = BinomialTree::of(self.size, me, root)
                .children()
                .map(|c| c.rank)
                .collect();
        } else {
            b.nack_at = Some(now + self.settings.nack_timeout);
        }
        self.progress(bid);
    }

    /// Completes `bid` here when whole, and sends the tree forwards it owes.
    fn progress(&mut self, bid: u64) {
        let Some(b) = self.bcasts.get_mut(&bid) else {
            return;
        };
        let Some(asm) = &b.asm else { return };
        if !asm.is_complete() {
            return;
        }
        b.nack_at = None;
        if b.started && !b.completed {
            b.completed = true;
            self.events.push_back(Event::Complete {
                bid,
                data: asm.data(),
            });
        }
        let forwards = std::mem::take(&mut b.forward_to);
        for child in forwards {
            self.send_tree(bid, child);
        }
        self.check_sync();
    }

    fn accept(&mut self, f: Fragment, repaired: bool) {
        let bid = f.bid;
        if bid < self.released_below {
            self.stats.redundant += 1;
            return;
        }
        let len = f.data.len();
        let room = self.early_bytes + len <= self.settings.early_limit;
        let b = self.bcasts.entry(bid).or_default();
        if !b.started && !repaired && !room {
            self.stats.early_dropped += 1;
            if b.asm.is_none() && b.forward_to.is_empty() {
                self.bcasts.remove(&bid);
            }
            return;
        }
        let asm = b.asm.get_or_insert_with(|| Assembly::shaped_like(&f));
        if !asm.fits(&f) {
            self.stats.malformed += 1;
            return;
        }
        if asm.insert(f) {
            if !b.started {
                self.early_bytes += len;
            }
            if repaired {
                self.stats.ring_repaired += 1;
            } else {
                self.stats.multicast_received += 1;
            }
        } else {
            self.stats.redundant += 1;
        }
        self.progress(bid);
    }

    /// Starts the queued broadcasts whose channels are free, in order; begins a
    /// synchronisation when the next one waits for its channel.
    fn run_queue(&mut self, now: Instant) {
        while let Some(&(bid, _, _)) = self.queued.front() {
            if !self.channel_free(bid) {
                self.begin_sync(now, bid);
                return;
            }
            if let Some((bid, root, data)) = self.queued.pop_front() {
                self.begin(now, bid, root, data);
            }
        }
    }

    /// Synchronises the epoch of the oldest unreleased broadcast, covering up to `end`.
    fn begin_sync(&mut self, _now: Instant, end: u64) {
        if self.sync.is_some() || end <= self.released_below {
            return;
        }
        let epoch = self.released_below / self.k;
        let end = end.min(self.released_below + self.k);
        let children: Vec<usize> = BinomialTree::of(self.size, self.rank, 0)
            .children()
            .map(|c| c.rank)
            .collect();
        let mut missing: BTreeMap<u64, BTreeSet<u32>> = BTreeMap::new();
        let mut trouble = 0;
        for bid in self.released_below..end {
            let b = self.bcasts.get(&bid);
            let have = b
                .and_then(|b| b.asm.as_ref())
                .is_some_and(Assembly::is_complete);
            missing.entry(bid).or_default();
            if !have {
                missing.entry(bid).or_default().insert(self.rank as u32);
            }
            if !have || b.is_some_and(|b| b.troubled) {
                trouble += 1;
            }
        }
        self.sync = Some(Sync {
            epoch,
            end,
            children,
            reports: 0,
            missing,
            trouble,
            sent_up: false,
            expect: BTreeMap::new(),
            down: false,
        });
        for (trouble, report) in self.early_reports.remove(&epoch).unwrap_or_default() {
            self.add_report(trouble, report);
        }
        self.check_sync();
    }

    fn add_report(&mut self, trouble: u64, report: MissingList) {
        if let Some(s) = &mut self.sync {
            s.reports += 1;
            s.trouble += trouble;
            for (bid, ranks) in report {
                if bid < s.end && bid >= self.released_below {
                    s.missing.entry(bid).or_default().extend(ranks);
                }
            }
        }
    }

    /// Moves the synchronisation on: report up once the children have, decide at the manager,
    /// release once the repairs are done.
    fn check_sync(&mut self) {
        let Some(s) = &self.sync else { return };
        if !s.sent_up && s.reports == s.children.len() {
            let (epoch, trouble) = (s.epoch, s.trouble);
            let missing: MissingList = s
                .missing
                .iter()
                .filter(|(_, r)| !r.is_empty())
                .map(|(b, r)| (*b, r.iter().copied().collect()))
                .collect();
            if let Some(sy) = &mut self.sync {
                sy.sent_up = true;
            }
            match BinomialTree::of(self.size, self.rank, 0).parent() {
                Some(parent) => self.send(
                    parent,
                    &Packet::SyncUp {
                        epoch,
                        trouble,
                        missing,
                    },
                ),
                None => {
                    let bids = self.sync.as_ref().map_or(0, |s| s.missing.len());
                    let possible = (bids * self.size.saturating_sub(1)) as u64;
                    // Most of the epoch needed repair: multicast is failing.
                    self.failed_syncs = if possible > 0 && trouble * 2 > possible {
                        self.failed_syncs + 1
                    } else {
                        0
                    };
                    let failover = self.failover_from.is_some()
                        || self.failed_syncs >= self.settings.retries.max(1);
                    self.sync_down(Instant::now(), epoch, failover, missing);
                }
            }
            return;
        }
        if s.down && s.expect.is_empty() {
            let pending_forwards = (self.released_below..s.end).any(|bid| {
                self.bcasts
                    .get(&bid)
                    .is_some_and(|b| !b.forward_to.is_empty())
            });
            if !pending_forwards {
                self.release();
            }
        }
    }

    /// The combined result arrived (or was decided here): pass it on, set up the repairs.
    fn sync_down(&mut self, now: Instant, epoch: u64, failover: bool, missing: MissingList) {
        let me = self.rank;
        let Some(s) = &self.sync else { return };
        if s.epoch != epoch || s.down {
            self.stats.malformed += 1;
            return;
        }
        let end = s.end;
        for child in BinomialTree::of(self.size, me, 0).children() {
            self.send(
                child.rank,
                &Packet::SyncDown {
                    epoch,
                    failover,
                    missing: missing.clone(),
                },
            );
        }
        if failover && self.failover_from.is_none() {
            self.failover_from = Some(end.max(self.released_below + self.k));
            self.stats.failovers = 1;
        }
        let mut expect = BTreeMap::new();
        let mut repairs = Vec::new();
        for (bid, ranks) in &missing {
            if *bid < self.released_below || *bid >= end || ranks.is_empty() {
                continue;
            }
            let Some(root) = self.bcasts.get(bid).and_then(|b| b.root) else {
                continue;
            };
            self.stats.sync_repairs += 1;
            let tree = BinomialTree::of(self.size, me, root);
            let needs = |relative: &std::ops::Range<usize>| {
                relative
                    .clone()
                    .any(|r| ranks.contains(&(tree.absolute(r) as u32)))
            };
            if ranks.contains(&(me as u32)) {
                let count = self
                    .bcasts
                    .get(bid)
                    .and_then(|b| b.asm.as_ref())
                    .map_or(0, |a| a.count);
                // The count is unknown if nothing arrived: learn it from the first fragment.
                expect.insert(*bid, if count == 0 { u32::MAX } else { count });
            }
            let children: Vec<usize> = tree
                .children()
                .filter(|c| needs(&c.relative))
                .map(|c| c.rank)
                .collect();
            repairs.push((*bid, children));
        }
        if let Some(s) = &mut self.sync {
            s.down = true;
            s.expect = expect;
        }
        for (bid, children) in repairs {
            if let Some(b) = self.bcasts.get_mut(&bid) {
                b.forward_to.extend(children);
            }
            self.progress(bid);
        }
        // Repairs that came before this rank learned it needed them.
        for (from, packet) in std::mem::take(&mut self.deferred) {
            self.on_packet(now, from, packet);
        }
        self.check_sync();
    }

    /// The epoch's channels are free: forget its broadcasts and start what waited.
    fn release(&mut self) {
        let Some(s) = self.sync.take() else { return };
        self.stats.syncs += 1;
        self.bcasts.retain(|bid, _| *bid >= s.end);
        self.released_below = s.end;
        let deferred = std::mem::take(&mut self.deferred);
        let now = Instant::now();
        for (from, packet) in deferred {
            self.on_packet(now, from, packet);
        }
        self.run_queue(now);
        if self.owner_gone && self.queued.is_empty() {
            self.begin_sync(now, self.next_start);
        }
    }

    fn on_tree_fragment(&mut self, f: Fragment) {
        let bid = f.bid;
        if let Some(s) = &mut self.sync {
            if let Some(left) = s.expect.get_mut(&bid) {
                if *left == u32::MAX {
                    *left = f.count;
                }
                *left -= 1;
                if *left == 0 {
                    s.expect.remove(&bid);
                }
            }
        }
        self.accept(f, true);
        self.check_sync();
    }

    fn on_packet(&mut self, now: Instant, from: usize, packet: Packet) {
        match packet {
            Packet::Fragment(f) | Packet::Tree(f)
                if f.bid >= self.released_below + 2 * self.k && !self.is_tree_bcast(f.bid) =>
            {
                // Past the window (its sender is ahead of this rank): keep it for later.
                self.deferred.push((from, Packet::Fragment(f)));
            }
            Packet::Tree(f) if self.is_tree_bcast(f.bid) => self.accept(f, true),
            Packet::Tree(f) => {
                if self.sync.as_ref().is_some_and(|s| s.down) {
                    self.on_tree_fragment(f);
                } else {
                    self.deferred.push((from, Packet::Tree(f)));
                }
            }
            Packet::Fragment(f) => self.accept(f, true),
            Packet::Nack { bid, missing } => self.on_nack(from, bid, missing),
            Packet::SyncUp {
                epoch,
                trouble,
                missing,
            } => {
                let current = self.sync.as_ref().map(|s| s.epoch);
                if current == Some(epoch) {
                    self.add_report(trouble, missing);
                    self.check_sync();
                } else if epoch >= self.released_below / self.k {
                    self.early_reports
                        .entry(epoch)
                        .or_default()
                        .push((trouble, missing));
                } else {
                    self.stats.malformed += 1;
                }
            }
            Packet::SyncDown {
                epoch,
                failover,
                missing,
            } => self.sync_down(now, epoch, failover, missing),
            Packet::Ready { .. } => self.stats.malformed += 1,
        }
    }

    /// A receiver misses fragments of a broadcast rooted here: resend them.
    fn on_nack(&mut self, from: usize, bid: u64, missing: Vec<u32>) {
        self.stats.nacks_received += 1;
        let me = self.rank;
        let retries = self.settings.retries;
        let Some(b) = self.bcasts.get_mut(&bid) else {
            return; // Not started here yet (it will be multicast then) or already released.
        };
        if b.root != Some(me) {
            self.stats.malformed += 1;
            return;
        }
        let by_multicast = b.resends < retries;
        b.resends += 1;
        let frags: Vec<Fragment> = match &b.asm {
            Some(asm) if missing.is_empty() => (0..asm.count)
                .take(NACK_MAX)
                .filter_map(|s| asm.fragment(bid, s))
                .collect(),
            Some(asm) => missing
                .iter()
                .take(NACK_MAX)
                .filter_map(|s| asm.fragment(bid, *s))
                .collect(),
            None => return,
        };
        for f in frags {
            if by_multicast {
                self.multicast(f);
            } else {
                self.send(from, &Packet::Fragment(f));
                self.stats.ring_sent += 1;
            }
        }
    }
}

impl Protocol for Channels {
    fn start(&mut self, now: Instant, bid: u64, root: usize, data: Option<Bytes>) {
        debug_assert_eq!(bid, self.next_start);
        self.next_start = bid + 1;
        self.queued.push_back((bid, root, data));
        self.run_queue(now);
    }

    fn handle_datagram(&mut self, _now: Instant, datagram: &Bytes) {
        match Packet::decode(datagram, self.keys, Algorithm::Channels) {
            Ok(Packet::Fragment(f)) => {
                if f.bid >= self.released_below + 2 * self.k || self.is_tree_bcast(f.bid) {
                    self.stats.early_dropped += 1;
                } else {
                    self.accept(f, false);
                }
            }
            Ok(_) => self.stats.malformed += 1,
            Err(reason) => self.stats.count_reject(reason),
        }
    }

    fn handle_packet(&mut self, now: Instant, from: usize, packet: &Bytes) {
        match Packet::decode(packet, self.keys, Algorithm::Channels) {
            Ok(p) => self.on_packet(now, from, p),
            Err(reason) => self.stats.count_reject(reason),
        }
    }

    fn handle_timeout(&mut self, now: Instant) {
        let timeout = self.settings.nack_timeout;
        let mut nacks = Vec::new();
        for (bid, b) in &mut self.bcasts {
            let (Some(at), Some(root)) = (b.nack_at, b.root) else {
                continue;
            };
            if at > now {
                continue;
            }
            // Nothing arrived: an empty list asks for everything.
            let missing: Vec<u32> = match &b.asm {
                Some(asm) => asm.missing().take(NACK_MAX).collect(),
                None => Vec::new(),
            };
            b.troubled = true;
            b.backoff = (b.backoff.max(1) * 2).min(NACK_BACKOFF_MAX);
            b.nack_at = Some(now + timeout * b.backoff);
            nacks.push((root, *bid, missing));
        }
        for (root, bid, missing) in nacks {
            self.stats.nacks_sent += 1;
            self.send(root, &Packet::Nack { bid, missing });
        }
    }

    fn poll_timeout(&self) -> Option<Instant> {
        self.bcasts.values().filter_map(|b| b.nack_at).min()
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
        let synced = self.sync.is_none()
            && self.queued.is_empty()
            && (self.released_below >= self.next_start
                || self.failover_from.is_some_and(|f| self.released_below >= f));
        let tree_done = self
            .bcasts
            .iter()
            .filter(|(bid, _)| self.is_tree_bcast(**bid))
            .all(|(_, b)| !b.started || (b.completed && b.forward_to.is_empty()));
        synced && tree_done
    }

    fn expects_from(&self, rank: usize) -> bool {
        let me = self.rank;
        let tree_parent =
            |root: usize| BinomialTree::of(self.size, me, root).parent() == Some(rank);
        if let Some(s) = &self.sync {
            let waits_for_reports = !s.sent_up && s.children.contains(&rank);
            let waits_for_down = s.sent_up && !s.down && tree_parent(0);
            let waits_for_repairs = s.expect.keys().any(|bid| {
                self.bcasts
                    .get(bid)
                    .and_then(|b| b.root)
                    .is_some_and(&tree_parent)
            });
            if waits_for_reports || waits_for_down || waits_for_repairs {
                return true;
            }
        }
        // An unfinished broadcast needs its root for NACK answers until this rank has reported
        // it in a synchronisation (the root leaves only after one, whose repairs then come down
        // the tree); down the point-to-point tree it needs its tree parent.
        let reported = |bid: u64| self.sync.as_ref().is_some_and(|s| s.sent_up && bid < s.end);
        self.bcasts.iter().any(|(&bid, b)| {
            b.started
                && !b.completed
                && b.root.is_some_and(|root| {
                    if self.is_tree_bcast(bid) {
                        tree_parent(root)
                    } else {
                        root == rank && !reported(bid)
                    }
                })
        })
    }

    fn owner_gone(&mut self, now: Instant) {
        self.owner_gone = true;
        if self.queued.is_empty() {
            let end = match self.failover_from {
                Some(f) => f.min(self.next_start),
                None => self.next_start,
            };
            self.begin_sync(now, end);
        }
    }

    fn stats(&self) -> BcastStats {
        self.stats
    }
}
