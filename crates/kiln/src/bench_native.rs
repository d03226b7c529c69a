//! `kiln bench --only native`: Linux boxes. Creating a box from a built template, `echo hi`
//! and `python3 -c 'print(1)'` in a live box, pausing and resuming it while it runs a dev
//! server, closing it, host memory per idle box, the
//! template's build time (first and cached), `kiln exec --template` as a whole process, and
//! plain `python3` on the host in the same run for comparison.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use kiln_native::boxes::{BoxSpec, Boxes, Exec, LiveBox};
use kiln_native::jail::BoxLimits;
use serde_json::json;

use crate::bench::{Report, micros, summary};
use crate::cli::BenchArgs;

/// The value in KiB of `key` (`MemAvailable:`, `Pss:`) in a /proc file, in bytes.
fn proc_bytes(path: &str, key: &str) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
        })
        .unwrap_or(0)
        * 1024
}

fn mem_available() -> u64 {
    proc_bytes("/proc/meminfo", "MemAvailable:")
}

fn pss(pid: i32) -> u64 {
    proc_bytes(&format!("/proc/{pid}/smaps_rollup"), "Pss:")
}

async fn run_ok(live: &LiveBox, argv: &[&str], expect: &str) -> anyhow::Result<Duration> {
    let exec = Exec::new(argv.iter().map(|s| s.to_string()).collect());
    let t = Instant::now();
    let out = live.exec(exec, |_, _| {}).await?;
    let took = t.elapsed();
    anyhow::ensure!(
        out.stdout == expect.as_bytes() && out.exit_code == Some(0),
        "{argv:?} gave {out:?}"
    );
    Ok(took)
}

pub(crate) fn run(args: &BenchArgs, n: usize, report: &mut Report) -> anyhow::Result<()> {
    // SAFETY: geteuid(2) takes no arguments, touches no memory of ours and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        report.insert(
            "native".into(),
            json!({"skipped": "Linux boxes need kiln to run as root"}),
        );
        return Ok(());
    }
    let linux = &args.linux;
    let store = crate::linux_cmd::store(linux);
    let definition = crate::linux_cmd::definitions(linux)?
        .into_iter()
        .find(|d| d.name == "python")
        .context("no python template is defined")?;
    let Some(template) = store.find(&definition) else {
        report.insert(
            "native".into(),
            json!({"skipped": "the python template is not built: kiln setup --template python"}),
        );
        return Ok(());
    };
    let mut lookups = Vec::new();
    for _ in 0..20 {
        let t = Instant::now();
        anyhow::ensure!(store.find(&definition).is_some());
        lookups.push(micros(t.elapsed()));
    }
    report.insert(
        "native_template_build".into(),
        json!({
            "template": "python",
            "first_build_s": (template.built.build_seconds * 10.0).round() / 10.0,
            "size_mib": template.built.size_bytes >> 20,
            "cached_lookup": summary(lookups),
        }),
    );
    volumes(n, report)?;
    // With QEMU and scripts/build-vm's kernel here, the same boxes run microVMs too.
    let mut with_vm = linux.clone();
    with_vm.vm = kiln_native::vm::find_qemu().is_some()
        && kiln_native::vm::VmAssets::find(crate::cache::dir().root()).is_ok();
    let linux = &with_vm;
    let boxes = crate::linux_cmd::boxes(linux)?;
    let limits = BoxLimits {
        memory_bytes: 256 << 20,
        vcpus: 1.0,
        pids: 128,
        disk_bytes: 256 << 20,
        weight: 100,
    };
    let spec = BoxSpec::new(template, limits);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let pool_template = spec.template.clone();
    rt.block_on(async {
        create_and_close(&boxes, &spec, n, report).await?;
        commands(&boxes, &spec, n, report).await?;
        idle_boxes(&boxes, &spec, args.boxes, report).await?;
        pool(linux, &boxes, pool_template.clone(), 5, n, report).await?;
        // Where runsc is installed: the same box under gVisor, side by side.
        let gvisor = kiln_native::builder::Template {
            gvisor: true,
            ..pool_template.clone()
        };
        if boxes.is_gvisor_for(&gvisor) {
            tier_python(&boxes, &spec, gvisor, "native_gvisor", report).await?;
        } else {
            report.insert(
                "native_gvisor".into(),
                json!({"skipped": "runsc is not installed here (apt-get install runsc)"}),
            );
        }
        if linux.vm {
            let vm = kiln_native::builder::Template {
                vm: true,
                ..pool_template
            };
            tier_python(&boxes, &spec, vm.clone(), "native_vm", report).await?;
            pool(linux, &boxes, vm, 2, (n / 4).clamp(8, 40), report).await?;
        } else {
            report.insert(
                "native_vm".into(),
                json!({"skipped": "no QEMU or no microVM kernel here (apt-get install qemu-system-x86; scripts/build-vm)"}),
            );
        }
        anyhow::Ok(())
    })?;
    processes(n, report)
}

