//! `nodeport trace --live`: real packets. A table of the tracer's own marks the first packet
//! of each new connection to `--to` (from `--from`) with `meta nftrace`; the kernel's trace
//! events name every rule the packet met, in every table; conntrack names the endpoint the
//! DNAT chose (nftrace names rules, not the map element chosen) and whether it answered.
//! Each packet is then explained as `--rules kernel` explains the same packet, followed by
//! its path and what the kernel did (`seen`).
//!
//! The ebpf mode reads the programs' trace events instead ([`run_ebpf`]): what
//! `np_tc_ingress` and the connect hook decide for each new connection while a trace runs;
//! the same trace table beside them sees what the programs pass on untranslated, and has
//! conntrack follow the node's own sockets to their backends ([`Sockets`]).
//!
//! The table is owned by the tracing process's netlink socket
//! ([`nftrace`](nodeport_proxy::nftables::netlink::nftrace)): it is deleted on a normal
//! exit, and the kernel deletes it when the process ends in any other way (an error,
//! Ctrl-C, SIGKILL).

use crate::cmd::{out, outln};
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use ipnet::IpNet;
use nodeport_proxy::config::ProxyMode;
use nodeport_proxy::conntrack;
use nodeport_proxy::model::Protocol;
use nodeport_proxy::nftables::netlink::nftrace::{
    self, Collector, Event, Selector, Session, Traced,
};
use nodeport_proxy::trace::explain::{Explanation, Reason, Verdict as Fate};
use nodeport_proxy::trace::path::Step;
use nodeport_proxy::trace::{Origin, Packet};
use serde::Serialize;

use super::{
    EXIT_NOT_DELIVERED, Exit, Tracing, trace_packet, unreadable_pinned_maps, untraceable, usage,
};

/// A packet is finished when no event came for it this long (its last hook is behind it).
const QUIET: Duration = Duration::from_millis(300);
/// How long an endpoint may take to answer before `seen` says it has not.
const ANSWER_WAIT: Duration = Duration::from_secs(1);

/// The `seen.reason` and the words for whether a socket's backend answered (within
/// [`ANSWER_WAIT`]).
fn answered_words(answered: bool) -> (&'static str, String) {
    if answered {
        ("endpoint", "it answered".to_string())
    } else {
        (
            "not_answering",
            format!("it has not answered within {ANSWER_WAIT:?}"),
        )
    }
}

/// `--from` with `--live`: an address or a CIDR.
pub(super) fn parse_from(value: &str) -> anyhow::Result<IpNet> {
    if let Ok(ip) = value.parse::<IpAddr>() {
        return Ok(IpNet::from(ip));
    }
    value.parse::<IpNet>().map(|n| n.trunc()).map_err(|_| {
        usage(format!(
            "invalid value {value:?} for --from: not an address or CIDR"
        ))
    })
}

/// `--to` with `--live`: `[ADDR]:PORT[/PROTO]`, the address optional (`:30569/tcp`).
pub(super) fn parse_to(value: &str) -> anyhow::Result<(Option<IpAddr>, u16, Protocol)> {
    if let Some(rest) = value.strip_prefix(':') {
        let (port, proto) = rest.split_once('/').unwrap_or((rest, "tcp"));
        let port: u16 = port
            .parse()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| usage(format!("invalid value {value:?} for --to: not a port")))?;
        let proto = Protocol::parse(&proto.to_ascii_uppercase()).ok_or_else(|| {
            usage(format!(
                "invalid value {value:?} for --to: the protocol must be tcp, udp or sctp"
            ))
        })?;
        return Ok((None, port, proto));
    }
    let (addr, proto) = super::parse_to(value)?;
    Ok((Some(addr.ip()), addr.port(), proto))
}

/// `--timeout`: `30s`, `500ms`, `2m`, `1h`, or a number of seconds.
pub(super) fn parse_duration(value: &str) -> anyhow::Result<Duration> {
    let bad = || {
        usage(format!(
            "invalid value {value:?} for --timeout: must be a duration such as 30s, 500ms or 2m"
        ))
    };
    let split = value
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(value.len());
    let (number, unit) = value.split_at(split);
    let number: f64 = number.parse().map_err(|_| bad())?;
    let seconds = match unit {
        "" | "s" => number,
        "ms" => number / 1000.0,
        "m" => number * 60.0,
        "h" => number * 3600.0,
        _ => return Err(bad()),
    };
    if !(seconds > 0.0 && seconds.is_finite()) {
        return Err(bad());
    }
    Ok(Duration::from_secs_f64(seconds))
}

/// What the kernel did with a real packet.
#[derive(Serialize, Default)]
struct Seen {
    /// `dnat`, `reject` or `drop` (by the proxy's rules), `drop` (`reason: other_table`),
    /// `pass` (not translated) or `unknown` (no conntrack entry).
    verdict: &'static str,
    /// `endpoint`, `not_answering`, the explanation's reason of a drop by the proxy's
    /// rules, `other_table`, `not_a_service` or `unknown`.
    reason: &'static str,
    /// The sentence people read.
    message: String,
    /// DNAT: the endpoint conntrack names.
    #[serde(skip_serializing_if = "Option::is_none")]
    endpoint: Option<SocketAddr>,
    /// The source the endpoint sees (the node's address when masqueraded).
    #[serde(skip_serializing_if = "Option::is_none")]
    source_seen_by_endpoint: Option<IpAddr>,
    /// Whether the other side answered within a second.
    #[serde(skip_serializing_if = "Option::is_none")]
    answered: Option<bool>,
    /// The rule that dropped it: `family table chain [rule N]`.
    #[serde(skip_serializing_if = "Option::is_none")]
    at: Option<String>,
    /// Refused: what came back (`tcp_reset`, `icmp_unreachable`, `icmpv6_unreachable`).
    #[serde(skip_serializing_if = "Option::is_none")]
    refused_with: Option<&'static str>,
    /// Refused: who sent it (the endpoint, or a router or node on the way).
    #[serde(skip_serializing_if = "Option::is_none")]
    refused_by: Option<IpAddr>,
    /// Not answered, nothing came back: the interface this node sent the packet out on.
    #[serde(skip_serializing_if = "Option::is_none")]
    sent_on: Option<String>,
}

