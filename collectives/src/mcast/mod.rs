//! The multicast broadcasts: Hoefler et al.'s two-stage broadcast (`two_stage.rs`) and LA-MPI's
//! channel broadcast (`channels.rs`), over a communicator's multicast group.
//!
//! Each algorithm is a sans-IO state machine implementing a `Protocol` trait: it is fed
//! broadcasts started here, multicast datagrams, point-to-point packets from other ranks and
//! timer ticks (with the time passed in), and it answers with transmits (a datagram to
//! multicast, a packet to send reliably to one rank) and events (a broadcast completed here).
//! The same machines run in the tokio engine (`engine.rs`) and in the discrete-event
//! [`sim`]ulation.
//!
//! Every rank of a communicator picks the multicast path alike, from the configuration and the
//! communicator's size alone: `RANKWEAVE_BCAST=multicast|channels` and at least
//! `RANKWEAVE_MCAST_MIN_RANKS` ranks. A rank whose group could not be joined still takes part
//! (it only never receives stage 1, and repairs everything).

pub(crate) mod assembly;
pub(crate) mod channels;
pub(crate) mod engine;
pub mod sim;
pub(crate) mod two_stage;
pub(crate) mod wire;

use std::time::{Duration, Instant};

use bytes::Bytes;
use rankweave_core::multicast::MulticastCounters;
use rankweave_core::tuning::BcastAlgorithm;
use rankweave_core::{Communicator, MulticastConfig};

use wire::{Keys, Reject};

/// The point-to-point tag of the multicast broadcasts' packets on the collective context
/// (reserved: collective sequence numbers never reach it).
pub(crate) const PACKET_TAG: u32 = u32::MAX;

/// Something a machine wants sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Transmit {
    /// A datagram for the communicator's multicast group (unreliable).
    Multicast(Bytes),
    /// A packet for rank `to` over the reliable point-to-point path.
    Send { to: usize, packet: Bytes },
}

/// Something that happened to a broadcast started here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Event {
    /// This rank has the whole broadcast `bid` (the root: it is buffered).
    Complete { bid: u64, data: Bytes },
}

/// A multicast broadcast algorithm as a sans-IO state machine (see the [module docs](self)).
pub(crate) trait Protocol: Send + std::fmt::Debug + 'static {
    /// This rank starts broadcast `bid` from `root`; the root passes the data.
    fn start(&mut self, now: Instant, bid: u64, root: usize, data: Option<Bytes>);
    /// A datagram arrived from the multicast group.
    fn handle_datagram(&mut self, now: Instant, datagram: &Bytes);
    /// A packet arrived from rank `from` over the point-to-point path.
    fn handle_packet(&mut self, now: Instant, from: usize, packet: &Bytes);
    /// The time [`poll_timeout`](Self::poll_timeout) asked for has come (calling it early is
    /// harmless).
    fn handle_timeout(&mut self, now: Instant);
    /// When the machine next wants [`handle_timeout`](Self::handle_timeout).
    fn poll_timeout(&self) -> Option<Instant>;
    fn poll_transmit(&mut self) -> Option<Transmit>;
    fn poll_event(&mut self) -> Option<Event>;
    /// Whether the driver should keep taking point-to-point packets (flow control: `false`
    /// while too much early data is held).
    fn wants_packets(&self) -> bool;
    /// Whether every broadcast started here is finished as far as other ranks are concerned
    /// (nothing left to forward, resend or acknowledge): the engine may stop once the
    /// communicator is gone.
    fn owes_nothing(&self) -> bool;
    /// Whether the machine may still need a point-to-point packet from `rank` (a ring or tree
    /// predecessor of an unfinished broadcast, a root owing NACK answers, a sync parent or
    /// child): if `rank` has left, that is a failure; a rank that leaves after sending all it
    /// owed is not (the others may still be busy with each other).
    fn expects_from(&self, rank: usize) -> bool;
    /// The communicator was dropped on this rank: no more broadcasts will start here.
    fn owner_gone(&mut self, now: Instant);
    fn stats(&self) -> BcastStats;
}

/// The settings the machines use (from [`MulticastConfig`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Settings {
    /// Payload bytes per fragment.
    pub fragment: usize,
    pub early_limit: usize,
    pub root_delay: Duration,
    pub sync: bool,
    pub channels: usize,
    pub nack_timeout: Duration,
    pub retries: u32,
}

