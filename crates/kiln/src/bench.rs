//! `kiln bench`: the figures kiln promises, measured on this machine, printed as JSON.

use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use kiln_core::{ExecRequest, Language, Limits};
use kiln_executor::{ExecutorPool, PoolConfig};
use kiln_wasm::{SessionOptions, WasmEngine};
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

pub(crate) fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

pub(crate) fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

pub(crate) fn private_memory_bytes() -> anyhow::Result<u64> {
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

pub(crate) type Report = serde_json::Map<String, serde_json::Value>;

/// Whether a figure was asked for: by a prefix in `--only`, or by default (no `--only`).
fn wanted(args: &BenchArgs, name: &str) -> bool {
    args.only
        .as_deref()
        .is_none_or(|only| only.split(',').any(|o| name.starts_with(o)))
}

/// Whether a figure was named in `--only` (soaks and slow figures run only then).
fn named(args: &BenchArgs, name: &str) -> bool {
    args.only
        .as_deref()
        .is_some_and(|only| only.split(',').any(|o| name.starts_with(o)))
}

/// Whether `--only` asks for anything of a group (`http`, `rest`), or is absent.
fn group(args: &BenchArgs, prefix: &str) -> bool {
    args.only.as_deref().is_none_or(|only| {
        only.split(',')
            .any(|o| o.starts_with(prefix) || prefix.starts_with(o))
    })
}

pub fn run(args: BenchArgs) -> anyhow::Result<ExitCode> {
    let cache = crate::cache::dir();
    let engine = WasmEngine::new(cache.clone())?;
    let progress = crate::progress::Bar::new();
    for language in Language::WASM {
        engine.prepare(language, &progress)?;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let n = args.iterations.max(5);
    let mut report = Report::new();
    report.insert(
        "machine_cpus".into(),
        json!(std::thread::available_parallelism().map_or(0, |n| n.get())),
    );
    rt.block_on(async {
        engine_oneshots(&engine, &args, n, &mut report).await?;
        fuel_cost(&engine, &args, n, &mut report).await?;
        engine_sessions(&engine, &args, n, &mut report).await?;
        if ["python_data", "python_fork", "python_pandas"]
            .iter()
            .any(|prefix| group(&args, prefix))
        {
            let want = |name: &str| wanted(&args, name);
            crate::bench_warm::run(&engine, &want, n, args.sessions, &mut report).await?;
        }
        through_workers(&args, n, &mut report).await
    })?;
    if wanted(&args, "cli") {
        cli_process(n, &mut report)?;
        crate::bench_warm::cli(n, &mut report)?;
    }
    servers(&args, n, &mut report)?;
    // Linux boxes: only when asked for (they need root and a built template).
    if named(&args, "native") {
        crate::bench_native::run(&args, n, &mut report)?;
    }
    // Interactive environments through a real `kiln serve --linux`: likewise.
    if named(&args, "interactive") {
        crate::bench_interactive::run(n, &mut report)?;
    }
    // Snapshots and forks of a Linux sandbox: likewise.
    if named(&args, "workspaces") {
        crate::bench_workspaces::run(n, &mut report)?;
    }
    if named(&args, "snapshots") {
        crate::bench_snapshots::run(n, &mut report)?;
    }
    println!(
        "{}",
        serde_json::to_string_pretty(&serde_json::Value::Object(report))?
    );
    Ok(ExitCode::SUCCESS)
}

/// Times `n` one-shots of `request` after 10 to warm up, checking each prints `expect`.
async fn time_oneshots(
    engine: &WasmEngine,
    request: &ExecRequest,
    n: usize,
    expect: &[u8],
) -> anyhow::Result<serde_json::Value> {
    time_runs(engine, request, 10, n, expect).await
}

/// Times `n` one-shots of `request` after `warmup` untimed ones, checking each prints
/// `expect`.
async fn time_runs(
    engine: &WasmEngine,
    request: &ExecRequest,
    warmup: usize,
    n: usize,
    expect: &[u8],
) -> anyhow::Result<serde_json::Value> {
    for _ in 0..warmup {
        engine.execute(request).await?;
    }
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let result = engine.execute(request).await?;
        samples.push(micros(t.elapsed()));
        anyhow::ensure!(
            result.stdout == expect,
            "unexpected output {:?}",
            result.stdout_text()
        );
    }
    Ok(summary(samples))
}

/// Page faults of the process per one-shot of `request`, over `n` runs (each trap costs
/// microseconds on a virtualised host). Pages the engine's threads populate in bulk with
/// madvise count too (the kernel counts them as faults), so this is an upper bound on the
/// request's own traps.
pub async fn fault_traps(
    engine: &WasmEngine,
    request: &ExecRequest,
    n: u64,
) -> anyhow::Result<serde_json::Value> {
    let faults = || {
        // SAFETY: getrusage fills the struct we pass; all-zero is a valid rusage.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: as above; RUSAGE_SELF needs no other argument.
        unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
        (usage.ru_minflt + usage.ru_majflt) as u64
    };
    let before = faults();
    for _ in 0..n {
        engine.execute(request).await?;
    }
    Ok(json!({"each": (faults() - before) / n.max(1)}))
}

/// Fresh sandboxes through the engine API: Python with and without a workspace, JavaScript.
async fn engine_oneshots(
    engine: &WasmEngine,
    args: &BenchArgs,
    n: usize,
    report: &mut Report,
) -> anyhow::Result<()> {
    // Fresh-sandbox Python with a workspace folder (what `kiln serve` runs).
    if wanted(args, "python_oneshot_workspace") {
        let workspace = tempfile::tempdir()?;
        let mut request = ExecRequest::new(Language::Python, "print(1+1)");
        request.workspace = Some(workspace.path().to_path_buf());
        let figure = time_oneshots(engine, &request, n, b"2\n").await?;
        report.insert("python_oneshot_workspace".into(), figure);
    }
    if wanted(args, "python_oneshot_engine") {
        let request = ExecRequest::new(Language::Python, "print(1+1)");
        let figure = time_oneshots(engine, &request, n, b"2\n").await?;
        report.insert("python_oneshot_engine".into(), figure);
        let traps = fault_traps(engine, &request, 50).await?;
        report.insert("python_oneshot_fault_traps".into(), traps);
    }
    if wanted(args, "python_oneshot_env") {
        // A request with an environment of its own (a primed guest gets it from a rebirth).
        let mut request = ExecRequest::new(Language::Python, "import os\nprint(os.environ['K'])");
        request.env = vec![("K".into(), "2".into())];
        let figure = time_oneshots(engine, &request, n, b"2\n").await?;
        report.insert("python_oneshot_env".into(), figure);
    }
    if wanted(args, "javascript_oneshot") {
        let js = ExecRequest::new(Language::JavaScript, "console.log(1+1)");
        let figure = time_oneshots(engine, &js, n, b"2\n").await?;
        report.insert("javascript_oneshot_engine".into(), figure);
    }
    Ok(())
}

/// The budget the fuel figures run under: far more than they use.
const BENCH_FUEL: u64 = 100_000_000_000;
/// A loop of 10^6 iterations, the fuel figures' compute-bound case.
const PYTHON_LOOP: &str = "n = 0\nfor i in range(1_000_000):\n    n += i\nprint(n)";

/// What an instruction budget costs: Python `print(1+1)` and a loop of 10^6 iterations,
/// with and without fuel. The fuel variant of the runtime compiles once (~90 s): its
/// figures run when it is compiled, or when `--only` names them in full (then it compiles).
async fn fuel_cost(
    engine: &WasmEngine,
    args: &BenchArgs,
    n: usize,
    report: &mut Report,
) -> anyhow::Result<()> {
    let loops = (n / 20).max(5);
    // The loop without fuel runs beside the loop with it, to compare.
    if wanted(args, "python_loop") || wanted(args, "python_loop_fuel") {
        let request = ExecRequest::new(Language::Python, PYTHON_LOOP);
        let figure = time_runs(engine, &request, 2, loops, b"499999500000\n").await?;
        report.insert("python_loop".into(), figure);
    }
    let figures = [
        (
            "python_oneshot_fuel",
            "print(1+1)",
            b"2\n".as_slice(),
            10,
            n,
        ),
        ("python_loop_fuel", PYTHON_LOOP, b"499999500000\n", 2, loops),
    ];
    for (name, code, expect, warmup, runs) in figures {
        if !wanted(args, name) {
            continue;
        }
        if wanted_exactly(args, name) {
            engine.prepare_variant(Language::Python, true, &crate::progress::Bar::new())?;
        } else if !engine.is_compiled(Language::Python, true)? {
            report.insert(
                name.into(),
                json!({"skipped": format!("the Python runtime is not compiled with fuel: `kiln bench --only {name}` compiles it (once, about 90 s), as does `kiln setup --fuel`")}),
            );
            continue;
        }
        let mut request = ExecRequest::new(Language::Python, code);
        request.limits.fuel = Some(BENCH_FUEL);
        let figure = time_runs(engine, &request, warmup, runs, expect).await?;
        report.insert(name.into(), figure);
    }
    Ok(())
}

/// Whether `--only` names the figure in full (slow set-up, such as a compilation, runs only
/// then).
fn wanted_exactly(args: &BenchArgs, name: &str) -> bool {
    args.only
        .as_deref()
        .is_some_and(|only| only.split(',').any(|o| o == name))
}

/// Session turns (Python, JavaScript) and the memory an idle Python session keeps.
async fn engine_sessions(
    engine: &WasmEngine,
    args: &BenchArgs,
    n: usize,
    report: &mut Report,
) -> anyhow::Result<()> {
    for (name, language, init) in [
        ("python_session", Language::Python, "x = 0"),
        ("javascript_session", Language::JavaScript, "var x = 0"),
    ] {
        if !wanted(args, name) {
            continue;
        }
        let mut session = engine
            .open_session(language, &SessionOptions::default())
            .await?;
        let limits = Limits::default();
        session.run(init, &limits).await?;
        let mut samples = Vec::with_capacity(n * 10);
        for _ in 0..n * 10 {
            let t = Instant::now();
            session.run("x += 1", &limits).await?;
            samples.push(micros(t.elapsed()));
        }
        report.insert(format!("{name}_turn"), summary(samples));
    }
    // Idle Python sessions: private memory each.
    if wanted(args, "python_idle") {
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
    }
    Ok(())
}

/// One-shots through executor worker processes: latency, then throughput with several in
/// flight per worker.
async fn through_workers(args: &BenchArgs, n: usize, report: &mut Report) -> anyhow::Result<()> {
    if !wanted(args, "python_oneshot_worker") && !wanted(args, "python_oneshot_throughput") {
        return Ok(());
    }
    let request = ExecRequest::new(Language::Python, "print(1+1)");
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
    Ok(())
}

/// The CLI as a whole process, warm cache.
fn cli_process(n: usize, report: &mut Report) -> anyhow::Result<()> {
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
    Ok(())
}

/// Figures of whole servers, each a separate process: `kiln serve`, `kiln rest`,
/// `kiln runner`, the agent and chat.
fn servers(args: &BenchArgs, n: usize, report: &mut Report) -> anyhow::Result<()> {
    let want = |name: &str| wanted(args, name);
    let explicit = |name: &str| named(args, name);
    if group(args, "http") {
        crate::bench_http::run(&want, &explicit, n, args.seconds, report)?;
    }
    if group(args, "rest") {
        let rest = |name: &str| want(name) || explicit("rest");
        crate::bench_rest::run(&rest, n, args.seconds, report)?;
    }
    if explicit("history_scale") || explicit("history_mixed_load") {
        crate::bench_history::run(&explicit, n, args.seconds, report)?;
    }
    if explicit("fair_share")
        || explicit("frozen_worker")
        || explicit("memory_return")
        || explicit("tenant_burst")
        || explicit("session_memory_return")
    {
        crate::bench_fair::run(&explicit, n, report)?;
    }
    if explicit("rest_crud_soak") {
        crate::bench_rest::soak("rest_crud_soak", 8, args.seconds, report)?;
    }
    if explicit("rest_read_mostly_soak") {
        crate::bench_rest::soak("rest_read_mostly_soak", 40, args.seconds, report)?;
    }
    if explicit("runner_jit") {
        crate::bench_runner::run(&explicit, n, report)?;
    }
    if want("agent_tool_round_trip") || want("chat_first_event") {
        #[cfg(feature = "bench-llm")]
        crate::bench_agent::run(&want, n, report)?;
        #[cfg(not(feature = "bench-llm"))]
        for name in ["agent_tool_round_trip", "chat_first_event"] {
            report.insert(name.into(), needs_bench_llm());
        }
    }
    Ok(())
}

/// What a figure that needs a model provider reports in a build without one.
#[cfg(not(feature = "bench-llm"))]
pub fn needs_bench_llm() -> serde_json::Value {
    serde_json::json!({
        "skipped": "needs a model provider: build with `cargo build --release --features bench-llm` (benchmark builds only)"
    })
}
