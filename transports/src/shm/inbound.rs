//! The receiving side of one pair: what happens to the records a local peer wrote into this
//! rank's ring.
//!
//! [`Inbound::read`] pops records in order and turns them into arrivals: an inline frame is
//! copied out of the ring; a single-copy frame's payload is read from the sender's memory
//! (`process_vm_readv`; long ones shared with the sender, see `split_copy`) into a fresh
//! buffer, after which the read is counted for the sender; pieces of
//! a pipelined frame are appended to a reassembly buffer until the frame is whole. Nothing the
//! peer wrote is trusted: a record that does not parse, a frame that does not decode or a
//! length that cannot be allocated is dropped and counted, and a ring whose bytes break the
//! ring's own rules is given up (the peer is then treated as failed).

use bytes::Bytes;
use rankweave_core::frame::{Frame, Header};
use rankweave_core::{Arrival, EagerTaken, EagerWant, byte_copy, wire};

use std::sync::Arc;

use super::cma;
use super::host::ProcessWatch;
use super::record::{self, Record};
use super::ring::{Popped, RingConsumer, RingControl};
use super::segment::Segment;
use super::split_copy::{self, SplitSlot};
use crate::sync::SharedBytes;
use rankweave_core::buffer_pool::{BufferPool, SmallCopies};

/// Payload bytes after which one read stops (see [`Inbound::read`]).
const READ_BYTES: usize = 256 * 1024;

/// The largest frame accepted in pieces (1 TiB): a sanity bound on a peer-supplied length.
const MAX_PIECED_FRAME: u64 = 1 << 40;

/// Where a ring's records are read into.
pub(crate) struct ReadInto<'a> {
    /// The sender's process: single-copy payloads are read from its memory.
    pub(crate) sender_pid: u32,
    /// The pair's split-copy slot, where long single-copy payloads are offered to the sender
    /// to share the copy (see `split_copy`); `None`: read alone.
    pub(crate) split: Option<&'a SplitSlot>,
    /// Whether to offer a payload now (asked only of payloads long enough): not where the
    /// sender may not write this process's memory, nor while this rank sends large messages
    /// to the sender as well, whose reading keeps it busy.
    pub(crate) sender_free: &'a dyn Fn() -> bool,
    /// Tells when the sender's process has exited (`None` for a rank of this process): a
    /// split copy stops waiting for the sender's share then.
    pub(crate) sender_watch: Option<&'a ProcessWatch>,
    /// Wakes the sender if it sleeps: called after offering it a share of a payload of at
    /// least `split_copy::WAKE_MIN` bytes.
    pub(crate) wake_sender: &'a dyn Fn(),
    /// Where buffers for large frames come from.
    pub(crate) pool: &'a Arc<BufferPool>,
    /// The rank has closed: frames are dropped (single-copy payloads are still acknowledged).
    pub(crate) discard: bool,
}

/// How one [`Inbound::read`] went.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ReadOutcome {
    /// Records consumed.
    pub(crate) records: usize,
    /// Payload bytes delivered.
    pub(crate) bytes: usize,
    /// Records or frames dropped as malformed.
    pub(crate) malformed: usize,
    /// Payloads lent whole to the sender.
    pub(crate) lent: usize,
    /// The producer is waiting for space and must be signalled.
    pub(crate) producer_waits: bool,
    /// The sender's single-copy payloads read so far, by token (see
    /// `segment::PairInfo::tokens_read`), when this read took one.
    pub(crate) tokens_read: Option<u64>,
}

#[derive(Debug)]
struct Partial {
    buf: Vec<u8>,
    total: usize,
}

/// The receiving state of the ring from one sender.
#[derive(Debug)]
pub(crate) struct Inbound {
    consumer: RingConsumer,
    stream: Stream,
}

/// What the records of one ring have said so far.
#[derive(Debug)]
struct Stream {
    sender: u32,
    /// Where small frames are copied out of the ring to.
    arena: SmallCopies,
    partial: Option<Partial>,
    said_bye: bool,
    broken: bool,
    /// One past the token of the last single-copy record handled.
    tokens_read: u64,
    /// A payload to lend whole to the sender, to write while this side reads the one after
    /// it (see `split_copy::LEND_MAX`): lent once that one has its buffer, and delivered
    /// before anything read after it.
    to_lend: Option<PayloadRead>,
    /// What lending did beside the records handled, not yet counted by the read.
    lending: LendingTally,
    /// Long single-copy payloads read in a row while the sender was free to help (see
    /// [`Stream::share_with_sender`]).
    free_streak: u32,
}

