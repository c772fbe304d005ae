//! Reduce, and the messaging every reduction shares ([`Reduction`]).
//!
//! # Binomial tree
//!
//! Ranks are numbered relative to a tree root. Node `v` receives from its children `v + 1`,
//! `v + 2`, `v + 4`, … (while that bit of `v` is clear and the child exists), combining each into
//! its accumulator, then sends the accumulator to its parent `v − lowbit(v)`: ⌈log₂ n⌉ rounds of
//! the whole vector. Child `v + m` brings the contiguous range `[v + m, v + 2m)`, and the children
//! come in increasing order, so `acc = acc ∘ child` keeps relative-rank order.
//!
//! - **Commutative operations**: the tree is rooted at `root` itself (relative ranks wrap around,
//!   which only commutative operations allow).
//! - **Non-commutative operations**: the tree is rooted at rank 0, where relative order is rank
//!   order, so the result is exactly `x₀ ∘ x₁ ∘ … ∘ xₙ₋₁`; rank 0 then sends it on to `root`.
//!
//! # Messages and failures
//!
//! Every message of a reduction (this module's and those of allreduce, reduce-scatter and scan)
//! ends with a kind byte: the elements followed by [`DATA`], or the rank where the collective
//! failed (`u32` LE) and why (UTF-8) followed by [`FAULT`]. The kind goes last so that the
//! elements start the message: a large one lands in a fresh, aligned buffer, and the receiver
//! combines straight from it ([`Theirs`]) instead of copying it out first. Senders build
//! messages in the process's [`BufferPool`], so a large reduction allocates nothing per call. A rank that sees a bad message (another
//! length than its own, a partial number of elements) does not stop: it remembers the error,
//! stops combining, and runs the rest of its schedule with fault notices in place of data. So
//! every rank of the schedule finishes, the ones whose result depends on the bad contribution
//! with an error, and nobody waits forever for a message that was never sent. The schedules
//! depend only on the number of ranks (empty blocks are still sent), not on the data, so ranks
//! that disagree about the length still pair up, as long as they chose the same algorithm
//! (allreduce chooses by byte size: contributions on both sides of `allreduce_large` can make
//! ranks run different schedules and wait for each other, which is why mismatched counts remain
//! erroneous, as in MPI).

use std::ops::{Deref, Range};

use bytes::Bytes;
use rankweave_core::buffer_pool::BufferPool;
use rankweave_core::{Error, ExchangeRecv, RecvOp, SendOp, byte_copy};

use crate::ctx::{Ctx, length_mismatch, to_vec};
use crate::tree::BinomialTree;
use crate::{CollectiveOp, Element, ReduceOp};

pub(crate) async fn binomial<T: Element>(
    cx: Ctx,
    root: usize,
    data: Vec<T>,
    op: ReduceOp<T>,
) -> Result<Option<Vec<T>>, Error> {
    let mut reduction = Reduction::new(cx, op);
    let result = reduce_to(&mut reduction, root, data).await?;
    reduction.finish(result)
}

/// The reduce of two ranks: the other rank sends its vector (at the call, then it is done)
/// and the root combines it with its own in rank order, which serves every operation; the
/// root's part is one receive, made where it is polled (see [`CollectiveOp::receiving`]).
///
/// The other rank sends straight from the caller's `data`: a message the ring takes is
/// copied there, a larger one once into the send's own buffer (a vector of its own first
/// would be a second copy, some 5% of a 64 KiB reduce). Only the root keeps a vector.
///
/// From [`PIPELINE_FROM`] bytes (below [`PAIR_PIPELINE_UNTIL`]) the vector goes in pieces of
/// [`PIECE_BYTES`] ([`Reduction::send_pieces`]), which the root combines as they come
/// ([`Reduction::receive_pieces`]): it works on the first piece while the next is being
/// written, where one message would have it wait for the whole vector and then copy it out
/// whole before combining.
pub(crate) fn pair<T: Element>(
    cx: Ctx,
    root: usize,
    data: &[T],
    op: ReduceOp<T>,
) -> CollectiveOp<Option<Vec<T>>> {
    let (me, other) = (cx.rank, 1 - cx.rank);
    let mut reduction = Reduction::new(cx, op);
    let pieces = (PIPELINE_FROM..PAIR_PIPELINE_UNTIL).contains(&size_of_val(data));
    if me != root {
        let mut sends = reduction.send_vector(root, data, pieces);
        sends.retain(|s| !s.is_complete());
        if sends.is_empty() {
            return CollectiveOp::finished(me, Ok(None));
        }
        return CollectiveOp::start(me, async move {
            for sent in sends {
                sent.await?;
            }
            Ok(None)
        });
    }
    let mut data = byte_copy::vec_from(data);
    if pieces {
        return CollectiveOp::start(me, async move {
            reduction.receive_pieces(other, &mut data).await?;
            reduction.finish(Some(data))
        });
    }
    let incoming = reduction.post(other);
    CollectiveOp::receiving(me, None, incoming.into_recv(), move |message| {
        reduction.combine_message(other, message.into_data(), &mut data);
        reduction.finish(Some(data))
    })
}

