//! Sessions (code contexts): a sandbox's live interpreter state, held by a worker, whose
//! variables persist between turns. Records live in the sandbox's `meta.json`; the live
//! state is a [`kiln_executor::SessionHandle`].

use std::sync::Arc;

use kiln_core::{ExecRequest, Language, Limits};
use kiln_executor::CallOptions;
use serde::Serialize;
use utoipa::ToSchema;

use crate::Runtime;
use crate::auth::Caller;
use crate::error::{Result, RuntimeError};
use crate::exec::detached;
use crate::sandbox::{SessionMeta, new_id, now_ms, rfc3339};

/// The most sessions one sandbox holds.
pub const MAX_SESSIONS_PER_SANDBOX: usize = 16;

/// A session of a sandbox.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SessionInfo {
    #[schema(example = "ses_3f2a9c1b7d4e5f60718293a4")]
    pub session_id: String,
    #[schema(example = "python")]
    pub language: String,
    /// `ready`, or `ended` (timed out, crashed, cancelled or lost to a restart: restart it).
    #[schema(example = "ready")]
    pub status: String,
    pub turns: u64,
    pub created_at: String,
}

/// Opens a new session in sandbox `id` (in `language`, default the sandbox's).
pub async fn create(
    rt: &Runtime,
    caller: &Caller,
    id: &str,
    language: Option<Language>,
) -> Result<SessionInfo> {
    let view = rt.registry.get(&caller.tenant, id)?;
    if view.meta.sessions.len() >= MAX_SESSIONS_PER_SANDBOX {
        return Err(RuntimeError::TooManySessions {
            limit: MAX_SESSIONS_PER_SANDBOX,
        });
    }
    let language = language.unwrap_or(view.meta.language);
    open(rt, caller, id, language, new_id("ses_")).await
}

/// Opens a session in sandbox `id` under the given id.
pub async fn open(
    rt: &Runtime,
    caller: &Caller,
    id: &str,
    language: Language,
    session_id: String,
) -> Result<SessionInfo> {
    let view = rt.registry.get(&caller.tenant, id)?;
    let mut request = ExecRequest::new(language, "");
    request.workspace = Some(view.meta.workspace());
    request.workspace_at = view.meta.workspace_at.clone();
    request.env = crate::exec::sandbox_env(&view.meta, &[]);
    request.limits = Limits {
        memory_bytes: view.meta.memory_bytes,
        ..Limits::default()
    };
    let quotas = rt.quotas(caller);
    rt.registry
        .usage(&caller.tenant)
        .check_session(&quotas, view.meta.memory_bytes)?;
    let options = CallOptions::for_tenant(&caller.tenant, quotas.cpu_weight);
    let template = view.meta.template();
    request.template = rt.request_template(template);
    request.network = view.meta.network;
    request.resources = view.meta.resources;
    let handle = rt
        .pool_for(template)?
        .open_session_with(request, options)
        .await?;
    let meta = SessionMeta {
        id: session_id.clone(),
        language,
        created_ms: now_ms(),
        turns: 0,
    };
    if let Err(error) = rt.registry.add_session(id, meta.clone(), handle, &quotas) {
        rt.close_session(template, &handle).await;
        return Err(error);
    }
    Ok(SessionInfo {
        session_id,
        language: language.name().into(),
        status: "ready".into(),
        turns: 0,
        created_at: rfc3339(meta.created_ms),
    })
}

/// Restarts a session: its state is dropped and a fresh one takes its id. The sandbox is
/// busy meanwhile; the restart runs to its end even if the caller stops waiting.
pub async fn restart(
    rt: &Arc<Runtime>,
    caller: &Caller,
    id: &str,
    session: &str,
) -> Result<SessionInfo> {
    let work = new_id("restart_");
    let (sandbox, _cancel, _) = rt.registry.begin(&caller.tenant, id, &work, None)?;
    let template = sandbox.template().to_owned();
    let (rt, caller, id, session) = (
        rt.clone(),
        caller.clone(),
        id.to_owned(),
        session.to_owned(),
    );
    detached(async move {
        let done = async {
            let (meta, handle) = rt.registry.session(&caller.tenant, &id, &session)?;
            if let Some(handle) = handle {
                rt.registry.drop_session_state(&id, &session);
                rt.close_session(&template, &handle).await;
            }
            open(&rt, &caller, &id, meta.language, session.clone()).await
        }
        .await;
        rt.registry.finish(&id, None).and(done)
    })
    .await
}

/// Closes a session and forgets it.
pub async fn close(rt: &Runtime, caller: &Caller, id: &str, session: &str) -> Result<()> {
    let template = rt
        .registry
        .get(&caller.tenant, id)?
        .meta
        .template()
        .to_owned();
    if let Some(handle) = rt.registry.remove_session(&caller.tenant, id, session)? {
        rt.close_session(&template, &handle).await;
    }
    Ok(())
}
