//! `kiln bench`: the figures kiln promises, measured on this machine, printed as JSON.

use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use kiln_core::{ExecRequest, Language, Limits};
use kiln_executor::{ExecutorPool, PoolConfig};
use kiln_wasm::{CacheDir, SessionOptions, WasmEngine};
use serde_json::json;

use crate::cli::BenchArgs;

pub(crate) fn summary(mut samples_us: Vec<f64>) -> serde_json::Value {
    samples_us.sort_by(|a, b| a.total_cmp(b));
    let pick = |q: f64| {
        let at = ((samples_us.len() as f64 - 1.0) * q).round() as usize;
        samples_us[at] / 1000.0
    };
    json!({
        "n": samples_us.len(),
        "median_ms": round3(pick(0.5)),
        "p90_ms": round3(pick(0.9)),
        "p95_ms": round3(pick(0.95)),
        "min_ms": round3(pick(0.0)),
        "max_ms": round3(pick(1.0)),
    })
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

pub(crate) fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn private_memory_bytes() -> anyhow::Result<u64> {
    let text =
        std::fs::read_to_string("/proc/self/smaps_rollup").context("reading smaps_rollup")?;
    let mut kib = 0u64;
    for line in text.lines() {
        if line.starts_with("Private_Clean:") || line.starts_with("Private_Dirty:") {
            kib += line
                .split_whitespace()
                .nth(1)
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    Ok(kib * 1024)
}

pub fn run(args: BenchArgs) -> anyhow::Result<ExitCode> {
    let cache = CacheDir::from_env();
    let engine = WasmEngine::new(cache.clone())?;
    let progress = crate::progress::Bar::new();
    for language in Language::ALL {
        engine.prepare(language, &progress)?;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let want = |name: &str| {
        args.only
            .as_deref()
            .is_none_or(|only| only.split(',').any(|o| name.starts_with(o)))
    };
    let n = args.iterations.max(5);
    let mut report = serde_json::Map::new();
    report.insert(
        "machine_cpus".into(),
        json!(std::thread::available_parallelism().map_or(0, |n| n.get())),
    );

    rt.block_on(async {
        // Fresh-sandbox Python with a workspace folder (what `kiln serve` runs).
        if want("python_oneshot_workspace") {
            let workspace = tempfile::tempdir()?;
            let mut request = ExecRequest::new(Language::Python, "print(1+1)");
            request.workspace = Some(workspace.path().to_path_buf());
            for _ in 0..10 {
                engine.execute(&request).await?;
            }
            let mut samples = Vec::with_capacity(n);
            for _ in 0..n {
                let t = Instant::now();
                let result = engine.execute(&request).await?;
                samples.push(micros(t.elapsed()));
                anyhow::ensure!(result.stdout == b"2\n", "unexpected output");
            }
            report.insert("python_oneshot_workspace".into(), summary(samples));
        }
        // Fresh-sandbox Python through the engine API.
        if want("python_oneshot_engine") {
            let request = ExecRequest::new(Language::Python, "print(1+1)");
            for _ in 0..10 {
                engine.execute(&request).await?;
            }
            let mut samples = Vec::with_capacity(n);
            for _ in 0..n {
                let t = Instant::now();
                let result = engine.execute(&request).await?;
                samples.push(micros(t.elapsed()));
                anyhow::ensure!(
                    result.stdout == b"2\n",
                    "unexpected output {:?}",
                    result.stdout_text()
                );
            }
            report.insert("python_oneshot_engine".into(), summary(samples));
            // Page-fault traps per one-shot (each costs microseconds on a virtualised host;
            // pages populated in bulk with madvise are not counted here).
            let faults = || {
                // SAFETY: getrusage fills the struct we pass; all-zero is a valid rusage.
                let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
                // SAFETY: as above; RUSAGE_SELF needs no other argument.
                unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
                usage.ru_minflt
            };
            let before = faults();
            for _ in 0..50 {
                engine.execute(&request).await?;
            }
            report.insert(
                "python_oneshot_fault_traps".into(),
                json!({"each": (faults() - before) / 50}),
            );
        }
        // JavaScript one-shot.
        if want("javascript_oneshot") {
            let js = ExecRequest::new(Language::JavaScript, "console.log(1+1)");
            for _ in 0..10 {
                engine.execute(&js).await?;
            }
            let mut samples = Vec::with_capacity(n);
            for _ in 0..n {
                let t = Instant::now();
                let result = engine.execute(&js).await?;
                samples.push(micros(t.elapsed()));
                anyhow::ensure!(
                    result.stdout == b"2\n",
                    "unexpected output {:?}",
                    result.stdout_text()
                );
            }
            report.insert("javascript_oneshot_engine".into(), summary(samples));
        }
        // Python session turn.
        if want("python_session") {
            let mut session = engine
                .open_session(Language::Python, &SessionOptions::default())
                .await?;
            let limits = Limits::default();
            session.run("x = 0", &limits).await?;
            let mut samples = Vec::with_capacity(n * 10);
            for _ in 0..n * 10 {
                let t = Instant::now();
                session.run("x += 1", &limits).await?;
                samples.push(micros(t.elapsed()));
            }
            report.insert("python_session_turn".into(), summary(samples));
        }
        // JavaScript session turn.
        if want("javascript_session") {
            let mut session = engine
                .open_session(Language::JavaScript, &SessionOptions::default())
                .await?;
            session.run("var x = 0", &Limits::default()).await?;
            let mut samples = Vec::with_capacity(n * 10);
            for _ in 0..n * 10 {
                let t = Instant::now();
                session.run("x += 1", &Limits::default()).await?;
                samples.push(micros(t.elapsed()));
            }
            report.insert("javascript_session_turn".into(), summary(samples));
        }
        // Idle Python sessions: private memory each.
        if want("python_idle") {
            let before = private_memory_bytes()?;
            let mut sessions = Vec::with_capacity(args.sessions);
            for i in 0..args.sessions {
                let mut s = engine
                    .open_session(Language::Python, &SessionOptions::default())
                    .await?;
                s.run(&format!("x = {i}"), &Limits::default()).await?;
                sessions.push(s);
            }
            let after = private_memory_bytes()?;
            let each = (after.saturating_sub(before)) as f64 / args.sessions.max(1) as f64;
            report.insert(
                "python_idle_session_private_mib".into(),
                json!({"sessions": args.sessions, "each_mib": round3(each / (1 << 20) as f64)}),
            );
            drop(sessions);
        }
        // Through executor workers.
        let request = ExecRequest::new(Language::Python, "print(1+1)");
        if want("python_oneshot_worker") || want("python_oneshot_throughput") {
            let config = PoolConfig::current_exe()?;
            let workers = config.workers;
            let pool = Arc::new(ExecutorPool::new(config));
            pool.start_all()?;
            for _ in 0..20 {
                pool.execute(request.clone()).await?;
            }
            let mut samples = Vec::with_capacity(n);
            for _ in 0..n {
                let t = Instant::now();
                let result = pool.execute(request.clone()).await?;
                samples.push(micros(t.elapsed()));
                anyhow::ensure!(result.stdout == b"2\n", "unexpected output");
            }
            report.insert("python_oneshot_worker".into(), summary(samples));

            // Throughput: one-shots through the pool, several in flight per worker.
            let deadline = Instant::now() + Duration::from_secs_f64(args.seconds);
            let mut tasks = Vec::new();
            for _ in 0..workers * 4 {
                let pool = pool.clone();
                let request = request.clone();
                tasks.push(tokio::spawn(async move {
                    let mut done = 0u64;
                    while Instant::now() < deadline {
                        if pool.execute(request.clone()).await.is_ok() {
                            done += 1;
                        }
                    }
                    done
                }));
            }
            let started = Instant::now();
            let mut total = 0;
            for task in tasks {
                total += task.await?;
            }
            let per_second = total as f64 / started.elapsed().as_secs_f64();
            report.insert(
                "python_oneshot_throughput".into(),
                json!({"workers": workers, "per_second": per_second.round()}),
            );
        }
        anyhow::Ok(())
    })?;

    // The CLI as a whole process, warm cache.
    if want("cli") {
        let exe = std::env::current_exe()?;
        let mut samples = Vec::new();
        for i in 0..(n / 10).max(10) + 2 {
            let t = Instant::now();
            let status = Command::new(&exe)
                .args(["exec", "--lang", "python", "-c", "print(1)"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .status()?;
            anyhow::ensure!(status.success(), "kiln exec failed: {status}");
            if i >= 2 {
                samples.push(micros(t.elapsed()));
            }
        }
        report.insert("cli_exec_python_process".into(), summary(samples));
    }

    // The HTTP server, as a separate process.
    let explicit = |name: &str| {
        args.only
            .as_deref()
            .is_some_and(|only| only.split(',').any(|o| name.starts_with(o)))
    };
    let http = args.only.as_deref().is_none_or(|only| {
        only.split(',')
            .any(|o| o.starts_with("http") || "http".starts_with(o))
    });
    if http {
        crate::bench_http::run(&want, &explicit, n, args.seconds, &mut report)?;
    }
    let rest_wanted = args.only.as_deref().is_none_or(|only| {
        only.split(',')
            .any(|o| o.starts_with("rest") || "rest".starts_with(o))
    });
    if rest_wanted {
        let rest = |name: &str| want(name) || explicit("rest");
        crate::bench_rest::run(&rest, n, args.seconds, &mut report)?;
    }
    if explicit("history_scale") || explicit("history_mixed_load") {
        crate::bench_history::run(&explicit, n, args.seconds, &mut report)?;
    }
    if explicit("fair_share") || explicit("frozen_worker") || explicit("memory_return") {
        crate::bench_fair::run(&explicit, n, &mut report)?;
    }
    if explicit("rest_crud_soak") {
        crate::bench_rest::soak("rest_crud_soak", 8, args.seconds, &mut report)?;
    }
    if explicit("rest_read_mostly_soak") {
        crate::bench_rest::soak("rest_read_mostly_soak", 40, args.seconds, &mut report)?;
    }
    if explicit("runner_jit") {
        crate::bench_runner::run(&explicit, n, &mut report)?;
    }
    if want("agent_tool_round_trip") || want("chat_first_event") {
        #[cfg(feature = "bench-llm")]
        crate::bench_agent::run(&want, n, &mut report)?;
        #[cfg(not(feature = "bench-llm"))]
        for name in ["agent_tool_round_trip", "chat_first_event"] {
            report.insert(name.into(), needs_bench_llm());
        }
    }

    println!(
        "{}",
        serde_json::to_string_pretty(&serde_json::Value::Object(report))?
    );
    Ok(ExitCode::SUCCESS)
}

/// What a figure that needs a model provider reports in a build without one.
#[cfg(not(feature = "bench-llm"))]
pub fn needs_bench_llm() -> serde_json::Value {
    serde_json::json!({
        "skipped": "needs a model provider: build with `cargo build --release --features bench-llm` (benchmark builds only)"
    })
}
