//! Git-versioned workspaces. Each sandbox has a real git repository, `history.git` beside
//! (never inside) its workspace, so code in the sandbox cannot rewrite its own history.
//! Every change made through the API (an exec or session turn that changed files, an upload,
//! a delete, a rollback) is one commit whose message carries the change's id in a
//! `Kiln-Exec-Id:` trailer and the files it touched in a `Kiln-Files:` trailer. Users can
//! `git clone` the repository or inspect it with any git tool.
//!
//! The workspace is hostile: code in it plants links, fifos, huge sparse files and nested
//! `.git` folders. So git never walks the workspace itself (no index, no work tree): kiln
//! reads it through [`kiln_workspace`] (directory handles, no link followed), builds the
//! trees itself, and writes a rollback back the same way. Links are recorded as links, never
//! followed; fifos, sockets and devices are left out; files above [`MAX_FILE_BYTES`] are left
//! out and reported. A name git refuses in a tree (`.git` in any case, with any number of
//! `~` after it) is stored with one more `~` and given back as it was, so a guest's nested
//! repository is recorded as plain files and restored exactly.
//!
//! Histories are linear: listing follows first parents from the head or a cursor, a page at a
//! time (nothing walks or counts the whole history), and reads each change's file list from
//! its message (no tree diff per entry); entries read once are kept in memory by commit id
//! ([`History::page`]). The root commit is also `refs/kiln/initial`, so a diff from
//! `initial` needs no walk. Loose objects are
//! packed now and then ([`History::pack_if_due`]).

use std::collections::{BTreeMap, HashMap};
use std::ffi::{OsStr, OsString};
use std::io::Read;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use git2::{Delta, DiffOptions, ObjectType, Oid, Repository, Signature, Time};
use kiln_workspace::{Dir, Kind, Tree, TreeError};
use serde::Serialize;

use crate::sandbox::now_ms;

/// The id of the commit every history starts from.
pub const INITIAL_ID: &str = "initial";

const TRAILER: &str = "Kiln-Exec-Id: ";
const FILES_TRAILER: &str = "Kiln-Files: ";
const INITIAL_REF: &str = "refs/kiln/initial";
/// How a history being made under a temporary name ends ([`History::open_or_create`]); a
/// crash can leave one, which [`remove_pending`] clears at start-up.
const PENDING_SUFFIX: &str = ".pending";

/// Most history entries one listing returns.
pub const MAX_HISTORY: usize = 1000;

/// The largest file history records: 64 MiB (the most one execution may write). Larger
/// files stay in the workspace but are left out of the commit, and the change says so.
pub const MAX_FILE_BYTES: u64 = 64 * 1024 * 1024;

/// Most entries (files, folders, links) one commit records.
pub const MAX_ENTRIES: usize = 100_000;

/// Most file names one change lists in its message.
const MAX_LISTED_FILES: usize = 1000;

/// A history operation failed.
#[derive(Debug, thiserror::Error)]
pub enum HistoryError {
    #[error("no change {0:?} in this sandbox's history")]
    UnknownId(String),
    #[error("the workspace history could not be read or written: {}", .0.message())]
    Git(#[from] git2::Error),
    #[error("the workspace could not be read or written: {0}")]
    Workspace(#[from] TreeError),
}

impl HistoryError {
    /// Whether the disk was full.
    pub fn is_no_space(&self) -> bool {
        match self {
            HistoryError::Workspace(e) => e.is_no_space(),
            HistoryError::Git(e) => {
                let text = e.message().to_ascii_lowercase();
                text.contains("no space left") || text.contains("disk quota")
            }
            HistoryError::UnknownId(_) => false,
        }
    }
}

/// One entry of a sandbox's history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct HistoryEntry {
    /// The change's id: an execution id (`python_run_…`), `upload_…`, `delete_…`,
    /// `rollback_…`, or `initial`.
    #[schema(example = "python_run_3f2a9c1b7d4e5f60718293a4")]
    pub id: String,
    /// The git commit.
    #[schema(example = "9fceb02d0ae598e95dc970b74767f19372d61af8")]
    pub commit_id: String,
    /// When it was recorded (RFC 3339).
    #[schema(example = "2026-11-22T14:03:32.120Z")]
    pub timestamp: String,
    /// What happened.
    #[schema(example = "python main.py")]
    pub message: String,
    /// The files it added, changed or removed (at most 1 000).
    pub files: Vec<String>,
}

/// Something in the workspace a commit did not record.
#[derive(Debug, Clone, Serialize, PartialEq, Eq, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct LeftOut {
    /// The path, relative to the workspace.
    pub path: String,
    /// Why: `too_large` (above 64 MiB), `special` (a fifo, socket or device), `too_many`
    /// (the workspace has more than 100 000 entries).
    pub reason: String,
}

/// What recording a change did.
#[derive(Debug, Clone, Default)]
pub struct Recorded {
    /// The new commit, or `None` when nothing changed.
    pub commit_id: Option<String>,
    /// What the commit left out.
    pub left_out: Vec<LeftOut>,
    /// Bytes in the workspace's files (their apparent sizes, left-out ones included).
    pub bytes: u64,
}

/// A sandbox's workspace repository.
pub struct History {
    repo: Repository,
    /// What is kept in memory for this repository.
    memory: Arc<RepoMemory>,
}

fn signature() -> Result<Signature<'static>, git2::Error> {
    signature_at(now_ms())
}

fn signature_at(ms: u64) -> Result<Signature<'static>, git2::Error> {
    Signature::new(
        "kiln",
        "kiln@localhost",
        &Time::new(i64::try_from(ms / 1000).unwrap_or(i64::MAX), 0),
    )
}

/// Makes an empty bare repository at `git_dir` and opens it.
fn create_repository(git_dir: &Path) -> Result<Repository, git2::Error> {
    setup_libgit2();
    make_bare(git_dir)
        .map_err(|e| git2::Error::from_str(&format!("could not create the history: {e}")))?;
    Repository::open_bare(git_dir)
}

/// Records `root` as a new repository's first commit, dated `ms`, also `refs/kiln/initial`.
fn commit_initial(repo: &Repository, root: Oid, ms: u64) -> Result<(), git2::Error> {
    let sig = signature_at(ms)?;
    let commit = repo.commit(
        Some("HEAD"),
        &sig,
        &sig,
        &message("initial workspace", INITIAL_ID, &[]),
        &repo.find_tree(root)?,
        &[],
    )?;
    repo.reference(INITIAL_REF, commit, true, "the initial workspace")?;
    Ok(())
}

