//! Engine tests against the real runtimes: behaviour, sessions and attacks. Each attack test
//! asserts the exact outcome; the test process itself must stay healthy throughout.
//!
//! The runtimes come from kiln's cache (`KILN_CACHE_DIR` or `~/.cache/kiln`), set up on first
//! use like any kiln command does.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use kiln_core::{ExecRequest, ExecResult, Language, Limits, Mount, Outcome};
use kiln_wasm::{CacheDir, ExecError, Quiet, SessionOptions, WasmEngine};

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn engine() -> &'static WasmEngine {
    static ENGINE: OnceLock<WasmEngine> = OnceLock::new();
    ENGINE.get_or_init(|| {
        let engine = WasmEngine::new(test_cache()).expect("engine");
        for language in Language::WASM {
            engine.prepare(language, &Quiet).expect("runtime setup");
        }
        engine
    })
}

fn py(code: &str) -> ExecRequest {
    ExecRequest::new(Language::Python, code)
}

fn js(code: &str) -> ExecRequest {
    ExecRequest::new(Language::JavaScript, code)
}

fn with_timeout(mut request: ExecRequest, ms: u64) -> ExecRequest {
    request.limits.timeout_ms = ms;
    request
}

async fn run(request: ExecRequest) -> ExecResult {
    engine().execute(&request).await.expect("execute")
}

/// The `text/plain` form of a run's main result (its final expression's value), if it has
/// one; a run has at most one.
fn shown(result: &ExecResult) -> Option<&str> {
    let mut main = result.results.iter().filter(|r| r.main);
    let text = main.next().map(|r| r.data["text/plain"].as_str());
    assert!(main.next().is_none(), "{:?}", result.results);
    text
}

// ---------------------------------------------------------------- behaviour

#[tokio::test]
async fn python_prints_and_exits() -> TestResult {
    let result = run(py("print(1 + 1)")).await;
    assert_eq!(result.stdout_text(), "2\n");
    assert_eq!(result.stderr_text(), "");
    assert_eq!(result.exit_code, 0);
    assert_eq!(result.outcome, Outcome::Completed);
    assert!(result.peak_memory_bytes > 0);
    Ok(())
}

/// Issue 16: a write the file budget refuses is flagged, with a reason to show.
#[tokio::test]
async fn a_write_over_the_budget_is_flagged_with_its_reason() -> TestResult {
    let mut request = py("open('/tmp/big', 'wb').write(b'x' * (8 << 20))");
    request.limits.fs_write_bytes = 4 << 20;
    let result = run(request.clone()).await;
    assert!(result.fs_refused, "{}", result.stderr_text());
    assert_eq!(
        result.fs_reason(&request.limits).as_deref(),
        Some(
            "file writes stopped at this execution's budget (4 MiB written, 1000 files created at most): writes beyond it failed with ENOSPC"
        )
    );
    let fine = run(py("open('/tmp/small', 'w').write('x')")).await;
    assert!(!fine.fs_refused);
    Ok(())
}

/// Issue 16: a missing module says what this Python has and where packages can be
/// installed, not CPython's site-packages hint (there is none to add).
#[tokio::test]
async fn a_missing_module_says_what_there_is_and_where_to_install() -> TestResult {
    let result = run(py("import requests")).await;
    let stderr = result.stderr_text();
    assert!(
        stderr.contains("ModuleNotFoundError: No module named 'requests'. kiln's Python on WebAssembly has the standard library plus numpy, pandas"),
        "{stderr}"
    );
    assert!(stderr.contains("can pip install"), "{stderr}");
    assert!(
        !stderr.contains("Site initialization is disabled"),
        "{stderr}"
    );
    assert_eq!(result.exit_code, 1);
    Ok(())
}

#[tokio::test]
async fn python_keeps_stdout_and_stderr_apart_and_reports_exit_codes() -> TestResult {
    let result = run(py(
        "import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)",
    ))
    .await;
    assert_eq!(result.stdout_text(), "out\n");
    assert_eq!(result.stderr_text(), "err\n");
    assert_eq!(result.exit_code, 3);
    assert_eq!(result.outcome, Outcome::Completed);

    let result = run(py("raise ValueError('bad')")).await;
    assert_eq!(result.exit_code, 1);
    assert!(
        result.stderr_text().contains("ValueError: bad"),
        "{}",
        result.stderr_text()
    );
    Ok(())
}

#[tokio::test]
async fn python_reads_stdin() -> TestResult {
    let mut request = py("import sys\nprint(sys.stdin.read().upper())");
    request.stdin = b"hello".to_vec();
    assert_eq!(run(request).await.stdout_text(), "HELLO\n");
    Ok(())
}

#[tokio::test]
async fn python_scientific_stack_works() -> TestResult {
    let code = "import numpy as np, pandas as pd\n\
                print(int(np.arange(10).sum()))\n\
                print(pd.DataFrame({'a': [1, 2]})['a'].sum())";
    let result = run(py(code)).await;
    assert_eq!(result.stdout_text(), "45\n3\n", "{}", result.stderr_text());
    Ok(())
}

#[tokio::test]
async fn python_matplotlib_renders_into_the_workspace() -> TestResult {
    let workspace = tempfile::tempdir()?;
    let mut request = py(
        "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n\
                          plt.plot([1, 2, 3])\nplt.savefig('plot.png')\nprint('saved')",
    );
    request.workspace = Some(workspace.path().to_path_buf());
    request.limits.timeout_ms = 120_000;
    let result = run(request).await;
    assert_eq!(result.stdout_text(), "saved\n", "{}", result.stderr_text());
    let png = std::fs::read(workspace.path().join("plot.png"))?;
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    Ok(())
}

#[tokio::test]
async fn workspace_is_the_working_directory_and_sees_its_files() -> TestResult {
    let workspace = tempfile::tempdir()?;
    std::fs::create_dir(workspace.path().join("data"))?;
    std::fs::write(workspace.path().join("data/input.txt"), "21")?;
    let mut request = py(
        "import os\nprint(os.getcwd())\nn = int(open('data/input.txt').read())\n\
                          open('out.txt', 'w').write(str(n * 2))",
    );
    request.workspace = Some(workspace.path().to_path_buf());
    let result = run(request).await;
    assert_eq!(
        result.stdout_text(),
        "/workspace\n",
        "{}",
        result.stderr_text()
    );
    assert_eq!(
        std::fs::read_to_string(workspace.path().join("out.txt"))?,
        "42"
    );
    assert_eq!(result.fs_written_bytes, 2);

    let mut request = js(
        "console.log(os.getcwd()[0]); std.writeFile('js.txt', std.loadFile('data/input.txt') + '!')",
    );
    request.workspace = Some(workspace.path().to_path_buf());
    let result = run(request).await;
    assert_eq!(
        result.stdout_text(),
        "/workspace\n",
        "{}",
        result.stderr_text()
    );
    assert_eq!(
        std::fs::read_to_string(workspace.path().join("js.txt"))?,
        "21!"
    );
    Ok(())
}

/// Issue 18: a run says whether it may have changed files (`files_changed`), so the server
/// records its workspace only then. Reading, listing and printing change nothing; every kind
/// of change — a write, a truncation without a write, a removal, a rename, a new folder or
/// link, a write outside the workspace — is seen, in one-shots, sessions and JavaScript.
#[tokio::test]
async fn a_run_says_whether_it_may_have_changed_files() -> TestResult {
    let workspace = tempfile::tempdir()?;
    let fill = || -> std::io::Result<()> {
        std::fs::write(workspace.path().join("a.txt"), "a")?;
        std::fs::write(workspace.path().join("b.txt"), "b")?;
        std::fs::create_dir_all(workspace.path().join("d"))
    };
    let in_workspace = |mut request: ExecRequest| {
        request.workspace = Some(workspace.path().to_path_buf());
        request
    };
    fill()?;
    let reads = "import os\nprint(open('a.txt').read(), sorted(os.listdir('.')), os.stat('b.txt').st_size)\nopen('b.txt', 'r+').close()";
    let result = run(in_workspace(py(reads))).await;
    assert_eq!(
        result.stdout_text(),
        "a ['a.txt', 'b.txt', 'd'] 1\n",
        "{}",
        result.stderr_text()
    );
    assert_eq!(result.files_changed, Some(false));
    let result = run(in_workspace(js("console.log(std.loadFile('a.txt'))"))).await;
    assert_eq!(result.stdout_text(), "a\n", "{}", result.stderr_text());
    assert_eq!(result.files_changed, Some(false));

    let changes = [
        "open('new.txt', 'w').write('x')",
        "open('a.txt', 'w').close()",
        "import os\nos.truncate('b.txt', 0)",
        "import os\nos.remove('a.txt')",
        "import os\nos.rename('a.txt', 'c.txt')",
        "import os\nos.rmdir('d')",
        "import os\nos.mkdir('e')",
        "import os\nos.symlink('a.txt', 'l')",
        "open('/tmp/scratch', 'w').write('x')",
    ];
    for code in changes {
        fill()?;
        let result = run(in_workspace(py(code))).await;
        assert_eq!(result.exit_code, 0, "{code}: {}", result.stderr_text());
        assert_eq!(result.files_changed, Some(true), "{code}");
    }
    let result = run(in_workspace(js("std.writeFile('js.txt', 'x')"))).await;
    assert_eq!(result.files_changed, Some(true), "{}", result.stderr_text());

    // Per turn: a session's reading turn after a writing one changed nothing.
    let options = SessionOptions {
        workspace: Some(workspace.path().to_path_buf()),
        ..SessionOptions::default()
    };
    let mut session = engine().open_session(Language::Python, &options).await?;
    let limits = Limits::default();
    let wrote = session
        .run("f = open('kept.txt', 'w')\nf.write('x')", &limits)
        .await?;
    assert_eq!(wrote.files_changed, Some(true), "{}", wrote.stderr_text());
    let read = session.run("print(open('a.txt').read())", &limits).await?;
    assert_eq!(read.files_changed, Some(false), "{}", read.stderr_text());
    // A file opened in an earlier turn and written in this one is a change of this one.
    let later = session.run("f.write('y')\nf.flush()", &limits).await?;
    assert_eq!(later.files_changed, Some(true), "{}", later.stderr_text());
    Ok(())
}