/// Long payloads a sender must have been free to help with in a row, after it was not,
/// before its receiver shares one with it again (see [`Stream::share_with_sender`]).
const STEADILY_FREE: u32 = 16;

/// Payloads delivered, dropped and lent by the lending of payloads (see
/// [`Stream::read_and_deliver`]), apart from what the record being handled returns.
#[derive(Debug, Default)]
struct LendingTally {
    bytes: usize,
    malformed: usize,
    lent: usize,
}

impl LendingTally {
    /// Counts what delivering a payload came to.
    fn add(&mut self, h: Handled) {
        match h {
            Handled::Delivered(n) | Handled::ReadAcross(n) => self.bytes += n,
            Handled::Malformed => self.malformed += 1,
            Handled::Nothing | Handled::Lendable(_) => {}
        }
    }
}

/// A single-copy payload to read: its frame's header and where it lies in the sender's memory.
#[derive(Debug)]
struct PayloadRead {
    header: Header,
    token: u64,
    addr: u64,
    len: usize,
    /// Whether the sender may copy some or all of it ([`Stream::share_with_sender`]).
    share: bool,
}

/// A receive buffer for a single-copy payload, lined up with its source (see
/// `BufferPool::take_lined_up`): the payload goes to its spare capacity after `skip` zeros.
struct Landing {
    buf: Vec<u8>,
    skip: usize,
}

impl Landing {
    /// A buffer for `read` from the pool (`None`: no memory for it).
    fn take(into: &ReadInto<'_>, read: &PayloadRead) -> Option<Landing> {
        let (buf, skip) = into.pool.take_lined_up(read.len, read.addr)?;
        Some(Landing { buf, skip })
    }

    /// Where the payload goes.
    fn dst(&mut self) -> *mut u8 {
        self.buf.spare_capacity_mut().as_mut_ptr().cast()
    }
}

/// A payload lent whole to the sender (`SplitSlot::lend`): the receiver finishes it after
/// reading the next one.
struct Lent {
    read: PayloadRead,
    landing: Landing,
    offer: split_copy::Offer,
}

impl Inbound {
    /// The receiving side of the ring from `sender` in this rank's segment `own`.
    pub(crate) fn new(own: &Segment, sender: u32) -> Option<Inbound> {
        let (control, _) = own.ring(sender)?;
        Some(Inbound {
            consumer: RingConsumer::new(control, own.geometry(), own.ring_key(sender)),
            stream: Stream::new(sender),
        })
    }

    /// The sender's rank.
    pub(crate) fn sender(&self) -> u32 {
        self.stream.sender
    }

    /// The sender said `BYE`: its ring is finished.
    pub(crate) fn said_bye(&self) -> bool {
        self.stream.said_bye
    }

    /// The ring broke its rules (or its sender vanished): nothing more is read from it.
    pub(crate) fn is_broken(&self) -> bool {
        self.stream.broken
    }

    /// Gives the ring up (its sender vanished).
    pub(crate) fn break_off(&mut self, own: &Segment) {
        self.stream.broken = true;
        if let Some((control, data)) = own.ring(self.stream.sender) {
            // Its producer is gone: nobody to signal.
            let _ = self.consumer.discard_all(control, &data);
        }
    }

    /// Whether records wait (a cheap look).
    pub(crate) fn has_records(&self, own: &Segment) -> bool {
        !self.stream.said_bye
            && !self.stream.broken
            && own
                .ring(self.stream.sender)
                .is_some_and(|(_, data)| self.consumer.has_records(&data))
    }

