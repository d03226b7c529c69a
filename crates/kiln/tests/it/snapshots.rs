//! Issue 37: snapshots and forks of Linux sandboxes through /api/v1 against a real
//! `kiln serve --linux`: a snapshot holds the workspace and what the box wrote outside it,
//! sandboxes made from it and forks diverge from their source and each other, a hostile
//! tree (links, a fifo, a huge sparse file) is copied as blocks and never walked, other
//! tenants see none of it, and snapshots outlive their sandbox and a restart of kiln.

use serde_json::{Value, json};

use crate::common::serve::{self, Options, Server, TestResult};

fn skip() -> bool {
    crate::common::skip_linux()
}

fn sh(server: &Server, id: &str, script: &str) -> String {
    let (status, body) = server
        .exec(id, json!({"command": ["bash", "-c", script]}))
        .unwrap();
    assert_eq!(status, 200, "{body}");
    body["stdout"].as_str().unwrap_or_default().to_string() + body["stderr"].as_str().unwrap_or("")
}

fn sandbox(server: &Server, body: Value) -> String {
    let (status, made) = server
        .call("POST", "/api/v1/sandboxes", Some(body))
        .unwrap();
    assert_eq!(status, 201, "{made}");
    made["containerId"].as_str().unwrap().to_string()
}

