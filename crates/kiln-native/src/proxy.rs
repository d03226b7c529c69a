//! The egress proxy: a box has no interface but loopback; where its sandbox has a network
//! (`network: allowlist`, or rules of its own), the agent listens on a loopback port inside
//! the box and carries every connection made to it over its channel to this proxy in kiln.
//! The proxy answers `CONNECT host:port`, absolute-form `GET http://…` and SOCKS5
//! (`socks5h://127.0.0.1:3128`, for other TCP), and dials the name itself, from the host's
//! network, when the operator's allowlist and the sandbox's own rules
//! ([`kiln_core::net::EgressPolicy`]) let it. Anything else gets a clear refusal (`403`
//! naming the rule, a refused SOCKS5 reply) and an audit line (target `kiln::egress`).
//!
//! Requests to hosts that a sandbox's `rules` name get the rules' headers, their
//! `${secrets.NAME}` placeholders filled from the tenant's secrets: plain HTTP in the
//! request the proxy forwards, HTTPS by opening the TLS with a certificate of kiln's CA
//! ([`crate::intercept`]). `pip install` and `npm install` work with the proxy variables
//! kiln sets in the box.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use kiln_core::net::{EgressGrant, EgressPolicy};
use kiln_guest::proto::Reply;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::channel::{Channel, Replies};
use crate::intercept::Interceptor;

pub use kiln_core::net::{Allowlist, Cidr, DEFAULT_NAMES, SecretSource, host_addresses};

/// The loopback port the proxy answers on inside a box.
pub const PROXY_PORT: u16 = 3128;
/// The longest request head read.
const MAX_HEAD: usize = 64 << 10;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a TLS handshake (either side) may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(20);

/// What one box's proxy applies: the operator's allowlist, the sandbox's rules (changed
/// while the box runs by [`LiveEgress::set`]; connections opened after see them), and what
/// header rules need.
pub struct LiveEgress {
    operator: Arc<Allowlist>,
    /// The rules now; open connections watch it, and end when a change refuses them.
    policy: tokio::sync::watch::Sender<Arc<EgressPolicy>>,
    secrets: Option<Arc<dyn SecretSource>>,
    tls: Option<Arc<Interceptor>>,
}

impl std::fmt::Debug for LiveEgress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveEgress")
            .field("operator", &self.operator)
            .field("grant", &self.grant())
            .finish_non_exhaustive()
    }
}

impl LiveEgress {
    pub fn new(
        operator: Arc<Allowlist>,
        secrets: Option<Arc<dyn SecretSource>>,
        tls: Option<Arc<Interceptor>>,
    ) -> LiveEgress {
        LiveEgress {
            operator,
            policy: tokio::sync::watch::Sender::new(Arc::new(EgressPolicy::default())),
            secrets,
            tls,
        }
    }

    /// The operator's list alone (template builds, `kiln exec`).
    pub fn operator_only(operator: Arc<Allowlist>) -> Arc<LiveEgress> {
        Arc::new(LiveEgress::new(operator, None, None))
    }

    /// Waits until the rules change so that a connection to `host:port` at `ip` would be
    /// refused, and answers why (never, while they let it be).
    async fn until_refused(&self, host: &str, port: u16, ip: Option<IpAddr>) -> String {
        let mut changes = self.policy.subscribe();
        loop {
            if changes.changed().await.is_err() {
                return std::future::pending().await;
            }
            let policy = changes.borrow_and_update().clone();
            let verdict = policy
                .check_name(&self.operator, host, port)
                .and_then(|()| match ip {
                    Some(ip) => {
                        policy.check_address(&self.operator, host, port, ip, &host_addresses())
                    }
                    None => Ok(()),
                });
            if let Err(why) = verdict {
                return why;
            }
        }
    }

    /// Applies a sandbox's rules from now on (`None`: the operator's list alone); open
    /// connections the new rules refuse are closed.
    pub fn set(&self, grant: Option<EgressGrant>) -> Result<(), String> {
        let policy = match grant {
            Some(grant) => EgressPolicy::new(grant)?,
            None => EgressPolicy::default(),
        };
        self.policy.send_replace(Arc::new(policy));
        Ok(())
    }

    /// The rules applied now (`None`: the operator's list alone).
    pub fn grant(&self) -> Option<EgressGrant> {
        let policy = self.policy();
        (policy.grant() != &EgressGrant::default()).then(|| policy.grant().clone())
    }

    fn policy(&self) -> Arc<EgressPolicy> {
        self.policy.borrow().clone()
    }

    pub fn operator(&self) -> &Allowlist {
        &self.operator
    }
}

/// Serves the connections accepted inside one box until it closes.
pub async fn serve(
    channel: Arc<Channel>,
    mut accepted: tokio::sync::mpsc::UnboundedReceiver<Replies>,
    egress: Arc<LiveEgress>,
) {
    while let Some(stream) = accepted.recv().await {
        let (channel, egress) = (channel.clone(), egress.clone());
        tokio::spawn(async move {
            let conn = stream.id;
            let policy = egress.policy();
            match handle(&channel, stream, &egress, &policy).await {
                Ok(()) => {}
                Err(Failure::Http(refusal)) => {
                    audit(&policy, &refusal);
                    let _ = channel.write(conn, refusal.answer(), true).await;
                }
                Err(Failure::Closed(refusal)) => {
                    audit(&policy, &refusal);
                    let _ = channel.write(conn, Vec::new(), true).await;
                }
            }
        });
    }
}

/// The audit line of a refusal.
fn audit(policy: &EgressPolicy, refusal: &Refusal) {
    let grant = policy.grant();
    tracing::warn!(
        target: "kiln::egress",
        sandbox = %grant.sandbox,
        tenant = %grant.tenant,
        status = refusal.status,
        "refused: {}",
        refusal.message
    );
}

