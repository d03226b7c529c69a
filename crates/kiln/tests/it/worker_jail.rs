//! The WebAssembly workers of a started `kiln serve` confine themselves (issue 15's defence
//! in depth): read from /proc as any operator would check a process.

use crate::common::serve::{Options, TestResult, start};
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
