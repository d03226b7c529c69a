//! The `kiln` binary: glue between the command line and the engine.

mod backends;
mod bench;
#[cfg(feature = "bench-llm")]
mod bench_agent;
mod bench_child;
mod bench_fair;
mod bench_history;
mod bench_http;
mod bench_interactive;
mod bench_native;
mod bench_rest;
mod bench_runner;
mod bench_snapshots;
mod bench_warm;
mod bench_workspaces;
mod cache;
mod cli;
mod config;
mod doctor;
mod linux_cmd;
mod progress;
mod rest_cmd;
mod runner_cmd;

use std::io::{IsTerminal, Read, Write};
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::Parser;
use kiln_core::{ExecRequest, ExecResult, Language, Outcome};
use kiln_wasm::{OutputChunk, StreamKind, WasmEngine};

use crate::cli::{Cli, Command, ExecArgs, exit_codes};

fn main() -> ExitCode {
    no_error_backtraces();
    let (cli, file) = match parse() {
        Ok(parsed) => parsed,
        Err(error) => {
            eprintln!("kiln: {error:#}");
            return ExitCode::from(exit_codes::KILN_ERROR);
        }
    };
    init_logging(&cli);
    match run(cli, &file) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("kiln: {error:#}");
            ExitCode::from(exit_codes::KILN_ERROR)
        }
    }
}

/// Errors made in the guest's system calls (a file not found, a stream asked for its position)
/// are everyday results, and wasmtime makes each an error value that captures a backtrace
/// where `RUST_BACKTRACE` is set: about 50 µs each, on every `print` and every failed lookup
/// of a module. Unless `RUST_LIB_BACKTRACE` says otherwise, errors capture none; panics
/// still print theirs as `RUST_BACKTRACE` says.
fn no_error_backtraces() {
    if std::env::var_os("RUST_LIB_BACKTRACE").is_none() {
        // SAFETY: the first thing `main` does, before any thread of this process starts and
        // before anything reads the environment.
        unsafe { std::env::set_var("RUST_LIB_BACKTRACE", "0") };
    }
}

/// The command line, over the settings of the kiln.toml it names (none for a worker: its
/// pool passes everything it needs).
fn parse() -> anyhow::Result<(Cli, config::FileConfig)> {
    use clap::{CommandFactory, FromArgMatches};
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if args
        .get(1)
        .is_some_and(|a| a == "__worker" || a == "__jail-probe")
    {
        return Ok((Cli::parse(), config::FileConfig::default()));
    }
    let file = config::FileConfig::load(&args)?;
    let (command, _) = file.apply(Cli::command())?;
    let matches = command.try_get_matches_from(args).unwrap_or_else(|e| {
        use clap::error::{ContextKind, ErrorKind};
        let invalid = matches!(
            e.kind(),
            ErrorKind::InvalidValue | ErrorKind::ValueValidation
        );
        if let (true, Some(path), Some(flag)) =
            (invalid, &file.path, e.get(ContextKind::InvalidArg))
        {
            let _ = e.print();
            eprintln!("(the value of {flag} may come from {})", path.display());
            std::process::exit(2);
        }
        e.exit()
    });
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    Ok((cli, file))
}

/// Logs go to stderr. The server logs a line per request (JSON unless stderr is a terminal);
/// everything else only warnings. `KILN_LOG` overrides the filter (e.g. `debug`) in every
/// process, workers included; workers write the format their server was told to.
fn init_logging(cli: &Cli) {
    let (default, json) = match &cli.command {
        Command::Serve(args) => ("info", logs_json(args)),
        Command::Worker => (
            "warn",
            std::env::var("KILN_LOG_FORMAT").is_ok_and(|f| f.eq_ignore_ascii_case("json")),
        ),
        _ => ("warn", false),
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("KILN_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .init();
    } else {
        builder.init();
    }
}

/// Whether `kiln serve` (and so its workers) logs JSON lines.
fn logs_json(args: &cli::ServeArgs) -> bool {
    match args.log_format {
        Some(format) => format == cli::LogFormat::Json,
        None => !std::io::stderr().is_terminal(),
    }
}

fn data_dir(given: Option<std::path::PathBuf>) -> anyhow::Result<std::path::PathBuf> {
    match given {
        Some(dir) => Ok(dir),
        None => dirs::data_dir()
            .map(|d| d.join("kiln"))
            .context("no data directory; pass --data-dir"),
    }
}

/// `dir`, made if missing (a worker may write only folders that exist when it starts).
pub(crate) fn made_dir(dir: &std::path::Path) -> anyhow::Result<std::path::PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    Ok(dir.to_path_buf())
}

