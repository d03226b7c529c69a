//! The worker side: serve requests from the pool until the pool closes the channel.
//!
//! A worker holds no secrets and no network connections: it only runs guests. Requests run
//! concurrently (each on its own task) under the worker's [`FairScheduler`]; a session's
//! turns run one at a time. Pings are answered at once, ahead of guest work.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kiln_core::backend::{Backend, BackendError, BackendSession, Door, OutputChunk};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{Mutex, mpsc, oneshot};

use crate::fair::FairScheduler;
use crate::protocol::{
    Op, RemoteError, Reply, Request, Response, encode, read_frame, write_batched,
};

/// The async runtime a worker runs on: `threads` threads (1: the current thread). It polls
/// for I/O after every task poll rather than every 61: a guest's poll lasts up to an epoch
/// tick, and the pool's pings and new requests must not wait for 61 of them.
pub fn runtime(threads: usize) -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = if threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        builder.worker_threads(threads);
        builder
    };
    builder.enable_all().event_interval(1).build()
}

type Sessions<S> = Arc<std::sync::Mutex<HashMap<u64, Arc<Mutex<S>>>>>;
type Running = Arc<std::sync::Mutex<HashMap<u64, oneshot::Sender<()>>>>;
/// Door calls waiting for the host's answer, by (request id, call number).
type DoorCalls =
    Arc<std::sync::Mutex<HashMap<(u64, u64), oneshot::Sender<Result<Vec<u8>, String>>>>>;

/// Maps a backend error to what crosses the wire.
pub fn remote_error(error: &BackendError) -> RemoteError {
    RemoteError {
        kind: error.kind.as_str().into(),
        message: error.message.clone(),
    }
}

/// The worker's stdin and stdout as non-blocking pipes driven by the reactor (tokio's own
/// `stdin()`/`stdout()` go through a blocking thread per read, which costs latency).
pub fn stdio_pipes() -> std::io::Result<(
    tokio::net::unix::pipe::Receiver,
    tokio::net::unix::pipe::Sender,
)> {
    use std::os::fd::{FromRawFd, OwnedFd};
    // SAFETY: fds 0 and 1 are open for the life of the worker and nothing else in the
    // process uses them once they are handed over here.
    let (stdin, stdout) = unsafe { (OwnedFd::from_raw_fd(0), OwnedFd::from_raw_fd(1)) };
    Ok((
        tokio::net::unix::pipe::Receiver::from_owned_fd(stdin)?,
        tokio::net::unix::pipe::Sender::from_owned_fd(stdout)?,
    ))
}

/// Serves requests read from `input` with `backend`, writing responses to `output`, until
/// `input` closes.
pub async fn serve<B, R, W>(backend: B, input: R, output: W)
where
    B: Backend,
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (tx, rx) = mpsc::unbounded_channel::<Response>();
    // Every task of the worker ends with this future: dropped (an in-process worker killed),
    // it takes its requests and its writer down with it, as a killed process would.
    let mut writer = AbortOnDrop(tokio::spawn(write_responses(rx, output)));
    let mut requests = tokio::task::JoinSet::new();
    let worker = Worker {
        scheduler: FairScheduler::with_flag(
            tokio::runtime::Handle::current().metrics().num_workers(),
            backend.contention_flag().unwrap_or_default(),
        ),
        backend,
        sessions: Arc::default(),
        running: Arc::default(),
        door_calls: Arc::default(),
        tx,
    };
    // Buffered: a frame's length and body, and frames sent together, in one read.
    let mut input = tokio::io::BufReader::with_capacity(64 << 10, input);
    while let Ok(request) = read_frame::<_, Request>(&mut input).await {
        let received = Instant::now();
        if let Some((request, stop)) = worker.control(request) {
            requests.spawn(worker.clone().run(request, received, stop));
        }
        while requests.try_join_next().is_some() {}
    }
    // The pool closed the stream: what is running finishes and its replies go out.
    while requests.join_next().await.is_some() {}
    drop(worker);
    let _ = (&mut writer.0).await;
}

/// A task aborted when its handle is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Writes each response as a frame, until every sender is gone or the pool stops reading;
/// replies waiting together (a one-shot's `Started` and its `Done`, usually) in one write.
async fn write_responses<W: AsyncWrite + Unpin>(rx: mpsc::UnboundedReceiver<Response>, output: W) {
    write_batched(rx, output, |response| encode_reply(&response)).await;
}

/// A reply's frame body; one too large for a frame fails alone, as a reply.
fn encode_reply(response: &Response) -> Option<Vec<u8>> {
    match encode(response) {
        Ok(body) => Some(body),
        Err(error) => encode(&Response {
            id: response.id,
            reply: Reply::Failed(RemoteError {
                kind: "too_large".into(),
                message: format!("the result could not be sent: {error}"),
            }),
        })
        .ok(),
    }
}

