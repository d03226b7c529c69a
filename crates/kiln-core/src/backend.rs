//! The backend seam: what every kind of sandbox (wasm today; native Linux boxes and microVMs
//! next) implements, so the worker process and everything above it stay the same.
//!
//! A backend runs [`ExecRequest`]s — code in a language, or a [`Command`] where the template
//! can run one — either once ([`Backend::run_once`]) or as turns of a stateful session
//! ([`Backend::open_session`], [`BackendSession::run`]), which a backend may fork
//! ([`Backend::fork_session`]). Output goes to an optional [`OutputSink`] as the guest
//! writes it; a session turn may be granted a [`Door`].
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
    /// The guest died while it ran the request (its box or VM ended under it: killed,
    /// a kernel panic); the next request starts a new one.
    Lost,
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
            ErrorKind::Lost => "lost",
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

    /// Opens a session that starts with `parent`'s state (its variables and imports), with
    /// the grants and limits of `request` (its code is not run); `parent` goes on unchanged,
    /// and neither sees what the other does from then on. Default: refused with
    /// [`ErrorKind::Unsupported`], for backends whose sessions cannot be copied.
    fn fork_session(
        &self,
        parent: &mut Self::Session,
        request: ExecRequest,
    ) -> impl Future<Output = Result<Self::Session, BackendError>> + Send {
        let _ = (parent, request);
        std::future::ready(Err(BackendError::unsupported(
            "this template's sessions cannot be forked",
        )))
    }
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

#[cfg(test)]
mod tests {
    use std::task::{Context, Poll, Waker};

    use super::*;
    use crate::Language;

    /// A backend that only says what the trait's defaults do.
    #[derive(Clone)]
    struct Plain;

    struct PlainSession;

    impl BackendSession for PlainSession {
        async fn run(
            &mut self,
            _code: &str,
            _limits: &Limits,
            _output: Option<OutputSink>,
            _door: Option<Door>,
        ) -> Result<ExecResult, BackendError> {
            Err(BackendError::unsupported("no turns"))
        }
    }

    impl Backend for Plain {
        type Session = PlainSession;

        fn templates(&self) -> Vec<TemplateInfo> {
            Vec::new()
        }

        async fn run_once(
            &self,
            _request: &ExecRequest,
            _output: Option<OutputSink>,
        ) -> Result<ExecResult, BackendError> {
            Err(BackendError::unsupported("no runs"))
        }

        async fn open_session(&self, _request: ExecRequest) -> Result<PlainSession, BackendError> {
            Ok(PlainSession)
        }
    }

    #[test]
    fn a_backend_that_cannot_fork_refuses_as_unsupported() {
        let mut parent = PlainSession;
        let request = ExecRequest::new(Language::Python, "");
        let forked = std::pin::pin!(Plain.fork_session(&mut parent, request));
        let Poll::Ready(Err(error)) = forked.poll(&mut Context::from_waker(Waker::noop())) else {
            panic!("the default answers at once, with an error");
        };
        assert_eq!(
            error,
            BackendError::unsupported("this template's sessions cannot be forked")
        );
    }
}
