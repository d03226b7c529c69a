//! The backend seam: what every kind of sandbox (wasm today; native Linux boxes and microVMs
//! next) implements, so the worker process and everything above it stay the same.
//!
//! A backend runs [`ExecRequest`]s — code in a language, or a [`Command`] where the template
//! can run one — either once ([`Backend::run_once`]) or as turns of a stateful session
//! ([`Backend::open_session`], [`BackendSession::run`]). Output goes to an optional
//! [`OutputSink`] as the guest writes it; a session turn may be granted a [`Door`].
//!
//! The worker is generic over the backend (monomorphised: no boxing on the hot path).
//! `kiln_wasm::WasmEngine` is the first implementation; `kiln_executor::fake::FakeBackend`
//! is the in-process test double.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use serde::{Deserialize, Serialize};

use crate::template::TemplateInfo;
use crate::{ExecRequest, ExecResult, Limits};

/// Which stream a chunk came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StreamKind {
    Stdout,
    Stderr,
    /// A rich result ([`crate::RichResult`]) as JSON, one per chunk.
    Display,
}

/// A piece of output as the guest wrote it, for streaming to a client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputChunk {
    pub stream: StreamKind,
    pub data: bytes::Bytes,
}

/// Where a backend sends output as it is written.
pub type OutputSink = tokio::sync::mpsc::UnboundedSender<OutputChunk>;

/// What a door answers: the reply frame, or a fault (the guest sees `OSError`).
pub type DoorFuture = Pin<Box<dyn Future<Output = Result<Vec<u8>, String>> + Send>>;

/// A capability the host grants a guest for one session turn. The guest reaches it with
/// `_host.call(frame) -> bytes`; frames are opaque bytes, checked by whoever grants the door.
/// A turn without a grant finds the door shut (`ConnectionRefusedError`).
pub type Door = Arc<dyn Fn(Vec<u8>) -> DoorFuture + Send + Sync>;

/// Why a backend refused or failed a request. Its kind crosses the worker wire as text
/// ([`ErrorKind::as_str`]); faces map kinds onto their own error shapes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct BackendError {
    pub kind: ErrorKind,
    pub message: String,
}

impl BackendError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> BackendError {
        BackendError {
            kind,
            message: message.into(),
        }
    }

    /// The template cannot do what the request asks (a command on a code-only template).
    pub fn unsupported(message: impl Into<String>) -> BackendError {
        BackendError::new(ErrorKind::Unsupported, message)
    }
}

/// The kinds of [`BackendError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The backend is not ready (runtimes missing, a module that will not load).
    Setup,
    /// The request's limits are invalid.
    Limits,
    /// A grant (workspace, mount, environment) was refused.
    Grant,
    /// The code or request is larger than allowed.
    TooLarge,
    /// The session ended earlier (a limit, a crash); open a new one.
    SessionEnded,
    /// The backend has no room for another guest now.
    Busy,
    /// The guest could not be started.
    Instantiate,
    /// The template cannot do this.
    Unsupported,
}

impl ErrorKind {
    /// The kind's name on the worker wire.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Setup => "setup",
            ErrorKind::Limits => "limits",
            ErrorKind::Grant => "grant",
            ErrorKind::TooLarge => "too_large",
            ErrorKind::SessionEnded => "session_ended",
            ErrorKind::Busy => "busy",
            ErrorKind::Instantiate => "instantiate",
            ErrorKind::Unsupported => "unsupported",
        }
    }
}

/// A kind of sandbox. Implementations are cheap to clone (an `Arc` inside).
pub trait Backend: Clone + Send + Sync + 'static {
    /// A stateful session: a guest kept alive between turns.
    type Session: BackendSession;

    /// The templates this backend runs.
    fn templates(&self) -> Vec<TemplateInfo>;

    /// A flag the worker sets while requests wait for a turn of the CPU; a backend that
    /// can preempt its guests should then do so more often. `None`: it cannot.
    fn contention_flag(&self) -> Option<Arc<AtomicBool>> {
        None
    }

    /// Runs one request to its end in a fresh guest.
    fn run_once(
        &self,
        request: &ExecRequest,
        output: Option<OutputSink>,
    ) -> impl Future<Output = Result<ExecResult, BackendError>> + Send;

    /// Opens a session with the grants and limits of `request` (its code is not run).
    fn open_session(
        &self,
        request: ExecRequest,
    ) -> impl Future<Output = Result<Self::Session, BackendError>> + Send;
}

/// A session of a [`Backend`]: turns run one at a time, each seeing what earlier ones left.
pub trait BackendSession: Send + 'static {
    /// Runs one turn of `code` within `limits`. A turn that ends the session (a limit, a
    /// crash) answers its result; the next turn fails with [`ErrorKind::SessionEnded`].
    fn run(
        &mut self,
        code: &str,
        limits: &Limits,
        output: Option<OutputSink>,
        door: Option<Door>,
    ) -> impl Future<Output = Result<ExecResult, BackendError>> + Send;
}
