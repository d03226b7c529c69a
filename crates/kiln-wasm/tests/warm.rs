//! Issue 18: warm starts and forks, against the real Python runtime. The warm engine's module
//! and the `python-data` image are built on first use into kiln's cache
//! (`KILN_CACHE_DIR` or `~/.cache/kiln`), as any kiln command does.

use std::sync::OnceLock;

use kiln_core::{ExecRequest, Language};
use kiln_wasm::{CacheDir, PYTHON_DATA, PYTHON_DATA_WARM_UP, Quiet, SessionOptions, WasmEngine};

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn engine() -> &'static WasmEngine {
    static ENGINE: OnceLock<WasmEngine> = OnceLock::new();
    ENGINE.get_or_init(|| {
        let root = std::env::var_os("KILN_CACHE_DIR")
            .map(Into::into)
            .unwrap_or_else(CacheDir::default_root);
        WasmEngine::new(CacheDir::new(root)).expect("engine")
    })
}

fn data(code: &str) -> ExecRequest {
    let mut request = ExecRequest::new(Language::Python, code);
    request.template = Some(PYTHON_DATA.into());
    request
}

fn options(template: Option<&str>) -> SessionOptions {
    SessionOptions {
        template: template.map(Into::into),
        ..SessionOptions::default()
    }
}

async fn out(session: &mut kiln_wasm::Session, code: &str) -> String {
    let result = session
        .run(code, &kiln_core::Limits::default())
        .await
        .expect("turn");
    assert!(result.success(), "{code}: {}", result.stderr_text());
    result.stdout_text()
}

/// The text of a session turn's final value (its main result; nothing on stdout).
async fn value(session: &mut kiln_wasm::Session, code: &str) -> String {
    let result = session
        .run(code, &kiln_core::Limits::default())
        .await
        .expect("turn");
    assert!(result.success(), "{code}: {}", result.stderr_text());
    assert_eq!(result.stdout_text(), "", "{code}");
    let main = result.results.iter().find(|r| r.main).expect("a value");
    main.data["text/plain"].clone()
}

#[tokio::test]
async fn python_data_starts_with_the_data_stack_imported_and_its_own_environment() -> TestResult {
    let mut request = data(
        "import sys, os\n\
         print(sorted(m for m in ('numpy', 'pandas', 'scipy', 'matplotlib.pyplot') if m in sys.modules))\n\
         import pandas as pd\n\
         print(pd.DataFrame({'a': [1, 2, 3]}).a.sum(), os.environ.get('GREETING'), os.environ['HOME'])\n\
         print(repr(os.environ['TRICKY']), os.environ['EMPTY'] == '', os.environ['HOME2'])",
    );
    request.env = vec![
        ("GREETING".into(), "hello".into()),
        ("TRICKY".into(), "a=b \"q\" \\ \n\t ü 🎉 \u{2028}".into()),
        ("EMPTY".into(), String::new()),
        ("HOME2".into(), "x".into()),
    ];
    let result = engine().execute(&request).await?;
    assert!(result.success(), "{}", result.stderr_text());
    assert_eq!(
        result.stdout_text(),
        "['matplotlib.pyplot', 'numpy', 'pandas', 'scipy']\n6 hello /tmp\n'a=b \"q\" \\\\ \\n\\t ü 🎉 \\u2028' True x\n"
    );
    // One-shots of the template start from its primed module, made into the cache.
    assert!(engine().is_warm_prepared(PYTHON_DATA_WARM_UP)?);
    // The next one sees none of the previous one's environment.
    let result = engine()
        .execute(&data("import os; print(os.environ.get('GREETING'))"))
        .await?;
    assert_eq!(result.stdout_text(), "None\n");
    // Its one-shots and sessions show a mistake as `python -c` does (no frame of `ast.py`),
    // and its sessions show a final expression's value.
    let result = engine().execute(&data("x = (1")).await?;
    let stderr = result.stderr_text();
    assert!(
        stderr.starts_with("  File \"<turn ")
            && stderr.ends_with("SyntaxError: '(' was never closed\n"),
        "{stderr}"
    );
    assert!(!stderr.contains("ast.py"), "{stderr}");
    let mut session = engine()
        .open_session(Language::Python, &options(Some(PYTHON_DATA)))
        .await?;
    assert_eq!(
        value(&mut session, "import numpy as np\nint(np.arange(3).sum())").await,
        "3"
    );
    let failed = session.run("x = (1", &kiln_core::Limits::default()).await?;
    assert!(
        !failed.stderr_text().contains("ast.py"),
        "{}",
        failed.stderr_text()
    );
    assert_eq!(value(&mut session, "np.int64(7) * 6").await, "np.int64(42)");
    Ok(())
}

