//! The engine: one wasmtime `Engine` per process, the compiled runtimes, and the clock that
//! bounds every guest.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
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
    /// The process began to shut down while a runtime was being prepared.
    #[error("kiln is shutting down: the {language} runtime's preparation was cut off")]
    ShuttingDown { language: Language },
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
    /// A turn asked for an instruction budget (fuel) in a session that cannot count it.
    #[error("this session cannot count an instruction budget (fuel): {why}")]
    FuelUnavailable { why: &'static str },
    /// The session cannot be forked.
    #[error("this session cannot be forked: {why}")]
    CannotFork { why: &'static str },
}

/// The most source code one execution accepts: 16 MiB.
pub const MAX_CODE_BYTES: usize = 16 << 20;

pub(crate) struct PythonRuntime {
    pub pre: InstancePre<GuestState>,
    /// The guest slots of its engine (what `Busy` reports).
    pub slots: u32,
    pub hot_pages: crate::prefault::HotPages,
    /// One-shot instances made ahead of time.
    pub ready: crate::ready::Ready,
    pub lib_dir: PathBuf,
    pub mpl_data_dir: PathBuf,
    /// Where its module is primed ([`crate::warm::prime`]): its guests start where another
    /// guest's turn ended, so each asks the host for its preopened folders anew.
    pub primed: Option<PrimedStart>,
}

/// How a guest of a primed module starts.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PrimedStart {
    /// Its monotonic clock's first reading: past anything the captured guest read.
    pub clock_ns: u64,
    /// Whether it runs the rebirth turn (environment, seeds: a warm template's module,
    /// whose memory is a warm-up's) or starts as captured (the plain primed module).
    pub rebirth: bool,
    /// The captured memory's length (a rebirth guest's memory cap must leave room above).
    pub memory_len: usize,
}

pub(crate) struct JsRuntime {
    pub pre: InstancePre<GuestState>,
    /// The guest slots of its engine (what `Busy` reports).
    pub slots: u32,
}

