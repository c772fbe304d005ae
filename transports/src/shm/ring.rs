//! A single-producer, single-consumer ring of variable-length records in shared memory.
//!
//! One ring carries everything one local rank sends to another. It lives in the receiver's
//! segment: a control block ([`RingControl`], two cache lines) and a data area whose length is
//! a power of two and a multiple of the alignment `unit` (64 bytes, one cache line, in the
//! transport; smaller in the loom models).
//!
//! * **Records.** Each record starts on a `unit` boundary with a 16-byte header — its *stamp*
//!   (a `u64`, below), then the body length as a little-endian `u32`, a kind byte and three
//!   reserved bytes — followed by its body. A record never wraps: when the next one does not
//!   fit before the end of the data area, the producer fills the rest with a [`PAD`] record and
//!   starts again at offset 0.
//! * **Hot window.** The producer also starts again at offset 0 early, once past its *hot
//!   window* (a few KiB), whenever the consumer has already released the space the record
//!   needs there: a pair whose receiver keeps up then cycles through a few cache-resident
//!   lines instead of sweeping the whole data area, and each record it writes finds its lines
//!   in the writer's cache rather than a lap away. (Open MPI's fast boxes are small for the same
//!   reason.) A lagging consumer is not waited for: the ring is then used whole. The filler
//!   of an early wrap holds the rest of the data area until the consumer reads it, though, so
//!   a burst of records right after one finds the ring full sooner; when that happens the
//!   producer stops wrapping early for 2, 4, … up to 64 laps. The consumer cannot tell the two
//!   kinds of wrap apart and need not. The sender turns early wraps off altogether while the
//!   consumer's cache is far from its own ([`RingProducer::set_early_wraps`], decided in
//!   `cache_distance`), where reusing hot lines costs more than it saves.
//! * **Positions.** `head` (bytes written by the producer) and `tail` (bytes released by the
//!   consumer) count up forever as `u64`s; the offset in the data area is the count modulo the
//!   capacity. The producer owns `head`, the consumer owns `tail`, each in its own cache line.
//! * **Publication, in band.** The producer writes a record's length, kind and body, then
//!   stores its stamp with `Release`; the consumer loads the word at its read position with
//!   `Acquire` and reads the record only if it holds the stamp that position should have. So a
//!   waiting consumer watches the very cache line the next record arrives in, and a small
//!   record reaches it in one cache-line transfer — watching `head` instead costs two in a row
//!   (`head`'s line, then the record's), which measured 1.3–1.9× the time of one on this
//!   machine. (Open MPI's and MPICH's shared-memory "fast boxes" flag their messages in band
//!   for the same reason.) `head` is still stored after each record, where nobody waits on it,
//!   for the rare readers that want everything published at once ([`RingConsumer::discard_all`]).
//!   In reverse, the consumer stores `tail` with `Release` once it has copied records out, and
//!   the producer loads it with `Acquire` before overwriting them. So no byte is ever read and
//!   written at once.
//! * **Stamps.** The word at a read position holds, until the next record is published there,
//!   whatever the previous lap left: an old record's stamp or payload bytes. A stamp is the
//!   position XOR the ring's [`RingKey`] — random per ring, with the top bit set — so an old
//!   stamp (another position) never matches, the zeros of a fresh segment never match, and
//!   payload bytes match only by a 2⁻⁶⁴ accident: the consumer never clears anything, and
//!   writes nothing into the data area.
//! * **Back-pressure.** A producer that finds the ring full sets `want_space`, issues a
//!   `SeqCst` fence and looks at `tail` again ([`RingProducer::request_space`]); a consumer that
//!   releases space stores `tail`, fences, and looks at `want_space`
//!   ([`RingConsumer::release`]). The two fences are totally ordered, so either the producer
//!   sees the space or the consumer sees the request and signals the producer: a full ring
//!   never strands its producer.
//!
//! The consumer checks every record it reads against the ring's bounds and reports a record
//! that cannot be valid as [`Popped::Corrupt`] rather than trusting it: the other side is
//! another process.
//!
//! The loom models in `loom-tests/tests/shm_ring.rs` compile this file against loom's atomics
//! and a checked [`SharedBytes`].

use crate::sync::SharedBytes;
use crate::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};

/// Bytes of a record header: stamp (`u64`), body length (`u32`), kind (`u8`), three reserved
/// bytes.
pub(crate) const RECORD_HEADER: usize = 16;
/// Bytes a record may have beyond a quarter of the ring (see [`RingGeometry::max_body`]).
pub(crate) const HEADROOM: usize = 256;

/// Bytes of the stamp at the start of a record header.
const STAMP: usize = 8;

/// What makes one ring's stamps its own (see the [module docs](self)): the stamp of the record
/// at position `p` is `p ^ key`. Both ends derive it from the receiving segment's random nonce
/// and the sender's rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RingKey(u64);

