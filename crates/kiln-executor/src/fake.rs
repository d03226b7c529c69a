//! An in-process [`Backend`] for tests: a tiny line language instead of a guest, so the
//! worker, the pool and the faces above them can be tested in milliseconds, without wasm.
//!
//! Each line of code is one statement:
//!
//! | statement | effect |
//! |---|---|
//! | `print TEXT` / `eprint TEXT` | `TEXT` and a newline on stdout / stderr |
//! | `sleep MS` | waits `MS` ms (the deadline still holds) |
//! | `spin` | waits until the deadline (a busy guest) |
//! | `exit N` | ends with exit code `N` |
//! | `set NAME VALUE` / `get NAME` | session state: store, then print a value |
//! | `door TEXT` | sends `TEXT` through the granted door and prints the answer |
//! | `fail KIND` | the backend fails with that [`ErrorKind`] (`busy`, `limits`, …) |
//! | `hang` | waits forever, past its deadline (a wedged guest the pool must stop) |
//!
//! Commands (template `fake`) run `echo ARGS…`; any other program exits 127. A session forks
//! with a copy of its variables.
//! [`pool_config`] makes an [`ExecutorPool`](crate::ExecutorPool) whose workers serve this
//! backend as tasks of the calling process. Compiled only for tests or with the
//! `fake-backend` feature.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kiln_core::backend::{
    Backend, BackendError, BackendSession, Door, ErrorKind, OutputChunk, OutputSink, StreamKind,
};
use kiln_core::template::{BackendKind, Capabilities, ImageRule, Lifecycle, TemplateInfo};
use kiln_core::{ExecRequest, ExecResult, Language, Limits, Outcome, Program};

/// The in-process test backend.
#[derive(Debug, Clone, Default)]
pub struct FakeBackend;

/// A pool configuration whose `workers` serve the fake backend as tasks of this process,
/// over in-memory pipes: pool, protocol and worker loop as in production, without processes
/// or wasm.
pub fn pool_config(workers: usize) -> crate::PoolConfig {
    let mut config = crate::PoolConfig::new("in-process".into(), Vec::new());
    config.workers = workers;
    config.in_process = Some(crate::pool::InProcess(std::sync::Arc::new(|stream| {
        Box::pin(async move {
            let (input, output) = tokio::io::split(stream);
            crate::worker::serve(FakeBackend, input, output).await;
        })
    })));
    config
}

/// A session of the fake backend: its variables.
#[derive(Debug, Default)]
pub struct FakeSession {
    vars: HashMap<String, String>,
    ended: Option<String>,
}

impl Backend for FakeBackend {
    type Session = FakeSession;

    fn templates(&self) -> Vec<TemplateInfo> {
        vec![TemplateInfo {
            id: "fake".into(),
            description: "the in-process test backend".into(),
            backend: BackendKind::Fake,
            lifecycle: Lifecycle::Ephemeral,
            languages: vec![Language::Python],
            capabilities: Capabilities {
                sessions: true,
                session_languages: vec![Language::Python],
                commands: true,
                fork: true,
                ..Capabilities::default()
            },
            images: ImageRule {
                names: vec![],
                repos: vec!["fake".into()],
                versions: None,
            },
            resources: None,
            workspace_owner: None,
        }]
    }

    async fn run_once(
        &self,
        request: &ExecRequest,
        output: Option<OutputSink>,
    ) -> Result<ExecResult, BackendError> {
        request
            .limits
            .validate()
            .map_err(|e| BackendError::new(ErrorKind::Limits, e.to_string()))?;
        match request.program() {
            Program::Code { source, .. } => {
                run(source, &request.limits, output, None, &mut HashMap::new()).await
            }
            Program::Command(command) => {
                let mut result = Run::new(&request.limits, output);
                match command.argv.split_first() {
                    Some((program, args)) if program == "echo" => {
                        result.write(false, &args.join(" "))
                    }
                    Some((program, _)) => {
                        result.write(true, &format!("{program}: command not found"));
                        result.exit_code = 127;
                    }
                    None => return Err(BackendError::new(ErrorKind::Limits, "an empty argv")),
                }
                Ok(result.finish(Outcome::Completed))
            }
        }
    }

    async fn open_session(&self, request: ExecRequest) -> Result<FakeSession, BackendError> {
        if request.command.is_some() {
            return Err(BackendError::unsupported(
                "a session runs code, not a command",
            ));
        }
        Ok(FakeSession::default())
    }

