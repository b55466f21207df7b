//! # A sandbox's network: `--net allow=LIST`
//!
//! A sandbox without an allowlist gets a new network namespace with loopback only (runc
//! creates it). A sandbox with one gets a namespace made here, joined by runc
//! ([`crate::spec::SpecInput::netns`]), with a veth to the host, NAT, and egress filtered on
//! the host side to exactly its list.
//!
//! ## The allowlist ([`parse_allowlist`])
//! ```text
//! LIST  = ENTRY { "," ENTRY }
//! ENTRY = ADDR [ "/" PREFIX ] [ ":" PORT [ "/" ( "tcp" | "udp" ) ] ]
//! ```
//! `ADDR` is a dotted IPv4 address; no prefix is `/32`; the address must have no host bits
//! set past the prefix (`10.0.0.1/8` is refused: say `10.0.0.0/8`). `PORT` is 1–65535; a port
//! without a protocol means TCP and UDP; no port means every protocol and port (ICMP too).
//! At most [`MAX_RULES`] entries. **IPv4 only**: an IPv6 entry is refused, and every IPv6
//! packet of a sandbox is dropped.
//!
//! ## Addresses ([`slot_addrs`])
//! Sandboxes live in [`BLOCK`] = `10.213.0.0/16`, one `/30` per *slot* (the manager hands out
//! slots, `0..MAX_SLOTS`): slot `n` owns `10.213.0.0 + 4n`, its host side (the sandbox's
//! gateway) is `+1`, the sandbox's `eth0` is `+2`. The host side of the veth is named
//! `sx<n>` ([`host_if`]); every interface named `sx*` is a sandbox's (nothing else on the
//! host may use the prefix). The namespace is a bind mount of an nsfs file at
//! `<run_dir>/netns/<id>` ([`netns_path`]).
//!
//! ## The filter: `table inet strata` on the host
//! The sandbox cannot change it (it is not in the sandbox's namespace, and the sandbox has no
//! `CAP_NET_ADMIN` anyway).
//! ```text
//! forward  (hook forward)  iifname "sx*" → sandbox_out ; oifname "sx*" → sandbox_in
//! input    (hook input)    iifname "sx*" → sandbox_host
//! sandbox_out   non-IPv4 drop; out to another sx* drop; to 10.213.0.0/16 drop;
//!               ct related accept; iifname vmap @out  (→ out_sx<n>); drop
//! sandbox_in    ct established,related accept; drop     (nothing outside opens a connection)
//! sandbox_host  non-IPv4 drop; ct direction reply accept (the host's own connections in);
//!               ct related accept; iifname vmap @host (→ host_sx<n>); drop
//! postrouting   (nat) ip saddr 10.213.0.0/16 oifname != "sx*" masquerade
//! out_sx<n>     ip saddr != <sandbox> drop; one accept per rule
//! host_sx<n>    ip saddr != <sandbox> drop; 10.213.0.0/16 but its own gateway drop;
//!               one accept per single-address (/32) rule
//! ```
//! What follows, for a sandbox's packets:
//! - It reaches exactly its rules. The rules are matched on every packet it sends, not only
//!   on a connection's first: after [`update`] removes a destination, even the connections
//!   already open to it stop.
//! - **Reserved ranges** ([`RESERVED`]: 0/8, 10/8, 100.64/10, 127/8, 169.254/16, 172.16/12,
//!   192.168/16, 224/4, 240/4) are reached only through a rule whose network lies entirely
//!   inside one of them (`10.1.2.3:80`, `192.168.0.0/24`): a broader rule (`0.0.0.0/0`,
//!   `8.0.0.0/6`) matches only outside them.
//! - **The host** (every address of the host: the gateway, other interfaces' addresses, other
//!   sandboxes' gateways — all of it arrives on the input hook, whatever the address) is
//!   reached only through a rule naming that address as a single address (`/32`), and never
//!   at another sandbox's gateway. A port scan of the host from inside finds nothing.
//! - **Other sandboxes** are never reached, whatever the rules say (their block is dropped
//!   before the rules, and so is anything forwarded from one `sx*` to another).
//! - Replies come back (conntrack); nothing outside can open a connection into a sandbox;
//!   the host itself can (the output hook is not filtered).
//! - DNS is not special: the sandbox's resolv.conf is empty; a resolver is reached only if
//!   listed.
//!
//! ## Atomicity and restarts
//! Every change is one `nft -f` transaction: [`setup`] and [`update`] (re)declare the table's
//! skeleton (base chains flushed and refilled, the reserved set refilled — no effect on any
//! sandbox), flush that sandbox's two chains and fill them, and map its interface to them;
//! the kernel applies all of it or nothing, so no packet ever sees a half-written list, and
//! no other sandbox's chains are touched. [`teardown`] removes one sandbox's map entries and
//! chains, again in one transaction. The table lives in the kernel, not in the daemon: a
//! daemon restart finds it as it was (nothing to redo); a host reboot loses it together
//! with the sandboxes. Until its map entries exist, an `sx*` interface is dropped entirely.
//!
//! ## What the caller owns
//! Slots: one sandbox per slot at a time; [`teardown`] trusts the `(id, slot)` it is given
//! (the veth and chains are the slot's, the namespace file the id's). [`setup`] refuses a
//! slot whose `sx<n>` exists or an id whose namespace file exists ([`Error::Conflict`]),
//! and waits (≤ 1 s, typically) until both ends of the veth are operationally up.
//!
//! ## What the daemon does to the host
//! [`setup`] turns on `net.ipv4.ip_forward` (and leaves it on); other tables with a `drop`
//! policy on the forward hook (Docker's, a host firewall) must also let `sx*` through.

