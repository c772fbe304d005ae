//! [`CollectiveOp`]: the future a collective returns.
//!
//! A collective starts when it is called: its sequence number is taken at once, its algorithm
//! is polled once on the spot (enough to finish it when its inputs are already here), and
//! whatever is left runs as a task of the rank's tokio runtime. So it makes progress — receiving,
//! combining and forwarding to the ranks below it in a tree — whether or not the caller polls
//! the returned future: a rank that started a broadcast and then computes for a while does not
//! hold up the ranks it forwards to (Yu's NIC-based collectives; here the runtime plays the
//! NIC). The future only waits for the result.
//!
//! A collective whose part on this rank comes down, at the call, to one receive and what it then
//! does with that message — a two-rank barrier or all-reduce once its send went out — does
//! without the future and the task: it is built
//! [`receiving`](CollectiveOp::receiving) that message and finishes where it is polled, as a
//! point-to-point receive does. Nobody waits for anything more from this rank, so nothing is
//! lost by leaving the rest to the caller's polls; this path is just cheaper (no future to
//! allocate and move, no task to schedule and hand the result back from), and when its send
//! went out at once its first look happens before anything is boxed: if the message lands
//! during that look, the usual case, nothing is allocated at all. A two-rank exchange
//! whose message is already here when it starts ([`exchanged`](CollectiveOp::exchanged)) is
//! cheaper still: it finishes at the call, with no receive future and nothing boxed.
//!
//! Dropping the future does not cancel the collective: the other ranks depend on this one's part,
//! so it runs to completion (like a dropped send). A receiving one dropped early still takes its
//! message, and one running where polled runs on, in a task.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use rankweave_core::{Error, ExchangeRecv, Message, RecvOp, SendOp};
use tokio::task::JoinHandle;

type BoxedRun<T> = Pin<Box<dyn Future<Output = Result<T, Error>> + Send + 'static>>;

/// Runs a dropped [`State::Inline`] collective to its end as a task ([`detach`], kept beside
/// it: `Drop` cannot ask for the bounds a task needs).
type Detach<T> = fn(BoxedRun<T>, &tokio::runtime::Handle);

fn detach<T: Send + 'static>(run: BoxedRun<T>, handle: &tokio::runtime::Handle) {
    drop(handle.spawn(async move {
        let _ = run.await;
    }));
}

/// The rest of a [`receiving`](CollectiveOp::receiving) collective: its last send if it did
/// not go out at once, its message, and `finish`, which makes the result of the message. Boxed
/// as one object (the closure inside it), so that a collective future stays small.
struct Receiving<F> {
    send: Option<SendOp>,
    message: Incoming,
    finish: F,
}

/// The message a [`Receiving`] collective finishes with.
enum Incoming {
    /// Still to come.
    Waiting(RecvOp),
    /// Already here (taken by the poll that returns it).
    Here(Option<Result<Message, Error>>),
}

/// [`Receiving`] with its closure's type erased.
trait Awaiting<T>: Send {
    /// Polls the send, then the receive; the message once it came.
    fn poll_message(&mut self, cx: &mut Context<'_>) -> Poll<Result<Message, Error>>;
    /// The result of the message.
    fn finish(self: Box<Self>, message: Message) -> Result<T, Error>;
    /// The receive still waiting, for a task to take the message when the future is dropped
    /// first.
    fn into_recv(self: Box<Self>) -> Option<RecvOp>;
}

impl<T, F: FnOnce(Message) -> Result<T, Error> + Send> Awaiting<T> for Receiving<F> {
    fn poll_message(&mut self, cx: &mut Context<'_>) -> Poll<Result<Message, Error>> {
        if let Some(pending) = &mut self.send {
            match Pin::new(pending).poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(())) => self.send = None,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            }
        }
        match &mut self.message {
            Incoming::Waiting(recv) => Pin::new(recv).poll(cx),
            Incoming::Here(message) => Poll::Ready(message.take().unwrap_or(Err(Error::Shutdown))),
        }
    }

    fn finish(self: Box<Self>, message: Message) -> Result<T, Error> {
        (self.finish)(message)
    }

    fn into_recv(self: Box<Self>) -> Option<RecvOp> {
        match self.message {
            Incoming::Waiting(recv) => Some(recv),
            Incoming::Here(_) => None,
        }
    }
}

/// A collective in progress: it runs whether or not this future is polled, and dropping the
/// future does not cancel it. Resolves to the collective's result.
#[must_use = "the collective runs anyway; await the future for its result"]
pub struct CollectiveOp<T> {
    state: State<T>,
    rank: usize,
}

