//! The lab's dual-stack variant (`nodeport lab --ip-family dual`): the same cluster with an
//! IPv6 address beside every IPv4 one, as a dual-stack kind cluster has them.
//!
//! IPv6 addresses are derived from the IPv4 plan, so the two families read alike:
//!
//! | what | IPv4 | IPv6 |
//! | --- | --- | --- |
//! | node network | `192.0.2.0/24` | `fd00:192:0:2::/64` |
//! | node `N` (`.10`, `.11`, …) | `192.0.2.1N` | `fd00:192:0:2::1N` |
//! | client | `192.0.2.100` | `fd00:192:0:2::100` |
//! | pod network of node `i` | `10.244.i.0/24` | `fd00:10:244:i::/64` |
//! | pod `10.244.i.h` | | `fd00:10:244:i::h` |
//! | ClusterIPs | `10.96.0.0/16` | `fd00:10:96::/108` |
//!
//! The API server runs with both ranges (IPv4 primary), the Nodes carry an InternalIP of each
//! family, each proxy gets both pod networks as `--cluster-cidr`, the Service `web` is
//! `RequireDualStack` with an EndpointSlice per family, and the verdict needs every node to
//! answer on the NodePort over both families.

use std::net::{IpAddr, Ipv6Addr};

use anyhow::Context;
use ipnet::Ipv6Net;
use k8s_openapi::api::core::v1::{Node as NodeObject, NodeAddress, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use nodeport_testbed::Netns;

use super::plan::{Node, Plan, Pod};

/// Which families the lab's cluster serves (`nodeport lab --ip-family`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum IpFamily {
    /// IPv4 only, as the reference lab.
    #[default]
    Ipv4,
    /// IPv4 and IPv6 (IPv4 primary).
    Dual,
}

/// The IPv6 node network.
pub const NODE_NETWORK6: Ipv6Net =
    Ipv6Net::new_assert(Ipv6Addr::new(0xfd00, 0x192, 0, 2, 0, 0, 0, 0), 64);
/// The client's IPv6 address.
pub const CLIENT_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x192, 0, 2, 0, 0, 0, 0x100);
/// The IPv6 pod network, split into a `/64` per node.
pub const CLUSTER_CIDR6: &str = "fd00:10:244::/48";
/// `--service-cluster-ip-range` of the dual-stack lab.
pub const SERVICE_RANGES: &str = "10.96.0.0/16,fd00:10:96::/108";

/// Writes the last octet of an IPv4 address as the hex digits that read the same
/// (`.10` → `::10`), so that both families of one host end alike.
fn same_digits(octet: u8) -> u16 {
    u16::from_str_radix(&octet.to_string(), 16).expect("decimal digits are hex digits")
}

/// A node's IPv6 address on the node network.
pub fn node_ip6(node: &Node) -> Ipv6Addr {
    let mut s = NODE_NETWORK6.network().segments();
    s[7] = same_digits(node.ip.octets()[3]);
    Ipv6Addr::from(s)
}

/// A node's IPv6 pod network: `fd00:10:244:<i>::/64` for `10.244.<i>.0/24`.
pub fn pod_cidr6(node: &Node) -> Ipv6Net {
    let i = node.pod_cidr.network().octets()[2];
    Ipv6Net::new_assert(
        Ipv6Addr::new(0xfd00, 0x10, 0x244, same_digits(i), 0, 0, 0, 0),
        64,
    )
}

/// A node's IPv6 address towards its pods (the first of its pod network).
pub fn pod_gateway6(node: &Node) -> Ipv6Addr {
    let mut s = pod_cidr6(node).network().segments();
    s[7] = 1;
    Ipv6Addr::from(s)
}

/// A pod's IPv6 address: `fd00:10:244:<i>::<h>` for `10.244.<i>.<h>`.
pub fn pod_ip6(pod: &Pod) -> Ipv6Addr {
    let [_, _, i, h] = pod.ip.octets();
    Ipv6Addr::new(0xfd00, 0x10, 0x244, same_digits(i), 0, 0, 0, same_digits(h))
}

/// Every address of a node the verdict asks: IPv4, then IPv6 when dual.
pub fn node_ips(node: &Node, family: IpFamily) -> Vec<IpAddr> {
    let mut ips = vec![IpAddr::V4(node.ip)];
    if family == IpFamily::Dual {
        ips.push(IpAddr::V6(node_ip6(node)));
    }
    ips
}

/// Adds the IPv6 side to a built network: addresses on the node network, forwarding, routes
/// between the nodes' IPv6 pod networks, and each pod's address and routes (the same
/// point-to-point layout as IPv4: a `/128` on each end of the veth).
pub fn add_ipv6(
    plan: &Plan,
    nodes: &[Netns],
    client: &Netns,
    pods: &[Netns],
) -> anyhow::Result<()> {
    let prefix = NODE_NETWORK6.prefix_len();
    for (node, ns) in plan.nodes.iter().zip(nodes) {
        ns.add_addr("eth0", &format!("{}/{prefix}", node_ip6(node)))?;
        ns.sysctl("net.ipv6.conf.all.forwarding", "1")
            .with_context(|| format!("enable IPv6 forwarding on {}", node.name))?;
    }
    for (i, ns) in nodes.iter().enumerate() {
        for (j, other) in plan.nodes.iter().enumerate() {
            if i != j {
                ns.run(&[
                    "ip",
                    "-6",
                    "route",
                    "add",
                    &pod_cidr6(other).to_string(),
                    "via",
                    &node_ip6(other).to_string(),
                ])?;
            }
        }
    }
    client.add_addr("eth0", &format!("{CLIENT_IP6}/{prefix}"))?;
    for (pod, ns) in plan.pods.iter().zip(pods) {
        let node = &plan.nodes[pod.node];
        let node_ns = &nodes[pod.node];
        let (ip, gateway) = (pod_ip6(pod).to_string(), pod_gateway6(node).to_string());
        ns.add_addr("eth0", &format!("{ip}/128"))?;
        ns.run(&["ip", "-6", "route", "add", &gateway, "dev", "eth0"])?;
        ns.run(&[
            "ip", "-6", "route", "add", "default", "via", &gateway, "dev", "eth0",
        ])?;
        node_ns.add_addr(&pod.host_veth, &format!("{gateway}/128"))?;
        node_ns.run(&[
            "ip",
            "-6",
            "route",
            "add",
            &format!("{ip}/128"),
            "dev",
            &pod.host_veth,
        ])?;
    }
    Ok(())
}

