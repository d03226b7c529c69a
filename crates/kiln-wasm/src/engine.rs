//! The engine: one wasmtime `Engine` per process, the compiled runtimes, and the clock that
//! bounds every guest.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kiln_core::{ExecRequest, ExecResult, Language, LimitsError};
use wasmtime::{Config, Engine, InstancePre, Linker, OptLevel};

use crate::cache::{ModuleError, load_or_compile};
use crate::guest::{GrantError, GuestState, PrivateTmp, TmpRoot, add_door, add_to_linker};
use crate::setup::{CacheDir, JAVASCRIPT, PYTHON, Progress, Quiet, RuntimeSpec, SetupError};
use crate::{javascript, python};

/// How often the epoch clock ticks. The deadline is checked at every tick, so a guest
/// overruns its deadline by at most about this much, and a guest yields to other work on
/// its thread at every tick.
pub const EPOCH_TICK: Duration = Duration::from_millis(5);
/// How often it ticks while guests wait for their turn on a busy thread (see
/// [`WasmEngine::contended`]): shorter turns, so a newcomer waits less. Each tick costs a
/// running guest about 30 µs, so this is not the pace when nobody waits.
pub const CONTENDED_EPOCH_TICK: Duration = Duration::from_millis(1);
/// The deepest wasm stack a guest may use. 8 MiB gives Python a clean `RecursionError`
/// instead of a trap for deep recursion.
pub const MAX_WASM_STACK: usize = 8 << 20;

/// The engine could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// wasmtime refused the configuration (a bug in kiln).
    #[error("wasmtime refused kiln's engine configuration: {0}")]
    Config(String),
    /// The folder for guests' private `/tmp` could not be made.
    #[error("could not create a temporary folder for guests (check TMPDIR): {0}")]
    Tmp(String),
    /// Fetching or unpacking a runtime failed.
    #[error(transparent)]
    Setup(#[from] SetupError),
    /// Compiling or loading a module failed.
    #[error(transparent)]
    Module(#[from] ModuleError),
    /// The module does not match what kiln expects of the runtime.
    #[error(
        "the {language} runtime does not fit kiln ({detail}); delete the cache folder {cache} and run `kiln setup`"
    )]
    Link {
        language: Language,
        detail: String,
        cache: PathBuf,
    },
}

/// An execution could not be carried out (as opposed to a guest that failed, which is a
/// normal [`ExecResult`]).
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// The runtime is not available.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The limits are unusable.
    #[error("invalid limits: {0}")]
    Limits(#[from] LimitsError),
    /// A grant (directory, environment variable) is unusable.
    #[error(transparent)]
    Grant(#[from] GrantError),
    /// The memory limit is below what the runtime needs to start.
    #[error("the {language} runtime needs a memory limit of at least {min_mib} MiB")]
    MemoryTooSmall { language: Language, min_mib: u64 },
    /// A part of the request is larger than kiln accepts.
    #[error("the request's {what} is too large: {detail}")]
    RequestTooLarge { what: &'static str, detail: String },
    /// The code is larger than kiln accepts.
    #[error("the code is {bytes} bytes; the most kiln accepts is {max} bytes")]
    CodeTooLarge { bytes: usize, max: usize },
    /// A private temporary folder could not be made.
    #[error("could not create the guest's private /tmp: {0}")]
    Tmp(#[source] std::io::Error),
    /// The session can no longer run code.
    #[error("the session has ended: {reason}; open a new session")]
    SessionEnded { reason: String },
    /// Every guest slot of this process is in use.
    #[error("too many sandboxes at once: all {limit} slots are in use; retry when some finish")]
    Busy { limit: u32 },
    /// The guest could not be started.
    #[error("could not start the {language} guest: {detail}")]
    Instantiate { language: Language, detail: String },
    /// WebAssembly does not run this language.
    #[error(
        "WebAssembly runs python and javascript; {language} runs on a Linux template (kiln serve --linux)"
    )]
    Unsupported { language: Language },
}

/// The most source code one execution accepts: 16 MiB.
pub const MAX_CODE_BYTES: usize = 16 << 20;

pub(crate) struct PythonRuntime {
    pub pre: InstancePre<GuestState>,
    pub hot_pages: crate::prefault::HotPages,
    pub lib_dir: PathBuf,
    pub mpl_data_dir: PathBuf,
}

pub(crate) struct JsRuntime {
    pub pre: InstancePre<GuestState>,
}

struct Ticker {
    stop: Arc<AtomicBool>,
    contended: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Ticker {
    fn start(engine: Engine) -> Ticker {
        let stop = Arc::new(AtomicBool::new(false));
        let contended = Arc::new(AtomicBool::new(false));
        let (flag, busy) = (stop.clone(), contended.clone());
        let thread = std::thread::Builder::new()
            .name("kiln-epoch".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    std::thread::sleep(if busy.load(Ordering::Relaxed) {
                        CONTENDED_EPOCH_TICK
                    } else {
                        EPOCH_TICK
                    });
                    engine.increment_epoch();
                }
            })
            .expect("spawning the epoch thread");
        Ticker {
            stop,
            contended,
            thread: Some(thread),
        }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

struct Inner {
    engine: Engine,
    tmp_root: TmpRoot,
    max_instances: u32,
    cache: CacheDir,
    python: Mutex<Option<Arc<PythonRuntime>>>,
    javascript: Mutex<Option<Arc<JsRuntime>>>,
    _ticker: Ticker,
}

/// kiln's WebAssembly engine. Cheap to clone; share one per process.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use kiln_core::{ExecRequest, Language};
/// use kiln_wasm::{CacheDir, WasmEngine};
///
/// let engine = WasmEngine::new(CacheDir::new(CacheDir::default_root()))?;
/// let result = engine.execute(&ExecRequest::new(Language::Python, "print(1 + 1)")).await?;
/// assert_eq!(result.stdout, b"2\n");
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct WasmEngine {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for WasmEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WasmEngine")
            .field("cache", &self.inner.cache)
            .finish_non_exhaustive()
    }
}

/// Engine settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineOptions {
    /// The most guests alive at once in this process, one-shots and sessions together.
    /// Each reserves (but does not use) about 12 GiB of address space. Default 1 000.
    pub max_instances: u32,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            max_instances: 1_000,
        }
    }
}

