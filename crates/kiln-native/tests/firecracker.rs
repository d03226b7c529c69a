//! kiln's Firecracker driver ([`kiln_native::vmm::Firecracker`]) against a scripted peer:
//! a Unix-socket HTTP server that speaks Firecracker's API as its documentation describes
//! it (pre-boot calls refused after `InstanceStart`, a snapshot only of a paused VM, a
//! `fault_message` with each refusal) and its vsock handshake (`CONNECT PORT` answered
//! `OK HOSTPORT`), with kiln's real agent behind the vsock socket as the guest. Firecracker
//! itself cannot run on this project's machines (their `/dev/kvm` is PVM): this is what is
//! tested of it, and the README says so.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kiln_guest::proto::{Op, Reply};
use kiln_native::channel::Channel;
use kiln_native::jail::BoxLimits;
use kiln_native::vm::{Accel, VmMemory, VmSpec};
use kiln_native::vmm::{Firecracker, Vmm};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};

fn agent() -> PathBuf {
    kiln_native::find_agent()
        .or_else(|| {
            let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../target/guest/release/kiln-guest");
            kiln_native::is_static(&path).then_some(path)
        })
        .expect("the static guest agent is not built: run scripts/build-guest")
}

/// How the peer behaves.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// As Firecracker does.
    Faithful,
    /// Refuses the kernel, as Firecracker does a path it cannot open.
    BadKernel,
    /// Answers bytes that are not HTTP.
    Garbage,
    /// Answers a head that says its body is a gigabyte.
    Huge,
}

#[derive(Default)]
struct State {
    calls: Vec<(String, String, Value)>,
    started: bool,
    paused: bool,
    configured: Vec<String>,
}

/// A scripted Firecracker on `run/api.sock` (the jail's `/kiln/run` is `run`).
struct Peer {
    state: Arc<Mutex<State>>,
}

impl Peer {
    fn start(run: &Path, mode: Mode) -> Peer {
        let state = Arc::new(Mutex::new(State::default()));
        let listener = UnixListener::bind(run.join("api.sock")).unwrap();
        let (shared, run) = (state.clone(), run.to_path_buf());
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (state, run) = (shared.clone(), run.clone());
                tokio::spawn(async move { answer(stream, state, &run, mode).await });
            }
        });
        Peer { state }
    }

    fn calls(&self) -> Vec<(String, String, Value)> {
        self.state.lock().unwrap().calls.clone()
    }
}

/// One API connection: one request, one answer.
async fn answer(stream: UnixStream, state: Arc<Mutex<State>>, run: &Path, mode: Mode) {
    let mut reader = tokio::io::BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line).await.unwrap();
    let mut parts = line.split_whitespace();
    let (method, path) = (
        parts.next().unwrap_or_default().to_string(),
        parts.next().unwrap_or_default().to_string(),
    );
    let mut length = 0;
    loop {
        let mut header = String::new();
        reader.read_line(&mut header).await.unwrap();
        if header.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            length = value.trim().parse().unwrap();
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).await.unwrap();
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let mut stream = reader.into_inner();
    match mode {
        Mode::Garbage => {
            let _ = stream.write_all(b"\x00\x01 not http at all\r\n\r\n").await;
            return;
        }
        Mode::Huge => {
            let _ = stream
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 1073741824\r\n\r\n{")
                .await;
            return;
        }
        _ => {}
    }
    let outcome = judge(&state, &method, &path, &body, mode);
    if outcome.is_ok() {
        state
            .lock()
            .unwrap()
            .calls
            .push((method.clone(), path.clone(), body.clone()));
    }
    let reply = match outcome {
        Ok(boots) => {
            if boots {
                // The guest comes up a moment later: the driver must retry its CONNECT.
                let uds = body["uds_path"]
                    .as_str()
                    .map(|p| p.to_string())
                    .unwrap_or_else(|| "/kiln/run/vsock.sock".into());
                let host = run.join(uds.strip_prefix("/kiln/run/").unwrap());
                tokio::spawn(guest(host));
            }
            "HTTP/1.1 204 No Content\r\nServer: Firecracker API\r\nConnection: keep-alive\r\n\r\n"
                .to_string()
        }
        Err(fault) => {
            let fault = json!({"fault_message": fault}).to_string();
            format!(
                "HTTP/1.1 400 Bad Request\r\nServer: Firecracker API\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{fault}",
                fault.len()
            )
        }
    };
    let _ = stream.write_all(reply.as_bytes()).await;
}

