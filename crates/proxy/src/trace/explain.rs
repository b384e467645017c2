//! A backend's [`Trace`] in Kubernetes' words: the Service port the packet addressed, the
//! endpoints it can reach with their probability (or Maglev share), masqueraded or not and
//! why, and its fate with the reason (no endpoints, a Local policy without a local
//! endpoint, `loadBalancerSourceRanges`, not a NodePort address, not a Service).
//!
//! The fates themselves come from the rules (or maps) as the tracer evaluated them; the
//! desired state only names them: which Service port owns the destination, which endpoint
//! is local, which Service setting the verdict follows from. A reason the Service's
//! settings do not explain is reported as such, with the chain that decided.

use std::fmt;
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;
use serde::Serialize;

use super::path::{self, Choosing, Step};
use super::{Fate, Origin, Packet, Trace};
use crate::desired::{DesiredState, ServicePortState};
use crate::model::{IpFamily, Protocol};
use crate::nodeaddr::Selection;

/// The dataplane whose rules were traced, for the words of the reasons.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Dataplane {
    /// nftables (either layout).
    Nftables,
    /// iptables.
    Iptables,
    /// eBPF (tc and cgroup socket programs).
    Ebpf,
}

/// What besides the rules the explanation needs.
#[derive(Debug, Clone)]
pub struct Context<'a> {
    /// The dataplane traced.
    pub dataplane: Dataplane,
    /// `--masquerade-all`.
    pub masquerade_all: bool,
    /// `--cluster-cidr`.
    pub cluster_cidrs: &'a [IpNet],
    /// `--nodeport-addresses` as given (for the "not a NodePort address" reason).
    pub nodeport_addresses: String,
    /// The node's own addresses.
    pub local_addrs: &'a [IpAddr],
    /// eBPF mode with `--ebpf-lb-algorithm maglev`: probabilities are table shares.
    pub maglev: bool,
    /// `net.ipv4.conf.<in>.route_localnet` as the node holds it (`--rules kernel`, `--live`);
    /// `None`: as the proxy leaves it, on only with its CVE-2020-8558 guard, which drops
    /// every packet from the network to 127.0.0.0/8 the rules do not translate.
    pub route_localnet: Option<bool>,
    /// iptables mode: a selection of every address (`0.0.0.0/0`) serves NodePorts on
    /// 127.0.0.1 too (`--iptables-localhost-nodeports`, default true, kube-proxy's). The
    /// nftables and ebpf modes never serve loopback under such a selection, nor any mode
    /// `::1`.
    pub localhost_nodeports: bool,
    /// nftables mode, flat layout: a rule of its shared chains that decided for the packet is
    /// named for the Service port in the path ([`path::name_steps`]).
    pub flat_layout: bool,
}

/// Which of a Service's addresses the packet was sent to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Frontend {
    /// `spec.clusterIPs`.
    ClusterIP,
    /// A NodePort on a NodePort address.
    NodePort,
    /// `spec.externalIPs`.
    ExternalIP,
    /// `status.loadBalancer.ingress[].ip`.
    LoadBalancerIP,
}

impl Frontend {
    /// Everything but the ClusterIP is external traffic (kube-proxy's external chain).
    pub fn is_external(self) -> bool {
        self != Frontend::ClusterIP
    }
}

/// The Service port a packet addressed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ServiceHit {
    /// `namespace/name:port/PROTOCOL`, e.g. `default/web:80/TCP`.
    pub port: String,
    /// `spec.ports[].name`, empty for an unnamed port.
    pub port_name: String,
    /// The address kind.
    pub frontend: Frontend,
    /// The traffic policy that applies (`externalTrafficPolicy` for external frontends,
    /// `internalTrafficPolicy` for the ClusterIP): `Cluster` or `Local`.
    pub traffic_policy: &'static str,
    /// `sessionAffinity: ClientIP` timeout, seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session_affinity_seconds: Option<u32>,
}

/// One endpoint the packet can be translated to.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Candidate {
    /// `ip:port` after DNAT.
    pub endpoint: SocketAddr,
    /// Probability of this endpoint (Maglev: its share of the table).
    pub probability: f64,
    /// The endpoint runs on this node.
    pub local: bool,
    /// The source is rewritten to the node's address.
    pub masquerade: bool,
    /// Why masqueraded or not.
    pub masquerade_reason: String,
}

