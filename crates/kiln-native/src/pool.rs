//! The warm pool (seed 002): per template, members (boxes; microVMs later) started ahead of
//! need, claimed in well under a millisecond, destroyed after use and never given back, and
//! refilled in the background within a CPU budget (how many may start at once).
//!
//! A claim on an empty pool follows the template's [`EmptyPoolPolicy`]: `wait` for the
//! replenisher's next member (up to the claim timeout; the replenisher starts one for each
//! waiting claim, up to `max_vms`), `boot_sync` (start one on the request path), or `reject`.
//! `max_vms` bounds the members alive at once, ready and in use together, so a burst past it
//! waits, then is refused with the reason.
//!
//! The pool is generic over what it keeps: a [`Starter`] starts one member, and dropping a
//! [`Claimed`] (or a ready member at shutdown) is the member's end.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kiln_core::pool::{EmptyPoolPolicy, PoolStats};

/// A template's pool settings, resolved.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PoolConfig {
    pub target: usize,
    pub max: usize,
    pub policy: EmptyPoolPolicy,
    pub claim_timeout: Duration,
}

impl PoolConfig {
    /// kiln's defaults: one ready member, at most 50 alive, claims wait up to 5 s.
    pub const DEFAULT: PoolConfig = PoolConfig {
        target: 1,
        max: 50,
        policy: EmptyPoolPolicy::Wait,
        claim_timeout: Duration::from_secs(5),
    };

    /// `definition`'s settings, the unset ones from [`PoolConfig::DEFAULT`] (a target above
    /// the maximum is lowered to it).
    pub fn resolve(definition: &kiln_core::pool::PoolDefinition) -> PoolConfig {
        let d = PoolConfig::DEFAULT;
        let max = definition.max_vms.unwrap_or(d.max).max(1);
        PoolConfig {
            target: definition.target_pool_size.unwrap_or(d.target).min(max),
            max,
            policy: definition.empty_pool_policy.unwrap_or(d.policy),
            claim_timeout: definition
                .claim_timeout_seconds
                .filter(|t| *t > 0.0 && *t <= 600.0)
                .map_or(d.claim_timeout, Duration::from_secs_f64),
        }
    }
}

/// The server's pool settings, for every template: its defaults, per-language (or
/// per-template) sizes, and how many members may start at once.
#[derive(Clone, Default)]
pub struct PoolSettings {
    /// What a template's own `pool:` leaves unset.
    pub defaults: kiln_core::pool::PoolDefinition,
    /// `target_pool_size` by language (`python`, `javascript` or `node`, `go`, `bash`: the
    /// templates whose first language it is, unless a template's own `pool:` sizes it) or
    /// by template name (`python`, `linux-python`: this wins over a template's own).
    pub sizes: std::collections::BTreeMap<String, usize>,
    /// Members starting at once, across all pools (the replenisher's CPU budget).
    pub at_once: usize,
    /// Where members' folders are made: beside the sandboxes' (the same file system), as a
    /// claimed member's folder is renamed into a sandbox's place. `None`: no pools.
    pub home: Option<std::path::PathBuf>,
    /// Makes and mounts a volume of the size given at the path given, with an empty
    /// `workspace` in it (the sandboxes' own kind). `None`: no pools.
    pub volume: Option<MakeVolume>,
}

/// `definition` with the size `size` where one is given (a size past the maximum raises
/// the maximum), resolved.
fn sized(mut definition: kiln_core::pool::PoolDefinition, size: Option<usize>) -> PoolConfig {
    if size.is_some() {
        definition.target_pool_size = size;
    }
    if let (Some(target), Some(max)) = (definition.target_pool_size, definition.max_vms)
        && target > max
    {
        definition.max_vms = Some(target);
    }
    PoolConfig::resolve(&definition)
}

/// See [`PoolSettings::volume`].
pub type MakeVolume = Arc<dyn Fn(&std::path::Path, u64) -> std::io::Result<()> + Send + Sync>;

