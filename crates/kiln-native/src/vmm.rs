//! What runs a microVM: a [`Vmm`] is QEMU's `microvm` machine driven over QMP ([`Qemu`]) or
//! Firecracker driven over its API socket ([`Firecracker`]). Either runs in the boxes' jail
//! ([`crate::vm::vmm_config`]); kiln's agent is the VM's PID 1 either way, reached over a
//! virtio serial port (QEMU) or vsock (Firecracker, which has no serial port for it).
//!
//! What differs, and why kiln serves QEMU by default:
//! - QEMU runs anywhere (TCG, a software CPU, where there is no VT-x/AMD-V, as on this
//!   project's machines); Firecracker needs KVM backed by hardware.
//! - QEMU shares the sandbox's workspace folder with the VM over 9p; Firecracker shares no
//!   folder with its VMs (no 9p, no virtio-fs), so its VMs run without a workspace: a
//!   sandbox (which always has one) is refused on it with that reason, and `kiln exec --vm
//!   --vmm firecracker` runs commands without `--workspace`.
//! - Snapshots: QEMU migrates its devices' state beside a RAM file shared with the template
//!   VM and mapped copy-on-write by each clone; Firecracker writes both files with
//!   `/snapshot/create` and maps the memory file privately on `/snapshot/load`.
//!
//! Firecracker is tested here against a scripted peer that speaks its API and its vsock
//! handshake (`tests/firecracker.rs`), never against Firecracker itself: it cannot run on
//! this project's machines (their `/dev/kvm` is PVM).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use crate::vm::{VmMemory, VmSpec};

/// How long a VMM has to make its sockets.
const SOCKET_TIMEOUT: Duration = Duration::from_secs(15);
/// How long a VM has to boot to its agent (a software CPU boots in seconds).
const AGENT_TIMEOUT: Duration = Duration::from_secs(90);
/// The largest answer read from Firecracker's API (its answers are a few hundred bytes).
const MAX_ANSWER: usize = 64 << 10;
/// How long one API call may take (a snapshot writes the VM's RAM).
const CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// A virtual machine monitor kiln can drive.
pub trait Vmm: Send + Sync + std::fmt::Debug {
    /// `qemu` or `firecracker`.
    fn name(&self) -> &'static str;
    /// Its binary on the host.
    fn binary(&self) -> &Path;
    /// Whether it serves a host folder to the VM (the sandbox's workspace).
    fn shares_folders(&self) -> bool;
    /// Whether a clone reads the snapshot's device state from a file in its jail (else it
    /// comes on descriptor 3, and the jail shows the RAM file alone).
    fn clone_reads_state_file(&self) -> bool;
    /// Its command line in the jail (paths as the jail shows them).
    fn argv(&self, spec: &VmSpec<'_>) -> Vec<String>;
    /// Once its process runs: configures and starts the VM (a clone: restores and resumes
    /// it), and answers the agent's channel, connected.
    fn boot<'a>(&'a self, spec: &'a VmSpec<'a>) -> BoxFuture<'a, Result<UnixStream, String>>;
    /// Stops a snapshot's template VM and writes its snapshot (`/kiln/snap/state`, and the
    /// RAM at `/kiln/snap/ram` where the VMM does not keep it there already).
    fn snapshot<'a>(&'a self, run_dir: &'a Path) -> BoxFuture<'a, Result<(), String>>;
}

/// The kernel command line of a VM (the init reads the `kiln.` words).
pub fn kernel_cmdline(spec: &VmSpec<'_>, agent: &str) -> String {
    // The writable layer is the VM's second disk (`/dev/vdb`).
    let mut cmdline = format!(
        "console=ttyS0 quiet panic=-1 kiln.workdir={} kiln.pids={} kiln.agent={agent}",
        spec.working_dir, spec.limits.pids
    );
    if spec.memory != VmMemory::Own {
        cmdline.push_str(" kiln.workspace=later");
    }
    if spec.accel == crate::vm::Accel::Tcg {
        // A software CPU cannot calibrate the TSC: say its rate.
        cmdline.push_str(" tsc_early_khz=2600000 tsc=reliable");
    }
    cmdline
}

