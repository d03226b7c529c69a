//! `kiln setup --template` and `kiln exec --template`: Linux templates and boxes from the
//! terminal.

use std::io::{IsTerminal, Read, Write};
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};
use kiln_native::boxes::{BoxSpec, Boxes, BoxesConfig, Exec};
use kiln_native::builder::{Store, Template};
use kiln_native::jail::BoxLimits;
use kiln_native::template::Definition;

use crate::cli::{ExecArgs, LinuxArgs};

/// The template store in kiln's cache folder.
pub fn store(linux: &LinuxArgs) -> Store {
    Store {
        root: crate::cache::dir().root().join("templates"),
        mirror: linux
            .debian_mirror
            .clone()
            .unwrap_or_else(Store::host_mirror),
        uid_base: linux.uid_base,
    }
}

/// Every template definition: the shipped ones and the operator's folder.
pub fn definitions(linux: &LinuxArgs) -> anyhow::Result<Vec<Definition>> {
    Ok(kiln_native::template::load(linux.templates_dir.as_deref())?)
}

fn definition(linux: &LinuxArgs, name: &str) -> anyhow::Result<Definition> {
    let all = definitions(linux)?;
    let names: Vec<String> = all.iter().map(|d| d.name.clone()).collect();
    all.into_iter().find(|d| d.name == name).with_context(|| {
        format!(
            "no Linux template is named {name:?}; defined: {}",
            names.join(", ")
        )
    })
}

/// The names boxes with `network: allowlist` may reach (and the private ranges those names
/// may lead to, where the operator lists any).
pub fn allowlist(linux: &LinuxArgs) -> anyhow::Result<kiln_native::proxy::Allowlist> {
    let names: Vec<String> = if linux.network_allow.is_empty() {
        kiln_native::proxy::DEFAULT_NAMES
            .iter()
            .map(|s| s.to_string())
            .collect()
    } else {
        linux.network_allow.clone()
    };
    kiln_native::proxy::Allowlist::new(&names).map_err(|e| anyhow::anyhow!("--network-allow: {e}"))
}

/// The CA bundle bound over boxes' own: `--box-ca-bundle FILE`, none with
/// `--box-ca-bundle none`, and by default the host's (`SSL_CERT_FILE`, else the first of the
/// usual places that exists), so boxes trust what the host trusts.
pub fn box_ca_bundle(linux: &LinuxArgs) -> anyhow::Result<Option<std::path::PathBuf>> {
    match &linux.box_ca_bundle {
        Some(path) if path.as_os_str() == "none" || path.as_os_str().is_empty() => Ok(None),
        Some(path) => {
            let file = std::fs::metadata(path)
                .with_context(|| format!("--box-ca-bundle {}", path.display()))?;
            anyhow::ensure!(
                file.is_file(),
                "--box-ca-bundle {}: not a file",
                path.display()
            );
            Ok(Some(path.canonicalize()?))
        }
        None => Ok(kiln_native::boxes::host_ca_bundle()),
    }
}

/// The live boxes of this process.
pub fn boxes(linux: &LinuxArgs) -> anyhow::Result<Boxes> {
    let agent = kiln_native::find_agent().context(
        "the guest agent is not built: run scripts/build-guest (or set KILN_GUEST to a static kiln-guest)",
    )?;
    let vm = if linux.vm {
        anyhow::ensure!(
            !kiln_native::boxes::is_gvisor(&linux.container_runtime)
                || crate::doctor::on_path("runc").is_some(),
            "--vm runs QEMU in runc's jail, and runc is not installed (apt-get install runc)"
        );
        let tier = kiln_native::vm::VmTier::new(
            crate::cache::dir().root(),
            &agent,
            &linux.state_dir,
            &linux.vmm,
        )
        .map_err(|e| anyhow::anyhow!("--vm: {e}"))?;
        eprintln!(
            "kiln: microVMs run under {} ({} {}, kernel {})",
            tier.accel_why,
            tier.vmm.name(),
            tier.vmm.binary().display(),
            tier.assets.kernel
        );
        Some(std::sync::Arc::new(tier))
    } else {
        None
    };
    Ok(Boxes::new(BoxesConfig {
        state_dir: linux.state_dir.clone(),
        agent,
        runtime: linux.container_runtime.clone(),
        alternate: crate::doctor::on_path(
            if kiln_native::boxes::is_gvisor(&linux.container_runtime) {
                "runc"
            } else {
                "runsc"
            },
        ),
        uid_base: linux.uid_base,
        criu: criu(linux),
        vm,
        gvisor: linux.gvisor,
    })?)
}

