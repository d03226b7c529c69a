//! The channel between kiln (the host) and the guest agent: length-prefixed JSON frames
//! (a `u32` little-endian length, then that many bytes of JSON) over one byte stream, the
//! agent's stdin and stdout inside a box (a vsock stream inside a microVM, later).
//!
//! The host sends [`Request`]s; the agent answers with [`Response`]s carrying the request's
//! `id`. A spawned process's output and exit, and a port connection's data, come back as
//! further responses with the `id` of the request that started them, until a final
//! [`Reply::Exited`] or [`Reply::Closed`].

use std::io::{Read, Write};

use serde::{Deserialize, Serialize};

/// The largest frame either side accepts: 16 MiB. Output and file data travel in chunks of
/// at most [`CHUNK_BYTES`].
pub const MAX_FRAME_BYTES: u32 = 16 << 20;

/// The largest piece of output, stdin or file data in one frame.
pub const CHUNK_BYTES: usize = 64 << 10;

/// The version of this protocol; the agent says it in its [`Reply::Hello`].
pub const PROTOCOL_VERSION: u32 = 1;

/// Who a process runs as inside the box.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Credentials {
    pub uid: u32,
    pub gid: u32,
}

/// A terminal's size in character cells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WindowSize {
    pub rows: u16,
    pub cols: u16,
}

/// A process to start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Spawn {
    /// The program and its arguments; never empty. A program without a `/` is looked up in
    /// the `PATH` of `env`.
    pub argv: Vec<String>,
    /// The whole environment (nothing is inherited from the agent).
    pub env: Vec<(String, String)>,
    /// The working directory.
    pub cwd: String,
    /// Run as this user; `None`: as the agent (the box's root).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<Credentials>,
    /// Run on a terminal of this size (stdout and stderr are then one stream).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub terminal: Option<WindowSize>,
    /// Keep stdin open for [`Op::Stdin`] frames; otherwise the process reads end of file.
    #[serde(default)]
    pub stdin: bool,
}

/// What the host asks of the agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    /// Are you there? Answered [`Reply::Hello`].
    Hello,
    /// Start a process: answered [`Reply::Spawned`], then its [`Reply::Output`] and finally
    /// [`Reply::Exited`], all with this request's id.
    Spawn(Spawn),
    /// Bytes for the stdin of the process (or the connection) started by request `target`;
    /// `eof` closes it after them. No reply.
    Stdin {
        target: u64,
        #[serde(with = "b64")]
        data: Vec<u8>,
        #[serde(default)]
        eof: bool,
    },
    /// Sends `signal` to the process group of request `target`'s process. No reply.
    Signal { target: u64, signal: i32 },
    /// Resizes request `target`'s terminal. No reply.
    Resize { target: u64, size: WindowSize },
    /// Reads up to `limit` bytes of a file from `offset`: answered [`Reply::Data`] chunks
    /// and a final [`Reply::Done`].
    ReadFile {
        path: String,
        offset: u64,
        limit: u64,
    },
    /// Writes a file (created with `mode` if missing; truncated unless `append`).
    WriteFile {
        path: String,
        #[serde(with = "b64")]
        data: Vec<u8>,
        #[serde(default)]
        append: bool,
        #[serde(default = "default_mode")]
        mode: u32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        owner: Option<Credentials>,
    },
    /// Lists a directory: answered [`Reply::Entries`].
    List { path: String },
    /// Describes one path without following a final symlink: answered [`Reply::Entry`].
    Stat { path: String },
    /// Makes a directory (and its parents when `parents`).
    MakeDir {
        path: String,
        #[serde(default)]
        parents: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        owner: Option<Credentials>,
    },
    /// Removes a file, or a directory with everything under it.
    Remove { path: String },
    /// Renames a path.
    Rename { from: String, to: String },
    /// Opens a TCP connection to `127.0.0.1:port` inside the box: answered
    /// [`Reply::Connected`], then [`Reply::Output`] with what the peer sends, then
    /// [`Reply::Closed`]. The host writes to it with [`Op::Stdin`].
    Connect { port: u16 },
    /// Listens on `127.0.0.1:port` inside the box: answered [`Reply::Listening`], then a
    /// [`Reply::Accepted`] for each connection a process in the box makes. Each accepted
    /// connection is a stream of its own, with the id the agent gives it: its bytes come as
    /// [`Reply::Output`] with that id, its end as [`Reply::Closed`]; the host writes to it
    /// with [`Op::Stdin`] to that id. (Kiln carries the box's proxied connections so.)
    Listen { port: u16 },
    /// After a microVM is restored from a snapshot (every clone starts with the same memory):
    /// mixes `seed` into the kernel's random pool and reseeds it at once, and sets the clock to
    /// `now_ms` (milliseconds since the epoch). Answered [`Reply::Done`] or
    /// [`Reply::Failed`].
    Thaw {
        #[serde(with = "b64")]
        seed: Vec<u8>,
        now_ms: u64,
    },
}