struct Ticker {
    stop: Arc<AtomicBool>,
    contended: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Ticker {
    /// Ticks `engine`, and each of `later` once it is made (the fuel and warm engines).
    fn start(engine: Engine, later: Vec<Arc<OnceLock<Engine>>>) -> Ticker {
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
                    for other in later.iter().filter_map(|e| e.get()) {
                        other.increment_epoch();
                    }
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

/// One wasmtime engine and the runtimes compiled for it. kiln has two: the default one,
/// bounded by epoch deadlines alone, and one that also counts fuel (its compiled code checks
/// a counter at every loop and call, so it is slower), made on the first request with a
/// budget ([`Limits::fuel`](kiln_core::Limits::fuel)).
struct Variant {
    engine: Engine,
    /// Guests alive at once in this engine, at most.
    slots: u32,
    /// Whether the engine counts fuel (its modules are cached apart, as `NAME-fuel`).
    fuel: bool,
    python: Mutex<Option<Arc<PythonRuntime>>>,
    /// The primed Python runtime (the plain engine only), once loaded.
    python_primed: Mutex<Option<Arc<PythonRuntime>>>,
    /// Set when the primed runtime could not be made: fresh guests start unprimed.
    primed_off: AtomicBool,
    /// Warm templates' primed runtimes (one-shots start from them), by warm-up code.
    warm_primed: Mutex<std::collections::HashMap<String, Arc<PythonRuntime>>>,
    /// Set when a warm template's primed runtime could not be made: its one-shots start
    /// in the warm engine.
    warm_primed_off: AtomicBool,
    javascript: Mutex<Option<Arc<JsRuntime>>>,
}

impl Variant {
    fn new(options: &EngineOptions, fuel: bool) -> Result<Variant, EngineError> {
        let slots = if fuel {
            fuel_slots(options.max_instances)
        } else {
            options.max_instances.max(1)
        };
        let mut config = config_with_slots(slots);
        config.consume_fuel(fuel);
        let engine = Engine::new(&config).map_err(|e| EngineError::Config(format!("{e:#}")))?;
        Ok(Variant {
            engine,
            slots,
            fuel,
            python: Mutex::new(None),
            python_primed: Mutex::new(None),
            primed_off: AtomicBool::new(false),
            warm_primed: Mutex::new(Default::default()),
            warm_primed_off: AtomicBool::new(false),
            javascript: Mutex::new(None),
        })
    }

    /// The name of a runtime's module in this engine (and in its `.cwasm` file).
    fn module_name(&self, language: &str) -> String {
        if self.fuel {
            format!("{language}-fuel")
        } else {
            language.to_owned()
        }
    }
}

/// The primed module's name in the cache: keyed by what priming puts in its memory (the
/// code run, the guest's environment, where its clock starts, and kiln's way of priming),
/// besides the runtime, kiln's exports and the engine, which every module's file name
/// carries. A change to any of them makes a new module rather than loading a stale one.
fn primed_module_name() -> String {
    let code: Vec<&str> = PRIMING_TURNS.iter().map(|(code, _)| *code).collect();
    primed_module_name_of(
        &code.join("\n"),
        crate::python::BASE_ENV,
        crate::warm::PRIMED_CLOCK_NS,
    )
}

/// What the priming run runs, turn by turn (code, and what it is for an error): kiln's turn,
/// then [`crate::warm::PRIMING_CODE`]. The primed module's name is keyed by their code.
const PRIMING_TURNS: [(&str, &str); 2] = [
    (crate::python::FAST_TURNS_DEF, "kiln's turns"),
    (crate::warm::PRIMING_CODE, "the priming run"),
];

fn primed_module_name_of(code: &str, env: &[(&str, &str)], clock_ns: u64) -> String {
    use sha2::Digest;
    let mut hasher = sha2::Sha256::new();
    hasher.update(code);
    for (name, value) in env {
        hasher.update(format!("\0{name}={value}"));
    }
    hasher.update(clock_ns.to_le_bytes());
    let key = hex::encode(hasher.finalize());
    format!("python-primed{}-{}", crate::warm::PRIME_VERSION, &key[..12])
}

/// A warm template's primed module's name in the cache: its image's key (which covers the
/// runtime, the engines, the warm-up code and the image format), and kiln's way of priming.
fn warm_primed_module_name(image: &std::path::Path) -> String {
    let key = image
        .file_stem()
        .map_or_else(String::new, |s| s.to_string_lossy().into_owned());
    format!("python-warm-primed{}-{key}", crate::warm::PRIME_VERSION)
}

/// Guest slots of the fuel engine: an eighth of the default engine's, at least 4 (and at
/// most as many). Few requests ask for a budget, and each slot reserves address space.
fn fuel_slots(max_instances: u32) -> u32 {
    let slots = max_instances.max(1);
    slots.div_ceil(8).max(4).min(slots)
}

struct Inner {
    plain: Variant,
    /// The fuel engine, made on first use.
    fuel: OnceLock<Variant>,
    /// Its wasmtime engine, for the epoch thread.
    fuel_engine: Arc<OnceLock<Engine>>,
    /// The engine of guests started from a memory image, made on first use.
    warm: OnceLock<crate::warm::WarmVariant>,
    /// Its wasmtime engine, for the epoch thread.
    warm_engine: Arc<OnceLock<Engine>>,
    options: EngineOptions,
    tmp_root: TmpRoot,
    cache: CacheDir,
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
    /// Guests with an instruction budget (fuel) run in a second engine, made on first use,
    /// with an eighth as many slots (at least 4).
    pub max_instances: u32,
    /// Python one-shot instances kept made ahead of time, so that a one-shot pays only for
    /// its turn (a thread of the engine makes them). Default 2; 0 for a process that runs
    /// one execution (`kiln exec`). Engines of fewer than 16 slots keep none.
    pub ready_instances: u32,
    /// Whether fresh Python guests without an environment of their own or a budget start
    /// primed: from a copy of the module whose memory is an interpreter's after a first turn
    /// (made once, at setup), so they skip the first turn's own work. Default on; the
    /// environment variable `KILN_PRIMED=0` turns it off.
    pub primed: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            max_instances: 1_000,
            ready_instances: 2,
            primed: std::env::var_os("KILN_PRIMED").is_none_or(|v| v != "0"),
        }
    }
}

/// Engines of fewer slots run one guest or a few and end (`kiln exec`'s has 4, setup's 1):
/// they keep no instances ready and learn no hot pages, which only later guests would use.
pub(crate) const SERVING_SLOTS: u32 = 16;

/// Bytes of a guest's memory kept resident when its slot is reused: pages the last guest
/// wrote are copied back from the image instead of unmapped, so the next guest does not
/// fault them in again (page faults dominate start-up on virtualised hosts).
const KEEP_RESIDENT_BYTES: usize = 8 << 20;

/// The wasmtime configuration kiln uses (see docs/engine.md for why each setting is there).
/// The allocator settings do not change compiled code, so every configuration shares the
/// same `.cwasm` files. (The fuel engine adds `consume_fuel`, which does: its files differ.)
pub fn engine_config(options: &EngineOptions) -> Config {
    config_with_slots(options.max_instances.max(1))
}

fn config_with_slots(slots: u32) -> Config {
    let mut config = Config::new();
    config
        .wasm_exceptions(true)
        .max_wasm_stack(MAX_WASM_STACK)
        .async_stack_size(MAX_WASM_STACK + (1 << 20))
        .epoch_interruption(true)
        .cranelift_opt_level(OptLevel::Speed);
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

    /// Ends the engine of a process about to exit: removes its temporary folders, and leaves
    /// everything else (the modules' mappings, the slot pool, its threads) to the exit, which
    /// tears a process down faster than dropping its parts one by one (about 5 ms of a
    /// `kiln exec` here). Call it when no guest runs, right before `std::process::exit`.
    pub fn finish_for_exit(self) {
        self.inner.tmp_root.remove_now();
        std::mem::forget(self);
    }

    /// An engine with explicit options.
    pub fn with_options(
        cache: CacheDir,
        options: &EngineOptions,
    ) -> Result<WasmEngine, EngineError> {
        let plain = Variant::new(options, false)?;
        let fuel_engine = Arc::new(OnceLock::new());
        let warm_engine = Arc::new(OnceLock::new());
        Ok(WasmEngine {
            inner: Arc::new(Inner {
                _ticker: Ticker::start(
                    plain.engine.clone(),
                    vec![fuel_engine.clone(), warm_engine.clone()],
                ),
                plain,
                fuel: OnceLock::new(),
                fuel_engine,
                warm: OnceLock::new(),
                warm_engine,
                options: options.clone(),
                tmp_root: TmpRoot::new().map_err(|e| EngineError::Tmp(e.to_string()))?,
                cache,
            }),
        })
    }

    /// The engine for guests with (`fuel`) or without an instruction budget; the fuel
    /// engine is made on first use.
    fn variant(&self, fuel: bool) -> Result<&Variant, EngineError> {
        if !fuel {
            return Ok(&self.inner.plain);
        }
        if let Some(variant) = self.inner.fuel.get() {
            return Ok(variant);
        }
        // Two first requests at once may both build one; the loser's is dropped unused.
        let variant = Variant::new(&self.inner.options, true)?;
        let variant = self.inner.fuel.get_or_init(|| variant);
        let _ = self.inner.fuel_engine.set(variant.engine.clone());
        Ok(variant)
    }

    /// The engine of guests started from a memory image (warm starts, forks), made on
    /// first use.
    pub(crate) fn warm_variant(&self) -> Result<&crate::warm::WarmVariant, EngineError> {
        if let Some(variant) = self.inner.warm.get() {
            return Ok(variant);
        }
        let variant = crate::warm::WarmVariant::new(self.inner.options.max_instances)?;
        let variant = self.inner.warm.get_or_init(|| variant);
        let _ = self.inner.warm_engine.set(variant.engine.clone());
        Ok(variant)
    }

    /// The engine of guests without an instruction budget (where a warm-up runs).
    pub(crate) fn plain_engine(&self) -> &Engine {
        &self.inner.plain.engine
    }

    /// The cache this engine uses.
    pub fn cache(&self) -> &CacheDir {
        &self.inner.cache
    }

    /// The most guests this engine runs at once (without an instruction budget).
    pub fn max_instances(&self) -> u32 {
        self.inner.plain.slots
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

    /// Makes `language` ready: fetches and unpacks its runtime if missing, compiles it if
    /// needed, and loads it. Reports long steps to `progress`.
    pub fn prepare(&self, language: Language, progress: &dyn Progress) -> Result<(), EngineError> {
        self.prepare_variant(language, false, progress)
    }

    /// Like [`WasmEngine::prepare`], for guests with an instruction budget (`fuel`) or
    /// without. The fuel variant is compiled apart, once (Python: about 90 CPU-seconds and
    /// 2.7 GB of memory), the first time a request asks for a budget.
    pub fn prepare_variant(
        &self,
        language: Language,
        fuel: bool,
        progress: &dyn Progress,
    ) -> Result<(), EngineError> {
        match language {
            // Where fresh guests start primed, the primed runtime is what they need (making
            // it compiles the plain one first); the plain one is loaded when a request
            // with an environment of its own asks for it.
            Language::Python if !fuel && self.inner.options.primed => {
                match self.primed_python(progress) {
                    Ok(_) => Ok(()),
                    Err(error) => {
                        tracing::warn!(target: "kiln_wasm", %error, "the primed Python runtime could not be made; fresh guests start unprimed");
                        self.variant(false)?
                            .primed_off
                            .store(true, Ordering::Relaxed);
                        self.python(progress, false).map(drop)
                    }
                }
            }
            Language::Python => self.python(progress, fuel).map(drop),
            Language::JavaScript => self.javascript(progress, fuel).map(drop),
            // Nothing of WebAssembly runs them; requests for them are refused.
            Language::Go | Language::Bash => Ok(()),
        }
    }

    /// Makes ready the plain (unprimed) Python runtime as well, which fresh guests need when
    /// a request brings an environment of its own, and which [`WasmEngine::prepare`] does
    /// not load where the primed one is cached already (`kiln setup`, so that `--prune`
    /// keeps it).
    pub fn prepare_unprimed_python(&self, progress: &dyn Progress) -> Result<(), EngineError> {
        self.python(progress, false).map(drop)
    }

    /// Whether `language`'s runtime is fetched and compiled for guests with an instruction
    /// budget (`fuel`) or without, so that a first request does not wait for a compilation.
    pub fn is_compiled(&self, language: Language, fuel: bool) -> Result<bool, EngineError> {
        let spec = match language {
            Language::Python => &PYTHON,
            Language::JavaScript => &JAVASCRIPT,
            Language::Go | Language::Bash => return Ok(false),
        };
        let variant = self.variant(fuel)?;
        let cache = &self.inner.cache;
        let name = variant.module_name(language.name());
        let path = crate::cache::cwasm_path(&variant.engine, cache, &name, spec.files[0].sha256);
        let primed = language != Language::Python
            || fuel
            || !self.inner.options.primed
            || self.python_cwasm(variant, &primed_module_name()).is_file();
        Ok(cache.is_installed(spec) && path.is_file() && primed)
    }

    pub(crate) fn linker(
        &self,
        engine: &Engine,
        language: Language,
    ) -> Result<Linker<GuestState>, EngineError> {
        let mut linker = Linker::new(engine);
        add_to_linker(&mut linker).map_err(|e| self.link_error(language, e))?;
        if language == Language::Python {
            add_door(&mut linker).map_err(|e| self.link_error(language, e))?;
        }
        Ok(linker)
    }

    pub(crate) fn link_error(&self, language: Language, error: wasmtime::Error) -> EngineError {
        EngineError::Link {
            language,
            detail: format!("{error:#}"),
            cache: self.inner.cache.root().to_path_buf(),
        }
    }

    fn module(
        &self,
        variant: &Variant,
        spec: &RuntimeSpec,
        language: Language,
        estimate: Duration,
        progress: &dyn Progress,
    ) -> Result<wasmtime::Module, EngineError> {
        // Code that counts fuel is larger and takes longer to compile.
        let estimate = if variant.fuel {
            estimate * 3 / 2
        } else {
            estimate
        };
        let sha256 = spec.files[0].sha256;
        self.compiled(
            &variant.engine,
            spec,
            &variant.module_name(language.name()),
            estimate,
            progress,
            &|wasm| crate::qjs_exports::prepare(sha256, wasm),
        )
    }

    /// `spec`'s module compiled for `engine` under `name`, fetching the runtime if missing.
    pub(crate) fn compiled(
        &self,
        engine: &Engine,
        spec: &RuntimeSpec,
        name: &str,
        estimate: Duration,
        progress: &dyn Progress,
        prepare: crate::cache::Prepare<'_>,
    ) -> Result<wasmtime::Module, EngineError> {
        let cache = &self.inner.cache;
        cache.ensure_runtime(spec, progress)?;
        Ok(load_or_compile(
            engine,
            cache,
            name,
            &cache.wasm_path(spec),
            spec.files[0].sha256,
            estimate,
            progress,
            prepare,
        )?)
    }

    /// A Python runtime of `module` in `engine`: linked, with `ready` one-shot instances
    /// made ahead of time (their thread started), its guests starting as `primed` says.
    pub(crate) fn python_runtime_of(
        &self,
        engine: &Engine,
        module: &wasmtime::Module,
        slots: u32,
        ready: usize,
        primed: Option<PrimedStart>,
    ) -> Result<Arc<PythonRuntime>, EngineError> {
        let pre = self
            .linker(engine, Language::Python)?
            .instantiate_pre(module)
            .map_err(|e| self.link_error(Language::Python, e))?;
        let runtime = Arc::new(PythonRuntime {
            pre,
            slots,
            hot_pages: match &primed {
                Some(PrimedStart { rebirth: true, .. }) => crate::prefault::HotPages::warm(),
                _ => crate::prefault::HotPages::fresh(),
            },
            ready: crate::ready::Ready::new(ready),
            lib_dir: self.inner.cache.python_lib_dir(),
            mpl_data_dir: self.inner.cache.python_mpl_data_dir(),
            primed,
        });
        runtime.ready.start(&runtime);
        Ok(runtime)
    }

    /// One-shot instances a runtime of `variant` that serves one-shots keeps made ahead of
    /// time: the engine's setting, none in a small engine ([`SERVING_SLOTS`]) or one that
    /// counts fuel.
    fn ready_instances(&self, variant: &Variant) -> usize {
        if variant.fuel || variant.slots < SERVING_SLOTS {
            0
        } else {
            self.inner.options.ready_instances as usize
        }
    }

    /// Where `variant` caches `name`, a module made from the Python runtime's.
    fn python_cwasm(&self, variant: &Variant, name: &str) -> PathBuf {
        crate::cache::cwasm_path(
            &variant.engine,
            &self.inner.cache,
            name,
            PYTHON.files[0].sha256,
        )
    }

    /// A primed runtime of the default engine (`variant`): [`WasmEngine::derived_python`]
    /// with the variant's slots and its ready instances.
    fn primed_runtime(
        &self,
        variant: &Variant,
        name: &str,
        prime: crate::cache::Prepare<'_>,
        primed: PrimedStart,
        progress: &dyn Progress,
    ) -> Result<Arc<PythonRuntime>, EngineError> {
        self.derived_python(
            &variant.engine,
            variant.slots,
            name,
            prime,
            self.ready_instances(variant),
            Some(primed),
            progress,
        )
    }

    /// A runtime of a module made from the Python runtime's (`prepare` rewrites its bytes:
    /// stripped, primed), compiled once into the cache as `name`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn derived_python(
        &self,
        engine: &Engine,
        slots: u32,
        name: &str,
        prepare: crate::cache::Prepare<'_>,
        ready: usize,
        primed: Option<PrimedStart>,
        progress: &dyn Progress,
    ) -> Result<Arc<PythonRuntime>, EngineError> {
        let estimate = Duration::from_secs(60);
        let module = self.compiled(engine, &PYTHON, name, estimate, progress, prepare)?;
        self.python_runtime_of(engine, &module, slots, ready, primed)
    }

    /// The Python runtime of the engine with (`fuel`) or without an instruction budget.
    pub(crate) fn python(
        &self,
        progress: &dyn Progress,
        fuel: bool,
    ) -> Result<Arc<PythonRuntime>, EngineError> {
        let variant = self.variant(fuel)?;
        let mut slot = variant.python.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(runtime) = slot.as_ref() {
            return Ok(runtime.clone());
        }
        let started = std::time::Instant::now();
        let estimate = Duration::from_secs(60);
        let module = self.module(variant, &PYTHON, Language::Python, estimate, progress)?;
        // One-shots take the primed runtime's instances made ahead, where it is on.
        let ready = if self.inner.options.primed {
            0
        } else {
            self.ready_instances(variant)
        };
        let runtime =
            self.python_runtime_of(&variant.engine, &module, variant.slots, ready, None)?;
        *slot = Some(runtime.clone());
        tracing::debug!(target: "kiln_wasm", language = "python", fuel, ms = started.elapsed().as_millis() as u64, "runtime ready");
        Ok(runtime)
    }

    /// The primed Python runtime of the engine without a budget ([`crate::warm::prime`]):
    /// loaded from the cache, or made once — the plain runtime runs
    /// [`crate::warm::PRIMING_CODE`] in a fresh guest, and a copy of the module with that
    /// guest's memory as its data is compiled (about as long as the plain module's).
    pub(crate) fn primed_python(
        &self,
        progress: &dyn Progress,
    ) -> Result<Arc<PythonRuntime>, EngineError> {
        let variant = self.variant(false)?;
        let mut slot = variant
            .python_primed
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(runtime) = slot.as_ref() {
            return Ok(runtime.clone());
        }
        let started = Instant::now();
        let name = primed_module_name();
        let path = self.python_cwasm(variant, &name);
        // The plain runtime is loaded only to make the primed module: a process that finds
        // it compiled maps one module, not two. (Loaded here, before the cache's lock is
        // taken for the compilation, which loading may need too.)
        let plain = if path.is_file() {
            None
        } else {
            Some(self.python(progress, false)?)
        };
        let prime = |wasm: Vec<u8>| {
            let plain = plain.as_ref().ok_or_else(|| {
                crate::qjs_exports::PatchError::Priming(
                    "the compiled primed module was unusable; it is made again next time".into(),
                )
            })?;
            progress.step(
                "priming the python runtime: its first turn, once",
                Some(Duration::from_secs(1)),
            );
            let (memory, _clock) = self
                .run_priming(plain)
                .map_err(crate::qjs_exports::PatchError::Priming)?;
            progress.done("primed the python runtime");
            crate::warm::prime(wasm, &memory)
        };
        let primed = PrimedStart {
            clock_ns: crate::warm::PRIMED_CLOCK_NS,
            rebirth: false,
            memory_len: 0,
        };
        let runtime = self.primed_runtime(variant, &name, &prime, primed, progress)?;
        *slot = Some(runtime.clone());
        tracing::debug!(target: "kiln_wasm", language = "python", primed = true, ms = started.elapsed().as_millis() as u64, "runtime ready");
        Ok(runtime)
    }

    /// The primed runtime of a warm template's one-shots: a copy of the module whose memory
    /// is the template's image (its warm-up's), compiled once into the cache, keyed by the
    /// image's key. Its guests come from the default engine's pooling slots, made ahead of
    /// time with the pages a one-shot touches populated, as fresh ones are; each runs the
    /// rebirth turn first. (Sessions of the template start in the warm engine, whose image
    /// mapping their forks share.)
    pub(crate) fn warm_primed_python(
        &self,
        warm_up: &str,
        image: &crate::warm::Image,
        progress: &dyn Progress,
    ) -> Result<Arc<PythonRuntime>, EngineError> {
        let variant = self.variant(false)?;
        let mut loaded = variant
            .warm_primed
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(runtime) = loaded.get(warm_up) {
            return Ok(runtime.clone());
        }
        let started = Instant::now();
        let name = warm_primed_module_name(&self.warm_image_path(warm_up)?);
        let prime = |wasm: Vec<u8>| {
            let memory = image.read_memory().map_err(|e| {
                crate::qjs_exports::PatchError::Priming(format!("reading the image: {e}"))
            })?;
            crate::warm::prime(wasm, &memory)
        };
        let primed = PrimedStart {
            clock_ns: image.clock_ns(),
            rebirth: true,
            memory_len: image.len(),
        };
        let runtime = self.primed_runtime(variant, &name, &prime, primed, progress)?;
        loaded.insert(warm_up.to_owned(), runtime.clone());
        tracing::debug!(target: "kiln_wasm", language = "python", warm_primed = true, ms = started.elapsed().as_millis() as u64, "runtime ready");
        Ok(runtime)
    }

    /// The runtime a one-shot of a warm template starts from, where primed starts are on
    /// and it can be made (else `None`: the one-shot starts in the warm engine, from the
    /// image). Made off this thread the first time (compiling it takes about a minute where
    /// setup did not).
    pub(crate) async fn warm_primed_runtime(&self, warm_up: &str) -> Option<Arc<PythonRuntime>> {
        if !self.inner.options.primed {
            return None;
        }
        let variant = self.variant(false).ok()?;
        if variant.warm_primed_off.load(Ordering::Relaxed) {
            return None;
        }
        let loaded = variant
            .warm_primed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(warm_up)
            .cloned();
        if loaded.is_some() {
            return loaded;
        }
        let made = async {
            let (image, _) = self.warm_image(warm_up, &Quiet).await?;
            let warm_up = warm_up.to_owned();
            Ok::<_, ExecError>(
                self.off_thread(Language::Python, move |engine| {
                    engine.warm_primed_python(&warm_up, &image, &Quiet)
                })
                .await?,
            )
        };
        match made.await {
            Ok(runtime) => Some(runtime),
            Err(error) => {
                if !variant.warm_primed_off.swap(true, Ordering::Relaxed) {
                    tracing::warn!(target: "kiln_wasm", %error, "a warm template's primed runtime could not be made; its one-shots start in the warm engine");
                }
                None
            }
        }
    }

    /// Whether what one-shots of a warm template start from is in the cache: the image,
    /// and the primed module where primed starts are on.
    pub fn is_warm_prepared(&self, warm_up: &str) -> Result<bool, EngineError> {
        let image = self.warm_image_path(warm_up)?;
        if !image.is_file() {
            return Ok(false);
        }
        if !self.inner.options.primed {
            return Ok(true);
        }
        let name = warm_primed_module_name(&image);
        Ok(self.python_cwasm(self.variant(false)?, &name).is_file())
    }

    /// Makes ready what one-shots of a warm template start from: its primed runtime where
    /// primed starts are on (the image built first if missing), else the warm engine's
    /// module and the image ([`WasmEngine::prepare_warm`]). `kiln exec` and setup use it.
    pub async fn prepare_warm_oneshots(
        &self,
        warm_up: &str,
        progress: &dyn Progress,
    ) -> Result<(), ExecError> {
        if self.inner.options.primed {
            let (image, _) = self.warm_image(warm_up, progress).await?;
            match self.warm_primed_python(warm_up, &image, progress) {
                Ok(_) => return Ok(()),
                Err(error) => {
                    tracing::warn!(target: "kiln_wasm", %error, "a warm template's primed runtime could not be made; its one-shots start in the warm engine");
                    self.variant(false)?
                        .warm_primed_off
                        .store(true, Ordering::Relaxed);
                }
            }
        }
        self.prepare_warm(warm_up, progress).await.map(drop)
    }

    /// Runs [`crate::warm::PRIMING_CODE`] as a one-shot in a fresh guest of `plain` (on a
    /// thread of its own, which may block) and answers the guest's memory afterwards and
    /// its clock, which must read less than [`crate::warm::PRIMED_CLOCK_NS`].
    fn run_priming(&self, plain: &Arc<PythonRuntime>) -> Result<(Vec<u8>, u64), String> {
        let run = || -> Result<(Vec<u8>, u64), String> {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| format!("could not start the priming run: {e}"))?;
            let (memory, clock) = runtime
                .block_on(self.capture_after(plain, &PRIMING_TURNS))
                .map_err(|e| e.to_string())?;
            if clock >= crate::warm::PRIMED_CLOCK_NS {
                return Err(format!("the priming run took too long ({clock} ns)"));
            }
            Ok((memory, clock))
        };
        std::thread::scope(|scope| {
            scope
                .spawn(run)
                .join()
                .unwrap_or_else(|_| Err("the priming run panicked".into()))
        })
    }

