//! [`Input`]: where an all-reduce keeps its copy of the caller's vector.
//!
//! The caller may change or free its slice as soon as the call returns, so the all-reduce
//! copies it at the call. A [direct](super::direct) all-reduce exposes that copy to its
//! peers' reads; copied into this rank's [arena](rankweave_core::arena), it is where the peers
//! have it mapped, and they read it with loads instead of `process_vm_readv`. The arena is
//! one per rank: a second direct all-reduce in flight, a vector larger than the arena, or a
//! transport without one gets a vector of its own, read the old way.

use std::marker::PhantomData;
use std::ops::Range;

use rankweave_core::{ArenaLease, byte_copy};

use crate::Element;
use crate::ctx::Ctx;
use crate::exposure::Exposure;

/// A rank's copy of its input vector (see the [module docs](self)).
pub(crate) enum Input<T> {
    /// In a vector of its own.
    Owned(Vec<T>),
    /// At the start of this rank's arena, held until the all-reduce ends.
    Arena {
        lease: ArenaLease,
        len: usize,
        elements: PhantomData<T>,
    },
}

impl<T: Element> Input<T> {
    /// Copies `data`: into this rank's arena if `to_arena` (an all-reduce by direct reads)
    /// and the arena is there, free and large enough; else into a vector.
    pub(crate) fn copy(cx: &Ctx, data: &[T], to_arena: bool) -> Input<T> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        if to_arena && !bytes.is_empty() {
            if let Some(mut lease) = cx.comm.lease_arena().filter(|l| l.len() >= bytes.len()) {
                byte_copy::copy_slice(&mut lease.bytes_mut()[..bytes.len()], bytes);
                let input = Input::Arena {
                    lease,
                    len: data.len(),
                    elements: PhantomData,
                };
                // The arena starts on a page, aligned for any element; checked all the same,
                // since a view of the wrong alignment would panic.
                if bytemuck::try_cast_slice::<u8, T>(input.arena_bytes()).is_ok() {
                    return input;
                }
            }
        }
        Input::Owned(byte_copy::vec_from(data))
    }

    /// Elements in the vector.
    pub(crate) fn len(&self) -> usize {
        match self {
            Input::Owned(v) => v.len(),
            Input::Arena { len, .. } => *len,
        }
    }

    /// Where the vector is, for the peers.
    pub(crate) fn exposure(&self) -> Exposure {
        match self {
            Input::Owned(v) => Exposure::at(v.as_ptr() as u64),
            Input::Arena { lease, .. } => Exposure {
                in_arena: true,
                ..Exposure::at(lease.addr())
            },
        }
    }

    /// The vector's bytes in the arena (empty for an owned one).
    fn arena_bytes(&self) -> &[u8] {
        match self {
            Input::Owned(_) => &[],
            Input::Arena { lease, len, .. } => &lease.bytes()[..len * size_of::<T>()],
        }
    }

    /// The vector, to read.
    pub(crate) fn as_slice(&self) -> &[T] {
        match self {
            Input::Owned(v) => v,
            Input::Arena { .. } => bytemuck::cast_slice(self.arena_bytes()),
        }
    }

    /// Elements `range` of the vector, to change while peers may be reading other elements
    /// (see the algorithm); only they are borrowed. Panics past the end, as slicing does.
    pub(crate) fn block_mut(&mut self, range: Range<usize>) -> &mut [T] {
        match self {
            Input::Owned(v) => &mut v[range],
            Input::Arena { lease, len, .. } => {
                assert!(range.end <= *len, "block {range:?} of {len} elements");
                let elem = size_of::<T>();
                let bytes = lease.range_mut(range.start * elem..range.end * elem);
                bytemuck::cast_slice_mut(bytes.expect("checked against the vector's length"))
            }
        }
    }

    /// The vector as a vector of its own, copied out of the arena if it is there (for an
    /// algorithm that does not read the peers' memory).
    pub(crate) fn into_vec(self) -> Vec<T> {
        match self {
            Input::Owned(v) => v,
            Input::Arena { .. } => byte_copy::vec_from(self.as_slice()),
        }
    }
}
