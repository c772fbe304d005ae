//! The bytes of the multicast broadcasts: one format for multicast datagrams and for the
//! point-to-point messages of the repair paths.
//!
//! Every packet starts with a 64-byte header (little-endian):
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `RWMC` |
//! | 4 | version (1) |
//! | 5 | kind: 0 fragment, 1 ready, 2 NACK, 3 sync-up, 4 sync-down, 5 tree fragment |
//! | 6 | algorithm: 0 two-stage, 1 channels |
//! | 7 | reserved (0) |
//! | 8..16 | job key |
//! | 16..24 | communicator context id |
//! | 24..32 | broadcast id (epoch for sync messages) |
//! | 32..36 | root |
//! | 36..40 | fragment sequence number |
//! | 40..44 | fragment count |
//! | 44..48 | fragment size (every fragment but the last) |
//! | 48..56 | total length of the broadcast |
//! | 56..60 | CRC32C of the header (with this field zero) and the body |
//! | 60..64 | body length |
//!
//! A fragment's body is its slice of the data; the control messages' bodies are lists of
//! `u32`/`u64` values (below). Anything short, with another magic or version, another job or
//! communicator, a bad CRC or inconsistent numbers is refused with a [`Reject`] reason, counted
//! by the caller and otherwise ignored: never trusted, never a panic.

use bytes::{BufMut, Bytes, BytesMut};

/// Header length in bytes.
pub(crate) const HEADER_LEN: usize = 64;
const MAGIC: [u8; 4] = *b"RWMC";
const VERSION: u8 = 1;
/// The longest broadcast a header may announce (1 TiB).
const MAX_TOTAL: u64 = 1 << 40;

/// Which job and communicator packets belong to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Keys {
    pub job_key: u64,
    pub context: u64,
}

/// Which algorithm a packet belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Algorithm {
    TwoStage = 0,
    Channels = 1,
}

/// One fragment of a broadcast: which broadcast, where it sits, and its bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Fragment {
    pub bid: u64,
    pub root: u32,
    pub seq: u32,
    pub count: u32,
    pub size: u32,
    pub total: u64,
    pub data: Bytes,
}

/// Ranks missing broadcasts: `(broadcast id, ranks)` pairs.
pub(crate) type MissingList = Vec<(u64, Vec<u32>)>;

/// Everything the broadcasts send.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Packet {
    /// A fragment: multicast, along the two-stage ring, or answering a NACK.
    Fragment(Fragment),
    /// A fragment sent down the point-to-point tree of the channel broadcast (repairs after a
    /// synchronisation, and every broadcast after a fail-over).
    Tree(Fragment),
    /// The randomized single-rank synchronisation: the chosen rank has started `bid`.
    Ready { bid: u64 },
    /// The sender lacks these fragments of `bid` (a prefix of the list if it is long).
    Nack { bid: u64, missing: Vec<u32> },
    /// Channel synchronisation, up the tree: which ranks of the sender's subtree miss which
    /// broadcasts of `epoch`, and for how many (broadcast, rank) pairs multicast failed at
    /// first (NACKed or missing).
    SyncUp {
        epoch: u64,
        trouble: u64,
        missing: MissingList,
    },
    /// Channel synchronisation, down the tree: the combined result, and whether the
    /// communicator fails over to point-to-point from the next epoch on.
    SyncDown {
        epoch: u64,
        failover: bool,
        missing: MissingList,
    },
}

/// Why a packet was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reject {
    /// Too short, another magic or version: not a rankweave broadcast packet.
    Unknown,
    /// Another job, communicator or algorithm (a group shared by accident).
    Foreign,
    /// The CRC does not match: corrupted on the way.
    Corrupt,
    /// Inconsistent numbers.
    Malformed,
}

impl Fragment {
    /// The fragments of `data` (at least one, empty for empty data) of `size` bytes each.
    pub fn split(bid: u64, root: u32, data: &Bytes, size: usize) -> Vec<Fragment> {
        let count = data.len().div_ceil(size).max(1);
        (0..count)
            .map(|i| Fragment {
                bid,
                root,
                seq: i as u32,
                count: count as u32,
                size: size as u32,
                total: data.len() as u64,
                data: data.slice(i * size..((i + 1) * size).min(data.len())),
            })
            .collect()
    }

    /// Whether the numbers agree with each other: the count fits the total and size, the
    /// sequence number is below the count, the data has the length its place implies.
    fn consistent(&self) -> bool {
        let size = u64::from(self.size);
        if self.total > MAX_TOTAL || self.count == 0 || (self.total > 0 && size == 0) {
            return false;
        }
        let count = if self.total == 0 {
            1
        } else {
            self.total.div_ceil(size)
        };
        let start = u64::from(self.seq) * size;
        let expected = self.total.saturating_sub(start).min(size);
        count == u64::from(self.count)
            && self.seq < self.count
            && self.data.len() as u64 == expected
    }
}