impl PoolSettings {
    /// The settings of a template's variant `id` (the microVM `vm-python`, the gVisor box
    /// `gvisor-python`): sized only by name in [`PoolSettings::sizes`] (a VM costs far more
    /// than a box to keep, and under a software CPU seconds of it to start; a variant is
    /// asked for by name), 0 otherwise; the rest from the defaults.
    pub fn for_variant(&self, id: &str) -> PoolConfig {
        sized(
            self.defaults.clone(),
            Some(self.sizes.get(id).copied().unwrap_or(0)),
        )
    }

    /// The settings of the template `name` (its definition's name) whose languages are
    /// `languages`, over its own `pool:`. A size given for the template by name wins over
    /// its own; one given for its first language (`python=2`) only where its own `pool:`
    /// sets no size (the services template, whose first language is python too, keeps its
    /// own 0).
    pub fn for_template(
        &self,
        name: &str,
        languages: &[String],
        own: Option<&kiln_core::pool::PoolDefinition>,
    ) -> PoolConfig {
        let first = languages.first().map(String::as_str).unwrap_or_default();
        let by_name = [name.to_string(), format!("linux-{name}")]
            .iter()
            .find_map(|key| self.sizes.get(key).copied());
        let by_language = [
            first.to_string(),
            if first == "javascript" {
                "node".into()
            } else {
                String::new()
            },
        ]
        .iter()
        .find_map(|key| self.sizes.get(key).copied());
        let own = own.cloned().unwrap_or_default();
        let size = by_name.or(by_language.filter(|_| own.target_pool_size.is_none()));
        sized(own.or(&self.defaults), size)
    }
}

/// Starts one member.
pub type Starter<M> =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<M, String>> + Send>> + Send + Sync>;

/// Whether a ready member still lives.
pub type Alive<M> = fn(&M) -> bool;

/// A claim that got no member, and why.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PoolError {
    #[error(
        "the warm pool of {template} is empty and its policy is reject ({in_use} of at most {max} in use); try again shortly, or raise its target_pool_size"
    )]
    Rejected {
        template: String,
        in_use: usize,
        max: usize,
    },
    #[error(
        "no member of {template}'s warm pool was ready within its claim timeout of {timeout:?} ({in_use} of at most {max} in use{why}); try again shortly"
    )]
    TimedOut {
        template: String,
        timeout: Duration,
        in_use: usize,
        max: usize,
        why: String,
    },
    #[error("starting a member of {template}'s warm pool failed: {message}")]
    Start { template: String, message: String },
    #[error("the warm pool of {template} is closed (the server is stopping)")]
    Closed { template: String },
}

struct State<M> {
    ready: VecDeque<M>,
    starting: usize,
    in_use: usize,
    waiting: usize,
    closed: bool,
    /// A failed start holds the replenisher back until then (doubling up to 30 s).
    backoff_until: Option<Instant>,
    backoff: Duration,
    stats: PoolStats,
}

struct Inner<M> {
    template: String,
    config: PoolConfig,
    start: Starter<M>,
    alive: Alive<M>,
    state: Mutex<State<M>>,
    /// Claims waiting for a member.
    ready: tokio::sync::Notify,
    /// The replenisher.
    wake: Arc<tokio::sync::Notify>,
}

/// One template's pool. Cheap to clone.
pub struct Pool<M> {
    inner: Arc<Inner<M>>,
}

impl<M> Clone for Pool<M> {
    fn clone(&self) -> Self {
        Pool {
            inner: self.inner.clone(),
        }
    }
}

/// A member claimed from a pool: it counts as in use (against `max_vms`) until dropped.
pub struct Claimed<M: Send + 'static> {
    member: Option<M>,
    pool: Arc<Inner<M>>,
}

impl<M: Send + 'static> Claimed<M> {
    pub fn member(&self) -> &M {
        self.member.as_ref().expect("a claimed member")
    }

    /// The member itself (it still counts as in use until this claim is dropped).
    pub fn take(&mut self) -> Option<M> {
        self.member.take()
    }
}

impl<M: Send + 'static> Drop for Claimed<M> {
    fn drop(&mut self) {
        // The member (if still held) goes first, then its place is given back.
        drop(self.member.take());
        let mut state = self.pool.lock();
        state.in_use = state.in_use.saturating_sub(1);
        drop(state);
        self.pool.wake.notify_one();
    }
}

