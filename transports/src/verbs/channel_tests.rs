//! Two channels wired back to back, with the wire and the receive buffers modelled: eager,
//! credits, rendezvous ordering, and peers that break the protocol.

use bytes::Bytes;
use rankweave_core::ContextId;
use rankweave_core::frame::{Envelope, Frame, Header};

use super::*;
use crate::verbs::provider::{MemoryRegion, MrId};

const CONFIG: ChannelConfig = ChannelConfig {
    window: 4,
    buffer_len: 256,
    max_transfer: 1 << 20,
};

fn frame(seq: u64, len: usize) -> Frame {
    Frame {
        header: Header::Eager(Envelope {
            context: ContextId(0),
            tag: 0,
            seq,
            len: len as u64,
        }),
        payload: Bytes::from(vec![seq as u8; len]),
    }
}

fn region(id: u64, len: u64) -> MemoryRegion {
    MemoryRegion {
        id: MrId(id),
        addr: id << 32,
        len: len as usize,
        lkey: id as u32,
        rkey: id as u32,
        remote_write: true,
    }
}

/// Moves everything `from` can transmit into `to`, registering buffers and delivering writes
/// as a driver would; returns how many transmissions there were.
fn pump(from: &mut RcChannel, to: &mut RcChannel, next_region: &mut u64) -> usize {
    let mut n = 0;
    while let Some(t) = from.poll_transmit(true) {
        n += 1;
        match t {
            Transmit::Message(bytes) => to.on_message(Bytes::from(bytes)).unwrap(),
            Transmit::Write {
                transfer,
                payload,
                remote,
            } => {
                let mr = to.on_write_done(transfer, payload.len()).unwrap();
                assert_eq!(remote.rkey as u64, mr.0);
                to.deliver_transfer(transfer, payload);
            }
        }
    }
    while let Some((transfer, len)) = to.poll_allocation() {
        *next_region += 1;
        to.buffer_ready(transfer, &region(*next_region, len));
    }
    n
}

fn frames(c: &mut RcChannel) -> Vec<u64> {
    std::iter::from_fn(|| c.poll_frame())
        .map(|f| match f.header {
            Header::Eager(e) => e.seq,
            _ => u64::MAX,
        })
        .collect()
}

#[test]
fn rendezvous_frames_keep_their_place_between_eager_ones() {
    let (mut a, mut b) = (RcChannel::new(CONFIG), RcChannel::new(CONFIG));
    let mut ids = 0;
    a.send(frame(0, 10));
    a.send(frame(1, 5000));
    a.send(frame(2, 10));
    for _ in 0..10 {
        pump(&mut a, &mut b, &mut ids);
        pump(&mut b, &mut a, &mut ids);
    }
    assert_eq!(frames(&mut b), [0, 1, 2]);
    assert_eq!(a.counters().rendezvous_sent, 1);
    assert_eq!(a.counters().eager_sent, 2);
    assert!(a.is_idle());
}

#[test]
fn a_frame_waits_behind_an_incomplete_rendezvous() {
    let (mut a, mut b) = (RcChannel::new(CONFIG), RcChannel::new(CONFIG));
    let mut ids = 0;
    a.send(frame(0, 5000));
    a.send(frame(1, 10));
    pump(&mut a, &mut b, &mut ids);
    assert!(
        b.poll_frame().is_none(),
        "frame 1 arrived but waits for frame 0"
    );
    for _ in 0..4 {
        pump(&mut b, &mut a, &mut ids);
        pump(&mut a, &mut b, &mut ids);
    }
    assert_eq!(frames(&mut b), [0, 1]);
}

#[test]
fn a_sender_without_credits_waits_and_the_receiver_returns_them() {
    let (mut a, mut b) = (RcChannel::new(CONFIG), RcChannel::new(CONFIG));
    let mut ids = 0;
    for seq in 0..10 {
        a.send(frame(seq, 10));
    }
    assert_eq!(
        pump(&mut a, &mut b, &mut ids),
        3,
        "window 4, one in reserve"
    );
    assert!(a.has_pending());
    assert_eq!(a.counters().credit_stalls, 1);
    // b owes 3 >= threshold 2: a credit-only message.
    assert_eq!(pump(&mut b, &mut a, &mut ids), 1);
    assert_eq!(b.counters().credit_updates_sent, 1);
    for _ in 0..10 {
        pump(&mut a, &mut b, &mut ids);
        pump(&mut b, &mut a, &mut ids);
    }
    assert_eq!(frames(&mut b), (0..10).collect::<Vec<_>>());
}

#[test]
fn a_peer_that_ignores_credits_is_caught() {
    let mut b = RcChannel::new(CONFIG);
    let mut bytes = Vec::new();
    super::super::message::Message::Frame(frame(0, 1)).encode(0, &mut bytes);
    for _ in 0..4 {
        b.on_message(Bytes::from(bytes.clone())).unwrap();
    }
    assert_eq!(
        b.on_message(Bytes::from(bytes)),
        Err(ChannelError::CreditOverrun)
    );
}

#[test]
fn protocol_violations_are_errors() {
    let mut b = RcChannel::new(CONFIG);
    let mut cts = Vec::new();
    super::super::message::Message::Cts {
        transfer: 9,
        addr: 0,
        rkey: 0,
    }
    .encode(0, &mut cts);
    assert_eq!(
        b.on_message(Bytes::from(cts)),
        Err(ChannelError::UnknownTransfer(9))
    );
    let mut rts = Vec::new();
    super::super::message::Message::Rts {
        transfer: 1,
        header: frame(0, 0).header,
        len: 2 << 20,
    }
    .encode(0, &mut rts);
    assert!(matches!(
        b.on_message(Bytes::from(rts)),
        Err(ChannelError::TransferTooLarge { .. })
    ));
    assert!(matches!(
        b.on_message(Bytes::from_static(b"garbage!")),
        Err(ChannelError::Malformed(_))
    ));
    assert_eq!(
        b.on_write_done(3, 10),
        Err(ChannelError::UnknownTransfer(3))
    );
}

#[test]
fn bye_comes_after_every_frame_and_finishes_the_peer() {
    let (mut a, mut b) = (RcChannel::new(CONFIG), RcChannel::new(CONFIG));
    let mut ids = 0;
    a.send(frame(0, 10));
    a.send(frame(1, 1000));
    a.close();
    for _ in 0..6 {
        pump(&mut a, &mut b, &mut ids);
        pump(&mut b, &mut a, &mut ids);
    }
    assert!(
        !b.peer_finished(),
        "BYE came, but its frames are not taken yet"
    );
    assert_eq!(frames(&mut b), [0, 1]);
    assert!(b.peer_finished());
    assert!(a.is_idle());
}
