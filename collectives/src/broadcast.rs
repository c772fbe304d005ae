//! Broadcast: the root's bytes to every rank, and the binomial tree the rooted collectives share.
//!
//! Only the root knows the data and its length, so the root alone picks the algorithm (the
//! `bcast` override; else binomial on fewer than `bcast_min_ranks` ranks (8; always on 2) or
//! below `bcast_large` bytes, scatter + allgather below `bcast_chain`, chain above) and tells
//! the others. Every non-root first receives one message starting with a header. A binomial
//! broadcast whose data follows the header in the same message has a one-byte header, 3, and
//! its length is the rest of the message: a small broadcast's message then fits the first cache
//! line of a shared-memory record (an 8-byte broadcast behind a 16-byte header did not, and a
//! second line costs as much as the first). Otherwise the header has 16 bytes: byte 0 the
//! algorithm (0 binomial, 1 scatter + allgather, 2 chain), byte 1 where a binomial broadcast's
//! data is (1: in a message of its own down the tree, 2: in a message of its own straight from
//! the root; 0 for the other algorithms), bytes 2..8 zero, bytes 8..16 the total length (u64
//! LE). On up to `flat_max` ranks (7) that message comes from the root itself, which sends
//! it to every rank (a *flat* fan-out: one hop, no rank waits for another to forward); on more
//! it comes from the rank's binomial-tree parent, and each rank forwards it unchanged to its own
//! children, so ranks never disagree.
//!
//! - **Binomial tree**: ⌈log₂ n⌉ rounds of the whole message (one round when flat). Below
//!   [`SEPARATE_FROM`] bytes the data follows the header in the same message (one message per
//!   edge); from there it is a second message, the caller's `Bytes` sent as they are: copying a
//!   large payload behind a header would cost more than the extra small message (and a
//!   rendezvous send reads it in place). When flat, that message too comes from the root below
//!   [`FLAT_BODY_BELOW`] bytes, and goes down the tree from there (where the root's sending it
//!   n − 1 times would cost more than the tree's extra rounds). Best when latency dominates.
//! - **Scatter + allgather** (van de Geijn): the message is cut into n nearly equal blocks by
//!   relative rank, scattered down the binomial tree (each subtree gets its contiguous range),
//!   then a ring allgather gives every rank every block: about twice the message per rank
//!   whatever n.
//! - **Chain**: segments of `segment` bytes flow root → root+1 → … → root+n−1, each rank
//!   forwarding a segment as soon as it has it, several in flight: each link carries the message
//!   once. Best for very large messages.

use std::collections::VecDeque;
use std::future::Future;
use std::ops::Range;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use bytes::{Buf, Bytes};
use rankweave_core::buffer_pool::BufferPool;
use rankweave_core::tuning::BcastAlgorithm;
use rankweave_core::{Communicator, Error, SendOp, byte_copy};

use crate::CollectiveOp;
use crate::ctx::{Ctx, await_all, keep_pending};
use crate::tree::BinomialTree;

/// Bytes of a full header.
const HEADER_LEN: usize = 16;
/// Byte 0 (and the whole header) of a binomial broadcast whose data follows in the same
/// message.
const COMPACT: u8 = 3;
/// Longest broadcast a header may announce (1 TiB); more is a corrupt header.
const MAX_LEN: u64 = 1 << 40;
/// From this many bytes a binomial broadcast sends its data apart from the header.
pub const SEPARATE_FROM: usize = 16 * 1024;
/// Below this many bytes a flat broadcast's data apart from the header comes from the root too
/// (4 ranks on 2 cores, interleaved: 0.35-0.5x the tree's time at 16 to 64 KiB, even at
/// 128 KiB, 1.25-1.3x from 256 KiB).
pub const FLAT_BODY_BELOW: usize = 128 * 1024;
/// Segments of the chain a rank keeps in flight (sends, and receives posted ahead).
const CHAIN_WINDOW: usize = 4;

