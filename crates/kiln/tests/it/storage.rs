//! Issue 12 (workspace storage integrity), against a real `kiln serve`: guest-planted links,
//! hard links and fifos never redirect a host read or write; nested `.git` folders are
//! history, not errors; a kill leaves nothing that breaks a sandbox; one sandbox's record is
//! written by one writer at a time; sizes, counts and full disks answer defined codes.
//! Every error body these tests receive is checked for the data folder's path (see
//! `common::serve::check_no_host_path`).

#[allow(dead_code, reason = "the browser helpers are for other test binaries")]
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::common::serve::*;

fn workspace(server: &Server, id: &str) -> PathBuf {
    server.data.join("sandboxes").join(id).join("workspace")
}

fn file_url(server: &Server, id: &str, path: &str) -> String {
    server.url(&format!("/api/v1/sandboxes/{id}/files/{path}"))
}

fn put(server: &Server, id: &str, path: &str, bytes: &[u8]) -> Res<Reply> {
    send(
        "PUT",
        &file_url(server, id, path),
        server.key.as_deref(),
        Some(("application/octet-stream", bytes)),
    )
}

fn get(server: &Server, id: &str, path: &str) -> Res<Reply> {
    send(
        "GET",
        &file_url(server, id, path),
        server.key.as_deref(),
        None,
    )
}

fn error_code(reply: &Reply) -> String {
    reply.json()["error"]["code"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// Everything under `dir` (paths and contents), to prove nothing outside changed.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(at) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&at) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            if meta.is_dir() {
                stack.push(path.clone());
                out.push((path, Vec::new()));
            } else if meta.is_file() {
                out.push((path.clone(), std::fs::read(&path).unwrap_or_default()));
            } else {
                out.push((path, b"<special>".to_vec()));
            }
        }
    }
    out.sort();
    out
}

