//! Desired state: per IP family, every service port with its endpoints already categorized
//! by traffic policy, plus the node's NodePort addresses and the service CIDRs. Pure.
//!
//! This is kube-proxy's `svcPortMap` + `endpointsMap` after `CategorizeEndpoints`
//! (`pkg/proxy/topology.go`), computed per service so a partial sync recomputes only the
//! Services that changed. Backends render from it and know nothing of Kubernetes objects.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use ipnet::IpNet;

use crate::model::{
    Endpoint, EndpointSlice, IpFamily, Node, Protocol, Service, ServiceName, ServicePort,
    ServicePortName,
};
use crate::nodeaddr::{NodeFacts, NodePortAddresses, Selection};

/// One endpoint of a service port, as the dataplane sees it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct EndpointTarget {
    /// Pod (or host) IP.
    pub ip: IpAddr,
    /// Target port.
    pub port: u16,
    /// Runs on this node.
    pub local: bool,
    /// `conditions.ready`.
    pub ready: bool,
    /// `conditions.serving`.
    pub serving: bool,
    /// `conditions.terminating`.
    pub terminating: bool,
}

impl EndpointTarget {
    /// `ip:port` (`[ip]:port` for IPv6).
    pub fn socket(&self) -> SocketAddr {
        SocketAddr::new(self.ip, self.port)
    }
}

/// One service port of one family, ready to render. Its lists are boxed slices: built once
/// and kept until the port changes, without the spare room of a `Vec` grown by a filter (16
/// places for 10 endpoints).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServicePortState {
    /// The port's configuration (shared with the other family's state).
    pub port: Arc<ServicePort>,
    /// ClusterIP of this family.
    pub cluster_ip: IpAddr,
    /// External IPs of this family.
    pub external_ips: Box<[IpAddr]>,
    /// Load-balancer ingress IPs of this family.
    pub load_balancer_ips: Box<[IpAddr]>,
    /// `loadBalancerSourceRanges` of this family.
    pub source_ranges: Box<[IpNet]>,
    /// Endpoints for the Cluster traffic policy (kube-proxy's `clusterEndpoints`).
    pub cluster_endpoints: Box<[EndpointTarget]>,
    /// Endpoints for the Local traffic policy (kube-proxy's `localEndpoints`).
    pub local_endpoints: Box<[EndpointTarget]>,
    /// Some usable endpoint exists anywhere (kube-proxy's `hasAnyEndpoints`).
    pub has_endpoints: bool,
    /// UDP ports: every endpoint with `serving` set, whatever its node or policy: the replies
    /// that conntrack entries may legitimately carry (kube-proxy's conntrack cleanup, which
    /// only looks at UDP, uses these). Sorted, without duplicates (a boxed slice: a set's node
    /// has room for eleven). Empty for other protocols, which nothing cleans: the ten
    /// addresses of a TCP port would be about 170 bytes kept for nothing.
    pub serving_ips: Box<[IpAddr]>,
    /// Distinct IPs of local endpoints that are ready (not terminating): the count the
    /// health-check node port reports.
    pub local_ready_ips: usize,
}

impl ServicePortState {
    /// The port's identity.
    pub fn name(&self) -> &ServicePortName {
        &self.port.name
    }

    /// kube-proxy's `ExternallyAccessible` in this family: a NodePort, or an external or
    /// load-balancer IP of this family. (kube-proxy builds a service port per family from
    /// that family's IPs only.)
    pub fn externally_accessible(&self) -> bool {
        self.port.node_port.is_some()
            || !self.load_balancer_ips.is_empty()
            || !self.external_ips.is_empty()
    }

    /// `externalTrafficPolicy: Local` on a port externally accessible in this family. Here
    /// deliberately per family: kube-proxy's `ExternalPolicyLocal` is the Service's, so a
    /// dual-stack Service external only in IPv4 counts in kube-proxy's IPv6
    /// `no_local_endpoints{traffic_policy="external"}` metric although nothing external exists
    /// there; the rules are the same either way.
    pub fn external_policy_local(&self) -> bool {
        self.port.external_policy_local && self.externally_accessible()
    }

