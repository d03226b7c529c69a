//! Live boxes: a jailed root filesystem with the guest agent as PID 1, started once by the
//! container runtime; every command after that is a spawn through the agent.
//!
//! On the host a box is a folder under the state directory holding its bundle
//! (`config.json`), the mount point of its root and a size-capped tmpfs with the overlay's
//! upper layer (what the box writes outside its workspace; writes beyond the cap fail with
//! ENOSPC inside the box). Closing a box kills every process it had, deletes its container
//! and cgroup, unmounts both layers and removes the folder. A kiln that died leaves boxes
//! behind: [`Boxes::new`] finds and removes them (they are cleaned, not resumed).

use std::ffi::CString;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use std::sync::Arc;

use kiln_guest::proto::{Credentials, Failure, Op, Reply, Spawn};

use crate::builder::Template;
use crate::channel::{Carried, Channel, ChannelClosed};
use crate::jail::{self, BoxLimits, Cgroups};
use crate::proxy;
use crate::template::{USER_HOME, USER_NAME, USER_UID};

/// How long a box's agent has to answer its first hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a microVM has to boot to its agent (a software CPU boots in seconds).
const VM_HELLO_TIMEOUT: Duration = Duration::from_secs(90);

/// How long reading a VM's (or gVisor box's) processes or ports through its agent may take.
const INSIDE_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a killed command has to report its end.
const KILL_GRACE: Duration = Duration::from_secs(3);
/// The prefix of every box's container id, so leftovers are recognised.
const ID_PREFIX: &str = "kiln-";

/// Where boxes live and what starts them.
#[derive(Debug, Clone)]
pub struct BoxesConfig {
    /// Runtime state: boxes' folders and the container runtime's state. Default `/run/kiln`.
    pub state_dir: PathBuf,
    /// The guest agent binary (static).
    pub agent: PathBuf,
    /// The container runtime boxes run under unless their template names one (`runc`, or
    /// gVisor's `runsc`).
    pub runtime: PathBuf,
    /// The other one (runsc where `runtime` is runc, and the reverse), for templates that
    /// name it; `None`: not installed here.
    pub alternate: Option<PathBuf>,
    /// Host uid that a box's root maps to.
    pub uid_base: u32,
    /// CRIU, which checkpoints a hibernated box's processes (see [`Boxes::criu`]). `None`:
    /// boxes hibernate keeping their files only.
    pub criu: Option<PathBuf>,
    /// What boots the templates run as microVMs ([`crate::vm`]); `None`: no VMs here.
    pub vm: Option<Arc<crate::vm::VmTier>>,
    /// Offer every template under gVisor too (`gvisor-NAME`); runsc must be `runtime` or
    /// `alternate`.
    pub gvisor: bool,
}

/// A box could not be made, or a command could not run in it.
#[derive(Debug, thiserror::Error)]
pub enum BoxError {
    #[error("the Linux backend cannot run here: {0}")]
    Unavailable(String),
    #[error("starting the box failed at {step}: {message}")]
    Start { step: &'static str, message: String },
    #[error(transparent)]
    Gone(#[from] ChannelClosed),
    #[error("{0}")]
    Refused(String),
}

/// The boxes of one kiln process.
#[derive(Debug, Clone)]
pub struct Boxes {
    config: BoxesConfig,
    cgroups: Cgroups,
    boxes_dir: PathBuf,
    /// This process's folder of the state directory (each runtime keeps its state in a
    /// folder of it named after the runtime).
    mine: PathBuf,
    /// This process's claim on its folder of the state directory, held while it lives.
    _claim: Arc<std::fs::File>,
    /// Whether CRIU checkpoints here, asked once.
    criu: Arc<std::sync::OnceLock<Result<PathBuf, String>>>,
    /// microVM snapshots being made or made (one at a time).
    snapshots: Arc<tokio::sync::Mutex<()>>,
    /// Box removals finishing in the background.
    removals: Arc<Removals>,
}

/// What a box is made of.
#[derive(Debug, Clone)]
pub struct BoxSpec {
    pub template: Template,
    /// A host folder bound at the template's working dir.
    pub workspace: Option<PathBuf>,
    pub limits: BoxLimits,
    /// `None`: no network at all. Otherwise what its proxy lets it reach (the operator's
    /// list and the sandbox's rules, which may change while it runs).
    pub network: Option<Arc<proxy::LiveEgress>>,
    /// A host CA bundle bound over the box's (for hosts behind a TLS-inspecting proxy).
    pub ca_bundle: Option<PathBuf>,
    /// The template's root filesystem itself is the box's root, written in place (no
    /// overlay, no capped layer): only a template build, whose folder is a staging copy.
    pub in_place: bool,
    /// A host folder that keeps what the box writes outside its workspace (the overlay's
    /// upper layer), across boxes: on the sandbox's volume. `None`: a tmpfs of the box's own,
    /// of `limits.disk_bytes`, gone with the box.
    pub layer: Option<PathBuf>,
    /// Host folders bound into the box (the sandbox's named volumes).
    pub mounts: Vec<kiln_core::Mount>,
}

impl BoxSpec {
    /// A box of `template` with no workspace and no network.
    pub fn new(template: Template, limits: BoxLimits) -> BoxSpec {
        BoxSpec {
            template,
            workspace: None,
            limits,
            network: None,
            ca_bundle: None,
            in_place: false,
            layer: None,
            mounts: Vec::new(),
        }
    }
}

/// Where a box's CA bundle is (Debian's).
const CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// Where distributions keep the system's CA bundle, in the order OpenSSL-based tools look:
/// Debian and Ubuntu, Fedora and RHEL, openSUSE, Alpine and the BSDs.
pub const HOST_CA_BUNDLES: [&str; 4] = [
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/ssl/cert.pem",
];

/// The CA bundle this host's own tools trust, found as they find it: `SSL_CERT_FILE`, then
/// the first of [`HOST_CA_BUNDLES`] that exists. Boxes get it by default, so what the host
/// trusts (a TLS-inspecting proxy's CA among it) the box trusts too.
pub fn host_ca_bundle() -> Option<PathBuf> {
    find_ca_bundle(std::env::var_os("SSL_CERT_FILE"), &HOST_CA_BUNDLES)
}

/// The first of `ssl_cert_file` (where set, not empty) and `candidates` that is a readable
/// regular file (links followed: the box is given the file itself).
pub fn find_ca_bundle<P: AsRef<Path>>(
    ssl_cert_file: Option<std::ffi::OsString>,
    candidates: &[P],
) -> Option<PathBuf> {
    let named = ssl_cert_file.filter(|p| !p.is_empty()).map(PathBuf::from);
    named
        .into_iter()
        .chain(candidates.iter().map(|p| p.as_ref().to_path_buf()))
        .find_map(|path| {
            let real = path.canonicalize().ok()?;
            let file = std::fs::File::open(&real).ok()?;
            file.metadata().ok()?.is_file().then_some(real)
        })
}

/// One command to run in a box.
#[derive(Debug, Clone)]
pub struct Exec {
    pub argv: Vec<String>,
    /// Added to the template's environment.
    pub env: Vec<(String, String)>,
    /// Default: the template's working dir.
    pub cwd: Option<String>,
    /// Run as the box's root (namespaced) instead of its user.
    pub root: bool,
    pub stdin: Vec<u8>,
    pub timeout: Duration,
    /// Bytes of stdout and of stderr kept.
    pub max_output: usize,
}

impl Exec {
    pub fn new(argv: Vec<String>) -> Exec {
        Exec {
            argv,
            env: Vec::new(),
            cwd: None,
            root: false,
            stdin: Vec::new(),
            timeout: Duration::from_secs(30),
            max_output: 1 << 20,
        }
    }
}

/// How a command ended.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExecOutput {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    /// The exit code, when it exited.
    pub exit_code: Option<i32>,
    /// The signal that killed it.
    pub signal: Option<i32>,
    pub timed_out: bool,
    /// Killed by the out-of-memory killer (the box's memory limit).
    pub oom_killed: bool,
}

impl ExecOutput {
    /// Takes one reply of a running command, keeping at most `max_output` bytes of each
    /// stream; true once the command exited.
    fn take(
        &mut self,
        reply: Reply,
        max_output: usize,
        on_output: &mut impl FnMut(bool, &[u8]),
    ) -> Result<bool, BoxError> {
        match reply {
            Reply::Spawned { .. } => Ok(false),
            Reply::Output { stderr, data } => {
                on_output(stderr, &data);
                let (buf, truncated) = if stderr {
                    (&mut self.stderr, &mut self.stderr_truncated)
                } else {
                    (&mut self.stdout, &mut self.stdout_truncated)
                };
                let room = max_output.saturating_sub(buf.len());
                buf.extend_from_slice(&data[..data.len().min(room)]);
                *truncated |= data.len() > room;
                Ok(false)
            }
            Reply::Exited { code, signal } => {
                self.exit_code = code;
                self.signal = signal;
                Ok(true)
            }
            Reply::Failed(failure) => Err(BoxError::Refused(failure.message)),
            other => Err(BoxError::Refused(format!(
                "the agent answered a spawn with {other:?}"
            ))),
        }
    }
}

/// How a microVM starts: booted cold, as a snapshot's template, or as a clone of one.
#[derive(Debug, Clone, PartialEq, Eq)]
enum VmPlan {
    Own,
    Template(PathBuf),
    Clone(PathBuf),
}

/// A running box.
#[derive(Debug)]
pub struct LiveBox {
    pub id: String,
    dir: PathBuf,
    channel: Arc<Channel>,
    /// Proxy variables and CA paths every command gets.
    network_env: Vec<(String, String)>,
    /// What its proxy applies (`None`: it has no network).
    egress: Option<Arc<proxy::LiveEgress>>,
    cgroup: String,
    cgroups: Cgroups,
    runtime: PathBuf,
    runtime_root: PathBuf,
    template: Template,
    /// The agent's pid on the host.
    pub host_pid: i32,
    /// Which box this is, kept over checkpoints: a box restored from a checkpoint has the
    /// lineage of the box checkpointed, so a process started in one is known in the other.
    pub lineage: u64,
    /// Set once [`LiveBox::close`] has removed the box.
    closed: std::sync::atomic::AtomicBool,
    removals: Arc<Removals>,
    /// A microVM (QEMU in the jail) rather than a box.
    vm: bool,
}

impl Drop for LiveBox {
    /// A box dropped without [`LiveBox::close`] (a panic, an early return) is still removed:
    /// its agent sees the channel close and kills what it started, and its container,
    /// cgroup, layers and folder go here (blocking, briefly).
    fn drop(&mut self) {
        if !self.closed.load(std::sync::atomic::Ordering::Acquire) {
            destroy(
                &self.runtime,
                &self.runtime_root,
                &self.id,
                &self.dir,
                self.host_pid,
            );
        }
    }
}

/// What a snapshot's RAM and state files were when it was made: each one's inode, size,
/// modification and change times (a write or a replacement of any kind moves them). Not
/// following links.
fn snapshot_fingerprint(dir: &Path) -> String {
    use std::os::unix::fs::MetadataExt;
    ["ram", "state"]
        .map(|name| {
            std::fs::symlink_metadata(dir.join(name)).map_or_else(
                |_| "missing".into(),
                |m| {
                    format!(
                        "{} {} {}.{} {}.{}",
                        m.ino(),
                        m.len(),
                        m.mtime(),
                        m.mtime_nsec(),
                        m.ctime(),
                        m.ctime_nsec()
                    )
                },
            )
        })
        .join(" / ")
}

/// Where a VM's writable layer image is: on the sandbox's volume (beside what a box would
/// keep there, within its cap) where it has one, else in the box's folder.
/// Makes the folder `path` where it is missing; an error where something else is there
/// (a file, a link: never followed).
fn kept_folder(path: &Path) -> Result<(), BoxError> {
    match std::fs::create_dir(path) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
            return Err(start_err("layer")(format!("{}: {e}", path.display())));
        }
        _ => {}
    }
    let kind = std::fs::symlink_metadata(path)
        .map_err(|e| start_err("layer")(format!("{}: {e}", path.display())))?;
    if !kind.is_dir() {
        return Err(start_err("layer")(format!(
            "{} is not a folder",
            path.display()
        )));
    }
    Ok(())
}

fn vm_layer(dir: &Path, spec: &BoxSpec) -> PathBuf {
    spec.layer
        .as_ref()
        .map_or_else(|| dir.join("layer.img"), |layer| layer.join("vm-layer.img"))
}

