//! Live processes in a sandbox's box ([`kiln_core::process::ProcessHost`]): started through
//! the agent in the box its workspace holds, followed as they write, fed stdin, signalled.
//! A running process holds its box, so the idle reaper leaves the box alone meanwhile.

use std::sync::Arc;

use kiln_core::backend::{BackendError, ErrorKind};
use kiln_core::process::{
    BoxFuture, BoxState, BoxUsage, Process, ProcessEvent, ProcessHost, ProcessSpec, Started,
};
use kiln_core::{ExecRequest, TerminalSize};
use kiln_guest::proto::{Reply, WindowSize};

use crate::backend::NativeBackend;
use crate::boxes::{BoxError, Exec, LiveBox};

/// A process in a live box. Across a hibernation with a checkpoint it stays the same
/// process: the box restored from the checkpoint (the same lineage) carries it on.
struct BoxProcess {
    backend: NativeBackend,
    workspace: std::path::PathBuf,
    /// The lineage of the box it was started in.
    lineage: u64,
    /// The box it runs in now (replaced when its box is restored).
    live: std::sync::Mutex<Arc<LiveBox>>,
    /// The agent's id of the spawn request.
    target: u64,
    pid: u32,
}

fn gone(e: BoxError) -> BackendError {
    BackendError::new(ErrorKind::SessionEnded, e.to_string())
}

impl BoxProcess {
    fn current(&self) -> Arc<LiveBox> {
        self.live.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Its box, restored first if it is hibernated (a keystroke wakes it).
    async fn live(&self) -> Result<Arc<LiveBox>, BackendError> {
        let current = self.current();
        if current.is_alive() {
            return Ok(current);
        }
        match self.backend.restored(&self.workspace, self.lineage).await {
            Some(live) => {
                *self.live.lock().unwrap_or_else(|e| e.into_inner()) = live.clone();
                Ok(live)
            }
            None => Err(BackendError::new(
                ErrorKind::SessionEnded,
                "the process ended with its box",
            )),
        }
    }
}

/// A started process, as its owner holds it.
struct Handle(Arc<BoxProcess>);

impl Process for Handle {
    fn pid(&self) -> u32 {
        self.0.pid
    }

    fn write_stdin(&self, data: Vec<u8>, eof: bool) -> BoxFuture<'_, Result<(), BackendError>> {
        Box::pin(async move {
            let live = self.0.live().await?;
            for chunk in data.chunks(kiln_guest::proto::CHUNK_BYTES) {
                live.write_stdin(self.0.target, chunk.to_vec())
                    .await
                    .map_err(gone)?;
            }
            if eof {
                live.close_stdin(self.0.target).await.map_err(gone)?;
            }
            Ok(())
        })
    }

    fn signal(&self, signal: i32) -> BoxFuture<'_, Result<(), BackendError>> {
        Box::pin(async move {
            let live = self.0.live().await?;
            live.signal(self.0.target, signal).await.map_err(gone)
        })
    }

    fn resize(&self, size: TerminalSize) -> BoxFuture<'_, Result<(), BackendError>> {
        Box::pin(async move {
            let size = WindowSize {
                rows: size.rows,
                cols: size.cols,
            };
            let live = self.0.live().await?;
            live.resize(self.0.target, size).await.map_err(gone)
        })
    }

    fn end(&self) -> BoxFuture<'_, Result<(), BackendError>> {
        Box::pin(async move {
            let live = self.0.current();
            if !live.is_alive() {
                // Hibernated (or gone): it goes with its checkpoint, unwoken.
                return Ok(());
            }
            live.signal(self.0.target, libc::SIGKILL)
                .await
                .map_err(gone)
        })
    }
}

impl ProcessHost for NativeBackend {
    fn pools(&self) -> Vec<kiln_core::pool::PoolStats> {
        self.pool_stats()
    }

