//! The parent side: a pool of worker processes.
//!
//! Each request goes to the worker with the fewest requests in flight; a session stays on the
//! worker that opened it. A worker that dies (crash, abort, `kill -9`) fails exactly the
//! requests and sessions it held, and the next request that lands on its slot starts a fresh
//! one.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use kiln_core::{ExecRequest, ExecResult, Language, Limits};
use kiln_wasm::Door;
use tokio::process::{Child, Command};
use tokio::sync::{mpsc, oneshot};

use crate::protocol::{
    Op, RemoteError, Reply, Request, Response, encode, read_frame, write_encoded,
};

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
}

impl PoolConfig {
    /// Workers that run this very binary with `__worker`, one per CPU, with only
    /// `KILN_CACHE_DIR`, `PATH`, `HOME` and `RUST_LOG` passed through.
    pub fn current_exe() -> std::io::Result<PoolConfig> {
        let env = [
            "KILN_CACHE_DIR",
            "PATH",
            "HOME",
            "RUST_LOG",
            "TMPDIR",
            "KILN_WORKER_THREADS",
        ]
        .iter()
        .filter_map(|name| std::env::var_os(name).map(|v| (OsString::from(name), v)))
        .collect();
        Ok(PoolConfig {
            workers: std::thread::available_parallelism().map_or(2, |n| n.get()),
            program: std::env::current_exe()?,
            args: vec!["__worker".into()],
            env,
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
    /// The request cannot be sent to a worker: it is too large.
    #[error("the request is too large to send to a worker: {0}")]
    TooLarge(String),
    /// The session is unknown (closed, or lost with its worker).
    #[error("no such session: {0}")]
    NoSuchSession(u64),
}

/// A piece of output streamed from a running execution.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    pub stderr: bool,
    pub data: Vec<u8>,
}

/// Extras for one call: a listener for output as it is written, a cancel signal (send
/// `()` to stop the execution; it then fails with `Remote` kind `cancelled`), and a door
/// granted to a session turn for that turn alone (see [`kiln_wasm::Door`]).
#[derive(Default)]
pub struct CallOptions {
    pub chunks: Option<mpsc::UnboundedSender<Chunk>>,
    pub cancel: Option<oneshot::Receiver<()>>,
    pub door: Option<Door>,
}

impl std::fmt::Debug for CallOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallOptions")
            .field("chunks", &self.chunks.is_some())
            .field("cancel", &self.cancel.is_some())
            .field("door", &self.door.is_some())
            .finish()
    }
}

struct Waiter {
    done: oneshot::Sender<Result<Reply, PoolError>>,
    chunks: Option<mpsc::UnboundedSender<Chunk>>,
    door: Option<Door>,
}

type Pending = Arc<Mutex<HashMap<u64, Waiter>>>;

struct Worker {
    generation: u64,
    tx: mpsc::UnboundedSender<Vec<u8>>,
    pending: Pending,
    alive: Arc<AtomicBool>,
    in_flight: Arc<AtomicUsize>,
    pid: Option<u32>,
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

/// A pool of executor worker processes.
pub struct ExecutorPool {
    config: PoolConfig,
    slots: Vec<Slot>,
    next_id: AtomicU64,
    generations: AtomicU64,
}

impl std::fmt::Debug for ExecutorPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecutorPool")
            .field("workers", &self.config.workers)
            .finish_non_exhaustive()
    }
}

impl ExecutorPool {
    /// A pool; workers start on first use.
    pub fn new(config: PoolConfig) -> ExecutorPool {
        let slots = (0..config.workers.max(1))
            .map(|_| Slot {
                worker: Mutex::new(None),
            })
            .collect();
        ExecutorPool {
            config,
            slots,
            next_id: AtomicU64::new(1),
            generations: AtomicU64::new(1),
        }
    }

    /// Starts every worker now rather than on first use.
    pub fn start_all(&self) -> Result<(), PoolError> {
        for slot in 0..self.slots.len() {
            self.worker(slot)?;
        }
        Ok(())
    }