/// The final verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Translated to an endpoint.
    Dnat,
    /// Rejected (ICMP port unreachable, TCP reset, `ECONNREFUSED`).
    Reject,
    /// Dropped silently.
    Drop,
    /// Passed on untranslated: not for a Service here.
    Pass,
}

/// Why a packet ends as it does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// It reaches one of the Service's endpoints.
    Endpoint,
    /// The Service has no usable endpoint at all (kube-proxy rejects).
    NoEndpoints,
    /// `externalTrafficPolicy: Local` and no endpoint on this node (kube-proxy drops).
    NoLocalEndpointsExternal,
    /// `internalTrafficPolicy: Local` and no endpoint on this node.
    NoLocalEndpointsInternal,
    /// The source is outside `loadBalancerSourceRanges`.
    SourceRanges,
    /// The port is a Service's NodePort, but the address is not a NodePort address under
    /// `--nodeport-addresses`.
    NotNodePortAddress,
    /// No Service has this address and port.
    NotAService,
    /// The address is in a ServiceCIDR but no Service has it (kube-proxy drops it).
    UnallocatedClusterIp,
    /// A loopback destination from the network, not translated: the CVE-2020-8558 guard
    /// drops it, or the kernel does (a martian destination with `route_localnet` off).
    Localnet,
    /// Dropped or rejected by another table than the proxy's (`nodeport trace --rules kernel`
    /// evaluates the node's other nftables tables; see `at`).
    OtherTable,
    /// Decided by a rule no Service setting explains (see `at`).
    Other,
}

/// One way the packet ends, with its probability.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Outcome {
    /// What happens.
    pub verdict: Verdict,
    /// Why.
    pub reason: Reason,
    /// The sentence a person reads.
    pub message: String,
    /// The chain (or program) that dropped or rejected it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub at: Option<String>,
    /// Probability of this outcome.
    pub probability: f64,
}

/// The packet as printed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PacketView {
    /// Source address.
    pub from: IpAddr,
    /// Destination address and port.
    pub to: SocketAddr,
    /// `tcp`, `udp` or `sctp`.
    pub protocol: &'static str,
    /// `input` (from the network) or `output` (from the node itself).
    pub path: &'static str,
    /// Input path: the interface it arrives on, when known (`--in-interface`, or the one
    /// holding the route back to the source). No rule the proxy writes matches on it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub interface: Option<String>,
}

/// A trace explained: what `nodeport trace` prints (`-o json`: this, serialized).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Explanation {
    /// The packet.
    pub packet: PacketView,
    /// Its way through the rules (or the programs' map look-ups), step by step, a random
    /// choice once with its candidates ([`path`]); empty when the tracer records none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub path: Vec<Step>,
    /// The dataplane traced.
    pub dataplane: Dataplane,
    /// How an endpoint is chosen: `random` (per new connection) or `maglev` (by the flow's
    /// hash; probabilities are shares of the table).
    pub endpoint_choice: &'static str,
    /// The Service port addressed, if any (also for a NodePort on an address that does not
    /// serve NodePorts).
    pub service: Option<ServiceHit>,
    /// The endpoints it can reach, most likely first.
    pub endpoints: Vec<Candidate>,
    /// Every way it ends, most likely first; the first is the fate printed.
    pub outcomes: Vec<Outcome>,
    /// Whose NodePort a packet to another address carries; and what the caller adds: rules
    /// that were not evaluated, a disagreement between the kernel and what the proxy would
    /// program.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

impl Explanation {
    /// The packet reaches an endpoint whatever the random choice.
    pub fn reaches_endpoint(&self) -> bool {
        !self.outcomes.is_empty() && self.outcomes.iter().all(|o| o.verdict == Verdict::Dnat)
    }
}

/// `default/web:80/TCP`; a port known by a name without namespace (the ebpf mode's maps
/// name none: `svc-7`, [`super::recover`]) is `svc-7:80/TCP`.
pub fn port_label(svc: &ServicePortState) -> String {
    let p = &svc.port;
    let proto = match p.name.protocol {
        Protocol::Tcp => "TCP",
        Protocol::Udp => "UDP",
        Protocol::Sctp => "SCTP",
    };
    if p.name.namespace.is_empty() {
        return format!("{}:{}/{proto}", p.name.name, p.port);
    }
    format!("{}/{}:{}/{proto}", p.name.namespace, p.name.name, p.port)
}

