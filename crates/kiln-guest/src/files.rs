//! File operations inside the box, as the agent (the box's root) sees the box. Paths are the
//! box's own: a symlink the box's code planted resolves inside the box, never on the host.
//! Reads and writes refuse anything but regular files (a planted fifo cannot stall them) and
//! open without blocking.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};

use crate::agent::send;
use crate::proto::{CHUNK_BYTES, Credentials, Entry, EntryKind, Failure, Op, Reply};

/// The most entries one [`Reply::Entries`] frame carries; a listing is sent in pieces.
const ENTRIES_PER_FRAME: usize = 512;

type Out = std::sync::Arc<std::sync::Mutex<Box<dyn Write + Send>>>;

/// Runs one file operation and answers it.
pub(crate) fn serve(out: &Out, id: u64, op: Op) {
    let result = match op {
        Op::ReadFile {
            path,
            offset,
            limit,
        } => read(out, id, &path, offset, limit),
        Op::WriteFile {
            path,
            data,
            append,
            mode,
            owner,
        } => write(&path, &data, append, mode, owner),
        Op::List { path } => list(out, id, &path),
        Op::Stat { path } => std::fs::symlink_metadata(&path)
            .map_err(|e| Failure::io(&path, &e))
            .map(|meta| {
                let name = path.rsplit('/').next().unwrap_or_default().to_string();
                send(
                    out,
                    id,
                    Reply::Entry {
                        entry: entry(name, &meta, &path),
                    },
                );
            }),
        Op::MakeDir {
            path,
            parents,
            owner,
        } => make_dir(&path, parents, owner),
        Op::Remove { path } => remove(&path),
        Op::Rename { from, to } => {
            std::fs::rename(&from, &to).map_err(|e| Failure::io(&format!("{from} → {to}"), &e))
        }
        other => Err(Failure::new(
            "invalid",
            format!("not a file operation: {other:?}"),
        )),
    };
    send(
        out,
        id,
        match result {
            Ok(()) => Reply::Done,
            Err(failure) => Reply::Failed(failure),
        },
    );
}

fn open_regular(path: &str, options: &mut OpenOptions) -> Result<File, Failure> {
    let file = options
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| Failure::io(path, &e))?;
    let meta = file.metadata().map_err(|e| Failure::io(path, &e))?;
    if meta.is_dir() {
        return Err(Failure::new(
            "is_a_directory",
            format!("{path} is a directory"),
        ));
    }
    if !meta.is_file() {
        return Err(Failure::new(
            "invalid",
            format!("{path} is not a regular file"),
        ));
    }
    Ok(file)
}

fn read(out: &Out, id: u64, path: &str, offset: u64, limit: u64) -> Result<(), Failure> {
    let mut file = open_regular(path, OpenOptions::new().read(true))?;
    file.seek(SeekFrom::Start(offset))
        .map_err(|e| Failure::io(path, &e))?;
    let mut left = limit;
    let mut buf = vec![0u8; CHUNK_BYTES];
    while left > 0 {
        let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        let n = file
            .read(&mut buf[..want])
            .map_err(|e| Failure::io(path, &e))?;
        if n == 0 {
            break;
        }
        send(
            out,
            id,
            Reply::Data {
                data: buf[..n].to_vec(),
            },
        );
        left -= n as u64;
    }
    Ok(())
}

fn chown(path: &str, owner: Option<Credentials>) -> Result<(), Failure> {
    if let Some(owner) = owner {
        std::os::unix::fs::lchown(path, Some(owner.uid), Some(owner.gid))
            .map_err(|e| Failure::io(path, &e))?;
    }
    Ok(())
}

fn write(
    path: &str,
    data: &[u8],
    append: bool,
    mode: u32,
    owner: Option<Credentials>,
) -> Result<(), Failure> {
    let mut options = OpenOptions::new();
    options
        .write(true)
        .create(true)
        .append(append)
        .mode(mode & 0o7777);
    let mut file = open_regular(path, &mut options)?;
    if !append {
        file.set_len(0).map_err(|e| Failure::io(path, &e))?;
    }
    file.write_all(data).map_err(|e| Failure::io(path, &e))?;
    if let Some(owner) = owner {
        std::os::unix::fs::fchown(&file, Some(owner.uid), Some(owner.gid))
            .map_err(|e| Failure::io(path, &e))?;
    }
    Ok(())
}

fn make_dir(path: &str, parents: bool, owner: Option<Credentials>) -> Result<(), Failure> {
    if parents {
        // Each directory made is given to `owner`, not only the last.
        let mut made = String::new();
        for part in path.split('/').filter(|p| !p.is_empty()) {
            made.push('/');
            made.push_str(part);
            match std::fs::create_dir(&made) {
                Ok(()) => chown(&made, owner)?,
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(Failure::io(&made, &e)),
            }
        }
        if !std::path::Path::new(path).is_dir() {
            return Err(Failure::new(
                "not_a_directory",
                format!("{path} exists and is not a directory"),
            ));
        }
        Ok(())
    } else {
        std::fs::create_dir(path).map_err(|e| Failure::io(path, &e))?;
        chown(path, owner)
    }
}

fn remove(path: &str) -> Result<(), Failure> {
    let meta = std::fs::symlink_metadata(path).map_err(|e| Failure::io(path, &e))?;
    // remove_dir_all never follows a symlink inside the tree.
    if meta.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    }
    .map_err(|e| Failure::io(path, &e))
}

fn list(out: &Out, id: u64, path: &str) -> Result<(), Failure> {
    let dir = std::fs::read_dir(path).map_err(|e| Failure::io(path, &e))?;
    let mut entries = Vec::new();
    for item in dir {
        let item = item.map_err(|e| Failure::io(path, &e))?;
        let name = item.file_name().to_string_lossy().into_owned();
        let full = format!("{}/{name}", path.trim_end_matches('/'));
        // An entry removed while listing is skipped.
        if let Ok(meta) = std::fs::symlink_metadata(&full) {
            entries.push(entry(name, &meta, &full));
        }
        if entries.len() == ENTRIES_PER_FRAME {
            send(
                out,
                id,
                Reply::Entries {
                    entries: std::mem::take(&mut entries),
                },
            );
        }
    }
    if !entries.is_empty() {
        send(out, id, Reply::Entries { entries });
    }
    Ok(())
}

fn entry(name: String, meta: &std::fs::Metadata, path: &str) -> Entry {
    let kind = if meta.is_symlink() {
        EntryKind::Symlink
    } else if meta.is_dir() {
        EntryKind::Dir
    } else if meta.is_file() {
        EntryKind::File
    } else {
        EntryKind::Other
    };
    Entry {
        name,
        kind,
        size: meta.len(),
        mode: meta.permissions().mode() & 0o7777,
        uid: meta.uid(),
        gid: meta.gid(),
        modified: meta.mtime(),
        target: (kind == EntryKind::Symlink)
            .then(|| std::fs::read_link(path).ok())
            .flatten()
            .map(|t| t.to_string_lossy().into_owned()),
    }
}
