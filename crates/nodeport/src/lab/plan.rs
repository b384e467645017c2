//! The lab's addressing plan: which nodes, pods and client exist, their names and addresses.
//!
//! Pure data, decided before anything is created, so that the topology, the Kubernetes
//! objects and the printed instructions all agree. The shape is the reference lab's (a kind
//! cluster): `control-plane`, `worker` and `worker2` on one network, a client outside the
//! cluster on the same network, a `/24` pod network per node out of `10.244.0.0/16`, and a
//! deployment `web` of three pods on the workers (the control plane is tainted, as kubeadm
//! taints it).

use std::hash::{BuildHasher, RandomState};
use std::net::Ipv4Addr;

use ipnet::Ipv4Net;

/// Every namespace of a lab is named `nplab-<id>-<role>`; the prefix finds them all.
pub const NETNS_PREFIX: &str = "nplab-";
/// The node network: TEST-NET-1 (RFC 5737), never routed, so it cannot clash with a real one.
pub const NODE_NETWORK: Ipv4Net = Ipv4Net::new_assert(Ipv4Addr::new(192, 0, 2, 0), 24);
/// The client outside the cluster.
pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 100);
/// The cluster's pod network (kind's and flannel's default), split into a `/24` per node.
pub const CLUSTER_CIDR: Ipv4Net = Ipv4Net::new_assert(Ipv4Addr::new(10, 244, 0, 0), 16);
/// Where the API server listens inside the control-plane namespace (kube-apiserver's port).
pub const API_PORT: u16 = 6443;
/// The deployment's name and its `app` label, as in the reference (`kubectl create deployment web`).
pub const APP: &str = "web";
/// The port the pods serve and the Service exposes (`--port=80`).
pub const WEB_PORT: u16 = 80;

/// The characters Kubernetes uses for generated name suffixes (`k8s.io/apimachinery`'s
/// `util/rand`): no vowels, so no words, and no characters that look alike.
const KUBE_ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";

/// A node's role, which decides its labels and taints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Runs the API server; tainted `NoSchedule`, so no pods.
    ControlPlane,
    /// Runs pods.
    Worker,
}

/// One node: a namespace on the node network with a pod network behind it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    /// The Node object's name, and the `--hostname-override` of its proxy.
    pub name: String,
    /// Its role.
    pub role: Role,
    /// Its address on the node network (the Node's `InternalIP`).
    pub ip: Ipv4Addr,
    /// Its pod network (`spec.podCIDR`).
    pub pod_cidr: Ipv4Net,
}

impl Node {
    /// The node's own address towards its pods: the first of its pod network, put on every pod
    /// veth as a `/32` (the point-to-point layout of kindnet and the `ptp` CNI plugin).
    pub fn pod_gateway(&self) -> Ipv4Addr {
        nth(self.pod_cidr, 1)
    }
}

/// One pod: a namespace connected to its node by a veth pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pod {
    /// The pod's name, as a Deployment names its pods (`web-<template hash>-<suffix>`).
    pub name: String,
    /// Index of its node in [`Plan::nodes`].
    pub node: usize,
    /// Its address, out of its node's pod network.
    pub ip: Ipv4Addr,
    /// The node-side end of its veth (`veth<suffix>`, within the 15-byte interface name limit).
    pub host_veth: String,
}

/// Everything one lab run creates, by name and address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The run's identifier, part of every namespace name and of the lab directory.
    pub id: String,
    /// Control plane first, then the workers.
    pub nodes: Vec<Node>,
    /// The deployment's pods, in address order.
    pub pods: Vec<Pod>,
}

impl Plan {
    /// The reference lab: `control-plane`, `worker`, `worker2`, and `replicas` pods spread
    /// over the workers (the first on `worker2`, as the reference's `kubectl get ep` shows two
    /// of three endpoints there).
    pub fn new(id: &str, replicas: usize) -> Self {
        let names = [
            ("control-plane", Role::ControlPlane),
            ("worker", Role::Worker),
            ("worker2", Role::Worker),
        ];
        let nodes: Vec<Node> = names
            .iter()
            .enumerate()
            .map(|(i, (name, role))| Node {
                name: (*name).to_owned(),
                role: *role,
                ip: nth(NODE_NETWORK, 10 + i as u32),
                pod_cidr: Ipv4Net::new_assert(Ipv4Addr::new(10, 244, i as u8, 0), 24),
            })
            .collect();
        let workers: Vec<usize> = (0..nodes.len())
            .filter(|&i| nodes[i].role == Role::Worker)
            .collect();
        let template_hash = random_name(10);
        let mut next_host = vec![2u32; nodes.len()];
        let mut pods: Vec<Pod> = (0..replicas)
            .map(|i| {
                let node = workers[(i + workers.len() - 1) % workers.len()];
                let ip = nth(nodes[node].pod_cidr, next_host[node]);
                next_host[node] += 1;
                let suffix = random_name(5);
                Pod {
                    name: format!("{APP}-{template_hash}-{suffix}"),
                    node,
                    ip,
                    host_veth: format!("veth{suffix}"),
                }
            })
            .collect();
        pods.sort_by_key(|p| p.ip);
        Self {
            id: id.to_owned(),
            nodes,
            pods,
        }
    }

