//! kiln's runtime: what every face (`kiln serve`'s two HTTP APIs, MCP, the chat agent, and
//! `kiln rest`'s live tenant sessions) calls.
//! It owns the sandbox registry, the template catalogue, workspaces and their git history,
//! the durable store, API keys and quotas, sessions, and the exec, file and history paths;
//! code runs in an [`ExecutorPool`]'s worker processes. Nothing here speaks HTTP: every
//! operation returns a typed [`RuntimeError`] that each face maps once.
//!
//! ```no_run
//! # async fn demo(
//! #     pool: kiln_executor::ExecutorPool,
//! #     catalogue: kiln_core::template::Catalogue,
//! # ) -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use kiln_runtime::{Runtime, RuntimeConfig, auth::Caller, exec};
//! let config = RuntimeConfig::new("/tmp/kiln-data".into(), catalogue);
//! let pools = kiln_runtime::Pools::new(kiln_core::template::BackendKind::Wasm, pool);
//! let rt = Arc::new(Runtime::open(config, pools)?);
//! let caller = Caller::local();
//! let sandbox = exec::create_default_sandbox(&rt, &caller, kiln_core::Language::Python).await?;
//! let code = exec::CodeExec { code: "print(6 * 7)".into(), ..Default::default() };
//! let spec = exec::prepare(&rt, &caller, &sandbox.id, code)?;
//! let ran = exec::run(&rt, &caller, &sandbox.id, spec, None).await?;
//! assert_eq!(ran.result.stdout_text(), "42\n");
//! # Ok(()) }
//! ```

pub mod admission;
pub mod auth;
pub mod error;
pub mod events;
pub mod exec;
pub mod files;
pub mod history;
pub mod lifecycle;
pub mod live;
pub mod metrics;
pub mod network;
pub mod outputs;
pub mod pools;
pub mod processes;
pub mod quota;
pub mod revisions;
pub mod sandbox;
pub mod secrets;
pub mod sessions;
pub mod snapshots;
pub mod store;
pub mod volume;
pub mod volumes;
pub mod workspaces;

use std::path::PathBuf;

use kiln_core::template::Catalogue;
use kiln_executor::{ExecutorPool, SessionHandle};

pub use error::{Result, RuntimeError};
pub use pools::{Executors, Pools};

/// What a new WebAssembly session is counted as holding until its first turn measures it:
/// 4 MiB (an idle Python session holds ~0.8 MiB, a fork of a warm `python-data` one ~3.5).
pub const SESSION_OPEN_BYTES: u64 = 4 << 20;

/// What the runtime is made of, read once by the binary.
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// Folder for sandboxes, workspaces, history and keys.
    pub data_dir: PathBuf,
    /// Each tenant's quotas unless its key says otherwise.
    pub quotas: quota::Quotas,
    /// The templates the backends offer, in order of preference.
    pub catalogue: Catalogue,
    /// Languages routed to a template of the operator's choice ([`Executors::with_routes`]).
    pub routes: Vec<(kiln_core::Language, String)>,
    /// The longest one execution may run (and the largest `timeoutMs`); default
    /// [`exec::MAX_EXEC_MS`], 5 minutes.
    pub max_exec_ms: u64,
    /// How long a tenant's line of executions over its quota may grow, and how long one
    /// waits in it ([`admission`]).
    pub admission: admission::AdmissionConfig,
    /// The operator's cap on every sandbox's life from its creation, whatever renews it;
    /// `None` (the default): no cap but the sandbox's own.
    pub max_life_ms: Option<u64>,
}

impl RuntimeConfig {
    /// Default quotas and `catalogue`'s templates, over `data_dir`.
    pub fn new(data_dir: PathBuf, catalogue: Catalogue) -> RuntimeConfig {
        RuntimeConfig {
            data_dir,
            quotas: quota::Quotas::default(),
            catalogue,
            routes: Vec::new(),
            max_exec_ms: exec::MAX_EXEC_MS,
            admission: admission::AdmissionConfig::default(),
            max_life_ms: None,
        }
    }
}

/// The runtime: sandboxes and their state, over an executor pool per backend.
pub struct Runtime {
    pub registry: sandbox::Registry,
    /// What runs code: a pool per backend, and the catalogue of templates that routes to
    /// them. A sandbox runs in its template's backend's pool.
    pub executors: Executors,
    pub metrics: metrics::Metrics,
    /// Each tenant's quotas unless its key says otherwise.
    pub quotas: quota::Quotas,
    /// The longest one execution may run.
    pub max_exec_ms: u64,
    /// Live processes in sandboxes (Linux templates).
    pub processes: processes::Processes,
    /// Each tenant's line of executions over its executions quota.
    pub admission: admission::Admission,
    /// The operator's cap on every sandbox's life ([`RuntimeConfig::max_life_ms`]).
    pub max_life_ms: Option<u64>,
    /// What happened to each sandbox ([`events`]).
    pub events: events::Events,
    /// Each tenant's secrets, which network rules put into requests ([`secrets`]).
    pub secrets: std::sync::Arc<secrets::Secrets>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("registry", &self.registry)
            .field("executors", &self.executors)
            .field("quotas", &self.quotas)
            .finish_non_exhaustive()
    }
}

