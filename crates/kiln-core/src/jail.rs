//! What every sandbox process kiln starts is refused, whichever backend runs it: one list of
//! system calls for the Linux boxes' seccomp filter (applied by their OCI runtime) and for
//! the WebAssembly workers' own filter (applied by the worker to itself).

/// System calls refused with `EPERM`, by name and number: mounting and namespace changes,
/// kernel modules and kexec, bpf, perf, userfaultfd, the kernel keyring, ptrace and
/// cross-process memory access, reboot and swap, clocks, handles that escape a mount
/// namespace, accounting.
pub fn denied_syscalls() -> impl Iterator<Item = (&'static str, i64)> {
    COMMON.iter().chain(ARCH_ONLY).copied()
}

/// `clone` flag of a new user namespace (refused by a rule on clone's first argument).
pub const CLONE_NEWUSER: u64 = libc::CLONE_NEWUSER as u64;
/// Packet sockets see raw frames: refused.
pub const AF_PACKET: u64 = libc::AF_PACKET as u64;

const COMMON: &[(&str, i64)] = &[
    ("mount", libc::SYS_mount),
    ("umount2", libc::SYS_umount2),
    ("pivot_root", libc::SYS_pivot_root),
    ("chroot", libc::SYS_chroot),
    ("unshare", libc::SYS_unshare),
    ("setns", libc::SYS_setns),
    ("move_mount", libc::SYS_move_mount),
    ("open_tree", libc::SYS_open_tree),
    ("fsopen", libc::SYS_fsopen),
    ("fsconfig", libc::SYS_fsconfig),
    ("fsmount", libc::SYS_fsmount),
    ("fspick", libc::SYS_fspick),
    ("mount_setattr", libc::SYS_mount_setattr),
    ("kexec_load", libc::SYS_kexec_load),
    ("kexec_file_load", libc::SYS_kexec_file_load),
    ("init_module", libc::SYS_init_module),
    ("finit_module", libc::SYS_finit_module),
    ("delete_module", libc::SYS_delete_module),
    ("bpf", libc::SYS_bpf),
    ("perf_event_open", libc::SYS_perf_event_open),
    ("userfaultfd", libc::SYS_userfaultfd),
    ("keyctl", libc::SYS_keyctl),
    ("add_key", libc::SYS_add_key),
    ("request_key", libc::SYS_request_key),
    ("ptrace", libc::SYS_ptrace),
    ("process_vm_readv", libc::SYS_process_vm_readv),
    ("process_vm_writev", libc::SYS_process_vm_writev),
    ("kcmp", libc::SYS_kcmp),
    ("reboot", libc::SYS_reboot),
    ("swapon", libc::SYS_swapon),
    ("swapoff", libc::SYS_swapoff),
    ("acct", libc::SYS_acct),
    ("settimeofday", libc::SYS_settimeofday),
    ("clock_settime", libc::SYS_clock_settime),
    ("clock_adjtime", libc::SYS_clock_adjtime),
    ("adjtimex", libc::SYS_adjtimex),
    ("open_by_handle_at", libc::SYS_open_by_handle_at),
    ("name_to_handle_at", libc::SYS_name_to_handle_at),
];

#[cfg(target_arch = "x86_64")]
const ARCH_ONLY: &[(&str, i64)] = &[("iopl", libc::SYS_iopl), ("ioperm", libc::SYS_ioperm)];
#[cfg(not(target_arch = "x86_64"))]
const ARCH_ONLY: &[(&str, i64)] = &[];