/// The VM a box of `spec` is, as its VMM is told: `image` its root image, `run` the folder
/// the VMM writes its sockets and console log in, `cgroup` the box's.
#[allow(clippy::too_many_arguments)]
fn vm_spec<'a>(
    tier: &'a crate::vm::VmTier,
    spec: &'a BoxSpec,
    plan: &'a VmPlan,
    image: &'a Path,
    layer: &'a Path,
    run: &'a Path,
    cgroup: &'a str,
    uid_base: u32,
) -> crate::vm::VmSpec<'a> {
    crate::vm::VmSpec {
        memory: match plan {
            VmPlan::Own => crate::vm::VmMemory::Own,
            VmPlan::Template(snapshot) => crate::vm::VmMemory::Template { snapshot },
            VmPlan::Clone(snapshot) => crate::vm::VmMemory::Clone { snapshot },
        },
        vmm: &*tier.vmm,
        accel: tier.accel,
        vmlinux: &tier.vmlinux,
        initrd: &tier.initrd,
        root_image: image,
        layer,
        workspace: spec.workspace.as_deref(),
        working_dir: &spec.template.definition.working_dir,
        run_dir: run,
        limits: spec.limits,
        uid_base,
        cgroup,
    }
}

fn start_err(step: &'static str) -> impl Fn(String) -> BoxError {
    move |message| BoxError::Start { step, message }
}

fn cstr(path: &Path) -> CString {
    CString::new(path.as_os_str().as_encoded_bytes()).unwrap_or_default()
}

fn mount(
    source: &str,
    target: &Path,
    fstype: &str,
    flags: libc::c_ulong,
    data: &str,
) -> Result<(), String> {
    let (source_c, fstype_c, data_c) = (
        CString::new(source).unwrap_or_default(),
        CString::new(fstype).unwrap_or_default(),
        CString::new(data).map_err(|_| "a mount option holds a NUL".to_string())?,
    );
    let target_c = cstr(target);
    // SAFETY: the four strings are NUL-terminated CStrings alive until after the call, which only
    // reads them (`data_c` through the untyped pointer mount(2) takes for its options); `flags` is
    // an integer.
    let rc = unsafe {
        libc::mount(
            source_c.as_ptr(),
            target_c.as_ptr(),
            fstype_c.as_ptr(),
            flags,
            data_c.as_ptr().cast(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(format!(
            "mount {fstype} on {}: {}",
            target.display(),
            std::io::Error::last_os_error()
        ))
    }
}

/// Binds `host` (a folder of kiln's data dir: a workspace, a named volume) at
/// `dir/binds/NAME`, the path the box's bundle names in its place. The data dir may be
/// closed to everyone but root (0700: the default under /root, a `mktemp -d`), which runc
/// does not mind (it binds as root), but CRIU restores a box's bind mounts as the box's
/// root: through the box's folder (0711) it reaches them, and a hibernated box or a
/// snapshot's copy comes back. [`unbridge`] undoes it.
fn bridge(dir: &Path, name: &str, host: &Path) -> Result<String, BoxError> {
    use std::os::unix::fs::DirBuilderExt;
    let binds = dir.join("binds");
    if !binds.is_dir() {
        std::fs::DirBuilder::new()
            .mode(0o711)
            .create(&binds)
            .map_err(|e| start_err("binds")(format!("{}: {e}", binds.display())))?;
    }
    let target = binds.join(name);
    std::fs::DirBuilder::new()
        .mode(0o711)
        .create(&target)
        .map_err(|e| start_err("binds")(format!("{}: {e}", target.display())))?;
    mount(&host.to_string_lossy(), &target, "", libc::MS_BIND, "")
        .map_err(|e| start_err("binds")(format!("{}: {e}", host.display())))?;
    Ok(target.to_string_lossy().into_owned())
}

/// Unmounts and removes a box's [`bridge`]s; false when one could not be (still mounted:
/// then the box's folder must not be removed, or the removal would reach into the data).
fn unbridge(dir: &Path) -> bool {
    let binds = dir.join("binds");
    let Ok(entries) = std::fs::read_dir(&binds) else {
        return true;
    };
    let mut all = true;
    for entry in entries.flatten() {
        let path = entry.path();
        unmount(&path);
        // rmdir, not a recursive removal: a folder still mounted (or not empty) stays.
        all &= std::fs::remove_dir(&path).is_ok();
    }
    all && std::fs::remove_dir(&binds).is_ok()
}

fn unmount(target: &Path) {
    let target = cstr(target);
    // SAFETY: `target` is a NUL-terminated CString alive for the call, which only reads it.
    unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
}

pub(crate) fn random_bytes() -> [u8; 8] {
    let mut bytes = [0u8; 8];
    let _ = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes));
    bytes
}

fn random_id() -> String {
    format!("{ID_PREFIX}{}", hex::encode(random_bytes()))
}

/// A checkpoint of a box to restore: its images (CRIU's, written by
/// [`LiveBox::checkpoint`]), the lineage of the box they were taken of and what its
/// channel had open.
#[derive(Debug, Clone)]
pub struct Restore<'a> {
    pub images: &'a Path,
    pub lineage: u64,
    pub carried: &'a crate::channel::Carried,
}

impl Boxes {
    /// Checks that boxes can run here and removes what a previous kiln left behind.
    /// The host uid and gid of a box's user (`user`, uid 1000 inside): who a sandbox's
    /// workspace belongs to.
    pub fn user_owner(&self) -> (u32, u32) {
        let id = self.config.uid_base + USER_UID;
        (id, id)
    }

    /// The host uid of a box's root: who may read a box's checkpoint images (CRIU restores
    /// the box's processes as it).
    pub fn root_uid(&self) -> u32 {
        self.config.uid_base
    }