/// The CRIU boxes are checkpointed with: `--criu` (`none`: no checkpoints), else the one
/// scripts/build-criu builds into kiln's cache, else `criu` on PATH.
pub fn criu(linux: &LinuxArgs) -> Option<std::path::PathBuf> {
    match &linux.criu {
        Some(path) if path.as_os_str() == "none" || path.as_os_str().is_empty() => None,
        Some(path) => Some(path.clone()),
        None => {
            let built = crate::cache::dir().root().join("tools/criu/criu");
            if built.is_file() {
                return Some(built);
            }
            std::env::var_os("PATH").and_then(|paths| {
                std::env::split_paths(&paths)
                    .map(|dir| dir.join("criu"))
                    .find(|p| p.is_file())
            })
        }
    }
}

/// The Linux backend of `kiln serve --linux`: every built template (those not built are
/// left out, said on stderr).
pub fn backend(
    linux: &LinuxArgs,
    data_dir: &std::path::Path,
) -> anyhow::Result<kiln_native::backend::NativeBackend> {
    let store = store(linux);
    let mut templates = Vec::new();
    let mut unbuilt = Vec::new();
    for definition in definitions(linux)? {
        match store.find(&definition) {
            Some(template) => templates.push(template),
            None => {
                eprintln!(
                    "kiln: the Linux template {0} is not built and is left out (kiln setup --template {0})",
                    definition.name
                );
                unbuilt.push(definition.name);
            }
        }
    }
    anyhow::ensure!(
        !templates.is_empty(),
        "--linux: no Linux template is built; run kiln setup --template all (as root)"
    );
    let (ca_bundle, egress_tls) = egress_tls(linux, data_dir)?;
    let backend = kiln_native::backend::NativeBackend::new(
        boxes(linux)?,
        templates,
        std::sync::Arc::new(allowlist(linux)?),
        ca_bundle,
        &pool_settings(linux, data_dir)?,
    )
    .with_unbuilt(unbuilt);
    Ok(match egress_tls {
        Some(tls) => backend.with_egress_tls(tls),
        None => backend,
    })
}

/// The boxes' CA bundle, and the CA that opens HTTPS for sandboxes' header rules: the
/// host's bundle (or `--box-ca-bundle`) with the CA appended, written to the data
/// directory at each start. Without a bundle for boxes there is no CA: HTTPS to a host
/// with rules is then refused, saying why.
fn egress_tls(
    linux: &LinuxArgs,
    data_dir: &std::path::Path,
) -> anyhow::Result<(
    Option<std::path::PathBuf>,
    Option<std::sync::Arc<kiln_native::intercept::Interceptor>>,
)> {
    let Some(host_bundle) = box_ca_bundle(linux)? else {
        return Ok((None, None));
    };
    let tls = kiln_native::intercept::Interceptor::new(Some(&host_bundle))
        .map_err(|e| anyhow::anyhow!("the egress CA: {e}"))?;
    let bundle = data_dir.join("egress").join("ca-bundle.pem");
    tls.write_bundle(Some(&host_bundle), &bundle)
        .with_context(|| format!("writing the boxes' CA bundle {}", bundle.display()))?;
    Ok((Some(bundle), Some(std::sync::Arc::new(tls))))
}

/// The warm pools' settings from the flags (a template's own `pool:` fills what they leave).
pub fn pool_settings(
    linux: &LinuxArgs,
    data_dir: &std::path::Path,
) -> anyhow::Result<kiln_native::pool::PoolSettings> {
    let defaults = kiln_core::pool::PoolDefinition {
        target_pool_size: linux.target_pool_size,
        max_vms: linux.max_vms,
        empty_pool_policy: linux
            .empty_pool_policy
            .as_deref()
            .and_then(kiln_core::pool::EmptyPoolPolicy::parse),
        claim_timeout_seconds: linux.claim_timeout_seconds,
    };
    defaults
        .check()
        .map_err(|e| anyhow::anyhow!("{}", e.replace("pool: ", "")))?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    Ok(kiln_native::pool::PoolSettings {
        defaults,
        sizes: linux.language_pools.iter().cloned().collect(),
        at_once: linux.pool_starts.unwrap_or(cores / 2).max(1),
        // Beside the sandboxes' folders, so a claimed member's is renamed into place.
        home: Some(data_dir.join("pool")),
        volume: Some(std::sync::Arc::new(|at: &std::path::Path, bytes: u64| {
            kiln_runtime::volume::attach(at, bytes)
        })),
    })
}

/// An executor pool serving the Linux backend in this process (it holds the boxes' agent
/// channels; the boxes themselves are separate, jailed processes).
pub fn pool_config(backend: kiln_native::backend::NativeBackend) -> kiln_executor::PoolConfig {
    let mut config = kiln_executor::PoolConfig::new("in-process".into(), Vec::new());
    config.workers = 1;
    config.in_process = Some(kiln_executor::InProcess(std::sync::Arc::new(
        move |stream| {
            let backend = backend.clone();
            Box::pin(async move {
                let (input, output) = tokio::io::split(stream);
                kiln_executor::worker::serve(backend, input, output).await;
            })
        },
    )));
    config
}

