//! Frames for the transports' tests.

use bytes::Bytes;
use rankweave_core::ContextId;
use rankweave_core::frame::{Envelope, Frame, Header};

/// An eager frame on `context` with `tag`, sequence number `seq` and `payload`.
pub(crate) fn eager_frame(context: u64, tag: u32, seq: u64, payload: impl Into<Bytes>) -> Frame {
    let payload = payload.into();
    Frame {
        header: Header::Eager(Envelope {
            context: ContextId(context),
            tag,
            seq,
            len: payload.len() as u64,
        }),
        payload,
    }
}
