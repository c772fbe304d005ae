//! The per-rank driver: the protocol [`Endpoint`] behind a lock, the transport beside it, and the
//! wakers of the futures waiting on it.
//!
//! Everything that moves data goes through [`Driver::pump`]: take what the transport received,
//! feed it to the endpoint, hand the endpoint's frames to the transport, and wake the futures
//! whose operations finished. Futures pump while they are polled (so a busy-polling receive sees
//! its message without any wake-up); the progress task pumps when the transport rings and no
//! future is busy-polling, which is what moves data while the application is not polling.

use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;

use rustc_hash::FxHashMap;

use crate::buffer_pool::BufferPool;
use crate::config::{Config, ProgressPolicy};
use crate::error::Error;
use crate::error::TransportError;
use crate::frame::{Envelope, Frame, Header};
use crate::matching::Selector;
use crate::protocol::{
    Endpoint, EndpointConfig, Event, Received, RecvId, RecvStart, SendId, SendStart,
};
use crate::spin_lock::{SpinLock, SpinLockGuard};
use crate::stats::Stats;
use crate::transport::{Arrival, Transport};
use crate::types::ContextId;

use super::shutdown::ShutdownSignal;

/// The payload of a send: a buffer the caller gives away, or borrowed pieces to be sent one
/// after the other (a collective's elements and its trailer byte) — copied straight into the
/// transport when the send goes out at once, into a buffer of their own otherwise.
#[derive(Debug)]
pub(crate) enum SendData<'a> {
    Bytes(Bytes),
    Parts(&'a [&'a [u8]]),
}

impl SendData<'_> {
    fn len(&self) -> usize {
        match self {
            SendData::Bytes(b) => b.len(),
            SendData::Parts(parts) => parts.iter().map(|p| p.len()).sum(),
        }
    }

    fn into_bytes(self) -> Bytes {
        match self {
            SendData::Bytes(b) => b,
            SendData::Parts(parts) => BufferPool::shared().concat(parts),
        }
    }
}

/// The receive of an [`exchange`](Driver::exchange) once it was started.
#[derive(Debug)]
pub(crate) enum RecvNow {
    /// Finished at once: its message (or why it failed).
    Done(Result<Received, Error>),
    /// Posted; it finishes later.
    Pending(RecvId),
}

/// What a parked future waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Waiting {
    Recv(RecvId),
    Send(SendId),
}

/// The state behind the driver's lock.
pub(crate) struct DriverState {
    pub(crate) endpoint: Endpoint,
    wakers: FxHashMap<Waiting, Waker>,
    probe_wakers: Vec<Waker>,
    arrivals: Vec<Arrival>,
}

impl DriverState {
    /// Registers `waker` to be woken when `what` finishes.
    pub(crate) fn park(&mut self, what: Waiting, waker: &Waker) {
        match self.wakers.get_mut(&what) {
            Some(w) if w.will_wake(waker) => {}
            Some(w) => w.clone_from(waker),
            None => {
                self.wakers.insert(what, waker.clone());
            }
        }
    }

    /// Forgets the waker registered for `what`.
    pub(crate) fn unpark(&mut self, what: Waiting) {
        self.wakers.remove(&what);
    }

    /// Registers `waker` to be woken when a new unexpected message arrives.
    pub(crate) fn park_probe(&mut self, waker: &Waker) {
        if !self.probe_wakers.iter().any(|w| w.will_wake(waker)) {
            self.probe_wakers.push(waker.clone());
        }
    }
}

/// One rank's engine, shared by its communicators, their futures and its progress task.
pub(crate) struct Driver {
    state: SpinLock<DriverState>,
    transport: Arc<dyn Transport>,
    pub(crate) config: Config,
    pub(crate) rank: u32,
    /// Set when the last communicator goes; wakes the progress task. Aborted if the rank died
    /// (its last communicator was dropped while panicking): stop at once, even with sends
    /// pending, so peers learn of the loss.
    shutdown: ShutdownSignal,
    /// Becomes `true` when the progress task has ended and closed the transport.
    finished: tokio::sync::watch::Sender<bool>,
}

impl Driver {
    pub(crate) fn new(rank: u32, size: u32, transport: Arc<dyn Transport>, config: Config) -> Self {
        let caps = transport.capabilities();
        let max_payload = config
            .max_frame
            .map_or(caps.max_payload, |m| m.min(caps.max_payload));
        let endpoint = Endpoint::new(EndpointConfig {
            rank,
            size,
            eager_limit: config.eager_limit.min(max_payload),
            unexpected_limit: config.unexpected_limit,
            max_payload,
            rts_with_data: caps.by_reference,
        });
        Driver {
            state: SpinLock::new(DriverState {
                endpoint,
                wakers: FxHashMap::default(),
                probe_wakers: Vec::new(),
                arrivals: Vec::new(),
            }),
            transport,
            config,
            rank,
            shutdown: ShutdownSignal::new(),
            finished: tokio::sync::watch::Sender::new(false),
        }
    }

