//! Live processes: programs that keep running in a sandbox while the client talks to them
//! (stdin, signals, a terminal's size) and that several clients may follow. The E2B facade's
//! process service stands on this seam; a backend whose sandboxes run real processes (Linux
//! boxes) implements [`ProcessHost`]. Unlike [`crate::backend::Backend::run_once`], a
//! process is not an execution with a result: it is started, followed and ended.

use std::future::Future;
use std::pin::Pin;

use crate::backend::BackendError;
use crate::{ExecRequest, TerminalSize};

/// A boxed future, for the object-safe traits below.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a process does, in order: output, then exactly one [`ProcessEvent::Exited`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProcessEvent {
    Stdout(bytes::Bytes),
    Stderr(bytes::Bytes),
    /// Output of a process on a terminal (stdout and stderr in one).
    Terminal(bytes::Bytes),
    /// It ended: its exit code, or the signal that killed it. Nothing follows.
    Exited {
        code: Option<i32>,
        signal: Option<i32>,
    },
}

/// What to start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessSpec {
    /// Program and arguments; never empty.
    pub argv: Vec<String>,
    /// Added to the sandbox's environment.
    pub env: Vec<(String, String)>,
    /// Default: where the sandbox's workspace is.
    pub cwd: Option<String>,
    /// Run on a terminal of this size.
    pub terminal: Option<TerminalSize>,
    /// Keep stdin open for [`Process::write_stdin`]; otherwise it reads end of file.
    pub stdin: bool,
}

/// A started process: its events come on the receiver handed out with it.
pub trait Process: Send + Sync {
    /// Its pid inside the sandbox.
    fn pid(&self) -> u32;
    /// Writes to its stdin (or terminal); `eof` closes stdin after `data`.
    fn write_stdin(&self, data: Vec<u8>, eof: bool) -> BoxFuture<'_, Result<(), BackendError>>;
    /// Sends a signal to its process group.
    fn signal(&self, signal: i32) -> BoxFuture<'_, Result<(), BackendError>>;
    /// Resizes its terminal.
    fn resize(&self, size: TerminalSize) -> BoxFuture<'_, Result<(), BackendError>>;
    /// Kills it because its sandbox is going: as `signal(SIGKILL)`, except that a process
    /// of a hibernated box is not woken to be killed (it goes with its checkpoint).
    fn end(&self) -> BoxFuture<'_, Result<(), BackendError>> {
        self.signal(9)
    }
}

/// The events of a started process.
pub type ProcessEvents = tokio::sync::mpsc::UnboundedReceiver<ProcessEvent>;

/// A started process and its events.
pub type Started = (Box<dyn Process>, ProcessEvents);

/// What a sandbox's box uses now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BoxUsage {
    /// CPU time used since the box started, in microseconds.
    pub cpu_us: u64,
    /// Memory in use, in bytes.
    pub memory_bytes: u64,
}

/// One process in a sandbox's box, as the box sees it (its pids, its uids).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BoxProcess {
    pub pid: u32,
    /// Its parent (0 for the box's first process, kiln's agent).
    pub ppid: u32,
    /// Its process group (what a group signal reaches).
    pub pgid: u32,
    /// Its user inside the box (0 root, 1000 the box's user).
    pub uid: u32,
    /// The program's name (the kernel's, up to 15 bytes).
    pub name: String,
    /// Its command line (cut at 4 KiB; empty for a zombie).
    pub argv: Vec<String>,
    /// One letter, as `ps` shows it: R running, S sleeping, D in a disk wait, T stopped,
    /// Z a zombie.
    pub state: String,
    /// When it started, in milliseconds since the Unix epoch.
    pub started_ms: u64,
    /// CPU time it used (user and system), in milliseconds.
    pub cpu_ms: u64,
    /// Its resident memory, in bytes.
    pub memory_bytes: u64,
    /// Whether it is kiln's agent (the box's pid 1): it cannot be signalled.
    pub agent: bool,
}

/// A TCP port a process of the box listens on.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BoxPort {
    pub port: u16,
    /// The address it listens on (`0.0.0.0`, `127.0.0.1`, `::`, …).
    pub address: String,
    /// Whether kiln reaches it (a preview connects to `127.0.0.1:port` in the box, which a
    /// socket on a wildcard or loopback address takes).
    pub reachable: bool,
    /// The listening process, where the box still shows it.
    pub pid: Option<u32>,
    pub name: Option<String>,
}

/// Where a sandbox's box stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BoxState {
    /// No box runs (none started yet, or it idled out): the next command starts one.
    Stopped,
    Running,
    /// Frozen: its processes keep their memory and do nothing until resumed.
    Paused,
    /// Put away: its memory returned to the host and its files kept (the workspace and what
    /// the box wrote outside it); the next command starts a box from them.
    Hibernated,
}

/// A change of a sandbox's box: where it stands now, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BoxEvent {
    /// The sandbox's workspace (what names its box).
    pub workspace: std::path::PathBuf,
    pub state: BoxState,
    /// Why, in a few words (`idle`, `a command`, `preview traffic`, `asked`, …).
    pub reason: String,
}

