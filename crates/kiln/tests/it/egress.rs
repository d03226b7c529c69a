//! Issue 37: a sandbox's own egress rules and the tenant's secrets, against a real HTTPS
//! server on this host and a real `kiln serve --linux` (in a mount namespace whose
//! `/etc/hosts` names the server). The server answers what it was sent, hashed: it never
//! echoes a secret back into the box, so that what the box holds afterwards is only what
//! kiln let in.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::common::serve::{self, KillOnDrop, Options, Server, TestResult};

fn skip() -> bool {
    crate::common::skip_linux()
}

/// The far end: HTTPS with a certificate for `api.test`, `other.test` and `denied.test`
/// (from a CA of the test's), answering each request with its host, path, and the SHA-256
/// of its `Authorization` header; each request is also logged, one JSON line each.
const UPSTREAM: &str = r#"
import hashlib, http.server, json, ssl, sys
log = open(sys.argv[3], "a", buffering=1)
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        auth = self.headers.get("Authorization")
        seen = {"host": self.headers.get("Host"), "path": self.path,
                "auth_sha256": hashlib.sha256(auth.encode()).hexdigest() if auth else None}
        log.write(json.dumps(seen) + "\n")
        body = json.dumps(seen).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
server = http.server.ThreadingHTTPServer(("0.0.0.0", 0), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(sys.argv[1], sys.argv[2])
server.socket = ctx.wrap_socket(server.socket, server_side=True)
print(server.server_address[1], flush=True)
server.serve_forever()
"#;

/// This host's first IPv4 address that is neither loopback nor link-local.
fn own_ipv4() -> std::net::IpAddr {
    kiln_native::proxy::host_addresses()
        .into_iter()
        .find(|a| match a {
            std::net::IpAddr::V4(v4) => !v4.is_loopback() && !v4.is_link_local(),
            std::net::IpAddr::V6(_) => false,
        })
        .expect("this host has an IPv4 address besides loopback")
}

/// Writes a CA and a certificate for the test's names into `dir`; answers the bundle
/// (the host's own CAs and the test's) kiln should trust.
fn certificates(dir: &Path) -> std::path::PathBuf {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "kiln egress test CA");
    let ca = ca.self_signed(&ca_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let leaf = rcgen::CertificateParams::new(vec![
        "api.test".to_string(),
        "other.test".to_string(),
        "denied.test".to_string(),
    ])
    .unwrap()
    .signed_by(&key, &ca, &ca_key)
    .unwrap();
    std::fs::write(dir.join("leaf.pem"), leaf.pem()).unwrap();
    std::fs::write(dir.join("leaf.key"), key.serialize_pem()).unwrap();
    let mut bundle = kiln_native::boxes::host_ca_bundle()
        .map(|p| std::fs::read(p).unwrap())
        .unwrap_or_default();
    bundle.extend_from_slice(ca.pem().as_bytes());
    let path = dir.join("bundle.pem");
    std::fs::write(&path, bundle).unwrap();
    path
}

fn sha256(text: &str) -> String {
    hex::encode(Sha256::digest(text.as_bytes()))
}

/// Runs `script` in the sandbox's box with bash; answers its stdout.
fn sh(server: &Server, id: &str, script: &str) -> String {
    let (status, body) = server
        .exec(
            id,
            json!({"command": ["bash", "-c", script], "timeoutMs": 120000}),
        )
        .unwrap();
    assert_eq!(status, 200, "{body}");
    body["stdout"].as_str().unwrap_or_default().to_string() + body["stderr"].as_str().unwrap_or("")
}

/// Every pid on this host in one of kiln's boxes (a `/kiln/` cgroup, any hierarchy).
fn box_pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
                .is_ok_and(|c| c.lines().any(|l| l.contains(":/kiln/")))
        })
        .collect()
}

