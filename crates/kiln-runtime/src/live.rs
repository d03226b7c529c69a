//! Live sessions kept by key (a `kiln rest` tenant today; live boxes next): at most `max` open
//! or being opened, the least recently used idle one closed to make room for a new one, and
//! idle ones closed after a timeout.
//!
//! A key's [`Slot`] holds its session behind an async lock. A request holds the lock for its
//! whole run, so a locked slot is busy and never evicted or closed as idle. What ending a
//! session means (closing it in its pool, removing what its owner left) is the owner's
//! [`Retire`], always called with the slot's lock held, so no request of that key can start
//! in between.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use kiln_executor::SessionHandle;

/// Evictions one reservation may make before it gives up (others may take what it frees).
const MAX_EVICTIONS_PER_RESERVE: usize = 16;

/// What the owner of the sessions does when one ends.
pub trait Retire: Send + Sync {
    /// Ends `key`'s session: `session` is its slot's content, its lock held by the caller.
    /// It must leave `session` empty and call [`LiveSessions::release`] when it closed one.
    fn retire(
        &self,
        key: &str,
        session: &mut Option<SessionHandle>,
    ) -> impl Future<Output = ()> + Send;

    /// `key`'s idle session was closed to make room for `for_key`'s (for the owner's log).
    fn evicted(&self, key: &str, for_key: &str) {
        let _ = (key, for_key);
    }
}

/// One key's session and when it was last used.
#[derive(Debug, Default)]
pub struct Slot {
    /// The live session, if any; hold the lock while using it.
    pub session: tokio::sync::Mutex<Option<SessionHandle>>,
    /// Milliseconds since the table was made.
    last_used_ms: AtomicU64,
}

/// Every open or opening session was busy: none could be closed to make room.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("all {max} sessions are busy")]
pub struct AllBusy {
    pub max: usize,
}

/// The table of live sessions.
#[derive(Debug)]
pub struct LiveSessions {
    slots: Mutex<HashMap<String, Arc<Slot>>>,
    /// Sessions open or being opened; at most `max`.
    open: AtomicUsize,
    max: usize,
    started: Instant,
    evictions: AtomicU64,
}