    /// Reads up to `budget` records, stopping early once [`READ_BYTES`] of payload are
    /// delivered or after a single-copy read. Frames go to `out` (see [`ReadInto`]).
    ///
    /// One single-copy read at most, because each takes microseconds, and a record behind it
    /// is a message this rank may not have asked for yet: in an exchange where the peer runs
    /// one message ahead, reading both delayed this rank's next send by a whole read, the
    /// peer then read two while this rank waited, and so on — the two ranks' reads never
    /// overlapped (`rw-bench ring` at 64 KiB: one read at a time, seen in `perf`'s syscall
    /// trace). The exception is a medium payload followed by another: the first is lent
    /// whole to its sender, which writes it while this rank reads the second, so the two
    /// take about as long as one read (see `Stream::read_and_deliver`).
    ///
    /// The byte bound is what keeps large receives in cache: a receive waiting for its
    /// message pumps only until it has it, so the next large payload is read when its own
    /// receive asks, into the buffer the application has just given back to the pool,
    /// instead of a whole window of payloads being read at once into buffers that have long
    /// left the cache by the time they are looked at (shared-memory bandwidth at 1 MiB went
    /// from ~0.75x to ~1.0x Open MPI's).
    pub(crate) fn read(
        &mut self,
        own: &Segment,
        into: &ReadInto<'_>,
        budget: usize,
        out: &mut Vec<Arrival>,
    ) -> ReadOutcome {
        let mut outcome = ReadOutcome::default();
        let Some((control, data)) = own.ring(self.stream.sender) else {
            return outcome;
        };
        let stream = &mut self.stream;
        let tokens_before = stream.tokens_read;
        while outcome.records < budget
            && outcome.bytes < READ_BYTES
            && !stream.said_bye
            && !stream.broken
        {
            let popped = self
                .consumer
                .pop(&data, |kind, body| stream.handle(kind, body, into, out));
            let mut handled = match popped {
                Popped::Empty => break,
                Popped::Corrupt => {
                    stream.broken = true;
                    continue;
                }
                Popped::Record(handled) => handled,
            };
            outcome.records += 1;
            if let Handled::Lendable(read) = handled {
                // A look at the next record, which stays where it is.
                let mut next_lendable = false;
                let _ = self.consumer.pop_if(&data, |kind, body| {
                    next_lendable = lendable_record(kind, body);
                    None::<()>
                });
                handled = stream.read_or_lend(read, next_lendable, into, out);
            }
            match handled {
                Handled::Delivered(n) => outcome.bytes += n,
                Handled::ReadAcross(n) => {
                    outcome.bytes += n;
                    break;
                }
                Handled::Malformed => outcome.malformed += 1,
                Handled::Nothing | Handled::Lendable(_) => {}
            }
        }
        // Nothing followed it after all (the read's budget ran out): read here.
        stream.settle_lent(into, out);
        let lending = std::mem::take(&mut stream.lending);
        outcome.bytes += lending.bytes;
        outcome.malformed += lending.malformed;
        outcome.lent = lending.lent;
        let mut waits = false;
        if stream.said_bye || stream.broken {
            // Nothing after a goodbye or a broken record is read: drop it all, so the ring
            // does not look unread forever.
            waits = self.consumer.discard_all(control, &data);
        }
        outcome.producer_waits = self.consumer.release(control) || waits;
        outcome.tokens_read = (stream.tokens_read != tokens_before).then_some(stream.tokens_read);
        outcome
    }

    /// Takes the next record if it is an inline frame holding the eager message `want`
    /// describes (envelope decoded where it lies, payload copied out): the short cut of a
    /// receive waiting for this sender (see `Transport::take_eager`). Anything else — an empty
    /// ring, another kind of record, a frame that does not decode or is another message — is
    /// left for [`read`](Self::read), which handles and counts it.
    pub(crate) fn take_eager(
        &mut self,
        own: &Segment,
        want: &EagerWant,
        into: Option<&mut [u8]>,
    ) -> Direct {
        let Some((control, data)) = self.open_ring(own) else {
            return Direct::default();
        };
        let mut single_copy_next = false;
        let popped = self.consumer.pop_if(&data, |kind, body| {
            let (envelope, payload) = match kind {
                record::SHORT => record::parse_short(body)?,
                record::FRAME => wire::decode_eager(body)?,
                _ => {
                    single_copy_next = kind == record::SINGLE_COPY;
                    return None;
                }
            };
            if !want.accepts(&envelope, payload.len()) {
                return None;
            }
            let data = match into {
                // `accepts` held the payload to `want.max_len`, which `into` is at least.
                Some(dst) => {
                    byte_copy::copy_slice(&mut dst[..payload.len()], payload);
                    Bytes::new()
                }
                // An allocation of its own: making and dropping it touches no reference count
                // (a slice of a shared chunk costs two atomic operations, more than that).
                None => byte_copy::bytes_from(payload),
            };
            Some(EagerTaken {
                tag: envelope.tag,
                len: payload.len(),
                data,
            })
        });
        self.direct(control, popped, single_copy_next)
    }

