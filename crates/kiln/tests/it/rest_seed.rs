//! Issue 16, item 1: `kiln rest` honours seed 000's code contract as written. A planner
//! prompted the seed's way answers plans in the seed's shape (`get` not `read`, no `cache`,
//! `response_hints` with `status` and `location_id`) whose code uses `store` bound to the
//! plan's resource, the seed's `ctx` keys, `safe_open`, guarded `os`, and `REPLY` or a
//! top-level `return`. Each case below is one request with the plan the scripted provider
//! answers for it; plans without `cache` are never cached, so every request asks the
//! provider once, in order.

use kiln_llm::fake::{FakeProvider, Step};
use serde_json::{Value, json};

use super::{Answer, Rest};

/// What a case expects back.
enum Expect {
    /// This status, this `Location` (or none) and exactly this JSON body (`Null`: empty).
    Reply(u16, Option<&'static str>, Value),
    /// kiln's error envelope with this status and code, its message holding this text.
    Error(u16, &'static str, &'static str),
}

struct Case {
    plan: Step,
    tenant: &'static str,
    /// `METHOD /path`.
    request: &'static str,
    body: Option<Value>,
    expect: Expect,
}

/// A plan in seed 000's shape; its `id` is the path's second segment, as a planner would
/// say.
fn seed_plan(action: &str, resource: &str, request: &str, hints: Value, code: &str) -> Step {
    let path = request.split_once(' ').map_or("", |(_, path)| path);
    let id = path.split(['/', '?']).filter(|s| !s.is_empty()).nth(1);
    Step::Text(
        json!({
            "action": action,
            "resource": resource,
            "id": id,
            "criteria": {},
            "payload": null,
            "response_hints": hints,
            "code": {"language": "python", "block": format!("```python\n{code}\n```")},
        })
        .to_string(),
    )
}

/// What a started `kiln rest` and its scripted planner leave for checks after the cases.
struct Served {
    rest: Rest,
    fake: FakeProvider,
    _dir: tempfile::TempDir,
}

/// Starts a `kiln rest` whose planner is a provider test server scripted with the cases'
/// plans, sends each case's request (as its tenant, with `headers`) and checks its answer.
async fn run_cases(cases: Vec<Case>, headers: &'static [(&'static str, &'static str)]) -> Served {
    let (plans, requests): (Vec<Step>, Vec<_>) = cases
        .into_iter()
        .map(|c| (c.plan, (c.tenant, c.request, c.body, c.expect)))
        .unzip();
    let fake = FakeProvider::start(plans).await.unwrap();
    let env = vec![
        ("KILN_LLM_MODEL", "openai-compatible:seed-000".to_string()),
        ("KILN_LLM_BASE_URL", fake.base_url.clone()),
    ];
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let rest = tokio::task::spawn_blocking(move || {
        let rest = Rest::start(&data, &["--deadline", "10"], &env);
        for (n, (tenant, request, body, expect)) in requests.into_iter().enumerate() {
            let (method, path) = request.split_once(' ').unwrap();
            let mut sent = vec![("x-session-id", tenant)];
            sent.extend_from_slice(headers);
            let body = body.map(|b| b.to_string());
            let answer = rest.call(method, path, body.as_deref(), &sent);
            check(n, &format!("{tenant}: {request}"), &answer, &expect);
        }
        rest
    })
    .await
    .unwrap();
    Served {
        rest,
        fake,
        _dir: dir,
    }
}

fn check(n: usize, what: &str, answer: &Answer, expect: &Expect) {
    match expect {
        Expect::Reply(status, location, json) => assert_eq!(
            (answer.status, answer.location.as_deref(), &answer.json),
            (*status, *location, json),
            "case {n}, {what}: {answer:?}"
        ),
        Expect::Error(status, code, part) => {
            answer.assert_error(*status, code);
            let message = answer.json["error"]["message"].as_str().unwrap_or("");
            assert!(
                message.contains(part),
                "case {n}, {what}: {part:?} not in {answer:?}"
            );
        }
    }
}

// The seed's typical patterns.

const CREATE: &str = r#"obj = ctx["body_json"]
if not isinstance(obj, dict):
    REPLY = {"status": 400, "headers": {}, "body": {"error": "expected a JSON object"}}
else:
    new_id = store.insert(obj)
    REPLY = {"headers": {}, "body": obj}"#;

const GET: &str = r#"obj = store.get(id)
if obj is None:
    REPLY = {"status": 404, "headers": {}, "body": {"error": "not found", "id": id}}
else:
    REPLY = {"status": 200, "headers": {}, "body": obj}"#;

const SEARCH: &str = r#"filters = {k: v[0] for k, v in ctx["query"].items()}
REPLY = {"status": 200, "headers": {}, "body": store.search(filters)}"#;

const LIST: &str = r#"items = store.get_all()
return {"status": 200, "headers": {"X-Total": str(len(items))}, "body": items}"#;

const REPLACE: &str = r#"obj = store.replace(id, ctx["body_json"])
if obj is None:
    REPLY = {"status": 404, "body": {"error": "not found"}}
else:
    REPLY = {"status": 200, "body": obj}"#;

/// Returns the body alone: the status is the action's default.
const PATCH: &str = r#"obj = store.patch(id, ctx["body_json"])
if obj is None:
    return {"status": 404, "body": {"error": "not found"}}
return obj"#;

/// No status: a delete's default, 204.
const DELETE: &str = r#"if store.delete(id):
    REPLY = {"body": None}
else:
    REPLY = {"status": 404, "body": {"error": "not found"}}"#;

/// A request answered by a seed-shaped plan.
fn seeded(
    (action, resource, hints): (&str, &str, Value),
    code: &str,
    tenant: &'static str,
    request: &'static str,
) -> Case {
    Case {
        plan: seed_plan(action, resource, request, hints, code),
        tenant,
        request,
        body: None,
        expect: Expect::Reply(0, None, Value::Null),
    }
}

/// A request answered by a seed-shaped plan with no hints.
fn plain(
    action: &str,
    resource: &str,
    code: &str,
    tenant: &'static str,
    request: &'static str,
) -> Case {
    seeded((action, resource, json!({})), code, tenant, request)
}

/// A request on `members` answered by a plan for `action` with this code.
fn member(action: &str, code: &str, tenant: &'static str, request: &'static str) -> Case {
    let hints = match action {
        "create" => json!({"status": 201, "location_id": true}),
        // No status: the action's default (204) answers.
        "delete" => json!({}),
        _ => json!({"status": 200}),
    };
    seeded((action, "members", hints), code, tenant, request)
}

impl Case {
    fn body(mut self, body: Value) -> Case {
        self.body = Some(body);
        self
    }

