//! Terminals: a shell on a PTY in a Linux sandbox's box, kept by kiln while nobody looks.
//! Clients attach over a WebSocket (`/api/v1/sandboxes/{id}/terminals/{tid}`, or the page
//! at `/terminal/{id}/{tid}/`), detach (the shell keeps running) and reattach with what they
//! missed replayed from a byte offset, out of a bounded ring of the terminal's output. One
//! attachment writes (keystrokes, resize, signals); any number watch; the owner may take the
//! writer's place.
//!
//! The wire: binary frames carry bytes both ways (output to the client, keystrokes to the
//! terminal); text frames carry small JSON controls. From the client: `{"type":"resize",
//! "cols","rows"}`, `{"type":"signal","signal":"INT"}`. From kiln: `{"type":"attached",
//! "offset","end","lost","writer"}` first (the replay, as binary frames, runs from `offset` to
//! `end`; `lost` bytes before `offset` fell out of the ring), `{"type":"writer","writer":
//! false}` when another attachment took over, `{"type":"exit","code","signal"}` when the
//! shell ended.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::Json;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Extension, Path, Query, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use kiln_core::TerminalSize;
use kiln_core::process::ProcessEvent;
use kiln_http::{HttpError, JsonObject as JsonBody};
use kiln_runtime::processes::{self, Running, StartProcess};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::sync::broadcast;
use utoipa::{IntoParams, ToSchema};

use crate::AppState;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};

/// Output a terminal keeps for reattaching clients: 1 MiB (the newest).
pub const RING_BYTES: usize = 1 << 20;
/// Terminals one sandbox holds at once.
pub const MAX_TERMINALS: usize = 16;
/// An ended terminal stays listed (its scrollback readable) this long.
const KEEP_ENDED: std::time::Duration = std::time::Duration::from_secs(300);
/// The largest binary frame kiln sends.
const FRAME: usize = 64 << 10;

/// What an attachment hears.
#[derive(Debug, Clone)]
enum Event {
    Output {
        offset: u64,
        data: bytes::Bytes,
    },
    Writer {
        attachment: u64,
    },
    Exit {
        code: Option<i32>,
        signal: Option<i32>,
    },
}

/// The newest output, with the offset of its first byte.
#[derive(Debug, Default)]
struct Ring {
    start: u64,
    bytes: VecDeque<u8>,
}

impl Ring {
    fn end(&self) -> u64 {
        self.start + self.bytes.len() as u64
    }

    fn push(&mut self, data: &[u8]) {
        self.bytes.extend(data);
        let over = self.bytes.len().saturating_sub(RING_BYTES);
        self.bytes.drain(..over);
        self.start += over as u64;
    }

    /// From `offset` (or the oldest kept byte) to the end: (from, bytes, lost).
    fn since(&self, offset: u64) -> (u64, Vec<u8>, u64) {
        let from = offset.clamp(self.start, self.end());
        let skip = (from - self.start) as usize;
        (
            from,
            self.bytes.range(skip..).copied().collect(),
            self.start.saturating_sub(offset),
        )
    }
}

/// One terminal.
pub struct Terminal {
    pub id: String,
    pub sandbox: String,
    pub created_ms: u64,
    process: Arc<Running>,
    ring: Mutex<Ring>,
    events: broadcast::Sender<Event>,
    writer: Mutex<Option<u64>>,
    size: Mutex<TerminalSize>,
    exited: Mutex<Option<(Option<i32>, Option<i32>)>>,
    viewers: AtomicU64,
}

impl Terminal {
    fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
        m.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The last `most` bytes it wrote (from its ring).
    pub fn tail(&self, most: usize) -> Vec<u8> {
        let (_, bytes, _) = Self::lock(&self.ring).since(0);
        bytes[bytes.len().saturating_sub(most)..].to_vec()
    }

    /// Types `data` into it, as its writer would.
    pub async fn type_in(&self, data: Vec<u8>) -> Result<(), ApiError> {
        Ok(self.process.write_stdin(data, false).await?)
    }