impl RingKey {
    /// The key of the ring from `sender` in the segment whose nonce is `nonce`.
    pub(crate) fn new(nonce: u64, sender: u32) -> RingKey {
        // The top bit keeps every stamp non-zero (positions stay below 2^63).
        RingKey((nonce ^ u64::from(sender).wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1 << 63)
    }

    fn stamp(self, position: u64) -> u64 {
        position ^ self.0
    }
}

/// The kind of the filler record at the end of the data area; never handed to the consumer.
pub(crate) const PAD: u8 = 0;

/// The producer's cache line: how far it has written. Stored after every record but read
/// only rarely, so it stays in the producer's cache.
#[repr(C, align(64))]
struct ProducerLine {
    head: AtomicU64,
}

/// The consumer's cache line.
#[repr(C, align(64))]
struct ConsumerLine {
    tail: AtomicU64,
}

/// The producer's request for space, which the consumer reads after every release: in a line
/// of its own, which changes only when the ring fills (beside `head` it would cost the
/// consumer a cache miss per record).
#[repr(C, align(64))]
struct RequestLine {
    want_space: AtomicU32,
}

/// The control block of one ring (three cache lines). All zeros is a fresh, empty ring, so a
/// freshly created (zero-filled) shared-memory segment holds valid rings.
#[repr(C)]
pub(crate) struct RingControl {
    producer: ProducerLine,
    consumer: ConsumerLine,
    request: RequestLine,
}

impl RingControl {
    /// A fresh, empty ring's control block.
    pub(crate) fn new() -> RingControl {
        RingControl {
            producer: ProducerLine {
                head: AtomicU64::new(0),
            },
            consumer: ConsumerLine {
                tail: AtomicU64::new(0),
            },
            request: RequestLine {
                want_space: AtomicU32::new(0),
            },
        }
    }

    /// Whether records were published that the consumer has not released yet (read or not):
    /// a look from anywhere, without the consumer's private state, at the word where the first
    /// unreleased record is or the next one will be. Never a false "no": if the consumer
    /// released more meanwhile (so the word looked at may have been reused), the answer is yes.
    pub(crate) fn has_unreleased(
        &self,
        data: &SharedBytes,
        geometry: RingGeometry,
        key: RingKey,
    ) -> bool {
        let tail = self.consumer.tail.load(Ordering::Acquire);
        // SAFETY: the offset is unit-aligned, so 8-aligned and in bounds. While `tail` is the
        // release position the word is written only atomically (a stamp); if the consumer
        // released more meanwhile, the producer may be reusing it, and the tail check below
        // discards whatever was read.
        let word = unsafe { data.load_word(geometry.offset(tail), Ordering::Acquire) };
        word == key.stamp(tail) || self.consumer.tail.load(Ordering::Acquire) != tail
    }
}

impl Default for RingControl {
    fn default() -> Self {
        RingControl::new()
    }
}

/// The geometry of a ring: data capacity and alignment unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RingGeometry {
    /// Bytes in the data area: a power of two, a multiple of `unit`.
    pub(crate) capacity: usize,
    /// Records start on multiples of this: a power of two of at least [`RECORD_HEADER`] bytes.
    pub(crate) unit: usize,
}

impl RingGeometry {
    /// Whether the geometry is usable.
    pub(crate) fn is_valid(&self) -> bool {
        self.unit.is_power_of_two()
            && self.unit >= RECORD_HEADER
            && self.capacity.is_power_of_two()
            && self.capacity >= 4 * self.unit
            && u32::try_from(self.capacity).is_ok()
    }

    /// The largest record body a producer may push: a quarter of the capacity, plus
    /// [`HEADROOM`] (a sixty-fourth of the capacity in small rings, whole units only), less
    /// the header. Under
    /// half the ring, so a full-size record always fits once the ring has drained, whatever the
    /// wrap position; and past the quarter by enough that a frame whose payload is a quarter of
    /// the ring plus a few bytes of framing (a power-of-two vector and a collective's kind
    /// byte, say) still goes as one record.
    pub(crate) fn max_body(&self) -> usize {
        let headroom = HEADROOM.min(self.capacity / 64) & self.unit_mask();
        self.capacity / 4 + headroom - RECORD_HEADER
    }

    /// Bytes a record with a `body`-byte body occupies.
    fn footprint(&self, body: usize) -> usize {
        (RECORD_HEADER + body + self.unit - 1) & self.unit_mask()
    }

    /// Clears the bits below the unit. The unit is a power of two, which the compiler cannot
    /// know: rounding by `/` and `%` put a hardware division (tens of cycles) on every record's
    /// path, both sides.
    fn unit_mask(&self) -> usize {
        !(self.unit - 1)
    }

    fn offset(&self, position: u64) -> usize {
        // The capacity is a power of two that fits u32, so the mask fits usize.
        (position & (self.capacity as u64 - 1)) as usize
    }
}

/// What [`RingProducer::try_push`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pushed {
    /// The record is published.
    Done,
    /// Not enough free space: try again after the consumer released some
    /// ([`RingProducer::request_space`]).
    Full,
    /// The body is longer than [`RingGeometry::max_body`]: it will never fit.
    TooLarge,
}

