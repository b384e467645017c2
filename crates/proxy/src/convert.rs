//! Conversion of Kubernetes objects into the compact [`crate::model`], the moment they arrive.
//!
//! The rules mirror kube-proxy's `newBaseServiceInfo`, `ShouldSkipService` and the
//! EndpointSlice cache: what kube-proxy ignores is dropped here, so everything downstream can
//! assume well-formed input.

use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::discovery::v1 as discovery;
use k8s_openapi::api::networking::v1 as networking;

use crate::model::{
    Endpoint, EndpointPort, EndpointSlice, IpFamily, Node, Placement, Protocol, Service,
    ServiceCidr, ServiceName, ServicePort, ServicePortName,
};

/// Label that ties an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// Default `sessionAffinityConfig.clientIP.timeoutSeconds` (3 hours), as the API server
/// defaults it.
pub const DEFAULT_AFFINITY_SECONDS: u32 = 10_800;

/// Namespace and name of an object (`default` namespace when unset).
pub fn object_key(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> ServiceName {
    ServiceName {
        namespace: intern(meta.namespace.as_deref().unwrap_or("default")),
        name: meta.name.as_deref().unwrap_or("").into(),
    }
}

/// Namespaces, and node, zone and port names, repeat across hundreds of thousands of objects
/// and endpoints: one shared allocation per distinct name.
fn intern(s: &str) -> Arc<str> {
    static NAMES: Shared<str> = Shared::new();
    NAMES.get(s, || Arc::from(s))
}

/// An endpoint's node and hints, shared by every endpoint with the same ones (a few per node).
fn placement(p: Placement) -> Arc<Placement> {
    static PLACEMENTS: Shared<Placement> = Shared::new();
    PLACEMENTS.get(&p, || Arc::new(p.clone()))
}

/// A table of shared values. Bounded: a cluster has few distinct names and placements; past
/// the bound, new ones are no longer shared (each costs its own allocation, as without it).
struct Shared<T: ?Sized>(std::sync::OnceLock<std::sync::Mutex<std::collections::HashSet<Arc<T>>>>);

impl<T: ?Sized + Eq + std::hash::Hash> Shared<T> {
    const BOUND: usize = 100_000;

    const fn new() -> Self {
        Shared(std::sync::OnceLock::new())
    }

    fn get(&self, value: &T, make: impl FnOnce() -> Arc<T>) -> Arc<T> {
        let mut values = self
            .0
            .get_or_init(Default::default)
            .lock()
            .expect("interner lock");
        if let Some(v) = values.get(value) {
            return v.clone();
        }
        let v = make();
        if values.len() < Self::BOUND {
            values.insert(v.clone());
        }
        v
    }
}

fn parse_ips<'a>(values: impl IntoIterator<Item = &'a String>) -> Vec<IpAddr> {
    values
        .into_iter()
        .filter_map(|s| s.trim().parse().ok())
        .collect()
}

/// Parses a CIDR, or a bare IP as a host route. The API server rejects a bare IP in
/// `loadBalancerSourceRanges`; kube-proxy skips one (and with no range left, admits every
/// source). Taken as a host route it fails closed instead.
pub fn parse_cidr(s: &str) -> Option<IpNet> {
    let s = s.trim();
    s.parse::<IpNet>()
        .ok()
        .map(|n| n.trunc())
        .or_else(|| s.parse::<IpAddr>().ok().map(IpNet::from))
}