    pub fn info(&self) -> TerminalInfo {
        let size = *Self::lock(&self.size);
        let exited = *Self::lock(&self.exited);
        TerminalInfo {
            terminal_id: self.id.clone(),
            pid: self.process.pid,
            cols: size.cols,
            rows: size.rows,
            created_at: kiln_runtime::sandbox::rfc3339(self.created_ms),
            output_bytes: Self::lock(&self.ring).end(),
            attached: self.viewers.load(Ordering::Relaxed),
            has_writer: Self::lock(&self.writer).is_some(),
            exited: exited.is_some(),
            exit_code: exited.and_then(|(code, _)| code),
            attach: format!("/api/v1/sandboxes/{}/terminals/{}", self.sandbox, self.id),
            page: format!("/terminal/{}/{}/", self.sandbox, self.id),
        }
    }
}

/// Every sandbox's terminals.
#[derive(Default)]
pub struct Terminals {
    table: Mutex<HashMap<String, BTreeMap<String, Arc<Terminal>>>>,
    next: AtomicU64,
}

impl std::fmt::Debug for Terminals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Terminals")
    }
}

impl Terminals {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, BTreeMap<String, Arc<Terminal>>>> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn get(&self, sandbox: &str, id: &str) -> Option<Arc<Terminal>> {
        self.lock().get(sandbox)?.get(id).cloned()
    }

    fn list(&self, sandbox: &str) -> Vec<Arc<Terminal>> {
        self.lock()
            .get(sandbox)
            .map(|all| all.values().cloned().collect())
            .unwrap_or_default()
    }

    fn forget(&self, sandbox: &str, id: &str) {
        let mut table = self.lock();
        if let Some(all) = table.get_mut(sandbox) {
            all.remove(id);
            if all.is_empty() {
                table.remove(sandbox);
            }
        }
    }
}

use kiln_runtime::sandbox::now_ms;

/// Keeps a terminal's output in its ring and tells its attachments, until its shell ends.
fn pump(
    terminals: Arc<AppState>,
    terminal: Arc<Terminal>,
    mut events: broadcast::Receiver<ProcessEvent>,
) {
    tokio::spawn(async move {
        loop {
            let event = match events.recv().await {
                Ok(event) => event,
                Err(broadcast::error::RecvError::Lagged(_)) => continue,
                Err(broadcast::error::RecvError::Closed) => ProcessEvent::Exited {
                    code: None,
                    signal: None,
                },
            };
            match event {
                ProcessEvent::Terminal(data)
                | ProcessEvent::Stdout(data)
                | ProcessEvent::Stderr(data) => {
                    let mut ring = Terminal::lock(&terminal.ring);
                    let offset = ring.end();
                    ring.push(&data);
                    // Sent under the ring's lock: an attachment that read the ring under it
                    // either has these bytes or receives them.
                    let _ = terminal.events.send(Event::Output { offset, data });
                }
                ProcessEvent::Exited { code, signal } => {
                    {
                        let _ring = Terminal::lock(&terminal.ring);
                        *Terminal::lock(&terminal.exited) = Some((code, signal));
                        let _ = terminal.events.send(Event::Exit { code, signal });
                    }
                    tokio::time::sleep(KEEP_ENDED).await;
                    terminals.terminals.forget(&terminal.sandbox, &terminal.id);
                    return;
                }
            }
        }
    });
}

// ---------------------------------------------------------------- the API

/// A terminal of a sandbox.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TerminalInfo {
    #[schema(example = "t1")]
    pub terminal_id: String,
    /// The shell's pid inside the box.
    pub pid: u32,
    pub cols: u16,
    pub rows: u16,
    pub created_at: String,
    /// Bytes the terminal has written since it started (the offset its next byte gets).
    pub output_bytes: u64,
    /// Clients attached now.
    pub attached: u64,
    /// Whether one of them holds the keyboard.
    pub has_writer: bool,
    pub exited: bool,
    pub exit_code: Option<i32>,
    /// The WebSocket to attach to (with the owner's key).
    pub attach: String,
    /// The browser page (with the owner's key, or a link's token).
    pub page: String,
}

/// Open a terminal.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[schema(example = json!({"cols": 120, "rows": 32}))]
pub struct NewTerminal {
    /// Default 80 × 24; at most 1000 each.
    pub cols: Option<u16>,
    pub rows: Option<u16>,
    /// What runs on it; default the box user's login shell.
    pub command: Option<Vec<String>>,
    /// Default the workspace.
    pub cwd: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

use crate::v1::path_error;

fn not_found(id: &str, tid: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "TERMINAL_NOT_FOUND",
        format!("sandbox {id} has no terminal {tid:?}"),
    )
}