/// Issue 12, item 1: links planted under the temporary name, on every path component, at the
/// target, hard links and fifos never make an upload, an exec `files` map or a download
/// reach outside the workspace.
#[test]
fn issue12_planted_links_never_redirect_host_writes_or_reads() -> TestResult {
    let server = start(Options {
        auth: true,
        ..Options::default()
    })?;
    let id = server.new_sandbox("python")?;
    let ws = workspace(&server, &id);
    let keys = server.data.join("keys.json");
    let keys_before = std::fs::read(&keys)?;
    let outside = server.data.parent().ok_or("parent")?.join("outside");
    std::fs::create_dir_all(&outside)?;
    std::fs::write(outside.join("secret.txt"), "secret")?;
    let outside_before = snapshot(&outside);

    // Guest code plants what the old server followed: its own temporary name pointing at the
    // key file (the server's pid is the suffix the old scheme used).
    let pid = server.child.0.id();
    let (status, r) = server.exec(&id, json!({"code": format!(
        "import os\nfor name in ['.up.txt.{pid}.tmp', '.main.py.{pid}.tmp']:\n    try:\n        os.symlink('../../../keys.json', name)\n    except OSError as e:\n        print('guest could not link', name, e)\nprint('planted')"
    )}))?;
    assert_eq!(status, 200, "{r}");
    // And the same from outside the guest, should the guest's link rules ever differ.
    for name in [format!(".up.txt.{pid}.tmp"), format!(".main.py.{pid}.tmp")] {
        let path = ws.join(&name);
        if std::fs::symlink_metadata(&path).is_err() {
            symlink(&keys, &path)?;
        }
    }
    let reply = put(&server, &id, "up.txt", b"upload")?;
    assert_eq!(
        reply.status,
        201,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    let (status, r) = server.exec(
        &id,
        json!({"code": "print(open('main.py').read())", "files": {"main.py": "x = 1"}}),
    )?;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["stdout"], "x = 1\n");
    assert_eq!(std::fs::read(ws.join("up.txt"))?, b"upload");

    // Links on every component of a path, and at its end.
    symlink(&outside, ws.join("first"))?;
    std::fs::create_dir_all(ws.join("d"))?;
    symlink(&outside, ws.join("d/middle"))?;
    symlink(outside.join("secret.txt"), ws.join("d/last.txt"))?;
    for path in [
        "first/secret.txt",
        "first/new.txt",
        "d/middle/secret.txt",
        "d/middle/x/y.txt",
        "d/last.txt",
    ] {
        let reply = put(&server, &id, path, b"pwned")?;
        assert_eq!(reply.status, 400, "PUT {path}");
        assert_eq!(error_code(&reply), "INVALID_PATH", "PUT {path}");
        let reply = get(&server, &id, path)?;
        assert_eq!(reply.status, 400, "GET {path}");
        assert_eq!(error_code(&reply), "INVALID_PATH", "GET {path}");
        assert!(!String::from_utf8_lossy(&reply.body).contains("secret\""));
        let (status, r) = server.exec(&id, json!({"code": "1", "files": {path: "pwned"}}))?;
        assert_eq!(status, 400, "files {path}: {r}");
    }
    // A listing names links as links and never enters them.
    let (status, list) = server.call("GET", &format!("/api/v1/sandboxes/{id}/files"), None)?;
    assert_eq!(status, 200);
    let first = list["files"]
        .as_array()
        .ok_or("files")?
        .iter()
        .find(|f| f["path"] == "first")
        .ok_or("first")?;
    assert_eq!(first["kind"], "symlink");
    assert!(
        !list.to_string().contains("secret.txt\""),
        "the listing entered a link: {list}"
    );
    let (status, _) = server.call(
        "GET",
        &format!("/api/v1/sandboxes/{id}/files?path=first"),
        None,
    )?;
    assert_eq!(status, 400);

    // A hard link to a file outside: an upload replaces the name, never the other file.
    std::fs::hard_link(&keys, ws.join("hard.json"))?;
    assert_eq!(put(&server, &id, "hard.json", b"pwned")?.status, 201);
    // A fifo: a download is refused at once, never opened (it would hang).
    let made = std::process::Command::new("mkfifo")
        .arg(ws.join("pipe"))
        .status()?;
    assert!(made.success());
    // (Opened, it would hang until the client's timeout.)
    let reply = get(&server, &id, "pipe")?;
    assert_eq!(reply.status, 400);
    assert_eq!(error_code(&reply), "INVALID_PATH");
    // Deleting a link removes the link only.
    let reply = send(
        "DELETE",
        &file_url(&server, &id, "first"),
        server.key.as_deref(),
        None,
    )?;
    assert_eq!(reply.status, 200);

    assert_eq!(std::fs::read(&keys)?, keys_before, "the key file changed");
    assert_eq!(snapshot(&outside), outside_before, "a file outside changed");
    Ok(())
}

