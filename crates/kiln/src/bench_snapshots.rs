//! `kiln bench --only snapshots`: snapshots and forks of a Linux sandbox through a real
//! `kiln serve --linux` (this binary, no keys), as a client sees them: a snapshot of a box
//! holding 200 MiB of files and a process holding 64 MiB of memory (with its processes, and
//! of its files alone), a fork into 4 copies (their processes restored), a sandbox made
//! from a snapshot, and what each copy holds on the host's disk (and how it was copied:
//! reflink or sparse).

use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{Value, json};

use crate::bench::{Report, micros, summary};
use crate::bench_child::LinuxServer;

pub(crate) fn run(n: usize, report: &mut Report) -> anyhow::Result<()> {
    // SAFETY: geteuid(2) takes no arguments, touches no memory of ours and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        report.insert(
            "snapshots".into(),
            json!({"skipped": "Linux boxes need kiln to run as root"}),
        );
        return Ok(());
    }
    // Each round copies hundreds of MiB: a few rounds say enough.
    let rounds = n.clamp(1, 5);
    let linux = LinuxServer::start(Duration::from_secs(300))?;
    let base = linux.base().to_owned();
    let agent = linux.agent.clone();
    let post = |path: &str, body: Value| linux.post(path, body);
    let delete = |path: &str| linux.delete(path);
    let created = post("/api/v1/sandboxes", json!({"template": "linux-python"}))?;
    let id = created["containerId"]
        .as_str()
        .context("no sandbox id")?
        .to_string();
    let wrote = post(
        &format!("/api/v1/sandboxes/{id}/exec"),
        json!({"command": ["sh", "-c",
            "for i in 0 1 2 3; do head -c 52428800 /dev/urandom > part$i.bin; done; sync; du -sm . | cut -f1"]}),
    )?;
    anyhow::ensure!(wrote["exitCode"] == 0, "writing 200 MiB failed: {wrote}");
    // A running process holding 64 MiB of memory: what a snapshot with processes carries.
    let started = post(
        &format!("/api/v1/sandboxes/{id}/exec"),
        json!({"command": ["sh", "-c",
            "python3 -c 'import time; x = bytearray(64 << 20); time.sleep(10**6)' >/dev/null 2>&1 & sleep 1"]}),
    )?;
    anyhow::ensure!(
        started["exitCode"] == 0,
        "starting the process failed: {started}"
    );

    let mut snapshot_us = Vec::new();
    let mut from_us = Vec::new();
    let mut fork_us = Vec::new();
    let mut disk = 0u64;
    let mut copy = Value::Null;
    let mut frozen_us = Vec::new();
    let mut files_only_us = Vec::new();
    let mut files_only_disk = 0u64;
    for _ in 0..rounds {
        let started = Instant::now();
        let snap = post(
            &format!("/api/v1/sandboxes/{id}/snapshots"),
            json!({"processes": false}),
        )?;
        files_only_us.push(micros(started.elapsed()));
        files_only_disk = snap["diskBytes"].as_u64().unwrap_or(0);
        delete(&format!(
            "/api/v1/snapshots/{}",
            snap["id"].as_str().unwrap_or_default()
        ))?;

        let started = Instant::now();
        let snap = post(
            &format!("/api/v1/sandboxes/{id}/snapshots"),
            json!({"processes": true}),
        )?;
        snapshot_us.push(micros(started.elapsed()));
        frozen_us.push(snap["frozenMs"].as_f64().unwrap_or(0.0) * 1000.0);
        disk = snap["diskBytes"].as_u64().unwrap_or(0);
        copy = snap["copy"].clone();
        let snap_id = snap["id"].as_str().context("no snapshot id")?.to_string();
        let started = Instant::now();
        let made = post("/api/v1/sandboxes", json!({"snapshot": snap_id}))?;
        from_us.push(micros(started.elapsed()));
        let copy_id = made["containerId"].as_str().unwrap_or_default();
        let info: Value = agent
            .get(&format!("{base}/api/v1/sandboxes/{copy_id}"))
            .call()?
            .into_json()?;
        anyhow::ensure!(
            info["state"] == "running",
            "a copy's box was not restored: {info}"
        );
        delete(&format!(
            "/api/v1/sandboxes/{}",
            made["containerId"].as_str().unwrap_or_default()
        ))?;
        delete(&format!("/api/v1/snapshots/{snap_id}"))?;

        let started = Instant::now();
        let forked = post(&format!("/api/v1/sandboxes/{id}/fork"), json!({"count": 4}))?;
        fork_us.push(micros(started.elapsed()));
        for fork in forked["forks"].as_array().context("no forks")? {
            anyhow::ensure!(
                fork["restoredProcesses"] == true,
                "a fork's processes were not restored: {fork}"
            );
            let fork_id = fork["sandbox"]["containerId"]
                .as_str()
                .with_context(|| format!("a fork failed: {fork}"))?;
            delete(&format!("/api/v1/sandboxes/{fork_id}"))?;
        }
    }
    report.insert(
        "snapshot_200mib".into(),
        json!({"latency": summary(snapshot_us), "frozen": summary(frozen_us), "disk_bytes": disk, "copy": copy, "processes": "64 MiB process checkpointed"}),
    );
    report.insert(
        "snapshot_200mib_files_only".into(),
        json!({"latency": summary(files_only_us), "disk_bytes": files_only_disk}),
    );
    report.insert("sandbox_from_snapshot_200mib".into(), summary(from_us));
    report.insert(
        "fork_4_200mib".into(),
        json!({"latency": summary(fork_us), "disk_bytes_per_fork": disk, "copy": copy}),
    );
    Ok(())
}