    /// Like [`WasmEngine::primed_python`] without progress, for async callers (loaded off
    /// this thread when not yet loaded, as [`WasmEngine::python_runtime`]).
    pub(crate) async fn primed_python_runtime(&self) -> Result<Arc<PythonRuntime>, EngineError> {
        let slot = &self.variant(false)?.python_primed;
        self.loaded_or_off_thread(slot, Language::Python, |engine| {
            engine.primed_python(&Quiet)
        })
        .await
    }

    /// The runtime a fresh Python guest of `request` starts from: the primed one where it
    /// applies (no budget, no environment of its own: a primed guest's `os.environ` is the
    /// priming run's), else the plain one. A primed runtime that cannot be made is reported
    /// once and not tried again in this process.
    pub(crate) async fn fresh_python(
        &self,
        request: &ExecRequest,
        fuel: bool,
    ) -> Result<Arc<PythonRuntime>, EngineError> {
        if !fuel && request.env.is_empty() && self.inner.options.primed {
            let variant = self.variant(false)?;
            if !variant.primed_off.load(Ordering::Relaxed) {
                match self.primed_python_runtime().await {
                    Ok(runtime) => return Ok(runtime),
                    Err(error) => {
                        if !variant.primed_off.swap(true, Ordering::Relaxed) {
                            tracing::warn!(target: "kiln_wasm", %error, "primed Python starts are off: the primed runtime could not be made; fresh guests start unprimed");
                        }
                    }
                }
            }
        }
        self.python_runtime(fuel).await
    }

