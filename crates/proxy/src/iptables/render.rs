//! `render`: desired state → iptables ruleset. Pure; the layout is kube-proxy's iptables
//! layout (`pkg/proxy/iptables/proxier.go`, `syncProxyRules`), rule by rule and comment by
//! comment (see the module documentation).

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;

use super::names::*;
use super::ruleset::{Addr, Chain, FamilyRules, JumpRule, Match, Rule, Ruleset, Table, Target};
use crate::config::NodeConfig;
use crate::desired::{DesiredState, EndpointTarget, FamilyState, ServicePortState};
use crate::model::{IpFamily, Protocol};
use crate::nodeaddr::Selection;

/// kube-proxy's `largeClusterEndpointsThreshold`: above this many endpoints in total, the
/// per-endpoint comments are left out (40% smaller input for `iptables-restore`).
pub const LARGE_CLUSTER_ENDPOINTS: usize = 1000;

/// What one service port contributes: rules in the top-level chains (rewritten on every
/// sync) and its own `nat` chains (rewritten only when they change).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ServiceRules {
    /// `(table, top-level chain, rule)` in order.
    pub top: Vec<(Table, &'static str, Rule)>,
    /// `KUBE-EXT-`, `KUBE-FW-`, `KUBE-SVC-`, `KUBE-SVL-`, `KUBE-SEP-` chains.
    pub chains: Vec<Chain>,
}

/// Renders every enabled family.
pub fn render(desired: &DesiredState, config: &NodeConfig) -> Ruleset {
    Ruleset {
        families: desired
            .families
            .iter()
            .map(|f| render_family(f, config))
            .collect(),
    }
}

/// Whether a family is in kube-proxy's "large cluster mode": more than
/// [`LARGE_CLUSTER_ENDPOINTS`] endpoints programmed.
pub fn large_cluster(state: &FamilyState) -> bool {
    let total: usize = state
        .services
        .values()
        .map(|s| s.cluster_endpoints.len().max(s.local_endpoints.len()))
        .sum();
    total > LARGE_CLUSTER_ENDPOINTS
}

/// Renders one family.
pub fn render_family(state: &FamilyState, config: &NodeConfig) -> FamilyRules {
    let large = large_cluster(state);
    let mut services = BTreeMap::new();
    let mut contributions = Vec::with_capacity(state.services.len());
    for (name, svc) in &state.services {
        let r = render_service(svc, state, config, large);
        contributions.push(r.top);
        services.insert(name.clone(), r.chains);
    }
    FamilyRules {
        family: state.family,
        jumps: jump_rules(),
        top: top_chains(state, config, contributions.iter().flatten()),
        services,
    }
}

/// Whether localhost NodePorts are served for this family: kube-proxy's
/// `localhostNodePorts`, which it turns off unless the NodePort addresses include IPv4
/// loopback (every address, or a CIDR such as `127.0.0.0/8` that selected 127.0.0.1), and
/// which never applies to IPv6.
pub fn localhost_nodeports(state: &FamilyState, config: &NodeConfig) -> bool {
    config.localhost_nodeports
        && state.family == IpFamily::V4
        && match &state.nodeport_ips {
            Selection::MatchAll => true,
            ips @ Selection::Ips(_) => ips.has_ipv4_loopback(),
        }
}

fn loopback(family: IpFamily) -> IpNet {
    match family {
        IpFamily::V4 => "127.0.0.0/8".parse().expect("valid CIDR"),
        IpFamily::V6 => "::1/128".parse().expect("valid CIDR"),
    }
}

fn comment(text: impl Into<String>) -> Match {
    Match::Comment(text.into())
}

fn jump(chain: &str) -> Target {
    Target::Jump(chain.to_string())
}

fn dst(ip: IpAddr) -> Match {
    Match::Dst {
        negate: false,
        addr: Addr::Ip(ip),
    }
}