/// What every request of one worker shares.
struct Worker<B: Backend> {
    backend: B,
    sessions: Sessions<B::Session>,
    scheduler: Arc<FairScheduler>,
    running: Running,
    door_calls: DoorCalls,
    tx: mpsc::UnboundedSender<Response>,
}

impl<B: Backend> Clone for Worker<B> {
    fn clone(&self) -> Self {
        Worker {
            backend: self.backend.clone(),
            sessions: self.sessions.clone(),
            scheduler: self.scheduler.clone(),
            running: self.running.clone(),
            door_calls: self.door_calls.clone(),
            tx: self.tx.clone(),
        }
    }
}

fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

impl<B: Backend> Worker<B> {
    /// Answers a control request (ping, cancel, door answer) at once, ahead of guest work;
    /// gives back any other request, registered as running before the next frame is read
    /// (so a cancel that follows it finds it), with the signal that stops it.
    fn control(&self, request: Request) -> Option<(Request, oneshot::Receiver<()>)> {
        match request.op {
            Op::Ping => {
                let _ = self.tx.send(Response {
                    id: request.id,
                    reply: Reply::Pong,
                });
            }
            Op::Cancel { target } => {
                if let Some(stop) = lock(&self.running).remove(&target) {
                    let _ = stop.send(());
                }
            }
            Op::DoorAnswer {
                target,
                call,
                ok,
                data,
            } => {
                if let Some(waiting) = lock(&self.door_calls).remove(&(target, call)) {
                    let answer = if ok {
                        Ok(data)
                    } else {
                        Err(String::from_utf8_lossy(&data).into_owned())
                    };
                    let _ = waiting.send(answer);
                }
            }
            _ => {
                let (stop_tx, stop_rx) = oneshot::channel();
                lock(&self.running).insert(request.id, stop_tx);
                return Some((request, stop_rx));
            }
        }
        None
    }

    /// Runs one request under the fair scheduler to its reply, streaming its output and
    /// stopping it if it is cancelled.
    async fn run(self, request: Request, received: Instant, mut stop_rx: oneshot::Receiver<()>) {
        let id = request.id;
        let (listener, mut chunks) = if request.stream {
            let (chunk_tx, chunk_rx) = mpsc::unbounded_channel::<OutputChunk>();
            (Some(chunk_tx), Some(chunk_rx))
        } else {
            (None, None)
        };
        let turn_session = match &request.op {
            Op::Turn { session, .. } => Some(*session),
            _ => None,
        };
        let door = match &request.op {
            Op::Turn { door: true, .. } => {
                Some(open_door(id, self.tx.clone(), self.door_calls.clone()))
            }
            _ => None,
        };
        let (tenant, weight) = request
            .share
            .as_ref()
            .map_or(("", 1), |s| (s.tenant.as_str(), s.weight));
        let deadline = op_timeout(&request.op).map(|t| received + t);
        let mut op = request.op;
        let tx = self.tx.clone();
        let work = self.scheduler.wrap(tenant, weight, deadline, async {
            // First polled with a run token: a one-shot starts now, and the pool learns it
            // (one that never started is run elsewhere if this worker dies).
            if matches!(op, Op::Exec(_)) {
                let _ = tx.send(Response {
                    id,
                    reply: Reply::Started,
                });
            }
            // The deadline counts from arrival: time spent waiting for a turn of the CPU
            // comes off the guest's own clock.
            shorten_timeout(&mut op, received.elapsed());
            handle(&self.backend, &self.sessions, op, listener, door).await
        });
        tokio::pin!(work);
        let reply = loop {
            tokio::select! {
                reply = &mut work => break reply,
                Some(chunk) = next_chunk(&mut chunks) => self.send_chunk(id, chunk),
                _ = &mut stop_rx => {
                    // The guest future is dropped: the execution stops where it is. A
                    // session stopped mid-turn is in no known state, so it ends.
                    if let Some(session) = turn_session {
                        lock(&self.sessions).remove(&session);
                    }
                    break Reply::Failed(RemoteError {
                        kind: "cancelled".into(),
                        message: "the execution was cancelled".into(),
                    });
                }
            }
        };
        // Every chunk written before the end goes out before the reply.
        if let Some(rx) = chunks.as_mut() {
            while let Ok(chunk) = rx.try_recv() {
                self.send_chunk(id, chunk);
            }
        }
        lock(&self.running).remove(&id);
        lock(&self.door_calls).retain(|(target, _), _| *target != id);
        let _ = self.tx.send(Response { id, reply });
    }