    pub fn new(config: BoxesConfig) -> Result<Boxes, BoxError> {
        // SAFETY: geteuid(2) takes no arguments, touches no memory of ours and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            return Err(BoxError::Unavailable(
                "Linux sandboxes need kiln to run as root (it maps each box to an unprivileged uid range)".into(),
            ));
        }
        if !config.agent.is_file() {
            return Err(BoxError::Unavailable(format!(
                "the guest agent {} is missing (build it with scripts/build-guest)",
                config.agent.display()
            )));
        }
        let version = Command::new(&config.runtime).arg("--version").output();
        if !version.is_ok_and(|o| o.status.success()) {
            return Err(BoxError::Unavailable(format!(
                "the container runtime {} does not run (apt-get install runc)",
                config.runtime.display()
            )));
        }
        // Box agents are orphaned when runc exits: they become kiln's children (and are
        // reaped when their box closes) instead of the host init's.
        // SAFETY: PR_SET_CHILD_SUBREAPER takes integer arguments only and touches no memory of
        // ours.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
        let unavailable = |dir: &Path, e: std::io::Error| {
            BoxError::Unavailable(format!("{}: {e}", dir.display()))
        };
        let make = |dir: &Path| {
            std::fs::create_dir_all(dir)
                .and_then(|()| {
                    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))
                })
                .map_err(|e| unavailable(dir, e))
        };
        if config.gvisor
            && !is_gvisor(&config.runtime)
            && !config.alternate.as_deref().is_some_and(is_gvisor)
        {
            return Err(BoxError::Unavailable(
                "--gvisor offers templates under gVisor, and runsc is not installed here (apt-get install runsc)".into(),
            ));
        }
        make(&config.state_dir)?;
        remove_stale_cgroups(Cgroups::detect());
        remove_abandoned(
            [Some(config.runtime.as_path()), config.alternate.as_deref()],
            &config.state_dir,
        );
        // Each kiln process has a folder of its own in the state directory, claimed with a
        // lock held for its life: kilns sharing the directory never touch each other's
        // boxes, and a folder whose lock is free belongs to a kiln that died.
        let mine = config
            .state_dir
            .join(format!("{PROCESS_PREFIX}{}", std::process::id()));
        make(&mine)?;
        let claim = claim(&mine).map_err(|e| unavailable(&mine, e))?;
        let boxes_dir = mine.join("boxes");
        make(&boxes_dir)?;
        for runtime in [Some(&config.runtime), config.alternate.as_ref()]
            .into_iter()
            .flatten()
        {
            make(&runtime_root(&mine, runtime))?;
        }
        Ok(Boxes {
            cgroups: Cgroups::detect(),
            config,
            boxes_dir,
            mine,
            _claim: Arc::new(claim),
            criu: Arc::default(),
            snapshots: Arc::default(),
            removals: Arc::default(),
        })
    }

    /// The CRIU that checkpoints boxes here: the configured one, if `criu check` passes
    /// (asked once); otherwise why not, in words for a user.
    pub fn criu(&self) -> Result<&Path, &str> {
        self.criu
            .get_or_init(|| {
                let Some(criu) = self.config.criu.clone() else {
                    return Err(
                        "kiln has no CRIU to checkpoint them with (--criu none, or none was found: scripts/build-criu builds one)"
                            .into(),
                    );
                };
                match Command::new(&criu)
                    .arg("check")
                    .stdin(Stdio::null())
                    .output()
                {
                    Err(e) => Err(format!(
                        "CRIU ({}) does not run: {e} (scripts/build-criu builds it)",
                        criu.display()
                    )),
                    Ok(out) if out.status.success() => Ok(criu),
                    Ok(out) => {
                        let said = String::from_utf8_lossy(&out.stderr);
                        let last = said
                            .lines()
                            .rev()
                            .find(|l| !l.trim().is_empty())
                            .unwrap_or("it failed")
                            .trim()
                            .to_string();
                        Err(format!(
                            "this host's CRIU ({}) cannot checkpoint (`criu check`: {last}); scripts/build-criu builds one that can",
                            criu.display()
                        ))
                    }
                }
            })
            .as_deref()
            .map_err(String::as_str)
    }

    /// The host's cgroup layout.
    /// What boots microVMs here, if this kiln runs them.
    pub fn vm_tier(&self) -> Option<&crate::vm::VmTier> {
        self.config.vm.as_deref()
    }

    pub fn cgroups(&self) -> Cgroups {
        self.cgroups
    }

    /// The container runtime a box of `template` runs under: the one it names, else the
    /// server's. A microVM's VMM is jailed by runc whatever the default is.
    pub fn runtime_for(&self, template: &Template) -> Result<&Path, BoxError> {
        let wanted = if template.vm {
            Some(crate::template::BoxRuntime::Runc)
        } else {
            template.box_runtime()
        };
        let Some(wanted) = wanted else {
            return Ok(&self.config.runtime);
        };
        let gvisor = wanted == crate::template::BoxRuntime::Runsc;
        [Some(&self.config.runtime), self.config.alternate.as_ref()]
            .into_iter()
            .flatten()
            .find(|runtime| is_gvisor(runtime) == gvisor)
            .map(PathBuf::as_path)
            .ok_or_else(|| {
                BoxError::Unavailable(format!(
                    "{} runs {} {}, which is not installed here (apt-get install {})",
                    template.definition.name,
                    if template.vm {
                        "its VMM in a jail of"
                    } else {
                        "its boxes under"
                    },
                    wanted.name(),
                    wanted.name()
                ))
            })
    }

    /// Waits (up to `within`) for the removals of closed boxes that go on in the background.
    pub async fn settled(&self, within: Duration) {
        self.removals.settled(within).await;
    }

    /// What boots microVMs here, or the refusal a VM template meets without it.
    fn vm_tier_or_refuse(&self) -> Result<&crate::vm::VmTier, BoxError> {
        self.config.vm.as_deref().ok_or_else(|| {
            BoxError::Unavailable("this kiln runs no microVMs (start it with --vm)".into())
        })
    }

    /// Whether this kiln offers every template under gVisor too (`gvisor-NAME`).
    pub fn offers_gvisor(&self) -> bool {
        self.config.gvisor
    }

    /// Whether a box of `template` would run under gVisor.
    pub fn is_gvisor_for(&self, template: &Template) -> bool {
        self.runtime_for(template).is_ok_and(is_gvisor)
    }

    /// Starts a box.
    pub async fn open(&self, spec: BoxSpec) -> Result<LiveBox, BoxError> {
        self.open_from(spec, None).await
    }

    /// Starts a box from a checkpoint of one (taken with [`LiveBox::checkpoint`] of a box
    /// of the same spec, whose layer `spec.layer` kept): its processes go on where they were.
    /// The images are read, not removed.
    pub async fn restore(&self, spec: BoxSpec, from: Restore<'_>) -> Result<LiveBox, BoxError> {
        if spec.layer.is_none() {
            return Err(BoxError::Refused(
                "only a box whose layer outlives it (on a sandbox's volume) can be restored".into(),
            ));
        }
        self.open_from(spec, Some(from)).await
    }

    async fn open_from(
        &self,
        spec: BoxSpec,
        from: Option<Restore<'_>>,
    ) -> Result<LiveBox, BoxError> {
        // A microVM is a clone of its template's snapshot (made on first need); if no snapshot
        // can be made, it boots cold, said in the log.
        let plan = if spec.template.vm && from.is_none() && !spec.in_place {
            match self.vm_snapshot(&spec).await {
                Ok(snapshot) => VmPlan::Clone(snapshot),
                Err(e) => {
                    tracing::warn!(template = %spec.template.definition.name, "no microVM snapshot, so a cold boot: {e}");
                    VmPlan::Own
                }
            }
        } else {
            VmPlan::Own
        };
        let live = self.open_planned(spec.clone(), from, plan.clone()).await?;
        if let VmPlan::Clone(_) = plan {
            live.thaw(spec.workspace.is_some()).await?;
        }
        Ok(live)
    }

    /// The snapshot clones of `spec`'s template VM start from: its folder (`ram` and `state`),
    /// made now if there is none (a template VM booted cold and warmed, then migrated with
    /// `x-ignore-shared`: its RAM stays in the file, only the devices' state is written).
    async fn vm_snapshot(&self, spec: &BoxSpec) -> Result<PathBuf, BoxError> {
        use sha2::{Digest, Sha256};
        let tier = self.config.vm.as_ref().ok_or_else(|| {
            BoxError::Unavailable("this kiln runs no microVMs (start it with --vm)".into())
        })?;
        let key = serde_json::json!([
            spec.template.definition.name,
            spec.template.built.hash,
            spec.template.rootfs,
            spec.limits.memory_bytes >> 20,
            spec.limits.disk_bytes >> 20,
            spec.limits.vcpus,
            spec.limits.pids,
            spec.template.definition.working_dir,
            tier.initrd,
            tier.accel.name(),
            tier.vmm.name(),
            tier.vmm.binary(),
        ]);
        let digest = hex::encode(Sha256::digest(key.to_string().as_bytes()));
        let dir = self.config.state_dir.join("vm/snapshots").join(format!(
            "{}-{}",
            spec.template.definition.name,
            &digest[..16]
        ));
        let _one_at_a_time = self.snapshots.lock().await;
        if let Ok(recorded) = std::fs::read_to_string(dir.join("complete")) {
            // A clone maps the RAM file copy-on-write, so it never changes it; a VMM that
            // wrote to it anyway (a guest that broke out into QEMU) would change its times.
            // Such a snapshot is never cloned again: it is made anew.
            if recorded == snapshot_fingerprint(&dir) {
                return Ok(dir);
            }
            tracing::warn!(snapshot = %dir.display(), "a microVM snapshot's memory file changed since it was made: made anew");
        }
        let _ = std::fs::remove_dir_all(&dir);
        let base = self.config.uid_base;
        let empty = dir.join("empty");
        std::fs::create_dir_all(&empty)
            .and_then(|()| std::os::unix::fs::chown(&dir, Some(base), Some(base)))
            .and_then(|()| std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)))
            .map_err(|e| start_err("snapshot")(format!("{}: {e}", dir.display())))?;
        let template_spec = BoxSpec {
            // A VMM that shares folders gets the snapshot's device for them (empty).
            workspace: tier.vmm.shares_folders().then_some(empty),
            layer: None,
            network: None,
            ..spec.clone()
        };
        let live = self
            .open_planned(template_spec, None, VmPlan::Template(dir.clone()))
            .await?;
        // Warmed as a pool member is: its shell and C library in the page cache.
        let mut warm = Exec::new(vec!["sh".into(), "-c".into(), "true".into()]);
        warm.timeout = Duration::from_secs(60);
        live.exec(warm, |_, _| {}).await?;
        let taken = match tier.vmm.snapshot(&live.dir.join("run")).await {
            // The template VM's disk as it stopped: what every clone's memory expects.
            Ok(()) => crate::vm::copy_layer(&live.dir.join("layer.img"), &dir.join("layer.img"), 0),
            Err(e) => Err(e),
        };
        live.close().await;
        taken.map_err(start_err("snapshot"))?;
        // The template VM is gone: its folder is root's again (clones get the RAM file
        // alone, bound in), and what it was is recorded.
        // The folder was the template VM's VMM's (bound in) while it ran: what clones bind
        // must be plain files, not links it left, and the record is made anew, not
        // written through whatever is there.
        std::os::unix::fs::chown(&dir, Some(0), Some(0))
            .map_err(|e| start_err("snapshot")(e.to_string()))?;
        for name in ["ram", "state", "layer.img"] {
            let plain = std::fs::symlink_metadata(dir.join(name)).is_ok_and(|m| m.is_file());
            if !plain {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(start_err("snapshot")(format!(
                    "the snapshot's {name} is not a plain file: the snapshot was discarded"
                )));
            }
        }
        let _ = std::fs::remove_file(dir.join("complete"));
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(dir.join("complete"))
            .and_then(|mut f| {
                std::io::Write::write_all(&mut f, snapshot_fingerprint(&dir).as_bytes())
            })
            .map_err(|e| start_err("snapshot")(e.to_string()))?;
        tracing::info!(template = %spec.template.definition.name, "made a microVM snapshot for clones");
        Ok(dir)
    }

    async fn open_planned(
        &self,
        spec: BoxSpec,
        from: Option<Restore<'_>>,
        plan: VmPlan,
    ) -> Result<LiveBox, BoxError> {
        let id = random_id();
        let dir = self.boxes_dir.join(&id);
        let runtime = self.runtime_for(&spec.template)?.to_path_buf();
        let runtime_root = runtime_root(&self.mine, &runtime);
        let made = Made {
            runtime: runtime.clone(),
            runtime_root: runtime_root.clone(),
            id: id.clone(),
            dir: dir.clone(),
            armed: true,
        };
        let (pipes, host_pid) = {
            let (boxes, id, dir, spec) = (self.clone(), id.clone(), dir.clone(), spec.clone());
            let images = from.as_ref().map(|from| from.images.to_path_buf());
            let plan = plan.clone();
            tokio::task::spawn_blocking(move || {
                boxes.start(&id, &dir, &spec, images.as_deref(), &plan)
            })
            .await
            .map_err(|e| start_err("runtime")(e.to_string()))??
        };
        follow_log(&dir, pipes.log);
        let carried = from
            .as_ref()
            .map(|from| from.carried.clone())
            .unwrap_or_default();
        let vm = spec.template.vm;
        let (channel, mut accepted) = if vm {
            // The VMM's stdin and stdout carry nothing: the agent talks over its serial
            // port (QEMU) or vsock (Firecracker).
            drop((pipes.from_agent, pipes.to_agent));
            let tier = self.vm_tier_or_refuse()?;
            let image = crate::vm::root_image(&spec.template.rootfs, self.config.uid_base)
                .map_err(start_err("image"))?;
            let (run, cgroup) = (dir.join("run"), cgroup_path(&id));
            let layer = vm_layer(&dir, &spec);
            let vm_spec = vm_spec(
                tier,
                &spec,
                &plan,
                &image,
                &layer,
                &run,
                &cgroup,
                self.config.uid_base,
            );
            let socket = tier.vmm.boot(&vm_spec).await.map_err(|e| {
                start_err(if matches!(plan, VmPlan::Clone(_)) {
                    "restore"
                } else {
                    "vm"
                })(format!("{e}; its log: {}", log_tail(&dir)))
            })?;
            let (read, write) = socket.into_split();
            Channel::resumed(read, write, &carried)
        } else {
            let read = tokio::net::unix::pipe::Receiver::from_owned_fd(pipes.from_agent)
                .map_err(|e| start_err("channel")(e.to_string()))?;
            let write = tokio::net::unix::pipe::Sender::from_owned_fd(pipes.to_agent)
                .map_err(|e| start_err("channel")(e.to_string()))?;
            Channel::resumed(read, write, &carried)
        };
        let channel = Arc::new(channel);
        let mut hello = channel.call(Op::Hello).await?;
        let hello_timeout = if vm { VM_HELLO_TIMEOUT } else { HELLO_TIMEOUT };
        let log_tail = |dir: &Path| {
            if vm {
                format!(
                    "{}; its console: {}",
                    log_tail(dir),
                    tail_lines(&dir.join("run/console.log"), 8, |_| true)
                )
            } else {
                log_tail(dir)
            }
        };
        match tokio::time::timeout(hello_timeout, hello.next()).await {
            Ok(Some(Reply::Hello { .. })) => {}
            Ok(other) => {
                return Err(start_err("agent")(format!(
                    "the agent answered {other:?}; its log: {}",
                    log_tail(&dir)
                )));
            }
            Err(_) => {
                return Err(start_err("agent")(format!(
                    "no answer in {hello_timeout:?}; its log: {}",
                    log_tail(&dir)
                )));
            }
        }
        let mut network_env = Vec::new();
        if let Some(allow) = &spec.network {
            // A restored agent still listens for the proxy where its box's old one did.
            let accepted = match accepted.take() {
                Some(accepted) => accepted,
                None => channel.listen(proxy::PROXY_PORT).await?,
            };
            tokio::spawn(proxy::serve(channel.clone(), accepted, allow.clone()));
            // SOCKS5 on the same port, for TCP other than HTTP(S) (`curl --socks5-hostname`,
            // `ssh -o ProxyCommand='nc -X 5 -x 127.0.0.1:3128 %h %p'`).
            network_env.push((
                "KILN_SOCKS_PROXY".to_string(),
                format!("socks5h://127.0.0.1:{}", proxy::PROXY_PORT),
            ));
            let url = format!("http://127.0.0.1:{}", proxy::PROXY_PORT);
            for key in ["http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"] {
                network_env.push((key.to_string(), url.clone()));
            }
            for key in ["no_proxy", "NO_PROXY"] {
                network_env.push((key.to_string(), "localhost,127.0.0.1,::1".to_string()));
            }
        }
        if spec.ca_bundle.is_some() {
            for key in [
                "SSL_CERT_FILE",
                "REQUESTS_CA_BUNDLE",
                "PIP_CERT",
                "NODE_EXTRA_CA_CERTS",
            ] {
                network_env.push((key.to_string(), CA_BUNDLE.to_string()));
            }
        }
        let mut made = made;
        made.armed = false;
        Ok(LiveBox {
            network_env,
            egress: spec.network.clone(),
            cgroup: cgroup_path(&id),
            id,
            dir,
            channel,
            cgroups: self.cgroups,
            runtime,
            runtime_root,
            template: spec.template,
            host_pid,
            lineage: from
                .as_ref()
                .map_or_else(|| u64::from_le_bytes(random_bytes()), |from| from.lineage),
            closed: std::sync::atomic::AtomicBool::new(false),
            removals: self.removals.clone(),
            vm,
        })
    }

    /// Makes the folder, mounts the layers, writes the bundle and runs the container; returns
    /// the host's end of the agent's channel and the agent's host pid.
    fn start(
        &self,
        id: &str,
        dir: &Path,
        spec: &BoxSpec,
        images: Option<&Path>,
        plan: &VmPlan,
    ) -> Result<(AgentPipes, i32), BoxError> {
        for path in [dir, &dir.join("layer"), &dir.join("rootfs")] {
            std::fs::create_dir(path)
                .map_err(|e| start_err("folder")(format!("{}: {e}", path.display())))?;
        }
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))
            .map_err(|e| start_err("folder")(e.to_string()))?;
        if spec.template.vm {
            self.write_vm_bundle(id, dir, spec, plan)?;
            // A clone of QEMU's reads its devices' state from descriptor 3.
            let on_fd3 = self
                .config
                .vm
                .as_ref()
                .is_some_and(|tier| !tier.vmm.clone_reads_state_file());
            let state = match plan {
                VmPlan::Clone(snapshot) if on_fd3 => Some(
                    std::fs::File::open(snapshot.join("state"))
                        .map_err(|e| start_err("restore")(e.to_string()))?,
                ),
                _ => None,
            };
            return self.run_container_with(&spec.template, id, dir, None, state);
        }
        self.mount_layers(dir, spec)?;
        self.write_bundle(id, dir, spec)?;
        self.run_container_with(&spec.template, id, dir, images, None)
    }

    /// Mounts the size-capped tmpfs of the upper layer and the overlay root over the
    /// template.
    fn mount_layers(&self, dir: &Path, spec: &BoxSpec) -> Result<(), BoxError> {
        let base = self.config.uid_base;
        let (layer, rootfs) = (dir.join("layer"), dir.join("rootfs"));
        let nosuid = libc::MS_NOSUID | libc::MS_NODEV;
        if spec.in_place {
            // A template build: its staging root, bound where the runtime (inside the box's
            // user namespace, which cannot see into kiln's cache) finds it.
            let source = spec.template.rootfs.to_string_lossy();
            mount(&source, &rootfs, "", libc::MS_BIND, "").map_err(start_err("root"))?;
            return mount(
                "",
                &rootfs,
                "",
                libc::MS_BIND | libc::MS_REMOUNT | nosuid,
                "",
            )
            .map_err(start_err("root"));
        }
        let (upper, work) = match &spec.layer {
            // The sandbox's own folder on its volume, made once (the volume's root is the
            // host's: the guest reaches only its workspace).
            Some(kept) => {
                for path in [kept.clone(), kept.join("upper"), kept.join("work")] {
                    kept_folder(&path)?;
                }
                std::fs::set_permissions(kept, std::fs::Permissions::from_mode(0o700))
                    .map_err(|e| start_err("layer")(e.to_string()))?;
                (kept.join("upper"), kept.join("work"))
            }
            None => {
                mount(
                    "kiln-layer",
                    &layer,
                    "tmpfs",
                    nosuid,
                    &format!("size={},mode=0711", spec.limits.disk_bytes),
                )
                .map_err(start_err("layer"))?;
                let (upper, work) = (layer.join("upper"), layer.join("work"));
                for path in [&upper, &work] {
                    std::fs::create_dir(path).map_err(|e| start_err("layer")(e.to_string()))?;
                }
                (upper, work)
            }
        };
        std::os::unix::fs::chown(&upper, Some(base), Some(base))
            .and_then(|()| std::fs::set_permissions(&upper, std::fs::Permissions::from_mode(0o755)))
            .map_err(|e| start_err("layer")(e.to_string()))?;
        mount(
            "kiln-root",
            &rootfs,
            "overlay",
            nosuid,
            &format!(
                "lowerdir={},upperdir={},workdir={}",
                spec.template.rootfs.display(),
                upper.display(),
                work.display()
            ),
        )
        .map_err(start_err("overlay"))
    }

    /// Writes the bundle's `config.json` (and gives the box's user its workspace's top
    /// folder).
    fn write_bundle(&self, id: &str, dir: &Path, spec: &BoxSpec) -> Result<(), BoxError> {
        let base = self.config.uid_base;
        if let Some(workspace) = &spec.workspace {
            std::os::unix::fs::lchown(workspace, Some(base + USER_UID), Some(base + USER_UID))
                .map_err(|e| start_err("workspace")(format!("{}: {e}", workspace.display())))?;
        }
        // Folders of kiln's data dir are bound from the box's own folder (see `bridge`).
        let workspace = match &spec.workspace {
            Some(w) => Some(bridge(dir, "workspace", w)?),
            None => None,
        };
        let agent = self.config.agent.to_string_lossy().into_owned();
        let cgroup = cgroup_path(id);
        // The CA bundle is bound from the box's own folder: CRIU restores a box's bind
        // mounts as the box's root, who may not pass through the folder the bundle is kept
        // in (kiln's data dir, 0700), and a hibernated box would not come back.
        let ca_bundle = match &spec.ca_bundle {
            None => None,
            Some(bundle) => {
                let own = dir.join("ca-bundle.pem");
                if std::fs::hard_link(bundle, &own).is_err() {
                    std::fs::copy(bundle, &own).map_err(|e| {
                        start_err("ca bundle")(format!("{}: {e}", bundle.display()))
                    })?;
                    std::fs::set_permissions(&own, std::fs::Permissions::from_mode(0o644))
                        .map_err(|e| start_err("ca bundle")(e.to_string()))?;
                }
                Some((own.to_string_lossy().into_owned(), CA_BUNDLE.to_string()))
            }
        };
        // A writable volume's top folder is the box user's, as the workspace's is.
        let mut binds = Vec::new();
        for (i, mount) in spec.mounts.iter().enumerate() {
            if mount.writable {
                std::os::unix::fs::lchown(
                    &mount.host,
                    Some(base + USER_UID),
                    Some(base + USER_UID),
                )
                .map_err(|e| start_err("volume")(format!("{}: {e}", mount.guest)))?;
            }
            binds.push((
                bridge(dir, &format!("volume-{i}"), &mount.host)?,
                mount.guest.clone(),
                mount.writable,
            ));
        }
        let config = jail::config(&jail::JailSpec {
            hostname: "kiln",
            agent: &agent,
            read_only: ca_bundle.as_slice(),
            binds: &binds,
            workspace: workspace.as_deref(),
            working_dir: &spec.template.definition.working_dir,
            uid_base: base,
            limits: spec.limits,
            cgroup: &cgroup,
        });
        let mut config = config;
        if is_gvisor(self.runtime_for(&spec.template)?) {
            gvisor_bundle(&mut config);
        }
        std::fs::write(dir.join("config.json"), config.to_string())
            .map_err(|e| start_err("bundle")(e.to_string()))
    }

    /// Writes the bundle of a microVM: QEMU in the boxes' jail ([`crate::vm::vmm_config`]),
    /// booting the template's root image (made on first use) with the workspace over 9p.
    fn write_vm_bundle(
        &self,
        id: &str,
        dir: &Path,
        spec: &BoxSpec,
        plan: &VmPlan,
    ) -> Result<(), BoxError> {
        let tier = self.vm_tier_or_refuse()?;
        if spec.in_place {
            return Err(BoxError::Refused("a microVM cannot build templates".into()));
        }
        if spec.workspace.is_some() && !tier.vmm.shares_folders() {
            return Err(BoxError::Refused(format!(
                "{} shares no folder with its VMs (no 9p, no virtio-fs), so this VM cannot have a workspace; a sandbox always has one: run VM sandboxes under QEMU (--vmm qemu)",
                tier.vmm.name()
            )));
        }
        let base = self.config.uid_base;
        let image =
            crate::vm::root_image(&spec.template.rootfs, base).map_err(start_err("image"))?;
        let root = dir.join("rootfs");
        // A snapshot's VMs all have the 9p device (its template's set), shared or not.
        crate::vm::make_vmm_root(
            &root,
            spec.workspace.is_some() || (*plan != VmPlan::Own && tier.vmm.shares_folders()),
        )
        .map_err(|e| start_err("folder")(e.to_string()))?;
        let run = dir.join("run");
        std::fs::create_dir(&run)
            .and_then(|()| std::os::unix::fs::chown(&run, Some(base), Some(base)))
            .and_then(|()| std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o700)))
            .map_err(|e| start_err("folder")(format!("{}: {e}", run.display())))?;
        if let Some(workspace) = &spec.workspace {
            std::os::unix::fs::lchown(workspace, Some(base + USER_UID), Some(base + USER_UID))
                .map_err(|e| start_err("workspace")(format!("{}: {e}", workspace.display())))?;
        }
        let cgroup = cgroup_path(id);
        let agent = self.config.agent.to_string_lossy().into_owned();
        if !spec.mounts.is_empty() {
            return Err(start_err("volume")(
                "a microVM mounts no named volumes yet; use its box template".to_string(),
            ));
        }
        let jail_box = jail::config(&jail::JailSpec {
            hostname: "kiln-vm",
            agent: &agent,
            read_only: &[],
            binds: &[],
            workspace: None,
            working_dir: "/",
            uid_base: base,
            limits: spec.limits,
            cgroup: &cgroup,
        });
        // Its writable layer: a fresh disk, or a copy of its snapshot's as the template VM
        // left it (the clone's memory expects that disk).
        let layer = vm_layer(dir, spec);
        if let Some(kept) = &spec.layer {
            kept_folder(kept)?;
            std::fs::set_permissions(kept, std::fs::Permissions::from_mode(0o700))
                .map_err(|e| start_err("layer")(e.to_string()))?;
        }
        match plan {
            VmPlan::Clone(snapshot) => {
                crate::vm::copy_layer(&snapshot.join("layer.img"), &layer, base)
            }
            _ => crate::vm::make_layer(&layer, spec.limits.disk_bytes, base),
        }
        .map_err(start_err("layer"))?;
        let mut config = crate::vm::vmm_config(
            &vm_spec(tier, spec, plan, &image, &layer, &run, &cgroup, base),
            jail_box,
        );
        config["root"]["readonly"] = serde_json::json!(true);
        std::fs::write(dir.join("config.json"), config.to_string())
            .map_err(|e| start_err("bundle")(e.to_string()))
    }

    /// Runs the container, its agent's stdin, stdout and stderr pipes (not a socket: a pipe
    /// is what a checkpoint of the box can carry over, runc reconnecting it on restore);
    /// answers kiln's ends and the agent's host pid. What runc itself says goes to the same
    /// stderr, and so to `agent.log` when it fails. With `images`, the container is restored
    /// from them (runc hands these pipes to the restored agent in place of its old ones).
    /// Runs the container of a box of `template` from its bundle (or restores it from CRIU's
    /// `images`), handing `fd3` to the container's process as its descriptor 3 (runc's
    /// `--preserve-fds`).
    fn run_container_with(
        &self,
        template: &Template,
        id: &str,
        dir: &Path,
        images: Option<&Path>,
        fd3: Option<std::fs::File>,
    ) -> Result<(AgentPipes, i32), BoxError> {
        let pipe = || std::io::pipe().map_err(|e| start_err("channel")(e.to_string()));
        let (agent_in, to_agent) = pipe()?;
        let (from_agent, agent_out) = pipe()?;
        let (log, agent_err) = pipe()?;
        let pid_file = dir.join("agent.pid");
        let runtime = self.runtime_for(template)?;
        let mut command = runtime_command(runtime, &runtime_root(&self.mine, runtime));
        match images {
            Some(_) if is_gvisor(runtime) => {
                return Err(start_err("restore")(
                    "a gVisor box is not restored with CRIU".into(),
                ));
            }
            None if is_gvisor(runtime) => {
                command.args(["run", "--detach"]);
            }
            None => {
                command.args(["run", "--detach", "--no-new-keyring"]);
                if let Some(file) = &fd3 {
                    use std::os::fd::AsRawFd;
                    use std::os::unix::process::CommandExt;
                    let fd = file.as_raw_fd();
                    command.args(["--preserve-fds", "1"]);
                    // SAFETY: dup2 in the forked child, before exec: an async-signal-safe
                    // system call on a descriptor the parent keeps open until the spawn ends.
                    unsafe {
                        command.pre_exec(move || {
                            if libc::dup2(fd, 3) < 0 {
                                return Err(std::io::Error::last_os_error());
                            }
                            Ok(())
                        });
                    }
                }
            }
            Some(images) => {
                let criu = self
                    .criu()
                    .map_err(|e| start_err("restore")(e.to_string()))?;
                command
                    .arg("--criu")
                    .arg(criu)
                    .args(["restore", "--detach"])
                    .args(CRIU_FLAGS)
                    .arg("--image-path")
                    .arg(images)
                    .arg("--work-path")
                    .arg(images);
            }
        }
        let status = command
            .arg("--pid-file")
            .arg(&pid_file)
            .arg("--bundle")
            .arg(dir)
            .arg(id)
            .stdin(Stdio::from(agent_in))
            .stdout(Stdio::from(agent_out))
            .stderr(Stdio::from(agent_err))
            .status()
            .map_err(|e| start_err("runtime")(e.to_string()));
        // The command holds the agent's ends of its pipes: gone now, so kiln sees the agent's
        // end (and runc's, when it fails) as the pipes closing.
        drop(command);
        let status = status?;
        if !status.success() {
            // runc is gone and started nothing: what it wrote is all there is.
            keep_log(dir, log);
            let criu_said = images
                .map(|images| {
                    format!(
                        " (CRIU's log: {})",
                        criu_log_tail(&images.join("restore.log"))
                    )
                })
                .unwrap_or_default();
            return Err(start_err(if images.is_some() {
                "restore"
            } else {
                "runtime"
            })(format!(
                "{} exited with {status}: {}{criu_said}",
                runtime.display(),
                log_tail(dir)
            )));
        }
        let host_pid = std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or(0);
        if images.is_some() {
            // runc brings a new box's loopback up, not a restored one's (whose server would
            // then answer nothing on 127.0.0.1).
            loopback_up(host_pid).map_err(start_err("restore"))?;
        }
        Ok((
            AgentPipes {
                from_agent: from_agent.into(),
                to_agent: to_agent.into(),
                log: log.into(),
            },
            host_pid,
        ))
    }
}