    /// Locks the state. A [`SpinLock`]: every operation takes it at least once, its critical
    /// sections are short, and it costs half the atomic operations of a `Mutex`. (A panic while
    /// it is held releases it: one panicking rank does not turn every later call into a panic.)
    pub(crate) fn lock(&self) -> SpinLockGuard<'_, DriverState> {
        self.state.lock()
    }

    /// Runs `f` on the locked state, sends what it produced, then wakes whatever finished.
    ///
    /// Posting an operation does not look at the transport: arrivals are taken in when someone
    /// waits (or probes, or the progress task runs). Matching results do not depend on it —
    /// arrivals keep their order and a receive posted earlier still matches first — and the
    /// receiving rank touches the cache lines its senders write once per batch instead of once
    /// per operation.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut DriverState) -> R) -> R {
        self.run(|_, st, _| f(st))
    }

    /// Like [`with`](Self::with), but takes in everything that arrived first.
    pub(crate) fn with_pumped<R>(&self, f: impl FnOnce(&mut DriverState) -> R) -> R {
        self.run(|d, st, wake| {
            d.pump(st, wake);
            f(st)
        })
    }

    /// Runs `check`; only if it has no answer yet and the transport may have something, takes
    /// in arrivals and runs it again. `arrived`: the caller has just seen
    /// [`Transport::may_have_arrivals`] say yes.
    fn check_or_pump<R>(
        &self,
        arrived: bool,
        mut check: impl FnMut(&mut DriverState) -> Option<R>,
    ) -> Option<R> {
        self.run(|d, st, wake| {
            check(st).or_else(|| {
                // A waiting future's first poll usually comes before its answer: skip the
                // empty drain (the transport's hint is exact for shared memory and in-process,
                // and `true` for the others).
                if !arrived && !d.transport.may_have_arrivals() {
                    return None;
                }
                d.pump_until(st, wake, &mut check)
            })
        })
    }

    /// Locks, runs `f`, sends what it produced, unlocks, then wakes whatever finished.
    fn run<R>(&self, f: impl FnOnce(&Self, &mut DriverState, &mut Vec<Waker>) -> R) -> R {
        let mut wake = Vec::new();
        let r = {
            let mut st = self.lock();
            let r = f(self, &mut st, &mut wake);
            self.flush(&mut st, &mut wake);
            r
        };
        wake.into_iter().for_each(Waker::wake);
        r
    }

    /// Moves data: drains the transport into the endpoint, sends what the endpoint produced and
    /// collects the wakers of finished operations into `wake` (woken after the lock is released).
    fn pump(&self, st: &mut DriverState, wake: &mut Vec<Waker>) {
        self.pump_until(st, wake, |_| None::<()>);
    }

    /// [`pump`](Self::pump), stopping as soon as `check` has an answer, which it returns.
    ///
    /// What is still in the transport stays there for the next poll or the progress task:
    /// a waiting future gets its result without first taking in everything behind it (a
    /// transport may deliver in bounded batches so that large payloads are read only when
    /// their receive asks; see the shared-memory transport's reads).
    fn pump_until<R>(
        &self,
        st: &mut DriverState,
        wake: &mut Vec<Waker>,
        mut check: impl FnMut(&mut DriverState) -> Option<R>,
    ) -> Option<R> {
        let mut arrivals = std::mem::take(&mut st.arrivals);
        let mut answer = None;
        loop {
            if let Err(e) = self.transport.drain(&mut arrivals) {
                tracing::warn!(rank = self.rank, error = %e, "transport drain failed");
            }
            if arrivals.is_empty() {
                break;
            }
            for a in arrivals.drain(..) {
                st.endpoint.handle(a);
            }
            answer = check(st);
            if answer.is_some() {
                break;
            }
            // Look again only if something may have come meanwhile (for shared memory a few
            // loads, where a drain takes locks and walks every ring). If not, what handling
            // produced goes out with `run`'s flush after its closure.
            if !self.transport.may_have_arrivals() {
                break;
            }
            self.flush(st, wake);
            // A parked operation finished: let its future run before taking in more. Left
            // to go on, a drain of a window of large messages (one single-copy read each)
            // kept a rank from posting its next sends until it had read everything, and a
            // bidirectional exchange ran one direction at a time.
            if !wake.is_empty() {
                break;
            }
        }
        // `run` flushes after its closure: nothing is left queued.
        st.arrivals = arrivals;
        answer
    }

    /// Starts a send. The common small one — an eager message to another rank with nothing
    /// queued ahead of it ([`Endpoint::start_eager`]) — goes straight to the transport
    /// ([`transmit_eager`](Self::transmit_eager)): it queues and finishes nothing else, so
    /// there is no queue to go through and nothing to flush or wake.
    pub(crate) fn post_send(
        &self,
        to: u32,
        context: ContextId,
        tag: u32,
        data: SendData<'_>,
    ) -> Result<SendStart, Error> {
        let mut st = self.lock();
        let start = self.start_send(&mut st, to, context, tag, data);
        // The common eager send queues and finishes nothing: no flush, nobody to wake.
        if !st.endpoint.has_output() {
            return start;
        }
        let mut wake = Vec::new();
        self.flush_output(&mut st, &mut wake);
        drop(st);
        wake.into_iter().for_each(Waker::wake);
        start
    }

    /// A send and a receive started together, under one lock: a two-rank collective's one
    /// exchange. The send starts as [`post_send`](Self::post_send) starts it; the receive for
    /// `sel` is posted and, if its message is already the next thing from its sender (the
    /// usual case when the other rank is ahead), taken at once, as a waiting future's first
    /// look would take it — so such a receive needs no future at all.
    pub(crate) fn exchange(
        &self,
        to: u32,
        context: ContextId,
        tag: u32,
        data: SendData<'_>,
        sel: Selector,
    ) -> (Result<SendStart, Error>, RecvNow) {
        self.run(|d, st, _| {
            let sent = d.start_send(st, to, context, tag, data);
            let received = match st.endpoint.start_recv(sel, None) {
                RecvStart::Matched(m) => RecvNow::Done(Ok(m.received)),
                RecvStart::Failed(e) => RecvNow::Done(Err(e)),
                RecvStart::Pending(id) => match d.take_recv(st, id) {
                    Some(r) => RecvNow::Done(r),
                    None => RecvNow::Pending(id),
                },
            };
            (sent, received)
        })
    }

    /// Starts a send on the locked state (see [`post_send`](Self::post_send)).
    ///
    /// Inlined by force, as are the endpoint's `start_eager` and `start_recv` and
    /// [`transmit_eager`](Self::transmit_eager): every small message's path, which LLVM stopped
    /// inlining once [`exchange`](Self::exchange) called it too (some 30 instructions more per
    /// message, `bench/callgrind-shm`).
    #[inline(always)]
    fn start_send(
        &self,
        st: &mut DriverState,
        to: u32,
        context: ContextId,
        tag: u32,
        data: SendData<'_>,
    ) -> Result<SendStart, Error> {
        match st.endpoint.start_eager(to, context, tag, data.len()) {
            Ok(Some(envelope)) => {
                // If the peer is lost, receives waiting for it fail (the flush wakes them).
                self.transmit_eager(st, to, envelope, data);
                Ok(SendStart::Complete)
            }
            Ok(None) => st.endpoint.post_send(to, context, tag, data.into_bytes()),
            Err(e) => Err(e),
        }
    }

    /// Hands the eager message `envelope` with payload `data` to the transport: written in
    /// place where the transport can ([`Transport::send_eager`]), as a frame otherwise.
    /// Returns `false` if the transport cannot reach the peer (see
    /// [`hand_over`](Self::hand_over)).
    #[inline(always)]
    fn transmit_eager(
        &self,
        st: &mut DriverState,
        to: u32,
        envelope: Envelope,
        data: SendData<'_>,
    ) -> bool {
        let written = match &data {
            SendData::Bytes(bytes) if self.transport.reads_in_place(to, bytes.len()) => Ok(false),
            SendData::Bytes(bytes) => self.transport.send_eager(to, &envelope, &[bytes]),
            SendData::Parts(parts) => self.transport.send_eager(to, &envelope, parts),
        };
        match written {
            Ok(true) => true,
            Ok(false) => {
                let frame = Frame {
                    header: Header::Eager(envelope),
                    payload: data.into_bytes(),
                };
                self.hand_over(st, to, frame)
            }
            Err(e) => self.unreachable(st, to, &e),
        }
    }

    /// Gives `frame` to the transport. Returns `false` if the transport cannot reach the peer,
    /// which is then lost to the endpoint.
    fn hand_over(&self, st: &mut DriverState, to: u32, frame: Frame) -> bool {
        match self.transport.send(to, frame) {
            Ok(()) => true,
            Err(e) => self.unreachable(st, to, &e),
        }
    }

    /// The transport cannot reach `to`: the endpoint loses the peer. Returns `false`.
    #[cold]
    fn unreachable(&self, st: &mut DriverState, to: u32, e: &TransportError) -> bool {
        tracing::debug!(rank = self.rank, to, error = %e, "peer unreachable");
        st.endpoint.peer_unreachable(to);
        false
    }

    /// Hands queued frames to the transport and turns events into wakers.
    #[inline]
    fn flush(&self, st: &mut DriverState, wake: &mut Vec<Waker>) {
        // Usually nothing: a receive that took its message directly, say.
        if st.endpoint.has_output() {
            self.flush_output(st, wake);
        }
    }

    /// [`flush`](Self::flush) when the endpoint has frames or events.
    fn flush_output(&self, st: &mut DriverState, wake: &mut Vec<Waker>) {
        while let Some((to, frame)) = st.endpoint.poll_transmit() {
            self.hand_over(st, to, frame);
        }
        if st.wakers.is_empty() && st.probe_wakers.is_empty() {
            // Nobody is parked (the busy-polling case): events need no translation.
            st.endpoint.discard_events();
            return;
        }
        while let Some(ev) = st.endpoint.poll_event() {
            let w = match ev {
                Event::RecvDone(id) => st.wakers.remove(&Waiting::Recv(id)),
                Event::SendDone(id) => st.wakers.remove(&Waiting::Send(id)),
                Event::Unexpected => {
                    wake.append(&mut st.probe_wakers);
                    None
                }
            };
            wake.extend(w);
        }
    }

    /// The result of receive `id` once it finished, or `None` while it waits.
    ///
    /// A receive waiting for one sender first takes that sender's next frame straight from the
    /// transport if it is the eager message it wants ([`Endpoint::direct_want`],
    /// [`Transport::take_eager`], [`Endpoint::take_direct`]): the common small message skips
    /// the arrival queue, matching and completion events. Anything else is left for the pump.
    pub(crate) fn take_recv(
        &self,
        st: &mut DriverState,
        id: RecvId,
    ) -> Option<Result<Received, Error>> {
        if let Some(r) = st.endpoint.take_recv(id) {
            return Some(r);
        }
        self.take_straight(st, id, None)
            .map(|(received, _)| Ok(received))
    }

    /// [`take_recv`](Self::take_recv) for a receive into `buf` (no longer than the receive's
    /// capacity allows): the message's sender, tag and length once it finished. An eager
    /// message taken straight from the transport is copied into `buf` there, with no buffer of
    /// its own on the way; one that came through matching is copied from its buffer.
    pub(crate) fn take_recv_into(
        &self,
        st: &mut DriverState,
        id: RecvId,
        buf: &mut [u8],
    ) -> Option<Result<(u32, u32, usize), Error>> {
        if let Some(r) = st.endpoint.take_recv(id) {
            return Some(r.map(|m| {
                // The engine refused longer messages (`Truncated`), so it fits.
                crate::byte_copy::copy_prefix(buf, &m.data);
                (m.source, m.tag, m.data.len())
            }));
        }
        if let Some((m, len)) = self.take_straight(st, id, Some(&mut *buf)) {
            return Some(Ok((m.source, m.tag, len)));
        }
        self.take_data(st, id, buf).map(Ok)
    }

    /// Rendezvous receive `id`'s data read by the transport straight into `buf`
    /// ([`Endpoint::data_want`], [`Transport::take_data`], [`Endpoint::take_data_direct`]):
    /// its sender, tag and length, or `None` if the transport did not take it.
    fn take_data(
        &self,
        st: &mut DriverState,
        id: RecvId,
        buf: &mut [u8],
    ) -> Option<(u32, u32, usize)> {
        let want = st.endpoint.data_want(id)?;
        if want.len > buf.len() || !self.transport.take_data(&want, buf) {
            return None;
        }
        let r = st.endpoint.take_data_direct(id, &want);
        if !st.wakers.is_empty() {
            // It parked once; no completion event will come to take its waker away.
            st.unpark(Waiting::Recv(id));
        }
        r
    }

    /// Receive `id`'s eager message taken straight from the transport (its payload copied to
    /// `into` if given, and then not in the result's `data`), with the payload's length.
    fn take_straight(
        &self,
        st: &mut DriverState,
        id: RecvId,
        into: Option<&mut [u8]>,
    ) -> Option<(Received, usize)> {
        let direct = st.endpoint.direct_want(id)?;
        let taken = self.transport.take_eager(&direct.want, into)?;
        let len = taken.len;
        let m = st.endpoint.take_direct(id, &direct, taken);
        if !st.wakers.is_empty() {
            // It parked once; no completion event will come to take its waker away.
            st.unpark(Waiting::Recv(id));
        }
        Some((m.received, len))
    }

    /// Pumps once; used by the progress task. Returns whether it woke a parked future.
    pub(crate) fn progress(&self) -> bool {
        let mut woke = false;
        self.run(|d, st, wake| {
            d.pump(st, wake);
            d.flush(st, wake);
            woke = !wake.is_empty();
        });
        woke
    }

    /// Polls an operation with the rank's progress policy: `check` looks at the locked state and
    /// returns the result once the operation is done; `park` registers the waker otherwise.
    ///
    /// While spinning, each poll busy-polls for a short burst registered with the transport as
    /// a busy poller (so arrivals do not wake the progress task), then yields to the scheduler.
    /// The registration never outlives the poll: a future that is polled once and then kept
    /// without being polled (say under `timeout(d, &mut op)`) cannot leave it behind.
    pub(crate) fn poll_op<T>(
        &self,
        cx: &mut Context<'_>,
        wait: &mut Wait,
        mut check: impl FnMut(&mut DriverState) -> Option<T>,
        park: impl FnOnce(&mut DriverState, &Waker),
    ) -> Poll<T> {
        if let Some(r) = self.check_or_pump(false, &mut check) {
            return Poll::Ready(r);
        }
        if wait.should_spin(&self.config) {
            // Watch the transport's doorbell (one load) and take the lock only when something
            // arrived: the reply is seen as soon as its cache line lands.
            let answer = self.spin_burst(wait, || {
                if self.transport.may_have_arrivals() {
                    self.check_or_pump(true, &mut check)
                } else {
                    None
                }
            });
            return self.after_burst(cx, answer);
        }
        // Park: register, then check once more so a completion between the two is not missed.
        self.transport.waiter_parked();
        self.with_pumped(|st| match check(st) {
            Some(r) => Poll::Ready(r),
            None => {
                park(st, cx.waker());
                Poll::Pending
            }
        })
    }

    /// One busy-poll burst of a waiting future, registered with the transport as a busy poller
    /// (so arrivals do not wake the progress task): `poll` each turn until it answers or
    /// [`SPIN_BURST`] has passed. The registration never outlives the burst: a future polled
    /// once and then kept without being polled (say under `timeout(d, &mut op)`) cannot leave
    /// it behind.
    fn spin_burst<T>(&self, wait: &mut Wait, mut poll: impl FnMut() -> Option<T>) -> Option<T> {
        let _busy = BusyPoll::new(&*self.transport);
        // The clock is first read after a few polls, not before the first: a reply on its
        // way lands within a few hundred nanoseconds, and three clock reads (some 20 ns
        // each here) ahead of the first look would add to its latency.
        let mut burst: Option<Instant> = None;
        let mut polls = 0u32;
        let give_way = self.config.spin_yield == Some(true);
        loop {
            if give_way {
                // More ranks than cores: let the one we wait for run.
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            if let Some(r) = poll() {
                return Some(r);
            }
            polls += 1;
            // The clock is read once every few polls: it costs more than a poll.
            if polls % CLOCK_EVERY == 0 {
                let now = Instant::now();
                let start = *burst.get_or_insert(now);
                if now.duration_since(start) >= SPIN_BURST {
                    wait.spinning_since(start);
                    // Data moving for this rank (a long frame going out or coming in piece by
                    // piece) restarts the spin window: a transfer longer than the window is
                    // not left to wake-ups, one per ring of pieces.
                    wait.saw_traffic(self.transport.traffic());
                    return None;
                }
            }
        }
    }

    /// The end of a burst: its answer, or yield and come straight back (other tasks on this
    /// worker run in between, and no wake-up, a system call, is needed to resume).
    fn after_burst<T>(&self, cx: &mut Context<'_>, answer: Option<T>) -> Poll<T> {
        match answer {
            Some(r) => Poll::Ready(r),
            None => {
                cx.waker().wake_by_ref();
                Poll::Pending
            }
        }
    }

    /// Polls a wait on flags (see [`Transport::raise_flag`]) with the rank's progress policy,
    /// as [`poll_op`](Self::poll_op) polls an operation: `look` reads the flags, without the
    /// lock. While spinning, what arrives for the rank is taken in as a busy-polling receive
    /// takes it in — messages for other futures, and word of sends the receiver has finished
    /// with (a timed send's end, which the shared-memory transport's choice of copy path
    /// learns from). Parked, the transport wakes it when a flag changes.
    pub(crate) fn poll_flags<T>(
        &self,
        cx: &mut Context<'_>,
        wait: &mut Wait,
        mut look: impl FnMut() -> Option<T>,
    ) -> Poll<T> {
        if let Some(r) = look() {
            return Poll::Ready(r);
        }
        if wait.should_spin(&self.config) {
            let answer = self.spin_burst(wait, || {
                if self.transport.may_have_arrivals() {
                    self.progress();
                }
                look()
            });
            return self.after_burst(cx, answer);
        }
        self.transport.park_on_flags(cx.waker());
        self.transport.waiter_parked();
        // Raised between the look and the parking: seen now, or it wakes us.
        look().map_or(Poll::Pending, Poll::Ready)
    }

    /// See [`Transport::can_read_peer_memory`].
    pub(crate) fn can_read_peer_memory(&self, peer: u32) -> bool {
        self.transport.can_read_peer_memory(peer)
    }

    /// See [`Transport::read_peer_memory`].
    pub(crate) fn read_peer_memory(
        &self,
        peer: u32,
        addr: u64,
        dst: &mut [std::mem::MaybeUninit<u8>],
    ) -> Result<(), TransportError> {
        self.transport.read_peer_memory(peer, addr, dst)
    }

    /// See [`Transport::lease_arena`].
    pub(crate) fn lease_arena(&self) -> Option<crate::ArenaLease> {
        self.transport.lease_arena()
    }

    /// See [`Transport::peer_arena`].
    pub(crate) fn peer_arena(&self, peer: u32) -> Option<crate::PeerArena> {
        self.transport.peer_arena(peer)
    }

    /// See [`Transport::has_flags_with`].
    pub(crate) fn has_flags_with(&self, peer: u32) -> bool {
        self.transport.has_flags_with(peer)
    }

    /// See [`Transport::raise_flag`].
    pub(crate) fn raise_flag(&self, peer: u32, value: u64) -> Result<(), TransportError> {
        self.transport.raise_flag(peer, value)
    }

    /// See [`Transport::read_flag`].
    pub(crate) fn read_flag(
        &self,
        peer: u32,
    ) -> Result<crate::transport::PeerFlag, TransportError> {
        self.transport.read_flag(peer)
    }

    /// Counters of this rank.
    pub(crate) fn stats(&self) -> Stats {
        let mut stats = self.lock().endpoint.stats();
        stats.transport = self.transport.stats();
        stats
    }

    /// The last communicator of this rank is gone: let the progress task finish pending sends
    /// and then close the transport. With `abort`, close at once (the rank panicked: its pending
    /// sends die with it, and peers must hear of the loss rather than wait for them).
    pub(crate) fn begin_shutdown(&self, abort: bool) {
        self.shutdown.request(abort);
    }

    /// The progress task: pumps whenever the transport rings, until shutdown with no sends left.
    pub(crate) async fn run_progress(self: Arc<Self>) {
        let mut draining = false;
        loop {
            std::future::poll_fn(|cx| {
                // Always poll the signal (it registers our waker, then checks), so a request
                // that races this poll is either seen here or wakes us.
                if self.shutdown.poll_requested(cx).is_ready() && !draining {
                    return Poll::Ready(());
                }
                self.transport.poll_arrival(cx)
            })
            .await;
            draining |= self.shutdown.is_requested();
            if self.progress() {
                // The futures it woke go first: they may post what the peers wait for (the
                // next window of sends), and on a one-thread runtime a transport that keeps
                // reporting work would otherwise hold them off for a whole task budget.
                tokio::task::yield_now().await;
            } else {
                // A transport that keeps reporting work must not starve the rank's own tasks
                // (which may be what it waits for) on this worker.
                tokio::task::consume_budget().await;
            }
            // Sends whose futures were dropped still complete (their peers answer through the
            // transport, which wakes us); only then does the rank go away.
            if self.shutdown.is_aborted() || (draining && !self.lock().endpoint.has_pending_sends())
            {
                break;
            }
        }
        self.transport.close();
        // A closed transport may still hold frames it could not hand over yet (a full ring, an
        // unacknowledged window) and nobody else will drive it when the rank was dropped rather
        // than shut down: keep at it here. The transport bounds this time (its linger).
        while !self.transport.is_drained() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        self.finished.send_replace(true);
    }

    /// Shuts the rank down (see [`Communicator::shutdown`](crate::Communicator::shutdown)) and
    /// waits until the progress task has ended, which includes the transport delivering what
    /// it was given or giving up on it.
    ///
    /// The caller has dropped its communicator. The rank's other handles get up to the peer
    /// timeout to go first: services that hold one (the multicast broadcast engine) are
    /// finishing what they owe other ranks, and closing under them would fail those ranks.
    /// Past that the rank ends regardless.
    pub(crate) async fn shut_down(&self) {
        let mut finished = self.finished.subscribe();
        let grace = self.config.peer_timeout;
        if tokio::time::timeout(grace, finished.wait_for(|&done| done))
            .await
            .is_err()
        {
            tracing::warn!(
                rank = self.rank,
                "shutdown: other handles of this rank still exist after {grace:?}; ending it anyway"
            );
            self.begin_shutdown(false);
            let _ = finished.wait_for(|&done| done).await;
        }
    }

    /// Spawns the progress task on the current tokio runtime.
    pub(crate) fn spawn_progress(self: &Arc<Self>) -> Result<(), Error> {
        let handle = tokio::runtime::Handle::try_current().map_err(|_| Error::NoRuntime)?;
        handle.spawn(Arc::clone(self).run_progress());
        Ok(())
    }
}

