//! What every guest store holds and how one call into a guest is bounded and judged.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use kiln_core::{ExecRequest, ExecResult, Limits, Outcome};
use wasmtime::{Caller, Linker, ResourceLimiter, Store, Trap, UpdateDeadline};
use wasmtime_wasi::p1::WasiP1Ctx;
use wasmtime_wasi::{FsPerms, I32Exit, WasiCtxBuilder};

use crate::output::{CappedPipe, StreamKind};

/// What a store used, readable by the host while the guest runs elsewhere.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    pub peak_memory_bytes: AtomicU64,
    /// Set when a memory growth was refused: the guest hit its cap.
    pub memory_hit: AtomicBool,
    pub fs_written_bytes: AtomicU64,
    /// Set when a write or file creation was refused for the budget.
    pub fs_refused: AtomicBool,
    /// Set when the guest called a file operation that may change a file or folder (a
    /// write, a creation, a truncation, a removal, a rename, a link); a turn that never did
    /// changed no file, and the host need not look at its workspace.
    pub fs_touched: AtomicBool,
}

impl Stats {
    /// Clears what is per turn (the memory peak is the instance's, and stays).
    pub fn start_turn(&self) {
        self.memory_hit.store(false, Ordering::Relaxed);
        self.fs_written_bytes.store(0, Ordering::Relaxed);
        self.fs_refused.store(false, Ordering::Relaxed);
        self.fs_touched.store(false, Ordering::Relaxed);
    }

    pub fn hit(&self) -> bool {
        self.memory_hit.load(Ordering::Relaxed)
    }

    pub fn peak(&self) -> u64 {
        self.peak_memory_bytes.load(Ordering::Relaxed)
    }

    pub fn written(&self) -> u64 {
        self.fs_written_bytes.load(Ordering::Relaxed)
    }
}

/// Memory cap of one store.
#[derive(Debug)]
pub(crate) struct MemoryLimiter {
    pub cap_bytes: usize,
    pub stats: Arc<Stats>,
}

impl ResourceLimiter for MemoryLimiter {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.cap_bytes {
            self.stats.memory_hit.store(true, Ordering::Relaxed);
            return Ok(false);
        }
        self.stats
            .peak_memory_bytes
            .fetch_max(desired as u64, Ordering::Relaxed);
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        // Tables hold function references; a million is far beyond what the runtimes use.
        Ok(desired <= 1_000_000)
    }
}

/// File-system budget of one execution (or one session turn).
#[derive(Debug, Default)]
pub(crate) struct FsBudget {
    write_bytes_left: AtomicU64,
    creates_left: AtomicU64,
}

impl FsBudget {
    /// A fresh budget for a turn. Shared (an `Arc`) with the store, whose own thread spends
    /// it.
    pub fn reset(&self, limits: &Limits) {
        self.write_bytes_left
            .store(limits.fs_write_bytes, Ordering::Relaxed);
        self.creates_left
            .store(limits.fs_create_count, Ordering::Relaxed);
    }

    pub fn write_bytes_left(&self) -> u64 {
        self.write_bytes_left.load(Ordering::Relaxed)
    }

    pub fn spend_write_bytes(&self, bytes: u64) {
        let left = self.write_bytes_left().saturating_sub(bytes);
        self.write_bytes_left.store(left, Ordering::Relaxed);
    }

    /// Takes one creation from the budget; false when none is left.
    pub fn take_create(&self) -> bool {
        let left = self.creates_left.load(Ordering::Relaxed);
        if left == 0 {
            return false;
        }
        self.creates_left.store(left - 1, Ordering::Relaxed);
        true
    }
}

