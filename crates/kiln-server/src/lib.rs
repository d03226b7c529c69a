//! `kiln serve`: the platform HTTP API. Untrusted code runs in executor worker processes
//! (`kiln_executor::ExecutorPool`), never in this process.
//!
//! Handlers only: each parses a request, calls [`kiln_runtime`] and maps the result
//! ([`kiln_runtime::RuntimeError`] becomes an [`ApiError`] in one place, `error.rs`).
//!
//! - `api`: the published `/api/sandbox` contract and the workspace history routes.
//! - `v1`: `/api/v1`: sandboxes, executions (SSE, WebSocket, cancel), sessions, files.
//! - `mcp`, `chat` and `agent`: MCP tools and the chat agent, over the same runtime.
//! - `gate`: the per-request middleware (keys, rate limit, timeout, access log, metrics).
//! - `openapi`: the generated description and the docs pages.

pub mod agent;
pub mod api;
pub mod boxes;
pub mod chat;
pub mod cluster;
pub mod console;
pub mod e2b;
pub mod error;
pub mod gate;
pub mod keys;
pub mod mcp;
pub mod openapi;
pub mod preview;
pub mod secrets;
pub mod site;
pub mod snapshots;
pub mod templates;
pub mod terminals;
pub mod v1;
pub mod volumes;
pub mod workflows;
pub mod workspaces;

// The runtime's modules under their old names, for the handlers.
use kiln_runtime::{auth, exec, history, quota, sandbox};

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::middleware::{from_fn, from_fn_with_state};
use axum::routing::{get, post};
use kiln_core::template::Catalogue;
use kiln_runtime::{Pools, Runtime, RuntimeConfig};

pub use error::ApiError;

/// Largest request body: 32 MiB.
pub const MAX_BODY_BYTES: usize = 32 << 20;

/// Shared state of the server.
pub struct AppState {
    /// Sandboxes, sessions, files and history, over the executor pool.
    pub runtime: Arc<Runtime>,
    pub auth: auth::Auth,
    pub limiter: gate::RateLimiter,
    pub request_timeout: Duration,
    /// Host names `/mcp` accepts in `Host` (DNS-rebinding protection).
    pub mcp_hosts: Vec<String>,
    /// The tenant each `/mcp` session belongs to.
    pub mcp_sessions: gate::McpSessionOwners,
    /// The model for `/api/v1/chat` (`Err`: how to configure one).
    pub llm: Result<Arc<dyn kiln_llm::ChatModel>, String>,
    /// Budgets of one agent run.
    pub agent_limits: agent::AgentLimits,
    /// The model settings (for a chat request naming its own model).
    pub llm_env: kiln_llm::LlmEnv,
    /// Whether the executor workers are confined.
    pub worker_jail: kiln_executor::confine::JailReport,
    /// The isolation tiers as found at start (`/readyz`).
    pub tiers: Vec<api::Tier>,
    /// Signs and checks preview (and terminal page) tokens.
    pub previews: preview::Signer,
    /// Linux sandboxes' terminals.
    pub terminals: terminals::Terminals,
    /// The domain of previews by host name, if the operator gave one.
    pub preview_domain: Option<String>,
    /// Workflows and their templates.
    pub workflows: workflows::Workflows,
    /// The data folder (`keys.json` for the admin routes).
    pub data_dir: PathBuf,
    /// This server's part in a cluster (`--database`), once it has joined.
    pub cluster: std::sync::OnceLock<Arc<cluster::Cluster>>,
}

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address to listen on (the binary's default is `127.0.0.1:3000`).
    pub listen: SocketAddr,
    /// Folder for sandboxes, workspaces, history and keys.
    pub data_dir: PathBuf,
    /// Require API keys (default). Off: every caller is the `local` tenant.
    pub auth: bool,
    /// Requests a second per key (bursts of twice that); 0 = no limit.
    pub rate_limit: u32,
    /// How long a request may take before it is answered with 408.
    pub request_timeout: Duration,
    /// Extra host names clients use to reach this server (for `/mcp`'s `Host` check;
    /// loopback names and the listen address are always accepted).
    pub public_hosts: Vec<String>,
    /// Previews by host name: `{port}-{id}.{domain}` (see [`preview::by_host`]).
    pub preview_domain: Option<String>,
    /// A folder of workflow templates besides the built-in ones.
    pub workflow_templates: Option<PathBuf>,
    /// Each tenant's quotas unless its key says otherwise.
    pub quotas: quota::Quotas,
    /// The bounds of each tenant's line of executions over its quota.
    pub admission: kiln_runtime::admission::AdmissionConfig,
    /// Whether the executor workers are confined (`/readyz`, `/metrics`).
    pub worker_jail: kiln_executor::confine::JailReport,
    /// The templates the backends offer, in order of preference.
    pub catalogue: Catalogue,
    /// The model settings, read once from the environment by the binary.
    pub llm: kiln_llm::LlmEnv,
    /// Languages routed to a template of the operator's choice (`python` → `linux-python`).
    pub routes: Vec<(kiln_core::Language, String)>,
    /// The longest one execution may run (default 5 minutes).
    pub max_exec_ms: u64,
    /// The operator's cap on every sandbox's life (`--max-sandbox-life`); `None`: none.
    pub max_life_ms: Option<u64>,
    /// Where the E2B facade listens, and its settings; `None`: no facade.
    pub e2b: Option<(SocketAddr, e2b::E2bConfig)>,
    /// The isolation tiers as found at start (`/readyz`); empty: not reported.
    pub tiers: Vec<api::Tier>,
    /// Join a cluster (`--database`); `None`: a server on its own.
    pub cluster: Option<cluster::ClusterConfig>,
}

