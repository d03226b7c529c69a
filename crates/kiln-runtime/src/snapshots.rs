//! Snapshots and forks of Linux sandboxes. A Linux sandbox keeps everything it writes on its
//! volume: the workspace and, in `.layer`, what its box changed outside it (the overlay's
//! upper layer). A snapshot is that volume's image, taken while the box is frozen and the
//! file system is frozen too (`FIFREEZE`: its journal flushed, no write half-done), with the
//! sandbox's history and how it was made. New sandboxes start from a snapshot with their own
//! copy of the image; a fork is a snapshot taken once and `count` sandboxes made from it.
//!
//! Copies are copy-on-write where the file system can (`FICLONE`: XFS with reflinks,
//! btrfs): a copy then costs nothing until one side writes. Elsewhere (ext4) they are
//! sparse copies: only the blocks the image uses are copied, holes stay holes. Each answer
//! says which (`copy`: `reflink` or `sparse`).
//!
//! Processes are carried where CRIU can (E2B's `mode: "full"`, the default): the box's
//! processes are checkpointed with `--leave-running` while it is frozen, and the image is
//! copied before it is thawed, so the two agree; a hibernated box's checkpoint is copied as
//! it is. A sandbox made from such a snapshot restores its box from a copy of that
//! checkpoint (its processes go on from the snapshot, each copy on its own); where the
//! processes cannot come (no CRIU, gVisor, a microVM, a restore that fails), it starts its
//! box fresh from the snapshot's files, and says why. `processes: false` (E2B's
//! `mode: "filesystem"`) takes the files alone.
//!
//! ```text
//! snapshots/<id>/snapshot.json   its record
//! snapshots/<id>/volume.img      the volume's image
//! snapshots/<id>/history.git     the sandbox's history then
//! snapshots/<id>/processes/      its box's checkpoint (CRIU's images and kiln's record)
//! ```

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use std::sync::Arc;

use crate::Runtime;
use crate::auth::Caller;
use crate::error::{Result, RuntimeError};
use crate::sandbox::{Sandbox, SandboxSpec, new_id, now_ms, rfc3339};
use crate::store;

/// The most snapshots a tenant keeps; their disk counts in its workspace quota.
pub const MAX_SNAPSHOTS: usize = 64;
/// The most sandboxes one fork makes.
pub const MAX_FORKS: u32 = 20;

/// How an image was copied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum CopyKind {
    /// Copy-on-write (the file system shares the blocks).
    Reflink,
    /// The used blocks copied, holes left holes.
    Sparse,
}

/// A snapshot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotInfo {
    /// `snap_…`.
    pub id: String,
    /// A name of the client's, if it gave one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The sandbox it was taken of.
    pub sandbox_id: String,
    pub template: String,
    pub created_at: String,
    /// Its image's size (the sandbox's disk).
    pub size_bytes: u64,
    /// What its image holds on the host's disk.
    pub disk_bytes: u64,
    /// How its image was copied.
    pub copy: CopyKind,
    /// Milliseconds the source sandbox's file system was frozen for it.
    pub frozen_ms: f64,
    /// Whether its box's processes were taken with its files (sandboxes made from it go on
    /// from them).
    #[serde(default)]
    pub with_processes: bool,
    /// What was kept of its processes, or why they were not, in plain words.
    #[serde(default)]
    pub processes: String,
}

/// What is stored: the info, its tenant, and what a sandbox made from it is made with.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Stored {
    #[serde(flatten)]
    info: SnapshotInfo,
    tenant: String,
    /// The source sandbox as it was (its id, folder and usage are not carried).
    source: Sandbox,
}

/// The snapshots of a server.
#[derive(Debug)]
pub struct Snapshots {
    root: PathBuf,
    all: Mutex<HashMap<String, Stored>>,
}

fn failed(what: &str, e: &std::io::Error) -> RuntimeError {
    if e.kind() == std::io::ErrorKind::StorageFull || e.raw_os_error() == Some(libc::ENOSPC) {
        return RuntimeError::NoSpace {
            what: format!("{what}: {e}"),
        };
    }
    RuntimeError::internal(format!("{what}: {e}"))
}

