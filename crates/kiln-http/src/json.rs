//! Reading JSON bodies with errors in the envelope: [`Json`] as an extractor, and its steps
//! ([`require_json`], [`read_body`], [`from_json`]) for a handler that reads the body itself.
//!
//! | status | code | when |
//! |---|---|---|
//! | 415 | `UNSUPPORTED_MEDIA_TYPE` | the `Content-Type` is not `application/json` or `application/*+json` |
//! | 413 | `BODY_TOO_LARGE` | the declared `Content-Length` or the body read is over the limit |
//! | 400 | `MALFORMED_JSON` | the body is not JSON (or has something after it) |
//! | 400 | `INVALID_REQUEST` | the JSON does not fit the type (`details.field` names where), or the body could not be read |

use axum::body::Body;
use axum::extract::{FromRequest, Request};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;

use crate::error::{BodyLimit, HttpError};

/// The body limit where no [`BodyLimit`] is set (axum's default): 2 MiB.
pub const DEFAULT_BODY_LIMIT: usize = 2 << 20;

/// A JSON body, read up to the face's [`BodyLimit`] (set by
/// [`reshape_errors`](crate::error::reshape_errors); [`DEFAULT_BODY_LIMIT`] without it), and
/// refused with an [`HttpError`]. As a response, it is `axum::Json`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Json<T>(pub T);

impl<T, S> FromRequest<S> for Json<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = HttpError;

    async fn from_request(request: Request, _state: &S) -> Result<Json<T>, HttpError> {
        from_json(&json_bytes(request).await?).map(Json)
    }
}

/// A JSON request's bytes: its content type checked, read up to the face's [`BodyLimit`].
async fn json_bytes(request: Request) -> Result<Bytes, HttpError> {
    let (parts, body) = request.into_parts();
    require_json(&parts.headers)?;
    let limit = parts
        .extensions
        .get::<BodyLimit>()
        .map_or(DEFAULT_BODY_LIMIT, |limit| limit.0);
    read_body(&parts.headers, body, limit).await
}

/// A request body that must be one JSON object (every request type of kiln's API is one):
/// read as [`Json`] reads it, and an array, string, number or null at the top is refused
/// with 400 `INVALID_REQUEST` (serde would otherwise fill a struct from an array by position).
#[derive(Debug, Clone, Copy, Default)]
pub struct JsonObject<T>(pub T);

impl<T, S> FromRequest<S> for JsonObject<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = HttpError;

    async fn from_request(request: Request, _state: &S) -> Result<JsonObject<T>, HttpError> {
        from_json_object(&json_bytes(request).await?).map(JsonObject)
    }
}

/// [`from_json`] of a body that must be a JSON object at the top.
pub fn from_json_object<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, HttpError> {
    let first = bytes.iter().find(|b| !b.is_ascii_whitespace());
    if first.is_some_and(|b| *b != b'{') {
        // Malformed JSON still says so; well-formed JSON that is not an object is refused.
        if serde_json::from_slice::<serde::de::IgnoredAny>(bytes).is_ok() {
            return Err(HttpError::new(
                StatusCode::BAD_REQUEST,
                "INVALID_REQUEST",
                "the body is not a valid request: it must be a JSON object",
            ));
        }
    }
    from_json(bytes)
}

impl<T: Serialize> IntoResponse for Json<T> {
    fn into_response(self) -> Response {
        axum::Json(self.0).into_response()
    }
}

/// `application/json` or `application/*+json`, any case, with any parameters.
pub fn is_json_content_type(value: &str) -> bool {
    let essence = value
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

/// 415 `UNSUPPORTED_MEDIA_TYPE` unless the `Content-Type` is JSON; the message names what
/// was sent.
pub fn require_json(headers: &HeaderMap) -> Result<(), HttpError> {
    let given = match headers.get(header::CONTENT_TYPE).map(|v| v.to_str()) {
        Some(Ok(value)) if is_json_content_type(value) => return Ok(()),
        None => "none".to_owned(),
        Some(Ok(value)) => format!("{value:?}"),
        Some(Err(_)) => "(not text)".to_owned(),
    };
    Err(HttpError::new(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "UNSUPPORTED_MEDIA_TYPE",
        format!("the body must be application/json (Content-Type: {given})"),
    ))
}

/// The body, at most `limit_bytes`: refused from its declared `Content-Length` before it is
/// read (so a client waiting on `Expect: 100-continue` hears at once), else cut off at the
/// limit while it is read. 413 `BODY_TOO_LARGE`; 400 `INVALID_REQUEST` when the body cannot
/// be read (the client went away).
pub async fn read_body(
    headers: &HeaderMap,
    body: Body,
    limit_bytes: usize,
) -> Result<Bytes, HttpError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit_bytes as u64) {
        return Err(HttpError::body_too_large(limit_bytes));
    }
    axum::body::to_bytes(body, limit_bytes)
        .await
        .map_err(|error| {
            let error = error.into_inner();
            if error.is::<http_body_util::LengthLimitError>() {
                HttpError::body_too_large(limit_bytes)
            } else {
                HttpError::new(
                    StatusCode::BAD_REQUEST,
                    "INVALID_REQUEST",
                    format!("the body could not be read: {error}"),
                )
            }
        })
}

