//! Named volumes: storage of a tenant's that outlives sandboxes and is shared between them.
//! Each is a size-capped ext4 image, as a Linux sandbox's workspace is ([`crate::volume`]),
//! loop-mounted for as long as kiln runs (again at each start), and mounted into the
//! sandboxes made with it: bound into Linux boxes (read-write or read-only), preopened in
//! WebAssembly guests.
//!
//! ```text
//! volumes/<id>/volume.json    its record (tenant, name, size, token)
//! volumes/<id>/volume.img     the image (sparse)
//! volumes/<id>/volume/        its mount point
//! volumes/<id>/volume/data/   what sandboxes see
//! ```
//!
//! A volume a live sandbox mounts cannot be deleted. A tenant's volumes count against its
//! `volumes` quota (how many) and, by the bytes their files use, its workspace quota.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::error::{Result, RuntimeError};
use crate::sandbox::{new_id, now_ms, random_hex, rfc3339};
use crate::store;

/// A volume's size when none is asked for (E2B's create names none).
pub const DEFAULT_BYTES: u64 = 1 << 30;
/// The most volumes one sandbox mounts.
pub const MAX_MOUNTS: usize = 8;

/// A named volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolumeRecord {
    /// `vol_…`.
    pub id: String,
    /// Unique within its tenant.
    pub name: String,
    #[serde(skip)]
    pub tenant: String,
    /// What it may hold, in bytes.
    pub size_bytes: u64,
    pub created_at: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    /// A bearer token that reaches its files alone (E2B's volume content API).
    #[serde(skip)]
    pub token: String,
}

/// What is stored: the record with its tenant and token.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Stored {
    #[serde(flatten)]
    record: VolumeRecord,
    tenant: String,
    token: String,
}

/// A volume in a sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VolumeMount {
    /// The volume, by id or name (kept as its id).
    pub volume: String,
    /// Where the sandbox sees it: an absolute path such as `/mnt/data`.
    pub path: String,
    /// Mounted read-only. Default false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
}

/// The named volumes of a server.
#[derive(Debug)]
pub struct Volumes {
    root: PathBuf,
    /// Every volume, by id.
    all: Mutex<HashMap<String, Stored>>,
}

fn invalid(message: impl Into<String>) -> RuntimeError {
    RuntimeError::InvalidOption {
        message: message.into(),
    }
}

fn io_failed(what: &str, e: &std::io::Error) -> RuntimeError {
    if e.kind() == std::io::ErrorKind::StorageFull {
        return RuntimeError::NoSpace {
            what: e.to_string(),
        };
    }
    RuntimeError::internal(format!("{what}: {e}"))
}

/// A valid volume name: 1..=64 of `A-Z a-z 0-9 _ . -`.
pub fn name_ok(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
        && !name.starts_with('.')
}

/// Folders of a sandbox a volume may not cover.
const RESERVED: [&str; 9] = [
    "/proc", "/sys", "/dev", "/.kiln", "/etc", "/usr", "/bin", "/lib", "/sbin",
];

/// Checks a mount's path: absolute, normal (no `.`, `..`, `//`, trailing `/`), not `/`,
/// not one of the system's folders nor under one.
pub fn check_path(path: &str) -> Result<()> {
    let bad = |why: &str| Err(invalid(format!("volume mount path {path:?}: {why}")));
    if !path.starts_with('/') || path.len() < 2 || path.len() > 256 {
        return bad("an absolute path of 2..=256 bytes, such as /mnt/data");
    }
    if path.ends_with('/')
        || path
            .split('/')
            .skip(1)
            .any(|part| part.is_empty() || part == "." || part == "..")
        || path.bytes().any(|b| b.is_ascii_control())
    {
        return bad("no empty, `.` or `..` parts, no trailing slash");
    }
    if RESERVED
        .iter()
        .any(|r| path == *r || path.starts_with(&format!("{r}/")))
    {
        return bad("a system folder (or under one)");
    }
    Ok(())
}

