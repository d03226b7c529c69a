//! What kiln nodes share when there is more than one (issue 38): which nodes are alive (each
//! holds a lease it renews), which node owns each sandbox (the directory), and how much of
//! each quota a tenant is using. One trait, [`Coordinator`], with two stores:
//!
//! - [`Local`]: in the process, for one machine (the default; nothing to run);
//! - [`Postgres`]: a real Postgres that every node of a cluster talks to
//!   (`--database postgres://…`), with versioned migrations.
//!
//! The rules both keep:
//! - Time is the store's: a lease ends at the store's clock, so nodes' clocks never decide
//!   who is alive.
//! - A quota is taken in one statement that adds only if the sum stays within the limit
//!   (`UPDATE … SET used = used + n WHERE used + n <= limit`), never read, then written: two
//!   nodes racing for the last unit cannot both get it.
//! - A node whose lease ran out is `lost`, and so are its sandboxes (a request for one is
//!   told so, at once). A lost node's heartbeat is refused ([`ClusterError::NodeLost`]): it
//!   must stop taking work, and join again as a new member.

use std::time::Duration;

use futures::future::BoxFuture;

mod local;
mod postgres;
pub mod testing;

pub use local::Local;
pub use postgres::{MIGRATIONS, Postgres};

/// A node as it joins.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    /// Unique in the cluster (e.g. its host name).
    pub id: String,
    /// Where other nodes reach its API (`http://10.0.0.5:3000`).
    pub address: String,
}

/// What a node is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeState {
    /// Takes new sandboxes.
    Live,
    /// Serves its sandboxes, takes no new ones.
    Draining,
    /// Its lease ran out: its sandboxes are lost.
    Lost,
}

impl NodeState {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeState::Live => "live",
            NodeState::Draining => "draining",
            NodeState::Lost => "lost",
        }
    }

    fn parse(text: &str) -> NodeState {
        match text {
            "live" => NodeState::Live,
            "draining" => NodeState::Draining,
            _ => NodeState::Lost,
        }
    }
}

/// A member, as the store knows it.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    pub info: NodeInfo,
    pub state: NodeState,
    /// Its sandboxes, as it last reported.
    pub load: u32,
    /// How long until its lease ends (zero when it has).
    pub lease_left: Duration,
}

/// Where a sandbox lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub sandbox: String,
    pub tenant: String,
    pub node: String,
    /// The owning node's address.
    pub address: String,
    /// `running`, `paused`, …, or `lost` once its node is.
    pub state: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The node's lease ran out and it was declared lost; it may not renew.
    #[error(
        "node {0} is no longer a member (its lease ran out); it must stop taking work and join again"
    )]
    NodeLost(String),
    #[error("no node {0}")]
    UnknownNode(String),
    #[error("sandbox {0} is already placed")]
    AlreadyPlaced(String),
    #[error("invalid: {0}")]
    Invalid(String),
    /// The store could not be reached or refused a statement.
    #[error("the cluster's database: {0}")]
    Store(String),
}

pub type Result<T> = std::result::Result<T, ClusterError>;

/// The state kiln nodes share. Every method is one round trip to the store (one transaction
/// where it changes more than one row).
pub trait Coordinator: Send + Sync {
    /// Joins (or joins again) as a live member whose lease ends after `lease`.
    fn join<'a>(&'a self, node: &'a NodeInfo, lease: Duration) -> BoxFuture<'a, Result<()>>;

    /// Renews the node's lease and reports its load. A lost node is refused.
    fn heartbeat<'a>(
        &'a self,
        node: &'a str,
        lease: Duration,
        load: u32,
    ) -> BoxFuture<'a, Result<()>>;

    /// Stops placing new sandboxes on the node.
    fn drain<'a>(&'a self, node: &'a str) -> BoxFuture<'a, Result<()>>;

    /// Declares every node whose lease ended lost, with its sandboxes; returns their ids.
    fn expire(&self) -> BoxFuture<'_, Result<Vec<String>>>;

    /// Every member, lost ones included, by id.
    fn nodes(&self) -> BoxFuture<'_, Result<Vec<Node>>>;

    /// Records that `node` owns `sandbox` (of `tenant`), in `state`.
    fn place<'a>(
        &'a self,
        sandbox: &'a str,
        tenant: &'a str,
        node: &'a str,
        state: &'a str,
    ) -> BoxFuture<'a, Result<()>>;

    /// Where a sandbox lives, if anywhere.
    fn locate<'a>(&'a self, sandbox: &'a str) -> BoxFuture<'a, Result<Option<Placement>>>;

    /// Changes a sandbox's state (false: no such sandbox).
    fn set_state<'a>(&'a self, sandbox: &'a str, state: &'a str) -> BoxFuture<'a, Result<bool>>;

    /// Forgets a sandbox (false: there was none).
    fn remove<'a>(&'a self, sandbox: &'a str) -> BoxFuture<'a, Result<bool>>;

    /// Takes `amount` of `tenant`'s `resource` if what it uses stays within `limit`: the new
    /// use, or `None` when it would not (nothing is taken then).
    fn reserve<'a>(
        &'a self,
        tenant: &'a str,
        resource: &'a str,
        amount: i64,
        limit: i64,
    ) -> BoxFuture<'a, Result<Option<i64>>>;

    /// Gives back `amount` (never below zero); the new use.
    fn release<'a>(
        &'a self,
        tenant: &'a str,
        resource: &'a str,
        amount: i64,
    ) -> BoxFuture<'a, Result<i64>>;

    /// What `tenant` uses of `resource`.
    fn usage<'a>(&'a self, tenant: &'a str, resource: &'a str) -> BoxFuture<'a, Result<i64>>;
}

/// Ids and names the store keeps: not empty, at most 256 bytes, no control characters.
fn check(what: &str, value: &str) -> Result<()> {
    if value.is_empty() || value.len() > 256 || value.chars().any(char::is_control) {
        return Err(ClusterError::Invalid(format!(
            "{what} must be 1 to 256 bytes without control characters"
        )));
    }
    Ok(())
}

fn check_amount(amount: i64) -> Result<()> {
    if amount < 0 {
        return Err(ClusterError::Invalid(format!(
            "an amount is not negative, got {amount}"
        )));
    }
    Ok(())
}