    /// kube-proxy's `UsesClusterEndpoints`: Cluster-policy endpoints are used for internal
    /// traffic, or for traffic short-circuited from pods and the node to an external address.
    pub fn uses_cluster_endpoints(&self) -> bool {
        !self.port.internal_policy_local || self.externally_accessible()
    }

    /// kube-proxy's `UsesLocalEndpoints`.
    pub fn uses_local_endpoints(&self) -> bool {
        self.port.internal_policy_local || self.external_policy_local()
    }

    /// The service chain (`service-`) exists: Cluster-policy endpoints are used and some exist.
    pub fn uses_cluster_chain(&self) -> bool {
        !self.cluster_endpoints.is_empty() && self.uses_cluster_endpoints()
    }

    /// The local chain (`local-`) exists.
    pub fn uses_local_chain(&self) -> bool {
        !self.local_endpoints.is_empty() && self.uses_local_endpoints()
    }

    /// Internal (ClusterIP) traffic has somewhere to go.
    pub fn has_internal_endpoints(&self) -> bool {
        self.has_endpoints && !(self.port.internal_policy_local && self.local_endpoints.is_empty())
    }

    /// External (NodePort, external IP, load balancer) traffic has somewhere to go.
    pub fn has_external_endpoints(&self) -> bool {
        self.has_endpoints && !(self.external_policy_local() && self.local_endpoints.is_empty())
    }

    /// The `external-` chain exists.
    pub fn uses_external_chain(&self) -> bool {
        self.has_endpoints && self.externally_accessible()
    }

    /// The `firewall-` chain exists: load-balancer IPs with source ranges.
    pub fn uses_firewall_chain(&self) -> bool {
        !self.load_balancer_ips.is_empty() && !self.source_ranges.is_empty()
    }

    /// Every endpoint any chain of this port may DNAT to (kube-proxy's `allReachable`), in
    /// order and without duplicates: these get `endpoint-` chains.
    pub fn reachable_endpoints(&self) -> Vec<&EndpointTarget> {
        let mut out: Vec<&EndpointTarget> = Vec::new();
        if self.uses_cluster_chain() {
            out.extend(self.cluster_endpoints.iter());
        }
        if self.uses_local_chain() {
            for ep in &self.local_endpoints {
                if !out.iter().any(|e| e.socket() == ep.socket()) {
                    out.push(ep);
                }
            }
        }
        out.sort_by_cached_key(|e| e.socket().to_string());
        out
    }
}

/// Everything of one IP family a backend renders.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FamilyState {
    /// The family.
    pub family: IpFamily,
    /// Service ports with a ClusterIP of this family, by name.
    pub services: BTreeMap<ServicePortName, Arc<ServicePortState>>,
    /// The node's IPs of this family (primary first): source ranges that contain one of
    /// them also admit the load-balancer IPs as sources (hairpin from the node).
    pub node_ips: Vec<IpAddr>,
    /// Addresses that accept NodePort traffic.
    pub nodeport_ips: Selection,
    /// Service CIDRs of this family (from ServiceCIDR objects): unallocated ClusterIPs in
    /// them are dropped.
    pub service_cidrs: Vec<IpNet>,
}

/// The desired state of every enabled family.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DesiredState {
    /// One entry per enabled family, IPv4 first.
    pub families: Vec<FamilyState>,
}

impl DesiredState {
    /// The state of one family, if enabled.
    pub fn family(&self, family: IpFamily) -> Option<&FamilyState> {
        self.families.iter().find(|f| f.family == family)
    }
}

/// Facts about the node the categorization depends on.
#[derive(Debug, Clone, Copy)]
pub struct NodeView<'a> {
    /// This node's name (endpoints with this `nodeName` are local).
    pub name: &'a str,
    /// This node's zone label, for topology hints.
    pub zone: Option<&'a str>,
}

impl<'a> NodeView<'a> {
    /// A view of a node known by name only.
    pub fn named(name: &'a str) -> Self {
        NodeView { name, zone: None }
    }

