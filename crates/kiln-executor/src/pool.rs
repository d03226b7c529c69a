//! The parent side: a pool of worker processes.
//!
//! **Placement.** A one-shot goes to the responsive worker with the fewest requests in flight
//! (then the least session memory); a session to the one with the least session memory
//! pinned (then the fewest sessions, then requests in flight). Each worker takes at most
//! [`PoolConfig::session_slots`] sessions, so guest slots are always left for one-shots. A
//! session stays on the worker that opened it, and so does a fork of it.
//!
//! **Liveness.** The pool pings every worker every [`HEARTBEAT`]. A worker that has not
//! answered for [`PoolConfig::stall_after`] gets no new work while another one answers; one
//! silent for [`PoolConfig::kill_after`] is killed and replaced. The pool enforces every
//! execution's deadline itself: an execution still unanswered [`PoolConfig::grace`] after its
//! deadline answers as timed out, and its worker is killed and replaced.
//!
//! **Memory.** A worker with no sessions and nothing in flight for
//! [`PoolConfig::recycle_idle`] is replaced by a fresh one when its anonymous resident memory
//! is more than [`PoolConfig::recycle_slack_bytes`] above what it had when it started (guest
//! memory slots keep pages resident for speed; a burst leaves many), or its whole resident
//! memory more than a quarter (and 16 MiB) above what it had once warm, after its first
//! answer (sessions that imported pandas leave ~60 MiB of the compiled module's pages mapped
//! in each worker: clean and shared, but what `ps` and an operator see).
//!
//! A worker that dies (crash, abort, `kill -9`) fails exactly the requests and sessions it
//! held, and its slot gets a fresh one.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use kiln_core::backend::Door;
use kiln_core::{ExecRequest, ExecResult, Language, Limits, Outcome};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::process::Command;
use tokio::sync::{mpsc, oneshot};

use crate::protocol::{Op, RemoteError, Reply, Request, Response, Share, encode, read_frame};

/// How often the pool pings each worker and checks its health.
pub const HEARTBEAT: Duration = Duration::from_millis(250);

/// How to start workers.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Number of worker processes. Default: the number of CPUs.
    pub workers: usize,
    /// The program to run (normally the `kiln` binary itself).
    pub program: PathBuf,
    /// Its arguments (normally `["__worker"]`).
    pub args: Vec<OsString>,
    /// The only environment variables a worker gets.
    pub env: Vec<(OsString, OsString)>,
    /// The folders a worker may write (it confines itself: see [`crate::confine`]);
    /// everything else is read-only to it. Default: the temporary folder. Add the folders
    /// of every workspace and mount its guests are granted.
    pub writable: Vec<PathBuf>,
    /// Sessions one worker holds at most. Default 900 of a worker's 1 000 guest slots: the
    /// rest stay free for one-shots.
    pub session_slots: usize,
    /// How long past an execution's deadline the pool waits for its answer before it kills
    /// the worker. Default 1 s.
    pub grace: Duration,
    /// A worker silent this long gets no new work while another answers. Default 400 ms:
    /// one heartbeat missed by more than 150 ms.
    pub stall_after: Duration,
    /// A worker silent this long is killed and replaced. Default 10 s.
    pub kill_after: Duration,
    /// How long a worker must be idle before it may be recycled for its memory. Default 10 s.
    pub recycle_idle: Duration,
    /// Anonymous resident memory an idle worker may hold above its starting figure before it
    /// is recycled. Default 24 MiB.
    pub recycle_slack_bytes: u64,
    /// Serve workers as tasks in this process instead of starting `program` (tests: see
    /// `kiln_executor::fake::pool_config`). `None`: worker processes.
    pub in_process: Option<InProcess>,
    /// Work done in this process before a one-shot is sent to a worker, outside its
    /// deadline: kiln's binary compiles a runtime variant the request needs and the cache
    /// lacks (the fuel variant: about 90 CPU-seconds, once), which a worker would otherwise
    /// do inside the request's deadline. `None`: nothing.
    pub before_send: Option<BeforeSend>,
}

/// Answers the work to do before `request` is sent, or `None` (the common case: nothing,
/// and nothing allocated).
#[derive(Clone)]
pub struct BeforeSend(pub Arc<WorkFor>);

/// What [`BeforeSend`] holds: the work a request needs first, if any.
pub type WorkFor = dyn Fn(&ExecRequest) -> Option<BoxFuture> + Send + Sync;

impl std::fmt::Debug for BeforeSend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BeforeSend(..)")
    }
}

/// Serves one worker in this process over the in-memory pipe it is given: requests arrive
/// on it and replies go back on it, framed as over a worker process's stdin and stdout.
#[derive(Clone)]
pub struct InProcess(pub Arc<dyn Fn(tokio::io::DuplexStream) -> BoxFuture + Send + Sync>);

/// A worker's serving loop, boxed.
pub type BoxFuture = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

impl std::fmt::Debug for InProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("InProcess(..)")
    }
}