/// A workspace folder the guest cannot enter is an error that names it, not a guest that
/// runs somewhere else.
#[tokio::test]
async fn a_workspace_that_cannot_be_entered_is_an_error() -> TestResult {
    let workspace = tempfile::tempdir()?;
    let mut request = py("print(1)");
    request.workspace = Some(workspace.path().join("missing"));
    match engine().execute(&request).await {
        Err(error) => assert!(
            error.to_string().contains("missing") || error.to_string().contains("workspace"),
            "{error}"
        ),
        Ok(result) => panic!("ran: {} {}", result.stdout_text(), result.stderr_text()),
    }
    Ok(())
}

#[tokio::test]
async fn read_only_mounts_can_be_read_but_not_written() -> TestResult {
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("in.csv"), "a,b\n1,2\n")?;
    let mut request = py("print(open('/data/in.csv').read().splitlines()[1])\n\
                          try:\n    open('/data/new.txt', 'w')\nexcept OSError as e:\n    print(type(e).__name__)");
    request.mounts.push(Mount {
        host: dir.path().to_path_buf(),
        guest: "/data".into(),
        writable: false,
    });
    let result = run(request).await;
    assert_eq!(
        result.stdout_text(),
        "1,2\nPermissionError\n",
        "{}",
        result.stderr_text()
    );
    assert!(!dir.path().join("new.txt").exists());
    Ok(())
}

#[tokio::test]
async fn javascript_runs_and_reports_errors() -> TestResult {
    let result = run(js("console.log(1 + 1)")).await;
    assert_eq!(result.stdout_text(), "2\n");
    assert_eq!(result.outcome, Outcome::Completed);

    let result = run(js("throw new TypeError('nope')")).await;
    assert_eq!(result.exit_code, 1);
    assert!(
        result.stderr_text().contains("TypeError: nope"),
        "{}",
        result.stderr_text()
    );

    let result = run(js("std.exit(7)")).await;
    assert_eq!(result.exit_code, 7);

    let result = run(js(
        "setTimeout(() => console.log('timer'), 5); await null; console.log('first')",
    ))
    .await;
    assert_eq!(result.stdout_text(), "first\ntimer\n");
    Ok(())
}

#[tokio::test]
async fn javascript_reads_stdin() -> TestResult {
    let mut request = js("console.log(std.in.readAsString().trim().length)");
    request.stdin = b"12345\n".to_vec();
    assert_eq!(run(request).await.stdout_text(), "5\n");
    Ok(())
}

