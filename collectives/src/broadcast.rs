//! Broadcast: the root's bytes to every rank, and the binomial tree the rooted collectives share.
//!
//! Only the root knows the data and its length, so the root alone picks the algorithm (the
//! `bcast` override, or by size: binomial below `bcast_large` or on 2 ranks, scatter + allgather
//! below `bcast_chain`, chain above) and tells the others. Every non-root first receives one
//! message from its binomial-tree parent starting with a 16-byte header: byte 0 the algorithm
//! (0 binomial, 1 scatter + allgather, 2 chain), bytes 1..8 zero, bytes 8..16 the total length
//! (u64 LE). It forwards that message unchanged to its own children, so ranks never disagree.
//!
//! - **Binomial tree**: the data follows the header in the same message; ⌈log₂ n⌉ rounds of the
//!   whole message. Best when latency dominates.
//! - **Scatter + allgather** (van de Geijn): the message is cut into n nearly equal blocks by
//!   relative rank, scattered down the binomial tree (each subtree gets its contiguous range),
//!   then a ring allgather gives every rank every block: about twice the message per rank
//!   whatever n.
//! - **Chain**: segments of `segment` bytes flow root → root+1 → … → root+n−1, each rank
//!   forwarding a segment as soon as it has it, several in flight: each link carries the message
//!   once. Best for very large messages.

use std::collections::VecDeque;
use std::ops::Range;

use bytes::{BufMut, Bytes, BytesMut};
use rankweave_core::tuning::BcastAlgorithm;
use rankweave_core::{Error, SendOp};

use crate::ctx::{Ctx, await_all};
use crate::tree::BinomialTree;

const HEADER_LEN: usize = 16;
/// Longest broadcast a header may announce (1 TiB); more is a corrupt header.
const MAX_LEN: u64 = 1 << 40;
/// Segments of the chain a rank keeps in flight (sends, and receives posted ahead).
const CHAIN_WINDOW: usize = 4;

pub(crate) async fn run(cx: Ctx, root: usize, data: Bytes) -> Result<Bytes, Error> {
    if cx.size == 1 {
        return Ok(data);
    }
    let tree = BinomialTree::new(&cx, root);
    let (message, algorithm, len, data) = match tree.parent() {
        None => {
            let algorithm = choose(&cx, data.len());
            let message = header_message(algorithm, &data);
            (message, algorithm, data.len(), Some(data))
        }
        Some(parent) => {
            let message = cx.recv(parent).await?;
            let (algorithm, len) = decode_header(parent, &message)?;
            (message, algorithm, len, None)
        }
    };
    let headers: Vec<SendOp> = tree
        .children()
        .iter()
        .map(|child| cx.send(child.rank, message.clone()))
        .collect();
    let result = match algorithm {
        BcastAlgorithm::Binomial => Ok(message.slice(HEADER_LEN..)),
        _ if len == 0 => Ok(Bytes::new()),
        BcastAlgorithm::ScatterAllgather => scatter_allgather(&cx, &tree, len, data).await,
        BcastAlgorithm::Chain => chain(&cx, &tree, len, data).await,
        BcastAlgorithm::Multicast | BcastAlgorithm::Channels => Err(Error::Protocol {
            peer: root,
            detail: "a point-to-point broadcast header named a multicast algorithm".into(),
        }),
    };
    await_all(headers).await?;
    result
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
    } else if len < tuning.bcast_large || cx.size <= 2 {
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

/// The header, followed by the data itself for the binomial tree.
fn header_message(algorithm: BcastAlgorithm, data: &Bytes) -> Bytes {
    let carries_data = algorithm == BcastAlgorithm::Binomial;
    let mut message =
        BytesMut::with_capacity(HEADER_LEN + if carries_data { data.len() } else { 0 });
    message.put_u8(algorithm_id(algorithm));
    message.put_bytes(0, 7);
    message.put_u64_le(data.len() as u64);
    if carries_data {
        message.put_slice(data);
    }
    message.freeze()
}

/// Reads the header `parent` sent: the algorithm and the total length.
fn decode_header(parent: usize, message: &Bytes) -> Result<(BcastAlgorithm, usize), Error> {
    let bad = |detail: String| Error::Protocol {
        peer: parent,
        detail: format!("broadcast header: {detail}"),
    };
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
    if message[1..8].iter().any(|&b| b != 0) {
        return Err(bad("reserved bytes are not zero".into()));
    }
    let len = u64::from_le_bytes(message[8..16].try_into().unwrap_or_default());
    let len = usize::try_from(len)
        .ok()
        .filter(|_| len <= MAX_LEN)
        .ok_or_else(|| bad(format!("absurd length {len}")))?;
    let body = message.len() - HEADER_LEN;
    let expected_body = if algorithm == BcastAlgorithm::Binomial {
        len
    } else {
        0
    };
    if body != expected_body {
        return Err(bad(format!(
            "{body} bytes follow the header where {expected_body} were expected"
        )));
    }
    Ok((algorithm, len))
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
        .iter()
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
                out.extend_from_slice(block);
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
        out.extend_from_slice(&segment);
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
        let m = header_message(BcastAlgorithm::Binomial, &data);
        assert_eq!(decode_header(3, &m).unwrap(), (BcastAlgorithm::Binomial, 5));
        let m = header_message(BcastAlgorithm::Chain, &data);
        assert_eq!(m.len(), HEADER_LEN);
        assert_eq!(decode_header(3, &m).unwrap(), (BcastAlgorithm::Chain, 5));
        let mut bad = m.to_vec();
        bad[0] = 7;
        assert!(decode_header(3, &Bytes::from(bad)).is_err());
        let mut bad = m.to_vec();
        bad[8..16].copy_from_slice(&((1u64 << 40) + 1).to_le_bytes());
        assert!(decode_header(3, &Bytes::from(bad)).is_err());
        assert!(decode_header(3, &m.slice(..10)).is_err());
        let mut long = m.to_vec();
        long.push(1);
        assert!(decode_header(3, &Bytes::from(long)).is_err());
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