impl Volumes {
    /// The volumes under `data_dir`, as recorded (not mounted: [`Volumes::attach_all`]).
    pub fn open(data_dir: &Path) -> Volumes {
        let root = data_dir.join("volumes");
        let mut all = HashMap::new();
        if let Ok(entries) = std::fs::read_dir(&root) {
            for entry in entries.flatten() {
                match store::read_json::<Stored>(&entry.path().join("volume.json")) {
                    Ok(mut stored) => {
                        stored.record.tenant = stored.tenant.clone();
                        stored.record.token = stored.token.clone();
                        all.insert(stored.record.id.clone(), stored);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                        // A create a crash cut short: nothing was promised from it.
                        let _ = crate::volume::detach(&entry.path().join("volume"));
                        let _ = std::fs::remove_dir_all(entry.path());
                    }
                    Err(e) => tracing::error!(
                        "volume {}: unreadable record ({e}); left as it is",
                        entry.path().display()
                    ),
                }
            }
        }
        Volumes {
            root,
            all: Mutex::new(all),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Stored>> {
        self.all.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn mount_point(&self, id: &str) -> PathBuf {
        self.root.join(id).join("volume")
    }

    /// The folder sandboxes see of volume `id`.
    pub fn content(&self, id: &str) -> PathBuf {
        self.mount_point(id).join("data")
    }

    /// Volume `id`'s files as a tree the host reads and writes without following what a
    /// sandbox planted (its temporaries beside `data`, out of sandboxes' reach).
    pub fn tree(&self, id: &str) -> Result<kiln_workspace::Tree> {
        let scratch = self.mount_point(id).join(".tmp");
        if !scratch.is_dir() {
            std::fs::create_dir_all(&scratch).map_err(|e| io_failed("the volume's scratch", &e))?;
        }
        let tree = kiln_workspace::Tree::open(&self.content(id), Some(&scratch))
            .map_err(RuntimeError::Workspace)?;
        Ok(tree)
    }

    /// Mounts every volume (at kiln's start); one that fails is said and left out.
    pub fn attach_all(&self) {
        let all: Vec<Stored> = self.lock().values().cloned().collect();
        for stored in all {
            if let Err(e) = crate::volume::attach_with(
                &self.mount_point(&stored.record.id),
                stored.record.size_bytes,
                "data",
            ) {
                tracing::error!(
                    "volume {} ({}): cannot mount: {e}",
                    stored.record.name,
                    stored.record.id
                );
            }
        }
    }

    /// Unmounts every volume (at kiln's stop), and the volumes' folder's own mount
    /// ([`share_root`]).
    pub fn detach_all(&self) {
        let ids: Vec<String> = self.lock().keys().cloned().collect();
        for id in ids {
            let _ = crate::volume::detach(&self.mount_point(&id));
        }
        if let Ok(root) = self.root.canonicalize()
            && is_mount_point(&root)
            && let Ok(path) = std::ffi::CString::new(root.as_os_str().as_encoded_bytes())
        {
            // SAFETY: `path` is a valid NUL-terminated string that outlives the call.
            unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH | libc::UMOUNT_NOFOLLOW) };
        }
    }

    /// Makes a volume `name` of `size_bytes` (default [`DEFAULT_BYTES`]) for `tenant`,
    /// which may hold `max_volumes`.
    pub fn create(
        &self,
        tenant: &str,
        name: &str,
        size_bytes: Option<u64>,
        metadata: BTreeMap<String, String>,
        max_volumes: u64,
        owner: Option<(u32, u32)>,
    ) -> Result<VolumeRecord> {
        if !name_ok(name) {
            return Err(invalid(format!(
                "{name:?} is not a volume name: 1..=64 of A-Z a-z 0-9 _ . - (not starting with .)"
            )));
        }
        let size = size_bytes.unwrap_or(DEFAULT_BYTES);
        let (min, max) = (crate::volume::MIN_BYTES, crate::volume::MAX_BYTES);
        if !(min..=max).contains(&size) {
            return Err(invalid(format!(
                "a volume's size is {} MiB ..= {} GiB, got {size} bytes",
                min >> 20,
                max >> 30
            )));
        }
        if metadata.len() > 32
            || metadata
                .iter()
                .any(|(k, v)| k.is_empty() || k.len() > 256 || v.len() > 1024)
        {
            return Err(invalid(
                "metadata: at most 32 entries, keys of 1..=256 bytes, values of at most 1024",
            ));
        }
        let id = new_id("vol_");
        {
            // Named and counted under the lock; made outside it (mkfs takes a while).
            let mut all = self.lock();
            let own: Vec<&Stored> = all.values().filter(|s| s.tenant == tenant).collect();
            if own.iter().any(|s| s.record.name == name) {
                return Err(RuntimeError::VolumeExists {
                    name: name.to_owned(),
                });
            }
            if own.len() as u64 >= max_volumes {
                return Err(crate::quota::exceeded(
                    "volumes",
                    max_volumes,
                    own.len() as u64,
                    "volumes",
                ));
            }
            // Reserved: a second create of the name waits for none and is refused above.
            all.insert(
                id.clone(),
                Stored {
                    record: VolumeRecord {
                        id: id.clone(),
                        name: name.to_owned(),
                        tenant: tenant.to_owned(),
                        size_bytes: size,
                        created_at: rfc3339(now_ms()),
                        metadata,
                        token: random_hex(24),
                    },
                    tenant: tenant.to_owned(),
                    token: String::new(),
                },
            );
        }
        let made = (|| {
            let dir = self.root.join(&id);
            std::fs::create_dir_all(&dir).map_err(|e| io_failed("the volume's folder", &e))?;
            crate::volume::attach_with(&self.mount_point(&id), size, "data")
                .map_err(|e| io_failed("making the volume", &e))?;
            // Its files are the sandboxes' user's (what the host writes into it too).
            if let Some((uid, gid)) = owner {
                std::os::unix::fs::lchown(self.content(&id), Some(uid), Some(gid))
                    .map_err(|e| io_failed("giving the volume to the sandboxes' user", &e))?;
            }
            let mut all = self.lock();
            let stored = all
                .get_mut(&id)
                .ok_or_else(|| RuntimeError::internal("the volume went"))?;
            stored.token = stored.record.token.clone();
            store::write_json(&dir.join("volume.json"), &*stored)
                .map_err(|e| io_failed("recording the volume", &e))?;
            Ok(stored.record.clone())
        })();
        if made.is_err() {
            self.lock().remove(&id);
            let _ = crate::volume::detach(&self.mount_point(&id));
            let _ = std::fs::remove_dir_all(self.root.join(&id));
        }
        made
    }

    /// `tenant`'s volumes, oldest first.
    pub fn list(&self, tenant: &str) -> Vec<VolumeRecord> {
        let mut own: Vec<VolumeRecord> = self
            .lock()
            .values()
            .filter(|s| s.tenant == tenant && !s.token.is_empty())
            .map(|s| s.record.clone())
            .collect();
        own.sort_by(|a, b| a.created_at.cmp(&b.created_at).then(a.id.cmp(&b.id)));
        own
    }

    /// `tenant`'s volume by id or name.
    pub fn find(&self, tenant: &str, which: &str) -> Result<VolumeRecord> {
        self.lock()
            .values()
            .find(|s| {
                s.tenant == tenant
                    && !s.token.is_empty()
                    && (s.record.id == which || s.record.name == which)
            })
            .map(|s| s.record.clone())
            .ok_or_else(|| RuntimeError::VolumeNotFound {
                volume: which.to_owned(),
            })
    }

    /// The volume a content token reaches.
    pub fn by_token(&self, token: &str) -> Option<VolumeRecord> {
        if token.len() < 32 {
            return None;
        }
        self.lock()
            .values()
            .find(|s| !s.token.is_empty() && constant_time_eq(s.token.as_bytes(), token.as_bytes()))
            .map(|s| s.record.clone())
    }

    /// Bytes the files of `tenant`'s volumes use.
    pub fn used_bytes(&self, tenant: &str) -> u64 {
        let ids: Vec<String> = self
            .lock()
            .values()
            .filter(|s| s.tenant == tenant)
            .map(|s| s.record.id.clone())
            .collect();
        ids.iter().map(|id| self.used(id)).sum()
    }

    /// Bytes volume `id`'s files use (its file system's used blocks).
    pub fn used(&self, id: &str) -> u64 {
        let point = self.mount_point(id);
        if !crate::volume::is_mounted(&point) {
            return 0;
        }
        rustix::fs::statvfs(&point).map_or(0, |s| {
            s.f_blocks
                .saturating_sub(s.f_bfree)
                .saturating_mul(s.f_frsize)
        })
    }

    /// Deletes `tenant`'s volume `which` unless one of `users` (the live sandboxes that
    /// mount each volume, by id) holds it; false when there is none.
    pub fn delete(
        &self,
        tenant: &str,
        which: &str,
        users: impl Fn(&str) -> Vec<String>,
    ) -> Result<bool> {
        let record = match self.find(tenant, which) {
            Ok(record) => record,
            Err(RuntimeError::VolumeNotFound { .. }) => return Ok(false),
            Err(e) => return Err(e),
        };
        let holders = users(&record.id);
        if !holders.is_empty() {
            return Err(RuntimeError::VolumeInUse {
                volume: record.name,
                sandboxes: holders,
            });
        }
        self.lock().remove(&record.id);
        let dir = self.root.join(&record.id);
        // The record goes first: a crash after it leaves a folder `open` clears.
        let _ = std::fs::remove_file(dir.join("volume.json"));
        crate::volume::detach(&self.mount_point(&record.id))
            .map_err(|e| io_failed("unmounting the volume", &e))?;
        std::fs::remove_dir_all(&dir).map_err(|e| io_failed("removing the volume", &e))?;
        Ok(true)
    }
}

/// Makes `data_dir/volumes` a mount point of its own with shared propagation, so that the
/// volumes kiln mounts under it later reach processes that copied the mount table before
/// (the WebAssembly workers' jails, whose copies are its slaves). Call before starting
/// workers. Without root there are no volumes to share: nothing is done.
pub fn share_root(data_dir: &Path) -> std::io::Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(());
    }
    let root = data_dir.join("volumes");
    std::fs::create_dir_all(&root)?;
    let root = root.canonicalize()?;
    let path = std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(root.as_os_str()))
        .map_err(|_| std::io::Error::other("a NUL in the data folder's path"))?;
    let mounted = is_mount_point(&root);
    // SAFETY: `path` is a valid NUL-terminated string that outlives both calls; the other
    // pointers are null, which mount(2) takes for a bind and a propagation change.
    unsafe {
        if !mounted
            && libc::mount(
                path.as_ptr(),
                path.as_ptr(),
                std::ptr::null(),
                libc::MS_BIND,
                std::ptr::null(),
            ) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
        if libc::mount(
            std::ptr::null(),
            path.as_ptr(),
            std::ptr::null(),
            libc::MS_SHARED,
            std::ptr::null(),
        ) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Whether `path` (canonical) is a mount point of this mount namespace.
fn is_mount_point(path: &Path) -> bool {
    std::fs::read_to_string("/proc/self/mountinfo").is_ok_and(|info| {
        info.lines()
            .filter_map(|line| line.split(' ').nth(4))
            .any(|point| unescape(point) == path.as_os_str().as_encoded_bytes())
    })
}

/// A mount point as `/proc/self/mountinfo` writes it (`\040` for a space, …), unescaped.
fn unescape(field: &str) -> Vec<u8> {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && let Some(code) = std::str::from_utf8(&bytes[i + 1..i + 4])
                .ok()
                .and_then(|digits| u8::from_str_radix(digits, 8).ok())
        {
            out.push(code);
            i += 4;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    out
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_paths_are_absolute_normal_and_outside_the_system() {
        for good in [
            "/mnt/data",
            "/data",
            "/home/user/shared",
            "/workspace/cache",
        ] {
            assert!(check_path(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "/",
            "data",
            "/mnt/",
            "/mnt//x",
            "/mnt/./x",
            "/mnt/../etc",
            "/proc",
            "/proc/x",
            "/etc",
            "/etc/ssl",
            "/usr/lib",
            "/dev/shm",
            "/.kiln",
            "/sys/fs",
            "/a\nb",
        ] {
            assert!(check_path(bad).is_err(), "{bad:?}");
        }
        assert!(check_path(&format!("/{}", "a".repeat(300))).is_err());
    }

    #[test]
    fn mountinfo_escapes_unescape() {
        assert_eq!(unescape("/data/my\\040vols"), b"/data/my vols");
        assert_eq!(unescape("/plain"), b"/plain");
        assert_eq!(unescape("/odd\\9x\\"), b"/odd\\9x\\");
        assert_eq!(unescape("/é\\134"), "/é\\".as_bytes());
    }

    #[test]
    fn names_are_short_and_plain() {
        assert!(name_ok("datasets-2024_v1.0"));
        for bad in ["", ".hidden", "a b", "a/b", "é", &"n".repeat(65)] {
            assert!(!name_ok(bad), "{bad:?}");
        }
    }
}
