//! Real packets through nf_tables, for `nodeport trace --live`: a table of the tracer's own
//! that sets `meta nftrace` on the packets asked for, and the trace events the kernel sends
//! for them on the `NFNLGRP_NFTRACE` netlink group, gathered packet by packet.
//!
//! The table (`inet nodeport-trace-<pid>`) is created over the same netlink socket the
//! events are read from, with the owner flag (`NFT_TABLE_F_OWNER`, Linux 5.12): the kernel
//! deletes it when that socket closes, so it goes with the process however the process ends
//! (return, error, Ctrl-C, SIGKILL). It is not in the proxy's `kube-proxy` table, whose full
//! sync flushes every chain. Its two chains, at prerouting and output, priority -150 (after
//! conntrack, -200, so `ct state new` is known; before the proxy's chains, -110 and -100),
//! mark the first packet of each new connection that matches, and what comes back to refuse
//! such a connection (a TCP reset, an ICMP error: [`Refusal`]), which the conntrack id of
//! its trace events ties to the traced packet.
//!
//! Every listener of the group receives every event. The kernel marks a packet once, in the
//! first chain that sets `nftrace`, and each event carries the packet's trace id; the first
//! event of a packet this tracer marked is the rule of its own table, so a packet is this
//! tracer's when it starts there. Events of packets another tracer started are left to it.

use std::collections::HashMap;
use std::net::IpAddr;
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use ipnet::IpNet;
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};

use super::{
    Buf, NFNL_MSG_BATCH_BEGIN, NFNL_MSG_BATCH_END, NFNL_SUBSYS_NFTABLES, NFT_CT_STATE,
    NFT_META_L4PROTO, NFT_MSG_DELTABLE, NFT_MSG_NEWCHAIN, NFT_MSG_NEWRULE, NFT_MSG_NEWTABLE,
    NFT_PAYLOAD_NETWORK_HEADER, NFT_PAYLOAD_TRANSPORT_HEADER, NFTA_CHAIN_HOOK, NFTA_CHAIN_NAME,
    NFTA_CHAIN_TABLE, NFTA_CHAIN_TYPE, NFTA_CT_DREG, NFTA_CT_KEY, NFTA_HOOK_HOOKNUM,
    NFTA_HOOK_PRIORITY, NFTA_META_KEY, NFTA_META_SREG, NFTA_RULE_CHAIN, NFTA_RULE_EXPRESSIONS,
    NFTA_RULE_TABLE, NFTA_TABLE_NAME, NFTA_TABLE_USERDATA, NFTA_VERDICT_CHAIN, NFTA_VERDICT_CODE,
    NLM_F_ACK, NLM_F_APPEND, NLM_F_CREATE, NLM_F_REQUEST, NLMSG_ERROR, REG_1, UDATA_COMMENT,
    addr_field, align4, attr_str, attrs, batch_marker, bitwise, cmp, ct_state, immediate_value,
    ip_bytes, meta_load, payload, prefix_match, proto_number, udata_comment,
};
use crate::model::{IpFamily, Protocol};
use crate::trace::Origin;

/// The netlink multicast group of nf_tables trace events (`NFNLGRP_NFTRACE`).
const NFNLGRP_NFTRACE: u32 = 9;
const NFT_MSG_TRACE: u16 = 17;
const NFPROTO_INET: u8 = 1;
const NFTA_TABLE_FLAGS: u16 = 2;
/// The table belongs to the socket that created it and goes when that socket closes.
const NFT_TABLE_F_OWNER: u32 = 0x2;
const NFT_META_NFTRACE: u32 = 12;
const NFT_META_NFPROTO: u32 = 15;
const HOOK_PREROUTING: u32 = 0;
const HOOK_OUTPUT: u32 = 3;
/// The loopback interface's index, in every network namespace.
const LOOPBACK_IFINDEX: u32 = 1;

// enum nft_trace_attributes (linux/netfilter/nf_tables.h).
const NFTA_TRACE_TABLE: u16 = 1;
const NFTA_TRACE_CHAIN: u16 = 2;
const NFTA_TRACE_RULE_HANDLE: u16 = 3;
const NFTA_TRACE_TYPE: u16 = 4;
const NFTA_TRACE_VERDICT: u16 = 5;
const NFTA_TRACE_ID: u16 = 6;
const NFTA_TRACE_NETWORK_HEADER: u16 = 8;
const NFTA_TRACE_TRANSPORT_HEADER: u16 = 9;
const NFTA_TRACE_IIF: u16 = 10;
const NFTA_TRACE_OIF: u16 = 12;
const NFTA_TRACE_NFPROTO: u16 = 15;
const NFTA_TRACE_POLICY: u16 = 16;
// Linux 6.7: the conntrack entry of the packet (`nf_trace_fill_ct_info`).
const NFTA_TRACE_CT_ID: u16 = 18;
const NFTA_TRACE_CT_DIRECTION: u16 = 19;
const NFT_TRACETYPE_POLICY: u32 = 1;
const NFT_TRACETYPE_RETURN: u32 = 2;
const NFT_TRACETYPE_RULE: u32 = 3;

/// Names of the tracers' tables: this prefix and the tracing process's id.
pub const TABLE_PREFIX: &str = "nodeport-trace-";
/// The priority of the tracer's chains: after conntrack (-200), before the proxy's (-110).
pub const PRIORITY: i32 = -150;
/// The tracer's chain at the prerouting hook (packets from the network).
pub const CHAIN_PREROUTING: &str = "prerouting";
/// The tracer's chain at the output hook (packets of the node's own processes).
pub const CHAIN_OUTPUT: &str = "output";

/// A failure of the live tracer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The netlink socket could not be opened, configured or used.
    #[error("nf_tables netlink socket: {what}")]
    Socket {
        /// What was being done.
        what: &'static str,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
    /// The kernel refused to create (or delete) the tracer's table.
    #[error("nf_tables refused {what} table inet {table}")]
    Refused {
        /// `creating` or `deleting`.
        what: &'static str,
        /// The table's name.
        table: String,
        /// The kernel's error.
        #[source]
        source: std::io::Error,
    },
    /// No acknowledgement came.
    #[error("no answer from nf_tables within {0:?}")]
    Timeout(Duration),
}

