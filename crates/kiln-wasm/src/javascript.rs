//! JavaScript guests: the QuickJS-NG WASI reactor.
//!
//! The reactor has no eval export; it runs `qjs` with an argv (`qjs --std -m -e CODE`). A
//! one-shot is a fresh instance and one such call. A session is one long call whose code is a
//! read-eval loop over stdin: the host writes each turn's code as a JSON line and the loop
//! answers with a marker line (carrying a random per-session nonce) on stdout when the turn
//! is done. The marker never reaches the caller.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use kiln_core::{ExecRequest, ExecResult, Language, Limits};
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, oneshot};
use wasmtime::{Instance, Store, TypedFunc};
use wasmtime_wasi::cli::AsyncStdinStream;
use wasmtime_wasi::p2::pipe::MemoryInputPipe;

use crate::engine::{ExecError, JsRuntime, WasmEngine, instantiate_error, instantiation_error};
use crate::guest::{
    CallEnd, FsBudget, GuestState, Preopen, PrivateTmp, Stats, Stdio, arm_deadline, bounded_call,
    classify_error, ensure_alive, finish, new_store, push_grants, wasi_context,
};
use crate::output::OutputChunk;

const BASE_ENV: &[(&str, &str)] = &[("TMPDIR", "/tmp"), ("HOME", "/tmp")];

struct Prepared {
    store: Store<GuestState>,
    instance: Instance,
    stdio: Stdio,
    tmp: PrivateTmp,
}

async fn prepare(
    engine: &WasmEngine,
    runtime: &JsRuntime,
    request: &ExecRequest,
    stdin: Box<dyn wasmtime_wasi::cli::StdinStream>,
) -> Result<Prepared, ExecError> {
    let tmp = engine.private_tmp().map_err(ExecError::Tmp)?;
    let stdio = Stdio::new(&request.limits);
    let mut preopens = vec![Preopen {
        host: tmp.path(),
        guest: "/tmp",
        writable: true,
    }];
    push_grants(request, &mut preopens);
    let wasi = wasi_context(&preopens, BASE_ENV, request, &stdio, stdin, &["qjs"])?;
    let mut store = new_store(runtime.pre.module().engine(), wasi, &request.limits)
        .map_err(|e| instantiate_error(Language::JavaScript, e))?;
    let instance = runtime
        .pre
        .instantiate_async(&mut store)
        .await
        .map_err(|e| instantiation_error(runtime.slots, Language::JavaScript, e))?;
    Ok(Prepared {
        store,
        instance,
        stdio,
        tmp,
    })
}

/// Initialises the reactor and runs `qjs` with `args`.
async fn run_qjs(
    store: &mut Store<GuestState>,
    instance: Instance,
    args: &[&str],
) -> wasmtime::Result<i32> {
    let initialize: TypedFunc<(), ()> = instance.get_typed_func(&mut *store, "_initialize")?;
    let malloc: TypedFunc<i32, i32> = instance.get_typed_func(&mut *store, "malloc")?;
    let init_argv: TypedFunc<(i32, i32), i32> =
        instance.get_typed_func(&mut *store, "qjs_init_argv")?;
    let memory = instance
        .get_memory(&mut *store, "memory")
        .ok_or_else(|| wasmtime::format_err!("the module exports no memory"))?;
    initialize.call_async(&mut *store, ()).await?;
    // One block: the NUL-terminated strings, then the pointer array. QuickJS keeps argv, so
    // the block is never freed (the instance is short-lived or lives as long as argv).
    let strings: usize = args.iter().map(|a| a.len() + 1).sum();
    let total = strings + 4 * (args.len() + 1);
    let size = i32::try_from(total).map_err(|_| wasmtime::format_err!("argv too large"))?;
    let base = malloc.call_async(&mut *store, size).await?;
    if base == 0 {
        return Err(wasmtime::format_err!("the guest could not allocate argv"));
    }
    let base = u32::try_from(base)?;
    let mut block = Vec::with_capacity(total);
    let mut pointers = Vec::with_capacity(args.len() + 1);
    for arg in args {
        pointers.push(base + u32::try_from(block.len())?);
        block.extend_from_slice(arg.as_bytes());
        block.push(0);
    }
    pointers.push(0);
    let argv = base + u32::try_from(block.len())?;
    for pointer in pointers {
        block.extend_from_slice(&pointer.to_le_bytes());
    }
    memory.write(&mut *store, base as usize, &block)?;
    let argc = i32::try_from(args.len())?;
    init_argv
        .call_async(&mut *store, (argc, i32::try_from(argv)?))
        .await
}

