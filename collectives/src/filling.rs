//! [`Filling`]: a result vector of blocks written in place, block by block — copied in,
//! or read straight from a peer's memory (see [`crate::exposure`]) — in the vector's spare
//! capacity, and given its length only once every block is there. A zeroed vector would cost a
//! pass over the whole result before the real writes (a fifth of a two-rank all-gather's time
//! at 1 MiB).

use std::mem::MaybeUninit;

use rankweave_core::{Error, byte_copy};

use crate::Element;
use crate::ctx::Ctx;

/// A vector of blocks being written (see the [module docs](self)).
pub(crate) struct Filling<T> {
    result: Vec<T>,
    /// Block `q` is elements `bounds[q]..bounds[q + 1]`.
    bounds: Vec<usize>,
    /// Which blocks have been written.
    written: Vec<bool>,
}

impl<T: Element> Filling<T> {
    /// Room for `blocks` blocks of `count` elements, none written yet.
    pub(crate) fn new(blocks: usize, count: usize) -> Filling<T> {
        Self::with_bounds((0..=blocks).map(|b| b * count).collect())
    }

    /// Room for the blocks that `bounds` cuts (block `q` is elements `bounds[q]..bounds[q +
    /// 1]`; `bounds` starts at 0 and never decreases), none written yet.
    pub(crate) fn with_bounds(bounds: Vec<usize>) -> Filling<T> {
        let blocks = bounds.len().saturating_sub(1);
        Filling {
            result: Vec::with_capacity(bounds.last().copied().unwrap_or(0)),
            bounds,
            written: vec![false; blocks],
        }
    }

    /// Elements per block, of a filling of equal blocks.
    pub(crate) fn count(&self) -> usize {
        self.bounds.get(1).copied().unwrap_or(0)
    }

    /// The address of the vector's first element (where peers read it from).
    pub(crate) fn address(&self) -> u64 {
        self.result.as_ptr() as u64
    }

    /// Block `q`'s elements.
    fn elements(&self, q: usize) -> std::ops::Range<usize> {
        self.bounds[q]..self.bounds[q + 1]
    }

    /// Block `q` of the spare capacity, as bytes.
    fn block_mut(&mut self, q: usize) -> &mut [MaybeUninit<u8>] {
        let elements = self.elements(q);
        let bytes = elements.len() * size_of::<T>();
        let block = &mut self.result.spare_capacity_mut()[elements];
        // SAFETY: the block's elements span exactly `bytes` bytes, and `MaybeUninit<u8>` has
        // no alignment or validity requirement, so any bytes of them may be viewed as it.
        unsafe { std::slice::from_raw_parts_mut(block.as_mut_ptr().cast(), bytes) }
    }

    /// Copies `src` (one block) into block `q`.
    pub(crate) fn copy_block(&mut self, q: usize, src: &[T]) {
        self.copy_block_bytes(q, bytemuck::cast_slice(src));
    }

    /// Copies `src`, the bytes of one block, into block `q`.
    pub(crate) fn copy_block_bytes(&mut self, q: usize, src: &[u8]) {
        let dst = self.block_mut(q);
        assert_eq!(dst.len(), src.len(), "a block of another length");
        // SAFETY: `dst` is writable for `src.len()` bytes (checked above) and, being spare
        // capacity of a vector borrowed mutably, overlaps nothing `src` borrows.
        unsafe { byte_copy::copy_raw(dst.as_mut_ptr().cast(), src.as_ptr(), src.len()) };
        self.written[q] = true;
    }

    /// Reads block `q` from `addr` in rank `q`'s memory.
    pub(crate) fn read_block(&mut self, cx: &Ctx, q: usize, addr: u64) -> Result<(), Error> {
        cx.comm.read_memory_of_uninit(q, addr, self.block_mut(q))?;
        self.written[q] = true;
        Ok(())
    }

    /// Block `q` as bytes, if it has been written.
    pub(crate) fn block(&self, q: usize) -> Option<&[u8]> {
        if !self.written.get(q).copied().unwrap_or(false) {
            return None;
        }
        let elements = self.elements(q);
        // SAFETY: block `q` of the allocation was written (`written[q]`) and nothing writes it
        // while `self` is borrowed; a `Pod` element's bytes are all initialized.
        Some(unsafe {
            std::slice::from_raw_parts(
                self.result.as_ptr().add(elements.start).cast(),
                elements.len() * size_of::<T>(),
            )
        })
    }

    /// The whole vector, once every block is written; `Error::Protocol` naming the block's rank
    /// if one is missing (its reads were not all made).
    pub(crate) fn finish(mut self) -> Result<Vec<T>, Error> {
        if let Some(q) = self.written.iter().position(|w| !w) {
            return Err(Error::Protocol {
                peer: q,
                detail: "its block was never read in".into(),
            });
        }
        // SAFETY: every block of the capacity has been written (`written` is all true), and any
        // bytes are a valid `Pod` element.
        unsafe {
            self.result
                .set_len(self.bounds.last().copied().unwrap_or(0))
        };
        Ok(self.result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_filling_is_whole_only_once_every_block_is_written() {
        let mut f = Filling::<u32>::new(3, 2);
        f.copy_block(2, &[5, 6]);
        f.copy_block(0, &[1, 2]);
        assert_eq!(f.block(0), Some(bytemuck::cast_slice(&[1u32, 2][..])));
        assert_eq!(f.block(1), None);
        assert_eq!(f.block(7), None);
        let mut g = Filling::<u32>::new(2, 1);
        g.copy_block(1, &[9]);
        match g.finish() {
            Err(Error::Protocol { peer: 0, .. }) => {}
            other => panic!("{other:?}"),
        }
        f.copy_block(1, &[3, 4]);
        assert_eq!(f.finish().unwrap(), [1, 2, 3, 4, 5, 6]);
        // No blocks at all.
        assert_eq!(
            Filling::<u64>::new(0, 5).finish().unwrap(),
            Vec::<u64>::new()
        );
        // Blocks of different lengths, one of them empty.
        let mut h = Filling::<u16>::with_bounds(vec![0, 2, 2, 5]);
        h.copy_block(2, &[7, 8, 9]);
        h.copy_block_bytes(0, bytemuck::cast_slice(&[1u16, 2]));
        assert_eq!(h.block(2), Some(bytemuck::cast_slice(&[7u16, 8, 9][..])));
        h.copy_block(1, &[]);
        assert_eq!(h.finish().unwrap(), [1, 2, 7, 8, 9]);
    }
}