/// CPU time of this process and its waited-for children (runc, mkfs), in seconds.
fn cpu_seconds() -> f64 {
    let usage = |who| {
        // SAFETY: getrusage(2) writes one rusage into the zeroed struct we pass.
        let mut r: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: as above; `who` is RUSAGE_SELF or RUSAGE_CHILDREN.
        unsafe { libc::getrusage(who, &mut r) };
        let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
        t(r.ru_utime) + t(r.ru_stime)
    };
    usage(libc::RUSAGE_SELF) + usage(libc::RUSAGE_CHILDREN)
}

/// The warm pool of boxes (seed 002): how fast it fills and what that costs, what an idle
/// member holds, a claim, claim → first command (`true`) in the claimed box, and destroying
/// it. Members are sandboxes' boxes, each on a 1 GiB volume of its own, as `kiln serve
/// --linux` keeps them.
async fn pool(
    linux: &crate::cli::LinuxArgs,
    boxes: &Boxes,
    template: kiln_native::builder::Template,
    size: usize,
    n: usize,
    report: &mut Report,
) -> anyhow::Result<()> {
    use kiln_core::backend::Backend;
    use kiln_core::process::ProcessHost;
    let vm = template.vm;
    let id = kiln_native::backend::template_id(&template);
    let dir = tempfile::tempdir()?;
    let mut settings = crate::linux_cmd::pool_settings(linux, dir.path())?;
    settings.defaults.target_pool_size = Some(if vm { 0 } else { size });
    settings.sizes.clear();
    if vm {
        settings.sizes.insert(id.clone(), size);
    }
    let template = kiln_native::builder::Template {
        vm: false,
        gvisor: false,
        ..template
    };
    let backend = kiln_native::backend::NativeBackend::new(
        boxes.clone(),
        vec![template],
        std::sync::Arc::new(
            kiln_native::proxy::Allowlist::new::<&str>(&[]).map_err(anyhow::Error::msg)?,
        ),
        None,
        &settings,
    );
    let ready = |backend: &kiln_native::backend::NativeBackend| {
        backend
            .pool_stats()
            .iter()
            .find(|p| p.template == id)
            .map_or(0, |p| p.ready)
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = mem_available();
    let (cpu, t) = (cpu_seconds(), Instant::now());
    backend.start_pools();
    while ready(&backend) < size {
        anyhow::ensure!(
            t.elapsed() < Duration::from_secs(120),
            "the pool did not fill"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let fill = t.elapsed();
    let fill_cpu = cpu_seconds() - cpu;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let held = before.saturating_sub(mem_available());
    let home = dir.path().join("pool");
    // A box's member is its agent; a VM's is QEMU (the guest's memory is QEMU's).
    let members = if vm {
        qemu_pids()
    } else {
        crate::bench_native::agents_in(&home)
    };
    let agents: u64 = members.iter().map(|pid| pss(*pid)).sum();

    let sandboxes = dir.path().join("sandboxes");
    std::fs::create_dir_all(&sandboxes)?;
    let mut request = kiln_core::ExecRequest::new(kiln_core::Language::Bash, String::new());
    request.template = Some(id.clone());
    request.resources = backend
        .templates()
        .iter()
        .find(|t| t.id == id)
        .and_then(|t| t.resources);
    request.limits.memory_bytes = request.resources.map_or(512, |r| r.memory_mb) << 20;
    let (mut claims, mut firsts, mut destroys) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..(n / 4).clamp(10, 40) {
        while ready(&backend) == 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let t = Instant::now();
        let claimed = ProcessHost::prestarted(&backend, &request)
            .await?
            .context("the pool served no member")?;
        let claim = t.elapsed();
        // What a sandbox's store does: the member's folder becomes the sandbox's.
        let folder = sandboxes.join(format!("sb_{i}"));
        std::fs::rename(&claimed.dir, &folder)?;
        let mut first = request.clone();
        first.workspace = Some(folder.join("volume").join("workspace"));
        ProcessHost::adopt(&backend, claimed, &first).await;
        first.command = Some(kiln_core::Command {
            argv: vec!["true".into()],
            cwd: None,
            terminal: None,
        });
        let ran = backend.run_once(&first, None).await?;
        let to_first = t.elapsed();
        anyhow::ensure!(ran.exit_code == 0, "true failed: {ran:?}");
        let live = backend
            .live_box(first.workspace.as_deref().context("workspace")?)
            .await
            .context("no box")?;
        let t = Instant::now();
        live.destroy_now().await;
        destroys.push(micros(t.elapsed()));
        drop(live);
        kiln_runtime::volume::detach(&folder.join("volume"))?;
        std::fs::remove_dir_all(&folder)?;
        claims.push(micros(claim));
        firsts.push(micros(to_first));
    }
    let stats: Vec<_> = backend
        .pool_stats()
        .into_iter()
        .filter(|p| p.template == id)
        .collect();
    backend.close_all().await;
    let mib = |bytes: f64| (bytes / 1048576.0 * 100.0).round() / 100.0;
    report.insert(
        if vm { "native_vm_pool" } else { "native_pool" }.into(),
        json!({
            "members": size,
            "fill_s": (fill.as_secs_f64() * 1000.0).round() / 1000.0,
            "replenish_per_s": ((size as f64 / fill.as_secs_f64()) * 10.0).round() / 10.0,
            "cpu_s_per_member": ((fill_cpu / size as f64) * 1000.0).round() / 1000.0,
            "starts_at_once": settings.at_once,
            "host_memory_per_member_mib": mib(held as f64 / size as f64),
            "pss_per_member_mib": mib(agents as f64 / members.len().max(1) as f64),
            "claim": summary(claims),
            "claim_to_first_command": summary(firsts),
            "destroy": summary(destroys),
            "boot_mean_ms": stats.first().map_or(0.0, |p| (p.boot.mean() * 1e4).round() / 10.0),
        }),
    );
    Ok(())
}

/// The host pids of the QEMUs running now (the bench's own pool members, when it measures
/// them).
fn qemu_pids() -> Vec<i32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.starts_with(b"/usr/bin/qemu-system-x86_64"))
        })
        .collect()
}

