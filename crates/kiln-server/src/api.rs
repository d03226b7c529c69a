//! The published sandbox contract: `/api/sandbox` create, exec, get, delete. Handlers parse,
//! call the registry and the executor pool, and map the result.

use std::sync::Arc;

use axum::Json;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use kiln_core::{ExecRequest, Language, Limits, Outcome};
use kiln_executor::{ExecutorPool, PoolError};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::sandbox::{IMAGES, Registry, image_language, new_id, now_ms, rfc3339, workspace_path};

/// Shared state of the server.
pub struct AppState {
    pub registry: Registry,
    pub pool: ExecutorPool,
}

type Shared = State<Arc<AppState>>;

/// Default sandbox lifetime: 30 minutes.
pub const DEFAULT_LIFETIME_MS: u64 = 30 * 60 * 1000;
/// Longest sandbox lifetime: 24 hours.
pub const MAX_LIFETIME_MS: u64 = 24 * 3600 * 1000;
/// Longest single execution: 5 minutes (bounded by the sandbox's remaining lifetime).
pub const MAX_EXEC_MS: u64 = 5 * 60 * 1000;
/// Most bytes of files one exec may upload.
pub const MAX_FILES_BYTES: usize = 16 << 20;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateBody {
    pub image: String,
    #[serde(default)]
    pub options: CreateOptions,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct CreateOptions {
    /// Lifetime in milliseconds.
    pub timeout: Option<u64>,
    /// Memory cap, e.g. "512m".
    pub memory_limit: Option<String>,
    /// Accepted for compatibility; not enforced yet.
    pub cpu_limit: Option<Value>,
}

pub async fn create(
    State(state): Shared,
    body: Result<Json<CreateBody>, JsonRejection>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let Json(body) = body?;
    let Some(language) = image_language(&body.image) else {
        let available: Vec<&str> = IMAGES.iter().map(|(name, _)| *name).collect();
        return Err(ApiError::bad_request(
            "UNKNOWN_IMAGE",
            format!(
                "unknown image {:?}; available: {} (and python:TAG, node:TAG)",
                body.image,
                available.join(", ")
            ),
        )
        .with_details(json!({ "image": body.image, "available": available })));
    };
    let lifetime_ms = body.options.timeout.unwrap_or(DEFAULT_LIFETIME_MS);
    if lifetime_ms == 0 || lifetime_ms > MAX_LIFETIME_MS {
        return Err(ApiError::bad_request(
            "INVALID_OPTION",
            format!("options.timeout must be 1..={MAX_LIFETIME_MS} ms, got {lifetime_ms}"),
        ));
    }
    let memory_bytes = match &body.options.memory_limit {
        None => Limits::default().memory_bytes,
        Some(text) => kiln_core::parse_size(text)
            .ok()
            .filter(|b| (language.min_memory_bytes()..=4 << 30).contains(b))
            .ok_or_else(|| {
                ApiError::bad_request(
                    "INVALID_OPTION",
                    format!(
                        "options.memoryLimit {text:?} is not a size between {} MiB and 4 GiB (e.g. \"512m\")",
                        language.min_memory_bytes() >> 20
                    ),
                )
            })?,
    };
    let _ = body.options.cpu_limit;
    let sandbox = state
        .registry
        .create(&body.image, language, lifetime_ms, memory_bytes)?;
    Ok((
        StatusCode::CREATED,
        Json(json!({
            "containerId": sandbox.id,
            "status": "created",
            "createdAt": rfc3339(sandbox.created_ms),
            "expiresAt": rfc3339(sandbox.expires_ms),
        })),
    ))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ExecBody {
    pub container_id: String,
    #[serde(default)]
    pub files: std::collections::BTreeMap<String, String>,
    pub command: Vec<String>,
}

/// What a command asks to run.
enum Program {
    File(String),
    Inline(String),
}

fn parse_command(command: &[String]) -> Result<(Language, Program), ApiError> {
    let unsupported = || {
        ApiError::bad_request(
            "UNSUPPORTED_COMMAND",
            format!(
                "unsupported command {command:?}; use [\"python\", FILE], [\"python\", \"-c\", CODE], [\"node\", FILE] or [\"node\", \"-e\", CODE]"
            ),
        )
    };
    let (program, rest) = command.split_first().ok_or_else(unsupported)?;
    let language = match program.as_str() {
        "python" | "python3" => Language::Python,
        "node" | "nodejs" => Language::JavaScript,
        _ => return Err(unsupported()),
    };
    let inline_flag = match language {
        Language::Python => "-c",
        Language::JavaScript => "-e",
    };
    match rest {
        [flag, code] if flag == inline_flag => Ok((language, Program::Inline(code.clone()))),
        [file] if !file.starts_with('-') => Ok((language, Program::File(file.clone()))),
        _ => Err(unsupported()),
    }
}

pub async fn exec(
    State(state): Shared,
    body: Result<Json<ExecBody>, JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    let Json(body) = body?;
    let (language, program) = parse_command(&body.command)?;
    let sandbox = state.registry.get(&body.container_id)?;
    if language != sandbox.language {
        return Err(ApiError::bad_request(
            "UNSUPPORTED_COMMAND",
            format!(
                "sandbox {} runs {} ({}); it cannot run {:?}",
                sandbox.id, sandbox.language, sandbox.image, body.command[0]
            ),
        ));
    }
    let total: usize = body.files.iter().map(|(k, v)| k.len() + v.len()).sum();
    if total > MAX_FILES_BYTES {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "FILES_TOO_LARGE",
            format!("the files total {total} bytes; the most is {MAX_FILES_BYTES}"),
        ));
    }
    let targets = body
        .files
        .keys()
        .map(|name| workspace_path(&sandbox.workspace, name))
        .collect::<Result<Vec<_>, _>>()?;

    let sandbox = state.registry.begin_exec(&sandbox.id)?;
    let outcome = run_exec(&state.pool, &sandbox, &body, &targets, language, program).await;
    let duration_ms = outcome.as_ref().map_or(0, |(_, ms)| *ms);
    state.registry.end_exec(&sandbox.id, duration_ms);
    outcome.map(|(value, _)| Json(value))
}

