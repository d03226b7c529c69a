//! `kiln exec --template`: Linux boxes from the command line, as a user runs them, and what a
//! killed kiln leaves behind. They need root, runc, the static guest agent and the python and
//! debian templates (`scripts/test` builds them); KILN_SKIP_LINUX=1 skips them.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::common::serve::kiln;

fn skip() -> bool {
    crate::common::skip_linux()
}

fn run(state: &Path, args: &[&str]) -> (i32, String, String) {
    let out = kiln()
        .arg("exec")
        .args(args)
        .env("KILN_STATE_DIR", state)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn kiln_exec_runs_commands_and_code_in_a_fresh_box_with_its_limits() {
    if skip() {
        return;
    }
    let state = tempfile::tempdir().unwrap();
    let state = state.path();
    let (code, out, err) = run(
        state,
        &[
            "--template",
            "python",
            "--",
            "python3",
            "-c",
            "import sys; print(sys.version_info[:2]); sys.exit(4)",
        ],
    );
    assert_eq!((code, out.as_str()), (4, "(3, 11)\n"), "{err}");

    // -c runs code in the template's first language: bash for debian.
    let (code, out, err) = run(
        state,
        &["--template", "debian", "-c", "echo $((6*7)) $(id -un)"],
    );
    assert_eq!((code, out.as_str()), (0, "42 user\n"), "{err}");
    let (_, out, _) = run(state, &["--template", "debian", "--root", "--", "id", "-u"]);
    assert_eq!(out, "0\n");

    // The workspace is the working directory.
    let workspace = tempfile::tempdir().unwrap();
    std::fs::write(workspace.path().join("in.txt"), "from the host").unwrap();
    let ws = workspace.path().to_str().unwrap();
    let (code, out, err) = run(
        state,
        &[
            "--template",
            "debian",
            "--workspace",
            ws,
            "--",
            "sh",
            "-c",
            "pwd; cat in.txt; echo made > out.txt",
        ],
    );
    assert_eq!(
        (code, out.as_str()),
        (0, "/workspace\nfrom the host"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(workspace.path().join("out.txt")).unwrap(),
        "made\n"
    );

    // Limits: the timeout (124) and the memory limit (125), each said on stderr.
    let (code, _, err) = run(
        state,
        &[
            "--template",
            "debian",
            "--timeout",
            "500ms",
            "--",
            "sleep",
            "10",
        ],
    );
    assert_eq!(code, 124, "{err}");
    assert!(err.contains("time limit"), "{err}");
    let (code, _, err) = run(
        state,
        &[
            "--template",
            "python",
            "--memory",
            "64m",
            "--",
            "python3",
            "-c",
            "x = bytearray(200 << 20)",
        ],
    );
    assert_eq!(code, 125, "{err}");
    assert!(err.contains("killed for memory"), "{err}");

    // --json, and clear errors for what cannot run.
    let (code, out, _) = run(
        state,
        &[
            "--template",
            "debian",
            "--json",
            "--",
            "sh",
            "-c",
            "echo o; echo e >&2; exit 3",
        ],
    );
    assert_eq!(code, 3);
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (
            json["stdout"].as_str(),
            json["stderr"].as_str(),
            json["exit_code"].as_i64()
        ),
        (Some("o\n"), Some("e\n"), Some(3))
    );
    let (code, _, err) = run(state, &["--template", "cobol", "--", "true"]);
    assert_ne!(code, 0);
    assert!(
        err.contains("no Linux template is named \"cobol\"") && err.contains("python"),
        "{err}"
    );
    let (code, _, err) = run(state, &["--template", "debian", "--", "no-such-program"]);
    assert_ne!(code, 0);
    assert!(err.contains("no-such-program: command not found"), "{err}");
    let (code, _, err) = run(
        state,
        &[
            "--template",
            "debian",
            "--network",
            "everything",
            "--",
            "true",
        ],
    );
    assert_ne!(code, 0);
    assert!(err.contains("--network is none or allowlist"), "{err}");
}

/// A `kiln exec` whose box runs `sleep SECONDS`, once the sleep runs.
fn sleep_in_a_box(state: &Path, seconds: &str) -> std::process::Child {
    let child = kiln()
        .args(["exec", "--template", "debian", "--", "sleep", seconds])
        .env("KILN_STATE_DIR", state)
        .spawn()
        .unwrap();
    let started = Instant::now();
    while processes(&format!("sleep {seconds}")) == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the box never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

/// The boxes in a state folder, of every kiln process's folder in it.
fn box_dirs(state: &Path) -> Vec<String> {
    let Ok(processes) = std::fs::read_dir(state) else {
        return Vec::new();
    };
    processes
        .flatten()
        .filter_map(|p| std::fs::read_dir(p.path().join("boxes")).ok())
        .flat_map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
        })
        .collect()
}

/// Host processes whose command line is exactly `argv`.
fn processes(argv: &str) -> usize {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .filter(|c| String::from_utf8_lossy(c).replace('\0', " ").trim() == argv)
        .count()
}