pub(crate) async fn run(cx: Ctx, root: usize, data: Bytes) -> Result<Bytes, Error> {
    if cx.size == 1 {
        return Ok(data);
    }
    let tree = BinomialTree::new(&cx, root);
    let fan = Fanout::of(&cx, &tree);
    // The root knows its header; the others read it from the message that reaches them first.
    let (mut message, data, known) = match fan.from {
        None => {
            let header = Header::new(choose(&cx, data.len()), data.len(), fan.flat);
            (header.message(&data), Some(data), Some(header))
        }
        Some(from) => (cx.recv(from).await?, None, None),
    };
    // Forwarded before it is decoded: a malformed header fails every rank below too, instead
    // of leaving them waiting for a message that would never come.
    let mut sends = send_down(&cx, fan.to(&tree), &mut message, known.is_some());
    let header = known.map_or_else(|| Header::decode(fan.from.unwrap_or(root), &message), Ok);
    let header = match header {
        Ok(header) => header,
        Err(e) => {
            await_all(sends).await?;
            return Err(e);
        }
    };
    let result = deliver(&cx, &tree, root, header, message, data, &mut sends).await;
    await_all(sends).await?;
    result
}

/// What a rank does once it knows the `header` (from `message`, or at the root its own, with
/// its `data`): receives and forwards the data as the algorithm says; sends still pending go
/// to `sends`.
async fn deliver(
    cx: &Ctx,
    tree: &BinomialTree,
    root: usize,
    header: Header,
    mut message: Bytes,
    data: Option<Bytes>,
    sends: &mut Vec<SendOp>,
) -> Result<Bytes, Error> {
    let len = header.len;
    match header.algorithm {
        BcastAlgorithm::Binomial if header.separate => {
            // Down the tree, or straight from the root (`Fanout::flat` with every rank a child
            // of the root).
            let body_fan = if header.from_root {
                Fanout::flat(tree)
            } else {
                Fanout::tree(tree)
            };
            let body = match (data, body_fan.from) {
                (Some(data), _) => Ok(data),
                (None, Some(parent)) => cx.recv(parent).await,
                // Cannot happen: the root has the data, every other rank a parent.
                (None, None) => Err(Error::Protocol {
                    peer: root,
                    detail: "broadcast: a rank with neither the data nor a parent".into(),
                }),
            };
            // After the header on each edge (sends to one rank keep their order), and before
            // checking it: children must not wait for a body that never comes, and each of
            // them checks it too. If none came here (the parent failed), an empty one: it
            // fails their check, as the announced length is never 0 with data apart.
            let forwarded = body.as_ref().map_or_else(|_| Bytes::new(), Bytes::clone);
            for child in body_fan.to(tree) {
                keep_pending(sends, cx.send(child, forwarded.clone()));
            }
            body.and_then(|body| check_body(body_fan.from.unwrap_or(root), body, len))
        }
        BcastAlgorithm::Binomial => Ok(data.unwrap_or_else(|| {
            // Advanced past the header rather than sliced: a slice would turn the received
            // buffer, unshared, into a reference-counted one (an allocation and an atomic
            // count) just to skip 16 bytes.
            let mut body = std::mem::take(&mut message);
            body.advance(header.encoded_len());
            body
        })),
        _ if len == 0 => Ok(Bytes::new()),
        // Boxed: their state would otherwise make every broadcast's future (allocated per
        // call) over a kilobyte, out of the allocator's fast per-thread cache; for the large
        // messages they serve, one more allocation is noise.
        BcastAlgorithm::ScatterAllgather => Box::pin(scatter_allgather(cx, tree, len, data)).await,
        BcastAlgorithm::Chain => Box::pin(chain(cx, tree, len, data)).await,
        BcastAlgorithm::Multicast | BcastAlgorithm::Channels => Err(Error::Protocol {
            peer: root,
            detail: "a point-to-point broadcast header named a multicast algorithm".into(),
        }),
    }
}

