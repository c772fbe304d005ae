//! rankweave's collective operations, as futures over the point-to-point layer.
//!
//! [`Collectives`] adds the collective operations to [`Communicator`]. Like point-to-point
//! operations they start when called: the call takes the communicator's next collective
//! sequence number (which tags every message of the operation on the communicator's collective
//! context, where user receives never look) and starts the algorithm as a task of the runtime,
//! so it progresses whether or not the returned [`CollectiveOp`] is polled, several collectives
//! can be in flight at once, also on different communicators, and they still pair up across
//! ranks. Every rank must start the same collectives in the same order, as in MPI.
//!
//! # Arguments and results
//!
//! Data is typed: slices of any [`bytemuck::Pod`] element type (raw bytes are `u8`).
//! Reductions take an [`Op`] or a [`UserOp`] over a [`Reducible`] type (built-in operations) or
//! any `Pod` type (user operations); non-commutative operations are combined in rank order, as
//! MPI promises. Where MPI has "v" variants with per-rank counts, so does this crate
//! (`gatherv`, `scatterv`, `all_gatherv`, `all_to_allv`): their blocks may differ in length
//! from rank to rank, and each rank learns the lengths from the messages. The plain variants
//! expect every rank to pass the same count; a rank that sees a count differ reports
//! [`Error::InvalidArgument`].
//!
//! The typed collectives borrow their input for the call only, and copy what must outlive it.
//! The bytes variants [`all_gather_bytes`](Collectives::all_gather_bytes) and
//! [`all_to_all_bytes`](Collectives::all_to_all_bytes) take the input as a
//! [`Payload`] (`Bytes`, `Vec<u8>`, ...) that the collective holds
//! until the peers are done with it: processes of one host read it in place, as MPI libraries
//! read a send buffer, and nothing is copied for them.
//!
//! # Algorithms
//!
//! Chosen by message and communicator size, with overrides in
//! [`CollectiveTuning`](rankweave_core::CollectiveTuning) (`RANKWEAVE_BCAST`, ...):
//!
//! | collective | algorithms |
//! |---|---|
//! | barrier | linear (up to `flat_max` ranks, default 7), dissemination |
//! | broadcast | flat (up to `flat_max` ranks) or binomial tree (small), scatter + ring allgather (large), pipelined chain (very large); on request two-stage multicast or LA-MPI channels ([`mcast`]) |
//! | reduce | binomial tree (order-preserving for non-commutative operations) |
//! | all_reduce | recursive doubling (small), Rabenseifner (large), ring |
//! | gather(v), scatter(v) | binomial tree |
//! | all_gather(v) | recursive doubling or Bruck (small), ring (large) |
//! | all_to_all(v) | linear (3 to `flat_max` ranks), Bruck (small), pairwise exchange (large) |
//! | reduce_scatter | recursive halving (commutative), reduce + scatter (otherwise) |
//! | scan, exscan | recursive doubling (order-preserving) |

#![warn(missing_docs)]

mod allgather;
mod allreduce;
mod alltoall;
mod barrier;
mod broadcast;
mod ctx;
mod exposure;
mod filling;
mod flag_wait;
mod gather;
pub mod mcast;
pub mod op;
mod reduce;
mod reduce_scatter;
mod scan;
mod scatter;
mod started;
mod swap;
mod tree;

use bytemuck::Pod;
use bytes::Bytes;
use rankweave_core::tuning::{AllreduceAlgorithm, AlltoallAlgorithm, BarrierAlgorithm};
use rankweave_core::{Communicator, Error, Payload, byte_copy};

pub use broadcast::{FLAT_BODY_BELOW, SEPARATE_FROM};
pub use mcast::BcastStats;
pub use op::{Op, ReduceOp, Reducible, UserOp};
pub use started::CollectiveOp;

use allgather::OwnBlock;
use ctx::Ctx;

/// Element types of the data collectives move.
pub trait Element: Pod + Send + Sync + 'static {}
impl<T: Pod + Send + Sync + 'static> Element for T {}

/// Starts `run` on the next collective of `comm`, after `check` accepted the arguments (a
/// rejected call sends nothing, but still takes its sequence number: every rank must make the
/// same calls, and a call that fails everywhere keeps them in step).
fn start<T: Send + 'static, F>(
    comm: &Communicator,
    check: Result<(), Error>,
    run: impl FnOnce(Ctx) -> F,
) -> CollectiveOp<T>
where
    F: Future<Output = Result<T, Error>> + Send + 'static,
{
    start_in(Ctx::next(comm), check, run)
}