/// Why a proxied request was refused.
#[derive(Debug)]
struct Refusal {
    status: &'static str,
    message: String,
}

impl Refusal {
    /// The HTTP answer a box gets.
    fn answer(&self) -> Vec<u8> {
        let body = format!("kiln: {}\n", self.message);
        format!(
            "HTTP/1.1 {}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.status,
            body.len(),
        )
        .into_bytes()
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

fn refuse(status: &'static str, message: impl Into<String>) -> Refusal {
    Refusal {
        status,
        message: message.into(),
    }
}

/// How a connection ended in refusal: answered in HTTP, or closed (past the point where
/// an HTTP answer could be framed: in TLS, in SOCKS5, mid-stream).
enum Failure {
    Http(Refusal),
    Closed(Refusal),
}

impl From<Refusal> for Failure {
    fn from(refusal: Refusal) -> Failure {
        Failure::Http(refusal)
    }
}

/// What the head of a request asks for.
#[derive(Debug, PartialEq, Eq)]
struct Target {
    host: String,
    port: u16,
    /// CONNECT: a tunnel. Otherwise the head to send upstream (origin-form).
    forward: Option<Vec<u8>>,
}

fn split_host_port(authority: &str, default_port: u16) -> Option<(String, u16)> {
    if let Some(rest) = authority.strip_prefix('[') {
        let (host, after) = rest.split_once(']')?;
        let port = match after.strip_prefix(':') {
            Some(p) => p.parse().ok()?,
            None => default_port,
        };
        return Some((host.to_string(), port));
    }
    match authority.rsplit_once(':') {
        Some((host, port)) => Some((host.to_string(), port.parse().ok()?)),
        None => Some((authority.to_string(), default_port)),
    }
}

fn parse_head(head: &[u8]) -> Result<Target, Refusal> {
    let text = std::str::from_utf8(head)
        .map_err(|_| refuse("400 Bad Request", "a request head that is not text"))?;
    let (line, rest) = text.split_once("\r\n").unwrap_or((text, ""));
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version)) = (parts.next(), parts.next(), parts.next())
    else {
        return Err(refuse(
            "400 Bad Request",
            format!("not an HTTP request: {line:?}"),
        ));
    };
    if method == "CONNECT" {
        let (host, port) = split_host_port(target, 443).ok_or_else(|| {
            refuse(
                "400 Bad Request",
                format!("a bad CONNECT target {target:?}"),
            )
        })?;
        return Ok(Target {
            host,
            port,
            forward: None,
        });
    }
    let Some(after) = target.strip_prefix("http://") else {
        return Err(refuse(
            "400 Bad Request",
            format!("the proxy takes CONNECT or http:// requests, not {target:?}"),
        ));
    };
    let (authority, path) = match after.find('/') {
        Some(at) => (&after[..at], &after[at..]),
        None => (after, "/"),
    };
    let (host, port) = split_host_port(authority, 80)
        .ok_or_else(|| refuse("400 Bad Request", format!("a bad URL {target:?}")))?;
    let mut forward = format!("{method} {path} {version}\r\n").into_bytes();
    forward.extend_from_slice(rest.as_bytes());
    Ok(Target {
        host,
        port,
        forward: Some(forward),
    })
}

/// Reads a request head (up to its blank line); `None` when the client went away first.
/// Answers the head and what followed it in the same reads.
async fn read_head(
    stream: &mut Replies,
    mut head: Vec<u8>,
) -> Result<Option<(Vec<u8>, Vec<u8>)>, Refusal> {
    loop {
        if let Some(at) = head.windows(4).position(|w| w == b"\r\n\r\n") {
            let early = head.split_off(at + 4);
            return Ok(Some((head, early)));
        }
        if head.len() > MAX_HEAD {
            return Err(refuse(
                "431 Request Header Fields Too Large",
                "the request head is too large",
            ));
        }
        match stream.next().await {
            Some(Reply::Output { data, .. }) => head.extend_from_slice(&data),
            _ => return Ok(None),
        }
    }
}

/// Connects to `host:port` where the operator's list and the sandbox's rules let it: the
/// name is checked before it is resolved, each address after (never the host itself, nor,
/// unless the operator listed them, private networks).
async fn connect_upstream(
    host: &str,
    port: u16,
    egress: &LiveEgress,
    policy: &EgressPolicy,
) -> Result<TcpStream, Refusal> {
    policy
        .check_name(&egress.operator, host, port)
        .map_err(|why| refuse("403 Forbidden", why))?;
    let addrs: Vec<_> =
        tokio::net::lookup_host((host.trim_start_matches('[').trim_end_matches(']'), port))
            .await
            .map_err(|e| refuse("502 Bad Gateway", format!("cannot resolve {host}: {e}")))?
            .collect();
    let addr = choose(host, port, &addrs, egress, policy, &host_addresses())?;
    tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| {
            refuse(
                "504 Gateway Timeout",
                format!("connecting to {host} timed out"),
            )
        })?
        .map_err(|e| refuse("502 Bad Gateway", format!("cannot connect to {host}: {e}")))
}

/// The first of `host`'s addresses a box may reach, or a refusal naming why none may be.
fn choose(
    host: &str,
    port: u16,
    addrs: &[SocketAddr],
    egress: &LiveEgress,
    policy: &EgressPolicy,
    host_addresses: &[IpAddr],
) -> Result<SocketAddr, Refusal> {
    let mut why = Vec::new();
    for addr in addrs {
        match policy.check_address(&egress.operator, host, port, addr.ip(), host_addresses) {
            Ok(()) => return Ok(*addr),
            Err(reason) if !why.contains(&reason) => why.push(reason),
            Err(_) => {}
        }
    }
    Err(refuse(
        "403 Forbidden",
        format!(
            "{host} resolves only to addresses a sandbox may not reach: {}",
            if why.is_empty() {
                "none at all".to_string()
            } else {
                why.join("; ")
            }
        ),
    ))
}

