//! The Services a node's kernel names, recovered from the rules (or maps) alone: what
//! `nodeport trace --rules kernel` names a packet's path with when it has no objects (no
//! `-f`, no API server).
//!
//! Each backend reads what its kernel form says of a Service port into [`PortFacts`]
//! (`nftables::recover` from element comments and chain names, `iptables::recover` from
//! `-m comment` texts and chain jumps, `ebpf::recover` from the maps, which hold ids, not
//! names); [`Recovered::into_desired`] turns them into the [`DesiredState`] that
//! [`explain`](super::explain) names a trace with, as it would the objects'.
//!
//! What a kernel form does not say is taken as the common case, and documented where it is
//! decided: an external address is an `externalIPs` entry unless the kernel guards it with
//! source ranges (a load-balancer IP); an endpoint is on this node when the kernel lists it
//! for a Local policy, or when the caller's test (the node's routes) says so.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use ipnet::IpNet;

use crate::desired::{DesiredState, EndpointTarget, FamilyState, ServicePortState};
use crate::model::{IpFamily, Protocol, ServicePort, ServicePortName};
use crate::nodeaddr::Selection;

/// What the kernel says of one Service port of one family.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PortFacts {
    /// `spec.ports[].port`.
    pub port: Option<u16>,
    /// The ClusterIP.
    pub cluster_ip: Option<IpAddr>,
    /// The NodePort.
    pub node_port: Option<u16>,
    /// External destinations not known to be load-balancer IPs.
    pub external_ips: BTreeSet<IpAddr>,
    /// Load-balancer IPs (the kernel guards them with source ranges).
    pub load_balancer_ips: BTreeSet<IpAddr>,
    /// `loadBalancerSourceRanges`.
    pub source_ranges: BTreeSet<IpNet>,
    /// `externalTrafficPolicy: Local`.
    pub external_policy_local: bool,
    /// `internalTrafficPolicy: Local`.
    pub internal_policy_local: bool,
    /// `sessionAffinity: ClientIP` timeout.
    pub session_affinity_seconds: Option<u32>,
    /// The Cluster policy's endpoints, in the kernel's order.
    pub cluster_endpoints: Vec<SocketAddr>,
    /// The Local policy's endpoints (on this node), when the kernel lists them.
    pub local_endpoints: Option<Vec<SocketAddr>>,
    /// The kernel rejects the port's traffic for want of any endpoint.
    pub no_endpoints: bool,
    /// Endpoints this node holds per the kernel besides [`Self::local_endpoints`] (the ebpf
    /// mode's backends without its remote flag).
    pub known_local: BTreeSet<SocketAddr>,
    /// Endpoints the kernel says are on another node (the ebpf mode's remote flag).
    pub known_remote: BTreeSet<SocketAddr>,
}

impl PortFacts {
    /// Adds an endpoint to a list, keeping the kernel's order and each endpoint once.
    pub fn push_endpoint(list: &mut Vec<SocketAddr>, endpoint: SocketAddr) {
        if !list.contains(&endpoint) {
            list.push(endpoint);
        }
    }

    /// The Local policy's list, created empty on first use.
    pub fn local_list(&mut self) -> &mut Vec<SocketAddr> {
        self.local_endpoints.get_or_insert_with(Vec::new)
    }
}

/// What the kernel says of one family.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FamilyFacts {
    /// Service ports by name.
    pub ports: BTreeMap<ServicePortName, PortFacts>,
    /// The NodePort addresses (`nodeport-ips`, iptables' `KUBE-NODEPORTS` jumps); `None`:
    /// every local address.
    pub nodeport_ips: Option<BTreeSet<IpAddr>>,
    /// ServiceCIDRs whose unallocated addresses are dropped.
    pub service_cidrs: Vec<IpNet>,
}

/// What the kernel says of every family.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Recovered {
    /// IPv4, IPv6.
    pub families: BTreeMap<IpFamily, FamilyFacts>,
    /// `--cluster-cidr`, as the ClusterIP masquerade rules show it (`ip saddr != …`).
    pub cluster_cidrs: BTreeSet<IpNet>,
    /// `--masquerade-all`: every ClusterIP packet is marked for masquerade.
    pub masquerade_all: bool,
}

