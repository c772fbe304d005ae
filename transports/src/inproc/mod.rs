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
        mailbox
            .push(Arrival::Frame {
                from: self.rank,
                frame,
            })
            .map_err(|_| TransportError::PeerUnreachable(to as usize))
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
    (0..n)
        .map(|rank| {
            let transport = fabric
                .endpoint(rank)
                .ok_or(Error::InvalidRank { rank, size: n })?;
            Communicator::world(rank, n, Arc::new(transport), config.clone())
        })
        .collect()
}
