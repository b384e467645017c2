//! `--nodeport-addresses`: which of this node's IPs accept NodePort traffic.
//!
//! Reference 004 specifies the flag; kube-proxy's nftables mode defaults it to `primary`
//! (the node's own IPs from its Node object). A value is a comma-separated list of entries;
//! each entry selects addresses, and the union is what `nodeport-ips` holds. New kinds of
//! entry (the `default-route` of reference 004, loopback handling) are new [`Selector`]
//! variants plus an arm in [`NodePortAddresses::select`].

use std::collections::BTreeSet;
use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use ipnet::IpNet;

use crate::model::IpFamily;

/// A bad `--nodeport-addresses` value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The value (or one entry of the list) is empty.
    #[error("invalid value \"{value}\" for --nodeport-addresses: must not be empty")]
    Empty {
        /// The whole value as given.
        value: String,
    },
    /// An entry is neither a keyword nor a CIDR.
    #[error(
        "invalid value \"{value}\" for --nodeport-addresses: \"{entry}\" is not a CIDR or \"primary\""
    )]
    BadEntry {
        /// The whole value as given.
        value: String,
        /// The entry that failed to parse.
        entry: String,
    },
}

/// One entry of `--nodeport-addresses`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selector {
    /// `primary`: the node's primary IP of each family (first `InternalIP`, else `ExternalIP`
    /// of the Node object), as kube-proxy expands it to `<ip>/32` and `<ip>/128`.
    Primary,
    /// A CIDR: the node's interface addresses inside it. `0.0.0.0/0` (`::/0`) matches every
    /// address of the node, expressed with `fib daddr type local` instead of a set.
    Cidr(IpNet),
}

impl fmt::Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Selector::Primary => f.write_str("primary"),
            Selector::Cidr(net) => write!(f, "{net}"),
        }
    }
}

/// The parsed `--nodeport-addresses` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePortAddresses {
    /// The entries, in the order given.
    pub selectors: Vec<Selector>,
}

impl Default for NodePortAddresses {
    /// `primary`: kube-proxy's default in nftables mode (`platformApplyDefaults`), so that a
    /// NodePort is not opened on every address a node happens to have.
    fn default() -> Self {
        NodePortAddresses {
            selectors: vec![Selector::Primary],
        }
    }
}

impl fmt::Display for NodePortAddresses {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.selectors.iter().map(ToString::to_string).collect();
        f.write_str(&parts.join(","))
    }
}

impl FromStr for NodePortAddresses {
    type Err = Error;

    fn from_str(value: &str) -> Result<Self, Error> {
        Self::from_entries(value.split(','), value)
    }
}

impl NodePortAddresses {
    /// Parses a list of entries (the `nodePortAddresses` list of a KubeProxyConfiguration);
    /// `whole` is echoed in errors.
    pub fn from_entries<'a>(
        entries: impl IntoIterator<Item = &'a str>,
        whole: &str,
    ) -> Result<Self, Error> {
        let mut selectors = Vec::new();
        for entry in entries {
            let entry = entry.trim();
            if entry.is_empty() {
                return Err(Error::Empty {
                    value: whole.to_string(),
                });
            }
            let selector = if entry == "primary" {
                Selector::Primary
            } else {
                let net: IpNet = entry.parse().map_err(|_| Error::BadEntry {
                    value: whole.to_string(),
                    entry: entry.to_string(),
                })?;
                Selector::Cidr(net.trunc())
            };
            if !selectors.contains(&selector) {
                selectors.push(selector);
            }
        }
        if selectors.is_empty() {
            return Err(Error::Empty {
                value: whole.to_string(),
            });
        }
        Ok(NodePortAddresses { selectors })
    }

    /// Selects the NodePort addresses of `family` from what is known of the node.
    ///
    /// Mirrors kube-proxy's `NewNodePortAddresses`: entries of the other family are ignored;
    /// a family left with no entry at all (e.g. IPv6 with `primary` on an IPv4-only node)
    /// matches every local address, as does a zero CIDR.
    pub fn select(&self, family: IpFamily, facts: &NodeFacts) -> Selection {
        let mut cidrs: Vec<IpNet> = Vec::new();
        for selector in &self.selectors {
            match selector {
                Selector::Primary => {
                    if let Some(ip) = facts.primary_ip(family) {
                        cidrs.push(IpNet::from(ip));
                    }
                }
                Selector::Cidr(net) => {
                    if IpFamily::of_net(net) == family {
                        cidrs.push(*net);
                    }
                }
            }
        }
        if cidrs.is_empty() || cidrs.iter().any(|c| c.prefix_len() == 0) {
            return Selection::MatchAll;
        }
        let ips = facts
            .local_ips
            .iter()
            .copied()
            .filter(|ip| IpFamily::of(*ip) == family)
            // nftables mode never DNATs localhost NodePorts (no route_localnet); kube-proxy
            // logs "--nodeport-addresses includes localhost but localhost NodePorts are not
            // supported" and leaves them out.
            .filter(|ip| !ip.is_loopback())
            .filter(|ip| cidrs.iter().any(|c| c.contains(ip)))
            .collect();
        Selection::Ips(ips)
    }
}

