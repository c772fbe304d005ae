//! [`Ctx`]: what every algorithm works with — the communicator, the collective's tag, this
//! rank's number and the size — and the message helpers the algorithms share: typed sends and
//! receives of `Pod` vectors, and a framing for sets of variable-length blocks.

use bytes::{BufMut, Bytes, BytesMut};
use rankweave_core::buffer_pool::BufferPool;
use rankweave_core::{Communicator, Error, SendOp, byte_copy};

/// One collective's view of its communicator (see the [module docs](self)).
#[derive(Clone, Debug)]
pub(crate) struct Ctx {
    pub comm: Communicator,
    /// Every message of this collective carries this tag on the collective context.
    pub tag: u32,
    pub rank: usize,
    pub size: usize,
}

impl Ctx {
    /// The context of the next collective on `comm` (takes its sequence number).
    pub fn next(comm: &Communicator) -> Ctx {
        Ctx::with_tag(comm, comm.next_collective())
    }

    /// The context of the collective on `comm` whose sequence number `tag` was taken already.
    pub fn with_tag(comm: &Communicator, tag: u32) -> Ctx {
        Ctx {
            tag,
            rank: comm.rank(),
            size: comm.size(),
            comm: comm.clone(),
        }
    }

    /// Sends bytes to `dst` (starts at once).
    pub fn send(&self, dst: usize, data: Bytes) -> SendOp {
        self.comm.collective_send(dst, self.tag, data)
    }

    /// Sends the concatenation of `parts` to `dst` (starts at once): copied straight into the
    /// transport when it goes out at once, so a small message needs no buffer of its own.
    pub fn send_parts(&self, dst: usize, parts: &[&[u8]]) -> SendOp {
        self.comm.collective_send_parts(dst, self.tag, parts)
    }

    /// Receives the next message of this collective from `src`.
    pub async fn recv(&self, src: usize) -> Result<Bytes, Error> {
        Ok(self.comm.collective_recv(src, self.tag).await?.into_data())
    }
}

/// The error for a peer whose contribution has the wrong number of elements.
pub(crate) fn length_mismatch(src: usize, expected: usize, got: usize) -> Error {
    Error::InvalidArgument(format!(
        "rank {src} contributed {got} elements where {expected} were expected: every rank must \
         pass the same count"
    ))
}

/// Checks that `root` is a rank of a communicator of `size` ranks.
pub(crate) fn check_root(root: usize, size: usize) -> Result<(), Error> {
    if root < size {
        Ok(())
    } else {
        Err(Error::InvalidRank { rank: root, size })
    }
}

/// Copies bytes into a vector of elements (the bytes need not be aligned).
pub(crate) fn to_vec<T: bytemuck::Pod>(data: &[u8]) -> Result<Vec<T>, Error> {
    let elem = std::mem::size_of::<T>();
    if elem == 0 {
        return Ok(Vec::new());
    }
    if data.len() % elem != 0 {
        return Err(Error::Misaligned {
            len: data.len(),
            elem,
        });
    }
    Ok(elements_of(&[data]))
}

/// The elements whose bytes are `parts`, one after the other (a whole number of elements in
/// all, checked by the callers). Copied straight into fresh capacity: zeroing the vector first,
/// as safe code must, would add a pass over memory as long as the copy itself.
fn elements_of<T: bytemuck::Pod>(parts: &[&[u8]]) -> Vec<T> {
    let elem = std::mem::size_of::<T>();
    if elem == 0 {
        // No bytes to place (and a zero-sized vector's buffer is dangling): callers count
        // zero-sized elements themselves.
        return Vec::new();
    }
    let bytes: usize = parts.iter().map(|p| p.len()).sum();
    let len = bytes / elem;
    let mut v: Vec<T> = Vec::with_capacity(len);
    let dst = v.as_mut_ptr().cast::<u8>();
    let mut at = 0;
    for part in parts {
        let n = part.len().min(len * elem - at);
        // SAFETY: `dst` points at capacity for `len * elem` bytes and `at + n` stays within
        // it (`n` is clamped); a fresh vector's buffer cannot overlap `part`.
        unsafe { byte_copy::copy_raw(dst.add(at), part.as_ptr(), n) };
        at += n;
    }
    let filled = at / elem;
    // SAFETY: the first `filled` elements were written byte for byte above, and any bytes are
    // a valid `T` (`Pod`). (`filled == len` when the callers' lengths hold.)
    unsafe { v.set_len(filled) };
    v
}

