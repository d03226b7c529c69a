//! `kiln bench --only http...`: the server's figures, measured against a real `kiln serve`
//! process (this binary, API keys on, rate limit off, JSON request logs to a file) with
//! keep-alive HTTP clients.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{Value, json};

use crate::bench::{micros, summary};
use crate::bench_child::{Spawned, children, spawn};

struct Server {
    process: Spawned,
    base: String,
    key: String,
}

fn start(workers: usize) -> anyhow::Result<Server> {
    let data = tempfile::tempdir()?;
    let key = Command::new(std::env::current_exe()?)
        .args(["keys", "create", "--name", "bench", "--data-dir"])
        .arg(data.path())
        .stderr(Stdio::null())
        .output()?;
    anyhow::ensure!(key.status.success(), "kiln keys create failed");
    let key = String::from_utf8(key.stdout)?.trim().to_owned();
    let data_path = data.path().to_path_buf();
    let process = spawn("serve", data, "/readyz", |command| {
        command
            .args([
                "serve",
                "--rate-limit",
                "0",
                "--max-sandboxes",
                "5000",
                "--max-executions",
                "256",
                "--log-format",
                "json",
                "--workers",
            ])
            .arg(workers.to_string())
            .arg("--data-dir")
            .arg(&data_path);
    })?;
    Ok(Server {
        base: process.base.clone(),
        process,
        key,
    })
}

fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(60))
        .max_idle_connections_per_host(64)
        .build()
}

impl Server {
    fn post(&self, agent: &ureq::Agent, path: &str, body: &Value) -> anyhow::Result<Value> {
        let response = agent
            .post(&format!("{}{path}", self.base))
            .set("authorization", &format!("Bearer {}", self.key))
            .send_json(body)
            .with_context(|| format!("POST {path}"))?;
        Ok(response.into_json()?)
    }

    fn delete(&self, agent: &ureq::Agent, path: &str) -> anyhow::Result<()> {
        agent
            .delete(&format!("{}{path}", self.base))
            .set("authorization", &format!("Bearer {}", self.key))
            .call()
            .with_context(|| format!("DELETE {path}"))?;
        Ok(())
    }

    fn create(&self, agent: &ureq::Agent) -> anyhow::Result<String> {
        let created = self.post(agent, "/api/sandbox", &json!({"image": "python"}))?;
        created["containerId"]
            .as_str()
            .map(str::to_owned)
            .context("no containerId")
    }

    fn exec(&self, agent: &ureq::Agent, id: &str) -> anyhow::Result<()> {
        let body = json!({"containerId": id, "command": ["python", "-c", "print(1+1)"]});
        let reply = self.post(agent, "/api/sandbox/exec", &body)?;
        anyhow::ensure!(reply["stdout"] == "2\n", "unexpected reply {reply}");
        Ok(())
    }

    /// Resident and proportional memory of the server and its workers, bytes.
    fn memory(&self) -> (u64, u64) {
        let mut pids = vec![self.process.pid()];
        pids.extend(children(self.process.pid()));
        let (mut rss, mut pss) = (0, 0);
        for pid in pids {
            let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")) else {
                continue;
            };
            for line in text.lines() {
                let value = || {
                    line.split_whitespace()
                        .nth(1)
                        .and_then(|v| v.parse::<u64>().ok())
                        .unwrap_or(0)
                        * 1024
                };
                if line.starts_with("Rss:") {
                    rss += value();
                } else if line.starts_with("Pss:") {
                    pss += value();
                }
            }
        }
        (rss, pss)
    }
}

fn mib(bytes: u64) -> f64 {
    (bytes as f64 / (1 << 20) as f64 * 10.0).round() / 10.0
}

