//! What can go wrong in the runtime, by domain. Each face maps a [`RuntimeError`] once: the
//! HTTP faces to a status and the `{code, message, details}` envelope, MCP to a tool error.
//! [`RuntimeError::code`] is the stable code every face shows; the message is for people and
//! never names a host path.

use kiln_executor::PoolError;
use kiln_workspace::TreeError;
use serde_json::{Value, json};

use crate::history::HistoryError;

/// A failure of a runtime operation.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("no sandbox {id:?}: it never existed, was deleted, or expired")]
    SandboxNotFound { id: String },
    #[error("sandbox {id} is running {running}; retry when it finishes (or cancel it)")]
    SandboxBusy { id: String, running: String },
    #[error(
        "sandbox {id} is {state} and its lifecycle does not resume it on a request (autoResume false): resume it first (POST /api/v1/sandboxes/{id}/resume)"
    )]
    SandboxPaused { id: String, state: &'static str },
    #[error(
        "port {port} is not one this sandbox lets previews reach (its lifecycle.allowedPorts: {allowed:?})"
    )]
    PortNotAllowed { port: u16, allowed: Vec<u16> },
    #[error("sandbox {id} was deleted while this ran; its result is gone")]
    SandboxDeleted { id: String },
    #[error("sandbox {id} has no session {session:?}")]
    SessionNotFound { id: String, session: String },
    /// A session's live state is gone (timed out, crashed, cancelled, lost to a restart).
    #[error("{message}; restart the session")]
    SessionEnded {
        message: String,
        id: Option<String>,
        session: Option<String>,
    },
    #[error("a sandbox holds at most {limit} sessions; close one first")]
    TooManySessions { limit: usize },
    /// A tenant quota would be exceeded.
    #[error(
        "over your {quota} quota: it is {}, and {} is in use; free some (delete sandboxes, close sessions, remove files) or ask for a larger quota",
        show(*.limit, .unit), show(*.in_use, .unit)
    )]
    QuotaExceeded {
        quota: String,
        limit: u64,
        in_use: u64,
        /// What the refused request asked for, where that is one amount (a session's memory).
        asked: Option<u64>,
        unit: String,
    },
    /// A workspace path was refused or failed (the message names the workspace path only).
    #[error("{0}")]
    Workspace(TreeError),
    #[error("no such folder in the workspace")]
    FolderNotFound { path: String },
    #[error("{path} is a folder; list it with GET .../files?path={path}")]
    IsAFolder { path: String },
    #[error("cannot run {path:?}: {why} (send it in `files` first)")]
    ProgramUnreadable { path: String, why: String },
    #[error(
        "{path} is {size} bytes; at most {limit} can be read here (download it with GET /api/v1/sandboxes/{id}/files/{path})"
    )]
    FileTooLarge {
        id: String,
        path: String,
        size: u64,
        limit: u64,
    },
    #[error(
        "{sent} files were sent; at most {limit} may be written at once (the most one execution may create)"
    )]
    TooManyFiles { sent: usize, limit: usize },
    #[error("the files total more than {limit} bytes")]
    FilesTooLarge { limit: usize },
    #[error("no change {id:?} in this sandbox's history")]
    ExecutionNotFound { id: String },
    #[error("{cursor:?} is not a cursor of this sandbox's history")]
    InvalidCursor { cursor: String },
    #[error("the server's disk is full: {what}; nothing was changed; retry when space is freed")]
    NoSpace { what: String },
    /// A Linux sandbox's workspace volume is full (its `resources.disk_mb`).
    #[error(
        "the sandbox's disk is full ({disk_mb} MiB, its resources.disk_mb): remove files from its workspace, or create the sandbox with a larger resources.disk_mb; nothing was changed"
    )]
    SandboxDiskFull { disk_mb: u64 },
    #[error("{message}")]
    UnsupportedLanguage { message: String },
    /// An option out of its range (a timeout, a lifetime, a memory size).
    #[error("{message}")]
    InvalidOption { message: String },
    #[error("{message}")]
    InvalidEnv { message: String },
    /// The image names no installed template.
    #[error("{message}")]
    UnknownImage {
        message: String,
        image: String,
        available: Vec<String>,
        templates: Vec<String>,
    },
    /// The backend refused the request's limits, size or grants.
    #[error("{message}")]
    InvalidRequest { message: String },
    /// The sandbox's backend cannot do this (a command on wasm, a foreign template).
    #[error("{message}")]
    Unsupported { message: String },
    #[error("sandbox {id} runs no process with {process}; it ended or never ran")]
    ProcessNotFound { id: String, process: String },
    /// A process could not be started (its program is missing, the box would not start).
    #[error("{message}")]
    ProcessFailed { message: String },
    #[error("the execution was cancelled")]
    Cancelled,
    #[error("the executor running this code died ({detail}); it has been replaced, retry")]
    ExecutorLost { detail: String },
    /// The executors are saturated; retry.
    #[error("{message}")]
    Saturated { message: String },
    /// The tenant's executions quota is in use and its line of waiting executions is full,
    /// or this one waited as long as a request may.
    #[error(
        "over your executions quota: {running} of {limit} run and {queued} wait{}; retry when some finish, or ask for a larger quota",
        if *.waited_ms > 0 { format!(" (this one waited {} ms for a place)", .waited_ms) } else { " (the line is full)".to_owned() }
    )]
    ExecutionQueueFull {
        limit: u64,
        running: u64,
        queued: usize,
        waited_ms: u64,
    },
    /// A fault of kiln's own (the message is scrubbed of host paths).
    #[error("no secret {name:?}")]
    SecretNotFound { name: String },
    #[error("no volume {volume:?}")]
    VolumeNotFound { volume: String },
    #[error("no snapshot {snapshot:?}")]
    SnapshotNotFound { snapshot: String },
    #[error("no workspace {workspace:?}")]
    WorkspaceNotFound { workspace: String },
    #[error("a volume named {name:?} exists")]
    VolumeExists { name: String },
    #[error("volume {volume:?} is mounted by live sandboxes ({}); delete them first", sandboxes.join(", "))]
    VolumeInUse {
        volume: String,
        sandboxes: Vec<String>,
    },
    #[error("a secret named {name:?} exists; update it instead")]
    SecretExists { name: String },
    #[error("{message}")]
    Internal { message: String },
}

