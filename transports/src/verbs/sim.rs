//! A simulated RDMA fabric: [`Provider`]s in pure Rust with the semantics of verbs, for tests.
//!
//! A [`SimFabric`] is a switch with ports; [`SimFabric::open_port`] gives one [`SimProvider`]
//! per port (one per rank, or several per rank for several HCAs). Everything happens
//! synchronously under one lock when a work request is posted, so runs are deterministic:
//!
//! * **RC** is reliable and in order. A send (or a write with immediate data) consumes the
//!   oldest receive posted at the peer; if there is none, the request waits (receiver not
//!   ready, RNR) and blocks the requests posted after it. It is retried when the peer posts a
//!   receive and on every poll of the sender's completion queue; each poll spends one of the
//!   queue pair's `rnr_retry` retries (7: without end), and when they run out the request
//!   completes with [`CompletionStatus::RnrRetryExceeded`] and the queue pair enters the error
//!   state: the requests behind it and its posted receives complete as
//!   [`CompletionStatus::Flushed`]. An RDMA write with immediate data places its bytes before
//!   its receive completion is generated; an RDMA read places the peer's bytes in the local
//!   buffer before its completion, and only shared (read-only) memory may be read remotely,
//!   only owned memory written; a bad remote key, address or access right gives
//!   [`CompletionStatus::RemoteAccessError`] and puts both queue pairs in the error state; a message longer than the receive buffer gives
//!   [`CompletionStatus::LocalLengthError`] at the receiver (whose queue pair then fails) and
//!   [`CompletionStatus::RemoteInvalidRequest`] at the sender.
//! * **UD** is unreliable: a datagram longer than the MTU is refused when posted; one that
//!   finds no receive posted, a destination with another queue key, or a port that is down is
//!   dropped silently (counted); receive buffers get a 40-byte GRH area before the payload.
//!   Datagrams to [`MULTICAST_QPN`] reach every queue pair attached to the group (not the
//!   sender).
//! * **Completions** of one port come out of its one completion queue in the order they were
//!   generated; a completion wakes the task registered with [`Provider::poll_ready`].
//! * **Faults**: [`SimFabric::drop_next_datagrams`] loses UD datagrams (and
//!   [`SimFabric::drop_datagrams_matching`] those with given bytes,
//!   [`SimFabric::set_datagram_loss`] a random share of all), [`SimFabric::hold_next_datagram`]
//!   delivers one after the next (reordering), and [`SimFabric::fail_port`] takes a port down:
//!   its RC queue pairs' outstanding requests fail ([`CompletionStatus::RetryExceeded`]), the
//!   queue pairs enter the error state, and RC requests towards it fail the same way when they
//!   are executed; its UD queue pairs stay usable but every datagram from or to the port is
//!   lost (as on InfiniBand, where UD has no connection to break). Both raise the port's
//!   asynchronous event ([`PortChange::Down`]). [`SimFabric::restore_port`] brings the port
//!   back ([`PortChange::Up`], as `IBV_EVENT_PORT_ACTIVE`): new queue pairs can be made and
//!   UD datagrams flow again; RC queue pairs in the error state stay there (a new connection
//!   is needed, as on hardware).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use rustc_hash::FxHashMap;

use super::device_event::PortChange;
use super::error::VerbsError;
#[cfg(test)]
use super::provider::RemoteSlice;
use super::provider::{
    AhId, Buffer, Completion, CompletionKind, CompletionStatus, MULTICAST_QPN, MemoryRegion, MrId,
    PortAddress, Provider, QpAddress, QpCaps, QpKind, QpNum, SendOp, SendRequest, Sge,
};

/// Bytes a UD receive buffer holds before the payload (the global routing header's place).
pub const GRH_LEN: usize = 40;

/// The first multicast LID.
pub const FIRST_MULTICAST_LID: u16 = 0xC000;

/// `rnr_retry` that never runs out.
const RNR_RETRY_FOREVER: u8 = 7;

/// Counters of a simulated fabric.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimCounters {
    /// UD datagrams delivered into a receive buffer.
    pub datagrams_delivered: u64,
    /// UD datagrams dropped because the destination had no receive posted.
    pub datagrams_dropped_no_receive: u64,
    /// UD datagrams dropped by [`SimFabric::drop_next_datagrams`] or a port that is down.
    pub datagrams_dropped_fault: u64,
    /// RC requests that found no receive posted at the peer (each attempt).
    pub rnr_naks: u64,
    /// Bytes moved by RDMA writes and reads.
    pub rdma_bytes: u64,
}

/// A simulated fabric (see the [module docs](self)). Cloning shares it.
#[derive(Clone, Debug)]
pub struct SimFabric {
    state: Arc<Mutex<Fabric>>,
}

impl Default for SimFabric {
    fn default() -> Self {
        SimFabric::new(4096)
    }
}