/// Firecracker's rules for one call: `Ok(true)` when it starts the guest.
fn judge(
    state: &Mutex<State>,
    method: &str,
    path: &str,
    body: &Value,
    mode: Mode,
) -> Result<bool, String> {
    let mut state = state.lock().unwrap();
    let pre_boot = [
        "/machine-config",
        "/boot-source",
        "/vsock",
        "/snapshot/load",
    ];
    if state.started && (pre_boot.contains(&path) || path.starts_with("/drives/")) {
        return Err("The requested operation is not supported after starting the microVM.".into());
    }
    let string = |key: &str| {
        body[key].as_str().map(str::to_string).ok_or(format!(
            "An error occurred when deserializing the json body of a request: missing field `{key}`"
        ))
    };
    match (method, path) {
        ("PUT", "/machine-config") => {
            let cpus = body["vcpu_count"]
                .as_u64()
                .ok_or("missing field `vcpu_count`")?;
            body["mem_size_mib"]
                .as_u64()
                .ok_or("missing field `mem_size_mib`")?;
            if !(1..=32).contains(&cpus) {
                return Err("The vCPU number is invalid!".into());
            }
        }
        ("PUT", "/boot-source") => {
            string("kernel_image_path")?;
            if mode == Mode::BadKernel {
                return Err("Invalid kernel path: No such file or directory (os error 2)".into());
            }
        }
        ("PUT", drive) if drive.starts_with("/drives/") => {
            if body["drive_id"].as_str() != drive.strip_prefix("/drives/") {
                return Err("The id from the path does not match the id from the body!".into());
            }
            string("path_on_host")?;
            body["is_root_device"]
                .as_bool()
                .ok_or("missing field `is_root_device`")?;
        }
        ("PUT", "/vsock") => {
            if body["guest_cid"].as_u64().is_none_or(|cid| cid < 3) {
                return Err("Invalid guest CID".into());
            }
            string("uds_path")?;
        }
        ("PUT", "/actions") => {
            if body["action_type"] != "InstanceStart" {
                return Err(format!("unknown action {}", body["action_type"]));
            }
            for needed in ["/machine-config", "/boot-source"] {
                if !state.configured.iter().any(|c| c == needed) {
                    return Err(format!("Cannot start microvm without {needed}"));
                }
            }
            state.started = true;
            return Ok(state.configured.iter().any(|c| c == "/vsock"));
        }
        ("PATCH", "/vm") => {
            if !state.started {
                return Err("The microVM is not running".into());
            }
            state.paused = body["state"] == "Paused";
        }
        ("PUT", "/snapshot/create") => {
            if !state.paused {
                return Err("Cannot create a snapshot of a running microVM".into());
            }
            string("snapshot_path")?;
            string("mem_file_path")?;
        }
        ("PUT", "/snapshot/load") => {
            string("snapshot_path")?;
            if body["mem_backend"]["backend_type"] != "File" {
                return Err("missing field `mem_backend`".into());
            }
            state.started = true;
            return Ok(true);
        }
        _ => return Err("Invalid request method and/or path".into()),
    }
    state.configured.push(path.to_string());
    Ok(false)
}

/// The guest: kiln's agent (its channel on pipes), behind Firecracker's vsock socket at
/// `uds`, which answers `CONNECT 1024` with `OK` and carries the bytes both ways. It listens
/// 300 ms after the boot, as a VM's agent does once the kernel is up.
async fn guest(uds: PathBuf) {
    tokio::time::sleep(Duration::from_millis(300)).await;
    let listener = UnixListener::bind(&uds).unwrap();
    while let Ok((mut host, _)) = listener.accept().await {
        let mut line = Vec::new();
        let mut byte = [0u8; 1];
        while host.read_exact(&mut byte).await.is_ok() && byte[0] != b'\n' {
            line.push(byte[0]);
        }
        if line != b"CONNECT 1024" {
            continue; // Firecracker closes a connection to a port no one listens on.
        }
        host.write_all(b"OK 1073741824\n").await.unwrap();
        let mut agent = tokio::process::Command::new(agent())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let (mut to_agent, mut from_agent) =
            (agent.stdin.take().unwrap(), agent.stdout.take().unwrap());
        tokio::spawn(async move {
            let (mut read, mut write) = host.split();
            let _ = tokio::join!(
                tokio::io::copy(&mut read, &mut to_agent),
                tokio::io::copy(&mut from_agent, &mut write)
            );
            drop(agent);
        });
    }
}

fn spec<'a>(vmm: &'a Firecracker, run: &'a Path, memory: VmMemory<'a>) -> VmSpec<'a> {
    VmSpec {
        memory,
        vmm,
        accel: Accel::Kvm,
        vmlinux: Path::new("/v"),
        initrd: Path::new("/i"),
        root_image: Path::new("/r"),
        layer: Path::new("/l"),
        workspace: None,
        working_dir: "/workspace",
        run_dir: run,
        limits: BoxLimits {
            memory_bytes: 512 << 20,
            vcpus: 1.5,
            pids: 128,
            disk_bytes: 1 << 30,
            weight: 100,
        },
        uid_base: 100_000,
        cgroup: "/kiln/test",
    }
}

