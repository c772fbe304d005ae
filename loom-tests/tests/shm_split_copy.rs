//! Loom models of the shared-memory transport's split copy (transports/src/shm/split_copy.rs):
//! a receiver offers a payload and reads chunks of it while the sender claims chunks and
//! writes them into the receiver's buffer.
//!
//! The receiver's buffers are loom-checked `SharedBytes` with one granule per chunk, and the
//! "copies" write a pattern into them: a receiver that looked at its buffer before the
//! sender's chunk was done, or two claimers writing the same chunk, is a causality violation;
//! a chunk written with another payload's bytes (a claim that outlived its offer) fails the
//! content check.
//!
//! Run: `LOOM_MAX_PREEMPTIONS=3 cargo test -p loom-tests --release`. See README.md.

use loom::sync::Arc;
use loom::sync::atomic::{AtomicBool, Ordering};
use loom::thread;
use loom_tests::harness::model;
use loom_tests::split_api::{Chunk, Offer, SPLIT_MIN, SplitSlot, chunks_for, tag_of};
use loom_tests::sync::SharedBytes;

/// How many times a waiting side yields before the model declares it stuck.
const SPINS: usize = 50;

/// Payload length: two chunks.
const LEN: u64 = SPLIT_MIN;
/// One granule per chunk.
const GRANULE: usize = (SPLIT_MIN / 2) as usize;

/// The receiver's buffers, one per offer; an offer's `dst` is the buffer's index.
struct Job {
    slot: SplitSlot,
    buffers: Vec<SharedBytes>,
    /// The receiver has finished every offer: the helper stops looking.
    over: AtomicBool,
}

impl Job {
    fn new(offers: usize) -> Arc<Job> {
        assert_eq!(chunks_for(LEN), 2);
        Arc::new(Job {
            slot: SplitSlot::default(),
            buffers: (0..offers)
                .map(|_| SharedBytes::new(LEN as usize, GRANULE))
                .collect(),
            over: AtomicBool::new(false),
        })
    }

    /// Copies chunk `c` of the payload with tag `tag` (its bytes are the tag) into the buffer
    /// the offer named.
    fn copy(&self, tag: u64, c: Chunk) -> bool {
        let bytes = vec![tag as u8; c.len as usize];
        // SAFETY (loom's SharedBytes checks it): the claim makes this chunk this side's alone.
        unsafe { self.buffers[c.dst as usize].write(c.offset as usize, &bytes) };
        true
    }

    /// The receiver: offers payload `token` into buffer `token`, reads its share, waits for
    /// the sender's, and checks the whole buffer holds this payload's bytes.
    fn receive(&self, token: u64) {
        let offer = self.slot.offer(token, token, LEN);
        let tag = offer.tag();
        self.slot.read_chunks(tag, |c| self.copy(tag, c));
        self.wait(offer);
        assert!(!self.slot.failed());
        // SAFETY (checked by loom): every chunk is finished, so no writer remains.
        let whole =
            unsafe { self.buffers[token as usize].with_slice(0, LEN as usize, |b| b.to_vec()) };
        assert!(
            whole.iter().all(|&b| b == tag as u8),
            "payload {token}: a chunk holds another payload's bytes"
        );
    }

    /// The receiver waits until every chunk of `offer` is copied.
    fn wait(&self, offer: Offer) {
        let mut spins = 0;
        while !self.slot.is_finished(offer) {
            spins += 1;
            assert!(spins < SPINS, "the sender's chunk never finished");
            thread::yield_now();
        }
    }

    /// The receiver lends payload `token` whole into buffer `token`, reads payload
    /// `token + 1` itself into its buffer meanwhile (not through the slot), then takes back
    /// what the sender has not claimed, waits for what it has, and checks the lent buffer.
    fn lend_then_read_next(&self, token: u64) {
        let offer = self.slot.lend(token, token, LEN);
        assert_eq!(offer.chunks(), 1);
        let tag = offer.tag();
        let next = token as usize + 1;
        // SAFETY (checked by loom): nobody else writes the next payload's buffer.
        unsafe { self.buffers[next].write(0, &vec![tag_of(next as u64) as u8; LEN as usize]) };
        self.slot.read_chunks(tag, |c| self.copy(tag, c));
        self.wait(offer);
        // SAFETY (checked by loom): the lent payload is finished, so no writer remains.
        let whole =
            unsafe { self.buffers[token as usize].with_slice(0, LEN as usize, |b| b.to_vec()) };
        assert!(whole.iter().all(|&b| b == tag as u8), "the lent payload");
    }

    /// The sender: helps with whatever offer is open until the receiver is over.
    fn help(&self) {
        for _ in 0..SPINS {
            if self.over.load(Ordering::Acquire) {
                return;
            }
            if let Some(tag) = self.slot.open_offer() {
                self.slot.take_chunks(tag, |c| self.copy(tag, c));
            }
            thread::yield_now();
        }
    }
}

/// Runs `receiver` on this thread while the sender helps on another, then stops the sender.
fn with_sender(job: Arc<Job>, receiver: impl FnOnce(&Job)) {
    let sender = {
        let job = job.clone();
        thread::spawn(move || job.help())
    };
    receiver(&job);
    job.over.store(true, Ordering::Release);
    sender.join().unwrap();
}

/// (a) One payload, both sides copying: every chunk is copied once, and the receiver sees the
/// sender's chunk complete (its `done` is `Release`/`Acquire`) before it reads its buffer.
#[test]
fn one_payload_two_copiers() {
    model(|| {
        with_sender(Job::new(1), |job| job.receive(0));
    });
}

/// (b) Two payloads in turn, into two buffers: a sender that saw the first offer and claims
/// late must not write the first payload into the second's buffer (a claim names its offer).
#[test]
fn a_late_claim_never_lands_in_the_next_payload() {
    model(|| {
        assert_ne!(tag_of(0), tag_of(1));
        with_sender(Job::new(2), |job| {
            job.receive(0);
            job.receive(1);
        });
    });
}

/// (c) A sender whose copy fails: the receiver learns it (once the offer is finished) and
/// does not mistake the chunk for copied.
#[test]
fn a_failed_share_is_reported() {
    model(|| {
        let job = Job::new(1);
        let sender = {
            let job = job.clone();
            thread::spawn(move || {
                for _ in 0..SPINS {
                    if let Some(tag) = job.slot.open_offer() {
                        if job.slot.claim_one(tag, |_| false).is_some() {
                            return true;
                        }
                    }
                    if job.over.load(Ordering::Acquire) {
                        return false;
                    }
                    thread::yield_now();
                }
                false
            })
        };
        let offer = job.slot.offer(0, 0, LEN);
        job.slot
            .read_chunks(offer.tag(), |c| job.copy(offer.tag(), c));
        let mut spins = 0;
        while !job.slot.is_finished(offer) {
            spins += 1;
            assert!(spins < SPINS, "the sender's chunk never finished");
            thread::yield_now();
        }
        let failed = job.slot.failed();
        job.over.store(true, Ordering::Release);
        let sender_failed_one = sender.join().unwrap();
        assert_eq!(failed, sender_failed_one);
    });
}

/// (d) A payload lent whole while the receiver reads the next one, then an ordinary offer:
/// either side copies the lent one, once, and the receiver sees it complete before it reads
/// its buffer; a sender that claims the lent payload late writes nothing into the next
/// offer's buffer.
#[test]
fn a_lent_payload_is_copied_once_by_either_side() {
    model(|| {
        with_sender(Job::new(3), |job| {
            job.lend_then_read_next(0);
            job.receive(2);
        });
    });
}
