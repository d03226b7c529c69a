//! A sandbox's lifecycle: seed 002's `SessionConfig` (idle timeout, maximum duration,
//! persistence, allowed ports) and E2B's `lifecycle` (what its timeout does, auto-resume),
//! given at create and kept in its record.
//!
//! A sandbox ends one of two ways:
//! - **a fixed life** (`timeoutMs` on create, renewable): it ends when that runs out, as
//!   E2B's sandboxes do; with `onTimeout: "pause"` it is paused instead, and kept
//!   [`PAUSED_KEEP_MS`];
//! - **no fixed life** (no `timeoutMs`): it ends only after `terminateAfterIdleMs` with no
//!   request to it (default [`DEFAULT_IDLE_LIFE_MS`], 7 days); every request moves that
//!   end.
//!
//! Either way `maxDurationMs` (none by default) is a hard cap from creation. Its Linux box
//! has an idle policy of its own: paused after `idleTimeoutMs` (the server's `--box-idle`,
//! 15 minutes), hibernated after `hibernateAfterMs` paused (the server's
//! `--box-hibernate-after`).

use std::time::Duration;

use kiln_core::process::{IdleAction, IdleOverrides};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::error::{Result, RuntimeError};

/// How long a sandbox with no fixed life lives without a request: 7 days.
pub const DEFAULT_IDLE_LIFE_MS: u64 = 7 * 24 * 3600 * 1000;
/// How long a sandbox paused by its timeout (`onTimeout: "pause"`) is kept: 30 days.
pub const PAUSED_KEEP_MS: u64 = 30 * 24 * 3600 * 1000;
/// The longest any of the durations below may be: a year.
pub const MAX_DURATION_MS: u64 = 365 * 24 * 3600 * 1000;
/// The most ports `allowedPorts` may list.
pub const MAX_ALLOWED_PORTS: usize = 64;

/// What becomes of a sandbox and its box over time. Every field is optional; what a request
/// leaves out is the server's default. The box's fields need a Linux template.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schema(example = json!({"idleTimeoutMs": 600000, "onIdle": "pause", "terminateAfterIdleMs": 86400000, "allowedPorts": [3000, 8080]}))]
pub struct Lifecycle {
    /// How long the box may run nothing (no command, process, terminal or preview
    /// connection) before `onIdle`. Default: the server's `--box-idle` (15 minutes).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        alias = "idleTimeout"
    )]
    #[schema(minimum = 1000)]
    pub idle_timeout_ms: Option<u64>,
    /// What an idle box gets: `pause` (frozen with everything), `stop` (processes end, files
    /// stay) or `hibernate` (as `stop`, shown as `hibernated`). Default: from `persistence`,
    /// else the server's `--box-idle-action` (`pause`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_idle: Option<OnIdle>,
    /// Hibernate a box paused this long. Default: the server's `--box-hibernate-after`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1000)]
    pub hibernate_after_ms: Option<u64>,
    /// For a sandbox without `timeoutMs`: it ends after this long with no request to it.
    /// Default 7 days.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1000)]
    pub terminate_after_idle_ms: Option<u64>,
    /// A hard cap on its life from creation, whatever renews it. Default none.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        alias = "maxDuration"
    )]
    #[schema(minimum = 1000)]
    pub max_duration_ms: Option<u64>,
    /// What the end of a fixed life (`timeoutMs`) does: `kill` (default: the sandbox is
    /// deleted) or `pause` (its box is paused and the sandbox kept 30 days; E2B's
    /// `autoPause`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_timeout: Option<OnTimeout>,
    /// Whether a request to a paused or hibernated sandbox (a command, a terminal, preview
    /// traffic) resumes it. Default true; false: it is refused with `SANDBOX_PAUSED` until
    /// resumed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_resume: Option<bool>,
    /// Seed 002's persistence: `none` (an idle box is stopped), `session` (paused: the
    /// default), `snapshot` (hibernated; kiln keeps its files, not yet its processes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistence: Option<Persistence>,
    /// The ports of its box that previews may reach; default any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed_ports: Option<Vec<u16>>,
}

