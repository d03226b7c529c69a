//! Executions over a tenant's concurrency quota wait their turn instead of being refused.
//!
//! Each tenant has its own line: at most `quotas.executions` of its executions run at once,
//! the next ones wait in arrival order, and a request is refused (429 `QUOTA_EXCEEDED`) only
//! when the line is already [`AdmissionConfig::max_queue`] long or it waited
//! [`AdmissionConfig::max_wait`] without a place. Lines are per tenant, so one tenant's burst
//! never queues another tenant's requests behind it. A waiter that goes away (its request
//! was dropped) gives its place to the next one.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::error::RuntimeError;

/// How long a tenant's line may grow and how long one request may wait in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionConfig {
    /// Requests of one tenant that may wait for a place at once; one more is refused.
    /// Default 1 024.
    pub max_queue: usize,
    /// The longest one request waits for a place before it is refused. Default 60 s.
    pub max_wait: Duration,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            max_queue: 1024,
            max_wait: Duration::from_secs(60),
        }
    }
}

#[derive(Default)]
struct Line {
    running: u64,
    next_ticket: u64,
    waiting: VecDeque<(u64, oneshot::Sender<()>)>,
}

/// Every tenant's line.
#[derive(Default)]
pub struct Admission {
    config: AdmissionConfig,
    lines: Arc<Mutex<HashMap<String, Line>>>,
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// A place to run; the next waiter of the tenant gets it when this is dropped.
pub struct Permit {
    tenant: String,
    lines: Arc<Mutex<HashMap<String, Line>>>,
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Permit")
            .field("tenant", &self.tenant)
            .finish()
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut lines = self.lines.lock().unwrap_or_else(|e| e.into_inner());
        let Some(line) = lines.get_mut(&self.tenant) else {
            return;
        };
        // The place passes to the first waiter still there; `running` stays as it is.
        while let Some((_, waiter)) = line.waiting.pop_front() {
            if waiter.send(()).is_ok() {
                return;
            }
        }
        line.running = line.running.saturating_sub(1);
        if line.running == 0 {
            lines.remove(&self.tenant);
        }
    }
}

/// Takes back a waiter's place in the line if it leaves before it was given one.
struct Ticket<'a> {
    admission: &'a Admission,
    tenant: &'a str,
    ticket: u64,
    armed: bool,
}

impl Ticket<'_> {
    /// Leaves the line; `true` when the waiter was still in it (no place given yet).
    fn leave(&mut self) -> bool {
        self.armed = false;
        let mut lines = self.admission.lock();
        let Some(line) = lines.get_mut(self.tenant) else {
            return false;
        };
        let before = line.waiting.len();
        line.waiting.retain(|(t, _)| *t != self.ticket);
        line.waiting.len() != before
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        if self.armed && !self.leave() {
            // A place was given between the wake-up and the drop: pass it on.
            drop(self.admission.permit(self.tenant));
        }
    }
}

impl Admission {
    pub fn new(config: AdmissionConfig) -> Admission {
        Admission {
            config,
            lines: Arc::default(),
        }
    }

