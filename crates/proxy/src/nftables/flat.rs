//! `--nftables-layout flat`: a fixed, small set of chains and rules; every Service port and
//! endpoint is an element of a named set or map. Pure, like [`mod@super::render`].
//!
//! Why: the kernel validates the whole chain graph on every commit that adds a rule (or a
//! `goto` map element), and visits every chain of the table on every commit
//! (`shared/reference/notes/nftables-kernel-costs.md`). With chains that do not depend on
//! the Services, a Service or endpoint change is data-map and plain-set element operations
//! only, which the kernel commits without validation.
//!
//! # How a packet finds its endpoint
//!
//! `services` (jumped to from `nat-prerouting` and `nat-output`, as in kube-proxy's layout)
//! classifies the destination with one lookup per kind (`cluster-ips`, `masquerade-ips`,
//! `local-policy-ips` and their NodePort twins) and jumps to that kind's policy chain
//! (`cluster-ip-policy`, `external-cluster-policy`, `external-local-policy`,
//! `nodeport-cluster-policy`, `nodeport-local-policy`: masquerade marks, short-circuits), which
//! jumps to a `pick-` chain. A packet thus pays one lookup per kind it is not, rather than one
//! per rule: in sets larger than the cache each miss is a cache miss. A `pick-` chain holds
//! one rule per endpoint count `n`:
//!
//! ```text
//! dnat ip to ip daddr . meta l4proto . th dport . numgen random mod n offset T(n) map @service-endpoints
//! ```
//!
//! A list of `n` endpoints occupies the slots `T(n) .. T(n) + n - 1` of its destination in
//! the map, with `T(n) = n (n - 1) / 2`, so that the slot ranges of different counts never
//! overlap: only the rule for the list's own `n` finds an element, the others miss (a map
//! lookup that misses ends the rule) and the packet goes on to the next rule. Each endpoint
//! is chosen with probability exactly `1/n` for `n` up to [`EXACT_MAX`] (64). Above, a list
//! takes the tier `j` with `n <= 128 * 2^j` and `M = 12,800 * 2^j` slots, each endpoint
//! holding `floor(M/n)` or `ceil(M/n)` of them: its share is within 1 % of `1/n` (relative)
//! by construction, for `n` up to 64 * 2^[`TIERS`] (8,192) endpoints.
//!
//! A NodePort is looked up by `meta l4proto . th dport` alone, behind the same
//! `nodeport-ips` (or `fib daddr type local`) test as in kube-proxy's layout.
//!
//! # Policies, masquerade, filtering
//!
//! * ClusterIP traffic from outside `--cluster-cidr` (or all of it with
//!   `--masquerade-all`) is marked for masquerade by one rule on `@cluster-ips`.
//! * External destinations with `externalTrafficPolicy: Cluster` are in `masquerade-ips`
//!   (`masquerade-nodeports`); with `Local`, in `local-policy-ips` (`local-policy-nodeports`):
//!   pods (`--cluster-cidr`) and the node itself short-circuit to the Cluster-policy
//!   endpoints (`service-cluster-endpoints`), the node masqueraded, everyone else goes to
//!   the local endpoints the destination holds in `service-endpoints`.
//! * Hairpin: `hairpin-ips` holds `ip . ip` of every endpoint; `masquerading` marks a
//!   DNATed connection whose source is its endpoint.
//! * No endpoints: `no-endpoint-services` / `no-endpoint-nodeports` are plain sets here and
//!   their members are rejected; `no-local-endpoint-services` /
//!   `no-local-endpoint-nodeports` are dropped (a Local policy without local endpoint).
//! * LoadBalancerSourceRanges: `firewall-ips` (plain set) names the guarded destinations,
//!   `firewall-allow` (an interval set of `addr . proto . port . source`) what they admit.
//!
//! # Session affinity
//!
//! Per distinct `sessionAffinityConfig.clientIP.timeoutSeconds` `T` (a handful at most), two
//! plain sets name the destinations and NodePorts with `sessionAffinity: ClientIP`
//! (`sticky-ips-T`, `sticky-nodeports-T`) and two dynamic maps with
//! timeout `T` remember, per client, the endpoint it was sent to:
//!
//! ```text
//! affinity-ips-T:       client . daddr . proto . port : endpoint addr . port
//! affinity-nodeports-T: client . proto . nodePort     : endpoint addr . port
//! ```
//!
//! Each `pick-` chain first jumps to `session-affinity-ips` (or `-nodeports`), which tries
//! `dnat ip to ip saddr . ip daddr . meta l4proto . th dport map @affinity-ips-T` for the
//! ports in the set (no entry: the rule does not match, the chain returns and the random
//! choice follows). The endpoint of a new connection is recorded after DNAT, from
//! `nat-postrouting` and `filter-input`, in `session-affinity-record`, with the original
//! destination from conntrack (`ct original ip daddr`, `ct original proto-dst`); each record
//! also refreshes the timeout, as kube-proxy's `update @affinity-…` does. So affinity adds
//! chains and rules per timeout, never per Service: a Service port switching affinity on or
//! off is element operations. The applier deletes the entries that point to an endpoint a
//! port no longer uses (kube-proxy deletes that endpoint's affinity set).
//!
//! IPv6 keeps kube-proxy's per-endpoint chains for affinity ports (reached through the
//! `service-ips`/`service-nodeports` verdict maps, which hold only their `goto` elements).
//! The cause is nft itself, not the kernel: nft 1.0.6 (Debian 12's) gives the key of an
//! `update @map { key : data }` statement one 16-byte register, whatever its length (its
//! `get_register` sees the set element wrapping the concatenation, not the concatenation),
//! and writes the data into the next 16-byte register. A key longer than 16 bytes therefore
//! either aborts nft (`netlink_linearize.c: Assertion 'dreg < ctx->reg_low' failed`, when a
//! field of the key starts past the first 16 bytes) or, worse, is silently overwritten by the
//! data (when its last field starts inside them and runs past: `nft --debug=netlink` shows
//! `tcp dport . ip6 daddr : ip6 saddr` load the address into 32-bit registers 9-12 and the
//! data into 12-15). A client key needs the client's address and the destination's, 36 bytes
//! and more in IPv6, so no IPv6 affinity map can be filled by a rule that `nft -f` loads
//! correctly; IPv4's keys are exactly 16 bytes (`client . daddr . proto . port`) or 12
//! (`client . proto . nodePort`), which nft encodes as we do
//! (`affinity_map_keys_fit_the_one_register_nft_gives_a_dynset_key`). Plain-set updates
//! (`update @set { key }`) are allocated correctly, but a set cannot return the endpoint.
//! Our netlink encoder could write the IPv6 rule (the registers fit when packed), but
//! `nodeport render | nft -f` and the `nft` kernel backend could not, so IPv6 affinity ports
//! cost chains and a validation walk over them, as in kube-proxy's layout.
//!
//! One difference with kube-proxy, kept on purpose: kube-proxy shares a client's affinity
//! across all destinations of a Service port (its affinity sets hang on the endpoint
//! chains); here a client's ClusterIP, each external or load-balancer IP, and the NodePort
//! (whatever the node address used) keep their own entry, as nothing in a packet names the
//! Service port it is bound for once the destinations differ.
//!
//! # Comments
//!
//! Every element carries its Service port's `namespace/name:port` ([`element_comment`]),
//! shortened to nftables' 128 bytes.

