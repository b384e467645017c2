//! `render`: desired state → what the IPVS mode programs. Pure; kube-proxy's IPVS
//! `syncProxyRules` and `writeIptablesRules` (`pkg/proxy/ipvs/proxier.go`).

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};

use super::names::*;
use super::ruleset::{FamilyIpvs, IpSet, IpvsRuleset, VirtualServer, ip_port};
use crate::config::NodeConfig;
use crate::desired::{DesiredState, EndpointTarget, FamilyState, ServicePortState};
use crate::iptables::ruleset::{
    Addr, Chain, Line, Match, Restore, Rule, Table, TableRestore, Target,
};
use crate::model::Protocol;
use crate::nodeaddr::Selection;

/// Renders every enabled family.
pub fn render(desired: &DesiredState, config: &NodeConfig) -> IpvsRuleset {
    IpvsRuleset {
        families: desired
            .families
            .iter()
            .map(|f| render_family(f, config))
            .collect(),
    }
}

/// The real servers of a virtual server: kube-proxy's `syncEndpoint`. With a Local policy
/// the local endpoints, or (no local endpoint) the cluster ones, so that pods still reach
/// the service (kubernetes#97081).
fn reals(svc: &ServicePortState, local_only: bool) -> Vec<SocketAddr> {
    let eps: &[EndpointTarget] = if local_only && !svc.local_endpoints.is_empty() {
        &svc.local_endpoints
    } else {
        &svc.cluster_endpoints
    };
    let mut out: Vec<SocketAddr> = eps.iter().map(EndpointTarget::socket).collect();
    // kube-proxy adds them in sorted string order.
    out.sort_by_cached_key(|s| s.to_string());
    out.dedup();
    out
}

/// The addresses NodePort virtual servers listen on: the selected NodePort addresses, or
/// with every address selected, the node's IPs of the family.
fn nodeport_addresses(state: &FamilyState) -> Vec<IpAddr> {
    match &state.nodeport_ips {
        Selection::Ips(ips) => ips.iter().copied().collect(),
        Selection::MatchAll => state
            .node_ips
            .iter()
            .copied()
            .filter(|ip| !ip.is_loopback())
            .collect(),
    }
}

/// Renders one family.
pub fn render_family(state: &FamilyState, config: &NodeConfig) -> FamilyIpvs {
    let family = state.family;
    let mut sets: BTreeMap<SetId, IpSet> = SetId::ALL
        .iter()
        .map(|id| {
            (
                *id,
                IpSet {
                    id: *id,
                    entries: BTreeSet::new(),
                },
            )
        })
        .collect();
    let mut add = |id: SetId, entry: String| {
        sets.get_mut(&id)
            .expect("every set exists")
            .entries
            .insert(entry);
    };
    let mut virtual_servers = Vec::new();
    let mut bound = BTreeSet::new();
    let node_ip = state.node_ips.first().copied();
    let np_addrs = nodeport_addresses(state);

    for svc in state.services.values() {
        let port = &svc.port;
        let proto = port.name.protocol;
        let vs = |addr: SocketAddr, local_only: bool| VirtualServer {
            protocol: proto,
            address: addr,
            scheduler: DEFAULT_SCHEDULER,
            persistence: port.session_affinity_seconds,
            reals: reals(svc, local_only),
        };
        // Hairpin: local endpoints talking to themselves through the service.
        for e in svc.reachable_endpoints().into_iter().filter(|e| e.local) {
            add(
                SetId::LoopBack,
                format!("{},{}", ip_port(e.ip, proto, e.port), e.ip),
            );
        }
        // ClusterIP.
        add(SetId::ClusterIp, ip_port(svc.cluster_ip, proto, port.port));
        virtual_servers.push(vs(
            SocketAddr::new(svc.cluster_ip, port.port),
            port.internal_policy_local,
        ));
        bound.insert(svc.cluster_ip);
        // External IPs.
        for ip in &svc.external_ips {
            let set = if svc.external_policy_local() {
                SetId::ExternalIpLocal
            } else {
                SetId::ExternalIp
            };
            add(set, ip_port(*ip, proto, port.port));
            virtual_servers.push(vs(
                SocketAddr::new(*ip, port.port),
                svc.external_policy_local(),
            ));
            bound.insert(*ip);
        }
        // Load-balancer IPs.
        for ip in &svc.load_balancer_ips {
            let entry = ip_port(*ip, proto, port.port);
            add(SetId::LoadBalancer, entry.clone());
            if svc.external_policy_local() {
                add(SetId::LoadBalancerLocal, entry.clone());
            }
            if !svc.source_ranges.is_empty() {
                add(SetId::LoadBalancerFw, entry.clone());
                for r in &svc.source_ranges {
                    add(SetId::LoadBalancerSourceCidr, format!("{entry},{r}"));
                }
                // A VIP the node holds loops back with the VIP as source.
                if node_ip.is_some_and(|n| svc.source_ranges.iter().any(|r| r.contains(&n))) {
                    add(SetId::LoadBalancerSourceIp, format!("{entry},{ip}"));
                }
            }
            virtual_servers.push(vs(
                SocketAddr::new(*ip, port.port),
                svc.external_policy_local(),
            ));
            bound.insert(*ip);
        }
        // NodePorts: a port set for TCP/UDP, `ip,sctp:port` per address for SCTP; one
        // virtual server per NodePort address.
        if let Some(np) = port.node_port {
            let local = svc.external_policy_local();
            match proto {
                Protocol::Tcp | Protocol::Udp => {
                    let (all, only_local) = if proto == Protocol::Tcp {
                        (SetId::NodePortTcp, SetId::NodePortLocalTcp)
                    } else {
                        (SetId::NodePortUdp, SetId::NodePortLocalUdp)
                    };
                    add(all, np.to_string());
                    if local {
                        add(only_local, np.to_string());
                    }
                }
                Protocol::Sctp => {
                    for ip in &np_addrs {
                        add(SetId::NodePortSctp, ip_port(*ip, proto, np));
                        if local {
                            add(SetId::NodePortLocalSctp, ip_port(*ip, proto, np));
                        }
                    }
                }
            }
            for ip in &np_addrs {
                virtual_servers.push(vs(SocketAddr::new(*ip, np), local));
            }
        }
        if let Some(hc) = port.health_check_node_port {
            add(SetId::HealthCheckNodePort, hc.to_string());
        }
    }

    let iptables = companion_rules(state, config, &sets);
    FamilyIpvs {
        family,
        virtual_servers,
        sets,
        bound,
        iptables,
    }
}

