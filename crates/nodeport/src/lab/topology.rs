//! Builds the lab's network from the [`Plan`]: every node, the client and every pod is a
//! network namespace; the node network is a bridge in a fabric namespace; pods hang off their
//! node on veth pairs. Nothing is created in the host's own namespace.
//!
//! ```text
//!                 nplab-<id>-lan: br0 (192.0.2.0/24)
//!      ┌──────────────┬──────────────┬──────────────┬──────────────┐
//!  control-plane    worker         worker2        client
//!  eth0 .10         eth0 .11       eth0 .12       eth0 .100
//!  10.244.0.0/24    10.244.1.0/24  10.244.2.0/24
//!                   └ veth ─ pod   ├ veth ─ pod
//!                                  └ veth ─ pod
//! ```
//!
//! Pods use the point-to-point layout of kindnet and the `ptp` CNI plugin: the pod has its
//! address as a `/32` and a default route via its node's pod gateway (`10.244.N.1`, on the
//! node end of every veth of that node); the node has a `/32` route per pod. Each node routes
//! the other nodes' pod networks via their node address, and forwards (`ip_forward=1`), as a
//! node with a simple routed CNI does. The client has no route to pod networks: it is outside
//! the cluster and reaches pods only through NodePorts.

use anyhow::Context;
use nodeport_testbed::{Lan, Netns, veth};

use super::plan::{NODE_NETWORK, Plan};

/// Creates the node network, the nodes and the client, with routes between the nodes' pod
/// networks. Whatever was created is deleted again if a later step fails.
pub fn build_network(plan: &Plan) -> anyhow::Result<(Lan, Vec<Netns>, Netns)> {
    let lan = Lan::with_fabric(Netns::create(&plan.netns("lan"))?)?;
    let prefix = NODE_NETWORK.prefix_len();
    let mut nodes = Vec::new();
    for node in &plan.nodes {
        let ns = Netns::create(&plan.netns(&node.name))?;
        lan.attach(&ns, "eth0", &format!("{}/{prefix}", node.ip))?;
        ns.sh("echo 1 > /proc/sys/net/ipv4/ip_forward")
            .with_context(|| format!("enable forwarding on {}", node.name))?;
        nodes.push(ns);
    }
    for (i, ns) in nodes.iter().enumerate() {
        for (j, other) in plan.nodes.iter().enumerate() {
            if i != j {
                ns.run(&[
                    "ip",
                    "route",
                    "add",
                    &other.pod_cidr.to_string(),
                    "via",
                    &other.ip.to_string(),
                ])?;
            }
        }
    }
    let client = Netns::create(&plan.netns("client"))?;
    lan.attach(
        &client,
        "eth0",
        &format!("{}/{prefix}", super::plan::CLIENT_IP),
    )?;
    Ok((lan, nodes, client))
}

/// Creates each pod's namespace and connects it to its node.
pub fn build_pods(plan: &Plan, nodes: &[Netns]) -> anyhow::Result<Vec<Netns>> {
    let mut pods = Vec::new();
    for pod in &plan.pods {
        let node = &plan.nodes[pod.node];
        let node_ns = &nodes[pod.node];
        let ns = Netns::create(&plan.netns(&pod.name))?;
        veth(node_ns, &pod.host_veth, &ns, "eth0")?;
        let gateway = node.pod_gateway().to_string();
        let ip = pod.ip.to_string();
        ns.add_addr("eth0", &format!("{ip}/32"))?;
        ns.run(&[
            "ip", "route", "add", &gateway, "dev", "eth0", "scope", "link",
        ])?;
        ns.run(&[
            "ip", "route", "add", "default", "via", &gateway, "dev", "eth0",
        ])?;
        node_ns.add_addr(&pod.host_veth, &format!("{gateway}/32"))?;
        node_ns.run(&[
            "ip",
            "route",
            "add",
            &format!("{ip}/32"),
            "dev",
            &pod.host_veth,
            "scope",
            "link",
        ])?;
        pods.push(ns);
    }
    Ok(pods)
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, SocketAddr};
    use std::time::Duration;

    use nodeport_testbed::server::{Server, ServerConfig};
    use nodeport_testbed::{probe, require_privileged};

    use super::*;
    use crate::lab::plan::{CLIENT_IP, WEB_PORT};

    #[test]
    fn every_node_reaches_every_pod_across_the_node_network_and_the_client_reaches_none() {
        if !require_privileged("every_node_reaches_every_pod_across_the_node_network") {
            return;
        }
        let plan = Plan::new(&format!("t{}", std::process::id()), 3);
        let (_lan, nodes, client) = build_network(&plan).unwrap();
        let pods = build_pods(&plan, &nodes).unwrap();
        let _servers: Vec<Server> = plan
            .pods
            .iter()
            .zip(&pods)
            .map(|(pod, ns)| Server::start_in(ns, ServerConfig::http(&pod.name, WEB_PORT)).unwrap())
            .collect();
        let timeout = Duration::from_secs(3);
        for (node, ns) in plan.nodes.iter().zip(&nodes) {
            for pod in &plan.pods {
                let to = SocketAddr::new(IpAddr::V4(pod.ip), WEB_PORT);
                let answer = probe::http_get(ns, None, to, "/", timeout)
                    .unwrap_or_else(|e| panic!("{} -> {}: {e}", node.name, pod.name));
                assert_eq!(answer.pod, pod.name);
                // Unrouted: the pod sees the node's own address (its node network address,
                // or its pod gateway when the pod is local).
                let seen: IpAddr = answer.client.rsplit_once(':').unwrap().0.parse().unwrap();
                assert!(
                    seen == IpAddr::V4(node.ip) || seen == IpAddr::V4(node.pod_gateway()),
                    "{} -> {}: pod saw {seen}",
                    node.name,
                    pod.name
                );
            }
        }
        // The client is outside the cluster: it reaches the nodes, not the pods.
        let to = SocketAddr::new(IpAddr::V4(plan.pods[0].ip), WEB_PORT);
        assert!(probe::tcp_connect(&client, to, Duration::from_millis(300)).is_err());
        let node = SocketAddr::new(IpAddr::V4(plan.nodes[1].ip), 9);
        let refused = probe::tcp_connect(&client, node, Duration::from_secs(2)).unwrap_err();
        assert!(
            matches!(&refused, nodeport_testbed::Error::Io { source, .. }
                if source.kind() == std::io::ErrorKind::ConnectionRefused),
            "the client should reach the node and be refused: {refused}"
        );
        assert_eq!(
            client
                .run(&["ip", "-4", "-o", "addr", "show", "eth0"])
                .unwrap()
                .split_whitespace()
                .nth(3),
            Some(format!("{CLIENT_IP}/24").as_str())
        );
    }
}
