//! `kiln exec --template`: Linux boxes from the command line, as a user runs them, and what a
//! killed kiln leaves behind. They need root, runc, the static guest agent and the python and
//! debian templates (`scripts/test` builds them); KILN_SKIP_LINUX=1 skips them.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::common::serve::kiln;

fn skip() -> bool {
    std::env::var("KILN_SKIP_LINUX").is_ok_and(|v| v == "1")
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

fn box_dirs(state: &Path) -> Vec<String> {
    std::fs::read_dir(state.join("boxes"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
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
fn a_box_left_by_a_killed_kiln_is_removed_by_the_next_one() {
    if skip() {
        return;
    }
    let state = tempfile::tempdir().unwrap();
    let marker = "sleep 86399.5";
    let mut child = kiln()
        .args(["exec", "--template", "debian", "--", "sleep", "86399.5"])
        .env("KILN_STATE_DIR", state.path())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while processes(marker) == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the box never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
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
    let runc = std::fs::read_dir(state.path().join("runc"))
        .unwrap()
        .count();
    assert_eq!(runc, 0, "runc still knows the left box");
}
