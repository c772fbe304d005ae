//! The vocabulary of the point-to-point API: ranks, tags, selectors, contexts, messages.

use bytes::Bytes;

/// The largest tag a user may send with (MPI's `MPI_TAG_UB` is at least 32767; ours is `2^31 - 1`).
///
/// Tags above it are rejected with [`Error::InvalidTag`](crate::Error::InvalidTag) so that a
/// stray negative `i32` cast to `u32` is caught instead of silently matching nothing.
pub const MAX_TAG: u32 = i32::MAX as u32;

/// Which sender a receive or probe accepts.
///
/// `From<usize>` is implemented, so `comm.recv(3, 7)` means `Source::Rank(3)`, `Tag::Value(7)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    /// Only messages from this rank of the communicator.
    Rank(usize),
    /// Messages from any rank (MPI's `MPI_ANY_SOURCE`).
    Any,
}

impl From<usize> for Source {
    fn from(rank: usize) -> Self {
        Source::Rank(rank)
    }
}

/// Which tags a receive or probe accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tag {
    /// Only messages sent with exactly this tag.
    Value(u32),
    /// Messages with any tag (MPI's `MPI_ANY_TAG`).
    Any,
}

impl From<u32> for Tag {
    fn from(tag: u32) -> Self {
        Tag::Value(tag)
    }
}

/// Identifies a communication context: every communicator owns two (one for point-to-point,
/// one for collectives), and messages only ever match receives of the same context.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContextId(pub u64);

impl ContextId {
    /// The world communicator's point-to-point context.
    pub const WORLD: ContextId = ContextId(0);

    /// The collective context paired with this point-to-point context.
    pub fn collective(self) -> ContextId {
        ContextId(self.0 | 1)
    }

    /// Derives a child context deterministically, so every member of a communicator computes the
    /// same id for the `n`-th communicator created from it without talking to the others.
    pub fn derive(self, n: u64, salt: u64) -> ContextId {
        // splitmix64 finaliser over the inputs: cheap, deterministic across processes, and a
        // 64-bit space makes an accidental collision vanishingly unlikely.
        let mut z = self.0 ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ salt.rotate_left(29);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        // Point-to-point contexts are even; `collective()` sets the low bit. Never collide with WORLD.
        ContextId((z & !1).max(2))
    }
}

/// What a probe learns about a waiting message without receiving it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Status {
    /// The sender's rank in the communicator the probe or receive was made on.
    pub source: usize,
    /// The tag the message was sent with.
    pub tag: u32,
    /// The payload length in bytes.
    pub len: usize,
}

/// A received message: who sent it, with which tag, and its bytes.
///
/// The payload is a [`Bytes`], so an in-process message is the sender's buffer itself (no copy).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub(crate) source: usize,
    pub(crate) tag: u32,
    pub(crate) data: Bytes,
}

impl Message {
    /// Builds a message (useful in tests and for transports that hand messages up directly).
    pub fn new(source: usize, tag: u32, data: Bytes) -> Self {
        Message { source, tag, data }
    }

    /// The sender's rank in the communicator the receive was made on.
    pub fn source(&self) -> usize {
        self.source
    }

    /// The tag the message was sent with.
    pub fn tag(&self) -> u32 {
        self.tag
    }

    /// The payload.
    pub fn data(&self) -> &Bytes {
        &self.data
    }

    /// Takes the payload out of the message.
    pub fn into_data(self) -> Bytes {
        self.data
    }

    /// The payload length in bytes.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// Whether the payload is empty.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The status (source, tag, length) of this message.
    pub fn status(&self) -> Status {
        Status {
            source: self.source,
            tag: self.tag,
            len: self.data.len(),
        }
    }

    /// Copies the payload into a vector of `T`.
    ///
    /// Fails with [`Error::Misaligned`](crate::Error::Misaligned) when the length is not a whole
    /// number of `T`s.
    pub fn to_vec<T: bytemuck::Pod>(&self) -> Result<Vec<T>, crate::Error> {
        pod_vec_from_bytes(&self.data)
    }
}

/// Copies bytes into a `Vec<T>`, checking that the length is a multiple of `size_of::<T>()`.
pub(crate) fn pod_vec_from_bytes<T: bytemuck::Pod>(data: &[u8]) -> Result<Vec<T>, crate::Error> {
    let elem = std::mem::size_of::<T>();
    if elem == 0 || data.len() % elem != 0 {
        return Err(crate::Error::Misaligned {
            len: data.len(),
            elem,
        });
    }
    let mut out = vec![T::zeroed(); data.len() / elem];
    crate::byte_copy::copy_slice(bytemuck::cast_slice_mut::<T, u8>(&mut out), data);
    Ok(out)
}

/// Anything that can be sent: turned into [`Bytes`] without a copy where possible.
///
/// Implemented for `Bytes`, `BytesMut`, `Vec<u8>`, `&'static str`, and for slices and arrays of
/// any [`bytemuck::Pod`] type (`&[f64]`, `&[u32; 4]`, …). A borrowed slice is read in place when
/// the send goes out at once (an eager message the transport takes now: copied once, straight
/// into the transport, as `MPI_Send` copies from the caller's buffer); otherwise it is copied
/// into a buffer of its own. An owned buffer (`Bytes`, `Vec<u8>`) is handed over without a
/// copy, which is what a large message wants.
pub trait Payload {
    /// Converts into the bytes that go on the wire.
    fn into_bytes(self) -> Bytes;

    /// The bytes, if they can be read in place for the duration of the call that sends them
    /// (a borrowed slice). `None` (the default) sends [`into_bytes`](Self::into_bytes).
    fn borrowed(&self) -> Option<&[u8]> {
        None
    }
}

impl Payload for Bytes {
    fn into_bytes(self) -> Bytes {
        self
    }
}

impl Payload for bytes::BytesMut {
    fn into_bytes(self) -> Bytes {
        self.freeze()
    }
}

impl Payload for Vec<u8> {
    fn into_bytes(self) -> Bytes {
        Bytes::from(self)
    }
}

impl Payload for &'static str {
    fn into_bytes(self) -> Bytes {
        Bytes::from_static(self.as_bytes())
    }
}

impl<T: bytemuck::Pod> Payload for &[T] {
    fn into_bytes(self) -> Bytes {
        crate::byte_copy::bytes_from(bytemuck::cast_slice(self))
    }

    fn borrowed(&self) -> Option<&[u8]> {
        Some(bytemuck::cast_slice(self))
    }
}

impl<T: bytemuck::Pod, const N: usize> Payload for &[T; N] {
    fn into_bytes(self) -> Bytes {
        crate::byte_copy::bytes_from(bytemuck::cast_slice(self.as_slice()))
    }

    fn borrowed(&self) -> Option<&[u8]> {
        Some(bytemuck::cast_slice(self.as_slice()))
    }
}

impl<T: bytemuck::Pod> Payload for &Vec<T> {
    fn into_bytes(self) -> Bytes {
        crate::byte_copy::bytes_from(bytemuck::cast_slice(self.as_slice()))
    }

    fn borrowed(&self) -> Option<&[u8]> {
        Some(bytemuck::cast_slice(self.as_slice()))
    }
}