/// Finds the Service port owning `dst:dport/proto`, and whether the match is a NodePort on
/// an address `--nodeport-addresses` leaves out.
fn find<'a>(
    desired: &'a DesiredState,
    ctx: &Context<'_>,
    packet: &Packet,
) -> Option<(&'a ServicePortState, Frontend, bool)> {
    let fam = desired.family(IpFamily::of(packet.dst))?;
    let mut unselected = None;
    for svc in fam.services.values() {
        let port = &svc.port;
        if port.name.protocol != packet.proto {
            continue;
        }
        if port.port == packet.dport {
            if svc.cluster_ip == packet.dst {
                return Some((svc, Frontend::ClusterIP, false));
            }
            if svc.external_ips.contains(&packet.dst) {
                return Some((svc, Frontend::ExternalIP, false));
            }
            if svc.load_balancer_ips.contains(&packet.dst) {
                return Some((svc, Frontend::LoadBalancerIP, false));
            }
        }
        if port.node_port == Some(packet.dport) {
            let selected = match &fam.nodeport_ips {
                Selection::Ips(ips) => ips.contains(&packet.dst),
                Selection::MatchAll => {
                    ctx.local_addrs.contains(&packet.dst)
                        && (!packet.dst.is_loopback() || match_all_serves_loopback(ctx, packet))
                }
            };
            if selected {
                return Some((svc, Frontend::NodePort, false));
            }
            if ctx.local_addrs.contains(&packet.dst) || packet.dst.is_loopback() {
                unselected = Some((&**svc, Frontend::NodePort, true));
            }
        }
    }
    unselected
}

/// Whether a selection of every address serves NodePorts on the packet's loopback
/// destination: only the iptables mode's, for IPv4, with localhost NodePorts (kube-proxy's
/// `localhostNodePorts`); the nftables mode leaves loopback out (kube-proxy's nftables mode
/// has no localhost NodePorts), the ebpf mode serves no frontend on it under such a
/// selection.
fn match_all_serves_loopback(ctx: &Context<'_>, packet: &Packet) -> bool {
    ctx.dataplane == Dataplane::Iptables && ctx.localhost_nodeports && packet.dst.is_ipv4()
}