    /// Takes the next record if it is a single-copy frame that `accept` takes — given its
    /// decoded header and payload length, it returns what the take gives back, or `None` to
    /// leave it — and reads its payload from the sender's memory straight into `dst` (shared
    /// with the sender for long ones, as [`read`](Self::read) does): a large message received
    /// into the caller's buffer is copied once, not read into a buffer of the transport's and
    /// copied again. Anything else, a destination too short, or a read that fails is left for
    /// [`read`](Self::read).
    pub(crate) fn take_single_copy<T>(
        &mut self,
        own: &Segment,
        dst: &mut [u8],
        read: &ReadInto<'_>,
        accept: impl FnOnce(&Header, usize) -> Option<T>,
    ) -> Direct<T> {
        let Some((control, data)) = self.open_ring(own) else {
            return Direct::default();
        };
        let mut token_read = None;
        let stream = &mut self.stream;
        let popped = self.consumer.pop_if(&data, |kind, body| {
            let Some(Record::SingleCopy {
                token,
                addr,
                len,
                header,
            }) = record::parse(kind, body)
            else {
                return None;
            };
            let header = match wire::decode_header(header) {
                Ok((h, declared, used)) if declared == len && used == header.len() => h,
                _ => return None,
            };
            let len = usize::try_from(len).ok()?;
            // A destination 1–63 bytes past the source modulo a page would make the kernel's
            // copy crawl (see `rankweave_core::byte_copy`): that one is left for `read`, which
            // reads into a buffer lined up with the source.
            if len > dst.len() || byte_copy::is_slow_copy(dst.as_ptr(), addr, len) {
                return None;
            }
            let taken = accept(&header, len)?;
            let share = stream.share_with_sender(read, len);
            read_payload_to(read, share, token, addr, &mut dst[..len]).ok()?;
            token_read = Some(token.saturating_add(1));
            Some(taken)
        });
        if let Some(n) = token_read {
            self.stream.tokens_read = self.stream.tokens_read.max(n);
        }
        let mut direct = self.direct(control, popped, false);
        direct.tokens_read = token_read.map(|_| self.stream.tokens_read);
        direct
    }

    /// The ring's control block and data, unless its sender said goodbye or broke the rules.
    fn open_ring<'s>(&self, own: &'s Segment) -> Option<(&'s RingControl, SharedBytes)> {
        if self.stream.said_bye || self.stream.broken {
            return None;
        }
        own.ring(self.stream.sender)
    }

    /// What a direct take came to; the space of what it consumed goes back to the producer.
    fn direct<T>(
        &mut self,
        control: &RingControl,
        popped: Popped<Option<T>>,
        single_copy_next: bool,
    ) -> Direct<T> {
        let taken = match popped {
            Popped::Record(Some(taken)) => Some(taken),
            Popped::Record(None) | Popped::Empty | Popped::Corrupt => None,
        };
        Direct {
            taken,
            // Padding before the record was consumed whatever came of it: its space goes back
            // to the producer now, not at the next read (which might be long in coming).
            producer_waits: self.consumer.release(control),
            single_copy_next,
            tokens_read: None,
        }
    }
}

/// What [`Inbound::take_eager`] or [`Inbound::take_single_copy`] did.
#[derive(Debug)]
pub(crate) struct Direct<T = EagerTaken> {
    /// What was taken, if it was what was wanted.
    pub(crate) taken: Option<T>,
    /// The producer waits for space and must be signalled.
    pub(crate) producer_waits: bool,
    /// Nothing was taken and the next record is a single-copy frame, which
    /// [`Inbound::take_single_copy`] may take.
    pub(crate) single_copy_next: bool,
    /// The sender's single-copy payloads read so far, when this take read one (to publish
    /// for the sender, as after [`Inbound::read`]).
    pub(crate) tokens_read: Option<u64>,
}

impl<T> Default for Direct<T> {
    fn default() -> Self {
        Direct {
            taken: None,
            producer_waits: false,
            single_copy_next: false,
            tokens_read: None,
        }
    }
}

impl Stream {
    /// The records from `sender`, none read yet.
    fn new(sender: u32) -> Stream {
        Stream {
            sender,
            arena: SmallCopies::default(),
            partial: None,
            said_bye: false,
            broken: false,
            tokens_read: 0,
            to_lend: None,
            lending: LendingTally::default(),
            free_streak: STEADILY_FREE,
        }
    }