/// Hello, then a file read through the agent behind the vsock socket.
async fn talks(stream: UnixStream, file: &Path) {
    let (read, write) = stream.into_split();
    let channel = Channel::new(read, write);
    let mut hello = channel.call(Op::Hello).await.unwrap();
    assert!(matches!(hello.next().await, Some(Reply::Hello { .. })));
    let mut data = channel
        .call(Op::ReadFile {
            path: file.to_string_lossy().into_owned(),
            offset: 0,
            limit: 1 << 10,
        })
        .await
        .unwrap();
    let mut got = Vec::new();
    while let Some(reply) = data.next().await {
        match reply {
            Reply::Data { data, .. } => got.extend(data),
            Reply::Done => break,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(got, b"from the guest");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn firecracker_is_configured_started_snapshotted_and_cloned_over_its_api() {
    let vmm = Firecracker {
        binary: "/usr/bin/firecracker".into(),
    };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("guest.txt");
    std::fs::write(&file, "from the guest").unwrap();

    // A cold boot: the machine, the kernel and its command line, the root image read-only,
    // the vsock device, then InstanceStart; the agent answers over vsock.
    let run = dir.path().join("cold");
    std::fs::create_dir(&run).unwrap();
    let peer = Peer::start(&run, Mode::Faithful);
    let cold = spec(&vmm, &run, VmMemory::Own);
    let stream = vmm.boot(&cold).await.unwrap();
    talks(stream, &file).await;
    let calls = peer.calls();
    let paths: Vec<&str> = calls.iter().map(|(_, p, _)| p.as_str()).collect();
    assert_eq!(
        paths,
        [
            "/machine-config",
            "/boot-source",
            "/drives/root",
            "/drives/layer",
            "/vsock",
            "/actions"
        ]
    );
    assert_eq!(calls[0].2["vcpu_count"], 2);
    assert_eq!(calls[0].2["mem_size_mib"], 512);
    let boot_args = calls[1].2["boot_args"].as_str().unwrap();
    assert!(
        boot_args.contains("kiln.agent=vsock") && boot_args.contains("kiln.pids=128"),
        "{boot_args}"
    );
    assert!(!boot_args.contains("tsc_early_khz"), "KVM: {boot_args}");
    assert_eq!(calls[2].2["is_read_only"], true);
    assert_eq!(calls[3].2["is_read_only"], false);
    assert_eq!(calls[4].2["guest_cid"], 3);

    // The snapshot of a VM: paused, then both files written.
    vmm.snapshot(&run).await.unwrap();
    let calls = peer.calls();
    assert_eq!(calls[6].0, "PATCH");
    assert_eq!(calls[6].2, json!({"state": "Paused"}));
    assert_eq!(calls[7].1, "/snapshot/create");
    assert_eq!(calls[7].2["mem_file_path"], "/kiln/snap/ram");
    // A second boot of the same VM is refused as Firecracker refuses it, and said.
    let again = vmm.boot(&cold).await.unwrap_err();
    assert!(again.contains("not supported after starting"), "{again}");

    // A clone: one call, the snapshot loaded with its memory file mapped, resumed; a new
    // agent connection.
    let run = dir.path().join("clone");
    std::fs::create_dir(&run).unwrap();
    let peer = Peer::start(&run, Mode::Faithful);
    let snapshot = dir.path().join("snap");
    let stream = vmm
        .boot(&spec(
            &vmm,
            &run,
            VmMemory::Clone {
                snapshot: &snapshot,
            },
        ))
        .await
        .unwrap();
    talks(stream, &file).await;
    let calls = peer.calls();
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(calls[0].1, "/snapshot/load");
    assert_eq!(calls[0].2["mem_backend"]["backend_path"], "/kiln/snap/ram");
    assert_eq!(calls[0].2["resume_vm"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn firecracker_refusals_and_hostile_answers_are_clean_errors() {
    let vmm = Firecracker {
        binary: "/usr/bin/firecracker".into(),
    };
    let dir = tempfile::tempdir().unwrap();
    for (mode, said) in [
        (Mode::BadKernel, "Invalid kernel path"),
        (Mode::Garbage, "no HTTP status"),
        (Mode::Huge, "too long"),
    ] {
        let run = tempfile::tempdir_in(dir.path()).unwrap();
        let _peer = Peer::start(run.path(), mode);
        let error = tokio::time::timeout(
            Duration::from_secs(20),
            vmm.boot(&spec(&vmm, run.path(), VmMemory::Own)),
        )
        .await
        .expect("a clean error, not a hang")
        .unwrap_err();
        assert!(error.contains(said), "{said}: {error}");
    }
    // No Firecracker at all: its socket never appears, and that is said.
    let run = tempfile::tempdir_in(dir.path()).unwrap();
    let error = vmm
        .boot(&spec(&vmm, run.path(), VmMemory::Own))
        .await
        .unwrap_err();
    assert!(error.contains("made no socket"), "{error}");
}
