//! The nftables ruleset as data: tables, chains, rules, sets, maps and elements, plus the
//! transaction operations that change them, and their `nft -f` text.
//!
//! Rules are a short list of [`Expr`] pieces, each one of the few forms kube-proxy uses. The
//! same value is printed for `nft -f`, evaluated by the [`tracer`](super::tracer), and kept
//! (as a hash) by the [`apply`](super::apply) layer to tell what changed.

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;

use crate::model::{IpFamily, Protocol, ServicePortName};

/// `ip` or `ip6`: the nftables family of a table.
pub fn nft_family(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "ip",
        IpFamily::V6 => "ip6",
    }
}

/// `ip` or `ip6`: the payload protocol keyword for addresses.
fn addr_keyword(family: IpFamily) -> &'static str {
    nft_family(family)
}

/// A verdict.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// `jump <chain>`: run the chain, come back.
    Jump(String),
    /// `goto <chain>`: run the chain, do not come back.
    Goto(String),
    /// `drop`.
    Drop,
    /// `reject` (ICMP port unreachable / TCP reset).
    Reject,
    /// `return`.
    Return,
    /// `accept`.
    Accept,
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verdict::Jump(c) => write!(f, "jump {c}"),
            Verdict::Goto(c) => write!(f, "goto {c}"),
            Verdict::Drop => f.write_str("drop"),
            Verdict::Reject => f.write_str("reject"),
            Verdict::Return => f.write_str("return"),
            Verdict::Accept => f.write_str("accept"),
        }
    }
}

/// What an address is compared with.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum AddrMatch {
    /// One address.
    Addr(IpAddr),
    /// A prefix.
    Net(IpNet),
    /// A named set (`@name`).
    Set(String),
    /// An anonymous set of prefixes (`{ a, b }`).
    Nets(Vec<IpNet>),
}

/// The key of a verdict-map lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MapKey {
    /// `ip daddr . meta l4proto . th dport`.
    DaddrProtoPort,
    /// `meta l4proto . th dport`.
    ProtoPort,
}

/// The key of a plain set lookup (flat layout).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LookupKey {
    /// `ip daddr . meta l4proto . th dport`.
    DaddrProtoPort,
    /// `meta l4proto . th dport`.
    ProtoPort,
    /// `ip saddr . ip daddr`.
    SaddrDaddr,
    /// `ip daddr . meta l4proto . th dport . ip saddr` (an interval set: the source is
    /// matched against prefixes).
    DaddrProtoPortSaddr,
    /// `ct original ip daddr`: the destination before DNAT (flat layout's affinity record).
    OrigDaddr,
    /// `ct original ip daddr . meta l4proto . ct original proto-dst`.
    OrigDaddrProtoPort,
    /// `meta l4proto . ct original proto-dst`.
    ProtoOrigPort,
}

/// Which of the flat layout's session-affinity maps a rule reads or writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AffinityKey {
    /// `ip saddr . ip daddr . meta l4proto . th dport`: a client of a ClusterIP, external or
    /// load-balancer IP.
    Dst,
    /// `ip saddr . meta l4proto . th dport`: a client of a NodePort, whatever the node
    /// address it used.
    NodePort,
}

/// The conntrack field a [`Expr::Ct`] match tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CtKey {
    /// `ct state`: one bit per state (`NF_CT_STATE_*_BIT`; `invalid` and `untracked` for
    /// packets without a conntrack entry).
    State,
    /// `ct status`: the entry's `IPS_*` status bits (`dnat`, `snat`, ...).
    Status,
}

/// `ct state` bits (linux/netfilter/nf_conntrack_common.h, `NF_CT_STATE_BIT`).
pub mod ct_state {
    /// No conntrack entry and not untracked.
    pub const INVALID: u32 = 1;
    /// `IP_CT_ESTABLISHED`.
    pub const ESTABLISHED: u32 = 1 << 1;
    /// `IP_CT_RELATED`.
    pub const RELATED: u32 = 1 << 2;
    /// `IP_CT_NEW`.
    pub const NEW: u32 = 1 << 3;
    /// `NF_CT_STATE_UNTRACKED_BIT` (`notrack`).
    pub const UNTRACKED: u32 = 1 << 6;
}

