//! Copying one guest-writable tree into another (a forked sandbox's workspace) under the
//! same rules as everything else here: the source is read one name at a time through
//! directory handles, links are copied as links (their target text, never followed or
//! resolved), only regular files are opened, and every file is streamed, never read whole
//! into memory. A hard link becomes an independent file; fifos, sockets and devices, files
//! over a size (a huge sparse file) and entries past a count are left out and reported.

use std::ffi::{OsStr, OsString};
use std::io::Read;
use std::rc::Rc;

use crate::{Dir, Kind, Tree, TreeError, show};

/// What [`copy_tree`] copies at most.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyBounds {
    /// Files larger than this (their apparent size) are left out as `too_large`.
    pub max_file_bytes: u64,
    /// Entries (files, folders, links) copied at most; the rest are left out as `too_many`.
    pub max_entries: usize,
    /// Bytes of file content copied at most; files past it are left out as `over_total`.
    pub max_total_bytes: u64,
}

/// One entry a copy left out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeftOut {
    /// Its path, relative to the tree.
    pub path: String,
    /// `too_large`, `special` (a fifo, socket or device), `too_many` or `over_total`.
    pub reason: &'static str,
}

/// What a copy did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Copied {
    /// Entries copied (files, folders, links).
    pub entries: usize,
    /// Bytes of file content copied.
    pub bytes: u64,
    /// What was left out (at most 100 named).
    pub left_out: Vec<LeftOut>,
    /// Whether a file was left out because of [`CopyBounds::max_total_bytes`].
    pub over_total: bool,
}

impl Copied {
    fn leave_out(&mut self, path: String, reason: &'static str) {
        self.over_total |= reason == "over_total";
        if self.left_out.len() < 100 {
            self.left_out.push(LeftOut { path, reason });
        }
    }
}

/// A folder still to copy: its parents' handles in both trees, and its name.
struct Pending {
    source: Rc<Dir>,
    target: Rc<Dir>,
    name: OsString,
    path: String,
}

/// Copies everything in `from` into `to` (an empty tree opened with a scratch folder),
/// within `bounds`. Files are written as [`Tree::write_in`] writes them (through the scratch
/// folder, the execute bit kept), and made durable together at the end (one `syncfs` of
/// `to`'s file system, rather than two fsyncs a file); a folder swapped for a link during the
/// copy is not entered. The open handles are one pair per folder level, however wide the
/// tree.
pub fn copy_tree(from: &Tree, to: &Tree, bounds: &CopyBounds) -> Result<Copied, TreeError> {
    let open = |dir: &Dir| {
        dir.try_clone()
            .map_err(|e| crate::io_error("open", OsStr::new("the workspace"), e))
    };
    let mut copied = Copied::default();
    let mut stack = Vec::new();
    copy_folder(
        to,
        &Rc::new(open(from.root())?),
        &Rc::new(open(to.root())?),
        "",
        bounds,
        &mut copied,
        &mut stack,
    )?;
    while let Some(folder) = stack.pop() {
        let source = match folder.source.open_dir(&folder.name) {
            Ok(source) => source,
            // Swapped for a link or removed meanwhile: never entered.
            Err(TreeError::Link { .. } | TreeError::NotDir { .. } | TreeError::NotFound { .. }) => {
                continue;
            }
            Err(e) => return Err(e.within(parent_of(&folder.path))),
        };
        let target = folder
            .target
            .make_dir(&folder.name)
            .map_err(|e| e.within(parent_of(&folder.path)))?;
        copy_folder(
            to,
            &Rc::new(source),
            &Rc::new(target),
            &folder.path,
            bounds,
            &mut copied,
            &mut stack,
        )?;
    }
    rustix::fs::syncfs(&to.root().fd)
        .map_err(|e| crate::errno_error("sync", OsStr::new("the workspace"), e))?;
    Ok(copied)
}

fn parent_of(path: &str) -> &str {
    path.rsplit_once('/').map_or("", |(parent, _)| parent)
}