/// Issue 12, item 1: a folder swapped for a link to the outside and back, as fast as a thread
/// can, while uploads and downloads go through it: nothing outside ever changes.
#[test]
fn issue12_links_swapped_in_between_check_and_use() -> TestResult {
    let server = start(Options {
        extra: &["--rate-limit", "0"],
        ..Options::default()
    })?;
    let id = server.new_sandbox("python")?;
    let ws = workspace(&server, &id);
    let outside = server.data.parent().ok_or("parent")?.join("outside");
    std::fs::create_dir_all(&outside)?;
    std::fs::write(outside.join("target.txt"), "outside")?;
    let before = snapshot(&outside);
    std::fs::create_dir(ws.join("real"))?;
    symlink(&outside, ws.join("link"))?;
    let stop = Arc::new(AtomicBool::new(false));
    let swaps = Arc::new(AtomicU64::new(0));
    let racer = {
        let (stop, swaps, ws) = (stop.clone(), swaps.clone(), ws.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let _ = std::fs::rename(ws.join("real"), ws.join("spot"));
                let _ = std::fs::rename(ws.join("spot"), ws.join("parked"));
                let _ = std::fs::rename(ws.join("link"), ws.join("spot"));
                let _ = std::fs::rename(ws.join("spot"), ws.join("link"));
                let _ = std::fs::rename(ws.join("parked"), ws.join("real"));
                swaps.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let started = Instant::now();
    let mut written = 0;
    while started.elapsed() < Duration::from_secs(3) {
        let reply = put(&server, &id, "spot/target.txt", b"pwned")?;
        if reply.status == 201 {
            written += 1;
        } else {
            assert!(
                matches!(reply.status, 400 | 404 | 409),
                "{}: {}",
                reply.status,
                String::from_utf8_lossy(&reply.body)
            );
        }
        let reply = get(&server, &id, "spot/target.txt")?;
        assert_ne!(reply.body, b"outside", "a download followed the link");
    }
    stop.store(true, Ordering::Relaxed);
    racer.join().map_err(|_| "racer panicked")?;
    eprintln!(
        "{written} uploads landed during {} swaps",
        swaps.load(Ordering::Relaxed)
    );
    assert_eq!(snapshot(&outside), before, "a file outside changed");
    Ok(())
}

/// Issue 12, item 2: a guest's nested `.git` is recorded as plain files; history goes on; a
/// `.git` at the root does not survive a rollback to `initial`.
#[test]
fn issue12_guest_git_folders_are_recorded_and_rolled_back() -> TestResult {
    let server = start(Options::default())?;
    let id = server.new_sandbox("python")?;
    let (status, r) = server.exec(&id, json!({"code": "import os\nos.makedirs('proj/.git/refs', exist_ok=True)\nopen('proj/.git/HEAD','w').write('ref: refs/heads/main\\n')\nopen('proj/app.py','w').write('print(1)')\nos.makedirs('.git/hooks', exist_ok=True)\nopen('.git/hooks/post-checkout','w').write('planted')"}))?;
    assert_eq!(status, 200, "{r}");
    assert!(r["commitId"].is_string(), "{r}");
    let first = r["executionId"].as_str().ok_or("id")?.to_owned();
    let (status, history) = server.call(
        "GET",
        &format!("/api/v1/sandboxes/{id}/history?limit=1"),
        None,
    )?;
    assert_eq!(status, 200);
    assert_eq!(
        history["history"][0]["files"],
        json!([".git/hooks/post-checkout", "proj/.git/HEAD", "proj/app.py"])
    );
    // Later execs, uploads and rollbacks still work.
    let (status, r) = server.exec(
        &id,
        json!({"code": "open('proj/.git/HEAD','w').write('changed')"}),
    )?;
    assert_eq!(status, 200, "{r}");
    assert!(r["commitId"].is_string(), "{r}");
    assert_eq!(
        put(&server, &id, "proj/.git/config", b"[core]")?.status,
        201
    );
    let (status, diff) = server.call(
        "POST",
        &format!("/api/sandbox/{id}/diff"),
        Some(json!({"fromExecId": first})),
    )?;
    assert_eq!(status, 200, "{diff}");
    let changed: Vec<&String> = diff["diff"].as_object().ok_or("diff")?.keys().collect();
    assert_eq!(changed, ["proj/.git/HEAD", "proj/.git/config"]);
    let (status, r) = server.call(
        "POST",
        &format!("/api/sandbox/{id}/rollback"),
        Some(json!({"executionId": first})),
    )?;
    assert_eq!(status, 200, "{r}");
    assert_eq!(
        String::from_utf8(get(&server, &id, "proj/.git/HEAD")?.body)?,
        "ref: refs/heads/main\n"
    );
    assert_eq!(get(&server, &id, "proj/.git/config")?.status, 404);
    // Back to the empty workspace: the planted root `.git` goes too.
    let (status, r) = server.call(
        "POST",
        &format!("/api/sandbox/{id}/rollback"),
        Some(json!({"executionId": "initial"})),
    )?;
    assert_eq!(status, 200, "{r}");
    let (_, list) = server.call("GET", &format!("/api/v1/sandboxes/{id}/files"), None)?;
    assert_eq!(list["files"], json!([]), "rollback to initial left files");
    assert!(!workspace(&server, &id).join(".git").exists());
    Ok(())
}

fn head_ref(git_dir: &Path) -> Res<PathBuf> {
    let head = std::fs::read_to_string(git_dir.join("HEAD"))?;
    let name = head
        .trim()
        .strip_prefix("ref: ")
        .ok_or("HEAD is not a ref")?;
    Ok(git_dir.join(name))
}

/// Issue 12, item 3: lock files and write temporaries left by a kill are swept at start-up;
/// a change that cannot be recorded still answers with the run's result and says so.
#[test]
fn issue12_kill_leftovers_are_recovered_and_results_never_lost() -> TestResult {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    let server = start(Options {
        data: Some(&data),
        ..Options::default()
    })?;
    let id = server.new_sandbox("python")?;
    let git = data.join("sandboxes").join(&id).join("history.git");
    // A new sandbox's history is made on first use (here: reading it).
    assert!(!git.exists(), "a new sandbox made its history eagerly");
    let (status, history) = server.call("GET", &format!("/api/v1/sandboxes/{id}/history"), None)?;
    assert_eq!(status, 200, "{history}");
    assert_eq!(
        history["history"].as_array().map(Vec::len),
        Some(1),
        "{history}"
    );
    let branch = head_ref(&git)?;

    // A commit that cannot happen (its ref is locked): the run's result comes back anyway.
    let lock = branch.with_extension("lock");
    std::fs::write(&lock, "")?;
    let (status, r) = server.exec(
        &id,
        json!({"code": "open('a.txt','w').write('a')\nprint('ran once')"}),
    )?;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["stdout"], "ran once\n");
    assert_eq!(r["historyRecorded"], false);
    assert_eq!(r["commitId"], Value::Null);
    let warning = r["warnings"][0].as_str().unwrap_or_default();
    assert!(warning.contains("not recorded"), "{r}");
    assert!(!warning.contains(&*data.to_string_lossy()), "{warning}");

    // kill -9 leaves locks and temporaries; the restarted server sweeps them.
    drop(server);
    std::fs::write(git.join("index.lock"), "")?;
    let scratch = data.join("sandboxes").join(&id).join(".tmp");
    std::fs::create_dir_all(&scratch)?;
    std::fs::write(
        scratch.join("kiln-0123456789abcdef01234567"),
        "half an upload",
    )?;
    std::fs::write(
        data.join("sandboxes")
            .join(&id)
            .join(".meta.json.00ff00ff00ff00ff.tmp"),
        "{",
    )?;
    // A history cut short while it was being made on first use.
    let pending = data
        .join("sandboxes")
        .join(&id)
        .join(".history.git.00ff00ff00ff00ff.pending");
    std::fs::create_dir_all(pending.join("objects"))?;
    let server = start(Options {
        data: Some(&data),
        ..Options::default()
    })?;
    assert!(!lock.exists() && !git.join("index.lock").exists());
    assert!(
        !pending.exists(),
        "a half-made history was left at start-up"
    );
    assert_eq!(
        std::fs::read_dir(&scratch).map(|d| d.count()).unwrap_or(0),
        0
    );
    let (status, r) = server.exec(&id, json!({"code": "open('b.txt','w').write('b')"}))?;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["historyRecorded"], true);
    assert!(r["commitId"].is_string(), "{r}");
    // The change the lock kept out is in this commit; no temporary is listed or recorded.
    let (_, history) = server.call(
        "GET",
        &format!("/api/v1/sandboxes/{id}/history?limit=1"),
        None,
    )?;
    assert_eq!(history["history"][0]["files"], json!(["a.txt", "b.txt"]));
    let (_, list) = server.call("GET", &format!("/api/v1/sandboxes/{id}/files"), None)?;
    let paths: Vec<&str> = list["files"]
        .as_array()
        .ok_or("files")?
        .iter()
        .filter_map(|f| f["path"].as_str())
        .collect();
    assert_eq!(paths, ["a.txt", "b.txt"]);
    let names: Vec<String> = std::fs::read_dir(data.join("sandboxes").join(&id))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert_eq!(names, [".tmp"]);
    Ok(())
}

