//! UD multicast: [`UdMulticast`], a [`MulticastFabric`] over InfiniBand multicast groups, the
//! second multicast route of the multicast broadcasts (after IP multicast, `crate::ipmcast`).
//!
//! A communicator's [`GroupId`] becomes a multicast LID (`0xC000` to `0xFFFE`) and a GID in
//! `ff12:401b::/32` (IPoIB's link-local scope prefix with rankweave's own signature in the
//! next 32 bits and the group id's 64 bits last) ([`group_address`]) and a queue key. Each
//! rank joins a group with a UD queue pair of its own on its first port, attached to the
//! group, with [`UdMulticastSettings::recv_buffers`] receive buffers of one MTU posted, and an
//! address handle for the group to send through. Datagrams are at most one MTU: the broadcast
//! engine fragments to [`MulticastFabric::max_datagram`].
//!
//! The trait promises a sender its own datagrams back; a UD queue pair does not receive what
//! it sent to its group, so [`UdMulticastGroup::send`] queues a copy locally. Sends never
//! block: without a free send buffer the datagram is dropped and counted, as a full network
//! would drop it, and the broadcast's repair stage resends it.
//!
//! On hardware the subnet manager must know the group: joining it through `rdma_join_multicast`
//! (rdma-cm) or a `ibv_*` SA query is not implemented yet; the device provider's
//! `attach_multicast` attaches to an MGID/MLID that must have been configured on the fabric.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

use bytes::Bytes;
use rankweave_core::multicast::MulticastCounters;
use rankweave_core::{GroupId, MulticastFabric, MulticastGroup, TransportError};

use super::error::VerbsError;
use super::provider::{
    AhId, Completion, CompletionStatus, MULTICAST_QPN, MemoryRegion, PortAddress, Provider, QpNum,
    SendOp, SendRequest, Sge,
};
use super::shared_port::{PortHandle, SharedPort};
use super::sim::{FIRST_MULTICAST_LID, GRH_LEN};
use super::ud_queue::{UdQueue, recv_slot};

/// Settings of [`UdMulticast`] groups.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UdMulticastSettings {
    /// Receive buffers posted per group (at least 1): datagrams that find none are lost.
    pub recv_buffers: u32,
    /// Send buffers per group (at least 1).
    pub send_buffers: u32,
}

impl Default for UdMulticastSettings {
    fn default() -> Self {
        UdMulticastSettings {
            recv_buffers: 512,
            send_buffers: 64,
        }
    }
}

/// The multicast LID and GID `group` maps to (see the [module docs](self)).
pub fn group_address(group: GroupId) -> PortAddress {
    let span = u64::from(0xFFFE - FIRST_MULTICAST_LID + 1);
    let lid = FIRST_MULTICAST_LID + (group.0 % span) as u16;
    let mut gid = [0u8; 16];
    gid[..4].copy_from_slice(&[0xff, 0x12, 0x40, 0x1b]);
    gid[4..8].copy_from_slice(b"rkwv");
    gid[8..].copy_from_slice(&group.0.to_be_bytes());
    PortAddress { lid, gid }
}

/// The queue key of `group`'s queue pairs (datagrams with another are dropped).
fn group_qkey(group: GroupId) -> u32 {
    // The high bit set marks a controlled queue key in verbs; stay clear of it.
    ((group.0 >> 32) as u32 ^ group.0 as u32) & 0x7FFF_FFFF
}

/// UD multicast for one rank on one port (see the [module docs](self)).
pub struct UdMulticast<P: Provider> {
    port: SharedPort<P>,
    settings: UdMulticastSettings,
}

impl<P: Provider> std::fmt::Debug for UdMulticast<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UdMulticast")
            .field("port", &self.port)
            .field("settings", &self.settings)
            .finish()
    }
}

impl<P: Provider> UdMulticast<P> {
    /// Groups on `port` with `settings`.
    pub fn new(port: SharedPort<P>, settings: UdMulticastSettings) -> UdMulticast<P> {
        UdMulticast { port, settings }
    }

    /// Joins `group`: its own queue pair, attached, with receives posted.
    pub fn join_group(&self, group: GroupId) -> Result<UdMulticastGroup<P>, VerbsError> {
        UdMulticastGroup::join(self.port.handle(), group, self.settings)
    }
}

