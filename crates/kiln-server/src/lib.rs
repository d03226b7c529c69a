//! `kiln serve`: the platform HTTP API. Untrusted code runs in executor worker processes
//! (`kiln_executor::ExecutorPool`), never in this process.
//!
//! This is the first part of the serve issue: the published `/api/sandbox` contract
//! (create, exec, get, delete), its error shape, per-sandbox workspaces and expiry. Auth,
//! sessions, streaming, git history, OpenAPI and durable state come next.

pub mod api;
pub mod error;
pub mod sandbox;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use kiln_executor::ExecutorPool;

pub use api::AppState;
pub use error::ApiError;

/// Largest request body: 32 MiB.
pub const MAX_BODY_BYTES: usize = 32 << 20;

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address to listen on. Default `127.0.0.1:8080`.
    pub listen: SocketAddr,
    /// Folder for workspaces and state. Default `~/.local/share/kiln`.
    pub data_dir: PathBuf,
}

/// The routes, over `state`.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/api/sandbox", post(api::create))
        .route("/api/sandbox/exec", post(api::exec))
        .route("/api/sandbox/{id}", get(api::get).delete(api::delete))
        .route("/healthz", get(api::healthz))
        .fallback(api::not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// Runs the server until ctrl-c or SIGTERM.
pub async fn serve(config: ServerConfig, pool: ExecutorPool) -> std::io::Result<()> {
    let registry = sandbox::Registry::new(config.data_dir.clone())?;
    let state = Arc::new(AppState { registry, pool });
    let reaper = state.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            reaper.registry.reap_expired();
        }
    });
    let listener = tokio::net::TcpListener::bind(config.listen).await?;
    eprintln!(
        "kiln: serving on http://{} (data in {})",
        listener.local_addr()?,
        config.data_dir.display()
    );
    eprintln!(
        "kiln: WARNING: authentication is not implemented yet: anyone who can reach this address can run code"
    );
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown_signal())
        .await
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}
