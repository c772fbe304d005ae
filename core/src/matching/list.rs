//! Intrusive doubly-linked lists threaded through one [`Slab`].
//!
//! Every entry lives in exactly one slab slot and is linked into `N` lists at once, one per
//! *lane*; lane `i` groups entries by the `i`-th of the keys given at insertion. This is what
//! lets the matcher index an unexpected message four ways and still remove it from all four
//! indexes in O(1), without tombstones: unlinking only touches the entry's neighbours.
//!
//! This is the path of every message, so it avoids hashing where it can:
//!
//! * each list has a small header (key, head, tail) in a per-lane slab, and an entry's link
//!   names its list's header directly, so unlinking needs no lookup at all;
//! * the key-to-header map is consulted only when a list is first touched: the last list used
//!   in each lane is remembered, and streams of messages with one envelope hit it every time;
//! * a list that empties keeps its header (streams empty and refill the same lists
//!   constantly); empty headers are swept once they outnumber the live entries by more than
//!   [`SPARE_HEADS`], so memory stays proportional to what is queued.
//!
//! Links are `u32` numbers ([`NIL`] for none) to keep nodes small.

use std::hash::Hash;

use rustc_hash::FxHashMap;
use slab::Slab;

/// "No slot".
const NIL: u32 = u32::MAX;

/// How many empty list headers a lane may keep beyond twice the number of live entries.
pub(super) const SPARE_HEADS: usize = 64;

/// One entry's membership in one lane: its list's header and its neighbours there.
#[derive(Clone, Copy, Debug)]
struct Link {
    list: u32,
    prev: u32,
    next: u32,
}

/// A list's first and last entries ([`NIL`] when empty).
#[derive(Clone, Copy, Debug)]
struct Header {
    head: u32,
    tail: u32,
}

#[derive(Debug)]
struct Node<T, const N: usize> {
    item: T,
    links: [Link; N],
}

/// The lists of one lane: headers, the key index, and the last list used.
#[derive(Debug)]
struct Lane<K> {
    headers: Slab<Header>,
    index: FxHashMap<K, u32>,
    recent: Option<(K, u32)>,
}

impl<K: Copy + Eq + Hash> Lane<K> {
    fn new() -> Self {
        Lane {
            headers: Slab::new(),
            index: FxHashMap::default(),
            recent: None,
        }
    }

    /// The header of list `key`, if it exists.
    fn find(&self, key: &K) -> Option<u32> {
        match self.recent {
            Some((k, id)) if k == *key => Some(id),
            _ => self.index.get(key).copied(),
        }
    }

    /// The header of list `key`, created (empty) if needed, and remembered as the recent one.
    fn find_or_create(&mut self, key: K) -> u32 {
        if let Some(id) = self.find(&key) {
            self.recent = Some((key, id));
            return id;
        }
        let id = self.headers.insert(Header {
            head: NIL,
            tail: NIL,
        }) as u32;
        self.index.insert(key, id);
        self.recent = Some((key, id));
        id
    }

    /// Drops the headers of empty lists.
    fn sweep(&mut self) {
        let headers = &mut self.headers;
        self.index.retain(|_, id| {
            let empty = headers[*id as usize].head == NIL;
            if empty {
                headers.remove(*id as usize);
            }
            !empty
        });
        self.recent = None;
    }
}

/// A set of entries of type `T`, each linked into one list per lane, lists keyed by `K`.
#[derive(Debug)]
pub(super) struct SlabLists<K, T, const N: usize> {
    nodes: Slab<Node<T, N>>,
    lanes: [Lane<K>; N],
}

fn opt(slot: u32) -> Option<usize> {
    (slot != NIL).then_some(slot as usize)
}

impl<K: Copy + Eq + Hash, T, const N: usize> SlabLists<K, T, N> {
    pub(super) fn new() -> Self {
        SlabLists {
            nodes: Slab::new(),
            lanes: std::array::from_fn(|_| Lane::new()),
        }
    }

