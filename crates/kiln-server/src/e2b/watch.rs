//! Watching a folder (envd's CreateWatcher, GetWatcherEvents, RemoveWatcher and the
//! streaming WatchDir): a watcher keeps a snapshot of the folder (every entry's kind, size
//! and modification time, through the workspace's handles, never following a link) and says
//! what changed since the last look: a new entry is CREATE (and WRITE when it is a file with
//! content), a changed one WRITE, a gone one REMOVE. A rename shows as REMOVE and CREATE.
//! Changes undone between two looks are not seen.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use kiln_runtime::files;
use kiln_workspace::Kind;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::connect::{self, RpcError, envelope};
use super::envd::workspace_rel;
use super::{E2b, SandboxCtx};

/// The most watchers one sandbox keeps.
pub const MAX_WATCHERS_PER_SANDBOX: usize = 16;

/// How often a streaming watch looks.
const STREAM_POLL: Duration = Duration::from_millis(200);

/// One entry as a watcher remembers it.
type Seen = BTreeMap<String, (Kind, u64, i64)>;

struct Watcher {
    sandbox: String,
    folder: String,
    recursive: bool,
    seen: Seen,
}

/// Every sandbox's watchers, by id.
#[derive(Default)]
pub struct Watchers {
    all: Mutex<HashMap<String, Watcher>>,
}

