//! Names of nftables objects, exactly as kube-proxy names them.
//!
//! Static objects have fixed names (kube-proxy's constants in `pkg/proxy/nftables`); per
//! service port objects are a prefix plus the hashed base of [`crate::names`]. The longest
//! prefix, `endpoint-`/`affinity-`/`external-`/`firewall-`, fits in the 16 characters
//! kube-proxy budgets, so every name stays within nftables' 256 characters.

use std::net::IpAddr;

use crate::model::ServicePortName;
use crate::names::{nft_endpoint_base, nft_service_port_base};

/// Base chain: LoadBalancerSourceRanges, before DNAT (`prerouting`, `dstnat - 10`).
pub const FILTER_PREROUTING_PRE_DNAT: &str = "filter-prerouting-pre-dnat";
/// Base chain: LoadBalancerSourceRanges for locally generated traffic (`output`, -110).
pub const FILTER_OUTPUT_PRE_DNAT: &str = "filter-output-pre-dnat";
/// Base chain: no-endpoint checks for traffic to this host (`input`, `filter`).
pub const FILTER_INPUT: &str = "filter-input";
/// Base chain: no-endpoint and ClusterIP checks for routed traffic (`forward`, `filter`).
pub const FILTER_FORWARD: &str = "filter-forward";
/// Base chain: no-endpoint and ClusterIP checks for local traffic (`output`, `filter`).
pub const FILTER_OUTPUT: &str = "filter-output";
/// Base chain: DNAT of arriving traffic (`prerouting`, `dstnat`).
pub const NAT_PREROUTING: &str = "nat-prerouting";
/// Base chain: DNAT of locally generated traffic (`output`, `dstnat`).
pub const NAT_OUTPUT: &str = "nat-output";
/// Base chain: masquerade (`postrouting`, `srcnat`).
pub const NAT_POSTROUTING: &str = "nat-postrouting";

/// Dispatch to the service chains through `service-ips` and `service-nodeports`.
pub const SERVICES: &str = "services";
/// Masquerades marked packets.
pub const MASQUERADING: &str = "masquerading";
/// Sets the masquerade mark.
pub const MARK_FOR_MASQUERADE: &str = "mark-for-masquerade";
/// Rejects traffic to ClusterIP ports no Service serves, drops unallocated ClusterIPs.
pub const CLUSTER_IPS_CHECK: &str = "cluster-ips-check";
/// Looks up `no-endpoint-services`.
pub const SERVICE_ENDPOINTS_CHECK: &str = "service-endpoints-check";
/// Looks up `no-endpoint-nodeports`.
pub const NODEPORT_ENDPOINTS_CHECK: &str = "nodeport-endpoints-check";
/// Looks up `firewall-ips`.
pub const FIREWALL_CHECK: &str = "firewall-check";
/// Drops connections to 127.0.0.0/8 from outside the node when localhost NodePorts are on
/// (CVE-2020-8558). Ours: kube-proxy's nftables mode has no localhost NodePorts.
pub const LOCALNET_CHECK: &str = "localnet-check";
/// `reject`, the target of no-endpoint verdicts.
pub const REJECT_CHAIN: &str = "reject-chain";

/// Set: every active ClusterIP.
pub const CLUSTER_IPS: &str = "cluster-ips";
/// Set: this node's NodePort addresses.
pub const NODEPORT_IPS: &str = "nodeport-ips";
/// Map: `addr . proto . port` of ClusterIPs, external IPs and load-balancer IPs → service chain.
pub const SERVICE_IPS: &str = "service-ips";
/// Map: `proto . port` of NodePorts → external chain.
pub const SERVICE_NODEPORTS: &str = "service-nodeports";
/// Map: services without endpoints → drop or reject.
pub const NO_ENDPOINT_SERVICES: &str = "no-endpoint-services";
/// Map: NodePorts without endpoints → drop or reject.
pub const NO_ENDPOINT_NODEPORTS: &str = "no-endpoint-nodeports";
/// Map: load-balancer IPs with source ranges → firewall chain.
pub const FIREWALL_IPS: &str = "firewall-ips";

// The flat layout's own objects (`--nftables-layout flat`); see `super::flat`.

