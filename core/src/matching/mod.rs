//! MPI matching: the posted-receive queue and the unexpected-message queue of one rank.
//!
//! The rules are MPI's. An arriving message goes to the *earliest-posted* receive whose
//! [`Selector`] matches its [`MatchKey`]; a new receive takes the *earliest-arrived* unexpected
//! message it matches. Between calls no queued receive matches any queued message, and
//! messages never match across contexts.
//!
//! Both directions are O(1) on average, wildcards included, because each queue is indexed by
//! the four shapes a selector can have (see [`Selector`]):
//!
//! * a posted receive sits in the one list of its own shape, so an arriving message checks the
//!   fronts of the (at most) four lists it could match and takes the earliest-posted of them;
//! * an unexpected message sits in four lists at once, one per shape that could select it, so
//!   a receive reads the front of exactly one list, and removal unlinks from all four.
//!
//! All lists are intrusive lists in a slab (module `list`): no tombstones, and empty lists are
//! dropped, so memory stays proportional to what is queued.
//!
//! Indexing an unexpected message four ways is the dearest step of matching, and a stream (a
//! receiver that falls behind its sender, then posts one receive per message in order) never
//! needs it: each receive takes the oldest message. So an unexpected message is first appended
//! to a plain FIFO of *fresh* messages, all younger than every indexed one, and indexed only
//! when a receive or probe walks past it without taking it. A receive looks at the indexes
//! first (older messages), then at the fresh FIFO from its front, indexing each message that
//! does not match until one does. A stream's receive takes the FIFO's front and never indexes
//! anything; any other pattern indexes each message at most once, as before.

mod list;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::fmt;

use crate::types::ContextId;
use list::SlabLists;

/// The envelope of an arrived message, as matching sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MatchKey {
    /// The context (communicator) the message was sent in.
    pub context: ContextId,
    /// The sender's rank in that communicator.
    pub source: u32,
    /// The tag it was sent with.
    pub tag: u32,
}

impl MatchKey {
    /// The four selectors, one per shape, that match this key, in lane order (see
    /// [`Selector::lane`]).
    fn selectors(&self) -> [Selector; LANES] {
        let (context, source, tag) = (self.context, Some(self.source), Some(self.tag));
        [
            Selector {
                context,
                source,
                tag,
            },
            Selector {
                context,
                source,
                tag: None,
            },
            Selector {
                context,
                source: None,
                tag,
            },
            Selector {
                context,
                source: None,
                tag: None,
            },
        ]
    }
}

/// What a receive or probe accepts: one context, and a source and tag that are either exact or
/// wildcards (`None`, MPI's `MPI_ANY_SOURCE` / `MPI_ANY_TAG`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Selector {
    /// The only context this selector accepts; contexts never cross.
    pub context: ContextId,
    /// The accepted sender, or `None` for any sender.
    pub source: Option<u32>,
    /// The accepted tag, or `None` for any tag.
    pub tag: Option<u32>,
}

/// Selectors key the index maps on every message's path, so they hash as two words instead of
/// five. Equal selectors hash equally; the rare `Some(u32::MAX)` / `None` collision only costs a
/// comparison.
impl std::hash::Hash for Selector {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        let source = u64::from(self.source.unwrap_or(u32::MAX));
        let tag = u64::from(self.tag.unwrap_or(u32::MAX));
        state.write_u64(self.context.0);
        state.write_u64((source << 32) | tag);
    }
}

impl Selector {
    /// Whether a message with envelope `key` satisfies this selector.
    pub fn matches(&self, key: &MatchKey) -> bool {
        self.context == key.context
            && self.source.is_none_or(|source| source == key.source)
            && self.tag.is_none_or(|tag| tag == key.tag)
    }

    /// Index of this selector's shape: exact, any tag, any source, any-any. A key's selector
    /// of shape `i` is `key.selectors()[i]`, and the selector itself names the list to read.
    fn lane(&self) -> usize {
        match (self.source, self.tag) {
            (Some(_), Some(_)) => 0,
            (Some(_), None) => 1,
            (None, Some(_)) => 2,
            (None, None) => 3,
        }
    }
}

