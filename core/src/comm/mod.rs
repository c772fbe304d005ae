//! [`Communicator`]: a group of ranks with its own communication context.

mod group;
mod ops;
mod split;

use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::config::Config;
use crate::error::{Error, TransportError};
use crate::matching::Selector;
use crate::multicast::{GroupId, MulticastGroup, MulticastSetup};
use crate::protocol::SendStart;
use crate::runtime::{Driver, RankLife, RecvNow, SendData};
use crate::stats::Stats;
use crate::transport::{PeerFlag, Transport};
use crate::types::{ContextId, MAX_TAG, Message, Payload, Source, Status, Tag};

pub(crate) use group::Group;
pub use ops::{ExchangeRecv, ProbeOp, RecvIntoOp, RecvOp, SendOp};

/// The highest collective tags are never sequence numbers (see
/// [`Communicator::next_collective`]): collective engines use them for their own packets.
pub const RESERVED_COLLECTIVE_TAGS: u64 = 16;

/// A group of ranks that exchange messages in a context of their own.
///
/// Cheap to clone (an `Arc` inside) and `Send + Sync`: clones may be moved to other tasks and
/// used concurrently. Messages sent on one communicator only ever match receives on the same
/// communicator; [`dup`](Self::dup) and [`split`](Self::split) make new ones.
///
/// # Operations start when called
///
/// [`send`](Self::send), [`recv`](Self::recv) and their relatives are ordinary functions, not
/// `async fn`s: the operation is registered with the rank's engine before the call returns,
/// and the returned future only waits for completion (MPI's `MPI_Isend` + `MPI_Wait`). So
///
/// ```ignore
/// let a = comm.send(1, 0, data);   // already on its way
/// let b = comm.recv(1, 0);         // already posted
/// let (sent, got) = tokio::join!(a, b);
/// ```
///
/// overlaps both, and a receive posted before the matching message arrives is matched in
/// posting order even if it is awaited later.
#[derive(Clone)]
pub struct Communicator {
    inner: Arc<CommInner>,
}

struct CommInner {
    driver: Arc<Driver>,
    life: Arc<RankLife>,
    context: ContextId,
    rank: usize,
    group: Group,
    /// Communicators created from this one so far (dup and split), numbering their contexts.
    children: AtomicU64,
    /// Collective operations started on this communicator so far, numbering their tags.
    collectives: AtomicU64,
    /// The job's multicast fabric, if multicast is on (every communicator of the rank shares it).
    multicast: Option<MulticastSetup>,
    /// This communicator's multicast group, joined when it was created.
    mcast_group: Option<Arc<dyn MulticastGroup>>,
    /// State that layers above keep per communicator (collective engines), one value per type.
    extensions: Mutex<Vec<Arc<dyn Any + Send + Sync>>>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank())
            .field("size", &self.size())
            .field("context", &self.inner.context)
            .finish()
    }
}

impl Communicator {
    /// The world communicator of rank `rank` of `size`, over `transport`.
    ///
    /// Starts the rank's progress task on the current tokio runtime ([`Error::NoRuntime`]
    /// outside one). Launch code calls this; applications get their communicator from
    /// `rankweave::init()` or `rankweave::local()`.
    pub fn world(
        rank: usize,
        size: usize,
        transport: Arc<dyn Transport>,
        config: Config,
    ) -> Result<Communicator, Error> {
        Communicator::world_with_multicast(rank, size, transport, config, None)
    }

    /// [`world`](Self::world) with a multicast fabric: this communicator and every one made
    /// from it join a multicast group of their own (see [`crate::multicast`]).
    pub fn world_with_multicast(
        rank: usize,
        size: usize,
        transport: Arc<dyn Transport>,
        config: Config,
        multicast: Option<MulticastSetup>,
    ) -> Result<Communicator, Error> {
        if rank >= size || size > u32::MAX as usize {
            return Err(Error::InvalidRank { rank, size });
        }
        let driver = Arc::new(Driver::new(rank as u32, size as u32, transport, config));
        driver.spawn_progress()?;
        let life = Arc::new(RankLife {
            driver: Arc::clone(&driver),
        });
        Ok(Communicator::from_parts(
            driver,
            life,
            ContextId::WORLD,
            rank,
            Group::World { size },
            multicast,
        ))
    }

