//! The web console (issue 36): `GET /console` serves one page, and `/console/assets/{name}`
//! its script, style and the vendored Preact + htm (`scripts/build-console`). All of it is
//! compiled into the binary; there is no build step for users. The page talks to the same
//! API as every client, with the key the person typed (kept in the tab's session storage),
//! so the console adds no route of its own beyond its files, and shows nothing a key could
//! not read through the API.

use axum::extract::Path;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};

const INDEX: &str = include_str!("../console/index.html");
const ASSETS: [(&str, &str, &str); 3] = [
    (
        "app.js",
        "text/javascript; charset=utf-8",
        include_str!("../console/app.js"),
    ),
    (
        "console.css",
        "text/css; charset=utf-8",
        include_str!("../console/console.css"),
    ),
    (
        "preact-htm.js",
        "text/javascript; charset=utf-8",
        include_str!("../console/vendor/preact-htm.js"),
    ),
];

/// What the console's pages may load: its own files only (no CDN), images from data and
/// blob URLs (figures, downloads), no inline script, and no framing by other sites.
const POLICY: &str = "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'";

fn page(content_type: &'static str, body: &'static str) -> Response {
    let mut response = (StatusCode::OK, body).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(POLICY),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// `GET /console`: to `/console/` (the assets are relative to it).
pub async fn root() -> Redirect {
    Redirect::permanent("/console/")
}

/// `GET /console/`: the page.
pub async fn index() -> Response {
    page("text/html; charset=utf-8", INDEX)
}

/// `GET /console/assets/{name}`.
pub async fn asset(Path(name): Path<String>) -> Response {
    match ASSETS.iter().find(|(n, _, _)| *n == name) {
        Some((_, content_type, body)) => page(content_type, body),
        None => crate::error::ApiError::new(
            StatusCode::NOT_FOUND,
            "NOT_FOUND",
            format!("the console has no file {name:?}"),
        )
        .into_response(),
    }
}