#[tokio::test]
async fn warm_starts_draw_different_random_numbers() -> TestResult {
    let code = "import random, numpy, tempfile\n\
                print(random.random(), numpy.random.rand(), next(tempfile._get_candidate_names()))";
    let a = engine().execute(&data(code)).await?;
    let b = engine().execute(&data(code)).await?;
    assert!(a.success(), "{}", a.stderr_text());
    let (a, b) = (a.stdout_text(), b.stdout_text());
    let (a, b): (Vec<&str>, Vec<&str>) = (a.split(' ').collect(), b.split(' ').collect());
    for i in 0..3 {
        assert_ne!(a[i], b[i], "value {i} repeats across warm starts");
    }
    Ok(())
}

#[tokio::test]
async fn a_workspace_folder_is_seen_after_a_warm_start() -> TestResult {
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("data.csv"), "a,b\n1,2\n3,4\n")?;
    let mut request =
        data("import pandas as pd, os; print(os.getcwd(), pd.read_csv('data.csv').b.sum())");
    request.workspace = Some(dir.path().to_path_buf());
    let result = engine().execute(&request).await?;
    assert!(result.success(), "{}", result.stderr_text());
    assert_eq!(result.stdout_text(), "/workspace 6\n");
    Ok(())
}

/// Both kinds of parent: one started fresh (its memory captured whole) and one started warm
/// (its image shared, its changed pages copied).
#[tokio::test]
async fn a_fork_keeps_the_state_and_shares_nothing_writable() -> TestResult {
    for template in [None, Some(PYTHON_DATA)] {
        let mut parent = engine()
            .open_session(Language::Python, &options(template))
            .await?;
        out(&mut parent, "import time, random\nxs = [1, 2, 3]\nt0 = time.monotonic()\nopen('/tmp/parent', 'w').write('p')").await;
        let mut child = parent.fork(engine(), &options(template)).await?;
        assert_eq!(out(&mut child, "print(xs)").await, "[1, 2, 3]\n");
        out(
            &mut child,
            "xs.append(4); open('/tmp/child', 'w').write('c')",
        )
        .await;
        out(&mut parent, "xs.append(5)").await;
        assert_eq!(out(&mut parent, "print(xs)").await, "[1, 2, 3, 5]\n");
        assert_eq!(out(&mut child, "print(xs)").await, "[1, 2, 3, 4]\n");
        // Files: each has its own /tmp (the fork's starts empty).
        let ls = "import os; print(sorted(os.listdir('/tmp')))";
        assert_eq!(out(&mut parent, ls).await, "['parent']\n");
        assert_eq!(out(&mut child, ls).await, "['child']\n");
        // The clock goes on; the generators differ.
        assert_eq!(
            out(&mut child, "print(time.monotonic() >= t0)").await,
            "True\n"
        );
        let draw = "print(random.random())";
        let mut sibling = parent.fork(engine(), &options(template)).await?;
        assert_ne!(out(&mut child, draw).await, out(&mut sibling, draw).await);
        // A fork of a fork.
        let mut grandchild = child.fork(engine(), &options(template)).await?;
        assert_eq!(out(&mut grandchild, "print(xs)").await, "[1, 2, 3, 4]\n");
    }
    Ok(())
}

#[tokio::test]
async fn a_changed_warm_up_builds_a_new_image_and_a_bad_one_is_rebuilt() -> TestResult {
    let engine = engine();
    let a = engine.warm_image_path("x = 41")?;
    let b = engine.warm_image_path("x = 42")?;
    assert_ne!(a, b);
    assert_ne!(a, engine.warm_image_path(PYTHON_DATA_WARM_UP)?);
    let _ = std::fs::remove_file(&a);
    assert!(
        engine.prepare_warm("x = 41", &Quiet).await?,
        "built the first time"
    );
    assert!(
        !engine.prepare_warm("x = 41", &Quiet).await?,
        "cached the second time"
    );
    // Another process finds it on disk and does not build it again; a damaged file is.
    let other = WasmEngine::new(engine.cache().clone())?;
    assert!(!other.prepare_warm("x = 41", &Quiet).await?);
    std::fs::write(&a, b"KILNIMG1 damaged")?;
    let third = WasmEngine::new(engine.cache().clone())?;
    assert!(third.prepare_warm("x = 41", &Quiet).await?);
    std::fs::remove_file(&a)?;
    Ok(())
}

