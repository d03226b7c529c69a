//! `kiln serve --database postgres://…`: this server as a node of a cluster (issue 38). It
//! joins with a lease it renews, keeps the shared directory in step with its registry (every
//! sandbox made or gone, from every face), declares nodes whose lease ended lost, and answers
//! a request for a sandbox another node owns with where it is (421 `SANDBOX_ELSEWHERE`), or
//! that its node is gone (410 `SANDBOX_LOST`), instead of 404. Requests are not proxied to
//! the owner yet.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Json;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use kiln_cluster::{ClusterError, Coordinator, NodeInfo};
use kiln_runtime::Runtime;
use kiln_runtime::auth::Caller;
use kiln_runtime::sandbox::DirectoryEvent;
use serde::Serialize;
use utoipa::ToSchema;

use crate::AppState;
use crate::error::ApiError;

/// How this server takes part in a cluster.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// The cluster's Postgres (`postgres://user@host/db`, or `host=/run/postgresql …`).
    pub database: String,
    /// This node's id, unique in the cluster.
    pub node_id: String,
    /// Where other nodes and clients reach this node's API.
    pub advertise: String,
    /// How long a lease lasts; it is renewed every third of it.
    pub lease: Duration,
}

/// This node's membership.
pub struct Cluster {
    pub store: Arc<dyn Coordinator>,
    pub node: String,
    pub lease: Duration,
    /// Set when the cluster declared this node lost (its lease ran out unrenewed).
    pub lost: AtomicBool,
}

fn store_error(e: ClusterError) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

/// Connects, joins, and starts keeping the directory and the lease.
pub async fn join(config: &ClusterConfig, runtime: Arc<Runtime>) -> std::io::Result<Arc<Cluster>> {
    let store: Arc<dyn Coordinator> = Arc::new(
        kiln_cluster::Postgres::connect(&config.database)
            .await
            .map_err(store_error)?,
    );
    let node = NodeInfo {
        id: config.node_id.clone(),
        address: config.advertise.clone(),
    };
    store.join(&node, config.lease).await.map_err(store_error)?;
    let cluster = Arc::new(Cluster {
        store,
        node: config.node_id.clone(),
        lease: config.lease,
        lost: AtomicBool::new(false),
    });
    // The directory follows the registry, in order: what is here, then each change.
    let (events_tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    runtime.registry.observe(events_tx);
    let writer = cluster.clone();
    tokio::spawn(async move {
        while let Some(event) = events.recv().await {
            let done = match &event {
                DirectoryEvent::Placed { id, tenant } => {
                    match writer
                        .store
                        .place(id, tenant, &writer.node, "running")
                        .await
                    {
                        Err(ClusterError::AlreadyPlaced(_)) => Ok(()),
                        other => other,
                    }
                }
                DirectoryEvent::Removed { id } => writer.store.remove(id).await.map(|_| ()),
            };
            if let Err(e) = done {
                tracing::warn!(target: "kiln::cluster", ?event, "the directory was not updated: {e}");
            }
        }
    });
    let beat = cluster.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(beat.lease / 3).await;
            let load = u32::try_from(runtime.registry.count()).unwrap_or(u32::MAX);
            match beat.store.heartbeat(&beat.node, beat.lease, load).await {
                Ok(()) => {}
                Err(ClusterError::NodeLost(_)) => {
                    if !beat.lost.swap(true, Ordering::Relaxed) {
                        tracing::error!(target: "kiln::cluster", node = %beat.node,
                            "the cluster declared this node lost (its lease ran out): restart it to join again");
                    }
                }
                Err(e) => tracing::warn!(target: "kiln::cluster", "heartbeat failed: {e}"),
            }
            match beat.store.expire().await {
                Ok(lost) if !lost.is_empty() => {
                    tracing::warn!(target: "kiln::cluster", ?lost, "nodes declared lost: their leases ran out");
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(target: "kiln::cluster", "could not expire leases: {e}"),
            }
        }
    });
    tracing::info!(target: "kiln::serve", node = %config.node_id, advertise = %config.advertise,
        lease_ms = config.lease.as_millis() as u64, "joined the cluster");
    Ok(cluster)
}

