//! The store of a cluster: Postgres. Every node runs [`Postgres::connect`], which applies the
//! migrations this kiln knows and the database lacks, under an advisory lock (two nodes
//! starting together apply each once).

use std::time::Duration;

use futures::future::BoxFuture;
use tokio_postgres::{Client, NoTls};

use crate::{
    ClusterError, Coordinator, Node, NodeInfo, NodeState, Placement, Result, check, check_amount,
};

/// The schema, one migration per version, applied in order and never changed once released
/// (a change is a new version).
pub const MIGRATIONS: &[(i32, &str)] = &[(
    1,
    "CREATE TABLE kiln_nodes (
        id TEXT PRIMARY KEY,
        address TEXT NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('live', 'draining', 'lost')),
        load INTEGER NOT NULL DEFAULT 0,
        lease_until TIMESTAMPTZ NOT NULL,
        joined TIMESTAMPTZ NOT NULL DEFAULT now()
    );
    CREATE TABLE kiln_sandboxes (
        id TEXT PRIMARY KEY,
        tenant TEXT NOT NULL,
        node TEXT NOT NULL REFERENCES kiln_nodes (id),
        state TEXT NOT NULL,
        created TIMESTAMPTZ NOT NULL DEFAULT now()
    );
    CREATE INDEX kiln_sandboxes_node ON kiln_sandboxes (node);
    CREATE INDEX kiln_sandboxes_tenant ON kiln_sandboxes (tenant);
    CREATE TABLE kiln_usage (
        tenant TEXT NOT NULL,
        resource TEXT NOT NULL,
        used BIGINT NOT NULL DEFAULT 0 CHECK (used >= 0),
        PRIMARY KEY (tenant, resource)
    );",
)];

/// The advisory lock migrations run under ("kiln" in ASCII).
const MIGRATION_LOCK: i64 = 0x6b69_6c6e;

/// A connection to the cluster's Postgres.
pub struct Postgres {
    client: Client,
}

fn store(e: tokio_postgres::Error) -> ClusterError {
    ClusterError::Store(match e.as_db_error() {
        Some(db) => format!("{}: {}", db.code().code(), db.message()),
        None => e.to_string(),
    })
}

/// A lease as Postgres reads it (`make_interval(secs => …)`).
fn seconds(lease: Duration) -> f64 {
    lease.as_secs_f64()
}

impl Postgres {
    /// Connects (`postgres://user@host/db`, or key=value pairs with `host=/run/dir` for a
    /// socket) and brings the schema up to date.
    pub async fn connect(config: &str) -> Result<Postgres> {
        let (client, connection) = tokio_postgres::connect(config, NoTls)
            .await
            .map_err(store)?;
        // A connection that ends shows as errors on the next calls.
        tokio::spawn(async move {
            let _ = connection.await;
        });
        let mut db = Postgres { client };
        db.migrate().await?;
        Ok(db)
    }

    /// Applies the migrations the database lacks; returns the versions applied.
    pub async fn migrate(&mut self) -> Result<Vec<i32>> {
        let tx = self.client.transaction().await.map_err(store)?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
            .await
            .map_err(store)?;
        tx.batch_execute(
            "CREATE TABLE IF NOT EXISTS kiln_migrations (
                version INTEGER PRIMARY KEY,
                applied TIMESTAMPTZ NOT NULL DEFAULT now()
            )",
        )
        .await
        .map_err(store)?;
        let have: Vec<i32> = tx
            .query("SELECT version FROM kiln_migrations", &[])
            .await
            .map_err(store)?
            .iter()
            .map(|r| r.get(0))
            .collect();
        if let Some(newer) = have
            .iter()
            .find(|v| !MIGRATIONS.iter().any(|(m, _)| m == *v))
        {
            return Err(ClusterError::Store(format!(
                "the database has schema version {newer}, which this kiln does not know: it is older than a node that migrated it"
            )));
        }
        let mut applied = Vec::new();
        for (version, sql) in MIGRATIONS {
            if have.contains(version) {
                continue;
            }
            tx.batch_execute(sql).await.map_err(store)?;
            tx.execute(
                "INSERT INTO kiln_migrations (version) VALUES ($1)",
                &[version],
            )
            .await
            .map_err(store)?;
            applied.push(*version);
        }
        tx.commit().await.map_err(store)?;
        Ok(applied)
    }
}