    fn handle(
        &mut self,
        kind: u8,
        body: &[u8],
        into: &ReadInto<'_>,
        out: &mut Vec<Arrival>,
    ) -> Handled {
        let discard = into.discard;
        let rec = record::parse(kind, body);
        if !matches!(rec, Some(Record::SingleCopy { .. })) {
            // Whatever comes after a lent payload is delivered after it.
            self.settle_lent(into, out);
        }
        let Some(rec) = rec else {
            return Handled::Malformed;
        };
        match rec {
            Record::Frame(_) | Record::Short(..) if discard => Handled::Nothing,
            Record::Short(envelope, payload) => {
                self.deliver_inline(Header::Eager(envelope), payload, out)
            }
            Record::Frame(bytes) => match inline_frame(bytes) {
                Some((header, payload)) => self.deliver_inline(header, payload, out),
                None => Handled::Malformed,
            },
            Record::SingleCopy {
                token,
                addr,
                len,
                header,
            } => {
                // Counted read even when malformed or discarded: the sender may let go.
                self.tokens_read = self.tokens_read.max(token.saturating_add(1));
                let read = if discard {
                    None
                } else {
                    payload_read(token, addr, len, header)
                };
                match read {
                    None => {
                        self.settle_lent(into, out);
                        if discard {
                            Handled::Nothing
                        } else {
                            Handled::Malformed
                        }
                    }
                    Some(mut read) => {
                        read.share = self.share_with_sender(into, read.len);
                        if read.share && self.to_lend.is_none() && lendable(read.len as u64) {
                            Handled::Lendable(read)
                        } else {
                            self.read_and_deliver(read, into, out)
                        }
                    }
                }
            }
            Record::ChunkFirst { total, piece } => {
                let replaced = self.partial.take().is_some();
                let buf = (total <= MAX_PIECED_FRAME && (piece.len() as u64) <= total)
                    .then(|| into.pool.take(total as usize))
                    .flatten();
                let Some(mut buf) = buf else {
                    return Handled::Malformed;
                };
                byte_copy::extend_bytes(&mut buf, piece);
                self.partial = Some(Partial {
                    buf,
                    total: total as usize,
                });
                let r = self.complete(into, out);
                if replaced { Handled::Malformed } else { r }
            }
            Record::Chunk(piece) => match &mut self.partial {
                Some(p) if p.buf.len() + piece.len() <= p.total => {
                    byte_copy::extend_bytes(&mut p.buf, piece);
                    self.complete(into, out)
                }
                _ => {
                    self.partial = None;
                    Handled::Malformed
                }
            },
            Record::Bye => {
                self.said_bye = true;
                Handled::Nothing
            }
        }
    }

    /// Whether to share a single-copy payload of `len` bytes with its sender (split it, or
    /// lend it): it is long enough, the sender is free to help — it may write this
    /// process's memory, and this rank holds no payloads of its own for it, which it would be
    /// busy reading — and has been for the last [`STEADILY_FREE`] long payloads in a row
    /// since it last was not. The streak keeps the split out of traffic both ways
    /// (`rw-bench bibw`), where the sender is free only now and then, at the end of a window:
    /// helping then left the receiver waiting for its share, and moved lines of the
    /// receiver's buffers between the caches (bidirectional bandwidth at 64 KiB 0.71× the
    /// better MPI with the split, 0.96× with it off, 11 interleaved rounds); where the sender
    /// stays free (a window one way, a ping-pong) nothing changes but that the first payloads
    /// after traffic both ways are read alone.
    fn share_with_sender(&mut self, into: &ReadInto<'_>, len: usize) -> bool {
        if into.split.is_none() || (len as u64) < split_copy::SPLIT_MIN {
            return false;
        }
        self.free_streak = if (into.sender_free)() {
            self.free_streak.saturating_add(1)
        } else {
            0
        };
        self.free_streak >= STEADILY_FREE
    }

    /// A payload that [`handle`](Self::handle) found lendable, once the read has looked at
    /// the record after it: lent to the sender if that one is a payload to read meanwhile
    /// (`next_lendable`), else read now.
    fn read_or_lend(
        &mut self,
        read: PayloadRead,
        next_lendable: bool,
        into: &ReadInto<'_>,
        out: &mut Vec<Arrival>,
    ) -> Handled {
        if next_lendable {
            self.to_lend = Some(read);
            return Handled::Nothing;
        }
        self.read_and_deliver(read, into, out)
    }