enum State<T> {
    /// Running as a task of the runtime.
    Spawned(JoinHandle<Result<T, Error>>),
    /// Running where this future is polled, after its first look: with no runtime at the call
    /// (an executor other than tokio), or built [`here`](CollectiveOp::here). Dropped, it runs
    /// on as a task where there is a runtime.
    Inline(BoxedRun<T>, Detach<T>),
    /// Waiting for one message (and for its last send, if that did not go out at once), then
    /// finishing with the message where polled (see the [module docs](self)).
    Receiving(Box<dyn Awaiting<T>>),
    /// Failed before it started (bad argument), or already taken.
    Ready(Option<Result<T, Error>>),
}

impl<T: Send + 'static> CollectiveOp<T> {
    /// Starts `run` for rank `rank`.
    pub(crate) fn start(
        rank: usize,
        run: impl Future<Output = Result<T, Error>> + Send + 'static,
    ) -> Self {
        Self::first_look(rank, Box::pin(run), |run| {
            match tokio::runtime::Handle::try_current() {
                Ok(handle) => State::Spawned(handle.spawn(run)),
                // No tokio runtime (another executor): it runs when the future is polled.
                Err(_) => State::Inline(run, detach::<T>),
            }
        })
    }

    /// Like [`start`](Self::start), but one still pending after its first look runs only
    /// where this future is polled, never as a task: for a rank whose remaining part is only
    /// to wait, with nothing the other ranks wait for (a barrier leaf once it has signalled).
    pub(crate) fn here(
        rank: usize,
        run: impl Future<Output = Result<T, Error>> + Send + 'static,
    ) -> Self {
        Self::first_look(rank, Box::pin(run), |run| State::Inline(run, detach::<T>))
    }

    /// One look first: a collective whose inputs are already here (a late rank's barrier, a
    /// broadcast root's eager sends) finishes at once, without a task and the scheduler round
    /// trips of handing its result back. A pending one goes on as `pending` says; a task is
    /// polled again there, which registers its waker: nothing this look saw is missed. (The
    /// runtime's handle, a reference count, is only taken then.)
    fn first_look(
        rank: usize,
        mut run: BoxedRun<T>,
        pending: impl FnOnce(BoxedRun<T>) -> State<T>,
    ) -> Self {
        let mut cx = Context::from_waker(Waker::noop());
        let first = std::panic::catch_unwind(AssertUnwindSafe(|| run.as_mut().poll(&mut cx)));
        let state = match first {
            Ok(Poll::Ready(result)) => State::Ready(Some(result)),
            Ok(Poll::Pending) => pending(run),
            Err(_) => State::Ready(Some(Err(panicked(rank)))),
        };
        CollectiveOp { state, rank }
    }

    /// Spawns `run` for rank `rank` without a first look (its caller just had one), or keeps it
    /// to run where polled if there is no runtime.
    pub(crate) fn spawn(
        rank: usize,
        run: impl Future<Output = Result<T, Error>> + Send + 'static,
    ) -> Self {
        let run: BoxedRun<T> = Box::pin(run);
        let state = match tokio::runtime::Handle::try_current() {
            Ok(handle) => State::Spawned(handle.spawn(run)),
            Err(_) => State::Inline(run, detach::<T>),
        };
        CollectiveOp { state, rank }
    }

    /// A collective whose whole remaining part is to see `send` (its last, if any) through,
    /// receive with `recv` (already posted) and `finish` with the message. Like
    /// [`start`](Self::start), it has a first look at once, so a message already here finishes
    /// it at the call.
    pub(crate) fn receiving(
        rank: usize,
        send: Option<SendOp>,
        mut recv: RecvOp,
        finish: impl FnOnce(Message) -> Result<T, Error> + Send + 'static,
    ) -> Self {
        let send = send.filter(|s| !s.is_complete());
        if send.is_none() {
            // The first look, before anything is boxed: the message usually lands during its
            // spin burst (the other rank a step behind), and the collective is then finished
            // at the call with no allocation at all.
            let mut cx = Context::from_waker(Waker::noop());
            match Pin::new(&mut recv).poll(&mut cx) {
                Poll::Ready(message) => {
                    return Self::finished(
                        rank,
                        message.and_then(|m| finish_caught(rank, finish, m)),
                    );
                }
                Poll::Pending => return Self::boxed(rank, None, Incoming::Waiting(recv), finish),
            }
        }
        Self::awaiting(rank, send, Incoming::Waiting(recv), finish)
    }

    /// A collective whose whole remaining part is the exchange
    /// ([`Communicator::collective_exchange`](rankweave_core::Communicator::collective_exchange))
    /// that started as `sent` and `received`, then `finish` with the message. When the message
    /// was already here and the send went out at once — the usual case for the later of two
    /// ranks — it finishes at the call, with nothing boxed and no receive future.
    pub(crate) fn exchanged(
        rank: usize,
        sent: SendOp,
        received: ExchangeRecv,
        finish: impl FnOnce(Message) -> Result<T, Error> + Send + 'static,
    ) -> Self {
        match received {
            ExchangeRecv::Ready(message) if sent.is_complete() => {
                Self::finished(rank, message.and_then(|m| finish_caught(rank, finish, m)))
            }
            ExchangeRecv::Ready(message) => {
                Self::awaiting(rank, Some(sent), Incoming::Here(Some(message)), finish)
            }
            ExchangeRecv::Waiting(recv) => Self::receiving(rank, Some(sent), recv, finish),
        }
    }

    /// [`receiving`](Self::receiving), with the message still to come or already here.
    fn awaiting(
        rank: usize,
        send: Option<SendOp>,
        message: Incoming,
        finish: impl FnOnce(Message) -> Result<T, Error> + Send + 'static,
    ) -> Self {
        let mut op = Self::boxed(rank, send, message, finish);
        let mut cx = Context::from_waker(Waker::noop());
        if let Poll::Ready(result) = Pin::new(&mut op).poll(&mut cx) {
            op.state = State::Ready(Some(result));
        }
        op
    }

    /// The [`receiving`](Self::receiving) state, boxed (no look taken here).
    fn boxed(
        rank: usize,
        send: Option<SendOp>,
        message: Incoming,
        finish: impl FnOnce(Message) -> Result<T, Error> + Send + 'static,
    ) -> Self {
        CollectiveOp {
            state: State::Receiving(Box::new(Receiving {
                send: send.filter(|s| !s.is_complete()),
                message,
                finish,
            })),
            rank,
        }
    }

    /// A collective that failed before it started (its arguments were invalid); nothing was
    /// sent.
    pub(crate) fn failed(rank: usize, error: Error) -> Self {
        Self::finished(rank, Err(error))
    }

    /// A collective that finished where it was called (a small broadcast's root).
    pub(crate) fn finished(rank: usize, result: Result<T, Error>) -> Self {
        CollectiveOp {
            state: State::Ready(Some(result)),
            rank,
        }
    }
}

