//! The network allowlist: a box has no interface but loopback; where its sandbox asks for
//! `network: allowlist`, the agent listens on a loopback port inside the box and carries
//! every connection made to it over its channel to this proxy in kiln, which answers
//! `CONNECT host:port` (and absolute-form `GET http://…`) for the listed names only, from the
//! host's network. Anything else gets a clear refusal (`403`, naming the host and the list).
//! `pip install` and `npm install` work with the proxy variables kiln sets in the box.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use kiln_guest::proto::Reply;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::channel::{Channel, Replies};

/// The loopback port the proxy answers on inside a box.
pub const PROXY_PORT: u16 = 3128;
/// The longest request head read.
const MAX_HEAD: usize = 16 << 10;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The names a box may reach, and on which ports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allowlist {
    /// Exact host names, or `*.suffix` for every name under a domain; lower-case.
    names: Vec<String>,
    ports: Vec<u16>,
}

/// The package indexes `pip` and `npm` use.
pub const DEFAULT_NAMES: [&str; 3] = ["pypi.org", "files.pythonhosted.org", "registry.npmjs.org"];

impl Allowlist {
    /// `names` (exact or `*.domain`) on ports 80 and 443.
    pub fn new<S: AsRef<str>>(names: &[S]) -> Result<Allowlist, String> {
        let mut list = Vec::new();
        for name in names {
            let name = name.as_ref().trim().to_ascii_lowercase();
            let bare = name.strip_prefix("*.").unwrap_or(&name);
            let valid = !bare.is_empty()
                && bare.len() <= 253
                && bare.split('.').all(|label| {
                    !label.is_empty()
                        && label.len() <= 63
                        && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
                });
            if !valid {
                return Err(format!("{name:?} is not a host name (or *.domain)"));
            }
            list.push(name);
        }
        Ok(Allowlist {
            names: list,
            ports: vec![80, 443],
        })
    }

    /// Whether `host:port` may be reached.
    pub fn allows(&self, host: &str, port: u16) -> bool {
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        self.ports.contains(&port)
            && self.names.iter().any(|name| match name.strip_prefix("*.") {
                Some(domain) => host.ends_with(&format!(".{domain}")),
                None => *name == host,
            })
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }
}

/// Serves the connections accepted inside one box until it closes.
pub async fn serve(
    channel: Arc<Channel>,
    mut accepted: tokio::sync::mpsc::UnboundedReceiver<Replies>,
    allow: Arc<Allowlist>,
) {
    while let Some(stream) = accepted.recv().await {
        let (channel, allow) = (channel.clone(), allow.clone());
        tokio::spawn(async move {
            let conn = stream.id;
            if let Err(refusal) = handle(&channel, stream, &allow).await {
                let body = format!("kiln: {refusal}\n");
                let answer = format!(
                    "HTTP/1.1 {refusal_status}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len(),
                    refusal_status = refusal.status,
                );
                let _ = channel.write(conn, answer.into_bytes(), true).await;
            }
        });
    }
}

/// Why a proxied request was refused.
#[derive(Debug)]
struct Refusal {
    status: &'static str,
    message: String,
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

/// Addresses a listed name must not lead to: the host itself and its link-local neighbours
/// (cloud metadata services).
fn forbidden(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            v4.is_loopback()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_multicast()
                || v4.is_broadcast()
        }
        IpAddr::V6(v6) => {
            v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (v6.segments()[0] & 0xffc0) == 0xfe80
                || v6
                    .to_ipv4_mapped()
                    .is_some_and(|v4| forbidden(IpAddr::V4(v4)))
        }
    }
}

/// Reads a request head (up to its blank line); `None` when the client went away first.
/// Answers the head and what followed it in the same reads.
async fn read_head(stream: &mut Replies) -> Result<Option<(Vec<u8>, Vec<u8>)>, Refusal> {
    let mut head = Vec::new();
    loop {
        match stream.next().await {
            Some(Reply::Output { data, .. }) => head.extend_from_slice(&data),
            _ => return Ok(None),
        }
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
    }
}

/// Connects to an allowed target from the host, never to the host itself.
async fn connect_upstream(target: &Target, allow: &Allowlist) -> Result<TcpStream, Refusal> {
    if !allow.allows(&target.host, target.port) {
        return Err(refuse(
            "403 Forbidden",
            format!(
                "{}:{} is not on this sandbox's network allowlist (allowed: {} on ports 80 and 443)",
                target.host,
                target.port,
                allow.names().join(", ")
            ),
        ));
    }
    let addrs: Vec<_> = tokio::net::lookup_host((target.host.as_str(), target.port))
        .await
        .map_err(|e| {
            refuse(
                "502 Bad Gateway",
                format!("cannot resolve {}: {e}", target.host),
            )
        })?
        .collect();
    let Some(addr) = addrs.iter().find(|a| !forbidden(a.ip())).copied() else {
        return Err(refuse(
            "403 Forbidden",
            format!(
                "{} resolves only to addresses a sandbox may not reach",
                target.host
            ),
        ));
    };
    tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| {
            refuse(
                "504 Gateway Timeout",
                format!("connecting to {} timed out", target.host),
            )
        })?
        .map_err(|e| {
            refuse(
                "502 Bad Gateway",
                format!("cannot connect to {}: {e}", target.host),
            )
        })
}

async fn handle(channel: &Channel, mut stream: Replies, allow: &Allowlist) -> Result<(), Refusal> {
    let conn = stream.id;
    let Some((head, early)) = read_head(&mut stream).await? else {
        return Ok(()); // the client went away
    };
    let target = parse_head(&head)?;
    let upstream = connect_upstream(&target, allow).await?;
    let (up_read, mut up_write) = upstream.into_split();
    let first = match target.forward {
        None => {
            channel
                .write(
                    conn,
                    b"HTTP/1.1 200 Connection established\r\n\r\n".to_vec(),
                    false,
                )
                .await
                .map_err(|e| refuse("502 Bad Gateway", e.to_string()))?;
            early
        }
        Some(mut forward) => {
            forward.extend_from_slice(&early);
            forward
        }
    };
    if !first.is_empty() && up_write.write_all(&first).await.is_err() {
        return Ok(());
    }
    relay(channel, stream, up_read, up_write).await;
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_allowlist_matches_names_domains_and_ports() {
        let allow = Allowlist::new(&["pypi.org", "*.pythonhosted.org"]).unwrap();
        assert!(allow.allows("pypi.org", 443));
        assert!(allow.allows("PyPI.org.", 80));
        assert!(allow.allows("files.pythonhosted.org", 443));
        assert!(!allow.allows("pythonhosted.org", 443));
        assert!(!allow.allows("evilpypi.org", 443));
        assert!(!allow.allows("pypi.org.evil.com", 443));
        assert!(!allow.allows("pypi.org", 22));
        for bad in ["", "a b", "*.", "x/y", "ex:80"] {
            assert!(Allowlist::new(&[bad]).is_err(), "{bad:?}");
        }
    }

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

    #[test]
    fn the_host_and_its_neighbours_are_never_reached() {
        for ip in [
            "127.0.0.1",
            "169.254.169.254",
            "0.0.0.0",
            "::1",
            "fe80::1",
            "::ffff:127.0.0.1",
            "224.0.0.1",
        ] {
            assert!(forbidden(ip.parse().unwrap()), "{ip}");
        }
        for ip in ["203.0.113.80", "151.101.0.223", "2a04:4e42::223"] {
            assert!(!forbidden(ip.parse().unwrap()), "{ip}");
        }
    }
}