fn show(n: u64, unit: &str) -> String {
    match unit {
        "bytes" => format!("{} MiB", n >> 20),
        _ => n.to_string(),
    }
}

/// The runtime's result.
pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;

impl RuntimeError {
    /// The stable code every face shows (`SANDBOX_NOT_FOUND`, `QUOTA_EXCEEDED`, …).
    pub fn code(&self) -> &'static str {
        use RuntimeError as E;
        match self {
            E::SandboxNotFound { .. } => "SANDBOX_NOT_FOUND",
            E::SandboxBusy { .. } => "SANDBOX_BUSY",
            E::SandboxPaused { .. } => "SANDBOX_PAUSED",
            E::PortNotAllowed { .. } => "PORT_NOT_ALLOWED",
            E::SandboxDeleted { .. } => "SANDBOX_DELETED",
            E::SessionNotFound { .. } => "SESSION_NOT_FOUND",
            E::SessionEnded { .. } => "SESSION_ENDED",
            E::TooManySessions { .. } => "TOO_MANY_SESSIONS",
            E::QuotaExceeded { .. } | E::ExecutionQueueFull { .. } => "QUOTA_EXCEEDED",
            E::Workspace(tree) => match tree {
                TreeError::InvalidName { .. }
                | TreeError::Link { .. }
                | TreeError::NotRegular { .. }
                | TreeError::NotDir { .. } => "INVALID_PATH",
                TreeError::NotFound { .. } => "FILE_NOT_FOUND",
                TreeError::IsDir { .. } => "PATH_IS_A_DIRECTORY",
                TreeError::Changed { .. } => "PATH_CHANGED",
                TreeError::NoSpace { .. } => "INSUFFICIENT_STORAGE",
                TreeError::TooManyEntries { .. } => "TOO_MANY_FILES",
                TreeError::Io { .. } => "INTERNAL",
            },
            E::FolderNotFound { .. } | E::ProgramUnreadable { .. } => "FILE_NOT_FOUND",
            E::IsAFolder { .. } => "PATH_IS_A_DIRECTORY",
            E::FileTooLarge { .. } => "FILE_TOO_LARGE",
            E::TooManyFiles { .. } => "TOO_MANY_FILES",
            E::FilesTooLarge { .. } => "FILES_TOO_LARGE",
            E::ExecutionNotFound { .. } => "EXECUTION_NOT_FOUND",
            E::InvalidCursor { .. } => "INVALID_CURSOR",
            E::NoSpace { .. } => "INSUFFICIENT_STORAGE",
            E::SandboxDiskFull { .. } => "SANDBOX_DISK_FULL",
            E::UnsupportedLanguage { .. } => "UNSUPPORTED_LANGUAGE",
            E::InvalidOption { .. } => "INVALID_OPTION",
            E::InvalidEnv { .. } => "INVALID_ENV",
            E::UnknownImage { .. } => "UNKNOWN_IMAGE",
            E::InvalidRequest { .. } => "INVALID_REQUEST",
            E::Unsupported { .. } => "UNSUPPORTED",
            E::ProcessNotFound { .. } => "PROCESS_NOT_FOUND",
            E::ProcessFailed { .. } => "PROCESS_FAILED",
            E::Cancelled => "EXECUTION_CANCELLED",
            E::ExecutorLost { .. } => "EXECUTOR_LOST",
            E::Saturated { .. } => "BUSY",
            E::SecretNotFound { .. } => "SECRET_NOT_FOUND",
            E::SecretExists { .. } => "SECRET_EXISTS",
            E::VolumeNotFound { .. } => "VOLUME_NOT_FOUND",
            E::SnapshotNotFound { .. } => "SNAPSHOT_NOT_FOUND",
            E::WorkspaceNotFound { .. } => "WORKSPACE_NOT_FOUND",
            E::VolumeExists { .. } => "VOLUME_EXISTS",
            E::VolumeInUse { .. } => "VOLUME_IN_USE",
            E::Internal { .. } => "INTERNAL",
        }
    }

    /// Details for programs (ids, paths, limits), as the JSON object every face shows.
    pub fn details(&self) -> Value {
        use RuntimeError as E;
        match self {
            E::SandboxNotFound { id } | E::SandboxDeleted { id } => json!({ "containerId": id }),
            E::SandboxBusy { id, running } => json!({ "containerId": id, "executionId": running }),
            E::SessionNotFound { id, session } => {
                json!({ "containerId": id, "sessionId": session })
            }
            E::SessionEnded {
                id: Some(id),
                session: Some(session),
                ..
            } => json!({ "containerId": id, "sessionId": session }),
            E::QuotaExceeded {
                quota,
                limit,
                in_use,
                asked,
                unit,
            } => {
                let mut details =
                    json!({ "quota": quota, "limit": limit, "inUse": in_use, "unit": unit });
                if let Some(asked) = asked {
                    details["asked"] = json!(asked);
                }
                details
            }
            E::ExecutionQueueFull {
                limit,
                running,
                queued,
                waited_ms,
            } => json!({
                "quota": "executions", "limit": limit, "inUse": running, "unit": "executions",
                "queued": queued, "waitedMs": waited_ms,
            }),
            E::Workspace(tree) => match tree {
                TreeError::NoSpace { .. }
                | TreeError::TooManyEntries { .. }
                | TreeError::Io { .. } => {
                    json!({})
                }
                _ => json!({ "path": tree.path().unwrap_or_default() }),
            },
            E::ProgramUnreadable { path, .. } => json!({ "path": path }),
            E::SandboxDiskFull { disk_mb } => json!({ "diskMb": disk_mb }),
            E::FileTooLarge {
                path, size, limit, ..
            } => json!({ "path": path, "size": size, "limitBytes": limit }),
            E::TooManyFiles { sent, limit } => json!({ "limit": limit, "sent": sent }),
            E::FilesTooLarge { limit } => json!({ "limitBytes": limit }),
            E::ExecutionNotFound { id } => json!({ "executionId": id }),
            E::UnknownImage {
                image,
                available,
                templates,
                ..
            } => json!({ "image": image, "available": available, "templates": templates }),
            E::VolumeInUse { volume, sandboxes } => {
                json!({ "volume": volume, "sandboxes": sandboxes })
            }
            _ => json!({}),
        }
    }

    /// The answer for a full disk while doing `what`.
    pub fn no_space(what: impl Into<String>) -> RuntimeError {
        RuntimeError::NoSpace { what: what.into() }
    }

    /// A fault of kiln's own; `message` must name no host path.
    pub fn internal(message: impl Into<String>) -> RuntimeError {
        RuntimeError::Internal {
            message: message.into(),
        }
    }

    /// The error for a session whose live state is gone.
    pub fn session_lost(id: &str, session: &str) -> RuntimeError {
        RuntimeError::SessionEnded {
            message: format!(
                "session {session} of sandbox {id} has no live state (it timed out, crashed, was cancelled, or the server restarted)"
            ),
            id: Some(id.to_owned()),
            session: Some(session.to_owned()),
        }
    }
}

