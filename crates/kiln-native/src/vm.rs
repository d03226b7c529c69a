//! The microVM tier: a Linux template's root filesystem booted as a virtual machine under
//! QEMU's `microvm` machine, its PID 1 the same guest agent as in boxes (over a virtio serial
//! port), and the VMM itself jailed as a box is (runc: its own user namespace, pid, mount,
//! network, ipc and uts namespaces, a cgroup, the boxes' seccomp filter, no capabilities, no
//! host mounts but what it serves the VM, and QEMU's own `-sandbox`).
//!
//! What a VM boots, all read-only:
//! - Debian's kernel (`vmlinux`, booted through PVH) and its virtio, ext4, overlay and 9p
//!   modules, with Debian's static busybox and kiln's init (`scripts/vm/init`), fetched by
//!   `scripts/build-vm` into the cache (`vm/current`);
//! - an initramfs kiln packs of those and its agent ([`initramfs`]);
//! - the template's root filesystem as an ext4 image ([`root_image`]), its owners shifted
//!   back from the boxes' host uids to the VM's own (root 0, the user 1000), made once.
//!
//! In the VM the root image is the lower layer of an overlay whose writable layer is a tmpfs;
//! the sandbox's workspace comes over 9p from the host folder boxes bind. QEMU runs in the
//! boxes' user namespace (the box's root is host uid `uid_base`), so a file the VM's user
//! (1000) writes in the workspace is the host's `uid_base + 1000`'s, as in a box.
//!
//! Acceleration: KVM where `/dev/kvm` has real VT-x/AMD-V (not PVM), else QEMU's TCG (a
//! software CPU: correct, slower), said at start ([`accel`]).

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::jail::BoxLimits;

/// What `scripts/build-vm` fetched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmAssets {
    /// `vm/current` in the cache, resolved.
    pub dir: PathBuf,
    /// The kernel's release (`6.1.0-56-amd64`).
    pub kernel: String,
}

/// How VMs are accelerated here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    Kvm,
    Tcg,
}

impl Accel {
    pub fn name(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// KVM where `/dev/kvm` is backed by hardware virtualisation (VT-x/AMD-V flags, no PVM);
/// TCG otherwise, with why.
pub fn accel() -> (Accel, String) {
    let kvm = Path::new("/dev/kvm").exists();
    let pvm = Path::new("/sys/module/kvm_pvm").exists();
    let hardware = std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|c| {
        c.lines()
            .filter(|l| l.starts_with("flags"))
            .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"))
    });
    match (kvm, pvm, hardware) {
        (true, false, true) => (Accel::Kvm, "KVM (VT-x/AMD-V)".into()),
        (true, true, _) => (
            Accel::Tcg,
            "QEMU's TCG, a software CPU: /dev/kvm here is PVM, which stock guest kernels do not run under".into(),
        ),
        (true, false, false) => (
            Accel::Tcg,
            "QEMU's TCG, a software CPU: /dev/kvm has no VT-x/AMD-V behind it".into(),
        ),
        (false, _, _) => (Accel::Tcg, "QEMU's TCG, a software CPU: no /dev/kvm".into()),
    }
}

impl VmAssets {
    /// The assets in `cache` (kiln's cache root), or why there are none.
    pub fn find(cache: &Path) -> Result<VmAssets, String> {
        let current = cache.join("vm/current");
        let dir = std::fs::canonicalize(&current).map_err(|_| {
            format!(
                "no microVM kernel in {} (scripts/build-vm fetches it)",
                current.display()
            )
        })?;
        let manifest: Value = std::fs::read(dir.join("manifest.json"))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .ok_or_else(|| {
                format!(
                    "{} has no readable manifest.json (run scripts/build-vm again)",
                    dir.display()
                )
            })?;
        for file in ["vmlinux", "busybox", "init", "modules/order"] {
            if !dir.join(file).is_file() {
                return Err(format!(
                    "{} lacks {file} (run scripts/build-vm again)",
                    dir.display()
                ));
            }
        }
        Ok(VmAssets {
            kernel: manifest["kernel"].as_str().unwrap_or("?").to_string(),
            dir,
        })
    }