fn socket_err(what: &'static str) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Socket { what, source }
}

/// Which packets to trace: the first packet of each new connection to `dport` over
/// `protocol`, to `daddr` if given, from `from` if given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selector {
    /// The protocol.
    pub protocol: Protocol,
    /// The destination port (before DNAT).
    pub dport: u16,
    /// The destination address (before DNAT); any when `None`.
    pub daddr: Option<IpAddr>,
    /// The sources; any when `None`.
    pub from: Option<IpNet>,
}

impl Selector {
    /// The family of the packets that can match (`None`: both).
    fn family(&self) -> Option<IpFamily> {
        self.daddr
            .map(IpFamily::of)
            .or(self.from.map(|n| IpFamily::of(n.addr())))
    }
}

/// A verdict named in a trace event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// `accept` (also what `dnat`, `snat`, `masquerade` return).
    Accept,
    /// `drop` (also what `reject` returns).
    Drop,
    /// The rule matched and evaluation goes on (`counter`, `meta mark set`, ...).
    Continue,
    /// `return`, or the end of a regular chain.
    Return,
    /// `jump` to the chain.
    Jump(String),
    /// `goto` the chain.
    Goto(String),
    /// Another code (`queue`, `stolen`).
    Other(i32),
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Verdict::Accept => f.write_str("accept"),
            Verdict::Drop => f.write_str("drop"),
            Verdict::Continue => f.write_str("continue"),
            Verdict::Return => f.write_str("return"),
            Verdict::Jump(c) => write!(f, "jump {c}"),
            Verdict::Goto(c) => write!(f, "goto {c}"),
            Verdict::Other(code) => write!(f, "verdict {code}"),
        }
    }
}

/// What a trace event reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A rule matched (its verdict may be `continue`).
    Rule,
    /// Evaluation returned from a regular chain.
    Return,
    /// The packet reached the end of a base chain: its policy applies.
    Policy,
    /// A type this tracer does not know.
    Other(u32),
}

/// One nf_tables trace event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The packet's trace id.
    pub id: u32,
    /// What happened.
    pub kind: Kind,
    /// The table's family (`ip`, `ip6`, `inet`, ...).
    pub family: &'static str,
    /// The table.
    pub table: String,
    /// The chain.
    pub chain: String,
    /// The rule's handle (rule events).
    pub handle: Option<u64>,
    /// The rule's verdict, or the chain's policy.
    pub verdict: Option<Verdict>,
    /// The network header as the packet was at this point.
    pub network: Vec<u8>,
    /// The transport header (its first bytes).
    pub transport: Vec<u8>,
    /// The input interface's index.
    pub iif: Option<u32>,
    /// The output interface's index.
    pub oif: Option<u32>,
    /// The id of the packet's conntrack entry (Linux 6.7; the same for both directions of a
    /// connection and for the ICMP errors about it).
    pub ct_id: Option<u32>,
    /// The packet goes in the reply direction of its conntrack entry.
    pub ct_reply: bool,
}

impl Event {
    /// `table ip kube-proxy chain services rule 12: goto ...`, as people read it.
    pub fn describe(&self) -> String {
        let at = format!("{} {} {}", self.family, self.table, self.chain);
        let verdict = self
            .verdict
            .as_ref()
            .map_or_else(|| "?".to_string(), |v| v.to_string());
        match (self.kind, self.handle) {
            (Kind::Rule, Some(h)) => format!("{at} rule {h}: {verdict}"),
            (Kind::Policy, _) => format!("{at}: policy {verdict}"),
            (Kind::Return, _) => format!("{at}: return"),
            _ => format!("{at}: {verdict}"),
        }
    }

    /// Whether the packet ends here.
    pub fn drops(&self) -> bool {
        self.verdict == Some(Verdict::Drop)
    }
}

fn family_name(nfproto: u8) -> &'static str {
    match nfproto {
        1 => "inet",
        2 => "ip",
        3 => "arp",
        5 => "netdev",
        7 => "bridge",
        10 => "ip6",
        _ => "unknown",
    }
}

fn be32(v: &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(v.get(..4)?.try_into().ok()?))
}

fn verdict_of(code: i32, chain: Option<String>) -> Verdict {
    match code {
        -1 => Verdict::Continue,
        -3 => Verdict::Jump(chain.unwrap_or_default()),
        -4 => Verdict::Goto(chain.unwrap_or_default()),
        -5 => Verdict::Return,
        // NF_DROP may carry an errno in its upper bits (NF_DROP_ERR).
        c if c >= 0 && c & 0xff == 0 => Verdict::Drop,
        c if c >= 0 && c & 0xff == 1 => Verdict::Accept,
        c => Verdict::Other(c),
    }
}