/// A build's progress: a spinner with the step and the tool's last line on a terminal,
/// one line per step otherwise.
struct BuildProgress {
    name: String,
    bar: Mutex<Option<ProgressBar>>,
}

impl BuildProgress {
    fn new(name: &str) -> BuildProgress {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new_spinner();
            bar.set_style(
                ProgressStyle::with_template("{spinner:.cyan} {prefix} {wide_msg} [{elapsed}]")
                    .unwrap_or_else(|_| ProgressStyle::default_spinner()),
            );
            bar.enable_steady_tick(Duration::from_millis(120));
            bar
        });
        BuildProgress {
            name: name.to_string(),
            bar: Mutex::new(bar),
        }
    }

    fn finish(&self, message: &str) {
        match self.bar.lock().unwrap_or_else(|e| e.into_inner()).take() {
            Some(bar) => bar.finish_with_message(message.to_string()),
            None => eprintln!("kiln: {message}"),
        }
    }
}

impl kiln_native::builder::Progress for BuildProgress {
    fn step(&self, index: usize, total: usize, step: &str) {
        let prefix = format!(
            "building the {} template [{index}/{total}] {step}",
            self.name
        );
        match &*self.bar.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(bar) => {
                bar.set_prefix(prefix);
                bar.set_message("");
            }
            None => eprintln!("kiln: {prefix}"),
        }
    }

    fn line(&self, line: &str) {
        if let Some(bar) = &*self.bar.lock().unwrap_or_else(|e| e.into_inner()) {
            bar.set_message(line.chars().take(100).collect::<String>());
        }
    }
}

fn ensure(
    store: &Store,
    definition: &Definition,
    rebuild: bool,
    linux: &LinuxArgs,
) -> anyhow::Result<Template> {
    if !rebuild && let Some(template) = store.find(definition) {
        return Ok(template);
    }
    // SAFETY: geteuid(2) takes no arguments, touches no memory of ours and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "building the {} template needs root (debootstrap, the uid shift and the box it is built in)",
            definition.name
        );
    }
    let (boxes, allow) = (boxes(linux)?, allowlist(linux)?);
    let jail = kiln_native::builder::Jail {
        boxes: &boxes,
        allow: &allow,
    };
    let progress = BuildProgress::new(&definition.name);
    match store.build(definition, jail, &progress) {
        Ok(template) => {
            progress.finish(&format!(
                "✓ {} template built in {:.0} s ({} MiB)",
                definition.name,
                template.built.build_seconds,
                template.built.size_bytes >> 20
            ));
            Ok(template)
        }
        Err(e) => {
            progress.finish(&format!("✗ {} template", definition.name));
            Err(e.into())
        }
    }
}

