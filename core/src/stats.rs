//! Counters a rank keeps about its traffic, read with `Communicator::stats()`.

/// A snapshot of a rank's counters. Later layers (reliability, routes) add their own fields.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
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
}