impl SimFabric {
    /// A fabric whose UD MTU is `ud_mtu` bytes.
    pub fn new(ud_mtu: usize) -> SimFabric {
        SimFabric {
            state: Arc::new(Mutex::new(Fabric {
                ud_mtu,
                ports: Vec::new(),
                qps: FxHashMap::default(),
                regions: FxHashMap::default(),
                groups: FxHashMap::default(),
                next_qpn: 0x100,
                next_key: 1,
                next_addr: 0x1_0000_0000,
                drop_datagrams: 0,
                drop_matching: Vec::new(),
                loss: None,
                hold_datagram: false,
                held: None,
                counters: SimCounters::default(),
            })),
        }
    }

    /// Adds a port (an HCA port with its own LID) and opens it.
    pub fn open_port(&self) -> SimProvider {
        let mut f = self.lock();
        let lid = u16::try_from(f.ports.len() + 1).unwrap_or(u16::MAX);
        let mut gid = [0u8; 16];
        gid[0] = 0xfe;
        gid[1] = 0x80;
        gid[14..].copy_from_slice(&lid.to_be_bytes());
        f.ports.push(Port {
            address: PortAddress { lid, gid },
            up: true,
            cq: VecDeque::new(),
            waker: None,
            ahs: Vec::new(),
            rdma_bytes: 0,
            changes: VecDeque::new(),
        });
        SimProvider {
            fabric: self.clone(),
            lid,
        }
    }

    /// Drops the next `n` UD datagrams sent anywhere on the fabric.
    pub fn drop_next_datagrams(&self, n: u32) {
        self.lock().drop_datagrams += n;
    }

    /// Drops the next `n` UD datagrams (unicast or multicast) whose bytes `matches` accepts;
    /// rules added later apply alongside earlier ones.
    pub fn drop_datagrams_matching(
        &self,
        n: u32,
        matches: impl Fn(&[u8]) -> bool + Send + 'static,
    ) {
        self.lock().drop_matching.push(DropRule {
            left: n,
            matches: Box::new(matches),
        });
    }

    /// Loses every UD datagram (unicast or multicast) with probability `per_mille` / 1000,
    /// drawn from a generator seeded with `seed` (deterministic for one sequence of sends);
    /// 0 turns random loss off.
    pub fn set_datagram_loss(&self, per_mille: u32, seed: u64) {
        self.lock().loss = (per_mille > 0).then_some((per_mille.min(1000), seed | 1));
    }

    /// Holds the next UD datagram back and delivers it after the one sent after it.
    pub fn hold_next_datagram(&self) {
        self.lock().hold_datagram = true;
    }

    /// Brings the port with LID `lid` back up after [`fail_port`](Self::fail_port) and
    /// raises its "port active" event ([`PortChange::Up`], the device's
    /// `IBV_EVENT_PORT_ACTIVE`); does nothing to a port that is up or unknown.
    pub fn restore_port(&self, lid: u16) {
        let mut f = self.lock();
        let Some(port) = f.port_mut(lid) else { return };
        if port.up {
            return;
        }
        port.up = true;
        port.changes.push_back(PortChange::Up);
        if let Some(w) = port.waker.take() {
            w.wake();
        }
    }

    /// Whether the port with LID `lid` is up (`false` for an unknown port).
    pub fn is_port_up(&self, lid: u16) -> bool {
        self.lock().port_up(lid)
    }

    /// Takes the port with LID `lid` down (see the [module docs](self)).
    pub fn fail_port(&self, lid: u16) {
        let mut f = self.lock();
        let Some(port) = f.port_mut(lid) else { return };
        if port.up {
            // The device's asynchronous event (`IBV_EVENT_PORT_ERR`).
            port.changes.push_back(PortChange::Down);
            if let Some(w) = port.waker.take() {
                w.wake();
            }
        }
        port.up = false;
        let qps: Vec<u32> = f
            .qps
            .iter()
            .filter(|(_, q)| q.lid == lid && q.kind == QpKind::Rc && q.state != QpState::Error)
            .map(|(&n, _)| n)
            .collect();
        for qpn in qps {
            f.fail_qp(qpn, CompletionStatus::RetryExceeded);
        }
    }

    /// Bytes moved by RDMA writes and reads that queue pairs of port `lid` started (0 for an
    /// unknown port).
    pub fn port_rdma_bytes(&self, lid: u16) -> u64 {
        self.lock().port(lid).map_or(0, |p| p.rdma_bytes)
    }

    /// Memory regions registered on port `lid` now (registered and not deregistered).
    pub fn registered_regions(&self, lid: u16) -> usize {
        self.lock()
            .regions
            .values()
            .filter(|r| r.lid == lid)
            .count()
    }

    /// What the fabric counted so far.
    pub fn counters(&self) -> SimCounters {
        self.lock().counters
    }

