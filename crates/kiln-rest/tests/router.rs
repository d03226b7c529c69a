//! The `kiln rest` routes and their error shapes, without sockets or processes: the router
//! is called with `tower::ServiceExt::oneshot`, over a pool whose workers serve the fake
//! backend in this process (`kiln_executor::fake`). The fake backend runs no Python, so a
//! request that reaches a tenant's session ends where the driver is loaded; what comes
//! before (auth, tenants, paths, bodies, admission, the error envelope) is all here. Plans
//! and their replies are covered by the process-level tests in crates/kiln/tests.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{HeaderMap, Request, StatusCode, header};
use kiln_executor::ExecutorPool;
use kiln_rest::{Planner, RestConfig};
use serde_json::{Value, json};
use tower::ServiceExt;

type TestResult = Result<(), Box<dyn std::error::Error>>;

struct Rest {
    router: Router,
    pool: Arc<ExecutorPool>,
    data: tempfile::TempDir,
}

/// A kiln rest over one in-process fake worker, its body limit 64 bytes.
fn rest(configure: impl FnOnce(&mut RestConfig)) -> Rest {
    let data = tempfile::tempdir().expect("a temporary folder");
    let mut config = RestConfig::new(
        ([127, 0, 0, 1], 0).into(),
        data.path().to_path_buf(),
        Planner::Conventions,
    );
    config.max_body_bytes = 64;
    configure(&mut config);
    let pool = Arc::new(ExecutorPool::new(kiln_executor::fake::pool_config(1)));
    let router = kiln_rest::router(config, pool.clone()).expect("the router");
    Rest { router, pool, data }
}

#[derive(Debug)]
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Vec<u8>,
    json: Value,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The envelope with this status, code and message, its request id the one in
    /// `X-Request-ID`; returns the request id.
    fn assert_error(&self, status: StatusCode, code: &str, message: &str) -> String {
        assert_eq!(self.status, status, "{self:?}");
        assert_eq!(self.header("content-type"), Some("application/json"));
        let request_id = self
            .header("x-request-id")
            .expect("X-Request-ID")
            .to_owned();
        assert_eq!(
            self.json,
            json!({"error": {"code": code, "message": message, "details": {},
                             "request_id": request_id}}),
        );
        request_id
    }
}

/// A request from 192.0.2.1 (the catch-all reads the client's address from `ConnectInfo`).
fn request(method: &str, path: &str) -> axum::http::request::Builder {
    let peer = SocketAddr::from(([192, 0, 2, 1], 40_000));
    Request::builder()
        .method(method)
        .uri(path)
        .extension(ConnectInfo(peer))
}

impl Rest {
    async fn call(&self, request: Request<Body>) -> Answer {
        let response = self
            .router
            .clone()
            .oneshot(request)
            .await
            .expect("the router answers");
        let (parts, body) = response.into_parts();
        let body = axum::body::to_bytes(body, 64 << 20)
            .await
            .expect("a body")
            .to_vec();
        let json = serde_json::from_slice(&body).unwrap_or(Value::Null);
        Answer {
            status: parts.status,
            headers: parts.headers,
            body,
            json,
        }
    }

    async fn get(&self, path: &str) -> Answer {
        self.call(request("GET", path).body(Body::empty()).unwrap())
            .await
    }
}