/// A broadcast on two ranks, with no [`Ctx`], tree or future in the usual case — a small one
/// that goes out in one message with the one-byte header. The root sends it at the call (a
/// [`root_at_once`] without the tree); the other rank posts its receive and looks once (with
/// the spin burst of any first look), and when the message is there — the usual case, the root
/// being a send ahead — takes the data out of it at the call, as a point-to-point receive
/// would. A message not there yet is left to a task, as any collective's part (so it is taken
/// whether or not the caller polls); a header that announces more (the data apart, another
/// algorithm) goes on as [`run`] would from its first message. `Err(data)` where the root's
/// part is not such a broadcast (the caller runs it as usual).
pub(crate) fn of_two(
    comm: &Communicator,
    root: usize,
    data: Bytes,
) -> Result<CollectiveOp<Bytes>, Bytes> {
    let me = comm.rank();
    if root == me {
        let tuning = &comm.config().collectives;
        let header = Header::new(BcastAlgorithm::Binomial, data.len(), true);
        // The root's choice as `choose` makes it on two ranks: binomial unless another
        // point-to-point algorithm is forced (a multicast one not taken is no choice here).
        let forced = matches!(
            tuning.bcast,
            Some(BcastAlgorithm::ScatterAllgather | BcastAlgorithm::Chain)
        );
        if forced || !header.carries_data() {
            return Err(data);
        }
        let tag = comm.next_collective();
        let head = header.encode();
        let sent = comm.collective_send_parts(1 - me, tag, &[&head[..header.encoded_len()], &data]);
        if sent.is_complete() {
            return Ok(CollectiveOp::finished(me, Ok(data)));
        }
        return Ok(CollectiveOp::start(me, async move {
            sent.await?;
            Ok(data)
        }));
    }
    Ok(flat_leaf(comm, root))
}

/// A non-root's part of a broadcast whose root sends every rank its first message itself (a
/// flat fan-out: two ranks, or up to `flat_max`), as [`of_two`]'s other rank does: the receive
/// posted and looked at once, and a small broadcast's data taken out of the message at the
/// call, with no [`Ctx`], tree or future; anything else goes on from that first message as
/// [`run`] would. With 4 ranks on 2 cores, where the message has usually come by the time a
/// rank calls, an 8-byte broadcast took 0.30 µs this way against 0.40 by the general path
/// (9 interleaved rounds; Open MPI 0.53), and 64 KiB 2.93 against 3.60.
pub(crate) fn flat_leaf(comm: &Communicator, root: usize) -> CollectiveOp<Bytes> {
    let me = comm.rank();
    let tag = comm.next_collective();
    let mut recv = comm.collective_recv(root, tag);
    let mut look = Context::from_waker(Waker::noop());
    let first = std::panic::catch_unwind(AssertUnwindSafe(|| Pin::new(&mut recv).poll(&mut look)));
    let Ok(first) = first else {
        return CollectiveOp::failed(me, crate::started::panicked(me));
    };
    match first {
        Poll::Ready(Ok(message)) => match compact_body(message.into_data()) {
            Ok(body) => CollectiveOp::finished(me, Ok(body)),
            Err(message) => {
                CollectiveOp::start(me, from_first(Ctx::with_tag(comm, tag), root, message))
            }
        },
        Poll::Ready(Err(e)) => CollectiveOp::finished(me, Err(e)),
        Poll::Pending => {
            let comm = comm.clone();
            // Looked at already: spawned straight away, without a second spin burst.
            CollectiveOp::spawn(me, async move {
                let message = recv.await?.into_data();
                match compact_body(message) {
                    Ok(body) => Ok(body),
                    Err(message) => from_first(Ctx::with_tag(&comm, tag), root, message).await,
                }
            })
        }
    }
}

/// Whether a broadcast on `comm` is flat: its root sends every rank its first message itself
/// (on up to `flat_max` ranks).
pub(crate) fn is_flat(comm: &Communicator) -> bool {
    comm.size() <= comm.config().collectives.flat_max
}

/// The data of a first message with the one-byte header, or the message if it has another.
fn compact_body(mut message: Bytes) -> Result<Bytes, Bytes> {
    if message.first() != Some(&COMPACT) || message.len() > SEPARATE_FROM {
        return Err(message);
    }
    // Advanced, not sliced (see `deliver`).
    message.advance(1);
    Ok(message)
}

