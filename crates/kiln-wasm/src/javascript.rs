//! JavaScript guests: the QuickJS-NG WASI reactor, driven as `qjs` would be on a laptop
//! by Node's rules (see `qjs`): a one-shot is a fresh instance that runs kiln's prelude, the
//! code as a module, and the event loop.
//!
//! A session is one long call whose code is a read-eval loop over stdin: the host writes
//! each turn's code as a JSON line and the loop answers with a marker line (carrying a
//! random per-session nonce) on stdout when the turn is done. The marker never reaches the
//! caller. Sessions have the prelude (console, process) but no event loop: promise jobs and
//! timers a turn leaves do not run.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use kiln_core::{ExecRequest, ExecResult, Language, Limits};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, oneshot};
use wasmtime::{Instance, Store};
use wasmtime_wasi::cli::AsyncStdinStream;
use wasmtime_wasi::p2::pipe::MemoryInputPipe;

use crate::engine::{
    EngineError, ExecError, JsRuntime, WasmEngine, instantiate_error, instantiation_error,
};
use crate::guest::{
    CallEnd, FsBudget, GuestState, Preopen, PrivateTmp, Stats, Stdio, arm_deadline, bounded_call,
    classify_error, ensure_alive, finish, new_store, push_grants, wasi_context,
};
use crate::output::OutputChunk;
use crate::qjs::{Bytecode, Qjs};
use crate::setup::{CacheDir, SetupError};

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
    let lib = lib_dir(engine.cache())?;
    preopens.push(Preopen {
        host: &lib,
        guest: LIB_GUEST_DIR,
        writable: false,
    });
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

/// What kiln's prelude compiles the first time a program needs it, which guests read from
/// [`LIB_GUEST_DIR`].
const LIB_FILES: [(&str, &str); 2] = [
    ("lib.js", include_str!("js/lib.js")),
    ("timers.js", include_str!("js/timers.js")),
];

/// Where guests find [`LIB_FILES`], read-only. A file costs a guest nothing until it is
/// read; lib.js's source carried in the prelude cost every one-shot ~40 µs.
const LIB_GUEST_DIR: &str = "/usr/local/lib/kiln";

/// The host folder holding [`LIB_FILES`] for `cache`: `<cache>/js/<digest>/`, so kilns of
/// different versions share a cache. Written (or rewritten, where a file differs) the first
/// time a process needs it.
fn lib_dir(cache: &CacheDir) -> Result<PathBuf, ExecError> {
    static FILES: OnceLock<(Vec<(&str, String)>, String)> = OnceLock::new();
    static READY: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
    let (files, digest) = FILES.get_or_init(|| {
        let mut hasher = Sha256::new();
        let files: Vec<_> = LIB_FILES
            .iter()
            .map(|(name, source)| {
                let source = compact(source);
                hasher.update(format!("{name}\0{}\0", source.len()));
                hasher.update(&source);
                (*name, source)
            })
            .collect();
        (files, hex::encode(hasher.finalize()))
    });
    let dir = cache.root().join("js").join(&digest[..16]);
    let mut ready = READY.lock().unwrap_or_else(|e| e.into_inner());
    if ready.contains(&dir) {
        return Ok(dir);
    }
    let failed = |action, path: &Path, e| {
        ExecError::Engine(EngineError::Setup(SetupError::io(action, path, e)))
    };
    std::fs::create_dir_all(&dir).map_err(|e| failed("create", &dir, e))?;
    for (name, source) in files {
        let file = dir.join(name);
        if std::fs::read(&file).ok().as_deref() == Some(source.as_bytes()) {
            continue;
        }
        let partial = dir.join(format!("{name}.{}.partial", std::process::id()));
        std::fs::write(&partial, source).map_err(|e| failed("write", &partial, e))?;
        std::fs::rename(&partial, &file).map_err(|e| failed("write", &file, e))?;
    }
    ready.push(dir.clone());
    Ok(dir)
}

