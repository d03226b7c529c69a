//! The host's side of the agent's channel: requests go out through one writer, and a reader
//! task routes every response to the request that asked, by id, until its final reply.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use kiln_guest::proto::{self, FrameError, Op, Reply, Request, Response};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

/// Where one request's replies go; a listener's also get each accepted connection's stream.
struct Route {
    tx: mpsc::UnboundedSender<Reply>,
    accepts: Option<mpsc::UnboundedSender<Replies>>,
    /// What its replies not read yet hold (see [`cost`]).
    buffered: std::sync::Arc<AtomicUsize>,
}

/// The most one stream may hold that its reader has not taken yet: past it, the stream is
/// cut (a final `Failed` reply, kind `overflow`) and what the agent sends on it after is
/// dropped, so a box that floods its channel (a hostile guest, a reader that stalled) never
/// grows kiln's memory without bound. The agent's channel has no flow control of its own.
pub const STREAM_BUDGET: usize = 64 << 20;
/// The most all of a channel's streams may hold that is not read yet.
pub const CHANNEL_BUDGET: usize = 256 << 20;
/// The most connections into a box a channel keeps open at once (each one the agent says
/// it accepted); more are refused (dropped).
pub const MAX_CONNECTIONS: usize = 4096;

/// What a reply holds in memory, roughly: its bytes, and a little for the rest.
fn cost(reply: &Reply) -> usize {
    64 + match reply {
        Reply::Output { data, .. } | Reply::Data { data } => data.len(),
        _ => 0,
    }
}

/// The most replies a parked stream keeps for whoever adopts it (the rest are dropped).
const PARKED_REPLIES: usize = 256;

/// The routes of a channel: by id, and the streams a checkpointed box had open that no one
/// has adopted yet since it was restored ([`Channel::adopt`]), each with its latest replies.
#[derive(Default)]
struct Table {
    routes: HashMap<u64, Route>,
    parked: HashMap<u64, std::collections::VecDeque<Reply>>,
}

type Routes = std::sync::Arc<Mutex<Option<Table>>>;

/// What a channel had open, to be carried over a checkpoint of its box: the next request
/// id (a restored channel goes on from there, so no new request shares an id with a stream
/// the agent still writes to), the streams open and which of them are listeners.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Carried {
    pub next: u64,
    pub streams: Vec<u64>,
    pub listeners: Vec<u64>,
}

/// One agent's channel.
pub struct Channel {
    writer: tokio::sync::Mutex<Box<dyn AsyncWrite + Send + Unpin>>,
    /// `None` once the channel has ended.
    routes: Routes,
    next: AtomicU64,
    reader: tokio::task::JoinHandle<()>,
    /// What all its streams hold that is not read yet.
    total: std::sync::Arc<AtomicUsize>,
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
    /// Its route's count of what is not read yet, and the channel's.
    buffered: std::sync::Arc<AtomicUsize>,
    total: std::sync::Arc<AtomicUsize>,
}

impl Replies {
    /// The next reply; `None` when the agent is gone.
    pub async fn next(&mut self) -> Option<Reply> {
        let reply = self.rx.recv().await?;
        let cost = cost(&reply);
        self.buffered.fetch_sub(cost, Ordering::AcqRel);
        self.total.fetch_sub(cost, Ordering::AcqRel);
        Some(reply)
    }
}

impl Drop for Replies {
    /// What was never read no longer counts.
    fn drop(&mut self) {
        self.rx.close();
        while let Ok(reply) = self.rx.try_recv() {
            let cost = cost(&reply);
            self.buffered.fetch_sub(cost, Ordering::AcqRel);
            self.total.fetch_sub(cost, Ordering::AcqRel);
        }
    }
}