/// The state of one guest store.
pub(crate) struct GuestState {
    pub wasi: WasiP1Ctx,
    pub memory: MemoryLimiter,
    pub fs: Arc<FsBudget>,
    /// Deadline as nanoseconds since `clock_base`; `u64::MAX` means none. Shared with the
    /// host's bounded call, which reads it while the guest runs.
    pub deadline_ns: Arc<AtomicU64>,
    pub clock_base: Instant,
    /// The capability granted for the current turn, if any: what `host::call` reaches.
    pub door: Option<Door>,
    /// Where rich results sent through `host::call` go (Python guests).
    pub displays: Option<crate::output::Displays>,
}

impl GuestState {
    pub fn deadline_passed(&self) -> bool {
        let now = u64::try_from(self.clock_base.elapsed().as_nanos()).unwrap_or(u64::MAX);
        now >= self.deadline_ns.load(Ordering::Relaxed)
    }
}

/// Sets a store's deadline to `limits.timeout_ms` from now.
pub(crate) fn arm_deadline(deadline_ns: &AtomicU64, clock_base: Instant, limits: &Limits) {
    let at = clock_base.elapsed() + limits.timeout();
    deadline_ns.store(
        u64::try_from(at.as_nanos()).unwrap_or(u64::MAX),
        Ordering::Relaxed,
    );
}

/// Starts a session turn on `store`: empty pipes with the turn's caps and listener, a fresh
/// file budget and memory statistics, and the deadline armed. Returns the deadline and its
/// clock, for the bounded call.
pub(crate) fn begin_turn(
    store: &mut Store<GuestState>,
    stdio: &Stdio,
    limits: &Limits,
    listener: Option<tokio::sync::mpsc::UnboundedSender<crate::output::OutputChunk>>,
) -> (Arc<AtomicU64>, Instant) {
    stdio.start_turn(limits, listener);
    let state = store.data_mut();
    state.fs.reset(limits);
    state.memory.stats.start_turn();
    arm_deadline(&state.deadline_ns, state.clock_base, limits);
    (state.deadline_ns.clone(), state.clock_base)
}

/// The stdio pipes of a store, kept by the host to read what the guest wrote.
#[derive(Debug, Clone)]
pub(crate) struct Stdio {
    pub stdout: CappedPipe,
    pub stderr: CappedPipe,
    pub displays: crate::output::Displays,
}

impl Stdio {
    pub fn new(limits: &Limits) -> Stdio {
        Stdio {
            stdout: CappedPipe::new(StreamKind::Stdout, limits.stdout_bytes),
            stderr: CappedPipe::new(StreamKind::Stderr, limits.stderr_bytes),
            displays: crate::output::Displays::default(),
        }
    }

    /// Empties both pipes for a new turn with its caps and listener.
    pub fn start_turn(
        &self,
        limits: &Limits,
        listener: Option<tokio::sync::mpsc::UnboundedSender<crate::output::OutputChunk>>,
    ) {
        self.stdout.reset(limits.stdout_bytes, listener.clone());
        self.displays.reset(listener.clone());
        self.stderr.reset(limits.stderr_bytes, listener);
    }
}

/// Refuses a turn on a guest that has ended.
pub(crate) fn ensure_alive(ended: &Option<String>) -> Result<(), crate::engine::ExecError> {
    match ended {
        Some(reason) => Err(crate::engine::ExecError::SessionEnded {
            reason: reason.clone(),
        }),
        None => Ok(()),
    }
}

/// Where a preopen comes from and how the guest may use it.
pub(crate) struct Preopen<'a> {
    pub host: &'a Path,
    pub guest: &'a str,
    pub writable: bool,
}

/// Failed to build a guest's context.
#[derive(Debug, thiserror::Error)]
pub enum GrantError {
    /// A granted host directory could not be opened (the message names the guest's path
    /// only: it reaches API clients, who are not told the host's paths).
    #[error("cannot grant the host folder for {guest} to the guest: {detail}")]
    Preopen {
        host: std::path::PathBuf,
        guest: String,
        detail: String,
    },
    /// A guest path is not absolute or holds `..`.
    #[error("the guest path {guest:?} must be absolute and must not contain `..`")]
    BadGuestPath { guest: String },
    /// An environment variable name or value is unusable.
    #[error("the environment variable {name:?} is not allowed (empty, or holds `=` or NUL)")]
    BadEnv { name: String },
}

