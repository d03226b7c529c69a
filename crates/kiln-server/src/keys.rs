//! Who the caller is and what it may hold (`/api/v1/me`, for every key), and, for an admin
//! key, the keys and every tenant's usage (`/api/v1/keys`, `/api/v1/tenants`). An admin key
//! is made with `kiln keys create --admin`; it manages keys here as `kiln keys` does on the
//! machine (the same `keys.json`, under the same lock), and its sandboxes are still only
//! its own tenant's. A server without keys (`--no-auth`) has nothing to manage: these
//! routes answer 409 `KEYS_OFF` there, and `/me` tells the one tenant's quotas and usage.

use std::collections::BTreeMap;

use axum::Json;
use axum::extract::rejection::PathRejection;
use axum::extract::{Extension, Path, State};
use axum::http::StatusCode;
use kiln_http::{HttpError, JsonObject as JsonBody};
use kiln_runtime::auth::{self, Auth, KeyGrant, KeyRecord};
use kiln_runtime::quota::{QuotaOverrides, Quotas, Usage};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::AppState;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::v1::{Shared, path_error};

/// The most keys `keys.json` holds; each request after a change reads it whole.
pub const MAX_KEYS: usize = 10_000;

/// What a tenant holds now: the quotas' counts, and its named volumes.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct UsageSet {
    #[serde(flatten)]
    pub usage: Usage,
    /// Named volumes.
    pub volumes: u64,
}

fn usage_of(state: &AppState, tenant: &str) -> UsageSet {
    UsageSet {
        usage: state.runtime.registry.usage(tenant),
        volumes: state.runtime.registry.volumes.list(tenant).len() as u64,
    }
}

/// The caller: its tenant, its key, its quotas and what it holds.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Me {
    pub tenant: String,
    /// The key's public id (`local` on a server without keys).
    pub key_id: String,
    /// The key's label.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Whether it may use `/api/v1/keys` and `/api/v1/tenants`.
    pub admin: bool,
    /// Whether this server asks for keys (false under `--no-auth`).
    pub auth: bool,
    /// Its quotas: the server's, with its key's own where it has them.
    pub quotas: Quotas,
    /// What its tenant holds now.
    pub usage: UsageSet,
}

/// Who am I: the caller's tenant, key, quotas and usage.
#[utoipa::path(get, path = "/api/v1/me", tag = "v1 keys",
    responses((status = 200, description = "The caller", body = Me)))]
pub async fn me(State(state): Shared, Extension(caller): Extension<Caller>) -> Json<Me> {
    let auth = matches!(state.auth, Auth::Keys(_));
    let name = if auth {
        all_keys(&state)
            .await
            .ok()
            .and_then(|keys| keys.into_iter().find(|k| k.id == caller.key_id))
            .map(|k| k.name)
    } else {
        None
    };
    Json(Me {
        quotas: state.runtime.quotas(&caller),
        usage: usage_of(&state, &caller.tenant),
        tenant: caller.tenant,
        key_id: caller.key_id,
        name,
        admin: caller.admin,
        auth,
    })
}

/// A key as an admin sees it (never the key itself, nor its hash).
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct KeyView {
    /// Its public id, `key_…`.
    pub id: String,
    pub name: String,
    pub tenant: String,
    /// When it was made (RFC 3339).
    pub created_at: String,
    pub admin: bool,
    /// Whether its sandboxes may reach hosts beyond the operator's network allowlist.
    pub network_widen: bool,
    /// Its own quotas, where they differ from the server's.
    pub quotas: QuotaOverrides,
    /// The quotas it works under: the server's with its own applied.
    pub effective_quotas: Quotas,
}

fn view(state: &AppState, record: KeyRecord) -> KeyView {
    KeyView {
        effective_quotas: state.runtime.quotas.with(&record.quotas),
        id: record.id,
        name: record.name,
        tenant: record.tenant,
        created_at: record.created_at,
        admin: record.admin,
        network_widen: record.network_widen,
        quotas: record.quotas,
    }
}