/// What becomes of a sandbox's box that nothing uses: no command, process, terminal or
/// preview connection holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdlePolicy {
    /// How long a box may run nothing before `action`.
    pub idle: std::time::Duration,
    pub action: IdleAction,
    /// How long a box stays paused before it is hibernated (`None`: it stays paused).
    pub hibernate_after: Option<std::time::Duration>,
}

impl IdlePolicy {
    /// This policy with a sandbox's own choices in place of its defaults.
    pub fn with(self, own: &IdleOverrides) -> IdlePolicy {
        IdlePolicy {
            idle: own.idle.unwrap_or(self.idle),
            action: own.action.unwrap_or(self.action),
            hibernate_after: own.hibernate_after.or(self.hibernate_after),
        }
    }
}

/// A sandbox's own idle policy, where it differs from its backend's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct IdleOverrides {
    pub idle: Option<std::time::Duration>,
    pub action: Option<IdleAction>,
    pub hibernate_after: Option<std::time::Duration>,
}

impl IdleOverrides {
    pub fn is_default(&self) -> bool {
        *self == IdleOverrides::default()
    }
}

/// What an idle box gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum IdleAction {
    /// Frozen with everything in it; the next command resumes it.
    Pause,
    /// Closed: the workspace and what the box wrote outside it stay, its processes end.
    Stop,
    /// Hibernated: as `Stop`, and the sandbox shows `hibernated` until its next command.
    Hibernate,
}

impl BoxState {
    /// Its name, as the API shows it (`stopped`, `running`, `paused`, `hibernated`).
    pub fn name(self) -> &'static str {
        match self {
            BoxState::Stopped => "stopped",
            BoxState::Running => "running",
            BoxState::Paused => "paused",
            BoxState::Hibernated => "hibernated",
        }
    }
}

/// A backend that starts live processes in a sandbox. `request` carries the sandbox: its
/// template, workspace (and where the guest sees it), network, resources and memory limit;
/// its code is not used. The box of a sandbox is named by its workspace.
/// A sandbox's box started ahead of need: see [`ProcessHost::prestarted`].
pub struct Prestarted {
    /// The folder that becomes the sandbox's (renamed; on the same file system as the
    /// sandboxes): its volume's image `volume.img` and its mounted `volume/`, with the
    /// `workspace/` the box already binds.
    pub dir: std::path::PathBuf,
    /// The backend's hold on the box (dropped: the box and whatever is left of the folder go).
    pub hold: Box<dyn std::any::Any + Send>,
}

impl std::fmt::Debug for Prestarted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prestarted")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