#[test]
fn kilns_sharing_a_state_folder_leave_each_others_boxes_alone() {
    if skip() {
        return;
    }
    let state = tempfile::tempdir().unwrap();
    let marker = "sleep 86398.5";
    let mut first = sleep_in_a_box(state.path(), "86398.5");
    // A second kiln on the same folder runs its own box and leaves the first one running.
    let (code, out, err) = run(
        state.path(),
        &["--template", "debian", "--", "echo", "second"],
    );
    assert_eq!((code, out.as_str()), (0, "second\n"), "{err}");
    assert_eq!(
        processes(marker),
        1,
        "the second kiln removed the first one's box"
    );
    first.kill().unwrap();
    first.wait().unwrap();
    // The first kiln died: the next one on the folder removes what it left.
    let (code, _, err) = run(state.path(), &["--template", "debian", "--", "true"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        box_dirs(state.path()).is_empty(),
        "{:?}",
        box_dirs(state.path())
    );
}

#[test]
fn a_box_left_by_a_killed_kiln_is_removed_by_the_next_one() {
    if skip() {
        return;
    }
    let state = tempfile::tempdir().unwrap();
    let marker = "sleep 86399.5";
    let mut child = sleep_in_a_box(state.path(), "86399.5");
    let left = box_dirs(state.path());
    assert_eq!(left.len(), 1, "{left:?}");
    // kill -9: kiln cannot clean up. Its end of the agent's channel closes, so the agent
    // kills what it started and the box's processes end; its mounts and folder stay.
    child.kill().unwrap();
    child.wait().unwrap();
    let killed = Instant::now();
    while processes(marker) > 0 {
        assert!(
            killed.elapsed() < Duration::from_secs(5),
            "the box's process outlived kiln"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        mounts.contains(&left[0]),
        "the left box's layers should still be mounted"
    );

    // The next kiln on the same state folder removes what is left: container, mounts, folder.
    let (code, _, err) = run(state.path(), &["--template", "debian", "--", "true"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        box_dirs(state.path()).is_empty(),
        "{:?}",
        box_dirs(state.path())
    );
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mounts.contains(&left[0]),
        "a mount of the left box remains"
    );
    for cgroup in ["/sys/fs/cgroup/memory/kiln", "/sys/fs/cgroup/kiln"] {
        let dir = Path::new(cgroup).join(&left[0]);
        assert!(
            !dir.exists(),
            "the left box's cgroup remains: {}",
            dir.display()
        );
    }
    // The dead kiln's folder (its runc state with it) is gone; only the last kiln's is left.
    let folders: Vec<_> = std::fs::read_dir(state.path()).unwrap().flatten().collect();
    assert_eq!(folders.len(), 1, "{folders:?}");
    let runc = std::fs::read_dir(folders[0].path().join("runc"))
        .unwrap()
        .count();
    assert_eq!(runc, 0, "runc still knows a box");
}

/// Seed 003's flow on a Linux template through `kiln serve --linux`: Docker images resolve to
/// Linux templates, commands run as given in the sandbox's live box (multi-file Python,
/// node), history records what they write, a missing program is exit 127, the default
/// language stays WebAssembly, and deleting the sandbox closes its box.
#[test]
fn kiln_serve_linux_runs_seed_003_commands_in_live_boxes() -> crate::common::serve::TestResult {
    if skip() {
        return Ok(());
    }
    use crate::common::serve::{Options, start};
    use serde_json::json;
    let state = tempfile::tempdir()?;
    let state_dir = state.path().to_str().ok_or("path")?;
    // This host reaches the package index through a TLS-inspecting proxy whose CA only the
    // host's bundle has: boxes get the host's bundle by default (no KILN_BOX_CA_BUNDLE).
    let server = start(Options {
        // No warm pool: this test counts the boxes (and volumes) its sandboxes make.
        extra: &["--linux", "--target-pool-size", "0"],
        env: &[("KILN_STATE_DIR", state_dir)],
        ..Options::default()
    })?;
    let (status, created) = server.call(
        "POST",
        "/api/sandbox",
        Some(json!({"image": "python:3.11-slim"})),
    )?;
    assert_eq!(status, 201, "{created}");
    let id = created["containerId"].as_str().ok_or("no id")?.to_string();
    assert_eq!(created["template"], "linux-python", "{created}");
    let (_, info) = server.call("GET", &format!("/api/sandbox/{id}"), None)?;
    assert_eq!(info["template"], "linux-python", "{info}");
    // What the sandbox really got, with the installed versions.
    let described = info["templateDescription"].as_str().unwrap_or("");
    assert!(described.contains("python3 3.11"), "{info}");

    let (status, ran) = server.call(
        "POST",
        "/api/sandbox/exec",
        Some(json!({"containerId": id, "command": ["python", "main.py", "arg"],
                    "files": {"main.py": "import sys, helper; print(helper.x, sys.version_info[:2], sys.argv[1:])",
                              "helper.py": "x = 42"}})),
    )?;
    assert_eq!(status, 200, "{ran}");
    assert_eq!(ran["stdout"], "42 (3, 11) ['arg']\n", "{ran}");
    assert_eq!(ran["status"], "success");

    let (_, ran) = server.call(
        "POST",
        "/api/sandbox/exec",
        Some(json!({"containerId": id, "command": ["sh", "-c", "echo made > out.txt; id -un"]})),
    )?;
    assert_eq!(ran["stdout"], "user\n", "{ran}");
    let (_, history) = server.call("GET", &format!("/api/sandbox/{id}/history"), None)?;
    assert_eq!(
        history["history"][0]["files"],
        json!(["out.txt"]),
        "{history}"
    );

    let (_, ran) = server.call(
        "POST",
        "/api/sandbox/exec",
        Some(json!({"containerId": id, "command": ["no-such-tool"]})),
    )?;
    assert_eq!(ran["exitCode"], 127, "{ran}");
    assert!(
        ran["stderr"]
            .as_str()
            .unwrap_or("")
            .contains("command not found"),
        "{ran}"
    );
    let (status, ran) = server.call(
        "POST",
        "/api/sandbox/exec",
        Some(json!({"containerId": id, "command": []})),
    )?;
    assert_eq!(status, 400, "{ran}");

    // node:18 is Linux Node.js; a sandbox by language stays WebAssembly.
    let (_, node) = server.call("POST", "/api/sandbox", Some(json!({"image": "node:18"})))?;
    let node_id = node["containerId"].as_str().ok_or("no id")?;
    let (_, ran) = server.call(
        "POST",
        "/api/sandbox/exec",
        Some(json!({"containerId": node_id, "command": ["node", "-e", "console.log({a: [1]}, process.version.split('.')[0])"]})),
    )?;
    assert_eq!(ran["stdout"], "{ a: [ 1 ] } v18\n", "{ran}");
    let wasm = server.new_sandbox("python")?;
    let (_, info) = server.call("GET", &format!("/api/sandbox/{wasm}"), None)?;
    assert_eq!(info["template"], "python", "{info}");

    // /api/v1: commands, and a Python session that keeps its variables in the box.
    let (_, ran) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/exec"),
        Some(json!({"command": ["bash", "-c", "echo $GREETING from $(uname -s)"], "env": {"GREETING": "hi"}})),
    )?;
    assert_eq!(ran["stdout"], "hi from Linux\n", "{ran}");
    let (status, session) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/sessions"),
        Some(json!({})),
    )?;
    assert_eq!(status, 201, "{session}");
    let session = session["sessionId"]
        .as_str()
        .ok_or("no session")?
        .to_string();
    let turn = |code: &str, timeout: u64| {
        server.call(
            "POST",
            &format!("/api/v1/sandboxes/{id}/exec"),
            Some(json!({"code": code, "sessionId": session, "timeoutMs": timeout})),
        )
    };
    turn("import os\nx = 41", 10_000)?;
    let (_, ran) = turn("x += 1\nprint(x, os.getuid())", 10_000)?;
    assert_eq!(ran["stdout"], "42 1000\n", "{ran}");
    let (_, ran) = turn("1/0", 10_000)?;
    assert_eq!(ran["exitCode"], 1, "{ran}");
    let stderr = ran["stderr"].as_str().unwrap_or("");
    assert!(
        stderr.contains("ZeroDivisionError") && !stderr.contains("<string>"),
        "{ran}"
    );
    let (_, ran) = turn("print(x)", 10_000)?;
    assert_eq!(ran["stdout"], "42\n", "{ran}");
    let (_, ran) = turn("import time; time.sleep(5)", 300)?;
    assert_eq!(ran["outcome"], "timed_out", "{ran}");
    let (status, ran) = turn("print(x)", 10_000)?;
    assert_eq!(status, 409, "a timed-out session ends: {ran}");
    // A command on a WebAssembly sandbox is refused, not run elsewhere.
    let (status, ran) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{wasm}/exec"),
        Some(json!({"command": ["ls"]})),
    )?;
    assert_eq!(
        (status, ran["error"]["code"].as_str()),
        (400, Some("UNSUPPORTED")),
        "{ran}"
    );

    // Go and bash: a sandbox by language is a Linux one; code runs as the language runs it.
    let (status, go) = server.call("POST", "/api/v1/sandboxes", Some(json!({"language": "go"})))?;
    assert_eq!(
        (status, go["template"].as_str()),
        (201, Some("linux-go")),
        "{go}"
    );
    let go_id = go["containerId"].as_str().ok_or("no id")?.to_string();
    let (_, ran) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{go_id}/exec"),
        Some(json!({"code": "package main\nimport \"fmt\"\nfunc main() { fmt.Println(\"go\", 6*7) }"})),
    )?;
    assert_eq!(ran["stdout"], "go 42\n", "{ran}");
    let (_, ran) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{go_id}/exec"),
        Some(json!({"code": "echo $((2+3)) $(id -un)", "language": "bash"})),
    )?;
    assert_eq!(ran["stdout"], "5 user\n", "{ran}");
    let (_, bash) = server.call(
        "POST",
        "/api/v1/sandboxes",
        Some(json!({"language": "bash"})),
    )?;
    assert_eq!(bash["template"], "linux-debian", "{bash}");
    server.call("DELETE", &format!("/api/v1/sandboxes/{go_id}"), None)?;
    let bash_id = bash["containerId"].as_str().ok_or("no id")?;
    server.call("DELETE", &format!("/api/v1/sandboxes/{bash_id}"), None)?;

    // network: allowlist reaches the package index through kiln's proxy; none is the default;
    // WebAssembly has no network to allow.
    let (status, net) = server.call(
        "POST",
        "/api/v1/sandboxes",
        Some(json!({"image": "python:3.11", "network": "allowlist"})),
    )?;
    assert_eq!(
        (status, net["network"].as_str()),
        (201, Some("allowlist")),
        "{net}"
    );
    let net_id = net["containerId"].as_str().ok_or("no id")?.to_string();
    let (_, ran) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{net_id}/exec"),
        Some(json!({"command": ["sh", "-c", "pip download -q --no-deps -d /tmp six==1.16.0 && ls /tmp | grep -c six"], "timeoutMs": 120000})),
    )?;
    assert_eq!(ran["stdout"], "1\n", "{ran}");
    // pip's own exit code (not that of a pipe's last command) says it failed.
    let (_, ran) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/exec"),
        Some(json!({"command": ["sh", "-c", "out=$(pip download -q --no-deps -d /tmp six==1.16.0 2>&1); rc=$?; echo \"$out\" | tail -1; echo pip-rc=$rc"], "timeoutMs": 60000})),
    )?;
    let said = ran["stdout"].as_str().unwrap_or("");
    assert!(
        said.contains("pip-rc=") && !said.contains("pip-rc=0") && !said.contains("Saved"),
        "no network by default: {ran}"
    );
    server.call("DELETE", &format!("/api/v1/sandboxes/{net_id}"), None)?;
    let (status, refused) = server.call(
        "POST",
        "/api/v1/sandboxes",
        Some(json!({"language": "python", "network": "allowlist"})),
    )?;
    assert_eq!(
        (status, refused["error"]["code"].as_str()),
        (400, Some("UNSUPPORTED")),
        "{refused}"
    );
    let (status, refused) = server.call(
        "POST",
        "/api/sandbox",
        Some(json!({"image": "python:3.11", "options": {"network": "everything"}})),
    )?;
    assert_eq!(status, 400, "{refused}");

    // Deleting the sandboxes closes their boxes (the backend reaps within seconds).
    for sandbox in [id.as_str(), node_id] {
        let (status, _) = server.call("DELETE", &format!("/api/sandbox/{sandbox}"), None)?;
        assert_eq!(status, 200);
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    while !box_dirs(state.path()).is_empty() {
        assert!(
            Instant::now() < deadline,
            "boxes outlived their sandboxes: {:?}",
            box_dirs(state.path())
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

#[test]
fn kiln_serve_linux_sandboxes_get_the_resources_they_ask_for_and_a_capped_disk()
-> crate::common::serve::TestResult {
    if skip() {
        return Ok(());
    }
    use crate::common::serve::{Options, start};
    use serde_json::json;
    let state = tempfile::tempdir()?;
    let state_dir = state.path().to_str().ok_or("path")?;
    let server = start(Options {
        // No warm pool: this test counts the boxes (and volumes) its sandboxes make.
        extra: &["--linux", "--target-pool-size", "0"],
        env: &[("KILN_STATE_DIR", state_dir)],
        ..Options::default()
    })?;
    // Seed 002's limits at create, shown in the answer as the box really got them.
    let (status, created) = server.call(
        "POST",
        "/api/v1/sandboxes",
        Some(json!({"image": "debian", "resources": {"vcpus": 0.5, "memory_mb": 256, "disk_mb": 32, "pids": 64}})),
    )?;
    assert_eq!(status, 201, "{created}");
    assert_eq!(
        created["resources"],
        json!({"vcpus": 0.5, "memory_mb": 256, "disk_mb": 32, "pids": 64}),
        "{created}"
    );
    let id = created["containerId"].as_str().ok_or("no id")?.to_string();
    let exec = |command: &str| {
        server.call(
            "POST",
            &format!("/api/v1/sandboxes/{id}/exec"),
            Some(json!({"command": ["sh", "-c", command], "timeoutMs": 60000})),
        )
    };
    // Files the host writes (and the folders it makes for them) are the box user's, so the
    // code may change them in place.
    let (status, put) = server.call(
        "PUT",
        &format!("/api/v1/sandboxes/{id}/files/notes/up.txt"),
        Some(json!("one")),
    )?;
    assert!(status == 200 || status == 201, "{put}");
    let (_, ran) =
        exec("echo two >> notes/up.txt && stat -c %U notes notes/up.txt && cat notes/up.txt")?;
    assert_eq!(ran["stdout"], "user\nuser\n\"one\"two\n", "{ran}");
    // Disk: a write past 32 MiB fails with ENOSPC inside the box; the host loses nothing.
    let host_free = || {
        let path = std::ffi::CString::new(server.data.to_str().unwrap_or("/")).expect("a path");
        // SAFETY: statvfs fills the zeroed struct; `path` outlives the call.
        let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: `path` is a NUL-terminated CString alive for the call, which only reads it, and
        // `stat` is a valid, writable statvfs that it fills.
        assert_eq!(unsafe { libc::statvfs(path.as_ptr(), &mut stat) }, 0);
        stat.f_bavail * stat.f_frsize
    };
    let before = host_free();
    let (_, ran) = exec(
        "dd if=/dev/zero of=big bs=1M count=300 2>&1 | grep -o 'No space left on device'; stat -c %s big",
    )?;
    let out = ran["stdout"].as_str().unwrap_or("");
    assert!(out.starts_with("No space left on device\n"), "{ran}");
    let size: u64 = out.lines().nth(1).unwrap_or("").parse().unwrap_or(u64::MAX);
    assert!(size <= 32 << 20, "the file outgrew the disk: {size}");
    let lost = before.saturating_sub(host_free());
    assert!(
        lost < 100 << 20,
        "the host lost {lost} bytes to a 32 MiB disk"
    );
    // Files the host writes are held to the same disk, with an answer that says so.
    let (status, full) = server.call(
        "PUT",
        &format!("/api/v1/sandboxes/{id}/files/more.bin"),
        Some(json!("x".repeat(1 << 20))),
    )?;
    assert_eq!(
        (status, full["error"]["code"].as_str()),
        (507, Some("SANDBOX_DISK_FULL")),
        "{full}"
    );
    // Freeing space makes room again.
    let (_, ran) = exec("rm big && echo hi > small && cat small")?;
    assert_eq!(ran["stdout"], "hi\n", "{ran}");
    // Processes: the box holds at most 64 (tasks, its agent's threads included). The shell
    // that forks stops at the first fork refused; then the box counts what runs.
    let (_, ran) = exec(
        "(i=0; while [ $i -lt 200 ]; do sleep 3 </dev/null >/dev/null 2>&1 & i=$((i+1)); done) 2>/dev/null; set -- /proc/[0-9]*; echo $#",
    )?;
    let running: u64 = ran["stdout"]
        .as_str()
        .unwrap_or("")
        .trim()
        .parse()
        .unwrap_or(0);
    assert!((30..=64).contains(&running), "{running} processes: {ran}");
    // Links the box plants lead nowhere on the host: reading through them is refused.
    let (_, ran) = exec("ln -s /etc/passwd leak && ln -s / up && echo planted")?;
    assert_eq!(ran["stdout"], "planted\n", "{ran}");
    for path in ["leak", "up/etc/passwd"] {
        let (status, refused) =
            server.call("GET", &format!("/api/v1/sandboxes/{id}/files/{path}"), None)?;
        assert_eq!(
            (status, refused["error"]["code"].as_str()),
            (400, Some("INVALID_PATH")),
            "{path}: {refused}"
        );
    }
    // Bad resources are refused with the reason; WebAssembly takes memory only.
    for (body, code) in [
        (
            json!({"image": "debian", "resources": {"pids": 1}}),
            "INVALID_OPTION",
        ),
        (
            json!({"image": "debian", "resources": {"disk_mb": 1 << 30}}),
            "INVALID_OPTION",
        ),
        (
            json!({"image": "debian", "resources": {"vcpus": 1000}}),
            "INVALID_OPTION",
        ),
        (
            json!({"image": "debian", "resources": {"cpus": 1}}),
            "INVALID_REQUEST",
        ),
        (
            json!({"language": "python", "resources": {"pids": 64}}),
            "UNSUPPORTED",
        ),
        (
            json!({"image": "debian", "memoryLimit": "256m", "resources": {"memory_mb": 256}}),
            "INVALID_OPTION",
        ),
    ] {
        let (status, refused) = server.call("POST", "/api/v1/sandboxes", Some(body.clone()))?;
        assert_eq!(
            (status, refused["error"]["code"].as_str()),
            (400, Some(code)),
            "{body}: {refused}"
        );
    }
    // Seed 003's cpuLimit is the box's CPU quota on a Linux template.
    let (status, seed) = server.call(
        "POST",
        "/api/sandbox",
        Some(json!({"image": "debian", "options": {"cpuLimit": "0.25"}})),
    )?;
    assert_eq!(
        (status, &seed["resources"]["vcpus"]),
        (201, &json!(0.25)),
        "{seed}"
    );
    let (status, bad) = server.call(
        "POST",
        "/api/sandbox",
        Some(json!({"image": "debian", "options": {"cpuLimit": "lots"}})),
    )?;
    assert_eq!(status, 400, "{bad}");
    // A deleted sandbox's volume is unmounted at once; a kept one when kiln stops.
    let (status, _) = server.call("DELETE", &format!("/api/v1/sandboxes/{id}"), None)?;
    assert!(status == 200 || status == 204, "{status}");
    let data = server.data.to_string_lossy().into_owned();
    // Mounts whose mount point is in the data folder (a box's overlay names its upper layer
    // on the volume in its options, not in its mount point), but the named volumes' folder,
    // which kiln mounts on itself while it runs (shared, for its workers).
    let volumes_root = format!("{data}/volumes");
    let mounted = || {
        std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .lines()
            .filter(|l| {
                l.split(' ')
                    .nth(4)
                    .is_some_and(|point| point.contains(&data) && point != volumes_root)
            })
            .count()
    };
    assert_eq!(
        mounted(),
        1,
        "only the seed 003 sandbox's volume is mounted"
    );
    let mut server = server;
    // SAFETY: kill sends a signal to the server's pid, which this test started.
    unsafe { libc::kill(server.child.0.id() as i32, libc::SIGTERM) };
    let status = server.child.0.wait()?;
    assert!(status.success(), "kiln serve stopped with {status}");
    assert_eq!(mounted(), 0, "a volume stayed mounted after kiln stopped");
    Ok(())
}

/// Runs `kiln exec --template debian --network allowlist` with `allow` as its list, in a mount
/// namespace of its own whose `/etc/hosts` is `hosts`, so listed names resolve where the test
/// says; the box asks the proxy for a CONNECT to each of `names` and prints each answer.
fn through_the_proxy(state: &Path, hosts: &Path, allow: &str, names: &[&str]) -> String {
    let script = format!(
        "for h in {}; do printf '== %s\\n' $h; exec 3<>/dev/tcp/127.0.0.1/3128; \
         printf 'CONNECT %s:443 HTTP/1.1\\r\\nHost: %s:443\\r\\n\\r\\n' $h $h >&3; \
         timeout 15 head -c 400 <&3; echo; exec 3<&-; done",
        names.join(" ")
    );
    let out = std::process::Command::new("unshare")
        .args(["--mount", "--propagation", "private", "--", "sh", "-c"])
        .arg("mount --bind \"$0\" /etc/hosts && exec \"$@\"")
        .arg(hosts)
        .arg(kiln().get_program())
        .args([
            "exec",
            "--template",
            "debian",
            "--network",
            "allowlist",
            "--",
        ])
        .args(["bash", "-c", &script])
        .env("KILN_STATE_DIR", state)
        .env("KILN_NETWORK_ALLOW", allow)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The proxy's answer to each name in `through_the_proxy`'s output.
fn answers(out: &str) -> std::collections::HashMap<String, String> {
    out.split("== ")
        .filter_map(|part| part.split_once('\n'))
        .map(|(name, answer)| (name.trim().to_string(), answer.to_string()))
        .collect()
}

/// Issue 32: a listed name resolving to a private network's address (RFC 1918, CGNAT,
/// unique-local IPv6) or to the host's own is refused by the proxy, with the reason, unless
/// the operator lists that range or address; each name's own answer is checked.
#[test]
fn the_proxy_refuses_listed_names_that_lead_to_private_or_host_addresses() {
    if skip() {
        return;
    }
    let state = tempfile::tempdir().unwrap();
    let etc = tempfile::tempdir().unwrap();
    // One of this host's own addresses that is neither loopback nor link-local.
    let own = kiln_native::proxy::host_addresses()
        .into_iter()
        .find(|a| match a {
            std::net::IpAddr::V4(v4) => !v4.is_loopback() && !v4.is_link_local(),
            std::net::IpAddr::V6(_) => false,
        })
        .expect("this host has an IPv4 address besides loopback");
    let hosts = etc.path().join("hosts");
    std::fs::write(
        &hosts,
        format!(
            "127.0.0.1 localhost\n10.255.255.1 lan.test\n100.64.0.7 cgnat.test\n\
             192.168.7.7 home.test\nfd00:1::7 ula.test\n{own} me.test\n"
        ),
    )
    .unwrap();
    let names = ["lan.test", "cgnat.test", "home.test", "ula.test", "me.test"];
    let listed = names.join(",");

    let out = through_the_proxy(state.path(), &hosts, &listed, &names);
    let got = answers(&out);
    for (name, reason) in [
        (
            "lan.test",
            "10.255.255.1 is a private network's address (RFC 1918)",
        ),
        ("cgnat.test", "carrier-grade NAT"),
        ("home.test", "192.168.7.7 is a private network's address"),
        ("ula.test", "unique-local IPv6"),
        ("me.test", "one of this host's own addresses"),
    ] {
        let answer = got.get(name).map(String::as_str).unwrap_or("");
        assert!(
            answer.starts_with("HTTP/1.1 403 Forbidden") && answer.contains(reason),
            "{name}: {reason:?} not in {answer:?} ({out})"
        );
    }

    // The operator opens a range, and the host's address by itself: those names go through
    // (whatever the far end then answers); the others stay refused.
    let out = through_the_proxy(
        state.path(),
        &hosts,
        &format!("{listed},10.255.255.0/24,{own}"),
        &["lan.test", "me.test", "home.test"],
    );
    let got = answers(&out);
    for name in ["lan.test", "me.test"] {
        let answer = got.get(name).map(String::as_str).unwrap_or("");
        assert!(
            !answer.contains("403 Forbidden") && !answer.contains("may not reach"),
            "{name} should pass the address check: {answer:?} ({out})"
        );
    }
    let answer = got.get("home.test").map(String::as_str).unwrap_or("");
    assert!(answer.starts_with("HTTP/1.1 403 Forbidden"), "{out}");
}

/// Issue 32: boxes trust what the host trusts by default (its CA bundle, found as its tools
/// find it), `--box-ca-bundle FILE` overrides it and `--box-ca-bundle none` turns it off.
#[test]
fn boxes_get_the_hosts_ca_bundle_unless_told_otherwise() {
    if skip() {
        return;
    }
    let state = tempfile::tempdir().unwrap();
    let host = kiln_native::boxes::host_ca_bundle().expect("this host has a CA bundle");
    let show = [
        "--template",
        "debian",
        "--",
        "sh",
        "-c",
        "echo \"[$SSL_CERT_FILE] [$PIP_CERT]\"; cat /etc/ssl/certs/ca-certificates.crt",
    ];
    let (code, out, err) = run(state.path(), &show);
    assert_eq!(code, 0, "{err}");
    let (said, bundle) = out.split_once('\n').unwrap_or_default();
    let path = "/etc/ssl/certs/ca-certificates.crt";
    assert_eq!(said, format!("[{path}] [{path}]"));
    assert_eq!(bundle, std::fs::read_to_string(&host).unwrap());

    let mine = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(mine.path(), "-----BEGIN CERTIFICATE-----\nmine\n").unwrap();
    // Readable by the box's user, as a CA bundle is.
    std::fs::set_permissions(
        mine.path(),
        <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o644),
    )
    .unwrap();
    let mut args = vec!["--box-ca-bundle", mine.path().to_str().unwrap()];
    args.extend(show);
    let (code, out, err) = run(state.path(), &args);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.ends_with("\n-----BEGIN CERTIFICATE-----\nmine\n"),
        "{out}"
    );

    let mut args = vec!["--box-ca-bundle", "none"];
    args.extend(show);
    let (code, out, err) = run(state.path(), &args);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("[] []\n"), "{out}");

    let (code, _, err) = run(
        state.path(),
        &[
            "--box-ca-bundle",
            "/no/such/bundle.pem",
            "--template",
            "debian",
            "--",
            "true",
        ],
    );
    assert_ne!(code, 0);
    assert!(err.contains("--box-ca-bundle /no/such/bundle.pem"), "{err}");
}

/// Issue 32: a Linux sandbox whose disk the host cannot cover is refused at create (507),
/// before any volume is made; `KILN_DISK_OVERCOMMIT` sets how far sizes may pass free space.
#[test]
fn kiln_serve_linux_refuses_a_disk_the_host_cannot_cover() -> crate::common::serve::TestResult {
    if skip() {
        return Ok(());
    }
    use crate::common::serve::{Options, start};
    use serde_json::json;
    let state = tempfile::tempdir()?;
    let state_dir = state.path().to_str().ok_or("path")?;
    // An overcommit this small covers no volume at all.
    let server = start(Options {
        extra: &["--linux"],
        env: &[
            ("KILN_STATE_DIR", state_dir),
            ("KILN_DISK_OVERCOMMIT", "0.000001"),
        ],
        ..Options::default()
    })?;
    let (status, refused) = server.call(
        "POST",
        "/api/v1/sandboxes",
        Some(json!({"image": "debian", "resources": {"disk_mb": 64}})),
    )?;
    assert_eq!(
        (status, refused["error"]["code"].as_str()),
        (507, Some("INSUFFICIENT_STORAGE")),
        "{refused}"
    );
    let said = refused["error"]["message"].as_str().unwrap_or_default();
    assert!(
        said.contains("a disk of 64 MiB") && said.contains("KILN_DISK_OVERCOMMIT"),
        "{refused}"
    );
    let sandboxes = server.data.join("sandboxes");
    let left = std::fs::read_dir(&sandboxes).map_or(0, |d| d.count());
    assert_eq!(left, 0, "a refused create left a folder");
    // A WebAssembly sandbox has no volume and is made as before.
    let (status, made) = server.call(
        "POST",
        "/api/v1/sandboxes",
        Some(json!({"language": "python"})),
    )?;
    assert_eq!(status, 201, "{made}");
    Ok(())
}

/// Issue 34, gVisor: the same boxes under `runsc` (`--box-runtime runsc`): the guest sees
/// gVisor's kernel, not the host's; a workspace works both ways; the limits and refusals a
/// runc box has hold (no host files, mount refused, no network, the pids limit against a
/// fork bomb, the memory limit); the box is gone after.
#[test]
fn issue34_boxes_run_under_gvisor_with_the_same_refusals() {
    if skip() {
        return;
    }
    let state = tempfile::tempdir().unwrap();
    let state = state.path();
    let runsc = |args: &[&str]| {
        let mut all = vec!["--box-runtime", "runsc", "--template", "python"];
        all.extend_from_slice(args);
        run(state, &all)
    };
    let host_kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let (code, out, err) = runsc(&["--", "sh", "-c", "uname -r; id -un"]);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert!(
        lines.len() == 2
            && !lines[0].is_empty()
            && lines[0] != host_kernel.trim()
            && lines[1] == "user",
        "the box saw the host's kernel ({}): {out}",
        host_kernel.trim()
    );
    let workspace = tempfile::tempdir().unwrap();
    std::fs::write(workspace.path().join("in.txt"), "from the host").unwrap();
    let ws = workspace.path().to_str().unwrap();
    let (code, out, err) = runsc(&[
        "--workspace",
        ws,
        "--",
        "sh",
        "-c",
        "cat in.txt && echo from-the-box > out.txt",
    ]);
    assert_eq!((code, out.as_str()), (0, "from the host"), "{err}");
    assert_eq!(
        std::fs::read_to_string(workspace.path().join("out.txt")).unwrap(),
        "from-the-box\n"
    );
    // Refusals: the host's files, mounting, the network.
    let marker = format!("/tmp/kiln-gvisor-marker-{}", std::process::id());
    std::fs::write(&marker, "host").unwrap();
    let script = format!(
        "cat {marker} 2>/dev/null && echo host-file-seen; \
         mount -t tmpfs none /mnt 2>/dev/null && echo mounted; \
         python3 -c 'import socket; socket.create_connection((\"1.1.1.1\", 80), timeout=2)' 2>/dev/null && echo online; \
         echo done"
    );
    let (code, out, err) = runsc(&["--root", "--", "sh", "-c", &script]);
    std::fs::remove_file(&marker).unwrap();
    assert_eq!((code, out.as_str()), (0, "done\n"), "{err}");
    // A fork bomb meets the pids limit. Under gVisor the limit also counts the sentry's own
    // threads, so the box may end with it rather than refuse the fork: either way it is
    // contained, and the next box runs.
    let (_, out, err) = runsc(&[
        "--",
        "python3",
        "-c",
        "import os\nn = 0\ntry:\n    while n < 100000:\n        if os.fork() == 0:\n            import time; time.sleep(30)\n        n += 1\nexcept OSError:\n    print('limited at', n)\n",
    ]);
    assert!(
        out.starts_with("limited at") || err.contains("the box ended"),
        "{out} {err}"
    );
    let (code, out, err) = runsc(&["--", "echo", "still-serving"]);
    assert_eq!((code, out.as_str()), (0, "still-serving\n"), "{err}");
    // The memory limit: a 2 GiB allocation does not succeed.
    let (code, out, _) = runsc(&[
        "--",
        "python3",
        "-c",
        "x = b'k' * (2 << 30); print('allocated')",
    ]);
    assert!(code != 0 && !out.contains("allocated"), "{code} {out}");
    // Nothing is left: the boxes, their runsc state and their processes are gone.
    assert!(box_dirs(state).is_empty(), "{:?}", box_dirs(state));
    let root = state.to_string_lossy().into_owned();
    let left: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains(&root))
        .collect();
    assert!(left.is_empty(), "left running: {left:?}");
}

