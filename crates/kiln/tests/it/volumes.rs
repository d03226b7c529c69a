//! Issue 37: named volumes through /api/v1 against a real `kiln serve --linux`: shared
//! between Linux boxes (read-write and read-only) and WebAssembly guests, kept across
//! sandbox deletion and a restart of kiln, refused delete while mounted, bounded by the
//! tenant's volumes quota, and refused with the reason for bad names, sizes and paths.

use serde_json::{Value, json};

use crate::common::serve::{self, Options, Server, TestResult};

fn skip() -> bool {
    crate::common::skip_linux()
}

fn sh(server: &Server, id: &str, script: &str) -> (i64, String) {
    let (status, body) = server
        .exec(id, json!({"command": ["bash", "-c", script]}))
        .unwrap();
    assert_eq!(status, 200, "{body}");
    (
        body["exitCode"].as_i64().unwrap_or(-1),
        body["stdout"].as_str().unwrap_or_default().to_string()
            + body["stderr"].as_str().unwrap_or(""),
    )
}

fn sandbox(server: &Server, body: Value) -> String {
    let (status, made) = server
        .call("POST", "/api/v1/sandboxes", Some(body))
        .unwrap();
    assert_eq!(status, 201, "{made}");
    made["containerId"].as_str().unwrap().to_string()
}

