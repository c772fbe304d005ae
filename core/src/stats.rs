//! Counters a rank keeps about its traffic, read with `Communicator::stats()`.

/// A snapshot of a rank's counters: the message layer's, then the transport's in
/// [`transport`](Self::transport).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Frames handed to the transport.
    pub frames_sent: u64,
    /// Frames received from the transport.
    pub frames_received: u64,
    /// Payload bytes handed to the transport.
    pub bytes_sent: u64,
    /// Payload bytes received from the transport.
    pub bytes_received: u64,
    /// Messages sent with the eager protocol.
    pub eager_messages_sent: u64,
    /// Messages sent with the rendezvous protocol.
    pub rendezvous_messages_sent: u64,
    /// Frames dropped because they broke the protocol (unknown ids, bad lengths, …).
    pub protocol_errors: u64,
    /// Messages now waiting in the unexpected queue.
    pub unexpected_messages: u64,
    /// Bytes of eager data now waiting in the unexpected queue.
    pub unexpected_bytes: u64,
    /// Receives now waiting in the posted-receive queue.
    pub posted_receives: u64,
    /// Sends now waiting for their transport hand-off or their peer (rendezvous).
    pub pending_sends: u64,
    /// What the transport counted (reliability, routes, dropped datagrams).
    pub transport: TransportStats,
}

/// Counters of a rank's transport. Transports without a reliability layer or routes leave
/// most of them at zero.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TransportStats {
    /// Whether the end-to-end reliability layer is running.
    pub reliability: bool,
    /// Per route (adapter), in route order.
    pub routes: Vec<RouteCounters>,
    /// Packets sent again (after a NACK, a loss detected from later ACKs, or a timeout).
    pub retransmissions: u64,
    /// Retransmission timer expiries.
    pub timeouts: u64,
    /// Received packets whose CRC32C did not match (dropped and NACKed).
    pub crc_failures: u64,
    /// Received packets dropped because they had already been received.
    pub duplicates_dropped: u64,
    /// Received datagrams dropped as foreign: another job's key, an unknown sender, or
    /// addressed to another rank.
    pub foreign_dropped: u64,
    /// Received datagrams dropped as malformed: too short, bad magic or version, impossible
    /// lengths, or a payload that is not a frame.
    pub malformed_dropped: u64,
    /// ACK packets sent (acknowledgements carried on DATA packets are not counted).
    pub acks_sent: u64,
    /// NACKs sent.
    pub nacks_sent: u64,
    /// Times a route was declared down for a peer and its traffic moved to the others.
    pub route_failovers: u64,
    /// Times a route that was down answered a probe and carried traffic again.
    pub route_recoveries: u64,
    /// Peers declared dead because they stopped answering.
    pub peers_lost: u64,
    /// Datagrams the carrier refused to send (full socket buffer, …); repaired like losses.
    pub send_errors: u64,
    /// What the shared-memory transport counted (zero without it).
    pub shm: ShmCounters,
}

/// Counters of the shared-memory transport.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShmCounters {
    /// Frames sent to local peers (all three ways).
    pub frames_sent: u64,
    /// Payload bytes sent to local peers.
    pub bytes_sent: u64,
    /// Frames received from local peers.
    pub frames_received: u64,
    /// Payload bytes received from local peers.
    pub bytes_received: u64,
    /// Frames whose payload the receiver read straight from the sender's memory
    /// (`process_vm_readv`).
    pub single_copy_sent: u64,
    /// Frames too large for one record sent in pieces through the ring (no single copy).
    pub pipelined_sent: u64,
    /// Single-copy payloads this rank read straight into a receive's own buffer (a large
    /// message received with `recv_into`), rather than into a buffer of the transport's and
    /// then copied there.
    pub read_into_receive: u64,
    /// Payload bytes of this rank's single-copy sends that it wrote into the receiver's
    /// buffer itself (`process_vm_writev`) while the receiver read the rest: the split copy.
    pub split_bytes_written: u64,
    /// Medium single-copy payloads this rank lent whole to their sender to write into its
    /// buffer while it read the next one itself (the sender may have left some to it).
    pub payloads_lent: u64,
    /// Times a record found its ring full and had to wait.
    pub ring_full: u64,
    /// Wake-up signals sent to parked peers.
    pub signals_sent: u64,
    /// Times this rank, asleep on its armed doorbell, found work when it looked anyway (after
    /// 20 ms) with no signal: a wake-up that should have come did not. Zero unless a wake-up
    /// was lost, or (rarely) a peer published in the microseconds between the two looks.
    pub wakeups_missed: u64,
    /// Records or frames from local peers dropped as malformed.
    pub malformed_dropped: u64,
    /// Local peers that exited, closed or broke their ring.
    pub peers_lost: u64,
    /// What the rank is doing now, for a first look at a job that seems stuck.
    pub now: ShmNow,
}

/// The shared-memory transport's state at the moment of a [`Stats`] snapshot (gauges, not
/// counters): enough to tell which side of a wake-up a quiet rank is waiting on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShmNow {
    /// This rank's doorbell is armed: producers signal it.
    pub doorbell_armed: bool,
    /// The progress task sleeps trusting the doorbell (no recheck timer).
    pub progress_asleep: bool,
    /// The progress task sleeps with a recheck timer (futures were spinning).
    pub progress_rechecking: bool,
    /// A wake-up signal waits unread on this rank's signal socket.
    pub signal_pending: bool,
    /// Rings into this rank holding records it has not released.
    pub unread_rings: u64,
    /// Peers with records queued here for want of ring space.
    pub queued_peers: u64,
    /// Peers whose doorbell is armed.
    pub peers_armed: u64,
    /// Records queued here for want of ring space, over all peers.
    pub queued_records: u64,
    /// Peers whose ring was last found full (this rank asked to be signalled).
    pub blocked_peers: u64,
    /// Whether the progress engine has work now (it should not be asleep if so).
    pub has_work: bool,
}

/// Counters of one route.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RouteCounters {
    /// Datagrams sent on this route.
    pub frames_sent: u64,
    /// Bytes sent on this route (whole datagrams).
    pub bytes_sent: u64,
    /// Datagrams received on this route.
    pub frames_received: u64,
    /// Bytes received on this route (whole datagrams).
    pub bytes_received: u64,
    /// Packets retransmitted on this route.
    pub retransmissions: u64,
    /// Times this route was declared down for some peer.
    pub failovers: u64,
    /// Times this route came back for some peer.
    pub recoveries: u64,
    /// Peers for which this route is currently down.
    pub down_for_peers: u64,
}
