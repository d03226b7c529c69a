//! The `kiln serve` routes and their error shapes, without sockets or processes: the router
//! is called with `tower::ServiceExt::oneshot`, over a pool whose workers serve the fake
//! backend in this process (`kiln_executor::fake`). Each test runs in milliseconds.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use kiln_core::template::{Catalogue, TemplateInfo};
use kiln_executor::ExecutorPool;
use kiln_runtime::quota::Quotas;
use kiln_server::{AppState, ServerConfig, router};
use serde_json::{Value, json};
use tower::ServiceExt;

struct App {
    state: Arc<AppState>,
    key: Option<String>,
    _data: tempfile::TempDir,
}

fn app(auth: bool) -> App {
    let data = tempfile::tempdir().expect("a temporary folder");
    // The fake backend serves these templates (its "python" is a toy language, not CPython).
    let mut python = TemplateInfo::example_python();
    python.backend = kiln_core::template::BackendKind::Fake;
    python.capabilities.fork = true;
    let mut javascript = python.clone();
    javascript.capabilities.fork = false;
    javascript.id = "javascript".into();
    javascript.languages = vec![kiln_core::Language::JavaScript];
    javascript.images.names = vec!["node".into()];
    javascript.images.repos = vec!["node".into()];
    javascript.images.versions = None;
    let config = ServerConfig {
        listen: ([127, 0, 0, 1], 0).into(),
        data_dir: data.path().to_path_buf(),
        auth,
        rate_limit: 0,
        request_timeout: std::time::Duration::from_secs(30),
        public_hosts: Vec::new(),
        preview_domain: None,
        workflow_templates: None,
        // Room for a handful of sessions at the default 512 MiB cap.
        quotas: Quotas {
            session_memory_bytes: 8 << 30,
            ..Quotas::default()
        },
        catalogue: Catalogue::new(vec![python, javascript]),
        llm: kiln_llm::LlmEnv::default(),
        routes: Vec::new(),
        max_exec_ms: kiln_runtime::exec::MAX_EXEC_MS,
        max_life_ms: None,
        e2b: None,
        tiers: Vec::new(),
        cluster: None,
        admission: Default::default(),
        worker_jail: Default::default(),
    };
    let key = auth.then(|| {
        kiln_runtime::auth::create_key(data.path(), "test", None, Default::default())
            .expect("a key")
            .1
    });
    let pool = ExecutorPool::new(kiln_executor::fake::pool_config(1));
    let state = Arc::new(
        AppState::open(
            &config,
            kiln_runtime::Pools::new(kiln_core::template::BackendKind::Fake, pool),
        )
        .expect("state"),
    );
    App {
        state,
        key,
        _data: data,
    }
}

impl App {
    /// One request through the whole router (gate, handlers, error layer).
    async fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> (StatusCode, Value, String) {
        let mut request = Request::builder().method(method).uri(path);
        if let Some(key) = &self.key {
            request = request.header(header::AUTHORIZATION, format!("Bearer {key}"));
        }
        if body.is_some() {
            request = request.header(header::CONTENT_TYPE, "application/json");
        }
        let request = request
            .body(body.map_or_else(Body::empty, |b| Body::from(b.to_owned())))
            .expect("a request");
        let response = router(self.state.clone())
            .oneshot(request)
            .await
            .expect("the router answers");
        let status = response.status();
        let allow = response
            .headers()
            .get(header::ALLOW)
            .map(|v| v.to_str().unwrap_or_default().to_owned())
            .unwrap_or_default();
        let bytes = axum::body::to_bytes(response.into_body(), 64 << 20)
            .await
            .expect("a body");
        let json = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        (status, json, allow)
    }