impl PoolConfig {
    /// A configuration with kiln's defaults for `program` and `args`.
    pub fn new(program: PathBuf, args: Vec<OsString>) -> PoolConfig {
        PoolConfig {
            workers: std::thread::available_parallelism().map_or(2, |n| n.get()),
            program,
            args,
            env: Vec::new(),
            writable: vec![std::env::temp_dir()],
            session_slots: 900,
            grace: Duration::from_secs(1),
            stall_after: HEARTBEAT + Duration::from_millis(150),
            kill_after: Duration::from_secs(10),
            recycle_idle: Duration::from_secs(10),
            recycle_slack_bytes: 24 << 20,
            in_process: None,
            before_send: None,
        }
    }

    /// Workers that run this very binary with `__worker`, one per CPU, with only
    /// `KILN_CACHE_DIR`, `PATH`, `HOME`, `KILN_LOG`, `KILN_LOG_FORMAT`, `TMPDIR`,
    /// `KILN_WORKER_THREADS`, `KILN_PRIMED` and `KILN_WORKER_JAIL` passed through.
    pub fn current_exe() -> std::io::Result<PoolConfig> {
        let env = [
            "KILN_CACHE_DIR",
            "PATH",
            "HOME",
            "KILN_LOG",
            "KILN_LOG_FORMAT",
            "TMPDIR",
            "KILN_WORKER_THREADS",
            "KILN_PRIMED",
            crate::confine::JAIL_ENV,
        ]
        .iter()
        .filter_map(|name| std::env::var_os(name).map(|v| (OsString::from(name), v)))
        .collect();
        Ok(PoolConfig {
            env,
            ..PoolConfig::new(std::env::current_exe()?, vec!["__worker".into()])
        })
    }
}

/// A pool request failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// The worker could not be started.
    #[error("could not start an executor worker: {0}")]
    Spawn(String),
    /// The worker died while holding the request; it has been replaced.
    #[error("the executor worker died during the execution ({0}); it has been replaced")]
    WorkerLost(String),
    /// The worker refused or failed the request.
    #[error("{}", .0.message)]
    Remote(RemoteError),
    /// The worker died before the one-shot started (the pool runs it elsewhere; callers
    /// see this only when no worker took it).
    #[error("the executor worker died before the execution started; it has been replaced")]
    NotStarted,
    /// The request cannot be sent to a worker: it is too large.
    #[error("the request is too large to send to a worker: {0}")]
    TooLarge(String),
    /// The session is unknown (closed, or lost with its worker).
    #[error("no such session: {0}")]
    NoSuchSession(u64),
    /// Every worker holds as many sessions as it may.
    #[error(
        "every executor worker holds its most sessions ({per_worker} each); close some sessions and retry"
    )]
    SessionsFull { per_worker: usize },
}

/// A piece of output streamed from a running execution.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    /// stdout, stderr, or a rich result (JSON of a [`kiln_core::RichResult`]).
    pub stream: kiln_core::backend::StreamKind,
    pub data: Vec<u8>,
}

/// Extras for one call: a listener for output as it is written, a cancel signal (send
/// `()` to stop the execution; it then fails with `Remote` kind `cancelled`), a door
/// granted to a session turn for that turn alone (see [`Door`]), and whose work
/// it is (for the worker's fair sharing of CPU between tenants).
#[derive(Default)]
pub struct CallOptions {
    pub chunks: Option<mpsc::UnboundedSender<Chunk>>,
    pub cancel: Option<oneshot::Receiver<()>>,
    pub door: Option<Door>,
    pub share: Option<Share>,
}

impl CallOptions {
    /// Options that only say whose work the call is.
    pub fn for_tenant(tenant: &str, weight: u32) -> CallOptions {
        CallOptions {
            share: Some(Share {
                tenant: tenant.to_string(),
                weight,
            }),
            ..CallOptions::default()
        }
    }
}

impl std::fmt::Debug for CallOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallOptions")
            .field("chunks", &self.chunks.is_some())
            .field("cancel", &self.cancel.is_some())
            .field("door", &self.door.is_some())
            .field("share", &self.share)
            .finish()
    }
}

struct Waiter {
    done: oneshot::Sender<Result<Reply, PoolError>>,
    chunks: Option<mpsc::UnboundedSender<Chunk>>,
    door: Option<Door>,
    /// A one-shot, which may run elsewhere if its worker dies before it starts.
    movable: bool,
    /// The worker said it started (`Reply::Started`).
    started: bool,
}

type Pending = Arc<Mutex<HashMap<u64, Waiter>>>;

struct Worker {
    generation: u64,
    tx: mpsc::UnboundedSender<Vec<u8>>,
    pending: Pending,
    alive: Arc<AtomicBool>,
    in_flight: AtomicUsize,
    /// Open sessions and their memory: the cap until a turn says what it really holds.
    sessions: Mutex<HashMap<u64, u64>>,
    session_memory: AtomicU64,
    pid: Option<u32>,
    /// An in-process worker's task.
    task: Option<tokio::task::AbortHandle>,
    /// When the worker last sent anything (ms since the pool's epoch).
    last_heard_ms: Arc<AtomicU64>,
    /// When it last became idle (no sessions, nothing in flight), ms since the epoch;
    /// `u64::MAX` while busy.
    idle_since_ms: AtomicU64,
    /// Anonymous resident memory at its first answer; 0 until then.
    base_anon: AtomicU64,
    /// Resident memory once warm (idle after its first answered request); 0 until then.
    warm_rss: AtomicU64,
    /// Requests it answered (or that ended on it).
    served: AtomicU64,
    /// Its temporary folder (removed when it exits).
    tmp: PathBuf,
}