fn runtime(threads: usize) -> anyhow::Result<tokio::runtime::Runtime> {
    let mut builder = if threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(threads);
        b
    };
    builder
        .enable_all()
        .build()
        .context("starting the async runtime")
}

fn run(cli: Cli, file: &config::FileConfig) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Config { command } => {
            print!(
                "{}",
                config::show(file, <Cli as clap::CommandFactory>::command(), &command)?
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Exec(args)
            if args
                .template
                .as_deref()
                .is_some_and(|t| !is_wasm_template(t)) =>
        {
            linux_cmd::exec(&args)
        }
        Command::Exec(args) => {
            if !args.command.is_empty() {
                bail!(
                    "a command after `--` runs in a Linux box: add --template NAME (for a script's arguments, use `kiln run FILE -- ARG…`)"
                );
            }
            let code = args
                .code
                .clone()
                .context("nothing to run: pass code with -c")?;
            let language = args.lang.unwrap_or(Language::Python);
            exec(language, code, &args, None)
        }
        Command::Run { file, exec: args } => run_file(&file, &args),
        Command::Setup {
            templates,
            rebuild,
            linux,
            ..
        } if !templates.is_empty() => linux_cmd::setup(&templates, rebuild, &linux),
        Command::Setup {
            lang, fuel, prune, ..
        } => setup(lang, fuel, prune),
        Command::Bench(args) => bench::run(args),
        Command::Doctor { linux, json } => doctor::run(&linux, json),
        Command::Rest(args) => rest_cmd::run(args),
        Command::Runner(args) => runner_cmd::run(args),
        Command::Serve(args) => serve(*args),
        Command::Mcp {
            data_dir: dir,
            workers,
            default_python_template,
        } => mcp(dir, workers, default_python_template),
        Command::Keys {
            command,
            data_dir: dir,
        } => keys(command, &data_dir(dir)?),
        Command::Worker => worker(),
        Command::JailProbe => jail_probe(),
    }
}

/// `kiln run FILE`: the language from the extension unless `--lang` says.
fn run_file(file: &std::path::Path, args: &ExecArgs) -> anyhow::Result<ExitCode> {
    let language = match args.lang {
        Some(language) => language,
        None => Language::from_path(file).with_context(|| {
            format!(
                "cannot tell the language of {} from its extension (.py or .js); pass --lang",
                file.display()
            )
        })?,
    };
    if args
        .template
        .as_deref()
        .is_some_and(|t| !is_wasm_template(t))
    {
        bail!(
            "kiln run runs a file on WebAssembly; in a Linux box run it as a command: kiln exec --template NAME --workspace DIR -- python3 FILE"
        );
    }
    let code = std::fs::read(file).with_context(|| format!("cannot read {}", file.display()))?;
    let code = String::from_utf8(code)
        .map_err(|_| anyhow::anyhow!("{} is not UTF-8 text", file.display()))?;
    match language {
        Language::Python => {
            let (launcher, mount) = python_script(file, args)?;
            exec(language, launcher, args, mount)
        }
        _ if !args.command.is_empty() => {
            bail!("arguments after `--` are passed to Python scripts only")
        }
        _ => exec(language, code, args, None),
    }
}