    /// Number of live entries.
    pub(super) fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Slot of the first entry of the list `key` in `lane`, if that list is non-empty.
    pub(super) fn front(&self, lane: usize, key: &K) -> Option<usize> {
        let lane = &self.lanes[lane];
        let id = lane.find(key)?;
        opt(lane.headers[id as usize].head)
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
            let list = self.nodes[slot].links[lane].list;
            let tail = self.lanes[lane].headers[list as usize].tail;
            self.link_after(lane, slot, opt(tail));
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
        for lane in 0..N {
            let list = self.nodes[slot].links[lane].list;
            let mut after = opt(self.lanes[lane].headers[list as usize].tail);
            while let Some(prev) = after {
                let node = &self.nodes[prev];
                if order(&node.item) <= rank {
                    break;
                }
                after = opt(node.links[lane].prev);
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
        let item = self.nodes.remove(slot).item;
        // Twice the live entries: after a sweep at least that many removals must pass before
        // the next, so sweeping costs O(1) per removal.
        let limit = 2 * self.nodes.len() + SPARE_HEADS;
        for lane in &mut self.lanes {
            if lane.headers.len() > limit {
                lane.sweep();
            }
        }
        item
    }

    fn alloc(&mut self, keys: [K; N], item: T) -> usize {
        let mut links = [Link {
            list: NIL,
            prev: NIL,
            next: NIL,
        }; N];
        for (lane, key) in keys.into_iter().enumerate() {
            links[lane].list = self.lanes[lane].find_or_create(key);
        }
        let slot = self.nodes.insert(Node { item, links });
        debug_assert!(slot < NIL as usize, "more entries than u32 slots");
        slot
    }

    /// Links `slot` into its list of `lane` right after `after` (`None`: at the front).
    fn link_after(&mut self, lane: usize, slot: usize, after: Option<usize>) {
        let s = slot as u32;
        let list = self.nodes[slot].links[lane].list as usize;
        let header = &mut self.lanes[lane].headers[list];
        let next = match after {
            Some(prev) => self.nodes[prev].links[lane].next,
            None => header.head,
        };
        if after.is_none() {
            header.head = s;
        }
        if next == NIL {
            header.tail = s;
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
        let Link { list, prev, next } = self.nodes[slot].links[lane];
        if let Some(prev) = opt(prev) {
            self.nodes[prev].links[lane].next = next;
        }
        if let Some(next) = opt(next) {
            self.nodes[next].links[lane].prev = prev;
        }
        let header = &mut self.lanes[lane].headers[list as usize];
        if prev == NIL {
            header.head = next;
        }
        if next == NIL {
            header.tail = prev;
        }
    }

    /// Number of non-empty lists, over all lanes.
    #[cfg(test)]
    pub(super) fn list_count(&self) -> usize {
        self.lanes
            .iter()
            .map(|lane| lane.headers.iter().filter(|(_, h)| h.head != NIL).count())
            .sum()
    }

    /// Number of list headers held, empty or not, in the fullest lane.
    #[cfg(test)]
    pub(super) fn max_heads(&self) -> usize {
        self.lanes
            .iter()
            .map(|lane| lane.headers.len())
            .max()
            .unwrap_or(0)
    }

    /// Checks every link, header and index entry against each other and returns each
    /// non-empty list's entries in order, as `(lane, key, slots)`.
    #[cfg(test)]
    pub(super) fn check(&self) -> Vec<(usize, K, Vec<usize>)> {
        let mut lists = Vec::new();
        for (l, lane) in self.lanes.iter().enumerate() {
            assert_eq!(
                lane.index.len(),
                lane.headers.len(),
                "index and headers differ"
            );
            let mut seen = 0;
            for (key, &id) in &lane.index {
                let header = &lane.headers[id as usize];
                if header.head == NIL {
                    assert_eq!(header.tail, NIL, "empty list with a tail");
                    continue;
                }
                let mut slots = Vec::new();
                let mut prev = NIL;
                let mut at = header.head;
                while let Some(slot) = opt(at) {
                    let link = &self.nodes[slot].links[l];
                    assert_eq!(link.list, id, "entry linked into a foreign list");
                    assert_eq!(link.prev, prev, "broken back link");
                    slots.push(slot);
                    prev = slot as u32;
                    at = link.next;
                }
                assert_eq!(prev, header.tail, "stale tail");
                seen += slots.len();
                lists.push((l, *key, slots));
            }
            assert_eq!(seen, self.nodes.len(), "lane {l} misses entries");
        }
        lists
    }
}