/// Issue 12, item 4: renewals, session creates and closes, execs (and the usage flush they
/// cause) race on one sandbox's record for 30 s: no error at all.
#[test]
fn issue12_concurrent_record_writes_never_fail() -> TestResult {
    let server = Arc::new(start(Options {
        extra: &["--rate-limit", "0"],
        ..Options::default()
    })?);
    let id = server.new_sandbox("python")?;
    let stop = Arc::new(AtomicBool::new(false));
    let failures = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let counts = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for role in 0..4 {
        let (server, id, stop, failures, counts) = (
            server.clone(),
            id.clone(),
            stop.clone(),
            failures.clone(),
            counts.clone(),
        );
        workers.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let outcome = match role {
                    0 | 1 => server.call(
                        "POST",
                        &format!("/api/v1/sandboxes/{id}/renew"),
                        Some(json!({"timeoutMs": 600000})),
                    ),
                    2 => server
                        .call(
                            "POST",
                            &format!("/api/v1/sandboxes/{id}/sessions"),
                            Some(json!({})),
                        )
                        .and_then(|(status, body)| {
                            if status != 201 {
                                return Ok((status, body));
                            }
                            let sid = body["sessionId"].as_str().unwrap_or_default().to_owned();
                            server.call(
                                "DELETE",
                                &format!("/api/v1/sandboxes/{id}/sessions/{sid}"),
                                None,
                            )
                        }),
                    _ => server.exec(&id, json!({"code": "print(1)"})),
                };
                counts.fetch_add(1, Ordering::Relaxed);
                match outcome {
                    // 409: the sandbox was busy with another exec (not an error of the record).
                    Ok((status, _)) if status < 300 || status == 409 => {}
                    Ok((status, body)) => failures
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(format!("role {role}: {status} {body}")),
                    Err(e) => failures
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(format!("role {role}: {e}")),
                }
            }
        }));
    }
    std::thread::sleep(Duration::from_secs(30));
    stop.store(true, Ordering::Relaxed);
    for worker in workers {
        worker.join().map_err(|_| "worker panicked")?;
    }
    let failures = failures.lock().unwrap_or_else(|e| e.into_inner());
    eprintln!("{} requests in 30 s", counts.load(Ordering::Relaxed));
    assert!(
        failures.is_empty(),
        "{} failed: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert!(counts.load(Ordering::Relaxed) > 100);
    let (status, info) = server.call("GET", &format!("/api/v1/sandboxes/{id}"), None)?;
    assert_eq!(status, 200, "{info}");
    Ok(())
}

