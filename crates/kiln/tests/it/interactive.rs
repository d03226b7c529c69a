//! Issue 33, first part: a Linux sandbox's box through kiln's own API: its processes
//! (listed as the box sees them, signalled, a group at once), restart (every process ends,
//! files stay), pause and resume (the cgroup frozen: a forking process stays frozen, the
//! next command resumes it), and the refusals (kiln's agent, an unknown pid, a bad signal,
//! another tenant, a WebAssembly sandbox). Needs root, runc and the debian template.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::common::serve::*;

fn skip() -> bool {
    let skip = std::env::var("KILN_SKIP_LINUX").is_ok_and(|v| v == "1");
    if skip {
        let test = std::thread::current().name().unwrap_or("?").to_owned();
        eprintln!("SKIPPED (KILN_SKIP_LINUX=1): {test}");
    }
    skip
}

fn sh(server: &Server, id: &str, script: &str) -> Res<Value> {
    let (status, ran) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/exec"),
        Some(json!({"command": ["sh", "-c", script]})),
    )?;
    assert_eq!(status, 200, "{ran}");
    Ok(ran)
}

fn listed(server: &Server, id: &str) -> Res<Value> {
    let (status, list) = server.call("GET", &format!("/api/v1/sandboxes/{id}/processes"), None)?;
    assert_eq!(status, 200, "{list}");
    Ok(list)
}