use std::fmt;
use std::io::Write;
use std::net::Ipv4Addr;
use std::os::fd::AsFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The block sandboxes' addresses come from: `10.213.0.0/16`.
pub const BLOCK: Ipv4Net = Ipv4Net {
    addr: Ipv4Addr::new(10, 213, 0, 0),
    prefix: 16,
};

/// Slots `0..MAX_SLOTS`: one `/30` of [`BLOCK`] each.
pub const MAX_SLOTS: u32 = 1 << (32 - 16 - 2);

/// The most entries an allowlist may have.
pub const MAX_RULES: usize = 256;

/// The nftables table (family `inet`) holding every sandbox's filter.
pub const TABLE: &str = "strata";

/// The prefix of the host side of every sandbox's veth.
pub const IF_PREFIX: &str = "sx";

/// Ranges a broad rule never opens (see the module docs).
pub const RESERVED: [Ipv4Net; 9] = [
    net(0, 0, 0, 0, 8),
    net(10, 0, 0, 0, 8),
    net(100, 64, 0, 0, 10),
    net(127, 0, 0, 0, 8),
    net(169, 254, 0, 0, 16),
    net(172, 16, 0, 0, 12),
    net(192, 168, 0, 0, 16),
    net(224, 0, 0, 0, 4),
    net(240, 0, 0, 0, 4),
];

const fn net(a: u8, b: u8, c: u8, d: u8, prefix: u8) -> Ipv4Net {
    Ipv4Net {
        addr: Ipv4Addr::new(a, b, c, d),
        prefix,
    }
}

/// An IPv4 network: an address with no bits set past its prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ipv4Net {
    addr: Ipv4Addr,
    prefix: u8,
}

impl Ipv4Net {
    /// `addr/prefix`; `None` if `prefix > 32` or `addr` has host bits set.
    pub fn new(addr: Ipv4Addr, prefix: u8) -> Option<Self> {
        if prefix > 32 || u32::from(addr) & !mask(prefix) != 0 {
            return None;
        }
        Some(Ipv4Net { addr, prefix })
    }

    pub fn addr(&self) -> Ipv4Addr {
        self.addr
    }

    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    /// Whether `a` is in this network.
    pub fn contains(&self, a: Ipv4Addr) -> bool {
        u32::from(a) & mask(self.prefix) == u32::from(self.addr)
    }

    /// Whether all of `other` is in this network.
    pub fn contains_net(&self, other: &Ipv4Net) -> bool {
        other.prefix >= self.prefix && self.contains(other.addr)
    }
}

fn mask(prefix: u8) -> u32 {
    if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(prefix.min(32)))
    }
}

impl fmt::Display for Ipv4Net {
    /// `a.b.c.d/p` (`/32` too).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// A transport protocol a rule may name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Proto {
    Tcp,
    Udp,
}

impl Proto {
    fn as_str(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        }
    }
}

/// One allowlist entry: a destination network, and optionally a port and protocol.
///
/// `port: None` is every port and protocol; `port: Some(_), proto: None` is TCP and UDP;
/// `port: None, proto: Some(p)` (not writable in the text form) is every port of `p`.
/// Serialized as its text form (`10.0.0.0/8:443/tcp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Rule {
    pub net: Ipv4Net,
    pub port: Option<u16>,
    pub proto: Option<Proto>,
}

impl Rule {
    /// Whether the rule opens reserved ranges it lies in (it lies entirely inside one).
    fn is_explicit(&self) -> bool {
        RESERVED.iter().any(|r| r.contains_net(&self.net))
    }

    /// The nft match of the rule's destination and ports (no verdict).
    fn nft_match(&self) -> String {
        let mut s = if self.net.prefix == 32 {
            format!("ip daddr {}", self.net.addr)
        } else {
            format!("ip daddr {}", self.net)
        };
        match (self.port, self.proto) {
            (Some(p), Some(proto)) => s.push_str(&format!(" {} dport {p}", proto.as_str())),
            (Some(p), None) => s.push_str(&format!(" meta l4proto {{ tcp, udp }} th dport {p}")),
            (None, Some(proto)) => s.push_str(&format!(" meta l4proto {}", proto.as_str())),
            (None, None) => {}
        }
        s
    }
}

