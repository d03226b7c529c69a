//! Workspaces (`kiln_runtime::workspaces`): `POST`/`GET /api/v1/workspaces`, `GET`/`DELETE
//! /api/v1/workspaces/{workspace}`, `POST …/start`, `…/stop`, `…/services`, `…/sql`. A
//! workspace's files, history, processes, terminals and previews are its sandbox's
//! (`/api/v1/sandboxes/{sandboxId}/…`).

use axum::Json;
use axum::extract::rejection::PathRejection;
use axum::extract::{Extension, Path, State};
use axum::http::StatusCode;
use kiln_runtime::workspaces::{NewWorkspace, Service, SqlResult, WorkspaceInfo};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::v1::{Shared, path_error};

fn body<T>(body: Result<kiln_http::JsonObject<T>, kiln_http::HttpError>) -> Result<T, ApiError> {
    body.map(|kiln_http::JsonObject(b)| b)
        .map_err(ApiError::from)
}

/// Make a workspace: a long-lived Linux sandbox of its template (default `linux-services`)
/// with its services started.
#[utoipa::path(post, path = "/api/v1/workspaces", tag = "v1 workspaces",
    request_body = NewWorkspace,
    responses(
        (status = 201, description = "Made, its services running", body = WorkspaceInfo),
        (status = 400, description = "A bad name, an unknown service or template, or a service that did not start (its log's tail)", body = ErrorBody),
    ))]
pub async fn create(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    new: Result<kiln_http::JsonObject<NewWorkspace>, kiln_http::HttpError>,
) -> Result<(StatusCode, Json<WorkspaceInfo>), ApiError> {
    let new = body(new)?;
    let made = kiln_runtime::workspaces::create(&state.runtime, &caller, new).await?;
    Ok((StatusCode::CREATED, Json(made)))
}

/// The tenant's workspaces.
#[derive(Debug, Serialize, ToSchema)]
pub struct WorkspaceList {
    pub workspaces: Vec<WorkspaceInfo>,
}

/// List the tenant's workspaces, oldest first.
#[utoipa::path(get, path = "/api/v1/workspaces", tag = "v1 workspaces",
    responses((status = 200, description = "Its workspaces", body = WorkspaceList)))]
pub async fn list(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
) -> Json<WorkspaceList> {
    Json(WorkspaceList {
        workspaces: state.runtime.registry.workspaces.list_for(&caller),
    })
}

/// One workspace, by id or name.
#[utoipa::path(get, path = "/api/v1/workspaces/{workspace}", tag = "v1 workspaces",
    params(("workspace" = String, Path, description = "Its id (`ws_…`) or name")),
    responses(
        (status = 200, description = "The workspace", body = WorkspaceInfo),
        (status = 404, description = "No such workspace", body = ErrorBody),
    ))]
pub async fn get(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    which: Result<Path<String>, PathRejection>,
) -> Result<Json<WorkspaceInfo>, ApiError> {
    let Path(which) = which.map_err(path_error)?;
    Ok(Json(state.runtime.registry.workspaces.get_as(
        &caller,
        &which,
        kiln_runtime::workspaces::Need::Read,
    )?))
}

/// Delete a workspace with its sandbox: its files, history and service data.
#[utoipa::path(delete, path = "/api/v1/workspaces/{workspace}", tag = "v1 workspaces",
    params(("workspace" = String, Path, description = "Its id or name")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, description = "No such workspace", body = ErrorBody),
    ))]
pub async fn delete(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    which: Result<Path<String>, PathRejection>,
) -> Result<StatusCode, ApiError> {
    let Path(which) = which.map_err(path_error)?;
    kiln_runtime::workspaces::delete(&state.runtime, &caller, &which).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Start a workspace: its box (restored if it was stopped) and every service of it.
#[utoipa::path(post, path = "/api/v1/workspaces/{workspace}/start", tag = "v1 workspaces",
    params(("workspace" = String, Path, description = "Its id or name")),
    responses(
        (status = 200, description = "Running", body = WorkspaceInfo),
        (status = 404, description = "No such workspace", body = ErrorBody),
    ))]