/// Why a selection of every address leaves the packet's loopback destination out, for the
/// "not a NodePort address" reason.
fn loopback_left_out(ctx: &Context<'_>, packet: &Packet) -> &'static str {
    if packet.dst.is_ipv6() {
        return " (no mode serves NodePorts on the IPv6 loopback address)";
    }
    match ctx.dataplane {
        Dataplane::Nftables => {
            " (a selection of every address leaves loopback out in the nftables mode, as \
             kube-proxy's does; 127.0.0.0/8 in --nodeport-addresses asks for localhost \
             NodePorts)"
        }
        Dataplane::Ebpf => {
            " (a selection of every address leaves loopback out in the ebpf mode; 127.0.0.0/8 \
             in --nodeport-addresses asks for localhost NodePorts)"
        }
        Dataplane::Iptables => " (--iptables-localhost-nodeports is off)",
    }
}

/// Explains `trace` (of `packet`) with the Services of `desired`.
pub fn explain(desired: &DesiredState, ctx: &Context<'_>, trace: &Trace) -> Explanation {
    let packet = &trace.packet;
    let found = find(desired, ctx, packet);
    let service = found.map(|(svc, frontend, _)| ServiceHit {
        port: port_label(svc),
        port_name: svc.port.name.port.to_string(),
        frontend,
        traffic_policy: policy(svc, frontend),
        session_affinity_seconds: svc.port.session_affinity_seconds,
    });
    let mut endpoints = Vec::new();
    let mut outcomes: Vec<Outcome> = Vec::new();
    for (fate, p) in &trace.fates {
        let (verdict, chain) = match fate {
            Fate::Delivered {
                dnat: Some(to),
                masqueraded,
                ..
            } => {
                let local = found.is_some_and(|(svc, ..)| {
                    svc.cluster_endpoints
                        .iter()
                        .chain(&svc.local_endpoints)
                        .any(|e| e.socket() == *to && e.local)
                });
                let reason = masquerade_reason(ctx, packet, found, *to, local, *masqueraded);
                endpoints.push(Candidate {
                    endpoint: *to,
                    probability: *p,
                    local,
                    masquerade: *masqueraded,
                    masquerade_reason: reason,
                });
                continue;
            }
            Fate::Delivered { dnat: None, .. } => (Verdict::Pass, None),
            Fate::Dropped(chain) => (Verdict::Drop, Some(chain.clone())),
            Fate::Rejected(chain) => (Verdict::Reject, Some(chain.clone())),
        };
        let cidrs = desired
            .family(IpFamily::of(packet.dst))
            .map_or(&[][..], |f| &f.service_cidrs[..]);
        let match_all = desired
            .family(IpFamily::of(packet.dst))
            .is_some_and(|f| f.nodeport_ips == Selection::MatchAll);
        let (verdict, reason, message) =
            match loopback_from_network(ctx, packet, verdict, chain.as_deref()) {
                Some(kernel) => kernel,
                None => {
                    let (reason, message) = why(
                        ctx,
                        packet,
                        found,
                        (cidrs, match_all),
                        verdict,
                        chain.as_deref(),
                    );
                    (verdict, reason, message)
                }
            };
        outcomes.push(Outcome {
            verdict,
            reason,
            message,
            at: chain,
            probability: *p,
        });
    }
    // Most likely first; equal shares (up to rounding: 1/3 reached through 2/3 · 1/2 is not
    // bit for bit 1/3) by address, so that every mode lists them alike.
    let share = |c: &Candidate| (c.probability * 1e9).round() as i64;
    endpoints.sort_by(|a, b| {
        share(b)
            .cmp(&share(a))
            .then_with(|| a.endpoint.cmp(&b.endpoint))
    });
    if !endpoints.is_empty() {
        let total: f64 = endpoints.iter().map(|c| c.probability).sum();
        let list: Vec<String> = endpoints.iter().map(|c| c.endpoint.to_string()).collect();
        let message = match list.as_slice() {
            [one] => format!("DNAT to {one}"),
            _ => format!("DNAT to one of {}", list.join(", ")),
        };
        outcomes.push(Outcome {
            verdict: Verdict::Dnat,
            reason: Reason::Endpoint,
            message,
            at: None,
            probability: total,
        });
    }
    outcomes.sort_by(|a, b| b.probability.total_cmp(&a.probability));
    // A NodePort's number to an address that is not the node's: not a Service there, but
    // say whose NodePort it is (a client that got the address wrong, or one the node no
    // longer holds).
    let mut notes = Vec::new();
    if outcomes.iter().any(|o| o.reason == Reason::NotAService)
        && !ctx.local_addrs.contains(&packet.dst)
        && let Some(svc) = desired
            .family(IpFamily::of(packet.dst))
            .into_iter()
            .flat_map(|f| f.services.values())
            .find(|s| {
                s.port.node_port == Some(packet.dport) && s.port.name.protocol == packet.proto
            })
    {
        notes.push(format!(
            "{}/{} is the NodePort of {}, but {} is not an address of this node: NodePorts \
             answer on the node's own addresses",
            packet.dport,
            packet.proto.as_lower(),
            port_label(svc),
            packet.dst
        ));
    }
    let choosing = if ctx.maglev {
        Choosing::Maglev
    } else {
        Choosing::Random
    };
    let mut steps = path::fold(&trace.walks, choosing);
    if let (Some((svc, frontend, _)), Some(hit)) = (found, &service) {
        path::name_steps(&mut steps, svc, &hit.port, ctx.flat_layout);
        name_ebpf_frontends(&mut steps, &hit.port, frontend);
    }
    Explanation {
        path: steps,
        packet: PacketView {
            from: packet.src,
            to: SocketAddr::new(packet.dst, packet.dport),
            protocol: packet.proto.as_lower(),
            path: match packet.origin {
                Origin::Remote => "input",
                Origin::Local => "output",
            },
            interface: None,
        },
        dataplane: ctx.dataplane,
        endpoint_choice: if ctx.maglev { "maglev" } else { "random" },
        service,
        endpoints,
        outcomes,
        notes,
    }
}

/// An eBPF program's `frontend` step for a Service port: `192.0.2.10:30080/tcp is
/// default/web:80/TCP (NodePort, frontend 3)` (`id`: the kernel's service id, when known),
/// as `--live` and a trace of the kernel's maps print it.
pub fn ebpf_frontend(to: &str, label: &str, frontend: Frontend, id: Option<u32>) -> String {
    match id {
        Some(id) => format!("{to} is {label} ({frontend:?}, frontend {id})"),
        None => format!("{to} is {label} ({frontend:?})"),
    }
}

/// Names the eBPF tracer's `frontend` steps (`192.0.2.10:30080/tcp: frontend 3`) for the
/// Service port the explanation found, as [`ebpf_frontend`].
fn name_ebpf_frontends(steps: &mut [Step], label: &str, frontend: Frontend) {
    for s in steps {
        if s.kind == "choice" {
            for c in &mut s.candidates {
                name_ebpf_frontends(&mut c.path, label, frontend);
            }
            continue;
        }
        if s.family != "ebpf" || s.chain != "frontend" {
            continue;
        }
        if let Some((to, id)) = s.verdict.split_once(": frontend") {
            let id = id.trim().parse().ok();
            s.verdict = ebpf_frontend(to, label, frontend, id);
        }
    }
}

fn policy(svc: &ServicePortState, frontend: Frontend) -> &'static str {
    let local = if frontend.is_external() {
        svc.external_policy_local()
    } else {
        svc.port.internal_policy_local
    };
    if local { "Local" } else { "Cluster" }
}

