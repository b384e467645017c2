//! Names of iptables chains, exactly as kube-proxy names them.
//!
//! Top-level chains have fixed names (kube-proxy's constants in `pkg/proxy/iptables`); per
//! service port chains are a prefix plus the 16-character hash of [`crate::names`]. The
//! longest name, `KUBE-SVC-` + 16, is 25 characters: inside iptables' 28-character budget
//! (`XT_EXTENSION_MAXNAMELEN` 29 with the terminating NUL), which is why kube-proxy hashes.

use std::net::IpAddr;

use crate::model::ServicePortName;
use crate::names::{iptables_endpoint_hash, iptables_service_port_hash};

/// nat and filter: entry point for service traffic (nat: DNAT dispatch; filter: rejects for
/// services without endpoints).
pub const KUBE_SERVICES: &str = "KUBE-SERVICES";
/// filter: drops and rejects for external destinations (external IPs, load-balancer IPs,
/// NodePorts) without usable endpoints.
pub const KUBE_EXTERNAL_SERVICES: &str = "KUBE-EXTERNAL-SERVICES";
/// nat: NodePort dispatch, jumped to last from `KUBE-SERVICES`; filter: accepts health-check
/// node ports.
pub const KUBE_NODEPORTS: &str = "KUBE-NODEPORTS";
/// nat: masquerades marked packets.
pub const KUBE_POSTROUTING: &str = "KUBE-POSTROUTING";
/// nat: sets the masquerade mark.
pub const KUBE_MARK_MASQ: &str = "KUBE-MARK-MASQ";
/// filter: accepts marked and established forwarded traffic, drops conntrack-invalid packets.
pub const KUBE_FORWARD: &str = "KUBE-FORWARD";
/// filter: drops load-balancer traffic not admitted by `loadBalancerSourceRanges`.
pub const KUBE_PROXY_FIREWALL: &str = "KUBE-PROXY-FIREWALL";
/// filter: kubelet's chain, duplicated by kube-proxy; holds the localhost NodePort guard.
pub const KUBE_FIREWALL: &str = "KUBE-FIREWALL";
/// mangle, nat and filter: an empty chain whose disappearance means someone flushed the
/// tables (firewalld reload, `iptables -F -X`); the next sync is then a full one.
pub const KUBE_PROXY_CANARY: &str = "KUBE-PROXY-CANARY";

/// Prefix of the Cluster-policy chain (`KUBE-SVC-<hash>`).
pub const SVC_PREFIX: &str = "KUBE-SVC-";
/// Prefix of the Local-policy chain.
pub const SVL_PREFIX: &str = "KUBE-SVL-";
/// Prefix of the external-traffic chain.
pub const EXT_PREFIX: &str = "KUBE-EXT-";
/// Prefix of the load-balancer source-range chain.
pub const FW_PREFIX: &str = "KUBE-FW-";
/// Prefix of an endpoint's DNAT chain.
pub const SEP_PREFIX: &str = "KUBE-SEP-";

/// The chain names of one service port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceChainNames {
    /// `KUBE-SVC-<H>`: Cluster traffic policy.
    pub cluster: String,
    /// `KUBE-SVL-<H>`: Local traffic policy.
    pub local: String,
    /// `KUBE-EXT-<H>`: external traffic entry.
    pub external: String,
    /// `KUBE-FW-<H>`: loadBalancerSourceRanges.
    pub firewall: String,
}

impl ServiceChainNames {
    /// The names for `port`.
    pub fn new(port: &ServicePortName) -> Self {
        let hash = iptables_service_port_hash(port);
        ServiceChainNames {
            cluster: format!("{SVC_PREFIX}{hash}"),
            local: format!("{SVL_PREFIX}{hash}"),
            external: format!("{EXT_PREFIX}{hash}"),
            firewall: format!("{FW_PREFIX}{hash}"),
        }
    }
}

/// `KUBE-SEP-<H>` of one endpoint of a service port; also the name of its `recent` list
/// (session affinity).
pub fn endpoint_chain(port: &ServicePortName, ip: IpAddr, target_port: u16) -> String {
    format!(
        "{SEP_PREFIX}{}",
        iptables_endpoint_hash(port, ip, target_port)
    )
}

/// kube-proxy's `isServiceChainName`: chains with these prefixes are the proxy's own per
/// service chains, and any of them the desired ruleset lacks is stale.
pub fn is_service_chain(name: &str) -> bool {
    [SVC_PREFIX, SVL_PREFIX, EXT_PREFIX, FW_PREFIX, SEP_PREFIX]
        .iter()
        .any(|p| name.starts_with(p))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Protocol;

    // Names from kube-proxy's own iptables unit tests (`proxier_test.go`,
    // TestOverallIPTablesRules) and reference 000.
    #[test]
    fn service_and_endpoint_chains_match_kube_proxys_unit_tests() {
        let p = ServicePortName::new("ns1", "svc1", "p80", Protocol::Tcp);
        let names = ServiceChainNames::new(&p);
        assert_eq!(names.cluster, "KUBE-SVC-XPGD46QRK7WJZT7O");
        assert_eq!(names.external, "KUBE-EXT-XPGD46QRK7WJZT7O");
        assert_eq!(names.local, "KUBE-SVL-XPGD46QRK7WJZT7O");
        assert_eq!(
            endpoint_chain(&p, "10.180.0.1".parse().unwrap(), 80),
            "KUBE-SEP-SXIVWICOYRO3J4NJ"
        );
        assert_eq!(
            endpoint_chain(&p, "10.180.2.1".parse().unwrap(), 80),
            "KUBE-SEP-ZX7GRIZKSNUQ3LAJ"
        );
        let svc5 = ServicePortName::new("ns5", "svc5", "p80", Protocol::Tcp);
        assert_eq!(
            ServiceChainNames::new(&svc5).firewall,
            "KUBE-FW-NUKIZ6OKUXPJNT4C"
        );
        let web = ServicePortName::new("default", "web", "", Protocol::Tcp);
        assert_eq!(
            ServiceChainNames::new(&web).cluster,
            "KUBE-SVC-LOLE4ISW44XBNF3G"
        );
    }

    #[test]
    fn reference_000s_endpoint_chains_come_out_identical() {
        // `ipt KUBE-SVC-LOLE4ISW44XBNF3G` in reference 000: pods 10.244.1.6, 10.244.2.7 and
        // 10.244.2.8 on port 80.
        let web = ServicePortName::new("default", "web", "", Protocol::Tcp);
        for (ip, want) in [
            ("10.244.1.6", "KUBE-SEP-PJHHG4YJTBHVHUTY"),
            ("10.244.2.7", "KUBE-SEP-4OIMBIYGK4QJUGT7"),
            ("10.244.2.8", "KUBE-SEP-R53NX34J3PCIETEY"),
        ] {
            assert_eq!(endpoint_chain(&web, ip.parse().unwrap(), 80), want, "{ip}");
        }
    }

    #[test]
    fn only_per_service_chains_count_as_service_chains() {
        assert!(is_service_chain("KUBE-SEP-SXIVWICOYRO3J4NJ"));
        assert!(is_service_chain("KUBE-FW-NUKIZ6OKUXPJNT4C"));
        assert!(!is_service_chain(KUBE_SERVICES));
        assert!(!is_service_chain(KUBE_NODEPORTS));
        assert!(!is_service_chain("DOCKER-USER"));
    }
}
