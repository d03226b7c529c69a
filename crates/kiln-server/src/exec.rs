//! Running code in a sandbox: the one path every face (the published contract, /api/v1,
//! streaming, WebSocket) goes through. It marks the sandbox busy, writes uploaded files,
//! runs the code in a worker (one-shot or a session turn), records the workspace change as a
//! git commit, and counts the execution.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use axum::http::StatusCode;
use kiln_core::{ExecRequest, ExecResult, Language, Limits, Outcome};
use kiln_executor::{CallOptions, Chunk, PoolError};
use serde_json::json;
use tokio::sync::mpsc;

use crate::AppState;
use crate::auth::Caller;
use crate::error::ApiError;
use crate::sandbox::{Sandbox, now_ms};

/// Longest single execution: 5 minutes (bounded by the sandbox's remaining lifetime).
pub const MAX_EXEC_MS: u64 = 5 * 60 * 1000;

/// What to run.
#[derive(Debug)]
pub struct RunSpec {
    /// The id this execution is known by (history, cancel, results).
    pub exec_id: String,
    pub language: Language,
    pub code: String,
    pub stdin: Vec<u8>,
    pub env: Vec<(String, String)>,
    /// Per-execution time limit; default (and most) the sandbox's remaining life, at most
    /// [`MAX_EXEC_MS`].
    pub timeout_ms: Option<u64>,
    /// Files to write into the workspace first (already checked paths).
    pub files: Vec<(PathBuf, Vec<u8>)>,
    /// Run the program in this workspace file instead of `code` (read once the sandbox is
    /// busy with this run).
    pub code_file: Option<(String, PathBuf)>,
    /// Run as a turn of this session instead of a fresh one-shot.
    pub session: Option<String>,
    /// The history message.
    pub summary: String,
    /// Told once the sandbox is busy with this run (from then on a cancel reaches it).
    pub begun: Option<tokio::sync::oneshot::Sender<()>>,
}

/// What a run produced.
#[derive(Debug)]
pub struct RunOutcome {
    pub exec_id: String,
    pub result: ExecResult,
    pub limits: Limits,
    /// The commit recording the files it changed, if any.
    pub commit_id: Option<String>,
}

impl RunOutcome {
    /// `success`, `error` or `timeout`.
    pub fn status(&self) -> &'static str {
        match self.result.outcome {
            Outcome::TimedOut => "timeout",
            _ if self.result.success() => "success",
            _ => "error",
        }
    }

    /// stderr with kiln's one-line reason appended for ends that were not the guest's own.
    pub fn stderr_with_reason(&self) -> String {
        let mut stderr = self.result.stderr_text();
        if let Some(reason) = self.result.outcome.reason(&self.limits) {
            stderr.push_str(&format!("kiln: {reason}\n"));
        }
        stderr
    }
}

fn write_error(path: &std::path::Path, error: &std::io::Error) -> ApiError {
    ApiError::bad_request(
        "FILE_WRITE_FAILED",
        format!("could not write {}: {error}", path.display()),
    )
}

/// Writes files into a workspace, durably.
pub fn write_files(
    workspace: &std::path::Path,
    files: &[(PathBuf, Vec<u8>)],
) -> Result<(), ApiError> {
    for (target, content) in files {
        crate::sandbox::check_no_links(workspace, target)?;
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).map_err(|e| write_error(target, &e))?;
        }
        if target.is_dir() {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "PATH_IS_A_DIRECTORY",
                format!("{} is a folder", target.display()),
            ));
        }
        crate::store::write_atomic(target, content).map_err(|e| write_error(target, &e))?;
    }
    Ok(())
}

