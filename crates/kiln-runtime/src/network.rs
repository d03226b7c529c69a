//! A sandbox's egress rules after it is made: replaced whole (as E2B's update does), kept
//! with the sandbox, and applied by its box's proxy at once, for connections opened from
//! then on, and to those open already (one the new rules refuse is closed).

use std::sync::Arc;

use crate::Runtime;
use crate::auth::Caller;
use crate::error::{Result, RuntimeError};
use crate::sandbox::Sandbox;

/// Replaces the egress rules of `caller`'s sandbox `id` (`None` or empty: the operator's
/// list alone), with `caller`'s right to widen the operator's list; answers the sandbox.
pub async fn set_network(
    rt: &Arc<Runtime>,
    caller: &Caller,
    id: &str,
    egress: Option<kiln_core::net::Egress>,
) -> Result<Sandbox> {
    let view = rt.registry.get(&caller.tenant, id)?;
    if view.meta.network != kiln_core::Network::Allowlist {
        let live = rt
            .catalogue()
            .get(view.meta.template())
            .is_some_and(|t| t.lifecycle == kiln_core::template::Lifecycle::Live);
        return Err(if live {
            RuntimeError::InvalidOption {
                message: format!(
                    "sandbox {id} was made without a network, and its box has no way out to rule; make one with network \"allowlist\" (or with rules) instead"
                ),
            }
        } else {
            RuntimeError::Unsupported {
                message: format!(
                    "sandbox {id} runs on the {} template, which has no network at all (WebAssembly)",
                    view.meta.template()
                ),
            }
        });
    }
    if let Some(egress) = &egress {
        egress
            .validate()
            .map_err(|message| RuntimeError::InvalidOption {
                message: format!("network: {message}"),
            })?;
    }
    let sandbox = rt
        .registry
        .set_egress(&caller.tenant, id, egress, caller.network_widen)?;
    if let Some(host) = rt.process_host(&sandbox) {
        host.set_egress(&sandbox.workspace(), sandbox.egress_grant())
            .await
            .map_err(|e| RuntimeError::internal(format!("applying the rules: {}", e.message)))?;
    }
    rt.events
        .record(&sandbox.id, "network", "egress rules replaced");
    Ok(sandbox)
}
