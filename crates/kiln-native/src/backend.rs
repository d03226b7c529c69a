//! The Linux backend behind kiln's backend seam: [`NativeBackend`] implements
//! `kiln_core::backend::Backend`, so the runtime's executor pool, the API and every face run
//! Linux templates as they run WebAssembly ones: a sandbox's commands and code run in its live
//! box (one per workspace, started on first use, closed when the sandbox's workspace is gone
//! or after it idles), a request without a workspace in a fresh box of its own.
//!
//! In the catalogue a Linux template is `linux-NAME` (`linux-python`, `linux-node`,
//! `linux-go`, `linux-debian`), so `python` and `javascript` keep naming the WebAssembly fast
//! path; Docker-style images (`python:3.11-slim`, `node:18`, `golang:1.19`, `debian`,
//! `ubuntu`) resolve to the Linux templates that honour them.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_core::backend::{
    Backend, BackendError, BackendSession, Door, ErrorKind, OutputChunk, OutputSink, StreamKind,
};
use kiln_core::template::{
    BackendKind, Capabilities, ImageRule, Lifecycle, TemplateInfo, VersionRange,
};
use kiln_core::{ExecRequest, ExecResult, Language, Limits, Outcome};

use crate::boxes::{BoxSpec, Boxes, Exec, LiveBox};
use crate::builder::Template;
use crate::jail::BoxLimits;
use crate::proxy::Allowlist;

/// The catalogue id of a Linux template.
pub fn catalogue_id(name: &str) -> String {
    format!("linux-{name}")
}

/// A Linux template as the catalogue lists it.
pub fn template_info(template: &Template) -> TemplateInfo {
    let definition = &template.definition;
    let languages = definition
        .languages
        .iter()
        .filter_map(|l| match l.as_str() {
            "python" => Some(Language::Python),
            "javascript" => Some(Language::JavaScript),
            _ => None,
        })
        .collect();
    let versions: Vec<String> = template
        .built
        .versions
        .iter()
        .map(|(package, version)| format!("{package} {version}"))
        .collect();
    TemplateInfo {
        id: catalogue_id(&definition.name),
        description: format!("{} ({})", definition.description, versions.join(", ")),
        backend: BackendKind::Native,
        lifecycle: Lifecycle::Live,
        languages,
        capabilities: Capabilities {
            commands: true,
            ..Capabilities::default()
        },
        images: ImageRule {
            names: definition.images.names.clone(),
            repos: definition.images.repos.clone(),
            versions: definition
                .images
                .versions
                .as_deref()
                .and_then(crate::template::parse_range)
                .map(|(min, max)| VersionRange { min, max }),
        },
    }
}

struct Held {
    live: Arc<LiveBox>,
    last_used: Instant,
}

struct Inner {
    boxes: Boxes,
    templates: Vec<(TemplateInfo, Template)>,
    /// Live boxes by workspace (one per sandbox).
    held: tokio::sync::Mutex<HashMap<PathBuf, Held>>,
    network: Option<Arc<Allowlist>>,
    ca_bundle: Option<PathBuf>,
}

/// The Linux backend. Cheap to clone.
#[derive(Clone)]
pub struct NativeBackend {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for NativeBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NativeBackend")
            .field("templates", &self.inner.templates.len())
            .finish_non_exhaustive()
    }
}

/// A box's limits from a request and its template.
fn limits(template: &Template, request: &Limits) -> BoxLimits {
    let resources = template.definition.resources;
    BoxLimits {
        memory_bytes: request.memory_bytes,
        vcpus: resources.vcpus,
        pids: resources.pids,
        disk_bytes: resources.disk_mb << 20,
        weight: 100,
    }
}

impl NativeBackend {
    /// A backend over built `templates`. `network`: the allowlist of the boxes it opens
    /// (`None`: no network).
    pub fn new(
        boxes: Boxes,
        templates: Vec<Template>,
        network: Option<Arc<Allowlist>>,
        ca_bundle: Option<PathBuf>,
    ) -> NativeBackend {
        NativeBackend {
            inner: Arc::new(Inner {
                boxes,
                templates: templates
                    .into_iter()
                    .map(|t| (template_info(&t), t))
                    .collect(),
                held: tokio::sync::Mutex::new(HashMap::new()),
                network,
                ca_bundle,
            }),
        }
    }

