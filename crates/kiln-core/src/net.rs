//! Where a sandbox's network may lead: the operator's allowlist ([`Allowlist`]), the
//! address classes no sandbox reaches ([`Reach`]), and a sandbox's own egress rules
//! ([`Egress`], E2B's `allow_out` / `deny_out` / `rules`), decided for each connection by
//! [`EgressPolicy::decide`]. Pure logic: kiln's proxy (`kiln_native::proxy`) does the I/O.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use serde::{Deserialize, Serialize};

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
    pub fn describe(&self) -> String {
        let mut all: Vec<String> = self.names.clone();
        all.extend(self.addresses.iter().map(Cidr::to_string));
        all.join(", ")
    }
}

/// Where an address is, for the proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach {
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
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => embedded_v4(v6).map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

fn in_v4(ip: Ipv4Addr, net: [u8; 4], bits: u8) -> bool {
    prefix_eq(&ip.octets(), &net, bits)
}

/// Where `ip` is (its IPv6 forms of IPv4 addresses as that address).
pub fn classify(ip: IpAddr) -> Reach {
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

/// Where kiln's proxy finds a tenant's secrets (kiln's runtime keeps them).
pub trait SecretSource: Send + Sync {
    /// The value of `tenant`'s secret `name`, or why there is none.
    fn secret(&self, tenant: &str, name: &str) -> Result<String, String>;
}

/// What `allowOut` / `denyOut` name for every destination (E2B's `ctx.all_traffic`);
/// `*` and `::/0` mean the same.
pub const ALL_TRAFFIC: &str = "0.0.0.0/0";

/// The most entries in `allowOut` or `denyOut`, hosts in `rules`, rules per host and
/// headers per rule; the longest entry, header name and header template.
pub const MAX_ENTRIES: usize = 256;
pub const MAX_RULE_HOSTS: usize = 64;
pub const MAX_RULES_PER_HOST: usize = 8;
pub const MAX_HEADERS: usize = 32;
pub const MAX_ENTRY: usize = 300;
pub const MAX_HEADER_NAME: usize = 128;
pub const MAX_HEADER_VALUE: usize = 8 << 10;

/// The ports a destination without one of its own is reached on through the operator's
/// list (and through a sandbox's widening `allowOut` entry).
pub const WEB_PORTS: [u16; 2] = [80, 443];

/// A sandbox's own egress rules: E2B's `network` (`allowOut`, `denyOut`, `rules`), and
/// kiln's `network` object in `/api/v1/sandboxes`. A destination is reached when an
/// `allowOut` entry names it, or no `denyOut` entry does (E2B's rule: `allowOut` wins), and
/// always within the operator's allowlist, unless the key that set the rules may widen it.
/// `rules` set headers on HTTP(S) requests to named hosts, with `${secrets.NAME}` (or E2B's
/// `${e2b.secrets.NAME}`) placeholders kiln's proxy fills from the tenant's secrets.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Egress {
    /// Destinations always reached (within the operator's list): host names, `*.domain`,
    /// addresses and ranges (`10.1.0.0/16`), each with an optional `:port`; `0.0.0.0/0`
    /// (or `*`) for all.
    #[serde(default, alias = "allow_out", skip_serializing_if = "Vec::is_empty")]
    pub allow_out: Vec<String>,
    /// Destinations refused unless `allowOut` names them; `["0.0.0.0/0"]` refuses all
    /// that `allowOut` leaves out.
    #[serde(default, alias = "deny_out", skip_serializing_if = "Vec::is_empty")]
    pub deny_out: Vec<String>,
    /// Per host (a name, `*.domain` or an address): rules whose `transform.headers` kiln's
    /// proxy sets on every HTTP and HTTPS request to it. Naming a host here does not allow
    /// it: `allowOut` (or the operator's list) must.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub rules: BTreeMap<String, Vec<EgressRule>>,
}

/// One rule for a host.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct EgressRule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transform: Option<Transform>,
}

