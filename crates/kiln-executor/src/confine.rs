//! The WebAssembly workers confine themselves: defence in depth under wasmtime's own
//! isolation, so that a guest that ever escaped the engine would find a process with no
//! network, a read-only file system and no way to start programs or change its jail.
//!
//! In two steps, because namespaces can only be entered while the process has one thread
//! and the filter is best installed once the engine is loaded:
//!
//! 1. [`isolate`], first thing in the worker: a new mount, network, IPC and UTS namespace
//!    (in a user namespace of its own when kiln is not root). The network namespace has
//!    only a loopback interface, down. Every mount becomes read-only and `nosuid`, except
//!    the folders the pool names writable (kiln's data folder, the temporary folder, the
//!    module cache), bound over themselves.
//! 2. [`restrict`], once the engine is loaded: `no_new_privs` and a seccomp filter on every
//!    thread refusing with `EPERM` the calls the Linux boxes refuse
//!    ([`kiln_core::jail::denied_syscalls`]), plus `execve`/`execveat` (a worker never
//!    starts a program), sockets other than Unix ones, and `clone` of a new user
//!    namespace; `clone3` answers `ENOSYS` (its flags are out of a filter's reach; the C
//!    library falls back to `clone`).
//!
//! `KILN_WORKER_JAIL=off` turns it off (a host without namespaces); `require` makes a worker
//! that cannot confine itself exit instead of serving with a warning.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule,
};

/// The environment variable naming the folders a worker may write, as a JSON array.
pub const WRITABLE_ENV: &str = "KILN_WORKER_WRITABLE";
/// `off`, `auto` (the default: confine, or warn and go on) or `require`.
pub const JAIL_ENV: &str = "KILN_WORKER_JAIL";

/// How hard a worker tries (from [`JAIL_ENV`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    Off,
    Auto,
    Require,
}

impl Policy {
    /// The policy `KILN_WORKER_JAIL` names; unknown text is `require` (never weaker).
    pub fn from_env() -> Policy {
        match std::env::var(JAIL_ENV).as_deref() {
            Ok("off") => Policy::Off,
            Ok("auto") | Err(_) => Policy::Auto,
            Ok(_) => Policy::Require,
        }
    }
}

impl Policy {
    /// The policy a server (`kiln serve`, `kiln rest`, `kiln runner`) gives its workers:
    /// `KILN_WORKER_JAIL`'s, where `auto` (or nothing) means `require` for a process running
    /// as root: a root worker that could not confine itself would run guests as root.
    pub fn for_server() -> Policy {
        match Policy::from_env() {
            // SAFETY: geteuid takes no arguments and cannot fail.
            Policy::Auto if unsafe { libc::geteuid() } == 0 => Policy::Require,
            policy => policy,
        }
    }

    /// Its name, as `KILN_WORKER_JAIL` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Off => "off",
            Policy::Auto => "auto",
            Policy::Require => "require",
        }
    }
}

/// Whether a server's workers are confined, as `/readyz` and `/metrics` say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JailReport {
    /// The policy the workers run under.
    pub policy: Policy,
    /// Whether a worker could confine itself (checked at start).
    pub confined: bool,
}

impl Default for JailReport {
    fn default() -> Self {
        JailReport {
            policy: Policy::Auto,
            confined: false,
        }
    }
}

/// The writable folders a pool passes its workers ([`WRITABLE_ENV`]).
pub fn writable_from_env() -> Vec<PathBuf> {
    std::env::var(WRITABLE_ENV)
        .ok()
        .and_then(|text| serde_json::from_str::<Vec<PathBuf>>(&text).ok())
        .unwrap_or_default()
}

/// Step 1: new namespaces and a read-only file system but for `writable`. Call it while
/// the process has one thread.
pub fn isolate(writable: &[PathBuf]) -> io::Result<()> {
    // SAFETY: these calls take no pointers, or pointers to live NUL-terminated strings.
    unsafe {
        if libc::geteuid() != 0 {
            let (uid, gid) = (libc::geteuid(), libc::getegid());
            check(
                libc::unshare(libc::CLONE_NEWUSER),
                "unshare a user namespace",
            )?;
            // The worker's own procfs files, written before any guest exists: kernel
            // interfaces of this process, not a tree a guest can write.
            std::fs::write("/proc/self/setgroups", "deny")?;
            std::fs::write("/proc/self/uid_map", format!("{uid} {uid} 1"))?;
            std::fs::write("/proc/self/gid_map", format!("{gid} {gid} 1"))?;
        }
        let flags =
            libc::CLONE_NEWNS | libc::CLONE_NEWNET | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS;
        check(libc::unshare(flags), "unshare namespaces")?;
    }
    mount(
        None,
        c"/",
        libc::MS_REC | libc::MS_SLAVE,
        "make mounts private",
    )?;
    let writable: Vec<CString> = writable
        .iter()
        .filter_map(|p| p.canonicalize().ok())
        .filter_map(|p| CString::new(p.as_os_str().as_bytes()).ok())
        .collect();
    for path in &writable {
        mount(
            Some(path),
            path,
            libc::MS_BIND | libc::MS_REC,
            "bind a writable folder",
        )?;
    }
    set_attr(c"/", MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0)?;
    for path in &writable {
        set_attr(path, 0, MOUNT_ATTR_RDONLY)?;
    }
    Ok(())
}