#[tokio::test]
async fn healthz_reports_the_planner_the_workers_and_the_plan_cache() -> TestResult {
    let rest = rest(|_| {});
    // The pool starts its workers on first use: none yet.
    let cold = rest.get("/healthz").await;
    assert_eq!(cold.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(cold.json["status"], "no executor workers", "{cold:?}");
    rest.pool.start_all()?;
    let warm = rest.get("/healthz").await;
    assert_eq!(warm.status, StatusCode::OK);
    assert_eq!(
        warm.json,
        json!({
            "status": "ok",
            "planner": "conventions (not an LLM)",
            "workers": 1,
            "tenant_sessions": 0,
            "max_tenant_sessions": 64,
            "evicted_sessions": 0,
            "plan_cache": {"hits": 0, "misses": 0, "hit_rate": 0.0},
        })
    );
    Ok(())
}

#[tokio::test]
async fn the_fixed_routes_serve_the_spec_and_the_docs() -> TestResult {
    let rest = rest(|_| {});
    let spec = rest.get("/openapi.json").await;
    assert_eq!(spec.status, StatusCode::OK);
    assert_eq!(spec.header("content-type"), Some("application/json"));
    assert_eq!(spec.json["info"]["title"], "kiln rest");
    let error = &spec.json["components"]["schemas"]["Error"]["properties"]["error"];
    assert_eq!(
        error["required"],
        json!(["code", "message", "details", "request_id"])
    );
    for (path, kind) in [("/docs", "text/html"), ("/redoc", "text/html")] {
        let page = rest.get(path).await;
        assert_eq!(page.status, StatusCode::OK, "{path}");
        assert!(
            page.header("content-type")
                .is_some_and(|t| t.starts_with(kind))
        );
    }
    Ok(())
}

#[tokio::test]
async fn a_method_a_fixed_route_does_not_serve_is_405_with_allow() -> TestResult {
    let rest = rest(|_| {});
    let answer = rest
        .call(request("POST", "/healthz").body(Body::empty())?)
        .await;
    let request_id = answer.assert_error(
        StatusCode::METHOD_NOT_ALLOWED,
        "METHOD_NOT_ALLOWED",
        "POST is not served on /healthz; the Allow header lists what is",
    );
    assert!(request_id.starts_with("rest-"), "{request_id}");
    assert_eq!(answer.header("allow"), Some("GET,HEAD"));

    // The caller's request id is the one in the body.
    let given = request("DELETE", "/openapi.json")
        .header("x-request-id", "req-42")
        .body(Body::empty())?;
    let answer = rest.call(given).await;
    assert_eq!(answer.json["error"]["request_id"], "req-42");
    assert_eq!(answer.header("x-request-id"), Some("req-42"));
    Ok(())
}

#[tokio::test]
async fn a_method_the_catch_all_does_not_serve_is_405_with_allow() -> TestResult {
    let rest = rest(|_| {});
    let answer = rest
        .call(request("TRACE", "/members/").body(Body::empty())?)
        .await;
    answer.assert_error(
        StatusCode::METHOD_NOT_ALLOWED,
        "METHOD_NOT_ALLOWED",
        "TRACE is not served; use GET, POST, PUT, PATCH, DELETE, OPTIONS or HEAD",
    );
    assert_eq!(
        answer.header("allow"),
        Some("GET, POST, PUT, PATCH, DELETE, OPTIONS, HEAD")
    );
    Ok(())
}

#[tokio::test]
async fn a_body_over_the_limit_is_413_declared_or_streamed() -> TestResult {
    let rest = rest(|_| {});
    let big = format!(r#"{{"name": "{}"}}"#, "x".repeat(100));
    let declared = request("POST", "/members/")
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONTENT_LENGTH, big.len())
        .body(Body::from(big.clone()))?;
    let streamed = request("POST", "/members/")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(big))?;
    for sent in [declared, streamed] {
        rest.call(sent).await.assert_error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "BODY_TOO_LARGE",
            "the body is larger than 64 bytes",
        );
    }
    Ok(())
}

