//! E2B's volumes over kiln's named volumes: the control plane's `/volumes` (create, list,
//! get, delete; a key's tenant owns them), `volumeMounts` at sandbox create, and the volume
//! content API (`/volumecontent/{id}/…`, reached with the volume's own token, as
//! `E2B_VOLUME_API_URL` points the SDK at the facade): list, stat, read, write, make
//! folders, change mode, remove, all through `kiln_workspace::Tree` (no link a sandbox
//! planted in the volume is ever followed).

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Query, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Json};
use kiln_runtime::RuntimeError;
use kiln_runtime::auth::Caller;
use kiln_runtime::sandbox::rfc3339;
use kiln_runtime::volumes::VolumeRecord;
use kiln_workspace::{Kind, Meta, RelPath, TreeError};
use serde::Deserialize;
use serde_json::{Value, json};

use super::{E2b, Route, error, message_of, status_of};
use crate::gate;

type Shared = State<Arc<E2b>>;

fn failed(e: RuntimeError) -> Response {
    error(
        status_of(&e, Route::Control),
        message_of(&e, Route::Control),
    )
}

/// The most bytes one upload of a volume file carries.
const MAX_UPLOAD_BYTES: usize = 256 << 20;

fn volume_json(e2b: &E2b, record: &VolumeRecord, token: bool) -> Value {
    let mut value = json!({ "volumeID": record.id, "name": record.name });
    if token {
        value["token"] = json!(record.token);
        if let Some(domain) = &e2b.config.domain {
            value["domain"] = json!(domain);
        }
    }
    value
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewVolume {
    name: String,
}

pub async fn create(
    State(e2b): Shared,
    Extension(caller): Extension<Caller>,
    body: bytes::Bytes,
) -> Response {
    let asked: NewVolume = match super::control::parse(&body) {
        Ok(asked) => asked,
        Err(response) => return response,
    };
    match crate::volumes::make(
        &e2b.app.runtime,
        &caller,
        asked.name,
        None,
        Default::default(),
    )
    .await
    {
        Ok(record) => (StatusCode::CREATED, Json(volume_json(&e2b, &record, true))).into_response(),
        Err(e) => failed(e),
    }
}

pub async fn list(State(e2b): Shared, Extension(caller): Extension<Caller>) -> Response {
    let all = e2b.app.runtime.registry.volumes.list(&caller.tenant);
    Json(
        all.iter()
            .map(|v| volume_json(&e2b, v, false))
            .collect::<Vec<_>>(),
    )
    .into_response()
}

pub async fn info(
    State(e2b): Shared,
    Extension(caller): Extension<Caller>,
    Path(which): Path<String>,
) -> Response {
    match e2b
        .app
        .runtime
        .registry
        .volumes
        .find(&caller.tenant, &which)
    {
        Ok(record) => Json(volume_json(&e2b, &record, true)).into_response(),
        Err(e) => failed(e),
    }
}

pub async fn destroy(
    State(e2b): Shared,
    Extension(caller): Extension<Caller>,
    Path(which): Path<String>,
) -> Response {
    match crate::volumes::remove(&e2b.app, &caller, &which).await {
        Ok(true) => StatusCode::NO_CONTENT.into_response(),
        Ok(false) => failed(RuntimeError::VolumeNotFound { volume: which }),
        Err(e) => failed(e),
    }
}

/// The content API's routes.
pub fn content_router(e2b: Arc<E2b>) -> Router {
    Router::new()
        .route("/volumecontent/{id}/dir", get(list_dir).post(make_dir))
        .route("/volumecontent/{id}/file", get(read_file).put(write_file))
        .route(
            "/volumecontent/{id}/path",
            get(stat_path).patch(patch_path).delete(remove_path),
        )
        .fallback(|request: Request| async move {
            error(
                StatusCode::NOT_FOUND,
                format!(
                    "the volume API has no route {} {}",
                    request.method(),
                    request.uri().path()
                ),
            )
        })
        .route_layer(from_fn_with_state("volume", super::label))
        .with_state(e2b.clone())
        .layer(from_fn_with_state(e2b.app.clone(), gate::rate_limit))
        .layer(from_fn_with_state(e2b, authenticate))
}

/// The volume a request's bearer token reaches; it must be the one its path names.
async fn authenticate(State(e2b): Shared, mut request: Request, next: Next) -> Response {
    let token = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .unwrap_or_default()
        .to_owned();
    let named = request
        .uri()
        .path()
        .strip_prefix("/volumecontent/")
        .and_then(|rest| rest.split('/').next())
        .unwrap_or_default()
        .to_owned();
    match e2b.app.runtime.registry.volumes.by_token(&token) {
        Some(record) if record.id == named => {
            request.extensions_mut().insert(Caller {
                tenant: record.tenant.clone(),
                key_id: format!("volume:{}", record.id),
                quotas: Default::default(),
                network_widen: false,
                admin: false,
            });
            request.extensions_mut().insert(record);
            next.run(request).await
        }
        _ => error(
            StatusCode::UNAUTHORIZED,
            "the volume API needs the volume's own token (Authorization: Bearer <token>)",
        ),
    }
}

#[derive(Deserialize)]
pub struct PathQuery {
    path: Option<String>,
    depth: Option<u32>,
    uid: Option<u32>,
    gid: Option<u32>,
    mode: Option<u32>,
    force: Option<bool>,
}

/// A path of the volume as the SDK names it (`/` the volume's root; leading slashes or
/// none).
fn rel(path: Option<&str>) -> Result<RelPath, Response> {
    let path = path.unwrap_or("/").trim_start_matches('/');
    if path.is_empty() {
        return Ok(RelPath::root());
    }
    RelPath::parse(path).map_err(|e| error(StatusCode::BAD_REQUEST, e.to_string()))
}

fn tree_failed(e: TreeError) -> Response {
    let status = match &e {
        TreeError::NotFound { .. } => StatusCode::NOT_FOUND,
        TreeError::NoSpace { .. } => StatusCode::INSUFFICIENT_STORAGE,
        TreeError::Io { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        TreeError::Changed { .. } | TreeError::IsDir { .. } => StatusCode::CONFLICT,
        _ => StatusCode::BAD_REQUEST,
    };
    error(status, e.to_string())
}

/// Runs file work off the async threads.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, Response> + Send + 'static,
) -> Result<T, Response> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
}

