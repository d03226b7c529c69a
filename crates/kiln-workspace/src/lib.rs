//! Host-side access to trees that guest code can write: sandbox workspaces, `kiln rest`
//! tenant folders, runner script volumes.
//!
//! Guest code may plant symbolic links, hard links, fifos, devices, nested `.git` folders and
//! names that collide with the host's temporary files, and swap them while the host works. So
//! nothing here resolves a path string from the root with ordinary path lookup: every
//! operation starts at a directory handle ([`Dir`]) and goes one name at a time with
//! `O_NOFOLLOW`, or in one `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` call where the
//! kernel has it. A link anywhere on the way is an error ([`TreeError::Link`]), never
//! followed. Only regular files are read; a fifo or device is refused before it is opened.
//!
//! Files are written to a temporary in a scratch folder the guest cannot reach (on the same
//! file system), created with `O_EXCL | O_NOFOLLOW` under an unpredictable name, then renamed
//! into place with `renameat` relative to the parent's handle: a planted name can neither
//! redirect the write nor see it half done, and a hard link to the old file keeps the old
//! bytes.
//!
//! [`copy::copy_tree`] copies one such tree into another under the same rules.
//!
//! ```no_run
//! use kiln_workspace::{RelPath, Tree};
//! let tree = Tree::open(
//!     "/data/sandboxes/sb_1/workspace".as_ref(),
//!     Some("/data/sandboxes/sb_1/.tmp".as_ref()),
//! )?;
//! tree.write(&RelPath::parse("out/result.txt")?, &mut &b"hello"[..])?;
//! # Ok::<(), kiln_workspace::TreeError>(())
//! ```

pub mod copy;
pub mod store;

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::Path;
use std::sync::atomic::{AtomicU8, Ordering};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

/// The longest workspace-relative path, in bytes.
pub const MAX_PATH_BYTES: usize = 4096;
/// The longest single name, in bytes.
pub const MAX_NAME_BYTES: usize = 255;