/// `ct status` bits (`IPS_*` in linux/netfilter/nf_conntrack_common.h).
pub mod ct_status {
    /// `IPS_SRC_NAT`.
    pub const SNAT: u32 = 1 << 4;
    /// `IPS_DST_NAT`: the connection was DNATed.
    pub const DNAT: u32 = 1 << 5;
}

impl CtKey {
    fn as_str(self) -> &'static str {
        match self {
            CtKey::State => "state",
            CtKey::Status => "status",
        }
    }

    /// The bit names nft prints, lowest bit first.
    fn names(self) -> &'static [(u32, &'static str)] {
        match self {
            CtKey::State => &[
                (ct_state::INVALID, "invalid"),
                (ct_state::ESTABLISHED, "established"),
                (ct_state::RELATED, "related"),
                (ct_state::NEW, "new"),
                (ct_state::UNTRACKED, "untracked"),
            ],
            CtKey::Status => &[(ct_status::SNAT, "snat"), (ct_status::DNAT, "dnat")],
        }
    }
}

/// One piece of a rule: a match or a statement, in nft's left-to-right order.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Expr {
    /// `ct state new`.
    CtStateNew,
    /// `ct <key> <bits>` (any of `bits` set) or `ct <key> ! <bits>` (none of them set), as
    /// nft lists a bitmask match: `ct state ! established,related`, `ct status ! dnat`.
    ///
    /// nf_tables only has a `ct state` for packets without a conntrack entry (`invalid`,
    /// `untracked`); every other key makes such a packet fail the match, whatever the
    /// negation: `ct status ! dnat` never matches an untracked packet.
    Ct {
        /// The field.
        key: CtKey,
        /// True: none of `bits` may be set (`!`); false: at least one must be.
        negate: bool,
        /// The bits, a union of [`ct_state`] or [`ct_status`] constants.
        bits: u32,
    },
    /// `ip daddr [!=] <match>`.
    Daddr {
        /// Negated (`!=`).
        negate: bool,
        /// Compared with.
        value: AddrMatch,
    },
    /// `ip saddr [!=] <match>`.
    Saddr {
        /// Negated (`!=`).
        negate: bool,
        /// Compared with.
        value: AddrMatch,
    },
    /// `tcp dport 80` (older kube-proxy wrote it in ClusterIP masquerade rules).
    Dport(Protocol, u16),
    /// `fib saddr type local`: the source is an address of this node.
    FibSaddrLocal,
    /// `fib daddr type local`: the destination is an address of this node.
    FibDaddrLocal,
    /// `mark and <mask> == 0`.
    MarkUnset(u32),
    /// `numgen random mod <modulus> <value>`: true with probability 1/modulus.
    NumgenIs {
        /// Modulus.
        modulus: u32,
        /// Value compared with (always 0 here).
        value: u32,
    },
    /// `... vmap @<map>`: the packet's key looked up in a named verdict map.
    VerdictMap {
        /// The key.
        key: MapKey,
        /// The map.
        map: String,
    },
    /// `<key> @<set>` or `<key> != @<set>`: the packet's key looked up in a named set.
    Lookup {
        /// The key.
        key: LookupKey,
        /// Negated (`!=`): matches when the key is not in the set.
        negate: bool,
        /// The set.
        set: String,
    },
    /// `dnat ip to <key> . numgen random mod <modulus> offset <offset> map @<map>`: DNAT to
    /// the `addr . port` the map holds for the packet's key and a random slot; no match
    /// (the rule does nothing) when the map has no such element. The flat layout's endpoint
    /// choice.
    DnatMap {
        /// The key before the slot.
        key: MapKey,
        /// `numgen random mod`.
        modulus: u32,
        /// `offset`.
        offset: u32,
        /// The data map.
        map: String,
    },
    /// `numgen random mod N vmap { 0 : goto a, 1 : goto b }`: kube-proxy's inline form, kept
    /// for comparison (see [`EndpointChoice`](crate::config::EndpointChoice)).
    NumgenVmap(Vec<String>),
    /// `mark set mark or <bits>`.
    MarkSetOr(u32),
    /// `mark set mark xor <bits>`.
    MarkSetXor(u32),
    /// `masquerade fully-random`.
    Masquerade,
    /// `meta l4proto <p> dnat to <ip:port>`.
    Dnat(Protocol, SocketAddr),
    /// `update @<set> { ip saddr }`: remember the client for session affinity.
    UpdateSaddr(String),
    /// `meta l4proto <p>`.
    L4proto(Protocol),
    /// `dnat ip to <client key> map @<map>`: DNAT to the endpoint the flat layout's affinity
    /// map remembers for this client and destination; no match when it remembers none.
    AffinityDnat {
        /// The key.
        key: AffinityKey,
        /// The dynamic map.
        map: String,
    },
    /// `update @<map> { <client key from ct original> : ip daddr . th dport }`: remember the
    /// endpoint a new connection was DNATed to (in a chain after DNAT).
    AffinityUpdate {
        /// The key.
        key: AffinityKey,
        /// The dynamic map.
        map: String,
    },
    /// A verdict.
    Verdict(Verdict),
}