/// Connects to a Unix socket a VMM makes, waiting up to `timeout` for it to appear.
async fn connect(path: &Path, timeout: Duration, what: &str) -> Result<UnixStream, String> {
    let started = Instant::now();
    loop {
        match UnixStream::connect(path).await {
            Ok(stream) => return Ok(stream),
            Err(e) if started.elapsed() > timeout => {
                return Err(format!("{what} made no socket in {timeout:?} ({e})"));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

/// QEMU's `microvm` machine, over QMP; the agent on a virtio serial port.
#[derive(Debug, Clone)]
pub struct Qemu {
    pub binary: PathBuf,
}

impl Vmm for Qemu {
    fn name(&self) -> &'static str {
        "qemu"
    }

    fn binary(&self) -> &Path {
        &self.binary
    }

    fn shares_folders(&self) -> bool {
        true
    }

    fn clone_reads_state_file(&self) -> bool {
        false
    }

    fn argv(&self, spec: &VmSpec<'_>) -> Vec<String> {
        crate::vm::qemu_args(spec)
    }

    fn boot<'a>(&'a self, spec: &'a VmSpec<'a>) -> BoxFuture<'a, Result<UnixStream, String>> {
        Box::pin(async move {
            // The agent's port is connected before a clone runs, so it never reads an end of
            // file (which would end it); then its state comes in.
            let socket = connect(&spec.run_dir.join("agent.sock"), SOCKET_TIMEOUT, "QEMU").await?;
            if let VmMemory::Clone { .. } = spec.memory {
                let mut qmp = crate::vm::Qmp::connect(&spec.run_dir.join("qmp.sock")).await?;
                qmp.execute(
                    "migrate-set-capabilities",
                    json!({"capabilities": [{"capability": "x-ignore-shared", "state": true}]}),
                )
                .await?;
                qmp.execute("migrate-incoming", json!({"uri": "fd:3"}))
                    .await?;
                qmp.migrated(Duration::from_secs(60)).await?;
                // Running already where QEMU starts a finished incoming migration itself.
                let _ = qmp.execute("cont", json!({})).await;
            }
            Ok(socket)
        })
    }

    fn snapshot<'a>(&'a self, run_dir: &'a Path) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let mut qmp = crate::vm::Qmp::connect(&run_dir.join("qmp.sock")).await?;
            qmp.execute("stop", json!({})).await?;
            // The RAM is the shared file already: only the devices' state is written.
            qmp.execute(
                "migrate-set-capabilities",
                json!({"capabilities": [{"capability": "x-ignore-shared", "state": true}]}),
            )
            .await?;
            qmp.execute("migrate", json!({"uri": "exec:cat > /kiln/snap/state"}))
                .await?;
            qmp.migrated(Duration::from_secs(60)).await
        })
    }
}

/// Firecracker, over its API socket (`/kiln/run/api.sock`); the agent on vsock port
/// [`kiln_guest::vsock::AGENT_PORT`], reached through Firecracker's Unix socket
/// (`/kiln/run/vsock.sock`, `CONNECT PORT`).
#[derive(Debug, Clone)]
pub struct Firecracker {
    pub binary: PathBuf,
}

/// The guest's vsock address (the first a guest may have).
pub const GUEST_CID: u32 = 3;

