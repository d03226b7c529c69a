//! envd's process service (`process.Process/*`): Start and Connect stream a process's
//! output; List, SendInput, StreamInput, SendSignal, CloseStdin and Update act on running
//! ones. On a Linux template every command is a real process in the sandbox's box
//! ([`kiln_runtime::processes`]). A WebAssembly sandbox has no processes: there `python`
//! / `python3` commands (`-c CODE`, `FILE`, `-m MODULE`, with arguments) run as one-shot
//! executions, and anything else ends with exit code 127 and the reason on stderr.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use axum::Extension;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::Response;
use bytes::Bytes;
use kiln_core::TerminalSize;
use kiln_core::backend::StreamKind;
use kiln_core::process::ProcessEvent;
use kiln_runtime::exec::{self, CodeExec, CommandLineError, CommandProgram};
use kiln_runtime::processes::{self, Follow, Running, StartProcess};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc};

use super::connect::{self, RpcError, b64, envelope};
use super::{E2b, SandboxCtx};

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ProcessConfig {
    cmd: String,
    args: Vec<String>,
    envs: BTreeMap<String, String>,
    cwd: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Size {
    cols: u16,
    rows: u16,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Pty {
    size: Option<Size>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct StartRequest {
    process: ProcessConfig,
    pty: Option<Pty>,
    tag: Option<String>,
    stdin: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Selector {
    pid: Option<u32>,
    tag: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Input {
    #[serde(with = "b64_opt")]
    stdin: Option<Vec<u8>>,
    #[serde(with = "b64_opt")]
    pty: Option<Vec<u8>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct SelectRequest {
    process: Selector,
    input: Option<Input>,
    signal: Option<Value>,
    pty: Option<Pty>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct StreamInputRequest {
    start: Option<SelectRequest>,
    data: Option<SelectRequest>,
}

mod b64_opt {
    use serde::{Deserialize, Deserializer};

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
        #[derive(Deserialize)]
        struct Wrap(#[serde(with = "super::b64")] Vec<u8>);
        Ok(Option::<Wrap>::deserialize(d)?.map(|w| w.0))
    }
}

/// `POST /process.Process/{method}`.
pub async fn rpc(
    State(e2b): State<Arc<E2b>>,
    Path(method): Path<String>,
    Extension(ctx): Extension<SandboxCtx>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let streaming = connect::is_streaming(&headers);
    let keepalive = headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(Duration::from_secs(50), |s| {
            Duration::from_secs(s.clamp(1, 3600))
        });
    let deadline = headers
        .get("connect-timeout-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|ms| *ms > 0)
        .map(Duration::from_millis);
    match method.as_str() {
        "Start" => {
            let asked: StartRequest = match connect::decode(&body, streaming) {
                Ok(asked) => asked,
                Err(e) => return connect::stream_error(e),
            };
            start(&e2b, &ctx, asked, keepalive, deadline).await
        }
        "Connect" => {
            let asked: SelectRequest = match connect::decode(&body, streaming) {
                Ok(asked) => asked,
                Err(e) => return connect::stream_error(e),
            };
            match find(&e2b, &ctx, &asked.process) {
                Ok(running) => follow(running, None, keepalive, deadline),
                Err(e) => connect::stream_error(e),
            }
        }
        "StreamInput" => {
            let answer = stream_input(&e2b, &ctx, &body).await;
            if streaming {
                let frames = match answer {
                    Ok(()) => vec![envelope(&json!({})), connect::end_stream(None)],
                    Err(e) => vec![connect::end_stream(Some(&e))],
                };
                connect::stream_response(futures::stream::iter(frames))
            } else {
                connect::unary(answer.map(|()| json!({})))
            }
        }
        _ => connect::unary(unary(&e2b, &ctx, &method, &body).await),
    }
}

fn find(e2b: &E2b, ctx: &SandboxCtx, selector: &Selector) -> Result<Arc<Running>, RpcError> {
    if selector.pid.is_none() && selector.tag.is_none() {
        return Err(RpcError::invalid("name the process by pid or tag"));
    }
    e2b.app
        .runtime
        .processes
        .find(ctx.id(), selector.pid, selector.tag.as_deref())
        .map_err(|e| RpcError::not_found(e.to_string()))
}

async fn unary(e2b: &E2b, ctx: &SandboxCtx, method: &str, body: &[u8]) -> Result<Value, RpcError> {
    match method {
        "List" => {
            let all = e2b.app.runtime.processes.list(ctx.id());
            let processes: Vec<Value> = all
                .iter()
                .map(|p| {
                    let (cmd, args) = p
                        .argv
                        .split_first()
                        .map_or((String::new(), &[][..]), |(c, a)| (c.clone(), a));
                    json!({
                        "config": {"cmd": cmd, "args": args, "envs": p.env, "cwd": p.cwd},
                        "pid": p.pid,
                        "tag": p.tag,
                    })
                })
                .collect();
            Ok(json!({"processes": processes}))
        }
        "SendInput" => {
            let asked: SelectRequest = connect::decode(body, false)?;
            let running = find(e2b, ctx, &asked.process)?;
            let input = asked.input.unwrap_or_default();
            let data = input.stdin.or(input.pty).unwrap_or_default();
            running.write_stdin(data, false).await?;
            Ok(json!({}))
        }
        "CloseStdin" => {
            let asked: SelectRequest = connect::decode(body, false)?;
            find(e2b, ctx, &asked.process)?
                .write_stdin(Vec::new(), true)
                .await?;
            Ok(json!({}))
        }
        "SendSignal" => {
            let asked: SelectRequest = connect::decode(body, false)?;
            let running = find(e2b, ctx, &asked.process)?;
            let signal = match asked.signal {
                Some(Value::String(name)) => match name.as_str() {
                    "SIGNAL_SIGKILL" => 9,
                    "SIGNAL_SIGTERM" => 15,
                    _ => return Err(RpcError::invalid(format!("unknown signal {name}"))),
                },
                Some(Value::Number(n)) if matches!(n.as_u64(), Some(9 | 15)) => {
                    n.as_u64().unwrap_or(9) as i32
                }
                _ => {
                    return Err(RpcError::invalid(
                        "signal is SIGNAL_SIGKILL or SIGNAL_SIGTERM",
                    ));
                }
            };
            running.signal(signal).await?;
            Ok(json!({}))
        }
        "Update" => {
            let asked: SelectRequest = connect::decode(body, false)?;
            let running = find(e2b, ctx, &asked.process)?;
            if let Some(size) = asked.pty.and_then(|p| p.size) {
                if !running.terminal {
                    return Err(RpcError::new(
                        "failed_precondition",
                        "the process has no terminal",
                    ));
                }
                running.resize(terminal_size(&size)?).await?;
            }
            Ok(json!({}))
        }
        other => Err(RpcError::new(
            "unimplemented",
            format!("process.Process has no method {other}"),
        )),
    }
}

fn terminal_size(size: &Size) -> Result<TerminalSize, RpcError> {
    if size.cols == 0 || size.rows == 0 || size.cols > 1000 || size.rows > 1000 {
        return Err(RpcError::invalid("a terminal is 1..=1000 columns and rows"));
    }
    Ok(TerminalSize {
        rows: size.rows,
        cols: size.cols,
    })
}

/// `StreamInput`: a `start` naming the process, then `data` messages of input.
async fn stream_input(e2b: &E2b, ctx: &SandboxCtx, body: &[u8]) -> Result<(), RpcError> {
    let messages: Vec<StreamInputRequest> = connect::decode_all(body)?;
    let mut target = None;
    for message in messages {
        if let Some(start) = message.start {
            target = Some(find(e2b, ctx, &start.process)?);
        }
        if let Some(data) = message.data {
            let running = target
                .as_ref()
                .ok_or_else(|| RpcError::invalid("StreamInput starts with a start message"))?;
            let input = data.input.unwrap_or_default();
            running
                .write_stdin(input.stdin.or(input.pty).unwrap_or_default(), false)
                .await?;
        }
    }
    Ok(())
}

/// Starts a process and streams it.
async fn start(
    e2b: &E2b,
    ctx: &SandboxCtx,
    asked: StartRequest,
    keepalive: Duration,
    deadline: Option<Duration>,
) -> Response {
    let mut argv = vec![asked.process.cmd.clone()];
    argv.extend(asked.process.args.iter().cloned());
    if !processes::runs_processes(&e2b.app.runtime, &ctx.sandbox) {
        return wasm_command(e2b, ctx, &argv, asked.process.envs, keepalive).await;
    }
    let terminal = match asked.pty.as_ref().and_then(|p| p.size.as_ref()) {
        Some(size) => match terminal_size(size) {
            Ok(size) => Some(size),
            Err(e) => return connect::stream_error(e),
        },
        None => None,
    };
    let start = StartProcess {
        argv,
        env: asked.process.envs,
        cwd: asked.process.cwd.filter(|c| !c.is_empty()),
        tag: asked.tag,
        terminal,
        stdin: asked.stdin.unwrap_or(false),
    };
    match processes::start(&e2b.app.runtime, &ctx.caller, ctx.id(), start).await {
        Ok((running, events)) => follow(running, Some(events), keepalive, deadline),
        Err(e) => connect::stream_error(e.into()),
    }
}

/// Streams a process: its start, its output, its end (and keepalives meanwhile).
/// `events`: the receiver subscribed at start; `None` to follow from now (Connect).
fn follow(
    running: Arc<Running>,
    events: Option<broadcast::Receiver<ProcessEvent>>,
    keepalive: Duration,
    deadline: Option<Duration>,
) -> Response {
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    let first = envelope(&json!({"event": {"start": {"pid": running.pid}}}));
    let follow = match events {
        Some(events) => Follow::Live(events),
        None => running.follow(),
    };
    tokio::spawn(async move {
        if tx.send(first).await.is_err() {
            return;
        }
        let mut events = match follow {
            Follow::Ended(end) => {
                let _ = tx.send(event_frame(&end)).await;
                let _ = tx.send(connect::end_stream(None)).await;
                return;
            }
            Follow::Live(events) => events,
        };
        // Said a little before the client's own deadline, so the client reads the reason
        // rather than a bare read timeout.
        let give_up =
            tokio::time::sleep(deadline.map_or(Duration::from_secs(u64::MAX >> 2), |d| {
                d.saturating_sub((d / 20).max(Duration::from_millis(50)))
            }));
        tokio::pin!(give_up);
        let mut ticks =
            tokio::time::interval_at(tokio::time::Instant::now() + keepalive, keepalive);
        loop {
            let frame = tokio::select! {
                event = events.recv() => match event {
                    Ok(event) => {
                        let end = matches!(event, ProcessEvent::Exited { .. });
                        if tx.send(event_frame(&event)).await.is_err() {
                            return;
                        }
                        if end {
                            connect::end_stream(None)
                        } else {
                            continue;
                        }
                    }
                    // A follower that fell behind misses some output, not the end.
                    Err(broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(broadcast::error::RecvError::Closed) => connect::end_stream(None),
                },
                _ = ticks.tick() => {
                    if tx.send(envelope(&json!({"event": {"keepalive": {}}}))).await.is_err() {
                        return;
                    }
                    continue;
                }
                () = &mut give_up => connect::end_stream(Some(&RpcError::new(
                    "deadline_exceeded",
                    "the command's connection timed out (the process goes on; connect to it again, or kill it)",
                ))),
            };
            let _ = tx.send(frame).await;
            return;
        }
    });
    connect::stream_response(futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|frame| (frame, rx))
    }))
}

/// One process event as envd's `StartResponse`.
fn event_frame(event: &ProcessEvent) -> Bytes {
    use base64::Engine;
    let b64 = |data: &[u8]| base64::engine::general_purpose::STANDARD.encode(data);
    let value = match event {
        ProcessEvent::Stdout(data) => json!({"event": {"data": {"stdout": b64(data)}}}),
        ProcessEvent::Stderr(data) => json!({"event": {"data": {"stderr": b64(data)}}}),
        ProcessEvent::Terminal(data) => json!({"event": {"data": {"pty": b64(data)}}}),
        ProcessEvent::Exited { code, signal } => {
            let (exit_code, exited, status) = match (code, signal) {
                (Some(code), _) => (*code, true, format!("exit status {code}")),
                (None, Some(signal)) => (-1, false, format!("signal: {}", signal_name(*signal))),
                (None, None) => (-1, false, "unknown".to_owned()),
            };
            json!({"event": {"end": {"exitCode": exit_code, "exited": exited, "status": status}}})
        }
    };
    envelope(&value)
}

fn signal_name(signal: i32) -> &'static str {
    match signal {
        9 => "killed",
        15 => "terminated",
        2 => "interrupt",
        6 => "aborted",
        11 => "segmentation fault",
        13 => "broken pipe",
        _ => "signal",
    }
}

static NEXT_PID: AtomicU32 = AtomicU32::new(1000);

/// A command in a WebAssembly sandbox: a Python command runs as a one-shot execution;
/// anything else ends with 127 and the reason.
async fn wasm_command(
    e2b: &E2b,
    ctx: &SandboxCtx,
    argv: &[String],
    envs: BTreeMap<String, String>,
    keepalive: Duration,
) -> Response {
    let pid = NEXT_PID.fetch_add(1, Ordering::Relaxed);
    let start = envelope(&json!({"event": {"start": {"pid": pid}}}));
    let (assigned, program) = match python_command(argv) {
        Ok(command) => command,
        Err(not_run) => {
            let refused = match not_run {
                NotRun::Refused(e) => format!("{e}; "),
                NotRun::NoShell => String::new(),
            };
            let why = format!(
                "kiln: {refused}this sandbox runs WebAssembly Python ({}), which has no shell and no processes: only `python -c CODE`, `python FILE` and `python -m MODULE` run here. Create the sandbox from the \"base\" template (a Linux sandbox) to run any command.\n",
                ctx.sandbox.template()
            );
            let frames = vec![
                start,
                event_frame(&ProcessEvent::Stderr(Bytes::from(why))),
                event_frame(&ProcessEvent::Exited {
                    code: Some(127),
                    signal: None,
                }),
                connect::end_stream(None),
            ];
            return connect::stream_response(futures::stream::iter(frames));
        }
    };
    let mut env = envs;
    env.extend(assigned);
    let rt = e2b.app.runtime.clone();
    let (caller, id) = (ctx.caller.clone(), ctx.id().to_owned());
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    tokio::spawn(async move {
        if tx.send(start).await.is_err() {
            return;
        }
        let (extra, end) = run_python_command(rt, caller, id, program, env, keepalive, &tx).await;
        if let Some(extra) = extra {
            let _ = tx
                .send(event_frame(&ProcessEvent::Stderr(Bytes::from(extra))))
                .await;
        }
        let _ = tx.send(event_frame(&end)).await;
        let _ = tx.send(connect::end_stream(None)).await;
    });
    connect::stream_response(futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|frame| (frame, rx))
    }))
}

/// Runs a Python command as a one-shot execution, sending its output to `tx` as it comes
/// (with keepalives); answers what stderr still needs to say (kiln's reason for an end that
/// was not the program's own) and the end.
async fn run_python_command(
    rt: Arc<kiln_runtime::Runtime>,
    caller: kiln_runtime::auth::Caller,
    id: String,
    program: PythonCommand,
    env: BTreeMap<String, String>,
    keepalive: Duration,
    tx: &mpsc::Sender<Bytes>,
) -> (Option<String>, ProcessEvent) {
    let failed = |message: String| {
        let end = ProcessEvent::Exited {
            code: Some(1),
            signal: None,
        };
        (
            Some(format!(
                "kiln: {}\n",
                kiln_runtime::sandbox::scrub_paths(&message)
            )),
            end,
        )
    };
    let exec = CodeExec {
        code: program.code,
        language: Some(kiln_core::Language::Python),
        env,
        ..CodeExec::default()
    };
    let mut spec = match exec::prepare(&rt, &caller, &id, exec) {
        Ok(spec) => spec,
        Err(e) => return failed(e.to_string()),
    };
    spec.code_file = program.file;
    spec.args = program.args;
    let (chunks_tx, mut chunks) = mpsc::unbounded_channel::<kiln_executor::Chunk>();
    let run =
        tokio::spawn(async move { exec::run(&rt, &caller, &id, spec, Some(chunks_tx)).await });
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + keepalive, keepalive);
    loop {
        let frame = tokio::select! {
            chunk = chunks.recv() => match chunk {
                Some(chunk) => match chunk.stream {
                    StreamKind::Stderr => event_frame(&ProcessEvent::Stderr(Bytes::from(chunk.data))),
                    StreamKind::Stdout => event_frame(&ProcessEvent::Stdout(Bytes::from(chunk.data))),
                    // A command's output is text; rich results are the code interpreter's.
                    StreamKind::Display => continue,
                },
                None => break,
            },
            _ = ticks.tick() => envelope(&json!({"event": {"keepalive": {}}})),
        };
        let _ = tx.send(frame).await;
    }
    match run.await {
        Ok(Ok(outcome)) => {
            let reason = outcome.stderr_with_reason();
            let own = outcome.result.stderr_text();
            let extra = reason
                .strip_prefix(own.as_str())
                .filter(|r| !r.is_empty())
                .map(str::to_owned);
            let end = ProcessEvent::Exited {
                code: Some(outcome.result.exit_code),
                signal: None,
            };
            (extra, end)
        }
        Ok(Err(e)) => failed(e.to_string()),
        Err(_) => (
            None,
            ProcessEvent::Exited {
                code: None,
                signal: Some(9),
            },
        ),
    }
}

/// A Python program a command names.
#[derive(Debug, PartialEq)]
struct PythonCommand {
    /// The launcher (see [`exec::python_launcher`]); empty when `file` runs.
    code: String,
    file: Option<kiln_workspace::RelPath>,
    args: Vec<String>,
}

/// Why a command does not run in a WebAssembly sandbox.
#[derive(Debug, PartialEq)]
enum NotRun {
    /// Anything but a Python command line: it needs a shell (pipes, redirections,
    /// expansions), runs another program, or names a file outside the workspace.
    NoShell,
    /// A `python` command line kiln does not run (an option it does not take, a bad module).
    Refused(CommandLineError),
}

/// `python…` commands, as `bash -l -c "…"` or as argv: the environment assignments before
/// the program, and what it runs, read by the runtime's one parser of command lines.
fn python_command(argv: &[String]) -> Result<(BTreeMap<String, String>, PythonCommand), NotRun> {
    let words = match argv {
        [shell, rest @ ..] if matches!(shell.rsplit('/').next(), Some("bash" | "sh")) => {
            let at = rest.iter().position(|a| a == "-c").ok_or(NotRun::NoShell)?;
            rest.get(at + 1)
                .and_then(|line| split_words(line))
                .ok_or(NotRun::NoShell)?
        }
        _ => argv.to_vec(),
    };
    let mut env = BTreeMap::new();
    let mut words = words.into_iter().peekable();
    while let Some(word) = words.peek() {
        match word.split_once('=') {
            Some((name, value))
                if !name.is_empty()
                    && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') =>
            {
                env.insert(name.to_owned(), value.to_owned());
                words.next();
            }
            _ => break,
        }
    }
    let words: Vec<String> = words.collect();
    let line = match exec::parse_command_line(&words) {
        Ok(line) if line.language == kiln_core::Language::Python => line,
        Ok(_) | Err(CommandLineError::Empty | CommandLineError::UnknownProgram { .. }) => {
            return Err(NotRun::NoShell);
        }
        Err(refused) => return Err(NotRun::Refused(refused)),
    };
    let command = match line.program {
        CommandProgram::File(file) => {
            let rel = file.strip_prefix("/home/user/").unwrap_or(&file);
            PythonCommand {
                code: String::new(),
                file: Some(
                    kiln_runtime::sandbox::workspace_path(rel).map_err(|_| NotRun::NoShell)?,
                ),
                args: line.args,
            }
        }
        _ => PythonCommand {
            code: line.launcher_at(super::HOME),
            file: None,
            args: Vec::new(),
        },
    };
    Ok((env, command))
}

/// Splits a command line into words as a POSIX shell would (quotes and backslashes);
/// `None` if it uses anything else of the shell (pipes, redirections, expansions, lists).
fn split_words(line: &str) -> Option<Vec<String>> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                in_word = true;
                loop {
                    match chars.next()? {
                        '\'' => break,
                        c => word.push(c),
                    }
                }
            }
            '"' => {
                in_word = true;
                loop {
                    match chars.next()? {
                        '"' => break,
                        '\\' => match chars.next()? {
                            c @ ('"' | '\\' | '$' | '`') => word.push(c),
                            '\n' => {}
                            c => {
                                word.push('\\');
                                word.push(c);
                            }
                        },
                        '$' | '`' => return None,
                        c => word.push(c),
                    }
                }
            }
            '\\' => {
                in_word = true;
                match chars.next()? {
                    '\n' => {}
                    c => word.push(c),
                }
            }
            ' ' | '\t' | '\n' => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            '|' | '&' | ';' | '<' | '>' | '(' | ')' | '$' | '`' | '*' | '?' | '[' | '{' | '}'
            | '#' | '~' => return None,
            c => {
                in_word = true;
                word.push(c);
            }
        }
    }
    if in_word {
        words.push(word);
    }
    Some(words)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(words: &[&str]) -> Vec<String> {
        words.iter().map(|w| (*w).to_owned()).collect()
    }

    #[test]
    fn words_split_as_a_shell_splits_them() {
        assert_eq!(
            split_words("python3 -c 'print(1)'").unwrap(),
            strings(&["python3", "-c", "print(1)"])
        );
        assert_eq!(
            split_words(r#"a "b c" d\ e ''"#).unwrap(),
            strings(&["a", "b c", "d e", ""])
        );
        assert_eq!(
            split_words(r#""say \"hi\"""#).unwrap(),
            strings(&["say \"hi\""])
        );
        for shell in [
            "a | b",
            "a > f",
            "echo $HOME",
            "a; b",
            "a && b",
            "\"$(x)\"",
            "ls *",
            "'open",
        ] {
            assert_eq!(split_words(shell), None, "{shell}");
        }
    }

    #[test]
    fn python_commands_are_recognised_and_others_are_not() -> Result<(), NotRun> {
        let bash = |line: &str| strings(&["/bin/bash", "-l", "-c", line]);
        let (env, cmd) = python_command(&bash("FOO=bar python3 -c 'import os; print(1)' x"))?;
        assert_eq!(env.get("FOO").map(String::as_str), Some("bar"));
        assert!(cmd.code.contains("import os; print(1)") && cmd.file.is_none());
        assert!(cmd.code.contains(r#"_kiln_sys.argv = ["-c", "x"]"#));
        let (_, cmd) = python_command(&bash("python /home/user/app.py a b"))?;
        assert_eq!(
            cmd.file.map(|f| f.as_str().to_owned()).as_deref(),
            Some("app.py")
        );
        assert_eq!(cmd.args, strings(&["a", "b"]));
        let (_, cmd) = python_command(&bash("python -m json.tool"))?;
        assert!(cmd.code.contains(r#"run_module("json.tool""#) && cmd.file.is_none());
        for other in [
            "echo hi",
            "ls",
            "node -e 1",
            "pip install x",
            "python3 x | y",
            "",
        ] {
            assert_eq!(
                python_command(&bash(other)).unwrap_err(),
                NotRun::NoShell,
                "{other}"
            );
        }
        // A Python command line kiln does not run says why.
        for refused in ["python3 -V", "python3 -c", "python -m ../x", "python"] {
            let NotRun::Refused(_) = python_command(&bash(refused)).unwrap_err() else {
                panic!("{refused} is refused without a reason");
            };
        }
        python_command(&strings(&["python3", "-c", "print(2)"]))?;
        Ok(())
    }
}