/// The Nodes with their IPv6 InternalIP and pod network added (the kubelet of a dual-stack
/// node registers both, IPv4 first).
pub fn dual_stack_nodes(plan: &Plan, mut objects: Vec<NodeObject>) -> Vec<NodeObject> {
    for (node, object) in plan.nodes.iter().zip(&mut objects) {
        if let Some(addresses) = object.status.as_mut().and_then(|s| s.addresses.as_mut()) {
            addresses.insert(
                1,
                NodeAddress {
                    type_: "InternalIP".to_owned(),
                    address: node_ip6(node).to_string(),
                },
            );
        }
        if let Some(cidrs) = object.spec.as_mut().and_then(|s| s.pod_cidrs.as_mut()) {
            cidrs.push(pod_cidr6(node).to_string());
        }
    }
    objects
}

/// The Service asking for both families (`kubectl expose ... --ip-family-policy=...` has no
/// flag; the lab writes `ipFamilyPolicy: RequireDualStack` as a dual-stack manifest does).
pub fn dual_stack_service(mut service: Service) -> Service {
    if let Some(spec) = service.spec.as_mut() {
        spec.ip_family_policy = Some("RequireDualStack".to_owned());
    }
    service
}

/// The IPv6 EndpointSlice the endpointslice controller writes beside the IPv4 one (one slice
/// per address type): the same endpoints at the pods' IPv6 addresses.
pub fn ipv6_slice(plan: &Plan, mut ipv4: EndpointSlice, suffix: &str) -> EndpointSlice {
    ipv4.metadata.name = Some(format!("{}-{suffix}", super::plan::APP));
    ipv4.address_type = "IPv6".to_owned();
    for (endpoint, pod) in ipv4.endpoints.iter_mut().zip(&plan.pods) {
        endpoint.addresses = vec![pod_ip6(pod).to_string()];
    }
    ipv4
}

/// The `--cluster-cidr` of each proxy.
pub fn cluster_cidrs(family: IpFamily) -> String {
    let v4 = super::plan::CLUSTER_CIDR.to_string();
    match family {
        IpFamily::Ipv4 => v4,
        IpFamily::Dual => format!("{v4},{CLUSTER_CIDR6}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv6_addresses_end_in_the_digits_of_their_ipv4_twins() {
        let plan = Plan::new("t", 3);
        let worker = &plan.nodes[1];
        assert_eq!(worker.ip.to_string(), "192.0.2.11");
        assert_eq!(node_ip6(worker).to_string(), "fd00:192:0:2::11");
        assert_eq!(pod_cidr6(worker).to_string(), "fd00:10:244:1::/64");
        assert_eq!(pod_gateway6(worker).to_string(), "fd00:10:244:1::1");
        for pod in &plan.pods {
            let [_, _, i, h] = pod.ip.octets();
            assert_eq!(pod_ip6(pod).to_string(), format!("fd00:10:244:{i}::{h}"));
            assert!(pod_cidr6(&plan.nodes[pod.node]).contains(&pod_ip6(pod)));
        }
        assert_eq!(
            node_ips(worker, IpFamily::Dual),
            vec![
                IpAddr::from([192, 0, 2, 11]),
                "fd00:192:0:2::11".parse::<IpAddr>().unwrap()
            ]
        );
        assert_eq!(node_ips(worker, IpFamily::Ipv4).len(), 1);
    }

    #[test]
    fn dual_stack_objects_carry_both_families() {
        let plan = Plan::new("t", 3);
        let nodes = dual_stack_nodes(&plan, super::super::objects::nodes(&plan));
        let addresses = nodes[0].status.as_ref().unwrap().addresses.clone().unwrap();
        let internal: Vec<&str> = addresses
            .iter()
            .filter(|a| a.type_ == "InternalIP")
            .map(|a| a.address.as_str())
            .collect();
        assert_eq!(internal, ["192.0.2.10", "fd00:192:0:2::10"]);
        let slice = super::super::objects::endpoint_slice(&plan, "abcde", None);
        let six = ipv6_slice(&plan, slice, "fghjk");
        assert_eq!(six.address_type, "IPv6");
        assert_eq!(six.metadata.name.as_deref(), Some("web-fghjk"));
        assert!(
            six.endpoints
                .iter()
                .all(|e| e.addresses[0].starts_with("fd00:10:244:"))
        );
        let svc = dual_stack_service(super::super::objects::service());
        assert_eq!(
            svc.spec.unwrap().ip_family_policy.as_deref(),
            Some("RequireDualStack")
        );
        assert_eq!(
            cluster_cidrs(IpFamily::Dual),
            "10.244.0.0/16,fd00:10:244::/48"
        );
    }
}
