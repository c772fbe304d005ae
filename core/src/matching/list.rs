//! Intrusive doubly-linked lists threaded through one [`Slab`].
//!
//! Every entry lives in exactly one slab slot and is linked into `N` lists at once, one per
//! *lane*; lane `i` groups entries by the `i`-th of the keys given at insertion. This is what
//! lets the matcher index an unexpected message four ways and still remove it from all four
//! indexes in O(1), without tombstones: unlinking only touches the entry's neighbours.
//!
//! List heads live in one hash map per lane. A list that empties keeps its head for a while:
//! streams of messages empty and refill the same lists constantly, and re-inserting a head each
//! time costs more than the whole rest of matching. Empty heads are swept once they outnumber
//! the live entries (plus [`SPARE_HEADS`]), so memory stays proportional to live entries.
//!
//! Links are `u32` slot numbers ([`NIL`] for none) to keep nodes small: every message moves
//! through this structure, and smaller nodes are cheaper to move and to cache.

use std::hash::Hash;

use rustc_hash::FxHashMap;
use slab::Slab;

/// "No slot".
const NIL: u32 = u32::MAX;

/// How many empty list heads a lane may keep beyond the number of live entries.
pub(super) const SPARE_HEADS: usize = 64;

/// One entry's membership in one lane: which list it is in and its neighbours there.
#[derive(Clone, Copy, Debug)]
struct Link<K> {
    key: K,
    prev: u32,
    next: u32,
}

/// First and last slot of a list; both [`NIL`] when the list is empty.
#[derive(Clone, Copy, Debug)]
struct Ends {
    head: u32,
    tail: u32,
}

impl Ends {
    const EMPTY: Ends = Ends {
        head: NIL,
        tail: NIL,
    };

    fn is_empty(&self) -> bool {
        self.head == NIL
    }
}

#[derive(Debug)]
struct Node<K, T, const N: usize> {
    item: T,
    links: [Link<K>; N],
}

/// A set of entries of type `T`, each linked into one list per lane, lists keyed by `K`.
#[derive(Debug)]
pub(super) struct SlabLists<K, T, const N: usize> {
    nodes: Slab<Node<K, T, N>>,
    heads: [FxHashMap<K, Ends>; N],
}

fn opt(slot: u32) -> Option<usize> {
    (slot != NIL).then_some(slot as usize)
}

impl<K: Copy + Eq + Hash, T, const N: usize> SlabLists<K, T, N> {
    pub(super) fn new() -> Self {
        SlabLists {
            nodes: Slab::new(),
            heads: std::array::from_fn(|_| FxHashMap::default()),
        }
    }

    /// Number of live entries.
    pub(super) fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Slot of the first entry of the list `key` in `lane`, if that list is non-empty.
    pub(super) fn front(&self, lane: usize, key: &K) -> Option<usize> {
        self.heads[lane].get(key).and_then(|ends| opt(ends.head))
    }

    /// The entry in `slot`, if it is live.
    pub(super) fn get(&self, slot: usize) -> Option<&T> {
        self.nodes.get(slot).map(|node| &node.item)
    }

    /// All live entries, in slot order (not list order).
    pub(super) fn iter(&self) -> impl Iterator<Item = (usize, &T)> {
        self.nodes.iter().map(|(slot, node)| (slot, &node.item))
    }

    /// Appends `item` to the back of list `keys[i]` in every lane `i`; returns its slot.
    pub(super) fn push_back(&mut self, keys: [K; N], item: T) -> usize {
        let slot = self.alloc(keys, item);
        for lane in 0..N {
            self.link_after(lane, slot, None, true);
        }
        slot
    }

    /// Inserts `item` into list `keys[i]` of every lane `i` at the position that keeps each list
    /// ordered by `order`, after any entries with an equal order; returns its slot.
    ///
    /// Walks each list from its back: callers use it to put back entries that left recently,
    /// so few later entries have arrived since and the walk is short.
    pub(super) fn insert_ordered(
        &mut self,
        keys: [K; N],
        item: T,
        order: impl Fn(&T) -> u64,
    ) -> usize {
        let rank = order(&item);
        let slot = self.alloc(keys, item);
        for (lane, key) in keys.iter().enumerate() {
            let mut after = self.heads[lane].get(key).and_then(|ends| opt(ends.tail));
            while let Some(prev) = after {
                let node = &self.nodes[prev];
                if order(&node.item) <= rank {
                    break;
                }
                after = opt(node.links[lane].prev);
            }
            self.link_after(lane, slot, after, false);
        }
        slot
    }