/// Converts a Service. `None` when kube-proxy would skip it entirely: `type: ExternalName`,
/// or no ClusterIP (unset, empty or `None`, i.e. headless).
pub fn service(svc: &core::Service) -> Option<(ServiceName, Service)> {
    let key = object_key(&svc.metadata);
    let spec = svc.spec.as_ref()?;
    if spec.type_.as_deref() == Some("ExternalName") {
        return None;
    }
    let primary = spec.cluster_ip.as_deref().unwrap_or("");
    if primary.is_empty() || primary == "None" {
        return None;
    }
    let mut cluster_ips = match &spec.cluster_ips {
        Some(ips) if !ips.is_empty() => parse_ips(ips),
        _ => parse_ips([&primary.to_string()]),
    };
    // At most one ClusterIP per family, the first one.
    let mut seen = Vec::new();
    cluster_ips.retain(|ip| {
        let family = IpFamily::of(*ip);
        let first = !seen.contains(&family);
        seen.push(family);
        first
    });
    let cluster_ips: Box<[IpAddr]> = cluster_ips.into();
    let external_ips: Box<[IpAddr]> = spec
        .external_ips
        .as_ref()
        .map(parse_ips)
        .unwrap_or_default()
        .into();
    // kube-proxy excludes `ipMode: Proxy` ingress points (LoadBalancerIPMode, GA in 1.32):
    // the load balancer itself proxies, so the node must not short-circuit the VIP.
    let load_balancer_ips: Box<[IpAddr]> = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref())
        .map(|ingress| {
            ingress
                .iter()
                .filter(|i| i.ip_mode.as_deref() != Some("Proxy"))
                .filter_map(|i| i.ip.as_deref()?.trim().parse().ok())
                .collect()
        })
        .unwrap_or_default();
    let load_balancer_source_ranges: Box<[IpNet]> = spec
        .load_balancer_source_ranges
        .as_ref()
        .map(|r| r.iter().filter_map(|s| parse_cidr(s)).collect())
        .unwrap_or_default();
    let session_affinity_seconds =
        (spec.session_affinity.as_deref() == Some("ClientIP")).then(|| {
            spec.session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds)
                .and_then(|t| u32::try_from(t).ok())
                .filter(|t| *t > 0)
                .unwrap_or(DEFAULT_AFFINITY_SECONDS)
        });
    let internal_policy_local = spec.internal_traffic_policy.as_deref() == Some("Local");
    let etp_local = spec.external_traffic_policy.as_deref() == Some("Local");
    let health_check_node_port = spec
        .health_check_node_port
        .and_then(|p| u16::try_from(p).ok())
        .filter(|p| *p != 0 && etp_local);

    let mut ports = Vec::new();
    for p in spec.ports.iter().flatten() {
        let Some(protocol) = Protocol::parse(p.protocol.as_deref().unwrap_or("TCP")) else {
            continue;
        };
        let Ok(port) = u16::try_from(p.port) else {
            continue;
        };
        let node_port = p
            .node_port
            .and_then(|n| u16::try_from(n).ok())
            .filter(|n| *n != 0);
        let sp = ServicePort {
            name: ServicePortName {
                namespace: key.namespace.clone(),
                name: key.name.clone(),
                port: intern(p.name.as_deref().unwrap_or("")),
                protocol,
            },
            cluster_ips: cluster_ips.clone(),
            port,
            node_port,
            external_ips: external_ips.clone(),
            load_balancer_ips: load_balancer_ips.clone(),
            load_balancer_source_ranges: load_balancer_source_ranges.clone(),
            external_policy_local: etp_local,
            internal_policy_local,
            session_affinity_seconds,
            health_check_node_port,
        };
        ports.push(Arc::new(sp));
    }
    Some((key, Service { ports }))
}