/// Copies the files and links of one folder; its sub-folders go on `stack`.
fn copy_folder(
    to: &Tree,
    source: &Rc<Dir>,
    target: &Rc<Dir>,
    prefix: &str,
    bounds: &CopyBounds,
    copied: &mut Copied,
    stack: &mut Vec<Pending>,
) -> Result<(), TreeError> {
    let within = |e: TreeError| e.within(prefix);
    let names = source
        .names(bounds.max_entries.saturating_add(1))
        .map_err(within)?;
    for name in names {
        let path = if prefix.is_empty() {
            show(&name)
        } else {
            format!("{prefix}/{}", show(&name))
        };
        if copied.entries >= bounds.max_entries {
            copied.leave_out(path, "too_many");
            continue;
        }
        let Some(meta) = source.entry(&name).map_err(within)? else {
            continue;
        };
        match meta.kind {
            Kind::File if meta.size > bounds.max_file_bytes => {
                copied.leave_out(path, "too_large");
                continue;
            }
            Kind::File if copied.bytes.saturating_add(meta.size) > bounds.max_total_bytes => {
                copied.leave_out(path, "over_total");
                continue;
            }
            Kind::File => {
                let (file, meta) = source.open_file(&name).map_err(within)?;
                // At most the size it had when opened: a file growing meanwhile is cut there.
                to.write_in_as(
                    target,
                    &name,
                    &mut file.take(meta.size),
                    meta.executable(),
                    false,
                )
                .map_err(within)?;
                copied.bytes = copied.bytes.saturating_add(meta.size);
            }
            Kind::Symlink => {
                let link = source.read_link(&name).map_err(within)?;
                target.symlink(&link, &name).map_err(within)?;
            }
            Kind::Dir => stack.push(Pending {
                source: source.clone(),
                target: target.clone(),
                name,
                path,
            }),
            _ => {
                copied.leave_out(path, "special");
                continue;
            }
        }
        copied.entries += 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    //! Attack tests: whatever a guest planted in the source, the copy never reads or writes
    //! outside the two trees, never follows a link, never hangs on a fifo, and never lets
    //! the copy and the original share a file.

    use std::os::unix::fs::{PermissionsExt, symlink};
    use std::path::Path;

    use super::*;

    struct Trees {
        dir: tempfile::TempDir,
        from: Tree,
        to: Tree,
    }

    fn trees() -> Trees {
        let dir = tempfile::tempdir().unwrap();
        for name in ["from", "to", "outside"] {
            std::fs::create_dir(dir.path().join(name)).unwrap();
        }
        std::fs::write(dir.path().join("outside/secret"), "secret").unwrap();
        let from = Tree::open(&dir.path().join("from"), None).unwrap();
        let to = Tree::open(&dir.path().join("to"), Some(&dir.path().join(".tmp"))).unwrap();
        Trees { dir, from, to }
    }

    const ROOMY: CopyBounds = CopyBounds {
        max_file_bytes: 1 << 20,
        max_entries: 1000,
        max_total_bytes: 1 << 30,
    };

    fn read(path: &Path) -> String {
        std::fs::read_to_string(path).unwrap()
    }

    #[test]
    fn files_folders_links_and_modes_are_copied() {
        let t = trees();
        let from = t.dir.path().join("from");
        std::fs::create_dir_all(from.join("a/b")).unwrap();
        std::fs::write(from.join("a/b/deep.txt"), "deep").unwrap();
        std::fs::write(from.join("run.sh"), "#!/bin/sh").unwrap();
        std::fs::set_permissions(from.join("run.sh"), PermissionsExt::from_mode(0o755)).unwrap();
        std::fs::create_dir_all(from.join("proj/.git")).unwrap();
        std::fs::write(from.join("proj/.git/HEAD"), "ref: refs/heads/main").unwrap();
        symlink("a/b/deep.txt", from.join("rel")).unwrap();
        std::fs::create_dir(from.join("empty")).unwrap();
        let copied = copy_tree(&t.from, &t.to, &ROOMY).unwrap();
        let to = t.dir.path().join("to");
        assert_eq!(read(&to.join("a/b/deep.txt")), "deep");
        assert_eq!(read(&to.join("proj/.git/HEAD")), "ref: refs/heads/main");
        let mode = std::fs::metadata(to.join("run.sh"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o111, 0o111, "the execute bit is kept");
        assert_eq!(
            std::fs::read_link(to.join("rel")).unwrap(),
            Path::new("a/b/deep.txt")
        );
        assert!(to.join("empty").is_dir());
        assert_eq!((copied.entries, copied.bytes), (9, 4 + 9 + 20));
        assert_eq!(copied.left_out, []);
    }

    #[test]
    fn attack_links_are_copied_as_links_and_never_followed() {
        let t = trees();
        let from = t.dir.path().join("from");
        let outside = t.dir.path().join("outside");
        symlink(&outside, from.join("dir-link")).unwrap();
        symlink(outside.join("secret"), from.join("file-link")).unwrap();
        symlink("../../../../etc/passwd", from.join("escape")).unwrap();
        copy_tree(&t.from, &t.to, &ROOMY).unwrap();
        let to = t.dir.path().join("to");
        assert_eq!(std::fs::read_link(to.join("dir-link")).unwrap(), outside);
        assert_eq!(
            std::fs::read_link(to.join("escape")).unwrap(),
            Path::new("../../../../etc/passwd")
        );
        assert!(
            std::fs::symlink_metadata(to.join("file-link"))
                .unwrap()
                .file_type()
                .is_symlink()
        );
        assert_eq!(read(&outside.join("secret")), "secret");
        let names: Vec<_> = std::fs::read_dir(&outside).unwrap().collect();
        assert_eq!(names.len(), 1, "nothing was written outside");
    }

    #[test]
    fn attack_a_hard_link_becomes_a_file_of_its_own() {
        let t = trees();
        let from = t.dir.path().join("from");
        std::fs::write(from.join("one"), "shared").unwrap();
        std::fs::hard_link(from.join("one"), from.join("two")).unwrap();
        copy_tree(&t.from, &t.to, &ROOMY).unwrap();
        let to = t.dir.path().join("to");
        std::fs::write(to.join("two"), "changed in the copy").unwrap();
        assert_eq!(read(&from.join("one")), "shared");
        assert_eq!(read(&to.join("one")), "shared");
    }

    #[test]
    fn attack_fifos_huge_sparse_files_and_floods_are_left_out() {
        let t = trees();
        let from = t.dir.path().join("from");
        let fifo = std::ffi::CString::new(from.join("pipe").to_str().unwrap()).unwrap();
        // SAFETY: mkfifo on a path string we own; no memory is shared.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);
        let sparse = std::fs::File::create(from.join("sparse")).unwrap();
        sparse.set_len(1 << 40).unwrap();
        std::fs::write(from.join("small"), "x").unwrap();
        let copied = copy_tree(&t.from, &t.to, &ROOMY).unwrap();
        let mut left: Vec<_> = copied
            .left_out
            .iter()
            .map(|l| (l.path.as_str(), l.reason))
            .collect();
        left.sort();
        assert_eq!(left, [("pipe", "special"), ("sparse", "too_large")]);
        let to = t.dir.path().join("to");
        assert!(!to.join("pipe").exists() && !to.join("sparse").exists());
        assert_eq!(read(&to.join("small")), "x");

        // Entries past the count are left out; one folder listing more is refused, as
        // the history refuses it (its names are never all held in memory).
        let t = trees();
        let from = t.dir.path().join("from");
        for folder in ["d1", "d2"] {
            std::fs::create_dir(from.join(folder)).unwrap();
            for i in 0..2 {
                std::fs::write(from.join(format!("{folder}/f{i}")), "12345").unwrap();
            }
        }
        let few = CopyBounds {
            max_entries: 4,
            ..ROOMY
        };
        let copied = copy_tree(&t.from, &t.to, &few).unwrap();
        assert_eq!(copied.entries, 4);
        assert_eq!(copied.left_out.len(), 2);
        assert!(copied.left_out.iter().all(|l| l.reason == "too_many"));
        let crowded = CopyBounds {
            max_entries: 2,
            ..ROOMY
        };
        for extra in ["d1/f2", "d1/f3"] {
            std::fs::write(from.join(extra), "12345").unwrap();
        }
        let refused = copy_tree(&t.from, &trees().to, &crowded).unwrap_err();
        assert!(
            matches!(refused, TreeError::TooManyEntries { limit: 3 }),
            "{refused:?}"
        );
        let t = trees();
        let from = t.dir.path().join("from");
        for i in 0..5 {
            std::fs::write(from.join(format!("f{i}")), "12345").unwrap();
        }
        let small = CopyBounds {
            max_total_bytes: 12,
            ..ROOMY
        };
        let copied = copy_tree(&t.from, &t.to, &small).unwrap();
        assert_eq!((copied.bytes, copied.over_total), (10, true));
    }

    #[test]
    fn a_wide_and_deep_tree_is_copied_whole() {
        let t = trees();
        let from = t.dir.path().join("from");
        let mut deep = from.clone();
        for _ in 0..200 {
            deep = deep.join("d");
        }
        std::fs::create_dir_all(&deep).unwrap();
        std::fs::write(deep.join("bottom"), "b").unwrap();
        for i in 0..300 {
            std::fs::create_dir(from.join(format!("w{i}"))).unwrap();
        }
        let copied = copy_tree(&t.from, &t.to, &ROOMY).unwrap();
        assert_eq!(copied.entries, 200 + 1 + 300);
        let mut copy = t.dir.path().join("to");
        for _ in 0..200 {
            copy = copy.join("d");
        }
        assert_eq!(read(&copy.join("bottom")), "b");
    }
}