/// [`start`] in a context already taken.
fn start_in<T: Send + 'static, F>(
    cx: Ctx,
    check: Result<(), Error>,
    run: impl FnOnce(Ctx) -> F,
) -> CollectiveOp<T>
where
    F: Future<Output = Result<T, Error>> + Send + 'static,
{
    let rank = cx.rank;
    match check {
        Ok(()) => CollectiveOp::start(rank, run(cx)),
        Err(e) => CollectiveOp::failed(rank, e),
    }
}

/// Collective operations on a communicator (see the [crate docs](crate)).
pub trait Collectives {
    /// Waits until every rank of the communicator has entered the barrier (linear on up to
    /// `flat_max` ranks: every rank signals rank 0, which releases them; dissemination above:
    /// ⌈log₂ n⌉ rounds of one send and one receive).
    fn barrier(&self) -> CollectiveOp<()>;

    /// Sends `data` from `root` to every rank; every rank gets the root's bytes. Ranks other
    /// than `root` may pass anything (an empty `Vec`, say): it is ignored, and they learn the
    /// length from the root.
    fn broadcast(&self, root: usize, data: impl Payload) -> CollectiveOp<Bytes>;

    /// What this communicator's multicast broadcasts did on this rank (`RANKWEAVE_BCAST` =
    /// `multicast` or `channels`): fragments multicast and repaired, NACKs, synchronisations,
    /// dropped packets, the group's own counters. `None` before the first one.
    fn multicast_stats(&self) -> Option<BcastStats>;

    /// Combines every rank's `data` with `op`; `root` gets `Some(result)`, the others `None`.
    fn reduce<T: Element>(
        &self,
        root: usize,
        data: &[T],
        op: impl Into<ReduceOp<T>>,
    ) -> CollectiveOp<Option<Vec<T>>>;

    /// Combines every rank's `data` with `op`; every rank gets the result.
    fn all_reduce<T: Element>(
        &self,
        data: &[T],
        op: impl Into<ReduceOp<T>>,
    ) -> CollectiveOp<Vec<T>>;

    /// Collects every rank's `data` (the same count everywhere) at `root`, in rank order:
    /// `root` gets `Some(concatenation)`, the others `None`.
    fn gather<T: Element>(&self, root: usize, data: &[T]) -> CollectiveOp<Option<Vec<T>>>;

    /// Collects every rank's `data` (counts may differ) at `root`: `root` gets one vector per
    /// rank.
    fn gatherv<T: Element>(&self, root: usize, data: &[T]) -> CollectiveOp<Option<Vec<Vec<T>>>>;

    /// Splits `root`'s `data` into `size` equal blocks and gives block `r` to rank `r`. The
    /// others' `data` is ignored. A length that does not divide evenly is an error at the root.
    fn scatter<T: Element>(&self, root: usize, data: &[T]) -> CollectiveOp<Vec<T>>;

    /// Gives `root`'s `blocks[r]` to rank `r` (lengths may differ); the others pass an empty
    /// `Vec`. The root must pass exactly `size` blocks.
    fn scatterv<T: Element>(&self, root: usize, blocks: Vec<Vec<T>>) -> CollectiveOp<Vec<T>>;

    /// Collects every rank's `data` (the same count everywhere) at every rank, in rank order.
    fn all_gather<T: Element>(&self, data: &[T]) -> CollectiveOp<Vec<T>>;

    /// [`all_gather`](Self::all_gather) of bytes, with `data` given to the collective rather
    /// than lent for the call: ranks that can read each other's memory (processes of one host,
    /// over shared memory) read it in place, and nothing is copied for them. Pass a clone of a
    /// `Bytes` to keep a handle to it; the collective only reads it. The ranks may mix this
    /// call and `all_gather` (of the same byte length) in one collective.
    fn all_gather_bytes(&self, data: impl Payload) -> CollectiveOp<Vec<u8>>;

    /// Collects every rank's `data` (counts may differ) at every rank: one vector per rank.
    fn all_gatherv<T: Element>(&self, data: &[T]) -> CollectiveOp<Vec<Vec<T>>>;

    /// Splits `data` into `size` equal blocks, sends block `r` to rank `r`, and returns the
    /// blocks received, concatenated in rank order.
    fn all_to_all<T: Element>(&self, data: &[T]) -> CollectiveOp<Vec<T>>;

