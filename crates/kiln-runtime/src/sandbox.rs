//! The sandbox registry: what a container id stands for, whose it is, its workspace and
//! history, its sessions and lifetime. Every sandbox is a folder under the data directory:
//!
//! ```text
//! sandboxes/<id>/meta.json      the record (written atomically, fsynced, before any ack)
//! sandboxes/<id>/workspace/     the files code sees as /workspace
//! sandboxes/<id>/history.git/   a bare git repository of the workspace's changes (made on first use)
//! sandboxes/<id>/.tmp/          scratch for writes into the workspace (out of the guest's reach)
//! ```
//!
//! The workspace is guest-writable and so hostile: the host touches it only through
//! [`kiln_workspace::Tree`] ([`Sandbox::tree`]), never with plain paths.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use kiln_core::Language;
use kiln_executor::SessionHandle;
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use crate::error::{Result, RuntimeError};
use crate::history::History;
use crate::lifecycle::Lifecycle;
use crate::quota::{Quotas, Usage};
use crate::store;
use kiln_workspace::{RelPath, Tree};

/// What a new sandbox is: the image the client named, the template that honours it, and
/// its bounds.
#[derive(Debug, Clone, PartialEq)]
pub struct SandboxSpec {
    pub image: String,
    pub template: String,
    pub language: Language,
    pub lifetime_ms: u64,
    pub memory_bytes: u64,
    /// Its network (see [`SandboxSpec::with_network`]).
    pub network: kiln_core::Network,
    /// Its own egress rules (see [`SandboxSpec::with_egress`]).
    pub egress: Option<kiln_core::net::Egress>,
    /// Whether its rules may widen the operator's list (set from the key that makes it, by
    /// [`crate::exec::create_sandbox`]).
    pub egress_widen: bool,
    /// Named volumes it mounts (see [`SandboxSpec::with_volumes`]).
    pub volume_mounts: Vec<crate::volumes::VolumeMount>,
    /// Its live box's resources: the template's, changed by
    /// [`SandboxSpec::with_resources`]; `None` for templates without boxes (WebAssembly).
    /// Its `memory_mb` is always `memory_bytes`'s.
    pub resources: Option<kiln_core::template::Resources>,
    /// Who its workspace belongs to on the host (its template's `workspace_owner`).
    pub workspace_owner: Option<(u32, u32)>,
    /// Where its code sees the workspace; `None`: `/workspace`.
    pub workspace_at: Option<String>,
    /// Labels the client keeps with it (E2B's metadata).
    pub metadata: BTreeMap<String, String>,
    /// Environment variables every execution, session and process in it sees.
    pub env: BTreeMap<String, String>,
    /// A token of its own that reaches it without an API key (E2B's envd access token).
    pub access_token: Option<String>,
    /// See [`Sandbox::public_ports`].
    pub public_ports: bool,
    /// The key that made it (set by [`crate::exec::create_sandbox`]).
    pub key_id: Option<String>,
    /// When it ends and what becomes of its box ([`crate::lifecycle`]); a
    /// `terminate_after_idle_ms` means no fixed life: `lifetime_ms` is then that window.
    pub lifecycle: Lifecycle,
}

/// Default sandbox lifetime: 30 minutes.
pub const DEFAULT_LIFETIME_MS: u64 = 30 * 60 * 1000;
/// Shortest sandbox lifetime: 1 second.
pub const MIN_LIFETIME_MS: u64 = 1000;
/// Longest sandbox lifetime: 24 hours.
pub const MAX_LIFETIME_MS: u64 = 24 * 3600 * 1000;

impl SandboxSpec {
    /// The sandbox `image` asks for: the template that honours it, the lifetime (default
    /// [`DEFAULT_LIFETIME_MS`]) and the memory cap (default [`kiln_core::Limits`]'s; a size
    /// such as `"512m"`).
    pub fn resolve(
        catalogue: &kiln_core::template::Catalogue,
        image: &str,
        lifetime_ms: Option<u64>,
        memory_limit: Option<&str>,
    ) -> Result<SandboxSpec> {
        let template = catalogue
            .resolve(image)
            .map_err(|unknown| RuntimeError::UnknownImage {
                message: unknown.to_string(),
                image: unknown.image.clone(),
                available: unknown.available.clone(),
                templates: catalogue.templates().iter().map(|t| t.id.clone()).collect(),
            })?;
        let language = template.default_language();
        let Some(lifetime_ms) = lifetime_ms else {
            let memory =
                SandboxSpec::resolve(catalogue, image, Some(MIN_LIFETIME_MS), memory_limit)?
                    .memory_bytes;
            return Ok(SandboxSpec::of_template(
                image.trim(),
                template,
                DEFAULT_LIFETIME_MS,
                memory,
            )
            .with_idle_life(crate::lifecycle::DEFAULT_IDLE_LIFE_MS));
        };
        if !(MIN_LIFETIME_MS..=MAX_LIFETIME_MS).contains(&lifetime_ms) {
            return Err(RuntimeError::InvalidOption {
                message: format!(
                    "the lifetime must be {MIN_LIFETIME_MS}..={MAX_LIFETIME_MS} ms, got {lifetime_ms}"
                ),
            });
        }
        let memory_bytes = match memory_limit {
            None => kiln_core::Limits::default().memory_bytes,
            Some(text) => kiln_core::parse_size(text)
                .ok()
                .filter(|b| (language.min_memory_bytes()..=4 << 30).contains(b))
                .ok_or_else(|| RuntimeError::InvalidOption {
                    message: format!(
                        "memoryLimit {text:?} is not a size between {} MiB and 4 GiB (e.g. \"512m\")",
                        language.min_memory_bytes() >> 20
                    ),
                })?,
        };
        Ok(SandboxSpec::of_template(
            image.trim(),
            template,
            lifetime_ms,
            memory_bytes,
        ))
    }

    /// The image a create request names: its `image` (or language), its `template` (an id
    /// from the catalogue), or both where both name the same template; neither: `default`.
    /// Two that name different templates are refused with `INVALID_OPTION`.
    pub fn named_image(
        catalogue: &kiln_core::template::Catalogue,
        image: Option<&str>,
        template: Option<&str>,
        default: &str,
    ) -> Result<String> {
        match (image, template) {
            (None, None) => Ok(default.to_owned()),
            (Some(one), None) | (None, Some(one)) => Ok(one.to_owned()),
            (Some(image), Some(template)) => {
                let of_image = catalogue.resolve(image).map(|t| t.id.clone());
                let of_template = catalogue.resolve(template).map(|t| t.id.clone());
                match (of_image, of_template) {
                    (Ok(a), Ok(b)) if a != b => Err(RuntimeError::InvalidOption {
                        message: format!(
                            "image {image:?} is template {a:?} but template names {b:?}; name one, or two that agree"
                        ),
                    }),
                    // Agreeing, or one unknown: resolving it says which.
                    (Ok(_), Err(_)) => Ok(template.to_owned()),
                    _ => Ok(image.to_owned()),
                }
            }
        }
    }

    /// A sandbox of `template` in its default language with no network, its box's
    /// resources the template's (memory as `memory_bytes`), its workspace the template's
    /// owner's.
    pub fn of_template(
        image: &str,
        template: &kiln_core::template::TemplateInfo,
        lifetime_ms: u64,
        memory_bytes: u64,
    ) -> SandboxSpec {
        SandboxSpec {
            image: image.to_owned(),
            template: template.id.clone(),
            language: template.default_language(),
            lifetime_ms,
            memory_bytes,
            network: kiln_core::Network::None,
            egress: None,
            egress_widen: false,
            volume_mounts: Vec::new(),
            resources: template.resources.map(|r| kiln_core::template::Resources {
                memory_mb: memory_bytes >> 20,
                ..r
            }),
            workspace_owner: template.workspace_owner,
            workspace_at: None,
            metadata: BTreeMap::new(),
            env: BTreeMap::new(),
            access_token: None,
            public_ports: false,
            key_id: None,
            lifecycle: Lifecycle::default(),
        }
    }

