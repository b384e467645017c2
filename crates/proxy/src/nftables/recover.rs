//! The Service ports a `kube-proxy` table names, recovered from the table alone (either
//! layout), for `nodeport trace --rules kernel` without objects ([`crate::trace::recover`]).
//!
//! * **flat**: every element carries its Service port's name as its comment
//!   ([`super::flat::element_comment`]); the set it is in says what it is (`cluster-ips`, the
//!   policy sets, the endpoint maps by slot, the no-endpoint sets, `firewall-allow`,
//!   `sticky-…`). The protocol comes from the keys, the port number from the destinations.
//! * **kube-proxy**: `service-ips` / `service-nodeports` send each destination to a chain
//!   whose name holds the Service port (`service-<H>-default/web/tcp/http`); the chain's
//!   kind says the policy (`service-` Cluster, `local-` Local, `external-`), its `goto`s the
//!   endpoints (`endpoint-…` chains, each with its DNAT); the no-endpoint maps carry the
//!   name as a comment; `firewall-<H>` chains hold the source ranges. The flat layout's
//!   IPv6 session-affinity ports are this form too.
//!
//! What the table cannot say: whether an unguarded external destination is an external IP or
//! a load-balancer IP (taken as an external IP), and, in the flat layout, an
//! `internalTrafficPolicy: Local` ClusterIP that no other destination of the port shows to
//! differ from the Cluster list (taken as Cluster).

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;

use super::names::*;
use super::ruleset::{AddrMatch, ElemKey, Expr, Table, Verdict};
use crate::model::{Protocol, ServicePortName};
use crate::trace::recover::{PortFacts, Recovered, parse_port_name};

/// Reads what `table` says of its Service ports into `into`.
pub fn recover(table: &Table, into: &mut Recovered) {
    let family = table.family;
    let facts = into.family(family);
    if table.sets().any(|s| s.name == NODEPORT_IPS) {
        facts.nodeport_ips = Some(
            table
                .elements()
                .iter()
                .filter(|e| e.set == NODEPORT_IPS)
                .filter_map(|e| match e.key {
                    ElemKey::Addr(ip) => Some(ip),
                    _ => None,
                })
                .collect(),
        );
    }
    if let Some(check) = table.chain(CLUSTER_IPS_CHECK) {
        for rule in &check.rules {
            if !rule.exprs.contains(&Expr::Verdict(Verdict::Drop)) {
                continue;
            }
            for e in &rule.exprs {
                match e {
                    Expr::Daddr {
                        negate: false,
                        value: AddrMatch::Net(net),
                    } => facts.service_cidrs.push(*net),
                    Expr::Daddr {
                        negate: false,
                        value: AddrMatch::Nets(nets),
                    } => facts.service_cidrs.extend(nets),
                    _ => {}
                }
            }
        }
    }
    flat(table, into);
    chains(table, into);
    masquerade_policy(table, into);
}

/// `--cluster-cidr` and `--masquerade-all` as the ClusterIP masquerade rules show them: the
/// flat layout's `cluster-ip-policy` chain, kube-proxy's per-port policy chains (`ip daddr
/// <ClusterIP> [ip saddr != <cluster CIDR>] jump mark-for-masquerade`).
fn masquerade_policy(table: &Table, into: &mut Recovered) {
    let marks = |r: &super::ruleset::Rule| {
        r.exprs.contains(&Expr::Verdict(Verdict::Jump(
            MARK_FOR_MASQUERADE.to_string(),
        )))
    };
    for chain in table.chains() {
        let flat = chain.name == CLUSTER_IP_POLICY;
        let per_port = matches!(port_chain(&chain.name), Some(("service-" | "local-", _)));
        if !flat && !per_port {
            continue;
        }
        for rule in chain.rules.iter().filter(|r| marks(r)) {
            // kube-proxy's layout: only the ClusterIP's rule names a destination.
            if per_port
                && !rule.exprs.iter().any(|e| {
                    matches!(
                        e,
                        Expr::Daddr {
                            negate: false,
                            value: AddrMatch::Addr(_)
                        }
                    )
                })
            {
                continue;
            }
            let off_cluster = rule.exprs.iter().find_map(|e| match e {
                Expr::Saddr {
                    negate: true,
                    value: AddrMatch::Net(net),
                } => Some(*net),
                _ => None,
            });
            match off_cluster {
                Some(net) => {
                    into.cluster_cidrs.insert(net);
                }
                None => into.masquerade_all = true,
            }
        }
    }
}