impl Settings {
    /// The settings of `config`, with fragments that fit datagrams of `max_datagram` bytes.
    pub fn from_config(config: &MulticastConfig, max_datagram: usize) -> Settings {
        Settings {
            fragment: config
                .fragment()
                .min(max_datagram.saturating_sub(wire::HEADER_LEN))
                .max(1),
            early_limit: config.early_limit,
            root_delay: config.root_delay,
            sync: config.sync,
            channels: config.channels.max(1),
            nack_timeout: config.nack_timeout,
            retries: config.retries,
        }
    }
}

/// What the multicast broadcasts of one communicator did on this rank (see
/// [`multicast_stats`](crate::Collectives::multicast_stats)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BcastStats {
    /// Fragments this rank multicast (first sends and resends).
    pub multicast_sent: u64,
    /// Fragments this rank first got by multicast.
    pub multicast_received: u64,
    /// Fragments sent over the point-to-point repair paths (the two-stage ring, NACK answers,
    /// the channel broadcast's tree).
    pub ring_sent: u64,
    /// Fragments this rank first got over a repair path: what multicast failed to deliver.
    pub ring_repaired: u64,
    /// Copies of fragments this rank already had, ignored.
    pub redundant: u64,
    /// Multicast fragments dropped because too much early data was held.
    pub early_dropped: u64,
    /// Packets with a bad CRC.
    pub crc_failures: u64,
    /// Packets of another job, communicator or algorithm.
    pub foreign: u64,
    /// Packets that are not rankweave broadcast packets.
    pub unknown: u64,
    /// Packets with inconsistent numbers or that break the protocol.
    pub malformed: u64,
    /// NACKs this rank sent (channel broadcast).
    pub nacks_sent: u64,
    /// NACKs this rank answered as a root.
    pub nacks_received: u64,
    /// Channel synchronisations this rank took part in.
    pub syncs: u64,
    /// Broadcasts a synchronisation found missing somewhere and repaired along the
    /// point-to-point tree.
    pub sync_repairs: u64,
    /// Whether the channel broadcast failed over to point-to-point (1) or not (0).
    pub failovers: u64,
    /// The multicast group's own counters (datagrams, bytes, injected faults).
    pub group: MulticastCounters,
}

impl BcastStats {
    /// Adds `other`'s protocol counters (not the group's) to these.
    pub fn add(&mut self, other: &BcastStats) {
        self.multicast_sent += other.multicast_sent;
        self.multicast_received += other.multicast_received;
        self.ring_sent += other.ring_sent;
        self.ring_repaired += other.ring_repaired;
        self.redundant += other.redundant;
        self.early_dropped += other.early_dropped;
        self.crc_failures += other.crc_failures;
        self.foreign += other.foreign;
        self.unknown += other.unknown;
        self.malformed += other.malformed;
        self.nacks_sent += other.nacks_sent;
        self.nacks_received += other.nacks_received;
        self.syncs += other.syncs;
        self.sync_repairs += other.sync_repairs;
        self.failovers += other.failovers;
    }

    fn count_reject(&mut self, reason: Reject) {
        match reason {
            Reject::Unknown => self.unknown += 1,
            Reject::Foreign => self.foreign += 1,
            Reject::Corrupt => self.crc_failures += 1,
            Reject::Malformed => self.malformed += 1,
        }
    }
}

/// The rank picked for the randomized single-rank synchronisation of broadcast `bid` from
/// `root`: a non-root rank every rank computes alike (from the job key, communicator and `bid`).
pub(crate) fn chosen_rank(keys: Keys, bid: u64, root: usize, size: usize) -> usize {
    if size < 2 {
        return root;
    }
    let mut z =
        keys.job_key ^ keys.context.rotate_left(17) ^ bid.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (root + 1 + (z % (size as u64 - 1)) as usize) % size
}

/// The multicast algorithm `comm`'s broadcasts use, if any (the same on every rank).
pub(crate) fn selected(comm: &Communicator) -> Option<wire::Algorithm> {
    let config = comm.config();
    if comm.size() < config.multicast.min_ranks.max(2) {
        return None;
    }
    match config.collectives.bcast {
        Some(BcastAlgorithm::Multicast) => Some(wire::Algorithm::TwoStage),
        Some(BcastAlgorithm::Channels) => Some(wire::Algorithm::Channels),
        _ => None,
    }
}

#[cfg(test)]
mod tests;