/// Every key on file.
#[derive(Debug, Serialize, ToSchema)]
pub struct KeyList {
    pub keys: Vec<KeyView>,
}

/// A new key.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[schema(example = json!({"name": "ci", "tenant": "team-a", "quotas": {"sandboxes": 20}}))]
pub struct NewKey {
    /// A label for people: at most 128 characters, no control characters.
    pub name: Option<String>,
    /// The tenant it acts for: 1..=64 of `A-Z a-z 0-9 - _`. Default: a new tenant named
    /// after the key. Keys of one tenant see the same sandboxes.
    pub tenant: Option<String>,
    /// An admin key (default false).
    pub admin: Option<bool>,
    /// Whether its sandboxes may widen the operator's network allowlist (default false).
    pub network_widen: Option<bool>,
    /// Its own quotas, where they should differ from the server's.
    pub quotas: Option<QuotaOverrides>,
}

/// A key just made: the key itself, shown this once.
#[derive(Debug, Serialize, ToSchema)]
pub struct MadeKey {
    /// The key (`kiln_…`): only its hash is kept, so it cannot be shown again.
    pub key: String,
    #[serde(flatten)]
    pub info: KeyView,
}

/// A change to a key; what is left out stays as it is.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[schema(example = json!({"quotas": {"sandboxes": 50, "executions": 4}}))]
pub struct KeyChange {
    pub name: Option<String>,
    pub admin: Option<bool>,
    pub network_widen: Option<bool>,
    /// Its own quotas, all of them: what this leaves out follows the server's (`{}`: the
    /// server's in full).
    pub quotas: Option<QuotaOverrides>,
}

/// Every tenant: its keys, quotas and what it holds.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TenantView {
    pub tenant: String,
    /// The ids of its keys.
    pub keys: Vec<String>,
    /// What it holds now.
    pub usage: UsageSet,
}

/// Every tenant that has keys or holds sandboxes.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TenantList {
    pub tenants: Vec<TenantView>,
    /// The server's quotas, which each key has unless it has its own.
    pub default_quotas: Quotas,
}

/// Lets only an admin key by; a server without keys has none to manage.
fn admin_only(state: &AppState, caller: &Caller) -> Result<(), ApiError> {
    if matches!(state.auth, Auth::Off) {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "KEYS_OFF",
            "this server runs without keys (--no-auth): there are none to manage; make keys with `kiln keys create` and serve without --no-auth",
        ));
    }
    require_admin(caller)
}

/// 403 `ADMIN_ONLY` unless the caller's key is an admin key.
pub(crate) fn require_admin(caller: &Caller) -> Result<(), ApiError> {
    if !caller.admin {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "ADMIN_ONLY",
            "this needs an admin key (`kiln keys create --admin` on the server's machine)",
        ));
    }
    Ok(())
}

fn check_quotas(quotas: &QuotaOverrides) -> Result<(), ApiError> {
    // Counts and bytes are JSON's int64 (the API description says so): no more than that.
    for (name, value) in [
        ("sandboxes", quotas.sandboxes),
        ("sessions", quotas.sessions),
        ("sessionMemoryBytes", quotas.session_memory_bytes),
        ("executions", quotas.executions),
        ("workspaceBytes", quotas.workspace_bytes),
        ("pausedBoxes", quotas.paused_boxes),
        ("volumes", quotas.volumes),
    ] {
        if let Some(value) = value
            && value > i64::MAX as u64
        {
            return Err(ApiError::bad_request(
                "INVALID_QUOTA",
                format!("{name} is at most {}, not {value}", i64::MAX),
            ));
        }
    }
    if let Some(weight) = quotas.cpu_weight
        && !(1..=100).contains(&weight)
    {
        return Err(ApiError::bad_request(
            "INVALID_QUOTA",
            format!("cpuWeight is 1 to 100, not {weight}"),
        ));
    }
    Ok(())
}

/// Runs `work` on the keys file away from the async workers.
async fn on_file<T: Send + 'static>(
    work: impl FnOnce() -> std::io::Result<Result<T, ApiError>> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
        .map_err(|e| ApiError::internal(format!("cannot read or write keys.json: {e}")))?
}

