//! `kiln-guest`: the guest agent. It serves the host on its stdin and stdout until the host
//! closes the channel, then kills what it started and exits (as PID 1, ending the box).

use std::os::fd::FromRawFd;

fn main() {
    if std::env::args().nth(1).as_deref() == Some("--version") {
        println!(
            "kiln-guest {} (protocol {})",
            env!("CARGO_PKG_VERSION"),
            kiln_guest::proto::PROTOCOL_VERSION
        );
        return;
    }
    if std::env::args().nth(1).as_deref() == Some("--vsock") {
        // In a Firecracker VM: the host reaches the agent over vsock, one connection at a
        // time (a snapshot's clone gets a new one after its restore).
        let port = std::env::args()
            .nth(2)
            .and_then(|p| p.parse().ok())
            .unwrap_or(kiln_guest::vsock::AGENT_PORT);
        if let Err(e) = kiln_guest::vsock::serve(port) {
            eprintln!("kiln-guest: vsock port {port}: {e}");
            std::process::exit(1);
        }
        return;
    }
    // Unbuffered: the agent writes whole frames and flushes each.
    // SAFETY: fd 0 is open from the start (the host's channel), and this File becomes its only
    // owner: nothing else in the agent reads stdin or touches fd 0.
    let input = unsafe { std::fs::File::from_raw_fd(0) };
    // SAFETY: fd 1 likewise: open from the start (the host's channel) and owned by this File alone;
    // the agent prints nothing to stdout (only `--version` did, and it has returned), and its
    // messages go to stderr.
    let output = unsafe { std::fs::File::from_raw_fd(1) };
    if let Err(e) = kiln_guest::agent::serve(input, output) {
        eprintln!("kiln-guest: {e}");
        std::process::exit(1);
    }
}