/// `bytes` as a `T`: 400 `MALFORMED_JSON` when they are not JSON, 400 `INVALID_REQUEST`
/// when the JSON does not fit `T` (`details.field` is the dotted path, when there is one).
pub fn from_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, HttpError> {
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    // Structs only from objects: serde would fill one from an array by position.
    let objects = crate::objects::Objects(&mut deserializer);
    let value = serde_path_to_error::deserialize(objects).map_err(|error| {
        let path = error.path().to_string();
        let inner = error.into_inner();
        // Whether the bytes are JSON at all, asked of the whole body: a struct is refused at
        // its `[` before the rest is read, and serde_json calls an enum given `{}` a syntax
        // error ("expected value") though the body is well-formed. Skimming JSON (serde's
        // `IgnoredAny`) does not check strings' UTF-8, so that is checked first.
        if let Err(utf8) = std::str::from_utf8(bytes) {
            return HttpError::new(
                StatusCode::BAD_REQUEST,
                "MALFORMED_JSON",
                format!("the body is not valid JSON: it is not UTF-8 ({utf8})"),
            );
        }
        match serde_json::from_slice::<serde::de::IgnoredAny>(bytes) {
            Ok(_) => invalid_request(&path, &inner),
            Err(syntax) => HttpError::malformed_json(&syntax),
        }
    })?;
    deserializer
        .end()
        .map_err(|error| HttpError::malformed_json(&error))?;
    Ok(value)
}

fn invalid_request(path: &str, error: &serde_json::Error) -> HttpError {
    let refused = HttpError::new(
        StatusCode::BAD_REQUEST,
        "INVALID_REQUEST",
        format!("the body is not a valid request: {error}"),
    );
    if path == "." {
        refused
    } else {
        let message = format!("the body is not a valid request: {path}: {error}");
        HttpError::new(StatusCode::BAD_REQUEST, "INVALID_REQUEST", message)
            .with_details(json!({"field": path}))
    }
}

#[cfg(test)]
mod tests {
    use axum::Router;
    use axum::http::{HeaderValue, StatusCode};
    use axum::routing::post;
    use serde::Deserialize;
    use serde_json::{Value, json};
    use tower::ServiceExt;

    use super::*;
    use crate::error::{RouterErrors, reshape_errors};

    #[derive(Debug, Deserialize, Serialize)]
    struct Member {
        name: String,
        #[serde(default)]
        tags: Vec<String>,
    }

    fn router(limit: usize) -> Router {
        async fn create(Json(member): Json<Member>) -> Json<Member> {
            Json(member)
        }
        Router::new()
            .route("/members", post(create))
            .layer(axum::middleware::from_fn_with_state(
                RouterErrors::new(limit),
                reshape_errors,
            ))
    }