/// The producer's private state (kept in process memory, not in the shared segment).
#[derive(Debug)]
pub(crate) struct RingProducer {
    geometry: RingGeometry,
    key: RingKey,
    head: u64,
    /// The last `tail` read from the consumer: free space is at least `capacity - (head - it)`.
    tail_seen: u64,
    /// Past this offset, start again at offset 0 if the consumer has released the space
    /// there (see the [module docs](self)); the capacity: never early.
    hot_window: usize,
    /// The head position before which no further early wrap is tried: after one was declined
    /// (each try may read the consumer's tail, a cache miss, so a lagging consumer is looked
    /// at once per window, not once per record) or after one cost room.
    next_wrap_try: u64,
    /// Where the filler of the last early wrap starts, until the consumer is known to have
    /// passed it or it has cost room.
    early_filler: Option<u64>,
    /// Early wraps that cost room in a row (capped): the next is tried only after `2^n` laps.
    costly_wraps: u32,
    /// Whether early wraps are tried at all (the sender turns them off while the consumer's
    /// cache is far: see `cache_distance`).
    early_wraps: bool,
    /// The positions the last wrap's filler spans (start, end), early or not: bytes that
    /// carry no record (see [`unread`](Self::unread)).
    last_filler: (u64, u64),
}

/// Most laps of the ring an early wrap that cost room puts off the next try: `2^6`.
const MAX_COSTLY_WRAPS: u32 = 6;

impl RingProducer {
    /// The producer of the ring `control` (which it continues where it stands).
    pub(crate) fn new(control: &RingControl, geometry: RingGeometry, key: RingKey) -> RingProducer {
        RingProducer {
            geometry,
            key,
            head: control.producer.head.load(Ordering::Relaxed),
            tail_seen: control.consumer.tail.load(Ordering::Acquire),
            hot_window: geometry.capacity,
            next_wrap_try: 0,
            early_filler: None,
            costly_wraps: 0,
            early_wraps: true,
            last_filler: (0, 0),
        }
    }

    /// Starts again at offset 0 once past `bytes` of the data area when the consumer keeps
    /// up (see the [module docs](self)); `0`, or a window of at least the capacity, never.
    pub(crate) fn with_hot_window(mut self, bytes: usize) -> RingProducer {
        self.hot_window = if bytes == 0 {
            self.geometry.capacity
        } else {
            bytes.min(self.geometry.capacity)
        };
        self
    }

    /// Turns early wraps (the hot window) on or off.
    pub(crate) fn set_early_wraps(&mut self, on: bool) {
        self.early_wraps = on;
    }

    /// Loads the consumer's `tail` (a cache miss while the consumer keeps releasing space).
    pub(crate) fn look_at_tail(&mut self, control: &RingControl) {
        self.tail_seen = control.consumer.tail.load(Ordering::Acquire);
    }

    /// The largest body [`try_push`](Self::try_push) accepts.
    pub(crate) fn max_body(&self) -> usize {
        self.geometry.max_body()
    }

    /// Bytes the next record with a `body`-byte body needs, including a wrap's filler.
    fn needed(&self, body: usize) -> usize {
        let need = self.geometry.footprint(body);
        let to_end = self.geometry.capacity - self.geometry.offset(self.head);
        if need > to_end { to_end + need } else { need }
    }

    fn has_room(&self, needed: usize) -> bool {
        // The tail comes from the other process: a tail beyond the head, or one so far behind
        // that more than the capacity would be in use, means no room (never an underflow).
        match self.head.checked_sub(self.tail_seen) {
            Some(used) if used <= self.geometry.capacity as u64 => {
                self.geometry.capacity - used as usize >= needed
            }
            _ => false,
        }
    }

    /// Whether `needed` bytes are free: by the last tail seen, else by the consumer's tail
    /// read now (a cache miss, so only when the one seen does not tell).
    fn has_room_looking(&mut self, control: &RingControl, needed: usize) -> bool {
        if self.has_room(needed) {
            return true;
        }
        self.tail_seen = control.consumer.tail.load(Ordering::Acquire);
        self.has_room(needed)
    }

    /// Appends one record of kind `kind` (not [`PAD`]) whose body is the concatenation of
    /// `parts`, and publishes it.
    pub(crate) fn try_push(
        &mut self,
        control: &RingControl,
        data: &SharedBytes,
        kind: u8,
        parts: &[&[u8]],
    ) -> Pushed {
        let body: usize = parts.iter().map(|p| p.len()).sum();
        if body > self.geometry.max_body() || kind == PAD {
            return Pushed::TooLarge;
        }
        let footprint = self.geometry.footprint(body);
        let at = self.geometry.offset(self.head);
        let to_end = self.geometry.capacity - at;
        let wrap = footprint > to_end || self.wraps_early(control, at, to_end + footprint);
        let needed = if wrap { to_end + footprint } else { footprint };
        if !self.has_room_looking(control, needed) {
            self.note_full();
            return Pushed::Full;
        }
        if wrap && footprint <= to_end {
            self.early_filler = Some(self.head);
        }
        let start = if wrap {
            self.head + to_end as u64
        } else {
            self.head
        };
        let record_at = if wrap { 0 } else { at };
        // SAFETY: [record_at, record_at + footprint) is free space (has_room counted it), in
        // bounds and unit-aligned: the consumer does not read it until its stamp is there. The
        // stamp goes last, publishing what was written before it.
        unsafe {
            data.write(record_at + STAMP, &length_and_kind(body, kind));
            let mut pos = record_at + RECORD_HEADER;
            // Empty pieces are skipped: each write is a call to `memcpy`, and an eager frame's
            // pieces are padded with empty ones.
            for part in parts.iter().filter(|p| !p.is_empty()) {
                data.write(pos, part);
                pos += part.len();
            }
            data.store_word(record_at, self.key.stamp(start), Ordering::Release);
        }
        if wrap {
            // The filler is published after the record it leads to, so a consumer that finds
            // it finds the record already there at offset 0.
            // SAFETY: [at, capacity) is free space too (counted in the wrap's room).
            unsafe {
                data.write(at + STAMP, &length_and_kind(to_end - RECORD_HEADER, PAD));
                data.store_word(at, self.key.stamp(self.head), Ordering::Release);
            }
            self.last_filler = (self.head, start);
        }
        self.head = start + footprint as u64;
        control.producer.head.store(self.head, Ordering::Release);
        Pushed::Done
    }

