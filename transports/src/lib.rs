//! rankweave's transports: the IO drivers under the message layer.
//!
//! Each transport implements [`rankweave_core::Transport`]: it moves frames and declares what it
//! guarantees, and stays small:
//!
//! * [`inproc`]: ranks as tasks of one process, frames handed over by reference.
//! * [`link`]: any [`Carrier`](rankweave_core::Carrier) (unreliable datagrams over routes) made
//!   into a transport by the end-to-end reliability layer; [`udp`] is such a carrier, and
//!   [`chaos`] a carrier decorator that injects faults.
//!
//! * [`shm`]: processes of one host, through shared-memory rings and single-copy reads;
//!   [`split`] combines it with a network transport for jobs that span hosts.
//!
//! * [`ipmcast`]: IP multicast groups (one per communicator) for the multicast broadcasts;
//!   [`chaos_group`] injects faults into what a group receives.
//!
//! * [`verbs`]: InfiniBand verbs: the RC transport over a provider interface, a simulated
//!   fabric, and (feature `verbs`) the device provider over `libibverbs`.

#![warn(missing_docs)]

pub mod chaos;
pub mod chaos_group;
pub mod inproc;
pub mod ipmcast;
pub mod link;
pub mod shm;
pub mod split;
mod sync;
#[cfg(test)]
mod test_frames;
#[cfg(test)]
mod test_waker;
pub mod udp;
pub mod verbs;
