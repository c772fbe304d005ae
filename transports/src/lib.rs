//! rankweave's transports: the IO drivers under the message layer.
//!
//! Each transport implements [`rankweave_core::Transport`]: it moves frames and declares what it
//! guarantees, and stays small. Today there is [`inproc`] (ranks as tasks of one process);
//! shared memory, UDP and verbs follow.

#![warn(missing_docs)]

pub mod chaos;
pub mod inproc;
mod sync;
