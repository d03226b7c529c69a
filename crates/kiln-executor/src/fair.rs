//! Fair sharing of a worker's CPU between tenants.
//!
//! A worker runs many guests on few threads. Guests yield at every epoch tick (5 ms of wasm),
//! so one poll of a guest's future is one *slice*. [`Fair`] wraps each request's future: it
//! may only be polled while it holds one of the worker's run tokens (one per thread), and
//! gives the token back after every poll. A future that yielded (woke itself while being
//! polled) goes straight back into the queue, so the scheduler, not the async runtime's
//! run queue, decides who runs next: the waiting tenant that has used the least CPU lately
//! (usage decays with a half-life of [`HALF_LIFE`], divided by the tenant's weight); within
//! a tenant, first come first served.
//!
//! So a tenant with eight busy loops gets about as much CPU as a tenant with one, and a tenant
//! that just arrived runs at the next tick. A request whose deadline has passed is polled
//! without a token, so it times out on time however busy the worker is.

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

/// How fast past CPU use is forgotten.
pub const HALF_LIFE: Duration = Duration::from_secs(1);

/// Tenants idle with less recent use than this (ns) are forgotten.
const FORGET_BELOW_NS: f64 = 1_000.0;

#[derive(Debug)]
struct Tenant {
    /// Decayed CPU use in nanoseconds, as of `at`.
    usage_ns: f64,
    at: Instant,
    weight: f64,
    /// Tickets waiting for a token, oldest first.
    waiting: VecDeque<u64>,
    /// Futures of this tenant alive now.
    live: usize,
}

impl Tenant {
    fn usage(&self, now: Instant) -> f64 {
        let age = now.saturating_duration_since(self.at).as_secs_f64();
        self.usage_ns * (-age * std::f64::consts::LN_2 / HALF_LIFE.as_secs_f64()).exp()
    }

    fn charge(&mut self, now: Instant, ns: f64) {
        self.usage_ns = self.usage(now) + ns;
        self.at = now;
    }
}

#[derive(Debug)]
struct State {
    free: usize,
    next_ticket: u64,
    tenants: HashMap<Arc<str>, Tenant>,
    /// Tickets handed a token but not yet polled.
    granted: HashSet<u64>,
    wakers: HashMap<u64, Waker>,
}

/// The run tokens of one worker and the tenants' recent use.
#[derive(Debug)]
pub struct FairScheduler {
    state: Mutex<State>,
    /// Raised while futures wait for a token (see `Backend::contention_flag`).
    contended: Arc<AtomicBool>,
}

impl FairScheduler {
    /// A scheduler with `tokens` guests running at once (one per runtime thread).
    pub fn new(tokens: usize) -> Arc<FairScheduler> {
        FairScheduler::with_flag(tokens, Arc::default())
    }