/// Maps a pool failure onto the API.
pub fn pool_error(error: PoolError) -> ApiError {
    match error {
        PoolError::WorkerLost(detail) => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "EXECUTOR_LOST",
            format!("the executor running this code died ({detail}); it has been replaced, retry"),
        ),
        PoolError::Remote(remote) if remote.kind == "busy" => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "BUSY", remote.message)
        }
        PoolError::Remote(remote) if remote.kind == "cancelled" => ApiError::new(
            StatusCode::CONFLICT,
            "EXECUTION_CANCELLED",
            "the execution was cancelled",
        ),
        PoolError::Remote(remote) if remote.kind == "session_ended" => ApiError::new(
            StatusCode::CONFLICT,
            "SESSION_ENDED",
            format!("{}; restart the session", remote.message),
        ),
        PoolError::Remote(remote)
            if remote.kind == "limits" || remote.kind == "too_large" || remote.kind == "grant" =>
        {
            ApiError::bad_request("INVALID_REQUEST", remote.message)
        }
        other => ApiError::internal(other.to_string()),
    }
}

/// Runs `work` to its end even if the request that started it goes away: a client that
/// disconnects or a request timeout must not leave a sandbox marked busy or a change
/// unrecorded.
pub async fn detached<T: Send + 'static>(
    work: impl Future<Output = Result<T, ApiError>> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::spawn(work)
        .await
        .map_err(|e| ApiError::internal(format!("a background task failed: {e}")))?
}

/// Creates a sandbox off the async threads (git init and fsyncs block), to its end even if
/// the request goes away.
pub async fn create_sandbox(
    state: &Arc<AppState>,
    tenant: &str,
    image: &str,
    language: kiln_core::Language,
    lifetime_ms: u64,
    memory_bytes: u64,
) -> Result<crate::sandbox::Sandbox, ApiError> {
    let (state, tenant, image) = (state.clone(), tenant.to_owned(), image.to_owned());
    detached(async move {
        tokio::task::spawn_blocking(move || {
            state
                .registry
                .create(&tenant, &image, language, lifetime_ms, memory_bytes)
        })
        .await
        .map_err(|e| ApiError::internal(format!("a background task failed: {e}")))?
    })
    .await
}

/// Creates a sandbox with the default lifetime and memory.
pub async fn create_default_sandbox(
    state: &Arc<AppState>,
    tenant: &str,
    language: kiln_core::Language,
) -> Result<crate::sandbox::Sandbox, ApiError> {
    create_sandbox(
        state,
        tenant,
        language.name(),
        language,
        crate::api::DEFAULT_LIFETIME_MS,
        Limits::default().memory_bytes,
    )
    .await
}

/// Runs `spec` in sandbox `id` of `caller`, streaming output to `chunks` if given. The run
/// goes on to its end (and is recorded) even if the caller stops waiting.
pub async fn run(
    state: &Arc<AppState>,
    caller: &Caller,
    id: &str,
    spec: RunSpec,
    chunks: Option<mpsc::UnboundedSender<Chunk>>,
) -> Result<RunOutcome, ApiError> {
    let (state, caller, id) = (state.clone(), caller.clone(), id.to_owned());
    detached(async move { run_attached(&state, &caller, &id, spec, chunks).await }).await
}

async fn run_attached(
    state: &AppState,
    caller: &Caller,
    id: &str,
    mut spec: RunSpec,
    chunks: Option<mpsc::UnboundedSender<Chunk>>,
) -> Result<RunOutcome, ApiError> {
    let (sandbox, cancel) = state.registry.begin(&caller.tenant, id, &spec.exec_id)?;
    if let Some(begun) = spec.begun.take() {
        let _ = begun.send(());
    }
    let started = Instant::now();
    let ran = run_in(state, &sandbox, &spec, chunks, cancel).await;
    let ran_at = started.elapsed();
    // Record what the code did to the workspace, whatever the outcome (a timed-out run may
    // still have written files).
    let workspace = sandbox.clone();
    let summary = spec.summary.clone();
    let exec_id = spec.exec_id.clone();
    let commit = tokio::task::spawn_blocking(move || {
        workspace
            .history()?
            .commit_if_changed(&summary, &exec_id)
            .map_err(crate::sandbox::history_error)
    })
    .await
    .unwrap_or_else(|e| Err(ApiError::internal(format!("history task failed: {e}"))));
    let committed_at = started.elapsed();
    let duration_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    let executed = ran.as_ref().ok().map(|_| duration_ms);
    state.registry.finish(&sandbox.id, executed)?;
    tracing::debug!(
        target: "kiln::timing",
        exec_id = %spec.exec_id,
        run_ms = ran_at.as_secs_f64() * 1000.0,
        guest_ms = ran.as_ref().map_or(0.0, |(r, _)| r.duration_us as f64 / 1000.0),
        commit_ms = (committed_at - ran_at).as_secs_f64() * 1000.0,
        finish_ms = (started.elapsed() - committed_at).as_secs_f64() * 1000.0,
        "execution phases"
    );
    let (result, limits) = ran?;
    state.metrics.execution(sandbox.language, &result);
    Ok(RunOutcome {
        exec_id: spec.exec_id,
        result,
        limits,
        commit_id: commit?,
    })
}