/// Reduces every rank's `data` (the same length everywhere) at `root`, in rank order for
/// non-commutative operations: `Some(result)` at `root`, `None` elsewhere (see the
/// [module docs](self)).
pub(crate) async fn reduce_to<T: Element>(
    reduction: &mut Reduction<T>,
    root: usize,
    data: Vec<T>,
) -> Result<Option<Vec<T>>, Error> {
    if reduction.op.is_commutative() {
        return tree(reduction, root, data).await;
    }
    let len = data.len();
    let at_zero = tree(reduction, 0, data).await?;
    if root == 0 {
        Ok(at_zero)
    } else if reduction.rank() == 0 {
        reduction
            .send(root, at_zero.as_deref().unwrap_or_default())
            .await?;
        Ok(None)
    } else if reduction.rank() == root {
        let incoming = reduction.post(0);
        Ok(Some(
            reduction
                .receive(incoming, len)
                .await?
                .map(Theirs::into_vec)
                .unwrap_or_default(),
        ))
    } else {
        Ok(None)
    }
}

/// The binomial tree rooted at `root`: the reduction at `root`, `None` elsewhere.
async fn tree<T: Element>(
    reduction: &mut Reduction<T>,
    root: usize,
    data: Vec<T>,
) -> Result<Option<Vec<T>>, Error> {
    let tree = BinomialTree::of(reduction.size(), reduction.rank(), root);
    // In pieces as on two ranks (see `pair`), each child's combined as it comes.
    let pieces = (PIPELINE_FROM..=TREE_PIPELINE_MAX).contains(&size_of_val(&data[..]));
    let mut acc = data;
    if pieces {
        for child in tree.children() {
            reduction.receive_pieces(child.rank, &mut acc).await?;
        }
    } else {
        // Post every child's receive now, so their (possibly rendezvous) sends all proceed
        // while the first ones are combined. Children come in increasing relative rank: each
        // holds the next contiguous range of higher ranks.
        let incoming: Vec<Incoming> = tree
            .children()
            .map(|child| reduction.post(child.rank))
            .collect();
        for from_child in incoming {
            if let Some(child) = reduction.receive(from_child, acc.len()).await? {
                reduction.combine(&mut acc, child, Side::Higher);
            }
        }
    }
    match tree.parent() {
        None => Ok(Some(acc)),
        Some(parent) => {
            for sent in reduction.send_vector(parent, &acc, pieces) {
                sent.await?;
            }
            Ok(None)
        }
    }
}

/// Bytes the kind takes at the end of every reduction message.
pub(crate) const KIND_LEN: usize = 1;
/// Kind byte of a message carrying elements.
const DATA: u8 = 0;
/// Kind byte of a message announcing that the collective failed.
const FAULT: u8 = 1;
/// Kind byte of a piece of a vector sent in pieces, other than the last (which is [`DATA`]).
const MORE: u8 = 2;

/// Elements bytes of each piece of a vector sent in pieces: each goes through a
/// shared-memory ring in one record, and is combined while it is in cache.
const PIECE_BYTES: usize = 8 * 1024;
/// Vectors of at least this many bytes go in pieces where a schedule allows it, up to
/// [`PAIR_PIPELINE_UNTIL`] on two ranks and [`TREE_PIPELINE_MAX`] in the tree.
const PIPELINE_FROM: usize = 16 * 1024;
/// On two ranks, from this many bytes one message again: it goes by single copy, which
/// measured as fast as the pieces at 256 KiB and faster from 512 KiB (7 interleaved rounds;
/// 5 rounds: 37 / 45 µs at 256 KiB, 69 / 97 at 512 KiB, 169 / 222 at 1 MiB).
const PAIR_PIPELINE_UNTIL: usize = 256 * 1024;
/// In the tree (3 ranks and more), pieces up to this many bytes: with 4 ranks on 2 cores they
/// beat one message at every size measured, up to this one (5 rounds: 102 / 154 µs at
/// 256 KiB, 210 / 336 at 512 KiB, 472 / 547 at 1 MiB).
const TREE_PIPELINE_MAX: usize = 1024 * 1024;