impl AppState {
    /// State over the data directory of `config`.
    pub fn open(config: &ServerConfig, pools: Pools) -> std::io::Result<AppState> {
        let model = config.llm.model();
        let runtime = Runtime::open(
            RuntimeConfig {
                data_dir: config.data_dir.clone(),
                quotas: config.quotas,
                catalogue: config.catalogue.clone(),
                routes: config.routes.clone(),
                max_exec_ms: config.max_exec_ms,
                admission: config.admission,
                max_life_ms: config.max_life_ms,
            },
            pools,
        )?;
        Ok(AppState {
            runtime: Arc::new(runtime),
            auth: if config.auth {
                auth::Auth::Keys(auth::KeyStore::new(&config.data_dir))
            } else {
                auth::Auth::Off
            },
            limiter: gate::RateLimiter::new(config.rate_limit),
            request_timeout: config.request_timeout,
            mcp_sessions: gate::McpSessionOwners::default(),
            mcp_hosts: {
                let mut hosts: Vec<String> = ["localhost", "127.0.0.1", "::1"]
                    .iter()
                    .map(|h| (*h).to_owned())
                    .collect();
                hosts.push(config.listen.ip().to_string());
                hosts.extend(config.public_hosts.iter().cloned());
                hosts
            },
            llm: chat::configured_model(&model),
            agent_limits: agent::AgentLimits {
                retry: model.as_ref().map(|c| c.retry).unwrap_or_default(),
                model_timeout: model
                    .as_ref()
                    .map_or(Duration::from_secs(120), |c| c.timeout),
                ..agent::AgentLimits::default()
            },
            llm_env: config.llm.clone(),
            worker_jail: config.worker_jail,
            tiers: config.tiers.clone(),
            previews: preview::Signer::open(&config.data_dir)?,
            terminals: terminals::Terminals::default(),
            preview_domain: config.preview_domain.clone(),
            workflows: workflows::Workflows::open(
                &config.data_dir,
                workflows::Templates::load(config.workflow_templates.as_deref())
                    .map_err(std::io::Error::other)?,
            ),
            data_dir: config.data_dir.clone(),
            cluster: std::sync::OnceLock::new(),
        })
    }
}