    /// The sandbox with no fixed life: it ends after `window_ms` without a request (each
    /// request moves its end).
    pub fn with_idle_life(mut self, window_ms: u64) -> SandboxSpec {
        self.lifetime_ms = window_ms;
        self.lifecycle.terminate_after_idle_ms = Some(window_ms);
        self
    }

    /// Whether its template runs a live box (WebAssembly ones have none).
    fn runs_box(&self, catalogue: &kiln_core::template::Catalogue) -> bool {
        catalogue
            .get(&self.template)
            .is_some_and(|t| t.lifecycle == kiln_core::template::Lifecycle::Live)
    }

    /// The sandbox with its box's previews open to anyone (`public`), where its template
    /// runs a box; refused for one that does not.
    pub fn with_public_previews(
        mut self,
        catalogue: &kiln_core::template::Catalogue,
        public: bool,
    ) -> Result<SandboxSpec> {
        if public {
            if !self.runs_box(catalogue) {
                return Err(RuntimeError::InvalidOption {
                    message: "publicPreviews is about a Linux box's servers; this template runs WebAssembly, which serves none".into(),
                });
            }
            self.public_ports = true;
        }
        Ok(self)
    }

    /// The sandbox with the lifecycle a create request gives (checked against its template
    /// and its life: see [`Lifecycle::check`]); what `asked` leaves out stays as it is.
    pub fn with_lifecycle(
        mut self,
        catalogue: &kiln_core::template::Catalogue,
        asked: Option<&Lifecycle>,
    ) -> Result<SandboxSpec> {
        let Some(asked) = asked else { return Ok(self) };
        let boxed = self.runs_box(catalogue);
        let fixed = self.lifecycle.terminate_after_idle_ms.is_none();
        asked.check(boxed, fixed)?;
        let window = asked
            .terminate_after_idle_ms
            .or(self.lifecycle.terminate_after_idle_ms);
        self.lifecycle = Lifecycle {
            terminate_after_idle_ms: window,
            ..asked.clone()
        };
        if let Some(window) = window {
            self.lifetime_ms = window;
        }
        if let Some(cap) = self.lifecycle.max_duration_ms {
            self.lifetime_ms = self.lifetime_ms.min(cap);
        }
        Ok(self)
    }

    /// The sandbox with the resources `asked` changes (seed 002's limits): CPU, processes
    /// and disk only where its template runs live boxes (Linux); memory anywhere, as
    /// `memory_mb` or the `memory_limit` it was resolved with, not both.
    pub fn with_resources(
        mut self,
        asked: Option<&kiln_core::template::ResourceRequest>,
        memory_limit_given: bool,
    ) -> Result<SandboxSpec> {
        let Some(asked) = asked else {
            return Ok(self);
        };
        let invalid = |message: String| RuntimeError::InvalidOption { message };
        if let Some(mb) = asked.memory_mb {
            if memory_limit_given {
                return Err(invalid(
                    "give the memory cap once: resources.memory_mb or memoryLimit, not both".into(),
                ));
            }
            let bytes = mb.saturating_mul(1 << 20);
            let min = self.language.min_memory_bytes();
            if !(min..=4 << 30).contains(&bytes) {
                return Err(invalid(format!(
                    "resources.memory_mb must be {}..=4096, got {mb}",
                    min >> 20
                )));
            }
            self.memory_bytes = bytes;
        }
        let box_only = asked.vcpus.is_some() || asked.disk_mb.is_some() || asked.pids.is_some();
        let Some(resources) = &mut self.resources else {
            if box_only {
                return Err(RuntimeError::Unsupported {
                    message: format!(
                        "the {} template runs WebAssembly guests, which have one thread, no processes and a per-run write budget; resources.vcpus, disk_mb and pids need a Linux template (python:3.11, linux-python, …)",
                        self.template
                    ),
                });
            }
            return Ok(self);
        };
        resources.memory_mb = self.memory_bytes >> 20;
        if let Some(vcpus) = asked.vcpus {
            let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
            if !(vcpus.is_finite() && (0.05..=cpus).contains(&vcpus)) {
                return Err(invalid(format!(
                    "resources.vcpus must be 0.05..={cpus} (this host's CPUs), got {vcpus}"
                )));
            }
            resources.vcpus = vcpus;
        }
        if let Some(mb) = asked.disk_mb {
            let (min, max) = (
                crate::volume::MIN_BYTES >> 20,
                crate::volume::MAX_BYTES >> 20,
            );
            if !(min..=max).contains(&mb) {
                return Err(invalid(format!(
                    "resources.disk_mb must be {min}..={max}, got {mb}"
                )));
            }
            resources.disk_mb = mb;
        }
        if let Some(pids) = asked.pids {
            if !(16..=32_768).contains(&pids) {
                return Err(invalid(format!(
                    "resources.pids must be 16..=32768, got {pids}"
                )));
            }
            resources.pids = pids;
        }
        Ok(self)
    }

    /// The sandbox with the network `name` (`none` or `allowlist`), which only templates
    /// that run live boxes (Linux) have; WebAssembly guests have no network at all.
    pub fn with_network(
        mut self,
        catalogue: &kiln_core::template::Catalogue,
        name: Option<&str>,
    ) -> Result<SandboxSpec> {
        let Some(name) = name else {
            return Ok(self);
        };
        let network =
            kiln_core::Network::from_name(name).ok_or_else(|| RuntimeError::InvalidOption {
                message: format!("network is \"none\" or \"allowlist\", not {name:?}"),
            })?;
        let live = catalogue
            .get(&self.template)
            .is_some_and(|t| t.lifecycle == kiln_core::template::Lifecycle::Live);
        if network == kiln_core::Network::Allowlist && !live {
            return Err(RuntimeError::Unsupported {
                message: format!(
                    "the {} template has no network at all; network \"allowlist\" needs a Linux template (python:3.11, linux-python, …)",
                    self.template
                ),
            });
        }
        self.network = network;
        Ok(self)
    }

    /// The sandbox with `tenant`'s named volumes mounted (`mounts` name them by id or
    /// name; kept by id): at most [`crate::volumes::MAX_MOUNTS`], each at a path of its own
    /// outside the system's folders and off the workspace. Linux boxes (not microVMs) and
    /// WebAssembly guests mount them.
    pub fn with_volumes(
        mut self,
        catalogue: &kiln_core::template::Catalogue,
        volumes: &crate::volumes::Volumes,
        tenant: &str,
        mounts: &[crate::volumes::VolumeMount],
    ) -> Result<SandboxSpec> {
        if mounts.is_empty() {
            return Ok(self);
        }
        let invalid = |message: String| RuntimeError::InvalidOption { message };
        if mounts.len() > crate::volumes::MAX_MOUNTS {
            return Err(invalid(format!(
                "at most {} volume mounts a sandbox",
                crate::volumes::MAX_MOUNTS
            )));
        }
        if catalogue
            .get(&self.template)
            .is_some_and(|t| t.id.starts_with("vm-"))
        {
            return Err(RuntimeError::Unsupported {
                message: format!(
                    "the {} template is a microVM, which mounts no named volumes yet; use its box template",
                    self.template
                ),
            });
        }
        let workspace = self
            .workspace_at
            .clone()
            .unwrap_or_else(|| kiln_core::WORKSPACE_GUEST.to_string());
        let mut resolved = Vec::new();
        for mount in mounts {
            crate::volumes::check_path(&mount.path)?;
            if mount.path == workspace || workspace.starts_with(&format!("{}/", mount.path)) {
                return Err(invalid(format!(
                    "volume mount path {:?} would cover the workspace ({workspace})",
                    mount.path
                )));
            }
            if resolved
                .iter()
                .any(|m: &crate::volumes::VolumeMount| m.path == mount.path)
            {
                return Err(invalid(format!("two volumes at {:?}", mount.path)));
            }
            let record = volumes.find(tenant, &mount.volume)?;
            resolved.push(crate::volumes::VolumeMount {
                volume: record.id,
                ..mount.clone()
            });
        }
        self.volume_mounts = resolved;
        Ok(self)
    }