impl<M> Inner<M> {
    fn lock(&self) -> std::sync::MutexGuard<'_, State<M>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<M: Send + 'static> Pool<M> {
    /// A pool for `template` (its catalogue id) of `tier` members (`box`, `vm`), woken by
    /// the replenisher's `wake`.
    pub fn new(
        template: &str,
        tier: &str,
        config: PoolConfig,
        start: Starter<M>,
        alive: Alive<M>,
        wake: Arc<tokio::sync::Notify>,
    ) -> Pool<M> {
        Pool {
            inner: Arc::new(Inner {
                template: template.to_string(),
                config,
                start,
                alive,
                state: Mutex::new(State {
                    ready: VecDeque::new(),
                    starting: 0,
                    in_use: 0,
                    waiting: 0,
                    closed: false,
                    backoff_until: None,
                    backoff: Duration::ZERO,
                    stats: PoolStats {
                        template: template.to_string(),
                        tier: tier.to_string(),
                        target: config.target,
                        max: config.max,
                        policy: config.policy,
                        claim_timeout_seconds: config.claim_timeout.as_secs_f64(),
                        ..Default::default()
                    },
                }),
                ready: tokio::sync::Notify::new(),
                wake,
            }),
        }
    }

    pub fn template(&self) -> &str {
        &self.inner.template
    }

    pub fn config(&self) -> PoolConfig {
        self.inner.config
    }

    /// A member: a ready one at once, else as the policy says.
    pub async fn claim(&self) -> Result<Claimed<M>, PoolError> {
        let started = Instant::now();
        let pool = &self.inner;
        let outcome = |state: &mut State<M>, outcome: &str| {
            *state.stats.claims.entry(outcome.to_string()).or_default() += 1;
            state
                .stats
                .claim_wait
                .observe(started.elapsed().as_secs_f64());
        };
        let mut waited = false;
        let mut counted_waiting = false;
        loop {
            // Registered before the state is read, so a member made ready in between wakes us.
            let notified = pool.ready.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let boot_now = {
                let mut state = pool.lock();
                if state.closed {
                    if counted_waiting {
                        state.waiting -= 1;
                    }
                    return Err(PoolError::Closed {
                        template: pool.template.clone(),
                    });
                }
                while let Some(member) = state.ready.pop_front() {
                    if !(pool.alive)(&member) {
                        state.stats.lost += 1;
                        continue;
                    }
                    state.in_use += 1;
                    if counted_waiting {
                        state.waiting -= 1;
                    }
                    outcome(&mut state, if waited { "waited" } else { "ready" });
                    drop(state);
                    pool.wake.notify_one();
                    return Ok(Claimed {
                        member: Some(member),
                        pool: pool.clone(),
                    });
                }
                let alive = state.starting + state.in_use;
                match pool.config.policy {
                    EmptyPoolPolicy::Reject => {
                        outcome(&mut state, "rejected");
                        return Err(PoolError::Rejected {
                            template: pool.template.clone(),
                            in_use: state.in_use,
                            max: pool.config.max,
                        });
                    }
                    EmptyPoolPolicy::BootSync if alive < pool.config.max => {
                        state.in_use += 1;
                        if counted_waiting {
                            state.waiting -= 1;
                        }
                        true
                    }
                    _ => false,
                }
            };
            if boot_now {
                return self.boot_sync(started).await;
            }
            {
                let mut state = pool.lock();
                if started.elapsed() >= pool.config.claim_timeout {
                    if counted_waiting {
                        state.waiting -= 1;
                    }
                    outcome(&mut state, "timed_out");
                    let why = state
                        .stats
                        .last_error
                        .as_ref()
                        .filter(|_| state.backoff_until.is_some())
                        .map(|e| format!("; the last start failed: {e}"))
                        .unwrap_or_default();
                    return Err(PoolError::TimedOut {
                        template: pool.template.clone(),
                        timeout: pool.config.claim_timeout,
                        in_use: state.in_use,
                        max: pool.config.max,
                        why,
                    });
                }
                if !counted_waiting {
                    state.waiting += 1;
                    counted_waiting = true;
                }
            }
            pool.wake.notify_one();
            waited = true;
            let left = pool.config.claim_timeout.saturating_sub(started.elapsed());
            let _ = tokio::time::timeout(left, notified).await;
        }
    }

    /// Starts a member on the request path (its place already counted in use).
    async fn boot_sync(&self, started: Instant) -> Result<Claimed<M>, PoolError> {
        let pool = &self.inner;
        let booted = Instant::now();
        let made = (pool.start)().await;
        let mut state = pool.lock();
        match made {
            Ok(member) => {
                state.stats.boot.observe(booted.elapsed().as_secs_f64());
                *state.stats.claims.entry("boot_sync".into()).or_default() += 1;
                state
                    .stats
                    .claim_wait
                    .observe(started.elapsed().as_secs_f64());
                drop(state);
                Ok(Claimed {
                    member: Some(member),
                    pool: pool.clone(),
                })
            }
            Err(message) => {
                state.in_use -= 1;
                state.stats.last_error = Some(message.clone());
                drop(state);
                pool.wake.notify_one();
                Err(PoolError::Start {
                    template: pool.template.clone(),
                    message,
                })
            }
        }
    }

    /// How many members the replenisher should start now: enough for the target and for
    /// every waiting claim, within `max_vms`.
    fn deficit(&self) -> usize {
        let mut state = self.inner.lock();
        if state.closed {
            return 0;
        }
        if let Some(until) = state.backoff_until {
            if Instant::now() < until {
                return 0;
            }
            state.backoff_until = None;
        }
        // Dead ready members are dropped here too, so they are replaced.
        let alive = self.inner.alive;
        let before = state.ready.len();
        state.ready.retain(alive);
        let lost = (before - state.ready.len()) as u64;
        state.stats.lost += lost;
        let have = state.ready.len() + state.starting;
        let want = (self.inner.config.target + state.waiting).saturating_sub(have);
        let room = self.inner.config.max.saturating_sub(have + state.in_use);
        want.min(room)
    }

    /// Starts one member in the background (the replenisher's budget is the caller's).
    fn start_one(&self) -> impl Future<Output = ()> + Send + 'static {
        let pool = self.inner.clone();
        pool.lock().starting += 1;
        async move {
            let booted = Instant::now();
            let made = (pool.start)().await;
            // Closed meanwhile: the member ends here, and counts as starting until it has
            // (so a shutdown waiting for starts finds it gone).
            let late = {
                let mut state = pool.lock();
                match made {
                    Ok(member) if !state.closed => {
                        state.starting -= 1;
                        state.stats.boot.observe(booted.elapsed().as_secs_f64());
                        state.stats.replenished += 1;
                        state.backoff = Duration::ZERO;
                        state.ready.push_back(member);
                        drop(state);
                        pool.ready.notify_one();
                        None
                    }
                    Ok(member) => Some(member),
                    Err(message) => {
                        state.starting -= 1;
                        tracing::warn!(template = %pool.template, "a warm pool member failed to start: {message}");
                        state.stats.replenish_failures += 1;
                        state.stats.last_error = Some(message);
                        state.backoff = (state.backoff * 2)
                            .clamp(Duration::from_millis(250), Duration::from_secs(30));
                        state.backoff_until = Some(Instant::now() + state.backoff);
                        drop(state);
                        // Waiting claims look again (they time out with the reason).
                        pool.ready.notify_waiters();
                        None
                    }
                }
            };
            if let Some(member) = late {
                let _ = tokio::task::spawn_blocking(move || drop(member)).await;
                pool.lock().starting -= 1;
            }
            pool.wake.notify_one();
        }
    }

