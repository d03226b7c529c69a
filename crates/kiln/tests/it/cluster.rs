//! Issue 38: `kiln serve --database` nodes on a real Postgres started by the test. Two nodes
//! share the directory of their sandboxes; a request for a sandbox the other node owns is
//! told where it is; a node killed with SIGKILL is declared lost when its lease runs out,
//! and so are its sandboxes (410, not a hang). Requests are not proxied yet.

use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::serve::{Options, Res, start};

/// Polls `check` every 100 ms until it holds, for at most `limit`.
fn until(limit: Duration, mut check: impl FnMut() -> Res<bool>) -> Res<()> {
    let deadline = Instant::now() + limit;
    loop {
        if check()? {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err("the cluster did not get there in time".into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn node<'a>(view: &'a Value, id: &str) -> Option<&'a Value> {
    view["nodes"].as_array()?.iter().find(|n| n["id"] == id)
}

#[test]
fn two_nodes_share_the_directory_and_a_killed_nodes_sandboxes_are_lost() -> Res<()> {
    let postgres = kiln_cluster::testing::Server::start();
    let database = postgres.config();
    let flags = |id: &'static str| {
        [
            "--database",
            database.as_str(),
            "--node-id",
            id,
            "--node-lease",
            "2s",
        ]
    };
    let a_flags = flags("node-a");
    let b_flags = flags("node-b");
    let mut a = start(Options {
        extra: &a_flags,
        ..Default::default()
    })?;
    let b = start(Options {
        extra: &b_flags,
        ..Default::default()
    })?;

    let kept = a.new_sandbox("python")?;
    let deleted = a.new_sandbox("python")?;
    // B sees both nodes live, and A's two sandboxes as its load.
    until(Duration::from_secs(10), || {
        let (status, view) = b.call("GET", "/api/v1/cluster", None)?;
        assert_eq!(status, 200, "{view}");
        assert_eq!(view["node"], "node-b");
        Ok(
            node(&view, "node-a").is_some_and(|n| n["state"] == "live" && n["load"] == 2)
                && node(&view, "node-b").is_some_and(|n| n["state"] == "live"),
        )
    })?;
    let (_, view) = b.call("GET", "/api/v1/cluster", None)?;
    assert_eq!(node(&view, "node-a").unwrap()["address"], a.base.as_str());

    // B answers for A's sandbox with where it is; a sandbox no node has stays 404.
    let (status, body) = b.call("GET", &format!("/api/v1/sandboxes/{kept}"), None)?;
    assert_eq!(status, 421, "{body}");
    assert_eq!(body["error"]["code"], "SANDBOX_ELSEWHERE");
    assert_eq!(body["error"]["details"]["node"], "node-a");
    assert_eq!(body["error"]["details"]["address"], a.base.as_str());
    let (status, _) = b.exec(&kept, serde_json::json!({"code": "print(1)"}))?;
    assert_eq!(status, 421);
    let (status, body) = b.call("GET", "/api/v1/sandboxes/sb_000000000000000000000000", None)?;
    assert_eq!(status, 404, "{body}");

    // Deleted on A: gone from the directory, so B says 404 too.
    let (status, body) = a.call("DELETE", &format!("/api/v1/sandboxes/{deleted}"), None)?;
    assert!(status == 200 || status == 204, "{status} {body}");
    until(Duration::from_secs(10), || {
        Ok(
            b.call("GET", &format!("/api/v1/sandboxes/{deleted}"), None)?
                .0
                == 404,
        )
    })?;

    // A dies at once. Once its lease (2 s) has run out, B declares it lost, and its
    // sandbox with it: 410, saying so.
    a.child.0.kill()?;
    a.child.0.wait()?;
    let died = Instant::now();
    until(Duration::from_secs(15), || {
        Ok(b.call("GET", &format!("/api/v1/sandboxes/{kept}"), None)?.0 == 410)
    })?;
    assert!(
        died.elapsed() >= Duration::from_millis(1000),
        "lost only after the lease"
    );
    let (_, body) = b.call("GET", &format!("/api/v1/sandboxes/{kept}"), None)?;
    assert_eq!(body["error"]["code"], "SANDBOX_LOST", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("node-a")
    );
    let (_, view) = b.call("GET", "/api/v1/cluster", None)?;
    assert_eq!(node(&view, "node-a").unwrap()["state"], "lost");
    assert_eq!(node(&view, "node-b").unwrap()["state"], "live");

    // A server on its own has no cluster to show.
    let alone = start(Options::default())?;
    let (status, body) = alone.call("GET", "/api/v1/cluster", None)?;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (404, Some("NO_CLUSTER"))
    );
    Ok(())
}