/// Whether `runtime` is gVisor's `runsc` (by its name), whose flags differ from runc's.
pub fn is_gvisor(runtime: &Path) -> bool {
    runtime
        .file_name()
        .is_some_and(|name| name.to_string_lossy().starts_with("runsc"))
}

/// The gVisor platform boxes run on: `KILN_RUNSC_PLATFORM`, else `ptrace` (which needs no
/// virtualisation; `kvm` wants real VT-x/AMD-V, not this host's PVM).
fn gvisor_platform() -> String {
    std::env::var("KILN_RUNSC_PLATFORM")
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "ptrace".to_string())
}

/// Where `runtime` keeps its state in a kiln process's folder `mine`: runc and runsc each in
/// a folder of their own.
fn runtime_root(mine: &Path, runtime: &Path) -> PathBuf {
    mine.join(if is_gvisor(runtime) { "runsc" } else { "runc" })
}

/// A command of the container runtime over kiln's state folder `root`: runc's flags, or
/// runsc's (its platform, and no network of its own: a box has only its loopback, and
/// reaches the allowlist through its agent as under runc).
fn runtime_command(runtime: &Path, root: &Path) -> Command {
    let mut command = Command::new(runtime);
    command.arg("--root").arg(root);
    if is_gvisor(runtime) {
        // The bundle's seccomp filter is not loaded inside the sandbox (runsc would with
        // `--oci-seccomp`, but this runsc then refuses the agent its threads): the sentry
        // is the wall, under runsc's own filters.
        command
            .arg(format!("--platform={}", gvisor_platform()))
            .arg("--network=none");
    }
    command
}

