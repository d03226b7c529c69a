//! Live boxes, for real: a template built with debootstrap (cached in kiln's cache folder),
//! boxes started by runc with the static agent as PID 1, commands through the agent, and
//! attacks that must leave the host unharmed.
//!
//! These need root, runc, debootstrap and the static agent (`scripts/build-guest`);
//! `scripts/test` provides them. Where they are missing the tests fail, saying what is
//! missing, unless KILN_SKIP_LINUX=1 says to skip them.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use kiln_native::boxes::{BoxSpec, Boxes, BoxesConfig, Exec, ExecOutput, LiveBox};
use kiln_native::builder::{Progress, Store, Template};
use kiln_native::jail::BoxLimits;

struct Stderr;

impl Progress for Stderr {
    fn step(&self, index: usize, total: usize, name: &str) {
        eprintln!("[{index}/{total}] {name}");
    }
    fn line(&self, _: &str) {}
}

fn skip() -> bool {
    let skip = std::env::var("KILN_SKIP_LINUX").is_ok_and(|v| v == "1");
    if skip {
        // Loud, so a skipped test never passes for a run one (libtest names the thread after
        // the test; scripts/test and .ci/run refuse KILN_SKIP_LINUX).
        let test = std::thread::current().name().unwrap_or("?").to_owned();
        eprintln!("SKIPPED (KILN_SKIP_LINUX=1): {test}");
    }
    skip
}

fn cache() -> PathBuf {
    std::env::var_os("KILN_CACHE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/kiln"))
}

fn store() -> Store {
    Store {
        root: cache().join("templates"),
        mirror: Store::host_mirror(),
        uid_base: 100_000,
    }
}

/// The python template, built once (or found in the cache).
fn python() -> &'static Template {
    static TEMPLATE: OnceLock<Template> = OnceLock::new();
    TEMPLATE.get_or_init(|| {
        let definition = kiln_native::template::load(None)
            .unwrap()
            .into_iter()
            .find(|d| d.name == "python")
            .unwrap();
        let (boxes, allow) = (boxes(), allowlist());
        store()
            .ensure(&definition, jail(&boxes, &allow), &Stderr)
            .unwrap()
    })
}

fn allowlist() -> kiln_native::proxy::Allowlist {
    kiln_native::proxy::Allowlist::new(&kiln_native::proxy::DEFAULT_NAMES).unwrap()
}

fn jail<'a>(
    boxes: &'a Boxes,
    allow: &'a kiln_native::proxy::Allowlist,
) -> kiln_native::builder::Jail<'a> {
    kiln_native::builder::Jail { boxes, allow }
}

fn boxes() -> Boxes {
    boxes_with("runc", false, Some(cache().join("tools/criu/criu")))
}

/// Boxes of `runtime` (`runc` or `runsc`), or microVMs under QEMU where `vm`, in a state
/// folder of their own (a new `Boxes` removes the boxes it finds in its folder).
fn boxes_with(runtime: &str, vm: bool, criu: Option<PathBuf>) -> Boxes {
    let agent = kiln_native::find_agent()
        .or_else(|| {
            let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../target/guest/release/kiln-guest");
            kiln_native::is_static(&path).then_some(path)
        })
        .expect("the static guest agent is not built: run scripts/build-guest");
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let state = std::env::temp_dir().join(format!(
        "kiln-boxes-test-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let vm = vm.then(|| {
        std::sync::Arc::new(
            kiln_native::vm::VmTier::new(&cache(), &agent, &state, "qemu")
                .expect("QEMU and scripts/build-vm's kernel"),
        )
    });
    Boxes::new(BoxesConfig {
        state_dir: state,
        agent,
        runtime: runtime.into(),
        alternate: None,
        uid_base: 100_000,
        criu,
        vm,
        gvisor: false,
    })
    .unwrap()
}

fn limits() -> BoxLimits {
    BoxLimits {
        memory_bytes: 256 << 20,
        vcpus: 1.0,
        pids: 64,
        disk_bytes: 64 << 20,
        weight: 100,
    }
}

async fn open(boxes: &Boxes, workspace: Option<PathBuf>) -> LiveBox {
    boxes
        .open(BoxSpec {
            workspace,
            ..BoxSpec::new(python().clone(), limits())
        })
        .await
        .unwrap()
}