/// A rule: pieces and an optional comment.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Rule {
    /// The pieces, in order.
    pub exprs: Vec<Expr>,
    /// `comment "..."`.
    pub comment: Option<String>,
}

impl Rule {
    /// A rule without a comment.
    pub fn new(exprs: Vec<Expr>) -> Self {
        Rule {
            exprs,
            comment: None,
        }
    }

    /// A rule with a comment.
    pub fn commented(exprs: Vec<Expr>, comment: &str) -> Self {
        Rule {
            exprs,
            comment: Some(comment.to_string()),
        }
    }

    /// The rule's text in `family`, without the `add rule <table> <chain>` prefix.
    pub fn text(&self, family: IpFamily) -> String {
        let mut out = String::new();
        for (i, e) in self.exprs.iter().enumerate() {
            if i > 0 {
                out.push(' ');
            }
            write_expr(&mut out, e, family);
        }
        if let Some(c) = &self.comment {
            let _ = write!(out, " comment {}", quote(c));
        }
        out
    }
}

fn write_addr_match(out: &mut String, m: &AddrMatch) {
    match m {
        AddrMatch::Addr(ip) => {
            let _ = write!(out, "{ip}");
        }
        AddrMatch::Net(net) => {
            let _ = write!(out, "{net}");
        }
        AddrMatch::Set(name) => {
            let _ = write!(out, "@{name}");
        }
        AddrMatch::Nets(nets) => {
            out.push_str("{ ");
            for (i, n) in nets.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                if n.prefix_len() == n.max_prefix_len() {
                    let _ = write!(out, "{}", n.addr());
                } else {
                    let _ = write!(out, "{n}");
                }
            }
            out.push_str(" }");
        }
    }
}