impl Firecracker {
    /// The calls that configure and start a VM booted cold, in order (Firecracker's API:
    /// machine, kernel, drives, vsock, then `InstanceStart`).
    pub fn boot_calls(spec: &VmSpec<'_>) -> Vec<(&'static str, String, Value)> {
        let cpus = (spec.limits.vcpus.ceil() as u64).clamp(1, 16);
        vec![
            (
                "PUT",
                "/machine-config".into(),
                json!({"vcpu_count": cpus, "mem_size_mib": crate::vm::ram_mib(&spec.limits), "smt": false}),
            ),
            (
                "PUT",
                "/boot-source".into(),
                json!({
                    "kernel_image_path": "/kiln/vmlinux",
                    "initrd_path": "/kiln/initrd",
                    "boot_args": kernel_cmdline(spec, "vsock"),
                }),
            ),
            (
                "PUT",
                "/drives/root".into(),
                json!({"drive_id": "root", "path_on_host": "/kiln/root.ext4",
                       "is_root_device": false, "is_read_only": true}),
            ),
            (
                "PUT",
                "/drives/layer".into(),
                json!({"drive_id": "layer", "path_on_host": "/kiln/layer.img",
                       "is_root_device": false, "is_read_only": false}),
            ),
            (
                "PUT",
                "/vsock".into(),
                json!({"guest_cid": GUEST_CID, "uds_path": "/kiln/run/vsock.sock"}),
            ),
            (
                "PUT",
                "/actions".into(),
                json!({"action_type": "InstanceStart"}),
            ),
        ]
    }
}

impl Vmm for Firecracker {
    fn name(&self) -> &'static str {
        "firecracker"
    }

    fn binary(&self) -> &Path {
        &self.binary
    }

    fn shares_folders(&self) -> bool {
        false
    }

    fn clone_reads_state_file(&self) -> bool {
        true
    }

    fn argv(&self, _spec: &VmSpec<'_>) -> Vec<String> {
        // Firecracker's own seccomp filters stay on (its default).
        [
            "/kiln/vmm",
            "--api-sock",
            "/kiln/run/api.sock",
            "--id",
            "kiln",
        ]
        .map(String::from)
        .to_vec()
    }

    fn boot<'a>(&'a self, spec: &'a VmSpec<'a>) -> BoxFuture<'a, Result<UnixStream, String>> {
        Box::pin(async move {
            let api = spec.run_dir.join("api.sock");
            connect(&api, SOCKET_TIMEOUT, "Firecracker").await?;
            let calls = match spec.memory {
                VmMemory::Clone { .. } => vec![(
                    "PUT",
                    "/snapshot/load".to_string(),
                    json!({
                        "snapshot_path": "/kiln/snap/state",
                        "mem_backend": {"backend_type": "File", "backend_path": "/kiln/snap/ram"},
                        "enable_diff_snapshots": false,
                        "resume_vm": true,
                    }),
                )],
                _ => Firecracker::boot_calls(spec),
            };
            for (method, path, body) in calls {
                api_call(&api, method, &path, Some(&body)).await?;
            }
            agent_over_vsock(
                &spec.run_dir.join("vsock.sock"),
                kiln_guest::vsock::AGENT_PORT,
                AGENT_TIMEOUT,
            )
            .await
        })
    }

    fn snapshot<'a>(&'a self, run_dir: &'a Path) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let api = run_dir.join("api.sock");
            api_call(&api, "PATCH", "/vm", Some(&json!({"state": "Paused"}))).await?;
            api_call(
                &api,
                "PUT",
                "/snapshot/create",
                Some(
                    &json!({"snapshot_type": "Full", "snapshot_path": "/kiln/snap/state",
                             "mem_file_path": "/kiln/snap/ram"}),
                ),
            )
            .await?;
            Ok(())
        })
    }
}