impl Runtime {
    /// Opens the runtime over `config.data_dir`, loading every sandbox recorded there and
    /// recovering what a crash left.
    pub fn open(config: RuntimeConfig, pools: Pools) -> std::io::Result<Runtime> {
        let processes = processes::Processes::new(pools.process_hosts());
        let key = secrets::KeySource::from_env(&config.data_dir)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let secrets = std::sync::Arc::new(secrets::Secrets::new(&config.data_dir, key));
        for host in processes.hosts() {
            host.use_secrets(secrets.clone());
        }
        let executors = Executors::new(pools, config.catalogue)
            .with_routes(config.routes)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        Ok(Runtime {
            registry: sandbox::Registry::open(config.data_dir)?,
            executors,
            metrics: metrics::Metrics::default(),
            quotas: config.quotas,
            max_exec_ms: config.max_exec_ms.max(1),
            processes,
            admission: admission::Admission::new(config.admission),
            max_life_ms: config.max_life_ms,
            events: events::Events::default(),
            secrets,
        })
    }

    /// What a new session in a sandbox of `template` is counted as holding until its
    /// first turn measures it: [`SESSION_OPEN_BYTES`] where its backend measures sessions
    /// (WebAssembly), `None` (its memory cap) where it cannot.
    pub fn session_holds(&self, template: &str) -> Option<u64> {
        self.measures_sessions(template)
            .then_some(SESSION_OPEN_BYTES)
    }

    /// What a new session in `sandbox` counts before its first turn, in bytes: as
    /// [`Runtime::session_holds`], else the sandbox's memory cap.
    pub fn new_session_holds(&self, sandbox: &sandbox::Sandbox) -> u64 {
        self.session_holds(sandbox.template())
            .unwrap_or(sandbox.memory_bytes)
    }

    /// Whether sessions of `template` report the memory they really hold.
    pub fn measures_sessions(&self, template: &str) -> bool {
        // An ephemeral template's session is an instance whose memory is its own; a live
        // one's is a process in a box, not measured alone.
        self.catalogue()
            .get(template)
            .is_some_and(|t| t.lifecycle == kiln_core::template::Lifecycle::Ephemeral)
    }

    /// What starts live processes in `sandbox`: its template's backend's process host, where
    /// the template runs processes (`capabilities.processes`) and its backend registered one.
    pub fn process_host(
        &self,
        sandbox: &sandbox::Sandbox,
    ) -> Option<std::sync::Arc<dyn kiln_core::process::ProcessHost>> {
        let template = self.catalogue().get(sandbox.template())?;
        if !template.capabilities.processes {
            return None;
        }
        self.processes.host_of(template.backend)
    }

    /// The quotas of `caller`: the runtime's, with its key's overrides.
    pub fn quotas(&self, caller: &auth::Caller) -> quota::Quotas {
        self.quotas.with(&caller.quotas)
    }

    /// The pool that runs sandboxes of `template` (its backend's).
    pub fn pool_for(&self, template: &str) -> Result<&ExecutorPool> {
        self.executors.pool_for(template)
    }

    /// The template an execution in `language` in a sandbox of `template` names to its
    /// backend: the sandbox's own for live templates (a Linux box runs its template's
    /// programs); for WebAssembly, the sandbox's own where it is not simply the language's
    /// (`python-data`, which starts warm, for Python), else none (a wasm sandbox runs either
    /// language in its workspace: JavaScript in a `python-data` sandbox runs as in any).
    pub fn request_template(
        &self,
        template: &str,
        language: kiln_core::Language,
    ) -> Option<String> {
        let info = self.catalogue().get(template)?;
        let own = match info.lifecycle {
            kiln_core::template::Lifecycle::Live => true,
            kiln_core::template::Lifecycle::Ephemeral => {
                info.id != language.name() && info.languages.contains(&language)
            }
        };
        own.then(|| info.id.clone())
    }

    /// The templates sandboxes are made from.
    pub fn catalogue(&self) -> &Catalogue {
        &self.executors.catalogue
    }

    /// Closes a live session of a sandbox made from `template` (a gone session is fine).
    pub async fn close_session(&self, template: &str, handle: &SessionHandle) {
        if let Ok(pool) = self.pool_for(template) {
            let _ = pool.close_session(handle).await;
        }
    }

    /// What sandbox `sandbox` uses now: CPU since the last look (or since it started), its
    /// box's memory (a WebAssembly sandbox has no box: 0), its workspace's bytes.
    pub async fn usage_of(&self, sandbox: &sandbox::Sandbox) -> processes::SandboxUsage {
        let workspace = sandbox.workspace();
        let live = match self.process_host(sandbox) {
            Some(host) => host.usage(&workspace).await,
            None => None,
        };
        let disk_bytes = {
            let sandbox = sandbox.clone();
            exec::blocking(move || Ok(processes::disk_used(&sandbox)))
                .await
                .unwrap_or(0)
        };
        let cpus = sandbox.resources.map_or(1.0, |r| r.vcpus.max(0.01));
        let cpu_used_pct = live.map_or(0.0, |live| {
            self.processes
                .cpu_percent(&sandbox.id, live.cpu_us, sandbox.created_ms, cpus)
        });
        processes::SandboxUsage {
            cpu_used_pct,
            memory_bytes: live.map_or(0, |l| l.memory_bytes),
            disk_bytes,
        }
    }