impl Worker {
    fn lock_sessions(&self) -> std::sync::MutexGuard<'_, HashMap<u64, u64>> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn session_count(&self) -> usize {
        self.lock_sessions().len()
    }

    fn add_session(&self, id: u64, memory: u64) {
        self.lock_sessions().insert(id, memory);
        self.session_memory.fetch_add(memory, Ordering::Relaxed);
    }

    fn set_session_memory(&self, id: u64, bytes: u64) {
        if let Some(memory) = self.lock_sessions().get_mut(&id) {
            let before = std::mem::replace(memory, bytes);
            self.session_memory.fetch_add(bytes, Ordering::Relaxed);
            self.session_memory.fetch_sub(before, Ordering::Relaxed);
        }
    }

    fn remove_session(&self, id: u64) {
        if let Some(memory) = self.lock_sessions().remove(&id) {
            self.session_memory.fetch_sub(memory, Ordering::Relaxed);
        }
    }

    fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Relaxed)
    }

    /// Stops the worker: it takes no new work and its process is killed (its reader then
    /// fails whatever it still held).
    fn kill(&self) {
        self.alive.store(false, Ordering::Relaxed);
        if let Some(task) = &self.task {
            task.abort();
        }
        if let Some(pid) = self.pid {
            // SAFETY: kill(2) on our own child's pid; the reader task reaps it, so the pid
            // cannot have been reused while the child's `Child` handle is alive.
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGKILL);
            }
        }
    }
}

struct Slot {
    worker: Mutex<Option<Arc<Worker>>>,
}

/// Where a session lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionHandle {
    pub id: u64,
    pub language: Language,
    slot: usize,
    generation: u64,
}

struct Inner {
    config: PoolConfig,
    slots: Vec<Slot>,
    next_id: AtomicU64,
    generations: AtomicU64,
    epoch: Instant,
    watching: AtomicBool,
}

/// A pool of executor worker processes.
pub struct ExecutorPool {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ExecutorPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecutorPool")
            .field("workers", &self.inner.config.workers)
            .finish_non_exhaustive()
    }
}

/// What `call` failed with.
enum CallError {
    /// The request never reached the worker (it had just exited), or reached it and its
    /// worker died before it started: its op, to send elsewhere.
    NotSent(Box<Op>),
    Failed(PoolError),
}

impl From<PoolError> for CallError {
    fn from(error: PoolError) -> CallError {
        CallError::Failed(error)
    }
}

/// How placement weighs a worker.
#[derive(Clone, Copy)]
enum Placing {
    OneShot,
    Session,
}

impl ExecutorPool {
    /// A pool; workers start on first use. Folders left by the workers of a pool whose
    /// process is gone (a server killed with `kill -9`) are removed.
    pub fn new(config: PoolConfig) -> ExecutorPool {
        sweep_stale_worker_folders();
        let slots = (0..config.workers.max(1))
            .map(|_| Slot {
                worker: Mutex::new(None),
            })
            .collect();
        ExecutorPool {
            inner: Arc::new(Inner {
                config,
                slots,
                next_id: AtomicU64::new(1),
                generations: AtomicU64::new(1),
                epoch: Instant::now(),
                watching: AtomicBool::new(false),
            }),
        }
    }

    /// Starts every worker now rather than on first use.
    pub fn start_all(&self) -> Result<(), PoolError> {
        for slot in 0..self.inner.slots.len() {
            self.inner.worker(slot)?;
        }
        Ok(())
    }

    /// Process ids of the live workers.
    pub fn worker_pids(&self) -> Vec<u32> {
        self.inner
            .live_workers()
            .into_iter()
            .filter_map(|w| w.pid)
            .collect()
    }

    /// Runs a one-shot execution on the least loaded worker.
    pub async fn execute(&self, request: ExecRequest) -> Result<ExecResult, PoolError> {
        self.execute_with(request, CallOptions::default()).await
    }

    /// Like [`ExecutorPool::execute`], with streamed output and/or a cancel signal.
    pub async fn execute_with(
        &self,
        request: ExecRequest,
        mut options: CallOptions,
    ) -> Result<ExecResult, PoolError> {
        let inner = &self.inner;
        if let Some(work) = inner
            .config
            .before_send
            .as_ref()
            .and_then(|f| (f.0)(&request))
        {
            work.await;
        }
        let deadline = Duration::from_millis(request.limits.timeout_ms);
        let mut op = Op::Exec(request);
        // A worker that exited between being chosen and being sent to, or that died before
        // the one-shot started, leaves it to another: as many tries as workers, and one.
        let tries = inner.slots.len() + 1;
        for attempt in 0.. {
            let worker = inner.worker(inner.pick(Placing::OneShot)?)?;
            match inner.call(&worker, op, &mut options, Some(deadline)).await {
                Ok(Reply::Done(result)) => return Ok(result),
                Ok(Reply::Failed(error)) => return Err(PoolError::Remote(error)),
                Ok(other) => return Err(unexpected(&other)),
                Err(CallError::Failed(error)) => return Err(error),
                Err(CallError::NotSent(back)) if attempt + 1 < tries => op = *back,
                Err(CallError::NotSent(_)) => return Err(PoolError::NotStarted),
            }
        }
        unreachable!("the loop returns")
    }