    /// A view of a Node object.
    pub fn of(node: &'a Node) -> Self {
        NodeView {
            name: &node.name,
            zone: node.zone.as_deref(),
        }
    }
}

/// Merges the endpoints of `port` from the slices of its Service, kube-proxy's
/// EndpointSliceCache way: slices in name order, one entry per `ip:port` (a ready copy wins
/// over a not-ready one), sorted by the `ip:port` string as kube-proxy sorts them (so
/// `10.0.0.10:80` comes before `10.0.0.2:80`).
pub fn merge_endpoints(
    port: &ServicePortName,
    family: IpFamily,
    slices: &[&EndpointSlice],
    node_name: &str,
) -> Vec<EndpointTarget> {
    merge_with_source(port, family, slices, node_name)
        .into_iter()
        .map(|(t, _)| t)
        .collect()
}

/// [`merge_endpoints`], keeping each target's slice entry (for its topology hints).
fn merge_with_source<'a>(
    port: &ServicePortName,
    family: IpFamily,
    slices: &[&'a EndpointSlice],
    node_name: &str,
) -> Vec<(EndpointTarget, &'a Endpoint)> {
    let mut by_socket: BTreeMap<String, (EndpointTarget, &'a Endpoint)> = BTreeMap::new();
    for slice in slices.iter().filter(|s| s.family == family) {
        for ep_port in slice
            .ports
            .iter()
            .filter(|p| *p.name == *port.port && p.protocol == port.protocol)
        {
            for ep in &slice.endpoints {
                let target = target(ep, ep_port.port, node_name);
                let key = target.socket().to_string();
                // One ip:port in two slices: while an endpoint moves between slices, or when
                // a new pod got the IP of one still terminating. kube-proxy keeps the copy
                // that is not terminating (the running pod); between two alike, the ready one.
                let rank = |t: &EndpointTarget| (!t.terminating, t.ready);
                match by_socket.get(&key) {
                    Some((existing, _)) if rank(existing) >= rank(&target) => {}
                    _ => {
                        by_socket.insert(key, (target, ep));
                    }
                }
            }
        }
    }
    by_socket.into_values().collect()
}

fn target(ep: &Endpoint, port: u16, node_name: &str) -> EndpointTarget {
    EndpointTarget {
        ip: ep.ip,
        port,
        local: ep.node_name() == Some(node_name),
        ready: ep.ready,
        serving: ep.serving,
        terminating: ep.terminating,
    }
}

/// Topology mode from hints (kube-proxy's `topologyModeFromHints`): same node if every
/// ready endpoint carries node hints and one names this node, else same zone under the same
/// all-hinted rule, else none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Topology {
    None,
    SameNode,
    SameZone,
}

fn topology_mode(slices_eps: &[(EndpointTarget, &Endpoint)], node: NodeView<'_>) -> Topology {
    let mut all_node_hints = true;
    let mut for_node = false;
    let mut all_zone_hints = true;
    let mut for_zone = false;
    for (t, ep) in slices_eps {
        if !t.ready {
            continue;
        }
        if ep.node_hints().is_empty() {
            all_node_hints = false;
        } else if ep.node_hints().iter().any(|n| **n == *node.name) {
            for_node = true;
        }
        if ep.zone_hints().is_empty() {
            all_zone_hints = false;
        } else if node
            .zone
            .is_some_and(|z| ep.zone_hints().iter().any(|h| **h == *z))
        {
            for_zone = true;
        }
    }
    if all_node_hints && for_node {
        Topology::SameNode
    } else if all_zone_hints && for_zone {
        Topology::SameZone
    } else {
        Topology::None
    }
}

