//! The code interpreter (E2B's port 49999): `POST /execute` streams a cell's output as
//! newline-delimited JSON (stdout and stderr a line at a time, results with their formats,
//! errors with name, value and traceback, the execution count, keepalives), and
//! `/contexts` manages contexts. A context is a kiln session of the sandbox; each sandbox
//! has a default `python` context (and a `javascript` one on WebAssembly), made on first use.
//!
//! Python cells run through a small driver, defined in the session on its first cell: the
//! cell's last expression is its main result (as in a notebook), `display()` and
//! matplotlib figures are results too, an exception is an `error`. The driver says these
//! on stdout as marked lines that this module takes out of the stream.

use std::sync::Arc;
use std::time::Duration;

use kiln_core::backend::StreamKind;

use axum::Extension;
use axum::Router;
use axum::extract::{Path, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use bytes::Bytes;
use kiln_core::Language;
use kiln_runtime::RuntimeError;
use kiln_runtime::exec::{self, CodeExec};
use kiln_runtime::sandbox::{now_ms, rfc3339};
use kiln_runtime::sessions;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::{E2b, HOME, Route, SandboxCtx, check_sandbox, message_of, status_of};
use crate::gate;

/// How often a running cell's stream says it is alive.
const KEEPALIVE: Duration = Duration::from_secs(5);

/// What starts a driver line on stdout.
const MARK: &str = "\u{1e}kiln-e2b:";

/// The largest cell: 1 MiB.
const MAX_CODE_BYTES: usize = 1 << 20;

/// The code interpreter's routes.
pub fn router(e2b: Arc<E2b>) -> Router {
    Router::new()
        .route("/health", get(|| async { (StatusCode::OK, "OK") }))
        .route("/execute", post(execute))
        .route("/contexts", get(list_contexts).post(create_context))
        .route("/contexts/{id}", delete(remove_context))
        .route("/contexts/{id}/restart", post(restart_context))
        .fallback(|request: Request| async move {
            text(
                StatusCode::NOT_FOUND,
                format!("no route {} {}", request.method(), request.uri().path()),
            )
        })
        .route_layer(from_fn_with_state("interpreter", super::label))
        .with_state(e2b.clone())
        // The key's rate limit, as on /api/v1 (authenticate runs first and names the key).
        .layer(from_fn_with_state(e2b.app.clone(), gate::rate_limit))
        .layer(from_fn_with_state(e2b, authenticate))
}

async fn authenticate(State(e2b): State<Arc<E2b>>, mut request: Request, next: Next) -> Response {
    let health = request.uri().path() == "/health";
    let headers = ["x-access-token", "e2b-traffic-access-token"];
    if let Err(response) = check_sandbox(&e2b, &mut request, &headers, |_| false)
        && (!health || response.status() == StatusCode::BAD_GATEWAY)
    {
        return response;
    }
    next.run(request).await
}

fn text(status: StatusCode, message: impl Into<String>) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        message.into(),
    )
        .into_response()
}

/// A runtime failure as the code interpreter says it: plain text.
fn failed(e: RuntimeError) -> Response {
    text(
        status_of(&e, Route::Interpreter),
        message_of(&e, Route::Interpreter),
    )
}

/// A language as the SDKs name it (`js` and `ts` too); `None` for one kiln cannot run here.
fn language(name: Option<&str>) -> Result<Language, Response> {
    match name.map(|n| n.trim().to_ascii_lowercase()).as_deref() {
        None | Some("") | Some("python") | Some("python3") => Ok(Language::Python),
        Some("javascript" | "js") => Ok(Language::JavaScript),
        Some(other) => Err(text(
            StatusCode::BAD_REQUEST,
            format!("kiln's code interpreter runs python and javascript, not {other}"),
        )),
    }
}

/// The id of a language's default context.
fn default_context(language: Language) -> &'static str {
    match language {
        Language::JavaScript => "javascript",
        _ => "python",
    }
}

/// Whether the sandbox's template runs `language` in sessions.
fn has_sessions(e2b: &E2b, ctx: &SandboxCtx, language: Language) -> bool {
    e2b.app
        .runtime
        .catalogue()
        .get(ctx.sandbox.template())
        .is_some_and(|t| t.capabilities.session_languages.contains(&language))
}