/// Open a terminal in a Linux sandbox's box.
#[utoipa::path(post, path = "/api/v1/sandboxes/{id}/terminals", tag = "v1 terminals",
    request_body = NewTerminal,
    params(("id" = String, Path, description = "The sandbox id")),
    responses(
        (status = 201, description = "Opened", body = TerminalInfo),
        (status = 400, description = "A bad size or command, or a WebAssembly sandbox", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 429, description = "The sandbox holds 16 terminals already", body = ErrorBody),
    ))]
pub async fn create(
    State(state): State<Arc<AppState>>,
    Extension(caller): Extension<Caller>,
    id: Result<Path<String>, PathRejection>,
    body: Result<JsonBody<NewTerminal>, HttpError>,
) -> Result<(StatusCode, Json<TerminalInfo>), ApiError> {
    let Path(id) = id.map_err(path_error)?;
    let JsonBody(body) = body?;
    let terminal = open(&state, &caller, &id, body).await?;
    Ok((StatusCode::CREATED, Json(terminal.info())))
}

/// Opens a terminal in sandbox `id`'s box (the route above, and MCP's `sandbox_terminal`).
pub async fn open(
    state: &Arc<AppState>,
    caller: &Caller,
    id: &str,
    body: NewTerminal,
) -> Result<Arc<Terminal>, ApiError> {
    let id = id.to_string();
    let size = TerminalSize {
        cols: body.cols.unwrap_or(80),
        rows: body.rows.unwrap_or(24),
    };
    if !(1..=1000).contains(&size.cols) || !(1..=1000).contains(&size.rows) {
        return Err(ApiError::bad_request(
            "INVALID_OPTION",
            "cols and rows must be 1..=1000",
        ));
    }
    state.runtime.registry.get(&caller.tenant, &id)?;
    if state.terminals.list(&id).len() >= MAX_TERMINALS {
        return Err(ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "TOO_MANY_TERMINALS",
            format!("sandbox {id} holds {MAX_TERMINALS} terminals, the most it may; close one"),
        ));
    }
    let argv = body.command.unwrap_or_else(|| {
        ["sh", "-c", "exec \"${SHELL:-/bin/sh}\" -l"]
            .iter()
            .map(|s| s.to_string())
            .collect()
    });
    let mut env = body.env;
    env.entry("TERM".into())
        .or_insert_with(|| "xterm-256color".into());
    let (running, events) = processes::start(
        &state.runtime,
        caller,
        &id,
        StartProcess {
            argv,
            env,
            cwd: body.cwd,
            tag: None,
            terminal: Some(size),
            stdin: true,
        },
    )
    .await?;
    let terminal = Arc::new(Terminal {
        id: format!(
            "t{}",
            state.terminals.next.fetch_add(1, Ordering::Relaxed) + 1
        ),
        sandbox: id.clone(),
        created_ms: now_ms(),
        process: running,
        ring: Mutex::default(),
        events: broadcast::channel(1024).0,
        writer: Mutex::new(None),
        size: Mutex::new(size),
        exited: Mutex::new(None),
        viewers: AtomicU64::new(0),
    });
    state
        .terminals
        .lock()
        .entry(id)
        .or_default()
        .insert(terminal.id.clone(), terminal.clone());
    pump(state.clone(), terminal.clone(), events);
    Ok(terminal)
}

/// A sandbox's terminals.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TerminalList {
    pub terminals: Vec<TerminalInfo>,
}

/// List a sandbox's terminals.
#[utoipa::path(get, path = "/api/v1/sandboxes/{id}/terminals", tag = "v1 terminals",
    params(("id" = String, Path, description = "The sandbox id")),
    responses(
        (status = 200, description = "Its terminals (ended ones stay listed 5 minutes)", body = TerminalList),
        (status = 404, description = "No such sandbox", body = ErrorBody),
    ))]
pub async fn list(
    State(state): State<Arc<AppState>>,
    Extension(caller): Extension<Caller>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Json<TerminalList>, ApiError> {
    let Path(id) = id.map_err(path_error)?;
    state.runtime.registry.get(&caller.tenant, &id)?;
    Ok(Json(TerminalList {
        terminals: state.terminals.list(&id).iter().map(|t| t.info()).collect(),
    }))
}

/// Close a terminal: its shell's process group is killed.
#[utoipa::path(delete, path = "/api/v1/sandboxes/{id}/terminals/{tid}", tag = "v1 terminals",
    params(("id" = String, Path, description = "The sandbox id"),
           ("tid" = String, Path, description = "The terminal id")),
    responses(
        (status = 204, description = "Closed"),
        (status = 404, description = "No such sandbox or terminal", body = ErrorBody),
    ))]
