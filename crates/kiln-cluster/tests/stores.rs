//! Both stores, held to the same rules: the in-process one, and a real Postgres started by
//! the test (initdb into a temporary folder, a server on a Unix socket of its own; as the
//! `postgres` user when the test runs as root, since Postgres refuses root).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_cluster::testing::Server;
use kiln_cluster::{ClusterError, Coordinator, Local, MIGRATIONS, NodeInfo, NodeState, Postgres};

fn node(id: &str) -> NodeInfo {
    NodeInfo {
        id: id.into(),
        address: format!("http://{id}.internal:3000"),
    }
}

/// The directory and leases, seen by two nodes `a` and `b` of one store.
async fn directory_and_leases(a: &dyn Coordinator, b: &dyn Coordinator) {
    a.join(&node("node-a"), Duration::from_millis(600))
        .await
        .unwrap();
    b.join(&node("node-b"), Duration::from_secs(60))
        .await
        .unwrap();

    // A sandbox placed by A is found by B, with A's address.
    a.place("sb_1", "alice", "node-a", "running").await.unwrap();
    let found = b.locate("sb_1").await.unwrap().unwrap();
    assert_eq!(
        (
            found.node.as_str(),
            found.tenant.as_str(),
            found.state.as_str()
        ),
        ("node-a", "alice", "running")
    );
    assert_eq!(found.address, "http://node-a.internal:3000");
    assert!(matches!(
        b.place("sb_1", "alice", "node-b", "running").await,
        Err(ClusterError::AlreadyPlaced(_))
    ));
    assert!(matches!(
        b.place("sb_2", "alice", "node-x", "running").await,
        Err(ClusterError::UnknownNode(_))
    ));
    assert!(matches!(
        b.place("", "alice", "node-b", "running").await,
        Err(ClusterError::Invalid(_))
    ));
    assert!(b.set_state("sb_1", "paused").await.unwrap());
    assert_eq!(a.locate("sb_1").await.unwrap().unwrap().state, "paused");
    assert!(!b.set_state("sb_none", "paused").await.unwrap());
    b.place("sb_b", "bob", "node-b", "running").await.unwrap();

    // A stops renewing; once its lease has ended, B declares it lost, with its sandboxes.
    assert!(b.expire().await.unwrap().is_empty());
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert_eq!(b.expire().await.unwrap(), vec!["node-a".to_string()]);
    assert!(b.expire().await.unwrap().is_empty(), "lost once");
    assert_eq!(b.locate("sb_1").await.unwrap().unwrap().state, "lost");
    assert_eq!(b.locate("sb_b").await.unwrap().unwrap().state, "running");
    let nodes = b.nodes().await.unwrap();
    let states: Vec<_> = nodes
        .iter()
        .map(|n| (n.info.id.as_str(), n.state))
        .collect();
    assert_eq!(
        states,
        vec![("node-a", NodeState::Lost), ("node-b", NodeState::Live)]
    );
    assert!(nodes[1].lease_left > Duration::from_secs(50));

    // The lost node may not renew, nor take sandboxes; joining again makes it live.
    assert!(matches!(
        a.heartbeat("node-a", Duration::from_secs(60), 3).await,
        Err(ClusterError::NodeLost(_))
    ));
    assert!(matches!(
        a.place("sb_3", "alice", "node-a", "running").await,
        Err(ClusterError::NodeLost(_))
    ));
    a.join(&node("node-a"), Duration::from_secs(60))
        .await
        .unwrap();
    a.heartbeat("node-a", Duration::from_secs(60), 3)
        .await
        .unwrap();
    a.drain("node-a").await.unwrap();
    let a_now = b
        .nodes()
        .await
        .unwrap()
        .into_iter()
        .find(|n| n.info.id == "node-a")
        .unwrap();
    assert_eq!((a_now.state, a_now.load), (NodeState::Draining, 3));
    assert!(b.remove("sb_1").await.unwrap());
    assert!(!b.remove("sb_1").await.unwrap());
    assert!(b.locate("sb_1").await.unwrap().is_none());
}

