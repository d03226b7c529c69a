//! The runtime without any face: sandboxes, executions, files, sessions and history driven
//! through `kiln_runtime`'s own API over a pool whose workers serve the fake backend in this
//! process. Failures come back as typed `RuntimeError`s, never HTTP shapes.

use std::collections::BTreeMap;
use std::sync::Arc;

use kiln_core::Language;
use kiln_core::template::{BackendKind, Catalogue, TemplateInfo};
use kiln_executor::ExecutorPool;
use kiln_runtime::auth::Caller;
use kiln_runtime::exec::{self, CodeExec};
use kiln_runtime::sandbox::SandboxSpec;
use kiln_runtime::{Pools, Runtime, RuntimeConfig, RuntimeError, files, revisions, sessions};
use serde_json::json;

struct Fixture {
    rt: Arc<Runtime>,
    _data: tempfile::TempDir,
}

fn runtime(quotas: Option<kiln_runtime::quota::Quotas>) -> Fixture {
    let data = tempfile::tempdir().expect("a temporary folder");
    let mut config = RuntimeConfig::new(
        data.path().to_path_buf(),
        Catalogue::new(vec![TemplateInfo::example_python()]),
    );
    if let Some(quotas) = quotas {
        config.quotas = quotas;
    }
    let pool = ExecutorPool::new(kiln_executor::fake::pool_config(1));
    Fixture {
        rt: Arc::new(
            Runtime::open(config, Pools::new(BackendKind::Wasm, pool)).expect("the runtime opens"),
        ),
        _data: data,
    }
}

fn tenant(name: &str) -> Caller {
    Caller {
        tenant: name.into(),
        ..Caller::local()
    }
}

fn code(text: &str) -> CodeExec {
    CodeExec {
        code: text.into(),
        ..CodeExec::default()
    }
}

#[tokio::test]
async fn a_sandbox_runs_code_keeps_files_and_records_history() {
    let Fixture { rt, _data } = runtime(None);
    let caller = tenant("a");
    let spec = SandboxSpec::resolve(rt.catalogue(), "python:3.12-slim", None, Some("256m"))
        .expect("python:3.12 resolves");
    assert_eq!(spec.template, "python");
    let id = exec::create_sandbox(&rt, &caller, spec)
        .await
        .expect("created")
        .id;

    let mut run = code("print hello");
    run.files = BTreeMap::from([("data/in.txt".to_owned(), b"42".to_vec())]);
    let prepared = exec::prepare(&rt, &caller, &id, run).expect("a valid run");
    let exec_id = prepared.exec_id.clone();
    assert!(exec_id.starts_with("python_run_"), "{exec_id}");
    let ran = exec::run(&rt, &caller, &id, prepared, None)
        .await
        .expect("it ran");
    assert_eq!(ran.result.stdout_text(), "hello\n");
    assert_eq!(ran.status(), "success");
    assert!(ran.commit_id.is_some(), "the uploaded file is a change");

    let bytes = files::read(&rt, &caller, &id, "data/in.txt".into(), 1024)
        .await
        .expect("the file is there");
    assert_eq!(bytes, b"42");
    let listing = files::list(&rt, &caller, &id, None)
        .await
        .expect("a listing");
    let paths: Vec<_> = listing.files.iter().map(|f| f.path.as_str()).collect();
    assert_eq!(paths, ["data", "data/in.txt"]);

    let (page, next) = revisions::page(&rt, &caller, &id, 10, None)
        .await
        .expect("a page");
    assert_eq!(page[0].id, exec_id);
    assert_eq!(next, None);
    let diff = revisions::diff(&rt, &caller, &id, "initial".into(), None)
        .await
        .expect("a diff");
    assert_eq!(diff.keys().collect::<Vec<_>>(), ["data/in.txt"]);
    let rolled = revisions::rollback(&rt, &caller, &id, "initial".into())
        .await
        .expect("rolled back");
    assert!(rolled.id.starts_with("rollback_"));
    let gone = files::read(&rt, &caller, &id, "data/in.txt".into(), 1024).await;
    assert!(
        matches!(
            gone,
            Err(RuntimeError::Workspace(
                kiln_workspace::TreeError::NotFound { .. }
            ))
        ),
        "{gone:?}"
    );

    rt.delete_sandbox(&caller, &id).await.expect("deleted");
    let after = exec::prepare(&rt, &caller, &id, code("print x"));
    assert!(
        matches!(after, Err(RuntimeError::SandboxNotFound { .. })),
        "{after:?}"
    );
}

