//! `kiln bench --only history_scale,history_mixed_load`: how workspace history costs grow,
//! against a real `kiln serve` (no auth, rate limit off).
//!
//! - `history_scale`: a history listing page (100 entries, and the default 1 000) and a diff
//!   from `initial` to the newest change, at 100 and at 6 000 commits (each commit one
//!   upload of one of ten files, so every diff has at most ten files). Then `pages`: the
//!   first page of 1 000 (`GET /api/v1/sandboxes/{id}/history`), and a page of 1 000 from a
//!   cursor halfway down, at 1 000 and at 50 000 commits, and how the two sizes compare (a
//!   page must cost what its entries cost, whatever the history's length: issue 32 §5).
//!   50 000 uploads through the API would take most of an hour, so that history is written
//!   straight into the sandbox's repository as the server lays one out
//!   (`History::append_uploads_for_bench`), the server idle meanwhile.
//! - `history_mixed_load`: four clients, each with its own sandbox and session, cycle through
//!   a one-shot exec that writes a file, a session turn, an upload, a download and a history
//!   page for `--seconds` (300 for the figure) after a 60-s warm-up; throughput per
//!   10-s window, the first and last compared.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{Value, json};

use crate::bench::{micros, summary};
use crate::bench_child::{Spawned, spawn};

/// A server and its data folder.
fn start() -> anyhow::Result<(Spawned, PathBuf)> {
    let data = tempfile::tempdir()?;
    let data_path = data.path().join("data");
    let server = spawn("serve", data, "/readyz", |command| {
        command
            .args(["serve", "--no-auth", "--rate-limit", "0", "--workers", "2"])
            .arg("--data-dir")
            .arg(&data_path);
    })?;
    Ok((server, data_path))
}

fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(60))
        .max_idle_connections_per_host(16)
        .build()
}

fn post(agent: &ureq::Agent, base: &str, path: &str, body: &Value) -> anyhow::Result<Value> {
    Ok(agent
        .post(&format!("{base}{path}"))
        .send_json(body)
        .with_context(|| format!("POST {path}"))?
        .into_json()?)
}

fn get(agent: &ureq::Agent, base: &str, path: &str) -> anyhow::Result<Vec<u8>> {
    let mut body = Vec::new();
    std::io::Read::read_to_end(
        &mut agent
            .get(&format!("{base}{path}"))
            .call()
            .with_context(|| format!("GET {path}"))?
            .into_reader(),
        &mut body,
    )?;
    Ok(body)
}

fn upload(
    agent: &ureq::Agent,
    base: &str,
    id: &str,
    name: &str,
    bytes: &[u8],
) -> anyhow::Result<()> {
    agent
        .put(&format!("{base}/api/v1/sandboxes/{id}/files/{name}"))
        .set("content-type", "application/octet-stream")
        .send_bytes(bytes)
        .with_context(|| format!("PUT {name}"))?;
    Ok(())
}

fn sandbox(agent: &ureq::Agent, base: &str) -> anyhow::Result<String> {
    let created = post(
        agent,
        base,
        "/api/v1/sandboxes",
        &json!({"language": "python", "timeoutMs": 86_400_000}),
    )?;
    created["containerId"]
        .as_str()
        .map(str::to_owned)
        .context("no containerId")
}

/// Median costs of listing and diffing at the history's current size.
fn measure(agent: &ureq::Agent, base: &str, id: &str, iterations: usize) -> anyhow::Result<Value> {
    let mut page_100 = Vec::new();
    let mut page_1000 = Vec::new();
    let mut diff = Vec::new();
    for _ in 0..iterations {
        let t = Instant::now();
        get(agent, base, &format!("/api/sandbox/{id}/history?limit=100"))?;
        page_100.push(micros(t.elapsed()));
        let t = Instant::now();
        get(agent, base, &format!("/api/sandbox/{id}/history"))?;
        page_1000.push(micros(t.elapsed()));
        let t = Instant::now();
        post(
            agent,
            base,
            &format!("/api/sandbox/{id}/diff"),
            &json!({"fromExecId": "initial"}),
        )?;
        diff.push(micros(t.elapsed()));
    }
    Ok(json!({
        "history_page_100": summary(page_100),
        "history_page_1000": summary(page_1000),
        "diff_from_initial": summary(diff),
    }))
}