impl Packet {
    fn kind(&self) -> u8 {
        match self {
            Packet::Fragment(_) => 0,
            Packet::Tree(_) => 5,
            Packet::Ready { .. } => 1,
            Packet::Nack { .. } => 2,
            Packet::SyncUp { .. } => 3,
            Packet::SyncDown { .. } => 4,
        }
    }

    /// The packet's bytes.
    pub fn encode(&self, keys: Keys, algorithm: Algorithm) -> Bytes {
        let (bid, root, seq, count, size, total) = match self {
            Packet::Fragment(f) | Packet::Tree(f) => {
                (f.bid, f.root, f.seq, f.count, f.size, f.total)
            }
            Packet::Ready { bid } | Packet::Nack { bid, .. } => (*bid, 0, 0, 0, 0, 0),
            Packet::SyncUp { epoch, .. } | Packet::SyncDown { epoch, .. } => {
                (*epoch, 0, 0, 0, 0, 0)
            }
        };
        let mut body = BytesMut::new();
        match self {
            Packet::Fragment(_) | Packet::Tree(_) | Packet::Ready { .. } => {}
            Packet::Nack { missing, .. } => {
                body.put_u32_le(missing.len() as u32);
                missing.iter().for_each(|s| body.put_u32_le(*s));
            }
            Packet::SyncUp {
                trouble, missing, ..
            } => {
                body.put_u64_le(*trouble);
                put_missing(&mut body, missing);
            }
            Packet::SyncDown {
                failover, missing, ..
            } => {
                body.put_u32_le(u32::from(*failover));
                put_missing(&mut body, missing);
            }
        }
        let body: &[u8] = match self {
            Packet::Fragment(f) | Packet::Tree(f) => &f.data,
            _ => &body,
        };
        let mut out = BytesMut::with_capacity(HEADER_LEN + body.len());
        out.put_slice(&MAGIC);
        out.put_u8(VERSION);
        out.put_u8(self.kind());
        out.put_u8(algorithm as u8);
        out.put_u8(0);
        out.put_u64_le(keys.job_key);
        out.put_u64_le(keys.context);
        out.put_u64_le(bid);
        out.put_u32_le(root);
        out.put_u32_le(seq);
        out.put_u32_le(count);
        out.put_u32_le(size);
        out.put_u64_le(total);
        out.put_u32_le(0);
        out.put_u32_le(body.len() as u32);
        out.put_slice(body);
        let crc = crc32c::crc32c(&out);
        out[56..60].copy_from_slice(&crc.to_le_bytes());
        out.freeze()
    }

    /// Decodes `bytes`, which must belong to `keys` and `algorithm` (see the module docs).
    pub fn decode(bytes: &Bytes, keys: Keys, algorithm: Algorithm) -> Result<Packet, Reject> {
        if bytes.len() < HEADER_LEN || bytes[..4] != MAGIC || bytes[4] != VERSION {
            return Err(Reject::Unknown);
        }
        let u32_at =
            |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap_or_default());
        let u64_at =
            |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap_or_default());
        if u64_at(8) != keys.job_key || u64_at(16) != keys.context || bytes[6] != algorithm as u8 {
            return Err(Reject::Foreign);
        }
        let body_len = u32_at(60) as usize;
        if body_len != bytes.len() - HEADER_LEN || bytes[7] != 0 {
            return Err(Reject::Malformed);
        }
        let crc = u32_at(56);
        let computed = {
            let head = crc32c::crc32c(&bytes[..56]);
            let head = crc32c::crc32c_append(head, &[0; 4]);
            crc32c::crc32c_append(head, &bytes[60..])
        };
        if crc != computed {
            return Err(Reject::Corrupt);
        }
        let id = u64_at(24);
        let body = bytes.slice(HEADER_LEN..);
        let packet = match bytes[5] {
            0 | 5 => {
                let f = Fragment {
                    bid: id,
                    root: u32_at(32),
                    seq: u32_at(36),
                    count: u32_at(40),
                    size: u32_at(44),
                    total: u64_at(48),
                    data: body,
                };
                if !f.consistent() {
                    return Err(Reject::Malformed);
                }
                if bytes[5] == 0 {
                    Packet::Fragment(f)
                } else {
                    Packet::Tree(f)
                }
            }
            1 if body.is_empty() => Packet::Ready { bid: id },
            2 => {
                let mut r = Reader(&body);
                let n = r.u32()? as usize;
                let missing = (0..n).map(|_| r.u32()).collect::<Result<_, _>>()?;
                r.end()?;
                Packet::Nack { bid: id, missing }
            }
            3 => {
                let mut r = Reader(&body);
                let trouble = r.u64()?;
                let missing = r.missing()?;
                r.end()?;
                Packet::SyncUp {
                    epoch: id,
                    trouble,
                    missing,
                }
            }
            4 => {
                let mut r = Reader(&body);
                let failover = match r.u32()? {
                    0 => false,
                    1 => true,
                    _ => return Err(Reject::Malformed),
                };
                let missing = r.missing()?;
                r.end()?;
                Packet::SyncDown {
                    epoch: id,
                    failover,
                    missing,
                }
            }
            _ => return Err(Reject::Malformed),
        };
        Ok(packet)
    }
}