/// Issue 12, item 5: counts and sizes. A `files` map over the per-execution file count is
/// refused whole; a huge sparse file is left out of history (never read, with a warning) and
/// downloads stream in bounded memory.
#[test]
fn issue12_sizes_and_counts_are_bounded() -> TestResult {
    let server = start(Options::default())?;
    let id = server.new_sandbox("python")?;
    let ws = workspace(&server, &id);

    let files: serde_json::Map<String, Value> = (0..1001)
        .map(|i| (format!("f/{i}.txt"), json!("x")))
        .collect();
    let (status, r) = server.exec(&id, json!({"code": "1", "files": files}))?;
    assert_eq!(status, 413, "{r}");
    assert_eq!(r["error"]["code"], "TOO_MANY_FILES");
    assert_eq!(r["error"]["details"]["limit"], 1000);
    assert!(!ws.join("f").exists(), "a refused files map wrote files");

    // The guest cannot make a file beyond its write budget, however sparse.
    let (status, r) = server.exec(&id, json!({"code": "f = open('sparse.bin', 'wb')\ntry:\n    f.seek(1 << 30)\n    f.write(b'x')\n    f.close()\n    print('written')\nexcept OSError as e:\n    print('refused', e.errno)"}))?;
    assert_eq!(status, 200, "{r}");
    assert!(
        r["stdout"]
            .as_str()
            .unwrap_or_default()
            .starts_with("refused"),
        "{r}"
    );
    // One planted from outside is left out of the history, at once, with a warning.
    let file = std::fs::File::create(ws.join("huge.bin"))?;
    file.set_len(1 << 30)?;
    drop(file);
    let (status, r) = server.exec(&id, json!({"code": "open('small.txt','w').write('s')"}))?;
    assert_eq!(status, 200, "{r}");
    assert!(
        r["warnings"].to_string().contains("huge.bin"),
        "no warning about huge.bin: {r}"
    );
    // A 1 GiB download streams: the server's memory does not grow by the file's size.
    let pid = server.child.0.id();
    let rss = || -> Res<u64> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        let line = status
            .lines()
            .find(|l| l.starts_with("VmRSS:"))
            .ok_or("VmRSS")?;
        Ok(line.split_whitespace().nth(1).ok_or("kB")?.parse::<u64>()? * 1024)
    };
    let before = rss()?;
    let response = ureq::get(&file_url(&server, &id, "huge.bin"))
        .timeout(Duration::from_secs(120))
        .call()?;
    let mut reader = response.into_reader();
    let mut total = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    let mut peak = before;
    loop {
        let n = std::io::Read::read(&mut reader, &mut buf)?;
        if n == 0 {
            break;
        }
        total += n as u64;
        if total % (64 << 20) < (1 << 20) {
            peak = peak.max(rss()?);
        }
    }
    assert_eq!(total, 1 << 30);
    eprintln!(
        "server RSS {} MiB before, peak {} MiB while streaming 1 GiB",
        before >> 20,
        peak >> 20
    );
    assert!(peak < before + (128 << 20), "the download was buffered");
    Ok(())
}