/// The sizes `pages` compares.
const PAGE_SCALE_COMMITS: [usize; 2] = [1000, 50_000];

/// A sandbox whose history holds `commits` changes (uploads), made through the API for the
/// first two and written into its repository for the rest.
fn long_history(
    agent: &ureq::Agent,
    base: &str,
    data: &Path,
    commits: usize,
) -> anyhow::Result<String> {
    let id = sandbox(agent, base)?;
    // The first upload makes the history (its initial commit and this one).
    upload(agent, base, &id, "f0.txt", b"0")?;
    let t = Instant::now();
    kiln_runtime::history::History::open(&data.join("sandboxes").join(&id).join("history.git"))?
        .append_uploads_for_bench(2, commits - 2, 100)?;
    eprintln!(
        "history_scale pages: {commits} commits (written in {:.1} s)",
        t.elapsed().as_secs_f64()
    );
    Ok(id)
}

/// Pages through a whole history once (each page then read for the first time), checking
/// it holds `commits` entries; the time and every page's cursor.
fn page_through(
    agent: &ureq::Agent,
    base: &str,
    id: &str,
    commits: usize,
) -> anyhow::Result<(f64, Vec<String>)> {
    let t = Instant::now();
    let mut cursors = Vec::new();
    let mut seen = 0;
    let mut cursor: Option<String> = None;
    loop {
        let path = match &cursor {
            None => format!("/api/v1/sandboxes/{id}/history"),
            Some(c) => format!("/api/v1/sandboxes/{id}/history?cursor={c}"),
        };
        let page: Value = serde_json::from_slice(&get(agent, base, &path)?)?;
        seen += page["history"].as_array().map_or(0, Vec::len);
        // `nextCursor`; servers before issue 32 §5 spelled it `next_cursor` only.
        cursor = page["nextCursor"]
            .as_str()
            .or(page["next_cursor"].as_str())
            .map(str::to_owned);
        match &cursor {
            Some(c) => cursors.push(c.clone()),
            None => break,
        }
    }
    anyhow::ensure!(seen == commits, "paged through {seen} entries of {commits}");
    Ok((t.elapsed().as_secs_f64() * 1000.0, cursors))
}

/// Pages of 1 000 at 1 000 and at 50 000 commits, two sandboxes measured in turn (so both
/// see the same load): the first page (`/api/v1` and the seed route), and at 50 000 a page
/// from a cursor halfway down. Each history is paged through once first, timed: every page
/// then read for the first time; the medians are of pages read again.
fn page_scale(
    agent: &ureq::Agent,
    base: &str,
    data: &Path,
    iterations: usize,
) -> anyhow::Result<Value> {
    let mut sandboxes = Vec::new();
    for commits in PAGE_SCALE_COMMITS {
        let id = long_history(agent, base, data, commits)?;
        let (walk_ms, cursors) = page_through(agent, base, &id, commits)?;
        let middle = cursors.get(cursors.len().saturating_sub(1) / 2).cloned();
        sandboxes.push((commits, id, walk_ms, cursors.len() + 1, middle));
    }
    let mut samples = vec![(Vec::new(), Vec::new(), Vec::new()); sandboxes.len()];
    for _ in 0..iterations {
        for ((_, id, _, _, middle), (first, seed, deep)) in sandboxes.iter().zip(&mut samples) {
            let t = Instant::now();
            get(agent, base, &format!("/api/v1/sandboxes/{id}/history"))?;
            first.push(micros(t.elapsed()));
            let t = Instant::now();
            get(
                agent,
                base,
                &format!("/api/sandbox/{id}/history?limit=1000"),
            )?;
            seed.push(micros(t.elapsed()));
            if let Some(c) = middle {
                let t = Instant::now();
                get(
                    agent,
                    base,
                    &format!("/api/v1/sandboxes/{id}/history?cursor={c}"),
                )?;
                deep.push(micros(t.elapsed()));
            }
        }
    }
    let mut out = serde_json::Map::new();
    let mut medians = Vec::new();
    for ((commits, _, walk_ms, pages, _), (first, seed, deep)) in sandboxes.into_iter().zip(samples)
    {
        let first = summary(first);
        medians.push(first["median_ms"].as_f64().unwrap_or(0.0));
        let mut at = json!({
            "first_page_1000": first,
            "seed_route_first_page_1000": summary(seed),
            "pages": pages,
            "whole_history_paged_ms": (walk_ms * 10.0).round() / 10.0,
            "first_read_page_mean_ms": (walk_ms / pages as f64 * 1000.0).round() / 1000.0,
        });
        if !deep.is_empty() {
            at["middle_page_1000"] = summary(deep);
        }
        out.insert(format!("commits_{commits}"), at);
    }
    if let [small, large] = medians[..]
        && small > 0.0
    {
        out.insert(
            "first_page_50000_over_1000".into(),
            json!((large / small * 1000.0).round() / 1000.0),
        );
    }
    Ok(Value::Object(out))
}

