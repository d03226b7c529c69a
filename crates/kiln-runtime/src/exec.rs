//! Running code in a sandbox: the one path every face (the published contract, /api/v1,
//! streaming, WebSocket) goes through. It marks the sandbox busy, writes uploaded files,
//! runs the code in a worker (one-shot or a session turn), records the workspace change as a
//! git commit, and counts the execution.

use std::sync::Arc;
use std::time::Instant;

use kiln_core::{ExecRequest, ExecResult, Language, Limits, Outcome};
use kiln_executor::{CallOptions, Chunk, Share};
use tokio::sync::mpsc;

use crate::Runtime;
use crate::auth::Caller;
use crate::error::{Result, RuntimeError};
use crate::history::{LeftOut, Recorded};
use crate::quota::Quotas;
use crate::sandbox::{Registry, Sandbox, SandboxSpec, now_ms};
use kiln_workspace::{RelPath, Tree};

mod command_line;

pub use command_line::{CommandLine, CommandLineError, CommandProgram, parse_command_line};

/// The default longest single execution: 5 minutes (bounded by the sandbox's remaining
/// lifetime). An operator sets another in `RuntimeConfig::max_exec_ms`
/// (`kiln serve --max-exec-time`).
pub const MAX_EXEC_MS: u64 = 5 * 60 * 1000;

/// What to run.
#[derive(Debug)]
pub struct RunSpec {
    /// The id this execution is known by (history, cancel, results).
    pub exec_id: String,
    pub language: Language,
    pub code: String,
    pub stdin: Vec<u8>,
    pub env: Vec<(String, String)>,
    /// Per-execution time limit; default (and most) the sandbox's remaining life, at most
    /// the runtime's `max_exec_ms` ([`MAX_EXEC_MS`] unless configured).
    pub timeout_ms: Option<u64>,
    /// An instruction budget in fuel units (WebAssembly one-shots; see
    /// [`Limits::fuel`]); `None`: none, only the deadline.
    pub fuel: Option<u64>,
    /// Files to write into the workspace first (already checked paths).
    pub files: Vec<(RelPath, Vec<u8>)>,
    /// Run the program in this workspace file instead of `code` (read once the sandbox is
    /// busy with this run). A Python program runs as `python FILE ARGS…` would
    /// ([`python_launcher`]).
    pub code_file: Option<RelPath>,
    /// The program file's arguments (`sys.argv[1:]`).
    pub args: Vec<String>,
    /// Run as a turn of this session instead of a fresh one-shot.
    pub session: Option<String>,
    /// Run this argv instead of code, where the sandbox's template runs commands (Linux).
    pub command: Option<Vec<String>>,
    /// The folder whose new and changed files come back with the result
    /// ([`crate::outputs`]); `out` when the request names none.
    pub output_dir: Option<RelPath>,
    /// The history message.
    pub summary: String,
    /// Told once the sandbox is busy with this run (from then on a cancel reaches it).
    pub begun: Option<tokio::sync::oneshot::Sender<()>>,
}

/// What a run produced.
#[derive(Debug)]
pub struct RunOutcome {
    pub exec_id: String,
    pub result: ExecResult,
    pub limits: Limits,
    /// The commit recording the files it changed, if any.
    pub commit_id: Option<String>,
    /// Set when the change could not be recorded in the history (the code ran; its result
    /// is here, but its files are not in the history).
    pub history_warning: Option<String>,
    /// What the commit left out (files over the size history records, fifos, devices).
    pub left_out: Vec<LeftOut>,
    /// Files the run added or changed under its output folder.
    pub outputs: Vec<crate::outputs::OutputFile>,
}

impl RunOutcome {
    /// `success`, `error` or `timeout`.
    pub fn status(&self) -> &'static str {
        match self.result.outcome {
            Outcome::TimedOut => "timeout",
            _ if self.result.success() => "success",
            _ => "error",
        }
    }

    /// Whether the history holds what this run did to the files (true also when it changed
    /// nothing).
    pub fn history_recorded(&self) -> bool {
        self.history_warning.is_none()
    }

    /// Warnings for the client: the change was not recorded, or parts of it were left out.
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings: Vec<String> = self.history_warning.iter().cloned().collect();
        for left in &self.left_out {
            let why = match left.reason.as_str() {
                "too_large" => "it is larger than the 64 MiB history records",
                "special" => "it is a fifo, socket or device",
                _ => "the workspace has more than 100 000 entries",
            };
            warnings.push(format!(
                "{} was not recorded in the history: {why}",
                left.path
            ));
        }
        warnings
    }

    /// stderr with kiln's one-line reason appended for ends that were not the guest's own.
    pub fn stderr_with_reason(&self) -> String {
        let mut stderr = self.result.stderr_text();
        if let Some(reason) = self.result.outcome.reason(&self.limits) {
            stderr.push_str(&format!("kiln: {reason}\n"));
        }
        let budget = Limits::default().fs_write_bytes;
        if self.result.fs_refused && self.limits.fs_write_bytes < budget {
            // The tenant's workspace quota, not the per-execution budget, was what ran out.
            stderr.push_str(&format!(
                "kiln: the workspace quota is reached: this execution could write {} MiB more, and writes beyond failed with ENOSPC; remove files from your sandboxes, or ask for a larger quota\n",
                self.limits.fs_write_bytes >> 20
            ));
        } else if let Some(reason) = self.result.fs_reason(&self.limits) {
            stderr.push_str(&format!("kiln: {reason}\n"));
        }
        stderr
    }
}