    fn prestarted<'a>(
        &'a self,
        request: &'a ExecRequest,
    ) -> BoxFuture<'a, Result<Option<kiln_core::process::Prestarted>, BackendError>> {
        Box::pin(NativeBackend::prestarted(self, request))
    }

    fn adopt<'a>(
        &'a self,
        prestarted: kiln_core::process::Prestarted,
        request: &'a ExecRequest,
    ) -> BoxFuture<'a, ()> {
        Box::pin(NativeBackend::adopt(self, prestarted, request))
    }

    fn start<'a>(
        &'a self,
        request: &'a ExecRequest,
        spec: ProcessSpec,
    ) -> BoxFuture<'a, Result<Started, BackendError>> {
        Box::pin(async move {
            let template = self.template(request)?;
            let Some(workspace) = &request.workspace else {
                return Err(BackendError::new(
                    ErrorKind::Grant,
                    "a live process runs in a sandbox: the request needs its workspace",
                ));
            };
            if spec.argv.is_empty() {
                return Err(BackendError::new(
                    ErrorKind::Limits,
                    "a process needs a program",
                ));
            }
            let live = self.held_box(template, request, workspace).await?;
            let mut exec = Exec::new(spec.argv);
            exec.env = request.env.iter().chain(&spec.env).cloned().collect();
            exec.cwd = spec.cwd;
            let terminal = spec.terminal.map(|size| WindowSize {
                rows: size.rows,
                cols: size.cols,
            });
            let (pid, target, mut replies) = live
                .start_process(&exec, terminal, spec.stdin)
                .await
                .map_err(|e| match e {
                    BoxError::Refused(message) => {
                        BackendError::new(ErrorKind::Instantiate, message)
                    }
                    other => BackendError::new(ErrorKind::Instantiate, other.to_string()),
                })?;
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            let on_terminal = terminal.is_some();
            let process = Arc::new(BoxProcess {
                backend: self.clone(),
                workspace: workspace.clone(),
                lineage: live.lineage,
                live: std::sync::Mutex::new(live),
                target,
                pid,
            });
            let pump = process.clone();
            tokio::spawn(async move {
                loop {
                    let event = match replies.next().await {
                        Some(Reply::Output { stderr, data }) => {
                            let data = bytes::Bytes::from(data);
                            if on_terminal {
                                ProcessEvent::Terminal(data)
                            } else if stderr {
                                ProcessEvent::Stderr(data)
                            } else {
                                ProcessEvent::Stdout(data)
                            }
                        }
                        Some(Reply::Exited { code, signal }) => {
                            let _ = tx.send(ProcessEvent::Exited { code, signal });
                            return;
                        }
                        Some(_) => continue,
                        None => {
                            // The box ended under the process. Checkpointed, it goes on in
                            // the box restored from the checkpoint (once something wakes
                            // it); otherwise it was killed with its box.
                            let resumed = pump
                                .backend
                                .await_restored(&pump.workspace, pump.lineage)
                                .await
                                .and_then(|live| Some((live.adopt(pump.target)?, live)));
                            match resumed {
                                Some((adopted, live)) => {
                                    *pump.live.lock().unwrap_or_else(|e| e.into_inner()) = live;
                                    replies = adopted;
                                    continue;
                                }
                                None => {
                                    let _ = tx.send(ProcessEvent::Exited {
                                        code: None,
                                        signal: Some(libc::SIGKILL),
                                    });
                                    return;
                                }
                            }
                        }
                    };
                    if tx.send(event).is_err() {
                        return;
                    }
                }
            });
            let process: Box<dyn Process> = Box::new(Handle(process));
            Ok((process, rx))
        })
    }

    fn usage<'a>(&'a self, workspace: &'a std::path::Path) -> BoxFuture<'a, Option<BoxUsage>> {
        Box::pin(async move {
            let live = self.live_box(workspace).await?;
            Some(BoxUsage {
                cpu_us: live.cpu_usage_us(),
                memory_bytes: live.memory_bytes(),
            })
        })
    }

    fn state<'a>(&'a self, workspace: &'a std::path::Path) -> BoxFuture<'a, BoxState> {
        Box::pin(NativeBackend::state(self, workspace))
    }

    fn processes<'a>(
        &'a self,
        workspace: &'a std::path::Path,
    ) -> BoxFuture<'a, Vec<kiln_core::process::BoxProcess>> {
        Box::pin(async move {
            match self.live_box(workspace).await {
                Some(live) => live.processes().await,
                None => Vec::new(),
            }
        })
    }

    fn signal<'a>(
        &'a self,
        workspace: &'a std::path::Path,
        pid: u32,
        signal: i32,
        group: bool,
    ) -> BoxFuture<'a, Result<Option<usize>, BackendError>> {
        Box::pin(async move {
            let Some(live) = self.live_box(workspace).await else {
                return Ok(None);
            };
            live.signal_pid(pid, signal, group)
                .await
                .map_err(|e| BackendError::new(ErrorKind::Limits, e.to_string()))
        })
    }

    fn restart<'a>(&'a self, workspace: &'a std::path::Path) -> BoxFuture<'a, usize> {
        Box::pin(async move { self.kill_processes(workspace).await.unwrap_or(0) })
    }

    fn ports<'a>(
        &'a self,
        workspace: &'a std::path::Path,
    ) -> BoxFuture<'a, Vec<kiln_core::process::BoxPort>> {
        Box::pin(async move {
            match self.live_box(workspace).await {
                Some(live) => live.ports().await,
                None => Vec::new(),
            }
        })
    }

    fn connect<'a>(
        &'a self,
        workspace: &'a std::path::Path,
        port: u16,
    ) -> BoxFuture<'a, Result<tokio::io::DuplexStream, BackendError>> {
        Box::pin(async move {
            // Preview traffic resumes a paused box (a hibernated one from its checkpoint),
            // and counts as activity.
            if matches!(
                NativeBackend::state(self, workspace).await,
                BoxState::Paused | BoxState::Hibernated
            ) {
                NativeBackend::set_paused(self, workspace, false, "preview traffic").await?;
            }
            match self.connect_box(workspace, port).await {
                None => Err(BackendError::new(
                    ErrorKind::Unsupported,
                    "no box runs for this sandbox: start its server first",
                )),
                Some(connected) => {
                    connected.map_err(|e| BackendError::new(ErrorKind::Unsupported, e.to_string()))
                }
            }
        })
    }

    fn hibernate<'a>(
        &'a self,
        workspace: &'a std::path::Path,
        reason: &'a str,
    ) -> BoxFuture<'a, Result<(BoxState, String), BackendError>> {
        Box::pin(NativeBackend::hibernate(self, workspace, reason))
    }

    fn set_paused<'a>(
        &'a self,
        workspace: &'a std::path::Path,
        paused: bool,
        reason: &'a str,
    ) -> BoxFuture<'a, Result<BoxState, BackendError>> {
        Box::pin(NativeBackend::set_paused(self, workspace, paused, reason))
    }

    fn subscribe(&self) -> Option<tokio::sync::broadcast::Receiver<kiln_core::process::BoxEvent>> {
        Some(self.box_events())
    }

    fn set_egress<'a>(
        &'a self,
        workspace: &'a std::path::Path,
        grant: Option<kiln_core::net::EgressGrant>,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(NativeBackend::set_egress(self, workspace, grant))
    }

    fn use_secrets(&self, secrets: std::sync::Arc<dyn kiln_core::net::SecretSource>) {
        NativeBackend::use_secrets(self, secrets)
    }

    fn paused(&self) -> BoxFuture<'_, Vec<(std::path::PathBuf, std::time::Duration)>> {
        Box::pin(async move { NativeBackend::paused_boxes(self) })
    }

    fn snapshot<'a>(
        &'a self,
        workspace: &'a std::path::Path,
        processes_into: Option<&'a std::path::Path>,
        copy: Box<dyn FnOnce() + Send + 'static>,
    ) -> BoxFuture<'a, Result<kiln_core::process::SnapshotProcesses, BackendError>> {
        Box::pin(NativeBackend::snapshot(
            self,
            workspace,
            processes_into,
            copy,
        ))
    }

    fn restore_from<'a>(
        &'a self,
        request: &'a kiln_core::ExecRequest,
        from: &'a std::path::Path,
    ) -> BoxFuture<'a, Result<String, String>> {
        Box::pin(NativeBackend::restore_from(self, request, from))
    }
}
