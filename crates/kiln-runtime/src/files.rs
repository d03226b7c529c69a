//! A sandbox's workspace files: list, read, write, delete. They touch the workspace only
//! through [`kiln_workspace::Tree`], whose directory handles never follow a link, so code
//! changing the tree meanwhile can make them see an older or newer state, never a place
//! outside the workspace. Listings and reads run beside whatever the sandbox runs; a write
//! runs beside an execution too (and is recorded in the next history entry); deletes,
//! renames and writes otherwise take the sandbox busy and are recorded at once.

use std::sync::Arc;

use kiln_workspace::{Kind, RelPath, TreeError};
use serde::Serialize;
use utoipa::ToSchema;

use crate::Runtime;
use crate::auth::Caller;
use crate::error::{Result, RuntimeError};
use crate::exec::{self, with_sandbox};
use crate::sandbox::{Sandbox, new_id, rfc3339, workspace_path};

/// Most entries one listing returns.
pub const MAX_LISTING: usize = 10_000;

/// A file or folder in a workspace.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct FileEntry {
    #[schema(example = "data/input.csv")]
    pub path: String,
    /// `file`, `dir`, `symlink` (never followed), or `special` (a fifo, socket or device).
    #[schema(example = "file")]
    pub kind: String,
    pub size: u64,
    pub modified_at: String,
}

/// A listing.
#[derive(Debug, Serialize, ToSchema)]
pub struct FileList {
    pub files: Vec<FileEntry>,
    /// Whether the listing stopped at 10 000 entries.
    pub truncated: bool,
}

/// A written or deleted file.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct FileChange {
    #[schema(example = "data/input.csv")]
    pub path: String,
    pub size: u64,
    /// The history entry recording the change (absent when nothing changed).
    pub history_id: Option<String>,
    pub commit_id: Option<String>,
    /// Set when the file was written while an execution ran in the sandbox: the write is
    /// done, and the next history entry (that execution's, or the next change's) records it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub history_pending: bool,
}

/// Lists a workspace folder (recursive, at most [`MAX_LISTING`] entries; default the
/// whole workspace).
pub async fn list(
    rt: &Arc<Runtime>,
    caller: &Caller,
    id: &str,
    folder: Option<String>,
) -> Result<FileList> {
    read_only(rt, caller, id, move |sandbox| {
        let start = match folder.as_deref() {
            Some(path) if !path.is_empty() => workspace_path(path)?,
            _ => RelPath::root(),
        };
        let tree = sandbox.tree()?;
        match tree.stat(&start)? {
            Some(meta) if meta.kind == Kind::Dir => {}
            Some(meta) if meta.kind == Kind::Symlink => {
                return Err(TreeError::Link {
                    path: start.to_string(),
                }
                .into());
            }
            _ => {
                return Err(RuntimeError::FolderNotFound {
                    path: start.to_string(),
                });
            }
        }
        let mut files = Vec::new();
        let truncated = tree.walk(&start, MAX_LISTING, &mut |path, meta| {
            let kind = match meta.kind {
                Kind::File => "file",
                Kind::Dir => "dir",
                Kind::Symlink => "symlink",
                _ => "special",
            };
            let modified_ms = u64::try_from(meta.mtime_ns / 1_000_000).unwrap_or(0);
            files.push(FileEntry {
                path: path.to_owned(),
                kind: kind.into(),
                size: if meta.kind == Kind::File {
                    meta.size
                } else {
                    0
                },
                modified_at: rfc3339(modified_ms),
            });
        })?;
        files.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(FileList { files, truncated })
    })
    .await
}

/// Opens a workspace file for reading (a regular file, never through a link), beside
/// whatever the sandbox runs; returns it and its size.
pub async fn open(
    rt: &Arc<Runtime>,
    caller: &Caller,
    id: &str,
    name: String,
) -> Result<(std::fs::File, u64)> {
    read_only(rt, caller, id, move |sandbox| {
        let rel = workspace_path(&name)?;
        let (file, meta) = sandbox.tree()?.open_file(&rel).map_err(|e| match e {
            TreeError::IsDir { .. } => RuntimeError::IsAFolder { path: name.clone() },
            other => other.into(),
        })?;
        Ok((file, meta.size))
    })
    .await
}

/// A workspace file's bytes, at most `limit` (a larger file is refused with
/// [`RuntimeError::FileTooLarge`]).
pub async fn read(
    rt: &Arc<Runtime>,
    caller: &Caller,
    id: &str,
    name: String,
    limit: u64,
) -> Result<Vec<u8>> {
    let (file, size) = open(rt, caller, id, name.clone()).await?;
    if size > limit {
        return Err(RuntimeError::FileTooLarge {
            id: id.to_owned(),
            path: name,
            size,
            limit,
        });
    }
    exec::blocking(move || {
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut std::io::Read::take(file, limit), &mut bytes)
            .map(|_| bytes)
            .map_err(|e| RuntimeError::internal(format!("could not read {name}: {e}")))
    })
    .await
}