pub async fn delete(
    State(state): State<Arc<AppState>>,
    Extension(caller): Extension<Caller>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<StatusCode, ApiError> {
    let Path((id, tid)) = path.map_err(path_error)?;
    state.runtime.registry.get(&caller.tenant, &id)?;
    let terminal = state
        .terminals
        .get(&id, &tid)
        .ok_or_else(|| not_found(&id, &tid))?;
    let _ = terminal.process.signal(libc_sigkill()).await;
    state.terminals.forget(&id, &tid);
    Ok(StatusCode::NO_CONTENT)
}

fn libc_sigkill() -> i32 {
    9
}

/// How to attach.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Attach {
    /// Replay output from this byte offset (default 0: all the ring holds).
    pub offset: Option<u64>,
    /// `write` (default: the keyboard, unless another attachment holds it) or `read`.
    pub mode: Option<String>,
    /// Take the keyboard from the attachment holding it.
    #[serde(default)]
    pub takeover: bool,
}

/// Attach to a terminal (a WebSocket), or describe it (plain `GET`).
#[utoipa::path(get, path = "/api/v1/sandboxes/{id}/terminals/{tid}", tag = "v1 terminals",
    params(("id" = String, Path, description = "The sandbox id"),
           ("tid" = String, Path, description = "The terminal id"), Attach),
    responses(
        (status = 101, description = "Attached: binary frames carry bytes, text frames JSON controls (see docs/interactive.md)"),
        (status = 200, description = "Without an upgrade: the terminal", body = TerminalInfo),
        (status = 404, description = "No such sandbox or terminal", body = ErrorBody),
    ))]
