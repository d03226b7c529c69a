//! envd, E2B's in-sandbox daemon, as kiln answers it: `/health`, `/files` (download and
//! upload: multipart or octet-stream, gzip both ways, signed URLs) and the filesystem
//! service (Stat, ListDir, MakeDir, Move, Remove) over the sandbox's workspace, which its
//! code sees at `/home/user`. The process service is in [`super::process`].
//!
//! Paths are the sandbox's: absolute, or relative to `/home/user`. Only the workspace is
//! reachable through files; a path outside it is refused with the reason.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use base64::Engine;
use bytes::Bytes;
use kiln_runtime::files::{self, Described};
use kiln_runtime::sandbox::{Sandbox, rfc3339};
use kiln_workspace::Kind;
use serde::{Deserialize, Serialize};
use serde_json::json;
use sha2::{Digest, Sha256};

use super::connect::{self, RpcError};
use super::{E2b, HOME, Route, SandboxCtx, check_sandbox, error, message_of, status_of};
use crate::gate;

/// The largest upload: 64 MiB (the most one file the history records).
pub const MAX_UPLOAD_BYTES: usize = 64 << 20;

/// envd's routes.
pub fn router(e2b: Arc<E2b>) -> Router {
    Router::new()
        .route("/health", get(|| async { StatusCode::NO_CONTENT }))
        .route("/files", get(download).post(upload))
        .route("/filesystem.Filesystem/{method}", post(filesystem))
        .route("/process.Process/{method}", post(super::process::rpc))
        .fallback(|request: Request| async move {
            error(
                StatusCode::NOT_FOUND,
                format!(
                    "envd has no route {} {}",
                    request.method(),
                    request.uri().path()
                ),
            )
        })
        .route_layer(from_fn_with_state("envd", super::label))
        .with_state(e2b.clone())
        // The key's rate limit, as on /api/v1 (authenticate runs first and names the key).
        .layer(from_fn_with_state(e2b.app.clone(), gate::rate_limit))
        .layer(from_fn_with_state(e2b, authenticate))
}

/// Every route but `/health` needs the sandbox's token (or, for `/files`, a signature).
async fn authenticate(State(e2b): State<Arc<E2b>>, mut request: Request, next: Next) -> Response {
    let health = request.uri().path() == "/health";
    let query = request.uri().query().unwrap_or_default().to_owned();
    let method = request.method().clone();
    let files = request.uri().path() == "/files";
    let signed = |sandbox: &Sandbox| files && signature_ok(sandbox, &query, &method);
    if let Err(response) = check_sandbox(&e2b, &mut request, &["x-access-token"], signed) {
        // A gone sandbox is 502 on every route, health included.
        if !health || response.status() == StatusCode::BAD_GATEWAY {
            return refuse(request, response).await;
        }
    }
    if let Some(user) = asked_user(&request, &query)
        && user != "user"
    {
        let message = format!(
            "kiln's sandboxes run everything as \"user\"; running as {user:?} is not supported"
        );
        let response = if files {
            error(StatusCode::UNAUTHORIZED, message)
        } else {
            RpcError::new("permission_denied", message).unary()
        };
        return refuse(request, response).await;
    }
    next.run(request).await
}

/// Answers `response` after reading what the client is still sending (at most 1 MiB, for at
/// most 1 s): a refusal sent while the client writes its body makes the server close the
/// connection, and the client then reports a broken pipe instead of the refusal (E2B's
/// newest Python SDK did, for a command started as another user).
async fn refuse(request: Request, response: Response) -> Response {
    let body = axum::body::to_bytes(request.into_body(), 1 << 20);
    let _ = tokio::time::timeout(std::time::Duration::from_secs(1), body).await;
    response
}

/// The user a request asks to act as: Basic auth's user name (`user=` in the SDKs), or
/// `/files`'s `username`.
fn asked_user(request: &Request, query: &str) -> Option<String> {
    let basic = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Basic "))
        .and_then(|b| {
            base64::engine::general_purpose::STANDARD
                .decode(b.trim())
                .ok()
        })
        .and_then(|raw| String::from_utf8(raw).ok())
        .map(|pair| pair.split(':').next().unwrap_or_default().to_owned());
    basic.filter(|u| !u.is_empty()).or_else(|| {
        serde_urlencoded::from_str::<Vec<(String, String)>>(query)
            .ok()?
            .into_iter()
            .find(|(k, v)| k == "username" && !v.is_empty())
            .map(|(_, v)| v)
    })
}

