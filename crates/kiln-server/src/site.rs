//! Static previews: a folder of a sandbox's workspace served as a web site, with no server
//! running in the sandbox (`GET /site/{id}/{path}`). Any sandbox has one, WebAssembly
//! included: a report a script wrote, a built front end.
//!
//! Who may read: the owner's key (any file of the workspace), or a signed link
//! (`POST /api/v1/sandboxes/{id}/sites`) scoped to one folder and its subfolders, until it
//! expires. Files are read as the files API reads them: resolved under the workspace's
//! handle with no link followed, regular files only, streamed. A folder answers its
//! `index.html`. Pages run sandboxed (`Content-Security-Policy: sandbox`, no
//! `allow-same-origin`): they cannot read kiln's origin, other previews or terminals.

use std::sync::Arc;

use axum::Json;
use axum::extract::rejection::PathRejection;
use axum::extract::{Extension, Path, Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use kiln_http::{HttpError, JsonObject as JsonBody};
use kiln_runtime::RuntimeError;
use kiln_runtime::files;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::AppState;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::preview::{COOKIE, MAX_TOKEN_SECONDS, SANDBOX_POLICY, TOKEN_PARAM};

/// The folder a link's holder may read (absent: the owner's key, which reads any).
#[derive(Debug, Clone)]
pub struct SiteScope(pub String);

/// The sandbox id a `/site/{id}/…` path names.
pub fn parse_path(path: &str) -> Option<&str> {
    let rest = path.strip_prefix("/site/")?;
    let id = rest.split('/').next()?;
    (!id.is_empty()).then_some(id)
}

/// Who a site request acts as, and the folder it is confined to when it came with a link.
/// `None`: answer 404.
pub fn caller(state: &AppState, request: &Request) -> Option<(Caller, Option<SiteScope>)> {
    let id = parse_path(request.uri().path())?;
    if crate::preview::presents_key(request) || matches!(state.auth, kiln_runtime::auth::Auth::Off)
    {
        return crate::gate::check_key(state, request)
            .ok()
            .map(|c| (c, None));
    }
    let grant = state.previews.check(
        &crate::preview::presented_token(request)?,
        kiln_runtime::sandbox::now_ms(),
    )?;
    let folder = grant.sandbox.strip_prefix(&format!("{id}/site/"))?;
    if grant.port != 0 {
        return None;
    }
    let sandbox = state.runtime.registry.get(&grant.tenant, id).ok()?.meta;
    let caller = state.auth.acting_for(&sandbox)?;
    Some((caller, Some(SiteScope(folder.to_string()))))
}

/// Whether `path` (workspace-relative, no leading slash) lies in `folder` ("" is the whole
/// workspace).
fn within(path: &str, folder: &str) -> bool {
    folder.is_empty()
        || path == folder
        || path
            .strip_prefix(folder)
            .is_some_and(|rest| rest.starts_with('/'))
}

/// The media type of a file, by its extension (unknown ones are bytes).
fn content_type(path: &str) -> &'static str {
    let ext = path
        .rsplit_once('.')
        .map(|(_, e)| e.to_ascii_lowercase())
        .unwrap_or_default();
    match ext.as_str() {
        "html" | "htm" => "text/html; charset=utf-8",
        "css" => "text/css; charset=utf-8",
        "js" | "mjs" => "text/javascript; charset=utf-8",
        "json" | "map" => "application/json",
        "txt" | "md" | "py" | "csv" | "log" => "text/plain; charset=utf-8",
        "xml" => "application/xml",
        "svg" => "image/svg+xml",
        "png" => "image/png",
        "jpg" | "jpeg" => "image/jpeg",
        "gif" => "image/gif",
        "webp" => "image/webp",
        "ico" => "image/x-icon",
        "wasm" => "application/wasm",
        "woff" => "font/woff",
        "woff2" => "font/woff2",
        "pdf" => "application/pdf",
        _ => "application/octet-stream",
    }
}

fn site_not_found(id: &str, path: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "FILE_NOT_FOUND",
        format!("sandbox {id}'s site has no {path:?} (a folder answers its index.html)"),
    )
}