/// What went wrong with a path in a guest-writable tree. Messages name paths relative to the
/// tree, never a host path.
#[derive(Debug, thiserror::Error)]
pub enum TreeError {
    /// The name breaks the rules of [`RelPath::parse`].
    #[error("the file name {path:?} is not allowed: {why}")]
    InvalidName { path: String, why: &'static str },
    /// A symbolic link on the way or at the end; links are never followed.
    #[error("{path} is a symbolic link; kiln does not follow links in a workspace")]
    Link { path: String },
    /// Not a regular file (a fifo, socket or device).
    #[error("{path} is a {kind}, not a regular file; kiln reads only regular files")]
    NotRegular { path: String, kind: &'static str },
    #[error("no file {path:?} in the workspace")]
    NotFound { path: String },
    #[error("{path} is a folder")]
    IsDir { path: String },
    #[error("{path} is not a folder")]
    NotDir { path: String },
    /// The disk (or the data folder's quota) is full.
    #[error("no space left on the server's disk while writing {path}")]
    NoSpace { path: String },
    /// The entry changed while it was being opened (a race with something else writing).
    #[error("{path} changed while it was being opened; retry")]
    Changed { path: String },
    /// The tree has more entries than a walk may visit.
    #[error("the workspace has more than {limit} entries")]
    TooManyEntries { limit: usize },
    #[error("could not {op} {path}: {source}")]
    Io {
        op: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl TreeError {
    /// The path the error is about, relative to the tree.
    pub fn path(&self) -> Option<&str> {
        match self {
            TreeError::TooManyEntries { .. } => None,
            TreeError::InvalidName { path, .. }
            | TreeError::Link { path }
            | TreeError::NotRegular { path, .. }
            | TreeError::NotFound { path }
            | TreeError::IsDir { path }
            | TreeError::NotDir { path }
            | TreeError::NoSpace { path }
            | TreeError::Changed { path }
            | TreeError::Io { path, .. } => Some(path),
        }
    }

    /// Whether the disk was full.
    pub fn is_no_space(&self) -> bool {
        matches!(self, TreeError::NoSpace { .. })
    }

    /// The same error with `prefix/` put before its path (errors of a [`Dir`] name only the
    /// entry; the caller knows where the folder is).
    pub fn within(mut self, prefix: &str) -> TreeError {
        let joined = match self.path() {
            Some(path) if !prefix.is_empty() => format!("{prefix}/{path}"),
            _ => return self,
        };
        match &mut self {
            TreeError::TooManyEntries { .. } => {}
            TreeError::InvalidName { path, .. }
            | TreeError::Link { path }
            | TreeError::NotRegular { path, .. }
            | TreeError::NotFound { path }
            | TreeError::IsDir { path }
            | TreeError::NotDir { path }
            | TreeError::NoSpace { path }
            | TreeError::Changed { path }
            | TreeError::Io { path, .. } => *path = joined,
        }
        self
    }
}

fn show(name: &OsStr) -> String {
    name.to_string_lossy().into_owned()
}

fn errno_error(op: &'static str, name: &OsStr, errno: Errno) -> TreeError {
    let path = show(name);
    match errno {
        Errno::NOSPC | Errno::DQUOT => TreeError::NoSpace { path },
        Errno::NOENT => TreeError::NotFound { path },
        Errno::LOOP => TreeError::Link { path },
        Errno::ISDIR => TreeError::IsDir { path },
        Errno::NOTDIR => TreeError::NotDir { path },
        _ => TreeError::Io {
            op,
            path,
            source: errno.into(),
        },
    }
}

fn io_error(op: &'static str, name: &OsStr, error: std::io::Error) -> TreeError {
    match error.raw_os_error() {
        Some(code) => errno_error(op, name, Errno::from_raw_os_error(code)),
        None => TreeError::Io {
            op,
            path: show(name),
            source: error,
        },
    }
}

/// A checked workspace-relative path: relative, `/`-separated, no `.` or `..` parts, no
/// empty parts, no NUL, at most [`MAX_NAME_BYTES`] a part and [`MAX_PATH_BYTES`] in all. The
/// empty path is the tree itself ([`RelPath::root`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelPath(String);

impl RelPath {
    /// Checks `name`.
    pub fn parse(name: &str) -> Result<RelPath, TreeError> {
        let bad = |why| {
            Err(TreeError::InvalidName {
                path: name.to_owned(),
                why,
            })
        };
        if name.is_empty() || name.len() > MAX_PATH_BYTES {
            return bad("it must be 1 to 4096 bytes");
        }
        if name.contains('\0') {
            return bad("it contains a NUL byte");
        }
        if name.starts_with('/') {
            return bad("it must be relative");
        }
        for part in name.split('/') {
            match part {
                "" => return bad("it has an empty part (`//` or a trailing `/`)"),
                "." => return bad("it contains `.`"),
                ".." => return bad("it contains `..`"),
                _ if part.len() > MAX_NAME_BYTES => return bad("a part is longer than 255 bytes"),
                _ => {}
            }
        }
        Ok(RelPath(name.to_owned()))
    }

    /// The tree itself.
    pub fn root() -> RelPath {
        RelPath(String::new())
    }

    /// Whether this is the tree itself.
    pub fn is_root(&self) -> bool {
        self.0.is_empty()
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Its names, in order.
    pub fn parts(&self) -> impl Iterator<Item = &str> {
        self.0.split('/').filter(|p| !p.is_empty())
    }

    /// Its folder and last name; `None` for the root.
    pub fn split_last(&self) -> Option<(RelPath, &str)> {
        if self.is_root() {
            return None;
        }
        Some(match self.0.rsplit_once('/') {
            Some((parent, leaf)) => (RelPath(parent.to_owned()), leaf),
            None => (RelPath::root(), self.0.as_str()),
        })
    }
}

impl std::fmt::Display for RelPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// What an entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    Dir,
    Symlink,
    Fifo,
    Socket,
    CharDevice,
    BlockDevice,
    Unknown,
}

impl Kind {
    fn of(mode: u32) -> Kind {
        match FileType::from_raw_mode(mode) {
            FileType::RegularFile => Kind::File,
            FileType::Directory => Kind::Dir,
            FileType::Symlink => Kind::Symlink,
            FileType::Fifo => Kind::Fifo,
            FileType::Socket => Kind::Socket,
            FileType::CharacterDevice => Kind::CharDevice,
            FileType::BlockDevice => Kind::BlockDevice,
            FileType::Unknown => Kind::Unknown,
        }
    }

    /// A word for messages.
    pub fn name(self) -> &'static str {
        match self {
            Kind::File => "file",
            Kind::Dir => "folder",
            Kind::Symlink => "symbolic link",
            Kind::Fifo => "fifo",
            Kind::Socket => "socket",
            Kind::CharDevice => "character device",
            Kind::BlockDevice => "block device",
            Kind::Unknown => "special file",
        }
    }
}

/// An entry's metadata, as `lstat` sees it (links are described, not followed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Meta {
    pub kind: Kind,
    /// Apparent size in bytes.
    pub size: u64,
    /// Permission bits.
    pub mode: u32,
    pub dev: u64,
    pub ino: u64,
    pub nlink: u64,
    /// Modification time, nanoseconds since the Unix epoch.
    pub mtime_ns: i64,
    /// Status-change time, nanoseconds since the Unix epoch (guest code cannot set it).
    pub ctime_ns: i64,
    /// Access time, nanoseconds since the Unix epoch.
    pub atime_ns: i64,
    /// Owner and group on the host.
    pub uid: u32,
    pub gid: u32,
}

impl Meta {
    fn of(stat: &rustix::fs::Stat) -> Meta {
        let ns = |secs: i64, nanos: i64| secs.saturating_mul(1_000_000_000).saturating_add(nanos);
        Meta {
            kind: Kind::of(stat.st_mode),
            size: u64::try_from(stat.st_size).unwrap_or(0),
            mode: stat.st_mode & 0o7777,
            dev: stat.st_dev,
            ino: stat.st_ino,
            nlink: stat.st_nlink,
            #[expect(clippy::unnecessary_cast, reason = "field widths differ by target")]
            mtime_ns: ns(stat.st_mtime as i64, stat.st_mtime_nsec as i64),
            #[expect(clippy::unnecessary_cast, reason = "field widths differ by target")]
            ctime_ns: ns(stat.st_ctime as i64, stat.st_ctime_nsec as i64),
            #[expect(clippy::unnecessary_cast, reason = "field widths differ by target")]
            atime_ns: ns(stat.st_atime as i64, stat.st_atime_nsec as i64),
            uid: stat.st_uid,
            gid: stat.st_gid,
        }
    }

    /// Whether any execute bit is set.
    pub fn executable(&self) -> bool {
        self.mode & 0o111 != 0
    }
}

fn check_name(name: &OsStr) -> Result<(), TreeError> {
    let bytes = name.as_bytes();
    let why = if bytes.is_empty() {
        "it is empty"
    } else if bytes == b"." || bytes == b".." {
        "it is `.` or `..`"
    } else if bytes.contains(&b'/') {
        "it contains `/`"
    } else if bytes.contains(&0) {
        "it contains a NUL byte"
    } else if bytes.len() > MAX_NAME_BYTES {
        "it is longer than 255 bytes"
    } else {
        return Ok(());
    };
    Err(TreeError::InvalidName {
        path: show(name),
        why,
    })
}

const DIR_FLAGS: OFlags = OFlags::RDONLY
    .union(OFlags::DIRECTORY)
    .union(OFlags::NOFOLLOW)
    .union(OFlags::CLOEXEC);

/// An open folder of a guest-writable tree. Every method takes one name (no `/`) and never
/// follows a link at it.
#[derive(Debug)]
pub struct Dir {
    fd: OwnedFd,
    /// Who files and folders the host makes here are given to (the tree's root's owner,
    /// where that is not kiln's own user: a Linux box's user).
    owner: Option<(u32, u32)>,
}

impl Dir {
    /// The folder's handle as a `File` of its own (a duplicate), for calls on the folder
    /// itself (its mode).
    pub fn as_file(&self) -> std::io::Result<File> {
        Ok(File::from(self.fd.try_clone()?))
    }

    /// Opens a host-owned folder (its path is trusted up to its last name, which must not be a
    /// link).
    pub fn open_host(path: &Path) -> std::io::Result<Dir> {
        let fd = rustix::fs::open(path, DIR_FLAGS, Mode::empty())?;
        Ok(Dir { fd, owner: None })
    }

    /// A second handle on the same folder.
    pub fn try_clone(&self) -> std::io::Result<Dir> {
        Ok(Dir {
            fd: self.fd.try_clone()?,
            owner: self.owner,
        })
    }

    /// Gives what the host made (through the handle `fd`) to this tree's owner, if it has one.
    fn give(&self, fd: &impl AsFd, name: &OsStr) -> Result<(), TreeError> {
        let Some((uid, gid)) = self.owner else {
            return Ok(());
        };
        let (uid, gid) = (
            rustix::fs::Uid::from_raw(uid),
            rustix::fs::Gid::from_raw(gid),
        );
        rustix::fs::fchown(fd, Some(uid), Some(gid)).map_err(|e| errno_error("give", name, e))
    }

    /// This folder's own metadata.
    pub fn meta(&self) -> Result<Meta, TreeError> {
        rustix::fs::fstat(&self.fd)
            .map(|s| Meta::of(&s))
            .map_err(|e| errno_error("read", OsStr::new("."), e))
    }

    /// The entry `name`, or `None` when there is none.
    pub fn entry(&self, name: &OsStr) -> Result<Option<Meta>, TreeError> {
        check_name(name)?;
        match rustix::fs::statat(&self.fd, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(stat) => Ok(Some(Meta::of(&stat))),
            Err(Errno::NOENT) => Ok(None),
            Err(e) => Err(errno_error("inspect", name, e)),
        }
    }

    /// The names in this folder (not `.` and `..`), unsorted; at most `limit`.
    pub fn names(&self, limit: usize) -> Result<Vec<OsString>, TreeError> {
        let read = rustix::fs::Dir::read_from(&self.fd)
            .map_err(|e| errno_error("list", OsStr::new("."), e))?;
        let mut names = Vec::new();
        for entry in read {
            let entry = entry.map_err(|e| errno_error("list", OsStr::new("."), e))?;
            let name = entry.file_name().to_bytes();
            if name == b"." || name == b".." {
                continue;
            }
            if names.len() >= limit {
                return Err(TreeError::TooManyEntries { limit });
            }
            names.push(OsString::from_vec(name.to_vec()));
        }
        Ok(names)
    }

    /// Opens the sub-folder `name`.
    pub fn open_dir(&self, name: &OsStr) -> Result<Dir, TreeError> {
        check_name(name)?;
        match rustix::fs::openat(&self.fd, name, DIR_FLAGS, Mode::empty()) {
            Ok(fd) => Ok(Dir {
                fd,
                owner: self.owner,
            }),
            Err(Errno::NOTDIR | Errno::LOOP) => match self.entry(name)? {
                Some(meta) if meta.kind == Kind::Symlink => {
                    Err(TreeError::Link { path: show(name) })
                }
                Some(meta) if meta.kind == Kind::Dir => {
                    Err(TreeError::Changed { path: show(name) })
                }
                Some(_) => Err(TreeError::NotDir { path: show(name) }),
                None => Err(TreeError::NotFound { path: show(name) }),
            },
            Err(e) => Err(errno_error("open", name, e)),
        }
    }

    /// Opens the sub-folder `name`, making it first if there is none.
    pub fn make_dir(&self, name: &OsStr) -> Result<Dir, TreeError> {
        check_name(name)?;
        let made = match rustix::fs::mkdirat(&self.fd, name, Mode::from_raw_mode(0o755)) {
            Ok(()) => true,
            Err(Errno::EXIST) => false,
            Err(e) => return Err(errno_error("make the folder", name, e)),
        };
        let dir = self.open_dir(name)?;
        if made {
            // Through the opened handle: whatever the name points at now, only this
            // folder (checked a folder, never a link) changes hands.
            self.give(&dir.fd, name)?;
        }
        Ok(dir)
    }

    /// Opens the regular file `name` for reading. Links, fifos and devices are refused before
    /// anything opens them.
    pub fn open_file(&self, name: &OsStr) -> Result<(File, Meta), TreeError> {
        let Some(before) = self.entry(name)? else {
            return Err(TreeError::NotFound { path: show(name) });
        };
        match before.kind {
            Kind::File => {}
            Kind::Dir => return Err(TreeError::IsDir { path: show(name) }),
            Kind::Symlink => return Err(TreeError::Link { path: show(name) }),
            other => {
                return Err(TreeError::NotRegular {
                    path: show(name),
                    kind: other.name(),
                });
            }
        }
        // O_NONBLOCK: should a fifo be swapped in after the check, opening it does not hang.
        let flags =
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC;
        let fd = rustix::fs::openat(&self.fd, name, flags, Mode::empty())
            .map_err(|e| errno_error("open", name, e))?;
        let after = rustix::fs::fstat(&fd)
            .map(|s| Meta::of(&s))
            .map_err(|e| errno_error("open", name, e))?;
        if after.kind != Kind::File || after.ino != before.ino || after.dev != before.dev {
            return Err(TreeError::Changed { path: show(name) });
        }
        let file = File::from(fd);
        Ok((file, after))
    }

    /// The target of the symbolic link `name`, as bytes.
    pub fn read_link(&self, name: &OsStr) -> Result<Vec<u8>, TreeError> {
        check_name(name)?;
        match rustix::fs::readlinkat(&self.fd, name, Vec::new()) {
            Ok(target) => Ok(target.into_bytes()),
            // No longer a link: it was swapped meanwhile.
            Err(Errno::INVAL) => Err(TreeError::Changed { path: show(name) }),
            Err(e) => Err(errno_error("read the link", name, e)),
        }
    }

    /// Makes a symbolic link `name` pointing at `target` (the target is stored, never
    /// resolved by kiln).
    pub fn symlink(&self, target: &[u8], name: &OsStr) -> Result<(), TreeError> {
        check_name(name)?;
        rustix::fs::symlinkat(OsStr::from_bytes(target), &self.fd, name)
            .map_err(|e| errno_error("make the link", name, e))?;
        if let Some((uid, gid)) = self.owner {
            let (uid, gid) = (
                rustix::fs::Uid::from_raw(uid),
                rustix::fs::Gid::from_raw(gid),
            );
            // The link itself (SYMLINK_NOFOLLOW), never what it points at.
            rustix::fs::chownat(
                &self.fd,
                name,
                Some(uid),
                Some(gid),
                AtFlags::SYMLINK_NOFOLLOW,
            )
            .map_err(|e| errno_error("give", name, e))?;
        }
        Ok(())
    }

    /// Removes `name`: a file or link is unlinked (a link's target is untouched), a folder is
    /// removed with everything in it, never following a link. `Ok(None)` when there was none.
    pub fn remove(&self, name: &OsStr) -> Result<Option<Kind>, TreeError> {
        let Some(meta) = self.entry(name)? else {
            return Ok(None);
        };
        if meta.kind == Kind::Dir {
            let inner = self.open_dir(name)?;
            inner.clear().map_err(|e| e.within(&show(name)))?;
            rustix::fs::unlinkat(&self.fd, name, AtFlags::REMOVEDIR)
                .map_err(|e| errno_error("remove", name, e))?;
        } else {
            rustix::fs::unlinkat(&self.fd, name, AtFlags::empty())
                .map_err(|e| errno_error("remove", name, e))?;
        }
        Ok(Some(meta.kind))
    }

    /// Removes everything in this folder.
    pub fn clear(&self) -> Result<(), TreeError> {
        for name in self.names(usize::MAX)? {
            self.remove(&name)?;
        }
        Ok(())
    }

    /// Makes this folder's entries durable.
    pub fn sync(&self) -> Result<(), TreeError> {
        rustix::fs::fsync(&self.fd).map_err(|e| errno_error("sync", OsStr::new("."), e))
    }
}

/// Removes the host-owned folder `path` and everything in it, guest-written parts included,
/// never following a link (the folder's own path is trusted). Missing is fine.
pub fn remove_host_tree(path: &Path) -> std::io::Result<()> {
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(std::io::Error::other("a folder to remove needs a parent"));
    };
    let parent = Dir::open_host(parent)?;
    match parent.remove(name) {
        Ok(_) => Ok(()),
        Err(TreeError::Io { source, .. }) => Err(source),
        Err(e) => Err(std::io::Error::other(e.to_string())),
    }
}

/// Whether `openat2` with `RESOLVE_BENEATH` works here: 0 not known yet, 1 yes, 2 no (an old
/// kernel, or a seccomp filter that refuses it).
static OPENAT2: AtomicU8 = AtomicU8::new(0);

/// How [`Tree`] resolves a path to a folder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolver {
    /// `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` where the kernel has it, else a walk.
    Auto,
    /// One `openat(O_NOFOLLOW | O_DIRECTORY)` per name.
    Walk,
}