    /// The sandbox with egress rules of its own (`allowOut`, `denyOut`, `rules`): a network
    /// through kiln's proxy (as `allowlist`), narrowed (or, where its key may, widened) by
    /// them. Only templates with live boxes have a network.
    pub fn with_egress(
        mut self,
        catalogue: &kiln_core::template::Catalogue,
        egress: Option<kiln_core::net::Egress>,
    ) -> Result<SandboxSpec> {
        let Some(egress) = egress else {
            return Ok(self);
        };
        egress
            .validate()
            .map_err(|message| RuntimeError::InvalidOption {
                message: format!("network: {message}"),
            })?;
        self = self.with_network(catalogue, Some("allowlist"))?;
        self.egress = (!egress.is_empty()).then_some(egress);
        Ok(self)
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// RFC 3339 UTC text for a millisecond timestamp.
pub fn rfc3339(ms: u64) -> String {
    let secs = (ms / 1000) as i64;
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

/// A stateful session (code context) of a sandbox, as recorded on disk.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SessionMeta {
    pub id: String,
    pub language: Language,
    pub created_ms: u64,
    pub turns: u64,
}

/// One sandbox, as recorded in its `meta.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Sandbox {
    pub id: String,
    pub tenant: String,
    pub image: String,
    /// The template it was made from; sandboxes made before templates existed have none and
    /// use their language's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    pub language: Language,
    pub created_ms: u64,
    pub expires_ms: u64,
    pub memory_bytes: u64,
    pub executions: u64,
    pub cpu_time_ms: u64,
    #[serde(default)]
    pub sessions: BTreeMap<String, SessionMeta>,
    /// Bytes in the workspace when its history last recorded it (for the tenant's quota).
    #[serde(default)]
    pub workspace_bytes: u64,
    /// Its network (Linux templates).
    #[serde(default, skip_serializing_if = "kiln_core::Network::is_none")]
    pub network: kiln_core::Network,
    /// Its own egress rules, within the operator's list (with a network).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<kiln_core::net::Egress>,
    /// Whether its egress rules may widen the operator's list (the key that set them may).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub egress_widen: bool,
    /// The named volumes it mounts (by id).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volume_mounts: Vec<crate::volumes::VolumeMount>,
    /// Its live box's resources (Linux templates).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<kiln_core::template::Resources>,
    /// Whether its workspace lives on a size-capped volume of `resources.disk_mb`
    /// ([`crate::volume`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub volume: bool,
    /// Where its code sees the workspace; `None`: `/workspace`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace_at: Option<String>,
    /// Labels the client keeps with it.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    /// Environment variables every execution, session and process in it sees.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// A token of its own that reaches it without an API key (E2B's envd access token).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access_token: Option<String>,
    /// Whether anyone may reach the servers its box runs through the E2B facade's host
    /// names (`{port}-{id}.{domain}`) without a token: E2B's `allowPublicTraffic`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub public_ports: bool,
    /// The public id of the API key that made it: requests that reach it by its own
    /// token (the E2B facade's sandbox plane) act with that key's quotas and rate limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_id: Option<String>,
    /// When it ends and what becomes of its box ([`crate::lifecycle`]).
    #[serde(default, skip_serializing_if = "is_default")]
    pub lifecycle: Lifecycle,
    /// Whether the end of its fixed life paused it (`onTimeout: "pause"`): it is kept
    /// [`crate::lifecycle::PAUSED_KEEP_MS`] more, then deleted unless renewed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub timed_out: bool,
    /// The length of its fixed life, as last given (create or renew): what a sandbox its
    /// timeout paused gets again when it resumes. 0 in records older than it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub life_ms: u64,
    /// Runtime only: the folder the sandbox lives in.
    #[serde(skip)]
    pub dir: PathBuf,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn is_default(lifecycle: &Lifecycle) -> bool {
    *lifecycle == Lifecycle::default()
}

impl Sandbox {
    /// Its named volumes as a backend grants them: each volume's folder at its path.
    pub fn mounts(&self, volumes: &crate::volumes::Volumes) -> Vec<kiln_core::Mount> {
        self.volume_mounts
            .iter()
            .map(|m| kiln_core::Mount {
                host: volumes.content(&m.volume),
                guest: m.path.clone(),
                writable: !m.read_only,
            })
            .collect()
    }

    /// What its box's proxy applies: its rules, with whom they are of; `None` where it has
    /// no network or no rules of its own (the operator's list alone).
    pub fn egress_grant(&self) -> Option<kiln_core::net::EgressGrant> {
        if self.network != kiln_core::Network::Allowlist {
            return None;
        }
        let rules = self.egress.clone()?;
        Some(kiln_core::net::EgressGrant {
            rules,
            widen: self.egress_widen,
            tenant: self.tenant.clone(),
            sandbox: self.id.clone(),
        })
    }

    /// Where its life ends at the latest (`maxDurationMs` from creation); `u64::MAX`: no cap.
    pub fn hard_end_ms(&self) -> u64 {
        self.lifecycle
            .max_duration_ms
            .map_or(u64::MAX, |cap| self.created_ms.saturating_add(cap))
    }

    /// Whether it is alive at `now`: before its end, or past the end of a fixed life that
    /// pauses it (`onTimeout: "pause"`) and that the reaper has yet to pause.
    pub fn live_at(&self, now: u64) -> bool {
        self.expires_ms > now
            || (self.lifecycle.pauses_on_timeout() && !self.timed_out && self.hard_end_ms() > now)
    }

    /// Moves the end of a life that requests extend (no fixed life) to a full window from
    /// now; answers whether it moved enough to be worth saving (a tenth of the window, at
    /// most a minute: a crash loses at most that much of its life).
    fn slide(&mut self, now: u64) -> bool {
        let Some(window) = self.lifecycle.terminate_after_idle_ms else {
            return false;
        };
        let end = now.saturating_add(window).min(self.hard_end_ms());
        if end > self.expires_ms.saturating_add((window / 10).min(60_000)) {
            self.expires_ms = end;
            return true;
        }
        false
    }

    /// The template it was made from.
    pub fn template(&self) -> &str {
        self.template.as_deref().unwrap_or(self.language.name())
    }

    /// The folder the code sees as `/workspace` (on its volume where it has one).
    pub fn workspace(&self) -> PathBuf {
        self.data_root().join("workspace")
    }

    /// Where the workspace's volume is mounted.
    pub fn volume_dir(&self) -> PathBuf {
        self.dir.join("volume")
    }

    /// The folder holding the workspace and its scratch: the volume, or the sandbox's own.
    fn data_root(&self) -> PathBuf {
        if self.volume {
            self.volume_dir()
        } else {
            self.dir.clone()
        }
    }

    /// Mounts the workspace's volume (made first if new); nothing for one without.
    pub fn attach_volume(&self) -> std::io::Result<()> {
        match self.resources {
            Some(resources) if self.volume => {
                crate::volume::attach(&self.volume_dir(), resources.disk_mb << 20)
            }
            _ => Ok(()),
        }
    }

    /// The git repository recording the workspace's history.
    pub fn git_dir(&self) -> PathBuf {
        self.dir.join("history.git")
    }

    /// Where writes into the workspace are staged: beside it (on the same file system), out
    /// of the guest's reach.
    pub fn scratch_dir(&self) -> PathBuf {
        self.data_root().join(".tmp")
    }

    fn meta_path(&self) -> PathBuf {
        self.dir.join("meta.json")
    }

    /// The workspace, for the host to read and write without following anything the guest
    /// planted.
    pub fn tree(&self) -> Result<Tree> {
        Ok(Tree::open(&self.workspace(), Some(&self.scratch_dir()))?)
    }

    /// Opens the workspace's history, making it on first use (a sandbox created empty has
    /// none until something needs it: [`History::open_or_create`]).
    pub fn history(&self) -> Result<History> {
        Ok(History::open_or_create(&self.git_dir(), self.created_ms)?)
    }
}

/// `text` with every absolute path in it replaced by `…`: libgit2 and the OS name the files
/// they failed on, and a client must never learn where the server keeps its data.
pub fn scrub_paths(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    let mut previous = ' ';
    while let Some(c) = chars.next() {
        if c == '/'
            && (previous.is_whitespace() || matches!(previous, '\'' | '"' | '(' | '=' | ':'))
        {
            // Skip to the end of the path: whitespace or a closing quote.
            while let Some(&next) = chars.peek() {
                if next.is_whitespace() || matches!(next, '\'' | '"' | ')' | ':' | ',') {
                    break;
                }
                chars.next();
            }
            out.push('…');
            previous = '…';
            continue;
        }
        out.push(c);
        previous = c;
    }
    out
}

/// What a sandbox is doing now.
#[derive(Debug)]
struct Running {
    id: String,
    cancel: Option<oneshot::Sender<()>>,
    /// Set when a file was uploaded beside this work: its record must look at the
    /// workspace even if the work itself changed nothing.
    files_written: bool,
}

#[derive(Debug)]
struct Entry {
    meta: Sandbox,
    running: Option<Running>,
    deleted: bool,
    handles: HashMap<String, SessionHandle>,
    /// What each live session holds now, in bytes: measured after its turns, or what was
    /// counted when it opened (see [`Quotas::session_memory_bytes`]).
    session_use: HashMap<String, u64>,
    /// Bytes a running session turn here may still grow its session's memory by (reserved
    /// against the tenant's session memory quota while it runs).
    turn_grant: u64,
    /// Held while the record is written: one writer per sandbox, so writes never race and
    /// the last one carries the newest state.
    writer: Arc<Mutex<()>>,
}

/// A snapshot of a sandbox and what it is running.
#[derive(Debug, Clone)]
pub struct SandboxView {
    pub meta: Sandbox,
    pub running: Option<String>,
    /// Sessions whose live state is held by a worker (others were lost to a restart).
    pub live_sessions: Vec<String>,
}

/// Every sandbox, durable under `root/sandboxes/<id>/`.
#[derive(Debug)]
pub struct Registry {
    root: PathBuf,
    sandboxes: Mutex<HashMap<String, Entry>>,
    /// Sandboxes whose usage counters changed since they were last written.
    dirty: Mutex<std::collections::HashSet<String>>,
    /// The tenants' named volumes.
    pub volumes: crate::volumes::Volumes,
    /// Snapshots of Linux sandboxes.
    pub snapshots: crate::snapshots::Snapshots,
    /// Workspaces: long-lived Linux sandboxes with services.
    pub workspaces: crate::workspaces::Workspaces,
    /// Where sandboxes made and gone are told, when this server is a node of a cluster
    /// ([`Registry::observe`]).
    observer: Mutex<Option<tokio::sync::mpsc::UnboundedSender<DirectoryEvent>>>,
}

/// What the registry tells a cluster's directory (issue 38): a sandbox made here, or gone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DirectoryEvent {
    Placed { id: String, tenant: String },
    Removed { id: String },
}

/// Random bytes as hex, from the kernel.
pub fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    let mut f = std::fs::File::open("/dev/urandom").expect("/dev/urandom is readable");
    std::io::Read::read_exact(&mut f, &mut buf).expect("/dev/urandom gives bytes");
    hex::encode(buf)
}