/// Why a packet that is not translated ends as it does, from the Service's settings; a
/// verdict they do not explain is `Other`, naming the chain. `match_all`: the NodePort
/// addresses are every address of the node.
fn why(
    ctx: &Context<'_>,
    packet: &Packet,
    found: Option<(&ServicePortState, Frontend, bool)>,
    (service_cidrs, match_all): (&[IpNet], bool),
    verdict: Verdict,
    chain: Option<&str>,
) -> (Reason, String) {
    // The chain is named only when no Service setting explains the verdict (kube-proxy's
    // chain names carry hashes); `Outcome::at` always has it.
    let at = chain.map(|c| format!(" in {c}")).unwrap_or_default();
    let Some((svc, frontend, unselected)) = found else {
        return match verdict {
            Verdict::Pass => (
                Reason::NotAService,
                format!(
                    "not a Service: no Service has {}/{}; passed on untranslated",
                    SocketAddr::new(packet.dst, packet.dport),
                    packet.proto.as_lower()
                ),
            ),
            // kube-proxy's nftables mode drops traffic to an address of a ServiceCIDR that no
            // Service has (its `cluster-ips-check` chain).
            _ if service_cidrs.iter().any(|n| n.contains(&packet.dst)) => (
                Reason::UnallocatedClusterIp,
                format!(
                    "{}: {} is in the ServiceCIDR {} but no Service has it (an unallocated \
                     ClusterIP)",
                    verb(verdict),
                    packet.dst,
                    service_cidrs
                        .iter()
                        .find(|n| n.contains(&packet.dst))
                        .expect("found above")
                ),
            ),
            _ => (Reason::Other, format!("{}{at}", verb(verdict))),
        };
    };
    let label = port_label(svc);
    if unselected {
        let why =
            if match_all && packet.dst.is_loopback() && !match_all_serves_loopback(ctx, packet) {
                loopback_left_out(ctx, packet)
            } else {
                ""
            };
        return (
            Reason::NotNodePortAddress,
            format!(
                "not a NodePort address: {} is not selected by --nodeport-addresses {}{why}, \
                 so NodePort {} of {label} does not answer there",
                packet.dst, ctx.nodeport_addresses, packet.dport
            ),
        );
    }
    let external = frontend.is_external();
    let local_policy = if external {
        svc.external_policy_local()
    } else {
        svc.port.internal_policy_local
    };
    let in_ranges =
        svc.source_ranges.iter().any(|r| r.contains(&packet.src)) || svc.source_ranges.is_empty();
    // nftables checks the source ranges first (kube-proxy's `firewall-check`, in
    // filter-prerouting, whatever the endpoints); iptables writes no firewall rule for a
    // Service without endpoints (it rejects them all), nor does the eBPF tc program look at
    // the ranges before its no-endpoint verdict.
    let out_of_range = frontend == Frontend::LoadBalancerIP && !in_ranges;
    let reason = match verdict {
        Verdict::Pass => Reason::Other,
        _ if out_of_range && ctx.dataplane == Dataplane::Nftables => Reason::SourceRanges,
        _ if !svc.has_endpoints => Reason::NoEndpoints,
        _ if out_of_range => Reason::SourceRanges,
        _ if local_policy && svc.local_endpoints.is_empty() => {
            if external {
                Reason::NoLocalEndpointsExternal
            } else {
                Reason::NoLocalEndpointsInternal
            }
        }
        _ => Reason::Other,
    };
    let message = match reason {
        Reason::NoEndpoints => format!("{}: {label} has no endpoints", verb(verdict)),
        Reason::SourceRanges => {
            let ranges: Vec<String> = svc.source_ranges.iter().map(|r| r.to_string()).collect();
            format!(
                "{}: {} is not in loadBalancerSourceRanges {} of {label}",
                verb(verdict),
                packet.src,
                ranges.join(", ")
            )
        }
        Reason::NoLocalEndpointsExternal => format!(
            "{}: externalTrafficPolicy Local and {label} has no endpoint on this node",
            verb(verdict)
        ),
        Reason::NoLocalEndpointsInternal => format!(
            "{}: internalTrafficPolicy Local and {label} has no endpoint on this node",
            verb(verdict)
        ),
        _ if verdict == Verdict::Pass => format!("passed on untranslated although {label} owns it"),
        _ => format!("{}{at}", verb(verdict)),
    };
    (reason, message)
}