/// Whether `query` carries a valid, unexpired v1 signature for its path and this method.
pub(crate) fn signature_ok(sandbox: &Sandbox, query: &str, method: &axum::http::Method) -> bool {
    let Ok(params) = serde_urlencoded::from_str::<Vec<(String, String)>>(query) else {
        return false;
    };
    let param = |name: &str| {
        params
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    let (Some(path), Some(signature), Some(token)) = (
        param("path"),
        param("signature"),
        sandbox.access_token.as_deref(),
    ) else {
        return false;
    };
    let operation = if method == axum::http::Method::GET {
        "read"
    } else {
        "write"
    };
    let user = param("username").unwrap_or_default();
    let mut raw = format!("{path}:{operation}:{user}:{token}");
    if let Some(expiration) = param("signature_expiration") {
        let Ok(at) = expiration.parse::<u64>() else {
            return false;
        };
        if at < kiln_runtime::sandbox::now_ms() / 1000 {
            return false;
        }
        raw.push_str(&format!(":{at}"));
    }
    let expected = format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(Sha256::digest(raw.as_bytes()))
    );
    super::same_secret(expected.as_bytes(), signature.as_bytes())
}

/// A sandbox path as a workspace path (`""`: the workspace itself), or why not.
pub fn workspace_rel(sandbox: &Sandbox, path: &str) -> Result<String, RpcError> {
    rel_under(sandbox.workspace_at.as_deref().unwrap_or(HOME), path)
}

/// `path` (absolute, relative to `home`, or `~/…`) as a path under `home` (`""`: `home`
/// itself), or why not. (The fuzz target `files_paths` calls it.)
pub fn rel_under(home: &str, path: &str) -> Result<String, RpcError> {
    if path.contains('\0') || path.len() > 4096 {
        return Err(RpcError::invalid(
            "the path is longer than 4096 bytes or holds NUL",
        ));
    }
    let full = if path.starts_with('/') {
        path.to_owned()
    } else if let Some(rest) = path.strip_prefix('~') {
        format!("{home}{rest}")
    } else {
        format!("{home}/{path}")
    };
    let mut parts: Vec<&str> = Vec::new();
    for part in full.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            other => parts.push(other),
        }
    }
    let normal = format!("/{}", parts.join("/"));
    if normal == home {
        return Ok(String::new());
    }
    match normal.strip_prefix(home).and_then(|r| r.strip_prefix('/')) {
        Some(rel) => Ok(rel.to_owned()),
        None => Err(RpcError::new(
            "permission_denied",
            format!(
                "{normal} is outside {home}: kiln's E2B sandboxes reach files in their workspace, {home}, only"
            ),
        )),
    }
}

/// The sandbox path of a workspace path.
fn sandbox_path(sandbox: &Sandbox, rel: &str) -> String {
    let home = sandbox.workspace_at.as_deref().unwrap_or(HOME);
    if rel.is_empty() {
        home.to_owned()
    } else {
        format!("{home}/{rel}")
    }
}

/// envd's `EntryInfo`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EntryInfo {
    name: String,
    #[serde(rename = "type")]
    kind: &'static str,
    path: String,
    #[serde(with = "connect::int64")]
    size: u64,
    mode: u32,
    permissions: String,
    owner: &'static str,
    group: &'static str,
    modified_time: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    symlink_target: Option<String>,
}