fn comment(id: SetId) -> Match {
    Match::Comment(id.comment().to_string())
}

fn match_set(id: SetId, state: &FamilyState, directions: &'static str) -> Match {
    Match::MatchSet {
        set: id.name(state.family),
        directions,
    }
}

/// One entry of kube-proxy's IPVS `ipsetWithIptablesChain`: `(set, table, from chain,
/// target, match directions, protocol)`.
type SetRule = (
    SetId,
    Table,
    &'static str,
    &'static str,
    &'static str,
    Option<Protocol>,
);

/// kube-proxy's IPVS `ipsetWithIptablesChain`, in order (each Local set before its set).
const SET_RULES: [SetRule; 12] = [
    (
        SetId::LoopBack,
        Table::Nat,
        KUBE_POSTROUTING,
        "MASQUERADE",
        "dst,dst,src",
        None,
    ),
    (
        SetId::LoadBalancer,
        Table::Nat,
        KUBE_SERVICES,
        KUBE_LOAD_BALANCER,
        "dst,dst",
        None,
    ),
    (
        SetId::LoadBalancerLocal,
        Table::Nat,
        KUBE_LOAD_BALANCER,
        "RETURN",
        "dst,dst",
        None,
    ),
    (
        SetId::NodePortLocalTcp,
        Table::Nat,
        KUBE_NODE_PORT,
        "RETURN",
        "dst",
        Some(Protocol::Tcp),
    ),
    (
        SetId::NodePortTcp,
        Table::Nat,
        KUBE_NODE_PORT,
        KUBE_MARK_MASQ,
        "dst",
        Some(Protocol::Tcp),
    ),
    (
        SetId::NodePortLocalUdp,
        Table::Nat,
        KUBE_NODE_PORT,
        "RETURN",
        "dst",
        Some(Protocol::Udp),
    ),
    (
        SetId::NodePortUdp,
        Table::Nat,
        KUBE_NODE_PORT,
        KUBE_MARK_MASQ,
        "dst",
        Some(Protocol::Udp),
    ),
    (
        SetId::NodePortLocalSctp,
        Table::Nat,
        KUBE_NODE_PORT,
        "RETURN",
        "dst,dst",
        Some(Protocol::Sctp),
    ),
    (
        SetId::NodePortSctp,
        Table::Nat,
        KUBE_NODE_PORT,
        KUBE_MARK_MASQ,
        "dst,dst",
        Some(Protocol::Sctp),
    ),
    (
        SetId::LoadBalancerFw,
        Table::Filter,
        KUBE_PROXY_FIREWALL,
        KUBE_SOURCE_RANGES_FIREWALL,
        "dst,dst",
        None,
    ),
    (
        SetId::LoadBalancerSourceCidr,
        Table::Filter,
        KUBE_SOURCE_RANGES_FIREWALL,
        "RETURN",
        "dst,dst,src",
        None,
    ),
    (
        SetId::LoadBalancerSourceIp,
        Table::Filter,
        KUBE_SOURCE_RANGES_FIREWALL,
        "RETURN",
        "dst,dst,src",
        None,
    ),
];

