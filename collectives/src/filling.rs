//! [`Filling`]: a result vector of equal blocks written in place, block by block — copied in,
//! or read straight from a peer's memory (see [`crate::exposure`]) — in the vector's spare
//! capacity, and given its length only once every block is there. A zeroed vector would cost a
//! pass over the whole result before the real writes (a fifth of a two-rank all-gather's time
//! at 1 MiB).

use std::mem::MaybeUninit;

use rankweave_core::{Error, byte_copy};

use crate::Element;
use crate::ctx::Ctx;

/// A vector of `blocks` blocks of `count` elements being written (see the [module docs](self)).
pub(crate) struct Filling<T> {
    result: Vec<T>,
    count: usize,
    /// Which blocks have been written.
    written: Vec<bool>,
}

impl<T: Element> Filling<T> {
    /// Room for `blocks` blocks of `count` elements, none written yet.
    pub(crate) fn new(blocks: usize, count: usize) -> Filling<T> {
        Filling {
            result: Vec::with_capacity(blocks * count),
            count,
            written: vec![false; blocks],
        }
    }

    /// Elements per block.
    pub(crate) fn count(&self) -> usize {
        self.count
    }

    /// The address of the vector's first element (where peers read it from).
    pub(crate) fn address(&self) -> u64 {
        self.result.as_ptr() as u64
    }

    /// Bytes per block.
    fn block_bytes(&self) -> usize {
        self.count * size_of::<T>()
    }

    /// Block `q` of the spare capacity, as bytes.
    fn block_mut(&mut self, q: usize) -> &mut [MaybeUninit<u8>] {
        let bytes = self.block_bytes();
        let block = &mut self.result.spare_capacity_mut()[q * self.count..][..self.count];
        // SAFETY: the block's elements span exactly `bytes` bytes, and `MaybeUninit<u8>` has
        // no alignment or validity requirement, so any bytes of them may be viewed as it.
        unsafe { std::slice::from_raw_parts_mut(block.as_mut_ptr().cast(), bytes) }
    }

    /// Copies `src` (one block) into block `q`.
    pub(crate) fn copy_block(&mut self, q: usize, src: &[T]) {
        let src: &[u8] = bytemuck::cast_slice(src);
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
        // SAFETY: block `q` of the allocation was written (`written[q]`) and nothing writes it
        // while `self` is borrowed; a `Pod` element's bytes are all initialized.
        Some(unsafe {
            std::slice::from_raw_parts(
                self.result.as_ptr().add(q * self.count).cast(),
                self.block_bytes(),
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
        unsafe { self.result.set_len(self.written.len() * self.count) };
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
    }
}
