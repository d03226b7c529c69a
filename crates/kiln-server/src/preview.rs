//! Previews: what a Linux sandbox's box serves on a port, through kiln, at
//! `/preview/{id}/{port}/…`: HTTP (streamed both ways) and WebSocket (any upgrade). The box
//! has no network interface: each preview connection is a connection the box's agent makes
//! to `127.0.0.1:port` inside it.
//!
//! Who may look: the owner's API key (`Authorization`), or a signed preview token
//! (`POST /api/v1/sandboxes/{id}/previews`: one sandbox, one port, an expiry) given as
//! `?kiln_preview_token=` once (kiln then sets a cookie scoped to the preview's path, so the
//! page's own requests carry it). Anything else, a forged, expired or other sandbox's
//! token, another tenant's key, is `404` as for an unknown sandbox, checked before any
//! byte reaches the box. Previews count against the owner's rate limit; an idle upgraded
//! connection closes after [`IDLE`].

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::body::Body;
use axum::extract::rejection::PathRejection;
use axum::extract::{Extension, Path, Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use kiln_http::{HttpError, JsonObject as JsonBody};
use kiln_runtime::processes;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use utoipa::ToSchema;

use crate::AppState;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};

/// An upgraded preview connection (WebSocket) that carries nothing for this long closes.
pub const IDLE: Duration = Duration::from_secs(600);
/// The query parameter and the cookie a token travels in.
pub const TOKEN_PARAM: &str = "kiln_preview_token";
pub(crate) const COOKIE: &str = "kiln_preview";
/// The longest a token lives: 7 days.
pub const MAX_TOKEN_SECONDS: u64 = 7 * 24 * 3600;

/// Signs and checks preview tokens with a key of the server's own (`preview.key` in the
/// data folder, made once, readable by kiln only).
#[derive(Clone)]
pub struct Signer {
    key: [u8; 32],
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Signer")
    }
}

/// What a token grants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub tenant: String,
    pub sandbox: String,
    pub port: u16,
    pub expires_ms: u64,
}

fn hmac_sha256(key: &[u8; 32], message: &[u8]) -> [u8; 32] {
    let mut block = [0u8; 64];
    block[..32].copy_from_slice(key);
    let pad = |byte: u8| block.map(|b| b ^ byte);
    let inner = Sha256::new()
        .chain_update(pad(0x36))
        .chain_update(message)
        .finalize();
    Sha256::new()
        .chain_update(pad(0x5c))
        .chain_update(inner)
        .finalize()
        .into()
}

fn b64() -> base64::engine::GeneralPurpose {
    base64::engine::general_purpose::URL_SAFE_NO_PAD
}

impl Signer {
    /// The server's key from `data_dir`, made on first use.
    pub fn open(data_dir: &std::path::Path) -> std::io::Result<Signer> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let path = data_dir.join("preview.key");
        if let Ok(bytes) = std::fs::read(&path)
            && let Ok(key) = <[u8; 32]>::try_from(bytes.as_slice())
        {
            return Ok(Signer { key });
        }
        let mut key = [0u8; 32];
        std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom")?, &mut key)?;
        std::fs::create_dir_all(data_dir)?;
        let staged = data_dir.join(format!(".preview.key.{}", std::process::id()));
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&staged)?;
        file.write_all(&key)?;
        file.sync_all()?;
        std::fs::rename(&staged, &path)?;
        Ok(Signer { key })
    }

    pub fn sign(&self, grant: &Grant) -> String {
        let payload = format!(
            "{}\n{}\n{}\n{}",
            grant.tenant, grant.sandbox, grant.port, grant.expires_ms
        );
        let mac = hmac_sha256(&self.key, payload.as_bytes());
        format!("{}.{}", b64().encode(payload), b64().encode(mac))
    }

    /// The grant of a token this server signed that has not expired at `now_ms`.
    pub fn check(&self, token: &str, now_ms: u64) -> Option<Grant> {
        let (payload, mac) = token.split_once('.')?;
        let payload = b64().decode(payload).ok()?;
        let mac = b64().decode(mac).ok()?;
        let expected = hmac_sha256(&self.key, &payload);
        // Compared in constant time.
        if !crate::e2b::same_secret(&mac, &expected) {
            return None;
        }
        let text = String::from_utf8(payload).ok()?;
        let mut parts = text.split('\n');
        let grant = Grant {
            tenant: parts.next()?.to_string(),
            sandbox: parts.next()?.to_string(),
            port: parts.next()?.parse().ok()?,
            expires_ms: parts.next()?.parse().ok()?,
        };
        (parts.next().is_none() && grant.expires_ms > now_ms).then_some(grant)
    }
}

