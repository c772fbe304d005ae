//! [`UdQueue`]: a UD queue pair made ready to carry datagrams — connected with its queue key,
//! one receive slot of MTU plus GRH bytes posted per receive buffer, and a registered region
//! of MTU-sized send buffers. The UD carrier (one per route) and the UD multicast groups (one
//! per communicator) both start from one.

use super::error::VerbsError;
use super::provider::{Buffer, MemoryRegion, Provider, QpAddress, QpCaps, QpKind, QpNum, Sge};
use super::sim::GRH_LEN;

/// A UD queue pair with its receive slots posted and its send buffers registered.
#[derive(Debug)]
pub(crate) struct UdQueue {
    pub qp: QpNum,
    /// Its own address.
    pub address: QpAddress,
    /// The port's UD MTU: the largest datagram.
    pub mtu: usize,
    /// Bytes of one receive slot (MTU plus the GRH the adapter writes in front).
    pub slot_len: usize,
    /// `recv_buffers` slots of `slot_len` bytes, all posted (work request id = slot index).
    pub recv_region: MemoryRegion,
    /// `send_buffers` buffers of `mtu` bytes.
    pub send_region: MemoryRegion,
}

impl UdQueue {
    /// Creates and connects a UD queue pair on `provider` with queue key `qkey`, posts
    /// `recv_buffers` receives and registers `send_buffers` send buffers.
    pub fn open<P: Provider>(
        provider: &mut P,
        qkey: u32,
        send_buffers: u32,
        recv_buffers: u32,
    ) -> Result<UdQueue, VerbsError> {
        let mtu = provider.ud_mtu();
        let qp = provider.create_qp(
            QpKind::Ud,
            QpCaps {
                max_send_wr: send_buffers,
                max_recv_wr: recv_buffers,
                rnr_retry: 0,
            },
        )?;
        let address = QpAddress {
            port: provider.port(),
            qpn: qp,
        };
        provider.connect(qp, address, qkey)?;
        let slot_len = mtu + GRH_LEN;
        let recv_region =
            provider.register(Buffer::Owned(vec![0; slot_len * recv_buffers as usize]))?;
        for slot in 0..recv_buffers {
            let slot = u64::from(slot);
            provider.post_recv(qp, slot, recv_slot(&recv_region, slot_len, slot))?;
        }
        let send_region = provider.register(Buffer::Owned(vec![0; mtu * send_buffers as usize]))?;
        Ok(UdQueue {
            qp,
            address,
            mtu,
            slot_len,
            recv_region,
            send_region,
        })
    }
}

/// Receive slot `slot` (its work request id) of `region`, a run of `slot_len`-byte slots.
pub(crate) fn recv_slot(region: &MemoryRegion, slot_len: usize, slot: u64) -> Sge {
    Sge {
        mr: region.id,
        offset: slot as usize * slot_len,
        len: slot_len,
    }
}