impl Recovered {
    /// The facts of a family, created empty on first use.
    pub fn family(&mut self, family: IpFamily) -> &mut FamilyFacts {
        self.families.entry(family).or_default()
    }

    /// The facts of a Service port, created empty on first use.
    pub fn port(&mut self, family: IpFamily, name: &ServicePortName) -> &mut PortFacts {
        self.family(family).ports.entry(name.clone()).or_default()
    }

    /// The NodePort addresses of a family, when the kernel lists them.
    pub fn nodeport_ips(&self, family: IpFamily) -> Option<&BTreeSet<IpAddr>> {
        self.families.get(&family)?.nodeport_ips.as_ref()
    }

    /// Every Service port and endpoint as the desired state [`explain`](super::explain)
    /// reads. `on_this_node` decides for an endpoint the kernel does not place (the caller
    /// asks the node's routes); a port whose ClusterIP the kernel does not show gets the
    /// unspecified address (no packet is addressed to it).
    pub fn into_desired(&self, on_this_node: &dyn Fn(IpAddr) -> bool) -> DesiredState {
        let mut families = Vec::new();
        for (&family, facts) in &self.families {
            let unspecified = match family {
                IpFamily::V4 => IpAddr::from([0u8; 4]),
                IpFamily::V6 => IpAddr::from([0u16; 8]),
            };
            let mut services = BTreeMap::new();
            for (name, f) in &facts.ports {
                let cluster_ip = f.cluster_ip.unwrap_or(unspecified);
                let local_list = f.local_endpoints.clone();
                let here = |e: &SocketAddr| {
                    !f.known_remote.contains(e)
                        && (f.known_local.contains(e)
                            || local_list.as_ref().is_some_and(|l| l.contains(e))
                            || on_this_node(e.ip()))
                };
                let target = |e: &SocketAddr, local: bool| EndpointTarget {
                    ip: e.ip(),
                    port: e.port(),
                    local,
                    ready: true,
                    serving: true,
                    terminating: false,
                };
                let cluster_endpoints: Vec<EndpointTarget> = f
                    .cluster_endpoints
                    .iter()
                    .map(|e| target(e, here(e)))
                    .collect();
                let local_endpoints: Vec<EndpointTarget> = match &local_list {
                    Some(list) => list.iter().map(|e| target(e, true)).collect(),
                    None => cluster_endpoints
                        .iter()
                        .filter(|e| e.local)
                        .cloned()
                        .collect(),
                };
                let has_endpoints = !f.no_endpoints
                    && (!cluster_endpoints.is_empty()
                        || !local_endpoints.is_empty()
                        || f.external_policy_local
                        || f.internal_policy_local);
                let local_ready_ips = local_endpoints
                    .iter()
                    .map(|e| e.ip)
                    .collect::<BTreeSet<_>>()
                    .len();
                let external_ips: Box<[IpAddr]> = f.external_ips.iter().copied().collect();
                let load_balancer_ips: Box<[IpAddr]> =
                    f.load_balancer_ips.iter().copied().collect();
                let source_ranges: Box<[IpNet]> = f.source_ranges.iter().copied().collect();
                let port = Arc::new(ServicePort {
                    name: name.clone(),
                    cluster_ips: f.cluster_ip.into_iter().collect(),
                    port: f.port.unwrap_or(0),
                    node_port: f.node_port,
                    external_ips: external_ips.clone(),
                    load_balancer_ips: load_balancer_ips.clone(),
                    load_balancer_source_ranges: source_ranges.clone(),
                    external_policy_local: f.external_policy_local,
                    internal_policy_local: f.internal_policy_local,
                    session_affinity_seconds: f.session_affinity_seconds,
                    health_check_node_port: None,
                });
                services.insert(
                    name.clone(),
                    Arc::new(ServicePortState {
                        port,
                        cluster_ip,
                        external_ips,
                        load_balancer_ips,
                        source_ranges,
                        cluster_endpoints: cluster_endpoints.into(),
                        local_endpoints: local_endpoints.into(),
                        has_endpoints,
                        serving_ips: Box::new([]),
                        local_ready_ips,
                    }),
                );
            }
            let nodeport_ips = match &facts.nodeport_ips {
                Some(ips) => Selection::Ips(ips.clone()),
                None => Selection::MatchAll,
            };
            families.push(FamilyState {
                family,
                services,
                node_ips: facts
                    .nodeport_ips
                    .iter()
                    .flatten()
                    .copied()
                    .filter(|ip| !ip.is_loopback())
                    .collect(),
                nodeport_ips,
                service_cidrs: facts.service_cidrs.clone(),
            });
        }
        DesiredState { families }
    }
}