    fn template(&self, request: &ExecRequest) -> Result<&Template, BackendError> {
        let wanted = request.template.as_deref().unwrap_or_default();
        self.inner
            .templates
            .iter()
            .find(|(info, _)| info.id == wanted)
            .map(|(_, t)| t)
            .ok_or_else(|| {
                BackendError::unsupported(format!("the Linux backend has no template {wanted:?}"))
            })
    }

    fn spec(&self, template: &Template, request: &ExecRequest) -> BoxSpec {
        BoxSpec {
            workspace: request.workspace.clone(),
            network: self.inner.network.clone(),
            ca_bundle: self.inner.ca_bundle.clone(),
            ..BoxSpec::new(template.clone(), limits(template, &request.limits))
        }
    }

    /// The live box of the request's workspace, started if there is none (or it died).
    async fn held_box(
        &self,
        template: &Template,
        request: &ExecRequest,
        workspace: &PathBuf,
    ) -> Result<Arc<LiveBox>, BackendError> {
        let mut held = self.inner.held.lock().await;
        if let Some(entry) = held.get_mut(workspace)
            && entry.live.is_alive()
        {
            entry.last_used = Instant::now();
            return Ok(entry.live.clone());
        }
        let live = Arc::new(
            self.inner
                .boxes
                .open(self.spec(template, request))
                .await
                .map_err(|e| BackendError::new(ErrorKind::Instantiate, e.to_string()))?,
        );
        if let Some(old) = held.insert(
            workspace.clone(),
            Held {
                live: live.clone(),
                last_used: Instant::now(),
            },
        ) {
            close_later(old.live);
        }
        Ok(live)
    }

    /// Closes the boxes whose workspace is gone (the sandbox was deleted) or that idled
    /// for `idle`. Run it now and then (see [`NativeBackend::start_reaper`]).
    pub async fn reap(&self, idle: Duration) -> usize {
        let mut held = self.inner.held.lock().await;
        let done: Vec<PathBuf> = held
            .iter()
            .filter(|(workspace, entry)| {
                !workspace.exists()
                    || !entry.live.is_alive()
                    || (entry.last_used.elapsed() >= idle && Arc::strong_count(&entry.live) == 1)
            })
            .map(|(workspace, _)| workspace.clone())
            .collect();
        for workspace in &done {
            if let Some(entry) = held.remove(workspace) {
                close_later(entry.live);
            }
        }
        done.len()
    }

    /// Reaps every few seconds, for as long as the backend lives.
    pub fn start_reaper(&self, idle: Duration) {
        let weak = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(5)).await;
                let Some(inner) = weak.upgrade() else { return };
                NativeBackend { inner }.reap(idle).await;
            }
        });
    }

    /// Live boxes held for sandboxes.
    pub async fn held(&self) -> usize {
        self.inner.held.lock().await.len()
    }

    /// Closes every box (at shutdown).
    pub async fn close_all(&self) {
        let all: Vec<_> = self.inner.held.lock().await.drain().collect();
        for (_, entry) in all {
            if let Ok(live) = Arc::try_unwrap(entry.live) {
                live.close().await;
            }
        }
    }
}

