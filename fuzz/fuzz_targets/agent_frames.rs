//! The guest agent's frames, both ways: what a hostile guest sends the host (responses) and
//! what reaches the agent (requests), as length-prefixed JSON.
//!
//! Invariant: reading any bytes never panics; a length over `MAX_FRAME_BYTES` is refused
//! before anything that large is allocated; a frame that decodes encodes back to a frame
//! that decodes to the same value (round trip).
#![no_main]

use kiln_guest::proto::{self, FrameError, Request, Response};
use libfuzzer_sys::fuzz_target;

fn frames<T>(data: &[u8])
where
    T: serde::Serialize + for<'de> serde::Deserialize<'de> + PartialEq + std::fmt::Debug,
{
    let mut input = data;
    for _ in 0..64 {
        match proto::read_frame::<_, T>(&mut input) {
            Ok(value) => {
                let encoded = proto::encode(&value).expect("a decoded frame encodes");
                let back: T = proto::read_frame(&mut encoded.as_slice()).expect("and decodes");
                assert_eq!(back, value);
            }
            Err(FrameError::Malformed(_)) => {}
            Err(FrameError::TooLarge(n)) => assert!(n > u64::from(proto::MAX_FRAME_BYTES)),
            Err(_) => return,
        }
    }
}

fuzz_target!(|data: &[u8]| {
    frames::<Response>(data);
    frames::<Request>(data);
});
