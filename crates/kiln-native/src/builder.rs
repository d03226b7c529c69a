//! Builds a template's root filesystem. Only the first step runs as the host's root:
//! `debootstrap --foreign` (minbase) downloads Debian's base packages from the mirror,
//! checks them against the mirror's signed index and unpacks them, running nothing from
//! them. The tree is then shifted to the unprivileged uids a box's user namespace maps, and
//! every later step runs inside a box's own jail with the new tree as its root (a user
//! namespace, no host mounts, the boxes' seccomp filter and capabilities, a cgroup, and a
//! network that reaches only the mirror and the allowlist through kiln's proxy):
//! debootstrap's second stage (the base packages' maintainer scripts), `apt-get install` of
//! the template's packages, its unprivileged user, its post-install script, the installed
//! versions and cleaning. So a template author can do no more than code in a box can.
//!
//! A build happens in a hidden folder beside the store and is renamed into place only when
//! every step succeeded, so the store holds whole templates or nothing; a failure says which
//! step failed and removes what it made. Templates are content-addressed: the folder's name
//! carries [`Definition::build_hash`], so an unchanged definition is never rebuilt and a
//! changed one builds a new folder beside the old.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::boxes::{BoxSpec, Boxes, Exec, LiveBox};
use crate::jail::BoxLimits;
use crate::proxy::Allowlist;
use crate::template::{Definition, USER_HOME, USER_NAME, USER_UID};

/// The longest one jailed step may run.
const STEP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30 * 60);

/// Where templates are built and kept.
#[derive(Debug, Clone)]
pub struct Store {
    /// `<cache>/templates`.
    pub root: PathBuf,
    /// The Debian mirror packages come from.
    pub mirror: String,
    /// Host uid (and gid) that a box's root maps to; the box's uid N is host `uid_base + N`.
    pub uid_base: u32,
}

/// What a built template records about itself (`template.json` beside its `rootfs`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Built {
    pub name: String,
    pub hash: String,
    pub suite: String,
    /// Installed versions of the definition's `versions` packages.
    pub versions: std::collections::BTreeMap<String, String>,
    pub uid_base: u32,
    pub size_bytes: u64,
    pub build_seconds: f64,
}