    fn lock(&self) -> MutexGuard<'_, Fabric> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One port of a [`SimFabric`], as a [`Provider`].
#[derive(Debug)]
pub struct SimProvider {
    fabric: SimFabric,
    lid: u16,
}

impl SimProvider {
    /// The fabric this port belongs to.
    pub fn fabric(&self) -> &SimFabric {
        &self.fabric
    }
}

#[derive(Debug)]
struct Port {
    address: PortAddress,
    up: bool,
    cq: VecDeque<Completion>,
    waker: Option<Waker>,
    ahs: Vec<PortAddress>,
    /// Bytes moved by RDMA writes and reads that queue pairs of this port started.
    rdma_bytes: u64,
    /// Port changes the "device" reported (its asynchronous events), not taken yet.
    changes: VecDeque<PortChange>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum QpState {
    /// Created, not yet connected: receives may be posted, sends not.
    Init,
    /// Ready to send.
    Ready,
    /// Failed: everything is flushed.
    Error,
}

#[derive(Debug)]
struct PendingSend {
    request: SendRequest,
    /// RNR retries left.
    rnr_left: u8,
}

#[derive(Debug)]
struct Qp {
    lid: u16,
    kind: QpKind,
    caps: QpCaps,
    state: QpState,
    remote: Option<QpAddress>,
    qkey: u32,
    recvs: VecDeque<(u64, Sge)>,
    sends: VecDeque<PendingSend>,
}

#[derive(Debug)]
struct Region {
    lid: u16,
    addr: u64,
    buffer: Buffer,
}

impl Region {
    fn bytes(&self) -> &[u8] {
        match &self.buffer {
            Buffer::Owned(v) => v,
            Buffer::Shared(b) => b,
        }
    }
}

#[derive(Debug)]
struct Datagram {
    from: QpAddress,
    to_lid: u16,
    qpn: QpNum,
    qkey: u32,
    imm: Option<u32>,
    bytes: Vec<u8>,
}

/// The outcome of trying to execute the request at the head of a send queue.
enum Attempt {
    Done(Completion),
    /// The peer had no receive posted.
    NotReady,
    /// The request failed: the queue pair fails with this status.
    Failed(CompletionStatus),
}

#[derive(Debug)]
struct Fabric {
    ud_mtu: usize,
    ports: Vec<Port>,
    qps: FxHashMap<u32, Qp>,
    regions: FxHashMap<u64, Region>,
    groups: FxHashMap<u16, Vec<u32>>,
    next_qpn: u32,
    next_key: u64,
    next_addr: u64,
    drop_datagrams: u32,
    drop_matching: Vec<DropRule>,
    /// Random loss: per mille, and the generator's state.
    loss: Option<(u32, u64)>,
    hold_datagram: bool,
    held: Option<Datagram>,
    counters: SimCounters,
}

/// Accepts the bytes of the datagrams a [`DropRule`] drops.
type DatagramFilter = Box<dyn Fn(&[u8]) -> bool + Send>;

/// Drops the next `left` datagrams whose bytes `matches` accepts.
struct DropRule {
    left: u32,
    matches: DatagramFilter,
}

impl std::fmt::Debug for DropRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DropRule")
            .field("left", &self.left)
            .finish_non_exhaustive()
    }
}

fn completion(wr_id: u64, qpn: u32, status: CompletionStatus, kind: CompletionKind) -> Completion {
    Completion {
        wr_id,
        qpn: QpNum(qpn),
        status,
        kind,
        byte_len: 0,
        imm: None,
        source: None,
    }
}

fn send_kind(op: &SendOp) -> CompletionKind {
    match op {
        SendOp::Send { .. } | SendOp::SendTo { .. } => CompletionKind::Send,
        SendOp::Write { .. } => CompletionKind::Write,
        SendOp::Read { .. } => CompletionKind::Read,
    }
}

impl Fabric {
    fn port_mut(&mut self, lid: u16) -> Option<&mut Port> {
        self.ports.get_mut(usize::from(lid).checked_sub(1)?)
    }

    fn port(&self, lid: u16) -> Option<&Port> {
        self.ports.get(usize::from(lid).checked_sub(1)?)
    }

    fn port_up(&self, lid: u16) -> bool {
        self.port(lid).is_some_and(|p| p.up)
    }

    fn push_completion(&mut self, lid: u16, c: Completion) {
        if let Some(port) = self.port_mut(lid) {
            port.cq.push_back(c);
            if let Some(w) = port.waker.take() {
                w.wake();
            }
        }
    }

    fn qp_of(&self, lid: u16, qpn: QpNum) -> Result<&Qp, VerbsError> {
        self.qps
            .get(&qpn.0)
            .filter(|q| q.lid == lid)
            .ok_or(VerbsError::UnknownQp(qpn.0))
    }