    pub fn config(&self) -> AdmissionConfig {
        self.config
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Line>> {
        self.lines.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn permit(&self, tenant: &str) -> Permit {
        Permit {
            tenant: tenant.to_owned(),
            lines: self.lines.clone(),
        }
    }

    /// How many of `tenant`'s executions run and wait now.
    pub fn load(&self, tenant: &str) -> (u64, usize) {
        self.lock()
            .get(tenant)
            .map_or((0, 0), |l| (l.running, l.waiting.len()))
    }

    /// A place for one execution of `tenant`, which may run `limit` at once: at once if
    /// there is room and nobody waits, else after the ones ahead in the line.
    pub async fn admit(&self, tenant: &str, limit: u64) -> Result<Permit, RuntimeError> {
        let limit = limit.max(1);
        let (ticket, placed) = {
            let mut lines = self.lock();
            let line = lines.entry(tenant.to_owned()).or_default();
            if line.running < limit && line.waiting.is_empty() {
                line.running += 1;
                return Ok(self.permit(tenant));
            }
            if line.waiting.len() >= self.config.max_queue {
                return Err(RuntimeError::ExecutionQueueFull {
                    limit,
                    running: line.running,
                    queued: line.waiting.len(),
                    waited_ms: 0,
                });
            }
            let (tx, rx) = oneshot::channel();
            let ticket = line.next_ticket;
            line.next_ticket += 1;
            line.waiting.push_back((ticket, tx));
            (ticket, rx)
        };
        let mut guard = Ticket {
            admission: self,
            tenant,
            ticket,
            armed: true,
        };
        let started = Instant::now();
        match tokio::time::timeout(self.config.max_wait, placed).await {
            Ok(Ok(())) => {
                guard.armed = false;
                Ok(self.permit(tenant))
            }
            // The sender is only dropped by a permit that passed the place on (a send that
            // succeeded), so this arm is the timeout.
            _ => {
                if !guard.leave() {
                    // Given a place just as the wait ran out: take it.
                    return Ok(self.permit(tenant));
                }
                let (running, queued) = self.load(tenant);
                Err(RuntimeError::ExecutionQueueFull {
                    limit,
                    running,
                    queued,
                    waited_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(max_queue: usize, max_wait_ms: u64) -> Arc<Admission> {
        Arc::new(Admission::new(AdmissionConfig {
            max_queue,
            max_wait: Duration::from_millis(max_wait_ms),
        }))
    }

    #[tokio::test]
    async fn over_the_limit_waits_in_order_and_runs_when_a_place_frees() {
        let gate = admission(8, 5_000);
        let first = gate.admit("a", 2).await.unwrap();
        let second = gate.admit("a", 2).await.unwrap();
        assert_eq!(gate.load("a"), (2, 0));
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut waiters = Vec::new();
        for n in 0..3 {
            let (gate, order) = (gate.clone(), order.clone());
            waiters.push(tokio::spawn(async move {
                let permit = gate.admit("a", 2).await.unwrap();
                order.lock().unwrap().push(n);
                permit
            }));
            // Arrival order is the order the line keeps.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(gate.load("a"), (2, 3));
        drop(first);
        let third = waiters.remove(0).await.unwrap();
        drop(second);
        let fourth = waiters.remove(0).await.unwrap();
        drop(third);
        let fifth = waiters.remove(0).await.unwrap();
        assert_eq!(*order.lock().unwrap(), vec![0, 1, 2]);
        assert_eq!(gate.load("a"), (2, 0));
        drop((fourth, fifth));
        assert_eq!(gate.load("a"), (0, 0));
    }

    #[tokio::test]
    async fn another_tenant_never_waits_behind_a_full_line() {
        let gate = admission(1, 5_000);
        let _held = gate.admit("a", 1).await.unwrap();
        let waiter = {
            let gate = gate.clone();
            tokio::spawn(async move { gate.admit("a", 1).await.map(drop) })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        let other = tokio::time::timeout(Duration::from_millis(100), gate.admit("b", 1))
            .await
            .expect("tenant b was queued behind tenant a");
        assert!(other.is_ok());
        waiter.abort();
    }

    #[tokio::test]
    async fn a_full_line_and_a_long_wait_are_refused() {
        let gate = admission(1, 100);
        let _held = gate.admit("a", 1).await.unwrap();
        let waiter = {
            let gate = gate.clone();
            tokio::spawn(async move { gate.admit("a", 1).await.map(drop) })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        match gate.admit("a", 1).await.unwrap_err() {
            RuntimeError::ExecutionQueueFull {
                queued, waited_ms, ..
            } => assert_eq!((queued, waited_ms), (1, 0)),
            other => panic!("unexpected {other:?}"),
        }
        match waiter.await.unwrap().unwrap_err() {
            RuntimeError::ExecutionQueueFull { waited_ms, .. } => assert!(waited_ms >= 100),
            other => panic!("unexpected {other:?}"),
        }
        // The timed-out waiter left the line.
        assert_eq!(gate.load("a"), (1, 0));
    }

    #[tokio::test]
    async fn a_waiter_that_goes_away_gives_its_place_on() {
        let gate = admission(8, 5_000);
        let held = gate.admit("a", 1).await.unwrap();
        let gone = {
            let gate = gate.clone();
            tokio::spawn(async move { gate.admit("a", 1).await.map(drop) })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        let next = {
            let gate = gate.clone();
            tokio::spawn(async move { gate.admit("a", 1).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        gone.abort();
        let _ = gone.await;
        drop(held);
        let permit = tokio::time::timeout(Duration::from_secs(1), next)
            .await
            .expect("the place was lost with the waiter that left")
            .unwrap()
            .unwrap();
        assert_eq!(gate.load("a"), (1, 0));
        drop(permit);
        assert_eq!(gate.load("a"), (0, 0));
    }
}
