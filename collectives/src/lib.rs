//! rankweave's collective operations, as futures over the point-to-point layer.
//!
//! [`Collectives`] adds the collective operations to
//! [`Communicator`]. Like point-to-point operations they start
//! when called: the call takes the communicator's next collective sequence number (which tags
//! every message of the operation on the communicator's collective context, where user
//! receives never look), so several collectives can be in flight at once and still pair up
//! across ranks. Every rank must start the same collectives in the same order, as in MPI.
//!
//! This crate starts small (barrier and broadcast); the tuned algorithm families follow.

#![warn(missing_docs)]

mod barrier;
mod broadcast;

use std::future::Future;

use bytes::Bytes;
use rankweave_core::{Communicator, Error, Payload};

/// Collective operations on a communicator.
pub trait Collectives {
    /// Waits until every rank of the communicator has entered the barrier (dissemination
    /// algorithm: ⌈log₂ n⌉ rounds of one send and one receive).
    fn barrier(&self) -> impl Future<Output = Result<(), Error>> + Send + 'static;

    /// Sends `data` from `root` to every rank (binomial tree); every rank gets the root's bytes.
    /// Ranks other than `root` may pass anything (an empty `Vec`, say): it is ignored.
    fn broadcast(
        &self,
        root: usize,
        data: impl Payload,
    ) -> impl Future<Output = Result<Bytes, Error>> + Send + 'static;
}

impl Collectives for Communicator {
    fn barrier(&self) -> impl Future<Output = Result<(), Error>> + Send + 'static {
        barrier::dissemination(self.clone(), self.next_collective())
    }

    fn broadcast(
        &self,
        root: usize,
        data: impl Payload,
    ) -> impl Future<Output = Result<Bytes, Error>> + Send + 'static {
        broadcast::binomial(
            self.clone(),
            self.next_collective(),
            root,
            data.into_bytes(),
        )
    }
}