/// Most files one `files` map (or upload) may write: the same as one execution may create.
pub const MAX_FILES: usize = 1000;

/// Writes files into a workspace, durably, never through a link the guest planted.
pub fn write_files(tree: &Tree, files: &[(RelPath, Vec<u8>)]) -> Result<()> {
    for (target, content) in files {
        tree.write(target, &mut content.as_slice())?;
    }
    Ok(())
}

/// Records what a change did to the workspace as change `id`, notes the workspace's size
/// for the tenant's quota, then packs the history in the background now and then. Blocking:
/// call it off the async threads.
pub fn record(registry: &Registry, sandbox: &Sandbox, summary: &str, id: &str) -> Result<Recorded> {
    let recorded = sandbox.history()?.record(&sandbox.tree()?, summary, id)?;
    note_recorded(registry, sandbox, &recorded);
    Ok(recorded)
}

/// After a change was committed (a run, an upload, a rollback): notes the workspace's size
/// for the tenant's quota, and packs the history in the background now and then.
pub fn note_recorded(registry: &Registry, sandbox: &Sandbox, recorded: &Recorded) {
    // A sandbox on a volume of its own is counted by the blocks its files really use (a
    // sparse file's size is not disk); others by their files' sizes.
    let bytes = if sandbox.volume {
        crate::processes::disk_used(sandbox)
    } else {
        recorded.bytes
    };
    registry.set_workspace_bytes(&sandbox.id, bytes);
    if recorded.commit_id.is_some() {
        pack_in_background(sandbox);
    }
}

/// Packs a sandbox's history off the request path when it has gathered many loose objects.
pub fn pack_in_background(sandbox: &Sandbox) {
    let git_dir = sandbox.git_dir();
    if !crate::history::pack_check_due(&git_dir) {
        return;
    }
    let id = sandbox.id.clone();
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        return;
    };
    handle.spawn_blocking(move || {
        let packed = crate::history::History::open(&git_dir).and_then(|h| h.pack_if_due());
        match packed {
            Ok(true) => tracing::debug!(sandbox = %id, "packed the workspace history"),
            Ok(false) => {}
            Err(e) => tracing::warn!(sandbox = %id, "could not pack the workspace history: {e}"),
        }
    });
}

/// Runs `work` to its end even if the request that started it goes away: a client that
/// disconnects or a request timeout must not leave a sandbox marked busy or a change
/// unrecorded.
pub async fn detached<T: Send + 'static>(
    work: impl Future<Output = Result<T>> + Send + 'static,
) -> Result<T> {
    tokio::spawn(work).await.map_err(task_failed)?
}

/// Runs blocking `work` off the async threads, to its end even if the caller stops waiting.
pub async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(task_failed)?
}

/// Runs blocking `work` on sandbox `id` of `caller` while the sandbox is busy with it (no
/// code runs meanwhile, so links cannot be swapped under a check); the sandbox is released
/// when the work ends, even if the caller stops waiting.
pub async fn with_sandbox<T: Send + 'static>(
    rt: &Arc<Runtime>,
    caller: &Caller,
    id: &str,
    work_id: &str,
    work: impl FnOnce(&Runtime, Sandbox) -> Result<T> + Send + 'static,
) -> Result<T> {
    let (sandbox, _cancel, _) = rt.registry.begin(&caller.tenant, id, work_id, None)?;
    let rt = rt.clone();
    blocking(move || {
        let id = sandbox.id.clone();
        let done = work(&rt, sandbox);
        rt.registry.finish(&id, None).and(done)
    })
    .await
}

/// A task of the runtime's own panicked or was cancelled.
pub fn task_failed(error: tokio::task::JoinError) -> RuntimeError {
    RuntimeError::internal(format!("a background task failed: {error}"))
}