    /// A fork starts with a copy of the parent's variables; an ended parent cannot fork.
    async fn fork_session(
        &self,
        parent: &mut FakeSession,
        request: ExecRequest,
    ) -> Result<FakeSession, BackendError> {
        if request.command.is_some() {
            return Err(BackendError::unsupported(
                "a session runs code, not a command",
            ));
        }
        if let Some(reason) = &parent.ended {
            return Err(BackendError::new(
                ErrorKind::SessionEnded,
                format!("the session has ended: {reason}"),
            ));
        }
        Ok(FakeSession {
            vars: parent.vars.clone(),
            ended: None,
        })
    }
}

impl BackendSession for FakeSession {
    async fn run(
        &mut self,
        code: &str,
        limits: &Limits,
        output: Option<OutputSink>,
        door: Option<Door>,
    ) -> Result<ExecResult, BackendError> {
        if let Some(reason) = &self.ended {
            return Err(BackendError::new(
                ErrorKind::SessionEnded,
                format!("the session has ended: {reason}"),
            ));
        }
        let result = run(code, limits, output, door, &mut self.vars).await?;
        if result.outcome == Outcome::TimedOut {
            self.ended = Some("a turn ran past its deadline".into());
        }
        Ok(result)
    }
}

/// An execution in progress: its output so far.
struct Run {
    started: Instant,
    limits: Limits,
    output: Option<OutputSink>,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    truncated: bool,
    exit_code: i32,
}

impl Run {
    fn new(limits: &Limits, output: Option<OutputSink>) -> Run {
        Run {
            started: Instant::now(),
            limits: limits.clone(),
            output,
            stdout: Vec::new(),
            stderr: Vec::new(),
            truncated: false,
            exit_code: 0,
        }
    }

    fn write(&mut self, stderr: bool, line: &str) {
        let data = format!("{line}\n").into_bytes();
        let (buffer, cap) = if stderr {
            (&mut self.stderr, self.limits.stderr_bytes)
        } else {
            (&mut self.stdout, self.limits.stdout_bytes)
        };
        let room = usize::try_from(cap)
            .unwrap_or(usize::MAX)
            .saturating_sub(buffer.len());
        let kept = &data[..data.len().min(room)];
        self.truncated |= kept.len() < data.len();
        buffer.extend_from_slice(kept);
        if let (Some(sink), false) = (&self.output, kept.is_empty()) {
            let stream = if stderr {
                StreamKind::Stderr
            } else {
                StreamKind::Stdout
            };
            let _ = sink.send(OutputChunk {
                stream,
                data: bytes::Bytes::copy_from_slice(kept),
            });
        }
    }

    fn deadline(&self) -> Instant {
        self.started + self.limits.timeout()
    }

    fn finish(self, outcome: Outcome) -> ExecResult {
        let outcome = match outcome {
            Outcome::Completed if self.truncated => Outcome::OutputTruncated,
            other => other,
        };
        ExecResult {
            stdout: self.stdout,
            stderr: self.stderr,
            exit_code: self.exit_code,
            outcome,
            stdout_truncated: self.truncated,
            stderr_truncated: false,
            duration_us: u64::try_from(self.started.elapsed().as_micros()).unwrap_or(u64::MAX),
            peak_memory_bytes: 0,
            fs_written_bytes: 0,
            fs_refused: false,
            files_changed: None,
            results: Vec::new(),
            session_memory_bytes: None,
        }
    }
}

async fn run(
    code: &str,
    limits: &Limits,
    output: Option<OutputSink>,
    door: Option<Door>,
    vars: &mut HashMap<String, String>,
) -> Result<ExecResult, BackendError> {
    let mut run = Run::new(limits, output);
    for line in code.lines() {
        let (word, rest) = line.trim().split_once(' ').unwrap_or((line.trim(), ""));
        match word {
            "" => {}
            "print" => run.write(false, rest),
            "eprint" => run.write(true, rest),
            "exit" => {
                run.exit_code = rest.trim().parse().unwrap_or(1);
                break;
            }
            "sleep" | "spin" => {
                let wait = Duration::from_millis(rest.trim().parse().unwrap_or(u64::MAX / 4));
                let until = Instant::now()
                    .checked_add(wait)
                    .unwrap_or_else(|| run.deadline());
                if until >= run.deadline() {
                    tokio::time::sleep_until(run.deadline().into()).await;
                    run.exit_code = 124;
                    return Ok(run.finish(Outcome::TimedOut));
                }
                tokio::time::sleep_until(until.into()).await;
            }
            "set" => {
                let (name, value) = rest.split_once(' ').unwrap_or((rest, ""));
                vars.insert(name.to_string(), value.to_string());
            }
            "get" => {
                let value = vars.get(rest).cloned().unwrap_or_default();
                run.write(false, &value);
            }
            "door" => {
                let answer = match &door {
                    Some(door) => door(rest.as_bytes().to_vec()).await,
                    None => Err("the door is shut".to_string()),
                };
                match answer {
                    Ok(bytes) => run.write(false, &String::from_utf8_lossy(&bytes)),
                    Err(fault) => run.write(true, &fault),
                }
            }
            "fail" => return Err(fail(rest)),
            "hang" => std::future::pending::<()>().await,
            other => {
                run.write(true, &format!("unknown statement {other:?}"));
                run.exit_code = 1;
                break;
            }
        }
    }
    Ok(run.finish(Outcome::Completed))
}