/// Closes a box once no execution holds it.
fn close_later(live: Arc<LiveBox>) {
    tokio::spawn(async move {
        let mut live = live;
        loop {
            match Arc::try_unwrap(live) {
                Ok(owned) => return owned.close().await,
                Err(shared) => {
                    live = shared;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    });
}

/// The argv that runs a request: its command, or its code in the request's language.
fn argv(
    template: &Template,
    request: &ExecRequest,
) -> Result<(Vec<String>, Option<String>), BackendError> {
    if let Some(command) = &request.command {
        if command.terminal.is_some() {
            return Err(BackendError::unsupported(
                "terminals on Linux templates are not supported yet",
            ));
        }
        return Ok((command.argv.clone(), command.cwd.clone()));
    }
    let language = request.language.name();
    if !template.definition.languages.iter().any(|l| l == language) {
        return Err(BackendError::unsupported(format!(
            "the {} template runs {} code, not {language}; send a `command` instead",
            catalogue_id(&template.definition.name),
            template.definition.languages.join(" and ")
        )));
    }
    let code = request.code.clone();
    let argv = match request.language {
        Language::Python => vec!["python3".into(), "-c".into(), code],
        Language::JavaScript => vec!["node".into(), "-e".into(), code],
    };
    Ok((argv, None))
}

impl Backend for NativeBackend {
    type Session = NativeSession;

    fn templates(&self) -> Vec<TemplateInfo> {
        self.inner
            .templates
            .iter()
            .map(|(info, _)| info.clone())
            .collect()
    }

    async fn run_once(
        &self,
        request: &ExecRequest,
        output: Option<OutputSink>,
    ) -> Result<ExecResult, BackendError> {
        let started = Instant::now();
        let template = self.template(request)?;
        if !request.mounts.is_empty() {
            return Err(BackendError::new(
                ErrorKind::Grant,
                "mounts are not supported on Linux templates yet; use the workspace",
            ));
        }
        let (argv, cwd) = argv(template, request)?;
        let limits = &request.limits;
        let mut exec = Exec::new(argv);
        exec.env = request.env.clone();
        exec.cwd = cwd;
        exec.stdin = request.stdin.clone();
        exec.timeout = Duration::from_millis(limits.timeout_ms);
        exec.max_output =
            usize::try_from(limits.stdout_bytes.max(limits.stderr_bytes)).unwrap_or(usize::MAX);
        let on_output = |stderr: bool, data: &[u8]| {
            if let Some(sink) = &output {
                let _ = sink.send(OutputChunk {
                    stream: if stderr {
                        StreamKind::Stderr
                    } else {
                        StreamKind::Stdout
                    },
                    data: bytes::Bytes::copy_from_slice(data),
                });
            }
        };
        let result = match &request.workspace {
            Some(workspace) => {
                let live = self.held_box(template, request, workspace).await?;
                live.exec(exec, on_output).await
            }
            None => {
                let live = self
                    .inner
                    .boxes
                    .open(self.spec(template, request))
                    .await
                    .map_err(|e| BackendError::new(ErrorKind::Instantiate, e.to_string()))?;
                let result = live.exec(exec, on_output).await;
                live.close().await;
                result
            }
        };
        let out = match result {
            Ok(out) => out,
            Err(crate::boxes::BoxError::Refused(message)) => {
                // The program could not start (not found, not executable): as a shell says it.
                return Ok(ExecResult {
                    stdout: Vec::new(),
                    stderr: format!("{message}\n").into_bytes(),
                    exit_code: 127,
                    outcome: Outcome::Completed,
                    stdout_truncated: false,
                    stderr_truncated: false,
                    duration_us: started.elapsed().as_micros() as u64,
                    peak_memory_bytes: 0,
                    fs_written_bytes: 0,
                });
            }
            Err(e) => return Err(BackendError::new(ErrorKind::Instantiate, e.to_string())),
        };
        let stdout_cap = usize::try_from(limits.stdout_bytes).unwrap_or(usize::MAX);
        let stderr_cap = usize::try_from(limits.stderr_bytes).unwrap_or(usize::MAX);
        let (mut stdout, mut stderr) = (out.stdout, out.stderr);
        let stdout_truncated = out.stdout_truncated || stdout.len() > stdout_cap;
        let stderr_truncated = out.stderr_truncated || stderr.len() > stderr_cap;
        stdout.truncate(stdout_cap);
        stderr.truncate(stderr_cap);
        let outcome = if out.timed_out {
            Outcome::TimedOut
        } else if out.oom_killed {
            Outcome::MemoryLimit
        } else if stdout_truncated || stderr_truncated {
            Outcome::OutputTruncated
        } else {
            Outcome::Completed
        };
        Ok(ExecResult {
            stdout,
            stderr,
            exit_code: match (out.exit_code, out.signal) {
                (Some(code), _) => code,
                (None, Some(signal)) => 128 + signal,
                (None, None) => -1,
            },
            outcome,
            stdout_truncated,
            stderr_truncated,
            duration_us: started.elapsed().as_micros() as u64,
            peak_memory_bytes: 0,
            fs_written_bytes: 0,
        })
    }

    async fn open_session(&self, request: ExecRequest) -> Result<NativeSession, BackendError> {
        let template = self.template(&request)?;
        Err(BackendError::unsupported(format!(
            "sessions on the {} template are not supported yet: run commands or code in the sandbox instead",
            catalogue_id(&template.definition.name)
        )))
    }
}

/// Sessions on Linux templates (not built yet: opening one is refused).
#[derive(Debug)]
pub struct NativeSession;

impl BackendSession for NativeSession {
    async fn run(
        &mut self,
        _code: &str,
        _limits: &Limits,
        _output: Option<OutputSink>,
        _door: Option<Door>,
    ) -> Result<ExecResult, BackendError> {
        Err(BackendError::new(
            ErrorKind::SessionEnded,
            "sessions on Linux templates are not supported yet",
        ))
    }
}