/// `kiln setup --template NAME…`.
pub fn setup(names: &[String], rebuild: bool, linux: &LinuxArgs) -> anyhow::Result<ExitCode> {
    let store = store(linux);
    let wanted: Vec<Definition> = if names.iter().any(|n| n == "all") {
        definitions(linux)?
    } else {
        names
            .iter()
            .map(|name| definition(linux, name))
            .collect::<anyhow::Result<_>>()?
    };
    for definition in &wanted {
        let template = ensure(&store, definition, rebuild, linux)?;
        eprintln!(
            "kiln: template {} ready: {} ({})",
            definition.name,
            template.rootfs.display(),
            template.built.versions_line()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The argv that runs `code` in a template's default language.
fn code_argv(definition: &Definition, args: &ExecArgs, code: &str) -> anyhow::Result<Vec<String>> {
    let language = match args.lang {
        Some(language) => language.name().to_string(),
        None => definition
            .languages
            .first()
            .cloned()
            .unwrap_or_else(|| "bash".into()),
    };
    let argv: Vec<&str> = match language.as_str() {
        "python" => vec!["python3", "-c", code],
        "javascript" => vec!["node", "-e", code],
        "bash" => vec!["bash", "-c", code],
        "go" => {
            bail!("Go code needs a file: put main.go in a --workspace and run `-- go run main.go`")
        }
        other => bail!("the {} template does not run {other} code", definition.name),
    };
    Ok(argv.into_iter().map(String::from).collect())
}

/// `kiln exec --template NAME -- COMMAND…` (or `-c CODE`): one command in a fresh box.
pub fn exec(args: &ExecArgs) -> anyhow::Result<ExitCode> {
    let name = args.template.as_deref().unwrap_or_default();
    let definition = definition(&args.linux, name)?;
    let argv = match (&args.code, args.command.is_empty()) {
        (Some(_), false) => bail!("give a command after -- or code with -c, not both"),
        (Some(code), true) => code_argv(&definition, args, code)?,
        (None, false) => args.command.clone(),
        (None, true) => bail!("nothing to run: give a command after -- or code with -c"),
    };
    if !args.mounts.is_empty() {
        bail!("--mount is not supported in Linux boxes yet; use --workspace");
    }
    let exec = exec_of(args, argv)?;
    let spec = box_spec(args, &definition)?;
    let boxes = boxes(&args.linux)?;
    let json = args.json;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let memory_bytes = spec.limits.memory_bytes;
    let output = runtime.block_on(async {
        let live = boxes.open(spec).await?;
        let result = live
            .exec(exec, |stderr, data| {
                if json {
                    return;
                }
                let _ = if stderr {
                    std::io::stderr().write_all(data)
                } else {
                    let mut out = std::io::stdout().lock();
                    out.write_all(data).and_then(|()| out.flush())
                };
            })
            .await;
        live.close().await;
        // Its removal finishes in the background: done before kiln exits.
        boxes.settled(Duration::from_secs(15)).await;
        anyhow::Ok(result?)
    })?;
    Ok(report(args, &definition.name, &output, memory_bytes))
}

/// The command to run, with the flags' environment, user, limits and stdin.
fn exec_of(args: &ExecArgs, argv: Vec<String>) -> anyhow::Result<Exec> {
    let mut exec = Exec::new(argv);
    exec.env = args.env_pairs()?;
    exec.root = args.root;
    exec.timeout = Duration::from_millis(exec_timeout(args));
    exec.max_output = args.max_output.unwrap_or(1 << 20) as usize;
    if !std::io::stdin().is_terminal() {
        std::io::stdin()
            .read_to_end(&mut exec.stdin)
            .context("reading stdin")?;
    }
    Ok(exec)
}

/// The box: the template (built first if needed), its resources (memory from --memory),
/// the workspace and the network.
fn box_spec(args: &ExecArgs, definition: &Definition) -> anyhow::Result<BoxSpec> {
    let mut template = ensure(&store(&args.linux), definition, false, &args.linux)?;
    template.vm = args.linux.vm;
    template.gvisor = args.linux.gvisor;
    anyhow::ensure!(
        !(template.vm && template.gvisor),
        "--vm and --gvisor are two tiers: a template runs as one or the other"
    );
    let resources = definition.resources;
    let limits = BoxLimits {
        memory_bytes: args.memory.unwrap_or(resources.memory_mb << 20),
        vcpus: resources.vcpus,
        pids: resources.pids,
        disk_bytes: resources.disk_mb << 20,
        weight: 100,
    };
    let workspace = match &args.workspace {
        Some(dir) => Some(
            dir.canonicalize()
                .with_context(|| format!("the workspace {}", dir.display()))?,
        ),
        None => None,
    };
    let network = match args.network.as_str() {
        "none" => None,
        "allowlist" => Some(kiln_native::proxy::LiveEgress::operator_only(
            std::sync::Arc::new(allowlist(&args.linux)?),
        )),
        other => bail!("--network is none or allowlist, not {other:?}"),
    };
    Ok(BoxSpec {
        workspace,
        network,
        ca_bundle: box_ca_bundle(&args.linux)?,
        ..BoxSpec::new(template, limits)
    })
}

/// Prints the JSON result if asked, says why a command was killed, and answers kiln's exit
/// code (the command's own, or 124 for the time limit, 125 for memory).
fn report(
    args: &ExecArgs,
    template: &str,
    output: &kiln_native::boxes::ExecOutput,
    memory_bytes: u64,
) -> ExitCode {
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "stdout": String::from_utf8_lossy(&output.stdout),
                "stderr": String::from_utf8_lossy(&output.stderr),
                "exit_code": output.exit_code,
                "signal": output.signal,
                "timed_out": output.timed_out,
                "oom_killed": output.oom_killed,
                "stdout_truncated": output.stdout_truncated,
                "stderr_truncated": output.stderr_truncated,
                "template": template,
            })
        );
    }
    if output.timed_out {
        eprintln!(
            "kiln: the command ran past its time limit ({} ms) and was killed",
            exec_timeout(args)
        );
        return ExitCode::from(crate::exit_codes::TIMED_OUT);
    }
    if output.oom_killed {
        eprintln!(
            "kiln: the command was killed for memory: the box's limit is {} MiB",
            memory_bytes >> 20
        );
        return ExitCode::from(crate::exit_codes::MEMORY_LIMIT);
    }
    ExitCode::from(match (output.exit_code, output.signal) {
        (Some(code), _) => (code & 0xff) as u8,
        (None, Some(signal)) => (128 + signal).min(255) as u8,
        (None, None) => crate::exit_codes::CRASHED,
    })
}

fn exec_timeout(args: &ExecArgs) -> u64 {
    args.timeout.unwrap_or(30_000)
}