/// The protocol and destination an element's key names (`None` for keys without one).
fn key_parts(key: &ElemKey) -> (Option<Protocol>, Option<IpAddr>, Option<u16>, Option<u32>) {
    match *key {
        ElemKey::AddrProtoPort(ip, p, port) => (Some(p), Some(ip), Some(port), None),
        ElemKey::AddrProtoPortSlot(ip, p, port, slot) => {
            (Some(p), Some(ip), Some(port), Some(slot))
        }
        ElemKey::AddrProtoPortNet(ip, p, port, _) => (Some(p), Some(ip), Some(port), None),
        ElemKey::ProtoPort(p, port) => (Some(p), None, Some(port), None),
        ElemKey::ProtoPortSlot(p, port, slot) => (Some(p), None, Some(port), Some(slot)),
        _ => (None, None, None, None),
    }
}

/// One destination of a flat-layout port: what the sets say of it.
#[derive(Default)]
struct Dst {
    /// The Service port's `port` (or the NodePort).
    port: Option<u16>,
    /// `service-endpoints` / `nodeport-endpoints` by slot: the policy's list.
    listed: BTreeMap<u32, SocketAddr>,
    /// `*-cluster-endpoints` by slot: the Cluster list of a Local-policy destination.
    cluster: BTreeMap<u32, SocketAddr>,
    masquerade: bool,
    local_policy: bool,
    no_endpoints: bool,
    no_local_endpoints: bool,
    firewall: bool,
}

/// One flat-layout Service port, before its protocol is known.
#[derive(Default)]
struct FlatPort {
    protocol: Option<Protocol>,
    cluster_ip: Option<IpAddr>,
    /// Destinations by address (ClusterIP, external, load balancer).
    dsts: BTreeMap<IpAddr, Dst>,
    /// The NodePort.
    nodeport: Option<Dst>,
    ranges: BTreeSet<IpNet>,
    affinity: Option<u32>,
}