/// What an idle box gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[serde(rename_all = "lowercase")]
pub enum OnIdle {
    Pause,
    Stop,
    Hibernate,
}

/// What the end of a sandbox's fixed life does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[serde(rename_all = "lowercase")]
pub enum OnTimeout {
    Kill,
    Pause,
}

/// Seed 002's `PersistenceMode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[serde(rename_all = "lowercase")]
pub enum Persistence {
    None,
    Session,
    Snapshot,
}

fn bounded(name: &str, value: Option<u64>) -> Result<()> {
    match value {
        Some(ms) if !(1000..=MAX_DURATION_MS).contains(&ms) => Err(RuntimeError::InvalidOption {
            message: format!("lifecycle.{name} must be 1000..={MAX_DURATION_MS} ms, got {ms}"),
        }),
        _ => Ok(()),
    }
}

impl Lifecycle {
    /// Checks it for a sandbox whose template runs a box (`boxed`) or not, and with a fixed
    /// life or not.
    pub fn check(&self, boxed: bool, fixed_life: bool) -> Result<()> {
        bounded("idleTimeoutMs", self.idle_timeout_ms)?;
        bounded("hibernateAfterMs", self.hibernate_after_ms)?;
        bounded("terminateAfterIdleMs", self.terminate_after_idle_ms)?;
        bounded("maxDurationMs", self.max_duration_ms)?;
        if fixed_life && self.terminate_after_idle_ms.is_some() {
            return Err(RuntimeError::InvalidOption {
                message: "give timeoutMs (a fixed life) or lifecycle.terminateAfterIdleMs (a life that every request extends), not both".into(),
            });
        }
        if !fixed_life && self.on_timeout.is_some() {
            return Err(RuntimeError::InvalidOption {
                message: "lifecycle.onTimeout needs timeoutMs: without one the sandbox has no timeout (it ends after lifecycle.terminateAfterIdleMs without requests)".into(),
            });
        }
        if let Some(ports) = &self.allowed_ports {
            let mut seen = std::collections::BTreeSet::new();
            if ports.is_empty()
                || ports.len() > MAX_ALLOWED_PORTS
                || ports.iter().any(|p| *p == 0 || !seen.insert(*p))
            {
                return Err(RuntimeError::InvalidOption {
                    message: format!(
                        "lifecycle.allowedPorts must list 1..={MAX_ALLOWED_PORTS} distinct ports of 1..=65535"
                    ),
                });
            }
        }
        if let Some(Persistence::None) = self.persistence
            && self.on_idle.is_some_and(|a| a != OnIdle::Stop)
        {
            return Err(RuntimeError::InvalidOption {
                message: "lifecycle.persistence \"none\" stops an idle box; it cannot be paused or hibernated".into(),
            });
        }
        let box_only = [
            ("idleTimeoutMs", self.idle_timeout_ms.is_some()),
            ("onIdle", self.on_idle.is_some()),
            ("hibernateAfterMs", self.hibernate_after_ms.is_some()),
            (
                "onTimeout \"pause\"",
                self.on_timeout == Some(OnTimeout::Pause),
            ),
            ("autoResume", self.auto_resume.is_some()),
            ("persistence", self.persistence.is_some()),
            ("allowedPorts", self.allowed_ports.is_some()),
        ];
        if !boxed && let Some((name, _)) = box_only.iter().find(|(_, set)| *set) {
            return Err(RuntimeError::InvalidOption {
                message: format!(
                    "lifecycle.{name} is about a Linux box; this template runs WebAssembly, which has no box to pause (use a linux-* template)"
                ),
            });
        }
        Ok(())
    }