/// Ids the agent gives accepted connections have this bit set; the host's request ids never
/// do.
pub const AGENT_ID_BIT: u64 = 1 << 63;

fn default_mode() -> u32 {
    0o644
}

/// A request frame.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    pub id: u64,
    pub op: Op,
}

/// What kind of thing a path is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EntryKind {
    File,
    Dir,
    Symlink,
    Other,
}

/// One file or directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub name: String,
    pub kind: EntryKind,
    pub size: u64,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Seconds since the epoch.
    pub modified: i64,
    /// Where a symlink points.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
}

/// A failure, with a stable kind.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    /// `not_found`, `exists`, `permission`, `not_a_directory`, `is_a_directory`,
    /// `no_space`, `invalid`, `unknown_target`, `spawn`, `io`.
    pub kind: String,
    pub message: String,
}

impl Failure {
    pub fn new(kind: &str, message: impl Into<String>) -> Failure {
        Failure {
            kind: kind.into(),
            message: message.into(),
        }
    }

    /// A failed system call, named by its errno.
    pub fn io(context: &str, e: &std::io::Error) -> Failure {
        let kind = match e.raw_os_error() {
            Some(libc::ENOENT) => "not_found",
            Some(libc::EEXIST) => "exists",
            Some(libc::EACCES | libc::EPERM | libc::EROFS) => "permission",
            Some(libc::ENOTDIR) => "not_a_directory",
            Some(libc::EISDIR) => "is_a_directory",
            Some(libc::ENOSPC | libc::EDQUOT) => "no_space",
            Some(libc::EINVAL | libc::ENAMETOOLONG | libc::ELOOP) => "invalid",
            _ => "io",
        };
        Failure::new(kind, format!("{context}: {e}"))
    }
}

/// What the agent answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reply {
    /// The answer to [`Op::Hello`].
    Hello { version: u32, pid: u32 },
    /// The process started, with this pid inside the box.
    Spawned { pid: u32 },
    /// Output of a process (or bytes from a connection).
    Output {
        stderr: bool,
        #[serde(with = "b64")]
        data: Vec<u8>,
    },
    /// The process ended, with an exit code or the signal that killed it; its output has
    /// all been sent.
    Exited {
        code: Option<i32>,
        signal: Option<i32>,
    },
    /// A piece of a file.
    Data {
        #[serde(with = "b64")]
        data: Vec<u8>,
    },
    /// A directory's entries.
    Entries { entries: Vec<Entry> },
    /// One path's description.
    Entry { entry: Entry },
    /// A connection is open.
    Connected,
    /// A connection is closed.
    Closed,
    /// The agent listens.
    Listening,
    /// A connection arrived on a listener: its stream's id.
    Accepted { conn: u64 },
    /// The request succeeded (and needs no other answer).
    Done,
    /// The request failed.
    Failed(Failure),
}

impl Reply {
    /// Whether this reply is the last for its request.
    pub fn is_final(&self) -> bool {
        matches!(
            self,
            Reply::Hello { .. }
                | Reply::Exited { .. }
                | Reply::Done
                | Reply::Failed(_)
                | Reply::Closed
        )
    }
}

/// A response frame.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Response {
    pub id: u64,
    pub reply: Reply,
}