/// The flat layout's elements, by their comment.
fn flat(table: &Table, into: &mut Recovered) {
    // Every ClusterIP: `cluster-ips` holds one element per address, commented with the first
    // of the Service's ports (the ports share it), so a port's ClusterIP is the destination
    // of its own elements that is in the set.
    let cluster_ips: BTreeSet<IpAddr> = table
        .elements()
        .iter()
        .filter(|e| e.set == CLUSTER_IPS)
        .filter_map(|e| match e.key {
            ElemKey::Addr(ip) => Some(ip),
            _ => None,
        })
        .collect();
    let mut ports: BTreeMap<&str, FlatPort> = BTreeMap::new();
    for e in table.elements() {
        // Verdict-map elements (kube-proxy's chains for IPv6 affinity) are read by `chains`.
        if e.value.is_some() {
            continue;
        }
        let Some(comment) = e.comment.as_deref() else {
            continue;
        };
        let p = ports.entry(comment).or_default();
        let (protocol, ip, port, slot) = key_parts(&e.key);
        p.protocol = p.protocol.or(protocol);
        let set = e.set;
        if set == CLUSTER_IPS {
            continue;
        }
        if let Some(ip) = ip.filter(|ip| cluster_ips.contains(ip)) {
            p.cluster_ip = Some(ip);
        }
        if let Some(t) = set
            .strip_prefix("sticky-ips-")
            .or_else(|| set.strip_prefix("sticky-nodeports-"))
        {
            p.affinity = t.parse().ok();
            continue;
        }
        let dst = match ip {
            Some(ip) => p.dsts.entry(ip).or_default(),
            None => p.nodeport.get_or_insert_with(Dst::default),
        };
        dst.port = dst.port.or(port);
        match (set, slot, e.data) {
            (SERVICE_ENDPOINTS | NODEPORT_ENDPOINTS, Some(s), Some(to)) => {
                dst.listed.insert(s, to);
            }
            (SERVICE_CLUSTER_ENDPOINTS | NODEPORT_CLUSTER_ENDPOINTS, Some(s), Some(to)) => {
                dst.cluster.insert(s, to);
            }
            (MASQUERADE_IPS | MASQUERADE_NODEPORTS, ..) => dst.masquerade = true,
            (LOCAL_POLICY_IPS | LOCAL_POLICY_NODEPORTS, ..) => dst.local_policy = true,
            (NO_ENDPOINT_SERVICES | NO_ENDPOINT_NODEPORTS, ..) => dst.no_endpoints = true,
            (NO_LOCAL_ENDPOINT_SERVICES | NO_LOCAL_ENDPOINT_NODEPORTS, ..) => {
                dst.no_local_endpoints = true;
            }
            (FIREWALL_IPS, ..) => dst.firewall = true,
            (FIREWALL_ALLOW, ..) => {
                if let ElemKey::AddrProtoPortNet(_, _, _, net) = e.key {
                    p.ranges.insert(net);
                }
            }
            _ => {}
        }
    }
    for (comment, p) in ports {
        let Some(name) = parse_port_name(comment, p.protocol.unwrap_or(Protocol::Tcp)) else {
            continue;
        };
        // Kube-proxy chains (IPv6 affinity) name the port themselves; its filter elements
        // are read here too, into the same facts.
        let f = into.port(table.family, &name);
        f.session_affinity_seconds = f.session_affinity_seconds.or(p.affinity);
        if let Some(ip) = p.cluster_ip {
            f.cluster_ip = Some(ip);
        }
        let in_order = |m: &BTreeMap<u32, SocketAddr>| {
            let mut v = Vec::new();
            for e in m.values() {
                PortFacts::push_endpoint(&mut v, *e);
            }
            v
        };
        // The Cluster list, where some destination shows it.
        let mut cluster: Option<Vec<SocketAddr>> = None;
        let mut external_local = false;
        let external = p
            .dsts
            .iter()
            .filter(|(ip, _)| Some(**ip) != p.cluster_ip)
            .map(|(_, d)| d)
            .chain(&p.nodeport);
        for d in external {
            f.no_endpoints |= d.no_endpoints;
            if d.local_policy || d.no_local_endpoints {
                external_local = true;
                if !d.cluster.is_empty() {
                    cluster = Some(in_order(&d.cluster));
                }
                if d.no_local_endpoints {
                    f.local_list();
                } else {
                    for e in in_order(&d.listed) {
                        PortFacts::push_endpoint(f.local_list(), e);
                    }
                }
            } else if d.masquerade && !d.listed.is_empty() {
                cluster = Some(in_order(&d.listed));
            }
        }
        f.external_policy_local |= external_local;
        for (ip, d) in &p.dsts {
            if Some(*ip) == p.cluster_ip {
                f.port = f.port.or(d.port);
                f.no_endpoints |= d.no_endpoints;
                let listed = in_order(&d.listed);
                if d.no_local_endpoints {
                    f.internal_policy_local = true;
                    f.local_list();
                } else if cluster.as_ref().is_some_and(|c| {
                    listed.iter().any(|e| !c.contains(e)) || listed.len() < c.len()
                }) {
                    // Not the Cluster list the external destinations show: the Local one.
                    f.internal_policy_local = true;
                    for e in listed {
                        PortFacts::push_endpoint(f.local_list(), e);
                    }
                } else if cluster.is_none() && !listed.is_empty() {
                    cluster = Some(listed);
                }
                continue;
            }
            f.port = f.port.or(d.port);
            if d.firewall {
                f.load_balancer_ips.insert(*ip);
            } else {
                f.external_ips.insert(*ip);
            }
        }
        if let Some(np) = &p.nodeport {
            f.node_port = f.node_port.or(np.port);
        }
        // A load-balancer IP the node's own address range admits is admitted as a source too
        // (hairpin): that is not one of the Service's ranges.
        for range in p.ranges {
            let own = range.prefix_len() == range.max_prefix_len()
                && f.load_balancer_ips.contains(&range.addr());
            if !own {
                f.source_ranges.insert(range);
            }
        }
        for e in cluster.into_iter().flatten() {
            PortFacts::push_endpoint(&mut f.cluster_endpoints, e);
        }
    }
}