use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;

use super::names::*;
use super::render::{
    base_chains, cluster_ips_check_rules, kube_proxy_service, localhost_nodeports, localnet_check,
    loopback,
};
use super::ruleset::{
    AddrMatch, AffinityKey, BaseObjects, Chain, CtKey, ElemKey, Element, Expr, KeyType, LookupKey,
    MapKey, Rule, ServiceObjects, Set, Verdict, ct_status,
};
use crate::config::NodeConfig;
use crate::desired::{EndpointTarget, FamilyState, ServicePortState};
use crate::model::{IpFamily, Protocol, ServicePortName};
use crate::nodeaddr::Selection;

/// Endpoint counts up to this get exactly `1/n` each.
pub const EXACT_MAX: u32 = 64;

/// Tiers above [`EXACT_MAX`]: tier `j` serves up to `128 * 2^j` endpoints.
pub const TIERS: u32 = 7;

/// Slots of the first tier: `100 * 128`, so that every endpoint of up to 128 holds at least
/// 100 slots (1 % resolution).
const TIER_BASE_SLOTS: u32 = 12_800;

/// First slot of the tiers: after the exact ranges `T(1) ..= T(64) + 63`.
const TIER_START: u32 = EXACT_MAX * (EXACT_MAX + 1) / 2;

/// nftables' longest comment (`NFTNL_UDATA_COMMENT_MAXLEN`).
pub const COMMENT_MAX: usize = 128;

/// The `(modulus, offset)` of the rule that picks among `n` endpoints (`n >= 1`).
pub fn dispatch(n: usize) -> (u32, u32) {
    let n = n.max(1) as u32;
    if n <= EXACT_MAX {
        return (n, n * (n - 1) / 2);
    }
    let mut j = 0;
    while j + 1 < TIERS && n > 128 << j {
        j += 1;
    }
    (
        TIER_BASE_SLOTS << j,
        TIER_START + TIER_BASE_SLOTS * ((1 << j) - 1),
    )
}

/// Every `(modulus, offset)` a `pick-` chain has a rule for, smallest first.
pub fn dispatch_rules() -> Vec<(u32, u32)> {
    let mut out: Vec<(u32, u32)> = (1..=EXACT_MAX as usize).map(dispatch).collect();
    for j in 0..TIERS {
        out.push(dispatch(
            ((128u32 << j) as usize).max(EXACT_MAX as usize + 1),
        ));
    }
    out
}

/// The slots of a list of `n` endpoints: `(slot, index of the endpoint)`.
pub fn slots(n: usize) -> impl Iterator<Item = (u32, usize)> {
    let (modulus, offset) = dispatch(n);
    let m = u64::from(modulus);
    (0..modulus).map(move |s| (offset + s, (u64::from(s) * n as u64 / m) as usize))
}

/// The comment every element of a Service port carries: `namespace/name:port` (`/name`
/// alone for an unnamed port), at most [`COMMENT_MAX`] bytes. Longer ones (Kubernetes allows
/// 63-byte namespaces, 63-byte names and 15-byte port names: 143 bytes) keep the namespace
/// and the port and cut the middle of the name, marking the cut with `...`
/// ([`crate::names::short_port_name`], which the eBPF mode's name map shares).
pub fn element_comment(port: &ServicePortName) -> String {
    crate::names::short_port_name(port, COMMENT_MAX)
}

fn jump(chain: &str) -> Expr {
    Expr::Verdict(Verdict::Jump(chain.to_string()))
}

fn goto(chain: &str) -> Expr {
    Expr::Verdict(Verdict::Goto(chain.to_string()))
}

fn lookup(key: LookupKey, set: &str) -> Expr {
    Expr::Lookup {
        key,
        negate: false,
        set: set.to_string(),
    }
}

fn set(name: &str, key: KeyType, comment: &str) -> Set {
    Set {
        name: name.to_string(),
        key,
        verdict_map: false,
        timeout: None,
        comment: Some(comment.to_string()),
        size: None,
    }
}

/// Smallest `size` of a flat set.
pub const MIN_SET_SIZE: u32 = 4096;

