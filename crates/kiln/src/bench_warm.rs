//! `kiln bench` figures of warm starts and forks (issue 18): a pandas-ready sandbox, a fork
//! of a live session, the private memory each costs, and `kiln exec` of a pandas cell.
//! The peers' commands are in docs/perf/README.md.

use std::process::{Command, Stdio};
use std::time::Instant;

use kiln_core::{ExecRequest, Language, Limits};
use kiln_wasm::{PYTHON_DATA, SessionOptions, WasmEngine};
use serde_json::json;

use crate::bench::{Report, micros, private_memory_bytes, round3, summary};

/// The first pandas turn every figure runs.
pub const PANDAS_CELL: &str = "import pandas as pd\nprint(pd.DataFrame({'a': [1, 2, 3]}).a.sum())";

fn data(code: &str, template: Option<&str>) -> ExecRequest {
    let mut request = ExecRequest::new(Language::Python, code);
    request.template = template.map(Into::into);
    request
}

fn options(template: Option<&str>) -> SessionOptions {
    SessionOptions {
        template: template.map(Into::into),
        ..SessionOptions::default()
    }
}

/// The warm figures `want` asks for.
pub async fn run(
    engine: &WasmEngine,
    want: &dyn Fn(&str) -> bool,
    n: usize,
    sessions: usize,
    report: &mut Report,
) -> anyhow::Result<()> {
    let progress = crate::progress::Bar::new();
    engine
        .prepare_warm(kiln_wasm::PYTHON_DATA_WARM_UP, &progress)
        .await?;
    engine
        .prepare_warm_oneshots(kiln_wasm::PYTHON_DATA_WARM_UP, &progress)
        .await?;
    if want("python_data_pandas_oneshot") {
        let request = data(PANDAS_CELL, Some(PYTHON_DATA));
        let figure = time(engine, &request, 5, n, "6\n").await?;
        report.insert("python_data_pandas_oneshot".into(), figure);
        let traps = crate::bench::fault_traps(engine, &request, 20).await?;
        report.insert("python_data_pandas_oneshot_fault_traps".into(), traps);
    }
    if want("python_data_print_oneshot") {
        // The fast path's cell in a warm sandbox: what starting from an image costs.
        let request = data("print(1+1)", Some(PYTHON_DATA));
        let figure = time(engine, &request, 10, n, "2\n").await?;
        report.insert("python_data_print_oneshot".into(), figure);
    }
    if want("python_pandas_oneshot") {
        // The cell in a default `python` sandbox (no template): it imports pandas, so it
        // starts from python-data's image (issue 39).
        let request = data(PANDAS_CELL, None);
        let figure = time(engine, &request, 5, n, "6\n").await?;
        report.insert("python_pandas_oneshot".into(), figure);
    }
    if want("python_pandas_cold_oneshot") {
        // The same cell in a fresh interpreter: what a sandbox paid before warm starts. A
        // memory cap that leaves the image no room keeps it fresh.
        let mut request = data(PANDAS_CELL, None);
        let image = engine.warm_image_path(kiln_wasm::PYTHON_DATA_WARM_UP)?;
        request.limits.memory_bytes = std::fs::metadata(image)?.len() + (32 << 20);
        let figure = time(engine, &request, 1, 3, "6\n").await?;
        report.insert("python_pandas_cold_oneshot".into(), figure);
    }
    for (name, template) in [
        ("python_data_fork", Some(PYTHON_DATA)),
        ("python_fork_fresh_parent", None),
    ] {
        if want(name) {
            let figure = forks(engine, template, n.min(100)).await?;
            report.insert(name.into(), figure);
        }
    }
    if want("python_data_idle") {
        let figure = idle_private(engine, sessions, false).await?;
        report.insert("python_data_idle_session_private_mib".into(), figure);
    }
    if want("python_data_forked_idle") {
        let figure = idle_private(engine, sessions, true).await?;
        report.insert("python_data_forked_idle_private_mib".into(), figure);
    }
    Ok(())
}

/// Times `n` one-shots of `request` after `warmup`, checking the output.
async fn time(
    engine: &WasmEngine,
    request: &ExecRequest,
    warmup: usize,
    n: usize,
    expect: &str,
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
            result.stdout_text() == expect,
            "unexpected output {:?} {:?}",
            result.stdout_text(),
            result.stderr_text()
        );
    }
    Ok(summary(samples))
}

/// A fork of a live session that imported pandas and made a frame, to its first turn.
async fn forks(
    engine: &WasmEngine,
    template: Option<&str>,
    n: usize,
) -> anyhow::Result<serde_json::Value> {
    let limits = Limits::default();
    let mut parent = engine
        .open_session(Language::Python, &options(template))
        .await?;
    let made = parent
        .run(
            "import pandas as pd\ndf = pd.DataFrame({'a': range(1000)})",
            &limits,
        )
        .await?;
    anyhow::ensure!(made.success(), "{}", made.stderr_text());
    let mut samples = Vec::with_capacity(n);
    for i in 0..n + 3 {
        let t = Instant::now();
        let mut child = parent.fork(engine, &options(template)).await?;
        let result = child.run("len(df)", &limits).await?;
        if i >= 3 {
            samples.push(micros(t.elapsed()));
        }
        anyhow::ensure!(
            result.stdout_text() == "1000\n",
            "unexpected output {:?} {:?}",
            result.stdout_text(),
            result.stderr_text()
        );
    }
    Ok(summary(samples))
}