/// One real packet: its source port and trace id, the explanation of the same packet, its
/// path and what the kernel did.
#[derive(Serialize)]
struct LivePacket {
    source_port: u16,
    /// nftables: the kernel's trace id (the ebpf mode has none).
    #[serde(skip_serializing_if = "Option::is_none")]
    trace_id: Option<u32>,
    #[serde(flatten)]
    explanation: Explanation,
    path: Vec<Step>,
    seen: Seen,
}

/// What `-o json` prints with `--live`.
#[derive(Serialize)]
struct LiveReport {
    source: &'static str,
    rules: &'static str,
    mode: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    nftables_layout: Option<&'static str>,
    /// The tracer's table (`inet nodeport-trace-<pid>`), gone when it ends; in the ebpf
    /// mode the map read (`np_ct`).
    table: String,
    packets: Vec<LivePacket>,
    /// Trace events the kernel could not deliver (the socket's buffer was full).
    #[serde(skip_serializing_if = "is_zero")]
    lost_events: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// `--to` and `--from` as the output names them (`:30569`, `any source`).
fn described(selector: &Selector) -> (String, String) {
    let to = match selector.daddr {
        Some(ip) => SocketAddr::new(ip, selector.dport).to_string(),
        None => format!(":{}", selector.dport),
    };
    let from = selector
        .from
        .map_or_else(|| "any source".to_string(), |n| format!("{n}"));
    (to, from)
}

/// Whether a rule is the proxy's: its nftables table, or (iptables-nft) its `KUBE-` chains.
fn is_proxys(e: &Event) -> bool {
    e.table == nodeport_proxy::nftables::ruleset::TABLE || e.chain.starts_with("KUBE-")
}

/// Runs the live trace; `fallback` is `--from`/`--to` as one packet, for iptables-legacy.
pub(super) fn run(
    tracing: &Tracing,
    selector: &Selector,
    count: usize,
    timeout: Duration,
    json: bool,
    fallback: (Option<IpAddr>, Option<(SocketAddr, Protocol)>),
    pin_root: &std::path::Path,
) -> anyhow::Result<()> {
    // Ctrl-C or SIGTERM ends the trace as its timeout does (the table removed, what was traced
    // printed), with 128 plus the signal as the exit code, as a shell reports it; a second one
    // exits at once (the kernel still removes the table with the socket). A handler of our own
    // also when the shell started us with SIGINT ignored (a background job).
    let interrupt = crate::lab::interrupt::Interrupt::install(|name| {
        eprintln!("nodeport trace: {name} again; ending at once");
        std::process::exit(if name == "SIGTERM" { 143 } else { 130 });
    })?;
    let result = match tracing.prepared.mode {
        ProxyMode::Ebpf => run_ebpf(
            tracing, selector, count, timeout, json, pin_root, &interrupt,
        ),
        _ => run_nftables(
            tracing, selector, count, timeout, json, fallback, &interrupt,
        ),
    };
    match interrupt.check() {
        Ok(()) => result,
        Err(interrupted) => Err(Exit {
            code: u8::try_from(128 + interrupted.number).unwrap_or(u8::MAX),
            message: Some(format!("nodeport trace: {interrupted}")),
        }
        .into()),
    }
}

/// [`run`] through nf_tables trace events (nftables, iptables-nft; iptables-legacy falls back
/// to tracing `fallback` through the kernel's rules).
fn run_nftables(
    tracing: &Tracing,
    selector: &Selector,
    count: usize,
    timeout: Duration,
    json: bool,
    fallback: (Option<IpAddr>, Option<(SocketAddr, Protocol)>),
    interrupt: &crate::lab::interrupt::Interrupt,
) -> anyhow::Result<()> {
    match tracing.prepared.mode {
        ProxyMode::Nftables => {}
        ProxyMode::Iptables => {
            use nodeport_proxy::iptables::apply::{Variant, detect_variant};
            if detect_variant(&[]).variant == Variant::Legacy {
                let (Some(from), Some((to, proto))) = fallback else {
                    return Err(untraceable(
                        "--live is not possible with iptables-legacy (x_tables sends no trace \
                         events to a process; its TRACE target logs to the kernel log): give \
                         --from ADDR and --to ADDR:PORT/PROTO to trace that packet through \
                         the kernel's rules instead",
                    ));
                };
                eprintln!(
                    "nodeport trace: --live is not possible with iptables-legacy (x_tables sends \
                     no trace events to a process); tracing the packet of --from and --to \
                     through the kernel's rules instead"
                );
                return match trace_packet(tracing, from, to, proto, json)? {
                    true => Ok(()),
                    false => Err(Exit {
                        code: EXIT_NOT_DELIVERED,
                        message: None,
                    }
                    .into()),
                };
            }
        }
        other => {
            return Err(untraceable(format!(
                "--live traces real packets with nftables trace events: not possible in the {} \
                 mode",
                other.as_str()
            )));
        }
    }
    let mut session = Session::start(selector).map_err(|e| {
        untraceable(format!(
            "--live: {}",
            anyhow::Error::from(e)
                .chain()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join(": ")
        ))
    })?;
    let table = session.table().to_string();
    let (to, from) = described(selector);
    if !json {
        outln!("{}", tracing.rules_line());
        outln!(
            "live        the first packet of the next {count} new connection(s) to {to}/{} \
             from {from}, within {timeout:?} (marked by table inet {table}, removed when \
             this trace ends)",
            selector.protocol.as_lower()
        );
    }
    let mut collector = Collector::new(&table);
    let deadline = Instant::now() + timeout;
    let mut packets: Vec<LivePacket> = Vec::new();
    let mut failed = false;
    let mut report = |traced: Traced, packets: &mut Vec<LivePacket>| {
        let Some(p) = explain_packet(tracing, traced, selector.protocol) else {
            return;
        };
        failed |= !matches!(p.seen.reason, "endpoint");
        if !json {
            print_packet(packets.len() + 1, &p);
        }
        packets.push(p);
    };
    while packets.len() < count && interrupt.check().is_ok() {
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        let wait = deadline.duration_since(now).min(QUIET / 3);
        let event = session
            .next(wait)
            .map_err(|e| untraceable(format!("--live: reading trace events: {e}")))?;
        let now = Instant::now();
        if let Some(e) = event
            && let Some(done) = collector.push(e, now)
        {
            report(done, &mut packets);
        }
        for done in collector.quiet(now, QUIET) {
            if packets.len() < count {
                report(done, &mut packets);
            }
        }
    }
    // Packets marked before the deadline whose last events came late.
    for done in collector.drain() {
        if packets.len() < count {
            report(done, &mut packets);
        }
    }
    let lost = session.overruns();
    session
        .close()
        .map_err(|e| untraceable(format!("--live: removing table inet {table}: {e}")))?;
    finish(
        tracing, selector, timeout, json, table, packets, lost, failed,
    )
}

/// Prints the JSON report (or the closing lines) and ends with the exit code: 0 every
/// packet reached an endpoint that answered, 1 one did not, 3 none came.
#[allow(clippy::too_many_arguments)]
fn finish(
    tracing: &Tracing,
    selector: &Selector,
    timeout: Duration,
    json: bool,
    table: String,
    packets: Vec<LivePacket>,
    lost: usize,
    failed: bool,
) -> anyhow::Result<()> {
    let (to, from) = described(selector);
    let none = packets.is_empty();
    if json {
        let report = LiveReport {
            source: tracing.origin,
            rules: "live",
            mode: tracing.prepared.mode.as_str(),
            nftables_layout: tracing.layout(),
            table,
            packets,
            lost_events: lost,
        };
        outln!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        if lost > 0 {
            outln!(
                "note        {lost} batch(es) of trace events were lost (the socket's buffer \
                 was full): a path may lack steps"
            );
        }
        if none {
            outln!("seen        no such packet within {timeout:?}");
        }
    }
    if none {
        return Err(Exit {
            code: super::EXIT_UNTRACEABLE,
            message: Some(format!(
                "--live: no new connection to {to}/{} from {from} within {timeout:?}",
                selector.protocol.as_lower()
            )),
        }
        .into());
    }
    if failed {
        return Err(Exit {
            code: EXIT_NOT_DELIVERED,
            message: None,
        }
        .into());
    }
    Ok(())
}

fn interface_name(index: Option<u32>) -> Option<String> {
    let name = nix::net::if_::if_indextoname(index?).ok()?;
    Some(name.to_string_lossy().into_owned())
}

/// Explains a real packet: the explanation of the same packet, its path, and what the
/// kernel did (the drop it met, or conntrack's entry).
fn explain_packet(tracing: &Tracing, traced: Traced, protocol: Protocol) -> Option<LivePacket> {
    let h = traced.headers?;
    let packet = Packet {
        src: h.src,
        dst: h.dst,
        proto: h.protocol.unwrap_or(protocol),
        dport: h.dport,
        origin: traced.origin,
    };
    let mut explanation = tracing.explain(&packet);
    // The path printed is the packet's own, from the kernel's events.
    explanation.path.clear();
    let first = traced.events.first();
    if traced.origin == Origin::Remote
        && let Some(name) = interface_name(first.and_then(|e| e.iif))
    {
        explanation.packet.interface = Some(name);
    }
    let path = traced
        .events
        .iter()
        .map(|e| Step {
            family: e.family,
            table: e.table.clone(),
            chain: e.chain.clone(),
            rule_handle: e.handle,
            rule_index: None,
            kind: match e.kind {
                nftrace::Kind::Rule => "rule",
                nftrace::Kind::Return => "return",
                nftrace::Kind::Policy => "policy",
                nftrace::Kind::Other(_) => "other",
            },
            verdict: e
                .verdict
                .as_ref()
                .map_or_else(String::new, |v| v.to_string()),
            elements: Vec::new(),
            service: None,
            candidates: Vec::new(),
        })
        .collect();
    let path = named_steps(tracing, &explanation, path);
    let seen = match traced.dropped_by() {
        Some(e) if is_proxys(e) => {
            // The proxy's own drop or reject: the explanation says why.
            let why = explanation
                .outcomes
                .iter()
                .find(|o| o.verdict != Fate::Dnat && o.verdict != Fate::Pass);
            let (verdict, reason, message) = match why {
                Some(o) => (verdict_name(o.verdict), reason_name(o), o.message.clone()),
                None => (
                    "drop",
                    "other",
                    "dropped by the proxy's rules, for no reason the Service explains".into(),
                ),
            };
            Seen {
                verdict,
                reason,
                message,
                at: Some(e.describe()),
                ..Seen::default()
            }
        }
        Some(e) => Seen {
            verdict: "drop",
            reason: "other_table",
            message: format!(
                "drop by table {} {}, not by the proxy's rules",
                e.family, e.table
            ),
            at: Some(e.describe()),
            ..Seen::default()
        },
        None => {
            let seen = delivered(&h, packet.proto, &traced, &tracing.prepared.facts.local_ips);
            // Every rule accepted it and it left no trace: when the kernel's drop of a
            // loopback destination from the network explains that, say so.
            match explanation.outcomes.first() {
                Some(o) if seen.reason == "unknown" && o.reason == Reason::Localnet => Seen {
                    verdict: "drop",
                    reason: "localnet",
                    message: format!(
                        "{}: every rule accepted it, no conntrack entry is left and nothing \
                         came back",
                        o.message
                    ),
                    ..Seen::default()
                },
                _ => seen,
            }
        }
    };
    Some(LivePacket {
        source_port: h.sport,
        trace_id: Some(traced.id),
        explanation,
        path,
        seen,
    })
}

/// The path's steps with the Service port the packet addressed where a step is that port's,
/// as a traced path names them ([`path::name_steps`](nodeport_proxy::trace::path::name_steps)).
fn named_steps(tracing: &Tracing, explanation: &Explanation, mut path: Vec<Step>) -> Vec<Step> {
    let Some(label) = explanation.service.as_ref().map(|s| s.port.clone()) else {
        return path;
    };
    let Some(svc) = tracing
        .prepared
        .desired
        .families
        .iter()
        .flat_map(|f| f.services.values())
        .find(|s| nodeport_proxy::trace::explain::port_label(s) == label)
    else {
        return path;
    };
    let flat = tracing.layout() == Some("flat");
    nodeport_proxy::trace::path::name_steps(&mut path, svc, &label, flat);
    path
}

fn verdict_name(v: Fate) -> &'static str {
    match v {
        Fate::Dnat => "dnat",
        Fate::Reject => "reject",
        Fate::Drop => "drop",
        Fate::Pass => "pass",
    }
}

