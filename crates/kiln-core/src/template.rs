//! Templates: what a sandbox is made of, and the catalogue that maps image names onto them.
//!
//! A sandbox is created from a *template* (`python`, `javascript` today; `debian-python`,
//! `node`, `go` … next). Each template declares which backend runs it, its lifecycle, the
//! languages its code cells speak, what it can do, and which Docker-style image names it
//! honours. Clients that speak in images (`python:3.12-slim`, `node:18-alpine`) are resolved
//! through the [`Catalogue`]; a name no installed template can honour is refused with the list
//! of what is available, never silently run on something else.
//!
//! ```
//! use kiln_core::template::{Catalogue, TemplateInfo};
//!
//! let catalogue = Catalogue::new(vec![TemplateInfo::example_python()]);
//! assert_eq!(catalogue.resolve("python:3.12-slim").unwrap().id, "python");
//! assert!(catalogue.resolve("python:2.7").is_err());
//! ```

use serde::{Deserialize, Serialize};

use crate::Language;

/// Which implementation runs a template's sandboxes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// WebAssembly guests on wasmtime, in kiln's worker processes.
    Wasm,
    /// Native Linux processes in a jailed root filesystem.
    Native,
    /// A microVM per sandbox.
    Vm,
    /// The in-process test double.
    Fake,
}

impl BackendKind {
    /// Its name, as in the API (`wasm`, `native`, `vm`, `fake`).
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Wasm => "wasm",
            BackendKind::Native => "native",
            BackendKind::Vm => "vm",
            BackendKind::Fake => "fake",
        }
    }
}

/// How a template's sandbox lives between executions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Lifecycle {
    /// Nothing runs between executions: the sandbox is a folder, each execution a fresh
    /// instance over it (wasm). Idle sandboxes cost only disk.
    Ephemeral,
    /// A box that keeps running between executions (processes, open ports).
    Live,
}

impl Lifecycle {
    /// Its name, as in the API (`ephemeral`, `live`).
    pub fn as_str(self) -> &'static str {
        match self {
            Lifecycle::Ephemeral => "ephemeral",
            Lifecycle::Live => "live",
        }
    }
}

/// What a template's sandboxes can do besides running code: what faces ask before they
/// offer something (never the backend's kind).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Capabilities {
    /// Stateful code sessions (a REPL whose variables survive between turns).
    pub sessions: bool,
    /// The languages its sessions run (empty without sessions).
    #[serde(default)]
    #[cfg_attr(feature = "schema", schema(value_type = Vec<String>, example = json!(["python"])))]
    pub session_languages: Vec<crate::Language>,
    /// A network to grant (the operator's allowlist, through kiln's proxy); without it a
    /// sandbox has none to ask for, and asking is not an error.
    #[serde(default)]
    pub network: bool,
    /// Pause, resume and hibernation of a live sandbox.
    #[serde(default)]
    pub pause: bool,
    /// Fuel (counted instructions) bounds its CPU, besides time.
    #[serde(default)]
    pub fuel: bool,
    /// Commands given as an argv (`["python3", "main.py"]`), not only code in a language.
    pub commands: bool,
    /// Background processes that outlive one execution.
    pub processes: bool,
    /// Interactive terminals (a PTY with a size).
    pub terminals: bool,
    /// Ports the sandbox listens on, reachable through kiln.
    pub ports: bool,
    /// Forking a running sandbox's state.
    pub fork: bool,
}

/// The image names a template honours.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ImageRule {
    /// Exact names, matched case-insensitively (`python`, `@ai-sandbox/python`).
    pub names: Vec<String>,
    /// Docker-style repositories, matched on the last path segment before the tag, so
    /// `library/python:3.12` and `docker.io/library/python:3.12` are `python:3.12`.
    pub repos: Vec<String>,
    /// The versions honoured, inclusive; a tag outside them is refused. `None`: any tag.
    /// A tag that names no version (`latest`, `slim`, `alpine`) is always honoured.
    pub versions: Option<VersionRange>,
}

/// An inclusive range of `major.minor` versions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionRange {
    pub min: (u32, u32),
    pub max: (u32, u32),
}

impl VersionRange {
    fn contains(&self, version: &TagVersion) -> bool {
        match version.minor {
            Some(minor) => (self.min..=self.max).contains(&(version.major, minor)),
            None => (self.min.0..=self.max.0).contains(&version.major),
        }
    }
}