#[tokio::test]
async fn refusals_are_typed_with_their_codes_and_details() {
    let Fixture { rt, _data } = runtime(None);
    let (owner, other) = (tenant("a"), tenant("b"));
    let unknown = SandboxSpec::resolve(rt.catalogue(), "python:2.7", None, None).unwrap_err();
    assert_eq!(unknown.code(), "UNKNOWN_IMAGE");
    assert_eq!(unknown.details()["image"], "python:2.7");
    assert_eq!(unknown.details()["templates"], json!(["python"]));
    let memory = SandboxSpec::resolve(rt.catalogue(), "python", None, Some("1k")).unwrap_err();
    assert_eq!(memory.code(), "INVALID_OPTION");

    let id = exec::create_default_sandbox(&rt, &owner, Language::Python)
        .await
        .expect("created")
        .id;
    // Another tenant's sandbox does not exist for it.
    let foreign = files::list(&rt, &other, &id, None).await.unwrap_err();
    assert_eq!(foreign.code(), "SANDBOX_NOT_FOUND");
    assert_eq!(foreign.details(), json!({ "containerId": id }));

    let mut bad_env = code("print x");
    bad_env.env = BTreeMap::from([("A=B".to_owned(), "1".to_owned())]);
    let refused = exec::prepare(&rt, &owner, &id, bad_env).unwrap_err();
    assert_eq!(refused.code(), "INVALID_ENV");
    let mut slow = code("print x");
    slow.timeout_ms = Some(exec::MAX_EXEC_MS + 1);
    assert_eq!(
        exec::prepare(&rt, &owner, &id, slow).unwrap_err().code(),
        "INVALID_OPTION"
    );
    let mut escape = code("print x");
    escape.files = BTreeMap::from([("../x".to_owned(), Vec::new())]);
    let escaped = exec::prepare(&rt, &owner, &id, escape).unwrap_err();
    assert_eq!(escaped.code(), "INVALID_PATH");

    files::write(&rt, &owner, &id, "big.txt".into(), vec![b'x'; 4096])
        .await
        .expect("written");
    let large = files::read(&rt, &owner, &id, "big.txt".into(), 100)
        .await
        .unwrap_err();
    assert_eq!(large.code(), "FILE_TOO_LARGE");
    assert_eq!(large.details()["size"], 4096);
    files::write(&rt, &owner, &id, "dir/a".into(), Vec::new())
        .await
        .expect("written");
    let folder = files::open(&rt, &owner, &id, "dir".into())
        .await
        .unwrap_err();
    assert!(
        matches!(folder, RuntimeError::IsAFolder { .. }),
        "{folder:?}"
    );
    let cursor = revisions::page(&rt, &owner, &id, 5, Some("nope".into()))
        .await
        .unwrap_err();
    assert_eq!(cursor.code(), "INVALID_CURSOR");
    let missing = revisions::rollback(&rt, &owner, &id, "python_run_nope".into())
        .await
        .unwrap_err();
    assert_eq!(missing.code(), "EXECUTION_NOT_FOUND");
    // The failed rollback left the sandbox idle.
    files::list(&rt, &owner, &id, None)
        .await
        .expect("idle again");
}

