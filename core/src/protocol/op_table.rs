//! A slab whose keys carry a generation, so a stale id (from a late or forged frame) never
//! reaches an operation that reused the slot.

use slab::Slab;

/// A table of operations addressed by 64-bit ids: slot in the low 32 bits, generation above.
#[derive(Debug)]
pub struct OpTable<T> {
    slots: Slab<(u32, T)>,
    generation: u32,
}

impl<T> Default for OpTable<T> {
    fn default() -> Self {
        OpTable {
            slots: Slab::new(),
            generation: 0,
        }
    }
}

impl<T> OpTable<T> {
    /// Stores `value` and returns its id.
    pub fn insert(&mut self, value: T) -> u64 {
        self.generation = self.generation.wrapping_add(1);
        let slot = self.slots.insert((self.generation, value));
        ((self.generation as u64) << 32) | slot as u64
    }

    fn split(id: u64) -> (usize, u32) {
        ((id & 0xFFFF_FFFF) as usize, (id >> 32) as u32)
    }

    /// The operation with this id, if it is still there.
    pub fn get(&self, id: u64) -> Option<&T> {
        let (slot, generation) = Self::split(id);
        match self.slots.get(slot) {
            Some((g, v)) if *g == generation => Some(v),
            _ => None,
        }
    }

    /// The operation with this id, mutably.
    pub fn get_mut(&mut self, id: u64) -> Option<&mut T> {
        let (slot, generation) = Self::split(id);
        match self.slots.get_mut(slot) {
            Some((g, v)) if *g == generation => Some(v),
            _ => None,
        }
    }

    /// Removes and returns the operation with this id.
    pub fn remove(&mut self, id: u64) -> Option<T> {
        self.get(id)?;
        Some(self.slots.remove(Self::split(id).0).1)
    }

    /// Number of operations held.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Ids and values of every operation.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (u64, &mut T)> {
        self.slots
            .iter_mut()
            .map(|(slot, (g, v))| (((*g as u64) << 32) | slot as u64, v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_ids_miss() {
        let mut t = OpTable::default();
        let a = t.insert("a");
        assert_eq!(t.remove(a), Some("a"));
        let b = t.insert("b");
        assert_ne!(a, b);
        assert_eq!(t.get(a), None);
        assert_eq!(t.remove(a), None);
        assert_eq!(t.get(b), Some(&"b"));
    }
}