    /// The name of the namespace for `role` (a node name, a pod name, `client` or `lan`).
    pub fn netns(&self, role: &str) -> String {
        format!("{NETNS_PREFIX}{}-{role}", self.id)
    }

    /// The control-plane node.
    pub fn control_plane(&self) -> &Node {
        &self.nodes[0]
    }

    /// Every namespace of the lab, fabric last (deleting it removes the bridge).
    pub fn namespaces(&self) -> Vec<String> {
        let mut all: Vec<String> = self.pods.iter().map(|p| self.netns(&p.name)).collect();
        all.extend(self.nodes.iter().map(|n| self.netns(&n.name)));
        all.push(self.netns("client"));
        all.push(self.netns("lan"));
        all
    }
}

/// A fresh lab identifier: five characters of Kubernetes' name alphabet.
pub fn new_id() -> String {
    random_name(5)
}

/// `n` random characters of [`KUBE_ALPHABET`]. The randomness is the standard library's
/// per-process random hash keys: names need to be unlikely to collide, not unpredictable.
fn random_name(n: usize) -> String {
    let state = RandomState::new();
    (0..n)
        .map(|i| {
            let h = state.hash_one((i, std::process::id(), std::time::SystemTime::now()));
            KUBE_ALPHABET[(h % KUBE_ALPHABET.len() as u64) as usize] as char
        })
        .collect()
}

/// The `n`th address of `net`.
fn nth(net: Ipv4Net, n: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(net.network()) + n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lab_has_the_reference_nodes_on_the_documentation_network() {
        let plan = Plan::new("abcde", 3);
        let nodes: Vec<(&str, String, String)> = plan
            .nodes
            .iter()
            .map(|n| (n.name.as_str(), n.ip.to_string(), n.pod_cidr.to_string()))
            .collect();
        assert_eq!(
            nodes,
            [
                ("control-plane", "192.0.2.10".into(), "10.244.0.0/24".into()),
                ("worker", "192.0.2.11".into(), "10.244.1.0/24".into()),
                ("worker2", "192.0.2.12".into(), "10.244.2.0/24".into()),
            ]
        );
        assert!(NODE_NETWORK.contains(&CLIENT_IP));
        assert_eq!(plan.control_plane().role, Role::ControlPlane);
    }

    #[test]
    fn three_pods_land_on_the_workers_two_on_worker2_with_distinct_addresses() {
        let plan = Plan::new("abcde", 3);
        let on: Vec<(&str, String)> = plan
            .pods
            .iter()
            .map(|p| (plan.nodes[p.node].name.as_str(), p.ip.to_string()))
            .collect();
        assert_eq!(
            on,
            [
                ("worker", "10.244.1.2".into()),
                ("worker2", "10.244.2.2".into()),
                ("worker2", "10.244.2.3".into()),
            ]
        );
        for pod in &plan.pods {
            assert!(plan.nodes[pod.node].pod_cidr.contains(&pod.ip));
            assert_ne!(pod.ip, plan.nodes[pod.node].pod_gateway());
            assert!(pod.host_veth.len() <= 15, "{}", pod.host_veth);
        }
    }

    #[test]
    fn pod_names_follow_the_deployment_pattern_with_one_template_hash() {
        let plan = Plan::new("abcde", 3);
        let hashes: Vec<&str> = plan
            .pods
            .iter()
            .map(|p| {
                let parts: Vec<&str> = p.name.split('-').collect();
                assert_eq!(parts.len(), 3, "{}", p.name);
                assert_eq!(parts[0], "web");
                assert_eq!(parts[2].len(), 5);
                assert!(
                    p.name
                        .bytes()
                        .all(|b| b == b'-' || b.is_ascii_alphanumeric())
                );
                parts[1]
            })
            .collect();
        assert!(hashes.iter().all(|h| *h == hashes[0] && h.len() == 10));
    }

    #[test]
    fn namespace_names_carry_the_lab_prefix_and_id() {
        let plan = Plan::new("x2k9p", 3);
        let all = plan.namespaces();
        assert_eq!(all.len(), 3 + 3 + 2);
        assert!(all.iter().all(|n| n.starts_with("nplab-x2k9p-")));
        assert_eq!(all.last().unwrap(), "nplab-x2k9p-lan");
        assert_eq!(plan.netns("worker2"), "nplab-x2k9p-worker2");
    }
}
