//! The futures returned by point-to-point operations. Each one only waits: the operation was
//! registered with the rank's engine when the call that made the future returned.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use super::Communicator;
use crate::error::Error;
use crate::matching::Selector;
use crate::protocol::{Matched, RecvId, RecvStart, SendId};
use crate::runtime::{Wait, Waiting};
use crate::types::{Message, Status};

/// A send in progress; resolves when the payload has been handed off.
///
/// Dropping it does not cancel the send: the message is still delivered.
#[must_use = "the send runs anyway; await the future to learn when it is done or failed"]
#[derive(Debug)]
pub struct SendOp {
    state: SendState,
}

#[derive(Debug)]
enum SendState {
    /// Handed off at once (an eager send): resolves to `Ok(())`. A variant of its own, so the
    /// streaming path builds and polls a bare tag instead of moving an `Option<Result<(), Error>>`
    /// around.
    Complete,
    /// Failed when it was started; the first poll takes the error (later polls give `Ok(())`).
    Failed(Option<Error>),
    Pending {
        comm: Communicator,
        id: SendId,
        wait: Wait,
        finished: bool,
    },
}

impl SendOp {
    pub(crate) fn done(result: Result<(), Error>) -> SendOp {
        let state = match result {
            Ok(()) => SendState::Complete,
            Err(e) => SendState::Failed(Some(e)),
        };
        SendOp { state }
    }

    pub(crate) fn pending(comm: Communicator, id: SendId) -> SendOp {
        SendOp {
            state: SendState::Pending {
                comm,
                id,
                wait: Wait::default(),
                finished: false,
            },
        }
    }
}

impl SendOp {
    /// Whether the send was handed off when it was started (an eager send): awaiting it gives
    /// `Ok(())` at once, so it need not be kept. A send still waiting (a rendezvous) or that
    /// failed is not complete: its outcome is only learnt by awaiting it.
    pub fn is_complete(&self) -> bool {
        matches!(self.state, SendState::Complete)
    }

    /// This send never busy-polls while it waits, whatever the progress policy: for background
    /// services (the multicast broadcast engine) that must not take CPU from the rank's own
    /// tasks. It is woken by the progress engine instead.
    pub fn without_spinning(mut self) -> SendOp {
        if let SendState::Pending { wait, .. } = &mut self.state {
            wait.park_only();
        }
        self
    }
}

impl Future for SendOp {
    type Output = Result<(), Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.get_mut().state {
            SendState::Complete => Poll::Ready(Ok(())),
            SendState::Failed(e) => Poll::Ready(e.take().map_or(Ok(()), Err)),
            SendState::Pending {
                comm,
                id,
                wait,
                finished,
            } => {
                let id = *id;
                let driver = &comm.inner.driver;
                let r = driver.poll_op(
                    cx,
                    wait,
                    |st| st.endpoint.take_send(id),
                    |st, w| st.park(Waiting::Send(id), w),
                );
                r.map(|r| {
                    *finished = true;
                    r.map_err(|e| comm.local_error(e))
                })
            }
        }
    }
}

impl Drop for SendOp {
    fn drop(&mut self) {
        if let SendState::Pending {
            comm, id, finished, ..
        } = &mut self.state
        {
            let driver = &comm.inner.driver;
            if !*finished {
                let id = *id;
                driver.with(|st| {
                    st.unpark(Waiting::Send(id));
                    st.endpoint.forget_send(id);
                });
            }
        }
    }
}

/// A posted receive; resolves with the matched [`Message`].
///
/// Dropping it before it matched withdraws the receive; after it matched, the message goes back
/// to the front of the line, so it is not lost. Safe under `tokio::time::timeout`.
#[must_use = "the receive is posted; dropping the future withdraws it"]
#[derive(Debug)]
pub struct RecvOp {
    comm: Communicator,
    state: RecvState,
}

/// Where a posted receive stands: the part of [`RecvOp`] and [`RecvIntoOp`] that does not
/// depend on how they hold their communicator (owned, or borrowed for the buffer's lifetime).
#[derive(Debug)]
enum RecvState {
    Failed(Option<Error>),
    /// The message was already there when the receive was posted.
    Matched(Option<Matched>),
    Pending {
        id: RecvId,
        wait: Wait,
        finished: bool,
    },
}

impl RecvState {
    fn pending(id: RecvId) -> RecvState {
        RecvState::Pending {
            id,
            wait: Wait::default(),
            finished: false,
        }
    }

    /// The state of a receive that [`Endpoint::start_recv`](crate::protocol::Endpoint::start_recv)
    /// began on `comm`.
    fn started(comm: &Communicator, start: RecvStart) -> RecvState {
        match start {
            RecvStart::Matched(m) => RecvState::Matched(Some(m)),
            RecvStart::Failed(e) => RecvState::Failed(Some(comm.local_error(e))),
            RecvStart::Pending(id) => RecvState::pending(id),
        }
    }

    fn poll(&mut self, comm: &Communicator, cx: &mut Context<'_>) -> Poll<Result<Message, Error>> {
        match self {
            RecvState::Failed(e) => Poll::Ready(Err(e.take().unwrap_or(Error::Shutdown))),
            RecvState::Matched(m) => match m.take() {
                Some(m) => Poll::Ready(Ok(comm.message(m.received))),
                None => Poll::Ready(Err(Error::Shutdown)),
            },
            RecvState::Pending { id, wait, finished } => {
                let id = *id;
                let driver = &comm.inner.driver;
                let r = driver.poll_op(
                    cx,
                    wait,
                    |st| driver.take_recv(st, id),
                    |st, w| st.park(Waiting::Recv(id), w),
                );
                r.map(|r| {
                    *finished = true;
                    r.map(|m| comm.message(m)).map_err(|e| comm.local_error(e))
                })
            }
        }
    }

