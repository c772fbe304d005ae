//! [`CollectiveTuning`]: which algorithm each collective uses, and the size thresholds of the
//! automatic choice. Part of [`Config`](crate::Config), so every setting has a typed default and
//! a `RANKWEAVE_*` override; the algorithms themselves live in `rankweave-collectives`.
//!
//! | variable | values | default |
//! |---|---|---|
//! | `RANKWEAVE_BCAST` | `auto`, `binomial`, `scatter_allgather`, `chain`, `multicast`, `channels` | `auto` |
//! | `RANKWEAVE_ALLREDUCE` | `auto`, `recursive_doubling`, `rabenseifner`, `ring`, `direct` | `auto` |
//! | `RANKWEAVE_ALLGATHER` | `auto`, `recursive_doubling`, `bruck`, `ring`, `direct` | `auto` |
//! | `RANKWEAVE_ALLTOALL` | `auto`, `bruck`, `pairwise`, `linear`, `direct` | `auto` |
//! | `RANKWEAVE_BARRIER` | `auto`, `dissemination`, `linear`, `flags` | `auto` |
//! | `RANKWEAVE_FLAT_MAX` | ranks | 7: on 3 to this many ranks the barrier is linear (through flags where they can be used) and broadcasts go from the root to every rank directly |
//! | `RANKWEAVE_BCAST_LARGE` | bytes | 12 KiB: scatter + allgather from here (on more than 2 ranks) |
//! | `RANKWEAVE_BCAST_CHAIN` | bytes | 4 MiB: pipelined chain from here |
//! | `RANKWEAVE_ALLREDUCE_LARGE` | bytes | 64 KiB: reduce-scatter + allgather from here |
//! | `RANKWEAVE_ALLREDUCE_DIRECT` | bytes | 256 KiB (twice that on 2 ranks; half of it, a quarter on 2 ranks, for vectors that fit `RANKWEAVE_SHM_ARENA`): commutative allreduces read their peers' vectors directly from here, where every rank is local and may (`0`: never) |
//! | `RANKWEAVE_ALLGATHER_LARGE` | bytes (total gathered) | 512 KiB: ring from here |
//! | `RANKWEAVE_ALLGATHER_DIRECT` | bytes (per rank) | 64 KiB: `all_gather` reads its peers' blocks directly from here, where every rank is local and may (`0`: never) |
//! | `RANKWEAVE_ALLTOALL_LARGE` | bytes (per destination) | 256 B: pairwise exchange from here |
//! | `RANKWEAVE_ALLTOALL_DIRECT` | bytes (per destination) | 32 KiB: `all_to_all` reads its blocks directly from the other ranks' inputs from here, where every rank is local and may (`0`: never) |
//! | `RANKWEAVE_SEGMENT` | bytes | 128 KiB: pipeline segment of the chain broadcast |

use crate::config::{parse_number, parse_size};
use crate::error::ConfigError;

/// Broadcast algorithms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BcastAlgorithm {
    /// Binomial tree: ⌈log₂ n⌉ rounds, the whole message each time. Best for small messages.
    Binomial,
    /// Scatter along a binomial tree, then a ring allgather (van de Geijn): about 2× the
    /// message per rank whatever `n`. Best for large messages.
    ScatterAllgather,
    /// Pipelined chain: segments flow rank to rank, so each link carries the message once.
    /// Best for very large messages.
    Chain,
    /// Two-stage multicast broadcast (Hoefler, Siebert and Rehm): every fragment multicast
    /// once, then completed reliably along a ring of point-to-point sends. Needs a multicast
    /// group (`RANKWEAVE_MULTICAST`); every rank picks it alike, by communicator size.
    Multicast,
    /// LA-MPI's channel broadcast (Yu, Sur, Panda, Aulwes, Graham): multicast into a ring of
    /// broadcast channels, returning once buffered; ACKs combined along a tree when channels
    /// run out; NACKs force resends; fail-over to point-to-point.
    Channels,
}