impl From<TreeError> for RuntimeError {
    /// A workspace failure; a full disk is [`RuntimeError::NoSpace`].
    fn from(error: TreeError) -> RuntimeError {
        match error {
            TreeError::NoSpace { .. } => RuntimeError::no_space(error.to_string()),
            other => RuntimeError::Workspace(other),
        }
    }
}

impl From<HistoryError> for RuntimeError {
    fn from(error: HistoryError) -> RuntimeError {
        match error {
            // History ids come in request bodies: the sandbox exists, the body is wrong.
            HistoryError::UnknownId(id) => RuntimeError::ExecutionNotFound { id },
            e if e.is_no_space() => {
                RuntimeError::no_space("the workspace history could not be written")
            }
            HistoryError::Workspace(e) => e.into(),
            e @ HistoryError::Git(_) => {
                tracing::error!("workspace history: {e}");
                RuntimeError::internal(crate::sandbox::scrub_paths(&e.to_string()))
            }
        }
    }
}

impl From<PoolError> for RuntimeError {
    /// A failure of the executor pool or of the backend behind it.
    fn from(error: PoolError) -> RuntimeError {
        match error {
            PoolError::WorkerLost(detail) => RuntimeError::ExecutorLost { detail },
            PoolError::Remote(remote) if remote.kind == "lost" => RuntimeError::ExecutorLost {
                detail: remote.message,
            },
            PoolError::Remote(remote) if remote.kind == "busy" => RuntimeError::Saturated {
                message: remote.message,
            },
            full @ PoolError::SessionsFull { .. } => RuntimeError::Saturated {
                message: full.to_string(),
            },
            PoolError::Remote(remote) if remote.kind == "cancelled" => RuntimeError::Cancelled,
            PoolError::Remote(remote) if remote.kind == "session_ended" => {
                RuntimeError::SessionEnded {
                    message: remote.message,
                    id: None,
                    session: None,
                }
            }
            PoolError::Remote(remote)
                if remote.kind == "limits"
                    || remote.kind == "too_large"
                    || remote.kind == "grant" =>
            {
                RuntimeError::InvalidRequest {
                    message: remote.message,
                }
            }
            PoolError::Remote(remote) if remote.kind == "unsupported" => {
                RuntimeError::Unsupported {
                    message: remote.message,
                }
            }
            other => RuntimeError::internal(other.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_codes_and_details_are_the_published_ones() {
        let quota = RuntimeError::QuotaExceeded {
            quota: "workspaceBytes".into(),
            limit: 2 << 30,
            in_use: 3 << 20,
            asked: None,
            unit: "bytes".into(),
        };
        assert_eq!(
            quota.to_string(),
            "over your workspaceBytes quota: it is 2048 MiB, and 3 MiB is in use; free some (delete sandboxes, close sessions, remove files) or ask for a larger quota"
        );
        assert_eq!(quota.code(), "QUOTA_EXCEEDED");
        assert_eq!(quota.details()["inUse"], 3 << 20);
        let lost = RuntimeError::session_lost("sb_1", "ses_2");
        assert_eq!(lost.code(), "SESSION_ENDED");
        assert!(
            lost.to_string()
                .ends_with("the server restarted); restart the session")
        );
        assert_eq!(
            lost.details(),
            json!({"containerId": "sb_1", "sessionId": "ses_2"})
        );
        let link: RuntimeError = TreeError::Link { path: "a/b".into() }.into();
        assert_eq!(link.code(), "INVALID_PATH");
        assert_eq!(link.details(), json!({"path": "a/b"}));
    }
}