impl Coordinator for Postgres {
    fn join<'a>(&'a self, node: &'a NodeInfo, lease: Duration) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            check("a node id", &node.id)?;
            check("an address", &node.address)?;
            self.client
                .execute(
                    "INSERT INTO kiln_nodes (id, address, state, lease_until)
                     VALUES ($1, $2, 'live', now() + make_interval(secs => $3))
                     ON CONFLICT (id) DO UPDATE SET address = $2, state = 'live', load = 0,
                         lease_until = now() + make_interval(secs => $3), joined = now()",
                    &[&node.id, &node.address, &seconds(lease)],
                )
                .await
                .map_err(store)?;
            Ok(())
        })
    }

    fn heartbeat<'a>(
        &'a self,
        node: &'a str,
        lease: Duration,
        load: u32,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let load = i32::try_from(load).unwrap_or(i32::MAX);
            let rows = self
                .client
                .query(
                    "UPDATE kiln_nodes SET lease_until = now() + make_interval(secs => $2), load = $3
                     WHERE id = $1 AND state <> 'lost' RETURNING id",
                    &[&node, &seconds(lease), &load],
                )
                .await
                .map_err(store)?;
            if rows.is_empty() {
                return Err(self.why_not(node).await);
            }
            Ok(())
        })
    }

    fn drain<'a>(&'a self, node: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let rows = self
                .client
                .query(
                    "UPDATE kiln_nodes SET state = 'draining' WHERE id = $1 AND state <> 'lost' RETURNING id",
                    &[&node],
                )
                .await
                .map_err(store)?;
            if rows.is_empty() {
                return Err(self.why_not(node).await);
            }
            Ok(())
        })
    }

    fn expire(&self) -> BoxFuture<'_, Result<Vec<String>>> {
        Box::pin(async move {
            // One statement: the nodes whose lease ended, and their sandboxes with them.
            let rows = self
                .client
                .query(
                    "WITH lost AS (
                         UPDATE kiln_nodes SET state = 'lost'
                         WHERE state <> 'lost' AND lease_until < now() RETURNING id
                     ), gone AS (
                         UPDATE kiln_sandboxes SET state = 'lost'
                         WHERE node IN (SELECT id FROM lost) RETURNING id
                     )
                     SELECT id FROM lost ORDER BY id",
                    &[],
                )
                .await
                .map_err(store)?;
            Ok(rows.iter().map(|r| r.get(0)).collect())
        })
    }

    fn nodes(&self) -> BoxFuture<'_, Result<Vec<Node>>> {
        Box::pin(async move {
            let rows = self
                .client
                .query(
                    "SELECT id, address, state, load,
                         greatest(extract(epoch FROM lease_until - now()), 0)::float8
                     FROM kiln_nodes ORDER BY id",
                    &[],
                )
                .await
                .map_err(store)?;
            Ok(rows
                .iter()
                .map(|r| Node {
                    info: NodeInfo {
                        id: r.get(0),
                        address: r.get(1),
                    },
                    state: NodeState::parse(r.get(2)),
                    load: r.get::<_, i32>(3).max(0) as u32,
                    lease_left: Duration::from_secs_f64(r.get::<_, f64>(4).max(0.0)),
                })
                .collect())
        })
    }

    fn place<'a>(
        &'a self,
        sandbox: &'a str,
        tenant: &'a str,
        node: &'a str,
        state: &'a str,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            check("a sandbox id", sandbox)?;
            check("a tenant", tenant)?;
            check("a state", state)?;
            // Only on a member that is not lost, in the same statement that checks it.
            let rows = self
                .client
                .query(
                    "INSERT INTO kiln_sandboxes (id, tenant, node, state)
                     SELECT $1, $2, id, $4 FROM kiln_nodes WHERE id = $3 AND state <> 'lost'
                     ON CONFLICT (id) DO NOTHING RETURNING id",
                    &[&sandbox, &tenant, &node, &state],
                )
                .await
                .map_err(store)?;
            if rows.is_empty() {
                let placed = self
                    .client
                    .query_opt("SELECT 1 FROM kiln_sandboxes WHERE id = $1", &[&sandbox])
                    .await
                    .map_err(store)?;
                if placed.is_some() {
                    return Err(ClusterError::AlreadyPlaced(sandbox.into()));
                }
                return Err(self.why_not(node).await);
            }
            Ok(())
        })
    }

    fn locate<'a>(&'a self, sandbox: &'a str) -> BoxFuture<'a, Result<Option<Placement>>> {
        Box::pin(async move {
            let row = self
                .client
                .query_opt(
                    "SELECT s.tenant, s.node, n.address, s.state
                     FROM kiln_sandboxes s JOIN kiln_nodes n ON n.id = s.node WHERE s.id = $1",
                    &[&sandbox],
                )
                .await
                .map_err(store)?;
            Ok(row.map(|r| Placement {
                sandbox: sandbox.into(),
                tenant: r.get(0),
                node: r.get(1),
                address: r.get(2),
                state: r.get(3),
            }))
        })
    }

    fn set_state<'a>(&'a self, sandbox: &'a str, state: &'a str) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            check("a state", state)?;
            let n = self
                .client
                .execute(
                    "UPDATE kiln_sandboxes SET state = $2 WHERE id = $1",
                    &[&sandbox, &state],
                )
                .await
                .map_err(store)?;
            Ok(n > 0)
        })
    }

    fn remove<'a>(&'a self, sandbox: &'a str) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let n = self
                .client
                .execute("DELETE FROM kiln_sandboxes WHERE id = $1", &[&sandbox])
                .await
                .map_err(store)?;
            Ok(n > 0)
        })
    }

    fn reserve<'a>(
        &'a self,
        tenant: &'a str,
        resource: &'a str,
        amount: i64,
        limit: i64,
    ) -> BoxFuture<'a, Result<Option<i64>>> {
        Box::pin(async move {
            check_amount(amount)?;
            check("a tenant", tenant)?;
            check("a resource", resource)?;
            // One statement: the first use makes the row, a later one adds to it, and
            // either only within the limit. Postgres locks the row for the update, so
            // concurrent ones see each other's sums.
            let row = self
                .client
                .query_opt(
                    "INSERT INTO kiln_usage AS u (tenant, resource, used)
                     SELECT $1::text, $2::text, $3::bigint WHERE $3::bigint <= $4::bigint
                     ON CONFLICT (tenant, resource) DO UPDATE SET used = u.used + EXCLUDED.used
                         WHERE u.used + EXCLUDED.used <= $4
                     RETURNING used",
                    &[&tenant, &resource, &amount, &limit],
                )
                .await
                .map_err(store)?;
            Ok(row.map(|r| r.get(0)))
        })
    }

    fn release<'a>(
        &'a self,
        tenant: &'a str,
        resource: &'a str,
        amount: i64,
    ) -> BoxFuture<'a, Result<i64>> {
        Box::pin(async move {
            check_amount(amount)?;
            let row = self
                .client
                .query_opt(
                    "UPDATE kiln_usage SET used = greatest(used - $3, 0)
                     WHERE tenant = $1 AND resource = $2 RETURNING used",
                    &[&tenant, &resource, &amount],
                )
                .await
                .map_err(store)?;
            Ok(row.map_or(0, |r| r.get(0)))
        })
    }

    fn usage<'a>(&'a self, tenant: &'a str, resource: &'a str) -> BoxFuture<'a, Result<i64>> {
        Box::pin(async move {
            let row = self
                .client
                .query_opt(
                    "SELECT used FROM kiln_usage WHERE tenant = $1 AND resource = $2",
                    &[&tenant, &resource],
                )
                .await
                .map_err(store)?;
            Ok(row.map_or(0, |r| r.get(0)))
        })
    }
}

impl Postgres {
    /// Why an update of `node` matched no row: unknown, or lost.
    async fn why_not(&self, node: &str) -> ClusterError {
        match self
            .client
            .query_opt("SELECT state FROM kiln_nodes WHERE id = $1", &[&node])
            .await
        {
            Ok(None) => ClusterError::UnknownNode(node.into()),
            Ok(Some(_)) => ClusterError::NodeLost(node.into()),
            Err(e) => store(e),
        }
    }
}
