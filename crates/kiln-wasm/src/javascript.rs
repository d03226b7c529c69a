//! JavaScript guests: the QuickJS-NG WASI reactor, driven as `qjs` would be on a laptop
//! by Node's rules (see `qjs`). A one-shot is a fresh instance that runs kiln's prelude,
//! the code as a module, and the event loop. A session keeps its instance; each turn is a
//! call of its own that runs the turn's code as a script (its declarations stay global;
//! top-level `await` works) and then the event loop, so its promises and timers are done
//! when the turn ends.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use kiln_core::{ExecRequest, ExecResult, Language, Limits};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use wasmtime::{Instance, Store};
use wasmtime_wasi::p2::pipe::MemoryInputPipe;

use crate::engine::{
    EngineError, ExecError, JsRuntime, WasmEngine, instantiate_error, instantiation_error,
};
use crate::guest::{
    CallEnd, GuestState, Preopen, PrivateTmp, Stdio, begin_turn, bounded_call, ensure_alive,
    finish, new_store, push_grants, wasi_context,
};
use crate::output::OutputChunk;
use crate::qjs::{Bytecode, Qjs, Run};
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
    let clock = crate::guest::GuestClock(std::time::Instant::now());
    let wasi = wasi_context(&preopens, BASE_ENV, request, &stdio, stdin, &["qjs"], clock)?;
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
/// It is kiln's own cache, like the compiled modules beside it: guests see it read-only
/// and never write there, so plain paths are safe here.
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
        Some(main) => qjs.event_loop(store, bytecode, main, Run::Program).await,
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

/// Why a JavaScript session takes no instruction budget.
pub(crate) const JS_SESSION_FUEL: &str = "JavaScript sessions do not count fuel; run the code as a one-shot, or in a Python session opened with a budget";

/// A live JavaScript session: one guest, each turn a call of its own (see the module doc).
pub(crate) struct JsSession {
    store: Store<GuestState>,
    qjs: Qjs,
    bytecode: &'static Bytecode,
    stdio: Stdio,
    pub ended: Option<String>,
    _tmp: PrivateTmp,
}

impl JsSession {
    /// The memory cap the guest runs under now.
    pub(crate) fn memory_cap(&self) -> usize {
        self.store.data().memory.cap_bytes
    }

    pub(crate) fn set_memory_cap(&mut self, cap: usize) {
        self.store.data_mut().memory.cap_bytes = cap;
    }

    /// Where the guest's linear memory starts in this process, and its size in bytes.
    pub(crate) fn linear_memory(&self) -> (usize, usize) {
        self.qjs.linear_memory(&self.store)
    }

    pub async fn open(
        engine: &WasmEngine,
        runtime: &JsRuntime,
        request: &ExecRequest,
    ) -> Result<JsSession, ExecError> {
        let bytecode = bytecode(engine, runtime).await?;
        let stdin = Box::new(MemoryInputPipe::new(Vec::new()));
        let Prepared {
            mut store,
            instance,
            stdio,
            tmp,
        } = prepare(engine, runtime, request, stdin).await?;
        let deadline = store.data().deadline_ns.clone();
        let clock_base = store.data().clock_base;
        let start = Qjs::with_prelude(&mut store, instance, working_dir(request), bytecode);
        let qjs = match bounded_call(&deadline, clock_base, start).await {
            CallEnd::Returned(qjs) => qjs,
            other => {
                let stderr = String::from_utf8_lossy(&stdio.stderr.take().0).into_owned();
                let ended = match other {
                    CallEnd::Trapped(trap) => trap,
                    CallEnd::TimedOut => "it timed out".into(),
                    _ => "it exited".into(),
                };
                return Err(instantiate_error(
                    Language::JavaScript,
                    format!("starting the session failed: {ended} {}", stderr.trim()),
                ));
            }
        };
        Ok(JsSession {
            store,
            qjs,
            bytecode,
            stdio,
            ended: None,
            _tmp: tmp,
        })
    }

    /// Runs `code` as a turn: a script whose declarations stay for later turns and which
    /// may `await` at its top level, then the event loop until its promise jobs and timers
    /// are done. An unhandled rejection is not reported (QuickJS's check would end the
    /// session).
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
        let (deadline, clock_base) = begin_turn(&mut self.store, &self.stdio, limits, listener);
        let (qjs, store, bytecode) = (&self.qjs, &mut self.store, self.bytecode);
        let run = async {
            match qjs.start_turn(store, code, "<turn>").await? {
                Some(turn) => qjs.event_loop(store, bytecode, turn, Run::Turn).await,
                None => Ok(1),
            }
        };
        let end = bounded_call(&deadline, clock_base, run).await;
        if !end.store_usable() {
            self.ended = Some(match &end {
                CallEnd::Exited(_) | CallEnd::Returned(_) => "the session exited".into(),
                CallEnd::TimedOut => "the session timed out and was stopped".into(),
                CallEnd::FuelExhausted => "the session spent its instruction budget".into(),
                CallEnd::Trapped(trap) => format!("the session crashed ({trap})"),
            });
        }
        Ok(finish(
            &end,
            &self.store.data().memory.stats,
            &self.stdio,
            started,
        ))
    }
}
