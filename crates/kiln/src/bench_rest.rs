//! `kiln bench --only rest`: `kiln rest`'s figures against a real `kiln rest` process (this
//! binary, JSON logs to a file, one tenant) with keep-alive HTTP clients.
//!
//! - `rest_cached_get`: GET /members/{id} answered from the plan cache, one client.
//! - `rest_cached_get_throughput`: the same from 8 clients at once, requests per second.
//! - `rest_uncached_conventions`: the plan cache off; each request planned by the
//!   conventions planner and run (one sandbox turn).
//! - `rest_uncached_llm_path`: the plan cache off; each request planned through the door by
//!   the LLM planner, whose provider is a local test server answering at once: what kiln
//!   adds around a model (prompt, door, two turns, checks), the provider's own time included.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
#[cfg(feature = "bench-llm")]
use kiln_llm::fake::{FakeProvider, Step};
use serde_json::{Value, json};

use crate::bench::{micros, summary};
use crate::bench_child::{Spawned, children, rss_mib, spawn};

fn start(args: &[&str], env: &[(&str, String)]) -> anyhow::Result<Spawned> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    spawn("rest", dir, "/healthz", |command| {
        command
            .arg("rest")
            .arg("--data-dir")
            .arg(&data)
            .args(args)
            .env_remove("KILN_LLM_MODEL")
            .env_remove("AUTH_TOKEN");
        for (k, v) in env {
            command.env(k, v);
        }
    })
}

fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(60))
        .max_idle_connections_per_host(64)
        .build()
}

fn get(agent: &ureq::Agent, url: &str) -> anyhow::Result<Value> {
    let response = agent
        .get(url)
        .call()
        .with_context(|| format!("GET {url}"))?;
    Ok(response.into_json()?)
}

/// Fills /members with `n` objects.
fn seed(rest: &Spawned, agent: &ureq::Agent, n: usize) -> anyhow::Result<()> {
    for i in 0..n {
        agent
            .post(&format!("{}/members/", rest.base))
            .send_json(json!({"name": format!("member {i}"), "n": i}))
            .context("seeding")?;
    }
    Ok(())
}

/// Median latency of GET /members/{id} over `n` requests.
fn latency(rest: &Spawned, agent: &ureq::Agent, n: usize) -> anyhow::Result<Value> {
    for i in 0..10 {
        get(agent, &format!("{}/members/{}", rest.base, i % 20 + 1))?;
    }
    let mut samples = Vec::with_capacity(n);
    for i in 0..n {
        let url = format!("{}/members/{}", rest.base, i % 20 + 1);
        let t = Instant::now();
        let body = get(agent, &url)?;
        samples.push(micros(t.elapsed()));
        anyhow::ensure!(body["n"] == json!(i % 20), "unexpected body {body}");
    }
    Ok(summary(samples))
}

pub fn run(
    want: &dyn Fn(&str) -> bool,
    n: usize,
    seconds: f64,
    report: &mut serde_json::Map<String, Value>,
) -> anyhow::Result<()> {
    let agent = agent();
    if want("rest_cached_get") {
        let rest = start(&["--planner", "conventions"], &[])?;
        seed(&rest, &agent, 20)?;
        report.insert("rest_cached_get".into(), latency(&rest, &agent, n)?);
        if want("rest_cached_get_throughput") {
            let figure = cached_get_throughput(&rest, seconds)?;
            report.insert("rest_cached_get_throughput".into(), figure);
        }
    }
    if want("rest_uncached_conventions") {
        let rest = start(&["--planner", "conventions", "--no-plan-cache"], &[])?;
        seed(&rest, &agent, 20)?;
        report.insert(
            "rest_uncached_conventions".into(),
            latency(&rest, &agent, n)?,
        );
    }
    #[cfg(not(feature = "bench-llm"))]
    if want("rest_uncached_llm_path") {
        report.insert(
            "rest_uncached_llm_path".into(),
            crate::bench::needs_bench_llm(),
        );
    }
    #[cfg(feature = "bench-llm")]
    if want("rest_uncached_llm_path") {
        report.insert("rest_uncached_llm_path".into(), llm_path(&agent, n)?);
    }
    Ok(())
}