#[tokio::test]
async fn a_json_body_that_is_not_json_is_400() -> TestResult {
    let rest = rest(|_| {});
    for content_type in [
        Some("application/json"),
        Some("application/merge-patch+json"),
        None,
    ] {
        let mut sent = request("PATCH", "/members/1");
        if let Some(content_type) = content_type {
            sent = sent.header(header::CONTENT_TYPE, content_type);
        }
        let answer = rest.call(sent.body(Body::from(r#"{"name": "#))?).await;
        answer.assert_error(
            StatusCode::BAD_REQUEST,
            "MALFORMED_JSON",
            "the body is not valid JSON: EOF while parsing a value at line 1 column 9",
        );
    }
    // Nothing of the tenant was created.
    assert!(!rest.data.path().join("tenants/public").exists());
    Ok(())
}

#[tokio::test]
async fn hostile_paths_and_session_ids_are_400() -> TestResult {
    let rest = rest(|_| {});
    rest.get("/members/%2F").await.assert_error(
        StatusCode::BAD_REQUEST,
        "INVALID_PATH",
        "a path segment holds a control character or an encoded '/'",
    );
    rest.get("/%2e%2e/x").await.assert_error(
        StatusCode::BAD_REQUEST,
        "INVALID_PATH",
        "'.' and '..' are not path segments here",
    );
    let bad_tenant = request("GET", "/members/")
        .header("x-session-id", "../etc")
        .body(Body::empty())?;
    rest.call(bad_tenant).await.assert_error(
        StatusCode::BAD_REQUEST,
        "INVALID_SESSION_ID",
        "X-Session-ID must be 1 to 64 letters, digits, '_' or '-'",
    );
    // HEAD: the status and headers, no body.
    let head = request("HEAD", "/members/%00").body(Body::empty())?;
    let answer = rest.call(head).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert!(answer.body.is_empty(), "{answer:?}");
    assert!(answer.header("x-request-id").is_some());
    Ok(())
}

#[tokio::test]
async fn with_a_token_every_request_needs_it() -> TestResult {
    let rest = rest(|config| config.auth_token = Some("s3cret".to_owned().into()));
    for (authorization, message) in [
        (
            None,
            "send Authorization: Bearer <token> (the token kiln rest was started with)",
        ),
        (Some("Bearer wrong"), "the bearer token is not valid"),
        (
            Some("Basic czNjcmV0"),
            "send Authorization: Bearer <token> (the token kiln rest was started with)",
        ),
    ] {
        let mut sent = request("GET", "/members/");
        if let Some(authorization) = authorization {
            sent = sent.header(header::AUTHORIZATION, authorization);
        }
        let answer = rest.call(sent.body(Body::empty())?).await;
        answer.assert_error(StatusCode::UNAUTHORIZED, "UNAUTHORIZED", message);
        assert_eq!(
            answer.header("www-authenticate"),
            Some("Bearer realm=\"kiln rest\"")
        );
    }
    // The token lets the request through to the tenant's sandbox (which the fake backend
    // cannot load the driver in).
    let sent = request("GET", "/members/")
        .header(header::AUTHORIZATION, "Bearer s3cret")
        .body(Body::empty())?;
    assert_eq!(rest.call(sent).await.json["error"]["code"], "SANDBOX_SETUP");
    Ok(())
}

/// Through admission, the session cap and the pool to the tenant's session; the fake
/// backend cannot run the Python driver, so loading it fails, and the request leaves
/// nothing behind: no session counted, no tenant folder.
#[tokio::test]
async fn a_request_reaches_the_tenants_sandbox_and_a_failed_one_leaves_nothing() -> TestResult {
    let rest = rest(|_| {});
    let sent = request("POST", "/members/")
        .header(header::CONTENT_TYPE, "application/json")
        .header("x-session-id", "team-a")
        .body(Body::from(r#"{"name": "Hartmann"}"#))?;
    let answer = rest.call(sent).await;
    answer.assert_error(
        StatusCode::INTERNAL_SERVER_ERROR,
        "SANDBOX_SETUP",
        "the driver could not be loaded: unknown statement \"import\"",
    );
    assert_eq!(answer.header("x-kiln-planner"), None, "nothing was planned");
    assert!(!rest.data.path().join("tenants/team-a").exists());
    let health = rest.get("/healthz").await;
    assert_eq!(
        health.json["workers"], 1,
        "the pool started for the request"
    );
    assert_eq!(health.json["tenant_sessions"], 0);
    Ok(())
}

#[tokio::test]
async fn an_address_out_of_new_tenants_is_429_with_retry_after() -> TestResult {
    let rest = rest(|config| config.new_tenants_per_minute = 1);
    let as_tenant = |tenant: &str| {
        request("GET", "/members/")
            .header("x-session-id", tenant)
            .body(Body::empty())
    };
    let first = rest.call(as_tenant("first")?).await;
    assert_eq!(first.json["error"]["code"], "SANDBOX_SETUP", "{first:?}");
    let second = rest.call(as_tenant("second")?).await;
    let retry = second
        .header("retry-after")
        .expect("Retry-After")
        .parse::<u64>()?;
    assert!((1..=60).contains(&retry), "{retry}");
    second.assert_error(
        StatusCode::TOO_MANY_REQUESTS,
        "TOO_MANY_NEW_TENANTS",
        &format!(
            "this address has used up its 1 new tenants a minute; retry in {retry} s, or use \
             a tenant it already has"
        ),
    );
    Ok(())
}

/// An extractor's own refusal (here the client address a test forgot) gets the envelope too.
#[tokio::test]
async fn an_extractors_refusal_gets_the_envelope() -> TestResult {
    let rest = rest(|_| {});
    let without_address = Request::get("/members/").body(Body::empty())?;
    rest.call(without_address).await.assert_error(
        StatusCode::INTERNAL_SERVER_ERROR,
        "INTERNAL",
        "Internal Server Error",
    );
    Ok(())
}