fn write_expr(out: &mut String, e: &Expr, family: IpFamily) {
    let ip = addr_keyword(family);
    match e {
        Expr::CtStateNew => out.push_str("ct state new"),
        Expr::Ct { key, negate, bits } => {
            let _ = write!(out, "ct {} ", key.as_str());
            if *negate {
                out.push_str("! ");
            }
            let names: Vec<&str> = key
                .names()
                .iter()
                .filter(|(bit, _)| bits & bit != 0)
                .map(|(_, name)| *name)
                .collect();
            debug_assert_eq!(
                names.len(),
                bits.count_ones() as usize,
                "every bit of a ct match has a name"
            );
            out.push_str(&names.join(","));
        }
        Expr::Daddr { negate, value } | Expr::Saddr { negate, value } => {
            let field = if matches!(e, Expr::Daddr { .. }) {
                "daddr"
            } else {
                "saddr"
            };
            let _ = write!(out, "{ip} {field} ");
            if *negate {
                out.push_str("!= ");
            }
            write_addr_match(out, value);
        }
        Expr::Dport(p, port) => {
            let _ = write!(out, "{} dport {port}", p.as_lower());
        }
        Expr::FibSaddrLocal => out.push_str("fib saddr type local"),
        Expr::FibDaddrLocal => out.push_str("fib daddr type local"),
        Expr::MarkUnset(mask) => {
            let _ = write!(out, "mark and {mask:#x} == 0");
        }
        Expr::NumgenIs { modulus, value } => {
            let _ = write!(out, "numgen random mod {modulus} {value}");
        }
        Expr::VerdictMap { key, map } => {
            match key {
                MapKey::DaddrProtoPort => {
                    let _ = write!(out, "{ip} daddr . meta l4proto . th dport");
                }
                MapKey::ProtoPort => out.push_str("meta l4proto . th dport"),
            }
            let _ = write!(out, " vmap @{map}");
        }
        Expr::Lookup { key, negate, set } => {
            match key {
                LookupKey::DaddrProtoPort => {
                    let _ = write!(out, "{ip} daddr . meta l4proto . th dport");
                }
                LookupKey::ProtoPort => out.push_str("meta l4proto . th dport"),
                LookupKey::SaddrDaddr => {
                    let _ = write!(out, "{ip} saddr . {ip} daddr");
                }
                LookupKey::DaddrProtoPortSaddr => {
                    let _ = write!(out, "{ip} daddr . meta l4proto . th dport . {ip} saddr");
                }
                LookupKey::OrigDaddr => {
                    let _ = write!(out, "ct original {ip} daddr");
                }
                LookupKey::OrigDaddrProtoPort => {
                    let _ = write!(
                        out,
                        "ct original {ip} daddr . meta l4proto . ct original proto-dst"
                    );
                }
                LookupKey::ProtoOrigPort => out.push_str("meta l4proto . ct original proto-dst"),
            }
            let _ = write!(out, " {}@{set}", if *negate { "!= " } else { "" });
        }
        Expr::DnatMap {
            key,
            modulus,
            offset,
            map,
        } => {
            let _ = write!(out, "dnat {ip} to ");
            match key {
                MapKey::DaddrProtoPort => {
                    let _ = write!(out, "{ip} daddr . meta l4proto . th dport");
                }
                MapKey::ProtoPort => out.push_str("meta l4proto . th dport"),
            }
            let _ = write!(out, " . numgen random mod {modulus}");
            if *offset != 0 {
                let _ = write!(out, " offset {offset}");
            }
            let _ = write!(out, " map @{map}");
        }
        Expr::NumgenVmap(targets) => {
            let _ = write!(out, "numgen random mod {} vmap {{ ", targets.len());
            for (i, t) in targets.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                let _ = write!(out, "{i} : goto {t}");
            }
            out.push_str(" }");
        }
        Expr::MarkSetOr(bits) => {
            let _ = write!(out, "mark set mark or {bits:#x}");
        }
        Expr::MarkSetXor(bits) => {
            let _ = write!(out, "mark set mark xor {bits:#x}");
        }
        Expr::Masquerade => out.push_str("masquerade fully-random"),
        Expr::Dnat(p, to) => {
            let _ = write!(out, "meta l4proto {} dnat to {to}", p.as_lower());
        }
        Expr::UpdateSaddr(set) => {
            let _ = write!(out, "update @{set} {{ {ip} saddr }}");
        }
        Expr::L4proto(p) => {
            let _ = write!(out, "meta l4proto {}", p.as_lower());
        }
        Expr::AffinityDnat { key, map } => {
            let _ = write!(out, "dnat {ip} to {ip} saddr . ");
            if *key == AffinityKey::Dst {
                let _ = write!(out, "{ip} daddr . ");
            }
            let _ = write!(out, "meta l4proto . th dport map @{map}");
        }
        Expr::AffinityUpdate { key, map } => {
            let _ = write!(out, "update @{map} {{ ct original {ip} saddr . ");
            if *key == AffinityKey::Dst {
                let _ = write!(out, "ct original {ip} daddr . ");
            }
            let _ = write!(
                out,
                "meta l4proto . ct original proto-dst : {ip} daddr . th dport }}"
            );
        }
        Expr::Verdict(v) => {
            let _ = write!(out, "{v}");
        }
    }
}

/// Quotes a comment for nft (double quotes; embedded quotes cannot be escaped in nft's
/// grammar, so they are replaced).
pub fn quote(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "'"))
}

/// Netfilter hook of a base chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Hook {
    /// Before routing.
    Prerouting,
    /// Locally delivered.
    Input,
    /// Routed through.
    Forward,
    /// Locally generated.
    Output,
    /// After routing.
    Postrouting,
}

impl Hook {
    fn as_str(self) -> &'static str {
        match self {
            Hook::Prerouting => "prerouting",
            Hook::Input => "input",
            Hook::Forward => "forward",
            Hook::Output => "output",
            Hook::Postrouting => "postrouting",
        }
    }
}

/// `filter` or `nat`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChainType {
    /// `type filter`.
    Filter,
    /// `type nat`.
    Nat,
}