/// One call of Firecracker's API over its socket `api` (a connection per call): the answer's
/// body (JSON, or `null` for none) on a 2xx; otherwise Firecracker's `fault_message`, said.
/// The answer is read bounded ([`MAX_ANSWER`]) and within [`CALL_TIMEOUT`].
pub async fn api_call(
    api: &Path,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> Result<Value, String> {
    let call = async {
        let mut stream = UnixStream::connect(api)
            .await
            .map_err(|e| format!("Firecracker's API socket: {e}"))?;
        let body = body.map(Value::to_string).unwrap_or_default();
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nAccept: application/json\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        stream
            .write_all(request.as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        let (status, answer) = read_answer(&mut stream).await?;
        if (200..300).contains(&status) {
            return Ok(if answer.is_empty() {
                Value::Null
            } else {
                serde_json::from_slice(&answer).unwrap_or(Value::Null)
            });
        }
        let fault = serde_json::from_slice::<Value>(&answer)
            .ok()
            .and_then(|v| v["fault_message"].as_str().map(str::to_string))
            .unwrap_or_else(|| String::from_utf8_lossy(&answer).chars().take(300).collect());
        Err(format!(
            "Firecracker refused {method} {path} ({status}): {fault}"
        ))
    };
    tokio::time::timeout(CALL_TIMEOUT, call)
        .await
        .map_err(|_| format!("Firecracker did not answer {method} {path} in {CALL_TIMEOUT:?}"))?
}

/// An HTTP/1.1 answer: its status and body (by `Content-Length`; none without one), at most
/// [`MAX_ANSWER`] bytes in all.
async fn read_answer(stream: &mut UnixStream) -> Result<(u16, Vec<u8>), String> {
    let mut reader = tokio::io::BufReader::new(stream).take(MAX_ANSWER as u64);
    let mut line = String::new();
    let mut status = None;
    let mut length = 0usize;
    loop {
        line.clear();
        let read = reader
            .read_line(&mut line)
            .await
            .map_err(|e| format!("Firecracker's answer: {e}"))?;
        if read == 0 {
            return Err("Firecracker's answer ended in its head (or was too long)".into());
        }
        let trimmed = line.trim_end();
        if status.is_none() {
            let code = trimmed
                .strip_prefix("HTTP/1.1 ")
                .or_else(|| trimmed.strip_prefix("HTTP/1.0 "))
                .and_then(|rest| rest.get(..3))
                .and_then(|code| code.parse::<u16>().ok())
                .ok_or_else(|| {
                    format!(
                        "Firecracker answered no HTTP status: {:?}",
                        trimmed.chars().take(80).collect::<String>()
                    )
                })?;
            status = Some(code);
            continue;
        }
        if trimmed.is_empty() {
            break;
        }
        if let Some((name, value)) = trimmed.split_once(':')
            && name.trim().eq_ignore_ascii_case("content-length")
        {
            length = value
                .trim()
                .parse()
                .map_err(|_| format!("Firecracker's answer has a bad length: {value:?}"))?;
        }
    }
    if length > MAX_ANSWER {
        return Err(format!("Firecracker's answer is too long ({length} bytes)"));
    }
    let mut body = vec![0; length];
    reader
        .read_exact(&mut body)
        .await
        .map_err(|e| format!("Firecracker's answer ended early: {e}"))?;
    Ok((status.unwrap_or(0), body))
}

/// The agent's channel through Firecracker's vsock socket `uds`: `CONNECT PORT`, answered
/// `OK HOSTPORT`; retried until the agent listens (the VM boots) or `timeout`.
pub async fn agent_over_vsock(
    uds: &Path,
    port: u32,
    timeout: Duration,
) -> Result<UnixStream, String> {
    let started = Instant::now();
    let mut last = String::from("no socket");
    while started.elapsed() < timeout {
        let attempt = async {
            let mut stream = UnixStream::connect(uds).await.map_err(|e| e.to_string())?;
            stream
                .write_all(format!("CONNECT {port}\n").as_bytes())
                .await
                .map_err(|e| e.to_string())?;
            // The answer is one short line, read a byte at a time so nothing of the agent's
            // stream after it is consumed.
            let mut answer = Vec::new();
            let mut byte = [0u8; 1];
            while answer.len() < 64 {
                match stream.read(&mut byte).await {
                    Ok(0) => return Err("closed".to_string()),
                    Ok(_) if byte[0] == b'\n' => break,
                    Ok(_) => answer.push(byte[0]),
                    Err(e) => return Err(e.to_string()),
                }
            }
            let answer = String::from_utf8_lossy(&answer).into_owned();
            if answer.starts_with("OK ") {
                Ok(stream)
            } else {
                Err(format!("answered {answer:?}"))
            }
        };
        match tokio::time::timeout(Duration::from_secs(5), attempt).await {
            Ok(Ok(stream)) => return Ok(stream),
            Ok(Err(e)) => last = e,
            Err(_) => last = "no answer in 5 s".into(),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Err(format!(
        "the agent did not answer on vsock port {port} in {timeout:?} ({last})"
    ))
}