    /// The future is going away: a message taken but never read goes back where it was, a
    /// receive still waiting is withdrawn.
    fn withdraw(&mut self, comm: &Communicator) {
        match self {
            RecvState::Matched(m) => {
                if let Some(m) = m.take() {
                    comm.inner.driver.with(|st| st.endpoint.give_back(m));
                }
            }
            RecvState::Pending {
                id,
                finished: false,
                ..
            } => {
                let id = *id;
                comm.inner.driver.with(|st| {
                    st.unpark(Waiting::Recv(id));
                    st.endpoint.cancel_recv(id);
                });
            }
            RecvState::Pending { .. } | RecvState::Failed(_) => {}
        }
    }

    fn park_only(&mut self) {
        if let RecvState::Pending { wait, .. } = self {
            wait.park_only();
        }
    }
}

impl RecvOp {
    pub(crate) fn pending(comm: Communicator, id: RecvId) -> RecvOp {
        RecvOp {
            comm,
            state: RecvState::pending(id),
        }
    }

    /// The future for a receive that [`Endpoint::start_recv`](crate::protocol::Endpoint::start_recv)
    /// began.
    pub(crate) fn started(comm: Communicator, start: RecvStart) -> RecvOp {
        let state = RecvState::started(&comm, start);
        RecvOp { comm, state }
    }

    pub(crate) fn failed(comm: Communicator, e: Error) -> RecvOp {
        RecvOp {
            comm,
            state: RecvState::Failed(Some(e)),
        }
    }

    /// This receive never busy-polls while it waits, whatever the progress policy (see
    /// [`SendOp::without_spinning`]).
    pub fn without_spinning(mut self) -> RecvOp {
        self.state.park_only();
        self
    }
}

impl Future for RecvOp {
    type Output = Result<Message, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        this.state.poll(&this.comm, cx)
    }
}

impl Drop for RecvOp {
    fn drop(&mut self) {
        self.state.withdraw(&self.comm);
    }
}

/// The receive of a [`collective_exchange`](Communicator::collective_exchange): finished at
/// the call, or posted and waiting.
#[derive(Debug)]
pub enum ExchangeRecv {
    /// Its message was already here (or the receive failed at once).
    Ready(Result<Message, Error>),
    /// Posted; the future resolves with the message.
    Waiting(RecvOp),
}

/// A posted receive into a caller's buffer; resolves with the message's [`Status`].
///
/// It borrows the communicator as it borrows the buffer (no handle of its own to make and
/// drop: two atomic operations fewer per message than a [`RecvOp`]). Dropping it withdraws
/// the receive, as for a [`RecvOp`].
#[must_use = "the receive is posted; dropping the future withdraws it"]
#[derive(Debug)]
pub struct RecvIntoOp<'a> {
    comm: &'a Communicator,
    state: RecvState,
    buf: &'a mut [u8],
}

impl<'a> RecvIntoOp<'a> {
    pub(crate) fn started(comm: &'a Communicator, start: RecvStart, buf: &'a mut [u8]) -> Self {
        let state = RecvState::started(comm, start);
        RecvIntoOp { comm, state, buf }
    }

    pub(crate) fn failed(comm: &'a Communicator, e: Error, buf: &'a mut [u8]) -> Self {
        let state = RecvState::Failed(Some(e));
        RecvIntoOp { comm, state, buf }
    }
}

impl Future for RecvIntoOp<'_> {
    type Output = Result<Status, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let (comm, buf) = (this.comm, &mut *this.buf);
        let RecvState::Pending { id, wait, finished } = &mut this.state else {
            // Failed, or matched when posted: its bytes are in a buffer already.
            return this.state.poll(comm, cx).map(|r| {
                let msg = r?;
                // The engine refused longer messages (Truncated), so this always fits.
                crate::byte_copy::copy_prefix(buf, &msg.data);
                Ok(msg.status())
            });
        };
        let id = *id;
        let driver = &comm.inner.driver;
        let r = driver.poll_op(
            cx,
            wait,
            // The message's bytes go straight into `buf` when it is taken from the transport.
            |st| driver.take_recv_into(st, id, buf),
            |st, w| st.park(Waiting::Recv(id), w),
        );
        r.map(|r| {
            *finished = true;
            r.map(|(source, tag, len)| comm.status(source, tag, len))
                .map_err(|e| comm.local_error(e))
        })
    }
}

impl Drop for RecvIntoOp<'_> {
    fn drop(&mut self) {
        self.state.withdraw(self.comm);
    }
}

/// Waits for a matching message without receiving it; resolves with its [`Status`].
#[must_use = "a probe does nothing unless awaited"]
#[derive(Debug)]
pub struct ProbeOp {
    comm: Communicator,
    sel: Result<Selector, Option<Error>>,
    wait: Wait,
}

impl ProbeOp {
    pub(crate) fn new(comm: Communicator, sel: Result<Selector, Error>) -> ProbeOp {
        ProbeOp {
            comm,
            sel: sel.map_err(Some),
            wait: Wait::default(),
        }
    }
}

impl Future for ProbeOp {
    type Output = Result<Status, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let sel = match &mut this.sel {
            Ok(sel) => *sel,
            Err(e) => return Poll::Ready(Err(e.take().unwrap_or(Error::Shutdown))),
        };
        let comm = &this.comm;
        comm.inner
            .driver
            .poll_op(
                cx,
                &mut this.wait,
                |st| st.endpoint.probe(&sel),
                |st, w| st.park_probe(w),
            )
            .map(|(src, tag, len)| Ok(comm.status(src, tag, len)))
    }
}
