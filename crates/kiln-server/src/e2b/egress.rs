//! E2B's network options and secrets over kiln's: `network.allowOut` / `denyOut` / `rules`
//! at create and in `PUT /sandboxes/{id}/network` (kiln's egress rules, applied by its
//! proxy), `allow_internet_access: false` as E2B defines it (`denyOut: ["0.0.0.0/0"]`), and
//! `/secrets` (kiln's per-tenant secrets; `${e2b.secrets.NAME}` fills from them).

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Extension;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use kiln_core::net::{ALL_TRAFFIC, Egress, EgressRule};
use kiln_runtime::RuntimeError;
use kiln_runtime::auth::Caller;
use kiln_runtime::secrets::SecretInfo;
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

/// E2B's `SandboxNetworkConfig` (create) and `SandboxNetworkUpdateConfig` (update).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkOptions {
    pub allow_public_traffic: Option<bool>,
    pub allow_out: Option<Vec<String>>,
    pub deny_out: Option<Vec<String>>,
    pub rules: Option<BTreeMap<String, Vec<EgressRule>>>,
    /// Kiln's boxes have no DNS of their own (the proxy resolves names on the host):
    /// accepted, and nothing to open.
    #[allow(dead_code)]
    pub dns_servers: Option<Vec<String>>,
    /// "Bring your own proxy": refused, as E2B's open-source runtime does.
    pub egress_proxy: Option<Value>,
    /// Update only: `false` is `denyOut: ["0.0.0.0/0"]`.
    #[serde(rename = "allow_internet_access")]
    pub allow_internet_access: Option<bool>,
}

impl NetworkOptions {
    /// Whether it says anything about egress (a proxy of the client's included, which
    /// is then refused).
    pub fn has_rules(&self) -> bool {
        self.allow_out.is_some()
            || self.deny_out.is_some()
            || self.rules.is_some()
            || self.egress_proxy.is_some()
    }

    /// Kiln's rules for these options, with `internet: false` (E2B's
    /// `allow_internet_access`) as a deny of all traffic.
    pub fn egress(&self, internet: Option<bool>) -> Result<Egress, Response> {
        if self.egress_proxy.is_some() {
            return Err(error(
                StatusCode::BAD_REQUEST,
                "network.egressProxy is not supported by kiln: a sandbox's traffic leaves through kiln's own proxy, filtered by allowOut/denyOut (E2B's open-source runtime refuses it too)",
            ));
        }
        let mut egress = Egress {
            allow_out: self.allow_out.clone().unwrap_or_default(),
            deny_out: self.deny_out.clone().unwrap_or_default(),
            rules: self.rules.clone().unwrap_or_default(),
        };
        if internet.or(self.allow_internet_access) == Some(false)
            && !egress.deny_out.iter().any(|d| d == ALL_TRAFFIC)
        {
            egress.deny_out.push(ALL_TRAFFIC.to_string());
        }
        egress
            .validate()
            .map_err(|why| error(StatusCode::BAD_REQUEST, format!("network: {why}")))?;
        Ok(egress)
    }
}

/// E2B's `network` of a sandbox's detail.
pub fn network_json(sandbox: &kiln_runtime::sandbox::Sandbox) -> Value {
    let egress = sandbox.egress.clone().unwrap_or_default();
    json!({
        "allowOut": egress.allow_out,
        "denyOut": egress.deny_out,
        "rules": egress.rules,
        "allowPublicTraffic": sandbox.public_ports,
    })
}

/// Whether E2B would say the sandbox has the internet: a network, not denied wholesale.
pub fn internet(sandbox: &kiln_runtime::sandbox::Sandbox) -> bool {
    sandbox.network == kiln_core::Network::Allowlist
        && !sandbox
            .egress
            .as_ref()
            .is_some_and(|e| e.allow_out.is_empty() && e.deny_out.iter().any(|d| d == ALL_TRAFFIC))
}