/// What makes a chain a base chain.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BaseHook {
    /// Chain type.
    pub kind: ChainType,
    /// Hook.
    pub hook: Hook,
    /// Numeric priority (`dstnat` = -100, `filter` = 0, `srcnat` = 100).
    pub priority: i32,
}

impl BaseHook {
    /// The priority as nft prints it: named where nft 1.0 accepts the name for this hook.
    pub fn priority_text(&self) -> String {
        let named = |name: &str, base: i32| match self.priority - base {
            0 => name.to_string(),
            d if d > 0 => format!("{name} + {d}"),
            d => format!("{name} - {}", -d),
        };
        match (self.hook, self.kind) {
            (Hook::Prerouting, _) => named("dstnat", -100),
            (Hook::Postrouting, _) => named("srcnat", 100),
            (_, ChainType::Filter) if self.priority == 0 => "filter".to_string(),
            _ => self.priority.to_string(),
        }
    }
}

/// A chain and its rules.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Chain {
    /// Name.
    pub name: String,
    /// Base-chain hook, if any.
    pub base: Option<BaseHook>,
    /// Rules in order.
    pub rules: Vec<Rule>,
}

impl Chain {
    /// A regular chain.
    pub fn regular(name: impl Into<String>, rules: Vec<Rule>) -> Self {
        Chain {
            name: name.into(),
            base: None,
            rules,
        }
    }
}

/// Key type of a set or map.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeyType {
    /// `ipv4_addr` / `ipv6_addr`.
    Addr,
    /// `ipv4_addr . inet_proto . inet_service`.
    AddrProtoPort,
    /// `inet_proto . inet_service`.
    ProtoPort,
    /// `ipv4_addr . ipv4_addr` (flat layout: hairpin source and destination).
    AddrAddr,
    /// `ipv4_addr . inet_proto . inet_service . ipv4_addr` with `flags interval` (flat
    /// layout: load-balancer destinations and the source ranges they admit).
    AddrProtoPortNet,
    /// `typeof ip daddr . meta l4proto . th dport . numgen random mod 1`: a destination and
    /// an endpoint slot (flat layout's endpoint maps, data `ip daddr . th dport`).
    AddrProtoPortSlot,
    /// `typeof meta l4proto . th dport . numgen random mod 1` (flat layout, NodePorts).
    ProtoPortSlot,
    /// `ipv4_addr . ipv4_addr . inet_proto . inet_service : ipv4_addr . inet_service`: a
    /// client and a destination, to the endpoint it was sent to (flat layout's affinity).
    AffinityDst,
    /// `ipv4_addr . inet_proto . inet_service : ipv4_addr . inet_service`: a client and a
    /// NodePort, to its endpoint.
    AffinityNodePort,
}

impl KeyType {
    /// Whether this key is written with `typeof` (a map to endpoints, `addr . port` data).
    pub fn is_slot(self) -> bool {
        matches!(self, KeyType::AddrProtoPortSlot | KeyType::ProtoPortSlot)
    }

    /// Whether this is a session-affinity map (`addr . port` data, filled by the kernel).
    pub fn is_affinity(self) -> bool {
        matches!(self, KeyType::AffinityDst | KeyType::AffinityNodePort)
    }

    /// Whether the set holds intervals (`flags interval`).
    pub fn is_interval(self) -> bool {
        matches!(self, KeyType::AddrProtoPortNet)
    }
}

/// A named set or verdict map.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Set {
    /// Name.
    pub name: String,
    /// Key type.
    pub key: KeyType,
    /// A verdict map (`: verdict`) rather than a set.
    pub verdict_map: bool,
    /// Dynamic set with this timeout in seconds (session affinity).
    pub timeout: Option<u32>,
    /// `comment`.
    pub comment: Option<String>,
    /// `size`: the most elements the kernel accepts (`None`: no limit is set).
    pub size: Option<u32>,
}

impl Set {
    /// Whether this is one of the flat layout's endpoint maps (`typeof ... : ip daddr . th
    /// dport`). nft 1.0.6 cannot add a rule that looks up such a map when it reads the map's
    /// definition from the kernel rather than from the same input ("conflicting protocols
    /// specified: ip vs. th"), so a full sync re-creates them instead of emptying them: then
    /// it also works when it goes through `nft -f`.
    pub fn has_endpoint_data(&self) -> bool {
        matches!(
            self.key,
            KeyType::AddrProtoPortSlot | KeyType::ProtoPortSlot
        )
    }