/// Issue 34, `kiln doctor`: each tier's availability on this host and why, as JSON; a
/// broken container runtime and CRIU turned off are reported as such.
#[test]
fn issue34_kiln_doctor_tells_what_this_host_can_run_and_why_not() {
    if skip() {
        return;
    }
    let doctor = |args: &[&str]| -> serde_json::Value {
        let out = kiln()
            .arg("doctor")
            .arg("--json")
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let status = |report: &serde_json::Value, name: &str| -> (String, String) {
        let found = report["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .unwrap_or_else(|| panic!("no {name} in {report}"));
        (
            found["status"].as_str().unwrap().to_string(),
            found["detail"].as_str().unwrap().to_string(),
        )
    };
    // This machine (the test suite's): runtimes fetched, templates built, runsc installed,
    // CRIU built by scripts/test, /dev/kvm a PVM, no microVM backend yet.
    let report = doctor(&[]);
    assert_eq!(status(&report, "webassembly").0, "ok", "{report}");
    let (runc, detail) = status(&report, "linux-runc");
    assert_eq!(runc, "ok", "{detail}");
    assert!(
        detail.contains("templates built: ") && detail.contains("python"),
        "{detail}"
    );
    assert_eq!(status(&report, "linux-gvisor").0, "ok", "{report}");
    assert_eq!(status(&report, "criu").0, "ok", "{report}");
    let kvm = status(&report, "kvm").0;
    if std::path::Path::new("/dev/kvm").exists() {
        assert_ne!(kvm, "no", "{report}");
    } else {
        assert_eq!(kvm, "no", "{report}");
    }
    // QEMU and scripts/build-vm's kernel are here (scripts/test installs and fetches them):
    // microVMs run, under TCG on this PVM host, and the report says which.
    let (microvm, detail) = status(&report, "microvm");
    assert_ne!(microvm, "no", "{detail}");
    assert!(detail.contains("TCG") || detail.contains("KVM"), "{detail}");
    // Told otherwise, it says what is wrong.
    let report = doctor(&["--container-runtime", "/nonexistent/runc", "--criu", "none"]);
    let (runc, detail) = status(&report, "linux-runc");
    assert_eq!(runc, "no", "{detail}");
    assert!(detail.contains("/nonexistent/runc"), "{detail}");
    let (criu, detail) = status(&report, "criu");
    assert_eq!(criu, "no", "{detail}");
    assert!(detail.contains("files only"), "{detail}");
}

/// Issue 34: `/readyz` carries the tiers as `kiln doctor` found them at start, each with
/// whether this server runs sandboxes on it.
#[test]
fn issue34_readyz_reports_each_tier_and_whether_it_is_served() -> crate::common::serve::TestResult {
    if skip() {
        return Ok(());
    }
    use crate::common::serve::{Options, start};
    let state = tempfile::tempdir()?;
    let state_dir = state.path().to_str().ok_or("path")?;
    let server = start(Options {
        extra: &["--linux", "--box-runtime", "runsc"],
        env: &[("KILN_STATE_DIR", state_dir)],
        ..Options::default()
    })?;
    let (status, ready) = server.call("GET", "/readyz", None)?;
    assert_eq!(status, 200, "{ready}");
    let tier = |name: &str| {
        ready["tiers"]
            .as_array()
            .and_then(|t| t.iter().find(|t| t["name"] == name))
            .cloned()
            .unwrap_or_else(|| panic!("no tier {name} in {ready}"))
    };
    assert_eq!(
        (
            tier("webassembly")["served"].clone(),
            tier("webassembly")["status"].clone()
        ),
        (serde_json::json!(true), serde_json::json!("ok")),
        "{ready}"
    );
    assert_eq!(tier("linux-gvisor")["served"], true, "{ready}");
    assert_eq!(tier("linux-runc")["served"], false, "{ready}");
    assert_eq!(tier("criu")["served"], false, "{ready}");
    assert_eq!(tier("microvm")["served"], false, "{ready}");
    // And a gVisor box serves a command through the API.
    let (status, created) = server.call(
        "POST",
        "/api/v1/sandboxes",
        Some(serde_json::json!({"template": "linux-python"})),
    )?;
    assert_eq!(status, 201, "{created}");
    let id = created["containerId"].as_str().ok_or("no id")?;
    let (status, ran) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/exec"),
        Some(serde_json::json!({"command": ["uname", "-r"]})),
    )?;
    assert_eq!((status, ran["exitCode"].as_i64()), (200, Some(0)), "{ran}");
    let host = std::fs::read_to_string("/proc/sys/kernel/osrelease")?;
    assert!(
        ran["stdout"]
            .as_str()
            .is_some_and(|k| !k.trim().is_empty() && k.trim() != host.trim()),
        "the box saw the host's kernel: {ran}"
    );
    Ok(())
}

/// A figure of `/metrics`: the sample whose name and labels start with `prefix`.
fn metric(server: &crate::common::serve::Server, prefix: &str) -> Option<f64> {
    let text = crate::common::serve::send("GET", &server.url("/metrics"), None, None).ok()?;
    String::from_utf8_lossy(&text.body)
        .lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The host pids of the guest agents of boxes whose root's writable layer is in `folder`.
fn agents_with_layer_in(folder: &Path) -> Vec<i32> {
    let needle = format!("upperdir={}", folder.display());
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.starts_with(b"/.kiln/agent"))
                && std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).is_ok_and(|m| {
                    m.lines()
                        .any(|l| l.contains(" / / ") && l.contains(&needle))
                })
        })
        .collect()
}