    /// Checks that `sge` lies inside a region of port `lid` (writable if `write`).
    fn check_sge(&self, lid: u16, sge: &Sge, write: bool) -> Result<(), VerbsError> {
        let region = self
            .regions
            .get(&sge.mr.0)
            .filter(|r| r.lid == lid)
            .ok_or(VerbsError::UnknownRegion(sge.mr.0))?;
        let end = sge.offset.checked_add(sge.len);
        if end.is_none_or(|e| e > region.bytes().len()) {
            return Err(VerbsError::BadAccess(format!(
                "{} bytes at offset {} of a {}-byte region",
                sge.len,
                sge.offset,
                region.bytes().len()
            )));
        }
        if write && !matches!(region.buffer, Buffer::Owned(_)) {
            return Err(VerbsError::BadAccess(
                "a read-only region as a write target".into(),
            ));
        }
        Ok(())
    }

    fn sge_bytes(&self, sge: Option<&Sge>) -> Vec<u8> {
        sge.and_then(|s| {
            let r = self.regions.get(&s.mr.0)?;
            r.bytes()
                .get(s.offset..s.offset + s.len)
                .map(<[u8]>::to_vec)
        })
        .unwrap_or_default()
    }

    fn write_sge(&mut self, sge: &Sge, data: &[u8]) {
        if let Some(Region {
            buffer: Buffer::Owned(v),
            ..
        }) = self.regions.get_mut(&sge.mr.0)
            && let Some(dst) = v.get_mut(sge.offset..sge.offset + data.len())
        {
            dst.copy_from_slice(data);
        }
    }

    /// The region `remote` points into, with the offset, if `len` bytes fit and `lid` owns it.
    fn remote_target(&self, lid: u16, addr: u64, rkey: u32, len: usize) -> Option<(u64, usize)> {
        let region = self.regions.get(&u64::from(rkey))?;
        let offset = usize::try_from(addr.checked_sub(region.addr)?).ok()?;
        (region.lid == lid && offset.checked_add(len)? <= region.bytes().len())
            .then_some((u64::from(rkey), offset))
    }

    /// Puts queue pair `qpn` into the error state: the head of its send queue completes with
    /// `status`, everything else it holds is flushed.
    fn fail_qp(&mut self, qpn: u32, status: CompletionStatus) {
        let Some(qp) = self.qps.get_mut(&qpn) else {
            return;
        };
        qp.state = QpState::Error;
        let lid = qp.lid;
        let sends: Vec<PendingSend> = qp.sends.drain(..).collect();
        let recvs: Vec<(u64, Sge)> = qp.recvs.drain(..).collect();
        for (i, s) in sends.iter().enumerate() {
            let st = if i == 0 {
                status
            } else {
                CompletionStatus::Flushed
            };
            self.push_completion(
                lid,
                completion(s.request.wr_id, qpn, st, send_kind(&s.request.op)),
            );
        }
        for (wr_id, _) in recvs {
            self.push_completion(
                lid,
                completion(wr_id, qpn, CompletionStatus::Flushed, CompletionKind::Recv),
            );
        }
    }

    /// Executes the send queue of `qpn` from its head until it is empty or blocked (RNR).
    /// `tick`: this is a retry timer expiry, which spends one RNR retry of a blocked head.
    fn progress(&mut self, qpn: u32, tick: bool) {
        let mut first = true;
        loop {
            let Some(qp) = self.qps.get(&qpn) else { return };
            if qp.state != QpState::Ready {
                return;
            }
            let Some(head) = qp.sends.front() else { return };
            let request = head.request;
            match self.attempt(qpn, &request) {
                Attempt::Done(c) => {
                    if let Some(qp) = self.qps.get_mut(&qpn) {
                        qp.sends.pop_front();
                    }
                    let lid = self.qps.get(&qpn).map_or(0, |q| q.lid);
                    self.push_completion(lid, c);
                }
                Attempt::Failed(status) => {
                    self.fail_qp(qpn, status);
                    return;
                }
                Attempt::NotReady => {
                    self.counters.rnr_naks += 1;
                    let Some(qp) = self.qps.get_mut(&qpn) else {
                        return;
                    };
                    let forever = qp.caps.rnr_retry >= RNR_RETRY_FOREVER;
                    if !tick || !first || forever {
                        return;
                    }
                    let exhausted = match qp.sends.front_mut() {
                        Some(head) if head.rnr_left > 0 => {
                            head.rnr_left -= 1;
                            false
                        }
                        Some(_) => true,
                        None => false,
                    };
                    if exhausted {
                        self.fail_qp(qpn, CompletionStatus::RnrRetryExceeded);
                    }
                    return;
                }
            }
            first = false;
        }
    }