async fn handle(
    channel: &Arc<Channel>,
    mut stream: Replies,
    egress: &LiveEgress,
    policy: &EgressPolicy,
) -> Result<(), Failure> {
    let first = match stream.next().await {
        Some(Reply::Output { data, .. }) if !data.is_empty() => data,
        _ => return Ok(()), // the client went away
    };
    if first[0] == 5 {
        return socks(channel, stream, first, egress, policy).await;
    }
    let Some((head, early)) = read_head(&mut stream, first).await? else {
        return Ok(());
    };
    let target = parse_head(&head)?;
    let rules = !policy.headers_for(&target.host).is_empty();
    let upstream = connect_upstream(&target.host, target.port, egress, policy).await?;
    let (host, port) = (target.host.clone(), target.port);
    let ip = upstream.peer_addr().ok().map(|a| a.ip());
    let work = carry(
        channel, stream, early, target, upstream, rules, egress, policy,
    );
    tokio::select! {
        done = work => done,
        why = egress.until_refused(&host, port, ip) => Err(rules_changed(&host, port, &why)),
    }
}

/// The end of an open connection to `host:port` that changed rules refuse (`why`).
fn rules_changed(host: &str, port: u16, why: &str) -> Failure {
    Failure::Closed(refuse(
        "403 Forbidden",
        format!("the connection to {host}:{port} was closed: the sandbox's rules changed ({why})"),
    ))
}

/// Carries a connection the checks let through: a tunnel, HTTPS opened for its rules, or
/// one plain HTTP request.
#[allow(clippy::too_many_arguments)]
async fn carry(
    channel: &Arc<Channel>,
    stream: Replies,
    early: Vec<u8>,
    target: Target,
    upstream: TcpStream,
    rules: bool,
    egress: &LiveEgress,
    policy: &EgressPolicy,
) -> Result<(), Failure> {
    let conn = stream.id;
    tracing::debug!(target: "kiln::egress", sandbox = %policy.grant().sandbox, host = %target.host, port = target.port, "connected");
    match (target.forward, rules) {
        (None, false) => {
            channel
                .write(
                    conn,
                    b"HTTP/1.1 200 Connection established\r\n\r\n".to_vec(),
                    false,
                )
                .await
                .map_err(|e| refuse("502 Bad Gateway", e.to_string()))?;
            let (up_read, mut up_write) = upstream.into_split();
            if !early.is_empty() && up_write.write_all(&early).await.is_err() {
                return Ok(());
            }
            relay(channel, stream, up_read, up_write).await;
            Ok(())
        }
        (None, true) => {
            // HTTPS to a host with rules: opened, so each request gets its headers.
            let Some(tls) = egress.tls.clone() else {
                return Err(refuse(
                    "502 Bad Gateway",
                    format!(
                        "{}'s rules set headers, and this kiln cannot open HTTPS to apply them (it has no CA bundle of its own to check {} against)",
                        target.host, target.host
                    ),
                )
                .into());
            };
            let client = tls.client().ok_or_else(|| {
                refuse(
                    "502 Bad Gateway",
                    format!(
                        "{}'s rules set headers, and this host has no CA bundle to check {} against",
                        target.host, target.host
                    ),
                )
            })?;
            let server = tls
                .server_for(&target.host)
                .map_err(|e| refuse("502 Bad Gateway", e))?;
            channel
                .write(
                    conn,
                    b"HTTP/1.1 200 Connection established\r\n\r\n".to_vec(),
                    false,
                )
                .await
                .map_err(|e| refuse("502 Bad Gateway", e.to_string()))?;
            let boxed = box_io(channel.clone(), stream, early);
            let inner = tokio::time::timeout(
                HANDSHAKE_TIMEOUT,
                tokio_rustls::TlsAcceptor::from(server).accept(boxed),
            )
            .await
            .map_err(|_| Failure::Closed(refuse("504", "the box's TLS handshake timed out")))?
            .map_err(|e| {
                Failure::Closed(refuse(
                    "502",
                    format!("the box's TLS handshake for {} failed: {e}", target.host),
                ))
            })?;
            let name =
                rustls_pki_types::ServerName::try_from(kiln_core::net::normal_host(&target.host))
                    .map_err(|e| Failure::Closed(refuse("400", format!("{}: {e}", target.host))))?;
            let outer = tokio::time::timeout(
                HANDSHAKE_TIMEOUT,
                tokio_rustls::TlsConnector::from(client).connect(name, upstream),
            )
            .await
            .map_err(|_| {
                Failure::Closed(refuse("504", format!("TLS to {} timed out", target.host)))
            })?
            .map_err(|e| {
                Failure::Closed(refuse("502", format!("TLS to {} failed: {e}", target.host)))
            })?;
            exchange(inner, outer, &target.host, egress, policy, false).await
        }
        (Some(forward), _) => {
            // Plain HTTP: one request a connection (the proxy asks for `Connection:
            // close`), so a request to another host goes through these checks too.
            let mut opening = forward;
            opening.extend_from_slice(&early);
            let boxed = box_io(channel.clone(), stream, opening);
            exchange(boxed, upstream, &target.host, egress, policy, true).await
        }
    }
}

/// Carries bytes both ways until each side has ended.
async fn relay(
    channel: &Channel,
    mut stream: Replies,
    mut up_read: tokio::net::tcp::OwnedReadHalf,
    mut up_write: tokio::net::tcp::OwnedWriteHalf,
) {
    let conn = stream.id;
    // Box → upstream.
    let to_upstream = async move {
        while let Some(Reply::Output { data, .. }) = stream.next().await {
            if up_write.write_all(&data).await.is_err() {
                break;
            }
        }
        let _ = up_write.shutdown().await;
    };
    // Upstream → box.
    let to_box = async {
        let mut buf = vec![0u8; kiln_guest::proto::CHUNK_BYTES];
        loop {
            match up_read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if channel.write(conn, buf[..n].to_vec(), false).await.is_err() {
                        break;
                    }
                }
            }
        }
        let _ = channel.write(conn, Vec::new(), true).await;
    };
    tokio::join!(to_upstream, to_box);
}