/// Bytes of a guest's memory kept resident when its slot is reused: pages the last guest
/// wrote are copied back from the image instead of unmapped, so the next guest does not
/// fault them in again (page faults dominate start-up on virtualised hosts).
const KEEP_RESIDENT_BYTES: usize = 8 << 20;

/// The wasmtime configuration kiln uses (see docs/engine.md for why each setting is there).
/// The allocator settings do not change compiled code, so every configuration shares the
/// same `.cwasm` files.
pub fn engine_config(options: &EngineOptions) -> Config {
    let mut config = Config::new();
    config
        .wasm_exceptions(true)
        .max_wasm_stack(MAX_WASM_STACK)
        .async_stack_size(MAX_WASM_STACK + (1 << 20))
        .epoch_interruption(true)
        .cranelift_opt_level(OptLevel::Speed);
    let slots = options.max_instances.max(1);
    let mut pool = wasmtime::PoolingAllocationConfig::new();
    pool.total_core_instances(slots)
        // A store's GC heap (wasm exceptions) takes a memory slot besides its linear memory.
        .total_memories(slots.saturating_mul(2))
        .total_tables(slots)
        .total_stacks(slots)
        .total_gc_heaps(slots)
        // The Python module's function table has 47 157 entries.
        .table_elements(100_000)
        .max_core_instance_size(16 << 20)
        .max_memory_size(4 << 30)
        .linear_memory_keep_resident(KEEP_RESIDENT_BYTES)
        .table_keep_resident(1 << 20)
        .pagemap_scan(wasmtime::Enabled::Auto);
    config.allocation_strategy(wasmtime::InstanceAllocationStrategy::Pooling(pool));
    config
}

impl WasmEngine {
    /// An engine using the runtimes in `cache`, with default options. Nothing is loaded until
    /// first use (or [`WasmEngine::prepare`]).
    pub fn new(cache: CacheDir) -> Result<WasmEngine, EngineError> {
        WasmEngine::with_options(cache, &EngineOptions::default())
    }

    /// An engine with explicit options.
    pub fn with_options(
        cache: CacheDir,
        options: &EngineOptions,
    ) -> Result<WasmEngine, EngineError> {
        let engine = Engine::new(&engine_config(options))
            .map_err(|e| EngineError::Config(format!("{e:#}")))?;
        Ok(WasmEngine {
            inner: Arc::new(Inner {
                _ticker: Ticker::start(engine.clone()),
                max_instances: options.max_instances.max(1),
                tmp_root: TmpRoot::new().map_err(|e| EngineError::Tmp(e.to_string()))?,
                engine,
                cache,
                python: Mutex::new(None),
                javascript: Mutex::new(None),
            }),
        })
    }