fn target(to: &str) -> Target {
    match to {
        "MASQUERADE" => Target::Masquerade {
            random_fully: false,
        },
        "RETURN" => Target::Return,
        chain => Target::Jump(chain.to_string()),
    }
}

/// The iptables rules the IPVS mode still needs (kube-proxy's `writeIptablesRules`):
/// masquerading decisions by ipset, the NodePort entry for local destinations, the
/// source-range firewall, forwarding and health-check accepts.
fn companion_rules(
    state: &FamilyState,
    config: &NodeConfig,
    sets: &BTreeMap<SetId, IpSet>,
) -> Restore {
    let mark = config.masquerade_mark();
    let non_empty = |id: SetId| !sets[&id].is_empty();
    let mut nat: Vec<Chain> = [
        KUBE_SERVICES,
        KUBE_POSTROUTING,
        KUBE_NODE_PORT,
        KUBE_LOAD_BALANCER,
        KUBE_MARK_MASQ,
    ]
    .iter()
    .map(|c| Chain::new(*c, Vec::new()))
    .collect();
    let mut filter: Vec<Chain> = [
        KUBE_FORWARD,
        KUBE_NODE_PORT,
        KUBE_PROXY_FIREWALL,
        KUBE_SOURCE_RANGES_FIREWALL,
    ]
    .iter()
    .map(|c| Chain::new(*c, Vec::new()))
    .collect();
    fn push(chains: &mut [Chain], name: &str, rule: Rule) {
        chains
            .iter_mut()
            .find(|c| c.name == name)
            .expect("declared chain")
            .rules
            .push(rule);
    }

    for (id, table, from, to, directions, proto) in SET_RULES {
        if !non_empty(id) {
            continue;
        }
        let mut m = Vec::new();
        if let Some(p) = proto {
            m.push(Match::ProtocolOnly(p));
        }
        m.push(comment(id));
        m.push(match_set(id, state, directions));
        let chains = if table == Table::Nat {
            &mut nat
        } else {
            &mut filter
        };
        push(chains, from, Rule::new(m, target(to)));
    }
    if non_empty(SetId::ClusterIp) {
        let mut m = vec![comment(SetId::ClusterIp)];
        if config.masquerade_all {
            m.push(match_set(SetId::ClusterIp, state, "dst,dst"));
        } else if let Some(cidr) = config.cluster_cidr(state.family) {
            // Off-cluster traffic to a service VIP may bounce to another node.
            m.push(match_set(SetId::ClusterIp, state, "dst,dst"));
            m.push(Match::Src {
                negate: true,
                addr: Addr::Net(cidr),
            });
        } else {
            // The node picks a VIP on kube-ipvs0 as source for VIP destinations.
            m.push(match_set(SetId::ClusterIp, state, "src,dst"));
        }
        push(
            &mut nat,
            KUBE_SERVICES,
            Rule::new(m, Target::Jump(KUBE_MARK_MASQ.into())),
        );
    }
    let external_accepts = |id: SetId, nat: &mut Vec<Chain>| {
        let base = vec![comment(id), match_set(id, state, "dst,dst")];
        // Traffic from off the machine (not a bridge port, not a local source).
        let mut off = base.clone();
        off.push(Match::NotFromBridge);
        off.push(Match::AddrTypeLocal {
            src: true,
            negate: true,
        });
        push(nat, KUBE_SERVICES, Rule::new(off, Target::Accept));
        // External IPs the node holds stay local (GCE load balancers).
        let mut local = base;
        local.push(Match::AddrTypeLocal {
            src: false,
            negate: false,
        });
        push(nat, KUBE_SERVICES, Rule::new(local, Target::Accept));
    };
    if non_empty(SetId::ExternalIp) {
        push(
            &mut nat,
            KUBE_SERVICES,
            Rule::new(
                vec![
                    comment(SetId::ExternalIp),
                    match_set(SetId::ExternalIp, state, "dst,dst"),
                ],
                Target::Jump(KUBE_MARK_MASQ.into()),
            ),
        );
        external_accepts(SetId::ExternalIp, &mut nat);
    }
    if non_empty(SetId::ExternalIpLocal) {
        external_accepts(SetId::ExternalIpLocal, &mut nat);
    }
    push(
        &mut nat,
        KUBE_SERVICES,
        Rule::new(
            vec![Match::AddrTypeLocal {
                src: false,
                negate: false,
            }],
            Target::Jump(KUBE_NODE_PORT.into()),
        ),
    );
    push(
        &mut nat,
        KUBE_LOAD_BALANCER,
        Rule::new(vec![], Target::Jump(KUBE_MARK_MASQ.into())),
    );
    push(
        &mut filter,
        KUBE_SOURCE_RANGES_FIREWALL,
        Rule::new(vec![], Target::Drop),
    );
    // Accept traffic to virtual services whatever later rules say (last in KUBE-SERVICES).
    for id in [SetId::ClusterIp, SetId::LoadBalancer] {
        if non_empty(id) {
            push(
                &mut nat,
                KUBE_SERVICES,
                Rule::new(vec![match_set(id, state, "dst,dst")], Target::Accept),
            );
        }
    }
    push(
        &mut filter,
        KUBE_FORWARD,
        Rule::new(
            vec![
                Match::Comment("kubernetes forwarding rules".into()),
                Match::Mark {
                    negate: false,
                    mark,
                },
            ],
            Target::Accept,
        ),
    );
    push(
        &mut filter,
        KUBE_FORWARD,
        Rule::new(
            vec![
                Match::Comment("kubernetes forwarding conntrack rule".into()),
                Match::CtState {
                    negate: false,
                    states: "RELATED,ESTABLISHED",
                },
            ],
            Target::Accept,
        ),
    );
    push(
        &mut filter,
        KUBE_NODE_PORT,
        Rule::new(
            vec![
                comment(SetId::HealthCheckNodePort),
                match_set(SetId::HealthCheckNodePort, state, "dst"),
            ],
            Target::Accept,
        ),
    );
    push(
        &mut nat,
        KUBE_POSTROUTING,
        Rule::new(vec![Match::Mark { negate: true, mark }], Target::Return),
    );
    push(
        &mut nat,
        KUBE_POSTROUTING,
        Rule::new(vec![], Target::MarkXor(mark)),
    );
    push(
        &mut nat,
        KUBE_POSTROUTING,
        Rule::new(
            vec![Match::Comment(
                "kubernetes service traffic requiring SNAT".into(),
            )],
            Target::Masquerade { random_fully: true },
        ),
    );
    push(
        &mut nat,
        KUBE_MARK_MASQ,
        Rule::new(vec![], Target::MarkOr(mark)),
    );

    // The jumps from built-in chains (the IPVS mode's `iptablesJumpChain`), prepended.
    let jumps: [(Table, &str, &str, &str); 7] = [
        (
            Table::Nat,
            "OUTPUT",
            KUBE_SERVICES,
            "kubernetes service portals",
        ),
        (
            Table::Nat,
            "PREROUTING",
            KUBE_SERVICES,
            "kubernetes service portals",
        ),
        (
            Table::Nat,
            "POSTROUTING",
            KUBE_POSTROUTING,
            "kubernetes postrouting rules",
        ),
        (
            Table::Filter,
            "FORWARD",
            KUBE_FORWARD,
            "kubernetes forwarding rules",
        ),
        (
            Table::Filter,
            "INPUT",
            KUBE_NODE_PORT,
            "kubernetes health check rules",
        ),
        (
            Table::Filter,
            "INPUT",
            KUBE_PROXY_FIREWALL,
            "kube-proxy firewall rules",
        ),
        (
            Table::Filter,
            "FORWARD",
            KUBE_PROXY_FIREWALL,
            "kube-proxy firewall rules",
        ),
    ];
    let section = |table: Table, chains: Vec<Chain>| {
        let mut s = TableRestore::new(table);
        s.declare = chains.iter().map(|c| c.name.clone()).collect();
        for c in chains {
            for r in c.rules {
                s.lines.push(Line::Append(c.name.clone(), r));
            }
        }
        for (t, from, to, text) in jumps {
            if t == table {
                s.lines.push(Line::Prepend(
                    from.to_string(),
                    Rule::new(vec![Match::Comment(text.into())], Target::Jump(to.into())),
                ));
            }
        }
        s
    };
    Restore {
        family: state.family,
        tables: vec![section(Table::Nat, nat), section(Table::Filter, filter)],
    }
}