/// Cached GETs a second from 8 clients, over `seconds` (2 to 60).
fn cached_get_throughput(rest: &Spawned, seconds: f64) -> anyhow::Result<Value> {
    let clients = 8;
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let window = Duration::from_secs_f64(seconds.clamp(2.0, 60.0));
    let handles: Vec<_> = (0..clients)
        .map(|c| {
            let (stop, done, base) = (stop.clone(), done.clone(), rest.base.clone());
            std::thread::spawn(move || -> anyhow::Result<()> {
                let agent = self::agent();
                let mut i = c;
                while !stop.load(Ordering::Relaxed) {
                    get(&agent, &format!("{base}/members/{}", i % 20 + 1))?;
                    done.fetch_add(1, Ordering::Relaxed);
                    i += clients;
                }
                Ok(())
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let (start, t) = (done.load(Ordering::Relaxed), Instant::now());
    std::thread::sleep(window);
    let count = done.load(Ordering::Relaxed) - start;
    let elapsed = t.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        h.join()
            .map_err(|_| anyhow::anyhow!("a client panicked"))??;
    }
    Ok(
        json!({"clients": clients, "seconds": elapsed, "requests": count, "per_second": (count as f64 / elapsed).round()}),
    )
}

/// Uncached requests through the LLM planner (a provider test server answering at once).
#[cfg(feature = "bench-llm")]
fn llm_path(agent: &ureq::Agent, n: usize) -> anyhow::Result<Value> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let fake = rt.block_on(FakeProvider::start(vec![]))?;
    let create = "body = ctx['body']\nnew_id = store.collection('members').insert(body)\nREPLY = {'status': 201, 'headers': {}, 'body': store.collection('members').get(new_id)}";
    let read = "item = store.collection('members').get(ctx['segments'][1])\nREPLY = {'status': 200 if item else 404, 'headers': {}, 'body': item}";
    let plan = |code: &str| {
        json!({"action": "read", "resource": "members", "id": null, "criteria": {}, "payload": null,
               "response_hints": {}, "cache": {"generic": false, "pattern": null},
               "code": {"language": "python", "block": format!("```python\n{code}\n```")}})
        .to_string()
    };
    let env = [
        ("KILN_LLM_MODEL", "openai-compatible:bench".to_string()),
        ("KILN_LLM_BASE_URL", fake.base_url.clone()),
    ];
    let rest = start(&["--planner", "llm", "--no-plan-cache"], &env)?;
    fake.repeat(Step::Text(plan(create)));
    seed(&rest, agent, 20)?;
    fake.repeat(Step::Text(plan(read)));
    let figure = latency(&rest, agent, n)?;
    drop(rest);
    drop(rt);
    Ok(figure)
}

/// One soak client: create, read `reads` times, replace, delete, until `stop`; counts
/// requests of whole rounds in `done` and failed rounds in `failed`.
fn crud_rounds(
    client: usize,
    reads: u64,
    base: &str,
    stop: &AtomicBool,
    done: &AtomicU64,
    failed: &AtomicU64,
) {
    let agent = self::agent();
    let mut i: u64 = 0;
    while !stop.load(Ordering::Relaxed) {
        i += 1;
        let name = format!("c{client} n{i}");
        let step = || -> anyhow::Result<()> {
            let created: Value = agent
                .post(&format!("{base}/members/"))
                .send_json(json!({"name": name, "n": i}))?
                .into_json()?;
            let id = created["id"].to_string();
            for _ in 0..reads {
                get(&agent, &format!("{base}/members/{id}"))?;
            }
            agent
                .put(&format!("{base}/members/{id}"))
                .send_json(json!({"name": name, "n": i + 1}))?;
            agent.delete(&format!("{base}/members/{id}")).call()?;
            Ok(())
        };
        match step() {
            Ok(()) => done.fetch_add(reads + 3, Ordering::Relaxed),
            Err(_) => failed.fetch_add(1, Ordering::Relaxed),
        };
    }
}

/// `rest_crud_soak` and `rest_read_mostly_soak` (only when named): 8 clients create, read
/// (`reads` times), replace and delete members of one tenant as fast as they can for
/// `seconds`, with plans cached; the worker processes' resident memory is sampled every
/// 10 s. Flat memory means nothing grows per request (each request is a session turn).
pub fn soak(
    name: &str,
    reads: u64,
    seconds: f64,
    report: &mut serde_json::Map<String, Value>,
) -> anyhow::Result<()> {
    let rest = start(&["--planner", "conventions"], &[])?;
    let agent = agent();
    seed(&rest, &agent, 20)?;
    let clients = 8;
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let handles: Vec<_> = (0..clients)
        .map(|c| {
            let (stop, done, failed, base) = (
                stop.clone(),
                done.clone(),
                failed.clone(),
                rest.base.clone(),
            );
            std::thread::spawn(move || crud_rounds(c, reads, &base, &stop, &done, &failed))
        })
        .collect();
    let workers = || -> f64 {
        let total: f64 = children(rest.pid()).into_iter().map(rss_mib).sum();
        (total * 10.0).round() / 10.0
    };
    // Ten seconds to warm up (plans cached, pages touched), then the measured window.
    std::thread::sleep(Duration::from_secs(10));
    let (start_count, t) = (done.load(Ordering::Relaxed), Instant::now());
    let mut curve = vec![json!({"t_s": 0, "requests": 0, "workers_rss_mib": workers()})];
    while t.elapsed().as_secs_f64() < seconds {
        std::thread::sleep(Duration::from_secs(10).min(Duration::from_secs_f64(seconds)));
        curve.push(json!({
            "t_s": t.elapsed().as_secs(),
            "requests": done.load(Ordering::Relaxed) - start_count,
            "workers_rss_mib": workers(),
        }));
    }
    let count = done.load(Ordering::Relaxed) - start_count;
    let elapsed = t.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        h.join().map_err(|_| anyhow::anyhow!("a client panicked"))?;
    }
    let rss: Vec<f64> = curve
        .iter()
        .filter_map(|p| p["workers_rss_mib"].as_f64())
        .collect();
    let first = rss.first().copied().unwrap_or(0.0);
    let worst = rss
        .iter()
        .map(|r| (r - first).abs() / first.max(1.0))
        .fold(0.0, f64::max);
    report.insert(
        name.into(),
        json!({
            "clients": clients,
            "reads_per_create_replace_delete": reads,
            "seconds": (elapsed * 10.0).round() / 10.0,
            "requests": count,
            "per_second": (count as f64 / elapsed).round(),
            "failed_rounds": failed.load(Ordering::Relaxed),
            "workers_rss_largest_change_percent": (worst * 1000.0).round() / 10.0,
            "curve": curve,
        }),
    );
    Ok(())
}