impl fmt::Display for Rule {
    /// The text form, which [`parse_allowlist`] reads back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.net.addr)?;
        if self.net.prefix != 32 {
            write!(f, "/{}", self.net.prefix)?;
        }
        if let Some(p) = self.port {
            write!(f, ":{p}")?;
            if let Some(proto) = self.proto {
                write!(f, "/{}", proto.as_str())?;
            }
        }
        Ok(())
    }
}

impl FromStr for Rule {
    type Err = Error;

    /// One entry (`ADDR[/PREFIX][:PORT[/PROTO]]`).
    fn from_str(s: &str) -> Result<Rule> {
        parse_rule(s)
    }
}

impl TryFrom<String> for Rule {
    type Error = Error;

    fn try_from(s: String) -> Result<Rule> {
        parse_rule(&s)
    }
}

impl From<Rule> for String {
    fn from(r: Rule) -> String {
        r.to_string()
    }
}

fn parse_rule(entry: &str) -> Result<Rule> {
    let bad = |why: &str| Error::InvalidSpec(format!("allowlist entry {entry:?}: {why}"));
    let e = entry.trim();
    if e.is_empty() {
        return Err(bad("empty entry"));
    }
    if e.contains('[') || e.matches(':').count() > 1 {
        return Err(bad("IPv6 is not supported (IPv4 only)"));
    }
    let (net_part, port_part) = match e.split_once(':') {
        Some((n, p)) => (n, Some(p)),
        None => (e, None),
    };
    let (addr_s, prefix_s) = match net_part.split_once('/') {
        Some((a, p)) => (a, Some(p)),
        None => (net_part, None),
    };
    let addr = Ipv4Addr::from_str(addr_s)
        .map_err(|_| bad(&format!("{addr_s:?} is not an IPv4 address (a.b.c.d)")))?;
    let prefix = match prefix_s {
        None => 32,
        Some(p) => match p.parse::<u8>() {
            Ok(n) if n <= 32 && !p.starts_with('+') => n,
            _ => return Err(bad(&format!("prefix {p:?} is not 0-32"))),
        },
    };
    let Some(net) = Ipv4Net::new(addr, prefix) else {
        let masked = Ipv4Addr::from(u32::from(addr) & mask(prefix));
        return Err(bad(&format!(
            "host bits set past /{prefix} (the network is {masked}/{prefix})"
        )));
    };
    let (port, proto) = match port_part {
        None => (None, None),
        Some(pp) => {
            let (port_s, proto_s) = match pp.split_once('/') {
                Some((a, b)) => (a, Some(b)),
                None => (pp, None),
            };
            let port = match port_s.parse::<u16>() {
                Ok(n) if n > 0 && !port_s.starts_with('+') => n,
                _ => return Err(bad(&format!("port {port_s:?} is not 1-65535"))),
            };
            let proto = match proto_s.map(str::to_ascii_lowercase).as_deref() {
                None => None,
                Some("tcp") => Some(Proto::Tcp),
                Some("udp") => Some(Proto::Udp),
                Some(other) => return Err(bad(&format!("protocol {other:?} is not tcp or udp"))),
            };
            (Some(port), proto)
        }
    };
    Ok(Rule { net, port, proto })
}

/// The rules of `s`, a comma-separated list of `CIDR[:port[/proto]]` (module docs). Spaces
/// around entries are ignored; an empty list or entry is refused.
pub fn parse_allowlist(s: &str) -> Result<Vec<Rule>> {
    if s.trim().is_empty() {
        return Err(Error::InvalidSpec(
            "empty allowlist (a sandbox without network is --net none)".into(),
        ));
    }
    let rules = s.split(',').map(parse_rule).collect::<Result<Vec<_>>>()?;
    check_count(&rules)?;
    Ok(rules)
}