/// How the box sees an owner: the sandboxes' user is 1000, as E2B's `user`.
fn shown_id(e2b: &E2b, id: u32, group: bool) -> u32 {
    match crate::volumes::box_user(&e2b.app.runtime) {
        Some((uid, gid)) if (!group && id == uid) || (group && id == gid) => 1000,
        _ => id,
    }
}

fn stat_json(e2b: &E2b, path: &str, meta: &Meta, target: Option<String>) -> Value {
    let name = path.rsplit('/').next().unwrap_or(path);
    let kind = match meta.kind {
        Kind::Dir => "directory",
        Kind::File => "file",
        Kind::Symlink => "symlink",
        _ => "unknown",
    };
    let time = |ns: i64| rfc3339(u64::try_from(ns / 1_000_000).unwrap_or(0));
    let mut value = json!({
        "name": name,
        "type": kind,
        "path": format!("/{path}"),
        "size": meta.size,
        "mode": meta.mode,
        "uid": shown_id(e2b, meta.uid, false),
        "gid": shown_id(e2b, meta.gid, true),
        "atime": time(meta.atime_ns),
        "mtime": time(meta.mtime_ns),
        "ctime": time(meta.ctime_ns),
    });
    if let Some(target) = target {
        value["target"] = json!(target);
    }
    value
}