/// What the proxy knows of its node's addresses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeFacts {
    /// The Node object's addresses in preference order (`InternalIP` then `ExternalIP`),
    /// or `--node-ip` values for `nodeport render`.
    pub node_ips: Vec<IpAddr>,
    /// Addresses configured on the node's interfaces (a netlink address dump), or, for
    /// `nodeport render`, the node IPs given.
    pub local_ips: Vec<IpAddr>,
}

impl NodeFacts {
    /// The primary node IP of a family: the first non-loopback node IP of that family.
    pub fn primary_ip(&self, family: IpFamily) -> Option<IpAddr> {
        self.node_ips
            .iter()
            .copied()
            .find(|ip| IpFamily::of(*ip) == family && !ip.is_loopback())
    }

    /// The node IPs of a family, primary first.
    pub fn node_ips(&self, family: IpFamily) -> Vec<IpAddr> {
        self.node_ips
            .iter()
            .copied()
            .filter(|ip| IpFamily::of(*ip) == family)
            .collect()
    }
}

/// The NodePort addresses of one family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    /// Every local address (`fib daddr type local`, except loopback).
    MatchAll,
    /// Exactly these addresses (the `nodeport-ips` set).
    Ips(BTreeSet<IpAddr>),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts() -> NodeFacts {
        NodeFacts {
            node_ips: vec!["192.0.2.10".parse().unwrap()],
            local_ips: ["192.0.2.10", "198.51.100.10", "127.0.0.1", "fd00::10"]
                .iter()
                .map(|s| s.parse().unwrap())
                .collect(),
        }
    }

    fn ips(list: &[&str]) -> Selection {
        Selection::Ips(list.iter().map(|s| s.parse().unwrap()).collect())
    }

    #[test]
    fn primary_is_the_default_and_selects_the_node_objects_ip() {
        let npa = NodePortAddresses::default();
        assert_eq!(npa.to_string(), "primary");
        assert_eq!(npa.select(IpFamily::V4, &facts()), ips(&["192.0.2.10"]));
    }

    #[test]
    fn primary_without_an_ip_of_the_family_matches_all_as_kube_proxy_does() {
        let npa = NodePortAddresses::default();
        assert_eq!(npa.select(IpFamily::V6, &facts()), Selection::MatchAll);
    }

    #[test]
    fn cidr_selects_only_local_addresses_inside_it() {
        let npa: NodePortAddresses = "198.51.100.0/24".parse().unwrap();
        assert_eq!(npa.select(IpFamily::V4, &facts()), ips(&["198.51.100.10"]));
    }

    #[test]
    fn zero_cidr_matches_all() {
        let npa: NodePortAddresses = "0.0.0.0/0,192.0.2.0/24".parse().unwrap();
        assert_eq!(npa.select(IpFamily::V4, &facts()), Selection::MatchAll);
    }

    #[test]
    fn loopback_addresses_are_never_nodeport_addresses_in_nftables_mode() {
        let npa: NodePortAddresses = "127.0.0.0/8".parse().unwrap();
        assert_eq!(npa.select(IpFamily::V4, &facts()), ips(&[]));
    }

    #[test]
    fn a_cidr_matching_no_address_selects_nothing_until_one_appears() {
        let npa: NodePortAddresses = "203.0.113.0/24".parse().unwrap();
        let mut f = facts();
        assert_eq!(npa.select(IpFamily::V4, &f), ips(&[]));
        f.local_ips.push("203.0.113.7".parse().unwrap());
        assert_eq!(npa.select(IpFamily::V4, &f), ips(&["203.0.113.7"]));
    }

    #[test]
    fn empty_and_malformed_values_name_the_flag() {
        let empty = "".parse::<NodePortAddresses>().unwrap_err();
        assert_eq!(
            empty.to_string(),
            "invalid value \"\" for --nodeport-addresses: must not be empty"
        );
        let bad = "10.0.0.0/8,nonsense"
            .parse::<NodePortAddresses>()
            .unwrap_err();
        assert_eq!(
            bad.to_string(),
            "invalid value \"10.0.0.0/8,nonsense\" for --nodeport-addresses: \"nonsense\" is not a CIDR or \"primary\""
        );
        assert!("10.0.0.0/33".parse::<NodePortAddresses>().is_err());
        assert!("10.0.0.0/8,".parse::<NodePortAddresses>().is_err());
    }
}