/// Writes a workspace file (folders are made as needed) and records the change.
pub async fn write(
    rt: &Arc<Runtime>,
    caller: &Caller,
    id: &str,
    name: String,
    body: Vec<u8>,
) -> Result<FileChange> {
    let history_id = new_id("upload_");
    let work = history_id.clone();
    let quotas = rt.quotas(caller);
    let usage = rt.registry.usage(&caller.tenant);
    if body.len() as u64 > usage.workspace_room(&quotas) {
        return Err(crate::quota::exceeded(
            "workspaceBytes",
            quotas.workspace_bytes,
            usage.workspace_bytes,
            "bytes",
        ));
    }
    let path = workspace_path(&name)?;
    match rt.registry.begin(&caller.tenant, id, &work, None) {
        Ok((sandbox, _, _)) => {
            let rt = rt.clone();
            exec::blocking(move || {
                let written = write_one(&sandbox, path, body).and_then(|size| {
                    let summary = format!("upload {name}");
                    recorded_change(&rt, &sandbox, &summary, history_id, name, size)
                });
                rt.registry.finish(&sandbox.id, None).and(written)
            })
            .await
        }
        // An execution is running: write beside it; its own record (or the next) takes the
        // file into the history, which only one change writes at a time.
        Err(RuntimeError::SandboxBusy { running, .. }) if exec::is_execution(&running) => {
            // Noted before the file is written: an execution that changed nothing itself
            // then still records the workspace, with this file in it.
            rt.registry.note_files_written(&caller.tenant, id)?;
            read_only(rt, caller, id, move |sandbox| {
                let size = write_one(&sandbox, path, body)?;
                Ok(FileChange {
                    path: name,
                    size,
                    history_id: None,
                    commit_id: None,
                    history_pending: true,
                })
            })
            .await
        }
        Err(error) => Err(error),
    }
}

/// Writes one workspace file; returns its size.
fn write_one(sandbox: &Sandbox, path: RelPath, body: Vec<u8>) -> Result<u64> {
    let size = body.len() as u64;
    exec::write_files(&sandbox.tree()?, &[(path, body)]).map_err(|e| disk_full(sandbox, e))?;
    Ok(size)
}

/// Deletes a file or folder (recursively, never following a link) and records the change.
pub async fn delete(
    rt: &Arc<Runtime>,
    caller: &Caller,
    id: &str,
    name: String,
) -> Result<FileChange> {
    let history_id = new_id("delete_");
    let work = history_id.clone();
    with_sandbox(rt, caller, id, &work, move |rt, sandbox| {
        let path = workspace_path(&name)?;
        sandbox.tree()?.remove(&path)?;
        let summary = format!("delete {name}");
        recorded_change(rt, &sandbox, &summary, history_id, name, 0)
    })
    .await
}

/// Records a file change in the history as entry `history_id` and describes it (no history
/// id when nothing changed).
fn recorded_change(
    rt: &Runtime,
    sandbox: &Sandbox,
    summary: &str,
    history_id: String,
    path: String,
    size: u64,
) -> Result<FileChange> {
    let commit_id = exec::record(&rt.registry, sandbox, summary, &history_id)?.commit_id;
    Ok(FileChange {
        path,
        size,
        history_id: commit_id.as_ref().map(|_| history_id),
        commit_id,
        history_pending: false,
    })
}

/// A full volume said as the sandbox's own disk being full, not the server's.
fn disk_full(sandbox: &crate::sandbox::Sandbox, error: RuntimeError) -> RuntimeError {
    let full = matches!(
        &error,
        RuntimeError::NoSpace { .. }
            | RuntimeError::Workspace(kiln_workspace::TreeError::NoSpace { .. })
    );
    match sandbox.resources {
        Some(resources) if full && sandbox.volume => RuntimeError::SandboxDiskFull {
            disk_mb: resources.disk_mb,
        },
        _ => error,
    }
}

/// One workspace entry, described (never followed if it is a link).
#[derive(Debug, Clone)]
pub struct Described {
    /// Relative to the workspace (`""`: the workspace itself).
    pub path: String,
    pub meta: kiln_workspace::Meta,
    /// Where a link points.
    pub link: Option<String>,
}

fn describe_at(
    tree: &kiln_workspace::Tree,
    rel: &RelPath,
    meta: kiln_workspace::Meta,
) -> Described {
    let link = (meta.kind == Kind::Symlink)
        .then(|| tree.read_link(rel).ok())
        .flatten()
        .map(|t| String::from_utf8_lossy(&t).into_owned());
    Described {
        path: rel.as_str().to_owned(),
        meta,
        link,
    }
}