    async fn sandbox(&self) -> String {
        let (status, body, _) = self
            .call(
                "POST",
                "/api/v1/sandboxes",
                Some(r#"{"language": "python"}"#),
            )
            .await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        body["containerId"].as_str().expect("an id").to_owned()
    }

    async fn exec(&self, id: &str, body: Value) -> (StatusCode, Value) {
        let path = format!("/api/v1/sandboxes/{id}/exec");
        let (status, body, _) = self.call("POST", &path, Some(&body.to_string())).await;
        (status, body)
    }
}

/// Every error has the one shape: `{"error": {"code", "message", "details"}}`.
fn assert_error(status: StatusCode, body: &Value, want: StatusCode, code: &str) {
    assert_eq!(status, want, "{body}");
    assert_eq!(body["error"]["code"], code, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert!(body["error"]["details"].is_object(), "{body}");
}

#[tokio::test]
async fn code_runs_through_both_contracts() {
    let app = app(false);
    let id = app.sandbox().await;
    let (status, body) = app
        .exec(&id, json!({"code": "print hi\neprint oops"}))
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        (body["stdout"].as_str(), body["stderr"].as_str()),
        (Some("hi\n"), Some("oops\n"))
    );
    // The published contract: files, then a command that runs one of them.
    let exec = json!({"containerId": id, "files": {"main.py": "print from-file"}, "command": ["python", "main.py"]});
    let (status, body, _) = app
        .call("POST", "/api/sandbox/exec", Some(&exec.to_string()))
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["stdout"], "from-file\n", "{body}");
    assert_eq!(body["status"], "success", "{body}");
    // The upload is in the workspace and its history.
    let (status, body, _) = app
        .call("GET", &format!("/api/sandbox/{id}/history"), None)
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, body, _) = app
        .call("GET", &format!("/api/v1/sandboxes/{id}/files"), None)
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body.to_string().contains("main.py"), "{body}");
}