/// kube-proxy's `iptablesJumpChains` and kubelet's `KUBE-FIREWALL` jumps, in order; each is
/// prepended to its built-in chain when missing.
pub fn jump_rules() -> Vec<JumpRule> {
    let new = || Match::CtState {
        negate: false,
        states: "NEW",
    };
    let j = |table, from, mut matches: Vec<Match>, text: &str, to: &str| {
        if !text.is_empty() {
            matches.push(comment(text));
        }
        JumpRule {
            table,
            from,
            rule: Rule::new(matches, jump(to)),
        }
    };
    let ext = "kubernetes externally-visible service portals";
    let portals = "kubernetes service portals";
    let firewall = "kubernetes load balancer firewall";
    vec![
        j(
            Table::Filter,
            "INPUT",
            vec![new()],
            ext,
            KUBE_EXTERNAL_SERVICES,
        ),
        j(
            Table::Filter,
            "FORWARD",
            vec![new()],
            ext,
            KUBE_EXTERNAL_SERVICES,
        ),
        j(
            Table::Filter,
            "INPUT",
            vec![],
            "kubernetes health check service ports",
            KUBE_NODEPORTS,
        ),
        j(
            Table::Filter,
            "FORWARD",
            vec![new()],
            portals,
            KUBE_SERVICES,
        ),
        j(Table::Filter, "OUTPUT", vec![new()], portals, KUBE_SERVICES),
        j(
            Table::Filter,
            "FORWARD",
            vec![],
            "kubernetes forwarding rules",
            KUBE_FORWARD,
        ),
        j(
            Table::Filter,
            "INPUT",
            vec![new()],
            firewall,
            KUBE_PROXY_FIREWALL,
        ),
        j(
            Table::Filter,
            "OUTPUT",
            vec![new()],
            firewall,
            KUBE_PROXY_FIREWALL,
        ),
        j(
            Table::Filter,
            "FORWARD",
            vec![new()],
            firewall,
            KUBE_PROXY_FIREWALL,
        ),
        j(Table::Nat, "OUTPUT", vec![], portals, KUBE_SERVICES),
        j(Table::Nat, "PREROUTING", vec![], portals, KUBE_SERVICES),
        j(
            Table::Nat,
            "POSTROUTING",
            vec![],
            "kubernetes postrouting rules",
            KUBE_POSTROUTING,
        ),
        // kubelet's duplicates (pkg/kubelet/kubelet_network_linux.go), no comment.
        j(Table::Filter, "INPUT", vec![], "", KUBE_FIREWALL),
        j(Table::Filter, "OUTPUT", vec![], "", KUBE_FIREWALL),
    ]
}

/// The top-level chains with the services' contributions in service order.
fn top_chains<'a>(
    state: &FamilyState,
    config: &NodeConfig,
    contributions: impl Iterator<Item = &'a (Table, &'static str, Rule)>,
) -> Vec<(Table, Chain)> {
    let family = state.family;
    let mark = config.masquerade_mark();
    let localhost = localhost_nodeports(state, config);
    let mut filter: Vec<(&'static str, Vec<Rule>)> = vec![
        (KUBE_SERVICES, Vec::new()),
        (KUBE_EXTERNAL_SERVICES, Vec::new()),
        (KUBE_FORWARD, Vec::new()),
        (KUBE_NODEPORTS, Vec::new()),
        (KUBE_PROXY_FIREWALL, Vec::new()),
    ];
    // The guard is written while 127.0.0.1 serves NodePorts, and also while route_localnet
    // is on without them (never reset: a restart with another --nodeport-addresses).
    if localhost || (family == IpFamily::V4 && config.route_localnet) {
        // CVE-2020-8558: with route_localnet on, nothing from outside may reach 127/8
        // except connections DNATed to a NodePort's endpoint.
        let lo = loopback(family);
        filter.push((
            KUBE_FIREWALL,
            vec![Rule::new(
                vec![
                    comment("block incoming localnet connections"),
                    Match::Dst {
                        negate: false,
                        addr: Addr::Net(lo),
                    },
                    Match::Src {
                        negate: true,
                        addr: Addr::Net(lo),
                    },
                    Match::CtState {
                        negate: true,
                        states: "RELATED,ESTABLISHED,DNAT",
                    },
                ],
                Target::Drop,
            )],
        ));
    }
    let mut nat: Vec<(&'static str, Vec<Rule>)> = vec![
        (KUBE_SERVICES, Vec::new()),
        (KUBE_NODEPORTS, Vec::new()),
        (
            KUBE_POSTROUTING,
            vec![
                Rule::new(vec![Match::Mark { negate: true, mark }], Target::Return),
                // Clear the mark so a packet that re-traverses the stack is not
                // masqueraded twice.
                Rule::new(vec![], Target::MarkXor(mark)),
                Rule::new(
                    vec![comment("kubernetes service traffic requiring SNAT")],
                    Target::Masquerade { random_fully: true },
                ),
            ],
        ),
        (
            KUBE_MARK_MASQ,
            vec![Rule::new(vec![], Target::MarkOr(mark))],
        ),
    ];
    for (table, chain, rule) in contributions {
        let list = match table {
            Table::Filter => &mut filter,
            Table::Nat => &mut nat,
            Table::Mangle => continue,
        };
        if let Some((_, rules)) = list.iter_mut().find(|(n, _)| n == chain) {
            rules.push(rule.clone());
        }
    }

    // NodePorts last: only after every ClusterIP/external/LB rule had its chance.
    let nodeports_comment =
        "kubernetes service nodeports; NOTE: this must be the last rule in this chain";
    let services = &mut nat[0].1;
    match &state.nodeport_ips {
        Selection::MatchAll => {
            let mut m = vec![
                comment(nodeports_comment),
                Match::AddrTypeLocal {
                    src: false,
                    negate: false,
                },
            ];
            // Localhost NodePorts never work for IPv6, and for IPv4 only with route_localnet.
            if family == IpFamily::V6 || !localhost {
                m.push(Match::Dst {
                    negate: true,
                    addr: Addr::Net(loopback(family)),
                });
            }
            services.push(Rule::new(m, jump(KUBE_NODEPORTS)));
        }
        Selection::Ips(ips) => {
            for ip in ips {
                if ip.is_loopback() && !localhost {
                    // kube-proxy: "--nodeport-addresses includes localhost but
                    // --iptables-localhost-nodeports=false was passed" (logged by the agent).
                    continue;
                }
                services.push(Rule::new(
                    vec![comment(nodeports_comment), dst(*ip)],
                    jump(KUBE_NODEPORTS),
                ));
            }
        }
    }

    let forward = &mut filter[2].1;
    // Packets conntrack sees as INVALID would otherwise be forwarded unNATed and reset the
    // connection (kubernetes#74839).
    forward.push(Rule::new(
        vec![Match::CtState {
            negate: false,
            states: "INVALID",
        }],
        Target::Drop,
    ));
    // Forward what we marked, even if the FORWARD policy is DROP.
    forward.push(Rule::new(
        vec![
            comment("kubernetes forwarding rules"),
            Match::Mark {
                negate: false,
                mark,
            },
        ],
        Target::Accept,
    ));
    forward.push(Rule::new(
        vec![
            comment("kubernetes forwarding conntrack rule"),
            Match::CtState {
                negate: false,
                states: "RELATED,ESTABLISHED",
            },
        ],
        Target::Accept,
    ));

    filter
        .into_iter()
        .map(|(n, r)| (Table::Filter, Chain::new(n, r)))
        .chain(nat.into_iter().map(|(n, r)| (Table::Nat, Chain::new(n, r))))
        .collect()
}