/// `kiln run script.py -- ARG…` as CPython runs it: inside `--workspace` as its own path
/// there; elsewhere from its folder, granted read-only at `/script`. Either way its folder
/// comes first on `sys.path` (sibling modules import), with `__file__`, `sys.argv` and
/// `__name__ == "__main__"`.
fn python_script(
    file: &std::path::Path,
    args: &ExecArgs,
) -> anyhow::Result<(String, Option<kiln_core::Mount>)> {
    use kiln_runtime::exec::{PythonProgram, python_launcher};
    let path = file
        .canonicalize()
        .with_context(|| format!("cannot find {}", file.display()))?;
    if let Some(workspace) = &args.workspace {
        let workspace = workspace
            .canonicalize()
            .with_context(|| format!("the workspace {}", workspace.display()))?;
        if let Ok(inside) = path.strip_prefix(&workspace) {
            let inside = inside.to_str().context("the script's path is not UTF-8")?;
            let code = python_launcher(&PythonProgram::Script(inside), &args.command);
            return Ok((code, None));
        }
    }
    let folder = path.parent().context("the script has no folder")?;
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .context("the script's name is not UTF-8")?;
    let guest = format!("{SCRIPT_GUEST}/{name}");
    let code = python_launcher(&PythonProgram::Script(&guest), &args.command);
    let mount = kiln_core::Mount {
        host: folder.to_path_buf(),
        guest: SCRIPT_GUEST.into(),
        writable: false,
    };
    Ok((code, Some(mount)))
}

/// Where `kiln run` grants a script's folder (read-only) when it is not in the workspace.
const SCRIPT_GUEST: &str = "/script";

