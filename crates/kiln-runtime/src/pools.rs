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
                    serde_json::to_value(kind)
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_owned))
                        .unwrap_or_default()
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
