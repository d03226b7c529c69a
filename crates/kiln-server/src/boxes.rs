//! `/api/v1/sandboxes/{id}/…` routes for a Linux sandbox's box: its processes (list,
//! signal), restart (every process ended, files kept), pause and resume (the box's cgroup
//! frozen and thawed). A WebAssembly sandbox has no box: these answer `400 UNSUPPORTED`.

use std::sync::Arc;

use axum::Json;
use axum::extract::rejection::PathRejection;
use axum::extract::{Extension, Path, State};
use kiln_http::{HttpError, JsonObject as JsonBody};
use kiln_runtime::processes;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::AppState;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};

type Shared = State<Arc<AppState>>;

use crate::v1::path_error;

/// One process of a sandbox's box, as the box sees it.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProcessInfo {
    #[schema(example = 7)]
    pub pid: u32,
    /// Its parent (0 for kiln's agent, the box's pid 1).
    pub ppid: u32,
    /// Its process group (what `group: true` signals).
    pub pgid: u32,
    /// Its user inside the box: 0 root, 1000 the box's user.
    #[schema(example = 1000)]
    pub uid: u32,
    /// The program's name, as the kernel keeps it (up to 15 bytes).
    #[schema(example = "python3")]
    pub name: String,
    /// Its command line (cut at 4 KiB; empty for a zombie).
    #[schema(example = json!(["python3", "-m", "http.server"]))]
    pub argv: Vec<String>,
    /// As `ps` shows it: R running, S sleeping, D in a disk wait, T stopped, Z a zombie.
    #[schema(example = "S")]
    pub state: String,
    /// When it started (RFC 3339).
    pub started_at: String,
    /// CPU time used, user and system, in milliseconds.
    pub cpu_ms: u64,
    /// Resident memory, in bytes.
    pub memory_bytes: u64,
    /// kiln's agent, which keeps the box (it cannot be signalled).
    pub agent: bool,
}

/// A box's state and processes.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProcessList {
    /// `running`, `paused`, `hibernated` or `stopped` (no box runs; the next command
    /// starts one).
    #[schema(example = "running")]
    pub state: String,
    pub processes: Vec<ProcessInfo>,
}

/// A signal for a process of the box.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[schema(example = json!({"signal": "TERM", "group": true}))]
pub struct SignalBody {
    /// A name (`TERM`, `SIGKILL`, `INT`, `HUP`, `QUIT`, `USR1`, `USR2`, `STOP`, `CONT`,
    /// `WINCH`) or a number from 1 to 64. Default `TERM`.
    #[schema(value_type = Option<String>)]
    pub signal: Option<serde_json::Value>,
    /// Send it to every process of the process's group (as `kill -- -PGID`). Default false.
    #[serde(default)]
    pub group: bool,
}

/// How many processes got a signal, or were ended.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Signalled {
    pub signalled: usize,
}

/// A box after a pause, resume or restart.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct BoxChange {
    /// `running`, `paused` or `stopped`.
    #[schema(example = "paused")]
    pub state: String,
    /// How long it took, in milliseconds.
    pub took_ms: f64,
    /// Processes ended (a restart only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub killed: Option<usize>,
    /// What became of the box's processes (a hibernation only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub processes: Option<String>,
}

/// A box state's name on the wire (`running`, `paused`, …).
pub fn state_name(state: kiln_core::process::BoxState) -> String {
    state.name().to_string()
}

/// Signal names a client may use, with or without `SIG`.
const SIGNALS: [(&str, i32); 10] = [
    ("HUP", 1),
    ("INT", 2),
    ("QUIT", 3),
    ("KILL", 9),
    ("USR1", 10),
    ("USR2", 12),
    ("TERM", 15),
    ("CONT", 18),
    ("STOP", 19),
    ("WINCH", 28),
];

/// The signal a body names (default TERM), or why it names none.
pub fn signal_number(value: Option<&serde_json::Value>) -> Result<i32, String> {
    let names = || {
        SIGNALS
            .iter()
            .map(|(n, _)| *n)
            .collect::<Vec<_>>()
            .join(", ")
    };
    match value {
        None | Some(serde_json::Value::Null) => Ok(15),
        Some(serde_json::Value::Number(n)) => n
            .as_i64()
            .filter(|n| (1..=64).contains(n))
            .map(|n| n as i32)
            .ok_or_else(|| format!("signal {n} is not a number from 1 to 64")),
        Some(serde_json::Value::String(name)) => {
            let upper = name.trim().to_ascii_uppercase();
            let bare = upper.strip_prefix("SIG").unwrap_or(&upper);
            SIGNALS
                .iter()
                .find(|(n, _)| *n == bare)
                .map(|(_, number)| *number)
                .ok_or_else(|| format!("unknown signal {name:?}; one of {}", names()))
        }
        Some(other) => Err(format!(
            "signal is a name ({}) or a number, not {other}",
            names()
        )),
    }
}

use kiln_runtime::sandbox::rfc3339;