/// A packet from the network to a loopback address that the rules do not translate: the
/// CVE-2020-8558 guard's drop (kube-proxy's `block incoming localnet connections`, in the
/// proxy's `localnet-check` / `KUBE-FIREWALL`: with `route_localnet` on for localhost
/// NodePorts, only what was DNATed may pass), or the kernel's own drop after the rules
/// (`route_localnet` off: 127.0.0.0/8 from outside is a martian destination; `::1` from
/// outside never even reaches a rule). A NodePort on 127.0.0.1 that the rules DNAT is
/// served, as kube-proxy serves it (`! --ctstate DNAT` in its guard).
fn loopback_from_network(
    ctx: &Context<'_>,
    packet: &Packet,
    verdict: Verdict,
    chain: Option<&str>,
) -> Option<(Verdict, Reason, String)> {
    if packet.origin != Origin::Remote || !packet.dst.is_loopback() || verdict == Verdict::Dnat {
        return None;
    }
    let dst = packet.dst;
    if dst.is_ipv6() {
        return Some((
            Verdict::Drop,
            Reason::Localnet,
            format!(
                "drop: {dst} from the network: the kernel drops a packet to the IPv6 loopback \
                 address that arrives on another interface than lo, before any rule"
            ),
        ));
    }
    match verdict {
        Verdict::Pass if ctx.route_localnet != Some(true) => Some((
            Verdict::Drop,
            Reason::Localnet,
            format!(
                "drop: {dst} from the network is a martian destination: with route_localnet \
                 off the kernel's routing drops it, NodePort or not"
            ),
        )),
        Verdict::Drop | Verdict::Reject
            if chain.is_some_and(|c| {
                c == crate::nftables::names::LOCALNET_CHECK
                    || c == crate::iptables::names::KUBE_FIREWALL
            }) =>
        {
            Some((
                Verdict::Drop,
                Reason::Localnet,
                format!(
                    "drop: {dst} from the network, not DNATed to a Service: route_localnet is \
                     on (localhost NodePorts) and the guard against CVE-2020-8558 drops it \
                     (kube-proxy's \"block incoming localnet connections\")"
                ),
            ))
        }
        _ => None,
    }
}

fn verb(v: Verdict) -> &'static str {
    match v {
        Verdict::Reject => "reject",
        Verdict::Drop => "drop",
        Verdict::Pass => "pass",
        Verdict::Dnat => "DNAT",
    }
}