/// The kind and base of a kube-proxy per-port chain (`service-<H>-ns/name/proto/port`).
fn port_chain(name: &str) -> Option<(&str, &str)> {
    ["service-", "local-", "external-", "firewall-"]
        .into_iter()
        .find_map(|kind| name.strip_prefix(kind).map(|base| (kind, base)))
        .filter(|(_, base)| base.contains('/'))
}

/// The Service port a chain base names (`HASH-ns/name/proto/port`); `fallback` is the
/// protocol when the name was cut short.
fn base_name(base: &str, fallback: Option<Protocol>) -> Option<ServicePortName> {
    let (_, readable) = base.split_once('-')?;
    let mut parts = readable.splitn(4, '/');
    let (ns, name) = (parts.next()?, parts.next()?);
    let protocol = parts
        .next()
        .and_then(|p| Protocol::parse(&p.to_ascii_uppercase()))
        .or(fallback)?;
    let port = parts.next().unwrap_or("");
    Some(ServicePortName::new(ns, name, port, protocol))
}

/// kube-proxy's layout: the verdict maps, the per-port chains and their endpoint chains.
fn chains(table: &Table, into: &mut Recovered) {
    let family = table.family;
    let cluster_ips: BTreeSet<IpAddr> = table
        .elements()
        .iter()
        .filter(|e| e.set == CLUSTER_IPS)
        .filter_map(|e| match e.key {
            ElemKey::Addr(ip) => Some(ip),
            _ => None,
        })
        .collect();
    // Per chain base: the Service port, and the protocol the keys show.
    let mut named: BTreeMap<String, ServicePortName> = BTreeMap::new();
    let mut name_of = |base: &str, protocol: Option<Protocol>| -> Option<ServicePortName> {
        if let Some(n) = named.get(base) {
            return Some(n.clone());
        }
        let n = base_name(base, protocol)?;
        named.insert(base.to_string(), n.clone());
        Some(n)
    };
    for e in table.elements() {
        let (protocol, ip, port, _) = key_parts(&e.key);
        match (e.set, &e.value) {
            (SERVICE_IPS | SERVICE_NODEPORTS | FIREWALL_IPS, Some(Verdict::Goto(chain))) => {
                let Some((kind, base)) = port_chain(chain) else {
                    continue;
                };
                let Some(name) = name_of(base, protocol) else {
                    continue;
                };
                let f = into.port(family, &name);
                match (ip, kind) {
                    (Some(ip), "service-" | "local-") => {
                        f.cluster_ip = Some(ip);
                        f.port = port;
                        f.internal_policy_local |= kind == "local-";
                    }
                    (Some(ip), "external-") => {
                        f.port = f.port.or(port);
                        if !f.load_balancer_ips.contains(&ip) {
                            f.external_ips.insert(ip);
                        }
                    }
                    (Some(ip), "firewall-") => {
                        f.external_ips.remove(&ip);
                        f.load_balancer_ips.insert(ip);
                        f.port = f.port.or(port);
                        ranges(table, chain, ip, f);
                    }
                    (None, _) => f.node_port = port,
                    _ => {}
                }
            }
            (NO_ENDPOINT_SERVICES | NO_ENDPOINT_NODEPORTS, Some(verdict)) => {
                let Some(name) = e
                    .comment
                    .as_deref()
                    .and_then(|c| parse_port_name(c, protocol.unwrap_or(Protocol::Tcp)))
                else {
                    continue;
                };
                let drop = *verdict == Verdict::Drop;
                let f = into.port(family, &name);
                match ip {
                    Some(ip) if cluster_ips.contains(&ip) => {
                        f.cluster_ip = Some(ip);
                        f.port = port;
                        if drop {
                            f.internal_policy_local = true;
                            f.local_list();
                        }
                    }
                    Some(ip) => {
                        f.port = f.port.or(port);
                        if !f.load_balancer_ips.contains(&ip) {
                            f.external_ips.insert(ip);
                        }
                        if drop {
                            f.external_policy_local = true;
                            f.local_list();
                        }
                    }
                    None => {
                        f.node_port = port;
                        if drop {
                            f.external_policy_local = true;
                            f.local_list();
                        }
                    }
                }
                f.no_endpoints |= !drop;
            }
            _ => {}
        }
    }
    // The per-port chains: the external chain's policy, the policy chains' endpoints.
    let dnat_of = |chain: &str| -> Option<SocketAddr> {
        table.chain(chain)?.rules.iter().find_map(|r| {
            r.exprs.iter().find_map(|e| match e {
                Expr::Dnat(_, to) => Some(*to),
                _ => None,
            })
        })
    };
    let affinity_timeout = |set: &str| table.sets().find(|s| s.name == set)?.timeout;
    for chain in table.chains() {
        let Some((kind, base)) = port_chain(&chain.name) else {
            continue;
        };
        let Some(name) = named.get(base).cloned().or_else(|| base_name(base, None)) else {
            continue;
        };
        let f = into.port(family, &name);
        match kind {
            // Local traffic short-circuits only under the Local policy.
            "external-"
                if chain
                    .rules
                    .iter()
                    .any(|r| r.exprs.contains(&Expr::FibSaddrLocal)) =>
            {
                f.external_policy_local = true;
            }
            "service-" | "local-" => {
                let mut endpoints = Vec::new();
                for rule in &chain.rules {
                    for e in &rule.exprs {
                        let targets: Vec<&String> = match e {
                            Expr::Verdict(Verdict::Goto(t) | Verdict::Jump(t)) => vec![t],
                            Expr::NumgenVmap(ts) => ts.iter().collect(),
                            Expr::Saddr {
                                value: AddrMatch::Set(set),
                                ..
                            } => {
                                f.session_affinity_seconds =
                                    f.session_affinity_seconds.or(affinity_timeout(set));
                                vec![]
                            }
                            _ => vec![],
                        };
                        for t in targets {
                            if let Some(to) = dnat_of(t) {
                                PortFacts::push_endpoint(&mut endpoints, to);
                            }
                        }
                    }
                }
                if kind == "local-" {
                    for e in endpoints {
                        PortFacts::push_endpoint(f.local_list(), e);
                    }
                } else {
                    for e in endpoints {
                        PortFacts::push_endpoint(&mut f.cluster_endpoints, e);
                    }
                }
            }
            _ => {}
        }
    }
}

/// A `firewall-<H>` chain's admitted sources (`ip saddr != { … } drop`), the VIP's own
/// address (admitted for the node's hairpin) left out.
fn ranges(table: &Table, chain: &str, vip: IpAddr, f: &mut PortFacts) {
    let Some(c) = table.chain(chain) else {
        return;
    };
    for rule in &c.rules {
        for e in &rule.exprs {
            let nets: Vec<IpNet> = match e {
                Expr::Saddr {
                    negate: true,
                    value: AddrMatch::Nets(nets),
                } => nets.clone(),
                Expr::Saddr {
                    negate: true,
                    value: AddrMatch::Net(net),
                } => vec![*net],
                Expr::Saddr {
                    negate: true,
                    value: AddrMatch::Addr(ip),
                } => vec![IpNet::from(*ip)],
                _ => continue,
            };
            f.source_ranges.extend(
                nets.into_iter()
                    .filter(|n| !(n.prefix_len() == n.max_prefix_len() && n.addr() == vip)),
            );
        }
    }
}