    pub fn vmlinux(&self) -> PathBuf {
        self.dir.join("vmlinux")
    }
}

/// Everything a host needs to boot VMs, found (and the initramfs packed) once.
#[derive(Debug, Clone)]
pub struct VmTier {
    /// What runs them: QEMU, or Firecracker ([`crate::vmm`]).
    pub vmm: std::sync::Arc<dyn crate::vmm::Vmm>,
    pub accel: Accel,
    /// Why that acceleration (said at start and by `kiln doctor`).
    pub accel_why: String,
    pub assets: VmAssets,
    /// The kernel (`assets`' vmlinux).
    pub vmlinux: PathBuf,
    pub initrd: PathBuf,
}

impl VmTier {
    /// The VMM `vmm` names (`qemu` or `firecracker`), the assets in `cache` and an
    /// initramfs with `agent` packed into `state_dir`; or why VMs cannot run here.
    pub fn new(cache: &Path, agent: &Path, state_dir: &Path, vmm: &str) -> Result<VmTier, String> {
        let (accel, accel_why) = accel();
        let vmm: std::sync::Arc<dyn crate::vmm::Vmm> = match vmm {
            "qemu" => std::sync::Arc::new(crate::vmm::Qemu {
                binary: find_qemu()
                    .ok_or("no qemu-system-x86_64 on PATH (apt-get install qemu-system-x86)")?,
            }),
            "firecracker" => {
                let binary = find_on_path("firecracker").ok_or(
                    "no firecracker on PATH (Firecracker's release binary; kiln does not install it)",
                )?;
                if accel != Accel::Kvm {
                    return Err(format!(
                        "Firecracker needs KVM backed by VT-x/AMD-V, and this host has none: {accel_why} (use --vmm qemu)"
                    ));
                }
                std::sync::Arc::new(crate::vmm::Firecracker { binary })
            }
            other => return Err(format!("unknown VMM {other:?} (qemu or firecracker)")),
        };
        let assets = VmAssets::find(cache)?;
        let initrd = initramfs(&assets, agent, &state_dir.join("vm"))
            .map_err(|e| format!("packing the VMs' initramfs: {e}"))?;
        Ok(VmTier {
            vmlinux: assets.vmlinux(),
            vmm,
            accel,
            accel_why,
            assets,
            initrd,
        })
    }
}

/// The QEMU that runs VMs: `qemu-system-x86_64` on PATH.
pub fn find_qemu() -> Option<PathBuf> {
    find_on_path("qemu-system-x86_64")
}

/// `name` in a folder of PATH.
pub fn find_on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    })
}

/// Appends one entry to a `newc` cpio archive.
fn cpio_entry(out: &mut Vec<u8>, ino: &mut u32, name: &str, mode: u32, data: &[u8]) {
    let fields = [
        *ino,
        mode,
        0,
        0,
        if mode & 0o040000 != 0 { 2 } else { 1 },
        0,
        data.len() as u32,
        0,
        0,
        0,
        0,
        name.len() as u32 + 1,
        0,
    ];
    *ino += 1;
    out.extend_from_slice(b"070701");
    for field in fields {
        out.extend_from_slice(format!("{field:08X}").as_bytes());
    }
    out.extend_from_slice(name.as_bytes());
    out.push(0);
    while !out.len().is_multiple_of(4) {
        out.push(0);
    }
    out.extend_from_slice(data);
    while !out.len().is_multiple_of(4) {
        out.push(0);
    }
}

/// The initramfs of VMs booting `assets` with `agent`: an uncompressed `newc` archive (the
/// kernel unpacks it fastest) of the init, busybox, the modules and the agent, written once
/// into `dir` under a name keyed by all of them.
pub fn initramfs(assets: &VmAssets, agent: &Path, dir: &Path) -> std::io::Result<PathBuf> {
    use sha2::{Digest, Sha256};
    let read = |p: &Path| std::fs::read(p);
    let order = std::fs::read_to_string(assets.dir.join("modules/order"))?;
    let mut files: Vec<(String, u32, Vec<u8>)> = vec![
        ("init".into(), 0o100755, read(&assets.dir.join("init"))?),
        (
            "bin/busybox".into(),
            0o100755,
            read(&assets.dir.join("busybox"))?,
        ),
        ("agent".into(), 0o100755, read(agent)?),
        ("modules/order".into(), 0o100644, order.clone().into_bytes()),
    ];
    for module in order.lines().filter(|l| !l.is_empty()) {
        files.push((
            format!("modules/{module}.ko"),
            0o100644,
            read(&assets.dir.join(format!("modules/{module}.ko")))?,
        ));
    }
    let mut hash = Sha256::new();
    for (name, _, data) in &files {
        hash.update(name.as_bytes());
        hash.update((data.len() as u64).to_le_bytes());
        hash.update(data);
    }
    let path = dir.join(format!(
        "vm-initrd-{}.cpio",
        &hex::encode(hash.finalize())[..16]
    ));
    if path.is_file() {
        return Ok(path);
    }
    let mut out = Vec::new();
    let mut ino = 1;
    for folder in ["bin", "modules", "dev", "proc", "sys"] {
        cpio_entry(&mut out, &mut ino, folder, 0o040755, &[]);
    }
    for (name, mode, data) in &files {
        cpio_entry(&mut out, &mut ino, name, *mode, data);
    }
    cpio_entry(&mut out, &mut ino, "TRAILER!!!", 0, &[]);
    std::fs::create_dir_all(dir)?;
    let partial = path.with_extension("partial");
    std::fs::write(&partial, &out)?;
    std::fs::rename(&partial, &path)?;
    Ok(path)
}

