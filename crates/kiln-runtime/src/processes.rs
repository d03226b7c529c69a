//! Live processes in sandboxes: started by a client, followed by one or more clients as they
//! write, fed stdin, signalled, listed, and killed with their sandbox. They run on the
//! sandbox's backend through [`kiln_core::process::ProcessHost`] (Linux boxes); a template
//! without one refuses with [`RuntimeError::Unsupported`].
//!
//! A process is not an execution: it does not make its sandbox busy, and what it does to the
//! workspace is recorded in the history by the next execution (or not at all).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use kiln_core::process::{BoxProcess, BoxState, Process, ProcessEvent, ProcessHost, ProcessSpec};
use kiln_core::{ExecRequest, Limits, TerminalSize};
use tokio::sync::broadcast;

use crate::Runtime;
use crate::auth::Caller;
use crate::error::{Result, RuntimeError};

/// The most processes one sandbox runs at once.
pub const MAX_PROCESSES_PER_SANDBOX: usize = 64;

/// Events a follower may fall behind by before it misses some.
const FOLLOW_BUFFER: usize = 1024;

/// A running process, as its followers see it.
pub struct Running {
    pub pid: u32,
    pub argv: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: Option<String>,
    /// The client's name for it (E2B's tag).
    pub tag: Option<String>,
    pub terminal: bool,
    control: Box<dyn Process>,
    events: broadcast::Sender<ProcessEvent>,
    /// Set (under this lock) when it exits, as the exit is sent: a follower that subscribes
    /// under the lock either sees it here or receives it.
    exited: Mutex<Option<ProcessEvent>>,
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Running")
            .field("pid", &self.pid)
            .field("argv", &self.argv)
            .field("tag", &self.tag)
            .finish_non_exhaustive()
    }
}

/// What a follower gets: events from now on, or the exit if it already happened.
#[derive(Debug)]
pub enum Follow {
    Live(broadcast::Receiver<ProcessEvent>),
    Ended(ProcessEvent),
}

impl Running {
    /// Says its end to its followers, once: kept and sent under one lock, so a follower
    /// arriving now either finds it kept or receives it.
    fn end(&self, event: ProcessEvent) {
        let mut exited = self.exited.lock().unwrap_or_else(|e| e.into_inner());
        if exited.is_none() {
            *exited = Some(event.clone());
            let _ = self.events.send(event);
        }
    }

    /// Follows it from now on.
    pub fn follow(&self) -> Follow {
        let exited = self.exited.lock().unwrap_or_else(|e| e.into_inner());
        match &*exited {
            Some(end) => Follow::Ended(end.clone()),
            None => Follow::Live(self.events.subscribe()),
        }
    }

    pub async fn write_stdin(&self, data: Vec<u8>, eof: bool) -> Result<()> {
        self.control
            .write_stdin(data, eof)
            .await
            .map_err(process_gone)
    }

    pub async fn signal(&self, signal: i32) -> Result<()> {
        self.control.signal(signal).await.map_err(process_gone)
    }

    pub async fn resize(&self, size: TerminalSize) -> Result<()> {
        self.control.resize(size).await.map_err(process_gone)
    }
}

fn process_gone(e: kiln_core::backend::BackendError) -> RuntimeError {
    RuntimeError::Unsupported {
        message: format!("the process can no longer be reached: {e}"),
    }
}

/// Every sandbox's running processes.
#[derive(Default)]
pub struct Processes {
    /// What starts live processes, by the backend whose sandboxes they run in.
    hosts: Vec<(kiln_core::template::BackendKind, Arc<dyn ProcessHost>)>,
    /// Sandbox id → pid → process.
    table: Table,
    /// Sandbox id → the last CPU sample (when, CPU time in µs).
    samples: Mutex<HashMap<String, (std::time::Instant, u64)>>,
}

type Table = Arc<Mutex<HashMap<String, BTreeMap<u32, Arc<Running>>>>>;

impl std::fmt::Debug for Processes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Processes")
            .field("hosts", &self.hosts.len())
            .finish_non_exhaustive()
    }
}

