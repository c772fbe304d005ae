//! A memory-registration cache for the payloads that rendezvous sends read from.
//!
//! Registering memory is slow (the kernel pins the pages and the HCA learns the translation), so
//! a payload that is sent again (a broadcast buffer, a halo exchanged every step) keeps its
//! registration. Entries are keyed by the payload's address and length. The classic danger of
//! such caches (MPI libraries hook `free` for it) is memory freed and reused while a stale
//! registration still points at it; here an entry holds a clone of the [`Bytes`] it registered,
//! so the memory cannot be freed while the entry exists. Entries in use by a transfer are
//! pinned; unpinned entries are evicted, least recently used first, once the cached bytes pass
//! the capacity.
//!
//! The cache does no IO: it asks its caller to register ([`MrCache::acquire`] takes a
//! closure) and tells it which regions to deregister ([`MrCache::evict`]).

use std::collections::BTreeMap;

use bytes::Bytes;
use rustc_hash::FxHashMap;

use super::error::VerbsError;
use super::provider::{MemoryRegion, MrId};

/// Counters of a [`MrCache`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MrCacheCounters {
    /// Lookups that found a registration.
    pub hits: u64,
    /// Lookups that registered.
    pub misses: u64,
    /// Registrations evicted.
    pub evictions: u64,
}

#[derive(Debug)]
struct Entry {
    region: MemoryRegion,
    /// Keeps the registered memory alive (and so its address unique) while cached.
    _memory: Bytes,
    pins: u32,
    last_use: u64,
}

/// The cache (see the [module docs](self)).
#[derive(Debug)]
pub struct MrCache {
    capacity: usize,
    entries: FxHashMap<(usize, usize), Entry>,
    by_id: FxHashMap<MrId, (usize, usize)>,
    /// Unpinned entries by last use.
    idle: BTreeMap<u64, (usize, usize)>,
    cached_bytes: usize,
    clock: u64,
    counters: MrCacheCounters,
}

impl MrCache {
    /// A cache that keeps unpinned registrations up to `capacity` bytes.
    pub fn new(capacity: usize) -> MrCache {
        MrCache {
            capacity,
            entries: FxHashMap::default(),
            by_id: FxHashMap::default(),
            idle: BTreeMap::new(),
            cached_bytes: 0,
            clock: 0,
            counters: MrCacheCounters::default(),
        }
    }

    /// The registration of `payload`, pinned until [`release`](Self::release): a cached one,
    /// or a new one made by `register`.
    pub fn acquire(
        &mut self,
        payload: &Bytes,
        register: impl FnOnce(Bytes) -> Result<MemoryRegion, VerbsError>,
    ) -> Result<MemoryRegion, VerbsError> {
        self.clock += 1;
        let key = (payload.as_ptr() as usize, payload.len());
        if let Some(e) = self.entries.get_mut(&key) {
            if e.pins == 0 {
                self.idle.remove(&e.last_use);
            }
            e.pins += 1;
            e.last_use = self.clock;
            self.counters.hits += 1;
            return Ok(e.region);
        }
        let region = register(payload.clone())?;
        self.counters.misses += 1;
        self.cached_bytes += payload.len();
        self.by_id.insert(region.id, key);
        self.entries.insert(
            key,
            Entry {
                region,
                _memory: payload.clone(),
                pins: 1,
                last_use: self.clock,
            },
        );
        Ok(region)
    }

    /// A transfer that used region `id` is done with it.
    pub fn release(&mut self, id: MrId) {
        let Some(key) = self.by_id.get(&id) else {
            return;
        };
        if let Some(e) = self.entries.get_mut(key) {
            e.pins = e.pins.saturating_sub(1);
            if e.pins == 0 {
                self.idle.insert(e.last_use, *key);
            }
        }
    }