/// How long one poll busy-polls before yielding to the scheduler: long enough to catch a reply
/// that is on its way (an in-process round trip is well under a microsecond), short enough that
/// ranks sharing a worker thread take turns quickly.
const SPIN_BURST: Duration = Duration::from_micros(1);

/// Polls of the spin loop between two looks at the clock. A poll that finds nothing is a few
/// loads (tens of nanoseconds), a clock read about as much again on a virtual machine: looking
/// every 32 polls keeps the clock under a tenth of the loop and overshoots the burst by at most
/// about a microsecond.
const CLOCK_EVERY: u32 = 32;

/// The waiting state of one future: since when it has been spinning.
#[derive(Debug, Default)]
pub(crate) struct Wait {
    since: Option<Instant>,
    /// [`Transport::traffic`] when last looked at.
    traffic: u64,
    /// Never spin, whatever the policy (a background service's operation).
    park_only: bool,
}

impl Wait {
    /// Makes this future park at once whenever it has to wait.
    pub(crate) fn park_only(&mut self) {
        self.park_only = true;
    }

    /// Restarts the spin window if the transport's traffic count moved since the last look.
    fn saw_traffic(&mut self, traffic: u64) {
        if traffic != self.traffic {
            self.traffic = traffic;
            if self.since.is_some() {
                self.since = Some(Instant::now());
            }
        }
    }

