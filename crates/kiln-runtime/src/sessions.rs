//! Sessions (code contexts): a sandbox's live interpreter state, held by a worker, whose
//! variables persist between turns. Records live in the sandbox's `meta.json`; the live
//! state is a [`kiln_executor::SessionHandle`].

use std::sync::Arc;

use kiln_core::{ExecRequest, Language, Limits};
use kiln_executor::{CallOptions, PoolError, SessionHandle};
use serde::Serialize;
use utoipa::ToSchema;

use crate::Runtime;
use crate::auth::Caller;
use crate::error::{Result, RuntimeError};
use crate::exec::{blocking, detached};
use crate::quota::Quotas;
use crate::sandbox::{Sandbox, SandboxSpec, SessionMeta, new_id, now_ms, rfc3339};

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

/// The request that opens (or forks) a session in `language` in `sandbox`: its workspace,
/// environment, memory cap, template, network and resources.
fn session_request(rt: &Runtime, sandbox: &Sandbox, language: Language) -> ExecRequest {
    let mut request = ExecRequest::new(language, "");
    request.workspace = Some(sandbox.workspace());
    request.workspace_at = sandbox.workspace_at.clone();
    request.idle = sandbox.lifecycle.box_policy();
    request.env = crate::exec::sandbox_env(sandbox, &[]);
    request.limits = Limits {
        memory_bytes: sandbox.memory_bytes,
        ..Limits::default()
    };
    request.template = rt.request_template(sandbox.template(), language);
    request.network = sandbox.network;
    request.egress = sandbox.egress_grant();
    request.mounts = sandbox.mounts(&rt.registry.volumes);
    request.resources = sandbox.resources;
    request
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
    crate::processes::awake(rt, &view.meta).await?;
    let request = session_request(rt, &view.meta, language);
    let quotas = rt.quotas(caller);
    rt.registry
        .usage(&caller.tenant)
        .check_session(&quotas, rt.new_session_holds(&view.meta))?;
    let options = CallOptions::for_tenant(&caller.tenant, quotas.cpu_weight);
    let template = view.meta.template();
    let handle = rt
        .pool_for(template)?
        .open_session_with(request, options)
        .await?;
    record_session(rt, id, template, session_id, language, handle, &quotas).await
}

