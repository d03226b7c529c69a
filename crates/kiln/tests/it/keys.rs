//! Keys and quotas over the API (`/api/v1/me`, `/api/v1/keys`, `/api/v1/tenants`) against
//! a real `kiln serve`: what any key learns of itself, what only an admin key may do, that a
//! key made or changed here works (and its quotas hold) at once, that a revoked one stops,
//! that the last admin key stays, and that hostile bodies are refused with the reason.

use serde_json::{Value, json};

use crate::common::serve::{Options, Res, Server, TestResult, kiln, start};

fn admin_key(server: &Server) -> Res<String> {
    let output = kiln()
        .args(["keys", "create", "--admin", "--name", "root", "--data-dir"])
        .arg(&server.data)
        .output()?;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(String::from_utf8_lossy(&output.stderr).contains("created admin key"));
    Ok(String::from_utf8(output.stdout)?.trim().to_owned())
}

fn code(body: &Value) -> &str {
    body["error"]["code"].as_str().unwrap_or_default()
}

#[test]
fn an_admin_key_manages_keys_and_quotas_that_hold_at_once() -> TestResult {
    let server = start(Options {
        auth: true,
        ..Options::default()
    })?;
    let user = server.key.clone().ok_or("no key")?;
    let admin = admin_key(&server)?;

    // Any key learns who it is, its quotas and what it holds.
    let (status, me) = server.call_as(Some(&user), "GET", "/api/v1/me", None)?;
    assert_eq!(status, 200, "{me}");
    assert_eq!(me["admin"], false);
    assert_eq!(me["auth"], true);
    assert_eq!(me["name"], "test");
    assert_eq!(me["quotas"]["sandboxes"], 1000);
    assert_eq!(me["usage"]["sandboxes"], 0);
    let user_tenant = me["tenant"].as_str().ok_or("no tenant")?.to_owned();

    // A plain key may not touch keys or see other tenants.
    for (method, path, body) in [
        ("GET", "/api/v1/keys", None),
        ("POST", "/api/v1/keys", Some(json!({"name": "x"}))),
        ("PATCH", "/api/v1/keys/key_x", Some(json!({"name": "x"}))),
        ("DELETE", "/api/v1/keys/key_x", None),
        ("GET", "/api/v1/tenants", None),
    ] {
        let (status, body) = server.call_as(Some(&user), method, path, body)?;
        assert_eq!(status, 403, "{method} {path}: {body}");
        assert_eq!(code(&body), "ADMIN_ONLY");
    }

    // The admin lists keys: never a key, never a hash.
    let (status, listed) = server.call_as(Some(&admin), "GET", "/api/v1/keys", None)?;
    assert_eq!(status, 200, "{listed}");
    assert_eq!(listed["keys"].as_array().map(Vec::len), Some(2));
    let text = listed.to_string();
    assert!(!text.contains(&user) && !text.contains(&admin) && !text.contains("sha256"));

    // It makes a key for a team with a quota of one sandbox; the key works at once and the
    // quota holds.
    let (status, made) = server.call_as(
        Some(&admin),
        "POST",
        "/api/v1/keys",
        Some(json!({"name": "team", "tenant": "team-a", "quotas": {"sandboxes": 1}})),
    )?;
    assert_eq!(status, 201, "{made}");
    let team = made["key"].as_str().ok_or("no key")?.to_owned();
    let team_id = made["id"].as_str().ok_or("no id")?.to_owned();
    assert!(team.starts_with("kiln_"));
    assert_eq!(made["tenant"], "team-a");
    assert_eq!(made["effectiveQuotas"]["sandboxes"], 1);
    assert_eq!(made["effectiveQuotas"]["sessions"], 64);
    let stored = std::fs::read_to_string(server.data.join("keys.json"))?;
    assert!(!stored.contains(&team), "the key itself is never stored");
    let new_sandbox = |key: &str| {
        server.call_as(
            Some(key),
            "POST",
            "/api/v1/sandboxes",
            Some(json!({"language": "python"})),
        )
    };
    let (status, body) = new_sandbox(&team)?;
    assert_eq!(status, 201, "{body}");
    let (status, body) = new_sandbox(&team)?;
    assert_eq!(status, 429, "{body}");
    assert_eq!(code(&body), "QUOTA_EXCEEDED");
    let (_, me) = server.call_as(Some(&team), "GET", "/api/v1/me", None)?;
    assert_eq!(me["quotas"]["sandboxes"], 1);
    assert_eq!(me["usage"]["sandboxes"], 1);

    // Raised, the quota is the new one on the key's next request.
    let (status, changed) = server.call_as(
        Some(&admin),
        "PATCH",
        &format!("/api/v1/keys/{team_id}"),
        Some(json!({"quotas": {"sandboxes": 2}, "name": "team a"})),
    )?;
    assert_eq!(status, 200, "{changed}");
    assert_eq!(changed["name"], "team a");
    assert_eq!(changed["quotas"], json!({"sandboxes": 2}));
    let (status, body) = new_sandbox(&team)?;
    assert_eq!(status, 201, "{body}");

    // The admin sees every tenant's usage, but its own sandboxes only.
    let (status, tenants) = server.call_as(Some(&admin), "GET", "/api/v1/tenants", None)?;
    assert_eq!(status, 200, "{tenants}");
    let of = |name: &str| {
        tenants["tenants"]
            .as_array()
            .and_then(|all| all.iter().find(|t| t["tenant"] == name).cloned())
            .unwrap_or(Value::Null)
    };
    assert_eq!(of("team-a")["usage"]["sandboxes"], 2, "{tenants}");
    assert_eq!(of("team-a")["keys"], json!([team_id]));
    assert_eq!(of(&user_tenant)["usage"]["sandboxes"], 0);
    assert_eq!(tenants["defaultQuotas"]["sandboxes"], 1000);
    let (_, own) = server.call_as(Some(&admin), "GET", "/api/v1/sandboxes", None)?;
    assert_eq!(own["sandboxes"], json!([]), "{own}");

    // Hostile and malformed bodies: refused with the reason, nothing written.
    let before = std::fs::read(server.data.join("keys.json"))?;
    for (body, want) in [
        (json!({"tenant": "../etc"}), "INVALID_TENANT"),
        (json!({"tenant": ""}), "INVALID_TENANT"),
        (json!({"tenant": "t".repeat(65)}), "INVALID_TENANT"),
        (json!({"name": "a\u{1b}[31mred"}), "INVALID_NAME"),
        (json!({"name": "n".repeat(129)}), "INVALID_NAME"),
        (json!({"quotas": {"cpuWeight": 0}}), "INVALID_QUOTA"),
        (json!({"quotas": {"cpuWeight": 101}}), "INVALID_QUOTA"),
        (
            json!({"quotas": {"sandboxes": 9_223_372_036_854_775_809_u64}}),
            "INVALID_QUOTA",
        ),
        (json!({"quotas": {"sandboxes": -1}}), "INVALID_REQUEST"),
        (json!({"quotas": {"gpus": 1}}), "INVALID_REQUEST"),
        // serde alone fills a struct from an array, by position.
        (json!({"quotas": [null, null]}), "INVALID_REQUEST"),
        (json!({"admin": "yes"}), "INVALID_REQUEST"),
        (json!({"sha256": "00"}), "INVALID_REQUEST"),
        (json!(["team"]), "INVALID_REQUEST"),
    ] {
        let (status, answer) =
            server.call_as(Some(&admin), "POST", "/api/v1/keys", Some(body.clone()))?;
        assert_eq!(status, 400, "{body}: {answer}");
        assert_eq!(code(&answer), want, "{body}: {answer}");
    }
    let (status, answer) = server.call_as(
        Some(&admin),
        "PATCH",
        "/api/v1/keys/key_nothing",
        Some(json!({"name": "x"})),
    )?;
    assert_eq!((status, code(&answer)), (404, "KEY_NOT_FOUND"), "{answer}");
    assert_eq!(std::fs::read(server.data.join("keys.json"))?, before);

    // The last admin key can be neither demoted nor revoked; once there is another, it can.
    let (_, listed) = server.call_as(Some(&admin), "GET", "/api/v1/keys", None)?;
    let admin_id = listed["keys"]
        .as_array()
        .and_then(|k| k.iter().find(|k| k["admin"] == true))
        .and_then(|k| k["id"].as_str())
        .ok_or("no admin key listed")?
        .to_owned();
    let path = format!("/api/v1/keys/{admin_id}");
    let (status, answer) =
        server.call_as(Some(&admin), "PATCH", &path, Some(json!({"admin": false})))?;
    assert_eq!((status, code(&answer)), (409, "LAST_ADMIN_KEY"), "{answer}");
    let (status, answer) = server.call_as(Some(&admin), "DELETE", &path, None)?;
    assert_eq!((status, code(&answer)), (409, "LAST_ADMIN_KEY"), "{answer}");
    let (status, answer) = server.call_as(
        Some(&admin),
        "PATCH",
        &format!("/api/v1/keys/{team_id}"),
        Some(json!({"admin": true})),
    )?;
    assert_eq!(status, 200, "{answer}");
    let (_, me) = server.call_as(Some(&team), "GET", "/api/v1/me", None)?;
    assert_eq!(me["admin"], true);
    let (status, _) = server.call_as(Some(&team), "DELETE", &path, None)?;
    assert_eq!(status, 204);
    let (status, _) = server.call_as(Some(&admin), "GET", "/api/v1/me", None)?;
    assert_eq!(status, 401, "a revoked key stops at once");

    // A revoked key's sandboxes stay its tenant's; revoking the plain key stops it too.
    let (_, listed) = server.call_as(Some(&team), "GET", "/api/v1/keys", None)?;
    let user_id = listed["keys"]
        .as_array()
        .and_then(|k| k.iter().find(|k| k["tenant"] == user_tenant.as_str()))
        .and_then(|k| k["id"].as_str())
        .ok_or("no plain key listed")?
        .to_owned();
    let (status, _) = server.call_as(
        Some(&team),
        "DELETE",
        &format!("/api/v1/keys/{user_id}"),
        None,
    )?;
    assert_eq!(status, 204);
    let (status, _) = server.call_as(Some(&user), "GET", "/api/v1/sandboxes", None)?;
    assert_eq!(status, 401);
    let listing = kiln()
        .args(["keys", "list", "--data-dir"])
        .arg(&server.data)
        .output()?;
    let listing = String::from_utf8(listing.stdout)?;
    assert!(
        listing.contains(&team_id) && listing.contains("(admin)"),
        "{listing}"
    );
    Ok(())
}