/// The root image of `template`'s VMs: its root filesystem as ext4, owners shifted back from
/// `uid_base` (the boxes' host uids) to the VM's own, made once beside the template's folder
/// (`vm-root.ext4`). `mkfs.ext4 -d` runs in a user namespace that maps `uid_base` to 0, so it
/// reads every file with the owner the VM must see; it reads the tree through a descriptor
/// kiln opened, so the cache's own folders need not be open to that uid.
pub fn root_image(rootfs: &Path, uid_base: u32) -> Result<PathBuf, String> {
    let template_dir = rootfs
        .parent()
        .ok_or("a template's root filesystem has no folder")?;
    let image = template_dir.join("vm-root.ext4");
    if image.is_file() {
        return Ok(image);
    }
    let size: u64 = dir_size(rootfs);
    let mb = ((size * 13 / 10) >> 20) + 128;
    // Written through a descriptor too (the mapped uid cannot reach the cache), aside, then
    // moved into place.
    let partial = template_dir.join(format!(
        ".vm-root-{}.ext4",
        hex::encode(crate::boxes::random_bytes())
    ));
    let out = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&partial)
        .and_then(|f| std::os::unix::fs::fchown(&f, Some(uid_base), Some(uid_base)).map(|()| f))
        .map_err(|e| format!("{}: {e}", partial.display()))?;
    let status = run_mapped(
        uid_base,
        rootfs,
        &out,
        &[
            "mkfs.ext4",
            "-q",
            "-F",
            "-L",
            "kiln-root",
            "-E",
            "root_owner=0:0",
            "-d",
            "@ROOT",
            "@OUT",
            &format!("{mb}M"),
        ],
    );
    drop(out);
    let result = status.and_then(|()| {
        std::fs::rename(&partial, &image).map_err(|e| format!("{}: {e}", image.display()))
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    result.map(|()| image)
}

/// The smallest writable layer a VM gets, whatever its disk limit.
const MIN_LAYER_BYTES: u64 = 64 << 20;

/// Makes `path` a fresh VM writable layer: a sparse file of `bytes` (the box's disk limit),
/// an ext4 filesystem without a journal (a layer goes with its VM), owned by `uid_base` (the
/// VMM's uid in its jail). Made anew (never following a link there); mkfs runs as kiln, on a
/// file no guest has touched.
pub fn make_layer(path: &Path, bytes: u64, uid_base: u32) -> Result<(), String> {
    let file = fresh_file(path, uid_base)?;
    file.set_len(bytes.max(MIN_LAYER_BYTES))
        .map_err(|e| format!("{}: {e}", path.display()))?;
    drop(file);
    let out = std::process::Command::new("mkfs.ext4")
        .args([
            "-q",
            "-F",
            "-L",
            "kiln-layer",
            "-O",
            "^has_journal",
            "-m",
            "0",
        ])
        .args(["-E", "lazy_itable_init=1,root_owner=0:0,nodiscard"])
        .arg(path)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("mkfs.ext4 (apt-get install e2fsprogs): {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "mkfs.ext4 {}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

/// A new, empty file at `path` owned by `uid_base`: what was there is removed first (a file
/// or a link, not followed), and the new one is made exclusively.
fn fresh_file(path: &Path, uid_base: u32) -> Result<std::fs::File, String> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(format!("{}: {e}", path.display())),
    }
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .and_then(|f| std::os::unix::fs::fchown(&f, Some(uid_base), Some(uid_base)).map(|()| f))
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// Copies the layer image `from` (a snapshot's) to `to`, its holes kept (only the extents
/// with data are read and written): a clone's own writable layer, as its template VM's was
/// when the snapshot was taken.
pub fn copy_layer(from: &Path, to: &Path, uid_base: u32) -> Result<(), String> {
    use std::io::{Read, Seek, SeekFrom, Write};
    use std::os::fd::AsRawFd;
    let failed = |e: std::io::Error| format!("copying {} to {}: {e}", from.display(), to.display());
    let mut source = std::fs::File::open(from).map_err(failed)?;
    let length = source.metadata().map_err(failed)?.len();
    let mut target = fresh_file(to, uid_base)?;
    target.set_len(length).map_err(failed)?;
    let mut at: i64 = 0;
    let mut buffer = vec![0u8; 1 << 20];
    while (at as u64) < length {
        // SAFETY: lseek(2) on a descriptor this function owns; integers only.
        let data = unsafe { libc::lseek(source.as_raw_fd(), at, libc::SEEK_DATA) };
        if data < 0 {
            break; // ENXIO: only a hole is left
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(source.as_raw_fd(), data, libc::SEEK_HOLE) };
        let end = if hole < 0 { length as i64 } else { hole };
        source.seek(SeekFrom::Start(data as u64)).map_err(failed)?;
        target.seek(SeekFrom::Start(data as u64)).map_err(failed)?;
        let mut left = (end - data) as usize;
        while left > 0 {
            let chunk = left.min(buffer.len());
            source.read_exact(&mut buffer[..chunk]).map_err(failed)?;
            target.write_all(&buffer[..chunk]).map_err(failed)?;
            left -= chunk;
        }
        at = end;
    }
    Ok(())
}

fn dir_size(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if let Ok(meta) = entry.metadata() {
                total += meta.blocks() * 512;
                if meta.is_dir() {
                    stack.push(entry.path());
                }
            }
        }
    }
    total
}

