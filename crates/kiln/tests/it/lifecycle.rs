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

    // A 3-second idle window: requests keep it alive well past 3 s, then it idles out.
    let kept = created_id(
        &server,
        json!({"lifecycle": {"terminateAfterIdleMs": 3000}}),
    )?;
    // The same window, capped at 5 s from creation: requests do not keep it past that.
    let capped = created_id(
        &server,
        json!({"lifecycle": {"terminateAfterIdleMs": 3000, "maxDurationMs": 5000}}),
    )?;
    let started = Instant::now();
    let mut capped_alive = Duration::ZERO;
    while started.elapsed() < Duration::from_millis(7000) {
        assert_eq!(status_of(&server, &kept)?, 200, "a used sandbox ended");
        if status_of(&server, &capped)? == 200 {
            capped_alive = started.elapsed();
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    // Requests kept it past its 3-second window, and the cap ended it all the same.
    assert!(
        capped_alive > Duration::from_millis(3300) && capped_alive < Duration::from_millis(5000),
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
    std::thread::sleep(Duration::from_millis(4500));
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

fn sh(server: &Server, id: &str, script: &str) -> Res<(u16, Value)> {
    server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/exec"),
        Some(json!({"command": ["sh", "-c", script]})),
    )
}

/// Waits until `id`'s GET shows `want` (a field and its value).
fn until_shown(server: &Server, id: &str, field: &str, want: Value) -> Res<Value> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, info) = server.call("GET", &format!("/api/v1/sandboxes/{id}"), None)?;
        if info[field] == want {
            return Ok(info);
        }
        assert!(
            Instant::now() < deadline,
            "{id}: {field} never became {want}: {info}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn issue33_a_linux_sandboxs_own_lifecycle_idles_resumes_times_out_and_bounds_previews() -> TestResult
{
    if crate::common::skip_linux() {
        return Ok(());
    }
    let state = tempfile::tempdir()?;
    let state_dir = state.path().to_str().ok_or("path")?;
    // The server's own idle policy is its default (15 minutes): what happens below is the
    // sandboxes' own.
    let server = start(Options {
        extra: &["--linux"],
        env: &[("KILN_STATE_DIR", state_dir)],
        ..Options::default()
    })?;
    let boxed = |lifecycle: Value, extra: Value| -> Res<String> {
        let mut body = json!({"template": "linux-debian", "lifecycle": lifecycle});
        if let (Some(body), Some(extra)) = (body.as_object_mut(), extra.as_object()) {
            body.extend(extra.clone());
        }
        created_id(&server, body)
    };
    let pauses = boxed(json!({"idleTimeoutMs": 1000}), json!({}))?;
    let snapshots = boxed(
        json!({"idleTimeoutMs": 1000, "persistence": "snapshot"}),
        json!({}),
    )?;
    let stays = boxed(json!({"autoResume": false}), json!({}))?;
    let times_out = boxed(json!({"onTimeout": "pause"}), json!({"timeoutMs": 3000}))?;
    for id in [&pauses, &snapshots, &stays, &times_out] {
        let (status, ran) = sh(&server, id, "sleep 600 >/dev/null 2>&1 &")?;
        assert_eq!(status, 200, "{ran}");
    }
    until_shown(&server, &pauses, "state", json!("paused"))?;
    until_shown(&server, &snapshots, "state", json!("hibernated"))?;
    let (_, info) = server.call("GET", &format!("/api/v1/sandboxes/{stays}"), None)?;
    assert_eq!(
        info["state"], "running",
        "the server's idle policy acted: {info}"
    );
    assert_eq!(info["lifecycle"]["autoResume"], false, "{info}");

    // autoResume false: a paused sandbox refuses commands, terminals and sessions until
    // resumed, and keeps its processes.
    let (status, paused) =
        server.call("POST", &format!("/api/v1/sandboxes/{stays}/pause"), None)?;
    assert_eq!(status, 200, "{paused}");
    let (status, refused) = sh(&server, &stays, "echo hi")?;
    assert_eq!(status, 409, "{refused}");
    assert_eq!(refused["error"]["code"], "SANDBOX_PAUSED", "{refused}");
    assert!(refused.to_string().contains("/resume"), "{refused}");
    let (status, refused) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{stays}/terminals"),
        Some(json!({})),
    )?;
    assert_eq!(status, 409, "{refused}");
    let (_, info) = server.call("GET", &format!("/api/v1/sandboxes/{stays}"), None)?;
    assert_eq!(
        info["state"], "paused",
        "a refused request resumed it: {info}"
    );
    let (status, _) = server.call("POST", &format!("/api/v1/sandboxes/{stays}/resume"), None)?;
    assert_eq!(status, 200);
    let (status, ran) = sh(&server, &stays, "pgrep -x sleep >/dev/null && echo kept")?;
    assert_eq!(
        (status, ran["stdout"].as_str()),
        (200, Some("kept\n")),
        "{ran}"
    );

    // onTimeout pause: the end of its life pauses it, and keeps it.
    // (Marked first, then paused by the same housekeeping pass: a read in between may see
    // it timed out and still running for a moment.)
    until_shown(&server, &times_out, "timedOut", json!(true))?;
    let info = until_shown(&server, &times_out, "state", json!("paused"))?;
    assert_eq!(info["timedOut"], true, "{info}");
    // A command resumes it (autoResume is on), its processes kept, and it gets its 3-second
    // life again (as E2B's auto-resume does): it times out, and is paused, once more. A
    // renewal gives it a longer life.
    let (status, ran) = sh(
        &server,
        &times_out,
        "pgrep -x sleep >/dev/null && echo kept",
    )?;
    assert_eq!(
        (status, ran["stdout"].as_str()),
        (200, Some("kept\n")),
        "{ran}"
    );
    until_shown(&server, &times_out, "timedOut", Value::Null)?;
    // (Marked first, then paused by the same housekeeping pass: a read in between may see
    // it timed out and still running for a moment.)
    until_shown(&server, &times_out, "timedOut", json!(true))?;
    let info = until_shown(&server, &times_out, "state", json!("paused"))?;
    assert_eq!(info["timedOut"], true, "{info}");
    let (status, renewed) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{times_out}/renew"),
        Some(json!({"timeoutMs": 600000})),
    )?;
    assert_eq!(status, 200, "{renewed}");
    assert_eq!(renewed.get("timedOut"), None, "{renewed}");

    // Each sandbox's events say what became of it and why.
    let events = |id: &str| -> Res<Vec<(String, String)>> {
        let (status, list) = server.call("GET", &format!("/api/v1/sandboxes/{id}/events"), None)?;
        assert_eq!(status, 200, "{list}");
        Ok(list["events"]
            .as_array()
            .ok_or("events")?
            .iter()
            .map(|e| {
                (
                    e["state"].as_str().unwrap_or_default().to_string(),
                    e["reason"].as_str().unwrap_or_default().to_string(),
                )
            })
            .collect())
    };
    let has = |seen: &[(String, String)], state: &str, reason: &str| {
        seen.iter().any(|(s, r)| s == state && r.contains(reason))
    };
    let seen = events(&pauses)?;
    assert_eq!(
        seen.first().map(|(s, _)| s.as_str()),
        Some("created"),
        "{seen:?}"
    );
    assert!(
        has(&seen, "running", "started") && has(&seen, "paused", "idle"),
        "{seen:?}"
    );
    assert!(has(&events(&snapshots)?, "hibernated", "idle"));
    let seen = events(&stays)?;
    assert!(
        has(&seen, "paused", "asked") && has(&seen, "running", "asked"),
        "{seen:?}"
    );
    let seen = events(&times_out)?;
    assert!(
        has(&seen, "paused", "timeout") && has(&seen, "running", "request"),
        "{seen:?}"
    );
    // A follower hears the kept events, then new ones, to the sandbox's deletion.
    let follow =
        ureq::get(&server.url(&format!("/api/v1/sandboxes/{stays}/events?follow=true"))).call()?;
    assert_eq!(follow.content_type(), "text/event-stream");
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(follow.into_reader()));
    let mut heard = Vec::new();
    let deleter = {
        let url = server.url(&format!("/api/v1/sandboxes/{stays}"));
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(500));
            let _ = ureq::delete(&url).call();
        })
    };
    for line in lines.by_ref() {
        let line = line?;
        if let Some(state) = line.strip_prefix("event: ") {
            heard.push(state.to_string());
            if state == "deleted" {
                break;
            }
        }
    }
    deleter.join().map_err(|_| "deleter")?;
    assert_eq!(
        heard.first().map(String::as_str),
        Some("created"),
        "{heard:?}"
    );
    assert_eq!(
        heard.last().map(String::as_str),
        Some("deleted"),
        "{heard:?}"
    );

    // allowedPorts: previews reach the listed port and no other, even one that listens.
    let ports = created_id(
        &server,
        json!({"template": "linux-python", "lifecycle": {"allowedPorts": [8001]}}),
    )?;
    let (status, ran) = sh(
        &server,
        &ports,
        "echo hello > index.html; for p in 8000 8001; do python3 -m http.server $p >/dev/null 2>&1 & done",
    )?;
    assert_eq!(status, 200, "{ran}");
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (_, listed) = server.call("GET", &format!("/api/v1/sandboxes/{ports}/ports"), None)?;
        if listed["ports"].as_array().is_some_and(|p| p.len() == 2) {
            break;
        }
        assert!(Instant::now() < deadline, "not both listen: {listed}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let preview = |port: u16| -> Res<(u16, String)> {
        let reply = send(
            "GET",
            &server.url(&format!("/preview/{ports}/{port}/index.html")),
            None,
            None,
        )?;
        Ok((
            reply.status,
            String::from_utf8_lossy(&reply.body).into_owned(),
        ))
    };
    assert_eq!(preview(8001)?, (200, "hello\n".to_string()));
    let (status, refused) = preview(8000)?;
    assert_eq!(status, 403, "{refused}");
    assert!(refused.contains("PORT_NOT_ALLOWED"), "{refused}");
    let (status, refused) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{ports}/previews"),
        Some(json!({"port": 8000})),
    )?;
    assert_eq!(status, 403, "{refused}");
    Ok(())
}