/// A guest-writable tree with an optional scratch folder for writes.
#[derive(Debug)]
pub struct Tree {
    root: Dir,
    scratch: Option<Dir>,
    resolver: Resolver,
}

/// Who the host's new entries in a tree rooted at `root` go to: the root's owner, where kiln
/// runs as root and the root belongs to someone else (a Linux box's user), so what the host
/// writes there the box may change in place. Otherwise nobody: they stay kiln's.
fn owner_of(root: &Dir) -> Option<(u32, u32)> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return None;
    }
    let stat = rustix::fs::fstat(&root.fd).ok()?;
    (stat.st_uid != 0).then_some((stat.st_uid, stat.st_gid))
}

/// Random hex from the kernel.
fn random_name() -> String {
    let mut bytes = [0u8; 12];
    let mut filled = 0;
    while filled < bytes.len() {
        match rustix::rand::getrandom(&mut bytes[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => filled += n,
            Err(Errno::INTR) => {}
            Err(_) => {
                // getrandom(2) exists on every kernel kiln supports; this is a last resort.
                let nanos = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos());
                bytes[..8].copy_from_slice(&(nanos as u64).to_le_bytes());
                break;
            }
        }
    }
    let mut out = String::from("kiln-");
    for byte in bytes {
        out.push_str(&format!("{byte:02x}"));
    }
    out
}