/// Issue 16: promises, `async`/`await` and timers run to completion before a one-shot ends,
/// in Node's order: every promise job before the next timer, timers by due time.
#[tokio::test]
async fn javascript_runs_promises_and_timers_in_nodes_order() -> TestResult {
    let result = run(js(
        "console.log(1); setTimeout(() => console.log(4), 20); setTimeout(() => console.log(3), 0); Promise.resolve().then(() => console.log(2))",
    ))
    .await;
    assert_eq!(
        result.stdout_text(),
        "1\n2\n3\n4\n",
        "{}",
        result.stderr_text()
    );
    assert_eq!(result.exit_code, 0);

    // What `node` prints for the same program.
    let result = run(js(r#"
setTimeout(() => {
  console.log("timer 1");
  Promise.resolve().then(() => console.log("job of timer 1"));
}, 0);
setTimeout(() => console.log("timer 2"), 0);
queueMicrotask(() => console.log("microtask"));
(async () => {
  await null;
  console.log("after await");
  await new Promise((resolve) => setTimeout(resolve, 5));
  console.log("after sleep");
})();
let ticks = 0;
const interval = setInterval(() => {
  console.log("tick");
  if (++ticks === 2) clearInterval(interval);
}, 1);
clearTimeout(setTimeout(() => console.log("cleared"), 1));
"#))
    .await;
    assert_eq!(
        result.stdout_text(),
        "microtask\nafter await\ntimer 1\njob of timer 1\ntimer 2\ntick\ntick\nafter sleep\n",
        "{}",
        result.stderr_text()
    );
    // An unreferenced timer does not keep the program alive; an immediate runs after it.
    let result = run(js(
        "setTimeout(() => console.log('never'), 50).unref(); setImmediate((w) => console.log(w), 'immediate'); console.log('main')",
    ))
    .await;
    assert_eq!(result.stdout_text(), "main\nimmediate\n");
    assert!(result.duration_us < 40_000, "{}", result.duration_us);

    // Top-level await, then a program that waits for something that never comes (Node's
    // "unsettled top-level await", exit code 13).
    let result = run(js(
        "const v = await new Promise((r) => setTimeout(() => r(42), 5)); console.log(v)",
    ))
    .await;
    assert_eq!(result.stdout_text(), "42\n");
    let result = run(js("await new Promise(() => {})")).await;
    assert_eq!(result.exit_code, 13);
    assert_eq!(
        result.stderr_text(),
        "Warning: Detected unsettled top-level await\n"
    );
    Ok(())
}

/// Issue 16: an error nothing catches, in a promise job, a rejection or a timer, ends the
/// program with exit code 1 and the error on stderr, as in Node.
#[tokio::test]
async fn javascript_uncaught_async_errors_fail_the_run() -> TestResult {
    for (code, said) in [
        (
            "async function f() { await null; throw new TypeError('async bad') } f()",
            "TypeError: async bad",
        ),
        (
            "Promise.resolve().then(() => { throw new RangeError('in a job') })",
            "RangeError: in a job",
        ),
        ("Promise.reject(new Error('rejected'))", "Error: rejected"),
        (
            "setTimeout(() => { throw new Error('in a timer') }, 1); setTimeout(() => console.log('later'), 5)",
            "Error: in a timer",
        ),
        (
            "queueMicrotask(() => { throw new Error('in a microtask') })",
            "Error: in a microtask",
        ),
        (
            "await Promise.reject(new Error('top-level'))",
            "Error: top-level",
        ),
    ] {
        let result = run(js(code)).await;
        assert_eq!(result.exit_code, 1, "{code}: {}", result.stderr_text());
        assert_eq!(result.outcome, Outcome::Completed, "{code}");
        assert!(
            result.stderr_text().contains(said),
            "{code}: {}",
            result.stderr_text()
        );
        assert_eq!(result.stdout_text(), "", "{code}");
    }
    // A synchronous throw ends the program before the jobs it queued run.
    let result = run(js(
        "Promise.resolve().then(() => console.log('queued')); throw new Error('sync')",
    ))
    .await;
    assert_eq!(result.exit_code, 1);
    assert_eq!(result.stdout_text(), "");
    assert!(result.stderr_text().starts_with("Error: sync\n"));
    // A rejection handled in time is no error.
    let result = run(js(
        "const p = Promise.reject(new Error('x')); p.catch((e) => console.log('caught', e.message))",
    ))
    .await;
    assert_eq!(
        (result.exit_code, result.stdout_text()),
        (0, "caught x\n".into())
    );
    Ok(())
}

/// Issue 16: an interval that never ends is stopped at the deadline, as any other loop.
#[tokio::test]
async fn javascript_endless_interval_times_out() -> TestResult {
    let started = Instant::now();
    let result = run(with_timeout(
        js("let n = 0; setInterval(() => { n++ }, 1); Promise.resolve().then(function again() { return Promise.resolve().then(again) })"),
        300,
    ))
    .await;
    assert_eq!(result.outcome, Outcome::TimedOut);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    let result = run(with_timeout(js("setInterval(() => {}, 50)"), 300)).await;
    assert_eq!(result.outcome, Outcome::TimedOut);
    Ok(())
}

/// Issue 16: console prints values as Node 20 does (`util.inspect`: depth 2, 80 columns,
/// arrays of numbers in columns, strings quoted inside objects); console.error and
/// console.warn write to stderr.
#[tokio::test]
async fn javascript_console_prints_values_as_node_does() -> TestResult {
    // Each line's expected text is what `node` 20 prints for it.
    let cases = [
        (
            "console.log({ a: 1 }, [1, 2], 'text', 42, null, undefined, -0, 10n)",
            "{ a: 1 } [ 1, 2 ] text 42 null undefined -0 10n",
        ),
        (
            "console.log({ nested: { deep: { deeper: { deepest: 1 } } }, list: [[1, [2, [3]]]] })",
            "{ nested: { deep: { deeper: [Object] } }, list: [ [ 1, [Array] ] ] }",
        ),
        (
            "console.log({ s: 'x', q: \"it's\", n: [1, 'two', { three: 3 }] })",
            "{ s: 'x', q: \"it's\", n: [ 1, 'two', { three: 3 } ] }",
        ),
        (
            "console.log(Array.from({ length: 12 }, (_, i) => i * i))",
            "[\n    0,   1,  4,  9, 16,\n   25,  36, 49, 64, 81,\n  100, 121\n]",
        ),
        (
            "console.log(new Map([['k', { v: 1 }]]), new Set([1, 'a']), new Date(0), /re/g)",
            "Map(1) { 'k' => { v: 1 } } Set(2) { 1, 'a' } 1970-01-01T00:00:00.000Z /re/g",
        ),
        (
            "class Point { constructor() { this.x = 1; this.y = 2 } }; console.log(new Point(), [function named() {}, () => {}, class A {}], Symbol('s'))",
            "Point { x: 1, y: 2 } [ [Function: named], [Function (anonymous)], [class A] ] Symbol(s)",
        ),
        (
            "const c = { name: 'c' }; c.self = c; console.log(c)",
            "<ref *1> { name: 'c', self: [Circular *1] }",
        ),
        (
            "console.log('%s is %d years, %i%% sure: %j', 'Bob', 42.5, '99.9', { a: [1] })",
            "Bob is 42.5 years, 99% sure: {\"a\":[1]}",
        ),
        (
            "console.log({ long: 'x'.repeat(70), more: 1 })",
            "{\n  long: 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx',\n  more: 1\n}",
        ),
        (
            "console.log(Object.create(null), { 'key-with-dash': 1, valid: 2 }, [, 1, , 2])",
            "[Object: null prototype] {} { 'key-with-dash': 1, valid: 2 } [ <1 empty item>, 1, <1 empty item>, 2 ]",
        ),
        (
            "console.table([{ a: 1, b: 'x' }, { a: 2 }])",
            "\u{250c}\u{2500}\u{2500}\u{2500}\u{2500}\u{2500}\u{2500}\u{2500}\u{2500}\u{2500}\u{252c}\u{2500}\u{2500}\u{2500}\u{252c}\u{2500}\u{2500}\u{2500}\u{2500}\u{2500}\u{2510}\n\u{2502} (index) \u{2502} a \u{2502} b   \u{2502}\n\u{251c}\u{2500}\u{2500}\u{2500}\u{2500}\u{2500}\u{2500}\u{2500}\u{2500}\u{2500}\u{253c}\u{2500}\u{2500}\u{2500}\u{253c}\u{2500}\u{2500}\u{2500}\u{2500}\u{2500}\u{2524}\n\u{2502} 0       \u{2502} 1 \u{2502} 'x' \u{2502}\n\u{2502} 1       \u{2502} 2 \u{2502}     \u{2502}\n\u{2514}\u{2500}\u{2500}\u{2500}\u{2500}\u{2500}\u{2500}\u{2500}\u{2500}\u{2500}\u{2534}\u{2500}\u{2500}\u{2500}\u{2534}\u{2500}\u{2500}\u{2500}\u{2500}\u{2500}\u{2518}",
        ),
    ];
    for (code, printed) in cases {
        let result = run(js(code)).await;
        assert_eq!(
            result.stdout_text(),
            format!("{printed}\n"),
            "{code}: {}",
            result.stderr_text()
        );
    }
    let result = run(js(
        "console.error({ to: 'stderr' }); console.warn('warned', 1); console.info('info'); console.debug([1])",
    ))
    .await;
    assert_eq!(result.stdout_text(), "info\n[ 1 ]\n");
    assert_eq!(result.stderr_text(), "{ to: 'stderr' }\nwarned 1\n");
    // An error prints its stack, as Node's does (QuickJS's frames).
    let result = run(js(
        "function f() { return new Error('boom') }\nconsole.log({ e: f() })",
    ))
    .await;
    assert_eq!(
        result.stdout_text(),
        "{\n  e: Error: boom\n      at f (<cmdline>:1:27)\n      at <anonymous> (<cmdline>:2:18)\n}\n"
    );
    Ok(())
}

/// Issue 16: `process` (argv, env, exit, exitCode, cwd, stdout.write) and relative ES-module
/// imports of workspace files, as on a laptop.
#[tokio::test]
async fn javascript_has_process_and_imports_workspace_modules() -> TestResult {
    let workspace = tempfile::tempdir()?;
    std::fs::create_dir(workspace.path().join("lib"))?;
    std::fs::write(
        workspace.path().join("lib/util.js"),
        "export const answer = 42;\nexport function fail() { throw new Error('from util'); }\n",
    )?;
    let mut request = js(r#"import { answer } from "./lib/util.js";
console.log(answer, process.argv, process.cwd(), process.platform, process.env.GREETING);
process.stdout.write("no newline");
process.exitCode = 3;"#);
    request.workspace = Some(workspace.path().to_path_buf());
    request.env = vec![("GREETING".into(), "hello".into())];
    let result = run(request.clone()).await;
    assert_eq!(
        result.stdout_text(),
        "42 [ '/usr/local/bin/node' ] /workspace wasi hello\nno newline",
        "{}",
        result.stderr_text()
    );
    assert_eq!(result.exit_code, 3);

    request.code = "import { fail } from './lib/util.js'; fail()".into();
    let result = run(request.clone()).await;
    assert_eq!(result.exit_code, 1);
    assert_eq!(
        result.stderr_text(),
        "Error: from util\n    at fail (lib/util.js:2:36)\n    at <anonymous> (<cmdline>:1:38)\n\n"
    );

    // What kiln runs for `node main.js a b` (kiln-runtime's launcher).
    std::fs::write(
        workspace.path().join("main.js"),
        "import { answer } from './lib/util.js';\nconsole.log(process.argv.slice(1), answer);\nprocess.exit(answer - 40);\nconsole.log('not reached');\n",
    )?;
    request.code = "globalThis[Symbol.for('kiln.argv')] = ['/workspace/main.js', 'a', 'b'];\nawait import('/workspace/main.js');\n".into();
    let result = run(request).await;
    assert_eq!(
        result.stdout_text(),
        "[ '/workspace/main.js', 'a', 'b' ] 42\n",
        "{}",
        result.stderr_text()
    );
    assert_eq!(result.exit_code, 2);
    Ok(())
}

#[tokio::test]
async fn python_sessions_keep_state_and_end_on_exit() -> TestResult {
    let mut session = engine()
        .open_session(Language::Python, &SessionOptions::default())
        .await?;
    let limits = Limits::default();
    let first = session.run("x = 40\nimport math", &limits).await?;
    assert_eq!(first.outcome, Outcome::Completed);
    let second = session
        .run("x += 2\nprint(x, math.pi > 3)", &limits)
        .await?;
    assert_eq!(second.stdout_text(), "42 True\n");
    let echoed = session.run("x * 2", &limits).await?;
    assert_eq!(shown(&echoed), Some("84"));
    let failed = session.run("1/0", &limits).await?;
    assert_eq!(failed.exit_code, 1);
    assert!(failed.stderr_text().contains("ZeroDivisionError"));
    let still = session.run("print(x)", &limits).await?;
    assert_eq!(still.stdout_text(), "42\n");
    let exit = session.run("exit(5)", &limits).await?;
    assert_eq!(exit.exit_code, 5);
    let after = session.run("print(x)", &limits).await.unwrap_err();
    assert!(matches!(after, ExecError::SessionEnded { .. }), "{after}");
    Ok(())
}

/// Issue 16: a cell's final value, `display(...)` and matplotlib figures come back as rich
/// results. Issue 32: the final value is not printed on stdout too (as E2B's `run_code`).
#[tokio::test]
async fn python_sessions_return_rich_results() -> TestResult {
    let mut session = engine()
        .open_session(Language::Python, &SessionOptions::default())
        .await?;
    let limits = Limits::default();
    let value = session.run("x = 41\nx + 1", &limits).await?;
    assert_eq!(value.stdout_text(), "");
    assert_eq!(value.results.len(), 1, "{:?}", value.results);
    assert!(value.results[0].main);
    assert_eq!(value.results[0].data["text/plain"], "42");
    let none = session.run("y = 1", &limits).await?;
    assert!(none.results.is_empty(), "{:?}", none.results);
    let frame = session
        .run(
            "import pandas as pd\ndf = pd.DataFrame({'a': [1, 2]})\ndisplay('shown')\ndf",
            &limits,
        )
        .await?;
    assert_eq!(frame.results.len(), 2, "{:?}", frame.results);
    assert!(!frame.results[0].main);
    assert_eq!(frame.results[0].data["text/plain"], "'shown'");
    assert!(frame.results[1].main);
    assert!(frame.results[1].data["text/html"].contains("<table"));
    assert!(frame.results[1].data["text/plain"].contains("a"));
    let plot = session
        .run(
            "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nprint('drawn')",
            &limits,
        )
        .await?;
    assert_eq!(plot.stdout_text(), "drawn\n");
    assert_eq!(plot.stderr_text(), "");
    let figures: Vec<_> = plot
        .results
        .iter()
        .filter(|r| r.data.contains_key("image/png"))
        .collect();
    assert_eq!(figures.len(), 1, "{:?}", plot.results);
    assert!(figures[0].data["image/png"].starts_with("iVBORw0KGgo"));
    let shown = session
        .run("plt.plot([3, 2, 1])\nplt.show()\nprint('after')", &limits)
        .await?;
    assert_eq!(shown.stdout_text(), "after\n");
    assert_eq!(shown.stderr_text(), "");
    assert_eq!(shown.results.len(), 1, "{:?}", shown.results);
    let empty = session.run("print('no figure')", &limits).await?;
    assert!(empty.results.is_empty(), "{:?}", empty.results);
    Ok(())
}

/// Issue 16: a one-shot's figures left open come back as PNG results. Issue 32: after its
/// final value, which is its main result and is not printed (as `python -c` prints none).
#[tokio::test]
async fn python_one_shots_return_their_figures() -> TestResult {
    let result = run(py(
        "import matplotlib.pyplot as plt\nplt.plot([1, 2])\n1 + 1",
    ))
    .await;
    assert_eq!(result.stdout_text(), "");
    assert_eq!(result.exit_code, 0, "{}", result.stderr_text());
    assert_eq!(result.results.len(), 2, "{:?}", result.results);
    assert_eq!(shown(&result), Some("2"));
    assert!(result.results[0].main);
    assert!(!result.results[1].main);
    assert!(result.results[1].data["image/png"].starts_with("iVBORw0KGgo"));
    let plain = run(py("print(1)")).await;
    assert!(plain.results.is_empty());
    Ok(())
}

/// Issue 32: a one-shot shows what a session shows: its final value (its main result, not
/// printed), `display(...)`, the figures each `plt.show()` shows (without Agg's warning);
/// code that shows nothing runs as before, and mistakes read as they did.
#[tokio::test]
async fn python_one_shots_return_rich_results() -> TestResult {
    let value = run(py("x = 6\nx * 7")).await;
    assert_eq!(
        (
            value.stdout_text().as_str(),
            shown(&value),
            value.results.len()
        ),
        ("", Some("42"), 1)
    );
    let printed = run(py("print(1)")).await;
    assert_eq!(printed.stdout_text(), "1\n");
    assert!(printed.results.is_empty(), "{:?}", printed.results);
    let displayed = run(py("display({'a': 1})")).await;
    assert_eq!(displayed.exit_code, 0, "{}", displayed.stderr_text());
    assert_eq!(displayed.results.len(), 1, "{:?}", displayed.results);
    assert!(!displayed.results[0].main);
    assert_eq!(displayed.results[0].data["text/plain"], "{'a': 1}");
    for quiet in [
        "def f(): pass\nf()",
        "x = 1",
        "for i in range(2):\n    i",
        "None",
    ] {
        let result = run(py(quiet)).await;
        assert!(
            result.results.is_empty() && result.stdout.is_empty() && result.exit_code == 0,
            "{quiet:?}: {result:?}"
        );
    }
    let multiline = run(py("d = {'a': 1}\nsorted(\n    d,\n)  # the keys")).await;
    assert_eq!(shown(&multiline), Some("['a']"));
    let joined = run(py("x = 1; x + 1")).await;
    assert_eq!(shown(&joined), Some("2"));
    let frame = run(py("import pandas as pd\npd.DataFrame({'a': [1, 2]})")).await;
    assert!(
        frame.results[0].main && frame.results[0].data["text/html"].contains("<table"),
        "{:?}",
        frame.results
    );
    let plot = run(py(
        "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()\nplt.plot([2, 1])\nplt.show()\nprint('done')",
    ))
    .await;
    assert_eq!(
        (plot.stdout_text().as_str(), plot.stderr_text().as_str()),
        ("done\n", "")
    );
    // Each `show()` showed its own figure and closed it.
    assert_eq!(plot.results.len(), 2, "{:?}", plot.results);
    for figure in &plot.results {
        assert!(!figure.main && figure.data["image/png"].starts_with("iVBORw0KGgo"));
    }
    // The last line is compiled apart: its error keeps its line, and a mistake before it
    // reads as it did.
    let failed = run(py("x = 0\n1 / x")).await;
    assert!(failed.results.is_empty(), "{:?}", failed.results);
    assert_division_traceback(&failed.stderr_text(), &["line 2, in <module>\n    1 / x\n"]);
    let mistake = run(py("def f(:\n    pass\nf()")).await;
    assert_eq!(mistake.exit_code, 1);
    assert!(
        mistake.stderr_text().starts_with("  File \"<turn ")
            && mistake
                .stderr_text()
                .ends_with("\", line 1\n    def f(:\n          ^\nSyntaxError: invalid syntax\n"),
        "{}",
        mistake.stderr_text()
    );
    // A guest that starts without kiln's turn (the fuel engine's) gets it first.
    let counted = run(with_fuel(py("x = 6\nx * 7"), 1_000_000_000)).await;
    assert_eq!(
        (counted.stdout_text().as_str(), shown(&counted)),
        ("", Some("42")),
        "{}",
        counted.stderr_text()
    );
    Ok(())
}

/// Attack: a guest that floods results keeps at most 64, is told so, and finishes.
#[tokio::test]
async fn attack_a_flood_of_results_is_capped() -> TestResult {
    let mut session = engine()
        .open_session(Language::Python, &SessionOptions::default())
        .await?;
    let limits = Limits::default();
    let flood = session
        .run("for i in range(100): display(i)\nprint('done')", &limits)
        .await?;
    assert_eq!(flood.stdout_text(), "done\n");
    assert_eq!(flood.results.len(), 64);
    assert!(
        flood.stderr_text().contains("a result was not kept"),
        "{}",
        flood.stderr_text()
    );
    let forged = session
        .run(
            "import _host\n_host.call(b'kiln:display {\"data\": 5}')",
            &limits,
        )
        .await?;
    assert_eq!(forged.exit_code, 1);
    assert!(
        forged.stderr_text().contains("OSError"),
        "{}",
        forged.stderr_text()
    );
    assert!(forged.results.is_empty());
    Ok(())
}

/// Each turn's source is kept under its name for tracebacks (`linecache` asks kiln's turn),
/// and dropped once no code of that turn is alive: a long session keeps what its live code
/// came from and a bounded rest, however many turns it ran.
#[tokio::test]
async fn a_session_keeps_no_source_of_turns_whose_code_is_gone() -> TestResult {
    let mut session = engine()
        .open_session(Language::Python, &SessionOptions::default())
        .await?;
    let limits = Limits::default();
    session
        .run("def kept():\n    return 1 / 0  # line of kept", &limits)
        .await?;
    // 10 000 turns of 4 KB each: about 40 MB of source if every turn were kept.
    let filler = format!("x = 1\n{}", "# padding\n".repeat(400));
    let measure = "import sys, linecache\n\
                   s = sys.modules['_reactor']._kiln_sources\n\
                   print(len(s), sum(len(e[0]) for e in s.values()), len(linecache._interactive_cache))";
    let mut counts = Vec::new();
    for _ in 0..2 {
        for _ in 0..5000 {
            let turn = session.run(&filler, &limits).await?;
            assert_eq!(turn.outcome, Outcome::Completed);
        }
        let text = session.run(measure, &limits).await?.stdout_text();
        let parts: Vec<u64> = text
            .split_whitespace()
            .map(|p| p.parse().unwrap())
            .collect();
        counts.push(parts);
    }
    eprintln!("kept after 5 000 and 10 000 turns (entries, bytes, linecache's): {counts:?}");
    for kept in &counts {
        // Checked whenever what is kept doubles past 256 KiB (text and 256 bytes an entry):
        // at most ~60 filler turns' worth, never the 20 or 40 MB that ran.
        assert!(kept[1] <= 300_000 && kept[0] <= 80, "{kept:?}");
    }
    // kiln's turn registers nothing in the runtime's own cache.
    assert_eq!(counts[0][2], counts[1][2], "{counts:?}");
    // A function from an early turn still shows its line in a traceback.
    let failed = session.run("kept()", &limits).await?;
    assert!(
        failed.stderr_text().contains("# line of kept"),
        "{}",
        failed.stderr_text()
    );
    Ok(())
}

/// A turn's `ZeroDivisionError` traceback: the code's own frames (each of `parts` in it),
/// none of kiln's.
fn assert_division_traceback(stderr: &str, parts: &[&str]) {
    assert!(
        stderr.starts_with("Traceback (most recent call last):\n  File \"<turn ")
            && parts.iter().all(|part| stderr.contains(part))
            && stderr.ends_with("ZeroDivisionError: division by zero\n")
            && !stderr.contains("reactor"),
        "{stderr}"
    );
}

/// A session's one-line turn compiles in `single` mode (half the compile of a tree): what it
/// shows, and how it fails, is what the tree gives — the final expression only, nothing for
/// a compound statement or an annotation, the last of `;`-joined ones, errors as `python -c`.
#[tokio::test]
async fn one_line_turns_echo_as_the_tree_does() -> TestResult {
    let mut session = engine()
        .open_session(Language::Python, &SessionOptions::default())
        .await?;
    let limits = Limits::default();
    let cases: &[(&str, Option<&str>)] = &[
        ("x = 5", None),
        ("x", Some("5")),
        ("1 + 1", Some("2")),
        ("x += 1", None),
        ("x\n", Some("6")),
        ("None", None),
        ("'doc'", Some("'doc'")),
        ("1; 2", Some("2")),
        ("for i in range(3): i", None),
        ("if True: 7", None),
        ("y: int = 3", None),
        ("y, __annotate__(1)", Some("(3, {'y': <class 'int'>})")),
        ("formatted = 8", None),
        ("formatted", Some("8")),
        ("match = [1, 2]", None),
        ("match[1]", Some("2")),
        ("(lambda: 9)()", Some("9")),
        ("[i * i for i in range(4)]", Some("[0, 1, 4, 9]")),
        ("def f(): return 1 / 0", None),
        ("x = 1  # a comment; with a semicolon", None),
        ("x", Some("1")),
    ];
    for (code, value) in cases {
        let result = session.run(code, &limits).await?;
        assert_eq!(
            (
                shown(&result),
                result.stdout_text().as_str(),
                result.exit_code
            ),
            (*value, "", 0),
            "{code:?}: {}",
            result.stderr_text()
        );
    }
    let printed = session.run("print('a')", &limits).await?;
    assert_eq!(
        (shown(&printed), printed.stdout_text().as_str()),
        (None, "a\n")
    );
    // A failing one-liner, through a function a one-line compound statement defined: both
    // lines shown, no frame of kiln's.
    let failed = session.run("f()", &limits).await?;
    assert_division_traceback(
        &failed.stderr_text(),
        &[
            "line 1, in <module>\n    f()\n",
            "line 1, in f\n    def f(): return 1 / 0\n",
        ],
    );
    // An indented line fails as it does in `python -c`, and the session goes on.
    let failed = session.run("  1", &limits).await?;
    let stderr = failed.stderr_text();
    assert!(
        stderr.ends_with("IndentationError: unexpected indent\n") && !stderr.contains("reactor"),
        "{stderr}"
    );
    let later = session.run("def g():\n    return 4\n", &limits).await?;
    assert_eq!(later.exit_code, 0, "{}", later.stderr_text());
    let source = session
        .run(
            "import inspect; print(inspect.getsource(g), end='')",
            &limits,
        )
        .await?;
    assert_eq!(source.stdout_text(), "def g():\n    return 4\n");
    Ok(())
}

#[tokio::test]
async fn javascript_sessions_keep_state() -> TestResult {
    let mut session = engine()
        .open_session(Language::JavaScript, &SessionOptions::default())
        .await?;
    let limits = Limits::default();
    session
        .run("var x = 40; function add(a) { return x + a }", &limits)
        .await?;
    let result = session.run("console.log(add(2))", &limits).await?;
    assert_eq!(result.stdout_text(), "42\n");
    assert_eq!(result.exit_code, 0);
    let failed = session.run("null.boom", &limits).await?;
    assert_eq!(failed.exit_code, 1);
    assert!(
        failed.stderr_text().contains("TypeError"),
        "{}",
        failed.stderr_text()
    );
    let marker_lookalike = session
        .run(
            "console.log('\\u0001kiln-turn-end-0000:0'); console.log(x)",
            &limits,
        )
        .await?;
    assert_eq!(
        marker_lookalike.stdout_text(),
        "\u{1}kiln-turn-end-0000:0\n40\n"
    );
    // A guest that exits mid-turn ends the turn at once, not at the deadline.
    let exited = session
        .run("console.log('bye'); std.exit(3)", &limits)
        .await?;
    assert_eq!(exited.exit_code, 3);
    assert_eq!(exited.stdout_text(), "bye\n");
    assert_eq!(session.ended(), Some("the session exited"));
    assert!(exited.duration_us < 5_000_000, "waited for the deadline");

    // Running out of memory is reported as such.
    let small = Limits {
        memory_bytes: 32 << 20,
        ..Limits::default()
    };
    let options = SessionOptions {
        limits: small.clone(),
        ..SessionOptions::default()
    };
    let mut session = engine()
        .open_session(Language::JavaScript, &options)
        .await?;
    let oom = session
        .run(
            "var a = []; for (;;) a.push(new Array(1e6).fill(1.5))",
            &small,
        )
        .await?;
    assert_eq!(oom.outcome, Outcome::MemoryLimit, "{}", oom.stderr_text());
    Ok(())
}

/// Issue 16: a session's turn runs its promises and timers before it ends, may `await` at
/// its top level, and keeps `let` and `const` for later turns; an error ends the turn, not
/// the session.
#[tokio::test]
async fn javascript_session_turns_run_their_promises_and_timers() -> TestResult {
    let mut session = engine()
        .open_session(Language::JavaScript, &SessionOptions::default())
        .await?;
    let limits = Limits::default();
    let turn = session
        .run(
            "let seen = []; setTimeout(() => seen.push('timer'), 5); Promise.resolve().then(() => seen.push('job')); console.log({ started: true })",
            &limits,
        )
        .await?;
    assert_eq!(
        turn.stdout_text(),
        "{ started: true }\n",
        "{}",
        turn.stderr_text()
    );
    let turn = session
        .run(
            "const v = await new Promise((r) => setTimeout(() => r(seen.length), 1)); console.log(seen, v)",
            &limits,
        )
        .await?;
    assert_eq!(
        turn.stdout_text(),
        "[ 'job', 'timer' ] 2\n",
        "{}",
        turn.stderr_text()
    );
    let failed = session
        .run("await Promise.reject(new RangeError('no'))", &limits)
        .await?;
    assert_eq!(failed.exit_code, 1);
    assert!(
        failed.stderr_text().starts_with("RangeError: no\n"),
        "{}",
        failed.stderr_text()
    );
    // A rejection nobody handles is not reported, and the session goes on.
    session
        .run("Promise.reject(new Error('ignored'))", &limits)
        .await?;
    let after = session.run("console.log(v + 1)", &limits).await?;
    assert_eq!(after.stdout_text(), "3\n");
    assert_eq!(session.ended(), None);
    Ok(())
}

#[tokio::test]
async fn session_turns_each_get_a_fresh_file_budget() -> TestResult {
    for (language, code) in [
        (
            Language::Python,
            "open('/tmp/f', 'ab').write(b'x' * 600_000)",
        ),
        (
            Language::JavaScript,
            "var f = std.open('/tmp/f', 'a'); f.puts('x'.repeat(600000)); f.close()",
        ),
    ] {
        let mut session = engine()
            .open_session(language, &SessionOptions::default())
            .await?;
        let limits = Limits {
            fs_write_bytes: 1_000_000,
            ..Limits::default()
        };
        for turn in 0..3 {
            let result = session.run(code, &limits).await?;
            assert_eq!(
                result.exit_code,
                0,
                "{language} turn {turn}: {}",
                result.stderr_text()
            );
            assert_eq!(result.fs_written_bytes, 600_000, "{language} turn {turn}");
        }
    }
    Ok(())
}

#[tokio::test]
async fn session_turns_have_their_own_deadline_and_a_timed_out_session_ends() -> TestResult {
    for language in Language::WASM {
        let mut session = engine()
            .open_session(language, &SessionOptions::default())
            .await?;
        let short = Limits {
            timeout_ms: 500,
            ..Limits::default()
        };
        let spin = match language {
            Language::Python => "while True: pass",
            _ => "for (;;) {}",
        };
        let result = session.run(spin, &short).await?;
        assert_eq!(result.outcome, Outcome::TimedOut, "{language}");
        assert!(session.ended().is_some());
        let err = session.run("1", &short).await.unwrap_err();
        assert!(matches!(err, ExecError::SessionEnded { .. }), "{err}");
    }
    Ok(())
}

#[tokio::test]
async fn go_and_bash_are_refused_as_languages_webassembly_does_not_run() -> TestResult {
    for language in [Language::Go, Language::Bash] {
        let err = engine()
            .execute(&ExecRequest::new(language, "echo hi"))
            .await
            .unwrap_err();
        assert!(matches!(err, ExecError::Unsupported { .. }), "{err}");
        assert!(err.to_string().contains("Linux template"), "{err}");
        let err = engine()
            .open_session(language, &SessionOptions::default())
            .await
            .unwrap_err();
        assert!(matches!(err, ExecError::Unsupported { .. }), "{err}");
    }
    Ok(())
}

#[tokio::test]
async fn bad_requests_are_refused_with_clear_errors() -> TestResult {
    let mut request = py("print(1)");
    request.limits.timeout_ms = 0;
    let err = engine().execute(&request).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid limits: the timeout must be greater than zero"
    );

    let mut request = py("print(1)");
    request.limits.memory_bytes = 20 << 20;
    let err = engine().execute(&request).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "the python runtime needs a memory limit of at least 64 MiB"
    );

    let mut request = py("print(1)");
    request.stdin = vec![b'x'; kiln_core::MAX_STDIN_BYTES + 1];
    let err = engine().execute(&request).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "the request's stdin is too large: 16777217 bytes, the most is 16777216"
    );

    let mut request = py("print(1)");
    request.env = (0..1001).map(|i| (format!("V{i}"), "x".into())).collect();
    let err = engine().execute(&request).await.unwrap_err();
    assert!(
        matches!(
            err,
            ExecError::RequestTooLarge {
                what: "environment",
                ..
            }
        ),
        "{err}"
    );

    let mut request = py("print(1)");
    request.mounts = (0..65)
        .map(|i| Mount {
            host: "/tmp".into(),
            guest: format!("/m{i}"),
            writable: false,
        })
        .collect();
    let err = engine().execute(&request).await.unwrap_err();
    assert!(
        matches!(
            err,
            ExecError::RequestTooLarge {
                what: "mount list",
                ..
            }
        ),
        "{err}"
    );

    let mut request = py("print(1)");
    request.limits.stdout_bytes = 1 << 30;
    let err = engine().execute(&request).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid limits: a stdout cap of 1073741824 bytes is above the maximum of 16 MiB"
    );

    let request = py(&"#".repeat(kiln_wasm::MAX_CODE_BYTES + 1));
    let err = engine().execute(&request).await.unwrap_err();
    assert!(matches!(err, ExecError::CodeTooLarge { .. }), "{err}");

    let mut request = py("print(1)");
    request.mounts.push(Mount {
        host: "/nonexistent-kiln-dir".into(),
        guest: "/data".into(),
        writable: false,
    });
    let err = engine().execute(&request).await.unwrap_err();
    assert!(
        err.to_string()
            .starts_with("cannot grant the host folder for /data to the guest"),
        "{err}"
    );

    let mut request = py("print(1)");
    request.mounts.push(Mount {
        host: "/tmp".into(),
        guest: "/a/../b".into(),
        writable: false,
    });
    let err = engine().execute(&request).await.unwrap_err();
    assert!(matches!(err, ExecError::Grant(_)), "{err}");

    let mut request = py("print(1)");
    request.env.push(("A=B".into(), "c".into()));
    let err = engine().execute(&request).await.unwrap_err();
    assert!(matches!(err, ExecError::Grant(_)), "{err}");
    Ok(())
}