/// A Service port's name as kube-proxy writes it in comments (`ServicePortName.String()`:
/// `namespace/name:port`, `namespace/name` for an unnamed port), with its protocol. `None`
/// for any other text. A name the flat layout shortened to fit nftables' 128-byte comments
/// keeps its `...`: it still tells one Service from another.
pub fn parse_port_name(text: &str, protocol: Protocol) -> Option<ServicePortName> {
    let (namespace, rest) = text.split_once('/')?;
    let (name, port) = rest.split_once(':').unwrap_or((rest, ""));
    let valid = |s: &str| {
        !s.is_empty()
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.'))
    };
    (valid(namespace) && valid(name) && (port.is_empty() || valid(port)))
        .then(|| ServicePortName::new(namespace, name, port, protocol))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{NftablesLayout, NodeConfig};
    use crate::desired::{self, NodeView, StateConfig};
    use crate::nodeaddr::NodeFacts;
    use crate::trace::explain::{self, Context, Dataplane, Explanation};
    use crate::trace::{Env, Origin, Packet};
    use crate::{ebpf, iptables, nftables, objects};

    /// The cluster `nodeport trace`'s golden outputs are traced on: every fate.
    const OBJECTS: &str = include_str!("../../../nodeport/tests/testdata/trace/objects.yaml");

    /// A Service whose two ports share their ClusterIP (the kernel's `cluster-ips` element
    /// names only one of them) and whose UDP port has no endpoint.
    const TWO_PORTS: &str = r#"
---
apiVersion: v1
kind: Service
metadata: {name: duo, namespace: default}
spec:
  type: NodePort
  clusterIP: 10.96.0.17
  ports:
  - {name: a-dns, port: 53, targetPort: 5353, protocol: UDP, nodePort: 30575}
  - {name: http, port: 80, targetPort: 8080, nodePort: 30576}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: duo-1, namespace: default, labels: {kubernetes.io/service-name: duo}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints:
- {addresses: [10.244.1.20], nodeName: node-a}
- {addresses: [10.244.2.20], nodeName: node-b}
"#;

    /// `trace_cli`'s packets: every fate of the fixture (from, to, port), TCP; and the
    /// two-port Service's.
    const PACKETS: &[(&str, &str, u16)] = &[
        ("203.0.113.5", "192.0.2.11", 30569),
        ("203.0.113.5", "192.0.2.11", 30570),
        ("203.0.113.5", "192.0.2.11", 30571),
        ("198.51.100.7", "198.51.100.200", 443),
        ("203.0.113.5", "198.51.100.200", 443),
        ("203.0.113.5", "198.51.100.11", 30569),
        ("203.0.113.5", "192.0.2.11", 22),
        ("10.244.2.3", "10.96.0.10", 80),
        ("192.0.2.11", "10.96.0.10", 80),
        ("2001:db8::99", "2001:db8::11", 30569),
        ("2001:db8::99", "fd00:96::10", 80),
        ("203.0.113.5", "192.0.2.11", 30573),
        ("192.0.2.11", "192.0.2.11", 30573),
        ("192.0.2.11", "10.96.0.14", 80),
        ("10.244.2.3", "10.96.0.15", 80),
        ("203.0.113.5", "192.0.2.11", 30574),
        ("203.0.113.5", "192.0.2.11", 30572),
        ("10.244.2.3", "10.96.0.11", 80),
        ("10.244.2.3", "10.96.0.12", 80),
        ("10.244.2.3", "10.96.0.17", 80),
        ("203.0.113.5", "192.0.2.11", 30576),
    ];

    /// UDP packets (from, to, port).
    const UDP_PACKETS: &[(&str, &str, u16)] = &[
        ("10.244.2.3", "10.96.0.17", 53),
        ("203.0.113.5", "192.0.2.11", 30575),
    ];

    struct Fixture {
        desired: DesiredState,
        local_ips: Vec<IpAddr>,
        config: NodeConfig,
        /// The endpoints the objects place on this node.
        here: BTreeSet<IpAddr>,
    }

    fn fixture(layout: NftablesLayout) -> Fixture {
        let loaded = objects::load(&format!("{OBJECTS}{TWO_PORTS}")).expect("the fixture loads");
        let node = loaded.node.expect("the fixture's Node");
        let local_ips: Vec<IpAddr> = [
            "192.0.2.11",
            "2001:db8::11",
            "198.51.100.11",
            "127.0.0.1",
            "::1",
        ]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
        let facts = NodeFacts {
            node_ips: node.addresses.clone(),
            local_ips: local_ips.clone(),
            default_route_ips: Vec::new(),
        };
        let desired = desired::build(
            &loaded.cluster,
            NodeView::named("node-a"),
            &facts,
            &StateConfig {
                families: IpFamily::ALL.to_vec(),
                nodeport_addresses: "primary".parse().unwrap(),
            },
        );
        let here = desired
            .families
            .iter()
            .flat_map(|f| f.services.values())
            .flat_map(|s| s.cluster_endpoints.iter().chain(&s.local_endpoints))
            .filter(|e| e.local)
            .map(|e| e.ip)
            .collect();
        Fixture {
            desired,
            local_ips,
            config: NodeConfig {
                nftables_layout: layout,
                cluster_cidrs: vec![
                    "10.244.0.0/16".parse().unwrap(),
                    "fd00:244::/48".parse().unwrap(),
                ],
                ..NodeConfig::default()
            },
            here,
        }
    }

    /// Every packet of [`PACKETS`] traced with `trace`, named once with `named` and once with
    /// the fixture's objects: the two explanations.
    fn both(
        fx: &Fixture,
        dataplane: Dataplane,
        named: &DesiredState,
        trace: &dyn Fn(&Packet, &Env) -> crate::trace::Trace,
    ) -> Vec<(Explanation, Explanation)> {
        let env = Env {
            local_addrs: fx.local_ips.clone(),
            ..Env::default()
        };
        let ctx = Context {
            dataplane,
            masquerade_all: false,
            cluster_cidrs: &fx.config.cluster_cidrs,
            nodeport_addresses: "primary".into(),
            local_addrs: &fx.local_ips,
            maglev: false,
            route_localnet: None,
            localhost_nodeports: true,
            flat_layout: dataplane == Dataplane::Nftables
                && fx.config.nftables_layout == NftablesLayout::Flat,
        };
        let udp = UDP_PACKETS.iter().map(|p| (p, Protocol::Udp));
        PACKETS
            .iter()
            .map(|p| (p, Protocol::Tcp))
            .chain(udp)
            .map(|((from, to, port), proto)| {
                let src: IpAddr = from.parse().unwrap();
                let packet = Packet {
                    src,
                    dst: to.parse().unwrap(),
                    proto,
                    dport: *port,
                    origin: if fx.local_ips.contains(&src) {
                        Origin::Local
                    } else {
                        Origin::Remote
                    },
                };
                let t = trace(&packet, &env);
                (
                    explain::explain(named, &ctx, &t),
                    explain::explain(&fx.desired, &ctx, &t),
                )
            })
            .collect()
    }

    /// `--cluster-cidr` is read back from the ClusterIP masquerade rules.
    fn assert_cluster_cidrs(recovered: &Recovered, fx: &Fixture) {
        let want: BTreeSet<IpNet> = fx.config.cluster_cidrs.iter().copied().collect();
        assert_eq!(recovered.cluster_cidrs, want);
        assert!(!recovered.masquerade_all);
    }

    fn assert_named_alike(pairs: &[(Explanation, Explanation)]) {
        for (from_kernel, from_objects) in pairs {
            assert_eq!(
                from_kernel.to_string(),
                from_objects.to_string(),
                "named from the kernel, then from the objects"
            );
            assert_eq!(from_kernel, from_objects);
        }
    }

    #[test]
    fn both_nftables_layouts_name_every_fate_from_the_table_as_the_objects_do() {
        for layout in [NftablesLayout::Flat, NftablesLayout::KubeProxy] {
            let fx = fixture(layout);
            let ruleset = nftables::render(&fx.desired, &fx.config);
            let mut recovered = Recovered::default();
            for table in &ruleset.tables {
                nftables::recover::recover(table, &mut recovered);
            }
            assert_cluster_cidrs(&recovered, &fx);
            let named = recovered.into_desired(&|ip| fx.here.contains(&ip));
            let pairs = both(&fx, Dataplane::Nftables, &named, &|p, env| {
                nftables::tracer::trace(&ruleset, p, env)
            });
            assert_named_alike(&pairs);
        }
    }

    #[test]
    fn iptables_chains_name_every_fate_from_their_comments_as_the_objects_do() {
        let fx = fixture(NftablesLayout::Flat);
        let ruleset = iptables::render(&fx.desired, &fx.config);
        let mut recovered = Recovered::default();
        for family in &ruleset.families {
            iptables::recover::recover(&family.view(), family.family, &mut recovered);
        }
        assert_cluster_cidrs(&recovered, &fx);
        let named = recovered.into_desired(&|ip| fx.here.contains(&ip));
        let pairs = both(&fx, Dataplane::Iptables, &named, &|p, env| {
            let view = ruleset
                .family(IpFamily::of(p.dst))
                .map(|f| f.view())
                .unwrap_or_else(iptables::ruleset::TableView::empty);
            iptables::tracer::trace(&view, p, env)
        });
        assert_named_alike(&pairs);
    }

    #[test]
    fn comments_name_service_ports_and_other_texts_do_not() {
        assert_eq!(
            parse_port_name("default/web:http", Protocol::Tcp),
            Some(ServicePortName::new(
                "default",
                "web",
                "http",
                Protocol::Tcp
            ))
        );
        assert_eq!(
            parse_port_name("kube-system/kube-dns", Protocol::Udp),
            Some(ServicePortName::new(
                "kube-system",
                "kube-dns",
                "",
                Protocol::Udp
            ))
        );
        assert_eq!(
            parse_port_name("ns/a...z:p", Protocol::Tcp).map(|n| n.to_string()),
            Some("ns/a...z:p".to_string())
        );
        for other in [
            "Active ClusterIPs",
            "short-circuit pod traffic",
            "default/web:http cluster IP",
            "/web",
            "default/",
        ] {
            assert_eq!(parse_port_name(other, Protocol::Tcp), None, "{other}");
        }
    }

    /// `rendered` as the kernel's maps hold it, read back with no objects to name it: each
    /// Service port and family gets a service id, each backend set a set id (as the applier
    /// gives them), and, with `name_map`, its name in `np_svc_names`. Also the names the ids
    /// stand for.
    fn as_kernel_holds_it(
        rendered: &ebpf::render::Rendered,
        name_map: bool,
    ) -> (ebpf::render::Rendered, Vec<(String, String)>) {
        use ebpf::maps::Frontend;
        let mut frontends = Vec::new();
        let mut backends = Vec::new();
        let mut ranges = Vec::new();
        let mut set_ids = BTreeMap::new();
        let mut names = Vec::new();
        let mut held = BTreeMap::new();
        for (i, ((name, _), maps)) in rendered.services.iter().enumerate() {
            let svc_id = i as u32 + 1;
            if name_map {
                // As the map holds it: written and read back.
                held.insert(
                    svc_id,
                    ebpf::maps::decode_svc_name(&ebpf::maps::svc_name(name)).unwrap(),
                );
            }
            names.push((
                format!("svc-{svc_id}:"),
                format!("{}/{}:", name.namespace, name.name),
            ));
            for (key, spec) in &maps.frontends {
                let (be_set, count) = match &spec.set {
                    Some(set) => {
                        let next = set_ids.len() as u32 + 1;
                        let id = *set_ids.entry(set.clone()).or_insert(next);
                        let list = &maps.sets[set];
                        for (o, b) in list.iter().enumerate() {
                            backends.push(((id, o as u32 + 1), *b));
                        }
                        (id, list.len() as u16)
                    }
                    None => (0, 0),
                };
                frontends.push((
                    *key,
                    Frontend {
                        svc_id,
                        be_set,
                        count,
                        flags: spec.flags,
                        affinity_timeout: spec.affinity_timeout,
                    },
                ));
                for net in &spec.source_ranges {
                    ranges.push((svc_id, *net));
                }
                for net in &spec.cluster_cidrs {
                    ranges.push((ebpf::maps::CLUSTER_CIDRS_ID, *net));
                }
            }
        }
        backends.sort_by_key(|(k, _)| *k);
        backends.dedup_by_key(|(k, _)| *k);
        ranges.sort();
        ranges.dedup();
        let read = ebpf::render::from_maps(
            &frontends,
            &backends,
            &ranges,
            &held,
            &ebpf::render::Rendered::default(),
        );
        (read, names)
    }

    fn ebpf_render(fx: &Fixture) -> ebpf::render::Rendered {
        let config = ebpf::render::RenderConfig {
            algorithm: ebpf::render::Algorithm::Random,
            local_ips: fx.local_ips.clone(),
            fib_forward: true,
            masquerade_all: false,
            cluster_cidrs: fx.config.cluster_cidrs.clone(),
        };
        ebpf::render::render(&fx.desired, &config)
    }

    #[test]
    fn the_ebpf_maps_name_ports_from_np_svc_names_and_explain_every_fate_as_the_objects_do() {
        let fx = fixture(NftablesLayout::Flat);
        let (read, _) = as_kernel_holds_it(&ebpf_render(&fx), true);
        let mut recovered = Recovered::default();
        ebpf::recover::recover(&read, &fx.local_ips, &mut recovered);
        assert_cluster_cidrs(&recovered, &fx);
        let named = recovered.into_desired(&|_| false);
        let pairs = both(&fx, Dataplane::Ebpf, &named, &|p, env| {
            ebpf::tracer::trace(&read, p, env)
        });
        assert_named_alike(&pairs);
        assert!(
            pairs
                .iter()
                .any(|(k, _)| k.to_string().contains("service     default/web:80/TCP")),
            "{pairs:#?}"
        );
    }

    #[test]
    fn without_np_svc_names_the_ebpf_maps_name_ports_by_service_id_and_explain_every_fate_alike() {
        // Maps a proxy older than np_svc_names wrote.
        let fx = fixture(NftablesLayout::Flat);
        let (read, names) = as_kernel_holds_it(&ebpf_render(&fx), false);
        let mut recovered = Recovered::default();
        ebpf::recover::recover(&read, &fx.local_ips, &mut recovered);
        assert_cluster_cidrs(&recovered, &fx);
        // Which endpoints are local is the maps' own word here (their remote flag).
        let named = recovered.into_desired(&|_| false);
        let pairs = both(&fx, Dataplane::Ebpf, &named, &|p, env| {
            ebpf::tracer::trace(&read, p, env)
        });
        for (from_kernel, from_objects) in &pairs {
            let mut text = from_kernel.to_string();
            for (id, name) in &names {
                text = text.replace(id.as_str(), name);
            }
            assert!(
                !from_kernel.to_string().contains("default/"),
                "the maps hold no names: {from_kernel}"
            );
            assert_eq!(text, from_objects.to_string());
            assert_eq!(from_kernel.outcomes.len(), from_objects.outcomes.len());
            for (k, o) in from_kernel.outcomes.iter().zip(&from_objects.outcomes) {
                assert_eq!((k.verdict, k.reason), (o.verdict, o.reason), "{text}");
            }
        }
    }
}
