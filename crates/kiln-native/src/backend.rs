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

use kiln_guest::proto::Reply;

use crate::boxes::{BoxSpec, Boxes, Exec, LiveBox};
use crate::builder::Template;
use crate::checkpoint::{self, BoxRecipe};
use crate::jail::BoxLimits;
use crate::proxy::Allowlist;
use kiln_core::process::BoxState;

/// The catalogue id of a Linux template.
pub fn catalogue_id(name: &str) -> String {
    format!("linux-{name}")
}

/// A Linux template as the catalogue lists it.
/// The catalogue id of a built template: `linux-NAME` for a box, `vm-NAME` for a microVM.
pub fn template_id(template: &Template) -> String {
    if template.vm {
        format!("vm-{}", template.definition.name)
    } else if template.gvisor {
        format!("gvisor-{}", template.definition.name)
    } else {
        catalogue_id(&template.definition.name)
    }
}

pub fn template_info(template: &Template) -> TemplateInfo {
    let definition = &template.definition;
    let languages = definition
        .languages
        .iter()
        .filter_map(|l| Language::from_name(l))
        .collect();
    TemplateInfo {
        id: template_id(template),
        description: format!(
            "{}{} ({})",
            definition.description,
            if template.vm {
                ", as a microVM"
            } else if template.gvisor {
                ", under gVisor"
            } else {
                ""
            },
            template.built.versions_line()
        ),
        backend: BackendKind::Native,
        lifecycle: Lifecycle::Live,
        languages,
        capabilities: Capabilities {
            commands: true,
            // A session is a Python interpreter kept running in the box.
            sessions: definition.languages.iter().any(|l| l == "python"),
            session_languages: definition
                .languages
                .iter()
                .any(|l| l == "python")
                .then_some(Language::Python)
                .into_iter()
                .collect(),
            processes: true,
            terminals: true,
            ports: true,
            network: true,
            pause: true,
            fuel: false,
            fork: false,
        },
        // Image names (`python:3.11`) lead to boxes; a VM is asked for by its id.
        images: if template.vm || template.gvisor {
            ImageRule::default()
        } else {
            ImageRule {
                names: definition.images.names.clone(),
                repos: definition.images.repos.clone(),
                versions: definition
                    .images
                    .versions
                    .as_deref()
                    .and_then(crate::template::parse_range)
                    .map(|(min, max)| VersionRange { min, max }),
            }
        },
        resources: Some(definition.resources),
        workspace_owner: None,
    }
}

struct Held {
    live: Arc<LiveBox>,
    last_used: Instant,
    /// Preview connections open to it (each keeps it from idling).
    connections: Arc<std::sync::atomic::AtomicUsize>,
    /// Its sandbox's own idle policy, where it differs from the backend's.
    policy: kiln_core::process::IdleOverrides,
    /// What it was started with (kept with its checkpoint, to start it again).
    recipe: BoxRecipe,
}