/// Runs `argv` (`@ROOT` in it standing for `root` and `@OUT` for `out`, both reached through
/// descriptors) as root of a new user namespace that maps 65536 ids from `uid_base` to 0.
fn run_mapped(
    uid_base: u32,
    root: &Path,
    out: &std::fs::File,
    argv: &[&str],
) -> Result<(), String> {
    use std::ffi::CString;
    use std::os::fd::AsRawFd;
    let dir = std::fs::File::open(root).map_err(|e| format!("{}: {e}", root.display()))?;
    let dir_path = format!("/proc/self/fd/{}", dir.as_raw_fd());
    let out_path = format!("/proc/self/fd/{}", out.as_raw_fd());
    let args: Vec<CString> = argv
        .iter()
        .map(|a| CString::new(a.replace("@ROOT", &dir_path).replace("@OUT", &out_path)))
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    let mut pointers: Vec<*const libc::c_char> = args.iter().map(|a| a.as_ptr()).collect();
    pointers.push(std::ptr::null());
    let (ready_r, ready_w) = std::io::pipe().map_err(|e| e.to_string())?;
    let (go_r, go_w) = std::io::pipe().map_err(|e| e.to_string())?;
    let (ready_r, ready_w, go_r, go_w) = (
        ready_r.as_raw_fd(),
        ready_w.as_raw_fd(),
        go_r.as_raw_fd(),
        go_w.as_raw_fd(),
    );
    // The descriptors of the tree and the image must reach the program.
    for fd in [dir.as_raw_fd(), out.as_raw_fd()] {
        // SAFETY: fcntl on a descriptor we own, clearing its close-on-exec flag.
        unsafe { libc::fcntl(fd, libc::F_SETFD, 0) };
    }
    // SAFETY: the child calls only async-signal-safe functions (unshare, read, write,
    // setresgid, setresuid, execvp, _exit) on memory prepared before the fork.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: as above: plain system calls in the forked child, then exec or _exit.
        unsafe {
            let mut byte = 0u8;
            if libc::unshare(libc::CLONE_NEWUSER) != 0 {
                libc::_exit(126);
            }
            libc::write(ready_w, (&raw const byte).cast(), 1);
            if libc::read(go_r, (&raw mut byte).cast(), 1) != 1 {
                libc::_exit(126);
            }
            if libc::setresgid(0, 0, 0) != 0 || libc::setresuid(0, 0, 0) != 0 {
                libc::_exit(126);
            }
            libc::execvp(pointers[0], pointers.as_ptr());
            libc::_exit(127);
        }
    }
    if pid < 0 {
        return Err(format!("fork: {}", std::io::Error::last_os_error()));
    }
    let mut byte = 0u8;
    // SAFETY: reading one byte into a live local from a pipe we own.
    let got = unsafe { libc::read(ready_r, (&raw mut byte).cast(), 1) };
    let mapped = if got == 1 {
        let map = format!("0 {uid_base} 65536\n");
        std::fs::write(format!("/proc/{pid}/uid_map"), &map)
            .and_then(|()| std::fs::write(format!("/proc/{pid}/setgroups"), "deny"))
            .and_then(|()| std::fs::write(format!("/proc/{pid}/gid_map"), &map))
    } else {
        Err(std::io::Error::other("the child did not start"))
    };
    // SAFETY: writing one byte from a live local to a pipe we own; the child goes on (or, on
    // a failed map, ends at its setresuid).
    unsafe { libc::write(go_w, (&raw const byte).cast(), 1) };
    let mut status = 0;
    // SAFETY: waiting for the child we forked, into a live local.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    // The pipes' descriptors close with their owners here.
    mapped.map_err(|e| format!("mapping the user namespace: {e}"))?;
    if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0 {
        Ok(())
    } else {
        Err(format!(
            "{} failed (status {status:#x}) in the mapped user namespace",
            argv[0]
        ))
    }
}

