//! Snapshots and forks of Linux sandboxes (`kiln_runtime::snapshots`): `POST
//! /api/v1/sandboxes/{id}/snapshots`, `GET`/`DELETE /api/v1/snapshots/…`, `POST
//! /api/v1/sandboxes/{id}/fork`, and `snapshot` at create.

use axum::Json;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Extension, Path, Query, State};
use axum::http::StatusCode;
use kiln_runtime::snapshots::{CopyKind, SnapshotInfo};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use utoipa::{IntoParams, ToSchema};

use crate::api::SandboxInfo;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::v1::{Shared, path_error};

/// A snapshot to take.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NewSnapshot {
    /// A name for it, unique within the tenant (1..=64 of `A-Z a-z 0-9 _ . -`).
    pub name: Option<String>,
    /// Take its box's running processes too. Absent: where kiln can (CRIU; not gVisor or
    /// microVM boxes), the answer saying why not where it cannot; `true`: a 400 where they
    /// cannot be taken; `false`: its files alone.
    pub processes: Option<bool>,
}

/// Take a snapshot of a Linux sandbox: its files (workspace and everything its box wrote
/// outside it), history and running processes (where CRIU can), taken with its box paused
/// and its file system frozen. New sandboxes start from it (`snapshot` at create), their
/// processes going on from the snapshot's.
#[utoipa::path(post, path = "/api/v1/sandboxes/{id}/snapshots", tag = "v1 snapshots",
    request_body(content = NewSnapshot, description = "Optional"),
    params(("id" = String, Path, description = "The sandbox id")),
    responses(
        (status = 201, description = "Taken", body = SnapshotInfo),
        (status = 400, description = "A WebAssembly sandbox, or a bad name", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
    ))]
pub async fn take(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    id: Result<Path<String>, PathRejection>,
    headers: axum::http::HeaderMap,
    body: axum::body::Body,
) -> Result<(StatusCode, Json<SnapshotInfo>), ApiError> {
    let Path(id) = id.map_err(path_error)?;
    let body: NewSnapshot = crate::v1::optional_json(&headers, body, 4096).await?;
    let info =
        kiln_runtime::snapshots::snapshot(&state.runtime, &caller, &id, body.name, body.processes)
            .await?;
    Ok((StatusCode::CREATED, Json(info)))
}

/// Which snapshots.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[into_params(parameter_in = Query)]
pub struct SnapshotQuery {
    /// Only those of this sandbox.
    pub sandbox_id: Option<String>,
}

/// The tenant's snapshots.
#[derive(Debug, Serialize, ToSchema)]
pub struct SnapshotList {
    pub snapshots: Vec<SnapshotInfo>,
}

/// List the tenant's snapshots, oldest first.
#[utoipa::path(get, path = "/api/v1/snapshots", tag = "v1 snapshots", params(SnapshotQuery),
    responses((status = 200, description = "Its snapshots", body = SnapshotList)))]
pub async fn list(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    query: Result<Query<SnapshotQuery>, QueryRejection>,
) -> Result<Json<SnapshotList>, ApiError> {
    let Query(query) = query.map_err(|e| ApiError::bad_request("INVALID_QUERY", e.body_text()))?;
    Ok(Json(SnapshotList {
        snapshots: state
            .runtime
            .registry
            .snapshots
            .list(&caller.tenant, query.sandbox_id.as_deref()),
    }))
}

/// One snapshot, by id or name.
#[utoipa::path(get, path = "/api/v1/snapshots/{snapshot}", tag = "v1 snapshots",
    params(("snapshot" = String, Path, description = "Its id (`snap_…`) or name")),
    responses(
        (status = 200, description = "The snapshot", body = SnapshotInfo),
        (status = 404, description = "No such snapshot", body = ErrorBody),
    ))]
pub async fn get(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    which: Result<Path<String>, PathRejection>,
) -> Result<Json<SnapshotInfo>, ApiError> {
    let Path(which) = which.map_err(path_error)?;
    Ok(Json(
        state
            .runtime
            .registry
            .snapshots
            .find(&caller.tenant, &which)?
            .0,
    ))
}