/// What a rule does to a request.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Transform {
    /// Headers set on the request (replacing any the box sent under the same name);
    /// values may hold `${secrets.NAME}` placeholders.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
}

impl Egress {
    /// Whether it says nothing (the operator's list alone decides).
    pub fn is_empty(&self) -> bool {
        self.allow_out.is_empty() && self.deny_out.is_empty() && self.rules.is_empty()
    }

    /// Checks every entry and rule, saying which is wrong and why.
    pub fn validate(&self) -> Result<(), String> {
        EgressPolicy::compile(self).map(|_| ())
    }

    /// The secret names its rules' headers use.
    pub fn secret_names(&self) -> Vec<String> {
        let mut names = Vec::new();
        for rule in self.rules.values().flatten() {
            for value in rule.transform.iter().flat_map(|t| t.headers.values()) {
                for name in placeholders(value) {
                    if !names.contains(&name) {
                        names.push(name);
                    }
                }
            }
        }
        names
    }
}

/// A sandbox's egress rules as its box's proxy applies them: the rules, whether the key
/// that set them may widen the operator's list, and whose secrets fill their placeholders.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EgressGrant {
    pub rules: Egress,
    /// `allowOut` may reach names beyond the operator's list (its key may widen it).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub widen: bool,
    /// The tenant whose secrets the rules' placeholders name.
    pub tenant: String,
    /// The sandbox, for audit lines.
    #[serde(default)]
    pub sandbox: String,
}

/// Where a destination entry points.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Dest {
    All,
    /// An exact host name, lower-case, without a trailing dot.
    Name(String),
    /// `*.domain`: every name under the domain (`.domain`, lower-case).
    Domain(String),
    /// An address or a range.
    Range(Cidr),
}

/// One `allowOut` / `denyOut` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    dest: Dest,
    port: Option<u16>,
    text: String,
}

fn valid_name(bare: &str) -> bool {
    !bare.is_empty()
        && bare.len() <= 253
        && bare.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        })
}

/// A host pattern: `name`, `*.domain` or an address or range.
fn parse_dest(text: &str) -> Option<Dest> {
    if matches!(text, "*" | "0.0.0.0/0" | "::/0") {
        return Some(Dest::All);
    }
    if let Some(cidr) = Cidr::parse(text) {
        return Some(Dest::Range(cidr));
    }
    if let Some(domain) = text.strip_prefix("*.") {
        return valid_name(domain).then(|| Dest::Domain(format!(".{domain}")));
    }
    let name = text.trim_end_matches('.');
    valid_name(name).then(|| Dest::Name(name.to_string()))
}

impl Entry {
    fn parse(raw: &str) -> Result<Entry, String> {
        let text = raw.trim().to_ascii_lowercase();
        if text.is_empty() || text.len() > MAX_ENTRY {
            return Err(format!(
                "{raw:?} is not a destination (1..={MAX_ENTRY} characters)"
            ));
        }
        if let Some(dest) = parse_dest(&text) {
            return Ok(Entry {
                dest,
                port: None,
                text,
            });
        }
        // `host:port`, `1.2.3.4:port`, `[v6]:port`.
        let with_port = text.rsplit_once(':').and_then(|(host, port)| {
            let port: u16 = port.parse().ok().filter(|p| *p > 0)?;
            let host = host
                .strip_prefix('[')
                .and_then(|h| h.strip_suffix(']'))
                .unwrap_or(host);
            match parse_dest(host)? {
                Dest::Range(cidr) if !cidr.is_single() => None,
                Dest::All => None,
                dest => Some((dest, port)),
            }
        });
        match with_port {
            Some((dest, port)) => Ok(Entry {
                dest,
                port: Some(port),
                text,
            }),
            None => Err(format!(
                "{raw:?} is not a destination: a host name, *.domain, an address or range (10.0.0.0/8), optionally with :port, or 0.0.0.0/0 for all"
            )),
        }
    }