/// The sandbox id and port a `/preview/{id}/{port}/…` path names, and the rest of it.
pub fn parse_path(path: &str) -> Option<(&str, u16, &str)> {
    let rest = path.strip_prefix("/preview/")?;
    let (id, rest) = rest.split_once('/')?;
    let (port, rest) = match rest.split_once('/') {
        Some((port, rest)) => (port, rest),
        None => (rest, ""),
    };
    let port: u16 = port.parse().ok().filter(|p| *p > 0)?;
    (!id.is_empty()).then_some((id, port, rest))
}

/// The token a preview request carries: its query parameter, else its cookie.
pub fn presented_token(request: &Request) -> Option<String> {
    if let Some(query) = request.uri().query() {
        for (name, value) in form_urlencoded(query) {
            if name == TOKEN_PARAM {
                return Some(value);
            }
        }
    }
    request
        .headers()
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|pair| {
            let (name, value) = pair.trim().split_once('=')?;
            (name == COOKIE).then(|| value.to_string())
        })
}

/// A token given in the request's query (`?kiln_preview_token=`), which kiln then sets as
/// a cookie so the page's own requests carry it.
pub fn query_token(request: &Request) -> Option<String> {
    request.uri().query().and_then(|q| {
        form_urlencoded(q)
            .into_iter()
            .find(|(n, _)| n == TOKEN_PARAM)
            .map(|(_, v)| v)
    })
}

/// Whether the request carries an API key (which is then checked, never bypassed by a
/// token or a public sandbox).
pub fn presents_key(request: &Request) -> bool {
    request.headers().contains_key(header::AUTHORIZATION)
        || request
            .headers()
            .contains_key(HeaderName::from_static("x-api-key"))
}

fn form_urlencoded(query: &str) -> Vec<(String, String)> {
    serde_urlencoded::from_str::<Vec<(String, String)>>(query).unwrap_or_default()
}

use kiln_runtime::sandbox::now_ms;

/// The same answer as for a sandbox that does not exist.
pub fn not_found(id: &str) -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "SANDBOX_NOT_FOUND",
        format!("sandbox {id} does not exist"),
    )
    .into_response()
}

/// Whether a box's `port` may be previewed: one its sandbox lists in
/// `lifecycle.allowedPorts`, or, where it lists none, an unprivileged one (the privileged
/// ones are where a box's root would run system services).
fn port_allowed(sandbox: &kiln_runtime::sandbox::Sandbox, port: u16) -> Result<(), ApiError> {
    match &sandbox.lifecycle.allowed_ports {
        Some(_) if sandbox.lifecycle.allows_port(port) => Ok(()),
        Some(_) => Err(kiln_runtime::RuntimeError::PortNotAllowed {
            port,
            allowed: sandbox.lifecycle.allowed_ports.clone().unwrap_or_default(),
        }
        .into()),
        None if port >= 1024 => Ok(()),
        None => Err(ApiError::bad_request(
            "PORT_NOT_ALLOWED",
            format!(
                "port {port} is privileged; previews reach ports 1024 and up, or those the sandbox lists in lifecycle.allowedPorts"
            ),
        )),
    }
}

