//! `kiln bench --only fair_share,frozen_worker,memory_return`: how `kiln serve` shares its
//! workers between tenants, against a real server process with two API keys (two tenants).
//! Only run when named: each takes tens of seconds.
//!
//! - `fair_share`: another tenant's `print(1)` while one tenant runs 8 busy loops.
//! - `frozen_worker`: execs while one worker is stopped (SIGSTOP), and how far a 3-s deadline
//!   overruns when the worker running it is stopped.
//! - `memory_return`: worker memory before a 100-way burst, right after it, and each second
//!   after, until it is back within 25 % (or 60 s pass).
//! - `session_memory_return`: worker memory before four sandboxes' pandas sessions, with
//!   them, and each second after the sandboxes are deleted, until it is back within 25 %.
//! - `tenant_burst`: a 200-way burst of one tenant's one-shots (200 sandboxes, the default
//!   executions quota of 16: the rest wait in the tenant's line), its errors and how long it
//!   took, and a second tenant's `print(1)` while it runs.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{Value, json};

use crate::bench::{micros, summary};
use crate::bench_child::{Spawned, children, rss_mib, spawn};

struct Server {
    process: Spawned,
    base: String,
    keys: Vec<String>,
}

/// A server with one key per entry of `keys` (each its own tenant, with those extra
/// `kiln keys create` flags).
fn start(workers: usize, keys: &[&[&str]]) -> anyhow::Result<Server> {
    let data = tempfile::tempdir()?;
    let mut made = Vec::new();
    for (i, flags) in keys.iter().enumerate() {
        let out = Command::new(std::env::current_exe()?)
            .args(["keys", "create", "--name"])
            .arg(format!("bench{i}"))
            .args(*flags)
            .arg("--data-dir")
            .arg(data.path())
            .stderr(Stdio::null())
            .output()?;
        anyhow::ensure!(out.status.success(), "kiln keys create failed");
        made.push(String::from_utf8(out.stdout)?.trim().to_owned());
    }
    let data_path = data.path().to_path_buf();
    let process = spawn("serve", data, "/readyz", |command| {
        command
            .args(["serve", "--rate-limit", "0", "--log-format", "json"])
            .arg("--workers")
            .arg(workers.to_string())
            .arg("--data-dir")
            .arg(&data_path);
    })?;
    Ok(Server {
        base: process.base.clone(),
        process,
        keys: made,
    })
}

fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(120))
        .max_idle_connections_per_host(64)
        .build()
}

impl Server {
    fn post(
        &self,
        agent: &ureq::Agent,
        key: usize,
        path: &str,
        body: &Value,
    ) -> anyhow::Result<Value> {
        let response = agent
            .post(&format!("{}{path}", self.base))
            .set("authorization", &format!("Bearer {}", self.keys[key]))
            .send_json(body)
            .with_context(|| format!("POST {path}"))?;
        Ok(response.into_json()?)
    }

    fn create(&self, agent: &ureq::Agent, key: usize) -> anyhow::Result<String> {
        let created = self.post(
            agent,
            key,
            "/api/v1/sandboxes",
            &json!({"language": "python"}),
        )?;
        created["containerId"]
            .as_str()
            .map(str::to_owned)
            .context("no containerId")
    }

    fn exec(
        &self,
        agent: &ureq::Agent,
        key: usize,
        id: &str,
        code: &str,
        timeout_ms: u64,
    ) -> anyhow::Result<Value> {
        self.post(
            agent,
            key,
            &format!("/api/v1/sandboxes/{id}/exec"),
            &json!({"code": code, "timeoutMs": timeout_ms}),
        )
    }

    fn workers(&self) -> Vec<u32> {
        children(self.process.pid())
    }
}

/// CPU time (user + system, clock ticks) of a process.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or_default();
    let fields: Vec<&str> = after.split_whitespace().collect();
    let field = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    field(11) + field(12)
}