/// The part of a rank with nothing to forward (the non-root of two ranks) from its first
/// `message` (from the root) on: what [`run`] does once that message is in, less the
/// forwarding — a rank with children must not use it (they would wait for the header, or hear
/// nothing of a bad one).
async fn from_first(cx: Ctx, root: usize, message: Bytes) -> Result<Bytes, Error> {
    let header = Header::decode(root, &message)?;
    let tree = BinomialTree::new(&cx, root);
    let mut sends = Vec::new();
    let result = deliver(&cx, &tree, root, header, message, None, &mut sends).await;
    await_all(sends).await?;
    result
}

/// The root's whole part of a small binomial broadcast, done where it is called: the header
/// and data go to its children at once, and when every send went out eagerly (the usual case)
/// the broadcast is finished, with no future to allocate and poll — a root's broadcast is then
/// as cheap as its sends. `Err(data)` when this broadcast is not one (another algorithm, or the
/// data apart from the header): the caller runs it as usual.
pub(crate) fn root_at_once(cx: &Ctx, data: Bytes) -> Result<CollectiveOp<Bytes>, Bytes> {
    let tree = BinomialTree::new(cx, cx.rank);
    let fan = Fanout::of(cx, &tree);
    let header = Header::new(choose(cx, data.len()), data.len(), fan.flat);
    if header.algorithm != BcastAlgorithm::Binomial || header.separate {
        return Err(data);
    }
    // Header and data go as borrowed pieces: into the ring straight from here when a send
    // goes out at once, with no message buffer built for it.
    let head = header.encode();
    let head = &head[..header.encoded_len()];
    let body: &[u8] = if header.carries_data() { &data } else { &[] };
    let mut sends = Vec::new();
    for child in fan.to(&tree) {
        keep_pending(&mut sends, cx.send_parts(child, &[head, body]));
    }
    if sends.is_empty() {
        return Ok(CollectiveOp::finished(cx.rank, Ok(data)));
    }
    Ok(CollectiveOp::start(cx.rank, async move {
        await_all(sends).await?;
        Ok(data)
    }))
}

/// Where a rank's first message of a broadcast comes from and whom it passes it on to: the
/// root straight to every rank (flat, on up to `flat_max` ranks), or down the binomial tree.
#[derive(Clone, Copy, Debug)]
struct Fanout {
    flat: bool,
    /// `None` at the root.
    from: Option<usize>,
}

impl Fanout {
    /// The fan-out of a broadcast's header on this communicator.
    fn of(cx: &Ctx, tree: &BinomialTree) -> Fanout {
        if is_flat(&cx.comm) {
            Fanout::flat(tree)
        } else {
            Fanout::tree(tree)
        }
    }

    fn flat(tree: &BinomialTree) -> Fanout {
        Fanout {
            flat: true,
            from: tree.parent().map(|_| tree.root),
        }
    }

    fn tree(tree: &BinomialTree) -> Fanout {
        Fanout {
            flat: false,
            from: tree.parent(),
        }
    }

    /// The ranks this one sends to: every other rank from a flat root, none from a flat
    /// non-root, the tree children otherwise.
    fn to(self, tree: &BinomialTree) -> impl Iterator<Item = usize> + '_ {
        let flat_root = self.flat && self.from.is_none();
        let everyone = (1..if flat_root { tree.n } else { 1 }).map(|r| tree.absolute(r));
        let children = tree.children().take_while(move |_| !self.flat);
        everyone.chain(children.map(|c| c.rank))
    }
}

/// Sends `message` to `targets`; returns the sends still pending (those that went out eagerly
/// are not kept: nothing to wait for, and no vector to allocate). With `give_last` (the root,
/// which has its data apart) the last target gets `message` itself instead of a clone, and
/// `message` is left empty.
fn send_down(
    cx: &Ctx,
    targets: impl Iterator<Item = usize>,
    message: &mut Bytes,
    give_last: bool,
) -> Vec<SendOp> {
    let mut sends = Vec::new();
    let mut targets = targets.peekable();
    while let Some(target) = targets.next() {
        let payload = if give_last && targets.peek().is_none() {
            std::mem::take(message)
        } else {
            message.clone()
        };
        keep_pending(&mut sends, cx.send(target, payload));
    }
    sends
}