fn reason_name(o: &nodeport_proxy::trace::explain::Outcome) -> &'static str {
    match o.reason {
        Reason::Endpoint => "endpoint",
        Reason::NoEndpoints => "no_endpoints",
        Reason::NoLocalEndpointsExternal => "no_local_endpoints_external",
        Reason::NoLocalEndpointsInternal => "no_local_endpoints_internal",
        Reason::SourceRanges => "source_ranges",
        Reason::NotNodePortAddress => "not_node_port_address",
        Reason::NotAService => "not_a_service",
        Reason::UnallocatedClusterIp => "unallocated_cluster_ip",
        Reason::Localnet => "localnet",
        Reason::OtherTable => "other_table",
        Reason::Other => "other",
    }
}

/// A packet no rule dropped: conntrack's entry for it names the endpoint, the source the
/// endpoint sees, and whether it answered (waited for up to [`ANSWER_WAIT`]). What came back
/// to refuse it (a TCP reset, which also ends the conntrack entry, or an ICMP error) tells a
/// refusal from a packet that went nowhere.
fn delivered(h: &nftrace::Headers, protocol: Protocol, traced: &Traced, local: &[IpAddr]) -> Seen {
    let deadline = Instant::now() + ANSWER_WAIT;
    let mut entry = None;
    loop {
        match conntrack::get(protocol, h.src, h.sport, h.dst, h.dport) {
            Ok(Some(c)) => {
                let answered = c.seen_reply;
                entry = Some(c);
                if answered {
                    break;
                }
            }
            Ok(None) => {}
            Err(e) => {
                return Seen {
                    verdict: "unknown",
                    reason: "unknown",
                    message: format!("accepted; conntrack could not be read: {e}"),
                    ..Seen::default()
                };
            }
        }
        // A refusal came back already: nothing more to wait for.
        if traced.refusal.is_some() || Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // Where the packet left this node (its last event's output interface).
    let sent_on = traced.events.iter().rev().find_map(|e| e.oif);
    let source_text = |seen_by: IpAddr| {
        if seen_by != h.src {
            format!("masqueraded to {seen_by}")
        } else {
            "not masqueraded".to_string()
        }
    };
    if let Some(r) = traced.refusal {
        // conntrack's entry names the endpoint when it is still there (an ICMP error);
        // a reset ended it, and names the endpoint itself (its source, before the node
        // reverses the DNAT).
        let named = match (&entry, r.kind) {
            (Some(c), _) => Some((
                SocketAddr::new(c.reply_src, c.reply_sport),
                c.reply_dst,
                "conntrack",
            )),
            (None, nftrace::RefusalKind::TcpReset) => {
                Some((SocketAddr::new(r.from, r.from_port), r.to, "its reset"))
            }
            // An ICMP error about a packet that left no entry (routing refused it before
            // conntrack confirmed it): where it was headed is unknown.
            (None, _) => None,
        };
        let sender = if named.is_some_and(|(e, _, _)| e.ip() == r.from) {
            format!("{} answered", r.from)
        } else if local.contains(&r.from) {
            format!("this node ({}) answered", r.from)
        } else {
            format!("{} (on the way, not the endpoint) answered", r.from)
        };
        let refused = format!(
            "refused: {sender} with {} ({})",
            r.kind.describe(),
            r.kind.cause()
        );
        let Some((endpoint, seen_by, named_by)) = named else {
            return Seen {
                verdict: "unknown",
                reason: "refused",
                message: format!("accepted by every rule, then {refused}"),
                answered: Some(false),
                refused_with: Some(r.kind.as_str()),
                refused_by: Some(r.from),
                ..Seen::default()
            };
        };
        let untranslated = endpoint == SocketAddr::new(h.dst, h.dport);
        let head = if untranslated {
            format!("passed on untranslated, {}", source_text(seen_by))
        } else {
            format!("DNAT to {endpoint} ({named_by}), {}", source_text(seen_by))
        };
        return Seen {
            verdict: if untranslated { "pass" } else { "dnat" },
            reason: "refused",
            message: format!("{head}; {refused}"),
            endpoint: (!untranslated).then_some(endpoint),
            source_seen_by_endpoint: Some(seen_by),
            answered: Some(false),
            refused_with: Some(r.kind.as_str()),
            refused_by: Some(r.from),
            ..Seen::default()
        };
    }
    let Some(c) = entry else {
        return Seen {
            verdict: "unknown",
            reason: "unknown",
            message: "accepted by every rule, but conntrack holds no entry for it and nothing \
                      came back: gone nowhere after the last rule (no route, forwarding off, \
                      reverse-path filter), or taken by a local socket that closed at once"
                .into(),
            ..Seen::default()
        };
    };
    let endpoint = SocketAddr::new(c.reply_src, c.reply_sport);
    let source = source_text(c.reply_dst);
    if endpoint == SocketAddr::new(h.dst, h.dport) {
        return Seen {
            verdict: "pass",
            reason: "not_a_service",
            message: format!("passed on untranslated, {source}"),
            source_seen_by_endpoint: Some(c.reply_dst),
            answered: Some(c.seen_reply),
            ..Seen::default()
        };
    }
    let sent_on_name = interface_name(sent_on);
    let (reason, answer) = if c.seen_reply {
        ("endpoint", "it answered".to_string())
    } else {
        let on = sent_on_name
            .as_deref()
            .map_or_else(String::new, |i| format!(" out on {i}"));
        let why = match sent_on_name
            .as_deref()
            .and_then(|i| neighbour_missing(endpoint.ip(), i))
        {
            Some(state) => format!(
                "no host answers for {} on {} (its neighbour entry is {state}): the \
                 address is not there",
                endpoint.ip(),
                sent_on_name.as_deref().unwrap_or("?")
            ),
            None => "the endpoint, or something between, drops it silently".to_string(),
        };
        (
            "not_answering",
            format!(
                "it has not answered within {ANSWER_WAIT:?} and nothing came back (no TCP \
                 reset, no ICMP error): the packet went nowhere after this node sent it{on}; \
                 {why}"
            ),
        )
    };
    Seen {
        verdict: "dnat",
        reason,
        message: format!("DNAT to {endpoint} (conntrack), {source}; {answer}"),
        endpoint: Some(endpoint),
        source_seen_by_endpoint: Some(c.reply_dst),
        answered: Some(c.seen_reply),
        sent_on: if c.seen_reply { None } else { sent_on_name },
        ..Seen::default()
    }
}

/// The state of the neighbour entry of `ip` on `interface` when it says no host has the
/// address (`INCOMPLETE`: asked, no answer yet; `FAILED`: no answer), from `ip -j neigh`.
fn neighbour_missing(ip: IpAddr, interface: &str) -> Option<String> {
    let out = std::process::Command::new("ip")
        .args([
            "-j",
            "neigh",
            "show",
            "to",
            &ip.to_string(),
            "dev",
            interface,
        ])
        .output()
        .ok()?;
    let entries: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    entries
        .as_array()?
        .iter()
        .flat_map(|e| e["state"].as_array().into_iter().flatten())
        .filter_map(|s| s.as_str())
        .find(|s| matches!(*s, "INCOMPLETE" | "FAILED"))
        .map(str::to_string)
}

/// One packet for people: its header line, the explanation, its path, what the kernel did.
fn print_packet(n: usize, p: &LivePacket) {
    let e = &p.explanation;
    let id = p
        .trace_id
        .map_or_else(String::new, |id| format!(", trace id {id:#010x}"));
    outln!(
        "live        packet {n}: {} → {}/{}, source port {}{id}",
        e.packet.from,
        e.packet.to,
        e.packet.protocol,
        p.source_port
    );
    out!("{e}");
    let mut lines = String::new();
    let _ = nodeport_proxy::trace::path::write_lines(&mut lines, &p.path);
    out!("{lines}");
    match &p.seen.at {
        Some(at) => outln!("seen        {} (at {at})", p.seen.message),
        None => outln!("seen        {}", p.seen.message),
    }
}

/// The node's own sockets as conntrack holds them while an ebpf trace runs (its nftables
/// trace table's `ct state` rule has conntrack follow this node's connections): a socket
/// the connect hook sent to a backend is the new entry from one of the node's addresses to
/// that backend (not in the table when the trace began, not another reported socket's). It
/// names the socket's real source and whether the backend answered.
struct Sockets {
    /// Entries in the table when the trace began.
    before: std::collections::HashSet<(IpAddr, u16, IpAddr, u16, u8)>,
    /// Entries already taken for a reported socket.
    taken: std::collections::HashSet<(IpAddr, u16, IpAddr, u16, u8)>,
    /// The node's addresses.
    local: Vec<IpAddr>,
}

fn entry_key(e: &conntrack::Entry) -> (IpAddr, u16, IpAddr, u16, u8) {
    (
        e.orig_src,
        e.orig_sport,
        e.orig_dst,
        e.orig_dport,
        e.protocol,
    )
}

impl Sockets {
    fn start(local: &[IpAddr]) -> Self {
        let before = [
            nodeport_proxy::model::IpFamily::V4,
            nodeport_proxy::model::IpFamily::V6,
        ]
        .into_iter()
        .flat_map(|f| conntrack::dump(f).unwrap_or_default())
        .map(|e| entry_key(&e))
        .collect();
        Sockets {
            before,
            taken: Default::default(),
            local: local.to_vec(),
        }
    }

    /// The entry of a socket sent to `to` over `protocol`, waiting up to [`ANSWER_WAIT`] for
    /// its backend to answer; `None` when conntrack shows none.
    fn find(&mut self, to: SocketAddr, protocol: Protocol) -> Option<conntrack::Entry> {
        let proto = nodeport_proxy::ebpf::maps::ip_proto(protocol);
        let family = nodeport_proxy::model::IpFamily::of(to.ip());
        let deadline = Instant::now() + ANSWER_WAIT;
        let mut found = None;
        loop {
            let candidates: Vec<conntrack::Entry> = conntrack::dump(family)
                .unwrap_or_default()
                .into_iter()
                .filter(|e| {
                    e.protocol == proto
                        && e.orig_dst == to.ip()
                        && e.orig_dport == to.port()
                        && self.local.contains(&e.orig_src)
                        && !self.before.contains(&entry_key(e))
                        && !self.taken.contains(&entry_key(e))
                })
                .collect();
            if let Some(answered) = candidates.iter().find(|e| e.seen_reply) {
                found = Some(*answered);
                break;
            }
            found = candidates.first().copied().or(found);
            if Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        if let Some(e) = &found {
            self.taken.insert(entry_key(e));
        }
        found
    }
}

/// `--live` in the ebpf mode, from the programs' trace events
/// ([`trace_events`](nodeport_proxy::ebpf::trace_events)): the tracer sets the deadline
/// until which `np_tc_ingress` and the connect hook record what they decide for each new
/// connection in `np_trace_log` (it lapses by itself if the tracer dies; the tracer
/// withdraws it at its end; tracers at once each read the whole log);
/// each event matching the selector is a new connection, explained as `--rules kernel`
/// explains its first packet, with the programs' steps as its path. A translated
/// connection's answer is read from `np_nat` (its reply entry records one).
///
/// Beside the log, a trace table of the nftables tracer's own ([`Session`]): the programs'
/// translations bypass netfilter (tc redirects them), so what it marks is what the programs
/// passed to the stack untranslated (a packet for no frontend, 127.0.0.1 from outside),
/// traced as in the nftables mode; and its `ct state` rule has conntrack follow the node's
/// connections while the trace runs, which names a socket's real source (its packets leave
/// with the backend as destination) and whether the backend answered ([`Sockets`]).
fn run_ebpf(
    tracing: &Tracing,
    selector: &Selector,
    count: usize,
    timeout: Duration,
    json: bool,
    pin_root: &std::path::Path,
    interrupt: &crate::lab::interrupt::Interrupt,
) -> anyhow::Result<()> {
    use nodeport_proxy::ebpf::apply::monotonic_now_ns;
    use nodeport_proxy::ebpf::maps::{Tuple, ip_proto};
    use nodeport_proxy::ebpf::programs::Maps;
    use nodeport_proxy::ebpf::trace_events::{EventKind, TraceEvents};
    let failed_to_read =
        |e: nodeport_proxy::ebpf::programs::Error| unreadable_pinned_maps("--live", pin_root, e);
    let maps = Maps::open_pinned(pin_root).map_err(failed_to_read)?;
    let mut events = TraceEvents::open_pinned(pin_root).map_err(failed_to_read)?;
    let deadline_ns = monotonic_now_ns()
        + u64::try_from((timeout + ANSWER_WAIT).as_nanos()).unwrap_or(u64::MAX / 2);
    // From now on (before the `live` line tells that the trace runs).
    let started_ns = monotonic_now_ns();
    events.report_until(deadline_ns).map_err(failed_to_read)?;
    let mut session = match Session::start(selector) {
        Ok(s) => Some(s),
        Err(e) => {
            eprintln!(
                "nodeport trace: no nftables trace table ({}): packets the programs pass \
                 untranslated are not traced, nor the node's sockets' sources and answers",
                anyhow::Error::from(e)
                    .chain()
                    .map(|c| c.to_string())
                    .collect::<Vec<_>>()
                    .join(": ")
            );
            None
        }
    };
    let mut collector = session.as_ref().map(|s| Collector::new(s.table()));
    let mut sockets = session
        .as_ref()
        .map(|_| Sockets::start(&tracing.prepared.facts.local_ips));
    let wanted = |t: &Tuple, socket: bool| {
        t.proto == ip_proto(selector.protocol)
            && t.dport == selector.dport
            && selector.daddr.is_none_or(|d| d == t.daddr)
            // A socket's source is not known at connect(): checked once conntrack names it.
            && (socket || selector.from.is_none_or(|n| n.contains(&t.saddr)))
    };
    let table = nodeport_proxy::ebpf::maps::names::TRACE_LOG.to_string();
    let (to, from) = described(selector);
    if !json {
        outln!("{}", tracing.rules_line());
        let beside = session.as_ref().map_or_else(String::new, |s| {
            format!(
                ", and what they pass untranslated as table inet {} marks it (removed when \
                 this trace ends)",
                s.table()
            )
        });
        outln!(
            "live        the next {count} new connection(s) to {to}/{} from {from}, within \
             {timeout:?}, as np_tc_ingress and the connect hook record them in {table} (while \
             this trace runs){beside}",
            selector.protocol.as_lower()
        );
    }
    let deadline = Instant::now() + timeout;
    let mut reported: std::collections::HashSet<Tuple> = Default::default();
    let mut packets: Vec<LivePacket> = Vec::new();
    let mut failed = false;
    let mut report = |p: LivePacket, packets: &mut Vec<LivePacket>| {
        failed |= !matches!(p.seen.reason, "endpoint");
        if !json {
            print_packet(packets.len() + 1, &p);
        }
        packets.push(p);
    };
    // A packet the nftables table marked that the programs did not report: passed to the
    // stack untranslated.
    let untranslated =
        |traced: &Traced, events: &[nodeport_proxy::ebpf::trace_events::TraceEvent]| {
            traced.headers.as_ref().is_some_and(|h| {
                !events.iter().any(|e| {
                    e.tuple.saddr == h.src
                        && e.tuple.daddr == h.dst
                        && e.tuple.sport == h.sport
                        && e.tuple.dport == h.dport
                })
            })
        };
    'polling: while packets.len() < count && interrupt.check().is_ok() && Instant::now() < deadline
    {
        let logged = events.since(started_ns);
        for e in &logged {
            let socket = matches!(e.kind, EventKind::SockDnat | EventKind::SockRefused);
            // A dropped connection's retransmissions are recorded again: once is enough.
            if !wanted(&e.tuple, socket) || !reported.insert(e.tuple) {
                continue;
            }
            // A socket sent to a backend: conntrack names its source (when it follows the
            // node's connections), which --from selects by.
            let entry = match (e.kind, &mut sockets) {
                (EventKind::SockDnat, Some(sockets)) => {
                    e.to.and_then(|to| sockets.find(to, selector.protocol))
                }
                _ => None,
            };
            if socket
                && let Some(from) = selector.from
                && !entry.is_some_and(|c| from.contains(&c.orig_src))
            {
                continue;
            }
            let p = ebpf_packet(tracing, (&maps, pin_root), e, selector.protocol, entry)?;
            report(p, &mut packets);
            if packets.len() >= count {
                break 'polling;
            }
        }
        let (Some(session), Some(collector)) = (session.as_mut(), collector.as_mut()) else {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        };
        let event = session
            .next(Duration::from_millis(50))
            .map_err(|e| untraceable(format!("--live: reading trace events: {e}")))?;
        let now = Instant::now();
        let mut done: Vec<Traced> = collector.quiet(now, QUIET);
        if let Some(e) = event
            && let Some(d) = collector.push(e, now)
        {
            done.push(d);
        }
        for traced in done {
            if packets.len() < count
                && untranslated(&traced, &logged)
                && let Some(p) = explain_packet(tracing, traced, selector.protocol)
            {
                report(p, &mut packets);
            }
        }
    }
    let mut lost = 0;
    if let (Some(session), Some(collector)) = (session, collector.as_mut()) {
        lost = session.overruns();
        let logged = events.since(started_ns);
        for traced in collector.drain() {
            if packets.len() < count
                && untranslated(&traced, &logged)
                && let Some(p) = explain_packet(tracing, traced, selector.protocol)
            {
                report(p, &mut packets);
            }
        }
        let table = session.table().to_string();
        session
            .close()
            .map_err(|e| untraceable(format!("--live: removing table inet {table}: {e}")))?;
    }
    events.stop(deadline_ns).map_err(failed_to_read)?;
    finish(
        tracing, selector, timeout, json, table, packets, lost, failed,
    )
}

/// One connection the programs reported: its explanation, the programs' steps, and what
/// happened (a translated connection's answer read from `np_nat`; a socket's from
/// conntrack's `entry` for it, when there is one).
fn ebpf_packet(
    tracing: &Tracing,
    (maps, pin_root): (&nodeport_proxy::ebpf::programs::Maps, &std::path::Path),
    e: &nodeport_proxy::ebpf::trace_events::TraceEvent,
    protocol: Protocol,
    entry: Option<conntrack::Entry>,
) -> anyhow::Result<LivePacket> {
    use nodeport_proxy::ebpf::maps::{CT_REPLY, CT_SNAT, Tuple};
    use nodeport_proxy::ebpf::trace_events::EventKind;
    let socket = matches!(e.kind, EventKind::SockDnat | EventKind::SockRefused);
    let t = &e.tuple;
    // A socket's connection: from the source conntrack names, else explained as one from
    // the node's own address of its family (a source is not known at connect()).
    let src = if let Some(c) = entry {
        c.orig_src
    } else if socket {
        tracing
            .prepared
            .facts
            .local_ips
            .iter()
            .copied()
            .find(|ip| ip.is_ipv4() == t.daddr.is_ipv4() && !ip.is_loopback())
            .unwrap_or(if t.daddr.is_ipv4() {
                IpAddr::from([0u8; 4])
            } else {
                IpAddr::from([0u8; 16])
            })
    } else {
        t.saddr
    };
    let packet = Packet {
        src,
        dst: t.daddr,
        proto: protocol,
        dport: t.dport,
        origin: if socket {
            Origin::Local
        } else {
            Origin::Remote
        },
    };
    let mut explanation = tracing.explain(&packet);
    explanation.path.clear();
    let program = if socket {
        if t.daddr.is_ipv4() {
            "np_connect4"
        } else {
            "np_connect6"
        }
    } else {
        "np_tc_ingress"
    };
    if !socket && let Some(name) = interface_name(Some(e.ifindex)) {
        explanation.packet.interface = Some(name);
    }
    let step = |what: &str, verdict: String| Step::program(program, what, verdict);
    let frontend = match &explanation.service {
        Some(s) => nodeport_proxy::trace::explain::ebpf_frontend(
            &format!(
                "{}/{}",
                SocketAddr::new(t.daddr, t.dport),
                protocol.as_lower()
            ),
            &s.port,
            s.frontend,
            Some(e.svc_id),
        ),
        None => format!(
            "{}/{}: frontend {}",
            SocketAddr::new(t.daddr, t.dport),
            protocol.as_lower(),
            e.svc_id
        ),
    };
    let mut path = vec![step("frontend", frontend)];
    // The explanation's reason for a drop or reject, as the nftables mode names it.
    let refusal = explanation
        .outcomes
        .iter()
        .find(|o| o.verdict != Fate::Dnat && o.verdict != Fate::Pass)
        .map(|o| (verdict_name(o.verdict), reason_name(o), o.message.clone()));
    let dropped = |verdict: &'static str, reason: &'static str, why: &str| {
        let (verdict, reason, message) =
            refusal
                .clone()
                .unwrap_or((verdict, reason, format!("{verdict}: {why}")));
        Seen {
            verdict,
            reason,
            message,
            at: Some(format!("ebpf {program}")),
            ..Seen::default()
        }
    };
    let seen = match e.kind {
        EventKind::Dnat => {
            let to = e.to.unwrap_or(SocketAddr::new(t.daddr, t.dport));
            let snat = e.flags & u16::from(CT_SNAT) != 0;
            let seen_by = e.snat.map_or(t.saddr, |a| a.ip());
            path.push(step("backend", format!("{to} chosen")));
            path.push(step(
                "snat",
                match e.snat {
                    Some(a) if snat => format!("source {t_s} becomes {a}", t_s = t.saddr),
                    _ => "source kept".to_string(),
                },
            ));
            // The backend's reply entry records its answer.
            let reply = Tuple {
                saddr: to.ip(),
                daddr: seen_by,
                sport: to.port(),
                dport: e.snat.filter(|_| snat).map_or(t.sport, |a| a.port()),
                proto: t.proto,
            };
            let until = Instant::now() + ANSWER_WAIT;
            let answered = loop {
                let nat = maps
                    .nat()
                    .map_err(|err| unreadable_pinned_maps("--live", pin_root, err))?;
                if nat
                    .iter()
                    .any(|(k, v)| *k == reply && v.flags & CT_REPLY != 0)
                {
                    break true;
                }
                if Instant::now() >= until {
                    break false;
                }
                std::thread::sleep(Duration::from_millis(50));
            };
            let source = if snat {
                format!("masqueraded to {seen_by}")
            } else {
                "not masqueraded".to_string()
            };
            let (reason, answer) = answered_words(answered);
            Seen {
                verdict: "dnat",
                reason,
                message: format!("DNAT to {to} ({program}), {source}; {answer}"),
                endpoint: Some(to),
                source_seen_by_endpoint: Some(seen_by),
                answered: Some(answered),
                ..Seen::default()
            }
        }
        EventKind::Reject => {
            path.push(step("verdict", "reject (ICMP port unreachable)".into()));
            dropped("reject", "no_endpoints", "no endpoints")
        }
        EventKind::DropNoEndpoints => {
            path.push(step("verdict", "drop (no endpoints)".into()));
            dropped("drop", "no_local_endpoints_external", "no endpoints")
        }
        EventKind::DropSource => {
            path.push(step(
                "source ranges",
                format!("{} is not in np_src_ranges: drop", t.saddr),
            ));
            dropped("drop", "source_ranges", "outside loadBalancerSourceRanges")
        }
        EventKind::DropOther => {
            path.push(step(
                "verdict",
                "drop (no backend chosen, or a map full)".into(),
            ));
            Seen {
                verdict: "drop",
                reason: "other",
                message: "drop: no backend could be chosen or a map is full".into(),
                at: Some(format!("ebpf {program}")),
                ..Seen::default()
            }
        }
        EventKind::SockDnat => {
            let to = e.to.unwrap_or(SocketAddr::new(t.daddr, t.dport));
            path.push(step(
                "backend",
                format!("{to} chosen: connect() goes there"),
            ));
            match entry {
                // TCP's conntrack states: 8 is CLOSE, where a reset ends a connection.
                Some(c) if c.seen_reply && c.tcp_state == Some(8) => Seen {
                    verdict: "dnat",
                    reason: "refused",
                    message: format!(
                        "connected to {to} at connect() ({program}), from {} (conntrack); \
                         refused: a TCP reset came back (nothing listens on that port there, \
                         or a firewall rejects with a reset)",
                        SocketAddr::new(c.orig_src, c.orig_sport)
                    ),
                    endpoint: Some(to),
                    source_seen_by_endpoint: Some(c.orig_src),
                    answered: Some(false),
                    refused_with: Some("tcp_reset"),
                    refused_by: Some(to.ip()),
                    ..Seen::default()
                },
                Some(c) => {
                    let (reason, answer) = answered_words(c.seen_reply);
                    Seen {
                        verdict: "dnat",
                        reason,
                        message: format!(
                            "connected to {to} at connect() ({program}), from {} (conntrack); \
                             {answer}",
                            SocketAddr::new(c.orig_src, c.orig_sport)
                        ),
                        endpoint: Some(to),
                        source_seen_by_endpoint: Some(c.orig_src),
                        answered: Some(c.seen_reply),
                        ..Seen::default()
                    }
                }
                None => Seen {
                    verdict: "dnat",
                    reason: "endpoint",
                    message: format!(
                        "connected to {to} at connect() ({program}): the socket's packets go \
                         to the backend untranslated; conntrack shows no connection of this \
                         node's to it (whether it answers is the socket's to see)"
                    ),
                    endpoint: Some(to),
                    ..Seen::default()
                },
            }
        }
        EventKind::SockRefused => {
            path.push(step("verdict", "connect() refused (ECONNREFUSED)".into()));
            let mut seen = dropped("reject", "no_endpoints", "no endpoints");
            seen.message = format!("{}: connect() refused with ECONNREFUSED", seen.message);
            seen
        }
    };
    Ok(LivePacket {
        source_port: entry.map_or(t.sport, |c| c.orig_sport),
        trace_id: None,
        explanation,
        path,
        seen,
    })
}