    /// Process ids of the live workers.
    pub fn worker_pids(&self) -> Vec<u32> {
        self.slots
            .iter()
            .filter_map(|s| {
                let guard = s.worker.lock().unwrap_or_else(|e| e.into_inner());
                guard
                    .as_ref()
                    .filter(|w| w.alive.load(Ordering::Relaxed))
                    .and_then(|w| w.pid)
            })
            .collect()
    }

    fn worker(&self, slot: usize) -> Result<Arc<Worker>, PoolError> {
        let mut guard = self.slots[slot]
            .worker
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(worker) = guard.as_ref()
            && worker.alive.load(Ordering::Relaxed)
        {
            return Ok(worker.clone());
        }
        let generation = self.generations.fetch_add(1, Ordering::Relaxed);
        let worker = Arc::new(self.spawn(generation)?);
        *guard = Some(worker.clone());
        Ok(worker)
    }

    fn spawn(&self, generation: u64) -> Result<Worker, PoolError> {
        let mut command = Command::new(&self.config.program);
        command
            .args(&self.config.args)
            .env_clear()
            .envs(self.config.env.iter().cloned())
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
        let mut child: Child = command
            .spawn()
            .map_err(|e| PoolError::Spawn(format!("{}: {e}", self.config.program.display())))?;
        let pid = child.id();
        let mut stdin = child.stdin.take().expect("stdin is piped");
        let mut stdout = child.stdout.take().expect("stdout is piped");
        let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
        let pending: Pending = Arc::default();
        let alive = Arc::new(AtomicBool::new(true));
        tokio::spawn(async move {
            while let Some(body) = rx.recv().await {
                if write_encoded(&mut stdin, &body).await.is_err() {
                    break;
                }
            }
        });
        let reader_pending = pending.clone();
        let reader_alive = alive.clone();
        let answers = tx.clone();
        tokio::spawn(async move {
            while let Ok(response) = read_frame::<_, Response>(&mut stdout).await {
                let mut pending = reader_pending.lock().unwrap_or_else(|e| e.into_inner());
                if let Reply::Door { call, data } = response.reply {
                    let door = pending.get(&response.id).and_then(|w| w.door.clone());
                    answer_door(door, response.id, call, data, answers.clone());
                    continue;
                }
                if let Reply::Chunk { stderr, data } = response.reply {
                    if let Some(listener) =
                        pending.get(&response.id).and_then(|w| w.chunks.as_ref())
                    {
                        let _ = listener.send(Chunk { stderr, data });
                    }
                    continue;
                }
                if let Some(waiter) = pending.remove(&response.id) {
                    let _ = waiter.done.send(Ok(response.reply));
                }
            }
            reader_alive.store(false, Ordering::Relaxed);
            let status = match child.wait().await {
                Ok(status) => status.to_string(),
                Err(e) => e.to_string(),
            };
            let waiters: Vec<_> = reader_pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .drain()
                .collect();
            for (_, waiter) in waiters {
                let _ = waiter.done.send(Err(PoolError::WorkerLost(status.clone())));
            }
        });
        Ok(Worker {
            generation,
            tx,
            pending,
            alive,
            in_flight: Arc::default(),
            pid,
        })
    }

    fn least_loaded(&self) -> usize {
        let mut best = 0;
        let mut best_load = usize::MAX;
        for (i, slot) in self.slots.iter().enumerate() {
            let guard = slot.worker.lock().unwrap_or_else(|e| e.into_inner());
            let load = guard
                .as_ref()
                .filter(|w| w.alive.load(Ordering::Relaxed))
                .map_or(0, |w| w.in_flight.load(Ordering::Relaxed));
            if load < best_load {
                best = i;
                best_load = load;
            }
        }
        best
    }

    async fn call(&self, worker: &Worker, op: Op) -> Result<Reply, PoolError> {
        self.call_with(worker, op, CallOptions::default()).await
    }

