//! `/api/v1/volumes`: a tenant's named volumes, storage that outlives sandboxes and is
//! shared between them (`volumeMounts` at sandbox create).

use std::collections::BTreeMap;

use axum::Json;
use axum::extract::rejection::PathRejection;
use axum::extract::{Extension, Path, State};
use axum::http::StatusCode;
use kiln_http::{HttpError, JsonObject as JsonBody};
use kiln_runtime::volumes::VolumeRecord;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::AppState;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::v1::{Shared, path_error};

/// A new volume.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[schema(example = json!({"name": "datasets", "sizeMb": 2048}))]
pub struct NewVolume {
    /// 1..=64 of `A-Z a-z 0-9 _ . -`, unique within the tenant.
    pub name: String,
    /// What it may hold, 16 MiB to 64 GiB (default 1024). Its image is sparse: the size is
    /// a cap, not an allocation.
    pub size_mb: Option<u64>,
    pub metadata: Option<BTreeMap<String, String>>,
}

/// A volume, with what it holds and who mounts it.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolumeInfo {
    #[serde(flatten)]
    pub volume: VolumeRecord,
    /// Bytes its files use now.
    pub used_bytes: u64,
    /// The live sandboxes that mount it.
    pub mounted_by: Vec<String>,
}

/// The tenant's volumes.
#[derive(Debug, Serialize, ToSchema)]
pub struct VolumeList {
    pub volumes: Vec<VolumeInfo>,
}

pub(crate) fn info(state: &AppState, volume: VolumeRecord) -> VolumeInfo {
    VolumeInfo {
        used_bytes: state.runtime.registry.volumes.used(&volume.id),
        mounted_by: state.runtime.registry.volume_users(&volume.id),
        volume,
    }
}

/// Make a volume (an ext4 file system of its own, mounted while kiln runs).
#[utoipa::path(post, path = "/api/v1/volumes", tag = "v1 volumes", request_body = NewVolume,
    responses(
        (status = 201, description = "Made", body = VolumeInfo),
        (status = 400, description = "A bad name or size", body = ErrorBody),
        (status = 409, description = "A volume of that name exists", body = ErrorBody),
        (status = 429, description = "Over the tenant's volumes or workspace quota", body = ErrorBody),
        (status = 507, description = "The host's disk cannot cover it", body = ErrorBody),
    ))]
pub async fn create(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    body: Result<JsonBody<NewVolume>, HttpError>,
) -> Result<(StatusCode, Json<VolumeInfo>), ApiError> {
    let JsonBody(body) = body?;
    let made = make(
        &state.runtime,
        &caller,
        body.name,
        body.size_mb.map(|mb| mb.saturating_mul(1 << 20)),
        body.metadata.unwrap_or_default(),
    )
    .await?;
    Ok((StatusCode::CREATED, Json(info(&state, made))))
}

/// Makes a volume for `caller`, within its quotas (every face's way in).
pub async fn make(
    runtime: &std::sync::Arc<kiln_runtime::Runtime>,
    caller: &Caller,
    name: String,
    size_bytes: Option<u64>,
    metadata: BTreeMap<String, String>,
) -> Result<VolumeRecord, kiln_runtime::RuntimeError> {
    let quotas = runtime.quotas(caller);
    runtime
        .registry
        .usage(&caller.tenant)
        .check_workspace(&quotas)?;
    let runtime = runtime.clone();
    let tenant = caller.tenant.clone();
    let owner = box_user(&runtime);
    tokio::task::spawn_blocking(move || {
        runtime
            .registry
            .volumes
            .create(&tenant, &name, size_bytes, metadata, quotas.volumes, owner)
    })
    .await
    .map_err(|e| kiln_runtime::RuntimeError::internal(e.to_string()))?
}

/// The host owner of Linux boxes' user (the user of every Linux template's workspace), if
/// this server runs Linux boxes.
pub fn box_user(runtime: &kiln_runtime::Runtime) -> Option<(u32, u32)> {
    runtime
        .catalogue()
        .templates()
        .iter()
        .find_map(|t| t.workspace_owner)
}

/// List the tenant's volumes, oldest first.
#[utoipa::path(get, path = "/api/v1/volumes", tag = "v1 volumes",
    responses((status = 200, description = "Its volumes", body = VolumeList)))]
pub async fn list(State(state): Shared, Extension(caller): Extension<Caller>) -> Json<VolumeList> {
    let volumes = state.runtime.registry.volumes.list(&caller.tenant);
    Json(VolumeList {
        volumes: volumes.into_iter().map(|v| info(&state, v)).collect(),
    })
}

/// One volume, by id or name.
#[utoipa::path(get, path = "/api/v1/volumes/{volume}", tag = "v1 volumes",
    params(("volume" = String, Path, description = "Its id (`vol_…`) or name")),
    responses(
        (status = 200, description = "The volume", body = VolumeInfo),
        (status = 404, description = "No such volume", body = ErrorBody),
    ))]
pub async fn get(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    which: Result<Path<String>, PathRejection>,
) -> Result<Json<VolumeInfo>, ApiError> {
    let Path(which) = which.map_err(path_error)?;
    let volume = state
        .runtime
        .registry
        .volumes
        .find(&caller.tenant, &which)?;
    Ok(Json(info(&state, volume)))
}

/// Delete a volume and its files; refused (409) while a live sandbox mounts it.
#[utoipa::path(delete, path = "/api/v1/volumes/{volume}", tag = "v1 volumes",
    params(("volume" = String, Path, description = "Its id (`vol_…`) or name")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, description = "No such volume", body = ErrorBody),
        (status = 409, description = "Mounted by live sandboxes (named in details)", body = ErrorBody),
    ))]
pub async fn delete(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    which: Result<Path<String>, PathRejection>,
) -> Result<StatusCode, ApiError> {
    let Path(which) = which.map_err(path_error)?;
    if remove(&state, &caller, &which).await? {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(kiln_runtime::RuntimeError::VolumeNotFound { volume: which }.into())
    }
}

/// Deletes `caller`'s volume `which` unless a live sandbox mounts it; false when none.
pub async fn remove(
    state: &std::sync::Arc<AppState>,
    caller: &Caller,
    which: &str,
) -> Result<bool, kiln_runtime::RuntimeError> {
    let runtime = state.runtime.clone();
    let (tenant, which) = (caller.tenant.clone(), which.to_owned());
    tokio::task::spawn_blocking(move || {
        runtime
            .registry
            .volumes
            .delete(&tenant, &which, |id| runtime.registry.volume_users(id))
    })
    .await
    .map_err(|e| kiln_runtime::RuntimeError::internal(e.to_string()))?
}