/// Creates a sandbox of `caller` off the async threads (git init and fsyncs block), to its
/// end even if the request goes away.
pub async fn create_sandbox(
    rt: &Arc<Runtime>,
    caller: &Caller,
    mut spec: SandboxSpec,
) -> Result<Sandbox> {
    let quotas = rt.quotas(caller);
    spec.key_id = Some(caller.key_id.clone());
    spec.egress_widen = caller.network_widen;
    if let Some(cap) = rt.max_life_ms {
        let own = spec.lifecycle.max_duration_ms.map_or(cap, |m| m.min(cap));
        spec.lifecycle.max_duration_ms = Some(own);
        spec.lifetime_ms = spec.lifetime_ms.min(own);
    }
    // A Linux sandbox's box comes from its template's warm pool where one serves it, its
    // folder renamed into the sandbox's place (checked against the quota first, so a tenant
    // over it cannot drain the pool).
    let host = rt
        .catalogue()
        .get(&spec.template)
        .filter(|t| t.capabilities.processes && spec.resources.is_some())
        .and_then(|t| rt.processes.host_of(t.backend));
    let mut prestarted = None;
    let mut box_request = None;
    if let Some(host) = &host {
        rt.registry.usage(&caller.tenant).check_sandbox(&quotas)?;
        let request = prestart_request(rt, &spec);
        prestarted = host.prestarted(&request).await.map_err(|e| match e.kind {
            kiln_core::backend::ErrorKind::Busy => RuntimeError::Saturated { message: e.message },
            _ => {
                RuntimeError::internal(format!("could not start the sandbox's box: {}", e.message))
            }
        })?;
        box_request = Some(request);
    }
    let adopt = prestarted.as_ref().map(|p| p.dir.clone());
    let (runtime, tenant) = (rt.clone(), caller.tenant.clone());
    // Blocking work runs to its end even when the caller stops waiting.
    let made = blocking(move || runtime.registry.create_in(&tenant, &spec, &quotas, adopt)).await;
    let made = match made {
        Ok(made) => made,
        Err(e) => {
            // The claimed box goes (its folder went with the failed sandbox's).
            if let Some(p) = prestarted {
                let _ = tokio::task::spawn_blocking(move || drop(p)).await;
            }
            return Err(e);
        }
    };
    if let (Some(host), Some(p), Some(mut request)) = (host, prestarted, box_request) {
        request.workspace = Some(made.workspace());
        host.adopt(p, &request).await;
    }
    rt.events.record(&made.id, "created", made.template());
    Ok(made)
}

/// The request a sandbox of `spec`'s box would be started for (its first command's, less the
/// command and the workspace).
fn prestart_request(rt: &Runtime, spec: &SandboxSpec) -> ExecRequest {
    let mut request = ExecRequest::new(spec.language, String::new());
    request.template = rt.request_template(&spec.template, spec.language);
    request.network = spec.network;
    // A sandbox with volumes starts a box of its own (pool members mount none).
    request.mounts = spec
        .volume_mounts
        .iter()
        .map(|m| kiln_core::Mount {
            host: rt.registry.volumes.content(&m.volume),
            guest: m.path.clone(),
            writable: !m.read_only,
        })
        .collect();
    request.resources = spec.resources;
    request.workspace_at = spec.workspace_at.clone();
    request.idle = spec.lifecycle.box_policy();
    request.limits.memory_bytes = spec.memory_bytes;
    request
}

/// Creates a sandbox of `language`'s preferred template (the WebAssembly one for python and
/// javascript, a Linux one for go and bash) with the default lifetime and memory.
pub async fn create_default_sandbox(
    rt: &Arc<Runtime>,
    caller: &Caller,
    language: kiln_core::Language,
) -> Result<Sandbox> {
    let template = rt.executors.preferred_template(language)?;
    let spec = SandboxSpec {
        // The language asked for, which need not be the template's first.
        language,
        ..SandboxSpec::of_template(
            language.name(),
            template,
            crate::sandbox::DEFAULT_LIFETIME_MS,
            Limits::default().memory_bytes,
        )
    };
    create_sandbox(rt, caller, spec).await
}

/// Runs `spec` in sandbox `id` of `caller`, streaming output to `chunks` if given. The run
/// goes on to its end (and is recorded) even if the caller stops waiting.
pub async fn run(
    rt: &Arc<Runtime>,
    caller: &Caller,
    id: &str,
    spec: RunSpec,
    chunks: Option<mpsc::UnboundedSender<Chunk>>,
) -> Result<RunOutcome> {
    let (rt, caller, id) = (rt.clone(), caller.clone(), id.to_owned());
    detached(async move { run_attached(&rt, &caller, &id, spec, chunks).await }).await
}