    /// [`all_to_all`](Self::all_to_all) of bytes, with `data` given to the collective rather
    /// than lent for the call: ranks that can read each other's memory read their blocks of
    /// it in place (see [`all_gather_bytes`](Self::all_gather_bytes)). The ranks may mix this
    /// call and `all_to_all` (of the same byte length) in one collective.
    fn all_to_all_bytes(&self, data: impl Payload) -> CollectiveOp<Vec<u8>>;

    /// Sends `blocks[r]` to rank `r` (lengths may differ) and returns the block from each rank.
    /// `blocks` must hold exactly `size` blocks.
    fn all_to_allv<T: Element>(&self, blocks: Vec<Vec<T>>) -> CollectiveOp<Vec<Vec<T>>>;

    /// Combines every rank's `data` (a length divisible by `size`, the same everywhere) with `op`
    /// and gives block `r` of the result to rank `r` (`MPI_Reduce_scatter_block`).
    fn reduce_scatter<T: Element>(
        &self,
        data: &[T],
        op: impl Into<ReduceOp<T>>,
    ) -> CollectiveOp<Vec<T>>;

    /// Inclusive prefix reduction: rank `r` gets `data₀ ∘ … ∘ dataᵣ`.
    fn scan<T: Element>(&self, data: &[T], op: impl Into<ReduceOp<T>>) -> CollectiveOp<Vec<T>>;

    /// Exclusive prefix reduction: rank `r > 0` gets `Some(data₀ ∘ … ∘ dataᵣ₋₁)`, rank 0 `None`.
    fn exscan<T: Element>(
        &self,
        data: &[T],
        op: impl Into<ReduceOp<T>>,
    ) -> CollectiveOp<Option<Vec<T>>>;
}

impl Collectives for Communicator {
    fn barrier(&self) -> CollectiveOp<()> {
        match (barrier::choose(self), self.rank()) {
            (BarrierAlgorithm::Flags, _) => barrier::flags(self),
            // Two ranks: one exchange, the dissemination barrier of two.
            (BarrierAlgorithm::Dissemination, _) if self.size() == 2 => barrier::pair(self),
            (BarrierAlgorithm::Linear, 0) => start(self, Ok(()), barrier::linear_root),
            (BarrierAlgorithm::Linear, _) => barrier::linear_leaf(self),
            (BarrierAlgorithm::Dissemination, _) => start(self, Ok(()), barrier::dissemination),
        }
    }

    fn broadcast(&self, root: usize, data: impl Payload) -> CollectiveOp<Bytes> {
        let data = data.into_bytes();
        if let Some(algorithm) = mcast::selected(self) {
            // Registered with the engine now (broadcast ids follow call order), like any
            // operation; the engine's task moves it.
            return start(self, ctx::check_root(root, self.size()), move |cx| {
                let engine = cx
                    .comm
                    .extension(|comm| mcast::engine::Engine::new(comm, algorithm));
                let me = cx.rank;
                engine.broadcast(root, (root == me).then_some(data))
            });
        }
        let data = if self.size() == 2 && root < 2 {
            match broadcast::of_two(self, root, data) {
                Ok(op) => return op,
                Err(data) => data,
            }
        } else if root < self.size() && root != self.rank() && broadcast::is_flat(self) {
            return broadcast::flat_leaf(self, root);
        } else {
            data
        };
        let cx = Ctx::next(self);
        let check = ctx::check_root(root, cx.size);
        let data = if check.is_ok() && root == cx.rank {
            match broadcast::root_at_once(&cx, data) {
                Ok(done) => return done,
                Err(data) => data,
            }
        } else {
            data
        };
        start_in(cx, check, move |cx| broadcast::run(cx, root, data))
    }

    fn multicast_stats(&self) -> Option<BcastStats> {
        self.existing_extension::<mcast::engine::Engine>()
            .map(|e| e.stats())
    }

    fn reduce<T: Element>(
        &self,
        root: usize,
        data: &[T],
        op: impl Into<ReduceOp<T>>,
    ) -> CollectiveOp<Option<Vec<T>>> {
        let op = op.into();
        let check = ctx::check_root(root, self.size()).and_then(|()| op.check());
        let cx = Ctx::next(self);
        if check.is_ok() && cx.size == 2 {
            return reduce::pair(cx, root, data, op);
        }
        let data = byte_copy::vec_from(data);
        start_in(cx, check, move |cx| reduce::binomial(cx, root, data, op))
    }