/// One connection accepted in a box as a byte stream (`early`: what it sent first).
fn box_io(channel: Arc<Channel>, mut stream: Replies, early: Vec<u8>) -> tokio::io::DuplexStream {
    let (ours, theirs) = tokio::io::duplex(64 << 10);
    let (mut from_box, mut to_box) = tokio::io::split(theirs);
    let conn = stream.id;
    tokio::spawn(async move {
        if early.is_empty() || to_box.write_all(&early).await.is_ok() {
            while let Some(Reply::Output { data, .. }) = stream.next().await {
                if to_box.write_all(&data).await.is_err() {
                    break;
                }
            }
        }
        let _ = to_box.shutdown().await;
    });
    tokio::spawn(async move {
        let mut buf = vec![0u8; kiln_guest::proto::CHUNK_BYTES];
        loop {
            match from_box.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if channel.write(conn, buf[..n].to_vec(), false).await.is_err() {
                        break;
                    }
                }
            }
        }
        let _ = channel.write(conn, Vec::new(), true).await;
    });
    ours
}

/// Carries HTTP/1.1 requests from the box to `upstream`, each with the rules' headers for
/// `host`, and the responses back as they come. `plain`: one absolute-form request (already
/// turned to origin-form), sent with `Connection: close`; otherwise every request of the
/// connection, until either side ends (an `Upgrade` request leaves the rest as it is).
async fn exchange<B, U>(
    boxed: B,
    upstream: U,
    host: &str,
    egress: &LiveEgress,
    policy: &EgressPolicy,
    plain: bool,
) -> Result<(), Failure>
where
    B: AsyncRead + AsyncWrite + Unpin + Send,
    U: AsyncRead + AsyncWrite + Unpin + Send,
{
    let (box_read, mut box_write) = tokio::io::split(boxed);
    let (mut up_read, mut up_write) = tokio::io::split(upstream);
    let mut reader = http::Reader::new(box_read);
    let requests = async {
        let outcome = loop {
            let head = match reader.head(MAX_HEAD).await {
                Ok(Some(head)) => head,
                Ok(None) => break Ok(()),
                Err(e) => break Err(Some(e)),
            };
            let request = match http::Request::parse(&head) {
                Ok(request) => request,
                Err(e) => break Err(Some(e)),
            };
            let framing = match request.framing() {
                Ok(framing) => framing,
                Err(e) => break Err(Some(e)),
            };
            let out = match rewrite(&request, host, egress, policy, plain) {
                Ok(out) => out,
                Err(e) => break Err(Some(e)),
            };
            if up_write.write_all(&out).await.is_err() {
                break Ok(());
            }
            if request.upgrades() {
                let _ = reader.copy_rest(&mut up_write).await;
                break Ok(());
            }
            if let Err(e) = reader.copy_body(framing, &mut up_write).await {
                break Err(Some(refuse("400 Bad Request", e.to_string())));
            }
            if plain {
                // The rest of the connection is not read: the upstream closes after its
                // answer (`Connection: close`), and the box's next request goes anew.
                break Err(None);
            }
        };
        if outcome.is_ok() {
            // The box is done sending: so is the proxy.
            let _ = up_write.shutdown().await;
        }
        outcome
    };
    let responses = async {
        let _ = tokio::io::copy(&mut up_read, &mut box_write).await;
        let _ = box_write.shutdown().await;
    };
    let (outcome, ()) = tokio::join!(requests, responses);
    match outcome {
        Ok(()) | Err(None) => Ok(()),
        Err(Some(refusal)) => Err(Failure::Closed(refusal)),
    }
}

/// A request's head as it goes upstream: the rules' headers set (their placeholders
/// filled), placeholders the box wrote in other headers filled for the secrets this host's
/// rules name, and for plain HTTP the proxy's own headers dropped and `Connection: close`.
fn rewrite(
    request: &http::Request,
    host: &str,
    egress: &LiveEgress,
    policy: &EgressPolicy,
    plain: bool,
) -> Result<Vec<u8>, Refusal> {
    let rules = policy.headers_for(host);
    if rules.is_empty() && !plain {
        return Ok(request.raw.clone());
    }
    let grant = policy.grant();
    let named: Vec<String> = rules
        .iter()
        .flat_map(|(_, value)| kiln_core::net::placeholders(value))
        .collect();
    let mut resolve = |name: &str| -> Result<String, String> {
        let source = egress
            .secrets
            .as_ref()
            .ok_or_else(|| "this kiln keeps no secrets".to_string())?;
        let value = source.secret(&grant.tenant, name)?;
        if value.bytes().any(|b| b == b'\r' || b == b'\n' || b == 0) {
            return Err(format!(
                "the secret {name:?} holds a line break or NUL, which a header cannot carry"
            ));
        }
        Ok(value)
    };
    let mut set = Vec::new();
    for (name, template) in &rules {
        let value = kiln_core::net::fill(template, &mut resolve).map_err(|why| {
            refuse(
                "502 Bad Gateway",
                format!("the rule for {host} sets {name}, and {why}"),
            )
        })?;
        set.push((name.clone(), value));
    }
    let mut out = request.line.clone();
    out.extend_from_slice(b"\r\n");
    for (name, value) in &request.headers {
        let lower = name.to_ascii_lowercase();
        if set.iter().any(|(n, _)| n.eq_ignore_ascii_case(name))
            || (plain
                && matches!(
                    lower.as_str(),
                    "proxy-connection" | "proxy-authorization" | "connection" | "keep-alive"
                ))
        {
            continue;
        }
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b": ");
        match std::str::from_utf8(value) {
            Ok(text) if !named.is_empty() && text.contains("${") => {
                let filled = kiln_core::net::fill(text, |secret| {
                    if named.iter().any(|n| n == secret) {
                        resolve(secret)
                    } else {
                        Ok(format!("${{secrets.{secret}}}"))
                    }
                })
                .map_err(|why| refuse("502 Bad Gateway", why))?;
                out.extend_from_slice(filled.as_bytes());
            }
            _ => out.extend_from_slice(value),
        }
        out.extend_from_slice(b"\r\n");
    }
    for (name, value) in &set {
        out.extend_from_slice(format!("{name}: {value}\r\n").as_bytes());
    }
    if plain {
        out.extend_from_slice(b"Connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    if !set.is_empty() {
        tracing::info!(
            target: "kiln::egress",
            sandbox = %grant.sandbox,
            tenant = %grant.tenant,
            host,
            headers = ?set.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
            "set headers by the sandbox's rules"
        );
    }
    Ok(out)
}