/// The routes, over `state`.
pub fn router(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/chat", post(chat::chat))
        .route("/templates", get(templates::list))
        .route("/me", get(keys::me))
        .route("/cluster", get(cluster::view))
        .route("/keys", get(keys::list).post(keys::create))
        .route(
            "/keys/{key}",
            axum::routing::patch(keys::update).delete(keys::revoke),
        )
        .route("/tenants", get(keys::tenants))
        .route("/sandboxes", get(v1::list).post(v1::create))
        .route("/sandboxes/{id}", get(v1::get).delete(v1::delete))
        .route("/sandboxes/{id}/renew", post(v1::renew))
        .route(
            "/sandboxes/{id}/network",
            axum::routing::put(v1::set_network),
        )
        .route("/sandboxes/{id}/snapshots", post(snapshots::take))
        .route("/sandboxes/{id}/fork", post(snapshots::fork))
        .route("/snapshots", get(snapshots::list))
        .route(
            "/snapshots/{snapshot}",
            get(snapshots::get).delete(snapshots::delete),
        )
        .route(
            "/workspaces",
            get(workspaces::list).post(workspaces::create),
        )
        .route(
            "/workspaces/{workspace}",
            get(workspaces::get).delete(workspaces::delete),
        )
        .route("/workspaces/{workspace}/start", post(workspaces::start))
        .route("/workspaces/{workspace}/stop", post(workspaces::stop))
        .route(
            "/workspaces/{workspace}/services",
            post(workspaces::add_service),
        )
        .route("/workspaces/{workspace}/sql", post(workspaces::sql))
        .route("/workspaces/{workspace}/preview", post(workspaces::preview))
        .route("/workspaces/{workspace}/files", get(workspaces::list_files))
        .route(
            "/workspaces/{workspace}/files/{*path}",
            get(workspaces::read_file)
                .put(workspaces::write_file)
                .delete(workspaces::delete_file),
        )
        .route("/workspaces/{workspace}/history", get(workspaces::history))
        .route(
            "/workspaces/{workspace}/collaborators",
            axum::routing::put(workspaces::collaborators),
        )
        .route("/workflow-templates", get(workflows::templates))
        .route("/workflows", get(workflows::list).post(workflows::create))
        .route("/workflows/{workflow}", get(workflows::get))
        .route("/workflows/{workflow}/events", get(workflows::events))
        .route(
            "/workflows/{workflow}/cancel",
            post(workflows::cancel_route),
        )
        .route("/workflows/{workflow}/submit", post(workflows::submit))
        .route("/workflows/{workflow}/review", post(workflows::review))
        .route("/volumes", get(volumes::list).post(volumes::create))
        .route(
            "/volumes/{volume}",
            get(volumes::get).delete(volumes::delete),
        )
        .route("/secrets", get(secrets::list).post(secrets::create))
        .route(
            "/secrets/{secret}",
            get(secrets::get)
                .put(secrets::update)
                .delete(secrets::delete),
        )
        .route("/sandboxes/{id}/processes", get(boxes::list))
        .route(
            "/sandboxes/{id}/processes/{pid}/signal",
            post(boxes::signal),
        )
        .route("/sandboxes/{id}/restart", post(boxes::restart))
        .route("/sandboxes/{id}/ports", get(preview::ports))
        .route(
            "/sandboxes/{id}/terminals",
            get(terminals::list).post(terminals::create),
        )
        .route(
            "/sandboxes/{id}/terminals/{tid}",
            get(terminals::attach).delete(terminals::delete),
        )
        .route(
            "/sandboxes/{id}/terminals/{tid}/links",
            post(terminals::link),
        )
        .route("/sandboxes/{id}/previews", post(preview::create_link))
        .route("/sandboxes/{id}/sites", post(site::create_link))
        .route("/sandboxes/{id}/events", get(boxes::events))
        .route("/sandboxes/{id}/pause", post(boxes::pause))
        .route("/sandboxes/{id}/resume", post(boxes::resume))
        .route("/sandboxes/{id}/hibernate", post(boxes::hibernate))
        .route("/sandboxes/{id}/exec", post(v1::execute))
        .route("/sandboxes/{id}/exec/stream", post(v1::execute_stream))
        .route("/sandboxes/{id}/ws", get(v1::websocket))
        .route(
            "/sandboxes/{id}/executions/{execution_id}/cancel",
            post(v1::cancel),
        )
        .route(
            "/sandboxes/{id}/sessions",
            get(v1::list_sessions).post(v1::create_session),
        )
        .route(
            "/sandboxes/{id}/sessions/{session_id}",
            axum::routing::delete(v1::close_session),
        )
        .route(
            "/sandboxes/{id}/sessions/{session_id}/restart",
            post(v1::restart_session),
        )
        .route(
            "/sandboxes/{id}/sessions/{session_id}/fork",
            post(v1::fork_session),
        )
        .route("/sandboxes/{id}/files", get(v1::list_files))
        .route(
            "/sandboxes/{id}/files/{*path}",
            get(v1::read_file)
                .put(v1::write_file)
                .delete(v1::delete_file),
        )
        .route("/sandboxes/{id}/history", get(api::history))
        .route("/sandboxes/{id}/diff", post(api::diff))
        .route("/sandboxes/{id}/rollback", post(api::rollback));
    Router::new()
        .route("/api/sandbox", post(api::create))
        .route("/api/sandbox/exec", post(api::exec))
        .route("/api/sandbox/{id}", get(api::get).delete(api::delete))
        .route("/api/sandbox/{id}/history", get(api::history))
        .route("/api/sandbox/{id}/diff", post(api::diff))
        .route("/api/sandbox/{id}/rollback", post(api::rollback))
        .nest("/api/v1", v1)
        .route("/console", get(console::root))
        .route("/console/", get(console::index))
        .route("/console/assets/{name}", get(console::asset))
        .route("/terminal/assets/{name}", get(terminals::asset))
        .route("/terminal/{id}/{tid}/", get(terminals::page))
        .route("/terminal/{id}/{tid}/ws", get(terminals::page_socket))
        .route("/site/{id}", get(site::root))
        .route("/site/{id}/", axum::routing::any(site::serve))
        .route("/site/{id}/{*path}", axum::routing::any(site::serve))
        .route("/preview/{id}/{port}", axum::routing::any(preview::proxy))
        .route("/preview/{id}/{port}/", axum::routing::any(preview::proxy))
        .route(
            "/preview/{id}/{port}/{*path}",
            axum::routing::any(preview::proxy),
        )
        .route("/healthz", get(api::healthz))
        .route("/readyz", get(api::readyz))
        .route("/metrics", get(api::metrics))
        .route("/openapi.json", get(openapi::openapi_json))
        .route("/docs", get(openapi::swagger_page))
        .route("/docs/swagger-ui-bundle.js", get(openapi::swagger_js))
        .route("/docs/swagger-ui.css", get(openapi::swagger_css))
        .route("/redoc", get(openapi::redoc_page))
        .route("/redoc/redoc.standalone.js", get(openapi::redoc_js))
        .nest_service(
            "/mcp",
            mcp::http_service(state.clone(), state.mcp_hosts.clone()),
        )
        .fallback(api::not_found)
        // Innermost first: each layer wraps those above it.
        .layer(from_fn_with_state(state.clone(), cluster::elsewhere))
        .layer(from_fn_with_state(
            kiln_http::error::RouterErrors::new(MAX_BODY_BYTES),
            gate::json_errors,
        ))
        .layer(from_fn_with_state(state.clone(), gate::bind_mcp_sessions))
        .layer(from_fn_with_state(state.clone(), gate::timeout))
        .layer(from_fn(gate::body_limit))
        .layer(from_fn_with_state(state.clone(), gate::workspace_guard))
        .layer(from_fn_with_state(state.clone(), gate::rate_limit))
        .layer(from_fn_with_state(state.clone(), gate::authenticate))
        .layer(from_fn_with_state(state.clone(), gate::metrics))
        .layer(from_fn(gate::access_log))
        .layer(from_fn(gate::request_id))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// Runs the server until ctrl-c or SIGTERM; running requests finish first.
pub async fn serve(config: ServerConfig, pools: Pools) -> std::io::Result<()> {
    let state = Arc::new(AppState::open(&config, pools)?);
    if let Some(cluster) = &config.cluster {
        let joined = cluster::join(cluster, state.runtime.clone()).await?;
        let _ = state.cluster.set(joined);
    }
    state.runtime.start_events();
    workflows::resume_all(&state);
    let ticking = state.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let runtime = &ticking.runtime;
            runtime.tick().await;
            runtime
                .enforce_paused_quota(|sandbox| match ticking.auth.acting_for(sandbox) {
                    Some(owner) => runtime.quotas(&owner),
                    None => runtime.quotas,
                })
                .await;
        }
    });
    let listener = tokio::net::TcpListener::bind(config.listen).await?;
    let address = listener.local_addr()?;
    tracing::info!(
        target: "kiln::serve",
        "serving on http://{address} (data in {}; API docs at http://{address}/docs)",
        config.data_dir.display()
    );
    match &state.auth {
        auth::Auth::Off => {
            let banner = "WARNING: authentication is OFF (--no-auth): anyone who can reach this address can run code and read every sandbox";
            eprintln!("kiln: {banner}");
            tracing::warn!(target: "kiln::serve", "{banner}");
        }
        auth::Auth::Keys(keys) if keys.count() == 0 => {
            let note = "no API keys yet: every request will get 401 until you create one with `kiln keys create`";
            eprintln!("kiln: {note}");
            tracing::warn!(target: "kiln::serve", "{note}");
        }
        auth::Auth::Keys(_) => {}
    }
    match &state.llm {
        Ok(model) => tracing::info!(target: "kiln::serve", "chat model: {}", model.name()),
        Err(why) => {
            tracing::info!(target: "kiln::serve", "no chat model (POST /api/v1/chat answers 503): {why}")
        }
    }
    // TCP_NODELAY: a streamed body (a download, SSE) is written after its headers; with Nagle
    // the second small write waited for the client's delayed ACK, 40 ms per download.
    let listener = axum::serve::ListenerExt::tap_io(listener, |stream| {
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!("could not set TCP_NODELAY: {e}");
        }
    });
    let facade = match &config.e2b {
        Some((address, e2b_config)) => {
            let listener = tokio::net::TcpListener::bind(address).await?;
            tracing::info!(
                target: "kiln::serve",
                "E2B facade on http://{0} (E2B_API_URL=http://{0} E2B_SANDBOX_URL=http://{0})",
                listener.local_addr()?
            );
            Some(tokio::spawn(e2b::serve(
                listener,
                state.clone(),
                e2b_config.clone(),
                shutdown_signal(),
            )))
        }
        None => None,
    };
    axum::serve(listener, router(state.clone()))
        .with_graceful_shutdown(shutdown_signal())
        .await?;
    if let Some(facade) = facade {
        let _ = facade.await;
    }
    state.runtime.registry.flush_usage();
    state.runtime.registry.detach_volumes();
    Ok(())
}

pub use kiln_http::shutdown_signal;
