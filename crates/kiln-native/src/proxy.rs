//! The network allowlist: a box has no interface but loopback; where its sandbox asks for
//! `network: allowlist`, the agent listens on a loopback port inside the box and carries
//! every connection made to it over its channel to this proxy in kiln, which answers
//! `CONNECT host:port` (and absolute-form `GET http://…`) for the listed names only, from the
//! host's network. Anything else gets a clear refusal (`403`, naming the host and the list).
//! `pip install` and `npm install` work with the proxy variables kiln sets in the box.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
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

/// The names a box may reach, and on which ports, and the private addresses (if any) the
/// operator lets those names lead to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allowlist {
    /// Exact host names, or `*.suffix` for every name under a domain; lower-case.
    names: Vec<String>,
    /// Private ranges (`10.0.0.0/8`) and addresses (`192.168.1.20`) the operator listed: a
    /// listed name may lead into them, and a listed single address may be named directly.
    addresses: Vec<Cidr>,
    ports: Vec<u16>,
}

/// The package indexes `pip` and `npm` use.
pub const DEFAULT_NAMES: [&str; 3] = ["pypi.org", "files.pythonhosted.org", "registry.npmjs.org"];

/// An address range: an address and how many of its leading bits a member shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    addr: IpAddr,
    bits: u8,
}

impl Cidr {
    /// `10.0.0.0/8`, `fd00::/8`, or one address (`192.168.1.20`, `fd00::1`). The address is
    /// taken as written, host bits and all, and compared on the prefix only.
    pub fn parse(text: &str) -> Option<Cidr> {
        let (addr, bits) = match text.split_once('/') {
            Some((addr, bits)) => (addr, Some(bits)),
            None => (text, None),
        };
        let addr: IpAddr = addr
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse()
            .ok()?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let bits: u8 = match bits {
            Some(bits) => bits.parse().ok().filter(|b| *b <= max)?,
            None => max,
        };
        // An IPv6 form of IPv4 addresses (`::ffff:10.0.0.0/104`) is their IPv4 range.
        if let IpAddr::V6(v6) = addr
            && bits >= 96
            && let Some(v4) = embedded_v4(v6)
        {
            return Some(Cidr {
                addr: IpAddr::V4(v4),
                bits: bits - 96,
            });
        }
        Some(Cidr { addr, bits })
    }

    /// Whether `ip` is in the range (an IPv4 range holds the IPv6 forms of its addresses
    /// too, see [`embedded_v4`]).
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, canonical(ip)) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => prefix_eq(&net.octets(), &ip.octets(), self.bits),
            (IpAddr::V6(net), IpAddr::V6(ip)) => prefix_eq(&net.octets(), &ip.octets(), self.bits),
            _ => false,
        }
    }

    /// One address, not a range.
    fn is_single(&self) -> bool {
        self.bits == if self.addr.is_ipv4() { 32 } else { 128 }
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_single() {
            write!(f, "{}", self.addr)
        } else {
            write!(f, "{}/{}", self.addr, self.bits)
        }
    }
}

fn prefix_eq(a: &[u8], b: &[u8], bits: u8) -> bool {
    let (whole, rest) = (usize::from(bits / 8), bits % 8);
    a[..whole] == b[..whole]
        && (rest == 0 || {
            let mask = 0xffu8 << (8 - rest);
            a[whole] & mask == b[whole] & mask
        })
}