// ---------------------------------------------------------------- instruction budget (fuel)

fn with_fuel(mut request: ExecRequest, fuel: u64) -> ExecRequest {
    request.limits.fuel = Some(fuel);
    request
}

/// A loop that prints its progress until the budget stops it.
const JS_COUNTER: &str = "let n = 0; for (;;) { n++; if (n % 1000 == 0) console.log(n); }";

/// Seed 004: with a budget, the same code stops at the same point on every run, with its
/// own outcome; a larger budget gets further; code within its budget completes.
#[tokio::test]
async fn javascript_fuel_stops_at_the_same_point_every_run() -> TestResult {
    let first = run(with_fuel(js(JS_COUNTER), 20_000_000)).await;
    assert_eq!(
        first.outcome,
        Outcome::FuelExhausted,
        "{}",
        first.stderr_text()
    );
    assert_eq!(first.exit_code, -1);
    assert!(!first.stdout.is_empty(), "it ran for a while first");
    for _ in 0..3 {
        let again = run(with_fuel(js(JS_COUNTER), 20_000_000)).await;
        assert_eq!(again.outcome, Outcome::FuelExhausted);
        assert_eq!(again.stdout_text(), first.stdout_text());
    }
    let more = run(with_fuel(js(JS_COUNTER), 40_000_000)).await;
    assert_eq!(more.outcome, Outcome::FuelExhausted);
    assert!(more.stdout.len() > first.stdout.len() && more.stdout.starts_with(&first.stdout));
    let done = run(with_fuel(js("console.log(1 + 1)"), 1_000_000_000)).await;
    assert_eq!(&done.outcome, &Outcome::Completed);
    assert_eq!(done.stdout_text(), "2\n");
    // The deadline still holds with a budget too large to matter.
    let started = Instant::now();
    let endless = run(with_timeout(
        with_fuel(js("for (;;) {}"), kiln_core::MAX_FUEL),
        500,
    ))
    .await;
    assert_eq!(endless.outcome, Outcome::TimedOut);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    Ok(())
}