/// Host tasks a gVisor box's sentry and gofer take for themselves (an idle box has ~60),
/// added to its pids limit: without them a box with a small limit dies when its sentry
/// cannot start a thread, rather than refusing its own process a fork.
const GVISOR_TASKS: u64 = 128;

/// The bundle as gVisor takes it: without the io weight (runsc writes `blkio.weight`,
/// which cgroup v1 hosts with another io scheduler lack; the sentry's io is its own anyway),
/// and room in the pids limit for gVisor's own tasks ([`GVISOR_TASKS`]).
fn gvisor_bundle(config: &mut serde_json::Value) {
    if let Some(resources) = config
        .pointer_mut("/linux/resources")
        .and_then(serde_json::Value::as_object_mut)
    {
        resources.remove("blockIO");
        if let Some(limit) = resources
            .get_mut("pids")
            .and_then(|pids| pids.get_mut("limit"))
            && let Some(n) = limit.as_u64()
        {
            *limit = serde_json::json!(n + GVISOR_TASKS);
        }
    }
}

/// What runc asks of CRIU on a box's checkpoint and restore: connections inside the box
/// (the agent's to a dev server, a preview's) are carried over, as are file locks (a package
/// manager's).
const CRIU_FLAGS: [&str; 2] = ["--tcp-established", "--file-locks"];

/// The last lines of a CRIU log that say what went wrong (its errors, else its end).
fn criu_log_tail(log: &Path) -> String {
    let errors = tail_lines(log, 3, |l| l.contains("Error"));
    let said = if errors.is_empty() {
        tail_lines(log, 3, |_| true)
    } else {
        errors
    };
    if said.is_empty() {
        "empty".to_string()
    } else {
        said
    }
}

/// The last `n` lines of the file at `path` that `keep` accepts, joined with " / ", from
/// its last 64 KiB only (a log may be large; it is never read whole).
fn tail_lines(path: &Path, n: usize, keep: impl Fn(&str) -> bool) -> String {
    use std::io::{Read, Seek, SeekFrom};
    const TAIL: u64 = 64 << 10;
    let mut bytes = Vec::new();
    // Not following a link: a VM's console log is in a folder its (jailed) QEMU writes.
    let opened = {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(path)
    };
    if let Ok(mut file) = opened {
        let len = file.metadata().map_or(0, |m| m.len());
        let _ = file.seek(SeekFrom::Start(len.saturating_sub(TAIL)));
        let _ = file.take(TAIL).read_to_end(&mut bytes);
    }
    let text = String::from_utf8_lossy(&bytes);
    let mut lines: Vec<&str> = text.lines().filter(|l| keep(l)).collect();
    lines.drain(..lines.len().saturating_sub(n));
    lines.join(" / ")
}

/// Brings up the loopback interface in the network namespace of host process `pid` (the
/// kernel gives it 127.0.0.1 and ::1 as it comes up), from a thread that joins the namespace
/// for this alone and then ends.
fn loopback_up(pid: i32) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let namespace = std::fs::File::open(format!("/proc/{pid}/ns/net"))
        .map_err(|e| format!("the box's network namespace: {e}"))?;
    std::thread::spawn(move || {
        let fail = |what: &str| format!("{what}: {}", std::io::Error::last_os_error());
        // SAFETY: setns(2) takes an fd (open for the call) and a flag; it moves only this
        // thread, which ends when this closure returns.
        if unsafe { libc::setns(namespace.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(fail("joining the box's network namespace"));
        }
        // SAFETY: socket(2) takes integers only; the fd it answers is owned below.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(fail("a socket in the box's network namespace"));
        }
        // SAFETY: `fd` is a new socket that nothing else owns.
        let socket = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ifreq is plain data (a name and a union of integers): all zeros is valid.
        let mut request: libc::ifreq = unsafe { std::mem::zeroed() };
        for (to, from) in request.ifr_name.iter_mut().zip(b"lo\0") {
            *to = *from as libc::c_char;
        }
        // SAFETY: SIOCGIFFLAGS and SIOCSIFFLAGS read and write the ifreq they are given, which
        // lives on this stack for both calls; the socket is open.
        unsafe {
            if libc::ioctl(socket.as_raw_fd(), libc::SIOCGIFFLAGS, &mut request) != 0 {
                return Err(fail("reading the box's loopback flags"));
            }
            request.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
            if libc::ioctl(socket.as_raw_fd(), libc::SIOCSIFFLAGS, &request) != 0 {
                return Err(fail("bringing the box's loopback up"));
            }
        }
        Ok(())
    })
    .join()
    .map_err(|_| "bringing the box's loopback up panicked".to_string())?
}

/// Reaps the CRIU helpers left to kiln: a checkpoint's or restore's helper processes that
/// outlive runc are orphaned to kiln (the boxes' subreaper) and would stay zombies. Only
/// exited children of this process named `criu` are waited for (by pid), so no one else's
/// wait is taken.
pub fn reap_criu_helpers() {
    let me = std::process::id().to_string();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // `pid (comm) state ppid …`
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let comm = &stat[open + 1..close];
        let mut rest = stat[close + 1..].split_whitespace();
        let (state, ppid) = (rest.next(), rest.next());
        if comm == "criu" && state == Some("Z") && ppid == Some(me.as_str()) {
            // SAFETY: waitpid(2) on one exited child's pid with a null status pointer (the
            // status is not stored) touches no memory of ours.
            unsafe { libc::waitpid(pid, std::ptr::null_mut(), libc::WNOHANG) };
        }
    }
}

/// kiln's ends of a box agent's stdio.
struct AgentPipes {
    from_agent: OwnedFd,
    to_agent: OwnedFd,
    /// The agent's stderr, kept in `agent.log`.
    log: OwnedFd,
}

/// The most of an agent's stderr `agent.log` keeps.
const MAX_AGENT_LOG: u64 = 1 << 20;

/// Writes what `log` holds to `agent.log` now, up to its end (every writer gone).
fn keep_log(dir: &Path, log: std::io::PipeReader) {
    if let Ok(mut file) = std::fs::File::create(dir.join("agent.log")) {
        let _ = std::io::copy(&mut std::io::Read::take(log, MAX_AGENT_LOG), &mut file);
    }
}

/// Copies an agent's stderr into `agent.log` (its first [`MAX_AGENT_LOG`] bytes) for as
/// long as the box lives; past the cap the rest is read and dropped, so the agent never
/// blocks on it.
fn follow_log(dir: &Path, log: OwnedFd) {
    let path = dir.join("agent.log");
    let Ok(reader) = tokio::net::unix::pipe::Receiver::from_owned_fd(log) else {
        return;
    };
    tokio::spawn(async move {
        let mut reader = tokio::io::AsyncReadExt::take(reader, MAX_AGENT_LOG);
        // Without a log file the agent's words are still read (an agent whose stderr
        // closed would fail on its next line).
        if let Ok(mut file) = tokio::fs::File::create(&path).await {
            let _ = tokio::io::copy(&mut reader, &mut file).await;
        }
        let _ = tokio::io::copy(&mut reader.into_inner(), &mut tokio::io::sink()).await;
    });
}

/// The prefix of each kiln process's folder in the state directory.
const PROCESS_PREFIX: &str = "kiln-process-";

/// Takes the lock that says `folder` belongs to a live kiln: `Ok` holds it (an open file
/// with an exclusive `flock`), an error says another live process holds it.
fn claim(folder: &Path) -> std::io::Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(folder.join("lock"))?;
    // SAFETY: flock(2) takes an fd and flags only; the fd is `file`'s, open while `file` lives.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(file)
}

/// Kills and removes every box of the kiln processes that died leaving them (their
/// containers, mounts and folders); the folders of live kilns are left alone.
fn remove_abandoned(runtimes: [Option<&Path>; 2], state_dir: &Path) {
    let runtimes: Vec<&Path> = runtimes.into_iter().flatten().collect();
    let Ok(entries) = std::fs::read_dir(state_dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let folder = entry.path();
        if !name.starts_with(PROCESS_PREFIX) || !folder.is_dir() {
            continue;
        }
        let Ok(_lock) = claim(&folder) else {
            continue; // a live kiln's
        };
        if let Ok(boxes) = std::fs::read_dir(folder.join("boxes")) {
            for left in boxes.flatten() {
                let id = left.file_name().to_string_lossy().into_owned();
                if !id.starts_with(ID_PREFIX) {
                    continue;
                }
                tracing::warn!(box_id = %id, "removing a box left by a kiln that died");
                // The runtime that ran it is the one whose state names it (runc keeps a
                // folder per container, runsc files that start with its id).
                let ran = |runtime: &&&Path| {
                    std::fs::read_dir(runtime_root(&folder, runtime)).is_ok_and(|mut states| {
                        states.any(|state| {
                            state.is_ok_and(|state| {
                                state.file_name().to_string_lossy().starts_with(&id)
                            })
                        })
                    })
                };
                if let Some(runtime) = runtimes.iter().find(ran).or(runtimes.first()) {
                    destroy(
                        runtime,
                        &runtime_root(&folder, runtime),
                        &id,
                        &left.path(),
                        0,
                    );
                }
            }
        }
        // Only once every box's folder is gone (one left holds a mount into the data).
        let boxes_left = std::fs::read_dir(folder.join("boxes")).is_ok_and(|mut boxes| {
            boxes.any(|b| b.is_ok_and(|b| b.file_name().to_string_lossy().starts_with(ID_PREFIX)))
        });
        if !boxes_left {
            let _ = std::fs::remove_dir_all(&folder);
        }
    }
}

/// Kills a box's processes, deletes its container (and cgroup), unmounts its layers and
/// removes its folder (which then holds only kiln's bundle and empty mount points).
fn destroy(runtime: &Path, runtime_root: &Path, id: &str, dir: &Path, host_pid: i32) {
    end(runtime, runtime_root, id, dir, host_pid);
    remove(runtime, runtime_root, id, dir);
}

