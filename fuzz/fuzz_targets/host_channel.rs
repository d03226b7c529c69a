//! The host's side of the agent's channel (`kiln_native::channel::Channel`), reading
//! whatever a hostile guest writes: replies to kiln's requests and to ids it never used,
//! connections it was never asked for, floods.
//!
//! Invariant: no panic; what the channel holds for its readers stays within its budget
//! (`CHANNEL_BUDGET`) and its open streams within `MAX_CONNECTIONS` plus kiln's own
//! requests; every stream ends (a final reply or the channel's end) once the guest's
//! bytes run out.
#![no_main]

use kiln_guest::proto::Op;
use kiln_native::channel::{CHANNEL_BUDGET, Channel, MAX_CONNECTIONS};
use libfuzzer_sys::fuzz_target;
use tokio::io::AsyncWriteExt;

fuzz_target!(|data: &[u8]| {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let (host_read, mut guest_write) = tokio::io::duplex(1 << 16);
        let (_guest_read, host_write) = tokio::io::duplex(1 << 16);
        let channel = Channel::new(host_read, host_write);
        // kiln's own requests (ids 1 and 2): a call and a listener.
        let mut hello = channel.call(Op::Hello).await.expect("a call");
        let listener = channel
            .call(Op::Listen { port: 1 })
            .await
            .expect("a listener");
        guest_write.write_all(data).await.expect("written");
        drop(guest_write);
        // Each stream ends once the guest's bytes run out.
        while hello.next().await.is_some() {}
        drop(listener);
        tokio::task::yield_now().await;
        assert!(channel.buffered() <= CHANNEL_BUDGET);
        assert!(channel.streams() <= MAX_CONNECTIONS + 2);
    });
});
