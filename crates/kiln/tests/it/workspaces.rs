//! Issue 35, first part: workspaces through /api/v1 against a real `kiln serve --linux`:
//! a workspace with real PostgreSQL and Redis from Debian's packages, `run_sql` answering
//! rows as JSON, bounded in time and refusing bad statements, the services' names
//! resolving inside the box, stop (services shut down, box hibernated) and start again with
//! the data kept, and the refusals (an unknown service, MongoDB with its reason, another
//! tenant, a bad name). Needs root, runc and the services template.

use serde_json::{Value, json};

use crate::common::serve::{self, Options, Server, TestResult};

fn skip() -> bool {
    crate::common::skip_linux()
}

fn sql(server: &Server, ws: &str, body: Value) -> (u16, Value) {
    server
        .call("POST", &format!("/api/v1/workspaces/{ws}/sql"), Some(body))
        .unwrap()
}

#[test]
fn issue35_a_workspace_runs_postgres_and_redis_answers_sql_and_keeps_its_data_over_stop_and_start()
-> TestResult {
    if skip() {
        return Ok(());
    }
    let data = tempfile::tempdir()?;
    let server = serve::start(Options {
        auth: true,
        data: Some(data.path()),
        extra: &["--linux"],
        ..Default::default()
    })?;
    let (status, ws) = server.call(
        "POST",
        "/api/v1/workspaces",
        Some(json!({"name": "shop", "services": ["postgres", "redis"]})),
    )?;
    assert_eq!(status, 201, "{ws}");
    assert_eq!(ws["template"], "linux-services", "{ws}");
    assert_eq!(ws["state"], "running", "{ws}");
    let services = ws["services"].as_array().ok_or("no services")?;
    assert_eq!(services.len(), 2, "{ws}");
    assert_eq!(services[0]["type"], "postgres");
    assert_eq!(services[0]["host"], "postgres.workspace.internal");
    assert_eq!(services[0]["port"], 5432);
    assert_eq!(
        services[0]["connectionString"],
        "postgresql://postgres@postgres.workspace.internal:5432/postgres"
    );
    let id = ws["id"].as_str().ok_or("no id")?.to_string();
    let sandbox = ws["sandboxId"].as_str().ok_or("no sandbox")?.to_string();

    let (status, made) = sql(
        &server,
        &id,
        json!({"query": "create table items (id serial primary key, name text not null, price numeric(8,2))"}),
    );
    assert_eq!(status, 200, "{made}");
    let (status, inserted) = sql(
        &server,
        "shop",
        json!({"query": "insert into items (name, price) values ('tea', 3.50), ('cake', 4.25), (NULL, 1)"}),
    );
    assert_eq!(
        status, 400,
        "a NOT NULL violation is the database's refusal: {inserted}"
    );
    assert!(
        inserted["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("null value"),
        "{inserted}"
    );
    let (status, inserted) = sql(
        &server,
        "shop",
        json!({"query": "insert into items (name, price) values ('tea', 3.50), ('cake', 4.25)"}),
    );
    assert_eq!(
        (status, inserted["rowcount"].as_i64()),
        (200, Some(2)),
        "{inserted}"
    );
    let (status, rows) = sql(
        &server,
        &id,
        json!({"query": "select name, price, price > 4 as dear from items order by id"}),
    );
    assert_eq!(status, 200, "{rows}");
    assert_eq!(rows["columns"], json!(["name", "price", "dear"]), "{rows}");
    assert_eq!(
        rows["rows"],
        json!([{"name": "tea", "price": "3.50", "dear": false}, {"name": "cake", "price": "4.25", "dear": true}]),
        "{rows}"
    );
    // A burst of 100 statements at once: each waits its turn, none is refused.
    let answers: Vec<(u16, Value)> = std::thread::scope(|scope| {
        let calls: Vec<_> = (0..100)
            .map(|n| {
                let server = &server;
                let id = &id;
                scope.spawn(move || sql(server, id, json!({"query": format!("select {n} as n")})))
            })
            .collect();
        calls.into_iter().map(|c| c.join().unwrap()).collect()
    });
    for (n, (status, rows)) in answers.iter().enumerate() {
        assert_eq!(
            (*status, rows["rows"][0]["n"].as_u64()),
            (200, Some(n as u64)),
            "{rows}"
        );
    }
    // Bounded: at most 1000 rows, the rest said.
    let (status, many) = sql(
        &server,
        &id,
        json!({"query": "select generate_series(1, 5000) as n"}),
    );
    assert_eq!(status, 200);
    assert_eq!(many["rows"].as_array().map(Vec::len), Some(1000));
    assert_eq!(many["truncated"], true);
    // Bounded in time: a statement past its time is cancelled, said in the database's words.
    let started = std::time::Instant::now();
    let (status, slow) = sql(
        &server,
        &id,
        json!({"query": "select pg_sleep(30)", "timeoutMs": 500}),
    );
    assert_eq!(status, 400, "{slow}");
    assert!(
        slow["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("statement timeout"),
        "{slow}"
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(20));
    // Bad requests.
    for (body, why) in [
        (json!({"query": ""}), "empty"),
        (json!({"query": "select 1", "timeoutMs": 0}), "no time"),
        (json!({"query": "select 1", "service": "redis"}), "no SQL"),
        (
            json!({"query": "select 1", "service": "mysql"}),
            "not a service of it",
        ),
        (json!({"query": "select 1", "extra": 1}), "unknown field"),
    ] {
        let (status, refused) = sql(&server, &id, body);
        assert_eq!(status, 400, "{why}: {refused}");
    }

    // Inside the box, the services answer by name.
    let (status, ran) = server.exec(
        &sandbox,
        json!({"command": ["bash", "-c",
            "redis-cli -h redis.workspace.internal set k kept && psql -X -At -h postgres.workspace.internal -U postgres -c 'select count(*) from items'"]}),
    )?;
    assert_eq!(status, 200, "{ran}");
    assert_eq!(ran["stdout"], "OK\n2\n", "{ran}");

    // Stop: services shut down cleanly, the box hibernated; start: back with the data.
    let (status, stopped) = server.call("POST", &format!("/api/v1/workspaces/{id}/stop"), None)?;
    assert_eq!(
        (status, stopped["state"].as_str()),
        (200, Some("stopped")),
        "{stopped}"
    );
    let (_, info) = server.call("GET", &format!("/api/v1/sandboxes/{sandbox}"), None)?;
    assert_eq!(info["state"], "hibernated", "{info}");
    let (status, started) = server.call("POST", &format!("/api/v1/workspaces/{id}/start"), None)?;
    assert_eq!(
        (status, started["state"].as_str()),
        (200, Some("running")),
        "{started}"
    );
    let (status, rows) = sql(
        &server,
        &id,
        json!({"query": "select name from items order by id"}),
    );
    assert_eq!(status, 200, "{rows}");
    assert_eq!(
        rows["rows"],
        json!([{"name": "tea"}, {"name": "cake"}]),
        "{rows}"
    );
    let (_, ran) = server.exec(
        &sandbox,
        json!({"command": ["redis-cli", "-h", "redis.workspace.internal", "get", "k"]}),
    )?;
    assert_eq!(ran["stdout"], "kept\n", "{ran}");

    // Refusals.
    for (body, status_wanted, says) in [
        (
            json!({"type": "mongodb"}),
            400,
            "Debian does not package MongoDB",
        ),
        (json!({"type": "oracle"}), 400, "not a service"),
    ] {
        let (status, refused) = server.call(
            "POST",
            &format!("/api/v1/workspaces/{id}/services"),
            Some(body),
        )?;
        assert_eq!(status, status_wanted, "{refused}");
        assert!(
            refused["error"]["message"]
                .as_str()
                .unwrap_or("")
                .contains(says),
            "{refused}"
        );
    }
    for body in [
        json!({"name": "shop"}),
        json!({"name": "bad name/"}),
        json!({"name": "x", "services": ["oracle"]}),
        json!({"name": "y", "template": "python"}),
    ] {
        let (status, refused) = server.call("POST", "/api/v1/workspaces", Some(body.clone()))?;
        assert_eq!(status, 400, "{body}: {refused}");
    }
    let other = serve::create_key(&server.data, None)?;
    for path in [
        format!("/api/v1/workspaces/{id}"),
        "/api/v1/workspaces/shop".into(),
    ] {
        let (status, _) = server.call_as(Some(&other), "GET", &path, None)?;
        assert_eq!(status, 404, "another tenant saw {path}");
    }
    let (_, listed) = server.call_as(Some(&other), "GET", "/api/v1/workspaces", None)?;
    assert_eq!(listed["workspaces"], json!([]), "{listed}");

    // Deleted, with its sandbox.
    let (status, _) = server.call("DELETE", "/api/v1/workspaces/shop", None)?;
    assert_eq!(status, 204);
    let (status, _) = server.call("GET", &format!("/api/v1/sandboxes/{sandbox}"), None)?;
    assert_eq!(status, 404);
    let (status, _) = server.call("GET", &format!("/api/v1/workspaces/{id}"), None)?;
    assert_eq!(status, 404);
    Ok(())
}

/// MariaDB (`mysql`) answers `run_sql` as postgres does; nginx serves the workspace's files
/// on 8080, by name inside the box and through kiln's preview of the sandbox.
#[test]
fn issue35_mysql_answers_sql_and_nginx_serves_the_workspace() -> TestResult {
    if skip() {
        return Ok(());
    }
    let server = serve::start(Options {
        auth: true,
        extra: &["--linux"],
        ..Default::default()
    })?;
    let (status, ws) = server.call(
        "POST",
        "/api/v1/workspaces",
        Some(json!({"name": "site", "services": ["mysql", "nginx"]})),
    )?;
    assert_eq!(status, 201, "{ws}");
    let id = ws["id"].as_str().ok_or("no id")?.to_string();
    let sandbox = ws["sandboxId"].as_str().ok_or("no sandbox")?.to_string();
    let (status, _) = sql(&server, &id, json!({"query": "create database shop"}));
    assert_eq!(status, 200);
    let (status, made) = sql(
        &server,
        &id,
        json!({"query": "create table shop.t (n int primary key, s varchar(10))"}),
    );
    assert_eq!(status, 200, "{made}");
    let (status, _) = sql(
        &server,
        &id,
        json!({"query": "insert into shop.t values (1, 'one'), (2, NULL)"}),
    );
    assert_eq!(status, 200);
    let (status, rows) = sql(
        &server,
        &id,
        json!({"query": "select n, s from shop.t order by n", "service": "mysql"}),
    );
    assert_eq!(status, 200, "{rows}");
    assert_eq!(
        rows["rows"],
        json!([{"n": 1, "s": "one"}, {"n": 2, "s": null}]),
        "{rows}"
    );
    let (status, refused) = sql(&server, &id, json!({"query": "select * from nowhere"}));
    assert_eq!(status, 400, "{refused}");
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap_or("")
            .starts_with("mysql: "),
        "{refused}"
    );

    // nginx serves the workspace.
    let (status, ran) = server.exec(
        &sandbox,
        json!({"command": ["bash", "-c", "echo '<h1>hello</h1>' > index.html && curl -s http://nginx.workspace.internal:8080/"]}),
    )?;
    assert_eq!(
        (status, ran["stdout"].as_str()),
        (200, Some("<h1>hello</h1>\n")),
        "{ran}"
    );
    let page = serve::preview_body(&server, &sandbox, 8080)?;
    assert_eq!(page, "<h1>hello</h1>\n");

    // A static preview of a folder of it: a signed link that works without a key.
    let (status, ran) = server.exec(
        &sandbox,
        json!({"command": ["bash", "-c", "mkdir -p site && echo '<p>site</p>' > site/index.html"]}),
    )?;
    assert_eq!(status, 200, "{ran}");
    let (status, shown) = server.call(
        "POST",
        &format!("/api/v1/workspaces/{id}/preview"),
        Some(json!({"type": "static", "rootPath": "site"})),
    )?;
    assert_eq!(status, 200, "{shown}");
    assert_eq!(
        shown["preview"],
        json!({"type": "static", "port": 8080, "rootPath": "site"})
    );
    let url = shown["url"].as_str().ok_or("no url")?;
    let page = serve::send("GET", &server.url(url), None, None)?;
    assert_eq!(
        (
            page.status,
            String::from_utf8_lossy(&page.body).into_owned()
        ),
        (200, "<p>site</p>\n".to_string())
    );
    let bare = serve::send(
        "GET",
        &server.url(&format!("/preview/{sandbox}/8080/")),
        None,
        None,
    )?;
    assert_ne!(
        bare.status, 200,
        "a preview without the link's token or a key"
    );
    for (body, why) in [
        (
            json!({"type": "static", "rootPath": "../etc"}),
            "out of the workspace",
        ),
        (
            json!({"type": "static", "rootPath": "a; } server { root /"}),
            "not a plain path",
        ),
        (json!({"type": "proxy"}), "no port"),
        (json!({"type": "websocket"}), "no such type"),
        (json!({"type": "static", "port": 9000}), "static is on 8080"),
    ] {
        let (status, refused) = server.call(
            "POST",
            &format!("/api/v1/workspaces/{id}/preview"),
            Some(body),
        )?;
        assert_eq!(status, 400, "{why}: {refused}");
    }
    let (status, shown) = server.call(
        "POST",
        &format!("/api/v1/workspaces/{id}/preview"),
        Some(json!({"type": "proxy", "port": 8080})),
    )?;
    assert_eq!(
        (status, shown["preview"]["type"].as_str()),
        (200, Some("proxy")),
        "{shown}"
    );

    // A workspace made with publicPreview: its previews need no key and no link.
    let (status, open) = server.call(
        "POST",
        "/api/v1/workspaces",
        Some(json!({"name": "open", "services": ["nginx"], "publicPreview": true})),
    )?;
    assert_eq!(
        (status, open["publicPreview"].as_bool()),
        (201, Some(true)),
        "{open}"
    );
    let open_box = open["sandboxId"].as_str().ok_or("no sandbox")?;
    let (status, _) = server.exec(
        open_box,
        json!({"command": ["bash", "-c", "echo public > index.html"]}),
    )?;
    assert_eq!(status, 200);
    let page = serve::send(
        "GET",
        &server.url(&format!("/preview/{open_box}/8080/")),
        None,
        None,
    )?;
    assert_eq!(
        (
            page.status,
            String::from_utf8_lossy(&page.body).into_owned()
        ),
        (200, "public\n".to_string())
    );
    Ok(())
}

/// The chat agent in a workspace (a scripted model on a real OpenAI-protocol server): it adds
/// postgres, makes a table, fills and reads it with run_sql, and the rows reach the model.
#[tokio::test(flavor = "multi_thread")]
async fn issue35_the_agent_works_in_a_workspace_with_add_service_and_run_sql() {
    use kiln_llm::fake::{FakeProvider, Step};
    if skip() {
        return;
    }
    let fake = FakeProvider::start(vec![
        Step::tool("c1", "add_service", json!({"service_type": "postgres"})),
        Step::tool(
            "c2",
            "run_sql",
            json!({"query": "create table notes (body text)"}),
        ),
        Step::tool(
            "c3",
            "run_sql",
            json!({"query": "insert into notes values ('from the agent')"}),
        ),
        Step::tool("c4", "run_sql", json!({"query": "select body from notes"})),
        Step::tool("c5", "run_sql", json!({"query": "select nope"})),
        Step::Text("Done.".into()),
    ])
    .await
    .unwrap();
    let base_url = fake.base_url.clone();
    let (status, events) = tokio::task::spawn_blocking(move || -> (u16, String) {
        let env = [
            ("KILN_LLM_MODEL", "openai-compatible:fake"),
            ("KILN_LLM_BASE_URL", base_url.as_str()),
        ];
        let server = serve::start(Options {
            auth: true,
            extra: &["--linux"],
            env: &env,
            ..Default::default()
        })
        .unwrap();
        let (status, ws) = server
            .call("POST", "/api/v1/workspaces", Some(json!({"name": "agent-ws"})))
            .unwrap();
        assert_eq!(status, 201, "{ws}");
        let reply = serve::send(
            "POST",
            &server.url("/api/v1/chat"),
            server.key.as_deref(),
            Some((
                "application/json",
                json!({"workspace": "agent-ws", "messages": [{"role": "user", "content": "keep a note"}]})
                    .to_string()
                    .as_bytes(),
            )),
        )
        .unwrap();
        let (_, ws) = server.call("GET", "/api/v1/workspaces/agent-ws", None).unwrap();
        assert_eq!(ws["services"][0]["type"], "postgres", "{ws}");
        (reply.status, String::from_utf8_lossy(&reply.body).into_owned())
    })
    .await
    .unwrap();
    assert_eq!(status, 200, "{events}");
    assert!(events.contains("event: final"), "{events}");
    // The model saw the rows, and the database's own words for the bad statement.
    let requests = fake.requests();
    let seen = requests.last().unwrap().to_string();
    assert!(seen.contains("from the agent"), "{seen}");
    assert!(seen.contains("nope"), "{seen}");
    // Offered: the workspace's tools besides the others.
    let first = requests[0].to_string();
    for tool in ["add_service", "run_sql", "enable_preview", "execute_code"] {
        assert!(first.contains(tool), "{tool} was not offered: {first}");
    }
}

/// A key of the tenant, named, and its public id.
fn team_key(server: &Server, name: &str) -> (String, String) {
    let output = serve::kiln()
        .args([
            "keys",
            "create",
            "--tenant",
            "team",
            "--name",
            name,
            "--data-dir",
        ])
        .arg(&server.data)
        .output()
        .unwrap();
    assert!(output.status.success());
    let key = String::from_utf8(output.stdout).unwrap().trim().to_owned();
    let listed = serve::kiln()
        .args(["keys", "list", "--data-dir"])
        .arg(&server.data)
        .output()
        .unwrap();
    let id = String::from_utf8(listed.stdout)
        .unwrap()
        .lines()
        .find(|l| l.ends_with(&format!("\t{name}")))
        .and_then(|l| l.split('\t').next())
        .unwrap()
        .to_owned();
    (key, id)
}

/// Collaborators: a workspace is private to its owner within the tenant until shared; a
/// read collaborator sees it and runs read-only SQL (the database refuses its writes), a
/// write collaborator works in it and its sandbox; neither deletes or shares it; a key it
/// is not shared with finds nothing on any route, the sandbox's included.
#[test]
fn issue35_a_workspace_is_private_to_its_owner_and_its_collaborators() -> TestResult {
    if skip() {
        return Ok(());
    }
    let server = serve::start(Options {
        auth: true,
        extra: &["--linux"],
        ..Default::default()
    })?;
    let (alice, _) = team_key(&server, "alice");
    let (bob, bob_id) = team_key(&server, "bob");
    let (carol, carol_id) = team_key(&server, "carol");
    let (status, ws) = server.call_as(
        Some(&alice),
        "POST",
        "/api/v1/workspaces",
        Some(json!({"name": "shared", "services": ["postgres"]})),
    )?;
    assert_eq!(status, 201, "{ws}");
    assert_eq!(ws["collaborators"], json!([]));
    let sandbox = ws["sandboxId"].as_str().ok_or("no sandbox")?.to_string();
    let (status, _) = server.call_as(
        Some(&alice),
        "POST",
        "/api/v1/workspaces/shared/sql",
        Some(json!({"query": "create table notes (body text)"})),
    )?;
    assert_eq!(status, 200);
    let exec = json!({"command": ["sh", "-c", "echo hi"]});
    let sql = |key: &str, query: &str| {
        server
            .call_as(
                Some(key),
                "POST",
                "/api/v1/workspaces/shared/sql",
                Some(json!({"query": query})),
            )
            .unwrap()
    };

    // Not shared: bob of the same tenant finds nothing.
    let hidden = |key: &str| -> TestResult {
        for (method, path, body) in [
            ("GET", "/api/v1/workspaces/shared".to_string(), None),
            ("GET", "/api/v1/workspaces/shared/files".to_string(), None),
            (
                "POST",
                "/api/v1/workspaces/shared/stop".to_string(),
                Some(json!({})),
            ),
            ("GET", format!("/api/v1/sandboxes/{sandbox}"), None),
            ("GET", format!("/api/v1/sandboxes/{sandbox}/files"), None),
            (
                "POST",
                format!("/api/v1/sandboxes/{sandbox}/exec"),
                Some(exec.clone()),
            ),
            ("GET", format!("/api/sandbox/{sandbox}"), None),
            (
                "POST",
                "/api/sandbox/exec".to_string(),
                Some(json!({"containerId": sandbox, "command": ["true"]})),
            ),
        ] {
            let (status, body) = server.call_as(Some(key), method, &path, body)?;
            assert_eq!(status, 404, "{method} {path}: {body}");
        }
        let (_, listed) = server.call_as(Some(key), "GET", "/api/v1/workspaces", None)?;
        assert_eq!(listed["workspaces"], json!([]), "{listed}");
        let (_, boxes) = server.call_as(Some(key), "GET", "/api/v1/sandboxes", None)?;
        assert!(!boxes.to_string().contains(&sandbox), "{boxes}");
        Ok(())
    };
    hidden(&bob)?;
    hidden(&carol)?;

    // Shared: bob reads, carol writes. Only alice shares, with keys of the tenant only.
    let share = |key: &str, body: Value| {
        server
            .call_as(
                Some(key),
                "PUT",
                "/api/v1/workspaces/shared/collaborators",
                Some(body),
            )
            .unwrap()
    };
    for (body, code) in [
        (
            json!({"collaborators": [{"keyId": "key_nope", "access": "read"}]}),
            "UNKNOWN_KEY",
        ),
        (
            json!({"collaborators": [{"keyId": bob_id, "access": "admin"}]}),
            "INVALID_REQUEST",
        ),
        (
            json!({"collaborators": [{"keyId": bob_id, "access": "read"}, {"keyId": bob_id, "access": "write"}]}),
            "INVALID_REQUEST",
        ),
    ] {
        let (status, refused) = share(&alice, body.clone());
        assert_eq!(
            (status, refused["error"]["code"].as_str()),
            (400, Some(code)),
            "{body}: {refused}"
        );
    }
    let (status, shared) = share(
        &alice,
        json!({"collaborators": [{"keyId": bob_id, "access": "read"}, {"keyId": carol_id, "access": "write"}]}),
    );
    assert_eq!(status, 200, "{shared}");
    assert_eq!(
        shared["collaborators"][0],
        json!({"keyId": bob_id, "access": "read"})
    );

    // bob reads: the record, the files, the history, SELECTs; the database refuses writes.
    for path in [
        "/api/v1/workspaces/shared",
        "/api/v1/workspaces/shared/files",
        "/api/v1/workspaces/shared/history",
    ] {
        let (status, body) = server.call_as(Some(&bob), "GET", path, None)?;
        assert_eq!(status, 200, "{path}: {body}");
    }
    let (status, rows) = sql(&bob, "select count(*) as n from notes");
    assert_eq!(
        (status, rows["rows"][0]["n"].as_i64()),
        (200, Some(0)),
        "{rows}"
    );
    for write in [
        "insert into notes values ('from bob')",
        "create table bobs (n int)",
        "set default_transaction_read_only = off; insert into notes values ('sneaky')",
    ] {
        let (status, refused) = sql(&bob, write);
        assert_eq!(status, 400, "{write}: {refused}");
    }
    // …and nothing else: no sandbox, no writes, no stop, no sharing.
    for (method, path, body) in [
        (
            "POST",
            format!("/api/v1/sandboxes/{sandbox}/exec"),
            Some(exec.clone()),
        ),
        (
            "POST",
            "/api/v1/workspaces/shared/stop".to_string(),
            Some(json!({})),
        ),
        (
            "POST",
            "/api/v1/workspaces/shared/services".to_string(),
            Some(json!({"type": "redis"})),
        ),
        ("DELETE", "/api/v1/workspaces/shared".to_string(), None),
    ] {
        let (status, body) = server.call_as(Some(&bob), method, &path, body)?;
        assert_eq!(status, 404, "bob {method} {path}: {body}");
    }
    let put = serve::send(
        "PUT",
        &server.url("/api/v1/workspaces/shared/files/bob.txt"),
        Some(&bob),
        Some(("application/octet-stream", b"no")),
    )?;
    assert_eq!(put.status, 404);
    let (status, _) = share(&bob, json!({"collaborators": []}));
    assert_eq!(status, 404);

    // carol writes: SQL, files, the sandbox itself; still no delete and no sharing.
    let (status, inserted) = sql(&carol, "insert into notes values ('from carol')");
    assert_eq!(
        (status, inserted["rowcount"].as_i64()),
        (200, Some(1)),
        "{inserted}"
    );
    let (status, ran) = server.call_as(
        Some(&carol),
        "POST",
        &format!("/api/v1/sandboxes/{sandbox}/exec"),
        Some(exec.clone()),
    )?;
    assert_eq!(
        (status, ran["stdout"].as_str()),
        (200, Some("hi\n")),
        "{ran}"
    );
    let put = serve::send(
        "PUT",
        &server.url("/api/v1/workspaces/shared/files/carol.txt"),
        Some(&carol),
        Some(("application/octet-stream", b"yes")),
    )?;
    assert_eq!(put.status, 201);
    let (status, _) = server.call_as(Some(&carol), "DELETE", "/api/v1/workspaces/shared", None)?;
    assert_eq!(status, 404);
    let (status, _) = share(&carol, json!({"collaborators": []}));
    assert_eq!(status, 404);
    let (_, rows) = sql(&bob, "select body from notes");
    assert_eq!(rows["rows"], json!([{"body": "from carol"}]), "{rows}");

    // Unshared again: bob finds nothing.
    let (status, _) = share(
        &alice,
        json!({"collaborators": [{"keyId": carol_id, "access": "write"}]}),
    );
    assert_eq!(status, 200);
    hidden(&bob)?;
    Ok(())
}
