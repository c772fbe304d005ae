//! Intrusive doubly-linked lists threaded through one [`Slab`].
//!
//! Every entry lives in exactly one slab slot and is linked into `N` lists at once, one per
//! *lane*; lane `i` groups entries by the `i`-th of the keys given at insertion. This is what
//! lets the matcher index an unexpected message four ways and still remove it from all four
//! indexes in O(1), without tombstones: unlinking only touches the entry's neighbours.
//!
//! List heads live in one hash map per lane and are removed as soon as their list empties, so
//! memory stays proportional to the live entries.

use std::hash::Hash;

use rustc_hash::FxHashMap;
use slab::Slab;

/// One entry's membership in one lane: which list it is in and its neighbours there.
#[derive(Clone, Copy, Debug)]
struct Link<K> {
    key: K,
    prev: Option<usize>,
    next: Option<usize>,
}

/// First and last slot of a non-empty list (empty lists have no head at all).
#[derive(Clone, Copy, Debug)]
struct Ends {
    head: usize,
    tail: usize,
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
        self.heads[lane].get(key).map(|ends| ends.head)
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
        for (lane, key) in keys.iter().enumerate() {
            let tail = self.heads[lane].get(key).map(|ends| ends.tail);
            self.link_after(lane, slot, tail);
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
            let mut after = self.heads[lane].get(key).map(|ends| ends.tail);
            while let Some(prev) = after {
                let node = &self.nodes[prev];
                if order(&node.item) <= rank {
                    break;
                }
                after = node.links[lane].prev;
            }
            self.link_after(lane, slot, after);
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
        self.nodes.remove(slot).item
    }

    fn alloc(&mut self, keys: [K; N], item: T) -> usize {
        let links = keys.map(|key| Link {
            key,
            prev: None,
            next: None,
        });
        self.nodes.insert(Node { item, links })
    }

    /// Links `slot` into its list of `lane` right after `after` (`None`: at the front).
    fn link_after(&mut self, lane: usize, slot: usize, after: Option<usize>) {
        let key = self.nodes[slot].links[lane].key;
        let next = match after {
            Some(prev) => self.nodes[prev].links[lane].next,
            None => self.heads[lane].get(&key).map(|ends| ends.head),
        };
        let link = &mut self.nodes[slot].links[lane];
        link.prev = after;
        link.next = next;
        if let Some(prev) = after {
            self.nodes[prev].links[lane].next = Some(slot);
        }
        if let Some(next) = next {
            self.nodes[next].links[lane].prev = Some(slot);
        }
        let ends = self.heads[lane].entry(key).or_insert(Ends {
            head: slot,
            tail: slot,
        });
        if after.is_none() {
            ends.head = slot;
        }
        if next.is_none() {
            ends.tail = slot;
        }
    }

    fn unlink(&mut self, lane: usize, slot: usize) {
        let Link { key, prev, next } = self.nodes[slot].links[lane];
        if let Some(prev) = prev {
            self.nodes[prev].links[lane].next = next;
        }
        if let Some(next) = next {
            self.nodes[next].links[lane].prev = prev;
        }
        let heads = &mut self.heads[lane];
        match (prev, next) {
            // Last entry of its list: drop the head so empty lists cost nothing.
            (None, None) => {
                heads.remove(&key);
            }
            (None, Some(next)) => heads.get_mut(&key).expect("linked list has a head").head = next,
            (Some(prev), None) => heads.get_mut(&key).expect("linked list has a head").tail = prev,
            (Some(_), Some(_)) => {}
        }
    }

    /// Number of non-empty lists, over all lanes.
    #[cfg(test)]
    pub(super) fn list_count(&self) -> usize {
        self.heads.iter().map(|heads| heads.len()).sum()
    }

    /// Checks every link and head against each other and returns each list's entries in order,
    /// as `(lane, key, slots)`.
    #[cfg(test)]
    pub(super) fn check(&self) -> Vec<(usize, K, Vec<usize>)> {
        let mut lists = Vec::new();
        for (lane, heads) in self.heads.iter().enumerate() {
            let mut seen = 0;
            for (key, ends) in heads {
                let mut slots = Vec::new();
                let mut prev = None;
                let mut at = Some(ends.head);
                while let Some(slot) = at {
                    let link = &self.nodes[slot].links[lane];
                    assert!(link.key == *key, "entry linked into a foreign list");
                    assert_eq!(link.prev, prev, "broken back link");
                    slots.push(slot);
                    prev = Some(slot);
                    at = link.next;
                }
                assert_eq!(prev, Some(ends.tail), "stale tail");
                seen += slots.len();
                lists.push((lane, *key, slots));
            }
            assert_eq!(seen, self.nodes.len(), "lane {lane} misses entries");
        }
        lists
    }
}