    fn answers(mut self, status: u16, location: Option<&'static str>, body: Value) -> Case {
        self.expect = Expect::Reply(status, location, body);
        self
    }

    fn ok(self, body: Value) -> Case {
        self.answers(200, None, body)
    }

    fn not_found(self) -> Case {
        self.answers(404, None, json!({"error": "not found"}))
    }
}

fn hartmann() -> Value {
    json!({"name": "Hartmann", "city": "Köln", "id": 1})
}

fn bauer() -> Value {
    json!({"name": "Bauer", "city": "Köln", "id": 1})
}

fn ada() -> Value {
    json!({"id": "ada", "name": "Ada"})
}

/// Creates (integer and string ids, Location) and reads, in two tenants.
fn create_and_read_cases() -> Vec<Case> {
    let create = |tenant, body: Value| member("create", CREATE, tenant, "POST /members").body(body);
    let get = |tenant, request| member("get", GET, tenant, request);
    let search = |tenant| {
        member(
            "search",
            SEARCH,
            tenant,
            "GET /members/search?city=k%C3%B6ln",
        )
    };
    let adams = json!({"name": "Adams", "id": 2});
    vec![
        create("alice", json!({"name": "Hartmann", "city": "Köln"})).answers(
            201,
            Some("/members/1"),
            hartmann(),
        ),
        create("alice", json!({"name": "Adams"})).answers(201, Some("/members/2"), adams.clone()),
        create("bob", json!({"name": "Bauer", "city": "Köln"})).answers(
            201,
            Some("/members/1"),
            bauer(),
        ),
        create("alice", ada()).answers(201, Some("/members/ada"), ada()),
        create("alice", json!([1, 2])).answers(
            400,
            None,
            json!({"error": "expected a JSON object"}),
        ),
        get("alice", "GET /members/1").ok(hartmann()),
        get("bob", "GET /members/2").answers(404, None, json!({"error": "not found", "id": "2"})),
        get("bob", "GET /members/1").ok(bauer()),
        get("alice", "GET /members/ada").ok(ada()),
        search("alice").ok(json!([hartmann()])),
        search("bob").ok(json!([bauer()])),
        member("list", LIST, "alice", "GET /members").ok(json!([hartmann(), adams, ada()])),
        member("list", LIST, "bob", "GET /members").ok(json!([bauer()])),
    ]
}

/// Replaces, patches and deletes: each tenant changes only its own objects.
fn write_cases() -> Vec<Case> {
    let replace = |tenant, body| member("replace", REPLACE, tenant, "PUT /members/2").body(body);
    let patch = |tenant, body| member("patch", PATCH, tenant, "PATCH /members/1").body(body);
    let delete = || member("delete", DELETE, "alice", "DELETE /members/2");
    let aachen = json!({"name": "Hartmann", "city": "Aachen", "id": 1});
    vec![
        replace("alice", json!({"name": "Adams", "city": "Bonn"}))
            .ok(json!({"name": "Adams", "city": "Bonn", "id": 2})),
        replace("bob", json!({"name": "Mallory"})).not_found(),
        patch("alice", json!({"city": "Aachen"})).ok(aachen.clone()),
        member("patch", PATCH, "bob", "PATCH /members/2")
            .body(json!({"city": "x"}))
            .not_found(),
        delete().answers(204, None, Value::Null),
        delete().not_found(),
        member("get", GET, "alice", "GET /members/2").answers(
            404,
            None,
            json!({"error": "not found", "id": "2"}),
        ),
        member("get", GET, "bob", "GET /members/1").ok(bauer()),
        member("list", LIST, "alice", "GET /members").ok(json!([aachen, ada()])),
    ]
}

#[tokio::test(flavor = "multi_thread")]
async fn issue_16_seed_000_plans_create_read_search_list_replace_patch_delete_per_tenant() {
    let mut cases = create_and_read_cases();
    cases.extend(write_cases());
    let served = run_cases(cases, &[]).await;
    let tenants = served.rest.data.join("tenants");
    let stored = |tenant: &str| -> Value {
        serde_json::from_slice(&std::fs::read(tenants.join(tenant).join("members.json")).unwrap())
            .unwrap()
    };
    assert_eq!(
        stored("bob"),
        json!([{"name": "Bauer", "city": "Köln", "id": 1}])
    );
    assert_eq!(stored("alice").as_array().map(Vec::len), Some(2));

    // The prompt is the seed's (its schema, store, ctx, safe_open, imports, REPLY), then
    // kiln's additions.
    let requests = served.fake.requests();
    assert_eq!(requests.len(), 22, "every request asked the planner once");
    let prompt = requests[0]["messages"][0]["content"].as_str().unwrap();
    let at = |needle: &str| {
        prompt
            .find(needle)
            .unwrap_or_else(|| panic!("{needle:?} not in the prompt:\n{prompt}"))
    };
    let seed = [
        "\"action\": \"create|get|list|replace|patch|delete|search\"",
        "\"response_hints\": {\"status\": <int>, \"location_id\": true|false}",
        "insert(obj) -> id",
        "client {\"ip\"}, session {\"id\"}",
        "safe_open(path, mode)",
        "json, re, math, statistics, uuid, datetime, itertools, typing, pathlib",
        "REPLY = {\"status\"",
    ];
    let additions = at("kiln's additions");
    for needle in seed {
        assert!(
            at(needle) < additions,
            "{needle:?} comes after kiln's additions"
        );
    }
    for needle in [
        "\"cache\": {\"generic\"",
        "store.collection(name)",
        "ctx also has params",
    ] {
        assert!(
            at(needle) > additions,
            "{needle:?} comes before kiln's additions"
        );
    }
}

const WHOAMI: &str = r#"h = ctx["headers"]
return {
    "method": ctx["method"], "path": ctx["path"], "segments": ctx["segments"],
    "query": ctx["query"], "ip": ctx["client"]["ip"], "session": ctx["session"]["id"],
    "custom": h.get("x-custom"), "credentials": "authorization" in h or "cookie" in h,
    "body_json": ctx["body_json"], "body_raw": ctx["body_raw"],
    "kiln": [ctx["tenant"], ctx["client_ip"], ctx["body"], store.collection("whoami").count()],
}"#;

const WRITE_NOTE: &str = r#"with safe_open("notes/today.txt", "w") as f:
    f.write(ctx["body_json"]["text"])
REPLY = {"body": {"saved": "notes/today.txt"}}"#;

const READ_NOTE: &str = r#"with safe_open("notes/today.txt") as f:
    return {"text": f.read()}"#;

const GUARDED_OS: &str = r#"import io
import os
import pathlib
buffer = io.StringIO()
buffer.write("a,b\n")
return {"joined": os.path.join("notes", "a.txt"), "ext": os.path.splitext("x.csv")[1],
        "stem": pathlib.PurePosixPath("a/b.txt").stem, "csv": buffer.getvalue()}"#;

impl Case {
    fn fails(mut self, status: u16, code: &'static str, part: &'static str) -> Case {
        self.expect = Expect::Error(status, code, part);
        self
    }
}

fn context_and_file_cases() -> Vec<Case> {
    let whoami = json!({
        "method": "POST", "path": "/whoami", "segments": ["whoami"], "query": {"x": ["1", "2"]},
        "ip": "127.0.0.1", "session": "alice", "custom": "v", "credentials": false,
        "body_json": {"a": 1}, "body_raw": "{\"a\":1}", "kiln": ["alice", "127.0.0.1", {"a": 1}, 0],
    });
    let read = |tenant, code| plain("get", "notes", code, tenant, "GET /notes");
    let hints = ("create", "whoami", json!({"status": 202}));
    vec![
        // response_hints.status is the default status; without location_id, no Location.
        seeded(hints, WHOAMI, "alice", "POST /whoami?x=1&x=2")
            .body(json!({"a": 1}))
            .answers(202, None, whoami),
        plain("create", "notes", WRITE_NOTE, "alice", "POST /notes")
            .body(json!({"text": "hello"}))
            .answers(201, None, json!({"saved": "notes/today.txt"})),
        read("alice", READ_NOTE).ok(json!({"text": "hello"})),
        // Bob's folder has no such file, and Alice's is out of his reach.
        read("bob", READ_NOTE).fails(500, "CODE_FAILED", "FileNotFoundError"),
        read(
            "bob",
            "REPLY = {'body': safe_open('../alice/notes/today.txt').read()}",
        )
        .fails(403, "POLICY_VIOLATION", "'..'"),
        read(
            "bob",
            "REPLY = {'body': safe_open('notes/../../alice/notes/today.txt').read()}",
        )
        .fails(403, "POLICY_VIOLATION", "'..'"),
        read("alice", "REPLY = {'body': safe_open('/etc/passwd').read()}").fails(
            403,
            "POLICY_VIOLATION",
            "absolute path '/etc/passwd'",
        ),
        plain("get", "paths", GUARDED_OS, "alice", "GET /paths")
            .ok(json!({"joined": "notes/a.txt", "ext": ".csv", "stem": "b", "csv": "a,b\n"})),
    ]
}

#[tokio::test(flavor = "multi_thread")]
async fn issue_16_seed_000_plans_see_the_seeds_ctx_and_keep_files_in_the_tenants_folder() {
    let headers = &[
        ("x-custom", "v"),
        ("authorization", "Bearer not-for-the-code"),
        ("cookie", "a=b"),
    ];
    let served = run_cases(context_and_file_cases(), headers).await;
    let tenants = served.rest.data.join("tenants");
    assert_eq!(
        std::fs::read_to_string(tenants.join("alice/notes/today.txt")).unwrap(),
        "hello"
    );
    assert!(!tenants.join("bob/notes").exists());
}

/// Each refused plan would first write to the `audit` collection: that none exists after
/// proves that nothing of them ran.
fn refused(code: &str, part: &'static str) -> Case {
    let code = format!("store.collection('audit').insert({{'ran': True}})\n{code}");
    plain("get", "audit", &code, "alice", "GET /audit").fails(502, "PLAN_UNSAFE", part)
}

fn escape_cases() -> Vec<Case> {
    vec![
        refused(
            "import os\nos.system('id')\nREPLY = {'status': 200}",
            "os.system is not allowed",
        ),
        refused(
            "from os import system\nsystem('id')",
            "os.system is not allowed",
        ),
        refused(
            "import os\nREPLY = {'body': os.listdir('/')}",
            "os.listdir is not allowed",
        ),
        refused(
            "import os\nREPLY = {'body': dict(os.environ)}",
            "os.environ is not allowed",
        ),
        refused(
            "import os.path as p\nREPLY = {'body': p.exists('/etc')}",
            "os.path.exists is not",
        ),
        refused(
            "import pathlib\nREPLY = {'body': pathlib.Path('/etc').exists()}",
            "pathlib.Path is not",
        ),
        refused(
            "import io\nREPLY = {'body': io.open('/etc/passwd').read()}",
            "io.open is not allowed",
        ),
        refused(
            "REPLY = {'body': open('/etc/passwd').read()}",
            "'open' is not allowed",
        ),
        refused(
            "import socket\nsocket.create_connection(('10.0.0.1', 80))",
            "'socket' is not allowed",
        ),
        refused("import subprocess", "import of 'subprocess' is not allowed"),
        refused("REPLY = {'body': str(ctx.__class__)}", "'__class__'"),
        // A pure path's `parser` is posixpath, whose `os` is the real one.
        refused(
            "import pathlib\nREPLY = {'body': str(pathlib.PurePosixPath('a').parser.os)}",
            "'parser'",
        ),
        // Past the tree check, the module itself offers nothing else.
        plain(
            "get",
            "alias",
            "import os\nm = os\nREPLY = {'body': str(m.system)}",
            "alice",
            "GET /alias",
        )
        .fails(500, "CODE_FAILED", "no attribute 'system'"),
        // A module offers its own API (`__all__`), not what it imported: statistics'
        // namedtuple calls eval (plan_gate, the gate's fuzzer, found it).
        plain(
            "get",
            "stats",
            "import statistics\nP = statistics.namedtuple('P', 'a b')\nREPLY = {'body': 1}",
            "alice",
            "GET /stats",
        )
        .fails(500, "CODE_FAILED", "no attribute 'namedtuple'"),
        plain(
            "get",
            "mean",
            "import statistics\nREPLY = {'body': statistics.mean([1, 2, 6])}",
            "alice",
            "GET /mean",
        )
        .ok(json!(3)),
    ]
}

#[tokio::test(flavor = "multi_thread")]
async fn issue_16_attack_seed_000_plans_that_reach_past_guarded_os_are_refused_before_they_run() {
    let served = run_cases(escape_cases(), &[]).await;
    assert!(
        !served.rest.data.join("tenants/alice/audit.json").exists(),
        "no refused plan ran at all"
    );
}

// Issue 32, §3: seed 000's `safe_open("notes.txt", "w")` failed in the guest with
// `FileNotFoundError: '/'`: os.makedirs stat-ed its way up from the tenant's folder to `/`,
// which the guest may not look at. Folders are now made from the tenant's folder down.

/// A request on `notes` (as `tenant`) answered by a plan with this code; a create answers
/// 201 by default.
fn note(action: &str, code: &str, tenant: &'static str, request: &'static str) -> Case {
    plain(action, "notes", code, tenant, request)
}

/// Dave's folder is a fresh one, made by kiln: top-level files, every mode, nested folders.
fn issue_32_file_cases() -> Vec<Case> {
    let read =
        |path: &str| format!("with safe_open({path:?}) as f:\n    return {{'text': f.read()}}");
    vec![
        // Seed 000's own line: a file at the top of the tenant's folder.
        note(
            "create",
            "with safe_open(\"notes.txt\", \"w\") as f:\n    f.write(ctx[\"body_json\"][\"text\"])\nREPLY = {\"body\": {\"saved\": \"notes.txt\"}}",
            "dave",
            "POST /notes",
        )
        .body(json!({"text": "hello"}))
        .answers(201, None, json!({"saved": "notes.txt"})),
        note("get", &read("notes.txt"), "dave", "GET /notes").ok(json!({"text": "hello"})),
        note(
            "patch",
            "with safe_open('notes.txt', 'a') as f:\n    n = f.write(', again')\nreturn {'appended': n}",
            "dave",
            "PATCH /notes",
        )
        .ok(json!({"appended": 7})),
        note("get", &read("notes.txt"), "dave", "GET /notes").ok(json!({"text": "hello, again"})),
        // Bytes: wb then rb.
        note(
            "create",
            "with safe_open('blob.bin', 'wb') as f:\n    f.write(bytes([0, 1, 255]) + 'kiln'.encode())\nreturn {'ok': True}",
            "dave",
            "POST /blobs",
        )
        .answers(201, None, json!({"ok": true})),
        note(
            "get",
            "with safe_open('blob.bin', 'rb') as f:\n    return {'bytes': list(f.read())}",
            "dave",
            "GET /blobs",
        )
        .ok(json!({"bytes": [0, 1, 255, 107, 105, 108, 110]})),
        // Nested folders, made on the first write; `x` refuses a file that exists.
        note(
            "create",
            "with safe_open('a/b/c.txt', 'w') as f:\n    f.write('deep')\nwith safe_open('a/b2/d.txt', 'x') as f:\n    f.write('new')\nreturn {'ok': True}",
            "dave",
            "POST /deep",
        )
        .answers(201, None, json!({"ok": true})),
        note("get", &read("a/b/c.txt"), "dave", "GET /deep").ok(json!({"text": "deep"})),
        note("get", &read("./a//b2/d.txt"), "dave", "GET /deep").ok(json!({"text": "new"})),
        note(
            "create",
            "safe_open('a/b2/d.txt', 'x')",
            "dave",
            "POST /deep",
        )
        .fails(500, "CODE_FAILED", "FileExistsError"),
        // Reading a file that is not there is the code's error, not a policy's.
        note("get", &read("a/none.txt"), "dave", "GET /deep")
            .fails(500, "CODE_FAILED", "FileNotFoundError"),
        // The refusals.
        note("create", "safe_open('../x', 'w')", "dave", "POST /notes").fails(
            403,
            "POLICY_VIOLATION",
            "safe_open refuses '../x': no '..'",
        ),
        note("get", &read("a/../../dave/notes.txt"), "dave", "GET /notes").fails(
            403,
            "POLICY_VIOLATION",
            "no '..'",
        ),
        note("get", &read("/etc/passwd"), "dave", "GET /notes").fails(
            403,
            "POLICY_VIOLATION",
            "absolute path '/etc/passwd'",
        ),
        note("create", "safe_open('/data/dave/x.txt', 'w')", "dave", "POST /notes").fails(
            403,
            "POLICY_VIOLATION",
            "absolute path '/data/dave/x.txt'",
        ),
    ]
}

/// Carol's folder holds links planted from the host (a plan cannot make one: guarded `os`
/// has no symlink, and pathlib.Path is refused): `other` -> `../alice` (Alice's folder),
/// `passwd` -> `/etc/passwd` (in the guest, readlink refuses a link to an absolute path),
/// `loop` -> `loop`, and `inner` -> `a/b`, a link that stays inside.
fn issue_32_link_cases() -> Vec<Case> {
    let outside = "it leads outside the tenant's folder";
    vec![
        note(
            "create",
            "with safe_open('a/b/c.txt', 'w') as f:\n    f.write('mine')\nreturn {'ok': True}",
            "carol",
            "POST /deep",
        )
        .answers(201, None, json!({"ok": true})),
        note(
            "get",
            "with safe_open('inner/c.txt') as f:\n    return {'text': f.read()}",
            "carol",
            "GET /deep",
        )
        .ok(json!({"text": "mine"})),
        note(
            "get",
            "return {'text': safe_open('other/secret.txt').read()}",
            "carol",
            "GET /notes",
        )
        .fails(
            403,
            "POLICY_VIOLATION",
            "safe_open refuses 'other/secret.txt': it leads outside",
        ),
        note(
            "create",
            "safe_open('other/new.txt', 'w')",
            "carol",
            "POST /notes",
        )
        .fails(403, "POLICY_VIOLATION", outside),
        note(
            "create",
            "safe_open('other/deep/new.txt', 'a')",
            "carol",
            "POST /notes",
        )
        .fails(403, "POLICY_VIOLATION", outside),
        note(
            "get",
            "return {'text': safe_open('passwd').read()}",
            "carol",
            "GET /notes",
        )
        .fails(403, "POLICY_VIOLATION", outside),
        note("create", "safe_open('passwd', 'w')", "carol", "POST /notes").fails(
            403,
            "POLICY_VIOLATION",
            outside,
        ),
        // A link to itself cannot be followed either.
        note(
            "get",
            "return {'text': safe_open('loop/x').read()}",
            "carol",
            "GET /notes",
        )
        .fails(
            403,
            "POLICY_VIOLATION",
            "the link 'loop' cannot be followed inside it",
        ),
    ]
}

#[tokio::test(flavor = "multi_thread")]
async fn issue_32_safe_open_reads_writes_appends_and_nests_in_the_guest_and_refuses_escapes() {
    let mut cases = issue_32_file_cases();
    cases.extend(issue_32_link_cases());
    let (plans, requests): (Vec<Step>, Vec<_>) = cases
        .into_iter()
        .map(|c| (c.plan, (c.tenant, c.request, c.body, c.expect)))
        .unzip();
    let count = plans.len();
    let fake = FakeProvider::start(plans).await.unwrap();
    let env = vec![
        ("KILN_LLM_MODEL", "openai-compatible:seed-000".to_string()),
        ("KILN_LLM_BASE_URL", fake.base_url.clone()),
    ];
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let tenants = data.join("tenants");
    std::fs::create_dir_all(tenants.join("alice")).unwrap();
    std::fs::write(tenants.join("alice/secret.txt"), "alice's").unwrap();
    std::fs::create_dir_all(tenants.join("carol")).unwrap();
    for (link, target) in [
        ("other", "../alice"),
        ("passwd", "/etc/passwd"),
        ("inner", "a/b"),
        ("loop", "loop"),
    ] {
        std::os::unix::fs::symlink(target, tenants.join("carol").join(link)).unwrap();
    }
    let rest = tokio::task::spawn_blocking(move || {
        let rest = Rest::start(&data, &["--deadline", "10"], &env);
        for (n, (tenant, request, body, expect)) in requests.into_iter().enumerate() {
            let (method, path) = request.split_once(' ').unwrap();
            let body = body.map(|b| b.to_string());
            let answer = rest.call(method, path, body.as_deref(), &[("x-session-id", tenant)]);
            check(n, &format!("{tenant}: {request}"), &answer, &expect);
        }
        rest
    })
    .await
    .unwrap();
    assert_eq!(
        fake.requests().len(),
        count,
        "every request asked the planner once"
    );

    // On the host: the files are in the tenant's own folder, and nothing went elsewhere.
    let read = |path: &str| std::fs::read(tenants.join(path)).unwrap();
    assert_eq!(read("dave/notes.txt"), b"hello, again");
    assert_eq!(read("dave/blob.bin"), b"\x00\x01\xffkiln");
    assert_eq!(read("dave/a/b/c.txt"), b"deep");
    assert_eq!(read("dave/a/b2/d.txt"), b"new");
    assert_eq!(read("carol/a/b/c.txt"), b"mine");
    assert!(!tenants.join("x").exists() && !tenants.join("dave/x.txt").exists());
    let mut alice: Vec<_> = std::fs::read_dir(tenants.join("alice"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    alice.sort();
    assert_eq!(
        alice,
        ["secret.txt"],
        "nothing was written through the link"
    );
    drop(rest);
}
