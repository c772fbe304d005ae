//! [`Engine`]: the tokio driver of a multicast broadcast machine, one per communicator and rank.
//!
//! The machine sits in a mutex shared by the callers of `broadcast` (who start broadcasts and
//! send their first datagrams at once, from their own thread) and a background task that plays
//! the NIC: it drains the multicast group, keeps a point-to-point receive posted for every rank
//! the machine hears from, fires the machine's timers, watches the sends it started, and hands
//! each completed broadcast to its waiting caller. So broadcasts progress — fragments are
//! forwarded, NACKs answered, channels synchronised — whether or not anyone awaits them. A
//! caller waiting for its broadcast busy-polls the group itself while the progress policy lets
//! it spin, so the common case (everything arrives by multicast) costs no task wake-up. The
//! engine's own point-to-point operations never spin: it is a background service.
//!
//! The engine lives in the communicator (an [extension](rankweave_core::Communicator::extension));
//! its task holds a [detached](rankweave_core::Communicator::detached) handle, so it keeps the
//! rank alive but not the communicator. When the communicator is dropped the task tells the
//! machine, keeps serving until the machine owes the other ranks nothing, and ends. A failed
//! peer (a receive or send ending in an error) fails every outstanding broadcast with that
//! error, and every later one.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rankweave_core::{Communicator, Error, MulticastGroup, ProgressPolicy, RecvOp, SendOp, Source};
use tokio::sync::oneshot;

use super::channels::Channels;
use super::two_stage::TwoStage;
use super::wire::{Algorithm, Keys};
use super::{BcastStats, Event, PACKET_TAG, Protocol, Settings, Transmit};

/// Datagrams taken from the group per look.
const DRAIN_BATCH: usize = 64;

/// A communicator's multicast broadcast engine (see the [module docs](self)).
pub(crate) struct Engine {
    shared: Arc<Shared>,
}

struct Shared {
    /// A detached handle: the engine's sends and receives.
    comm: Communicator,
    group: Option<Arc<dyn MulticastGroup>>,
    /// Ranks the machine hears from over point-to-point.
    listens_to: Vec<usize>,
    state: Mutex<State>,
    /// The background task, to wake when a caller changed something it must look at.
    task: Mutex<Option<Waker>>,
    owner_gone: AtomicBool,
}

struct State {
    machine: Box<dyn Protocol>,
    next_bid: u64,
    waiters: HashMap<u64, oneshot::Sender<Result<Bytes, Error>>>,
    sends: Vec<SendOp>,
    failed: Option<Error>,
}

