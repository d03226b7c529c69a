//! The host's side of the agent's channel: requests go out through one writer, and a reader
//! task routes every response to the request that asked, by id, until its final reply.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use kiln_guest::proto::{self, FrameError, Op, Reply, Request, Response};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

/// Where one request's replies go; a listener's also get each accepted connection's stream.
struct Route {
    tx: mpsc::UnboundedSender<Reply>,
    accepts: Option<mpsc::UnboundedSender<Replies>>,
}

type Routes = std::sync::Arc<Mutex<Option<HashMap<u64, Route>>>>;

/// One agent's channel.
pub struct Channel {
    writer: tokio::sync::Mutex<Box<dyn AsyncWrite + Send + Unpin>>,
    /// `None` once the channel has ended.
    routes: Routes,
    next: AtomicU64,
    reader: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channel").finish_non_exhaustive()
    }
}

/// The replies to one request.
#[derive(Debug)]
pub struct Replies {
    pub id: u64,
    rx: mpsc::UnboundedReceiver<Reply>,
}

impl Replies {
    /// The next reply; `None` when the agent is gone.
    pub async fn next(&mut self) -> Option<Reply> {
        self.rx.recv().await
    }
}

/// The agent is gone (the box ended) or the channel broke.
#[derive(Debug, thiserror::Error)]
#[error("the box's agent is gone: {0}")]
pub struct ChannelClosed(pub String);

async fn read_response<R: AsyncRead + Unpin>(input: &mut R) -> Result<Response, FrameError> {
    let mut prefix = [0u8; 4];
    input
        .read_exact(&mut prefix)
        .await
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => FrameError::Closed,
            _ => FrameError::Io(e),
        })?;
    let mut body = vec![0u8; proto::frame_len(prefix)?];
    input.read_exact(&mut body).await.map_err(FrameError::Io)?;
    serde_json::from_slice(&body).map_err(FrameError::Malformed)
}

impl Channel {
    /// Starts routing the responses read from `input`.
    pub fn new(
        mut input: impl AsyncRead + Send + Unpin + 'static,
        output: impl AsyncWrite + Send + Unpin + 'static,
    ) -> Channel {
        let routes: Routes = std::sync::Arc::new(Mutex::new(Some(HashMap::new())));
        let reader = {
            let routes = routes.clone();
            tokio::spawn(async move {
                loop {
                    let Ok(Response { id, reply }) = read_response(&mut input).await else {
                        break;
                    };
                    let mut guard = routes.lock().unwrap_or_else(|e| e.into_inner());
                    let Some(table) = guard.as_mut() else { break };
                    let last = reply.is_final();
                    if let Reply::Accepted { conn } = reply {
                        // The connection's route exists before its first byte is read.
                        let (tx, rx) = mpsc::unbounded_channel();
                        table.insert(conn, Route { tx, accepts: None });
                        if let Some(accepts) = table.get(&id).and_then(|r| r.accepts.as_ref()) {
                            let _ = accepts.send(Replies { id: conn, rx });
                        }
                        continue;
                    }
                    if let Some(route) = table.get(&id) {
                        let _ = route.tx.send(reply);
                    }
                    if last {
                        table.remove(&id);
                    }
                }
                // Every waiting request sees the end.
                routes.lock().unwrap_or_else(|e| e.into_inner()).take();
            })
        };
        Channel {
            writer: tokio::sync::Mutex::new(Box::new(output)),
            routes,
            next: AtomicU64::new(1),
            reader,
        }
    }

    /// Sends a request whose replies are wanted.
    pub async fn call(&self, op: Op) -> Result<Replies, ChannelClosed> {
        self.call_routed(op, None).await
    }

    async fn call_routed(
        &self,
        op: Op,
        accepts: Option<mpsc::UnboundedSender<Replies>>,
    ) -> Result<Replies, ChannelClosed> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        self.routes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
            .ok_or_else(|| ChannelClosed("the channel ended".into()))?
            .insert(id, Route { tx, accepts });
        self.send_frame(&Request { id, op }).await?;
        Ok(Replies { id, rx })
    }

    /// Listens on `port` inside the box: each connection a process there makes arrives as
    /// the replies of a stream of its own (its bytes as `Output`, its end as `Closed`);
    /// write to it with [`Channel::write`].
    pub async fn listen(
        &self,
        port: u16,
    ) -> Result<mpsc::UnboundedReceiver<Replies>, ChannelClosed> {
        let (accepts, accepted) = mpsc::unbounded_channel();
        let mut replies = self.call_routed(Op::Listen { port }, Some(accepts)).await?;
        match replies.next().await {
            Some(Reply::Listening) => Ok(accepted),
            other => Err(ChannelClosed(format!(
                "the agent could not listen on port {port}: {other:?}"
            ))),
        }
    }

    /// Writes to a stream (a process's stdin, a connection); `eof` closes it after.
    pub async fn write(&self, target: u64, data: Vec<u8>, eof: bool) -> Result<(), ChannelClosed> {
        self.tell(Op::Stdin { target, data, eof }).await
    }

    /// Sends a request that gets no reply (stdin, signal, resize).
    pub async fn tell(&self, op: Op) -> Result<(), ChannelClosed> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.send_frame(&Request { id, op }).await
    }

    async fn send_frame(&self, request: &Request) -> Result<(), ChannelClosed> {
        let frame = proto::encode(request).map_err(|e| ChannelClosed(e.to_string()))?;
        let mut writer = self.writer.lock().await;
        writer
            .write_all(&frame)
            .await
            .map_err(|e| ChannelClosed(e.to_string()))?;
        writer
            .flush()
            .await
            .map_err(|e| ChannelClosed(e.to_string()))
    }

    /// Whether the agent is still there.
    pub fn is_open(&self) -> bool {
        self.routes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// Closes the channel: the agent kills what it started and exits.
    pub async fn close(&self) {
        let _ = self.writer.lock().await.shutdown().await;
        self.reader.abort();
        self.routes.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        self.reader.abort();
    }
}
