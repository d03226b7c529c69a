//! E2B's snapshots and forks over kiln's (`kiln_runtime::snapshots`): `create_snapshot`
//! (`POST /sandboxes/{id}/snapshots`), `list_snapshots` (`GET /snapshots`),
//! `delete_snapshot` (`DELETE /templates/{snapshot id}`), `Sandbox.create(snapshot_id)`, and
//! `fork` (`POST /sandboxes/{id}/fork`). E2B's `mode="full"` (the default: `memory` true or
//! absent) takes the box's running processes with its files where kiln can (CRIU); absent,
//! a box whose processes cannot be taken is snapshotted with its files alone, and asked by
//! name (`memory: true`) that is a 400 saying why. `mode="filesystem"` takes the files
//! alone. A fork carries the processes where kiln can.

use std::sync::Arc;

use axum::Extension;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use kiln_runtime::RuntimeError;
use kiln_runtime::auth::Caller;
use kiln_runtime::snapshots::{FromSnapshot, SnapshotInfo};
use serde::Deserialize;
use serde_json::{Value, json};

use super::{E2b, Route, error, kiln_id, message_of, status_of};

type Shared = State<Arc<E2b>>;

fn failed(e: RuntimeError) -> Response {
    error(
        status_of(&e, Route::Control),
        message_of(&e, Route::Control),
    )
}

fn snapshot_json(info: &SnapshotInfo) -> Value {
    json!({
        "snapshotID": info.id,
        "names": info.name.iter().collect::<Vec<_>>(),
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewSnapshot {
    name: Option<String>,
    memory: Option<bool>,
}

pub async fn create(
    State(e2b): Shared,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    body: bytes::Bytes,
) -> Response {
    let asked: NewSnapshot = match super::control::parse(&body) {
        Ok(asked) => asked,
        Err(response) => return response,
    };
    if let Err(response) = super::control::find(&e2b, &caller, &id) {
        return response;
    }
    match kiln_runtime::snapshots::snapshot(
        &e2b.app.runtime,
        &caller,
        &kiln_id(&id),
        asked.name,
        asked.memory,
    )
    .await
    {
        Ok(info) => (StatusCode::CREATED, axum::Json(snapshot_json(&info))).into_response(),
        Err(e) => failed(e),
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ListQuery {
    #[serde(rename = "sandboxID")]
    sandbox_id: Option<String>,
    name: Option<String>,
    limit: Option<usize>,
    next_token: Option<String>,
}

pub async fn list(
    State(e2b): Shared,
    Extension(caller): Extension<Caller>,
    query: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Ok(Query(query)) = query else {
        return error(
            StatusCode::BAD_REQUEST,
            "limit is a number; sandboxID, name and nextToken are text",
        );
    };
    let sandbox = query.sandbox_id.as_deref().map(kiln_id);
    let all: Vec<SnapshotInfo> = e2b
        .app
        .runtime
        .registry
        .snapshots
        .list(&caller.tenant, sandbox.as_deref())
        .into_iter()
        .filter(|s| {
            query
                .name
                .as_deref()
                .is_none_or(|n| s.name.as_deref() == Some(n))
        })
        .collect();
    super::paged(
        query.limit,
        query.next_token.as_deref(),
        || Ok(all),
        snapshot_json,
    )
}

/// `DELETE /templates/{id}`: E2B deletes a snapshot as a template.
pub async fn delete(
    State(e2b): Shared,
    Extension(caller): Extension<Caller>,
    Path(which): Path<String>,
) -> Response {
    let runtime = e2b.app.runtime.clone();
    let (tenant, name) = (caller.tenant.clone(), which.clone());
    let deleted =
        tokio::task::spawn_blocking(move || runtime.registry.snapshots.delete(&tenant, &name))
            .await
            .unwrap_or_else(|e| Err(RuntimeError::internal(e.to_string())));
    match deleted {
        Ok(true) => StatusCode::NO_CONTENT.into_response(),
        Ok(false) => error(
            StatusCode::NOT_FOUND,
            format!(
                "no snapshot {which:?} (kiln deletes snapshots here; its templates are the operator's)"
            ),
        ),
        Err(e) => failed(e),
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    /// Seconds.
    timeout: Option<u64>,
    count: Option<u32>,
}

pub async fn fork(
    State(e2b): Shared,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    body: bytes::Bytes,
) -> Response {
    let asked: ForkRequest = match super::control::parse(&body) {
        Ok(asked) => asked,
        Err(response) => return response,
    };
    if let Err(response) = super::control::find(&e2b, &caller, &id) {
        return response;
    }
    let with = FromSnapshot {
        lifetime_ms: asked.timeout.map(|s| s.saturating_mul(1000).max(1000)),
        ..Default::default()
    };
    let forks = match kiln_runtime::snapshots::fork(
        &e2b.app.runtime,
        &caller,
        &kiln_id(&id),
        asked.count.unwrap_or(1),
        with,
        None,
    )
    .await
    {
        Ok(forks) => forks,
        Err(e) => return failed(e),
    };
    let results: Vec<Value> = forks
        .into_iter()
        .map(|fork| match fork {
            Ok(made) => json!({ "sandbox": super::control::sandbox_json(&e2b, &made.sandbox) }),
            Err(e) => json!({
                "error": {
                    "code": status_of(&e, Route::Control).as_u16(),
                    "message": message_of(&e, Route::Control),
                }
            }),
        })
        .collect();
    (StatusCode::CREATED, axum::Json(results)).into_response()
}

/// `Sandbox.create(snapshot_id)`: a sandbox from the caller's snapshot `which`, if it has
/// one by that id or name (`None`: not a snapshot; the name is a template's).
pub async fn create_from(
    e2b: &E2b,
    caller: &Caller,
    which: &str,
    lifetime_ms: u64,
    metadata: std::collections::BTreeMap<String, String>,
) -> Option<Result<kiln_runtime::sandbox::Sandbox, Response>> {
    e2b.app
        .runtime
        .registry
        .snapshots
        .find(&caller.tenant, which)
        .ok()?;
    let made = kiln_runtime::snapshots::create_from(
        &e2b.app.runtime,
        caller,
        which,
        FromSnapshot {
            lifetime_ms: Some(lifetime_ms),
            metadata: Some(metadata),
            access_token: Some(kiln_runtime::sandbox::random_hex(24)),
        },
    )
    .await;
    Some(made.map(|made| made.sandbox).map_err(failed))
}
