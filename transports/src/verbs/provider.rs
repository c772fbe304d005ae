//! The narrow [`Provider`] trait: what the verbs transports need from an RDMA device.
//!
//! One provider value is one opened port of one device with one protection domain and one
//! completion queue shared by all its queue pairs (so completions of one provider come out in
//! the order the device produced them). It offers what `libibverbs` offers, in verbs terms but
//! with Rust types and without raw pointers:
//!
//! * queue pairs: reliable connected ([`QpKind::Rc`]) and unreliable datagram ([`QpKind::Ud`]),
//!   brought to ready-to-send with [`Provider::connect`];
//! * memory registration: [`Provider::register`] takes ownership of a buffer (owned and
//!   writable, or shared and read-only) and gives back a [`MemoryRegion`] whose keys work
//!   locally and remotely; [`Provider::deregister`] hands the memory back;
//! * work requests: [`Provider::post_recv`] and [`Provider::post_send`] (send, send with
//!   immediate data, RDMA write, RDMA write with immediate data, RDMA read; UD sends through an
//!   address handle);
//! * completions: [`Provider::poll_completions`] and [`Provider::poll_ready`] for wake-ups;
//! * address handles and multicast attachment for UD.
//!
//! Two implementations exist: the simulated fabric ([`super::sim`], always compiled, used by
//! the tests) and the device provider over `libibverbs` (`super::device`, feature `verbs`).

use std::task::{Context, Poll};

use bytes::Bytes;

use super::device_event::PortChange;
use super::error::VerbsError;

/// A queue pair number (24 bits in verbs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QpNum(pub u32);

/// The queue pair number that addresses every queue pair attached to a multicast group.
pub const MULTICAST_QPN: QpNum = QpNum(0x00FF_FFFF);

/// The two kinds of queue pair the transports use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpKind {
    /// Reliable connected: one peer, delivered exactly once and in order, RDMA allowed.
    Rc,
    /// Unreliable datagram: any peer (through an address handle), at most one MTU per message,
    /// may be lost; receivers see a 40-byte GRH area first in every receive buffer.
    Ud,
}

/// Sizes of a queue pair's queues and its RNR behaviour.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpCaps {
    /// Send work requests that may be outstanding.
    pub max_send_wr: u32,
    /// Receive work requests that may be outstanding.
    pub max_recv_wr: u32,
    /// RC: how often a send that found no posted receive (receiver not ready, RNR) is retried
    /// before it fails with [`CompletionStatus::RnrRetryExceeded`]; 7 means without end, as in
    /// verbs.
    pub rnr_retry: u8,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps {
            max_send_wr: 256,
            max_recv_wr: 256,
            rnr_retry: 7,
        }
    }
}

/// Where a port can be reached: its local identifier and global identifier.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PortAddress {
    /// The port's LID (16 bits; multicast LIDs start at `0xC000`).
    pub lid: u16,
    /// The port's GID (for routed and RoCE fabrics).
    pub gid: [u8; 16],
}

/// Where a queue pair can be reached: what peers exchange to connect (RC) or to address a
/// datagram (UD).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QpAddress {
    /// The port the queue pair lives on.
    pub port: PortAddress,
    /// The queue pair number.
    pub qpn: QpNum,
}

impl QpAddress {
    /// Bytes of its encoding: LID, GID, queue pair number (little-endian).
    pub const ENCODED_LEN: usize = 2 + 16 + 4;

    /// Appends its encoding (LID, GID, QPN; little-endian) to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.port.lid.to_le_bytes());
        out.extend_from_slice(&self.port.gid);
        out.extend_from_slice(&self.qpn.0.to_le_bytes());
    }

    /// Decodes an encoding at the start of `bytes` (`None` when it is too short).
    pub fn decode(bytes: &[u8]) -> Option<QpAddress> {
        let (lid, rest) = bytes.split_first_chunk::<2>()?;
        let (gid, rest) = rest.split_first_chunk::<16>()?;
        let (qpn, _) = rest.split_first_chunk::<4>()?;
        Some(QpAddress {
            port: PortAddress {
                lid: u16::from_le_bytes(*lid),
                gid: *gid,
            },
            qpn: QpNum(u32::from_le_bytes(*qpn)),
        })
    }
}