async fn run_exec(
    pool: &ExecutorPool,
    sandbox: &crate::sandbox::Sandbox,
    body: &ExecBody,
    targets: &[std::path::PathBuf],
    language: Language,
    program: Program,
) -> Result<(Value, u64), ApiError> {
    for ((_, content), target) in body.files.iter().zip(targets) {
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).map_err(|e| write_error(target, &e))?;
        }
        std::fs::write(target, content).map_err(|e| write_error(target, &e))?;
    }
    let code = match program {
        Program::Inline(code) => code,
        Program::File(name) => {
            let path = workspace_path(&sandbox.workspace, &name)?;
            std::fs::read_to_string(&path).map_err(|e| {
                ApiError::bad_request(
                    "FILE_NOT_FOUND",
                    format!("cannot run {name:?}: {e} (send it in `files` first)"),
                )
                .with_details(json!({ "path": name }))
            })?
        }
    };
    let remaining_ms = sandbox.expires_ms.saturating_sub(now_ms()).max(1);
    let mut request = ExecRequest::new(language, code);
    request.workspace = Some(sandbox.workspace.clone());
    request.limits.memory_bytes = sandbox.memory_bytes;
    request.limits.timeout_ms = remaining_ms.min(MAX_EXEC_MS);
    let limits = request.limits.clone();
    let result = pool.execute(request).await.map_err(pool_error)?;
    let status = match result.outcome {
        Outcome::TimedOut => "timeout",
        _ if result.success() => "success",
        _ => "error",
    };
    let duration_ms = result.duration_us / 1000;
    let mut stderr = result.stderr_text();
    // `reason` is None for a normal end; the message names the limits this exec really had.
    if let Some(reason) = result.outcome.reason(&limits) {
        stderr.push_str(&format!("kiln: {reason}\n"));
    }
    let prefix = match language {
        Language::Python => "python_run_",
        Language::JavaScript => "node_run_",
    };
    Ok((
        json!({
            "id": new_id(prefix),
            "status": status,
            "duration": duration_ms,
            "stdout": result.stdout_text(),
            "stderr": stderr,
            "exitCode": result.exit_code,
        }),
        duration_ms,
    ))
}

fn write_error(path: &std::path::Path, error: &std::io::Error) -> ApiError {
    ApiError::bad_request(
        "FILE_WRITE_FAILED",
        format!("could not write {}: {error}", path.display()),
    )
}

fn pool_error(error: PoolError) -> ApiError {
    match error {
        PoolError::WorkerLost(detail) => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "EXECUTOR_LOST",
            format!("the executor running this code died ({detail}); it has been replaced, retry"),
        ),
        PoolError::Remote(remote) if remote.kind == "busy" => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "BUSY", remote.message)
        }
        PoolError::Remote(remote) if remote.kind == "limits" || remote.kind == "too_large" => {
            ApiError::bad_request("INVALID_REQUEST", remote.message)
        }
        other => ApiError::internal(other.to_string()),
    }
}

pub async fn get(State(state): Shared, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let sandbox = state.registry.get(&id)?;
    Ok(Json(json!({
        "containerId": sandbox.id,
        "image": sandbox.image,
        "status": if sandbox.busy { "running" } else { "idle" },
        "createdAt": rfc3339(sandbox.created_ms),
        "expiresAt": rfc3339(sandbox.expires_ms),
        "resourceUsage": {
            "executions": sandbox.executions,
            "executionTimeMs": sandbox.cpu_time_ms,
            "memoryLimitBytes": sandbox.memory_bytes,
        },
    })))
}

pub async fn delete(State(state): Shared, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    state.registry.delete(&id)?;
    Ok(Json(json!({ "status": "deleted", "containerId": id })))
}

pub async fn healthz() -> Json<Value> {
    Json(json!({ "status": "ok" }))
}

pub async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "ROUTE_NOT_FOUND", "no such route")
}