/// Converts an EndpointSlice. `None` for FQDN slices and slices without a
/// `kubernetes.io/service-name` label, which kube-proxy ignores.
pub fn endpoint_slice(slice: &discovery::EndpointSlice) -> Option<(ServiceName, EndpointSlice)> {
    let key = object_key(&slice.metadata);
    let service_name = slice.metadata.labels.as_ref()?.get(SERVICE_NAME_LABEL)?;
    let family = match slice.address_type.as_str() {
        "IPv4" => IpFamily::V4,
        "IPv6" => IpFamily::V6,
        _ => return None,
    };
    let ports = slice
        .ports
        .iter()
        .flatten()
        .filter_map(|p| {
            Some(EndpointPort {
                name: intern(p.name.as_deref().unwrap_or("")),
                port: u16::try_from(p.port?).ok()?,
                protocol: Protocol::parse(p.protocol.as_deref().unwrap_or("TCP"))?,
            })
        })
        .collect();
    let endpoints = slice
        .endpoints
        .iter()
        .filter_map(|e| {
            let ip: IpAddr = e.addresses.first()?.trim().parse().ok()?;
            if IpFamily::of(ip) != family {
                return None;
            }
            let conditions = e.conditions.as_ref();
            // kube-proxy's endpointslicecache.go: an unset `ready` or `serving` reads as true,
            // an unset `terminating` as false. (The API doc says an unset `serving` defers to
            // `ready`; kube-proxy does not, so a terminating endpoint from a controller that
            // never sets `serving` still takes traffic while no ready endpoint is left.)
            let ready = conditions.and_then(|c| c.ready).unwrap_or(true);
            let serving = conditions.and_then(|c| c.serving).unwrap_or(true);
            let terminating = conditions.and_then(|c| c.terminating).unwrap_or(false);
            let hints = e.hints.as_ref();
            let placement_of_endpoint = Placement {
                node_name: e.node_name.as_deref().map(intern),
                zone_hints: hints
                    .iter()
                    .flat_map(|h| h.for_zones.iter().flatten())
                    .map(|z| intern(&z.name))
                    .collect(),
                node_hints: hints
                    .iter()
                    .flat_map(|h| h.for_nodes.iter().flatten())
                    .map(|n| intern(&n.name))
                    .collect(),
            };
            Some(Endpoint {
                ip,
                ready,
                serving,
                terminating,
                placement: (placement_of_endpoint != Placement::default())
                    .then(|| placement(placement_of_endpoint)),
            })
        })
        .collect();
    Some((
        key.clone(),
        EndpointSlice {
            service: ServiceName {
                namespace: key.namespace.clone(),
                name: service_name.as_str().into(),
            },
            family,
            ports,
            endpoints,
        },
    ))
}

/// Converts a Node: addresses in kube-proxy's preference order (InternalIP, then ExternalIP).
pub fn node(node: &core::Node) -> Node {
    let addresses = node
        .status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .map(|addrs| {
            let pick = |kind: &str| {
                addrs
                    .iter()
                    .filter(move |a| a.type_ == kind)
                    .filter_map(|a| a.address.trim().parse::<IpAddr>().ok())
                    .collect::<Vec<_>>()
            };
            let mut all = pick("InternalIP");
            all.extend(pick("ExternalIP"));
            all
        })
        .unwrap_or_default();
    let to_be_deleted = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == "ToBeDeletedByClusterAutoscaler"));
    Node {
        name: node.metadata.name.clone().unwrap_or_default(),
        addresses,
        zone: node
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("topology.kubernetes.io/zone"))
            .cloned(),
        deleting: node.metadata.deletion_timestamp.is_some(),
        to_be_deleted,
    }
}