/// Whether `needle` is anywhere in process `pid`'s readable memory, environment or command
/// line.
fn process_holds(pid: u32, needle: &[u8]) -> bool {
    use std::os::unix::fs::FileExt;
    let found = |bytes: &[u8]| bytes.windows(needle.len()).any(|w| w == needle);
    for what in ["environ", "cmdline"] {
        if std::fs::read(format!("/proc/{pid}/{what}")).is_ok_and(|b| found(&b)) {
            return true;
        }
    }
    let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) else {
        return false;
    };
    let Ok(mem) = std::fs::File::open(format!("/proc/{pid}/mem")) else {
        return false;
    };
    for line in maps.lines() {
        let mut parts = line.split_whitespace();
        let (Some(range), Some(perms)) = (parts.next(), parts.next()) else {
            continue;
        };
        if !perms.starts_with('r') || line.ends_with("[vvar]") {
            continue;
        }
        let Some((start, end)) = range.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end)) = (u64::from_str_radix(start, 16), u64::from_str_radix(end, 16))
        else {
            continue;
        };
        let mut at = start;
        let mut buf = vec![0u8; 1 << 20];
        let mut tail: Vec<u8> = Vec::new();
        while at < end {
            let want = usize::try_from((end - at).min(buf.len() as u64)).unwrap();
            let Ok(n) = mem.read_at(&mut buf[..want], at) else {
                break;
            };
            if n == 0 {
                break;
            }
            tail.extend_from_slice(&buf[..n]);
            if found(&tail) {
                return true;
            }
            tail.drain(..tail.len().saturating_sub(needle.len()));
            at += n as u64;
        }
    }
    false
}