/// Mounts under `folder` on the host.
fn mounts_under(folder: &Path) -> usize {
    let folder = folder.to_string_lossy().into_owned();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter(|l| {
            l.split(' ')
                .nth(4)
                .is_some_and(|at| at.starts_with(&folder))
        })
        .count()
}

/// Seed 002's warm pool, for boxes: a template's pool fills in the background; a new sandbox
/// gets a box that already runs (its first command pays no start), on its own volume, its
/// files and the files outside the workspace its own; a member whose agent dies is dropped
/// and replaced; a burst of 50 creates on an emptied pool follows the policy (`reject`: the
/// ready ones are served, the rest refused at once with the reason); stopping kiln leaves no
/// member, and a kiln killed with -9 leaves none the next one keeps.
#[test]
fn issue34_a_warm_pool_hands_new_sandboxes_a_running_box_and_follows_its_policy()
-> crate::common::serve::TestResult {
    if skip() {
        return Ok(());
    }
    use crate::common::serve::{Options, send, start};
    use serde_json::json;
    let state = tempfile::tempdir()?;
    let state_dir = state.path().to_str().ok_or("path")?;
    let data = tempfile::tempdir()?;
    let env = [("KILN_STATE_DIR", state_dir)];
    let server = start(Options {
        data: Some(data.path()),
        extra: &[
            "--linux",
            "--language-pools",
            "python=2,debian=0,javascript=0,go=0",
            "--empty-pool-policy",
            "reject",
        ],
        env: &env,
        ..Options::default()
    })?;
    let ready = r#"kiln_pool_ready{template="linux-python",tier="box"}"#;
    wait_for("2 ready members", Duration::from_secs(60), || {
        metric(&server, ready) == Some(2.0)
    });
    assert_eq!(
        metric(&server, r#"kiln_pool_target{template="linux-debian""#),
        None,
        "a pool sized 0 is no pool"
    );
    let pool = data.path().join("pool");

    // A member whose agent dies is dropped and replaced.
    let agents = agents_with_layer_in(&pool);
    assert_eq!(agents.len(), 2, "two members' agents: {agents:?}");
    // SAFETY: kill sends a signal to a pid this test found (a box's agent).
    unsafe { libc::kill(agents[0], libc::SIGKILL) };
    wait_for("the dead member replaced", Duration::from_secs(30), || {
        metric(&server, r#"kiln_pool_lost_total{template="linux-python""#) == Some(1.0)
            && metric(&server, ready) == Some(2.0)
    });

    // A new sandbox's box already runs, on the sandbox's own volume.
    let (status, created) = server.call(
        "POST",
        "/api/v1/sandboxes",
        Some(json!({"template": "linux-python"})),
    )?;
    assert_eq!(status, 201, "{created}");
    let id = created["containerId"].as_str().ok_or("no id")?.to_string();
    let (_, info) = server.call("GET", &format!("/api/v1/sandboxes/{id}"), None)?;
    assert_eq!(
        info["state"], "running",
        "a box before the first command: {info}"
    );
    assert_eq!(
        metric(
            &server,
            r#"kiln_pool_claims_total{template="linux-python",tier="box",outcome="ready"}"#
        ),
        Some(1.0)
    );
    let put = send(
        "PUT",
        &server.url(&format!("/api/v1/sandboxes/{id}/files/hello.txt")),
        None,
        Some(("application/octet-stream", b"from the host")),
    )?;
    assert!(put.status == 200 || put.status == 201, "{}", put.status);
    let exec = |command: &str| {
        server.call(
            "POST",
            &format!("/api/v1/sandboxes/{id}/exec"),
            Some(json!({"command": ["sh", "-c", command]})),
        )
    };
    let (status, ran) = exec(
        "cat hello.txt; echo; id -u; pwd; echo mine > made.txt; echo kept > /home/user/outside; df -m . | tail -1 | awk '{print $2}'",
    )?;
    assert_eq!(status, 200, "{ran}");
    let out = ran["stdout"].as_str().unwrap_or_default().to_string();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[..3], ["from the host", "1000", "/workspace"], "{ran}");
    let size: u64 = lines[3].parse()?;
    assert!(
        (900..=1024).contains(&size),
        "the workspace is the sandbox's 1 GiB volume: {ran}"
    );
    let got = send(
        "GET",
        &server.url(&format!("/api/v1/sandboxes/{id}/files/made.txt")),
        None,
        None,
    )?;
    assert_eq!(String::from_utf8_lossy(&got.body), "mine\n");
    // What it writes outside the workspace is on its volume too: it outlives the box.
    let (status, slept) =
        server.call("POST", &format!("/api/v1/sandboxes/{id}/hibernate"), None)?;
    assert_eq!(status, 200, "{slept}");
    let (_, ran) = exec("cat /home/user/outside")?;
    assert_eq!(ran["stdout"], "kept\n", "{ran}");

    // reject: a burst of 50 creates is served by what is ready, the rest refused at once.
    wait_for("the pool refilled", Duration::from_secs(30), || {
        metric(&server, ready) == Some(2.0)
    });
    let started = Instant::now();
    let burst: Vec<_> = (0..50)
        .map(|_| {
            let url = server.url("/api/v1/sandboxes");
            std::thread::spawn(move || {
                send(
                    "POST",
                    &url,
                    None,
                    Some(("application/json", br#"{"template":"linux-python"}"#)),
                )
                .map(|r| (r.status, r.retry_after.clone(), r.json()))
                .map_err(|e| e.to_string())
            })
        })
        .collect();
    let mut made = 0;
    for handle in burst {
        let (status, retry, body) = handle.join().map_err(|_| "panicked")??;
        match status {
            201 => made += 1,
            503 => {
                assert!(
                    body.to_string()
                        .contains("warm pool of linux-python is empty and its policy is reject"),
                    "{body}"
                );
                assert!(retry.is_some(), "a refusal says when to retry: {body}");
            }
            other => panic!("{other}: {body}"),
        }
    }
    assert!(
        (2..=6).contains(&made),
        "{made} of 50 made from 2 ready members"
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "refusals are at once"
    );
    let rejected = metric(
        &server,
        r#"kiln_pool_claims_total{template="linux-python",tier="box",outcome="rejected"}"#,
    );
    assert_eq!(rejected, Some((50 - made) as f64));

    // Stopped, kiln leaves no member behind: no folder, no mount.
    wait_for("the pool refilled again", Duration::from_secs(30), || {
        metric(&server, ready) == Some(2.0)
    });
    drop(server);
    assert_eq!(
        std::fs::read_dir(&pool)?.count(),
        0,
        "members left after a stop"
    );
    assert_eq!(mounts_under(&pool), 0, "members' volumes left mounted");

    // Killed with -9, its members are removed by the next kiln.
    let server = start(Options {
        data: Some(data.path()),
        extra: &[
            "--linux",
            "--language-pools",
            "python=2,debian=0,javascript=0,go=0",
        ],
        env: &env,
        ..Options::default()
    })?;
    wait_for("2 ready members", Duration::from_secs(60), || {
        metric(&server, ready) == Some(2.0)
    });
    let mut server = server;
    // SAFETY: kill sends a signal to the server's pid, which this test started.
    unsafe { libc::kill(server.child.0.id() as i32, libc::SIGKILL) };
    server.child.0.wait()?;
    assert_eq!(std::fs::read_dir(&pool)?.count(), 2);
    assert_eq!(mounts_under(&pool), 2);
    let server = start(Options {
        data: Some(data.path()),
        extra: &["--linux", "--target-pool-size", "0"],
        env: &env,
        ..Options::default()
    })?;
    assert_eq!(
        std::fs::read_dir(&pool)?.count(),
        0,
        "a dead kiln's members were kept"
    );
    assert_eq!(mounts_under(&pool), 0);
    assert!(
        agents_with_layer_in(&pool).is_empty(),
        "a dead kiln's members still run"
    );
    drop(server);
    Ok(())
}

/// The host pids of the QEMUs of the kiln whose state folder is `state`.
pub(crate) fn vmms_of(state: &Path) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                c.starts_with(b"/usr/bin/qemu-system-x86_64") && in_state_folder(*pid, state)
            })
        })
        .collect()
}

