//! kiln's file quota, in front of WASI: the preview-1 functions that write or create files
//! are shadowed in the `Linker`; each checks the execution's budget and then calls the
//! wasmtime-wasi implementation. Over budget, the guest gets `ENOSPC`.
//!
//! The write budget counts bytes written and the growth of a file's apparent size: a write
//! that starts past a file's end also pays for the hole it leaves (so a 1-byte write at a
//! 1 GiB offset costs 1 GiB + 1 byte), and `fd_filestat_set_size` pays for the bytes it
//! adds. Shrinking a file is free and refunds nothing. Every refusal is `ENOSPC` (51), never
//! `EFBIG`, whatever the offset: the guest ran out of its disk budget, not past a size limit.

use std::sync::atomic::Ordering;

use wasmtime::{Caller, Linker};
use wasmtime_wasi::p1::wasi_snapshot_preview1 as p1;
use wiggle::{GuestMemory, GuestPtr};

use crate::guest::GuestState;

/// WASI errno values kiln answers with itself.
const ERRNO_BADF: i32 = 8;
const ERRNO_NOSPC: i32 = 51;

/// Refuses a write or a creation over the budget: `ENOSPC`, noted for the result.
fn refuse(state: &GuestState) -> i32 {
    state.memory.stats.fs_refused.store(true, Ordering::Relaxed);
    ERRNO_NOSPC
}
const OFLAGS_CREAT: i32 = 1;
const OFLAGS_TRUNC: i32 = 8;

/// Notes that the guest called a file operation that may change a file or folder (see
/// `Stats::fs_touched`): whatever it answers, the host then records the workspace.
fn touch(state: &GuestState) {
    state.memory.stats.fs_touched.store(true, Ordering::Relaxed);
}

/// Runs `body` with the guest's memory and WASI context, as the generated bindings do.
macro_rules! with_memory {
    ($caller:ident, |$mem:ident, $state:ident| $body:expr) => {{
        use p1::WasiSnapshotPreview1 as _;
        let Some(wasmtime::Extern::Memory(memory)) = $caller.get_export("memory") else {
            return Err(wasmtime::format_err!("the guest exports no memory"));
        };
        let fuel = wasmtime::AsContextMut::as_context_mut(&mut $caller).hostcall_fuel();
        let (bytes, $state) = memory.data_and_store_mut(&mut $caller);
        $state.wasi.set_hostcall_fuel(fuel);
        let mut $mem = GuestMemory::Unshared(bytes);
        $body
    }};
}

fn iovec_total(bytes: &[u8], iovs: i32, count: i32) -> Option<u64> {
    let base = usize::try_from(iovs).ok()?;
    let count = usize::try_from(count).ok()?;
    if count > 1024 {
        return None;
    }
    let mut total = 0u64;
    for i in 0..count {
        let at = base.checked_add(i * 8 + 4)?;
        let len = bytes.get(at..at + 4)?;
        total += u64::from(u32::from_le_bytes(len.try_into().ok()?));
    }
    Some(total)
}