    /// Reads a single-copy payload and delivers it. With a payload to lend before it, that
    /// one is lent first — after this one's buffer is taken: the application gives them back
    /// to the pool in order, so next time the sender writes the same buffer again and this
    /// side reads into the same one, each staying in the cache of the core that fills it
    /// (taken the other way round, the two buffers swapped sides each time and bandwidth at
    /// 64 KiB fell by a third) — then this one is read alone (the lent one holds the
    /// split-copy slot), and the lent one is finished and delivered before it.
    fn read_and_deliver(
        &mut self,
        read: PayloadRead,
        into: &ReadInto<'_>,
        out: &mut Vec<Arrival>,
    ) -> Handled {
        let Some(mut landing) = Landing::take(into, &read) else {
            self.settle_lent(into, out);
            return Handled::Malformed;
        };
        let lent = self.to_lend.take().map(|r| lend(into, r));
        let may_split = read.share && !matches!(lent, Some(Ok(_)));
        // SAFETY: the landing's spare capacity holds `read.len` bytes (`take_lined_up`), and
        // nothing else refers to it.
        let result = unsafe {
            read_payload_raw(
                into,
                may_split,
                read.token,
                read.addr,
                landing.dst(),
                read.len,
            )
        };
        match lent {
            Some(Ok(lent)) => {
                self.lending.lent += 1;
                let h = self.settle(lent, into, out);
                self.lending.add(h);
            }
            Some(Err(planned)) => {
                let h = self.read_and_deliver(planned, into, out);
                self.lending.add(h);
            }
            None => {}
        }
        // SAFETY: on success every byte of the payload was written, here or by the sender.
        unsafe { self.deliver_read(result, "single-copy read failed", read, landing, into, out) }
    }

    /// Reads and delivers the payload to lend, if any, now: nothing else follows it.
    fn settle_lent(&mut self, into: &ReadInto<'_>, out: &mut Vec<Arrival>) {
        if let Some(read) = self.to_lend.take() {
            let h = self.read_and_deliver(read, into, out);
            self.lending.add(h);
        }
    }

    /// Finishes a lent payload — reads what the sender has not claimed, waits for what it
    /// has — and delivers it.
    fn settle(&self, lent: Lent, into: &ReadInto<'_>, out: &mut Vec<Arrival>) -> Handled {
        let Lent {
            read,
            mut landing,
            offer,
        } = lent;
        let dst = landing.dst();
        let finished = match into.split {
            // SAFETY: the offer's destination is the landing's spare capacity, `read.len`
            // bytes, which nothing here has touched since it was lent; the buffer stays in
            // place.
            Some(slot) => unsafe { finish_offer(into, slot, offer, read.addr, dst, read.len) },
            // Not reached (a payload is lent only through the slot), but then it is this
            // side's to read.
            // SAFETY: as above, and nobody was offered these bytes.
            None => unsafe { cma::read_raw(into.sender_pid, read.addr, dst, read.len) },
        };
        let what = "lent single-copy read failed";
        // SAFETY: on success every byte was written, by the sender or by this side.
        unsafe { self.deliver_read(finished, what, read, landing, into, out) }
    }

    /// Delivers a single-copy payload read into `landing` if `filled` says the read worked; a
    /// failed one is logged as `what` and its record counts as malformed.
    ///
    /// # Safety
    ///
    /// If `filled` is `Ok`, the first `read.len` bytes of the landing's spare capacity have
    /// been written.
    unsafe fn deliver_read(
        &self,
        filled: Result<(), String>,
        what: &str,
        read: PayloadRead,
        mut landing: Landing,
        into: &ReadInto<'_>,
        out: &mut Vec<Arrival>,
    ) -> Handled {
        if let Err(e) = filled {
            tracing::warn!(sender = self.sender, error = %e, "{what}");
            return Handled::Malformed;
        }
        // SAFETY: the caller's promise, for a read that worked.
        unsafe { landing.buf.set_len(landing.buf.len() + read.len) };
        let payload = into.pool.freeze_after(landing.buf, landing.skip);
        out.push(Arrival::Frame {
            from: self.sender,
            frame: Frame {
                header: read.header,
                payload,
            },
        });
        Handled::ReadAcross(read.len)
    }

    /// Delivers the reassembled frame once all its pieces are in.
    fn complete(&mut self, into: &ReadInto<'_>, out: &mut Vec<Arrival>) -> Handled {
        match self.partial.take_if(|p| p.buf.len() == p.total) {
            Some(_) if into.discard => Handled::Nothing,
            Some(p) => self.deliver(into.pool.freeze(p.buf), out),
            None => Handled::Nothing,
        }
    }