    fn send_chunk(&self, id: u64, chunk: OutputChunk) {
        let reply = Reply::Chunk {
            stream: chunk.stream,
            data: chunk.data.to_vec(),
        };
        let _ = self.tx.send(Response { id, reply });
    }
}

/// How long an execution may take, from its arrival.
fn op_timeout(op: &Op) -> Option<Duration> {
    match op {
        Op::Exec(request) => Some(Duration::from_millis(request.limits.timeout_ms)),
        Op::Turn { limits, .. } => Some(Duration::from_millis(limits.timeout_ms)),
        _ => None,
    }
}

fn shorten_timeout(op: &mut Op, waited: Duration) {
    let limits = match op {
        Op::Exec(request) => &mut request.limits,
        Op::Turn { limits, .. } => limits,
        _ => return,
    };
    if limits.timeout_ms == 0 {
        // Left for the engine to refuse as invalid.
        return;
    }
    let waited = u64::try_from(waited.as_millis()).unwrap_or(u64::MAX);
    limits.timeout_ms = limits.timeout_ms.saturating_sub(waited).max(1);
}

async fn next_chunk(
    chunks: &mut Option<mpsc::UnboundedReceiver<OutputChunk>>,
) -> Option<OutputChunk> {
    match chunks {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// The door of request `id`: each guest frame goes up to the pool as a `Door` reply and
/// waits for the matching `DoorAnswer`.
fn open_door(id: u64, tx: mpsc::UnboundedSender<Response>, calls: DoorCalls) -> Door {
    let next = Arc::new(AtomicU64::new(0));
    Arc::new(move |frame: Vec<u8>| {
        let call = next.fetch_add(1, Ordering::Relaxed);
        let (answer_tx, answer_rx) = oneshot::channel();
        calls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert((id, call), answer_tx);
        let sent = tx.send(Response {
            id,
            reply: Reply::Door { call, data: frame },
        });
        Box::pin(async move {
            if sent.is_err() {
                return Err("the pool went away".to_string());
            }
            answer_rx
                .await
                .unwrap_or_else(|_| Err("the door call was dropped".to_string()))
        })
    })
}

/// Forks session `parent` as `session`. The parent's lock is held while it is copied, so a
/// turn of the parent that runs now ends first and none starts meanwhile.
async fn fork<B: Backend>(
    backend: &B,
    sessions: &Sessions<B::Session>,
    parent: u64,
    session: u64,
    request: kiln_core::ExecRequest,
) -> Reply {
    let found = lock(sessions).get(&parent).cloned();
    let Some(found) = found else {
        return Reply::Failed(RemoteError {
            kind: "no_such_session".into(),
            message: format!("no session {parent} on this worker"),
        });
    };
    let mut guard = found.lock().await;
    match backend.fork_session(&mut guard, request).await {
        Ok(forked) => {
            drop(guard);
            lock(sessions).insert(session, Arc::new(Mutex::new(forked)));
            Reply::Opened
        }
        Err(error) => Reply::Failed(remote_error(&error)),
    }
}

async fn handle<B: Backend>(
    backend: &B,
    sessions: &Sessions<B::Session>,
    op: Op,
    listener: Option<mpsc::UnboundedSender<OutputChunk>>,
    door: Option<Door>,
) -> Reply {
    match op {
        Op::Exec(request) => match backend.run_once(&request, listener).await {
            Ok(result) => Reply::Done(result),
            Err(error) => Reply::Failed(remote_error(&error)),
        },
        Op::OpenSession { session, request } => match backend.open_session(request).await {
            Ok(opened) => {
                sessions
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(session, Arc::new(Mutex::new(opened)));
                Reply::Opened
            }
            Err(error) => Reply::Failed(remote_error(&error)),
        },
        Op::Turn {
            session,
            code,
            limits,
            door: _,
        } => {
            let found = sessions
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&session)
                .cloned();
            let Some(found) = found else {
                return Reply::Failed(RemoteError {
                    kind: "no_such_session".into(),
                    message: format!("no session {session} on this worker"),
                });
            };
            let mut guard = found.lock().await;
            match guard.run(&code, &limits, listener, door).await {
                Ok(result) => Reply::Done(result),
                Err(error) => Reply::Failed(remote_error(&error)),
            }
        }
        Op::ForkSession {
            parent,
            session,
            request,
        } => fork(backend, sessions, parent, session, request).await,
        Op::CloseSession { session } => {
            sessions
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&session);
            Reply::Closed
        }
        Op::Cancel { .. } | Op::DoorAnswer { .. } | Op::Ping => Reply::Closed,
    }
}