fn read_u32(bytes: &[u8], at: i32) -> Option<u32> {
    let at = usize::try_from(at).ok()?;
    Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

fn raw<'a>(mem: &'a GuestMemory<'_>) -> &'a [u8] {
    match mem {
        GuestMemory::Unshared(bytes) => bytes,
        GuestMemory::Shared(_) => &[],
    }
}

fn is_stdio(fd: i32) -> bool {
    (0..=2).contains(&fd)
}

/// Whether `fd` is still the guest's stdout or stderr stream. A guest that closes fd 1 gets
/// it back from its next `path_open` (wasmtime-wasi reuses free numbers), so the number alone
/// does not say: a stream's rights are exactly `FD_WRITE`, a file's or a folder's are many
/// more. This costs stdio writes a descriptor-table lookup, no system call and no error
/// (asking a stream for its position would make an error, which captures a backtrace where
/// `RUST_BACKTRACE` is set and `RUST_LIB_BACKTRACE` is not: 50 µs a `print`).
async fn is_stdio_stream(state: &mut GuestState, mem: &mut GuestMemory<'_>, fd: i32) -> bool {
    use p1::WasiSnapshotPreview1 as _;
    if !is_stdio(fd) {
        return false;
    }
    match state.wasi.fd_fdstat_get(mem, fd.into()).await {
        Ok(stat) => stat.fs_rights_base == wasmtime_wasi::p1::types::Rights::FD_WRITE,
        Err(_) => false,
    }
}

/// What a write of `len` bytes costs the budget when it leaves a `hole` of bytes between the
/// file's end and where it starts: the bytes plus the hole. A write of nothing extends no file
/// (POSIX `pwrite` of zero bytes past the end leaves the size alone) and costs nothing.
fn write_charge(hole: u64, len: u64) -> u64 {
    if len == 0 {
        0
    } else {
        len.saturating_add(hole)
    }
}

/// The hole a write at `position` leaves in a file of `size` bytes.
fn hole(position: u64, size: u64) -> u64 {
    position.saturating_sub(size)
}

/// How far setting a file of `size` bytes to `new_size` grows it; shrinking is zero.
fn growth(size: u64, new_size: u64) -> u64 {
    new_size.saturating_sub(size)
}

/// The current size of the file at `fd`, from the WASI context; `None` when `fd` is no file
/// (or cannot be stat'ed), in which case the call the guest made fails in wasmtime-wasi too.
async fn file_size(state: &mut GuestState, mem: &mut GuestMemory<'_>, fd: i32) -> Option<u64> {
    use p1::WasiSnapshotPreview1 as _;
    state
        .wasi
        .fd_filestat_get(mem, fd.into())
        .await
        .ok()
        .map(|stat| stat.size)
}

/// The hole a write to `fd` at `at` (`None`: at the fd's own position, as `fd_write` does)
/// would leave past the file's end. Costs one filestat when the position is past zero, and
/// an fdstat only when a hole would otherwise be charged (an append-mode fd writes at the end
/// whatever its position or offset, as on Linux, and so leaves none).
async fn hole_before_write(
    state: &mut GuestState,
    mem: &mut GuestMemory<'_>,
    fd: i32,
    at: Option<u64>,
) -> u64 {
    use p1::WasiSnapshotPreview1 as _;
    let position = match at {
        Some(offset) => offset,
        // No position: not a seekable file, and wasmtime-wasi refuses the write.
        None => match state.wasi.fd_tell(mem, fd.into()) {
            Ok(position) => position,
            Err(_) => return 0,
        },
    };
    if position == 0 {
        return 0;
    }
    // A file whose size cannot be read is taken as empty: the safe side.
    let size = file_size(state, mem, fd).await.unwrap_or(0);
    let hole = hole(position, size);
    if hole == 0 {
        return 0;
    }
    let appending = state
        .wasi
        .fd_fdstat_get(mem, fd.into())
        .await
        .is_ok_and(|stat| {
            stat.fs_flags
                .contains(wasmtime_wasi::p1::types::Fdflags::APPEND)
        });
    if appending { 0 } else { hole }
}

/// wasmtime-wasi's `fd_write` (`at` is `None`) or `fd_pwrite` at `at`, unchecked.
async fn write_through(
    state: &mut GuestState,
    mem: &mut GuestMemory<'_>,
    (fd, iovs, count, nwritten): (i32, i32, i32, i32),
    at: Option<i64>,
) -> wasmtime::Result<i32> {
    match at {
        None => p1::fd_write(&mut state.wasi, mem, fd, iovs, count, nwritten).await,
        Some(offset) => {
            p1::fd_pwrite(&mut state.wasi, mem, fd, iovs, count, offset, nwritten).await
        }
    }
}

/// Writes the iovecs at `iovs` to `fd` at `at` (`None`: `fd_write`, at the fd's position),
/// refusing with `ENOSPC` what the budget cannot pay (bytes plus any hole) and charging what
/// was written. stdio streams are never charged and cost no system call.
async fn budgeted_write(
    state: &mut GuestState,
    mem: &mut GuestMemory<'_>,
    (fd, iovs, count, nwritten): (i32, i32, i32, i32),
    at: Option<i64>,
) -> wasmtime::Result<i32> {
    if is_stdio_stream(state, mem, fd).await {
        return write_through(state, mem, (fd, iovs, count, nwritten), at).await;
    }
    touch(state);
    // The whole iovec array, though wasmtime-wasi writes only the first non-empty buffer:
    // the safe side.
    let len = iovec_total(raw(mem), iovs, count).unwrap_or(0);
    // A negative offset reaches wasmtime-wasi as the u64 of the same bits, as here.
    let hole = hole_before_write(state, mem, fd, at.map(i64::cast_unsigned)).await;
    if write_charge(hole, len) > state.fs.write_bytes_left() {
        return Ok(refuse(state));
    }
    let errno = write_through(state, mem, (fd, iovs, count, nwritten), at).await?;
    if errno == 0 {
        let n = u64::from(read_u32(raw(mem), nwritten).unwrap_or(0));
        state.fs.spend_write_bytes(write_charge(hole, n));
        state
            .memory
            .stats
            .fs_written_bytes
            .fetch_add(n, Ordering::Relaxed);
    }
    Ok(errno)
}

pub(crate) fn shadow_writes(linker: &mut Linker<GuestState>) -> wasmtime::Result<()> {
    linker.func_wrap_async(
        "wasi_snapshot_preview1",
        "fd_write",
        |mut caller: Caller<'_, GuestState>, args: (i32, i32, i32, i32)| {
            Box::new(async move {
                with_memory!(caller, |mem, state| {
                    budgeted_write(state, &mut mem, args, None).await
                })
            })
        },
    )?;
    linker.func_wrap_async(
        "wasi_snapshot_preview1",
        "fd_pwrite",
        |mut caller: Caller<'_, GuestState>,
         (fd, iovs, count, offset, nwritten): (i32, i32, i32, i64, i32)| {
            Box::new(async move {
                with_memory!(caller, |mem, state| {
                    budgeted_write(state, &mut mem, (fd, iovs, count, nwritten), Some(offset)).await
                })
            })
        },
    )?;
    linker.func_wrap_async(
        "wasi_snapshot_preview1",
        "fd_filestat_set_size",
        |mut caller: Caller<'_, GuestState>, (fd, size): (i32, i64)| {
            Box::new(async move {
                with_memory!(caller, |mem, state| {
                    touch(state);
                    // Growing a file by truncation writes no bytes but pays for the ones it
                    // adds; shrinking is free. A negative size reaches wasmtime-wasi as a huge
                    // u64, and is refused here as such.
                    let current = file_size(state, &mut mem, fd).await.unwrap_or(0);
                    let growth = growth(current, size.cast_unsigned());
                    if growth > state.fs.write_bytes_left() {
                        return Ok(refuse(state));
                    }
                    let errno =
                        p1::fd_filestat_set_size(&mut state.wasi, &mut mem, fd, size).await?;
                    if errno == 0 {
                        state.fs.spend_write_bytes(growth);
                    }
                    Ok(errno)
                })
            })
        },
    )?;
    linker.func_wrap_async(
        "wasi_snapshot_preview1",
        "fd_renumber",
        |mut caller: Caller<'_, GuestState>, (from, to): (i32, i32)| {
            Box::new(async move {
                with_memory!(caller, |mem, state| {
                    // A file moved onto stdout would escape the quota's accounting.
                    if is_stdio(to) || is_stdio(from) {
                        return Ok(ERRNO_BADF);
                    }
                    p1::fd_renumber(&mut state.wasi, &mut mem, from, to).await
                })
            })
        },
    )?;
    Ok(())
}