/// The slot a [`PostedKey`] names for the receive kept outside the lists (`Matcher::solo`);
/// no slab slot is ever this large.
const SOLO: usize = usize::MAX;

/// Number of selector shapes, hence of indexes per queue.
const LANES: usize = 4;

/// A message that arrived before a receive wanted it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unexpected<M> {
    /// Arrival order number assigned by the [`Matcher`]; earlier arrivals have smaller numbers.
    /// It travels with the message so that [`Matcher::requeue`] can restore its place in line.
    pub seq: u64,
    /// The message's envelope.
    pub key: MatchKey,
    /// The caller's message payload or handle.
    pub msg: M,
}

/// Names a queued receive, for [`Matcher::cancel`].
///
/// It holds the receive's slot and its posting number, so a stale key (for a receive that
/// already matched or was cancelled) never withdraws a newer receive that reuses the slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PostedKey {
    slot: usize,
    seq: u64,
}

/// Result of [`Matcher::post`].
#[must_use = "a matched receive must be completed with its message"]
#[derive(Debug, PartialEq, Eq)]
pub enum PostOutcome<R, M> {
    /// No unexpected message matched; the receive is queued under this key.
    Queued(PostedKey),
    /// The receive took the earliest-arrived matching unexpected message, which left the queue.
    Matched {
        /// The receive, handed back.
        recv: R,
        /// The message it takes.
        unexpected: Unexpected<M>,
    },
}

/// Result of [`Matcher::arrive`] and [`Matcher::requeue`].
#[must_use = "a matched receive must be completed with its message"]
#[derive(Debug, PartialEq, Eq)]
pub enum ArriveOutcome<R, M> {
    /// The earliest-posted matching receive takes the message; the receive left the queue.
    Matched {
        /// The receive that takes the message.
        recv: R,
        /// The message, with its arrival number.
        unexpected: Unexpected<M>,
    },
    /// No receive matched; the message is queued as unexpected.
    Queued,
}

/// A queued receive and its posting number (posting order decides among matching receives).
struct Posted<R> {
    seq: u64,
    sel: Selector,
    recv: R,
}

/// One rank's matching engine: queued receives of type `R`, unexpected messages of type `M`.
pub struct Matcher<R, M> {
    /// Each receive is in one list: the one keyed by its own selector.
    posted: SlabLists<Selector, Posted<R>, 1>,
    /// Each message is in four lists: lane `i` keyed by `key.selectors()[i]`, in arrival order.
    unexpected: SlabLists<Selector, Unexpected<M>, LANES>,
    /// Unexpected messages not indexed yet, in arrival order; every one arrived after every
    /// message in `unexpected`. No queued receive matches any of them.
    fresh: VecDeque<Unexpected<M>>,
    /// Queued receives per selector shape, so an arrival only looks up shapes in use (usually
    /// just exact receives: one lookup instead of four).
    posted_shapes: [usize; LANES],
    /// One queued receive kept outside the lists: the first one posted while this place is
    /// free. A rank that waits for one message at a time (a ping-pong, a collective's next
    /// step, whose tag is new every time) never touches the lists; when others are queued
    /// too, its posting number decides between it and the lists' fronts.
    solo: Option<Posted<R>>,
    next_post: u64,
    next_arrival: u64,
}

impl<R, M> Default for Matcher<R, M> {
    fn default() -> Self {
        Self::new()
    }
}

impl<R, M> fmt::Debug for Matcher<R, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Matcher")
            .field("posted", &self.posted_len())
            .field("unexpected", &self.unexpected_len())
            .finish_non_exhaustive()
    }
}

impl<R, M> Matcher<R, M> {
    /// An empty matcher.
    pub fn new() -> Self {
        Matcher {
            posted: SlabLists::new(),
            unexpected: SlabLists::new(),
            fresh: VecDeque::new(),
            posted_shapes: [0; LANES],
            solo: None,
            next_post: 0,
            next_arrival: 0,
        }
    }