/// Delete a snapshot (sandboxes made from it keep their own disks).
#[utoipa::path(delete, path = "/api/v1/snapshots/{snapshot}", tag = "v1 snapshots",
    params(("snapshot" = String, Path, description = "Its id (`snap_…`) or name")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, description = "No such snapshot", body = ErrorBody),
    ))]
pub async fn delete(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    which: Result<Path<String>, PathRejection>,
) -> Result<StatusCode, ApiError> {
    let Path(which) = which.map_err(path_error)?;
    let runtime = state.runtime.clone();
    let (tenant, name) = (caller.tenant.clone(), which.clone());
    let deleted =
        tokio::task::spawn_blocking(move || runtime.registry.snapshots.delete(&tenant, &name))
            .await
            .map_err(|e| ApiError::internal(e.to_string()))??;
    if deleted {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(kiln_runtime::RuntimeError::SnapshotNotFound { snapshot: which }.into())
    }
}

/// How many forks, and their life.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ForkRequest {
    /// 1..=20 (default 1).
    pub count: Option<u32>,
    /// Each fork's life in milliseconds (default the source's).
    pub timeout_ms: Option<u64>,
    /// Carry the source's running processes into the forks (as a snapshot's `processes`).
    pub processes: Option<bool>,
}

/// One fork: the sandbox made, or why it was not.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Fork {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<SandboxInfo>,
    /// How its disk was copied from the source's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub copy: Option<CopyKind>,
    /// Whether its processes were restored from the source's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub restored_processes: Option<bool>,
    /// What became of the source's processes in it, in plain words.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub processes: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Object)]
    pub error: Option<Value>,
}

impl Fork {
    fn failed(e: &kiln_runtime::RuntimeError) -> Fork {
        Fork {
            sandbox: None,
            copy: None,
            restored_processes: None,
            processes: None,
            error: Some(json!({"code": e.code(), "message": e.to_string()})),
        }
    }
}

/// The forks made.
#[derive(Debug, Serialize, ToSchema)]
pub struct Forks {
    pub forks: Vec<Fork>,
}

/// Fork a Linux sandbox into `count` sandboxes that start from its files as they are now
/// (one snapshot, taken once) and diverge from then on; each succeeds or fails on its own.
#[utoipa::path(post, path = "/api/v1/sandboxes/{id}/fork", tag = "v1 snapshots",
    request_body(content = ForkRequest, description = "Optional"),
    params(("id" = String, Path, description = "The sandbox id")),
    responses(
        (status = 201, description = "The forks", body = Forks),
        (status = 400, description = "A bad count, or a WebAssembly sandbox", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
    ))]
pub async fn fork(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    id: Result<Path<String>, PathRejection>,
    headers: axum::http::HeaderMap,
    body: axum::body::Body,
) -> Result<(StatusCode, Json<Forks>), ApiError> {
    let Path(id) = id.map_err(path_error)?;
    let body: ForkRequest = crate::v1::optional_json(&headers, body, 4096).await?;
    let made = kiln_runtime::snapshots::fork(
        &state.runtime,
        &caller,
        &id,
        body.count.unwrap_or(1),
        kiln_runtime::snapshots::FromSnapshot {
            lifetime_ms: body.timeout_ms,
            ..Default::default()
        },
        body.processes,
    )
    .await?;
    let forks = made
        .into_iter()
        .map(|fork| match fork {
            Ok(made) => {
                let sandbox = state
                    .runtime
                    .registry
                    .get(&caller.tenant, &made.sandbox.id)
                    .map(|view| SandboxInfo::from_view(&view).described(state.runtime.catalogue()));
                match sandbox {
                    Ok(info) => Fork {
                        sandbox: Some(info),
                        copy: Some(made.copy),
                        restored_processes: Some(made.restored),
                        processes: Some(made.processes),
                        error: None,
                    },
                    Err(e) => Fork::failed(&e),
                }
            }
            Err(e) => Fork::failed(&e),
        })
        .collect();
    Ok((StatusCode::CREATED, Json(Forks { forks })))
}