/// The data of a binomial broadcast sent apart from its header (by `from`), checked against
/// the header.
fn check_body(from: usize, body: Bytes, len: usize) -> Result<Bytes, Error> {
    if body.len() != len {
        return Err(Error::Protocol {
            peer: from,
            detail: format!(
                "broadcast: {} bytes of data where the header announced {len}",
                body.len()
            ),
        });
    }
    Ok(body)
}

/// The root's choice (see the [module docs](self)).
fn choose(cx: &Ctx, len: usize) -> BcastAlgorithm {
    let tuning = &cx.comm.config().collectives;
    if let Some(
        algorithm @ (BcastAlgorithm::Binomial
        | BcastAlgorithm::ScatterAllgather
        | BcastAlgorithm::Chain),
    ) = tuning.bcast
    {
        algorithm
    } else if len < tuning.bcast_large || cx.size < tuning.bcast_min_ranks.max(3) {
        BcastAlgorithm::Binomial
    } else if len < tuning.bcast_chain {
        BcastAlgorithm::ScatterAllgather
    } else {
        BcastAlgorithm::Chain
    }
}

fn algorithm_id(algorithm: BcastAlgorithm) -> u8 {
    match algorithm {
        BcastAlgorithm::Binomial => 0,
        BcastAlgorithm::ScatterAllgather => 1,
        BcastAlgorithm::Chain => 2,
        // Never chosen here (see `choose`): multicast broadcasts take another path.
        BcastAlgorithm::Multicast | BcastAlgorithm::Channels => 0,
    }
}

/// What every non-root learns first (see the [module docs](self)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Header {
    algorithm: BcastAlgorithm,
    len: usize,
    /// A binomial broadcast's data comes in a message of its own.
    separate: bool,
    /// ... and that message comes straight from the root, not down the tree.
    from_root: bool,
}

impl Header {
    /// The header of a broadcast of `len` bytes whose header fans out `flat` or not.
    fn new(algorithm: BcastAlgorithm, len: usize, flat: bool) -> Header {
        let separate = algorithm == BcastAlgorithm::Binomial && len >= SEPARATE_FROM;
        Header {
            algorithm,
            len,
            separate,
            from_root: separate && flat && len < FLAT_BODY_BELOW,
        }
    }

    /// The header, followed by the data itself for a binomial broadcast that does not send it
    /// apart.
    fn message(&self, data: &Bytes) -> Bytes {
        let body: &[u8] = if self.carries_data() { data } else { &[] };
        BufferPool::shared().concat(&[&self.encode()[..self.encoded_len()], body])
    }

    /// How many bytes the header takes: one when the data follows it.
    fn encoded_len(&self) -> usize {
        if self.carries_data() { 1 } else { HEADER_LEN }
    }

    /// The header's bytes: the first [`encoded_len`](Self::encoded_len) of these.
    fn encode(&self) -> [u8; HEADER_LEN] {
        let mut header = [0u8; HEADER_LEN];
        if self.carries_data() {
            header[0] = COMPACT;
            return header;
        }
        header[0] = algorithm_id(self.algorithm);
        header[1] = match (self.separate, self.from_root) {
            (false, _) => 0,
            (true, false) => 1,
            (true, true) => 2,
        };
        header[8..].copy_from_slice(&(self.len as u64).to_le_bytes());
        header
    }

    fn carries_data(&self) -> bool {
        self.algorithm == BcastAlgorithm::Binomial && !self.separate
    }