    /// Posts a receive: it takes the earliest-arrived unexpected message `sel` matches
    /// (removing it), or else is queued.
    pub fn post(&mut self, sel: Selector, recv: R) -> PostOutcome<R, M> {
        let found = match self.unexpected.len() {
            0 => None,
            _ => self.unexpected.front(sel.lane(), &sel),
        };
        if let Some(slot) = found {
            let unexpected = self.unexpected.remove(slot);
            return PostOutcome::Matched { recv, unexpected };
        }
        if self.fresh_front_matching(&sel) {
            if let Some(unexpected) = self.fresh.pop_front() {
                return PostOutcome::Matched { recv, unexpected };
            }
        }
        let seq = self.next_post;
        self.next_post += 1;
        if self.solo.is_none() {
            self.solo = Some(Posted { seq, sel, recv });
            return PostOutcome::Queued(PostedKey { slot: SOLO, seq });
        }
        let slot = self.posted.push_back([sel], Posted { seq, sel, recv });
        self.posted_shapes[sel.lane()] += 1;
        PostOutcome::Queued(PostedKey { slot, seq })
    }

    /// A message arrives: it gets the next arrival number, then the earliest-posted matching
    /// receive takes it (leaving the queue), or else it is queued as unexpected.
    pub fn arrive(&mut self, key: MatchKey, msg: M) -> ArriveOutcome<R, M> {
        let seq = self.next_arrival;
        self.next_arrival += 1;
        let unexpected = Unexpected { seq, key, msg };
        match self.take_earliest_posted(&key) {
            Some(recv) => ArriveOutcome::Matched { recv, unexpected },
            None => {
                self.fresh.push_back(unexpected);
                ArriveOutcome::Queued
            }
        }
    }

    /// Takes the earliest-arrived unexpected message `sel` matches if `take` accepts it (the
    /// matcher's state is as after [`post`](Self::post) took it); otherwise leaves everything
    /// queued and returns `None`.
    ///
    /// This is `post` without queueing a receive: a caller that can complete at once with the
    /// message it finds skips creating one.
    pub fn take_if(
        &mut self,
        sel: &Selector,
        take: impl FnOnce(&Unexpected<M>) -> bool,
    ) -> Option<Unexpected<M>> {
        if let Some(slot) = match self.unexpected.len() {
            0 => None,
            _ => self.unexpected.front(sel.lane(), sel),
        } {
            return take(self.unexpected.get(slot)?).then(|| self.unexpected.remove(slot));
        }
        if self.fresh_front_matching(sel) && take(self.fresh.front()?) {
            return self.fresh.pop_front();
        }
        None
    }

    /// Indexes fresh messages from the front of the FIFO until its front matches `sel`;
    /// returns whether it does (`false`: the FIFO is empty now).
    fn fresh_front_matching(&mut self, sel: &Selector) -> bool {
        while let Some(u) = self.fresh.front() {
            if sel.matches(&u.key) {
                return true;
            }
            if let Some(u) = self.fresh.pop_front() {
                self.unexpected.push_back(u.key.selectors(), u);
            }
        }
        false
    }

    /// Indexes every fresh message.
    fn index_fresh(&mut self) {
        while let Some(u) = self.fresh.pop_front() {
            self.unexpected.push_back(u.key.selectors(), u);
        }
    }

    /// Puts back a message that matched earlier (its receive was dropped, or the buffer was too
    /// small), keeping its original arrival number: the earliest-posted matching receive takes
    /// it, or else it goes back into the unexpected queue where its number places it, ahead of
    /// later arrivals and behind earlier ones.
    ///
    /// Finding that place walks back from the end of each index over the messages that arrived
    /// after it and are still queued; this path is rare.
    pub fn requeue(&mut self, u: Unexpected<M>) -> ArriveOutcome<R, M> {
        debug_assert!(
            u.seq < self.next_arrival,
            "requeue of a message never numbered here"
        );
        match self.take_earliest_posted(&u.key) {
            Some(recv) => ArriveOutcome::Matched {
                recv,
                unexpected: u,
            },
            None => {
                // Rare: index everything, then find the message's place among all of them.
                self.index_fresh();
                self.unexpected
                    .insert_ordered(u.key.selectors(), u, |queued| queued.seq);
                ArriveOutcome::Queued
            }
        }
    }

