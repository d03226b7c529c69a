//! `kiln runner`: flags and start-up of the UHLP sandbox runner (the protocol lives in the
//! kiln-runner crate).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kiln_core::Language;
use kiln_wasm::WasmEngine;

use crate::cli::{parse_bytes, parse_duration_ms};

#[derive(Debug, Args)]
pub struct RunnerArgs {
    /// Port to listen on (all interfaces unless --host or --listen say otherwise).
    #[arg(long, env = "UHLP_SANDBOX_PORT", default_value_t = 8080)]
    pub port: u16,
    /// Interface to listen on.
    #[arg(long, env = "UHLP_SANDBOX_HOST", default_value = "0.0.0.0")]
    pub host: std::net::IpAddr,
    /// Full address to listen on; overrides --host and --port.
    #[arg(long)]
    pub listen: Option<std::net::SocketAddr>,
    /// The shared volume holding JIT scripts (mounted read-only at /app in the sandbox).
    #[arg(long, env = "UHLP_SHARED_VOLUME")]
    pub scripts: Option<PathBuf>,
    /// Executor worker processes (default: one per CPU).
    #[arg(long)]
    pub workers: Option<usize>,
    /// Longest sandbox run, e.g. 500ms, 10s (a request may ask for less).
    #[arg(long, default_value = "10s", value_parser = parse_duration_ms, env = "UHLP_SANDBOX_TIMEOUT")]
    pub timeout: u64,
    /// Memory cap of a sandbox, e.g. 256m.
    #[arg(long, default_value = "256m", value_parser = parse_bytes, env = "UHLP_SANDBOX_MEMORY")]
    pub memory: u64,
    /// Largest request body; larger ones get 413.
    #[arg(long, default_value = "10m", value_parser = parse_bytes)]
    pub max_body: u64,
    /// Deadline of one MCP call.
    #[arg(long, default_value = "30s", value_parser = parse_duration_ms)]
    pub mcp_timeout: u64,
    /// Deadline of one whole /execute; past it the answer is 504.
    #[arg(long, default_value = "300s", value_parser = parse_duration_ms)]
    pub request_timeout: u64,
    /// Steps a workflow may run per request (or per instance in step mode).
    #[arg(long, default_value_t = 50)]
    pub max_workflow_steps: u32,
    /// Lowest level sent to core.framework.logFrameworkMessage: debug, info, warn, error, off.
    #[arg(long, default_value = "info", env = "UHLP_LOG_LEVEL", value_parser = parse_level)]
    pub log_level: kiln_runner::Level,
}

fn parse_level(text: &str) -> Result<kiln_runner::Level, String> {
    kiln_runner::Level::parse(text)
        .ok_or_else(|| format!("unknown level {text:?}; use debug, info, warn, error or off"))
}

/// Runs `kiln runner` until SIGINT or SIGTERM.
pub fn run(args: RunnerArgs) -> anyhow::Result<ExitCode> {
    if let Some(dir) = &args.scripts {
        anyhow::ensure!(
            dir.is_dir(),
            "the shared volume {} is not a folder",
            dir.display()
        );
    }
    // Fetch and compile the runtimes here, once, before any worker needs them.
    let setup = WasmEngine::with_options(
        crate::cache::dir(),
        &kiln_wasm::EngineOptions {
            max_instances: 1,
            ready_instances: 0,
            ..kiln_wasm::EngineOptions::default()
        },
    )?;
    for language in Language::WASM {
        setup.prepare(language, &crate::progress::Bar::new())?;
    }
    drop(setup);
    let (pool, _) = crate::backends::wasm_pool(crate::backends::WasmWorkers {
        workers: args.workers,
        writable: Vec::new(),
        jail: true,
        log_format: None,
    })?;
    let config = kiln_runner::RunnerConfig {
        listen: args
            .listen
            .unwrap_or(std::net::SocketAddr::new(args.host, args.port)),
        scripts: args.scripts,
        timeout_ms: args.timeout,
        memory_bytes: args.memory,
        max_body_bytes: usize::try_from(args.max_body).context("--max-body is too large")?,
        mcp_timeout: Duration::from_millis(args.mcp_timeout),
        request_timeout: Duration::from_millis(args.request_timeout),
        max_workflow_steps: args.max_workflow_steps.max(1),
        log_level: args.log_level,
    };
    crate::runtime(2)?.block_on(async {
        let backends = crate::backends::Backends::register(pool, None);
        let executors = kiln_runtime::Executors::new(backends.pools, backends.catalogue);
        kiln_runner::serve(config, executors).await?;
        anyhow::Ok(())
    })?;
    Ok(ExitCode::SUCCESS)
}
