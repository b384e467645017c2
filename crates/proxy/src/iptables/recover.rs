//! The Service ports kube-proxy's iptables chains name, recovered from `iptables-save` alone,
//! for `nodeport trace --rules kernel` without objects ([`crate::trace::recover`]).
//!
//! Every rule kube-proxy writes into its top-level chains carries the Service port's name in
//! a `-m comment` (`"default/web:http cluster IP"`, `"… external IP"`, `"… loadbalancer
//! IP"`, `"default/web:http"` in `KUBE-NODEPORTS`, `"… has no endpoints"`, `"… has no local
//! endpoints"`, `"… traffic not accepted by KUBE-FW-…"`); the chains those rules jump to
//! (`KUBE-SVC-`, `KUBE-SVL-`, `KUBE-EXT-`, `KUBE-FW-`, then `KUBE-SEP-` with the DNAT) give
//! the policies, the endpoints in order, the session affinity and the source ranges.
//!
//! What the rules cannot say: whether an external destination without endpoints (only its
//! `KUBE-EXTERNAL-SERVICES` rule is left) is an external IP or a load-balancer IP (taken as
//! an external IP).

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;

use super::names::*;
use super::ruleset::{Addr, Match, Rule, Table, TableView, Target};
use crate::model::{IpFamily, Protocol, ServicePortName};
use crate::trace::recover::{PortFacts, Recovered, parse_port_name};

/// What one rule's matches say: its comment, protocol, destination and port.
struct Parts<'a> {
    comment: Option<&'a str>,
    protocol: Option<Protocol>,
    dst: Option<IpAddr>,
    dport: Option<u16>,
    dst_local: bool,
    sources: Vec<IpNet>,
    /// `! -s <CIDR>`.
    not_sources: Vec<IpNet>,
    recent_seconds: Option<u32>,
}

fn parts(rule: &Rule) -> Parts<'_> {
    let mut p = Parts {
        comment: None,
        protocol: None,
        dst: None,
        dport: None,
        dst_local: false,
        sources: Vec::new(),
        not_sources: Vec::new(),
        recent_seconds: None,
    };
    for m in &rule.matches {
        match m {
            Match::Comment(c) => p.comment = Some(c),
            Match::Protocol(proto) | Match::ProtocolOnly(proto) => p.protocol = Some(*proto),
            Match::Dport(port) => p.dport = Some(*port),
            Match::Dst {
                negate: false,
                addr: Addr::Ip(ip),
            } => p.dst = Some(*ip),
            Match::AddrTypeLocal {
                src: false,
                negate: false,
            } => p.dst_local = true,
            Match::Src { negate, addr } => {
                let net = match addr {
                    Addr::Ip(ip) => IpNet::from(*ip),
                    Addr::Net(net) => *net,
                };
                if *negate {
                    p.not_sources.push(net);
                } else {
                    p.sources.push(net);
                }
            }
            Match::RecentCheck { seconds, .. } => p.recent_seconds = Some(*seconds),
            _ => {}
        }
    }
    p
}

fn jump_target(rule: &Rule) -> Option<&str> {
    match &rule.target {
        Target::Jump(c) => Some(c),
        _ => None,
    }
}