/// Private memory per idle session: warm-started ones, or forks of one session that
/// imported pandas and made a frame. Each ran a turn. The image they share is counted apart.
async fn idle_private(
    engine: &WasmEngine,
    count: usize,
    forked: bool,
) -> anyhow::Result<serde_json::Value> {
    let limits = Limits::default();
    let template = Some(PYTHON_DATA);
    let mut parent = engine
        .open_session(Language::Python, &options(template))
        .await?;
    parent
        .run(
            "import pandas as pd\ndf = pd.DataFrame({'a': range(1000)})",
            &limits,
        )
        .await?;
    // One of each first, so what every session shares is mapped before counting.
    let mut first = engine
        .open_session(Language::Python, &options(template))
        .await?;
    first.run("x = 0", &limits).await?;
    let before = private_memory_bytes()?;
    let mut sessions = Vec::with_capacity(count);
    for i in 0..count {
        let mut session = if forked {
            parent.fork(engine, &options(template)).await?
        } else {
            engine
                .open_session(Language::Python, &options(template))
                .await?
        };
        session.run(&format!("x = {i}"), &limits).await?;
        sessions.push(session);
    }
    let after = private_memory_bytes()?;
    let each = after.saturating_sub(before) as f64 / count.max(1) as f64;
    Ok(json!({"sessions": count, "each_mib": round3(each / (1 << 20) as f64)}))
}

/// `kiln exec --template python-data` of a pandas cell, the whole process; and the peer in
/// the same run, `python3 -c` (with pandas, where the host's Python has it).
pub fn cli(n: usize, report: &mut Report) -> anyhow::Result<()> {
    let exe = std::env::current_exe()?;
    let kiln = |code: &str| {
        let mut command = Command::new(&exe);
        command.args(["exec", "--template", PYTHON_DATA, "-c", code]);
        command
    };
    let runs = (n / 10).max(10);
    let figure = process(kiln(PANDAS_CELL), runs)?;
    report.insert("cli_exec_python_data_pandas_process".into(), figure);
    // The same cell with no template: `kiln exec -c` as a user types it (issue 39).
    let mut plain = Command::new(&exe);
    plain.args(["exec", "-c", PANDAS_CELL]);
    let figure = process(plain, runs)?;
    report.insert("cli_exec_python_pandas_process".into(), figure);
    // The system's interpreter (Debian's /usr/bin/python3), as a user runs `python3` on a
    // plain machine; else the one `python3` resolves to, itself rather than a shim in front
    // of it (pyenv's is a shell script, and its interpreter imports more at start).
    let resolved = Command::new("python3")
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_owned())
        .unwrap_or_default();
    let system = "/usr/bin/python3";
    let python = if std::path::Path::new(system).exists() {
        system.to_owned()
    } else if resolved.is_empty() {
        "python3".to_owned()
    } else {
        resolved.clone()
    };
    report.insert("peer_python3".into(), json!(python));
    // As a user runs it: with its bytecode cache (an environment that sets
    // PYTHONDONTWRITEBYTECODE makes every start compile its site-packages' hooks again).
    let python3 = |interpreter: &str, code: &str| {
        let mut command = Command::new(interpreter);
        command
            .args(["-c", code])
            .env_remove("PYTHONDONTWRITEBYTECODE");
        command
    };
    let figure = process(python3(&python, "print(1+1)"), runs)
        .unwrap_or_else(|e| json!({"skipped": format!("python3 -c could not run it here: {e:#}")}));
    report.insert("peer_python3_print_process".into(), figure);
    // pandas where an interpreter has it: the system's, else the resolved one.
    let with_pandas = [python.as_str(), resolved.as_str()]
        .into_iter()
        .filter(|p| !p.is_empty())
        .find(|p| {
            python3(p, "import pandas")
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
        .map(str::to_owned);
    let figure = match &with_pandas {
        Some(interpreter) => {
            report.insert("peer_python3_pandas".into(), json!(interpreter));
            process(python3(interpreter, PANDAS_CELL), runs).unwrap_or_else(
                |e| json!({"skipped": format!("python3 -c could not run it here: {e:#}")}),
            )
        }
        None => json!({"skipped": "no python3 here has pandas"}),
    };
    report.insert("peer_python3_pandas_process".into(), figure);
    // A sandboxed peer: python3 in a bubblewrap jail with every namespace unshared.
    let mut bwrap = Command::new("bwrap");
    bwrap
        .env_remove("PYTHONDONTWRITEBYTECODE")
        .args(["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"])
        .args([
            "--unshare-all",
            "--die-with-parent",
            &python,
            "-c",
            "print(1+1)",
        ]);
    let figure = process(bwrap, runs).unwrap_or_else(|e| {
        json!({"skipped": format!("bwrap could not run python3 here (apt-get install bubblewrap): {e:#}")})
    });
    report.insert("peer_bwrap_python3_print_process".into(), figure);
    Ok(())
}

/// Times `runs` runs of `command` (after two untimed), which must succeed.
fn process(mut command: Command, runs: usize) -> anyhow::Result<serde_json::Value> {
    command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut samples = Vec::with_capacity(runs);
    for i in 0..runs + 2 {
        let t = Instant::now();
        let status = command.status()?;
        anyhow::ensure!(status.success(), "{command:?} failed: {status}");
        if i >= 2 {
            samples.push(micros(t.elapsed()));
        }
    }
    Ok(summary(samples))
}