    /// Opens a session on the worker with the least session memory. `request.code` is
    /// ignored.
    pub async fn open_session(&self, request: ExecRequest) -> Result<SessionHandle, PoolError> {
        self.open_session_with(request, CallOptions::default())
            .await
    }

    /// Like [`ExecutorPool::open_session`], saying whose session it is.
    pub async fn open_session_with(
        &self,
        request: ExecRequest,
        mut options: CallOptions,
    ) -> Result<SessionHandle, PoolError> {
        let inner = &self.inner;
        let language = request.language;
        let memory = request.limits.memory_bytes;
        for attempt in 0..2 {
            let slot = inner.pick(Placing::Session)?;
            let worker = inner.worker(slot)?;
            let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
            // Counted before it opens, so concurrent opens spread out.
            worker.add_session(id, memory);
            let op = Op::OpenSession {
                session: id,
                request: request.clone(),
            };
            let answer = inner.call(&worker, op, &mut options, None).await;
            if !matches!(answer, Ok(Reply::Opened)) {
                worker.remove_session(id);
            }
            match answer {
                Ok(Reply::Opened) => {
                    return Ok(SessionHandle {
                        id,
                        language,
                        slot,
                        generation: worker.generation,
                    });
                }
                Ok(Reply::Failed(error)) => return Err(PoolError::Remote(error)),
                Ok(other) => return Err(unexpected(&other)),
                Err(CallError::Failed(error)) => return Err(error),
                Err(CallError::NotSent(_)) if attempt == 0 => continue,
                Err(CallError::NotSent(_)) => break,
            }
        }
        Err(PoolError::WorkerLost(
            "the worker had already exited".into(),
        ))
    }

    /// Opens a session that starts as a copy of `parent` (its variables and imports; see
    /// [`kiln_core::backend::Backend::fork_session`]) with the grants and limits of
    /// `request` (its code is ignored). The copy lives on the parent's worker, where its
    /// state is: it counts against that worker's [`PoolConfig::session_slots`]. A turn of
    /// the parent that runs meanwhile ends before the copy is made.
    pub async fn fork_session_with(
        &self,
        parent: &SessionHandle,
        request: ExecRequest,
        mut options: CallOptions,
    ) -> Result<SessionHandle, PoolError> {
        let inner = &self.inner;
        let worker = inner.session_worker(parent)?;
        if worker.session_count() >= inner.config.session_slots {
            return Err(PoolError::SessionsFull {
                per_worker: inner.config.session_slots,
            });
        }
        let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
        worker.add_session(id, request.limits.memory_bytes);
        let op = Op::ForkSession {
            parent: parent.id,
            session: id,
            request,
        };
        let answer = inner.call(&worker, op, &mut options, None).await;
        if !matches!(answer, Ok(Reply::Opened)) {
            worker.remove_session(id);
        }
        match answer {
            Ok(Reply::Opened) => Ok(SessionHandle {
                id,
                language: parent.language,
                slot: parent.slot,
                generation: worker.generation,
            }),
            Ok(Reply::Failed(error)) if error.kind == "no_such_session" => {
                worker.remove_session(parent.id);
                Err(PoolError::NoSuchSession(parent.id))
            }
            Ok(Reply::Failed(error)) => Err(PoolError::Remote(error)),
            Ok(other) => Err(unexpected(&other)),
            Err(CallError::Failed(error)) => Err(error),
            Err(CallError::NotSent(_)) => Err(PoolError::WorkerLost(format!(
                "session {} was lost with its worker",
                parent.id
            ))),
        }
    }

    /// Runs a turn in a session.
    pub async fn run(
        &self,
        session: &SessionHandle,
        code: String,
        limits: Limits,
    ) -> Result<ExecResult, PoolError> {
        self.run_with(session, code, limits, CallOptions::default())
            .await
    }

    /// Like [`ExecutorPool::run`], with streamed output and/or a cancel signal. A cancelled
    /// turn ends its session.
    pub async fn run_with(
        &self,
        session: &SessionHandle,
        code: String,
        limits: Limits,
        mut options: CallOptions,
    ) -> Result<ExecResult, PoolError> {
        let inner = &self.inner;
        let worker = inner.session_worker(session)?;
        let deadline = Duration::from_millis(limits.timeout_ms);
        let op = Op::Turn {
            session: session.id,
            code,
            limits,
            door: options.door.is_some(),
        };
        let answer = inner.call(&worker, op, &mut options, Some(deadline)).await;
        match answer {
            Ok(Reply::Done(result)) => {
                // Placement weighs what sessions really hold once that is known.
                if let Some(bytes) = result.session_memory_bytes {
                    worker.set_session_memory(session.id, bytes);
                }
                Ok(result)
            }
            Ok(Reply::Failed(error)) if error.kind == "no_such_session" => {
                worker.remove_session(session.id);
                Err(PoolError::NoSuchSession(session.id))
            }
            Ok(Reply::Failed(error)) => {
                if error.kind == "cancelled" {
                    // The worker ended the session with its turn.
                    worker.remove_session(session.id);
                }
                Err(PoolError::Remote(error))
            }
            Ok(other) => Err(unexpected(&other)),
            Err(CallError::Failed(error)) => Err(error),
            Err(CallError::NotSent(_)) => Err(PoolError::WorkerLost(format!(
                "session {} was lost with its worker",
                session.id
            ))),
        }
    }