/// Why the rules masqueraded a packet to `to` or not, from the Service's settings and the
/// flags, following kube-proxy's decisions (its `mark-for-masquerade` jumps). A verdict the
/// settings do not explain says so rather than guess.
fn masquerade_reason(
    ctx: &Context<'_>,
    packet: &Packet,
    found: Option<(&ServicePortState, Frontend, bool)>,
    to: SocketAddr,
    local_endpoint: bool,
    masqueraded: bool,
) -> String {
    let Some((svc, frontend, _)) = found else {
        return if masqueraded {
            "by a rule no Service explains".into()
        } else {
            "no masquerade rule matched".into()
        };
    };
    let from_node = packet.origin == Origin::Local;
    let in_cluster = ctx.cluster_cidrs.iter().any(|c| c.contains(&packet.src));
    let ebpf = ctx.dataplane == Dataplane::Ebpf;
    if ebpf && from_node {
        return "the node's own socket is connected to the endpoint directly (cgroup hook), \
                there is nothing to masquerade"
            .into();
    }
    if masqueraded {
        if frontend.is_external() && !svc.external_policy_local() {
            return "externalTrafficPolicy Cluster: the source becomes this node's address so \
                    that replies come back through it"
                .into();
        }
        if ebpf && !local_endpoint {
            return "the endpoint is on another node: SNAT to this node so that its replies \
                    come back through it"
                .into();
        }
        if frontend == Frontend::ClusterIP && ctx.masquerade_all {
            return "--masquerade-all".into();
        }
        if frontend == Frontend::ClusterIP && !ctx.cluster_cidrs.is_empty() && !in_cluster {
            return format!(
                "the source {} is outside --cluster-cidr (off-cluster traffic to a ClusterIP)",
                packet.src
            );
        }
        if to.ip() == packet.src {
            return "hairpin: the endpoint is the client itself".into();
        }
        if frontend.is_external() && from_node {
            return "traffic from the node itself to an external address takes the Cluster \
                    policy's endpoints and is masqueraded (kube-proxy's short-circuit of local \
                    traffic)"
                .into();
        }
        return "by a rule no Service setting explains".into();
    }
    if frontend.is_external() && svc.external_policy_local() {
        return "externalTrafficPolicy Local keeps the client's address".into();
    }
    if frontend == Frontend::ClusterIP {
        if ebpf && ctx.cluster_cidrs.is_empty() {
            return "the endpoint is on this node: no SNAT needed".into();
        }
        if !ctx.cluster_cidrs.is_empty() && in_cluster {
            return format!("the source {} is a pod (inside --cluster-cidr)", packet.src);
        }
        if ctx.cluster_cidrs.is_empty() {
            return "ClusterIP traffic is masqueraded only under --masquerade-all or from \
                    outside --cluster-cidr (not set)"
                .into();
        }
    }
    "no masquerade rule matched".into()
}