/// `nodes` views of one store, each reserving one unit `per_node` times at once against a
/// limit of `limit`: exactly `limit` succeed.
async fn quota_burst(nodes: Vec<Arc<dyn Coordinator>>, per_node: usize, limit: i64) {
    let mut tasks = Vec::new();
    for store in &nodes {
        for _ in 0..per_node {
            let store = store.clone();
            tasks.push(tokio::spawn(async move {
                store.reserve("alice", "sandboxes", 1, limit).await.unwrap()
            }));
        }
    }
    let mut granted = 0;
    for task in tasks {
        if task.await.unwrap().is_some() {
            granted += 1;
        }
    }
    assert_eq!(granted, limit);
    let one = &nodes[0];
    assert_eq!(one.usage("alice", "sandboxes").await.unwrap(), limit);
    assert_eq!(
        one.reserve("alice", "sandboxes", 1, limit).await.unwrap(),
        None
    );
    assert_eq!(
        one.release("alice", "sandboxes", 10).await.unwrap(),
        limit - 10
    );
    assert_eq!(
        one.reserve("alice", "sandboxes", 10, limit).await.unwrap(),
        Some(limit)
    );
    // Never below zero; a negative amount is refused; a first use past the limit takes none.
    assert_eq!(one.release("alice", "sandboxes", 1 << 40).await.unwrap(), 0);
    assert!(matches!(
        one.reserve("alice", "sandboxes", -5, limit).await,
        Err(ClusterError::Invalid(_))
    ));
    assert_eq!(one.reserve("bob", "memory", 100, 50).await.unwrap(), None);
    assert_eq!(one.usage("bob", "memory").await.unwrap(), 0);
    assert_eq!(one.usage("carol", "sandboxes").await.unwrap(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_in_process_store_keeps_the_directory_leases_and_quotas() {
    let local = Arc::new(Local::new());
    directory_and_leases(local.as_ref(), local.as_ref()).await;
    let views: Vec<Arc<dyn Coordinator>> = vec![local.clone(), local.clone(), local];
    quota_burst(views, 40, 50).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_keeps_the_directory_leases_and_quotas_across_nodes() {
    let server = Server::start();
    let (a, b) = (server.connect().await, server.connect().await);
    directory_and_leases(&a, &b).await;
    // Three nodes, each with its own connection, racing for the last units.
    let mut views: Vec<Arc<dyn Coordinator>> = Vec::new();
    for _ in 0..3 {
        views.push(Arc::new(server.connect().await));
    }
    quota_burst(views, 40, 50).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nodes_starting_together_migrate_once_and_a_newer_schema_is_refused() {
    let server = Server::start();
    let mut starts = Vec::new();
    for _ in 0..4 {
        let config = server.config();
        starts.push(tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                match Postgres::connect(&config).await {
                    Ok(db) => return db,
                    Err(_) if Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(100)).await
                    }
                    Err(e) => panic!("{e}"),
                }
            }
        }));
    }
    let mut dbs = Vec::new();
    for s in starts {
        dbs.push(s.await.unwrap());
    }
    // Applied once: a second run applies nothing.
    assert_eq!(dbs[0].migrate().await.unwrap(), Vec::<i32>::new());
    // A version this kiln does not know (a newer node migrated the database) is refused.
    let (client, connection) = tokio_postgres::connect(&server.config(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let versions: Vec<i32> = client
        .query("SELECT version FROM kiln_migrations ORDER BY version", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        versions,
        MIGRATIONS.iter().map(|(v, _)| *v).collect::<Vec<_>>()
    );
    client
        .execute("INSERT INTO kiln_migrations (version) VALUES (999)", &[])
        .await
        .unwrap();
    let refused = Postgres::connect(&server.config()).await.err().unwrap();
    assert!(
        refused.to_string().contains("schema version 999"),
        "{refused}"
    );
}