    /// Reads the header `parent` sent.
    fn decode(parent: usize, message: &Bytes) -> Result<Header, Error> {
        let bad = |detail: String| Error::Protocol {
            peer: parent,
            detail: format!("broadcast header: {detail}"),
        };
        if message.first() == Some(&COMPACT) {
            let len = message.len() - 1;
            return if len < SEPARATE_FROM {
                Ok(Header::new(BcastAlgorithm::Binomial, len, false))
            } else {
                Err(bad(format!(
                    "{len} bytes of data behind a compact header (below {SEPARATE_FROM} expected)"
                )))
            };
        }
        if message.len() < HEADER_LEN {
            return Err(bad(format!(
                "{} bytes, shorter than a header",
                message.len()
            )));
        }
        let algorithm = match message[0] {
            0 => BcastAlgorithm::Binomial,
            1 => BcastAlgorithm::ScatterAllgather,
            2 => BcastAlgorithm::Chain,
            id => return Err(bad(format!("unknown algorithm {id}"))),
        };
        // A binomial broadcast's data behind a full header would have had a compact one.
        let (separate, from_root) = match message[1] {
            0 if algorithm != BcastAlgorithm::Binomial => (false, false),
            1 if algorithm == BcastAlgorithm::Binomial => (true, false),
            2 if algorithm == BcastAlgorithm::Binomial => (true, true),
            flag => return Err(bad(format!("flag {flag} with algorithm {}", message[0]))),
        };
        if message[2..8].iter().any(|&b| b != 0) {
            return Err(bad("reserved bytes are not zero".into()));
        }
        let len = u64::from_le_bytes(message[8..16].try_into().unwrap_or_default());
        let len = usize::try_from(len)
            .ok()
            .filter(|_| len <= MAX_LEN)
            .ok_or_else(|| bad(format!("absurd length {len}")))?;
        if separate && len == 0 {
            // The root sends data apart only from `SEPARATE_FROM` bytes: an empty body is how
            // a rank tells its children that none came (see `run`).
            return Err(bad(
                "data apart from the header of an empty broadcast".into()
            ));
        }
        let header = Header {
            algorithm,
            len,
            separate,
            from_root,
        };
        let body = message.len() - HEADER_LEN;
        if body != 0 {
            return Err(bad(format!("{body} bytes follow a full header")));
        }
        Ok(header)
    }
}

/// A buffer for `len` bytes, or an error if memory for it cannot be had (the length came from
/// a peer: an allocation failure must not abort the process).
fn buffer(len: usize) -> Result<Vec<u8>, Error> {
    let mut buf = Vec::new();
    buf.try_reserve_exact(len)
        .map_err(|_| Error::InvalidArgument(format!("broadcast: cannot allocate {len} bytes")))?;
    Ok(buf)
}

/// Van de Geijn: binomial scatter of n blocks, then a ring allgather of the blocks.
async fn scatter_allgather(
    cx: &Ctx,
    tree: &BinomialTree,
    len: usize,
    data: Option<Bytes>,
) -> Result<Bytes, Error> {
    let n = cx.size;
    let layout = Blocks { len, n };
    let subtree = tree.subtree();
    // `held` is the byte range of this subtree's blocks, starting at `held_from` in the message.
    let held_from = layout.range(subtree.start).start;
    let held = match &data {
        Some(data) => data.clone(),
        None => {
            let parent = tree.parent().unwrap_or_default();
            let got = cx.recv(parent).await?;
            check_len(
                parent,
                "scatter block range",
                layout.span(&subtree).len(),
                got.len(),
            )?;
            got
        }
    };
    let to_children: Vec<SendOp> = tree
        .children()
        .map(|child| {
            let span = layout.span(&child.relative);
            cx.send(
                child.rank,
                held.slice(span.start - held_from..span.end - held_from),
            )
        })
        .collect();
    let own = layout.range(tree.relative);
    let own = held.slice(own.start - held_from..own.end - held_from);
    let blocks = ring_allgather(cx, tree, &layout, own).await?;
    await_all(to_children).await?;
    match data {
        Some(data) => Ok(data),
        None => {
            let mut out = buffer(len)?;
            for block in &blocks {
                byte_copy::extend_bytes(&mut out, block);
            }
            Ok(Bytes::from(out))
        }
    }
}