/// A SOCKS5 reply (`code` 0: succeeded).
fn socks_reply(code: u8) -> Vec<u8> {
    vec![5, code, 0, 1, 0, 0, 0, 0, 0, 0]
}

/// SOCKS5 (RFC 1928), no authentication, CONNECT only: the box names the host (or an
/// address), the proxy checks and dials it as it does for HTTP, and carries the bytes.
async fn socks(
    channel: &Arc<Channel>,
    stream: Replies,
    first: Vec<u8>,
    egress: &LiveEgress,
    policy: &EgressPolicy,
) -> Result<(), Failure> {
    let mut io = box_io(channel.clone(), stream, first);
    let bad = |what: &str| Failure::Closed(refuse("400", format!("SOCKS5: {what}")));
    let mut greeting = [0u8; 2];
    io.read_exact(&mut greeting)
        .await
        .map_err(|_| bad("a short greeting"))?;
    let mut methods = vec![0u8; usize::from(greeting[1])];
    io.read_exact(&mut methods)
        .await
        .map_err(|_| bad("a short greeting"))?;
    if !methods.contains(&0) {
        let _ = io.write_all(&[5, 0xff]).await;
        return Err(bad("the client offers no method without authentication"));
    }
    io.write_all(&[5, 0])
        .await
        .map_err(|_| bad("the client left"))?;
    let mut request = [0u8; 4];
    io.read_exact(&mut request)
        .await
        .map_err(|_| bad("a short request"))?;
    let host = match request[3] {
        1 => {
            let mut a = [0u8; 4];
            io.read_exact(&mut a)
                .await
                .map_err(|_| bad("a short address"))?;
            std::net::Ipv4Addr::from(a).to_string()
        }
        4 => {
            let mut a = [0u8; 16];
            io.read_exact(&mut a)
                .await
                .map_err(|_| bad("a short address"))?;
            std::net::Ipv6Addr::from(a).to_string()
        }
        3 => {
            let mut len = [0u8; 1];
            io.read_exact(&mut len)
                .await
                .map_err(|_| bad("a short name"))?;
            let mut name = vec![0u8; usize::from(len[0])];
            io.read_exact(&mut name)
                .await
                .map_err(|_| bad("a short name"))?;
            String::from_utf8(name).map_err(|_| bad("a name that is not text"))?
        }
        _ => {
            let _ = io.write_all(&socks_reply(8)).await;
            return Err(bad("an address type it does not know"));
        }
    };
    let mut port = [0u8; 2];
    io.read_exact(&mut port)
        .await
        .map_err(|_| bad("a short request"))?;
    let port = u16::from_be_bytes(port);
    if request[0] != 5 || request[1] != 1 {
        let _ = io.write_all(&socks_reply(7)).await;
        return Err(bad("only CONNECT is served"));
    }
    let upstream = match connect_upstream(&host, port, egress, policy).await {
        Ok(upstream) => upstream,
        Err(refusal) => {
            // 2: not allowed by the rule set; 4: host unreachable.
            let code = if refusal.status.starts_with("403") {
                2
            } else {
                4
            };
            let _ = io.write_all(&socks_reply(code)).await;
            let _ = io.shutdown().await;
            return Err(Failure::Closed(refusal));
        }
    };
    io.write_all(&socks_reply(0))
        .await
        .map_err(|_| bad("the client left"))?;
    let ip = upstream.peer_addr().ok().map(|a| a.ip());
    let mut upstream = upstream;
    tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut io, &mut upstream) => Ok(()),
        why = egress.until_refused(&host, port, ip) => Err(rules_changed(&host, port, &why)),
    }
}

/// Just enough HTTP/1.1 to frame requests (RFC 9112): heads, and bodies by
/// `Content-Length` or chunked coding, passed on as they come.
mod http {
    use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

    use super::{Refusal, refuse};

    /// The longest chunk-size line (with extensions) and trailer line.
    const MAX_LINE: usize = 8 << 10;