impl Built {
    /// The installed versions, as `package version, …`.
    pub fn versions_line(&self) -> String {
        self.versions
            .iter()
            .map(|(package, version)| format!("{package} {version}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// A built template on disk.
#[derive(Debug, Clone)]
pub struct Template {
    pub definition: Definition,
    pub built: Built,
    /// The read-only root filesystem (an overlay's lower layer).
    pub rootfs: PathBuf,
    /// Run as a microVM (the `vm-` tier) rather than a box: its root filesystem made an
    /// image ([`crate::vm::root_image`]) and booted under QEMU.
    pub vm: bool,
    /// Offered under gVisor as well as its own runtime (the `gvisor-` variant of a template,
    /// `kiln serve --gvisor`): its boxes run under runsc.
    pub gvisor: bool,
}

impl Template {
    /// The runtime its boxes run under, if it names one (else the server's default).
    pub fn box_runtime(&self) -> Option<crate::template::BoxRuntime> {
        if self.gvisor {
            Some(crate::template::BoxRuntime::Runsc)
        } else {
            self.definition.box_runtime
        }
    }
}

/// A step failed.
#[derive(Debug, thiserror::Error)]
#[error("building the {template} template failed at step {step:?}: {message}")]
pub struct BuildError {
    pub template: String,
    pub step: &'static str,
    pub message: String,
}

/// What a build reports as it goes (from the thread that drives the jailed steps too).
pub trait Progress: Sync {
    /// Step `index` of `total` begins.
    fn step(&self, index: usize, total: usize, name: &str);
    /// A line of a step's tool output.
    fn line(&self, line: &str);
}

/// Reports nothing.
#[derive(Debug)]
pub struct Quiet;

impl Progress for Quiet {
    fn step(&self, _: usize, _: usize, _: &str) {}
    fn line(&self, _: &str) {}
}

const NODOC: &str = "path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
";

/// What debootstrap installed before the exclusions applied, caches and logs; no name
/// resolution (a box has no network unless kiln's proxy carries it) and kiln's own host
/// names, with any a template's post-install put in `/etc/kiln/hosts` (the services
/// template's `postgres.workspace.internal`). Run in the jail, as the last step.
const CLEAN: &str = "find /usr/share/doc -depth -type f ! -name copyright -delete; \
    find /usr/share/doc -depth -type d -empty -delete; \
    rm -rf /usr/share/man/* /usr/share/info/*; \
    find /usr/share/locale -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +; \
    apt-get clean; \
    rm -rf /var/lib/apt/lists/* /var/log/* /var/tmp/* /var/cache/debconf/* /debootstrap; \
    rm -f /etc/hostname /etc/hosts /etc/resolv.conf; \
    echo kiln > /etc/hostname; \
    printf '127.0.0.1\\tlocalhost kiln\\n::1\\tlocalhost ip6-localhost ip6-loopback\\n' > /etc/hosts; \
    if [ -f /etc/kiln/hosts ]; then cat /etc/kiln/hosts >> /etc/hosts; fi; \
    : > /etc/resolv.conf";

const STEPS: [&str; 9] = [
    "debootstrap",
    "ownership",
    "jail",
    "configure",
    "apt-get install",
    "user",
    "post-install",
    "clean",
    "seal",
];

/// What a build's jail may use: all the host's CPUs, memory and tasks enough for a
/// compiler, a `/tmp` of 1 GiB.
fn build_limits() -> BoxLimits {
    BoxLimits {
        memory_bytes: 4 << 30,
        vcpus: std::thread::available_parallelism().map_or(1, |n| n.get()) as f64,
        pids: 4096,
        disk_bytes: 4 << 30,
        weight: 100,
    }
}

/// Where a build's jailed steps run.
#[derive(Debug, Clone, Copy)]
pub struct Jail<'a> {
    /// The boxes that run them (the agent, the container runtime, the state folder).
    pub boxes: &'a Boxes,
    /// What the build's network may reach beside the mirror (a `post_install` that runs
    /// `pip install` needs the package index): the boxes' allowlist.
    pub allow: &'a Allowlist,
}

impl Store {
    /// Reads the Debian mirror from the host's apt sources (the first `URIs:` or `deb`
    /// line naming a path ending in `/debian`), else deb.debian.org.
    pub fn host_mirror() -> String {
        let mut texts = Vec::new();
        if let Ok(dir) = std::fs::read_dir("/etc/apt/sources.list.d") {
            for entry in dir.flatten() {
                texts.extend(std::fs::read_to_string(entry.path()).ok());
            }
        }
        texts.extend(std::fs::read_to_string("/etc/apt/sources.list").ok());
        texts
            .iter()
            .flat_map(|t| t.lines())
            .filter(|l| !l.trim_start().starts_with('#'))
            .flat_map(|l| l.split_whitespace())
            .find(|w| {
                (w.starts_with("http://") || w.starts_with("https://"))
                    && w.trim_end_matches('/').ends_with("/debian")
            })
            .map(|w| w.trim_end_matches('/').to_string())
            .unwrap_or_else(|| "http://deb.debian.org/debian".into())
    }

    fn folder(&self, definition: &Definition) -> PathBuf {
        let hash = definition.build_hash(&self.mirror, self.uid_base);
        self.root
            .join(format!("{}-{}", definition.name, &hash[..16]))
    }

    /// The built template for `definition`, if its root filesystem is in the store.
    pub fn find(&self, definition: &Definition) -> Option<Template> {
        let folder = self.folder(definition);
        let text = std::fs::read_to_string(folder.join("template.json")).ok()?;
        let built: Built = serde_json::from_str(&text).ok()?;
        (built.hash == definition.build_hash(&self.mirror, self.uid_base)).then(|| Template {
            definition: definition.clone(),
            built,
            rootfs: folder.join("rootfs"),
            vm: false,
            gvisor: false,
        })
    }

    /// The built template, building it first (in `jail`) if it is not in the store.
    pub fn ensure(
        &self,
        definition: &Definition,
        jail: Jail<'_>,
        progress: &dyn Progress,
    ) -> Result<Template, BuildError> {
        match self.find(definition) {
            Some(template) => Ok(template),
            None => self.build(definition, jail, progress),
        }
    }

    /// Builds `definition`'s root filesystem (even if one is in the store: it is replaced):
    /// debootstrap's download as the host's root, every later step in `jail`.
    pub fn build(
        &self,
        definition: &Definition,
        jail: Jail<'_>,
        progress: &dyn Progress,
    ) -> Result<Template, BuildError> {
        let fail = |step: &'static str| {
            let template = definition.name.clone();
            move |message: String| BuildError {
                template: template.clone(),
                step,
                message,
            }
        };
        let started = Instant::now();
        let mut guard = self.staging(definition).map_err(fail("prepare"))?;
        let staging = guard.0.clone().unwrap_or_default();
        let job = Job {
            store: self,
            definition,
            progress,
            rootfs: staging.join("rootfs"),
            debs: self.root.join("debs"),
            suite: definition.suite().map_err(fail("prepare"))?.to_string(),
            step: std::sync::atomic::AtomicUsize::new(0),
        };
        std::fs::create_dir_all(&job.debs)
            .map_err(|e| fail("prepare")(format!("{}: {e}", job.debs.display())))?;
        job.bootstrap().map_err(fail("debootstrap"))?;
        job.next("ownership");
        job.prepare().map_err(fail("ownership"))?;
        shift_ownership(&job.rootfs, self.uid_base).map_err(fail("ownership"))?;
        let versions = job.jailed(jail)?;
        job.next("seal");
        let built = Built {
            name: definition.name.clone(),
            hash: definition.build_hash(&self.mirror, self.uid_base),
            suite: job.suite.clone(),
            versions,
            uid_base: self.uid_base,
            size_bytes: disk_usage(&job.rootfs),
            build_seconds: started.elapsed().as_secs_f64(),
        };
        let template = self
            .seal(definition, &staging, built)
            .map_err(fail("seal"))?;
        guard.0 = None;
        Ok(template)
    }

    /// A fresh hidden folder to build in, removed unless the build succeeds.
    fn staging(&self, definition: &Definition) -> Result<RemoveOnDrop, String> {
        std::fs::create_dir_all(&self.root).map_err(|e| format!("{}: {e}", self.root.display()))?;
        self.remove_abandoned_builds();
        let hash = definition.build_hash(&self.mirror, self.uid_base);
        // The pid says whose build it is; the count tells apart builds one process runs at
        // once.
        static BUILDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let staging = self.root.join(format!(
            ".build-{}-{}-{}-{}",
            definition.name,
            &hash[..16],
            std::process::id(),
            BUILDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&staging);
        std::fs::create_dir_all(&staging).map_err(|e| format!("{}: {e}", staging.display()))?;
        Ok(RemoveOnDrop(Some(staging)))
    }

    /// Records what was built and renames the staging folder into place.
    fn seal(
        &self,
        definition: &Definition,
        staging: &Path,
        built: Built,
    ) -> Result<Template, String> {
        let json = serde_json::to_vec_pretty(&built).map_err(|e| e.to_string())?;
        std::fs::write(staging.join("template.json"), json).map_err(|e| e.to_string())?;
        let folder = self.folder(definition);
        if folder.exists() {
            std::fs::remove_dir_all(&folder).map_err(|e| format!("{}: {e}", folder.display()))?;
        }
        std::fs::rename(staging, &folder).map_err(|e| format!("{}: {e}", folder.display()))?;
        Ok(Template {
            definition: definition.clone(),
            built,
            rootfs: folder.join("rootfs"),
            vm: false,
            gvisor: false,
        })
    }

    /// Removes builds a dead process left half-made (this process's own builds, running or
    /// not, remove themselves).
    fn remove_abandoned_builds(&self) {
        let Ok(dir) = std::fs::read_dir(&self.root) else {
            return;
        };
        for entry in dir.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(pid) = name
                .strip_prefix(".build-")
                .and_then(|rest| rest.rsplit('-').nth(1))
                .and_then(|pid| pid.parse::<i32>().ok())
            else {
                continue;
            };
            // SAFETY: kill(2) takes only integers and touches no memory of ours, and with signal 0
            // it sends nothing, whatever `pid` is: it only checks that the process exists.
            let alive = unsafe { libc::kill(pid, 0) } == 0;
            if !alive {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }

    /// Every built template folder in the store, by name (for `kiln setup --list`).
    pub fn built(&self) -> Vec<Built> {
        let Ok(dir) = std::fs::read_dir(&self.root) else {
            return Vec::new();
        };
        let mut all: Vec<Built> = dir
            .flatten()
            .filter_map(|e| std::fs::read_to_string(e.path().join("template.json")).ok())
            .filter_map(|t| serde_json::from_str(&t).ok())
            .collect();
        all.sort_by(|a, b| a.name.cmp(&b.name));
        all
    }
}

/// One build's steps, in order.
struct Job<'a> {
    store: &'a Store,
    definition: &'a Definition,
    progress: &'a dyn Progress,
    rootfs: PathBuf,
    /// The package cache debootstrap's download shares between builds (never seen by a
    /// jailed step: debootstrap copies what it needs into the new root).
    debs: PathBuf,
    suite: String,
    step: std::sync::atomic::AtomicUsize,
}

impl Job<'_> {
    fn next(&self, name: &str) {
        let step = self.step.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        self.progress.step(step, STEPS.len(), name);
    }

    fn fail(&self, step: &'static str) -> impl Fn(String) -> BuildError + '_ {
        move |message| BuildError {
            template: self.definition.name.clone(),
            step,
            message,
        }
    }

    /// Downloads, checks and unpacks the base packages, running none of them.
    fn bootstrap(&self) -> Result<(), String> {
        self.next("debootstrap");
        run(
            Command::new("debootstrap")
                .arg("--variant=minbase")
                .arg("--foreign")
                .arg(format!("--cache-dir={}", self.debs.display()))
                .arg(&self.suite)
                .arg(&self.rootfs)
                .arg(&self.store.mirror),
            self.progress,
        )
    }

    /// While the tree holds only what debootstrap unpacked: apt's source and the
    /// documentation exclusions, an empty `/tmp`, and the agent's mount point.
    fn prepare(&self) -> Result<(), String> {
        let write = |path: &str, text: &str| {
            let path = self.rootfs.join(path);
            std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))
        };
        write(
            "etc/apt/sources.list",
            &format!("deb {} {} main\n", self.store.mirror, self.suite),
        )?;
        // Documentation, manual pages and translations are left out (copyright files stay).
        std::fs::create_dir_all(self.rootfs.join("etc/dpkg/dpkg.cfg.d"))
            .map_err(|e| e.to_string())?;
        write("etc/dpkg/dpkg.cfg.d/01-kiln-nodoc", NODOC)?;
        if let Ok(entries) = std::fs::read_dir(self.rootfs.join("tmp")) {
            for entry in entries.flatten() {
                let path = entry.path();
                let _ = match entry.file_type() {
                    Ok(kind) if kind.is_dir() => std::fs::remove_dir_all(&path),
                    _ => std::fs::remove_file(&path),
                };
            }
        }
        // The runtime mounts on these and refuses a link (a foreign debootstrap leaves
        // `/proc` a link to the host's).
        for dir in ["proc", "sys", "dev", "tmp"] {
            let path = self.rootfs.join(dir);
            if std::fs::symlink_metadata(&path).is_ok_and(|m| !m.is_dir()) {
                std::fs::remove_file(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            }
            std::fs::create_dir_all(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        }
        let kiln = self.rootfs.join(".kiln");
        std::fs::create_dir_all(&kiln).map_err(|e| e.to_string())?;
        write(".kiln/agent", "")?;
        std::fs::set_permissions(kiln.join("agent"), std::fs::Permissions::from_mode(0o755))
            .map_err(|e| e.to_string())
    }

    /// Every step after the ownership shift, in a box whose root is the new tree: answers
    /// the installed versions. The box is driven from a thread of its own (a build is
    /// called from plain code and from async code alike).
    fn jailed(
        &self,
        jail: Jail<'_>,
    ) -> Result<std::collections::BTreeMap<String, String>, BuildError> {
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    let runtime = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .map_err(|e| self.fail("jail")(e.to_string()))?;
                    runtime.block_on(self.in_jail(jail))
                })
                .join()
                .unwrap_or_else(|_| Err(self.fail("jail")("the build's thread panicked".into())))
        })
    }

    async fn in_jail(
        &self,
        jail: Jail<'_>,
    ) -> Result<std::collections::BTreeMap<String, String>, BuildError> {
        self.next("jail");
        let (host, port) = mirror_host(&self.store.mirror).map_err(self.fail("jail"))?;
        let allow = jail
            .allow
            .with_host(&host, port)
            .map_err(|e| self.fail("jail")(format!("the mirror {}: {e}", self.store.mirror)))?;
        let template = Template {
            definition: self.definition.clone(),
            built: Built {
                name: self.definition.name.clone(),
                hash: String::new(),
                suite: self.suite.clone(),
                versions: Default::default(),
                uid_base: self.store.uid_base,
                size_bytes: 0,
                build_seconds: 0.0,
            },
            rootfs: self.rootfs.clone(),
            vm: false,
            gvisor: false,
        };
        let live = jail
            .boxes
            .open(BoxSpec {
                network: Some(crate::proxy::LiveEgress::operator_only(
                    std::sync::Arc::new(allow),
                )),
                in_place: true,
                ..BoxSpec::new(template, build_limits())
            })
            .await
            .map_err(|e| self.fail("jail")(e.to_string()))?;
        let versions = self.steps(&live).await;
        live.close().await;
        versions
    }

    async fn steps(
        &self,
        live: &LiveBox,
    ) -> Result<std::collections::BTreeMap<String, String>, BuildError> {
        self.next("configure");
        // `container=lxc`: in a box no device can be made, and debootstrap then does not try.
        self.sh(
            live,
            "container=lxc /debootstrap/debootstrap --second-stage",
        )
        .await
        .map_err(self.fail("configure"))?;
        self.next("apt-get install");
        if !self.definition.packages.is_empty() {
            self.sh(
                live,
                &format!(
                    "apt-get update -q && apt-get install -y -q --no-install-recommends {}",
                    self.definition.packages.join(" ")
                ),
            )
            .await
            .map_err(self.fail("apt-get install"))?;
        }
        self.next("user");
        self.sh(
            live,
            &format!(
                "useradd --uid {USER_UID} --user-group --create-home --home-dir {USER_HOME} \
                 --shell {shell} {USER_NAME} && mkdir -p {dir} && chown {USER_NAME}:{USER_NAME} {dir}",
                shell = self.definition.default_shell,
                dir = self.definition.working_dir,
            ),
        )
        .await
        .map_err(self.fail("user"))?;
        self.next("post-install");
        if let Some(script) = &self.definition.post_install {
            self.sh(live, script)
                .await
                .map_err(self.fail("post-install"))?;
        }
        let versions = if self.definition.versions.is_empty() {
            Default::default()
        } else {
            let mut argv = vec!["dpkg-query", "-W", "-f", "${Package}\t${Version}\n"];
            argv.extend(self.definition.versions.iter().map(String::as_str));
            let listed = self
                .command(live, argv.iter().map(|a| a.to_string()).collect())
                .await
                .map_err(|e| self.fail("post-install")(format!("dpkg-query: {e}")))?;
            String::from_utf8_lossy(&listed)
                .lines()
                .filter_map(|l| l.split_once('\t'))
                .map(|(p, v)| (p.to_string(), v.to_string()))
                .collect()
        };
        self.next("clean");
        self.sh(live, CLEAN).await.map_err(self.fail("clean"))?;
        Ok(versions)
    }

    /// Runs `script` with `sh -e` as the box's root.
    async fn sh(&self, live: &LiveBox, script: &str) -> Result<Vec<u8>, String> {
        self.command(live, vec!["/bin/sh".into(), "-ec".into(), script.into()])
            .await
    }

    /// Runs `argv` as the box's root, passing each output line to the progress; answers its
    /// standard output, or why it failed with its last lines.
    async fn command(&self, live: &LiveBox, argv: Vec<String>) -> Result<Vec<u8>, String> {
        let program = argv.first().cloned().unwrap_or_default();
        let mut exec = Exec::new(argv);
        exec.root = true;
        exec.cwd = Some("/".into());
        exec.timeout = STEP_TIMEOUT;
        exec.max_output = 4 << 20;
        exec.env = vec![
            ("DEBIAN_FRONTEND".into(), "noninteractive".into()),
            ("LC_ALL".into(), "C".into()),
        ];
        let mut lines = Lines::default();
        let out = live
            .exec(exec, |stderr, data| lines.feed(stderr, data, self.progress))
            .await
            .map_err(|e| format!("{program}: {e}"))?;
        lines.flush(self.progress);
        let why = if out.timed_out {
            format!("ran past {} minutes", STEP_TIMEOUT.as_secs() / 60)
        } else if out.oom_killed {
            format!(
                "ran out of memory (a build's jail has {} GiB)",
                build_limits().memory_bytes >> 30
            )
        } else {
            match (out.exit_code, out.signal) {
                (Some(0), _) => return Ok(out.stdout),
                (Some(code), _) => format!("exited with {code}"),
                (None, Some(signal)) => format!("was killed by signal {signal}"),
                (None, None) => "ended without a status".into(),
            }
        };
        Err(format!(
            "{program} {why}; its last lines:\n{}",
            lines.tail.iter().cloned().collect::<Vec<_>>().join("\n")
        ))
    }
}

