//! `kiln rest`: flags and start-up of the dynamic REST metaservice.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, Subcommand, ValueEnum};
use kiln_core::Language;
use kiln_rest::{Planner, RestConfig};
use kiln_wasm::WasmEngine;

#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct RestArgs {
    #[command(subcommand)]
    pub command: Option<RestCommand>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8090", env = "KILN_REST_LISTEN")]
    pub listen: std::net::SocketAddr,
    /// Folder for tenant data and plan caches (default: $KILN_DATA_DIR/rest, else
    /// ~/.local/share/kiln/rest).
    #[arg(long, env = "KILN_REST_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Who plans requests: `conventions` (offline, no LLM), `llm` (the model in
    /// KILN_LLM_MODEL), or `auto` (llm when KILN_LLM_MODEL is set, else conventions).
    #[arg(long, value_enum, default_value_t = PlannerChoice::Auto, env = "KILN_REST_PLANNER")]
    pub planner: PlannerChoice,
    /// Require `Authorization: Bearer <token>` on every request but /healthz and the docs.
    #[arg(long, env = "AUTH_TOKEN", hide_env_values = true)]
    pub auth_token: Option<String>,
    /// Seconds a request's code may run.
    #[arg(long, default_value_t = 10, env = "KILN_REST_DEADLINE")]
    pub deadline: u64,
    /// Largest request body, e.g. 1m.
    #[arg(long, default_value = "1m", value_parser = crate::cli::parse_bytes)]
    pub max_body: u64,
    /// Largest response a plan may produce, e.g. 4m.
    #[arg(long, default_value = "4m", value_parser = crate::cli::parse_bytes)]
    pub max_result: u64,
    /// Memory cap of each tenant's sandbox, e.g. 256m.
    #[arg(long, default_value = "256m", value_parser = crate::cli::parse_bytes)]
    pub memory: u64,
    /// Executor worker processes (default: one per CPU).
    #[arg(long)]
    pub workers: Option<usize>,
    /// Plan every request anew (no plan cache).
    #[arg(long)]
    pub no_plan_cache: bool,
    /// Seconds after which an idle tenant's sandbox is closed (its data stays on disk).
    #[arg(long, default_value_t = 300)]
    pub idle_timeout: u64,
    /// Live tenant sandbox sessions at most. Past it a tenant that needs one takes the
    /// least recently used idle session; when all are busy it gets 503 (Retry-After).
    #[arg(long, default_value_t = 64, env = "KILN_REST_MAX_SESSIONS")]
    pub max_sessions: usize,
    /// Memory caps of all live tenant sessions together, e.g. 8g: lowers --max-sessions
    /// to this divided by --memory (default: no budget but the count).
    #[arg(long, value_parser = crate::cli::parse_bytes, env = "KILN_REST_SESSIONS_MEMORY")]
    pub sessions_memory: Option<u64>,
    /// New tenants one client address may create per minute (IPv6 counted by /64); past
    /// it 429 TOO_MANY_NEW_TENANTS, while its tenants keep working. 0: no limit. Default:
    /// 30 without --auth-token; none with it (the token's holder, usually one backend
    /// address, names the tenants of all its users).
    #[arg(long, env = "KILN_REST_NEW_TENANTS_PER_MINUTE")]
    pub new_tenants_per_minute: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PlannerChoice {
    Auto,
    Conventions,
    Llm,
}

#[derive(Debug, Subcommand)]
pub enum RestCommand {
    /// Show the plan cache (per tenant: patterns, planner, hits, hit rate), or clear it.
    Plans {
        /// Only this tenant.
        #[arg(long)]
        tenant: Option<String>,
        /// Remove the cached plans (of --tenant, or of every tenant).
        #[arg(long)]
        clear: bool,
        /// Print each plan's code too.
        #[arg(long)]
        code: bool,
        /// The folder `kiln rest` keeps its data in (default: $KILN_DATA_DIR/rest, else
        /// ~/.local/share/kiln/rest).
        #[arg(long, env = "KILN_REST_DATA_DIR")]
        data_dir: Option<PathBuf>,
    },
}

/// `--data-dir` (or `KILN_REST_DATA_DIR`), else `rest/` in kiln's data folder:
/// `$KILN_DATA_DIR/rest` when that is set, `~/.local/share/kiln/rest` otherwise.
fn data_dir(given: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    if let Some(dir) = given {
        return Ok(dir);
    }
    if let Some(root) = std::env::var_os("KILN_DATA_DIR").filter(|v| !v.is_empty()) {
        return Ok(PathBuf::from(root).join("rest"));
    }
    dirs::data_dir()
        .map(|d| d.join("kiln").join("rest"))
        .context("no data directory; pass --data-dir")
}

