//! kiln's guest agent and the protocol the host speaks to it.
//!
//! The agent (the `kiln-guest` binary) is PID 1 in every Linux box: it reaps zombies,
//! forwards termination signals to the processes it started, and serves the host's framed
//! requests over one channel (its stdin and stdout): spawn a process (argv, environment,
//! working directory, user, optional terminal), its stdin, signals and terminal size, its
//! streamed output and exit status; file read, write, list, stat, make-dir, remove, rename;
//! and TCP connections to ports inside the box. Commands in a live box go through it: the
//! box's namespaces are set up once, when it starts, never per command.
//!
//! The host side lives in `kiln-native`; [`proto`] is the contract between them.

pub mod proto;

#[cfg(target_os = "linux")]
pub mod agent;
#[cfg(target_os = "linux")]
mod files;
#[cfg(target_os = "linux")]
pub mod vsock;
