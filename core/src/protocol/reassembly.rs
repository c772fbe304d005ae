//! Reassembly of a rendezvous message from data fragments that may arrive in any order.

use bytes::Bytes;

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
#[derive(Debug)]
pub struct Reassembler {
    len: usize,
    whole: Option<Bytes>,
    buf: Option<Vec<u8>>,
    /// Received byte ranges, sorted and merged (usually a single range: fragments come in order).
    ranges: Vec<(usize, usize)>,
    received: usize,
}

impl Reassembler {
    /// Prepares for a message of `len` bytes.
    pub fn new(len: usize) -> Self {
        Reassembler {
            len,
            whole: None,
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
            let mut v = Vec::new();
            v.try_reserve_exact(self.len)
                .map_err(|_| FragmentError::NoMemory)?;
            v.resize(self.len, 0);
            self.buf = Some(v);
        }
        let Some(buf) = self.buf.as_mut() else {
            return Err(FragmentError::NoMemory);
        };
        buf[offset..end].copy_from_slice(&data);
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

    /// The assembled message; call once [`is_complete`](Self::is_complete).
    pub fn finish(self) -> Bytes {
        match (self.whole, self.buf) {
            (Some(whole), _) => whole,
            (None, Some(buf)) => Bytes::from(buf),
            (None, None) => Bytes::new(),
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
        let mut r = Reassembler::new(100);
        r.insert(0, data).unwrap();
        assert!(r.is_complete());
        assert_eq!(r.finish().as_ptr(), ptr);
    }

    #[test]
    fn out_of_order_fragments_assemble() {
        let msg: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
        let mut r = Reassembler::new(1000);
        for &(s, e) in &[(600, 1000), (0, 300), (300, 600)] {
            r.insert(s, Bytes::copy_from_slice(&msg[s..e])).unwrap();
        }
        assert!(r.is_complete());
        assert_eq!(&r.finish()[..], &msg[..]);
    }

    #[test]
    fn bad_fragments_are_refused() {
        let mut r = Reassembler::new(10);
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
    fn empty_message_completes_on_its_empty_fragment() {
        let mut r = Reassembler::new(0);
        assert!(!r.is_complete());
        r.insert(0, Bytes::new()).unwrap();
        assert!(r.is_complete());
        assert!(r.finish().is_empty());
    }
}