    async fn post_body(content_type: Option<&str>, body: Body) -> (StatusCode, Value) {
        let mut request = Request::post("/members");
        if let Some(content_type) = content_type {
            request = request.header(header::CONTENT_TYPE, content_type);
        }
        let response = router(64)
            .oneshot(request.body(body).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap();
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    fn error(code: &str, message: &str, details: Value) -> Value {
        json!({"error": {"code": code, "message": message, "details": details}})
    }

    #[tokio::test]
    async fn a_fitting_body_is_read() {
        let body = Body::from(r#"{"name": "Hartmann"}"#);
        let (status, member) = post_body(Some("application/json; charset=utf-8"), body).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(member, json!({"name": "Hartmann", "tags": []}));
    }

    #[tokio::test]
    async fn each_bad_body_has_its_status_code_and_message() {
        let (status, body) = post_body(Some("text/plain"), Body::from("{}")).await;
        assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
        let message = r#"the body must be application/json (Content-Type: "text/plain")"#;
        assert_eq!(body, error("UNSUPPORTED_MEDIA_TYPE", message, json!({})));

        let (status, body) = post_body(None, Body::from("{}")).await;
        assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
        let message = "the body must be application/json (Content-Type: none)";
        assert_eq!(body, error("UNSUPPORTED_MEDIA_TYPE", message, json!({})));

        let (status, body) = post_body(Some("application/json"), Body::from("{\"name\":")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        let message = "the body is not valid JSON: EOF while parsing a value at line 1 column 8";
        assert_eq!(body, error("MALFORMED_JSON", message, json!({})));

        let (status, body) =
            post_body(Some("application/json"), Body::from(r#"{"name": "a"} x"#)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(body["error"]["code"], "MALFORMED_JSON", "{body}");

        let (status, body) = post_body(Some("application/json"), Body::from("{}")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        let message = "the body is not a valid request: missing field `name` at line 1 column 2";
        assert_eq!(body, error("INVALID_REQUEST", message, json!({})));

        let wrong = Body::from(r#"{"name": "x", "tags": [1]}"#);
        let (status, body) = post_body(Some("application/vnd.kiln+json"), wrong).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        let message = "the body is not a valid request: tags[0]: invalid type: integer `1`, \
                       expected a string at line 1 column 24";
        assert_eq!(
            body,
            error("INVALID_REQUEST", message, json!({"field": "tags[0]"}))
        );
    }

    #[tokio::test]
    async fn a_body_over_the_limit_is_413_declared_or_streamed() {
        let big = format!(r#"{{"name": "{}"}}"#, "x".repeat(100));
        let (status, body) = post_body(Some("application/json"), Body::from(big)).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
        let message = "the body is larger than 64 bytes";
        assert_eq!(body, error("BODY_TOO_LARGE", message, json!({})));

        let chunks = (0..8).map(|_| Ok::<_, std::io::Error>(Bytes::from(vec![b' '; 16])));
        let streamed = Body::from_stream(futures::stream::iter(chunks));
        let (status, body) = post_body(Some("application/json"), streamed).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(body, error("BODY_TOO_LARGE", message, json!({})));
    }

    #[test]
    fn json_content_types() {
        for (value, json) in [
            ("application/json", true),
            ("Application/JSON; charset=utf-8", true),
            ("application/vnd.uhlp+json", true),
            ("text/plain", false),
            ("application/jsonp", false),
            ("text/x+json", false),
        ] {
            assert_eq!(is_json_content_type(value), json, "{value}");
        }
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        assert_eq!(require_json(&headers), Ok(()));
    }
}

#[cfg(test)]
mod object_bodies {
    use super::from_json_object;

    #[derive(Debug, serde::Deserialize, PartialEq)]
    struct Update {
        value: String,
        #[serde(default)]
        metadata: std::collections::BTreeMap<String, String>,
    }

    #[test]
    fn a_body_is_one_json_object() {
        let ok: Update = from_json_object(br#" {"value": "v"}"#).unwrap();
        assert_eq!(ok.value, "v");
        // serde alone would fill the struct from an array, by position.
        assert!(serde_json::from_slice::<Update>(br#"["v", {}]"#).is_ok());
        for body in [&br#"["v", {}]"#[..], b"\"v\"", b"7", b"null", b" [] "] {
            let refused = from_json_object::<Update>(body).unwrap_err();
            assert_eq!(refused.code(), "INVALID_REQUEST", "{body:?}");
        }
        // Not UTF-8 (a string with a stray byte, which a skim of the JSON does not check) is
        // malformed, also when a struct was refused first (the fuzzer's find).
        for body in [
            &b"["[..],
            b"{\"value\": ",
            b"{\"s\xa2\x9epe\": {\"box\": [1, 2]}}",
            b"{\"value\": \"v\", \"metadata\": [1], \"k\xa2\": 1}",
        ] {
            let malformed = from_json_object::<Update>(body).unwrap_err();
            assert_eq!(malformed.code(), "MALFORMED_JSON", "{body:?}");
        }
        // serde_json calls an enum given `{}` a syntax error; the body is JSON, so it is an
        // invalid request (the fuzzer's second find).
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        enum Shape {
            Plain,
            Box { w: u32 },
        }
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        struct Shaped {
            shape: Option<Shape>,
        }
        let refused = from_json_object::<Shaped>(br#"{"shape": {}}"#).unwrap_err();
        assert_eq!(refused.code(), "INVALID_REQUEST", "{}", refused.message());
        assert_eq!(refused.details()["field"], "shape");
    }
}