    /// A communicator over `group` with context `context`; joins its multicast group when the
    /// job has a fabric. A group that cannot be joined leaves the communicator without one
    /// (broadcasts then use point-to-point algorithms), with a warning.
    fn from_parts(
        driver: Arc<Driver>,
        life: Arc<RankLife>,
        context: ContextId,
        rank: usize,
        group: Group,
        multicast: Option<MulticastSetup>,
    ) -> Communicator {
        let mcast_group = multicast.as_ref().and_then(|m| {
            let id = GroupId::derive(m.job_key, context);
            m.fabric
                .join(id)
                .inspect_err(|e| {
                    tracing::warn!(
                        ?context,
                        "cannot join this communicator's multicast group ({e}); its broadcasts use point-to-point"
                    );
                })
                .ok()
        });
        Communicator {
            inner: Arc::new(CommInner {
                driver,
                life,
                context,
                rank,
                group,
                children: AtomicU64::new(0),
                collectives: AtomicU64::new(0),
                multicast,
                mcast_group,
                extensions: Mutex::new(Vec::new()),
            }),
        }
    }

    /// This communicator's multicast group, if the job has a multicast fabric and the group
    /// could be joined.
    pub fn multicast_group(&self) -> Option<&Arc<dyn MulticastGroup>> {
        self.inner.mcast_group.as_ref()
    }

    /// The value of type `T` kept with this communicator (made by `init` on first use): how
    /// layers above, such as collective engines, keep state per communicator. It lives as
    /// long as this communicator (all its clones) does.
    pub fn extension<T: Any + Send + Sync>(&self, init: impl FnOnce(&Communicator) -> T) -> Arc<T> {
        let mut ext = self
            .inner
            .extensions
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(found) = ext.iter().find_map(|e| Arc::clone(e).downcast::<T>().ok()) {
            return found;
        }
        let made = Arc::new(init(self));
        ext.push(Arc::clone(&made) as Arc<dyn Any + Send + Sync>);
        made
    }

    /// The value of type `T` kept with this communicator, if one was made.
    pub fn existing_extension<T: Any + Send + Sync>(&self) -> Option<Arc<T>> {
        let ext = self
            .inner
            .extensions
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        ext.iter().find_map(|e| Arc::clone(e).downcast::<T>().ok())
    }

    /// The job's multicast fabric and key, if multicast is on.
    pub fn multicast_setup(&self) -> Option<&MulticastSetup> {
        self.inner.multicast.as_ref()
    }

    /// Another handle on this communicator (same context, group and multicast group) that
    /// keeps the rank alive but not this communicator's [`extension`](Self::extension)s: for
    /// the background task of an extension, which must not keep its own owner alive. Do not
    /// start collectives on it (it numbers them apart from this handle).
    pub fn detached(&self) -> Communicator {
        Communicator {
            inner: Arc::new(CommInner {
                driver: Arc::clone(&self.inner.driver),
                life: Arc::clone(&self.inner.life),
                context: self.inner.context,
                rank: self.inner.rank,
                group: self.inner.group.clone(),
                children: AtomicU64::new(0),
                collectives: AtomicU64::new(0),
                multicast: self.inner.multicast.clone(),
                mcast_group: self.inner.mcast_group.clone(),
                extensions: Mutex::new(Vec::new()),
            }),
        }
    }

    /// This rank's number in the communicator, `0..size()`.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Number of ranks in the communicator.
    pub fn size(&self) -> usize {
        self.inner.group.size()
    }

    /// This rank's number in the world (the job).
    pub fn world_rank(&self) -> usize {
        self.inner.driver.rank as usize
    }

    /// The point-to-point context id of this communicator.
    pub fn context(&self) -> ContextId {
        self.inner.context
    }

    /// The rank's configuration.
    pub fn config(&self) -> &Config {
        &self.inner.driver.config
    }

    /// The rank's traffic counters (shared by all communicators of the rank).
    pub fn stats(&self) -> Stats {
        self.inner.driver.stats()
    }

    /// Ends this rank, for every communicator of it, and waits until what it sent is
    /// delivered: sends already started complete, then the transport retransmits and
    /// acknowledges until its peers have everything (or its linger time is up).
    ///
    /// Dropping the last communicator of a rank starts the same shutdown without waiting for
    /// it, which is enough when the process (and its runtime) lives on; a process that is about
    /// to exit calls this first (`rankweave::finalize` does). Call it with no receive
    /// outstanding, having dropped the rank's other communicators: those still alive (and
    /// services finishing what they owe other ranks, such as the multicast broadcast engine)
    /// get up to [`Config::peer_timeout`] to go; then the rank ends regardless and operations
    /// started on them fail with [`Error::Shutdown`].
    pub async fn shutdown(self) {
        let driver = Arc::clone(&self.inner.driver);
        drop(self);
        driver.shut_down().await;
    }