/// The one Python test of fuel (the fuel variant of the Python runtime compiles once per
/// cache, ~90 CPU-seconds): one-shots stop at the same point; a session opened with a
/// budget gives each turn a fresh one and ends when a turn spends it; a session opened
/// without one refuses a turn with a budget.
#[tokio::test]
async fn python_fuel_stops_at_the_same_point_every_run() -> TestResult {
    let counter = "n = 0\nwhile True:\n    n += 1\n    if n % 1000 == 0: print(n, flush=True)";
    let first = run(with_fuel(py(counter), 100_000_000)).await;
    assert_eq!(
        first.outcome,
        Outcome::FuelExhausted,
        "{}",
        first.stderr_text()
    );
    assert!(
        first.stdout_text().starts_with("1000\n2000\n"),
        "{}",
        first.stdout_text()
    );
    let second = run(with_fuel(py(counter), 100_000_000)).await;
    assert_eq!(second.outcome, Outcome::FuelExhausted);
    assert_eq!(second.stdout_text(), first.stdout_text());
    // kiln's own setup turns (the workspace, line-buffered streaming) spend none of it:
    // `print(1)` alone needs about half a million units.
    let workspace = tempfile::tempdir()?;
    let mut small = with_fuel(py("print(1)"), 1_000_000);
    small.workspace = Some(workspace.path().to_path_buf());
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    let streamed = engine().execute_streaming(&small, Some(tx)).await?;
    assert_eq!(
        streamed.outcome,
        Outcome::Completed,
        "{}",
        streamed.stderr_text()
    );
    assert_eq!(streamed.stdout_text(), "1\n");

    let options = SessionOptions {
        limits: Limits {
            fuel: Some(50_000_000),
            ..Limits::default()
        },
        ..SessionOptions::default()
    };
    let mut session = engine().open_session(Language::Python, &options).await?;
    // Each turn fits the budget; together they would not.
    for _ in 0..3 {
        let turn = session
            .run("for i in range(40000): pass", &options.limits)
            .await?;
        assert_eq!(turn.outcome, Outcome::Completed, "{}", turn.stderr_text());
    }
    let spent = session.run("while True: pass", &options.limits).await?;
    assert_eq!(spent.outcome, Outcome::FuelExhausted);
    let err = session.run("1", &options.limits).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "the session has ended: the session spent its instruction budget (fuel) and was stopped; open a new session"
    );

    let mut plain = engine()
        .open_session(Language::Python, &SessionOptions::default())
        .await?;
    let err = plain.run("1", &options.limits).await.unwrap_err();
    assert!(matches!(err, ExecError::FuelUnavailable { .. }), "{err}");
    assert_eq!(
        shown(&plain.run("1 + 1", &Limits::default()).await?),
        Some("2")
    );
    Ok(())
}

