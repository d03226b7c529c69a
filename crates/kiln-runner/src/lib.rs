//! `kiln runner`: the UHLP sandbox runner protocol. A core framework calls `POST /execute`
//! with `{requestId, requestData, context}`; the runner runs a script function in a kiln
//! sandbox (JIT mode), a prompt template through the framework's LLM (llm mode), or a
//! workflow of such steps (workflow mode), and answers `{requestId, resultType, data,
//! metrics}`. The framework's MCP tools (`context.mcp_endpoint`) provide definitions, state,
//! the LLM and logging. See docs/runner.md.
//!
//! ```no_run
//! # async fn demo(
//! #     catalogue: kiln_core::template::Catalogue,
//! # ) -> Result<(), Box<dyn std::error::Error>> {
//! use kiln_core::template::BackendKind;
//! use kiln_executor::{ExecutorPool, PoolConfig};
//! use kiln_runner::RunnerConfig;
//! use kiln_runtime::{Executors, Pools};
//!
//! let config = RunnerConfig {
//!     scripts: Some("/srv/shared".into()),
//!     ..RunnerConfig::default()
//! };
//! let pool = ExecutorPool::new(PoolConfig::current_exe()?);
//! let executors = Executors::new(Pools::new(BackendKind::Wasm, pool), catalogue);
//! kiln_runner::serve(config, executors).await?;
//! # Ok(()) }
//! ```

pub mod api;
pub mod jit;
pub mod mcp;
pub mod protocol;
pub mod runner;
pub mod template;
pub mod workflow;

use std::sync::Arc;

pub use mcp::Level;
pub use runner::{Runner, RunnerConfig};

use kiln_runtime::Executors;
use serde_json::Value;

/// The runner could not be started.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The address could not be bound.
    #[error("cannot listen on {addr}")]
    Bind {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    /// The HTTP client for MCP could not be built.
    #[error("cannot build the MCP client")]
    Client(#[source] reqwest::Error),
    /// The server failed while running.
    #[error("the server failed")]
    Serve(#[source] std::io::Error),
}

/// Serves the runner until SIGINT or SIGTERM. `/healthz` answers 200 once the workers are
/// warm; requests that arrive earlier are served too, only slower.
pub async fn serve(config: RunnerConfig, executors: Executors) -> Result<(), ServeError> {
    let addr = config.listen;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Bind { addr, source })?;
    let runner = Arc::new(Runner::new(config, executors).map_err(ServeError::Client)?);
    let warming = runner.clone();
    tokio::spawn(async move {
        if let Err(error) = warming.warm_up().await {
            // A bare diagnostic: without workers there is no framework log to reach.
            tracing::error!(%error, "the runner could not warm up; /healthz stays 503");
        }
    });
    tracing::info!(
        "kiln runner listening on {}",
        listener.local_addr().unwrap_or(addr)
    );
    axum::serve(listener, api::router(runner))
        .with_graceful_shutdown(shutdown())
        .await
        .map_err(ServeError::Serve)
}

async fn shutdown() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate => {}
    }
}

/// The JSON Schemas the runner serves at `/schema/{file}` and that docs/runner/ holds:
/// `(file name, schema)`.
pub fn schemas() -> Vec<(&'static str, Value)> {
    vec![
        ("request.json", protocol::request_schema()),
        ("response.json", protocol::response_schema()),
        ("error.json", protocol::error_schema()),
        (
            "workflow.json",
            schemars::schema_for!(workflow::WorkflowDef).to_value(),
        ),
        (
            "template.json",
            schemars::schema_for!(template::TemplateDef).to_value(),
        ),
    ]
}

#[cfg(test)]
mod tests {
    /// The checked-in schemas under docs/runner/ are the ones the types give. Run with
    /// `KILN_UPDATE_SCHEMAS=1` to rewrite them after changing a type.
    #[test]
    fn checked_in_schemas_match_the_types() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/runner");
        let update = std::env::var_os("KILN_UPDATE_SCHEMAS").is_some();
        for (file, schema) in super::schemas() {
            let text = serde_json::to_string_pretty(&schema).unwrap() + "\n";
            let path = dir.join(file);
            if update {
                std::fs::create_dir_all(&dir).unwrap();
                std::fs::write(&path, &text).unwrap();
            }
            let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
            // Compared as JSON values: key order depends on serde_json features, which
            // differ between `cargo test -p kiln-runner` and a whole-workspace build.
            let checked_in: serde_json::Value =
                serde_json::from_str(&checked_in).unwrap_or(serde_json::Value::Null);
            assert!(
                checked_in == schema,
                "{} is out of date; run `KILN_UPDATE_SCHEMAS=1 cargo test -p kiln-runner` and commit it",
                path.display()
            );
        }
    }
}