/// The bytes of a slice of elements (in a pooled buffer when large: no allocation per call).
pub(crate) fn to_bytes<T: bytemuck::Pod>(data: &[T]) -> Bytes {
    BufferPool::shared().concat(&[bytemuck::cast_slice(data)])
}

/// Frames several blocks, each tagged with a number (usually the rank it belongs to), into
/// one message: `count: u32`, then `(id: u32, len: u64)` per block, then the blocks' bytes.
pub(crate) fn encode_blocks<'a>(blocks: impl IntoIterator<Item = (usize, &'a [u8])>) -> Bytes {
    let blocks: Vec<(usize, &[u8])> = blocks.into_iter().collect();
    let body: usize = blocks.iter().map(|(_, b)| b.len()).sum();
    let mut out = BytesMut::with_capacity(4 + 12 * blocks.len() + body);
    out.put_u32_le(blocks.len() as u32);
    for (id, b) in &blocks {
        out.put_u32_le(*id as u32);
        out.put_u64_le(b.len() as u64);
    }
    for (_, b) in &blocks {
        out.put_slice(b);
    }
    out.freeze()
}

/// Splits a message made by [`encode_blocks`] into its blocks (slices of `data`, no copy).
/// Anything inconsistent is [`Error::Protocol`] naming `from`, never a panic.
pub(crate) fn decode_blocks(from: usize, data: Bytes) -> Result<Vec<(usize, Bytes)>, Error> {
    let bad = |detail: &str| Error::Protocol {
        peer: from,
        detail: format!("malformed collective block set: {detail}"),
    };
    if data.len() < 4 {
        return Err(bad("shorter than its count"));
    }
    let count = u32::from_le_bytes(data[..4].try_into().unwrap_or_default()) as usize;
    let table = count
        .checked_mul(12)
        .and_then(|t| t.checked_add(4))
        .filter(|&t| t <= data.len())
        .ok_or_else(|| bad("block table longer than the message"))?;
    let mut blocks = Vec::with_capacity(count);
    let mut at = table;
    for i in 0..count {
        let e = &data[4 + 12 * i..4 + 12 * (i + 1)];
        let id = u32::from_le_bytes(e[..4].try_into().unwrap_or_default()) as usize;
        let len = u64::from_le_bytes(e[4..].try_into().unwrap_or_default());
        let end = usize::try_from(len)
            .ok()
            .and_then(|l| at.checked_add(l))
            .filter(|&end| end <= data.len())
            .ok_or_else(|| bad("block longer than the message"))?;
        blocks.push((id, data.slice(at..end)));
        at = end;
    }
    if at != data.len() {
        return Err(bad("bytes after the last block"));
    }
    Ok(blocks)
}

/// Decodes a block set from `from` that must hold exactly the blocks of `ranks`, in that order
/// (so each in range and present once); anything else is [`Error::Protocol`].
pub(crate) fn decode_expected_blocks(
    from: usize,
    message: Bytes,
    ranks: impl ExactSizeIterator<Item = usize>,
) -> Result<Vec<Bytes>, Error> {
    expected_blocks(from, decode_blocks(from, message)?, ranks)
}

/// [`decode_expected_blocks`] of blocks already decoded.
pub(crate) fn expected_blocks(
    from: usize,
    blocks: Vec<(usize, Bytes)>,
    ranks: impl ExactSizeIterator<Item = usize>,
) -> Result<Vec<Bytes>, Error> {
    let bad = |detail: String| Error::Protocol { peer: from, detail };
    if blocks.len() != ranks.len() {
        return Err(bad(format!(
            "{} blocks where {} were expected",
            blocks.len(),
            ranks.len()
        )));
    }
    blocks
        .into_iter()
        .zip(ranks)
        .map(|((id, block), expected)| {
            if id == expected {
                Ok(block)
            } else {
                Err(bad(format!(
                    "block {id} where block {expected} was expected"
                )))
            }
        })
        .collect()
}