    fn check_rank(&self, rank: usize) -> Result<u32, Error> {
        // `ok_or_else`: an `Error` built eagerly is dropped on every send and receive.
        self.inner
            .group
            .world_of(rank)
            .ok_or_else(|| Error::InvalidRank {
                rank,
                size: self.size(),
            })
    }

    fn check_tag(tag: u32) -> Result<u32, Error> {
        if tag > MAX_TAG {
            return Err(Error::InvalidTag { tag, max: MAX_TAG });
        }
        Ok(tag)
    }

    /// A selector on `context`. User tags are checked against [`MAX_TAG`]; collective traffic
    /// (`user == false`) uses the whole tag range.
    fn selector_on(
        &self,
        context: ContextId,
        source: Source,
        tag: Tag,
        user: bool,
    ) -> Result<Selector, Error> {
        Ok(Selector {
            context,
            source: match source {
                Source::Rank(r) => Some(self.check_rank(r)?),
                Source::Any => None,
            },
            tag: match tag {
                Tag::Value(t) if user => Some(Self::check_tag(t)?),
                Tag::Value(t) => Some(t),
                Tag::Any => None,
            },
        })
    }

    fn selector(&self, context: ContextId, source: Source, tag: Tag) -> Result<Selector, Error> {
        self.selector_on(context, source, tag, true)
    }

    /// Translates an error that names a world rank into this communicator's numbering.
    fn local_error(&self, e: Error) -> Error {
        match e {
            Error::PeerFailed { rank } => Error::PeerFailed {
                rank: self.inner.group.local_of(rank as u32).unwrap_or(rank),
            },
            Error::Truncated {
                len,
                capacity,
                from,
                tag,
            } => Error::Truncated {
                len,
                capacity,
                from: self.inner.group.local_of(from as u32).unwrap_or(from),
                tag,
            },
            other => other,
        }
    }

    /// Sends `payload` to rank `dst` with `tag`.
    ///
    /// The send starts now; the future resolves when the payload has been handed off (at once
    /// for eager messages; after the receiver matched it for rendezvous ones). Dropping the
    /// future does **not** cancel the send: it completes in the background.
    ///
    /// A borrowed slice (`&buf[..]`) is copied straight into the transport when the send goes
    /// out at once, with no buffer of its own (see [`Payload`]).
    pub fn send(&self, dst: usize, tag: u32, payload: impl Payload) -> SendOp {
        if let Some(bytes) = payload.borrowed() {
            let parts = [bytes];
            return self.send_on(self.inner.context, dst, tag, SendData::Parts(&parts), true);
        }
        let data = SendData::Bytes(payload.into_bytes());
        self.send_on(self.inner.context, dst, tag, data, true)
    }

    fn send_on(
        &self,
        context: ContextId,
        dst: usize,
        tag: u32,
        data: SendData<'_>,
        user: bool,
    ) -> SendOp {
        let start = (|| {
            let to = self.check_rank(dst)?;
            let tag = if user { Self::check_tag(tag)? } else { tag };
            self.inner.driver.post_send(to, context, tag, data)
        })();
        match start {
            Ok(SendStart::Complete) => SendOp::done(Ok(())),
            Ok(SendStart::Pending(id)) => SendOp::pending(self.clone(), id),
            Err(e) => SendOp::done(Err(self.local_error(e))),
        }
    }

    /// Receives a message matching `source` and `tag` (`Source::Any` / `Tag::Any` are wildcards;
    /// plain `usize` / `u32` values convert).
    ///
    /// The receive is posted now; the future resolves with the message. Dropping the future
    /// before it matched withdraws the receive; dropping it after it matched puts the message
    /// back where it was, so nothing is lost.
    pub fn recv(&self, source: impl Into<Source>, tag: impl Into<Tag>) -> RecvOp {
        self.recv_on(self.inner.context, source.into(), tag.into(), true)
    }

    fn recv_on(&self, context: ContextId, source: Source, tag: Tag, user: bool) -> RecvOp {
        let sel = self.selector_on(context, source, tag, user);
        match sel {
            Ok(sel) => {
                let start = self
                    .inner
                    .driver
                    .with(|st| st.endpoint.start_recv(sel, None));
                RecvOp::started(self.clone(), start)
            }
            Err(e) => RecvOp::failed(self.clone(), e),
        }
    }