/// Where the ranks of a received partial result lie relative to this rank's own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    /// Lower ranks: the result is `theirs ∘ mine`.
    Lower,
    /// Higher ranks: the result is `mine ∘ theirs`.
    Higher,
}

impl Side {
    /// The side of `theirs` relative to `mine` (numbers that order ranks the same way).
    pub fn of(theirs: usize, mine: usize) -> Side {
        if theirs < mine {
            Side::Lower
        } else {
            Side::Higher
        }
    }
}

/// Why this rank's part of the collective failed, and the notice it sends in place of data.
struct Fault {
    error: Error,
    notice: Bytes,
}

/// A receive that has been posted and is awaited by [`Reduction::receive`].
pub(crate) struct Incoming {
    from: usize,
    recv: RecvOp,
}

impl Incoming {
    /// The posted receive, to be awaited elsewhere; its message goes to [`Reduction::accept`].
    pub fn into_recv(self) -> RecvOp {
        self.recv
    }
}

/// One rank's part in a reduction collective: the context, the operation, and whether the
/// collective has failed (see the [module docs](self)).
pub(crate) struct Reduction<T> {
    cx: Ctx,
    pub op: ReduceOp<T>,
    fault: Option<Fault>,
}

impl<T: Element> Reduction<T> {
    pub fn new(cx: Ctx, op: ReduceOp<T>) -> Self {
        Reduction {
            cx,
            op,
            fault: None,
        }
    }

    pub fn rank(&self) -> usize {
        self.cx.rank
    }

    pub fn size(&self) -> usize {
        self.cx.size
    }

    /// The collective's context (communicator and tag).
    pub fn ctx(&self) -> &Ctx {
        &self.cx
    }

    /// Whether the collective has failed on this rank (seen here or told by a peer).
    pub fn has_failed(&self) -> bool {
        self.fault.is_some()
    }

    /// Posts the receive of the next message from `from`.
    pub fn post(&self, from: usize) -> Incoming {
        Incoming {
            from,
            recv: self.cx.comm.collective_recv(from, self.cx.tag),
        }
    }

    /// Sends `data` (or the fault notice) to `partner` and receives from it, both started at
    /// once and together ([`Communicator::collective_exchange`]): a two-rank collective's one
    /// exchange. The message goes to [`combine_message`](Self::combine_message).
    ///
    /// [`Communicator::collective_exchange`]: rankweave_core::Communicator::collective_exchange
    pub fn start_exchange(&self, partner: usize, data: &[T]) -> (SendOp, ExchangeRecv) {
        let parts: [&[u8]; 2] = match &self.fault {
            None => [bytemuck::cast_slice(data), &[DATA]],
            Some(fault) => [&fault.notice, &[]],
        };
        let (comm, tag) = (&self.cx.comm, self.cx.tag);
        comm.collective_exchange(partner, tag, &parts, partner)
    }

    /// Sends `data` to `to`, or the fault notice once the collective has failed (starts at once).
    pub fn send(&self, to: usize, data: &[T]) -> SendOp {
        match &self.fault {
            None => self
                .cx
                .send_parts(to, &[bytemuck::cast_slice(data), &[DATA]]),
            Some(fault) => self.cx.send(to, fault.notice.clone()),
        }
    }

    /// Sends `data` to `to` in pieces ([`send_pieces`](Self::send_pieces)) or as one message
    /// ([`send`](Self::send)).
    pub fn send_vector(&self, to: usize, data: &[T], in_pieces: bool) -> Vec<SendOp> {
        if in_pieces {
            self.send_pieces(to, data)
        } else {
            vec![self.send(to, data)]
        }
    }

    /// Sends `data` to `to` in pieces of [`PIECE_BYTES`], every one but the last marked
    /// [`MORE`] (all start at once; the fault notice alone once the collective has failed).
    /// The receiver takes them with [`receive_pieces`](Self::receive_pieces).
    pub fn send_pieces(&self, to: usize, data: &[T]) -> Vec<SendOp> {
        if self.fault.is_some() || data.is_empty() {
            return vec![self.send(to, data)];
        }
        let per = (PIECE_BYTES / size_of::<T>().max(1)).max(1);
        let count = data.len().div_ceil(per);
        data.chunks(per)
            .enumerate()
            .map(|(i, piece)| {
                let kind = if i + 1 == count { DATA } else { MORE };
                self.cx
                    .send_parts(to, &[bytemuck::cast_slice(piece), &[kind]])
            })
            .collect()
    }