    fn all_reduce<T: Element>(
        &self,
        data: &[T],
        op: impl Into<ReduceOp<T>>,
    ) -> CollectiveOp<Vec<T>> {
        let op = op.into();
        let check = op.check();
        let cx = Ctx::next(self);
        let algorithm = allreduce::choose(&cx, &op, data.len());
        if check.is_ok() && cx.size == 2 && algorithm == AllreduceAlgorithm::RecursiveDoubling {
            // One exchange.
            return allreduce::pair(cx, byte_copy::vec_from(data), op);
        }
        let input = allreduce::Input::copy(&cx, data, algorithm == AllreduceAlgorithm::Direct);
        start_in(cx, check, move |cx| {
            allreduce::run(cx, input, op, algorithm)
        })
    }

    fn gather<T: Element>(&self, root: usize, data: &[T]) -> CollectiveOp<Option<Vec<T>>> {
        let (count, data) = (data.len(), ctx::to_bytes(data));
        start(self, ctx::check_root(root, self.size()), move |cx| {
            gather::gather::<T>(cx, root, data, count)
        })
    }

    fn gatherv<T: Element>(&self, root: usize, data: &[T]) -> CollectiveOp<Option<Vec<Vec<T>>>> {
        let data = ctx::to_bytes(data);
        start(self, ctx::check_root(root, self.size()), move |cx| {
            gather::gatherv::<T>(cx, root, data)
        })
    }

    fn scatter<T: Element>(&self, root: usize, data: &[T]) -> CollectiveOp<Vec<T>> {
        let n = self.size();
        let is_root = self.rank() == root;
        // A root whose data does not split still takes part: it tells the others, who would
        // otherwise wait for their blocks.
        let refusal = (is_root && data.len() % n != 0).then(|| {
            Error::InvalidArgument(format!(
                "scatter: {} elements do not split into {n} equal blocks",
                data.len()
            ))
        });
        let blocks: Vec<Vec<T>> = if is_root && refusal.is_none() {
            let per = data.len() / n;
            (0..n)
                .map(|r| byte_copy::vec_from(&data[r * per..(r + 1) * per]))
                .collect()
        } else {
            Vec::new()
        };
        start(self, ctx::check_root(root, n), move |cx| {
            scatter::scatterv(cx, root, blocks, refusal)
        })
    }

    fn scatterv<T: Element>(&self, root: usize, blocks: Vec<Vec<T>>) -> CollectiveOp<Vec<T>> {
        // A root with the wrong number of blocks tells the others (`scatter::scatterv`).
        start(self, ctx::check_root(root, self.size()), move |cx| {
            scatter::scatterv(cx, root, blocks, None)
        })
    }

    fn all_gather<T: Element>(&self, data: &[T]) -> CollectiveOp<Vec<T>> {
        all_gather_of(self, data, None)
    }

    fn all_gather_bytes(&self, data: impl Payload) -> CollectiveOp<Vec<u8>> {
        let data = data.into_bytes();
        all_gather_of(self, &data.clone(), Some(data))
    }

    fn all_gatherv<T: Element>(&self, data: &[T]) -> CollectiveOp<Vec<Vec<T>>> {
        let data = ctx::to_bytes(data);
        start(self, Ok(()), move |cx| {
            allgather::all_gatherv::<T>(cx, data)
        })
    }

    fn all_to_all<T: Element>(&self, data: &[T]) -> CollectiveOp<Vec<T>> {
        all_to_all_of(self, data, None)
    }

    fn all_to_all_bytes(&self, data: impl Payload) -> CollectiveOp<Vec<u8>> {
        let data = data.into_bytes();
        all_to_all_of(self, &data.clone(), Some(data))
    }

