//! `render`: desired state → nftables ruleset. Pure; in the flat layout (the default, see
//! [`super::flat`]) or in kube-proxy's GA nftables layout (see the module documentation),
//! chain by chain and name by name.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;

use super::names::*;
use super::ruleset::{
    AddrMatch, BaseHook, BaseObjects, Chain, ChainType, CtKey, ElemKey, Element, Expr, Hook,
    KeyType, MapKey, Rule, Ruleset, ServiceObjects, Set, Table, Verdict, ct_state, ct_status,
};
use crate::config::{EndpointChoice, NftablesLayout, NodeConfig};
use crate::desired::{DesiredState, EndpointTarget, FamilyState, ServicePortState};
use crate::model::IpFamily;
use crate::nodeaddr::Selection;

/// Renders the whole ruleset: one table per enabled family.
pub fn render(desired: &DesiredState, config: &NodeConfig) -> Ruleset {
    Ruleset {
        tables: desired
            .families
            .iter()
            .map(|f| render_table(f, config))
            .collect(),
    }
}

/// Renders one family's table.
pub fn render_table(state: &FamilyState, config: &NodeConfig) -> Table {
    let services: BTreeMap<_, _> = state
        .services
        .iter()
        .map(|(name, svc)| (name.clone(), render_service(svc, state, config)))
        .collect();
    Table {
        family: state.family,
        base: render_base(state, config),
        services,
    }
}

/// The loopback range of a family.
pub(super) fn loopback(family: IpFamily) -> IpNet {
    match family {
        IpFamily::V4 => "127.0.0.0/8".parse().expect("valid CIDR"),
        IpFamily::V6 => "::1/128".parse().expect("valid CIDR"),
    }
}

fn jump(chain: &str) -> Expr {
    Expr::Verdict(Verdict::Jump(chain.to_string()))
}

fn goto(chain: &str) -> Expr {
    Expr::Verdict(Verdict::Goto(chain.to_string()))
}

fn base(name: &str, kind: ChainType, hook: Hook, priority: i32, rules: Vec<Rule>) -> Chain {
    Chain {
        name: name.to_string(),
        base: Some(BaseHook {
            kind,
            hook,
            priority,
        }),
        rules,
    }
}

/// The base chains, with kube-proxy's hooks and priorities, shared by both layouts (the
/// public contract, documented in the module doc: DNAT at dstnat, masquerade at srcnat,
/// no-endpoint filtering in filter chains); `filter_input` is the input chain's rules.
pub(super) fn base_chains(filter_input: Vec<Rule>) -> Vec<Chain> {
    let new_jump = |to: &str| Rule::new(vec![Expr::CtStateNew, jump(to)]);
    vec![
        base(
            FILTER_PREROUTING_PRE_DNAT,
            ChainType::Filter,
            Hook::Prerouting,
            -110,
            vec![new_jump(FIREWALL_CHECK)],
        ),
        base(
            FILTER_OUTPUT_PRE_DNAT,
            ChainType::Filter,
            Hook::Output,
            -110,
            vec![new_jump(FIREWALL_CHECK)],
        ),
        base(
            FILTER_INPUT,
            ChainType::Filter,
            Hook::Input,
            0,
            filter_input,
        ),
        base(
            FILTER_FORWARD,
            ChainType::Filter,
            Hook::Forward,
            0,
            vec![
                new_jump(SERVICE_ENDPOINTS_CHECK),
                new_jump(CLUSTER_IPS_CHECK),
            ],
        ),
        base(
            FILTER_OUTPUT,
            ChainType::Filter,
            Hook::Output,
            0,
            vec![
                new_jump(SERVICE_ENDPOINTS_CHECK),
                new_jump(CLUSTER_IPS_CHECK),
            ],
        ),
        base(
            NAT_PREROUTING,
            ChainType::Nat,
            Hook::Prerouting,
            -100,
            vec![Rule::new(vec![jump(SERVICES)])],
        ),
        base(
            NAT_OUTPUT,
            ChainType::Nat,
            Hook::Output,
            -100,
            vec![Rule::new(vec![jump(SERVICES)])],
        ),
        base(
            NAT_POSTROUTING,
            ChainType::Nat,
            Hook::Postrouting,
            100,
            vec![Rule::new(vec![jump(MASQUERADING)])],
        ),
    ]
}