/// A guest's monotonic clock: nanoseconds since its origin. A guest started from an image
/// or forked gets an origin in the past, so its clock goes on from where its image's or
/// parent's was, never backwards.
pub(crate) struct GuestClock(pub Instant);

impl wasmtime_wasi::HostMonotonicClock for GuestClock {
    fn resolution(&self) -> u64 {
        1
    }

    fn now(&self) -> u64 {
        u64::try_from(self.0.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }
}

/// Builds the WASI context: only the given preopens and environment, no network, no
/// inherited anything.
pub(crate) fn wasi_context(
    preopens: &[Preopen<'_>],
    base_env: &[(&str, &str)],
    request: &ExecRequest,
    stdio: &Stdio,
    stdin: Box<dyn wasmtime_wasi::cli::StdinStream>,
    args: &[&str],
    clock: GuestClock,
) -> Result<WasiP1Ctx, GrantError> {
    let mut builder = WasiCtxBuilder::new();
    builder
        .monotonic_clock(clock)
        .args(args)
        .stdout(stdio.stdout.clone())
        .stderr(stdio.stderr.clone())
        .allow_tcp(false)
        .allow_udp(false)
        .allow_ip_name_lookup(false);
    builder.stdin(StdinBox(stdin));
    for (name, value) in base_env {
        builder.env(name, value);
    }
    for (name, value) in &request.env {
        if name.is_empty() || name.contains('=') || name.contains('\0') || value.contains('\0') {
            return Err(GrantError::BadEnv { name: name.clone() });
        }
        builder.env(name, value);
    }
    for preopen in preopens {
        check_guest_path(preopen.guest)?;
        let perms = if preopen.writable {
            FsPerms::ReadWrite
        } else {
            FsPerms::ReadOnly
        };
        builder
            .preopened_dir(preopen.host, preopen.guest, perms)
            .map_err(|e| GrantError::Preopen {
                host: preopen.host.to_path_buf(),
                guest: preopen.guest.to_owned(),
                detail: format!("{e:#}"),
            })?;
    }
    Ok(builder.build_p1())
}

fn check_guest_path(guest: &str) -> Result<(), GrantError> {
    if !guest.starts_with('/') || guest.split('/').any(|part| part == "..") {
        return Err(GrantError::BadGuestPath {
            guest: guest.to_owned(),
        });
    }
    Ok(())
}

/// A boxed stdin, so callers can pick the stream type at run time.
struct StdinBox(Box<dyn wasmtime_wasi::cli::StdinStream>);

impl wasmtime_wasi::cli::IsTerminal for StdinBox {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl wasmtime_wasi::cli::StdinStream for StdinBox {
    fn async_stream(&self) -> Box<dyn tokio::io::AsyncRead + Send + Sync> {
        self.0.async_stream()
    }

    fn p2_stream(&self) -> Box<dyn wasmtime_wasi_io::streams::InputStream> {
        self.0.p2_stream()
    }
}

/// A new store with the memory cap, the epoch deadline and the deadline callback installed,
/// and the instruction budget when `limits` has one (then `engine` must count fuel).
pub(crate) fn new_store(
    engine: &wasmtime::Engine,
    wasi: WasiP1Ctx,
    limits: &Limits,
) -> wasmtime::Result<Store<GuestState>> {
    let clock_base = Instant::now();
    let deadline_ns = Arc::new(AtomicU64::new(u64::MAX));
    arm_deadline(&deadline_ns, clock_base, limits);
    let fs = Arc::new(FsBudget::default());
    fs.reset(limits);
    let state = GuestState {
        wasi,
        memory: MemoryLimiter {
            cap_bytes: usize::try_from(limits.memory_bytes).unwrap_or(usize::MAX),
            stats: Arc::new(Stats::default()),
        },
        fs,
        deadline_ns,
        clock_base,
        door: None,
        displays: None,
    };
    let mut store = Store::new(engine, state);
    if let Some(fuel) = limits.fuel {
        store.set_fuel(fuel)?;
    }
    store.limiter(|state| &mut state.memory);
    store.set_epoch_deadline(1);
    store.epoch_deadline_callback(|ctx| {
        if ctx.data().deadline_passed() {
            Ok(UpdateDeadline::Interrupt)
        } else {
            // Yield at every tick so the host's timers and other guests get their turn.
            Ok(UpdateDeadline::Yield(1))
        }
    });
    Ok(store)
}

/// Gives a store made ahead of time (with an empty context) a request's context, caps and
/// deadline, before it runs anything (kiln's own calls at start, such as a primed guest's
/// preopen reset, run under it: the deadline armed when the store was made may have passed
/// while it waited to be taken).
pub(crate) fn dress_store(store: &mut Store<GuestState>, wasi: WasiP1Ctx, limits: &Limits) {
    let state = store.data_mut();
    arm_deadline(&state.deadline_ns, state.clock_base, limits);
    state.wasi = wasi;
    state.memory.cap_bytes = usize::try_from(limits.memory_bytes).unwrap_or(usize::MAX);
    state.fs.reset(limits);
    state.door = None;
}

/// Adds WASI preview 1 with kiln's file quota in front of the calls that write or create
/// files, and the host door.
pub(crate) fn add_to_linker(linker: &mut Linker<GuestState>) -> wasmtime::Result<()> {
    wasmtime_wasi::p1::add_to_linker_async(linker, |state: &mut GuestState| &mut state.wasi)?;
    linker.allow_shadowing(true);
    crate::quota::shadow_writes(linker)?;
    crate::quota::shadow_creates(linker)?;
    linker.allow_shadowing(false);
    Ok(())
}

/// How one call into the guest ended, before output is collected.
#[derive(Debug)]
pub(crate) enum CallEnd<T> {
    /// The export returned.
    Returned(T),
    /// The guest called `proc_exit`.
    Exited(i32),
    /// The deadline passed (inside wasm or while blocked in the host).
    TimedOut,
    /// The instruction budget (fuel) was spent.
    FuelExhausted,
    /// A trap or host error; the string names it.
    Trapped(String),
}

impl<T> CallEnd<T> {
    /// Whether the store may be used again afterwards.
    pub fn store_usable(&self) -> bool {
        matches!(self, CallEnd::Returned(_))
    }
}

/// Runs one async call into the guest under the store's deadline. The epoch callback stops
/// running wasm; the timer stops a guest blocked in a host call (`time.sleep`, stdin).
pub(crate) async fn bounded_call<T, F>(
    deadline_ns: &AtomicU64,
    clock_base: Instant,
    call: F,
) -> CallEnd<T>
where
    F: std::future::Future<Output = wasmtime::Result<T>>,
{
    let deadline = deadline_ns.load(Ordering::Relaxed);
    let at = clock_base + std::time::Duration::from_nanos(deadline);
    match tokio::time::timeout_at(at.into(), call).await {
        Err(_) => CallEnd::TimedOut,
        Ok(Ok(value)) => CallEnd::Returned(value),
        Ok(Err(error)) => classify_error(error),
    }
}

pub(crate) fn classify_error<T>(error: wasmtime::Error) -> CallEnd<T> {
    if let Some(exit) = error.downcast_ref::<I32Exit>() {
        return CallEnd::Exited(exit.0);
    }
    if let Some(trap) = error.downcast_ref::<Trap>() {
        if *trap == Trap::Interrupt {
            return CallEnd::TimedOut;
        }
        if *trap == Trap::OutOfFuel {
            return CallEnd::FuelExhausted;
        }
        return CallEnd::Trapped(trap_name(*trap));
    }
    CallEnd::Trapped(format!("host error: {error:#}"))
}

fn trap_name(trap: Trap) -> String {
    match trap {
        Trap::StackOverflow => "stack overflow".into(),
        Trap::MemoryOutOfBounds => "out-of-bounds memory access".into(),
        Trap::UnreachableCodeReached => "unreachable code reached".into(),
        Trap::IntegerDivisionByZero => "integer division by zero".into(),
        Trap::IndirectCallToNull => "call to a null function".into(),
        Trap::BadSignature => "indirect call with a bad signature".into(),
        Trap::IntegerOverflow => "integer overflow".into(),
        Trap::BadConversionToInteger => "bad conversion to integer".into(),
        other => other.to_string(),
    }
}

/// Turns a call's end and the store's state into the outcome and exit code kiln reports.
fn judge(end: &CallEnd<i32>, memory_hit: bool, truncated: bool) -> (Outcome, i32) {
    let (outcome, exit_code) = match end {
        CallEnd::Returned(code) | CallEnd::Exited(code) => {
            // A guest that hit its cap and then failed ran out of memory; one that caught
            // the MemoryError and succeeded completed.
            if memory_hit && *code != 0 {
                (Outcome::MemoryLimit, *code)
            } else if truncated {
                (Outcome::OutputTruncated, *code)
            } else {
                (Outcome::Completed, *code)
            }
        }
        CallEnd::TimedOut => (Outcome::TimedOut, -1),
        // What stopped it was the budget, whatever the memory cap did before.
        CallEnd::FuelExhausted => (Outcome::FuelExhausted, -1),
        CallEnd::Trapped(_) if memory_hit => (Outcome::MemoryLimit, -1),
        CallEnd::Trapped(trap) => (Outcome::Crashed { trap: trap.clone() }, -1),
    };
    (outcome, exit_code)
}

pub use kiln_core::backend::{Door, DoorFuture};

/// The largest frame through the door either way: 4 MiB. A larger one is a fault.
pub const MAX_DOOR_FRAME_BYTES: usize = 4 << 20;

/// Defines `host::call`, the door through which a guest asks the host for a granted
/// capability: -1 when nothing is granted, -2 when the host faults, 0 with the reply written
/// into guest memory (allocated with the guest's `host_alloc`) otherwise.
pub(crate) fn add_door(linker: &mut Linker<GuestState>) -> wasmtime::Result<()> {
    linker.func_wrap_async(
        "host",
        "call",
        |mut caller: Caller<'_, GuestState>, (ptr, len, out_ptr, out_len): (i32, i32, i32, i32)| {
            Box::new(async move {
                let out = (out_ptr, out_len);
                if let Some(displays) = caller.data().displays.clone()
                    && let Some(answer) = display_call(&mut caller, &displays, ptr, len, out).await
                {
                    return Ok(answer);
                }
                let Some(door) = caller.data().door.clone() else {
                    return Ok(-1);
                };
                Ok(door_call(&mut caller, &door, ptr, len, out)
                    .await
                    .unwrap_or(-2))
            })
        },
    )?;
    Ok(())
}

/// What begins a frame that carries a rich result for kiln itself rather than for a door.
pub(crate) const DISPLAY_FRAME: &[u8] = b"kiln:display ";
/// The frame a Python guest sends once it has imported pyplot (see [`crate::output::Displays::arm`]).
pub(crate) const FIGURES_FRAME: &[u8] = b"kiln:figures";

/// A frame for kiln itself through `host::call`: a rich result, kept (answer 0, reply `ok`)
/// or refused (-2: malformed, or the turn's results budget is spent), or the figures
/// signal. `None`: a frame for the door.
async fn display_call(
    caller: &mut Caller<'_, GuestState>,
    displays: &crate::output::Displays,
    ptr: i32,
    len: i32,
    out: (i32, i32),
) -> Option<i32> {
    let memory = caller.get_export("memory")?.into_memory()?;
    let mut head = [0u8; DISPLAY_FRAME.len()];
    let head_len = usize::try_from(len).ok()?.min(head.len());
    memory
        .read(&*caller, usize::try_from(ptr).ok()?, &mut head[..head_len])
        .ok()?;
    if &head[..head_len] == FIGURES_FRAME {
        displays.arm();
    } else if head[..head_len] == *DISPLAY_FRAME {
        let Some(frame) = read_frame(caller, ptr, len) else {
            return Some(-2);
        };
        if !displays.push(&frame[DISPLAY_FRAME.len()..]) {
            return Some(-2);
        }
    } else {
        return None;
    }
    Some(write_reply(caller, b"ok".to_vec(), out).await.unwrap_or(-2))
}

/// A frame the guest wrote at `ptr`, at most [`MAX_DOOR_FRAME_BYTES`].
fn read_frame(caller: &mut Caller<'_, GuestState>, ptr: i32, len: i32) -> Option<Vec<u8>> {
    let memory = caller.get_export("memory")?.into_memory()?;
    let ptr = usize::try_from(ptr).ok()?;
    let len = usize::try_from(len).ok()?;
    if len > MAX_DOOR_FRAME_BYTES {
        return None;
    }
    let mut frame = vec![0u8; len];
    memory.read(&*caller, ptr, &mut frame).ok()?;
    Some(frame)
}

/// One call through an open door; `None` is a fault.
async fn door_call(
    caller: &mut Caller<'_, GuestState>,
    door: &Door,
    ptr: i32,
    len: i32,
    out: (i32, i32),
) -> Option<i32> {
    let frame = read_frame(caller, ptr, len)?;
    let reply = door(frame).await.ok()?;
    write_reply(caller, reply, out).await
}

/// Writes `reply` into guest memory (allocated with the guest's `host_alloc`) and its
/// pointer and length at the two out-pointers; `None` is a fault.
async fn write_reply(
    caller: &mut Caller<'_, GuestState>,
    reply: Vec<u8>,
    (out_ptr, out_len): (i32, i32),
) -> Option<i32> {
    if reply.len() > MAX_DOOR_FRAME_BYTES {
        return None;
    }
    let memory = caller.get_export("memory")?.into_memory()?;
    let alloc = caller
        .get_export("host_alloc")?
        .into_func()?
        .typed::<i32, i32>(&*caller)
        .ok()?;
    let reply_len = i32::try_from(reply.len()).ok()?;
    let at = alloc.call_async(&mut *caller, reply_len).await.ok()?;
    let at_usize = usize::try_from(at).ok()?;
    memory.write(&mut *caller, at_usize, &reply).ok()?;
    let out_ptr = usize::try_from(out_ptr).ok()?;
    let out_len = usize::try_from(out_len).ok()?;
    memory
        .write(
            &mut *caller,
            out_ptr,
            &u32::try_from(at).ok()?.to_le_bytes(),
        )
        .ok()?;
    memory
        .write(
            &mut *caller,
            out_len,
            &u32::try_from(reply_len).ok()?.to_le_bytes(),
        )
        .ok()?;
    Some(0)
}

/// Appends the request's own grants: its workspace (at `/workspace` unless it says where),
/// then its mounts.
pub(crate) fn push_grants<'a>(request: &'a ExecRequest, preopens: &mut Vec<Preopen<'a>>) {
    if let Some(workspace) = &request.workspace {
        preopens.push(Preopen {
            host: workspace,
            guest: request.workspace_guest(),
            writable: true,
        });
    }
    for mount in &request.mounts {
        preopens.push(Preopen {
            host: &mount.host,
            guest: &mount.guest,
            writable: mount.writable,
        });
    }
}

/// Collects a call's output and statistics into the result kiln reports.
pub(crate) fn finish(
    end: &CallEnd<i32>,
    stats: &Stats,
    stdio: &Stdio,
    started: Instant,
) -> ExecResult {
    let (stdout, stdout_truncated) = stdio.stdout.take();
    let (stderr, stderr_truncated) = stdio.stderr.take();
    let (outcome, exit_code) = judge(end, stats.hit(), stdout_truncated || stderr_truncated);
    tracing::trace!(
        target: "kiln_wasm",
        ?outcome,
        exit_code,
        us = started.elapsed().as_micros() as u64,
        peak_memory = stats.peak(),
        fs_written = stats.written(),
        "guest call ended"
    );
    ExecResult {
        stdout,
        stderr,
        exit_code,
        outcome,
        stdout_truncated,
        stderr_truncated,
        duration_us: u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX),
        peak_memory_bytes: stats.peak(),
        fs_written_bytes: stats.written(),
        fs_refused: stats.fs_refused.load(Ordering::Relaxed),
        files_changed: Some(stats.fs_touched.load(Ordering::Relaxed)),
        results: stdio.displays.take(),
        session_memory_bytes: None,
    }
}