#[tokio::test]
async fn fuel_out_of_range_and_javascript_sessions_with_fuel_are_refused() -> TestResult {
    for fuel in [0, kiln_core::MAX_FUEL + 1] {
        let err = engine()
            .execute(&with_fuel(js("1"), fuel))
            .await
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "invalid limits: an instruction budget (fuel) of {fuel} is outside 1..=1000000000000"
            )
        );
    }
    let options = SessionOptions {
        limits: Limits {
            fuel: Some(1_000_000),
            ..Limits::default()
        },
        ..SessionOptions::default()
    };
    let err = engine()
        .open_session(Language::JavaScript, &options)
        .await
        .unwrap_err();
    assert!(matches!(err, ExecError::FuelUnavailable { .. }), "{err}");
    let mut session = engine()
        .open_session(Language::JavaScript, &SessionOptions::default())
        .await?;
    let err = session.run("1", &options.limits).await.unwrap_err();
    assert!(matches!(err, ExecError::FuelUnavailable { .. }), "{err}");
    Ok(())
}

// ---------------------------------------------------------------- attacks

#[tokio::test]
async fn attack_infinite_loop_times_out() -> TestResult {
    for request in [py("while True: pass"), js("for (;;) {}")] {
        let started = Instant::now();
        let result = run(with_timeout(request, 1000)).await;
        assert_eq!(result.outcome, Outcome::TimedOut);
        assert_eq!(result.exit_code, -1);
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{:?}",
            started.elapsed()
        );
    }
    Ok(())
}

#[tokio::test]
async fn attack_blocking_sleep_is_cut_at_the_deadline() -> TestResult {
    for request in [py("import time\ntime.sleep(100)"), js("os.sleep(100000)")] {
        let started = Instant::now();
        let result = run(with_timeout(request, 1000)).await;
        assert_eq!(result.outcome, Outcome::TimedOut);
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{:?}",
            started.elapsed()
        );
    }
    Ok(())
}

/// Sleeping costs no fuel: a guest with a budget that blocks in the host still stops at
/// the wall-clock deadline, not never.
#[tokio::test]
async fn attack_blocking_sleep_with_a_fuel_budget_is_cut_at_the_deadline() -> TestResult {
    for request in [py("import time\ntime.sleep(100)"), js("os.sleep(100000)")] {
        let started = Instant::now();
        let result = run(with_timeout(with_fuel(request, 1_000_000_000), 1000)).await;
        assert_eq!(
            result.outcome,
            Outcome::TimedOut,
            "{}",
            result.stderr_text()
        );
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{:?}",
            started.elapsed()
        );
    }
    Ok(())
}

#[tokio::test]
async fn attack_memory_blow_up_hits_the_cap() -> TestResult {
    let cases = [
        py("a = []\nwhile True:\n    a.append(bytearray(10**6))"),
        py("x = bytearray(200 * 1024**2)"),
        js("let a = []; for (;;) a.push(new Array(1e6).fill(1.5))"),
    ];
    for mut request in cases {
        request.limits.memory_bytes = 64 << 20;
        let result = run(request).await;
        assert_eq!(
            result.outcome,
            Outcome::MemoryLimit,
            "{}",
            result.stderr_text()
        );
        assert!(result.peak_memory_bytes <= 64 << 20);
    }
    Ok(())
}

#[tokio::test]
async fn attack_deep_recursion_is_a_clean_error() -> TestResult {
    let result = run(py("def f(n): return f(n + 1)\nf(0)")).await;
    assert_eq!(result.outcome, Outcome::Completed);
    assert_eq!(result.exit_code, 1);
    assert!(
        result.stderr_text().contains("RecursionError"),
        "{}",
        result.stderr_text()
    );

    let result = run(py("import json\njson.loads('[' * 100000)")).await;
    assert_eq!(result.exit_code, 1);
    assert!(
        result.stderr_text().contains("RecursionError"),
        "{}",
        result.stderr_text()
    );

    let result = run(js("function f(n) { return f(n + 1) + 1 } f(0)")).await;
    assert_eq!(result.exit_code, 1);
    assert!(
        result
            .stderr_text()
            .contains("RangeError: Maximum call stack size exceeded")
    );
    Ok(())
}

#[tokio::test]
async fn attack_hundred_megabytes_of_output_is_truncated() -> TestResult {
    let cases = [
        py("import sys\nsys.stdout.write('x' * 100_000_000)\nsys.stderr.write('y' * 100_000_000)"),
        js("std.out.puts('x'.repeat(1e8)); std.err.puts('y'.repeat(1e8))"),
    ];
    for request in cases {
        let result = run(request).await;
        assert_eq!(result.outcome, Outcome::OutputTruncated);
        assert_eq!(result.exit_code, 0);
        assert_eq!(result.stdout.len(), 1 << 20);
        assert_eq!(result.stderr.len(), 1 << 20);
        assert!(result.stdout_truncated && result.stderr_truncated);
        assert!(result.stdout.iter().all(|&b| b == b'x'));
    }
    Ok(())
}

#[tokio::test]
async fn attack_reading_host_files_fails() -> TestResult {
    let code = "for p in ['/etc/passwd', '/proc/self/environ', '/root', '/../etc/passwd']:\n\
                \x20   try:\n        open(p).read()\n        print('READ', p)\n\
                \x20   except OSError as e:\n        print(type(e).__name__)";
    let result = run(py(code)).await;
    assert_eq!(
        result.stdout_text(),
        "FileNotFoundError\nFileNotFoundError\nFileNotFoundError\nFileNotFoundError\n",
        "{}",
        result.stderr_text()
    );
    let result = run(js(
        "console.log(std.loadFile('/etc/passwd'), std.open('/etc/passwd', 'r'))",
    ))
    .await;
    assert_eq!(result.stdout_text(), "null null\n");
    Ok(())
}

#[tokio::test]
async fn attack_dotdot_and_symlink_escapes_from_the_workspace_fail() -> TestResult {
    let outer = tempfile::tempdir()?;
    std::fs::write(outer.path().join("secret.txt"), "SECRET")?;
    let workspace = outer.path().join("ws");
    std::fs::create_dir(&workspace)?;
    std::os::unix::fs::symlink(outer.path().join("secret.txt"), workspace.join("link"))?;
    std::os::unix::fs::symlink("/etc", workspace.join("etc"))?;
    let code = "import os\n\
                def attempt(label, fn):\n\
                \x20   try:\n        fn()\n        print(label, 'ESCAPED')\n\
                \x20   except OSError as e:\n        print(label, 'blocked')\n\
                attempt('dotdot', lambda: open('../secret.txt').read())\n\
                attempt('abs-dotdot', lambda: open('/workspace/../ws/../secret.txt').read())\n\
                attempt('host-link', lambda: open('link').read())\n\
                attempt('dir-link', lambda: open('etc/passwd').read())\n\
                attempt('own-abs-link', lambda: os.symlink('/etc/passwd', 'mine'))\n\
                attempt('own-rel-link', lambda: os.symlink('../secret.txt', 'rel') or open('rel').read())\n\
                attempt('write-out', lambda: open('../evil.txt', 'w').write('x'))";
    let mut request = py(code);
    request.workspace = Some(workspace.clone());
    let result = run(request).await;
    assert_eq!(
        result.stdout_text(),
        "dotdot blocked\nabs-dotdot blocked\nhost-link blocked\ndir-link blocked\n\
         own-abs-link blocked\nown-rel-link blocked\nwrite-out blocked\n",
        "{}",
        result.stderr_text()
    );
    assert!(!outer.path().join("evil.txt").exists());

    let mut request = js(
        "console.log(std.loadFile('../secret.txt'), std.loadFile('link'), std.loadFile('etc/passwd'))",
    );
    request.workspace = Some(workspace);
    let result = run(request).await;
    assert_eq!(
        result.stdout_text(),
        "null null null\n",
        "{}",
        result.stderr_text()
    );
    Ok(())
}

#[tokio::test]
async fn attack_writing_outside_the_grants_fails() -> TestResult {
    let code = "for p in ['/usr/local/lib/x.py', '/etc/x', '/x', '/usr/local/lib/python315.zip/matplotlib/mpl-data/x']:\n\
                \x20   try:\n        open(p, 'w').write('x')\n        print('WROTE', p)\n\
                \x20   except OSError as e:\n        print(type(e).__name__)";
    let result = run(py(code)).await;
    let lines: Vec<String> = result.stdout_text().lines().map(str::to_owned).collect();
    assert_eq!(lines.len(), 4, "{}", result.stderr_text());
    assert!(lines.iter().all(|l| !l.starts_with("WROTE")), "{lines:?}");

    let result = run(js(
        "console.log(['/etc/x', '/x', '/usr/x'].map(p => std.open(p, 'w')).join(','))",
    ))
    .await;
    assert_eq!(result.stdout_text(), ",,\n", "{}", result.stderr_text());
    Ok(())
}