    /// What its box's idle policy changes of the backend's.
    pub fn box_policy(&self) -> IdleOverrides {
        let action = self.on_idle.or(match self.persistence {
            None | Some(Persistence::Session) => None,
            Some(Persistence::None) => Some(OnIdle::Stop),
            Some(Persistence::Snapshot) => Some(OnIdle::Hibernate),
        });
        IdleOverrides {
            idle: self.idle_timeout_ms.map(Duration::from_millis),
            action: action.map(|a| match a {
                OnIdle::Pause => IdleAction::Pause,
                OnIdle::Stop => IdleAction::Stop,
                OnIdle::Hibernate => IdleAction::Hibernate,
            }),
            hibernate_after: self.hibernate_after_ms.map(Duration::from_millis),
        }
    }

    /// Whether a request to it while paused resumes it.
    pub fn auto_resume(&self) -> bool {
        self.auto_resume.unwrap_or(true)
    }

    /// Whether the end of its fixed life pauses it rather than deleting it.
    pub fn pauses_on_timeout(&self) -> bool {
        self.on_timeout == Some(OnTimeout::Pause)
    }

    /// Whether previews may reach `port` of its box.
    pub fn allows_port(&self, port: u16) -> bool {
        self.allowed_ports
            .as_ref()
            .is_none_or(|ports| ports.contains(&port))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_lifecycles_are_refused_with_the_field_named() {
        let refused =
            |l: Lifecycle, boxed: bool, fixed: bool| l.check(boxed, fixed).unwrap_err().to_string();
        assert!(
            refused(
                Lifecycle {
                    idle_timeout_ms: Some(10),
                    ..Default::default()
                },
                true,
                false
            )
            .contains("idleTimeoutMs")
        );
        assert!(
            refused(
                Lifecycle {
                    allowed_ports: Some(vec![80, 80]),
                    ..Default::default()
                },
                true,
                false
            )
            .contains("allowedPorts")
        );
        assert!(
            refused(
                Lifecycle {
                    allowed_ports: Some(vec![0]),
                    ..Default::default()
                },
                true,
                false
            )
            .contains("allowedPorts")
        );
        assert!(
            refused(
                Lifecycle {
                    on_idle: Some(OnIdle::Pause),
                    ..Default::default()
                },
                false,
                false
            )
            .contains("WebAssembly")
        );
        assert!(
            refused(
                Lifecycle {
                    terminate_after_idle_ms: Some(5000),
                    ..Default::default()
                },
                true,
                true
            )
            .contains("not both")
        );
        assert!(
            refused(
                Lifecycle {
                    on_timeout: Some(OnTimeout::Pause),
                    ..Default::default()
                },
                true,
                false
            )
            .contains("needs timeoutMs")
        );
        assert!(
            refused(
                Lifecycle {
                    persistence: Some(Persistence::None),
                    on_idle: Some(OnIdle::Pause),
                    ..Default::default()
                },
                true,
                false
            )
            .contains("persistence")
        );
        // A WebAssembly sandbox may still choose when it ends.
        Lifecycle {
            terminate_after_idle_ms: Some(60_000),
            max_duration_ms: Some(3_600_000),
            ..Default::default()
        }
        .check(false, false)
        .unwrap();
    }

    #[test]
    fn persistence_picks_what_an_idle_box_gets_unless_on_idle_says() {
        let of = |p, a| {
            Lifecycle {
                persistence: p,
                on_idle: a,
                ..Default::default()
            }
            .box_policy()
            .action
        };
        assert_eq!(of(None, None), None);
        assert_eq!(of(Some(Persistence::None), None), Some(IdleAction::Stop));
        assert_eq!(of(Some(Persistence::Session), None), None);
        assert_eq!(
            of(Some(Persistence::Snapshot), None),
            Some(IdleAction::Hibernate)
        );
        assert_eq!(
            of(Some(Persistence::Snapshot), Some(OnIdle::Pause)),
            Some(IdleAction::Pause)
        );
        let ports = Lifecycle {
            allowed_ports: Some(vec![3000]),
            ..Default::default()
        };
        assert!(ports.allows_port(3000) && !ports.allows_port(22));
        assert!(Lifecycle::default().allows_port(22));
    }
}