impl Allowlist {
    /// `entries` on ports 80 and 443: host names (exact or `*.domain`), and the private
    /// ranges or addresses (`10.0.0.0/8`, `192.168.1.20`, `fd00::/8`) those names may lead
    /// to (a single address is also a host a box may name). Loopback, link-local,
    /// multicast and unspecified addresses can never be listed.
    pub fn new<S: AsRef<str>>(entries: &[S]) -> Result<Allowlist, String> {
        let mut names = Vec::new();
        let mut addresses = Vec::new();
        for entry in entries {
            let entry = entry.as_ref().trim().to_ascii_lowercase();
            if let Some(cidr) = Cidr::parse(&entry) {
                if let Reach::Never(why) = classify(cidr.addr) {
                    return Err(format!(
                        "{entry:?} is {why}, which a sandbox may never reach"
                    ));
                }
                addresses.push(cidr);
                continue;
            }
            if entry.contains('/') || entry.contains(':') {
                return Err(format!(
                    "{entry:?} is neither a host name (or *.domain) nor an address range (10.0.0.0/8)"
                ));
            }
            let bare = entry.strip_prefix("*.").unwrap_or(&entry);
            let valid = !bare.is_empty()
                && bare.len() <= 253
                && bare.split('.').all(|label| {
                    !label.is_empty()
                        && label.len() <= 63
                        && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
                });
            if !valid {
                return Err(format!("{entry:?} is not a host name (or *.domain)"));
            }
            names.push(entry);
        }
        Ok(Allowlist {
            names,
            addresses,
            ports: vec![80, 443],
        })
    }

    /// Whether `host:port` may be asked for (where it may lead is [`Allowlist::reach`]'s).
    pub fn allows(&self, host: &str, port: u16) -> bool {
        if !self.ports.contains(&port) {
            return false;
        }
        // An address given as the host: only one listed by itself.
        if let Ok(ip) = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
        {
            return self
                .addresses
                .iter()
                .any(|a| a.is_single() && canonical(a.addr) == canonical(ip));
        }
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        self.names.iter().any(|name| match name.strip_prefix("*.") {
            Some(domain) => host.ends_with(&format!(".{domain}")),
            None => *name == host,
        })
    }

    /// Whether a connection may go to `ip`, given the host's own addresses: `Err` says why
    /// not. Public addresses may; loopback, link-local, multicast and unspecified ones never;
    /// private ones (RFC 1918, CGNAT, unique-local IPv6) only inside a listed range; the
    /// host's own only where listed by itself.
    pub fn reach(&self, ip: IpAddr, host_addresses: &[IpAddr]) -> Result<(), String> {
        let ip = canonical(ip);
        let listed_alone = || {
            self.addresses
                .iter()
                .any(|a| a.is_single() && a.contains(ip))
        };
        if host_addresses.iter().any(|own| canonical(*own) == ip) && !listed_alone() {
            if matches!(classify(ip), Reach::Never(_)) {
                return Err(format!("{ip} is {}", describe(ip)));
            }
            return Err(format!(
                "{ip} is one of this host's own addresses (only an operator's --network-allow {ip} opens it)"
            ));
        }
        match classify(ip) {
            Reach::Public => Ok(()),
            Reach::Never(why) => Err(format!("{ip} is {why}")),
            Reach::Private(_) if self.addresses.iter().any(|a| a.contains(ip)) => Ok(()),
            Reach::Private(why) => Err(format!(
                "{ip} is {why} (an operator opens a private range with --network-allow, e.g. --network-allow {})",
                suggestion(ip)
            )),
        }
    }