    /// Tries to execute `request`, the head of `qpn`'s send queue.
    fn attempt(&mut self, qpn: u32, request: &SendRequest) -> Attempt {
        let Some(qp) = self.qps.get(&qpn) else {
            return Attempt::Failed(CompletionStatus::Flushed);
        };
        let lid = qp.lid;
        let kind = send_kind(&request.op);
        if !self.port_up(lid) {
            if matches!(request.op, SendOp::SendTo { .. }) {
                // UD: the datagram is lost on the dead link; the send itself completes.
                self.counters.datagrams_dropped_fault += 1;
                return Attempt::Done(completion(
                    request.wr_id,
                    qpn,
                    CompletionStatus::Success,
                    kind,
                ));
            }
            return Attempt::Failed(CompletionStatus::RetryExceeded);
        }
        if let SendOp::SendTo {
            ah,
            qpn: dest,
            qkey,
            imm,
        } = request.op
        {
            let Some(dest_port) = self
                .port(lid)
                .and_then(|p| p.ahs.get(usize::try_from(ah.0).ok()?))
                .copied()
            else {
                return Attempt::Failed(CompletionStatus::RemoteInvalidRequest);
            };
            let bytes = self.sge_bytes(request.local.as_ref());
            let from = QpAddress {
                port: self.port(lid).map_or(dest_port, |p| p.address),
                qpn: QpNum(qpn),
            };
            self.route_datagram(Datagram {
                from,
                to_lid: dest_port.lid,
                qpn: dest,
                qkey,
                imm,
                bytes,
            });
            return Attempt::Done(completion(
                request.wr_id,
                qpn,
                CompletionStatus::Success,
                kind,
            ));
        }
        let Some(remote) = qp.remote else {
            return Attempt::Failed(CompletionStatus::RemoteInvalidRequest);
        };
        let peer_ok = self.port_up(remote.port.lid)
            && self
                .qps
                .get(&remote.qpn.0)
                .is_some_and(|q| q.state == QpState::Ready && q.lid == remote.port.lid);
        if !peer_ok {
            return Attempt::Failed(CompletionStatus::RetryExceeded);
        }
        let len = request.local.map_or(0, |s| s.len);
        let consumes_receive = matches!(
            request.op,
            SendOp::Send { .. } | SendOp::Write { imm: Some(_), .. }
        );
        if consumes_receive
            && self
                .qps
                .get(&remote.qpn.0)
                .is_none_or(|q| q.recvs.is_empty())
        {
            return Attempt::NotReady;
        }
        match request.op {
            SendOp::Send { imm } => {
                let Some((wr_id, sge)) = self
                    .qps
                    .get_mut(&remote.qpn.0)
                    .and_then(|q| q.recvs.pop_front())
                else {
                    return Attempt::NotReady;
                };
                if len > sge.len {
                    self.push_completion(
                        remote.port.lid,
                        completion(
                            wr_id,
                            remote.qpn.0,
                            CompletionStatus::LocalLengthError,
                            CompletionKind::Recv,
                        ),
                    );
                    self.fail_qp(remote.qpn.0, CompletionStatus::Flushed);
                    return Attempt::Failed(CompletionStatus::RemoteInvalidRequest);
                }
                let bytes = self.sge_bytes(request.local.as_ref());
                self.write_sge(&sge, &bytes);
                let mut c = completion(
                    wr_id,
                    remote.qpn.0,
                    CompletionStatus::Success,
                    CompletionKind::Recv,
                );
                c.byte_len = len;
                c.imm = imm;
                self.push_completion(remote.port.lid, c);
            }
            SendOp::Write { remote: at, imm } => {
                let target = self
                    .remote_target(remote.port.lid, at.addr, at.rkey, len)
                    .filter(|(key, _)| {
                        self.regions
                            .get(key)
                            .is_some_and(|r| matches!(r.buffer, Buffer::Owned(_)))
                    });
                let Some((key, offset)) = target else {
                    return self.remote_access_error(remote.qpn.0);
                };
                let bytes = self.sge_bytes(request.local.as_ref());
                self.write_sge(
                    &Sge {
                        mr: MrId(key),
                        offset,
                        len,
                    },
                    &bytes,
                );
                self.counters.rdma_bytes += len as u64;
                if let Some(p) = self.port_mut(lid) {
                    p.rdma_bytes += len as u64;
                }
                if let Some(imm) = imm {
                    let Some((wr_id, _)) = self
                        .qps
                        .get_mut(&remote.qpn.0)
                        .and_then(|q| q.recvs.pop_front())
                    else {
                        return Attempt::NotReady;
                    };
                    let mut c = completion(
                        wr_id,
                        remote.qpn.0,
                        CompletionStatus::Success,
                        CompletionKind::RecvWriteImm,
                    );
                    c.byte_len = len;
                    c.imm = Some(imm);
                    self.push_completion(remote.port.lid, c);
                }
            }
            SendOp::Read { remote: at } => {
                // Only shared memory is registered for remote read (owned memory is
                // registered for local and remote write, as the device provider does).
                let target = self
                    .remote_target(remote.port.lid, at.addr, at.rkey, len)
                    .filter(|(key, _)| {
                        self.regions
                            .get(key)
                            .is_some_and(|r| matches!(r.buffer, Buffer::Shared(_)))
                    });
                let Some((key, offset)) = target else {
                    return self.remote_access_error(remote.qpn.0);
                };
                let bytes = self.sge_bytes(Some(&Sge {
                    mr: MrId(key),
                    offset,
                    len,
                }));
                if let Some(local) = request.local {
                    self.write_sge(&local, &bytes);
                }
                self.counters.rdma_bytes += len as u64;
                if let Some(p) = self.port_mut(lid) {
                    p.rdma_bytes += len as u64;
                }
            }
            SendOp::SendTo { .. } => {}
        }
        Attempt::Done(completion(
            request.wr_id,
            qpn,
            CompletionStatus::Success,
            kind,
        ))
    }

