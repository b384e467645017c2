//! Kernel object names hashed exactly as kube-proxy hashes them, shared by every backend.
//!
//! Operators grep for these names and compare nodes with each other, so they must come out
//! byte-identical to kube-proxy's for the same Service, port and endpoint.

use sha2::{Digest, Sha256};

use crate::model::{Protocol, ServicePortName};

/// Longest object name nftables accepts (knftables' `NameLengthMax`).
pub const NFT_NAME_LENGTH_MAX: usize = 256;

/// Longest prefix (`service-`, `endpoint-`, `affinity-`, ...) including its hyphen: kube-proxy's
/// `chainNamePrefixLengthMax`.
pub const NFT_PREFIX_LENGTH_MAX: usize = 16;

/// Budget for the hashed part of an nftables name, so that any prefix still fits in
/// [`NFT_NAME_LENGTH_MAX`]: 240 characters, as kube-proxy's `chainNameBaseLengthMax`.
pub const NFT_BASE_LENGTH_MAX: usize = NFT_NAME_LENGTH_MAX - NFT_PREFIX_LENGTH_MAX;

/// Base32 (RFC 4648 standard alphabet, padded) of the SHA-256 of `input`.
fn base32_sha256(input: &str) -> String {
    let digest = Sha256::digest(input.as_bytes());
    data_encoding::BASE32.encode(&digest)
}

/// kube-proxy's `hashAndTruncate`: the first 8 characters of the hash, a hyphen and the
/// readable input; longer than [`NFT_BASE_LENGTH_MAX`] keeps the first 237 characters and
/// appends `...`.
pub fn nft_hash_and_truncate(readable: &str) -> String {
    let hash = base32_sha256(readable);
    let mut name = format!("{}-{}", &hash[..8], readable);
    if name.len() > NFT_BASE_LENGTH_MAX {
        // The readable part is ASCII (names, protocols, IPs, digits), so byte cuts are safe;
        // fall back to the nearest char boundary should a caller ever pass something else.
        let mut cut = NFT_BASE_LENGTH_MAX - 3;
        while !name.is_char_boundary(cut) {
            cut -= 1;
        }
        name.truncate(cut);
        name.push_str("...");
    }
    name
}

/// Base of a service port's nftables chain names (`service-`, `local-`, `external-`,
/// `firewall-` are prepended): `servicePortChainNameBase`, hashing `ns/name/proto/portname`.
/// An unnamed port keeps the trailing slash, e.g. `GZEOLGI7-default/backends/tcp/`.
pub fn nft_service_port_base(port: &ServicePortName) -> String {
    nft_hash_and_truncate(&format!(
        "{}/{}/{}/{}",
        port.namespace,
        port.name,
        port.protocol.as_lower(),
        port.port
    ))
}

/// Base of an endpoint's nftables chain and affinity-set names:
/// `servicePortEndpointChainNameBase`, hashing `ns/name/proto/portname__ip/port`. IPv6 colons
/// become dots, as `:` is not allowed in nftables names.
pub fn nft_endpoint_base(port: &ServicePortName, ip: std::net::IpAddr, target_port: u16) -> String {
    let ip = ip.to_string().replace(':', ".");
    nft_hash_and_truncate(&format!(
        "{}/{}/{}/{}__{}/{}",
        port.namespace,
        port.name,
        port.protocol.as_lower(),
        port.port,
        ip,
        target_port
    ))
}

/// kube-proxy's iptables `portProtoHash`: the first 16 characters of the hash of the
/// service port name (`ns/name` or `ns/name:port`) followed by the lower-case protocol, with
/// no separator. `KUBE-SVC-`, `KUBE-SVL-`, `KUBE-EXT-`, `KUBE-FW-` are prepended to it.
pub fn iptables_service_port_hash(port: &ServicePortName) -> String {
    let hash = base32_sha256(&format!("{}{}", port, port.protocol.as_lower()));
    hash[..16].to_string()
}

/// kube-proxy's iptables `servicePortEndpointChainName` hash (prepended with `KUBE-SEP-`):
/// service port name, lower-case protocol and `ip:port` (IPv6 in brackets), concatenated.
pub fn iptables_endpoint_hash(
    port: &ServicePortName,
    ip: std::net::IpAddr,
    target_port: u16,
) -> String {
    let endpoint = std::net::SocketAddr::new(ip, target_port);
    let hash = base32_sha256(&format!("{}{}{}", port, port.protocol.as_lower(), endpoint));
    hash[..16].to_string()
}

/// The name an iptables chain takes for a service port, e.g. `KUBE-SVC-LOLE4ISW44XBNF3G`.
pub fn iptables_chain(prefix: &str, port: &ServicePortName) -> String {
    format!("{prefix}{}", iptables_service_port_hash(port))
}

/// Protocols as they appear in hashed names (lower case).
impl Protocol {
    /// `tcp`, `udp` or `sctp`.
    pub fn as_lower(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Sctp => "sctp",
        }
    }
}