/// The `size` of a set that Service ports can fill with up to `bound` elements: twice that,
/// a power of two, at least [`MIN_SET_SIZE`], at most `max`.
pub fn set_size(bound: usize, max: u32) -> u32 {
    let want = (bound.saturating_mul(2)).clamp(MIN_SET_SIZE as usize, 1 << 31);
    (want.next_power_of_two().min(1 << 31) as u32).min(max)
}

/// Upper bounds of what Service ports put into the flat sets, counted without rendering them
/// (a partial sync renders only the changed ports). One Service port's bounds
/// ([`SetBounds::of_port`]) add up to a table's ([`SetBounds::of_state`]); the applier keeps
/// the sum and moves it by the changed ports only, so that sizing the sets does not walk every
/// Service port on every change.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SetBounds {
    /// Destinations (ClusterIP, external and load-balancer IPs).
    dsts: u32,
    /// NodePorts.
    nodeports: u32,
    /// Slots of `service-endpoints`.
    ep_dsts: u32,
    /// Slots of `nodeport-endpoints`.
    ep_nodeports: u32,
    /// Slots of `service-cluster-endpoints`.
    cluster_dsts: u32,
    /// Slots of `nodeport-cluster-endpoints`.
    cluster_nodeports: u32,
    /// Hairpin pairs.
    hairpin: u32,
    /// `firewall-allow` entries.
    allow: u32,
    /// Session-affinity timeouts and the number of ports with each.
    affinity: std::collections::BTreeMap<u32, u32>,
}

impl SetBounds {
    /// What one Service port may put into each set.
    pub fn of_port(svc: &ServicePortState) -> Self {
        let slots = |n: usize| if n == 0 { 0 } else { dispatch(n).0 as usize };
        let external = svc.external_ips.len() + svc.load_balancer_ips.len();
        let np = usize::from(svc.port.node_port.is_some());
        let (c, l) = (
            slots(svc.cluster_endpoints.len()),
            slots(svc.local_endpoints.len()),
        );
        let n = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
        SetBounds {
            dsts: n(1 + external),
            nodeports: n(np),
            ep_dsts: n((1 + external) * c.max(l)),
            ep_nodeports: n(np * c.max(l)),
            cluster_dsts: n(external * c),
            cluster_nodeports: n(np * c),
            hairpin: n(svc.cluster_endpoints.len() + svc.local_endpoints.len()),
            allow: n(svc.load_balancer_ips.len()
                * (svc.source_ranges.len() + svc.load_balancer_ips.len())),
            // IPv4 only: IPv6 affinity keeps kube-proxy's chains (see the module's notes).
            affinity: svc
                .port
                .session_affinity_seconds
                .filter(|_| svc.cluster_ip.is_ipv4())
                .map(|t| (t, 1))
                .into_iter()
                .collect(),
        }
    }

    /// The session-affinity timeouts some port has, smallest first.
    pub fn affinity_timeouts(&self) -> impl Iterator<Item = u32> + '_ {
        self.affinity.keys().copied()
    }

    /// What every Service port of `state` may put into each set.
    pub fn of_state(state: &FamilyState) -> Self {
        let mut total = SetBounds::default();
        for svc in state.services.values() {
            total.add(&SetBounds::of_port(svc));
        }
        total
    }

    /// About how many claims (destinations, NodePorts, endpoint addresses) the ports make:
    /// the applier's record reserves room for them at once.
    pub fn claims(&self) -> usize {
        (self.dsts as usize) + (self.nodeports as usize) + (self.hairpin as usize)
    }

    fn fields(&mut self) -> [&mut u32; 8] {
        [
            &mut self.dsts,
            &mut self.nodeports,
            &mut self.ep_dsts,
            &mut self.ep_nodeports,
            &mut self.cluster_dsts,
            &mut self.cluster_nodeports,
            &mut self.hairpin,
            &mut self.allow,
        ]
    }

    /// Adds a port's bounds.
    pub fn add(&mut self, other: &SetBounds) {
        let mut other = other.clone();
        for (a, b) in self.fields().into_iter().zip(other.fields()) {
            *a = a.saturating_add(*b);
        }
        for (t, n) in other.affinity {
            *self.affinity.entry(t).or_default() += n;
        }
    }

    /// Removes a port's bounds (added before).
    pub fn remove(&mut self, other: &SetBounds) {
        let mut other = other.clone();
        for (a, b) in self.fields().into_iter().zip(other.fields()) {
            *a = a.saturating_sub(*b);
        }
        for (t, n) in other.affinity {
            if let Some(have) = self.affinity.get_mut(&t) {
                *have = have.saturating_sub(n);
                if *have == 0 {
                    self.affinity.remove(&t);
                }
            }
        }
    }

    /// The bound of flat set `set`, if Service ports fill it.
    fn of_set(&self, set: &str) -> Option<usize> {
        let n = match set {
            CLUSTER_IPS
            | SERVICE_IPS
            | NO_ENDPOINT_SERVICES
            | NO_LOCAL_ENDPOINT_SERVICES
            | FIREWALL_IPS
            | MASQUERADE_IPS
            | LOCAL_POLICY_IPS => self.dsts,
            SERVICE_NODEPORTS
            | NO_ENDPOINT_NODEPORTS
            | NO_LOCAL_ENDPOINT_NODEPORTS
            | MASQUERADE_NODEPORTS
            | LOCAL_POLICY_NODEPORTS => self.nodeports,
            FIREWALL_ALLOW => self.allow,
            HAIRPIN_IPS => self.hairpin,
            SERVICE_ENDPOINTS => self.ep_dsts,
            NODEPORT_ENDPOINTS => self.ep_nodeports,
            SERVICE_CLUSTER_ENDPOINTS => self.cluster_dsts,
            NODEPORT_CLUSTER_ENDPOINTS => self.cluster_nodeports,
            s if s.starts_with("sticky-ips-") => self.dsts,
            s if s.starts_with("sticky-nodeports-") => self.nodeports,
            _ => return None,
        };
        Some(n as usize)
    }
}