    /// This list and one host more, on `port` too: a template build's Debian mirror. A
    /// name is listed with the addresses it resolves to here that a box could not otherwise
    /// reach (private ones, the host's own), because the operator chose the mirror; an
    /// address is listed by itself. A mirror on a loopback or link-local address cannot be
    /// reached through the proxy at all: that is an error that says so.
    pub fn with_host(&self, host: &str, port: u16) -> Result<Allowlist, String> {
        let mut list = self.clone();
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        let addresses: Vec<IpAddr> = match bare.parse::<IpAddr>() {
            Ok(ip) => vec![ip],
            Err(_) => {
                let named = Allowlist::new(&[bare])?;
                list.names.extend(named.names);
                std::net::ToSocketAddrs::to_socket_addrs(&(bare, port))
                    .map(|found| found.map(|a| a.ip()).collect())
                    .unwrap_or_default()
            }
        };
        let own = host_addresses();
        for ip in addresses {
            let listed = Cidr::parse(&ip.to_string()).ok_or_else(|| format!("{ip}?"))?;
            match classify(ip) {
                Reach::Never(why) => {
                    return Err(format!(
                        "{host} is {why} ({ip}), which a build reaches only through kiln's proxy and the proxy never reaches: use a mirror on an address a box may reach"
                    ));
                }
                Reach::Private(_) => list.addresses.push(listed),
                Reach::Public if own.contains(&ip) => list.addresses.push(listed),
                Reach::Public if bare.parse::<IpAddr>().is_ok() => list.addresses.push(listed),
                Reach::Public => {}
            }
        }
        if !list.ports.contains(&port) {
            list.ports.push(port);
        }
        Ok(list)
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The private ranges and addresses listed.
    pub fn addresses(&self) -> &[Cidr] {
        &self.addresses
    }

    /// The list as an operator wrote it, for messages.
    fn describe(&self) -> String {
        let mut all: Vec<String> = self.names.clone();
        all.extend(self.addresses.iter().map(Cidr::to_string));
        all.join(", ")
    }
}

/// Where an address is, for the proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reach {
    /// Anywhere on the internet (documentation and benchmark ranges included: some hosts'
    /// resolvers answer public names with them).
    Public,
    /// A private network's (reachable only inside a range the operator listed).
    Private(&'static str),
    /// The host itself, its link, or no single host at all: never.
    Never(&'static str),
}

/// The IPv4 address an IPv6 one stands for, where it stands for one: IPv4-mapped
/// (`::ffff:a.b.c.d`), IPv4-compatible (`::a.b.c.d`, deprecated) and NAT64's well-known
/// prefix (`64:ff9b::a.b.c.d`, which a NAT64 gateway carries to `a.b.c.d`).
fn embedded_v4(v6: Ipv6Addr) -> Option<Ipv4Addr> {
    let s = v6.segments();
    let tail = Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
    match s {
        [0, 0, 0, 0, 0, 0xffff, _, _] => Some(tail),
        // `::` and `::1` are IPv6's own unspecified and loopback addresses.
        [0, 0, 0, 0, 0, 0, hi, lo] if hi != 0 || lo > 1 => Some(tail),
        [0x64, 0xff9b, 0, 0, 0, 0, _, _] => Some(tail),
        _ => None,
    }
}

/// An address in the form the checks compare: IPv6 forms of IPv4 addresses as IPv4.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => embedded_v4(v6).map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

fn in_v4(ip: Ipv4Addr, net: [u8; 4], bits: u8) -> bool {
    prefix_eq(&ip.octets(), &net, bits)
}

/// Where `ip` is (its IPv6 forms of IPv4 addresses as that address).
fn classify(ip: IpAddr) -> Reach {
    match canonical(ip) {
        IpAddr::V4(v4) => {
            if v4.is_loopback() {
                Reach::Never("a loopback address (the host itself)")
            } else if v4.is_link_local() {
                Reach::Never("a link-local address (the host's link: cloud metadata services)")
            } else if in_v4(v4, [0, 0, 0, 0], 8) {
                Reach::Never("an unspecified (\"this host\") address")
            } else if v4.is_broadcast() || v4.is_multicast() {
                Reach::Never("a broadcast or multicast address")
            } else if in_v4(v4, [240, 0, 0, 0], 4) {
                Reach::Never("a reserved address (240.0.0.0/4)")
            } else if in_v4(v4, [10, 0, 0, 0], 8)
                || in_v4(v4, [172, 16, 0, 0], 12)
                || in_v4(v4, [192, 168, 0, 0], 16)
            {
                Reach::Private("a private network's address (RFC 1918)")
            } else if in_v4(v4, [100, 64, 0, 0], 10) {
                Reach::Private("a carrier-grade NAT address (100.64.0.0/10)")
            } else {
                Reach::Public
            }
        }
        IpAddr::V6(v6) => {
            let first = v6.segments()[0];
            if v6.is_loopback() {
                Reach::Never("a loopback address (the host itself)")
            } else if v6.is_unspecified() {
                Reach::Never("the unspecified address (the host itself)")
            } else if first & 0xffc0 == 0xfe80 {
                Reach::Never("a link-local address (the host's link)")
            } else if v6.is_multicast() {
                Reach::Never("a multicast address")
            } else if first & 0xfe00 == 0xfc00 {
                Reach::Private("a unique-local IPv6 address (fc00::/7)")
            } else if first & 0xffc0 == 0xfec0 {
                Reach::Private("a site-local IPv6 address (fec0::/10)")
            } else if v6.segments()[..3] == [0x64, 0xff9b, 1] {
                Reach::Private("a local-use NAT64 address (64:ff9b:1::/48)")
            } else {
                Reach::Public
            }
        }
    }
}

fn describe(ip: IpAddr) -> &'static str {
    match classify(ip) {
        Reach::Public => "a public address",
        Reach::Private(why) | Reach::Never(why) => why,
    }
}

/// What an operator would list to open `ip`, for a refusal's hint.
fn suggestion(ip: IpAddr) -> String {
    canonical(ip).to_string()
}

/// Every address assigned to an interface of this host (empty if they cannot be read):
/// a listed name must not lead back to the host through one of them.
pub fn host_addresses() -> Vec<IpAddr> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a pointer to a list it allocates into `list`, a live local;
    // on failure it returns -1 and the list is not ours to free.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return Vec::new();
    }
    let mut found = Vec::new();
    let mut at = list;
    while !at.is_null() {
        // SAFETY: `at` is a node of the list getifaddrs made, which stays valid until
        // freeifaddrs below; its `ifa_addr` is null or points at a sockaddr whose family says
        // which struct it is (sockaddr_in for AF_INET, sockaddr_in6 for AF_INET6).
        unsafe {
            let node = &*at;
            if !node.ifa_addr.is_null() {
                match i32::from((*node.ifa_addr).sa_family) {
                    libc::AF_INET => {
                        let sin = &*(node.ifa_addr as *const libc::sockaddr_in);
                        found.push(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                            sin.sin_addr.s_addr,
                        ))));
                    }
                    libc::AF_INET6 => {
                        let sin6 = &*(node.ifa_addr as *const libc::sockaddr_in6);
                        found.push(IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)));
                    }
                    _ => {}
                }
            }
            at = node.ifa_next;
        }
    }
    // SAFETY: `list` came from a successful getifaddrs and is freed once, after its last use.
    unsafe { libc::freeifaddrs(list) };
    found
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