    /// The cache this engine uses.
    pub fn cache(&self) -> &CacheDir {
        &self.inner.cache
    }

    /// The most guests this engine runs at once.
    pub fn max_instances(&self) -> u32 {
        self.inner.max_instances
    }

    /// A flag to raise while guests wait for their turn (a scheduler in front of the engine
    /// sets it): the epoch clock then ticks every [`CONTENDED_EPOCH_TICK`] instead of every
    /// [`EPOCH_TICK`], so running guests yield sooner.
    pub fn contended(&self) -> Arc<AtomicBool> {
        self.inner._ticker.contended.clone()
    }

    pub(crate) fn private_tmp(&self) -> std::io::Result<PrivateTmp> {
        self.inner.tmp_root.private()
    }

    pub(crate) fn wasmtime(&self) -> &Engine {
        &self.inner.engine
    }

    /// Makes `language` ready: fetches and unpacks its runtime if missing, compiles it if
    /// needed, and loads it. Reports long steps to `progress`.
    pub fn prepare(&self, language: Language, progress: &dyn Progress) -> Result<(), EngineError> {
        match language {
            Language::Python => self.python(progress).map(drop),
            Language::JavaScript => self.javascript(progress).map(drop),
            // Nothing of WebAssembly runs them; requests for them are refused.
            Language::Go | Language::Bash => Ok(()),
        }
    }

    fn linker(&self, language: Language) -> Result<Linker<GuestState>, EngineError> {
        let mut linker = Linker::new(&self.inner.engine);
        add_to_linker(&mut linker).map_err(|e| self.link_error(language, e))?;
        if language == Language::Python {
            add_door(&mut linker).map_err(|e| self.link_error(language, e))?;
        }
        Ok(linker)
    }

    fn link_error(&self, language: Language, error: wasmtime::Error) -> EngineError {
        EngineError::Link {
            language,
            detail: format!("{error:#}"),
            cache: self.inner.cache.root().to_path_buf(),
        }
    }

    fn module(
        &self,
        spec: &RuntimeSpec,
        name: &str,
        estimate: Duration,
        progress: &dyn Progress,
    ) -> Result<wasmtime::Module, EngineError> {
        let cache = &self.inner.cache;
        cache.ensure_runtime(spec, progress)?;
        Ok(load_or_compile(
            &self.inner.engine,
            cache,
            name,
            &cache.wasm_path(spec),
            spec.files[0].sha256,
            estimate,
            progress,
        )?)
    }

    pub(crate) fn python(
        &self,
        progress: &dyn Progress,
    ) -> Result<Arc<PythonRuntime>, EngineError> {
        let mut slot = self.inner.python.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(runtime) = slot.as_ref() {
            return Ok(runtime.clone());
        }
        let started = std::time::Instant::now();
        let module = self.module(&PYTHON, "python", Duration::from_secs(60), progress)?;
        let linker = self.linker(Language::Python)?;
        let pre = linker
            .instantiate_pre(&module)
            .map_err(|e| self.link_error(Language::Python, e))?;
        let runtime = Arc::new(PythonRuntime {
            pre,
            hot_pages: Default::default(),
            lib_dir: self.inner.cache.python_lib_dir(),
            mpl_data_dir: self.inner.cache.python_mpl_data_dir(),
        });
        *slot = Some(runtime.clone());
        tracing::debug!(target: "kiln_wasm", language = "python", ms = started.elapsed().as_millis() as u64, "runtime ready");
        Ok(runtime)
    }

    pub(crate) fn javascript(
        &self,
        progress: &dyn Progress,
    ) -> Result<Arc<JsRuntime>, EngineError> {
        let mut slot = self
            .inner
            .javascript
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(runtime) = slot.as_ref() {
            return Ok(runtime.clone());
        }
        let started = std::time::Instant::now();
        let module = self.module(&JAVASCRIPT, "javascript", Duration::from_secs(2), progress)?;
        let linker = self.linker(Language::JavaScript)?;
        let pre = linker
            .instantiate_pre(&module)
            .map_err(|e| self.link_error(Language::JavaScript, e))?;
        let runtime = Arc::new(JsRuntime { pre });
        *slot = Some(runtime.clone());
        tracing::debug!(target: "kiln_wasm", language = "javascript", ms = started.elapsed().as_millis() as u64, "runtime ready");
        Ok(runtime)
    }