    /// The `{ type ... ; }` body of `add set` / `add map`.
    pub fn spec_text(&self, family: IpFamily) -> String {
        let addr = match family {
            IpFamily::V4 => "ipv4_addr",
            IpFamily::V6 => "ipv6_addr",
        };
        let ip = addr_keyword(family);
        let key = match self.key {
            KeyType::Addr => addr.to_string(),
            KeyType::AddrProtoPort => format!("{addr} . inet_proto . inet_service"),
            KeyType::ProtoPort => "inet_proto . inet_service".to_string(),
            KeyType::AddrAddr => format!("{addr} . {addr}"),
            KeyType::AddrProtoPortNet => format!("{addr} . inet_proto . inet_service . {addr}"),
            KeyType::AddrProtoPortSlot => format!(
                "{ip} daddr . meta l4proto . th dport . numgen random mod 1 : {ip} daddr . th dport"
            ),
            KeyType::ProtoPortSlot => {
                format!("meta l4proto . th dport . numgen random mod 1 : {ip} daddr . th dport")
            }
            // `type`, not `typeof`: nft 1.0.6 cannot add the `dnat ... map` rule when it reads
            // a `typeof` map's definition from the kernel (see `has_endpoint_data`), and
            // these maps are kept across full syncs, not re-created.
            KeyType::AffinityDst => {
                format!("{addr} . {addr} . inet_proto . inet_service : {addr} . inet_service")
            }
            KeyType::AffinityNodePort => {
                format!("{addr} . inet_proto . inet_service : {addr} . inet_service")
            }
        };
        let mut out = if self.key.is_slot() {
            format!("{{ typeof {key}")
        } else {
            format!("{{ type {key}")
        };
        if self.verdict_map {
            out.push_str(" : verdict");
        }
        out.push_str(" ;");
        if self.key.is_interval() {
            out.push_str(" flags interval ;");
        }
        if let Some(n) = self.size {
            let _ = write!(out, " size {n} ;");
        }
        if let Some(t) = self.timeout {
            let _ = write!(out, " flags dynamic,timeout ; timeout {t}s ;");
        }
        if let Some(c) = &self.comment {
            let _ = write!(out, " comment {} ;", quote(c));
        }
        out.push_str(" }");
        out
    }

    /// `set` or `map`.
    pub fn keyword(&self) -> &'static str {
        if self.is_map() { "map" } else { "set" }
    }

    /// A map (verdict or data), listed and flushed as `map`.
    pub fn is_map(&self) -> bool {
        self.verdict_map || self.key.is_slot() || self.key.is_affinity()
    }
}

/// The key of an element.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ElemKey {
    /// An address.
    Addr(IpAddr),
    /// `addr . proto . port`.
    AddrProtoPort(IpAddr, Protocol, u16),
    /// `proto . port`.
    ProtoPort(Protocol, u16),
    /// `addr . addr`.
    AddrAddr(IpAddr, IpAddr),
    /// `addr . proto . port . prefix`.
    AddrProtoPortNet(IpAddr, Protocol, u16, IpNet),
    /// `addr . proto . port . slot`.
    AddrProtoPortSlot(IpAddr, Protocol, u16, u32),
    /// `proto . port . slot`.
    ProtoPortSlot(Protocol, u16, u32),
    /// `addr . addr . proto . port` (a client and a destination).
    AddrAddrProtoPort(IpAddr, IpAddr, Protocol, u16),
}

impl fmt::Display for ElemKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ElemKey::Addr(ip) => write!(f, "{ip}"),
            ElemKey::AddrProtoPort(ip, p, port) => write!(f, "{ip} . {} . {port}", p.as_lower()),
            ElemKey::ProtoPort(p, port) => write!(f, "{} . {port}", p.as_lower()),
            ElemKey::AddrAddr(a, b) => write!(f, "{a} . {b}"),
            ElemKey::AddrProtoPortNet(ip, p, port, net) => {
                write!(f, "{ip} . {} . {port} . ", p.as_lower())?;
                if net.prefix_len() == net.max_prefix_len() {
                    write!(f, "{}", net.addr())
                } else {
                    write!(f, "{}", net.trunc())
                }
            }
            ElemKey::AddrProtoPortSlot(ip, p, port, slot) => {
                write!(f, "{ip} . {} . {port} . {slot}", p.as_lower())
            }
            ElemKey::ProtoPortSlot(p, port, slot) => {
                write!(f, "{} . {port} . {slot}", p.as_lower())
            }
            ElemKey::AddrAddrProtoPort(a, b, p, port) => {
                write!(f, "{a} . {b} . {} . {port}", p.as_lower())
            }
        }
    }
}