    /// The pool as it stands.
    pub fn stats(&self) -> PoolStats {
        let state = self.inner.lock();
        PoolStats {
            ready: state.ready.len(),
            starting: state.starting,
            in_use: state.in_use,
            waiting: state.waiting,
            ..state.stats.clone()
        }
    }

    /// Closes the pool: claims are refused and the ready members handed back (to be ended).
    pub fn close(&self) -> Vec<M> {
        let mut state = self.inner.lock();
        state.closed = true;
        let ready = state.ready.drain(..).collect();
        drop(state);
        self.inner.ready.notify_waiters();
        ready
    }
}

/// Keeps `pools` filled: starts what they lack, at most `at_once` at a time across all of
/// them, whenever a claim, a member's end or a start wakes it (and every second, to notice
/// dead members and backoffs ending). Ends when `pools` are all closed.
pub async fn replenish<M: Send + 'static>(
    pools: Vec<Pool<M>>,
    wake: Arc<tokio::sync::Notify>,
    at_once: usize,
) {
    let budget = Arc::new(tokio::sync::Semaphore::new(at_once.max(1)));
    loop {
        if pools.iter().all(|p| p.inner.lock().closed) {
            return;
        }
        // Round-robin, one start per pool per pass, so one pool's burst does not starve
        // another's refill.
        let mut started_any = true;
        while started_any {
            started_any = false;
            for pool in &pools {
                if pool.deficit() == 0 {
                    continue;
                }
                let Ok(permit) = budget.clone().try_acquire_owned() else {
                    break;
                };
                let start = pool.start_one();
                tokio::spawn(async move {
                    start.await;
                    drop(permit);
                });
                started_any = true;
            }
            if budget.available_permits() == 0 {
                break;
            }
        }
        let _ = tokio::time::timeout(Duration::from_secs(1), wake.notified()).await;
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_size_by_language_leaves_a_templates_own_size_alone_and_one_by_name_does_not() {
        let settings = PoolSettings {
            sizes: [("python".to_string(), 2), ("linux-go".to_string(), 3)].into(),
            ..PoolSettings::default()
        };
        let python = vec!["python".to_string()];
        let none = kiln_core::pool::PoolDefinition {
            target_pool_size: Some(0),
            ..Default::default()
        };
        // python=2 sizes the python template, not the services template (its own 0).
        assert_eq!(settings.for_template("python", &python, None).target, 2);
        assert_eq!(
            settings
                .for_template("services", &python, Some(&none))
                .target,
            0
        );
        // By name, the operator's size wins over the template's own.
        assert_eq!(
            settings
                .for_template("go", &["go".to_string()], Some(&none))
                .target,
            3
        );
    }

    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A member that counts how many are alive (dropping one ends it).
    struct Member(Arc<AtomicUsize>);
    impl Drop for Member {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn new_pool(
        config: PoolConfig,
        boot: Duration,
        fail: bool,
    ) -> (Pool<Member>, Arc<AtomicUsize>) {
        let alive = Arc::new(AtomicUsize::new(0));
        let counter = alive.clone();
        let start: Starter<Member> = Arc::new(move || {
            let counter = counter.clone();
            Box::pin(async move {
                tokio::time::sleep(boot).await;
                if fail {
                    return Err("no such template".to_string());
                }
                counter.fetch_add(1, Ordering::SeqCst);
                Ok(Member(counter))
            })
        });
        let wake = Arc::new(tokio::sync::Notify::new());
        let pool = Pool::new("t", "box", config, start, |_| true, wake.clone());
        tokio::spawn(replenish(vec![pool.clone()], wake, 2));
        (pool, alive)
    }

    async fn until(what: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !what() {
            assert!(Instant::now() < deadline, "timed out");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    fn config(target: usize, max: usize, policy: EmptyPoolPolicy, timeout_ms: u64) -> PoolConfig {
        PoolConfig {
            target,
            max,
            policy,
            claim_timeout: Duration::from_millis(timeout_ms),
        }
    }

    #[tokio::test]
    async fn a_pool_fills_to_its_target_and_claims_are_never_given_back() {
        let (pool, alive) = new_pool(
            config(3, 10, EmptyPoolPolicy::Wait, 2000),
            Duration::from_millis(10),
            false,
        );
        until(|| pool.stats().ready == 3).await;
        let claimed = pool.claim().await.unwrap();
        assert_eq!(pool.stats().in_use, 1);
        // Refilled to 3 ready while one is in use.
        until(|| pool.stats().ready == 3).await;
        assert_eq!(alive.load(Ordering::SeqCst), 4);
        drop(claimed);
        // The claimed member is gone, not returned.
        until(|| alive.load(Ordering::SeqCst) == 3).await;
        let stats = pool.stats();
        assert_eq!((stats.ready, stats.in_use), (3, 0));
        assert_eq!(stats.claims.get("ready"), Some(&1));
        assert!(stats.replenished >= 4);
        for member in pool.close() {
            drop(member);
        }
        assert_eq!(alive.load(Ordering::SeqCst), 0);
        assert!(matches!(pool.claim().await, Err(PoolError::Closed { .. })));
    }

    #[tokio::test]
    async fn a_burst_of_50_claims_follows_each_policy() {
        // reject: the ready ones are served, the rest refused at once.
        let (pool, _alive) = new_pool(
            config(2, 50, EmptyPoolPolicy::Reject, 2000),
            Duration::from_millis(30),
            false,
        );
        until(|| pool.stats().ready == 2).await;
        let claims: Vec<_> = (0..50).map(|_| pool.claim()).collect();
        let results = futures::future::join_all(claims).await;
        let served = results.iter().filter(|r| r.is_ok()).count();
        assert_eq!(served, 2);
        assert!(
            results
                .iter()
                .filter_map(|r| r.as_ref().err())
                .all(|e| matches!(e, PoolError::Rejected { .. }))
        );
        drop(results);

        // wait, max 10: at most 10 alive at once; those not served in time are refused.
        let (pool, alive) = pool_with_peak(config(2, 10, EmptyPoolPolicy::Wait, 300));
        until(|| pool.stats().ready == 2).await;
        let claims: Vec<_> = (0..50)
            .map(|_| {
                let pool = pool.clone();
                tokio::spawn(async move {
                    let claimed = pool.claim().await;
                    // Hold it a while, as a run would.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    claimed.is_ok()
                })
            })
            .collect();
        let mut served = 0;
        for c in claims {
            served += usize::from(c.await.unwrap());
        }
        let (peak, stats) = (alive.1.load(Ordering::SeqCst), pool.stats());
        assert!(peak <= 10, "at most max_vms alive at once, saw {peak}");
        assert!((10..50).contains(&served), "served {served}");
        assert_eq!(
            stats.claims.get("timed_out").copied().unwrap_or(0),
            (50 - served) as u64
        );

        // boot_sync: every claim is served (each past the ready ones starts its own).
        let (pool, _alive) = new_pool(
            config(2, 50, EmptyPoolPolicy::BootSync, 2000),
            Duration::from_millis(30),
            false,
        );
        until(|| pool.stats().ready == 2).await;
        let results = futures::future::join_all((0..50).map(|_| pool.claim())).await;
        assert!(results.iter().all(|r| r.is_ok()));
        let stats = pool.stats();
        assert!(
            stats.claims.get("boot_sync").copied().unwrap_or(0) >= 40,
            "{:?}",
            stats.claims
        );
    }

    /// A pool whose members also track the most alive at once.
    fn pool_with_peak(config: PoolConfig) -> (Pool<Member>, (Arc<AtomicUsize>, Arc<AtomicUsize>)) {
        let alive = Arc::new(AtomicUsize::new(0));
        let peak = Arc::new(AtomicUsize::new(0));
        let (a, p) = (alive.clone(), peak.clone());
        let start: Starter<Member> = Arc::new(move || {
            let (a, p) = (a.clone(), p.clone());
            Box::pin(async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                let now = a.fetch_add(1, Ordering::SeqCst) + 1;
                p.fetch_max(now, Ordering::SeqCst);
                Ok(Member(a))
            })
        });
        let wake = Arc::new(tokio::sync::Notify::new());
        let pool = Pool::new("t", "box", config, start, |_| true, wake.clone());
        tokio::spawn(replenish(vec![pool.clone()], wake, 2));
        (pool, (alive, peak))
    }

    #[tokio::test]
    async fn a_pool_whose_starts_fail_says_why_and_backs_off() {
        let (pool, _alive) = new_pool(
            config(1, 4, EmptyPoolPolicy::Wait, 300),
            Duration::from_millis(1),
            true,
        );
        let err = pool.claim().await.err().unwrap().to_string();
        assert!(
            err.contains("claim timeout") && err.contains("no such template"),
            "{err}"
        );
        let stats = pool.stats();
        assert!(stats.replenish_failures >= 1);
        // Backing off: not hundreds of tries in 300 ms.
        assert!(
            stats.replenish_failures < 10,
            "{}",
            stats.replenish_failures
        );
    }
}