/// Whether host process `pid` belongs to a box of the kiln whose state folder is `state`
/// (its cgroup is `/kiln/<box id>`, and the box's folder is under `state`).
fn in_state_folder(pid: i32, state: &Path) -> bool {
    let Ok(cgroups) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else {
        return false;
    };
    let Some(id) = cgroups
        .lines()
        .find_map(|l| l.split("/kiln/").nth(1).map(str::to_string))
    else {
        return false;
    };
    std::fs::read_dir(state)
        .into_iter()
        .flatten()
        .flatten()
        .any(|process| process.path().join("boxes").join(&id).exists())
}

/// The microVM tier: a Linux template booted as a VM under QEMU (`microvm`, in the boxes'
/// jail; TCG on this PVM host), its PID 1 kiln's agent. `kiln exec --vm` runs a command in
/// one: its own kernel, the box's user, the workspace over 9p owned as in a box. Through the
/// API (`kiln serve --linux --vm`), `vm-python` sandboxes come from the warm pool, run
/// commands, code and sessions, and share files with the API; and they hold as boxes do: no
/// network, no host loopback, no host files, a memory bomb ends only the program, a guest
/// kernel panic ends only that VM, a CPU spin meets its deadline, filling the disk ends in
/// ENOSPC inside the VM, a killed VMM is replaced in the pool, and a kiln killed with -9
/// leaves VMs the next one ends.
#[test]
fn issue34_templates_run_as_microvms_with_the_same_refusals() -> crate::common::serve::TestResult {
    if skip() {
        return Ok(());
    }
    use crate::common::serve::{Options, send, start};
    use serde_json::json;
    let state = tempfile::tempdir()?;
    let workspace = tempfile::tempdir()?;
    std::fs::write(workspace.path().join("in.txt"), "from the host")?;
    let ws = workspace.path().to_str().ok_or("path")?;
    let (code, out, err) = run(
        state.path(),
        &[
            "--template",
            "python",
            "--vm",
            "--workspace",
            ws,
            "--",
            "sh",
            "-c",
            "uname -r; id -u; cat /proc/1/cmdline | tr '\\0' ' '; echo; cat in.txt; echo; echo made > out.txt",
        ],
    );
    assert_eq!(code, 0, "{out}{err}");
    let lines: Vec<&str> = out.lines().collect();
    let host = std::fs::read_to_string("/proc/sys/kernel/osrelease")?;
    assert_ne!(lines[0], host.trim(), "the VM ran the host's kernel: {out}");
    assert_eq!(
        lines[1..4],
        ["1000", "/.kiln/agent ", "from the host"],
        "{out}"
    );
    assert!(
        err.contains("microVMs run under"),
        "the tier is said at start: {err}"
    );
    let made = workspace.path().join("out.txt");
    assert_eq!(std::fs::read_to_string(&made)?, "made\n");
    assert_eq!(
        std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(&made)?),
        101_000,
        "the VM's user writes as a box's user does"
    );
    // VMs are clones of their template's snapshot (made by the first): each draws random
    // numbers of its own and keeps the host's time.
    let draw = || {
        run(
            state.path(),
            &[
                "--template",
                "python",
                "--vm",
                "--",
                "sh",
                "-c",
                "head -c 16 /dev/urandom | od -An -tx1; date +%s",
            ],
        )
    };
    let (a, b) = (draw(), draw());
    assert_eq!((a.0, b.0), (0, 0), "{} {}", a.2, b.2);
    assert_ne!(
        a.1.lines().next(),
        b.1.lines().next(),
        "two clones drew the same numbers"
    );
    let vm_now: i64 = b.1.lines().nth(1).ok_or("no date")?.trim().parse()?;
    let host_now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs() as i64;
    assert!(
        (vm_now - host_now).abs() < 30,
        "the clone's clock: {vm_now} vs {host_now}"
    );
    // A snapshot whose memory file changed since it was made is never cloned: made anew.
    let snapshots = state.path().join("vm/snapshots");
    let snapshot = std::fs::read_dir(&snapshots)?
        .flatten()
        .next()
        .ok_or("no snapshot made")?
        .path();
    std::fs::OpenOptions::new()
        .write(true)
        .open(snapshot.join("ram"))?
        .set_modified(std::time::SystemTime::now() - Duration::from_secs(3600))?;
    let (code, _, err) = run(
        state.path(),
        &["--template", "python", "--vm", "--", "true"],
    );
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("changed since it was made"), "{err}");

    let state_dir = state.path().to_str().ok_or("path")?;
    let server = start(Options {
        extra: &[
            "--linux",
            "--vm",
            "--language-pools",
            "vm-python=1,debian=0,javascript=0,go=0,python=0",
        ],
        env: &[("KILN_STATE_DIR", state_dir)],
        ..Options::default()
    })?;
    let ready = r#"kiln_pool_ready{template="vm-python",tier="vm"}"#;
    wait_for("a ready VM", Duration::from_secs(120), || {
        metric(&server, ready) == Some(1.0)
    });
    // A killed VMM is dropped from the pool and replaced.
    let vmms = vmms_of(state.path());
    assert_eq!(
        vmms.len(),
        1,
        "one VMM, in this server's state folder: {vmms:?}"
    );
    // SAFETY: kill sends a signal to a pid this test found (the pool's QEMU).
    unsafe { libc::kill(vmms[0], libc::SIGKILL) };
    wait_for("the killed VM replaced", Duration::from_secs(120), || {
        metric(&server, r#"kiln_pool_lost_total{template="vm-python""#) == Some(1.0)
            && metric(&server, ready) == Some(1.0)
    });

    let (status, created) = server.call(
        "POST",
        "/api/v1/sandboxes",
        Some(json!({"template": "vm-python"})),
    )?;
    assert_eq!(status, 201, "{created}");
    let id = created["containerId"].as_str().ok_or("no id")?.to_string();
    let exec = |body: serde_json::Value| -> crate::common::serve::Res<serde_json::Value> {
        let (status, ran) =
            server.call("POST", &format!("/api/v1/sandboxes/{id}/exec"), Some(body))?;
        assert_eq!(status, 200, "{ran}");
        Ok(ran)
    };
    let sh = |script: &str| exec(json!({"command": ["sh", "-c", script], "timeoutMs": 60000}));
    let ran = sh("uname -r; echo kept > note.txt")?;
    assert_ne!(
        ran["stdout"].as_str().unwrap_or_default().trim(),
        host.trim(),
        "{ran}"
    );
    let got = send(
        "GET",
        &server.url(&format!("/api/v1/sandboxes/{id}/files/note.txt")),
        None,
        None,
    )?;
    assert_eq!(String::from_utf8_lossy(&got.body), "kept\n");
    let ran = exec(json!({"language": "python", "code": "print(6 * 7)"}))?;
    assert_eq!(ran["stdout"], "42\n", "{ran}");
    let (status, opened) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/sessions"),
        Some(json!({"language": "python"})),
    )?;
    assert_eq!(status, 201, "{opened}");
    let session = opened["sessionId"]
        .as_str()
        .ok_or("no session")?
        .to_string();
    exec(json!({"code": "v = 41", "sessionId": session}))?;
    let ran = exec(json!({"code": "print(v + 1)", "sessionId": session}))?;
    assert_eq!(ran["stdout"], "42\n", "{ran}");

    // Its processes and ports, as the VM sees them (read through the agent), and a signal.
    sh("sleep 600 >/dev/null 2>&1 & python3 -m http.server 8123 >/dev/null 2>&1 &")?;
    let mut listed = serde_json::Value::Null;
    wait_for(
        "the VM's processes and port listed",
        Duration::from_secs(60),
        || {
            let processes = server.call("GET", &format!("/api/v1/sandboxes/{id}/processes"), None);
            let ports = server.call("GET", &format!("/api/v1/sandboxes/{id}/ports"), None);
            let (Ok((_, processes)), Ok((_, ports))) = (processes, ports) else {
                return false;
            };
            listed = json!({"processes": processes, "ports": ports});
            let has = |what: &str| processes.to_string().contains(what);
            has("\"sleep\"")
                && ports["ports"].as_array().is_some_and(|p| {
                    p.iter()
                        .any(|p| p["port"] == 8123 && p["name"] == "python3")
                })
        },
    );
    let processes = listed["processes"]["processes"]
        .as_array()
        .ok_or("no list")?;
    assert_eq!(processes[0]["pid"], 1, "{listed}");
    assert_eq!(processes[0]["agent"], true, "{listed}");
    let sleeper = processes
        .iter()
        .find(|p| p["argv"] == json!(["sleep", "600"]))
        .ok_or("no sleep")?;
    assert_eq!(sleeper["uid"], 1000, "{sleeper}");
    let (status, sent) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/processes/{}/signal", sleeper["pid"]),
        Some(json!({"signal": "KILL"})),
    )?;
    assert_eq!(
        (status, sent["signalled"].clone()),
        (200, json!(1)),
        "{sent}"
    );
    let ran = sh("sleep 0.5; pgrep -x sleep || echo none")?;
    assert_eq!(ran["stdout"], "none\n", "{ran}");

    // The refusals: no network at all, not even the host's loopback; no host files.
    let port = server.base.rsplit(':').next().unwrap_or("0").to_string();
    let ran = sh(&format!(
        "python3 - <<'EOF'\nimport socket\nfor host, port in [('1.1.1.1', 80), ('10.0.2.2', 80), ('127.0.0.1', {port})]:\n    try:\n        socket.create_connection((host, port), timeout=3)\n        print('reached', host)\n    except OSError as e:\n        print('refused', host)\nEOF\nls / | tr '\\n' ' '; test -e {ws}/in.txt && echo host-files"
    ))?;
    let said = ran["stdout"].as_str().unwrap_or_default();
    assert!(
        !said.contains("reached") && !said.contains("host-files"),
        "{ran}"
    );
    assert_eq!(said.matches("refused").count(), 3, "{ran}");
    // A memory bomb past the VM's RAM ends the program, not the VM.
    let ran = sh("python3 -c 'x = bytearray(2 << 30)'; echo after-$?")?;
    assert!(
        ran["stdout"]
            .as_str()
            .is_some_and(|s| s.contains("after-1") || s.contains("after-137")),
        "{ran}"
    );
    assert_eq!(sh("echo alive")?["stdout"], "alive\n");
    // A guest kernel panic (its root asks for one) ends that VM only: kiln exec says the VM
    // is gone, and the server's VM goes on.
    let (code, out, err) = run(
        state.path(),
        &[
            "--template",
            "python",
            "--vm",
            "--root",
            "--",
            "sh",
            "-c",
            "echo c > /proc/sysrq-trigger; sleep 30",
        ],
    );
    assert_ne!(code, 0, "{out}{err}");
    assert_eq!(sh("cat note.txt")?["stdout"], "kept\n");
    // A fork bomb of the VM's user meets the sandbox's pids limit (its process count), and a
    // restart (its root's `kill -KILL -1`) empties the VM.
    let limits = sh("grep 'Max processes' /proc/self/limits")?;
    assert!(
        limits["stdout"]
            .as_str()
            .is_some_and(|l| l.split_whitespace().nth(2) == Some("256")),
        "the user's processes are capped at the template's pids: {limits}"
    );
    let (status, bombed) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/exec"),
        Some(json!({"command": ["sh", "-c", "b() { b | b & }; b; sleep 5; ps -u user --no-headers | wc -l"], "timeoutMs": 60000})),
    )?;
    assert_eq!(status, 200, "{bombed}");
    let (status, restarted) =
        server.call("POST", &format!("/api/v1/sandboxes/{id}/restart"), None)?;
    assert_eq!(status, 200, "{restarted}");
    let ran = sh("ps -u user --no-headers | wc -l")?;
    let left: u32 = ran["stdout"].as_str().unwrap_or("x").trim().parse()?;
    assert!(
        left <= 3,
        "a restart left {left} of the user's processes: {ran}"
    );
    // CPU: a spinning program meets its deadline; the VM goes on.
    let (status, spun) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/exec"),
        Some(json!({"command": ["python3", "-c", "while True: pass"], "timeoutMs": 3000})),
    )?;
    assert_eq!(status, 200, "{spun}");
    assert_eq!(spun["outcome"], "timed_out", "{spun}");
    assert_eq!(sh("echo alive")?["stdout"], "alive\n");
    // Disk: the workspace and the VM's writable layer (an image on the same volume) share
    // the sandbox's capped disk; filling either ends in an error inside the VM (ENOSPC, or
    // an I/O error on the layer when the volume under it is full), not in the host's disk,
    // and the VM goes on.
    let (status, small) = server.call(
        "POST",
        "/api/v1/sandboxes",
        Some(json!({"template": "vm-python", "resources": {"disk_mb": 64}})),
    )?;
    assert_eq!(status, 201, "{small}");
    let small = small["containerId"].as_str().ok_or("no id")?.to_string();
    let (status, filled) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{small}/exec"),
        Some(json!({"command": ["sh", "-c", "dd if=/dev/zero of=big bs=1M count=100 2>&1 | grep -c 'No space'; rm big; dd if=/dev/zero of=/tmp/big bs=1M count=100 2>&1 | grep -cE 'No space|Input/output'; rm -f /tmp/big; echo goes-on"], "timeoutMs": 120000})),
    )?;
    assert_eq!(
        (status, filled["stdout"].clone()),
        (200, json!("1\n1\ngoes-on\n")),
        "{filled}"
    );
    // The layer is the sandbox's disk, not the VM's RAM: 300 MiB outside the workspace of a
    // VM with 512 MiB of RAM (a tmpfs layer held at most half of it).
    let wrote = exec(
        json!({"command": ["sh", "-c", "dd if=/dev/zero of=/home/user/big bs=1M count=300 2>/dev/null && du -m /home/user/big | cut -f1; rm -f /home/user/big"], "timeoutMs": 120000}),
    )?;
    assert_eq!(wrote["stdout"], "300\n", "{wrote}");

    // kiln killed with -9 leaves its VMs running; the next kiln removes them.
    let mut server = server;
    // SAFETY: kill sends a signal to the server's pid, which this test started.
    unsafe { libc::kill(server.child.0.id() as i32, libc::SIGKILL) };
    server.child.0.wait()?;
    let left: Vec<i32> = std::fs::read_dir("/proc")?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.starts_with(b"/usr/bin/qemu-system-x86_64"))
                && in_state_folder(*pid, state.path())
        })
        .collect();
    assert!(!left.is_empty(), "the VMs went with kiln");
    let server = start(Options {
        extra: &["--linux", "--target-pool-size", "0"],
        env: &[("KILN_STATE_DIR", state_dir)],
        ..Options::default()
    })?;
    wait_for("a dead kiln's VMs ended", Duration::from_secs(30), || {
        left.iter().all(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map_or(true, |s| s.split(' ').nth(2) == Some("Z"))
        })
    });
    drop(server);
    Ok(())
}