#[tokio::test]
async fn sessions_keep_state_and_their_quota_holds() {
    let quotas = kiln_runtime::quota::Quotas {
        sessions: 1,
        ..Default::default()
    };
    let Fixture { rt, _data } = runtime(Some(quotas));
    let caller = tenant("a");
    let id = exec::create_default_sandbox(&rt, &caller, Language::Python)
        .await
        .expect("created")
        .id;
    let session = sessions::create(&rt, &caller, &id, None)
        .await
        .expect("opened");
    assert_eq!(session.status, "ready");
    let mut set = code("set n 7");
    set.session = Some(session.session_id.clone());
    let spec = exec::prepare(&rt, &caller, &id, set).expect("a turn");
    exec::run(&rt, &caller, &id, spec, None).await.expect("ran");
    let mut get = code("get n");
    get.session = Some(session.session_id.clone());
    let spec = exec::prepare(&rt, &caller, &id, get).expect("a turn");
    let ran = exec::run(&rt, &caller, &id, spec, None).await.expect("ran");
    assert_eq!(ran.result.stdout_text(), "7\n");

    let over = sessions::create(&rt, &caller, &id, None).await.unwrap_err();
    assert_eq!(over.code(), "QUOTA_EXCEEDED");
    assert_eq!(over.details()["quota"], "sessions");

    sessions::close(&rt, &caller, &id, &session.session_id)
        .await
        .expect("closed");
    let closed = sessions::close(&rt, &caller, &id, &session.session_id)
        .await
        .unwrap_err();
    assert_eq!(closed.code(), "SESSION_NOT_FOUND");
    sessions::create(&rt, &caller, &id, None)
        .await
        .expect("room again after the close");
}

#[tokio::test]
async fn each_sandbox_runs_on_its_templates_backend_and_no_other() {
    let data = tempfile::tempdir().expect("a temporary folder");
    let mut native = TemplateInfo::example_python();
    native.id = "debian-python".into();
    native.backend = BackendKind::Native;
    native.images.names = vec!["debian-python".into()];
    native.images.repos = Vec::new();
    let config = RuntimeConfig::new(
        data.path().to_path_buf(),
        Catalogue::new(vec![TemplateInfo::example_python(), native]),
    );
    // Only the wasm backend has workers here.
    let pool = ExecutorPool::new(kiln_executor::fake::pool_config(1));
    let rt = Arc::new(Runtime::open(config, Pools::new(BackendKind::Wasm, pool)).expect("opens"));
    let caller = tenant("a");
    let spec = SandboxSpec::resolve(rt.catalogue(), "debian-python", None, None).expect("resolves");
    assert_eq!(spec.template, "debian-python");
    let id = exec::create_sandbox(&rt, &caller, spec)
        .await
        .expect("created")
        .id;
    let prepared = exec::prepare(&rt, &caller, &id, code("print x")).expect("a valid run");
    let refused = exec::run(&rt, &caller, &id, prepared, None)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), "UNSUPPORTED");
    assert_eq!(
        refused.to_string(),
        "no executor serves the native backend on this server"
    );
    let session = sessions::create(&rt, &caller, &id, None).await.unwrap_err();
    assert_eq!(session.code(), "UNSUPPORTED");
    // The refused run left the sandbox idle, and the wasm template still runs.
    files::list(&rt, &caller, &id, None).await.expect("idle");
    let python = exec::create_default_sandbox(&rt, &caller, Language::Python)
        .await
        .expect("created")
        .id;
    let prepared = exec::prepare(&rt, &caller, &python, code("print ok")).expect("a run");
    let ran = exec::run(&rt, &caller, &python, prepared, None)
        .await
        .expect("ran");
    assert_eq!(ran.result.stdout_text(), "ok\n");
}

/// Whether this machine can loop-mount volumes (root, e2fsprogs); `KILN_SKIP_LINUX=1` skips.
fn volumes_available() -> bool {
    if std::env::var_os("KILN_SKIP_LINUX").is_some() {
        // Loud, so a skipped test never passes for a run one (libtest names the thread after
        // the test; scripts/test and .ci/run refuse KILN_SKIP_LINUX).
        let test = std::thread::current().name().unwrap_or("?").to_owned();
        eprintln!("SKIPPED (KILN_SKIP_LINUX is set): {test}");
        return false;
    }
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    assert!(
        root,
        "volumes need root (loop mounts); run as root or set KILN_SKIP_LINUX=1"
    );
    true
}