/// `finish(message)`, a panic in it turned into an error.
fn finish_caught<T>(
    rank: usize,
    finish: impl FnOnce(Message) -> Result<T, Error>,
    message: Message,
) -> Result<T, Error> {
    std::panic::catch_unwind(AssertUnwindSafe(|| finish(message)))
        .unwrap_or_else(|_| Err(panicked(rank)))
}

pub(crate) fn panicked(rank: usize) -> Error {
    Error::RankPanicked {
        rank,
        message: "a collective panicked".into(),
    }
}

// Nothing in it is pinned structurally: the task handle, the boxed run and the receive are
// `Unpin`, and the result is only moved out.
impl<T> Unpin for CollectiveOp<T> {}

impl<T> Future for CollectiveOp<T> {
    type Output = Result<T, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        match &mut this.state {
            State::Spawned(handle) => Pin::new(handle).poll(cx).map(|r| match r {
                Ok(result) => result,
                Err(e) if e.is_panic() => Err(Error::RankPanicked {
                    rank: this.rank,
                    message: "a collective's task panicked".into(),
                }),
                Err(_) => Err(Error::Shutdown),
            }),
            State::Inline(run, _) => {
                let done = run.as_mut().poll(cx);
                if done.is_ready() {
                    // Finished: nothing for `Drop` to run on (a finished `async` block must
                    // not be polled again).
                    this.state = State::Ready(None);
                }
                done
            }
            State::Ready(r) => Poll::Ready(r.take().unwrap_or(Err(Error::Shutdown))),
            State::Receiving(rest) => {
                let message = match rest.poll_message(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(message) => message,
                };
                let State::Receiving(rest) = std::mem::replace(&mut this.state, State::Ready(None))
                else {
                    return Poll::Ready(Err(Error::Shutdown));
                };
                Poll::Ready(message.and_then(|m| finish_caught(this.rank, |m| rest.finish(m), m)))
            }
        }
    }
}

impl<T> Drop for CollectiveOp<T> {
    fn drop(&mut self) {
        // Its messages still come: a task takes them (without a runtime the receives are
        // withdrawn and the messages stay unclaimed, as with any future of another executor).
        if !matches!(self.state, State::Receiving(_) | State::Inline(..)) {
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        match std::mem::replace(&mut self.state, State::Ready(None)) {
            State::Receiving(rest) => {
                // (A pending send goes on by itself when its future is dropped.)
                if let Some(recv) = rest.into_recv() {
                    drop(handle.spawn(async move {
                        let _ = recv.await;
                    }));
                }
            }
            // What was left to run where polled (a linear all-to-all's receives, a barrier's
            // wait) runs to its end.
            State::Inline(run, detach) => detach(run, &handle),
            _ => {}
        }
    }
}

impl<T> std::fmt::Debug for CollectiveOp<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            State::Spawned(_) => "running",
            State::Inline(..) => "inline",
            State::Receiving(_) => "receiving",
            State::Ready(_) => "ready",
        };
        f.debug_struct("CollectiveOp")
            .field("rank", &self.rank)
            .field("state", &state)
            .finish()
    }
}