/// Every key on file, read away from the async workers.
async fn all_keys(state: &AppState) -> Result<Vec<KeyRecord>, ApiError> {
    let dir = state.data_dir.clone();
    on_file(move || auth::list_keys(&dir).map(Ok)).await
}

fn last_admin() -> ApiError {
    ApiError::new(
        StatusCode::CONFLICT,
        "LAST_ADMIN_KEY",
        "this is the last admin key: make another first (the machine's `kiln keys` can always manage keys)",
    )
}

/// List every key (admin).
#[utoipa::path(get, path = "/api/v1/keys", tag = "v1 keys",
    responses(
        (status = 200, description = "The keys", body = KeyList),
        (status = 403, description = "Not an admin key", body = ErrorBody),
        (status = 409, description = "The server runs without keys", body = ErrorBody),
    ))]
pub async fn list(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
) -> Result<Json<KeyList>, ApiError> {
    admin_only(&state, &caller)?;
    let keys = all_keys(&state).await?;
    Ok(Json(KeyList {
        keys: keys.into_iter().map(|k| view(&state, k)).collect(),
    }))
}

/// Make a key (admin). The answer carries the key itself, this once.
#[utoipa::path(post, path = "/api/v1/keys", tag = "v1 keys", request_body = NewKey,
    responses(
        (status = 201, description = "Made", body = MadeKey),
        (status = 400, description = "A bad name, tenant or quota", body = ErrorBody),
        (status = 403, description = "Not an admin key", body = ErrorBody),
        (status = 409, description = "The server runs without keys, or holds its most keys", body = ErrorBody),
    ))]
pub async fn create(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    body: Result<JsonBody<NewKey>, HttpError>,
) -> Result<(StatusCode, Json<MadeKey>), ApiError> {
    admin_only(&state, &caller)?;
    let JsonBody(body) = body?;
    let name = body.name.unwrap_or_default();
    auth::check_key_name(&name).map_err(|e| ApiError::bad_request("INVALID_NAME", e))?;
    if let Some(tenant) = &body.tenant {
        auth::check_tenant_name(tenant).map_err(|e| ApiError::bad_request("INVALID_TENANT", e))?;
    }
    let quotas = body.quotas.unwrap_or_default();
    check_quotas(&quotas)?;
    let grant = KeyGrant {
        network_widen: body.network_widen.unwrap_or(false),
        admin: body.admin.unwrap_or(false),
    };
    let dir = state.data_dir.clone();
    let (record, key) = on_file(move || {
        // Counted under the lock that writes the new key: keys made at once never pass it.
        auth::create_key_within(&dir, &name, body.tenant.as_deref(), quotas, grant, MAX_KEYS).map(
            |made| {
                made.ok_or_else(|| {
                    ApiError::new(
                        StatusCode::CONFLICT,
                        "TOO_MANY_KEYS",
                        format!("this server holds its most keys ({MAX_KEYS}): revoke some first"),
                    )
                })
            },
        )
    })
    .await?;
    tracing::info!(key = %record.id, tenant = %record.tenant, admin = record.admin, by = %caller.key_id, "key made");
    Ok((
        StatusCode::CREATED,
        Json(MadeKey {
            key,
            info: view(&state, record),
        }),
    ))
}

/// Change a key's name, quotas or grants (admin). It takes effect on its next request.
#[utoipa::path(patch, path = "/api/v1/keys/{key}", tag = "v1 keys", request_body = KeyChange,
    params(("key" = String, Path, description = "Its public id, `key_…`")),
    responses(
        (status = 200, description = "Changed", body = KeyView),
        (status = 400, description = "A bad name or quota", body = ErrorBody),
        (status = 403, description = "Not an admin key", body = ErrorBody),
        (status = 404, description = "No such key", body = ErrorBody),
        (status = 409, description = "It is the last admin key, or the server runs without keys", body = ErrorBody),
    ))]