/// `rules` as text, which [`parse_allowlist`] reads back.
pub fn format_allowlist(rules: &[Rule]) -> String {
    rules
        .iter()
        .map(Rule::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

fn check_count(rules: &[Rule]) -> Result<()> {
    if rules.len() > MAX_RULES {
        return Err(Error::Limit(format!(
            "{} allowlist entries (at most {MAX_RULES})",
            rules.len()
        )));
    }
    Ok(())
}

/// A sandbox's network, as [`setup`] made it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxNet {
    pub id: String,
    pub slot: u32,
    /// The namespace runc joins (`<run_dir>/netns/<id>`).
    pub netns: PathBuf,
    /// The host side of the veth (`sx<slot>`).
    pub host_if: String,
    /// The sandbox's `eth0` address (in a `/30`).
    pub sandbox_addr: Ipv4Addr,
    /// The host side's address: the sandbox's default route.
    pub gateway: Ipv4Addr,
}

/// The host side's name of slot `slot`'s veth.
pub fn host_if(slot: u32) -> String {
    format!("{IF_PREFIX}{slot}")
}

/// Whether slot `slot`'s veth exists on the host: the slot is taken, by this node or by
/// another node daemon of the same machine (the host's interfaces are the one table every
/// node sees).
pub fn slot_taken(slot: u32) -> bool {
    Path::new("/sys/class/net").join(host_if(slot)).exists()
}

/// Where sandbox `id`'s namespace is bind-mounted.
pub fn netns_path(run_dir: &Path, id: &str) -> PathBuf {
    run_dir.join("netns").join(id)
}

/// `(gateway, sandbox)` of slot `slot`; slots past [`BLOCK`] are refused.
pub fn slot_addrs(slot: u32) -> Result<(Ipv4Addr, Ipv4Addr)> {
    if slot >= MAX_SLOTS {
        return Err(Error::Limit(format!(
            "network slot {slot} is past {BLOCK} (at most {MAX_SLOTS} sandboxes with a network)"
        )));
    }
    let base = u32::from(BLOCK.addr) + 4 * slot;
    Ok((Ipv4Addr::from(base + 1), Ipv4Addr::from(base + 2)))
}

fn check_id(id: &str) -> Result<()> {
    if !crate::manager::valid_id(id) {
        return Err(Error::InvalidSpec(format!("invalid sandbox id {id:?}")));
    }
    Ok(())
}

/// Give sandbox `id` a namespace with a veth on slot `slot` and egress filtered to `rules`
/// (module docs). Blocking. On failure, what was made is removed again.
pub fn setup(run_dir: &Path, id: &str, slot: u32, rules: &[Rule]) -> Result<SandboxNet> {
    check_id(id)?;
    check_count(rules)?;
    let (gateway, sandbox_addr) = slot_addrs(slot)?;
    let net = SandboxNet {
        id: id.to_owned(),
        slot,
        netns: netns_path(run_dir, id),
        host_if: host_if(slot),
        sandbox_addr,
        gateway,
    };
    if link_exists(&net.host_if)? {
        return Err(Error::Conflict(format!(
            "interface {} exists: network slot {slot} is in use (or a leftover: tear it down)",
            net.host_if
        )));
    }
    if std::fs::symlink_metadata(&net.netns).is_ok() {
        return Err(Error::Conflict(format!(
            "{} exists (a leftover network of sandbox {id}? tear it down)",
            net.netns.display()
        )));
    }
    enable_forwarding()?;
    // The filter first: the interface is covered from its first packet.
    if let Err(e) = install(&net, rules).and_then(|()| plumb(&net)) {
        if let Err(t) = teardown(run_dir, id, slot) {
            tracing::warn!(
                sandbox = id,
                "network setup failed, and so did its cleanup: {t}"
            );
        }
        return Err(e);
    }
    Ok(net)
}

/// The namespace, the veth, the addresses and routes of `net`.
fn plumb(net: &SandboxNet) -> Result<()> {
    create_netns(&net.netns)?;
    let ns = path_str(&net.netns)?;
    let hif = net.host_if.as_str();
    ip(&[
        "link", "add", hif, "type", "veth", "peer", "name", "eth0", "netns", ns,
    ])?;
    // No IPv6 on either end (its packets are dropped anyway; no link-local chatter).
    let _ = write_sysctl(&format!("net/ipv6/conf/{hif}/disable_ipv6"), "1");
    ip(&["addr", "add", &format!("{}/30", net.gateway), "dev", hif])?;
    ip(&["link", "set", hif, "up"])?;
    let (addr, gw) = (format!("{}/30", net.sandbox_addr), net.gateway.to_string());
    in_netns(&net.netns, || {
        for k in ["all", "default", "eth0"] {
            let _ = write_sysctl(&format!("net/ipv6/conf/{k}/disable_ipv6"), "1");
        }
        ip(&["link", "set", "lo", "up"])?;
        ip(&["addr", "add", &addr, "dev", "eth0"])?;
        ip(&["link", "set", "eth0", "up"])?;
        ip(&["route", "add", "default", "via", &gw, "dev", "eth0"])?;
        wait_up("eth0")
    })??;
    wait_up(hif)
}

/// Wait until `dev` is operationally up: the kernel's link watcher activates a device's queue
/// (up to a second after its carrier came on); until then, what it sends is dropped.
fn wait_up(dev: &str) -> Result<()> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        if run("ip", &["-o", "link", "show", "dev", dev], None)?.contains(" state UP ") {
            return Ok(());
        }
        if std::time::Instant::now() > deadline {
            return Err(Error::Runtime(format!("{dev} did not come up within 5 s")));
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Replace the rules of `net` with `rules`, atomically (one nft transaction). Blocking.
pub fn update(run_dir: &Path, net: &SandboxNet, rules: &[Rule]) -> Result<()> {
    check_count(rules)?;
    if net.netns != netns_path(run_dir, &net.id) || slot_addrs(net.slot)?.1 != net.sandbox_addr {
        return Err(Error::InvalidSpec(format!(
            "network of sandbox {} does not match its slot {}",
            net.id, net.slot
        )));
    }
    if !net.netns.exists() {
        return Err(Error::NotFound(format!(
            "sandbox {} has no network ({} is gone)",
            net.id,
            net.netns.display()
        )));
    }
    install(net, rules)
}

/// Remove sandbox `id`'s network on slot `slot`: its veth, its chains and map entries, its
/// namespace's bind mount and file. What is gone already is fine (leftovers after a crash);
/// other sandboxes are not touched. Every step is tried; the first failure is returned.
pub fn teardown(run_dir: &Path, id: &str, slot: u32) -> Result<()> {
    check_id(id)?;
    slot_addrs(slot)?;
    let hif = host_if(slot);
    let mut first: Option<Error> = None;
    let mut note = |r: Result<()>| {
        if let Err(e) = r {
            first.get_or_insert(e);
        }
    };
    // Deleting the host side deletes the pair.
    note(link_exists(&hif).and_then(|there| {
        if there {
            ip(&["link", "del", &hif])
        } else {
            Ok(())
        }
    }));
    note(table_exists().and_then(|there| {
        if !there {
            return Ok(());
        }
        let (o, h) = (format!("out_{hif}"), format!("host_{hif}"));
        // Adding first makes each delete valid whether or not the thing was there.
        nft_apply(&format!(
            "add chain inet {TABLE} {o}\nadd chain inet {TABLE} {h}\n\
             add element inet {TABLE} out {{ \"{hif}\" : jump {o} }}\n\
             add element inet {TABLE} host {{ \"{hif}\" : jump {h} }}\n\
             delete element inet {TABLE} out {{ \"{hif}\" }}\n\
             delete element inet {TABLE} host {{ \"{hif}\" }}\n\
             delete chain inet {TABLE} {o}\ndelete chain inet {TABLE} {h}\n"
        ))
    }));
    note(remove_netns(&netns_path(run_dir, id)));
    first.map_or(Ok(()), Err)
}

/// Delete the whole table if no sandbox has chains in it any more; whether it did. For tests
/// and uninstalling (a running daemon needs nothing of this).
pub fn remove_table_if_unused() -> Result<bool> {
    if !table_exists()? {
        return Ok(false);
    }
    let listing = nft(&["list", "table", "inet", TABLE], None)?;
    if listing.contains(&format!("chain out_{IF_PREFIX}"))
        || listing.contains(&format!("chain host_{IF_PREFIX}"))
    {
        return Ok(false);
    }
    nft(&["delete", "table", "inet", TABLE], None)?;
    Ok(true)
}

/// The table's skeleton, declared so that applying it again changes nothing but its own
/// base chains' and set's contents (each flushed and refilled in the same transaction).
fn skeleton() -> String {
    let reserved = RESERVED
        .iter()
        .map(Ipv4Net::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    let t = TABLE;
    let sx = format!("\"{IF_PREFIX}*\"");
    let block = BLOCK;
    let base = |name: &str, hook: Option<&str>| match hook {
        Some(h) => format!("add chain inet {t} {name} {{ {h}; }}\nflush chain inet {t} {name}\n"),
        None => format!("add chain inet {t} {name}\nflush chain inet {t} {name}\n"),
    };
    let mut s = format!(
        "add table inet {t}\n\
         add set inet {t} reserved {{ type ipv4_addr; flags interval; }}\n\
         flush set inet {t} reserved\n\
         add element inet {t} reserved {{ {reserved} }}\n\
         add map inet {t} out {{ type ifname : verdict; }}\n\
         add map inet {t} host {{ type ifname : verdict; }}\n"
    );
    for c in ["sandbox_out", "sandbox_in", "sandbox_host"] {
        s.push_str(&base(c, None));
    }
    s.push_str(&base(
        "forward",
        Some("type filter hook forward priority filter; policy accept"),
    ));
    s.push_str(&base(
        "input",
        Some("type filter hook input priority filter; policy accept"),
    ));
    s.push_str(&base(
        "postrouting",
        Some("type nat hook postrouting priority srcnat; policy accept"),
    ));
    for (chain, rule) in [
        ("forward", format!("iifname {sx} goto sandbox_out")),
        ("forward", format!("oifname {sx} goto sandbox_in")),
        ("input", format!("iifname {sx} goto sandbox_host")),
        ("sandbox_out", "meta nfproto != ipv4 drop".to_owned()),
        ("sandbox_out", format!("oifname {sx} drop")),
        ("sandbox_out", format!("ip daddr {block} drop")),
        ("sandbox_out", "ct state related accept".to_owned()),
        ("sandbox_out", "iifname vmap @out".to_owned()),
        ("sandbox_out", "drop".to_owned()),
        (
            "sandbox_in",
            "ct state established,related accept".to_owned(),
        ),
        ("sandbox_in", "drop".to_owned()),
        ("sandbox_host", "meta nfproto != ipv4 drop".to_owned()),
        ("sandbox_host", "ct direction reply accept".to_owned()),
        ("sandbox_host", "ct state related accept".to_owned()),
        ("sandbox_host", "iifname vmap @host".to_owned()),
        ("sandbox_host", "drop".to_owned()),
        (
            "postrouting",
            format!("ip saddr {block} oifname != {sx} masquerade"),
        ),
    ] {
        s.push_str(&format!("add rule inet {t} {chain} {rule}\n"));
    }
    s
}

/// The nft transaction giving `net` exactly `rules` (with the skeleton).
fn transaction(net: &SandboxNet, rules: &[Rule]) -> String {
    let t = TABLE;
    let hif = &net.host_if;
    let (o, h) = (format!("out_{hif}"), format!("host_{hif}"));
    let mut s = skeleton();
    for c in [&o, &h] {
        s.push_str(&format!(
            "add chain inet {t} {c}\nflush chain inet {t} {c}\n"
        ));
    }
    let mut rule = |chain: &str, r: String| s.push_str(&format!("add rule inet {t} {chain} {r}\n"));
    for c in [&o, &h] {
        rule(c, format!("ip saddr != {} drop", net.sandbox_addr));
    }
    rule(
        &h,
        format!("ip daddr {BLOCK} ip daddr != {} drop", net.gateway),
    );
    for r in rules {
        let m = r.nft_match();
        if r.is_explicit() {
            rule(&o, format!("{m} accept"));
        } else {
            rule(&o, format!("ip daddr != @reserved {m} accept"));
        }
        if r.net.prefix == 32 {
            rule(&h, format!("{m} accept"));
        }
    }
    s.push_str(&format!(
        "add element inet {t} out {{ \"{hif}\" : jump {o} }}\n\
         add element inet {t} host {{ \"{hif}\" : jump {h} }}\n"
    ));
    s
}

fn install(net: &SandboxNet, rules: &[Rule]) -> Result<()> {
    nft_apply(&transaction(net, rules))
}

/// Create a network namespace (loopback down, nothing else) bind-mounted at `path`, a new
/// file. Blocking. The namespace lives until [`remove_netns`] and its last process.
pub fn create_netns(path: &Path) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir)
            .map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
    }
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o444)
        .open(path)
    {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            return Err(Error::Conflict(format!("{} exists", path.display())))
        }
        Err(e) => return Err(Error::io(format!("create {}", path.display()), e)),
    }
    let made = std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: NEWNET only moves this thread (which exits right after) into a new
            // network namespace; no file descriptor table or memory is unshared, so no
            // other thread can observe anything inconsistent.
            unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::NEWNET) }
                .map_err(|e| Error::io("unshare(CLONE_NEWNET)", e.into()))?;
            rustix::mount::mount_bind("/proc/thread-self/ns/net", path).map_err(|e| {
                Error::io(
                    format!("bind the new namespace at {}", path.display()),
                    e.into(),
                )
            })
        })
        .join()
        .unwrap_or_else(|_| Err(Error::Runtime("namespace thread panicked".into())))
    });
    if made.is_err() {
        let _ = std::fs::remove_file(path);
    }
    made
}