impl std::fmt::Display for VersionRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}.{}–{}.{}",
            self.min.0, self.min.1, self.max.0, self.max.1
        )
    }
}

/// Seed 002's resource limits of a live box: a template's defaults, which a sandbox may
/// change at create.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Resources {
    /// CPUs' worth of time per period (a quota; `0.5` is half a CPU).
    #[serde(default = "one")]
    pub vcpus: f64,
    /// Memory and swap, together.
    #[serde(default = "default_memory_mb")]
    pub memory_mb: u64,
    /// The workspace's volume, and separately the box's writable layer.
    #[serde(default = "default_disk_mb")]
    pub disk_mb: u64,
    /// Processes and threads.
    #[serde(default = "default_pids")]
    pub pids: u64,
}

fn one() -> f64 {
    1.0
}
fn default_memory_mb() -> u64 {
    512
}
fn default_disk_mb() -> u64 {
    1024
}
fn default_pids() -> u64 {
    256
}

impl Default for Resources {
    fn default() -> Resources {
        Resources {
            vcpus: one(),
            memory_mb: default_memory_mb(),
            disk_mb: default_disk_mb(),
            pids: default_pids(),
        }
    }
}

/// The resources a create request asks for (seed 002's `vcpus`, `memory_mb`, `disk_mb`,
/// `pids`); what it leaves out is the template's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ResourceRequest {
    /// CPUs' worth of time (0.05 up to the host's CPUs; Linux templates).
    pub vcpus: Option<f64>,
    /// Memory cap in MiB (the same cap as `memoryLimit`; give one or the other).
    pub memory_mb: Option<u64>,
    /// Size of the workspace's volume and of the box's writable layer, in MiB (16..=65536;
    /// Linux templates).
    pub disk_mb: Option<u64>,
    /// Processes and threads (16..=32768; Linux templates).
    pub pids: Option<u64>,
}

/// One template, as a backend declares it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TemplateInfo {
    /// The template's name, as clients pass it (`python`).
    pub id: String,
    /// One line for people: what the sandbox runs.
    pub description: String,
    pub backend: BackendKind,
    pub lifecycle: Lifecycle,
    /// The languages code cells may use; the first is the default.
    pub languages: Vec<Language>,
    pub capabilities: Capabilities,
    /// The image names it honours.
    pub images: ImageRule,
    /// A live box's default resources (Linux templates); `None` for guests that have no
    /// box (WebAssembly).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<Resources>,
    /// The host uid and gid its sandboxes' workspaces belong to (a Linux box's user, so the
    /// files the host writes there are the box's to change); `None`: kiln's own.
    #[serde(skip)]
    pub workspace_owner: Option<(u32, u32)>,
}

impl TemplateInfo {
    /// The language code runs in when a request names none.
    pub fn default_language(&self) -> Language {
        self.languages.first().copied().unwrap_or(Language::Python)
    }

    /// Whether this template's repositories honour `image` (trimmed and lower-cased).
    fn honours(&self, image: &str) -> Honour {
        let (repo, tag) = split_image(image);
        if !self.images.repos.iter().any(|r| r == repo) {
            return Honour::NotMine;
        }
        match (tag.and_then(TagVersion::parse), &self.images.versions) {
            (Some(version), Some(range)) if !range.contains(&version) => Honour::WrongVersion,
            _ => Honour::Yes,
        }
    }

    /// The Python template of the wasm backend, as a doc example.
    pub fn example_python() -> TemplateInfo {
        TemplateInfo {
            id: "python".into(),
            description: "CPython 3.15 on WebAssembly".into(),
            backend: BackendKind::Wasm,
            lifecycle: Lifecycle::Ephemeral,
            languages: vec![Language::Python],
            capabilities: Capabilities {
                sessions: true,
                ..Capabilities::default()
            },
            images: ImageRule {
                names: vec!["python3".into()],
                repos: vec!["python".into(), "python3".into()],
                versions: Some(VersionRange {
                    min: (3, 0),
                    max: (3, 15),
                }),
            },
            resources: None,
            workspace_owner: None,
        }
    }
}

enum Honour {
    Yes,
    NotMine,
    WrongVersion,
}

/// `registry/ns/repo:tag` → (`repo`, `Some("tag")`). A digest (`@sha256:…`) is dropped.
fn split_image(image: &str) -> (&str, Option<&str>) {
    let image = image.split('@').next().unwrap_or_default();
    let last = image.rsplit('/').next().unwrap_or_default();
    match last.split_once(':') {
        Some((repo, tag)) => (repo, Some(tag)),
        None => (last, None),
    }
}