#[test]
fn without_keys_me_tells_the_machine_quotas_and_keys_are_off() -> TestResult {
    let server = start(Options::default())?;
    let (status, me) = server.call("GET", "/api/v1/me", None)?;
    assert_eq!(status, 200, "{me}");
    assert_eq!(me["tenant"], "local");
    assert_eq!(me["auth"], false);
    assert_eq!(me["admin"], false);
    assert_eq!(me["quotas"]["sandboxes"], 10_000);
    for (method, path) in [("GET", "/api/v1/keys"), ("GET", "/api/v1/tenants")] {
        let (status, body) = server.call(method, path, None)?;
        assert_eq!((status, code(&body)), (409, "KEYS_OFF"), "{body}");
    }
    let (status, body) = server.call("POST", "/api/v1/keys", Some(json!({})))?;
    assert_eq!((status, code(&body)), (409, "KEYS_OFF"), "{body}");
    assert!(!server.data.join("keys.json").exists());
    // A nested struct is read from an object only, never from an array by position.
    for body in [
        json!({"lifecycle": [null, null]}),
        json!({"resources": []}),
        json!({"networkRules": [[], []]}),
    ] {
        let (status, answer) = server.call("POST", "/api/v1/sandboxes", Some(body.clone()))?;
        assert_eq!(
            (status, code(&answer)),
            (400, "INVALID_REQUEST"),
            "{body}: {answer}"
        );
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("invalid type: sequence"),
            "{body}: {answer}"
        );
    }
    let (status, listed) = server.call("GET", "/api/v1/sandboxes", None)?;
    assert_eq!(
        (status, &listed["sandboxes"]),
        (200, &json!([])),
        "nothing was made"
    );
    Ok(())
}