fn fail(kind: &str) -> BackendError {
    let kind = match kind.trim() {
        "setup" => ErrorKind::Setup,
        "limits" => ErrorKind::Limits,
        "grant" => ErrorKind::Grant,
        "too_large" => ErrorKind::TooLarge,
        "session_ended" => ErrorKind::SessionEnded,
        "busy" => ErrorKind::Busy,
        "unsupported" => ErrorKind::Unsupported,
        _ => ErrorKind::Instantiate,
    };
    BackendError::new(kind, format!("failed as asked: {}", kind.as_str()))
}

#[cfg(test)]
mod tests {
    //! The worker loop, driven over an in-memory pipe with the fake backend.

    use kiln_core::{Command, ExecRequest, Language, Limits, Outcome};
    use tokio::io::{DuplexStream, ReadHalf, WriteHalf};

    use super::FakeBackend;
    use crate::protocol::{Op, Reply, Request, Response, read_frame, write_frame};

    struct Worker {
        to: WriteHalf<DuplexStream>,
        from: ReadHalf<DuplexStream>,
    }

    impl Worker {
        fn start() -> Worker {
            let (ours, theirs) = tokio::io::duplex(1 << 20);
            let (input, output) = tokio::io::split(theirs);
            tokio::spawn(crate::worker::serve(FakeBackend, input, output));
            let (from, to) = tokio::io::split(ours);
            Worker { to, from }
        }

        async fn send(&mut self, id: u64, op: Op, stream: bool) {
            let request = Request {
                id,
                op,
                stream,
                share: None,
            };
            write_frame(&mut self.to, &request).await.unwrap();
        }

        /// The next reply, past one-shots' `Started` (its own test checks it).
        async fn next(&mut self) -> Response {
            loop {
                let response = self.frame().await;
                if !matches!(response.reply, Reply::Started) {
                    return response;
                }
            }
        }

        async fn frame(&mut self) -> Response {
            read_frame(&mut self.from).await.unwrap()
        }

        /// Sends `op` and reads replies up to the last one for it (chunks before it).
        async fn call(&mut self, id: u64, op: Op) -> Reply {
            self.send(id, op, false).await;
            let response = self.next().await;
            assert_eq!(response.id, id);
            response.reply
        }
    }

    fn code(source: &str) -> ExecRequest {
        ExecRequest::new(Language::Python, source)
    }

    fn done(reply: Reply) -> kiln_core::ExecResult {
        match reply {
            Reply::Done(result) => result,
            other => panic!("expected Done, got {other:?}"),
        }
    }