/// Computes the state of one service port of one family from the slices of its Service.
/// `None` when the port has no ClusterIP of this family.
pub fn service_port_state(
    port: &Arc<ServicePort>,
    family: IpFamily,
    slices: &[&EndpointSlice],
    node: NodeView<'_>,
) -> Option<ServicePortState> {
    let cluster_ip = port.cluster_ip(family)?;
    let of_family = |ips: &[IpAddr]| -> Box<[IpAddr]> {
        ips.iter()
            .copied()
            .filter(|ip| IpFamily::of(*ip) == family)
            .collect()
    };
    let hinted = merge_with_source(&port.name, family, slices, node.name);
    let endpoints: Vec<EndpointTarget> = hinted.iter().map(|(t, _)| t.clone()).collect();

    let mut state = ServicePortState {
        port: port.clone(),
        cluster_ip,
        external_ips: of_family(&port.external_ips),
        load_balancer_ips: of_family(&port.load_balancer_ips),
        source_ranges: port
            .load_balancer_source_ranges
            .iter()
            .copied()
            .filter(|n| IpFamily::of_net(n) == family)
            .collect(),
        cluster_endpoints: Box::default(),
        local_endpoints: Box::default(),
        has_endpoints: false,
        serving_ips: if port.name.protocol != Protocol::Udp {
            Box::default()
        } else {
            let mut ips: Vec<IpAddr> = endpoints
                .iter()
                .filter(|e| e.serving)
                .map(|e| e.ip)
                .collect();
            ips.sort_unstable();
            ips.dedup();
            ips.into_boxed_slice()
        },
        local_ready_ips: endpoints
            .iter()
            .filter(|e| e.local && e.ready && !e.terminating)
            .map(|e| e.ip)
            .collect::<BTreeSet<_>>()
            .len(),
    };

    // kube-proxy's CategorizeEndpoints.
    if state.uses_cluster_endpoints() {
        let mode = topology_mode(&hinted, node);
        let available = |t: &EndpointTarget| match mode {
            Topology::None => true,
            Topology::SameNode => hinted
                .iter()
                .any(|(h, e)| h == t && e.node_hints().iter().any(|n| **n == *node.name)),
            Topology::SameZone => hinted.iter().any(|(h, e)| {
                h == t
                    && node
                        .zone
                        .is_some_and(|z| e.zone_hints().iter().any(|n| **n == *z))
            }),
        };
        state.cluster_endpoints = endpoints
            .iter()
            .filter(|e| e.ready && available(e))
            .cloned()
            .collect();
        if state.cluster_endpoints.is_empty() {
            // No ready endpoint anywhere: fall back to serving-and-terminating ones
            // (KEP-1669, ProxyTerminatingEndpoints).
            state.cluster_endpoints = endpoints
                .iter()
                .filter(|e| e.serving && e.terminating && available(e))
                .cloned()
                .collect();
        }
        state.has_endpoints = !state.cluster_endpoints.is_empty();
    }
    if state.uses_local_endpoints() {
        let mut local_ready = false;
        let mut local_serving_terminating = false;
        for e in &endpoints {
            if e.ready {
                state.has_endpoints = true;
                local_ready |= e.local;
            } else if e.serving && e.terminating {
                state.has_endpoints = true;
                local_serving_terminating |= e.local;
            }
        }
        state.local_endpoints = if local_ready {
            endpoints
                .iter()
                .filter(|e| e.local && e.ready)
                .cloned()
                .collect()
        } else if local_serving_terminating {
            endpoints
                .iter()
                .filter(|e| e.local && e.serving && e.terminating)
                .cloned()
                .collect()
        } else {
            Box::default()
        };
    }
    Some(state)
}

/// Static inputs of the desired state that come from configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateConfig {
    /// Families to program (both by default, as kube-proxy's dual-stack proxier does).
    pub families: Vec<IpFamily>,
    /// `--nodeport-addresses`.
    pub nodeport_addresses: NodePortAddresses,
}

impl Default for StateConfig {
    fn default() -> Self {
        StateConfig {
            families: IpFamily::ALL.to_vec(),
            nodeport_addresses: NodePortAddresses::default(),
        }
    }
}