    /// An RDMA request broke the responder's memory protection (bad key, range or access
    /// right): as on InfiniBand, the responder's queue pair `responder` enters the error
    /// state too (its outstanding requests and receives are flushed), and the requester's
    /// request completes with [`CompletionStatus::RemoteAccessError`].
    fn remote_access_error(&mut self, responder: u32) -> Attempt {
        self.fail_qp(responder, CompletionStatus::Flushed);
        Attempt::Failed(CompletionStatus::RemoteAccessError)
    }

    /// Sends a UD datagram through the fault hooks to its destination(s).
    fn route_datagram(&mut self, d: Datagram) {
        if self.drop_datagrams > 0 {
            self.drop_datagrams -= 1;
            self.counters.datagrams_dropped_fault += 1;
            return;
        }
        if let Some(rule) = self
            .drop_matching
            .iter_mut()
            .find(|r| r.left > 0 && (r.matches)(&d.bytes))
        {
            rule.left -= 1;
            self.drop_matching.retain(|r| r.left > 0);
            self.counters.datagrams_dropped_fault += 1;
            return;
        }
        if let Some((per_mille, rng)) = &mut self.loss {
            *rng ^= *rng << 13;
            *rng ^= *rng >> 7;
            *rng ^= *rng << 17;
            if (*rng % 1000) < u64::from(*per_mille) {
                self.counters.datagrams_dropped_fault += 1;
                return;
            }
        }
        if self.hold_datagram && self.held.is_none() {
            self.hold_datagram = false;
            self.held = Some(d);
            return;
        }
        let held = self.held.take();
        self.deliver_datagram(d);
        if let Some(h) = held {
            self.deliver_datagram(h);
        }
    }

    fn deliver_datagram(&mut self, d: Datagram) {
        if d.qpn != MULTICAST_QPN && !self.port_up(d.to_lid) {
            self.counters.datagrams_dropped_fault += 1;
            return;
        }
        let targets: Vec<u32> = if d.qpn == MULTICAST_QPN {
            self.groups
                .get(&d.to_lid)
                .map(|g| g.iter().copied().filter(|&q| q != d.from.qpn.0).collect())
                .unwrap_or_default()
        } else {
            vec![d.qpn.0]
        };
        for qpn in targets {
            let Some(qp) = self.qps.get(&qpn) else {
                continue;
            };
            let accepts = qp.kind == QpKind::Ud
                && qp.state == QpState::Ready
                && qp.qkey == d.qkey
                && (d.qpn == MULTICAST_QPN || qp.lid == d.to_lid)
                && self.port_up(qp.lid);
            if !accepts {
                self.counters.datagrams_dropped_fault += 1;
                continue;
            }
            let Some(qp) = self.qps.get_mut(&qpn) else {
                continue;
            };
            let lid = qp.lid;
            let Some((wr_id, sge)) = qp.recvs.pop_front() else {
                self.counters.datagrams_dropped_no_receive += 1;
                continue;
            };
            if d.bytes.len() + GRH_LEN > sge.len {
                self.push_completion(
                    lid,
                    completion(
                        wr_id,
                        qpn,
                        CompletionStatus::LocalLengthError,
                        CompletionKind::Recv,
                    ),
                );
                continue;
            }
            self.write_sge(
                &Sge {
                    mr: sge.mr,
                    offset: sge.offset + GRH_LEN,
                    len: d.bytes.len(),
                },
                &d.bytes,
            );
            self.counters.datagrams_delivered += 1;
            let mut c = completion(wr_id, qpn, CompletionStatus::Success, CompletionKind::Recv);
            c.byte_len = d.bytes.len() + GRH_LEN;
            c.imm = d.imm;
            c.source = Some(d.from);
            self.push_completion(lid, c);
        }
    }
}

impl SimProvider {
    fn lock(&self) -> MutexGuard<'_, Fabric> {
        self.fabric.lock()
    }
}