/// The fixed objects of a flat table: everything but the elements of Service ports.
pub fn render_base(state: &FamilyState, config: &NodeConfig) -> BaseObjects {
    render_base_sized(state, config, &SetBounds::of_state(state))
}

/// [`render_base`] with the sets sized for `bounds` (the applier's running sum).
pub fn render_base_sized(
    state: &FamilyState,
    config: &NodeConfig,
    bounds: &SetBounds,
) -> BaseObjects {
    let family = state.family;
    let mark = config.masquerade_mark();
    let new_jump = |to: &str| Rule::new(vec![Expr::CtStateNew, jump(to)]);
    let match_all = state.nodeport_ips == Selection::MatchAll;
    let localnet_guard =
        localhost_nodeports(state) || (state.family == IpFamily::V4 && config.route_localnet);

    let mut sets = vec![set(CLUSTER_IPS, KeyType::Addr, "Active ClusterIPs")];
    if !match_all {
        sets.push(set(
            NODEPORT_IPS,
            KeyType::Addr,
            "IPs that accept NodePort traffic",
        ));
    }
    let vmap = |name: &str, key, comment: &str| Set {
        verdict_map: true,
        ..set(name, key, comment)
    };
    sets.extend([
        vmap(
            SERVICE_IPS,
            KeyType::AddrProtoPort,
            "session-affinity ClusterIP, ExternalIP and LoadBalancer IP traffic",
        ),
        vmap(
            SERVICE_NODEPORTS,
            KeyType::ProtoPort,
            "session-affinity NodePort traffic",
        ),
        set(
            NO_ENDPOINT_SERVICES,
            KeyType::AddrProtoPort,
            "services with no endpoints: rejected",
        ),
        set(
            NO_ENDPOINT_NODEPORTS,
            KeyType::ProtoPort,
            "nodeports with no endpoints: rejected",
        ),
        set(
            NO_LOCAL_ENDPOINT_SERVICES,
            KeyType::AddrProtoPort,
            "Local traffic policy without local endpoints: dropped",
        ),
        set(
            NO_LOCAL_ENDPOINT_NODEPORTS,
            KeyType::ProtoPort,
            "nodeports with externalTrafficPolicy Local without local endpoints: dropped",
        ),
        set(
            FIREWALL_IPS,
            KeyType::AddrProtoPort,
            "destinations that are subject to LoadBalancerSourceRanges",
        ),
        set(
            FIREWALL_ALLOW,
            KeyType::AddrProtoPortNet,
            "sources LoadBalancerSourceRanges admit",
        ),
        set(
            MASQUERADE_IPS,
            KeyType::AddrProtoPort,
            "external destinations with externalTrafficPolicy Cluster",
        ),
        set(
            MASQUERADE_NODEPORTS,
            KeyType::ProtoPort,
            "nodeports with externalTrafficPolicy Cluster",
        ),
        set(
            LOCAL_POLICY_IPS,
            KeyType::AddrProtoPort,
            "external destinations with externalTrafficPolicy Local",
        ),
        set(
            LOCAL_POLICY_NODEPORTS,
            KeyType::ProtoPort,
            "nodeports with externalTrafficPolicy Local",
        ),
        set(
            HAIRPIN_IPS,
            KeyType::AddrAddr,
            "endpoints reaching themselves",
        ),
        set(
            SERVICE_ENDPOINTS,
            KeyType::AddrProtoPortSlot,
            "endpoints of each destination",
        ),
        set(
            NODEPORT_ENDPOINTS,
            KeyType::ProtoPortSlot,
            "endpoints of each nodeport",
        ),
        set(
            SERVICE_CLUSTER_ENDPOINTS,
            KeyType::AddrProtoPortSlot,
            "cluster endpoints of externalTrafficPolicy Local destinations",
        ),
        set(
            NODEPORT_CLUSTER_ENDPOINTS,
            KeyType::ProtoPortSlot,
            "cluster endpoints of externalTrafficPolicy Local nodeports",
        ),
    ]);

    let timeouts: Vec<u32> = bounds.affinity_timeouts().collect();
    for &t in &timeouts {
        let names = AffinityNames::new(t);
        sets.push(set(
            names.dsts,
            KeyType::AddrProtoPort,
            &format!("destinations with sessionAffinity ClientIP, timeout {t}s"),
        ));
        sets.push(set(
            names.nodeports,
            KeyType::ProtoPort,
            &format!("nodeports with sessionAffinity ClientIP, timeout {t}s"),
        ));
        for (name, key, what) in [
            (names.dst_map, KeyType::AffinityDst, "destination"),
            (names.nodeport_map, KeyType::AffinityNodePort, "nodeport"),
        ] {
            sets.push(Set {
                timeout: Some(t),
                size: Some(AFFINITY_MAP_SIZE.min(config.flat_max_set_size)),
                ..set(
                    name,
                    key,
                    &format!("the endpoint of each client of a {what}"),
                )
            });
        }
    }
    // After DNAT: a new connection to a session-affinity destination records its endpoint.
    let record = || {
        Rule::new(vec![
            Expr::CtStateNew,
            Expr::Ct {
                key: CtKey::Status,
                negate: false,
                bits: ct_status::DNAT,
            },
            jump(SESSION_AFFINITY_RECORD),
        ])
    };

    let mut filter_input = Vec::new();
    if localnet_guard {
        filter_input.push(Rule::new(vec![jump(LOCALNET_CHECK)]));
    }
    filter_input.extend([
        new_jump(NODEPORT_ENDPOINTS_CHECK),
        new_jump(SERVICE_ENDPOINTS_CHECK),
    ]);
    filter_input.push(record());
    let mut chains = base_chains(filter_input);
    if let Some(post) = chains.iter_mut().find(|c| c.name == NAT_POSTROUTING) {
        post.rules.insert(0, record());
    }

    let cluster_ips_check = cluster_ips_check_rules(state, true);
    // The NodePort destination test, as in kube-proxy's layout.
    let nodeport_dst: Vec<Expr> = if match_all {
        vec![
            Expr::FibDaddrLocal,
            Expr::Daddr {
                negate: true,
                value: AddrMatch::Net(loopback(family)),
            },
        ]
    } else {
        vec![Expr::Daddr {
            negate: false,
            value: AddrMatch::Set(NODEPORT_IPS.to_string()),
        }]
    };
    let np = |rest: Vec<Expr>| {
        let mut e = nodeport_dst.clone();
        e.extend(rest);
        Rule::new(e)
    };
    let dst = LookupKey::DaddrProtoPort;
    let port = LookupKey::ProtoPort;

    let mut services = vec![
        Rule::new(vec![Expr::VerdictMap {
            key: MapKey::DaddrProtoPort,
            map: SERVICE_IPS.to_string(),
        }]),
        np(vec![Expr::VerdictMap {
            key: MapKey::ProtoPort,
            map: SERVICE_NODEPORTS.to_string(),
        }]),
    ];
    let cluster_ip = Expr::Daddr {
        negate: false,
        value: AddrMatch::Set(CLUSTER_IPS.to_string()),
    };
    let pod_cidr = config.cluster_cidr(family);
    // Each kind of destination is one lookup in `services` and a chain of its own for the
    // rest: a packet pays one lookup per kind it is not (the sets are large, and a lookup
    // that misses in a set bigger than the cache is a cache miss), not one per rule.
    let mut policy_chains = Vec::new();
    let mut cluster_ip_policy = Vec::new();
    if config.masquerade_all {
        cluster_ip_policy.push(Rule::new(vec![jump(MARK_FOR_MASQUERADE)]));
    } else if let Some(cidr) = pod_cidr {
        // Off-cluster traffic to a ClusterIP may bounce to another node: masqueraded.
        cluster_ip_policy.push(Rule::new(vec![
            Expr::Saddr {
                negate: true,
                value: AddrMatch::Net(cidr),
            },
            jump(MARK_FOR_MASQUERADE),
        ]));
    }
    cluster_ip_policy.push(Rule::new(vec![jump(PICK_SERVICE_ENDPOINTS)]));
    policy_chains.push(Chain::regular(CLUSTER_IP_POLICY, cluster_ip_policy));
    services.push(Rule::new(vec![cluster_ip, jump(CLUSTER_IP_POLICY)]));
    // External destinations, then NodePorts: masquerade (Cluster policy) or short-circuit
    // (Local policy), then the endpoint choice. Only destinations of a Service reach a
    // `pick-` chain: other traffic (pod to pod, to the internet, to the node) pays one set
    // lookup per kind here, not one per rule there.
    let mut external = |lookup_rule: &dyn Fn(Vec<Expr>) -> Rule,
                        key: LookupKey,
                        (masq, masq_chain): (&str, &str),
                        (local, local_chain): (&str, &str),
                        short_circuit: &str,
                        pick: &str,
                        out: &mut Vec<Rule>| {
        out.push(lookup_rule(vec![lookup(key, masq), jump(masq_chain)]));
        out.push(lookup_rule(vec![lookup(key, local), jump(local_chain)]));
        policy_chains.push(Chain::regular(
            masq_chain,
            vec![
                Rule::new(vec![jump(MARK_FOR_MASQUERADE)]),
                Rule::new(vec![jump(pick)]),
            ],
        ));
        let mut rules = Vec::new();
        if let Some(cidr) = pod_cidr {
            rules.push(Rule::commented(
                vec![
                    Expr::Saddr {
                        negate: false,
                        value: AddrMatch::Net(cidr),
                    },
                    goto(short_circuit),
                ],
                "short-circuit pod traffic",
            ));
        }
        rules.push(Rule::commented(
            vec![Expr::FibSaddrLocal, jump(MARK_FOR_MASQUERADE)],
            "masquerade local traffic",
        ));
        rules.push(Rule::commented(
            vec![Expr::FibSaddrLocal, goto(short_circuit)],
            "short-circuit local traffic",
        ));
        rules.push(Rule::new(vec![jump(pick)]));
        policy_chains.push(Chain::regular(local_chain, rules));
    };
    external(
        &Rule::new,
        dst,
        (MASQUERADE_IPS, EXTERNAL_CLUSTER_POLICY),
        (LOCAL_POLICY_IPS, EXTERNAL_LOCAL_POLICY),
        PICK_SERVICE_CLUSTER_ENDPOINTS,
        PICK_SERVICE_ENDPOINTS,
        &mut services,
    );
    external(
        &np,
        port,
        (MASQUERADE_NODEPORTS, NODEPORT_CLUSTER_POLICY),
        (LOCAL_POLICY_NODEPORTS, NODEPORT_LOCAL_POLICY),
        PICK_NODEPORT_CLUSTER_ENDPOINTS,
        PICK_NODEPORT_ENDPOINTS,
        &mut services,
    );

    // A client the affinity maps remember goes back to its endpoint; the others (and every
    // port without affinity) are spread by the slot rules. The affinity rules live in chains
    // of their own, so that a timeout coming or going rewrites those, never the `pick-`
    // chains (nft 1.0.6 cannot re-add a `pick-` rule whose `typeof` map it reads from the
    // kernel; see `Set::has_endpoint_data`).
    let affinity_rules = |key: AffinityKey| -> Vec<Rule> {
        timeouts
            .iter()
            .map(|&t| {
                let names = AffinityNames::new(t);
                let (dsts, k, map) = match key {
                    AffinityKey::Dst => (lookup(dst, names.dsts), key, names.dst_map),
                    AffinityKey::NodePort => {
                        (lookup(port, names.nodeports), key, names.nodeport_map)
                    }
                };
                Rule::new(vec![
                    dsts,
                    Expr::AffinityDnat {
                        key: k,
                        map: map.to_string(),
                    },
                ])
            })
            .collect()
    };
    let pick = |name: &str, key: MapKey, map: &str| {
        let affinity = match key {
            MapKey::DaddrProtoPort => SESSION_AFFINITY_IPS,
            MapKey::ProtoPort => SESSION_AFFINITY_NODEPORTS,
        };
        Chain::regular(
            name,
            std::iter::once(Rule::new(vec![jump(affinity)]))
                .chain(dispatch_rules().into_iter().map(|(modulus, offset)| {
                    Rule::new(vec![Expr::DnatMap {
                        key,
                        modulus,
                        offset,
                        map: map.to_string(),
                    }])
                }))
                .collect(),
        )
    };

    chains.extend([
        Chain::regular(CLUSTER_IPS_CHECK, cluster_ips_check),
        Chain::regular(
            FIREWALL_CHECK,
            vec![Rule::new(vec![
                lookup(dst, FIREWALL_IPS),
                Expr::Lookup {
                    key: LookupKey::DaddrProtoPortSaddr,
                    negate: true,
                    set: FIREWALL_ALLOW.to_string(),
                },
                Expr::Verdict(Verdict::Drop),
            ])],
        ),
        Chain::regular(
            MARK_FOR_MASQUERADE,
            vec![Rule::new(vec![Expr::MarkSetOr(mark)])],
        ),
        Chain::regular(
            MASQUERADING,
            vec![
                // Hairpin: a pod that reached itself through a Service.
                Rule::new(vec![
                    Expr::Ct {
                        key: CtKey::Status,
                        negate: false,
                        bits: ct_status::DNAT,
                    },
                    lookup(LookupKey::SaddrDaddr, HAIRPIN_IPS),
                    jump(MARK_FOR_MASQUERADE),
                ]),
                Rule::new(vec![Expr::MarkUnset(mark), Expr::Verdict(Verdict::Return)]),
                Rule::new(vec![Expr::MarkSetXor(mark)]),
                Rule::new(vec![Expr::Masquerade]),
            ],
        ),
        Chain::regular(
            NODEPORT_ENDPOINTS_CHECK,
            vec![
                np(vec![
                    lookup(port, NO_ENDPOINT_NODEPORTS),
                    Expr::Verdict(Verdict::Reject),
                ]),
                np(vec![
                    lookup(port, NO_LOCAL_ENDPOINT_NODEPORTS),
                    Expr::Verdict(Verdict::Drop),
                ]),
            ],
        ),
        Chain::regular(
            SERVICE_ENDPOINTS_CHECK,
            vec![
                Rule::new(vec![
                    lookup(dst, NO_ENDPOINT_SERVICES),
                    Expr::Verdict(Verdict::Reject),
                ]),
                Rule::new(vec![
                    lookup(dst, NO_LOCAL_ENDPOINT_SERVICES),
                    Expr::Verdict(Verdict::Drop),
                ]),
            ],
        ),
        Chain::regular(SERVICES, services),
        pick(
            PICK_SERVICE_ENDPOINTS,
            MapKey::DaddrProtoPort,
            SERVICE_ENDPOINTS,
        ),
        pick(
            PICK_NODEPORT_ENDPOINTS,
            MapKey::ProtoPort,
            NODEPORT_ENDPOINTS,
        ),
        pick(
            PICK_SERVICE_CLUSTER_ENDPOINTS,
            MapKey::DaddrProtoPort,
            SERVICE_CLUSTER_ENDPOINTS,
        ),
        pick(
            PICK_NODEPORT_CLUSTER_ENDPOINTS,
            MapKey::ProtoPort,
            NODEPORT_CLUSTER_ENDPOINTS,
        ),
    ]);
    chains.extend(policy_chains);
    if localnet_guard {
        chains.push(localnet_check());
    }
    chains.extend([
        Chain::regular(SESSION_AFFINITY_IPS, affinity_rules(AffinityKey::Dst)),
        Chain::regular(
            SESSION_AFFINITY_NODEPORTS,
            affinity_rules(AffinityKey::NodePort),
        ),
        Chain::regular(SESSION_AFFINITY_RECORD, affinity_record_rules(&timeouts)),
    ]);
    // Sizes with headroom (`nodeport-ips` holds the node's addresses, no Service's).
    for s in &mut sets {
        if let Some(bound) = bounds.of_set(&s.name) {
            s.size = Some(set_size(bound, config.flat_max_set_size));
        }
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

/// The most clients each session-affinity map remembers (per timeout, over all its ports):
/// a full map records no more clients until entries expire, which costs those clients their
/// affinity, never their connection.
pub const AFFINITY_MAP_SIZE: u32 = 1 << 20;

/// `session-affinity-record`: per timeout and protocol (nft needs the protocol to type
/// `th dport` in the map's data), the client key of a DNATed new connection and the endpoint
/// it went to. A NodePort connection is one whose original destination is no ClusterIP and
/// no external destination.
fn affinity_record_rules(timeouts: &[u32]) -> Vec<Rule> {
    let mut rules = Vec::new();
    for &t in timeouts {
        let names = AffinityNames::new(t);
        for proto in [Protocol::Tcp, Protocol::Udp, Protocol::Sctp] {
            rules.push(Rule::new(vec![
                Expr::L4proto(proto),
                lookup(LookupKey::OrigDaddrProtoPort, names.dsts),
                Expr::AffinityUpdate {
                    key: AffinityKey::Dst,
                    map: names.dst_map.to_string(),
                },
            ]));
            let not_in = |key, set: &str| Expr::Lookup {
                key,
                negate: true,
                set: set.to_string(),
            };
            rules.push(Rule::new(vec![
                Expr::L4proto(proto),
                not_in(LookupKey::OrigDaddr, CLUSTER_IPS),
                not_in(LookupKey::OrigDaddrProtoPort, MASQUERADE_IPS),
                not_in(LookupKey::OrigDaddrProtoPort, LOCAL_POLICY_IPS),
                lookup(LookupKey::ProtoOrigPort, names.nodeports),
                Expr::AffinityUpdate {
                    key: AffinityKey::NodePort,
                    map: names.nodeport_map.to_string(),
                },
            ]));
        }
    }
    rules
}

/// One service port's elements.
pub fn render_service(
    svc: &ServicePortState,
    state: &FamilyState,
    config: &NodeConfig,
) -> ServiceObjects {
    let port = &svc.port;
    let proto = port.name.protocol;
    let comment: Option<std::sync::Arc<str>> = config
        .flat_comments
        .then(|| element_comment(&port.name).into());
    let mut out = ServiceObjects::default();
    // Room for the common case (a ClusterIP and a NodePort, each with a slot per endpoint,
    // and a hairpin pair per endpoint), so that the list is not grown element by element.
    let endpoints = svc.cluster_endpoints.len().max(svc.local_endpoints.len());
    out.elements
        .reserve(4 + (3 + svc.external_ips.len() + svc.load_balancer_ips.len()) * endpoints);
    // Session affinity through the maps in IPv4; IPv6 keeps kube-proxy's chains (see the
    // module's notes: nft 1.0.6 cannot write an IPv6 `update` with `addr . port` data).
    let affinity = port
        .session_affinity_seconds
        .filter(|_| state.family == IpFamily::V4)
        .map(AffinityNames::new);
    let chains_affinity = port.session_affinity_seconds.is_some() && affinity.is_none();
    if chains_affinity {
        // kube-proxy's chains and affinity sets, reached through the `goto` elements of
        // `service-ips`/`service-nodeports`; everything the filter chains use comes below.
        let kp = kube_proxy_service(svc, state, config);
        let firewall = super::names::ServiceChainNames::new(&port.name).firewall;
        out.chains = kp
            .chains
            .into_iter()
            .filter(|c| c.name != firewall)
            .collect();
        out.sets = kp.sets;
        out.elements = kp
            .elements
            .into_iter()
            .filter(|e| e.set == SERVICE_IPS || e.set == SERVICE_NODEPORTS)
            .map(|e| Element {
                comment: comment.clone(),
                ..e
            })
            .collect();
    }
    let mut el = |set: &'static str, key: ElemKey, data: Option<SocketAddr>| {
        out.elements.push(Element {
            set,
            key,
            value: None,
            data,
            comment: comment.clone(),
        });
    };

    el(CLUSTER_IPS, ElemKey::Addr(svc.cluster_ip), None);
    if let Some(names) = affinity {
        for ip in std::iter::once(&svc.cluster_ip)
            .chain(&svc.external_ips)
            .chain(&svc.load_balancer_ips)
        {
            el(
                names.dsts,
                ElemKey::AddrProtoPort(*ip, proto, port.port),
                None,
            );
        }
        if let Some(np) = port.node_port {
            el(names.nodeports, ElemKey::ProtoPort(proto, np), None);
        }
    }

    let has_internal = svc.has_internal_endpoints();
    let has_external = svc.has_external_endpoints();
    let etp_local = svc.external_policy_local();
    let internal_list: &[EndpointTarget] = if port.internal_policy_local {
        &svc.local_endpoints
    } else {
        &svc.cluster_endpoints
    };
    let external_list: &[EndpointTarget] = if etp_local {
        &svc.local_endpoints
    } else {
        &svc.cluster_endpoints
    };
    // No usable endpoint at all: reject; a Local policy without local endpoints: drop.
    let no_endpoint = |services: bool| match (svc.has_endpoints, services) {
        (false, true) => NO_ENDPOINT_SERVICES,
        (false, false) => NO_ENDPOINT_NODEPORTS,
        (true, true) => NO_LOCAL_ENDPOINT_SERVICES,
        (true, false) => NO_LOCAL_ENDPOINT_NODEPORTS,
    };
    let endpoints =
        |list: &[EndpointTarget],
         key: &dyn Fn(u32) -> ElemKey,
         map: &'static str,
         el: &mut dyn FnMut(&'static str, ElemKey, Option<SocketAddr>)| {
            if list.is_empty() {
                return;
            }
            for (slot, i) in slots(list.len()) {
                el(map, key(slot), Some(list[i].socket()));
            }
        };

    // ClusterIP.
    let cip = ElemKey::AddrProtoPort(svc.cluster_ip, proto, port.port);
    if has_internal {
        if !chains_affinity {
            endpoints(
                internal_list,
                &|s| ElemKey::AddrProtoPortSlot(svc.cluster_ip, proto, port.port, s),
                SERVICE_ENDPOINTS,
                &mut el,
            );
        }
    } else {
        el(no_endpoint(true), cip, None);
    }

    // External and load-balancer IPs.
    let external_dst =
        |ip: IpAddr, el: &mut dyn FnMut(&'static str, ElemKey, Option<SocketAddr>)| {
            let key = ElemKey::AddrProtoPort(ip, proto, port.port);
            if svc.has_endpoints && !chains_affinity {
                el(
                    if etp_local {
                        LOCAL_POLICY_IPS
                    } else {
                        MASQUERADE_IPS
                    },
                    key,
                    None,
                );
                if etp_local {
                    endpoints(
                        &svc.cluster_endpoints,
                        &|s| ElemKey::AddrProtoPortSlot(ip, proto, port.port, s),
                        SERVICE_CLUSTER_ENDPOINTS,
                        el,
                    );
                }
                if has_external {
                    endpoints(
                        external_list,
                        &|s| ElemKey::AddrProtoPortSlot(ip, proto, port.port, s),
                        SERVICE_ENDPOINTS,
                        el,
                    );
                }
            }
            if !has_external {
                el(no_endpoint(true), key, None);
            }
        };
    for ip in &svc.external_ips {
        external_dst(*ip, &mut el);
    }
    for ip in &svc.load_balancer_ips {
        external_dst(*ip, &mut el);
    }
    if svc.uses_firewall_chain() {
        let node_ip = state.node_ips.first().copied();
        let mut sources = svc.source_ranges.to_vec();
        if node_ip.is_some_and(|ip| svc.source_ranges.iter().any(|r| r.contains(&ip))) {
            // A VIP the node holds locally loops back with the VIP as source.
            sources.extend(svc.load_balancer_ips.iter().map(|ip| IpNet::from(*ip)));
        }
        for ip in &svc.load_balancer_ips {
            el(
                FIREWALL_IPS,
                ElemKey::AddrProtoPort(*ip, proto, port.port),
                None,
            );
            for range in &sources {
                el(
                    FIREWALL_ALLOW,
                    ElemKey::AddrProtoPortNet(*ip, proto, port.port, range.trunc()),
                    None,
                );
            }
        }
    }

    // NodePort.
    if let Some(np) = port.node_port {
        let key = ElemKey::ProtoPort(proto, np);
        if svc.has_endpoints && !chains_affinity {
            el(
                if etp_local {
                    LOCAL_POLICY_NODEPORTS
                } else {
                    MASQUERADE_NODEPORTS
                },
                key,
                None,
            );
            if etp_local {
                endpoints(
                    &svc.cluster_endpoints,
                    &|s| ElemKey::ProtoPortSlot(proto, np, s),
                    NODEPORT_CLUSTER_ENDPOINTS,
                    &mut el,
                );
            }
            if has_external {
                endpoints(
                    external_list,
                    &|s| ElemKey::ProtoPortSlot(proto, np, s),
                    NODEPORT_ENDPOINTS,
                    &mut el,
                );
            }
        }
        if !has_external {
            el(no_endpoint(false), key, None);
        }
    }

    // Hairpin: every endpoint this port may DNAT to (kube-proxy's `allReachable`; in the
    // order of the lists, not sorted as kube-proxy's endpoint chains are: a set has no order).
    let cluster = svc.uses_cluster_chain() && !chains_affinity;
    if cluster {
        for e in &svc.cluster_endpoints {
            el(HAIRPIN_IPS, ElemKey::AddrAddr(e.ip, e.ip), None);
        }
    }
    if svc.uses_local_chain() && !chains_affinity {
        for e in &svc.local_endpoints {
            if !(cluster && svc.cluster_endpoints.iter().any(|c| c.ip == e.ip)) {
                el(HAIRPIN_IPS, ElemKey::AddrAddr(e.ip, e.ip), None);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Protocol;

    #[test]
    fn every_endpoint_count_has_its_own_slot_range_and_every_slot_an_endpoint() {
        let rules = dispatch_rules();
        // Disjoint ranges, in increasing order.
        for w in rules.windows(2) {
            assert!(w[0].1 + w[0].0 <= w[1].1, "{w:?}");
        }
        for n in 1..=64 {
            let (m, o) = dispatch(n);
            assert_eq!((m, o), (n as u32, (n * (n - 1) / 2) as u32));
            let got: Vec<usize> = slots(n).map(|(_, i)| i).collect();
            assert_eq!(got, (0..n).collect::<Vec<_>>(), "exactly one slot each");
        }
    }

    #[test]
    fn above_64_endpoints_every_share_is_within_one_percent_of_one_nth() {
        for n in [65, 100, 127, 128, 129, 1000, 8192] {
            let mut count = vec![0u32; n];
            let (m, _) = dispatch(n);
            for (_, i) in slots(n) {
                count[i] += 1;
            }
            for c in count {
                let share = f64::from(c) / f64::from(m);
                let rel = share * n as f64;
                assert!((0.99..=1.01).contains(&rel), "n={n}: {rel}");
            }
            assert!(rules_have(dispatch(n)), "n={n} has a rule");
        }
    }

    #[test]
    fn set_sizes_are_twice_the_bound_in_powers_of_two_within_their_limits() {
        assert_eq!(set_size(0, 1 << 24), 4096);
        assert_eq!(set_size(3000, 1 << 24), 8192);
        assert_eq!(set_size(100_000, 1 << 24), 262_144);
        assert_eq!(set_size(100_000_000, 1 << 24), 1 << 24);
        assert_eq!(set_size(10, 4), 4, "the configured limit wins");
    }

    fn rules_have(d: (u32, u32)) -> bool {
        dispatch_rules().contains(&d)
    }

    #[test]
    fn comments_of_the_longest_names_kubernetes_allows_fit_in_128_bytes_keeping_namespace_and_port()
    {
        let ns = "n".repeat(63);
        let name = format!("a{}z", "m".repeat(61));
        let port = "p".repeat(15);
        let c = element_comment(&ServicePortName::new(&ns, &name, &port, Protocol::Tcp));
        assert_eq!(c.len(), COMMENT_MAX, "{c}");
        assert!(c.starts_with(&format!("{ns}/a")), "{c}");
        assert!(c.ends_with(&format!("z:{port}")), "{c}");
        assert!(c.contains("..."), "{c}");
        let short = element_comment(&ServicePortName::new("default", "web", "", Protocol::Tcp));
        assert_eq!(short, "default/web");
        let unnamed = element_comment(&ServicePortName::new(&ns, &name, "", Protocol::Tcp));
        assert_eq!(unnamed, format!("{ns}/{name}"), "127 bytes fit");
    }
}
