//! `kiln doctor`: what this host can run, tier by tier, and why not where it cannot —
//! WebAssembly, Linux boxes under runc, under gVisor, hibernation with CRIU, and what
//! virtualisation there is for microVMs. Read-only: it starts no box and changes nothing.

use std::path::Path;
use std::process::{Command, ExitCode, Stdio};

use crate::cli::LinuxArgs;

/// One finding.
#[derive(Debug, serde::Serialize)]
pub struct Check {
    /// What was checked (`webassembly`, `linux-runc`, …).
    pub name: &'static str,
    /// `ok`, `warn` (works, with a caveat) or `no`.
    pub status: &'static str,
    pub detail: String,
}

fn check(name: &'static str, status: &'static str, detail: impl Into<String>) -> Check {
    Check {
        name,
        status,
        detail: detail.into(),
    }
}

/// The first line a command prints (stdout, else stderr), if it runs and succeeds.
fn first_line(program: &Path, args: &[&str]) -> Result<String, String> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{} does not run: {e}", program.display()))?;
    let text = if out.stdout.is_empty() {
        out.stderr
    } else {
        out.stdout
    };
    let line = String::from_utf8_lossy(&text)
        .lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim()
        .to_string();
    if out.status.success() {
        Ok(line)
    } else {
        Err(format!("{} failed: {line}", program.display()))
    }
}

