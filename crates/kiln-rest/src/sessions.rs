//! Tenants' sandbox sessions: admission (new tenants per address), a cap on live sessions
//! with least-recently-used eviction of idle ones, the idle timeout, the turns, and what a
//! tenant leaves on disk when its session ends.
//!
//! The table of slots, the cap, eviction and the idle timeout are the runtime's
//! ([`kiln_runtime::live::LiveSessions`], `App::live`); what ending a tenant's session means
//! (closing it, removing what a tenant that stored nothing left) is kiln rest's
//! [`Retire`](kiln_runtime::live::Retire), called with the tenant's lock held.

use std::time::{Duration, Instant};

use axum::http::StatusCode;
use kiln_core::{ExecRequest, ExecResult, Language, Limits, Mount, Outcome};
use kiln_executor::{CallOptions, Door, PoolError, SessionHandle};
use serde_json::Value;

use kiln_http::HttpError;

use crate::{App, Slot, python};

impl App {
    /// The tenant's slot. A tenant with no slot here and no folder on disk is new and
    /// spends one of the client address's new tenants (429 when none is left; nothing is
    /// created then).
    pub(crate) fn admit(&self, tenant: &str, peer: std::net::IpAddr) -> Result<Slot, HttpError> {
        if let Some(slot) = self.live.get(tenant) {
            return Ok(slot);
        }
        if !self.tenant_dir(tenant).is_dir()
            && let Err(retry) = self.new_tenants.admit(peer, Instant::now())
        {
            return Err(HttpError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "TOO_MANY_NEW_TENANTS",
                format!(
                    "this address has used up its {} new tenants a minute; retry in {} s, or \
                     use a tenant it already has",
                    self.config.new_tenants_per_minute,
                    retry.seconds()
                ),
            )
            .retry_after(retry.seconds()));
        }
        Ok(self.live.get_or_insert(tenant))
    }

    fn tenant_dir(&self, tenant: &str) -> std::path::PathBuf {
        self.config.data_dir.join("tenants").join(tenant)
    }

    /// Closes the sessions of tenants idle longer than `idle_timeout` (their data stays on
    /// disk; the next request opens a fresh session).
    pub(crate) async fn close_idle(&self) {
        self.live.close_idle(self, self.config.idle_timeout).await;
    }

    /// Counts a session about to open against the cap, evicting idle ones to make room;
    /// 503 when every live session is busy.
    async fn reserve(&self, tenant: &str) -> Result<(), HttpError> {
        self.live.reserve(self, tenant).await.map_err(|full| {
            HttpError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "TOO_MANY_SESSIONS",
                format!(
                    "all {} tenant sessions are busy serving requests; retry in a moment",
                    full.max
                ),
            )
            .retry_after(1)
        })
    }

    pub(crate) async fn discard_if_empty(&self, tenant: &str) {
        let dir = self.tenant_dir(tenant);
        let plans = self.plans.clone();
        let tenant = tenant.to_string();
        let _ = tokio::task::spawn_blocking(move || {
            // Fails (and keeps everything) unless the folder is empty.
            match std::fs::remove_dir(&dir) {
                Ok(()) => plans.remove(&tenant),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => plans.remove(&tenant),
                Err(_) => plans.forget(&tenant),
            }
        })
        .await;
    }

    pub(crate) fn limits(&self, timeout: Duration) -> Limits {
        Limits {
            timeout_ms: u64::try_from(timeout.as_millis())
                .unwrap_or(u64::MAX)
                .max(1),
            memory_bytes: self.config.memory_bytes,
            stdout_bytes: self.config.max_result_bytes + (64 << 10),
            stderr_bytes: 64 << 10,
            fs_write_bytes: 256 << 20,
            fs_create_count: 1_000,
            fuel: None,
            session_growth_bytes: None,
        }
    }

    /// The tenant's live session, opened (with the driver loaded) when there is none.
    pub(crate) async fn session(
        &self,
        tenant: &str,
        guard: &mut Option<SessionHandle>,
    ) -> Result<SessionHandle, HttpError> {
        if let Some(session) = guard {
            return Ok(*session);
        }
        self.reserve(tenant).await?;
        match self.open(tenant).await {
            Ok(session) => {
                *guard = Some(session);
                Ok(session)
            }
            Err(error) => {
                self.live.release();
                self.discard_if_empty(tenant).await;
                Err(error)
            }
        }
    }

    async fn open(&self, tenant: &str) -> Result<SessionHandle, HttpError> {
        let lost = |e: PoolError| {
            HttpError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "SANDBOX_UNAVAILABLE",
                format!("the tenant's sandbox could not be started: {e}"),
            )
        };
        let dir = self.tenant_dir(tenant);
        std::fs::create_dir_all(&dir).map_err(|e| {
            HttpError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "STORAGE",
                format!("the tenant's folder could not be made: {e}"),
            )
        })?;
        let guest_root = format!("/data/{tenant}");
        let mut request = ExecRequest::new(Language::Python, "");
        request.limits = self.limits(Duration::from_secs(30));
        request.mounts = vec![Mount {
            host: dir,
            guest: guest_root.clone(),
            writable: true,
        }];
        // Each tenant is a tenant of its own in the worker's fair CPU sharing.
        let session = self
            .pool
            .open_session_with(request, CallOptions::for_tenant(tenant, 1))
            .await
            .map_err(lost)?;
        let loaded = self
            .pool
            .run_with(
                &session,
                python::loader(&guest_root, tenant),
                self.limits(Duration::from_secs(30)),
                CallOptions::for_tenant(tenant, 1),
            )
            .await;
        let loaded = match loaded {
            Ok(loaded) => loaded,
            Err(error) => {
                let _ = self.pool.close_session(&session).await;
                return Err(lost(error));
            }
        };
        if !loaded.success() {
            let _ = self.pool.close_session(&session).await;
            return Err(HttpError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "SANDBOX_SETUP",
                format!(
                    "the driver could not be loaded: {}",
                    tail(&loaded.stderr_text(), 400)
                ),
            ));
        }
        Ok(session)
    }

    /// Runs one driver turn and returns its answer. A turn that ends its session (deadline,
    /// crash) closes it; the next request opens a fresh one.
    pub(crate) async fn turn(
        &self,
        tenant: &str,
        guard: &mut Option<SessionHandle>,
        session: &SessionHandle,
        code: String,
        door: Option<Door>,
        timeout: Duration,
    ) -> Result<Value, HttpError> {
        let options = CallOptions {
            door,
            ..CallOptions::for_tenant(tenant, 1)
        };
        let result = self
            .pool
            .run_with(session, code, self.limits(timeout), options)
            .await;
        let result: ExecResult = match result {
            Ok(result) => result,
            Err(error) => {
                self.drop_session(guard).await;
                return Err(HttpError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "SANDBOX_LOST",
                    format!("the tenant's sandbox was lost ({error}); retry the request"),
                ));
            }
        };
        // A deadline or a crash ended the session; one over its memory is not reused.
        let ended = matches!(
            result.outcome,
            Outcome::TimedOut
                | Outcome::Crashed { .. }
                | Outcome::MemoryLimit
                | Outcome::FuelExhausted
        );
        if ended {
            self.drop_session(guard).await;
        }
        if let Some(error) = self.failed_turn(&result, timeout) {
            return Err(error);
        }
        python::answer(&result.stdout_text()).ok_or_else(|| {
            HttpError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "INTERNAL",
                format!(
                    "the driver gave no answer (exit {}): {}",
                    result.exit_code,
                    tail(&result.stderr_text(), 400)
                ),
            )
        })
    }

    /// The error of a turn the sandbox stopped (deadline, memory, crash) or whose output
    /// went past the result cap; `None` for one that ran to its end.
    fn failed_turn(&self, result: &ExecResult, timeout: Duration) -> Option<HttpError> {
        let error = match &result.outcome {
            Outcome::TimedOut => HttpError::new(
                StatusCode::GATEWAY_TIMEOUT,
                "DEADLINE_EXCEEDED",
                format!(
                    "the request ran past its deadline of {} ms and was stopped",
                    timeout.as_millis()
                ),
            ),
            Outcome::MemoryLimit => HttpError::new(
                StatusCode::INSUFFICIENT_STORAGE,
                "MEMORY_LIMIT",
                format!(
                    "the request needed more than the sandbox's {} MiB of memory",
                    self.config.memory_bytes >> 20
                ),
            ),
            Outcome::Crashed { trap } => HttpError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "SANDBOX_CRASHED",
                format!("the sandbox crashed ({trap})"),
            ),
            _ if result.stdout_truncated => HttpError::new(
                StatusCode::BAD_GATEWAY,
                "RESULT_TOO_LARGE",
                format!(
                    "the response is larger than the cap of {} bytes",
                    self.config.max_result_bytes
                ),
            ),
            _ => return None,
        };
        Some(error)
    }

    /// Closes the session, if any (its data stays).
    pub(crate) async fn drop_session(&self, guard: &mut Option<SessionHandle>) {
        if let Some(session) = guard.take() {
            self.live.release();
            let _ = self.pool.close_session(&session).await;
        }
    }
}