#[test]
fn issue37_snapshots_and_forks_copy_a_sandbox_and_diverge() -> TestResult {
    if skip() {
        return Ok(());
    }
    let data = tempfile::tempdir()?;
    let start = || {
        serve::start(Options {
            auth: true,
            data: Some(data.path()),
            extra: &["--linux"],
            ..Default::default()
        })
    };
    let server = start()?;
    let source = sandbox(&server, json!({"template": "linux-python"}));
    // Files in the workspace and outside it, and a hostile tree: links out of the box, a
    // fifo, a file of a terabyte (sparse), a nested repository.
    let out = sh(
        &server,
        &source,
        "echo v1 > state.txt && head -c 20M /dev/urandom > blob && md5sum blob > blob.md5 \
         && mkdir -p ~/.config && echo outside > ~/.config/kept \
         && ln -s /etc/shadow shadow && ln -s / root && mkfifo pipe && truncate -s 1T huge \
         && mkdir -p nested/.git && echo '[core]' > nested/.git/config && echo ok",
    );
    assert!(out.ends_with("ok\n"), "{out}");
    let (status, snap) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{source}/snapshots"),
        Some(json!({"name": "first"})),
    )?;
    assert_eq!(status, 201, "{snap}");
    assert!(
        matches!(snap["copy"].as_str(), Some("reflink" | "sparse")),
        "{snap}"
    );
    // The sparse terabyte costs nothing; the 20 MiB blob is there.
    let disk = snap["diskBytes"].as_u64().unwrap_or(0);
    assert!((20 << 20..=200 << 20).contains(&disk), "{snap}");
    let snap_id = snap["id"].as_str().ok_or("no id")?.to_string();

    // The source goes on, and diverges.
    sh(&server, &source, "echo v2 > state.txt");
    let copy = sandbox(&server, json!({"snapshot": "first"}));
    let out = sh(
        &server,
        &copy,
        "cat state.txt ~/.config/kept && md5sum -c blob.md5 && readlink shadow && test -p pipe && stat -c %s huge && cat nested/.git/config",
    );
    assert_eq!(
        out, "v1\noutside\nblob: OK\n/etc/shadow\n1099511627776\n[core]\n",
        "the copy's files"
    );
    assert_eq!(sh(&server, &source, "cat state.txt"), "v2\n");
    // Its history is the source's at the snapshot.
    let (status, history) =
        server.call("GET", &format!("/api/v1/sandboxes/{copy}/history"), None)?;
    assert_eq!(status, 200, "{history}");

    // Forks: copies of the source now, each its own.
    let (status, forked) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{source}/fork"),
        Some(json!({"count": 3})),
    )?;
    assert_eq!(status, 201, "{forked}");
    let forks: Vec<String> = forked["forks"]
        .as_array()
        .ok_or("no forks")?
        .iter()
        .map(|f| {
            f["sandbox"]["containerId"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    assert_eq!(forks.len(), 3, "{forked}");
    for (i, fork) in forks.iter().enumerate() {
        assert_eq!(sh(&server, fork, "cat state.txt"), "v2\n");
        sh(&server, fork, &format!("echo fork-{i} > state.txt"));
    }
    for (i, fork) in forks.iter().enumerate() {
        assert_eq!(sh(&server, fork, "cat state.txt"), format!("fork-{i}\n"));
    }
    assert_eq!(sh(&server, &source, "cat state.txt"), "v2\n");
    // The fork's own snapshot is gone; the named one stays.
    let (_, listed) = server.call(
        "GET",
        &format!("/api/v1/snapshots?sandboxId={source}"),
        None,
    )?;
    assert_eq!(
        listed["snapshots"].as_array().map(Vec::len),
        Some(1),
        "{listed}"
    );

    // Bounds and refusals.
    for count in [0, 21] {
        let (status, refused) = server.call(
            "POST",
            &format!("/api/v1/sandboxes/{source}/fork"),
            Some(json!({"count": count})),
        )?;
        assert_eq!(status, 400, "count {count}: {refused}");
    }
    let wasm = sandbox(&server, json!({"language": "python"}));
    let (status, refused) =
        server.call("POST", &format!("/api/v1/sandboxes/{wasm}/snapshots"), None)?;
    assert_eq!(
        (status, refused["error"]["code"].as_str()),
        (400, Some("UNSUPPORTED")),
        "{refused}"
    );
    let (status, refused) = server.call(
        "POST",
        "/api/v1/sandboxes",
        Some(json!({"snapshot": "first", "template": "linux-debian"})),
    )?;
    assert_eq!(status, 400, "{refused}");
    let other = serve::create_key(&server.data, None)?;
    for path in [
        format!("/api/v1/snapshots/{snap_id}"),
        "/api/v1/snapshots/first".to_string(),
    ] {
        let (status, _) = server.call_as(Some(&other), "GET", &path, None)?;
        assert_eq!(status, 404, "another tenant saw {path}");
    }
    let (status, _) = server.call_as(
        Some(&other),
        "POST",
        "/api/v1/sandboxes",
        Some(json!({"snapshot": snap_id})),
    )?;
    assert_eq!(status, 404, "another tenant made a sandbox of the snapshot");

    // A snapshot outlives its sandbox and a restart of kiln.
    let (status, _) = server.call("DELETE", &format!("/api/v1/sandboxes/{source}"), None)?;
    assert_eq!(status, 204);
    let key = server.key.clone();
    drop(server);
    let mut server = start()?;
    server.key = key;
    let again = sandbox(&server, json!({"snapshot": snap_id}));
    assert_eq!(sh(&server, &again, "cat state.txt"), "v1\n");
    let (status, _) = server.call("DELETE", "/api/v1/snapshots/first", None)?;
    assert_eq!(status, 204);
    let (status, _) = server.call(
        "POST",
        "/api/v1/sandboxes",
        Some(json!({"snapshot": snap_id})),
    )?;
    assert_eq!(status, 404);
    // Sandboxes made from it keep their own disks.
    assert_eq!(sh(&server, &again, "cat state.txt"), "v1\n");
    assert!(
        std::fs::read_dir(data.path().join("snapshots"))?
            .next()
            .is_none(),
        "a deleted snapshot left files"
    );
    Ok(())
}

fn pid_of(server: &Server, id: &str, pattern: &str) -> String {
    sh(server, id, &format!("pgrep -f '{pattern}' || echo none"))
}

/// A snapshot takes a box's running processes with its files (CRIU, `--leave-running`, the
/// box frozen meanwhile so the two agree): a server's in-memory count and a shell loop
/// that appends to a file all the while go on in every copy and fork, each on its own,
/// while the source never stops. `processes: false` takes the files alone; a hibernated
/// box's checkpoint is taken as it is; `processes: true` where they cannot be taken is a
/// 400 saying why.
#[test]
fn issue37_a_snapshot_carries_running_processes_into_its_copies_and_forks() -> TestResult {
    if skip() {
        return Ok(());
    }
    let data = tempfile::tempdir()?;
    let server = serve::start(Options {
        auth: true,
        data: Some(data.path()),
        // No warm pool: a new sandbox has no box until its first command.
        extra: &["--linux", "--target-pool-size", "0"],
        ..Default::default()
    })?;
    let source = sandbox(&server, json!({"template": "linux-python"}));
    let (status, ran) = server.exec(
        &source,
        json!({
            "command": ["sh", "-c", "echo in-memory > /tmp/marker; python3 counter.py 8000 >/dev/null 2>&1 & \
                (while :; do date +%s%N >> ticks; sleep 0.02; done) >/dev/null 2>&1 & echo started"],
            "files": {"counter.py": serve::COUNTER_PY},
        }),
    )?;
    assert_eq!(status, 200, "{ran}");
    let count = |id: &str| serve::preview_body(&server, id, 8000);
    assert_eq!(count(&source)?, "1");
    assert_eq!(count(&source)?, "2");
    let source_pid = pid_of(&server, &source, "^python3 counter[.]py 8000");

    let (status, snap) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{source}/snapshots"),
        Some(json!({"name": "live"})),
    )?;
    assert_eq!(status, 201, "{snap}");
    assert_eq!(snap["withProcesses"], true, "{snap}");
    assert!(
        snap["processes"]
            .as_str()
            .unwrap_or("")
            .contains("checkpointed"),
        "{snap}"
    );
    // The source never stopped: the same process, its count going on.
    assert_eq!(count(&source)?, "3");
    assert_eq!(
        pid_of(&server, &source, "^python3 counter[.]py 8000"),
        source_pid
    );
    let (_, info) = server.call("GET", &format!("/api/v1/sandboxes/{source}"), None)?;
    assert_eq!(info["state"], "running", "{info}");

    // A copy goes on from the snapshot (2), on its own.
    let copy = sandbox(&server, json!({"snapshot": "live"}));
    assert_eq!(count(&copy)?, "3");
    assert_eq!(count(&copy)?, "4");
    assert_eq!(count(&source)?, "4");
    // The appending loop came too, and appends in the copy.
    let ticks =
        |id: &str| -> usize { sh(&server, id, "wc -l < ticks").trim().parse().unwrap_or(0) };
    let before = ticks(&copy);
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(ticks(&copy) > before, "the copy's loop does not run");
    // The box's /tmp (memory: a tmpfs) comes with its processes.
    assert_eq!(sh(&server, &copy, "cat /tmp/marker"), "in-memory\n");
    let (_, events) = server.call("GET", &format!("/api/v1/sandboxes/{copy}/events"), None)?;
    assert!(
        events.to_string().contains("restored from the snapshot"),
        "{events}"
    );

    // Forks: each goes on from the source as it is now (4), and diverges.
    let (status, forked) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{source}/fork"),
        Some(json!({"count": 2})),
    )?;
    assert_eq!(status, 201, "{forked}");
    let forks: Vec<String> = forked["forks"]
        .as_array()
        .ok_or("no forks")?
        .iter()
        .map(|f| {
            assert_eq!(f["restoredProcesses"], true, "{f}");
            f["sandbox"]["containerId"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    assert_eq!(forks.len(), 2, "{forked}");
    assert_eq!(count(&forks[0])?, "5");
    assert_eq!(count(&forks[0])?, "6");
    assert_eq!(count(&forks[1])?, "5");
    assert_eq!(count(&source)?, "5");

    // Files alone, when asked: a copy of it starts fresh.
    let (status, files) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{source}/snapshots"),
        Some(json!({"name": "files", "processes": false})),
    )?;
    assert_eq!(status, 201, "{files}");
    assert_eq!(files["withProcesses"], false, "{files}");
    let fresh = sandbox(&server, json!({"snapshot": "files"}));
    assert_eq!(
        pid_of(&server, &fresh, "^python3 counter[.]py 8000"),
        "none\n"
    );
    assert_eq!(sh(&server, &fresh, "test -s ticks && echo kept"), "kept\n");

    // A hibernated box: its checkpoint is taken as it is, and it stays hibernated.
    let (status, slept) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{source}/hibernate"),
        None,
    )?;
    assert_eq!(status, 200, "{slept}");
    let (status, asleep) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{source}/snapshots"),
        Some(json!({"processes": true})),
    )?;
    assert_eq!(status, 201, "{asleep}");
    assert!(
        asleep["processes"]
            .as_str()
            .unwrap_or("")
            .contains("hibernation"),
        "{asleep}"
    );
    let (_, info) = server.call("GET", &format!("/api/v1/sandboxes/{source}"), None)?;
    assert_eq!(info["state"], "hibernated", "{info}");
    let woken = sandbox(&server, json!({"snapshot": asleep["id"]}));
    assert_eq!(count(&woken)?, "6");
    assert_eq!(count(&source)?, "6");

    // A sandbox with no box running has no processes to take: asked for them by name, a
    // 400 saying why; by default, its files alone.
    let idle = sandbox(&server, json!({"template": "linux-debian"}));
    let (status, refused) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{idle}/snapshots"),
        Some(json!({"processes": true})),
    )?;
    assert_eq!(status, 400, "{refused}");
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("no box ran"),
        "{refused}"
    );
    let (status, taken) =
        server.call("POST", &format!("/api/v1/sandboxes/{idle}/snapshots"), None)?;
    assert_eq!(status, 201, "{taken}");
    assert_eq!(taken["withProcesses"], false, "{taken}");
    // The refused one left nothing behind.
    let (_, listed) = server.call("GET", &format!("/api/v1/snapshots?sandboxId={idle}"), None)?;
    assert_eq!(
        listed["snapshots"].as_array().map(Vec::len),
        Some(1),
        "{listed}"
    );
    Ok(())
}