#[tokio::test]
async fn a_linux_sandboxs_workspace_lives_on_a_capped_volume_that_outlives_a_restart() {
    if !volumes_available() {
        return;
    }
    let data = tempfile::tempdir().expect("a temporary folder");
    let mut linux = TemplateInfo::example_python();
    linux.id = "linux-python".into();
    linux.images.names = vec!["linux-python".into()];
    linux.images.repos = Vec::new();
    linux.resources = Some(kiln_core::template::Resources::default());
    let open = || {
        let config = RuntimeConfig::new(
            data.path().to_path_buf(),
            Catalogue::new(vec![TemplateInfo::example_python(), linux.clone()]),
        );
        let pool = ExecutorPool::new(kiln_executor::fake::pool_config(1));
        Arc::new(Runtime::open(config, Pools::new(BackendKind::Wasm, pool)).expect("opens"))
    };
    let rt = open();
    let caller = tenant("a");
    let asked = kiln_core::template::ResourceRequest {
        disk_mb: Some(16),
        pids: Some(64),
        ..Default::default()
    };
    let spec = SandboxSpec::resolve(rt.catalogue(), "linux-python", None, None)
        .and_then(|s| s.with_resources(Some(&asked), false))
        .expect("resolves");
    let resources = spec.resources.expect("a Linux template's resources");
    assert_eq!(
        (resources.disk_mb, resources.pids, resources.vcpus),
        (16, 64, 1.0)
    );
    let sandbox = exec::create_sandbox(&rt, &caller, spec)
        .await
        .expect("created");
    let volume = sandbox.volume_dir();
    assert!(
        kiln_runtime::volume::is_mounted(&volume),
        "the volume is mounted"
    );
    assert!(sandbox.workspace().starts_with(&volume));
    // The host's writes land on the volume and stop at its size with a clear error.
    let chunk = vec![7u8; 4 << 20];
    let mut written = 0;
    let full = loop {
        match files::write(
            &rt,
            &caller,
            &sandbox.id,
            format!("f{written}"),
            chunk.clone(),
        )
        .await
        {
            Ok(_) => written += 1,
            Err(e) => break e,
        }
        assert!(written < 8, "16 MiB took more than 8 files of 4 MiB");
    };
    assert!(written >= 1, "at least one 4 MiB file fits");
    assert_eq!(full.code(), "SANDBOX_DISK_FULL", "{full}");
    // The volume keeps the files across a restart (the runtime opens it again, mounted or not).
    drop(rt);
    kiln_runtime::volume::detach(&volume).expect("unmounted");
    assert!(!kiln_runtime::volume::is_mounted(&volume));
    let rt = open();
    assert!(
        kiln_runtime::volume::is_mounted(&volume),
        "mounted again at open"
    );
    let listed = files::list(&rt, &caller, &sandbox.id, None)
        .await
        .expect("listed");
    assert_eq!(listed.files.len(), written, "{listed:?}");
    // Deleting the sandbox unmounts its volume and removes its image.
    rt.delete_sandbox(&caller, &sandbox.id)
        .await
        .expect("deleted");
    assert!(!volume.exists() && !kiln_runtime::volume::image_of(&volume).exists());
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    assert!(!mounts.contains(&*volume.to_string_lossy()), "{mounts}");
    // A WebAssembly template has no box: CPU, disk and processes are refused, memory is not.
    let wasm = SandboxSpec::resolve(rt.catalogue(), "python", None, None).expect("resolves");
    let refused = wasm
        .clone()
        .with_resources(Some(&asked), false)
        .unwrap_err();
    assert_eq!(refused.code(), "UNSUPPORTED", "{refused}");
    let memory = kiln_core::template::ResourceRequest {
        memory_mb: Some(256),
        ..Default::default()
    };
    assert_eq!(
        wasm.clone()
            .with_resources(Some(&memory), false)
            .unwrap()
            .memory_bytes,
        256 << 20
    );
    let twice = wasm.with_resources(Some(&memory), true).unwrap_err();
    assert_eq!(twice.code(), "INVALID_OPTION", "{twice}");
}

/// A runtime whose `python` template forks sessions and whose `plain` one does not.
fn forking_runtime() -> Fixture {
    forking_runtime_with(2 << 30)
}

