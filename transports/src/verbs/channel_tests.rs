//! Two channels wired back to back, with the wire and the receive buffers modelled: eager,
//! credits, rendezvous, stream tags, and peers that break the protocol.

use bytes::Bytes;
use rankweave_core::frame::{Frame, Header};

use super::*;
use crate::verbs::message::StreamTag;
use crate::verbs::provider::{MemoryRegion, MrId};

fn send(c: &mut RcChannel, seq: u64, len: usize) {
    c.send(StreamTag::whole(seq), frame(seq, len));
}

const CONFIG: ChannelConfig = ChannelConfig {
    window: 4,
    buffer_len: 256,
    max_transfer: 1 << 20,
    read_min: usize::MAX,
};

fn frame(seq: u64, len: usize) -> Frame {
    crate::test_frames::eager_frame(0, 0, seq, vec![seq as u8; len])
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

thread_local! {
    /// The read rendezvous payloads registered by [`pump`], by remote key.
    static SOURCES: std::cell::RefCell<std::collections::HashMap<u32, Bytes>> =
        Default::default();
}

/// Moves everything `from` can transmit into `to`, registering buffers and delivering writes
/// as a driver would; returns how many transmissions there were.
fn pump(from: &mut RcChannel, to: &mut RcChannel, next_region: &mut u64) -> usize {
    let mut n = 0;
    while let Some((transfer, payload)) = from.poll_source() {
        *next_region += 1;
        let r = region(*next_region, payload.len() as u64);
        SOURCES.with(|s| s.borrow_mut().insert(r.rkey, payload));
        from.source_ready(transfer, &r);
    }
    while let Some(t) = from.poll_transmit(true) {
        n += 1;
        match t {
            Transmit::Message { bytes, .. } => to.on_message(Bytes::from(bytes)).unwrap(),
            Transmit::Write {
                tag: _,
                transfer,
                payload,
                remote,
            } => {
                let mr = to.on_write_done(transfer, payload.len()).unwrap();
                assert_eq!(remote.rkey as u64, mr.0);
                to.deliver_transfer(transfer, payload);
            }
            // `from` reads from `to`'s registered payload.
            Transmit::Read {
                transfer,
                region,
                len,
                remote,
            } => {
                let payload = SOURCES
                    .with(|s| s.borrow().get(&remote.rkey).cloned())
                    .expect("a registered source");
                assert_eq!(payload.len() as u64, len);
                assert_eq!(from.on_read_done(transfer), Ok(region));
                from.deliver_transfer(transfer, payload);
            }
        }
    }
    while let Some((transfer, len)) = to.poll_allocation() {
        *next_region += 1;
        to.buffer_ready(transfer, &region(*next_region, len));
    }
    n
}

/// The stream sequence numbers of the complete frames, in the order they came out; checks
/// that each frame's tag matches its contents.
fn frames(c: &mut RcChannel) -> Vec<u64> {
    std::iter::from_fn(|| c.poll_frame())
        .map(|(tag, f)| match f.header {
            Header::Eager(e) => {
                assert_eq!(e.seq, tag.seq, "tag and frame disagree");
                assert!(f.payload.iter().all(|&b| b == e.seq as u8));
                tag.seq
            }
            _ => u64::MAX,
        })
        .collect()
}

#[test]
fn rendezvous_frames_come_out_when_complete_with_their_tags() {
    let (mut a, mut b) = (RcChannel::new(CONFIG), RcChannel::new(CONFIG));
    let mut ids = 0;
    send(&mut a, 0, 10);
    send(&mut a, 1, 5000);
    send(&mut a, 2, 10);
    for _ in 0..10 {
        pump(&mut a, &mut b, &mut ids);
        pump(&mut b, &mut a, &mut ids);
    }
    // The rendezvous frame completes after the eager one sent behind it; the stream above
    // restores the order from the tags.
    assert_eq!(frames(&mut b), [0, 2, 1]);
    assert_eq!(a.counters().rendezvous_sent, 1);
    assert_eq!(a.counters().eager_sent, 2);
    assert!(a.is_idle());
}

#[test]
fn transmissions_name_the_frame_they_deliver() {
    let (mut a, mut b) = (RcChannel::new(CONFIG), RcChannel::new(CONFIG));
    let mut ids = 0;
    send(&mut a, 7, 10);
    send(&mut a, 8, 5000);
    let mut delivered = Vec::new();
    for _ in 0..4 {
        while let Some(t) = a.poll_transmit(true) {
            match t {
                Transmit::Message { bytes, delivers } => {
                    delivered.extend(delivers.map(|t| t.seq));
                    b.on_message(Bytes::from(bytes)).unwrap();
                }
                Transmit::Write {
                    tag,
                    transfer,
                    payload,
                    ..
                } => {
                    delivered.push(tag.seq);
                    b.on_write_done(transfer, payload.len()).unwrap();
                    b.deliver_transfer(transfer, payload);
                }
                Transmit::Read { .. } => unreachable!("reads are off in this configuration"),
            }
        }
        pump(&mut b, &mut a, &mut ids);
        while let Some((transfer, len)) = b.poll_allocation() {
            ids += 1;
            b.buffer_ready(transfer, &region(ids, len));
        }
    }
    // The Rts delivers nothing; the write delivers frame 8.
    assert_eq!(delivered, [7, 8]);
    assert_eq!(frames(&mut b), [7, 8]);
}

#[test]
fn a_frame_behind_an_incomplete_rendezvous_is_not_held() {
    let (mut a, mut b) = (RcChannel::new(CONFIG), RcChannel::new(CONFIG));
    let mut ids = 0;
    send(&mut a, 0, 5000);
    send(&mut a, 1, 10);
    pump(&mut a, &mut b, &mut ids);
    assert_eq!(frames(&mut b), [1], "frame 1 is complete, frame 0 is not");
    for _ in 0..4 {
        pump(&mut b, &mut a, &mut ids);
        pump(&mut a, &mut b, &mut ids);
    }
    assert_eq!(frames(&mut b), [0]);
}

#[test]
fn a_sender_without_credits_waits_and_the_receiver_returns_them() {
    let (mut a, mut b) = (RcChannel::new(CONFIG), RcChannel::new(CONFIG));
    let mut ids = 0;
    for seq in 0..10 {
        send(&mut a, seq, 10);
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
    super::super::message::Message::Frame {
        tag: StreamTag::whole(0),
        frame: frame(0, 1),
    }
    .encode(0, &mut bytes);
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
        tag: StreamTag::whole(0),
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
    send(&mut a, 0, 10);
    send(&mut a, 1, 1000);
    a.close(2);
    for _ in 0..6 {
        pump(&mut a, &mut b, &mut ids);
        pump(&mut b, &mut a, &mut ids);
    }
    assert_eq!(
        b.peer_end(),
        None,
        "BYE came, but its frames are not taken yet"
    );
    assert_eq!(frames(&mut b), [0, 1]);
    assert_eq!(b.peer_end(), Some(2));
    assert!(a.is_idle());
}

/// From `read_min` on, a rendezvous frame goes by RDMA read: the sender registers the payload
/// and announces it, the receiver reads it and answers with a Fin, which delivers the frame at
/// the sender and releases the payload's region. Smaller rendezvous frames still go by write.
#[test]
fn read_rendezvous_is_chosen_from_the_threshold_and_ends_with_a_fin() {
    let config = ChannelConfig {
        read_min: 4000,
        ..CONFIG
    };
    let (mut a, mut b) = (RcChannel::new(config), RcChannel::new(config));
    let mut ids = 100;
    send(&mut a, 0, 10);
    send(&mut a, 1, 5000);
    send(&mut a, 2, 3000);
    send(&mut a, 3, 10);
    // The read rendezvous frame waits for its registration.
    assert!(!a.is_idle());
    for _ in 0..10 {
        pump(&mut a, &mut b, &mut ids);
        pump(&mut b, &mut a, &mut ids);
    }
    let mut got = frames(&mut b);
    got.sort_unstable();
    assert_eq!(got, [0, 1, 2, 3]);
    let finished: Vec<u64> = std::iter::from_fn(|| a.poll_read_finished())
        .map(|(tag, _)| tag.seq)
        .collect();
    assert_eq!(finished, [1], "the Fin delivers the read frame");
    let (ca, cb) = (a.counters(), b.counters());
    assert_eq!((ca.rendezvous_sent, ca.read_rendezvous_sent), (2, 1));
    assert_eq!(ca.rdma_bytes_sent, 3000, "the smaller one was written");
    assert_eq!(cb.rdma_bytes_read, 5000);
    assert!(a.is_idle() && b.is_idle());
}

/// A lane given up releases its announced payloads; a Fin for one of them that was already on
/// its way is ignored, a Fin for a transfer never announced is a protocol error.
#[test]
fn abandoned_reads_release_their_payload_and_ignore_a_late_fin() {
    let config = ChannelConfig {
        read_min: 1000,
        ..CONFIG
    };
    let (mut a, mut b) = (RcChannel::new(config), RcChannel::new(config));
    let mut ids = 200;
    send(&mut a, 0, 2000);
    pump(&mut a, &mut b, &mut ids);
    assert_eq!(a.take_read_sources(), [MrId(201)]);
    assert!(a.is_idle());
    // b reads and answers with a Fin.
    pump(&mut b, &mut a, &mut ids);
    assert_eq!(a.poll_read_finished(), None);
    let mut fin = Vec::new();
    Message::Fin { transfer: 9 }.encode(0, &mut fin);
    assert_eq!(
        a.on_message(Bytes::from(fin)),
        Err(ChannelError::UnknownTransfer(9))
    );
}
