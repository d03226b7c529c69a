//! What the host reads of a microVM's (or gVisor box's) `/proc` through its agent: a
//! process's `stat`, `status` and `cmdline`, and `net/tcp` / `tcp6`. A hostile guest writes
//! all of it.
//!
//! Invariant: no panic (no overflow, no slice out of range) whatever the text; a process
//! read has the pid it was asked for; a listening socket has a port and an address.
#![no_main]

use kiln_native::procs::{vm_listening, vm_process};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Four parts, split at 0xFF bytes: stat, status, cmdline, net; the first 8 bytes the
    // boot time.
    let (boot, rest) = match data.split_first_chunk::<8>() {
        Some((boot, rest)) => (u64::from_le_bytes(*boot), rest),
        None => (0, data),
    };
    let mut parts = rest.splitn(4, |b| *b == 0xFF);
    let stat = parts.next().unwrap_or_default();
    let status = String::from_utf8_lossy(parts.next().unwrap_or_default());
    let cmdline = parts.next().unwrap_or_default();
    let net = String::from_utf8_lossy(parts.next().unwrap_or_default());
    if let Some(process) = vm_process(42, stat, &status, cmdline, boot) {
        assert_eq!(process.pid, 42);
    }
    for v6 in [false, true] {
        for (port, _inode) in vm_listening(&net, v6) {
            assert!(!port.address.is_empty());
        }
    }
});
