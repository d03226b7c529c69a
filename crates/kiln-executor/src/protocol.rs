//! The wire between the pool and a worker: length-prefixed JSON frames over the worker's
//! stdin and stdout (u32 little-endian length, then that many bytes of JSON).

use kiln_core::{ExecRequest, ExecResult, Limits};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The largest frame either side accepts: 64 MiB (code is capped at 16 MiB, output at what
/// the limits allow).
pub const MAX_FRAME_BYTES: u32 = 64 << 20;

/// What the pool asks of a worker.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Op {
    /// Run a one-shot execution.
    Exec(ExecRequest),
    /// Open a session with the grants and limits of the request (its code is ignored).
    OpenSession { session: u64, request: ExecRequest },
    /// Run a turn in an open session.
    Turn {
        session: u64,
        code: String,
        limits: Limits,
        /// Grant the door for this turn: the guest's `_host.call` frames come up as
        /// `Reply::Door` and are answered with `Op::DoorAnswer`.
        #[serde(default)]
        door: bool,
    },
    /// Open session `session` as a copy of the open session `parent` (its state, with the
    /// grants and limits of the request; its code is ignored). Waits for a turn of `parent`
    /// that is running to end. Answered `Opened`.
    ForkSession {
        parent: u64,
        session: u64,
        request: ExecRequest,
    },
    /// Close a session.
    CloseSession { session: u64 },
    /// Stop the request `target` (an `Exec` or a `Turn`). It answers `Failed` with kind
    /// `cancelled`; a cancelled turn ends its session. Cancel itself gets no reply.
    Cancel { target: u64 },
    /// Are you there? Answered `Pong` at once, ahead of any guest work.
    Ping,
    /// The host's answer to door call `call` of the request `target`: the reply frame
    /// (`ok`), or a fault message. Gets no reply.
    DoorAnswer {
        target: u64,
        call: u64,
        ok: bool,
        #[serde(with = "kiln_core::base64_bytes")]
        data: Vec<u8>,
    },
}

/// Whose work a request is, for fair sharing of the worker's CPU (see [`crate::fair`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Share {
    /// The tenant; requests without a share count as one anonymous tenant.
    pub tenant: String,
    /// Its weight (≥ 1): a tenant of weight 2 gets twice the CPU of one of weight 1 when
    /// both are busy.
    pub weight: u32,
}

/// A request frame.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Request {
    pub id: u64,
    pub op: Op,
    /// Send output as `Chunk` replies while it runs (for `Exec` and `Turn`).
    #[serde(default)]
    pub stream: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share: Option<Share>,
}

/// A failure the worker reports for one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteError {
    /// A stable name: `setup`, `limits`, `grant`, `too_large`, `session_ended`,
    /// `no_such_session`, `busy`, `instantiate`, `cancelled`, `internal`.
    pub kind: String,
    /// The message, one line.
    pub message: String,
}

/// What a worker answers.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Reply {
    /// Output as the guest wrote it; more replies follow for the same request.
    Chunk {
        stream: kiln_core::backend::StreamKind,
        #[serde(with = "kiln_core::base64_bytes")]
        data: Vec<u8>,
    },
    /// A frame the guest sent through its granted door; answer with `Op::DoorAnswer`.
    Door {
        call: u64,
        #[serde(with = "kiln_core::base64_bytes")]
        data: Vec<u8>,
    },
    /// A one-shot began to run (it got its turn of the CPU): from here on it may have had
    /// effects. A one-shot whose worker dies before this is run again on another worker.
    Started,
    Done(ExecResult),
    /// The answer to `Ping`.
    Pong,
    Opened,
    Closed,
    Failed(RemoteError),
}

/// A response frame.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Response {
    pub id: u64,
    pub reply: Reply,
}

/// A frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The other side closed the stream.
    #[error("the stream closed")]
    Closed,
    /// The frame is larger than [`MAX_FRAME_BYTES`].
    #[error("a frame of {0} bytes is larger than the limit of {MAX_FRAME_BYTES}")]
    TooLarge(u32),
    /// The frame is not valid JSON for the expected type.
    #[error("malformed frame: {0}")]
    Malformed(#[source] serde_json::Error),
    /// Reading or writing failed.
    #[error("frame I/O failed: {0}")]
    Io(#[source] std::io::Error),
}

/// Serializes a frame's body, refusing one larger than [`MAX_FRAME_BYTES`] (so an oversized
/// message fails alone instead of breaking the stream).
pub fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, FrameError> {
    let bytes = serde_json::to_vec(value).map_err(FrameError::Malformed)?;
    let len = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
    if len > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge(len));
    }
    Ok(bytes)
}

