//! kiln's Linux backend: real `python3`, `node`, `go` and `bash` in live boxes.
//!
//! - [`template`]: template definitions (YAML, seed 002's shape); kiln ships `debian`,
//!   `python`, `node` and `go`.
//! - [`builder`]: builds a definition's read-only, content-addressed root filesystem with
//!   `debootstrap` and `apt-get`.
//! - [`jail`]: the OCI configuration of a box: namespaces, uid mapping, cgroup limits,
//!   mounts, capabilities, seccomp.
//! - [`boxes`]: live boxes started by runc with the guest agent (`kiln-guest`) as PID 1;
//!   commands run through the agent.
//! - [`checkpoint`]: hibernated boxes' CRIU checkpoints on disk, restored on the next request.

pub mod backend;
pub mod boxes;
pub mod builder;
pub mod channel;
pub mod checkpoint;
pub mod intercept;
pub mod jail;
pub mod pool;
pub mod process;
/// The parsers of process and socket tables (public for the fuzz targets).
#[doc(hidden)]
pub mod procs;
pub mod proxy;
pub mod template;
pub mod vm;
pub mod vmm;

use std::path::{Path, PathBuf};

/// Where the guest agent binary is: `KILN_GUEST`, else beside the running executable
/// (`kiln-guest`, as installed), else where `scripts/build-guest` puts it in a source
/// checkout (`target/guest/release/kiln-guest` beside `target/<profile>/kiln`).
pub fn find_agent() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("KILN_GUEST").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(path));
    }
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    [
        dir.join("kiln-guest-static"),
        dir.join("../guest/release/kiln-guest"),
    ]
    .into_iter()
    .find(|p| is_static(p))
}

/// Whether `path` is a statically linked executable (no program interpreter): the agent
/// runs inside root filesystems whose C library kiln does not choose.
pub fn is_static(path: &Path) -> bool {
    let Ok(bytes) = std::fs::read(path) else {
        return false;
    };
    if bytes.len() < 64 || &bytes[..4] != b"\x7fELF" || bytes[4] != 2 {
        return false;
    }
    let u16_at = |at: usize| u16::from_le_bytes([bytes[at], bytes[at + 1]]) as usize;
    let phoff = u64::from_le_bytes(bytes[32..40].try_into().unwrap_or_default()) as usize;
    let (phentsize, phnum) = (u16_at(54), u16_at(56));
    const PT_INTERP: u32 = 3;
    (0..phnum).all(|i| {
        let at = phoff + i * phentsize;
        bytes
            .get(at..at + 4)
            .map(|t| u32::from_le_bytes(t.try_into().unwrap_or_default()))
            != Some(PT_INTERP)
    })
}