/// Runs the history measurements named in `explicit` into `report`.
pub fn run(
    explicit: &dyn Fn(&str) -> bool,
    iterations: usize,
    seconds: f64,
    report: &mut serde_json::Map<String, Value>,
) -> anyhow::Result<()> {
    let (server, data) = start()?;
    let base = server.base.clone();
    let agent = agent();
    if explicit("history_scale") {
        let pages = page_scale(&agent, &base, &data, iterations.clamp(20, 100))?;
        let id = sandbox(&agent, &base)?;
        let iterations = iterations.clamp(5, 50);
        let mut commits = 1;
        let mut at = serde_json::Map::new();
        for target in [100, 6000] {
            let t = Instant::now();
            while commits < target {
                upload(
                    &agent,
                    &base,
                    &id,
                    &format!("f{}.txt", commits % 10),
                    commits.to_string().as_bytes(),
                )?;
                commits += 1;
            }
            eprintln!(
                "history_scale: {commits} commits (grown in {:.1} s)",
                t.elapsed().as_secs_f64()
            );
            // Let background packing settle, as a long-lived server would have.
            std::thread::sleep(Duration::from_secs(1));
            at.insert(
                format!("commits_{target}"),
                measure(&agent, &base, &id, iterations)?,
            );
        }
        at.insert("pages".into(), pages);
        report.insert("history_scale".into(), Value::Object(at));
    }
    if explicit("history_mixed_load") {
        report.insert("history_mixed_load".into(), mixed_load(&base, seconds)?);
    }
    Ok(())
}

/// Long enough for the file system to reach its steady state: ext4 avoids reusing inodes
/// deleted in the last 60 s, so file creation slows as deletions (packed loose objects,
/// replaced files and refs) accumulate over the first minute of any write-heavy load, and
/// then holds.
const WARM_UP_SECONDS: u64 = 60;

/// What the mixed-load clients count, shared with the sampler.
#[derive(Default)]
struct Counters {
    stop: AtomicBool,
    done: AtomicU64,
    errors: AtomicU64,
    /// Per operation (exec, session turn, upload, download, history page): count and total
    /// microseconds, to see which one a change in throughput comes from.
    op_count: [AtomicU64; 5],
    op_us: [AtomicU64; 5],
}