/// [`forking_runtime`] with a workspace quota of `workspace_bytes`.
fn forking_runtime_with(workspace_bytes: u64) -> Fixture {
    let data = tempfile::tempdir().expect("a temporary folder");
    let mut python = TemplateInfo::example_python();
    python.capabilities.fork = true;
    let mut plain = TemplateInfo::example_python();
    plain.id = "plain".into();
    plain.images.names = vec!["plain".into()];
    plain.images.repos = Vec::new();
    let mut config = RuntimeConfig::new(
        data.path().to_path_buf(),
        Catalogue::new(vec![python, plain]),
    );
    config.quotas.session_memory_bytes = 8 << 30;
    config.quotas.workspace_bytes = workspace_bytes;
    let pool = ExecutorPool::new(kiln_executor::fake::pool_config(1));
    Fixture {
        rt: Arc::new(Runtime::open(config, Pools::new(BackendKind::Wasm, pool)).expect("opens")),
        _data: data,
    }
}

/// Runs `text` as a turn of `session` in sandbox `id`; its stdout.
async fn turn(rt: &Arc<Runtime>, caller: &Caller, id: &str, session: &str, text: &str) -> String {
    let mut run = code(text);
    run.session = Some(session.to_owned());
    let spec = exec::prepare(rt, caller, id, run).expect("a turn");
    exec::run(rt, caller, id, spec, None)
        .await
        .expect("ran")
        .result
        .stdout_text()
}

#[tokio::test]
async fn a_forked_session_starts_with_its_parents_state_in_the_same_sandbox() {
    let Fixture { rt, _data } = forking_runtime();
    let caller = tenant("a");
    let id = exec::create_default_sandbox(&rt, &caller, Language::Python)
        .await
        .expect("created")
        .id;
    let parent = sessions::create(&rt, &caller, &id, None)
        .await
        .expect("opened")
        .session_id;
    turn(&rt, &caller, &id, &parent, "set x 41").await;
    let forked = sessions::fork(&rt, &caller, &id, &parent, false)
        .await
        .expect("forked");
    assert_eq!(forked.sandbox_id, id);
    assert_eq!(forked.forked_from, parent);
    assert_eq!(
        (forked.session.status.as_str(), forked.session.turns),
        ("ready", 0)
    );
    let child = forked.session.session_id;
    assert_ne!(child, parent);
    assert_eq!(turn(&rt, &caller, &id, &child, "get x").await, "41\n");
    turn(&rt, &caller, &id, &child, "set x 1").await;
    turn(&rt, &caller, &id, &parent, "set y 2").await;
    assert_eq!(turn(&rt, &caller, &id, &parent, "get x").await, "41\n");
    assert_eq!(turn(&rt, &caller, &id, &child, "get y").await, "\n");
    let view = rt.registry.get("a", &id).expect("the sandbox");
    assert_eq!(view.meta.sessions.len(), 2);
    assert_eq!(view.live_sessions.len(), 2);
}