    /// How a request's body ends.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Framing {
        Length(u64),
        Chunked,
    }

    /// A request head.
    #[derive(Debug)]
    pub struct Request {
        /// The request line, without its CRLF.
        pub line: Vec<u8>,
        pub headers: Vec<(String, Vec<u8>)>,
        /// The head as it came.
        pub raw: Vec<u8>,
    }

    impl Request {
        pub fn parse(head: &[u8]) -> Result<Request, Refusal> {
            let bad = |what: &str| refuse("400 Bad Request", format!("a bad request head: {what}"));
            // Each line keeps its CR; the blank line's CRLF and the last LF go.
            let body = head
                .strip_suffix(b"\n\r\n")
                .ok_or_else(|| bad("no blank line"))?;
            let mut lines = body.split(|b| *b == b'\n');
            let line = lines.next().ok_or_else(|| bad("no request line"))?;
            let line = line.strip_suffix(b"\r").ok_or_else(|| bad("a bare LF"))?;
            if line.split(|b| *b == b' ').count() != 3 || line.iter().any(|b| b.is_ascii_control())
            {
                return Err(bad("the request line"));
            }
            let mut headers = Vec::new();
            for raw in lines {
                let raw = raw.strip_suffix(b"\r").ok_or_else(|| bad("a bare LF"))?;
                let colon = raw
                    .iter()
                    .position(|b| *b == b':')
                    .ok_or_else(|| bad("a header line without a colon"))?;
                let name = std::str::from_utf8(&raw[..colon])
                    .ok()
                    .filter(|n| {
                        !n.is_empty()
                            && n.bytes().all(|b| {
                                b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
                            })
                    })
                    .ok_or_else(|| bad("a header name that is not a token"))?;
                let value = raw[colon + 1..].trim_ascii();
                if value.iter().any(|b| *b == 0 || *b == b'\r') {
                    return Err(bad("a control character in a header"));
                }
                headers.push((name.to_string(), value.to_vec()));
            }
            Ok(Request {
                line: line.to_vec(),
                headers,
                raw: head.to_vec(),
            })
        }

        fn values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
            self.headers
                .iter()
                .filter(move |(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_slice())
        }

        /// How its body ends; ambiguous framing (both lengths, differing lengths, a coding
        /// other than chunked last) is refused, so no request hides inside another.
        pub fn framing(&self) -> Result<Framing, Refusal> {
            let bad =
                |what: &str| refuse("400 Bad Request", format!("a request's framing: {what}"));
            let codings: Vec<&[u8]> = self.values("transfer-encoding").collect();
            let lengths: Vec<&[u8]> = self.values("content-length").collect();
            if !codings.is_empty() {
                if !lengths.is_empty() {
                    return Err(bad("both Transfer-Encoding and Content-Length"));
                }
                let last = codings
                    .last()
                    .and_then(|v| v.split(|b| *b == b',').next_back())
                    .map(|c| c.trim_ascii().to_ascii_lowercase());
                return match last.as_deref() {
                    Some(b"chunked") => Ok(Framing::Chunked),
                    _ => Err(bad("a transfer coding that does not end in chunked")),
                };
            }
            let mut length = None;
            for value in lengths {
                for part in value.split(|b| *b == b',') {
                    let n: u64 = std::str::from_utf8(part.trim_ascii())
                        .ok()
                        .filter(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()))
                        .and_then(|t| t.parse().ok())
                        .ok_or_else(|| bad("a Content-Length that is not a number"))?;
                    if length.is_some_and(|l| l != n) {
                        return Err(bad("differing Content-Length values"));
                    }
                    length = Some(n);
                }
            }
            Ok(Framing::Length(length.unwrap_or(0)))
        }

        /// Whether it asks to leave HTTP (`Upgrade`, such as a WebSocket).
        pub fn upgrades(&self) -> bool {
            self.values("upgrade").next().is_some()
        }
    }

    /// A buffered reader of requests.
    pub struct Reader<R> {
        inner: R,
        buf: Vec<u8>,
    }

    impl<R: AsyncRead + Unpin> Reader<R> {
        pub fn new(inner: R) -> Reader<R> {
            Reader {
                inner,
                buf: Vec::new(),
            }
        }

        /// Reads more; false at the end.
        async fn fill(&mut self) -> std::io::Result<bool> {
            let mut chunk = [0u8; 16 << 10];
            let n = self.inner.read(&mut chunk).await?;
            self.buf.extend_from_slice(&chunk[..n]);
            Ok(n > 0)
        }

        /// The next head (through its blank line); `None` at a clean end.
        pub async fn head(&mut self, max: usize) -> Result<Option<Vec<u8>>, Refusal> {
            loop {
                if let Some(at) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    let rest = self.buf.split_off(at + 4);
                    return Ok(Some(std::mem::replace(&mut self.buf, rest)));
                }
                if self.buf.len() > max {
                    return Err(refuse(
                        "431 Request Header Fields Too Large",
                        "the request head is too large",
                    ));
                }
                match self.fill().await {
                    Ok(true) => {}
                    Ok(false) if self.buf.is_empty() => return Ok(None),
                    Ok(false) | Err(_) => {
                        return Err(refuse("400 Bad Request", "the request ended in its head"));
                    }
                }
            }
        }

        /// One line, CRLF and all.
        async fn line(&mut self) -> std::io::Result<Vec<u8>> {
            loop {
                if let Some(at) = self.buf.windows(2).position(|w| w == b"\r\n") {
                    let rest = self.buf.split_off(at + 2);
                    return Ok(std::mem::replace(&mut self.buf, rest));
                }
                if self.buf.len() > MAX_LINE {
                    return Err(std::io::Error::other("a chunk line is too long"));
                }
                if !self.fill().await? {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
            }
        }

        /// Copies exactly `n` bytes to `out`.
        async fn copy_exact<W: AsyncWrite + Unpin>(
            &mut self,
            mut n: u64,
            out: &mut W,
        ) -> std::io::Result<()> {
            while n > 0 {
                if self.buf.is_empty() && !self.fill().await? {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                let take = usize::try_from(n).unwrap_or(usize::MAX).min(self.buf.len());
                out.write_all(&self.buf[..take]).await?;
                self.buf.drain(..take);
                n -= take as u64;
            }
            Ok(())
        }

        /// Copies a body framed as `framing` to `out`, as it came.
        pub async fn copy_body<W: AsyncWrite + Unpin>(
            &mut self,
            framing: Framing,
            out: &mut W,
        ) -> std::io::Result<()> {
            match framing {
                Framing::Length(n) => self.copy_exact(n, out).await,
                Framing::Chunked => loop {
                    let line = self.line().await?;
                    let size = line[..line.len() - 2]
                        .split(|b| *b == b';')
                        .next()
                        .and_then(|s| std::str::from_utf8(s.trim_ascii()).ok())
                        .filter(|s| !s.is_empty() && s.len() <= 16)
                        .and_then(|s| u64::from_str_radix(s, 16).ok())
                        .ok_or_else(|| std::io::Error::other("a bad chunk size"))?;
                    out.write_all(&line).await?;
                    if size == 0 {
                        // Trailers, up to the blank line.
                        loop {
                            let line = self.line().await?;
                            out.write_all(&line).await?;
                            if line == b"\r\n" {
                                return Ok(());
                            }
                        }
                    }
                    self.copy_exact(size, out).await?;
                    let end = self.line().await?;
                    if end != b"\r\n" {
                        return Err(std::io::Error::other("a chunk without its CRLF"));
                    }
                    out.write_all(&end).await?;
                },
            }
        }

        /// Copies what is left, to the end.
        pub async fn copy_rest<W: AsyncWrite + Unpin>(
            &mut self,
            out: &mut W,
        ) -> std::io::Result<()> {
            out.write_all(&self.buf).await?;
            self.buf.clear();
            tokio::io::copy(&mut self.inner, out).await?;
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_parse_into_targets() {
        assert_eq!(
            parse_head(b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: pypi.org:443\r\n\r\n").unwrap(),
            Target {
                host: "pypi.org".into(),
                port: 443,
                forward: None
            }
        );
        let target = parse_head(
            b"GET http://deb.debian.org/debian/x HTTP/1.1\r\nHost: deb.debian.org\r\n\r\n",
        )
        .unwrap();
        assert_eq!((target.host.as_str(), target.port), ("deb.debian.org", 80));
        assert_eq!(
            target.forward.unwrap(),
            b"GET /debian/x HTTP/1.1\r\nHost: deb.debian.org\r\n\r\n"
        );
        assert_eq!(
            parse_head(b"CONNECT [::1]:8443 HTTP/1.1\r\n\r\n")
                .unwrap()
                .host,
            "::1"
        );
        for bad in [
            &b"GET /local HTTP/1.1\r\n\r\n"[..],
            b"junk\r\n\r\n",
            b"\xff\xfe\r\n\r\n",
            b"CONNECT host:x HTTP/1.1\r\n\r\n",
        ] {
            assert!(parse_head(bad).is_err(), "{bad:?}");
        }
    }
    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    struct Keys;

    impl SecretSource for Keys {
        fn secret(&self, tenant: &str, name: &str) -> Result<String, String> {
            match (tenant, name) {
                ("t", "key") => Ok("sk-live-123".into()),
                ("t", "multi") => Ok("a\r\nb".into()),
                _ => Err(format!("tenant {tenant} has no secret {name:?}")),
            }
        }
    }

    fn egress(rules: &str, operator: &[&str]) -> (LiveEgress, Arc<EgressPolicy>) {
        let live = LiveEgress::new(
            Arc::new(Allowlist::new(operator).unwrap()),
            Some(Arc::new(Keys)),
            None,
        );
        live.set(Some(EgressGrant {
            rules: serde_json::from_str(rules).unwrap(),
            widen: false,
            tenant: "t".into(),
            sandbox: "s".into(),
        }))
        .unwrap();
        let policy = live.policy();
        (live, policy)
    }

    #[test]
    fn a_name_leading_only_where_a_box_may_not_go_is_refused_with_each_reason() {
        let (live, policy) = egress("{}", &["pypi.org"]);
        let at = |text: &str| SocketAddr::new(ip(text), 443);
        let refused = choose(
            "pypi.org",
            443,
            &[at("10.0.0.1"), at("::ffff:100.64.1.1"), at("127.0.0.1")],
            &live,
            &policy,
            &[],
        )
        .unwrap_err();
        assert_eq!(refused.status, "403 Forbidden");
        for said in ["10.0.0.1", "RFC 1918", "carrier-grade NAT", "loopback"] {
            assert!(refused.message.contains(said), "{said}: {refused}");
        }
        // The first address that may be reached is the one connected to.
        let chosen = choose(
            "pypi.org",
            443,
            &[at("10.0.0.1"), at("151.101.0.223")],
            &live,
            &policy,
            &[],
        )
        .unwrap();
        assert_eq!(chosen, at("151.101.0.223"));
        // A sandbox's denyOut range refuses an address the operator's list would allow.
        let (live, policy) = egress(r#"{"denyOut": ["151.101.0.0/16"]}"#, &["pypi.org"]);
        let refused =
            choose("pypi.org", 443, &[at("151.101.0.223")], &live, &policy, &[]).unwrap_err();
        assert!(refused.message.contains("151.101.0.0/16"), "{refused}");
    }

    fn request(head: &str) -> http::Request {
        http::Request::parse(head.as_bytes()).unwrap()
    }

    #[test]
    fn requests_are_framed_and_ambiguous_framing_is_refused() {
        use http::Framing;
        let framing = |head: &str| request(head).framing();
        assert_eq!(
            framing("GET / HTTP/1.1\r\nHost: a\r\n\r\n").unwrap(),
            Framing::Length(0)
        );
        assert_eq!(
            framing("POST / HTTP/1.1\r\nContent-Length: 12\r\n\r\n").unwrap(),
            Framing::Length(12)
        );
        assert_eq!(
            framing("POST / HTTP/1.1\r\nContent-Length: 5, 5\r\n\r\n").unwrap(),
            Framing::Length(5)
        );
        assert_eq!(
            framing("POST / HTTP/1.1\r\nTransfer-Encoding: gzip, Chunked\r\n\r\n").unwrap(),
            Framing::Chunked
        );
        for smuggled in [
            "POST / HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
            "POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
            "POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
            "POST / HTTP/1.1\r\nContent-Length: 0x10\r\n\r\n",
            "POST / HTTP/1.1\r\nTransfer-Encoding: chunked, gzip\r\n\r\n",
        ] {
            assert!(framing(smuggled).is_err(), "{smuggled:?}");
        }
        for bad in [
            "GET / HTTP/1.1\nHost: a\r\n\r\n",
            "GET /\r\n\r\n",
            "GET / HTTP/1.1\r\nNo colon\r\n\r\n",
            "GET / HTTP/1.1\r\nBad Name: x\r\n\r\n",
        ] {
            assert!(http::Request::parse(bad.as_bytes()).is_err(), "{bad:?}");
        }
    }

    #[tokio::test]
    async fn bodies_are_copied_by_their_framing_and_the_next_request_follows() {
        let wire = b"5\r\nhello\r\n0\r\nX-Trailer: 1\r\n\r\nGET /next HTTP/1.1\r\n\r\n";
        let mut reader = http::Reader::new(&wire[..]);
        let mut out = Vec::new();
        reader
            .copy_body(http::Framing::Chunked, &mut out)
            .await
            .unwrap();
        assert_eq!(out, b"5\r\nhello\r\n0\r\nX-Trailer: 1\r\n\r\n");
        let next = reader.head(1024).await.unwrap().unwrap();
        assert_eq!(next, b"GET /next HTTP/1.1\r\n\r\n");
        assert!(reader.head(1024).await.unwrap().is_none());
        // A chunk that lies about its size, a length longer than what comes.
        for (wire, framing) in [
            (&b"zz\r\nhello\r\n"[..], http::Framing::Chunked),
            (b"3\r\nhello\r\n", http::Framing::Chunked),
            (b"abc", http::Framing::Length(10)),
        ] {
            let mut reader = http::Reader::new(wire);
            assert!(reader.copy_body(framing, &mut Vec::new()).await.is_err());
        }
        let mut reader = http::Reader::new(&[b'a'; 100][..]);
        assert_eq!(
            reader.head(50).await.unwrap_err().status,
            "431 Request Header Fields Too Large"
        );
    }

    #[test]
    fn rules_set_headers_with_secrets_for_their_host_only() {
        let (live, policy) = egress(
            r#"{"rules": {"api.x.com": [{"transform": {"headers": {"Authorization": "Bearer ${secrets.key}"}}}]}}"#,
            &["*.x.com"],
        );
        let head = request(
            "GET /v1 HTTP/1.1\r\nHost: api.x.com\r\nauthorization: Bearer ${secrets.key}\r\nX-Echo: ${e2b.secrets.key} ${secrets.other}\r\n\r\n",
        );
        let out =
            String::from_utf8(rewrite(&head, "api.x.com", &live, &policy, false).unwrap()).unwrap();
        assert_eq!(
            out,
            "GET /v1 HTTP/1.1\r\nHost: api.x.com\r\nX-Echo: sk-live-123 ${secrets.other}\r\nAuthorization: Bearer sk-live-123\r\n\r\n"
        );
        // Another host gets the request as the box wrote it, placeholders and all.
        let out = rewrite(&head, "www.x.com", &live, &policy, false).unwrap();
        assert_eq!(out, head.raw);
        assert!(!String::from_utf8(out).unwrap().contains("sk-live"));
        // Plain HTTP drops the proxy's headers and closes after the answer.
        let plain = request(
            "GET / HTTP/1.1\r\nHost: www.x.com\r\nProxy-Connection: keep-alive\r\nConnection: keep-alive\r\nProxy-Authorization: Basic x\r\n\r\n",
        );
        let out =
            String::from_utf8(rewrite(&plain, "www.x.com", &live, &policy, true).unwrap()).unwrap();
        assert_eq!(
            out,
            "GET / HTTP/1.1\r\nHost: www.x.com\r\nConnection: close\r\n\r\n"
        );
        // A secret the tenant lacks, or one no header can carry: refused, saying which.
        for (name, said) in [("gone", "has no secret \"gone\""), ("multi", "line break")] {
            let (live, policy) = egress(
                &format!(
                    r#"{{"rules": {{"api.x.com": [{{"transform": {{"headers": {{"A": "${{secrets.{name}}}"}}}}}}]}}}}"#
                ),
                &["*.x.com"],
            );
            let refused = rewrite(&head, "api.x.com", &live, &policy, false).unwrap_err();
            assert!(refused.message.contains(said), "{refused}");
        }
    }

    #[tokio::test]
    async fn an_open_connection_ends_when_new_rules_refuse_it_and_not_before() {
        let (live, _) = egress("{}", &["*.x.com"]);
        let live = Arc::new(live);
        let ip = Some(ip("151.101.0.223"));
        let watcher = {
            let live = live.clone();
            tokio::spawn(async move { live.until_refused("api.x.com", 443, ip).await })
        };
        let grant = |rules: &str| EgressGrant {
            rules: serde_json::from_str(rules).unwrap(),
            tenant: "t".into(),
            sandbox: "s".into(),
            widen: false,
        };
        // Changes that still let it through leave it open.
        live.set(Some(grant(r#"{"denyOut": ["other.x.com"]}"#)))
            .unwrap();
        live.set(Some(grant(
            r#"{"allowOut": ["api.x.com"], "denyOut": ["*"]}"#,
        )))
        .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!watcher.is_finished());
        // A range it dialed into, denied: it ends, saying why.
        live.set(Some(grant(r#"{"denyOut": ["151.101.0.0/16"]}"#)))
            .unwrap();
        let why = tokio::time::timeout(Duration::from_secs(5), watcher)
            .await
            .unwrap()
            .unwrap();
        assert!(why.contains("151.101.0.0/16"), "{why}");
    }
}
