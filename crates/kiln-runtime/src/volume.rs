//! Size-capped workspaces: an ext4 file system in a sparse image file, loop-mounted for the
//! sandbox's life. A Linux sandbox's code writes its workspace with real system calls, so
//! only the kernel can hold it to a size: past the volume's size (or its inodes) every write
//! fails with `ENOSPC` inside the box, and the host's disk never fills.
//!
//! ```text
//! sandboxes/<id>/volume.img        the image (sparse: it costs what the files use, ~5 MB empty)
//! sandboxes/<id>/volume/           its mount point (nosuid, nodev, noatime)
//! sandboxes/<id>/volume/workspace/ the workspace, bound into the box
//! sandboxes/<id>/volume/.tmp/      the host's write scratch (same file system, out of reach)
//! ```
//!
//! The image lives beside the mount point, never inside anything a guest can reach, so the
//! file system's metadata is only ever written by the kernel, not crafted by a guest.
//! Attaching is idempotent: kiln mounts every volume again when it starts (a mount left by
//! a killed kiln is reused as it is). Needs root and `mkfs.ext4` (e2fsprogs).

use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The smallest volume: ext4 needs room for its own metadata and a journal.
pub const MIN_BYTES: u64 = 16 << 20;
/// The largest volume (its image is sparse: the size is a cap, not an allocation).
pub const MAX_BYTES: u64 = 64 << 30;

/// The image file of the volume mounted at `mount_point`.
pub fn image_of(mount_point: &Path) -> PathBuf {
    mount_point.with_extension("img")
}

/// Whether something is mounted at `path` (its device differs from its parent's).
pub fn is_mounted(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let (Ok(own), Some(Ok(parent))) = (
        std::fs::symlink_metadata(path),
        path.parent().map(std::fs::symlink_metadata),
    ) else {
        return false;
    };
    own.is_dir() && own.dev() != parent.dev()
}

/// Makes (first time) and mounts the volume of `bytes` at `mount_point`, with an empty
/// `workspace` folder in it. Mounted already: nothing to do.
pub fn attach(mount_point: &Path, bytes: u64) -> io::Result<()> {
    if is_mounted(mount_point) {
        return Ok(());
    }
    let image = image_of(mount_point);
    let fresh = !image.exists();
    if fresh {
        make_image(&image, bytes)?;
    }
    std::fs::create_dir_all(mount_point)?;
    if let Err(first) = mount(&image, mount_point) {
        if fresh {
            return Err(first);
        }
        // A volume a crash cut short: let e2fsck mend what its journal cannot, then retry.
        let _ = run(Command::new("e2fsck").arg("-p").arg(&image), "e2fsck");
        mount(&image, mount_point)?;
    }
    if fresh {
        let _ = std::fs::remove_dir(mount_point.join("lost+found"));
    }
    match std::fs::create_dir(mount_point.join("workspace")) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => Err(e),
        _ => Ok(()),
    }
}

/// Unmounts the volume at `mount_point`, lazily: a box still holding it keeps its own view
/// until it closes, and the loop device goes with the last user. Not mounted: nothing to do.
pub fn detach(mount_point: &Path) -> io::Result<()> {
    if !is_mounted(mount_point) {
        return Ok(());
    }
    let path = std::ffi::CString::new(mount_point.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL in the path"))?;
    // SAFETY: `path` is a valid NUL-terminated string that outlives the call.
    if unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH | libc::UMOUNT_NOFOLLOW) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A sparse image of `bytes` with an empty ext4 in it, made under a temporary name and
/// renamed into place (a crash leaves no half-made image under the real name).
fn make_image(image: &Path, bytes: u64) -> io::Result<()> {
    let staging = image.with_extension("img.new");
    let file = std::fs::File::create(&staging)?;
    file.set_len(bytes.clamp(MIN_BYTES, MAX_BYTES))?;
    drop(file);
    let made = run(
        Command::new("mkfs.ext4")
            .args([
                "-q",
                "-F",
                "-m",
                "0",
                "-J",
                "size=4",
                "-E",
                "root_owner=0:0",
            ])
            .arg(&staging),
        "mkfs.ext4",
    )
    .and_then(|()| std::fs::rename(&staging, image));
    if made.is_err() {
        let _ = std::fs::remove_file(&staging);
    }
    made
}

fn mount(image: &Path, mount_point: &Path) -> io::Result<()> {
    run(
        Command::new("mount")
            .args(["-t", "ext4", "-o", "loop,nosuid,nodev,noatime"])
            .arg(image)
            .arg(mount_point),
        "mount",
    )
}

/// Runs a tool to its end; a failure names it and says what it printed.
fn run(command: &mut Command, tool: &str) -> io::Result<()> {
    let out = command
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| {
            let hint = if e.kind() == io::ErrorKind::NotFound {
                " (install e2fsprogs and mount: `apt-get install e2fsprogs mount`)"
            } else {
                ""
            };
            io::Error::new(e.kind(), format!("could not run {tool}: {e}{hint}"))
        })?;
    if out.status.success() {
        return Ok(());
    }
    let said = String::from_utf8_lossy(&out.stderr);
    Err(io::Error::other(format!(
        "{tool} failed ({}): {}",
        out.status,
        said.trim()
    )))
}