    /// A frame read in place from the ring (an inline record): its payload copied out.
    fn deliver_inline(
        &mut self,
        header: Header,
        payload: &[u8],
        out: &mut Vec<Arrival>,
    ) -> Handled {
        let n = payload.len();
        let payload = self.arena.copy(payload);
        out.push(Arrival::Frame {
            from: self.sender,
            frame: Frame { header, payload },
        });
        Handled::Delivered(n)
    }

    fn deliver(&self, bytes: Bytes, out: &mut Vec<Arrival>) -> Handled {
        match wire::decode(bytes) {
            Ok(frame) => {
                let n = frame.payload.len();
                out.push(Arrival::Frame {
                    from: self.sender,
                    frame,
                });
                Handled::Delivered(n)
            }
            Err(_) => Handled::Malformed,
        }
    }
}

/// A single-copy record's payload, its frame header decoded (`None` if it does not decode or
/// does not match the record). The payload will get a buffer of its own (typically a power
/// of two, which the pool keeps well), apart from the header.
fn payload_read(token: u64, addr: u64, len: u64, header: &[u8]) -> Option<PayloadRead> {
    let header = match wire::decode_header(header) {
        Ok((h, declared, used)) if declared == len && used == header.len() => h,
        _ => return None,
    };
    Some(PayloadRead {
        header,
        token,
        addr,
        len: usize::try_from(len).ok()?,
        share: false,
    })
}

/// Lends `read` whole to the sender (`SplitSlot::lend`) in a buffer of its own; gives it
/// back if it cannot be lent.
fn lend(into: &ReadInto<'_>, read: PayloadRead) -> Result<Lent, PayloadRead> {
    let (Some(slot), Some(mut landing)) = (into.split, Landing::take(into, &read)) else {
        return Err(read);
    };
    let offer = slot.lend(read.token, landing.dst() as u64, read.len as u64);
    Ok(Lent {
        read,
        landing,
        offer,
    })
}

/// Whether a payload of `len` bytes is of a length to lend to the sender (see
/// `split_copy::LEND_MAX`), should another follow it.
fn lendable(len: u64) -> bool {
    (split_copy::SPLIT_MIN..=split_copy::LEND_MAX).contains(&len)
}

/// Whether a record is a single-copy payload that the receiver may read itself while the
/// sender writes a lent one.
fn lendable_record(kind: u8, body: &[u8]) -> bool {
    kind == record::SINGLE_COPY
        && matches!(record::parse(kind, body), Some(Record::SingleCopy { len, .. }) if lendable(len))
}

/// Reads the single-copy payload of `dst.len()` bytes at `addr` of the sender into `dst` (see
/// [`read_payload_raw`]; `share`: [`Stream::share_with_sender`]).
fn read_payload_to(
    into: &ReadInto<'_>,
    share: bool,
    token: u64,
    addr: u64,
    dst: &mut [u8],
) -> Result<(), String> {
    // SAFETY: an exclusively borrowed slice: writable for its length, and nothing else
    // accesses it until this returns.
    unsafe { read_payload_raw(into, share, token, addr, dst.as_mut_ptr(), dst.len()) }
}

/// Reads a single-copy payload of `len` bytes at `addr` of the sender to `dst`: shared with
/// the sender where the pair has a split-copy slot, `may_split` (the caller asked
/// [`Stream::share_with_sender`]) and the payload is long enough (see `split_copy`), else in
/// one read.
///
/// # Safety
///
/// `dst` is writable for `len` bytes, and nothing else reads or writes them until this returns.
unsafe fn read_payload_raw(
    into: &ReadInto<'_>,
    may_split: bool,
    token: u64,
    addr: u64,
    dst: *mut u8,
    len: usize,
) -> Result<(), String> {
    let Some(slot) = into
        .split
        .filter(|_| may_split && len as u64 >= split_copy::SPLIT_MIN && (into.sender_free)())
    else {
        // SAFETY: the caller's promise.
        return unsafe { cma::read_raw(into.sender_pid, addr, dst, len) };
    };
    // From here until the offer is finished, the sender may write any chunk it claims to
    // `dst`: nothing here touches those bytes but the reads of the chunks this side claims.
    let offer = slot.offer(token, dst as u64, len as u64);
    if len as u64 >= split_copy::WAKE_MIN {
        (into.wake_sender)();
    }
    // SAFETY: the caller's promise, and `offer` is of these bytes.
    unsafe { finish_offer(into, slot, offer, addr, dst, len) }
}

