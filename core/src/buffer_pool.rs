//! Receive buffers for large messages, reused instead of freed.
//!
//! A large message lands in a fresh buffer of its size (a shared-memory single-copy read, a
//! rendezvous message reassembled from fragments). Allocators hand
//! buffers of a megabyte and more straight from the kernel (`mmap`) and give them back on free,
//! so every such message would pay a page fault and a page clear per 4 KiB — more than the copy
//! itself. The pool keeps buffers that the application has dropped (the `Bytes` it received
//! owns a pooled buffer that goes back here when the last reference goes) in power-of-two
//! size classes, up to a bound, and hands them out again already faulted in. MPI libraries get
//! the same effect from the application reusing its receive buffer.

use std::sync::{Arc, Mutex, OnceLock};

use bytes::{Buf, Bytes, BytesMut};

use crate::byte_copy;

/// Buffers smaller than this come from the allocator directly: they are cheap to get. From a
/// page up they are pooled: a window of outstanding 16 KiB receives, freed together, is enough
/// for glibc to trim its heap and fault every page in again on the next window (shared-memory
/// bandwidth at 16 KiB went from ~2 to ~5 GB/s), and the pool's lock is cheap next to copying
/// a page.
pub const POOLED_FROM: usize = 4 * 1024;

/// Bytes of buffers the pool keeps at most (beyond that, returned buffers are freed).
const KEEP_BYTES: usize = 256 * 1024 * 1024;

/// Room a pooled buffer has beyond its size class: where [`BufferPool::take_lined_up`] moves
/// the start of the data to line it up with its source (see [`byte_copy::aligned_skip`]), so
/// that a power-of-two message still fits its class.
const SLACK: usize = byte_copy::LINE_UP;

/// The size class of a pooled buffer's capacity, or `None` for a buffer the pool did not
/// make (not pooled).
fn class_of(capacity: usize) -> Option<usize> {
    let size = capacity.checked_sub(SLACK)?;
    (size >= POOLED_FROM && size.is_power_of_two()).then(|| size.trailing_zeros() as usize)
}

/// See the [module docs](self).
#[derive(Debug, Default)]
pub struct BufferPool {
    inner: Mutex<Classes>,
}

#[derive(Debug, Default)]
struct Classes {
    /// `free[c]` holds buffers of capacity `2^c`.
    free: Vec<Vec<Vec<u8>>>,
    kept: usize,
}