/// Starts `count` busy loops of tenant `key`, each in its own sandbox, for `seconds`.
fn busy_loops(
    server: &Server,
    key: usize,
    count: usize,
    seconds: u64,
) -> anyhow::Result<Vec<std::thread::JoinHandle<()>>> {
    let agent = agent();
    let ids = (0..count)
        .map(|_| server.create(&agent, key))
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(ids
        .into_iter()
        .map(|id| {
            let (agent, base, key) = (agent.clone(), server.base.clone(), server.keys[key].clone());
            std::thread::spawn(move || {
                let _ = agent
                    .post(&format!("{base}/api/v1/sandboxes/{id}/exec"))
                    .set("authorization", &format!("Bearer {key}"))
                    .send_json(json!({"code": "while True: pass", "timeoutMs": seconds * 1000}));
            })
        })
        .collect())
}

/// Runs the measurements `explicit` names into `report`.
pub fn run(
    explicit: &dyn Fn(&str) -> bool,
    iterations: usize,
    report: &mut serde_json::Map<String, Value>,
) -> anyhow::Result<()> {
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
    let agent = agent();
    if explicit("fair_share") {
        report.insert(
            "fair_share".into(),
            fair_share(&agent, workers, iterations)?,
        );
    }
    if explicit("frozen_worker") {
        report.insert(
            "frozen_worker".into(),
            frozen_worker(&agent, workers, iterations)?,
        );
    }
    if explicit("memory_return") {
        report.insert("memory_return".into(), memory_return(&agent, workers)?);
    }
    if explicit("session_memory_return") {
        report.insert(
            "session_memory_return".into(),
            session_memory_return(&agent, workers)?,
        );
    }
    if explicit("tenant_burst") {
        report.insert("tenant_burst".into(), tenant_burst(&agent, workers)?);
    }
    Ok(())
}

/// Another tenant's `print(1)` while 8 busy loops of one tenant run.
fn fair_share(agent: &ureq::Agent, workers: usize, iterations: usize) -> anyhow::Result<Value> {
    let server = start(workers, &[&["--max-executions", "16"], &[]])?;
    let mine = server.create(agent, 1)?;
    for _ in 0..20 {
        server.exec(agent, 1, &mine, "print(1)", 10_000)?;
    }
    let sample = |n: usize| -> anyhow::Result<Vec<f64>> {
        let mut samples = Vec::with_capacity(n);
        for _ in 0..n {
            let t = Instant::now();
            let reply = server.exec(agent, 1, &mine, "print(1)", 10_000)?;
            samples.push(micros(t.elapsed()));
            anyhow::ensure!(reply["stdout"] == "1\n", "unexpected reply {reply}");
        }
        Ok(samples)
    };
    let idle = sample(iterations)?;
    let loops = busy_loops(&server, 0, 8, 120)?;
    // Let the loops start and build up use.
    std::thread::sleep(Duration::from_secs(2));
    let busy = sample(iterations)?;
    let figure = json!({
        "busy_loops_of_other_tenant": 8,
        "workers": workers,
        "print1_idle": summary(idle),
        "print1_while_busy": summary(busy),
    });
    drop(server);
    for handle in loops {
        let _ = handle.join();
    }
    Ok(figure)
}