impl<P: Provider> MulticastFabric for UdMulticast<P> {
    fn max_datagram(&self) -> usize {
        self.port.handle().ud_mtu()
    }

    fn join(&self, group: GroupId) -> Result<Arc<dyn MulticastGroup>, TransportError> {
        Ok(Arc::new(self.join_group(group)?))
    }
}

/// `wr_id` top bit: a send (else a receive); the rest is the buffer index.
const WR_SEND: u64 = 1 << 63;

struct State<P: Provider> {
    handle: PortHandle<P>,
    qp: QpNum,
    group: PortAddress,
    ah: AhId,
    qkey: u32,
    mtu: usize,
    slot_len: usize,
    recv_region: MemoryRegion,
    send_region: MemoryRegion,
    free_send: Vec<u32>,
    received: VecDeque<Bytes>,
    completions: Vec<Completion>,
    counters: MulticastCounters,
}

/// One rank's membership of one UD multicast group (see the [module docs](self)).
pub struct UdMulticastGroup<P: Provider> {
    mtu: usize,
    state: Mutex<State<P>>,
}

impl<P: Provider> std::fmt::Debug for UdMulticastGroup<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.lock();
        f.debug_struct("UdMulticastGroup")
            .field("group", &s.group)
            .field("qp", &s.qp)
            .finish_non_exhaustive()
    }
}