/// Only the sandboxes' user may own what the API makes (the box sees no other user).
fn check_owner(query: &PathQuery) -> Result<(), Response> {
    for (what, id) in [("uid", query.uid), ("gid", query.gid)] {
        if id.is_some_and(|id| id != 1000) {
            return Err(error(
                StatusCode::BAD_REQUEST,
                format!("{what}: kiln's volumes hold the sandbox user's files (1000) only"),
            ));
        }
    }
    if query.mode.is_some_and(|m| m > 0o7777) {
        return Err(error(
            StatusCode::BAD_REQUEST,
            "mode: permission bits, at most 0o7777",
        ));
    }
    Ok(())
}

/// Sets `mode` on the file or folder at `rel`, through a handle opened without following
/// links (a link a sandbox swapped in is refused, never chmod-ed through).
fn set_mode(tree: &kiln_workspace::Tree, rel: &RelPath, mode: u32) -> Result<(), Response> {
    use std::os::unix::fs::PermissionsExt;
    let meta = tree.stat(rel).map_err(tree_failed)?.ok_or_else(|| {
        error(
            StatusCode::NOT_FOUND,
            format!("no such path /{}", rel.as_str()),
        )
    })?;
    let file = match meta.kind {
        Kind::Dir => tree
            .dir(rel)
            .map_err(tree_failed)?
            .as_file()
            .map_err(|e| error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?,
        Kind::File => tree.open_file(rel).map_err(tree_failed)?.0,
        _ => {
            return Err(error(
                StatusCode::BAD_REQUEST,
                "only files and folders have a mode to set",
            ));
        }
    };
    file.set_permissions(std::fs::Permissions::from_mode(mode))
        .map_err(|e| error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}

async fn list_dir(
    State(e2b): Shared,
    Extension(volume): Extension<VolumeRecord>,
    Query(query): Query<PathQuery>,
) -> Response {
    let rel = match rel(query.path.as_deref()) {
        Ok(rel) => rel,
        Err(response) => return response,
    };
    let depth = query.depth.unwrap_or(1).clamp(1, 32) as usize;
    let shown = e2b.clone();
    let listed = blocking(move || {
        let tree = e2b
            .app
            .runtime
            .registry
            .volumes
            .tree(&volume.id)
            .map_err(failed)?;
        match tree.stat(&rel).map_err(tree_failed)? {
            Some(meta) if meta.kind == Kind::Dir => {}
            Some(_) => {
                return Err(error(
                    StatusCode::BAD_REQUEST,
                    format!("/{} is not a folder", rel.as_str()),
                ));
            }
            None => {
                return Err(error(
                    StatusCode::NOT_FOUND,
                    format!("no folder /{}", rel.as_str()),
                ));
            }
        }
        let base = rel.as_str().matches('/').count() + usize::from(!rel.is_root());
        let mut entries = Vec::new();
        tree.walk(&rel, 100_000, &mut |path, meta| {
            let level = path.matches('/').count() + 1 - base;
            if level <= depth {
                entries.push((path.to_owned(), *meta));
            }
        })
        .map_err(tree_failed)?;
        Ok(entries
            .into_iter()
            .map(|(path, meta)| {
                let target = (meta.kind == Kind::Symlink)
                    .then(|| RelPath::parse(&path).ok())
                    .flatten()
                    .and_then(|r| tree.read_link(&r).ok())
                    .map(|t| String::from_utf8_lossy(&t).into_owned());
                (path, meta, target)
            })
            .collect::<Vec<_>>())
    })
    .await;
    match listed {
        Ok(entries) => Json(
            entries
                .iter()
                .map(|(path, meta, target)| stat_json(&shown, path, meta, target.clone()))
                .collect::<Vec<_>>(),
        )
        .into_response(),
        Err(response) => response,
    }
}

async fn stat_path(
    State(e2b): Shared,
    Extension(volume): Extension<VolumeRecord>,
    Query(query): Query<PathQuery>,
) -> Response {
    let rel = match rel(query.path.as_deref()) {
        Ok(rel) => rel,
        Err(response) => return response,
    };
    let shown = e2b.clone();
    let stat = blocking(move || {
        let tree = e2b
            .app
            .runtime
            .registry
            .volumes
            .tree(&volume.id)
            .map_err(failed)?;
        let meta = tree.stat(&rel).map_err(tree_failed)?.ok_or_else(|| {
            error(
                StatusCode::NOT_FOUND,
                format!("no such path /{}", rel.as_str()),
            )
        })?;
        let target = (meta.kind == Kind::Symlink)
            .then(|| tree.read_link(&rel).ok())
            .flatten()
            .map(|t| String::from_utf8_lossy(&t).into_owned());
        Ok((rel, meta, target))
    })
    .await;
    match stat {
        Ok((rel, meta, target)) => {
            Json(stat_json(&shown, rel.as_str(), &meta, target)).into_response()
        }
        Err(response) => response,
    }
}

async fn read_file(
    State(e2b): Shared,
    Extension(volume): Extension<VolumeRecord>,
    Query(query): Query<PathQuery>,
) -> Response {
    let rel = match rel(query.path.as_deref()) {
        Ok(rel) => rel,
        Err(response) => return response,
    };
    let opened = blocking(move || {
        let tree = e2b
            .app
            .runtime
            .registry
            .volumes
            .tree(&volume.id)
            .map_err(failed)?;
        let (file, meta) = tree.open_file(&rel).map_err(tree_failed)?;
        Ok((file, meta.size))
    })
    .await;
    match opened {
        Ok((file, size)) => {
            let file = tokio::io::AsyncReadExt::take(tokio::fs::File::from_std(file), size);
            (
                [
                    (header::CONTENT_TYPE, "application/octet-stream".to_owned()),
                    (header::CONTENT_LENGTH, size.to_string()),
                ],
                Body::from_stream(crate::v1::file_chunks(file)),
            )
                .into_response()
        }
        Err(response) => response,
    }
}

async fn write_file(
    State(e2b): Shared,
    Extension(volume): Extension<VolumeRecord>,
    Query(query): Query<PathQuery>,
    body: Body,
) -> Response {
    let rel = match rel(query.path.as_deref()) {
        Ok(rel) if !rel.is_root() => rel,
        Ok(_) => {
            return error(
                StatusCode::BAD_REQUEST,
                "path names a file, not the volume's root",
            );
        }
        Err(response) => return response,
    };
    if let Err(response) = check_owner(&query) {
        return response;
    }
    let bytes = match axum::body::to_bytes(body, MAX_UPLOAD_BYTES).await {
        Ok(bytes) => bytes,
        Err(_) => {
            return error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "a volume file upload is at most {} MiB",
                    MAX_UPLOAD_BYTES >> 20
                ),
            );
        }
    };
    let shown = e2b.clone();
    let written = blocking(move || {
        let tree = e2b
            .app
            .runtime
            .registry
            .volumes
            .tree(&volume.id)
            .map_err(failed)?;
        if query.force != Some(true) && tree.stat(&rel).map_err(tree_failed)?.is_some() {
            return Err(error(
                StatusCode::CONFLICT,
                format!("/{} exists (force=true replaces it)", rel.as_str()),
            ));
        }
        tree.write(&rel, &mut bytes.as_ref()).map_err(tree_failed)?;
        if let Some(mode) = query.mode {
            set_mode(&tree, &rel, mode)?;
        }
        let meta = tree
            .stat(&rel)
            .map_err(tree_failed)?
            .ok_or_else(|| error(StatusCode::CONFLICT, "the file went as it was written"))?;
        Ok((rel, meta))
    })
    .await;
    match written {
        Ok((rel, meta)) => (
            StatusCode::CREATED,
            Json(stat_json(&shown, rel.as_str(), &meta, None)),
        )
            .into_response(),
        Err(response) => response,
    }
}