pub async fn attach(
    State(state): State<Arc<AppState>>,
    Extension(caller): Extension<Caller>,
    path: Result<Path<(String, String)>, PathRejection>,
    query: Result<Query<Attach>, QueryRejection>,
    upgrade: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> Result<Response, ApiError> {
    let Path((id, tid)) = path.map_err(path_error)?;
    let Query(asked) = query.map_err(|e| ApiError::bad_request("INVALID_QUERY", e.body_text()))?;
    let sandbox = state.runtime.registry.get(&caller.tenant, &id)?.meta;
    let terminal = state
        .terminals
        .get(&id, &tid)
        .ok_or_else(|| not_found(&id, &tid))?;
    let write = match asked.mode.as_deref() {
        None | Some("write") => true,
        Some("read") => false,
        Some(other) => {
            return Err(ApiError::bad_request(
                "INVALID_QUERY",
                format!("mode is write or read, not {other:?}"),
            ));
        }
    };
    let Ok(upgrade) = upgrade else {
        return Ok(Json(terminal.info()).into_response());
    };
    // Attaching to a paused sandbox's terminal resumes it (or is refused, SANDBOX_PAUSED,
    // where its lifecycle says autoResume false).
    processes::wake(&state.runtime, &sandbox).await?;
    let runtime = state.runtime.clone();
    Ok(upgrade
        .max_message_size(1 << 20)
        .on_upgrade(move |socket| {
            session(
                socket,
                runtime,
                terminal,
                asked.offset.unwrap_or(0),
                write,
                asked.takeover,
            )
        })
        .into_response())
}

static ATTACHMENTS: AtomicU64 = AtomicU64::new(1);

async fn send_json(socket: &mut WebSocket, value: serde_json::Value) -> bool {
    socket
        .send(Message::Text(value.to_string().into()))
        .await
        .is_ok()
}

async fn send_bytes(socket: &mut WebSocket, data: &[u8]) -> bool {
    for chunk in data.chunks(FRAME) {
        if socket
            .send(Message::Binary(bytes::Bytes::copy_from_slice(chunk)))
            .await
            .is_err()
        {
            return false;
        }
    }
    true
}

/// One attachment, until the client leaves (the shell goes on).
async fn session(
    mut socket: WebSocket,
    runtime: Arc<kiln_runtime::Runtime>,
    terminal: Arc<Terminal>,
    offset: u64,
    write: bool,
    takeover: bool,
) {
    let me = ATTACHMENTS.fetch_add(1, Ordering::Relaxed);
    terminal.viewers.fetch_add(1, Ordering::Relaxed);
    let mut writer = false;
    if write {
        let mut holder = Terminal::lock(&terminal.writer);
        if holder.is_none() || takeover {
            *holder = Some(me);
            writer = true;
            let _ = terminal.events.send(Event::Writer { attachment: me });
        }
    }
    // The replay and the subscription under the ring's lock: nothing is missed or doubled.
    let (from, replay, lost, end, mut events, exited) = {
        let ring = Terminal::lock(&terminal.ring);
        let (from, replay, lost) = ring.since(offset);
        let events = terminal.events.subscribe();
        let exited = *Terminal::lock(&terminal.exited);
        (from, replay, lost, ring.end(), events, exited)
    };
    let mut next = end;
    let mut alive = send_json(
        &mut socket,
        json!({"type": "attached", "terminal": terminal.id, "offset": from, "end": end,
               "lost": lost, "writer": writer}),
    )
    .await
        && send_bytes(&mut socket, &replay).await;
    if let Some((code, signal)) = exited {
        let _ = send_json(
            &mut socket,
            json!({"type": "exit", "code": code, "signal": signal}),
        )
        .await;
        alive = false;
    }
    while alive {
        tokio::select! {
            event = events.recv() => match event {
                Ok(Event::Output { offset, data }) => {
                    // Bytes already replayed are skipped.
                    let skip = next.saturating_sub(offset) as usize;
                    if skip < data.len() {
                        alive = send_bytes(&mut socket, &data[skip..]).await;
                    }
                    next = next.max(offset + data.len() as u64);
                }
                Ok(Event::Writer { attachment }) => {
                    if writer && attachment != me {
                        writer = false;
                        alive = send_json(&mut socket, json!({"type": "writer", "writer": false})).await;
                    }
                }
                Ok(Event::Exit { code, signal }) => {
                    let _ = send_json(&mut socket, json!({"type": "exit", "code": code, "signal": signal})).await;
                    alive = false;
                }
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    // Too slow for the live stream: catch up from the ring.
                    let (from, missed, lost) = Terminal::lock(&terminal.ring).since(next);
                    if lost > 0 {
                        alive = send_json(&mut socket, json!({"type": "lost", "bytes": lost})).await;
                    }
                    alive = alive && send_bytes(&mut socket, &missed).await;
                    next = from + missed.len() as u64;
                }
                Err(broadcast::error::RecvError::Closed) => alive = false,
            },
            message = socket.recv() => match message {
                Some(Ok(Message::Binary(data))) if writer => {
                    // A keystroke is use: the sandbox's idle life starts again.
                    runtime.registry.touch(&terminal.sandbox);
                    alive = terminal.process.write_stdin(data.to_vec(), false).await.is_ok();
                }
                Some(Ok(Message::Text(text))) => {
                    alive = control(&mut socket, &terminal, writer, text.as_str()).await;
                }
                Some(Ok(Message::Binary(_) | Message::Ping(_) | Message::Pong(_))) => {}
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => alive = false,
            },
        }
    }
    if writer {
        let mut holder = Terminal::lock(&terminal.writer);
        if *holder == Some(me) {
            *holder = None;
        }
    }
    terminal.viewers.fetch_sub(1, Ordering::Relaxed);
}

/// A client's control frame; false when the connection should end.
async fn control(socket: &mut WebSocket, terminal: &Terminal, writer: bool, text: &str) -> bool {
    let Ok(control) = serde_json::from_str::<serde_json::Value>(text) else {
        return send_json(
            socket,
            json!({"type": "error", "message": "a control frame is JSON"}),
        )
        .await;
    };
    let refuse = |message: &str| json!({"type": "error", "message": message});
    match control["type"].as_str() {
        Some("resize") => {
            let (Some(cols), Some(rows)) = (control["cols"].as_u64(), control["rows"].as_u64())
            else {
                return send_json(socket, refuse("resize needs cols and rows")).await;
            };
            if !writer {
                return send_json(
                    socket,
                    refuse("only the attachment holding the keyboard resizes"),
                )
                .await;
            }
            if !(1..=1000).contains(&cols) || !(1..=1000).contains(&rows) {
                return send_json(socket, refuse("cols and rows must be 1..=1000")).await;
            }
            let size = TerminalSize {
                cols: cols as u16,
                rows: rows as u16,
            };
            *Terminal::lock(&terminal.size) = size;
            terminal.process.resize(size).await.is_ok()
        }
        Some("signal") => {
            if !writer {
                return send_json(
                    socket,
                    refuse("only the attachment holding the keyboard signals"),
                )
                .await;
            }
            match crate::boxes::signal_number(control.get("signal")) {
                Ok(signal) => terminal.process.signal(signal).await.is_ok(),
                Err(message) => send_json(socket, refuse(&message)).await,
            }
        }
        _ => send_json(socket, refuse("controls are resize and signal")).await,
    }
}