#[tokio::test]
async fn attack_file_quota_holds() -> TestResult {
    let mut request = py("f = open('/tmp/big', 'wb')\n\
                          try:\n    for _ in range(100):\n        f.write(b'x' * 1_000_000)\n        f.flush()\n\
                          except OSError as e:\n    print(e.errno)");
    request.limits.fs_write_bytes = 10 << 20;
    let result = run(request).await;
    assert_eq!(result.stdout_text(), "51\n", "{}", result.stderr_text());
    assert!(result.fs_written_bytes <= 10 << 20);

    let mut request = py(
        "import os\nn = 0\ntry:\n    while True:\n        open(f'/tmp/f{n}', 'w').close()\n        n += 1\n\
                          except OSError as e:\n    print(n, e.errno)\n\
                          open('/tmp/f0', 'w').write('reopen is fine')\nprint('ok')",
    );
    request.limits.fs_create_count = 50;
    let result = run(request).await;
    assert_eq!(
        result.stdout_text(),
        "50 51\nok\n",
        "{}",
        result.stderr_text()
    );

    let mut request = py(
        "import os\nfd = os.open('/tmp/sparse', os.O_CREAT | os.O_WRONLY)\n\
                          try:\n    os.ftruncate(fd, 10**12)\nexcept OSError as e:\n    print(e.errno)",
    );
    request.limits.fs_write_bytes = 1 << 20;
    let result = run(request).await;
    assert_eq!(result.stdout_text(), "51\n", "{}", result.stderr_text());
    Ok(())
}

#[tokio::test]
async fn attack_sparse_files_pay_for_their_holes() -> TestResult {
    // Under the default 64 MiB budget, one byte at 1 GiB (by seek, pwrite or truncate) would
    // make a 1 GiB file: each is refused with ENOSPC and leaves the file empty.
    let workspace = tempfile::tempdir()?;
    let code = "import os\n\
                def attempt(label, fn):\n\
                \x20   try:\n        fn()\n        print(label, 'ALLOWED')\n\
                \x20   except OSError as e:\n        print(label, e.errno)\n\
                def seek():\n\
                \x20   with open('seek.bin', 'wb') as f:\n        f.seek(1 << 30)\n        f.write(b'x')\n\
                def pwrite():\n\
                \x20   fd = os.open('pwrite.bin', os.O_CREAT | os.O_WRONLY)\n\
                \x20   try:\n        os.pwrite(fd, b'x', 1 << 30)\n    finally:\n        os.close(fd)\n\
                def truncate():\n\
                \x20   with open('truncate.bin', 'wb') as f:\n        f.truncate(1 << 30)\n\
                attempt('seek', seek)\n\
                attempt('pwrite', pwrite)\n\
                attempt('truncate', truncate)\n\
                attempt('os.truncate', lambda: os.truncate('truncate.bin', 1 << 30))\n\
                print(hasattr(os, 'posix_fallocate'))\n\
                for name in ['seek.bin', 'pwrite.bin', 'truncate.bin']:\n\
                \x20   print(name, os.path.getsize(name))";
    let mut request = py(code);
    request.workspace = Some(workspace.path().to_path_buf());
    let result = run(request).await;
    assert_eq!(
        result.stdout_text(),
        "seek 51\npwrite 51\ntruncate 51\nos.truncate 51\nFalse\n\
         seek.bin 0\npwrite.bin 0\ntruncate.bin 0\n",
        "{}",
        result.stderr_text()
    );
    assert_eq!(result.fs_written_bytes, 0);
    for name in ["seek.bin", "pwrite.bin", "truncate.bin"] {
        assert_eq!(
            std::fs::metadata(workspace.path().join(name))?.len(),
            0,
            "{name}"
        );
    }

    let code = "var fd = os.open('os.bin', os.O_WRONLY | os.O_CREAT);\n\
                console.log(os.seek(fd, 1 << 30, std.SEEK_SET));\n\
                console.log(os.write(fd, new Uint8Array([120]).buffer, 0, 1));\n\
                os.close(fd);\n\
                var f = std.open('std.bin', 'w');\n\
                f.seek(1 << 30, std.SEEK_SET);\n\
                f.puts('x');\n\
                f.flush();\n\
                console.log(f.error());\n\
                f.close();\n\
                console.log(os.stat('os.bin')[0].size, os.stat('std.bin')[0].size);";
    let mut request = js(code);
    request.workspace = Some(workspace.path().to_path_buf());
    let result = run(request).await;
    assert_eq!(
        result.stdout_text(),
        "1073741824\n-51\ntrue\n0 0\n",
        "{}",
        result.stderr_text()
    );
    assert_eq!(result.fs_written_bytes, 0);
    for name in ["os.bin", "std.bin"] {
        assert_eq!(
            std::fs::metadata(workspace.path().join(name))?.len(),
            0,
            "{name}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn attack_a_file_opened_on_a_closed_stdio_number_is_still_charged() -> TestResult {
    // wasmtime-wasi hands a closed fd 1 to the next open file; writes to it are file writes.
    let code = "import os\nos.close(1)\n\
                fd = os.open('/tmp/big', os.O_CREAT | os.O_WRONLY)\n\
                try:\n    for _ in range(100):\n        os.write(fd, b'x' * 1_000_000)\n\
                except OSError as e:\n    os.write(2, f'{fd} {e.errno} {os.fstat(fd).st_size}'.encode())";
    let mut request = py(code);
    request.limits.fs_write_bytes = 10 << 20;
    let result = run(request).await;
    assert_eq!(result.stderr_text(), "1 51 10000000");
    assert_eq!(result.fs_written_bytes, 10_000_000);
    Ok(())
}

#[tokio::test]
async fn file_quota_charges_overwrites_and_appends_their_bytes_and_holes_their_size() -> TestResult
{
    // The budget is exactly what this costs: a 1 MiB write, a 1000-byte overwrite inside the
    // file, a 10-byte append, one byte past a 100-byte hole (101), a free shrink and a
    // 100-byte growth. Any extra charge would fail a write; the next byte is refused.
    let workspace = tempfile::tempdir()?;
    let code = "import os\n\
                with open('data.bin', 'wb') as f:\n\
                \x20   f.write(b'a' * (1 << 20))\n    f.seek(1000)\n    f.write(b'b' * 1000)\n\
                with open('data.bin', 'ab') as f:\n    f.write(b'c' * 10)\n\
                with open('data.bin', 'r+b') as f:\n\
                \x20   f.seek(0, 2)\n    f.seek(100, 1)\n    f.write(b'd')\n\
                \x20   f.truncate(5)\n    f.truncate(105)\n\
                print(os.path.getsize('data.bin'))\n\
                try:\n\
                \x20   with open('more.bin', 'wb') as f:\n        f.write(b'x')\n\
                except OSError as e:\n    print(e.errno)";
    let mut request = py(code);
    request.workspace = Some(workspace.path().to_path_buf());
    request.limits.fs_write_bytes = (1 << 20) + 1000 + 10 + 101 + 100;
    let result = run(request).await;
    assert_eq!(
        result.stdout_text(),
        "105\n51\n",
        "{}",
        result.stderr_text()
    );
    assert_eq!(result.fs_written_bytes, (1 << 20) + 1000 + 10 + 1);
    let data = std::fs::read(workspace.path().join("data.bin"))?;
    assert_eq!(data.len(), 105);
    assert_eq!(&data[..5], b"aaaaa");
    assert!(data[5..].iter().all(|&b| b == 0));
    assert_eq!(
        std::fs::metadata(workspace.path().join("more.bin"))?.len(),
        0
    );
    Ok(())
}

#[tokio::test]
async fn attack_sockets_and_subprocesses_fail() -> TestResult {
    let code = "import socket, subprocess, os\n\
                def attempt(label, fn):\n\
                \x20   try:\n        fn()\n        print(label, 'ALLOWED')\n\
                \x20   except Exception as e:\n        print(label, 'blocked')\n\
                attempt('connect', lambda: socket.create_connection(('127.0.0.1', 22), timeout=1))\n\
                attempt('dns', lambda: socket.getaddrinfo('example.com', 80))\n\
                attempt('listen', lambda: socket.socket().bind(('0.0.0.0', 8080)))\n\
                attempt('subprocess', lambda: subprocess.run(['ls']))\n\
                attempt('system', lambda: os.system('ls') == 0 or 1 / 0)\n\
                attempt('fork', lambda: os.fork())";
    let result = run(py(code)).await;
    assert_eq!(
        result.stdout_text(),
        "connect blocked\ndns blocked\nlisten blocked\nsubprocess blocked\nsystem blocked\nfork blocked\n",
        "{}",
        result.stderr_text()
    );
    let result = run(js(
        "console.log(typeof fetch, typeof os.exec, typeof os.socket, typeof require)",
    ))
    .await;
    assert_eq!(
        result.stdout_text(),
        "undefined undefined undefined undefined\n"
    );
    Ok(())
}

#[tokio::test]
async fn attack_threads_cannot_start() -> TestResult {
    let code = "import threading\ntry:\n    threading.Thread(target=print).start()\n    print('STARTED')\n\
                except RuntimeError as e:\n    print('blocked')";
    let result = run(py(code)).await;
    assert_eq!(
        result.stdout_text(),
        "blocked\n",
        "{}",
        result.stderr_text()
    );
    let result = run(js("console.log(typeof os.Worker)")).await;
    assert_eq!(result.stdout_text(), "undefined\n");
    Ok(())
}

#[tokio::test]
async fn attack_environment_is_only_what_was_granted() -> TestResult {
    // SAFETY: set once before any guest reads it; tests only read the host environment here.
    unsafe { std::env::set_var("KILN_TEST_HOST_SECRET", "hunter2") };
    let mut request = py("import os\nprint(sorted(os.environ.items()))");
    request.env.push(("GRANTED".into(), "yes".into()));
    let result = run(request).await;
    assert_eq!(
        result.stdout_text(),
        "[('GRANTED', 'yes'), ('HOME', '/tmp'), ('MPLBACKEND', 'Agg'), ('PYTHONTZPATH', ''), ('TMPDIR', '/tmp')]\n"
    );
    let mut request = js("console.log(JSON.stringify(std.getenviron()))");
    request.env.push(("GRANTED".into(), "yes".into()));
    let result = run(request).await;
    assert_eq!(
        result.stdout_text(),
        "{\"TMPDIR\":\"/tmp\",\"HOME\":\"/tmp\",\"GRANTED\":\"yes\"}\n"
    );
    Ok(())
}

#[tokio::test]
async fn attack_one_execution_cannot_see_another_s_tmp() -> TestResult {
    let first = run(py("open('/tmp/left-behind', 'w').write('x')\nprint('ok')")).await;
    assert_eq!(first.stdout_text(), "ok\n");
    let second = run(py("import os\nprint(os.listdir('/tmp'))")).await;
    assert_eq!(second.stdout_text(), "[]\n");
    Ok(())
}

#[tokio::test]
async fn many_concurrent_executions_stay_isolated() -> TestResult {
    let mut tasks = Vec::new();
    for i in 0..16 {
        tasks.push(tokio::spawn(async move {
            let request = if i % 2 == 0 {
                py(&format!("x = {i}\nprint(x * 2)"))
            } else {
                js(&format!("var x = {i}; console.log(x * 2)"))
            };
            (i, engine().execute(&request).await)
        }));
    }
    for task in tasks {
        let (i, result) = task.await?;
        assert_eq!(result?.stdout_text(), format!("{}\n", i * 2));
    }
    Ok(())
}

#[tokio::test]
async fn a_session_whose_guest_trapped_says_so_and_is_never_reused() -> TestResult {
    let mut session = engine()
        .open_session(Language::Python, &SessionOptions::default())
        .await?;
    let limits = Limits::default();
    session.run("x = 1", &limits).await?;
    let crashed = session.run("import os\nos.abort()", &limits).await?;
    assert_eq!(
        crashed.outcome,
        Outcome::Crashed {
            trap: "unreachable code reached".into()
        }
    );
    assert_eq!(
        session.ended(),
        Some("the session crashed (unreachable code reached)")
    );
    let err = session.run("print(x)", &limits).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "the session has ended: the session crashed (unreachable code reached); open a new session"
    );
    Ok(())
}

#[tokio::test]
async fn session_output_streams_as_it_is_written() -> TestResult {
    for (language, code) in [
        (
            Language::Python,
            "import sys\nprint('a', flush=True)\nprint('b', file=sys.stderr)",
        ),
        (
            Language::JavaScript,
            "console.log('a'); std.out.flush(); std.err.puts('b\\n')",
        ),
    ] {
        let mut session = engine()
            .open_session(language, &SessionOptions::default())
            .await?;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let result = session
            .run_streaming(code, &Limits::default(), Some(tx))
            .await?;
        assert_eq!(result.stdout_text(), "a\n", "{language}");
        assert_eq!(result.stderr_text(), "b\n", "{language}");
        let mut chunks = Vec::new();
        while let Ok(chunk) = rx.try_recv() {
            chunks.push((chunk.stream, chunk.data.to_vec()));
        }
        assert_eq!(
            chunks,
            vec![
                (kiln_wasm::StreamKind::Stdout, b"a\n".to_vec()),
                (kiln_wasm::StreamKind::Stderr, b"b\n".to_vec())
            ],
            "{language}"
        );
    }
    Ok(())
}

/// Issue 32: a final expression's value is the main result, one-shot or session, and
/// neither prints it (a one-shot's stdout is `python -c`'s; a session's is E2B's `run_code`'s).
#[tokio::test]
async fn final_expressions_are_results_not_output_in_one_shots_and_sessions() -> TestResult {
    let result = run(py("1 + 1")).await;
    assert_eq!(result.stdout_text(), "");
    assert_eq!(shown(&result), Some("2"));
    let result = run(py("for i in range(2):\n    print(i)")).await;
    assert_eq!(result.stdout_text(), "0\n1\n");
    let result = run(py("x = 1\nraise KeyError(x)")).await;
    assert!(
        result.stderr_text().contains("line 2"),
        "{}",
        result.stderr_text()
    );
    let mut session = engine()
        .open_session(Language::Python, &SessionOptions::default())
        .await?;
    let echoed = session.run("1 + 1", &Limits::default()).await?;
    assert_eq!(echoed.stdout_text(), "");
    assert_eq!(shown(&echoed), Some("2"));
    // As in a notebook: the final expression only, after what comes before it; None not
    // shown.
    let echoed = session
        .run("print('a')\ny = 20\ny + 1", &Limits::default())
        .await?;
    assert_eq!(echoed.stdout_text(), "a\n");
    assert_eq!(shown(&echoed), Some("21"));
    let echoed = session.run("print('b')", &Limits::default()).await?;
    assert_eq!(echoed.stdout_text(), "b\n");
    assert_eq!(shown(&echoed), None);
    Ok(())
}

/// kiln compiles a one-shot's code from its source and a session's through `ast` (to echo
/// its final expression): either way a mistake reads as `python -c` shows it, with no frame
/// of kiln's nor of `ast.py`, and a session goes on after it.
#[tokio::test]
async fn syntax_errors_read_as_python_shows_them_in_one_shots_and_sessions() -> TestResult {
    fn python_like(stderr: &str) {
        assert!(
            stderr.starts_with("  File \"<turn ")
                && stderr.ends_with(
                    "\", line 1\n    x = (1\n        ^\nSyntaxError: '(' was never closed\n"
                ),
            "{stderr}"
        );
        assert!(
            !stderr.contains("ast.py")
                && !stderr.contains("Traceback")
                && !stderr.contains("reactor"),
            "{stderr}"
        );
    }
    let result = run(py("x = (1")).await;
    assert_eq!(result.exit_code, 1);
    python_like(&result.stderr_text());
    // A runtime error's traceback has the code's frames only.
    let result = run(py("def f():\n    return 1 / 0\nf()")).await;
    assert_division_traceback(
        &result.stderr_text(),
        &["line 3, in <module>", "line 2, in f"],
    );
    let mut session = engine()
        .open_session(Language::Python, &SessionOptions::default())
        .await?;
    let limits = Limits::default();
    session.run("x = 41", &limits).await?;
    let failed = session.run("x = (1", &limits).await?;
    assert_eq!(failed.exit_code, 1);
    python_like(&failed.stderr_text());
    let echoed = session.run("x + 1", &limits).await?;
    assert_eq!(shown(&echoed), Some("42"));
    // A session with an environment of its own starts unprimed: its setup turn installs
    // kiln's turn, so it reads the same.
    let options = SessionOptions {
        env: vec![("GREETING".into(), "hi".into())],
        ..SessionOptions::default()
    };
    let mut session = engine().open_session(Language::Python, &options).await?;
    let failed = session.run("x = (1", &limits).await?;
    python_like(&failed.stderr_text());
    let echoed = session
        .run("import os, sys\n'_kiln_sources' in dir(sys.modules['_reactor']), os.environ['GREETING']", &limits)
        .await?;
    assert_eq!(shown(&echoed), Some("(True, 'hi')"));
    Ok(())
}

#[tokio::test]
async fn a_full_engine_says_it_is_busy() -> TestResult {
    let small = WasmEngine::with_options(
        test_cache(),
        &kiln_wasm::EngineOptions {
            max_instances: 2,
            ready_instances: 0,
            ..kiln_wasm::EngineOptions::default()
        },
    )?;
    small.prepare(Language::Python, &Quiet)?;
    let options = SessionOptions::default();
    let _a = small.open_session(Language::Python, &options).await?;
    let _b = small.open_session(Language::Python, &options).await?;
    let err = small.execute(&py("print(1)")).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "too many sandboxes at once: all 2 slots are in use; retry when some finish"
    );
    drop(_a);
    let result = small.execute(&py("print(1)")).await?;
    assert_eq!(result.stdout_text(), "1\n");
    Ok(())
}