/// What a preview served under kiln's origin may do: run scripts, forms, popups and
/// downloads, in an origin of its own (no `allow-same-origin`).
pub const SANDBOX_POLICY: &str = "sandbox allow-scripts allow-forms allow-popups allow-modals allow-downloads allow-pointer-lock";

/// Hop-by-hop headers (RFC 9110 §7.6.1) a proxy does not pass on, but for an upgrade.
const HOP: [&str; 7] = [
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "proxy-connection",
];

fn is_upgrade(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONNECTION)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.split(',')
                .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
        })
        && headers.contains_key(header::UPGRADE)
}

/// `ANY /preview/{id}/{port}/{*path}`: the request, passed to the box's server.
pub async fn proxy(
    State(state): State<Arc<AppState>>,
    Extension(caller): Extension<Caller>,
    request: Request,
) -> Response {
    let path = request.uri().path().to_string();
    let Some((id, port, rest)) = parse_path(&path) else {
        return not_found("?");
    };
    let Ok(view) = state.runtime.registry.get(&caller.tenant, id) else {
        return not_found(id);
    };
    // A token given in the query goes on in a cookie, with the same expiry.
    let query_token = query_token(&request);
    let prefix = format!("/preview/{id}/{port}");
    let mut response = forward(&state, &view.meta, port, rest, Some(&prefix), request).await;
    if let Some(token) = query_token
        && response.status() != StatusCode::SWITCHING_PROTOCOLS
        && let Ok(cookie) = HeaderValue::from_str(&format!(
            "{COOKIE}={token}; Path={prefix}/; HttpOnly; SameSite=Lax"
        ))
    {
        // The page's own requests (scripts, images, its WebSocket) carry the cookie.
        response.headers_mut().append(header::SET_COOKIE, cookie);
    }
    response
}

