//! Names of IPVS-mode objects, exactly as kube-proxy names them: the ipsets with their
//! comments (`pkg/proxy/ipvs/ipset.go`), the iptables chains, the dummy interface.

use crate::model::IpFamily;

/// The dummy interface every service address is bound to (kube-proxy's `defaultDummyDevice`).
pub const DUMMY_DEVICE: &str = "kube-ipvs0";
/// kube-proxy's default scheduler, round robin.
pub const DEFAULT_SCHEDULER: &str = "rr";

/// nat: entry for service traffic.
pub const KUBE_SERVICES: &str = "KUBE-SERVICES";
/// nat: masquerading; filter-free.
pub const KUBE_POSTROUTING: &str = "KUBE-POSTROUTING";
/// nat: masquerade decision for NodePorts; filter: accepts health-check node ports.
pub const KUBE_NODE_PORT: &str = "KUBE-NODE-PORT";
/// nat: masquerade decision for load-balancer IPs.
pub const KUBE_LOAD_BALANCER: &str = "KUBE-LOAD-BALANCER";
/// nat: sets the masquerade mark.
pub const KUBE_MARK_MASQ: &str = "KUBE-MARK-MASQ";
/// filter: forwarding of marked and established traffic.
pub const KUBE_FORWARD: &str = "KUBE-FORWARD";
/// filter: entry of the source-range firewall.
pub const KUBE_PROXY_FIREWALL: &str = "KUBE-PROXY-FIREWALL";
/// filter: drops load-balancer traffic from sources outside the ranges.
pub const KUBE_SOURCE_RANGES_FIREWALL: &str = "KUBE-SOURCE-RANGES-FIREWALL";

/// One of the ipsets the IPVS mode keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SetId {
    /// `KUBE-LOOP-BACK` (`hash:ip,port,ip`): local endpoints, for hairpin masquerade.
    LoopBack,
    /// `KUBE-CLUSTER-IP` (`hash:ip,port`).
    ClusterIp,
    /// `KUBE-EXTERNAL-IP` (`hash:ip,port`).
    ExternalIp,
    /// `KUBE-EXTERNAL-IP-LOCAL` (`hash:ip,port`).
    ExternalIpLocal,
    /// `KUBE-LOAD-BALANCER` (`hash:ip,port`).
    LoadBalancer,
    /// `KUBE-LOAD-BALANCER-FW` (`hash:ip,port`).
    LoadBalancerFw,
    /// `KUBE-LOAD-BALANCER-LOCAL` (`hash:ip,port`).
    LoadBalancerLocal,
    /// `KUBE-LOAD-BALANCER-SOURCE-IP` (`hash:ip,port,ip`).
    LoadBalancerSourceIp,
    /// `KUBE-LOAD-BALANCER-SOURCE-CIDR` (`hash:ip,port,net`).
    LoadBalancerSourceCidr,
    /// `KUBE-NODE-PORT-TCP` (`bitmap:port`).
    NodePortTcp,
    /// `KUBE-NODE-PORT-LOCAL-TCP` (`bitmap:port`).
    NodePortLocalTcp,
    /// `KUBE-NODE-PORT-UDP` (`bitmap:port`).
    NodePortUdp,
    /// `KUBE-NODE-PORT-LOCAL-UDP` (`bitmap:port`).
    NodePortLocalUdp,
    /// `KUBE-NODE-PORT-SCTP-HASH` (`hash:ip,port`).
    NodePortSctp,
    /// `KUBE-NODE-PORT-LOCAL-SCTP-HASH` (`hash:ip,port`).
    NodePortLocalSctp,
    /// `KUBE-HEALTH-CHECK-NODE-PORT` (`bitmap:port`).
    HealthCheckNodePort,
}

/// The ipset types used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SetType {
    /// `hash:ip,port`.
    HashIpPort,
    /// `hash:ip,port,ip`.
    HashIpPortIp,
    /// `hash:ip,port,net`.
    HashIpPortNet,
    /// `bitmap:port` (`range 0-65535`).
    BitmapPort,
}

impl SetType {
    /// As `ipset` writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            SetType::HashIpPort => "hash:ip,port",
            SetType::HashIpPortIp => "hash:ip,port,ip",
            SetType::HashIpPortNet => "hash:ip,port,net",
            SetType::BitmapPort => "bitmap:port",
        }
    }
}

impl SetId {
    /// Every set, in kube-proxy's `ipsetInfo` order (the order they are created in).
    pub const ALL: [SetId; 16] = [
        SetId::LoopBack,
        SetId::ClusterIp,
        SetId::ExternalIp,
        SetId::ExternalIpLocal,
        SetId::LoadBalancer,
        SetId::LoadBalancerFw,
        SetId::LoadBalancerLocal,
        SetId::LoadBalancerSourceIp,
        SetId::LoadBalancerSourceCidr,
        SetId::NodePortTcp,
        SetId::NodePortLocalTcp,
        SetId::NodePortUdp,
        SetId::NodePortLocalUdp,
        SetId::NodePortSctp,
        SetId::NodePortLocalSctp,
        SetId::HealthCheckNodePort,
    ];