    /// Whether it names `host:port` (at `ip`, once resolved; an address given as the host
    /// is its own `ip`).
    fn matches(&self, host: &str, port: u16, ip: Option<IpAddr>) -> bool {
        if self.port.is_some_and(|p| p != port) {
            return false;
        }
        match &self.dest {
            Dest::All => true,
            Dest::Name(name) => *name == host,
            Dest::Domain(suffix) => host.ends_with(suffix.as_str()),
            Dest::Range(cidr) => literal(host).or(ip).is_some_and(|ip| cidr.contains(ip)),
        }
    }

    fn is_range(&self) -> bool {
        matches!(self.dest, Dest::Range(_))
    }
}

/// The address a host is, where it is one.
fn literal(host: &str) -> Option<IpAddr> {
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .parse()
        .ok()
}

/// A host as rules compare it: lower-case, no trailing dot, no brackets.
pub fn normal_host(host: &str) -> String {
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .trim_end_matches('.')
        .to_ascii_lowercase()
}

/// A valid HTTP header name (an RFC 9110 token).
fn header_name_ok(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_HEADER_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// Headers no rule may set: the proxy frames requests by them, or they name the host.
const FRAMING_HEADERS: [&str; 6] = [
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "upgrade",
    "te",
];

/// A valid secret name: 1..=128 of `A-Z a-z 0-9 _ . -`.
pub fn secret_name_ok(name: &str) -> bool {
    (1..=128).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

/// The secret names `${secrets.NAME}` / `${e2b.secrets.NAME}` placeholders in `text` use.
pub fn placeholders(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("${") {
        let after = &rest[at + 2..];
        let Some(end) = after.find('}') else { break };
        let inner = &after[..end];
        if let Some(name) = inner
            .strip_prefix("e2b.secrets.")
            .or_else(|| inner.strip_prefix("secrets."))
        {
            names.push(name.to_string());
        }
        rest = &after[end + 1..];
    }
    names
}

/// `text` with each `${secrets.NAME}` / `${e2b.secrets.NAME}` placeholder replaced by what
/// `resolve` answers for NAME; other `${…}` are left as they are.
pub fn fill(
    text: &str,
    mut resolve: impl FnMut(&str) -> Result<String, String>,
) -> Result<String, String> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("${") {
        out.push_str(&rest[..at]);
        let after = &rest[at + 2..];
        let Some(end) = after.find('}') else {
            out.push_str(&rest[at..]);
            return Ok(out);
        };
        let inner = &after[..end];
        match inner
            .strip_prefix("e2b.secrets.")
            .or_else(|| inner.strip_prefix("secrets."))
        {
            Some(name) => out.push_str(&resolve(name)?),
            None => out.push_str(&rest[at..at + 2 + end + 1]),
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// The headers rules set for one host pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
struct HostRules {
    dest: Dest,
    headers: Vec<(String, String)>,
}

/// A sandbox's egress rules, checked and ready to decide connections.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EgressPolicy {
    grant: EgressGrant,
    allow: Vec<Entry>,
    deny: Vec<Entry>,
    rules: Vec<HostRules>,
}

/// What the sandbox's own lists say of a destination.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// An `allowOut` entry names it.
    Listed,
    /// No entry refuses it.
    Open,
    /// This `denyOut` entry refuses it.
    Denied(String),
    /// Only its address can tell.
    Unknown,
}

impl EgressPolicy {
    /// The rules of `grant`, or why they are wrong.
    pub fn new(grant: EgressGrant) -> Result<EgressPolicy, String> {
        let mut policy = EgressPolicy::compile(&grant.rules)?;
        policy.grant = grant;
        Ok(policy)
    }

    fn compile(egress: &Egress) -> Result<EgressPolicy, String> {
        for (what, list) in [
            ("allowOut", &egress.allow_out),
            ("denyOut", &egress.deny_out),
        ] {
            if list.len() > MAX_ENTRIES {
                return Err(format!("{what}: at most {MAX_ENTRIES} entries"));
            }
        }
        let parse = |what: &str, list: &[String]| -> Result<Vec<Entry>, String> {
            list.iter()
                .map(|e| Entry::parse(e).map_err(|why| format!("{what}: {why}")))
                .collect()
        };
        let allow = parse("allowOut", &egress.allow_out)?;
        let deny = parse("denyOut", &egress.deny_out)?;
        if egress.rules.len() > MAX_RULE_HOSTS {
            return Err(format!("rules: at most {MAX_RULE_HOSTS} hosts"));
        }
        let mut rules = Vec::new();
        for (host, list) in &egress.rules {
            let pattern = host.trim().to_ascii_lowercase();
            let dest = match parse_dest(&pattern) {
                Some(Dest::All) | None => {
                    return Err(format!(
                        "rules: {host:?} is not a host (a name, *.domain or an address)"
                    ));
                }
                Some(dest) => dest,
            };
            if list.len() > MAX_RULES_PER_HOST {
                return Err(format!(
                    "rules[{host:?}]: at most {MAX_RULES_PER_HOST} rules"
                ));
            }
            let mut headers = Vec::new();
            for rule in list {
                let Some(transform) = &rule.transform else {
                    continue;
                };
                if transform.headers.len() > MAX_HEADERS {
                    return Err(format!(
                        "rules[{host:?}]: at most {MAX_HEADERS} headers a rule"
                    ));
                }
                for (name, value) in &transform.headers {
                    if !header_name_ok(name) {
                        return Err(format!("rules[{host:?}]: {name:?} is not a header name"));
                    }
                    if FRAMING_HEADERS.contains(&name.to_ascii_lowercase().as_str()) {
                        return Err(format!(
                            "rules[{host:?}]: a rule may not set {name:?} (the proxy frames requests by it)"
                        ));
                    }
                    if value.len() > MAX_HEADER_VALUE
                        || value.bytes().any(|b| b == b'\r' || b == b'\n' || b == 0)
                    {
                        return Err(format!(
                            "rules[{host:?}].{name}: a header value is one line of at most {MAX_HEADER_VALUE} bytes"
                        ));
                    }
                    for secret in placeholders(value) {
                        if !secret_name_ok(&secret) {
                            return Err(format!(
                                "rules[{host:?}].{name}: {secret:?} is not a secret name (1..=128 of A-Z a-z 0-9 _ . -)"
                            ));
                        }
                    }
                    headers.push((name.clone(), value.clone()));
                }
            }
            rules.push(HostRules { dest, headers });
        }
        Ok(EgressPolicy {
            grant: EgressGrant {
                rules: egress.clone(),
                ..Default::default()
            },
            allow,
            deny,
            rules,
        })
    }

    pub fn grant(&self) -> &EgressGrant {
        &self.grant
    }

    /// The sandbox's lists' verdict on `host:port` (at `ip`, once known).
    fn verdict(&self, host: &str, port: u16, ip: Option<IpAddr>) -> Verdict {
        if self.allow.iter().any(|e| e.matches(host, port, ip)) {
            return Verdict::Listed;
        }
        // Before the address is known, an `allowOut` range may still name it.
        if ip.is_none() && literal(host).is_none() && self.allow.iter().any(Entry::is_range) {
            return Verdict::Unknown;
        }
        if let Some(entry) = self.deny.iter().find(|e| e.matches(host, port, ip)) {
            return Verdict::Denied(entry.text.clone());
        }
        if ip.is_none() && literal(host).is_none() && self.deny.iter().any(Entry::is_range) {
            return Verdict::Unknown;
        }
        Verdict::Open
    }

    /// Whether `host:port` may be asked for at all, before it is resolved (a name no rule
    /// can let through is never looked up: a box cannot send data out in DNS queries).
    pub fn check_name(&self, operator: &Allowlist, host: &str, port: u16) -> Result<(), String> {
        let host = normal_host(host);
        let verdict = self.verdict(&host, port, None);
        if !operator.allows(&host, port) {
            let widens = self.grant.widen
                && self.allow.iter().any(|e| {
                    e.matches(&host, port, None) && (e.port.is_some() || WEB_PORTS.contains(&port))
                });
            if !widens {
                let mut why = format!(
                    "{host}:{port} is not on the operator's allowlist (allowed: {} on ports 80 and 443)",
                    operator.describe()
                );
                if verdict == Verdict::Listed {
                    why.push_str(
                        "; this sandbox's allowOut names it, but the key that set its rules may not widen the operator's list (an operator grants that with `kiln keys create --network-widen`)",
                    );
                }
                return Err(why);
            }
        }
        match verdict {
            Verdict::Denied(entry) => Err(format!(
                "{host}:{port} is refused by this sandbox's denyOut entry {entry:?}"
            )),
            _ => Ok(()),
        }
    }

    /// Whether a connection for `host:port` may go to `ip` (one of its addresses), given
    /// the host's own addresses.
    pub fn check_address(
        &self,
        operator: &Allowlist,
        host: &str,
        port: u16,
        ip: IpAddr,
        own: &[IpAddr],
    ) -> Result<(), String> {
        operator.reach(ip, own)?;
        match self.verdict(&normal_host(host), port, Some(ip)) {
            Verdict::Denied(entry) => Err(format!(
                "{ip} is refused by this sandbox's denyOut entry {entry:?}"
            )),
            _ => Ok(()),
        }
    }

    /// The headers rules set on requests to `host`, in order (templates, unfilled).
    pub fn headers_for(&self, host: &str) -> Vec<(String, String)> {
        let host = normal_host(host);
        self.rules
            .iter()
            .filter(|r| match &r.dest {
                Dest::All => false,
                Dest::Name(name) => *name == host,
                Dest::Domain(suffix) => host.ends_with(suffix.as_str()),
                Dest::Range(cidr) => literal(&host).is_some_and(|ip| cidr.contains(ip)),
            })
            .flat_map(|r| r.headers.iter().cloned())
            .collect()
    }

    /// Whether any rule names `host` (its HTTPS is then opened by the proxy).
    pub fn has_rules_for(&self, host: &str) -> bool {
        !self.headers_for(host).is_empty()
    }
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

    fn policy(allow: &[&str], deny: &[&str], widen: bool) -> EgressPolicy {
        EgressPolicy::new(EgressGrant {
            rules: Egress {
                allow_out: allow.iter().map(|s| s.to_string()).collect(),
                deny_out: deny.iter().map(|s| s.to_string()).collect(),
                rules: BTreeMap::new(),
            },
            widen,
            tenant: "t".into(),
            sandbox: "s".into(),
        })
        .unwrap()
    }

    #[test]
    fn egress_follows_e2bs_rule_allow_out_wins_and_the_rest_is_open_unless_denied() {
        let op = Allowlist::new(&["*.example.com", "pypi.org", "203.0.113.9"]).unwrap();
        let none = policy(&[], &[], false);
        assert_eq!(none.check_name(&op, "api.example.com", 443), Ok(()));
        assert!(none.check_name(&op, "evil.org", 443).is_err());
        // Only what allowOut names, the rest denied.
        let only = policy(&["api.example.com"], &[ALL_TRAFFIC], false);
        assert_eq!(only.check_name(&op, "api.example.com", 443), Ok(()));
        assert_eq!(only.check_name(&op, "API.Example.com.", 80), Ok(()));
        let refused = only.check_name(&op, "www.example.com", 443).unwrap_err();
        assert!(refused.contains("denyOut entry \"0.0.0.0/0\""), "{refused}");
        assert!(only.check_name(&op, "pypi.org", 443).is_err());
        // A deny list alone narrows; what it leaves out stays open.
        let narrow = policy(&[], &["*.example.com"], false);
        assert!(narrow.check_name(&op, "api.example.com", 443).is_err());
        assert_eq!(narrow.check_name(&op, "pypi.org", 443), Ok(()));
        // allowOut alone changes nothing (E2B: everything is allowed without a deny).
        let alone = policy(&["api.example.com"], &[], false);
        assert_eq!(alone.check_name(&op, "www.example.com", 443), Ok(()));
        // `*` and `::/0` are all traffic too.
        for all in ["*", "::/0"] {
            assert!(
                policy(&[], &[all], false)
                    .check_name(&op, "pypi.org", 443)
                    .is_err()
            );
        }
        // Ports: an entry's port binds it to that port.
        let port = policy(&["api.example.com:443"], &[ALL_TRAFFIC], false);
        assert_eq!(port.check_name(&op, "api.example.com", 443), Ok(()));
        assert!(port.check_name(&op, "api.example.com", 80).is_err());
    }

    #[test]
    fn a_sandbox_narrows_the_operators_list_and_widens_it_only_with_a_key_that_may() {
        let op = Allowlist::new(&["pypi.org"]).unwrap();
        let narrow = policy(&["api.openai.com"], &[ALL_TRAFFIC], false);
        let refused = narrow.check_name(&op, "api.openai.com", 443).unwrap_err();
        assert!(
            refused.contains("not on the operator's allowlist"),
            "{refused}"
        );
        assert!(refused.contains("--network-widen"), "{refused}");
        let wide = policy(
            &["api.openai.com", "db.example.net:5432"],
            &[ALL_TRAFFIC],
            true,
        );
        assert_eq!(wide.check_name(&op, "api.openai.com", 443), Ok(()));
        // Widening opens the web ports, or the entry's own port; never others.
        assert!(wide.check_name(&op, "api.openai.com", 22).is_err());
        assert_eq!(wide.check_name(&op, "db.example.net", 5432), Ok(()));
        assert!(wide.check_name(&op, "db.example.net", 443).is_err());
        // A widening list still cannot lead to the host or private networks.
        let own = [ip("198.51.100.7")];
        for never in ["127.0.0.1", "10.0.0.1", "169.254.169.254", "198.51.100.7"] {
            assert!(
                wide.check_address(&op, "api.openai.com", 443, ip(never), &own)
                    .is_err(),
                "{never}"
            );
        }
        assert_eq!(
            wide.check_address(&op, "api.openai.com", 443, ip("151.101.0.223"), &own),
            Ok(())
        );
        // Nor does naming a private address widen to it.
        let private = policy(&["10.0.0.5"], &[ALL_TRAFFIC], true);
        assert_eq!(private.check_name(&op, "10.0.0.5", 443), Ok(()));
        assert!(
            private
                .check_address(&op, "10.0.0.5", 443, ip("10.0.0.5"), &[])
                .is_err()
        );
    }

    #[test]
    fn address_ranges_decide_once_the_name_is_resolved() {
        let op = Allowlist::new(&["*.example.com"]).unwrap();
        let deny = policy(&[], &["203.0.113.0/24"], false);
        assert_eq!(deny.check_name(&op, "a.example.com", 443), Ok(()));
        let refused = deny
            .check_address(&op, "a.example.com", 443, ip("203.0.113.5"), &[])
            .unwrap_err();
        assert!(refused.contains("203.0.113.0/24"), "{refused}");
        assert_eq!(
            deny.check_address(&op, "a.example.com", 443, ip("198.51.100.1"), &[]),
            Ok(())
        );
        // An allowOut range wins over a denyOut name.
        let both = policy(&["198.51.100.0/24"], &[ALL_TRAFFIC], false);
        assert_eq!(both.check_name(&op, "b.example.com", 443), Ok(()));
        assert_eq!(
            both.check_address(&op, "b.example.com", 443, ip("198.51.100.9"), &[]),
            Ok(())
        );
        assert!(
            both.check_address(&op, "b.example.com", 443, ip("203.0.113.9"), &[])
                .is_err()
        );
    }

    #[test]
    fn bad_entries_and_rules_are_refused_with_what_is_wrong() {
        let bad = |egress: Egress| egress.validate().unwrap_err();
        for entry in [
            "",
            "a b",
            "*.",
            "x/y",
            "host:0",
            "host:99999",
            "10.0.0.0/8:80",
            "*:80",
        ] {
            let why = bad(Egress {
                allow_out: vec![entry.into()],
                ..Default::default()
            });
            assert!(why.starts_with("allowOut:"), "{entry:?}: {why}");
        }
        let many = Egress {
            deny_out: vec!["a.com".into(); MAX_ENTRIES + 1],
            ..Default::default()
        };
        assert!(bad(many).contains("at most"));
        let rule = |host: &str, name: &str, value: &str| Egress {
            rules: BTreeMap::from([(
                host.to_string(),
                vec![EgressRule {
                    transform: Some(Transform {
                        headers: BTreeMap::from([(name.to_string(), value.to_string())]),
                    }),
                }],
            )]),
            ..Default::default()
        };
        assert!(
            rule("api.x.com", "Authorization", "Bearer ${secrets.k}")
                .validate()
                .is_ok()
        );
        assert!(bad(rule("*", "A", "b")).contains("not a host"));
        assert!(bad(rule("api.x.com", "Bad Name", "b")).contains("not a header name"));
        assert!(bad(rule("api.x.com", "Host", "b")).contains("may not set"));
        assert!(bad(rule("api.x.com", "Content-Length", "1")).contains("may not set"));
        assert!(bad(rule("api.x.com", "A", "b\r\nX: y")).contains("one line"));
        assert!(bad(rule("api.x.com", "A", "${secrets.a b}")).contains("not a secret name"));
        assert!(
            bad(rule("api.x.com", "A", &"x".repeat(MAX_HEADER_VALUE + 1))).contains("one line")
        );
        // Unknown fields are refused, both spellings of the lists are taken.
        assert!(serde_json::from_str::<Egress>(r#"{"allowOut": [], "bogus": 1}"#).is_err());
        let e: Egress =
            serde_json::from_str(r#"{"allow_out": ["a.com"], "denyOut": ["*"]}"#).unwrap();
        assert_eq!((e.allow_out.len(), e.deny_out.len()), (1, 1));
    }

    #[test]
    fn rule_headers_match_their_hosts_and_placeholders_fill_from_secrets() {
        let egress: Egress = serde_json::from_str(
            r#"{"rules": {"api.x.com": [{"transform": {"headers": {"Authorization": "Bearer ${e2b.secrets.key}"}}}],
                          "*.y.com": [{"transform": {"headers": {"X-Token": "${secrets.tok}-${other}"}}}, {}]}}"#,
        )
        .unwrap();
        assert_eq!(egress.secret_names(), ["tok", "key"]);
        let policy = EgressPolicy::new(EgressGrant {
            rules: egress,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(
            policy.headers_for("API.x.com."),
            [(
                "Authorization".to_string(),
                "Bearer ${e2b.secrets.key}".to_string()
            )]
        );
        assert!(policy.has_rules_for("a.y.com"));
        assert!(!policy.has_rules_for("y.com"));
        assert!(!policy.has_rules_for("x.com"));
        let filled = fill(
            "Bearer ${e2b.secrets.key} ${secrets.tok} ${other} ${open",
            |name| Ok(format!("<{name}>")),
        )
        .unwrap();
        assert_eq!(filled, "Bearer <key> <tok> ${other} ${open");
        assert_eq!(
            fill("${secrets.gone}", |name| Err(format!("no {name}"))),
            Err("no gone".to_string())
        );
        assert!(secret_name_ok("openai-api-key.v2_x"));
        for bad in ["", "a b", "a{", "a}", "é", &"a".repeat(129)] {
            assert!(!secret_name_ok(bad), "{bad:?}");
        }
    }
}