/// Unmount and remove a namespace file made by [`create_netns`]; a missing one is fine.
pub fn remove_netns(path: &Path) -> Result<()> {
    match rustix::mount::unmount(path, rustix::mount::UnmountFlags::DETACH) {
        Ok(()) | Err(rustix::io::Errno::INVAL) | Err(rustix::io::Errno::NOENT) => {}
        Err(e) => return Err(Error::io(format!("unmount {}", path.display()), e.into())),
    }
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io(format!("remove {}", path.display()), e)),
    }
}

/// Run `f` on a thread inside the network namespace at `path` (sockets it opens, processes
/// it spawns, `/proc/sys/net` it writes are that namespace's). Blocking.
pub fn in_netns<T: Send>(path: &Path, f: impl FnOnce() -> T + Send) -> Result<T> {
    let ns =
        std::fs::File::open(path).map_err(|e| Error::io(format!("open {}", path.display()), e))?;
    std::thread::scope(|s| {
        s.spawn(|| {
            rustix::thread::move_into_link_name_space(
                ns.as_fd(),
                Some(rustix::thread::LinkNameSpaceType::Network),
            )
            .map_err(|e| Error::io(format!("setns {}", path.display()), e.into()))?;
            Ok(f())
        })
        .join()
        .unwrap_or_else(|_| Err(Error::Runtime("namespace thread panicked".into())))
    })
}