/// `GET /site/{id}` → the site's root, with the slash its relative links need.
pub async fn root(Path(id): Path<String>, request: Request) -> Response {
    let query = request
        .uri()
        .query()
        .map(|q| format!("?{q}"))
        .unwrap_or_default();
    redirect(&format!("/site/{id}/{query}"))
}

fn redirect(to: &str) -> Response {
    match HeaderValue::from_str(to) {
        Ok(location) => (
            StatusCode::PERMANENT_REDIRECT,
            [(header::LOCATION, location)],
        )
            .into_response(),
        Err(_) => StatusCode::BAD_REQUEST.into_response(),
    }
}

/// `GET /site/{id}/{*path}`: a file of the workspace, or a folder's `index.html`.
pub async fn serve(
    State(state): State<Arc<AppState>>,
    Extension(caller): Extension<Caller>,
    scope: Option<Extension<SiteScope>>,
    path: Result<Path<(String, String)>, PathRejection>,
    request: Request,
) -> Result<Response, ApiError> {
    let (id, path) = match path {
        Ok(Path(pair)) => pair,
        // `/site/{id}/`: the root.
        Err(_) => match parse_path(request.uri().path()) {
            Some(id) => (id.to_string(), String::new()),
            None => return Err(ApiError::bad_request("INVALID_PATH", "bad site path")),
        },
    };
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return Err(ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "METHOD_NOT_ALLOWED",
            "a site is read-only: GET or HEAD",
        ));
    }
    let wanted = path.trim_end_matches('/').to_string();
    if let Some(Extension(SiteScope(folder))) = &scope
        && !within(&wanted, folder)
    {
        return Err(crate::error::ApiError::from(
            RuntimeError::SandboxNotFound { id: id.clone() },
        ));
    }
    let runtime = &state.runtime;
    // A file, else a folder's index.html (a folder named without its slash is sent to it, so
    // its page's relative links resolve).
    let not_found = |e: &RuntimeError| {
        matches!(
            e,
            RuntimeError::Workspace(kiln_workspace::TreeError::NotFound { .. })
        )
    };
    // Not the root: a file, or a folder (answered below).
    if !wanted.is_empty() {
        match files::open(runtime, &caller, &id, wanted.clone()).await {
            Ok(_) if path.ends_with('/') => return Err(site_not_found(&id, &path)),
            Ok((file, size)) => return Ok(respond(&request, &id, file, size, &wanted)),
            Err(RuntimeError::IsAFolder { .. }) => {}
            Err(e) if not_found(&e) => return Err(site_not_found(&id, &path)),
            Err(e) => return Err(e.into()),
        }
    }
    if !wanted.is_empty() && !path.ends_with('/') {
        let query = request
            .uri()
            .query()
            .map(|q| format!("?{q}"))
            .unwrap_or_default();
        return Ok(redirect(&format!("/site/{id}/{wanted}/{query}")));
    }
    let index = if wanted.is_empty() {
        "index.html".to_string()
    } else {
        format!("{wanted}/index.html")
    };
    match files::open(runtime, &caller, &id, index.clone()).await {
        Ok((file, size)) => Ok(respond(&request, &id, file, size, &index)),
        Err(e) if not_found(&e) => Err(site_not_found(&id, &index)),
        Err(e) => Err(e.into()),
    }
}

/// A file of the site, streamed, with its type and the sandbox policy.
fn respond(request: &Request, id: &str, file: std::fs::File, size: u64, served: &str) -> Response {
    let file = tokio::io::AsyncReadExt::take(tokio::fs::File::from_std(file), size);
    let body = if request.method() == Method::HEAD {
        axum::body::Body::empty()
    } else {
        axum::body::Body::from_stream(crate::v1::file_chunks(file))
    };
    let mut response = (
        [
            (header::CONTENT_TYPE, content_type(served).to_string()),
            (header::CONTENT_LENGTH, size.to_string()),
            (header::CONTENT_SECURITY_POLICY, SANDBOX_POLICY.to_string()),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff".to_string()),
            (header::CACHE_CONTROL, "no-cache".to_string()),
        ],
        body,
    )
        .into_response();
    // A link's token goes on in a cookie, so the page's own requests carry it.
    if let Some(token) = crate::preview::query_token(request)
        && let Ok(cookie) = HeaderValue::from_str(&format!(
            "{COOKIE}={token}; Path=/site/{id}/; HttpOnly; SameSite=Lax"
        ))
    {
        response.headers_mut().append(header::SET_COOKIE, cookie);
    }
    response
}

