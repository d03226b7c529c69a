//! Directory lookups and quota reservations per second, in the process and on a real
//! Postgres started here (one connection, and four side by side as four nodes would).
//! `cargo bench -p kiln-cluster` prints one line per figure.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_cluster::testing::Server;
use kiln_cluster::{Coordinator, Local, NodeInfo};

const SANDBOXES: usize = 1000;

async fn fill(store: &dyn Coordinator) {
    let node = NodeInfo {
        id: "node-a".into(),
        address: "http://node-a:3000".into(),
    };
    store.join(&node, Duration::from_secs(600)).await.unwrap();
    for i in 0..SANDBOXES {
        store
            .place(&format!("sb_{i}"), "alice", "node-a", "running")
            .await
            .unwrap();
    }
}

/// Operations per second of `op` over `views` (each view driven by one task), for `time`.
async fn rate(
    views: &[Arc<dyn Coordinator>],
    time: Duration,
    op: fn(Arc<dyn Coordinator>, usize) -> futures::future::BoxFuture<'static, ()>,
) -> f64 {
    let start = Instant::now();
    let mut tasks = Vec::new();
    for view in views {
        let view = view.clone();
        tasks.push(tokio::spawn(async move {
            let mut n = 0usize;
            while start.elapsed() < time {
                op(view.clone(), n).await;
                n += 1;
            }
            n
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    total as f64 / start.elapsed().as_secs_f64()
}

fn lookup(view: Arc<dyn Coordinator>, n: usize) -> futures::future::BoxFuture<'static, ()> {
    Box::pin(async move {
        let id = format!("sb_{}", n % SANDBOXES);
        assert!(view.locate(&id).await.unwrap().is_some());
    })
}

fn reserve(view: Arc<dyn Coordinator>, _: usize) -> futures::future::BoxFuture<'static, ()> {
    Box::pin(async move {
        view.reserve("alice", "executions", 1, i64::MAX)
            .await
            .unwrap();
    })
}

async fn figures(name: &str, views: Vec<Arc<dyn Coordinator>>) {
    let time = Duration::from_secs(3);
    let lookups = rate(&views, time, lookup).await;
    let reserves = rate(&views, time, reserve).await;
    println!(
        "{name:<34} directory lookups {lookups:>10.0}/s   quota reservations {reserves:>10.0}/s"
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() {
    let local: Arc<dyn Coordinator> = Arc::new(Local::new());
    fill(local.as_ref()).await;
    figures("in process, 1 task", vec![local.clone()]).await;
    figures("in process, 4 tasks", vec![local.clone(); 4]).await;

    let server = Server::start();
    let first: Arc<dyn Coordinator> = Arc::new(server.connect().await);
    fill(first.as_ref()).await;
    figures("postgres (socket), 1 connection", vec![first.clone()]).await;
    let mut four = vec![first];
    for _ in 0..3 {
        four.push(Arc::new(server.connect().await));
    }
    figures("postgres (socket), 4 connections", four).await;
}
