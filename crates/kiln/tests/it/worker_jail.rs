//! The WebAssembly workers of a started `kiln serve` confine themselves (issue 15's defence
//! in depth): read from /proc as any operator would check a process.

use std::os::unix::process::CommandExt;
use std::time::{Duration, Instant};

use crate::common::serve::{KillOnDrop, Options, TestResult, kiln, send, start};
use serde_json::json;

/// The `kiln __worker` processes whose parent is `parent`.
fn workers_of(parent: u32) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // The parent is the second field after the command's closing parenthesis.
        let ppid = stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.split(' ').nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if ppid == Some(parent) && cmdline.split(|b| *b == 0).any(|a| a == b"__worker") {
            found.push(pid);
        }
    }
    found
}

fn status_field(pid: u32, name: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix(&format!("{name}:"))
                .map(|v| v.trim().to_owned())
        })
        .unwrap_or_default()
}

/// The mount options of the mount at `point` in `pid`'s mount namespace.
fn mount_options(pid: u32, point: &str) -> Option<String> {
    let info = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).ok()?;
    info.lines().rev().find_map(|line| {
        let fields: Vec<&str> = line.split(' ').collect();
        (fields.get(4) == Some(&point)).then(|| fields.get(5).map(|s| (*s).to_owned()))?
    })
}

#[test]
fn wasm_workers_run_with_no_network_a_read_only_host_and_a_seccomp_filter() -> TestResult {
    let server = start(Options::default())?;
    // The workers serve as before: code runs and its workspace writes land.
    let (status, created) = server.call("POST", "/api/v1/sandboxes", Some(json!({})))?;
    assert_eq!(status, 201, "{created}");
    let id = created["containerId"].as_str().ok_or("no id")?.to_string();
    let (_, ran) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/exec"),
        Some(json!({"code": "open('kept.txt', 'w').write('hi'); print(open('kept.txt').read())"})),
    )?;
    assert_eq!(ran["stdout"], "hi\n", "{ran}");
    let (_, listed) = server.call("GET", &format!("/api/v1/sandboxes/{id}/files"), None)?;
    assert!(listed.to_string().contains("kept.txt"), "{listed}");

    let workers = workers_of(server.child.0.id());
    assert!(!workers.is_empty(), "no worker processes found");
    let own_net = std::fs::read_link("/proc/self/ns/net")?;
    let own_mnt = std::fs::read_link("/proc/self/ns/mnt")?;
    let data = server.data.canonicalize()?;
    for pid in workers {
        assert_eq!(
            status_field(pid, "Seccomp"),
            "2",
            "worker {pid}: no seccomp filter"
        );
        assert_eq!(status_field(pid, "NoNewPrivs"), "1", "worker {pid}");
        let net = std::fs::read_link(format!("/proc/{pid}/ns/net"))?;
        assert_ne!(
            net, own_net,
            "worker {pid} shares the host's network namespace"
        );
        let mnt = std::fs::read_link(format!("/proc/{pid}/ns/mnt"))?;
        assert_ne!(mnt, own_mnt, "worker {pid} shares the host's mounts");
        // Its only interface is loopback (a fresh namespace): the host's are not there.
        let dev = std::fs::read_to_string(format!("/proc/{pid}/net/dev"))?;
        let interfaces: Vec<&str> = dev
            .lines()
            .skip(2)
            .filter_map(|l| l.split(':').next().map(str::trim))
            .collect();
        assert_eq!(interfaces, ["lo"], "worker {pid}: {dev}");
        let root = mount_options(pid, "/").ok_or("no / mount")?;
        assert!(
            root.split(',').any(|o| o == "ro"),
            "worker {pid}: / is {root}"
        );
        assert!(
            root.split(',').any(|o| o == "nosuid"),
            "worker {pid}: / is {root}"
        );
        let data_opts = mount_options(pid, &data.to_string_lossy()).ok_or("no data mount")?;
        assert!(
            data_opts.split(',').any(|o| o == "rw"),
            "worker {pid}: data is {data_opts}"
        );
        for system in ["/usr", "/etc"] {
            if let Some(opts) = mount_options(pid, system) {
                assert!(
                    opts.split(',').any(|o| o == "ro"),
                    "worker {pid}: {system} is {opts}"
                );
            }
        }
    }
    Ok(())
}