    async fn call_with(
        &self,
        worker: &Worker,
        op: Op,
        options: CallOptions,
    ) -> Result<Reply, PoolError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let stream = options.chunks.is_some();
        let body =
            encode(&Request { id, op, stream }).map_err(|e| PoolError::TooLarge(e.to_string()))?;
        let (tx, mut rx) = oneshot::channel();
        worker
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(
                id,
                Waiter {
                    done: tx,
                    chunks: options.chunks,
                    door: options.door,
                },
            );
        if !worker.alive.load(Ordering::Relaxed) || worker.tx.send(body).is_err() {
            worker
                .pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&id);
            return Err(PoolError::WorkerLost(
                "the worker had already exited".into(),
            ));
        }
        worker.in_flight.fetch_add(1, Ordering::Relaxed);
        let closed = || Err(PoolError::WorkerLost("the worker channel closed".into()));
        let reply = match options.cancel {
            None => rx.await.unwrap_or_else(|_| closed()),
            Some(mut cancel) => {
                tokio::select! {
                    reply = &mut rx => reply.unwrap_or_else(|_| closed()),
                    Ok(()) = &mut cancel => {
                        if let Ok(frame) = encode(&Request { id: 0, op: Op::Cancel { target: id }, stream: false }) {
                            let _ = worker.tx.send(frame);
                        }
                        rx.await.unwrap_or_else(|_| closed())
                    }
                }
            }
        };
        worker.in_flight.fetch_sub(1, Ordering::Relaxed);
        reply
    }

    /// Runs a one-shot execution on the least loaded worker.
    pub async fn execute(&self, request: ExecRequest) -> Result<ExecResult, PoolError> {
        self.execute_with(request, CallOptions::default()).await
    }

    /// Like [`ExecutorPool::execute`], with streamed output and/or a cancel signal.
    pub async fn execute_with(
        &self,
        request: ExecRequest,
        options: CallOptions,
    ) -> Result<ExecResult, PoolError> {
        let worker = self.worker(self.least_loaded())?;
        match self.call_with(&worker, Op::Exec(request), options).await? {
            Reply::Done(result) => Ok(result),
            Reply::Failed(error) => Err(PoolError::Remote(error)),
            other => Err(unexpected(&other)),
        }
    }

    /// Opens a session on the least loaded worker. `request.code` is ignored.
    pub async fn open_session(&self, request: ExecRequest) -> Result<SessionHandle, PoolError> {
        let slot = self.least_loaded();
        let worker = self.worker(slot)?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let language = request.language;
        match self
            .call(
                &worker,
                Op::OpenSession {
                    session: id,
                    request,
                },
            )
            .await?
        {
            Reply::Opened => Ok(SessionHandle {
                id,
                language,
                slot,
                generation: worker.generation,
            }),
            Reply::Failed(error) => Err(PoolError::Remote(error)),
            other => Err(unexpected(&other)),
        }
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
            Some(worker)
                if worker.generation == session.generation
                    && worker.alive.load(Ordering::Relaxed) =>
            {
                Ok(worker.clone())
            }
            _ => Err(PoolError::WorkerLost(format!(
                "session {} was lost with its worker",
                session.id
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
        options: CallOptions,
    ) -> Result<ExecResult, PoolError> {
        let worker = self.session_worker(session)?;
        let op = Op::Turn {
            session: session.id,
            code,
            limits,
            door: options.door.is_some(),
        };
        match self.call_with(&worker, op, options).await? {
            Reply::Done(result) => Ok(result),
            Reply::Failed(error) if error.kind == "no_such_session" => {
                Err(PoolError::NoSuchSession(session.id))
            }
            Reply::Failed(error) => Err(PoolError::Remote(error)),
            other => Err(unexpected(&other)),
        }
    }

    /// Closes a session (a session lost with its worker is already closed).
    pub async fn close_session(&self, session: &SessionHandle) -> Result<(), PoolError> {
        let Ok(worker) = self.session_worker(session) else {
            return Ok(());
        };
        match self
            .call(
                &worker,
                Op::CloseSession {
                    session: session.id,
                },
            )
            .await?
        {
            Reply::Closed => Ok(()),
            Reply::Failed(error) => Err(PoolError::Remote(error)),
            other => Err(unexpected(&other)),
        }
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