async fn sh(live: &LiveBox, script: &str) -> ExecOutput {
    let mut exec = Exec::new(vec!["/bin/sh".into(), "-c".into(), script.into()]);
    exec.timeout = Duration::from_secs(20);
    live.exec(exec, |_, _| {}).await.unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_box_runs_python_as_its_user_in_its_workspace() {
    if skip() {
        return;
    }
    let boxes = boxes();
    let workspace = tempfile::tempdir().unwrap();
    let live = open(&boxes, Some(workspace.path().to_path_buf())).await;
    let out = sh(&live, "echo hi").await;
    assert_eq!(
        (text(&out.stdout).as_str(), out.exit_code),
        ("hi\n", Some(0))
    );

    let out = sh(
        &live,
        "python3 -c 'import os,sys; print(sys.version_info[:2], os.getuid(), os.getcwd())' \
         && echo made > note.txt && id -un && exit 7",
    )
    .await;
    assert_eq!(
        text(&out.stdout),
        "(3, 11) 1000 /workspace\nuser\n",
        "{out:?}"
    );
    assert_eq!(out.exit_code, Some(7));
    // The file is in the host's workspace folder.
    assert_eq!(
        std::fs::read_to_string(workspace.path().join("note.txt")).unwrap(),
        "made\n"
    );

    // stdin reaches the command; stderr is kept apart.
    let mut exec = Exec::new(vec![
        "python3".into(),
        "-c".into(),
        "import sys; d=sys.stdin.read(); print(d.upper()); print('e', file=sys.stderr)".into(),
    ]);
    exec.stdin = b"piped in".to_vec();
    let out = live.exec(exec, |_, _| {}).await.unwrap();
    assert_eq!(
        (text(&out.stdout), text(&out.stderr)),
        ("PIPED IN\n".into(), "e\n".into())
    );

    // A timeout kills the command.
    let mut exec = Exec::new(vec!["sleep".into(), "30".into()]);
    exec.timeout = Duration::from_millis(300);
    let out = live.exec(exec, |_, _| {}).await.unwrap();
    assert!(
        out.timed_out && out.signal == Some(libc::SIGKILL),
        "{out:?}"
    );

    live.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_jail_holds_privileges_namespaces_and_syscalls() {
    if skip() {
        return;
    }
    let boxes = boxes();
    let live = open(&boxes, None).await;
    let out = sh(
        &live,
        "grep -E '^(CapEff|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status; cat /proc/self/uid_map; \
         hostname; ls /sys/class/net",
    )
    .await;
    let got = text(&out.stdout);
    for needle in [
        "CapEff:\t0000000000000000",
        "CapBnd:\t0000000000000000",
        "NoNewPrivs:\t1",
        "Seccomp:\t2",
        "100000",
        "kiln\n",
        "lo\n",
    ] {
        assert!(got.contains(needle), "{needle:?} not in {got}");
    }
    assert!(!got.contains("eth"), "{got}");

    // Refused, to the user and to the box's (namespaced) root alike: mount, new user
    // namespaces, ptrace, device nodes, writes to /proc/sys and /sys, packet and raw
    // sockets, setuid to root, the host's shadow file.
    for root in [false, true] {
        for (script, why) in [
            (&syscall("mount(b'x', b'/tmp', b'tmpfs', 0, None)"), "mount"),
            (&syscall("unshare(0x10000000)"), "userns"),
            (&syscall("unshare(0x00020000)"), "mount ns"),
            (&"mknod /tmp/null c 1 3".to_string(), "mknod"),
            (&"echo 1 > /proc/sys/kernel/panic".to_string(), "proc/sys"),
            (&"echo x > /sys/kernel/uevent_helper".to_string(), "sys"),
            (
                &"python3 -c 'import socket; socket.socket(socket.AF_PACKET, socket.SOCK_RAW)'"
                    .to_string(),
                "packet",
            ),
            (
                &"python3 -c 'import socket; socket.socket(socket.AF_INET, socket.SOCK_RAW, 1)'"
                    .to_string(),
                "raw",
            ),
            (&syscall("ptrace(16, 1, 0, 0)"), "ptrace"),
        ] {
            let mut exec = Exec::new(vec!["/bin/sh".into(), "-c".into(), script.to_string()]);
            exec.root = root;
            let out = live.exec(exec, |_, _| {}).await.unwrap();
            assert_ne!(
                out.exit_code,
                Some(0),
                "{why} (root: {root}): {script} succeeded: {out:?}"
            );
            let said = text(&out.stderr).to_lowercase();
            assert!(
                [
                    "not permitted",
                    "permission denied",
                    "read-only",
                    "must be superuser"
                ]
                .iter()
                .any(|n| said.contains(n)),
                "{why} (root: {root}): {script} failed for another reason: {said}"
            );
        }
    }
    for script in [
        "python3 -c 'import os; os.setuid(0)'",
        "cat /etc/shadow",
        "su -c id root < /dev/null",
    ] {
        let out = sh(&live, script).await;
        assert_ne!(out.exit_code, Some(0), "{script} succeeded: {out:?}");
    }
    // No network: no route, no name resolution.
    let out = sh(
        &live,
        "curl -sS -m 3 http://1.1.1.1/ || curl -sS -m 3 http://deb.debian.org/",
    )
    .await;
    assert_ne!(out.exit_code, Some(0), "{out:?}");
    live.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_hold_fork_bomb_memory_bomb_and_disk_fill() {
    if skip() {
        return;
    }
    let boxes = boxes();
    let live = open(&boxes, None).await;

    // Fork bomb: the pids limit stops it (the host can still start processes), the
    // command's timeout kills its whole process group, and the box answers again.
    let mut exec = Exec::new(vec![
        "bash".into(),
        "-c".into(),
        "f(){ f|f & }; f; sleep 10".into(),
    ]);
    exec.timeout = Duration::from_secs(3);
    let out = live.exec(exec, |_, _| {}).await.unwrap();
    assert!(out.timed_out, "{out:?}");
    assert!(
        std::process::Command::new("true")
            .status()
            .unwrap()
            .success()
    );
    let out = sh(&live, "echo alive").await;
    assert_eq!(text(&out.stdout), "alive\n", "{out:?}");

    // Memory bomb: only the allocating process dies, reported as out of memory.
    let out = sh(
        &live,
        "python3 -c 'x = bytearray(400 << 20); print(len(x))'",
    )
    .await;
    assert!(out.oom_killed || out.exit_code != Some(0), "{out:?}");
    let mut exec = Exec::new(vec![
        "python3".into(),
        "-c".into(),
        "x = bytearray(400 << 20)".into(),
    ]);
    exec.timeout = Duration::from_secs(20);
    let out = live.exec(exec, |_, _| {}).await.unwrap();
    assert!(out.oom_killed, "{out:?}");
    assert_eq!(text(&sh(&live, "echo still").await.stdout), "still\n");

    // Disk fill: ENOSPC inside, the host's free space unchanged.
    let before = free_bytes("/");
    let out = sh(
        &live,
        "dd if=/dev/zero of=/home/user/fill bs=1M count=200 2>&1; echo rc=$?",
    )
    .await;
    let got = text(&out.stdout);
    assert!(got.contains("No space left on device"), "{got}");
    let after = free_bytes("/");
    // Lost space is what a box's fill would cost; other tests freeing theirs meanwhile
    // only adds to it.
    assert!(
        before.saturating_sub(after) < 32 << 20,
        "the host lost free space: {before} → {after}"
    );

    live.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cpu_spin_is_held_to_its_quota_while_another_box_answers() {
    if skip() {
        return;
    }
    let boxes = boxes();
    let spinner = boxes
        .open(BoxSpec::new(
            python().clone(),
            BoxLimits {
                vcpus: 0.25,
                ..limits()
            },
        ))
        .await
        .unwrap();
    let other = open(&boxes, None).await;
    // Two spinning processes: without the quota they would take both cores.
    let mut spin = Exec::new(vec![
        "sh".into(),
        "-c".into(),
        "python3 -c 'while True: pass' & python3 -c 'while True: pass' & wait".into(),
    ]);
    spin.timeout = Duration::from_secs(4);
    let spinning = spinner.exec(spin, |_, _| {});
    let measure = async {
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let (used, wall) = (spinner.cpu_usage_us(), std::time::Instant::now());
        // Meanwhile the other box runs commands.
        for _ in 0..5 {
            assert_eq!(text(&sh(&other, "echo fine").await.stdout), "fine\n");
        }
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let used = spinner.cpu_usage_us() - used;
        (used as f64 / wall.elapsed().as_micros() as f64, used)
    };
    let (out, (share, used)) = tokio::join!(spinning, measure);
    assert!(out.unwrap().timed_out);
    // A quarter of a CPU, with room for the scheduler's periods: never the two cores.
    assert!(used > 0, "no CPU use was read from the box's cgroup");
    assert!(
        share < 0.4,
        "the spinning box used {share:.2} CPUs against a quota of 0.25"
    );
    spinner.close().await;
    other.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_a_box_leaves_nothing_behind_and_boxes_do_not_see_each_other() {
    if skip() {
        return;
    }
    let boxes = boxes();
    let a = open(&boxes, None).await;
    let b = open(&boxes, None).await;
    sh(&a, "echo secret > /home/user/a.txt; sleep 100 &").await;
    let out = sh(&b, "ls /home/user; ps -e -o comm=").await;
    let got = text(&out.stdout);
    assert!(!got.contains("a.txt") && !got.contains("sleep"), "{got}");
    // /proc/*/root leads only into the box itself.
    let out = sh(
        &b,
        "ls /proc/1/root/home/user; ls /proc/*/root/ 2>/dev/null | grep -c kiln-boxes-test || true",
    )
    .await;
    assert!(!text(&out.stdout).contains("a.txt"), "{out:?}");

    let (pid, id, cgroup) = (a.host_pid, a.id.clone(), a.cgroup_dir());
    assert!(std::path::Path::new(&format!("/proc/{pid}")).exists());
    assert!(cgroup.exists(), "{}", cgroup.display());
    a.close().await;
    // A box dropped without close (a panic, an early return) is removed all the same.
    let b_cgroup = b.cgroup_dir();
    drop(b);
    for gone in [&cgroup, &b_cgroup] {
        assert!(
            !gone.exists(),
            "a cgroup outlived its box: {}",
            gone.display()
        );
    }
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "the agent outlived close"
    );
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(&id), "a mount of {id} is left: {mounts}");
    let leftover = std::process::Command::new("pgrep")
        .args(["-f", "sleep 100"])
        .output()
        .unwrap();
    assert!(leftover.stdout.is_empty(), "a box process outlived close");
}

/// A shell command calling libc's `call` through Python's ctypes; it fails with the errno's
/// text when the call fails.
fn syscall(call: &str) -> String {
    format!(
        "python3 -c \"import ctypes,os,sys; l=ctypes.CDLL(None, use_errno=True); \
         sys.exit(os.strerror(ctypes.get_errno()) if l.{call} != 0 else 0)\""
    )
}

#[test]
fn a_failed_build_says_which_step_failed_and_leaves_nothing() {
    if skip() {
        return;
    }
    let definition = kiln_native::template::Definition::parse(
        "name: broken\nbase: debian:bookworm\npost_install: |\n  echo about to fail\n  exit 3\n",
        "test",
    )
    .unwrap();
    let store = store();
    let (boxes, allow) = (boxes(), allowlist());
    let err = store
        .build(&definition, jail(&boxes, &allow), &Stderr)
        .unwrap_err();
    assert_eq!(err.step, "post-install", "{err}");
    assert!(err.to_string().contains("about to fail"), "{err}");
    assert!(store.find(&definition).is_none());
    let left: Vec<_> = std::fs::read_dir(&store.root)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("broken"))
        .collect();
    assert!(left.is_empty(), "a failed build left {left:?}");
}

/// A template author gets a box's jail, not the host's root: `apt-get` and `post_install` run
/// as the box's root (uids shifted, host uid 100 000), in the box's pid namespace, with
/// the boxes' capabilities and seccomp filter, and a network that reaches the mirror
/// only through kiln's proxy. A tree the script leaves behind is not walked by the host
/// with plain paths: a link it plants where cleaning happens leads nowhere on the host.
#[test]
fn a_template_build_runs_its_scripts_in_the_jail() {
    if skip() {
        return;
    }
    use std::os::unix::fs::MetadataExt;
    let victim = std::env::temp_dir().join(format!("kiln-build-victim-{}", std::process::id()));
    std::fs::create_dir_all(&victim).unwrap();
    std::fs::write(victim.join("keep"), "the host's").unwrap();
    let definition = kiln_native::template::Definition::parse(
        &format!(
            r#"name: jailprobe
base: debian:bookworm
packages: [hello]
versions: [hello]
post_install: |
  exec > /probe.txt 2>&1
  echo "uid_map $(cat /proc/self/uid_map | tr -s ' ' | sed 's/^ //')"
  echo "pid1 $(cat /proc/1/comm)"
  (exec 3<>/dev/tcp/1.1.1.1/80) 2>/dev/null && echo "direct reached" || echo "direct refused"
  unshare --user true 2>/dev/null && echo "userns made" || echo "userns refused"
  mount -t tmpfs none /mnt 2>/dev/null && echo "mount made" || echo "mount refused"
  hello
  echo "whoami $(id -u)"
  # Where the host's old cleaning followed links: /var/log becomes one to a host folder.
  rm -rf /var/log && ln -s {victim} /var/log
  exit 0
"#,
            victim = victim.display()
        ),
        "test",
    )
    .unwrap();
    let store = store();
    let (boxes, allow) = (boxes(), allowlist());
    let built = store.build(&definition, jail(&boxes, &allow), &Stderr);
    let template = built.unwrap();
    let probe = std::fs::read_to_string(template.rootfs.join("probe.txt")).unwrap();
    let meta = std::fs::metadata(template.rootfs.join("probe.txt")).unwrap();
    let home = std::fs::metadata(template.rootfs.join("home/user")).unwrap();
    let folder = template.rootfs.parent().unwrap().to_path_buf();
    let kept = std::fs::read_to_string(victim.join("keep"));
    let _ = std::fs::remove_dir_all(&folder);
    let _ = std::fs::remove_dir_all(&victim);
    for line in [
        "uid_map 0 100000 65536",
        "pid1 agent",
        "direct refused",
        "userns refused",
        "mount refused",
        "Hello, world!",
        "whoami 0",
    ] {
        assert!(probe.lines().any(|l| l == line), "no {line:?} in:\n{probe}");
    }
    assert!(
        template.built.versions.contains_key("hello"),
        "{:?}",
        template.built.versions
    );
    assert_eq!((meta.uid(), meta.gid()), (100_000, 100_000));
    assert_eq!(home.uid(), 100_000 + kiln_native::template::USER_UID);
    assert_eq!(kept.ok().as_deref(), Some("the host's"));
}

fn free_bytes(path: &str) -> u64 {
    let c = std::ffi::CString::new(path).unwrap();
    // SAFETY: statvfs is a C struct of integers, for which all-zero bytes are a valid value.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated CString alive for the call, which only reads it, and `stat`
    // is a valid, writable statvfs that it fills.
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut stat) }, 0);
    stat.f_bavail as u64 * stat.f_frsize as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_allowlist_lets_pip_reach_the_index_and_nothing_else() {
    if skip() {
        return;
    }
    let boxes = boxes();
    // `localhost` is listed: a listed name must still never lead to the host.
    let mut names = kiln_native::proxy::DEFAULT_NAMES.to_vec();
    names.push("localhost");
    let allow = kiln_native::proxy::Allowlist::new(&names).unwrap();
    let live = boxes
        .open(BoxSpec {
            network: Some(kiln_native::proxy::LiveEgress::operator_only(
                std::sync::Arc::new(allow),
            )),
            // This host reaches the indexes through a TLS-inspecting proxy whose CA only
            // the host's bundle has: the one kiln finds by default.
            ca_bundle: kiln_native::boxes::host_ca_bundle(),
            ..BoxSpec::new(
                python().clone(),
                BoxLimits {
                    disk_bytes: 256 << 20,
                    ..limits()
                },
            )
        })
        .await
        .unwrap();
    let mut exec = Exec::new(vec![
        "python3".into(),
        "-m".into(),
        "pip".into(),
        "install".into(),
        "--user".into(),
        "--no-cache-dir".into(),
        "--index-url".into(),
        "https://pypi.org/simple".into(),
        "six==1.16.0".into(),
    ]);
    exec.timeout = Duration::from_secs(120);
    let out = live.exec(exec, |_, _| {}).await.unwrap();
    assert_eq!(
        out.exit_code,
        Some(0),
        "pip install failed: {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    let out = sh(&live, "python3 -c 'import six; print(six.__version__)'").await;
    assert_eq!(text(&out.stdout), "1.16.0\n", "{out:?}");

    // A name not on the list: refused by the proxy, with the reason.
    let out = sh(
        &live,
        "curl -sS https://example.com/ 2>&1; curl -sS -x '' http://example.com/ 2>&1",
    )
    .await;
    let got = text(&out.stdout);
    assert!(got.contains("403"), "{got}");
    // Around the proxy: no route, no DNS.
    let out = sh(
        &live,
        "curl -sS -m 5 --noproxy '*' https://pypi.org/ 2>&1; echo rc=$?",
    )
    .await;
    assert!(!text(&out.stdout).contains("rc=0"), "{out:?}");
    // The proxy never leads to the host itself, though the name is listed: asked through
    // the proxy (no_proxy would send 127.0.0.1 and localhost around it), on a listed port,
    // it answers 403 with the reason; around the proxy the box's own loopback has nothing.
    // Each command's own result is checked.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let proxied = |url: &str| {
        format!(
            "curl -sS -m 5 -x http://127.0.0.1:3128 --noproxy '' -w '\\nstatus=%{{http_code}}\\n' {url} 2>&1; echo rc=$?"
        )
    };
    let out = sh(&live, &proxied("http://localhost/")).await;
    let got = text(&out.stdout);
    assert!(
        got.contains("status=403") && got.contains("may not reach") && got.contains("loopback"),
        "{got}"
    );
    let out = sh(&live, &proxied(&format!("http://127.0.0.1:{port}/"))).await;
    let got = text(&out.stdout);
    assert!(got.contains("status=403"), "{got}");
    let out = sh(
        &live,
        &format!("curl -sS -m 5 --noproxy '*' http://127.0.0.1:{port}/ 2>&1; echo rc=$?"),
    )
    .await;
    let got = text(&out.stdout);
    assert!(
        got.contains("rc=7"),
        "connection refused inside the box: {got}"
    );
    assert_eq!(
        listener.accept().map(drop).map_err(|e| e.kind()),
        Err(std::io::ErrorKind::WouldBlock),
        "the host's listener was reached"
    );
    live.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn io_uring_is_refused_in_a_box_with_eperm() {
    if skip() {
        return;
    }
    // On this host io_uring works (unless the host turned it off for everyone), so the
    // refusal below is the box's filter.
    let disabled = std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
        .map(|v| v.trim() != "0")
        .unwrap_or(false);
    if !disabled {
        let mut params = [0u8; 120];
        // SAFETY: io_uring_setup(1, params) reads and writes the 120-byte io_uring_params
        // struct `params` (a live local) and answers a new fd or -1.
        let fd = unsafe { libc::syscall(libc::SYS_io_uring_setup, 1, params.as_mut_ptr()) };
        assert!(fd >= 0, "io_uring_setup failed on the host");
        // SAFETY: `fd` is the new io_uring fd, ours to close.
        unsafe { libc::close(fd as i32) };
    }
    let boxes = boxes();
    let live = open(&boxes, None).await;
    // setup(entries, params), enter(fd, to_submit, min_complete, flags, sig, sigsz),
    // register(fd, opcode, arg, nr_args): each -1 with EPERM, and the process lives on.
    let script = "import ctypes; l = ctypes.CDLL(None, use_errno=True); p = ctypes.create_string_buffer(120)\n\
                  for call in [(425, 1, p), (426, 0, 0, 0, 0, None, 0), (427, 0, 0, None, 0)]:\n\
                  \x20   ctypes.set_errno(0); r = l.syscall(*call); print(r, ctypes.get_errno())\n\
                  print('alive')";
    for root in [false, true] {
        let mut exec = Exec::new(vec!["python3".into(), "-c".into(), script.into()]);
        exec.root = root;
        let out = live.exec(exec, |_, _| {}).await.unwrap();
        let eperm = libc::EPERM;
        assert_eq!(
            (text(&out.stdout), out.exit_code),
            (
                format!("-1 {eperm}\n-1 {eperm}\n-1 {eperm}\nalive\n"),
                Some(0)
            ),
            "root: {root}: {out:?}"
        );
    }
    live.close().await;
}

/// Fills `live` to its pids limit from outside any command's process group: a process that
/// leaves its session and starts threads until none more fit, then keeps taking any room
/// that frees.
async fn fill(live: &LiveBox) {
    let filler = "import os, threading, time\n\
                  if os.fork(): os._exit(0)\n\
                  os.setsid(); threading.stack_size(1 << 18)\n\
                  while True:\n\
                  \x20   try: threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n\
                  \x20   except RuntimeError: time.sleep(0.005)";
    let out = sh(
        live,
        &format!("python3 -c '{filler}' </dev/null >/dev/null 2>&1; echo filled"),
    )
    .await;
    assert_eq!(text(&out.stdout), "filled\n", "{out:?}");
    tokio::time::sleep(Duration::from_millis(500)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_box_full_of_processes_says_what_to_do_and_can_be_emptied() {
    if skip() {
        return;
    }
    let boxes = boxes();
    let live = open(&boxes, None).await;
    // A shell started before the box fills (as a terminal or session would be).
    let mut exec = Exec::new(vec!["bash".into()]);
    exec.timeout = Duration::from_secs(60);
    let mut shell = live.spawn(&exec).await.unwrap();
    fill(&live).await;

    let refused = live
        .exec(Exec::new(vec!["true".into()]), |_, _| {})
        .await
        .unwrap_err()
        .to_string();
    for said in [
        "the box is full",
        "pids limit of 64",
        "kill -9 -1",
        "delete the sandbox",
    ] {
        assert!(refused.contains(said), "{said:?} not in {refused}");
    }

    // The way out the message names: `kill -9 -1` from the shell already running (a
    // builtin: it needs no new process) ends every other process of the box's user.
    live.write_stdin(shell.id, b"kill -9 -1; echo cleared\n".to_vec())
        .await
        .unwrap();
    let mut said = Vec::new();
    while !text(&said).contains("cleared") {
        match tokio::time::timeout(Duration::from_secs(10), shell.next()).await {
            Ok(Some(kiln_guest::proto::Reply::Output { data, .. })) => said.extend(data),
            other => panic!("the shell did not answer: {other:?} {}", text(&said)),
        }
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(text(&sh(&live, "echo alive").await.stdout), "alive\n");

    // The host's way out: every process but the agent killed from outside.
    fill(&live).await;
    assert!(
        live.exec(Exec::new(vec!["true".into()]), |_, _| {})
            .await
            .is_err(),
        "the box filled again"
    );
    let killed = live.kill_all_but_agent().await;
    assert!(killed >= 1, "{killed}");
    assert_eq!(
        text(&sh(&live, "echo alive again").await.stdout),
        "alive again\n"
    );
    live.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_allowlist_a_box_has_no_network_at_all() {
    if skip() {
        return;
    }
    let boxes = boxes();
    let live = open(&boxes, None).await;
    let out = sh(&live, "python3 -m pip download --no-deps -d /tmp six 2>&1 | tail -2; getent hosts pypi.org; echo rc=$?").await;
    let got = text(&out.stdout);
    assert!(got.contains("rc=2") || got.contains("rc=1"), "{got}");
    assert!(!got.contains("Saved"), "{got}");
    live.close().await;
}

/// Issue 34: what a runc box refuses and holds, a gVisor box and a microVM hold too: to the
/// box's user, mount, new namespaces, device nodes, writes to /proc/sys and /sys, packet
/// and raw sockets, ptrace of its agent, setuid to root; no network and no host loopback;
/// a fork bomb, a memory bomb, a disk fill and a CPU spin end in the box, which answers
/// after (a gVisor box may end with a fork bomb instead: the pids limit counts the
/// sentry's threads, and that is said); orphans are reaped. A VM's root is the VM's own
/// (the VM is the boundary), so what is refused is asked of its user.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_refusals_and_limits_hold_under_gvisor_and_in_a_microvm() {
    if skip() {
        return;
    }
    // A host server the boxes must not reach over "their" loopback.
    let host = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = host.local_addr().unwrap().port();
    for (name, runtime, vm) in [("gvisor", "runsc", false), ("vm", "runc", true)] {
        let boxes = boxes_with(runtime, vm, None);
        let template = Template {
            vm,
            ..python().clone()
        };
        let live = boxes
            .open(BoxSpec::new(template, limits()))
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        for (script, why) in [
            (syscall("mount(b'x', b'/tmp', b'tmpfs', 0, None)"), "mount"),
            // Under gVisor a user may make a mount namespace of gVisor's own kernel (runc
            // refuses it), and still not mount in it.
            (
                if name == "gvisor" {
                    syscall("unshare(0x00020000) or l.mount(b'x', b'/tmp', b'tmpfs', 0, None)")
                } else {
                    syscall("unshare(0x00020000)")
                },
                "mount ns",
            ),
            // gVisor lets an unprivileged mknod pass, in its own kernel: the node leads to
            // gVisor's emulated devices only, never the host's (a disk: no such device).
            (
                if name == "gvisor" {
                    "mknod /tmp/sda b 8 0 && head -c 1 /tmp/sda".to_string()
                } else {
                    "mknod /tmp/null c 1 3".to_string()
                },
                "mknod",
            ),
            ("echo 1 > /proc/sys/kernel/panic".to_string(), "proc/sys"),
            (
                "python3 -c 'import socket; socket.socket(socket.AF_PACKET, socket.SOCK_RAW)'"
                    .to_string(),
                "packet",
            ),
            (
                "python3 -c 'import socket; socket.socket(socket.AF_INET, socket.SOCK_RAW, 1)'"
                    .to_string(),
                "raw",
            ),
            (syscall("ptrace(16, 1, 0, 0)"), "ptrace"),
            ("python3 -c 'import os; os.setuid(0)'".to_string(), "setuid"),
        ] {
            let out = sh(&live, &script).await;
            assert_ne!(
                out.exit_code,
                Some(0),
                "{name}: {why}: {script} succeeded: {out:?}"
            );
        }
        let out = sh(
            &live,
            &format!(
                "python3 -c \"import socket\nfor a in [('1.1.1.1', 80), ('127.0.0.1', {port})]:\n  try:\n    socket.create_connection(a, timeout=3); print('reached', a[0])\n  except OSError: print('refused', a[0])\""
            ),
        )
        .await;
        assert_eq!(
            text(&out.stdout),
            "refused 1.1.1.1\nrefused 127.0.0.1\n",
            "{name}: {out:?}"
        );
        // Orphans are reaped by the agent (PID 1): no zombie is left.
        let out = sh(
            &live,
            "(sleep 0.2 &) ; (true &) ; sleep 1; ps -eo stat= | grep -c '^Z' || true",
        )
        .await;
        assert_eq!(text(&out.stdout).trim(), "0", "{name}: {out:?}");
        // Memory bomb: the program ends, the box answers. Under gVisor the box's memory
        // limit holds the sentry and its guest together, and the host's OOM killer ends
        // the sentry: the box ends, the host is unharmed, the next box runs (said in
        // docs/linux.md).
        let mut exec = Exec::new(vec![
            "python3".into(),
            "-c".into(),
            "x = bytearray(400 << 20); print(len(x))".into(),
        ]);
        exec.timeout = Duration::from_secs(30);
        let live = match live.exec(exec, |_, _| {}).await {
            Ok(out) => {
                assert!(
                    out.oom_killed || out.exit_code != Some(0),
                    "{name}: {out:?}"
                );
                assert_eq!(
                    text(&sh(&live, "echo still").await.stdout),
                    "still\n",
                    "{name}"
                );
                live
            }
            Err(e) => {
                assert_eq!(name, "gvisor", "{name}: {e}");
                live.close().await;
                let live = boxes
                    .open(BoxSpec::new(
                        Template {
                            vm,
                            ..python().clone()
                        },
                        limits(),
                    ))
                    .await
                    .unwrap();
                assert_eq!(text(&sh(&live, "echo next").await.stdout), "next\n");
                live
            }
        };
        // Fork bomb: the pids limit holds it (the host can still start processes).
        let mut exec = Exec::new(vec![
            "bash".into(),
            "-c".into(),
            "f(){ f|f & }; f; sleep 10".into(),
        ]);
        exec.timeout = Duration::from_secs(3);
        let bombed = live.exec(exec, |_, _| {}).await;
        assert!(
            std::process::Command::new("true")
                .status()
                .unwrap()
                .success()
        );
        match bombed {
            Ok(out) => {
                assert!(out.timed_out, "{name}: {out:?}");
                let _ = live.kill_all_but_agent().await;
                assert_eq!(
                    text(&sh(&live, "echo alive").await.stdout),
                    "alive\n",
                    "{name}"
                );
            }
            // Under gVisor the box may end with it (said in docs/linux.md).
            Err(e) => assert_eq!(name, "gvisor", "{name}: {e}"),
        }
        live.close().await;
        boxes.settled(Duration::from_secs(15)).await;
    }
    drop(host);
}
