//! Fuzzes `rankweave_core::reliability::Packet::decode`: it must never panic, and whatever it
//! accepts must re-encode (in one buffer, and as header + payload for a gathered send) to the
//! same bytes, which decode again to the same packet.
//!
//! Each input is decoded as it is, and once more with its magic, version and CRC fixed up, so
//! that the fuzzer also explores what follows the CRC check (random bytes never match a CRC).

#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use rankweave_core::reliability::packet::{COMMON_HEADER_LEN, MAGIC, RAW_HEADER_LEN, VERSION};
use rankweave_core::reliability::{Packet, PacketBody};
use rankweave_core::wire::checksum_parts;

/// Decodes `data` and checks the round trip of whatever is accepted.
fn check(data: &[u8]) {
    let input = Bytes::copy_from_slice(data);
    // Decode with the key the buffer claims (bytes 8..16), so that packets can be accepted;
    // also with another key, which must not panic either.
    let key = data
        .get(8..16)
        .and_then(|k| <[u8; 8]>::try_from(k).ok())
        .map_or(0, u64::from_le_bytes);
    let _ = Packet::decode(&input, key ^ 1);
    let Ok(packet) = Packet::decode(&input, key) else {
        return;
    };
    let encoded = packet.encode();
    assert_eq!(encoded.len(), packet.encoded_len());
    assert_eq!(encoded, input, "the encoding is canonical");
    let mut gathered = Vec::new();
    packet.write_header(&mut gathered);
    assert_eq!(gathered.len(), packet.header_len());
    if let Some(payload) = packet.payload() {
        for part in payload.parts() {
            gathered.extend_from_slice(part);
        }
    }
    assert_eq!(gathered, &encoded[..], "write_header + payload == encode");
    let again = Packet::decode(&encoded, key).expect("a re-encoded packet decodes");
    assert_eq!(again, packet);
    if let PacketBody::Data { seq, .. } = packet.body {
        assert_ne!(seq, 0);
    }
}

fuzz_target!(|data: &[u8]| {
    check(data);
    if data.len() >= COMMON_HEADER_LEN {
        let mut fixed = data.to_vec();
        fixed[..2].copy_from_slice(&MAGIC);
        fixed[2] = VERSION;
        // RAW packets (kind 3) checksum their header only.
        let end = if fixed[3] == 3 {
            RAW_HEADER_LEN.min(fixed.len())
        } else {
            fixed.len()
        };
        let crc = checksum_parts(&[&fixed[..4], &fixed[8..end]]);
        fixed[4..8].copy_from_slice(&crc.to_le_bytes());
        check(&fixed);
    }
});