impl kiln_runtime::live::Retire for App {
    /// Ends a tenant's session (its lock held by the caller). A tenant that stored nothing
    /// leaves nothing behind: its empty folder and its plan cache file are removed.
    async fn retire(&self, tenant: &str, guard: &mut Option<SessionHandle>) {
        self.drop_session(guard).await;
        self.discard_if_empty(tenant).await;
    }

    fn evicted(&self, tenant: &str, for_tenant: &str) {
        let line = serde_json::json!({
            "target": "kiln::rest",
            "event": "session_evicted",
            "tenant": tenant,
            "for_tenant": for_tenant,
        });
        eprintln!("{line}");
    }
}

/// Removes empty tenant folders and the plan files of tenants without a folder, left by an
/// earlier run (a tenant that never stored anything keeps nothing on disk).
pub(crate) fn sweep(data_dir: &std::path::Path) {
    let tenants = data_dir.join("tenants");
    if let Ok(entries) = std::fs::read_dir(&tenants) {
        for entry in entries.filter_map(Result::ok) {
            // Fails, keeping it, unless empty.
            let _ = std::fs::remove_dir(entry.path());
        }
    }
    if let Ok(entries) = std::fs::read_dir(data_dir.join("plans")) {
        for entry in entries.filter_map(Result::ok) {
            let path = entry.path();
            let Some(tenant) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".json"))
            else {
                continue;
            };
            if !tenant.starts_with('.') && !tenants.join(tenant).is_dir() {
                let _ = std::fs::remove_file(&path);
            }
        }
    }
}

pub(crate) fn tail(text: &str, chars: usize) -> String {
    let text = text.trim_end();
    let count = text.chars().count();
    text.chars().skip(count.saturating_sub(chars)).collect()
}