    /// Like [`FairScheduler::new`], raising `contended` while futures wait for a token.
    pub fn with_flag(tokens: usize, contended: Arc<AtomicBool>) -> Arc<FairScheduler> {
        Arc::new(FairScheduler {
            contended,
            state: Mutex::new(State {
                free: tokens.max(1),
                next_ticket: 1,
                tenants: HashMap::new(),
                granted: HashSet::new(),
                wakers: HashMap::new(),
            }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wraps `future` so that it runs under this scheduler as `tenant` (weight ≥ 1), and is
    /// polled without a token from `deadline` on.
    pub fn wrap<F: Future>(
        self: &Arc<Self>,
        tenant: &str,
        weight: u32,
        deadline: Option<Instant>,
        future: F,
    ) -> Fair<F> {
        let tenant: Arc<str> = {
            let mut state = self.lock();
            let now = Instant::now();
            let key = match state.tenants.get_key_value(tenant) {
                Some((key, _)) => key.clone(),
                None => Arc::from(tenant),
            };
            let entry = state.tenants.entry(key.clone()).or_insert(Tenant {
                usage_ns: 0.0,
                at: now,
                weight: 1.0,
                waiting: VecDeque::new(),
                live: 0,
            });
            entry.weight = f64::from(weight.max(1));
            entry.live += 1;
            key
        };
        Fair {
            future,
            scheduler: self.clone(),
            tenant,
            deadline,
            ticket: None,
            wake: Arc::new(WakeCatcher {
                polling: AtomicBool::new(false),
                woken: AtomicBool::new(false),
                waker: Mutex::new(Waker::noop().clone()),
            }),
        }
    }

    /// Takes a token for `ticket`'s holder: one granted to it, or a free one when nobody
    /// waits. Otherwise queues it (or refreshes its waker) and answers `None`.
    fn acquire(&self, tenant: &Arc<str>, ticket: &mut Option<u64>, waker: &Waker) -> bool {
        let mut state = self.lock();
        if let Some(t) = *ticket {
            if state.granted.remove(&t) {
                *ticket = None;
                return true;
            }
            state.wakers.insert(t, waker.clone());
            return false;
        }
        if state.free > 0 {
            state.free -= 1;
            return true;
        }
        let t = state.next_ticket;
        state.next_ticket += 1;
        if let Some(entry) = state.tenants.get_mut(tenant) {
            entry.waiting.push_back(t);
        }
        state.wakers.insert(t, waker.clone());
        *ticket = Some(t);
        self.contended.store(true, Ordering::Relaxed);
        false
    }

    /// Gives a token back after a slice of `ns` charged to `tenant`; the token goes on to
    /// the neediest waiting tenant. With `requeue` (the future yielded and wants to run
    /// again), the future first joins the queue itself, woken through `waker` when its turn
    /// comes.
    fn release(&self, tenant: &Arc<str>, ns: f64, requeue: Option<(&mut Option<u64>, &Waker)>) {
        let mut state = self.lock();
        let now = Instant::now();
        if let Some(entry) = state.tenants.get_mut(tenant) {
            entry.charge(now, ns);
        }
        if let Some((ticket, waker)) = requeue {
            let t = state.next_ticket;
            state.next_ticket += 1;
            if let Some(entry) = state.tenants.get_mut(tenant) {
                entry.waiting.push_back(t);
            }
            state.wakers.insert(t, waker.clone());
            *ticket = Some(t);
        }
        self.hand_on(&mut state, now);
    }

    fn hand_on(&self, state: &mut State, now: Instant) {
        let next = state
            .tenants
            .values_mut()
            .filter(|t| !t.waiting.is_empty())
            .min_by(|a, b| {
                let (ua, ub) = (a.usage(now) / a.weight, b.usage(now) / b.weight);
                ua.total_cmp(&ub).then(a.waiting[0].cmp(&b.waiting[0]))
            })
            .and_then(|t| t.waiting.pop_front());
        match next {
            Some(ticket) => {
                state.granted.insert(ticket);
                if let Some(waker) = state.wakers.remove(&ticket) {
                    waker.wake();
                }
            }
            None => state.free += 1,
        }
        let waiting = state.tenants.values().any(|t| !t.waiting.is_empty());
        if self.contended.load(Ordering::Relaxed) != waiting {
            self.contended.store(waiting, Ordering::Relaxed);
        }
    }

    /// Forgets a finished or dropped future: its queued ticket, or the token granted to it
    /// and never used.
    fn leave(&self, tenant: &Arc<str>, ticket: Option<u64>) {
        let mut state = self.lock();
        let now = Instant::now();
        if let Some(t) = ticket {
            state.wakers.remove(&t);
            if state.granted.remove(&t) {
                self.hand_on(&mut state, now);
            } else if let Some(entry) = state.tenants.get_mut(tenant) {
                entry.waiting.retain(|w| *w != t);
            }
        }
        if let Some(entry) = state.tenants.get_mut(tenant) {
            entry.live = entry.live.saturating_sub(1);
        }
        // Keep the table to tenants that are live or used CPU lately.
        if state.tenants.len() > 64 {
            state
                .tenants
                .retain(|_, t| t.live > 0 || t.usage(now) >= FORGET_BELOW_NS);
        }
    }

    /// Recent CPU use per tenant in milliseconds (for tests and diagnostics).
    pub fn usage_ms(&self) -> Vec<(String, f64)> {
        let state = self.lock();
        let now = Instant::now();
        let mut out: Vec<_> = state
            .tenants
            .iter()
            .map(|(name, t)| (name.to_string(), t.usage(now) / 1e6))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}

/// Tells a wake during our own poll (a yield) from a wake afterwards (an event): the first
/// is kept as a flag, the second goes to the runtime's waker.
struct WakeCatcher {
    polling: AtomicBool,
    woken: AtomicBool,
    waker: Mutex<Waker>,
}

impl Wake for WakeCatcher {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if self.polling.load(Ordering::Acquire) {
            self.woken.store(true, Ordering::Release);
        } else {
            self.waker
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .wake_by_ref();
        }
    }
}

/// A future that runs under a [`FairScheduler`]; see the module docs.
pub struct Fair<F> {
    future: F,
    scheduler: Arc<FairScheduler>,
    tenant: Arc<str>,
    deadline: Option<Instant>,
    /// Our place in the queue, while we wait for a token.
    ticket: Option<u64>,
    wake: Arc<WakeCatcher>,
}

impl<F: Future> Future for Fair<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        // SAFETY: `future` is never moved out of `self`; the other fields are not pinned.
        let this = unsafe { self.get_unchecked_mut() };
        // SAFETY: a pin projection to `future`: `this` came from a `Pin<&mut Fair<F>>`, and
        // `future` is never moved out of a `Fair` (no method takes or swaps it; `Drop` touches only
        // `scheduler`, `tenant` and `ticket`), so it stays where it was pinned until it is dropped
        // in place. `Fair` has no manual `Unpin` impl, so it is `Unpin` only when `F` is.
        let future = unsafe { Pin::new_unchecked(&mut this.future) };
        let overdue = this.deadline.is_some_and(|d| Instant::now() >= d);
        if overdue {
            // Past its deadline a request only needs to notice it and stop: no token.
            return future.poll(cx);
        }
        if !this
            .scheduler
            .acquire(&this.tenant, &mut this.ticket, cx.waker())
        {
            return Poll::Pending;
        }
        {
            let mut waker = this.wake.waker.lock().unwrap_or_else(|e| e.into_inner());
            if !waker.will_wake(cx.waker()) {
                *waker = cx.waker().clone();
            }
        }
        this.wake.woken.store(false, Ordering::Relaxed);
        this.wake.polling.store(true, Ordering::Release);
        let catcher = Waker::from(this.wake.clone());
        let started = Instant::now();
        let result = future.poll(&mut Context::from_waker(&catcher));
        let ns = started.elapsed().as_nanos() as f64;
        this.wake.polling.store(false, Ordering::Release);
        let yielded = this.wake.woken.swap(false, Ordering::AcqRel);
        let requeue = (result.is_pending() && yielded).then_some((&mut this.ticket, cx.waker()));
        this.scheduler.release(&this.tenant, ns, requeue);
        result
    }
}

impl<F> Drop for Fair<F> {
    fn drop(&mut self) {
        self.scheduler.leave(&self.tenant, self.ticket.take());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// Yields as wasmtime does at an epoch tick: wakes itself and answers `Pending` once.
    struct Tick(bool);

    impl Future for Tick {
        type Output = ();
        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
            if self.0 {
                return Poll::Ready(());
            }
            self.0 = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }

    /// A future that burns `slice` of CPU per poll for `slices` polls, yielding between.
    async fn busy(slice: Duration, slices: usize, done: Arc<AtomicUsize>) {
        for _ in 0..slices {
            let until = Instant::now() + slice;
            while Instant::now() < until {
                std::hint::spin_loop();
            }
            Tick(false).await;
        }
        done.fetch_add(1, Ordering::Relaxed);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_newcomer_runs_before_a_busy_tenants_queue() {
        let scheduler = FairScheduler::new(1);
        let done = Arc::new(AtomicUsize::new(0));
        let mut hogs = Vec::new();
        for _ in 0..8 {
            let f = scheduler.wrap(
                "hog",
                1,
                None,
                busy(Duration::from_millis(2), 50, done.clone()),
            );
            hogs.push(tokio::spawn(f));
        }
        // Let the hogs build up use.
        tokio::time::sleep(Duration::from_millis(30)).await;
        let finished_before = done.load(Ordering::Relaxed);
        let newcomer = scheduler.wrap(
            "guest",
            1,
            None,
            busy(Duration::from_millis(1), 3, Arc::new(AtomicUsize::new(0))),
        );
        let slices_before = hog_slices(&scheduler);
        newcomer.await;
        let slices_after = hog_slices(&scheduler);
        // Among eight queued busy futures, the newcomer's three slices ran after at most a
        // slice or so of the hog each time, not after the hog's whole queue (8 × 2 ms).
        assert!(
            slices_after - slices_before < 3.0 * 2.0 * 3.0,
            "the hog ran {} ms while the newcomer waited",
            slices_after - slices_before
        );
        assert_eq!(done.load(Ordering::Relaxed), finished_before);
        for hog in hogs {
            hog.abort();
        }
    }

    fn hog_slices(scheduler: &FairScheduler) -> f64 {
        scheduler
            .usage_ms()
            .into_iter()
            .find(|(t, _)| t == "hog")
            .map_or(0.0, |(_, ms)| ms)
    }

    #[tokio::test(flavor = "current_thread")]
    async fn two_busy_tenants_share_evenly_whatever_their_task_counts() {
        let scheduler = FairScheduler::new(1);
        let a_done = Arc::new(AtomicUsize::new(0));
        let b_done = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for _ in 0..6 {
            tasks.push(tokio::spawn(scheduler.wrap(
                "six",
                1,
                None,
                busy(Duration::from_millis(1), 1000, a_done.clone()),
            )));
        }
        tasks.push(tokio::spawn(scheduler.wrap(
            "one",
            1,
            None,
            busy(Duration::from_millis(1), 1000, b_done.clone()),
        )));
        tokio::time::sleep(Duration::from_millis(300)).await;
        let usage: HashMap<_, _> = scheduler.usage_ms().into_iter().collect();
        let (six, one) = (usage["six"], usage["one"]);
        // Equal shares (by decayed use), not 6:1.
        assert!(
            one > six * 0.6 && six > one * 0.6,
            "six tasks used {six} ms, one task {one} ms"
        );
        for task in tasks {
            task.abort();
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_tenant_of_weight_three_gets_three_times_the_cpu_of_one_of_weight_one() {
        // Issue 32: the per-tenant CPU weight (`--cpu-weight`) had no test at any level.
        let scheduler = FairScheduler::new(1);
        let mut tasks = Vec::new();
        for (tenant, weight) in [("light", 1), ("heavy", 3)] {
            for _ in 0..3 {
                tasks.push(tokio::spawn(scheduler.wrap(
                    tenant,
                    weight,
                    None,
                    busy(
                        Duration::from_millis(1),
                        5000,
                        Arc::new(AtomicUsize::new(0)),
                    ),
                )));
            }
        }
        tokio::time::sleep(Duration::from_millis(600)).await;
        let usage: HashMap<_, _> = scheduler.usage_ms().into_iter().collect();
        let (light, heavy) = (usage["light"], usage["heavy"]);
        // Decayed use over weight is what is levelled: heavy ≈ 3 × light.
        let ratio = heavy / light;
        assert!(
            (2.2..=4.0).contains(&ratio),
            "weight 3 used {heavy} ms, weight 1 {light} ms (ratio {ratio})"
        );
        for task in tasks {
            task.abort();
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn dropped_waiters_pass_their_token_on() {
        let scheduler = FairScheduler::new(1);
        let gate = Arc::new(tokio::sync::Notify::new());
        let holder = {
            let gate = gate.clone();
            scheduler.wrap("a", 1, None, async move { gate.notified().await })
        };
        // The holder's first poll takes and returns the token; it waits on the gate.
        let holder = tokio::spawn(holder);
        tokio::task::yield_now().await;
        let waiter = tokio::spawn(scheduler.wrap("b", 1, None, async { 1 }));
        waiter.abort();
        let _ = waiter.await;
        // A later future still gets to run.
        let value = scheduler.wrap("c", 1, None, async { 7 }).await;
        assert_eq!(value, 7);
        gate.notify_one();
        holder.await.unwrap();
        let state = scheduler.lock();
        assert_eq!(state.free, 1);
        assert!(state.granted.is_empty() && state.wakers.is_empty());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_overdue_future_runs_without_a_token() {
        let scheduler = FairScheduler::new(1);
        // Hold the only token from outside.
        let mut ticket = None;
        let waker = futures_noop_waker();
        assert!(scheduler.acquire(&Arc::from("x"), &mut ticket, &waker));
        let past = Instant::now() - Duration::from_millis(1);
        let value = scheduler.wrap("late", 1, Some(past), async { 3 }).await;
        assert_eq!(value, 3);
    }

    fn futures_noop_waker() -> Waker {
        Waker::noop().clone()
    }
}