/// `cluster-ips-check`, the same in both layouts: packets to a ClusterIP on a port it does not
/// serve are rejected, and packets to an unallocated address of a ServiceCIDR dropped.
///
/// kube-proxy drops the ServiceCIDRs with one rule on an anonymous set (`ip daddr { a, b }`),
/// which the kube-proxy layout keeps; `one_rule_per_cidr` writes a rule per ServiceCIDR
/// instead (the flat layout), which the netlink encoder encodes, so that a node with several
/// ServiceCIDRs of a family (an operator growing the ClusterIP space, KEP-1880) never sends
/// its full syncs through `nft -f`.
pub(super) fn cluster_ips_check_rules(state: &FamilyState, one_rule_per_cidr: bool) -> Vec<Rule> {
    let mut rules = cluster_ips_check(state);
    if one_rule_per_cidr && state.service_cidrs.len() > 1 {
        rules.truncate(1);
        for cidr in &state.service_cidrs {
            rules.push(Rule::commented(
                vec![
                    Expr::Daddr {
                        negate: false,
                        value: AddrMatch::Net(*cidr),
                    },
                    Expr::Verdict(Verdict::Drop),
                ],
                "Drop traffic to unallocated ClusterIPs",
            ));
        }
    }
    rules
}

/// kube-proxy's `cluster-ips-check` rules (see [`cluster_ips_check_rules`]).
pub(super) fn cluster_ips_check(state: &FamilyState) -> Vec<Rule> {
    let mut cluster_ips_check = vec![Rule::commented(
        vec![
            Expr::Daddr {
                negate: false,
                value: AddrMatch::Set(CLUSTER_IPS.to_string()),
            },
            Expr::Verdict(Verdict::Reject),
        ],
        "Reject traffic to invalid ports of ClusterIPs",
    )];
    if !state.service_cidrs.is_empty() {
        cluster_ips_check.push(Rule::commented(
            vec![
                Expr::Daddr {
                    negate: false,
                    value: AddrMatch::Nets(state.service_cidrs.clone()),
                },
                Expr::Verdict(Verdict::Drop),
            ],
            "Drop traffic to unallocated ClusterIPs",
        ));
    }
    cluster_ips_check
}

/// Whether this family serves localhost NodePorts: a CIDR of `--nodeport-addresses` selected
/// an IPv4 loopback address (`127.0.0.0/8`, `127.0.0.1/32`).
///
/// Upstream kube-proxy's nftables mode does not do this: it leaves loopback addresses out of
/// `nodeport-ips` ("localhost NodePorts are not supported", KEP-3866) and never sets
/// `route_localnet`. We serve them anyway, as issue #8 asks, the way the iptables mode
/// does: `127.0.0.1` in `nodeport-ips` (DNAT in `nat-output`), the loopback source
/// masqueraded by the external chain, `net.ipv4.conf.all.route_localnet=1` set by the
/// proxy, and [`LOCALNET_CHECK`] as the CVE-2020-8558 guard.
pub fn localhost_nodeports(state: &FamilyState) -> bool {
    state.family == IpFamily::V4 && state.nodeport_ips.has_ipv4_loopback()
}

/// The CVE-2020-8558 guard: kube-proxy's (kubelet's) iptables rule
/// `-A KUBE-FIREWALL -m comment --comment "block incoming localnet connections"
/// -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP`,
/// written for nftables. With `route_localnet=1` the kernel would otherwise deliver a packet
/// from another host to a service listening on 127.0.0.1.
///
/// The iptables rule drops every packet that is neither RELATED, ESTABLISHED nor DNATed:
/// new connections, and also packets conntrack calls INVALID or that are UNTRACKED. nft
/// cannot say that in one rule: `ct status` fails to match a packet without a conntrack
/// entry (nf_tables' ct expression breaks for every key but `state`), so
/// `ct state ! established,related ct status ! dnat` alone would let invalid and untracked
/// packets through. Hence two rules, which together drop exactly what the iptables rule
/// drops:
///
/// ```text
/// ip daddr 127.0.0.0/8 ip saddr != 127.0.0.0/8 ct state invalid,untracked drop
/// ip daddr 127.0.0.0/8 ip saddr != 127.0.0.0/8 ct state ! established,related ct status ! dnat drop
/// ```
///
/// `filter-input` jumps here for every packet (not only `ct state new` ones), as the
/// iptables `INPUT` chain jumps to `KUBE-FIREWALL`.
pub(super) fn localnet_check() -> Chain {
    let lo = loopback(IpFamily::V4);
    let guard = |ct: Vec<Expr>| {
        let mut exprs = vec![
            Expr::Daddr {
                negate: false,
                value: AddrMatch::Net(lo),
            },
            Expr::Saddr {
                negate: true,
                value: AddrMatch::Net(lo),
            },
        ];
        exprs.extend(ct);
        exprs.push(Expr::Verdict(Verdict::Drop));
        Rule::commented(exprs, "block incoming localnet connections")
    };
    Chain::regular(
        LOCALNET_CHECK,
        vec![
            guard(vec![Expr::Ct {
                key: CtKey::State,
                negate: false,
                bits: ct_state::INVALID | ct_state::UNTRACKED,
            }]),
            guard(vec![
                Expr::Ct {
                    key: CtKey::State,
                    negate: true,
                    bits: ct_state::ESTABLISHED | ct_state::RELATED,
                },
                Expr::Ct {
                    key: CtKey::Status,
                    negate: true,
                    bits: ct_status::DNAT,
                },
            ]),
        ],
    )
}