/// A frame could not be read or written.
#[derive(Debug)]
pub enum FrameError {
    /// The other side closed the stream.
    Closed,
    /// The frame is larger than [`MAX_FRAME_BYTES`].
    TooLarge(u64),
    /// The frame is not valid JSON for the expected type.
    Malformed(serde_json::Error),
    /// Reading or writing failed.
    Io(std::io::Error),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::Closed => write!(f, "the channel closed"),
            FrameError::TooLarge(n) => write!(
                f,
                "a frame of {n} bytes is larger than the limit of {MAX_FRAME_BYTES}"
            ),
            FrameError::Malformed(e) => write!(f, "malformed frame: {e}"),
            FrameError::Io(e) => write!(f, "channel I/O failed: {e}"),
        }
    }
}

impl std::error::Error for FrameError {}

/// Serializes a frame with its length prefix, refusing one larger than [`MAX_FRAME_BYTES`].
pub fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, FrameError> {
    let mut out = vec![0u8; 4];
    serde_json::to_writer(&mut out, value).map_err(FrameError::Malformed)?;
    let len = (out.len() - 4) as u64;
    if len > u64::from(MAX_FRAME_BYTES) {
        return Err(FrameError::TooLarge(len));
    }
    out[..4].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(out)
}

/// Checks a frame's length prefix.
pub fn frame_len(prefix: [u8; 4]) -> Result<usize, FrameError> {
    let len = u32::from_le_bytes(prefix);
    if len > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge(u64::from(len)));
    }
    Ok(len as usize)
}

/// Reads one frame (blocking).
pub fn read_frame<R: Read, T: for<'de> Deserialize<'de>>(input: &mut R) -> Result<T, FrameError> {
    let mut prefix = [0u8; 4];
    read_exact(input, &mut prefix)?;
    let mut body = vec![0u8; frame_len(prefix)?];
    read_exact(input, &mut body)?;
    serde_json::from_slice(&body).map_err(FrameError::Malformed)
}

fn read_exact<R: Read>(input: &mut R, buf: &mut [u8]) -> Result<(), FrameError> {
    input.read_exact(buf).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => FrameError::Closed,
        _ => FrameError::Io(e),
    })
}

/// Writes one frame (blocking).
pub fn write_frame<W: Write, T: Serialize>(out: &mut W, value: &T) -> Result<(), FrameError> {
    out.write_all(&encode(value)?).map_err(FrameError::Io)?;
    out.flush().map_err(FrameError::Io)
}

/// Bytes as base64 in JSON (standard alphabet, padded).
mod b64 {
    use base64::Engine;
    use base64::engine::general_purpose::STANDARD;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&STANDARD.encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        decode(text.as_bytes()).ok_or_else(|| serde::de::Error::custom("invalid base64"))
    }

    pub(super) fn decode(text: &[u8]) -> Option<Vec<u8>> {
        STANDARD.decode(text).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_bad_frames_are_refused() {
        let request = Request {
            id: 9,
            op: Op::Stdin {
                target: 3,
                data: (0..=255).collect(),
                eof: true,
            },
        };
        let bytes = encode(&request).unwrap();
        let back: Request = read_frame(&mut bytes.as_slice()).unwrap();
        assert_eq!(back, request);

        let huge = (MAX_FRAME_BYTES + 1).to_le_bytes();
        assert!(matches!(
            read_frame::<_, Request>(&mut huge.as_slice()),
            Err(FrameError::TooLarge(_))
        ));
        assert!(matches!(
            read_frame::<_, Request>(&mut [3u8, 0, 0].as_slice()),
            Err(FrameError::Closed)
        ));
        let mut junk = 3u32.to_le_bytes().to_vec();
        junk.extend_from_slice(b"{{{");
        assert!(matches!(
            read_frame::<_, Request>(&mut junk.as_slice()),
            Err(FrameError::Malformed(_))
        ));
    }

    #[test]
    fn base64_round_trips_every_length_and_refuses_junk() {
        for len in 0..40 {
            let data: Vec<u8> = (0..len).map(|i| (i * 37 % 256) as u8).collect();
            let json = serde_json::to_string(&Reply::Data { data: data.clone() }).unwrap();
            let back: Reply = serde_json::from_str(&json).unwrap();
            assert_eq!(back, Reply::Data { data });
        }
        for junk in ["abc", "a===", "ab=c", "ab==cd==", "a*cd"] {
            assert!(b64::decode(junk.as_bytes()).is_none(), "{junk}");
        }
    }
}