pub(crate) fn shadow_creates(linker: &mut Linker<GuestState>) -> wasmtime::Result<()> {
    shadow_path_open(linker)?;
    shadow_create_directory(linker)?;
    shadow_symlink(linker)?;
    shadow_link(linker)?;
    shadow_removals(linker)
}

/// Removals, renames and `fd_allocate` change files without writing or creating any: they
/// only note that the turn touched files ([`touch`]).
fn shadow_removals(linker: &mut Linker<GuestState>) -> wasmtime::Result<()> {
    linker.func_wrap_async(
        "wasi_snapshot_preview1",
        "path_unlink_file",
        |mut caller: Caller<'_, GuestState>, (dirfd, path, path_len): (i32, i32, i32)| {
            Box::new(async move {
                with_memory!(caller, |mem, state| {
                    touch(state);
                    p1::path_unlink_file(&mut state.wasi, &mut mem, dirfd, path, path_len).await
                })
            })
        },
    )?;
    linker.func_wrap_async(
        "wasi_snapshot_preview1",
        "path_remove_directory",
        |mut caller: Caller<'_, GuestState>, (dirfd, path, path_len): (i32, i32, i32)| {
            Box::new(async move {
                with_memory!(caller, |mem, state| {
                    touch(state);
                    p1::path_remove_directory(&mut state.wasi, &mut mem, dirfd, path, path_len)
                        .await
                })
            })
        },
    )?;
    linker.func_wrap_async(
        "wasi_snapshot_preview1",
        "path_rename",
        |mut caller: Caller<'_, GuestState>,
         (old_fd, old, old_len, new_fd, new, new_len): (i32, i32, i32, i32, i32, i32)| {
            Box::new(async move {
                with_memory!(caller, |mem, state| {
                    touch(state);
                    p1::path_rename(
                        &mut state.wasi,
                        &mut mem,
                        old_fd,
                        old,
                        old_len,
                        new_fd,
                        new,
                        new_len,
                    )
                    .await
                })
            })
        },
    )?;
    linker.func_wrap_async(
        "wasi_snapshot_preview1",
        "fd_allocate",
        |mut caller: Caller<'_, GuestState>, (fd, offset, len): (i32, i64, i64)| {
            Box::new(async move {
                with_memory!(caller, |mem, state| {
                    touch(state);
                    p1::fd_allocate(&mut state.wasi, &mut mem, fd, offset, len)
                })
            })
        },
    )?;
    Ok(())
}