/// The cache the tests use: `KILN_CACHE_DIR` as the binary reads it, else the default.
fn test_cache() -> CacheDir {
    match std::env::var_os("KILN_CACHE_DIR") {
        Some(dir) if !dir.is_empty() => CacheDir::new(dir),
        _ => CacheDir::new(CacheDir::default_root()),
    }
}

/// A first run that must compile its runtime (minutes for Python on a fresh cache, the first
/// time a request asks for fuel) compiles it off the caller's thread: an executor worker's one
/// thread goes on answering the pool's pings, which kill a worker silent for 10 s. Here a fresh
/// cache (the runtimes, no compiled module) compiles JavaScript while a ticker shares the
/// thread.
#[tokio::test(flavor = "current_thread")]
async fn a_first_run_compiles_its_runtime_off_the_callers_thread() -> TestResult {
    engine(); // the runtimes are fetched
    let fresh = tempfile::tempdir()?;
    std::os::unix::fs::symlink(
        test_cache().root().join("runtimes"),
        fresh.path().join("runtimes"),
    )?;
    let cold = WasmEngine::new(CacheDir::new(fresh.path()))?;
    let longest_gap = std::sync::Arc::new(std::sync::Mutex::new(Duration::ZERO));
    let ticker = tokio::spawn({
        let longest_gap = longest_gap.clone();
        async move {
            let mut last = Instant::now();
            loop {
                tokio::time::sleep(Duration::from_millis(5)).await;
                let gap = last.elapsed();
                last = Instant::now();
                let mut longest = longest_gap.lock().expect("lock");
                *longest = (*longest).max(gap);
            }
        }
    });
    // The ticker takes its first reading before the run starts.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let started = Instant::now();
    let result = cold.execute(&js("console.log(1+1)")).await?;
    let took = started.elapsed();
    ticker.abort();
    assert_eq!(result.stdout_text(), "2\n", "{}", result.stderr_text());
    let compiled = std::fs::read_dir(fresh.path().join("modules"))?.count();
    assert_eq!(
        compiled, 1,
        "the run compiled JavaScript into the fresh cache"
    );
    let longest = *longest_gap.lock().expect("lock");
    assert!(
        took > Duration::from_millis(200),
        "compiling took {took:?}: too quick to tell whether it blocked the thread"
    );
    assert!(
        longest < took / 3,
        "the thread was blocked for {longest:?} of the {took:?} the first run took"
    );
    Ok(())
}