impl fmt::Display for Explanation {
    /// One line per step, for people.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = &self.packet;
        let path = match p.path {
            "input" => "from the network (input path)",
            _ => "from this node (output path)",
        };
        write!(
            f,
            "packet      {} → {}/{}, {path}",
            p.from, p.to, p.protocol
        )?;
        if let Some(i) = &p.interface {
            write!(f, ", on {i}")?;
        }
        writeln!(f)?;
        path::write_lines(f, &self.path)?;
        match &self.service {
            Some(s) => {
                let kind = match s.frontend {
                    Frontend::ClusterIP => "ClusterIP",
                    Frontend::NodePort => "NodePort",
                    Frontend::ExternalIP => "external IP",
                    Frontend::LoadBalancerIP => "load-balancer IP",
                };
                let policy = if s.frontend.is_external() {
                    "externalTrafficPolicy"
                } else {
                    "internalTrafficPolicy"
                };
                write!(
                    f,
                    "service     {}: {kind} {}, {policy} {}",
                    s.port, p.to, s.traffic_policy
                )?;
                if let Some(t) = s.session_affinity_seconds {
                    write!(f, ", sessionAffinity ClientIP {t}s")?;
                }
                writeln!(f)?;
            }
            None => writeln!(f, "service     none")?,
        }
        let share = if self.endpoint_choice == "maglev" {
            " of the Maglev table"
        } else {
            ""
        };
        for c in &self.endpoints {
            let place = if c.local { "this node" } else { "another node" };
            writeln!(
                f,
                "endpoint    {}  {:.2}%{share}  on {place}",
                c.endpoint,
                c.probability * 100.0,
            )?;
        }
        let yes = |c: &Candidate| if c.masquerade { "yes" } else { "no" };
        let uniform = self.endpoints.windows(2).all(|w| {
            w[0].masquerade == w[1].masquerade && w[0].masquerade_reason == w[1].masquerade_reason
        });
        match self.endpoints.first() {
            Some(c) if uniform => writeln!(f, "masquerade  {}: {}", yes(c), c.masquerade_reason)?,
            _ => {
                for c in &self.endpoints {
                    writeln!(
                        f,
                        "masquerade  {} to {}: {}",
                        yes(c),
                        c.endpoint,
                        c.masquerade_reason
                    )?;
                }
            }
        }
        for (i, o) in self.outcomes.iter().enumerate() {
            let label = if i == 0 { "fate" } else { "or" };
            write!(f, "{label:<11} {}", o.message)?;
            if self.outcomes.len() > 1 {
                write!(f, " ({:.2}%)", o.probability * 100.0)?;
            }
            writeln!(f)?;
        }
        for note in &self.notes {
            writeln!(f, "note        {note}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::desired::{self, NodeView, StateConfig};
    use crate::nodeaddr::NodeFacts;
    use crate::objects;

    const WEB: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec: {type: NodePort, clusterIP: 10.96.0.10, ports: [{port: 80, targetPort: 8080, nodePort: 30080}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: default, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{port: 8080}]
endpoints: [{addresses: [10.244.1.5], nodeName: node-a}]
"#;

    fn node() -> Vec<IpAddr> {
        vec!["192.0.2.10".parse().unwrap()]
    }

    fn explained(fates: Vec<(Fate, f64)>, packet: Packet) -> Explanation {
        let cluster = objects::load(WEB).expect("objects").cluster;
        let facts = NodeFacts {
            node_ips: node(),
            local_ips: node(),
            ..Default::default()
        };
        let state = desired::build(
            &cluster,
            NodeView::named("node-a"),
            &facts,
            &StateConfig::default(),
        );
        let addrs = node();
        let ctx = Context {
            dataplane: Dataplane::Nftables,
            masquerade_all: false,
            cluster_cidrs: &[],
            nodeport_addresses: "primary".into(),
            local_addrs: &addrs,
            maglev: false,
            route_localnet: None,
            localhost_nodeports: true,
            flat_layout: true,
        };
        explain(
            &state,
            &ctx,
            &Trace {
                packet,
                fates,
                walks: Vec::new(),
            },
        )
    }

    #[test]
    fn a_verdict_no_service_setting_explains_is_reported_with_its_chain_not_guessed() {
        // The Service has a local endpoint and no source ranges: nothing in its settings
        // explains a drop, so the reason is `Other` and the chain is named.
        let e = explained(
            vec![(Fate::Dropped("filter-input".into()), 1.0)],
            Packet::remote("203.0.113.5", "192.0.2.10", Protocol::Tcp, 30080),
        );
        assert_eq!(e.service.as_ref().unwrap().port, "default/web:80/TCP");
        assert_eq!(e.outcomes[0].reason, Reason::Other);
        assert_eq!(e.outcomes[0].message, "drop in filter-input");
        assert!(!e.reaches_endpoint());
    }

    #[test]
    fn a_packet_that_can_end_in_two_ways_reaches_an_endpoint_only_if_every_way_does() {
        let to: SocketAddr = "10.244.1.5:8080".parse().unwrap();
        let delivered = Fate::Delivered {
            dnat: Some(to),
            masqueraded: true,
            affinity: vec![],
        };
        let e = explained(
            vec![
                (delivered.clone(), 0.75),
                (Fate::Rejected("services".into()), 0.25),
            ],
            Packet::remote("203.0.113.5", "192.0.2.10", Protocol::Tcp, 30080),
        );
        assert!(!e.reaches_endpoint());
        assert_eq!(e.outcomes[0].verdict, Verdict::Dnat);
        assert_eq!(e.outcomes[0].probability, 0.75);
        let text = e.to_string();
        assert!(
            text.contains("fate        DNAT to 10.244.1.5:8080 (75.00%)"),
            "{text}"
        );
        assert!(
            text.contains("or          reject in services (25.00%)"),
            "{text}"
        );

        let e = explained(
            vec![(delivered, 1.0)],
            Packet::remote("203.0.113.5", "192.0.2.10", Protocol::Tcp, 30080),
        );
        assert!(e.reaches_endpoint());
        assert!(e.endpoints[0].local);
    }
}
