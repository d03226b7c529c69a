//! The store of one machine: the same rules as [`crate::Postgres`], in the process.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;

use crate::{
    ClusterError, Coordinator, Node, NodeInfo, NodeState, Placement, Result, check, check_amount,
};

struct Member {
    info: NodeInfo,
    state: NodeState,
    load: u32,
    lease_until: Instant,
}

struct Entry {
    tenant: String,
    node: String,
    state: String,
}

#[derive(Default)]
struct State {
    nodes: BTreeMap<String, Member>,
    sandboxes: HashMap<String, Entry>,
    usage: HashMap<(String, String), i64>,
}

/// The state of a single kiln, in its own memory.
#[derive(Default)]
pub struct Local {
    state: Mutex<State>,
}

impl Local {
    pub fn new() -> Local {
        Local::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn ready<'a, T: Send + 'a>(value: T) -> BoxFuture<'a, T> {
    Box::pin(std::future::ready(value))
}

impl Coordinator for Local {
    fn join<'a>(&'a self, node: &'a NodeInfo, lease: Duration) -> BoxFuture<'a, Result<()>> {
        let result = check("a node id", &node.id).map(|()| {
            self.lock().nodes.insert(
                node.id.clone(),
                Member {
                    info: node.clone(),
                    state: NodeState::Live,
                    load: 0,
                    lease_until: Instant::now() + lease,
                },
            );
        });
        ready(result)
    }

    fn heartbeat<'a>(
        &'a self,
        node: &'a str,
        lease: Duration,
        load: u32,
    ) -> BoxFuture<'a, Result<()>> {
        let mut state = self.lock();
        let result = match state.nodes.get_mut(node) {
            None => Err(ClusterError::UnknownNode(node.into())),
            Some(m) if m.state == NodeState::Lost => Err(ClusterError::NodeLost(node.into())),
            Some(m) => {
                m.lease_until = Instant::now() + lease;
                m.load = load;
                Ok(())
            }
        };
        ready(result)
    }

    fn drain<'a>(&'a self, node: &'a str) -> BoxFuture<'a, Result<()>> {
        let mut state = self.lock();
        let result = match state.nodes.get_mut(node) {
            None => Err(ClusterError::UnknownNode(node.into())),
            Some(m) if m.state == NodeState::Lost => Err(ClusterError::NodeLost(node.into())),
            Some(m) => {
                m.state = NodeState::Draining;
                Ok(())
            }
        };
        ready(result)
    }

    fn expire(&self) -> BoxFuture<'_, Result<Vec<String>>> {
        let mut state = self.lock();
        let now = Instant::now();
        let mut lost = Vec::new();
        for (id, m) in state.nodes.iter_mut() {
            if m.state != NodeState::Lost && m.lease_until < now {
                m.state = NodeState::Lost;
                lost.push(id.clone());
            }
        }
        for entry in state.sandboxes.values_mut() {
            if lost.contains(&entry.node) {
                entry.state = "lost".into();
            }
        }
        ready(Ok(lost))
    }

    fn nodes(&self) -> BoxFuture<'_, Result<Vec<Node>>> {
        let now = Instant::now();
        let nodes = self
            .lock()
            .nodes
            .values()
            .map(|m| Node {
                info: m.info.clone(),
                state: m.state,
                load: m.load,
                lease_left: m.lease_until.saturating_duration_since(now),
            })
            .collect();
        ready(Ok(nodes))
    }

    fn place<'a>(
        &'a self,
        sandbox: &'a str,
        tenant: &'a str,
        node: &'a str,
        state: &'a str,
    ) -> BoxFuture<'a, Result<()>> {
        let result = (|| {
            check("a sandbox id", sandbox)?;
            check("a tenant", tenant)?;
            check("a state", state)?;
            let mut s = self.lock();
            match s.nodes.get(node) {
                None => return Err(ClusterError::UnknownNode(node.into())),
                Some(m) if m.state == NodeState::Lost => {
                    return Err(ClusterError::NodeLost(node.into()));
                }
                Some(_) => {}
            }
            if s.sandboxes.contains_key(sandbox) {
                return Err(ClusterError::AlreadyPlaced(sandbox.into()));
            }
            s.sandboxes.insert(
                sandbox.into(),
                Entry {
                    tenant: tenant.into(),
                    node: node.into(),
                    state: state.into(),
                },
            );
            Ok(())
        })();
        ready(result)
    }

    fn locate<'a>(&'a self, sandbox: &'a str) -> BoxFuture<'a, Result<Option<Placement>>> {
        let s = self.lock();
        let found = s.sandboxes.get(sandbox).map(|e| Placement {
            sandbox: sandbox.into(),
            tenant: e.tenant.clone(),
            node: e.node.clone(),
            address: s
                .nodes
                .get(&e.node)
                .map(|m| m.info.address.clone())
                .unwrap_or_default(),
            state: e.state.clone(),
        });
        ready(Ok(found))
    }

    fn set_state<'a>(&'a self, sandbox: &'a str, state: &'a str) -> BoxFuture<'a, Result<bool>> {
        let result =
            check("a state", state).map(|()| match self.lock().sandboxes.get_mut(sandbox) {
                Some(e) => {
                    e.state = state.into();
                    true
                }
                None => false,
            });
        ready(result)
    }

    fn remove<'a>(&'a self, sandbox: &'a str) -> BoxFuture<'a, Result<bool>> {
        ready(Ok(self.lock().sandboxes.remove(sandbox).is_some()))
    }

    fn reserve<'a>(
        &'a self,
        tenant: &'a str,
        resource: &'a str,
        amount: i64,
        limit: i64,
    ) -> BoxFuture<'a, Result<Option<i64>>> {
        let result = check_amount(amount).map(|()| {
            let mut s = self.lock();
            let used = s.usage.entry((tenant.into(), resource.into())).or_insert(0);
            match used.checked_add(amount) {
                Some(next) if next <= limit => {
                    *used = next;
                    Some(next)
                }
                _ => None,
            }
        });
        ready(result)
    }

    fn release<'a>(
        &'a self,
        tenant: &'a str,
        resource: &'a str,
        amount: i64,
    ) -> BoxFuture<'a, Result<i64>> {
        let result = check_amount(amount).map(|()| {
            let mut s = self.lock();
            let used = s.usage.entry((tenant.into(), resource.into())).or_insert(0);
            *used = (*used - amount).max(0);
            *used
        });
        ready(result)
    }

    fn usage<'a>(&'a self, tenant: &'a str, resource: &'a str) -> BoxFuture<'a, Result<i64>> {
        let used = self
            .lock()
            .usage
            .get(&(tenant.to_string(), resource.to_string()))
            .copied()
            .unwrap_or(0);
        ready(Ok(used))
    }
}