/// Writes one encoded frame body with its length prefix.
pub async fn write_encoded<W: AsyncWrite + Unpin>(
    out: &mut W,
    body: &[u8],
) -> Result<(), FrameError> {
    let len = u32::try_from(body.len()).map_err(|_| FrameError::TooLarge(u32::MAX))?;
    out.write_all(&len.to_le_bytes())
        .await
        .map_err(FrameError::Io)?;
    out.write_all(body).await.map_err(FrameError::Io)?;
    out.flush().await.map_err(FrameError::Io)
}

/// Frames gathered into one write reach at most about this many bytes.
const BATCH_BYTES: usize = 1 << 20;

/// Writes what `rx` carries as frames (each item's body from `body`; `None` skips it),
/// those waiting together in one write: one system call instead of two per frame. Ends when
/// every sender is gone or a write fails (the reader stopped).
pub async fn write_batched<T, W: AsyncWrite + Unpin>(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<T>,
    mut out: W,
    body: impl Fn(T) -> Option<Vec<u8>>,
) {
    let mut batch = Vec::new();
    while let Some(first) = rx.recv().await {
        batch.clear();
        let mut next = Some(first);
        while let Some(item) = next.take() {
            if let Some(frame) = body(item) {
                let len = u32::try_from(frame.len()).unwrap_or(u32::MAX);
                batch.extend_from_slice(&len.to_le_bytes());
                batch.extend_from_slice(&frame);
            }
            if batch.len() < BATCH_BYTES {
                next = rx.try_recv().ok();
            }
        }
        if batch.is_empty() {
            continue;
        }
        if out.write_all(&batch).await.is_err() || out.flush().await.is_err() {
            break;
        }
    }
}

/// Writes one frame.
pub async fn write_frame<W: AsyncWrite + Unpin, T: Serialize>(
    out: &mut W,
    value: &T,
) -> Result<(), FrameError> {
    write_encoded(out, &encode(value)?).await
}

/// Reads one frame.
pub async fn read_frame<R: AsyncRead + Unpin, T: for<'de> Deserialize<'de>>(
    input: &mut R,
) -> Result<T, FrameError> {
    let mut len = [0u8; 4];
    match input.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(FrameError::Closed),
        Err(e) => return Err(FrameError::Io(e)),
    }
    let len = u32::from_le_bytes(len);
    if len > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge(len));
    }
    let mut bytes = vec![0u8; len as usize];
    input
        .read_exact(&mut bytes)
        .await
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => FrameError::Closed,
            _ => FrameError::Io(e),
        })?;
    serde_json::from_slice(&bytes).map_err(FrameError::Malformed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames_round_trip_and_bad_frames_are_refused() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        let request = Request {
            id: 7,
            op: Op::CloseSession { session: 3 },
            stream: false,
            share: None,
        };
        write_frame(&mut a, &request).await.unwrap();
        let back: Request = read_frame(&mut b).await.unwrap();
        assert_eq!(back.id, 7);
        assert!(matches!(back.op, Op::CloseSession { session: 3 }));

        a.write_all(&(MAX_FRAME_BYTES + 1).to_le_bytes())
            .await
            .unwrap();
        let err = read_frame::<_, Request>(&mut b).await.unwrap_err();
        assert!(matches!(err, FrameError::TooLarge(n) if n == MAX_FRAME_BYTES + 1));

        let (mut a, mut b) = tokio::io::duplex(1024);
        a.write_all(&3u32.to_le_bytes()).await.unwrap();
        a.write_all(b"{x}").await.unwrap();
        let err = read_frame::<_, Request>(&mut b).await.unwrap_err();
        assert!(matches!(err, FrameError::Malformed(_)));
        drop(a);
        let err = read_frame::<_, Request>(&mut b).await.unwrap_err();
        assert!(matches!(err, FrameError::Closed));
    }
}