/// A jailed step's output cut into lines (for the progress, and the last few for an error).
#[derive(Default)]
struct Lines {
    partial: [Vec<u8>; 2],
    tail: std::collections::VecDeque<String>,
}

impl Lines {
    fn feed(&mut self, stderr: bool, data: &[u8], progress: &dyn Progress) {
        let partial = &mut self.partial[usize::from(stderr)];
        partial.extend_from_slice(data);
        while let Some(end) = partial.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = partial.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line[..end]).into_owned();
            progress.line(&line);
            self.tail.push_back(line);
            if self.tail.len() > 8 {
                self.tail.pop_front();
            }
        }
        // A line that never ends is cut, so one stream cannot hold a build's memory.
        if partial.len() > 64 << 10 {
            partial.truncate(4096);
            partial.push(b'\n');
            self.feed(stderr, &[], progress);
        }
    }

    fn flush(&mut self, progress: &dyn Progress) {
        for stderr in [false, true] {
            if !self.partial[usize::from(stderr)].is_empty() {
                self.feed(stderr, b"\n", progress);
            }
        }
    }
}

/// The mirror's host and port (`http://deb.debian.org/debian` is `deb.debian.org`, 80).
fn mirror_host(mirror: &str) -> Result<(String, u16), String> {
    let (scheme, rest) = mirror
        .split_once("://")
        .ok_or_else(|| format!("the mirror {mirror:?} is not an http:// or https:// address"))?;
    let default_port = match scheme {
        "http" => 80,
        "https" => 443,
        _ => {
            return Err(format!(
                "the mirror {mirror:?} is not an http:// or https:// address"
            ));
        }
    };
    let authority = rest.split('/').next().unwrap_or_default();
    let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
    let (host, port) = match authority.rsplit_once(':') {
        Some((host, port)) if !port.contains(']') => (
            host,
            port.parse()
                .map_err(|_| format!("the mirror {mirror:?} has a bad port"))?,
        ),
        _ => (authority, default_port),
    };
    if host.is_empty() {
        return Err(format!("the mirror {mirror:?} names no host"));
    }
    Ok((host.to_string(), port))
}