    /// Whether the policy lets this future keep busy-polling.
    fn should_spin(&mut self, config: &Config) -> bool {
        if self.park_only {
            return false;
        }
        match config.progress {
            ProgressPolicy::Park => false,
            ProgressPolicy::Spin => true,
            // Before the first burst ended, the window has just begun: no clock read.
            ProgressPolicy::SpinThenPark => self
                .since
                .is_none_or(|since| since.elapsed() < config.spin_window()),
        }
    }

    /// A spin burst that began at `start` ended without an answer: the window counts from the
    /// first one.
    fn spinning_since(&mut self, start: Instant) {
        self.since.get_or_insert(start);
    }
}

/// A busy-poll registration with the transport, ended when dropped (also on unwinding).
struct BusyPoll<'a> {
    transport: &'a dyn Transport,
}

impl<'a> BusyPoll<'a> {
    fn new(transport: &'a dyn Transport) -> Self {
        transport.begin_busy_poll();
        BusyPoll { transport }
    }
}

impl Drop for BusyPoll<'_> {
    fn drop(&mut self) {
        self.transport.end_busy_poll();
    }
}

/// Keeps a rank alive while any of its communicators exists; the last one to go starts shutdown.
pub(crate) struct RankLife {
    pub(crate) driver: Arc<Driver>,
}