/// Runs the HTTP measurements `want` selects into `report`.
pub fn run(
    want: &dyn Fn(&str) -> bool,
    explicit: &dyn Fn(&str) -> bool,
    iterations: usize,
    seconds: f64,
    report: &mut serde_json::Map<String, Value>,
) -> anyhow::Result<()> {
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
    let server = start(workers)?;
    let agent = agent();

    if want("http_exec") {
        let id = server.create(&agent)?;
        for _ in 0..20 {
            server.exec(&agent, &id)?;
        }
        let mut samples = Vec::new();
        for _ in 0..iterations {
            let t = Instant::now();
            server.exec(&agent, &id)?;
            samples.push(micros(t.elapsed()));
        }
        report.insert("http_exec_existing_sandbox".into(), summary(samples));
        server.delete(&agent, &format!("/api/sandbox/{id}"))?;
    }

    if want("http_create_exec_delete") {
        let mut samples = Vec::new();
        for i in 0..(iterations / 2).max(20) + 5 {
            let t = Instant::now();
            let id = server.create(&agent)?;
            server.exec(&agent, &id)?;
            server.delete(&agent, &format!("/api/sandbox/{id}"))?;
            if i >= 5 {
                samples.push(micros(t.elapsed()));
            }
        }
        report.insert("http_create_exec_delete".into(), summary(samples));
    }

    if want("http_throughput") {
        let clients = 16;
        let (execs, elapsed) = load(&server, clients, Duration::from_secs_f64(seconds), None)?;
        report.insert(
            "http_exec_throughput".into(),
            json!({
                "clients": clients,
                "seconds": round1(elapsed),
                "execs": execs,
                "per_second": round1(execs as f64 / elapsed),
            }),
        );
    }

    if want("http_idle_sandboxes") {
        report.insert(
            "http_idle_sandboxes".into(),
            idle_sandboxes(&server, &agent)?,
        );
    }
    // Only when named: it takes as long as asked (`--seconds`, e.g. 600).
    if explicit("http_soak") {
        report.insert("http_soak".into(), soak(&server, seconds)?);
    }
    Ok(())
}

/// Memory of the server and its workers before and after 1 000 idle sandboxes.
fn idle_sandboxes(server: &Server, agent: &ureq::Agent) -> anyhow::Result<Value> {
    let count = 1000;
    let before = server.memory();
    let t = Instant::now();
    for _ in 0..count {
        server.create(agent)?;
    }
    let created_in = t.elapsed();
    std::thread::sleep(Duration::from_millis(500));
    let after = server.memory();
    Ok(json!({
        "sandboxes": count,
        "create_ms_each": round1(created_in.as_secs_f64() * 1000.0 / count as f64),
        "rss_mib_before": mib(before.0),
        "rss_mib_after": mib(after.0),
        "pss_mib_after": mib(after.1),
        "note": "server plus all workers; RSS counts pages shared between workers once per process, PSS splits them",
    }))
}

/// Execs from 4 clients for `seconds`, with the memory curve.
fn soak(server: &Server, seconds: f64) -> anyhow::Result<Value> {
    let mut curve = Vec::new();
    let started = Instant::now();
    let sampler = |curve: &mut Vec<Value>, execs: u64| {
        let (rss, pss) = server.memory();
        curve.push(json!({
            "t_s": round1(started.elapsed().as_secs_f64()),
            "execs": execs,
            "rss_mib": mib(rss),
            "pss_mib": mib(pss),
        }));
    };
    let (execs, elapsed) = load(
        server,
        4,
        Duration::from_secs_f64(seconds),
        Some(&mut |execs| sampler(&mut curve, execs)),
    )?;
    Ok(json!({
        "clients": 4,
        "seconds": round1(elapsed),
        "execs": execs,
        "per_second": round1(execs as f64 / elapsed),
        "memory_curve": curve,
    }))
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

/// `clients` threads, each with its own sandbox, exec as fast as they can for `duration`;
/// `sample` is called every 10 s with the count so far. Returns (execs, seconds).
fn load(
    server: &Server,
    clients: usize,
    duration: Duration,
    mut sample: Option<&mut dyn FnMut(u64)>,
) -> anyhow::Result<(u64, f64)> {
    let agent = agent();
    let ids = (0..clients)
        .map(|_| server.create(&agent))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let failed = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    std::thread::scope(|scope| {
        for id in &ids {
            let (done, stop, failed, agent) =
                (done.clone(), stop.clone(), failed.clone(), agent.clone());
            scope.spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match server.exec(&agent, id) {
                        Ok(()) => done.fetch_add(1, Ordering::Relaxed),
                        Err(_) => failed.fetch_add(1, Ordering::Relaxed),
                    };
                }
            });
        }
        let mut next_sample = Duration::ZERO;
        while started.elapsed() < duration {
            if let Some(sample) = sample.as_mut()
                && started.elapsed() >= next_sample
            {
                sample(done.load(Ordering::Relaxed));
                next_sample += Duration::from_secs(10);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        stop.store(true, Ordering::Relaxed);
    });
    let elapsed = started.elapsed().as_secs_f64();
    if let Some(sample) = sample.as_mut() {
        sample(done.load(Ordering::Relaxed));
    }
    let failed = failed.load(Ordering::Relaxed);
    anyhow::ensure!(failed == 0, "{failed} execs failed under load");
    Ok((done.load(Ordering::Relaxed), elapsed))
}
