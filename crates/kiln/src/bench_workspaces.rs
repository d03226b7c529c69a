//! `kiln bench --only workspaces`: workspaces with a postgres service through a real
//! `kiln serve --linux` (this binary, no keys), as a client sees them: a new workspace with
//! postgres to its first `run_sql` answer (the database made on the way), `run_sql` of a
//! one-row select, stop, start again to the first answer, and the memory an idle workspace
//! with postgres holds (the PSS of its box's processes), and a burst of 100 concurrent
//! `run_sql` calls (each waits its turn; the time until the last is answered).

use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{Value, json};

use crate::bench::{Report, micros, summary};
use crate::bench_child::LinuxServer;

pub(crate) fn run(n: usize, report: &mut Report) -> anyhow::Result<()> {
    // SAFETY: geteuid(2) takes no arguments, touches no memory of ours and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        report.insert(
            "workspaces".into(),
            json!("skipped: boxes need root (run kiln bench as root)"),
        );
        return Ok(());
    }
    let rounds = n.clamp(1, 5);
    let linux = LinuxServer::start(Duration::from_secs(300))?;
    let post = |path: &str, body: Value| linux.post(path, body);
    let mut create_us = Vec::new();
    let mut select_us = Vec::new();
    let mut stop_us = Vec::new();
    let mut start_us = Vec::new();
    let mut pss = Vec::new();
    let mut burst_us = Vec::new();
    for round in 0..rounds {
        let started = Instant::now();
        let ws = post(
            "/api/v1/workspaces",
            json!({"name": format!("bench-{round}"), "services": ["postgres"]}),
        )?;
        let id = ws["id"].as_str().context("no workspace id")?.to_string();
        let one = post(
            &format!("/api/v1/workspaces/{id}/sql"),
            json!({"query": "select 1 as one"}),
        )?;
        anyhow::ensure!(one["rows"] == json!([{"one": 1}]), "run_sql: {one}");
        create_us.push(micros(started.elapsed()));
        for _ in 0..10 {
            let started = Instant::now();
            post(
                &format!("/api/v1/workspaces/{id}/sql"),
                json!({"query": "select 1 as one"}),
            )?;
            select_us.push(micros(started.elapsed()));
        }
        let started = Instant::now();
        let answered = std::thread::scope(|scope| {
            let calls: Vec<_> = (0..100)
                .map(|_| {
                    scope.spawn(|| {
                        post(
                            &format!("/api/v1/workspaces/{id}/sql"),
                            json!({"query": "select 1 as one"}),
                        )
                    })
                })
                .collect();
            calls
                .into_iter()
                .map(|c| c.join())
                .filter(|joined| matches!(joined, Ok(Ok(_))))
                .count()
        });
        anyhow::ensure!(
            answered == 100,
            "a burst of 100 run_sql: {answered} answered"
        );
        burst_us.push(micros(started.elapsed()));
        let started = Instant::now();
        post(&format!("/api/v1/workspaces/{id}/stop"), json!({}))?;
        stop_us.push(micros(started.elapsed()));
        let started = Instant::now();
        post(&format!("/api/v1/workspaces/{id}/start"), json!({}))?;
        post(
            &format!("/api/v1/workspaces/{id}/sql"),
            json!({"query": "select 1 as one"}),
        )?;
        start_us.push(micros(started.elapsed()));
        std::thread::sleep(Duration::from_secs(1));
        let sandbox = ws["sandboxId"].as_str().context("no sandbox")?;
        let measured = post(
            &format!("/api/v1/sandboxes/{sandbox}/exec"),
            json!({"command": ["sh", "-c",
                "cat /proc/[0-9]*/smaps_rollup 2>/dev/null | awk '/^Pss:/ {s += $2} END {print s}'"]}),
        )?;
        let kib: u64 = measured["stdout"]
            .as_str()
            .unwrap_or("")
            .trim()
            .parse()
            .unwrap_or(0);
        pss.push(kib * 1024);
        linux.delete(&format!("/api/v1/workspaces/{id}"))?;
    }
    report.insert(
        "workspace_with_postgres_to_first_sql".into(),
        summary(create_us),
    );
    report.insert("run_sql_one_row".into(), summary(select_us));
    report.insert("run_sql_burst_of_100".into(), summary(burst_us));
    report.insert("workspace_stop".into(), summary(stop_us));
    report.insert("workspace_start_to_first_sql".into(), summary(start_us));
    pss.sort_unstable();
    report.insert(
        "idle_workspace_with_postgres_pss_bytes".into(),
        json!({"median": pss.get(pss.len() / 2).copied().unwrap_or(0), "all": pss}),
    );
    Ok(())
}