impl Tree {
    /// Opens the tree at `root` (a host-owned path; only its contents are guest-writable).
    /// `scratch` is where writes are staged: a host-owned folder on the same file system that
    /// no guest can reach; it is made if missing. Without one, the tree is read-only.
    pub fn open(root: &Path, scratch: Option<&Path>) -> Result<Tree, TreeError> {
        let mut root =
            Dir::open_host(root).map_err(|e| io_error("open", OsStr::new("the workspace"), e))?;
        root.owner = owner_of(&root);
        let scratch = match scratch {
            Some(path) => {
                std::fs::create_dir_all(path)
                    .map_err(|e| io_error("make", OsStr::new("the scratch folder"), e))?;
                Some(
                    Dir::open_host(path)
                        .map_err(|e| io_error("open", OsStr::new("the scratch folder"), e))?,
                )
            }
            None => None,
        };
        Ok(Tree {
            root,
            scratch,
            resolver: Resolver::Auto,
        })
    }

    /// The same tree, resolving with `resolver` (tests use it to cover both ways).
    pub fn with_resolver(mut self, resolver: Resolver) -> Tree {
        self.resolver = resolver;
        self
    }

    /// The tree's own folder.
    pub fn root(&self) -> &Dir {
        &self.root
    }

    /// Opens the folder at `rel`.
    pub fn dir(&self, rel: &RelPath) -> Result<Dir, TreeError> {
        if rel.is_root() {
            return self
                .root
                .try_clone()
                .map_err(|e| io_error("open", OsStr::new("the workspace"), e));
        }
        if self.resolver == Resolver::Auto && OPENAT2.load(Ordering::Relaxed) != 2 {
            let how =
                ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
            match rustix::fs::openat2(&self.root.fd, rel.as_str(), DIR_FLAGS, Mode::empty(), how) {
                Ok(fd) => {
                    OPENAT2.store(1, Ordering::Relaxed);
                    return Ok(Dir {
                        fd,
                        owner: self.root.owner,
                    });
                }
                Err(Errno::NOSYS | Errno::PERM) => OPENAT2.store(2, Ordering::Relaxed),
                Err(Errno::INVAL) if OPENAT2.load(Ordering::Relaxed) == 0 => {
                    OPENAT2.store(2, Ordering::Relaxed);
                }
                // Anything else: the walk below says exactly which name is wrong.
                Err(_) => {}
            }
        }
        self.walk_to(rel, false)
    }

