//! The API description (OpenAPI 3.1), generated from the handlers' and types' annotations,
//! served at `/openapi.json`, with Swagger UI at `/docs` and ReDoc at `/redoc` (both
//! embedded: the docs work offline).

use axum::http::header;
use axum::response::{IntoResponse, Response};
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::{Modify, OpenApi};

use crate::{api, error, history, v1};

mod mcp;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "kiln",
        description = "Run untrusted code (Python 3.15 with numpy/pandas/scipy/scikit-learn/matplotlib, JavaScript) in WebAssembly sandboxes. Every route but the operational ones needs `Authorization: Bearer <key>` (keys: `kiln keys create`). Errors are `{\"error\": {\"code\", \"message\", \"details\"}}` with stable codes.",
        license(name = "Apache-2.0"),
    ),
    paths(
        api::create, api::exec, api::get, api::delete,
        api::history, api::diff, api::rollback,
        crate::templates::list,
        crate::keys::me, crate::keys::list, crate::keys::create, crate::keys::update, crate::keys::revoke, crate::keys::tenants, crate::cluster::view,
        v1::list, v1::create, v1::get, v1::delete, v1::renew, v1::set_network,
        crate::snapshots::take, crate::snapshots::fork, crate::snapshots::list, crate::snapshots::get, crate::snapshots::delete,
        crate::workspaces::create, crate::workspaces::list, crate::workspaces::get, crate::workspaces::delete, crate::workspaces::start, crate::workspaces::stop, crate::workspaces::add_service, crate::workspaces::sql, crate::workspaces::preview, crate::workspaces::list_files, crate::workspaces::read_file, crate::workspaces::write_file, crate::workspaces::delete_file, crate::workspaces::history, crate::workspaces::collaborators,
        crate::workflows::templates, crate::workflows::create, crate::workflows::list, crate::workflows::get, crate::workflows::events, crate::workflows::cancel_route, crate::workflows::submit, crate::workflows::review,
        crate::volumes::list, crate::volumes::create, crate::volumes::get, crate::volumes::delete,
        crate::secrets::list, crate::secrets::create, crate::secrets::get, crate::secrets::update, crate::secrets::delete,
        crate::boxes::list, crate::boxes::signal, crate::boxes::restart, crate::boxes::pause, crate::boxes::resume, crate::boxes::hibernate,
        crate::preview::ports, crate::preview::create_link, crate::site::create_link, crate::boxes::events,
        crate::terminals::create, crate::terminals::list, crate::terminals::attach, crate::terminals::delete, crate::terminals::link,
        v1::execute, v1::execute_stream, v1::websocket, v1::cancel,
        v1::create_session, v1::list_sessions, v1::restart_session, v1::fork_session, v1::close_session,
        v1::list_files, v1::read_file, v1::write_file, v1::delete_file,
        crate::chat::chat,
        api::healthz, api::readyz, api::metrics,
    ),
    components(schemas(error::ErrorBody, error::ErrorDetail, history::HistoryEntry)),
    modifiers(&BearerAuth),
    tags(
        (name = "sandbox", description = "The published sandbox contract (stable shapes)."),
        (name = "history", description = "Git-versioned workspaces: history, diff, rollback."),
        (name = "v1 keys", description = "Who the caller is, its quotas and usage (`/me`, any key); an admin key's keys and every tenant's usage."),
        (name = "v1 cluster", description = "The nodes of the cluster this server is part of (`kiln serve --database`)."),
        (name = "v1 sandboxes", description = "Sandboxes: list, create, renew, delete."),
        (name = "v1 snapshots", description = "Snapshots and forks of Linux sandboxes: their files, history and (where CRIU can) running processes, copied on write where the file system can."),
        (name = "v1 workspaces", description = "Workspaces: long-lived Linux sandboxes with services (postgres, redis, mysql, nginx) and run_sql."),
        (name = "v1 workflows", description = "Workflows: a creator agent and a reviewer agent (or people) work on a workspace in turns until the work is approved or rejected; every event is also a note in the workspace history."),
        (name = "v1 volumes", description = "Each tenant's named volumes: storage that outlives sandboxes, mounted into several (volumeMounts at create)."),
        (name = "v1 secrets", description = "Each tenant's secrets: values network rules put into requests to named hosts, never into a sandbox, never returned."),
        (name = "v1 boxes", description = "A Linux sandbox's box: its processes, signals, restart, pause and resume."),
        (name = "v1 terminals", description = "Terminals you can leave and reattach to, with replay, viewers and a browser page."),
        (name = "v1 executions", description = "Run code: plain, streamed (SSE, WebSocket), cancel."),
        (name = "v1 sessions", description = "Stateful code contexts."),
        (name = "v1 files", description = "Workspace files, binary-safe."),
        (name = "v1 chat", description = "A model that runs code: tool calls, live output, artifacts, structured answers."),
        (name = "operations", description = "Health, readiness, metrics (no key needed)."),
    )
)]
pub struct ApiDoc;