/// Passes `request` to `sandbox`'s server on `port` as a request for `/{rest}` (its query
/// kept, less kiln's token), streamed both ways, an upgrade (WebSocket) carried through.
/// `prefix`: where the preview is mounted on kiln, told to the server as
/// `X-Forwarded-Prefix`. The caller has checked who may reach it.
pub async fn forward(
    state: &AppState,
    sandbox: &kiln_runtime::sandbox::Sandbox,
    port: u16,
    rest: &str,
    prefix: Option<&str>,
    mut request: Request,
) -> Response {
    let id = sandbox.id.as_str();
    if let Err(refused) = port_allowed(sandbox, port) {
        return refused.into_response();
    }
    let stream = match processes::connect_box(&state.runtime, sandbox, port).await {
        Ok(stream) => stream,
        Err(kiln_runtime::error::RuntimeError::ProcessFailed { message }) => {
            return ApiError::new(
                StatusCode::BAD_GATEWAY,
                "PREVIEW_UNREACHABLE",
                format!("nothing answers on port {port} in sandbox {id}: {message} (GET /api/v1/sandboxes/{id}/ports lists what listens)"),
            )
            .into_response();
        }
        Err(e) => return ApiError::from(e).into_response(),
    };
    let (mut sender, connection) =
        match hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await {
            Ok(pair) => pair,
            Err(e) => {
                return ApiError::new(
                    StatusCode::BAD_GATEWAY,
                    "PREVIEW_UNREACHABLE",
                    format!("port {port} in sandbox {id}: {e}"),
                )
                .into_response();
            }
        };
    tokio::spawn(connection.with_upgrades());

    // What the box's server sees: its own path, none of kiln's credentials.
    let query: Vec<(String, String)> = request
        .uri()
        .query()
        .map(form_urlencoded)
        .unwrap_or_default()
        .into_iter()
        .filter(|(n, _)| n != TOKEN_PARAM)
        .collect();
    let mut target = format!("/{rest}");
    if !query.is_empty() {
        target.push('?');
        target.push_str(&serde_urlencoded::to_string(&query).unwrap_or_default());
    }
    let upgrade = is_upgrade(request.headers());
    let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut request));
    let (parts, body) = request.into_parts();
    let mut upstream = axum::http::Request::builder()
        .method(parts.method.clone())
        .uri(target);
    for (name, value) in &parts.headers {
        let lower = name.as_str();
        if HOP.contains(&lower)
            || lower == "authorization"
            || lower == "x-api-key"
            || lower == "host"
            || (!upgrade && lower == "connection")
        {
            continue;
        }
        if lower == "cookie" {
            let kept: Vec<&str> = value
                .to_str()
                .unwrap_or_default()
                .split(';')
                .map(str::trim)
                .filter(|c| !c.starts_with(&format!("{COOKIE}=")))
                .collect();
            if !kept.is_empty()
                && let Ok(value) = HeaderValue::from_str(&kept.join("; "))
            {
                upstream = upstream.header(header::COOKIE, value);
            }
            continue;
        }
        upstream = upstream.header(name, value);
    }
    upstream = upstream.header(header::HOST, format!("localhost:{port}"));
    if let Some(prefix) = prefix {
        upstream = upstream.header("x-forwarded-prefix", prefix);
    }
    if let Some(host) = parts.headers.get(header::HOST) {
        upstream = upstream.header("x-forwarded-host", host);
    }
    let upstream = match upstream.body(body) {
        Ok(upstream) => upstream,
        Err(e) => return ApiError::bad_request("INVALID_REQUEST", e.to_string()).into_response(),
    };
    let mut answer = match sender.send_request(upstream).await {
        Ok(answer) => answer,
        Err(e) => {
            return ApiError::new(
                StatusCode::BAD_GATEWAY,
                "PREVIEW_UNREACHABLE",
                format!("port {port} in sandbox {id} did not answer: {e}"),
            )
            .into_response();
        }
    };
    if answer.status() == StatusCode::SWITCHING_PROTOCOLS
        && let Some(client_upgrade) = client_upgrade
    {
        let box_upgrade = hyper::upgrade::on(&mut answer);
        tokio::spawn(async move {
            if let (Ok(client), Ok(boxed)) = (client_upgrade.await, box_upgrade.await) {
                pump(
                    hyper_util::rt::TokioIo::new(client),
                    hyper_util::rt::TokioIo::new(boxed),
                )
                .await;
            }
        });
    }
    let (mut parts, body) = answer.into_parts();
    // Answered in the client's HTTP version (a box's HTTP/1.0 server, Python's own, may
    // switch protocols too).
    parts.version = axum::http::Version::HTTP_11;
    for hop in HOP {
        parts.headers.remove(hop);
    }
    // A preview under kiln's own origin runs in an opaque one: its scripts cannot read
    // kiln's pages, other previews or terminals, nor send their cookies (a site by host
    // name, `--preview-domain`, has an origin of its own instead).
    if prefix.is_some() {
        parts.headers.append(
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(SANDBOX_POLICY),
        );
    }
    Response::from_parts(parts, Body::new(body))
}

/// The sandbox and port a `Host` of `{port}-{id}.{domain}` names (`id` with or without
/// its `sb_`).
pub fn host_target(headers: &HeaderMap, domain: &str) -> Option<(String, u16)> {
    let host = headers.get(header::HOST)?.to_str().ok()?;
    let host = host.rsplit_once(':').map_or(host, |(name, port)| {
        if port.chars().all(|c| c.is_ascii_digit()) {
            name
        } else {
            host
        }
    });
    let label = host
        .to_ascii_lowercase()
        .strip_suffix(&domain.trim_matches('.').to_ascii_lowercase())?
        .strip_suffix('.')?
        .to_string();
    let (port, id) = label.split_once('-')?;
    let port: u16 = port.parse().ok().filter(|p| *p > 0)?;
    if id.is_empty() || id.contains('.') {
        return None;
    }
    let id = if id.starts_with("sb_") {
        id.to_string()
    } else {
        format!("sb_{id}")
    };
    Some((id, port))
}