pub async fn start(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    which: Result<Path<String>, PathRejection>,
) -> Result<Json<WorkspaceInfo>, ApiError> {
    let Path(which) = which.map_err(path_error)?;
    Ok(Json(
        kiln_runtime::workspaces::start(&state.runtime, &caller, &which).await?,
    ))
}

/// Stop a workspace: its services shut down cleanly, its box hibernated; files, history and
/// service data are kept.
#[utoipa::path(post, path = "/api/v1/workspaces/{workspace}/stop", tag = "v1 workspaces",
    params(("workspace" = String, Path, description = "Its id or name")),
    responses(
        (status = 200, description = "Stopped", body = WorkspaceInfo),
        (status = 404, description = "No such workspace", body = ErrorBody),
    ))]
pub async fn stop(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    which: Result<Path<String>, PathRejection>,
) -> Result<Json<WorkspaceInfo>, ApiError> {
    let Path(which) = which.map_err(path_error)?;
    Ok(Json(
        kiln_runtime::workspaces::stop(&state.runtime, &caller, &which).await?,
    ))
}

/// A service to add.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewService {
    /// `postgres`, `redis`, `mysql` or `nginx`.
    #[serde(rename = "type")]
    pub kind: String,
}

/// Add a service to a workspace (started now, and with the workspace from then on): how a
/// client in the workspace reaches it.
#[utoipa::path(post, path = "/api/v1/workspaces/{workspace}/services", tag = "v1 workspaces",
    request_body = NewService,
    params(("workspace" = String, Path, description = "Its id or name")),
    responses(
        (status = 201, description = "Running", body = Service),
        (status = 400, description = "An unknown service, or one that did not start (its log's tail)", body = ErrorBody),
        (status = 404, description = "No such workspace", body = ErrorBody),
    ))]
pub async fn add_service(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    which: Result<Path<String>, PathRejection>,
    new: Result<kiln_http::JsonObject<NewService>, kiln_http::HttpError>,
) -> Result<(StatusCode, Json<Service>), ApiError> {
    let Path(which) = which.map_err(path_error)?;
    let new = body(new)?;
    let kind = kiln_runtime::workspaces::ServiceKind::parse(&new.kind)?;
    let service =
        kiln_runtime::workspaces::add_service(&state.runtime, &caller, &which, kind).await?;
    Ok((StatusCode::CREATED, Json(service)))
}

/// One SQL statement to run.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct SqlRequest {
    pub query: String,
    /// `postgres` or `mysql` (default: the workspace's first of them).
    pub service: Option<String>,
    /// Default 10 000, at most 60 000.
    pub timeout_ms: Option<u64>,
}

/// Run one SQL statement against a workspace's postgres or mysql: its rows as JSON (at most
/// 1000), bounded in time. A statement the database refuses, or one past its time, is a 400
/// with the database's words.
#[utoipa::path(post, path = "/api/v1/workspaces/{workspace}/sql", tag = "v1 workspaces",
    request_body = SqlRequest,
    params(("workspace" = String, Path, description = "Its id or name")),
    responses(
        (status = 200, description = "Its rows", body = SqlResult),
        (status = 400, description = "A bad statement, no such service, or past its time", body = ErrorBody),
        (status = 404, description = "No such workspace", body = ErrorBody),
    ))]
pub async fn sql(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    which: Result<Path<String>, PathRejection>,
    asked: Result<kiln_http::JsonObject<SqlRequest>, kiln_http::HttpError>,
) -> Result<Json<SqlResult>, ApiError> {
    let Path(which) = which.map_err(path_error)?;
    let asked = body(asked)?;
    Ok(Json(
        kiln_runtime::workspaces::run_sql(
            &state.runtime,
            &caller,
            &which,
            asked.service.as_deref(),
            &asked.query,
            asked.timeout_ms,
        )
        .await?,
    ))
}

