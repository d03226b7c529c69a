//! The worker side: serve requests from the pool until the pool closes the channel.
//!
//! A worker holds no secrets and no network connections: it only runs guests. Requests run
//! concurrently (each on its own task); a session's turns run one at a time.

use std::collections::HashMap;
use std::sync::Arc;

use kiln_wasm::{ExecError, Session, SessionOptions, WasmEngine};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{Mutex, mpsc};

use crate::protocol::{
    Op, RemoteError, Reply, Request, Response, encode, read_frame, write_encoded,
};

type Sessions = Arc<std::sync::Mutex<HashMap<u64, Arc<Mutex<Session>>>>>;

/// Maps an engine error to what crosses the wire.
pub fn remote_error(error: &ExecError) -> RemoteError {
    let kind = match error {
        ExecError::Engine(_) => "setup",
        ExecError::Limits(_) | ExecError::MemoryTooSmall { .. } => "limits",
        ExecError::Grant(_) => "grant",
        ExecError::CodeTooLarge { .. } | ExecError::RequestTooLarge { .. } => "too_large",
        ExecError::SessionEnded { .. } => "session_ended",
        ExecError::Busy { .. } => "busy",
        ExecError::Tmp(_) | ExecError::Instantiate { .. } => "instantiate",
    };
    RemoteError {
        kind: kind.into(),
        message: error.to_string(),
    }
}

/// The worker's stdin and stdout as non-blocking pipes driven by the reactor (tokio's own
/// `stdin()`/`stdout()` go through a blocking thread per read, which costs latency).
pub fn stdio_pipes() -> std::io::Result<(
    tokio::net::unix::pipe::Receiver,
    tokio::net::unix::pipe::Sender,
)> {
    use std::os::fd::{FromRawFd, OwnedFd};
    // SAFETY: fds 0 and 1 are open for the life of the worker and nothing else in the
    // process uses them once they are handed over here.
    let (stdin, stdout) = unsafe { (OwnedFd::from_raw_fd(0), OwnedFd::from_raw_fd(1)) };
    Ok((
        tokio::net::unix::pipe::Receiver::from_owned_fd(stdin)?,
        tokio::net::unix::pipe::Sender::from_owned_fd(stdout)?,
    ))
}

/// Serves requests read from `input`, writing responses to `output`, until `input` closes.
pub async fn serve<R, W>(engine: WasmEngine, mut input: R, mut output: W)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (tx, mut rx) = mpsc::unbounded_channel::<Response>();
    let writer = tokio::spawn(async move {
        while let Some(response) = rx.recv().await {
            let body = match encode(&response) {
                Ok(body) => body,
                // A reply too large for a frame fails alone, as a reply.
                Err(error) => {
                    let failed = Response {
                        id: response.id,
                        reply: Reply::Failed(RemoteError {
                            kind: "too_large".into(),
                            message: format!("the result could not be sent: {error}"),
                        }),
                    };
                    match encode(&failed) {
                        Ok(body) => body,
                        Err(_) => continue,
                    }
                }
            };
            if write_encoded(&mut output, &body).await.is_err() {
                break;
            }
        }
    });
    let sessions: Sessions = Arc::default();
    loop {
        let request: Request = match read_frame(&mut input).await {
            Ok(request) => request,
            Err(_) => break,
        };
        let engine = engine.clone();
        let sessions = sessions.clone();
        let tx = tx.clone();
        tokio::spawn(async move {
            let reply = handle(&engine, &sessions, request.op).await;
            let _ = tx.send(Response {
                id: request.id,
                reply,
            });
        });
    }
    drop(tx);
    let _ = writer.await;
}

async fn handle(engine: &WasmEngine, sessions: &Sessions, op: Op) -> Reply {
    match op {
        Op::Exec(request) => match engine.execute(&request).await {
            Ok(result) => Reply::Done(result),
            Err(error) => Reply::Failed(remote_error(&error)),
        },
        Op::OpenSession { session, request } => {
            let options = SessionOptions {
                env: request.env,
                workspace: request.workspace,
                mounts: request.mounts,
                limits: request.limits,
            };
            match engine.open_session(request.language, &options).await {
                Ok(opened) => {
                    sessions
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(session, Arc::new(Mutex::new(opened)));
                    Reply::Opened
                }
                Err(error) => Reply::Failed(remote_error(&error)),
            }
        }
        Op::Turn {
            session,
            code,
            limits,
        } => {
            let found = sessions
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&session)
                .cloned();
            let Some(found) = found else {
                return Reply::Failed(RemoteError {
                    kind: "no_such_session".into(),
                    message: format!("no session {session} on this worker"),
                });
            };
            let mut guard = found.lock().await;
            match guard.run(&code, &limits).await {
                Ok(result) => Reply::Done(result),
                Err(error) => Reply::Failed(remote_error(&error)),
            }
        }
        Op::CloseSession { session } => {
            sessions
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&session);
            Reply::Closed
        }
    }
}