    /// Closes a session (a session lost with its worker is already closed).
    pub async fn close_session(&self, session: &SessionHandle) -> Result<(), PoolError> {
        let inner = &self.inner;
        let Ok(worker) = inner.session_worker(session) else {
            return Ok(());
        };
        let op = Op::CloseSession {
            session: session.id,
        };
        let answer = inner
            .call(&worker, op, &mut CallOptions::default(), None)
            .await;
        worker.remove_session(session.id);
        match answer {
            Ok(Reply::Closed) => Ok(()),
            Ok(Reply::Failed(error)) => Err(PoolError::Remote(error)),
            Ok(other) => Err(unexpected(&other)),
            Err(CallError::Failed(error)) => Err(error),
            Err(CallError::NotSent(_)) => Ok(()),
        }
    }

    /// Per live worker: sessions, their memory caps, requests in flight (for metrics and
    /// tests).
    pub fn worker_loads(&self) -> Vec<WorkerLoad> {
        self.inner
            .live_workers()
            .into_iter()
            .map(|w| WorkerLoad {
                pid: w.pid,
                sessions: w.session_count(),
                session_memory_bytes: w.session_memory.load(Ordering::Relaxed),
                in_flight: w.in_flight.load(Ordering::Relaxed),
                responsive: self.inner.responsive(&w),
            })
            .collect()
    }
}

/// One worker's load, as placement sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerLoad {
    pub pid: Option<u32>,
    pub sessions: usize,
    pub session_memory_bytes: u64,
    pub in_flight: usize,
    pub responsive: bool,
}

impl Inner {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn live_workers(&self) -> Vec<Arc<Worker>> {
        self.slots
            .iter()
            .filter_map(|s| {
                let guard = s.worker.lock().unwrap_or_else(|e| e.into_inner());
                guard.as_ref().filter(|w| w.is_alive()).cloned()
            })
            .collect()
    }

    fn responsive(&self, worker: &Worker) -> bool {
        let silent = self
            .now_ms()
            .saturating_sub(worker.last_heard_ms.load(Ordering::Relaxed));
        u128::from(silent) < self.config.stall_after.as_millis()
    }

    /// The slot for new work: never first-fit, always by load; workers that stopped
    /// answering last.
    fn pick(&self, placing: Placing) -> Result<usize, PoolError> {
        let mut best: Option<(usize, (bool, u64, u64, u64))> = None;
        for (i, slot) in self.slots.iter().enumerate() {
            let worker = slot
                .worker
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
                .filter(|w| w.is_alive());
            // A slot without a live worker gets a fresh one: empty and responsive.
            let (stalled, sessions, memory, in_flight) = match &worker {
                Some(w) => (
                    !self.responsive(w),
                    w.session_count(),
                    w.session_memory.load(Ordering::Relaxed),
                    w.in_flight.load(Ordering::Relaxed) as u64,
                ),
                None => (false, 0, 0, 0),
            };
            let key = match placing {
                Placing::OneShot => (stalled, in_flight, memory, sessions as u64),
                Placing::Session => {
                    if sessions >= self.config.session_slots {
                        continue;
                    }
                    (stalled, memory, sessions as u64, in_flight)
                }
            };
            if best.is_none_or(|(_, b)| key < b) {
                best = Some((i, key));
            }
        }
        best.map(|(i, _)| i).ok_or(PoolError::SessionsFull {
            per_worker: self.config.session_slots,
        })
    }

    fn worker(self: &Arc<Self>, slot: usize) -> Result<Arc<Worker>, PoolError> {
        let mut guard = self.slots[slot]
            .worker
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(worker) = guard.as_ref()
            && worker.is_alive()
        {
            return Ok(worker.clone());
        }
        let generation = self.generations.fetch_add(1, Ordering::Relaxed);
        let worker = Arc::new(self.spawn(generation)?);
        *guard = Some(worker.clone());
        drop(guard);
        if !self.watching.swap(true, Ordering::Relaxed) {
            tokio::spawn(watch(Arc::downgrade(self)));
        }
        Ok(worker)
    }

    fn session_worker(&self, session: &SessionHandle) -> Result<Arc<Worker>, PoolError> {
        let guard = self
            .slots
            .get(session.slot)
            .ok_or(PoolError::NoSuchSession(session.id))?
            .worker
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match guard.as_ref() {
            Some(worker) if worker.generation == session.generation && worker.is_alive() => {
                Ok(worker.clone())
            }
            _ => Err(PoolError::WorkerLost(format!(
                "session {} was lost with its worker",
                session.id
            ))),
        }
    }