/// The receiver's part of `offer` (a payload of `len` bytes at `addr` of the sender, going to
/// `dst`): reads the chunks the sender has not claimed, waits for those it has, and reads
/// the whole payload again if the sender's copy failed.
///
/// # Safety
///
/// `dst` is writable for `len` bytes and is the offer's destination, and nothing but the two
/// sides' copies of their claims reads or writes them until this returns.
unsafe fn finish_offer(
    into: &ReadInto<'_>,
    slot: &SplitSlot,
    offer: split_copy::Offer,
    addr: u64,
    dst: *mut u8,
    len: usize,
) -> Result<(), String> {
    let pid = into.sender_pid;
    slot.read_chunks(offer.tag, |c| {
        // SAFETY: the chunk lies within `dst..dst + len` (the caller's writable bytes) and was
        // claimed by this side alone: the sender writes only the chunks it claimed.
        unsafe {
            cma::read_raw(
                pid,
                addr + c.offset,
                dst.add(c.offset as usize),
                c.len as usize,
            )
        }
        .is_ok()
    });
    wait_for_sender(slot, offer, into)?;
    if slot.failed() {
        // The sender still holds the payload (its token is not counted read yet).
        // SAFETY: `dst..dst + len` is the caller's, and no chunk is out any more.
        unsafe { cma::read_raw(pid, addr, dst, len)? };
    }
    Ok(())
}

/// Waits until every chunk of `offer` is copied: the chunks the sender claimed are being
/// written by one system call each, so this is a wait of microseconds (yielding the core now
/// and then, in case the sender shares it), unless the sender's process has died.
fn wait_for_sender(
    slot: &SplitSlot,
    offer: split_copy::Offer,
    into: &ReadInto<'_>,
) -> Result<(), String> {
    let mut spins = 0u32;
    while !slot.is_finished(offer) {
        spins = spins.wrapping_add(1);
        if spins % 128 != 0 {
            std::hint::spin_loop();
            continue;
        }
        if into.sender_watch.is_some_and(|w| w.has_exited()) {
            return Err("the sender exited while writing its share of a payload".into());
        }
        std::thread::yield_now();
    }
    Ok(())
}

/// An inline frame's header, decoded where it lies in the ring, and its payload (the checks
/// are `wire::decode`'s); `None` if it does not decode or its length disagrees.
fn inline_frame(body: &[u8]) -> Option<(Header, &[u8])> {
    match wire::decode_header(body) {
        Ok((h, declared, used)) if declared == (body.len() - used) as u64 => {
            Some((h, &body[used..]))
        }
        _ => None,
    }
}

/// What handling one record did.
enum Handled {
    Delivered(usize),
    /// A single-copy payload that may be lent to the sender, if another follows: the read
    /// looks at the next record, then asks [`Stream::read_or_lend`].
    Lendable(PayloadRead),
    /// Delivered by a single-copy read of this many bytes: the read stops after it.
    ReadAcross(usize),
    Malformed,
    Nothing,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// A receiver shares long payloads with a sender that is free to help from the start; once
    /// it finds the sender busy (traffic both ways), only after the sender has been free for
    /// `STEADILY_FREE` long payloads in a row. Short payloads, and a pair without a slot, never.
    #[test]
    fn a_sender_busy_once_is_shared_with_again_only_after_a_free_streak() {
        let slot = SplitSlot::default();
        let pool = Arc::new(BufferPool::default());
        let free = Cell::new(true);
        let sender_free = || free.get();
        let into = ReadInto {
            sender_pid: 0,
            split: Some(&slot),
            sender_free: &sender_free,
            sender_watch: None,
            wake_sender: &|| {},
            pool: &pool,
            discard: false,
        };
        let mut stream = Stream::new(1);
        let long = split_copy::SPLIT_MIN as usize;
        assert!(stream.share_with_sender(&into, long));
        assert!(!stream.share_with_sender(&into, long - 1), "too short");
        free.set(false);
        assert!(!stream.share_with_sender(&into, long));
        free.set(true);
        for i in 1..STEADILY_FREE {
            assert!(
                !stream.share_with_sender(&into, long),
                "payload {i} of the streak"
            );
        }
        assert!(stream.share_with_sender(&into, long));
        assert!(stream.share_with_sender(&into, 1 << 20));
        let alone = ReadInto {
            split: None,
            ..into
        };
        assert!(!stream.share_with_sender(&alone, long), "no slot");
    }
}
