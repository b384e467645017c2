//! Node-level configuration every backend renders with.

use ipnet::IpNet;

use crate::model::IpFamily;

/// How a service chain picks one of its endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EndpointChoice {
    /// A cascade of plain rules: rule `i` of `n` is `numgen random mod (n-i) 0 goto
    /// endpoint-i`, the last a plain `goto`. Each endpoint gets 1/n, and loading stays linear
    /// (the default; see the nftables module documentation for the measurements).
    #[default]
    Cascade,
    /// kube-proxy's `numgen random mod n vmap { 0 : goto ..., 1 : goto ... }`: one anonymous
    /// map per service chain, which `nft` loads in superlinear time. Kept to measure against.
    InlineVmap,
}

/// Configuration that shapes the rendered rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeConfig {
    /// `--masquerade-bit`: the mark bit set on packets to masquerade (default 14 → 0x4000).
    pub masquerade_bit: u8,
    /// `--masquerade-all`: masquerade every packet sent to a ClusterIP (default false).
    pub masquerade_all: bool,
    /// `--cluster-cidr`: the pod ranges, one per family at most. Traffic from outside them is
    /// "not local" and masqueraded when sent to a ClusterIP (kube-proxy's ClusterCIDR local
    /// traffic detector, its default `--detect-local-mode`). Empty: no detection.
    pub cluster_cidrs: Vec<IpNet>,
    /// How service chains pick an endpoint.
    pub endpoint_choice: EndpointChoice,
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            // kube-proxy's default masqueradeBit (defaults.go).
            masquerade_bit: 14,
            masquerade_all: false,
            cluster_cidrs: Vec::new(),
            endpoint_choice: EndpointChoice::default(),
        }
    }
}

impl NodeConfig {
    /// The masquerade mark: `1 << masquerade_bit`.
    pub fn masquerade_mark(&self) -> u32 {
        1u32 << self.masquerade_bit.min(31)
    }

    /// The pod range of a family, if local traffic detection is on for it.
    pub fn cluster_cidr(&self, family: IpFamily) -> Option<IpNet> {
        self.cluster_cidrs
            .iter()
            .copied()
            .find(|c| IpFamily::of_net(c) == family)
    }
}