/// List the processes of a Linux sandbox's box.
#[utoipa::path(get, path = "/api/v1/sandboxes/{id}/processes", tag = "v1 boxes",
    params(("id" = String, Path, description = "The sandbox id")),
    responses(
        (status = 200, description = "The box's state and processes (none when it is stopped)", body = ProcessList),
        (status = 400, description = "A WebAssembly sandbox (no box)", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
    ))]
pub async fn list(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Json<ProcessList>, ApiError> {
    let Path(id) = id.map_err(path_error)?;
    let (box_state, found) = processes::box_processes(&state.runtime, &caller, &id).await?;
    Ok(Json(ProcessList {
        state: state_name(box_state),
        processes: found
            .into_iter()
            .map(|p| ProcessInfo {
                pid: p.pid,
                ppid: p.ppid,
                pgid: p.pgid,
                uid: p.uid,
                name: p.name,
                argv: p.argv,
                state: p.state,
                started_at: rfc3339(p.started_ms),
                cpu_ms: p.cpu_ms,
                memory_bytes: p.memory_bytes,
                agent: p.agent,
            })
            .collect(),
    }))
}

/// Send a signal to a process of the box (or its whole process group).
#[utoipa::path(post, path = "/api/v1/sandboxes/{id}/processes/{pid}/signal", tag = "v1 boxes",
    request_body = SignalBody,
    params(("id" = String, Path, description = "The sandbox id"),
           ("pid" = u32, Path, description = "The process's pid inside the box")),
    responses(
        (status = 200, description = "Sent", body = Signalled),
        (status = 400, description = "A bad signal, pid 1 (kiln's agent), or a WebAssembly sandbox", body = ErrorBody),
        (status = 404, description = "No such sandbox, or no such process in its box", body = ErrorBody),
    ))]
pub async fn signal(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    path: Result<Path<(String, u32)>, PathRejection>,
    body: Result<JsonBody<SignalBody>, HttpError>,
) -> Result<Json<Signalled>, ApiError> {
    let Path((id, pid)) = path.map_err(path_error)?;
    let JsonBody(body) = body?;
    let number = signal_number(body.signal.as_ref())
        .map_err(|message| ApiError::bad_request("INVALID_SIGNAL", message))?;
    let signalled =
        processes::signal_box_process(&state.runtime, &caller, &id, pid, number, body.group)
            .await?;
    Ok(Json(Signalled { signalled }))
}

/// Restart a box: every process but kiln's agent ends; files (in and out of the workspace)
/// stay. The way out of a box a fork bomb filled.
#[utoipa::path(post, path = "/api/v1/sandboxes/{id}/restart", tag = "v1 boxes",
    params(("id" = String, Path, description = "The sandbox id")),
    responses(
        (status = 200, description = "Restarted", body = BoxChange),
        (status = 400, description = "A WebAssembly sandbox (no box)", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
    ))]
pub async fn restart(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Json<BoxChange>, ApiError> {
    let Path(id) = id.map_err(path_error)?;
    let started = std::time::Instant::now();
    let killed = processes::restart_box(&state.runtime, &caller, &id).await?;
    let sandbox = state.runtime.registry.get(&caller.tenant, &id)?.meta;
    let box_state = processes::box_state(&state.runtime, &sandbox)
        .await
        .unwrap_or(kiln_core::process::BoxState::Stopped);
    Ok(Json(BoxChange {
        state: state_name(box_state),
        took_ms: started.elapsed().as_secs_f64() * 1000.0,
        killed: Some(killed),
        processes: None,
    }))
}

/// Pause a box: its cgroup is frozen, so its processes keep their memory, files and
/// connections and use no CPU. The next command (or `resume`) thaws it.
#[utoipa::path(post, path = "/api/v1/sandboxes/{id}/pause", tag = "v1 boxes",
    params(("id" = String, Path, description = "The sandbox id")),
    responses(
        (status = 200, description = "Paused", body = BoxChange),
        (status = 400, description = "A WebAssembly sandbox (no box)", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
    ))]
pub async fn pause(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Json<BoxChange>, ApiError> {
    let Path(id) = id.map_err(path_error)?;
    change(&state, &caller, &id, true).await
}

/// Resume a paused box (any command to it resumes it too).
#[utoipa::path(post, path = "/api/v1/sandboxes/{id}/resume", tag = "v1 boxes",
    params(("id" = String, Path, description = "The sandbox id")),
    responses(
        (status = 200, description = "Resumed", body = BoxChange),
        (status = 400, description = "A WebAssembly sandbox (no box)", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
    ))]
pub async fn resume(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Json<BoxChange>, ApiError> {
    let Path(id) = id.map_err(path_error)?;
    change(&state, &caller, &id, false).await
}

/// Hibernate a box: its memory goes back to the host and its files stay (the workspace and
/// what it wrote outside it); the next command starts a box from them. Its processes end
/// (kiln checkpoints none yet): `processes` says so, and why.
#[utoipa::path(post, path = "/api/v1/sandboxes/{id}/hibernate", tag = "v1 boxes",
    params(("id" = String, Path, description = "The sandbox id")),
    responses(
        (status = 200, description = "Hibernated", body = BoxChange),
        (status = 400, description = "A WebAssembly sandbox (no box)", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
    ))]