/// `ls -l`'s permission text of a mode.
fn permissions(kind: Kind, mode: u32) -> String {
    let mut text = String::with_capacity(10);
    text.push(match kind {
        Kind::Dir => 'd',
        Kind::Symlink => 'l',
        _ => '-',
    });
    for shift in [6, 3, 0] {
        let bits = (mode >> shift) & 7;
        text.push(if bits & 4 != 0 { 'r' } else { '-' });
        text.push(if bits & 2 != 0 { 'w' } else { '-' });
        text.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    text
}

pub fn entry_info(sandbox: &Sandbox, described: &Described) -> EntryInfo {
    let path = sandbox_path(sandbox, &described.path);
    let meta = &described.meta;
    EntryInfo {
        name: path.rsplit('/').next().unwrap_or_default().to_owned(),
        kind: match meta.kind {
            Kind::Dir => "FILE_TYPE_DIRECTORY",
            Kind::Symlink => "FILE_TYPE_SYMLINK",
            Kind::File => "FILE_TYPE_FILE",
            _ => "FILE_TYPE_UNSPECIFIED",
        },
        path,
        size: meta.size,
        mode: meta.mode & 0o7777,
        permissions: permissions(meta.kind, meta.mode),
        owner: "user",
        group: "user",
        modified_time: rfc3339(u64::try_from(meta.mtime_ns / 1_000_000).unwrap_or(0)),
        symlink_target: described.link.clone(),
    }
}

#[derive(Debug, Deserialize)]
struct PathRequest {
    #[serde(default)]
    path: String,
    #[serde(default)]
    depth: Option<u32>,
}

#[derive(Debug, Deserialize)]
struct MoveRequest {
    #[serde(default)]
    source: String,
    #[serde(default)]
    destination: String,
}

/// `POST /filesystem.Filesystem/{method}`.
async fn filesystem(
    State(e2b): State<Arc<E2b>>,
    axum::extract::Path(method): axum::extract::Path<String>,
    axum::Extension(ctx): axum::Extension<SandboxCtx>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if method == "WatchDir" {
        let keepalive = headers
            .get("keepalive-ping-interval")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(std::time::Duration::from_secs(50), |s| {
                std::time::Duration::from_secs(s.clamp(1, 3600))
            });
        return super::watch::stream(e2b, ctx, &body, keepalive).await;
    }
    if connect::is_streaming(&headers) {
        return connect::stream_error(RpcError::new(
            "unimplemented",
            format!("filesystem.Filesystem/{method} is not a streaming call"),
        ));
    }
    connect::unary(filesystem_call(&e2b, &ctx, &method, &body).await)
}

async fn filesystem_call(
    e2b: &E2b,
    ctx: &SandboxCtx,
    method: &str,
    body: &[u8],
) -> Result<serde_json::Value, RpcError> {
    let rt = &e2b.app.runtime;
    let (caller, id, sandbox) = (&ctx.caller, ctx.id(), &ctx.sandbox);
    match method {
        "Stat" => {
            let asked: PathRequest = connect::decode(body, false)?;
            let rel = workspace_rel(sandbox, &asked.path)?;
            let found = files::describe(rt, caller, id, rel)
                .await
                .map_err(|e| not_found_as(e, &format!("path '{}' does not exist", asked.path)))?;
            Ok(json!({"entry": entry_info(sandbox, &found)}))
        }
        "ListDir" => {
            let asked: PathRequest = connect::decode(body, false)?;
            let rel = workspace_rel(sandbox, &asked.path)?;
            let depth = asked.depth.unwrap_or(1).clamp(1, 64) as usize;
            let all = files::entries(rt, caller, id, rel, depth)
                .await
                .map_err(|e| {
                    not_found_as(e, &format!("directory '{}' does not exist", asked.path))
                })?;
            let entries: Vec<EntryInfo> = all.iter().map(|d| entry_info(sandbox, d)).collect();
            Ok(json!({"entries": entries}))
        }
        "MakeDir" => {
            let asked: PathRequest = connect::decode(body, false)?;
            let rel = workspace_rel(sandbox, &asked.path)?;
            if !files::make_dir(rt, caller, id, rel.clone()).await? {
                return Err(RpcError::new(
                    "already_exists",
                    format!("directory '{}' already exists", asked.path),
                ));
            }
            let made = files::describe(rt, caller, id, rel).await?;
            Ok(json!({"entry": entry_info(sandbox, &made)}))
        }
        "Move" => {
            let asked: MoveRequest = connect::decode(body, false)?;
            let from = workspace_rel(sandbox, &asked.source)?;
            let to = workspace_rel(sandbox, &asked.destination)?;
            let moved = files::rename(rt, caller, id, from, to)
                .await
                .map_err(|e| not_found_as(e, &format!("path '{}' does not exist", asked.source)))?;
            Ok(json!({"entry": entry_info(sandbox, &moved)}))
        }
        "Remove" => {
            let asked: PathRequest = connect::decode(body, false)?;
            let rel = workspace_rel(sandbox, &asked.path)?;
            if rel.is_empty() {
                return Err(RpcError::invalid(
                    "the home folder itself cannot be removed",
                ));
            }
            files::delete(rt, caller, id, rel)
                .await
                .map_err(|e| not_found_as(e, &format!("path '{}' does not exist", asked.path)))?;
            Ok(json!({}))
        }
        "CreateWatcher" | "GetWatcherEvents" | "RemoveWatcher" => {
            super::watch::unary(e2b, ctx, method, body).await
        }
        other => Err(RpcError::new(
            "unimplemented",
            format!("filesystem.Filesystem has no method {other}"),
        )),
    }
}

/// A runtime error, with "not found" said in the sandbox's own words.
fn not_found_as(e: kiln_runtime::RuntimeError, message: &str) -> RpcError {
    let error = RpcError::from(e);
    if error.code == "not_found" {
        RpcError::not_found(message)
    } else {
        error
    }
}

#[derive(Debug, Deserialize)]
struct FileQuery {
    path: Option<String>,
}

/// `GET /files?path=`: the file's bytes, streamed (gzip when asked for).
async fn download(
    State(e2b): State<Arc<E2b>>,
    axum::Extension(ctx): axum::Extension<SandboxCtx>,
    Query(query): Query<FileQuery>,
    headers: HeaderMap,
) -> Response {
    let Some(path) = query.path.filter(|p| !p.is_empty()) else {
        return error(StatusCode::BAD_REQUEST, "path is required");
    };
    let rel = match workspace_rel(&ctx.sandbox, &path) {
        Ok(rel) => rel,
        Err(e) => return error(e.status(), e.message),
    };
    let opened = files::open(&e2b.app.runtime, &ctx.caller, ctx.id(), rel).await;
    let (file, size) = match opened {
        Ok(opened) => opened,
        Err(e) => return file_error(e, &path),
    };
    let file = tokio::io::AsyncReadExt::take(tokio::fs::File::from_std(file), size);
    let gzip = headers
        .get(header::ACCEPT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|e| e.trim().starts_with("gzip")));
    if gzip {
        return (
            [
                (header::CONTENT_TYPE, "application/octet-stream"),
                (header::CONTENT_ENCODING, "gzip"),
            ],
            axum::body::Body::from_stream(gzip_stream(file)),
        )
            .into_response();
    }
    let chunks = crate::v1::file_chunks(file);
    (
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_owned()),
            (header::CONTENT_LENGTH, size.to_string()),
        ],
        axum::body::Body::from_stream(chunks),
    )
        .into_response()
}