struct Unmount(PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// Issue 12, item 5: a full disk answers 507 and loses nothing acknowledged; once space is
/// freed, writes work again. The data folder is a 24 MiB tmpfs (the suite runs as root, as
/// CI does).
#[test]
fn issue12_a_full_disk_answers_507_and_recovers() -> TestResult {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data)?;
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=24m", "tmpfs"])
        .arg(&data)
        .status()?;
    assert!(
        mounted.success(),
        "this test mounts a small tmpfs and needs root (CI runs as root)"
    );
    let _unmount = Unmount(data.clone());
    let server = start(Options {
        data: Some(&data),
        ..Options::default()
    })?;
    let id = server.new_sandbox("python")?;
    let chunk = vec![7u8; 4 << 20];
    let mut acked = Vec::new();
    let mut full = None;
    for i in 0..20 {
        let name = format!("fill{i}.bin");
        let reply = put(&server, &id, &name, &chunk)?;
        match reply.status {
            201 => acked.push(name),
            _ => {
                full = Some(reply);
                break;
            }
        }
    }
    let full = full.ok_or("the disk never filled")?;
    assert_eq!(full.status, 507, "{}", String::from_utf8_lossy(&full.body));
    assert_eq!(error_code(&full), "INSUFFICIENT_STORAGE");
    // An exec that writes on a full disk: the run's answer comes back, the history says what
    // it could not record; nothing is a 500.
    let (status, r) = server.exec(&id, json!({"code": "print('still runs')"}))?;
    assert!(status == 200 || status == 507, "{status} {r}");
    // Everything acknowledged is there, byte for byte.
    for name in &acked {
        let reply = get(&server, &id, name)?;
        assert_eq!(reply.status, 200, "{name}");
        assert_eq!(reply.body.len(), chunk.len(), "{name}");
    }
    // Free space; writes work again.
    for name in &acked {
        let reply = send("DELETE", &file_url(&server, &id, name), None, None)?;
        assert!(matches!(reply.status, 200 | 507), "{}", reply.status);
    }
    let scratch_and_ws_free =
        || -> Res<u16> { Ok(put(&server, &id, "after.txt", b"works")?.status) };
    let mut status = 0;
    for _ in 0..20 {
        status = scratch_and_ws_free()?;
        if status == 201 {
            break;
        }
        // Deleting recorded files frees workspace space; history keeps their blobs, so the
        // history may still be full: free what the test itself owns.
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        status, 201,
        "writes did not work again after space was freed"
    );
    assert_eq!(get(&server, &id, "after.txt")?.body, b"works");
    Ok(())
}