async fn run_attached(
    state: &Arc<Runtime>,
    caller: &Caller,
    id: &str,
    mut spec: RunSpec,
    chunks: Option<mpsc::UnboundedSender<Chunk>>,
) -> Result<RunOutcome> {
    let quotas = state.quotas(caller);
    let (sandbox, cancel, usage) =
        state
            .registry
            .begin(&caller.tenant, id, &spec.exec_id, Some(&quotas))?;
    // Over the tenant's executions quota it waits in the tenant's line, the sandbox held
    // busy for it; refused past the line's bounds.
    let _place = match state
        .admission
        .admit(&caller.tenant, quotas.executions)
        .await
    {
        Ok(place) => place,
        Err(refused) => {
            state.registry.finish(&sandbox.id, None)?;
            return Err(refused);
        }
    };
    if let Some(begun) = spec.begun.take() {
        let _ = begun.send(());
    }
    let started = Instant::now();
    let share = Share {
        tenant: caller.tenant.clone(),
        weight: quotas.cpu_weight,
    };
    let room = usage.workspace_room(&quotas);
    let ran = run_in(state, &sandbox, &spec, chunks, cancel, share, &quotas, room).await;
    let ran_at = started.elapsed();
    // Record what the code did to the workspace, whatever the outcome (a timed-out run may
    // still have written files).
    // A run that wrote no files and whose backend saw it change none (`files_changed`), with
    // no upload beside it, left the workspace as it was: its history has nothing to record,
    // and the workspace is not walked.
    let unchanged = spec.files.is_empty()
        && matches!(&ran, Ok((result, _)) if result.files_changed == Some(false))
        && !state.registry.files_written_beside(&sandbox.id);
    let recorded = if unchanged {
        Ok((Recorded::default(), Vec::new()))
    } else {
        record_run(state, &sandbox, &spec).await
    };
    let committed_at = started.elapsed();
    let duration_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    let executed = ran.as_ref().ok().map(|_| duration_ms);
    state.registry.finish(&sandbox.id, executed)?;
    tracing::debug!(
        target: "kiln::timing",
        exec_id = %spec.exec_id,
        run_ms = ran_at.as_secs_f64() * 1000.0,
        guest_ms = ran.as_ref().map_or(0.0, |(r, _)| r.duration_us as f64 / 1000.0),
        commit_ms = (committed_at - ran_at).as_secs_f64() * 1000.0,
        finish_ms = (started.elapsed() - committed_at).as_secs_f64() * 1000.0,
        "execution phases"
    );
    let (result, limits) = ran?;
    state.metrics.execution(sandbox.language, &result);
    // The code ran: its result is the answer even when its files could not be recorded (a
    // retrying client would run it twice).
    let (commit_id, left_out, history_warning, outputs) = match recorded {
        Ok((recorded, outputs)) => (recorded.commit_id, recorded.left_out, None, outputs),
        Err(e) => {
            tracing::error!(sandbox = %sandbox.id, exec_id = %spec.exec_id, "the change was not recorded: {e}");
            (
                None,
                Vec::new(),
                Some(format!(
                    "the files this run changed were not recorded in the history: {e}"
                )),
                Vec::new(),
            )
        }
    };
    Ok(RunOutcome {
        exec_id: spec.exec_id,
        result,
        limits,
        commit_id,
        history_warning,
        left_out,
        outputs,
    })
}

/// Records what a run did to `sandbox`'s workspace (off the async threads), with the files
/// it added or changed under its output folder.
async fn record_run(
    state: &Arc<Runtime>,
    sandbox: &Sandbox,
    spec: &RunSpec,
) -> Result<(Recorded, Vec<crate::outputs::OutputFile>)> {
    let (registry, sandbox) = (state.clone(), sandbox.clone());
    let (summary, exec_id) = (spec.summary.clone(), spec.exec_id.clone());
    let output_dir = spec.output_dir.clone();
    tokio::task::spawn_blocking(move || {
        let recorded = record(&registry.registry, &sandbox, &summary, &exec_id)?;
        let outputs = match &recorded.commit_id {
            Some(_) => {
                let dir = output_dir.unwrap_or_else(default_output_dir);
                crate::outputs::collect(&sandbox, &exec_id, &dir)
            }
            None => Vec::new(),
        };
        Ok((recorded, outputs))
    })
    .await
    .unwrap_or_else(|e| Err(RuntimeError::internal(format!("history task failed: {e}"))))
}

/// `out`, the output folder when a request names none.
fn default_output_dir() -> RelPath {
    RelPath::parse(crate::outputs::DEFAULT_OUTPUT_DIR).expect("a valid relative path")
}