/// Counts one open connection while it lives.
struct Connection(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for Connection {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

struct Inner {
    boxes: Boxes,
    templates: Vec<(TemplateInfo, Template)>,
    /// Live boxes by workspace (one per sandbox).
    held: tokio::sync::Mutex<HashMap<PathBuf, Held>>,
    /// What boxes of sandboxes with `network: allowlist` may reach.
    allowlist: Arc<Allowlist>,
    ca_bundle: Option<PathBuf>,
    /// The CA that opens HTTPS to hosts a sandbox's header rules name.
    egress_tls: Option<Arc<crate::intercept::Interceptor>>,
    /// Where those rules' secret placeholders are filled from (set by kiln's runtime).
    secrets: std::sync::OnceLock<Arc<dyn kiln_core::net::SecretSource>>,
    /// Workspaces whose sandbox is paused (its box frozen, or none running): the idle
    /// reaper leaves their boxes alone, and the next command resumes them.
    paused: std::sync::Mutex<HashMap<PathBuf, Instant>>,
    /// Workspaces whose box was hibernated (closed, its files kept): the next command
    /// starts one again.
    hibernated: std::sync::Mutex<std::collections::HashSet<PathBuf>>,
    /// Boxes being closed, by workspace: a new box of the same sandbox waits for its old one
    /// to be gone (they would share the upper layer on the sandbox's volume).
    closing: std::sync::Mutex<HashMap<PathBuf, tokio::task::JoinHandle<()>>>,
    /// Every change of a box's state, for whoever listens.
    events: tokio::sync::broadcast::Sender<kiln_core::process::BoxEvent>,
    /// Workspaces whose box is being checkpointed now: nothing starts or restores a box of
    /// theirs meanwhile.
    checkpointing: std::sync::Mutex<std::collections::HashSet<PathBuf>>,
    /// The warm pools of boxes, one per template whose pool is not empty by setting.
    pools: Vec<BoxPool>,
    /// Wakes the pools' replenisher.
    pool_wake: Arc<tokio::sync::Notify>,
    /// How many pool members may start at once.
    pool_at_once: usize,
    /// Templates defined but not built here (their names).
    unbuilt: Vec<String>,
}

/// A template's warm pool: sandboxes' boxes started ahead of need, each on a volume of its
/// own in a folder that becomes the sandbox's when claimed, at the template's resources, with
/// no network and the workspace where the template puts it.
struct BoxPool {
    template: Template,
    /// What its members are started with.
    recipe: BoxRecipe,
    pool: crate::pool::Pool<Member>,
}

/// A pool member: a box and the folder of its volume (`volume.img`, `volume/workspace`).
pub struct Member {
    /// `None` once adopted (the folder is a sandbox's).
    dir: Option<PathBuf>,
    live: Option<LiveBox>,
}

impl Member {
    fn alive(&self) -> bool {
        self.live.as_ref().is_some_and(LiveBox::is_alive)
    }
}

impl Drop for Member {
    /// A member not adopted: its box goes (blocking, briefly), then its volume and folder
    /// (gone already where a sandbox's store renamed it away).
    fn drop(&mut self) {
        drop(self.live.take());
        if let Some(dir) = &self.dir {
            remove_member_dir(dir);
        }
    }
}

/// Unmounts a member's volume and removes its folder (the image and the empty mount point:
/// no guest ever ran in it).
fn remove_member_dir(dir: &std::path::Path) {
    let volume = dir.join("volume");
    if let Ok(c) = std::ffi::CString::new(volume.as_os_str().as_encoded_bytes()) {
        // SAFETY: a valid C string; unmounting a path that is not a mount point fails harmlessly.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
    if std::fs::symlink_metadata(dir).is_ok() {
        let _ = std::fs::remove_dir_all(dir);
    }
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

/// A box's limits: the sandbox's resources (the template's when it has none) and the
/// request's memory cap.
fn limits(template: &Template, request: &ExecRequest) -> BoxLimits {
    let resources = request.resources.unwrap_or(template.definition.resources);
    BoxLimits {
        memory_bytes: request.limits.memory_bytes,
        vcpus: resources.vcpus,
        pids: resources.pids,
        disk_bytes: resources.disk_mb << 20,
        weight: 100,
    }
}

impl NativeBackend {
    /// A backend over built `templates`. `allowlist`: what the boxes of sandboxes with
    /// `network: allowlist` may reach (the others have no network).
    pub fn new(
        boxes: Boxes,
        templates: Vec<Template>,
        allowlist: Arc<Allowlist>,
        ca_bundle: Option<PathBuf>,
        pool_settings: &crate::pool::PoolSettings,
    ) -> NativeBackend {
        let owner = boxes.user_owner();
        // Where VMs run, each template is also offered as a microVM (`vm-NAME`); with
        // `--gvisor`, under gVisor (`gvisor-NAME`).
        let mut templates = templates;
        let own: Vec<Template> = templates
            .iter()
            .filter(|t| !t.vm && !t.gvisor)
            .cloned()
            .collect();
        if boxes.vm_tier().is_some() {
            templates.extend(own.iter().map(|t| Template {
                vm: true,
                ..t.clone()
            }));
        }
        if boxes.offers_gvisor() {
            templates.extend(own.iter().map(|t| Template {
                gvisor: true,
                ..t.clone()
            }));
        }
        let pool_wake = Arc::new(tokio::sync::Notify::new());
        let pools = match (&pool_settings.home, &pool_settings.volume) {
            (Some(home), Some(volume)) => {
                clear_pool_home(home);
                templates
                    .iter()
                    .filter_map(|template| {
                        box_pool(
                            template,
                            pool_settings,
                            &boxes,
                            &ca_bundle,
                            home,
                            volume,
                            &pool_wake,
                        )
                    })
                    .collect()
            }
            _ => Vec::new(),
        };
        NativeBackend {
            inner: Arc::new(Inner {
                pools,
                pool_wake,
                pool_at_once: pool_settings.at_once.max(1),
                unbuilt: Vec::new(),
                boxes,
                templates: templates
                    .into_iter()
                    .map(|t| {
                        let mut info = template_info(&t);
                        info.workspace_owner = Some(owner);
                        (info, t)
                    })
                    .collect(),
                held: tokio::sync::Mutex::new(HashMap::new()),
                allowlist,
                ca_bundle,
                egress_tls: None,
                secrets: Default::default(),
                paused: Default::default(),
                hibernated: Default::default(),
                closing: Default::default(),
                events: tokio::sync::broadcast::channel(1024).0,
                checkpointing: Default::default(),
            }),
        }
    }

    pub(crate) fn template(&self, request: &ExecRequest) -> Result<&Template, BackendError> {
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
        self.spec_of(
            template,
            request.workspace.clone(),
            &self.recipe(template, request),
        )
    }

    /// What a box for `request` is started with.
    fn recipe(&self, template: &Template, request: &ExecRequest) -> BoxRecipe {
        BoxRecipe {
            template: template_id(template),
            limits: limits(template, request),
            network: matches!(request.network, kiln_core::Network::Allowlist),
            workspace_at: request.workspace_at.clone(),
            idle: request.idle,
            egress: request.egress.clone(),
            mounts: request.mounts.clone(),
        }
    }

    fn spec_of(
        &self,
        template: &Template,
        workspace: Option<PathBuf>,
        recipe: &BoxRecipe,
    ) -> BoxSpec {
        // The workspace (and the commands' default folder) where the request wants it.
        let template = match &recipe.workspace_at {
            Some(at) => {
                let mut moved = template.clone();
                moved.definition.working_dir = at.clone();
                moved
            }
            None => template.clone(),
        };
        BoxSpec {
            layer: workspace.as_deref().and_then(persistent_layer),
            workspace,
            network: recipe.network.then(|| {
                let egress = crate::proxy::LiveEgress::new(
                    self.inner.allowlist.clone(),
                    self.inner.secrets.get().cloned(),
                    self.inner.egress_tls.clone(),
                );
                if let Err(why) = egress.set(recipe.egress.clone()) {
                    // Checked when they were set: rules that no longer parse leave the
                    // box no way out at all rather than the operator's whole list.
                    tracing::warn!(target: "kiln::egress", "the sandbox's network rules are refused ({why}): its box gets none");
                    let _ = egress.set(Some(kiln_core::net::EgressGrant {
                        rules: kiln_core::net::Egress {
                            deny_out: vec![kiln_core::net::ALL_TRAFFIC.into()],
                            ..Default::default()
                        },
                        ..Default::default()
                    }));
                }
                Arc::new(egress)
            }),
            ca_bundle: self.inner.ca_bundle.clone(),
            mounts: recipe.mounts.clone(),
            ..BoxSpec::new(template, recipe.limits)
        }
    }

    /// The boxes' table, once no checkpoint of `workspace`'s box is being taken (a box of
    /// the sandbox must not start over the layer CRIU is still dumping).
    async fn settled(
        &self,
        workspace: &std::path::Path,
    ) -> Result<tokio::sync::MutexGuard<'_, HashMap<PathBuf, Held>>, BackendError> {
        let started = Instant::now();
        loop {
            let held = self.inner.held.lock().await;
            if !self.checkpointing().contains(workspace) {
                return Ok(held);
            }
            drop(held);
            if started.elapsed() > CHECKPOINT_WAIT {
                return Err(BackendError::new(
                    ErrorKind::Instantiate,
                    format!(
                        "the sandbox's box is still being checkpointed after {CHECKPOINT_WAIT:?}; try again"
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn checkpointing(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<PathBuf>> {
        self.inner
            .checkpointing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// The live box of the request's workspace, started if there is none (or it died).
    pub(crate) async fn held_box(
        &self,
        template: &Template,
        request: &ExecRequest,
        workspace: &PathBuf,
    ) -> Result<Arc<LiveBox>, BackendError> {
        let mut held = self.settled(workspace).await?;
        // A command to a paused sandbox resumes it (E2B's auto-resume).
        let was_paused = self.paused().remove(workspace).is_some();
        self.hibernated().remove(workspace);
        if let Some(entry) = held.get_mut(workspace)
            && entry.live.is_alive()
        {
            entry.last_used = Instant::now();
            entry.policy = request.idle;
            if entry.recipe.egress != request.egress {
                apply_egress(entry, request.egress.clone())?;
            }
            if was_paused || entry.live.is_paused() {
                entry
                    .live
                    .set_paused(false)
                    .await
                    .map_err(|e| BackendError::new(ErrorKind::Instantiate, e.to_string()))?;
                self.emit(workspace, BoxState::Running, "resumed by a request");
            }
            return Ok(entry.live.clone());
        }
        // A dead box of this sandbox goes first, and one being closed is waited for.
        if let Some(old) = held.remove(workspace) {
            old.live.destroy_now().await;
        }
        let closing = self
            .inner
            .closing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(workspace);
        if let Some(closing) = closing {
            let _ = tokio::time::timeout(Duration::from_secs(10), closing).await;
        }
        // A hibernated box comes back from its checkpoint, its processes as they were.
        if let Some(live) = self.restore(&mut held, workspace).await {
            return Ok(live);
        }
        let live = Arc::new(
            self.inner
                .boxes
                .open(self.spec(template, request))
                .await
                .map_err(|e| BackendError::new(ErrorKind::Instantiate, e.to_string()))?,
        );
        self.emit(workspace, BoxState::Running, "started for a request");
        if let Some(old) = held.insert(
            workspace.clone(),
            Held {
                live: live.clone(),
                last_used: Instant::now(),
                connections: Arc::default(),
                policy: request.idle,
                recipe: self.recipe(template, request),
            },
        ) {
            self.close_later(workspace, old.live);
        }
        Ok(live)
    }

    /// Restores the box of `workspace` from its checkpoint, if it has one: its processes go
    /// on where they were. The checkpoint is used up either way; one that fails to restore
    /// is said in the box's events (its processes are gone, its files kept) and answers
    /// `None`, as does a sandbox with no checkpoint. Called with the boxes' table locked.
    async fn restore(
        &self,
        held: &mut HashMap<PathBuf, Held>,
        workspace: &std::path::Path,
    ) -> Option<Arc<LiveBox>> {
        self.restore_why(held, workspace).await.ok()
    }

    /// [`NativeBackend::restore`], saying why not: `Err(None)` when there is no checkpoint,
    /// `Err(Some(why))` when it did not restore.
    async fn restore_why(
        &self,
        held: &mut HashMap<PathBuf, Held>,
        workspace: &std::path::Path,
    ) -> Result<Arc<LiveBox>, Option<String>> {
        let folder = checkpoint::folder(workspace).ok_or(None)?;
        let Some(record) = checkpoint::read(&folder) else {
            // Not complete: a kiln that died while it checkpointed left it.
            if folder.exists() {
                checkpoint::remove(&folder);
            }
            return Err(None);
        };
        let started = Instant::now();
        let template = self
            .inner
            .templates
            .iter()
            .find(|(info, _)| info.id == record.recipe.template)
            .map(|(_, t)| t);
        let restored = match template {
            None => Err(format!(
                "its template {} is no longer served",
                record.recipe.template
            )),
            Some(template) => {
                let spec = self.spec_of(template, Some(workspace.to_path_buf()), &record.recipe);
                let images = checkpoint::images(&folder);
                let from = crate::boxes::Restore {
                    images: &images,
                    lineage: record.lineage,
                    carried: &record.carried,
                };
                self.inner
                    .boxes
                    .restore(spec, from)
                    .await
                    .map_err(|e| e.to_string())
            }
        };
        checkpoint::remove(&folder);
        self.hibernated().remove(workspace);
        self.paused().remove(workspace);
        match restored {
            Ok(live) => {
                let live = Arc::new(live);
                held.insert(
                    workspace.to_path_buf(),
                    Held {
                        live: live.clone(),
                        last_used: Instant::now(),
                        connections: Arc::default(),
                        policy: record.recipe.idle,
                        recipe: record.recipe,
                    },
                );
                self.emit(
                    workspace,
                    BoxState::Running,
                    &format!(
                        "restored from its checkpoint in {} ms, its processes as they were",
                        started.elapsed().as_millis()
                    ),
                );
                Ok(live)
            }
            Err(e) => {
                tracing::warn!(workspace = %workspace.display(), error = %e, "a checkpoint did not restore");
                self.emit(
                    workspace,
                    BoxState::Stopped,
                    &format!(
                        "its checkpoint could not be restored, so its processes are gone (its files are kept): {e}"
                    ),
                );
                Err(Some(e))
            }
        }
    }

    /// The live box of lineage `lineage` for `workspace` (a process started in it asks),
    /// restored now from its checkpoint if it is hibernated. `None`: that box is gone for
    /// good (closed, replaced, or its checkpoint failed).
    pub(crate) async fn restored(
        &self,
        workspace: &std::path::Path,
        lineage: u64,
    ) -> Option<Arc<LiveBox>> {
        let mut held = self.settled(workspace).await.ok()?;
        if let Some(entry) = held.get(workspace).filter(|e| e.live.is_alive()) {
            return (entry.live.lineage == lineage).then(|| entry.live.clone());
        }
        let record = checkpoint::folder(workspace).and_then(|f| checkpoint::read(&f))?;
        if record.lineage != lineage {
            return None;
        }
        self.restore(&mut held, workspace)
            .await
            .filter(|live| live.lineage == lineage)
    }

    /// Waits for the box of lineage `lineage` of `workspace` to be restored (by whatever
    /// request wakes it), without waking it: the box, or `None` once it is gone for good.
    pub(crate) async fn await_restored(
        &self,
        workspace: &std::path::Path,
        lineage: u64,
    ) -> Option<Arc<LiveBox>> {
        let mut events = self.box_events();
        loop {
            {
                // Under the table's lock: a restore holds it from reading the checkpoint
                // to adding the box.
                let held = self.inner.held.lock().await;
                if let Some(entry) = held.get(workspace).filter(|e| e.live.is_alive()) {
                    return (entry.live.lineage == lineage).then(|| entry.live.clone());
                }
                if !self.checkpointing().contains(workspace) {
                    let record = checkpoint::folder(workspace).and_then(|f| checkpoint::read(&f));
                    if record.is_none_or(|r| r.lineage != lineage) {
                        return None;
                    }
                }
            }
            let _ = tokio::time::timeout(Duration::from_secs(2), events.recv()).await;
        }
    }

    /// Closes the boxes whose workspace is gone (the sandbox was deleted) or whose agent
    /// died, gives `policy.action` to those that idled for `policy.idle` (nothing ran in
    /// them: no command, and no process, terminal or preview connection holds them; a paused
    /// box is not idle again), and hibernates those paused for `policy.hibernate_after`.
    /// Answers how many it closed, paused or hibernated. Run it now and then (see
    /// [`NativeBackend::start_reaper`]).
    pub async fn reap(&self, policy: IdlePolicy) -> usize {
        let mut held = self.inner.held.lock().await;
        self.paused().retain(|workspace, _| workspace.exists());
        self.hibernated().retain(|workspace| workspace.exists());
        let paused = self.paused().clone();
        let gone: Vec<PathBuf> = held
            .iter()
            .filter(|(workspace, entry)| !workspace.exists() || !entry.live.is_alive())
            .map(|(workspace, _)| workspace.clone())
            .collect();
        let policy_of = |workspace: &PathBuf| {
            held.get(workspace)
                .map_or(policy, |entry| policy.with(&entry.policy))
        };
        let idled: Vec<(PathBuf, IdleAction)> = held
            .iter()
            .filter(|(workspace, entry)| {
                !gone.contains(workspace)
                    && entry.last_used.elapsed() >= policy.with(&entry.policy).idle
                    && Arc::strong_count(&entry.live) == 1
                    && entry.connections.load(std::sync::atomic::Ordering::Relaxed) == 0
                    && !paused.contains_key(*workspace)
                    && !entry.live.is_paused()
            })
            .map(|(workspace, entry)| (workspace.clone(), policy.with(&entry.policy).action))
            .collect();
        let mut sleepy: Vec<PathBuf> = paused
            .iter()
            .filter(|(workspace, since)| {
                policy_of(workspace)
                    .hibernate_after
                    .is_some_and(|after| since.elapsed() >= after)
            })
            .map(|(workspace, _)| workspace.clone())
            .collect();
        let acted = gone.len() + idled.len() + sleepy.len();
        for workspace in &gone {
            if let Some(entry) = held.remove(workspace) {
                if workspace.exists() {
                    self.emit(workspace, BoxState::Stopped, "its agent ended");
                }
                self.close_later(workspace, entry.live);
            }
        }
        for (workspace, action) in &idled {
            match action {
                IdleAction::Hibernate => sleepy.push(workspace.clone()),
                IdleAction::Stop => {
                    if let Some(entry) = held.remove(workspace) {
                        self.emit(workspace, BoxState::Stopped, "idle");
                        self.close_later(workspace, entry.live);
                    }
                }
                IdleAction::Pause => {
                    if let Some(entry) = held.get(workspace)
                        && entry.live.set_paused(true).await.is_ok()
                    {
                        self.paused().insert(workspace.clone(), Instant::now());
                        self.emit(workspace, BoxState::Paused, "idle");
                    }
                }
            }
        }
        drop(held);
        for workspace in &sleepy {
            let _ = self.hibernate(workspace, "idle").await;
        }
        acted
    }

    /// Reaps every few seconds, for as long as the backend lives.
    pub fn start_reaper(&self, policy: IdlePolicy) {
        let weak = Arc::downgrade(&self.inner);
        // A sandbox's own policy may be shorter than the backend's: every second at most.
        let every = Duration::from_secs(1)
            .min(policy.idle)
            .min(policy.hibernate_after.unwrap_or(Duration::MAX))
            .max(Duration::from_millis(100));
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(inner) = weak.upgrade() else { return };
                NativeBackend { inner }.reap(policy).await;
                let _ = tokio::task::spawn_blocking(crate::boxes::reap_criu_helpers).await;
            }
        });
    }

    /// A connection to `port` in the box of `workspace`, counted as activity while it is
    /// open (the box does not idle under it). `None`: no box runs.
    pub(crate) async fn connect_box(
        &self,
        workspace: &std::path::Path,
        port: u16,
    ) -> Option<Result<tokio::io::DuplexStream, crate::boxes::BoxError>> {
        let (live, guard) = {
            let mut held = self.inner.held.lock().await;
            let entry = held.get_mut(workspace).filter(|e| e.live.is_alive())?;
            entry.last_used = Instant::now();
            entry
                .connections
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            (entry.live.clone(), Connection(entry.connections.clone()))
        };
        Some(live.connect(port, guard).await)
    }

    /// The live box of `workspace`, if one runs.
    pub async fn live_box(&self, workspace: &std::path::Path) -> Option<Arc<LiveBox>> {
        let held = self.inner.held.lock().await;
        held.get(workspace)
            .filter(|entry| entry.live.is_alive())
            .map(|entry| entry.live.clone())
    }

    /// Kills every process in the live box of `workspace` but its agent (see
    /// [`LiveBox::kill_all_but_agent`]): a sandbox whose box a fork bomb filled runs
    /// commands again, its files and installed packages kept. `None`: no box runs for it.
    pub async fn kill_processes(&self, workspace: &std::path::Path) -> Option<usize> {
        let live = self.live_box(workspace).await?;
        // A frozen box's processes die only once thawed.
        if self.paused().remove(workspace).is_some() || live.is_paused() {
            let _ = live.set_paused(false).await;
        }
        let killed = live.kill_all_but_agent().await;
        self.emit(
            workspace,
            BoxState::Running,
            "restarted: its processes ended",
        );
        Some(killed)
    }

    /// The sandboxes paused now, each with how long it has been.
    pub fn paused_boxes(&self) -> Vec<(PathBuf, Duration)> {
        self.paused()
            .iter()
            .map(|(workspace, since)| (workspace.clone(), since.elapsed()))
            .collect()
    }

    fn paused(&self) -> std::sync::MutexGuard<'_, HashMap<PathBuf, Instant>> {
        self.inner.paused.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn hibernated(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<PathBuf>> {
        self.inner
            .hibernated
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Hibernates the box of `workspace`: its memory goes back to the host, its files stay
    /// on the sandbox's volume, and where CRIU can, its processes are checkpointed to disk
    /// and come back as they were on its next request (or resume); where it cannot, they end
    /// (and the answer says why). The sandbox stays `hibernated` until then. Answers what
    /// became of its processes.
    pub async fn hibernate(
        &self,
        workspace: &std::path::Path,
        reason: &str,
    ) -> Result<(kiln_core::process::BoxState, String), BackendError> {
        let entry = {
            let mut held = self.settled(workspace).await?;
            let entry = held.remove(workspace);
            self.paused().remove(workspace);
            self.hibernated().insert(workspace.to_path_buf());
            if entry.is_some() {
                self.checkpointing().insert(workspace.to_path_buf());
            }
            entry
        };
        let said = match entry {
            None => match checkpoint::folder(workspace).and_then(|f| checkpoint::read(&f)) {
                Some(_) => "it was hibernated already: its processes are checkpointed and come back on its next request".to_string(),
                None => "no box ran: its files are kept".to_string(),
            },
            Some(entry) => {
                let said = match self.checkpoint(workspace, &entry).await {
                    Ok(said) => said,
                    Err(why) => {
                        // Killed now, whoever holds it (a terminal's shell ends with it).
                        entry.live.destroy_now().await;
                        format!("the box's processes ended and its files were kept: {why}")
                    }
                };
                self.checkpointing().remove(workspace);
                said
            }
        };
        self.emit(workspace, BoxState::Hibernated, reason);
        Ok((kiln_core::process::BoxState::Hibernated, said))
    }

    /// Checkpoints the box of `entry` (the table no longer holds it) and removes it; what
    /// to tell, or why it could not be (the box is then still there).
    async fn checkpoint(
        &self,
        workspace: &std::path::Path,
        entry: &Held,
    ) -> Result<String, String> {
        // `criu check` runs once, on the first checkpoint: off the async threads.
        let boxes = self.inner.boxes.clone();
        let criu = tokio::task::spawn_blocking(move || {
            boxes
                .criu()
                .map(std::path::Path::to_path_buf)
                .map_err(str::to_string)
        })
        .await
        .map_err(|e| e.to_string())??;
        let folder = checkpoint::folder(workspace).ok_or(
            "its sandbox has no volume to keep the box's layer on, so its processes could not come back over the same files",
        )?;
        if !entry.live.is_alive() {
            return Err("its box had ended".into());
        }
        let started = Instant::now();
        let images = checkpoint::prepare(&folder, self.inner.boxes.root_uid())
            .map_err(|e| format!("{}: {e}", folder.display()))?;
        let processes = entry
            .live
            .processes()
            .await
            .iter()
            .filter(|p| !p.agent)
            .count();
        // Frozen, its processes checkpointed and left as they were, then killed while still
        // frozen: nothing they do after the checkpoint reaches the files it was taken with.
        // (Letting CRIU freeze and kill them itself races with a shell's vfork: see
        // `LiveBox::checkpoint`.)
        let checkpointed = match entry.live.checkpointable() {
            Err(e) => Err(e),
            Ok(()) => match entry.live.set_paused(true).await {
                Err(e) => Err(e.to_string()),
                Ok(()) => entry.live.checkpoint(&criu, &images).await,
            },
        };
        let carried = match checkpointed {
            Ok(carried) => carried,
            Err(e) => {
                checkpoint::remove(&folder);
                return Err(format!("checkpointing them failed: {e}"));
            }
        };
        entry.live.kill_frozen();
        entry.live.destroy_now().await;
        if let Err(e) = checkpoint::hand_to(&images, self.inner.boxes.root_uid()) {
            checkpoint::remove(&folder);
            return Err(format!("its checkpoint could not be kept: {e}"));
        }
        let record = checkpoint::Record {
            lineage: entry.live.lineage,
            carried,
            recipe: entry.recipe.clone(),
            bytes: checkpoint::size(&images),
            made_ms: checkpoint::now_ms(),
        };
        if let Err(e) = checkpoint::complete(&folder, &record) {
            checkpoint::remove(&folder);
            return Err(format!("its checkpoint could not be kept: {e}"));
        }
        let which = match processes {
            0 => "the box (no process of its own ran, only kiln's agent) was checkpointed"
                .to_string(),
            1 => "its 1 process was checkpointed".to_string(),
            n => format!("its {n} processes were checkpointed"),
        };
        Ok(format!(
            "{which} ({} MiB on disk, in {} ms): its next request or resume restores it as it was",
            record.bytes.div_ceil(1 << 20),
            started.elapsed().as_millis()
        ))
    }

    /// See [`kiln_core::process::ProcessHost::snapshot`]: the box of `workspace` held still
    /// (marked as being checkpointed, so every other request for it waits) and paused while
    /// `copy` runs, its processes checkpointed into `processes_into` first, left running.
    pub async fn snapshot(
        &self,
        workspace: &std::path::Path,
        processes_into: Option<&std::path::Path>,
        copy: Box<dyn FnOnce() + Send + 'static>,
    ) -> Result<kiln_core::process::SnapshotProcesses, BackendError> {
        let live = {
            let held = self.settled(workspace).await?;
            self.checkpointing().insert(workspace.to_path_buf());
            held.get(workspace)
                .filter(|entry| entry.live.is_alive())
                .map(|entry| entry.live.clone())
        };
        let unmark = Unmark(self, workspace);
        let paused_here = match &live {
            Some(live) if !live.is_paused() => {
                if let Err(e) = live.set_paused(true).await {
                    return Err(BackendError::new(
                        ErrorKind::Instantiate,
                        format!("pausing the box: {e}"),
                    ));
                }
                true
            }
            _ => false,
        };
        let kept = match processes_into {
            None => kiln_core::process::SnapshotProcesses {
                carried: false,
                said: "only its files were taken, as asked".into(),
            },
            Some(into) => self.checkpoint_into(workspace, live.as_deref(), into).await,
        };
        let copied = tokio::task::spawn_blocking(copy).await;
        if paused_here && let Some(live) = &live {
            let _ = live.set_paused(false).await;
        }
        drop(unmark);
        copied.map_err(|e| BackendError::new(ErrorKind::Instantiate, e.to_string()))?;
        Ok(kept)
    }

    /// Checkpoints the processes of `live` (the paused box of `workspace`; none when no box
    /// runs) into `into`, or copies the checkpoint of a hibernated one there.
    async fn checkpoint_into(
        &self,
        workspace: &std::path::Path,
        live: Option<&LiveBox>,
        into: &std::path::Path,
    ) -> kiln_core::process::SnapshotProcesses {
        use kiln_core::process::SnapshotProcesses;
        let not = |why: String| SnapshotProcesses {
            carried: false,
            said: format!("its processes were not taken, only its files: {why}"),
        };
        let owner = self.inner.boxes.root_uid();
        let Some(live) = live else {
            // Hibernated: its checkpoint is its processes, consistent with its files.
            if let Some(folder) =
                checkpoint::folder(workspace).filter(|f| checkpoint::is_complete(f))
            {
                let to = into.to_path_buf();
                let copied = tokio::task::spawn_blocking(move || {
                    let record = checkpoint::copy(&folder, &to, owner)?;
                    checkpoint::complete(&to, &record).map(|()| record)
                })
                .await;
                return match copied {
                    Ok(Ok(record)) => SnapshotProcesses {
                        carried: true,
                        said: format!(
                            "its processes were taken from its hibernation's checkpoint ({} MiB)",
                            record.bytes.div_ceil(1 << 20)
                        ),
                    },
                    Ok(Err(e)) => {
                        checkpoint::remove(into);
                        not(format!("its checkpoint could not be copied: {e}"))
                    }
                    Err(e) => not(e.to_string()),
                };
            }
            return not("no box ran".into());
        };
        let boxes = self.inner.boxes.clone();
        let criu = tokio::task::spawn_blocking(move || {
            boxes
                .criu()
                .map(std::path::Path::to_path_buf)
                .map_err(str::to_string)
        })
        .await
        .map_err(|e| e.to_string())
        .and_then(|c| c);
        let criu = match criu {
            Ok(criu) => criu,
            Err(why) => return not(why),
        };
        let Some(recipe) = self
            .inner
            .held
            .lock()
            .await
            .get(workspace)
            .map(|entry| entry.recipe.clone())
        else {
            return not("its box ended".into());
        };
        let started = Instant::now();
        let images = match checkpoint::prepare(into, owner) {
            Ok(images) => images,
            Err(e) => return not(format!("{}: {e}", into.display())),
        };
        let processes = live.processes().await.iter().filter(|p| !p.agent).count();
        let carried = match live.checkpoint(&criu, &images).await {
            Ok(carried) => carried,
            Err(e) => {
                checkpoint::remove(into);
                return not(format!("checkpointing them failed: {e}"));
            }
        };
        let record = checkpoint::Record {
            lineage: live.lineage,
            carried,
            recipe,
            bytes: checkpoint::size(&images),
            made_ms: checkpoint::now_ms(),
        };
        if let Err(e) =
            checkpoint::hand_to(&images, owner).and_then(|()| checkpoint::complete(into, &record))
        {
            checkpoint::remove(into);
            return not(format!("its checkpoint could not be kept: {e}"));
        }
        SnapshotProcesses {
            carried: true,
            said: format!(
                "{} checkpointed ({} MiB, in {} ms)",
                match processes {
                    0 => "no process of its own ran; its box was".to_string(),
                    1 => "its 1 process was".to_string(),
                    n => format!("its {n} processes were"),
                },
                record.bytes.div_ceil(1 << 20),
                started.elapsed().as_millis()
            ),
        }
    }

    /// See [`kiln_core::process::ProcessHost::restore_from`]: the checkpoint in `from` copied
    /// to the new sandbox's own (its box's recipe the new sandbox's: its rules, its volumes),
    /// then restored now.
    pub async fn restore_from(
        &self,
        request: &ExecRequest,
        from: &std::path::Path,
    ) -> Result<String, String> {
        let workspace = request
            .workspace
            .clone()
            .ok_or("the sandbox has no workspace")?;
        let folder = checkpoint::folder(&workspace)
            .ok_or("the sandbox has no volume to keep its box's layer on")?;
        let template = self.template(request).map_err(|e| e.message)?;
        let recipe = self.recipe(template, request);
        let owner = self.inner.boxes.root_uid();
        let (from, into) = (from.to_path_buf(), folder.clone());
        let copied = tokio::task::spawn_blocking(move || {
            let mut record = checkpoint::copy(&from, &into, owner)?;
            if record.recipe.template != recipe.template {
                checkpoint::remove(&into);
                return Err(std::io::Error::other(format!(
                    "the checkpoint is of a {} box, the sandbox is {}",
                    record.recipe.template, recipe.template
                )));
            }
            record.recipe = recipe;
            // What the source's channel had open was read by the source's clients: a copy
            // carries only what its agent listens on (the proxy's port).
            record.carried.streams = record.carried.listeners.clone();
            checkpoint::complete(&into, &record)
        })
        .await
        .map_err(|e| e.to_string())?;
        copied.map_err(|e| format!("its checkpoint could not be copied: {e}"))?;
        let mut held = self.settled(&workspace).await.map_err(|e| e.message)?;
        if held.get(&workspace).is_some_and(|e| e.live.is_alive()) {
            checkpoint::remove(&folder);
            return Err("a box runs for it already".into());
        }
        let started = Instant::now();
        match self.restore_why(&mut held, &workspace).await {
            Ok(_) => Ok(format!(
                "its processes were restored from the snapshot in {} ms",
                started.elapsed().as_millis()
            )),
            Err(why) => Err(why.unwrap_or_else(|| "its checkpoint was not complete".into())),
        }
    }

    /// Where the box of `workspace` stands.
    pub async fn state(&self, workspace: &std::path::Path) -> kiln_core::process::BoxState {
        use kiln_core::process::BoxState;
        if self.hibernated().contains(workspace) || self.checkpointed(workspace) {
            return BoxState::Hibernated;
        }
        if self.paused().contains_key(workspace) {
            return BoxState::Paused;
        }
        match self.live_box(workspace).await {
            Some(live) if live.is_paused() => BoxState::Paused,
            Some(_) => BoxState::Running,
            None => BoxState::Stopped,
        }
    }

    /// Pauses (freezes) or resumes the box of `workspace`; a sandbox with no box running is
    /// marked paused all the same (its next command resumes it, starting a box).
    pub async fn set_paused(
        &self,
        workspace: &std::path::Path,
        paused: bool,
        reason: &str,
    ) -> Result<kiln_core::process::BoxState, BackendError> {
        let before = self.state(workspace).await;
        // Under the boxes' lock, so no command starts or resumes the box meanwhile.
        let mut held = self.settled(workspace).await?;
        let mut live = held
            .get(workspace)
            .filter(|entry| entry.live.is_alive())
            .map(|entry| entry.live.clone());
        if live.is_none() && self.checkpointed(workspace) {
            if paused {
                // Hibernated it stays: a checkpoint is already more asleep than paused.
                return Ok(BoxState::Hibernated);
            }
            live = self.restore(&mut held, workspace).await;
        }
        if let Some(live) = &live {
            live.set_paused(paused)
                .await
                .map_err(|e| BackendError::new(ErrorKind::Instantiate, e.to_string()))?;
        }
        if paused {
            self.paused()
                .entry(workspace.to_path_buf())
                .or_insert_with(Instant::now);
            self.hibernated().remove(workspace);
        } else {
            self.paused().remove(workspace);
        }
        drop(held);
        let after = self.state(workspace).await;
        if after != before {
            self.emit(workspace, after, reason);
        }
        Ok(after)
    }

    /// Whether `workspace`'s box is checkpointed on disk (hibernated, to be restored).
    fn checkpointed(&self, workspace: &std::path::Path) -> bool {
        checkpoint::folder(workspace).is_some_and(|f| checkpoint::is_complete(&f))
    }

    /// Every change of a box's state from now on.
    pub fn box_events(&self) -> tokio::sync::broadcast::Receiver<kiln_core::process::BoxEvent> {
        self.inner.events.subscribe()
    }

    /// Tells listeners that the box of `workspace` now stands at `state`, and why.
    fn emit(&self, workspace: &std::path::Path, state: BoxState, reason: &str) {
        let _ = self.inner.events.send(kiln_core::process::BoxEvent {
            workspace: workspace.to_path_buf(),
            state,
            reason: reason.to_string(),
        });
    }

    /// Closes a box once no execution holds it, remembered as closing for its workspace.
    fn close_later(&self, workspace: &std::path::Path, live: Arc<LiveBox>) {
        let task = tokio::spawn(async move {
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
        self.inner
            .closing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(workspace.to_path_buf(), task);
    }

    /// The backend with `names` said to be defined but not built here (a create for one is
    /// told to build it, not that it does not exist).
    /// Opens HTTPS to hosts that sandboxes' header rules name with `tls`'s CA (which the
    /// boxes' CA bundle must hold).
    pub fn with_egress_tls(mut self, tls: Arc<crate::intercept::Interceptor>) -> NativeBackend {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.egress_tls = Some(tls);
        }
        self
    }

    /// Where header rules' secret placeholders are filled from (the first one set stays).
    pub fn use_secrets(&self, secrets: Arc<dyn kiln_core::net::SecretSource>) {
        let _ = self.inner.secrets.set(secrets);
    }

    /// Applies a sandbox's egress rules to its box from now on (its next box starts with
    /// them anyway: each request carries them).
    pub async fn set_egress(
        &self,
        workspace: &std::path::Path,
        grant: Option<kiln_core::net::EgressGrant>,
    ) -> Result<(), BackendError> {
        if let Some(grant) = &grant {
            kiln_core::net::EgressPolicy::new(grant.clone())
                .map_err(|e| BackendError::new(ErrorKind::Grant, e))?;
        }
        let mut held = self.inner.held.lock().await;
        if let Some(entry) = held.get_mut(workspace) {
            apply_egress(entry, grant)?;
        }
        Ok(())
    }

    pub fn with_unbuilt(mut self, names: Vec<String>) -> NativeBackend {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.unbuilt = names;
        }
        self
    }

    /// Templates defined but not built here.
    pub fn unbuilt(&self) -> &[String] {
        &self.inner.unbuilt
    }

    /// Whether it offers its templates as microVMs too.
    pub fn runs_vms(&self) -> bool {
        self.inner.boxes.vm_tier().is_some()
    }

    /// Starts the warm pools' replenisher (call inside the async runtime): each template's
    /// pool fills to its target in the background.
    pub fn start_pools(&self) {
        if self.inner.pools.is_empty() {
            return;
        }
        let pools = self.inner.pools.iter().map(|p| p.pool.clone()).collect();
        tokio::spawn(crate::pool::replenish(
            pools,
            self.inner.pool_wake.clone(),
            self.inner.pool_at_once,
        ));
    }

    /// Every warm pool as it stands.
    pub fn pool_stats(&self) -> Vec<kiln_core::pool::PoolStats> {
        self.inner.pools.iter().map(|p| p.pool.stats()).collect()
    }

    /// A box for a new sandbox of `request`, from its template's warm pool where one serves
    /// such a sandbox (see [`kiln_core::process::ProcessHost::prestarted`]).
    pub(crate) async fn prestarted(
        &self,
        request: &ExecRequest,
    ) -> Result<Option<kiln_core::process::Prestarted>, BackendError> {
        let Ok(template) = self.template(request) else {
            return Ok(None);
        };
        let recipe = self.recipe(template, request);
        let Some(pool) = self.inner.pools.iter().find(|p| {
            p.template.definition.name == template.definition.name
                && p.template.vm == template.vm
                && p.template.gvisor == template.gvisor
                && p.recipe.limits == recipe.limits
                && p.recipe.network == recipe.network
                && p.recipe.mounts == recipe.mounts
                && p.recipe
                    .workspace_at
                    .as_deref()
                    .unwrap_or(&p.template.definition.working_dir)
                    == recipe
                        .workspace_at
                        .as_deref()
                        .unwrap_or(&template.definition.working_dir)
        }) else {
            return Ok(None);
        };
        use crate::pool::PoolError;
        let claimed = match pool.pool.claim().await {
            Ok(claimed) => claimed,
            // `wait` ran out: the sandbox is made without a box, which starts on its first
            // command as without a pool (a burst of creates past what the pool refills in
            // the claim timeout is served, not refused: 33 of 100 were, on defaults).
            Err(e @ PoolError::TimedOut { .. }) => {
                tracing::info!(template = %pool.pool.template(), "{e}: the box starts on the sandbox's first command");
                return Ok(None);
            }
            Err(e) => {
                let kind = match e {
                    PoolError::Start { .. } => ErrorKind::Instantiate,
                    _ => ErrorKind::Busy,
                };
                return Err(BackendError::new(kind, e.to_string()));
            }
        };
        Ok(Some(kiln_core::process::Prestarted {
            dir: claimed.member().dir.clone().unwrap_or_default(),
            hold: Box::new(claimed),
        }))
    }

    /// Hands the box of `prestarted` to the sandbox of `request.workspace`.
    pub(crate) async fn adopt(
        &self,
        prestarted: kiln_core::process::Prestarted,
        request: &ExecRequest,
    ) {
        let (Ok(mut claimed), Some(workspace), Ok(template)) = (
            prestarted.hold.downcast::<crate::pool::Claimed<Member>>(),
            request.workspace.clone(),
            self.template(request),
        ) else {
            return;
        };
        let Some(mut member) = claimed.take() else {
            return;
        };
        let live = member.live.take();
        // Its folder is the sandbox's now: nothing of it is removed with the member.
        member.dir = None;
        drop(member);
        drop(claimed);
        let Some(live) = live else { return };
        let mut held = self.inner.held.lock().await;
        let live = Arc::new(live);
        if let Some(old) = held.insert(
            workspace.clone(),
            Held {
                live,
                last_used: Instant::now(),
                connections: Arc::default(),
                policy: request.idle,
                recipe: self.recipe(template, request),
            },
        ) {
            self.close_later(&workspace, old.live);
        }
        drop(held);
        self.emit(
            &workspace,
            BoxState::Running,
            "started ahead, from the template's warm pool",
        );
    }

    /// Live boxes held for sandboxes.
    pub async fn held(&self) -> usize {
        self.inner.held.lock().await.len()
    }

    /// Closes every box (at shutdown), the pools' ready ones included.
    pub async fn close_all(&self) {
        for pool in &self.inner.pools {
            for mut member in pool.pool.close() {
                if let Some(live) = member.live.take() {
                    live.close().await;
                }
                tokio::task::spawn_blocking(move || drop(member)).await.ok();
            }
        }
        // Members still starting are removed by their starts once these see the pool closed.
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline
            && self.inner.pools.iter().any(|p| p.pool.stats().starting > 0)
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let all: Vec<_> = self.inner.held.lock().await.drain().collect();
        for (_, entry) in all {
            if let Ok(live) = Arc::try_unwrap(entry.live) {
                live.close().await;
            }
        }
        // Closed boxes finish their removal in the background: done before kiln exits.
        self.inner.boxes.settled(Duration::from_secs(15)).await;
    }
}

pub use kiln_core::process::{IdleAction, IdlePolicy};

/// Removes what a kiln before this one left in the pools' folder (its members' boxes are
/// gone with it; their volumes may still be mounted).
fn clear_pool_home(home: &std::path::Path) {
    let _ = std::fs::create_dir_all(home);
    // Passable, not listable: a box's runtime (gVisor's gofer, in the box's user namespace)
    // reaches its member's workspace through it.
    let _ = std::fs::set_permissions(home, std::os::unix::fs::PermissionsExt::from_mode(0o711));
    for entry in std::fs::read_dir(home).into_iter().flatten().flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            remove_member_dir(&entry.path());
        }
    }
}

/// Applies a sandbox's egress rules to its held box, and keeps them with its recipe (for
/// a checkpoint of it).
fn apply_egress(
    entry: &mut Held,
    grant: Option<kiln_core::net::EgressGrant>,
) -> Result<(), BackendError> {
    if let Some(egress) = entry.live.egress() {
        egress
            .set(grant.clone())
            .map_err(|e| BackendError::new(ErrorKind::Grant, e))?;
    }
    entry.recipe.egress = grant;
    Ok(())
}

/// The warm pool of `template`, unless its settings keep none.
fn box_pool(
    template: &Template,
    settings: &crate::pool::PoolSettings,
    boxes: &Boxes,
    ca_bundle: &Option<PathBuf>,
    home: &std::path::Path,
    volume: &crate::pool::MakeVolume,
    wake: &Arc<tokio::sync::Notify>,
) -> Option<BoxPool> {
    let definition = &template.definition;
    let config = if template.vm || template.gvisor {
        settings.for_variant(&template_id(template))
    } else {
        settings.for_template(
            &definition.name,
            &definition.languages,
            definition.pool.as_ref(),
        )
    };
    if config.target == 0 {
        return None;
    }
    let resources = definition.resources;
    let recipe = BoxRecipe {
        template: template_id(template),
        limits: BoxLimits {
            memory_bytes: resources.memory_mb << 20,
            vcpus: resources.vcpus,
            pids: resources.pids,
            disk_bytes: resources.disk_mb << 20,
            weight: 100,
        },
        network: false,
        workspace_at: None,
        idle: Default::default(),
        egress: None,
        mounts: Vec::new(),
    };
    let (boxes, home, volume, ca_bundle) = (
        boxes.clone(),
        home.to_path_buf(),
        volume.clone(),
        ca_bundle.clone(),
    );
    let (start_template, start_recipe) = (template.clone(), recipe.clone());
    let start: crate::pool::Starter<Member> = Arc::new(move || {
        let (boxes, home, volume, ca_bundle) = (
            boxes.clone(),
            home.clone(),
            volume.clone(),
            ca_bundle.clone(),
        );
        let (template, recipe) = (start_template.clone(), start_recipe.clone());
        Box::pin(async move {
            let dir = home.join(format!("m-{}", hex::encode(crate::boxes::random_bytes())));
            let made = {
                let dir = dir.clone();
                let bytes = recipe.limits.disk_bytes;
                tokio::task::spawn_blocking(move || -> std::io::Result<()> {
                    std::fs::create_dir(&dir)?;
                    volume(&dir.join("volume"), bytes)
                })
                .await
                .map_err(|e| e.to_string())
                .and_then(|r| r.map_err(|e| format!("its volume: {e}")))
            };
            let mut member = Member {
                dir: Some(dir.clone()),
                live: None,
            };
            made?;
            let workspace = dir.join("volume").join("workspace");
            let spec = BoxSpec {
                layer: persistent_layer(&workspace),
                workspace: Some(workspace),
                network: None,
                ca_bundle,
                ..BoxSpec::new(template, recipe.limits)
            };
            let live = boxes.open(spec).await.map_err(|e| e.to_string())?;
            if live.is_vm() {
                // Under a software CPU a VM's first process pays for translating the C
                // library and the shell; a member pays it before it is ready, not its claimer.
                let mut warm = Exec::new(vec!["sh".into(), "-c".into(), "true".into()]);
                warm.timeout = Duration::from_secs(60);
                live.exec(warm, |_, _| {})
                    .await
                    .map_err(|e| format!("warming the VM: {e}"))?;
            }
            member.live = Some(live);
            Ok(member)
        })
    });
    Some(BoxPool {
        pool: crate::pool::Pool::new(
            &recipe.template,
            if template.vm {
                "vm"
            } else if template.gvisor {
                "gvisor"
            } else {
                "box"
            },
            config,
            start,
            Member::alive,
            wake.clone(),
        ),
        template: template.clone(),
        recipe,
    })
}

/// The longest a request waits for a checkpoint of its sandbox's box to be taken.
const CHECKPOINT_WAIT: Duration = Duration::from_secs(120);

/// Where a sandbox's box keeps what it writes outside its workspace: `.layer` on the
/// sandbox's volume, beside `workspace` (the volume's root is out of the guest's reach; see
/// kiln-runtime's `volume`), so it outlives the box (a stop, a kiln restart) and counts
/// against the volume's size. `None` when the workspace is no volume's (its box then writes
/// into a tmpfs of its own).
pub fn persistent_layer(workspace: &std::path::Path) -> Option<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    if workspace.file_name()? != "workspace" {
        return None;
    }
    let volume = workspace.parent()?;
    let (own, outer) = (
        std::fs::symlink_metadata(volume).ok()?,
        std::fs::symlink_metadata(volume.parent()?).ok()?,
    );
    (own.is_dir() && own.dev() != outer.dev()).then(|| volume.join(".layer"))
}

/// Code up to this size is passed on the command line (`python3 -c`, `node -e`, `bash -c`),
/// so the program's folder is the working dir as in a terminal; larger code (and all Go) is
/// written to a file in the box's `/tmp` first.
const INLINE_CODE_BYTES: usize = 96 << 10;

/// What a request runs: its command, or its code in the request's language.
enum Program {
    Argv {
        argv: Vec<String>,
        cwd: Option<String>,
    },
    /// Code written to `file` in the box first, then run by `argv`.
    File {
        file: String,
        code: String,
        argv: Vec<String>,
    },
}

fn program(template: &Template, request: &ExecRequest) -> Result<Program, BackendError> {
    if let Some(command) = &request.command {
        if command.terminal.is_some() {
            return Err(BackendError::unsupported(
                "terminals on Linux templates are not supported yet",
            ));
        }
        return Ok(Program::Argv {
            argv: command.argv.clone(),
            cwd: command.cwd.clone(),
        });
    }
    let language = request.language;
    if !template
        .definition
        .languages
        .iter()
        .any(|l| l == language.name())
    {
        return Err(BackendError::unsupported(format!(
            "the {} template runs {} code, not {language}; send a `command` instead",
            template_id(template),
            template.definition.languages.join(" and ")
        )));
    }
    let code = request.code.clone();
    let (program, flag) = match language {
        Language::Python => ("python3", "-c"),
        Language::JavaScript => ("node", "-e"),
        Language::Bash => ("bash", "-c"),
        Language::Go => ("go", "run"),
    };
    if language != Language::Go && code.len() <= INLINE_CODE_BYTES {
        return Ok(Program::Argv {
            argv: vec![program.into(), flag.into(), code],
            cwd: None,
        });
    }
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let file = format!("/tmp/kiln-cell-{n}.{}", language.extension());
    let argv = match language {
        Language::Go => vec!["go".into(), "run".into(), file.clone()],
        _ => vec![program.into(), file.clone()],
    };
    Ok(Program::File { file, code, argv })
}

/// Runs `program` in `live`.
async fn run_program(
    live: &LiveBox,
    program: Program,
    mut exec: Exec,
    on_output: impl FnMut(bool, &[u8]),
) -> Result<crate::boxes::ExecOutput, crate::boxes::BoxError> {
    match program {
        Program::Argv { argv, cwd } => {
            exec.argv = argv;
            exec.cwd = cwd;
            live.exec(exec, on_output).await
        }
        Program::File { file, code, argv } => {
            live.write_file(&file, code.into_bytes()).await?;
            exec.argv = argv;
            let result = live.exec(exec, on_output).await;
            live.remove_file(&file).await;
            result
        }
    }
}

/// A box's command output as an execution's result, within the request's caps.
fn to_result(out: crate::boxes::ExecOutput, limits: &Limits, started: Instant) -> ExecResult {
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
    ExecResult {
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
        fs_refused: false,
        files_changed: None,
        results: Vec::new(),
        session_memory_bytes: None,
    }
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
        let program = program(template, request)?;
        let limits = &request.limits;
        let mut exec = Exec::new(Vec::new());
        exec.env = request.env.clone();
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
                run_program(&live, program, exec, on_output).await
            }
            None => {
                let live = self
                    .inner
                    .boxes
                    .open(self.spec(template, request))
                    .await
                    .map_err(|e| BackendError::new(ErrorKind::Instantiate, e.to_string()))?;
                let result = run_program(&live, program, exec, on_output).await;
                live.close().await;
                result
            }
        };
        let out = match result {
            Ok(out) => out,
            // The program could not start (not found, not executable): as a shell says it.
            Err(crate::boxes::BoxError::Refused(message)) => crate::boxes::ExecOutput {
                stderr: format!("{message}\n").into_bytes(),
                exit_code: Some(127),
                ..Default::default()
            },
            // Its box (or VM) ended under it: killed, a guest kernel panic.
            Err(crate::boxes::BoxError::Gone(_)) => {
                return Err(BackendError::new(
                    ErrorKind::Lost,
                    format!(
                        "the sandbox's {} ended while the command ran; its next command starts a new one",
                        if template.vm { "VM" } else { "box" }
                    ),
                ));
            }
            Err(e) => return Err(BackendError::new(ErrorKind::Instantiate, e.to_string())),
        };
        Ok(to_result(out, limits, started))
    }

    async fn open_session(&self, request: ExecRequest) -> Result<NativeSession, BackendError> {
        let template = self.template(&request)?;
        if request.language != Language::Python
            || !template.definition.languages.iter().any(|l| l == "python")
        {
            return Err(BackendError::unsupported(format!(
                "sessions on the {} template run Python only",
                template_id(template)
            )));
        }
        let live = match &request.workspace {
            Some(workspace) => self.held_box(template, &request, workspace).await?,
            None => Arc::new(
                self.inner
                    .boxes
                    .open(self.spec(template, &request))
                    .await
                    .map_err(|e| BackendError::new(ErrorKind::Instantiate, e.to_string()))?,
            ),
        };
        let resume = request
            .workspace
            .clone()
            .map(|workspace| (self.clone(), workspace));
        NativeSession::start(live, &request, resume).await
    }
}

/// The interpreter of a Python session: it reads `LENGTH\n` and that many bytes of code on
/// stdin, runs them in one namespace, then writes the turn's end marker (with its status) to
/// stdout and to stderr, so each stream is known to be drained.
const PYTHON_DRIVER: &str = r#"
import sys, traceback
token = sys.argv[1].encode()
ns = {"__name__": "__main__", "__builtins__": __builtins__}
stdin = sys.stdin.buffer
while True:
    head = stdin.readline()
    if not head:
        break
    code = stdin.read(int(head)).decode("utf-8", "replace")
    status = 0
    try:
        exec(compile(code, "<cell>", "exec"), ns)
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:
        # The cell's frames only, not the driver's.
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
            stream.buffer.write(b"\0" + token + b":" + str(status).encode() + b"\0\n")
            stream.flush()
        except Exception:
            pass
"#;

/// One output stream of a session turn: output passes through until the turn's end marker.
#[derive(Debug, Default)]
struct TurnStream {
    pending: Vec<u8>,
    status: Option<i32>,
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

impl TurnStream {
    /// Takes `data`; returns what can be passed on now (a possible start of the marker is
    /// held back until it is decided).
    fn feed(&mut self, data: &[u8], marker: &[u8]) -> Vec<u8> {
        self.pending.extend_from_slice(data);
        if let Some(at) = find(&self.pending, marker) {
            let after = at + marker.len();
            if let Some(end) = find(&self.pending[after..], b"\0\n") {
                let status = std::str::from_utf8(&self.pending[after..after + end])
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(1);
                self.status = Some(status);
                let out = self.pending[..at].to_vec();
                self.pending.clear();
                return out;
            }
            let out = self.pending[..at].to_vec();
            self.pending.drain(..at);
            return out;
        }
        let keep = (1..marker.len().min(self.pending.len() + 1))
            .rev()
            .find(|&n| self.pending.ends_with(&marker[..n]))
            .unwrap_or(0);
        let cut = self.pending.len() - keep;
        self.pending.drain(..cut).collect()
    }
}

/// A Python session in a Linux box: one interpreter process that keeps its variables.
pub struct NativeSession {
    live: Arc<LiveBox>,
    /// Where its box is restored from when it was hibernated with a checkpoint (a sandbox's
    /// session: its interpreter comes back with the box, its variables kept).
    resume: Option<(NativeBackend, PathBuf)>,
    target: u64,
    replies: crate::channel::Replies,
    /// `\0TOKEN:`, the start of a turn's end marker.
    marker: Vec<u8>,
    ended: Option<String>,
}

impl std::fmt::Debug for NativeSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NativeSession")
            .field("target", &self.target)
            .finish_non_exhaustive()
    }
}

impl NativeSession {
    async fn start(
        live: Arc<LiveBox>,
        request: &ExecRequest,
        resume: Option<(NativeBackend, PathBuf)>,
    ) -> Result<NativeSession, BackendError> {
        let mut bytes = [0u8; 12];
        let _ = std::fs::File::open("/dev/urandom")
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes));
        let token = format!("kiln-turn-{}", hex::encode(bytes));
        let mut exec = Exec::new(vec![
            "python3".into(),
            "-u".into(),
            "-c".into(),
            PYTHON_DRIVER.into(),
            token.clone(),
        ]);
        exec.env = request.env.clone();
        let replies = live
            .spawn(&exec)
            .await
            .map_err(|e| BackendError::new(ErrorKind::Instantiate, e.to_string()))?;
        Ok(NativeSession {
            target: replies.id,
            live,
            resume,
            replies,
            marker: format!("\0{token}:").into_bytes(),
            ended: None,
        })
    }

    fn end(&mut self, why: &str) {
        self.ended = Some(why.to_string());
    }

    /// Takes up its interpreter in the box restored from a checkpoint of its box, if its box
    /// was hibernated so (restoring it now).
    async fn reattach(&mut self) {
        if self.live.is_alive() {
            return;
        }
        let Some((backend, workspace)) = &self.resume else {
            return;
        };
        if let Some(live) = backend.restored(workspace, self.live.lineage).await
            && let Some(replies) = live.adopt(self.target)
        {
            self.live = live;
            self.replies = replies;
        }
    }
}

impl BackendSession for NativeSession {
    async fn run(
        &mut self,
        code: &str,
        limits: &Limits,
        output: Option<OutputSink>,
        _door: Option<Door>,
    ) -> Result<ExecResult, BackendError> {
        if let Some(why) = &self.ended {
            return Err(BackendError::new(
                ErrorKind::SessionEnded,
                format!("the session ended earlier ({why}); open a new one"),
            ));
        }
        self.reattach().await;
        let started = Instant::now();
        let oom_before = self.live.oom_kills();
        let mut input = format!("{}\n", code.len()).into_bytes();
        input.extend_from_slice(code.as_bytes());
        self.live
            .write_stdin(self.target, input)
            .await
            .map_err(|e| BackendError::new(ErrorKind::SessionEnded, e.to_string()))?;
        let mut turn = Turn::new(limits);
        let deadline = tokio::time::Instant::now() + Duration::from_millis(limits.timeout_ms);
        let mut outcome = Outcome::Completed;
        let mut exit_code = 0;
        while !turn.done() {
            let reply = match tokio::time::timeout_at(deadline, self.replies.next()).await {
                Ok(Some(reply)) => reply,
                Ok(None) => {
                    self.end("its box ended");
                    return Err(BackendError::new(
                        ErrorKind::SessionEnded,
                        "the session's box ended",
                    ));
                }
                Err(_) => {
                    let _ = self.live.signal(self.target, libc::SIGKILL).await;
                    self.end("a turn ran past its time limit");
                    outcome = Outcome::TimedOut;
                    exit_code = -1;
                    break;
                }
            };
            match reply {
                Reply::Output { stderr, data } => {
                    turn.output(stderr, &data, &self.marker, output.as_ref());
                }
                Reply::Exited { code, signal } => {
                    // The interpreter died mid-turn (killed for memory, os._exit, a crash).
                    let oom = signal == Some(libc::SIGKILL) && self.live.oom_kills() > oom_before;
                    (outcome, exit_code) = died(code, signal, oom);
                    self.end("its interpreter exited");
                    break;
                }
                _ => {}
            }
        }
        if outcome == Outcome::Completed {
            exit_code = turn.status();
            if turn.truncated.iter().any(|t| *t) {
                outcome = Outcome::OutputTruncated;
            }
        }
        let [stdout, stderr] = turn.kept;
        Ok(ExecResult {
            stdout,
            stderr,
            exit_code,
            outcome,
            stdout_truncated: turn.truncated[0],
            stderr_truncated: turn.truncated[1],
            duration_us: started.elapsed().as_micros() as u64,
            peak_memory_bytes: 0,
            fs_written_bytes: 0,
            fs_refused: false,
            files_changed: None,
            results: Vec::new(),
            session_memory_bytes: None,
        })
    }
}

/// How a turn ended whose interpreter exited.
fn died(code: Option<i32>, signal: Option<i32>, oom: bool) -> (Outcome, i32) {
    let outcome = if oom {
        Outcome::MemoryLimit
    } else {
        Outcome::Crashed {
            trap: format!("the interpreter exited ({code:?}, signal {signal:?})"),
        }
    };
    (outcome, code.unwrap_or(-1))
}

/// One session turn's output: both streams up to their end markers, kept within the caps.
struct Turn {
    streams: [TurnStream; 2],
    kept: [Vec<u8>; 2],
    truncated: [bool; 2],
    caps: [usize; 2],
}

impl Turn {
    fn new(limits: &Limits) -> Turn {
        Turn {
            streams: [TurnStream::default(), TurnStream::default()],
            kept: [Vec::new(), Vec::new()],
            truncated: [false, false],
            caps: [
                usize::try_from(limits.stdout_bytes).unwrap_or(usize::MAX),
                usize::try_from(limits.stderr_bytes).unwrap_or(usize::MAX),
            ],
        }
    }

    /// Both streams reached the turn's end marker.
    fn done(&self) -> bool {
        self.streams.iter().all(|s| s.status.is_some())
    }

    /// The cell's status (from the end marker).
    fn status(&self) -> i32 {
        self.streams[0]
            .status
            .or(self.streams[1].status)
            .unwrap_or(0)
    }

    fn output(&mut self, stderr: bool, data: &[u8], marker: &[u8], sink: Option<&OutputSink>) {
        let i = usize::from(stderr);
        let out = self.streams[i].feed(data, marker);
        if out.is_empty() {
            return;
        }
        if let Some(sink) = sink {
            let _ = sink.send(OutputChunk {
                stream: if stderr {
                    StreamKind::Stderr
                } else {
                    StreamKind::Stdout
                },
                data: bytes::Bytes::copy_from_slice(&out),
            });
        }
        let room = self.caps[i].saturating_sub(self.kept[i].len());
        self.kept[i].extend_from_slice(&out[..out.len().min(room)]);
        self.truncated[i] |= out.len() > room;
    }
}

impl Drop for NativeSession {
    fn drop(&mut self) {
        // Closing a session ends its interpreter.
        let (live, target) = (self.live.clone(), self.target);
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                let _ = live.signal(target, libc::SIGKILL).await;
            });
        }
    }
}

/// Takes a workspace off the checkpointing list when dropped (however the hold ends).
struct Unmark<'a>(&'a NativeBackend, &'a std::path::Path);

impl Drop for Unmark<'_> {
    fn drop(&mut self) {
        self.0.checkpointing().remove(self.1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_turn_stream_passes_output_and_finds_its_marker_across_chunks() {
        let marker = b"\0tok:";
        let mut stream = TurnStream::default();
        let mut out = Vec::new();
        for piece in [&b"hello \0"[..], b"to", b"k:", b"0", b"\0\n"] {
            out.extend(stream.feed(piece, marker));
        }
        assert_eq!(out, b"hello ");
        assert_eq!(stream.status, Some(0));
        let mut stream = TurnStream::default();
        assert_eq!(stream.feed(b"a\0b\0to", marker), b"a\0b");
        assert_eq!(stream.feed(b"x", marker), b"\0tox");
        assert_eq!(stream.feed(b"\0tok:3\0\n", marker), b"");
        assert_eq!(stream.status, Some(3));
    }
}