    /// Whether the record going to offset `at`, which needs `needed` bytes if it starts again
    /// at offset 0, does so early: `at` is past the hot window and the consumer has released
    /// that much (read from its tail if the last tail seen does not tell, at most once per
    /// window while it lags).
    fn wraps_early(&mut self, control: &RingControl, at: usize, needed: usize) -> bool {
        if !self.early_wraps || at < self.hot_window || self.head < self.next_wrap_try {
            return false;
        }
        if !self.has_room_looking(control, needed) {
            self.next_wrap_try = self.head + self.hot_window as u64;
            return false;
        }
        if self.early_filler.take().is_some() {
            // The consumer is past the last one's filler (it released more than that) and the
            // ring never filled meanwhile: that one cost nothing.
            self.costly_wraps = 0;
        }
        true
    }

    /// The ring is full. If it is full because of the last early wrap's filler — the consumer
    /// lagged right after it, as in a burst of sends, and the filler still holds the rest of
    /// the ring — early wraps were the wrong bet for this traffic: the next one waits `2^n`
    /// laps, `n` growing with each such miss in a row.
    fn note_full(&mut self) {
        if self
            .early_filler
            .take()
            .is_some_and(|filler| self.tail_seen <= filler)
        {
            self.costly_wraps = (self.costly_wraps + 1).min(MAX_COSTLY_WRAPS);
            let laps = (self.geometry.capacity as u64) << self.costly_wraps;
            self.next_wrap_try = self.head + laps;
        }
    }

    /// Whether the consumer has released everything published before the producer stood at
    /// `position` (reads its tail).
    pub(crate) fn consumed_to(&self, control: &RingControl, position: u64) -> bool {
        control.consumer.tail.load(Ordering::Acquire) >= position
    }

    /// Bytes of records written and not yet released by the consumer (reads its tail), not
    /// counting the last wrap's filler: an early wrap leaves most of the ring as filler behind
    /// a few bytes of record. (Fillers of earlier laps still count, but with those unread the
    /// consumer is a lap behind anyway.)
    pub(crate) fn unread(&self, control: &RingControl) -> u64 {
        let tail = control.consumer.tail.load(Ordering::Acquire);
        let unread = self.head.saturating_sub(tail);
        let (filler, after) = self.last_filler;
        if tail <= filler {
            unread.saturating_sub(after - filler)
        } else {
            unread
        }
    }

    /// Where the next record goes (a position counted from the ring's start, never wrapping).
    pub(crate) fn position(&self) -> u64 {
        self.head
    }

    /// Whether a record with a `body`-byte body fits now (reads the consumer's tail).
    pub(crate) fn has_room_now(&mut self, control: &RingControl, body: usize) -> bool {
        self.tail_seen = control.consumer.tail.load(Ordering::Acquire);
        self.has_room(self.needed(body))
    }

    /// After [`Pushed::Full`]: asks the consumer to signal when it releases space, then looks
    /// once more. Returns whether a record with a `body`-byte body fits now (if not, the
    /// consumer will see the request and signal).
    pub(crate) fn request_space(&mut self, control: &RingControl, body: usize) -> bool {
        control.request.want_space.store(1, Ordering::Relaxed);
        // Orders the request before the tail load, against the consumer's tail store and
        // want_space load (see the module docs).
        fence(Ordering::SeqCst);
        self.tail_seen = control.consumer.tail.load(Ordering::Acquire);
        self.has_room(self.needed(body))
    }
}

#[cfg(test)]
impl RingProducer {
    /// Publishes, as a producer that breaks the rules might, a record header whose body runs
    /// past the end of the data area.
    pub(crate) fn push_corrupt(&mut self, data: &SharedBytes) {
        let at = self.geometry.offset(self.head);
        // SAFETY: test use; `at` is unit-aligned and in bounds.
        unsafe {
            data.write(at + STAMP, &length_and_kind(self.geometry.capacity, 1));
            data.store_word(at, self.key.stamp(self.head), Ordering::Release);
        }
    }
}