impl BufferPool {
    /// The process's pool, shared by every rank's endpoint (reassembly) and by the
    /// collectives, so their bound on kept bytes holds per process however many in-process
    /// ranks run. (Each shared-memory and UDP transport keeps a pool of its own.) Borrowed:
    /// a small message built with it (`shared().concat(..)`) costs no reference count; clone
    /// it to keep it.
    pub fn shared() -> &'static Arc<BufferPool> {
        static SHARED: OnceLock<Arc<BufferPool>> = OnceLock::new();
        SHARED.get_or_init(Arc::default)
    }

    /// `parts` one after the other in one buffer (pooled when large): how a message is built
    /// from a header and a payload without a fresh allocation per message.
    pub fn concat(self: &Arc<Self>, parts: &[&[u8]]) -> Bytes {
        let len = parts.iter().map(|p| p.len()).sum();
        let Some(mut buf) = self.take(len) else {
            // As much memory as the payload itself cannot be had: fail as `Vec` would.
            return Bytes::from(parts.concat());
        };
        for part in parts {
            byte_copy::extend_bytes(&mut buf, part);
        }
        self.freeze(buf)
    }

    /// An empty buffer with room for at least `len` bytes, or `None` if that much memory
    /// cannot be had.
    pub fn take(self: &Arc<Self>, len: usize) -> Option<Vec<u8>> {
        if len < POOLED_FROM {
            // Below a page, failing to allocate aborts anyway (as it would a moment later for
            // any other small allocation); `with_capacity` is a plain `malloc`, where
            // `try_reserve_exact` on an empty vector takes the growth path (some 200
            // instructions more per small collective message).
            return Some(Vec::with_capacity(len));
        }
        let class = len.checked_next_power_of_two()?.trailing_zeros() as usize;
        {
            let mut c = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(v) = c.free.get_mut(class).and_then(Vec::pop) {
                c.kept -= 1 << class;
                return Some(v);
            }
        }
        let mut v = Vec::new();
        v.try_reserve_exact((1usize << class) + SLACK)
            .ok()
            .map(|()| v)
    }

    /// A buffer for `len` bytes that a copy this process does not steer (the kernel's, for
    /// `process_vm_readv`) will fill from address `src`: filled with as many zeros as put the
    /// data's start at `src`'s offset modulo 64 (returned as the skip), with room for `len`
    /// bytes after them. [`freeze_after`](Self::freeze_after) drops the zeros again.
    pub fn take_lined_up(self: &Arc<Self>, len: usize, src: u64) -> Option<(Vec<u8>, usize)> {
        // A pooled buffer has the slack already; a small one gets it here.
        let mut buf = self.take(len)?;
        let room = len.checked_add(SLACK)?;
        if buf.capacity() < room {
            buf.try_reserve_exact(room).ok()?;
        }
        let skip = byte_copy::aligned_skip(buf.as_ptr(), src as usize);
        buf.resize(skip, 0);
        Some((buf, skip))
    }

    /// [`freeze`](Self::freeze), without the first `skip` bytes (a
    /// [`take_lined_up`](Self::take_lined_up) buffer's).
    pub fn freeze_after(self: &Arc<Self>, buf: Vec<u8>, skip: usize) -> Bytes {
        let mut b = self.freeze(buf);
        b.advance(skip);
        b
    }

    /// Wraps a filled buffer as `Bytes` that returns it to the pool when dropped.
    pub fn freeze(self: &Arc<Self>, buf: Vec<u8>) -> Bytes {
        if class_of(buf.capacity()).is_none() {
            return Bytes::from(buf);
        }
        Bytes::from_owner(Pooled {
            buf,
            pool: Arc::clone(self),
        })
    }

    fn give_back(&self, mut buf: Vec<u8>) {
        let Some(class) = class_of(buf.capacity()) else {
            return;
        };
        // Counted by class, slack left out.
        let cap = 1usize << class;
        if cap > KEEP_BYTES {
            return;
        }
        let mut c = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if c.free.len() <= class {
            c.free.resize_with(class + 1, Vec::new);
        }
        // Over the bound: make room by freeing buffers of other sizes (the application has
        // moved on to this one), else drop this one.
        while c.kept + cap > KEEP_BYTES {
            let Some(other) = (0..c.free.len())
                .filter(|&k| k != class && !c.free[k].is_empty())
                .max_by_key(|&k| c.free[k].len() << k)
            else {
                return;
            };
            if c.free[other].pop().is_some() {
                c.kept -= 1 << other;
            }
        }
        buf.clear();
        c.kept += cap;
        c.free[class].push(buf);
    }

    /// Gives a buffer from [`take`](Self::take) back without wrapping it in `Bytes` first
    /// (scratch space).
    pub fn recycle(&self, buf: Vec<u8>) {
        self.give_back(buf);
    }

    /// Bytes of buffers kept for reuse.
    pub fn kept(&self) -> usize {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).kept
    }
}

/// A pooled buffer owned by a `Bytes`; back to the pool on drop.
struct Pooled {
    buf: Vec<u8>,
    pool: Arc<BufferPool>,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        self.pool.give_back(std::mem::take(&mut self.buf));
    }
}

/// Bytes of each chunk [`SmallCopies`] copies into.
const SMALL_CHUNK: usize = 16 * 1024;

/// Copies of small payloads (out of a ring, say) packed into shared chunks: one allocation
/// per chunk instead of one per message (a message's `Bytes` keeps its chunk alive, so chunks
/// are kept small: a message the application holds on to does not hold much else).
#[derive(Debug, Default)]
pub struct SmallCopies {
    chunk: BytesMut,
}