    /// Receives what [`send_pieces`](Self::send_pieces) sent from `from` and combines it into
    /// `mine` piece by piece, in rank order. Reads up to the last piece (or a fault notice)
    /// whatever it finds, so nothing of this collective is left unreceived: a sender whose
    /// vector has another length, or a malformed piece, is recorded as the failure, as with
    /// [`receive`](Self::receive). `Err` only when a message could not be received at all.
    pub async fn receive_pieces(&mut self, from: usize, mine: &mut [T]) -> Result<(), Error> {
        let side = Side::of(from, self.cx.rank);
        let elem = size_of::<T>().max(1);
        let mut at = 0;
        loop {
            let message = self
                .cx
                .comm
                .collective_recv(from, self.cx.tag)
                .await?
                .into_data();
            let (kind, bytes) = match message.split_last() {
                Some((&kind, elements)) => (kind, elements.len()),
                None => (FAULT, 0),
            };
            if kind != MORE {
                // The last piece, a fault notice or a malformed message: the usual checks,
                // against what is left of this rank's vector.
                let rest = mine.len().saturating_sub(at);
                if kind == DATA && bytes / elem != rest && !self.has_failed() {
                    self.fail(length_mismatch(from, mine.len(), at + bytes / elem));
                } else if let Some(theirs) = self.accept(from, message, rest) {
                    self.combine(&mut mine[at..], theirs, side);
                }
                return Ok(());
            }
            // After a failure the pieces are only counted, so that all of them are read.
            let end = at + bytes / elem;
            if end > mine.len() && !self.has_failed() {
                self.fail(length_mismatch(from, mine.len(), end));
            } else if !self.has_failed() {
                match Theirs::new(message, bytes) {
                    Ok(theirs) => self.combine(&mut mine[at..end], theirs, side),
                    Err(e) => self.fail(e),
                }
            }
            at = end;
        }
    }

    /// Waits for a posted receive of `len` elements. `Ok(None)` when the collective has failed
    /// (before or by this message): the caller skips combining and carries on with its
    /// schedule. `Err` only when the message could not be received at all.
    pub async fn receive(
        &mut self,
        incoming: Incoming,
        len: usize,
    ) -> Result<Option<Theirs<T>>, Error> {
        let message = incoming.recv.await?.into_data();
        Ok(self.accept(incoming.from, message, len))
    }

    /// Sends `data` to `partner` and receives `len` elements from it, both started before
    /// either is awaited (rendezvous sends complete only once the partner has matched them).
    pub async fn exchange(
        &mut self,
        partner: usize,
        data: &[T],
        len: usize,
    ) -> Result<Option<Theirs<T>>, Error> {
        let incoming = self.post(partner);
        let sent = self.send(partner, data);
        let received = self.receive(incoming, len).await;
        sent.await?;
        received
    }

    /// `mine = theirs ∘ mine` or `mine = mine ∘ theirs`, as `theirs` lies on `side`.
    pub fn combine(&mut self, mine: &mut [T], theirs: Theirs<T>, side: Side) {
        let combined = match side {
            Side::Lower => self.op.combine(&theirs, mine),
            Side::Higher if self.op.is_commutative() => self.op.combine(&theirs, mine),
            Side::Higher => {
                // `mine ∘ theirs` lands in the right operand: theirs, as a vector of our own.
                let mut theirs = theirs.into_vec();
                self.op
                    .combine(mine, &mut theirs)
                    .map(|()| byte_copy::copy_slice(mine, &theirs))
            }
        };
        if let Err(error) = combined {
            self.fail(error);
        }
    }

    /// `mine = lower ∘ mine`, without taking `lower`.
    pub fn combine_lower(&mut self, lower: &[T], mine: &mut [T]) {
        if let Err(error) = self.op.combine(lower, mine) {
            self.fail(error);
        }
    }

    /// The collective's result on this rank: `result`, or the error that made it fail.
    pub fn finish<R>(self, result: R) -> Result<R, Error> {
        match self.fault {
            None => Ok(result),
            Some(fault) => Err(fault.error),
        }
    }

    /// Combines the partial `from` sent in `message` into `mine`, in rank order; a fault
    /// notice or a bad message is recorded instead, as with [`receive`](Self::receive). For a
    /// message received without this type's help (a two-rank collective's one receive).
    pub fn combine_message(&mut self, from: usize, message: Bytes, mine: &mut [T]) {
        if let Some(theirs) = self.accept(from, message, mine.len()) {
            self.combine(mine, theirs, Side::of(from, self.cx.rank));
        }
    }