/// A GET that follows no redirect: its status, the headers asked for, its body.
fn fetch(
    url: &str,
    key: Option<&str>,
    cookie: Option<&str>,
    headers: &[&str],
) -> Res<(u16, Vec<Option<String>>, String)> {
    let agent = ureq::AgentBuilder::new().redirects(0).build();
    let mut request = agent.get(url);
    if let Some(key) = key {
        request = request.set("authorization", &format!("Bearer {key}"));
    }
    if let Some(cookie) = cookie {
        request = request.set("cookie", cookie);
    }
    let response = match request.call() {
        Ok(response) => response,
        Err(ureq::Error::Status(_, response)) => response,
        Err(e) => return Err(e.into()),
    };
    let status = response.status();
    let seen = headers
        .iter()
        .map(|h| response.header(h).map(String::from))
        .collect();
    Ok((status, seen, response.into_string()?))
}

/// A folder of the workspace served as a site, with no server in the sandbox: the owner's
/// key reads any file; a link reads its folder only, until it expires; nothing follows a
/// link the guest planted; pages run sandboxed.
#[test]
fn issue33_a_static_site_of_a_workspace_folder_for_the_owner_or_a_folder_link() -> TestResult {
    let server = start(Options {
        auth: true,
        ..Options::default()
    })?;
    let key = server.key.clone().ok_or("no key")?;
    let id = created_id(&server, json!({}))?;
    for (path, text) in [
        (
            "public/index.html",
            "<h1>site</h1><script src=app.js></script>",
        ),
        ("public/app.js", "console.log(1)"),
        ("public/sub/index.html", "<p>sub</p>"),
        ("secret.txt", "the secret"),
    ] {
        let reply = send(
            "PUT",
            &server.url(&format!("/api/v1/sandboxes/{id}/files/{path}")),
            Some(&key),
            Some(("application/octet-stream", text.as_bytes())),
        )?;
        assert_eq!(reply.status, 201, "{path}");
    }
    // A link the guest planted, to a file outside the link's folder.
    std::os::unix::fs::symlink(
        "../secret.txt",
        server
            .data
            .join(format!("sandboxes/{id}/workspace/public/leak")),
    )?;
    let site = |path: &str| server.url(&format!("/site/{id}/{path}"));
    const WANTED: &[&str] = &[
        "content-type",
        "content-security-policy",
        "location",
        "set-cookie",
    ];

    // The owner's key: any file, a folder's index.html, a folder without its slash sent to it.
    let (status, seen, body) = fetch(&site("public/"), Some(&key), None, WANTED)?;
    assert_eq!(
        (status, body.as_str()),
        (200, "<h1>site</h1><script src=app.js></script>")
    );
    assert_eq!(seen[0].as_deref(), Some("text/html; charset=utf-8"));
    assert!(
        seen[1]
            .as_deref()
            .is_some_and(|p| p.starts_with("sandbox ") && !p.contains("allow-same-origin")),
        "{seen:?}"
    );
    let (status, seen, _) = fetch(&site("public/sub"), Some(&key), None, WANTED)?;
    assert_eq!(
        (status, seen[2].as_deref()),
        (308, Some(format!("/site/{id}/public/sub/").as_str()))
    );
    assert_eq!(
        fetch(&site("secret.txt"), Some(&key), None, WANTED)?.2,
        "the secret"
    );
    let (status, _, body) = fetch(&site("public/leak"), Some(&key), None, WANTED)?;
    assert!(
        status == 400 && !body.contains("the secret"),
        "a planted link was followed: {status} {body}"
    );
    let (status, _, _) = fetch(&site("nothing.html"), Some(&key), None, WANTED)?;
    assert_eq!(status, 404);
    // Without the key or a link: as if it did not exist.
    let (status, _, body) = fetch(&site("public/"), None, None, WANTED)?;
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("SANDBOX_NOT_FOUND"), "{body}");
    let reply = send(
        "POST",
        &site("public/"),
        Some(&key),
        Some(("text/plain", b"x")),
    )?;
    assert_eq!(reply.status, 405);

    // A link to `public`: its folder and subfolders, with the token carried on in a cookie.
    let (status, link) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/sites"),
        Some(json!({"folder": "public"})),
    )?;
    assert_eq!(status, 201, "{link}");
    let url = link["url"].as_str().ok_or("url")?;
    assert!(
        url.starts_with(&format!("/site/{id}/public/?kiln_preview_token=")),
        "{link}"
    );
    let (status, seen, body) = fetch(&server.url(url), None, None, WANTED)?;
    assert_eq!(status, 200, "{body}");
    let cookie = seen[3].clone().ok_or("no cookie")?;
    let cookie = cookie.split(';').next().ok_or("cookie")?.to_string();
    let (status, seen, body) = fetch(&site("public/app.js"), None, Some(&cookie), WANTED)?;
    assert_eq!((status, body.as_str()), (200, "console.log(1)"));
    assert_eq!(seen[0].as_deref(), Some("text/javascript; charset=utf-8"));
    assert_eq!(
        fetch(&site("public/sub/"), None, Some(&cookie), WANTED)?.2,
        "<p>sub</p>"
    );
    // Nothing outside the folder, however it is spelled.
    let token = url.split("kiln_preview_token=").nth(1).ok_or("token")?;
    for outside in [
        "secret.txt".to_string(),
        format!("secret.txt?kiln_preview_token={token}"),
        "public/%2e%2e/secret.txt".to_string(),
        "public/..%2fsecret.txt".to_string(),
        "public2/x".to_string(),
        "public/leak".to_string(),
    ] {
        let (status, _, body) = fetch(&site(&outside), None, Some(&cookie), WANTED)?;
        assert!(
            status != 200 && !body.contains("the secret"),
            "{outside}: {status} {body}"
        );
    }
    // Bad folders are refused; an expired link reads nothing.
    for bad in [
        json!({"folder": "../x"}),
        json!({"folder": "a\u{0}b"}),
        json!({"ttlSeconds": 0}),
    ] {
        let (status, refused) = server.call(
            "POST",
            &format!("/api/v1/sandboxes/{id}/sites"),
            Some(bad.clone()),
        )?;
        assert_eq!(status, 400, "{bad}: {refused}");
    }
    let (_, short) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/sites"),
        Some(json!({"folder": "public/sub", "ttlSeconds": 1})),
    )?;
    let short = short["url"].as_str().ok_or("url")?.to_string();
    assert_eq!(fetch(&server.url(&short), None, None, WANTED)?.0, 200);
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(fetch(&server.url(&short), None, None, WANTED)?.0, 404);
    Ok(())
}