/// Ring allgather of the blocks by relative rank: in step s a rank passes block r − s to its
/// successor and gets block r − s − 1 from its predecessor. Returns the blocks in order.
async fn ring_allgather(
    cx: &Ctx,
    tree: &BinomialTree,
    layout: &Blocks,
    own: Bytes,
) -> Result<Vec<Bytes>, Error> {
    let (n, r) = (cx.size, tree.relative);
    let successor = tree.absolute((r + 1) % n);
    let predecessor = tree.absolute((r + n - 1) % n);
    // Every step's receive can be posted at once: messages from one rank arrive in order.
    let receives: Vec<_> = (1..n)
        .map(|_| cx.comm.collective_recv(predecessor, cx.tag))
        .collect();
    let mut blocks = vec![Bytes::new(); n];
    blocks[r] = own.clone();
    let mut sends = Vec::with_capacity(n - 1);
    let mut passing = own;
    for (step, receive) in (1..n).zip(receives) {
        sends.push(cx.send(successor, passing));
        let index = (r + n - step) % n;
        let block = receive.await?.into_data();
        check_len(
            predecessor,
            "ring block",
            layout.range(index).len(),
            block.len(),
        )?;
        blocks[index] = block.clone();
        passing = block;
    }
    await_all(sends).await?;
    Ok(blocks)
}

/// Pipelined chain along relative ranks 0 → 1 → … → n − 1.
async fn chain(
    cx: &Ctx,
    tree: &BinomialTree,
    len: usize,
    data: Option<Bytes>,
) -> Result<Bytes, Error> {
    let (n, r) = (cx.size, tree.relative);
    let successor = (r + 1 < n).then(|| tree.absolute(r + 1));
    let mut forward = Forwarder {
        cx,
        successor,
        in_flight: VecDeque::new(),
    };
    if let Some(data) = data {
        let segment = cx.comm.config().collectives.segment.max(1);
        let mut at = 0;
        while at < len {
            let end = len.min(at + segment);
            forward.push(data.slice(at..end)).await?;
            at = end;
        }
        forward.finish().await?;
        return Ok(data);
    }
    // Receivers take the segments as the root cut them: any non-empty pieces adding up to `len`.
    let predecessor = tree.absolute(r - 1);
    let mut out = buffer(len)?;
    let mut receives = VecDeque::new();
    while out.len() < len {
        // Each segment holds at least one byte, so never post more receives than bytes remain.
        while receives.len() < CHAIN_WINDOW && out.len() + receives.len() < len {
            receives.push_back(cx.comm.collective_recv(predecessor, cx.tag));
        }
        let Some(receive) = receives.pop_front() else {
            break;
        };
        let segment = receive.await?.into_data();
        let remaining = len - out.len();
        if segment.is_empty() || segment.len() > remaining {
            return Err(Error::Protocol {
                peer: predecessor,
                detail: format!(
                    "broadcast chain segment of {} bytes with {remaining} bytes to go",
                    segment.len()
                ),
            });
        }
        byte_copy::extend_bytes(&mut out, &segment);
        forward.push(segment).await?;
    }
    forward.finish().await?;
    Ok(Bytes::from(out))
}

/// Sends the chain's segments on to the successor (if any), at most [`CHAIN_WINDOW`] at once.
struct Forwarder<'a> {
    cx: &'a Ctx,
    successor: Option<usize>,
    in_flight: VecDeque<SendOp>,
}

impl Forwarder<'_> {
    async fn push(&mut self, segment: Bytes) -> Result<(), Error> {
        let Some(successor) = self.successor else {
            return Ok(());
        };
        self.in_flight.push_back(self.cx.send(successor, segment));
        if self.in_flight.len() > CHAIN_WINDOW {
            if let Some(oldest) = self.in_flight.pop_front() {
                oldest.await?;
            }
        }
        Ok(())
    }

    async fn finish(self) -> Result<(), Error> {
        await_all(self.in_flight.into()).await
    }
}

fn check_len(peer: usize, what: &str, expected: usize, got: usize) -> Result<(), Error> {
    if expected == got {
        Ok(())
    } else {
        Err(Error::Protocol {
            peer,
            detail: format!("broadcast {what} of {got} bytes where {expected} were expected"),
        })
    }
}

/// The message cut into `n` nearly equal contiguous blocks (the first `len % n` one byte
/// longer), block i for relative rank i.
struct Blocks {
    len: usize,
    n: usize,
}