impl Drop for RankLife {
    fn drop(&mut self) {
        self.driver.begin_shutdown(std::thread::panicking());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spin_then_park(window: Duration) -> Config {
        Config {
            progress: ProgressPolicy::SpinThenPark,
            spin: Some(window),
            ..Config::default()
        }
    }

    #[test]
    fn the_spin_window_counts_from_the_last_traffic() {
        let config = spin_then_park(Duration::from_millis(200));
        let (mut quiet, mut busy) = (Wait::default(), Wait::default());
        assert!(quiet.should_spin(&config) && busy.should_spin(&config));
        // Each ends a first burst; the window counts from its start.
        let start = Instant::now();
        quiet.spinning_since(start);
        busy.spinning_since(start);
        std::thread::sleep(Duration::from_millis(250));
        // No traffic since the wait began: the window has passed.
        quiet.saw_traffic(0);
        assert!(!quiet.should_spin(&config));
        // Traffic moved meanwhile: the window starts again.
        busy.saw_traffic(7);
        assert!(busy.should_spin(&config));
        // The same count again is no news.
        std::thread::sleep(Duration::from_millis(250));
        busy.saw_traffic(7);
        assert!(!busy.should_spin(&config));
    }

    #[test]
    fn the_window_starts_with_the_first_burst_and_stays_put() {
        let config = spin_then_park(Duration::from_millis(200));
        let mut wait = Wait::default();
        // No burst has ended yet: spin, without reading the clock.
        std::thread::sleep(Duration::from_millis(250));
        assert!(wait.should_spin(&config));
        // The first burst began a while ago: the window has passed.
        wait.spinning_since(Instant::now() - Duration::from_millis(250));
        assert!(!wait.should_spin(&config));
        // A later burst does not move its start.
        wait.spinning_since(Instant::now());
        assert!(!wait.should_spin(&config));
    }

    #[test]
    fn traffic_before_the_first_spin_starts_no_window() {
        let config = spin_then_park(Duration::from_millis(200));
        let mut wait = Wait::default();
        wait.saw_traffic(3);
        assert_eq!(wait.since, None);
        assert!(wait.should_spin(&config));
    }
}

#[cfg(test)]
mod pump_tests {
    use std::collections::VecDeque;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::task::Wake;