/// One-shots take instances made ahead of time (with an empty context): each must see its
/// own request's environment, folders and memory cap, never another's. (Those without an
/// environment of their own start primed, from the primed runtime's instances.)
#[tokio::test]
async fn instances_made_ahead_of_time_get_each_requests_own_grants_and_caps() -> TestResult {
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("mine.txt"), "mine")?;
    for round in 0..9 {
        let code = "import os\n\
                    print(os.environ.get('ROUND'), os.path.exists('/workspace/mine.txt'))\n\
                    try:\n    b = bytearray(200 << 20); print('big')\nexcept MemoryError:\n    print('capped')";
        let mut request = ExecRequest::new(Language::Python, code);
        let expected = match round % 3 {
            0 => {
                request.limits.memory_bytes = 128 << 20;
                request.env = vec![("ROUND".into(), round.to_string())];
                format!("{round} False\ncapped\n")
            }
            1 => {
                request.limits.memory_bytes = 128 << 20;
                "None False\ncapped\n".to_owned()
            }
            _ => {
                request.workspace = Some(dir.path().to_path_buf());
                "None True\nbig\n".to_owned()
            }
        };
        let result = engine().execute(&request).await?;
        assert_eq!(result.stdout_text(), expected, "{}", result.stderr_text());
    }
    Ok(())
}

/// Fresh guests start primed (from a module whose memory is an interpreter's after a first
/// turn, made once into the cache): each still has its own folders, its own `/tmp`, the
/// base environment, its own random numbers, and a clock past the priming run's that only
/// goes forward. A request with an environment of its own starts unprimed, and sees it.
#[tokio::test]
async fn primed_starts_are_each_guests_own() -> TestResult {
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("mine.txt"), "mine")?;
    let code = "import os, time, random\n\
                open('/tmp/left', 'w').write('x')\n\
                print(time.monotonic() >= 10, sorted(os.environ), os.getcwd(), os.listdir('.'), os.listdir('/tmp'), random.random())";
    let mut outs = Vec::new();
    for _ in 0..3 {
        let mut request = ExecRequest::new(Language::Python, code);
        request.workspace = Some(dir.path().to_path_buf());
        let result = engine().execute(&request).await?;
        assert!(result.success(), "{}", result.stderr_text());
        outs.push(result.stdout_text());
    }
    for out in &outs {
        assert!(
            out.starts_with(
                "True ['HOME', 'MPLBACKEND', 'PYTHONTZPATH', 'TMPDIR'] /workspace ['mine.txt'] ['left'] 0."
            ),
            "{out}"
        );
    }
    assert!(
        outs[0] != outs[1] && outs[1] != outs[2],
        "random numbers repeat: {outs:?}"
    );
    // Without a workspace, the working directory is the root, as in an unprimed guest.
    let result = engine()
        .execute(&ExecRequest::new(
            Language::Python,
            "import os; print(os.getcwd())",
        ))
        .await?;
    assert_eq!(result.stdout_text(), "/\n", "{}", result.stderr_text());

    let mut request = ExecRequest::new(
        Language::Python,
        "import os, time; print(time.monotonic() < 10, os.environ['GREETING'])",
    );
    request.env = vec![("GREETING".into(), "hello".into())];
    let result = engine().execute(&request).await?;
    assert_eq!(
        result.stdout_text(),
        "True hello\n",
        "{}",
        result.stderr_text()
    );

    // Sessions start primed too; their clock goes forward from turn to turn.
    let mut session = engine()
        .open_session(Language::Python, &options(None))
        .await?;
    assert_eq!(
        out(
            &mut session,
            "import time; t = time.monotonic(); print(t >= 10)"
        )
        .await,
        "True\n"
    );
    assert_eq!(
        out(&mut session, "print(time.monotonic() > t)").await,
        "True\n"
    );
    assert_eq!(value(&mut session, "x = 41\nx + 1").await, "42");
    Ok(())
}