/// What [`RingConsumer::pop`] found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Popped<R> {
    /// Nothing unread.
    Empty,
    /// A record; the value is what the callback returned.
    Record(R),
    /// The bytes at the read position are not a valid record (the producer broke the
    /// protocol); the ring cannot be read further.
    Corrupt,
}

/// The consumer's private state.
#[derive(Debug)]
pub(crate) struct RingConsumer {
    geometry: RingGeometry,
    key: RingKey,
    tail: u64,
    /// `tail` as last published.
    released: u64,
}

impl RingConsumer {
    /// The consumer of the ring `control`.
    pub(crate) fn new(control: &RingControl, geometry: RingGeometry, key: RingKey) -> RingConsumer {
        let tail = control.consumer.tail.load(Ordering::Relaxed);
        RingConsumer {
            geometry,
            key,
            tail,
            released: tail,
        }
    }

    /// Whether a record is waiting (one load).
    pub(crate) fn has_records(&self, data: &SharedBytes) -> bool {
        self.is_published(data, self.geometry.offset(self.tail))
    }

    /// Whether the record at the read position, offset `at`, has been published.
    fn is_published(&self, data: &SharedBytes, at: usize) -> bool {
        // SAFETY: `at` is the unit-aligned offset of the read position: 8-aligned and in
        // bounds. The word there is written only atomically (a stamp) while it is the read
        // position.
        unsafe { data.load_word(at, Ordering::Acquire) == self.key.stamp(self.tail) }
    }

    /// Reads the next record and calls `f(kind, body)` with it. The record's space is not
    /// handed back until [`release`](Self::release).
    pub(crate) fn pop<R>(
        &mut self,
        data: &SharedBytes,
        f: impl FnOnce(u8, &[u8]) -> R,
    ) -> Popped<R> {
        self.read_next(data, |kind, body| (f(kind, body), true))
    }

    /// Like [`pop`](Self::pop), but the record is consumed only if `f` returns `Some`;
    /// otherwise it stays first in line (`Record(None)`). Padding before it is consumed either
    /// way: it carries nothing.
    pub(crate) fn pop_if<R>(
        &mut self,
        data: &SharedBytes,
        f: impl FnOnce(u8, &[u8]) -> Option<R>,
    ) -> Popped<Option<R>> {
        self.read_next(data, |kind, body| {
            let r = f(kind, body);
            let consumed = r.is_some();
            (r, consumed)
        })
    }

    /// Finds the next record (consuming padding), calls `f(kind, body)` with it and consumes
    /// it if `f` says so.
    #[inline(always)]
    fn read_next<R>(
        &mut self,
        data: &SharedBytes,
        f: impl FnOnce(u8, &[u8]) -> (R, bool),
    ) -> Popped<R> {
        loop {
            let at = self.geometry.offset(self.tail);
            if !self.is_published(data, at) {
                return Popped::Empty;
            }
            let to_end = self.geometry.capacity - at;
            let mut head = [0u8; RECORD_HEADER - STAMP];
            // SAFETY: [at, at + 16) is in bounds (at is unit-aligned, unit >= 16) and published
            // (its stamp is there): the producer does not write it until we release it.
            unsafe { data.with_slice(at + STAMP, head.len(), |b| head.copy_from_slice(b)) };
            let body = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
            let kind = head[4];
            let footprint = self.geometry.footprint(body);
            if footprint > to_end || (kind != PAD && body > self.geometry.max_body()) {
                return Popped::Corrupt;
            }
            if kind == PAD {
                if footprint != to_end {
                    return Popped::Corrupt;
                }
                self.tail += to_end as u64;
                continue;
            }
            // SAFETY: the record lies within the published, unreleased bytes (checked above).
            let (r, consumed) =
                unsafe { data.with_slice(at + RECORD_HEADER, body, |b| f(kind, b)) };
            if consumed {
                self.tail += footprint as u64;
            }
            return Popped::Record(r);
        }
    }

    /// Gives up on the ring: everything written so far counts as read and is released, so
    /// the ring no longer looks unread (its sender said goodbye or broke the rules).
    /// Returns what [`release`](Self::release) returns.
    pub(crate) fn discard_all(&mut self, control: &RingControl, data: &SharedBytes) -> bool {
        let head = control.producer.head.load(Ordering::Acquire);
        // A head from the other process that is behind, or more than a ring ahead, is not
        // trusted: nothing is skipped by it then.
        if head
            .checked_sub(self.tail)
            .is_some_and(|n| n <= self.geometry.capacity as u64)
        {
            self.tail = head;
        }
        // Published records beyond the head (from a producer that broke the rules: a record
        // whose length cannot be trusted) are stepped over a unit at a time, so that no stamp
        // is left at the read position and the ring stops looking unread.
        for _ in 0..self.geometry.capacity / self.geometry.unit {
            if !self.is_published(data, self.geometry.offset(self.tail)) {
                break;
            }
            self.tail += self.geometry.unit as u64;
        }
        self.release(control)
    }