impl<P: Provider> UdMulticastGroup<P> {
    fn join(
        mut handle: PortHandle<P>,
        group: GroupId,
        settings: UdMulticastSettings,
    ) -> Result<UdMulticastGroup<P>, VerbsError> {
        if settings.recv_buffers == 0 || settings.send_buffers == 0 {
            return Err(VerbsError::InvalidSetting(format!(
                "{} receive and {} send buffers (at least 1 each)",
                settings.recv_buffers, settings.send_buffers
            )));
        }
        let address = group_address(group);
        let qkey = group_qkey(group);
        let q = UdQueue::open(
            &mut handle,
            qkey,
            settings.send_buffers,
            settings.recv_buffers,
        )?;
        let (qp, mtu) = (q.qp, q.mtu);
        let ah = handle.create_ah(address)?;
        // Attach last: every receive is posted before the first datagram can come.
        handle.attach_multicast(qp, address)?;
        Ok(UdMulticastGroup {
            mtu,
            state: Mutex::new(State {
                handle,
                qp,
                group: address,
                ah,
                qkey,
                mtu,
                slot_len: q.slot_len,
                recv_region: q.recv_region,
                send_region: q.send_region,
                free_send: (0..settings.send_buffers).rev().collect(),
                received: VecDeque::new(),
                completions: Vec::new(),
                counters: MulticastCounters::default(),
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State<P>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl<P: Provider> State<P> {
    /// Takes completions: frees send buffers, queues received datagrams, reposts receives.
    fn poll(&mut self) {
        loop {
            self.completions.clear();
            let n = match self.handle.poll_completions(&mut self.completions, 64) {
                Ok(n) => n,
                Err(e) => {
                    tracing::debug!(error = %e, "multicast completion poll failed");
                    return;
                }
            };
            for i in 0..self.completions.len() {
                let c = self.completions[i];
                if c.wr_id & WR_SEND != 0 {
                    self.free_send.push((c.wr_id & !WR_SEND) as u32);
                    continue;
                }
                let slot = recv_slot(&self.recv_region, self.slot_len, c.wr_id);
                if c.status == CompletionStatus::Success {
                    let len = c.byte_len.saturating_sub(GRH_LEN).min(self.mtu);
                    if let Ok(bytes) =
                        self.handle
                            .read_local(self.recv_region.id, slot.offset + GRH_LEN, len)
                    {
                        self.counters.datagrams_received += 1;
                        self.counters.bytes_received += len as u64;
                        self.received.push_back(Bytes::from(bytes));
                    }
                }
                if c.status != CompletionStatus::Flushed {
                    let _ = self.handle.post_recv(self.qp, c.wr_id, slot);
                }
            }
            if n == 0 {
                return;
            }
        }
    }
}

impl<P: Provider> MulticastGroup for UdMulticastGroup<P> {
    fn send(&self, datagram: &[u8]) -> Result<(), TransportError> {
        if datagram.len() > self.mtu {
            return Err(TransportError::Io {
                op: "UD multicast send",
                message: format!(
                    "datagram of {} bytes exceeds the MTU of {}",
                    datagram.len(),
                    self.mtu
                ),
            });
        }
        let mut guard = self.lock();
        let s = &mut *guard;
        if s.free_send.is_empty() {
            s.poll();
        }
        // The sender's own copy (a UD queue pair does not hear its own multicast).
        s.received.push_back(Bytes::copy_from_slice(datagram));
        let Some(slot) = s.free_send.pop() else {
            s.counters.send_dropped += 1;
            return Ok(());
        };
        let offset = slot as usize * s.mtu;
        let posted = s
            .handle
            .write_local(s.send_region.id, offset, datagram)
            .and_then(|()| {
                s.handle.post_send(
                    s.qp,
                    SendRequest {
                        wr_id: WR_SEND | u64::from(slot),
                        op: SendOp::SendTo {
                            ah: s.ah,
                            qpn: MULTICAST_QPN,
                            qkey: s.qkey,
                            imm: None,
                        },
                        local: Some(Sge {
                            mr: s.send_region.id,
                            offset,
                            len: datagram.len(),
                        }),
                    },
                )
            });
        match posted {
            Ok(()) => {
                s.counters.datagrams_sent += 1;
                s.counters.bytes_sent += datagram.len() as u64;
            }
            Err(e) => {
                // Lost, as the network would lose it; receivers repair.
                tracing::debug!(error = %e, "multicast send refused");
                s.free_send.push(slot);
                s.counters.send_dropped += 1;
            }
        }
        Ok(())
    }

    fn drain(&self, out: &mut Vec<Bytes>, max: usize) -> Result<usize, TransportError> {
        let mut s = self.lock();
        s.poll();
        let n = s.received.len().min(max);
        out.extend(s.received.drain(..n));
        Ok(n)
    }

    fn poll_readable(&self, cx: &mut Context<'_>) -> Poll<()> {
        let s = self.lock();
        if !s.received.is_empty() {
            return Poll::Ready(());
        }
        s.handle.poll_ready(cx)
    }

    fn max_datagram(&self) -> usize {
        self.mtu
    }

    fn stats(&self) -> MulticastCounters {
        self.lock().counters
    }
}

impl<P: Provider> Drop for UdMulticastGroup<P> {
    fn drop(&mut self) {
        let mut s = self.lock();
        let (qp, group) = (s.qp, s.group);
        let _ = s.handle.detach_multicast(qp, group);
        let _ = s.handle.destroy_qp(qp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::sim::SimFabric;

    #[test]
    fn every_member_gets_each_datagram_once_and_the_sender_its_own_copy() {
        let fabric = SimFabric::new(1024);
        let ports: Vec<_> = (0..3)
            .map(|_| SharedPort::new(fabric.open_port()))
            .collect();
        let fabrics: Vec<_> = ports
            .iter()
            .map(|p| UdMulticast::new(p.clone(), UdMulticastSettings::default()))
            .collect();
        let g = GroupId(0xDEAD_BEEF_0123_4567);
        let groups: Vec<_> = fabrics.iter().map(|f| f.join_group(g).unwrap()).collect();
        let other = fabrics[2].join_group(GroupId(7)).unwrap();
        assert_eq!(fabrics[0].max_datagram(), 1024);
        groups[0].send(b"one").unwrap();
        groups[1].send(&[9u8; 1024]).unwrap();
        assert!(matches!(
            groups[1].send(&[0u8; 1025]),
            Err(TransportError::Io { .. })
        ));
        for (i, grp) in groups.iter().enumerate() {
            let mut out = Vec::new();
            assert_eq!(grp.drain(&mut out, 10).unwrap(), 2, "rank {i}");
            assert!(out.contains(&Bytes::from_static(b"one")));
            assert!(out.contains(&Bytes::from(vec![9u8; 1024])));
        }
        let mut out = Vec::new();
        assert_eq!(
            other.drain(&mut out, 10).unwrap(),
            0,
            "another group hears nothing"
        );
        assert_eq!(groups[0].stats().datagrams_sent, 1);
        assert_ne!(group_address(g), group_address(GroupId(7)));
        assert!(group_address(g).lid >= FIRST_MULTICAST_LID && group_address(g).lid < 0xFFFF);
        // Leaving detaches: the others still hear each other, the leaver's port nothing.
        drop(groups.into_iter().next());
    }
}