/// Browser-style timer globals (QuickJS keeps them in `os`).
const TIMERS: &str = "globalThis.setTimeout=os.setTimeout;globalThis.clearTimeout=os.clearTimeout;";

/// Prefix run before the code on its first line, so line numbers stay true: timer globals,
/// and the workspace as the working directory.
fn prelude(request: &ExecRequest) -> String {
    let mut prelude = String::from(TIMERS);
    if request.workspace.is_some() {
        prelude.push_str(&format!("os.chdir({:?});", request.workspace_guest()));
    }
    prelude
}

/// Runs a request in a fresh instance.
pub(crate) async fn run_once(
    engine: &WasmEngine,
    runtime: &JsRuntime,
    request: &ExecRequest,
    listener: Option<mpsc::UnboundedSender<OutputChunk>>,
) -> Result<ExecResult, ExecError> {
    let started = Instant::now();
    let stdin = Box::new(MemoryInputPipe::new(request.stdin.clone()));
    let Prepared {
        mut store,
        instance,
        stdio,
        tmp: _tmp,
    } = prepare(engine, runtime, request, stdin).await?;
    stdio.start_turn(&request.limits, listener);
    let code = format!("{}{}", prelude(request), request.code);
    let args = ["qjs", "--std", "-m", "-e", code.as_str()];
    let deadline = store.data().deadline_ns.clone();
    let clock_base = store.data().clock_base;
    let end = bounded_call(&deadline, clock_base, run_qjs(&mut store, instance, &args)).await;
    // qjs answers -1 when the script threw (it printed the exception).
    let end = match end {
        CallEnd::Returned(v) if v != 0 => CallEnd::Returned(1),
        other => other,
    };
    Ok(finish(&end, &store.data().memory.stats, &stdio, started))
}

/// The read-eval loop a JavaScript session runs. `NONCE` is replaced per session.
const SESSION_LOOP: &str = r#"(function () {
  var marker = "\u0001kiln-turn-end-NONCE:";
  var line;
  while ((line = std.in.getline()) !== null) {
    var status = 0;
    try {
      (0, eval)(JSON.parse(line));
    } catch (e) {
      status = 1;
      var text = String(e);
      if (e && e.stack) text += "\n" + e.stack;
      std.err.puts(text.endsWith("\n") ? text : text + "\n");
    }
    std.out.flush();
    std.err.flush();
    std.out.puts(marker + status + "\n");
    std.out.flush();
  }
})();"#;

/// Why a JavaScript session takes no instruction budget: its guest is one long call, with
/// no point between turns where the host could refill the store's fuel.
pub(crate) const JS_SESSION_FUEL: &str = "JavaScript sessions do not count fuel (the session is one long call); run the code as a one-shot, or in a Python session opened with a budget";

/// A live JavaScript session.
pub(crate) struct JsSession {
    stdin: tokio::io::DuplexStream,
    turns: mpsc::UnboundedReceiver<Vec<u8>>,
    stdio: Stdio,
    deadline_ns: Arc<AtomicU64>,
    clock_base: Instant,
    task: Option<tokio::task::JoinHandle<()>>,
    task_end: Option<oneshot::Receiver<CallEnd<i32>>>,
    stats: Arc<Stats>,
    fs: Arc<FsBudget>,
    pub ended: Option<String>,
    _tmp: PrivateTmp,
}

impl Drop for JsSession {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

fn nonce() -> String {
    let mut bytes = [0u8; 12];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        let _ = std::io::Read::read_exact(&mut f, &mut bytes);
    }
    hex::encode(bytes)
}

