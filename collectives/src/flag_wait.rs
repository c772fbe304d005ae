//! Where flags in shared memory can be used (see [`Communicator::raise_flag`]); waiting on them
//! is [`Communicator::wait_on_flags`].

use rankweave_core::Communicator;
use rankweave_core::types::ContextId;

/// Whether `comm` can use flags: the world communicator (there is one flag per pair of ranks,
/// not per communicator), with every other rank sharing them with this one. The same answer on
/// every rank: it depends on where the ranks run, not on their state.
pub(crate) fn usable(comm: &Communicator) -> bool {
    comm.context() == ContextId::WORLD
        && (0..comm.size()).all(|r| r == comm.rank() || comm.has_flags_with(r))
}
