//! A workspace's history: pages of changes, diffs between two points, rollback.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::Runtime;
use crate::auth::Caller;
use crate::error::{Result, RuntimeError};
use crate::exec::{self, blocking, with_sandbox};
use crate::history::{HistoryEntry, HistoryError, MAX_HISTORY};
use crate::sandbox::new_id;

/// A page of changes, newest first (at most `limit`, 1 to [`MAX_HISTORY`]), starting after
/// `cursor` (the previous page's cursor: its last entry's commit id); returns the next page's
/// cursor too, `None` on the last page. Costs what the page's entries cost, however long the
/// history ([`crate::history::History::page`]); a cursor that is not a commit of this
/// history is [`RuntimeError::InvalidCursor`].
pub async fn page(
    rt: &Runtime,
    caller: &Caller,
    id: &str,
    limit: usize,
    cursor: Option<String>,
) -> Result<(Vec<HistoryEntry>, Option<String>)> {
    if !(1..=MAX_HISTORY).contains(&limit) {
        return Err(RuntimeError::InvalidRequest {
            message: format!("limit must be 1 to {MAX_HISTORY}"),
        });
    }
    let sandbox = rt.registry.get(&caller.tenant, id)?.meta;
    blocking(move || {
        sandbox
            .history()?
            .page(limit, cursor.as_deref())
            .map_err(|e| match e {
                HistoryError::UnknownId(cursor) => RuntimeError::InvalidCursor { cursor },
                other => other.into(),
            })
    })
    .await
}

/// Unified diffs, one per changed file, between history ids `from` and `to` (default the
/// newest).
pub async fn diff(
    rt: &Runtime,
    caller: &Caller,
    id: &str,
    from: String,
    to: Option<String>,
) -> Result<BTreeMap<String, String>> {
    let sandbox = rt.registry.get(&caller.tenant, id)?.meta;
    blocking(move || {
        let history = sandbox.history()?;
        let to = match to {
            Some(to) => to,
            None => history.entries(1)?.pop().map(|e| e.id).unwrap_or_default(),
        };
        Ok(history.diff(&from, &to)?)
    })
    .await
}

/// Records a note in sandbox `id`'s history (a commit with no file changes, `summary` its
/// message, `change` its id): its commit id.
pub async fn note(
    rt: &Runtime,
    caller: &Caller,
    id: &str,
    summary: String,
    change: String,
) -> Result<String> {
    let sandbox = rt.registry.get(&caller.tenant, id)?.meta;
    blocking(move || Ok(sandbox.history()?.note(&summary, &change)?)).await
}

/// The commit id of sandbox `id`'s newest change.
pub async fn head(rt: &Runtime, caller: &Caller, id: &str) -> Result<String> {
    let sandbox = rt.registry.get(&caller.tenant, id)?.meta;
    blocking(move || Ok(sandbox.history()?.head_id()?)).await
}

/// The files that changed in sandbox `id` between changes `from` and `to`.
pub async fn changed(
    rt: &Runtime,
    caller: &Caller,
    id: &str,
    from: String,
    to: String,
) -> Result<Vec<String>> {
    let sandbox = rt.registry.get(&caller.tenant, id)?.meta;
    blocking(move || Ok(sandbox.history()?.changed_between(&from, &to)?)).await
}

/// A finished rollback.
#[derive(Debug)]
pub struct RolledBack {
    /// The rollback's own history id.
    pub id: String,
    pub commit_id: Option<String>,
}

/// Restores the workspace to its state after history id `target`, recorded as a new entry.
/// The sandbox must be idle; the rollback runs to its end even if the caller stops waiting.
pub async fn rollback(
    rt: &Arc<Runtime>,
    caller: &Caller,
    id: &str,
    target: String,
) -> Result<RolledBack> {
    let rollback_id = new_id("rollback_");
    let new_id = rollback_id.clone();
    let recorded = with_sandbox(rt, caller, id, &rollback_id, move |rt, sandbox| {
        let recorded = sandbox
            .history()?
            .rollback(&sandbox.tree()?, &target, &new_id)?;
        exec::note_recorded(&rt.registry, &sandbox, &recorded);
        Ok(recorded)
    })
    .await?;
    Ok(RolledBack {
        id: rollback_id,
        commit_id: recorded.commit_id,
    })
}