/// The folder under which an engine makes each guest's private `/tmp`, removed with the
/// engine. Creating and removing a folder costs ~170 µs on a journaling file system, so a
/// folder the guest left empty is kept for the next guest instead (an empty folder carries
/// nothing from one guest to the next).
#[derive(Debug)]
pub(crate) struct TmpRoot {
    root: tempfile::TempDir,
    next: AtomicU64,
    free: Arc<std::sync::Mutex<Vec<std::path::PathBuf>>>,
}

/// Empty folders kept for reuse, at most.
const FREE_TMP_DIRS: usize = 64;

impl TmpRoot {
    pub fn new() -> std::io::Result<TmpRoot> {
        Ok(TmpRoot {
            root: tempfile::Builder::new().prefix("kiln-tmp-").tempdir()?,
            next: AtomicU64::new(0),
            free: Arc::default(),
        })
    }

    /// Removes the root and everything under it now (guests still running lose their `/tmp`).
    pub fn remove_now(&self) {
        // Guests wrote the folders under it: std's remove_dir_all walks them through
        // directory handles and never follows a link (the root itself is kiln's own).
        let _ = std::fs::remove_dir_all(self.root.path());
    }

    /// An empty folder only this guest sees, emptied or removed on drop.
    pub fn private(&self) -> std::io::Result<PrivateTmp> {
        let reused = self.free.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let path = match reused {
            Some(path) => path,
            None => {
                let n = self.next.fetch_add(1, Ordering::Relaxed);
                let path = self.root.path().join(n.to_string());
                std::fs::create_dir(&path)?;
                path
            }
        };
        Ok(PrivateTmp {
            path,
            free: self.free.clone(),
        })
    }
}

/// A guest's private `/tmp` on the host.
#[derive(Debug)]
pub(crate) struct PrivateTmp {
    path: std::path::PathBuf,
    free: Arc<std::sync::Mutex<Vec<std::path::PathBuf>>>,
}

impl PrivateTmp {
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for PrivateTmp {
    fn drop(&mut self) {
        let empty = std::fs::read_dir(&self.path).is_ok_and(|mut entries| entries.next().is_none());
        if empty {
            let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
            if free.len() < FREE_TMP_DIRS {
                free.push(std::mem::take(&mut self.path));
                return;
            }
        }
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guest_paths_must_be_absolute_without_dotdot() {
        assert!(check_guest_path("/workspace").is_ok());
        assert!(matches!(
            check_guest_path("workspace"),
            Err(GrantError::BadGuestPath { .. })
        ));
        assert!(matches!(
            check_guest_path("/a/../etc"),
            Err(GrantError::BadGuestPath { .. })
        ));
    }
}