    fn accept(&mut self, from: usize, message: Bytes, len: usize) -> Option<Theirs<T>> {
        if self.fault.is_some() {
            return None;
        }
        match decode(from, message, len) {
            Ok(data) => Some(data),
            Err(Received::Fault(fault)) => {
                self.fault = Some(fault);
                None
            }
            Err(Received::Bad(error)) => {
                self.fail(error);
                None
            }
        }
    }

    /// Records a failure seen here (the first one wins): from now on this rank sends fault
    /// notices in place of data, and [`finish`](Self::finish) gives the error.
    pub fn fail(&mut self, error: Error) {
        if self.fault.is_none() {
            let notice = encode_fault(self.cx.rank, &error);
            self.fault = Some(Fault { error, notice });
        }
    }
}

/// Why a message gave no data.
enum Received {
    /// The sender's collective had failed, maybe elsewhere: its notice.
    Fault(Fault),
    /// The message itself is wrong.
    Bad(Error),
}

fn encode_fault(rank: usize, error: &Error) -> Bytes {
    let reason = error.to_string();
    BufferPool::shared().concat(&[&(rank as u32).to_le_bytes(), reason.as_bytes(), &[FAULT]])
}

fn decode<T: Element>(from: usize, message: Bytes, len: usize) -> Result<Theirs<T>, Received> {
    match message.last() {
        Some(&DATA) => {
            let bytes = message.len() - 1;
            let theirs = Theirs::new(message, bytes).map_err(Received::Bad)?;
            if theirs.len() != len {
                return Err(Received::Bad(length_mismatch(from, len, theirs.len())));
            }
            Ok(theirs)
        }
        // A piece: the sender's vector is long enough to go in pieces and this rank's is not
        // (its pieces left unreceived stay with this collective's tag, which nothing else
        // matches).
        Some(&MORE) => Err(Received::Bad(Error::InvalidArgument(format!(
            "rank {from} sent its contribution in pieces, longer than the {len} elements \
             expected: every rank must pass the same count"
        )))),
        Some(&FAULT) if message.len() >= 5 => {
            let origin = u32::from_le_bytes([message[0], message[1], message[2], message[3]]);
            let reason = String::from_utf8_lossy(&message[4..message.len() - 1]);
            let error =
                Error::InvalidArgument(format!("the collective failed on rank {origin}: {reason}"));
            Err(Received::Fault(Fault {
                error,
                notice: message,
            }))
        }
        _ => Err(Received::Bad(Error::Protocol {
            peer: from,
            detail: "malformed reduction message".into(),
        })),
    }
}

/// A peer's elements: read in place from its message when the bytes are aligned for `T` (a
/// large message's buffer is), else copied out. Made only by `Theirs::new`, which checks.
pub(crate) enum Theirs<T> {
    /// The message's first `bytes` bytes, aligned for `T` and a whole number of elements.
    InPlace {
        /// The whole message: a slice of it would turn an unshared buffer into a
        /// reference-counted one (an allocation and an atomic count) to drop one byte.
        message: Bytes,
        /// How many of its first bytes are the elements.
        bytes: usize,
    },
    Copied(Vec<T>),
}

impl<T: Element> Theirs<T> {
    /// The elements in the first `bytes` bytes of `message`.
    fn new(message: Bytes, bytes: usize) -> Result<Self, Error> {
        let elements = &message[..bytes];
        if bytemuck::try_cast_slice::<u8, T>(elements).is_ok() {
            Ok(Theirs::InPlace { message, bytes })
        } else {
            to_vec(elements).map(Theirs::Copied)
        }
    }

    /// The elements as a vector of their own.
    pub fn into_vec(self) -> Vec<T> {
        match self {
            Theirs::InPlace { .. } => byte_copy::vec_from(&self),
            Theirs::Copied(v) => v,
        }
    }
}

impl<T: Element> Deref for Theirs<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match self {
            // Checked in `new`: aligned, a whole number of elements.
            Theirs::InPlace { message, bytes } => bytemuck::cast_slice(&message[..*bytes]),
            Theirs::Copied(v) => v,
        }
    }
}

/// Boundaries of `len` elements cut into `parts` nearly equal blocks (the first `len % parts`
/// one element longer): block `i` is `bounds[i]..bounds[i + 1]`.
pub(crate) fn even_bounds(len: usize, parts: usize) -> Vec<usize> {
    let (per, extra) = (len / parts, len % parts);
    (0..=parts).map(|i| i * per + i.min(extra)).collect()
}

/// Block `i` of `bounds`.
pub(crate) fn block(bounds: &[usize], i: usize) -> Range<usize> {
    bounds[i]..bounds[i + 1]
}