/// Reads one `NFT_MSG_TRACE` message (after the netlink header): the `nfgenmsg` and the
/// attributes. `None` when it holds no trace id.
pub fn parse_event(payload: &[u8]) -> Option<Event> {
    let family = family_name(*payload.first()?);
    let mut e = Event {
        id: 0,
        kind: Kind::Other(0),
        family,
        table: String::new(),
        chain: String::new(),
        handle: None,
        verdict: None,
        network: Vec::new(),
        transport: Vec::new(),
        iif: None,
        oif: None,
        ct_id: None,
        ct_reply: false,
    };
    let mut id = None;
    let mut policy = None;
    for (ty, v) in attrs(payload.get(4..)?) {
        match ty {
            NFTA_TRACE_TABLE => e.table = attr_str(v),
            NFTA_TRACE_CHAIN => e.chain = attr_str(v),
            NFTA_TRACE_RULE_HANDLE => {
                e.handle = v
                    .get(..8)
                    .map(|b| u64::from_be_bytes(b.try_into().expect("8")));
            }
            NFTA_TRACE_TYPE => {
                e.kind = match be32(v)? {
                    NFT_TRACETYPE_RULE => Kind::Rule,
                    NFT_TRACETYPE_RETURN => Kind::Return,
                    NFT_TRACETYPE_POLICY => Kind::Policy,
                    other => Kind::Other(other),
                }
            }
            NFTA_TRACE_VERDICT => {
                let mut code = None;
                let mut chain = None;
                for (t, x) in attrs(v) {
                    match t {
                        NFTA_VERDICT_CODE => code = be32(x).map(|c| c as i32),
                        NFTA_VERDICT_CHAIN => chain = Some(attr_str(x)),
                        _ => {}
                    }
                }
                e.verdict = code.map(|c| verdict_of(c, chain));
            }
            NFTA_TRACE_ID => id = be32(v),
            NFTA_TRACE_NETWORK_HEADER => e.network = v.to_vec(),
            NFTA_TRACE_TRANSPORT_HEADER => e.transport = v.to_vec(),
            NFTA_TRACE_IIF => e.iif = be32(v),
            NFTA_TRACE_OIF => e.oif = be32(v),
            NFTA_TRACE_NFPROTO => {}
            NFTA_TRACE_POLICY => policy = be32(v).map(|c| verdict_of(c as i32, None)),
            NFTA_TRACE_CT_ID => e.ct_id = be32(v),
            NFTA_TRACE_CT_DIRECTION => e.ct_reply = v.first() == Some(&1),
            _ => {}
        }
    }
    if e.kind == Kind::Policy {
        e.verdict = policy.or(e.verdict);
    }
    e.id = id?;
    Some(e)
}

/// The addresses and ports of a packet, read from its headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Headers {
    /// Source address.
    pub src: IpAddr,
    /// Destination address.
    pub dst: IpAddr,
    /// Protocol (`None`: not TCP, UDP or SCTP).
    pub protocol: Option<Protocol>,
    /// Source port.
    pub sport: u16,
    /// Destination port.
    pub dport: u16,
}

/// An IPv4 or IPv6 header's source, destination and transport protocol number.
fn addresses_and_protocol(network: &[u8]) -> Option<(IpAddr, IpAddr, u8)> {
    Some(match network.first()? >> 4 {
        4 => {
            let a: [u8; 4] = network.get(12..16)?.try_into().ok()?;
            let b: [u8; 4] = network.get(16..20)?.try_into().ok()?;
            (IpAddr::from(a), IpAddr::from(b), *network.get(9)?)
        }
        6 => {
            let a: [u8; 16] = network.get(8..24)?.try_into().ok()?;
            let b: [u8; 16] = network.get(24..40)?.try_into().ok()?;
            (IpAddr::from(a), IpAddr::from(b), *network.get(6)?)
        }
        _ => return None,
    })
}

/// Reads an IPv4 or IPv6 header and the ports of the transport header after it.
pub fn parse_headers(network: &[u8], transport: &[u8]) -> Option<Headers> {
    let (src, dst, proto) = addresses_and_protocol(network)?;
    let protocol = match proto {
        6 => Some(Protocol::Tcp),
        17 => Some(Protocol::Udp),
        132 => Some(Protocol::Sctp),
        _ => None,
    };
    let port = |at: usize| {
        transport
            .get(at..at + 2)
            .map_or(0, |p| u16::from_be_bytes([p[0], p[1]]))
    };
    Some(Headers {
        src,
        dst,
        protocol,
        sport: port(0),
        dport: port(2),
    })
}

/// What came back to refuse a traced connection: the tracer's table also marks, in the
/// reply direction of a connection to the traced port, TCP resets and ICMP errors (`ct state
/// related`); the conntrack id in their trace events ties them to the traced packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    /// Who sent it: its source as it reached the node (before the node reverses the NAT), so
    /// the endpoint itself, or a router or node on the way.
    pub from: IpAddr,
    /// A TCP reset: its source port (the endpoint's port).
    pub from_port: u16,
    /// Where it was sent (the masqueraded source, or the client).
    pub to: IpAddr,
    /// A TCP reset or an ICMP error.
    pub kind: RefusalKind,
}

/// The packet that refused a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalKind {
    /// A TCP segment with RST: nothing listens on the port, or a firewall rejects with a reset.
    TcpReset,
    /// An ICMP (`v6`: ICMPv6) destination unreachable error with its code.
    Unreachable {
        /// ICMPv6 rather than ICMP.
        v6: bool,
        /// The code (ICMP: 3 port unreachable, 13 administratively prohibited, ...).
        code: u8,
    },
}

impl RefusalKind {
    /// `TCP reset`, `ICMP port unreachable`, `ICMPv6 administratively prohibited`, ...
    pub fn describe(&self) -> String {
        match *self {
            RefusalKind::TcpReset => "a TCP reset".to_string(),
            RefusalKind::Unreachable { v6, code } => {
                let what = match (v6, code) {
                    (false, 0) | (true, 0) => "network unreachable",
                    (false, 1) | (true, 3) => "host unreachable",
                    (false, 2) => "protocol unreachable",
                    (false, 3) | (true, 4) => "port unreachable",
                    (false, 9 | 10 | 13) | (true, 1) => "administratively prohibited",
                    (true, 5) => "source address failed ingress/egress policy",
                    (true, 6) => "reject route to destination",
                    _ => "destination unreachable",
                };
                let family = if v6 { "ICMPv6" } else { "ICMP" };
                format!("{family} {what} (code {code})")
            }
        }
    }

    /// Why such an answer comes, in a few words.
    pub fn cause(&self) -> &'static str {
        match *self {
            RefusalKind::TcpReset => {
                "nothing listens on that port there, or a firewall rejects with a reset"
            }
            RefusalKind::Unreachable { v6, code } => match (v6, code) {
                (false, 3) | (true, 4) => "nothing listens on that port there",
                (false, 9 | 10 | 13) | (true, 1 | 5) => "a firewall rejects it",
                (false, 1) | (true, 3) => "no host answers for the address",
                (false, 0) | (true, 0 | 6) => "no route to the address",
                _ => "the destination cannot be reached",
            },
        }
    }

    /// For tools: `tcp_reset`, `icmp_unreachable`, `icmpv6_unreachable`.
    pub fn as_str(&self) -> &'static str {
        match self {
            RefusalKind::TcpReset => "tcp_reset",
            RefusalKind::Unreachable { v6: false, .. } => "icmp_unreachable",
            RefusalKind::Unreachable { v6: true, .. } => "icmpv6_unreachable",
        }
    }
}

