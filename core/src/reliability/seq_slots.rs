//! [`SeqSlots`]: values keyed by sequence number, for keys that come close together.
//!
//! A link's unacknowledged packets are numbered consecutively and leave mostly from the front,
//! so a ring indexed by `seq − base` holds them with no allocation per packet (a `BTreeMap`
//! allocated and freed a node for every packet of a ping-pong) and finds one with an
//! index instead of a search. Memory follows the span from the lowest to the highest key, not
//! the number of keys: fine for a window of sequence numbers, wrong for scattered keys.

use std::collections::VecDeque;

/// Values keyed by `u64` sequence numbers, stored in a ring covering the lowest to the highest
/// key present.
#[derive(Clone, Debug)]
pub struct SeqSlots<T> {
    /// The key of `slots[0]`.
    base: u64,
    /// Occupied or vacant slots; the first and the last are occupied (or there are none).
    slots: VecDeque<Option<T>>,
    len: usize,
}

impl<T> Default for SeqSlots<T> {
    fn default() -> Self {
        SeqSlots {
            base: 0,
            slots: VecDeque::new(),
            len: 0,
        }
    }
}

impl<T> SeqSlots<T> {
    /// How many keys are present.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no key is present.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn index(&self, seq: u64) -> Option<usize> {
        let i = usize::try_from(seq.checked_sub(self.base)?).ok()?;
        (i < self.slots.len()).then_some(i)
    }

    /// The value of `seq`.
    pub fn get(&self, seq: u64) -> Option<&T> {
        self.slots.get(self.index(seq)?)?.as_ref()
    }

    /// The value of `seq`, mutably.
    pub fn get_mut(&mut self, seq: u64) -> Option<&mut T> {
        let i = self.index(seq)?;
        self.slots.get_mut(i)?.as_mut()
    }

    /// Whether `seq` is present.
    pub fn contains(&self, seq: u64) -> bool {
        self.get(seq).is_some()
    }

    /// Puts `value` under `seq`, returning the value it replaces.
    pub fn insert(&mut self, seq: u64, value: T) -> Option<T> {
        if self.slots.is_empty() {
            self.base = seq;
        }
        if seq < self.base {
            for _ in seq..self.base {
                self.slots.push_front(None);
            }
            self.base = seq;
        }
        let i = usize::try_from(seq - self.base).expect("sequence numbers too far apart");
        if i >= self.slots.len() {
            self.slots.resize_with(i + 1, || None);
        }
        let old = self.slots[i].replace(value);
        if old.is_none() {
            self.len += 1;
        }
        old
    }

    /// Takes the value of `seq` out.
    pub fn remove(&mut self, seq: u64) -> Option<T> {
        let i = self.index(seq)?;
        let value = self.slots[i].take()?;
        self.len -= 1;
        // Keep both ends occupied, so `first` and `last` are one look.
        while let Some(None) = self.slots.front() {
            self.slots.pop_front();
            self.base += 1;
        }
        while let Some(None) = self.slots.back() {
            self.slots.pop_back();
        }
        Some(value)
    }

    /// The lowest key and its value.
    pub fn first(&self) -> Option<(u64, &T)> {
        Some((self.base, self.slots.front()?.as_ref()?))
    }

    /// The lowest key and its value, mutably.
    pub fn first_mut(&mut self) -> Option<(u64, &mut T)> {
        Some((self.base, self.slots.front_mut()?.as_mut()?))
    }

    /// The highest key and its value.
    pub fn last(&self) -> Option<(u64, &T)> {
        let last = self.base + self.slots.len().checked_sub(1)? as u64;
        Some((last, self.slots.back()?.as_ref()?))
    }

    /// Keys and values, lowest key first.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &T)> + '_ {
        let base = self.base;
        self.slots
            .iter()
            .enumerate()
            .filter_map(move |(i, v)| Some((base + i as u64, v.as_ref()?)))
    }

    /// Values, lowest key first, mutably.
    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut T> + '_ {
        self.slots.iter_mut().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn behaves_like_an_ordered_map() {
        // A seeded walk of inserts and removes near a moving front, checked against a BTreeMap.
        let mut rng = crate::rng::SplitMix64(7);
        let mut slots = SeqSlots::default();
        let mut model = BTreeMap::new();
        let mut next = 100u64;
        for step in 0..20_000u64 {
            match rng.next_u64() % 4 {
                0 | 1 => {
                    assert_eq!(slots.insert(next, step), model.insert(next, step));
                    next += 1 + rng.next_u64() % 2;
                }
                2 => {
                    let lowest = model.keys().next().copied().unwrap_or(next);
                    let seq = lowest + rng.next_u64() % 4;
                    assert_eq!(slots.remove(seq), model.remove(&seq));
                }
                _ => {
                    let seq = next.saturating_sub(rng.next_u64() % 8);
                    assert_eq!(slots.get(seq), model.get(&seq));
                    if let Some(v) = slots.get_mut(seq) {
                        *v += 1;
                        *model.get_mut(&seq).unwrap() += 1;
                    }
                }
            }
            assert_eq!(slots.len(), model.len());
            assert_eq!(slots.first(), model.first_key_value().map(|(k, v)| (*k, v)));
            assert_eq!(slots.last(), model.last_key_value().map(|(k, v)| (*k, v)));
        }
        let all: Vec<_> = slots.iter().map(|(k, v)| (k, *v)).collect();
        let expected: Vec<_> = model.iter().map(|(k, v)| (*k, *v)).collect();
        assert_eq!(all, expected);
    }

    #[test]
    fn a_key_below_the_lowest_one_extends_the_front() {
        let mut slots = SeqSlots::default();
        slots.insert(10, 'a');
        slots.insert(7, 'b');
        assert_eq!(slots.first(), Some((7, &'b')));
        assert_eq!(slots.last(), Some((10, &'a')));
        assert_eq!(slots.get(8), None);
        assert_eq!(slots.remove(7), Some('b'));
        assert_eq!(slots.first(), Some((10, &'a')));
        assert_eq!(slots.remove(10), Some('a'));
        assert!(slots.is_empty());
        assert_eq!(slots.first(), None);
        // Empty again: the next key starts a new span, wherever it is.
        slots.insert(1_000_000, 'c');
        assert_eq!(slots.first(), Some((1_000_000, &'c')));
        assert_eq!(slots.get(0), None);
    }
}