/// The static part of a table, in the configured layout.
pub fn render_base(state: &FamilyState, config: &NodeConfig) -> BaseObjects {
    match config.nftables_layout {
        NftablesLayout::Flat => super::flat::render_base(state, config),
        NftablesLayout::KubeProxy => kube_proxy_base(state, config),
    }
}

/// [`render_base`] given the flat sets' bounds (kept by the applier, see
/// [`super::flat::SetBounds`]) instead of counting them over every Service port.
pub fn render_base_sized(
    state: &FamilyState,
    config: &NodeConfig,
    bounds: &super::flat::SetBounds,
) -> BaseObjects {
    match config.nftables_layout {
        NftablesLayout::Flat => super::flat::render_base_sized(state, config, bounds),
        NftablesLayout::KubeProxy => kube_proxy_base(state, config),
    }
}

/// The objects of one service port, in the configured layout.
pub fn render_service(
    svc: &ServicePortState,
    state: &FamilyState,
    config: &NodeConfig,
) -> ServiceObjects {
    match config.nftables_layout {
        NftablesLayout::Flat => super::flat::render_service(svc, state, config),
        NftablesLayout::KubeProxy => kube_proxy_service(svc, state, config),
    }
}

/// The static part of a table in kube-proxy's layout: kube-proxy's `setupNFTables`.
pub fn kube_proxy_base(state: &FamilyState, config: &NodeConfig) -> BaseObjects {
    let family = state.family;
    let mark = config.masquerade_mark();
    let new_jump = |to: &str| Rule::new(vec![Expr::CtStateNew, jump(to)]);
    let map = |name: &str, key, comment: &str| Set {
        name: name.to_string(),
        key,
        verdict_map: true,
        timeout: None,
        comment: Some(comment.to_string()),
        size: None,
    };
    let match_all = state.nodeport_ips == Selection::MatchAll;
    // The guard is there while 127.0.0.1 serves NodePorts, and also while `route_localnet`
    // is on without them (a restart with another --nodeport-addresses leaves it on).
    let localnet_guard =
        localhost_nodeports(state) || (state.family == IpFamily::V4 && config.route_localnet);
    let mut filter_input = Vec::new();
    if localnet_guard {
        filter_input.push(Rule::new(vec![jump(LOCALNET_CHECK)]));
    }
    filter_input.extend([
        new_jump(NODEPORT_ENDPOINTS_CHECK),
        new_jump(SERVICE_ENDPOINTS_CHECK),
    ]);

    let mut sets = vec![Set {
        name: CLUSTER_IPS.to_string(),
        key: KeyType::Addr,
        verdict_map: false,
        timeout: None,
        comment: Some("Active ClusterIPs".to_string()),
        size: None,
    }];
    if !match_all {
        sets.push(Set {
            name: NODEPORT_IPS.to_string(),
            key: KeyType::Addr,
            verdict_map: false,
            timeout: None,
            comment: Some("IPs that accept NodePort traffic".to_string()),
            size: None,
        });
    }
    sets.extend([
        map(
            FIREWALL_IPS,
            KeyType::AddrProtoPort,
            "destinations that are subject to LoadBalancerSourceRanges",
        ),
        map(
            NO_ENDPOINT_NODEPORTS,
            KeyType::ProtoPort,
            "vmap to drop or reject packets to service nodeports with no endpoints",
        ),
        map(
            NO_ENDPOINT_SERVICES,
            KeyType::AddrProtoPort,
            "vmap to drop or reject packets to services with no endpoints",
        ),
        map(
            SERVICE_IPS,
            KeyType::AddrProtoPort,
            "ClusterIP, ExternalIP and LoadBalancer IP traffic",
        ),
        map(SERVICE_NODEPORTS, KeyType::ProtoPort, "NodePort traffic"),
    ]);

    // Base chains with kube-proxy's hooks and priorities; the public contract (DNAT at
    // dstnat, masquerade at srcnat, no-endpoint filtering in filter chains) is documented
    // in the module doc.
    let mut chains = base_chains(filter_input);

    let cluster_ips_check = cluster_ips_check(state);
    let not_loopback = Expr::Daddr {
        negate: true,
        value: AddrMatch::Net(loopback(family)),
    };
    let nodeport_dst = if match_all {
        not_loopback.clone()
    } else {
        Expr::Daddr {
            negate: false,
            value: AddrMatch::Set(NODEPORT_IPS.to_string()),
        }
    };
    let mut nodeport_dispatch = Vec::new();
    if match_all {
        nodeport_dispatch.push(Expr::FibDaddrLocal);
    }
    nodeport_dispatch.push(nodeport_dst.clone());
    nodeport_dispatch.push(Expr::VerdictMap {
        key: MapKey::ProtoPort,
        map: SERVICE_NODEPORTS.to_string(),
    });

    chains.extend([
        Chain::regular(CLUSTER_IPS_CHECK, cluster_ips_check),
        Chain::regular(
            FIREWALL_CHECK,
            vec![Rule::new(vec![Expr::VerdictMap {
                key: MapKey::DaddrProtoPort,
                map: FIREWALL_IPS.to_string(),
            }])],
        ),
        Chain::regular(
            MARK_FOR_MASQUERADE,
            vec![Rule::new(vec![Expr::MarkSetOr(mark)])],
        ),
        Chain::regular(
            MASQUERADING,
            vec![
                Rule::new(vec![Expr::MarkUnset(mark), Expr::Verdict(Verdict::Return)]),
                Rule::new(vec![Expr::MarkSetXor(mark)]),
                Rule::new(vec![Expr::Masquerade]),
            ],
        ),
        Chain::regular(
            NODEPORT_ENDPOINTS_CHECK,
            vec![Rule::new(vec![
                nodeport_dst,
                Expr::VerdictMap {
                    key: MapKey::ProtoPort,
                    map: NO_ENDPOINT_NODEPORTS.to_string(),
                },
            ])],
        ),
        Chain::regular(
            REJECT_CHAIN,
            vec![Rule::new(vec![Expr::Verdict(Verdict::Reject)])],
        ),
        Chain::regular(
            SERVICES,
            vec![
                Rule::new(vec![Expr::VerdictMap {
                    key: MapKey::DaddrProtoPort,
                    map: SERVICE_IPS.to_string(),
                }]),
                Rule::new(nodeport_dispatch),
            ],
        ),
        Chain::regular(
            SERVICE_ENDPOINTS_CHECK,
            vec![Rule::new(vec![Expr::VerdictMap {
                key: MapKey::DaddrProtoPort,
                map: NO_ENDPOINT_SERVICES.to_string(),
            }])],
        ),
    ]);

    if localnet_guard {
        chains.push(localnet_check());
    }

    let elements = match &state.nodeport_ips {
        Selection::MatchAll => Vec::new(),
        Selection::Ips(ips) => ips
            .iter()
            .map(|ip| Element {
                set: NODEPORT_IPS,
                key: ElemKey::Addr(*ip),
                value: None,
                data: None,
                comment: None,
            })
            .collect(),
    };
    BaseObjects {
        sets,
        chains,
        elements,
    }
}