pub fn on_path(name: &str) -> Option<std::path::PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// Every check, in order.
pub fn checks(linux: &LinuxArgs) -> Vec<Check> {
    let mut found = Vec::new();
    // WebAssembly: built in; its runtimes are fetched once into the cache.
    let cache = crate::cache::dir();
    let missing: Vec<&str> = [
        ("python", &kiln_wasm::setup::PYTHON),
        ("javascript", &kiln_wasm::setup::JAVASCRIPT),
    ]
    .into_iter()
    .filter(|(_, spec)| !cache.is_installed(spec))
    .map(|(name, _)| name)
    .collect();
    found.push(if missing.is_empty() {
        check(
            "webassembly",
            "ok",
            format!("python and javascript, runtimes in {}", cache.root().display()),
        )
    } else {
        check(
            "webassembly",
            "warn",
            format!(
                "runs anywhere; {} not fetched yet (kiln setup fetches them, or the first run does)",
                missing.join(" and ")
            ),
        )
    });

    // Linux boxes: root, user namespaces, cgroups, runc, the agent, the templates.
    // SAFETY: geteuid(2) takes no arguments, touches no memory of ours and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    let userns = std::fs::read_to_string("/proc/sys/user/max_user_namespaces")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(0);
    let cgroups = kiln_native::jail::Cgroups::detect();
    let runc = first_line(&linux.container_runtime, &["--version"]);
    let agent = kiln_native::find_agent();
    let templates = match crate::linux_cmd::definitions(linux) {
        Ok(definitions) => {
            let store = crate::linux_cmd::store(linux);
            let (built, not): (Vec<_>, Vec<_>) =
                definitions.iter().partition(|d| store.find(d).is_some());
            (
                built.iter().map(|d| d.name.clone()).collect::<Vec<_>>(),
                not.iter().map(|d| d.name.clone()).collect::<Vec<_>>(),
            )
        }
        Err(_) => (Vec::new(), Vec::new()),
    };
    let mut why_not = Vec::new();
    if !root {
        why_not.push(
            "kiln is not running as root (boxes map onto an unprivileged uid range)".to_string(),
        );
    }
    if userns == 0 {
        why_not
            .push("user namespaces are off (/proc/sys/user/max_user_namespaces is 0)".to_string());
    }
    if let Err(e) = &runc {
        why_not.push(format!("{e} (apt-get install runc)"));
    }
    if agent.is_none() {
        why_not.push("the guest agent is not built (scripts/build-guest)".to_string());
    }
    if templates.0.is_empty() {
        why_not.push("no template is built (kiln setup --template all, as root)".to_string());
    }
    found.push(if why_not.is_empty() {
        check(
            "linux-runc",
            "ok",
            format!(
                "{}; cgroups {}; templates built: {}{}",
                runc.as_deref().unwrap_or_default(),
                cgroups.as_str(),
                templates.0.join(", "),
                if templates.1.is_empty() {
                    String::new()
                } else {
                    format!(" (not built: {})", templates.1.join(", "))
                }
            ),
        )
    } else {
        check("linux-runc", "no", why_not.join("; "))
    });

    // gVisor: runsc, for boxes under a user-space kernel.
    let runsc = on_path("runsc").map(|p| first_line(&p, &["--version"]));
    found.push(match runsc {
        Some(Ok(version)) => check(
            "linux-gvisor",
            if why_not.is_empty() { "ok" } else { "warn" },
            format!(
                "{version}; --box-runtime runsc, --gvisor (gvisor-NAME templates) or a template's box_runtime: runsc (platform {}){}",
                std::env::var("KILN_RUNSC_PLATFORM").unwrap_or_else(|_| "ptrace".into()),
                if why_not.is_empty() {
                    String::new()
                } else {
                    " — but Linux boxes cannot run here (see linux-runc)".to_string()
                }
            ),
        ),
        Some(Err(e)) => check("linux-gvisor", "no", e),
        None => check(
            "linux-gvisor",
            "no",
            "runsc is not installed (apt-get install runsc)",
        ),
    });

    // Hibernation with process checkpoints.
    found.push(match crate::linux_cmd::criu(linux) {
        None => check(
            "criu",
            "no",
            "no CRIU: hibernation keeps files only (scripts/build-criu builds one)",
        ),
        Some(path) => match first_line(&path, &["check"]) {
            Ok(said) => check(
                "criu",
                "ok",
                format!("{} passes `criu check` ({said})", path.display()),
            ),
            Err(e) => check(
                "criu",
                "no",
                format!("{e}: hibernation keeps files only (scripts/build-criu builds a CRIU that works on current kernels)"),
            ),
        },
    });

    // Virtualisation, for microVMs.
    let kvm = Path::new("/dev/kvm").exists();
    let pvm = Path::new("/sys/module/kvm_pvm").exists();
    let hardware = std::fs::read_to_string("/proc/cpuinfo")
        .map(|c| {
            c.lines()
                .filter(|l| l.starts_with("flags"))
                .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"))
        })
        .unwrap_or(false);
    found.push(match (kvm, pvm, hardware) {
        (true, _, true) => check("kvm", "ok", "/dev/kvm with hardware virtualisation (VT-x/AMD-V)"),
        (true, true, false) => check(
            "kvm",
            "warn",
            "/dev/kvm is PVM, a software virtualiser: stock guest kernels do not run under it; microVMs would run under QEMU's TCG (slower)",
        ),
        (true, false, false) => check(
            "kvm",
            "warn",
            "/dev/kvm without VT-x/AMD-V flags (nested or emulated): microVMs may not run",
        ),
        (false, _, _) => check("kvm", "no", "no /dev/kvm: microVMs would run under QEMU's TCG only"),
    });
    found.push(warm_pool(linux));
    found.push(microvm(linux));
    found
}

/// The checks as `/readyz` reports them: each with whether this server runs sandboxes on
/// it (`linux`: it serves `--linux`, under runc or runsc as `--box-runtime` says).
pub fn tiers(linux: &LinuxArgs, serves_linux: bool) -> Vec<kiln_server::api::Tier> {
    let gvisor = kiln_native::boxes::is_gvisor(&linux.container_runtime);
    checks(linux)
        .into_iter()
        .map(|c| kiln_server::api::Tier {
            served: match c.name {
                "webassembly" => true,
                "linux-runc" => serves_linux && !gvisor,
                "linux-gvisor" => serves_linux && (gvisor || linux.gvisor),
                "criu" => serves_linux && !gvisor && c.status == "ok",
                "warm-pool" => serves_linux && c.status == "ok",
                "microvm" => serves_linux && linux.vm && c.status != "no",
                _ => false,
            },
            name: c.name.to_string(),
            status: c.status.to_string(),
            detail: c.detail,
        })
        .collect()
}