    fn spawn(&self, generation: u64) -> Result<Worker, PoolError> {
        // The worker's temporary folder (guests' private /tmp folders live in it) is the
        // pool's to remove once the worker has exited, however it ended.
        let tmp = std::env::temp_dir().join(format!(
            "kiln-worker-{}-{generation}-{}",
            std::process::id(),
            self.epoch.elapsed().as_nanos()
        ));
        std::fs::create_dir(&tmp).map_err(|e| {
            PoolError::Spawn(format!(
                "creating the worker's folder {}: {e}",
                tmp.display()
            ))
        })?;
        let started = match &self.config.in_process {
            Some(serve) => Ok(start_in_process(serve)),
            None => self.start_process(&tmp),
        };
        let Started {
            pid,
            task,
            stdin,
            stdout,
            exit,
        } = match started {
            Ok(started) => started,
            Err(e) => {
                let _ = kiln_workspace::remove_host_tree(&tmp);
                return Err(e);
            }
        };
        let (tx, rx) = mpsc::unbounded_channel::<Vec<u8>>();
        tokio::spawn(crate::protocol::write_batched(rx, stdin, Some));
        let worker = Worker {
            generation,
            tx,
            pending: Arc::default(),
            alive: Arc::new(AtomicBool::new(true)),
            in_flight: AtomicUsize::new(0),
            sessions: Mutex::default(),
            session_memory: AtomicU64::new(0),
            pid,
            task,
            last_heard_ms: Arc::new(AtomicU64::new(self.now_ms())),
            idle_since_ms: AtomicU64::new(self.now_ms()),
            base_anon: AtomicU64::new(0),
            warm_rss: AtomicU64::new(0),
            served: AtomicU64::new(0),
            tmp,
        };
        tokio::spawn(read_replies(
            ReplyReader {
                pending: worker.pending.clone(),
                alive: worker.alive.clone(),
                heard: worker.last_heard_ms.clone(),
                epoch: self.epoch,
                answers: worker.tx.clone(),
                tmp: worker.tmp.clone(),
            },
            stdout,
            exit,
        ));
        Ok(worker)
    }

    /// Starts a worker process.
    fn start_process(&self, tmp: &std::path::Path) -> Result<Started, PoolError> {
        let mut child = self
            .worker_command(tmp)
            .spawn()
            .map_err(|e| PoolError::Spawn(format!("{}: {e}", self.config.program.display())))?;
        let stdin = child.stdin.take().expect("stdin is piped");
        let stdout = child.stdout.take().expect("stdout is piped");
        Ok(Started {
            pid: child.id(),
            task: None,
            stdin: Box::new(stdin),
            stdout: Box::new(stdout),
            exit: Box::pin(async move {
                match child.wait().await {
                    Ok(status) => status.to_string(),
                    Err(e) => e.to_string(),
                }
            }),
        })
    }

    /// The worker process's command: a clean environment, its own TMPDIR, killed with the
    /// pool.
    fn worker_command(&self, tmp: &std::path::Path) -> Command {
        let mut command = Command::new(&self.config.program);
        command
            .args(&self.config.args)
            .env_clear()
            .envs(self.config.env.iter().cloned())
            .env("TMPDIR", tmp)
            .env(
                crate::confine::WRITABLE_ENV,
                serde_json::to_string(&self.config.writable).unwrap_or_default(),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        // SAFETY: prctl is async-signal-safe; it asks the kernel to kill the worker when the
        // parent dies, so no orphaned worker outlives the pool.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        command
    }

    /// Sends `op` to `worker` and waits for its answer. With `deadline` (an execution's
    /// timeout), an answer that has not come `grace` after it is given up on: the worker is
    /// killed and the execution answers as timed out.
    async fn call(
        &self,
        worker: &Worker,
        op: Op,
        options: &mut CallOptions,
        deadline: Option<Duration>,
    ) -> Result<Reply, CallError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let stream = options.chunks.is_some();
        let request = Request {
            id,
            op,
            stream,
            share: options.share.clone(),
        };
        let body = encode(&request).map_err(|e| PoolError::TooLarge(e.to_string()))?;
        let (tx, mut rx) = oneshot::channel();
        worker
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(
                id,
                Waiter {
                    done: tx,
                    chunks: options.chunks.clone(),
                    door: options.door.clone(),
                    movable: matches!(request.op, Op::Exec(_)),
                    started: false,
                },
            );
        if !worker.is_alive() || worker.tx.send(body).is_err() {
            worker
                .pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&id);
            return Err(CallError::NotSent(Box::new(request.op)));
        }
        let _busy = InFlight::enter(worker);
        let started = Instant::now();
        let closed = || Err(PoolError::WorkerLost("the worker channel closed".into()));
        let give_up = async {
            match deadline {
                Some(deadline) => tokio::time::sleep(deadline + self.config.grace).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(give_up);
        let mut cancel = options.cancel.take();
        let reply = loop {
            tokio::select! {
                reply = &mut rx => match reply {
                    // Its worker died before it began: it had no effect, and may run elsewhere.
                    Ok(Err(PoolError::NotStarted)) => return Err(CallError::NotSent(Box::new(request.op))),
                    reply => break reply.unwrap_or_else(|_| closed()),
                },
                Ok(()) = async { match cancel.as_mut() { Some(c) => c.await, None => std::future::pending().await } } => {
                    cancel = None;
                    if let Ok(frame) = encode(&Request { id: 0, op: Op::Cancel { target: id }, stream: false, share: None }) {
                        let _ = worker.tx.send(frame);
                    }
                }
                () = &mut give_up => {
                    tracing::warn!(
                        pid = worker.pid,
                        waited_ms = started.elapsed().as_millis() as u64,
                        "an execution overran its deadline by the grace period; killing its worker"
                    );
                    worker
                        .pending
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&id);
                    worker.kill();
                    break Ok(Reply::Done(overrun(started.elapsed(), self.config.grace)));
                }
            }
        };
        Ok(reply?)
    }
}

