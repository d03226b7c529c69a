//! The API description (OpenAPI 3.1), generated from the handlers' and types' annotations,
//! served at `/openapi.json`, with Swagger UI at `/docs` and ReDoc at `/redoc` (both
//! embedded: the docs work offline).

use axum::http::header;
use axum::response::{Html, IntoResponse, Response};
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::{Modify, OpenApi};

use crate::{api, error, history, v1};

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
        v1::list, v1::create, v1::get, v1::delete, v1::renew,
        v1::execute, v1::execute_stream, v1::websocket, v1::cancel,
        v1::create_session, v1::list_sessions, v1::restart_session, v1::close_session,
        v1::list_files, v1::read_file, v1::write_file, v1::delete_file,
        api::healthz, api::readyz, api::metrics,
    ),
    components(schemas(error::ErrorBody, error::ErrorDetail, history::HistoryEntry)),
    modifiers(&BearerAuth),
    tags(
        (name = "sandbox", description = "The published sandbox contract (stable shapes)."),
        (name = "history", description = "Git-versioned workspaces: history, diff, rollback."),
        (name = "v1 sandboxes", description = "Sandboxes: list, create, renew, delete."),
        (name = "v1 executions", description = "Run code: plain, streamed (SSE, WebSocket), cancel."),
        (name = "v1 sessions", description = "Stateful code contexts."),
        (name = "v1 files", description = "Workspace files, binary-safe."),
        (name = "operations", description = "Health, readiness, metrics (no key needed)."),
    )
)]
pub struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)),
        );
        let public = ["/healthz", "/readyz", "/metrics"];
        for (path, item) in openapi.paths.paths.iter_mut() {
            if public.contains(&path.as_str()) {
                continue;
            }
            for operation in [
                &mut item.get,
                &mut item.post,
                &mut item.put,
                &mut item.delete,
            ]
            .into_iter()
            .flatten()
            {
                operation.security = Some(vec![utoipa::openapi::security::SecurityRequirement::new(
                    "bearer",
                    Vec::<String>::new(),
                )]);
            }
        }
    }
}

/// The description, as JSON text (built once).
pub fn spec_json() -> &'static str {
    static SPEC: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SPEC.get_or_init(|| {
        ApiDoc::openapi()
            .to_pretty_json()
            .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    })
}

pub async fn openapi_json() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], spec_json()).into_response()
}

pub async fn swagger_page() -> Html<&'static str> {
    Html(
        r##"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kiln API</title>
<link rel="stylesheet" href="/docs/swagger-ui.css"></head>
<body><div id="ui"></div>
<script src="/docs/swagger-ui-bundle.js"></script>
<script>window.ui = SwaggerUIBundle({url: "/openapi.json", dom_id: "#ui", deepLinking: true, persistAuthorization: true});</script>
</body></html>"##,
    )
}

pub async fn redoc_page() -> Html<&'static str> {
    Html(
        r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kiln API</title></head>
<body><redoc spec-url="/openapi.json"></redoc>
<script src="/redoc/redoc.standalone.js"></script>
</body></html>"#,
    )
}

fn asset(content_type: &'static str, bytes: &'static [u8]) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "public, max-age=86400"),
        ],
        bytes,
    )
        .into_response()
}

pub async fn swagger_js() -> Response {
    asset(
        "text/javascript",
        include_bytes!("../assets/swagger-ui-bundle.js"),
    )
}

pub async fn swagger_css() -> Response {
    asset("text/css", include_bytes!("../assets/swagger-ui.css"))
}

pub async fn redoc_js() -> Response {
    asset(
        "text/javascript",
        include_bytes!("../assets/redoc.standalone.js"),
    )
}