fn message(summary: &str, id: &str, files: &[String]) -> String {
    // One line of summary, bounded, then the trailers.
    let mut line: String = summary
        .lines()
        .next()
        .unwrap_or_default()
        .chars()
        .take(200)
        .collect();
    if line.is_empty() {
        line = "change".into();
    }
    let listed: Vec<&String> = files.iter().take(MAX_LISTED_FILES).collect();
    let files = serde_json::to_string(&listed).unwrap_or_else(|_| "[]".into());
    format!("{line}\n\n{TRAILER}{id}\n{FILES_TRAILER}{files}\n")
}

fn trailer<'a>(commit: &'a git2::Commit<'_>, name: &str) -> Option<&'a str> {
    let text = commit.message()?;
    text.lines()
        .rev()
        .find_map(|line| line.strip_prefix(name))
        .map(str::trim)
}

fn id_of(commit: &git2::Commit<'_>) -> Option<String> {
    trailer(commit, TRAILER).map(str::to_owned)
}

/// Whether git refuses `name` in a tree (after taking off trailing `~`s): `.git` in any case.
fn git_like(name: &[u8]) -> bool {
    let mut end = name.len();
    while end > 0 && name[end - 1] == b'~' {
        end -= 1;
    }
    name[..end].eq_ignore_ascii_case(b".git")
}

/// The name stored in a tree for a workspace name: `.git`-like names get one more `~`.
fn encode(name: &[u8]) -> Vec<u8> {
    let mut out = name.to_vec();
    if git_like(name) {
        out.push(b'~');
    }
    out
}

/// The workspace name for a name stored in a tree.
fn decode(stored: &[u8]) -> &[u8] {
    if git_like(stored) && stored.ends_with(b"~") {
        &stored[..stored.len() - 1]
    } else {
        stored
    }
}

/// A stored path (`a/.git~/HEAD`) as the workspace has it (`a/.git/HEAD`).
fn decode_path(stored: &[u8]) -> String {
    let parts: Vec<String> = stored
        .split(|b| *b == b'/')
        .map(|part| String::from_utf8_lossy(decode(part)).into_owned())
        .collect();
    parts.join("/")
}

/// What kiln keeps in memory for one history repository, shared by every [`History`] opened
/// on it (one entry per repository, dropped by [`forget`]).
#[derive(Debug, Default)]
struct RepoMemory {
    /// One writer at a time: changes (from the request path) and packing (in the background)
    /// take turns.
    write: Mutex<()>,
    /// Blob ids of files whose metadata has not changed since they were hashed: a commit
    /// re-reads only what changed. Keyed by (device, inode); an entry is trusted only when
    /// size, mtime, ctime and the execute bit all match, and is made only for files whose
    /// ctime is more than 100 ms old: file times tick with the kernel's coarse clock (one
    /// jiffy, at most 10 ms), so a later change of the same file always shows in its ctime,
    /// which guest code cannot set.
    blobs: Mutex<HashMap<(u64, u64), CachedBlob>>,
    /// History entries already read, by commit ([`History::page`]).
    entries: Mutex<EntryCache>,
    /// Changes recorded, for [`pack_check_due`].
    changes: AtomicU32,
    /// Whether a packer runs now.
    packing: AtomicBool,
}

/// A stat-cache entry: size, mtime, ctime, the execute bit, and the blob.
type CachedBlob = (u64, i64, i64, bool, Oid);

/// History entries of one repository already read, each with its commit's first parent. A
/// commit never changes once written (its id is the hash of its content), so an entry read
/// once holds for good: a page of entries already read reads no object at all, and a page's
/// cost does not depend on the history's length. Bounded by the bytes it holds: over
/// [`ENTRY_CACHE_REPO_BYTES`] it starts again (a client paging through a long history keeps
/// its last pages); when all repositories' together would pass [`ENTRY_CACHE_BYTES`], all
/// start again (the ones in use fill theirs again).
#[derive(Debug, Default)]
struct EntryCache {
    entries: HashMap<Oid, (HistoryEntry, Option<Oid>)>,
    /// About what `entries` holds, in bytes ([`entry_bytes`]), also counted in
    /// [`CACHED_ENTRY_BYTES`] until dropped.
    bytes: usize,
}

