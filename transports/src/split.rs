//! Shared memory to the ranks on this host, the network to the others: what
//! `RANKWEAVE_TRANSPORT=auto` runs in a job that spans hosts.
//!
//! A [`SplitTransport`] holds a [`ShmTransport`] and a network transport. The first frame to a
//! peer looks the peer's segment address up (the same lookup the shared-memory transport makes):
//! equal host keys send it through shared memory, others over the network; the choice is kept
//! for the job's life, so the frames from one rank to another always take one path and stay in
//! order. Both transports deliver into the same drain, and the progress engine sleeps on both.
//!
//! A frame may be no larger than the network allows (the smaller of the two limits), so
//! large messages to local peers are split as for remote ones; a job whose ranks all share one
//! host runs over shared memory alone and has no such limit.

use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};

use rankweave_core::frame::{Envelope, Frame};
use rankweave_core::{
    Arrival, Capabilities, EagerTaken, EagerWant, Transport, TransportError, TransportStats,
};
use rustc_hash::FxHashMap;

use crate::shm::{SegmentDirectory, ShmTransport};

/// Which transport carries the traffic to one peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    SharedMemory,
    Network,
}

/// See the [module docs](self).
pub struct SplitTransport {
    local: ShmTransport,
    network: Arc<dyn Transport>,
    host: String,
    directory: Arc<dyn SegmentDirectory>,
    paths: RwLock<FxHashMap<u32, Path>>,
}

impl std::fmt::Debug for SplitTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SplitTransport")
            .field("rank", &self.local.rank())
            .finish()
    }
}

impl SplitTransport {
    /// Local peers through `local`, the others through `network`; `directory` tells which is
    /// which (by the host key in each rank's segment address).
    pub fn new(
        local: ShmTransport,
        network: Arc<dyn Transport>,
        directory: Arc<dyn SegmentDirectory>,
    ) -> SplitTransport {
        SplitTransport {
            host: local.address().host,
            local,
            network,
            directory,
            paths: RwLock::new(FxHashMap::default()),
        }
    }

    fn path(&self, to: u32) -> Result<Path, TransportError> {
        if to == self.local.rank() {
            return Ok(Path::SharedMemory);
        }
        if let Some(p) = self
            .paths
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&to)
        {
            return Ok(*p);
        }
        let addr = self.directory.lookup_segment(to)?;
        let path = if addr.host == self.host {
            Path::SharedMemory
        } else {
            Path::Network
        };
        self.paths
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(to, path);
        Ok(path)
    }
}

impl Transport for SplitTransport {
    fn capabilities(&self) -> Capabilities {
        let a = self.local.capabilities();
        let b = self.network.capabilities();
        Capabilities {
            reliable: a.reliable && b.reliable,
            ordered: a.ordered && b.ordered,
            max_payload: a.max_payload.min(b.max_payload),
            multicast: a.multicast && b.multicast,
            rdma: a.rdma && b.rdma,
            by_reference: a.by_reference && b.by_reference,
        }
    }

    fn can_read_peer_memory(&self, peer: u32) -> bool {
        self.path(peer) == Ok(Path::SharedMemory) && self.local.can_read_peer_memory(peer)
    }

    fn read_peer_memory(
        &self,
        peer: u32,
        addr: u64,
        dst: &mut [std::mem::MaybeUninit<u8>],
    ) -> Result<(), TransportError> {
        match self.path(peer)? {
            Path::SharedMemory => self.local.read_peer_memory(peer, addr, dst),
            Path::Network => self.network.read_peer_memory(peer, addr, dst),
        }
    }

    fn has_flags_with(&self, peer: u32) -> bool {
        self.path(peer) == Ok(Path::SharedMemory) && self.local.has_flags_with(peer)
    }

    fn raise_flag(&self, peer: u32, value: u64) -> Result<(), TransportError> {
        match self.path(peer)? {
            Path::SharedMemory => self.local.raise_flag(peer, value),
            Path::Network => self.network.raise_flag(peer, value),
        }
    }

    fn park_on_flags(&self, waker: &std::task::Waker) {
        self.local.park_on_flags(waker);
    }

    fn lease_arena(&self) -> Option<rankweave_core::ArenaLease> {
        self.local.lease_arena()
    }

    fn peer_arena(&self, peer: u32) -> Option<rankweave_core::PeerArena> {
        match self.path(peer) {
            Ok(Path::SharedMemory) => self.local.peer_arena(peer),
            _ => None,
        }
    }

    fn read_flag(&self, peer: u32) -> Result<rankweave_core::transport::PeerFlag, TransportError> {
        match self.path(peer)? {
            Path::SharedMemory => self.local.read_flag(peer),
            Path::Network => self.network.read_flag(peer),
        }
    }

    fn send(&self, to: u32, frame: Frame) -> Result<(), TransportError> {
        match self.path(to)? {
            Path::SharedMemory => self.local.send(to, frame),
            Path::Network => self.network.send(to, frame),
        }
    }

    fn drain(&self, out: &mut Vec<Arrival>) -> Result<usize, TransportError> {
        let a = self.local.drain(out)?;
        let b = self.network.drain(out)?;
        Ok(a + b)
    }

    fn send_eager(
        &self,
        to: u32,
        envelope: &Envelope,
        payload: &[&[u8]],
    ) -> Result<bool, TransportError> {
        match self.path(to)? {
            Path::SharedMemory => self.local.send_eager(to, envelope, payload),
            Path::Network => self.network.send_eager(to, envelope, payload),
        }
    }

    fn reads_in_place(&self, to: u32, len: usize) -> bool {
        match self.path(to) {
            Ok(Path::SharedMemory) => self.local.reads_in_place(to, len),
            Ok(Path::Network) => self.network.reads_in_place(to, len),
            Err(_) => false,
        }
    }

    fn take_eager(&self, want: &EagerWant, into: Option<&mut [u8]>) -> Option<EagerTaken> {
        // Only local peers write into this rank's rings; a remote one has nothing there.
        self.local.take_eager(want, into)
    }

    fn poll_arrival(&self, cx: &mut Context<'_>) -> Poll<()> {
        // Both register the waker; either may wake the engine.
        let a = self.local.poll_arrival(cx);
        let b = self.network.poll_arrival(cx);
        if a.is_ready() || b.is_ready() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    fn may_have_arrivals(&self) -> bool {
        self.local.may_have_arrivals() || self.network.may_have_arrivals()
    }

    fn traffic(&self) -> u64 {
        self.local.traffic().wrapping_add(self.network.traffic())
    }

    fn begin_busy_poll(&self) {
        self.local.begin_busy_poll();
        self.network.begin_busy_poll();
    }

    fn end_busy_poll(&self) {
        self.local.end_busy_poll();
        self.network.end_busy_poll();
    }

    fn waiter_parked(&self) {
        self.local.waiter_parked();
        self.network.waiter_parked();
    }

    fn close(&self) {
        self.local.close();
        self.network.close();
    }

    fn is_drained(&self) -> bool {
        // Both are asked every time: each does its own lingering work when asked.
        let a = self.local.is_drained();
        let b = self.network.is_drained();
        a && b
    }

    fn stats(&self) -> TransportStats {
        let mut s = self.network.stats();
        s.shm = self.local.stats().shm;
        s
    }
}