struct RemoveOnDrop(Option<PathBuf>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(path) = self.0.take() {
            let _ = std::fs::remove_dir_all(path);
        }
    }
}

/// Runs a tool, passing each output line to `progress`; the last lines say why it failed.
fn run(command: &mut Command, progress: &dyn Progress) -> Result<(), String> {
    use std::io::BufRead;
    let mut child = command
        .env("DEBIAN_FRONTEND", "noninteractive")
        .env("LC_ALL", "C")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            let program = command.get_program().to_string_lossy().into_owned();
            match e.kind() {
                std::io::ErrorKind::NotFound => format!(
                    "{program} is not installed (apt-get install {program}, or run scripts/ensure-deps)"
                ),
                _ => format!("cannot start {program}: {e}"),
            }
        })?;
    let stderr = child.stderr.take();
    let tail = std::sync::Arc::new(std::sync::Mutex::new(std::collections::VecDeque::new()));
    let errors = {
        let tail = tail.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr?)
                .lines()
                .map_while(Result::ok)
            {
                let mut tail = tail.lock().unwrap_or_else(|e| e.into_inner());
                tail.push_back(line);
                if tail.len() > 8 {
                    tail.pop_front();
                }
            }
            Some(())
        })
    };
    if let Some(stdout) = child.stdout.take() {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            progress.line(&line);
            let mut tail = tail.lock().unwrap_or_else(|e| e.into_inner());
            tail.push_back(line);
            if tail.len() > 8 {
                tail.pop_front();
            }
        }
    }
    let _ = errors.join();
    let status = child.wait().map_err(|e| e.to_string())?;
    if status.success() {
        return Ok(());
    }
    let tail = tail.lock().unwrap_or_else(|e| e.into_inner());
    Err(format!(
        "{} exited with {status}; its last lines:\n{}",
        command.get_program().to_string_lossy(),
        tail.iter().cloned().collect::<Vec<_>>().join("\n")
    ))
}