    /// Hands the space of every record read so far back to the producer. Returns whether the
    /// producer had asked for space (and is owed a signal); the request is cleared.
    pub(crate) fn release(&mut self, control: &RingControl) -> bool {
        if self.released == self.tail {
            return false;
        }
        self.released = self.tail;
        control.consumer.tail.store(self.tail, Ordering::Release);
        // Orders the tail store before the want_space load, against the producer's
        // request_space (see the module docs).
        fence(Ordering::SeqCst);
        control.request.want_space.load(Ordering::Relaxed) != 0
            && control.request.want_space.swap(0, Ordering::Relaxed) != 0
    }
}

/// The part of a record header after the stamp.
fn length_and_kind(body: usize, kind: u8) -> [u8; RECORD_HEADER - STAMP] {
    // body <= max_body < capacity, which fits u32 (RingGeometry::is_valid).
    let len = (body as u32).to_le_bytes();
    [len[0], len[1], len[2], len[3], kind, 0, 0, 0]
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Ring {
        control: RingControl,
        data: SharedBytes,
        _buf: Vec<u64>,
    }

    const KEY: RingKey = RingKey(1 << 63 | 0x5EED);

    fn ring(capacity: usize, unit: usize) -> (Ring, RingGeometry) {
        let mut buf = vec![0u64; capacity / 8];
        // SAFETY: `buf` lives as long as the ring (it is moved into it; a Vec's heap buffer
        // does not move).
        let data = unsafe { SharedBytes::from_raw(buf.as_mut_ptr().cast(), capacity) };
        let geometry = RingGeometry { capacity, unit };
        assert!(geometry.is_valid());
        (
            Ring {
                control: RingControl::new(),
                data,
                _buf: buf,
            },
            geometry,
        )
    }

    fn pop(c: &mut RingConsumer, r: &Ring) -> Popped<(u8, Vec<u8>)> {
        c.pop(&r.data, |k, b| (k, b.to_vec()))
    }

    #[test]
    fn records_come_out_in_order_across_wraps() {
        let (r, g) = ring(1024, 64);
        let mut p = RingProducer::new(&r.control, g, KEY);
        let mut c = RingConsumer::new(&r.control, g, KEY);
        let mut expected = std::collections::VecDeque::new();
        for i in 0..2000usize {
            let body: Vec<u8> = (0..(i * 37) % (g.max_body() + 1))
                .map(|j| (i + j) as u8)
                .collect();
            let (a, b) = body.split_at(body.len() / 3);
            loop {
                match p.try_push(&r.control, &r.data, 1 + (i % 5) as u8, &[a, b]) {
                    Pushed::Done => break,
                    Pushed::Full => {
                        let (k, got) = match pop(&mut c, &r) {
                            Popped::Record(x) => x,
                            other => panic!("full ring, but the consumer found {other:?}"),
                        };
                        let (ek, eb) = expected.pop_front().unwrap();
                        assert_eq!((k, got), (ek, eb));
                        c.release(&r.control);
                    }
                    Pushed::TooLarge => panic!("body of {} refused", body.len()),
                }
            }
            expected.push_back((1 + (i % 5) as u8, body));
        }
        while let Some((ek, eb)) = expected.pop_front() {
            assert_eq!(pop(&mut c, &r), Popped::Record((ek, eb)));
        }
        assert_eq!(pop(&mut c, &r), Popped::Empty);
    }

    /// `unread` counts the bytes of records the consumer has not released, the filler of the
    /// last wrap (early or not) left out.
    #[test]
    fn unread_counts_records_not_the_filler_of_a_wrap() {
        let (r, g) = ring(1024, 64);
        let mut p = RingProducer::new(&r.control, g, KEY).with_hot_window(256);
        let mut c = RingConsumer::new(&r.control, g, KEY);
        let push = |p: &mut RingProducer, len: usize| {
            assert_eq!(
                p.try_push(&r.control, &r.data, 1, &[&vec![7u8; len]]),
                Pushed::Done
            )
        };
        let read = |c: &mut RingConsumer| {
            while let Popped::Record(_) = pop(c, &r) {}
            c.release(&r.control);
        };
        assert_eq!(p.unread(&r.control), 0);
        push(&mut p, 40);
        push(&mut p, 100);
        assert_eq!(
            p.unread(&r.control),
            (g.footprint(40) + g.footprint(100)) as u64
        );
        read(&mut c);
        assert_eq!(p.unread(&r.control), 0);
        // Past the window with the consumer caught up: the next record starts again at 0
        // behind a filler to the end of the ring, which is not counted.
        push(&mut p, 200);
        read(&mut c);
        let before = p.position();
        push(&mut p, 40);
        assert!(p.position() - before > 512, "an early wrap");
        assert_eq!(p.unread(&r.control), g.footprint(40) as u64);
        push(&mut p, 40);
        assert_eq!(p.unread(&r.control), 2 * g.footprint(40) as u64);
        read(&mut c);
        assert_eq!(p.unread(&r.control), 0);
        // A natural wrap's filler is not counted either.
        let mut q = RingProducer::new(&r.control, g, KEY);
        q.head = p.head;
        q.tail_seen = p.head;
        while q.position() % 1024 < 1024 - 2 * 64 {
            push(&mut q, 40);
            read(&mut c);
        }
        push(&mut q, 200);
        assert_eq!(q.unread(&r.control), g.footprint(200) as u64);
        read(&mut c);
        assert_eq!(q.unread(&r.control), 0);
    }

    #[test]
    fn a_producer_starts_again_early_while_its_consumer_keeps_up_and_backs_off_after_a_burst() {
        let (r, g) = ring(1024, 64);
        let mut p = RingProducer::new(&r.control, g, KEY).with_hot_window(256);
        let mut c = RingConsumer::new(&r.control, g, KEY);
        let offset = |p: &RingProducer| p.position() % 1024;
        let read_all = |c: &mut RingConsumer, kind: u8, n: u8| {
            for i in 0..n {
                assert_eq!(pop(c, &r), Popped::Record((kind, vec![i; 40])));
            }
            c.release(&r.control);
        };
        let push = |p: &mut RingProducer, kind: u8, i: u8| {
            p.try_push(&r.control, &r.data, kind, &[&[i; 40]])
        };
        // Read as written: the records stay within the window and the one record past it.
        for i in 0..100u8 {
            assert!(offset(&p) <= 256, "record {i} at offset {}", offset(&p));
            assert_eq!(push(&mut p, 1, 0), Pushed::Done);
            read_all(&mut c, 1, 1);
            assert_eq!(pop(&mut c, &r), Popped::Empty);
        }
        assert!(
            p.position() > 1024,
            "the early wraps moved the positions on"
        );
        // A burst the consumer does not read, right after an early wrap: the filler holds the
        // rest of the ring, so it fills after as many records as fit before the filler.
        while offset(&p) != 256 {
            assert_eq!(push(&mut p, 1, 0), Pushed::Done);
            read_all(&mut c, 1, 1);
        }
        let mut n = 0;
        while push(&mut p, 2, n) == Pushed::Done {
            n += 1;
        }
        assert_eq!(n, 4, "records 0..4 fit before the filler at 256");
        read_all(&mut c, 2, n);
        // That cost room: for the next two laps the producer goes round the whole ring, and a
        // burst fills all of it.
        for kind in [3, 4] {
            let mut n = 0;
            while push(&mut p, kind, n) == Pushed::Done {
                n += 1;
            }
            assert_eq!(
                n, 16,
                "burst {kind}: the whole ring, 16 records of 64 bytes"
            );
            read_all(&mut c, kind, n);
        }
        // Keeping up again: back within the window once the two laps are over.
        for _ in 0..40 {
            assert_eq!(push(&mut p, 4, 0), Pushed::Done);
            read_all(&mut c, 4, 1);
        }
        for i in 0..20u8 {
            assert!(offset(&p) <= 256, "record {i} at offset {}", offset(&p));
            assert_eq!(push(&mut p, 5, 0), Pushed::Done);
            read_all(&mut c, 5, 1);
        }
    }

    #[test]
    fn full_ring_requests_space_and_release_reports_it() {
        let (r, g) = ring(256, 64);
        let mut p = RingProducer::new(&r.control, g, KEY);
        let mut c = RingConsumer::new(&r.control, g, KEY);
        let mut n = 0;
        while p.try_push(&r.control, &r.data, 1, &[&[7u8; 40]]) == Pushed::Done {
            n += 1;
        }
        assert_eq!(n, 4, "four 64-byte records fill 256 bytes");
        assert!(!p.request_space(&r.control, 40));
        assert!(matches!(pop(&mut c, &r), Popped::Record((1, _))));
        assert!(c.release(&r.control), "the producer asked for space");
        assert!(!c.release(&r.control), "and is told once");
        assert_eq!(
            p.try_push(&r.control, &r.data, 1, &[&[7u8; 40]]),
            Pushed::Done
        );
    }

    #[test]
    fn a_record_declined_by_pop_if_stays_first_across_a_wrap() {
        let (r, g) = ring(256, 16);
        let mut p = RingProducer::new(&r.control, g, KEY);
        let mut c = RingConsumer::new(&r.control, g, KEY);
        // Seven 32-byte records, read and released: 32 bytes are left before the end, so
        // the next record of 64 goes after a pad at the start.
        for _ in 0..7 {
            assert_eq!(p.try_push(&r.control, &r.data, 1, &[b"x"]), Pushed::Done);
            assert!(matches!(pop(&mut c, &r), Popped::Record(_)));
            c.release(&r.control);
        }
        assert_eq!(
            p.try_push(&r.control, &r.data, 2, &[&[5u8; 40]]),
            Pushed::Done
        );
        let declined = c.pop_if(&r.data, |k, b| {
            assert_eq!((k, b.len()), (2, 40));
            None::<()>
        });
        assert_eq!(declined, Popped::Record(None));
        assert_eq!(
            c.pop_if(&r.data, |k, b| Some((k, b.len()))),
            Popped::Record(Some((2, 40)))
        );
        assert_eq!(c.pop_if(&r.data, |_, _| Some(())), Popped::Empty);
    }

    #[test]
    fn oversized_and_pad_kind_are_refused() {
        let (r, g) = ring(256, 64);
        let mut p = RingProducer::new(&r.control, g, KEY);
        let big = vec![0u8; g.max_body() + 1];
        assert_eq!(
            p.try_push(&r.control, &r.data, 1, &[&big]),
            Pushed::TooLarge
        );
        assert_eq!(p.try_push(&r.control, &r.data, PAD, &[]), Pushed::TooLarge);
    }

    #[test]
    fn a_tail_beyond_the_head_means_no_room_not_a_panic() {
        let (r, g) = ring(256, 64);
        let mut p = RingProducer::new(&r.control, g, KEY);
        while p.try_push(&r.control, &r.data, 1, &[b"x"]) == Pushed::Done {}
        // The producer looks at the tail only when its cached one shows no room.
        r.control.consumer.tail.store(1 << 40, Ordering::Release);
        assert_eq!(p.try_push(&r.control, &r.data, 1, &[b"x"]), Pushed::Full);
        assert!(!p.request_space(&r.control, 1));
    }

    /// Publishes a record header at offset `at` for position `position`, as a producer that
    /// breaks the rules might.
    fn forge(r: &Ring, at: usize, position: u64, body: usize, kind: u8) {
        // SAFETY: nobody else uses the ring; `at` is unit-aligned.
        unsafe {
            r.data.write(at + STAMP, &length_and_kind(body, kind));
            r.data
                .store_word(at, KEY.stamp(position), Ordering::Release);
        }
    }

    #[test]
    fn corrupt_records_are_reported_not_trusted() {
        let (r, g) = ring(256, 64);
        // A body running past the end of the data area.
        let mut c = RingConsumer::new(&r.control, g, KEY);
        forge(&r, 0, 0, 300, 3);
        assert_eq!(pop(&mut c, &r), Popped::Corrupt);
        // Given up, the ring no longer looks unread (the head never covered the record).
        assert!(r.control.has_unreleased(&r.data, g, KEY));
        c.discard_all(&r.control, &r.data);
        assert!(!r.control.has_unreleased(&r.data, g, KEY));
        assert!(!c.has_records(&r.data));
        // A body longer than any producer may push, though it would fit.
        let (r, g) = ring(256, 64);
        let mut c = RingConsumer::new(&r.control, g, KEY);
        forge(&r, 0, 0, g.max_body() + 1, 3);
        assert_eq!(pop(&mut c, &r), Popped::Corrupt);
        // A filler that does not reach the end.
        let (r, g) = ring(256, 64);
        let mut c = RingConsumer::new(&r.control, g, KEY);
        forge(&r, 0, 0, 10, PAD);
        assert_eq!(pop(&mut c, &r), Popped::Corrupt);
    }

    #[test]
    fn only_the_stamp_of_the_read_position_publishes_a_record() {
        let (r, g) = ring(256, 64);
        let mut p = RingProducer::new(&r.control, g, KEY);
        let mut c = RingConsumer::new(&r.control, g, KEY);
        // A fresh (zeroed) ring has nothing.
        assert!(!c.has_records(&r.data));
        assert!(!r.control.has_unreleased(&r.data, g, KEY));
        // A lap later, the old record's stamp at the same offset is not the new one's.
        for _ in 0..4 {
            assert_eq!(p.try_push(&r.control, &r.data, 1, &[b"x"]), Pushed::Done);
            assert!(r.control.has_unreleased(&r.data, g, KEY));
            assert!(matches!(pop(&mut c, &r), Popped::Record((1, _))));
            c.release(&r.control);
        }
        assert!(!c.has_records(&r.data));
        assert!(!r.control.has_unreleased(&r.data, g, KEY));
        assert_eq!(pop(&mut c, &r), Popped::Empty);
        // Nor is a stamp made with another ring's key, or payload bytes that look like one.
        // SAFETY: nobody else uses the ring.
        unsafe {
            r.data
                .store_word(0, RingKey(1 << 63).stamp(256), Ordering::Release)
        };
        assert_eq!(pop(&mut c, &r), Popped::Empty);
        assert_eq!(p.try_push(&r.control, &r.data, 2, &[b"y"]), Pushed::Done);
        assert_eq!(pop(&mut c, &r), Popped::Record((2, b"y".to_vec())));
    }

    #[test]
    fn discard_all_skips_what_was_written_but_not_a_head_out_of_range() {
        let (r, g) = ring(256, 64);
        let mut p = RingProducer::new(&r.control, g, KEY);
        let mut c = RingConsumer::new(&r.control, g, KEY);
        for _ in 0..3 {
            assert_eq!(p.try_push(&r.control, &r.data, 1, &[b"x"]), Pushed::Done);
        }
        c.discard_all(&r.control, &r.data);
        assert_eq!(pop(&mut c, &r), Popped::Empty);
        assert!(!r.control.has_unreleased(&r.data, g, KEY));
        r.control.producer.head.store(1 << 40, Ordering::Release);
        c.discard_all(&r.control, &r.data);
        assert_eq!(p.try_push(&r.control, &r.data, 2, &[b"y"]), Pushed::Done);
        assert_eq!(pop(&mut c, &r), Popped::Record((2, b"y".to_vec())));
    }
}