    /// Runs one request in a fresh sandbox and returns what it produced. A guest that fails,
    /// times out or runs out of memory is a normal result; an error means kiln could not run
    /// it at all.
    pub async fn execute(&self, request: &ExecRequest) -> Result<ExecResult, ExecError> {
        self.execute_streaming(request, None).await
    }

    /// Like [`WasmEngine::execute`], also sending output chunks to `listener` as the guest
    /// writes them (the result still holds all kept output).
    pub async fn execute_streaming(
        &self,
        request: &ExecRequest,
        listener: Option<tokio::sync::mpsc::UnboundedSender<crate::output::OutputChunk>>,
    ) -> Result<ExecResult, ExecError> {
        check_request(request)?;
        let started = Instant::now();
        let mut result = match request.language {
            Language::Python => {
                let runtime = self.python(&Quiet)?;
                let mut guest = python::PythonGuest::open(self, &runtime, request, false).await?;
                let result = guest.turn(&request.code, &request.limits, listener).await?;
                guest.learn_hot_pages(&runtime);
                result
            }
            Language::JavaScript => {
                let runtime = self.javascript(&Quiet)?;
                javascript::run_once(self, &runtime, request, listener).await?
            }
            language @ (Language::Go | Language::Bash) => {
                return Err(ExecError::Unsupported { language });
            }
        };
        result.duration_us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
        Ok(result)
    }
}

/// A guest of `language` could not be started because of `error`.
pub(crate) fn instantiate_error(language: Language, error: impl std::fmt::Display) -> ExecError {
    ExecError::Instantiate {
        language,
        detail: format!("{error:#}"),
    }
}

/// Maps a failed `instantiate_async`: `Busy` when every pool slot is taken.
pub(crate) fn instantiation_error(
    engine: &WasmEngine,
    language: Language,
    error: wasmtime::Error,
) -> ExecError {
    if error.is::<wasmtime::PoolConcurrencyLimitError>() {
        return ExecError::Busy {
            limit: engine.max_instances(),
        };
    }
    instantiate_error(language, error)
}

pub(crate) fn check_request(request: &ExecRequest) -> Result<(), ExecError> {
    if !request.language.is_wasm() {
        return Err(ExecError::Unsupported {
            language: request.language,
        });
    }
    request.limits.validate()?;
    let min = request.language.min_memory_bytes();
    if request.limits.memory_bytes < min {
        return Err(ExecError::MemoryTooSmall {
            language: request.language,
            min_mib: min >> 20,
        });
    }
    if request.stdin.len() > kiln_core::MAX_STDIN_BYTES {
        return Err(ExecError::RequestTooLarge {
            what: "stdin",
            detail: format!(
                "{} bytes, the most is {}",
                request.stdin.len(),
                kiln_core::MAX_STDIN_BYTES
            ),
        });
    }
    let env_bytes: usize = request.env.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
    if request.env.len() > kiln_core::MAX_ENV_VARS || env_bytes > kiln_core::MAX_ENV_BYTES {
        return Err(ExecError::RequestTooLarge {
            what: "environment",
            detail: format!(
                "{} variables in {env_bytes} bytes, the most is {} variables in {} bytes",
                request.env.len(),
                kiln_core::MAX_ENV_VARS,
                kiln_core::MAX_ENV_BYTES
            ),
        });
    }
    if request.mounts.len() > kiln_core::MAX_MOUNTS {
        return Err(ExecError::RequestTooLarge {
            what: "mount list",
            detail: format!(
                "{} mounts, the most is {}",
                request.mounts.len(),
                kiln_core::MAX_MOUNTS
            ),
        });
    }
    check_code(&request.code)
}

/// Refuses code over [`MAX_CODE_BYTES`].
pub(crate) fn check_code(code: &str) -> Result<(), ExecError> {
    if code.len() > MAX_CODE_BYTES {
        return Err(ExecError::CodeTooLarge {
            bytes: code.len(),
            max: MAX_CODE_BYTES,
        });
    }
    Ok(())
}
