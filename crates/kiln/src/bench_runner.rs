//! `kiln bench --only runner_jit`: `POST /execute` of a trivial JIT function against a real
//! `kiln runner` process (this binary, one worker), over a keep-alive HTTP connection. The
//! request's MCP endpoint is a closed port: no MCP call is on this path, and the runner's
//! background logs to it are dropped.

use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{Value, json};

use crate::bench::{micros, summary};
use crate::bench_child::{Spawned, spawn};

fn start() -> anyhow::Result<Spawned> {
    let dir = tempfile::tempdir()?;
    let scripts = dir.path().join("shared");
    std::fs::create_dir(&scripts)?;
    std::fs::write(
        scripts.join("trivial.py"),
        "def handler(data, context):\n    return {\"ok\": True, \"n\": data.get(\"n\")}\n",
    )?;
    std::fs::write(
        scripts.join("trivial_js.js"),
        "function handler(data, context) { return {ok: true, n: data.n}; }\n",
    )?;
    spawn("runner", dir, "/healthz", |command| {
        command
            .args(["runner", "--workers", "1", "--scripts"])
            .arg(&scripts);
    })
}

/// Measures `/execute` of a trivial Python (`runner_jit`) and JavaScript (`runner_jit_js`)
/// function: client-side latency, and the runner's own `execution.duration`.
pub fn run(
    want: &dyn Fn(&str) -> bool,
    n: usize,
    report: &mut serde_json::Map<String, Value>,
) -> anyhow::Result<()> {
    let runner = start()?;
    let closed = std::net::TcpListener::bind("127.0.0.1:0")?;
    let endpoint = format!("http://{}/mcp", closed.local_addr()?);
    drop(closed);
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(30))
        .build();
    for (name, component) in [("runner_jit", "trivial"), ("runner_jit_js", "trivial_js")] {
        if !want(name) {
            continue;
        }
        let mut samples = Vec::with_capacity(n);
        let mut server = Vec::with_capacity(n);
        for i in 0..n + 20 {
            let body = json!({
                "requestId": format!("bench-{i}"),
                "requestData": {"source": "internal", "n": i},
                "context": {"mcp_endpoint": endpoint, "appId": "bench", "componentId": component},
            });
            let t = Instant::now();
            let answer: Value = agent
                .post(&format!("{}/execute", runner.base))
                .set("content-type", "application/json")
                .send_string(&body.to_string())
                .context("POST /execute")?
                .into_json()?;
            let elapsed = t.elapsed();
            anyhow::ensure!(
                answer["data"] == json!({"ok": true, "n": i}),
                "unexpected answer {answer}"
            );
            if i >= 20 {
                samples.push(micros(elapsed));
                let ms = answer["metrics"][0]["value"].as_f64().unwrap_or(0.0);
                server.push(ms * 1000.0);
            }
        }
        let mut entry = summary(samples);
        entry["server_execution_duration"] = summary(server);
        report.insert(name.into(), entry);
    }
    Ok(())
}