impl JsSession {
    pub async fn open(
        engine: &WasmEngine,
        runtime: &JsRuntime,
        request: &ExecRequest,
    ) -> Result<JsSession, ExecError> {
        let (host_side, guest_side) = tokio::io::duplex(1 << 20);
        let stdin = Box::new(AsyncStdinStream::new(guest_side));
        let Prepared {
            mut store,
            instance,
            stdio,
            tmp,
        } = prepare(engine, runtime, request, stdin).await?;
        let nonce = nonce();
        let (turn_tx, turns) = mpsc::unbounded_channel();
        let marker = format!("\u{1}kiln-turn-end-{nonce}:").into_bytes();
        stdio.stdout.set_control(marker, turn_tx);
        let deadline_ns = store.data().deadline_ns.clone();
        let clock_base = store.data().clock_base;
        let stats = store.data().memory.stats.clone();
        let fs = store.data().fs.clone();
        // Idle sessions have no deadline; each turn arms one.
        deadline_ns.store(u64::MAX, Ordering::Relaxed);
        let code = format!(
            "{}{}",
            prelude(request),
            SESSION_LOOP.replace("NONCE", &nonce)
        );
        let (end_tx, task_end) = oneshot::channel();
        let task = tokio::spawn(async move {
            // One call for the session's life: the epoch callback interrupts wasm past a
            // turn's deadline, and the host aborts this task when a turn blocked in a host
            // call overruns.
            let args = ["qjs", "--std", "-e", code.as_str()];
            let end = match run_qjs(&mut store, instance, &args).await {
                Ok(v) => CallEnd::Returned(v),
                Err(error) => classify_error(error),
            };
            let _ = end_tx.send(end);
        });
        Ok(JsSession {
            stdin: host_side,
            turns,
            stdio,
            deadline_ns,
            clock_base,
            task: Some(task),
            task_end: Some(task_end),
            stats,
            fs,
            ended: None,
            _tmp: tmp,
        })
    }

    pub async fn turn(
        &mut self,
        code: &str,
        limits: &Limits,
        listener: Option<mpsc::UnboundedSender<OutputChunk>>,
    ) -> Result<ExecResult, ExecError> {
        let started = Instant::now();
        ensure_alive(&self.ended)?;
        if limits.fuel.is_some() {
            return Err(ExecError::FuelUnavailable {
                why: JS_SESSION_FUEL,
            });
        }
        self.stdio.start_turn(limits, listener);
        let mut line = serde_json::to_string(code).expect("a string serializes");
        line.push('\n');
        self.stats.start_turn();
        self.fs.reset(limits);
        arm_deadline(&self.deadline_ns, self.clock_base, limits);
        let deadline = self.clock_base
            + std::time::Duration::from_nanos(self.deadline_ns.load(Ordering::Relaxed));
        let died = || CallEnd::Trapped("the session task died".into());
        // The turn ends with the loop's marker, or with the guest itself (exit, trap).
        let wait = async {
            if self.stdin.write_all(line.as_bytes()).await.is_err() {
                return None;
            }
            let task_end = self.task_end.as_mut()?;
            tokio::select! {
                status = self.turns.recv() => status.map(Ok),
                end = task_end => Some(Err(end.unwrap_or_else(|_| died()))),
            }
        };
        let status = tokio::time::timeout_at(deadline.into(), wait).await;
        self.deadline_ns.store(u64::MAX, Ordering::Relaxed);
        let end = match status {
            Ok(Some(Ok(status))) => {
                CallEnd::Returned(if status.first() == Some(&b'0') { 0 } else { 1 })
            }
            Ok(other) => {
                let end = match other {
                    Some(Err(end)) => end,
                    _ => match self.task_end.take() {
                        Some(rx) => rx.await.unwrap_or_else(|_| died()),
                        None => died(),
                    },
                };
                self.task_end = None;
                self.ended = Some(match &end {
                    CallEnd::Exited(_) | CallEnd::Returned(_) => "the session exited".into(),
                    CallEnd::TimedOut => "the session timed out and was stopped".into(),
                    CallEnd::FuelExhausted => "the session spent its instruction budget".into(),
                    CallEnd::Trapped(trap) => format!("the session crashed ({trap})"),
                });
                end
            }
            Err(_) => {
                if let Some(task) = self.task.take() {
                    task.abort();
                }
                self.ended = Some("the session timed out and was stopped".into());
                CallEnd::TimedOut
            }
        };
        Ok(finish(&end, &self.stats, &self.stdio, started))
    }
}