/// The memory cap holds for warm starts and forks: an image larger than the cap is refused
/// with the cap it needs, and a fork's memory counts against the fork's own cap.
#[tokio::test]
async fn attack_a_warm_start_or_fork_above_its_memory_cap_is_refused() -> TestResult {
    let mut request = data("print(1)");
    request.limits.memory_bytes = 64 << 20;
    let error = engine().execute(&request).await.unwrap_err().to_string();
    assert!(
        error.contains("needs a memory limit of at least"),
        "{error}"
    );
    let mut parent = engine()
        .open_session(Language::Python, &options(Some(PYTHON_DATA)))
        .await?;
    out(&mut parent, "big = bytearray(300 << 20)").await;
    let mut small = options(Some(PYTHON_DATA));
    small.limits.memory_bytes = 256 << 20;
    let error = parent.fork(engine(), &small).await.unwrap_err().to_string();
    assert!(
        error.contains("needs a memory limit of at least"),
        "{error}"
    );
    // A JavaScript session cannot be forked, and says so.
    let mut js = engine()
        .open_session(Language::JavaScript, &SessionOptions::default())
        .await?;
    let error = js
        .fork(engine(), &SessionOptions::default())
        .await
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("only Python sessions can be forked"),
        "{error}"
    );
    Ok(())
}

/// An instance made ahead of time may wait longer than a run's default deadline (30 s)
/// before a one-shot takes it: the one-shot runs under its own deadline, armed when it takes
/// the instance, not under one left from when the instance was made.
#[tokio::test]
async fn an_instance_made_long_before_its_one_shot_runs_under_the_one_shots_deadline() -> TestResult
{
    let print = || ExecRequest::new(Language::Python, "print(1 + 1)");
    let first = engine().execute(&print()).await?;
    assert_eq!(first.stdout_text(), "2\n", "{}", first.stderr_text());
    let default_deadline = kiln_core::Limits::default().timeout();
    tokio::time::sleep(default_deadline + std::time::Duration::from_secs(2)).await;
    for request in [print(), data("print(1 + 1)")] {
        let result = engine().execute(&request).await?;
        assert_eq!(result.stdout_text(), "2\n", "{}", result.stderr_text());
        assert!(result.success(), "{}", result.stderr_text());
    }
    Ok(())
}

/// Issue 39: a plain Python one-shot (no template) whose code imports the data stack starts
/// from python-data's image, which shows as scipy already in `sys.modules` (pandas does not
/// import it); its globals are a fresh interpreter's. With fuel, or a memory cap the image
/// does not fit beside, it starts fresh as before; so does code that imports no such
/// package.
#[tokio::test]
async fn a_plain_python_one_shot_that_imports_pandas_starts_from_the_warm_image() -> TestResult {
    let engine = engine();
    engine
        .prepare_warm_oneshots(PYTHON_DATA_WARM_UP, &Quiet)
        .await?;
    let code = "import sys\nimport pandas as pd\n\
                print(pd.DataFrame({'a': [1, 2, 3]}).a.sum(), 'scipy' in sys.modules, \
                sorted(n for n in ('numpy', 'pandas', 'scipy', 'matplotlib') if n in globals()))";
    let plain = ExecRequest::new(Language::Python, code);
    let result = engine.execute(&plain).await?;
    assert!(result.success(), "{}", result.stderr_text());
    assert_eq!(
        result.stdout_text(),
        "6 True []\n",
        "started warm, no name bound"
    );

    // A warm start counts no fuel: a run with a budget starts fresh.
    let mut fueled = ExecRequest::new(Language::Python, code);
    fueled.limits.fuel = Some(50_000_000_000);
    let result = engine.execute(&fueled).await?;
    assert!(result.success(), "{}", result.stderr_text());
    assert_eq!(result.stdout_text(), "6 False []\n", "with fuel: fresh");

    // A cap the image does not fit beside: fresh (and pandas still imports in it).
    let image = std::fs::metadata(engine.warm_image_path(PYTHON_DATA_WARM_UP)?)?.len();
    let mut small = ExecRequest::new(Language::Python, code);
    small.limits.memory_bytes = image + (32 << 20);
    let result = engine.execute(&small).await?;
    assert_eq!(
        result.stdout_text(),
        "6 False []\n",
        "{}",
        result.stderr_text()
    );

    // Code that imports none of the stack starts fresh.
    let result = engine
        .execute(&ExecRequest::new(
            Language::Python,
            "import sys\nprint('pandas' in sys.modules)",
        ))
        .await?;
    assert_eq!(result.stdout_text(), "False\n");
    Ok(())
}
