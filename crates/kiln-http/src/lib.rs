//! What kiln's HTTP faces (`kiln serve`, `kiln rest`, `kiln runner`) share: the error
//! envelope and the middleware that gives the router's own errors that shape ([`error`]),
//! the JSON body extractor ([`Json`]), graceful shutdown, and the API docs pages (Swagger UI
//! at `/docs`, ReDoc at `/redoc`, both embedded so the docs work offline; each face serves
//! its own spec at `/openapi.json`).
//!
//! ```
//! use axum::{Router, http::StatusCode, routing::post};
//! use kiln_http::{HttpError, Json, RouterErrors, reshape_errors};
//!
//! async fn create(Json(body): Json<serde_json::Value>) -> Result<Json<serde_json::Value>, HttpError> {
//!     if body.get("name").is_none() {
//!         return Err(HttpError::new(StatusCode::BAD_REQUEST, "NAME_MISSING", "send a name"));
//!     }
//!     Ok(Json(body))
//! }
//!
//! // Bodies up to 1 MiB; a 404, 405, 413 or 415 of the router itself gets the envelope too.
//! let errors = RouterErrors::new(1 << 20);
//! let router: Router = Router::new()
//!     .route("/members", post(create))
//!     .layer(axum::middleware::from_fn_with_state(errors, reshape_errors));
//! ```

pub mod connect;
pub mod error;
pub mod json;
pub mod objects;
pub mod stream;
pub mod upload;

pub use error::{HttpError, RouterErrors, reshape_errors};
pub use json::{Json, JsonObject};

pub mod docs {
    //! The Swagger UI and ReDoc pages and their assets.

    use axum::http::header;
    use axum::response::{Html, IntoResponse, Response};

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

    /// The docs routes: `/docs` and `/redoc` with their assets.
    pub fn routes<S: Clone + Send + Sync + 'static>() -> axum::Router<S> {
        use axum::routing::get;
        axum::Router::new()
            .route("/docs", get(swagger_page))
            .route("/docs/swagger-ui-bundle.js", get(swagger_js))
            .route("/docs/swagger-ui.css", get(swagger_css))
            .route("/redoc", get(redoc_page))
            .route("/redoc/redoc.standalone.js", get(redoc_js))
    }
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
    tracing::info!(target: "kiln::http", "shutting down: finishing running requests");
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use axum::http::{Request, StatusCode, header};
    use tower::ServiceExt;

    #[tokio::test]
    async fn the_docs_pages_and_their_assets_are_served() {
        for (path, kind) in [
            ("/docs", "text/html"),
            ("/docs/swagger-ui-bundle.js", "text/javascript"),
            ("/docs/swagger-ui.css", "text/css"),
            ("/redoc", "text/html"),
            ("/redoc/redoc.standalone.js", "text/javascript"),
        ] {
            let request = Request::get(path).body(Body::empty()).unwrap();
            let response = super::docs::routes::<()>().oneshot(request).await.unwrap();
            assert_eq!(response.status(), StatusCode::OK, "{path}");
            let content_type = response.headers()[header::CONTENT_TYPE].to_str().unwrap();
            assert!(content_type.starts_with(kind), "{path}: {content_type}");
            let body = axum::body::to_bytes(response.into_body(), 8 << 20)
                .await
                .unwrap();
            assert!(body.len() > 200, "{path}: {} bytes", body.len());
        }
    }
}