/// Reads a refusal from the headers of a reply-direction packet: a TCP reset, or an ICMP
/// destination unreachable error (ICMP's "fragmentation needed" and ICMPv6's "packet too big"
/// only lower the path MTU: not refusals).
pub fn parse_refusal(network: &[u8], transport: &[u8]) -> Option<Refusal> {
    let (from, to, proto) = addresses_and_protocol(network)?;
    let (kind, from_port) = match (proto, transport.first()?, transport.get(1)?) {
        (6, _, _) if transport.get(13)? & 0x04 != 0 => (
            RefusalKind::TcpReset,
            u16::from_be_bytes([transport[0], transport[1]]),
        ),
        (1, 3, &code) if code != 4 => (RefusalKind::Unreachable { v6: false, code }, 0),
        (58, 1, &code) => (RefusalKind::Unreachable { v6: true, code }, 0),
        _ => return None,
    };
    Some(Refusal {
        from,
        from_port,
        to,
        kind,
    })
}

/// One packet this tracer marked, with every event the kernel sent for it.
#[derive(Debug, Clone)]
pub struct Traced {
    /// The trace id.
    pub id: u32,
    /// Where it came from: the network (the tracer's prerouting chain marked it) or the node
    /// (its output chain).
    pub origin: Origin,
    /// Its headers when marked (before any NAT).
    pub headers: Option<Headers>,
    /// Every event in other tables than the tracers', in order.
    pub events: Vec<Event>,
    /// The id of its conntrack entry (from the kernel's trace event, Linux 6.7).
    pub ct_id: Option<u32>,
    /// What came back to refuse it (a TCP reset, an ICMP error), seen while it was open.
    pub refusal: Option<Refusal>,
    /// When the last event came.
    last: Instant,
}

impl Traced {
    /// The event that dropped the packet (a rule's `drop` or `reject`, or a `drop` policy).
    pub fn dropped_by(&self) -> Option<&Event> {
        self.events.iter().find(|e| e.drops())
    }
}

/// Gathers events into the packets of one tracer's table.
#[derive(Debug)]
pub struct Collector {
    table: String,
    open: HashMap<u32, Traced>,
    /// Trace ids that continue another packet: one of the node's own, looped back (its
    /// trace id changes with the input interface).
    alias: HashMap<u32, u32>,
}

impl Collector {
    /// A collector for the tracer whose table is `table`.
    pub fn new(table: &str) -> Self {
        Collector {
            table: table.to_string(),
            open: HashMap::new(),
            alias: HashMap::new(),
        }
    }

    /// Takes one event. A packet that ends with it (dropped) or that a new packet with the
    /// same trace id replaces is returned, finished.
    pub fn push(&mut self, e: Event, now: Instant) -> Option<Traced> {
        if e.table == self.table {
            // Our rule marked a new packet: its event names the rule (by handle) and, being
            // the first of the chain, carries the packet's headers (the kernel adds them once
            // per base chain). The chain's other events (the end of the chain, the policy)
            // add nothing; a packet another tracer marked crosses our chain with only those.
            let headers = parse_headers(&e.network, &e.transport);
            if e.kind != Kind::Rule || e.handle.is_none() || headers.is_none() {
                return None;
            }
            // Our reply rules marked a reset or an ICMP error coming back: it belongs to the
            // traced packet of the same conntrack entry (a packet that starts a connection is
            // never one: conntrack calls a reset without an entry invalid, not new).
            let refusal = parse_refusal(&e.network, &e.transport);
            if e.ct_reply || refusal.is_some() {
                if let (Some(ct), Some(refusal)) = (e.ct_id, refusal)
                    && let Some(p) = self
                        .open
                        .values_mut()
                        .find(|p| p.ct_id == Some(ct) && p.refusal.is_none())
                {
                    p.refusal = Some(refusal);
                    p.last = now;
                }
                return None;
            }
            let origin = if e.chain == CHAIN_OUTPUT {
                Origin::Local
            } else {
                Origin::Remote
            };
            // The node's own packet back in through loopback: the same packet.
            if origin == Origin::Remote
                && e.iif == Some(LOOPBACK_IFINDEX)
                && let Some(own) = self
                    .open
                    .values()
                    .find(|p| p.origin == Origin::Local && p.headers == headers)
            {
                self.alias.insert(e.id, own.id);
                return None;
            }
            let packet = Traced {
                id: e.id,
                origin,
                headers,
                events: Vec::new(),
                ct_id: e.ct_id,
                refusal: None,
                last: now,
            };
            self.alias.retain(|_, own| *own != e.id);
            return self.open.insert(e.id, packet);
        }
        // Another tracer's table: not part of the path.
        if e.table.starts_with(TABLE_PREFIX) {
            return None;
        }
        let id = self.alias.get(&e.id).copied().unwrap_or(e.id);
        let drops = e.drops();
        let packet = self.open.get_mut(&id)?;
        packet.last = now;
        packet.events.push(e);
        if drops {
            return self.finish(id);
        }
        None
    }

    fn finish(&mut self, id: u32) -> Option<Traced> {
        self.alias.retain(|_, own| *own != id);
        self.open.remove(&id)
    }

    /// Packets without an event for `quiet`: finished (delivered, or waiting for nothing
    /// more), oldest first.
    pub fn quiet(&mut self, now: Instant, quiet: Duration) -> Vec<Traced> {
        let ids: Vec<u32> = self
            .open
            .values()
            .filter(|p| now.duration_since(p.last) >= quiet)
            .map(|p| p.id)
            .collect();
        let mut done: Vec<Traced> = ids.iter().filter_map(|id| self.finish(*id)).collect();
        done.sort_by_key(|p| p.last);
        done
    }

