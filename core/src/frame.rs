//! Frames: the units the message protocol hands to a transport.
//!
//! In-process transports move these values as they are (the payload is a reference-counted
//! [`Bytes`], so nothing is copied); byte-oriented transports (UDP, shared memory) will encode
//! them into bytes.

use bytes::Bytes;

use crate::types::ContextId;

/// Where a message belongs: the fields matching looks at, plus its length and its place in the
/// sender's stream to this receiver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Envelope {
    /// The communication context (communicator) the message was sent on.
    pub context: ContextId,
    /// The user's tag.
    pub tag: u32,
    /// Position in the stream of messages from this sender to this receiver, from 0.
    pub seq: u64,
    /// Total payload length in bytes.
    pub len: u64,
}

/// What a frame says; the payload travels beside it in [`Frame::payload`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Header {
    /// A whole message, sent without asking (its length is within the eager limit and the
    /// sender holds enough of the receiver's eager credit). The payload is the message.
    Eager(Envelope),
    /// Request to send a message whose data waits at the sender until the receiver matches it.
    Rts {
        /// The message's envelope.
        envelope: Envelope,
        /// The sender's handle for this message, echoed back in the CTS.
        send_id: u64,
        /// The data travels with this frame (transports that hand payloads over by reference,
        /// where attaching it costs nothing): the receiver takes it on match and its CTS only
        /// tells the sender the message was received.
        attached: bool,
    },
    /// Clear to send: the receiver matched an RTS and is ready for the data.
    Cts {
        /// The sender's handle from the RTS.
        send_id: u64,
        /// The receiver's handle, carried by every data fragment.
        recv_id: u64,
    },
    /// A fragment of a rendezvous message's data, at `offset` within the message.
    Data {
        /// The receiver's handle from the CTS.
        recv_id: u64,
        /// Byte offset of this fragment within the message.
        offset: u64,
    },
    /// The receiver has consumed `bytes` of eager data: the sender may send that much more
    /// eagerly.
    Credit {
        /// Bytes of eager credit given back.
        bytes: u64,
    },
}

/// A header and its payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    /// What the frame is.
    pub header: Header,
    /// The bytes it carries (empty for control frames).
    pub payload: Bytes,
}

impl Frame {
    /// A frame with an empty payload.
    pub fn control(header: Header) -> Self {
        Frame {
            header,
            payload: Bytes::new(),
        }
    }
}