/// A preview to enable (seed 002's `enable_preview`).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PreviewRequest {
    /// `static` (the workspace's files, served by its nginx) or `proxy` (its own server).
    #[serde(rename = "type")]
    pub kind: String,
    /// `static`: the folder of the workspace to serve (default all of it).
    pub root_path: Option<String>,
    /// `proxy`: the port its server listens on.
    pub port: Option<u16>,
    /// How long the link works, in seconds (default 3600).
    pub ttl_seconds: Option<u64>,
}

/// A workspace's preview and a signed link to it.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct PreviewAnswer {
    pub preview: kiln_runtime::workspaces::Preview,
    /// Works without a key until `expiresAt` (relative to this server).
    pub url: String,
    pub expires_at: String,
}

/// Enable a workspace's preview and get a signed link to it.
#[utoipa::path(post, path = "/api/v1/workspaces/{workspace}/preview", tag = "v1 workspaces",
    request_body = PreviewRequest,
    params(("workspace" = String, Path, description = "Its id or name")),
    responses(
        (status = 200, description = "Enabled", body = PreviewAnswer),
        (status = 400, description = "A bad type, folder or port", body = ErrorBody),
        (status = 404, description = "No such workspace", body = ErrorBody),
    ))]
pub async fn preview(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    which: Result<Path<String>, PathRejection>,
    asked: Result<kiln_http::JsonObject<PreviewRequest>, kiln_http::HttpError>,
) -> Result<Json<PreviewAnswer>, ApiError> {
    let Path(which) = which.map_err(path_error)?;
    let asked = body(asked)?;
    Ok(Json(
        enable_preview(
            &state,
            &caller,
            &which,
            &asked.kind,
            asked.root_path.as_deref(),
            asked.port,
            asked.ttl_seconds.unwrap_or(3600),
        )
        .await?,
    ))
}

/// Enables the preview and signs a link to it (the route above, MCP and the agent).
pub async fn enable_preview(
    state: &crate::AppState,
    caller: &Caller,
    which: &str,
    kind: &str,
    root_path: Option<&str>,
    port: Option<u16>,
    ttl: u64,
) -> Result<PreviewAnswer, ApiError> {
    let ws = kiln_runtime::workspaces::enable_preview(
        &state.runtime,
        caller,
        which,
        kind,
        root_path,
        port,
    )
    .await?;
    let preview = ws
        .preview
        .ok_or_else(|| ApiError::internal("the preview was not recorded"))?;
    let link = crate::preview::link(state, caller, &ws.sandbox_id, preview.port, ttl)?;
    Ok(PreviewAnswer {
        preview,
        url: link.url,
        expires_at: link.expires_at,
    })
}

// ---------------------------------------------------------------- files and history

/// The sandbox of `caller`'s workspace `which`.
fn sandbox_of(
    state: &crate::AppState,
    caller: &Caller,
    which: &str,
    need: kiln_runtime::workspaces::Need,
) -> Result<String, ApiError> {
    Ok(state
        .runtime
        .registry
        .workspaces
        .get_as(caller, which, need)?
        .sandbox_id)
}

/// List a workspace's files (its sandbox's: `GET /api/v1/sandboxes/{sandboxId}/files`).
#[utoipa::path(get, path = "/api/v1/workspaces/{workspace}/files", tag = "v1 workspaces",
    params(("workspace" = String, Path, description = "Its id or name"), crate::v1::ListQuery),
    responses(
        (status = 200, description = "The listing", body = kiln_runtime::files::FileList),
        (status = 400, description = "Bad path", body = ErrorBody),
        (status = 404, description = "No such workspace or folder", body = ErrorBody),
    ))]