impl Provider for SimProvider {
    fn port(&self) -> PortAddress {
        self.lock()
            .port(self.lid)
            .map_or(PortAddress::default_for(self.lid), |p| p.address)
    }

    fn ud_mtu(&self) -> usize {
        self.lock().ud_mtu
    }

    fn create_qp(&mut self, kind: QpKind, caps: QpCaps) -> Result<QpNum, VerbsError> {
        let mut f = self.lock();
        if !f.port_up(self.lid) {
            return Err(VerbsError::PortDown);
        }
        let qpn = f.next_qpn;
        f.next_qpn += 1;
        f.qps.insert(
            qpn,
            Qp {
                lid: self.lid,
                kind,
                caps,
                state: QpState::Init,
                remote: None,
                qkey: 0,
                recvs: VecDeque::new(),
                sends: VecDeque::new(),
            },
        );
        Ok(QpNum(qpn))
    }

    fn connect(&mut self, qp: QpNum, remote: QpAddress, qkey: u32) -> Result<(), VerbsError> {
        let mut f = self.lock();
        f.qp_of(self.lid, qp)?;
        let Some(q) = f.qps.get_mut(&qp.0) else {
            return Err(VerbsError::UnknownQp(qp.0));
        };
        if q.state != QpState::Init {
            return Err(VerbsError::QpState {
                qpn: qp.0,
                op: "connect",
            });
        }
        if q.kind == QpKind::Rc {
            q.remote = Some(remote);
        }
        q.qkey = qkey;
        q.state = QpState::Ready;
        Ok(())
    }

    fn destroy_qp(&mut self, qp: QpNum) -> Result<(), VerbsError> {
        let mut f = self.lock();
        f.qp_of(self.lid, qp)?;
        f.qps.remove(&qp.0);
        for members in f.groups.values_mut() {
            members.retain(|&q| q != qp.0);
        }
        Ok(())
    }

    fn register(&mut self, buffer: Buffer) -> Result<MemoryRegion, VerbsError> {
        let mut f = self.lock();
        let key = f.next_key;
        let rkey = u32::try_from(key)
            .map_err(|_| VerbsError::InvalidSetting("memory keys exhausted".into()))?;
        f.next_key += 1;
        let addr = f.next_addr;
        let len = buffer.len();
        // Regions get disjoint, page-aligned addresses, as if they were mapped memory.
        f.next_addr += (len as u64).div_ceil(4096).max(1) * 4096;
        let remote_write = matches!(buffer, Buffer::Owned(_));
        f.regions.insert(
            key,
            Region {
                lid: self.lid,
                addr,
                buffer,
            },
        );
        Ok(MemoryRegion {
            id: MrId(key),
            addr,
            len,
            lkey: rkey,
            rkey,
            remote_write,
        })
    }

    fn deregister(&mut self, mr: MrId) -> Result<Buffer, VerbsError> {
        let mut f = self.lock();
        match f.regions.get(&mr.0) {
            Some(r) if r.lid == self.lid => {}
            _ => return Err(VerbsError::UnknownRegion(mr.0)),
        }
        f.regions
            .remove(&mr.0)
            .map(|r| r.buffer)
            .ok_or(VerbsError::UnknownRegion(mr.0))
    }

    fn write_local(&mut self, mr: MrId, offset: usize, data: &[u8]) -> Result<(), VerbsError> {
        let mut f = self.lock();
        let sge = Sge {
            mr,
            offset,
            len: data.len(),
        };
        f.check_sge(self.lid, &sge, true)?;
        f.write_sge(&sge, data);
        Ok(())
    }

    fn read_local(&self, mr: MrId, offset: usize, len: usize) -> Result<Vec<u8>, VerbsError> {
        let f = self.lock();
        let sge = Sge { mr, offset, len };
        f.check_sge(self.lid, &sge, false)?;
        Ok(f.sge_bytes(Some(&sge)))
    }

    fn post_recv(&mut self, qp: QpNum, wr_id: u64, sge: Sge) -> Result<(), VerbsError> {
        let mut f = self.lock();
        f.check_sge(self.lid, &sge, true)?;
        let q = f.qp_of(self.lid, qp)?;
        if q.recvs.len() >= q.caps.max_recv_wr as usize {
            return Err(VerbsError::QueueFull {
                qpn: qp.0,
                queue: "receive",
            });
        }
        if q.state == QpState::Error {
            f.push_completion(
                self.lid,
                completion(wr_id, qp.0, CompletionStatus::Flushed, CompletionKind::Recv),
            );
            return Ok(());
        }
        let remote = q.remote;
        if let Some(q) = f.qps.get_mut(&qp.0) {
            q.recvs.push_back((wr_id, sge));
        }
        // A sender blocked on this queue pair (RNR) retries now (without spending a retry).
        if let Some(peer) = remote {
            f.progress(peer.qpn.0, false);
        }
        Ok(())
    }