    /// Deletes a sandbox of `caller` and stops what it holds (running work is cancelled;
    /// its sessions are closed).
    pub async fn delete_sandbox(&self, caller: &auth::Caller, id: &str) -> Result<()> {
        self.registry.get(&caller.tenant, id)?;
        self.processes.kill_all(id).await;
        let removed = self.registry.delete(&caller.tenant, id)?;
        self.events.record(id, "deleted", "asked");
        for (template, handle) in removed.handles {
            self.close_session(&template, &handle).await;
        }
        Ok(())
    }

    /// Keeps each tenant within its quota of paused boxes ([`quota::Quotas::paused_boxes`]):
    /// its longest-paused boxes over it are hibernated (their files kept, their processes
    /// ended). `quotas_of` gives the quotas of a sandbox's owner. Answers how many it
    /// hibernated.
    pub async fn enforce_paused_quota(
        &self,
        quotas_of: impl Fn(&sandbox::Sandbox) -> quota::Quotas,
    ) -> usize {
        let mut paused = Vec::new();
        for host in self.processes.hosts() {
            paused.extend(host.paused().await);
        }
        if paused.is_empty() {
            return 0;
        }
        let wanted = paused.iter().map(|(w, _)| w.clone()).collect();
        let sandboxes = self.registry.by_workspace(&wanted);
        let mut by_tenant: std::collections::BTreeMap<
            &str,
            Vec<(std::time::Duration, &sandbox::Sandbox)>,
        > = Default::default();
        for (workspace, since) in &paused {
            if let Some(sandbox) = sandboxes.get(workspace) {
                by_tenant
                    .entry(sandbox.tenant.as_str())
                    .or_default()
                    .push((*since, sandbox));
            }
        }
        let mut hibernated = 0;
        for (tenant, mut boxes) in by_tenant {
            let limit = boxes
                .iter()
                .map(|(_, s)| quotas_of(s).paused_boxes)
                .max()
                .unwrap_or(0) as usize;
            if boxes.len() <= limit {
                continue;
            }
            // The longest-paused first.
            boxes.sort_by_key(|b| std::cmp::Reverse(b.0));
            let over = boxes.len() - limit;
            for (_, sandbox) in boxes.into_iter().take(over) {
                let Some(host) = self.process_host(sandbox) else {
                    continue;
                };
                if host
                    .hibernate(
                        &sandbox.workspace(),
                        "over its tenant's quota of paused boxes",
                    )
                    .await
                    .is_ok()
                {
                    hibernated += 1;
                    tracing::info!(
                        sandbox = %sandbox.id,
                        tenant,
                        "hibernated a paused box: its tenant keeps at most {limit} paused"
                    );
                }
            }
        }
        hibernated
    }

    /// Hears the process host's box events and records each as its sandbox's (call once,
    /// while serving).
    pub fn start_events(self: &std::sync::Arc<Self>) {
        for host in self.processes.hosts() {
            if let Some(heard) = host.subscribe() {
                self.record_events(heard);
            }
        }
    }

    fn record_events(
        self: &std::sync::Arc<Self>,
        mut heard: tokio::sync::broadcast::Receiver<kiln_core::process::BoxEvent>,
    ) {
        let weak = std::sync::Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                let event = match heard.recv().await {
                    Ok(event) => event,
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(_) => return,
                };
                let Some(rt) = weak.upgrade() else { return };
                let wanted = std::iter::once(event.workspace.clone()).collect();
                if let Some(sandbox) = rt.registry.by_workspace(&wanted).values().next() {
                    rt.events
                        .record(&sandbox.id, event.state.name(), &event.reason);
                    if event.state == kiln_core::process::BoxState::Running {
                        rt.registry.revive(&sandbox.id);
                    }
                }
            }
        });
    }

    /// Housekeeping, every second while serving: writes changed usage counters and removes
    /// expired sandboxes (closing their sessions).
    pub async fn tick(self: &std::sync::Arc<Self>) {
        let flusher = self.clone();
        let _ = tokio::task::spawn_blocking(move || flusher.registry.flush_usage()).await;
        let removed = self.registry.reap_expired();
        for id in &removed.ids {
            self.processes.kill_all(id).await;
            self.events.record(id, "deleted", "its life ended");
        }
        // Paused where it stands, its processes and files kept (E2B's autoPause).
        for sandbox in &removed.paused {
            if let Some(host) = self.process_host(sandbox)
                && let Err(e) = host
                    .set_paused(&sandbox.workspace(), true, "its timeout (onTimeout: pause)")
                    .await
            {
                tracing::warn!(sandbox = %sandbox.id, "could not pause a sandbox at its timeout: {}", e.message);
            }
        }
        for (template, handle) in removed.handles {
            self.close_session(&template, &handle).await;
        }
    }
}
