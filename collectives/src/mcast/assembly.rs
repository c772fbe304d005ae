//! [`Assembly`]: the fragments of one broadcast a rank holds, with the bitmap of which.

use bytes::{Bytes, BytesMut};

use super::wire::Fragment;

/// The fragments of one broadcast held so far (Hoefler et al.'s process-local status bitmap).
#[derive(Debug)]
pub(crate) struct Assembly {
    pub root: u32,
    pub count: u32,
    pub size: u32,
    pub total: u64,
    frags: Vec<Option<Bytes>>,
    have: u32,
    held_bytes: usize,
}

impl Assembly {
    /// An empty assembly shaped like `f` (root, count, size and total length).
    pub fn shaped_like(f: &Fragment) -> Assembly {
        Assembly {
            root: f.root,
            count: f.count,
            size: f.size,
            total: f.total,
            frags: vec![None; f.count as usize],
            have: 0,
            held_bytes: 0,
        }
    }

    /// The root's assembly: all of `data`, cut into fragments of `size` bytes.
    pub fn whole(bid: u64, root: u32, data: &Bytes, size: usize) -> Assembly {
        let frags = Fragment::split(bid, root, data, size);
        let mut asm = Assembly::shaped_like(&frags[0]);
        for f in frags {
            asm.insert(f);
        }
        asm
    }

    /// Whether `f` belongs to a broadcast of this shape (a fragment that disagrees is forged
    /// or from a confused peer).
    pub fn fits(&self, f: &Fragment) -> bool {
        (f.root, f.count, f.size, f.total) == (self.root, self.count, self.size, self.total)
    }

    /// Stores `f` (which must [`fit`](Self::fits)); `false` if it was there already.
    pub fn insert(&mut self, f: Fragment) -> bool {
        let slot = &mut self.frags[f.seq as usize];
        if slot.is_some() {
            return false;
        }
        self.held_bytes += f.data.len();
        *slot = Some(f.data);
        self.have += 1;
        true
    }

    pub fn is_complete(&self) -> bool {
        self.have == self.count
    }

    /// Bytes of fragment data held.
    pub fn held_bytes(&self) -> usize {
        self.held_bytes
    }

    /// Sequence numbers not held yet.
    pub fn missing(&self) -> impl Iterator<Item = u32> + '_ {
        self.frags
            .iter()
            .enumerate()
            .filter(|(_, f)| f.is_none())
            .map(|(i, _)| i as u32)
    }

    /// Fragment `seq` as a packet, if held.
    pub fn fragment(&self, bid: u64, seq: u32) -> Option<Fragment> {
        let data = self.frags.get(seq as usize)?.clone()?;
        Some(Fragment {
            bid,
            root: self.root,
            seq,
            count: self.count,
            size: self.size,
            total: self.total,
            data,
        })
    }

    /// The whole broadcast (no copy when it is one fragment). Only when complete.
    pub fn data(&self) -> Bytes {
        match &self.frags[..] {
            [Some(only)] => only.clone(),
            frags => {
                let mut out = BytesMut::with_capacity(self.total as usize);
                for f in frags.iter().flatten() {
                    out.extend_from_slice(f);
                }
                out.freeze()
            }
        }
    }
}