fn put_missing(out: &mut BytesMut, missing: &MissingList) {
    out.put_u32_le(missing.len() as u32);
    for (bid, ranks) in missing {
        out.put_u64_le(*bid);
        out.put_u32_le(ranks.len() as u32);
        ranks.iter().for_each(|r| out.put_u32_le(*r));
    }
}

/// Reads little-endian numbers off a body; running out is [`Reject::Malformed`].
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], Reject> {
        let (head, rest) = self.0.split_at_checked(N).ok_or(Reject::Malformed)?;
        self.0 = rest;
        head.try_into().map_err(|_| Reject::Malformed)
    }
    fn u32(&mut self) -> Result<u32, Reject> {
        self.take::<4>().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Result<u64, Reject> {
        self.take::<8>().map(u64::from_le_bytes)
    }
    fn missing(&mut self) -> Result<MissingList, Reject> {
        let n = self.u32()? as usize;
        // Each entry takes at least 12 bytes: a count beyond that is a lie, not an allocation.
        if n > self.0.len() / 12 {
            return Err(Reject::Malformed);
        }
        (0..n)
            .map(|_| {
                let bid = self.u64()?;
                let k = self.u32()? as usize;
                if k > self.0.len() / 4 {
                    return Err(Reject::Malformed);
                }
                let ranks = (0..k).map(|_| self.u32()).collect::<Result<_, _>>()?;
                Ok((bid, ranks))
            })
            .collect()
    }
    fn end(&self) -> Result<(), Reject> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(Reject::Malformed)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEYS: Keys = Keys {
        job_key: 0xfeed,
        context: 4,
    };

    fn round_trip(p: Packet) {
        let bytes = p.encode(KEYS, Algorithm::Channels);
        assert_eq!(Packet::decode(&bytes, KEYS, Algorithm::Channels), Ok(p));
    }

    #[test]
    fn every_packet_round_trips() {
        let data = Bytes::from((0..100u8).collect::<Vec<_>>());
        let frags = Fragment::split(9, 3, &data, 32);
        assert_eq!(frags.len(), 4);
        assert_eq!(frags[3].data.len(), 4);
        for f in frags {
            round_trip(Packet::Tree(f.clone()));
            round_trip(Packet::Fragment(f));
        }
        round_trip(Packet::Fragment(
            Fragment::split(1, 0, &Bytes::new(), 32).remove(0),
        ));
        round_trip(Packet::Ready { bid: 7 });
        round_trip(Packet::Nack {
            bid: 7,
            missing: vec![1, 5],
        });
        round_trip(Packet::SyncUp {
            epoch: 2,
            trouble: 3,
            missing: vec![(32, vec![1, 2]), (33, vec![])],
        });
        round_trip(Packet::SyncDown {
            epoch: 2,
            failover: true,
            missing: vec![(40, vec![7])],
        });
    }

    #[test]
    fn garbage_is_refused_with_a_reason() {
        let data = Bytes::from(vec![5u8; 300]);
        let good = Packet::Fragment(Fragment::split(1, 0, &data, 128).remove(1))
            .encode(KEYS, Algorithm::TwoStage);
        let decode =
            |b: &[u8]| Packet::decode(&Bytes::copy_from_slice(b), KEYS, Algorithm::TwoStage);
        for cut in 0..good.len() {
            assert!(decode(&good[..cut]).is_err(), "cut at {cut}");
        }
        let other_job = Keys { job_key: 1, ..KEYS };
        assert_eq!(
            Packet::decode(&good, other_job, Algorithm::TwoStage),
            Err(Reject::Foreign)
        );
        assert_eq!(
            Packet::decode(&good, KEYS, Algorithm::Channels),
            Err(Reject::Foreign)
        );
        for at in [5, 24, 40, 70, good.len() - 1] {
            let mut bad = good.to_vec();
            bad[at] ^= 0x10;
            assert_eq!(decode(&bad), Err(Reject::Corrupt), "byte {at}");
        }
        assert_eq!(decode(b"not a packet at all"), Err(Reject::Unknown));
        // Consistent CRC over inconsistent numbers: a sequence number past the count.
        let mut f = Fragment::split(1, 0, &data, 128).remove(0);
        f.seq = 5;
        let lying = Packet::Fragment(f).encode(KEYS, Algorithm::TwoStage);
        assert_eq!(decode(&lying), Err(Reject::Malformed));
        let huge_list = {
            let mut b = BytesMut::new();
            b.put_u32_le(u32::MAX);
            b
        };
        assert_eq!(Reader(&huge_list).missing(), Err(Reject::Malformed));
    }
}