impl Drop for EntryCache {
    fn drop(&mut self) {
        CACHED_ENTRY_BYTES.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// Empties every repository's [`EntryCache`].
fn clear_entry_caches() {
    let repos = REPOS.lock().unwrap_or_else(|e| e.into_inner());
    for memory in repos.iter().flat_map(|r| r.values()) {
        let mut cache = memory.entries.lock().unwrap_or_else(|e| e.into_inner());
        *cache = EntryCache::default();
    }
}

static REPOS: Mutex<Option<HashMap<PathBuf, Arc<RepoMemory>>>> = Mutex::new(None);
/// Stat-cache entries of all repositories together, and the most kept.
static CACHED_BLOBS: AtomicUsize = AtomicUsize::new(0);
const STAT_CACHE_MAX: usize = 200_000;
/// Bytes of history entries kept for all repositories together, and for one: 4 MiB is about
/// 16 pages of 1 000 of typical entries (one change's file list may be 1 000 names).
static CACHED_ENTRY_BYTES: AtomicUsize = AtomicUsize::new(0);
const ENTRY_CACHE_BYTES: usize = 64 << 20;
/// (Tests page through histories far larger than this, to see it start again.)
const ENTRY_CACHE_REPO_BYTES: usize = if cfg!(test) { 64 << 10 } else { 4 << 20 };

/// About the memory an entry takes in the cache.
fn entry_bytes(entry: &HistoryEntry) -> usize {
    let strings = [
        &entry.id,
        &entry.commit_id,
        &entry.timestamp,
        &entry.message,
    ];
    160 + strings.iter().map(|s| s.len()).sum::<usize>()
        + entry.files.iter().map(|f| f.len() + 24).sum::<usize>()
}

fn memory(git_dir: &Path) -> Arc<RepoMemory> {
    let mut repos = REPOS.lock().unwrap_or_else(|e| e.into_inner());
    repos
        .get_or_insert_with(HashMap::new)
        .entry(git_dir.to_path_buf())
        .or_default()
        .clone()
}

impl RepoMemory {
    fn cached_blob(&self, meta: &kiln_workspace::Meta) -> Option<Oid> {
        let blobs = self.blobs.lock().unwrap_or_else(|e| e.into_inner());
        let (size, mtime, ctime, exec, oid) = *blobs.get(&(meta.dev, meta.ino))?;
        (size == meta.size
            && mtime == meta.mtime_ns
            && ctime == meta.ctime_ns
            && exec == meta.executable())
        .then_some(oid)
    }

    fn remember_blob(&self, meta: &kiln_workspace::Meta, oid: Oid, now_ns: i64) {
        if meta.ctime_ns > now_ns.saturating_sub(100_000_000) {
            return;
        }
        let mut blobs = self.blobs.lock().unwrap_or_else(|e| e.into_inner());
        if CACHED_BLOBS.load(Ordering::Relaxed) >= STAT_CACHE_MAX {
            // Over the total: this repository starts again (the others keep theirs).
            CACHED_BLOBS.fetch_sub(blobs.len(), Ordering::Relaxed);
            blobs.clear();
        }
        let entry = (
            meta.size,
            meta.mtime_ns,
            meta.ctime_ns,
            meta.executable(),
            oid,
        );
        if blobs.insert((meta.dev, meta.ino), entry).is_none() {
            CACHED_BLOBS.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The entry of commit `oid` and its first parent, if read before.
    fn cached_entry(&self, oid: Oid) -> Option<(HistoryEntry, Option<Oid>)> {
        let cache = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        cache.entries.get(&oid).cloned()
    }

    fn remember_entry(&self, oid: Oid, entry: &HistoryEntry, parent: Option<Oid>) {
        let bytes = entry_bytes(entry);
        if CACHED_ENTRY_BYTES.load(Ordering::Relaxed) + bytes > ENTRY_CACHE_BYTES {
            // Taken without this repository's lock held: `clear_entry_caches` takes `REPOS`
            // first, then each cache's lock.
            clear_entry_caches();
        }
        let mut cache = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if cache.bytes + bytes > ENTRY_CACHE_REPO_BYTES {
            *cache = EntryCache::default();
        }
        if cache.entries.insert(oid, (entry.clone(), parent)).is_none() {
            cache.bytes += bytes;
            CACHED_ENTRY_BYTES.fetch_add(bytes, Ordering::Relaxed);
        }
    }
}

/// Forgets what is kept in memory for a repository (its sandbox is gone).
pub fn forget(git_dir: &Path) {
    let mut repos = REPOS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(memory) = repos.as_mut().and_then(|r| r.remove(git_dir)) {
        let blobs = memory.blobs.lock().unwrap_or_else(|e| e.into_inner());
        CACHED_BLOBS.fetch_sub(blobs.len(), Ordering::Relaxed);
        // Its entries are given back when the last handle on it goes (`EntryCache::drop`).
    }
}

fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}

struct Stager<'a> {
    repo: &'a Repository,
    memory: &'a RepoMemory,
    entries: usize,
    now_ns: i64,
    left_out: Vec<LeftOut>,
    bytes: u64,
}

impl Stager<'_> {
    fn leave_out(&mut self, path: String, reason: &str) {
        if self.left_out.len() < 100 {
            self.left_out.push(LeftOut {
                path,
                reason: reason.into(),
            });
        }
    }

    /// The tree of `dir`, or `None` when it records nothing (git keeps no empty folders).
    fn tree(&mut self, dir: &Dir, prefix: &str) -> Result<Option<Oid>, HistoryError> {
        let names = dir.names(MAX_ENTRIES + 1).map_err(|e| within(e, prefix))?;
        let mut builder = self.repo.treebuilder(None)?;
        for name in names {
            let path = join(prefix, &name);
            if self.entries >= MAX_ENTRIES {
                self.leave_out(path, "too_many");
                continue;
            }
            let Some(meta) = dir.entry(&name).map_err(|e| within(e, prefix))? else {
                continue;
            };
            self.entries += 1;
            let stored = encode(name.as_bytes());
            self.bytes = self.bytes.saturating_add(meta.size);
            match meta.kind {
                Kind::File => {
                    if meta.size > MAX_FILE_BYTES {
                        self.leave_out(path, "too_large");
                        continue;
                    }
                    let oid = match self.memory.cached_blob(&meta) {
                        Some(oid) => oid,
                        None => {
                            let (file, meta) =
                                dir.open_file(&name).map_err(|e| within(e, prefix))?;
                            let oid = self.blob(file, meta.size, &path)?;
                            self.memory.remember_blob(&meta, oid, self.now_ns);
                            oid
                        }
                    };
                    let mode = if meta.executable() {
                        0o100755
                    } else {
                        0o100644
                    };
                    builder.insert(OsStr::from_bytes(&stored), oid, mode)?;
                }
                Kind::Symlink => {
                    let target = dir.read_link(&name).map_err(|e| within(e, prefix))?;
                    let oid = self.repo.blob(&target)?;
                    builder.insert(OsStr::from_bytes(&stored), oid, 0o120000)?;
                }
                Kind::Dir => {
                    let sub = dir.open_dir(&name).map_err(|e| within(e, prefix))?;
                    if let Some(oid) = self.tree(&sub, &path)? {
                        builder.insert(OsStr::from_bytes(&stored), oid, 0o040000)?;
                    }
                }
                _ => self.leave_out(path, "special"),
            }
        }
        if builder.is_empty() {
            return Ok(None);
        }
        Ok(Some(builder.write()?))
    }

    /// Streams a file into a blob (a file that changes size meanwhile is an error).
    fn blob(&self, file: std::fs::File, size: u64, path: &str) -> Result<Oid, HistoryError> {
        let odb = self.repo.odb()?;
        let length = usize::try_from(size).unwrap_or(usize::MAX);
        let mut writer = odb.writer(length, ObjectType::Blob)?;
        let copied = std::io::copy(&mut file.take(size), &mut writer).map_err(|e| {
            HistoryError::Workspace(TreeError::Io {
                op: "read",
                path: path.to_owned(),
                source: e,
            })
        })?;
        if copied != size {
            return Err(HistoryError::Workspace(TreeError::Changed {
                path: path.to_owned(),
            }));
        }
        Ok(writer.finalize()?)
    }
}

fn join(prefix: &str, name: &OsStr) -> String {
    let name = name.to_string_lossy();
    if prefix.is_empty() {
        name.into_owned()
    } else {
        format!("{prefix}/{name}")
    }
}

fn within(error: TreeError, prefix: &str) -> HistoryError {
    HistoryError::Workspace(error.within(prefix))
}

/// The empty tree's id (what an empty workspace records).
fn empty_tree(repo: &Repository) -> Result<Oid, git2::Error> {
    repo.treebuilder(None)?.write()
}

impl History {
    /// Creates the repository at `git_dir` and records the initial commit of `tree`
    /// (whatever the workspace holds).
    pub fn init(git_dir: &Path, tree: &Tree) -> Result<History, HistoryError> {
        let history = History {
            repo: create_repository(git_dir)?,
            memory: memory(git_dir),
        };
        let (root, _, _) = history.stage(tree)?;
        commit_initial(&history.repo, root, now_ms())?;
        Ok(history)
    }