/// Adds `base` to every file's owner and group, so that the box's user namespace (which maps
/// its uid 0 to host `base`) sees its files as Debian made them. Each inode is shifted once
/// (hard links), symlinks are not followed, and modes are restored (a chown clears the
/// setuid bits).
fn shift_ownership(rootfs: &Path, base: u32) -> Result<(), String> {
    let mut seen = std::collections::HashSet::new();
    let mut stack = vec![rootfs.to_path_buf()];
    while let Some(path) = stack.pop() {
        let meta =
            std::fs::symlink_metadata(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        if meta.is_dir() {
            for entry in std::fs::read_dir(&path).map_err(|e| format!("{}: {e}", path.display()))? {
                stack.push(entry.map_err(|e| e.to_string())?.path());
            }
        }
        if !seen.insert((meta.dev(), meta.ino())) {
            continue;
        }
        let (uid, gid) = (meta.uid(), meta.gid());
        if uid >= base && gid >= base {
            continue; // already shifted (a rebuild over a shifted tree never happens, but be safe)
        }
        std::os::unix::fs::lchown(&path, Some(uid + base), Some(gid + base))
            .map_err(|e| format!("{}: {e}", path.display()))?;
        if !meta.is_symlink() {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(meta.mode() & 0o7777))
                .map_err(|e| format!("{}: {e}", path.display()))?;
        }
    }
    Ok(())
}