/// A request to `{port}-{id}.{domain}`: as `/preview/{id}/{port}/` with its path, for the
/// owner's key or a token of this sandbox and port (in the query once, then in a cookie of
/// this host), counted against the owner's rate limit; anything else is 404.
pub async fn by_host(state: &AppState, request: Request, id: &str, port: u16) -> Response {
    let caller =
        caller_for(state, &request, id, id, port).or_else(|| public_caller(state, &request, id));
    let Some(caller) = caller else {
        return not_found(id);
    };
    let Ok(view) = state.runtime.registry.get(&caller.tenant, id) else {
        return not_found(id);
    };
    if let Err(wait) = state.limiter.take(&caller.key_id) {
        let seconds = wait.ceil().max(1.0) as u64;
        return ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "RATE_LIMITED",
            format!("too many requests for this key; retry in {seconds} s"),
        )
        .into_response();
    }
    let query_token = query_token(&request);
    let rest = request.uri().path().trim_start_matches('/').to_string();
    let mut response = forward(state, &view.meta, port, &rest, None, request).await;
    if let Some(token) = query_token
        && response.status() != StatusCode::SWITCHING_PROTOCOLS
        && let Ok(cookie) =
            HeaderValue::from_str(&format!("{COOKIE}={token}; Path=/; HttpOnly; SameSite=Lax"))
    {
        response.headers_mut().append(header::SET_COOKIE, cookie);
    }
    response
}

/// Copies both ways until either side ends or nothing moves for [`IDLE`].
async fn pump<A, B>(a: A, b: B)
where
    A: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    B: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut a_read, mut a_write) = tokio::io::split(a);
    let (mut b_read, mut b_write) = tokio::io::split(b);
    let (mut up, mut down) = (vec![0u8; 64 << 10], vec![0u8; 64 << 10]);
    loop {
        let moved = tokio::time::timeout(IDLE, async {
            tokio::select! {
                n = a_read.read(&mut up) => match n {
                    Ok(0) | Err(_) => false,
                    Ok(n) => b_write.write_all(&up[..n]).await.is_ok(),
                },
                n = b_read.read(&mut down) => match n {
                    Ok(0) | Err(_) => false,
                    Ok(n) => a_write.write_all(&down[..n]).await.is_ok(),
                },
            }
        })
        .await;
        if !matches!(moved, Ok(true)) {
            let _ = a_write.shutdown().await;
            let _ = b_write.shutdown().await;
            return;
        }
    }
}

// ---------------------------------------------------------------- the API's side

/// A port the box listens on, with where its preview is.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct PortInfo {
    #[schema(example = 8000)]
    pub port: u16,
    /// The address it listens on.
    #[schema(example = "0.0.0.0")]
    pub address: String,
    /// Whether a preview reaches it (a wildcard or loopback address).
    pub reachable: bool,
    /// The listening process, where the box shows it.
    pub pid: Option<u32>,
    pub name: Option<String>,
    /// The preview's path on this server (with the owner's key, or add a token).
    #[schema(example = "/preview/sb_3f2a9c1b7d4e5f60718293a4/8000/")]
    pub preview: String,
    /// Its host name, where the server has a preview domain (`--preview-domain`).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(example = "8000-3f2a9c1b7d4e5f60718293a4.preview.example.com")]
    pub host: Option<String>,
}

/// A box's listening ports.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct PortList {
    /// `running`, `paused` or `stopped`.
    pub state: String,
    pub ports: Vec<PortInfo>,
}

use crate::v1::path_error;

/// List the TCP ports a Linux sandbox's box listens on.
#[utoipa::path(get, path = "/api/v1/sandboxes/{id}/ports", tag = "v1 boxes",
    params(("id" = String, Path, description = "The sandbox id")),
    responses(
        (status = 200, description = "What listens, with each preview's path", body = PortList),
        (status = 400, description = "A WebAssembly sandbox (no box)", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
    ))]
