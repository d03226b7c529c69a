//! The agent's channel in a Firecracker VM: a vsock listener (Firecracker has no virtio
//! serial port). The host connects through Firecracker's Unix socket (`CONNECT PORT`), and
//! the agent serves one connection at a time: a snapshot's clone resets its connections,
//! and its host connects anew.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// The vsock port the agent listens on.
pub const AGENT_PORT: u32 = 1024;

/// Listens on vsock `port` (any CID) and serves each connection in turn, for ever.
pub fn serve(port: u32) -> io::Result<()> {
    let listener = listen(port)?;
    let connections = std::iter::from_fn(|| {
        loop {
            match accept(&listener) {
                Ok(stream) => return Some(stream),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    eprintln!("kiln-guest: vsock accept: {e}");
                    std::thread::sleep(std::time::Duration::from_millis(100));
                }
            }
        }
    })
    .filter_map(|stream| {
        let write = stream.try_clone().ok()?;
        let channel: crate::agent::Channel = (Box::new(stream), Box::new(write));
        Some(channel)
    });
    crate::agent::serve_each(connections).map_err(|e| io::Error::other(e.to_string()))
}

fn listen(port: u32) -> io::Result<OwnedFd> {
    // SAFETY: socket(2) takes integers only; a non-negative result is a new descriptor that
    // nothing else owns.
    let fd = unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by socket(2) and is owned by no one else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_vm is plain data: all-zero bytes are a valid value.
    let mut address: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
    address.svm_family = libc::AF_VSOCK as libc::sa_family_t;
    address.svm_port = port;
    address.svm_cid = libc::VMADDR_CID_ANY;
    // SAFETY: `address` is a live, initialised sockaddr_vm and the length given is its size;
    // bind(2) only reads it.
    let rc = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&raw const address).cast(),
            std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: listen(2) on a descriptor this function owns; integers only.
    if unsafe { libc::listen(fd.as_raw_fd(), 4) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

fn accept(listener: &OwnedFd) -> io::Result<std::fs::File> {
    // SAFETY: accept4(2) with null address pointers (the peer's address is not wanted) on a
    // listening descriptor that outlives the call.
    let fd = unsafe {
        libc::accept4(
            listener.as_raw_fd(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            libc::SOCK_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor from accept4, owned by no one else.
    Ok(unsafe { std::fs::File::from_raw_fd(fd) })
}