/// The languages whose default contexts the sandbox has (made on first use: a session
/// holds memory, and most sandboxes never run JavaScript).
fn default_languages(e2b: &E2b, ctx: &SandboxCtx) -> Vec<Language> {
    [Language::Python, Language::JavaScript]
        .into_iter()
        .filter(|l| has_sessions(e2b, ctx, *l))
        .collect()
}

/// Makes `language`'s default context if the sandbox lacks it.
async fn ensure_default(
    e2b: &E2b,
    ctx: &SandboxCtx,
    language: Language,
) -> Result<(), RuntimeError> {
    let rt = &e2b.app.runtime;
    let id = default_context(language);
    let made = |rt: &kiln_runtime::Runtime| -> Result<bool, RuntimeError> {
        Ok(rt
            .registry
            .get(&ctx.caller.tenant, ctx.id())?
            .meta
            .sessions
            .contains_key(id))
    };
    if made(rt)? {
        return Ok(());
    }
    match sessions::open(rt, &ctx.caller, ctx.id(), language, id.to_owned()).await {
        Ok(_) => Ok(()),
        // Made by a request beside this one meanwhile.
        Err(_) if made(rt)? => Ok(()),
        Err(e) => Err(e),
    }
}

fn context_json(id: &str, language: Language) -> Value {
    json!({"id": id, "language": language.name(), "cwd": HOME})
}

async fn list_contexts(
    State(e2b): State<Arc<E2b>>,
    Extension(ctx): Extension<SandboxCtx>,
) -> Response {
    match e2b.app.runtime.registry.get(&ctx.caller.tenant, ctx.id()) {
        Ok(view) => {
            let sessions = &view.meta.sessions;
            let mut all: Vec<Value> = default_languages(&e2b, &ctx)
                .into_iter()
                .filter(|l| !sessions.contains_key(default_context(*l)))
                .map(|l| context_json(default_context(l), l))
                .collect();
            all.extend(sessions.values().map(|s| context_json(&s.id, s.language)));
            axum::Json(all).into_response()
        }
        Err(e) => failed(e),
    }
}

/// A default context's language, if `id` names one the sandbox has not made yet.
fn unmade_default(e2b: &E2b, ctx: &SandboxCtx, id: &str) -> Option<Language> {
    let language = default_languages(e2b, ctx)
        .into_iter()
        .find(|l| default_context(*l) == id)?;
    let made = e2b
        .app
        .runtime
        .registry
        .get(&ctx.caller.tenant, ctx.id())
        .is_ok_and(|v| v.meta.sessions.contains_key(id));
    (!made).then_some(language)
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct NewContext {
    language: Option<String>,
    cwd: Option<String>,
}

async fn create_context(
    State(e2b): State<Arc<E2b>>,
    Extension(ctx): Extension<SandboxCtx>,
    body: Bytes,
) -> Response {
    let asked: NewContext = if body.iter().all(u8::is_ascii_whitespace) {
        NewContext::default()
    } else {
        match kiln_http::objects::from_slice(&body) {
            Ok(asked) => asked,
            Err(e) => return text(StatusCode::BAD_REQUEST, format!("invalid body: {e}")),
        }
    };
    let language = match language(asked.language.as_deref()) {
        Ok(language) => language,
        Err(response) => return response,
    };
    if !has_sessions(&e2b, &ctx, language) {
        return text(
            StatusCode::BAD_REQUEST,
            format!("this sandbox's template runs no {language} contexts"),
        );
    }
    let rt = &e2b.app.runtime;
    let info = match sessions::create(rt, &ctx.caller, ctx.id(), Some(language)).await {
        Ok(info) => info,
        Err(e) => return failed(e),
    };
    let cwd = asked
        .cwd
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| HOME.to_owned());
    if cwd != HOME && language == Language::Python {
        let code = format!("import os as _k; _k.chdir({}); del _k", py_literal(&cwd));
        if let Err(e) = run_plain(&e2b, &ctx, &info.session_id, code).await {
            let _ = sessions::close(rt, &ctx.caller, ctx.id(), &info.session_id).await;
            return failed(e);
        }
    }
    axum::Json(json!({"id": info.session_id, "language": language.name(), "cwd": cwd}))
        .into_response()
}