#[test]
fn issue37_named_volumes_are_shared_kept_and_bounded() -> TestResult {
    if skip() {
        return Ok(());
    }
    let data = tempfile::tempdir()?;
    let start = || {
        serve::start(Options {
            auth: true,
            data: Some(data.path()),
            extra: &["--linux", "--max-volumes", "2"],
            ..Default::default()
        })
    };
    let server = start()?;
    let (status, made) = server.call(
        "POST",
        "/api/v1/volumes",
        Some(json!({"name": "shared", "sizeMb": 32})),
    )?;
    assert_eq!(status, 201, "{made}");
    assert_eq!(made["sizeBytes"], 32 << 20, "{made}");
    let volume = made["id"].as_str().ok_or("no id")?.to_string();

    // One box writes, another reads it read-only, a WebAssembly guest reads and writes.
    let writer = sandbox(
        &server,
        json!({"template": "linux-python", "volumeMounts": [{"volume": "shared", "path": "/mnt/shared"}]}),
    );
    let (code, out) = sh(
        &server,
        &writer,
        "echo from-box > /mnt/shared/a.txt && id -u && df -m /mnt/shared | tail -1",
    );
    assert_eq!(code, 0, "{out}");
    let reader = sandbox(
        &server,
        json!({"template": "linux-debian", "volumeMounts": [{"volume": volume, "path": "/data", "readOnly": true}]}),
    );
    let (code, out) = sh(&server, &reader, "cat /data/a.txt; echo x > /data/b.txt");
    assert_ne!(code, 0, "a read-only mount was written: {out}");
    assert!(
        out.starts_with("from-box\n") && out.contains("Read-only file system"),
        "{out}"
    );
    let wasm = sandbox(
        &server,
        json!({"language": "python", "volumeMounts": [{"volume": "shared", "path": "/mnt/shared"}]}),
    );
    let (status, ran) = server.exec(
        &wasm,
        json!({"code": "print(open('/mnt/shared/a.txt').read(), end=''); open('/mnt/shared/w.txt', 'w').write('from-wasm')"}),
    )?;
    assert_eq!(
        (status, ran["stdout"].as_str()),
        (200, Some("from-box\n")),
        "{ran}"
    );
    let (_, out) = sh(&server, &writer, "cat /mnt/shared/w.txt");
    assert_eq!(out, "from-wasm");

    // The volume's size binds what boxes write into it.
    let (code, out) = sh(
        &server,
        &writer,
        "dd if=/dev/zero of=/mnt/shared/big bs=1M count=64 2>&1; echo rc=$?",
    );
    assert!(
        out.contains("No space left on device") && code == 0,
        "{out}"
    );
    sh(&server, &writer, "rm -f /mnt/shared/big");

    // In use: not deleted, the sandboxes named.
    let (status, refused) = server.call("DELETE", "/api/v1/volumes/shared", None)?;
    assert_eq!(status, 409, "{refused}");
    assert_eq!(refused["error"]["code"], "VOLUME_IN_USE", "{refused}");
    let (_, info) = server.call("GET", "/api/v1/volumes/shared", None)?;
    assert_eq!(
        info["mountedBy"].as_array().map(Vec::len),
        Some(3),
        "{info}"
    );
    assert!(info["usedBytes"].as_u64().unwrap_or(0) > 0, "{info}");

    // Bad names, sizes, paths, and another tenant's volume.
    for (body, said) in [
        (json!({"name": "not a name"}), "volume name"),
        (json!({"name": "tiny", "sizeMb": 1}), "size"),
        (json!({"name": "huge", "sizeMb": 1 << 20}), "size"),
        (json!({"name": "shared"}), "exists"),
    ] {
        let (status, refused) = server.call("POST", "/api/v1/volumes", Some(body.clone()))?;
        assert!(status == 400 || status == 409, "{body}: {status} {refused}");
        assert!(
            refused["error"]["message"]
                .as_str()
                .unwrap_or("")
                .contains(said),
            "{body}: {refused}"
        );
    }
    for (mounts, said) in [
        (
            json!([{"volume": "shared", "path": "/proc/x"}]),
            "system folder",
        ),
        (
            json!([{"volume": "shared", "path": "relative"}]),
            "absolute",
        ),
        (
            json!([{"volume": "shared", "path": "/workspace"}]),
            "cover the workspace",
        ),
        (
            json!([{"volume": "shared", "path": "/a"}, {"volume": "shared", "path": "/a"}]),
            "two volumes",
        ),
        (json!([{"volume": "nope", "path": "/a"}]), "no volume"),
        (
            json!([{"volume": "shared", "path": "/a", "bogus": 1}]),
            "unknown field",
        ),
    ] {
        let (status, refused) = server.call(
            "POST",
            "/api/v1/sandboxes",
            Some(json!({"template": "linux-python", "volumeMounts": mounts})),
        )?;
        assert!(
            status == 400 || status == 404,
            "{mounts}: {status} {refused}"
        );
        assert!(
            refused["error"]["message"]
                .as_str()
                .unwrap_or("")
                .contains(said),
            "{mounts}: {refused}"
        );
    }
    let other = serve::create_key(&server.data, None)?;
    let (status, _) = server.call_as(Some(&other), "GET", "/api/v1/volumes/shared", None)?;
    assert_eq!(status, 404);
    let (status, refused) = server.call_as(
        Some(&other),
        "POST",
        "/api/v1/sandboxes",
        Some(
            json!({"template": "linux-python", "volumeMounts": [{"volume": volume, "path": "/x"}]}),
        ),
    )?;
    assert_eq!(status, 404, "another tenant mounted the volume: {refused}");

    // The volumes quota (2 here).
    let (status, _) = server.call(
        "POST",
        "/api/v1/volumes",
        Some(json!({"name": "second", "sizeMb": 16})),
    )?;
    assert_eq!(status, 201);
    let (status, refused) = server.call(
        "POST",
        "/api/v1/volumes",
        Some(json!({"name": "third", "sizeMb": 16})),
    )?;
    assert_eq!(status, 429, "{refused}");
    assert_eq!(refused["error"]["details"]["quota"], "volumes", "{refused}");

    // Deleting the sandboxes frees it; its files stay, across a restart of kiln.
    for id in [&writer, &reader, &wasm] {
        let (status, _) = server.call("DELETE", &format!("/api/v1/sandboxes/{id}"), None)?;
        assert_eq!(status, 204);
    }
    let key = server.key.clone();
    drop(server);
    let mut server = start()?;
    server.key = key;
    let (status, listed) = server.call("GET", "/api/v1/volumes", None)?;
    assert_eq!(status, 200);
    let names: Vec<&str> = listed["volumes"]
        .as_array()
        .ok_or("no list")?
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert_eq!(names, ["shared", "second"], "{listed}");
    let again = sandbox(
        &server,
        json!({"template": "linux-python", "volumeMounts": [{"volume": "shared", "path": "/mnt/v"}]}),
    );
    let (_, out) = sh(&server, &again, "cat /mnt/v/a.txt /mnt/v/w.txt");
    assert_eq!(out, "from-box\nfrom-wasm");
    let (status, _) = server.call("DELETE", &format!("/api/v1/sandboxes/{again}"), None)?;
    assert_eq!(status, 204);
    let (status, _) = server.call("DELETE", "/api/v1/volumes/shared", None)?;
    assert_eq!(status, 204);
    let (status, _) = server.call("DELETE", "/api/v1/volumes/shared", None)?;
    assert_eq!(status, 404);
    let (status, _) = server.call("DELETE", "/api/v1/volumes/second", None)?;
    assert_eq!(status, 204);
    assert!(
        std::fs::read_dir(data.path().join("volumes"))?
            .next()
            .is_none(),
        "a deleted volume left files"
    );
    Ok(())
}