/// The python template on another tier (a microVM, a gVisor box): starting it until its
/// agent answers (a VM's first boots cold and is snapshotted, the rest are clones),
/// `python3 -c 'print(1)'` in it (beside `native_python`, the same in a runc box), and
/// closing it.
async fn tier_python(
    boxes: &Boxes,
    spec: &BoxSpec,
    template: kiln_native::builder::Template,
    name: &str,
    report: &mut Report,
) -> anyhow::Result<()> {
    let vm = template.vm;
    let spec = BoxSpec {
        template,
        ..spec.clone()
    };
    let (mut boots, mut pythons, mut closes) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..3 {
        let t = Instant::now();
        let live = boxes.open(spec.clone()).await?;
        boots.push(micros(t.elapsed()));
        for _ in 0..5 {
            pythons.push(micros(
                run_ok(&live, &["python3", "-c", "print(1)"], "1\n").await?,
            ));
        }
        let t = Instant::now();
        live.close().await;
        closes.push(micros(t.elapsed()));
    }
    let mut figures = json!({
        "boot_to_agent": summary(boots),
        "python": summary(pythons),
        "close": summary(closes),
    });
    if vm {
        figures["accel"] = json!(boxes.vm_tier().map_or("none", |t| t.accel.name()));
    }
    report.insert(name.into(), figures);
    Ok(())
}

/// The host pids of the guest agents of boxes whose writable layer is under `folder`.
pub(crate) fn agents_in(folder: &std::path::Path) -> Vec<i32> {
    let needle = format!("upperdir={}", folder.display());
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.starts_with(b"/.kiln/agent"))
                && std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
                    .is_ok_and(|m| m.lines().any(|l| l.contains(&needle)))
        })
        .collect()
}