    fn walk_to(&self, rel: &RelPath, create: bool) -> Result<Dir, TreeError> {
        let mut at = self
            .root
            .try_clone()
            .map_err(|e| io_error("open", OsStr::new("the workspace"), e))?;
        let mut done = String::new();
        for part in rel.parts() {
            let name = OsStr::new(part);
            let next = if create {
                at.make_dir(name)
            } else {
                at.open_dir(name)
            };
            at = next.map_err(|e| e.within(&done))?;
            if !done.is_empty() {
                done.push('/');
            }
            done.push_str(part);
        }
        Ok(at)
    }

    /// Opens the folder at `rel`, making every missing folder on the way.
    pub fn make_dirs(&self, rel: &RelPath) -> Result<Dir, TreeError> {
        self.walk_to(rel, true)
    }

    /// The entry at `rel` (never following a link), or `None`.
    pub fn stat(&self, rel: &RelPath) -> Result<Option<Meta>, TreeError> {
        let Some((parent, leaf)) = rel.split_last() else {
            return self.root.meta().map(Some);
        };
        let dir = match self.dir(&parent) {
            Ok(dir) => dir,
            Err(TreeError::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        dir.entry(OsStr::new(leaf))
            .map_err(|e| e.within(parent.as_str()))
    }

    /// Opens the regular file at `rel` for reading.
    pub fn open_file(&self, rel: &RelPath) -> Result<(File, Meta), TreeError> {
        let Some((parent, leaf)) = rel.split_last() else {
            return Err(TreeError::IsDir {
                path: String::new(),
            });
        };
        let dir = self.dir(&parent)?;
        dir.open_file(OsStr::new(leaf))
            .map_err(|e| e.within(parent.as_str()))
    }

    /// Writes `data` to `rel` atomically and durably, making folders as needed. A folder or a
    /// link already at `rel` is refused. Returns the bytes written.
    pub fn write(&self, rel: &RelPath, data: &mut dyn Read) -> Result<u64, TreeError> {
        let Some((parent, leaf)) = rel.split_last() else {
            return Err(TreeError::IsDir {
                path: String::new(),
            });
        };
        let dir = self.make_dirs(&parent)?;
        self.write_in(&dir, OsStr::new(leaf), data, false)
            .map_err(|e| e.within(parent.as_str()))
    }

    /// Writes `data` as the file `name` of `dir` (a folder of this tree): to a fresh
    /// temporary in the scratch folder, fsynced, renamed into place, the folder fsynced.
    pub fn write_in(
        &self,
        dir: &Dir,
        name: &OsStr,
        data: &mut dyn Read,
        executable: bool,
    ) -> Result<u64, TreeError> {
        self.write_in_as(dir, name, data, executable, true)
    }

    /// [`Tree::write_in`]; without `durable`, nothing is fsynced (a caller that writes many
    /// files syncs the file system once at the end: see [`copy::copy_tree`]).
    fn write_in_as(
        &self,
        dir: &Dir,
        name: &OsStr,
        data: &mut dyn Read,
        executable: bool,
        durable: bool,
    ) -> Result<u64, TreeError> {
        check_name(name)?;
        let Some(scratch) = &self.scratch else {
            return Err(TreeError::Io {
                op: "write",
                path: show(name),
                source: std::io::Error::other("this tree was opened read-only"),
            });
        };
        match dir.entry(name)? {
            Some(meta) if meta.kind == Kind::Dir => {
                return Err(TreeError::IsDir { path: show(name) });
            }
            Some(meta) if meta.kind == Kind::Symlink => {
                return Err(TreeError::Link { path: show(name) });
            }
            _ => {}
        }
        let temp = random_name();
        let mode = Mode::from_raw_mode(if executable { 0o755 } else { 0o644 });
        let flags =
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let fd = rustix::fs::openat(&scratch.fd, temp.as_str(), flags, mode)
            .map_err(|e| errno_error("write", name, e))?;
        let written = (|| {
            dir.give(&fd, name)?;
            let mut file = File::from(fd);
            let n = std::io::copy(data, &mut file).map_err(|e| io_error("write", name, e))?;
            file.flush().map_err(|e| io_error("write", name, e))?;
            if durable {
                file.sync_all().map_err(|e| io_error("write", name, e))?;
            }
            rustix::fs::renameat(&scratch.fd, temp.as_str(), &dir.fd, name)
                .map_err(|e| errno_error("write", name, e))?;
            Ok(n)
        })();
        match written {
            Ok(n) => {
                if durable {
                    dir.sync()?;
                }
                Ok(n)
            }
            Err(e) => {
                let _ = rustix::fs::unlinkat(&scratch.fd, temp.as_str(), AtFlags::empty());
                Err(e)
            }
        }
    }

    /// Renames the entry at `from` to `to` (folders to `to` made as needed), replacing a
    /// file at `to`; neither final name is followed if it is a link. Both folders are
    /// fsynced.
    pub fn rename(&self, from: &RelPath, to: &RelPath) -> Result<(), TreeError> {
        let root = || TreeError::InvalidName {
            path: String::new(),
            why: "the workspace itself cannot be moved or replaced",
        };
        let (from_parent, from_leaf) = from.split_last().ok_or_else(root)?;
        let (to_parent, to_leaf) = to.split_last().ok_or_else(root)?;
        if to.as_str().starts_with(&format!("{}/", from.as_str())) {
            return Err(TreeError::InvalidName {
                path: to.to_string(),
                why: "a folder cannot be moved into itself",
            });
        }
        let source = self.dir(&from_parent)?;
        if source.entry(OsStr::new(from_leaf))?.is_none() {
            return Err(TreeError::NotFound {
                path: from.to_string(),
            });
        }
        let target = self.make_dirs(&to_parent)?;
        rustix::fs::renameat(&source.fd, from_leaf, &target.fd, to_leaf).map_err(|e| {
            errno_error("rename", OsStr::new(from_leaf), e).within(from_parent.as_str())
        })?;
        source.sync()?;
        target.sync()
    }

    /// Where the link at `rel` points.
    pub fn read_link(&self, rel: &RelPath) -> Result<Vec<u8>, TreeError> {
        let Some((parent, leaf)) = rel.split_last() else {
            return Err(TreeError::NotFound {
                path: String::new(),
            });
        };
        self.dir(&parent)?
            .read_link(OsStr::new(leaf))
            .map_err(|e| e.within(parent.as_str()))
    }

    /// Removes the entry at `rel` (a folder with everything in it); returns what it was.
    pub fn remove(&self, rel: &RelPath) -> Result<Kind, TreeError> {
        let Some((parent, leaf)) = rel.split_last() else {
            return Err(TreeError::InvalidName {
                path: String::new(),
                why: "the workspace itself cannot be removed",
            });
        };
        let dir = self.dir(&parent)?;
        let removed = dir
            .remove(OsStr::new(leaf))
            .map_err(|e| e.within(parent.as_str()))?;
        dir.sync()?;
        removed.ok_or_else(|| TreeError::NotFound {
            path: rel.to_string(),
        })
    }

    /// Visits every entry under the folder `rel` (depth first, links and special files
    /// described but never entered or opened), at most `limit` entries; returns whether the
    /// walk stopped at the limit. Paths given to `visit` are relative to the tree.
    pub fn walk(
        &self,
        rel: &RelPath,
        limit: usize,
        visit: &mut dyn FnMut(&str, &Meta),
    ) -> Result<bool, TreeError> {
        let start = self.dir(rel)?;
        let mut stack = vec![(start, rel.as_str().to_owned())];
        let mut seen = 0usize;
        while let Some((dir, prefix)) = stack.pop() {
            let names = match dir.names(limit.saturating_sub(seen).saturating_add(1)) {
                Ok(names) => names,
                Err(TreeError::TooManyEntries { .. }) => return Ok(true),
                Err(e) => return Err(e.within(&prefix)),
            };
            for name in names {
                if seen >= limit {
                    return Ok(true);
                }
                let Some(meta) = dir.entry(&name).map_err(|e| e.within(&prefix))? else {
                    continue;
                };
                let path = if prefix.is_empty() {
                    show(&name)
                } else {
                    format!("{prefix}/{}", show(&name))
                };
                seen += 1;
                visit(&path, &meta);
                if meta.kind == Kind::Dir {
                    match dir.open_dir(&name) {
                        Ok(sub) => stack.push((sub, path)),
                        // Swapped for a link meanwhile: described, never entered.
                        Err(
                            TreeError::Link { .. }
                            | TreeError::NotDir { .. }
                            | TreeError::NotFound { .. },
                        ) => {}
                        Err(e) => return Err(e.within(&prefix)),
                    }
                }
            }
        }
        Ok(false)
    }

    /// Removes everything in the scratch folder (temporaries a crash left behind).
    pub fn sweep_scratch(&self) -> Result<(), TreeError> {
        match &self.scratch {
            Some(scratch) => scratch.clear(),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests;