// ---------------------------------------------------------------- the page

const PAGE: &str = include_str!("terminal.html");

/// `GET /terminal/{id}/{tid}/`: the terminal in a browser (xterm.js, served by kiln).
pub async fn page(
    State(state): State<Arc<AppState>>,
    Extension(caller): Extension<Caller>,
    path: Result<Path<(String, String)>, PathRejection>,
    query: Result<Query<Vec<(String, String)>>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Path((id, tid)) = path.map_err(path_error)?;
    state.runtime.registry.get(&caller.tenant, &id)?;
    if state.terminals.get(&id, &tid).is_none() {
        return Err(not_found(&id, &tid));
    }
    let mut response = Html(PAGE).into_response();
    // A token given once goes on in a cookie for the page's WebSocket.
    if let Ok(Query(pairs)) = query
        && let Some((_, token)) = pairs.iter().find(|(n, _)| n == crate::preview::TOKEN_PARAM)
        && let Ok(cookie) = HeaderValue::from_str(&format!(
            "kiln_preview={token}; Path=/terminal/{id}/{tid}/; HttpOnly; SameSite=Strict"
        ))
    {
        response.headers_mut().append(header::SET_COOKIE, cookie);
    }
    Ok(response)
}

/// `GET /terminal/assets/{name}`: the vendored xterm.js (MIT), no key needed.
pub async fn asset(Path(name): Path<String>) -> Response {
    let (body, kind): (&'static [u8], &str) = match name.as_str() {
        "xterm.js" => (
            include_bytes!("../assets/xterm/xterm.js"),
            "text/javascript",
        ),
        "addon-fit.js" => (
            include_bytes!("../assets/xterm/addon-fit.js"),
            "text/javascript",
        ),
        "xterm.css" => (include_bytes!("../assets/xterm/xterm.css"), "text/css"),
        _ => return StatusCode::NOT_FOUND.into_response(),
    };
    (
        [
            (header::CONTENT_TYPE, kind),
            (header::CACHE_CONTROL, "public, max-age=86400"),
        ],
        body,
    )
        .into_response()
}

/// A link to a terminal's page for someone without the key.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NewLink {
    /// How long the link works, in seconds (default 3600, at most 7 days).
    pub ttl_seconds: Option<u64>,
}

/// A terminal page link.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TerminalLink {
    pub url: String,
    pub expires_at: String,
}

/// Make a signed link to a terminal's page (it attaches with the keyboard).
#[utoipa::path(post, path = "/api/v1/sandboxes/{id}/terminals/{tid}/links", tag = "v1 terminals",
    request_body = NewLink,
    params(("id" = String, Path, description = "The sandbox id"),
           ("tid" = String, Path, description = "The terminal id")),
    responses(
        (status = 201, description = "The link", body = TerminalLink),
        (status = 400, description = "A bad lifetime", body = ErrorBody),
        (status = 404, description = "No such sandbox or terminal", body = ErrorBody),
    ))]
pub async fn link(
    State(state): State<Arc<AppState>>,
    Extension(caller): Extension<Caller>,
    path: Result<Path<(String, String)>, PathRejection>,
    body: Result<JsonBody<NewLink>, HttpError>,
) -> Result<(StatusCode, Json<TerminalLink>), ApiError> {
    let Path((id, tid)) = path.map_err(path_error)?;
    let JsonBody(body) = body?;
    state.runtime.registry.get(&caller.tenant, &id)?;
    if state.terminals.get(&id, &tid).is_none() {
        return Err(not_found(&id, &tid));
    }
    let link = page_link(&state, &caller, &id, &tid, body.ttl_seconds.unwrap_or(3600))?;
    Ok((StatusCode::CREATED, Json(link)))
}