/// Concatenates blocks that must each hold `count` elements (the block of rank i at index i);
/// another count means the ranks disagree about the collective's arguments.
pub(crate) fn concat_equal_blocks<T: bytemuck::Pod>(
    blocks: &[impl AsRef<[u8]>],
    count: usize,
) -> Result<Vec<T>, Error> {
    let elem = std::mem::size_of::<T>();
    let block_bytes = count * elem;
    if let Some((rank, block)) = blocks
        .iter()
        .map(AsRef::as_ref)
        .enumerate()
        .find(|(_, b)| b.len() != block_bytes)
    {
        if elem != 0 && block.len() % elem != 0 {
            return Err(Error::Misaligned {
                len: block.len(),
                elem,
            });
        }
        return Err(length_mismatch(rank, count, block.len() / elem.max(1)));
    }
    if elem == 0 {
        return Ok(vec![T::zeroed(); count * blocks.len()]);
    }
    let parts: Vec<&[u8]> = blocks.iter().map(AsRef::as_ref).collect();
    Ok(elements_of(&parts))
}

/// Waits for sends started earlier.
/// Adds `send` to `sends` unless it was handed off at once (an eager send): only sends that
/// still have something to report need awaiting, and a collective whose sends all went out
/// eagerly allocates no vector for them.
pub(crate) fn keep_pending(sends: &mut Vec<SendOp>, send: SendOp) {
    if !send.is_complete() {
        sends.push(send);
    }
}

pub(crate) async fn await_all(sends: Vec<SendOp>) -> Result<(), Error> {
    for send in sends {
        send.await?;
    }
    Ok(())
}

/// The powers of two below `n`: the distances (or bits) of the logarithmic algorithms' rounds.
pub(crate) fn powers_of_two_below(n: usize) -> impl Iterator<Item = usize> {
    std::iter::successors(Some(1usize), |d| d.checked_mul(2)).take_while(move |&d| d < n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_sets_round_trip_and_reject_garbage() {
        let a = [1u8, 2, 3];
        let enc = encode_blocks([(7, &a[..]), (0, &[][..]), (2, &[9u8][..])]);
        let dec = decode_blocks(1, enc.clone()).unwrap();
        assert_eq!(dec.len(), 3);
        assert_eq!((dec[0].0, &dec[0].1[..]), (7, &a[..]));
        assert_eq!((dec[1].0, dec[1].1.len()), (0, 0));
        assert_eq!((dec[2].0, &dec[2].1[..]), (2, &[9u8][..]));
        for cut in 0..enc.len() {
            assert!(decode_blocks(1, enc.slice(..cut)).is_err(), "cut at {cut}");
        }
        let mut long = enc.to_vec();
        long.push(0);
        assert!(decode_blocks(1, Bytes::from(long)).is_err());
        let huge = encode_blocks([]).to_vec();
        let mut h = huge.clone();
        h[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_blocks(1, Bytes::from(h)).is_err());
    }

    #[test]
    fn unaligned_bytes_become_elements() {
        let bytes = [0u8, 1, 0, 0, 0, 2, 0, 0, 0];
        let v: Vec<u32> = to_vec(&bytes[1..]).unwrap();
        assert_eq!(v, [1, 2]);
        assert!(matches!(
            to_vec::<u32>(&bytes[..3]),
            Err(Error::Misaligned { len: 3, elem: 4 })
        ));
    }

    #[test]
    fn equal_blocks_concatenate_and_mismatches_are_caught() {
        let blocks = [
            Bytes::from_static(&[1, 0, 2, 0]),
            Bytes::from_static(&[3, 0, 4, 0]),
            Bytes::from_static(&[5, 0, 6, 0]),
        ];
        let v: Vec<u16> = concat_equal_blocks(&blocks, 2).unwrap();
        assert_eq!(v, [1, 2, 3, 4, 5, 6]);
        let uneven = [blocks[0].clone(), blocks[1].slice(..2)];
        assert!(concat_equal_blocks::<u16>(&uneven, 2).is_err());
        let odd = [blocks[0].clone(), blocks[1].slice(..3)];
        assert!(matches!(
            concat_equal_blocks::<u16>(&odd, 2),
            Err(Error::Misaligned { len: 3, elem: 2 })
        ));
        let units: Vec<()> = concat_equal_blocks(&[Bytes::new(), Bytes::new()], 3).unwrap();
        assert_eq!(units.len(), 6, "zero-sized elements keep their count");
    }
}
