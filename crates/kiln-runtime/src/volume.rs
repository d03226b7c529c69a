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
//! file system's metadata is only ever written by the kernel, not crafted by a guest. It is
//! mounted with `discard`, so the blocks of files deleted inside it are punched out of the
//! image and go back to the host.
//!
//! A new volume is made only where the host's disk can keep its promise: the sizes of every
//! volume beside it, its own included, may not pass the data folder's free space plus what
//! those volumes already use, times `KILN_DISK_OVERCOMMIT` (default 1: no overcommit).
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
    attach_with(mount_point, bytes, "workspace")
}

/// As [`attach`], with the folder made in it named `folder`.
pub fn attach_with(mount_point: &Path, bytes: u64, folder: &str) -> io::Result<()> {
    if is_mounted(mount_point) {
        return Ok(());
    }
    let image = image_of(mount_point);
    let fresh = !image.exists();
    if fresh {
        check_room(mount_point, bytes, overcommit_ratio())?;
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
    match std::fs::create_dir(mount_point.join(folder)) {
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

/// How far volumes may promise more than the disk holds: `KILN_DISK_OVERCOMMIT` (a positive
/// number; 1, the default, promises no more than the disk has).
pub fn overcommit_ratio() -> f64 {
    std::env::var("KILN_DISK_OVERCOMMIT")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|r| r.is_finite() && *r > 0.0)
        .unwrap_or(1.0)
}

/// What the volumes of a data folder promise and hold, and what its disk has left.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Room {
    /// The sizes of the volumes (what they may grow to).
    pub promised: u64,
    /// The bytes their images hold now.
    pub used: u64,
    /// Free space on the file system holding them (for an unprivileged user: what is left
    /// above the reserved blocks).
    pub free: u64,
}

impl Room {
    /// Whether the disk covers one more volume of `bytes`, with `ratio` of overcommit.
    pub fn covers(&self, bytes: u64, ratio: f64) -> bool {
        let wanted = self.promised.saturating_add(bytes) as f64;
        wanted <= ratio * self.free.saturating_add(self.used) as f64
    }
}

/// The volumes beside the one to be mounted at `mount_point` (every sandbox's image in the
/// folder of sandboxes holding it, and every named volume's of the data folder: `sandboxes/`
/// and `volumes/` share one disk), and the free space of their file system.
pub fn room_beside(mount_point: &Path) -> io::Result<Room> {
    use std::os::unix::fs::MetadataExt;
    let own = mount_point.parent().unwrap_or(mount_point);
    let sandboxes = own.parent().unwrap_or(own);
    let mut room = Room::default();
    let mut folders = vec![sandboxes.to_path_buf()];
    if let Some(data) = sandboxes.parent() {
        for sibling in ["sandboxes", "volumes"] {
            let folder = data.join(sibling);
            if folder != sandboxes && folder.is_dir() {
                folders.push(folder);
            }
        }
    }
    for folder in &folders {
        for entry in std::fs::read_dir(folder)?.flatten() {
            let image = image_of(&entry.path().join("volume"));
            if let Ok(meta) = std::fs::symlink_metadata(&image)
                && meta.is_file()
            {
                room.promised += meta.len();
                room.used += meta.blocks() * 512;
            }
        }
    }
    let stat = rustix::fs::statvfs(sandboxes).map_err(io::Error::from)?;
    room.free = stat.f_bavail.saturating_mul(stat.f_frsize);
    Ok(room)
}

/// Refuses (`StorageFull`, which a create answers as 507 with these figures) a new volume of
/// `bytes` at `mount_point` that the host's disk cannot cover with `ratio` of overcommit.
pub fn check_room(mount_point: &Path, bytes: u64, ratio: f64) -> io::Result<()> {
    let bytes = bytes.clamp(MIN_BYTES, MAX_BYTES);
    let room = room_beside(mount_point)?;
    if room.covers(bytes, ratio) {
        return Ok(());
    }
    let why = format!(
        "a disk of {} MiB (resources.disk_mb) does not fit: the live sandboxes' disks promise {} MiB \
         and hold {} MiB, and the host's disk has {} MiB free; with an overcommit of {ratio} it \
         covers {} MiB in all. Ask for a smaller disk_mb, delete sandboxes, or raise \
         KILN_DISK_OVERCOMMIT",
        bytes >> 20,
        room.promised >> 20,
        room.used >> 20,
        room.free >> 20,
        (ratio * room.free.saturating_add(room.used) as f64) as u64 >> 20,
    );
    tracing::warn!("refusing a volume: {why}");
    Err(io::Error::new(io::ErrorKind::StorageFull, why))
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
            // discard: blocks freed inside are punched out of the sparse image.
            .args(["-t", "ext4", "-o", "loop,nosuid,nodev,noatime,discard"])
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_volume_fits_while_the_disk_covers_every_volumes_size() {
        const G: u64 = 1 << 30;
        // 10 GiB free, volumes of 6 GiB holding 1 GiB: 5 GiB more fit, not 6.
        let room = Room {
            promised: 6 * G,
            used: G,
            free: 10 * G,
        };
        assert!(room.covers(5 * G, 1.0));
        assert!(!room.covers(5 * G + 1, 1.0));
        // An overcommit of 2 doubles what the disk covers.
        assert!(room.covers(16 * G, 2.0));
        assert!(!room.covers(17 * G, 2.0));
        // An empty folder on a full disk takes nothing; a huge one never overflows.
        assert!(!Room::default().covers(MIN_BYTES, 1.0));
        let huge = Room {
            promised: u64::MAX,
            used: u64::MAX,
            free: u64::MAX,
        };
        assert!(huge.covers(u64::MAX, 1.0));
    }

    #[test]
    fn the_room_counts_the_images_beside_a_new_volume() {
        let data = tempfile::tempdir().expect("a folder");
        let sandboxes = data.path().join("sandboxes");
        for (id, size) in [("a", 64u64 << 20), ("b", 32 << 20)] {
            std::fs::create_dir_all(sandboxes.join(id)).expect("made");
            let image = std::fs::File::create(sandboxes.join(id).join("volume.img")).expect("made");
            image.set_len(size).expect("sized");
        }
        std::fs::create_dir_all(sandboxes.join("new")).expect("made");
        let mount_point = sandboxes.join("new").join("volume");
        let room = room_beside(&mount_point).expect("counted");
        assert_eq!(room.promised, 96 << 20);
        assert!(room.used < 1 << 20, "sparse images hold next to nothing");
        assert!(room.free > 0);
        check_room(&mount_point, 16 << 20, 1.0).expect("16 MiB fits");
        let refused = check_room(&mount_point, MAX_BYTES, 1e-9).expect_err("refused");
        assert_eq!(refused.kind(), io::ErrorKind::StorageFull);
        let said = refused.to_string();
        assert!(
            said.contains("resources.disk_mb") && said.contains("KILN_DISK_OVERCOMMIT"),
            "{said}"
        );
    }
}