/// The version a tag names: `3.12.1-slim` → 3.12, `18-alpine` → 18, `latest` → none.
struct TagVersion {
    major: u32,
    minor: Option<u32>,
}

impl TagVersion {
    fn parse(tag: &str) -> Option<TagVersion> {
        let end = tag
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(tag.len());
        let mut parts = tag[..end].split('.');
        let major = parts.next()?.parse().ok()?;
        let minor = parts.next().and_then(|m| m.parse().ok());
        Some(TagVersion { major, minor })
    }
}

/// The longest image name looked up (Docker's own limit for a reference is about this).
pub const MAX_IMAGE_NAME: usize = 256;

/// An image name no installed template honours.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}; available: {}", available.join(", "))]
pub struct UnknownImage {
    pub image: String,
    /// Why, in one sentence.
    pub reason: String,
    /// What the catalogue offers, as accepted image names (`python`, `python:3.0–3.15`, …).
    pub available: Vec<String>,
}

/// The templates a kiln installation offers, in order of preference: when two honour an
/// image, the first wins.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Catalogue {
    templates: Vec<TemplateInfo>,
    /// Templates this installation knows of but cannot run now, by id prefix (`linux-`),
    /// each with why: what a request for one is told.
    unavailable: Vec<(String, String)>,
}

impl Catalogue {
    pub fn new(templates: Vec<TemplateInfo>) -> Catalogue {
        Catalogue {
            templates,
            unavailable: Vec::new(),
        }
    }

    /// With the templates whose id starts with `prefix` said to be unavailable, and why
    /// (a tier this server does not run: its reason is what a create for one is told).
    pub fn with_unavailable(mut self, prefix: &str, reason: &str) -> Catalogue {
        self.unavailable
            .push((prefix.to_string(), reason.to_string()));
        self
    }

    /// Every template, in order of preference.
    pub fn templates(&self) -> &[TemplateInfo] {
        &self.templates
    }

    /// The template named `id` exactly.
    pub fn get(&self, id: &str) -> Option<&TemplateInfo> {
        self.templates.iter().find(|t| t.id == id)
    }

    /// The template that honours `image`: a template name, one of its exact names, or a
    /// Docker-style `repo:tag` whose version it runs.
    pub fn resolve(&self, image: &str) -> Result<&TemplateInfo, UnknownImage> {
        if image.len() > MAX_IMAGE_NAME {
            // Echoed back in the error: a hostile name is not repeated whole.
            let mut end = MAX_IMAGE_NAME;
            while !image.is_char_boundary(end) {
                end -= 1;
            }
            return Err(UnknownImage {
                image: format!("{}…", &image[..end]),
                reason: format!(
                    "an image name is at most {MAX_IMAGE_NAME} bytes; this one has {}",
                    image.len()
                ),
                available: self.available(),
            });
        }
        let wanted = image.trim().to_ascii_lowercase();
        // A template's own name or exact alias beats any repository match.
        if let Some(template) = self
            .templates
            .iter()
            .find(|t| t.id == wanted || t.images.names.contains(&wanted))
        {
            return Ok(template);
        }
        let mut wrong_version = None;
        for template in &self.templates {
            match template.honours(&wanted) {
                Honour::Yes if !wanted.is_empty() => return Ok(template),
                Honour::WrongVersion => {
                    wrong_version.get_or_insert(template);
                }
                _ => {}
            }
        }
        let reason = match wrong_version {
            Some(t) => format!(
                "no installed template runs {image:?}: the {:?} template ({}) honours {}",
                t.id,
                t.description,
                accepted(t).join(", ")
            ),
            None if wanted.is_empty() => "no image given".to_string(),
            None => match self
                .unavailable
                .iter()
                .find(|(prefix, _)| wanted.starts_with(prefix.as_str()))
            {
                Some((_, why)) => format!("the template {image:?} cannot run here: {why}"),
                None => format!("no installed template honours the image {image:?}"),
            },
        };
        Err(UnknownImage {
            image: image.to_string(),
            reason,
            available: self.available(),
        })
    }

    /// Every accepted image name, for error messages.
    pub fn available(&self) -> Vec<String> {
        self.templates.iter().flat_map(accepted).collect()
    }
}