/// Step 2: `no_new_privs` and the seccomp filters, on every thread.
pub fn restrict() -> io::Result<()> {
    let (refused, enosys) = filters().map_err(io::Error::other)?;
    seccompiler::apply_filter_all_threads(&refused).map_err(io::Error::other)?;
    seccompiler::apply_filter_all_threads(&enosys).map_err(io::Error::other)?;
    Ok(())
}

/// Confines this worker by `policy`: an error only where it is `require`.
pub fn confine_isolate(policy: Policy, writable: &[PathBuf]) -> io::Result<()> {
    apply(policy, "isolate itself", || isolate(writable))
}

/// [`restrict`] by `policy`.
pub fn confine_restrict(policy: Policy) -> io::Result<()> {
    apply(policy, "install its seccomp filter", restrict)
}

fn apply(policy: Policy, what: &str, step: impl FnOnce() -> io::Result<()>) -> io::Result<()> {
    if policy == Policy::Off {
        return Ok(());
    }
    match step() {
        Ok(()) => Ok(()),
        Err(e) if policy == Policy::Require => Err(io::Error::new(
            e.kind(),
            format!("the worker could not {what}: {e} ({JAIL_ENV}=require)"),
        )),
        Err(e) => {
            tracing::warn!(
                "the worker could not {what} and runs without it: {e} (set {JAIL_ENV}=off to silence this, or require to refuse)"
            );
            Ok(())
        }
    }
}

/// The filter refusing with `EPERM`, and the one answering `clone3` with `ENOSYS`.
fn filters() -> Result<(BpfProgram, BpfProgram), seccompiler::Error> {
    let arch = std::env::consts::ARCH
        .try_into()
        .map_err(seccompiler::Error::Backend)?;
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = kiln_core::jail::denied_syscalls()
        .map(|(_, number)| (number, Vec::new()))
        .collect();
    rules.insert(libc::SYS_execve, Vec::new());
    rules.insert(libc::SYS_execveat, Vec::new());
    let arg0 = |op, value| SeccompCondition::new(0, SeccompCmpArgLen::Qword, op, value);
    rules.insert(
        libc::SYS_socket,
        vec![SeccompRule::new(vec![arg0(
            SeccompCmpOp::Ne,
            libc::AF_UNIX as u64,
        )?])?],
    );
    let newuser = kiln_core::jail::CLONE_NEWUSER;
    rules.insert(
        libc::SYS_clone,
        vec![SeccompRule::new(vec![arg0(
            SeccompCmpOp::MaskedEq(newuser),
            newuser,
        )?])?],
    );
    let eperm = SeccompAction::Errno(libc::EPERM as u32);
    let refused = SeccompFilter::new(rules, SeccompAction::Allow, eperm, arch)?.try_into()?;
    let clone3 = BTreeMap::from([(libc::SYS_clone3, Vec::new())]);
    let enosys = SeccompAction::Errno(libc::ENOSYS as u32);
    let enosys = SeccompFilter::new(clone3, SeccompAction::Allow, enosys, arch)?.try_into()?;
    Ok((refused, enosys))
}

const MOUNT_ATTR_RDONLY: u64 = 0x1;
const MOUNT_ATTR_NOSUID: u64 = 0x2;
const AT_RECURSIVE: libc::c_int = 0x8000;

/// `struct mount_attr` of mount_setattr(2).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// mount(2) with no file system type and no data: a bind (`source`) or a propagation change.
fn mount(
    source: Option<&std::ffi::CStr>,
    target: &std::ffi::CStr,
    flags: libc::c_ulong,
    what: &str,
) -> io::Result<()> {
    let source = source.map_or(std::ptr::null(), std::ffi::CStr::as_ptr);
    // SAFETY: the strings outlive the call; null pointers are allowed for the unused ones.
    let rc = unsafe {
        libc::mount(
            source,
            target.as_ptr(),
            std::ptr::null(),
            flags,
            std::ptr::null(),
        )
    };
    check(rc, what)
}

/// Sets and clears mount attributes on `path` and every mount below it.
fn set_attr(path: &std::ffi::CStr, set: u64, clear: u64) -> io::Result<()> {
    let attr = MountAttr {
        attr_set: set,
        attr_clr: clear,
        propagation: 0,
        userns_fd: 0,
    };
    // SAFETY: `path` and `attr` outlive the call; the size is the struct's.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            libc::AT_FDCWD,
            path.as_ptr(),
            AT_RECURSIVE,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    check(rc as libc::c_int, "set mount attributes")
}

fn check(rc: libc::c_int, what: &str) -> io::Result<()> {
    if rc == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    Err(io::Error::new(e.kind(), format!("{what}: {e}")))
}