    /// Opens the history at `git_dir`, making it first if there is none yet: a sandbox
    /// created empty gets its history on first use (most one-shot sandboxes never record
    /// anything, and making a repository was most of a create and of a delete). The
    /// repository made then holds what `init` would have recorded at creation: one initial
    /// commit of the empty workspace, dated `created_ms`. It is made under a temporary name
    /// beside `git_dir` and renamed into place, so two first uses at once, or a crash in
    /// the middle, never leave a half-made history: the loser of a race opens the winner's.
    pub fn open_or_create(git_dir: &Path, created_ms: u64) -> Result<History, HistoryError> {
        match std::fs::symlink_metadata(git_dir) {
            Ok(_) => return History::open(git_dir),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(HistoryError::Git(git2::Error::from_str(&format!(
                    "could not open the history: {e}"
                ))));
            }
        }
        let parent = git_dir.parent().unwrap_or(Path::new("."));
        let name = git_dir
            .file_name()
            .map_or("history".into(), |n| n.to_string_lossy());
        let temp = parent.join(format!(
            ".{name}.{}{PENDING_SUFFIX}",
            crate::sandbox::random_hex(8)
        ));
        let made = History::make_empty(&temp, created_ms);
        forget(&temp);
        let failed = |e: std::io::Error| {
            HistoryError::Git(git2::Error::from_str(&format!(
                "could not create the history: {e}"
            )))
        };
        if let Err(e) = made {
            let _ = kiln_workspace::remove_host_tree(&temp);
            return Err(e);
        }
        match std::fs::rename(&temp, git_dir) {
            Ok(()) => {
                crate::store::sync_dir(parent).map_err(failed)?;
            }
            Err(e) => {
                let _ = kiln_workspace::remove_host_tree(&temp);
                // Another first use made it meanwhile (`ENOTEMPTY`/`EEXIST`): use that.
                if std::fs::symlink_metadata(git_dir).is_err() {
                    return Err(failed(e));
                }
            }
        }
        History::open(git_dir)
    }

    /// A new repository at `git_dir` whose one commit, also `refs/kiln/initial`, is the
    /// empty workspace at `created_ms`.
    fn make_empty(git_dir: &Path, created_ms: u64) -> Result<(), HistoryError> {
        let repo = create_repository(git_dir)?;
        let root = empty_tree(&repo)?;
        Ok(commit_initial(&repo, root, created_ms)?)
    }

    /// Makes a copy of this repository at `git_dir` (which must not exist yet): the same
    /// commits, head and initial commit, so the copy's next change follows this one's head
    /// (a forked sandbox's history). Objects never change once written, so they are hard
    /// links where the file system allows, else copies; lock files stay behind. This
    /// repository's changes and packing wait meanwhile.
    pub fn clone_into(&self, git_dir: &Path) -> Result<History, HistoryError> {
        let _turn = self.memory.write.lock().unwrap_or_else(|e| e.into_inner());
        // No packer may remove loose objects while they are linked: take its turn.
        while self.memory.packing.swap(true, Ordering::AcqRel) {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let copied = copy_repository(self.repo.path(), git_dir);
        self.memory.packing.store(false, Ordering::Release);
        copied.map_err(|e| {
            HistoryError::Git(git2::Error::from_str(&format!(
                "could not copy the history: {e}"
            )))
        })?;
        History::open(git_dir)
    }

    /// Opens the repository of a workspace.
    pub fn open(git_dir: &Path) -> Result<History, HistoryError> {
        setup_libgit2();
        let repo = Repository::open_bare(git_dir)?;
        Ok(History {
            repo,
            memory: memory(git_dir),
        })
    }

    /// Builds the tree of the whole workspace as the guest sees it.
    fn stage(&self, tree: &Tree) -> Result<(Oid, Vec<LeftOut>, u64), HistoryError> {
        // Nothing runs in the sandbox while it is staged, so an entry that changes under the
        // walk is something else racing it: try again, then give up.
        let mut tries = 0;
        loop {
            match self.stage_once(tree) {
                Err(HistoryError::Workspace(TreeError::Changed { .. })) if tries < 3 => tries += 1,
                other => return other,
            }
        }
    }

    fn stage_once(&self, tree: &Tree) -> Result<(Oid, Vec<LeftOut>, u64), HistoryError> {
        let mut stager = Stager {
            repo: &self.repo,
            memory: &self.memory,
            entries: 0,
            now_ns: now_ns(),
            left_out: Vec::new(),
            bytes: 0,
        };
        let oid = match stager.tree(tree.root(), "")? {
            Some(oid) => oid,
            None => empty_tree(&self.repo)?,
        };
        Ok((oid, stager.left_out, stager.bytes))
    }

    fn head(&self) -> Result<git2::Commit<'_>, git2::Error> {
        self.repo.head()?.peel_to_commit()
    }

