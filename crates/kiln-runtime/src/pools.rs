//! The backends, each registered once: its kind, the executor pool that runs its code and
//! sessions, and what starts live processes in its sandboxes (if it runs any). What a
//! template's sandboxes can do is in its `TemplateInfo::capabilities`, which faces ask; the
//! runtime routes each sandbox to its template's backend by kind, here and only here. A
//! backend not registered is refused with [`RuntimeError::Unsupported`], never run on
//! another.

use std::sync::Arc;

use kiln_core::process::ProcessHost;
use kiln_core::template::BackendKind;
use kiln_executor::{ExecutorPool, WorkerLoad};

use crate::error::{Result, RuntimeError};

/// One registered backend.
struct Registered {
    kind: BackendKind,
    pool: ExecutorPool,
    /// What starts live processes in its sandboxes (boxes); `None`: it runs code only.
    processes: Option<Arc<dyn ProcessHost>>,
}

/// The registered backends, by kind.
pub struct Pools {
    by_kind: Vec<Registered>,
}

impl std::fmt::Debug for Pools {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.by_kind.iter().map(|r| (r.kind, r.processes.is_some())))
            .finish()
    }
}

impl Pools {
    /// `pool` serves the sandboxes of `kind`'s templates (which run no live processes).
    pub fn new(kind: BackendKind, pool: ExecutorPool) -> Pools {
        Pools {
            by_kind: Vec::new(),
        }
        .register(kind, pool, None)
    }

    /// Adds (or replaces) the pool of `kind`, whose templates run no live processes.
    pub fn with(self, kind: BackendKind, pool: ExecutorPool) -> Pools {
        self.register(kind, pool, None)
    }

    /// Registers backend `kind` (replacing one registered before): `pool` runs its code and
    /// sessions, `processes` starts live processes in its sandboxes.
    pub fn register(
        mut self,
        kind: BackendKind,
        pool: ExecutorPool,
        processes: Option<Arc<dyn ProcessHost>>,
    ) -> Pools {
        self.by_kind.retain(|r| r.kind != kind);
        self.by_kind.push(Registered {
            kind,
            pool,
            processes,
        });
        self
    }

    /// Every backend's process host, with its kind.
    pub fn process_hosts(&self) -> Vec<(BackendKind, Arc<dyn ProcessHost>)> {
        self.by_kind
            .iter()
            .filter_map(|r| Some((r.kind, r.processes.clone()?)))
            .collect()
    }

    /// The kinds registered.
    pub fn kinds(&self) -> Vec<BackendKind> {
        self.by_kind.iter().map(|r| r.kind).collect()
    }

    /// The pool of `kind`, or why there is none.
    pub fn get(&self, kind: BackendKind) -> Result<&ExecutorPool> {
        self.by_kind
            .iter()
            .find(|r| r.kind == kind)
            .map(|r| &r.pool)
            .ok_or_else(|| RuntimeError::Unsupported {
                message: format!(
                    "no executor serves the {} backend on this server",
                    kind.as_str()
                ),
            })
    }

    /// Starts every pool's workers now; the first failure.
    pub fn start_all(&self) -> std::result::Result<(), kiln_executor::PoolError> {
        self.by_kind.iter().try_for_each(|r| r.pool.start_all())
    }

    /// Every worker's load, pool after pool.
    pub fn worker_loads(&self) -> Vec<WorkerLoad> {
        self.by_kind
            .iter()
            .flat_map(|r| r.pool.worker_loads())
            .collect()
    }
}

/// The executor pools and the catalogue that routes a template (or a language) to one: what
/// runs code. The runtime's sandboxes use it, and so do faces that run code with no sandbox
/// of their own (kiln runner's scripts, MCP's fresh runs).
#[derive(Debug)]
pub struct Executors {
    pub pools: Pools,
    /// The installed templates, in order of preference.
    pub catalogue: kiln_core::template::Catalogue,
    /// Languages the operator sends to a template of their choice (`python` →
    /// `linux-python`), ahead of the catalogue's order (see [`Executors::with_routes`]).
    pub routes: Vec<(kiln_core::Language, String)>,
}

impl Executors {
    pub fn new(pools: Pools, catalogue: kiln_core::template::Catalogue) -> Executors {
        Executors {
            pools,
            catalogue,
            routes: Vec::new(),
        }
    }

    /// With `routes`: each language's preferred template (where code in it runs when a
    /// request names no sandbox or template: MCP's run tools, the agent, default sandboxes).
    /// A route to a template that is not installed, or that does not speak the language,
    /// is refused with the reason.
    pub fn with_routes(
        mut self,
        routes: Vec<(kiln_core::Language, String)>,
    ) -> std::result::Result<Executors, String> {
        for (language, id) in &routes {
            let template = self.catalogue.get(id).ok_or_else(|| {
                format!(
                    "the route {language}={id} names no installed template (installed: {})",
                    self.catalogue
                        .templates()
                        .iter()
                        .map(|t| t.id.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })?;
            if !template.languages.contains(language) {
                return Err(format!(
                    "the route {language}={id}: the {id} template does not run {language}"
                ));
            }
        }
        self.routes = routes;
        Ok(self)
    }

    /// The pool that runs sandboxes of `template` (its backend's).
    pub fn pool_for(&self, template: &str) -> Result<&ExecutorPool> {
        let info = self
            .catalogue
            .get(template)
            .ok_or_else(|| RuntimeError::Unsupported {
                message: format!(
                    "the template {template:?} is not installed on this server (installed: {})",
                    self.catalogue.available().join(", ")
                ),
            })?;
        self.pools.get(info.backend)
    }

    /// The preferred template for `language`: the one the operator routed it to, else the
    /// first ephemeral template that speaks it (the WebAssembly fast path), else the first
    /// that does (a Linux template for `go` and `bash`).
    pub fn preferred_template(
        &self,
        language: kiln_core::Language,
    ) -> Result<&kiln_core::template::TemplateInfo> {
        if let Some(routed) = self
            .routes
            .iter()
            .find(|(l, _)| *l == language)
            .and_then(|(_, id)| self.catalogue.get(id))
        {
            return Ok(routed);
        }
        let speaks = |t: &&kiln_core::template::TemplateInfo| t.languages.contains(&language);
        let templates = self.catalogue.templates();
        templates
            .iter()
            .filter(speaks)
            .find(|t| t.lifecycle == kiln_core::template::Lifecycle::Ephemeral)
            .or_else(|| templates.iter().find(speaks))
            .ok_or_else(|| RuntimeError::UnsupportedLanguage {
                message: if language.is_wasm() {
                    format!("no installed template runs {language}")
                } else {
                    format!("no installed template runs {language}: it needs a Linux template (kiln serve --linux, with the template built)")
                },
            })
    }

    /// The pool of the preferred template for `language`.
    pub fn pool_for_language(&self, language: kiln_core::Language) -> Result<&ExecutorPool> {
        self.pools.get(self.preferred_template(language)?.backend)
    }

    /// Runs `request` once, in a fresh sandbox of the preferred template for its language.
    pub async fn run_once(
        &self,
        mut request: kiln_core::ExecRequest,
    ) -> Result<kiln_core::ExecResult> {
        let template = self.preferred_template(request.language)?;
        let pool = self.pools.get(template.backend)?;
        request.template.get_or_insert_with(|| template.id.clone());
        Ok(pool.execute(request).await?)
    }
}