/// The sandbox a request's path names (`/api/v1/sandboxes/{id}…`, `/api/sandbox/{id}…`).
fn sandbox_of(path: &str) -> Option<&str> {
    let rest = path
        .strip_prefix("/api/v1/sandboxes/")
        .or_else(|| path.strip_prefix("/api/sandbox/"))?;
    let id = rest.split('/').next()?;
    id.starts_with("sb_").then_some(id)
}

/// A 404 for a sandbox this node does not hold becomes where it is, when another node does.
pub async fn elsewhere(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    let Some(cluster) = state.cluster.get().cloned() else {
        return next.run(request).await;
    };
    let id = sandbox_of(request.uri().path()).map(str::to_owned);
    let tenant = request
        .extensions()
        .get::<Caller>()
        .map(|c| c.tenant.clone());
    let response = next.run(request).await;
    let (Some(id), Some(tenant)) = (id, tenant) else {
        return response;
    };
    if response.status() != StatusCode::NOT_FOUND {
        return response;
    }
    let Ok(Some(found)) = cluster.store.locate(&id).await else {
        return response;
    };
    // Another tenant's sandbox stays not found.
    if found.tenant != tenant || found.node == cluster.node {
        return response;
    }
    let details = serde_json::json!({"node": found.node, "address": found.address});
    if found.state == "lost" {
        return ApiError::new(
            StatusCode::GONE,
            "SANDBOX_LOST",
            format!(
                "sandbox {id} was on node {}, which stopped answering (its lease ran out): its running processes are gone",
                found.node
            ),
        )
        .with_details(details)
        .into_response();
    }
    ApiError::new(
        StatusCode::MISDIRECTED_REQUEST,
        "SANDBOX_ELSEWHERE",
        format!(
            "sandbox {id} lives on node {} ({}): send its requests there",
            found.node, found.address
        ),
    )
    .with_details(details)
    .into_response()
}

/// A node, as `GET /api/v1/cluster` shows it.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeView {
    pub id: String,
    pub address: String,
    /// `live`, `draining` or `lost`.
    pub state: String,
    /// Its sandboxes, as it last reported.
    pub load: u32,
    /// Milliseconds until its lease ends.
    pub lease_left_ms: u64,
}

/// This server's cluster.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterView {
    /// This node's id.
    pub node: String,
    pub nodes: Vec<NodeView>,
}

/// The cluster's nodes (an admin key, or any caller under `--no-auth`). 404 `NO_CLUSTER` on a
/// server started without `--database`.
#[utoipa::path(get, path = "/api/v1/cluster", tag = "v1 cluster",
    responses(
        (status = 200, description = "The nodes", body = ClusterView),
        (status = 403, description = "Not an admin key", body = crate::error::ErrorBody),
        (status = 404, description = "This server is not part of a cluster", body = crate::error::ErrorBody),
    ))]
pub async fn view(
    State(state): State<Arc<AppState>>,
    axum::Extension(caller): axum::Extension<Caller>,
) -> Result<Json<ClusterView>, ApiError> {
    if matches!(state.auth, kiln_runtime::auth::Auth::Keys(_)) {
        crate::keys::require_admin(&caller)?;
    }
    let Some(cluster) = state.cluster.get() else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "NO_CLUSTER",
            "this server is not part of a cluster (start it with --database postgres://…)",
        ));
    };
    let nodes = cluster.store.nodes().await.map_err(|e| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "CLUSTER_UNREACHABLE",
            e.to_string(),
        )
    })?;
    Ok(Json(ClusterView {
        node: cluster.node.clone(),
        nodes: nodes
            .into_iter()
            .map(|n| NodeView {
                id: n.info.id,
                address: n.info.address,
                state: n.state.as_str().into(),
                load: n.load,
                lease_left_ms: n.lease_left.as_millis() as u64,
            })
            .collect(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sandbox_of_a_path() {
        assert_eq!(sandbox_of("/api/v1/sandboxes/sb_12/exec"), Some("sb_12"));
        assert_eq!(sandbox_of("/api/v1/sandboxes/sb_12"), Some("sb_12"));
        assert_eq!(sandbox_of("/api/sandbox/sb_1/history"), Some("sb_1"));
        assert_eq!(sandbox_of("/api/v1/sandboxes"), None);
        assert_eq!(sandbox_of("/api/v1/sandboxes/other"), None);
        assert_eq!(sandbox_of("/api/v1/templates"), None);
    }
}