    /// The files that differ between two trees, as the workspace names them.
    fn changed_files(&self, old: Option<Oid>, new: Oid) -> Result<Vec<String>, git2::Error> {
        let old = old.map(|oid| self.repo.find_tree(oid)).transpose()?;
        let new = self.repo.find_tree(new)?;
        let diff = self
            .repo
            .diff_tree_to_tree(old.as_ref(), Some(&new), None)?;
        Ok(diff
            .deltas()
            .filter(|d| d.status() != Delta::Unmodified)
            .filter_map(|d| {
                d.new_file()
                    .path_bytes()
                    .or_else(|| d.old_file().path_bytes())
                    .map(decode_path)
            })
            .collect())
    }

    fn commit_tree(&self, tree: Oid, summary: &str, id: &str) -> Result<String, HistoryError> {
        let head = self.head()?;
        let files = self.changed_files(Some(head.tree_id()), tree)?;
        let tree = self.repo.find_tree(tree)?;
        let sig = signature()?;
        let oid = self.repo.commit(
            Some("HEAD"),
            &sig,
            &sig,
            &message(summary, id, &files),
            &tree,
            &[&head],
        )?;
        Ok(oid.to_string())
    }

    /// Records a note as change `id`: a commit of the workspace as last recorded (no file
    /// changes) with `summary` as its message (a workflow's events). Its commit id.
    pub fn note(&self, summary: &str, id: &str) -> Result<String, HistoryError> {
        let _turn = self.memory.write.lock().unwrap_or_else(|e| e.into_inner());
        let tree = self.head()?.tree_id();
        self.commit_tree(tree, summary, id)
    }

    /// The newest commit's id.
    pub fn head_id(&self) -> Result<String, HistoryError> {
        Ok(self.head()?.id().to_string())
    }

    /// The paths that differ between the states after changes `from` and `to` (ids or
    /// commit ids), as the workspace names them.
    pub fn changed_between(&self, from: &str, to: &str) -> Result<Vec<String>, HistoryError> {
        let from = self.find(from)?.tree_id();
        let to = self.find(to)?.tree_id();
        Ok(self.changed_files(Some(from), to)?)
    }

    /// Commits the workspace as change `id` if it differs from the last commit.
    pub fn record(&self, tree: &Tree, summary: &str, id: &str) -> Result<Recorded, HistoryError> {
        let _turn = self.memory.write.lock().unwrap_or_else(|e| e.into_inner());
        let (staged, left_out, bytes) = self.stage(tree)?;
        if self.head()?.tree_id() == staged {
            return Ok(Recorded {
                commit_id: None,
                left_out,
                bytes,
            });
        }
        Ok(Recorded {
            commit_id: Some(self.commit_tree(staged, summary, id)?),
            left_out,
            bytes,
        })
    }

    fn entry(&self, commit: &git2::Commit<'_>) -> Result<HistoryEntry, HistoryError> {
        let ms = u64::try_from(commit.time().seconds()).unwrap_or(0) * 1000;
        let files = match trailer(commit, FILES_TRAILER)
            .and_then(|json| serde_json::from_str::<Vec<String>>(json).ok())
        {
            Some(files) => files,
            // Commits made before the file list was kept in the message.
            None => {
                let parent = commit.parent(0).ok().map(|p| p.tree_id());
                let mut files = self.changed_files(parent, commit.tree_id())?;
                files.truncate(MAX_LISTED_FILES);
                files
            }
        };
        Ok(HistoryEntry {
            id: id_of(commit).unwrap_or_else(|| commit.id().to_string()),
            commit_id: commit.id().to_string(),
            timestamp: crate::sandbox::rfc3339(ms),
            message: commit.summary().unwrap_or_default().to_owned(),
            files,
        })
    }

    /// The entry of commit `oid` and the commit's first parent: from memory when read before
    /// ([`EntryCache`]), else read (one object) and kept. A commit that cannot be read is an
    /// error, never taken for the end of the history.
    fn entry_at(&self, oid: Oid) -> Result<(HistoryEntry, Option<Oid>), HistoryError> {
        if let Some(known) = self.memory.cached_entry(oid) {
            return Ok(known);
        }
        let commit = self.repo.find_commit(oid)?;
        let entry = self.entry(&commit)?;
        let parent = commit.parent_id(0).ok();
        self.memory.remember_entry(oid, &entry, parent);
        Ok((entry, parent))
    }

    /// The history, newest first: at most `limit` entries after the commit `cursor` (from the
    /// head when `None`), and the cursor of the next page when there is one (the id of the
    /// page's last commit, when that commit has a parent).
    ///
    /// A page costs what its entries cost, however long the history: it starts at the head
    /// or at the cursor's commit (found by id, no walk), follows first parents for `limit`
    /// commits and stops; nothing counts or sorts the whole history. Entries read before
    /// come from memory. A cursor that is not a commit id of this repository is
    /// [`HistoryError::UnknownId`].
    pub fn page(
        &self,
        limit: usize,
        cursor: Option<&str>,
    ) -> Result<(Vec<HistoryEntry>, Option<String>), HistoryError> {
        let mut at = match cursor {
            None => self.repo.head()?.target(),
            Some(cursor) => {
                let unknown = || HistoryError::UnknownId(cursor.to_owned());
                if cursor.len() != 40 {
                    return Err(unknown());
                }
                let oid = Oid::from_str(cursor).map_err(|_| unknown())?;
                match self.memory.cached_entry(oid) {
                    Some((_, parent)) => parent,
                    None => {
                        let commit = self.repo.find_commit(oid).map_err(|_| unknown())?;
                        commit.parent_id(0).ok()
                    }
                }
            }
        };
        let mut entries = Vec::with_capacity(limit.min(MAX_HISTORY));
        while let Some(oid) = at {
            if entries.len() == limit {
                break;
            }
            let (entry, parent) = self.entry_at(oid)?;
            entries.push(entry);
            at = parent;
        }
        // More after this page exactly when its last commit has a parent: known without
        // reading that parent.
        let next = match at {
            Some(_) => entries.last().map(|e| e.commit_id.clone()),
            None => None,
        };
        Ok((entries, next))
    }

    /// The history, newest first, at most `limit` entries.
    pub fn entries(&self, limit: usize) -> Result<Vec<HistoryEntry>, HistoryError> {
        Ok(self.page(limit, None)?.0)
    }

