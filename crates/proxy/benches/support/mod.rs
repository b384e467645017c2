//! The synthetic cluster the proxy benches share: Service `i` is a ClusterIP + NodePort
//! Service with one TCP port and ten ready endpoints spread over four nodes.

#![allow(dead_code)]

use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::discovery::v1 as discovery;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use nodeport_proxy::config::{EndpointChoice, NodeConfig};
use nodeport_proxy::convert;
use nodeport_proxy::desired::StateConfig;
use nodeport_proxy::model::{EndpointSlice, IpFamily, Service, ServiceName};
use nodeport_proxy::nftables::apply::NftCommand;
use nodeport_proxy::nftables::netlink::NetlinkKernel;
use nodeport_proxy::nodeaddr::NodeFacts;
use nodeport_proxy::objects::Cluster;
use nodeport_testbed::Netns;

/// Node names.
const NODES: [&str; 4] = ["node-0", "node-1", "node-2", "node-3"];

/// Endpoints per Service.
pub const ENDPOINTS: usize = 10;

/// An IPv4 address from its 32-bit value.
pub fn ip(a: u32) -> std::net::IpAddr {
    std::net::IpAddr::V4(std::net::Ipv4Addr::from(a))
}

/// A ready endpoint on node `node`, as an EndpointSlice lists it.
pub fn endpoint(ip: std::net::IpAddr, node: usize) -> discovery::Endpoint {
    discovery::Endpoint {
        addresses: vec![ip.to_string()],
        node_name: Some(NODES[node % NODES.len()].to_string()),
        ..Default::default()
    }
}

/// A Service `ns/name` with one TCP port `http` (80, to `target_port` on `endpoints`) and its
/// EndpointSlice, keyed as the trackers key them. Built as Kubernetes objects and converted
/// as the proxy converts every watch event ([`convert`]), so that the benches hold what the
/// proxy holds, with the names it shares and the ones it does not.
pub fn service_objects(
    ns: &str,
    name: &str,
    cluster_ip: std::net::IpAddr,
    node_port: Option<u16>,
    target_port: u16,
    endpoints: Vec<discovery::Endpoint>,
) -> (ServiceName, Service, ServiceName, EndpointSlice) {
    let meta = |name: &str, labels: Option<(&str, &str)>| ObjectMeta {
        name: Some(name.to_string()),
        namespace: Some(ns.to_string()),
        labels: labels.map(|(k, v)| [(k.to_string(), v.to_string())].into()),
        ..Default::default()
    };
    let svc = core::Service {
        metadata: meta(name, None),
        spec: Some(core::ServiceSpec {
            type_: Some(
                if node_port.is_some() {
                    "NodePort"
                } else {
                    "ClusterIP"
                }
                .into(),
            ),
            cluster_ip: Some(cluster_ip.to_string()),
            cluster_ips: Some(vec![cluster_ip.to_string()]),
            ports: Some(vec![core::ServicePort {
                name: Some("http".into()),
                port: 80,
                node_port: node_port.map(i32::from),
                protocol: Some("TCP".into()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    };
    let slice = discovery::EndpointSlice {
        metadata: meta(
            &format!("{name}-abcde"),
            Some((convert::SERVICE_NAME_LABEL, name)),
        ),
        address_type: "IPv4".into(),
        ports: Some(vec![discovery::EndpointPort {
            name: Some("http".into()),
            port: Some(i32::from(target_port)),
            protocol: Some("TCP".into()),
            ..Default::default()
        }]),
        endpoints,
    };
    let (sk, s) = convert::service(&svc).expect("a ClusterIP Service");
    let (ek, e) = convert::endpoint_slice(&slice).expect("a labelled IPv4 slice");
    (sk, s, ek, e)
}

/// Endpoint `e` of Service `i` in 10.0.0.0/8; each `generation` moves every endpoint to
/// another /8 (a changed EndpointSlice).
pub fn endpoint_ip(i: usize, e: usize, generation: u32) -> std::net::IpAddr {
    ip(0x0A00_0000 + (i * 16 + e) as u32 + generation * 0x0100_0000)
}

/// Service `i`: ClusterIP in 172.16.0.0/12, NodePort, ten endpoints in 10.0.0.0/8.
pub fn service(i: usize, generation: u32) -> (ServiceName, Service, ServiceName, EndpointSlice) {
    let endpoints = (0..ENDPOINTS)
        .map(|e| endpoint(endpoint_ip(i, e, generation), e))
        .collect();
    service_objects(
        &format!("ns{}", i / 100),
        &format!("svc{i}"),
        ip(0xAC10_0000 + i as u32),
        Some(30000 + (i % 2768) as u16).filter(|_| i < 2768),
        8080,
        endpoints,
    )
}

/// Services `0..n` and their EndpointSlices, as the trackers hold them after the initial lists.
pub fn cluster(n: usize) -> Cluster {
    let mut c = Cluster::new();
    for i in 0..n {
        let (sk, s, ek, e) = service(i, 0);
        c.update_service(sk, Some(s));
        c.update_slice(ek, Some(e));
    }
    c.take_changes();
    c
}

/// The node: one address, 192.0.2.10.
pub fn facts() -> NodeFacts {
    NodeFacts {
        node_ips: vec![ip(0xC000_020A)],
        local_ips: vec![ip(0xC000_020A)],
        ..Default::default()
    }
}

/// IPv4 only.
pub fn state_config() -> StateConfig {
    StateConfig {
        families: vec![IpFamily::V4],
        ..Default::default()
    }
}

/// Pods in 10.0.0.0/8, endpoints chosen by `choice`.
pub fn node_config(choice: EndpointChoice) -> NodeConfig {
    NodeConfig {
        cluster_cidrs: vec!["10.0.0.0/8".parse().unwrap()],
        endpoint_choice: choice,
        // The figures recorded so far are kube-proxy's layout; the flat one is compared
        // side by side through `flat_config`.
        nftables_layout: nodeport_proxy::config::NftablesLayout::KubeProxy,
        ..Default::default()
    }
}

/// The flat layout's configuration, with the same pod range.
#[allow(dead_code)]
pub fn flat_config() -> NodeConfig {
    NodeConfig {
        nftables_layout: nodeport_proxy::config::NftablesLayout::Flat,
        ..node_config(EndpointChoice::Cascade)
    }
}

/// `nft` run inside `ns`.
pub fn nft_in(ns: &Netns) -> NftCommand {
    NftCommand::in_netns(ns.name())
}

/// The netlink kernel interface of `ns` (its `nft` fallback also inside `ns`).
pub fn netlink_in(ns: &Netns) -> NetlinkKernel {
    NetlinkKernel::in_namespace(
        &std::path::Path::new("/run/netns").join(ns.name()),
        nft_in(ns),
    )
    .unwrap()
}