pub async fn list_files(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    which: Result<Path<String>, PathRejection>,
    query: Result<
        axum::extract::Query<crate::v1::ListQuery>,
        axum::extract::rejection::QueryRejection,
    >,
) -> Result<Json<kiln_runtime::files::FileList>, ApiError> {
    let Path(which) = which.map_err(path_error)?;
    let id = sandbox_of(
        &state,
        &caller,
        &which,
        kiln_runtime::workspaces::Need::Read,
    )?;
    crate::v1::list_files(State(state), Extension(caller), Ok(Path(id)), query).await
}

/// Download a file of a workspace.
#[utoipa::path(get, path = "/api/v1/workspaces/{workspace}/files/{path}", tag = "v1 workspaces",
    params(("workspace" = String, Path, description = "Its id or name"), ("path" = String, Path, description = "The file's path in the workspace")),
    responses(
        (status = 200, description = "The file", content_type = "application/octet-stream", body = Vec<u8>),
        (status = 400, description = "Bad path, a link or a special file", body = ErrorBody),
        (status = 404, description = "No such workspace or file", body = ErrorBody),
        (status = 409, description = "The path is a folder", body = ErrorBody),
    ))]
pub async fn read_file(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    ids: Result<Path<(String, String)>, PathRejection>,
) -> Result<axum::response::Response, ApiError> {
    let Path((which, name)) = ids.map_err(path_error)?;
    let id = sandbox_of(
        &state,
        &caller,
        &which,
        kiln_runtime::workspaces::Need::Read,
    )?;
    crate::v1::read_file(State(state), Extension(caller), Ok(Path((id, name)))).await
}

/// Write a file of a workspace (the body is its bytes); recorded in its history.
#[utoipa::path(put, path = "/api/v1/workspaces/{workspace}/files/{path}", tag = "v1 workspaces",
    params(("workspace" = String, Path, description = "Its id or name"), ("path" = String, Path, description = "The file's path in the workspace")),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses(
        (status = 201, description = "Written", body = kiln_runtime::files::FileChange),
        (status = 400, description = "Bad path", body = ErrorBody),
        (status = 404, description = "No such workspace", body = ErrorBody),
    ))]
pub async fn write_file(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    ids: Result<Path<(String, String)>, PathRejection>,
    body: bytes::Bytes,
) -> Result<(StatusCode, Json<kiln_runtime::files::FileChange>), ApiError> {
    let Path((which, name)) = ids.map_err(path_error)?;
    let id = sandbox_of(
        &state,
        &caller,
        &which,
        kiln_runtime::workspaces::Need::Write,
    )?;
    crate::v1::write_file(State(state), Extension(caller), Ok(Path((id, name))), body).await
}

/// Delete a file of a workspace; recorded in its history.
#[utoipa::path(delete, path = "/api/v1/workspaces/{workspace}/files/{path}", tag = "v1 workspaces",
    params(("workspace" = String, Path, description = "Its id or name"), ("path" = String, Path, description = "The file's path in the workspace")),
    responses(
        (status = 200, description = "Deleted", body = kiln_runtime::files::FileChange),
        (status = 404, description = "No such workspace or file", body = ErrorBody),
    ))]
pub async fn delete_file(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    ids: Result<Path<(String, String)>, PathRejection>,
) -> Result<Json<kiln_runtime::files::FileChange>, ApiError> {
    let Path((which, name)) = ids.map_err(path_error)?;
    let id = sandbox_of(
        &state,
        &caller,
        &which,
        kiln_runtime::workspaces::Need::Write,
    )?;
    crate::v1::delete_file(State(state), Extension(caller), Ok(Path((id, name)))).await
}

/// A workspace's history, newest first (its sandbox's; workflow events are notes in it).
#[utoipa::path(get, path = "/api/v1/workspaces/{workspace}/history", tag = "v1 workspaces",
    params(("workspace" = String, Path, description = "Its id or name"), crate::api::HistoryQuery),
    responses(
        (status = 200, description = "The history", body = crate::api::HistoryReply),
        (status = 400, description = "Bad limit or cursor", body = ErrorBody),
        (status = 404, description = "No such workspace", body = ErrorBody),
    ))]