    /// Every packet still open, oldest first.
    pub fn drain(&mut self) -> Vec<Traced> {
        self.alias.clear();
        let mut done: Vec<Traced> = self.open.drain().map(|(_, p)| p).collect();
        done.sort_by_key(|p| p.last);
        done
    }
}

/// A tracer's table in the kernel and the socket that owns it and reads the events.
pub struct Session {
    socket: Socket,
    table: String,
    seq: u32,
    buf: Vec<u8>,
    /// Events read while waiting for an acknowledgement.
    pending: std::collections::VecDeque<Event>,
    overruns: usize,
}

/// How long the kernel may take to acknowledge the table.
const ACK_TIMEOUT: Duration = Duration::from_secs(10);

impl Session {
    /// Subscribes to trace events and creates the table `inet nodeport-trace-<pid>` with
    /// the owner flag, its chains and the rules that mark the packets `selector` picks.
    pub fn start(selector: &Selector) -> Result<Self, Error> {
        let mut socket = Socket::new(NETLINK_NETFILTER).map_err(socket_err("socket"))?;
        socket.bind_auto().map_err(socket_err("bind"))?;
        socket
            .connect(&SocketAddr::new(0, 0))
            .map_err(socket_err("connect"))?;
        // Busy nodes send many events: a large buffer loses fewer (losses are counted).
        let fd = socket.as_fd();
        let _ =
            nix::sys::socket::setsockopt(&fd, nix::sys::socket::sockopt::RcvBufForce, &(16 << 20));
        socket
            .add_membership(NFNLGRP_NFTRACE)
            .map_err(socket_err("joining NFNLGRP_NFTRACE"))?;
        let mut session = Session {
            socket,
            table: format!("{TABLE_PREFIX}{}", std::process::id()),
            seq: 1,
            buf: vec![0; 1 << 20],
            pending: Default::default(),
            overruns: 0,
        };
        let (batch, last) = encode_table(&session.table, selector, session.seq);
        session.seq = last + 2;
        session.send(&batch)?;
        session.wait_ack(last, "creating")?;
        Ok(session)
    }

    /// The table's name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// Trace events lost because the socket's buffer was full.
    pub fn overruns(&self) -> usize {
        self.overruns
    }

    fn send(&mut self, bytes: &[u8]) -> Result<(), Error> {
        self.socket.send(bytes, 0).map_err(socket_err("send"))?;
        Ok(())
    }

    /// Reads the messages of one datagram, waiting at most `wait`; calls `each` with each
    /// message's type, sequence number and payload. `false` when nothing came.
    fn read(
        &mut self,
        wait: Duration,
        mut each: impl FnMut(&mut Self, u16, u32, &[u8]),
    ) -> Result<bool, Error> {
        let wait = wait.max(Duration::from_millis(1));
        nix::sys::socket::setsockopt(
            &self.socket.as_fd(),
            nix::sys::socket::sockopt::ReceiveTimeout,
            &nix::sys::time::TimeVal::new(wait.as_secs() as _, wait.subsec_micros() as _),
        )
        .map_err(|e| Error::Socket {
            what: "SO_RCVTIMEO",
            source: e.into(),
        })?;
        let mut buf = std::mem::take(&mut self.buf);
        let n = match self.socket.recv(&mut &mut buf[..], 0) {
            Ok(n) => n,
            Err(e) => {
                self.buf = buf;
                return match e.kind() {
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => Ok(false),
                    _ if e.raw_os_error() == Some(nix::libc::ENOBUFS) => {
                        self.overruns += 1;
                        Ok(true)
                    }
                    _ => Err(Error::Socket {
                        what: "receive",
                        source: e,
                    }),
                };
            }
        };
        let mut off = 0;
        while off + 16 <= n {
            let len = u32::from_ne_bytes(buf[off..off + 4].try_into().expect("4 bytes")) as usize;
            let ty = u16::from_ne_bytes(buf[off + 4..off + 6].try_into().expect("2 bytes"));
            let seq = u32::from_ne_bytes(buf[off + 8..off + 12].try_into().expect("4 bytes"));
            if len < 16 || off + len > n {
                break;
            }
            each(self, ty, seq, &buf[off + 16..off + len]);
            off += align4(len);
        }
        self.buf = buf;
        Ok(true)
    }

    /// Waits for the acknowledgement of `seq`, keeping the trace events that come first.
    fn wait_ack(&mut self, seq: u32, what: &'static str) -> Result<(), Error> {
        let deadline = Instant::now() + ACK_TIMEOUT;
        let mut answer: Option<i32> = None;
        while answer.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout(ACK_TIMEOUT));
            }
            self.read(left, |s, ty, got, payload| {
                if ty == NLMSG_ERROR && payload.len() >= 4 {
                    let errno = i32::from_ne_bytes(payload[..4].try_into().expect("4 bytes"));
                    // An error on any message of the batch fails it; the ack closes it.
                    if errno != 0 || got == seq {
                        answer = Some(errno);
                    }
                } else if let Some(e) = trace_event(ty, payload) {
                    s.pending.push_back(e);
                }
            })?;
        }
        match answer {
            Some(0) | None => Ok(()),
            Some(errno) => Err(Error::Refused {
                what,
                table: self.table.clone(),
                source: std::io::Error::from_raw_os_error(-errno),
            }),
        }
    }

    /// The next trace event (of any tracer's packet), waiting at most `wait`.
    pub fn next(&mut self, wait: Duration) -> Result<Option<Event>, Error> {
        let deadline = Instant::now() + wait;
        loop {
            if let Some(e) = self.pending.pop_front() {
                return Ok(Some(e));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            let got = self.read(left, |s, ty, _, payload| {
                if let Some(e) = trace_event(ty, payload) {
                    s.pending.push_back(e);
                }
            })?;
            if !got {
                return Ok(None);
            }
        }
    }

    /// Deletes the table now (closing the socket would too).
    pub fn close(mut self) -> Result<(), Error> {
        let mut b = Buf { b: Vec::new() };
        let seq = self.seq;
        batch_marker(&mut b, NFNL_MSG_BATCH_BEGIN, seq);
        let m = b.begin_nft(
            NFT_MSG_DELTABLE,
            NLM_F_REQUEST | NLM_F_ACK,
            seq + 1,
            NFPROTO_INET,
        );
        b.str(NFTA_TABLE_NAME, &self.table);
        b.end(m);
        batch_marker(&mut b, NFNL_MSG_BATCH_END, seq + 2);
        self.send(&b.b)?;
        self.wait_ack(seq + 1, "deleting")
    }
}

