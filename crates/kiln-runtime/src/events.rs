//! A sandbox's events: what became of it and its box, and why (`created`, `running`,
//! `paused`, `hibernated`, `stopped`, `deleted`), as seed 002's environment model asks.
//! Each sandbox keeps its newest [`KEPT`] in memory (a restart of kiln starts them afresh);
//! followers hear new ones as they happen (`GET /api/v1/sandboxes/{id}/events?follow=true`).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;
use tokio::sync::broadcast;
use utoipa::ToSchema;

/// Events one sandbox keeps (its newest).
pub const KEPT: usize = 128;

/// One thing that happened to a sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxEvent {
    /// Increases with every event of the server (a follower resumes after the last it saw).
    pub seq: u64,
    pub at: String,
    pub sandbox_id: String,
    /// `created`, `running`, `paused`, `hibernated`, `stopped` or `deleted`.
    #[schema(example = "paused")]
    pub state: String,
    /// Why, in a few words: `idle`, `asked`, `a command`, `preview traffic`, …
    #[schema(example = "idle")]
    pub reason: String,
}

/// Every sandbox's events.
#[derive(Debug)]
pub struct Events {
    kept: Mutex<HashMap<String, VecDeque<SandboxEvent>>>,
    live: broadcast::Sender<SandboxEvent>,
    seq: AtomicU64,
}

impl Default for Events {
    fn default() -> Self {
        Events {
            kept: Mutex::default(),
            live: broadcast::channel(1024).0,
            seq: AtomicU64::new(0),
        }
    }
}

impl Events {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, VecDeque<SandboxEvent>>> {
        self.kept.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records that sandbox `id` is now `state`, because of `reason`. A `deleted` sandbox's
    /// events are forgotten once followers have heard it.
    pub fn record(&self, id: &str, state: &str, reason: &str) {
        let event = SandboxEvent {
            seq: self.seq.fetch_add(1, Ordering::Relaxed) + 1,
            at: crate::sandbox::rfc3339(crate::sandbox::now_ms()),
            sandbox_id: id.to_string(),
            state: state.to_string(),
            reason: reason.to_string(),
        };
        {
            let mut kept = self.lock();
            if state == "deleted" {
                kept.remove(id);
            } else {
                let mine = kept.entry(id.to_string()).or_default();
                if mine.len() == KEPT {
                    mine.pop_front();
                }
                mine.push_back(event.clone());
            }
        }
        let _ = self.live.send(event);
    }

    /// Sandbox `id`'s events kept now, oldest first.
    pub fn of(&self, id: &str) -> Vec<SandboxEvent> {
        self.lock()
            .get(id)
            .map(|e| e.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Every event from now on (a follower filters its sandbox's).
    pub fn subscribe(&self) -> broadcast::Receiver<SandboxEvent> {
        self.live.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sandbox_keeps_its_newest_events_and_forgets_them_when_deleted() {
        let events = Events::default();
        let mut heard = events.subscribe();
        for i in 0..KEPT + 5 {
            events.record("sb_1", "running", &format!("{i}"));
        }
        let kept = events.of("sb_1");
        assert_eq!(kept.len(), KEPT);
        assert_eq!(kept[0].reason, "5");
        assert!(kept.windows(2).all(|w| w[0].seq < w[1].seq));
        events.record("sb_1", "deleted", "asked");
        assert!(events.of("sb_1").is_empty());
        assert_eq!(heard.try_recv().unwrap().reason, "0");
    }
}