/// A file read and gzipped a chunk at a time.
fn gzip_stream(
    file: impl tokio::io::AsyncRead + Unpin + Send + 'static,
) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> + Send {
    use flate2::write::GzEncoder;
    use std::io::Write;
    let encoder = Some(GzEncoder::new(Vec::new(), flate2::Compression::fast()));
    futures::stream::try_unfold((file, encoder), |(mut file, encoder)| async move {
        let Some(mut encoder) = encoder else {
            return Ok(None);
        };
        let mut buf = vec![0u8; 64 * 1024];
        let n = tokio::io::AsyncReadExt::read(&mut file, &mut buf).await?;
        if n == 0 {
            let rest = encoder.finish()?;
            return Ok(Some((Bytes::from(rest), (file, None))));
        }
        encoder.write_all(&buf[..n])?;
        let out = std::mem::take(encoder.get_mut());
        Ok(Some((Bytes::from(out), (file, Some(encoder)))))
    })
}

/// A runtime failure of `/files`, as envd says it: a missing path or a folder in envd's own
/// words, the rest as the facade says it ([`status_of`]).
fn file_error(e: kiln_runtime::RuntimeError, path: &str) -> Response {
    let message = match e.code() {
        "FILE_NOT_FOUND" => format!("path '{path}' does not exist"),
        "PATH_IS_A_DIRECTORY" => format!("path '{path}' is a directory"),
        _ => message_of(&e, Route::Files),
    };
    error(status_of(&e, Route::Files), message)
}

/// `POST /files`: multipart (each part's file name its path) or one octet-stream body
/// (`?path=`), gzip-encoded or not. Answers what was written.
async fn upload(
    State(e2b): State<Arc<E2b>>,
    axum::Extension(ctx): axum::Extension<SandboxCtx>,
    Query(query): Query<FileQuery>,
    request: Request,
) -> Response {
    let headers = request.headers().clone();
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let gzip = headers
        .get(header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("gzip"));
    let body = request.into_body();
    let written = if content_type.starts_with("multipart/form-data") {
        match upload_parts(&e2b, &ctx, &content_type, query.path.clone(), body).await {
            Ok(written) => written,
            Err(response) => return response,
        }
    } else {
        let Some(path) = query.path.clone().filter(|p| !p.is_empty()) else {
            return error(
                StatusCode::BAD_REQUEST,
                "path is required for an octet-stream upload",
            );
        };
        let data = match read_body(body, gzip).await {
            Ok(data) => data,
            Err(response) => return response,
        };
        match write_one(&e2b, &ctx, &path, data).await {
            Ok(info) => vec![info],
            Err(response) => return response,
        }
    };
    if written.is_empty() {
        return error(StatusCode::BAD_REQUEST, "the upload holds no file");
    }
    axum::Json(written).into_response()
}