impl Watchers {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Watcher>> {
        self.all.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct WatchRequest {
    path: String,
    recursive: bool,
    #[serde(alias = "watcher_id")]
    watcher_id: String,
}

/// The folder's entries now, by path relative to it.
async fn look(
    e2b: &E2b,
    ctx: &SandboxCtx,
    folder: &str,
    recursive: bool,
) -> Result<Seen, RpcError> {
    let depth = if recursive { 64 } else { 1 };
    let found = files::entries(
        &e2b.app.runtime,
        &ctx.caller,
        ctx.id(),
        folder.to_owned(),
        depth,
    )
    .await
    .map_err(|e| {
        let error = RpcError::from(e);
        if error.code == "not_found" {
            RpcError::not_found(format!("directory '{folder}' does not exist"))
        } else {
            error
        }
    })?;
    let prefix = if folder.is_empty() {
        String::new()
    } else {
        format!("{folder}/")
    };
    Ok(found
        .into_iter()
        .filter_map(|d| {
            let name = d.path.strip_prefix(&prefix)?.to_owned();
            Some((name, (d.meta.kind, d.meta.size, d.meta.mtime_ns)))
        })
        .collect())
}

/// What changed from `before` to `now`, as envd's events.
fn changes(before: &Seen, now: &Seen) -> Vec<Value> {
    let event =
        |name: &str, kind: &str| json!({"name": name, "type": format!("EVENT_TYPE_{kind}")});
    let mut events = Vec::new();
    for (name, (kind, size, mtime)) in now {
        match before.get(name) {
            None => {
                events.push(event(name, "CREATE"));
                if *kind == Kind::File && *size > 0 {
                    events.push(event(name, "WRITE"));
                }
            }
            Some((old_kind, _, _)) if old_kind != kind => {
                events.push(event(name, "REMOVE"));
                events.push(event(name, "CREATE"));
            }
            Some((_, old_size, old_mtime)) if (old_size, old_mtime) != (size, mtime) => {
                if *kind != Kind::Dir {
                    events.push(event(name, "WRITE"));
                }
            }
            Some(_) => {}
        }
    }
    for name in before.keys().filter(|name| !now.contains_key(*name)) {
        events.push(event(name, "REMOVE"));
    }
    events
}

/// The unary watcher calls.
pub async fn unary(
    e2b: &E2b,
    ctx: &SandboxCtx,
    method: &str,
    body: &[u8],
) -> Result<Value, RpcError> {
    let asked: WatchRequest = connect::decode(body, false)?;
    match method {
        "CreateWatcher" => {
            let folder = workspace_rel(&ctx.sandbox, &asked.path)?;
            let seen = look(e2b, ctx, &folder, asked.recursive).await?;
            let mut all = e2b.watchers.lock();
            // Watchers of sandboxes that are gone go with them.
            all.retain(|_, w| e2b.app.runtime.registry.lookup(&w.sandbox).is_some());
            if all.values().filter(|w| w.sandbox == ctx.id()).count() >= MAX_WATCHERS_PER_SANDBOX {
                return Err(RpcError::new(
                    "resource_exhausted",
                    format!(
                        "a sandbox keeps at most {MAX_WATCHERS_PER_SANDBOX} watchers; stop one first"
                    ),
                ));
            }
            let id = kiln_runtime::sandbox::new_id("watch_");
            all.insert(
                id.clone(),
                Watcher {
                    sandbox: ctx.id().to_owned(),
                    folder,
                    recursive: asked.recursive,
                    seen,
                },
            );
            Ok(json!({"watcherId": id}))
        }
        "GetWatcherEvents" => {
            let (folder, recursive, before) = {
                let all = e2b.watchers.lock();
                let watcher = all
                    .get(&asked.watcher_id)
                    .filter(|w| w.sandbox == ctx.id())
                    .ok_or_else(|| {
                        RpcError::not_found(format!("watcher {} not found", asked.watcher_id))
                    })?;
                (
                    watcher.folder.clone(),
                    watcher.recursive,
                    watcher.seen.clone(),
                )
            };
            let now = look(e2b, ctx, &folder, recursive).await?;
            let events = changes(&before, &now);
            if let Some(watcher) = e2b.watchers.lock().get_mut(&asked.watcher_id) {
                watcher.seen = now;
            }
            Ok(json!({"events": events}))
        }
        "RemoveWatcher" => {
            let mut all = e2b.watchers.lock();
            match all.get(&asked.watcher_id) {
                Some(w) if w.sandbox == ctx.id() => {
                    all.remove(&asked.watcher_id);
                    Ok(json!({}))
                }
                _ => Err(RpcError::not_found(format!(
                    "watcher {} not found",
                    asked.watcher_id
                ))),
            }
        }
        other => Err(RpcError::new(
            "unimplemented",
            format!("filesystem.Filesystem has no method {other}"),
        )),
    }
}

/// `WatchDir`: a stream of the folder's changes until the client goes away.
pub async fn stream(
    e2b: std::sync::Arc<E2b>,
    ctx: SandboxCtx,
    body: &[u8],
    keepalive: Duration,
) -> axum::response::Response {
    let asked: WatchRequest = match connect::decode(body, true) {
        Ok(asked) => asked,
        Err(e) => return connect::stream_error(e),
    };
    let folder = match workspace_rel(&ctx.sandbox, &asked.path) {
        Ok(folder) => folder,
        Err(e) => return connect::stream_error(e),
    };
    let mut seen = match look(&e2b, &ctx, &folder, asked.recursive).await {
        Ok(seen) => seen,
        Err(e) => return connect::stream_error(e),
    };
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    tokio::spawn(async move {
        if tx.send(envelope(&json!({"start": {}}))).await.is_err() {
            return;
        }
        let mut last_sent = tokio::time::Instant::now();
        loop {
            tokio::time::sleep(STREAM_POLL).await;
            let now = match look(&e2b, &ctx, &folder, asked.recursive).await {
                Ok(now) => now,
                // Busy running a cell: look again next time.
                Err(e) if e.code == "unavailable" => continue,
                Err(e) => {
                    let _ = tx.send(connect::end_stream(Some(&e))).await;
                    return;
                }
            };
            for event in changes(&seen, &now) {
                if tx
                    .send(envelope(&json!({"filesystem": event})))
                    .await
                    .is_err()
                {
                    return;
                }
                last_sent = tokio::time::Instant::now();
            }
            seen = now;
            if last_sent.elapsed() >= keepalive {
                if tx.send(envelope(&json!({"keepalive": {}}))).await.is_err() {
                    return;
                }
                last_sent = tokio::time::Instant::now();
            }
            if tx.is_closed() {
                return;
            }
        }
    });
    connect::stream_response(futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|frame| (frame, rx))
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_say_create_write_and_remove() {
        let before: Seen = [
            ("kept".to_owned(), (Kind::File, 1, 1)),
            ("changed".to_owned(), (Kind::File, 1, 1)),
            ("gone".to_owned(), (Kind::File, 1, 1)),
        ]
        .into();
        let now: Seen = [
            ("kept".to_owned(), (Kind::File, 1, 1)),
            ("changed".to_owned(), (Kind::File, 2, 5)),
            ("new".to_owned(), (Kind::File, 3, 1)),
            ("empty".to_owned(), (Kind::File, 0, 1)),
        ]
        .into();
        let said: Vec<(String, String)> = changes(&before, &now)
            .iter()
            .map(|e| {
                (
                    e["name"].as_str().unwrap().to_owned(),
                    e["type"].as_str().unwrap().to_owned(),
                )
            })
            .collect();
        let has = |name: &str, kind: &str| {
            said.contains(&(name.to_owned(), format!("EVENT_TYPE_{kind}")))
        };
        assert!(has("changed", "WRITE") && has("new", "CREATE") && has("new", "WRITE"));
        assert!(has("empty", "CREATE") && !has("empty", "WRITE"));
        assert!(has("gone", "REMOVE") && !said.iter().any(|(n, _)| n == "kept"));
    }
}