pub async fn hibernate(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Json<BoxChange>, ApiError> {
    let Path(id) = id.map_err(path_error)?;
    let (box_state, why, took) = processes::hibernate(&state.runtime, &caller, &id).await?;
    Ok(Json(BoxChange {
        state: state_name(box_state),
        took_ms: took.as_secs_f64() * 1000.0,
        killed: None,
        processes: Some(why),
    }))
}

async fn change(
    state: &AppState,
    caller: &Caller,
    id: &str,
    paused: bool,
) -> Result<Json<BoxChange>, ApiError> {
    let (box_state, took) = processes::set_paused(&state.runtime, caller, id, paused).await?;
    Ok(Json(BoxChange {
        state: state_name(box_state),
        took_ms: took.as_secs_f64() * 1000.0,
        killed: None,
        processes: None,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_are_named_or_numbered() {
        use serde_json::json;
        assert_eq!(signal_number(None), Ok(15));
        assert_eq!(signal_number(Some(&json!("kill"))), Ok(9));
        assert_eq!(signal_number(Some(&json!("SIGINT"))), Ok(2));
        assert_eq!(signal_number(Some(&json!(9))), Ok(9));
        for bad in [
            json!(0),
            json!(65),
            json!(-9),
            json!("SIGNOPE"),
            json!(true),
            json!(1.5),
        ] {
            assert!(signal_number(Some(&bad)).is_err(), "{bad}");
        }
    }
}

/// The events route's query.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct EventsQuery {
    /// After the kept events, go on streaming new ones as Server-Sent Events (`event:
    /// <state>`, `data:` the event) until the sandbox is deleted.
    pub follow: Option<bool>,
}

/// One Server-Sent Event of a followed sandbox.
#[derive(Debug, Serialize, ToSchema)]
pub struct EventSse {
    /// The state it is now: `created`, `running`, `paused`, `hibernated`, `stopped` or
    /// `deleted` (the last event).
    #[schema(example = "paused")]
    pub event: String,
    /// The event as JSON text (a `SandboxEvent`).
    #[schema(
        example = "{\"seq\":7,\"at\":\"2026-11-28T04:00:35.623Z\",\"sandboxId\":\"sb_…\",\"state\":\"paused\",\"reason\":\"idle\"}"
    )]
    pub data: String,
}

/// A sandbox's kept events, oldest first.
#[derive(Debug, Serialize, ToSchema)]
pub struct EventList {
    pub events: Vec<kiln_runtime::events::SandboxEvent>,
}

/// What happened to a sandbox and its box, and why: `created`, `running`, `paused`,
/// `hibernated`, `stopped`, `deleted` (the newest 128, kept in memory since kiln started).
#[utoipa::path(get, path = "/api/v1/sandboxes/{id}/events", tag = "v1 boxes",
    params(("id" = String, Path, description = "The sandbox id"), EventsQuery),
    responses(
        (status = 200, description = "Its events (JSON), or with follow=true a stream of them (text/event-stream: `event:` the state, `data:` the event)",
            content(
                (EventList = "application/json"),
                (EventSse = "text/event-stream"),
            )),
        (status = 404, description = "No such sandbox", body = ErrorBody),
    ))]
pub async fn events(
    State(state): Shared,
    Extension(caller): Extension<Caller>,
    id: Result<Path<String>, PathRejection>,
    query: Result<axum::extract::Query<EventsQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<axum::response::Response, ApiError> {
    use axum::response::IntoResponse;
    use axum::response::sse::{Event, KeepAlive, Sse};
    let Path(id) = id.map_err(path_error)?;
    let axum::extract::Query(query) =
        query.map_err(|e| ApiError::bad_request("INVALID_QUERY", e.body_text()))?;
    state.runtime.registry.get(&caller.tenant, &id)?;
    if !query.follow.unwrap_or(false) {
        return Ok(Json(EventList {
            events: state.runtime.events.of(&id),
        })
        .into_response());
    }
    // Subscribed before the kept ones are read: nothing falls between them.
    let live = state.runtime.events.subscribe();
    let kept: std::collections::VecDeque<_> = state.runtime.events.of(&id).into();
    let last = kept.back().map_or(0, |e| e.seq);
    let stream = futures::stream::unfold(
        (kept, live, last, false),
        move |(mut kept, mut live, last, done)| {
            let id = id.clone();
            async move {
                if done {
                    return None;
                }
                let event = match kept.pop_front() {
                    Some(event) => event,
                    None => loop {
                        match live.recv().await {
                            Ok(event) if event.sandbox_id == id && event.seq > last => break event,
                            Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                            Err(_) => return None,
                        }
                    },
                };
                let ended = event.state == "deleted";
                let sse = Event::default()
                    .event(event.state.clone())
                    .data(serde_json::to_string(&event).unwrap_or_default());
                Some((
                    Ok::<_, std::convert::Infallible>(sse),
                    (kept, live, last, ended),
                ))
            }
        },
    );
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response())
}