/// A signed link to terminal `tid`'s page, working `ttl` seconds.
pub fn page_link(
    state: &AppState,
    caller: &Caller,
    id: &str,
    tid: &str,
    ttl: u64,
) -> Result<TerminalLink, ApiError> {
    if !(1..=crate::preview::MAX_TOKEN_SECONDS).contains(&ttl) {
        return Err(ApiError::bad_request(
            "INVALID_OPTION",
            format!(
                "ttlSeconds must be 1..={}",
                crate::preview::MAX_TOKEN_SECONDS
            ),
        ));
    }
    let grant = crate::preview::Grant {
        tenant: caller.tenant.clone(),
        sandbox: format!("{id}/{tid}"),
        port: 0,
        expires_ms: now_ms() + ttl * 1000,
    };
    let token = state.previews.sign(&grant);
    Ok(TerminalLink {
        url: format!(
            "/terminal/{id}/{tid}/?{}={token}",
            crate::preview::TOKEN_PARAM
        ),
        expires_at: kiln_runtime::sandbox::rfc3339(grant.expires_ms),
    })
}

/// `/terminal/{id}/{tid}/…`: the sandbox and terminal it names.
pub fn parse_path(path: &str) -> Option<(&str, &str)> {
    let rest = path.strip_prefix("/terminal/")?;
    let mut parts = rest.splitn(3, '/');
    let (id, tid) = (parts.next()?, parts.next()?);
    (!id.is_empty() && !tid.is_empty() && id != "assets").then_some((id, tid))
}

/// The caller a terminal page request acts as: the owner's key, or a link's token for this
/// very terminal. `None`: answer 404.
pub fn page_caller(state: &AppState, request: &axum::extract::Request) -> Option<Caller> {
    let (id, tid) = parse_path(request.uri().path())?;
    crate::preview::caller_for(state, request, id, &format!("{id}/{tid}"), 0)
}

/// `GET /terminal/{id}/{tid}/ws`: the page's WebSocket (as [`attach`], by the page's cookie).
/// A browser says where the page that opens it came from (`Origin`): only kiln's own page,
/// on this very host, may; a preview's page (an opaque origin, `null`) or another site's
/// may not use the cookie to reach the terminal.
pub async fn page_socket(
    state: State<Arc<AppState>>,
    caller: Extension<Caller>,
    headers: axum::http::HeaderMap,
    path: Result<Path<(String, String)>, PathRejection>,
    query: Result<Query<Attach>, QueryRejection>,
    upgrade: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> Result<Response, ApiError> {
    if let Some(origin) = headers.get(header::ORIGIN) {
        let host = headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or_default();
        let from = origin.to_str().unwrap_or_default();
        let same = from
            .strip_prefix("http://")
            .or_else(|| from.strip_prefix("https://"))
            .is_some_and(|rest| rest == host);
        if !same {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "CROSS_ORIGIN",
                format!(
                    "a terminal's page socket opens only from kiln's own page on {host}, not from {from:?}"
                ),
            ));
        }
    }
    attach(state, caller, path, query, upgrade).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_keeps_the_newest_bytes_and_says_what_was_lost() {
        let mut ring = Ring::default();
        ring.push(b"hello ");
        ring.push(b"world");
        assert_eq!(ring.since(0), (0, b"hello world".to_vec(), 0));
        assert_eq!(ring.since(6), (6, b"world".to_vec(), 0));
        assert_eq!(ring.since(99), (11, Vec::new(), 0));
        let big = vec![b'x'; RING_BYTES];
        ring.push(&big);
        assert_eq!(ring.bytes.len(), RING_BYTES, "bounded");
        let (from, bytes, lost) = ring.since(0);
        assert_eq!((from, bytes.len(), lost), (11, RING_BYTES, 11));
    }

    #[test]
    fn terminal_paths_name_a_sandbox_and_a_terminal() {
        assert_eq!(parse_path("/terminal/sb_1/t1/"), Some(("sb_1", "t1")));
        assert_eq!(parse_path("/terminal/sb_1/t1/ws"), Some(("sb_1", "t1")));
        assert_eq!(parse_path("/terminal/assets/xterm.js"), None);
        assert_eq!(parse_path("/terminal/sb_1"), None);
    }
}