/// A Linux template that is defined (an operator's YAML) but not built on this server is
/// refused at create with what to do (build it), not as an unknown image; the built ones
/// still run.
#[test]
fn issue34_a_defined_but_unbuilt_template_is_refused_with_how_to_build_it()
-> crate::common::serve::TestResult {
    if skip() {
        return Ok(());
    }
    use crate::common::serve::{Options, start};
    use serde_json::json;
    let state = tempfile::tempdir()?;
    let definitions = tempfile::tempdir()?;
    std::fs::write(
        definitions.path().join("extra.yaml"),
        "name: extra\nbase: debian:bookworm\npackages: [bash, jq]\nlanguages: [bash]\n",
    )?;
    let dir = definitions.path().to_str().ok_or("path")?;
    let server = start(Options {
        extra: &["--linux", "--target-pool-size", "0", "--templates-dir", dir],
        env: &[("KILN_STATE_DIR", state.path().to_str().ok_or("path")?)],
        ..Options::default()
    })?;
    let (status, refused) = server.call(
        "POST",
        "/api/v1/sandboxes",
        Some(json!({"template": "linux-extra"})),
    )?;
    assert_eq!(
        refused["error"]["code"], "UNKNOWN_IMAGE",
        "{status} {refused}"
    );
    let message = refused["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("defined but not built")
            && message.contains("kiln setup --template extra"),
        "{refused}"
    );
    let (status, created) = server.call(
        "POST",
        "/api/v1/sandboxes",
        Some(json!({"template": "linux-debian"})),
    )?;
    assert_eq!(status, 201, "{created}");
    Ok(())
}