/// `path_open` with `O_CREAT` counts a file it creates. Past the quota it fails with `ENOSPC`.
fn shadow_path_open(linker: &mut Linker<GuestState>) -> wasmtime::Result<()> {
    linker.func_wrap_async(
        "wasi_snapshot_preview1",
        "path_open",
        |mut caller: Caller<'_, GuestState>,
         (dirfd, dirflags, path, path_len, oflags, base, inheriting, fdflags, opened): (
            i32,
            i32,
            i32,
            i32,
            i32,
            i64,
            i64,
            i32,
            i32,
        )| {
            Box::new(async move {
                with_memory!(caller, |mem, state| {
                    if oflags & (OFLAGS_CREAT | OFLAGS_TRUNC) != 0 {
                        touch(state);
                    }
                    if oflags & OFLAGS_CREAT != 0 {
                        let exists = path_exists(state, &mut mem, dirfd, path, path_len).await;
                        if !exists && !state.fs.take_create() {
                            return Ok(refuse(state));
                        }
                    }
                    p1::path_open(
                        &mut state.wasi,
                        &mut mem,
                        dirfd,
                        dirflags,
                        path,
                        path_len,
                        oflags,
                        base,
                        inheriting,
                        fdflags,
                        opened,
                    )
                    .await
                })
            })
        },
    )?;
    Ok(())
}

/// `path_create_directory` counts the folder. Past the quota it fails with `ENOSPC`.
fn shadow_create_directory(linker: &mut Linker<GuestState>) -> wasmtime::Result<()> {
    linker.func_wrap_async(
        "wasi_snapshot_preview1",
        "path_create_directory",
        |mut caller: Caller<'_, GuestState>, (dirfd, path, path_len): (i32, i32, i32)| {
            Box::new(async move {
                with_memory!(caller, |mem, state| {
                    touch(state);
                    if !state.fs.take_create() {
                        return Ok(refuse(state));
                    }
                    p1::path_create_directory(&mut state.wasi, &mut mem, dirfd, path, path_len)
                        .await
                })
            })
        },
    )?;
    Ok(())
}