/// A fresh random id with a prefix.
pub fn new_id(prefix: &str) -> String {
    format!("{prefix}{}", random_hex(12))
}

fn busy_error(id: &str, running: &str) -> RuntimeError {
    RuntimeError::SandboxBusy {
        id: id.to_owned(),
        running: running.to_owned(),
    }
}

/// Maps a failure on the server's own files; the message never names a host path (an
/// `io::Error` from the OS carries none).
fn io_error(what: &str, error: &std::io::Error) -> RuntimeError {
    if matches!(error.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) {
        return RuntimeError::no_space(what);
    }
    // A refusal of kiln's own (a disk the host cannot cover): its words name figures only.
    if error.kind() == std::io::ErrorKind::StorageFull && error.raw_os_error().is_none() {
        return RuntimeError::no_space(format!("{what}: {error}"));
    }
    tracing::error!("{what}: {error}");
    RuntimeError::internal(scrub_paths(&format!("{what}: {error}")))
}

/// Sessions and running work a removed sandbox leaves for the caller to stop.
#[derive(Debug, Default)]
pub struct Removed {
    /// Live sessions to close, each with its sandbox's template (whose backend holds it).
    pub handles: Vec<(String, SessionHandle)>,
    /// The ids of the sandboxes removed.
    pub ids: Vec<String>,
    /// Sandboxes whose fixed life ended with `onTimeout: "pause"`: kept, their boxes to
    /// pause.
    pub paused: Vec<Sandbox>,
}