#[tokio::test]
async fn a_fork_with_its_workspace_lives_in_a_sandbox_of_its_own() {
    let Fixture { rt, _data } = forking_runtime();
    let caller = tenant("a");
    let id = exec::create_default_sandbox(&rt, &caller, Language::Python)
        .await
        .expect("created")
        .id;
    let parent = sessions::create(&rt, &caller, &id, None)
        .await
        .expect("opened")
        .session_id;
    turn(&rt, &caller, &id, &parent, "set x 41").await;
    files::write(&rt, &caller, &id, "data/in.txt".into(), b"before".to_vec())
        .await
        .expect("written");
    let forked = sessions::fork(&rt, &caller, &id, &parent, true)
        .await
        .expect("forked");
    let child_box = forked.sandbox_id.clone();
    assert_ne!(child_box, id);
    let child = forked.session.session_id;
    assert_eq!(
        turn(&rt, &caller, &child_box, &child, "get x").await,
        "41\n"
    );
    let read = |sandbox: &str, path: &str| {
        let (rt, caller, sandbox, path) = (
            rt.clone(),
            caller.clone(),
            sandbox.to_owned(),
            path.to_owned(),
        );
        async move { files::read(&rt, &caller, &sandbox, path, 1024).await }
    };
    assert_eq!(
        read(&child_box, "data/in.txt").await.expect("copied"),
        b"before"
    );
    // The fork's history starts at the parent's head.
    let (parent_history, _) = revisions::page(&rt, &caller, &id, 100, None)
        .await
        .expect("a history");
    let (child_history, _) = revisions::page(&rt, &caller, &child_box, 100, None)
        .await
        .expect("a history");
    let commits = |entries: &[kiln_runtime::history::HistoryEntry]| {
        entries
            .iter()
            .map(|e| e.commit_id.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(commits(&child_history), commits(&parent_history));
    assert_eq!(child_history.len(), 2, "the initial commit and the upload");
    // From then on each sandbox's files are its own.
    files::write(&rt, &caller, &child_box, "child.txt".into(), b"c".to_vec())
        .await
        .expect("written");
    files::write(&rt, &caller, &id, "parent.txt".into(), b"p".to_vec())
        .await
        .expect("written");
    files::write(&rt, &caller, &id, "data/in.txt".into(), b"after".to_vec())
        .await
        .expect("written");
    assert_eq!(
        read(&id, "child.txt").await.unwrap_err().code(),
        "FILE_NOT_FOUND"
    );
    assert_eq!(
        read(&child_box, "parent.txt").await.unwrap_err().code(),
        "FILE_NOT_FOUND"
    );
    assert_eq!(
        read(&child_box, "data/in.txt").await.expect("kept"),
        b"before"
    );
    let view = rt
        .registry
        .get("a", &child_box)
        .expect("the fork's sandbox");
    assert_eq!(view.meta.template(), "python");
    assert_eq!(view.meta.sessions.len(), 1);
}

#[tokio::test]
async fn forks_are_refused_with_their_codes() {
    let Fixture { rt, _data } = forking_runtime();
    let caller = tenant("a");
    let id = exec::create_default_sandbox(&rt, &caller, Language::Python)
        .await
        .expect("created")
        .id;
    let parent = sessions::create(&rt, &caller, &id, None)
        .await
        .expect("opened")
        .session_id;
    let unknown = sessions::fork(&rt, &caller, "sb_nope", &parent, false)
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), "SANDBOX_NOT_FOUND");
    let unknown = sessions::fork(&rt, &caller, &id, "ses_nope", false)
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), "SESSION_NOT_FOUND");
    let foreign = sessions::fork(&rt, &tenant("b"), &id, &parent, true)
        .await
        .unwrap_err();
    assert_eq!(foreign.code(), "SANDBOX_NOT_FOUND");
    refused_while_busy_or_ended(&rt, &caller, &id, &parent).await;

    // A template that does not fork says so, and makes nothing.
    let spec = SandboxSpec::resolve(rt.catalogue(), "plain", None, None).expect("resolves");
    let plain = exec::create_sandbox(&rt, &caller, spec)
        .await
        .expect("created")
        .id;
    let session = sessions::create(&rt, &caller, &plain, None)
        .await
        .expect("opened")
        .session_id;
    let sandboxes = rt.registry.count();
    let refused = sessions::fork(&rt, &caller, &plain, &session, true)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), "UNSUPPORTED");
    assert!(
        refused
            .to_string()
            .contains("sessions of the plain template cannot be forked"),
        "{refused}"
    );
    let js = sessions::create(&rt, &caller, &id, Some(Language::JavaScript))
        .await
        .expect("opened")
        .session_id;
    let refused = sessions::fork(&rt, &caller, &id, &js, true)
        .await
        .unwrap_err();
    assert_eq!(
        refused.to_string(),
        "javascript sessions of the python template cannot be forked; its python sessions can"
    );
    assert_eq!(rt.registry.count(), sandboxes, "no sandbox was left behind");
    // Every refusal left the sandbox idle.
    files::list(&rt, &caller, &id, None).await.expect("idle");
}