/// The memory a region is made of.
#[derive(Debug)]
pub enum Buffer {
    /// Owned memory, registered for local write and remote write (a receive target).
    Owned(Vec<u8>),
    /// Shared, immutable memory, registered for local and remote read (a send source).
    Shared(Bytes),
}

impl Buffer {
    /// Its length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Buffer::Owned(v) => v.len(),
            Buffer::Shared(b) => b.len(),
        }
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A provider's handle of a registered memory region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MrId(pub u64);

/// A registered memory region: its handle, its address as the device sees it, its length and
/// keys. Peers need `addr` and `rkey` to reach it by RDMA.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryRegion {
    /// The provider's handle.
    pub id: MrId,
    /// The address of its first byte in the device's address space.
    pub addr: u64,
    /// Its length in bytes.
    pub len: usize,
    /// The key for local work requests.
    pub lkey: u32,
    /// The key peers use for RDMA.
    pub rkey: u32,
    /// Whether peers may write it (owned memory) or only read it (shared memory).
    pub remote_write: bool,
}

/// A piece of registered memory a work request reads or writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sge {
    /// The region.
    pub mr: MrId,
    /// Offset within the region.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
}

/// A piece of a peer's registered memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteSlice {
    /// The peer's address (the region's `addr` plus an offset).
    pub addr: u64,
    /// The region's remote key.
    pub rkey: u32,
}

/// A provider's handle of an address handle (UD destination).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AhId(pub u64);

/// What a send work request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendOp {
    /// RC send: consumes one receive at the peer; `imm` arrives with its completion.
    Send {
        /// Immediate data.
        imm: Option<u32>,
    },
    /// UD send to `qpn` through address handle `ah` (at most one MTU).
    SendTo {
        /// The destination's address handle.
        ah: AhId,
        /// The destination queue pair ([`MULTICAST_QPN`] for a multicast group).
        qpn: QpNum,
        /// The queue key the destination expects.
        qkey: u32,
        /// Immediate data.
        imm: Option<u32>,
    },
    /// RC RDMA write into `remote`; with `imm`, it also consumes one receive at the peer, whose
    /// completion carries `imm` and is generated after the written bytes are in place.
    Write {
        /// Where to write.
        remote: RemoteSlice,
        /// Immediate data (write with immediate).
        imm: Option<u32>,
    },
    /// RC RDMA read from `remote` into the local scatter list.
    Read {
        /// Where to read from.
        remote: RemoteSlice,
    },
}

/// A send work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendRequest {
    /// Returned in the completion.
    pub wr_id: u64,
    /// The operation.
    pub op: SendOp,
    /// The local memory sent from (or read into); `None` for a zero-length message.
    pub local: Option<Sge>,
}

/// How a work request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompletionStatus {
    /// Done.
    Success,
    /// RC: the peer had no receive posted and the RNR retries ran out.
    RnrRetryExceeded,
    /// RC: the peer did not answer (port or link down) and the transport retries ran out.
    RetryExceeded,
    /// RC: the remote key, address, length or access rights were wrong.
    RemoteAccessError,
    /// The receive buffer was too small for the message.
    LocalLengthError,
    /// RC: the peer refused the request (its receive buffer was too small, or the request was
    /// not valid for it).
    RemoteInvalidRequest,
    /// The queue pair is in the error state: the request was flushed without being executed.
    Flushed,
}

/// What kind of work request completed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompletionKind {
    /// A send (RC or UD).
    Send,
    /// An RDMA write.
    Write,
    /// An RDMA read.
    Read,
    /// A receive consumed by a send.
    Recv,
    /// A receive consumed by an RDMA write with immediate data (no bytes in the receive buffer).
    RecvWriteImm,
}