impl Drop for Inner {
    /// The pool goes (the server stops): its workers go with it, and their folders.
    fn drop(&mut self) {
        for slot in &self.slots {
            let worker = slot.worker.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(worker) = worker {
                worker.kill();
                let _ = kiln_workspace::remove_host_tree(&worker.tmp);
            }
        }
    }
}

/// Counts a request in flight on its worker for as long as it is held.
struct InFlight<'a>(&'a Worker);

impl<'a> InFlight<'a> {
    fn enter(worker: &'a Worker) -> InFlight<'a> {
        worker.in_flight.fetch_add(1, Ordering::Relaxed);
        worker.idle_since_ms.store(u64::MAX, Ordering::Relaxed);
        InFlight(worker)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.served.fetch_add(1, Ordering::Relaxed);
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The result of an execution whose worker did not answer in time.
fn overrun(waited: Duration, grace: Duration) -> ExecResult {
    ExecResult {
        stdout: Vec::new(),
        stderr: format!(
            "kiln: the execution did not end by its deadline (its worker did not answer within {} ms after it); the worker was stopped and replaced\n",
            grace.as_millis()
        )
        .into_bytes(),
        exit_code: -1,
        outcome: Outcome::TimedOut,
        stdout_truncated: false,
        stderr_truncated: false,
        duration_us: u64::try_from(waited.as_micros()).unwrap_or(u64::MAX),
        peak_memory_bytes: 0,
        fs_written_bytes: 0,
        fs_refused: false,
        files_changed: None,
        results: Vec::new(),
        session_memory_bytes: None,
    }
}

/// A started worker: its pipes and how to learn how it ended.
struct Started {
    pid: Option<u32>,
    task: Option<tokio::task::AbortHandle>,
    stdin: Box<dyn AsyncWrite + Unpin + Send>,
    stdout: Box<dyn AsyncRead + Unpin + Send>,
    exit: std::pin::Pin<Box<dyn std::future::Future<Output = String> + Send>>,
}

/// Starts a worker as a task of this process, over an in-memory pipe.
fn start_in_process(serve: &InProcess) -> Started {
    let (ours, theirs) = tokio::io::duplex(1 << 20);
    let task = tokio::spawn((serve.0)(theirs));
    let abort = task.abort_handle();
    let (stdout, stdin) = tokio::io::split(ours);
    Started {
        pid: None,
        task: Some(abort),
        stdin: Box::new(stdin),
        stdout: Box::new(stdout),
        exit: Box::pin(async move {
            match task.await {
                Ok(()) => "the in-process worker ended".to_string(),
                Err(e) if e.is_cancelled() => "signal: 9 (SIGKILL)".to_string(),
                Err(e) => format!("the in-process worker panicked: {e}"),
            }
        }),
    }
}

/// What the task reading one worker's replies shares with the pool.
struct ReplyReader {
    pending: Pending,
    alive: Arc<AtomicBool>,
    heard: Arc<AtomicU64>,
    epoch: Instant,
    answers: mpsc::UnboundedSender<Vec<u8>>,
    tmp: PathBuf,
}

/// Hands each reply of a worker to whoever waits for it, until the worker's stdout closes;
/// then fails every request it still held and removes its temporary folder.
async fn read_replies(
    reader: ReplyReader,
    stdout: Box<dyn AsyncRead + Unpin + Send>,
    exit: std::pin::Pin<Box<dyn std::future::Future<Output = String> + Send>>,
) {
    // Buffered: a frame's length and body, and frames written together, in one read.
    let mut stdout = tokio::io::BufReader::with_capacity(64 << 10, stdout);
    while let Ok(response) = read_frame::<_, Response>(&mut stdout).await {
        reader.heard.store(
            u64::try_from(reader.epoch.elapsed().as_millis()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        let mut pending = reader.pending.lock().unwrap_or_else(|e| e.into_inner());
        match response.reply {
            Reply::Pong => {}
            Reply::Started => {
                if let Some(waiter) = pending.get_mut(&response.id) {
                    waiter.started = true;
                }
            }
            Reply::Door { call, data } => {
                let door = pending.get(&response.id).and_then(|w| w.door.clone());
                answer_door(door, response.id, call, data, reader.answers.clone());
            }
            Reply::Chunk { stream, data } => {
                if let Some(listener) = pending.get(&response.id).and_then(|w| w.chunks.as_ref()) {
                    let _ = listener.send(Chunk { stream, data });
                }
            }
            reply => {
                if let Some(waiter) = pending.remove(&response.id) {
                    let _ = waiter.done.send(Ok(reply));
                }
            }
        }
    }
    reader.alive.store(false, Ordering::Relaxed);
    let status = exit.await;
    // Guest-written: removed through directory handles, never following a link.
    let tmp = reader.tmp;
    tokio::task::spawn_blocking(move || kiln_workspace::remove_host_tree(&tmp));
    let waiters: Vec<_> = reader
        .pending
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .drain()
        .collect();
    for (_, waiter) in waiters {
        let lost = if waiter.movable && !waiter.started {
            PoolError::NotStarted
        } else {
            PoolError::WorkerLost(status.clone())
        };
        let _ = waiter.done.send(Err(lost));
    }
}

/// Removes `$TMPDIR/kiln-worker-<pid>-…` folders whose pool process `pid` no longer runs.
fn sweep_stale_worker_folders() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("kiln-worker-"))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = kiln_workspace::remove_host_tree(&entry.path());
        }
    }
}

/// Anonymous and whole resident memory of process `pid`, from `/proc`.
fn rss_bytes(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(name))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    };
    Some((field("RssAnon:")?, field("VmRSS:")?))
}