/// A seccomp filter refusing `unshare` (EPERM) and allowing everything else: a host where
/// processes cannot make namespaces, as some container runtimes set up.
fn no_unshare_filter() -> Result<seccompiler::BpfProgram, Box<dyn std::error::Error + Send + Sync>>
{
    let arch = std::env::consts::ARCH.try_into()?;
    let filter = seccompiler::SeccompFilter::new(
        [(libc::SYS_unshare, vec![])].into_iter().collect(),
        seccompiler::SeccompAction::Allow,
        seccompiler::SeccompAction::Errno(libc::EPERM as u32),
        arch,
    )?;
    Ok(filter.try_into()?)
}

/// Starts `kiln serve --no-auth` on `port` under `filter`, with `env`; its stderr goes to
/// `log`.
fn serve_filtered(
    filter: &seccompiler::BpfProgram,
    data: &std::path::Path,
    port: u16,
    env: &[(&str, &str)],
    log: &std::path::Path,
) -> Result<KillOnDrop, Box<dyn std::error::Error + Send + Sync>> {
    let mut command = kiln();
    command
        .args(["serve", "--no-auth", "--workers", "1", "--listen"])
        .arg(format!("127.0.0.1:{port}"))
        .arg("--data-dir")
        .arg(data)
        .env_remove("KILN_WORKER_JAIL")
        .envs(env.iter().copied())
        .stderr(std::fs::File::create(log)?);
    if !is_root() {
        // Not root: the server default is `auto`; ask for what root gets.
        command.env("KILN_WORKER_JAIL", "require");
    }
    let filter = filter.clone();
    // SAFETY: between fork and exec only the two prctl calls seccompiler makes run; the
    // program was built before the fork, so nothing allocates.
    unsafe {
        command.pre_exec(move || seccompiler::apply_filter(&filter).map_err(std::io::Error::other));
    }
    Ok(KillOnDrop(command.spawn()?))
}

fn is_root() -> bool {
    // SAFETY: geteuid takes no arguments and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

fn free_port() -> Result<u16, Box<dyn std::error::Error + Send + Sync>> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

#[test]
fn issue32_a_server_says_whether_its_workers_are_confined() -> TestResult {
    let server = start(Options::default())?;
    let (status, ready) = server.call("GET", "/readyz", None)?;
    assert_eq!(status, 200, "{ready}");
    assert_eq!(ready["workers"]["confined"], true, "{ready}");
    let policy = if is_root() { "require" } else { "auto" };
    assert_eq!(ready["workers"]["jail"], policy, "{ready}");
    let metrics = String::from_utf8(send("GET", &server.url("/metrics"), None, None)?.body)?;
    let line = format!("kiln_workers_confined{{jail=\"{policy}\"}} 1");
    assert!(metrics.contains(&line), "no {line} in\n{metrics}");
    Ok(())
}

#[test]
fn issue32_a_root_server_refuses_to_start_with_workers_it_cannot_confine() -> TestResult {
    let dir = tempfile::tempdir()?;
    let filter = no_unshare_filter()?;
    let log = dir.path().join("refused.log");
    let mut refused = serve_filtered(&filter, &dir.path().join("a"), free_port()?, &[], &log)?;
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = refused.0.try_wait()? {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "kiln serve started: {}",
            std::fs::read_to_string(&log)?
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let said = std::fs::read_to_string(&log)?;
    assert!(!status.success(), "{said}");
    assert!(said.contains("cannot confine themselves"), "{said}");
    assert!(said.contains("KILN_WORKER_JAIL=off"), "{said}");
    // Told `off`, it starts, says so loudly, and /readyz says the workers are unconfined.
    let log = dir.path().join("off.log");
    let port = free_port()?;
    let _off = serve_filtered(
        &filter,
        &dir.path().join("b"),
        port,
        &[("KILN_WORKER_JAIL", "off")],
        &log,
    )?;
    let base = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(60);
    let ready = loop {
        if let Ok(reply) = send("GET", &format!("{base}/readyz"), None, None)
            && reply.status == 200
        {
            break reply.json();
        }
        assert!(
            Instant::now() < deadline,
            "{}",
            std::fs::read_to_string(&log)?
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(
        ready["workers"],
        json!({"confined": false, "jail": "off"}),
        "{ready}"
    );
    assert!(std::fs::read_to_string(&log)?.contains("UNCONFINED"));
    // It still runs code.
    let created = send(
        "POST",
        &format!("{base}/api/v1/sandboxes"),
        None,
        Some(("application/json", b"{}")),
    )?
    .json();
    let id = created["containerId"].as_str().ok_or("no id")?;
    let ran = send(
        "POST",
        &format!("{base}/api/v1/sandboxes/{id}/exec"),
        None,
        Some(("application/json", br#"{"code": "print(6 * 7)"}"#)),
    )?
    .json();
    assert_eq!(ran["stdout"], "42\n", "{ran}");
    Ok(())
}