/// Issue 34, gVisor per template: a template names its box runtime (`box_runtime: runsc`
/// in its YAML), and `--gvisor` offers every template under gVisor too (`gvisor-NAME`),
/// while the others run under the server's runc, side by side in one server. A gVisor
/// template's pool starts its members under runsc; hibernating a gVisor box keeps its
/// files (runsc's own checkpoint is not driven) and says so.
#[test]
fn issue34_a_template_picks_its_box_runtime() -> crate::common::serve::TestResult {
    if skip() {
        return Ok(());
    }
    use crate::common::serve::{Options, start};
    use serde_json::json;
    let state = tempfile::tempdir()?;
    let definitions = tempfile::tempdir()?;
    // The shipped python, under gVisor: the same build (the runtime is not part of it).
    let python = include_str!("../../../kiln-native/templates/python.yaml");
    std::fs::write(
        definitions.path().join("python.yaml"),
        format!("{python}\nbox_runtime: runsc\n"),
    )?;
    let dir = definitions.path().to_str().ok_or("path")?;
    let server = start(Options {
        extra: &[
            "--linux",
            "--gvisor",
            "--templates-dir",
            dir,
            "--language-pools",
            "gvisor-debian=1,debian=0,javascript=0,go=0,python=0",
        ],
        env: &[("KILN_STATE_DIR", state.path().to_str().ok_or("path")?)],
        ..Options::default()
    })?;
    let host_kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")?;
    let kernel_of =
        |template: &str| -> Result<(String, String), Box<dyn std::error::Error + Send + Sync>> {
            let (status, created) = server.call(
                "POST",
                "/api/v1/sandboxes",
                Some(json!({"template": template})),
            )?;
            assert_eq!(status, 201, "{template}: {created}");
            let id = created["containerId"].as_str().ok_or("no id")?.to_string();
            let (status, ran) = server.call(
                "POST",
                &format!("/api/v1/sandboxes/{id}/exec"),
                Some(json!({"command": ["sh", "-c", "uname -r; echo made > made.txt"]})),
            )?;
            assert_eq!(status, 200, "{template}: {ran}");
            Ok((
                ran["stdout"]
                    .as_str()
                    .unwrap_or_default()
                    .trim()
                    .to_string(),
                id,
            ))
        };
    let (kernel, _) = kernel_of("linux-debian")?;
    assert_eq!(kernel, host_kernel.trim(), "linux-debian runs under runc");
    let (kernel, py) = kernel_of("linux-python")?;
    assert_ne!(kernel, host_kernel.trim(), "box_runtime: runsc is gVisor");
    assert!(!kernel.is_empty());
    // Its processes and ports are the box's as gVisor sees them (the host sees the sentry),
    // read through the agent; a signal reaches one.
    let (status, _) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{py}/exec"),
        Some(json!({"command": ["sh", "-c", "sleep 600 >/dev/null 2>&1 & python3 -m http.server 8123 >/dev/null 2>&1 &"]})),
    )?;
    assert_eq!(status, 200);
    let mut listed = serde_json::Value::Null;
    wait_for(
        "the gVisor box's processes and port listed",
        Duration::from_secs(30),
        || {
            let processes = server.call("GET", &format!("/api/v1/sandboxes/{py}/processes"), None);
            let ports = server.call("GET", &format!("/api/v1/sandboxes/{py}/ports"), None);
            let (Ok((_, processes)), Ok((_, ports))) = (processes, ports) else {
                return false;
            };
            listed = json!({"processes": processes, "ports": ports});
            processes.to_string().contains("\"sleep\"")
                && ports["ports"].as_array().is_some_and(|p| {
                    p.iter()
                        .any(|p| p["port"] == 8123 && p["name"] == "python3")
                })
        },
    );
    let processes = listed["processes"]["processes"]
        .as_array()
        .ok_or("no list")?;
    assert_eq!(
        (processes[0]["pid"].clone(), processes[0]["agent"].clone()),
        (json!(1), json!(true)),
        "{listed}"
    );
    let sleeper = processes
        .iter()
        .find(|p| p["argv"] == json!(["sleep", "600"]))
        .ok_or("no sleep")?;
    assert_eq!(sleeper["uid"], 1000, "{sleeper}");
    let (status, sent) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{py}/processes/{}/signal", sleeper["pid"]),
        Some(json!({"signal": "KILL"})),
    )?;
    assert_eq!(
        (status, sent["signalled"].clone()),
        (200, json!(1)),
        "{sent}"
    );
    let (_, ran) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{py}/exec"),
        Some(json!({"command": ["sh", "-c", "sleep 0.5; pgrep -x sleep || echo none"]})),
    )?;
    assert_eq!(ran["stdout"], "none\n", "{ran}");
    // gvisor-debian comes from its pool, started under runsc.
    wait_for("the gVisor pool filled", Duration::from_secs(60), || {
        metric(
            &server,
            r#"kiln_pool_ready{template="gvisor-debian",tier="gvisor"}"#,
        ) == Some(1.0)
    });
    let (kernel, id) = kernel_of("gvisor-debian")?;
    assert_ne!(kernel, host_kernel.trim(), "gvisor-debian is gVisor");
    assert_eq!(
        metric(
            &server,
            r#"kiln_pool_claims_total{template="gvisor-debian",tier="gvisor",outcome="ready"}"#
        ),
        Some(1.0)
    );
    // Hibernated: its files are kept, its processes are not (and it says why).
    let (status, slept) =
        server.call("POST", &format!("/api/v1/sandboxes/{id}/hibernate"), None)?;
    assert_eq!(status, 200, "{slept}");
    assert!(slept.to_string().contains("gVisor"), "{slept}");
    let (status, ran) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/exec"),
        Some(json!({"command": ["sh", "-c", "cat made.txt; uname -r"]})),
    )?;
    assert_eq!(status, 200, "{ran}");
    assert_eq!(
        ran["stdout"].as_str().unwrap_or_default(),
        format!("made\n{kernel}\n")
    );
    // The catalogue says which is which.
    let (_, templates) = server.call("GET", "/api/v1/templates", None)?;
    let described = |id: &str| {
        templates
            .as_array()
            .or_else(|| templates["templates"].as_array())
            .and_then(|all| all.iter().find(|t| t["id"] == id))
            .map(|t| t["description"].to_string())
            .unwrap_or_default()
    };
    assert!(
        described("gvisor-python").contains("under gVisor"),
        "{templates}"
    );
    Ok(())
}

