//! kiln's file quota, in front of WASI: the preview-1 functions that write or create files
//! are shadowed in the `Linker`; each checks the execution's budget and then calls the
//! wasmtime-wasi implementation. Over budget, the guest gets `ENOSPC`.

use std::sync::atomic::Ordering;

use wasmtime::{Caller, Linker};
use wasmtime_wasi::p1::wasi_snapshot_preview1 as p1;
use wiggle::{GuestMemory, GuestPtr};

use crate::guest::GuestState;

/// WASI errno values kiln answers with itself.
const ERRNO_BADF: i32 = 8;
const ERRNO_NOSPC: i32 = 51;
const OFLAGS_CREAT: i32 = 1;

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

/// Whether a write of the iovecs at `iovs` would go over the file budget.
fn over_budget(state: &GuestState, mem: &GuestMemory<'_>, iovs: i32, count: i32) -> bool {
    iovec_total(raw(mem), iovs, count).unwrap_or(0) > state.fs.write_bytes_left()
}

/// Charges a successful write (its byte count is at `nwritten`) to the budget and the stats.
fn charge_write(state: &GuestState, mem: &GuestMemory<'_>, nwritten: i32) {
    let n = u64::from(read_u32(raw(mem), nwritten).unwrap_or(0));
    state.fs.spend_write_bytes(n);
    state
        .memory
        .stats
        .fs_written_bytes
        .fetch_add(n, Ordering::Relaxed);
}

pub(crate) fn shadow_writes(linker: &mut Linker<GuestState>) -> wasmtime::Result<()> {
    linker.func_wrap_async(
        "wasi_snapshot_preview1",
        "fd_write",
        |mut caller: Caller<'_, GuestState>, (fd, iovs, count, nwritten): (i32, i32, i32, i32)| {
            Box::new(async move {
                with_memory!(caller, |mem, state| {
                    if !is_stdio(fd) && over_budget(state, &mem, iovs, count) {
                        return Ok(ERRNO_NOSPC);
                    }
                    let errno =
                        p1::fd_write(&mut state.wasi, &mut mem, fd, iovs, count, nwritten).await?;
                    if errno == 0 && !is_stdio(fd) {
                        charge_write(state, &mem, nwritten);
                    }
                    Ok(errno)
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
                    if over_budget(state, &mem, iovs, count) {
                        return Ok(ERRNO_NOSPC);
                    }
                    let errno =
                        p1::fd_pwrite(&mut state.wasi, &mut mem, fd, iovs, count, offset, nwritten)
                            .await?;
                    if errno == 0 {
                        charge_write(state, &mem, nwritten);
                    }
                    Ok(errno)
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
                    // Growing a file by truncation costs no bytes written but may cost disk:
                    // a size beyond what is left to write is refused.
                    if u64::try_from(size).unwrap_or(u64::MAX) > state.fs.write_bytes_left() {
                        return Ok(ERRNO_NOSPC);
                    }
                    p1::fd_filestat_set_size(&mut state.wasi, &mut mem, fd, size).await
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
                    if oflags & OFLAGS_CREAT != 0 {
                        let exists = path_exists(state, &mut mem, dirfd, path, path_len).await;
                        if !exists && !state.fs.take_create() {
                            return Ok(ERRNO_NOSPC);
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
    linker.func_wrap_async(
        "wasi_snapshot_preview1",
        "path_create_directory",
        |mut caller: Caller<'_, GuestState>, (dirfd, path, path_len): (i32, i32, i32)| {
            Box::new(async move {
                with_memory!(caller, |mem, state| {
                    if !state.fs.take_create() {
                        return Ok(ERRNO_NOSPC);
                    }
                    p1::path_create_directory(&mut state.wasi, &mut mem, dirfd, path, path_len)
                        .await
                })
            })
        },
    )?;
    linker.func_wrap_async(
        "wasi_snapshot_preview1",
        "path_symlink",
        |mut caller: Caller<'_, GuestState>,
         (old, old_len, dirfd, new, new_len): (i32, i32, i32, i32, i32)| {
            Box::new(async move {
                with_memory!(caller, |mem, state| {
                    if !state.fs.take_create() {
                        return Ok(ERRNO_NOSPC);
                    }
                    p1::path_symlink(&mut state.wasi, &mut mem, old, old_len, dirfd, new, new_len)
                        .await
                })
            })
        },
    )?;
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
                    if !state.fs.take_create() {
                        return Ok(ERRNO_NOSPC);
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
}