    /// Unlinks the entry in `slot` from all its lists and returns it.
    ///
    /// # Panics
    /// If `slot` is not live.
    pub(super) fn remove(&mut self, slot: usize) -> T {
        for lane in 0..N {
            self.unlink(lane, slot);
        }
        let item = self.nodes.remove(slot).item;
        self.sweep_heads();
        item
    }

    fn alloc(&mut self, keys: [K; N], item: T) -> usize {
        let links = keys.map(|key| Link {
            key,
            prev: NIL,
            next: NIL,
        });
        let slot = self.nodes.insert(Node { item, links });
        debug_assert!(slot < NIL as usize, "more entries than u32 slots");
        slot
    }

    /// Links `slot` into its list of `lane`: at the back if `at_back`, otherwise right after
    /// `after` (`None`: at the front).
    fn link_after(&mut self, lane: usize, slot: usize, after: Option<usize>, at_back: bool) {
        let key = self.nodes[slot].links[lane].key;
        let s = slot as u32;
        // One hash lookup in the common case (the list, maybe empty, already has a head).
        let ends = match self.heads[lane].get_mut(&key) {
            Some(ends) => ends,
            None => self.heads[lane].entry(key).or_insert(Ends::EMPTY),
        };
        let after = if at_back { opt(ends.tail) } else { after };
        let next = match after {
            Some(prev) => self.nodes[prev].links[lane].next,
            None => ends.head,
        };
        if after.is_none() {
            ends.head = s;
        }
        if next == NIL {
            ends.tail = s;
        }
        let link = &mut self.nodes[slot].links[lane];
        link.prev = after.map_or(NIL, |p| p as u32);
        link.next = next;
        if let Some(prev) = after {
            self.nodes[prev].links[lane].next = s;
        }
        if let Some(next) = opt(next) {
            self.nodes[next].links[lane].prev = s;
        }
    }

    fn unlink(&mut self, lane: usize, slot: usize) {
        let Link { key, prev, next } = self.nodes[slot].links[lane];
        if let Some(prev) = opt(prev) {
            self.nodes[prev].links[lane].next = next;
        }
        if let Some(next) = opt(next) {
            self.nodes[next].links[lane].prev = prev;
        }
        if prev == NIL || next == NIL {
            if let Some(ends) = self.heads[lane].get_mut(&key) {
                if prev == NIL {
                    ends.head = next;
                }
                if next == NIL {
                    ends.tail = prev;
                }
            }
        }
    }

    /// Drops empty list heads once they outnumber the live entries by [`SPARE_HEADS`].
    fn sweep_heads(&mut self) {
        // Twice the live entries: after a sweep at least that many removals must pass before the
        // next, so sweeping costs O(1) per removal.
        let limit = 2 * self.nodes.len() + SPARE_HEADS;
        for heads in &mut self.heads {
            if heads.len() > limit {
                heads.retain(|_, ends| !ends.is_empty());
            }
        }
    }

    /// Number of non-empty lists, over all lanes.
    #[cfg(test)]
    pub(super) fn list_count(&self) -> usize {
        self.heads
            .iter()
            .map(|heads| heads.values().filter(|e| !e.is_empty()).count())
            .sum()
    }

    /// Number of list heads held, empty or not, in the fullest lane.
    #[cfg(test)]
    pub(super) fn max_heads(&self) -> usize {
        self.heads.iter().map(|h| h.len()).max().unwrap_or(0)
    }

    /// Checks every link and head against each other and returns each non-empty list's
    /// entries in order, as `(lane, key, slots)`.
    #[cfg(test)]
    pub(super) fn check(&self) -> Vec<(usize, K, Vec<usize>)> {
        let mut lists = Vec::new();
        for (lane, heads) in self.heads.iter().enumerate() {
            let mut seen = 0;
            for (key, ends) in heads {
                if ends.is_empty() {
                    assert_eq!(ends.tail, NIL, "empty list with a tail");
                    continue;
                }
                let mut slots = Vec::new();
                let mut prev = NIL;
                let mut at = ends.head;
                while let Some(slot) = opt(at) {
                    let link = &self.nodes[slot].links[lane];
                    assert!(link.key == *key, "entry linked into a foreign list");
                    assert_eq!(link.prev, prev, "broken back link");
                    slots.push(slot);
                    prev = slot as u32;
                    at = link.next;
                }
                assert_eq!(prev, ends.tail, "stale tail");
                seen += slots.len();
                lists.push((lane, *key, slots));
            }
            assert_eq!(seen, self.nodes.len(), "lane {lane} misses entries");
        }
        lists
    }
}