/// What a run executes: its code, or its program file (read now, while the sandbox is busy
/// with the run).
fn program_code(state: &Runtime, sandbox: &Sandbox, spec: &RunSpec) -> Result<String> {
    let Some(name) = &spec.code_file else {
        return Ok(spec.code.clone());
    };
    let source = read_program(&sandbox.tree()?, name)?;
    // The command line's semantics (CPython's, Node's), where kiln's own language runtimes
    // run it (WebAssembly); a template with commands runs the command itself, and the test
    // backend (a toy language) reads the source. (Which runtime implements the language is
    // the backend's kind, not a capability.)
    let wasm = state
        .catalogue()
        .get(sandbox.template())
        .is_some_and(|t| t.backend == kiln_core::template::BackendKind::Wasm);
    let home = sandbox
        .workspace_at
        .as_deref()
        .unwrap_or(kiln_core::WORKSPACE_GUEST);
    Ok(match spec.language {
        Language::Python if wasm => {
            python_launcher_at(&PythonProgram::Script(name.as_str()), &spec.args, home)
        }
        Language::JavaScript if wasm => javascript_launcher_at(name.as_str(), &spec.args, home),
        _ => source,
    })
}

#[expect(
    clippy::too_many_arguments,
    reason = "one run's parts, each from a different place in `run`"
)]
async fn run_in(
    state: &Runtime,
    sandbox: &Sandbox,
    spec: &RunSpec,
    chunks: Option<mpsc::UnboundedSender<Chunk>>,
    cancel: tokio::sync::oneshot::Receiver<()>,
    share: Share,
    quotas: &Quotas,
    workspace_room: u64,
) -> Result<(ExecResult, Limits)> {
    crate::processes::awake(state, sandbox).await?;
    // Most runs send no files and name no program file: no workspace handle is opened for
    // them (recording the change opens its own, off the async threads).
    if !spec.files.is_empty() {
        write_files(&sandbox.tree()?, &spec.files)?;
    }
    let code = program_code(state, sandbox, spec)?;
    let remaining_ms = sandbox.expires_ms.saturating_sub(now_ms()).max(1);
    let mut limits = Limits {
        memory_bytes: sandbox.memory_bytes,
        timeout_ms: remaining_ms.min(state.max_exec_ms),
        ..Limits::default()
    };
    if let Some(timeout_ms) = spec.timeout_ms {
        limits.timeout_ms = limits.timeout_ms.min(timeout_ms.max(1));
    }
    limits.fuel = spec.fuel;
    // The tenant's workspace quota bounds what this run may write.
    limits.fs_write_bytes = limits.fs_write_bytes.min(workspace_room);
    let options = CallOptions {
        chunks,
        cancel: Some(cancel),
        door: None,
        share: Some(share),
    };
    let result = match &spec.session {
        None => {
            let request = one_shot(state, sandbox, spec, code, &limits);
            state
                .pool_for(sandbox.template())?
                .execute_with(request, options)
                .await
        }
        Some(session) => {
            let (_, handle) = state
                .registry
                .session(&sandbox.tenant, &sandbox.id, session)?;
            let Some(handle) = handle else {
                return Err(RuntimeError::session_lost(&sandbox.id, session));
            };
            // A measured session's turn may grow it only by what the tenant's session
            // memory quota has left (reserved while it runs).
            let mut turn_limits = limits.clone();
            let measured = state.measures_sessions(sandbox.template());
            if measured {
                turn_limits.session_growth_bytes = Some(state.registry.grant_turn(
                    &sandbox.tenant,
                    &sandbox.id,
                    quotas,
                ));
            }
            let ran = match state.pool_for(sandbox.template()) {
                Ok(pool) => pool.run_with(&handle, code, turn_limits, options).await,
                Err(e) => {
                    state.registry.end_turn(&sandbox.id, session, None);
                    return Err(e);
                }
            };
            if measured {
                let holds = ran.as_ref().ok().and_then(|r| r.session_memory_bytes);
                state.registry.end_turn(&sandbox.id, session, holds);
            }
            match &ran {
                Ok(result) if result.outcome.ran_to_end() => {
                    state.registry.count_turn(&sandbox.id, session);
                }
                // A turn that timed out, crashed, was cancelled or lost its worker ended the
                // session's state.
                _ => {
                    if let Some(handle) = state.registry.drop_session_state(&sandbox.id, session) {
                        state.close_session(sandbox.template(), &handle).await;
                    }
                }
            }
            ran
        }
    };
    let result = result?;
    Ok((result, limits))
}

/// The request of a one-shot run in `sandbox`.
fn one_shot(
    state: &Runtime,
    sandbox: &Sandbox,
    spec: &RunSpec,
    code: String,
    limits: &Limits,
) -> ExecRequest {
    let mut request = ExecRequest::new(spec.language, code);
    request.template = state.request_template(sandbox.template(), spec.language);
    request.network = sandbox.network;
    request.egress = sandbox.egress_grant();
    request.mounts = sandbox.mounts(&state.registry.volumes);
    request.resources = sandbox.resources;
    request.command = spec.command.clone().map(|argv| kiln_core::Command {
        argv,
        cwd: None,
        terminal: None,
    });
    request.workspace = Some(sandbox.workspace());
    request.workspace_at = sandbox.workspace_at.clone();
    request.idle = sandbox.lifecycle.box_policy();
    request.stdin = spec.stdin.clone();
    request.env = sandbox_env(sandbox, &spec.env);
    request.limits = limits.clone();
    request
}