/// Converts a ServiceCIDR.
pub fn service_cidr(cidr: &networking::ServiceCIDR) -> (String, ServiceCidr) {
    let cidrs = cidr
        .spec
        .as_ref()
        .and_then(|s| s.cidrs.as_ref())
        .map(|c| c.iter().filter_map(|s| parse_cidr(s)).collect())
        .unwrap_or_default();
    (
        cidr.metadata.name.clone().unwrap_or_default(),
        ServiceCidr { cidrs },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn svc(yaml: &str) -> core::Service {
        yaml_serde::from_str(yaml).unwrap()
    }

    #[test]
    fn headless_and_external_name_services_are_skipped_as_kube_proxy_does() {
        let headless =
            svc("metadata: {name: a, namespace: ns}\nspec: {clusterIP: None, ports: [{port: 80}]}");
        let external = svc(
            "metadata: {name: b, namespace: ns}\nspec: {type: ExternalName, externalName: x.example}",
        );
        assert!(service(&headless).is_none());
        assert!(service(&external).is_none());
    }

    #[test]
    fn service_ports_carry_policies_and_affinity_defaults() {
        let s = svc(r#"
metadata: {name: web, namespace: default}
spec:
  type: NodePort
  clusterIP: 10.96.0.10
  clusterIPs: [10.96.0.10, "fd00::10"]
  externalTrafficPolicy: Local
  healthCheckNodePort: 32000
  sessionAffinity: ClientIP
  ports: [{name: http, port: 80, nodePort: 30080}, {name: dns, port: 53, protocol: UDP}]
status: {loadBalancer: {ingress: [{ip: 203.0.113.9}, {ip: 203.0.113.10, ipMode: Proxy}]}}
"#);
        let (key, s) = service(&s).unwrap();
        assert_eq!(key.to_string(), "default/web");
        let http = &s.ports[0];
        assert_eq!(http.name.to_string(), "default/web:http");
        assert_eq!(
            http.cluster_ip(IpFamily::V6),
            Some("fd00::10".parse().unwrap())
        );
        assert_eq!(http.node_port, Some(30080));
        assert!(http.external_policy_local);
        assert_eq!(
            http.session_affinity_seconds,
            Some(DEFAULT_AFFINITY_SECONDS)
        );
        assert_eq!(
            http.load_balancer_ips,
            ["203.0.113.9".parse::<IpAddr>().unwrap()].into()
        );
        assert_eq!(s.ports[1].name.protocol, Protocol::Udp);
        // Externally reachable through the load balancer IP, so eTP=Local applies here too.
        assert!(s.ports[1].external_policy_local);
    }

    #[test]
    fn endpoint_conditions_default_as_kube_proxy_reads_them() {
        let slice: discovery::EndpointSlice = yaml_serde::from_str(
            r#"
metadata: {name: web-abc, namespace: default, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{port: 8080}]
endpoints:
- addresses: [10.0.0.1]
- addresses: [10.0.0.2]
  conditions: {ready: false, terminating: true}
  nodeName: n1
"#,
        )
        .unwrap();
        let (_, s) = endpoint_slice(&slice).unwrap();
        assert_eq!(s.service.to_string(), "default/web");
        assert_eq!(s.ports[0].protocol, Protocol::Tcp);
        assert!(s.endpoints[0].ready && s.endpoints[0].serving && !s.endpoints[0].terminating);
        // Unset `serving` is serving, even with `ready: false` (kube-proxy, not the API doc).
        assert!(!s.endpoints[1].ready && s.endpoints[1].serving && s.endpoints[1].terminating);
    }

    #[test]
    fn endpoints_of_one_node_with_the_same_hints_share_one_placement() {
        let slice: discovery::EndpointSlice = yaml_serde::from_str(
            r#"
metadata: {name: web-abc, namespace: default, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{port: 8080}]
endpoints:
- {addresses: [10.0.0.1], nodeName: n1}
- {addresses: [10.0.0.2], nodeName: n1}
- {addresses: [10.0.0.3], nodeName: n1, hints: {forZones: [{name: z1}]}}
- {addresses: [10.0.0.4], nodeName: n2, hints: {forZones: [{name: z1}], forNodes: [{name: n2}]}}
- {addresses: [10.0.0.5]}
"#,
        )
        .unwrap();
        let (_, s) = endpoint_slice(&slice).unwrap();
        let e = &s.endpoints;
        let same = |a: &Endpoint, b: &Endpoint| match (&a.placement, &b.placement) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        assert!(same(&e[0], &e[1]));
        assert!(!same(&e[0], &e[2]), "other hints");
        assert_eq!(e[2].node_name(), Some("n1"));
        assert_eq!(&*e[2].zone_hints()[0], "z1");
        assert!(e[2].node_hints().is_empty());
        assert_eq!(e[3].node_name(), Some("n2"));
        assert_eq!(&*e[3].node_hints()[0], "n2");
        assert_eq!(e[4].placement, None, "no node, no hints");
        assert_eq!(e[4].node_name(), None);
        // Converted again (another watch event), the same placement is found.
        let (_, again) = endpoint_slice(&slice).unwrap();
        assert!(same(&e[0], &again.endpoints[0]));
        // What the proxy keeps per endpoint (a million at 100,000 Services): an address, three
        // conditions and one pointer.
        assert!(std::mem::size_of::<Endpoint>() <= 32);
    }
}