    /// Removes unpinned entries, least recently used first, until the cache holds at most its
    /// capacity; returns the regions to deregister.
    pub fn evict(&mut self) -> Vec<MrId> {
        let mut out = Vec::new();
        while self.cached_bytes > self.capacity {
            let Some((_, key)) = self.idle.pop_first() else {
                break;
            };
            if let Some(e) = self.entries.remove(&key) {
                self.by_id.remove(&e.region.id);
                self.cached_bytes -= e.region.len;
                self.counters.evictions += 1;
                out.push(e.region.id);
            }
        }
        out
    }

    /// Bytes of memory registered through the cache now.
    pub fn cached_bytes(&self) -> usize {
        self.cached_bytes
    }

    /// Registrations in the cache now.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the cache holds no registration.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Its counters.
    pub fn counters(&self) -> MrCacheCounters {
        self.counters
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_register(next: &mut u64) -> impl FnOnce(Bytes) -> Result<MemoryRegion, VerbsError> {
        *next += 1;
        let id = *next;
        move |b: Bytes| {
            Ok(MemoryRegion {
                id: MrId(id),
                addr: b.as_ptr() as u64,
                len: b.len(),
                lkey: id as u32,
                rkey: id as u32,
                remote_write: false,
            })
        }
    }

    #[test]
    fn the_same_payload_hits_and_a_different_one_misses() {
        let mut next = 0;
        let mut cache = MrCache::new(1 << 20);
        let a = Bytes::from(vec![1u8; 100]);
        let b = Bytes::from(vec![2u8; 100]);
        let ra = cache.acquire(&a, fake_register(&mut next)).unwrap();
        cache.release(ra.id);
        let ra2 = cache.acquire(&a.clone(), fake_register(&mut next)).unwrap();
        assert_eq!(ra, ra2, "a clone of the same bytes reuses the registration");
        let rb = cache.acquire(&b, fake_register(&mut next)).unwrap();
        assert_ne!(ra.id, rb.id);
        // A slice of `a` is other memory (another length): a registration of its own.
        let rs = cache
            .acquire(&a.slice(..50), fake_register(&mut next))
            .unwrap();
        assert_ne!(rs.id, ra.id);
        assert_eq!(
            cache.counters(),
            MrCacheCounters {
                hits: 1,
                misses: 3,
                evictions: 0
            }
        );
    }

    #[test]
    fn eviction_takes_the_least_recently_used_unpinned_entries_only() {
        let mut next = 0;
        let mut cache = MrCache::new(250);
        let bufs: Vec<Bytes> = (0..4).map(|i| Bytes::from(vec![i as u8; 100])).collect();
        let regs: Vec<MemoryRegion> = bufs
            .iter()
            .map(|b| cache.acquire(b, fake_register(&mut next)).unwrap())
            .collect();
        assert_eq!(cache.cached_bytes(), 400);
        assert!(cache.evict().is_empty(), "everything is pinned");
        // Recency is the order of use (acquisition), not of release: 0 is the oldest.
        cache.release(regs[2].id);
        cache.release(regs[0].id);
        cache.release(regs[1].id);
        let evicted = cache.evict();
        assert_eq!(evicted, vec![regs[0].id, regs[1].id]);
        assert_eq!(cache.cached_bytes(), 200);
        assert_eq!(cache.len(), 2);
        // Entry 3 is still pinned; 2 is idle and within capacity, and still hits.
        let again = cache.acquire(&bufs[2], fake_register(&mut next)).unwrap();
        assert_eq!(again.id, regs[2].id);
        assert_eq!(cache.counters().evictions, 2);
    }

    #[test]
    fn a_failed_registration_is_not_cached() {
        let mut cache = MrCache::new(1000);
        let a = Bytes::from(vec![0u8; 10]);
        let err = cache
            .acquire(&a, |_| Err(VerbsError::PortDown))
            .unwrap_err();
        assert_eq!(err, VerbsError::PortDown);
        assert!(cache.is_empty());
        assert_eq!(cache.cached_bytes(), 0);
    }
}