/// Drops comment lines and indentation: the library's source is parsed in every guest that
/// needs it.
fn compact(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    for line in source.lines().map(str::trim) {
        if line.is_empty() || line.starts_with("//") {
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// kiln's JavaScript as QuickJS bytecode (parsing the prelude took ~0.3 ms of every
/// one-shot; reading its bytecode takes a tenth of that), compiled once per process in a
/// guest of its own.
static BYTECODE: tokio::sync::OnceCell<Bytecode> = tokio::sync::OnceCell::const_new();

async fn bytecode(
    engine: &WasmEngine,
    runtime: &JsRuntime,
) -> Result<&'static Bytecode, ExecError> {
    BYTECODE
        .get_or_try_init(|| compile_bytecode(engine, runtime))
        .await
}

async fn compile_bytecode(engine: &WasmEngine, runtime: &JsRuntime) -> Result<Bytecode, ExecError> {
    let request = ExecRequest::new(Language::JavaScript, "");
    let stdin = Box::new(MemoryInputPipe::new(Vec::new()));
    let Prepared {
        mut store,
        instance,
        stdio,
        tmp: _tmp,
    } = prepare(engine, runtime, &request, stdin).await?;
    if store.get_fuel().is_ok() {
        // An engine that counts fuel: this guest is kiln's own, not a request's.
        store
            .set_fuel(u64::MAX)
            .map_err(|e| instantiate_error(Language::JavaScript, e))?;
    }
    let compile = async {
        let qjs = Qjs::start(&mut store, instance, &["qjs"], None).await?;
        Bytecode::compile(&qjs, &mut store).await
    };
    compile.await.map_err(|e| {
        let stderr = String::from_utf8_lossy(&stdio.stderr.take().0).into_owned();
        instantiate_error(
            Language::JavaScript,
            format!("compiling kiln's prelude: {e:#}: {}", stderr.trim()),
        )
    })
}

/// Where a request's guest starts: its workspace, if it has one.
fn working_dir(request: &ExecRequest) -> Option<&str> {
    request
        .workspace
        .as_ref()
        .map(|_| request.workspace_guest())
}

/// Runs a program in a fresh guest: the prelude, the code as a module, then the event
/// loop. Answers the exit code.
async fn run_program(
    store: &mut Store<GuestState>,
    instance: Instance,
    request: &ExecRequest,
    bytecode: &Bytecode,
) -> wasmtime::Result<i32> {
    let qjs = Qjs::with_prelude(store, instance, working_dir(request), bytecode).await?;
    match qjs.start_module(store, &request.code, "<cmdline>").await? {
        Some(main) => qjs.event_loop(store, bytecode, main).await,
        None => Ok(1),
    }
}

/// Runs a request in a fresh instance.
pub(crate) async fn run_once(
    engine: &WasmEngine,
    runtime: &JsRuntime,
    request: &ExecRequest,
    listener: Option<mpsc::UnboundedSender<OutputChunk>>,
) -> Result<ExecResult, ExecError> {
    let started = Instant::now();
    let bytecode = bytecode(engine, runtime).await?;
    let stdin = Box::new(MemoryInputPipe::new(request.stdin.clone()));
    let Prepared {
        mut store,
        instance,
        stdio,
        tmp: _tmp,
    } = prepare(engine, runtime, request, stdin).await?;
    stdio.start_turn(&request.limits, listener);
    let deadline = store.data().deadline_ns.clone();
    let clock_base = store.data().clock_base;
    let run = run_program(&mut store, instance, request, bytecode);
    let end = bounded_call(&deadline, clock_base, run).await;
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
        let bytecode = bytecode(engine, runtime).await?;
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
        let code = SESSION_LOOP.replace("NONCE", &nonce);
        let cwd = working_dir(request).map(str::to_owned);
        let (end_tx, task_end) = oneshot::channel();
        let task = tokio::spawn(async move {
            // One call for the session's life: the epoch callback interrupts wasm past a
            // turn's deadline, and the host aborts this task when a turn blocked in a host
            // call overruns.
            let run = async {
                let qjs = Qjs::with_prelude(&mut store, instance, cwd.as_deref(), bytecode).await?;
                qjs.eval_script(&mut store, &code, "<kiln>").await
            };
            let end = match run.await {
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
