//! A capped output stream for the guest's stdout and stderr.
//!
//! wasmtime's `MemoryOutputPipe` is cumulative and answers an I/O error when full; kiln keeps
//! the first `cap` bytes, drops the rest while telling the guest the write succeeded (so a
//! chatty program still finishes), flags the loss, and can hand each chunk to a listener as it
//! arrives (streaming).

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::mpsc;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi_io::poll::Pollable;
use wasmtime_wasi_io::streams::{OutputStream, StreamError};

pub use kiln_core::backend::{OutputChunk, StreamKind};

#[derive(Debug)]
struct Inner {
    data: Vec<u8>,
    cap: usize,
    truncated: bool,
    listener: Option<mpsc::UnboundedSender<OutputChunk>>,
    /// A runtime message kiln words for its own sandbox: a write holding the first has it
    /// replaced by the second.
    reword: Option<(&'static str, &'static str)>,
}

/// One capped stream, shared between the store (which writes) and the host (which reads).
#[derive(Debug, Clone)]
pub struct CappedPipe {
    kind: StreamKind,
    inner: Arc<Mutex<Inner>>,
}

impl CappedPipe {
    pub fn new(kind: StreamKind, cap: u64) -> CappedPipe {
        CappedPipe {
            kind,
            inner: Arc::new(Mutex::new(Inner {
                data: Vec::new(),
                cap: usize::try_from(cap).unwrap_or(usize::MAX),
                truncated: false,
                listener: None,
                reword: None,
            })),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A poisoned lock only means a panic elsewhere; the bytes are still good.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts a new turn: a fresh cap, empty buffer, and the listener for its chunks.
    pub fn reset(&self, cap: u64, listener: Option<mpsc::UnboundedSender<OutputChunk>>) {
        let mut inner = self.lock();
        inner.data.clear();
        inner.cap = usize::try_from(cap).unwrap_or(usize::MAX);
        inner.truncated = false;
        inner.listener = listener;
    }

    /// Replaces `from` with `to` in any one write that holds it whole.
    pub fn set_reword(&self, from: &'static str, to: &'static str) {
        self.lock().reword = Some((from, to));
    }

    /// Takes what was kept so far and whether anything was dropped.
    pub fn take(&self) -> (Vec<u8>, bool) {
        let mut inner = self.lock();
        inner.listener = None;
        (std::mem::take(&mut inner.data), inner.truncated)
    }

    fn push(&self, bytes: &[u8]) {
        let mut inner = self.lock();
        let reworded;
        let bytes = match inner.reword {
            Some((from, to)) if contains(bytes, from.as_bytes()) => {
                reworded = String::from_utf8_lossy(bytes)
                    .replace(from, to)
                    .into_bytes();
                &reworded[..]
            }
            _ => bytes,
        };
        let room = inner.cap.saturating_sub(inner.data.len());
        let kept = &bytes[..bytes.len().min(room)];
        if kept.len() < bytes.len() {
            inner.truncated = true;
        }
        if kept.is_empty() {
            return;
        }
        inner.data.extend_from_slice(kept);
        if let Some(listener) = &inner.listener {
            let chunk = OutputChunk {
                stream: self.kind,
                data: Bytes::copy_from_slice(kept),
            };
            if listener.send(chunk).is_err() {
                inner.listener = None;
            }
        }
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|w| w == needle)
}

impl IsTerminal for CappedPipe {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for CappedPipe {
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }

    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

#[wasmtime_wasi::async_trait]
impl OutputStream for CappedPipe {
    fn write(&mut self, bytes: Bytes) -> Result<(), StreamError> {
        self.push(&bytes);
        Ok(())
    }

    fn flush(&mut self) -> Result<(), StreamError> {
        Ok(())
    }

    fn check_write(&mut self) -> Result<usize, StreamError> {
        Ok(64 * 1024)
    }
}

#[wasmtime_wasi::async_trait]
impl Pollable for CappedPipe {
    async fn ready(&mut self) {}
}

impl tokio::io::AsyncWrite for CappedPipe {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.push(buf);
        std::task::Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_cap_and_flags_the_rest() {
        let pipe = CappedPipe::new(StreamKind::Stdout, 4);
        let mut stream = pipe.clone();
        OutputStream::write(&mut stream, Bytes::from_static(b"abc")).unwrap();
        OutputStream::write(&mut stream, Bytes::from_static(b"def")).unwrap();
        assert_eq!(pipe.take(), (b"abcd".to_vec(), true));
        pipe.reset(10, None);
        OutputStream::write(&mut stream, Bytes::from_static(b"xyz")).unwrap();
        assert_eq!(pipe.take(), (b"xyz".to_vec(), false));
    }

    #[test]
    fn streams_kept_chunks_to_a_listener() {
        let pipe = CappedPipe::new(StreamKind::Stderr, 5);
        let (tx, mut rx) = mpsc::unbounded_channel();
        pipe.reset(5, Some(tx));
        let mut stream = pipe.clone();
        OutputStream::write(&mut stream, Bytes::from_static(b"hello world")).unwrap();
        let chunk = rx.try_recv().unwrap();
        assert_eq!(chunk.stream, StreamKind::Stderr);
        assert_eq!(&chunk.data[..], b"hello");
        assert!(rx.try_recv().is_err());
    }
}

/// Rich results a guest sends during a turn (see [`kiln_core::RichResult`]): kept in order up
/// to [`kiln_core::MAX_RICH_RESULTS`] and [`kiln_core::MAX_RICH_RESULT_BYTES`], and handed to
/// the turn's listener as they arrive.
#[derive(Debug, Clone, Default)]
pub struct Displays {
    inner: Arc<Mutex<DisplaysInner>>,
}

#[derive(Debug, Default)]
struct DisplaysInner {
    results: Vec<kiln_core::RichResult>,
    bytes: usize,
    listener: Option<mpsc::UnboundedSender<OutputChunk>>,
    /// Whether the guest imported pyplot: its open figures are shown after each turn.
    armed: bool,
}

impl Displays {
    fn lock(&self) -> std::sync::MutexGuard<'_, DisplaysInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts a new turn: nothing kept, and the listener for its results.
    pub fn reset(&self, listener: Option<mpsc::UnboundedSender<OutputChunk>>) {
        let mut inner = self.lock();
        inner.results.clear();
        inner.bytes = 0;
        inner.listener = listener;
    }

    /// Keeps one result the guest sent as a frame; `false` if the frame is malformed or the
    /// turn's budget is spent (the guest is told, and the result is not kept).
    pub fn push(&self, frame: &[u8]) -> bool {
        let Some(result) = kiln_core::RichResult::from_frame(frame) else {
            return false;
        };
        let mut inner = self.lock();
        let size = result.size();
        if inner.results.len() >= kiln_core::MAX_RICH_RESULTS
            || inner.bytes + size > kiln_core::MAX_RICH_RESULT_BYTES
        {
            return false;
        }
        inner.bytes += size;
        if let Some(listener) = &inner.listener
            && let Ok(json) = serde_json::to_vec(&result)
        {
            let _ = listener.send(OutputChunk {
                stream: StreamKind::Display,
                data: Bytes::from(json),
            });
        }
        inner.results.push(result);
        true
    }

    /// Notes that the guest imported pyplot.
    pub fn arm(&self) {
        self.lock().armed = true;
    }

    /// Whether the guest imported pyplot.
    pub fn armed(&self) -> bool {
        self.lock().armed
    }

    /// Takes the turn's results.
    pub fn take(&self) -> Vec<kiln_core::RichResult> {
        std::mem::take(&mut self.lock().results)
    }
}