    /// Like [`WasmEngine::python`] without progress, for async callers: a runtime not yet
    /// loaded is loaded on a blocking thread, because loading may compile it or wait for
    /// another process's compilation (minutes on a fresh cache, the first time a request
    /// asks for fuel), and an executor worker's one thread must go on answering the pool's
    /// pings meanwhile (a worker silent for 10 s is killed). A loaded one costs no hop.
    pub(crate) async fn python_runtime(
        &self,
        fuel: bool,
    ) -> Result<Arc<PythonRuntime>, EngineError> {
        let slot = &self.variant(fuel)?.python;
        self.loaded_or_off_thread(slot, Language::Python, move |engine| {
            engine.python(&Quiet, fuel)
        })
        .await
    }

    /// Like [`WasmEngine::python_runtime`], for JavaScript.
    pub(crate) async fn javascript_runtime(
        &self,
        fuel: bool,
    ) -> Result<Arc<JsRuntime>, EngineError> {
        let slot = &self.variant(fuel)?.javascript;
        self.loaded_or_off_thread(slot, Language::JavaScript, move |engine| {
            engine.javascript(&Quiet, fuel)
        })
        .await
    }

    /// The runtime in `slot` when it is loaded, else `load`'s, run off this thread.
    pub(crate) async fn loaded_or_off_thread<T: Send + Sync + 'static>(
        &self,
        slot: &Mutex<Option<Arc<T>>>,
        language: Language,
        load: impl FnOnce(&WasmEngine) -> Result<Arc<T>, EngineError> + Send + 'static,
    ) -> Result<Arc<T>, EngineError> {
        let loaded = slot.lock().unwrap_or_else(|e| e.into_inner()).clone();
        match loaded {
            Some(runtime) => Ok(runtime),
            None => self.off_thread(language, load).await,
        }
    }

    /// Runs `work`, which may block for minutes, on a blocking thread of the current tokio
    /// runtime (on this thread where there is none).
    pub(crate) async fn off_thread<T: Send + 'static>(
        &self,
        language: Language,
        work: impl FnOnce(&WasmEngine) -> Result<T, EngineError> + Send + 'static,
    ) -> Result<T, EngineError> {
        if tokio::runtime::Handle::try_current().is_err() {
            return work(self);
        }
        let engine = self.clone();
        match tokio::task::spawn_blocking(move || work(&engine)).await {
            Ok(done) => done,
            Err(error) => match error.try_into_panic() {
                Ok(panic) => std::panic::resume_unwind(panic),
                Err(_) => Err(EngineError::ShuttingDown { language }),
            },
        }
    }

    /// The JavaScript runtime of the engine with (`fuel`) or without an instruction budget.
    pub(crate) fn javascript(
        &self,
        progress: &dyn Progress,
        fuel: bool,
    ) -> Result<Arc<JsRuntime>, EngineError> {
        let variant = self.variant(fuel)?;
        let mut slot = variant.javascript.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(runtime) = slot.as_ref() {
            return Ok(runtime.clone());
        }
        let started = std::time::Instant::now();
        let estimate = Duration::from_secs(2);
        let module = self.module(
            variant,
            &JAVASCRIPT,
            Language::JavaScript,
            estimate,
            progress,
        )?;
        let linker = self.linker(&variant.engine, Language::JavaScript)?;
        let pre = linker
            .instantiate_pre(&module)
            .map_err(|e| self.link_error(Language::JavaScript, e))?;
        let runtime = Arc::new(JsRuntime {
            pre,
            slots: variant.slots,
        });
        *slot = Some(runtime.clone());
        tracing::debug!(target: "kiln_wasm", language = "javascript", fuel, ms = started.elapsed().as_millis() as u64, "runtime ready");
        Ok(runtime)
    }

    /// Runs one request in a fresh sandbox and returns what it produced. A guest that fails,
    /// times out or runs out of memory is a normal result; an error means kiln could not run
    /// it at all.
    pub async fn execute(&self, request: &ExecRequest) -> Result<ExecResult, ExecError> {
        self.execute_streaming(request, None).await
    }

    /// A one-shot in a fresh guest of `runtime` (plain, primed, or a warm template's primed
    /// one): its pages taught to the runtime, the guest dropped off this thread where the
    /// runtime keeps instances ready.
    async fn fresh_oneshot(
        &self,
        runtime: &Arc<PythonRuntime>,
        request: &ExecRequest,
        listener: Option<tokio::sync::mpsc::UnboundedSender<crate::output::OutputChunk>>,
    ) -> Result<ExecResult, ExecError> {
        let origin = python::Origin::Fresh;
        let mut guest = python::PythonGuest::open(self, runtime, request, false, origin).await?;
        let result = guest.turn(&request.code, &request.limits, listener).await?;
        guest.learn_hot_pages(runtime);
        if runtime.ready.want() > 0 {
            crate::ready::drop_later(guest);
        }
        Ok(result)
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
        // A budget runs on the fuel engine; without one, nothing here counts fuel.
        let fuel = request.limits.fuel.is_some();
        let template = request
            .template
            .as_deref()
            .or_else(|| self.data_stack_start(request, fuel));
        let warm_primed = match template.and_then(crate::warm::warm_up_of) {
            Some(warm_up) if !fuel && request.language == Language::Python => {
                self.warm_primed_runtime(warm_up).await
            }
            _ => None,
        };
        let mut result = match request.language {
            Language::Python => {
                if let Some(runtime) = warm_primed {
                    self.fresh_oneshot(&runtime, request, listener).await?
                } else if let Some(origin) = self.warm_origin(template, fuel).await? {
                    let runtime = self.warm_python_runtime().await?;
                    let mut guest =
                        python::PythonGuest::open(self, &runtime, request, false, origin).await?;
                    guest.turn(&request.code, &request.limits, listener).await?
                } else {
                    let runtime = self.fresh_python(request, fuel).await?;
                    self.fresh_oneshot(&runtime, request, listener).await?
                }
            }
            Language::JavaScript => {
                let runtime = self.javascript_runtime(fuel).await?;
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

impl WasmEngine {
    /// Where a plain Python one-shot (no template) whose code imports the data stack
    /// ([`crate::warm::imports_data_stack`]) starts: `python-data`'s warm image, which has
    /// imported it already, so `import pandas` costs nothing instead of most of a second.
    /// Only when that image and its primed module are built (`kiln setup` builds them; a
    /// one-shot never waits for them), the run counts no fuel (a warm start counts none), and the run's memory cap
    /// leaves at least 64 MiB beside the image. The image leaves no name bound, so the code
    /// sees the globals of a fresh interpreter; its modules are in `sys.modules` already.
    fn data_stack_start(&self, request: &ExecRequest, fuel: bool) -> Option<&'static str> {
        if fuel
            || request.language != Language::Python
            || !crate::warm::imports_data_stack(&request.code)
        {
            return None;
        }
        let warm_up = crate::warm::PYTHON_DATA_WARM_UP;
        if !self.is_warm_prepared(warm_up).unwrap_or(false) {
            return None;
        }
        let image = self.warm_image_path(warm_up).ok()?;
        let bytes = std::fs::metadata(&image).ok()?.len();
        if request.limits.memory_bytes < bytes.saturating_add(64 << 20) {
            return None;
        }
        Some(crate::warm::PYTHON_DATA)
    }

    /// Where a Python guest of `template` starts: its warm image when the template has a
    /// warm-up, else `None` (a fresh interpreter). A warm template counts no fuel.
    pub(crate) async fn warm_origin(
        &self,
        template: Option<&str>,
        fuel: bool,
    ) -> Result<Option<python::Origin>, ExecError> {
        let Some(warm_up) = template.and_then(crate::warm::warm_up_of) else {
            return Ok(None);
        };
        if fuel {
            return Err(ExecError::FuelUnavailable {
                why: "a warm template (python-data) counts no instruction budget; use the python template for a run with fuel",
            });
        }
        let (image, _) = self.warm_image(warm_up, &Quiet).await?;
        Ok(Some(python::Origin::Image(image)))
    }
}

/// A guest of `language` could not be started because of `error`.
pub(crate) fn instantiate_error(language: Language, error: impl std::fmt::Display) -> ExecError {
    ExecError::Instantiate {
        language,
        detail: format!("{error:#}"),
    }
}

/// Maps a failed `instantiate_async`: `Busy` when every one of the engine's `slots` is
/// taken.
pub(crate) fn instantiation_error(
    slots: u32,
    language: Language,
    error: wasmtime::Error,
) -> ExecError {
    if error.is::<wasmtime::PoolConcurrencyLimitError>() {
        return ExecError::Busy { limit: slots };
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::cwasm_path;

    #[test]
    fn the_primed_module_is_keyed_by_what_priming_puts_in_it() {
        let base = primed_module_name_of("pass", &[("HOME", "/tmp")], 10);
        assert_eq!(base, primed_module_name_of("pass", &[("HOME", "/tmp")], 10));
        assert!(base.starts_with("python-primed"), "{base}");
        for other in [
            primed_module_name_of("pass\n", &[("HOME", "/tmp")], 10),
            primed_module_name_of("pass", &[("HOME", "/root")], 10),
            primed_module_name_of("pass", &[("HOME", "/tmp"), ("A", "b")], 10),
            primed_module_name_of("pass", &[("HOME", "/tmp")], 11),
        ] {
            assert_ne!(base, other);
        }
    }

    #[test]
    fn the_fuel_engine_compiles_to_files_of_its_own() {
        let options = EngineOptions {
            max_instances: 8,
            ..EngineOptions::default()
        };
        let plain = Variant::new(&options, false).unwrap();
        let fuel = Variant::new(&options, true).unwrap();
        let cache = CacheDir::new("/kiln-cache");
        let digest = "0123456789abcdef".repeat(4);
        let path =
            |variant: &Variant, name: &str| cwasm_path(&variant.engine, &cache, name, &digest);
        assert!(
            path(&plain, &plain.module_name("python"))
                .to_string_lossy()
                .contains("/python-0123456789abcdef-wasmtime48.0.8-")
        );
        assert!(
            path(&fuel, &fuel.module_name("python"))
                .to_string_lossy()
                .contains("/python-fuel-0123456789abcdef-")
        );
        // Under one name too, the engines' hashes differ: neither loads the other's code.
        assert_ne!(path(&plain, "python"), path(&fuel, "python"));
    }

    #[test]
    fn the_fuel_engine_has_an_eighth_of_the_slots_at_least_four() {
        assert_eq!([1, 4, 8, 40, 1000].map(fuel_slots), [1, 4, 4, 5, 125]);
    }
}