/// Barrier algorithms (two ranks always make one exchange, which is both).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BarrierAlgorithm {
    /// Dissemination (Hensgen, Finkel and Manber): ⌈log₂ n⌉ rounds in which every rank
    /// signals the rank 2^k ahead. Every rank leaves at about the same time.
    Dissemination,
    /// Linear (Open MPI's choice for 4 to 7 ranks): every rank signals rank 0, which releases
    /// them all. Two hops whatever `n`, and rank 0 leaves first, so a broadcast from it that
    /// follows is already on its way when the others leave.
    Linear,
    /// Linear through flags in shared memory: every rank raises its flag to rank 0, which
    /// raises its own to every rank once it saw them all — a cache line's trip per hop where
    /// a message takes the whole send and receive path (MPICH's barrier on shared memory works
    /// the same way); on two ranks, one exchange of flags. Only the world communicator, with
    /// every rank on this host over shared memory, can use it (there is one flag per pair of
    /// ranks), and there it is the automatic choice on up to `flat_max` ranks (and on two);
    /// forced elsewhere, the automatic choice stands in.
    Flags,
}

/// Allreduce algorithms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllreduceAlgorithm {
    /// Recursive doubling: ⌈log₂ n⌉ exchanges of the whole vector. Best for small vectors.
    RecursiveDoubling,
    /// Rabenseifner: recursive-halving reduce-scatter, then recursive-doubling allgather.
    Rabenseifner,
    /// Ring: reduce-scatter and allgather around a ring, 2(n−1) steps of 1/n of the vector.
    Ring,
    /// Direct reads (commutative operations, every rank on this host with cross-memory attach
    /// permitted; otherwise the automatic choice): each rank reads its block of every other
    /// rank's vector straight from that rank's memory and reduces it, then reads the others'
    /// finished blocks straight into its result. No message carries data, and nothing is
    /// copied but by those reads.
    Direct,
}

/// Allgather algorithms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllgatherAlgorithm {
    /// Recursive doubling (power-of-two sizes; others use Bruck).
    RecursiveDoubling,
    /// Bruck: ⌈log₂ n⌉ rounds for any `n`.
    Bruck,
    /// Ring: n − 1 steps of one block each. Best for large blocks.
    Ring,
    /// Direct reads (`all_gather` only; `all_gatherv` takes Bruck): every rank reads each
    /// peer's block straight from the peer's result vector into its own, where every rank of
    /// the communicator can read the others' memory (ranks of one host over shared memory);
    /// elsewhere the automatic choice among the others.
    Direct,
}

/// Alltoall algorithms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AlltoallAlgorithm {
    /// Bruck: ⌈log₂ n⌉ rounds, blocks forwarded through intermediate ranks. Best for small
    /// blocks.
    Bruck,
    /// Pairwise exchange: n − 1 steps, each with one partner. Best for large blocks.
    Pairwise,
    /// Linear (Open MPI's `basic_linear`): every block sent and every receive posted at once.
    /// No step waits for another, so on a host with more ranks than cores each rank needs the
    /// processor once to send and once to receive. Few ranks, small blocks.
    Linear,
    /// Direct reads (`all_to_all` only; `all_to_allv` takes pairwise exchange): every rank
    /// reads its block from each peer's copy of its input straight into its result, where
    /// every rank of the communicator can read the others' memory (ranks of one host over
    /// shared memory); elsewhere the automatic choice among the others.
    Direct,
}

