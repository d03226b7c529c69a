//! Per-tenant quotas: how much of the server one tenant may hold at once. The server has
//! defaults (`kiln serve --max-…`); a key may override any of them (`kiln keys create
//! --max-…`). Going over one answers 429 `QUOTA_EXCEEDED`, naming the quota, its value and
//! what is in use. The checks that matter under a race (sandboxes, sessions, executions)
//! are made under the registry's lock, where the new thing is counted.

use serde::{Deserialize, Serialize};

use crate::error::RuntimeError;

/// What one tenant may hold at once.
///
/// Two sets of defaults: [`Quotas::default`] for each key of a server with keys, and
/// [`Quotas::whole_machine`] for the one tenant of a server without them (`--no-auth`: a
/// laptop, one team), which gets what the machine has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Quotas {
    /// Live sandboxes. Default 1 000.
    pub sandboxes: u64,
    /// Live sessions (code contexts), all sandboxes together. Default 64.
    pub sessions: u64,
    /// The memory live sessions really use, all together: what each has written of its
    /// memory (private resident pages, measured by its worker after its turns), not its
    /// cap, plus what a running turn may still grow. A session that cannot be measured (a
    /// Linux box's) counts its cap. Default 2 GiB: about 600 idle Python sessions, or four
    /// filled to the default 512 MiB cap.
    pub session_memory_bytes: u64,
    /// Executions running at once; more wait in the tenant's line
    /// ([`crate::admission`]). Default 16.
    pub executions: u64,
    /// Bytes in all its workspaces together. Default 2 GiB.
    pub workspace_bytes: u64,
    /// Its share of worker CPU when tenants compete (≥ 1). Default 1.
    pub cpu_weight: u32,
    /// Linux boxes it keeps paused at once (frozen, their memory held). Over it, its
    /// longest-paused box is hibernated (files kept, processes ended) to make room. Default
    /// 16.
    pub paused_boxes: u64,
    /// Named volumes it keeps ([`crate::volumes`]); the bytes their files use count in
    /// `workspace_bytes`. Default 32.
    pub volumes: u64,
}

impl Default for Quotas {
    fn default() -> Self {
        Quotas {
            sandboxes: 1000,
            sessions: 64,
            session_memory_bytes: 2 << 30,
            executions: 16,
            workspace_bytes: 2 << 30,
            cpu_weight: 1,
            paused_boxes: 16,
            volumes: 32,
        }
    }
}

impl Quotas {
    /// The quotas of the one tenant of a server without keys: the machine's capacity.
    /// Sandboxes 10 000, sessions 1 024, session memory half the machine's memory (at least
    /// the keyed default), executions 64 at once, workspaces half the free space of the file
    /// system under `data_dir` (at least the keyed default).
    pub fn whole_machine(data_dir: &std::path::Path) -> Quotas {
        let keyed = Quotas::default();
        Quotas {
            sandboxes: 10_000,
            sessions: 1024,
            session_memory_bytes: (machine_memory_bytes() / 2).max(keyed.session_memory_bytes),
            executions: 64,
            workspace_bytes: (free_disk_bytes(data_dir) / 2).max(keyed.workspace_bytes),
            cpu_weight: 1,
            paused_boxes: 128,
            volumes: 1024,
        }
    }
}

/// The machine's memory (`MemTotal`), 0 where it cannot be read.
fn machine_memory_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|line| line.strip_prefix("MemTotal:"))
                .and_then(|rest| {
                    rest.trim()
                        .trim_end_matches("kB")
                        .trim()
                        .parse::<u64>()
                        .ok()
                })
        })
        .map_or(0, |kib| kib << 10)
}

/// Free bytes of the file system holding `dir` (or its nearest existing parent), 0 where
/// it cannot be read.
fn free_disk_bytes(dir: &std::path::Path) -> u64 {
    let existing = dir.ancestors().find(|d| d.exists()).unwrap_or(dir);
    rustix::fs::statvfs(existing).map_or(0, |s| s.f_bavail.saturating_mul(s.f_frsize))
}

/// A key's own quotas, where they differ from the server's defaults (stored in `keys.json`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct QuotaOverrides {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandboxes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sessions: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_memory_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executions: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_weight: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_boxes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volumes: Option<u64>,
}

impl QuotaOverrides {
    pub fn is_empty(&self) -> bool {
        *self == QuotaOverrides::default()
    }
}

impl Quotas {
    /// These quotas with a key's overrides applied.
    pub fn with(self, overrides: &QuotaOverrides) -> Quotas {
        Quotas {
            sandboxes: overrides.sandboxes.unwrap_or(self.sandboxes),
            sessions: overrides.sessions.unwrap_or(self.sessions),
            session_memory_bytes: overrides
                .session_memory_bytes
                .unwrap_or(self.session_memory_bytes),
            executions: overrides.executions.unwrap_or(self.executions),
            workspace_bytes: overrides.workspace_bytes.unwrap_or(self.workspace_bytes),
            cpu_weight: overrides.cpu_weight.unwrap_or(self.cpu_weight).max(1),
            paused_boxes: overrides.paused_boxes.unwrap_or(self.paused_boxes),
            volumes: overrides.volumes.unwrap_or(self.volumes),
        }
    }
}

/// What one tenant holds now (measured as the quotas measure it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Usage {
    pub sandboxes: u64,
    pub sessions: u64,
    pub session_memory_bytes: u64,
    pub executions: u64,
    pub workspace_bytes: u64,
}

/// The refusal for quota `name` (its value `limit`; `in_use` held now), in `unit`.
pub fn exceeded(name: &str, limit: u64, in_use: u64, unit: &str) -> RuntimeError {
    RuntimeError::QuotaExceeded {
        quota: name.to_owned(),
        limit,
        in_use,
        asked: None,
        unit: unit.to_owned(),
    }
}

impl Usage {
    /// Refuses one more sandbox.
    pub fn check_sandbox(&self, quotas: &Quotas) -> Result<(), RuntimeError> {
        if self.sandboxes >= quotas.sandboxes {
            return Err(exceeded(
                "sandboxes",
                quotas.sandboxes,
                self.sandboxes,
                "sandboxes",
            ));
        }
        Ok(())
    }

    /// Refuses one more session that holds `memory` bytes to begin with.
    pub fn check_session(&self, quotas: &Quotas, memory: u64) -> Result<(), RuntimeError> {
        if self.sessions >= quotas.sessions {
            return Err(exceeded(
                "sessions",
                quotas.sessions,
                self.sessions,
                "sessions",
            ));
        }
        if self.session_memory_bytes.saturating_add(memory) > quotas.session_memory_bytes {
            return Err(RuntimeError::QuotaExceeded {
                quota: "sessionMemory".into(),
                limit: quotas.session_memory_bytes,
                in_use: self.session_memory_bytes,
                asked: Some(memory),
                unit: "bytes".into(),
            });
        }
        Ok(())
    }

    /// Refuses any execution while the workspaces are over their quota (how many run at
    /// once is the tenant's line's business: [`crate::admission`]).
    pub fn check_workspace(&self, quotas: &Quotas) -> Result<(), RuntimeError> {
        if self.workspace_bytes >= quotas.workspace_bytes {
            return Err(exceeded(
                "workspaceBytes",
                quotas.workspace_bytes,
                self.workspace_bytes,
                "bytes",
            ));
        }
        Ok(())
    }

    /// Bytes the tenant may still add to its workspaces.
    pub fn workspace_room(&self, quotas: &Quotas) -> u64 {
        quotas.workspace_bytes.saturating_sub(self.workspace_bytes)
    }
}