/// The rules of one service port: kube-proxy's per service loop of `syncProxyRules`.
pub fn render_service(
    svc: &ServicePortState,
    state: &FamilyState,
    config: &NodeConfig,
    large: bool,
) -> ServiceRules {
    let family = state.family;
    let port = &svc.port;
    let proto = port.name.protocol;
    let names = ServiceChainNames::new(&port.name);
    let spn = port.name.to_string();
    let mut out = ServiceRules::default();

    let has_endpoints = svc.has_endpoints;
    let has_internal = svc.has_internal_endpoints();
    let has_external = svc.has_external_endpoints();
    let internal_chain = if port.internal_policy_local {
        &names.local
    } else {
        &names.cluster
    };
    let external_policy_chain = if svc.external_policy_local() {
        &names.local
    } else {
        &names.cluster
    };
    // kube-proxy: `usesFWChain := hasEndpoints && len(LoadBalancerVIPs) > 0 && len(ranges) > 0`.
    let uses_fw = has_endpoints && svc.uses_firewall_chain();
    let lb_chain = if uses_fw {
        &names.firewall
    } else {
        &names.external
    };
    let (internal_filter, external_filter) = if !has_endpoints {
        let c = format!("{spn} has no endpoints");
        ((Target::Reject, c.clone()), (Target::Reject, c))
    } else {
        let c = format!("{spn} has no local endpoints");
        ((Target::Drop, c.clone()), (Target::Drop, c))
    };
    let to = |ip: IpAddr, p: u16| vec![Match::Protocol(proto), dst(ip), Match::Dport(p)];
    let with = |c: String, rest: Vec<Match>| {
        let mut m = vec![comment(c)];
        m.extend(rest);
        m
    };

    // Capture the ClusterIP.
    if has_internal {
        out.top.push((
            Table::Nat,
            KUBE_SERVICES,
            Rule::new(
                with(format!("{spn} cluster IP"), to(svc.cluster_ip, port.port)),
                jump(internal_chain),
            ),
        ));
    } else {
        out.top.push((
            Table::Filter,
            KUBE_SERVICES,
            Rule::new(
                with(internal_filter.1.clone(), to(svc.cluster_ip, port.port)),
                internal_filter.0.clone(),
            ),
        ));
    }
    // External IPs.
    for ip in &svc.external_ips {
        if has_endpoints {
            out.top.push((
                Table::Nat,
                KUBE_SERVICES,
                Rule::new(
                    with(format!("{spn} external IP"), to(*ip, port.port)),
                    jump(&names.external),
                ),
            ));
        }
        if !has_external {
            // No endpoints at all (REJECT), or none for external traffic (DROP what the
            // EXT chain did not short-circuit).
            out.top.push((
                Table::Filter,
                KUBE_EXTERNAL_SERVICES,
                Rule::new(
                    with(external_filter.1.clone(), to(*ip, port.port)),
                    external_filter.0.clone(),
                ),
            ));
        }
    }
    // Load-balancer IPs.
    for ip in &svc.load_balancer_ips {
        if has_endpoints {
            out.top.push((
                Table::Nat,
                KUBE_SERVICES,
                Rule::new(
                    with(format!("{spn} loadbalancer IP"), to(*ip, port.port)),
                    jump(lb_chain),
                ),
            ));
        }
        if uses_fw {
            // What KUBE-FW did not DNAT still has the VIP as destination here.
            out.top.push((
                Table::Filter,
                KUBE_PROXY_FIREWALL,
                Rule::new(
                    with(
                        format!("{spn} traffic not accepted by {}", names.firewall),
                        to(*ip, port.port),
                    ),
                    Target::Drop,
                ),
            ));
        }
    }
    if !has_external {
        for ip in &svc.load_balancer_ips {
            out.top.push((
                Table::Filter,
                KUBE_EXTERNAL_SERVICES,
                Rule::new(
                    with(external_filter.1.clone(), to(*ip, port.port)),
                    external_filter.0.clone(),
                ),
            ));
        }
    }
    // NodePorts (not subject to loadBalancerSourceRanges, as in kube-proxy).
    if let Some(np) = port.node_port {
        if has_endpoints {
            out.top.push((
                Table::Nat,
                KUBE_NODEPORTS,
                Rule::new(
                    with(spn.clone(), vec![Match::Protocol(proto), Match::Dport(np)]),
                    jump(&names.external),
                ),
            ));
        }
        if !has_external {
            out.top.push((
                Table::Filter,
                KUBE_EXTERNAL_SERVICES,
                Rule::new(
                    with(
                        external_filter.1.clone(),
                        vec![
                            Match::AddrTypeLocal {
                                src: false,
                                negate: false,
                            },
                            Match::Protocol(proto),
                            Match::Dport(np),
                        ],
                    ),
                    external_filter.0.clone(),
                ),
            ));
        }
    }
    // Health-check node port: accepted whatever the endpoints.
    if let Some(hc) = port.health_check_node_port {
        out.top.push((
            Table::Filter,
            KUBE_NODEPORTS,
            Rule::new(
                with(
                    format!("{spn} health check node port"),
                    vec![Match::Protocol(Protocol::Tcp), Match::Dport(hc)],
                ),
                Target::Accept,
            ),
        ));
    }

    // Internal traffic: masquerade off-cluster sources (a static route to the service
    // range may bounce the packet to another node).
    let masq_internal = if !has_internal {
        None
    } else if config.masquerade_all {
        Some(Rule::new(
            with(format!("{spn} cluster IP"), to(svc.cluster_ip, port.port)),
            jump(KUBE_MARK_MASQ),
        ))
    } else {
        config.cluster_cidr(family).map(|cidr| {
            let mut m = with(format!("{spn} cluster IP"), to(svc.cluster_ip, port.port));
            m.push(Match::Src {
                negate: true,
                addr: Addr::Net(cidr),
            });
            Rule::new(m, jump(KUBE_MARK_MASQ))
        })
    };

    // External traffic chain.
    if svc.uses_external_chain() {
        let mut rules = Vec::new();
        if !svc.external_policy_local() {
            // Endpoints may be on another node: masquerade so replies come back here.
            rules.push(Rule::new(
                vec![comment(format!(
                    "masquerade traffic for {spn} external destinations"
                ))],
                jump(KUBE_MARK_MASQ),
            ));
        } else {
            if let Some(cidr) = config.cluster_cidr(family) {
                // Pod → external address: as if out to the load balancer and back, subject
                // to neither traffic policy.
                rules.push(Rule::new(
                    vec![
                        comment(format!("pod traffic for {spn} external destinations")),
                        Match::Src {
                            negate: false,
                            addr: Addr::Net(cidr),
                        },
                    ],
                    jump(&names.cluster),
                ));
            }
            // The node itself: the VIP is local, so it would be the source; masquerade.
            rules.push(Rule::new(
                vec![
                    comment(format!(
                        "masquerade LOCAL traffic for {spn} external destinations"
                    )),
                    Match::AddrTypeLocal {
                        src: true,
                        negate: false,
                    },
                ],
                jump(KUBE_MARK_MASQ),
            ));
            rules.push(Rule::new(
                vec![
                    comment(format!(
                        "route LOCAL traffic for {spn} external destinations"
                    )),
                    Match::AddrTypeLocal {
                        src: true,
                        negate: false,
                    },
                ],
                jump(&names.cluster),
            ));
        }
        if has_external {
            rules.push(Rule::new(vec![], jump(external_policy_chain)));
        }
        out.chains.push(Chain::new(names.external.clone(), rules));
    }

    // loadBalancerSourceRanges.
    if uses_fw {
        let c = format!("{spn} loadbalancer IP");
        let mut rules: Vec<Rule> = svc
            .source_ranges
            .iter()
            .map(|r| {
                Rule::new(
                    vec![
                        comment(c.clone()),
                        Match::Src {
                            negate: false,
                            addr: Addr::Net(*r),
                        },
                    ],
                    jump(&names.external),
                )
            })
            .collect();
        let node_ip = state.node_ips.first().copied();
        if node_ip.is_some_and(|ip| svc.source_ranges.iter().any(|r| r.contains(&ip))) {
            // A VIP the node holds loops back with the VIP as source.
            for ip in &svc.load_balancer_ips {
                rules.push(Rule::new(
                    vec![
                        comment(c.clone()),
                        Match::Src {
                            negate: false,
                            addr: Addr::Ip(*ip),
                        },
                    ],
                    jump(&names.external),
                ));
            }
        }
        rules.push(Rule::new(
            vec![comment(format!(
                "other traffic to {spn} will be dropped by KUBE-PROXY-FIREWALL"
            ))],
            Target::None,
        ));
        out.chains.push(Chain::new(names.firewall.clone(), rules));
    }

    // Policy chains.
    let affinity = port.session_affinity_seconds;
    let policy_chain = |name: &String, endpoints: &[EndpointTarget]| {
        let mut rules = Vec::new();
        if name == internal_chain {
            rules.extend(masq_internal.clone());
        }
        let ep_comment = |e: &EndpointTarget| -> Vec<Match> {
            if large {
                Vec::new()
            } else {
                vec![comment(format!("{spn} -> {}", e.socket()))]
            }
        };
        if let Some(seconds) = affinity {
            for e in endpoints {
                let sep = endpoint_chain(&port.name, e.ip, e.port);
                let mut m = ep_comment(e);
                m.push(Match::RecentCheck {
                    name: sep.clone(),
                    seconds,
                });
                rules.push(Rule::new(m, Target::Jump(sep)));
            }
        }
        let n = endpoints.len();
        for (i, e) in endpoints.iter().enumerate() {
            let mut m = ep_comment(e);
            if i + 1 < n {
                // Taken with probability 1/(n-i) among the packets still here: 1/n each.
                m.push(Match::Probability((n - i) as u32));
            }
            rules.push(Rule::new(
                m,
                Target::Jump(endpoint_chain(&port.name, e.ip, e.port)),
            ));
        }
        Chain::new(name.clone(), rules)
    };
    if svc.uses_cluster_chain() {
        out.chains
            .push(policy_chain(&names.cluster, &svc.cluster_endpoints));
    }
    if svc.uses_local_chain() {
        out.chains
            .push(policy_chain(&names.local, &svc.local_endpoints));
    }

    // Endpoint chains.
    for e in svc.reachable_endpoints() {
        let sep = endpoint_chain(&port.name, e.ip, e.port);
        let base = || -> Vec<Match> {
            if large {
                Vec::new()
            } else {
                vec![comment(spn.clone())]
            }
        };
        // Hairpin: a pod reaching itself through the Service must be masqueraded.
        let mut hairpin = base();
        hairpin.push(Match::Src {
            negate: false,
            addr: Addr::Ip(e.ip),
        });
        let mut dnat = base();
        if affinity.is_some() {
            dnat.push(Match::RecentSet(sep.clone()));
        }
        dnat.push(Match::Protocol(proto));
        out.chains.push(Chain::new(
            sep,
            vec![
                Rule::new(hairpin, jump(KUBE_MARK_MASQ)),
                Rule::new(dnat, Target::Dnat(e.socket())),
            ],
        ));
    }
    out
}