    fn all_to_allv<T: Element>(&self, blocks: Vec<Vec<T>>) -> CollectiveOp<Vec<Vec<T>>> {
        let n = self.size();
        let check = if blocks.len() == n {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "all_to_allv: {} blocks for {n} ranks",
                blocks.len()
            )))
        };
        start(self, check, move |cx| alltoall::all_to_allv(cx, blocks))
    }

    fn reduce_scatter<T: Element>(
        &self,
        data: &[T],
        op: impl Into<ReduceOp<T>>,
    ) -> CollectiveOp<Vec<T>> {
        let n = self.size();
        let op = op.into();
        let check = op.check();
        if check.is_ok() && data.len() % n != 0 {
            let e = Error::InvalidArgument(format!(
                "reduce_scatter: {} elements do not split into {n} equal blocks",
                data.len()
            ));
            let whole = &data[..data.len() / n * n];
            return failing_after(self.rank(), self.reduce_scatter(whole, op), e);
        }
        let data = byte_copy::vec_from(data);
        start(self, check, move |cx| reduce_scatter::run(cx, data, op))
    }

    fn scan<T: Element>(&self, data: &[T], op: impl Into<ReduceOp<T>>) -> CollectiveOp<Vec<T>> {
        let op = op.into();
        let check = op.check();
        let data = byte_copy::vec_from(data);
        start(self, check, move |cx| scan::inclusive(cx, data, op))
    }

    fn exscan<T: Element>(
        &self,
        data: &[T],
        op: impl Into<ReduceOp<T>>,
    ) -> CollectiveOp<Option<Vec<T>>> {
        let op = op.into();
        let check = op.check();
        let data = byte_copy::vec_from(data);
        start(self, check, move |cx| scan::exclusive(cx, data, op))
    }
}

/// `all_gather` of `data`; `shared` holds the same bytes when the caller gave them to the
/// collective (`all_gather_bytes`), so that peers may read them in place.
fn all_gather_of<T: Element>(
    comm: &Communicator,
    data: &[T],
    shared: Option<Bytes>,
) -> CollectiveOp<Vec<T>> {
    let cx = Ctx::next(comm);
    if allgather::is_direct(&cx, size_of_val(data)) {
        let result = allgather::result_with_own(&cx, data);
        let own = shared.map_or(OwnBlock::InResult, OwnBlock::Shared);
        return start_in(cx, Ok(()), move |cx| allgather::direct(cx, result, own));
    }
    if cx.size == 2 && allgather::is_small(&cx, size_of_val(data)) {
        return swap::swap(cx, data, data, data.len());
    }
    let count = data.len();
    let data = shared.unwrap_or_else(|| ctx::to_bytes(data));
    start_in(cx, Ok(()), move |cx| {
        allgather::all_gather::<T>(cx, data, count)
    })
}

/// `all_to_all` of `data`; `shared` holds the same bytes when the caller gave them to the
/// collective (`all_to_all_bytes`), so that peers may read their blocks in place.
fn all_to_all_of<T: Element>(
    comm: &Communicator,
    data: &[T],
    shared: Option<Bytes>,
) -> CollectiveOp<Vec<T>> {
    let n = comm.size();
    if data.len() % n != 0 {
        let e = Error::InvalidArgument(format!(
            "all_to_all: {} elements do not split into {n} equal blocks",
            data.len()
        ));
        let whole = &data[..data.len() / n * n];
        let shared = shared.map(|b| b.slice(..size_of_val(whole)));
        return failing_after(comm.rank(), all_to_all_of(comm, whole, shared), e);
    }
    let cx = Ctx::next(comm);
    let count = data.len() / n;
    if alltoall::is_direct(&cx, count * size_of::<T>()) {
        let result = alltoall::direct_result(&cx, data);
        let input = match shared {
            Some(bytes) => alltoall::DirectInput::Whole(bytes),
            None => alltoall::DirectInput::new(&cx, data),
        };
        return start_in(cx, Ok(()), move |cx| alltoall::direct(cx, input, result));
    }
    if n == 2 && alltoall::choose(&cx, count * size_of::<T>()) == AlltoallAlgorithm::Bruck {
        // Block r of `data` is for rank r.
        let (to_0, to_1) = data.split_at(count);
        return if cx.rank == 0 {
            swap::swap(cx, to_0, to_1, count)
        } else {
            swap::swap(cx, to_1, to_0, count)
        };
    }
    let len = data.len();
    let data = shared.unwrap_or_else(|| ctx::to_bytes(data));
    if alltoall::choose(&cx, count * size_of::<T>()) == AlltoallAlgorithm::Linear {
        return alltoall::linear_at_once(cx, data, count);
    }
    start_in(cx, Ok(()), move |cx| {
        alltoall::all_to_all::<T>(cx, data, len)
    })
}

/// `op` (the call with the whole blocks there are, for a length that does not split into equal
/// blocks) run to its end, then failed with `e`: the rank takes part, so that the others do not
/// wait for its blocks, and reports its own mistake. The others fail too where their blocks
/// then differ in length from this rank's.
fn failing_after<T: Send + 'static>(rank: usize, op: CollectiveOp<T>, e: Error) -> CollectiveOp<T> {
    CollectiveOp::start(rank, async move {
        let _ = op.await;
        Err(e)
    })
}
