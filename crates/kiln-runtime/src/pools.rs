//! The executor pools, one per backend kind. The runtime routes each sandbox to the pool of
//! its template's backend (one `match` on the kind); a backend with no pool here is refused
//! with [`RuntimeError::Unsupported`], never run on another.

use kiln_core::template::BackendKind;
use kiln_executor::{ExecutorPool, WorkerLoad};

use crate::error::{Result, RuntimeError};

/// Executor pools by backend kind.
pub struct Pools {
    by_kind: Vec<(BackendKind, ExecutorPool)>,
}

impl std::fmt::Debug for Pools {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.by_kind.iter().map(|(kind, _)| kind))
            .finish()
    }
}

impl Pools {
    /// `pool` serves the sandboxes of `kind`'s templates.
    pub fn new(kind: BackendKind, pool: ExecutorPool) -> Pools {
        Pools {
            by_kind: vec![(kind, pool)],
        }
    }

    /// Adds (or replaces) the pool of `kind`.
    pub fn with(mut self, kind: BackendKind, pool: ExecutorPool) -> Pools {
        self.by_kind.retain(|(k, _)| *k != kind);
        self.by_kind.push((kind, pool));
        self
    }

    /// The pool of `kind`, or why there is none.
    pub fn get(&self, kind: BackendKind) -> Result<&ExecutorPool> {
        self.by_kind
            .iter()
            .find(|(k, _)| *k == kind)
            .map(|(_, pool)| pool)
            .ok_or_else(|| RuntimeError::Unsupported {
                message: format!(
                    "no executor serves the {} backend on this server",
                    kind.as_str()
                ),
            })
    }

    /// Starts every pool's workers now; the first failure.
    pub fn start_all(&self) -> std::result::Result<(), kiln_executor::PoolError> {
        self.by_kind
            .iter()
            .try_for_each(|(_, pool)| pool.start_all())
    }

    /// Every worker's load, pool after pool.
    pub fn worker_loads(&self) -> Vec<WorkerLoad> {
        self.by_kind
            .iter()
            .flat_map(|(_, pool)| pool.worker_loads())
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