impl Registry {
    /// Opens the registry under `root`, loading every sandbox recorded there. Folders left
    /// half-made by a crash (no `meta.json`) are removed. Sessions come back as lost: their
    /// variables lived in a worker process.
    pub fn open(root: PathBuf) -> std::io::Result<Registry> {
        let dir = root.join("sandboxes");
        std::fs::create_dir_all(&dir)?;
        let mut sandboxes = HashMap::new();
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            let meta_path = path.join("meta.json");
            if !meta_path.exists() {
                tracing::warn!(
                    "removing {}: a sandbox folder with no meta.json (a create or delete cut short)",
                    path.display()
                );
                let _ = crate::volume::detach(&path.join("volume"));
                let _ = kiln_workspace::remove_host_tree(&path);
                continue;
            }
            match store::read_json::<Sandbox>(&meta_path) {
                Ok(mut meta) => {
                    meta.dir = path;
                    if let Err(e) = meta.attach_volume() {
                        tracing::error!(
                            sandbox = %meta.id,
                            "could not mount the workspace's volume (its files are out of reach until it mounts): {e}"
                        );
                    }
                    recover(&meta);
                    sandboxes.insert(
                        meta.id.clone(),
                        Entry {
                            meta,
                            running: None,
                            deleted: false,
                            handles: HashMap::new(),
                            session_use: HashMap::new(),
                            turn_grant: 0,
                            writer: Arc::default(),
                        },
                    );
                }
                Err(e) => tracing::error!("skipping a sandbox whose meta.json cannot be read: {e}"),
            }
        }
        let volumes = crate::volumes::Volumes::open(&root);
        volumes.attach_all();
        let snapshots = crate::snapshots::Snapshots::open(&root);
        let workspaces = crate::workspaces::Workspaces::open(&root);
        Ok(Registry {
            root,
            sandboxes: Mutex::new(sandboxes),
            dirty: Mutex::default(),
            volumes,
            snapshots,
            workspaces,
            observer: Mutex::default(),
        })
    }

    /// Tells `events` of every sandbox this registry holds, then of each one made or gone,
    /// in order (a cluster node keeps the shared directory with it).
    pub fn observe(&self, events: tokio::sync::mpsc::UnboundedSender<DirectoryEvent>) {
        let sandboxes = self.lock();
        for entry in sandboxes.values().filter(|e| !e.deleted) {
            let _ = events.send(DirectoryEvent::Placed {
                id: entry.meta.id.clone(),
                tenant: entry.meta.tenant.clone(),
            });
        }
        // Set while the sandboxes are locked: no change falls between the two.
        *self.observer.lock().unwrap_or_else(|e| e.into_inner()) = Some(events);
    }

    /// Tells the observer, if any (called with the sandboxes locked, so events keep the
    /// order of the changes).
    fn tell(&self, event: DirectoryEvent) {
        if let Some(events) = &*self.observer.lock().unwrap_or_else(|e| e.into_inner()) {
            let _ = events.send(event);
        }
    }

    /// The live sandboxes that mount volume `id`.
    pub fn volume_users(&self, id: &str) -> Vec<String> {
        let now = now_ms();
        self.lock()
            .values()
            .filter(|e| {
                !e.deleted
                    && e.meta.live_at(now)
                    && e.meta.volume_mounts.iter().any(|m| m.volume == id)
            })
            .map(|e| e.meta.id.clone())
            .collect()
    }

    /// Unmounts every workspace volume (at shutdown: nothing of kiln's stays mounted while
    /// it is not running; the next start mounts them again).
    pub fn detach_volumes(&self) {
        for entry in self.lock().values().filter(|e| e.meta.volume) {
            if let Err(e) = crate::volume::detach(&entry.meta.volume_dir()) {
                tracing::warn!(sandbox = %entry.meta.id, "could not unmount the workspace's volume: {e}");
            }
        }
        self.volumes.detach_all();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.sandboxes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Creates a sandbox with an empty, versioned workspace; durable when it returns. Its
    /// history repository is made on first use ([`Sandbox::history`]): a sandbox that never
    /// records a change (most one-shot sandboxes) never pays for one.
    pub fn create(&self, tenant: &str, spec: &SandboxSpec, quotas: &Quotas) -> Result<Sandbox> {
        self.create_seeded(tenant, spec, quotas, |_| Ok(()))
    }

    /// [`Registry::create`], its folder `adopt` where given: a warm pool member's, renamed into
    /// the sandbox's place with its volume mounted and its workspace made (on the same file
    /// system). On failure that folder is removed with the rest.
    pub fn create_in(
        &self,
        tenant: &str,
        spec: &SandboxSpec,
        quotas: &Quotas,
        adopt: Option<PathBuf>,
    ) -> Result<Sandbox> {
        self.create_with(tenant, spec, quotas, adopt, None, |_| Ok(()))
    }

    /// Creates a sandbox whose workspace and history `seed` fills (it is given the new
    /// sandbox with its folder and empty workspace made; it may create the history at
    /// [`Sandbox::git_dir`], which is otherwise made on first use with the empty workspace
    /// as its initial commit); durable when it returns. A seed that fails leaves nothing.
    pub fn create_seeded(
        &self,
        tenant: &str,
        spec: &SandboxSpec,
        quotas: &Quotas,
        seed: impl FnOnce(&Sandbox) -> Result<()>,
    ) -> Result<Sandbox> {
        self.create_with(tenant, spec, quotas, None, None, seed)
    }

    /// Creates a sandbox of `spec` (a Linux one) from snapshot `snapshot`: its volume a
    /// copy of the snapshot's image (a reflink where the file system can), its history the
    /// snapshot's; answers it and how its disk was copied.
    pub fn create_from_snapshot(
        &self,
        tenant: &str,
        spec: &SandboxSpec,
        quotas: &Quotas,
        snapshot: &str,
    ) -> Result<(Sandbox, crate::snapshots::CopyKind)> {
        let image = self.snapshots.image(snapshot);
        let history = self.snapshots.history(snapshot);
        let copied = std::cell::Cell::new(crate::snapshots::CopyKind::Sparse);
        let made = self.create_with(
            tenant,
            spec,
            quotas,
            None,
            Some((&image, &copied)),
            |child| {
                crate::history::History::open(&history)?.clone_into(&child.git_dir())?;
                Ok(())
            },
        )?;
        Ok((made, copied.get()))
    }

    fn create_with(
        &self,
        tenant: &str,
        spec: &SandboxSpec,
        quotas: &Quotas,
        adopt: Option<PathBuf>,
        image: Option<(
            &std::path::Path,
            &std::cell::Cell<crate::snapshots::CopyKind>,
        )>,
        seed: impl FnOnce(&Sandbox) -> Result<()>,
    ) -> Result<Sandbox> {
        self.usage(tenant).check_sandbox(quotas)?;
        let id = new_id("sb_");
        let created_ms = now_ms();
        let meta = Sandbox {
            id: id.clone(),
            tenant: tenant.to_owned(),
            image: spec.image.clone(),
            template: Some(spec.template.clone()),
            language: spec.language,
            created_ms,
            expires_ms: created_ms
                .saturating_add(spec.lifetime_ms)
                .min(created_ms.saturating_add(spec.lifecycle.max_duration_ms.unwrap_or(u64::MAX))),
            memory_bytes: spec.memory_bytes,
            executions: 0,
            cpu_time_ms: 0,
            sessions: BTreeMap::new(),
            workspace_bytes: 0,
            network: spec.network,
            egress: spec.egress.clone(),
            egress_widen: spec.egress_widen,
            volume_mounts: spec.volume_mounts.clone(),
            resources: spec.resources,
            volume: spec.resources.is_some(),
            workspace_at: spec.workspace_at.clone(),
            metadata: spec.metadata.clone(),
            env: spec.env.clone(),
            access_token: spec.access_token.clone(),
            public_ports: spec.public_ports,
            key_id: spec.key_id.clone(),
            lifecycle: spec.lifecycle.clone(),
            timed_out: false,
            life_ms: spec.lifetime_ms,
            dir: self.root.join("sandboxes").join(&id),
        };
        let made = (|| {
            match &adopt {
                Some(from) => {
                    if let Some(parent) = meta.dir.parent() {
                        std::fs::create_dir_all(parent)
                            .map_err(|e| io_error("could not create the sandbox", &e))?;
                    }
                    std::fs::rename(from, &meta.dir)
                        .map_err(|e| io_error("could not adopt the warm pool's box folder", &e))?;
                }
                None => std::fs::create_dir_all(&meta.dir)
                    .map_err(|e| io_error("could not create the sandbox", &e))?,
            }
            if let Some((image, copied)) = image {
                // The disk must fit as a new one would (a copy may cost its whole size).
                let bytes = spec.resources.map_or(0, |r| r.disk_mb << 20);
                crate::volume::check_room(
                    &meta.volume_dir(),
                    bytes,
                    crate::volume::overcommit_ratio(),
                )
                .map_err(|e| io_error("could not make the sandbox's disk", &e))?;
                copied.set(
                    crate::snapshots::copy_image(
                        image,
                        &crate::volume::image_of(&meta.volume_dir()),
                    )
                    .map_err(|e| io_error("could not copy the snapshot's disk", &e))?,
                );
            }
            meta.attach_volume()
                .map_err(|e| io_error("could not make the workspace's volume", &e))?;
            std::fs::create_dir_all(meta.workspace())
                .map_err(|e| io_error("could not create the sandbox", &e))?;
            if let Some((uid, gid)) = spec.workspace_owner {
                std::os::unix::fs::lchown(meta.workspace(), Some(uid), Some(gid))
                    .map_err(|e| io_error("could not give the workspace to its box's user", &e))?;
            }
            seed(&meta)?;
            store::write_json(&meta.meta_path(), &meta)
                .map_err(|e| io_error("could not create the sandbox", &e))
        })();
        if let Err(e) = made {
            remove_sandbox_dir(&meta);
            return Err(e);
        }
        let mut sandboxes = self.lock();
        // Counted where it is added, so concurrent creates cannot pass the quota together.
        if let Err(e) = self.usage_of(&sandboxes, tenant).check_sandbox(quotas) {
            drop(sandboxes);
            let _ = std::fs::remove_file(meta.meta_path());
            remove_sandbox_dir(&meta);
            return Err(e);
        }
        sandboxes.insert(
            id,
            Entry {
                meta: meta.clone(),
                running: None,
                deleted: false,
                handles: HashMap::new(),
                session_use: HashMap::new(),
                turn_grant: 0,
                writer: Arc::default(),
            },
        );
        self.tell(DirectoryEvent::Placed {
            id: meta.id.clone(),
            tenant: meta.tenant.clone(),
        });
        Ok(meta)
    }

    fn find<'a>(
        sandboxes: &'a mut HashMap<String, Entry>,
        tenant: &str,
        id: &str,
    ) -> Result<&'a mut Entry> {
        let now = now_ms();
        match sandboxes.get_mut(id) {
            Some(entry)
                if entry.meta.tenant == tenant && entry.meta.live_at(now) && !entry.deleted =>
            {
                Ok(entry)
            }
            _ => Err(RuntimeError::SandboxNotFound { id: id.to_owned() }),
        }
    }

    fn view(entry: &Entry) -> SandboxView {
        SandboxView {
            meta: entry.meta.clone(),
            running: entry.running.as_ref().map(|r| r.id.clone()),
            live_sessions: entry.handles.keys().cloned().collect(),
        }
    }

    /// A live sandbox of `tenant` (another tenant's is "not found").
    /// A request to it: a sandbox with no fixed life lives a full window from now.
    pub fn get(&self, tenant: &str, id: &str) -> Result<SandboxView> {
        let mut sandboxes = self.lock();
        let entry = Registry::find(&mut sandboxes, tenant, id)?;
        let moved = entry.meta.slide(now_ms());
        let view = Registry::view(entry);
        drop(sandboxes);
        if moved {
            self.mark_dirty(id);
        }
        Ok(view)
    }

    /// A live sandbox by id alone, whoever's it is (for a request that proves itself with
    /// the sandbox's own access token, checked by the caller).
    /// A sandbox its timeout paused (`onTimeout: "pause"`) resumed: it gets a life as long
    /// as its last one again (E2B's auto-resume), and may time out again. Nothing for any
    /// other.
    pub fn revive(&self, id: &str) {
        let revived = {
            let mut sandboxes = self.lock();
            match sandboxes
                .get_mut(id)
                .filter(|e| !e.deleted && e.meta.timed_out)
            {
                Some(entry) => {
                    let life = if entry.meta.life_ms == 0 {
                        DEFAULT_LIFETIME_MS
                    } else {
                        entry.meta.life_ms
                    };
                    entry.meta.timed_out = false;
                    entry.meta.expires_ms =
                        now_ms().saturating_add(life).min(entry.meta.hard_end_ms());
                    true
                }
                None => false,
            }
        };
        if revived && let Err(e) = self.persist(id) {
            tracing::warn!("could not save sandbox {id}: {e}");
        }
    }

    /// Use of sandbox `id` that is no request (a keystroke in its terminal): a sandbox with
    /// no fixed life lives a full window from now.
    pub fn touch(&self, id: &str) {
        let now = now_ms();
        let moved = self
            .lock()
            .get_mut(id)
            .filter(|e| e.meta.live_at(now) && !e.deleted)
            .is_some_and(|e| e.meta.slide(now));
        if moved {
            self.mark_dirty(id);
        }
    }

    /// Like [`Registry::get`], a request to it.
    pub fn lookup(&self, id: &str) -> Option<SandboxView> {
        let now = now_ms();
        let mut sandboxes = self.lock();
        let entry = sandboxes
            .get_mut(id)
            .filter(|e| e.meta.live_at(now) && !e.deleted)?;
        let moved = entry.meta.slide(now);
        let view = Registry::view(entry);
        drop(sandboxes);
        if moved {
            self.mark_dirty(id);
        }
        Some(view)
    }

    /// The first live sandbox (of any tenant) `wanted` picks.
    pub fn find_live(&self, wanted: impl Fn(&Sandbox) -> bool) -> Option<SandboxView> {
        let now = now_ms();
        let sandboxes = self.lock();
        sandboxes
            .values()
            .filter(|e| e.meta.live_at(now) && !e.deleted)
            .find(|e| wanted(&e.meta))
            .map(Registry::view)
    }

    /// A tenant's sandboxes, oldest first, `limit` after the one with id `after`.
    pub fn list(
        &self,
        tenant: &str,
        after: Option<&str>,
        limit: usize,
    ) -> (Vec<SandboxView>, Option<String>) {
        let now = now_ms();
        let sandboxes = self.lock();
        let mut mine: Vec<&Entry> = sandboxes
            .values()
            .filter(|e| e.meta.tenant == tenant && e.meta.live_at(now) && !e.deleted)
            .collect();
        mine.sort_by(|a, b| (a.meta.created_ms, &a.meta.id).cmp(&(b.meta.created_ms, &b.meta.id)));
        // Another tenant's sandbox id is a cursor like any unknown one.
        let start = match after
            .and_then(|a| sandboxes.get(a))
            .filter(|cursor| cursor.meta.tenant == tenant)
        {
            Some(cursor) => mine
                .iter()
                .position(|e| {
                    (e.meta.created_ms, &e.meta.id) > (cursor.meta.created_ms, &cursor.meta.id)
                })
                .unwrap_or(mine.len()),
            None => 0,
        };
        let page: Vec<SandboxView> = mine[start..]
            .iter()
            .take(limit)
            .map(|e| Registry::view(e))
            .collect();
        let next = (start + page.len() < mine.len())
            .then(|| page.last().map(|v| v.meta.id.clone()))
            .flatten();
        (page, next)
    }

    /// The tenants that hold sandboxes now (for an admin's view of every tenant).
    pub fn tenants(&self) -> std::collections::BTreeSet<String> {
        self.lock()
            .values()
            .filter(|e| !e.deleted)
            .map(|e| e.meta.tenant.clone())
            .collect()
    }

    /// What `tenant` holds now.
    pub fn usage(&self, tenant: &str) -> Usage {
        self.usage_of(&self.lock(), tenant)
    }

    /// `tenant`'s usage, the bytes its named volumes' files use counted as workspace bytes.
    fn usage_of(&self, sandboxes: &HashMap<String, Entry>, tenant: &str) -> Usage {
        let now = now_ms();
        let mut usage = Usage {
            workspace_bytes: self
                .volumes
                .used_bytes(tenant)
                .saturating_add(self.snapshots.disk_bytes(tenant)),
            ..Usage::default()
        };
        for entry in sandboxes.values() {
            if entry.meta.tenant != tenant || entry.deleted {
                continue;
            }
            if entry.meta.live_at(now) {
                usage.sandboxes += 1;
            }
            usage.sessions += entry.handles.len() as u64;
            usage.session_memory_bytes += entry
                .handles
                .keys()
                .map(|s| {
                    entry
                        .session_use
                        .get(s)
                        .copied()
                        .unwrap_or(entry.meta.memory_bytes)
                })
                .sum::<u64>()
                + entry.turn_grant;
            usage.executions += u64::from(entry.running.is_some());
            usage.workspace_bytes += entry.meta.workspace_bytes;
        }
        usage
    }

    /// Marks a sandbox busy with work `work_id` (an execution, an upload); a second one is
    /// refused with 409 until it ends. The receiver fires if the work is cancelled. With
    /// `quotas`, the tenant's workspace bytes are checked first (429). Also answers the tenant's usage as it was.
    pub fn begin(
        &self,
        tenant: &str,
        id: &str,
        work_id: &str,
        quotas: Option<&Quotas>,
    ) -> Result<(Sandbox, oneshot::Receiver<()>, Usage)> {
        let mut sandboxes = self.lock();
        let usage = match quotas {
            Some(quotas) => {
                let usage = self.usage_of(&sandboxes, tenant);
                // A busy sandbox answers 409 below whatever the quota says.
                if Registry::find(&mut sandboxes, tenant, id)?
                    .running
                    .is_none()
                {
                    usage.check_workspace(quotas)?;
                }
                usage
            }
            None => Usage::default(),
        };
        let entry = Registry::find(&mut sandboxes, tenant, id)?;
        if let Some(running) = &entry.running {
            return Err(busy_error(id, &running.id));
        }
        let (tx, rx) = oneshot::channel();
        entry.running = Some(Running {
            id: work_id.to_owned(),
            cancel: Some(tx),
            files_written: false,
        });
        Ok((entry.meta.clone(), rx, usage))
    }

    /// Notes, before a file is written beside the work sandbox `id` is busy with (an upload
    /// while an execution runs), that the work's record must look at the workspace. Fails
    /// when the sandbox is gone.
    pub fn note_files_written(&self, tenant: &str, id: &str) -> Result<()> {
        let mut sandboxes = self.lock();
        let entry = Registry::find(&mut sandboxes, tenant, id)?;
        if let Some(running) = &mut entry.running {
            running.files_written = true;
        }
        Ok(())
    }

    /// Whether a file was written beside the work sandbox `id` is busy with
    /// ([`Registry::note_files_written`]).
    pub fn files_written_beside(&self, id: &str) -> bool {
        self.lock()
            .get(id)
            .and_then(|e| e.running.as_ref())
            .is_some_and(|r| r.files_written)
    }

    /// Ends work started with [`Registry::begin`], counting an execution of `duration_ms`
    /// when `executed`. Fails with 409 `SANDBOX_DELETED` when the sandbox was deleted
    /// meanwhile (its folder goes now).
    pub fn finish(&self, id: &str, executed: Option<u64>) -> Result<()> {
        let mut sandboxes = self.lock();
        let Some(entry) = sandboxes.get_mut(id) else {
            return Ok(());
        };
        entry.running = None;
        if entry.deleted {
            let entry = sandboxes.remove(id).expect("present");
            drop(sandboxes);
            remove_sandbox_dir(&entry.meta);
            return Err(RuntimeError::SandboxDeleted { id: id.to_owned() });
        }
        if let Some(duration_ms) = executed {
            // Usage counters are statistics, not user data: they are written by
            // `flush_usage` (every second and at shutdown), not before each reply.
            entry.meta.executions += 1;
            entry.meta.cpu_time_ms += duration_ms;
            drop(sandboxes);
            self.dirty
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(id.to_owned());
        }
        Ok(())
    }

    /// Has sandbox `id`'s record written with the usage counters.
    fn mark_dirty(&self, id: &str) {
        self.dirty
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.to_owned());
    }

    /// Writes the usage counters that changed since the last call.
    pub fn flush_usage(&self) {
        let ids: Vec<String> = self
            .dirty
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain()
            .collect();
        for id in ids {
            if let Err(e) = self.persist(&id) {
                tracing::warn!("could not save the usage of {id}: {e}");
            }
        }
    }

    /// Cancels the running work `work_id` (any, when `None`); false when nothing matched.
    pub fn cancel(&self, tenant: &str, id: &str, work_id: Option<&str>) -> Result<bool> {
        let mut sandboxes = self.lock();
        let entry = Registry::find(&mut sandboxes, tenant, id)?;
        match &mut entry.running {
            Some(running) if work_id.is_none_or(|w| w == running.id) => {
                Ok(running.cancel.take().is_some_and(|tx| tx.send(()).is_ok()))
            }
            _ => Ok(false),
        }
    }

    /// Writes sandbox `id`'s record as it is now. Writers of one sandbox take turns, and
    /// each writes the state current when its turn comes, so the newest state is the one
    /// left on disk. A deleted sandbox is not written.
    fn persist(&self, id: &str) -> Result<()> {
        let writer = match self.lock().get(id) {
            Some(entry) if !entry.deleted => entry.writer.clone(),
            _ => return Ok(()),
        };
        let _turn = writer.lock().unwrap_or_else(|e| e.into_inner());
        let meta = match self.lock().get(id) {
            Some(entry) if !entry.deleted => entry.meta.clone(),
            _ => return Ok(()),
        };
        store::write_json(&meta.meta_path(), &meta)
            .map_err(|e| io_error("could not save the sandbox", &e))
    }

    /// Replaces a sandbox's egress rules (`None`: the operator's list alone), set by a key
    /// that may (`widen`) or may not widen the operator's list; answers the sandbox.
    pub fn set_egress(
        &self,
        tenant: &str,
        id: &str,
        egress: Option<kiln_core::net::Egress>,
        widen: bool,
    ) -> Result<Sandbox> {
        let mut sandboxes = self.lock();
        let entry = Registry::find(&mut sandboxes, tenant, id)?;
        entry.meta.egress = egress.filter(|e| !e.is_empty());
        entry.meta.egress_widen = widen;
        let meta = entry.meta.clone();
        drop(sandboxes);
        self.persist(id)?;
        Ok(meta)
    }

    /// Extends a sandbox's life to `lifetime_ms` from now.
    pub fn renew(&self, tenant: &str, id: &str, lifetime_ms: u64) -> Result<Sandbox> {
        let mut sandboxes = self.lock();
        let entry = Registry::find(&mut sandboxes, tenant, id)?;
        entry.meta.expires_ms = now_ms()
            .saturating_add(lifetime_ms)
            .min(entry.meta.hard_end_ms());
        entry.meta.timed_out = false;
        entry.meta.life_ms = lifetime_ms;
        let meta = entry.meta.clone();
        drop(sandboxes);
        self.persist(id)?;
        Ok(meta)
    }

    /// Records a new session and the worker holding it, counted as holding `holds` bytes
    /// until a turn measures it (`None`: the sandbox's memory cap), within the tenant's
    /// `quotas` (checked here, where it is counted).
    pub fn add_session(
        &self,
        id: &str,
        session: SessionMeta,
        handle: SessionHandle,
        holds: Option<u64>,
        quotas: &Quotas,
    ) -> Result<()> {
        let mut sandboxes = self.lock();
        let Some((tenant, holds)) = sandboxes
            .get(id)
            .filter(|e| !e.deleted)
            .map(|e| (e.meta.tenant.clone(), holds.unwrap_or(e.meta.memory_bytes)))
        else {
            return Err(RuntimeError::SandboxNotFound { id: id.to_owned() });
        };
        self.usage_of(&sandboxes, &tenant)
            .check_session(quotas, holds)?;
        let Some(entry) = sandboxes.get_mut(id).filter(|e| !e.deleted) else {
            return Err(RuntimeError::SandboxNotFound { id: id.to_owned() });
        };
        entry.session_use.insert(session.id.clone(), holds);
        entry.handles.insert(session.id.clone(), handle);
        entry.meta.sessions.insert(session.id.clone(), session);
        drop(sandboxes);
        self.persist(id)
    }

    /// The worker handle of a session: `Ok(None)` when it is recorded but its state was lost
    /// (a restart, a dead worker, a cancelled turn).
    pub fn session(
        &self,
        tenant: &str,
        id: &str,
        session: &str,
    ) -> Result<(SessionMeta, Option<SessionHandle>)> {
        let mut sandboxes = self.lock();
        let entry = Registry::find(&mut sandboxes, tenant, id)?;
        let Some(meta) = entry.meta.sessions.get(session) else {
            return Err(RuntimeError::SessionNotFound {
                id: id.to_owned(),
                session: session.to_owned(),
            });
        };
        Ok((meta.clone(), entry.handles.get(session).copied()))
    }

    /// Reserves for a session turn in sandbox `id` of `tenant` the room left under the
    /// tenant's session memory quota: how many bytes the turn may grow its session by.
    /// Counted as in use until [`Registry::end_turn`].
    pub fn grant_turn(&self, tenant: &str, id: &str, quotas: &Quotas) -> u64 {
        let mut sandboxes = self.lock();
        let in_use = self.usage_of(&sandboxes, tenant).session_memory_bytes;
        let room = quotas.session_memory_bytes.saturating_sub(in_use);
        if let Some(entry) = sandboxes.get_mut(id) {
            entry.turn_grant = room;
        }
        room
    }

    /// Ends a session turn's reservation; `holds` is what the session holds now, where
    /// its worker measured it.
    pub fn end_turn(&self, id: &str, session: &str, holds: Option<u64>) {
        if let Some(entry) = self.lock().get_mut(id) {
            entry.turn_grant = 0;
            if let Some(bytes) = holds
                && entry.handles.contains_key(session)
            {
                entry.session_use.insert(session.to_owned(), bytes);
            }
        }
    }

    /// Forgets a session's live state (it ended); its record stays until it is closed.
    pub fn drop_session_state(&self, id: &str, session: &str) -> Option<SessionHandle> {
        self.lock()
            .get_mut(id)
            .and_then(|e| e.handles.remove(session))
    }

    /// Notes how many bytes a sandbox's workspace holds (written with the usage counters).
    pub fn set_workspace_bytes(&self, id: &str, bytes: u64) {
        if let Some(entry) = self.lock().get_mut(id)
            && entry.meta.workspace_bytes != bytes
        {
            entry.meta.workspace_bytes = bytes;
            self.dirty
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(id.to_owned());
        }
    }

    /// Counts a session turn.
    pub fn count_turn(&self, id: &str, session: &str) {
        if let Some(entry) = self.lock().get_mut(id)
            && let Some(s) = entry.meta.sessions.get_mut(session)
        {
            s.turns += 1;
        }
    }

    /// Removes a session's record; returns its live handle to close.
    pub fn remove_session(
        &self,
        tenant: &str,
        id: &str,
        session: &str,
    ) -> Result<Option<SessionHandle>> {
        let mut sandboxes = self.lock();
        let entry = Registry::find(&mut sandboxes, tenant, id)?;
        if entry.meta.sessions.remove(session).is_none() {
            return Err(RuntimeError::SessionNotFound {
                id: id.to_owned(),
                session: session.to_owned(),
            });
        }
        let handle = entry.handles.remove(session);
        drop(sandboxes);
        self.persist(id)?;
        Ok(handle)
    }

    /// Deletes a sandbox: gone for every request from now on (durably). Running work is
    /// cancelled; its folder goes when that work ends.
    pub fn delete(&self, tenant: &str, id: &str) -> Result<Removed> {
        // A record being written now must not bring meta.json back after it is removed: wait
        // for its writer (writer first, then the registry, as `persist` does).
        let writer = Registry::find(&mut self.lock(), tenant, id)?.writer.clone();
        let _turn = writer.lock().unwrap_or_else(|e| e.into_inner());
        let mut sandboxes = self.lock();
        let entry = Registry::find(&mut sandboxes, tenant, id)?;
        // Removing meta.json first makes the deletion durable; a crash before the folder is
        // gone leaves a folder with no meta.json, which the next start removes.
        std::fs::remove_file(entry.meta.meta_path())
            .map_err(|e| io_error("could not delete the sandbox", &e))?;
        let _ = store::sync_dir(&entry.meta.dir);
        self.tell(DirectoryEvent::Removed { id: id.to_owned() });
        let removed = Removed {
            ids: vec![id.to_owned()],
            handles: entry
                .handles
                .drain()
                .map(|(_, h)| (entry.meta.template().to_owned(), h))
                .collect(),
            paused: Vec::new(),
        };
        if let Some(running) = &mut entry.running {
            entry.deleted = true;
            if let Some(cancel) = running.cancel.take() {
                let _ = cancel.send(());
            }
        } else {
            let entry = sandboxes.remove(id).expect("present");
            drop(sandboxes);
            remove_sandbox_dir(&entry.meta);
        }
        Ok(removed)
    }

    /// Removes every sandbox whose lifetime is over and that runs nothing; one whose
    /// lifecycle says `onTimeout: "pause"` is kept instead (the first time its life ends),
    /// for its box to be paused.
    pub fn reap_expired(&self) -> Removed {
        let now = now_ms();
        let mut removed = Removed::default();
        let expired: Vec<Entry> = {
            let mut sandboxes = self.lock();
            for entry in sandboxes.values_mut().filter(|e| {
                e.meta.expires_ms <= now
                    && e.running.is_none()
                    && !e.deleted
                    && !e.meta.timed_out
                    && e.meta.lifecycle.pauses_on_timeout()
                    && e.meta.hard_end_ms() > now
            }) {
                entry.meta.timed_out = true;
                entry.meta.expires_ms = now
                    .saturating_add(crate::lifecycle::PAUSED_KEEP_MS)
                    .min(entry.meta.hard_end_ms());
                removed.paused.push(entry.meta.clone());
            }
            let ids: Vec<String> = sandboxes
                .values()
                .filter(|e| !e.meta.live_at(now) && e.running.is_none())
                .map(|e| e.meta.id.clone())
                .collect();
            for id in &ids {
                self.tell(DirectoryEvent::Removed { id: id.clone() });
            }
            ids.iter().filter_map(|id| sandboxes.remove(id)).collect()
        };
        for kept in &removed.paused {
            if let Err(e) = self.persist(&kept.id) {
                tracing::warn!("could not save sandbox {}: {e}", kept.id);
            }
        }
        for mut entry in expired {
            removed.ids.push(entry.meta.id.clone());
            let _ = std::fs::remove_file(entry.meta.meta_path());
            remove_sandbox_dir(&entry.meta);
            let template = entry.meta.template().to_owned();
            removed
                .handles
                .extend(entry.handles.drain().map(|(_, h)| (template.clone(), h)));
        }
        removed
    }

    /// The live sandboxes whose workspaces are among `workspaces`, by workspace.
    pub fn by_workspace(
        &self,
        workspaces: &std::collections::HashSet<PathBuf>,
    ) -> HashMap<PathBuf, Sandbox> {
        let now = now_ms();
        self.lock()
            .values()
            .filter(|e| !e.deleted && e.meta.live_at(now))
            .map(|e| (e.meta.workspace(), &e.meta))
            .filter(|(workspace, _)| workspaces.contains(workspace))
            .map(|(workspace, meta)| (workspace, meta.clone()))
            .collect()
    }

    /// Live sandboxes (all tenants).
    pub fn count(&self) -> usize {
        self.lock().values().filter(|e| !e.deleted).count()
    }

    /// Whether the data folder accepts writes.
    pub fn writable(&self) -> bool {
        let probe = self.root.join(".ready-probe");
        let ok = std::fs::write(&probe, b"ok").is_ok();
        let _ = std::fs::remove_file(&probe);
        ok
    }
}