/// The pool's health loop: pings, stall and wedge detection, memory recycling. Ends with
/// the pool.
async fn watch(pool: Weak<Inner>) {
    let mut ticks: u64 = 0;
    loop {
        tokio::time::sleep(HEARTBEAT).await;
        let Some(inner) = pool.upgrade() else { return };
        ticks += 1;
        let now = inner.now_ms();
        for slot in 0..inner.slots.len() {
            let worker = inner.slots[slot]
                .worker
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
                .filter(|w| w.is_alive());
            let Some(worker) = worker else { continue };
            if let Ok(ping) = encode(&Request {
                id: 0,
                op: Op::Ping,
                stream: false,
                share: None,
            }) {
                let _ = worker.tx.send(ping);
            }
            let silent = now.saturating_sub(worker.last_heard_ms.load(Ordering::Relaxed));
            if u128::from(silent) >= inner.config.kill_after.as_millis() {
                tracing::warn!(
                    pid = worker.pid,
                    silent_ms = silent,
                    "an executor worker stopped answering; replacing it"
                );
                worker.kill();
                continue;
            }
            // Memory: the figure to come back to is taken at the first heartbeat; then once
            // a second is enough.
            let first = worker.base_anon.load(Ordering::Relaxed) == 0;
            if !first && !ticks.is_multiple_of(4) {
                continue;
            }
            let Some((anon, rss)) = worker.pid.and_then(rss_bytes) else {
                continue;
            };
            if first {
                worker.base_anon.store(anon.max(1), Ordering::Relaxed);
                continue;
            }
            let idle = worker.in_flight.load(Ordering::Relaxed) == 0 && worker.session_count() == 0;
            if !idle {
                worker.idle_since_ms.store(u64::MAX, Ordering::Relaxed);
                continue;
            }
            let since = worker.idle_since_ms.load(Ordering::Relaxed);
            if since == u64::MAX {
                worker.idle_since_ms.store(now, Ordering::Relaxed);
                continue;
            }
            let warm = worker.warm_rss.load(Ordering::Relaxed);
            if warm == 0 && worker.served.load(Ordering::Relaxed) > 0 {
                // Idle a second after its first answers: the figure to come back to.
                worker.warm_rss.store(rss.max(1), Ordering::Relaxed);
                continue;
            }
            let base = worker.base_anon.load(Ordering::Relaxed);
            let grown_anon = anon > base.saturating_add(inner.config.recycle_slack_bytes);
            let grown_rss = warm > 0 && rss > warm.saturating_add((warm / 4).max(16 << 20));
            if u128::from(now.saturating_sub(since)) >= inner.config.recycle_idle.as_millis()
                && (grown_anon || grown_rss)
            {
                inner.recycle(slot, &worker, anon, base);
            }
        }
    }
}

impl Inner {
    /// Replaces an idle worker with a fresh one, if it is still idle and still the slot's.
    fn recycle(self: &Arc<Self>, slot: usize, worker: &Arc<Worker>, anon: u64, base: u64) {
        {
            let guard = self.slots[slot]
                .worker
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let current = guard.as_ref().is_some_and(|w| Arc::ptr_eq(w, worker));
            // New work reaches a worker only through this lock (`worker`) or with a session
            // (none: idle), and `call` sends nothing to a worker marked dead, so marking it
            // here, under the lock, loses no request.
            if !current
                || worker.in_flight.load(Ordering::Relaxed) != 0
                || worker.session_count() != 0
            {
                return;
            }
            worker.alive.store(false, Ordering::Relaxed);
        }
        tracing::info!(
            pid = worker.pid,
            rss_anon_mib = anon >> 20,
            base_mib = base >> 20,
            "recycling an idle executor worker to return its memory"
        );
        worker.kill();
        let _ = self.worker(slot);
    }
}

/// Answers one door call of request `target` off the reader task: with the granted door,
/// or, when the call has none, with a fault.
fn answer_door(
    door: Option<Door>,
    target: u64,
    call: u64,
    frame: Vec<u8>,
    out: mpsc::UnboundedSender<Vec<u8>>,
) {
    tokio::spawn(async move {
        let answer = match door {
            Some(door) => door(frame).await,
            None => Err("no capability is granted to this call".to_string()),
        };
        let (ok, data) = match answer {
            Ok(data) => (true, data),
            Err(message) => (false, message.into_bytes()),
        };
        let op = Op::DoorAnswer {
            target,
            call,
            ok,
            data,
        };
        if let Ok(body) = encode(&Request {
            id: 0,
            op,
            stream: false,
            share: None,
        }) {
            let _ = out.send(body);
        }
    });
}

fn unexpected(reply: &Reply) -> PoolError {
    PoolError::Remote(RemoteError {
        kind: "internal".into(),
        message: format!("the worker answered out of turn: {reply:?}"),
    })
}