    /// The newest commit recorded as change `id` (or a commit id itself).
    fn find(&self, id: &str) -> Result<git2::Commit<'_>, HistoryError> {
        if id == INITIAL_ID
            && let Ok(reference) = self.repo.find_reference(INITIAL_REF)
        {
            return Ok(reference.peel_to_commit()?);
        }
        if id.len() == 40
            && let Ok(oid) = Oid::from_str(id)
            && let Ok(commit) = self.repo.find_commit(oid)
        {
            return Ok(commit);
        }
        let mut at = Some(self.head()?);
        while let Some(commit) = at {
            if id_of(&commit).as_deref() == Some(id) {
                return Ok(commit);
            }
            at = commit.parent(0).ok();
        }
        Err(HistoryError::UnknownId(id.to_owned()))
    }

    /// A unified diff per changed file between the states after changes `from` and `to`.
    pub fn diff(&self, from: &str, to: &str) -> Result<BTreeMap<String, String>, HistoryError> {
        let from = self.find(from)?.tree()?;
        let to = self.find(to)?.tree()?;
        let mut options = DiffOptions::new();
        options.context_lines(3);
        let diff = self
            .repo
            .diff_tree_to_tree(Some(&from), Some(&to), Some(&mut options))?;
        let mut out = BTreeMap::new();
        for index in 0..diff.deltas().len() {
            let Some(mut patch) = git2::Patch::from_diff(&diff, index)? else {
                continue;
            };
            let delta = patch.delta();
            let name = delta
                .new_file()
                .path_bytes()
                .or_else(|| delta.old_file().path_bytes())
                .map(decode_path)
                .unwrap_or_default();
            let text = patch.to_buf()?;
            out.insert(name, String::from_utf8_lossy(&text).into_owned());
        }
        Ok(out)
    }

    /// Restores the workspace to its state after change `target` — exactly: everything the
    /// recorded tree does not hold is removed — and records that as change `id`.
    pub fn rollback(&self, tree: &Tree, target: &str, id: &str) -> Result<Recorded, HistoryError> {
        let _turn = self.memory.write.lock().unwrap_or_else(|e| e.into_inner());
        let wanted = self.find(target)?.tree()?;
        self.restore(tree, tree.root(), &wanted, "")?;
        let (staged, left_out, bytes) = self.stage(tree)?;
        let commit_id = self.commit_tree(staged, &format!("rollback to {target}"), id)?;
        Ok(Recorded {
            commit_id: Some(commit_id),
            left_out,
            bytes,
        })
    }

    fn restore(
        &self,
        tree: &Tree,
        dir: &Dir,
        wanted: &git2::Tree<'_>,
        prefix: &str,
    ) -> Result<(), HistoryError> {
        let mut keep: HashMap<Vec<u8>, git2::TreeEntry<'_>> = HashMap::new();
        for entry in wanted.iter() {
            keep.insert(decode(entry.name_bytes()).to_vec(), entry);
        }
        // Everything not in the recorded tree goes, whatever it is.
        for name in dir.names(usize::MAX).map_err(|e| within(e, prefix))? {
            if !keep.contains_key(name.as_bytes()) {
                dir.remove(&name).map_err(|e| within(e, prefix))?;
            }
        }
        for (name, entry) in keep {
            let name = OsString::from_vec(name);
            let path = join(prefix, &name);
            let have = dir.entry(&name).map_err(|e| within(e, prefix))?;
            match entry.filemode() {
                0o040000 => {
                    if have.is_some_and(|m| m.kind != Kind::Dir) {
                        dir.remove(&name).map_err(|e| within(e, prefix))?;
                    }
                    let sub = dir.make_dir(&name).map_err(|e| within(e, prefix))?;
                    let subtree = self.repo.find_tree(entry.id())?;
                    self.restore(tree, &sub, &subtree, &path)?;
                }
                0o120000 => {
                    let target = self.repo.find_blob(entry.id())?;
                    if have.is_some() {
                        dir.remove(&name).map_err(|e| within(e, prefix))?;
                    }
                    dir.symlink(target.content(), &name)
                        .map_err(|e| within(e, prefix))?;
                }
                mode => {
                    if have.is_some_and(|m| m.kind != Kind::File) {
                        dir.remove(&name).map_err(|e| within(e, prefix))?;
                    }
                    // Streamed from a loose object; a packed one (libgit2 cannot stream
                    // those) is read whole, bounded by MAX_FILE_BYTES.
                    let odb = self.repo.odb()?;
                    let executable = mode == 0o100755;
                    let written = match odb.reader(entry.id()) {
                        Ok((mut reader, _, _)) => {
                            tree.write_in(dir, &name, &mut reader, executable)
                        }
                        Err(_) => {
                            let blob = self.repo.find_blob(entry.id())?;
                            tree.write_in(dir, &name, &mut blob.content(), executable)
                        }
                    };
                    written.map_err(|e| within(e, prefix))?;
                }
            }
        }
        Ok(())
    }

    /// Packs the repository's loose objects when there are many (each change adds a few;
    /// thousands of small files make every lookup slower). Call it off the request path.
    pub fn pack_if_due(&self) -> Result<bool, HistoryError> {
        self.pack(PACK_AFTER_LOOSE)
    }

    /// Packs the loose objects when there are at least `after_loose`, merging the smallest
    /// packs into the new one.
    ///
    /// Changes go on meanwhile: only the loose objects listed before the pack was written are
    /// removed (a change writing one of them again finds it in the pack), and readers fall
    /// back to re-reading the pack folder when a loose object is gone. Only one packer runs
    /// per repository; a second call while one runs returns at once.
    fn pack(&self, after_loose: usize) -> Result<bool, HistoryError> {
        if self.memory.packing.swap(true, Ordering::AcqRel) {
            return Ok(false);
        }
        let packed = self.pack_now(after_loose);
        self.memory.packing.store(false, Ordering::Release);
        packed
    }

    fn pack_now(&self, after_loose: usize) -> Result<bool, HistoryError> {
        // Plain paths are right here: `history.git` is the server's own folder, beside the
        // workspace and never granted to a guest (unlike the workspace, which only
        // `kiln_workspace` touches).
        let objects = self.repo.path().join("objects");
        let mut loose = Vec::new();
        // Loose objects live in objects/xx/ (two hex digits); the folders are kiln's own.
        for dir in std::fs::read_dir(&objects).map_err(git_io)?.flatten() {
            let name = dir.file_name();
            let name = name.to_string_lossy();
            if name.len() != 2 || !name.chars().all(|c| c.is_ascii_hexdigit()) {
                continue;
            }
            for file in std::fs::read_dir(dir.path()).map_err(git_io)?.flatten() {
                let rest = file.file_name().to_string_lossy().into_owned();
                if let Ok(oid) = Oid::from_str(&format!("{name}{rest}")) {
                    loose.push((oid, file.path()));
                }
            }
        }
        if loose.len() < after_loose.max(1) {
            return Ok(false);
        }
        // Geometric repacking (as `git repack --geometric=2`): the loose objects and the
        // smallest packs are merged until every pack left is at least twice the size of all
        // smaller ones together, so each object is rewritten O(log n) times over the
        // history's life, never the whole history on every pack.
        let pack_dir = objects.join("pack");
        let mut packs = existing_packs(&pack_dir);
        packs.sort_by_key(|p| p.oids.len());
        let mut merge = 0;
        'split: while merge <= packs.len() {
            let mut smaller =
                loose.len() + packs[..merge].iter().map(|p| p.oids.len()).sum::<usize>();
            for pack in &packs[merge..] {
                if pack.oids.len() < 2 * smaller {
                    merge += 1;
                    continue 'split;
                }
                smaller += pack.oids.len();
            }
            break;
        }
        let merged = &packs[..merge.min(packs.len())];
        let mut builder = self.repo.packbuilder()?;
        builder.set_threads(1);
        for (oid, _) in &loose {
            builder.insert_object(*oid, None)?;
        }
        for pack in merged {
            for oid in &pack.oids {
                builder.insert_object(*oid, None)?;
            }
        }
        builder.write(&pack_dir, 0o444)?;
        self.repo.odb()?.refresh()?;
        // Only what is in the new pack is removed; objects written meanwhile stay loose.
        for (_, path) in loose {
            let _ = std::fs::remove_file(path);
        }
        for pack in merged {
            for extension in ["pack", "idx", "rev", "keep"] {
                let _ = std::fs::remove_file(pack.base.with_extension(extension));
            }
        }
        Ok(true)
    }
}