fn enable_forwarding() -> Result<()> {
    let p = "/proc/sys/net/ipv4/ip_forward";
    match std::fs::read_to_string(p) {
        Ok(v) if v.trim() == "1" => Ok(()),
        _ => write_sysctl("net/ipv4/ip_forward", "1"),
    }
}

fn write_sysctl(key: &str, value: &str) -> Result<()> {
    let p = format!("/proc/sys/{key}");
    std::fs::write(&p, value).map_err(|e| Error::io(format!("write {p}"), e))
}

fn path_str(p: &Path) -> Result<&str> {
    p.to_str()
        .ok_or_else(|| Error::InvalidSpec(format!("{} is not UTF-8", p.display())))
}

fn link_exists(name: &str) -> Result<bool> {
    let out = Command::new("ip")
        .args(["link", "show", "dev", name])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| Error::io("run ip (is iproute2 installed?)", e))?;
    Ok(out.status.success())
}

fn table_exists() -> Result<bool> {
    let out = Command::new("nft")
        .args(["list", "table", "inet", TABLE])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| Error::io("run nft (is nftables installed?)", e))?;
    Ok(out.status.success())
}

fn ip(args: &[&str]) -> Result<()> {
    run("ip", args, None).map(|_| ())
}

fn nft(args: &[&str], stdin: Option<&str>) -> Result<String> {
    run("nft", args, stdin)
}

