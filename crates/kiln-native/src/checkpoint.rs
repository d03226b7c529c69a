//! Checkpoints of hibernated boxes on disk: CRIU's images of the box's processes, and what
//! kiln needs to restore them (the box's spec, the lineage of the box, what its agent's
//! channel had open).
//!
//! ```text
//! sandboxes/<id>/checkpoint/           0700, beside the volume's mount point: out of the
//!                                      guest's reach (it sees only volume/workspace)
//! sandboxes/<id>/checkpoint/images/    CRIU's images (and its dump and restore logs)
//! sandboxes/<id>/checkpoint/kiln.json  written last: a checkpoint without it is incomplete
//! ```
//!
//! Only a box whose writable layer outlives it (`.layer` on the sandbox's volume) is
//! checkpointed: its processes come back over the same files. A checkpoint is used once:
//! restored (or failing to restore), it is removed, so the same processes never run twice.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use kiln_core::process::IdleOverrides;

use crate::channel::Carried;
use crate::jail::BoxLimits;

/// What a box was started with, to start it again the same way from its checkpoint.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BoxRecipe {
    /// Its template's catalogue id (`linux-python`).
    pub template: String,
    pub limits: BoxLimits,
    /// Whether it had the allowlist proxy (`network: allowlist`).
    pub network: bool,
    /// Where its workspace was mounted, when not at the template's working dir.
    pub workspace_at: Option<String>,
    pub idle: IdleOverrides,
    /// The sandbox's egress rules its proxy applied (a restored box gets them before its
    /// processes run on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<kiln_core::net::EgressGrant>,
    /// The host folders bound into it (its sandbox's named volumes).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<kiln_core::Mount>,
}

/// A checkpoint's record (`kiln.json`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Record {
    pub lineage: u64,
    pub carried: Carried,
    pub recipe: BoxRecipe,
    /// The images' size on disk.
    pub bytes: u64,
    /// When it was taken (ms since the epoch).
    pub made_ms: u64,
}

const RECORD: &str = "kiln.json";

/// The checkpoint folder of the sandbox whose workspace is `workspace`: only for a
/// workspace on a volume (`sandboxes/<id>/volume/workspace` → `sandboxes/<id>/checkpoint`).
pub fn folder(workspace: &Path) -> Option<PathBuf> {
    crate::backend::persistent_layer(workspace)?;
    Some(workspace.parent()?.parent()?.join("checkpoint"))
}

/// The folder CRIU writes its images to, in a checkpoint folder.
pub fn images(folder: &Path) -> PathBuf {
    folder.join("images")
}

/// The record of the complete checkpoint in `folder`, if there is one.
pub fn read(folder: &Path) -> Option<Record> {
    let file = std::fs::File::open(folder.join(RECORD)).ok()?;
    // A record is small; one this big was not written by kiln.
    let mut text = Vec::new();
    std::io::Read::read_to_end(&mut std::io::Read::take(file, 1 << 20), &mut text).ok()?;
    serde_json::from_slice(&text).ok()
}

/// Whether `folder` holds a complete checkpoint (its record written): a stat, no parse, for
/// the hot path of asking a box's state (a torn record is found out when it is restored).
pub fn is_complete(folder: &Path) -> bool {
    folder.join(RECORD).is_file()
}

/// Makes `folder` afresh (anything left in it is removed) with an empty images folder,
/// both entered only by root and `owner` (the host uid of the box's root: CRIU restores the
/// box's processes as it, and they read their images; the guest never sees the path).
pub fn prepare(folder: &Path, owner: u32) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    remove(folder);
    std::fs::DirBuilder::new().mode(0o700).create(folder)?;
    let images = images(folder);
    std::fs::DirBuilder::new().mode(0o700).create(&images)?;
    for path in [folder, images.as_path()] {
        std::os::unix::fs::lchown(path, Some(owner), Some(0))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o750))?;
    }
    Ok(images)
}

/// Gives CRIU's image files to `owner` (the host uid of the box's root), readable by root's
/// group too: the restored processes open some of them themselves (`timens-N.img`,
/// `tty-info.img`), some before they take the box root's uid (still the host's root then, with
/// no capability over the host's files) and some after, and CRIU writes a few readable by root
/// alone (a restore failed on `timens-0.img` when they were root's, and on `timens-13.img`
/// when they were the box root's alone). Not following links (CRIU writes plain files here;
/// the guest never reaches this folder).
pub fn hand_to(images: &Path, owner: u32) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    for entry in std::fs::read_dir(images)? {
        let path = entry?.path();
        std::os::unix::fs::lchown(&path, Some(owner), Some(0))?;
        let meta = std::fs::symlink_metadata(&path)?;
        if meta.is_file() {
            let mode = meta.mode() & 0o7777;
            std::fs::set_permissions(
                &path,
                std::fs::Permissions::from_mode((mode | 0o040) & !0o007),
            )?;
        }
    }
    Ok(())
}