pub trait ProcessHost: Send + Sync + 'static {
    /// Its warm pools as they stand (none where it keeps none).
    fn pools(&self) -> Vec<crate::pool::PoolStats> {
        Vec::new()
    }

    /// A box started ahead of need for a new sandbox of `request` (its template, resources,
    /// memory, network and workspace place; no workspace yet), claimed from the template's
    /// warm pool as its policy says; `None` where no pool serves such a sandbox. The
    /// sandbox's store renames [`Prestarted::dir`] into the sandbox's place, then
    /// [`ProcessHost::adopt`] hands it the box. Dropped instead, the box is destroyed.
    fn prestarted<'a>(
        &'a self,
        request: &'a ExecRequest,
    ) -> BoxFuture<'a, Result<Option<Prestarted>, BackendError>> {
        let _ = request;
        Box::pin(async { Ok(None) })
    }

    /// Gives the box of `prestarted` to the sandbox whose workspace is `request.workspace`
    /// (its folder now where [`Prestarted::dir`] was): its first command finds it running.
    fn adopt<'a>(&'a self, prestarted: Prestarted, request: &'a ExecRequest) -> BoxFuture<'a, ()> {
        let _ = (prestarted, request);
        Box::pin(async {})
    }

    fn start<'a>(
        &'a self,
        request: &'a ExecRequest,
        spec: ProcessSpec,
    ) -> BoxFuture<'a, Result<Started, BackendError>>;

    /// What the live box of `workspace` uses now; `None` when none runs.
    fn usage<'a>(&'a self, workspace: &'a std::path::Path) -> BoxFuture<'a, Option<BoxUsage>>;

    /// Where the box of `workspace` stands.
    fn state<'a>(&'a self, workspace: &'a std::path::Path) -> BoxFuture<'a, BoxState>;

    /// The processes of the box of `workspace` (none when no box runs).
    fn processes<'a>(&'a self, workspace: &'a std::path::Path) -> BoxFuture<'a, Vec<BoxProcess>>;

    /// Sends `signal` to process `pid` (as the box numbers it), or with `group` to every
    /// process of its group: how many got it, `None` when the box has no such pid (or no box
    /// runs). The agent is refused ([`crate::backend::ErrorKind::Limits`]).
    fn signal<'a>(
        &'a self,
        workspace: &'a std::path::Path,
        pid: u32,
        signal: i32,
        group: bool,
    ) -> BoxFuture<'a, Result<Option<usize>, BackendError>>;

    /// Kills every process of the box of `workspace` but the agent (resuming it first if it
    /// is paused): its files stay. How many were killed (0 when no box runs).
    fn restart<'a>(&'a self, workspace: &'a std::path::Path) -> BoxFuture<'a, usize>;

    /// The TCP ports the box of `workspace` listens on (none when no box runs).
    fn ports<'a>(&'a self, workspace: &'a std::path::Path) -> BoxFuture<'a, Vec<BoxPort>>;

    /// A connection to `127.0.0.1:port` inside the box of `workspace` (a paused box is
    /// resumed first): a stream whose bytes go both ways until either side closes.
    fn connect<'a>(
        &'a self,
        workspace: &'a std::path::Path,
        port: u16,
    ) -> BoxFuture<'a, Result<tokio::io::DuplexStream, BackendError>>;

    /// Hibernates the box of `workspace`: its memory goes back to the host, its files stay,
    /// and the next command brings a box back. Answers what became of its processes (kiln
    /// checkpoints none yet: they end, and the answer says why).
    /// `reason` says who asked, for the sandbox's events ([`BoxEvent`]).
    fn hibernate<'a>(
        &'a self,
        workspace: &'a std::path::Path,
        reason: &'a str,
    ) -> BoxFuture<'a, Result<(BoxState, String), BackendError>>;

    /// Freezes (`paused`) or thaws the box of `workspace`. A box that is not running is
    /// remembered as paused all the same, and resumes with the next command.
    fn set_paused<'a>(
        &'a self,
        workspace: &'a std::path::Path,
        paused: bool,
        reason: &'a str,
    ) -> BoxFuture<'a, Result<BoxState, BackendError>>;

    /// The changes of every box's state, as they happen (`None`: this host tells none).
    fn subscribe(&self) -> Option<tokio::sync::broadcast::Receiver<BoxEvent>> {
        None
    }

    /// The boxes paused now (their workspaces), each with how long it has been paused.
    fn paused(&self) -> BoxFuture<'_, Vec<(std::path::PathBuf, std::time::Duration)>> {
        Box::pin(async { Vec::new() })
    }

    /// Applies a sandbox's egress rules to the live box of `workspace` now (`None`: the
    /// operator's list alone); a box started later gets them from its requests. Default:
    /// this host has no network to rule.
    fn set_egress<'a>(
        &'a self,
        _workspace: &'a std::path::Path,
        _grant: Option<crate::net::EgressGrant>,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async { Ok(()) })
    }

    /// Where the placeholders of header rules are filled from (kiln's secrets store).
    fn use_secrets(&self, _secrets: std::sync::Arc<dyn crate::net::SecretSource>) {}

    /// Holds the box of `workspace` still while `copy` copies its files: no command, terminal
    /// or preview reaches it meanwhile, and a running box is paused around it (and resumed
    /// after). With `processes_into`, its processes are checkpointed there first (a folder
    /// made afresh, out of every guest's reach), consistent with the files `copy` sees; a
    /// hibernated box's checkpoint is copied there instead. Answers what became of the
    /// processes; `copy` runs whatever the answer (on a blocking thread).
    /// Default: this host keeps no processes; `copy` runs as it is.
    fn snapshot<'a>(
        &'a self,
        workspace: &'a std::path::Path,
        processes_into: Option<&'a std::path::Path>,
        copy: Box<dyn FnOnce() + Send + 'static>,
    ) -> BoxFuture<'a, Result<SnapshotProcesses, BackendError>> {
        let _ = (workspace, processes_into);
        Box::pin(async move {
            tokio::task::spawn_blocking(copy)
                .await
                .map_err(|e| BackendError::new(crate::backend::ErrorKind::Setup, e.to_string()))?;
            Ok(SnapshotProcesses {
                carried: false,
                said: "this host checkpoints no processes: only the files were taken".into(),
            })
        })
    }

    /// Starts the box of the new sandbox of `request` (its workspace holding a snapshot's
    /// files) from the checkpoint of processes `from` (written by [`ProcessHost::snapshot`];
    /// copied, not used up): its processes go on from where the snapshot took them. `Err`:
    /// why they could not (the sandbox keeps its files; its next command starts a fresh box).
    fn restore_from<'a>(
        &'a self,
        request: &'a ExecRequest,
        from: &'a std::path::Path,
    ) -> BoxFuture<'a, Result<String, String>> {
        let _ = (request, from);
        Box::pin(async { Err("this host restores no processes".to_string()) })
    }
}

/// What a snapshot kept of a box's processes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotProcesses {
    /// Whether its processes were checkpointed with it.
    pub carried: bool,
    /// What was kept, or why the processes were not (in plain words).
    pub said: String,
}

impl std::fmt::Debug for dyn ProcessHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ProcessHost")
    }
}