/// Issue 18: runs that change no file are no longer staged (the engine's `files_changed`;
/// the engine's own tests prove the flag), so what must hold here is that no change is
/// lost: a reading run records nothing, and every kind of change is still recorded — in
/// one-shots, in session turns, through a link the guest planted, and by a write to a file
/// a session opened in an earlier turn. (An upload landing while a reading execution runs:
/// `serve::files_work_while_an_execution_runs`.)
#[test]
fn issue18_only_runs_that_change_files_are_recorded() -> TestResult {
    let server = start(Options::default())?;
    let id = server.new_sandbox("python")?;
    let history_len = |server: &Server| -> Res<usize> {
        let (status, body) =
            server.call("GET", &format!("/api/v1/sandboxes/{id}/history"), None)?;
        assert_eq!(status, 200, "{body}");
        Ok(body["history"].as_array().map_or(0, Vec::len))
    };
    let run = |code: &str, session: Option<&str>| -> Res<Value> {
        let mut body = json!({ "code": code });
        if let Some(session) = session {
            body["sessionId"] = json!(session);
        }
        let (status, reply) = server.exec(&id, body)?;
        assert_eq!(status, 200, "{reply}");
        assert_eq!(reply["status"], "success", "{code}: {reply}");
        assert_eq!(reply["historyRecorded"], true, "{reply}");
        Ok(reply)
    };
    let reply = run(
        "open('a.txt', 'w').write('a')\nimport os\nos.mkdir('d')\nos.symlink('a.txt', 'link')",
        None,
    )?;
    assert!(reply["commitId"].is_string(), "{reply}");
    let recorded = history_len(&server)?;

    // Reading, listing, stat-ing, following the guest's own link: nothing to record.
    let reply = run(
        "import os\nprint(open('a.txt').read(), open('link').read(), sorted(os.listdir('.')), os.stat('d').st_mode > 0)",
        None,
    )?;
    assert_eq!(
        reply["stdout"], "a a ['a.txt', 'd', 'link'] True\n",
        "{reply}"
    );
    assert!(reply["commitId"].is_null(), "{reply}");
    assert_eq!(history_len(&server)?, recorded);

    // Each change is recorded, one-shot by one-shot.
    for code in [
        "open('a.txt', 'a').write('b')",
        "open('link', 'w').write('through the link')",
        "open('b.txt', 'w').close()",
        "import os\nos.rename('b.txt', 'd/c.txt')",
        "import os\nos.truncate('a.txt', 0)",
        "import os\nos.remove('d/c.txt')",
    ] {
        let before = history_len(&server)?;
        let reply = run(code, None)?;
        assert!(reply["commitId"].is_string(), "{code}: {reply}");
        assert_eq!(history_len(&server)?, before + 1, "{code}");
    }

    // Session turns: a reading turn records nothing; a write to a file the session opened
    // in an earlier turn is this turn's change.
    let (status, body) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/sessions"),
        Some(json!({ "language": "python" })),
    )?;
    assert_eq!(status, 201, "{body}");
    let session = body["sessionId"]
        .as_str()
        .ok_or("no session id")?
        .to_owned();
    let opened = run("f = open('kept.txt', 'w')", Some(&session))?;
    assert!(
        opened["commitId"].is_string(),
        "the file was created: {opened}"
    );
    let before = history_len(&server)?;
    let read = run("print(open('a.txt').read())", Some(&session))?;
    assert!(read["commitId"].is_null(), "{read}");
    assert_eq!(history_len(&server)?, before);
    let wrote = run("f.write('later')\nf.flush()", Some(&session))?;
    assert!(wrote["commitId"].is_string(), "{wrote}");
    assert_eq!(
        std::fs::read_to_string(workspace(&server, &id).join("kept.txt"))?,
        "later"
    );
    Ok(())
}