    use super::*;
    use crate::transport::Capabilities;

    /// Hands over one frame per drain, as shared memory hands over one single-copy payload per
    /// read, and says whether more are there.
    #[derive(Default)]
    struct OneAtATime {
        queue: Mutex<VecDeque<Arrival>>,
    }

    impl OneAtATime {
        fn left(&self) -> usize {
            self.queue.lock().unwrap().len()
        }
    }

    impl Transport for OneAtATime {
        fn capabilities(&self) -> Capabilities {
            Capabilities {
                reliable: true,
                ordered: true,
                max_payload: usize::MAX,
                multicast: false,
                rdma: false,
                by_reference: false,
            }
        }
        fn send(&self, _to: u32, _frame: Frame) -> Result<(), TransportError> {
            Ok(())
        }
        fn drain(&self, out: &mut Vec<Arrival>) -> Result<usize, TransportError> {
            let next = self.queue.lock().unwrap().pop_front();
            Ok(next.map(|a| out.push(a)).map_or(0, |()| 1))
        }
        fn poll_arrival(&self, _cx: &mut Context<'_>) -> Poll<()> {
            Poll::Pending
        }
        fn may_have_arrivals(&self) -> bool {
            self.left() > 0
        }
    }

    #[derive(Default)]
    struct Flag(AtomicBool);