/// One mixed-load client: its own sandbox and session; execs, turns, uploads, downloads and
/// history pages in turn until told to stop.
fn mixed_client(client: usize, base: &str, counters: &Counters) -> anyhow::Result<()> {
    let agent = agent();
    let id = sandbox(&agent, base)?;
    let session = post(
        &agent,
        base,
        &format!("/api/v1/sandboxes/{id}/sessions"),
        &json!({}),
    )?;
    let session = session["sessionId"]
        .as_str()
        .context("no sessionId")?
        .to_owned();
    let mut n = 0u64;
    while !counters.stop.load(Ordering::Relaxed) {
        n += 1;
        let op_started = Instant::now();
        let outcome = match n % 5 {
            0 => post(
                &agent,
                base,
                &format!("/api/v1/sandboxes/{id}/exec"),
                &json!({"code": format!("open('out{}.txt','w').write('{client} {n}')", n % 20)}),
            )
            .map(|_| ()),
            1 => post(
                &agent,
                base,
                &format!("/api/v1/sandboxes/{id}/exec"),
                &json!({"code": "x = globals().get('x', 0) + 1", "sessionId": session}),
            )
            .map(|_| ()),
            2 => upload(
                &agent,
                base,
                &id,
                &format!("up{}.txt", n % 20),
                n.to_string().as_bytes(),
            ),
            3 => get(
                &agent,
                base,
                &format!("/api/v1/sandboxes/{id}/files/up{}.txt", (n + 19) % 20),
            )
            .map(|_| ()),
            _ => get(
                &agent,
                base,
                &format!("/api/sandbox/{id}/history?limit=100"),
            )
            .map(|_| ()),
        };
        let op = (n % 5) as usize;
        counters.op_count[op].fetch_add(1, Ordering::Relaxed);
        counters.op_us[op].fetch_add(op_started.elapsed().as_micros() as u64, Ordering::Relaxed);
        match outcome {
            Ok(()) => counters.done.fetch_add(1, Ordering::Relaxed),
            Err(_) => counters.errors.fetch_add(1, Ordering::Relaxed),
        };
    }
    Ok(())
}

fn mixed_load(base: &str, seconds: f64) -> anyhow::Result<Value> {
    let clients = 4;
    let counters = Arc::new(Counters::default());
    let threads: Vec<_> = (0..clients)
        .map(|client| {
            let (base, counters) = (base.to_owned(), counters.clone());
            std::thread::spawn(move || mixed_client(client, &base, &counters))
        })
        .collect();
    let Counters {
        stop,
        done,
        errors,
        op_count,
        op_us,
    } = &*counters;
    // Warm-up: every client's sandbox, session and 40 files exist before the clock starts, so
    // the first window does the same work as the last one, with a short history (about 800
    // commits per sandbox, against 4 000 at the end).
    std::thread::sleep(Duration::from_secs(WARM_UP_SECONDS));
    let started = Instant::now();
    let mut windows = Vec::new();
    let mut last = done.load(Ordering::Relaxed);
    let snapshot = || -> [(u64, u64); 5] {
        std::array::from_fn(|i| {
            (
                op_count[i].load(Ordering::Relaxed),
                op_us[i].load(Ordering::Relaxed),
            )
        })
    };
    let mut last_ops = snapshot();
    let mut op_windows: Vec<Value> = Vec::new();
    while started.elapsed().as_secs_f64() < seconds {
        std::thread::sleep(Duration::from_secs(10).min(Duration::from_secs_f64(seconds.max(1.0))));
        let now = done.load(Ordering::Relaxed);
        windows.push((now - last) as f64 / 10.0);
        last = now;
        let ops = snapshot();
        let mean_ms: Vec<f64> = (0..5)
            .map(|i| {
                let (n, us) = (ops[i].0 - last_ops[i].0, ops[i].1 - last_ops[i].1);
                if n == 0 {
                    0.0
                } else {
                    (us as f64 / n as f64 / 10.0).round() / 100.0
                }
            })
            .collect();
        op_windows.push(json!(mean_ms));
        last_ops = ops;
    }
    stop.store(true, Ordering::Relaxed);
    for thread in threads {
        thread
            .join()
            .map_err(|_| anyhow::anyhow!("a client panicked"))??;
    }
    let first = windows.first().copied().unwrap_or(0.0);
    let final_window = windows.last().copied().unwrap_or(0.0);
    Ok(json!({
        "clients": clients,
        "warm_up_seconds": WARM_UP_SECONDS,
        "seconds": (started.elapsed().as_secs_f64() * 10.0).round() / 10.0,
        "requests": done.load(Ordering::Relaxed),
        "errors": errors.load(Ordering::Relaxed),
        "per_second_by_10s_window": windows,
        "mean_ms_by_10s_window": {
            "ops": ["exec_writing_a_file", "session_turn", "upload", "download", "history_page_100"],
            "windows": op_windows,
        },
        "first_10s_per_second": first,
        "last_10s_per_second": final_window,
        "last_over_first": if first > 0.0 { (final_window / first * 1000.0).round() / 1000.0 } else { 0.0 },
    }))
}