/// Ends a box: its processes killed (a VM's VMM with them) and reaped, its layers
/// unmounted. What is left ([`remove`]) is bookkeeping: the runtime's state and cgroup, and
/// the folder.
fn end(runtime: &Path, runtime_root: &Path, id: &str, dir: &Path, host_pid: i32) {
    let cgroups = Cgroups::detect();
    let cgroup = cgroup_path(id);
    // A frozen box's processes cannot die (on v1) until thawed.
    let _ = cgroups.set_frozen(&cgroup, false, KILL_GRACE);
    // Killed from here, every process of the box's cgroup (through pidfds, until the cgroup
    // is empty: a fork in between is caught by the next round), rather than by `runc kill
    // --all`, a process of its own that costs ~10 ms to start. Under gVisor the sentry
    // and what it traces are in the cgroup too: killed and reaped here (orphaned to kiln, the
    // boxes' subreaper), or runsc's delete waits seconds for them to be gone.
    let members = cgroups.processes(&cgroup);
    kill_all_but(cgroups, &cgroup, 0);
    if !cgroups.processes(&cgroup).is_empty() {
        let _ = runtime_command(runtime, runtime_root)
            .args(["kill", "--all", id, "KILL"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
    let started = Instant::now();
    let mut left = members;
    if host_pid > 0 && !left.contains(&host_pid) {
        left.push(host_pid);
    }
    // kiln is the agent's subreaper (see `Boxes::new`): reap what it can, so no zombie is
    // left; a pid that is not kiln's child answers at once.
    while !left.is_empty() && started.elapsed() < KILL_GRACE {
        // SAFETY: waitpid(2) with a null status pointer (the status is not stored) touches no
        // memory of ours; a pid that is not kiln's child answers ECHILD.
        left.retain(|pid| unsafe { libc::waitpid(*pid, std::ptr::null_mut(), libc::WNOHANG) } == 0);
        if !left.is_empty() {
            std::thread::sleep(Duration::from_micros(500));
        }
    }
    unmount(&dir.join("rootfs"));
    unmount(&dir.join("layer"));
    unbridge(dir);
}

/// Removes what is left of an ended box ([`end`]): the runtime's state and the box's cgroup
/// (`delete`), and its folder.
fn remove(runtime: &Path, runtime_root: &Path, id: &str, dir: &Path) {
    let runc = |args: &[&str]| {
        runtime_command(runtime, runtime_root)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
    };
    let started = Instant::now();
    // `delete` without --force, once the processes are gone (runc's forced delete polls in
    // 100 ms steps). runsc's forced delete is its quick one (it stops the sandbox and its
    // gofer at once).
    let mut deleted =
        is_gvisor(runtime) && runc(&["delete", "--force", id]).is_ok_and(|s| s.success());
    while !deleted && started.elapsed() < KILL_GRACE {
        // A container runc removed itself (after a checkpoint) has no state left.
        deleted =
            runc(&["delete", id]).is_ok_and(|s| s.success()) || !runtime_root.join(id).exists();
        if !deleted {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    if !deleted {
        let _ = runc(&["delete", "--force", id]);
    }
    // What the runtime left of the box's cgroup (empty by now, or in a moment).
    Cgroups::detect().remove_empty(&cgroup_path(id), KILL_GRACE);
    if !unbridge(dir) {
        tracing::error!(dir = %dir.display(), "a box's bound folder is still mounted: its folder is left");
        return;
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Removes boxes' cgroups (`/kiln/kiln-*`) that are empty and were made over an hour ago:
/// left by a runtime (or a kiln) that died before removing them. A box being started has
/// its cgroup for seconds only; one in use is not empty, and the kernel keeps it.
fn remove_stale_cgroups(cgroups: Cgroups) {
    let hour_ago = std::time::SystemTime::now() - Duration::from_secs(3600);
    // Every hierarchy's `kiln` folder (they need not all hold the same boxes: v1's
    // `unified` mount holds few), each box once.
    let mut seen = std::collections::HashSet::new();
    let entries = cgroups
        .dirs("/kiln")
        .into_iter()
        .flat_map(|parent| std::fs::read_dir(parent).into_iter().flatten().flatten());
    for entry in entries {
        if !seen.insert(entry.file_name()) {
            continue;
        }
        let name = entry.file_name().to_string_lossy().into_owned();
        let old = entry
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|made| made < hour_ago);
        if name.starts_with(ID_PREFIX) && old && cgroups.processes(&cgroup_path(&name)).is_empty() {
            cgroups.remove_empty(&cgroup_path(&name), Duration::ZERO);
        }
    }
}

/// Box removals still under way in the background ([`LiveBox::destroy_now`] returns once
/// the box has ended): waited for at shutdown ([`Boxes::settled`]).
#[derive(Debug, Default)]
struct Removals {
    under_way: std::sync::Mutex<usize>,
    done: tokio::sync::Notify,
}

impl Removals {
    fn count(&self) -> std::sync::MutexGuard<'_, usize> {
        self.under_way
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Runs `work` on a blocking thread, counted until it is done.
    fn run(self: &Arc<Self>, work: impl FnOnce() + Send + 'static) {
        *self.count() += 1;
        let removals = self.clone();
        tokio::task::spawn_blocking(move || {
            work();
            *removals.count() -= 1;
            removals.done.notify_waiters();
        });
    }

    async fn settled(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let done = self.done.notified();
            if *self.count() == 0 || Instant::now() >= deadline {
                return;
            }
            let _ = tokio::time::timeout(Duration::from_millis(50), done).await;
        }
    }
}

/// What a command is told when the box is at its pids limit: how full it is, and the ways
/// out that exist.
fn full_box_message(current: Option<u64>, max: Option<u64>, said: &str) -> String {
    let how_full = match (current, max) {
        (Some(current), Some(max)) => {
            format!("its {current} tasks (processes and threads) fill its pids limit of {max}")
        }
        (_, Some(max)) => format!("its processes fill its pids limit of {max}"),
        _ => "its processes fill its pids limit".to_string(),
    };
    format!(
        "the box is full: {how_full}, so nothing more can start in it (a fork bomb, or \
         processes an earlier command left running?). End them with `kill -9 -1` from a shell \
         or session already running in the box (a builtin: it needs no new process), or \
         delete the sandbox and create another: its box closes with every process in it \
         (the agent said: {said})"
    )
}

/// Kills the processes of a box's cgroup but `agent`, round after round while new ones
/// appear (a fork bomb forks as it dies), for at most [`KILL_GRACE`]. Each is signalled
/// through a pidfd opened while it is still seen in the box's cgroup, so a pid the host
/// reused meanwhile is never signalled.
fn kill_all_but(cgroups: Cgroups, cgroup: &str, agent: i32) -> usize {
    let started = Instant::now();
    let mut killed = std::collections::HashSet::new();
    let mut pause = Duration::from_micros(200);
    loop {
        let left: Vec<i32> = cgroups
            .processes(cgroup)
            .into_iter()
            .filter(|pid| *pid != agent)
            .collect();
        if left.is_empty() || started.elapsed() > KILL_GRACE {
            return killed.len();
        }
        for pid in left {
            if signal_in_cgroup(pid, cgroup, libc::SIGKILL) {
                killed.insert(pid);
            }
        }
        // Killed processes leave the cgroup as they exit: soon, looked at often at first.
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(1));
    }
}

/// Sends `signal` to host process `pid` if it is (still) in `cgroup`.
fn signal_in_cgroup(pid: i32, cgroup: &str, signal: i32) -> bool {
    // SAFETY: pidfd_open takes two integers and touches no memory of ours; it answers a new
    // fd (owned below) or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return false;
    }
    // SAFETY: `fd` is a new pidfd that nothing else owns; the OwnedFd closes it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    // The pidfd names one process for good: check that this one is the box's.
    let member = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).is_ok_and(|text| {
        text.lines().any(|line| {
            line.rsplit_once(':')
                .is_some_and(|(_, path)| path == cgroup)
        })
    });
    if !member {
        return false;
    }
    // SAFETY: pidfd_send_signal reads only its integer arguments (a null siginfo is allowed:
    // the kernel fills one as kill(2) would); `fd` is open for the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            signal,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    rc == 0
}

fn cgroup_path(id: &str) -> String {
    format!("/kiln/{id}")
}

fn log_tail(dir: &Path) -> String {
    tail_lines(&dir.join("agent.log"), 6, |_| true)
}

/// Removes a half-made box when starting it fails.
struct Made {
    runtime: PathBuf,
    runtime_root: PathBuf,
    id: String,
    dir: PathBuf,
    armed: bool,
}

impl Drop for Made {
    fn drop(&mut self) {
        if self.armed {
            destroy(&self.runtime, &self.runtime_root, &self.id, &self.dir, 0);
        }
    }
}

impl LiveBox {
    /// The template the box runs.
    pub fn template(&self) -> &Template {
        &self.template
    }

    /// The environment a command starts with: the template's, the user's identity, then
    /// the request's.
    fn environment(&self, exec: &Exec) -> Vec<(String, String)> {
        let (home, user) = if exec.root {
            ("/root", "root")
        } else {
            (USER_HOME, USER_NAME)
        };
        let mut env = vec![
            (
                "PATH".to_string(),
                format!(
                    "{home}/.local/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
                ),
            ),
            ("HOME".into(), home.into()),
            ("USER".into(), user.into()),
            ("LOGNAME".into(), user.into()),
            (
                "SHELL".into(),
                self.template.definition.default_shell.clone(),
            ),
            ("TMPDIR".into(), "/tmp".into()),
        ];
        let mut set = |key: &str, value: &str| {
            env.retain(|(k, _)| k != key);
            env.push((key.to_string(), value.to_string()));
        };
        for (key, value) in &self.template.definition.env {
            set(key, value);
        }
        for (key, value) in &self.network_env {
            set(key, value);
        }
        for (key, value) in &exec.env {
            set(key, value);
        }
        env
    }

    /// Starts a command that keeps running (a session's interpreter), its stdin open: its
    /// replies (output, then its exit), to be read by the caller.
    pub async fn spawn(&self, exec: &Exec) -> Result<crate::channel::Replies, BoxError> {
        let spawn = self.spawn_request(exec, true);
        let mut replies = self.channel.call(Op::Spawn(spawn)).await?;
        match replies.next().await {
            Some(Reply::Spawned { .. }) => Ok(replies),
            Some(Reply::Failed(failure)) => Err(self.refusal(failure)),
            other => Err(BoxError::Refused(format!(
                "the agent answered a spawn with {other:?}"
            ))),
        }
    }

    /// Starts a live process (see [`kiln_core::process`]): its pid inside the box, the
    /// request id that names it for [`LiveBox::write_stdin`] and [`LiveBox::signal`], and
    /// its replies (output, then its exit).
    pub async fn start_process(
        &self,
        exec: &Exec,
        terminal: Option<kiln_guest::proto::WindowSize>,
        stdin: bool,
    ) -> Result<(u32, u64, crate::channel::Replies), BoxError> {
        if exec.argv.is_empty() {
            return Err(BoxError::Refused("a command needs a program".into()));
        }
        let mut spawn = self.spawn_request(exec, stdin || terminal.is_some());
        spawn.terminal = terminal;
        let mut replies = self.channel.call(Op::Spawn(spawn)).await?;
        match replies.next().await {
            Some(Reply::Spawned { pid }) => Ok((pid, replies.id, replies)),
            Some(Reply::Failed(failure)) => Err(self.refusal(failure)),
            other => Err(BoxError::Refused(format!(
                "the agent answered a spawn with {other:?}"
            ))),
        }
    }

    /// Closes a spawned command's stdin.
    pub async fn close_stdin(&self, target: u64) -> Result<(), BoxError> {
        Ok(self.channel.write(target, Vec::new(), true).await?)
    }

    /// Resizes a spawned command's terminal.
    pub async fn resize(
        &self,
        target: u64,
        size: kiln_guest::proto::WindowSize,
    ) -> Result<(), BoxError> {
        Ok(self.channel.tell(Op::Resize { target, size }).await?)
    }

    /// Writes a file inside the box (owned by the box's user), through the agent.
    pub async fn write_file(&self, path: &str, data: Vec<u8>) -> Result<(), BoxError> {
        let mut replies = self
            .channel
            .call(Op::WriteFile {
                path: path.to_string(),
                data,
                append: false,
                mode: 0o644,
                owner: Some(Credentials {
                    uid: USER_UID,
                    gid: USER_UID,
                }),
            })
            .await?;
        match replies.next().await {
            Some(Reply::Done) => Ok(()),
            Some(Reply::Failed(failure)) => Err(self.refusal(failure)),
            other => Err(BoxError::Refused(format!(
                "the agent answered a write with {other:?}"
            ))),
        }
    }

    /// Removes a file inside the box, through the agent (errors are ignored).
    pub async fn remove_file(&self, path: &str) {
        if let Ok(mut replies) = self
            .channel
            .call(Op::Remove {
                path: path.to_string(),
            })
            .await
        {
            let _ = replies.next().await;
        }
    }

    /// Writes to a spawned command's stdin.
    pub async fn write_stdin(&self, target: u64, data: Vec<u8>) -> Result<(), BoxError> {
        Ok(self.channel.write(target, data, false).await?)
    }

    /// Sends a signal to a spawned command's process group.
    pub async fn signal(&self, target: u64, signal: i32) -> Result<(), BoxError> {
        Ok(self.channel.tell(Op::Signal { target, signal }).await?)
    }

    /// The error for a request the agent refused. A box at its pids limit (the agent could
    /// start no thread, or no process) says so, with what to do about it.
    fn refusal(&self, failure: Failure) -> BoxError {
        let full = failure.kind == "no_resources"
            || failure
                .message
                .contains(&format!("(os error {})", libc::EAGAIN));
        if !full {
            return BoxError::Refused(failure.message);
        }
        let (current, max) = self.cgroups.pids(&self.cgroup);
        BoxError::Refused(full_box_message(current, max, &failure.message))
    }

    /// Kills every process in the box but its agent (PID 1), from the host: a box that a
    /// fork bomb (or anything left running) filled to its pids limit can start commands
    /// again. Commands and sessions running in it end as killed. Answers how many processes
    /// were killed.
    pub async fn kill_all_but_agent(&self) -> usize {
        if self.seen_inside() {
            // In a VM (or under gVisor), from inside: `kill -KILL -1` as its root reaches
            // every process but PID 1 (the agent) and the shell that sends it. Again until
            // nothing is left to signal: a process caught forking (a fork bomb's) may leave
            // a child the first round missed.
            let mut exec = Exec::new(vec![
                "sh".into(),
                "-c".into(),
                "n=0; while [ $n -lt 50 ] && kill -KILL -1 2>/dev/null; do n=$((n+1)); sleep 0.02; done".into(),
            ]);
            exec.root = true;
            exec.timeout = Duration::from_secs(10);
            return usize::from(self.exec(exec, |_, _| {}).await.is_ok());
        }
        let (cgroups, cgroup, agent) = (self.cgroups, self.cgroup.clone(), self.host_pid);
        tokio::task::spawn_blocking(move || kill_all_but(cgroups, &cgroup, agent))
            .await
            .unwrap_or(0)
    }

    /// The box's processes, as it sees them (read from the host: works while paused).
    pub async fn processes(&self) -> Vec<kiln_core::process::BoxProcess> {
        if self.seen_inside() {
            // The host sees QEMU (or gVisor's sentry), not the box's processes: the agent
            // reads the box's own /proc; it cannot while the box is paused (it is frozen
            // with it), and never makes the caller wait long.
            if self.is_paused() {
                return Vec::new();
            }
            return tokio::time::timeout(INSIDE_READ_TIMEOUT, self.vm_processes())
                .await
                .unwrap_or_default();
        }
        let (cgroups, cgroup, base) = (
            self.cgroups,
            self.cgroup.clone(),
            self.template.built.uid_base,
        );
        tokio::task::spawn_blocking(move || {
            crate::procs::tasks(&cgroups.processes(&cgroup), base)
                .into_iter()
                .map(|t| t.process)
                .collect()
        })
        .await
        .unwrap_or_default()
    }

    /// Sends `signal` to the box's process `pid` (the box's number), or to every process of
    /// its group: how many got it; `None` when the box has no such process. The agent
    /// (pid 1) is refused: closing or restarting the box is how it ends.
    pub async fn signal_pid(
        &self,
        pid: u32,
        signal: i32,
        group: bool,
    ) -> Result<Option<usize>, BoxError> {
        if pid == 1 {
            return Err(BoxError::Refused(
                "pid 1 is kiln's agent, which keeps the box: restart the box to end every process, or delete the sandbox".into(),
            ));
        }
        if self.seen_inside() {
            // Sent from inside by the box's root (the host cannot reach its processes).
            if self.is_paused() {
                return Err(BoxError::Refused(
                    "its processes are reached through its agent, which is paused with it: resume the sandbox first".into(),
                ));
            }
            let processes = self.processes().await;
            let Some(target) = processes.iter().find(|p| p.pid == pid) else {
                return Ok(None);
            };
            let chosen: Vec<u32> = if group {
                processes
                    .iter()
                    .filter(|p| p.pgid == target.pgid && !p.agent)
                    .map(|p| p.pid)
                    .collect()
            } else {
                vec![pid]
            };
            let mut argv = vec!["kill".to_string(), format!("-{signal}"), "--".into()];
            argv.extend(chosen.iter().map(u32::to_string));
            let mut exec = Exec::new(argv);
            exec.root = true;
            exec.timeout = Duration::from_secs(10);
            let out = self.exec(exec, |_, _| {}).await?;
            return Ok(Some(if out.exit_code == Some(0) {
                chosen.len()
            } else {
                0
            }));
        }
        let (cgroups, cgroup, base) = (
            self.cgroups,
            self.cgroup.clone(),
            self.template.built.uid_base,
        );
        let sent = tokio::task::spawn_blocking(move || {
            let tasks = crate::procs::tasks(&cgroups.processes(&cgroup), base);
            let target = tasks.iter().find(|t| t.process.pid == pid)?;
            let chosen: Vec<i32> = if group {
                tasks
                    .iter()
                    .filter(|t| t.host_pgid == target.host_pgid && !t.process.agent)
                    .map(|t| t.host_pid)
                    .collect()
            } else {
                vec![target.host_pid]
            };
            Some(
                chosen
                    .into_iter()
                    .filter(|host_pid| signal_in_cgroup(*host_pid, &cgroup, signal))
                    .count(),
            )
        })
        .await
        .map_err(|e| BoxError::Refused(e.to_string()))?;
        Ok(sent)
    }

    /// The TCP ports the box's processes listen on (read from the host, through the
    /// agent's network namespace).
    pub async fn ports(&self) -> Vec<kiln_core::process::BoxPort> {
        if self.seen_inside() {
            if self.is_paused() {
                return Vec::new();
            }
            return tokio::time::timeout(INSIDE_READ_TIMEOUT, self.vm_ports())
                .await
                .unwrap_or_default();
        }
        let (cgroups, cgroup, base, agent) = (
            self.cgroups,
            self.cgroup.clone(),
            self.template.built.uid_base,
            self.host_pid,
        );
        tokio::task::spawn_blocking(move || {
            let tasks = crate::procs::tasks(&cgroups.processes(&cgroup), base);
            crate::procs::listening(agent, &tasks)
        })
        .await
        .unwrap_or_default()
    }

    /// A connection to `127.0.0.1:port` inside the box, made by the agent (the box has no
    /// network interface of its own): what is written to the stream reaches the box's
    /// server, what it answers comes back, and either side's end closes the other.
    /// `keep` lives as long as the connection (a guard that counts it as activity).
    pub async fn connect(
        &self,
        port: u16,
        keep: impl Send + 'static,
    ) -> Result<tokio::io::DuplexStream, BoxError> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut replies = self.channel.call(Op::Connect { port }).await?;
        match replies.next().await {
            Some(Reply::Connected) => {}
            Some(Reply::Failed(failure)) => return Err(BoxError::Refused(failure.message)),
            other => {
                return Err(BoxError::Refused(format!(
                    "the agent answered a connect with {other:?}"
                )));
            }
        }
        let target = replies.id;
        let (ours, theirs) = tokio::io::duplex(256 << 10);
        let (mut from_client, mut to_client) = tokio::io::split(ours);
        tokio::spawn(async move {
            let _keep = keep;
            while let Some(reply) = replies.next().await {
                match reply {
                    Reply::Output { data, .. } if to_client.write_all(&data).await.is_err() => {
                        break;
                    }
                    Reply::Closed | Reply::Failed(_) => break,
                    _ => {}
                }
            }
            let _ = to_client.shutdown().await;
        });
        let channel = self.channel.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; kiln_guest::proto::CHUNK_BYTES.min(256 << 10)];
            loop {
                match from_client.read(&mut buf).await {
                    Ok(0) | Err(_) => {
                        let _ = channel.write(target, Vec::new(), true).await;
                        return;
                    }
                    Ok(n) => {
                        if channel
                            .write(target, buf[..n].to_vec(), false)
                            .await
                            .is_err()
                        {
                            return;
                        }
                    }
                }
            }
        });
        Ok(theirs)
    }

    /// Removes the box now (a dead box replaced by a new one): what [`LiveBox::close`] does,
    /// for a box others may still hold; they find it gone.
    pub async fn destroy_now(&self) {
        // Once only: the last holder's drop must not remove it again.
        if self.closed.swap(true, std::sync::atomic::Ordering::AcqRel) {
            return;
        }
        // The agent ends when its channel closes, taking what it started (as in `close`).
        self.channel.close().await;
        let (runtime, runtime_root, id, dir, pid) = (
            self.runtime.clone(),
            self.runtime_root.clone(),
            self.id.clone(),
            self.dir.clone(),
            self.host_pid,
        );
        // Ended here (its processes, a VM's VMM among them, killed and reaped); the
        // runtime's bookkeeping and the folder go in the background.
        let (ended_runtime, ended_root, ended_id, ended_dir) = (
            runtime.clone(),
            runtime_root.clone(),
            id.clone(),
            dir.clone(),
        );
        let _ = tokio::task::spawn_blocking(move || {
            end(&ended_runtime, &ended_root, &ended_id, &ended_dir, pid)
        })
        .await;
        self.removals
            .run(move || remove(&runtime, &runtime_root, &id, &dir));
    }

    /// Checkpoints the box with CRIU into `images` (an empty folder out of the guest's
    /// reach): every process's memory and state, its open files and its connections inside
    /// the box are written there for [`Boxes::restore`]. The box must be paused (frozen) by
    /// the caller, and is left as it was: its processes whole and still frozen (CRIU
    /// restores the freezer's state it found), so its files stay as the images saw them
    /// until the caller thaws it (a snapshot) or kills it ([`LiveBox::kill_frozen`], a
    /// hibernation). Answers what its channel had open (to be handed to the restore). On
    /// failure the error says why (CRIU's own words).
    pub async fn checkpoint(&self, criu: &Path, images: &Path) -> Result<Carried, String> {
        self.checkpointable()?;
        if !self.is_paused() {
            return Err("the box must be paused while its processes are copied".into());
        }
        self.settle_vforks().await?;
        let carried = self.dump(criu, images).await;
        // Frozen it stays whatever CRIU did: the caller copies its files next.
        if !self.is_paused() {
            self.set_paused(true).await.map_err(|e| e.to_string())?;
        }
        carried
    }

    /// Lets a paused box's `vfork` children reach their `exec` before it is checkpointed: a
    /// task frozen while it waits for its vfork child (a shell running a command: dash
    /// vforks) cannot be seized by CRIU until the child execs, and CRIU, having stopped the
    /// child, waits for it in vain (10 s, then the dump fails). The box is thawed for a
    /// moment and frozen again until no task waits so (at most 50 times).
    async fn settle_vforks(&self) -> Result<(), String> {
        for _ in 0..50 {
            let (cgroups, cgroup) = (self.cgroups, self.cgroup.clone());
            let waiting = tokio::task::spawn_blocking(move || {
                cgroups
                    .processes(&cgroup)
                    .into_iter()
                    .any(crate::procs::in_vfork)
            })
            .await
            .map_err(|e| e.to_string())?;
            if !waiting {
                return Ok(());
            }
            self.set_paused(false).await.map_err(|e| e.to_string())?;
            tokio::time::sleep(Duration::from_millis(2)).await;
            self.set_paused(true).await.map_err(|e| e.to_string())?;
        }
        Err("a process of the box kept waiting for a vfork child to exec; try again".into())
    }

    /// Why CRIU cannot checkpoint this box, if it cannot.
    pub fn checkpointable(&self) -> Result<(), String> {
        if self.vm {
            return Err(
                "a microVM's memory is not checkpointed yet (CRIU checkpoints boxes, not QEMU)"
                    .into(),
            );
        }
        if is_gvisor(&self.runtime) {
            return Err("gVisor boxes are not checkpointed with CRIU (runsc has a checkpoint of its own, which kiln does not drive yet)".into());
        }
        Ok(())
    }

    /// Sends SIGKILL to every process of the box while it is frozen: they end, without
    /// running another instruction of their own, when it is thawed (as closing it does).
    pub fn kill_frozen(&self) {
        for pid in self.cgroups.processes(&self.cgroup) {
            // SAFETY: kill(2) on a pid of the box's frozen cgroup: a frozen process cannot
            // exit, so the pid is still its.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }

    async fn dump(&self, criu: &Path, images: &Path) -> Result<Carried, String> {
        let carried = self.channel.carried();
        let mut command = runtime_command(&self.runtime, &self.runtime_root);
        command
            .arg("--criu")
            .arg(criu)
            .arg("checkpoint")
            .args(CRIU_FLAGS)
            .arg("--leave-running")
            .arg("--image-path")
            .arg(images)
            .arg("--work-path")
            .arg(images)
            .arg(&self.id)
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        let images = images.to_path_buf();
        let out = tokio::task::spawn_blocking(move || command.output())
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("{}: {e}", self.runtime.display()))?;
        if out.status.success() {
            return Ok(carried);
        }
        let said = String::from_utf8_lossy(&out.stderr);
        let said = said
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("");
        Err(format!(
            "runc checkpoint exited with {}: {} (CRIU's log: {})",
            out.status,
            said.trim(),
            criu_log_tail(&images.join("dump.log"))
        ))
    }

    /// Whether the box is frozen.
    pub fn is_paused(&self) -> bool {
        self.cgroups.is_frozen(&self.cgroup)
    }

    /// Freezes the box's every process (`paused`) or thaws them. Its agent is frozen too, so
    /// nothing may be asked of it until it is thawed.
    pub async fn set_paused(&self, paused: bool) -> Result<(), BoxError> {
        let (cgroups, cgroup) = (self.cgroups, self.cgroup.clone());
        tokio::task::spawn_blocking(move || {
            cgroups.set_frozen(&cgroup, paused, Duration::from_secs(2))
        })
        .await
        .map_err(|e| BoxError::Refused(e.to_string()))?
        .map_err(BoxError::Refused)
    }

    /// How many times the box's processes were killed for memory.
    pub fn oom_kills(&self) -> u64 {
        self.cgroups.oom_kills(&self.cgroup)
    }

    /// The box's cgroup folder (gone once the box is closed).
    pub fn cgroup_dir(&self) -> PathBuf {
        self.cgroups.dir(&self.cgroup)
    }

    /// Memory the box's processes use now, in bytes.
    pub fn memory_bytes(&self) -> u64 {
        self.cgroups.memory_bytes(&self.cgroup)
    }

    /// CPU time the box's processes have used, in microseconds.
    pub fn cpu_usage_us(&self) -> u64 {
        self.cgroups.cpu_usage_us(&self.cgroup)
    }

    /// The agent's spawn request for `exec`.
    fn spawn_request(&self, exec: &Exec, stdin: bool) -> Spawn {
        Spawn {
            env: self.environment(exec),
            argv: exec.argv.clone(),
            cwd: exec
                .cwd
                .clone()
                .unwrap_or_else(|| self.template.definition.working_dir.clone()),
            user: (!exec.root).then_some(Credentials {
                uid: USER_UID,
                gid: USER_UID,
            }),
            terminal: None,
            stdin,
        }
    }

    /// Runs a command to its end (or its timeout), calling `on_output(stderr, bytes)` as
    /// output arrives.
    pub async fn exec(
        &self,
        exec: Exec,
        mut on_output: impl FnMut(bool, &[u8]),
    ) -> Result<ExecOutput, BoxError> {
        if exec.argv.is_empty() {
            return Err(BoxError::Refused("a command needs a program".into()));
        }
        let oom_before = self.cgroups.oom_kills(&self.cgroup);
        let spawn = self.spawn_request(&exec, !exec.stdin.is_empty());
        let mut replies = self.channel.call(Op::Spawn(spawn)).await?;
        let target = replies.id;
        let chunks = exec.stdin.chunks(kiln_guest::proto::CHUNK_BYTES);
        let count = chunks.len();
        for (i, chunk) in chunks.enumerate() {
            self.channel
                .write(target, chunk.to_vec(), i + 1 == count)
                .await?;
        }
        let mut output = ExecOutput::default();
        let deadline = tokio::time::Instant::now() + exec.timeout;
        let mut killed_at = None;
        loop {
            let wait_until = killed_at.map_or(deadline, |at: tokio::time::Instant| at + KILL_GRACE);
            let reply = match tokio::time::timeout_at(wait_until, replies.next()).await {
                Ok(Some(reply)) => reply,
                Ok(None) => {
                    return Err(BoxError::Gone(ChannelClosed(
                        "the box ended while the command ran".into(),
                    )));
                }
                Err(_) if killed_at.is_none() => {
                    output.timed_out = true;
                    killed_at = Some(tokio::time::Instant::now());
                    self.signal(target, libc::SIGKILL).await?;
                    continue;
                }
                Err(_) => {
                    return Err(BoxError::Gone(ChannelClosed(
                        "the command did not end after SIGKILL".into(),
                    )));
                }
            };
            if let Reply::Failed(failure) = reply {
                return Err(self.refusal(failure));
            }
            if output.take(reply, exec.max_output, &mut on_output)? {
                output.oom_killed = output.signal == Some(libc::SIGKILL)
                    && !output.timed_out
                    && self.cgroups.oom_kills(&self.cgroup) > oom_before;
                return Ok(output);
            }
        }
    }

    /// Stream `target` of the box this one was restored from (a process started there):
    /// its replies from now on. `None`: not a stream the checkpoint carried, or taken already.
    pub fn adopt(&self, target: u64) -> Option<crate::channel::Replies> {
        self.channel.adopt(target)
    }

    /// A file of the VM, read by its agent (at most `limit` bytes).
    async fn vm_read(&self, path: String, limit: u64) -> Option<Vec<u8>> {
        let mut replies = self
            .channel
            .call(Op::ReadFile {
                path,
                offset: 0,
                limit,
            })
            .await
            .ok()?;
        let mut data = Vec::new();
        loop {
            match replies.next().await? {
                Reply::Data { data: chunk } => data.extend_from_slice(&chunk),
                Reply::Done => return Some(data),
                _ => return None,
            }
        }
    }

    /// A folder of the VM, listed by its agent.
    async fn vm_list(&self, path: String) -> Vec<kiln_guest::proto::Entry> {
        let Ok(mut replies) = self.channel.call(Op::List { path }).await else {
            return Vec::new();
        };
        match replies.next().await {
            Some(Reply::Entries { entries }) => entries,
            _ => Vec::new(),
        }
    }

    /// The VM's processes, read from its `/proc` through the agent (every file asked at
    /// once: one round trip's wait, not one per file).
    async fn vm_processes(&self) -> Vec<kiln_core::process::BoxProcess> {
        let boot = self
            .vm_read("/proc/stat".into(), 64 << 10)
            .await
            .and_then(|s| {
                String::from_utf8_lossy(&s)
                    .lines()
                    .find_map(|l| l.strip_prefix("btime ")?.trim().parse().ok())
            })
            .unwrap_or(0);
        let pids: Vec<u32> = self
            .vm_list("/proc".into())
            .await
            .iter()
            .filter_map(|e| e.name.parse().ok())
            .take(4096)
            .collect();
        let reads = pids.iter().map(|pid| async move {
            let (stat, status, cmdline) = tokio::join!(
                self.vm_read(format!("/proc/{pid}/stat"), 4 << 10),
                self.vm_read(format!("/proc/{pid}/status"), 16 << 10),
                self.vm_read(format!("/proc/{pid}/cmdline"), crate::procs::MAX_CMDLINE),
            );
            crate::procs::vm_process(
                *pid,
                &stat?,
                &String::from_utf8_lossy(&status?),
                &cmdline.unwrap_or_default(),
                boot,
            )
        });
        let mut found: Vec<_> = futures::future::join_all(reads)
            .await
            .into_iter()
            .flatten()
            .collect();
        found.sort_by_key(|p| p.pid);
        found
    }

    /// The TCP ports the VM's processes listen on, from its `/proc/net` through the agent.
    async fn vm_ports(&self) -> Vec<kiln_core::process::BoxPort> {
        let mut found = Vec::new();
        for (file, v6) in [("tcp", false), ("tcp6", true)] {
            if let Some(text) = self.vm_read(format!("/proc/net/{file}"), 4 << 20).await {
                found.extend(crate::procs::vm_listening(
                    &String::from_utf8_lossy(&text),
                    v6,
                ));
            }
        }
        if !found.is_empty() {
            let processes = self.vm_processes().await;
            for process in &processes {
                let links = self.vm_list(format!("/proc/{}/fd", process.pid)).await;
                for (port, inode) in found.iter_mut() {
                    let wanted = format!("socket:[{inode}]");
                    if port.pid.is_none()
                        && links
                            .iter()
                            .any(|l| l.target.as_deref() == Some(wanted.as_str()))
                    {
                        port.pid = Some(process.pid);
                        port.name = Some(process.name.clone());
                    }
                }
            }
        }
        let mut ports: Vec<_> = found.into_iter().map(|(p, _)| p).collect();
        ports.sort_by(|a, b| (a.port, &a.address).cmp(&(b.port, &b.address)));
        ports.dedup_by(|a, b| a.port == b.port && a.address == b.address);
        ports
    }

    /// A clone's own randomness, clock and workspace, after its restore: fresh host entropy
    /// credited and the pool reseeded, the clock set, and (where it has one) its workspace
    /// mounted over 9p (the snapshot's template VM had none mounted: a mounted share cannot
    /// migrate).
    async fn thaw(&self, workspace: bool) -> Result<(), BoxError> {
        // 64 bytes from the host's random source.
        let seed: Vec<u8> = (0..8).flat_map(|_| random_bytes()).collect();
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let mut replies = self.channel.call(Op::Thaw { seed, now_ms }).await?;
        match replies.next().await {
            Some(Reply::Done) => {}
            other => {
                return Err(start_err("thaw")(format!("the agent answered {other:?}")));
            }
        }
        if workspace {
            let at = self.template.definition.working_dir.clone();
            let mut mount = Exec::new(vec![
                "mount".into(),
                "-t".into(),
                "9p".into(),
                "-o".into(),
                "trans=virtio,version=9p2000.L,msize=262144,access=client,cache=none".into(),
                "workspace".into(),
                at,
            ]);
            mount.root = true;
            mount.cwd = Some("/".into());
            mount.timeout = Duration::from_secs(30);
            let out = self.exec(mount, |_, _| {}).await?;
            if out.exit_code != Some(0) {
                return Err(start_err("workspace")(format!(
                    "mounting the workspace failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                )));
            }
        }
        Ok(())
    }

    /// Whether it is a microVM rather than a box.
    pub fn is_vm(&self) -> bool {
        self.vm
    }

    /// Whether it runs under gVisor.
    pub fn is_gvisor(&self) -> bool {
        is_gvisor(&self.runtime)
    }

    /// Whether its processes are seen (and signalled) from inside, through the agent: a
    /// VM's run on its own kernel and a gVisor box's on gVisor's sentry, so the host's
    /// `/proc` and the box's cgroup show QEMU or the sentry, not them.
    fn seen_inside(&self) -> bool {
        self.vm || self.is_gvisor()
    }

    /// Whether the box is still running.
    /// What its proxy applies, where it has a network.
    pub fn egress(&self) -> Option<&Arc<proxy::LiveEgress>> {
        self.egress.as_ref()
    }

    pub fn is_alive(&self) -> bool {
        self.channel.is_open()
    }

    /// Stops the box: every process in it is killed, its container, cgroup, layers and
    /// folder removed.
    pub async fn close(self) {
        self.destroy_now().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_ca_bundle_is_ssl_cert_file_then_the_first_usual_place_that_exists() {
        let dir = tempfile::tempdir().unwrap();
        let at = |name: &str| dir.path().join(name);
        let (debian, fedora, suse) = (at("debian.crt"), at("fedora.crt"), at("suse.pem"));
        let candidates = [&debian, &fedora, &suse];
        // None of them: none.
        assert_eq!(find_ca_bundle(None, &candidates), None);
        // The first that exists, in order.
        std::fs::write(&suse, "suse").unwrap();
        assert_eq!(find_ca_bundle(None, &candidates), Some(suse.clone()));
        std::fs::write(&fedora, "fedora").unwrap();
        assert_eq!(find_ca_bundle(None, &candidates), Some(fedora.clone()));
        // A link is followed to its file (Fedora's bundle is a link into ca-trust).
        std::fs::write(at("extracted.pem"), "real").unwrap();
        std::os::unix::fs::symlink(at("extracted.pem"), &debian).unwrap();
        assert_eq!(find_ca_bundle(None, &candidates), Some(at("extracted.pem")));
        // SSL_CERT_FILE comes first; empty or missing, it is passed over.
        std::fs::write(at("env.pem"), "env").unwrap();
        let env = |p: &Path| Some(p.as_os_str().to_owned());
        assert_eq!(
            find_ca_bundle(env(&at("env.pem")), &candidates),
            Some(at("env.pem"))
        );
        assert_eq!(
            find_ca_bundle(Some("".into()), &candidates),
            Some(at("extracted.pem"))
        );
        assert_eq!(
            find_ca_bundle(env(&at("missing.pem")), &candidates),
            Some(at("extracted.pem"))
        );
        // A folder is no bundle.
        std::fs::create_dir(at("dir.pem")).unwrap();
        assert_eq!(find_ca_bundle(env(&at("dir.pem")), &[at("dir.pem")]), None);
    }

    #[test]
    fn a_full_box_says_how_full_and_the_ways_out() {
        let said = full_box_message(Some(64), Some(64), "no thread: os error 11");
        for part in [
            "the box is full: its 64 tasks (processes and threads) fill its pids limit of 64",
            "kill -9 -1",
            "delete the sandbox and create another",
            "(the agent said: no thread: os error 11)",
        ] {
            assert!(said.contains(part), "{part:?} not in {said}");
        }
        let said = full_box_message(None, Some(128), "x");
        assert!(
            said.contains("its processes fill its pids limit of 128"),
            "{said}"
        );
        let said = full_box_message(None, None, "x");
        assert!(
            said.contains("its processes fill its pids limit,"),
            "{said}"
        );
    }
}