/// The sandbox's environment, with `extra` over it.
pub fn sandbox_env(sandbox: &Sandbox, extra: &[(String, String)]) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = sandbox
        .env
        .iter()
        .filter(|(k, _)| !extra.iter().any(|(e, _)| e == *k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    env.extend(extra.iter().cloned());
    env
}

/// What `python …` runs: a script, `-c` code or a `-m` module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PythonProgram<'a> {
    /// A file: relative to the workspace, or an absolute guest path.
    Script(&'a str),
    Inline(&'a str),
    Module(&'a str),
}

/// Code that runs `program` with `args` as CPython's command line would in `/workspace`:
/// `sys.argv` as given; for a script, its folder first on `sys.path`, `__file__` its absolute
/// path, `__name__ == "__main__"` and tracebacks naming the file and its lines; for `-c`,
/// `<string>`; for `-m`, the workspace on `sys.path` and `runpy` as CPython does.
pub fn python_launcher(program: &PythonProgram<'_>, args: &[String]) -> String {
    python_launcher_at(program, args, kiln_core::WORKSPACE_GUEST)
}

/// [`python_launcher`] for a guest that sees its workspace at `home`.
pub fn python_launcher_at(program: &PythonProgram<'_>, args: &[String], home: &str) -> String {
    let literal = |text: &str| serde_json::to_string(text).unwrap_or_else(|_| "''".into());
    let rest: Vec<String> = args.iter().map(|a| literal(a)).collect();
    let rest = rest.join(", ");
    let (argv0, path_entry, run) = match program {
        PythonProgram::Script(path) => {
            let absolute = if path.starts_with('/') {
                (*path).to_owned()
            } else {
                format!("{home}/{path}")
            };
            let folder = absolute.rsplit_once('/').map_or(home, |(dir, _)| dir);
            let file = literal(&absolute);
            (
                literal(path),
                literal(folder),
                format!(
                    "exec(compile(open({file}, 'rb').read(), {file}, 'exec'), {{'__name__': '__main__', '__file__': {file}, '__builtins__': __builtins__}})"
                ),
            )
        }
        PythonProgram::Inline(code) => (
            literal("-c"),
            literal(""),
            format!(
                "exec(compile({}, '<string>', 'exec'), {{'__name__': '__main__', '__builtins__': __builtins__}})",
                literal(code)
            ),
        ),
        PythonProgram::Module(module) => (
            literal(module),
            literal(home),
            format!(
                "__import__('runpy').run_module({}, run_name='__main__', alter_sys=True)",
                literal(module)
            ),
        ),
    };
    // A failure's traceback starts at the program's own frames, as CPython's does: this
    // launcher's and runpy's are left out.
    format!(
        "import sys as _kiln_sys\n\
         _kiln_sys.argv = [{argv0}, {rest}]\n\
         _kiln_sys.path.insert(0, {path_entry})\n\
         def _kiln_main():\n    \
             try:\n        \
                 {run}\n    \
             except SystemExit:\n        \
                 raise\n    \
             except BaseException as e:\n        \
                 tb = e.__traceback__\n        \
                 while tb is not None and (tb.tb_frame.f_code.co_filename.startswith('<turn') or tb.tb_frame.f_code.co_filename == '<frozen runpy>' or tb.tb_frame.f_code.co_filename.endswith('/runpy.py')):\n            \
                     tb = tb.tb_next\n        \
                 __import__('traceback').print_exception(type(e), e, tb)\n        \
                 raise SystemExit(1) from None\n\
         del _kiln_sys\n\
         _kiln_main()\n"
    )
}

/// Code that runs the JavaScript file `file` (relative to the workspace at `home`, or an
/// absolute guest path) with `args` as `node FILE ARG…` would, in kiln's QuickJS: the file
/// is imported as a module by its absolute path, so its relative imports resolve against
/// its folder and errors name its lines; `process.argv` is `[execPath, FILE, ARG…]` with
/// `FILE` absolute.
pub fn javascript_launcher_at(file: &str, args: &[String], home: &str) -> String {
    let literal = |text: &str| serde_json::to_string(text).unwrap_or_else(|_| "''".into());
    let absolute = if file.starts_with('/') {
        file.to_owned()
    } else {
        format!("{home}/{file}")
    };
    let argv: Vec<String> = std::iter::once(absolute.as_str())
        .chain(args.iter().map(String::as_str))
        .map(literal)
        .collect();
    format!(
        "globalThis[Symbol.for('kiln.argv')] = [{}];\nawait import({});\n",
        argv.join(", "),
        literal(&absolute)
    )
}

/// The most bytes of a program file kiln reads to run it.
const MAX_PROGRAM_BYTES: u64 = 16 * 1024 * 1024;

/// Reads the program in workspace file `name` (a regular file; never through a link).
fn read_program(tree: &Tree, name: &RelPath) -> Result<String> {
    let cannot = |why: String| RuntimeError::ProgramUnreadable {
        path: name.as_str().to_owned(),
        why,
    };
    let (file, meta) = tree.open_file(name).map_err(|e| match e {
        kiln_workspace::TreeError::NotFound { .. } => cannot("there is no such file".into()),
        other => other.into(),
    })?;
    if meta.size > MAX_PROGRAM_BYTES {
        return Err(cannot(format!(
            "it is larger than {MAX_PROGRAM_BYTES} bytes"
        )));
    }
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(
        &mut std::io::Read::take(file, MAX_PROGRAM_BYTES),
        &mut bytes,
    )
    .map_err(|e| cannot(e.to_string()))?;
    String::from_utf8(bytes).map_err(|_| cannot("it is not UTF-8 text".into()))
}

/// Most bytes one `files` map may carry (names and contents): 16 MiB.
pub const MAX_FILES_BYTES: usize = 16 << 20;

/// Checks files to upload: their count, total size and every name.
pub fn check_files<'a>(
    files: impl ExactSizeIterator<Item = (&'a String, &'a [u8])>,
) -> Result<Vec<(RelPath, Vec<u8>)>> {
    if files.len() > MAX_FILES {
        return Err(RuntimeError::TooManyFiles {
            sent: files.len(),
            limit: MAX_FILES,
        });
    }
    let mut total = 0usize;
    let mut out = Vec::new();
    for (name, content) in files {
        total += name.len() + content.len();
        if total > MAX_FILES_BYTES {
            return Err(RuntimeError::FilesTooLarge {
                limit: MAX_FILES_BYTES,
            });
        }
        out.push((crate::sandbox::workspace_path(name)?, content.to_vec()));
    }
    Ok(out)
}

/// The execution id prefix of a language.
pub fn exec_prefix(language: Language) -> &'static str {
    match language {
        Language::Python => "python_run_",
        Language::JavaScript => "node_run_",
        Language::Go => "go_run_",
        Language::Bash => "bash_run_",
    }
}

/// Whether work id `id` is an execution (rather than a file change or a rollback).
pub fn is_execution(id: &str) -> bool {
    Language::ALL
        .iter()
        .any(|language| id.starts_with(exec_prefix(*language)))
}

/// Code to run in a sandbox, as every face asks for it.
#[derive(Debug, Default, Clone)]
pub struct CodeExec {
    /// The program text.
    pub code: String,
    /// Default the sandbox's.
    pub language: Option<Language>,
    pub stdin: Vec<u8>,
    /// Environment variables the code sees (one-shots only; a session keeps its own).
    pub env: std::collections::BTreeMap<String, String>,
    /// Time limit; default (and most) [`MAX_EXEC_MS`] or what is left of the sandbox's life.
    pub timeout_ms: Option<u64>,
    /// An instruction budget in fuel units, 1..=[`kiln_core::MAX_FUEL`] (WebAssembly
    /// one-shots): the run stops with `fuel_exhausted` when it is spent. Default none.
    pub fuel: Option<u64>,
    /// Files to write into the workspace first (name → bytes).
    pub files: std::collections::BTreeMap<String, Vec<u8>>,
    /// Run as a turn of this session instead of a fresh one-shot.
    pub session: Option<String>,
    /// An argv to run instead of code, where the sandbox's template runs commands (Linux).
    pub command: Option<Vec<String>>,
    /// The workspace folder whose new and changed files come back with the result;
    /// default `out`.
    pub output_dir: Option<String>,
}

/// Checks a command against the sandbox's template.
fn check_command(rt: &Runtime, template: &str, exec: &CodeExec) -> Result<()> {
    let Some(argv) = &exec.command else {
        return Ok(());
    };
    let invalid = |message: &str| RuntimeError::InvalidOption {
        message: message.to_string(),
    };
    if argv.is_empty() || argv.iter().any(|a| a.contains('\0')) {
        return Err(invalid(
            "command must be a non-empty array of strings without NUL bytes",
        ));
    }
    if argv.len() > 4096 || argv.iter().map(String::len).sum::<usize>() > 1 << 20 {
        return Err(invalid("command is larger than 4096 arguments or 1 MiB"));
    }
    if !exec.code.is_empty() {
        return Err(invalid("give code or command, not both"));
    }
    if exec.session.is_some() {
        return Err(invalid("a command runs on its own, not as a session turn"));
    }
    let commands = rt
        .catalogue()
        .get(template)
        .is_some_and(|t| t.capabilities.commands);
    if !commands {
        return Err(RuntimeError::Unsupported {
            message: format!(
                "the {template} template runs code, not commands; create the sandbox from a Linux template (linux-python, python:3.11, node:18, …) to run commands"
            ),
        });
    }
    Ok(())
}

/// Checks an instruction budget: within range, for a one-shot, on a WebAssembly template.
fn check_fuel(rt: &Runtime, template: &str, exec: &CodeExec) -> Result<()> {
    let Some(fuel) = exec.fuel else {
        return Ok(());
    };
    let invalid = |message: String| Err(RuntimeError::InvalidOption { message });
    if !(1..=kiln_core::MAX_FUEL).contains(&fuel) {
        return invalid(format!(
            "fuel must be 1..={} (an instruction budget in fuel units, about one per WebAssembly instruction)",
            kiln_core::MAX_FUEL
        ));
    }
    if exec.session.is_some() {
        return invalid(
            "fuel applies to one-shot executions; a session turn runs without an instruction budget (leave out sessionId, or fuel)".into(),
        );
    }
    let fueled = rt
        .catalogue()
        .get(template)
        .is_some_and(|t| t.capabilities.fuel);
    if !fueled {
        return invalid(format!(
            "fuel applies to WebAssembly templates (python, javascript); the {template} template is bounded by timeoutMs"
        ));
    }
    Ok(())
}

/// Refuses an environment variable whose name is empty or holds `=` or NUL, or whose value
/// holds NUL.
pub fn check_env(env: &std::collections::BTreeMap<String, String>) -> Result<()> {
    match env
        .iter()
        .find(|(name, value)| name.is_empty() || name.contains(['=', '\0']) || value.contains('\0'))
    {
        Some((name, _)) => Err(RuntimeError::InvalidEnv {
            message: format!(
                "the environment variable {name:?} is not allowed: names are non-empty and hold no `=` or NUL; values hold no NUL"
            ),
        }),
        None => Ok(()),
    }
}

/// Checks `exec` against sandbox `id` of `caller` and turns it into a run.
pub fn prepare(rt: &Runtime, caller: &Caller, id: &str, exec: CodeExec) -> Result<RunSpec> {
    let view = rt.registry.get(&caller.tenant, id)?;
    let language = exec.language.unwrap_or(view.meta.language);
    if let Some(timeout) = exec.timeout_ms
        && (timeout == 0 || timeout > rt.max_exec_ms)
    {
        return Err(RuntimeError::InvalidOption {
            message: format!(
                "timeoutMs must be 1..={} (this server's longest execution; its operator sets it with --max-exec-time)",
                rt.max_exec_ms
            ),
        });
    }
    check_fuel(rt, view.meta.template(), &exec)?;
    check_env(&exec.env)?;
    if exec.session.is_some() && !exec.env.is_empty() {
        return Err(RuntimeError::InvalidEnv {
            message: "env applies to one-shot executions; a session keeps the environment it was opened with".into(),
        });
    }
    if let Some(session) = &exec.session {
        let (meta, _) = rt.registry.session(&caller.tenant, id, session)?;
        if meta.language != language {
            return Err(RuntimeError::UnsupportedLanguage {
                message: format!("session {session} runs {}", meta.language),
            });
        }
    }
    check_command(rt, view.meta.template(), &exec)?;
    let files = check_files(exec.files.iter().map(|(k, v)| (k, v.as_slice())))?;
    let output_dir = exec.output_dir.as_deref().map(output_dir).transpose()?;
    let summary = match &exec.command {
        Some(argv) => argv.join(" "),
        None => format!(
            "{} {}",
            language.name(),
            exec.code.lines().next().unwrap_or_default()
        ),
    };
    Ok(RunSpec {
        exec_id: crate::sandbox::new_id(exec_prefix(language)),
        language,
        code: exec.code,
        stdin: exec.stdin,
        env: exec.env.into_iter().collect(),
        timeout_ms: exec.timeout_ms,
        fuel: exec.fuel,
        files,
        code_file: None,
        args: Vec::new(),
        session: exec.session,
        command: exec.command,
        output_dir,
        summary,
        begun: None,
    })
}

/// An output folder a request names: a relative path in the workspace (`out`, `results/x`),
/// or the same under `/workspace/`.
pub fn output_dir(name: &str) -> Result<RelPath> {
    let relative = name
        .strip_prefix(&format!("{}/", kiln_core::WORKSPACE_GUEST))
        .unwrap_or(name);
    RelPath::parse(relative.trim_end_matches('/')).map_err(|e| RuntimeError::InvalidOption {
        message: format!("outputDir {name:?} is not a folder in the workspace: {e}"),
    })
}

/// A language by name, or the error every face shows for an unknown one.
pub fn language(name: &str) -> Result<Language> {
    Language::from_name(name).ok_or_else(|| RuntimeError::UnsupportedLanguage {
        message: format!("unknown language {name:?}; use python or javascript"),
    })
}