fn trace_event(ty: u16, payload: &[u8]) -> Option<Event> {
    (ty == (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_TRACE)
        .then(|| parse_event(payload))
        .flatten()
}

/// The batch that creates the table, its two chains and their rules; sequence numbers from
/// `seq` (the begin message) on, the last rule asking for the acknowledgement (its sequence
/// number is returned).
fn encode_table(table: &str, selector: &Selector, seq: u32) -> (Vec<u8>, u32) {
    let mut b = Buf { b: Vec::new() };
    let mut seq = seq;
    batch_marker(&mut b, NFNL_MSG_BATCH_BEGIN, seq);
    seq += 1;
    let create = NLM_F_REQUEST | NLM_F_CREATE;
    let m = b.begin_nft(NFT_MSG_NEWTABLE, create, seq, NFPROTO_INET);
    b.str(NFTA_TABLE_NAME, table);
    b.u32be(NFTA_TABLE_FLAGS, NFT_TABLE_F_OWNER);
    b.attr(
        NFTA_TABLE_USERDATA,
        &udata_comment(
            UDATA_COMMENT,
            &format!(
                "nodeport trace --live (pid {}): goes when it ends",
                std::process::id()
            ),
        ),
    );
    b.end(m);
    for (chain, hook) in [
        (CHAIN_PREROUTING, HOOK_PREROUTING),
        (CHAIN_OUTPUT, HOOK_OUTPUT),
    ] {
        seq += 1;
        let m = b.begin_nft(NFT_MSG_NEWCHAIN, create, seq, NFPROTO_INET);
        b.str(NFTA_CHAIN_TABLE, table);
        b.str(NFTA_CHAIN_NAME, chain);
        let n = b.nest(NFTA_CHAIN_HOOK);
        b.u32be(NFTA_HOOK_HOOKNUM, hook);
        b.attr(NFTA_HOOK_PRIORITY, &PRIORITY.to_be_bytes());
        b.close(n);
        b.str(NFTA_CHAIN_TYPE, "filter");
        b.end(m);
        // The packet asked for; what comes back to refuse it: a TCP reset (TCP only) and
        // an ICMP error.
        let mut rules: Vec<Option<Refused>> = vec![None];
        if selector.protocol == Protocol::Tcp {
            rules.push(Some(Refused::TcpReset));
        }
        rules.push(Some(Refused::IcmpError));
        let last = rules.len() - 1;
        for (i, rule) in rules.into_iter().enumerate() {
            seq += 1;
            // The output chain's last rule is the batch's last message: it asks for the ack.
            let ack = if hook == HOOK_OUTPUT && i == last {
                NLM_F_ACK
            } else {
                0
            };
            let m = b.begin_nft(
                NFT_MSG_NEWRULE,
                create | NLM_F_APPEND | ack,
                seq,
                NFPROTO_INET,
            );
            b.str(NFTA_RULE_TABLE, table);
            b.str(NFTA_RULE_CHAIN, chain);
            let n = b.nest(NFTA_RULE_EXPRESSIONS);
            match rule {
                None => mark_rule(&mut b, selector.family(), selector),
                Some(kind) => refusal_rule(&mut b, selector, kind),
            }
            b.close(n);
            b.end(m);
        }
    }
    batch_marker(&mut b, NFNL_MSG_BATCH_END, seq + 1);
    (b.b, seq)
}

/// The replies [`refusal_rule`] marks.
#[derive(Debug, Clone, Copy)]
enum Refused {
    /// `tcp flags & rst != 0`.
    TcpReset,
    /// `ct state related` (ICMP errors about the connection).
    IcmpError,
}

const NFTA_CT_DIRECTION: u16 = 3;
const NFT_CT_DIRECTION: u32 = 1;
const NFT_CT_PROTOCOL: u32 = 10;
const NFT_CT_PROTO_DST: u32 = 12;
const IP_CT_DIR_ORIGINAL: u8 = 0;
const IP_CT_DIR_REPLY: u8 = 1;

/// `[meta nfproto F] (meta l4proto tcp tcp flags & rst != 0 | ct state related) ct direction
/// reply ct original protocol P ct original proto-dst N meta nftrace set 1`: a reset or an
/// ICMP error coming back on a connection to the traced port (the conntrack id of its trace
/// events names the connection).
fn refusal_rule(b: &mut Buf, selector: &Selector, kind: Refused) {
    if let Some(family) = selector.family() {
        meta_load(b, NFT_META_NFPROTO, REG_1);
        cmp(b, REG_1, false, &[super::nfproto(family)]);
    }
    match kind {
        Refused::TcpReset => {
            meta_load(b, NFT_META_L4PROTO, REG_1);
            cmp(b, REG_1, false, &[proto_number(Protocol::Tcp)]);
            payload(b, REG_1, NFT_PAYLOAD_TRANSPORT_HEADER, 13, 1);
            bitwise(b, REG_1, &[0x04], &[0]);
            cmp(b, REG_1, true, &[0]);
        }
        Refused::IcmpError => {
            b.expr("ct", |b| {
                b.u32be(NFTA_CT_DREG, REG_1);
                b.u32be(NFTA_CT_KEY, NFT_CT_STATE);
            });
            bitwise(
                b,
                REG_1,
                &crate::nftables::ruleset::ct_state::RELATED.to_ne_bytes(),
                &0u32.to_ne_bytes(),
            );
            cmp(b, REG_1, true, &0u32.to_ne_bytes());
        }
    }
    let ct = |b: &mut Buf, key: u32, direction: Option<u8>| {
        b.expr("ct", |b| {
            b.u32be(NFTA_CT_DREG, REG_1);
            b.u32be(NFTA_CT_KEY, key);
            if let Some(d) = direction {
                b.attr(NFTA_CT_DIRECTION, &[d]);
            }
        });
    };
    ct(b, NFT_CT_DIRECTION, None);
    cmp(b, REG_1, false, &[IP_CT_DIR_REPLY]);
    ct(b, NFT_CT_PROTOCOL, Some(IP_CT_DIR_ORIGINAL));
    cmp(b, REG_1, false, &[proto_number(selector.protocol)]);
    ct(b, NFT_CT_PROTO_DST, Some(IP_CT_DIR_ORIGINAL));
    cmp(b, REG_1, false, &selector.dport.to_be_bytes());
    immediate_value(b, REG_1, &[1]);
    b.expr("meta", |b| {
        b.u32be(NFTA_META_KEY, NFT_META_NFTRACE);
        b.u32be(NFTA_META_SREG, REG_1);
    });
}

/// `[meta nfproto F] [ip daddr A] [ip saddr C] meta l4proto P th dport N ct state new meta
/// nftrace set 1`, as nft encodes it.
fn mark_rule(b: &mut Buf, family: Option<IpFamily>, selector: &Selector) {
    if let Some(family) = family {
        meta_load(b, NFT_META_NFPROTO, REG_1);
        cmp(b, REG_1, false, &[super::nfproto(family)]);
    }
    // Network header before transport header, in the order nft itself encodes them, so
    // that `nft list` (and every `nft -f`, which lists the ruleset into its cache first)
    // reads the rule back as nft would have written it.
    if let (Some(family), Some(daddr)) = (family, selector.daddr) {
        let (offset, len) = addr_field(family, true);
        payload(b, REG_1, NFT_PAYLOAD_NETWORK_HEADER, offset, len);
        cmp(b, REG_1, false, &ip_bytes(daddr));
    }
    if let (Some(family), Some(from)) = (family, selector.from) {
        let (offset, _) = addr_field(family, false);
        prefix_match(b, offset, false, &from);
    }
    meta_load(b, NFT_META_L4PROTO, REG_1);
    cmp(b, REG_1, false, &[proto_number(selector.protocol)]);
    payload(b, REG_1, NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2);
    cmp(b, REG_1, false, &selector.dport.to_be_bytes());
    b.expr("ct", |b| {
        b.u32be(NFTA_CT_DREG, REG_1);
        b.u32be(NFTA_CT_KEY, NFT_CT_STATE);
    });
    bitwise(b, REG_1, &ct_state::NEW.to_ne_bytes(), &0u32.to_ne_bytes());
    cmp(b, REG_1, true, &0u32.to_ne_bytes());
    immediate_value(b, REG_1, &[1]);
    b.expr("meta", |b| {
        b.u32be(NFTA_META_KEY, NFT_META_NFTRACE);
        b.u32be(NFTA_META_SREG, REG_1);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(id: u32, table: &str, chain: &str, verdict: Option<Verdict>) -> Event {
        Event {
            id,
            kind: Kind::Rule,
            family: if table.starts_with(TABLE_PREFIX) {
                "inet"
            } else {
                "ip"
            },
            table: table.to_string(),
            chain: chain.to_string(),
            handle: Some(4),
            verdict,
            network: vec![
                0x45, 0, 0, 60, 0, 0, 0x40, 0, 64, 6, 0, 0, 192, 0, 2, 100, 192, 0, 2, 10,
            ],
            transport: vec![0x9c, 0x40, 0x75, 0x30],
            iif: Some(2),
            oif: None,
            ct_id: Some(id + 1000),
            ct_reply: false,
        }
    }

    #[test]
    fn a_packet_is_ours_when_our_table_marked_it_and_another_tracers_packets_are_left_out() {
        let now = Instant::now();
        let mut c = Collector::new("nodeport-trace-1");
        // Another tracer's packet: its events are not ours.
        assert!(
            c.push(
                event(
                    7,
                    "nodeport-trace-2",
                    CHAIN_PREROUTING,
                    Some(Verdict::Continue)
                ),
                now
            )
            .is_none()
        );
        assert!(
            c.push(event(7, "kube-proxy", "nat-prerouting", None), now)
                .is_none()
        );
        // It crosses our chain too (end of chain and policy, no rule of ours matched).
        let mut crossing = event(
            7,
            "nodeport-trace-1",
            CHAIN_PREROUTING,
            Some(Verdict::Continue),
        );
        crossing.handle = None;
        assert!(c.push(crossing, now).is_none());
        assert!(
            c.push(
                event(7, "kube-proxy", "services", Some(Verdict::Accept)),
                now
            )
            .is_none()
        );
        // Ours, also marked by the other tracer: its table is not part of the path.
        c.push(
            event(
                9,
                "nodeport-trace-1",
                CHAIN_PREROUTING,
                Some(Verdict::Continue),
            ),
            now,
        );
        c.push(
            event(
                9,
                "nodeport-trace-2",
                CHAIN_PREROUTING,
                Some(Verdict::Continue),
            ),
            now,
        );
        c.push(
            event(
                9,
                "kube-proxy",
                "nat-prerouting",
                Some(Verdict::Jump("services".into())),
            ),
            now,
        );
        let later = now + Duration::from_secs(1);
        let done = c.quiet(later, Duration::from_millis(500));
        assert_eq!(done.len(), 1);
        let p = &done[0];
        assert_eq!(p.id, 9);
        assert_eq!(p.origin, Origin::Remote);
        assert_eq!(p.events.len(), 1);
        assert_eq!(p.events[0].table, "kube-proxy");
        let h = p.headers.unwrap();
        assert_eq!(h.src, "192.0.2.100".parse::<IpAddr>().unwrap());
        assert_eq!(h.dst, "192.0.2.10".parse::<IpAddr>().unwrap());
        assert_eq!(
            (h.sport, h.dport, h.protocol),
            (40000, 30000, Some(Protocol::Tcp))
        );
    }

    #[test]
    fn a_drop_ends_the_packet_at_once_and_a_reused_trace_id_starts_a_new_one() {
        let now = Instant::now();
        let mut c = Collector::new("nodeport-trace-1");
        c.push(
            event(3, "nodeport-trace-1", CHAIN_OUTPUT, Some(Verdict::Continue)),
            now,
        );
        // The same id marked again (a retransmitted SYN in a reused buffer): the first ends.
        let first = c
            .push(
                event(3, "nodeport-trace-1", CHAIN_OUTPUT, Some(Verdict::Continue)),
                now,
            )
            .expect("the first packet is finished");
        assert_eq!(first.origin, Origin::Local);
        let dropped = c
            .push(event(3, "filter", "input", Some(Verdict::Drop)), now)
            .expect("a drop ends the packet");
        assert_eq!(dropped.dropped_by().unwrap().chain, "input");
        assert!(c.drain().is_empty());
    }

    #[test]
    fn a_reset_or_icmp_error_coming_back_is_the_refusal_of_the_traced_packet_of_its_conntrack_entry()
     {
        let now = Instant::now();
        let mut c = Collector::new("nodeport-trace-1");
        let ours = |id| event(id, "nodeport-trace-1", CHAIN_PREROUTING, None);
        c.push(ours(5), now);
        c.push(ours(6), now);
        // A reset from 10.244.1.2:8080 to the masqueraded 10.244.1.1, in the reply direction
        // of packet 6's entry (ct id 1006): marked by our reply rule, not a packet of its own.
        let mut reset = ours(40);
        reset.network = vec![
            0x45, 0, 0, 40, 0, 0, 0x40, 0, 64, 6, 0, 0, 10, 244, 1, 2, 10, 244, 1, 1,
        ];
        reset.transport = vec![0x1f, 0x90, 0x9c, 0x40, 0, 0, 0, 0, 0, 0, 0, 1, 0x50, 0x14];
        reset.ct_id = Some(1006);
        reset.ct_reply = true;
        assert!(c.push(reset, now).is_none());
        // An ICMP "fragmentation needed" about packet 5 only lowers the MTU: no refusal.
        let mut too_big = ours(41);
        too_big.network = vec![
            0x45, 0, 0, 56, 0, 0, 0x40, 0, 64, 1, 0, 0, 10, 244, 1, 2, 10, 244, 1, 1,
        ];
        too_big.transport = vec![3, 4, 0, 0, 0, 0, 5, 0xdc];
        too_big.ct_id = Some(1005);
        too_big.ct_reply = true;
        assert!(c.push(too_big, now).is_none());
        let done = c.quiet(now + Duration::from_secs(1), Duration::from_millis(500));
        assert_eq!(done.len(), 2, "the replies are no packets of their own");
        let by_id = |id| done.iter().find(|p| p.id == id).unwrap();
        assert_eq!(by_id(5).refusal, None);
        let r = by_id(6).refusal.expect("the reset");
        assert_eq!(r.kind, RefusalKind::TcpReset);
        assert_eq!(
            (r.from, r.from_port, r.to),
            (
                "10.244.1.2".parse::<IpAddr>().unwrap(),
                8080,
                "10.244.1.1".parse::<IpAddr>().unwrap()
            )
        );
        // ICMPv6 port unreachable.
        let mut v6 = vec![0x60, 0, 0, 0, 0, 0, 58, 64];
        v6.extend_from_slice(&"fd00::2".parse::<std::net::Ipv6Addr>().unwrap().octets());
        v6.extend_from_slice(&"fd00::1".parse::<std::net::Ipv6Addr>().unwrap().octets());
        let r = parse_refusal(&v6, &[1, 4, 0, 0]).unwrap();
        assert_eq!(r.kind.describe(), "ICMPv6 port unreachable (code 4)");
        assert_eq!(r.kind.as_str(), "icmpv6_unreachable");
    }

    #[test]
    fn trace_messages_are_read_from_their_attributes() {
        let mut b = Buf { b: Vec::new() };
        b.b.extend_from_slice(&[2, 0, 0, 0]); // nfgenmsg: ip
        b.str(NFTA_TRACE_TABLE, "kube-proxy");
        b.str(NFTA_TRACE_CHAIN, "services");
        b.attr(NFTA_TRACE_RULE_HANDLE, &12u64.to_be_bytes());
        b.u32be(NFTA_TRACE_TYPE, NFT_TRACETYPE_RULE);
        let n = b.nest(NFTA_TRACE_VERDICT);
        b.attr(NFTA_VERDICT_CODE, &(-4i32).to_be_bytes());
        b.str(NFTA_VERDICT_CHAIN, "service-web");
        b.close(n);
        b.u32be(NFTA_TRACE_ID, 77);
        let e = parse_event(&b.b).unwrap();
        assert_eq!(e.id, 77);
        assert_eq!(e.family, "ip");
        assert_eq!(e.verdict, Some(Verdict::Goto("service-web".into())));
        assert_eq!(
            e.describe(),
            "ip kube-proxy services rule 12: goto service-web"
        );
        // A policy event names the policy.
        let mut b = Buf { b: Vec::new() };
        b.b.extend_from_slice(&[1, 0, 0, 0]);
        b.str(NFTA_TRACE_TABLE, "filter");
        b.str(NFTA_TRACE_CHAIN, "input");
        b.u32be(NFTA_TRACE_TYPE, NFT_TRACETYPE_POLICY);
        b.u32be(NFTA_TRACE_POLICY, 0);
        b.u32be(NFTA_TRACE_ID, 78);
        let e = parse_event(&b.b).unwrap();
        assert!(e.drops());
        assert_eq!(e.describe(), "inet filter input: policy drop");
    }
}