/// Issue 34: a microVM with `--network allowlist` reaches kiln's proxy over its own
/// loopback (the agent listens for it in the VM), and the proxy answers for the host: a
/// name not listed is refused with the reason, a listed one is let through to the CONNECT.
#[test]
fn issue34_a_vm_reaches_kilns_proxy_over_its_loopback() {
    if skip() {
        return;
    }
    let state = tempfile::tempdir().unwrap();
    let script = "for h in not-listed.test; do exec 3<>/dev/tcp/127.0.0.1/3128; \
        printf 'CONNECT %s:443 HTTP/1.1\\r\\nHost: %s:443\\r\\n\\r\\n' $h $h >&3; \
        timeout 15 head -c 300 <&3; echo; exec 3<&-; done; \
        (exec 3<>/dev/tcp/127.0.0.1/8000) 2>/dev/null && echo loopback-server-reached || echo no-server-on-8000";
    let out = kiln()
        .args([
            "exec",
            "--template",
            "debian",
            "--vm",
            "--network",
            "allowlist",
            "--",
        ])
        .args(["bash", "-c", script])
        .env("KILN_STATE_DIR", state.path())
        .env("KILN_NETWORK_ALLOW", "listed.test")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(" 403 ") && stdout.contains("not-listed.test"),
        "{stdout}"
    );
    assert!(stdout.contains("no-server-on-8000"), "{stdout}");
}
