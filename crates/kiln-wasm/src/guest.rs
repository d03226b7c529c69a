//! What every guest store holds and how one call into a guest is bounded and judged.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use kiln_core::{ExecRequest, ExecResult, Limits, Outcome};
use wasmtime::{Caller, Linker, ResourceLimiter, Store, Trap, UpdateDeadline};
use wasmtime_wasi::p1::WasiP1Ctx;
use wasmtime_wasi::p1::wasi_snapshot_preview1 as p1;
use wasmtime_wasi::{FsPerms, I32Exit, WasiCtxBuilder};
use wiggle::{GuestMemory, GuestPtr};

use crate::output::{CappedPipe, StreamKind};

/// The guest's working directory when a workspace is granted.
pub const WORKSPACE_GUEST: &str = "/workspace";

/// WASI errno values kiln answers with itself.
const ERRNO_BADF: i32 = 8;
const ERRNO_NOSPC: i32 = 51;
const OFLAGS_CREAT: i32 = 1;

/// What a store used, readable by the host while the guest runs elsewhere.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    pub peak_memory_bytes: AtomicU64,
    /// Set when a memory growth was refused: the guest hit its cap.
    pub memory_hit: AtomicBool,
    pub fs_written_bytes: AtomicU64,
}

impl Stats {
    /// Clears what is per turn (the memory peak is the instance's, and stays).
    pub fn start_turn(&self) {
        self.memory_hit.store(false, Ordering::Relaxed);
        self.fs_written_bytes.store(0, Ordering::Relaxed);
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
    pub write_bytes_left: u64,
    pub creates_left: u64,
}

impl FsBudget {
    pub fn reset(&mut self, limits: &Limits) {
        self.write_bytes_left = limits.fs_write_bytes;
        self.creates_left = limits.fs_create_count;
    }
}

/// The state of one guest store.
pub(crate) struct GuestState {
    pub wasi: WasiP1Ctx,
    pub memory: MemoryLimiter,
    pub fs: FsBudget,
    /// Deadline as nanoseconds since `clock_base`; `u64::MAX` means none. Shared so a host
    /// task can move it while the guest runs (JavaScript sessions).
    pub deadline_ns: Arc<AtomicU64>,
    pub clock_base: Instant,
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

/// The stdio pipes of a store, kept by the host to read what the guest wrote.
#[derive(Debug, Clone)]
pub(crate) struct Stdio {
    pub stdout: CappedPipe,
    pub stderr: CappedPipe,
}

impl Stdio {
    pub fn new(limits: &Limits) -> Stdio {
        Stdio {
            stdout: CappedPipe::new(StreamKind::Stdout, limits.stdout_bytes),
            stderr: CappedPipe::new(StreamKind::Stderr, limits.stderr_bytes),
        }
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
    /// A granted host directory could not be opened.
    #[error("cannot grant {host} to the guest at {guest}: {detail}")]
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

/// Builds the WASI context: only the given preopens and environment, no network, no
/// inherited anything.
pub(crate) fn wasi_context(
    preopens: &[Preopen<'_>],
    base_env: &[(&str, &str)],
    request: &ExecRequest,
    stdio: &Stdio,
    stdin: Box<dyn wasmtime_wasi::cli::StdinStream>,
    args: &[&str],
) -> Result<WasiP1Ctx, GrantError> {
    let mut builder = WasiCtxBuilder::new();
    builder
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

/// A new store with the memory cap, the epoch deadline and the deadline callback installed.
pub(crate) fn new_store(
    engine: &wasmtime::Engine,
    wasi: WasiP1Ctx,
    limits: &Limits,
) -> Store<GuestState> {
    let clock_base = Instant::now();
    let deadline_ns = Arc::new(AtomicU64::new(u64::MAX));
    arm_deadline(&deadline_ns, clock_base, limits);
    let mut fs = FsBudget::default();
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
    };
    let mut store = Store::new(engine, state);
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
    store
}

/// Adds WASI preview 1 with kiln's file quota in front of the calls that write or create
/// files, and the host door.
pub(crate) fn add_to_linker(linker: &mut Linker<GuestState>) -> wasmtime::Result<()> {
    wasmtime_wasi::p1::add_to_linker_async(linker, |state: &mut GuestState| &mut state.wasi)?;
    linker.allow_shadowing(true);
    shadow_writes(linker)?;
    shadow_creates(linker)?;
    linker.allow_shadowing(false);
    Ok(())
}

/// Runs `body` with the guest's memory and WASI context, as the generated bindings do.
macro_rules! with_memory {
    ($caller:ident, |$mem:ident, $state:ident| $body:expr) => {{
        use p1::WasiSnapshotPreview1 as _;
        let Some(wasmtime::Extern::Memory(memory)) = $caller.get_export("memory") else {
            return Err(wasmtime::format_err!("the guest exports no memory"));
        };
        let fuel = wasmtime::AsContextMut::as_context_mut(&mut $caller).hostcall_fuel();
        let (bytes, $state) = memory.data_and_store_mut(&mut $caller);
        $state.wasi.set_hostcall_fuel(fuel);
        let mut $mem = GuestMemory::Unshared(bytes);
        $body
    }};
}

fn iovec_total(bytes: &[u8], iovs: i32, count: i32) -> Option<u64> {
    let base = usize::try_from(iovs).ok()?;
    let count = usize::try_from(count).ok()?;
    if count > 1024 {
        return None;
    }
    let mut total = 0u64;
    for i in 0..count {
        let at = base.checked_add(i * 8 + 4)?;
        let len = bytes.get(at..at + 4)?;
        total += u64::from(u32::from_le_bytes(len.try_into().ok()?));
    }
    Some(total)
}

fn read_u32(bytes: &[u8], at: i32) -> Option<u32> {
    let at = usize::try_from(at).ok()?;
    Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

fn raw<'a>(mem: &'a GuestMemory<'_>) -> &'a [u8] {
    match mem {
        GuestMemory::Unshared(bytes) => bytes,
        GuestMemory::Shared(_) => &[],
    }
}

fn is_stdio(fd: i32) -> bool {
    (0..=2).contains(&fd)
}

fn shadow_writes(linker: &mut Linker<GuestState>) -> wasmtime::Result<()> {
    linker.func_wrap_async(
        "wasi_snapshot_preview1",
        "fd_write",
        |mut caller: Caller<'_, GuestState>, (fd, iovs, count, nwritten): (i32, i32, i32, i32)| {
            Box::new(async move {
                with_memory!(caller, |mem, state| {
                    if !is_stdio(fd) {
                        let want = iovec_total(raw(&mem), iovs, count).unwrap_or(0);
                        if want > state.fs.write_bytes_left {
                            return Ok(ERRNO_NOSPC);
                        }
                    }
                    let errno =
                        p1::fd_write(&mut state.wasi, &mut mem, fd, iovs, count, nwritten).await?;
                    if errno == 0 && !is_stdio(fd) {
                        let n = u64::from(read_u32(raw(&mem), nwritten).unwrap_or(0));
                        state.fs.write_bytes_left = state.fs.write_bytes_left.saturating_sub(n);
                        state
                            .memory
                            .stats
                            .fs_written_bytes
                            .fetch_add(n, Ordering::Relaxed);
                    }
                    Ok(errno)
                })
            })
        },
    )?;
    linker.func_wrap_async(
        "wasi_snapshot_preview1",
        "fd_pwrite",
        |mut caller: Caller<'_, GuestState>,
         (fd, iovs, count, offset, nwritten): (i32, i32, i32, i64, i32)| {
            Box::new(async move {
                with_memory!(caller, |mem, state| {
                    let want = iovec_total(raw(&mem), iovs, count).unwrap_or(0);
                    if want > state.fs.write_bytes_left {
                        return Ok(ERRNO_NOSPC);
                    }
                    let errno =
                        p1::fd_pwrite(&mut state.wasi, &mut mem, fd, iovs, count, offset, nwritten)
                            .await?;
                    if errno == 0 {
                        let n = u64::from(read_u32(raw(&mem), nwritten).unwrap_or(0));
                        state.fs.write_bytes_left = state.fs.write_bytes_left.saturating_sub(n);
                        state
                            .memory
                            .stats
                            .fs_written_bytes
                            .fetch_add(n, Ordering::Relaxed);
                    }
                    Ok(errno)
                })
            })
        },
    )?;
    linker.func_wrap_async(
        "wasi_snapshot_preview1",
        "fd_filestat_set_size",
        |mut caller: Caller<'_, GuestState>, (fd, size): (i32, i64)| {
            Box::new(async move {
                with_memory!(caller, |mem, state| {
                    // Growing a file by truncation costs no bytes written but may cost disk:
                    // a size beyond what is left to write is refused.
                    if u64::try_from(size).unwrap_or(u64::MAX) > state.fs.write_bytes_left {
                        return Ok(ERRNO_NOSPC);
                    }
                    p1::fd_filestat_set_size(&mut state.wasi, &mut mem, fd, size).await
                })
            })
        },
    )?;
    linker.func_wrap_async(
        "wasi_snapshot_preview1",
        "fd_renumber",
        |mut caller: Caller<'_, GuestState>, (from, to): (i32, i32)| {
            Box::new(async move {
                with_memory!(caller, |mem, state| {
                    // A file moved onto stdout would escape the quota's accounting.
                    if is_stdio(to) || is_stdio(from) {
                        return Ok(ERRNO_BADF);
                    }
                    p1::fd_renumber(&mut state.wasi, &mut mem, from, to).await
                })
            })
        },
    )?;
    Ok(())
}

fn take_create(state: &mut GuestState) -> bool {
    if state.fs.creates_left == 0 {
        return false;
    }
    state.fs.creates_left -= 1;
    true
}

fn shadow_creates(linker: &mut Linker<GuestState>) -> wasmtime::Result<()> {
    linker.func_wrap_async(
        "wasi_snapshot_preview1",
        "path_open",
        |mut caller: Caller<'_, GuestState>,
         (dirfd, dirflags, path, path_len, oflags, base, inheriting, fdflags, opened): (
            i32,
            i32,
            i32,
            i32,
            i32,
            i64,
            i64,
            i32,
            i32,
        )| {
            Box::new(async move {
                with_memory!(caller, |mem, state| {
                    if oflags & OFLAGS_CREAT != 0 {
                        let exists = path_exists(state, &mut mem, dirfd, path, path_len).await;
                        if !exists && !take_create(state) {
                            return Ok(ERRNO_NOSPC);
                        }
                    }
                    p1::path_open(
                        &mut state.wasi,
                        &mut mem,
                        dirfd,
                        dirflags,
                        path,
                        path_len,
                        oflags,
                        base,
                        inheriting,
                        fdflags,
                        opened,
                    )
                    .await
                })
            })
        },
    )?;
    linker.func_wrap_async(
        "wasi_snapshot_preview1",
        "path_create_directory",
        |mut caller: Caller<'_, GuestState>, (dirfd, path, path_len): (i32, i32, i32)| {
            Box::new(async move {
                with_memory!(caller, |mem, state| {
                    if !take_create(state) {
                        return Ok(ERRNO_NOSPC);
                    }
                    p1::path_create_directory(&mut state.wasi, &mut mem, dirfd, path, path_len)
                        .await
                })
            })
        },
    )?;
    linker.func_wrap_async(
        "wasi_snapshot_preview1",
        "path_symlink",
        |mut caller: Caller<'_, GuestState>,
         (old, old_len, dirfd, new, new_len): (i32, i32, i32, i32, i32)| {
            Box::new(async move {
                with_memory!(caller, |mem, state| {
                    if !take_create(state) {
                        return Ok(ERRNO_NOSPC);
                    }
                    p1::path_symlink(&mut state.wasi, &mut mem, old, old_len, dirfd, new, new_len)
                        .await
                })
            })
        },
    )?;
    linker.func_wrap_async(
        "wasi_snapshot_preview1",
        "path_link",
        |mut caller: Caller<'_, GuestState>,
         (old_fd, flags, old, old_len, new_fd, new, new_len): (
            i32,
            i32,
            i32,
            i32,
            i32,
            i32,
            i32,
        )| {
            Box::new(async move {
                with_memory!(caller, |mem, state| {
                    if !take_create(state) {
                        return Ok(ERRNO_NOSPC);
                    }
                    p1::path_link(
                        &mut state.wasi,
                        &mut mem,
                        old_fd,
                        flags,
                        old,
                        old_len,
                        new_fd,
                        new,
                        new_len,
                    )
                    .await
                })
            })
        },
    )?;
    Ok(())
}

async fn path_exists(
    state: &mut GuestState,
    mem: &mut GuestMemory<'_>,
    dirfd: i32,
    path: i32,
    path_len: i32,
) -> bool {
    use p1::WasiSnapshotPreview1 as _;
    let (Ok(dirfd), Ok(path), Ok(path_len)) = (
        u32::try_from(dirfd),
        u32::try_from(path),
        u32::try_from(path_len),
    ) else {
        return false;
    };
    state
        .wasi
        .path_filestat_get(
            mem,
            dirfd.into(),
            wasmtime_wasi::p1::types::Lookupflags::empty(),
            GuestPtr::new((path, path_len)),
        )
        .await
        .is_ok()
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
        CallEnd::Trapped(_) if memory_hit => (Outcome::MemoryLimit, -1),
        CallEnd::Trapped(trap) => (Outcome::Crashed { trap: trap.clone() }, -1),
    };
    (outcome, exit_code)
}

/// Defines `host::call`, the door through which a guest asks the host for a granted
/// capability. No capability is granted yet: every call answers -1 ("no host").
pub(crate) fn add_door(linker: &mut Linker<GuestState>) -> wasmtime::Result<()> {
    linker.func_wrap(
        "host",
        "call",
        |_caller: Caller<'_, GuestState>,
         _ptr: i32,
         _len: i32,
         _out_ptr: i32,
         _out_len: i32|
         -> i32 { -1 },
    )?;
    Ok(())
}

/// Appends the request's own grants: its workspace at `/workspace`, then its mounts.
pub(crate) fn push_grants<'a>(request: &'a ExecRequest, preopens: &mut Vec<Preopen<'a>>) {
    if let Some(workspace) = &request.workspace {
        preopens.push(Preopen {
            host: workspace,
            guest: WORKSPACE_GUEST,
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
    }
}

/// The folder under which an engine makes each guest's private `/tmp` (one `mkdir` per
/// guest, no random names), removed with the engine.
#[derive(Debug)]
pub(crate) struct TmpRoot {
    root: tempfile::TempDir,
    next: AtomicU64,
}

impl TmpRoot {
    pub fn new() -> std::io::Result<TmpRoot> {
        Ok(TmpRoot {
            root: tempfile::Builder::new().prefix("kiln-tmp-").tempdir()?,
            next: AtomicU64::new(0),
        })
    }

    /// A new, empty folder only this guest sees, removed on drop.
    pub fn private(&self) -> std::io::Result<PrivateTmp> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let path = self.root.path().join(n.to_string());
        std::fs::create_dir(&path)?;
        Ok(PrivateTmp { path })
    }
}

/// A guest's private `/tmp` on the host.
#[derive(Debug)]
pub(crate) struct PrivateTmp {
    path: std::path::PathBuf,
}

impl PrivateTmp {
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for PrivateTmp {
    fn drop(&mut self) {
        // Most guests leave /tmp empty: one rmdir; otherwise remove what they left.
        if std::fs::remove_dir(&self.path).is_err() {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iovec_total_sums_lengths_and_rejects_out_of_range() {
        let mut bytes = vec![0u8; 32];
        bytes[4..8].copy_from_slice(&5u32.to_le_bytes());
        bytes[12..16].copy_from_slice(&7u32.to_le_bytes());
        assert_eq!(iovec_total(&bytes, 0, 2), Some(12));
        assert_eq!(iovec_total(&bytes, 28, 2), None);
        assert_eq!(iovec_total(&bytes, -4, 1), None);
        assert_eq!(iovec_total(&bytes, 0, 5000), None);
    }

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