/// Flat layout, set: destinations whose traffic policy is Local and that have no local
/// endpoint: dropped.
pub const NO_LOCAL_ENDPOINT_SERVICES: &str = "no-local-endpoint-services";
/// Flat layout, set: NodePorts (`proto . port`) without a local endpoint under
/// `externalTrafficPolicy: Local`: dropped.
pub const NO_LOCAL_ENDPOINT_NODEPORTS: &str = "no-local-endpoint-nodeports";
/// Flat layout, interval set: `addr . proto . port . source range` that
/// LoadBalancerSourceRanges admit.
pub const FIREWALL_ALLOW: &str = "firewall-allow";
/// Flat layout, set: external and load-balancer destinations with
/// `externalTrafficPolicy: Cluster`, masqueraded.
pub const MASQUERADE_IPS: &str = "masquerade-ips";
/// Flat layout, set: NodePorts with `externalTrafficPolicy: Cluster`, masqueraded.
pub const MASQUERADE_NODEPORTS: &str = "masquerade-nodeports";
/// Flat layout, set: external and load-balancer destinations with
/// `externalTrafficPolicy: Local` (pod and node sources short-circuit to every endpoint).
pub const LOCAL_POLICY_IPS: &str = "local-policy-ips";
/// Flat layout, set: NodePorts with `externalTrafficPolicy: Local`.
pub const LOCAL_POLICY_NODEPORTS: &str = "local-policy-nodeports";
/// Flat layout, set: `endpoint IP . endpoint IP`: a pod reaching itself through a Service
/// (hairpin) is masqueraded.
pub const HAIRPIN_IPS: &str = "hairpin-ips";
/// Flat layout, map: `addr . proto . port . slot` → endpoint `addr . port`, the endpoints
/// of each ClusterIP, external and load-balancer destination under its traffic policy.
pub const SERVICE_ENDPOINTS: &str = "service-endpoints";
/// Flat layout, map: `proto . port . slot` → endpoint, for NodePorts.
pub const NODEPORT_ENDPOINTS: &str = "nodeport-endpoints";
/// Flat layout, map: the Cluster-policy endpoints of `externalTrafficPolicy: Local`
/// destinations, for traffic from pods and the node (short-circuit).
pub const SERVICE_CLUSTER_ENDPOINTS: &str = "service-cluster-endpoints";
/// Flat layout, map: as [`SERVICE_CLUSTER_ENDPOINTS`], for NodePorts.
pub const NODEPORT_CLUSTER_ENDPOINTS: &str = "nodeport-cluster-endpoints";
/// Flat layout, chain: picks an endpoint from [`SERVICE_ENDPOINTS`].
pub const PICK_SERVICE_ENDPOINTS: &str = "pick-service-endpoints";
/// Flat layout, chain: picks an endpoint from [`NODEPORT_ENDPOINTS`].
pub const PICK_NODEPORT_ENDPOINTS: &str = "pick-nodeport-endpoints";
/// Flat layout, chain: picks an endpoint from [`SERVICE_CLUSTER_ENDPOINTS`].
pub const PICK_SERVICE_CLUSTER_ENDPOINTS: &str = "pick-service-cluster-endpoints";
/// Flat layout, chain: picks an endpoint from [`NODEPORT_CLUSTER_ENDPOINTS`].
pub const PICK_NODEPORT_CLUSTER_ENDPOINTS: &str = "pick-nodeport-cluster-endpoints";
/// Flat layout, chain: what a ClusterIP destination gets (masquerade mark, endpoint choice).
pub const CLUSTER_IP_POLICY: &str = "cluster-ip-policy";
/// Flat layout, chain: an external destination with `externalTrafficPolicy: Cluster`.
pub const EXTERNAL_CLUSTER_POLICY: &str = "external-cluster-policy";
/// Flat layout, chain: an external destination with `externalTrafficPolicy: Local`.
pub const EXTERNAL_LOCAL_POLICY: &str = "external-local-policy";
/// Flat layout, chain: a NodePort with `externalTrafficPolicy: Cluster`.
pub const NODEPORT_CLUSTER_POLICY: &str = "nodeport-cluster-policy";
/// Flat layout, chain: a NodePort with `externalTrafficPolicy: Local`.
pub const NODEPORT_LOCAL_POLICY: &str = "nodeport-local-policy";
/// Flat layout, chain: records the endpoint of each new connection to a session-affinity
/// destination (after DNAT, from `nat-postrouting` and `filter-input`).
pub const SESSION_AFFINITY_RECORD: &str = "session-affinity-record";
/// Flat layout, chain: sends a client back to the endpoint remembered for it, first thing in
/// the `pick-service…` chains (empty without session affinity).
pub const SESSION_AFFINITY_IPS: &str = "session-affinity-ips";
/// Flat layout, chain: the same for the `pick-nodeport…` chains.
pub const SESSION_AFFINITY_NODEPORTS: &str = "session-affinity-nodeports";