/// Checks a workspace-relative file name: relative, no `..`, no empty or `.` parts, no NUL,
/// at most 255 bytes a part and 4 096 in all.
pub fn workspace_path(name: &str) -> Result<RelPath> {
    Ok(RelPath::parse(name)?)
}

/// Removes a sandbox's folder (its workspace is removed without following any link in it;
/// its volume is unmounted first).
fn remove_sandbox_dir(meta: &Sandbox) {
    crate::history::forget(&meta.git_dir());
    if let Err(e) = crate::volume::detach(&meta.volume_dir()) {
        tracing::warn!(sandbox = %meta.id, "could not unmount the workspace's volume: {e}");
    }
    if let Err(e) = kiln_workspace::remove_host_tree(&meta.dir) {
        tracing::warn!(sandbox = %meta.id, "could not remove the sandbox's folder: {e}");
    }
}

/// Makes a sandbox left by a crash usable: stale git lock files go, and so do write
/// temporaries (they live in the scratch folder, never in the workspace).
fn recover(meta: &Sandbox) {
    crate::history::remove_pending(&meta.dir);
    match crate::history::recover(&meta.git_dir()) {
        Ok(removed) if !removed.is_empty() => tracing::warn!(
            sandbox = %meta.id,
            "removed {} stale lock file(s) from the workspace history (a crash cut a commit short)",
            removed.len()
        ),
        Ok(_) => {}
        Err(e) => tracing::error!(sandbox = %meta.id, "could not clean the workspace history: {e}"),
    }
    // Temporaries of the record's own atomic writes (`.meta.json.<random>.tmp`).
    if let Ok(entries) = std::fs::read_dir(&meta.dir) {
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with(".meta.json.") && name.ends_with(".tmp") {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
    let scratch = meta.scratch_dir();
    if let Err(e) = kiln_workspace::remove_host_tree(&scratch)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::error!(sandbox = %meta.id, "could not sweep write temporaries: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workspace_paths_refuse_escapes() {
        assert_eq!(
            workspace_path("data/in.txt").unwrap().as_str(),
            "data/in.txt"
        );
        for bad in [
            "../x",
            "/etc/passwd",
            "a/../../x",
            "",
            "a\0b",
            "./a",
            "a/./b",
            "a//b",
            "a/",
        ] {
            let err = workspace_path(bad).unwrap_err();
            assert_eq!(err.code(), "INVALID_PATH", "{bad:?}");
        }
    }

    #[test]
    fn host_paths_are_scrubbed() {
        assert_eq!(
            scrub_paths(
                "failed to create locked file '/data/sandboxes/sb_1/history.git/index.lock': File exists"
            ),
            "failed to create locked file '…': File exists"
        );
        assert_eq!(
            scrub_paths("could not open /tmp/x: denied"),
            "could not open …: denied"
        );
        assert_eq!(
            scrub_paths("a/b stays, so does 1/2"),
            "a/b stays, so does 1/2"
        );
    }

    #[test]
    fn timestamps_are_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_795_000_000_123), "2026-11-18T11:06:40.123Z");
    }
}