fn planner(choice: PlannerChoice) -> anyhow::Result<Planner> {
    let configured = std::env::var("KILN_LLM_MODEL").is_ok_and(|v| !v.is_empty());
    if choice == PlannerChoice::Conventions || (choice == PlannerChoice::Auto && !configured) {
        return Ok(Planner::Conventions);
    }
    let config = kiln_llm::ModelConfig::from_env().context("the LLM planner")?;
    let model = kiln_llm::GenaiModel::new(&config).context("the LLM planner")?;
    Ok(Planner::Llm {
        model: Arc::new(model),
        timeout: config.timeout,
        retry: config.retry,
    })
}

pub fn run(args: RestArgs) -> anyhow::Result<std::process::ExitCode> {
    if let Some(RestCommand::Plans {
        tenant,
        clear,
        code,
        data_dir: dir,
    }) = args.command
    {
        return plans(&data_dir(dir)?, tenant.as_deref(), clear, code);
    }
    let dir = data_dir(args.data_dir)?;
    let planner = planner(args.planner)?;
    let setup = WasmEngine::with_options(
        crate::cache::dir(),
        &kiln_wasm::EngineOptions {
            max_instances: 1,
            ready_instances: 0,
            ..kiln_wasm::EngineOptions::default()
        },
    )?;
    setup.prepare(Language::Python, &crate::progress::Bar::new())?;
    drop(setup);
    let (pool, _) = crate::backends::wasm_pool(crate::backends::WasmWorkers {
        workers: args.workers,
        writable: vec![dir.clone()],
        jail: true,
        log_format: None,
    })?;
    let pool = Arc::new(pool);
    let mut config = RestConfig::new(args.listen, dir, planner);
    config.auth_token = args
        .auth_token
        .filter(|t| !t.is_empty())
        .map(secrecy::SecretString::from);
    config.deadline = Duration::from_secs(args.deadline.max(1));
    config.max_body_bytes = usize::try_from(args.max_body).unwrap_or(usize::MAX);
    config.max_result_bytes = args.max_result;
    config.memory_bytes = args.memory;
    config.plan_cache = !args.no_plan_cache;
    config.idle_timeout = Duration::from_secs(args.idle_timeout.max(1));
    config.max_sessions = args.max_sessions.max(1);
    config.sessions_memory_bytes = args.sessions_memory;
    config.new_tenants_per_minute = args
        .new_tenants_per_minute
        .unwrap_or(if config.auth_token.is_some() { 0 } else { 30 });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        pool.start_all()?;
        kiln_rest::serve(config, pool).await?;
        anyhow::Ok(())
    })?;
    Ok(std::process::ExitCode::SUCCESS)
}

fn plans(
    dir: &std::path::Path,
    tenant: Option<&str>,
    clear: bool,
    code: bool,
) -> anyhow::Result<std::process::ExitCode> {
    let plans_dir = dir.join("plans");
    let mut files: Vec<PathBuf> = match tenant {
        Some(t) => {
            if t.is_empty()
                || !t
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_-".contains(&b))
            {
                bail!("--tenant takes letters, digits, '_' or '-'");
            }
            vec![plans_dir.join(format!("{t}.json"))]
        }
        None => match std::fs::read_dir(&plans_dir) {
            Ok(entries) => entries
                .filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|e| e == "json"))
                .collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e).context(format!("reading {}", plans_dir.display())),
        },
    };
    files.sort();
    let mut report = Vec::new();
    for path in files {
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let stored = kiln_rest::plans::read_tenant(&path)?;
        if clear {
            if path.exists() {
                let empty = kiln_rest::TenantPlans::default();
                kiln_runtime::store::write_json(&path, &empty)?;
            }
            report.push(serde_json::json!({"tenant": name, "cleared": stored.entries.len()}));
            continue;
        }
        let entries: Vec<_> = stored
            .entries
            .iter()
            .map(|e| {
                let mut v = serde_json::json!({
                    "pattern": e.pattern, "planner": e.planner, "hits": e.hits, "created": e.created,
                });
                if code {
                    v["code"] = e.code.clone().into();
                }
                v
            })
            .collect();
        report.push(serde_json::json!({
            "tenant": name,
            "hits": stored.hits,
            "misses": stored.misses,
            "hit_rate": (stored.hit_rate() * 1000.0).round() / 1000.0,
            "plans": entries,
        }));
    }
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(std::process::ExitCode::SUCCESS)
}