/// `path_symlink` counts the link. Past the quota it fails with `ENOSPC`.
fn shadow_symlink(linker: &mut Linker<GuestState>) -> wasmtime::Result<()> {
    linker.func_wrap_async(
        "wasi_snapshot_preview1",
        "path_symlink",
        |mut caller: Caller<'_, GuestState>,
         (old, old_len, dirfd, new, new_len): (i32, i32, i32, i32, i32)| {
            Box::new(async move {
                with_memory!(caller, |mem, state| {
                    touch(state);
                    if !state.fs.take_create() {
                        return Ok(refuse(state));
                    }
                    p1::path_symlink(&mut state.wasi, &mut mem, old, old_len, dirfd, new, new_len)
                        .await
                })
            })
        },
    )?;
    Ok(())
}

/// `path_link` counts the hard link. Past the quota it fails with `ENOSPC`.
fn shadow_link(linker: &mut Linker<GuestState>) -> wasmtime::Result<()> {
    linker.func_wrap_async(
        "wasi_snapshot_preview1",
        "path_link",
        |mut caller: Caller<'_, GuestState>,
         (old_fd, flags, old, old_len, new_fd, new, new_len): (
            i32,
            i32,
            i32,
            i32,
            i32,
            i32,
            i32,
        )| {
            Box::new(async move {
                with_memory!(caller, |mem, state| {
                    touch(state);
                    if !state.fs.take_create() {
                        return Ok(refuse(state));
                    }
                    p1::path_link(
                        &mut state.wasi,
                        &mut mem,
                        old_fd,
                        flags,
                        old,
                        old_len,
                        new_fd,
                        new,
                        new_len,
                    )
                    .await
                })
            })
        },
    )?;
    Ok(())
}

async fn path_exists(
    state: &mut GuestState,
    mem: &mut GuestMemory<'_>,
    dirfd: i32,
    path: i32,
    path_len: i32,
) -> bool {
    use p1::WasiSnapshotPreview1 as _;
    let (Ok(dirfd), Ok(path), Ok(path_len)) = (
        u32::try_from(dirfd),
        u32::try_from(path),
        u32::try_from(path_len),
    ) else {
        return false;
    };
    state
        .wasi
        .path_filestat_get(
            mem,
            dirfd.into(),
            wasmtime_wasi::p1::types::Lookupflags::empty(),
            GuestPtr::new((path, path_len)),
        )
        .await
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iovec_total_sums_lengths_and_rejects_out_of_range() {
        let mut bytes = vec![0u8; 32];
        bytes[4..8].copy_from_slice(&5u32.to_le_bytes());
        bytes[12..16].copy_from_slice(&7u32.to_le_bytes());
        assert_eq!(iovec_total(&bytes, 0, 2), Some(12));
        assert_eq!(iovec_total(&bytes, 28, 2), None);
        assert_eq!(iovec_total(&bytes, -4, 1), None);
        assert_eq!(iovec_total(&bytes, 0, 5000), None);
    }

    #[test]
    fn writes_pay_for_the_hole_they_leave_and_truncation_for_its_growth() {
        // Appending at the end, overwriting inside: the bytes only.
        assert_eq!(write_charge(hole(100, 100), 10), 10);
        assert_eq!(write_charge(hole(40, 100), 10), 10);
        // One byte at 1 GiB in an empty file: the hole too.
        assert_eq!(write_charge(hole(1 << 30, 0), 1), (1 << 30) + 1);
        assert_eq!(write_charge(hole(150, 100), 10), 60);
        // Writing nothing extends nothing.
        assert_eq!(write_charge(hole(1 << 30, 0), 0), 0);
        // A negative offset seen as a u64 never wraps the charge.
        assert_eq!(write_charge(hole((-1i64).cast_unsigned(), 0), 5), u64::MAX);
        assert_eq!(growth(100, 1 << 30), (1 << 30) - 100);
        assert_eq!(growth(100, 100), 0);
        assert_eq!(growth(100, 0), 0);
    }
}