    /// Receives into `buf`, returning the message's [`Status`].
    ///
    /// A message longer than `buf` fails with [`Error::Truncated`] and is not consumed: it stays
    /// first in line for the next matching receive. Posted now, like [`recv`](Self::recv).
    ///
    /// The message is copied once, into `buf`: over shared memory a small one straight from
    /// the ring, a large one straight from the sender's memory (single copy), when this
    /// receive is the one waiting for that sender's next message; otherwise from the buffer
    /// it was received into.
    pub fn recv_into<'a, T: bytemuck::Pod>(
        &'a self,
        source: impl Into<Source>,
        tag: impl Into<Tag>,
        buf: &'a mut [T],
    ) -> RecvIntoOp<'a> {
        let bytes: &'a mut [u8] = bytemuck::cast_slice_mut(buf);
        match self.selector(self.inner.context, source.into(), tag.into()) {
            Ok(sel) => {
                let cap = bytes.len();
                let start = self
                    .inner
                    .driver
                    .with(|st| st.endpoint.start_recv(sel, Some(cap)));
                RecvIntoOp::started(self, start, bytes)
            }
            Err(e) => RecvIntoOp::failed(self, e, bytes),
        }
    }

    /// Sends to `dst` and receives from `source` at the same time (both start now), like
    /// `MPI_Sendrecv`. Safe against the deadlock of two blocking sends facing each other.
    pub fn sendrecv(
        &self,
        dst: usize,
        send_tag: u32,
        payload: impl Payload,
        source: impl Into<Source>,
        recv_tag: impl Into<Tag>,
    ) -> impl Future<Output = Result<Message, Error>> + Send + 'static {
        // Check the send's arguments first, so a bad destination never leaves a receive posted
        // that could swallow a message.
        let ops = self
            .check_rank(dst)
            .and_then(|_| Self::check_tag(send_tag))
            .map(|_| {
                let recv = self.recv(source, recv_tag);
                (recv, self.send(dst, send_tag, payload))
            });
        async move {
            let (recv, send) = ops?;
            // Both are under way; a failed send drops (withdraws) the receive.
            send.await?;
            recv.await
        }
    }

    /// Waits until a message matching `source` and `tag` is available and returns its status
    /// without receiving it.
    pub fn probe(&self, source: impl Into<Source>, tag: impl Into<Tag>) -> ProbeOp {
        let sel = self.selector(self.inner.context, source.into(), tag.into());
        ProbeOp::new(self.clone(), sel)
    }

    /// The status of a message matching `source` and `tag` if one is available now.
    pub fn iprobe(
        &self,
        source: impl Into<Source>,
        tag: impl Into<Tag>,
    ) -> Result<Option<Status>, Error> {
        let sel = self.selector(self.inner.context, source.into(), tag.into())?;
        let found = self.inner.driver.with_pumped(|st| st.endpoint.probe(&sel));
        Ok(found.map(|(src, tag, len)| self.status(src, tag, len)))
    }

    /// A received message in this communicator's numbering.
    fn message(&self, m: crate::protocol::Received) -> Message {
        Message {
            source: self
                .inner
                .group
                .local_of(m.source)
                .unwrap_or(m.source as usize),
            tag: m.tag,
            data: m.data,
        }
    }

    fn status(&self, world_source: u32, tag: u32, len: usize) -> Status {
        Status {
            source: self
                .inner
                .group
                .local_of(world_source)
                .unwrap_or(world_source as usize),
            tag,
            len,
        }
    }

    /// A new communicator with the same ranks and a fresh context: traffic on one never matches
    /// receives on the other. Every rank must call `dup` (and `split`) in the same order.
    pub async fn dup(&self) -> Result<Communicator, Error> {
        let n = self.inner.children.fetch_add(1, Ordering::Relaxed);
        let context = self.inner.context.derive(n, u64::MAX);
        Ok(Communicator::from_parts(
            Arc::clone(&self.inner.driver),
            Arc::clone(&self.inner.life),
            context,
            self.inner.rank,
            self.inner.group.clone(),
            self.inner.multicast.clone(),
        ))
    }

    /// Splits the ranks by `color`: ranks giving the same color form a new communicator, ordered
    /// by `key` (ties by their rank here). A rank giving `None` (MPI's `MPI_UNDEFINED`) takes
    /// part but gets `None` back. Every rank of this communicator must call it.
    pub async fn split(&self, color: Option<u32>, key: i32) -> Result<Option<Communicator>, Error> {
        use tracing::Instrument;
        let span = tracing::debug_span!("split", rank = self.inner.rank, ?color, key);
        split::split(self, color, key).instrument(span).await
    }

    /// Reserves the next collective sequence number of this communicator. Every rank must start
    /// collectives in the same order, so the n-th collective gets number n everywhere; its
    /// messages use that number (modulo 2³² − 16) as their tag on the collective context; the
    /// top [`RESERVED_COLLECTIVE_TAGS`] tags stay free for collective engines.
    pub fn next_collective(&self) -> u32 {
        self.next_collective_numbered().1
    }

    /// [`next_collective`](Self::next_collective), with the collective's whole sequence number
    /// (from 0; it does not wrap) beside its tag.
    pub fn next_collective_numbered(&self) -> (u64, u32) {
        let n = self.inner.collectives.fetch_add(1, Ordering::Relaxed);
        (
            n,
            (n % (u64::from(u32::MAX) - RESERVED_COLLECTIVE_TAGS + 1)) as u32,
        )
    }

    /// Sends on this communicator's collective context, which user receives never match. For
    /// collective algorithms; `tag` is usually from [`next_collective`](Self::next_collective).
    pub fn collective_send(&self, dst: usize, tag: u32, payload: impl Payload) -> SendOp {
        let data = SendData::Bytes(payload.into_bytes());
        self.send_on(self.inner.context.collective(), dst, tag, data, false)
    }

    /// [`collective_send`](Self::collective_send) of the concatenation of `parts`: copied
    /// straight into the transport when the message goes out at once (a small message to a
    /// shared-memory peer), into a buffer of its own otherwise.
    pub fn collective_send_parts(&self, dst: usize, tag: u32, parts: &[&[u8]]) -> SendOp {
        let data = SendData::Parts(parts);
        self.send_on(self.inner.context.collective(), dst, tag, data, false)
    }

    /// [`collective_send_parts`](Self::collective_send_parts) to `dst` and
    /// [`collective_recv`](Self::collective_recv) from `src`, started together: a two-rank
    /// collective's one exchange. The receive comes back [`ExchangeRecv::Ready`] when its
    /// message was already here (the other rank was ahead): then no receive future is made at
    /// all, which is most of what such a collective would otherwise cost.
    pub fn collective_exchange(
        &self,
        dst: usize,
        tag: u32,
        parts: &[&[u8]],
        src: usize,
    ) -> (SendOp, ExchangeRecv) {
        let context = self.inner.context.collective();
        let (to, sel) = match (
            self.check_rank(dst),
            self.selector_on(context, Source::Rank(src), Tag::Value(tag), false),
        ) {
            (Ok(to), Ok(sel)) => (to, sel),
            (Err(e), _) | (_, Err(e)) => {
                return (SendOp::done(Err(e.clone())), ExchangeRecv::Ready(Err(e)));
            }
        };
        let (sent, received) =
            self.inner
                .driver
                .exchange(to, context, tag, SendData::Parts(parts), sel);
        let sent = match sent {
            Ok(SendStart::Complete) => SendOp::done(Ok(())),
            Ok(SendStart::Pending(id)) => SendOp::pending(self.clone(), id),
            Err(e) => SendOp::done(Err(self.local_error(e))),
        };
        let received = match received {
            RecvNow::Done(r) => {
                ExchangeRecv::Ready(r.map(|m| self.message(m)).map_err(|e| self.local_error(e)))
            }
            RecvNow::Pending(id) => ExchangeRecv::Waiting(RecvOp::pending(self.clone(), id)),
        };
        (sent, received)
    }

    /// Whether this rank may read `rank`'s memory directly
    /// ([`read_memory_of`](Self::read_memory_of)): a rank on this host, over shared memory,
    /// whose process the kernel lets this one inspect. For collective engines.
    pub fn can_read_memory_of(&self, rank: usize) -> bool {
        self.check_rank(rank)
            .is_ok_and(|to| self.inner.driver.can_read_peer_memory(to))
    }

    /// Copies `dst.len()` bytes at address `addr` of `rank`'s process into `dst`, `rank` not
    /// taking part (one-sided). For collective engines, which agree with `rank` by messages
    /// where the bytes are and until when they stay unchanged. A rank that is gone gives
    /// [`Error::PeerFailed`].
    pub fn read_memory_of(&self, rank: usize, addr: u64, dst: &mut [u8]) -> Result<(), Error> {
        // SAFETY: `MaybeUninit<u8>` has the layout of `u8`, and the read only writes whole
        // bytes into the slice, so it stays initialized.
        let dst = unsafe { &mut *(std::ptr::from_mut(dst) as *mut [std::mem::MaybeUninit<u8>]) };
        self.read_memory_of_uninit(rank, addr, dst)
    }

    /// [`read_memory_of`](Self::read_memory_of) into memory that may be uninitialized (a
    /// vector's spare capacity): on success every byte of `dst` has been written.
    pub fn read_memory_of_uninit(
        &self,
        rank: usize,
        addr: u64,
        dst: &mut [std::mem::MaybeUninit<u8>],
    ) -> Result<(), Error> {
        let from = self.check_rank(rank)?;
        self.inner
            .driver
            .read_peer_memory(from, addr, dst)
            .map_err(|e| self.peer_error(rank, e))
    }

    /// This rank's [arena](crate::arena), if its transport has one and nobody holds it (see
    /// [`Transport::lease_arena`]). One per rank, shared by every communicator. For collective
    /// engines.
    pub fn lease_arena(&self) -> Option<crate::ArenaLease> {
        self.inner.driver.lease_arena()
    }

    /// `rank`'s [arena](crate::arena) as mapped in this process, if it is on this host over
    /// shared memory and not gone (see [`Transport::peer_arena`]). For collective engines.
    pub fn peer_arena(&self, rank: usize) -> Option<crate::PeerArena> {
        let peer = self.check_rank(rank).ok()?;
        self.inner.driver.peer_arena(peer)
    }

    /// Whether this rank shares flags with `rank` ([`raise_flag`](Self::raise_flag)): a rank
    /// on this host, over shared memory. For collective engines.
    pub fn has_flags_with(&self, rank: usize) -> bool {
        self.check_rank(rank)
            .is_ok_and(|to| self.inner.driver.has_flags_with(to))
    }

    /// Sets the flag this rank raises to `rank` to `value` (see
    /// [`Transport::raise_flag`]): one word per ordered pair of
    /// local ranks, shared by every communicator, so only the world communicator's barrier
    /// uses it. A rank that is gone gives [`Error::PeerFailed`].
    pub fn raise_flag(&self, rank: usize, value: u64) -> Result<(), Error> {
        let to = self.check_rank(rank)?;
        self.inner
            .driver
            .raise_flag(to, value)
            .map_err(|e| self.peer_error(rank, e))
    }

    /// The flag `rank` raised to this rank, and whether `rank` is gone (see
    /// [`raise_flag`](Self::raise_flag)).
    pub fn flag_from(&self, rank: usize) -> Result<PeerFlag, Error> {
        let from = self.check_rank(rank)?;
        self.inner
            .driver
            .read_flag(from)
            .map_err(|e| self.peer_error(rank, e))
    }

    /// Waits until `look` (which reads flags: [`flag_from`](Self::flag_from)) answers, with
    /// the rank's progress policy, as a receive waits: busy-polling in short bursts for the
    /// spin window, taking in what arrives for the rank meanwhile, then parked until a flag
    /// raised to this rank changes or a peer is found gone. For collective engines.
    pub fn wait_on_flags<'a, T>(
        &'a self,
        mut look: impl FnMut() -> Option<T> + 'a,
    ) -> impl Future<Output = T> + 'a {
        let mut wait = crate::runtime::Wait::default();
        std::future::poll_fn(move |cx| self.inner.driver.poll_flags(cx, &mut wait, &mut look))
    }

    /// A one-sided operation's failure: a peer unreachable is a peer failed.
    fn peer_error(&self, rank: usize, e: TransportError) -> Error {
        match e {
            TransportError::PeerUnreachable(_) => Error::PeerFailed { rank },
            e => Error::Transport(e),
        }
    }

    /// Receives on this communicator's collective context (see
    /// [`collective_send`](Self::collective_send)).
    pub fn collective_recv(&self, source: impl Into<Source>, tag: u32) -> RecvOp {
        self.recv_on(
            self.inner.context.collective(),
            source.into(),
            Tag::Value(tag),
            false,
        )
    }
}
