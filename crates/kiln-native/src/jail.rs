//! The jail of one box, as an OCI runtime configuration (`config.json` of a bundle): user,
//! pid, mount, network, ipc, uts and cgroup namespaces; the box's uids mapped onto an
//! unprivileged host range; a cgroup with memory (and swap), pids, cpu and io limits; fresh
//! `/proc`, a minimal `/dev`, a size-capped `/tmp`, `/sys` read-only, `nosuid,nodev`
//! everywhere; no_new_privs, a small capability set for the agent (the code's processes drop
//! all of them) and a seccomp filter. A maintained runtime (runc) applies it.

use serde_json::{Value, json};

/// The limits of one box.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct BoxLimits {
    pub memory_bytes: u64,
    /// CPUs' worth of time per period (1.5 = one and a half cores).
    pub vcpus: f64,
    pub pids: u64,
    /// The size of the writable layer over the template (and of `/tmp`'s share of it).
    pub disk_bytes: u64,
    /// Relative CPU and io weight against other boxes (100 = normal).
    pub weight: u16,
}

/// What the jail is built from.
#[derive(Debug, Clone)]
pub struct JailSpec<'a> {
    pub hostname: &'a str,
    /// Host path of the guest agent binary, bound read-only at `/.kiln/agent`.
    pub agent: &'a str,
    /// Host files bound read-only: (host path, path in the box).
    pub read_only: &'a [(String, String)],
    /// Host path of the workspace, bound read-write at `working_dir`.
    pub workspace: Option<&'a str>,
    /// Further host folders (named volumes): (host path, path in the box, writable), bound
    /// after the workspace (so one may lie inside it).
    pub binds: &'a [(String, String, bool)],
    pub working_dir: &'a str,
    pub uid_base: u32,
    pub limits: BoxLimits,
    /// The cgroup path (relative to each hierarchy's root, or the v2 root).
    pub cgroup: &'a str,
}

/// The capabilities the agent keeps (as the box's namespaced root), Docker's default set
/// without NET_RAW, MKNOD, SYS_CHROOT and AUDIT_WRITE. Processes started as the box's user drop every capability;
/// processes started as root (a per-sandbox option) keep these, inside the namespace only.
const AGENT_CAPS: [&str; 10] = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SETFCAP",
];

use kiln_core::jail::{AF_PACKET, CLONE_NEWUSER};