pub async fn ports(
    State(state): State<Arc<AppState>>,
    Extension(caller): Extension<Caller>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Json<PortList>, ApiError> {
    let Path(id) = id.map_err(path_error)?;
    let (box_state, found) = processes::box_ports(&state.runtime, &caller, &id).await?;
    Ok(Json(PortList {
        state: crate::boxes::state_name(box_state),
        ports: found
            .into_iter()
            .map(|p| PortInfo {
                preview: format!("/preview/{id}/{}/", p.port),
                host: state
                    .preview_domain
                    .as_ref()
                    .map(|domain| format!("{}-{}.{domain}", p.port, id.trim_start_matches("sb_"))),
                port: p.port,
                address: p.address,
                reachable: p.reachable,
                pid: p.pid,
                name: p.name,
            })
            .collect(),
    }))
}

/// Ask for a preview link.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[schema(example = json!({"port": 8000, "ttlSeconds": 3600}))]
pub struct NewPreview {
    pub port: u16,
    /// How long the link works, in seconds (default 3600, at most 7 days).
    pub ttl_seconds: Option<u64>,
}

/// A preview link anyone holding it may open until it expires.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct PreviewLink {
    pub port: u16,
    /// The path to open (on this server), token included.
    #[schema(example = "/preview/sb_3f2a9c1b7d4e5f60718293a4/8000/?kiln_preview_token=…")]
    pub url: String,
    /// The token alone (as `?kiln_preview_token=` on any path of the preview).
    pub token: String,
    pub expires_at: String,
}

/// Make a signed preview link for one port of a sandbox.
#[utoipa::path(post, path = "/api/v1/sandboxes/{id}/previews", tag = "v1 boxes",
    request_body = NewPreview,
    params(("id" = String, Path, description = "The sandbox id")),
    responses(
        (status = 201, description = "The link", body = PreviewLink),
        (status = 400, description = "A bad port or lifetime, or a WebAssembly sandbox", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
    ))]
pub async fn create_link(
    State(state): State<Arc<AppState>>,
    Extension(caller): Extension<Caller>,
    id: Result<Path<String>, PathRejection>,
    body: Result<JsonBody<NewPreview>, HttpError>,
) -> Result<(StatusCode, Json<PreviewLink>), ApiError> {
    let Path(id) = id.map_err(path_error)?;
    let JsonBody(body) = body?;
    let link = link(
        &state,
        &caller,
        &id,
        body.port,
        body.ttl_seconds.unwrap_or(3600),
    )?;
    Ok((StatusCode::CREATED, Json(link)))
}

/// A signed link to `port` of sandbox `id`'s box, working `ttl` seconds (the route above,
/// and MCP's `sandbox_preview_link`).
pub fn link(
    state: &AppState,
    caller: &Caller,
    id: &str,
    port: u16,
    ttl: u64,
) -> Result<PreviewLink, ApiError> {
    let sandbox = state.runtime.registry.get(&caller.tenant, id)?.meta;
    if !processes::runs_processes(&state.runtime, &sandbox) {
        return Err(ApiError::bad_request(
            "UNSUPPORTED",
            "a WebAssembly sandbox serves nothing to preview; create the sandbox from a Linux template",
        ));
    }
    port_allowed(&sandbox, port)?;
    if !(1..=MAX_TOKEN_SECONDS).contains(&ttl) {
        return Err(ApiError::bad_request(
            "INVALID_OPTION",
            format!("ttlSeconds must be 1..={MAX_TOKEN_SECONDS}"),
        ));
    }
    let grant = Grant {
        tenant: caller.tenant.clone(),
        sandbox: sandbox.id.clone(),
        port,
        expires_ms: now_ms() + ttl * 1000,
    };
    let token = state.previews.sign(&grant);
    Ok(PreviewLink {
        port,
        url: format!("/preview/{}/{port}/?{TOKEN_PARAM}={token}", sandbox.id),
        expires_at: kiln_runtime::sandbox::rfc3339(grant.expires_ms),
        token,
    })
}