/// `PUT /sandboxes/{id}/network`: replaces the sandbox's rules whole (what the body leaves
/// out is cleared), as E2B does.
pub async fn update_network(
    State(e2b): Shared,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    body: bytes::Bytes,
) -> Response {
    let options: NetworkOptions = match super::control::parse(&body) {
        Ok(options) => options,
        Err(response) => return response,
    };
    if let Err(response) = super::control::find(&e2b, &caller, &id) {
        return response;
    }
    let egress = match options.egress(None) {
        Ok(egress) => egress,
        Err(response) => return response,
    };
    match kiln_runtime::network::set_network(&e2b.app.runtime, &caller, &kiln_id(&id), Some(egress))
        .await
    {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => failed(e),
    }
}

/// E2B's `Secret`.
fn secret_json(info: &SecretInfo) -> Value {
    json!({
        "secretID": info.id,
        "name": info.name,
        "currentVersion": info.version,
        "metadata": info.metadata,
        "createdAt": info.created_at,
        "updatedAt": info.updated_at,
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewSecret {
    name: String,
    value: String,
    metadata: Option<BTreeMap<String, String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretUpdate {
    value: String,
    metadata: Option<BTreeMap<String, String>>,
}

/// Runs a secrets-store call off the async threads (it writes files).
async fn blocking<T: Send + 'static>(
    call: impl FnOnce() -> Result<T, RuntimeError> + Send + 'static,
) -> Result<T, Response> {
    tokio::task::spawn_blocking(call)
        .await
        .map_err(|e| error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .map_err(failed)
}

pub async fn create_secret(
    State(e2b): Shared,
    Extension(caller): Extension<Caller>,
    body: bytes::Bytes,
) -> Response {
    let asked: NewSecret = match super::control::parse(&body) {
        Ok(asked) => asked,
        Err(response) => return response,
    };
    let secrets = e2b.app.runtime.secrets.clone();
    match blocking(move || {
        secrets.create(
            &caller.tenant,
            &asked.name,
            &asked.value,
            asked.metadata.unwrap_or_default(),
        )
    })
    .await
    {
        Ok(info) => (StatusCode::CREATED, axum::Json(secret_json(&info))).into_response(),
        Err(response) => response,
    }
}

pub async fn update_secret(
    State(e2b): Shared,
    Extension(caller): Extension<Caller>,
    Path(which): Path<String>,
    body: bytes::Bytes,
) -> Response {
    let asked: SecretUpdate = match super::control::parse(&body) {
        Ok(asked) => asked,
        Err(response) => return response,
    };
    let secrets = e2b.app.runtime.secrets.clone();
    match blocking(move || secrets.update(&caller.tenant, &which, &asked.value, asked.metadata))
        .await
    {
        Ok(info) => axum::Json(secret_json(&info)).into_response(),
        Err(response) => response,
    }
}

pub async fn get_secret(
    State(e2b): Shared,
    Extension(caller): Extension<Caller>,
    Path(which): Path<String>,
) -> Response {
    match e2b.app.runtime.secrets.get(&caller.tenant, &which) {
        Ok(info) => axum::Json(secret_json(&info)).into_response(),
        Err(e) => failed(e),
    }
}

pub async fn delete_secret(
    State(e2b): Shared,
    Extension(caller): Extension<Caller>,
    Path(which): Path<String>,
) -> Response {
    match e2b.app.runtime.secrets.delete(&caller.tenant, &which) {
        Ok(true) => StatusCode::NO_CONTENT.into_response(),
        Ok(false) => failed(RuntimeError::SecretNotFound { name: which }),
        Err(e) => failed(e),
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SecretPage {
    limit: Option<usize>,
    next_token: Option<String>,
}

/// `GET /secrets`: a page (`limit`, default 100, at most 1000), and `x-next-token` when
/// more follow.
pub async fn list_secrets(
    State(e2b): Shared,
    Extension(caller): Extension<Caller>,
    page: Result<Query<SecretPage>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Ok(Query(page)) = page else {
        return error(
            StatusCode::BAD_REQUEST,
            "limit is a number, nextToken a token",
        );
    };
    super::paged(
        page.limit,
        page.next_token.as_deref(),
        || e2b.app.runtime.secrets.list(&caller.tenant).map_err(failed),
        secret_json,
    )
}
