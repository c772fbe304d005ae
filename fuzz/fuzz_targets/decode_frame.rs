//! Fuzzes `rankweave_core::wire::decode`: it must never panic, and whatever it accepts must
//! re-encode to the same bytes and decode again to the same frame.

#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use rankweave_core::wire;

fuzz_target!(|data: &[u8]| {
    let input = Bytes::copy_from_slice(data);
    if let Ok(frame) = wire::decode(input.clone()) {
        let encoded = wire::encode(&frame);
        assert_eq!(encoded, input, "the encoding is canonical");
        let again = wire::decode(encoded).expect("a re-encoded frame decodes");
        assert_eq!(again, frame);
    }
});
