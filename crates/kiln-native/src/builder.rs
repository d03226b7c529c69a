//! Builds a template's root filesystem: `debootstrap` (minbase) from a Debian mirror, then
//! `apt-get install` of the template's packages, the unprivileged user, the post-install
//! script, cleaning, and the ownership shift that lets a box's user namespace own it.
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

use crate::template::{Definition, USER_HOME, USER_NAME, USER_UID};

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
}

/// A step failed.
#[derive(Debug, thiserror::Error)]
#[error("building the {template} template failed at step {step:?}: {message}")]
pub struct BuildError {
    pub template: String,
    pub step: &'static str,
    pub message: String,
}

/// What a build reports as it goes.
pub trait Progress {
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

/// What debootstrap installed before the exclusions applied.
const CLEAN: &str = "find /usr/share/doc -depth -type f ! -name copyright -delete; \
    find /usr/share/doc -depth -type d -empty -delete; \
    rm -rf /usr/share/man/* /usr/share/info/*; \
    find /usr/share/locale -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +; \
    apt-get clean";

const STEPS: [&str; 7] = [
    "debootstrap",
    "apt-get install",
    "user",
    "post-install",
    "clean",
    "ownership",
    "seal",
];

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
        })
    }

    /// The built template, building it first if it is not in the store.
    pub fn ensure(
        &self,
        definition: &Definition,
        progress: &dyn Progress,
    ) -> Result<Template, BuildError> {
        match self.find(definition) {
            Some(template) => Ok(template),
            None => self.build(definition, progress),
        }
    }

    /// Builds `definition`'s root filesystem (even if one is in the store: it is replaced).
    pub fn build(
        &self,
        definition: &Definition,
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
            step: std::cell::Cell::new(0),
        };
        std::fs::create_dir_all(&job.debs)
            .map_err(|e| fail("prepare")(format!("{}: {e}", job.debs.display())))?;
        job.bootstrap().map_err(fail("debootstrap"))?;
        job.install().map_err(fail("apt-get install"))?;
        job.add_user().map_err(fail("user"))?;
        let versions = job.post_install().map_err(fail("post-install"))?;
        job.clean().map_err(fail("clean"))?;
        job.next("ownership");
        shift_ownership(&job.rootfs, self.uid_base).map_err(fail("ownership"))?;
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
        let staging = self.root.join(format!(
            ".build-{}-{}-{}",
            definition.name,
            &hash[..16],
            std::process::id()
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
        })
    }

    /// Removes builds a dead process left half-made.
    fn remove_abandoned_builds(&self) {
        let Ok(dir) = std::fs::read_dir(&self.root) else {
            return;
        };
        for entry in dir.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(pid) = name
                .strip_prefix(".build-")
                .and_then(|rest| rest.rsplit('-').next())
                .and_then(|pid| pid.parse::<i32>().ok())
            else {
                continue;
            };
            // SAFETY: kill(2) takes only integers and touches no memory of ours, and with signal 0
            // it sends nothing, whatever `pid` is: it only checks that the process exists.
            let alive = unsafe { libc::kill(pid, 0) } == 0;
            if !alive || pid == std::process::id() as i32 {
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
    /// The package cache shared by every build.
    debs: PathBuf,
    suite: String,
    step: std::cell::Cell<usize>,
}

impl Job<'_> {
    fn next(&self, name: &str) {
        self.step.set(self.step.get() + 1);
        self.progress.step(self.step.get(), STEPS.len(), name);
    }

    fn in_root(&self, script: &str) -> Result<(), String> {
        in_root(&self.rootfs, &self.debs, script, self.progress)
    }

    fn bootstrap(&self) -> Result<(), String> {
        self.next("debootstrap");
        run(
            Command::new("debootstrap")
                .arg("--variant=minbase")
                .arg(format!("--cache-dir={}", self.debs.display()))
                .arg(&self.suite)
                .arg(&self.rootfs)
                .arg(&self.store.mirror),
            self.progress,
        )
    }

    fn install(&self) -> Result<(), String> {
        self.next("apt-get install");
        std::fs::write(
            self.rootfs.join("etc/apt/sources.list"),
            format!("deb {} {} main\n", self.store.mirror, self.suite),
        )
        .map_err(|e| e.to_string())?;
        // Documentation, manual pages and translations are left out (copyright files stay).
        std::fs::write(self.rootfs.join("etc/dpkg/dpkg.cfg.d/01-kiln-nodoc"), NODOC)
            .map_err(|e| e.to_string())?;
        if self.definition.packages.is_empty() {
            return Ok(());
        }
        self.in_root(&format!(
            "apt-get update -q && apt-get install -y -q --no-install-recommends {}",
            self.definition.packages.join(" ")
        ))
    }

    fn add_user(&self) -> Result<(), String> {
        self.next("user");
        self.in_root(&format!(
            "useradd --uid {USER_UID} --user-group --create-home --home-dir {USER_HOME} \
             --shell {shell} {USER_NAME} && mkdir -p {dir} && chown {USER_NAME}:{USER_NAME} {dir}",
            shell = self.definition.default_shell,
            dir = self.definition.working_dir,
        ))
    }

    /// Runs the template's script; answers the installed versions of its `versions`.
    fn post_install(&self) -> Result<std::collections::BTreeMap<String, String>, String> {
        self.next("post-install");
        if let Some(script) = &self.definition.post_install {
            self.in_root(script)?;
        }
        installed_versions(&self.rootfs, &self.definition.versions)
    }

    fn clean(&self) -> Result<(), String> {
        self.next("clean");
        self.in_root(CLEAN)?;
        clean(&self.rootfs)
    }
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

/// Runs `script` as root inside `rootfs` (chroot), in a private mount namespace holding
/// `/proc` and the shared package cache, so nothing stays mounted when it ends.
fn in_root(
    rootfs: &Path,
    debs: &Path,
    script: &str,
    progress: &dyn Progress,
) -> Result<(), String> {
    let setup = "set -e; mount -t proc proc \"$1/proc\"; \
                 mount --bind \"$2\" \"$1/var/cache/apt/archives\"; \
                 exec chroot \"$1\" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
                 HOME=/root DEBIAN_FRONTEND=noninteractive LC_ALL=C /bin/sh -ec \"$3\"";
    run(
        Command::new("unshare")
            .args(["--mount", "--propagation", "private", "--fork", "--"])
            .args(["/bin/sh", "-c", setup, "kiln-build"])
            .arg(rootfs)
            .arg(debs)
            .arg(script),
        progress,
    )
}

fn installed_versions(
    rootfs: &Path,
    packages: &[String],
) -> Result<std::collections::BTreeMap<String, String>, String> {
    if packages.is_empty() {
        return Ok(Default::default());
    }
    let output = Command::new("chroot")
        .arg(rootfs)
        .args(["dpkg-query", "-W", "-f", "${Package}\t${Version}\n"])
        .args(packages)
        .output()
        .map_err(|e| format!("dpkg-query: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "dpkg-query: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| l.split_once('\t'))
        .map(|(p, v)| (p.to_string(), v.to_string()))
        .collect())
}

/// Drops caches and logs, leaves no name resolution (a box has no network unless kiln's
/// proxy carries it) and makes the mount point of the agent.
fn clean(rootfs: &Path) -> Result<(), String> {
    for dir in [
        "var/lib/apt/lists",
        "var/log",
        "tmp",
        "var/tmp",
        "var/cache/debconf",
    ] {
        let dir = rootfs.join(dir);
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for entry in entries.flatten() {
                let path = entry.path();
                let _ = if path.is_dir() && !path.is_symlink() {
                    std::fs::remove_dir_all(&path)
                } else {
                    std::fs::remove_file(&path)
                };
            }
        }
    }
    let write = |path: &str, text: &str| {
        let path = rootfs.join(path);
        let _ = std::fs::remove_file(&path);
        std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))
    };
    write("etc/hostname", "kiln\n")?;
    write(
        "etc/hosts",
        "127.0.0.1\tlocalhost kiln\n::1\tlocalhost ip6-localhost ip6-loopback\n",
    )?;
    write("etc/resolv.conf", "")?;
    let kiln = rootfs.join(".kiln");
    std::fs::create_dir_all(&kiln).map_err(|e| e.to_string())?;
    std::fs::write(kiln.join("agent"), b"").map_err(|e| e.to_string())?;
    std::fs::set_permissions(kiln.join("agent"), std::fs::Permissions::from_mode(0o755))
        .map_err(|e| e.to_string())
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