/// `kiln doctor [--json]`: prints the checks; exits 0 (it reports, it does not judge).
pub fn run(linux: &LinuxArgs, json: bool) -> anyhow::Result<ExitCode> {
    let found = checks(linux);
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({ "checks": found }))?
        );
    } else {
        for c in &found {
            println!("{:<5} {:<13} {}", c.status, c.name, c.detail);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// What the warm pools of `kiln serve --linux` with these settings keep (the live figures are
/// on the server's `/metrics`, `kiln_pool_*`).
fn warm_pool(linux: &LinuxArgs) -> Check {
    let settings = match crate::linux_cmd::pool_settings(linux, Path::new("/")) {
        Ok(settings) => settings,
        Err(e) => {
            return check(
                "warm-pool",
                "no",
                format!("the pool settings are refused: {e}"),
            );
        }
    };
    let definitions = crate::linux_cmd::definitions(linux).unwrap_or_default();
    let pools: Vec<String> = definitions
        .iter()
        .filter_map(|d| {
            let config = settings.for_template(&d.name, &d.languages, d.pool.as_ref());
            (config.target > 0).then(|| {
                format!(
                    "{} {} ready (at most {}, {}, claims wait {:?})",
                    kiln_native::backend::catalogue_id(&d.name),
                    config.target,
                    config.max,
                    config.policy.name(),
                    config.claim_timeout
                )
            })
        })
        .collect();
    if pools.is_empty() {
        return check(
            "warm-pool",
            "warn",
            "no warm pool (every pool is sized 0): a Linux sandbox's box starts on its first command",
        );
    }
    check(
        "warm-pool",
        "ok",
        format!(
            "boxes started ahead for new Linux sandboxes, {} at a time: {}; live figures on /metrics (kiln_pool_*)",
            settings.at_once,
            pools.join("; ")
        ),
    )
}

/// The microVM tier: QEMU, the kernel scripts/build-vm fetches, and how VMs would be
/// accelerated (KVM, or TCG and why).
fn microvm(linux: &LinuxArgs) -> Check {
    let cache = crate::cache::dir();
    let qemu = kiln_native::vm::find_qemu();
    let assets = kiln_native::vm::VmAssets::find(cache.root());
    let firecracker = on_path("firecracker").map_or(
        "; no Firecracker on PATH (--vmm firecracker)".to_string(),
        |p| {
            let (accel, why) = kiln_native::vm::accel();
            format!(
                "; Firecracker at {}: --vmm firecracker{}",
                p.display(),
                if accel == kiln_native::vm::Accel::Kvm {
                    " (its VMs have no workspace: it shares no folders)".to_string()
                } else {
                    format!(" cannot run here ({why})")
                }
            )
        },
    );
    match (qemu, assets) {
        (None, _) => check(
            "microvm",
            "no",
            format!("no QEMU (apt-get install qemu-system-x86){firecracker}"),
        ),
        (Some(_), Err(e)) => check("microvm", "no", format!("{e}{firecracker}")),
        (Some(qemu), Ok(assets)) => {
            let (accel, why) = kiln_native::vm::accel();
            check(
                "microvm",
                if accel == kiln_native::vm::Accel::Kvm {
                    "ok"
                } else {
                    "warn"
                },
                format!(
                    "QEMU {} (microvm), kernel {}; under {why}; `kiln serve --linux --vm` offers vm-* templates{}{firecracker}",
                    qemu.display(),
                    assets.kernel,
                    if linux.vm { " (asked: --vm)" } else { "" }
                ),
            )
        }
    }
}