#[test]
fn issue37_a_rule_puts_a_secret_into_https_requests_to_its_host_and_nowhere_else() -> TestResult {
    if skip() {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let bundle = certificates(dir.path());
    let own = own_ipv4();
    let hosts = dir.path().join("hosts");
    std::fs::write(
        &hosts,
        format!("127.0.0.1 localhost\n{own} api.test other.test denied.test\n"),
    )?;
    let requests = dir.path().join("requests.jsonl");
    let mut upstream = KillOnDrop(
        Command::new("python3")
            .args(["-c", UPSTREAM])
            .arg(dir.path().join("leaf.pem"))
            .arg(dir.path().join("leaf.key"))
            .arg(&requests)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()?,
    );
    let mut first = String::new();
    BufReader::new(upstream.0.stdout.take().ok_or("no stdout")?).read_line(&mut first)?;
    let port: u16 = first.trim().parse()?;
    let bundle_text = bundle.to_string_lossy().into_owned();
    let own_text = own.to_string();
    let server = serve::start(Options {
        extra: &["--linux", "--network-allow", &own_text],
        env: &[("SSL_CERT_FILE", &bundle_text), ("KILN_LOG", "info")],
        hosts: Some(&hosts),
        ..Default::default()
    })?;

    // The value is random, so nothing but this test's request can hold it.
    let value = format!("sk-{}", hex::encode(rand_bytes()));
    let (status, body) = server.call(
        "POST",
        "/api/v1/secrets",
        Some(json!({"name": "api-token", "value": value})),
    )?;
    assert_eq!(status, 201, "{body}");
    assert!(!body.to_string().contains(&value), "{body}");
    let placeholder = "Bearer ${secrets.api-token}";
    let rules = json!({
        "allowOut": [format!("api.test:{port}"), format!("other.test:{port}")],
        "denyOut": ["0.0.0.0/0"],
        "rules": {
            "api.test": [{"transform": {"headers": {"Authorization": placeholder}}}],
            // A rule for a host the sandbox may not reach sends nothing there.
            "denied.test": [{"transform": {"headers": {"Authorization": placeholder}}}],
        }
    });
    let (status, created) = server.call(
        "POST",
        "/api/v1/sandboxes",
        Some(json!({"template": "linux-python", "networkRules": rules})),
    )?;
    assert_eq!(status, 201, "{created}");
    assert_eq!(created["network"], "allowlist", "{created}");
    assert_eq!(created["networkRules"], rules, "{created}");
    let id = created["containerId"].as_str().ok_or("no id")?.to_string();

    // A long-lived Python process in the box asks each host (HTTPS, through the proxy, its
    // own header a placeholder), then stays, holding what it received.
    let client = format!(
        r#"
import json, sys, time, urllib.request
out = open("/tmp/answers.jsonl", "w", buffering=1)
for host in ["api.test", "other.test", "denied.test"]:
    request = urllib.request.Request(f"https://{{host}}:{port}/x", headers={{"Authorization": "{placeholder}"}})
    try:
        answer = urllib.request.urlopen(request, timeout=30).read().decode()
    except Exception as e:
        answer = json.dumps({{"error": str(e)}})
    out.write(json.dumps({{"host": host, "answer": answer}}) + "\n")
out.write("done\n")
time.sleep(600)
"#
    );
    let written = serve::send(
        "PUT",
        &server.url(&format!("/api/v1/sandboxes/{id}/files/client.py")),
        None,
        Some(("application/octet-stream", client.as_bytes())),
    )?;
    assert!(
        written.status < 300,
        "{}",
        String::from_utf8_lossy(&written.body)
    );
    sh(
        &server,
        &id,
        "nohup python3 client.py > /tmp/client.log 2>&1 &",
    );
    let deadline = Instant::now() + Duration::from_secs(90);
    let answers = loop {
        let text = sh(&server, &id, "cat /tmp/answers.jsonl 2>/dev/null; true");
        if text.contains("done") {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "the client never finished: {text} {}",
            sh(&server, &id, "cat /tmp/client.log")
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let answer = |host: &str| -> Value {
        answers
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|a| a["host"] == host)
            .map(|a| {
                serde_json::from_str(a["answer"].as_str().unwrap_or("{}")).unwrap_or(Value::Null)
            })
            .unwrap_or(Value::Null)
    };
    // The rule's host got the secret (over HTTPS, opened by kiln's CA, which the box trusts).
    assert_eq!(
        answer("api.test")["auth_sha256"],
        sha256(&format!("Bearer {value}")),
        "{answers}"
    );
    // Another host got the placeholder the box sent, not the secret.
    assert_eq!(
        answer("other.test")["auth_sha256"],
        sha256(placeholder),
        "{answers}"
    );
    // A host the sandbox may not reach got nothing at all, rule or not.
    assert!(
        answer("denied.test")["error"]
            .as_str()
            .unwrap_or("")
            .contains("403"),
        "{answers}"
    );
    let seen = std::fs::read_to_string(&requests)?;
    assert!(!seen.contains("denied.test"), "{seen}");
    assert_eq!(seen.lines().count(), 2, "{seen}");
    // The refusal has its audit line.
    let log = server.log_text();
    assert!(
        log.lines().any(|l| l.contains("kiln::egress")
            && l.contains("denied.test")
            && l.contains("refused")),
        "no audit line for denied.test: {log}"
    );

    // The box never holds the secret: not in its processes' memory, environments or
    // command lines (the client is still alive), not in the files it can write.
    let pids = box_pids();
    assert!(!pids.is_empty(), "no box processes found");
    for pid in &pids {
        assert!(
            !process_holds(*pid, value.as_bytes()),
            "box process {pid} holds the secret"
        );
    }
    // The scan does read memory: the client holds the placeholder it sent.
    assert!(
        pids.iter()
            .any(|pid| process_holds(*pid, b"${secrets.api-token}")),
        "no box process holds even the placeholder: the scan reads nothing"
    );
    let reversed: String = value.chars().rev().collect();
    let files = sh(
        &server,
        &id,
        &format!(
            "grep -rIl -e \"$(printf %s {reversed} | rev)\" /home /root /tmp /var /etc /run /dev/shm 2>/dev/null; echo end"
        ),
    );
    assert_eq!(files.trim(), "end", "{files}");

    // Rules replaced while the box runs take effect for new connections: without the rule,
    // the placeholder goes to api.test as the box wrote it.
    let (status, body) = server.call(
        "PUT",
        &format!("/api/v1/sandboxes/{id}/network"),
        Some(json!({"allowOut": [format!("api.test:{port}")], "denyOut": ["*"]})),
    )?;
    assert_eq!(status, 200, "{body}");
    let out = sh(
        &server,
        &id,
        &format!("curl -sS -H 'Authorization: {placeholder}' https://api.test:{port}/after"),
    );
    let after: Value = serde_json::from_str(&out).map_err(|e| format!("{e}: {out}"))?;
    assert_eq!(after["auth_sha256"], sha256(placeholder), "{out}");
    // SOCKS5 (for TCP other than HTTP) goes through the same rules.
    let out = sh(
        &server,
        &id,
        &format!(
            "curl -sS -x '' --socks5-hostname 127.0.0.1:3128 -k https://api.test:{port}/socks; echo; \
             curl -sS -m 10 -x '' --socks5-hostname 127.0.0.1:3128 -k https://other.test:{port}/socks 2>&1; echo rc=$?"
        ),
    );
    assert!(out.contains("\"path\": \"/socks\""), "{out}");
    assert!(
        !out.contains("rc=0"),
        "other.test went through SOCKS5: {out}"
    );

    // A narrowing update ends connections it refuses that were open already: a tunnel to
    // other.test, open while the rules let it, is closed by the update that drops it.
    let (status, body) = server.call(
        "PUT",
        &format!("/api/v1/sandboxes/{id}/network"),
        Some(json!({"allowOut": [format!("api.test:{port}"), format!("other.test:{port}")], "denyOut": ["*"]})),
    )?;
    assert_eq!(status, 200, "{body}");
    let opened = sh(
        &server,
        &id,
        &format!(
            "rm -f /tmp/tunnel-end; ( exec 3<>/dev/tcp/127.0.0.1/3128;              printf 'CONNECT other.test:{port} HTTP/1.1\r\nHost: other.test:{port}\r\n\r\n' >&3;              head -c 39 <&3 > /tmp/tunnel-head; timeout 60 cat <&3 >/dev/null; echo rc=$? > /tmp/tunnel-end ) >/dev/null 2>&1 &              for i in $(seq 100); do [ -s /tmp/tunnel-head ] && break; sleep 0.05; done; cat /tmp/tunnel-head"
        ),
    );
    assert!(
        opened.starts_with("HTTP/1.1 200"),
        "the tunnel did not open: {opened}"
    );
    let still = sh(
        &server,
        &id,
        "sleep 0.5; cat /tmp/tunnel-end 2>/dev/null; echo .",
    );
    assert_eq!(still, ".\n", "the tunnel ended before the update");
    let (status, body) = server.call(
        "PUT",
        &format!("/api/v1/sandboxes/{id}/network"),
        Some(json!({"allowOut": [format!("api.test:{port}")], "denyOut": ["*"]})),
    )?;
    assert_eq!(status, 200, "{body}");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let ended = sh(&server, &id, "cat /tmp/tunnel-end 2>/dev/null; true");
        if ended == "rc=0\n" {
            break;
        }
        assert!(ended.is_empty(), "the tunnel ended another way: {ended}");
        assert!(
            Instant::now() < deadline,
            "an update that refuses an open tunnel left it open"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let log = server.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("kiln::egress") && l.contains("rules changed")),
        "no audit line for the closed tunnel"
    );

    // The secret's API never gives the value back, and a deleted secret is gone for rules.
    let (_, listed) = server.call("GET", "/api/v1/secrets", None)?;
    assert!(!listed.to_string().contains(&value), "{listed}");
    assert_eq!(listed["secrets"][0]["name"], "api-token", "{listed}");
    let (status, _) = server.call("DELETE", "/api/v1/secrets/api-token", None)?;
    assert_eq!(status, 204);
    let (status, _) = server.call("DELETE", "/api/v1/secrets/api-token", None)?;
    assert_eq!(status, 404);
    Ok(())
}

fn rand_bytes() -> [u8; 16] {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes))
        .unwrap();
    bytes
}