/// One element of a set or map.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Element {
    /// The set or map.
    pub set: &'static str,
    /// Key.
    pub key: ElemKey,
    /// Verdict, for verdict maps.
    pub value: Option<Verdict>,
    /// `addr . port`, for the flat layout's endpoint maps.
    pub data: Option<SocketAddr>,
    /// `comment` (kube-proxy names the service port on no-endpoint elements). Shared: the
    /// flat layout puts one Service port's comment on each of its elements.
    pub comment: Option<std::sync::Arc<str>>,
}

impl Element {
    /// `{ key [comment "c"] [: verdict] }`.
    pub fn text(&self) -> String {
        let mut out = format!("{{ {}", self.key);
        if let Some(c) = &self.comment {
            let _ = write!(out, " comment {}", quote(c));
        }
        if let Some(v) = &self.value {
            let _ = write!(out, " : {v}");
        }
        if let Some(d) = &self.data {
            let _ = write!(out, " : {} . {}", d.ip(), d.port());
        }
        out.push_str(" }");
        out
    }
}

/// The objects of one service port in one table.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct ServiceObjects {
    /// `service-`, `local-`, `external-`, `firewall-`, `endpoint-` chains.
    pub chains: Vec<Chain>,
    /// `affinity-` sets.
    pub sets: Vec<Set>,
    /// Elements in the shared sets and maps.
    pub elements: Vec<Element>,
}

/// The objects every table has whatever the Services: base chains, helper chains, the
/// shared sets and maps, and elements that depend on the node only.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct BaseObjects {
    /// Sets and maps, in creation order.
    pub sets: Vec<Set>,
    /// Chains with their rules.
    pub chains: Vec<Chain>,
    /// Elements (`nodeport-ips`).
    pub elements: Vec<Element>,
}

/// One table (`ip kube-proxy` or `ip6 kube-proxy`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table {
    /// Family.
    pub family: IpFamily,
    /// Static objects.
    pub base: BaseObjects,
    /// Per service port objects.
    pub services: BTreeMap<ServicePortName, ServiceObjects>,
}

/// Everything the proxy programs.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Ruleset {
    /// One table per enabled family.
    pub tables: Vec<Table>,
}

impl Ruleset {
    /// The table of a family.
    pub fn table(&self, family: IpFamily) -> Option<&Table> {
        self.tables.iter().find(|t| t.family == family)
    }
}

impl Table {
    /// Every chain of the table, base objects first.
    pub fn chains(&self) -> impl Iterator<Item = &Chain> {
        self.base
            .chains
            .iter()
            .chain(self.services.values().flat_map(|s| s.chains.iter()))
    }

    /// Looks a chain up by name.
    pub fn chain(&self, name: &str) -> Option<&Chain> {
        self.chains().find(|c| c.name == name)
    }

    /// Every set and map.
    pub fn sets(&self) -> impl Iterator<Item = &Set> {
        self.base
            .sets
            .iter()
            .chain(self.services.values().flat_map(|s| s.sets.iter()))
    }

    /// Every element, base first. When two service ports claim the same key, the first (in
    /// service-port order) wins, as the apply layer resolves it.
    pub fn elements(&self) -> Vec<&Element> {
        let mut seen = std::collections::HashSet::new();
        self.base
            .elements
            .iter()
            .chain(self.services.values().flat_map(|s| s.elements.iter()))
            .filter(|e| seen.insert((e.set, e.key)))
            .collect()
    }
}

