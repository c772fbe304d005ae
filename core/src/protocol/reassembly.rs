//! Reassembly of a rendezvous message from data fragments that may arrive in any order.

use std::sync::Arc;

use bytes::Bytes;

use crate::buffer_pool::BufferPool;

/// Why a fragment was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FragmentError {
    /// The fragment reaches past the message's end.
    OutOfBounds,
    /// The fragment overlaps bytes that already arrived.
    Overlap,
    /// The message buffer could not be allocated (a huge or forged length).
    NoMemory,
}

/// Collects the fragments of one message into a buffer.
///
/// A message that arrives as one fragment is kept as that fragment's `Bytes` (no copy), which is
/// how in-process transfers stay zero-copy. Otherwise fragments are copied into place and the
/// received ranges are tracked, so a duplicate or overlapping fragment is refused instead of
/// silently corrupting the count.
///
/// The buffer comes from the rank's [`BufferPool`] and is never zeroed: fragments are written
/// into its spare capacity, and its length is set once the tracked ranges cover every byte.
/// A large message therefore costs one copy per byte, without the page faults and page
/// clearing a fresh multi-megabyte allocation pays.
#[derive(Debug)]
pub struct Reassembler {
    len: usize,
    whole: Option<Bytes>,
    pool: Arc<BufferPool>,
    /// Empty, with capacity for `len` bytes; bytes in `ranges` of its spare capacity are written.
    buf: Option<Vec<u8>>,
    /// Received byte ranges, sorted and merged (usually a single range: fragments come in order).
    ranges: Vec<(usize, usize)>,
    received: usize,
}

impl Reassembler {
    /// Prepares for a message of `len` bytes, its buffer to come from `pool`.
    pub fn new(len: usize, pool: Arc<BufferPool>) -> Self {
        Reassembler {
            len,
            whole: None,
            pool,
            buf: None,
            ranges: Vec::new(),
            received: 0,
        }
    }

    /// The message length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the message is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes received so far.
    pub fn received(&self) -> usize {
        self.received
    }

    /// Whether every byte has arrived (an empty message is complete once its single empty
    /// fragment arrives; see [`insert`](Self::insert)).
    pub fn is_complete(&self) -> bool {
        self.received == self.len && (self.len > 0 || self.whole.is_some())
    }

    /// Adds the fragment at `offset`.
    pub fn insert(&mut self, offset: usize, data: Bytes) -> Result<(), FragmentError> {
        let end = offset
            .checked_add(data.len())
            .ok_or(FragmentError::OutOfBounds)?;
        if end > self.len {
            return Err(FragmentError::OutOfBounds);
        }
        if self.received == 0 && offset == 0 && data.len() == self.len && self.whole.is_none() {
            self.received = self.len;
            self.whole = Some(data);
            return Ok(());
        }
        if self.whole.is_some() {
            return Err(FragmentError::Overlap);
        }
        if data.is_empty() {
            return Ok(());
        }
        self.add_range(offset, end)?;
        if self.buf.is_none() {
            // Fallible: a forged length must fail this message, not abort the process.
            self.buf = Some(self.pool.take(self.len).ok_or(FragmentError::NoMemory)?);
        }
        let Some(buf) = self.buf.as_mut() else {
            return Err(FragmentError::NoMemory);
        };
        let spare = &mut buf.spare_capacity_mut()[..self.len];
        // SAFETY: `offset..end` lies within the `len` bytes of spare capacity (checked against
        // `len` above), and a `u8` slice may be copied into `MaybeUninit<u8>` of the same length.
        unsafe {
            crate::byte_copy::copy_raw(
                spare[offset..end].as_mut_ptr().cast::<u8>(),
                data.as_ptr(),
                data.len(),
            );
        }
        self.received += data.len();
        Ok(())
    }