/// Algorithm choices and thresholds of the collectives (see the [module docs](self)).
/// `None` in an algorithm field means automatic choice by size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CollectiveTuning {
    /// `RANKWEAVE_BCAST`.
    pub bcast: Option<BcastAlgorithm>,
    /// `RANKWEAVE_BARRIER`.
    pub barrier: Option<BarrierAlgorithm>,
    /// `RANKWEAVE_FLAT_MAX`: on 3 to this many ranks (default 7, as Open MPI) the automatic
    /// barrier is [linear](BarrierAlgorithm::Linear) and a broadcast goes from the root to
    /// every rank directly instead of down a binomial tree (its data too below 128 KiB). With
    /// so few ranks a tree saves little, and each forwarding rank is one more that must be
    /// running for the others to finish — on a host with more ranks than cores, a scheduler
    /// time slice. Every rank of a communicator must use the same value (a rank's first
    /// broadcast message comes from the root or from its tree parent by it).
    pub flat_max: usize,
    /// `RANKWEAVE_ALLREDUCE`.
    pub allreduce: Option<AllreduceAlgorithm>,
    /// `RANKWEAVE_ALLGATHER`.
    pub allgather: Option<AllgatherAlgorithm>,
    /// `RANKWEAVE_ALLTOALL`.
    pub alltoall: Option<AlltoallAlgorithm>,
    /// `RANKWEAVE_BCAST_LARGE`: broadcasts of at least this many bytes use scatter + allgather
    /// (on at least `bcast_min_ranks` ranks).
    pub bcast_large: usize,
    /// `RANKWEAVE_BCAST_MIN_RANKS`: on fewer ranks than this, every broadcast is a binomial
    /// tree, whatever its size (MPICH's `BCAST_MIN_PROCS`, also 8): with few ranks the tree
    /// sends the whole message only a couple of times, and the more elaborate algorithms'
    /// extra rounds cost more than they save.
    pub bcast_min_ranks: usize,
    /// `RANKWEAVE_BCAST_CHAIN`: broadcasts of at least this many bytes use the pipelined chain.
    pub bcast_chain: usize,
    /// `RANKWEAVE_ALLREDUCE_LARGE`: allreduces of at least this many bytes use reduce-scatter +
    /// allgather (Rabenseifner).
    pub allreduce_large: usize,
    /// `RANKWEAVE_ALLREDUCE_DIRECT`: commutative allreduces of at least this many bytes (twice
    /// as many on two ranks; half as many, a quarter on two ranks, for vectors that fit the
    /// shared-memory arena, which peers read with loads) use [direct
    /// reads](AllreduceAlgorithm::Direct) where every rank of the communicator can read the
    /// others' memory; `0` never does.
    pub allreduce_direct: usize,
    /// `RANKWEAVE_ALLGATHER_LARGE`: allgathers collecting at least this many bytes in all use
    /// the ring.
    pub allgather_large: usize,
    /// `RANKWEAVE_ALLGATHER_DIRECT`: `all_gather`s of at least this many bytes per rank use
    /// [direct reads](AllgatherAlgorithm::Direct) where every rank can read the others'
    /// memory; `0` never does.
    pub allgather_direct: usize,
    /// `RANKWEAVE_ALLTOALL_LARGE`: alltoalls with blocks of at least this many bytes use
    /// pairwise exchange.
    pub alltoall_large: usize,
    /// `RANKWEAVE_ALLTOALL_DIRECT`: `all_to_all`s with blocks of at least this many bytes use
    /// [direct reads](AlltoallAlgorithm::Direct) where every rank can read the others'
    /// memory; `0` never does.
    pub alltoall_direct: usize,
    /// `RANKWEAVE_SEGMENT`: segment size of pipelined algorithms (the chain broadcast).
    pub segment: usize,
}

impl Default for CollectiveTuning {
    fn default() -> Self {
        CollectiveTuning {
            bcast: None,
            barrier: None,
            flat_max: 7,
            allreduce: None,
            allgather: None,
            alltoall: None,
            bcast_large: 12 * 1024,
            bcast_min_ranks: 8,
            bcast_chain: 4 << 20,
            allreduce_large: 64 * 1024,
            allreduce_direct: 256 * 1024,
            allgather_large: 512 * 1024,
            allgather_direct: 64 * 1024,
            alltoall_large: 256,
            alltoall_direct: 32 * 1024,
            segment: 128 * 1024,
        }
    }
}

fn choice<T: Copy>(
    variable: &str,
    value: &str,
    names: &[(&str, T)],
) -> Result<Option<T>, ConfigError> {
    let v = value.trim().to_ascii_lowercase().replace('-', "_");
    if v == "auto" {
        return Ok(None);
    }
    names
        .iter()
        .find(|(n, _)| *n == v)
        .map(|(_, t)| Some(*t))
        .ok_or_else(|| ConfigError {
            variable: variable.into(),
            value: value.into(),
            expected: format!(
                "auto or one of: {}",
                names.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
            ),
        })
}