/// What a sandbox uses now ([`Runtime::usage_of`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SandboxUsage {
    pub cpu_used_pct: f64,
    pub memory_bytes: u64,
    pub disk_bytes: u64,
}

/// Bytes used on the sandbox's volume (its workspace's file system), or the workspace's
/// size as last recorded where it has no volume of its own.
pub fn disk_used(sandbox: &crate::sandbox::Sandbox) -> u64 {
    if sandbox.volume
        && let Ok(stat) = rustix::fs::statvfs(sandbox.volume_dir())
    {
        return (stat.f_blocks - stat.f_bfree) * stat.f_frsize;
    }
    sandbox.workspace_bytes
}

/// What to start, as a client asks for it.
#[derive(Debug, Clone, Default)]
pub struct StartProcess {
    pub argv: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: Option<String>,
    pub tag: Option<String>,
    pub terminal: Option<TerminalSize>,
    pub stdin: bool,
}

impl Processes {
    /// Processes started on `hosts`, each for its backend's sandboxes (none: no template
    /// runs live processes).
    pub fn new(hosts: Vec<(kiln_core::template::BackendKind, Arc<dyn ProcessHost>)>) -> Processes {
        Processes {
            hosts,
            table: Table::default(),
            samples: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, BTreeMap<u32, Arc<Running>>>> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Every process host.
    pub fn hosts(&self) -> Vec<Arc<dyn ProcessHost>> {
        self.hosts.iter().map(|(_, host)| host.clone()).collect()
    }

    /// The process host of backend `kind`, if it has one.
    pub fn host_of(&self, kind: kiln_core::template::BackendKind) -> Option<Arc<dyn ProcessHost>> {
        self.hosts
            .iter()
            .find(|(k, _)| *k == kind)
            .map(|(_, host)| host.clone())
    }

    /// CPU use of sandbox `id` as a percentage of its CPUs since the last look (or since
    /// `created_ms`), from its box's total CPU time `cpu_us`.
    pub fn cpu_percent(&self, id: &str, cpu_us: u64, created_ms: u64, cpus: f64) -> f64 {
        let now = std::time::Instant::now();
        let mut samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        let (wall_us, used_us) = match samples.get(id) {
            Some((at, before)) => (
                now.duration_since(*at).as_micros() as f64,
                cpu_us.saturating_sub(*before) as f64,
            ),
            None => (
                (crate::sandbox::now_ms().saturating_sub(created_ms) * 1000) as f64,
                cpu_us as f64,
            ),
        };
        samples.insert(id.to_owned(), (now, cpu_us));
        if wall_us <= 0.0 {
            return 0.0;
        }
        (used_us / wall_us / cpus * 100.0).clamp(0.0, 100.0)
    }

    /// The running processes of sandbox `id`, by pid.
    pub fn list(&self, id: &str) -> Vec<Arc<Running>> {
        self.lock()
            .get(id)
            .map(|all| all.values().cloned().collect())
            .unwrap_or_default()
    }

    /// A running process of sandbox `id`, by pid or by tag.
    pub fn find(&self, id: &str, pid: Option<u32>, tag: Option<&str>) -> Result<Arc<Running>> {
        let table = self.lock();
        let found = table.get(id).and_then(|all| match (pid, tag) {
            (Some(pid), _) => all.get(&pid).cloned(),
            (None, Some(tag)) => all
                .values()
                .find(|p| p.tag.as_deref() == Some(tag))
                .cloned(),
            (None, None) => None,
        });
        found.ok_or_else(|| RuntimeError::ProcessNotFound {
            id: id.to_owned(),
            process: match (pid, tag) {
                (Some(pid), _) => format!("pid {pid}"),
                (None, Some(tag)) => format!("tag {tag:?}"),
                (None, None) => "(none named)".into(),
            },
        })
    }

    /// Kills every process of sandbox `id` (it is being deleted).
    pub async fn kill_all(&self, id: &str) {
        self.samples
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
        let all = self.lock().remove(id).unwrap_or_default();
        for process in all.values() {
            let _ = process.control.end().await;
        }
    }
}

/// Starts a process in sandbox `id` of `caller`: the process, and its events from the
/// start (the first is its first output or its exit).
pub async fn start(
    rt: &Runtime,
    caller: &Caller,
    id: &str,
    asked: StartProcess,
) -> Result<(Arc<Running>, broadcast::Receiver<ProcessEvent>)> {
    let sandbox = rt.registry.get(&caller.tenant, id)?.meta;
    let host = host_for(rt, &sandbox)?;
    check_start(&asked)?;
    awake(rt, &sandbox).await?;
    if rt.processes.lock().get(id).map_or(0, BTreeMap::len) >= MAX_PROCESSES_PER_SANDBOX {
        return Err(RuntimeError::Saturated {
            message: format!(
                "sandbox {id} runs {MAX_PROCESSES_PER_SANDBOX} processes, the most it may; wait for one to end or kill one"
            ),
        });
    }
    let request = box_request(rt, &sandbox);
    let spec = ProcessSpec {
        argv: asked.argv.clone(),
        env: asked
            .env
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        cwd: asked.cwd.clone(),
        terminal: asked.terminal,
        stdin: asked.stdin,
    };
    let (control, mut events) = host.start(&request, spec).await.map_err(|e| match e.kind {
        kiln_core::backend::ErrorKind::Instantiate => {
            RuntimeError::ProcessFailed { message: e.message }
        }
        _ => RuntimeError::Unsupported { message: e.message },
    })?;
    let (sender, receiver) = broadcast::channel(FOLLOW_BUFFER);
    let running = Arc::new(Running {
        pid: control.pid(),
        argv: asked.argv,
        env: asked.env,
        cwd: asked.cwd,
        tag: asked.tag,
        terminal: asked.terminal.is_some(),
        control,
        events: sender,
        exited: Mutex::new(None),
    });
    rt.processes
        .lock()
        .entry(id.to_owned())
        .or_default()
        .insert(running.pid, running.clone());
    let pump = running.clone();
    let table = rt.processes.table.clone();
    let sandbox_id = id.to_owned();
    tokio::spawn(async move {
        while let Some(event) = events.recv().await {
            if matches!(event, ProcessEvent::Exited { .. }) {
                pump.end(event);
                break;
            }
            let _ = pump.events.send(event);
        }
        // Events that stop without an exit: the box went, and the process with it.
        pump.end(ProcessEvent::Exited {
            code: None,
            signal: Some(libc::SIGKILL),
        });
        forget(&table, &sandbox_id, &pump);
    });
    Ok((running, receiver))
}

/// Whether `sandbox`'s template runs live processes (a Linux box; WebAssembly has none).
pub fn runs_processes(rt: &Runtime, sandbox: &crate::sandbox::Sandbox) -> bool {
    rt.process_host(sandbox).is_some()
}

/// What starts processes in `sandbox`, or why nothing does.
fn host_for(rt: &Runtime, sandbox: &crate::sandbox::Sandbox) -> Result<Arc<dyn ProcessHost>> {
    let template = sandbox.template();
    rt.process_host(sandbox).ok_or_else(|| RuntimeError::Unsupported {
        message: format!(
            "the {template} template runs code, not processes; create the sandbox from a Linux template to run commands"
        ),
    })
}

/// The request that names sandbox `sandbox`'s box to the process host: its template,
/// workspace (and where the guest sees it), network, resources, environment and memory.
pub(crate) fn box_request(rt: &Runtime, sandbox: &crate::sandbox::Sandbox) -> ExecRequest {
    let mut request = ExecRequest::new(sandbox.language, "");
    request.template = rt.request_template(sandbox.template(), sandbox.language);
    request.network = sandbox.network;
    request.egress = sandbox.egress_grant();
    request.mounts = sandbox.mounts(&rt.registry.volumes);
    request.resources = sandbox.resources;
    request.workspace = Some(sandbox.workspace());
    request.workspace_at = sandbox.workspace_at.clone();
    request.idle = sandbox.lifecycle.box_policy();
    request.env = crate::exec::sandbox_env(sandbox, &[]);
    request.limits = Limits {
        memory_bytes: sandbox.memory_bytes,
        ..Limits::default()
    };
    request
}

/// Removes an ended process from the table (unless another took its pid since).
fn forget(table: &Table, id: &str, process: &Arc<Running>) {
    let mut table = table.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(all) = table.get_mut(id) {
        if all
            .get(&process.pid)
            .is_some_and(|p| Arc::ptr_eq(p, process))
        {
            all.remove(&process.pid);
        }
        if all.is_empty() {
            table.remove(id);
        }
    }
}

/// Checks what a client asks to start.
fn check_start(asked: &StartProcess) -> Result<()> {
    let invalid = |message: &str| RuntimeError::InvalidOption {
        message: message.to_owned(),
    };
    if asked.argv.is_empty() || asked.argv[0].is_empty() {
        return Err(invalid("a process needs a program"));
    }
    if asked.argv.iter().any(|a| a.contains('\0')) {
        return Err(invalid("arguments may not hold NUL bytes"));
    }
    if asked.argv.len() > 4096 || asked.argv.iter().map(String::len).sum::<usize>() > 1 << 20 {
        return Err(invalid(
            "the command is larger than 4096 arguments or 1 MiB",
        ));
    }
    crate::exec::check_env(&asked.env)?;
    if asked.env.len() > kiln_core::MAX_ENV_VARS {
        return Err(invalid("too many environment variables"));
    }
    if let Some(cwd) = &asked.cwd
        && (!cwd.starts_with('/') || cwd.contains('\0') || cwd.len() > 4096)
    {
        return Err(invalid("cwd must be an absolute path"));
    }
    if asked.tag.as_ref().is_some_and(|t| t.len() > 256) {
        return Err(invalid("a tag is at most 256 bytes"));
    }
    Ok(())
}

/// Refuses a request that would resume a paused or hibernated sandbox whose lifecycle turned
/// auto-resume off (`SANDBOX_PAUSED`); any other passes (and resumes it).
pub async fn awake(rt: &Runtime, sandbox: &crate::sandbox::Sandbox) -> Result<()> {
    if sandbox.lifecycle.auto_resume() {
        return Ok(());
    }
    match box_state(rt, sandbox).await {
        Some(state @ (BoxState::Paused | BoxState::Hibernated)) => {
            Err(RuntimeError::SandboxPaused {
                id: sandbox.id.clone(),
                state: state.name(),
            })
        }
        _ => Ok(()),
    }
}

/// Resumes a paused box for a request that needs it running (a terminal attaching), unless
/// its lifecycle turned auto-resume off ([`awake`]).
pub async fn wake(rt: &Runtime, sandbox: &crate::sandbox::Sandbox) -> Result<()> {
    awake(rt, sandbox).await?;
    if box_state(rt, sandbox).await == Some(BoxState::Paused)
        && let Some(host) = rt.process_host(sandbox)
    {
        host.set_paused(&sandbox.workspace(), false, "a terminal attached")
            .await
            .map_err(|e| RuntimeError::Internal { message: e.message })?;
    }
    Ok(())
}

/// Where a Linux sandbox's box stands (`None` for a WebAssembly sandbox, which has none).
pub async fn box_state(rt: &Runtime, sandbox: &crate::sandbox::Sandbox) -> Option<BoxState> {
    if !runs_processes(rt, sandbox) {
        return None;
    }
    let host = rt.process_host(sandbox)?;
    Some(host.state(&sandbox.workspace()).await)
}

/// The box of sandbox `id`: where it stands and its processes, as the box sees them.
pub async fn box_processes(
    rt: &Runtime,
    caller: &Caller,
    id: &str,
) -> Result<(BoxState, Vec<BoxProcess>)> {
    let sandbox = rt.registry.get(&caller.tenant, id)?.meta;
    let host = host_for(rt, &sandbox)?;
    let workspace = sandbox.workspace();
    let state = host.state(&workspace).await;
    Ok((state, host.processes(&workspace).await))
}

/// Sends `signal` to process `pid` of sandbox `id`'s box (or its whole group): how many got
/// it.
pub async fn signal_box_process(
    rt: &Runtime,
    caller: &Caller,
    id: &str,
    pid: u32,
    signal: i32,
    group: bool,
) -> Result<usize> {
    let sandbox = rt.registry.get(&caller.tenant, id)?.meta;
    let host = host_for(rt, &sandbox)?;
    match host.signal(&sandbox.workspace(), pid, signal, group).await {
        Ok(Some(sent)) => Ok(sent),
        Ok(None) => Err(RuntimeError::ProcessNotFound {
            id: id.to_string(),
            process: format!("pid {pid}"),
        }),
        Err(e) => Err(RuntimeError::InvalidRequest { message: e.message }),
    }
}

/// Ends every process of sandbox `id`'s box but kiln's agent (resuming it first if it is
/// paused); its files, inside and outside the workspace, stay. How many were killed.
pub async fn restart_box(rt: &Runtime, caller: &Caller, id: &str) -> Result<usize> {
    let sandbox = rt.registry.get(&caller.tenant, id)?.meta;
    let host = host_for(rt, &sandbox)?;
    Ok(host.restart(&sandbox.workspace()).await)
}

/// Pauses (freezes) or resumes sandbox `id`'s box: where it stands after, and how long it
/// took.
pub async fn set_paused(
    rt: &Runtime,
    caller: &Caller,
    id: &str,
    paused: bool,
) -> Result<(BoxState, std::time::Duration)> {
    let sandbox = rt.registry.get(&caller.tenant, id)?.meta;
    let host = host_for(rt, &sandbox)?;
    let started = std::time::Instant::now();
    let state = host
        .set_paused(&sandbox.workspace(), paused, "asked")
        .await
        .map_err(|e| RuntimeError::Internal { message: e.message })?;
    Ok((state, started.elapsed()))
}

/// The TCP ports sandbox `id`'s box listens on.
pub async fn box_ports(
    rt: &Runtime,
    caller: &Caller,
    id: &str,
) -> Result<(BoxState, Vec<kiln_core::process::BoxPort>)> {
    let sandbox = rt.registry.get(&caller.tenant, id)?.meta;
    let host = host_for(rt, &sandbox)?;
    let workspace = sandbox.workspace();
    Ok((host.state(&workspace).await, host.ports(&workspace).await))
}

/// A connection to `port` inside `sandbox`'s box (for a preview).
pub async fn connect_box(
    rt: &Runtime,
    sandbox: &crate::sandbox::Sandbox,
    port: u16,
) -> Result<tokio::io::DuplexStream> {
    let host = host_for(rt, sandbox)?;
    if !sandbox.lifecycle.allows_port(port) {
        return Err(RuntimeError::PortNotAllowed {
            port,
            allowed: sandbox.lifecycle.allowed_ports.clone().unwrap_or_default(),
        });
    }
    awake(rt, sandbox).await?;
    host.connect(&sandbox.workspace(), port)
        .await
        .map_err(|e| RuntimeError::ProcessFailed { message: e.message })
}

/// Hibernates sandbox `id`'s box: its memory returned, its files kept; answers what became
/// of its processes.
pub async fn hibernate(
    rt: &Runtime,
    caller: &Caller,
    id: &str,
) -> Result<(BoxState, String, std::time::Duration)> {
    let sandbox = rt.registry.get(&caller.tenant, id)?.meta;
    let host = host_for(rt, &sandbox)?;
    let started = std::time::Instant::now();
    let (state, why) = host
        .hibernate(&sandbox.workspace(), "asked")
        .await
        .map_err(|e| RuntimeError::Internal { message: e.message })?;
    Ok((state, why, started.elapsed()))
}