/// `print(1)` with one worker stopped, and a 3-s deadline whose worker is stopped.
fn frozen_worker(agent: &ureq::Agent, workers: usize, iterations: usize) -> anyhow::Result<Value> {
    let server = start(workers, &[&[]])?;
    let mine = server.create(agent, 0)?;
    for _ in 0..10 {
        server.exec(agent, 0, &mine, "print(1)", 10_000)?;
    }
    let pids = server.workers();
    anyhow::ensure!(pids.len() >= 2, "needs two workers, found {pids:?}");
    // SAFETY: signals to this bench's own server's children.
    unsafe { libc::kill(pids[0] as i32, libc::SIGSTOP) };
    // Routing notices a silent worker after about a second.
    std::thread::sleep(Duration::from_millis(1500));
    let mut samples = Vec::new();
    for _ in 0..iterations.min(50) {
        let t = Instant::now();
        server.exec(agent, 0, &mine, "print(1)", 10_000)?;
        samples.push(micros(t.elapsed()));
    }
    // SAFETY: as above.
    unsafe { libc::kill(pids[0] as i32, libc::SIGCONT) };
    std::thread::sleep(Duration::from_millis(500));
    // A 3-s busy loop whose worker is stopped one second in.
    let before: Vec<u64> = server.workers().iter().map(|&p| cpu_ticks(p)).collect();
    let runner = {
        let (agent, base, key, id) = (
            agent.clone(),
            server.base.clone(),
            server.keys[0].clone(),
            mine.clone(),
        );
        std::thread::spawn(move || {
            let t = Instant::now();
            let reply: Option<Value> = agent
                .post(&format!("{base}/api/v1/sandboxes/{id}/exec"))
                .set("authorization", &format!("Bearer {key}"))
                .send_json(json!({"code": "while True: pass", "timeoutMs": 3000}))
                .ok()
                .and_then(|r| r.into_json().ok());
            (t.elapsed(), reply)
        })
    };
    std::thread::sleep(Duration::from_millis(1000));
    let now = server.workers();
    let busiest = now
        .iter()
        .zip(before.iter().chain(std::iter::repeat(&0)))
        .max_by_key(|(p, b)| cpu_ticks(**p).saturating_sub(**b))
        .map(|(p, _)| *p)
        .context("no worker")?;
    // SAFETY: as above.
    unsafe { libc::kill(busiest as i32, libc::SIGSTOP) };
    let (took, reply) = runner
        .join()
        .map_err(|_| anyhow::anyhow!("runner panicked"))?;
    // SAFETY: as above (it may already be dead: killed by the pool).
    unsafe { libc::kill(busiest as i32, libc::SIGCONT) };
    let figure = json!({
        "print1_with_one_worker_stopped": summary(samples),
        "deadline_ms": 3000,
        "answered_after_ms": (took.as_secs_f64() * 1000.0).round(),
        "overrun_ms": (took.as_secs_f64() * 1000.0 - 3000.0).round(),
        "status": reply.as_ref().map(|r| r["status"].clone()),
    });
    Ok(figure)
}

/// Worker memory after a 100-way numpy burst, sampled each second until it is back.
fn memory_return(agent: &ureq::Agent, workers: usize) -> anyhow::Result<Value> {
    let server = start(
        workers,
        &[&["--max-executions", "200", "--max-sandboxes", "200"]],
    )?;
    let ids = (0..100)
        .map(|_| server.create(agent, 0))
        .collect::<anyhow::Result<Vec<_>>>()?;
    server.exec(agent, 0, &ids[0], "print(1)", 10_000)?;
    std::thread::sleep(Duration::from_secs(2));
    let worker_rss = || -> Vec<f64> { server.workers().into_iter().map(rss_mib).collect() };
    let baseline = worker_rss();
    std::thread::scope(|scope| {
        for id in &ids {
            let (server, agent) = (&server, agent.clone());
            scope.spawn(move || {
                let _ = server.exec(
                    &agent,
                    0,
                    id,
                    "import numpy as np\nprint(np.arange(1000000).sum())",
                    60_000,
                );
            });
        }
    });
    let after_burst = worker_rss();
    let idle_from = Instant::now();
    let mut curve = Vec::new();
    let mut back_after = None;
    while idle_from.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_secs(1));
        let now = worker_rss();
        let total: f64 = now.iter().sum();
        curve.push(json!({"t_s": idle_from.elapsed().as_secs(), "workers_rss_mib": now}));
        if back_after.is_none() && total <= baseline.iter().sum::<f64>() * 1.25 {
            back_after = Some(idle_from.elapsed().as_secs());
            break;
        }
    }
    let figure = json!({
        "burst": 100,
        "workers_rss_mib_baseline": baseline,
        "workers_rss_mib_after_burst": after_burst,
        "within_25_percent_after_s": back_after,
        "curve": curve,
    });
    Ok(figure)
}

