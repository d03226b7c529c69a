//! Issue 33: a sandbox's lifecycle on create (seed 002's `SessionConfig`, E2B's
//! `lifecycle`): no fixed life unless asked (every request extends an idle window), a hard
//! cap when asked (the request's or the operator's), refusals of bad ones; on a Linux box its
//! own idle policy, auto-resume turned off, the timeout pausing instead of deleting, and the
//! ports previews may reach.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::common::serve::*;

fn create(server: &Server, body: Value) -> Res<(u16, Value)> {
    server.call("POST", "/api/v1/sandboxes", Some(body))
}

fn created_id(server: &Server, body: Value) -> Res<String> {
    let (status, created) = create(server, body)?;
    assert_eq!(status, 201, "{created}");
    Ok(created["containerId"].as_str().ok_or("no id")?.to_string())
}

fn status_of(server: &Server, id: &str) -> Res<u16> {
    Ok(server
        .call("GET", &format!("/api/v1/sandboxes/{id}"), None)?
        .0)
}

#[test]
fn issue33_a_sandbox_without_a_fixed_life_lives_while_used_and_ends_when_idle_or_capped()
-> TestResult {
    let server = start(Options::default())?;
    // The default: no fixed life, a 7-day idle window, shown.
    let (status, made) = create(&server, json!({}))?;
    assert_eq!(status, 201, "{made}");
    assert_eq!(
        made["lifecycle"]["terminateAfterIdleMs"], 604_800_000u64,
        "{made}"
    );

    // A 2-second idle window: requests keep it alive well past 2 s, then it idles out.
    let kept = created_id(
        &server,
        json!({"lifecycle": {"terminateAfterIdleMs": 2000}}),
    )?;
    // The same window, capped at 3.5 s from creation: requests do not keep it past that.
    let capped = created_id(
        &server,
        json!({"lifecycle": {"terminateAfterIdleMs": 2000, "maxDurationMs": 3500}}),
    )?;
    let started = Instant::now();
    let mut capped_alive = Duration::ZERO;
    while started.elapsed() < Duration::from_millis(5000) {
        assert_eq!(status_of(&server, &kept)?, 200, "a used sandbox ended");
        if status_of(&server, &capped)? == 200 {
            capped_alive = started.elapsed();
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    // Requests kept it past its 2-second window, and the cap ended it all the same.
    assert!(
        capped_alive > Duration::from_millis(2300) && capped_alive < Duration::from_millis(3600),
        "the capped sandbox was last seen {capped_alive:?} in"
    );
    let (status, ran) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{kept}/exec"),
        Some(json!({"code": "print(6*7)"})),
    )?;
    assert_eq!(
        (status, ran["stdout"].as_str()),
        (200, Some("42\n")),
        "{ran}"
    );
    std::thread::sleep(Duration::from_millis(3500));
    assert_eq!(status_of(&server, &kept)?, 404, "an idle sandbox lived on");

    // A fixed life with a cap: a renewal does not pass the cap.
    let (status, made) = create(
        &server,
        json!({"timeoutMs": 60000, "lifecycle": {"maxDurationMs": 120000}}),
    )?;
    assert_eq!(status, 201, "{made}");
    let id = made["containerId"].as_str().ok_or("id")?;
    let (status, renewed) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/renew"),
        Some(json!({"timeoutMs": 86400000})),
    )?;
    assert_eq!(status, 200, "{renewed}");
    let created_at = made["createdAt"].as_str().ok_or("createdAt")?;
    let expires_at = renewed["expiresAt"].as_str().ok_or("expiresAt")?;
    // Both are RFC 3339 in UTC: the cap puts the end two minutes after creation.
    let minutes = |t: &str| -> Res<f64> {
        let clock = &t[11..23];
        let parts: Vec<f64> = clock.split(':').map(|p| p.parse().unwrap_or(0.0)).collect();
        Ok(parts[0] * 60.0 + parts[1] + parts[2] / 60.0)
    };
    let span = (minutes(expires_at)? - minutes(created_at)?).rem_euclid(24.0 * 60.0);
    assert!((1.99..=2.01).contains(&span), "{created_at} → {expires_at}");
    Ok(())
}

#[test]
fn issue33_bad_lifecycles_are_refused_naming_the_field() -> TestResult {
    let server = start(Options::default())?;
    for (body, says) in [
        (json!({"lifecycle": {"idleTimeoutMs": 5}}), "idleTimeoutMs"),
        (
            json!({"lifecycle": {"terminateAfterIdleMs": 0}}),
            "terminateAfterIdleMs",
        ),
        (
            json!({"timeoutMs": 5000, "lifecycle": {"terminateAfterIdleMs": 5000}}),
            "not both",
        ),
        (
            json!({"lifecycle": {"onTimeout": "pause"}}),
            "needs timeoutMs",
        ),
        (json!({"lifecycle": {"onTimeout": "snooze"}}), "onTimeout"),
        (
            json!({"lifecycle": {"allowedPorts": [3000, 3000]}}),
            "allowedPorts",
        ),
        (json!({"lifecycle": {"allowedPorts": []}}), "allowedPorts"),
        (
            json!({"lifecycle": {"allowedPorts": [70000]}}),
            "allowedPorts",
        ),
        (
            json!({"lifecycle": {"persistence": "forever"}}),
            "persistence",
        ),
        (json!({"lifecycle": {"whenever": 1}}), "whenever"),
        (json!({"lifecycle": "pause"}), "lifecycle"),
        // A WebAssembly sandbox has no box to pause.
        (json!({"lifecycle": {"onIdle": "pause"}}), "WebAssembly"),
        (
            json!({"timeoutMs": 5000, "lifecycle": {"onTimeout": "pause"}}),
            "WebAssembly",
        ),
        (
            json!({"lifecycle": {"allowedPorts": [3000]}}),
            "WebAssembly",
        ),
    ] {
        let (status, refused) = create(&server, body.clone())?;
        assert_eq!(status, 400, "{body} → {refused}");
        assert!(
            refused.to_string().contains(says),
            "{body} → {refused} does not say {says}"
        );
    }
    // The operator's cap bounds every sandbox, whatever it asks.
    let capped = start(Options {
        extra: &["--max-sandbox-life", "2s"],
        ..Options::default()
    })?;
    let id = created_id(&capped, json!({}))?;
    let fixed = created_id(&capped, json!({"timeoutMs": 600000}))?;
    std::thread::sleep(Duration::from_millis(3000));
    assert_eq!(status_of(&capped, &id)?, 404);
    assert_eq!(status_of(&capped, &fixed)?, 404);
    Ok(())
}