    /// The IPv4 name.
    pub fn base_name(self) -> &'static str {
        match self {
            SetId::LoopBack => "KUBE-LOOP-BACK",
            SetId::ClusterIp => "KUBE-CLUSTER-IP",
            SetId::ExternalIp => "KUBE-EXTERNAL-IP",
            SetId::ExternalIpLocal => "KUBE-EXTERNAL-IP-LOCAL",
            SetId::LoadBalancer => "KUBE-LOAD-BALANCER",
            SetId::LoadBalancerFw => "KUBE-LOAD-BALANCER-FW",
            SetId::LoadBalancerLocal => "KUBE-LOAD-BALANCER-LOCAL",
            SetId::LoadBalancerSourceIp => "KUBE-LOAD-BALANCER-SOURCE-IP",
            SetId::LoadBalancerSourceCidr => "KUBE-LOAD-BALANCER-SOURCE-CIDR",
            SetId::NodePortTcp => "KUBE-NODE-PORT-TCP",
            SetId::NodePortLocalTcp => "KUBE-NODE-PORT-LOCAL-TCP",
            SetId::NodePortUdp => "KUBE-NODE-PORT-UDP",
            SetId::NodePortLocalUdp => "KUBE-NODE-PORT-LOCAL-UDP",
            SetId::NodePortSctp => "KUBE-NODE-PORT-SCTP-HASH",
            SetId::NodePortLocalSctp => "KUBE-NODE-PORT-LOCAL-SCTP-HASH",
            SetId::HealthCheckNodePort => "KUBE-HEALTH-CHECK-NODE-PORT",
        }
    }

    /// The name in `family`: IPv6 sets are `KUBE-6-...`, cut to ipset's 31 characters
    /// (kube-proxy's `NewIPSet`).
    pub fn name(self, family: IpFamily) -> String {
        let base = self.base_name();
        match family {
            IpFamily::V4 => base.to_string(),
            IpFamily::V6 => {
                let mut n = base.replacen("KUBE-", "KUBE-6-", 1);
                n.truncate(31);
                n
            }
        }
    }

    /// The set's type.
    pub fn set_type(self) -> SetType {
        match self {
            SetId::LoopBack | SetId::LoadBalancerSourceIp => SetType::HashIpPortIp,
            SetId::LoadBalancerSourceCidr => SetType::HashIpPortNet,
            SetId::NodePortTcp
            | SetId::NodePortLocalTcp
            | SetId::NodePortUdp
            | SetId::NodePortLocalUdp
            | SetId::HealthCheckNodePort => SetType::BitmapPort,
            _ => SetType::HashIpPort,
        }
    }

    /// kube-proxy's comment for the set, used in the iptables rules that match it.
    pub fn comment(self) -> &'static str {
        match self {
            SetId::LoopBack => {
                "Kubernetes endpoints dst ip:port, source ip for solving hairpin purpose"
            }
            SetId::ClusterIp => "Kubernetes service cluster ip + port for masquerade purpose",
            SetId::ExternalIp => {
                "Kubernetes service external ip + port for masquerade and filter purpose"
            }
            SetId::ExternalIpLocal => {
                "Kubernetes service external ip + port with externalTrafficPolicy=local"
            }
            SetId::LoadBalancer => "Kubernetes service lb portal",
            SetId::LoadBalancerFw => {
                "Kubernetes service load balancer ip + port for load balancer with sourceRange"
            }
            SetId::LoadBalancerLocal => {
                "Kubernetes service load balancer ip + port with externalTrafficPolicy=local"
            }
            SetId::LoadBalancerSourceIp => {
                "Kubernetes service load balancer ip + port + source IP for packet filter purpose"
            }
            SetId::LoadBalancerSourceCidr => {
                "Kubernetes service load balancer ip + port + source cidr for packet filter purpose"
            }
            SetId::NodePortTcp => "Kubernetes nodeport TCP port for masquerade purpose",
            SetId::NodePortLocalTcp => {
                "Kubernetes nodeport TCP port with externalTrafficPolicy=local"
            }
            SetId::NodePortUdp => "Kubernetes nodeport UDP port for masquerade purpose",
            SetId::NodePortLocalUdp => {
                "Kubernetes nodeport UDP port with externalTrafficPolicy=local"
            }
            SetId::NodePortSctp => {
                "Kubernetes nodeport SCTP port for masquerade purpose with type 'hash ip:port'"
            }
            SetId::NodePortLocalSctp => {
                "Kubernetes nodeport SCTP port with externalTrafficPolicy=local with type 'hash ip:port'"
            }
            SetId::HealthCheckNodePort => "Kubernetes health check node port",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv6_sets_get_kube_6_names_within_ipsets_31_characters() {
        assert_eq!(SetId::ClusterIp.name(IpFamily::V6), "KUBE-6-CLUSTER-IP");
        assert_eq!(
            SetId::LoadBalancerSourceCidr.name(IpFamily::V6),
            "KUBE-6-LOAD-BALANCER-SOURCE-CID"
        );
        assert_eq!(SetId::NodePortTcp.name(IpFamily::V4), "KUBE-NODE-PORT-TCP");
    }
}