    /// A message arrives for the queued receive `posted`, which the caller knows to be the
    /// earliest-posted receive matching it (say, the only one queued): withdraws the receive
    /// and returns it with the message's arrival number, as [`arrive`](Self::arrive) would
    /// have, without looking at any other receive. `None` (and nothing changes) if the
    /// receive is no longer queued.
    pub fn arrive_for(&mut self, posted: PostedKey) -> Option<(R, u64)> {
        let recv = self.cancel(posted)?;
        Some((recv, self.next_arrival()))
    }

    /// The arrival number of a message taken by a receive the matcher never held (the
    /// endpoint's lone receive): numbered as [`arrive`](Self::arrive) would have, so that
    /// giving it back puts it in its place.
    pub fn next_arrival(&mut self) -> u64 {
        let seq = self.next_arrival;
        self.next_arrival += 1;
        seq
    }

    /// Withdraws a queued receive. Returns `None` if it is no longer queued (it matched, was
    /// cancelled or was taken by [`take_posted_from`](Self::take_posted_from)).
    pub fn cancel(&mut self, key: PostedKey) -> Option<R> {
        if key.slot == SOLO {
            return self.solo.take_if(|p| p.seq == key.seq).map(|p| p.recv);
        }
        // The posting number guards against the slot having been reused by a newer receive.
        let posted = self.posted.get(key.slot)?;
        (posted.seq == key.seq).then(|| self.remove_posted(key.slot))
    }

    /// The earliest-arrived unexpected message `sel` matches, left in the queue.
    ///
    /// Takes `&mut self` because it indexes the fresh messages it walks past (see the module
    /// docs); what is queued, and in which order, does not change.
    pub fn probe(&mut self, sel: &Selector) -> Option<&Unexpected<M>> {
        if let Some(slot) = self.unexpected.front(sel.lane(), sel) {
            return self.unexpected.get(slot);
        }
        if self.fresh_front_matching(sel) {
            self.fresh.front()
        } else {
            None
        }
    }

    /// Withdraws, in posting order, every queued receive whose selector names exactly `source`
    /// (in any context): those receives can no longer complete once that peer is gone.
    /// Any-source receives stay queued.
    ///
    /// This scans all queued receives; it runs once per lost peer, not per message.
    pub fn take_posted_from(&mut self, source: u32) -> Vec<R> {
        let mut doomed: Vec<(u64, usize)> = self
            .posted_iter()
            .filter(|(_, posted)| posted.sel.source == Some(source))
            .map(|(slot, posted)| (posted.seq, slot))
            .collect();
        doomed.sort_unstable();
        doomed
            .into_iter()
            .filter_map(|(_, slot)| match slot {
                SOLO => self.solo.take().map(|p| p.recv),
                _ => Some(self.remove_posted(slot)),
            })
            .collect()
    }

    /// Number of queued unexpected messages.
    pub fn unexpected_len(&self) -> usize {
        self.unexpected.len() + self.fresh.len()
    }

    /// Number of queued receives.
    pub fn posted_len(&self) -> usize {
        self.posted.len() + usize::from(self.solo.is_some())
    }

    /// Every queued receive with its slot ([`SOLO`] for the one outside the lists).
    fn posted_iter(&self) -> impl Iterator<Item = (usize, &Posted<R>)> {
        self.solo
            .iter()
            .map(|p| (SOLO, p))
            .chain(self.posted.iter())
    }