/// The caller a preview request acts as: the owner's key, or the grant of a valid token
/// for this very sandbox and port. `None`: answer 404.
pub fn preview_caller(state: &AppState, request: &Request) -> Option<Caller> {
    let (id, port, _) = parse_path(request.uri().path())?;
    caller_for(state, request, id, id, port).or_else(|| public_caller(state, request, id))
}

/// The owner of sandbox `id` when its previews are public (`publicPreviews`, or E2B's
/// default `allowPublicTraffic`) and the request carries no key (a wrong key stays refused).
fn public_caller(state: &AppState, request: &Request, id: &str) -> Option<Caller> {
    if presents_key(request) {
        return None;
    }
    let sandbox = state.runtime.registry.lookup(id)?.meta;
    if !sandbox.public_ports {
        return None;
    }
    state.auth.acting_for(&sandbox)
}

/// Who a request for sandbox `id` acts as, on a route a token may open too: the key it
/// carries (or the one tenant without keys), else the grant of a valid token for `scope` (the
/// sandbox, or `{id}/{terminal}`) and `port` (0 for a terminal). `None`: answer 404.
pub fn caller_for(
    state: &AppState,
    request: &Request,
    id: &str,
    scope: &str,
    port: u16,
) -> Option<Caller> {
    if presents_key(request) || matches!(state.auth, kiln_runtime::auth::Auth::Off) {
        return crate::gate::check_key(state, request).ok();
    }
    let grant = state.previews.check(&presented_token(request)?, now_ms())?;
    if grant.sandbox != scope || grant.port != port {
        return None;
    }
    let sandbox = state.runtime.registry.get(&grant.tenant, id).ok()?.meta;
    state.auth.acting_for(&sandbox)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_signed_scoped_and_expire() {
        let dir = tempfile_dir();
        let signer = Signer::open(&dir).unwrap();
        let grant = Grant {
            tenant: "t".into(),
            sandbox: "sb_1".into(),
            port: 8000,
            expires_ms: 2_000,
        };
        let token = signer.sign(&grant);
        assert_eq!(signer.check(&token, 1_000), Some(grant.clone()));
        assert_eq!(signer.check(&token, 2_000), None, "expired");
        // Another server's key, a changed payload, a cut token, garbage.
        let other = Signer { key: [7; 32] };
        assert_eq!(other.check(&token, 1_000), None);
        let (payload, mac) = token.split_once('.').unwrap();
        let forged = b64().encode("t\nsb_1\n8001\n2000");
        assert_eq!(signer.check(&format!("{forged}.{mac}"), 1_000), None);
        assert_eq!(signer.check(payload, 1_000), None);
        assert_eq!(signer.check("..", 1_000), None);
        // The key is kept: a restarted server checks the same tokens.
        assert_eq!(
            Signer::open(&dir).unwrap().check(&token, 1_000),
            Some(grant)
        );
        let _ = std::fs::remove_dir_all(dir);
    }

    fn tempfile_dir() -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "kiln-preview-test-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn preview_paths_name_a_sandbox_and_a_port() {
        assert_eq!(
            parse_path("/preview/sb_1/8000/a/b"),
            Some(("sb_1", 8000, "a/b"))
        );
        assert_eq!(parse_path("/preview/sb_1/8000/"), Some(("sb_1", 8000, "")));
        assert_eq!(parse_path("/preview/sb_1/8000"), Some(("sb_1", 8000, "")));
        for bad in [
            "/preview/sb_1",
            "/preview//80/",
            "/preview/sb_1/0/",
            "/preview/sb_1/99999/",
            "/x",
        ] {
            assert_eq!(parse_path(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_hmac_is_rfc_4231s() {
        // RFC 4231 test case 2 has a 4-byte key; kiln's keys are 32 bytes, zero-padded the
        // same way, so the padded key gives the same MAC.
        let mut key = [0u8; 32];
        key[..4].copy_from_slice(b"Jefe");
        let mac: String = hmac_sha256(&key, b"what do ya want for nothing?")
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            mac,
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }
}
