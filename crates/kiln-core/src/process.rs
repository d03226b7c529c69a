//! Live processes: programs that keep running in a sandbox while the client talks to them
//! (stdin, signals, a terminal's size) and that several clients may follow. The E2B facade's
//! process service stands on this seam; a backend whose sandboxes run real processes (Linux
//! boxes) implements [`ProcessHost`]. Unlike [`crate::backend::Backend::run_once`], a
//! process is not an execution with a result: it is started, followed and ended.

use std::future::Future;
use std::pin::Pin;

use crate::backend::BackendError;
use crate::{ExecRequest, TerminalSize};

/// A boxed future, for the object-safe traits below.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a process does, in order: output, then exactly one [`ProcessEvent::Exited`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProcessEvent {
    Stdout(bytes::Bytes),
    Stderr(bytes::Bytes),
    /// Output of a process on a terminal (stdout and stderr in one).
    Terminal(bytes::Bytes),
    /// It ended: its exit code, or the signal that killed it. Nothing follows.
    Exited {
        code: Option<i32>,
        signal: Option<i32>,
    },
}

/// What to start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessSpec {
    /// Program and arguments; never empty.
    pub argv: Vec<String>,
    /// Added to the sandbox's environment.
    pub env: Vec<(String, String)>,
    /// Default: where the sandbox's workspace is.
    pub cwd: Option<String>,
    /// Run on a terminal of this size.
    pub terminal: Option<TerminalSize>,
    /// Keep stdin open for [`Process::write_stdin`]; otherwise it reads end of file.
    pub stdin: bool,
}

/// A started process: its events come on the receiver handed out with it.
pub trait Process: Send + Sync {
    /// Its pid inside the sandbox.
    fn pid(&self) -> u32;
    /// Writes to its stdin (or terminal); `eof` closes stdin after `data`.
    fn write_stdin(&self, data: Vec<u8>, eof: bool) -> BoxFuture<'_, Result<(), BackendError>>;
    /// Sends a signal to its process group.
    fn signal(&self, signal: i32) -> BoxFuture<'_, Result<(), BackendError>>;
    /// Resizes its terminal.
    fn resize(&self, size: TerminalSize) -> BoxFuture<'_, Result<(), BackendError>>;
}

/// The events of a started process.
pub type ProcessEvents = tokio::sync::mpsc::UnboundedReceiver<ProcessEvent>;

/// A started process and its events.
pub type Started = (Box<dyn Process>, ProcessEvents);

/// What a sandbox's box uses now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BoxUsage {
    /// CPU time used since the box started, in microseconds.
    pub cpu_us: u64,
    /// Memory in use, in bytes.
    pub memory_bytes: u64,
}

/// A backend that starts live processes in a sandbox. `request` carries the sandbox: its
/// template, workspace (and where the guest sees it), network, resources and memory limit;
/// its code is not used.
pub trait ProcessHost: Send + Sync + 'static {
    fn start<'a>(
        &'a self,
        request: &'a ExecRequest,
        spec: ProcessSpec,
    ) -> BoxFuture<'a, Result<Started, BackendError>>;

    /// What the live box of `workspace` uses now; `None` when none runs.
    fn usage<'a>(&'a self, workspace: &'a std::path::Path) -> BoxFuture<'a, Option<BoxUsage>>;
}

impl std::fmt::Debug for dyn ProcessHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ProcessHost")
    }
}