/// A 200-way burst of one tenant (default quotas), and another tenant's `print(1)` meanwhile.
fn tenant_burst(agent: &ureq::Agent, workers: usize) -> anyhow::Result<Value> {
    const BURST: usize = 200;
    let server = start(workers, &[&[], &[]])?;
    let ids = (0..BURST)
        .map(|_| server.create(agent, 0))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mine = server.create(agent, 1)?;
    for _ in 0..20 {
        server.exec(agent, 1, &mine, "print(1)", 10_000)?;
    }
    let running = std::sync::atomic::AtomicBool::new(true);
    let started = Instant::now();
    let (outcomes, other) = std::thread::scope(|scope| {
        let other = scope.spawn(|| {
            let mut samples = Vec::new();
            let mut failed = 0;
            while running.load(std::sync::atomic::Ordering::Relaxed) {
                let t = Instant::now();
                match server.exec(agent, 1, &mine, "print(1)", 10_000) {
                    Ok(reply) if reply["stdout"] == "1\n" => samples.push(micros(t.elapsed())),
                    _ => failed += 1,
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            (samples, failed)
        });
        let burst: Vec<_> = ids
            .iter()
            .map(|id| {
                let server = &server;
                scope.spawn(move || {
                    let t = Instant::now();
                    let reply = server.exec(&self::agent(), 0, id, "print(1)", 60_000);
                    (reply, t.elapsed())
                })
            })
            .collect();
        let outcomes: Vec<_> = burst.into_iter().filter_map(|h| h.join().ok()).collect();
        running.store(false, std::sync::atomic::Ordering::Relaxed);
        (outcomes, other.join())
    });
    let took = started.elapsed();
    let errors = outcomes
        .iter()
        .filter(|(reply, _)| !matches!(reply, Ok(r) if r["stdout"] == "1\n"))
        .count();
    let latencies: Vec<f64> = outcomes.iter().map(|(_, t)| micros(*t)).collect();
    let (samples, other_failed) = other.map_err(|_| anyhow::anyhow!("sampler panicked"))?;
    anyhow::ensure!(!samples.is_empty(), "the other tenant got no answer");
    Ok(json!({
        "burst": BURST,
        "workers": workers,
        "errors": errors,
        "burst_wall_ms": (took.as_secs_f64() * 1000.0).round(),
        "burst_request": summary(latencies),
        "other_tenant_print1": summary(samples),
        "other_tenant_errors": other_failed,
    }))
}

/// Worker memory before, with and after four sandboxes' pandas sessions (deleted, as the
/// reaper does at the end of their lifetime), sampled each second until back within 25 %.
fn session_memory_return(agent: &ureq::Agent, workers: usize) -> anyhow::Result<Value> {
    let server = start(workers, &[&[]])?;
    // Every worker answers once (at once, so each gets one) and settles: warm.
    let warm = (0..workers * 2)
        .map(|_| server.create(agent, 0))
        .collect::<anyhow::Result<Vec<_>>>()?;
    std::thread::scope(|scope| {
        for id in &warm {
            let server = &server;
            scope.spawn(move || server.exec(agent, 0, id, "print(1)", 10_000));
        }
    });
    std::thread::sleep(Duration::from_secs(3));
    let worker_rss = || -> Vec<f64> { server.workers().into_iter().map(rss_mib).collect() };
    let baseline = worker_rss();
    let mut ids = Vec::new();
    for _ in 0..4 {
        let id = server.create(agent, 0)?;
        for _ in 0..2 {
            let opened = server.post(
                agent,
                0,
                &format!("/api/v1/sandboxes/{id}/sessions"),
                &json!({}),
            )?;
            let session = opened["sessionId"].as_str().context("no sessionId")?;
            let ran = server.post(
                agent,
                0,
                &format!("/api/v1/sandboxes/{id}/exec"),
                &json!({"sessionId": session, "timeoutMs": 60_000, "code":
                    "import pandas as pd\ndf = pd.DataFrame({'a': range(200000)})\nprint(int(df.a.sum()))"}),
            )?;
            anyhow::ensure!(ran["stdout"] == "19999900000\n", "unexpected {ran}");
        }
        ids.push(id);
    }
    let with_sessions = worker_rss();
    for id in &ids {
        agent
            .delete(&format!("{}/api/v1/sandboxes/{id}", server.base))
            .set("authorization", &format!("Bearer {}", server.keys[0]))
            .call()?;
    }
    let idle_from = Instant::now();
    let limit = baseline.iter().sum::<f64>() * 1.25;
    let mut curve = Vec::new();
    let mut back_after = None;
    while idle_from.elapsed() < Duration::from_secs(45) {
        std::thread::sleep(Duration::from_secs(1));
        let now = worker_rss();
        curve.push(json!({"t_s": idle_from.elapsed().as_secs(), "workers_rss_mib": now}));
        if now.iter().sum::<f64>() <= limit {
            back_after = Some(idle_from.elapsed().as_secs());
            break;
        }
    }
    Ok(json!({
        "sessions": 8,
        "workers_rss_mib_baseline": baseline,
        "workers_rss_mib_with_sessions": with_sessions,
        "within_25_percent_after_s": back_after,
        "curve": curve,
    }))
}
