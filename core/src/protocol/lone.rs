//! The lone receive: a receive posted while no other receive waits and no message is queued
//! unexpected — a rank waiting for one message at a time, the common case of request/reply and
//! of every tree collective.
//!
//! Such a receive cannot be overtaken and cannot match anything already here, so the endpoint
//! keeps it beside the op table and the matcher instead of in them: posting it stores three
//! words, and when its message is the next frame its sender left in the transport
//! ([`Endpoint::take_direct`](super::Endpoint::take_direct)) nothing has to be looked up,
//! matched or removed. The endpoint keeps one invariant: while a lone receive exists, the state
//! is exactly what it would be with that receive posted in the matcher. So every call that
//! could change what it matches — another receive, an arrival taken in, a message given back,
//! a cancelled receive, a lost peer, a frame to self — first makes it **join**: it is entered
//! in the op table and posted, in its place in line (it was posted before anything that is
//! posted now). Its future keeps the id it was given; [`LoneIds`] translates.

use crate::matching::Selector;

use super::RecvId;

/// Slot bits of a lone receive's id: never a slot of the op table (which would need four
/// billion operations at once), so a lone id never finds an operation there.
const LONE_SLOT: u64 = 0xFFFF_FFFF;

/// A receive posted alone (see the [module docs](self)).
#[derive(Clone, Copy, Debug)]
pub(super) struct LoneRecv {
    pub(super) id: RecvId,
    pub(super) sel: Selector,
    pub(super) max_len: Option<usize>,
}

/// The ids of lone receives, and the op-table ids of those that joined.
#[derive(Debug, Default)]
pub(super) struct LoneIds {
    generation: u32,
    /// (the id the receive's future knows, its id in the op table), for lone receives that
    /// joined and whose outcome has not been taken yet. Rarely more than one entry.
    joined: Vec<(RecvId, RecvId)>,
}

impl LoneIds {
    /// A fresh id for a lone receive.
    pub(super) fn fresh(&mut self) -> RecvId {
        self.generation = self.generation.wrapping_add(1);
        RecvId((u64::from(self.generation) << 32) | LONE_SLOT)
    }

    /// Lone receive `lone` is now operation `op` of the op table.
    pub(super) fn joined(&mut self, lone: RecvId, op: RecvId) {
        self.joined.push((lone, op));
    }

    /// The op-table id of the receive its future knows as `id`.
    pub(super) fn op_id(&self, id: RecvId) -> RecvId {
        if id.0 & LONE_SLOT != LONE_SLOT {
            return id;
        }
        self.joined
            .iter()
            .find(|(lone, _)| *lone == id)
            .map_or(id, |&(_, op)| op)
    }

    /// The id the future of operation `op` knows it by.
    pub(super) fn public_id(&self, op: RecvId) -> RecvId {
        self.joined
            .iter()
            .find(|(_, o)| *o == op)
            .map_or(op, |&(lone, _)| lone)
    }

    /// The receive its future knows as `id` is finished with (taken or cancelled).
    pub(super) fn forget(&mut self, id: RecvId) {
        if id.0 & LONE_SLOT == LONE_SLOT {
            self.joined.retain(|(lone, _)| *lone != id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lone_ids_are_fresh_and_translate_once_joined() {
        let mut ids = LoneIds::default();
        let (a, b) = (ids.fresh(), ids.fresh());
        assert_ne!(a, b);
        // Not joined: its own id; ordinary ids pass through.
        assert_eq!(ids.op_id(a), a);
        assert_eq!(ids.op_id(RecvId(7)), RecvId(7));
        ids.joined(a, RecvId(3));
        assert_eq!(ids.op_id(a), RecvId(3));
        assert_eq!(ids.public_id(RecvId(3)), a);
        assert_eq!(ids.public_id(RecvId(4)), RecvId(4));
        ids.forget(a);
        assert_eq!(ids.op_id(a), a);
        assert_eq!(ids.public_id(RecvId(3)), RecvId(3));
    }
}