/// Apply `script` as one nft transaction.
fn nft_apply(script: &str) -> Result<()> {
    nft(&["-f", "-"], Some(script)).map(|_| ())
}

/// Run `program args`, feeding it `stdin`; its stdout, or an error with its stderr.
fn run(program: &str, args: &[&str], stdin: Option<&str>) -> Result<String> {
    let mut child = Command::new(program)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| Error::io(format!("run {program}"), e))?;
    if let (Some(text), Some(mut w)) = (stdin, child.stdin.take()) {
        // A child that exits early closes the pipe; its status and stderr tell why.
        let _ = w.write_all(text.as_bytes());
    }
    let out = child
        .wait_with_output()
        .map_err(|e| Error::io(format!("wait for {program}"), e))?;
    if !out.status.success() {
        return Err(Error::Runtime(format!(
            "{program} {}: {} ({})",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim(),
            out.status
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(s: &str) -> Rule {
        let v = parse_allowlist(s).unwrap();
        assert_eq!(v.len(), 1, "{s}");
        v[0]
    }

    #[test]
    fn entries_parse_as_documented() {
        let r = one("1.2.3.4");
        assert_eq!(r.net, Ipv4Net::new(Ipv4Addr::new(1, 2, 3, 4), 32).unwrap());
        assert_eq!((r.port, r.proto), (None, None));
        let r = one("10.0.0.0/8:443/tcp");
        assert_eq!(
            (r.net.addr(), r.net.prefix()),
            (Ipv4Addr::new(10, 0, 0, 0), 8)
        );
        assert_eq!((r.port, r.proto), (Some(443), Some(Proto::Tcp)));
        let r = one("0.0.0.0/0:53");
        assert_eq!((r.net.prefix(), r.port, r.proto), (0, Some(53), None));
        assert_eq!(one(" 8.8.8.8:53/UDP ").proto, Some(Proto::Udp));
        let v = parse_allowlist("1.1.1.1:53/udp, 192.168.1.0/24,10.1.2.3:8080").unwrap();
        assert_eq!(v.len(), 3);
        for s in [
            "1.2.3.4",
            "10.0.0.0/8:443/tcp",
            "0.0.0.0/0:53",
            "9.9.9.9:53/udp",
        ] {
            assert_eq!(one(s).to_string(), s);
        }
        let text = "1.1.1.1:53/udp,192.168.1.0/24,10.1.2.3:8080";
        assert_eq!(format_allowlist(&parse_allowlist(text).unwrap()), text);
        let json = serde_json::to_string(&v).unwrap();
        assert_eq!(
            json,
            r#"["1.1.1.1:53/udp","192.168.1.0/24","10.1.2.3:8080"]"#
        );
        assert_eq!(serde_json::from_str::<Vec<Rule>>(&json).unwrap(), v);
        assert!(serde_json::from_str::<Rule>(r#""1.2.3.4:0""#).is_err());
    }

    #[test]
    fn bad_entries_are_refused_with_a_reason() {
        for (s, why) in [
            ("", "empty allowlist"),
            ("  ", "empty allowlist"),
            ("1.2.3.4,", "empty entry"),
            (",1.2.3.4", "empty entry"),
            ("1.2.3.4,,5.6.7.8", "empty entry"),
            ("1.2.3", "not an IPv4 address"),
            ("1.2.3.4.5", "not an IPv4 address"),
            ("256.1.1.1", "not an IPv4 address"),
            ("01.2.3.4", "not an IPv4 address"),
            ("example.com:80", "not an IPv4 address"),
            ("/8", "not an IPv4 address"),
            ("10.0.0.0/33", "not 0-32"),
            ("10.0.0.0/-1", "not 0-32"),
            ("10.0.0.0/+8", "not 0-32"),
            ("10.0.0.0/", "not 0-32"),
            (
                "10.0.0.1/8",
                "host bits set past /8 (the network is 10.0.0.0/8)",
            ),
            ("1.2.3.4:", "not 1-65535"),
            ("1.2.3.4:0", "not 1-65535"),
            ("1.2.3.4:65536", "not 1-65535"),
            ("1.2.3.4:+80", "not 1-65535"),
            ("1.2.3.4:80-90", "not 1-65535"),
            ("1.2.3.4:http", "not 1-65535"),
            ("1.2.3.4:80/sctp", "not tcp or udp"),
            ("1.2.3.4:80/", "not tcp or udp"),
            ("1.2.3.4/tcp", "not 0-32"),
            ("::1", "IPv6"),
            ("[2001:db8::1]:443", "IPv6"),
            ("2001:db8::/32", "IPv6"),
            ("1.2.3.4:80:90", "IPv6"),
        ] {
            match parse_allowlist(s) {
                Err(Error::InvalidSpec(m)) => assert!(m.contains(why), "{s:?}: {m}"),
                other => panic!("{s:?}: {other:?}"),
            }
        }
        let many = vec!["1.2.3.4"; MAX_RULES + 1].join(",");
        assert!(matches!(parse_allowlist(&many), Err(Error::Limit(_))));
        assert!(parse_allowlist(&vec!["1.2.3.4"; MAX_RULES].join(",")).is_ok());
    }

    #[test]
    fn slots_map_to_their_own_30() {
        assert_eq!(
            slot_addrs(0).unwrap(),
            (Ipv4Addr::new(10, 213, 0, 1), Ipv4Addr::new(10, 213, 0, 2))
        );
        assert_eq!(
            slot_addrs(64).unwrap(),
            (Ipv4Addr::new(10, 213, 1, 1), Ipv4Addr::new(10, 213, 1, 2))
        );
        assert_eq!(
            slot_addrs(MAX_SLOTS - 1).unwrap(),
            (
                Ipv4Addr::new(10, 213, 255, 253),
                Ipv4Addr::new(10, 213, 255, 254)
            )
        );
        assert!(matches!(slot_addrs(MAX_SLOTS), Err(Error::Limit(_))));
        assert!(host_if(MAX_SLOTS - 1).len() <= 15);
        assert!(matches!(
            setup(Path::new("/nonexistent"), "../x", 0, &[]),
            Err(Error::InvalidSpec(_))
        ));
    }

    #[test]
    fn broad_rules_do_not_open_reserved_ranges() {
        let explicit = ["10.214.0.2:80", "192.168.0.0/24", "10.0.0.0/8", "127.0.0.1"];
        for s in explicit {
            assert!(one(s).is_explicit(), "{s}");
        }
        for s in ["0.0.0.0/0", "8.0.0.0/6", "1.1.1.1:53", "10.0.0.0/7"] {
            assert!(!one(s).is_explicit(), "{s}");
        }
        let net = SandboxNet {
            id: "a".into(),
            slot: 1,
            netns: "/x".into(),
            host_if: host_if(1),
            sandbox_addr: Ipv4Addr::new(10, 213, 0, 6),
            gateway: Ipv4Addr::new(10, 213, 0, 5),
        };
        let t = transaction(
            &net,
            &parse_allowlist("0.0.0.0/0,10.1.2.3:80/tcp,1.2.3.4:53").unwrap(),
        );
        for line in [
            "add rule inet strata out_sx1 ip daddr != @reserved ip daddr 0.0.0.0/0 accept",
            "add rule inet strata out_sx1 ip daddr 10.1.2.3 tcp dport 80 accept",
            "add rule inet strata host_sx1 ip daddr 10.1.2.3 tcp dport 80 accept",
            "add rule inet strata out_sx1 ip daddr != @reserved ip daddr 1.2.3.4 meta l4proto { tcp, udp } th dport 53 accept",
            "add rule inet strata host_sx1 ip daddr 1.2.3.4 meta l4proto { tcp, udp } th dport 53 accept",
            "add rule inet strata host_sx1 ip daddr 10.213.0.0/16 ip daddr != 10.213.0.5 drop",
            "add element inet strata out { \"sx1\" : jump out_sx1 }",
        ] {
            assert!(t.lines().any(|l| l == line), "missing {line:?} in\n{t}");
        }
        assert!(!t.contains("host_sx1 ip daddr != @reserved ip daddr 0.0.0.0/0"));
    }
}