struct BearerAuth;

/// Errors any operation may answer besides its own (auth, limits, body problems, overload).
const COMMON_ERRORS: &[(&str, &str)] = &[
    ("400", "Malformed JSON, wrong types, or a bad value"),
    ("401", "No API key, or one that is unknown or revoked"),
    ("404", "No such sandbox (or it belongs to another tenant)"),
    (
        "408",
        "The request took longer than the server's request timeout",
    ),
    ("413", "The body is larger than 32 MiB"),
    ("415", "The body is not `application/json`"),
    (
        "429",
        "Too many requests for this key (RATE_LIMITED; see `Retry-After`), or over one of the tenant's quotas (QUOTA_EXCEEDED; `details` names it)",
    ),
    ("503", "Executor lost or saturated; retry"),
];

/// The example each error status shows, with a code that status really carries (the error
/// schema's own example, `SANDBOX_NOT_FOUND`, would otherwise stand for every one of them).
const ERROR_EXAMPLES: &[(&str, &str, &str)] = &[
    (
        "400",
        "INVALID_REQUEST",
        "the body is not a valid request: timeoutMs: invalid type: string \"5s\", expected u64",
    ),
    (
        "401",
        "UNAUTHORIZED",
        "the API key is not valid (unknown or revoked)",
    ),
    (
        "404",
        "SANDBOX_NOT_FOUND",
        "no sandbox \"sb_0123\": it never existed, was deleted, or expired",
    ),
    (
        "408",
        "REQUEST_TIMEOUT",
        "the request took longer than 600 s",
    ),
    (
        "409",
        "SANDBOX_BUSY",
        "sandbox sb_0123 is running python_run_0456; retry when it finishes (or cancel it)",
    ),
    (
        "413",
        "BODY_TOO_LARGE",
        "the body is larger than the limit of 32 MiB",
    ),
    (
        "415",
        "UNSUPPORTED_MEDIA_TYPE",
        "the body must be application/json (Content-Type: \"text/plain\")",
    ),
    (
        "429",
        "RATE_LIMITED",
        "too many requests for this key; retry in 1 s",
    ),
    (
        "503",
        "EXECUTOR_LOST",
        "the executor running this code died (it exited); it has been replaced, retry",
    ),
];

fn error_response(description: &str) -> utoipa::openapi::RefOr<utoipa::openapi::Response> {
    use utoipa::openapi::{ContentBuilder, Ref, ResponseBuilder};
    ResponseBuilder::new()
        .description(description)
        .content(
            "application/json",
            ContentBuilder::new()
                .schema(Some(Ref::from_schema_name("ErrorBody")))
                .build(),
        )
        .build()
        .into()
}

/// A stable, unique operation id from the method and path: `post_api_v1_sandboxes_id_exec`.
fn operation_id(method: &str, path: &str) -> String {
    let mut id = method.to_owned();
    for part in path.split('/').filter(|p| !p.is_empty()) {
        id.push('_');
        id.push_str(&part.replace(['{', '}'], "").replace(['.', '-'], "_"));
    }
    id
}

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)),
        );
        let takes_id = name_and_secure(openapi);
        link_created(openapi, &takes_id);
        link_nested(openapi);
        plain_summaries(openapi);
        example_errors(openapi);
    }
}