/// Read access to the known objects, so that the desired state can be computed from the
/// proxy's trackers and from a parsed objects file alike.
pub trait Objects {
    /// Every Service.
    fn services(&self) -> Box<dyn Iterator<Item = (&ServiceName, &Service)> + '_>;
    /// One Service.
    fn service(&self, name: &ServiceName) -> Option<&Service>;
    /// The EndpointSlices of a Service.
    fn slices_of(&self, service: &ServiceName) -> Vec<&EndpointSlice>;
    /// Service CIDRs from every ServiceCIDR object.
    fn service_cidrs(&self) -> Vec<IpNet>;
}

/// Computes the whole desired state.
pub fn build(
    objects: &dyn Objects,
    node: NodeView<'_>,
    facts: &NodeFacts,
    config: &StateConfig,
) -> DesiredState {
    let cidrs = objects.service_cidrs();
    let families = config
        .families
        .iter()
        .map(|&family| {
            let mut services = BTreeMap::new();
            for (name, svc) in objects.services() {
                let slices = objects.slices_of(name);
                for port in &svc.ports {
                    if let Some(state) = service_port_state(port, family, &slices, node) {
                        services.insert(port.name.clone(), Arc::new(state));
                    }
                }
            }
            FamilyState {
                family,
                services,
                node_ips: facts.node_ips(family),
                nodeport_ips: config.nodeport_addresses.select(family, facts),
                service_cidrs: cidrs
                    .iter()
                    .copied()
                    .filter(|c| IpFamily::of_net(c) == family)
                    .collect(),
            }
        })
        .collect();
    DesiredState { families }
}

impl DesiredState {
    /// Recomputes the given Services only (a partial sync); returns the service ports whose
    /// state changed, per family.
    pub fn refresh_services(
        &mut self,
        objects: &dyn Objects,
        node: NodeView<'_>,
        changed: &BTreeSet<ServiceName>,
    ) -> BTreeSet<ServicePortName> {
        let mut touched = BTreeSet::new();
        for fam in &mut self.families {
            for name in changed {
                // Drop the old ports of this Service, then insert the current ones.
                let old: Vec<ServicePortName> = fam
                    .services
                    .range(
                        ServicePortName::new(
                            &name.namespace,
                            &name.name,
                            "",
                            crate::model::Protocol::Tcp,
                        )..,
                    )
                    .take_while(|(k, _)| k.namespace == name.namespace && k.name == name.name)
                    .map(|(k, _)| k.clone())
                    .collect();
                let mut fresh = BTreeMap::new();
                if let Some(svc) = objects.service(name) {
                    let slices = objects.slices_of(name);
                    for port in &svc.ports {
                        if let Some(state) = service_port_state(port, fam.family, &slices, node) {
                            fresh.insert(port.name.clone(), Arc::new(state));
                        }
                    }
                }
                for k in old {
                    if !fresh.contains_key(&k) {
                        fam.services.remove(&k);
                        touched.insert(k);
                    }
                }
                for (k, v) in fresh {
                    if fam.services.get(&k) != Some(&v) {
                        fam.services.insert(k.clone(), v);
                        touched.insert(k);
                    }
                }
            }
        }
        touched
    }

    /// Re-selects node addresses and service CIDRs (node or address changes); returns
    /// whether anything changed.
    pub fn refresh_node(
        &mut self,
        objects: &dyn Objects,
        facts: &NodeFacts,
        config: &StateConfig,
    ) -> bool {
        let cidrs = objects.service_cidrs();
        let mut changed = false;
        for fam in &mut self.families {
            let node_ips = facts.node_ips(fam.family);
            let nodeport_ips = config.nodeport_addresses.select(fam.family, facts);
            let service_cidrs: Vec<IpNet> = cidrs
                .iter()
                .copied()
                .filter(|c| IpFamily::of_net(c) == fam.family)
                .collect();
            if node_ips != fam.node_ips
                || nodeport_ips != fam.nodeport_ips
                || service_cidrs != fam.service_cidrs
            {
                changed = true;
                fam.node_ips = node_ips;
                fam.nodeport_ips = nodeport_ips;
                fam.service_cidrs = service_cidrs;
            }
        }
        changed
    }
}