/// Describes one workspace path; `FILE_NOT_FOUND` when there is none.
pub async fn describe(
    rt: &Arc<Runtime>,
    caller: &Caller,
    id: &str,
    name: String,
) -> Result<Described> {
    read_only(rt, caller, id, move |sandbox| {
        let rel = relative(&name)?;
        let tree = sandbox.tree()?;
        match tree.stat(&rel)? {
            Some(meta) => Ok(describe_at(&tree, &rel, meta)),
            None => Err(TreeError::NotFound { path: name }.into()),
        }
    })
    .await
}

/// Runs blocking read-only `work` on sandbox `id` of `caller` beside whatever it runs: it
/// describes entries through the workspace's handles and never follows a link, so code
/// changing the tree meanwhile can make it see an older or newer state, never outside the
/// workspace. (Taking the sandbox busy would make a watcher's polls refuse the sandbox's
/// own work.)
async fn read_only<T: Send + 'static>(
    rt: &Arc<Runtime>,
    caller: &Caller,
    id: &str,
    work: impl FnOnce(crate::sandbox::Sandbox) -> Result<T> + Send + 'static,
) -> Result<T> {
    let sandbox = rt.registry.get(&caller.tenant, id)?.meta;
    exec::blocking(move || work(sandbox)).await
}

/// `name` as a workspace path; `""` is the workspace itself.
fn relative(name: &str) -> Result<RelPath> {
    if name.is_empty() {
        Ok(RelPath::root())
    } else {
        workspace_path(name)
    }
}

/// The entries of a workspace folder down to `depth` levels (1: its own entries), in name
/// order, a folder's entries after it; at most [`MAX_LISTING`]. A missing folder is
/// `FOLDER_NOT_FOUND`; a file or link there is refused.
pub async fn entries(
    rt: &Arc<Runtime>,
    caller: &Caller,
    id: &str,
    folder: String,
    depth: usize,
) -> Result<Vec<Described>> {
    read_only(rt, caller, id, move |sandbox| {
        let start = relative(&folder)?;
        let tree = sandbox.tree()?;
        match tree.stat(&start)? {
            Some(meta) if meta.kind == Kind::Dir => {}
            Some(_) => {
                return Err(TreeError::NotDir {
                    path: start.to_string(),
                }
                .into());
            }
            None => {
                return Err(RuntimeError::FolderNotFound {
                    path: start.to_string(),
                });
            }
        }
        let base = start.parts().count();
        let mut found = Vec::new();
        tree.walk(&start, MAX_LISTING, &mut |path, meta| {
            if let Ok(rel) = RelPath::parse(path)
                && rel.parts().count() - base <= depth.max(1)
            {
                found.push((rel, *meta));
            }
        })?;
        found.sort_by(|a, b| a.0.parts().cmp(b.0.parts()));
        Ok(found
            .into_iter()
            .map(|(rel, meta)| describe_at(&tree, &rel, meta))
            .collect())
    })
    .await
}

/// Makes a workspace folder and the folders on the way; `false` if it already was one.
pub async fn make_dir(rt: &Arc<Runtime>, caller: &Caller, id: &str, name: String) -> Result<bool> {
    let work = new_id("mkdir_");
    with_sandbox(rt, caller, id, &work, move |_, sandbox| {
        let rel = relative(&name)?;
        let tree = sandbox.tree()?;
        match tree.stat(&rel)? {
            Some(meta) if meta.kind == Kind::Dir => return Ok(false),
            Some(_) => {
                return Err(TreeError::NotDir {
                    path: rel.to_string(),
                }
                .into());
            }
            None => {}
        }
        tree.make_dirs(&rel)?;
        Ok(true)
    })
    .await
}

/// Renames a workspace entry, and records the change.
pub async fn rename(
    rt: &Arc<Runtime>,
    caller: &Caller,
    id: &str,
    from: String,
    to: String,
) -> Result<Described> {
    let history_id = new_id("move_");
    let work = history_id.clone();
    with_sandbox(rt, caller, id, &work, move |rt, sandbox| {
        let (source, target) = (relative(&from)?, relative(&to)?);
        let tree = sandbox.tree()?;
        tree.rename(&source, &target)?;
        let moved = tree
            .stat(&target)?
            .ok_or_else(|| TreeError::NotFound { path: to.clone() })?;
        let described = describe_at(&tree, &target, moved);
        recorded_change(
            rt,
            &sandbox,
            &format!("move {from} to {to}"),
            history_id,
            to,
            0,
        )?;
        Ok(described)
    })
    .await
}