async fn make_dir(
    State(e2b): Shared,
    Extension(volume): Extension<VolumeRecord>,
    Query(query): Query<PathQuery>,
) -> Response {
    let rel = match rel(query.path.as_deref()) {
        Ok(rel) if !rel.is_root() => rel,
        Ok(_) => {
            return error(
                StatusCode::BAD_REQUEST,
                "path names a folder, not the volume's root",
            );
        }
        Err(response) => return response,
    };
    if let Err(response) = check_owner(&query) {
        return response;
    }
    let shown = e2b.clone();
    let made = blocking(move || {
        let tree = e2b
            .app
            .runtime
            .registry
            .volumes
            .tree(&volume.id)
            .map_err(failed)?;
        if query.force != Some(true) && tree.stat(&rel).map_err(tree_failed)?.is_some() {
            return Err(error(
                StatusCode::CONFLICT,
                format!("/{} exists", rel.as_str()),
            ));
        }
        tree.make_dirs(&rel).map_err(tree_failed)?;
        if let Some(mode) = query.mode {
            set_mode(&tree, &rel, mode)?;
        }
        let meta = tree
            .stat(&rel)
            .map_err(tree_failed)?
            .ok_or_else(|| error(StatusCode::CONFLICT, "the folder went as it was made"))?;
        Ok((rel, meta))
    })
    .await;
    match made {
        Ok((rel, meta)) => (
            StatusCode::CREATED,
            Json(stat_json(&shown, rel.as_str(), &meta, None)),
        )
            .into_response(),
        Err(response) => response,
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Patch {
    uid: Option<u32>,
    gid: Option<u32>,
    mode: Option<u32>,
}

async fn patch_path(
    State(e2b): Shared,
    Extension(volume): Extension<VolumeRecord>,
    Query(query): Query<PathQuery>,
    body: bytes::Bytes,
) -> Response {
    let rel = match rel(query.path.as_deref()) {
        Ok(rel) => rel,
        Err(response) => return response,
    };
    let patch: Patch = match super::control::parse(&body) {
        Ok(patch) => patch,
        Err(response) => return response,
    };
    let asked = PathQuery {
        path: None,
        depth: None,
        uid: patch.uid,
        gid: patch.gid,
        mode: patch.mode,
        force: None,
    };
    if let Err(response) = check_owner(&asked) {
        return response;
    }
    let shown = e2b.clone();
    let patched = blocking(move || {
        let tree = e2b
            .app
            .runtime
            .registry
            .volumes
            .tree(&volume.id)
            .map_err(failed)?;
        if let Some(mode) = patch.mode {
            set_mode(&tree, &rel, mode)?;
        }
        let meta = tree.stat(&rel).map_err(tree_failed)?.ok_or_else(|| {
            error(
                StatusCode::NOT_FOUND,
                format!("no such path /{}", rel.as_str()),
            )
        })?;
        Ok((rel, meta))
    })
    .await;
    match patched {
        Ok((rel, meta)) => Json(stat_json(&shown, rel.as_str(), &meta, None)).into_response(),
        Err(response) => response,
    }
}

async fn remove_path(
    State(e2b): Shared,
    Extension(volume): Extension<VolumeRecord>,
    Query(query): Query<PathQuery>,
) -> Response {
    let rel = match rel(query.path.as_deref()) {
        Ok(rel) if !rel.is_root() => rel,
        Ok(_) => {
            return error(
                StatusCode::BAD_REQUEST,
                "the volume's root cannot be removed (delete the volume)",
            );
        }
        Err(response) => return response,
    };
    let removed = blocking(move || {
        let tree = e2b
            .app
            .runtime
            .registry
            .volumes
            .tree(&volume.id)
            .map_err(failed)?;
        tree.remove(&rel).map_err(tree_failed)?;
        Ok(())
    })
    .await;
    match removed {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(response) => response,
    }
}