    fn add_range(&mut self, start: usize, end: usize) -> Result<(), FragmentError> {
        let i = self.ranges.partition_point(|&(_, e)| e <= start);
        if let Some(&(s, _)) = self.ranges.get(i) {
            if s < end {
                return Err(FragmentError::Overlap);
            }
        }
        // Merge with neighbours that touch.
        let merge_left = i > 0 && self.ranges[i - 1].1 == start;
        let merge_right = self.ranges.get(i).is_some_and(|&(s, _)| s == end);
        match (merge_left, merge_right) {
            (true, true) => {
                self.ranges[i - 1].1 = self.ranges[i].1;
                self.ranges.remove(i);
            }
            (true, false) => self.ranges[i - 1].1 = end,
            (false, true) => self.ranges[i].0 = start,
            (false, false) => self.ranges.insert(i, (start, end)),
        }
        Ok(())
    }

    /// The assembled message; call once [`is_complete`](Self::is_complete) (before, the bytes
    /// received so far are dropped and an empty message returned).
    pub fn finish(self) -> Bytes {
        match (self.whole, self.buf) {
            (Some(whole), _) => whole,
            (None, Some(mut buf)) if self.received == self.len => {
                // SAFETY: the ranges are disjoint (overlaps are refused) and add up to `len`
                // bytes within `0..len`, so every one of the first `len` bytes was written.
                unsafe { buf.set_len(self.len) };
                self.pool.freeze(buf)
            }
            _ => Bytes::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_fragment_is_zero_copy() {
        let data = Bytes::from(vec![7u8; 100]);
        let ptr = data.as_ptr();
        let mut r = Reassembler::new(100, Arc::default());
        r.insert(0, data).unwrap();
        assert!(r.is_complete());
        assert_eq!(r.finish().as_ptr(), ptr);
    }

    #[test]
    fn out_of_order_fragments_assemble() {
        let msg: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
        let mut r = Reassembler::new(1000, Arc::default());
        for &(s, e) in &[(600, 1000), (0, 300), (300, 600)] {
            r.insert(s, Bytes::copy_from_slice(&msg[s..e])).unwrap();
        }
        assert!(r.is_complete());
        assert_eq!(&r.finish()[..], &msg[..]);
    }

    #[test]
    fn bad_fragments_are_refused() {
        let mut r = Reassembler::new(10, Arc::default());
        assert_eq!(
            r.insert(8, Bytes::from_static(b"abc")),
            Err(FragmentError::OutOfBounds)
        );
        r.insert(0, Bytes::from_static(b"abcd")).unwrap();
        assert_eq!(
            r.insert(2, Bytes::from_static(b"xy")),
            Err(FragmentError::Overlap)
        );
        assert_eq!(
            r.insert(usize::MAX, Bytes::from_static(b"x")),
            Err(FragmentError::OutOfBounds)
        );
        assert!(!r.is_complete());
        r.insert(4, Bytes::from_static(b"efghij")).unwrap();
        assert!(r.is_complete());
        assert_eq!(&r.finish()[..], b"abcdefghij");
    }

    #[test]
    fn large_messages_reuse_the_buffer_of_a_dropped_one() {
        let pool = Arc::new(BufferPool::default());
        let len = 1 << 20;
        let assemble = |fill: u8| {
            let mut r = Reassembler::new(len, Arc::clone(&pool));
            for start in (0..len).step_by(64 << 10).rev() {
                let piece = vec![fill; (64 << 10).min(len - start)];
                r.insert(start, Bytes::from(piece)).unwrap();
            }
            assert!(r.is_complete());
            r.finish()
        };
        let first = assemble(1);
        assert!(first.iter().all(|&b| b == 1));
        let addr = first.as_ptr();
        drop(first);
        let second = assemble(2);
        assert_eq!(second.as_ptr(), addr, "the first message's buffer, reused");
        assert_eq!(second.len(), len);
        assert!(
            second.iter().all(|&b| b == 2),
            "no byte of the first message left"
        );
        // An incomplete message gives nothing.
        let mut r = Reassembler::new(len, Arc::clone(&pool));
        r.insert(0, Bytes::from(vec![3u8; 10])).unwrap();
        assert!(r.finish().is_empty());
    }

    #[test]
    fn empty_message_completes_on_its_empty_fragment() {
        let mut r = Reassembler::new(0, Arc::default());
        assert!(!r.is_complete());
        r.insert(0, Bytes::new()).unwrap();
        assert!(r.is_complete());
        assert!(r.finish().is_empty());
    }
}