impl Engine {
    /// The engine of `comm` running `algorithm`; spawns its task on the current runtime.
    pub fn new(comm: &Communicator, algorithm: Algorithm) -> Engine {
        let config = comm.config();
        let group = comm.multicast_group().cloned();
        let max_datagram = group.as_ref().map_or(64 * 1024, |g| g.max_datagram());
        let settings = Settings::from_config(&config.multicast, max_datagram);
        let keys = Keys {
            job_key: comm.multicast_setup().map_or(0, |m| m.job_key),
            context: comm.context().0,
        };
        let (rank, size) = (comm.rank(), comm.size());
        let (machine, listens_to): (Box<dyn Protocol>, Vec<usize>) = match algorithm {
            Algorithm::TwoStage => {
                let listens = if settings.sync {
                    (0..size).filter(|&r| r != rank).collect()
                } else {
                    vec![(rank + size - 1) % size]
                };
                (Box::new(TwoStage::new(rank, size, keys, settings)), listens)
            }
            Algorithm::Channels => (
                Box::new(Channels::new(rank, size, keys, settings)),
                (0..size).filter(|&r| r != rank).collect(),
            ),
        };
        let shared = Arc::new(Shared {
            comm: comm.detached(),
            group,
            listens_to,
            state: Mutex::new(State {
                machine,
                next_bid: 0,
                waiters: HashMap::new(),
                sends: Vec::new(),
                failed: None,
            }),
            task: Mutex::new(None),
            owner_gone: AtomicBool::new(false),
        });
        let task = EngineTask {
            recvs: shared.listens_to.iter().map(|_| None).collect(),
            shared: Arc::clone(&shared),
            sleep: None,
            told_gone: false,
            departed: HashMap::new(),
        };
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                handle.spawn(task);
            }
            Err(_) => shared.lock().failed = Some(Error::NoRuntime),
        }
        Engine { shared }
    }

    /// Starts the next broadcast of this communicator (from `root`, with `data` at the root);
    /// resolves to the broadcast's bytes once this rank has them all.
    pub fn broadcast(
        &self,
        root: usize,
        data: Option<Bytes>,
    ) -> impl Future<Output = Result<Bytes, Error>> + Send + 'static + use<> {
        let (tx, rx) = oneshot::channel();
        {
            let mut st = self.shared.lock();
            if let Some(e) = &st.failed {
                let _ = tx.send(Err(e.clone()));
            } else {
                let bid = st.next_bid;
                st.next_bid += 1;
                st.waiters.insert(bid, tx);
                st.machine.start(Instant::now(), bid, root, data);
                self.shared.flush(&mut st);
            }
        }
        self.shared.wake_task();
        BcastWait {
            shared: Arc::clone(&self.shared),
            rx,
            since: None,
        }
    }

    /// The machine's counters with the group's.
    pub fn stats(&self) -> BcastStats {
        let mut stats = self.shared.lock().machine.stats();
        if let Some(g) = &self.shared.group {
            stats.group = g.stats();
        }
        stats
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shared.owner_gone.store(true, Ordering::Release);
        self.shared.wake_task();
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wake_task(&self) {
        let waker = self.task.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// Carries out what the machine wants sent and hands completed broadcasts over.
    fn flush(&self, st: &mut State) {
        while let Some(t) = st.machine.poll_transmit() {
            match t {
                Transmit::Multicast(datagram) => {
                    if let Some(g) = &self.group {
                        // A send error is a lost datagram; the repair paths cover it.
                        if let Err(e) = g.send(&datagram) {
                            tracing::debug!(error = %e, "multicast send failed");
                        }
                    }
                }
                Transmit::Send { to, packet } => {
                    st.sends.push(
                        self.comm
                            .collective_send(to, PACKET_TAG, packet)
                            .without_spinning(),
                    );
                }
            }
        }
        while let Some(Event::Complete { bid, data }) = st.machine.poll_event() {
            if let Some(tx) = st.waiters.remove(&bid) {
                let _ = tx.send(Ok(data));
            }
        }
    }

    /// Takes what the multicast group holds and runs it through the machine, from a caller's
    /// thread; `true` if anything came. Skipped while the engine task holds the machine.
    fn poll_group_inline(&self) -> bool {
        let Some(g) = &self.group else { return false };
        let mut st = match self.state.try_lock() {
            Ok(st) => st,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return false,
        };
        let mut datagrams = Vec::new();
        if !matches!(g.drain(&mut datagrams, DRAIN_BATCH), Ok(n) if n > 0) {
            return false;
        }
        let now = Instant::now();
        for d in &datagrams {
            st.machine.handle_datagram(now, d);
        }
        self.flush(&mut st);
        // Sends to watch and timers to arm are the task's.
        let task_has_work = !st.sends.is_empty() || st.machine.poll_timeout().is_some();
        drop(st);
        if task_has_work {
            self.wake_task();
        }
        true
    }

    /// Fails every outstanding and later broadcast with `error`.
    fn fail(&self, st: &mut State, error: Error) {
        tracing::debug!(%error, "multicast broadcast engine failed");
        for (_, tx) in st.waiters.drain() {
            let _ = tx.send(Err(error.clone()));
        }
        st.failed.get_or_insert(error);
    }
}

/// How long a waiting caller looks at the group before yielding to the scheduler (each look
/// is one `recvmsg`).
const SPIN_BURST: Duration = Duration::from_micros(20);

/// A caller's wait for one broadcast. It takes the engine's answer; while the progress policy
/// lets it spin, it also looks at the multicast group itself, so a datagram is handled the
/// moment it lands rather than after the engine task's wake-up (an epoll round and, on an idle
/// worker, a thread wake-up: tens of microseconds here).
struct BcastWait {
    shared: Arc<Shared>,
    rx: oneshot::Receiver<Result<Bytes, Error>>,
    /// When this wait started spinning.
    since: Option<Instant>,
}

impl BcastWait {
    fn should_spin(&mut self) -> bool {
        let config = self.shared.comm.config();
        self.shared.group.is_some()
            && match config.progress {
                ProgressPolicy::Park => false,
                ProgressPolicy::Spin => true,
                ProgressPolicy::SpinThenPark => {
                    self.since.get_or_insert_with(Instant::now).elapsed() < config.spin_window()
                }
            }
    }
}

impl Future for BcastWait {
    type Output = Result<Bytes, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if let Poll::Ready(r) = Pin::new(&mut this.rx).poll(cx) {
            return Poll::Ready(r.unwrap_or(Err(Error::Shutdown)));
        }
        if !this.should_spin() {
            return Poll::Pending;
        }
        let give_way = this.shared.comm.config().spin_yield == Some(true);
        let burst = Instant::now();
        loop {
            if this.shared.poll_group_inline() {
                match this.rx.try_recv() {
                    Ok(r) => return Poll::Ready(r),
                    Err(oneshot::error::TryRecvError::Closed) => {
                        return Poll::Ready(Err(Error::Shutdown));
                    }
                    Err(oneshot::error::TryRecvError::Empty) => {}
                }
            }
            if burst.elapsed() >= SPIN_BURST {
                break;
            }
            if give_way {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        // Come straight back after the scheduler's other tasks (no wake-up needed).
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

/// The background task (see the [module docs](self)).
struct EngineTask {
    shared: Arc<Shared>,
    /// One posted receive per rank in `listens_to`, when the machine wants packets.
    recvs: Vec<Option<RecvOp>>,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    told_gone: bool,
    /// Peers whose receive failed while nothing was expected from them (they finished and
    /// left): a failure only if the machine comes to expect something from one.
    departed: HashMap<usize, Error>,
}

impl EngineTask {
    /// One pass over every source of work; `Ok(true)` if anything happened.
    fn pass(&mut self, cx: &mut Context<'_>, st: &mut State) -> Result<bool, Error> {
        let shared = &*self.shared;
        let now = Instant::now();
        let mut busy = false;
        if let Some(g) = &shared.group {
            let mut datagrams = Vec::new();
            while g.poll_readable(cx).is_ready() {
                datagrams.clear();
                match g.drain(&mut datagrams, DRAIN_BATCH) {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(e) => {
                        tracing::debug!(error = %e, "multicast receive failed");
                        break;
                    }
                }
                for d in &datagrams {
                    st.machine.handle_datagram(now, d);
                }
                busy = true;
            }
        }
        for (src, e) in &self.departed {
            if st.machine.expects_from(*src) {
                return Err(e.clone());
            }
        }
        for (slot, &src) in self.recvs.iter_mut().zip(&shared.listens_to) {
            loop {
                if slot.is_none() {
                    if !st.machine.wants_packets() || self.departed.contains_key(&src) {
                        break;
                    }
                    // Parked, not spinning: one spinning receive per listened rank would
                    // cost a spin burst per rank on every pass of this background task.
                    *slot = Some(
                        shared
                            .comm
                            .collective_recv(Source::Rank(src), PACKET_TAG)
                            .without_spinning(),
                    );
                }
                let Some(op) = slot.as_mut() else { break };
                match Pin::new(op).poll(cx) {
                    Poll::Pending => break,
                    Poll::Ready(Ok(message)) => {
                        *slot = None;
                        st.machine.handle_packet(now, src, message.data());
                        busy = true;
                    }
                    Poll::Ready(Err(e)) => {
                        *slot = None;
                        // Nothing more will come from `src`: a failure only if the machine
                        // needs something from it, now or once it moves on.
                        if st.machine.expects_from(src) {
                            return Err(e);
                        }
                        self.departed.insert(src, e);
                        break;
                    }
                }
            }
        }
        let mut failed = None;
        st.sends.retain_mut(|op| match Pin::new(op).poll(cx) {
            Poll::Pending => true,
            Poll::Ready(Ok(())) => false,
            Poll::Ready(Err(e)) => {
                failed.get_or_insert(e);
                false
            }
        });
        if let Some(e) = failed {
            return Err(e);
        }
        match st.machine.poll_timeout() {
            Some(at) if at <= now => {
                st.machine.handle_timeout(now);
                busy = true;
            }
            Some(at) => {
                let at = tokio::time::Instant::from_std(at);
                let sleep = self
                    .sleep
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at)));
                if sleep.deadline() != at {
                    sleep.as_mut().reset(at);
                }
                if sleep.as_mut().poll(cx).is_ready() {
                    busy = true;
                }
            }
            None => self.sleep = None,
        }
        shared.flush(st);
        Ok(busy)
    }
}

impl Future for EngineTask {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        let shared = Arc::clone(&this.shared);
        *shared.task.lock().unwrap_or_else(|p| p.into_inner()) = Some(cx.waker().clone());
        let mut st = shared.lock();
        loop {
            if st.failed.is_some() {
                return Poll::Ready(());
            }
            if shared.owner_gone.load(Ordering::Acquire) && !this.told_gone {
                this.told_gone = true;
                st.machine.owner_gone(Instant::now());
                shared.flush(&mut st);
            }
            match this.pass(cx, &mut st) {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => {
                    shared.fail(&mut st, e);
                    return Poll::Ready(());
                }
            }
        }
        if this.told_gone && st.machine.owes_nothing() && st.sends.is_empty() {
            return Poll::Ready(());
        }
        Poll::Pending
    }
}