    fn post_send(&mut self, qp: QpNum, request: SendRequest) -> Result<(), VerbsError> {
        let mut f = self.lock();
        if let Some(local) = &request.local {
            f.check_sge(self.lid, local, matches!(request.op, SendOp::Read { .. }))?;
        }
        let q = f.qp_of(self.lid, qp)?;
        match (q.kind, &request.op) {
            (QpKind::Ud, SendOp::SendTo { .. }) => {
                let len = request.local.map_or(0, |s| s.len);
                if len > f.ud_mtu {
                    return Err(VerbsError::InvalidRequest(format!(
                        "a {len}-byte UD message exceeds the {}-byte MTU",
                        f.ud_mtu
                    )));
                }
            }
            (QpKind::Rc, SendOp::Send { .. } | SendOp::Write { .. } | SendOp::Read { .. }) => {}
            (kind, op) => {
                return Err(VerbsError::InvalidRequest(format!(
                    "{op:?} on a {kind:?} queue pair"
                )));
            }
        }
        if q.sends.len() >= q.caps.max_send_wr as usize {
            return Err(VerbsError::QueueFull {
                qpn: qp.0,
                queue: "send",
            });
        }
        match q.state {
            QpState::Init => {
                return Err(VerbsError::QpState {
                    qpn: qp.0,
                    op: "send",
                });
            }
            QpState::Error => {
                f.push_completion(
                    self.lid,
                    completion(
                        request.wr_id,
                        qp.0,
                        CompletionStatus::Flushed,
                        send_kind(&request.op),
                    ),
                );
                return Ok(());
            }
            QpState::Ready => {}
        }
        let rnr_left = q.caps.rnr_retry;
        if let Some(q) = f.qps.get_mut(&qp.0) {
            q.sends.push_back(PendingSend { request, rnr_left });
        }
        f.progress(qp.0, false);
        Ok(())
    }

    fn poll_completions(
        &mut self,
        out: &mut Vec<Completion>,
        max: usize,
    ) -> Result<usize, VerbsError> {
        let mut f = self.lock();
        // Each poll is one expiry of the RNR timer of this port's blocked queue pairs.
        let blocked: Vec<u32> = f
            .qps
            .iter()
            .filter(|(_, q)| q.lid == self.lid && !q.sends.is_empty())
            .map(|(&n, _)| n)
            .collect();
        for qpn in blocked {
            f.progress(qpn, true);
        }
        let Some(port) = f.port_mut(self.lid) else {
            return Ok(0);
        };
        let n = port.cq.len().min(max);
        out.extend(port.cq.drain(..n));
        Ok(n)
    }

    fn poll_ready(&self, cx: &mut Context<'_>) -> Poll<()> {
        let mut f = self.lock();
        let Some(port) = f.port_mut(self.lid) else {
            return Poll::Ready(());
        };
        if port.cq.is_empty() && port.changes.is_empty() {
            port.waker = Some(cx.waker().clone());
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    }

    fn create_ah(&mut self, dest: PortAddress) -> Result<AhId, VerbsError> {
        let mut f = self.lock();
        let port = f
            .port_mut(self.lid)
            .ok_or(VerbsError::UnknownAddressHandle(0))?;
        port.ahs.push(dest);
        Ok(AhId(port.ahs.len() as u64 - 1))
    }

    fn attach_multicast(&mut self, qp: QpNum, group: PortAddress) -> Result<(), VerbsError> {
        if group.lid < FIRST_MULTICAST_LID {
            return Err(VerbsError::InvalidRequest(format!(
                "LID {:#x} is not a multicast LID",
                group.lid
            )));
        }
        let mut f = self.lock();
        if f.qp_of(self.lid, qp)?.kind != QpKind::Ud {
            return Err(VerbsError::InvalidRequest(
                "only UD queue pairs join multicast groups".into(),
            ));
        }
        let members = f.groups.entry(group.lid).or_default();
        if !members.contains(&qp.0) {
            members.push(qp.0);
        }
        Ok(())
    }

    fn detach_multicast(&mut self, qp: QpNum, group: PortAddress) -> Result<(), VerbsError> {
        let mut f = self.lock();
        f.qp_of(self.lid, qp)?;
        if let Some(members) = f.groups.get_mut(&group.lid) {
            members.retain(|&q| q != qp.0);
        }
        Ok(())
    }

    fn poll_port_change(&mut self) -> Option<PortChange> {
        self.lock().port_mut(self.lid)?.changes.pop_front()
    }
}

impl PortAddress {
    fn default_for(lid: u16) -> PortAddress {
        PortAddress { lid, gid: [0; 16] }
    }
}

#[cfg(test)]
#[path = "sim_tests.rs"]
mod tests;