/// A new route and the replies it feeds, counted against the channel's `total`.
fn route(
    id: u64,
    accepts: Option<mpsc::UnboundedSender<Replies>>,
    total: &std::sync::Arc<AtomicUsize>,
) -> (Route, Replies) {
    let (tx, rx) = mpsc::unbounded_channel();
    let buffered = std::sync::Arc::new(AtomicUsize::new(0));
    (
        Route {
            tx,
            accepts,
            buffered: buffered.clone(),
        },
        Replies {
            id,
            rx,
            buffered,
            total: total.clone(),
        },
    )
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
        input: impl AsyncRead + Send + Unpin + 'static,
        output: impl AsyncWrite + Send + Unpin + 'static,
    ) -> Channel {
        Channel::resumed(input, output, &Carried::default()).0
    }

    /// A channel to the agent of a restored box, which goes on writing to the streams its
    /// old channel had open (`carried`): each is parked until [`Channel::adopt`] takes it
    /// (its latest [`PARKED_REPLIES`] replies kept), a listener's accepted connections are
    /// the receiver answered, and new requests take ids after the old ones.
    pub fn resumed(
        mut input: impl AsyncRead + Send + Unpin + 'static,
        output: impl AsyncWrite + Send + Unpin + 'static,
        carried: &Carried,
    ) -> (Channel, Option<mpsc::UnboundedReceiver<Replies>>) {
        let mut table = Table::default();
        let mut accepted = None;
        let total = std::sync::Arc::new(AtomicUsize::new(0));
        for id in &carried.streams {
            if carried.listeners.contains(id) {
                let (accepts, rx) = mpsc::unbounded_channel();
                // The stream of the listener itself is never read again (its `Listening`
                // came before the checkpoint).
                let (listener, _) = route(*id, Some(accepts), &total);
                table.routes.insert(*id, listener);
                accepted.get_or_insert(rx);
            } else {
                table.parked.insert(*id, Default::default());
            }
        }
        let routes: Routes = std::sync::Arc::new(Mutex::new(Some(table)));
        let reader = {
            let (routes, total) = (routes.clone(), total.clone());
            tokio::spawn(async move {
                loop {
                    let Ok(Response { id, reply }) = read_response(&mut input).await else {
                        break;
                    };
                    let mut guard = routes.lock().unwrap_or_else(|e| e.into_inner());
                    let Some(table) = guard.as_mut() else { break };
                    let last = reply.is_final();
                    if let Reply::Accepted { conn } = reply {
                        // The connection's route exists before its first byte is read: for a
                        // listener kiln asked for only, a connection id of the agent's own
                        // (never one of kiln's requests), within the bound.
                        let connections = table
                            .routes
                            .keys()
                            .filter(|id| *id & proto::AGENT_ID_BIT != 0)
                            .count();
                        let Some(accepts) = table.routes.get(&id).and_then(|r| r.accepts.clone())
                        else {
                            continue;
                        };
                        if conn & proto::AGENT_ID_BIT == 0
                            || table.routes.contains_key(&conn)
                            || connections >= MAX_CONNECTIONS
                        {
                            continue;
                        }
                        let (into, replies) = route(conn, None, &total);
                        table.routes.insert(conn, into);
                        let _ = accepts.send(replies);
                        continue;
                    }
                    if let Some(into) = table.routes.get(&id) {
                        let cost = cost(&reply);
                        let over = into.buffered.load(Ordering::Acquire) + cost > STREAM_BUDGET
                            || total.load(Ordering::Acquire) + cost > CHANNEL_BUDGET;
                        if over {
                            // Cut: the reader is told why, and the stream's later replies
                            // find no route (dropped).
                            let cut = Reply::Failed(proto::Failure::new(
                                "overflow",
                                format!(
                                    "the box sent more on this stream than was read ({} MiB held for it, {} MiB for its channel): it was cut",
                                    STREAM_BUDGET >> 20,
                                    CHANNEL_BUDGET >> 20
                                ),
                            ));
                            let said = self::cost(&cut);
                            into.buffered.fetch_add(said, Ordering::AcqRel);
                            total.fetch_add(said, Ordering::AcqRel);
                            if into.tx.send(cut).is_err() {
                                into.buffered.fetch_sub(said, Ordering::AcqRel);
                                total.fetch_sub(said, Ordering::AcqRel);
                            }
                            table.routes.remove(&id);
                            continue;
                        }
                        into.buffered.fetch_add(cost, Ordering::AcqRel);
                        total.fetch_add(cost, Ordering::AcqRel);
                        if into.tx.send(reply).is_err() {
                            // No one reads it any more: it does not count.
                            into.buffered.fetch_sub(cost, Ordering::AcqRel);
                            total.fetch_sub(cost, Ordering::AcqRel);
                        }
                        if last {
                            table.routes.remove(&id);
                        }
                    } else if let Some(parked) = table.parked.get_mut(&id) {
                        parked.push_back(reply);
                        // Its latest replies, within a count and the stream's budget.
                        while parked.len() > PARKED_REPLIES
                            || (parked.len() > 1
                                && parked.iter().map(cost).sum::<usize>() > STREAM_BUDGET)
                        {
                            parked.pop_front();
                        }
                    }
                }
                // Every waiting request sees the end.
                routes.lock().unwrap_or_else(|e| e.into_inner()).take();
            })
        };
        let channel = Channel {
            writer: tokio::sync::Mutex::new(Box::new(output)),
            routes,
            next: AtomicU64::new(carried.next.max(1)),
            reader,
            total,
        };
        (channel, accepted)
    }

    /// What this channel has open now, for a checkpoint of its box ([`Channel::resumed`]).
    pub fn carried(&self) -> Carried {
        let guard = self.routes.lock().unwrap_or_else(|e| e.into_inner());
        let mut carried = Carried {
            next: self.next.load(Ordering::Relaxed),
            ..Carried::default()
        };
        if let Some(table) = guard.as_ref() {
            // Accepted connections (the agent's ids) die with the host's side of them.
            for (id, route) in &table.routes {
                if id & proto::AGENT_ID_BIT == 0 {
                    carried.streams.push(*id);
                    if route.accepts.is_some() {
                        carried.listeners.push(*id);
                    }
                }
            }
            carried.streams.extend(table.parked.keys());
        }
        carried.streams.sort_unstable();
        carried.listeners.sort_unstable();
        carried
    }

    /// Takes stream `id` of the box's life before its checkpoint: its replies from now on,
    /// after those kept while it was parked. `None`: not a stream this channel carried over,
    /// or one already adopted.
    pub fn adopt(&self, id: u64) -> Option<Replies> {
        let mut guard = self.routes.lock().unwrap_or_else(|e| e.into_inner());
        let table = guard.as_mut()?;
        let parked = table.parked.remove(&id)?;
        let (into, replies) = route(id, None, &self.total);
        let mut ended = false;
        for reply in parked {
            ended |= reply.is_final();
            let cost = cost(&reply);
            into.buffered.fetch_add(cost, Ordering::AcqRel);
            self.total.fetch_add(cost, Ordering::AcqRel);
            let _ = into.tx.send(reply);
        }
        if !ended {
            table.routes.insert(id, into);
        }
        Some(replies)
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
        let (into, replies) = route(id, accepts, &self.total);
        self.routes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
            .ok_or_else(|| ChannelClosed("the channel ended".into()))?
            .routes
            .insert(id, into);
        self.send_frame(&Request { id, op }).await?;
        Ok(replies)
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

    /// What the channel's streams hold now that their readers have not taken.
    pub fn buffered(&self) -> usize {
        self.total.load(Ordering::Acquire)
    }

    /// How many streams are open (requests waiting for replies, connections).
    pub fn streams(&self) -> usize {
        self.routes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map_or(0, |table| table.routes.len())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn output(text: &str) -> Reply {
        Reply::Output {
            stderr: false,
            data: text.as_bytes().to_vec(),
        }
    }

    /// A restored box's agent goes on writing to the streams its old channel had open: each
    /// is parked (its latest replies kept, within a bound) until adopted, a stream the old
    /// channel did not carry is dropped, a carried listener's connections arrive, and new
    /// requests take ids after the old ones.
    #[tokio::test]
    async fn a_resumed_channel_parks_carried_streams_until_adopted_and_goes_on_from_their_ids() {
        let (host_read, mut agent_write) = tokio::io::duplex(1 << 20);
        let (mut agent_read, host_write) = tokio::io::duplex(1 << 20);
        let carried = Carried {
            next: 100,
            streams: vec![5, 7],
            listeners: vec![7],
        };
        let (channel, accepted) = Channel::resumed(host_read, host_write, &carried);
        let mut accepted = accepted.expect("the listener's connections");
        let conn = proto::AGENT_ID_BIT | 1;
        let mut frames = Vec::new();
        for i in 0..PARKED_REPLIES + 44 {
            frames.push(Response {
                id: 5,
                reply: output(&format!("{i};")),
            });
        }
        frames.push(Response {
            id: 9,
            reply: output("nobody's"),
        });
        frames.push(Response {
            id: 7,
            reply: Reply::Accepted { conn },
        });
        frames.push(Response {
            id: conn,
            reply: output("over the connection"),
        });
        for frame in &frames {
            agent_write
                .write_all(&proto::encode(frame).unwrap())
                .await
                .unwrap();
        }
        let mut connection = accepted.recv().await.expect("a connection");
        assert_eq!(connection.id, conn);
        assert_eq!(connection.next().await, Some(output("over the connection")));

        // Every frame before the connection's has been routed by now.
        let mut adopted = channel.adopt(5).expect("stream 5 was carried");
        assert!(channel.adopt(5).is_none(), "a stream is adopted once");
        assert!(channel.adopt(9).is_none(), "stream 9 was not carried");
        // The oldest replies beyond the bound were dropped; the latest are kept, in order.
        assert_eq!(adopted.next().await, Some(output("44;")));
        for _ in 1..PARKED_REPLIES {
            assert!(matches!(adopted.next().await, Some(Reply::Output { .. })));
        }
        // Replies after the adoption arrive as to any request.
        let exited = Reply::Exited {
            code: Some(0),
            signal: None,
        };
        agent_write
            .write_all(
                &proto::encode(&Response {
                    id: 5,
                    reply: exited.clone(),
                })
                .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(adopted.next().await, Some(exited));
        assert_eq!(
            adopted.next().await,
            None,
            "its route ends with its final reply"
        );

        // A new request takes an id after the old channel's.
        let _hello = channel.call(Op::Hello).await.unwrap();
        let mut prefix = [0u8; 4];
        agent_read.read_exact(&mut prefix).await.unwrap();
        let mut body = vec![0u8; proto::frame_len(prefix).unwrap()];
        agent_read.read_exact(&mut body).await.unwrap();
        let request: Request = serde_json::from_slice(&body).unwrap();
        assert_eq!(request.id, 100);
        // What it would carry over now: the listener and the hello (not the agent's
        // connection, nor stream 5, which ended).
        let now = channel.carried();
        assert_eq!(now.next, 101);
        assert_eq!(now.streams, vec![7, 100]);
        assert_eq!(now.listeners, vec![7]);
    }

    /// A hostile agent (a guest that broke its agent) floods a stream no one reads, and
    /// announces connections no one asked for: kiln's memory stays within the stream's
    /// budget (the stream is cut, and says so), connections within their bound, and frames
    /// for streams that do not exist are dropped.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_flooding_agent_leaves_the_host_bounded() {
        let (host_read, mut agent_write) = tokio::io::duplex(1 << 20);
        let (_agent_read, host_write) = tokio::io::duplex(1 << 20);
        let channel = Channel::new(host_read, host_write);
        let mut flooded = channel.call(Op::Hello).await.unwrap();
        let listener = channel.call(Op::Listen { port: 1 }).await.unwrap();
        let (flooded_id, listener_id) = (flooded.id, listener.id);
        let megabyte = vec![b'x'; 1 << 20];
        let writer = tokio::spawn(async move {
            // 200 MiB on a stream kiln is not reading.
            for _ in 0..200 {
                let frame = Response {
                    id: flooded_id,
                    reply: Reply::Output {
                        stderr: false,
                        data: megabyte.clone(),
                    },
                };
                agent_write
                    .write_all(&proto::encode(&frame).unwrap())
                    .await
                    .unwrap();
            }
            // Connections: to a stream that is no listener, with kiln's own ids, and far
            // more than the bound.
            let mut frames = Vec::new();
            frames.push(Response {
                id: flooded_id,
                reply: Reply::Accepted {
                    conn: proto::AGENT_ID_BIT | 7,
                },
            });
            frames.push(Response {
                id: listener_id,
                reply: Reply::Accepted { conn: 12345 },
            });
            for n in 0..(MAX_CONNECTIONS as u64 + 500) {
                frames.push(Response {
                    id: listener_id,
                    reply: Reply::Accepted {
                        conn: proto::AGENT_ID_BIT | (1 << 32) | n,
                    },
                });
            }
            // And megabytes for streams that do not exist.
            for n in 0..50 {
                frames.push(Response {
                    id: 1_000_000 + n,
                    reply: output(&"y".repeat(1 << 20)),
                });
            }
            for frame in &frames {
                agent_write
                    .write_all(&proto::encode(frame).unwrap())
                    .await
                    .unwrap();
            }
            agent_write
        });
        let _agent_write = tokio::time::timeout(std::time::Duration::from_secs(60), writer)
            .await
            .expect("the host keeps reading a flood")
            .unwrap();
        assert!(
            channel.buffered() <= STREAM_BUDGET + (1 << 20),
            "{} bytes held",
            channel.buffered()
        );
        assert!(
            channel.streams() <= MAX_CONNECTIONS + 2,
            "{} streams open",
            channel.streams()
        );
        // The flooded stream: what fit, then why it was cut, then its end.
        let mut outputs = 0;
        let cut = loop {
            match flooded.next().await {
                Some(Reply::Output { .. }) => outputs += 1,
                Some(Reply::Failed(failure)) => break failure,
                other => panic!("{other:?}"),
            }
        };
        assert!((1..200).contains(&outputs), "{outputs}");
        assert_eq!(cut.kind, "overflow");
        assert_eq!(flooded.next().await, None);
        assert_eq!(channel.buffered(), 0, "read or gone, nothing counts");
    }
}