/// A work completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The request's `wr_id`.
    pub wr_id: u64,
    /// The queue pair it belongs to.
    pub qpn: QpNum,
    /// How it ended.
    pub status: CompletionStatus,
    /// What it was (for a flushed request: what was posted).
    pub kind: CompletionKind,
    /// Receives: bytes placed (for UD, including the 40-byte GRH area).
    pub byte_len: usize,
    /// Immediate data, if the message carried any.
    pub imm: Option<u32>,
    /// UD receives: the sender's queue pair and port.
    pub source: Option<QpAddress>,
}

/// An opened RDMA port (see the [module docs](self)).
pub trait Provider: Send + 'static {
    /// Where this port can be reached.
    fn port(&self) -> PortAddress;

    /// The largest UD message (the path MTU), GRH not included.
    fn ud_mtu(&self) -> usize;

    /// Creates a queue pair of `kind` on the provider's completion queue.
    fn create_qp(&mut self, kind: QpKind, caps: QpCaps) -> Result<QpNum, VerbsError>;

    /// Brings queue pair `qp` to ready-to-send: for RC, connected to `remote`; for UD, `remote`
    /// is ignored (datagrams name their destination) and `qkey` is the key it accepts.
    fn connect(&mut self, qp: QpNum, remote: QpAddress, qkey: u32) -> Result<(), VerbsError>;

    /// Destroys queue pair `qp` (its outstanding requests are dropped without completions).
    fn destroy_qp(&mut self, qp: QpNum) -> Result<(), VerbsError>;

    /// Registers `buffer`: the provider keeps it until [`deregister`](Self::deregister).
    fn register(&mut self, buffer: Buffer) -> Result<MemoryRegion, VerbsError>;

    /// Ends a registration and gives the memory back. The caller makes sure no work request
    /// still uses it.
    fn deregister(&mut self, mr: MrId) -> Result<Buffer, VerbsError>;

    /// Copies `data` into registered owned memory at `offset` (to fill a send buffer). The
    /// caller makes sure no posted work request covers those bytes.
    fn write_local(&mut self, mr: MrId, offset: usize, data: &[u8]) -> Result<(), VerbsError>;

    /// Copies `len` bytes at `offset` of registered memory into a new buffer (to take a
    /// received message out of its receive buffer after its completion).
    fn read_local(&self, mr: MrId, offset: usize, len: usize) -> Result<Vec<u8>, VerbsError>;

    /// Posts a receive into `sge` on queue pair `qp`.
    fn post_recv(&mut self, qp: QpNum, wr_id: u64, sge: Sge) -> Result<(), VerbsError>;

    /// Posts a send work request on queue pair `qp` (always signalled).
    fn post_send(&mut self, qp: QpNum, request: SendRequest) -> Result<(), VerbsError>;

    /// Moves up to `max` completions into `out`, in completion-queue order; returns how many.
    fn poll_completions(
        &mut self,
        out: &mut Vec<Completion>,
        max: usize,
    ) -> Result<usize, VerbsError>;

    /// Registers the task to be woken when a completion may be waiting; `Ready` if one is.
    fn poll_ready(&self, cx: &mut Context<'_>) -> Poll<()>;

    /// Creates an address handle for UD sends to `dest` (a port or a multicast LID/GID).
    fn create_ah(&mut self, dest: PortAddress) -> Result<AhId, VerbsError>;

    /// Attaches UD queue pair `qp` to the multicast group `group` (its MGID and MLID).
    fn attach_multicast(&mut self, qp: QpNum, group: PortAddress) -> Result<(), VerbsError>;

    /// Detaches UD queue pair `qp` from the multicast group `group`.
    fn detach_multicast(&mut self, qp: QpNum, group: PortAddress) -> Result<(), VerbsError>;

    /// The next change of the port's state the device reported (its asynchronous events, see
    /// [`super::device_event`]); [`poll_ready`](Self::poll_ready) wakes the task when one may
    /// be waiting. The default reports none.
    fn poll_port_change(&mut self) -> Option<PortChange> {
        None
    }
}