/// A Service port's name in at most `max` bytes, for the kernel objects that carry it as
/// text (the flat nftables layout's element comments, 128 bytes; the eBPF mode's
/// `np_svc_names`): `namespace/name:port` (`namespace/name` for an unnamed port), or, when
/// longer (Kubernetes allows 63-byte namespaces, 63-byte names and 15-byte port names: 143
/// bytes), the namespace and the port kept and the middle of the name cut, marked with `...`.
pub fn short_port_name(port: &ServicePortName, max: usize) -> String {
    let full = port.to_string();
    if full.len() <= max {
        return full;
    }
    let suffix = if port.port.is_empty() {
        String::new()
    } else {
        format!(":{}", port.port)
    };
    let budget = max - port.namespace.len() - 1 - suffix.len() - 3;
    // Names are DNS labels (ASCII): byte cuts are char cuts.
    let name = &port.name;
    let head = budget.div_ceil(2);
    let tail = budget - head;
    format!(
        "{}/{}...{}{}",
        port.namespace,
        &name[..head],
        &name[name.len() - tail..],
        suffix
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn port(ns: &str, name: &str, port: &str, protocol: Protocol) -> ServicePortName {
        ServicePortName::new(ns, name, port, protocol)
    }

    // Every expected string below is copied from reference 003 (a kube-proxy 1.30 node).
    #[test]
    fn service_chain_base_matches_kube_proxy_for_unnamed_port() {
        let p = port("default", "backends", "", Protocol::Tcp);
        assert_eq!(nft_service_port_base(&p), "GZEOLGI7-default/backends/tcp/");
    }

    #[test]
    fn service_chain_base_matches_kube_proxy_for_named_ports() {
        let cases = [
            (
                "default",
                "kubernetes",
                "https",
                Protocol::Tcp,
                "2QRHZV4L-default/kubernetes/tcp/https",
            ),
            (
                "kube-system",
                "kube-dns",
                "dns-tcp",
                Protocol::Tcp,
                "NWBZK7IH-kube-system/kube-dns/tcp/dns-tcp",
            ),
            (
                "kube-system",
                "kube-dns",
                "dns",
                Protocol::Udp,
                "FY5PMXPG-kube-system/kube-dns/udp/dns",
            ),
            (
                "kube-system",
                "kube-dns",
                "metrics",
                Protocol::Tcp,
                "AS2KJYAD-kube-system/kube-dns/tcp/metrics",
            ),
        ];
        for (ns, name, p, proto, want) in cases {
            assert_eq!(nft_service_port_base(&port(ns, name, p, proto)), want);
        }
    }

    #[test]
    fn endpoint_chain_base_matches_kube_proxy() {
        let cases = [
            (
                "default",
                "kubernetes",
                "https",
                Protocol::Tcp,
                "192.168.228.3",
                6443,
                "4GDGBDUZ-default/kubernetes/tcp/https__192.168.228.3/6443",
            ),
            (
                "default",
                "backends",
                "",
                Protocol::Tcp,
                "10.244.2.14",
                80,
                "LNODCRIZ-default/backends/tcp/__10.244.2.14/80",
            ),
            (
                "default",
                "backends",
                "",
                Protocol::Tcp,
                "10.244.2.22",
                80,
                "O3LHJ3FD-default/backends/tcp/__10.244.2.22/80",
            ),
            (
                "default",
                "backends",
                "",
                Protocol::Tcp,
                "10.244.2.24",
                80,
                "CVDUOZVH-default/backends/tcp/__10.244.2.24/80",
            ),
            (
                "kube-system",
                "kube-dns",
                "dns",
                Protocol::Udp,
                "10.244.0.2",
                53,
                "2GKX576Q-kube-system/kube-dns/udp/dns__10.244.0.2/53",
            ),
            (
                "kube-system",
                "kube-dns",
                "metrics",
                Protocol::Tcp,
                "10.244.0.4",
                9153,
                "UIZQ3LM6-kube-system/kube-dns/tcp/metrics__10.244.0.4/9153",
            ),
        ];
        for (ns, name, p, proto, ip, target, want) in cases {
            let got = nft_endpoint_base(&port(ns, name, p, proto), ip.parse().unwrap(), target);
            assert_eq!(got, want);
        }
    }

    #[test]
    fn ipv6_endpoint_colons_become_dots() {
        let p = port("ns1", "svc1", "p80", Protocol::Tcp);
        let name = nft_endpoint_base(&p, "fd00::1".parse().unwrap(), 80);
        assert!(name.ends_with("-ns1/svc1/tcp/p80__fd00..1/80"), "{name}");
    }

    #[test]
    fn long_names_are_truncated_to_the_kube_proxy_budget() {
        let long = "x".repeat(250);
        let p = port("ns", &long, "", Protocol::Tcp);
        let name = nft_service_port_base(&p);
        assert_eq!(name.len(), NFT_BASE_LENGTH_MAX);
        assert!(name.ends_with("..."));
        assert!(name.starts_with(&nft_hash_and_truncate(&format!("ns/{long}/tcp/"))[..8]));
    }

    #[test]
    fn iptables_service_chain_matches_reference_000() {
        // Reference 000: `kubectl expose deployment web --port=80 --type=NodePort`.
        let p = port("default", "web", "", Protocol::Tcp);
        assert_eq!(iptables_chain("KUBE-SVC-", &p), "KUBE-SVC-LOLE4ISW44XBNF3G");
    }
}
