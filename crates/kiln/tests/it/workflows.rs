//! Issue 35, workflows: a creator and a reviewer (kiln's agent loop on a scripted model
//! behind a real OpenAI-protocol HTTP server, or people through the API) work on a workspace
//! in a real `kiln serve --linux` with real PostgreSQL and nginx, through creation → review →
//! revision → approved | rejected. The audit trail and the workspace history agree; the
//! static website's preview serves the pages the creator wrote; the bad inputs are refused.
//! Needs root, runc and the services template.

use std::time::{Duration, Instant};

use kiln_llm::fake::{FakeProvider, Step};
use serde_json::{Value, json};

use crate::common::serve::{self, Options, Server};

fn skip() -> bool {
    crate::common::skip_linux()
}

/// A `kiln serve --linux` with keys whose model is `model` on the scripted server at
/// `base_url`.
fn with_model(model: &str, base_url: &str, data: Option<&std::path::Path>) -> Server {
    serve::start(Options {
        auth: true,
        data,
        extra: &["--linux"],
        env: &[("KILN_LLM_MODEL", model), ("KILN_LLM_BASE_URL", base_url)],
        ..Default::default()
    })
    .unwrap()
}

/// Polls workflow `id` until `done` holds (at most 240 s).
fn wait_for(server: &Server, id: &str, done: impl Fn(&Value) -> bool) -> Value {
    let started = Instant::now();
    loop {
        let (status, wf) = server
            .call("GET", &format!("/api/v1/workflows/{id}"), None)
            .unwrap();
        assert_eq!(status, 200, "{wf}");
        if done(&wf) {
            return wf;
        }
        assert!(
            started.elapsed() < Duration::from_secs(240),
            "workflow {id} did not get there: {wf:#}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn finished(wf: &Value) -> bool {
    matches!(wf["stage"].as_str(), Some("approved" | "rejected"))
}

fn actions(wf: &Value) -> Vec<String> {
    wf["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["action"].as_str().unwrap().to_owned())
        .collect()
}

/// Every event of the trail is a note in the workspace's history, with its words, in order.
fn trail_agrees_with_history(server: &Server, wf: &Value) {
    // The workspace's own route answers its sandbox's history.
    let (status, history) = server
        .call(
            "GET",
            &format!(
                "/api/v1/workspaces/{}/history?limit=500",
                wf["workspace"].as_str().unwrap()
            ),
            None,
        )
        .unwrap();
    assert_eq!(status, 200, "{history}");
    let entries = history["history"]
        .as_array()
        .unwrap_or_else(|| panic!("no entries: {history}"));
    let id = wf["id"].as_str().unwrap();
    let notes: Vec<&Value> = entries
        .iter()
        .rev()
        .filter(|e| {
            e["id"]
                .as_str()
                .unwrap_or("")
                .starts_with(&format!("workflow_{id}_"))
        })
        .collect();
    let events = wf["history"].as_array().unwrap();
    assert_eq!(notes.len(), events.len(), "{history:#}");
    for (event, note) in events.iter().zip(notes) {
        assert_eq!(event["commitId"], note["commitId"], "{event} / {note}");
        assert_eq!(
            note["id"],
            format!("workflow_{id}_{}", event["seq"]),
            "{note}"
        );
        let message = note["message"].as_str().unwrap();
        assert!(
            message.starts_with(&format!(
                "workflow {id} #{}: {} {}",
                event["seq"],
                event["agent"].as_str().unwrap(),
                event["action"].as_str().unwrap()
            )),
            "{message} / {event}"
        );
        assert_eq!(note["files"], json!([]), "a note changes no file: {note}");
    }
}

/// The database-schema workflow, end to end: the creator writes migrations and runs them in
/// a real postgres; the reviewer (on a model of its own) inspects the schema with run_sql
/// and asks for an index; the creator reads the feedback, adds it and resubmits; the
/// reviewer sees the index, changes a file and approves with a grade.
#[tokio::test(flavor = "multi_thread")]
async fn issue35_the_database_schema_workflow_is_reviewed_revised_and_approved() {
    if skip() {
        return;
    }
    let schema = "create table customers (id serial primary key, email text not null unique);\ncreate table orders (id serial primary key, customer_id int not null references customers(id), total numeric(10,2) not null);";
    let index = "create index orders_customer_id_idx on orders (customer_id);";
    let fake = FakeProvider::start(vec![
        // Creator, round 1.
        Step::tool(
            "c1",
            "write_file",
            json!({"path": "migrations/001_initial.sql", "content": schema}),
        ),
        Step::tool("c2", "run_sql", json!({"query": schema})),
        Step::tool(
            "c3",
            "write_file",
            json!({"path": "seed/data.sql", "content": "insert into customers (email) values ('a@example.com');"}),
        ),
        Step::tool(
            "c4",
            "run_sql",
            json!({"query": "insert into customers (email) values ('a@example.com')"}),
        ),
        Step::tool(
            "c5",
            "submit_for_review",
            json!({"notes": "customers and orders, with seed data"}),
        ),
        // Reviewer, round 1: inspects the live schema.
        Step::tool(
            "r1",
            "read_file",
            json!({"path": "migrations/001_initial.sql"}),
        ),
        Step::tool(
            "r2",
            "run_sql",
            json!({"query": "select indexname from pg_indexes where tablename = 'orders' order by indexname"}),
        ),
        Step::tool(
            "r3",
            "submit_review",
            json!({"approved": false, "grade": "C", "feedback": "orders.customer_id has no index: every customer's orders is a full scan", "suggestions": ["create index on orders (customer_id) in migrations/002_indexes.sql"]}),
        ),
        // Creator, round 2.
        Step::tool("c6", "get_review_feedback", json!({})),
        Step::tool(
            "c7",
            "write_file",
            json!({"path": "migrations/002_indexes.sql", "content": index}),
        ),
        Step::tool("c8", "run_sql", json!({"query": index})),
        Step::tool(
            "c9",
            "submit_for_review",
            json!({"notes": "added the index"}),
        ),
        // Reviewer, round 2: sees the index, leaves a note file, approves.
        Step::tool(
            "r4",
            "run_sql",
            json!({"query": "select indexname from pg_indexes where tablename = 'orders' order by indexname"}),
        ),
        Step::tool(
            "r5",
            "list_files",
            json!({}),
        ),
        Step::tool(
            "r6",
            "read_file",
            json!({"path": "migrations/002_indexes.sql"}),
        ),
        Step::Text("Looks right.".into()),
        // Told to submit (a nudge), it does.
        Step::tool(
            "r7",
            "submit_review",
            json!({"approved": true, "grade": "A", "feedback": "normalized, constrained and indexed"}),
        ),
    ])
    .await
    .unwrap();
    let base_url = fake.base_url.clone();
    let (wf, sse) = tokio::task::spawn_blocking(move || {
        let server = with_model("openai-compatible:creator-model", &base_url, None);
        let (status, started) = server
            .call(
                "POST",
                "/api/v1/workflows",
                Some(json!({
                    "template": "database-schema",
                    "task": "A schema for customers and their orders.",
                    "roles": {"reviewer": {"model": "openai-compatible:reviewer-model"}}
                })),
            )
            .unwrap();
        assert_eq!(status, 201, "{started}");
        assert_eq!(started["stage"], "creation");
        assert_eq!(started["currentAgent"], "creator");
        assert_eq!(started["roles"]["reviewer"]["model"], "openai-compatible:reviewer-model");
        let id = started["id"].as_str().unwrap().to_owned();
        let (_, ws) = server
            .call(
                "GET",
                &format!("/api/v1/workspaces/{}", started["workspaceId"].as_str().unwrap()),
                None,
            )
            .unwrap();
        assert_eq!(ws["services"][0]["type"], "postgres", "{ws}");
        let wf = wait_for(&server, &id, finished);
        trail_agrees_with_history(&server, &wf);
        // The events stream replays the whole trail and ends.
        let reply = serve::send(
            "GET",
            &server.url(&format!("/api/v1/workflows/{id}/events")),
            server.key.as_deref(),
            None,
        )
        .unwrap();
        assert_eq!(reply.status, 200);
        // The schema the reviewer approved is in the database.
        let (status, rows) = server
            .call(
                "POST",
                &format!("/api/v1/workspaces/{}/sql", wf["workspaceId"].as_str().unwrap()),
                Some(json!({"query": "select count(*) as n from pg_indexes where indexname = 'orders_customer_id_idx'"})),
            )
            .unwrap();
        assert_eq!((status, rows["rows"][0]["n"].as_i64()), (200, Some(1)), "{rows}");
        (wf, String::from_utf8_lossy(&reply.body).into_owned())
    })
    .await
    .unwrap();
    assert_eq!(wf["stage"], "approved", "{wf:#}");
    assert_eq!(wf["round"], 2);
    assert_eq!(wf["currentAgent"], Value::Null);
    let reviews = wf["reviews"].as_array().unwrap();
    assert_eq!(reviews.len(), 2, "{wf:#}");
    assert_eq!(reviews[0]["approved"], false);
    assert_eq!(reviews[0]["grade"], "C");
    assert_eq!(reviews[0]["round"], 1);
    assert_eq!(
        reviews[0]["suggestions"],
        json!(["create index on orders (customer_id) in migrations/002_indexes.sql"])
    );
    assert_eq!(reviews[0]["modifiedFiles"], json!([]), "{wf:#}");
    assert_eq!(reviews[1]["approved"], true);
    assert_eq!(reviews[1]["grade"], "A");
    assert_eq!(reviews[1]["by"], "agent");
    assert_eq!(
        actions(&wf),
        [
            "started",
            "turn_started",
            "submitted_for_review",
            "turn_started",
            "review_submitted",
            "revision_requested",
            "turn_started",
            "submitted_for_review",
            "turn_started",
            "nudged",
            "review_submitted",
            "approved"
        ]
    );
    // The stream carried the trail in order.
    let streamed: Vec<String> = sse
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| v["action"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(streamed, actions(&wf), "{sse}");

    let requests = fake.requests();
    // Each role on its own model, with its own tools.
    let models: Vec<&str> = requests
        .iter()
        .map(|r| r["model"].as_str().unwrap())
        .collect();
    assert_eq!(models[0], "creator-model");
    assert_eq!(models[5], "reviewer-model", "{models:?}");
    let tools = |r: &Value| -> Vec<String> {
        r["tools"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["function"]["name"].as_str().unwrap().to_owned())
            .collect()
    };
    let creator = tools(&requests[0]);
    assert!(
        creator.contains(&"submit_for_review".to_owned()),
        "{creator:?}"
    );
    assert!(
        !creator.contains(&"submit_review".to_owned()),
        "{creator:?}"
    );
    let reviewer = tools(&requests[5]);
    assert!(
        reviewer.contains(&"submit_review".to_owned()),
        "{reviewer:?}"
    );
    assert!(reviewer.contains(&"run_sql".to_owned()), "{reviewer:?}");
    assert!(
        !reviewer.contains(&"write_file".to_owned()),
        "the template gives the reviewer no write_file: {reviewer:?}"
    );
    // The reviewer saw only the primary key in round 1, the index in round 2.
    let round_one = requests[7].to_string();
    assert!(round_one.contains("orders_pkey") && !round_one.contains("orders_customer_id_idx"));
    let round_two = requests[13].to_string();
    assert!(round_two.contains("orders_customer_id_idx"), "{round_two}");
    // The creator read the feedback in round 2.
    let feedback = requests[9].to_string();
    assert!(feedback.contains("full scan"), "{feedback}");
}

/// The static-website workflow: the creator writes the pages, the workflow turns the
/// preview on, the reviewer fetches the page inside the workspace and approves; the preview
/// URL serves the pages. Then a creator that never hands over is rejected, bounded; the bad
/// inputs are refused; a person reviews through the API (changing a file, which the review's
/// modifiedFiles shows); a waiting workflow is cancelled.
#[tokio::test(flavor = "multi_thread")]
async fn issue35_the_static_website_workflow_previews_its_pages_and_bad_inputs_are_refused() {
    if skip() {
        return;
    }
    let fake = FakeProvider::start(vec![
        Step::tool(
            "c1",
            "write_file",
            json!({"path": "index.html", "content": "<!doctype html><html lang=\"en\"><head><link rel=\"stylesheet\" href=\"style.css\"></head><body><h1>Bakery</h1></body></html>\n"}),
        ),
        Step::tool(
            "c2",
            "write_file",
            json!({"path": "style.css", "content": "h1 { color: brown; }\n"}),
        ),
        Step::tool("c3", "submit_for_review", json!({"notes": "one page"})),
        Step::tool(
            "r1",
            "execute_code",
            json!({"language": "bash", "code": "curl -s http://127.0.0.1:8080/"}),
        ),
        Step::tool(
            "r2",
            "submit_review",
            json!({"approved": true, "grade": "B+", "feedback": "simple and valid"}),
        ),
        // A second workflow whose creator only talks: told twice, then rejected.
        Step::Text("I would make a page.".into()),
        Step::Text("Still thinking.".into()),
        Step::Text("Done, I think.".into()),
        // A third with a person reviewing: the creator's two turns.
        Step::tool(
            "h1",
            "write_file",
            json!({"path": "index.html", "content": "<h1>v1</h1>\n"}),
        ),
        Step::tool("h2", "submit_for_review", json!({})),
        Step::tool("h3", "get_review_feedback", json!({})),
        Step::tool("h4", "submit_for_review", json!({"notes": "took your edit"})),
    ])
    .await
    .unwrap();
    let base_url = fake.base_url.clone();
    let seen = tokio::task::spawn_blocking(move || {
        let server = with_model("openai-compatible:fake", &base_url, None);
        let (status, listed) = server
            .call("GET", "/api/v1/workflow-templates", None)
            .unwrap();
        assert_eq!(status, 200);
        let names: Vec<&str> = listed["templates"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["database-schema", "fullstack-app", "static-website"]);

        // Bad inputs.
        for (body, status, code) in [
            (json!({"template": "mobile-app", "task": "x"}), 400, "UNKNOWN_TEMPLATE"),
            (json!({"template": "static-website", "task": " "}), 400, "INVALID_REQUEST"),
            (
                json!({"template": "static-website", "task": "x", "maxRounds": 0}),
                400,
                "INVALID_REQUEST",
            ),
            (
                json!({"template": "static-website", "task": "x", "roles": {"reviewer": {"model": "nosuch:thing"}}}),
                400,
                "INVALID_MODEL",
            ),
            (
                json!({"template": "static-website", "task": "x", "workspace": "nowhere"}),
                404,
                "WORKSPACE_NOT_FOUND",
            ),
            (json!({"template": "static-website"}), 400, "INVALID_REQUEST"),
            (
                json!({"template": "static-website", "task": "x", "colour": "red"}),
                400,
                "INVALID_REQUEST",
            ),
        ] {
            let (got, refused) = server.call("POST", "/api/v1/workflows", Some(body.clone())).unwrap();
            assert_eq!((got, refused["error"]["code"].as_str()), (status, Some(code)), "{body}: {refused}");
        }
        let (status, _) = server.call("GET", "/api/v1/workflows/wf_nope", None).unwrap();
        assert_eq!(status, 404);

        // The website.
        let (status, started) = server
            .call(
                "POST",
                "/api/v1/workflows",
                Some(json!({"template": "static-website", "task": "A page for a bakery."})),
            )
            .unwrap();
        assert_eq!(status, 201, "{started}");
        let id = started["id"].as_str().unwrap().to_owned();
        let wf = wait_for(&server, &id, finished);
        assert_eq!(wf["stage"], "approved", "{wf:#}");
        assert_eq!(wf["reviews"][0]["grade"], "B+");
        trail_agrees_with_history(&server, &wf);
        let url = wf["previewUrl"].as_str().unwrap();
        let page = serve::send("GET", &server.url(url), None, None).unwrap();
        assert_eq!(page.status, 200);
        let body = String::from_utf8_lossy(&page.body).into_owned();
        assert!(body.contains("<h1>Bakery</h1>"), "{body}");
        let (path, query) = url.split_once('?').unwrap();
        let css = serve::send(
            "GET",
            &server.url(&format!("{path}style.css?{query}")),
            None,
            None,
        )
        .unwrap();
        assert_eq!(String::from_utf8_lossy(&css.body), "h1 { color: brown; }\n");

        // A creator that never hands over: bounded, then rejected with the reason.
        let (status, started) = server
            .call(
                "POST",
                "/api/v1/workflows",
                Some(json!({"template": "static-website", "task": "Another page."})),
            )
            .unwrap();
        assert_eq!(status, 201, "{started}");
        let idle = wait_for(&server, started["id"].as_str().unwrap(), finished);
        assert_eq!(idle["stage"], "rejected", "{idle:#}");
        assert!(
            idle["reason"]
                .as_str()
                .unwrap()
                .contains("ended its turn 3 times without calling submit_for_review"),
            "{idle}"
        );
        assert_eq!(actions(&idle).iter().filter(|a| *a == "nudged").count(), 2);

        // A person reviews, in the first workflow's workspace (one workflow at a time there).
        let (status, started) = server
            .call(
                "POST",
                "/api/v1/workflows",
                Some(json!({"template": "static-website", "task": "A third page.", "workspace": wf["workspace"], "roles": {"reviewer": {"human": true}}})),
            )
            .unwrap();
        assert_eq!(status, 201, "{started}");
        let hid = started["id"].as_str().unwrap().to_owned();
        assert_eq!(started["workspaceId"], wf["workspaceId"]);
        let (status, busy) = server
            .call(
                "POST",
                "/api/v1/workflows",
                Some(json!({"template": "static-website", "task": "x", "workspace": wf["workspace"]})),
            )
            .unwrap();
        assert_eq!((status, busy["error"]["code"].as_str()), (409, Some("WORKFLOW_RUNNING")), "{busy}");
        let waiting = wait_for(&server, &hid, |w| w["waitingForHuman"] == json!(true));
        assert_eq!(waiting["currentAgent"], "reviewer");
        // The creator is an agent: nobody may act as it.
        let (status, refused) = server
            .call("POST", &format!("/api/v1/workflows/{hid}/submit"), Some(json!({})))
            .unwrap();
        assert_eq!((status, refused["error"]["code"].as_str()), (409, Some("NOT_HUMAN_ROLE")));
        for bad in [json!({}), json!({"approved": "yes"}), json!({"approved": true, "grade": 5})] {
            let (status, refused) = server
                .call("POST", &format!("/api/v1/workflows/{hid}/review"), Some(bad.clone()))
                .unwrap();
            assert_eq!(status, 400, "{bad}: {refused}");
        }
        // The person edits a file, then asks for changes.
        let workspace = waiting["workspace"].as_str().unwrap();
        let put = serve::send(
            "PUT",
            &server.url(&format!("/api/v1/workspaces/{workspace}/files/index.html")),
            server.key.as_deref(),
            Some(("application/octet-stream", b"<h1>v1, edited</h1>\n")),
        )
        .unwrap();
        assert!(put.status < 300, "{}", String::from_utf8_lossy(&put.body));
        let got = serve::send(
            "GET",
            &server.url(&format!("/api/v1/workspaces/{workspace}/files/index.html")),
            server.key.as_deref(),
            None,
        )
        .unwrap();
        assert_eq!(String::from_utf8_lossy(&got.body), "<h1>v1, edited</h1>\n");
        let (status, listed) = server
            .call("GET", &format!("/api/v1/workspaces/{workspace}/files"), None)
            .unwrap();
        assert_eq!(status, 200, "{listed}");
        assert!(listed.to_string().contains("style.css"), "{listed}");
        let (status, _) = server
            .call("GET", "/api/v1/workspaces/nowhere/files", None)
            .unwrap();
        assert_eq!(status, 404);
        let (status, reviewed) = server
            .call(
                "POST",
                &format!("/api/v1/workflows/{hid}/review"),
                Some(json!({"approved": false, "feedback": "I fixed the heading; keep it", "suggestions": ["say more"]})),
            )
            .unwrap();
        assert_eq!(status, 200, "{reviewed}");
        assert_eq!(reviewed["stage"], "revision");
        assert_eq!(reviewed["reviews"][0]["modifiedFiles"], json!(["index.html"]), "{reviewed}");
        assert!(reviewed["reviews"][0]["by"].as_str().unwrap().starts_with("human:"));
        let again = wait_for(&server, &hid, |w| {
            w["waitingForHuman"] == json!(true) && w["round"] == json!(2)
        });
        assert_eq!(again["stage"], "review");
        // Cancelled while it waits.
        let (status, cancelled) = server
            .call("POST", &format!("/api/v1/workflows/{hid}/cancel"), None)
            .unwrap();
        assert_eq!(status, 200, "{cancelled}");
        assert_eq!(cancelled["stage"], "rejected");
        assert!(cancelled["reason"].as_str().unwrap().starts_with("cancelled by key"));
        assert_eq!(actions(&cancelled).last().map(String::as_str), Some("cancelled"));
        trail_agrees_with_history(&server, &cancelled);
        let (status, _) = server
            .call("POST", &format!("/api/v1/workflows/{hid}/cancel"), None)
            .unwrap();
        assert_eq!(status, 409);
        // Another tenant sees none of it.
        let other = serve::create_key(&server.data, None).unwrap();
        let (status, _) = server
            .call_as(Some(&other), "GET", &format!("/api/v1/workflows/{hid}"), None)
            .unwrap();
        assert_eq!(status, 404);
        let (_, listed) = server.call_as(Some(&other), "GET", "/api/v1/workflows", None).unwrap();
        assert_eq!(listed["workflows"], json!([]));
        let (_, mine) = server.call("GET", "/api/v1/workflows", None).unwrap();
        assert_eq!(mine["workflows"].as_array().unwrap().len(), 3);
    })
    .await;
    seen.unwrap();
    // The reviewer fetched the served page inside the workspace.
    let requests = fake.requests();
    let fetched = requests[4].to_string();
    assert!(fetched.contains("Bakery"), "{fetched}");
    // The human review's feedback reached the creator.
    let last = requests.last().unwrap().to_string();
    assert!(last.contains("I fixed the heading"), "{last}");
}

/// A workflow outlives its server: stopped during the creator's turn (its model call never
/// answered), the server starts again and the turn starts over; the person reviewing then
/// approves. Its record and trail come back from the data folder.
#[tokio::test(flavor = "multi_thread")]
async fn issue35_a_workflow_goes_on_after_its_server_restarts() {
    if skip() {
        return;
    }
    let fake = FakeProvider::start(vec![
        Step::Hang,
        Step::tool(
            "c1",
            "write_file",
            json!({"path": "index.html", "content": "<p>kept</p>\n"}),
        ),
        Step::tool(
            "c2",
            "submit_for_review",
            json!({"notes": "after a restart"}),
        ),
    ])
    .await
    .unwrap();
    let base_url = fake.base_url.clone();
    tokio::task::spawn_blocking(move || {
        let data = tempfile::tempdir().unwrap();
        let (id, key) = {
            let server = with_model("openai-compatible:fake", &base_url, Some(data.path()));
            let (status, started) = server
                .call(
                    "POST",
                    "/api/v1/workflows",
                    Some(json!({"template": "static-website", "task": "A page.", "roles": {"reviewer": {"human": true}}})),
                )
                .unwrap();
            assert_eq!(status, 201, "{started}");
            let id = started["id"].as_str().unwrap().to_owned();
            wait_for(&server, &id, |w| actions(w).contains(&"turn_started".to_owned()));
            let mut server = server;
            // SAFETY: kill sends a signal to the server's pid, which this test started.
            unsafe { libc::kill(server.child.0.id() as i32, libc::SIGTERM) };
            assert!(server.child.0.wait().unwrap().success());
            (id, server.key.clone())
        };
        let mut server = with_model("openai-compatible:fake", &base_url, Some(data.path()));
        server.key = key;
        let waiting = wait_for(&server, &id, |w| w["waitingForHuman"] == json!(true));
        assert_eq!(waiting["stage"], "review", "{waiting:#}");
        let (status, reviewed) = server
            .call(
                "POST",
                &format!("/api/v1/workflows/{id}/review"),
                Some(json!({"approved": true, "grade": "A"})),
            )
            .unwrap();
        assert_eq!((status, reviewed["stage"].as_str()), (200, Some("approved")), "{reviewed}");
        assert_eq!(
            actions(&reviewed),
            [
                "started",
                "turn_started",
                "turn_started",
                "preview_enabled",
                "submitted_for_review",
                "waiting_for_human",
                "review_submitted",
                "approved"
            ]
        );
        trail_agrees_with_history(&server, &reviewed);
    })
    .await
    .unwrap();
}

/// The fullstack-app template, played by people: its workspace gets postgres and redis, and
/// when the work is submitted its proxy preview shows what the backend answers on port 8000.
#[test]
fn issue35_the_fullstack_app_template_previews_its_backend() {
    if skip() {
        return;
    }
    let server = serve::start(Options {
        auth: true,
        extra: &["--linux"],
        ..Default::default()
    })
    .unwrap();
    let (status, started) = server
        .call(
            "POST",
            "/api/v1/workflows",
            Some(json!({"template": "fullstack-app", "task": "A notes app.", "roles": {"creator": {"human": true}, "reviewer": {"human": true}}})),
        )
        .unwrap();
    assert_eq!(status, 201, "{started}");
    assert_eq!(started["waitingForHuman"], true);
    let id = started["id"].as_str().unwrap();
    let (_, ws) = server
        .call(
            "GET",
            &format!(
                "/api/v1/workspaces/{}",
                started["workspace"].as_str().unwrap()
            ),
            None,
        )
        .unwrap();
    let services: Vec<&str> = ws["services"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["type"].as_str().unwrap())
        .collect();
    assert_eq!(services, ["postgres", "redis"], "{ws}");
    // The person playing the creator starts a backend on 8000.
    let (status, ran) = server
        .exec(
            started["sandboxId"].as_str().unwrap(),
            json!({"command": ["bash", "-c", "mkdir -p backend && echo '<h1>notes</h1>' > backend/index.html && (cd backend && setsid python3 -m http.server 8000 >/dev/null 2>&1 &) && for i in $(seq 50); do curl -sf localhost:8000/ >/dev/null && break; sleep 0.1; done"]}),
        )
        .unwrap();
    assert_eq!(status, 200, "{ran}");
    let (status, submitted) = server
        .call(
            "POST",
            &format!("/api/v1/workflows/{id}/submit"),
            Some(json!({"notes": "backend on 8000"})),
        )
        .unwrap();
    assert_eq!(status, 200, "{submitted}");
    let url = submitted["previewUrl"].as_str().unwrap();
    assert!(
        url.starts_with(&format!(
            "/preview/{}/8000/",
            started["sandboxId"].as_str().unwrap()
        )),
        "{url}"
    );
    let page = serve::send("GET", &server.url(url), None, None).unwrap();
    assert_eq!(
        (
            page.status,
            String::from_utf8_lossy(&page.body).into_owned()
        ),
        (200, "<h1>notes</h1>\n".to_string())
    );
    let (status, done) = server
        .call(
            "POST",
            &format!("/api/v1/workflows/{id}/review"),
            Some(json!({"approved": false, "feedback": "no API yet"})),
        )
        .unwrap();
    assert_eq!(
        (status, done["stage"].as_str()),
        (200, Some("revision")),
        "{done}"
    );
}