    /// Removes and returns the earliest-posted queued receive matching `key`: the solo one or
    /// the earliest of the fronts of the lists whose selectors match it.
    fn take_earliest_posted(&mut self, key: &MatchKey) -> Option<R> {
        let solo = self
            .solo
            .as_ref()
            .filter(|p| p.sel.matches(key))
            .map(|p| p.seq);
        match (solo, self.earliest_listed(key)) {
            (Some(solo), Some((listed, _))) if solo < listed => self.solo.take().map(|p| p.recv),
            (_, Some((_, slot))) => Some(self.remove_posted(slot)),
            (Some(_), None) => self.solo.take().map(|p| p.recv),
            (None, None) => None,
        }
    }

    /// The posting number and slot of the earliest receive in the lists matching `key`: the
    /// earliest of the fronts of the (at most four) lists whose selectors match it.
    fn earliest_listed(&self, key: &MatchKey) -> Option<(u64, usize)> {
        if self.posted.len() == 0 {
            return None;
        }
        if self.posted_shapes[1..] == [0; LANES - 1] {
            // Only fully specified receives are posted (the common case): the one list that
            // can match is the key's own, and its front is the earliest of them.
            let exact = Selector {
                context: key.context,
                source: Some(key.source),
                tag: Some(key.tag),
            };
            let slot = self.posted.front(0, &exact)?;
            return Some((self.posted.get(slot)?.seq, slot));
        }
        key.selectors()
            .iter()
            .enumerate()
            .filter(|&(lane, _)| self.posted_shapes[lane] > 0)
            .filter_map(|(_, sel)| {
                let slot = self.posted.front(0, sel)?;
                Some((self.posted.get(slot)?.seq, slot))
            })
            .min()
    }

    fn remove_posted(&mut self, slot: usize) -> R {
        let posted = self.posted.remove(slot);
        self.posted_shapes[posted.sel.lane()] -= 1;
        posted.recv
    }

    /// Number of non-empty index lists (posted, unexpected): zero when both queues are empty
    /// and no list head leaked.
    #[cfg(test)]
    pub(crate) fn index_lists(&self) -> (usize, usize) {
        (self.posted.list_count(), self.unexpected.list_count())
    }

    /// The most list heads (empty ones included) any index holds.
    #[cfg(test)]
    pub(crate) fn max_heads(&self) -> usize {
        self.posted.max_heads().max(self.unexpected.max_heads())
    }

    /// Checks the indexes' internal consistency and the matching invariant: lists ordered by
    /// posting / arrival number, each entry in the lists its selector or key names, and no
    /// queued receive matching any queued message.
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) {
        for (_, sel, slots) in self.posted.check() {
            let seqs: Vec<u64> = slots
                .iter()
                .map(|&s| self.posted.get(s).unwrap().seq)
                .collect();
            assert!(seqs.is_sorted(), "posted list {sel:?} out of order");
            for &slot in &slots {
                assert_eq!(self.posted.get(slot).unwrap().sel, sel);
            }
        }
        for (lane, sel, slots) in self.unexpected.check() {
            let seqs: Vec<u64> = slots
                .iter()
                .map(|&s| self.unexpected.get(s).unwrap().seq)
                .collect();
            assert!(seqs.is_sorted(), "unexpected list {sel:?} out of order");
            for &slot in &slots {
                assert_eq!(
                    self.unexpected.get(slot).unwrap().key.selectors()[lane],
                    sel
                );
            }
        }
        let fresh: Vec<u64> = self.fresh.iter().map(|u| u.seq).collect();
        assert!(fresh.is_sorted(), "fresh messages out of order");
        if let (Some(first), Some(indexed)) = (
            fresh.first(),
            self.unexpected.iter().map(|(_, u)| u.seq).max(),
        ) {
            assert!(
                indexed < *first,
                "a fresh message is older than an indexed one"
            );
        }
        for (_, posted) in self.posted_iter() {
            for u in self.unexpected.iter().map(|(_, u)| u).chain(&self.fresh) {
                assert!(
                    !posted.sel.matches(&u.key),
                    "queued receive matches queued message"
                );
            }
        }
    }
}
