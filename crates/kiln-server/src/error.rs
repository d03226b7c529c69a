//! The one error shape every route answers with:
//! `{"error": {"code": "SANDBOX_NOT_FOUND", "message": "...", "details": {...}}}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use kiln_http::HttpError;
use serde_json::{Map, Value};

pub use kiln_http::error::ErrorCode;

/// An API error with a stable code: kiln-http's one envelope ([`HttpError`]), in a type of
/// this crate so that the runtime's errors map onto it here, once.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError(pub HttpError);

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError(HttpError::new(status, code, message))
    }

    pub fn with_details(self, details: Value) -> ApiError {
        ApiError(self.0.with_details(details))
    }

    pub fn bad_request(code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, code, message)
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "INTERNAL", message)
    }

    pub fn status(&self) -> StatusCode {
        self.0.status()
    }

    pub fn code(&self) -> &'static str {
        self.0.code()
    }

    pub fn message(&self) -> &str {
        self.0.message()
    }

    pub fn details(&self) -> &Map<String, Value> {
        self.0.details()
    }
}

impl From<HttpError> for ApiError {
    fn from(error: HttpError) -> ApiError {
        ApiError(error)
    }
}

impl IntoResponse for ApiError {
    /// A 503 (busy, an empty warm pool, a lost executor) says when to try again: a second.
    fn into_response(self) -> Response {
        let busy = self.status() == StatusCode::SERVICE_UNAVAILABLE;
        let mut response = self.0.into_response();
        if busy
            && !response
                .headers()
                .contains_key(axum::http::header::RETRY_AFTER)
        {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            );
        }
        response
    }
}

/// The error body, for the API description.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

/// One error: a stable code, a message for people, and details for programs.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ErrorDetail {
    #[schema(example = "SANDBOX_NOT_FOUND")]
    pub code: String,
    #[schema(example = "no sandbox \"sb_0123\": it never existed, was deleted, or expired")]
    pub message: String,
    #[schema(value_type = Object)]
    pub details: Value,
}

impl From<kiln_runtime::RuntimeError> for ApiError {
    /// The one mapping of runtime failures onto HTTP: a status by kind; the code, message
    /// and details are the runtime's own.
    fn from(error: kiln_runtime::RuntimeError) -> ApiError {
        use kiln_runtime::RuntimeError as E;
        use kiln_workspace::TreeError;
        let status = match &error {
            E::SandboxNotFound { .. }
            | E::SessionNotFound { .. }
            | E::FolderNotFound { .. }
            | E::ProcessNotFound { .. }
            | E::SecretNotFound { .. }
            | E::VolumeNotFound { .. }
            | E::SnapshotNotFound { .. }
            | E::WorkspaceNotFound { .. } => StatusCode::NOT_FOUND,
            E::SecretExists { .. } | E::VolumeExists { .. } | E::VolumeInUse { .. } => {
                StatusCode::CONFLICT
            }
            E::SandboxBusy { .. }
            | E::SandboxPaused { .. }
            | E::SandboxDeleted { .. }
            | E::SessionEnded { .. }
            | E::TooManySessions { .. }
            | E::IsAFolder { .. }
            | E::Cancelled => StatusCode::CONFLICT,
            E::PortNotAllowed { .. } => StatusCode::FORBIDDEN,
            E::QuotaExceeded { .. } | E::ExecutionQueueFull { .. } => StatusCode::TOO_MANY_REQUESTS,
            E::Workspace(tree) => match tree {
                TreeError::NotFound { .. } => StatusCode::NOT_FOUND,
                TreeError::IsDir { .. } | TreeError::Changed { .. } => StatusCode::CONFLICT,
                TreeError::NoSpace { .. } => StatusCode::INSUFFICIENT_STORAGE,
                TreeError::TooManyEntries { .. } => StatusCode::PAYLOAD_TOO_LARGE,
                TreeError::Io { .. } => StatusCode::INTERNAL_SERVER_ERROR,
                _ => StatusCode::BAD_REQUEST,
            },
            E::FileTooLarge { .. } | E::TooManyFiles { .. } | E::FilesTooLarge { .. } => {
                StatusCode::PAYLOAD_TOO_LARGE
            }
            E::NoSpace { .. } | E::SandboxDiskFull { .. } => StatusCode::INSUFFICIENT_STORAGE,
            E::ProgramUnreadable { .. }
            | E::ExecutionNotFound { .. }
            | E::InvalidCursor { .. }
            | E::UnsupportedLanguage { .. }
            | E::InvalidOption { .. }
            | E::InvalidEnv { .. }
            | E::UnknownImage { .. }
            | E::InvalidRequest { .. }
            | E::Unsupported { .. } => StatusCode::BAD_REQUEST,
            E::ExecutorLost { .. } | E::Saturated { .. } | E::ProcessFailed { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            E::Internal { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError::new(status, error.code(), error.to_string()).with_details(error.details())
    }
}

impl ApiError {
    /// A runtime failure of what the request's body names (an execution's `session`): the
    /// one override of the mapping above, since a session named in the body that does not
    /// exist is a bad request (400), not a missing URL (404).
    pub fn named_in_body(error: kiln_runtime::RuntimeError) -> ApiError {
        match error {
            e @ kiln_runtime::RuntimeError::SessionNotFound { .. } => {
                ApiError::bad_request(e.code(), e.to_string()).with_details(e.details())
            }
            other => other.into(),
        }
    }
}