/// The operations of every path, mutably.
fn operations(
    openapi: &mut utoipa::openapi::OpenApi,
) -> impl Iterator<Item = &mut utoipa::openapi::path::Operation> {
    openapi.paths.paths.values_mut().flat_map(|item| {
        [
            &mut item.get,
            &mut item.post,
            &mut item.put,
            &mut item.patch,
            &mut item.delete,
        ]
        .into_iter()
        .flatten()
    })
}

/// Swagger UI and ReDoc show a summary as plain text, so markdown in one shows its backticks.
/// utoipa makes a handler's first doc paragraph the summary, on one line here; where that
/// holds code, the summary keeps its first clause and the whole paragraph leads the
/// description, where markdown renders.
fn plain_summaries(openapi: &mut utoipa::openapi::OpenApi) {
    for operation in operations(openapi) {
        let Some(summary) = operation.summary.take() else {
            continue;
        };
        if !summary.contains('`') {
            operation.summary = Some(summary.split_whitespace().collect::<Vec<_>>().join(" "));
            continue;
        }
        let head = summary
            .find([':', '.'])
            .map_or(summary.as_str(), |end| &summary[..end]);
        let plain = if head.contains('`') {
            summary.replace('`', "")
        } else {
            head.to_owned()
        };
        operation.summary = Some(plain.split_whitespace().collect::<Vec<_>>().join(" "));
        operation.description = Some(match operation.description.take() {
            Some(rest) => format!("{summary}\n\n{rest}"),
            None => summary,
        });
    }
}

/// Gives each error answer an example whose code fits its status ([`ERROR_EXAMPLES`]).
fn example_errors(openapi: &mut utoipa::openapi::OpenApi) {
    for operation in operations(openapi) {
        for (status, response) in operation.responses.responses.iter_mut() {
            let utoipa::openapi::RefOr::T(response) = response else {
                continue;
            };
            let Some((_, code, message)) = ERROR_EXAMPLES.iter().find(|(s, ..)| s == status) else {
                continue;
            };
            if let Some(content) = response.content.get_mut("application/json")
                && content.example.is_none()
            {
                content.example = Some(serde_json::json!({
                    "error": {"code": code, "message": message, "details": {}}
                }));
            }
        }
    }
}

/// Names every operation, asks for the bearer key on all but the public ones and adds the
/// common error answers; returns the operations that take a sandbox id.
fn name_and_secure(openapi: &mut utoipa::openapi::OpenApi) -> Vec<String> {
    let public = ["/healthz", "/readyz", "/metrics"];
    // Operations that take a sandbox id, for links from the creating operations.
    let mut takes_id = Vec::new();
    for (path, item) in openapi.paths.paths.iter_mut() {
        for (method, operation) in [
            ("get", &mut item.get),
            ("post", &mut item.post),
            ("put", &mut item.put),
            ("patch", &mut item.patch),
            ("delete", &mut item.delete),
        ] {
            let Some(operation) = operation else { continue };
            let id = operation_id(method, path);
            operation.operation_id = Some(id.clone());
            if path.contains("{id}")
                && !path.contains("{execution_id}")
                && !path.contains("{session_id}")
                && !path.ends_with("/ws")
                && !path.contains("{path}")
            {
                takes_id.push(id);
            }
            if public.contains(&path.as_str()) {
                continue;
            }
            operation.security = Some(vec![utoipa::openapi::security::SecurityRequirement::new(
                "bearer",
                Vec::<String>::new(),
            )]);
            for (status, description) in COMMON_ERRORS {
                operation
                    .responses
                    .responses
                    .entry((*status).to_owned())
                    .or_insert_with(|| error_response(description));
            }
        }
    }
    takes_id
}