impl Blocks {
    /// The byte range of block `i`.
    fn range(&self, i: usize) -> Range<usize> {
        let (base, extra) = (self.len / self.n, self.len % self.n);
        let start = i * base + i.min(extra);
        start..start + base + usize::from(i < extra)
    }

    /// The byte range of blocks `blocks` (contiguous).
    fn span(&self, blocks: &Range<usize>) -> Range<usize> {
        self.range(blocks.start).start..self.range(blocks.end - 1).end
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_reject_garbage() {
        let data = Bytes::from_static(b"hello");
        let binomial = Header::new(BcastAlgorithm::Binomial, 5, false);
        let m = binomial.message(&data);
        // A small broadcast's header is one byte; its length is what follows.
        assert_eq!(&m[..], b"\x03hello");
        assert_eq!(Header::decode(3, &m).unwrap(), binomial);
        let chain = Header::new(BcastAlgorithm::Chain, 5, true);
        let m = chain.message(&data);
        assert_eq!(m.len(), HEADER_LEN);
        assert_eq!(Header::decode(3, &m).unwrap(), chain);
        let mut bad = m.to_vec();
        bad[0] = 7;
        assert!(Header::decode(3, &Bytes::from(bad)).is_err());
        let mut bad = m.to_vec();
        bad[1] = 1; // data apart is for binomial broadcasts only
        assert!(Header::decode(3, &Bytes::from(bad)).is_err());
        let mut bad = m.to_vec();
        bad[8..16].copy_from_slice(&((1u64 << 40) + 1).to_le_bytes());
        assert!(Header::decode(3, &Bytes::from(bad)).is_err());
        assert!(Header::decode(3, &m.slice(..10)).is_err());
        let mut long = m.to_vec();
        long.push(1);
        assert!(Header::decode(3, &Bytes::from(long)).is_err());
        // Data behind a full binomial header, or too much of it behind a compact one: garbage.
        let mut full = m.to_vec();
        full[0] = 0;
        assert!(Header::decode(3, &Bytes::from(full)).is_err());
        let mut huge = vec![COMPACT];
        huge.resize(1 + SEPARATE_FROM, 0);
        assert!(Header::decode(3, &Bytes::from(huge)).is_err());
        assert_eq!(
            Header::decode(3, &Bytes::from_static(&[COMPACT])).unwrap(),
            Header::new(BcastAlgorithm::Binomial, 0, true)
        );
        // A large binomial broadcast announces its data apart: the header travels alone.
        let big = Bytes::from(vec![1u8; SEPARATE_FROM]);
        let apart = Header::new(BcastAlgorithm::Binomial, big.len(), false);
        assert!(apart.separate && !apart.from_root);
        let m = apart.message(&big);
        assert_eq!(m.len(), HEADER_LEN);
        assert_eq!(Header::decode(3, &m).unwrap(), apart);
        // Flat, it says the data comes from the root too, below `FLAT_BODY_BELOW` bytes.
        let flat = Header::new(BcastAlgorithm::Binomial, big.len(), true);
        assert!(flat.separate && flat.from_root);
        assert_eq!(Header::decode(3, &flat.message(&big)).unwrap(), flat);
        let flat_large = Header::new(BcastAlgorithm::Binomial, FLAT_BODY_BELOW, true);
        assert!(flat_large.separate && !flat_large.from_root);
        // Small data travels behind the header whatever the fan-out.
        assert!(!Header::new(BcastAlgorithm::Binomial, 5, true).separate);
        let mut bad = flat.message(&big).to_vec();
        bad[1] = 3;
        assert!(Header::decode(3, &Bytes::from(bad)).is_err());
    }

    #[test]
    fn blocks_cover_the_message() {
        for len in [0, 1, 5, 17, 100] {
            for n in 1..10 {
                let b = Blocks { len, n };
                assert_eq!(b.span(&(0..n)), 0..len);
                for i in 1..n {
                    assert_eq!(b.range(i - 1).end, b.range(i).start);
                }
            }
        }
    }
}