/// A Linux sandbox's workspace volume (1 GiB): made and mounted at create, unmounted and
/// removed at delete.
fn volumes(n: usize, report: &mut Report) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (mut attaches, mut removes) = (Vec::new(), Vec::new());
    for i in 0..(n / 4).clamp(10, 50) {
        let point = dir.path().join(format!("v{i}"));
        let t = Instant::now();
        kiln_runtime::volume::attach(&point, 1 << 30)?;
        attaches.push(micros(t.elapsed()));
        let t = Instant::now();
        kiln_runtime::volume::detach(&point)?;
        std::fs::remove_dir_all(&point)?;
        std::fs::remove_file(kiln_runtime::volume::image_of(&point))?;
        removes.push(micros(t.elapsed()));
    }
    report.insert("native_volume_create".into(), summary(attaches));
    report.insert("native_volume_remove".into(), summary(removes));
    Ok(())
}

/// Creating a box (until its agent answers) and closing it.
async fn create_and_close(
    boxes: &Boxes,
    spec: &BoxSpec,
    n: usize,
    report: &mut Report,
) -> anyhow::Result<()> {
    let (mut creates, mut closes) = (Vec::new(), Vec::new());
    for i in 0..(n / 4).clamp(10, 50) + 2 {
        let t = Instant::now();
        let live = boxes.open(spec.clone()).await?;
        let created = t.elapsed();
        let t = Instant::now();
        live.close().await;
        if i >= 2 {
            creates.push(micros(created));
            closes.push(micros(t.elapsed()));
        }
    }
    report.insert("native_create".into(), summary(creates));
    report.insert("native_close".into(), summary(closes));
    Ok(())
}

/// `echo hi` and `python3 -c 'print(1)'` in a live box.
async fn commands(
    boxes: &Boxes,
    spec: &BoxSpec,
    n: usize,
    report: &mut Report,
) -> anyhow::Result<()> {
    let live = boxes.open(spec.clone()).await?;
    let mut echo = Vec::new();
    for i in 0..n + 5 {
        let took = run_ok(&live, &["echo", "hi"], "hi\n").await?;
        if i >= 5 {
            echo.push(micros(took));
        }
    }
    report.insert("native_echo".into(), summary(echo));
    let mut python = Vec::new();
    for i in 0..(n / 4).max(10) + 3 {
        let took = run_ok(&live, &["python3", "-c", "print(1)"], "1\n").await?;
        if i >= 3 {
            python.push(micros(took));
        }
    }
    report.insert("native_python".into(), summary(python));
    // Pause (the cgroup frozen) and resume of a box running a dev server.
    let server = Exec::new(
        ["sh", "-c", "python3 -m http.server 8000 >/dev/null 2>&1 &"]
            .iter()
            .map(|s| s.to_string())
            .collect(),
    );
    live.exec(server, |_, _| {}).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (mut pauses, mut resumes) = (Vec::new(), Vec::new());
    for i in 0..n.clamp(10, 200) + 3 {
        let t = Instant::now();
        live.set_paused(true).await?;
        let paused = t.elapsed();
        anyhow::ensure!(live.is_paused(), "the box did not freeze");
        let t = Instant::now();
        live.set_paused(false).await?;
        if i >= 3 {
            pauses.push(micros(paused));
            resumes.push(micros(t.elapsed()));
        }
    }
    run_ok(&live, &["echo", "hi"], "hi\n").await?;
    report.insert("native_pause".into(), summary(pauses));
    report.insert("native_resume".into(), summary(resumes));
    previews(&live, n, report).await?;
    live.close().await;
    Ok(())
}