impl Snapshots {
    pub fn open(data_dir: &Path) -> Snapshots {
        let root = data_dir.join("snapshots");
        let mut all = HashMap::new();
        if let Ok(entries) = std::fs::read_dir(&root) {
            for entry in entries.flatten() {
                match store::read_json::<Stored>(&entry.path().join("snapshot.json")) {
                    Ok(stored) => {
                        all.insert(stored.info.id.clone(), stored);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                        // A snapshot a crash cut short.
                        let _ = std::fs::remove_dir_all(entry.path());
                    }
                    Err(e) => tracing::error!(
                        "snapshot {}: unreadable record ({e}); left as it is",
                        entry.path().display()
                    ),
                }
            }
        }
        Snapshots {
            root,
            all: Mutex::new(all),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Stored>> {
        self.all.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn dir(&self, id: &str) -> PathBuf {
        self.root.join(id)
    }

    /// The image of snapshot `id`.
    pub fn image(&self, id: &str) -> PathBuf {
        self.dir(id).join("volume.img")
    }

    /// The checkpoint of snapshot `id`'s processes (when it has one).
    pub fn processes(&self, id: &str) -> PathBuf {
        self.dir(id).join("processes")
    }

    /// The history of snapshot `id`.
    pub fn history(&self, id: &str) -> PathBuf {
        self.dir(id).join("history.git")
    }

    /// `tenant`'s snapshots (of `sandbox` only, where given), oldest first.
    pub fn list(&self, tenant: &str, sandbox: Option<&str>) -> Vec<SnapshotInfo> {
        let mut own: Vec<SnapshotInfo> = self
            .lock()
            .values()
            .filter(|s| s.tenant == tenant && sandbox.is_none_or(|id| s.info.sandbox_id == id))
            .map(|s| s.info.clone())
            .collect();
        own.sort_by(|a, b| a.created_at.cmp(&b.created_at).then(a.id.cmp(&b.id)));
        own
    }

    /// `tenant`'s snapshot by id or name, with the sandbox it was taken of.
    pub fn find(&self, tenant: &str, which: &str) -> Result<(SnapshotInfo, Sandbox)> {
        self.lock()
            .values()
            .find(|s| {
                s.tenant == tenant && (s.info.id == which || s.info.name.as_deref() == Some(which))
            })
            .map(|s| (s.info.clone(), s.source.clone()))
            .ok_or_else(|| RuntimeError::SnapshotNotFound {
                snapshot: which.to_owned(),
            })
    }

    /// Bytes `tenant`'s snapshots hold on the host's disk.
    pub fn disk_bytes(&self, tenant: &str) -> u64 {
        self.lock()
            .values()
            .filter(|s| s.tenant == tenant)
            .map(|s| s.info.disk_bytes)
            .sum()
    }

    /// Begins a snapshot of `source` (a Linux sandbox with a volume): checks it may be taken,
    /// makes its folder and copies the sandbox's history. Then [`Snapshots::copy_disk`]
    /// (with the box held still) and [`Snapshots::finish`]; dropped unfinished, the folder
    /// goes.
    pub fn begin(&self, source: &Sandbox, name: Option<String>) -> Result<Taking> {
        if !source.volume {
            return Err(RuntimeError::Unsupported {
                message: format!(
                    "sandbox {} keeps its files in a folder, not a volume of its own: snapshots and forks are of Linux sandboxes (WebAssembly ones fork their sessions: POST …/sessions/{{sid}}/fork with withWorkspace)",
                    source.id
                ),
            });
        }
        if let Some(name) = &name
            && !crate::volumes::name_ok(name)
        {
            return Err(RuntimeError::InvalidOption {
                message: format!("{name:?} is not a snapshot name: 1..=64 of A-Z a-z 0-9 _ . -"),
            });
        }
        {
            let all = self.lock();
            let own: Vec<&Stored> = all.values().filter(|s| s.tenant == source.tenant).collect();
            if own.len() >= MAX_SNAPSHOTS {
                return Err(crate::quota::exceeded(
                    "snapshots",
                    MAX_SNAPSHOTS as u64,
                    own.len() as u64,
                    "snapshots",
                ));
            }
            if let Some(name) = &name
                && own.iter().any(|s| s.info.name.as_deref() == Some(name))
            {
                return Err(RuntimeError::InvalidOption {
                    message: format!("a snapshot named {name:?} exists"),
                });
            }
        }
        let id = new_id("snap_");
        let taking = Taking {
            dir: self.dir(&id),
            id,
            name,
            done: false,
        };
        std::fs::create_dir_all(&taking.dir).map_err(|e| failed("the snapshot's folder", &e))?;
        source
            .history()?
            .clone_into(&taking.dir.join("history.git"))?;
        Ok(taking)
    }

    /// Copies `source`'s disk into the snapshot, its file system frozen meanwhile (the
    /// caller holds its box still): how, and for how many ms it was frozen.
    pub fn copy_disk(&self, taking: &str, source: &Sandbox) -> Result<(CopyKind, f64)> {
        let started = std::time::Instant::now();
        let copied = {
            let frozen = FrozenFs::freeze(&source.volume_dir());
            let copied = copy_image(
                &crate::volume::image_of(&source.volume_dir()),
                &self.image(taking),
            );
            drop(frozen);
            copied
        };
        let copy = copied.map_err(|e| failed("copying the sandbox's disk", &e))?;
        Ok((copy, started.elapsed().as_secs_f64() * 1000.0))
    }

    /// Records the snapshot: it is listed from now on.
    pub fn finish(
        &self,
        mut taking: Taking,
        source: &Sandbox,
        (copy, frozen_ms): (CopyKind, f64),
        processes: kiln_core::process::SnapshotProcesses,
    ) -> Result<SnapshotInfo> {
        let id = taking.id.clone();
        let (size_bytes, image_disk) = sizes(&self.image(&id));
        let kept = self.processes(&id);
        if !processes.carried {
            let _ = std::fs::remove_dir_all(&kept);
        }
        let mut source = source.clone();
        source.sessions.clear();
        let stored = Stored {
            info: SnapshotInfo {
                id: id.clone(),
                name: taking.name.take(),
                sandbox_id: source.id.clone(),
                template: source.template().to_owned(),
                created_at: rfc3339(now_ms()),
                size_bytes,
                disk_bytes: image_disk + checkpoint_bytes(&kept),
                copy,
                frozen_ms,
                with_processes: processes.carried,
                processes: processes.said,
            },
            tenant: source.tenant.clone(),
            source,
        };
        store::write_json(&taking.dir.join("snapshot.json"), &stored)
            .map_err(|e| failed("recording the snapshot", &e))?;
        taking.done = true;
        let info = stored.info.clone();
        self.lock().insert(id, stored);
        Ok(info)
    }

    /// Deletes `tenant`'s snapshot `which`; false when there is none.
    pub fn delete(&self, tenant: &str, which: &str) -> Result<bool> {
        let info = match self.find(tenant, which) {
            Ok((info, _)) => info,
            Err(RuntimeError::SnapshotNotFound { .. }) => return Ok(false),
            Err(e) => return Err(e),
        };
        self.lock().remove(&info.id);
        let dir = self.dir(&info.id);
        let _ = std::fs::remove_file(dir.join("snapshot.json"));
        crate::history::forget(&dir.join("history.git"));
        std::fs::remove_dir_all(&dir).map_err(|e| failed("removing the snapshot", &e))?;
        Ok(true)
    }
}

/// A snapshot being taken ([`Snapshots::begin`]).
#[derive(Debug)]
pub struct Taking {
    id: String,
    dir: PathBuf,
    name: Option<String>,
    done: bool,
}

impl Drop for Taking {
    fn drop(&mut self) {
        if !self.done {
            crate::history::forget(&self.dir.join("history.git"));
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Takes a snapshot of `caller`'s Linux sandbox `id`: its box held still (paused, no
/// request reaching it) while its disk is copied, its file system frozen. `processes`:
/// `None` takes them where CRIU can (saying why not where it cannot), `Some(true)` fails
/// where it cannot, `Some(false)` takes the files alone.
pub async fn snapshot(
    rt: &Arc<Runtime>,
    caller: &Caller,
    id: &str,
    name: Option<String>,
    processes: Option<bool>,
) -> Result<SnapshotInfo> {
    let sandbox = rt.registry.get(&caller.tenant, id)?.meta;
    rt.registry
        .usage(&caller.tenant)
        .check_workspace(&rt.quotas(caller))?;
    let host = rt.process_host(&sandbox);
    let workspace = sandbox.workspace();
    let (runtime, source) = (rt.clone(), sandbox.clone());
    let taking =
        tokio::task::spawn_blocking(move || runtime.registry.snapshots.begin(&source, name))
            .await
            .unwrap_or_else(|e| Err(RuntimeError::internal(e.to_string())))?;
    let into = rt.registry.snapshots.processes(&taking.id);
    let wanted = processes != Some(false);
    // The disk is copied while the host holds the box still; the copy's outcome comes back.
    let (copied_tx, copied) = std::sync::mpsc::sync_channel(1);
    let copy = {
        let (runtime, source, id) = (rt.clone(), sandbox.clone(), taking.id.clone());
        move || {
            let _ = copied_tx.send(runtime.registry.snapshots.copy_disk(&id, &source));
        }
    };
    let kept = match &host {
        Some(host) => host
            .snapshot(&workspace, wanted.then_some(into.as_path()), Box::new(copy))
            .await
            .map_err(|e| RuntimeError::internal(format!("holding the box still: {}", e.message)))?,
        None => {
            tokio::task::spawn_blocking(copy)
                .await
                .map_err(|e| RuntimeError::internal(e.to_string()))?;
            kiln_core::process::SnapshotProcesses {
                carried: false,
                said: "no box runs for its template: only its files were taken".into(),
            }
        }
    };
    let copied = copied
        .try_recv()
        .unwrap_or_else(|_| Err(RuntimeError::internal("the disk was not copied")))?;
    if processes == Some(true) && !kept.carried {
        return Err(RuntimeError::Unsupported {
            message: format!(
                "a snapshot with processes was asked for and cannot be taken here ({}); take one of its files alone with processes: false (mode \"filesystem\")",
                kept.said
            ),
        });
    }
    let (runtime, source) = (rt.clone(), sandbox.clone());
    let taken = tokio::task::spawn_blocking(move || {
        runtime
            .registry
            .snapshots
            .finish(taking, &source, copied, kept)
    })
    .await
    .unwrap_or_else(|e| Err(RuntimeError::internal(e.to_string())));
    if let Ok(info) = &taken {
        rt.events.record(
            &sandbox.id,
            "snapshot",
            &format!("{}: {}", info.id, info.processes),
        );
    }
    taken
}

/// What a sandbox made from a snapshot may change of the snapshot's: its life (ms).
#[derive(Debug, Clone, Default)]
pub struct FromSnapshot {
    pub lifetime_ms: Option<u64>,
    pub metadata: Option<std::collections::BTreeMap<String, String>>,
    /// An access token of its own (the E2B facade's sandboxes have one).
    pub access_token: Option<String>,
}

/// Makes a sandbox of `caller`'s from its snapshot `which` (id or name): the snapshot's
/// files, history, template, resources, network and rules, environment and volumes; its
/// box starts fresh. Answers it and how its disk was copied.
pub async fn create_from(
    rt: &Arc<Runtime>,
    caller: &Caller,
    which: &str,
    with: FromSnapshot,
) -> Result<Made> {
    let (info, source) = rt.registry.snapshots.find(&caller.tenant, which)?;
    let template = rt.catalogue().get(&info.template).cloned().ok_or_else(|| {
        RuntimeError::Unsupported {
            message: format!(
                "snapshot {} is of the {} template, which this server does not serve (start it with --linux)",
                info.id, info.template
            ),
        }
    })?;
    let lifetime_ms = with
        .lifetime_ms
        .or((source.life_ms > 0).then_some(source.life_ms))
        .unwrap_or(crate::sandbox::DEFAULT_LIFETIME_MS);
    let mut spec =
        SandboxSpec::of_template(&source.image, &template, lifetime_ms, source.memory_bytes);
    spec.language = source.language;
    spec.network = source.network;
    spec.egress = source.egress.clone();
    spec.resources = source.resources;
    spec.workspace_at = source.workspace_at.clone();
    spec.metadata = with.metadata.unwrap_or_else(|| source.metadata.clone());
    spec.env = source.env.clone();
    spec.access_token = with.access_token.or(source
        .access_token
        .clone()
        .map(|_| crate::sandbox::random_hex(24)));
    spec.public_ports = source.public_ports;
    spec.lifecycle = source.lifecycle.clone();
    // Its volumes as the tenant has them now (a volume deleted since is an error).
    let mounts: Vec<crate::volumes::VolumeMount> = source.volume_mounts.clone();
    spec = spec.with_volumes(
        rt.catalogue(),
        &rt.registry.volumes,
        &caller.tenant,
        &mounts,
    )?;
    let quotas = rt.quotas(caller);
    spec.key_id = Some(caller.key_id.clone());
    spec.egress_widen = caller.network_widen;
    if let Some(cap) = rt.max_life_ms {
        let own = spec.lifecycle.max_duration_ms.map_or(cap, |m| m.min(cap));
        spec.lifecycle.max_duration_ms = Some(own);
        spec.lifetime_ms = spec.lifetime_ms.min(own);
    }
    rt.registry.usage(&caller.tenant).check_workspace(&quotas)?;
    let (runtime, tenant, snapshot) = (rt.clone(), caller.tenant.clone(), info.id.clone());
    let made = tokio::task::spawn_blocking(move || {
        runtime
            .registry
            .create_from_snapshot(&tenant, &spec, &quotas, &snapshot)
    })
    .await
    .unwrap_or_else(|e| Err(RuntimeError::internal(e.to_string())))?;
    let (sandbox, copy) = made;
    let (restored, processes) = match rt.process_host(&sandbox) {
        _ if !info.with_processes => (
            false,
            "the snapshot holds no processes: its box starts fresh from its files".to_string(),
        ),
        None => (false, "no box runs for its template".to_string()),
        Some(host) => {
            let request = crate::processes::box_request(rt, &sandbox);
            match host
                .restore_from(&request, &rt.registry.snapshots.processes(&info.id))
                .await
            {
                Ok(said) => (true, said),
                Err(why) => (
                    false,
                    format!(
                        "its processes could not be restored, so its box starts fresh from the snapshot's files: {why}"
                    ),
                ),
            }
        }
    };
    rt.events.record(
        &sandbox.id,
        "created",
        &format!("from snapshot {}: {processes}", info.id),
    );
    Ok(Made {
        sandbox,
        copy,
        restored,
        processes,
    })
}

/// A sandbox made from a snapshot.
#[derive(Debug, Clone)]
pub struct Made {
    pub sandbox: Sandbox,
    /// How its disk was copied.
    pub copy: CopyKind,
    /// Whether its processes were restored from the snapshot's.
    pub restored: bool,
    /// What became of the snapshot's processes, in plain words.
    pub processes: String,
}

/// Forks `caller`'s Linux sandbox `id` into `count` sandboxes (1..=[`MAX_FORKS`]) that
/// start from it as it is now and diverge: one snapshot, taken once (and gone after), each
/// fork's disk a copy of it and its processes restored from a copy of its checkpoint
/// (`processes` as for [`snapshot`]). Each fork succeeds or fails on its own.
pub async fn fork(
    rt: &Arc<Runtime>,
    caller: &Caller,
    id: &str,
    count: u32,
    with: FromSnapshot,
    processes: Option<bool>,
) -> Result<Vec<Result<Made>>> {
    if !(1..=MAX_FORKS).contains(&count) {
        return Err(RuntimeError::InvalidOption {
            message: format!("count must be 1..={MAX_FORKS}, got {count}"),
        });
    }
    let snapshot = snapshot(rt, caller, id, None, processes).await?;
    let mut forks = Vec::new();
    for _ in 0..count {
        forks.push(create_from(rt, caller, &snapshot.id, with.clone()).await);
    }
    let (runtime, tenant) = (rt.clone(), caller.tenant.clone());
    let _ = tokio::task::spawn_blocking(move || {
        runtime.registry.snapshots.delete(&tenant, &snapshot.id)
    })
    .await;
    Ok(forks)
}

/// What a snapshot's checkpoint of processes holds on disk (its record and CRIU's images:
/// plain files, kiln's own, two levels deep; nothing followed).
fn checkpoint_bytes(folder: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let files = |dir: &Path| -> u64 {
        std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| std::fs::symlink_metadata(e.path()).ok())
            .filter(std::fs::Metadata::is_file)
            .map(|m| m.blocks() * 512)
            .sum()
    };
    files(folder) + files(&folder.join("images"))
}

/// An image's size and what it holds on disk.
pub fn sizes(image: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(image).map_or((0, 0), |m| (m.len(), m.blocks() * 512))
}

/// A file system frozen (`FIFREEZE`) until dropped: its journal flushed, every write held.
/// One that cannot be frozen (not mounted, no right) is left as it is, said in the log.
struct FrozenFs(Option<std::fs::File>);

const FIFREEZE: libc::c_ulong = 0xC004_5877;
const FITHAW: libc::c_ulong = 0xC004_5878;
const FICLONE: libc::c_ulong = 0x4004_9409;

impl FrozenFs {
    fn freeze(mount_point: &Path) -> FrozenFs {
        if !crate::volume::is_mounted(mount_point) {
            return FrozenFs(None);
        }
        let Ok(dir) = std::fs::File::open(mount_point) else {
            return FrozenFs(None);
        };
        // SAFETY: an ioctl on a descriptor we own; FIFREEZE takes no argument.
        if unsafe { libc::ioctl(dir.as_raw_fd(), FIFREEZE, 0) } != 0 {
            tracing::warn!(
                "could not freeze {} for a snapshot ({}); copying it as it is, with its box frozen",
                mount_point.display(),
                std::io::Error::last_os_error()
            );
            return FrozenFs(None);
        }
        FrozenFs(Some(dir))
    }
}

impl Drop for FrozenFs {
    fn drop(&mut self) {
        if let Some(dir) = &self.0 {
            // SAFETY: an ioctl on a descriptor we own; FITHAW takes no argument.
            unsafe { libc::ioctl(dir.as_raw_fd(), FITHAW, 0) };
        }
    }
}

/// Copies the image `from` to a new file `to`: a reflink where the file system shares
/// blocks, else a sparse copy (data extents only, by `SEEK_DATA`/`SEEK_HOLE`).
pub fn copy_image(from: &Path, to: &Path) -> std::io::Result<CopyKind> {
    use std::os::unix::fs::FileExt;
    let source = std::fs::File::open(from)?;
    let len = source.metadata()?.len();
    let staging = to.with_extension("img.new");
    let dest = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&staging)?;
    let result = (|| {
        // SAFETY: an ioctl on two descriptors we own; FICLONE takes the source's.
        if unsafe { libc::ioctl(dest.as_raw_fd(), FICLONE, source.as_raw_fd()) } == 0 {
            dest.sync_all()?;
            return Ok(CopyKind::Reflink);
        }
        dest.set_len(len)?;
        let mut at: i64 = 0;
        let mut buf = vec![0u8; 1 << 20];
        let end = i64::try_from(len).unwrap_or(i64::MAX);
        while at < end {
            // SAFETY: lseek on a descriptor we own.
            let data = unsafe { libc::lseek(source.as_raw_fd(), at, libc::SEEK_DATA) };
            if data < 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::ENXIO) {
                    break; // no data past `at`
                }
                return Err(e);
            }
            // SAFETY: as above.
            let hole = unsafe { libc::lseek(source.as_raw_fd(), data, libc::SEEK_HOLE) };
            let hole = if hole < 0 { end } else { hole };
            let mut offset = data;
            while offset < hole {
                let want =
                    usize::try_from((hole - offset).min(buf.len() as i64)).unwrap_or(buf.len());
                let n = source.read_at(&mut buf[..want], offset as u64)?;
                if n == 0 {
                    break;
                }
                dest.write_all_at(&buf[..n], offset as u64)?;
                offset += n as i64;
            }
            at = hole;
        }
        dest.sync_all()?;
        Ok(CopyKind::Sparse)
    })();
    match result {
        Ok(kind) => {
            std::fs::rename(&staging, to)?;
            Ok(kind)
        }
        Err(e) => {
            let _ = std::fs::remove_file(&staging);
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sparse_image_copies_its_data_and_keeps_its_holes() {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let from = dir.path().join("a.img");
        let file = std::fs::File::create(&from).unwrap();
        file.set_len(64 << 20).unwrap();
        file.write_all_at(b"start", 0).unwrap();
        file.write_all_at(&vec![7u8; 1 << 20], 10 << 20).unwrap();
        file.write_all_at(b"end", (64 << 20) - 3).unwrap();
        file.sync_all().unwrap();
        let to = dir.path().join("b.img");
        let kind = copy_image(&from, &to).unwrap();
        assert_eq!(std::fs::read(&from).unwrap(), std::fs::read(&to).unwrap());
        let (size, disk) = sizes(&to);
        assert_eq!(size, 64 << 20);
        if kind == CopyKind::Sparse {
            assert!(
                disk < 4 << 20,
                "the holes were filled: {disk} bytes on disk"
            );
        }
        // A destination folder that is not there is an error, and leaves nothing.
        assert!(copy_image(&from, &dir.path().join("missing/c.img")).is_err());
    }
}