fn seccomp() -> Value {
    json!({
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        "syscalls": [
            {"names": kiln_core::jail::denied_syscalls().map(|(name, _)| name).collect::<Vec<_>>(), "action": "SCMP_ACT_ERRNO", "errnoRet": libc::EPERM},
            // New user namespaces, by clone's flags. clone3 hides its flags in memory a
            // filter cannot read: it answers ENOSYS, and the C library falls back to clone.
            {"names": ["clone"], "action": "SCMP_ACT_ERRNO", "errnoRet": libc::EPERM,
             "args": [{"index": 0, "value": CLONE_NEWUSER, "valueTwo": CLONE_NEWUSER, "op": "SCMP_CMP_MASKED_EQ"}]},
            {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": libc::ENOSYS},
            // Packet sockets see raw frames.
            {"names": ["socket"], "action": "SCMP_ACT_ERRNO", "errnoRet": libc::EPERM,
             "args": [{"index": 0, "value": AF_PACKET, "op": "SCMP_CMP_EQ"}]},
            // io_uring does its work in kernel threads a filter never sees, and has been a
            // steady source of kernel exploits: refused, as in Docker's default profile.
            {"names": IO_URING, "action": "SCMP_ACT_ERRNO", "errnoRet": libc::EPERM},
        ]
    })
}

/// io_uring's system calls (refused in boxes).
const IO_URING: [&str; 3] = ["io_uring_setup", "io_uring_enter", "io_uring_register"];

/// A bind mount of host `source` at `destination` (`ro` or `rw`), `nosuid,nodev`.
pub(crate) fn bind(source: &str, destination: &str, mode: &str) -> Value {
    json!({"destination": destination, "type": "bind", "source": source,
           "options": ["rbind", mode, "nosuid", "nodev"]})
}

/// The box's mounts: fresh `/proc`, a minimal `/dev`, read-only `/sys`, a size-capped
/// `/tmp`, the agent, read-only host files and the workspace; `nosuid,nodev` on all.
fn mounts(spec: &JailSpec<'_>) -> Vec<Value> {
    let tmp_bytes = (spec.limits.disk_bytes / 4).clamp(16 << 20, 1 << 30);
    let mut mounts = vec![
        json!({"destination": "/proc", "type": "proc", "source": "proc",
               "options": ["nosuid", "noexec", "nodev"]}),
        json!({"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
               "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}),
        json!({"destination": "/dev/pts", "type": "devpts", "source": "devpts",
               "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]}),
        json!({"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
               "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]}),
        json!({"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
               "options": ["nosuid", "noexec", "nodev"]}),
        json!({"destination": "/sys", "type": "sysfs", "source": "sysfs",
               "options": ["nosuid", "noexec", "nodev", "ro"]}),
        json!({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
               "options": ["nosuid", "nodev", "mode=1777", format!("size={tmp_bytes}")]}),
        bind(spec.agent, "/.kiln/agent", "ro"),
    ];
    for (host, inside) in spec.read_only {
        mounts.push(bind(host, inside, "ro"));
    }
    if let Some(workspace) = spec.workspace {
        mounts.push(bind(workspace, spec.working_dir, "rw"));
    }
    for (host, inside, writable) in spec.binds {
        mounts.push(bind(host, inside, if *writable { "rw" } else { "ro" }));
    }
    mounts
}

/// The agent's process: the box's root with [`AGENT_CAPS`], no_new_privs, no core dumps.
fn process() -> Value {
    let caps = AGENT_CAPS.to_vec();
    // A user namespace cannot raise a hard limit above kiln's own.
    let nofile = {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes one rlimit into `limit`, a live local, and RLIMIT_NOFILE is a
        // valid resource; were it to fail, `limit` keeps its zeros (clamped to 1024 below).
        unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
        limit.rlim_max.clamp(1024, 65536)
    };
    json!({
        "terminal": false,
        "user": {"uid": 0, "gid": 0},
        "args": ["/.kiln/agent"],
        "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
        "cwd": "/",
        "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
        "rlimits": [
            {"type": "RLIMIT_NOFILE", "hard": nofile, "soft": nofile},
            {"type": "RLIMIT_CORE", "hard": 0u64, "soft": 0u64},
        ],
        "noNewPrivileges": true,
        "oomScoreAdj": 500,
    })
}

/// The cgroup's limits: memory (swap included), pids, cpu quota and shares, io weight, and
/// no devices.
fn resources(limits: BoxLimits) -> Value {
    let period: u64 = 100_000;
    let quota = (limits.vcpus * period as f64).round().max(1000.0) as u64;
    json!({
        "devices": [{"allow": false, "access": "rwm"}],
        "memory": {"limit": limits.memory_bytes, "swap": limits.memory_bytes},
        "pids": {"limit": limits.pids},
        "cpu": {"quota": quota, "period": period,
                "shares": 1024 * u64::from(limits.weight.max(1)) / 100},
        "blockIO": {"weight": limits.weight.clamp(10, 1000)},
    })
}

/// The bundle's `config.json`.
pub fn config(spec: &JailSpec<'_>) -> Value {
    json!({
        "ociVersion": "1.0.2",
        "process": process(),
        "root": {"path": "rootfs", "readonly": false},
        "hostname": spec.hostname,
        "mounts": mounts(spec),
        "linux": {
            "uidMappings": [{"containerID": 0, "hostID": spec.uid_base, "size": 65536}],
            "gidMappings": [{"containerID": 0, "hostID": spec.uid_base, "size": 65536}],
            "namespaces": [
                {"type": "pid"}, {"type": "network"}, {"type": "ipc"}, {"type": "uts"},
                {"type": "mount"}, {"type": "user"}, {"type": "cgroup"},
            ],
            "cgroupsPath": spec.cgroup,
            "resources": resources(spec.limits),
            "maskedPaths": [
                "/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
                "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi",
                "/sys/firmware", "/sys/devices/virtual/powercap",
            ],
            "readonlyPaths": [
                "/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger",
            ],
            "seccomp": seccomp(),
        },
    })
}

/// Which cgroup hierarchy the host runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cgroups {
    /// Only the unified v2 hierarchy (most production hosts).
    V2,
    /// v1 controllers (possibly beside a v2 mount with no controllers: "hybrid").
    V1,
}

impl Cgroups {
    /// Detects the host's layout.
    pub fn detect() -> Cgroups {
        if std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
            Cgroups::V2
        } else {
            Cgroups::V1
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Cgroups::V2 => "v2",
            Cgroups::V1 => "v1",
        }
    }

    /// The box's cgroup folder: its memory controller's on v1, the unified one on v2.
    pub fn dir(self, cgroup: &str) -> std::path::PathBuf {
        let cgroup = cgroup.trim_start_matches('/');
        match self {
            Cgroups::V2 => std::path::Path::new("/sys/fs/cgroup").join(cgroup),
            Cgroups::V1 => std::path::Path::new("/sys/fs/cgroup/memory").join(cgroup),
        }
    }

    /// Every folder of the cgroup: each v1 controller's (the ones mounted), or the unified
    /// one on v2.
    pub fn dirs(self, cgroup: &str) -> Vec<std::path::PathBuf> {
        let cgroup = cgroup.trim_start_matches('/');
        match self {
            Cgroups::V2 => vec![std::path::Path::new("/sys/fs/cgroup").join(cgroup)],
            Cgroups::V1 => std::fs::read_dir("/sys/fs/cgroup")
                .into_iter()
                .flatten()
                .flatten()
                // Not following links (`cpu` → `cpu,cpuacct`): each hierarchy once.
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path().join(cgroup))
                .filter(|dir| dir.is_dir())
                .collect(),
        }
    }

    /// Removes the cgroup's folders that are empty (no processes, no children): what a
    /// container runtime left (runsc leaves its cgroups behind when its sandbox died
    /// first). A cgroup still in use is left alone (the kernel refuses, for `wait` of retries).
    pub fn remove_empty(self, cgroup: &str, wait: std::time::Duration) {
        for dir in self.dirs(cgroup) {
            // A cgroup whose last tasks were just killed answers EBUSY until the kernel has
            // released them (seen on v1's memory controller under load: the folder was left
            // until the hourly sweep): retried for up to `wait`.
            let deadline = std::time::Instant::now() + wait;
            loop {
                match std::fs::remove_dir(&dir) {
                    Err(e)
                        if e.raw_os_error() == Some(libc::EBUSY)
                            && std::time::Instant::now() < deadline =>
                    {
                        std::thread::sleep(std::time::Duration::from_millis(5));
                    }
                    _ => break,
                }
            }
        }
    }

    /// The file that freezes the box's cgroup: v1's freezer controller's `freezer.state`,
    /// v2's `cgroup.freeze`.
    fn freezer(self, cgroup: &str) -> std::path::PathBuf {
        let cgroup = cgroup.trim_start_matches('/');
        match self {
            Cgroups::V2 => std::path::Path::new("/sys/fs/cgroup")
                .join(cgroup)
                .join("cgroup.freeze"),
            Cgroups::V1 => std::path::Path::new("/sys/fs/cgroup/freezer")
                .join(cgroup)
                .join("freezer.state"),
        }
    }

    /// Whether the kernel has frozen every task of the cgroup (a freeze under way is not).
    pub fn is_frozen(self, cgroup: &str) -> bool {
        match self {
            Cgroups::V2 => {
                let events = self.freezer(cgroup).with_file_name("cgroup.events");
                std::fs::read_to_string(events)
                    .is_ok_and(|text| text.lines().any(|l| l.trim() == "frozen 1"))
            }
            Cgroups::V1 => std::fs::read_to_string(self.freezer(cgroup))
                .is_ok_and(|state| state.trim() == "FROZEN"),
        }
    }

    /// Freezes (or thaws) every task of the cgroup, and waits until the kernel says it is
    /// done: a task that forks meanwhile is frozen too (the kernel freezes new children of
    /// a freezing cgroup). Gives up after `within`, thawing again, with the reason.
    pub fn set_frozen(
        self,
        cgroup: &str,
        frozen: bool,
        within: std::time::Duration,
    ) -> Result<(), String> {
        let file = self.freezer(cgroup);
        let value = match (self, frozen) {
            (Cgroups::V2, true) => "1",
            (Cgroups::V2, false) => "0",
            (Cgroups::V1, true) => "FROZEN",
            (Cgroups::V1, false) => "THAWED",
        };
        let started = std::time::Instant::now();
        let mut pause = std::time::Duration::from_micros(50);
        loop {
            std::fs::write(&file, value).map_err(|e| format!("{}: {e}", file.display()))?;
            if self.is_frozen(cgroup) == frozen {
                return Ok(());
            }
            if started.elapsed() >= within {
                if frozen {
                    let _ = self.set_frozen(cgroup, false, within);
                }
                return Err(format!(
                    "the kernel did not {} the box's tasks within {within:?}",
                    if frozen { "freeze" } else { "thaw" }
                ));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(std::time::Duration::from_millis(5));
        }
    }

    /// How many times the box's processes were killed for memory, from its cgroup.
    pub fn oom_kills(self, cgroup: &str) -> u64 {
        let cgroup = cgroup.trim_start_matches('/');
        let (file, key) = match self {
            Cgroups::V2 => (format!("/sys/fs/cgroup/{cgroup}/memory.events"), "oom_kill"),
            Cgroups::V1 => (
                format!("/sys/fs/cgroup/memory/{cgroup}/memory.oom_control"),
                "oom_kill",
            ),
        };
        std::fs::read_to_string(file)
            .ok()
            .and_then(|text| {
                text.lines().find_map(|l| {
                    let (k, v) = l.split_once(' ')?;
                    (k == key).then(|| v.trim().parse().ok()).flatten()
                })
            })
            .unwrap_or(0)
    }

    /// The box's pids controller folder.
    fn pids_dir(self, cgroup: &str) -> std::path::PathBuf {
        let cgroup = cgroup.trim_start_matches('/');
        match self {
            Cgroups::V2 => std::path::Path::new("/sys/fs/cgroup").join(cgroup),
            Cgroups::V1 => std::path::Path::new("/sys/fs/cgroup/pids").join(cgroup),
        }
    }

    /// The box's tasks (processes and their threads) now, and its pids limit (`None`: none
    /// or unreadable).
    pub fn pids(self, cgroup: &str) -> (Option<u64>, Option<u64>) {
        let dir = self.pids_dir(cgroup);
        let read = |name: &str| {
            std::fs::read_to_string(dir.join(name))
                .ok()
                .and_then(|v| v.trim().parse().ok())
        };
        (read("pids.current"), read("pids.max"))
    }

    /// The host pids of the box's processes (thread group leaders).
    pub fn processes(self, cgroup: &str) -> Vec<i32> {
        std::fs::read_to_string(self.pids_dir(cgroup).join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    /// Memory the cgroup's processes use now, in bytes (page cache included).
    pub fn memory_bytes(self, cgroup: &str) -> u64 {
        let cgroup = cgroup.trim_start_matches('/');
        let path = match self {
            Cgroups::V2 => format!("/sys/fs/cgroup/{cgroup}/memory.current"),
            Cgroups::V1 => format!("/sys/fs/cgroup/memory/{cgroup}/memory.usage_in_bytes"),
        };
        std::fs::read_to_string(path)
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }

    /// CPU time the box's processes have used, in microseconds, from its cgroup.
    pub fn cpu_usage_us(self, cgroup: &str) -> u64 {
        let cgroup = cgroup.trim_start_matches('/');
        match self {
            Cgroups::V2 => std::fs::read_to_string(format!("/sys/fs/cgroup/{cgroup}/cpu.stat"))
                .ok()
                .and_then(|text| {
                    text.lines().find_map(|l| {
                        l.strip_prefix("usage_usec ")
                            .and_then(|v| v.trim().parse().ok())
                    })
                })
                .unwrap_or(0),
            Cgroups::V1 => {
                std::fs::read_to_string(format!("/sys/fs/cgroup/cpuacct/{cgroup}/cpuacct.usage"))
                    .ok()
                    .and_then(|v| v.trim().parse::<u64>().ok())
                    .map_or(0, |ns| ns / 1000)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rules of the box's filter that answer `name` with an errno, and the errnos.
    fn refusals(name: &str) -> Vec<(i64, bool)> {
        let profile = seccomp();
        profile["syscalls"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|rule| rule["names"].as_array().unwrap().iter().any(|n| n == name))
            .map(|rule| {
                assert_eq!(rule["action"], "SCMP_ACT_ERRNO", "{rule}");
                (
                    rule["errnoRet"].as_i64().unwrap(),
                    rule.get("args").is_some(),
                )
            })
            .collect()
    }

    #[test]
    fn io_uring_is_refused_with_eperm_not_a_kill() {
        assert_eq!(seccomp()["defaultAction"], "SCMP_ACT_ALLOW");
        for name in ["io_uring_setup", "io_uring_enter", "io_uring_register"] {
            assert_eq!(
                refusals(name),
                [(i64::from(libc::EPERM), false)],
                "{name}: one unconditional EPERM rule"
            );
        }
        // The other refusals stay.
        assert_eq!(refusals("mount"), [(i64::from(libc::EPERM), false)]);
        assert_eq!(refusals("clone3"), [(i64::from(libc::ENOSYS), false)]);
    }
}