/// Benchmarks only (`kiln bench --only history_scale`): long histories made in seconds.
impl History {
    /// Appends `changes` changes to this history, numbered from `first`, as a long-lived
    /// sandbox's history would hold them: change `n` is an upload of `f{n % 10}.txt` holding
    /// `n` (each commit as [`History::record`] writes it: the same tree layout, message and
    /// trailers), all but the newest `loose` written straight into packs of geometrically
    /// falling size, as [`History::pack_if_due`] leaves a history, and the newest `loose`
    /// as loose objects. Writing each change loose and packing as the server does would take
    /// minutes for 50 000 changes. Returns the new head's commit id.
    #[doc(hidden)]
    pub fn append_uploads_for_bench(
        &self,
        first: usize,
        changes: usize,
        loose: usize,
    ) -> Result<String, HistoryError> {
        let _turn = self.memory.write.lock().unwrap_or_else(|e| e.into_inner());
        // What is loose now goes into a pack first, as the server's packer would have done.
        self.pack(1)?;
        let mut head = self.head()?.id();
        let mut n = first;
        let end = first + changes;
        let packed_end = end.saturating_sub(loose).max(first);
        // A second handle on the repository whose writes go to memory, dumped as one pack
        // per chunk: two thirds of what is left each time, then the rest.
        let staging = Repository::open_bare(self.repo.path())?;
        let staging_odb = staging.odb()?;
        let mempack = staging_odb.add_new_mempack_backend(1000)?;
        while n < packed_end {
            let left = packed_end - n;
            let chunk = if left > 1500 { left * 2 / 3 } else { left };
            for _ in 0..chunk {
                head = append_upload(&staging, head, n, false)?;
                n += 1;
            }
            let mut pack = git2::Buf::new();
            mempack.dump(&staging, &mut pack)?;
            mempack.reset()?;
            let odb = self.repo.odb()?;
            let mut writer = odb.packwriter()?;
            std::io::Write::write_all(&mut writer, &pack).map_err(git_io)?;
            writer.commit()?;
            odb.refresh()?;
            self.repo.head()?.set_target(head, "bench")?;
        }
        while n < end {
            head = append_upload(&self.repo, head, n, true)?;
            n += 1;
        }
        Ok(head.to_string())
    }
}

/// Commits an upload of `f{n % 10}.txt` holding `n` on top of `parent` (moving `HEAD` to it
/// when `move_head`).
fn append_upload(
    repo: &Repository,
    parent: Oid,
    n: usize,
    move_head: bool,
) -> Result<Oid, HistoryError> {
    let parent = repo.find_commit(parent)?;
    let name = format!("f{}.txt", n % 10);
    let blob = repo.blob(n.to_string().as_bytes())?;
    let mut builder = repo.treebuilder(Some(&parent.tree()?))?;
    builder.insert(&name, blob, 0o100644)?;
    let tree = repo.find_tree(builder.write()?)?;
    let sig = signature()?;
    let id = format!("upload_{n:024x}");
    Ok(repo.commit(
        move_head.then_some("HEAD"),
        &sig,
        &sig,
        &message(&format!("upload {name}"), &id, &[name]),
        &tree,
        &[&parent],
    )?)
}

/// A pack of a repository: its path without extension and the objects its index lists.
struct PackFile {
    base: PathBuf,
    oids: Vec<Oid>,
}

/// The packs in `dir` whose index kiln can read (version 2, what libgit2 writes).
fn existing_packs(dir: &Path) -> Vec<PackFile> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".idx"))
        .filter_map(|e| {
            let bytes = std::fs::read(e.path()).ok()?;
            Some(PackFile {
                base: e.path().with_extension(""),
                oids: index_oids(&bytes)?,
            })
        })
        .collect()
}

/// The object ids a version-2 pack index lists: a 4-byte magic, a 4-byte version, 256
/// 4-byte fan-out counts (the last is the total), then the 20-byte ids in order.
fn index_oids(bytes: &[u8]) -> Option<Vec<Oid>> {
    if bytes.get(..8)? != b"\xfftOc\x00\x00\x00\x02" {
        return None;
    }
    let total = u32::from_be_bytes(bytes.get(8 + 255 * 4..8 + 256 * 4)?.try_into().ok()?);
    let start = 8 + 256 * 4;
    (0..total as usize)
        .map(|i| Oid::from_bytes(bytes.get(start + i * 20..start + (i + 1) * 20)?).ok())
        .collect()
}