/// Reads what one family's tables say of their Service ports into `into`.
pub fn recover(view: &TableView, family: IpFamily, into: &mut Recovered) {
    let chain = |table: Table, name: &str| view.chain(table, name).unwrap_or(&[]);
    // The Service port each per-port chain belongs to, from the rules that jump to it.
    let mut owner: BTreeMap<String, ServicePortName> = BTreeMap::new();
    let mut nodeport_ips: Option<BTreeSet<IpAddr>> = Some(BTreeSet::new());
    let mut lb_ips: BTreeSet<IpAddr> = BTreeSet::new();
    let mut into_cidrs: BTreeSet<IpNet> = BTreeSet::new();
    let mut masquerade_all = false;

    for rule in chain(Table::Nat, KUBE_SERVICES) {
        let p = parts(rule);
        let target = jump_target(rule);
        if target == Some(KUBE_NODEPORTS) {
            match p.dst {
                Some(ip) => {
                    if let Some(ips) = &mut nodeport_ips {
                        ips.insert(ip);
                    }
                }
                None if p.dst_local => nodeport_ips = None,
                None => {}
            }
            continue;
        }
        let (Some(comment), Some(protocol), Some(ip)) = (p.comment, p.protocol, p.dst) else {
            continue;
        };
        let kinds = [" cluster IP", " external IP", " loadbalancer IP"];
        let Some((kind, name)) = kinds.iter().find_map(|k| {
            comment
                .strip_suffix(k)
                .and_then(|n| parse_port_name(n, protocol))
                .map(|n| (*k, n))
        }) else {
            continue;
        };
        let f = into.port(family, &name);
        f.port = f.port.or(p.dport);
        match kind {
            " cluster IP" => {
                f.cluster_ip = Some(ip);
                f.internal_policy_local |= target.is_some_and(|t| t.starts_with(SVL_PREFIX));
            }
            " external IP" => {
                f.external_ips.insert(ip);
            }
            _ => {
                f.load_balancer_ips.insert(ip);
                lb_ips.insert(ip);
            }
        }
        if let Some(t) = target {
            owner.insert(t.to_string(), name);
        }
    }
    for rule in chain(Table::Nat, KUBE_NODEPORTS) {
        let p = parts(rule);
        let (Some(comment), Some(protocol), Some(t)) = (p.comment, p.protocol, jump_target(rule))
        else {
            continue;
        };
        let Some(name) = parse_port_name(comment, protocol) else {
            continue;
        };
        into.port(family, &name).node_port = p.dport;
        owner.insert(t.to_string(), name);
    }
    // What is rejected for want of endpoints, or dropped for want of local ones.
    for (chain_name, internal) in [(KUBE_SERVICES, true), (KUBE_EXTERNAL_SERVICES, false)] {
        for rule in chain(Table::Filter, chain_name) {
            let p = parts(rule);
            let (Some(comment), Some(protocol)) = (p.comment, p.protocol) else {
                continue;
            };
            let (name, none_at_all) = match comment.strip_suffix(" has no endpoints") {
                Some(n) => (n, true),
                None => match comment.strip_suffix(" has no local endpoints") {
                    Some(n) => (n, false),
                    None => continue,
                },
            };
            let Some(name) = parse_port_name(name, protocol) else {
                continue;
            };
            let f = into.port(family, &name);
            f.no_endpoints |= none_at_all;
            match p.dst {
                Some(ip) if internal => {
                    f.cluster_ip = Some(ip);
                    f.port = p.dport;
                    if !none_at_all {
                        f.internal_policy_local = true;
                        f.local_list();
                    }
                    continue;
                }
                Some(ip) => {
                    f.port = f.port.or(p.dport);
                    if !f.load_balancer_ips.contains(&ip) {
                        f.external_ips.insert(ip);
                    }
                }
                None => f.node_port = p.dport,
            }
            if !none_at_all {
                f.external_policy_local = true;
                f.local_list();
            }
        }
    }
    for rule in chain(Table::Filter, KUBE_PROXY_FIREWALL) {
        let p = parts(rule);
        let (Some(comment), Some(protocol), Some(ip)) = (p.comment, p.protocol, p.dst) else {
            continue;
        };
        let Some(name) = comment
            .split_once(" traffic not accepted by ")
            .and_then(|(n, _)| parse_port_name(n, protocol))
        else {
            continue;
        };
        let f = into.port(family, &name);
        f.external_ips.remove(&ip);
        f.load_balancer_ips.insert(ip);
        lb_ips.insert(ip);
    }
    // The per-port chains, reached from the rules above (EXT and FW chains lead on to the
    // policy chains).
    let mut todo: Vec<String> = owner.keys().cloned().collect();
    while let Some(name) = todo.pop() {
        let Some(port) = owner.get(&name).cloned() else {
            continue;
        };
        let rules = chain(Table::Nat, &name);
        let f = into.port(family, &port);
        if name.starts_with(EXT_PREFIX) {
            for rule in rules {
                if parts(rule)
                    .comment
                    .is_some_and(|c| c.starts_with("masquerade LOCAL traffic for "))
                {
                    f.external_policy_local = true;
                }
            }
        }
        if name.starts_with(FW_PREFIX) {
            for rule in rules {
                let p = parts(rule);
                f.source_ranges.extend(p.sources.into_iter().filter(|n| {
                    !(n.prefix_len() == n.max_prefix_len() && lb_ips.contains(&n.addr()))
                }));
            }
        }
        let policy = name.starts_with(SVC_PREFIX) || name.starts_with(SVL_PREFIX);
        let mut endpoints: Vec<SocketAddr> = Vec::new();
        for rule in rules {
            let Some(t) = jump_target(rule) else {
                continue;
            };
            // The ClusterIP's masquerade rule: `--cluster-cidr` or `--masquerade-all`.
            if policy && t == KUBE_MARK_MASQ {
                let p = parts(rule);
                if p.comment.is_some_and(|c| c.ends_with(" cluster IP")) {
                    match p.not_sources.first() {
                        Some(net) => {
                            into_cidrs.insert(*net);
                        }
                        None => masquerade_all = true,
                    }
                }
                continue;
            }
            if policy && t.starts_with(SEP_PREFIX) {
                if let Some(seconds) = parts(rule).recent_seconds {
                    f.session_affinity_seconds = Some(seconds);
                }
                let dnat = chain(Table::Nat, t).iter().find_map(|r| match r.target {
                    Target::Dnat(to) => Some(to),
                    _ => None,
                });
                if let Some(to) = dnat {
                    PortFacts::push_endpoint(&mut endpoints, to);
                }
            } else if [SVC_PREFIX, SVL_PREFIX, EXT_PREFIX]
                .iter()
                .any(|p| t.starts_with(p))
                && !owner.contains_key(t)
            {
                owner.insert(t.to_string(), port.clone());
                todo.push(t.to_string());
            }
        }
        if name.starts_with(SVL_PREFIX) {
            for e in endpoints {
                PortFacts::push_endpoint(f.local_list(), e);
            }
        } else if name.starts_with(SVC_PREFIX) {
            for e in endpoints {
                PortFacts::push_endpoint(&mut f.cluster_endpoints, e);
            }
        }
    }
    into.family(family).nodeport_ips = nodeport_ips;
    into.cluster_cidrs.extend(into_cidrs);
    into.masquerade_all |= masquerade_all;
}