impl CollectiveTuning {
    /// Applies the `RANKWEAVE_*` variables `get` finds (empty values are absent).
    pub fn apply_env(&mut self, get: &dyn Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        use AllgatherAlgorithm as G;
        use AllreduceAlgorithm as R;
        use AlltoallAlgorithm as A;
        use BcastAlgorithm as B;
        if let Some(v) = get("RANKWEAVE_BCAST") {
            self.bcast = choice(
                "RANKWEAVE_BCAST",
                &v,
                &[
                    ("binomial", B::Binomial),
                    ("scatter_allgather", B::ScatterAllgather),
                    ("chain", B::Chain),
                    ("multicast", B::Multicast),
                    ("channels", B::Channels),
                ],
            )?;
        }
        if let Some(v) = get("RANKWEAVE_BARRIER") {
            self.barrier = choice(
                "RANKWEAVE_BARRIER",
                &v,
                &[
                    ("dissemination", BarrierAlgorithm::Dissemination),
                    ("linear", BarrierAlgorithm::Linear),
                    ("flags", BarrierAlgorithm::Flags),
                ],
            )?;
        }
        if let Some(v) = get("RANKWEAVE_ALLREDUCE") {
            self.allreduce = choice(
                "RANKWEAVE_ALLREDUCE",
                &v,
                &[
                    ("recursive_doubling", R::RecursiveDoubling),
                    ("rabenseifner", R::Rabenseifner),
                    ("ring", R::Ring),
                    ("direct", R::Direct),
                ],
            )?;
        }
        if let Some(v) = get("RANKWEAVE_ALLGATHER") {
            self.allgather = choice(
                "RANKWEAVE_ALLGATHER",
                &v,
                &[
                    ("recursive_doubling", G::RecursiveDoubling),
                    ("bruck", G::Bruck),
                    ("ring", G::Ring),
                    ("direct", G::Direct),
                ],
            )?;
        }
        if let Some(v) = get("RANKWEAVE_ALLTOALL") {
            self.alltoall = choice(
                "RANKWEAVE_ALLTOALL",
                &v,
                &[
                    ("bruck", A::Bruck),
                    ("pairwise", A::Pairwise),
                    ("linear", A::Linear),
                    ("direct", A::Direct),
                ],
            )?;
        }
        let sizes: [(&str, &mut usize); 9] = [
            ("RANKWEAVE_BCAST_LARGE", &mut self.bcast_large),
            ("RANKWEAVE_BCAST_CHAIN", &mut self.bcast_chain),
            ("RANKWEAVE_ALLREDUCE_LARGE", &mut self.allreduce_large),
            ("RANKWEAVE_ALLREDUCE_DIRECT", &mut self.allreduce_direct),
            ("RANKWEAVE_ALLGATHER_LARGE", &mut self.allgather_large),
            ("RANKWEAVE_ALLGATHER_DIRECT", &mut self.allgather_direct),
            ("RANKWEAVE_ALLTOALL_LARGE", &mut self.alltoall_large),
            ("RANKWEAVE_ALLTOALL_DIRECT", &mut self.alltoall_direct),
            ("RANKWEAVE_SEGMENT", &mut self.segment),
        ];
        for (name, field) in sizes {
            if let Some(v) = get(name) {
                *field = parse_size(name, &v)?;
            }
        }
        if let Some(v) = get("RANKWEAVE_BCAST_MIN_RANKS") {
            self.bcast_min_ranks =
                parse_number("RANKWEAVE_BCAST_MIN_RANKS", &v, 1, u32::MAX.into())? as usize;
        }
        if let Some(v) = get("RANKWEAVE_FLAT_MAX") {
            self.flat_max = parse_number("RANKWEAVE_FLAT_MAX", &v, 0, u32::MAX.into())? as usize;
        }
        if self.segment == 0 {
            return Err(ConfigError {
                variable: "RANKWEAVE_SEGMENT".into(),
                value: "0".into(),
                expected: "at least 1 byte".into(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(vars: &[(&str, &str)]) -> Result<CollectiveTuning, ConfigError> {
        let mut t = CollectiveTuning::default();
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        t.apply_env(&|name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))?;
        Ok(t)
    }

    #[test]
    fn algorithms_and_thresholds_from_the_environment() {
        let t = with(&[
            ("RANKWEAVE_BCAST", "scatter-allgather"),
            ("RANKWEAVE_ALLREDUCE", "Ring"),
            ("RANKWEAVE_ALLGATHER", "auto"),
            ("RANKWEAVE_ALLTOALL", "linear"),
            ("RANKWEAVE_ALLREDUCE_LARGE", "1M"),
            ("RANKWEAVE_ALLREDUCE_DIRECT", "0"),
            ("RANKWEAVE_SEGMENT", "8k"),
            ("RANKWEAVE_BCAST_MIN_RANKS", "4"),
            ("RANKWEAVE_BARRIER", "Linear"),
            ("RANKWEAVE_FLAT_MAX", "0"),
        ])
        .unwrap();
        assert_eq!(t.barrier, Some(BarrierAlgorithm::Linear));
        assert_eq!(t.flat_max, 0);
        assert_eq!(CollectiveTuning::default().flat_max, 7);
        assert_eq!(t.bcast_min_ranks, 4);
        assert_eq!(CollectiveTuning::default().bcast_min_ranks, 8);
        assert_eq!(t.bcast, Some(BcastAlgorithm::ScatterAllgather));
        assert_eq!(t.allreduce, Some(AllreduceAlgorithm::Ring));
        assert_eq!(t.allgather, None);
        assert_eq!(t.alltoall, Some(AlltoallAlgorithm::Linear));
        assert_eq!(t.allreduce_large, 1 << 20);
        assert_eq!(t.allreduce_direct, 0);
        assert_eq!(CollectiveTuning::default().allreduce_direct, 256 * 1024);
        assert_eq!(t.segment, 8192);
        let t = with(&[("RANKWEAVE_ALLREDUCE", "direct")]).unwrap();
        assert_eq!(t.allreduce, Some(AllreduceAlgorithm::Direct));
        let t = with(&[
            ("RANKWEAVE_ALLGATHER", "direct"),
            ("RANKWEAVE_ALLGATHER_DIRECT", "1M"),
        ])
        .unwrap();
        assert_eq!(t.allgather, Some(AllgatherAlgorithm::Direct));
        assert_eq!(t.allgather_direct, 1 << 20);
        assert_eq!(CollectiveTuning::default().allgather_direct, 64 * 1024);
        let t = with(&[
            ("RANKWEAVE_ALLTOALL", "direct"),
            ("RANKWEAVE_ALLTOALL_DIRECT", "0"),
        ])
        .unwrap();
        assert_eq!(t.alltoall, Some(AlltoallAlgorithm::Direct));
        assert_eq!(t.alltoall_direct, 0);
        assert_eq!(CollectiveTuning::default().alltoall_direct, 32 * 1024);
    }

    #[test]
    fn bad_values_name_the_variable_and_the_choices() {
        let e = with(&[("RANKWEAVE_BCAST", "telepathy")]).unwrap_err();
        assert_eq!(e.variable, "RANKWEAVE_BCAST");
        assert!(e.expected.contains("binomial"), "{}", e.expected);
        let e = with(&[("RANKWEAVE_SEGMENT", "0")]).unwrap_err();
        assert_eq!(e.variable, "RANKWEAVE_SEGMENT");
        let e = with(&[("RANKWEAVE_BCAST_MIN_RANKS", "0")]).unwrap_err();
        assert_eq!(e.variable, "RANKWEAVE_BCAST_MIN_RANKS");
        let e = with(&[("RANKWEAVE_BARRIER", "tree")]).unwrap_err();
        assert!(e.expected.contains("linear"), "{}", e.expected);
        let e = with(&[("RANKWEAVE_FLAT_MAX", "-1")]).unwrap_err();
        assert_eq!(e.variable, "RANKWEAVE_FLAT_MAX");
        let e = with(&[("RANKWEAVE_ALLTOALL_LARGE", "lots")]).unwrap_err();
        assert_eq!(e.variable, "RANKWEAVE_ALLTOALL_LARGE");
    }
}