/// Counts changes per repository; true every [`PACK_CHECK_EVERY`]th, when
/// [`History::pack_if_due`] is worth calling (it lists the loose objects).
pub fn pack_check_due(git_dir: &Path) -> bool {
    let count = memory(git_dir).changes.fetch_add(1, Ordering::Relaxed) + 1;
    count.is_multiple_of(PACK_CHECK_EVERY)
}

/// Copies the repository `from` (the server's own folder, never granted to a guest: plain
/// paths are right here) to the new folder `to`: objects hard-linked (else copied), the
/// rest copied; lock files and anything but files and folders are left behind.
fn copy_repository(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir(to)?;
    let mut stack = vec![(from.to_path_buf(), to.to_path_buf(), false)];
    while let Some((source, target, objects)) = stack.pop() {
        for entry in std::fs::read_dir(&source)? {
            let entry = entry?;
            let name = entry.file_name();
            let kind = entry.file_type()?;
            let (from_path, to_path) = (entry.path(), target.join(&name));
            if kind.is_dir() {
                std::fs::create_dir(&to_path)?;
                let objects = objects || (source == from && name == "objects");
                stack.push((from_path, to_path, objects));
            } else if kind.is_file()
                && !name.to_string_lossy().ends_with(".lock")
                && !(objects && std::fs::hard_link(&from_path, &to_path).is_ok())
            {
                std::fs::copy(&from_path, &to_path)?;
            }
        }
    }
    Ok(())
}

/// Changes between two looks at the loose objects.
const PACK_CHECK_EVERY: u32 = 32;
/// Loose objects that make a pack worthwhile.
const PACK_AFTER_LOOSE: usize = 512;

fn git_io(error: std::io::Error) -> HistoryError {
    HistoryError::Git(git2::Error::from_str(&format!("packing: {error}")))
}

/// Process-wide libgit2 settings, once.
fn setup_libgit2() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // Without this, every tree entry kiln inserts makes libgit2 open and inflate the
        // object's header to check it exists (~40 opens a commit for a 40-file workspace,
        // 11 ms of a 13 ms commit here). kiln inserts only objects it has just written or
        // found in this repository, which it never prunes.
        git2::opts::strict_object_creation(false);
    });
}

/// kiln's settings for a history repository, as lines of its `config`.
const CONFIG: &str = "\n[core]\n\t# Only a literal `.git` is then refused in trees (kiln stores it as `.git~`); the NTFS\n\t# rules (`git~1`, `.git.`) would refuse guest names that are fine on Linux.\n\tprotectNTFS = false\n[pack]\n\t# Workspace objects are small and packed often: a delta window of one object.\n\twindowMemory = 1\n";

/// Makes an empty bare repository at `git_dir` (which must not exist), as `git init --bare`
/// would, in one pass: its folders, `HEAD`, and a `config` with kiln's settings written once.
/// libgit2's own init wrote a description, a sample hook and an exclude file nothing reads,
/// rewrote `config` three times under a lock, probed the file system for symlinks, case
/// and file modes, and read the user's global git configuration: most of a sandbox create.
///
/// `git_dir` is the server's own folder beside the workspace, out of every guest's reach;
/// still, nothing here follows a link or reuses a file: each folder and file is created new
/// (`EEXIST` otherwise).
fn make_bare(git_dir: &Path) -> std::io::Result<()> {
    let create = |name: &str, text: &str| {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(git_dir.join(name))
            .and_then(|mut file| std::io::Write::write_all(&mut file, text.as_bytes()))
    };
    std::fs::create_dir(git_dir)?;
    for dir in [
        "objects",
        "objects/info",
        "objects/pack",
        "refs",
        "refs/heads",
        "refs/tags",
    ] {
        std::fs::create_dir(git_dir.join(dir))?;
    }
    create("HEAD", "ref: refs/heads/master\n")?;
    let config = format!(
        "[core]\n\tbare = true\n\trepositoryformatversion = 0\n\tfilemode = true\n{CONFIG}"
    );
    create("config", &config)
}

/// Adds kiln's settings to a repository's `config` (one append, before anything reads it:
/// two `Config::set_*` calls rewrote the file twice, 2 ms of a sandbox create).
fn configure(repo: &Repository) -> Result<(), git2::Error> {
    let path = repo.path().join("config");
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    if text.contains("protectNTFS") {
        return Ok(());
    }
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .map_err(|e| git2::Error::from_str(&format!("could not configure the history: {e}")))?;
    std::io::Write::write_all(&mut file, CONFIG.as_bytes())
        .map_err(|e| git2::Error::from_str(&format!("could not configure the history: {e}")))
}

/// Removes histories a crash left half-made in `dir` (a sandbox's folder): temporaries of
/// [`History::open_or_create`], never used by anything.
pub fn remove_pending(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') && name.ends_with(PENDING_SUFFIX) {
            let _ = kiln_workspace::remove_host_tree(&entry.path());
        }
    }
}

/// Makes a repository left by a crash usable again: removes stale lock files (`*.lock`; the
/// server owns the folder and nothing else writes it) and any index (kiln keeps none).
/// Call it at start-up, before anything uses the repository. Returns the files removed.
pub fn recover(git_dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    let mut stack = vec![git_dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let Ok(kind) = entry.file_type() else {
                continue;
            };
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if kind.is_dir() {
                // Objects hold no locks; the rest (refs, logs) is small.
                if dir == git_dir && name == "objects" {
                    continue;
                }
                stack.push(path);
            } else if name.ends_with(".lock") || (dir == git_dir && name == "index") {
                std::fs::remove_file(&path)?;
                removed.push(path);
            }
        }
    }
    if let Ok(repo) = Repository::open_bare(git_dir) {
        let _ = configure(&repo);
        if repo.find_reference(INITIAL_REF).is_err()
            && let Ok(head) = repo.head().and_then(|h| h.peel_to_commit())
        {
            let mut root = head;
            while let Ok(parent) = root.parent(0) {
                root = parent;
            }
            let _ = repo.reference(INITIAL_REF, root.id(), true, "the initial workspace");
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests;
