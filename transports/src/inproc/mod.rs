//! In-process hand-off between ranks that are tasks of one process.
//!
//! Every rank owns a [`Mailbox`]; sending a frame pushes it, as it is, into the destination's
//! mailbox. Payloads are [`bytes::Bytes`], so a message's data is never copied: the receiver gets
//! the sender's buffer. The transport is reliable and ordered and has no frame size limit, so the
//! message layer needs no reliability or fragmentation on top of it.

pub mod carrier;
mod mailbox;
pub mod reliable;

use std::sync::Arc;
use std::task::{Context, Poll};

use rankweave_core::frame::Frame;
use rankweave_core::{
    Arrival, Capabilities, Communicator, Config, Error, Transport, TransportError,
};

pub use carrier::{InprocCarrier, InprocCarrierFabric};
pub use mailbox::Mailbox;

/// The mailboxes of all ranks of one in-process job.
#[derive(Debug)]
pub struct InprocFabric {
    mailboxes: Vec<Mailbox<Arrival>>,
}

impl InprocFabric {
    /// A fabric for `n` ranks.
    pub fn new(n: usize) -> Arc<InprocFabric> {
        Arc::new(InprocFabric {
            mailboxes: (0..n).map(|_| Mailbox::new()).collect(),
        })
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.mailboxes.len()
    }

    /// The transport of rank `rank`.
    pub fn endpoint(self: &Arc<Self>, rank: usize) -> Option<InprocTransport> {
        (rank < self.mailboxes.len()).then(|| InprocTransport {
            rank: rank as u32,
            fabric: Arc::clone(self),
        })
    }
}

/// One rank's side of an [`InprocFabric`].
#[derive(Debug)]
pub struct InprocTransport {
    rank: u32,
    fabric: Arc<InprocFabric>,
}

impl InprocTransport {
    fn mailbox(&self) -> &Mailbox<Arrival> {
        &self.fabric.mailboxes[self.rank as usize]
    }
}

impl Transport for InprocTransport {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            reliable: true,
            ordered: true,
            max_payload: usize::MAX,
            multicast: false,
            rdma: false,
            by_reference: true,
        }
    }

    fn send(&self, to: u32, frame: Frame) -> Result<(), TransportError> {
        let mailbox = self
            .fabric
            .mailboxes
            .get(to as usize)
            .ok_or(TransportError::PeerUnreachable(to as usize))?;
        // A closed mailbox means `to` is going away: its `close` pushes `PeerLost` into our
        // mailbox right after closing its own, behind every frame it sent us. The frame is
        // dropped, as a network drops datagrams to a host that is gone, and the loss is learnt
        // from that notice, in order. Reporting an error here instead made the driver declare
        // the peer lost at once, while frames it had sent before exiting still waited in our
        // mailbox: receives that those frames would have matched failed with `PeerFailed`.
        let _ = mailbox.push(Arrival::Frame {
            from: self.rank,
            frame,
        });
        Ok(())
    }

    fn drain(&self, out: &mut Vec<Arrival>) -> Result<usize, TransportError> {
        Ok(self.mailbox().drain_into(out))
    }

    fn poll_arrival(&self, cx: &mut Context<'_>) -> Poll<()> {
        self.mailbox().poll_nonempty(cx)
    }

    fn may_have_arrivals(&self) -> bool {
        !self.mailbox().is_empty()
    }

    fn begin_busy_poll(&self) {
        self.mailbox().begin_busy_poll();
    }

    fn end_busy_poll(&self) {
        self.mailbox().end_busy_poll();
    }

    fn close(&self) {
        self.mailbox().close();
        // Everything this rank sent is already in its peers' mailboxes, ahead of this notice.
        for (rank, mailbox) in self.fabric.mailboxes.iter().enumerate() {
            if rank != self.rank as usize {
                let _ = mailbox.push(Arrival::PeerLost { rank: self.rank });
            }
        }
    }
}

/// The world communicators of an `n`-rank in-process job, rank order.
///
/// Must be called inside a tokio runtime (each rank gets a progress task).
pub fn world(n: usize, config: &Config) -> Result<Vec<Communicator>, Error> {
    if n == 0 {
        return Err(Error::InvalidArgument(
            "a job needs at least one rank".into(),
        ));
    }
    let fabric = InprocFabric::new(n);
    // Multicast broadcasts, when asked for, go over real IP multicast (loopback) here too.
    let job_key = rankweave_core::rng::random_u64();
    (0..n)
        .map(|rank| {
            let transport = fabric
                .endpoint(rank)
                .ok_or(Error::InvalidRank { rank, size: n })?;
            let multicast = crate::ipmcast::setup(config, rank as u32, job_key);
            Communicator::world_with_multicast(
                rank,
                n,
                Arc::new(transport),
                config.clone(),
                multicast,
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use rankweave_core::ContextId;
    use rankweave_core::frame::{Envelope, Header};

    use super::*;

    fn eager(seq: u64) -> Frame {
        Frame {
            header: Header::Eager(Envelope {
                context: ContextId(0),
                tag: 0,
                seq,
                len: 1,
            }),
            payload: Bytes::from(vec![seq as u8]),
        }
    }

    /// A send to a rank that has closed is dropped without an error; the closed rank's frames
    /// and then its `PeerLost` notice still arrive, in that order.
    #[test]
    fn a_send_to_a_closed_rank_is_dropped_and_its_loss_arrives_in_order() {
        let fabric = InprocFabric::new(2);
        let (a, b) = (fabric.endpoint(0).unwrap(), fabric.endpoint(1).unwrap());
        for seq in 0..3 {
            a.send(1, eager(seq)).unwrap();
        }
        a.close();
        assert_eq!(b.send(0, eager(0)), Ok(()), "dropped, not an error");
        assert_eq!(b.send(2, eager(0)), Err(TransportError::PeerUnreachable(2)));
        let mut got = Vec::new();
        assert_eq!(b.drain(&mut got).unwrap(), 4);
        let seqs: Vec<_> = got
            .iter()
            .filter_map(|arrival| match arrival {
                Arrival::Frame { from: 0, frame } => Some(frame.payload[0]),
                _ => None,
            })
            .collect();
        assert_eq!(seqs, [0, 1, 2]);
        assert!(matches!(got[3], Arrival::PeerLost { rank: 0 }));
        let mut own = Vec::new();
        assert_eq!(
            a.drain(&mut own).unwrap(),
            0,
            "nothing reached the closed rank"
        );
    }

    /// End to end: a rank that exits right after sending does not look lost to a peer that
    /// has not yet taken in what it sent, even when that peer sends to it meanwhile.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn frames_sent_before_exit_are_received_after_sending_to_the_exited_rank() {
        for _ in 0..20 {
            let mut comms = world(2, &Config::default()).unwrap();
            let receiver = comms.pop().unwrap();
            let sender = comms.pop().unwrap();
            for i in 0..10u8 {
                sender.send(1, 0, vec![i]).await.unwrap();
            }
            sender.shutdown().await;
            // May find the exited rank's mailbox closed before the loss is taken in; either
            // way it must not hide the messages that came before the loss.
            let _ = receiver.send(0, 1, vec![0xff]).await;
            for i in 0..10u8 {
                let m = receiver.recv(0, 0).await.unwrap();
                assert_eq!(m.data(), &[i][..]);
            }
            assert!(matches!(
                receiver.recv(0, 0).await,
                Err(Error::PeerFailed { rank: 0 })
            ));
        }
    }
}