async fn run_in(
    state: &AppState,
    sandbox: &Sandbox,
    spec: &RunSpec,
    chunks: Option<mpsc::UnboundedSender<Chunk>>,
    cancel: tokio::sync::oneshot::Receiver<()>,
) -> Result<(ExecResult, Limits), ApiError> {
    write_files(&sandbox.workspace(), &spec.files)?;
    let code = match &spec.code_file {
        None => spec.code.clone(),
        Some((name, path)) => {
            crate::sandbox::check_no_links(&sandbox.workspace(), path)?;
            std::fs::read_to_string(path).map_err(|e| {
                ApiError::bad_request(
                    "FILE_NOT_FOUND",
                    format!("cannot run {name:?}: {e} (send it in `files` first)"),
                )
                .with_details(json!({ "path": name }))
            })?
        }
    };
    let remaining_ms = sandbox.expires_ms.saturating_sub(now_ms()).max(1);
    let mut limits = Limits {
        memory_bytes: sandbox.memory_bytes,
        timeout_ms: remaining_ms.min(MAX_EXEC_MS),
        ..Limits::default()
    };
    if let Some(timeout_ms) = spec.timeout_ms {
        limits.timeout_ms = limits.timeout_ms.min(timeout_ms.max(1));
    }
    let options = CallOptions {
        chunks,
        cancel: Some(cancel),
        door: None,
    };
    let result = match &spec.session {
        None => {
            let mut request = ExecRequest::new(spec.language, code);
            request.workspace = Some(sandbox.workspace());
            request.stdin = spec.stdin.clone();
            request.env = spec.env.clone();
            request.limits = limits.clone();
            state.pool.execute_with(request, options).await
        }
        Some(session) => {
            let (_, handle) = state
                .registry
                .session(&sandbox.tenant, &sandbox.id, session)?;
            let Some(handle) = handle else {
                return Err(session_lost(&sandbox.id, session));
            };
            let ran = state
                .pool
                .run_with(&handle, code, limits.clone(), options)
                .await;
            match &ran {
                Ok(result) if result.outcome.ran_to_end() => {
                    state.registry.count_turn(&sandbox.id, session);
                }
                // A turn that timed out, crashed, was cancelled or lost its worker ended the
                // session's state.
                _ => {
                    if let Some(handle) = state.registry.drop_session_state(&sandbox.id, session) {
                        let _ = state.pool.close_session(&handle).await;
                    }
                }
            }
            ran
        }
    };
    let result = result.map_err(pool_error)?;
    Ok((result, limits))
}

/// The error for a session whose live state is gone.
pub fn session_lost(id: &str, session: &str) -> ApiError {
    ApiError::new(
        StatusCode::CONFLICT,
        "SESSION_ENDED",
        format!(
            "session {session} of sandbox {id} has no live state (it timed out, crashed, was cancelled, or the server restarted); restart it"
        ),
    )
    .with_details(json!({ "containerId": id, "sessionId": session }))
}