/// Where a VM's memory comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmMemory<'a> {
    /// Its own, booted cold.
    Own,
    /// A snapshot's template VM: its RAM a file in `snapshot` (shared, so a migration with
    /// `x-ignore-shared` writes only the devices' state), its workspace mounted later.
    Template { snapshot: &'a Path },
    /// A clone of the snapshot in `snapshot`: its RAM file mapped copy-on-write (private:
    /// what the clone writes never reaches the file; QEMU 7.2 cannot map a file it opened
    /// read-only so, hence a fingerprint check before each clone), the devices' state read
    /// from descriptor 3, its workspace mounted after the restore.
    Clone { snapshot: &'a Path },
}

/// What one VM is started with.
pub struct VmSpec<'a> {
    pub memory: VmMemory<'a>,
    pub vmm: &'a dyn crate::vmm::Vmm,
    pub accel: Accel,
    pub vmlinux: &'a Path,
    pub initrd: &'a Path,
    pub root_image: &'a Path,
    /// The VM's writable layer: an ext4 image of the box's disk limit ([`make_layer`]).
    pub layer: &'a Path,
    /// The host folder served as the workspace (9p), if any.
    pub workspace: Option<&'a Path>,
    /// Where the workspace is in the VM (the template's working dir).
    pub working_dir: &'a str,
    /// The folder QEMU writes its sockets and console log in (bound at `/kiln/run`).
    pub run_dir: &'a Path,
    pub limits: BoxLimits,
    pub uid_base: u32,
    pub cgroup: &'a str,
}

/// Memory QEMU itself may use beyond the VM's RAM (its own code, TCG's translation cache of
/// 64 MiB, device buffers).
const VMM_OVERHEAD: u64 = 192 << 20;

/// The VM's RAM: the box's memory cap, at least 128 MiB.
pub(crate) fn ram_mib(limits: &BoxLimits) -> u64 {
    (limits.memory_bytes >> 20).max(128)
}