/// Host memory per idle box (MemAvailable's drop, which counts the kernel's share too) and
/// the agents' proportional set size.
async fn idle_boxes(
    boxes: &Boxes,
    spec: &BoxSpec,
    idle: usize,
    report: &mut Report,
) -> anyhow::Result<()> {
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = mem_available();
    let mut open = Vec::new();
    for _ in 0..idle {
        open.push(boxes.open(spec.clone()).await?);
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after = mem_available();
    let agents: u64 = open.iter().map(|b| pss(b.host_pid)).sum();
    // The same boxes paused: what freezing costs beyond what they hold.
    let t = Instant::now();
    for live in &open {
        live.set_paused(true).await?;
    }
    let pause_all = t.elapsed();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let paused = mem_available();
    let charged: u64 = open.iter().map(|b| b.memory_bytes()).sum();
    for live in &open {
        live.set_paused(false).await?;
    }
    let t = Instant::now();
    for live in open {
        live.close().await;
    }
    let close_all = t.elapsed();
    let per_box = before.saturating_sub(after) / idle.max(1) as u64;
    let mib = |bytes: f64| (bytes / 1048576.0 * 100.0).round() / 100.0;
    report.insert(
        "native_idle_boxes".into(),
        json!({
            "boxes": idle,
            "host_memory_per_box_mib": mib(per_box as f64),
            "agent_pss_per_box_mib": mib(agents as f64 / idle.max(1) as f64),
            "host_memory_per_paused_box_mib": mib(
                before.saturating_sub(paused) as f64 / idle.max(1) as f64
            ),
            "cgroup_memory_per_paused_box_mib": mib(charged as f64 / idle.max(1) as f64),
            "pause_all_s": (pause_all.as_secs_f64() * 100.0).round() / 100.0,
            "close_all_s": (close_all.as_secs_f64() * 100.0).round() / 100.0,
        }),
    );
    Ok(())
}

/// Whole processes: kiln exec in a fresh box, and plain python3 on the host.
fn processes(n: usize, report: &mut Report) -> anyhow::Result<()> {
    let exe = std::env::current_exe()?;
    let mut cli = Vec::new();
    let mut plain = Vec::new();
    for i in 0..(n / 10).max(10) + 2 {
        let t = Instant::now();
        let status = Command::new(&exe)
            .args([
                "exec",
                "--template",
                "python",
                "--",
                "python3",
                "-c",
                "print(1)",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .status()?;
        anyhow::ensure!(status.success(), "kiln exec --template failed: {status}");
        let took = t.elapsed();
        let t = Instant::now();
        let host = Command::new(if std::path::Path::new("/usr/bin/python3").exists() {
            "/usr/bin/python3"
        } else {
            "python3"
        })
        .args(["-c", "print(1)"])
        .stdout(Stdio::null())
        .status();
        let host_took = t.elapsed();
        if i >= 2 {
            cli.push(micros(took));
            if host.is_ok_and(|s| s.success()) {
                plain.push(micros(host_took));
            }
        }
    }
    report.insert("native_cli_exec_process".into(), summary(cli));
    if !plain.is_empty() {
        report.insert("host_python3_process".into(), summary(plain));
    }
    Ok(())
}

/// A preview's path without kiln's HTTP layer: a connection through the agent to the box's
/// `python3 -m http.server`, the first byte of a small page, and a 64 MiB file's rate.
async fn previews(live: &LiveBox, n: usize, report: &mut Report) -> anyhow::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let files = Exec::new(
        [
            "sh",
            "-c",
            "echo hello > small.html && head -c 67108864 /dev/zero > big.bin",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
    );
    live.exec(files, |_, _| {}).await?;
    // Written where the dev server started: the box's working dir.
    let get = |path: &str| format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n");
    let mut first = Vec::new();
    for i in 0..n.clamp(10, 200) + 3 {
        let t = Instant::now();
        let mut stream = live.connect(8000, ()).await?;
        stream.write_all(get("/small.html").as_bytes()).await?;
        let mut byte = [0u8; 1];
        anyhow::ensure!(stream.read(&mut byte).await? == 1, "no answer");
        if i >= 3 {
            first.push(micros(t.elapsed()));
        }
        let mut rest = Vec::new();
        stream.read_to_end(&mut rest).await?;
    }
    report.insert("native_preview_first_byte".into(), summary(first));
    let mut rates = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let mut stream = live.connect(8000, ()).await?;
        stream.write_all(get("/big.bin").as_bytes()).await?;
        let mut total = 0usize;
        let mut buf = vec![0u8; 256 << 10];
        loop {
            let got = stream.read(&mut buf).await?;
            if got == 0 {
                break;
            }
            total += got;
        }
        anyhow::ensure!(total > 64 << 20, "the large file came short: {total} bytes");
        rates.push(total as f64 / t.elapsed().as_secs_f64() / 1e6);
    }
    rates.sort_by(f64::total_cmp);
    report.insert(
        "native_preview_large_file".into(),
        json!({"mib": 64, "median_mb_s": (rates[rates.len() / 2] * 10.0).round() / 10.0}),
    );
    Ok(())
}