/// Paused boxes hold their memory: a tenant keeps at most its quota of them, and the
/// longest-paused go to hibernation (files kept) to make room.
#[test]
fn issue33_paused_boxes_over_the_tenants_quota_are_hibernated_longest_paused_first() -> TestResult {
    if crate::common::skip_linux() {
        return Ok(());
    }
    let state = tempfile::tempdir()?;
    let state_dir = state.path().to_str().ok_or("path")?;
    let server = start(Options {
        extra: &["--linux", "--max-paused-boxes", "2"],
        env: &[("KILN_STATE_DIR", state_dir)],
        ..Options::default()
    })?;
    let mut ids = Vec::new();
    for _ in 0..3 {
        let id = created_id(&server, json!({"template": "linux-debian"}))?;
        let (status, ran) = sh(
            &server,
            &id,
            "echo kept > /var/tmp/file; sleep 600 >/dev/null 2>&1 &",
        )?;
        assert_eq!(status, 200, "{ran}");
        ids.push(id);
    }
    for id in &ids {
        let (status, paused) =
            server.call("POST", &format!("/api/v1/sandboxes/{id}/pause"), None)?;
        assert_eq!(
            (status, &paused["state"]),
            (200, &json!("paused")),
            "{paused}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    until_shown(&server, &ids[0], "state", json!("hibernated"))?;
    for id in &ids[1..] {
        let (_, info) = server.call("GET", &format!("/api/v1/sandboxes/{id}"), None)?;
        assert_eq!(info["state"], "paused", "{info}");
    }
    // The hibernated one's files are kept.
    let (status, ran) = sh(&server, &ids[0], "cat /var/tmp/file")?;
    assert_eq!(
        (status, ran["stdout"].as_str()),
        (200, Some("kept\n")),
        "{ran}"
    );
    Ok(())
}

/// `publicPreviews`: anyone reaches the box's servers (within `allowedPorts`) without a key
/// or a link; a private sandbox's stay 404; a wrong key is still refused.
#[test]
fn issue33_public_previews_need_no_key_where_the_sandbox_says_so() -> TestResult {
    if crate::common::skip_linux() {
        return Ok(());
    }
    let state = tempfile::tempdir()?;
    let state_dir = state.path().to_str().ok_or("path")?;
    let server = start(Options {
        auth: true,
        extra: &["--linux"],
        env: &[("KILN_STATE_DIR", state_dir)],
        ..Options::default()
    })?;
    let public = created_id(
        &server,
        json!({"template": "linux-python", "publicPreviews": true, "lifecycle": {"allowedPorts": [8000]}}),
    )?;
    let private = created_id(&server, json!({"template": "linux-python"}))?;
    let (_, info) = server.call("GET", &format!("/api/v1/sandboxes/{public}"), None)?;
    assert_eq!(info["publicPreviews"], true, "{info}");
    for id in [&public, &private] {
        let (status, ran) = sh(
            &server,
            id,
            "echo hello > index.html; for p in 8000 8001; do python3 -m http.server $p >/dev/null 2>&1 & done",
        )?;
        assert_eq!(status, 200, "{ran}");
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    let get = |id: &str, port: u16, key: Option<&str>| -> Res<(u16, String)> {
        let reply = send(
            "GET",
            &server.url(&format!("/preview/{id}/{port}/index.html")),
            key,
            None,
        )?;
        Ok((
            reply.status,
            String::from_utf8_lossy(&reply.body).into_owned(),
        ))
    };
    loop {
        let key = server.key.clone();
        if get(&public, 8000, key.as_deref())?.0 == 200
            && get(&private, 8000, key.as_deref())?.0 == 200
        {
            break;
        }
        assert!(Instant::now() < deadline, "the servers never answered");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(get(&public, 8000, None)?, (200, "hello\n".to_string()));
    assert_eq!(get(&public, 8001, None)?.0, 403, "outside allowedPorts");
    assert_eq!(
        get(&private, 8000, None)?.0,
        404,
        "a private preview opened"
    );
    assert_eq!(
        get(&public, 8000, Some("kiln_wrong"))?.0,
        404,
        "a wrong key passed"
    );
    let (status, refused) = create(&server, json!({"publicPreviews": true}))?;
    assert_eq!(status, 400, "{refused}");
    assert!(refused.to_string().contains("WebAssembly"), "{refused}");
    Ok(())
}
