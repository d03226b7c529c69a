//! `/api/v1/secrets`: each tenant's secrets, which its sandboxes' network rules put into
//! requests to named hosts (`${secrets.NAME}` in a rule's header). A value goes in with
//! create and update and never comes back out: not in any answer, log or history.

use std::collections::BTreeMap;

use axum::Json;
use axum::extract::rejection::PathRejection;
use axum::extract::{Extension, Path, State};
use axum::http::StatusCode;
use kiln_http::{HttpError, JsonObject as JsonBody};
use kiln_runtime::secrets::SecretInfo;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::v1::{Shared, path_error};

/// A new secret.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[schema(example = json!({"name": "openai", "value": "sk-…", "metadata": {"team": "ml"}}))]
pub struct NewSecret {
    /// 1..=128 of `A-Z a-z 0-9 _ . -`, unique within the tenant.
    pub name: String,
    /// 1 byte to 64 KiB; stored sealed, never returned.
    pub value: String,
    pub metadata: Option<BTreeMap<String, String>>,
}

impl std::fmt::Debug for NewSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NewSecret")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// A secret's new value.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct SecretUpdate {
    pub value: String,
    /// Replaces the stored metadata where given.
    pub metadata: Option<BTreeMap<String, String>>,
}

impl std::fmt::Debug for SecretUpdate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretUpdate").finish_non_exhaustive()
    }
}

/// The tenant's secrets (never their values).
#[derive(Debug, Serialize, ToSchema)]
pub struct SecretList {
    pub secrets: Vec<SecretInfo>,
}

/// Store a secret.
#[utoipa::path(post, path = "/api/v1/secrets", tag = "v1 secrets", request_body = NewSecret,
    responses(
        (status = 201, description = "Stored", body = SecretInfo),
        (status = 400, description = "A bad name, value or metadata", body = ErrorBody),
        (status = 409, description = "A secret of that name exists", body = ErrorBody),
    ))]
pub async fn create(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    body: Result<JsonBody<NewSecret>, HttpError>,
) -> Result<(StatusCode, Json<SecretInfo>), ApiError> {
    let JsonBody(body) = body?;
    let secrets = state.runtime.secrets.clone();
    let tenant = caller.tenant.clone();
    let info = tokio::task::spawn_blocking(move || {
        secrets.create(
            &tenant,
            &body.name,
            &body.value,
            body.metadata.unwrap_or_default(),
        )
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))??;
    Ok((StatusCode::CREATED, Json(info)))
}

/// List the tenant's secrets.
#[utoipa::path(get, path = "/api/v1/secrets", tag = "v1 secrets",
    responses((status = 200, description = "Its secrets, oldest first", body = SecretList)))]
pub async fn list(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
) -> Result<Json<SecretList>, ApiError> {
    Ok(Json(SecretList {
        secrets: state.runtime.secrets.list(&caller.tenant)?,
    }))
}

/// One secret, by id or name (never its value).
#[utoipa::path(get, path = "/api/v1/secrets/{secret}", tag = "v1 secrets",
    params(("secret" = String, Path, description = "Its id (`sec_…`) or name")),
    responses(
        (status = 200, description = "The secret", body = SecretInfo),
        (status = 404, description = "No such secret", body = ErrorBody),
    ))]
pub async fn get(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    which: Result<Path<String>, PathRejection>,
) -> Result<Json<SecretInfo>, ApiError> {
    let Path(which) = which.map_err(path_error)?;
    Ok(Json(state.runtime.secrets.get(&caller.tenant, &which)?))
}

/// Replace a secret's value (its version goes up by one).
#[utoipa::path(put, path = "/api/v1/secrets/{secret}", tag = "v1 secrets", request_body = SecretUpdate,
    params(("secret" = String, Path, description = "Its id (`sec_…`) or name")),
    responses(
        (status = 200, description = "Replaced", body = SecretInfo),
        (status = 404, description = "No such secret", body = ErrorBody),
    ))]
pub async fn update(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    which: Result<Path<String>, PathRejection>,
    body: Result<JsonBody<SecretUpdate>, HttpError>,
) -> Result<Json<SecretInfo>, ApiError> {
    let Path(which) = which.map_err(path_error)?;
    let JsonBody(body) = body?;
    let secrets = state.runtime.secrets.clone();
    let tenant = caller.tenant.clone();
    let info = tokio::task::spawn_blocking(move || {
        secrets.update(&tenant, &which, &body.value, body.metadata)
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))??;
    Ok(Json(info))
}

/// Delete a secret; rules naming it then refuse their requests, saying so.
#[utoipa::path(delete, path = "/api/v1/secrets/{secret}", tag = "v1 secrets",
    params(("secret" = String, Path, description = "Its id (`sec_…`) or name")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, description = "No such secret", body = ErrorBody),
    ))]
pub async fn delete(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    which: Result<Path<String>, PathRejection>,
) -> Result<StatusCode, ApiError> {
    let Path(which) = which.map_err(path_error)?;
    if state.runtime.secrets.delete(&caller.tenant, &which)? {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(kiln_runtime::RuntimeError::SecretNotFound { name: which }.into())
    }
}