impl SmallCopies {
    /// A copy of `data`.
    pub fn copy(&mut self, data: &[u8]) -> Bytes {
        if data.is_empty() {
            return Bytes::new();
        }
        if self.chunk.capacity() < data.len() {
            self.chunk = BytesMut::with_capacity(SMALL_CHUNK.max(data.len()));
        }
        let spare = &mut self.chunk.spare_capacity_mut()[..data.len()];
        // SAFETY: `spare` is `data.len()` bytes of the chunk's spare capacity (checked above),
        // written in full before `set_len` counts them; it cannot overlap `data`, which the
        // caller borrows while the chunk is borrowed mutably here.
        unsafe {
            byte_copy::copy_raw(spare.as_mut_ptr().cast(), data.as_ptr(), data.len());
            self.chunk.set_len(self.chunk.len() + data.len());
        }
        self.chunk.split().freeze()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_buffers_come_back_and_are_reused() {
        let pool = Arc::new(BufferPool::default());
        let mut v = pool.take(1_000_000).unwrap();
        assert!(v.capacity() >= 1_000_000);
        v.extend(std::iter::repeat_n(7u8, 1_000_000));
        let addr = v.as_ptr();
        let bytes = pool.freeze(v);
        let slice = bytes.slice(10..20);
        drop(bytes);
        assert_eq!(pool.kept(), 0, "a slice still holds the buffer");
        assert_eq!(&slice[..], &[7u8; 10]);
        drop(slice);
        assert_eq!(pool.kept(), 1 << 20);
        let again = pool.take(600_000).unwrap();
        assert_eq!(again.as_ptr(), addr, "the same buffer, reused");
        assert!(again.is_empty());
        assert_eq!(pool.kept(), 0);
        // Over the bound, buffers of another size make room for the new one.
        let mut many: Vec<Bytes> = (0..(KEEP_BYTES >> 20))
            .map(|_| {
                let mut v = pool.take(1 << 20).unwrap();
                v.push(1);
                pool.freeze(v)
            })
            .collect();
        many.clear();
        assert_eq!(pool.kept(), KEEP_BYTES);
        let mut big = pool.take(4 << 20).unwrap();
        big.push(1);
        drop(pool.freeze(big));
        assert_eq!(pool.kept(), KEEP_BYTES);
        assert_eq!(
            pool.inner.lock().unwrap().free[22].len(),
            1,
            "the 4 MiB buffer is kept"
        );
        // Small buffers are not pooled.
        let kept = pool.kept();
        let small = pool.take(100).unwrap();
        drop(pool.freeze(small));
        assert_eq!(pool.kept(), kept);
    }

    #[test]
    fn lined_up_buffers_start_at_their_sources_offset() {
        let pool = Arc::new(BufferPool::default());
        for (len, src) in [
            (1 << 20, 0x7f00_0000_1010u64),
            (100, 0x1234),
            (70_000, 0x40),
        ] {
            let (mut buf, skip) = pool.take_lined_up(len, src).unwrap();
            assert_eq!(buf.len(), skip);
            assert!(buf.iter().all(|&b| b == 0));
            assert_eq!((buf.as_ptr() as u64 + skip as u64) % 64, src % 64);
            assert!(
                buf.capacity() >= skip + len,
                "room for the data after the skip"
            );
            let at = buf.as_ptr();
            buf.extend(std::iter::repeat_n(5u8, len));
            let b = pool.freeze_after(buf, skip);
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&x| x == 5));
            // SAFETY: only comparing addresses.
            assert_eq!(b.as_ptr(), unsafe { at.add(skip) });
        }
        // The 1 MiB and 128 KiB buffers came back, counted by their classes.
        assert_eq!(pool.kept(), (1 << 20) + (128 << 10));
        let (again, _) = pool.take_lined_up(1 << 20, 0).unwrap();
        assert!(again.capacity() >= (1 << 20) + SLACK);
        pool.recycle(again);
        assert_eq!(pool.kept(), (1 << 20) + (128 << 10));
    }

    #[test]
    fn concat_joins_parts_into_a_pooled_buffer() {
        let pool = Arc::new(BufferPool::default());
        let body = vec![9u8; 100_000];
        let joined = pool.concat(&[b"head", &body, b"!"]);
        assert_eq!(joined.len(), 100_005);
        assert_eq!(&joined[..4], b"head");
        assert_eq!(&joined[4..100_004], &body[..]);
        assert_eq!(joined[100_004], b'!');
        drop(joined);
        assert_eq!(pool.kept(), 128 << 10, "the buffer went back to the pool");
        assert_eq!(&pool.concat(&[b"a", b"", b"bc"])[..], b"abc");
        assert_eq!(pool.kept(), 128 << 10, "small messages are not pooled");
    }
}