    fn failed(reply: Reply) -> String {
        match reply {
            Reply::Failed(error) => error.kind,
            other => panic!("expected Failed, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn one_shots_and_commands_run_and_fail_with_their_kinds() {
        let mut worker = Worker::start();
        let result = done(
            worker
                .call(1, Op::Exec(code("print hi\neprint oops\nexit 3")))
                .await,
        );
        assert_eq!(
            (
                result.stdout.as_slice(),
                result.stderr.as_slice(),
                result.exit_code
            ),
            (&b"hi\n"[..], &b"oops\n"[..], 3)
        );
        let mut echo = code("");
        echo.command = Some(Command {
            argv: vec!["echo".into(), "a".into(), "b".into()],
            cwd: None,
            terminal: None,
        });
        assert_eq!(done(worker.call(2, Op::Exec(echo)).await).stdout, b"a b\n");
        assert_eq!(
            failed(worker.call(3, Op::Exec(code("fail busy"))).await),
            "busy"
        );
        let mut bad = code("print x");
        bad.limits.timeout_ms = 0;
        assert_eq!(failed(worker.call(4, Op::Exec(bad)).await), "limits");
        let mut short = code("sleep 60000");
        short.limits.timeout_ms = 50;
        assert_eq!(
            done(worker.call(5, Op::Exec(short)).await).outcome,
            Outcome::TimedOut
        );
    }

    #[tokio::test]
    async fn sessions_keep_state_until_closed() {
        let mut worker = Worker::start();
        let open = Op::OpenSession {
            session: 7,
            request: code(""),
        };
        assert!(matches!(worker.call(1, open).await, Reply::Opened));
        let turn = |source: &str| Op::Turn {
            session: 7,
            code: source.into(),
            limits: Limits::default(),
            door: false,
        };
        done(worker.call(2, turn("set x 41")).await);
        assert_eq!(done(worker.call(3, turn("get x")).await).stdout, b"41\n");
        assert!(matches!(
            worker.call(4, Op::CloseSession { session: 7 }).await,
            Reply::Closed
        ));
        assert_eq!(
            failed(worker.call(5, turn("get x")).await),
            "no_such_session"
        );
    }

    #[tokio::test]
    async fn a_fork_starts_with_its_parents_state_and_goes_its_own_way() {
        let mut worker = Worker::start();
        let open = Op::OpenSession {
            session: 1,
            request: code(""),
        };
        assert!(matches!(worker.call(1, open).await, Reply::Opened));
        let turn = |session: u64, source: &str| Op::Turn {
            session,
            code: source.into(),
            limits: Limits::default(),
            door: false,
        };
        done(worker.call(2, turn(1, "set x 41")).await);
        let fork = |parent: u64, session: u64| Op::ForkSession {
            parent,
            session,
            request: code(""),
        };
        assert!(matches!(worker.call(3, fork(1, 2)).await, Reply::Opened));
        assert_eq!(done(worker.call(4, turn(2, "get x")).await).stdout, b"41\n");
        done(worker.call(5, turn(2, "set x child")).await);
        done(worker.call(6, turn(1, "set y parent")).await);
        assert_eq!(done(worker.call(7, turn(1, "get x")).await).stdout, b"41\n");
        assert_eq!(
            done(worker.call(8, turn(2, "get x")).await).stdout,
            b"child\n"
        );
        assert_eq!(done(worker.call(9, turn(2, "get y")).await).stdout, b"\n");
        assert_eq!(
            failed(worker.call(10, fork(99, 3)).await),
            "no_such_session"
        );
        // A fork asked while a turn of the parent runs waits for the turn to end.
        worker
            .send(11, turn(1, "sleep 200\nset z late"), false)
            .await;
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        worker.send(12, fork(1, 4), false).await;
        let first = worker.next().await;
        assert_eq!(first.id, 11, "the turn ends before the fork answers");
        done(first.reply);
        let second = worker.next().await;
        assert_eq!(second.id, 12);
        assert!(matches!(second.reply, Reply::Opened), "{second:?}");
        assert_eq!(
            done(worker.call(13, turn(4, "get z")).await).stdout,
            b"late\n"
        );
    }

    #[tokio::test]
    async fn output_streams_before_the_result_and_pings_pass_a_busy_guest() {
        let mut worker = Worker::start();
        worker
            .send(
                1,
                Op::Exec(code("print early\nsleep 300\nprint late")),
                true,
            )
            .await;
        let first = worker.next().await;
        assert!(
            matches!(&first.reply, Reply::Chunk { stream: kiln_core::backend::StreamKind::Stdout, data } if data == b"early\n"),
            "{first:?}"
        );
        worker.send(2, Op::Ping, false).await;
        let pong = worker.next().await;
        assert_eq!(pong.id, 2, "the ping is answered while the guest sleeps");
        assert!(matches!(pong.reply, Reply::Pong));
        let late = worker.next().await;
        assert!(matches!(late.reply, Reply::Chunk { .. }));
        assert_eq!(done(worker.next().await.reply).stdout, b"early\nlate\n");
    }

    #[tokio::test]
    async fn a_one_shot_says_it_started_before_anything_else_and_a_turn_does_not() {
        let mut worker = Worker::start();
        worker
            .send(1, Op::Exec(code("print early\nprint late")), true)
            .await;
        let first = worker.frame().await;
        assert_eq!(first.id, 1);
        assert!(matches!(first.reply, Reply::Started), "{first:?}");
        let mut replies = Vec::new();
        loop {
            let response = worker.frame().await;
            let last = matches!(response.reply, Reply::Done(_));
            replies.push(response.reply);
            if last {
                break;
            }
        }
        assert!(
            !replies.iter().any(|r| matches!(r, Reply::Started)),
            "{replies:?}"
        );
        let request = code("");
        worker
            .send(
                2,
                Op::OpenSession {
                    session: 7,
                    request,
                },
                false,
            )
            .await;
        assert!(matches!(worker.frame().await.reply, Reply::Opened));
        let turn = Op::Turn {
            session: 7,
            code: "print x".into(),
            limits: Limits::default(),
            door: false,
        };
        worker.send(3, turn, false).await;
        let answer = worker.frame().await;
        assert!(matches!(answer.reply, Reply::Done(_)), "{answer:?}");
    }

    #[tokio::test]
    async fn a_cancelled_execution_fails_as_cancelled() {
        let mut worker = Worker::start();
        worker.send(1, Op::Exec(code("spin")), false).await;
        worker.send(2, Op::Cancel { target: 1 }, false).await;
        let response = worker.next().await;
        assert_eq!(response.id, 1);
        assert_eq!(failed(response.reply), "cancelled");
    }

    #[tokio::test]
    async fn a_granted_door_carries_frames_both_ways() {
        let mut worker = Worker::start();
        let open = Op::OpenSession {
            session: 1,
            request: code(""),
        };
        assert!(matches!(worker.call(1, open).await, Reply::Opened));
        let turn = Op::Turn {
            session: 1,
            code: "door ping".into(),
            limits: Limits::default(),
            door: true,
        };
        worker.send(2, turn, false).await;
        let asked = worker.next().await;
        let Reply::Door { call, data } = asked.reply else {
            panic!("expected a door frame, got {asked:?}");
        };
        assert_eq!(data, b"ping");
        let answer = Op::DoorAnswer {
            target: 2,
            call,
            ok: true,
            data: b"pong".to_vec(),
        };
        worker.send(3, answer, false).await;
        assert_eq!(done(worker.next().await.reply).stdout, b"pong\n");
        // The same session without a grant finds the door shut.
        let shut = Op::Turn {
            session: 1,
            code: "door ping".into(),
            limits: Limits::default(),
            door: false,
        };
        assert_eq!(
            done(worker.call(4, shut).await).stderr,
            b"the door is shut\n"
        );
    }

    // ------------------------------------------------------------ the pool, in process

    use std::time::Duration;

    use crate::{ExecutorPool, PoolError};

    #[tokio::test]
    async fn an_in_process_pool_runs_one_shots_and_sessions() {
        let pool = ExecutorPool::new(super::pool_config(2));
        pool.start_all().unwrap();
        assert_eq!(pool.worker_pids(), Vec::<u32>::new(), "no processes");
        let result = pool.execute(code("print hello")).await.unwrap();
        assert_eq!(result.stdout, b"hello\n");
        let session = pool.open_session(code("")).await.unwrap();
        pool.run(&session, "set n 7".into(), Limits::default())
            .await
            .unwrap();
        let got = pool
            .run(&session, "get n".into(), Limits::default())
            .await
            .unwrap();
        assert_eq!(got.stdout, b"7\n");
        let fork = pool
            .fork_session_with(&session, code(""), crate::CallOptions::default())
            .await
            .unwrap();
        assert_ne!(fork.id, session.id);
        let got = pool
            .run(&fork, "get n".into(), Limits::default())
            .await
            .unwrap();
        assert_eq!(got.stdout, b"7\n", "the fork has the parent's state");
        let loads = pool.worker_loads();
        assert_eq!(
            loads.iter().map(|l| l.sessions).sum::<usize>(),
            2,
            "both sessions on one worker: {loads:?}"
        );
        assert!(loads.iter().any(|l| l.sessions == 2), "{loads:?}");
        pool.close_session(&session).await.unwrap();
        let gone = pool
            .fork_session_with(&session, code(""), crate::CallOptions::default())
            .await
            .unwrap_err();
        assert_eq!(gone, PoolError::NoSuchSession(session.id));
        let refused = pool.execute(code("fail busy")).await.unwrap_err();
        assert!(
            matches!(&refused, PoolError::Remote(r) if r.kind == "busy"),
            "{refused:?}"
        );
    }

    #[tokio::test]
    async fn a_wedged_execution_is_stopped_at_its_deadline_and_its_worker_replaced() {
        let mut config = super::pool_config(1);
        config.grace = Duration::from_millis(100);
        let pool = ExecutorPool::new(config);
        let session = pool.open_session(code("")).await.unwrap();
        pool.run(&session, "set kept 1".into(), Limits::default())
            .await
            .unwrap();
        let mut wedged = code("hang");
        wedged.limits.timeout_ms = 200;
        let result = pool.execute(wedged).await.unwrap();
        assert_eq!(result.outcome, Outcome::TimedOut);
        // The worker was killed with it: its session is gone, and a new worker serves.
        let lost = pool
            .run(&session, "get kept".into(), Limits::default())
            .await;
        assert!(lost.is_err(), "{lost:?}");
        let after = pool.execute(code("print again")).await.unwrap();
        assert_eq!(after.stdout, b"again\n");
    }
}