/// Ask for a link to a folder of a sandbox's workspace, served as a site.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[schema(example = json!({"folder": "public", "ttlSeconds": 3600}))]
pub struct NewSite {
    /// The folder, relative to the workspace (default: the whole workspace). The link
    /// reads it and its subfolders, nothing else.
    #[serde(default)]
    pub folder: String,
    /// How long the link works, in seconds (default 3600, at most 7 days).
    pub ttl_seconds: Option<u64>,
}

/// A site link anyone holding it may open until it expires.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SiteLink {
    pub folder: String,
    /// The path to open (on this server), token included.
    #[schema(example = "/site/sb_3f2a9c1b7d4e5f60718293a4/public/?kiln_preview_token=…")]
    pub url: String,
    pub token: String,
    pub expires_at: String,
}

/// Make a signed link to a folder of a sandbox's workspace, served as a static site (any
/// sandbox, WebAssembly included). The owner's key reads `/site/{id}/…` without one.
#[utoipa::path(post, path = "/api/v1/sandboxes/{id}/sites", tag = "v1 boxes",
    request_body = NewSite,
    params(("id" = String, Path, description = "The sandbox id")),
    responses(
        (status = 201, description = "The link", body = SiteLink),
        (status = 400, description = "A bad folder or lifetime", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
    ))]
pub async fn create_link(
    State(state): State<Arc<AppState>>,
    Extension(caller): Extension<Caller>,
    id: Result<Path<String>, PathRejection>,
    body: Result<JsonBody<NewSite>, HttpError>,
) -> Result<(StatusCode, Json<SiteLink>), ApiError> {
    let Path(id) = id.map_err(crate::v1::path_error)?;
    let JsonBody(body) = body?;
    let sandbox = state.runtime.registry.get(&caller.tenant, &id)?.meta;
    let folder = body.folder.trim_matches('/').to_string();
    if !folder.is_empty() {
        kiln_runtime::sandbox::workspace_path(&folder)?;
    }
    if folder.contains(['\n', '\r']) {
        return Err(ApiError::bad_request(
            "INVALID_PATH",
            "a site's folder has no line breaks",
        ));
    }
    let ttl = body.ttl_seconds.unwrap_or(3600);
    if !(1..=MAX_TOKEN_SECONDS).contains(&ttl) {
        return Err(ApiError::bad_request(
            "INVALID_OPTION",
            format!("ttlSeconds must be 1..={MAX_TOKEN_SECONDS}"),
        ));
    }
    let grant = crate::preview::Grant {
        tenant: caller.tenant.clone(),
        sandbox: format!("{}/site/{folder}", sandbox.id),
        port: 0,
        expires_ms: kiln_runtime::sandbox::now_ms() + ttl * 1000,
    };
    let token = state.previews.sign(&grant);
    let at = if folder.is_empty() {
        String::new()
    } else {
        format!("{folder}/")
    };
    Ok((
        StatusCode::CREATED,
        Json(SiteLink {
            url: format!("/site/{}/{at}?{TOKEN_PARAM}={token}", sandbox.id),
            folder,
            expires_at: kiln_runtime::sandbox::rfc3339(grant.expires_ms),
            token,
        }),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_link_reads_its_folder_and_nothing_beside_it() {
        assert!(within("public", "public"));
        assert!(within("public/a/b.html", "public"));
        assert!(!within("public2/x", "public"));
        assert!(!within("secret.txt", "public"));
        assert!(!within("", "public"));
        assert!(within("anything", ""));
        assert_eq!(parse_path("/site/sb_1/a/b"), Some("sb_1"));
        assert_eq!(parse_path("/site/"), None);
        assert_eq!(content_type("a/INDEX.HTML"), "text/html; charset=utf-8");
        assert_eq!(content_type("noext"), "application/octet-stream");
    }
}