/// One operation of a transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// `add table` (no-op if it exists).
    AddTable,
    /// `delete table`.
    DeleteTable,
    /// `add chain` (no-op if it exists; base chains get their hook).
    AddChain(String, Option<BaseHook>),
    /// `flush chain`: remove every rule.
    FlushChain(String),
    /// `delete chain` (must be empty and unreferenced).
    DeleteChain(String),
    /// `add rule` at the end of a chain.
    AddRule(String, Rule),
    /// `add set` / `add map` (no-op if it exists).
    AddSet(Set),
    /// `flush set` / `flush map`.
    FlushSet(String, bool),
    /// `delete set` / `delete map`.
    DeleteSet(String, bool),
    /// `add element`.
    AddElement(Element),
    /// `delete element`.
    DeleteElement(&'static str, ElemKey),
}

/// A transaction on one or both tables, applied all or nothing.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Transaction {
    /// Operations in order, each on the table of its family.
    pub ops: Vec<(IpFamily, Op)>,
}

/// The name of the table in both families.
pub const TABLE: &str = "kube-proxy";

/// The table's comment.
pub const TABLE_COMMENT: &str = "rules for kube-proxy";

impl Transaction {
    /// Appends an operation.
    pub fn push(&mut self, family: IpFamily, op: Op) {
        self.ops.push((family, op));
    }

    /// Number of operations.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Whether there is nothing to do.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// The transaction as `nft -f` input, one command a line (knftables' form).
    pub fn to_nft(&self) -> String {
        let mut out = String::with_capacity(self.ops.len() * 96);
        for (family, op) in &self.ops {
            write_op(&mut out, *family, op);
            out.push('\n');
        }
        out
    }
}

/// Writes one operation as an nft command line.
pub fn write_op(out: &mut String, family: IpFamily, op: &Op) {
    let t = format!("{} {TABLE}", nft_family(family));
    match op {
        Op::AddTable => {
            let _ = write!(
                out,
                "add table {t} {{ comment {} ; }}",
                quote(TABLE_COMMENT)
            );
        }
        Op::DeleteTable => {
            let _ = write!(out, "delete table {t}");
        }
        Op::AddChain(name, None) => {
            let _ = write!(out, "add chain {t} {name}");
        }
        Op::AddChain(name, Some(h)) => {
            let kind = match h.kind {
                ChainType::Filter => "filter",
                ChainType::Nat => "nat",
            };
            let _ = write!(
                out,
                "add chain {t} {name} {{ type {kind} hook {} priority {} ; }}",
                h.hook.as_str(),
                h.priority_text()
            );
        }
        Op::FlushChain(name) => {
            let _ = write!(out, "flush chain {t} {name}");
        }
        Op::DeleteChain(name) => {
            let _ = write!(out, "delete chain {t} {name}");
        }
        Op::AddRule(chain, rule) => {
            let _ = write!(out, "add rule {t} {chain} {}", rule.text(family));
        }
        Op::AddSet(set) => {
            let _ = write!(
                out,
                "add {} {t} {} {}",
                set.keyword(),
                set.name,
                set.spec_text(family)
            );
        }
        Op::FlushSet(name, map) => {
            let _ = write!(out, "flush {} {t} {name}", if *map { "map" } else { "set" });
        }
        Op::DeleteSet(name, map) => {
            let _ = write!(
                out,
                "delete {} {t} {name}",
                if *map { "map" } else { "set" }
            );
        }
        Op::AddElement(e) => {
            let _ = write!(out, "add element {t} {} {}", e.set, e.text());
        }
        Op::DeleteElement(set, key) => {
            let _ = write!(out, "delete element {t} {set} {{ {key} }}");
        }
    }
}

/// The transaction that creates `ruleset` from nothing: what `nodeport render` prints and
/// what a first sync on an empty kernel sends.
pub fn create_all(ruleset: &Ruleset) -> Transaction {
    let mut tx = Transaction::default();
    for table in &ruleset.tables {
        let f = table.family;
        tx.push(f, Op::AddTable);
        for set in table.sets() {
            tx.push(f, Op::AddSet(set.clone()));
        }
        for chain in table.chains() {
            tx.push(f, Op::AddChain(chain.name.clone(), chain.base.clone()));
        }
        for chain in table.chains() {
            for rule in &chain.rules {
                tx.push(f, Op::AddRule(chain.name.clone(), rule.clone()));
            }
        }
        for e in table.elements() {
            tx.push(f, Op::AddElement(e.clone()));
        }
    }
    tx
}