/// Connects to an allowed target from the host, never to the host itself (nor, unless the
/// operator listed them, to private networks).
async fn connect_upstream(target: &Target, allow: &Allowlist) -> Result<TcpStream, Refusal> {
    if !allow.allows(&target.host, target.port) {
        return Err(refuse(
            "403 Forbidden",
            format!(
                "{}:{} is not on this sandbox's network allowlist (allowed: {} on ports 80 and 443)",
                target.host,
                target.port,
                allow.describe()
            ),
        ));
    }
    let addrs: Vec<_> = tokio::net::lookup_host((
        target.host.trim_start_matches('[').trim_end_matches(']'),
        target.port,
    ))
    .await
    .map_err(|e| {
        refuse(
            "502 Bad Gateway",
            format!("cannot resolve {}: {e}", target.host),
        )
    })?
    .collect();
    let addr = choose(&target.host, &addrs, allow, &host_addresses())?;
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

/// The first of `host`'s addresses a box may reach, or a refusal naming why none may be.
fn choose(
    host: &str,
    addrs: &[SocketAddr],
    allow: &Allowlist,
    host_addresses: &[IpAddr],
) -> Result<SocketAddr, Refusal> {
    let mut why = Vec::new();
    for addr in addrs {
        match allow.reach(addr.ip(), host_addresses) {
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

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    fn reach(allow: &Allowlist, text: &str) -> Result<(), String> {
        allow.reach(ip(text), &[])
    }

    #[test]
    fn the_host_and_its_neighbours_are_never_reached() {
        let allow = Allowlist::new(&["pypi.org"]).unwrap();
        for never in [
            "127.0.0.1",
            "127.255.255.254",
            "169.254.169.254",
            "169.254.0.0",
            "169.254.255.255",
            "0.0.0.0",
            "0.1.2.3",
            "224.0.0.1",
            "239.255.255.255",
            "255.255.255.255",
            "240.0.0.1",
            "::",
            "::1",
            "fe80::1",
            "febf:ffff::1",
            "ff02::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "::ffff:0.0.0.0",
            "::127.0.0.1",
            "::2",
            "64:ff9b::a9fe:a9fe",
        ] {
            assert!(
                matches!(classify(ip(never)), Reach::Never(_)),
                "{never}: {:?}",
                classify(ip(never))
            );
            assert!(reach(&allow, never).is_err(), "{never}");
        }
        // Not even an operator can list them.
        for never in [
            "127.0.0.0/8",
            "169.254.169.254",
            "::1",
            "fe80::/10",
            "::ffff:127.0.0.1",
        ] {
            let refused = Allowlist::new(&[never]).unwrap_err();
            assert!(refused.contains("may never reach"), "{never}: {refused}");
        }
    }

    #[test]
    fn private_networks_are_refused_at_each_range_and_its_edges() {
        let allow = Allowlist::new(&["pypi.org"]).unwrap();
        for private in [
            "10.0.0.0",
            "10.255.255.255",
            "172.16.0.0",
            "172.31.255.255",
            "192.168.0.0",
            "192.168.255.255",
            "100.64.0.0",
            "100.127.255.255",
            "fc00::",
            "fd00::2",
            "fdff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
            "fec0::1",
            "64:ff9b:1::a",
            // IPv6 forms of private IPv4 addresses.
            "::ffff:10.0.0.1",
            "::ffff:172.16.5.4",
            "::ffff:192.168.1.1",
            "::ffff:100.64.0.1",
            "::10.1.2.3",
            "64:ff9b::10.1.2.3",
            "64:ff9b::c0a8:0101",
        ] {
            assert!(
                matches!(classify(ip(private)), Reach::Private(_)),
                "{private}: {:?}",
                classify(ip(private))
            );
            let refused = reach(&allow, private).unwrap_err();
            assert!(refused.contains("--network-allow"), "{refused}");
        }
        // Just outside each range: public (documentation and benchmark ranges too, which
        // some resolvers answer for public names).
        for public in [
            "9.255.255.255",
            "11.0.0.0",
            "172.15.255.255",
            "172.32.0.0",
            "192.167.255.255",
            "192.169.0.0",
            "100.63.255.255",
            "100.128.0.0",
            "1.1.1.1",
            "151.101.0.223",
            "203.0.113.80",
            "192.0.2.2",
            "198.18.0.1",
            "169.253.255.255",
            "169.255.0.0",
            "126.255.255.255",
            "128.0.0.0",
            "223.255.255.255",
            "2a04:4e42::223",
            "2001:db8::1",
            "fbff:ffff::1",
            "fe00::1",
            "::ffff:151.101.0.223",
            "64:ff9b::151.101.0.223",
        ] {
            assert_eq!(classify(ip(public)), Reach::Public, "{public}");
            assert_eq!(reach(&allow, public), Ok(()), "{public}");
        }
    }

    #[test]
    fn an_operator_opens_the_private_ranges_it_lists_and_no_others() {
        let allow = Allowlist::new(&[
            "mirror.internal",
            "10.20.0.0/16",
            "192.168.1.20",
            "fd00:1::/32",
        ])
        .unwrap();
        assert_eq!(allow.names(), ["mirror.internal"]);
        assert_eq!(allow.addresses().len(), 3);
        for open in [
            "10.20.0.0",
            "10.20.255.255",
            "::ffff:10.20.3.4",
            "64:ff9b::10.20.3.4",
            "192.168.1.20",
            "fd00:1::5",
            "fd00:1:ffff::1",
        ] {
            assert_eq!(reach(&allow, open), Ok(()), "{open}");
        }
        for shut in [
            "10.19.255.255",
            "10.21.0.0",
            "192.168.1.21",
            "192.168.1.19",
            "fd00:2::5",
            "172.16.0.1",
            "127.0.0.1",
        ] {
            assert!(reach(&allow, shut).is_err(), "{shut}");
        }
        // A single address is also a host a box may name; a range is not, nor its members.
        assert!(allow.allows("192.168.1.20", 443));
        assert!(allow.allows("::ffff:192.168.1.20", 443));
        assert!(!allow.allows("192.168.1.20", 22));
        assert!(!allow.allows("10.20.0.1", 443));
        assert!(!allow.allows("127.0.0.1", 443));
        // Bad entries say what they are.
        for bad in ["10.0.0.0/33", "fd00::/129", "10.0.0/8", "fd00:::1", "a/b"] {
            assert!(Allowlist::new(&[bad]).is_err(), "{bad}");
        }
        assert!(
            allow.describe().contains("10.20.0.0/16"),
            "{}",
            allow.describe()
        );
        // IPv6 forms of IPv4 ranges are those ranges.
        let mapped = Allowlist::new(&["::ffff:172.16.0.0/108"]).unwrap();
        assert_eq!(mapped.addresses()[0].to_string(), "172.16.0.0/12");
        assert_eq!(reach(&mapped, "172.31.0.1"), Ok(()));
        assert!(reach(&mapped, "10.0.0.1").is_err());
    }

    #[test]
    fn the_hosts_own_addresses_are_refused_unless_listed_alone() {
        let own = [ip("192.0.2.2"), ip("fd00::2"), ip("127.0.0.1")];
        let plain = Allowlist::new(&["pypi.org"]).unwrap();
        for address in ["192.0.2.2", "::ffff:192.0.2.2", "fd00::2"] {
            let refused = plain.reach(ip(address), &own).unwrap_err();
            assert!(refused.contains("host's own"), "{address}: {refused}");
        }
        assert_eq!(plain.reach(ip("192.0.2.3"), &own), Ok(()));
        // A range holding the host's address opens its neighbours, not the host.
        let range = Allowlist::new(&["fd00::/64", "192.0.2.0/24"]).unwrap();
        assert_eq!(range.reach(ip("fd00::3"), &own), Ok(()));
        assert!(range.reach(ip("fd00::2"), &own).is_err());
        assert!(range.reach(ip("192.0.2.2"), &own).is_err());
        let alone = Allowlist::new(&["fd00::2", "192.0.2.2"]).unwrap();
        assert_eq!(alone.reach(ip("fd00::2"), &own), Ok(()));
        assert_eq!(alone.reach(ip("::ffff:192.0.2.2"), &own), Ok(()));
        // This host's real addresses include its loopback.
        let real = host_addresses();
        assert!(real.contains(&ip("127.0.0.1")), "{real:?}");
        assert!(plain.reach(ip("127.0.0.1"), &real).is_err());
    }

    #[test]
    fn a_name_leading_only_where_a_box_may_not_go_is_refused_with_each_reason() {
        let allow = Allowlist::new(&["pypi.org"]).unwrap();
        let at = |text: &str| SocketAddr::new(ip(text), 443);
        let refused = choose(
            "pypi.org",
            &[at("10.0.0.1"), at("::ffff:100.64.1.1"), at("127.0.0.1")],
            &allow,
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
            &[at("10.0.0.1"), at("151.101.0.223")],
            &allow,
            &[],
        )
        .unwrap();
        assert_eq!(chosen, at("151.101.0.223"));
    }
}