impl LiveSessions {
    /// A table of at most `max` sessions (at least one).
    pub fn new(max: usize) -> LiveSessions {
        LiveSessions {
            slots: Mutex::default(),
            open: AtomicUsize::new(0),
            max: max.max(1),
            started: Instant::now(),
            evictions: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Slot>>> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The most sessions open at once.
    pub fn max(&self) -> usize {
        self.max
    }

    /// Sessions open or being opened now.
    pub fn open_count(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// Idle sessions closed to make room since the start.
    pub fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::Relaxed)
    }

    /// `key`'s slot, if it has one.
    pub fn get(&self, key: &str) -> Option<Arc<Slot>> {
        self.lock().get(key).cloned()
    }

    /// `key`'s slot, made empty if it has none.
    pub fn get_or_insert(&self, key: &str) -> Arc<Slot> {
        self.lock().entry(key.to_owned()).or_default().clone()
    }

    /// Drops `key`'s slot from the table when nobody else holds it (`slot` is the caller's
    /// own clone; its lock must be released).
    pub fn forget_if_unused(&self, key: &str, slot: &Arc<Slot>) {
        let mut slots = self.lock();
        if slots
            .get(key)
            .is_some_and(|s| Arc::ptr_eq(s, slot) && Arc::strong_count(s) <= 2)
        {
            slots.remove(key);
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Marks `slot` used now (for the idle timeout and eviction order).
    pub fn touch(&self, slot: &Slot) {
        slot.last_used_ms.store(self.now_ms(), Ordering::Relaxed);
    }

    /// A session closed: its place is free again.
    pub fn release(&self) {
        self.open.fetch_sub(1, Ordering::AcqRel);
    }

    /// Closes the sessions idle longer than `idle` (a busy one is looked at next time).
    pub async fn close_idle(&self, owner: &impl Retire, idle: Duration) {
        let now = self.now_ms();
        let idle_ms = u64::try_from(idle.as_millis()).unwrap_or(u64::MAX);
        // Weak, so that holding the list does not make every slot look in use.
        let slots: Vec<(String, Weak<Slot>)> = self
            .lock()
            .iter()
            .map(|(key, slot)| (key.clone(), Arc::downgrade(slot)))
            .collect();
        for (key, slot) in slots {
            let Some(slot) = slot.upgrade() else {
                continue;
            };
            if now.saturating_sub(slot.last_used_ms.load(Ordering::Relaxed)) < idle_ms {
                continue;
            }
            let Ok(mut guard) = slot.session.try_lock() else {
                continue;
            };
            // Also for a slot whose session a deadline already ended.
            owner.retire(&key, &mut guard).await;
            drop(guard);
            self.forget_if_unused(&key, &slot);
        }
    }

    /// Closes the least recently used idle session of another key; false when every
    /// session is busy.
    async fn evict_one(&self, owner: &impl Retire, except: &str) -> bool {
        let mut candidates: Vec<(u64, String, Weak<Slot>)> = self
            .lock()
            .iter()
            .filter(|(key, _)| key.as_str() != except)
            .map(|(key, slot)| {
                let used = slot.last_used_ms.load(Ordering::Relaxed);
                (used, key.clone(), Arc::downgrade(slot))
            })
            .collect();
        candidates.sort_by_key(|(used, _, _)| *used);
        for (_, key, slot) in candidates {
            let Some(slot) = slot.upgrade() else {
                continue;
            };
            // Locked means a request holds or waits for it: never evicted.
            let Ok(mut guard) = slot.session.try_lock() else {
                continue;
            };
            if guard.is_none() {
                continue;
            }
            owner.retire(&key, &mut guard).await;
            drop(guard);
            self.forget_if_unused(&key, &slot);
            self.evictions.fetch_add(1, Ordering::Relaxed);
            owner.evicted(&key, except);
            return true;
        }
        false
    }

    /// Counts a session about to open for `key`, closing idle ones of other keys to make
    /// room. On `Ok` the caller opens its session, or calls [`LiveSessions::release`] if
    /// that fails.
    pub async fn reserve(&self, owner: &impl Retire, key: &str) -> Result<(), AllBusy> {
        let max = self.max;
        for _ in 0..=MAX_EVICTIONS_PER_RESERVE {
            let reserved = self
                .open
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n < max).then_some(n + 1)
                })
                .is_ok();
            if reserved {
                return Ok(());
            }
            if !self.evict_one(owner, key).await {
                break;
            }
        }
        Err(AllBusy { max })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::{ExecRequest, Language};
    use kiln_executor::{CallOptions, ExecutorPool};

    /// An owner whose sessions live in an in-process fake pool; it records what it retired.
    struct Owner {
        pool: ExecutorPool,
        table: Arc<LiveSessions>,
        retired: Mutex<Vec<String>>,
    }

    impl Retire for Owner {
        async fn retire(&self, key: &str, session: &mut Option<SessionHandle>) {
            if let Some(session) = session.take() {
                self.table.release();
                let _ = self.pool.close_session(&session).await;
            }
            self.retired.lock().unwrap().push(key.to_owned());
        }
    }

    fn owner(max: usize) -> Owner {
        Owner {
            pool: ExecutorPool::new(kiln_executor::fake::pool_config(1)),
            table: Arc::new(LiveSessions::new(max)),
            retired: Mutex::default(),
        }
    }

    async fn open(owner: &Owner, key: &str) -> Result<(), AllBusy> {
        let slot = owner.table.get_or_insert(key);
        let mut guard = slot.session.lock().await;
        owner.table.reserve(owner, key).await?;
        let request = ExecRequest::new(Language::Python, "");
        let session = owner
            .pool
            .open_session_with(request, CallOptions::default())
            .await
            .expect("a fake session");
        *guard = Some(session);
        owner.table.touch(&slot);
        Ok(())
    }

    #[tokio::test]
    async fn the_least_recently_used_idle_session_makes_room_and_busy_ones_never_do() {
        let owner = owner(2);
        let table = owner.table.clone();
        open(&owner, "a").await.expect("room");
        tokio::time::sleep(Duration::from_millis(5)).await;
        open(&owner, "b").await.expect("room");
        // Full: the least recently used (a) goes.
        open(&owner, "c").await.expect("a evicted");
        assert_eq!(*owner.retired.lock().unwrap(), ["a"]);
        assert_eq!((table.open_count(), table.evictions()), (2, 1));
        assert!(table.get("a").is_none(), "an evicted key leaves the table");
        // Both left are busy: nothing can make room.
        let b = table.get("b").expect("b");
        let c = table.get("c").expect("c");
        let (_b, _c) = (b.session.lock().await, c.session.lock().await);
        let full = table.reserve(&owner, "d").await.unwrap_err();
        assert_eq!(full, AllBusy { max: 2 });
        assert_eq!(table.open_count(), 2);
    }

    #[tokio::test]
    async fn idle_sessions_close_and_busy_ones_stay() {
        let owner = owner(4);
        let table = owner.table.clone();
        open(&owner, "idle").await.expect("room");
        open(&owner, "busy").await.expect("room");
        let busy = table.get("busy").expect("busy");
        let _held = busy.session.lock().await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        table.close_idle(&owner, Duration::from_millis(10)).await;
        assert_eq!(*owner.retired.lock().unwrap(), ["idle"]);
        assert_eq!(table.open_count(), 1);
        assert!(table.get("idle").is_none());
    }
}