pub async fn update(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    id: Result<Path<String>, PathRejection>,
    body: Result<JsonBody<KeyChange>, HttpError>,
) -> Result<Json<KeyView>, ApiError> {
    admin_only(&state, &caller)?;
    let Path(id) = id.map_err(path_error)?;
    let JsonBody(change) = body?;
    if let Some(name) = &change.name {
        auth::check_key_name(name).map_err(|e| ApiError::bad_request("INVALID_NAME", e))?;
    }
    if let Some(quotas) = &change.quotas {
        check_quotas(quotas)?;
    }
    let dir = state.data_dir.clone();
    let by = caller.key_id.clone();
    let record = on_file(move || {
        auth::edit_keys(&dir, |keys| {
            let admins = keys.iter().filter(|k| k.admin).count();
            let Some(record) = keys.iter_mut().find(|k| k.id == id) else {
                return Err(key_not_found(&id));
            };
            if change.admin == Some(false) && record.admin && admins == 1 {
                return Err(last_admin());
            }
            if let Some(name) = change.name {
                record.name = name;
            }
            if let Some(admin) = change.admin {
                record.admin = admin;
            }
            if let Some(widen) = change.network_widen {
                record.network_widen = widen;
            }
            if let Some(quotas) = change.quotas {
                record.quotas = quotas;
            }
            Ok(record.clone())
        })
    })
    .await?;
    tracing::info!(key = %record.id, by = %by, "key changed");
    Ok(Json(view(&state, record)))
}

fn key_not_found(id: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "KEY_NOT_FOUND",
        format!("no key {id:?} (ids are `key_…`, as `GET /api/v1/keys` lists them)"),
    )
}

/// Revoke a key (admin): it stops working at once. The last admin key stays.
#[utoipa::path(delete, path = "/api/v1/keys/{key}", tag = "v1 keys",
    params(("key" = String, Path, description = "Its public id, `key_…`")),
    responses(
        (status = 204, description = "Revoked"),
        (status = 403, description = "Not an admin key", body = ErrorBody),
        (status = 404, description = "No such key", body = ErrorBody),
        (status = 409, description = "It is the last admin key, or the server runs without keys", body = ErrorBody),
    ))]
pub async fn revoke(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    id: Result<Path<String>, PathRejection>,
) -> Result<StatusCode, ApiError> {
    admin_only(&state, &caller)?;
    let Path(id) = id.map_err(path_error)?;
    let dir = state.data_dir.clone();
    let by = caller.key_id.clone();
    let gone = id.clone();
    on_file(move || {
        auth::edit_keys(&dir, |keys| {
            let Some(at) = keys.iter().position(|k| k.id == id) else {
                return Err(key_not_found(&id));
            };
            if keys[at].admin && keys.iter().filter(|k| k.admin).count() == 1 {
                return Err(last_admin());
            }
            keys.remove(at);
            Ok(())
        })
    })
    .await?;
    tracing::info!(key = %gone, by = %by, "key revoked");
    Ok(StatusCode::NO_CONTENT)
}

/// Every tenant with keys or sandboxes, what it holds, and the server's quotas (admin).
#[utoipa::path(get, path = "/api/v1/tenants", tag = "v1 keys",
    responses(
        (status = 200, description = "The tenants", body = TenantList),
        (status = 403, description = "Not an admin key", body = ErrorBody),
        (status = 409, description = "The server runs without keys", body = ErrorBody),
    ))]
pub async fn tenants(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
) -> Result<Json<TenantList>, ApiError> {
    admin_only(&state, &caller)?;
    let keys = all_keys(&state).await?;
    let mut by_tenant: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for key in keys {
        by_tenant.entry(key.tenant).or_default().push(key.id);
    }
    for tenant in state.runtime.registry.tenants() {
        by_tenant.entry(tenant).or_default();
    }
    Ok(Json(TenantList {
        tenants: by_tenant
            .into_iter()
            .map(|(tenant, keys)| TenantView {
                usage: usage_of(&state, &tenant),
                tenant,
                keys,
            })
            .collect(),
        default_quotas: state.runtime.quotas,
    }))
}