/// Links let clients (and schemathesis' stateful tests) follow a created sandbox's id into
/// the operations that take it.
fn link_created(openapi: &mut utoipa::openapi::OpenApi, takes_id: &[String]) {
    use utoipa::openapi::link::LinkBuilder;
    for (path, field) in [
        ("/api/v1/sandboxes", "containerId"),
        ("/api/sandbox", "containerId"),
    ] {
        let Some(item) = openapi.paths.paths.get_mut(path) else {
            continue;
        };
        let Some(operation) = item.post.as_mut() else {
            continue;
        };
        let Some(utoipa::openapi::RefOr::T(created)) = operation.responses.responses.get_mut("201")
        else {
            continue;
        };
        for target in takes_id {
            let link = LinkBuilder::new()
                .operation_id(target.clone())
                .parameter("id", format!("$response.body#/{field}"))
                .build();
            created.links.insert(target.clone(), link.into());
        }
    }
}

/// A session's id leads to its restart, fork and close; an execution's to its cancel.
fn link_nested(openapi: &mut utoipa::openapi::OpenApi) {
    use utoipa::openapi::link::LinkBuilder;
    let nested = [
        (
            "/api/v1/sandboxes/{id}/sessions",
            "201",
            "session_id",
            "sessionId",
            &[
                "post_api_v1_sandboxes_id_sessions_session_id_restart",
                "post_api_v1_sandboxes_id_sessions_session_id_fork",
                "delete_api_v1_sandboxes_id_sessions_session_id",
            ][..],
        ),
        (
            "/api/v1/sandboxes/{id}/exec",
            "200",
            "execution_id",
            "executionId",
            &["post_api_v1_sandboxes_id_executions_execution_id_cancel"][..],
        ),
    ];
    for (path, status, param, field, targets) in nested {
        let Some(item) = openapi.paths.paths.get_mut(path) else {
            continue;
        };
        let Some(operation) = item.post.as_mut() else {
            continue;
        };
        let Some(utoipa::openapi::RefOr::T(response)) =
            operation.responses.responses.get_mut(status)
        else {
            continue;
        };
        for target in targets {
            let link = LinkBuilder::new()
                .operation_id(*target)
                .parameter("id", "$request.path.id")
                .parameter(param, format!("$response.body#/{field}"))
                .build();
            response.links.insert((*target).to_owned(), link.into());
        }
    }
}

/// The description, as JSON text (built once).
pub fn spec_json() -> &'static str {
    static SPEC: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SPEC.get_or_init(|| {
        let mut value = serde_json::to_value(ApiDoc::openapi()).unwrap_or_default();
        fix_link_names(&mut value);
        mcp::describe(&mut value);
        serde_json::to_string_pretty(&value).unwrap_or_default()
    })
}

/// utoipa 5.5 writes a link's `operationId` as `operation_id`; OpenAPI spells it in camel
/// case.
fn fix_link_names(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::Object(map) => {
            if let Some(links) = map.get_mut("links").and_then(|l| l.as_object_mut()) {
                for link in links.values_mut() {
                    if let Some(link) = link.as_object_mut()
                        && let Some(id) = link.remove("operation_id")
                    {
                        link.insert("operationId".into(), id);
                    }
                }
            }
            for child in map.values_mut() {
                fix_link_names(child);
            }
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(fix_link_names),
        _ => {}
    }
}

pub async fn openapi_json() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], spec_json()).into_response()
}

pub use kiln_http::docs::{redoc_js, redoc_page, swagger_css, swagger_js, swagger_page};

#[cfg(test)]
mod tests {
    use serde_json::Value;

    fn spec() -> Value {
        serde_json::from_str(super::spec_json()).expect("the description is JSON")
    }

    fn operations(spec: &Value) -> Vec<(String, &Value)> {
        let mut found = Vec::new();
        for (path, item) in spec["paths"].as_object().expect("paths") {
            for (method, operation) in item.as_object().expect("a path item") {
                found.push((format!("{method} {path}"), operation));
            }
        }
        found
    }