/// Records a session a worker holds now as `session_id` of sandbox `id` (made from
/// `template`), within the tenant's `quotas`; one over them is closed again.
async fn record_session(
    rt: &Runtime,
    id: &str,
    template: &str,
    session_id: String,
    language: Language,
    handle: SessionHandle,
    quotas: &Quotas,
) -> Result<SessionInfo> {
    let meta = SessionMeta {
        id: session_id.clone(),
        language,
        created_ms: now_ms(),
        turns: 0,
    };
    let holds = rt.session_holds(template);
    if let Err(error) = rt
        .registry
        .add_session(id, meta.clone(), handle, holds, quotas)
    {
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

/// A session forked from another, and where it lives.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ForkedSession {
    /// The sandbox the fork lives in: the parent's, or a new one (`withWorkspace`).
    #[schema(example = "sb_3f2a9c1b7d4e5f60718293a4")]
    pub sandbox_id: String,
    /// The session it was forked from (in the parent's sandbox).
    #[schema(example = "ses_0a1b2c3d4e5f60718293a4b5")]
    pub forked_from: String,
    #[serde(flatten)]
    pub session: SessionInfo,
}

/// Forks session `session` of sandbox `id`: a new session that starts with its variables,
/// imports and definitions (a copy-on-write copy of its memory), while the parent goes on
/// unchanged. The fork's `/tmp` starts empty, files open in the parent are not open in it,
/// and its random generators are reseeded.
///
/// Without `with_workspace` the fork is another session of the same sandbox (the same
/// workspace and grants; it counts against [`MAX_SESSIONS_PER_SANDBOX`]). With it, the fork
/// lives in a new sandbox of the same template and tenant whose workspace and history start
/// as the parent sandbox's are now (its files are recorded first): a copy of the history,
/// and of the files it records (links as links, never followed; files over 64 MiB, fifos
/// and devices left out), counted against the tenant's workspace quota.
///
/// The parent's sandbox is busy while it forks: a fork asked while a turn (or anything
/// else) runs there is refused with `SANDBOX_BUSY`, never made from a state half-way
/// through a turn. The fork runs to its end even if the caller stops waiting.
pub async fn fork(
    rt: &Arc<Runtime>,
    caller: &Caller,
    id: &str,
    session: &str,
    with_workspace: bool,
) -> Result<ForkedSession> {
    let work = new_id("fork_");
    let (parent, _cancel, _) = rt.registry.begin(&caller.tenant, id, &work, None)?;
    let (rt, caller, session) = (rt.clone(), caller.clone(), session.to_owned());
    detached(async move {
        let done = fork_begun(&rt, &caller, &parent, &session, with_workspace, &work).await;
        let finished = rt.registry.finish(&parent.id, None);
        // The parent was deleted meanwhile: a sandbox made for the fork goes too.
        if let (Err(_), Ok(forked)) = (&finished, &done)
            && forked.sandbox_id != parent.id
        {
            let _ = rt.delete_sandbox(&caller, &forked.sandbox_id).await;
        }
        finished.and(done)
    })
    .await
}

/// [`fork`], with the parent's sandbox busy with it as `work`.
async fn fork_begun(
    rt: &Arc<Runtime>,
    caller: &Caller,
    parent: &Sandbox,
    session: &str,
    with_workspace: bool,
    work: &str,
) -> Result<ForkedSession> {
    let (meta, handle) = rt.registry.session(&caller.tenant, &parent.id, session)?;
    let Some(handle) = handle else {
        return Err(RuntimeError::session_lost(&parent.id, session));
    };
    check_forkable(rt, parent, &meta)?;
    if !with_workspace {
        if parent.sessions.len() >= MAX_SESSIONS_PER_SANDBOX {
            return Err(RuntimeError::TooManySessions {
                limit: MAX_SESSIONS_PER_SANDBOX,
            });
        }
        let forked = fork_into(rt, caller, parent, parent, &meta, &handle).await?;
        return Ok(ForkedSession {
            sandbox_id: parent.id.clone(),
            forked_from: session.to_owned(),
            session: forked,
        });
    }
    // Over the session quota: refused before a sandbox is made for nothing.
    rt.registry
        .usage(&caller.tenant)
        .check_session(&rt.quotas(caller), rt.new_session_holds(parent))?;
    let child = fork_sandbox(rt, caller, parent, session, work).await?;
    match fork_into(rt, caller, parent, &child, &meta, &handle).await {
        Ok(forked) => Ok(ForkedSession {
            sandbox_id: child.id.clone(),
            forked_from: session.to_owned(),
            session: forked,
        }),
        Err(error) => {
            let _ = rt.delete_sandbox(caller, &child.id).await;
            Err(error)
        }
    }
}

/// Refuses a session its template cannot fork: a template says so in `capabilities.fork`,
/// for sessions in its own languages (a JavaScript session in a `python` sandbox cannot).
fn check_forkable(rt: &Runtime, sandbox: &Sandbox, session: &SessionMeta) -> Result<()> {
    let template = sandbox.template();
    let Some(info) = rt.catalogue().get(template) else {
        return Err(RuntimeError::Unsupported {
            message: format!("the template {template:?} is not installed on this server"),
        });
    };
    let language = session.language;
    if !info.capabilities.fork {
        return Err(RuntimeError::Unsupported {
            message: format!(
                "sessions of the {template} template cannot be forked (a template's capabilities.fork says whether its sessions can: GET /api/v1/templates)"
            ),
        });
    }
    if !info.languages.contains(&language) {
        return Err(RuntimeError::Unsupported {
            message: format!(
                "{language} sessions of the {template} template cannot be forked; its {} sessions can",
                info.default_language()
            ),
        });
    }
    Ok(())
}

/// Opens a fork of the session `parent_session` (held as `handle` for sandbox `parent`) in
/// sandbox `target`, with `target`'s grants, and records it there.
async fn fork_into(
    rt: &Runtime,
    caller: &Caller,
    parent: &Sandbox,
    target: &Sandbox,
    parent_session: &SessionMeta,
    handle: &SessionHandle,
) -> Result<SessionInfo> {
    let language = parent_session.language;
    let request = session_request(rt, target, language);
    let quotas = rt.quotas(caller);
    rt.registry
        .usage(&caller.tenant)
        .check_session(&quotas, target.memory_bytes)?;
    let options = CallOptions::for_tenant(&caller.tenant, quotas.cpu_weight);
    let template = parent.template();
    let forked = rt
        .pool_for(template)?
        .fork_session_with(handle, request, options)
        .await;
    let forked = match forked {
        Ok(forked) => forked,
        Err(error @ (PoolError::NoSuchSession(_) | PoolError::WorkerLost(_))) => {
            // The parent's state is gone with its worker: it has ended too.
            rt.registry
                .drop_session_state(&parent.id, &parent_session.id);
            return Err(match error {
                PoolError::NoSuchSession(_) => {
                    RuntimeError::session_lost(&parent.id, &parent_session.id)
                }
                other => other.into(),
            });
        }
        Err(error) => return Err(error.into()),
    };
    record_session(
        rt,
        &target.id,
        template,
        new_id("ses_"),
        language,
        forked,
        &quotas,
    )
    .await
}

/// A new sandbox of `parent`'s template, tenant and settings whose workspace and history
/// start as `parent`'s are now (recorded first, as change `work`).
async fn fork_sandbox(
    rt: &Arc<Runtime>,
    caller: &Caller,
    parent: &Sandbox,
    session: &str,
    work: &str,
) -> Result<Sandbox> {
    let quotas = rt.quotas(caller);
    // A fork lives as its parent does: a fixed life as long as the parent's, or the same
    // window of idleness.
    let lifetime_ms = match parent.lifecycle.terminate_after_idle_ms {
        Some(window) => window,
        None => parent.expires_ms.saturating_sub(parent.created_ms).clamp(
            crate::sandbox::MIN_LIFETIME_MS,
            crate::sandbox::MAX_LIFETIME_MS,
        ),
    };
    let owner = rt
        .catalogue()
        .get(parent.template())
        .and_then(|t| t.workspace_owner);
    let spec = SandboxSpec {
        image: parent.image.clone(),
        template: parent.template().to_owned(),
        language: parent.language,
        lifetime_ms,
        memory_bytes: parent.memory_bytes,
        network: parent.network,
        egress: parent.egress.clone(),
        egress_widen: parent.egress_widen,
        volume_mounts: parent.volume_mounts.clone(),
        resources: parent.resources,
        workspace_owner: owner,
        workspace_at: parent.workspace_at.clone(),
        metadata: Default::default(),
        env: parent.env.clone(),
        access_token: None,
        public_ports: false,
        key_id: parent.key_id.clone(),
        lifecycle: parent.lifecycle.clone(),
    };
    let (rt, tenant, parent, summary, work) = (
        rt.clone(),
        caller.tenant.clone(),
        parent.clone(),
        format!("fork of session {session}"),
        work.to_owned(),
    );
    blocking(move || {
        // What the parent's files are now is its history's head, which the fork starts at.
        crate::exec::record(&rt.registry, &parent, &summary, &work)?;
        let in_use = rt.registry.usage(&tenant).workspace_bytes;
        let child = rt
            .registry
            .create_seeded(&tenant, &spec, &quotas, |child| {
                seed_from(&parent, child, in_use, &quotas)
            })?;
        crate::exec::record(&rt.registry, &child, &summary, &work)?;
        rt.events
            .record(&child.id, "created", &format!("a fork of {}", parent.id));
        Ok(child)
    })
    .await
}

/// Fills the new sandbox `child` with `parent`'s history and files (see [`fork`]), within
/// what the tenant's workspace quota leaves (`in_use` bytes are in its workspaces now).
fn seed_from(parent: &Sandbox, child: &Sandbox, in_use: u64, quotas: &Quotas) -> Result<()> {
    parent.history()?.clone_into(&child.git_dir())?;
    let bounds = kiln_workspace::copy::CopyBounds {
        max_file_bytes: crate::history::MAX_FILE_BYTES,
        max_entries: crate::history::MAX_ENTRIES,
        max_total_bytes: quotas.workspace_bytes.saturating_sub(in_use),
    };
    let copied = kiln_workspace::copy::copy_tree(&parent.tree()?, &child.tree()?, &bounds)?;
    if copied.over_total {
        return Err(crate::quota::exceeded(
            "workspaceBytes",
            quotas.workspace_bytes,
            in_use,
            "bytes",
        ));
    }
    Ok(())
}