/// The image names a template accepts, in words: its id, exact names, `repo:a.b–c.d`.
pub fn accepted(template: &TemplateInfo) -> Vec<String> {
    let mut names = vec![template.id.clone()];
    names.extend(
        template
            .images
            .names
            .iter()
            .filter(|n| **n != template.id)
            .cloned(),
    );
    for repo in &template.images.repos {
        names.push(match &template.images.versions {
            Some(range) => format!("{repo}:{range}"),
            None => format!("{repo}:TAG"),
        });
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_the_serialised_ones() {
        for kind in [
            BackendKind::Wasm,
            BackendKind::Native,
            BackendKind::Vm,
            BackendKind::Fake,
        ] {
            assert_eq!(serde_json::to_value(kind).unwrap(), kind.as_str());
        }
        for lifecycle in [Lifecycle::Ephemeral, Lifecycle::Live] {
            assert_eq!(serde_json::to_value(lifecycle).unwrap(), lifecycle.as_str());
        }
    }

    fn catalogue() -> Catalogue {
        let javascript = TemplateInfo {
            id: "javascript".into(),
            description: "QuickJS on WebAssembly".into(),
            languages: vec![Language::JavaScript],
            images: ImageRule {
                names: vec!["node".into(), "js".into()],
                repos: vec!["node".into()],
                versions: None,
            },
            resources: None,
            workspace_owner: None,
            ..TemplateInfo::example_python()
        };
        Catalogue::new(vec![TemplateInfo::example_python(), javascript])
    }

    #[test]
    fn images_resolve_to_templates_that_honour_them() {
        let catalogue = catalogue();
        for (image, id) in [
            ("python", "python"),
            ("PYTHON3", "python"),
            ("python:3", "python"),
            ("python:3.9-slim", "python"),
            ("python:3.15.0", "python"),
            ("python:latest", "python"),
            ("python:slim-bookworm", "python"),
            ("library/python:3.12", "python"),
            ("docker.io/library/python:3.12@sha256:abc", "python"),
            (" javascript ", "javascript"),
            ("node:16-alpine", "javascript"),
            ("node", "javascript"),
        ] {
            assert_eq!(
                catalogue.resolve(image).map(|t| t.id.as_str()),
                Ok(id),
                "{image}"
            );
        }
    }

    #[test]
    fn versions_no_template_runs_are_refused_with_what_is_available() {
        let catalogue = catalogue();
        for image in ["python:2.7", "python:2", "python:3.16-slim", "python:4"] {
            let err = catalogue.resolve(image).unwrap_err();
            assert!(err.reason.contains("no installed template runs"), "{err}");
            assert!(err.reason.contains("python:3.0–3.15"), "{err}");
            assert!(err.available.contains(&"python".to_string()), "{err:?}");
        }
        for image in ["ruby:3", "", "   ", "pythonx", "python-3"] {
            let err = catalogue.resolve(image).unwrap_err();
            assert_eq!(err.available, catalogue.available());
        }
    }

    #[test]
    fn an_oversized_image_name_is_refused_without_echoing_it_whole() {
        let huge = "python:3.12".to_string() + &"é".repeat(1 << 20);
        let err = catalogue().resolve(&huge).unwrap_err();
        assert!(err.image.len() <= MAX_IMAGE_NAME + 4, "{}", err.image.len());
        assert!(err.to_string().len() < 1000, "{}", err.to_string().len());
        assert!(err.reason.contains("at most 256 bytes"), "{err}");
    }

    #[test]
    fn the_first_template_that_honours_an_image_wins() {
        let mut templates = catalogue().templates().to_vec();
        let mut native = TemplateInfo::example_python();
        native.id = "debian-python".into();
        native.backend = BackendKind::Native;
        templates.insert(0, native);
        let catalogue = Catalogue::new(templates);
        assert_eq!(
            catalogue.resolve("python:3.11").unwrap().id,
            "debian-python"
        );
        assert_eq!(catalogue.resolve("python").unwrap().id, "python");
        assert_eq!(catalogue.get("python").unwrap().backend, BackendKind::Wasm);
    }

    #[test]
    fn a_template_of_a_tier_not_served_here_is_refused_with_the_reason() {
        let catalogue = catalogue().with_unavailable("linux-", "start the server with --linux");
        let err = catalogue.resolve("linux-python").unwrap_err();
        assert!(
            err.reason
                .contains("cannot run here: start the server with --linux"),
            "{err}"
        );
        let err = catalogue.resolve("nope").unwrap_err();
        assert!(
            err.reason.contains("no installed template honours"),
            "{err}"
        );
        assert_eq!(catalogue.resolve("python").unwrap().id, "python");
    }
}