/// The chain names of one service port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceChainNames {
    /// `service-<H>`: Cluster traffic policy.
    pub cluster: String,
    /// `local-<H>`: Local traffic policy.
    pub local: String,
    /// `external-<H>`: external traffic entry.
    pub external: String,
    /// `firewall-<H>`: LoadBalancerSourceRanges.
    pub firewall: String,
}

impl ServiceChainNames {
    /// The names for `port`.
    pub fn new(port: &ServicePortName) -> Self {
        let base = nft_service_port_base(port);
        ServiceChainNames {
            cluster: format!("service-{base}"),
            local: format!("local-{base}"),
            external: format!("external-{base}"),
            firewall: format!("firewall-{base}"),
        }
    }
}

/// `endpoint-<H>` and `affinity-<H>` of one endpoint of a service port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointNames {
    /// The DNAT chain.
    pub chain: String,
    /// The session affinity set.
    pub affinity: String,
}

impl EndpointNames {
    /// The names for an endpoint of `port`.
    pub fn new(port: &ServicePortName, ip: IpAddr, target_port: u16) -> Self {
        let base = nft_endpoint_base(port, ip, target_port);
        EndpointNames {
            chain: format!("endpoint-{base}"),
            affinity: format!("affinity-{base}"),
        }
    }
}

/// kube-proxy's `isServiceChainName`: per service chains are those with a `/` in the name;
/// any such chain in the table that the desired ruleset lacks is stale.
pub fn is_service_chain(name: &str) -> bool {
    name.contains('/')
}

/// kube-proxy's `isAffinitySetName`.
pub fn is_affinity_set(name: &str) -> bool {
    name.starts_with("affinity-")
}

/// `name` as a `&'static str` (set names of elements, [`Element::set`](super::ruleset::Element)):
/// names made at run time (read from a listing, or the flat layout's per-timeout affinity
/// sets) are leaked once per process; a table has a few dozen.
pub fn intern(name: &str) -> &'static str {
    static NAMES: std::sync::Mutex<Option<std::collections::HashSet<&'static str>>> =
        std::sync::Mutex::new(None);
    let mut names = NAMES.lock().unwrap_or_else(|e| e.into_inner());
    let names = names.get_or_insert_with(std::collections::HashSet::new);
    if let Some(n) = names.get(name) {
        return n;
    }
    let leaked: &'static str = Box::leak(name.to_string().into_boxed_str());
    names.insert(leaked);
    leaked
}

/// The flat layout's session-affinity objects of one timeout: which destinations and
/// NodePorts have `sessionAffinity: ClientIP` with it, and the dynamic maps from a client to
/// the endpoint it was sent to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AffinityNames {
    /// Set of `addr . proto . port`.
    pub dsts: &'static str,
    /// Set of `proto . port`.
    pub nodeports: &'static str,
    /// Map `client . addr . proto . port : endpoint`.
    pub dst_map: &'static str,
    /// Map `client . proto . port : endpoint`.
    pub nodeport_map: &'static str,
}

impl AffinityNames {
    /// The names for `timeout` seconds. The maps start with `affinity-`, as kube-proxy's
    /// affinity sets: a full sync keeps what the kernel recorded in them ([`is_affinity_set`]).
    pub fn new(timeout: u32) -> Self {
        AffinityNames {
            dsts: intern(&format!("sticky-ips-{timeout}")),
            nodeports: intern(&format!("sticky-nodeports-{timeout}")),
            dst_map: intern(&format!("affinity-ips-{timeout}")),
            nodeport_map: intern(&format!("affinity-nodeports-{timeout}")),
        }
    }
}
