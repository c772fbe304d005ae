//! Waiting on flags in shared memory, which local ranks raise to each other (see
//! [`Communicator::raise_flag`]) and no message announces.
//!
//! [`until`] looks as the progress policy says: busy-polling in bursts of [`SPIN_BURST`]
//! (yielding the processor between looks where ranks outnumber cores) and handing the thread
//! back to the runtime between bursts, for the spin window; then parked until a flag changes
//! (the transport wakes it: see [`Communicator::park_on_flags`]). While it spins, the rank's
//! peers need not wake it ([`Communicator::spinning_on_flags`]), as while a receive
//! busy-polls: a wake-up costs a system call on each side.

use std::task::Poll;
use std::time::{Duration, Instant};

use rankweave_core::types::ContextId;
use rankweave_core::{Communicator, Error, ProgressPolicy};

/// Whether `comm` can use flags: the world communicator (there is one flag per pair of ranks,
/// not per communicator), with every other rank sharing them with this one. The same answer on every rank: it depends on where the ranks run, not
/// on their state.
pub(crate) fn usable(comm: &Communicator) -> bool {
    comm.context() == ContextId::WORLD
        && (0..comm.size()).all(|r| r == comm.rank() || comm.has_flags_with(r))
}

/// One busy-poll burst, as long as the point-to-point operations' bursts.
const SPIN_BURST: Duration = Duration::from_micros(1);

/// Calls `look` until it gives `Some`, and returns that.
pub(crate) async fn until<T>(
    comm: &Communicator,
    mut look: impl FnMut() -> Option<Result<T, Error>>,
) -> Result<T, Error> {
    let config = comm.config();
    let give_way = config.spin_yield == Some(true);
    // When the first burst ended: the spin window counts from there.
    let mut spun_since: Option<Instant> = None;
    loop {
        let spin = match config.progress {
            ProgressPolicy::Spin => true,
            ProgressPolicy::Park => false,
            ProgressPolicy::SpinThenPark => {
                spun_since.is_none_or(|since| since.elapsed() < config.spin_window())
            }
        };
        if !spin {
            break;
        }
        // The clock is read once every few looks, not before the first: a flag on its way
        // lands within a few hundred nanoseconds.
        let mut burst: Option<Instant> = None;
        let mut looks = 0u32;
        // Peers need not wake this rank while it looks for itself.
        comm.spinning_on_flags();
        loop {
            if let Some(result) = look() {
                return result;
            }
            if give_way {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            looks += 1;
            if looks % 32 == 0 {
                let now = Instant::now();
                let start = *burst.get_or_insert(now);
                if now.duration_since(start) >= SPIN_BURST {
                    spun_since.get_or_insert(start);
                    break;
                }
            }
        }
        tokio::task::yield_now().await;
    }
    std::future::poll_fn(|cx| {
        if let Some(result) = look() {
            return Poll::Ready(result);
        }
        comm.park_on_flags(cx.waker());
        // Raised between the look and the parking: seen now, or it woke us.
        look().map_or(Poll::Pending, Poll::Ready)
    })
    .await
}