/// A fork asked while a turn of `parent` runs is refused (never copied half-way); once the
/// turn is done it forks the state the turn left; a session that timed out cannot fork.
async fn refused_while_busy_or_ended(rt: &Arc<Runtime>, caller: &Caller, id: &str, parent: &str) {
    let mut slow = code("sleep 400\nset late 1");
    slow.session = Some(parent.to_owned());
    let spec = exec::prepare(rt, caller, id, slow).expect("a turn");
    let running = {
        let (rt, caller, id) = (rt.clone(), caller.clone(), id.to_owned());
        tokio::spawn(async move { exec::run(&rt, &caller, &id, spec, None).await })
    };
    while rt
        .registry
        .get(&caller.tenant, id)
        .expect("there")
        .running
        .is_none()
    {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let busy = sessions::fork(rt, caller, id, parent, false)
        .await
        .unwrap_err();
    assert_eq!(busy.code(), "SANDBOX_BUSY");
    running.await.expect("joined").expect("ran");
    let forked = sessions::fork(rt, caller, id, parent, false)
        .await
        .expect("forked once the turn is done");
    assert_eq!(
        turn(rt, caller, id, &forked.session.session_id, "get late").await,
        "1\n"
    );

    // A session whose turn ran past its deadline has ended: so has forking it.
    let mut spin = code("spin");
    spin.session = Some(parent.to_owned());
    spin.timeout_ms = Some(50);
    let spec = exec::prepare(rt, caller, id, spin).expect("a turn");
    exec::run(rt, caller, id, spec, None).await.expect("ran");
    let ended = sessions::fork(rt, caller, id, parent, true)
        .await
        .unwrap_err();
    assert_eq!(ended.code(), "SESSION_ENDED");
}

#[tokio::test]
async fn a_fork_with_its_workspace_counts_against_the_workspace_quota() {
    let Fixture { rt, _data } = forking_runtime_with(1000);
    let caller = tenant("a");
    let id = exec::create_default_sandbox(&rt, &caller, Language::Python)
        .await
        .expect("created")
        .id;
    let parent = sessions::create(&rt, &caller, &id, None)
        .await
        .expect("opened")
        .session_id;
    files::write(&rt, &caller, &id, "a.txt".into(), vec![b'x'; 600])
        .await
        .expect("written");
    let sandboxes = rt.registry.count();
    let over = sessions::fork(&rt, &caller, &id, &parent, true)
        .await
        .unwrap_err();
    assert_eq!(over.code(), "QUOTA_EXCEEDED");
    assert_eq!(over.details()["quota"], "workspaceBytes");
    assert_eq!(over.details()["inUse"], 600);
    assert_eq!(rt.registry.count(), sandboxes, "no sandbox was left behind");
    // Within the sandbox, a fork copies no files and fits.
    sessions::fork(&rt, &caller, &id, &parent, false)
        .await
        .expect("forked in place");
}

/// Issue 32: a volume mounted with `discard` gives the blocks of a deleted file back to the
/// host (its sparse image shrinks again), instead of keeping them for good.
#[test]
fn a_volume_gives_the_blocks_of_deleted_files_back_to_the_host() {
    use std::io::Write;
    use std::os::unix::fs::MetadataExt;
    if !volumes_available() {
        return;
    }
    let data = tempfile::tempdir().expect("a temporary folder");
    let mount_point = data.path().join("sandboxes").join("v").join("volume");
    std::fs::create_dir_all(mount_point.parent().expect("a parent")).expect("made");
    kiln_runtime::volume::attach(&mount_point, 256 << 20).expect("attached");
    let image = kiln_runtime::volume::image_of(&mount_point);
    let held = || std::fs::metadata(&image).expect("the image").blocks() * 512;
    // SAFETY: sync(2) takes no arguments and cannot fail.
    let sync = || unsafe { libc::sync() };
    sync();
    let empty = held();
    let file = mount_point.join("workspace").join("big");
    {
        let mut out = std::fs::File::create(&file).expect("created");
        let chunk = vec![0x5au8; 1 << 20];
        for _ in 0..64 {
            out.write_all(&chunk).expect("written");
        }
        out.sync_all().expect("synced");
    }
    sync();
    let full = held();
    assert!(
        full >= empty + (60 << 20),
        "64 MiB written: the image holds {full} bytes (empty: {empty})"
    );
    std::fs::remove_file(&file).expect("removed");
    // The freed blocks are discarded when the journal commits; sync makes it commit.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        sync();
        let now = held();
        if now <= empty + (4 << 20) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the deleted file's blocks stayed in the image: {now} bytes held (empty: {empty}, full: {full})"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    kiln_runtime::volume::detach(&mount_point).expect("detached");
}
