//! kiln's backends, each built and registered in one place.
//!
//! - The WebAssembly backend: an executor pool of this binary's worker processes
//!   ([`wasm_pool`]), for every face (serve, mcp, rest, runner).
//! - With `--linux`, the Linux backend: its templates, its pool (served in process), its
//!   process host (live processes, terminals, ports, pause and hibernation) and its reaper.
//!
//! [`Backends::register`] registers each once, kind → pool + process host, and builds the
//! catalogue from their templates. Faces ask a template's `capabilities`, never a backend's
//! kind. A new backend touches its crate, [`Backends::register`] and its templates.

use std::sync::Arc;

use kiln_core::backend::Backend;
use kiln_core::template::{BackendKind, Catalogue};

/// How the WebAssembly backend's workers run.
pub struct WasmWorkers {
    /// How many (default: the pool's).
    pub workers: Option<usize>,
    /// Folders they may write (a data folder), besides kiln's cache.
    pub writable: Vec<std::path::PathBuf>,
    /// Confine them ([`crate::worker_jail`]): what a server does; `kiln mcp`, one user's
    /// stdio, does not.
    pub jail: bool,
    /// Their log lines' format, where it must match a server's (`json` or `text`).
    pub log_format: Option<&'static str>,
}

/// The WebAssembly backend's executor pool, and its workers' jail where asked.
pub fn wasm_pool(
    options: WasmWorkers,
) -> anyhow::Result<(
    kiln_executor::ExecutorPool,
    Option<kiln_executor::confine::JailReport>,
)> {
    let mut config = kiln_executor::PoolConfig::current_exe()?;
    if let Some(workers) = options.workers {
        config.workers = workers.max(1);
    }
    crate::prepare_before_send(&mut config);
    for dir in options.writable {
        config.writable.push(crate::made_dir(&dir)?);
    }
    if let Some(format) = options.log_format {
        config.env.retain(|(name, _)| name != "KILN_LOG_FORMAT");
        config.env.push(("KILN_LOG_FORMAT".into(), format.into()));
    }
    let jail = if options.jail {
        Some(crate::worker_jail(&mut config)?)
    } else {
        None
    };
    Ok((kiln_executor::ExecutorPool::new(config), jail))
}

/// Every backend of this process, registered.
pub struct Backends {
    /// Their templates, in order of preference: Linux ones first (Docker-style images,
    /// `python:3.11`, resolve to real Linux), then WebAssembly's (a language's default stays
    /// its WebAssembly template, the first ephemeral one).
    pub catalogue: Catalogue,
    pub pools: kiln_runtime::Pools,
    /// The Linux backend, to start its reaper and close its boxes at the end.
    pub linux: Option<kiln_native::backend::NativeBackend>,
}

impl Backends {
    /// Registers the WebAssembly backend over `wasm`, and the Linux backend where given.
    pub fn register(
        wasm: kiln_executor::ExecutorPool,
        linux: Option<kiln_native::backend::NativeBackend>,
    ) -> Backends {
        let mut templates = Vec::new();
        let mut pools = kiln_runtime::Pools::new(BackendKind::Wasm, wasm);
        if let Some(native) = &linux {
            templates.extend(native.templates());
            let pool =
                kiln_executor::ExecutorPool::new(crate::linux_cmd::pool_config(native.clone()));
            let processes: Arc<dyn kiln_core::process::ProcessHost> = Arc::new(native.clone());
            pools = pools.register(BackendKind::Native, pool, Some(processes));
        }
        templates.extend(kiln_wasm::templates());
        let mut catalogue = Catalogue::new(templates);
        if let Some(native) = &linux {
            for name in native.unbuilt() {
                let reason = format!(
                    "the {name} template is defined but not built on this server: run `kiln setup --template {name}` (as root), then restart it"
                );
                catalogue = catalogue.with_unavailable(&format!("linux-{name}"), &reason);
                if native.runs_vms() {
                    catalogue = catalogue.with_unavailable(&format!("vm-{name}"), &reason);
                }
            }
        }
        if linux.is_none() {
            catalogue = catalogue.with_unavailable(
                "linux-",
                "Linux templates run on a server started with --linux (as root, after kiln setup --template all); this one runs WebAssembly only. `kiln doctor` says whether this host can run them",
            );
        }
        Backends {
            catalogue,
            pools,
            linux,
        }
    }

    /// Starts every pool's workers, and the Linux backend's reaper with `idle` (call inside
    /// the async runtime).
    pub fn start(&self, idle: Option<kiln_native::backend::IdlePolicy>) -> anyhow::Result<()> {
        self.pools.start_all()?;
        if let (Some(native), Some(idle)) = (&self.linux, idle) {
            native.start_reaper(idle);
            native.start_pools();
        }
        Ok(())
    }
}
