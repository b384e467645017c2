//! The allocation flags' values as text: `--service-cluster-ip-range` here (the NodePort
//! range is [`PortRange::parse`](nodeport_alloc::PortRange::parse)). In the library rather
//! than in the command, so that `nodeport apiserver` and `nodeport up` share it and the
//! `flags` fuzz target reaches it.

use ipnet::IpNet;

/// A `--service-cluster-ip-range` value kube-apiserver would refuse (its `validateClusterIPFlags`
/// messages).
#[derive(Debug, thiserror::Error)]
pub enum ClusterIpRangeError {
    /// More than two comma-separated entries.
    #[error("--service-cluster-ip-range must not contain more than two entries")]
    TooMany,
    /// An entry that does not parse as a CIDR.
    #[error("--service-cluster-ip-range {0:?} is not a CIDR")]
    NotACidr(String),
    /// A CIDR the allocator cannot use (too large, too small).
    #[error("--service-cluster-ip-range: {0}")]
    Unusable(#[source] nodeport_alloc::ip::Error),
    /// Two CIDRs of one family.
    #[error(
        "--service-cluster-ip-range[0] and --service-cluster-ip-range[1] must be of different IP family"
    )]
    SameFamily,
}

/// `--service-cluster-ip-range`: one CIDR, or two of different families (`v4,v6` or `v6,v4`,
/// the first the primary family), checked as kube-apiserver's `validateClusterIPFlags` checks
/// them. Returns the primary range and the secondary one, if any.
pub fn cluster_ip_ranges(text: &str) -> Result<(IpNet, Option<IpNet>), ClusterIpRangeError> {
    let entries: Vec<&str> = text.split(',').map(str::trim).collect();
    if entries.len() > 2 {
        return Err(ClusterIpRangeError::TooMany);
    }
    let mut nets = Vec::new();
    for entry in &entries {
        let net: IpNet = entry
            .parse()
            .map_err(|_| ClusterIpRangeError::NotACidr((*entry).to_owned()))?;
        nodeport_alloc::ip::Allocator::new(net).map_err(ClusterIpRangeError::Unusable)?;
        nets.push(net);
    }
    if let [first, second] = nets[..]
        && first.addr().is_ipv6() == second.addr().is_ipv6()
    {
        return Err(ClusterIpRangeError::SameFamily);
    }
    Ok((nets[0], nets.get(1).copied()))
}