fn setup(lang: Option<Language>, fuel: bool, prune: bool) -> anyhow::Result<ExitCode> {
    let cache = crate::cache::dir();
    let progress = progress::Bar::new();
    let engine = WasmEngine::new(cache.clone())?;
    let languages = match lang {
        Some(language) => vec![language],
        None => Language::WASM.to_vec(),
    };
    for language in languages {
        engine.prepare(language, &progress)?;
        if fuel {
            engine.prepare_variant(language, true, &progress)?;
        }
        if language == Language::Python {
            engine.prepare_unprimed_python(&progress)?;
            // The python-data template's warm image, the engine its sessions start in, and
            // the primed module its one-shots start from.
            let warm_up = kiln_wasm::PYTHON_DATA_WARM_UP;
            runtime(1)?.block_on(engine.prepare_warm(warm_up, &progress))?;
            runtime(1)?.block_on(engine.prepare_warm_oneshots(warm_up, &progress))?;
        }
    }
    eprintln!("kiln: runtimes ready in {}", cache.root().display());
    let which = if prune {
        kiln_wasm::Prune::AllButUsed
    } else {
        kiln_wasm::Prune::Unused
    };
    let pruned = kiln_wasm::prune(&cache, which)?;
    if !pruned.files.is_empty() || prune {
        eprintln!(
            "kiln: removed {} unused compiled module(s) and image(s), {:.1} MB",
            pruned.files.len(),
            pruned.bytes as f64 / 1e6
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Fetches and compiles the runtimes here, once, before any worker needs them.
fn prepare_runtimes() -> anyhow::Result<()> {
    let setup = WasmEngine::with_options(
        crate::cache::dir(),
        &kiln_wasm::EngineOptions {
            max_instances: 1,
            ready_instances: 0,
            ..kiln_wasm::EngineOptions::default()
        },
    )?;
    for language in Language::WASM {
        setup.prepare(language, &progress::Bar::new())?;
    }
    // python-data's image is built in the background, so the server starts at once; a
    // python-data request that comes first waits for it on the cache's lock.
    let warm = std::thread::Builder::new()
        .name("kiln-warm-setup".into())
        .spawn(move || {
            let built = runtime(1).map_err(|e| e.to_string()).and_then(|rt| {
                let warm_up = kiln_wasm::PYTHON_DATA_WARM_UP;
                let quiet = &kiln_wasm::Quiet;
                let prepared = rt.block_on(async {
                    setup.prepare_warm(warm_up, quiet).await?;
                    setup.prepare_warm_oneshots(warm_up, quiet).await
                });
                prepared.map_err(|e| e.to_string())
            });
            if let Err(error) = built {
                tracing::warn!(%error, "could not build the python-data template's image; its sandboxes will try again");
            }
        });
    warm.context("starting the python-data setup thread")?;
    Ok(())
}

/// Makes ready, in this process and before the request is sent, what a one-shot needs and
/// the cache lacks: the fuel variant of a runtime for a run with an instruction budget
/// (Python: about 90 CPU-seconds, once per cache), or a warm template's image (built in the
/// background at start; about a minute). A worker would otherwise wait for it inside the
/// request's deadline, and the pool would stop it as overrun. Other requests pass straight
/// through.
pub fn prepare_before_send(config: &mut kiln_executor::PoolConfig) {
    use std::sync::atomic::{AtomicBool, Ordering};
    let engine: std::sync::Arc<std::sync::OnceLock<Option<WasmEngine>>> = Default::default();
    // Python's fuel variant, JavaScript's, the warm image: known ready, so later requests
    // skip the check.
    let ready: std::sync::Arc<[AtomicBool; 3]> = Default::default();
    let work = move |request: &ExecRequest| -> Option<kiln_executor::pool::BoxFuture> {
        let language = request.language;
        let fuel = request.limits.fuel.is_some();
        let warm_up = request.template.as_deref().and_then(kiln_wasm::warm_up_of);
        let index = match (language, fuel, warm_up) {
            (Language::Python, true, _) => 0,
            (Language::JavaScript, true, _) => 1,
            (Language::Python, false, Some(_)) => 2,
            _ => return None,
        };
        if ready[index].load(Ordering::Relaxed) {
            return None;
        }
        let (engine, ready) = (engine.clone(), ready.clone());
        let handle = tokio::runtime::Handle::current();
        Some(Box::pin(async move {
            let prepared = tokio::task::spawn_blocking(move || {
                let options = kiln_wasm::EngineOptions {
                    max_instances: 1,
                    ready_instances: 0,
                    ..kiln_wasm::EngineOptions::default()
                };
                let made = || WasmEngine::with_options(crate::cache::dir(), &options).ok();
                let Some(engine) = engine.get_or_init(made) else {
                    return Ok(());
                };
                match warm_up {
                    Some(warm_up) if !fuel => {
                        if !engine.is_warm_prepared(warm_up)? {
                            let quiet = &kiln_wasm::Quiet;
                            handle.block_on(engine.prepare_warm_oneshots(warm_up, quiet))?;
                        }
                    }
                    _ => engine.prepare_variant(language, true, &kiln_wasm::Quiet)?,
                }
                ready[index].store(true, Ordering::Relaxed);
                Ok::<(), anyhow::Error>(())
            })
            .await;
            if let Ok(Err(error)) = prepared {
                // The worker meets the same error and reports it with the request.
                tracing::warn!(
                    error = format!("{error:#}"),
                    "could not make a runtime ready ahead of a request"
                );
            }
        }))
    };
    config.before_send = Some(kiln_executor::BeforeSend(std::sync::Arc::new(work)));
}

/// This host's name (a node's default id).
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "kiln".into())
}

fn serve(args: cli::ServeArgs) -> anyhow::Result<ExitCode> {
    prepare_runtimes()?;
    let data_dir = data_dir(args.data_dir.clone())?;
    // Named volumes mounted later must reach the workers' jails, made now.
    if let Err(e) = kiln_runtime::volumes::share_root(&data_dir) {
        tracing::warn!("named volumes will not reach WebAssembly sandboxes: {e}");
    }
    // Workers' log lines (KILN_LOG applies to them too) match the server's.
    let (pool, worker_jail) = backends::wasm_pool(backends::WasmWorkers {
        workers: args.workers,
        writable: vec![data_dir.clone()],
        jail: true,
        log_format: Some(if logs_json(&args) { "json" } else { "text" }),
    })?;
    let worker_jail = worker_jail.context("a server's workers have a jail policy")?;
    let linux = if args.linux {
        Some(linux_cmd::backend(&args.linux_args, &data_dir)?)
    } else {
        None
    };
    let backends = backends::Backends::register(pool, linux);
    let catalogue = backends.catalogue.clone();
    let routes = python_route(&catalogue, args.routes, args.default_python_template)?;
    // Without keys the one tenant gets the machine; with keys, each key the defaults.
    let quotas = if args.no_auth {
        kiln_runtime::quota::Quotas::whole_machine(&data_dir)
    } else {
        kiln_runtime::quota::Quotas::default()
    }
    .with(&args.quotas.overrides());
    let server = kiln_server::ServerConfig {
        listen: args.listen,
        data_dir,
        auth: !args.no_auth,
        rate_limit: args.rate_limit,
        request_timeout: std::time::Duration::from_secs(args.request_timeout.max(1)),
        public_hosts: args.public_hosts,
        preview_domain: args.preview_domain.clone(),
        workflow_templates: args.workflow_templates.clone(),
        quotas,
        worker_jail,
        admission: kiln_runtime::admission::AdmissionConfig {
            max_queue: args.exec_queue,
            max_wait: std::time::Duration::from_secs(args.exec_queue_wait),
        },
        catalogue,
        llm: kiln_llm::LlmEnv::from_env(),
        routes,
        max_exec_ms: args.max_exec_time,
        max_life_ms: args.max_sandbox_life,
        e2b: args.e2b_listen.map(|address| {
            (
                address,
                kiln_server::e2b::E2bConfig {
                    domain: args.e2b_domain.clone(),
                },
            )
        }),
        tiers: doctor::tiers(&args.linux_args, args.linux),
        cluster: args
            .database
            .clone()
            .map(|database| kiln_server::cluster::ClusterConfig {
                database,
                node_id: args.node_id.clone().unwrap_or_else(host_name),
                advertise: args
                    .advertise
                    .clone()
                    .unwrap_or_else(|| format!("http://{}", args.listen)),
                lease: std::time::Duration::from_millis(args.node_lease.max(1000)),
            }),
    };
    let idle = kiln_native::backend::IdlePolicy {
        idle: std::time::Duration::from_millis(args.linux_args.box_idle),
        action: match args.linux_args.box_idle_action.as_str() {
            "stop" => kiln_native::backend::IdleAction::Stop,
            "hibernate" => kiln_native::backend::IdleAction::Hibernate,
            _ => kiln_native::backend::IdleAction::Pause,
        },
        hibernate_after: args
            .linux_args
            .box_hibernate_after
            .map(std::time::Duration::from_millis),
    };
    runtime(2)?.block_on(async {
        backends.start(Some(idle))?;
        let linux = backends.linux.clone();
        kiln_server::serve(server, backends.pools).await?;
        if let Some(backend) = &linux {
            backend.close_all().await;
        }
        anyhow::Ok(())
    })?;
    Ok(ExitCode::SUCCESS)
}

/// The routes with `--default-python-template`'s as Python's: an `installed` template that
/// runs Python, and not another than a `--route python=…` names.
fn python_route(
    installed: &kiln_core::template::Catalogue,
    mut routes: Vec<(Language, String)>,
    default_python_template: Option<String>,
) -> anyhow::Result<Vec<(Language, String)>> {
    let Some(template) = default_python_template else {
        return Ok(routes);
    };
    if !installed
        .get(&template)
        .is_some_and(|t| t.languages.contains(&Language::Python))
    {
        let python: Vec<&str> = installed
            .templates()
            .iter()
            .filter(|t| t.languages.contains(&Language::Python))
            .map(|t| t.id.as_str())
            .collect();
        bail!(
            "--default-python-template {template:?} is not a Python template; use one of {}",
            python.join(", ")
        );
    }
    match routes
        .iter()
        .find(|(language, _)| *language == Language::Python)
    {
        Some((_, routed)) if *routed != template => bail!(
            "--default-python-template {template} and --route python={routed} disagree; give one"
        ),
        Some(_) => {}
        None => routes.push((Language::Python, template)),
    }
    Ok(routes)
}

fn mcp(
    dir: Option<std::path::PathBuf>,
    workers: usize,
    default_python_template: Option<String>,
) -> anyhow::Result<ExitCode> {
    prepare_runtimes()?;
    let data_dir = data_dir(dir)?;
    if let Err(e) = kiln_runtime::volumes::share_root(&data_dir) {
        tracing::warn!("named volumes will not reach WebAssembly sandboxes: {e}");
    }
    let (pool, _) = backends::wasm_pool(backends::WasmWorkers {
        workers: Some(workers),
        writable: vec![data_dir.clone()],
        jail: false,
        log_format: None,
    })?;
    let backends = backends::Backends::register(pool, None);
    let mut config = kiln_runtime::RuntimeConfig::new(data_dir, backends.catalogue);
    config.routes = python_route(&config.catalogue, Vec::new(), default_python_template)?;
    runtime(2)?.block_on(async {
        let runtime = std::sync::Arc::new(kiln_runtime::Runtime::open(config, backends.pools)?);
        let served = kiln_server::mcp::serve_stdio(runtime.clone()).await;
        runtime.registry.detach_volumes();
        served?;
        anyhow::Ok(())
    })?;
    Ok(ExitCode::SUCCESS)
}

fn keys(command: cli::KeysCommand, dir: &std::path::Path) -> anyhow::Result<ExitCode> {
    match command {
        cli::KeysCommand::Create {
            name,
            tenant,
            quotas,
            network_widen,
            admin,
        } => {
            let (record, key) = kiln_runtime::auth::create_key_with(
                dir,
                &name,
                tenant.as_deref(),
                quotas.overrides(),
                kiln_runtime::auth::KeyGrant {
                    network_widen,
                    admin,
                },
            )
            .with_context(|| format!("cannot create a key in {}", dir.display()))?;
            println!("{key}");
            eprintln!(
                "kiln: created {}key {} for tenant {}; it is shown once, only its hash is kept ({})",
                if record.admin { "admin " } else { "" },
                record.id,
                record.tenant,
                dir.join("keys.json").display()
            );
        }
        cli::KeysCommand::List => {
            let keys = kiln_runtime::auth::list_keys(dir)?;
            if keys.is_empty() {
                eprintln!(
                    "kiln: no keys in {}; create one with `kiln keys create`",
                    dir.display()
                );
            }
            for key in keys {
                println!(
                    "{}\t{}\t{}\t{}{}",
                    key.id,
                    key.tenant,
                    key.created_at,
                    key.name,
                    if key.admin { "\t(admin)" } else { "" }
                );
            }
        }
        cli::KeysCommand::Revoke { id } => {
            if !kiln_runtime::auth::revoke_key(dir, &id)? {
                anyhow::bail!("no key {id:?} in {}", dir.join("keys.json").display());
            }
            eprintln!("kiln: revoked {id}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `kiln __jail-probe`: confines itself as a worker does (namespaces, read-only mounts, the
/// seccomp filter) and exits 0, or says why it could not.
fn jail_probe() -> anyhow::Result<ExitCode> {
    use kiln_executor::confine;
    confine::isolate(&confine::writable_from_env()).context("could not isolate itself")?;
    confine::restrict().context("could not install its seccomp filter")?;
    Ok(ExitCode::SUCCESS)
}

/// The jail a server's workers run in: the policy for servers (`require` as root, unless
/// `KILN_WORKER_JAIL` says otherwise), passed to every worker of `config`, and whether a
/// worker can confine itself here (a probe process tries). A server that requires the jail
/// and cannot have it refuses to start, saying why; one told `off` says so loudly.
pub(crate) fn worker_jail(
    config: &mut kiln_executor::PoolConfig,
) -> anyhow::Result<kiln_executor::confine::JailReport> {
    use kiln_executor::confine::{JAIL_ENV, JailReport, Policy, WRITABLE_ENV};
    let policy = Policy::for_server();
    config.env.retain(|(name, _)| name != JAIL_ENV);
    config.env.push((JAIL_ENV.into(), policy.name().into()));
    if policy == Policy::Off {
        eprintln!(
            "kiln: WARNING: executor workers run UNCONFINED ({JAIL_ENV}=off): no namespaces, no seccomp filter; code that escaped WebAssembly would act as kiln's own user on this host"
        );
        return Ok(JailReport {
            policy,
            confined: false,
        });
    }
    let output = std::process::Command::new(&config.program)
        .arg("__jail-probe")
        .env_clear()
        .envs(config.env.iter().map(|(k, v)| (k, v)))
        .env(WRITABLE_ENV, serde_json::to_string(&config.writable)?)
        .stdin(std::process::Stdio::null())
        .output()
        .context("could not start the worker jail probe")?;
    if output.status.success() {
        return Ok(JailReport {
            policy,
            confined: true,
        });
    }
    let said = String::from_utf8_lossy(&output.stderr);
    let reason = said.trim().trim_start_matches("kiln: ");
    if policy == Policy::Require {
        anyhow::bail!(
            "the executor workers cannot confine themselves here: {reason}. kiln runs as root (or {JAIL_ENV}=require), where it refuses to run guests in unconfined workers: allow user, mount and network namespaces and seccomp on this host, or set {JAIL_ENV}=off to run them unconfined (not recommended)"
        );
    }
    tracing::warn!(
        "the executor workers cannot confine themselves here and run without their jail: {reason} (set {JAIL_ENV}=off to silence this, or require to refuse)"
    );
    Ok(JailReport {
        policy,
        confined: false,
    })
}

/// `kiln __worker`: serves the wasm backend to its pool over stdin and stdout.
fn worker() -> anyhow::Result<ExitCode> {
    use kiln_executor::confine;
    // Confined before any thread starts (namespaces need one), filtered once loaded.
    let policy = confine::Policy::from_env();
    let cache = crate::cache::dir();
    let mut writable = confine::writable_from_env();
    writable.push(cache.root().to_path_buf());
    confine::confine_isolate(policy, &writable)?;
    let engine = WasmEngine::new(cache)?;
    confine::confine_restrict(policy)?;
    let threads = std::env::var("KILN_WORKER_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    kiln_executor::worker::runtime(threads)?.block_on(async {
        let (input, output) = kiln_executor::worker::stdio_pipes()?;
        kiln_executor::worker::serve(engine, input, output).await;
        anyhow::Ok(())
    })?;
    Ok(ExitCode::SUCCESS)
}

/// Whether `template` is a warm WebAssembly template (`python-data`): `kiln exec
/// --template` then runs it here instead of in a Linux box (whose `python` is Debian's).
fn is_wasm_template(template: &str) -> bool {
    kiln_wasm::warm_up_of(template).is_some()
}

fn exec(
    language: Language,
    code: String,
    args: &ExecArgs,
    script: Option<kiln_core::Mount>,
) -> anyhow::Result<ExitCode> {
    let mut request = ExecRequest::new(language, code);
    request.template = args.template.clone();
    request.limits = args.limits()?;
    request.env = args.env_pairs()?;
    request.workspace = args.workspace.clone();
    request.mounts = args.mounts()?;
    if let Some(script) = script {
        if request.mounts.iter().any(|m| m.guest == script.guest) {
            bail!(
                "{} is where kiln run grants the script's folder; mount something else there",
                script.guest
            );
        }
        request.mounts.push(script);
    }
    if !std::io::stdin().is_terminal() {
        std::io::stdin()
            .read_to_end(&mut request.stdin)
            .context("reading stdin")?;
    }
    // One execution: a small slot pool starts faster than the server-sized default.
    let options = kiln_wasm::EngineOptions {
        max_instances: 4,
        ready_instances: 0,
        ..kiln_wasm::EngineOptions::default()
    };
    let engine = WasmEngine::with_options(crate::cache::dir(), &options)?;
    let fuel = request.limits.fuel.is_some();
    match request.template.as_deref().and_then(kiln_wasm::warm_up_of) {
        // A warm template needs its image (built once) and the warm engine's module, not
        // the runtime's own.
        Some(warm_up) if language == Language::Python => {
            runtime(1)?.block_on(engine.prepare_warm_oneshots(warm_up, &progress::Bar::new()))?;
        }
        _ => engine.prepare_variant(language, fuel, &progress::Bar::new())?,
    }
    let result = if args.json {
        let result = runtime(1)?.block_on(engine.execute(&request))?;
        println!("{}", serde_json::to_string(&json_result(&result))?);
        result
    } else {
        // Output reaches the terminal as the guest writes it.
        runtime(1)?.block_on(async {
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<OutputChunk>();
            let printer = tokio::spawn(async move {
                while let Some(chunk) = rx.recv().await {
                    let written = match chunk.stream {
                        StreamKind::Stdout => {
                            let mut out = std::io::stdout().lock();
                            out.write_all(&chunk.data).and_then(|()| out.flush())
                        }
                        StreamKind::Stderr => std::io::stderr().write_all(&chunk.data),
                        // A terminal shows no images: said once the run ends.
                        StreamKind::Display => Ok(()),
                    };
                    if written.is_err() {
                        break;
                    }
                }
            });
            let result = engine.execute_streaming(&request, Some(tx)).await;
            let _ = printer.await;
            result
        })?
    };
    if !args.json {
        // A final expression's value (the main result) goes unsaid, as `python -c` says
        // nothing of it; what the code showed on purpose is counted.
        let shown = result.results.iter().filter(|r| !r.main).count();
        let figures = (shown > 0).then(|| {
            format!(
                "{shown} rich result(s) (figures, displayed values) not shown here: `kiln exec --json` returns them"
            )
        });
        let reasons = [
            result.outcome.reason(&request.limits),
            result.fs_reason(&request.limits),
            figures,
        ];
        for reason in reasons.into_iter().flatten() {
            if !result.stderr.is_empty() && !result.stderr.ends_with(b"\n") {
                eprintln!();
            }
            eprintln!("kiln: {reason}");
        }
    }
    // Nothing is left to do but exit: the process's exit tears the engine down faster than
    // dropping it would (its temporary folders are removed first).
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    engine.finish_for_exit();
    std::process::exit(i32::from(exit_code(&result)));
}

/// kiln's exit code for a result: the guest's own when it ran to its end, else a distinct
/// code per outcome.
pub fn exit_code(result: &ExecResult) -> u8 {
    match &result.outcome {
        Outcome::Completed | Outcome::OutputTruncated => (result.exit_code & 0xff) as u8,
        Outcome::TimedOut => exit_codes::TIMED_OUT,
        Outcome::MemoryLimit => exit_codes::MEMORY_LIMIT,
        Outcome::Crashed { .. } => exit_codes::CRASHED,
        Outcome::FuelExhausted => exit_codes::FUEL_EXHAUSTED,
    }
}

fn json_result(result: &ExecResult) -> serde_json::Value {
    serde_json::json!({
        "stdout": result.stdout_text(),
        "stderr": result.stderr_text(),
        "exit_code": result.exit_code,
        "outcome": result.outcome,
        "stdout_truncated": result.stdout_truncated,
        "stderr_truncated": result.stderr_truncated,
        "duration_us": result.duration_us,
        "peak_memory_bytes": result.peak_memory_bytes,
        "fs_written_bytes": result.fs_written_bytes,
        "results": result.results,
    })
}