/// Writes each file part of a multipart body (its file name is its path; `path` for one
/// without); answers what was written.
async fn upload_parts(
    e2b: &E2b,
    ctx: &SandboxCtx,
    content_type: &str,
    path: Option<String>,
    body: axum::body::Body,
) -> Result<Vec<serde_json::Value>, Response> {
    let mut parts = kiln_http::upload::Parts::new(
        content_type,
        body.into_data_stream(),
        path,
        MAX_UPLOAD_BYTES,
    )
    .map_err(upload_error)?;
    let mut written = Vec::new();
    while let Some((name, data)) = parts.next_file().await.map_err(upload_error)? {
        written.push(write_one(e2b, ctx, &name, data).await?);
    }
    Ok(written)
}

fn upload_error(refused: kiln_http::upload::UploadError) -> Response {
    match refused {
        kiln_http::upload::UploadError::TooLarge => too_large(),
        other => error(StatusCode::BAD_REQUEST, other.to_string()),
    }
}

fn too_large() -> Response {
    error(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!(
            "a file is larger than {} MiB, the most one upload writes",
            MAX_UPLOAD_BYTES >> 20
        ),
    )
}

/// A body's bytes (gunzipped when `gzip`), at most [`MAX_UPLOAD_BYTES`].
async fn read_body(body: axum::body::Body, gzip: bool) -> Result<Vec<u8>, Response> {
    use futures::StreamExt;
    let mut stream = body.into_data_stream();
    let mut raw = Vec::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk
            .map_err(|e| error(StatusCode::BAD_REQUEST, format!("the body broke off: {e}")))?;
        if raw.len() + chunk.len() > MAX_UPLOAD_BYTES {
            return Err(too_large());
        }
        raw.extend_from_slice(&chunk);
    }
    if !gzip {
        return Ok(raw);
    }
    tokio::task::spawn_blocking(move || {
        kiln_http::upload::gunzip_limited(&raw, MAX_UPLOAD_BYTES).map_err(upload_error)
    })
    .await
    .map_err(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "decompression failed"))?
}

async fn write_one(
    e2b: &E2b,
    ctx: &SandboxCtx,
    path: &str,
    data: Vec<u8>,
) -> Result<serde_json::Value, Response> {
    let rel = workspace_rel(&ctx.sandbox, path).map_err(|e| error(e.status(), e.message))?;
    if rel.is_empty() {
        return Err(error(
            StatusCode::BAD_REQUEST,
            format!("path '{path}' is a directory"),
        ));
    }
    files::write(&e2b.app.runtime, &ctx.caller, ctx.id(), rel.clone(), data)
        .await
        .map_err(|e| file_error(e, path))?;
    let full = sandbox_path(&ctx.sandbox, &rel);
    Ok(json!({
        "name": full.rsplit('/').next().unwrap_or_default(),
        "type": "file",
        "path": full,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sandbox() -> Sandbox {
        serde_json::from_value(json!({
            "id": "sb_1", "tenant": "t", "image": "base", "language": "python",
            "createdMs": 0, "expiresMs": 1, "memoryBytes": 1, "executions": 0, "cpuTimeMs": 0,
            "workspaceAt": "/home/user"
        }))
        .unwrap()
    }

    #[test]
    fn sandbox_paths_map_into_the_workspace_and_nowhere_else() {
        let s = sandbox();
        assert_eq!(workspace_rel(&s, "a.txt").unwrap(), "a.txt");
        assert_eq!(workspace_rel(&s, "/home/user/d/a.txt").unwrap(), "d/a.txt");
        assert_eq!(workspace_rel(&s, "/home/user").unwrap(), "");
        assert_eq!(workspace_rel(&s, "./d/../b").unwrap(), "b");
        assert_eq!(workspace_rel(&s, "~/x").unwrap(), "x");
        for outside in [
            "/etc/passwd",
            "../x",
            "/home/user/../../etc",
            "/home/username/x",
            "/tmp",
        ] {
            let e = workspace_rel(&s, outside).unwrap_err();
            assert_eq!(e.code, "permission_denied", "{outside}");
        }
        assert!(workspace_rel(&s, "a\0b").is_err());
    }

    #[test]
    fn permissions_read_like_ls() {
        assert_eq!(permissions(Kind::File, 0o644), "-rw-r--r--");
        assert_eq!(permissions(Kind::Dir, 0o755), "drwxr-xr-x");
        assert_eq!(permissions(Kind::Symlink, 0o777), "lrwxrwxrwx");
    }
}