fn disk_usage(root: &Path) -> u64 {
    let mut seen = std::collections::HashSet::new();
    let mut total = 0;
    let mut stack = vec![root.to_path_buf()];
    while let Some(path) = stack.pop() {
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if meta.is_dir()
            && let Ok(entries) = std::fs::read_dir(&path)
        {
            stack.extend(entries.flatten().map(|e| e.path()));
        }
        if seen.insert((meta.dev(), meta.ino())) {
            total += meta.blocks() * 512;
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mirror_names_its_host_and_port() {
        assert_eq!(
            mirror_host("http://deb.debian.org/debian").unwrap(),
            ("deb.debian.org".into(), 80)
        );
        assert_eq!(
            mirror_host("https://mirror.example:8443/debian/").unwrap(),
            ("mirror.example".into(), 8443)
        );
        assert_eq!(
            mirror_host("http://apt@10.0.0.5:3142/debian").unwrap(),
            ("10.0.0.5".into(), 3142)
        );
        assert_eq!(
            mirror_host("http://[fd00::5]/debian").unwrap(),
            ("[fd00::5]".into(), 80)
        );
        for bad in [
            "deb.debian.org/debian",
            "ftp://x/debian",
            "http:///debian",
            "http://x:port/",
        ] {
            assert!(mirror_host(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_build_may_reach_its_mirror_even_on_a_private_address_but_never_loopback() {
        let boxes = Allowlist::new(&["pypi.org"]).unwrap();
        let private: std::net::IpAddr = "10.0.0.5".parse().unwrap();
        assert!(boxes.reach(private, &[]).is_err());
        let build = boxes.with_host("10.0.0.5", 3142).unwrap();
        assert!(build.allows("10.0.0.5", 3142));
        assert!(build.reach(private, &[]).is_ok());
        assert!(build.allows("pypi.org", 443));
        // Only the mirror's address, not its neighbours.
        assert!(build.reach("10.0.0.6".parse().unwrap(), &[]).is_err());
        let named = boxes.with_host("deb.debian.org", 80).unwrap();
        assert!(named.allows("deb.debian.org", 80));
        assert!(!named.allows("security.debian.org", 80));
        for never in ["127.0.0.1", "localhost", "169.254.169.254", "[::1]"] {
            let err = boxes.with_host(never, 80).unwrap_err();
            assert!(err.contains("never reaches"), "{never}: {err}");
        }
    }
}