/// QEMU's command line, with paths as the jail shows them.
pub fn qemu_args(spec: &VmSpec<'_>) -> Vec<String> {
    let ram = ram_mib(&spec.limits);
    let cmdline = crate::vmm::kernel_cmdline(spec, "serial");
    let accel = match spec.accel {
        Accel::Kvm => "kvm".to_string(),
        Accel::Tcg => "tcg,tb-size=64".to_string(),
    };
    let cpus = (spec.limits.vcpus.ceil() as u64).clamp(1, 16);
    let mut args: Vec<String> = [
        "/usr/bin/qemu-system-x86_64",
        "-M",
        "microvm",
        "-accel",
        &accel,
        "-m",
        &format!("{ram}M"),
        "-smp",
        &cpus.to_string(),
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-no-reboot",
        "-sandbox",
        "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
        "-serial",
        "file:/kiln/run/console.log",
        "-kernel",
        "/kiln/vmlinux",
        "-initrd",
        "/kiln/initrd",
        "-append",
        &cmdline,
        "-drive",
        "id=root,file=/kiln/root.ext4,format=raw,if=none,readonly=on",
        "-device",
        "virtio-blk-device,drive=root",
        "-drive",
        // An error writing the image (the sandbox's disk full) is the guest's I/O error,
        // never a stopped VM (QEMU's default on ENOSPC).
        "id=layer,file=/kiln/layer.img,format=raw,if=none,discard=unmap,werror=report,rerror=report",
        "-device",
        "virtio-blk-device,drive=layer",
        "-device",
        "virtio-serial-device",
        "-chardev",
        "socket,id=agent,path=/kiln/run/agent.sock,server=on,wait=off",
        "-device",
        "virtserialport,chardev=agent,name=kiln.agent",
        "-object",
        "rng-random,id=rng,filename=/dev/urandom",
        "-device",
        "virtio-rng-device,rng=rng",
        "-qmp",
        "unix:/kiln/run/qmp.sock,server=on,wait=off",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    match spec.memory {
        VmMemory::Own => {}
        VmMemory::Template { .. } | VmMemory::Clone { .. } => {
            let clone = matches!(spec.memory, VmMemory::Clone { .. });
            args.extend([
                "-object".to_string(),
                format!(
                    "memory-backend-file,id=mem,size={ram}M,mem-path=/kiln/snap/ram,{}",
                    if clone { "share=off" } else { "share=on" }
                ),
                "-machine".to_string(),
                "memory-backend=mem".to_string(),
            ]);
            if clone {
                args.extend(["-incoming".to_string(), "defer".to_string()]);
            } else {
                // The template VM (kiln's own, no user code in it) writes its state with
                // `migrate exec:`, which needs a shell: its sandbox lets it spawn one.
                if let Some(at) = args.iter().position(|a| a.starts_with("on,obsolete=deny")) {
                    args[at] =
                        "on,obsolete=deny,elevateprivileges=deny,resourcecontrol=deny".into();
                }
            }
        }
    }
    if spec.workspace.is_some() || spec.memory != VmMemory::Own {
        args.extend(
            [
                "-fsdev",
                "local,id=ws,path=/kiln/workspace,security_model=passthrough",
                "-device",
                "virtio-9p-device,fsdev=ws,mount_tag=workspace",
            ]
            .map(String::from),
        );
    }
    args
}

/// The folders and links the VMM's root needs (made before runc, which cannot make them as
/// the mapped root in a folder of the host's root): the host's `/usr` is bound read-only
/// (QEMU and its libraries), the rest are mount points.
pub fn make_vmm_root(root: &Path, workspace: bool) -> std::io::Result<()> {
    for dir in [
        "usr",
        "proc",
        "dev",
        "sys",
        "tmp",
        "kiln",
        "kiln/run",
        "kiln/snap",
        "etc",
    ] {
        std::fs::create_dir_all(root.join(dir))?;
    }
    if workspace {
        std::fs::create_dir_all(root.join("kiln/workspace"))?;
    }
    for file in [
        "kiln/vmm",
        "kiln/vmlinux",
        "kiln/initrd",
        "kiln/root.ext4",
        "kiln/layer.img",
        "kiln/snap/ram",
        "kiln/snap/state",
    ] {
        std::fs::write(root.join(file), b"")?;
    }
    for (link, to) in [
        ("bin", "usr/bin"),
        ("lib", "usr/lib"),
        ("lib64", "usr/lib64"),
        ("sbin", "usr/sbin"),
    ] {
        if !root.join(link).exists() {
            std::os::unix::fs::symlink(to, root.join(link))?;
        }
    }
    Ok(())
}

/// The OCI bundle that runs QEMU in the boxes' jail: the boxes' namespaces, uid mapping,
/// seccomp filter and cgroup (its memory the VM's RAM plus QEMU's own), no capabilities, the
/// host's `/usr` read-only and only what it serves the VM bound in.
pub fn vmm_config(spec: &VmSpec<'_>, jail_box: Value) -> Value {
    let mut config = jail_box;
    let bind = |source: &Path, destination: &str, mode: &str| {
        crate::jail::bind(&source.to_string_lossy(), destination, mode)
    };
    let mut mounts = vec![
        json!({"destination": "/proc", "type": "proc", "source": "proc",
               "options": ["nosuid", "noexec", "nodev"]}),
        json!({"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
               "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}),
        json!({"destination": "/sys", "type": "sysfs", "source": "sysfs",
               "options": ["nosuid", "noexec", "nodev", "ro"]}),
        json!({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
               "options": ["nosuid", "nodev", "mode=1777", "size=16m"]}),
        bind(Path::new("/usr"), "/usr", "ro"),
        bind(spec.vmm.binary(), "/kiln/vmm", "ro"),
        bind(spec.vmlinux, "/kiln/vmlinux", "ro"),
        bind(spec.initrd, "/kiln/initrd", "ro"),
        bind(spec.root_image, "/kiln/root.ext4", "ro"),
        bind(spec.layer, "/kiln/layer.img", "rw"),
        bind(spec.run_dir, "/kiln/run", "rw"),
    ];
    match spec.memory {
        VmMemory::Own => {}
        VmMemory::Template { snapshot } => mounts.push(bind(snapshot, "/kiln/snap", "rw")),
        // A clone sees the RAM file alone (QEMU: its state comes on descriptor 3), or the
        // RAM and state files (Firecracker, which maps the RAM file privately, read-only
        // here): it can neither replace them nor touch the snapshot's other files.
        VmMemory::Clone { snapshot } if spec.vmm.clone_reads_state_file() => {
            mounts.push(bind(&snapshot.join("ram"), "/kiln/snap/ram", "ro"));
            mounts.push(bind(&snapshot.join("state"), "/kiln/snap/state", "ro"));
        }
        VmMemory::Clone { snapshot } => {
            mounts.push(bind(&snapshot.join("ram"), "/kiln/snap/ram", "rw"))
        }
    }
    if let Some(workspace) = spec.workspace {
        mounts.push(bind(workspace, "/kiln/workspace", "rw"));
    }
    config["mounts"] = Value::Array(mounts);
    let args = spec.vmm.argv(spec);
    config["process"]["args"] = json!(args);
    config["process"]["cwd"] = json!("/");
    // What 9p's passthrough needs to write the workspace as the VM's users (owners kept,
    // over files of the boxes' uid range only: the jail's user namespace); nothing else,
    // and nothing at all for a VMM that shares no folder.
    let caps: &[&str] = if spec.vmm.shares_folders() {
        &["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID"]
    } else {
        &[]
    };
    config["process"]["capabilities"] =
        json!({"bounding": caps, "effective": caps, "permitted": caps});
    let memory = ram_mib(&spec.limits) * (1 << 20) + VMM_OVERHEAD;
    config["linux"]["resources"]["memory"] = json!({"limit": memory, "swap": memory});
    // QEMU's own threads, not the guest's processes (those the guest kernel counts).
    config["linux"]["resources"]["pids"] = json!({"limit": 64});
    if spec.accel == Accel::Kvm {
        config["linux"]["devices"] = json!([{"path": "/dev/kvm", "type": "c", "major": 10,
            "minor": 232, "fileMode": 0o660, "uid": 0, "gid": 0}]);
        config["linux"]["resources"]["devices"] = json!([
            {"allow": false, "access": "rwm"},
            {"allow": true, "type": "c", "major": 10, "minor": 232, "access": "rw"},
        ]);
    }
    config
}

/// A QMP connection to a VM's QEMU (`/kiln/run/qmp.sock`).
pub struct Qmp {
    lines: tokio::io::Lines<tokio::io::BufReader<tokio::net::unix::OwnedReadHalf>>,
    write: tokio::net::unix::OwnedWriteHalf,
}

impl Qmp {
    /// Connects (waiting up to 15 s for QEMU to make the socket) and negotiates.
    pub async fn connect(path: &Path) -> Result<Qmp, String> {
        use tokio::io::AsyncBufReadExt;
        let started = std::time::Instant::now();
        let stream = loop {
            match tokio::net::UnixStream::connect(path).await {
                Ok(stream) => break stream,
                Err(e) if started.elapsed() > std::time::Duration::from_secs(15) => {
                    return Err(format!("QMP {}: {e}", path.display()));
                }
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(10)).await,
            }
        };
        let (read, write) = stream.into_split();
        let mut qmp = Qmp {
            lines: tokio::io::BufReader::new(read).lines(),
            write,
        };
        qmp.lines
            .next_line()
            .await
            .map_err(|e| e.to_string())?
            .ok_or("QMP closed before its greeting")?;
        qmp.execute("qmp_capabilities", json!({})).await?;
        Ok(qmp)
    }

    /// Runs one command: its `return`, or its error.
    pub async fn execute(&mut self, command: &str, arguments: Value) -> Result<Value, String> {
        use tokio::io::AsyncWriteExt;
        let line = json!({"execute": command, "arguments": arguments}).to_string() + "\n";
        self.write
            .write_all(line.as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        loop {
            let line = self
                .lines
                .next_line()
                .await
                .map_err(|e| e.to_string())?
                .ok_or_else(|| format!("QMP closed during {command}"))?;
            let reply: Value = serde_json::from_str(&line).map_err(|e| e.to_string())?;
            if let Some(found) = reply.get("return") {
                return Ok(found.clone());
            }
            if let Some(error) = reply.get("error") {
                return Err(format!("QMP {command}: {}", error["desc"]));
            }
            // An event, not an answer.
        }
    }

    /// Waits for the migration in either direction to end: `Ok` once completed.
    pub async fn migrated(&mut self, timeout: std::time::Duration) -> Result<(), String> {
        let started = std::time::Instant::now();
        loop {
            let state = self.execute("query-migrate", json!({})).await?;
            match state["status"].as_str() {
                Some("completed") => return Ok(()),
                Some("failed") | Some("cancelled") => {
                    return Err(format!("the migration failed: {}", state["error-desc"]));
                }
                _ if started.elapsed() > timeout => {
                    return Err(format!("the migration took over {timeout:?}"));
                }
                _ => tokio::time::sleep(std::time::Duration::from_millis(2)).await,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cpio_entry_is_newc_padded_to_four_bytes() {
        let mut out = Vec::new();
        let mut ino = 1;
        cpio_entry(&mut out, &mut ino, "init", 0o100755, b"#!/bin/sh\n");
        assert!(out.starts_with(b"070701"));
        assert_eq!(out.len() % 4, 0);
        assert_eq!(&out[6..14], b"00000001");
        // 110-byte header, "init\0", padded to 116, 10 bytes of data padded to 128.
        assert_eq!(out.len(), 128);
        assert_eq!(ino, 2);
    }

    #[test]
    fn qemu_gets_a_software_cpu_with_a_tsc_rate_and_the_workspace_over_9p() {
        let limits = BoxLimits {
            memory_bytes: 512 << 20,
            vcpus: 1.5,
            pids: 128,
            disk_bytes: 1 << 30,
            weight: 100,
        };
        let spec = VmSpec {
            memory: VmMemory::Own,
            vmm: &crate::vmm::Qemu {
                binary: "/usr/bin/qemu-system-x86_64".into(),
            },
            accel: Accel::Tcg,
            vmlinux: Path::new("/v"),
            initrd: Path::new("/i"),
            root_image: Path::new("/r"),
            layer: Path::new("/l"),
            workspace: Some(Path::new("/w")),
            working_dir: "/workspace",
            run_dir: Path::new("/run"),
            limits,
            uid_base: 100_000,
            cgroup: "/kiln/x",
        };
        let args = qemu_args(&spec).join(" ");
        for part in [
            "-accel tcg,tb-size=64",
            "-m 512M",
            "-smp 2",
            "tsc_early_khz=",
            "drive=layer",
            "mount_tag=workspace",
            "-sandbox on,",
        ] {
            assert!(args.contains(part), "{part} not in {args}");
        }
        let kvm = qemu_args(&VmSpec {
            accel: Accel::Kvm,
            workspace: None,
            ..spec
        })
        .join(" ");
        assert!(
            !kvm.contains("tsc_early_khz") && !kvm.contains("9p"),
            "{kvm}"
        );
    }

    #[test]
    fn firecracker_runs_bound_in_with_no_capabilities_and_a_clone_reads_its_files_read_only() {
        let vmm = crate::vmm::Firecracker {
            binary: "/opt/fc/firecracker".into(),
        };
        let snapshot = Path::new("/snap");
        let spec = VmSpec {
            memory: VmMemory::Clone { snapshot },
            vmm: &vmm,
            accel: Accel::Kvm,
            vmlinux: Path::new("/v"),
            initrd: Path::new("/i"),
            root_image: Path::new("/r"),
            layer: Path::new("/l"),
            workspace: None,
            working_dir: "/workspace",
            run_dir: Path::new("/run"),
            limits: BoxLimits {
                memory_bytes: 256 << 20,
                vcpus: 1.0,
                pids: 64,
                disk_bytes: 1 << 30,
                weight: 100,
            },
            uid_base: 100_000,
            cgroup: "/kiln/x",
        };
        let config = vmm_config(&spec, json!({"process": {}, "linux": {"resources": {}}}));
        assert_eq!(config["process"]["args"][0], "/kiln/vmm");
        assert_eq!(config["process"]["capabilities"]["effective"], json!([]));
        let mounts = config["mounts"].to_string();
        for (source, destination) in [
            ("/opt/fc/firecracker", "/kiln/vmm"),
            ("/snap/ram", "/kiln/snap/ram"),
            ("/snap/state", "/kiln/snap/state"),
        ] {
            let bound = config["mounts"].as_array().unwrap().iter().any(|m| {
                m["source"] == source
                    && m["destination"] == destination
                    && m["options"].to_string().contains("\"ro\"")
            });
            assert!(bound, "{source} at {destination}, read-only: {mounts}");
        }
        assert!(!mounts.contains("/kiln/workspace"), "{mounts}");
    }
}