/// The pids of the listed processes whose command line is `argv`.
fn pids_of(list: &Value, argv: &[&str]) -> Vec<u64> {
    list["processes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["argv"] == json!(argv))
        .filter_map(|p| p["pid"].as_u64())
        .collect()
}

fn read_file(server: &Server, id: &str, path: &str) -> Res<String> {
    let reply = send(
        "GET",
        &server.url(&format!("/api/v1/sandboxes/{id}/files/{path}")),
        server.key.as_deref(),
        None,
    )?;
    let text = String::from_utf8_lossy(&reply.body).into_owned();
    assert_eq!(reply.status, 200, "{text}");
    Ok(text)
}

#[test]
fn issue33_a_boxs_processes_are_listed_signalled_and_restarted() -> TestResult {
    if skip() {
        return Ok(());
    }
    let state = tempfile::tempdir()?;
    let state_dir = state.path().to_str().ok_or("path")?;
    let server = start(Options {
        auth: true,
        extra: &["--linux"],
        env: &[("KILN_STATE_DIR", state_dir)],
        ..Options::default()
    })?;
    let (status, created) = server.call(
        "POST",
        "/api/v1/sandboxes",
        Some(json!({"template": "linux-debian"})),
    )?;
    assert_eq!(status, 201, "{created}");
    let id = created["containerId"].as_str().ok_or("no id")?.to_string();
    let (_, info) = server.call("GET", &format!("/api/v1/sandboxes/{id}"), None)?;
    assert_eq!(
        info["state"], "stopped",
        "no box before the first command: {info}"
    );

    // Background processes an exec leaves behind survive it and are listed; one of them
    // leads a group of two.
    sh(&server, &id, "sleep 600 >/dev/null 2>&1 &")?;
    sh(
        &server,
        &id,
        "setsid sh -c 'sleep 601 & sleep 602 & wait' >/dev/null 2>&1 &",
    )?;
    let list = listed(&server, &id)?;
    assert_eq!(list["state"], "running", "{list}");
    let agent = &list["processes"][0];
    assert_eq!(agent["pid"], 1, "{list}");
    assert_eq!(agent["agent"], true, "{list}");
    let sleeper = pids_of(&list, &["sleep", "600"]);
    assert_eq!(sleeper.len(), 1, "{list}");
    let sleeping = list["processes"]
        .as_array()
        .ok_or("no processes")?
        .iter()
        .find(|p| p["pid"].as_u64() == Some(sleeper[0]))
        .ok_or("gone")?;
    assert_eq!(
        sleeping["uid"], 1000,
        "the box's user, not the host's: {sleeping}"
    );
    assert!(sleeping["memoryBytes"].as_u64() > Some(0), "{sleeping}");
    assert!(
        sleeping["startedAt"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z'))
    );

    // A signal to one process.
    let signal = |pid: u64, body: Value| {
        server.call(
            "POST",
            &format!("/api/v1/sandboxes/{id}/processes/{pid}/signal"),
            Some(body),
        )
    };
    let (status, sent) = signal(sleeper[0], json!({"signal": "KILL"}))?;
    assert_eq!(
        (status, sent["signalled"].clone()),
        (200, json!(1)),
        "{sent}"
    );
    // A group at once: the two sleepers and their shell.
    let grouped = pids_of(&listed(&server, &id)?, &["sleep", "601"]);
    assert_eq!(grouped.len(), 1);
    let (status, sent) = signal(grouped[0], json!({"signal": 15, "group": true}))?;
    assert_eq!(
        (status, sent["signalled"].clone()),
        (200, json!(3)),
        "{sent}"
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let list = listed(&server, &id)?;
        let left: Vec<u64> = ["600", "601", "602"]
            .iter()
            .flat_map(|n| pids_of(&list, &["sleep", n]))
            .collect();
        if left.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "still running: {list}");
        std::thread::sleep(Duration::from_millis(50));
    }

    // Refusals: the agent, a pid the box does not have, a bad signal, bad bodies.
    let (status, refused) = signal(1, json!({"signal": "KILL"}))?;
    assert_eq!(status, 400, "{refused}");
    assert!(refused.to_string().contains("agent"), "{refused}");
    let (status, refused) = signal(99_999, json!({}))?;
    assert_eq!(status, 404, "{refused}");
    for body in [
        json!({"signal": "NOPE"}),
        json!({"signal": 0}),
        json!({"signal": [9]}),
        json!({"sig": 9}),
    ] {
        let (status, refused) = signal(2, body.clone())?;
        assert_eq!(status, 400, "{body}: {refused}");
    }

    // Another tenant sees nothing of it.
    let other = create_key(&server.data, None)?;
    for (method, path) in [
        ("GET", format!("/api/v1/sandboxes/{id}/processes")),
        ("POST", format!("/api/v1/sandboxes/{id}/pause")),
        ("POST", format!("/api/v1/sandboxes/{id}/restart")),
    ] {
        let (status, _) = server.call_as(Some(&other), method, &path, None)?;
        assert_eq!(status, 404, "{method} {path}");
    }

    // Restart: a box a fork bomb filled gets its room back; files outside the workspace stay.
    sh(
        &server,
        &id,
        "echo kept > /var/tmp/kept; for i in 1 2 3 4 5; do sleep 700 & done",
    )?;
    let (status, restarted) =
        server.call("POST", &format!("/api/v1/sandboxes/{id}/restart"), None)?;
    assert_eq!(status, 200, "{restarted}");
    assert!(restarted["killed"].as_u64() >= Some(5), "{restarted}");
    let list = listed(&server, &id)?;
    assert_eq!(
        list["processes"].as_array().map(Vec::len),
        Some(1),
        "only the agent: {list}"
    );
    assert_eq!(sh(&server, &id, "cat /var/tmp/kept")?["stdout"], "kept\n");

    // A WebAssembly sandbox has no box.
    let (_, wasm) = server.call(
        "POST",
        "/api/v1/sandboxes",
        Some(json!({"language": "python"})),
    )?;
    let wasm = wasm["containerId"].as_str().ok_or("no id")?;
    let (status, refused) =
        server.call("GET", &format!("/api/v1/sandboxes/{wasm}/processes"), None)?;
    assert_eq!(status, 400, "{refused}");
    Ok(())
}

#[test]
fn issue33_a_paused_box_is_frozen_even_while_forking_and_the_next_command_resumes_it() -> TestResult
{
    if skip() {
        return Ok(());
    }
    let state = tempfile::tempdir()?;
    let state_dir = state.path().to_str().ok_or("path")?;
    let server = start(Options {
        auth: true,
        extra: &["--linux"],
        env: &[("KILN_STATE_DIR", state_dir)],
        ..Options::default()
    })?;
    let (_, created) = server.call(
        "POST",
        "/api/v1/sandboxes",
        Some(json!({"template": "linux-debian"})),
    )?;
    let id = created["containerId"].as_str().ok_or("no id")?.to_string();
    // A counter in the workspace (read from the host, which needs nothing of the box), and
    // a process that forks without end.
    sh(
        &server,
        &id,
        "(i=0; while :; do i=$((i+1)); echo $i > count.txt; sleep 0.02; done) >/dev/null 2>&1 &
         (while :; do sleep 30 & sleep 0.01; done) >/dev/null 2>&1 &",
    )?;
    std::thread::sleep(Duration::from_millis(300));
    let (status, paused) = server.call("POST", &format!("/api/v1/sandboxes/{id}/pause"), None)?;
    assert_eq!(status, 200, "{paused}");
    assert_eq!(paused["state"], "paused", "{paused}");
    let (_, info) = server.call("GET", &format!("/api/v1/sandboxes/{id}"), None)?;
    assert_eq!(info["state"], "paused", "{info}");

    // Frozen: the counter stops and the forker makes nothing more.
    let count = read_file(&server, &id, "count.txt")?;
    let tasks = listed(&server, &id)?["processes"].as_array().map(Vec::len);
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(
        read_file(&server, &id, "count.txt")?,
        count,
        "the counter moved while paused"
    );
    let list = listed(&server, &id)?;
    assert_eq!(list["state"], "paused");
    assert_eq!(list["processes"].as_array().map(Vec::len), tasks, "{list}");

    // A second pause is harmless; a command resumes the box and the counter goes on.
    let (status, again) = server.call("POST", &format!("/api/v1/sandboxes/{id}/pause"), None)?;
    assert_eq!(
        (status, again["state"].clone()),
        (200, json!("paused")),
        "{again}"
    );
    let ran = sh(&server, &id, "echo awake")?;
    assert_eq!(ran["stdout"], "awake\n", "{ran}");
    let (_, info) = server.call("GET", &format!("/api/v1/sandboxes/{id}"), None)?;
    assert_eq!(info["state"], "running", "{info}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while read_file(&server, &id, "count.txt")? == count {
        assert!(
            Instant::now() < deadline,
            "the counter did not go on after resuming"
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    // Pause and resume by route; deleting a paused sandbox removes its box.
    let (_, paused) = server.call("POST", &format!("/api/v1/sandboxes/{id}/pause"), None)?;
    assert_eq!(paused["state"], "paused");
    let (status, resumed) = server.call("POST", &format!("/api/v1/sandboxes/{id}/resume"), None)?;
    assert_eq!(
        (status, resumed["state"].clone()),
        (200, json!("running")),
        "{resumed}"
    );
    server.call("POST", &format!("/api/v1/sandboxes/{id}/pause"), None)?;
    let (status, _) = server.call("DELETE", &format!("/api/v1/sandboxes/{id}"), None)?;
    assert_eq!(status, 204);
    let boxes = state.path();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let left = std::fs::read_dir(boxes)?
            .flatten()
            .filter_map(|e| std::fs::read_dir(e.path().join("boxes")).ok())
            .flat_map(|d| d.flatten())
            .count();
        if left == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "a deleted paused sandbox's box is still there"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(())
}