/// The objects of one service port in kube-proxy's layout: kube-proxy's per service loop of
/// `syncProxyRules`.
pub fn kube_proxy_service(
    svc: &ServicePortState,
    state: &FamilyState,
    config: &NodeConfig,
) -> ServiceObjects {
    let family = state.family;
    let port = &svc.port;
    let proto = port.name.protocol;
    let names = ServiceChainNames::new(&port.name);
    let comment: std::sync::Arc<str> = port.name.to_string().into();
    let mut out = ServiceObjects::default();

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
    let (internal_verdict, external_verdict) = if !svc.has_endpoints {
        let reject = Verdict::Goto(REJECT_CHAIN.to_string());
        (reject.clone(), reject)
    } else {
        (Verdict::Drop, Verdict::Drop)
    };
    let addr_key = |ip: IpAddr, p: u16| ElemKey::AddrProtoPort(ip, proto, p);
    let element = |set: &'static str, key: ElemKey, value: Verdict| Element {
        set,
        key,
        value: Some(value),
        data: None,
        comment: None,
    };
    let no_endpoint = |set: &'static str, key: ElemKey, value: Verdict| Element {
        set,
        key,
        value: Some(value),
        data: None,
        comment: Some(comment.clone()),
    };

    // Elements.
    out.elements.push(Element {
        set: CLUSTER_IPS,
        key: ElemKey::Addr(svc.cluster_ip),
        value: None,
        data: None,
        comment: None,
    });
    let cip = addr_key(svc.cluster_ip, port.port);
    if has_internal {
        out.elements.push(element(
            SERVICE_IPS,
            cip,
            Verdict::Goto(internal_chain.clone()),
        ));
    } else {
        out.elements
            .push(no_endpoint(NO_ENDPOINT_SERVICES, cip, internal_verdict));
    }
    for ip in &svc.external_ips {
        let key = addr_key(*ip, port.port);
        if svc.has_endpoints {
            out.elements.push(element(
                SERVICE_IPS,
                key,
                Verdict::Goto(names.external.clone()),
            ));
        }
        if !has_external {
            out.elements.push(no_endpoint(
                NO_ENDPOINT_SERVICES,
                key,
                external_verdict.clone(),
            ));
        }
    }
    for ip in &svc.load_balancer_ips {
        let key = addr_key(*ip, port.port);
        if svc.has_endpoints {
            out.elements.push(element(
                SERVICE_IPS,
                key,
                Verdict::Goto(names.external.clone()),
            ));
        }
        if svc.uses_firewall_chain() {
            out.elements.push(element(
                FIREWALL_IPS,
                key,
                Verdict::Goto(names.firewall.clone()),
            ));
        }
        if !has_external {
            out.elements.push(no_endpoint(
                NO_ENDPOINT_SERVICES,
                key,
                external_verdict.clone(),
            ));
        }
    }
    if let Some(np) = port.node_port {
        let key = ElemKey::ProtoPort(proto, np);
        if svc.has_endpoints {
            out.elements.push(element(
                SERVICE_NODEPORTS,
                key,
                Verdict::Goto(names.external.clone()),
            ));
        }
        if !has_external {
            out.elements.push(no_endpoint(
                NO_ENDPOINT_NODEPORTS,
                key,
                external_verdict.clone(),
            ));
        }
    }

    // Policy chains, with the internal masquerade rule first in the internal one.
    let masq_internal = if !has_internal {
        None
    } else if config.masquerade_all {
        Some(Rule::new(vec![
            Expr::Daddr {
                negate: false,
                value: AddrMatch::Addr(svc.cluster_ip),
            },
            jump(MARK_FOR_MASQUERADE),
        ]))
    } else {
        // Off-cluster traffic to a ClusterIP (a static route to the service range) may
        // bounce to another node, so it is masqueraded.
        config.cluster_cidr(family).map(|cidr| {
            Rule::new(vec![
                Expr::Daddr {
                    negate: false,
                    value: AddrMatch::Addr(svc.cluster_ip),
                },
                Expr::Saddr {
                    negate: true,
                    value: AddrMatch::Net(cidr),
                },
                jump(MARK_FOR_MASQUERADE),
            ])
        })
    };
    let affinity = port.session_affinity_seconds;
    let policy_chain = |name: &String, endpoints: &[EndpointTarget], out: &mut ServiceObjects| {
        let mut rules = Vec::new();
        if name == internal_chain {
            rules.extend(masq_internal.clone());
        }
        let targets: Vec<String> = endpoints
            .iter()
            .map(|e| EndpointNames::new(&port.name, e.ip, e.port).chain)
            .collect();
        if affinity.is_some() {
            for e in endpoints {
                let n = EndpointNames::new(&port.name, e.ip, e.port);
                rules.push(Rule::new(vec![
                    Expr::Saddr {
                        negate: false,
                        value: AddrMatch::Set(n.affinity),
                    },
                    goto(&n.chain),
                ]));
            }
        }
        rules.extend(endpoint_choice(&targets, config.endpoint_choice));
        out.chains.push(Chain::regular(name.clone(), rules));
    };
    if svc.uses_cluster_chain() {
        policy_chain(&names.cluster, &svc.cluster_endpoints, &mut out);
    }
    if svc.uses_local_chain() {
        policy_chain(&names.local, &svc.local_endpoints, &mut out);
    }

    // External traffic chain.
    if svc.uses_external_chain() {
        let mut rules = Vec::new();
        if !svc.external_policy_local() {
            // Endpoints may be on another node: masquerade so replies come back here.
            rules.push(Rule::new(vec![jump(MARK_FOR_MASQUERADE)]));
        } else {
            if let Some(cidr) = config.cluster_cidr(family) {
                // Pod → external address: as if it went out to the load balancer and came
                // back, subject to neither traffic policy.
                rules.push(Rule::commented(
                    vec![
                        Expr::Saddr {
                            negate: false,
                            value: AddrMatch::Net(cidr),
                        },
                        goto(&names.cluster),
                    ],
                    "short-circuit pod traffic",
                ));
            }
            // The node itself: its source is a local address, so masquerade.
            rules.push(Rule::commented(
                vec![Expr::FibSaddrLocal, jump(MARK_FOR_MASQUERADE)],
                "masquerade local traffic",
            ));
            rules.push(Rule::commented(
                vec![Expr::FibSaddrLocal, goto(&names.cluster)],
                "short-circuit local traffic",
            ));
        }
        if has_external {
            rules.push(Rule::new(vec![goto(external_policy_chain)]));
        }
        out.chains
            .push(Chain::regular(names.external.clone(), rules));
    }

    // LoadBalancerSourceRanges.
    if svc.uses_firewall_chain() {
        let node_ip = state.node_ips.first().copied();
        let mut sources = svc.source_ranges.to_vec();
        if node_ip.is_some_and(|ip| svc.source_ranges.iter().any(|r| r.contains(&ip))) {
            // A VIP the node holds locally loops back with the VIP as source.
            sources.extend(svc.load_balancer_ips.iter().map(|ip| IpNet::from(*ip)));
        }
        out.chains.push(Chain::regular(
            names.firewall.clone(),
            vec![Rule::new(vec![
                Expr::Saddr {
                    negate: true,
                    value: AddrMatch::Nets(sources),
                },
                Expr::Verdict(Verdict::Drop),
            ])],
        ));
    }

    // Endpoint chains (and affinity sets).
    for e in svc.reachable_endpoints() {
        let n = EndpointNames::new(&port.name, e.ip, e.port);
        let mut rules = vec![Rule::new(vec![
            // Hairpin: a pod reaching itself through the Service must be masqueraded.
            Expr::Saddr {
                negate: false,
                value: AddrMatch::Addr(e.ip),
            },
            jump(MARK_FOR_MASQUERADE),
        ])];
        if let Some(timeout) = affinity {
            rules.push(Rule::new(vec![Expr::UpdateSaddr(n.affinity.clone())]));
            out.sets.push(Set {
                name: n.affinity.clone(),
                key: KeyType::Addr,
                verdict_map: false,
                timeout: Some(timeout),
                comment: None,
                size: None,
            });
        }
        rules.push(Rule::new(vec![Expr::Dnat(proto, e.socket())]));
        out.chains.push(Chain::regular(n.chain, rules));
    }
    out
}

/// The rules that pick one endpoint chain.
fn endpoint_choice(targets: &[String], choice: EndpointChoice) -> Vec<Rule> {
    match choice {
        EndpointChoice::InlineVmap => vec![Rule::new(vec![Expr::NumgenVmap(targets.to_vec())])],
        EndpointChoice::Cascade => {
            let n = targets.len();
            targets
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    if i + 1 == n {
                        Rule::new(vec![goto(t)])
                    } else {
                        // Taken with probability 1/(n-i) among the packets still here:
                        // 1/n overall for every endpoint.
                        Rule::new(vec![
                            Expr::NumgenIs {
                                modulus: (n - i) as u32,
                                value: 0,
                            },
                            goto(t),
                        ])
                    }
                })
                .collect()
        }
    }
}