    impl Wake for Flag {
        fn wake(self: Arc<Self>) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    /// The progress task's pump stops once it finished an operation whose future is parked,
    /// so that future runs (and posts what it will post: the next window of sends) before the
    /// rank takes in the rest; a pump that finishes nothing parked takes in everything.
    #[test]
    fn a_pump_stops_once_it_finished_a_parked_operation() {
        let transport = Arc::new(OneAtATime::default());
        for seq in 0..3 {
            let envelope = Envelope {
                context: ContextId::WORLD,
                tag: 1,
                seq,
                len: 1,
            };
            let frame = Frame {
                header: Header::Eager(envelope),
                payload: Bytes::from_static(b"x"),
            };
            transport
                .queue
                .lock()
                .unwrap()
                .push_back(Arrival::Frame { from: 0, frame });
        }
        let driver = Driver::new(1, 2, transport.clone(), Config::default());
        let sel = Selector {
            context: ContextId::WORLD,
            source: Some(0),
            tag: Some(1),
        };
        let Some(RecvStart::Pending(id)) =
            Some(driver.with(|st| st.endpoint.start_recv(sel, None)))
        else {
            panic!("nothing was taken in yet");
        };
        let flag = Arc::new(Flag::default());
        driver.with(|st| st.park(Waiting::Recv(id), &Waker::from(flag.clone())));
        assert!(
            driver.progress(),
            "the receive finished and its future was woken"
        );
        assert!(flag.0.load(Ordering::SeqCst));
        assert_eq!(
            transport.left(),
            2,
            "what came behind it is still in the transport"
        );
        assert!(driver.lock().endpoint.take_recv(id).is_some());
        assert!(!driver.progress(), "nothing parked: nobody to wake");
        assert_eq!(transport.left(), 0, "so one pump takes in everything");
    }
}