/// Writes the record, making the checkpoint complete (written aside, then renamed).
pub fn complete(folder: &Path, record: &Record) -> std::io::Result<()> {
    let partial = folder.join(format!("{RECORD}.partial"));
    std::fs::write(
        &partial,
        serde_json::to_vec(record).map_err(std::io::Error::other)?,
    )?;
    std::fs::rename(&partial, folder.join(RECORD))
}

/// Copies the complete checkpoint in `from` to `to` (made afresh, entered by root and
/// `owner` as [`prepare`] makes it), its images given to `owner` as [`hand_to`] does; `from`
/// is left as it is. Answers its record (to be written with [`complete`]: `to` is not complete
/// until then). Plain files only: a checkpoint folder holds nothing else (it is kiln's, out
/// of every guest's reach), and anything else found there is refused.
pub fn copy(from: &Path, to: &Path, owner: u32) -> std::io::Result<Record> {
    let record = read(from).ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("{}: no complete checkpoint", from.display()),
        )
    })?;
    let images = prepare(to, owner)?;
    let copied = (|| {
        for entry in std::fs::read_dir(self::images(from))? {
            let entry = entry?;
            if !entry.file_type()?.is_file() {
                return Err(std::io::Error::other(format!(
                    "{}: not a plain file",
                    entry.path().display()
                )));
            }
            std::fs::copy(entry.path(), images.join(entry.file_name()))?;
        }
        hand_to(&images, owner)
    })();
    if let Err(e) = copied {
        remove(to);
        return Err(e);
    }
    Ok(record)
}

/// Removes a checkpoint (used, failed or abandoned).
pub fn remove(folder: &Path) {
    let _ = std::fs::remove_dir_all(folder);
}

/// The bytes the files under `folder` take (CRIU's images: plain files in one folder).
pub fn size(folder: &Path) -> u64 {
    std::fs::read_dir(folder)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| entry.metadata().ok())
        .filter(std::fs::Metadata::is_file)
        .map(|m| m.len())
        .sum()
}

/// Now, in ms since the epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_round_trips_and_an_incomplete_checkpoint_reads_as_none() {
        let dir = tempfile::tempdir().unwrap();
        let folder = dir.path().join("checkpoint");
        let images = prepare(&folder, 0).unwrap();
        assert!(images.is_dir());
        assert_eq!(read(&folder), None, "no record yet: incomplete");
        std::fs::write(images.join("pages-1.img"), vec![0u8; 4096]).unwrap();
        let record = Record {
            lineage: 7,
            carried: Carried {
                next: 42,
                streams: vec![3, 9],
                listeners: vec![3],
            },
            recipe: BoxRecipe {
                template: "linux-python".into(),
                limits: BoxLimits {
                    memory_bytes: 1 << 30,
                    vcpus: 1.5,
                    pids: 256,
                    disk_bytes: 1 << 30,
                    weight: 100,
                },
                network: true,
                workspace_at: None,
                idle: IdleOverrides::default(),
                egress: Some(kiln_core::net::EgressGrant {
                    rules: kiln_core::net::Egress {
                        deny_out: vec!["0.0.0.0/0".into()],
                        ..Default::default()
                    },
                    widen: false,
                    tenant: "t".into(),
                    sandbox: "sb".into(),
                }),
                mounts: Vec::new(),
            },
            bytes: size(&images),
            made_ms: now_ms(),
        };
        assert_eq!(record.bytes, 4096);
        complete(&folder, &record).unwrap();
        assert_eq!(read(&folder), Some(record));
        // A record that is not one (a torn or foreign file) is no checkpoint.
        std::fs::write(folder.join(RECORD), b"{not json").unwrap();
        assert_eq!(read(&folder), None);
        // Preparing again starts from nothing.
        let images = prepare(&folder, 0).unwrap();
        assert_eq!(size(&images), 0);
        remove(&folder);
        assert!(!folder.exists());
    }
}