#[tokio::test]
async fn sessions_keep_state_between_turns() {
    let app = app(false);
    let id = app.sandbox().await;
    let (status, body, _) = app
        .call(
            "POST",
            &format!("/api/v1/sandboxes/{id}/sessions"),
            Some("{}"),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let session = body["sessionId"].as_str().expect("a session").to_owned();
    let (status, body) = app
        .exec(&id, json!({"code": "set x 41", "sessionId": session}))
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (_, body) = app
        .exec(&id, json!({"code": "get x", "sessionId": session}))
        .await;
    assert_eq!(body["stdout"], "41\n", "{body}");
}

#[tokio::test]
async fn templates_are_listed_and_images_resolve_through_them() {
    let app = app(false);
    let (status, body, _) = app.call("GET", "/api/v1/templates", None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["templates"][0]["id"], "python", "{body}");
    assert_eq!(body["templates"][1]["id"], "javascript", "{body}");
    let (status, body, _) = app
        .call(
            "POST",
            "/api/sandbox",
            Some(r#"{"image": "python:3.12-slim"}"#),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    for image in ["python:2.7", "ruby:3", ""] {
        let create = json!({ "image": image }).to_string();
        let (status, body, _) = app.call("POST", "/api/sandbox", Some(&create)).await;
        assert_error(status, &body, StatusCode::BAD_REQUEST, "UNKNOWN_IMAGE");
        assert_eq!(
            body["error"]["details"]["templates"],
            json!(["python", "javascript"])
        );
    }
}

#[tokio::test]
async fn bad_requests_get_the_one_error_shape() {
    let app = app(false);
    let id = app.sandbox().await;
    let cases: Vec<(&str, String, Option<&str>, StatusCode, &str)> = vec![
        (
            "POST",
            "/api/sandbox".into(),
            Some("{not json"),
            StatusCode::BAD_REQUEST,
            "MALFORMED_JSON",
        ),
        (
            "POST",
            "/api/sandbox".into(),
            Some(r#"{"image": 5}"#),
            StatusCode::BAD_REQUEST,
            "INVALID_REQUEST",
        ),
        (
            "POST",
            "/api/sandbox".into(),
            Some(r#"{"image": "python", "bogus": 1}"#),
            StatusCode::BAD_REQUEST,
            "INVALID_REQUEST",
        ),
        (
            "GET",
            "/api/v1/sandboxes/sb_000000000000000000000000".into(),
            None,
            StatusCode::NOT_FOUND,
            "SANDBOX_NOT_FOUND",
        ),
        (
            "GET",
            "/api/v1/nope".into(),
            None,
            StatusCode::NOT_FOUND,
            "ROUTE_NOT_FOUND",
        ),
        (
            "GET",
            format!("/api/v1/sandboxes/{id}/files/..%2Fetc%2Fpasswd"),
            None,
            StatusCode::BAD_REQUEST,
            "INVALID_PATH",
        ),
        (
            "POST",
            format!("/api/v1/sandboxes/{id}/exec"),
            Some(r#"{"code": "print x", "timeoutMs": "soon"}"#),
            StatusCode::BAD_REQUEST,
            "INVALID_REQUEST",
        ),
    ];
    for (method, path, body, want, code) in cases {
        let (status, answer, _) = app.call(method, &path, body).await;
        assert_error(status, &answer, want, code);
    }
    // 405 keeps its Allow header and gets the JSON body.
    let (status, body, allow) = app.call("DELETE", "/api/sandbox/exec", None).await;
    assert_error(
        status,
        &body,
        StatusCode::METHOD_NOT_ALLOWED,
        "METHOD_NOT_ALLOWED",
    );
    assert!(allow.contains("POST"), "Allow: {allow:?}");
}

#[tokio::test]
async fn backend_failures_map_to_their_codes() {
    let app = app(false);
    let id = app.sandbox().await;
    let (status, body) = app.exec(&id, json!({"code": "fail busy"})).await;
    assert_error(status, &body, StatusCode::SERVICE_UNAVAILABLE, "BUSY");
    let (status, body) = app.exec(&id, json!({"code": "fail unsupported"})).await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, "UNSUPPORTED");
    let (status, body) = app.exec(&id, json!({"code": "fail limits"})).await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, "INVALID_REQUEST");
    // A guest past its deadline is an answer, not an error.
    let (status, body) = app
        .exec(&id, json!({"code": "spin", "timeoutMs": 100}))
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["status"], "timeout", "{body}");
    // The sandbox is not left busy by any of it.
    let (status, body) = app.exec(&id, json!({"code": "print still-here"})).await;
    assert_eq!(
        (status, body["stdout"].as_str()),
        (StatusCode::OK, Some("still-here\n"))
    );
}

#[tokio::test]
async fn keys_are_required_when_auth_is_on() {
    let mut app = app(true);
    let (status, body, _) = app.call("GET", "/api/v1/sandboxes", None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    app.key = None;
    let (status, body, _) = app.call("GET", "/api/v1/sandboxes", None).await;
    assert_error(status, &body, StatusCode::UNAUTHORIZED, "UNAUTHORIZED");
    app.key = Some("kiln_not_a_real_key".into());
    let (status, body, _) = app.call("GET", "/api/v1/templates", None).await;
    assert_error(status, &body, StatusCode::UNAUTHORIZED, "UNAUTHORIZED");
    // Operational routes need no key.
    let (status, _, _) = app.call("GET", "/healthz", None).await;
    assert_eq!(status, StatusCode::OK);
}

/// Bodies are read by kiln-http's JSON extractor: 415 without a JSON content type, 413 over
/// the 32 MiB limit (declared or streamed), 400 naming the field that does not fit.
#[tokio::test]
async fn bodies_are_refused_with_clear_errors_in_the_one_shape() {
    let app = app(false);
    let send = |content_type: Option<&'static str>, length: Option<u64>, body: Vec<u8>| {
        let state = app.state.clone();
        async move {
            let mut request = Request::builder().method("POST").uri("/api/v1/sandboxes");
            if let Some(content_type) = content_type {
                request = request.header(header::CONTENT_TYPE, content_type);
            }
            if let Some(length) = length {
                request = request.header(header::CONTENT_LENGTH, length);
            }
            let response = router(state)
                .oneshot(request.body(Body::from(body)).expect("a request"))
                .await
                .expect("the router answers");
            let status = response.status();
            let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
                .await
                .expect("a body");
            let json: Value = serde_json::from_slice(&bytes).expect("a JSON body");
            (status, json)
        }
    };
    let (status, body) = send(Some("text/plain"), None, b"{}".to_vec()).await;
    assert_error(
        status,
        &body,
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "UNSUPPORTED_MEDIA_TYPE",
    );
    assert_eq!(
        body["error"]["message"],
        "the body must be application/json (Content-Type: \"text/plain\")"
    );
    let (status, body) = send(None, None, b"{}".to_vec()).await;
    assert_error(
        status,
        &body,
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "UNSUPPORTED_MEDIA_TYPE",
    );
    // Declared too large: refused before a byte is read.
    let (status, body) = send(Some("application/json"), Some(33 << 20), Vec::new()).await;
    assert_error(
        status,
        &body,
        StatusCode::PAYLOAD_TOO_LARGE,
        "BODY_TOO_LARGE",
    );
    // Streamed too large, with no length declared.
    let big = format!(r#"{{"language": "{}"}}"#, "p".repeat(33 << 20)).into_bytes();
    let (status, body) = send(Some("application/json"), None, big).await;
    assert_error(
        status,
        &body,
        StatusCode::PAYLOAD_TOO_LARGE,
        "BODY_TOO_LARGE",
    );
    let (status, body) = send(
        Some("application/json; charset=utf-8"),
        None,
        br#"{"language": "python", "timeoutMs": "soon"}"#.to_vec(),
    )
    .await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, "INVALID_REQUEST");
    assert_eq!(body["error"]["details"]["field"], "timeoutMs", "{body}");
    let (status, body) = send(
        Some("application/json"),
        None,
        br#"{"language": "python"}"#.to_vec(),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
}

impl App {
    /// A POST of `body` (any bytes) with `content_type`, through the whole router.
    async fn post_raw(
        &self,
        path: &str,
        content_type: Option<&str>,
        body: Vec<u8>,
    ) -> (StatusCode, Value) {
        let mut request = Request::builder().method("POST").uri(path);
        if let Some(content_type) = content_type {
            request = request.header(header::CONTENT_TYPE, content_type);
        }
        let response = router(self.state.clone())
            .oneshot(request.body(Body::from(body)).expect("a request"))
            .await
            .expect("the router answers");
        let status = response.status();
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .expect("a body");
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    async fn session(&self, id: &str, language: &str) -> String {
        let path = format!("/api/v1/sandboxes/{id}/sessions");
        let create = json!({ "language": language }).to_string();
        let (status, body, _) = self.call("POST", &path, Some(&create)).await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        body["sessionId"].as_str().expect("a session").to_owned()
    }
}

#[tokio::test]
async fn a_session_forks_into_its_sandbox_or_a_new_one() {
    let app = app(false);
    let id = app.sandbox().await;
    let parent = app.session(&id, "python").await;
    app.exec(&id, json!({"code": "set x 41", "sessionId": parent}))
        .await;
    let fork = format!("/api/v1/sandboxes/{id}/sessions/{parent}/fork");
    // No body, an empty object, and an explicit false all fork within the sandbox.
    let mut forks = Vec::new();
    for body in [None, Some("{}"), Some(r#"{"withWorkspace": false}"#)] {
        let (status, answer, _) = app.call("POST", &fork, body).await;
        assert_eq!(status, StatusCode::CREATED, "{answer}");
        assert_eq!(answer["sandboxId"], id.as_str(), "{answer}");
        assert_eq!(answer["forkedFrom"], parent.as_str(), "{answer}");
        assert_eq!(
            (
                answer["status"].as_str(),
                answer["turns"].as_u64(),
                answer["language"].as_str()
            ),
            (Some("ready"), Some(0), Some("python")),
            "{answer}"
        );
        forks.push(answer["sessionId"].as_str().expect("an id").to_owned());
    }
    let (_, ran) = app
        .exec(&id, json!({"code": "get x", "sessionId": forks[0]}))
        .await;
    assert_eq!(ran["stdout"], "41\n", "{ran}");
    let (_, list, _) = app
        .call("GET", &format!("/api/v1/sandboxes/{id}/sessions"), None)
        .await;
    assert_eq!(list["sessions"].as_array().map(Vec::len), Some(4), "{list}");

    // With its workspace: a new sandbox whose files start as the parent's.
    let upload = app
        .post_raw(
            &format!("/api/v1/sandboxes/{id}/exec"),
            Some("application/json"),
            json!({"code": "print x", "files": {"kept.txt": "before"}})
                .to_string()
                .into_bytes(),
        )
        .await;
    assert_eq!(upload.0, StatusCode::OK, "{}", upload.1);
    let (status, answer, _) = app
        .call("POST", &fork, Some(r#"{"withWorkspace": true}"#))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{answer}");
    let child_box = answer["sandboxId"].as_str().expect("a sandbox").to_owned();
    assert_ne!(child_box, id);
    let child = answer["sessionId"].as_str().expect("a session").to_owned();
    let (_, ran) = app
        .exec(&child_box, json!({"code": "get x", "sessionId": child}))
        .await;
    assert_eq!(ran["stdout"], "41\n", "{ran}");
    let (status, listed, _) = app
        .call("GET", &format!("/api/v1/sandboxes/{child_box}/files"), None)
        .await;
    assert_eq!(status, StatusCode::OK, "{listed}");
    assert!(listed.to_string().contains("kept.txt"), "{listed}");
    let (status, info, _) = app
        .call("GET", &format!("/api/v1/sandboxes/{child_box}"), None)
        .await;
    assert_eq!(status, StatusCode::OK, "{info}");
    assert_eq!(info["template"], "python", "{info}");

    // The route is in the API description, linked from session creation.
    let (_, spec, _) = app.call("GET", "/openapi.json", None).await;
    let path = &spec["paths"]["/api/v1/sandboxes/{id}/sessions/{session_id}/fork"]["post"];
    assert_eq!(
        path["operationId"],
        "post_api_v1_sandboxes_id_sessions_session_id_fork"
    );
    assert!(path["responses"]["201"].is_object(), "{path}");
}

#[tokio::test]
async fn fork_refusals_are_clear_and_in_the_one_shape() {
    let app = app(false);
    let id = app.sandbox().await;
    let parent = app.session(&id, "python").await;
    let fork = format!("/api/v1/sandboxes/{id}/sessions/{parent}/fork");
    let cases = [
        (
            "/api/v1/sandboxes/sb_000000000000000000000000/sessions/ses_x/fork".to_owned(),
            None,
            StatusCode::NOT_FOUND,
            "SANDBOX_NOT_FOUND",
        ),
        (
            format!("/api/v1/sandboxes/{id}/sessions/ses_nope/fork"),
            None,
            StatusCode::NOT_FOUND,
            "SESSION_NOT_FOUND",
        ),
        (
            fork.clone(),
            Some("{not json"),
            StatusCode::BAD_REQUEST,
            "MALFORMED_JSON",
        ),
        (
            fork.clone(),
            Some(r#"{"withWorkspace": "yes"}"#),
            StatusCode::BAD_REQUEST,
            "INVALID_REQUEST",
        ),
        (
            fork.clone(),
            Some(r#"{"bogus": 1}"#),
            StatusCode::BAD_REQUEST,
            "INVALID_REQUEST",
        ),
    ];
    for (path, body, want, code) in cases {
        let (status, answer, _) = app.call("POST", &path, body).await;
        assert_error(status, &answer, want, code);
    }
    let (status, answer) = app
        .post_raw(&fork, Some("text/plain"), b"{}".to_vec())
        .await;
    assert_error(
        status,
        &answer,
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "UNSUPPORTED_MEDIA_TYPE",
    );
    let big = format!(
        r#"{{"withWorkspace": false, "pad": "{}"}}"#,
        " ".repeat(70 << 10)
    );
    let (status, answer) = app
        .post_raw(&fork, Some("application/json"), big.into_bytes())
        .await;
    assert_error(
        status,
        &answer,
        StatusCode::PAYLOAD_TOO_LARGE,
        "BODY_TOO_LARGE",
    );
}

#[tokio::test]
async fn sessions_that_cannot_fork_say_so() {
    let app = app(false);
    let id = app.sandbox().await;
    let parent = app.session(&id, "python").await;
    let fork = format!("/api/v1/sandboxes/{id}/sessions/{parent}/fork");
    // Sessions a template cannot fork: a javascript sandbox's, a JavaScript session's.
    let (status, created, _) = app
        .call(
            "POST",
            "/api/v1/sandboxes",
            Some(r#"{"language": "javascript"}"#),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    let js_box = created["containerId"].as_str().expect("an id").to_owned();
    let js = app.session(&js_box, "javascript").await;
    let (status, answer, _) = app
        .call(
            "POST",
            &format!("/api/v1/sandboxes/{js_box}/sessions/{js}/fork"),
            None,
        )
        .await;
    assert_error(status, &answer, StatusCode::BAD_REQUEST, "UNSUPPORTED");
    assert!(
        answer["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("sessions of the javascript template cannot be forked")),
        "{answer}"
    );
    let js_in_python = app.session(&id, "javascript").await;
    let (status, answer, _) = app
        .call(
            "POST",
            &format!("/api/v1/sandboxes/{id}/sessions/{js_in_python}/fork"),
            Some(r#"{"withWorkspace": true}"#),
        )
        .await;
    assert_error(status, &answer, StatusCode::BAD_REQUEST, "UNSUPPORTED");

    // A session whose turn ran past its deadline has ended.
    let (_, ran) = app
        .exec(
            &id,
            json!({"code": "spin", "sessionId": parent, "timeoutMs": 100}),
        )
        .await;
    assert_eq!(ran["status"], "timeout", "{ran}");
    let (status, answer, _) = app.call("POST", &fork, None).await;
    assert_error(status, &answer, StatusCode::CONFLICT, "SESSION_ENDED");
    let (_, list, _) = app.call("GET", "/api/v1/sandboxes", None).await;
    assert_eq!(
        list["sandboxes"].as_array().map(Vec::len),
        Some(2),
        "no sandbox left behind: {list}"
    );
}