pub async fn history(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    which: Result<Path<String>, PathRejection>,
    query: Result<
        axum::extract::Query<crate::api::HistoryQuery>,
        axum::extract::rejection::QueryRejection,
    >,
) -> Result<Json<crate::api::HistoryReply>, ApiError> {
    let Path(which) = which.map_err(path_error)?;
    let id = sandbox_of(
        &state,
        &caller,
        &which,
        kiln_runtime::workspaces::Need::Read,
    )?;
    crate::api::history(State(state), Extension(caller), Path(id), query).await
}

/// Whom a workspace is shared with.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Sharing {
    /// Other keys of the tenant (at most 32), each `read` or `write`; replaces the list.
    pub collaborators: Vec<kiln_runtime::workspaces::Collaborator>,
}

/// The most collaborators of one workspace.
pub const MAX_COLLABORATORS: usize = 32;

/// Shares a workspace of `caller`'s (its owner's) with other keys of the tenant.
pub fn share(
    state: &crate::AppState,
    caller: &Caller,
    which: &str,
    collaborators: Vec<kiln_runtime::workspaces::Collaborator>,
) -> Result<WorkspaceInfo, ApiError> {
    let crate::auth::Auth::Keys(keys) = &state.auth else {
        return Err(ApiError::bad_request(
            "INVALID_REQUEST",
            "this server has no API keys (--no-auth): its one user has every workspace; there is nobody to share with",
        ));
    };
    if collaborators.len() > MAX_COLLABORATORS {
        return Err(ApiError::bad_request(
            "INVALID_REQUEST",
            format!("at most {MAX_COLLABORATORS} collaborators"),
        ));
    }
    for (n, c) in collaborators.iter().enumerate() {
        if c.key_id == caller.key_id {
            return Err(ApiError::bad_request(
                "INVALID_REQUEST",
                "the owner is not a collaborator of its own workspace",
            ));
        }
        if collaborators[..n].iter().any(|d| d.key_id == c.key_id) {
            return Err(ApiError::bad_request(
                "INVALID_REQUEST",
                format!("{} is named twice", c.key_id),
            ));
        }
        if keys
            .by_id(&c.key_id)
            .is_none_or(|key| key.tenant != caller.tenant)
        {
            return Err(ApiError::bad_request(
                "UNKNOWN_KEY",
                format!(
                    "{:?} is not a key of this tenant (kiln keys list shows them; a workspace is shared within its tenant only)",
                    c.key_id
                ),
            ));
        }
    }
    Ok(state
        .runtime
        .registry
        .workspaces
        .share(caller, which, collaborators)?)
}

/// Share a workspace with other keys of the tenant, `read` (its record, files, history,
/// workflows, read-only SQL) or `write` (everything but deleting and sharing it, its
/// sandbox too); the list replaces the one it had. Its owner's alone. Keys not listed (and
/// not the owner) do not see the workspace or its sandbox.
#[utoipa::path(put, path = "/api/v1/workspaces/{workspace}/collaborators", tag = "v1 workspaces",
    params(("workspace" = String, Path, description = "Its id or name")),
    request_body = Sharing,
    responses(
        (status = 200, description = "Shared", body = WorkspaceInfo),
        (status = 400, description = "A key that is not the tenant's, or no keys on this server", body = ErrorBody),
        (status = 404, description = "No such workspace of the caller's", body = ErrorBody),
    ))]
pub async fn collaborators(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    which: Result<Path<String>, PathRejection>,
    sent: Result<kiln_http::JsonObject<Sharing>, kiln_http::HttpError>,
) -> Result<Json<WorkspaceInfo>, ApiError> {
    let Path(which) = which.map_err(path_error)?;
    let sent = body(sent)?;
    Ok(Json(share(&state, &caller, &which, sent.collaborators)?))
}