    /// Every `description` and `summary` in the description, with where it is.
    fn texts<'a>(value: &'a Value, at: &str, found: &mut Vec<(String, &'a str)>) {
        match value {
            Value::Object(map) => {
                for (key, child) in map {
                    match (key.as_str(), child) {
                        ("description" | "summary", Value::String(text)) => {
                            found.push((format!("{at}/{key}"), text));
                        }
                        _ => texts(child, &format!("{at}/{key}"), found),
                    }
                }
            }
            Value::Array(items) => {
                for (index, child) in items.iter().enumerate() {
                    texts(child, &format!("{at}/{index}"), found);
                }
            }
            _ => {}
        }
    }

    /// Swagger UI and ReDoc print summaries as plain text: a backtick there shows.
    #[test]
    fn summaries_hold_no_markdown() {
        let spec = spec();
        for (operation, body) in operations(&spec) {
            let summary = body["summary"].as_str().unwrap_or_default();
            assert!(!summary.contains('`'), "{operation}: {summary}");
            assert!(!summary.contains('\n'), "{operation}: {summary}");
        }
        let stream = &spec["paths"]["/api/v1/sandboxes/{id}/exec/stream"]["post"];
        assert_eq!(
            stream["summary"],
            "Run code and stream its output as Server-Sent Events"
        );
        assert!(
            stream["description"]
                .as_str()
                .unwrap_or_default()
                .contains("`stdout` / `stderr`"),
            "{stream}"
        );
    }

    /// Markdown takes `<key>` outside a code span for an HTML tag and drops it
    /// ("Bearer <key>" renders as "Bearer ").
    #[test]
    fn no_text_reads_as_an_html_tag() {
        let spec = spec();
        let mut found = Vec::new();
        texts(&spec, "", &mut found);
        for (at, text) in found {
            let outside_code: String = text.split('`').step_by(2).collect();
            assert!(
                !outside_code
                    .split('<')
                    .skip(1)
                    .any(|after| after.starts_with(|c: char| c.is_ascii_alphabetic() || c == '/')),
                "{at}: {text}"
            );
        }
    }

    /// Issue 16: every 400 example said `SANDBOX_NOT_FOUND`.
    #[test]
    fn each_error_example_has_a_code_of_its_status() {
        let spec = spec();
        let mut checked = 0;
        for (operation, body) in operations(&spec) {
            for (status, response) in body["responses"].as_object().expect("responses") {
                let example = &response["content"]["application/json"]["example"];
                if example.is_null() {
                    continue;
                }
                let expected = super::ERROR_EXAMPLES
                    .iter()
                    .find(|(s, ..)| s == status)
                    .map(|(_, code, _)| *code);
                let code = example["error"]["code"].as_str();
                if status == "404" && operation.ends_with(" /mcp") {
                    assert_eq!(code, Some("SESSION_NOT_FOUND"), "{operation}");
                } else {
                    assert_eq!(code, expected, "{operation} {status}: {example}");
                }
                checked += 1;
            }
        }
        assert!(checked > 200, "only {checked} error examples");
        let create = &spec["paths"]["/api/sandbox"]["post"]["responses"]["400"];
        assert_eq!(
            create["content"]["application/json"]["example"]["error"]["code"],
            "INVALID_REQUEST"
        );
    }

    #[test]
    fn mcp_is_described() {
        let spec = spec();
        let mcp = &spec["paths"]["/mcp"];
        for (method, id) in [
            ("post", "post_mcp"),
            ("get", "get_mcp"),
            ("delete", "delete_mcp"),
        ] {
            assert_eq!(mcp[method]["operationId"], id);
            assert_eq!(mcp[method]["security"][0]["bearer"], serde_json::json!([]));
        }
        assert_eq!(
            mcp["post"]["requestBody"]["content"]["application/json"]["example"]["method"],
            "initialize"
        );
        assert!(
            spec["tags"]
                .as_array()
                .expect("tags")
                .iter()
                .any(|tag| tag["name"] == "mcp")
        );
    }
}