/// Runs a turn whose output nobody reads.
async fn run_plain(
    e2b: &E2b,
    ctx: &SandboxCtx,
    session: &str,
    code: String,
) -> Result<(), RuntimeError> {
    let exec = CodeExec {
        code,
        session: Some(session.to_owned()),
        ..CodeExec::default()
    };
    let spec = exec::prepare(&e2b.app.runtime, &ctx.caller, ctx.id(), exec)?;
    let outcome = exec::run(&e2b.app.runtime, &ctx.caller, ctx.id(), spec, None).await?;
    if outcome.result.success() {
        Ok(())
    } else {
        Err(RuntimeError::InvalidOption {
            message: outcome.result.stderr_text(),
        })
    }
}

async fn remove_context(
    State(e2b): State<Arc<E2b>>,
    Extension(ctx): Extension<SandboxCtx>,
    Path(id): Path<String>,
) -> Response {
    if unmade_default(&e2b, &ctx, &id).is_some() {
        return StatusCode::OK.into_response();
    }
    match sessions::close(&e2b.app.runtime, &ctx.caller, ctx.id(), &id).await {
        Ok(()) => StatusCode::OK.into_response(),
        Err(e) => failed(e),
    }
}

async fn restart_context(
    State(e2b): State<Arc<E2b>>,
    Extension(ctx): Extension<SandboxCtx>,
    Path(id): Path<String>,
) -> Response {
    if unmade_default(&e2b, &ctx, &id).is_some() {
        return StatusCode::OK.into_response();
    }
    match sessions::restart(&e2b.app.runtime, &ctx.caller, ctx.id(), &id).await {
        Ok(_) => StatusCode::OK.into_response(),
        Err(e) => failed(e),
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ExecuteRequest {
    code: String,
    context_id: Option<String>,
    language: Option<String>,
    env_vars: Option<std::collections::BTreeMap<String, String>>,
}

/// A Python string literal.
fn py_literal(text: &str) -> String {
    // JSON strings are Python string literals (with \uXXXX escapes).
    serde_json::to_string(text).unwrap_or_else(|_| "''".into())
}

/// The driver, defined once per session (see the module's doc).
const PYTHON_DRIVER: &str = include_str!("driver.py");

/// What a Python cell runs: the driver (if the session lacks it) and the cell through it.
fn python_cell(code: &str, env: &std::collections::BTreeMap<String, String>) -> String {
    format!(
        "if '__kiln_e2b__' not in globals():\n    exec(compile({driver}, '<kiln-e2b>', 'exec'), globals())\n__kiln_e2b__.run({code}, {env}, globals())\n",
        driver = py_literal(PYTHON_DRIVER),
        code = py_literal(code),
        env = py_literal(&serde_json::to_string(env).unwrap_or_else(|_| "{}".into())),
    )
}

/// What a JavaScript cell runs: the cell through indirect `eval` (its `var`s and
/// functions stay global), its value a result, an exception an error, as marked lines.
fn javascript_cell(code: &str) -> String {
    let literal = serde_json::to_string(code).unwrap_or_else(|_| "''".into());
    format!(
        "(function () {{ var M = \"\\u001ekiln-e2b:\"; var g = globalThis; \
         g.__kiln_e2b_count = (g.__kiln_e2b_count || 0) + 1; \
         function emit(o) {{ print(M + JSON.stringify(o)); }} \
         try {{ var v = (0, eval)({literal}); \
           if (v !== undefined) {{ var t; if (typeof v === 'string') t = v; else {{ try {{ t = JSON.stringify(v); }} catch (e) {{ t = undefined; }} if (t === undefined || typeof v === 'function') t = String(v); }} \
             emit({{type: 'result', text: t, is_main_result: true}}); }} \
         }} catch (e) {{ var name = (e && e.name) || 'Error'; var value = (e && e.message !== undefined) ? String(e.message) : String(e); \
           emit({{type: 'error', name: name, value: value, traceback: name + ': ' + value + '\\n' + ((e && e.stack) || '')}}); }} \
         emit({{type: 'number_of_executions', execution_count: g.__kiln_e2b_count}}); }})();\n"
    )
}

async fn execute(
    State(e2b): State<Arc<E2b>>,
    Extension(ctx): Extension<SandboxCtx>,
    body: Bytes,
) -> Response {
    let asked: ExecuteRequest = match kiln_http::objects::from_slice(&body) {
        Ok(asked) => asked,
        Err(e) => return text(StatusCode::BAD_REQUEST, format!("invalid body: {e}")),
    };
    if asked.code.len() > MAX_CODE_BYTES {
        return text(
            StatusCode::PAYLOAD_TOO_LARGE,
            "the code is larger than 1 MiB",
        );
    }
    if asked.context_id.is_some() && asked.language.is_some() {
        return text(
            StatusCode::BAD_REQUEST,
            "give context_id or language, not both",
        );
    }
    let rt = &e2b.app.runtime;
    let (session, language) = match context_of(&e2b, &ctx, &asked).await {
        Ok(found) => found,
        Err(response) => return response,
    };
    // Cells queue as a kernel's do: wait (a while) for the sandbox's running work to end.
    if let Err(response) = wait_idle(&e2b, &ctx).await {
        return response;
    }
    // A context whose state ended (an interrupted or timed-out cell, a restart of kiln)
    // starts afresh, as a restarted kernel would, and the cell says so.
    let mut restarted = false;
    if let Ok((_, None)) = rt.registry.session(&ctx.caller.tenant, ctx.id(), &session) {
        if let Err(e) = sessions::restart(rt, &ctx.caller, ctx.id(), &session).await {
            return failed(e);
        }
        restarted = true;
    }
    let env = asked.env_vars.unwrap_or_default();
    let code = match language {
        Language::Python => python_cell(&asked.code, &env),
        _ if !env.is_empty() => {
            return text(
                StatusCode::BAD_REQUEST,
                "env_vars apply to python cells only here",
            );
        }
        _ => javascript_cell(&asked.code),
    };
    stream_cell(&e2b, &ctx, session, language, code, restarted).await
}

/// The context a cell runs in (made if it is a default one not made yet), and its language.
async fn context_of(
    e2b: &E2b,
    ctx: &SandboxCtx,
    asked: &ExecuteRequest,
) -> Result<(String, Language), Response> {
    if let Some(id) = &asked.context_id {
        if let Some(language) = unmade_default(e2b, ctx, id) {
            ensure_default(e2b, ctx, language).await.map_err(failed)?;
            return Ok((id.clone(), language));
        }
        let (meta, _) = e2b
            .app
            .runtime
            .registry
            .session(&ctx.caller.tenant, ctx.id(), id)
            .map_err(failed)?;
        return Ok((id.clone(), meta.language));
    }
    let language = language(asked.language.as_deref())?;
    if !has_sessions(e2b, ctx, language) {
        return Err(text(
            StatusCode::BAD_REQUEST,
            format!("this sandbox's template runs no {language} code interpreter"),
        ));
    }
    ensure_default(e2b, ctx, language).await.map_err(failed)?;
    Ok((default_context(language).to_owned(), language))
}

/// Runs a cell's code in `session` and answers its output as NDJSON, as it comes.
async fn stream_cell(
    e2b: &E2b,
    ctx: &SandboxCtx,
    session: String,
    language: Language,
    code: String,
    restarted: bool,
) -> Response {
    let rt = &e2b.app.runtime;
    let exec = CodeExec {
        code,
        language: Some(language),
        session: Some(session),
        ..CodeExec::default()
    };
    let mut spec = match exec::prepare(rt, &ctx.caller, ctx.id(), exec) {
        Ok(spec) => spec,
        Err(e) => return failed(e),
    };
    let (begun_tx, begun_rx) = tokio::sync::oneshot::channel();
    spec.begun = Some(begun_tx);
    let exec_id = spec.exec_id.clone();
    let (chunks_tx, chunks) = mpsc::unbounded_channel();
    let (rt, caller, id) = (rt.clone(), ctx.caller.clone(), ctx.id().to_owned());
    let run = {
        let (rt, caller, id) = (rt.clone(), caller.clone(), id.clone());
        tokio::spawn(async move { exec::run(&rt, &caller, &id, spec, Some(chunks_tx)).await })
    };
    // A sandbox busy with something else answers at once, not as a stream.
    if begun_rx.await.is_err() {
        return match run.await {
            Ok(Err(e)) => failed(e),
            _ => text(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the cell could not start",
            ),
        };
    }
    let (lines_tx, lines) = mpsc::channel::<Bytes>(256);
    if restarted {
        let note = "kiln: this context's earlier state was lost (a cell was interrupted or timed out, or the server restarted); it was restarted\n";
        let _ = lines_tx.try_send(line(&output_line(true, note.to_owned())));
    }
    let cancel = CancelOnDrop {
        rt,
        tenant: caller.tenant.clone(),
        id,
        exec_id,
        done: false,
    };
    tokio::spawn(pump(chunks, run, lines_tx, language));
    let stream = futures::stream::unfold((lines, cancel), |(mut lines, mut cancel)| async move {
        match lines.recv().await {
            Some(line) => Some((Ok::<_, std::io::Error>(line), (lines, cancel))),
            None => {
                cancel.disarm();
                None
            }
        }
    });
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        axum::body::Body::from_stream(stream),
    )
        .into_response()
}

/// The longest a cell waits for the sandbox's running work before it is refused.
const QUEUE_WAIT: Duration = Duration::from_secs(60);

async fn wait_idle(e2b: &E2b, ctx: &SandboxCtx) -> Result<(), Response> {
    let until = tokio::time::Instant::now() + QUEUE_WAIT;
    loop {
        let view = e2b
            .app
            .runtime
            .registry
            .get(&ctx.caller.tenant, ctx.id())
            .map_err(failed)?;
        let Some(running) = view.running else {
            return Ok(());
        };
        if tokio::time::Instant::now() >= until {
            return Err(text(
                StatusCode::CONFLICT,
                format!(
                    "the sandbox has been busy with {running} for over {} s",
                    QUEUE_WAIT.as_secs()
                ),
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Cancels the cell when its client goes away before the end (E2B's interrupt).
struct CancelOnDrop {
    rt: Arc<kiln_runtime::Runtime>,
    tenant: String,
    id: String,
    exec_id: String,
    done: bool,
}

impl CancelOnDrop {
    /// The cell ended: nothing to cancel.
    fn disarm(&mut self) {
        self.done = true;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if !self.done {
            let _ = self
                .rt
                .registry
                .cancel(&self.tenant, &self.id, Some(&self.exec_id));
        }
    }
}

/// One NDJSON line.
fn line(value: &Value) -> Bytes {
    let mut text = value.to_string();
    text.push('\n');
    Bytes::from(text)
}

/// Output split into whole lines, a stream at a time.
#[derive(Default)]
struct Lines {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
}

impl Lines {
    /// Takes a chunk; returns the lines it completed.
    fn take(&mut self, stderr: bool, data: &[u8]) -> Vec<String> {
        let buf = if stderr {
            &mut self.stderr
        } else {
            &mut self.stdout
        };
        buf.extend_from_slice(data);
        // Whole lines out, in one drain (not a copy of the rest per line).
        let whole = buf.iter().rposition(|b| *b == b'\n').map_or(0, |at| at + 1);
        let mut done: Vec<String> = buf
            .drain(..whole)
            .as_slice()
            .split_inclusive(|b| *b == b'\n')
            .map(|line| String::from_utf8_lossy(line).into_owned())
            .collect();
        // A very long line without an end goes out in pieces.
        if buf.len() > 64 << 10 {
            done.push(String::from_utf8_lossy(buf).into_owned());
            buf.clear();
        }
        done
    }

    fn rest(&mut self, stderr: bool) -> Option<String> {
        let buf = if stderr {
            &mut self.stderr
        } else {
            &mut self.stdout
        };
        (!buf.is_empty()).then(|| String::from_utf8_lossy(&std::mem::take(buf)).into_owned())
    }
}

/// What one output line says: plain output, or a driver event.
fn output_line(stderr: bool, text: String) -> Value {
    if !stderr
        && let Some(event) = text.strip_prefix(MARK)
        && let Ok(value) = serde_json::from_str::<Value>(event.trim_end())
    {
        return value;
    }
    let kind = if stderr { "stderr" } else { "stdout" };
    json!({"type": kind, "text": text, "timestamp": rfc3339(now_ms())})
}

/// Turns the cell's output into NDJSON lines, with keepalives, then its end.
async fn pump(
    mut chunks: mpsc::UnboundedReceiver<kiln_executor::Chunk>,
    run: tokio::task::JoinHandle<kiln_runtime::Result<exec::RunOutcome>>,
    out: mpsc::Sender<Bytes>,
    language: Language,
) {
    let mut lines = Lines::default();
    let mut saw_error = false;
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + KEEPALIVE, KEEPALIVE);
    loop {
        tokio::select! {
            chunk = chunks.recv() => {
                let Some(chunk) = chunk else { break };
                // The cell driver says its results on stdout, as E2B's protocol has them.
                if chunk.stream == StreamKind::Display {
                    continue;
                }
                let stderr = chunk.stream == StreamKind::Stderr;
                for text in lines.take(stderr, &chunk.data) {
                    let value = output_line(stderr, text);
                    saw_error |= value["type"] == "error";
                    if out.send(line(&value)).await.is_err() {
                        return;
                    }
                }
            }
            _ = ticks.tick() => {
                if out.send(line(&json!({"type": "keepalive"}))).await.is_err() {
                    return;
                }
            }
        }
    }
    for stderr in [false, true] {
        if let Some(text) = lines.rest(stderr) {
            let value = output_line(stderr, text);
            saw_error |= value["type"] == "error";
            let _ = out.send(line(&value)).await;
        }
    }
    let outcome = run.await;
    let error = match outcome {
        Ok(Ok(outcome)) if !outcome.result.success() && !saw_error => {
            let reason = outcome.stderr_with_reason();
            let (name, value) = match outcome.result.outcome {
                kiln_core::Outcome::TimedOut => (
                    "TimeoutError",
                    "the cell ran past its time limit".to_owned(),
                ),
                _ if language == Language::JavaScript => {
                    let first = reason.lines().next().unwrap_or("Error").to_owned();
                    let (name, value) = first.split_once(": ").unwrap_or(("Error", first.as_str()));
                    let name = name.trim_start_matches("Uncaught ").to_owned();
                    let value = value.to_owned();
                    return finish(&out, Some(json!({"type": "error", "name": name, "value": value, "traceback": reason}))).await;
                }
                _ => (
                    "KernelError",
                    reason
                        .lines()
                        .last()
                        .unwrap_or("the cell failed")
                        .to_owned(),
                ),
            };
            Some(json!({"type": "error", "name": name, "value": value, "traceback": reason}))
        }
        Ok(Ok(_)) => None,
        Ok(Err(e)) => Some(json!({
            "type": "error",
            "name": "KernelError",
            "value": kiln_runtime::sandbox::scrub_paths(&e.to_string()),
            "traceback": "",
        })),
        Err(_) => Some(
            json!({"type": "error", "name": "KernelError", "value": "the cell's task failed", "traceback": ""}),
        ),
    };
    finish(&out, error).await;
}

async fn finish(out: &mpsc::Sender<Bytes>, error: Option<Value>) {
    if let Some(error) = error {
        let _ = out.send(line(&error)).await;
    }
    let _ = out.send(line(&json!({"type": "end_of_execution"}))).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_is_cut_into_whole_lines_and_driver_events_are_taken_out() {
        let mut lines = Lines::default();
        assert!(lines.take(false, b"Hel").is_empty());
        assert_eq!(lines.take(false, b"lo\nwor"), vec!["Hello\n"]);
        assert_eq!(lines.rest(false).as_deref(), Some("wor"));
        let event = output_line(
            false,
            format!("{MARK}{{\"type\":\"result\",\"text\":\"2\"}}\n"),
        );
        assert_eq!(event, json!({"type": "result", "text": "2"}));
        let plain = output_line(true, "oops\n".into());
        assert_eq!(plain["type"], "stderr");
        assert_eq!(plain["text"], "oops\n");
        // A marker on stderr is plain text.
        assert_eq!(output_line(true, format!("{MARK}{{}}\n"))["type"], "stderr");
    }
}
