//! `--nodeport-addresses`: which of this node's IPs accept NodePort traffic.
//!
//! Reference 004 specifies the flag; kube-proxy's nftables mode defaults it to `primary`
//! (the node's own IPs from its Node object). A value is a comma-separated list of entries;
//! each entry selects addresses, and the union is what `nodeport-ips` holds (nftables) or
//! what the per-address `KUBE-NODEPORTS` jumps match (iptables).
//!
//! Entries:
//! - a CIDR: the node's interface addresses inside it, of the CIDR's family only. A CIDR
//!   that matches no address is allowed (reference 004's DHCP case): it starts matching as
//!   soon as an address inside it appears. `0.0.0.0/0` (`::/0`) matches every address.
//! - `default-route`: the addresses of the interface(s) that hold the default route (the
//!   lowest-metric one), per family, link-local ones left out (reference 004;
//!   kube-apiserver's `--advertise-address` heuristic). When that interface has no such
//!   address of the family, the next default route's interface is taken, as
//!   `ChooseHostInterface` does (see `addrs::choose_default_route_ips`).
//! - `primary`: the Node object's primary IP of each family (kube-proxy's nftables default).
//!   As in kube-proxy's `validateKubeProxyNodePortAddress`, it must be the only entry.
//!
//! Entries are taken as written: one with spaces around it is refused, as kube-proxy's
//! flag parsing (pflag keeps them) and validation (not a CIDR) do.
//!
//! IPv4 loopback addresses are selected only by a CIDR that contains them (`127.0.0.0/8`,
//! `127.0.0.1/32`): localhost NodePorts, which need `route_localnet` and the CVE-2020-8558
//! guard (see `docs/ARCHITECTURE.md`, "NodePort addresses"). IPv6 loopback never is: the
//! kernel has no `route_localnet` for IPv6, so `::1` cannot be DNATed off the node.

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
        "invalid value \"{value}\" for --nodeport-addresses: \"{entry}\" is not a CIDR, \"primary\" or \"default-route\""
    )]
    BadEntry {
        /// The whole value as given.
        value: String,
        /// The entry that failed to parse.
        entry: String,
    },
    /// An entry has spaces around it. kube-proxy takes each comma-separated entry as
    /// written (pflag's CSV reader keeps spaces) and `ParseCIDRSloppy` rejects it.
    #[error(
        "invalid value \"{value}\" for --nodeport-addresses: \"{entry}\" has spaces around it (entries are separated by a comma alone)"
    )]
    Spaces {
        /// The whole value as given.
        value: String,
        /// The entry, spaces included.
        entry: String,
    },
    /// `primary` is not the only entry (kube-proxy's `validateKubeProxyNodePortAddress`
    /// refuses it: "can't use both 'primary' and CIDRs").
    #[error(
        "invalid value \"{value}\" for --nodeport-addresses: \"primary\" must be the only entry (can't use both 'primary' and CIDRs)"
    )]
    PrimaryNotAlone {
        /// The whole value as given.
        value: String,
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
    /// `default-route`: the addresses of the interfaces holding a default route, per family
    /// (reference 004). What it stands for is read from the routing table, not from the
    /// value: see [`NodeFacts::default_route_ips`].
    DefaultRoute,
}

/// The keyword of [`Selector::DefaultRoute`].
pub const DEFAULT_ROUTE: &str = "default-route";
/// The keyword of [`Selector::Primary`].
pub const PRIMARY: &str = "primary";

impl fmt::Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Selector::Primary => f.write_str(PRIMARY),
            Selector::Cidr(net) => write!(f, "{net}"),
            Selector::DefaultRoute => f.write_str(DEFAULT_ROUTE),
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
        let entries: Vec<&str> = entries.into_iter().collect();
        let mut selectors = Vec::new();
        for (i, &entry) in entries.iter().enumerate() {
            if entry.trim().is_empty() {
                return Err(Error::Empty {
                    value: whole.to_string(),
                });
            }
            // kube-proxy: pflag's StringSlice keeps the spaces around an entry, and
            // validateKubeProxyNodePortAddress (pkg/proxy/apis/config/validation) rejects
            // " 10.0.0.0/8" as not a valid CIDR; so do we, rather than guess.
            if entry.trim() != entry {
                return Err(Error::Spaces {
                    value: whole.to_string(),
                    entry: entry.to_string(),
                });
            }
            // validateKubeProxyNodePortAddress: "primary" is valid only as the one entry
            // ("can't use both 'primary' and CIDRs"); default-route is no exception.
            if entry == PRIMARY && (i != 0 || entries.len() != 1) {
                return Err(Error::PrimaryNotAlone {
                    value: whole.to_string(),
                });
            }
            let selector = if entry == PRIMARY {
                Selector::Primary
            } else if entry == DEFAULT_ROUTE {
                Selector::DefaultRoute
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

    /// Whether some entry is `default-route`.
    pub fn uses_default_route(&self) -> bool {
        self.selectors.contains(&Selector::DefaultRoute)
    }

    /// The CIDR entries that match none of the node's addresses (of their family): allowed,
    /// as reference 004 asks (an address inside may appear later, e.g. from DHCP), but worth
    /// a log line since such an entry opens nothing yet.
    pub fn unmatched_cidrs(&self, facts: &NodeFacts) -> Vec<IpNet> {
        self.selectors
            .iter()
            .filter_map(|s| match s {
                Selector::Cidr(net) if net.prefix_len() > 0 => Some(*net),
                _ => None,
            })
            .filter(|net| !facts.local_ips.iter().any(|ip| net.contains(ip)))
            .collect()
    }

    /// Selects the NodePort addresses of `family` from what is known of the node.
    ///
    /// Mirrors kube-proxy's `NewNodePortAddresses`: entries of the other family are ignored;
    /// a family left with no entry at all (e.g. IPv6 with `primary` on an IPv4-only node)
    /// matches every local address, as does a zero CIDR. `default-route` is an entry of both
    /// families: a family without a default route selects nothing through it.
    ///
    /// IPv4 loopback addresses are kept when a CIDR selects them (localhost NodePorts; each
    /// backend decides whether it serves them), IPv6 loopback never is.
    pub fn select(&self, family: IpFamily, facts: &NodeFacts) -> Selection {
        let mut cidrs: Vec<IpNet> = Vec::new();
        let mut default_route = false;
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
                Selector::DefaultRoute => default_route = true,
            }
        }
        if (cidrs.is_empty() && !default_route) || cidrs.iter().any(|c| c.prefix_len() == 0) {
            return Selection::MatchAll;
        }
        let by_default_route = |ip: &IpAddr| {
            // The default route's interface may hold its loopback-range addresses only in
            // odd setups; a localhost NodePort must be asked for with a CIDR. Its link-local
            // addresses (every IPv6 interface has an fe80:: one) are not what the heuristic
            // of reference 004 picks either: kube-apiserver's `ChooseHostInterface` takes
            // global unicast addresses only. A CIDR can still ask for them.
            default_route && is_default_route_candidate(ip) && facts.default_route_ips.contains(ip)
        };
        let ips = facts
            .local_ips
            .iter()
            .copied()
            .filter(|ip| IpFamily::of(*ip) == family)
            // kube-proxy: "--nodeport-addresses includes localhost but localhost NodePorts
            // are not supported on IPv6".
            .filter(|ip| !(ip.is_loopback() && family == IpFamily::V6))
            .filter(|ip| cidrs.iter().any(|c| c.contains(ip)) || by_default_route(ip))
            .collect();
        Selection::Ips(ips)
    }
}

/// Whether `default-route` may select `ip` on a default route's interface: a global
/// address, neither loopback nor link-local (kube-apiserver's `ChooseHostInterface` takes
/// global unicast addresses only).
pub(crate) fn is_default_route_candidate(ip: &IpAddr) -> bool {
    !ip.is_loopback() && !is_link_local(ip)
}

/// `169.254.0.0/16` or `fe80::/10`.
fn is_link_local(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => v6.is_unicast_link_local(),
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
    /// What `default-route` stands for at this moment: the addresses of the interfaces that
    /// hold the best default route (in the main table), each family by its own. The proxy
    /// reads them from the routing table with the other addresses (so a moved default route
    /// is followed without a restart); `nodeport render` takes them from its
    /// `--default-route-interface` flags.
    pub default_route_ips: Vec<IpAddr>,
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
    /// Every local address (`fib daddr type local` / `-m addrtype --dst-type LOCAL`),
    /// loopback only where a backend says so (iptables' `localhostNodePorts`).
    MatchAll,
    /// Exactly these addresses (the `nodeport-ips` set).
    Ips(BTreeSet<IpAddr>),
}

impl Selection {
    /// Whether an IPv4 loopback address is selected: localhost NodePorts are asked for.
    pub fn has_ipv4_loopback(&self) -> bool {
        match self {
            Selection::MatchAll => false,
            Selection::Ips(ips) => ips.iter().any(|ip| ip.is_ipv4() && ip.is_loopback()),
        }
    }
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
            default_route_ips: Vec::new(),
        }
    }

    /// [`facts`] with the default route on the interface holding `ips`.
    fn facts_routed(ips: &[&str]) -> NodeFacts {
        NodeFacts {
            default_route_ips: ips.iter().map(|s| s.parse().unwrap()).collect(),
            ..facts()
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
    fn ipv4_loopback_is_selected_only_by_a_cidr_that_contains_it() {
        let npa: NodePortAddresses = "127.0.0.0/8".parse().unwrap();
        let sel = npa.select(IpFamily::V4, &facts());
        assert_eq!(sel, ips(&["127.0.0.1"]));
        assert!(sel.has_ipv4_loopback());
        let npa: NodePortAddresses = "192.0.2.0/24".parse().unwrap();
        assert!(!npa.select(IpFamily::V4, &facts()).has_ipv4_loopback());
        // 0.0.0.0/0 is kube-proxy's MatchAll: localhost only where a backend adds it.
        let npa: NodePortAddresses = "0.0.0.0/0".parse().unwrap();
        assert!(!npa.select(IpFamily::V4, &facts()).has_ipv4_loopback());
    }

    #[test]
    fn ipv6_loopback_is_never_a_nodeport_address() {
        let mut f = facts();
        f.local_ips.push("::1".parse().unwrap());
        let npa: NodePortAddresses = "::1/128,fd00::/64".parse().unwrap();
        assert_eq!(npa.select(IpFamily::V6, &f), ips(&["fd00::10"]));
    }

    #[test]
    fn mixed_lists_apply_each_entry_to_its_own_family() {
        let npa: NodePortAddresses = "127.0.0.0/8,198.51.100.0/24,fd00::/64".parse().unwrap();
        assert_eq!(
            npa.select(IpFamily::V4, &facts()),
            ips(&["127.0.0.1", "198.51.100.10"])
        );
        assert_eq!(npa.select(IpFamily::V6, &facts()), ips(&["fd00::10"]));
        // No IPv6 entry at all: that family matches every address, as in kube-proxy.
        let npa: NodePortAddresses = "198.51.100.0/24".parse().unwrap();
        assert_eq!(npa.select(IpFamily::V6, &facts()), Selection::MatchAll);
    }

    #[test]
    fn default_route_selects_the_addresses_of_the_default_route_interface_per_family() {
        let npa: NodePortAddresses = "default-route".parse().unwrap();
        assert_eq!(npa.to_string(), "default-route");
        assert!(npa.uses_default_route());
        // No default route known: nothing, in either family (not every address).
        assert_eq!(npa.select(IpFamily::V4, &facts()), ips(&[]));
        assert_eq!(npa.select(IpFamily::V6, &facts()), ips(&[]));
        let f = facts_routed(&["198.51.100.10"]);
        assert_eq!(npa.select(IpFamily::V4, &f), ips(&["198.51.100.10"]));
        assert_eq!(npa.select(IpFamily::V6, &f), ips(&[]));
        // The route moved: the selection follows.
        let f = facts_routed(&["192.0.2.10"]);
        assert_eq!(npa.select(IpFamily::V4, &f), ips(&["192.0.2.10"]));
    }

    #[test]
    fn default_route_leaves_out_the_link_local_addresses_of_the_interface() {
        let mut f = facts();
        f.local_ips
            .extend(["fe80::10", "169.254.0.10"].map(|s| s.parse::<IpAddr>().unwrap()));
        f.default_route_ips = ["198.51.100.10", "169.254.0.10", "fd00::10", "fe80::10"]
            .map(|s| s.parse().unwrap())
            .to_vec();
        let npa: NodePortAddresses = "default-route".parse().unwrap();
        assert_eq!(npa.select(IpFamily::V4, &f), ips(&["198.51.100.10"]));
        assert_eq!(npa.select(IpFamily::V6, &f), ips(&["fd00::10"]));
        // Asked for by a CIDR, they are selected.
        let npa: NodePortAddresses = "fe80::/10".parse().unwrap();
        assert_eq!(npa.select(IpFamily::V6, &f), ips(&["fe80::10"]));
    }

    #[test]
    fn default_route_combines_with_cidrs() {
        let npa: NodePortAddresses = "127.0.0.1/32,default-route".parse().unwrap();
        assert_eq!(
            npa.select(IpFamily::V4, &facts_routed(&["192.0.2.10"])),
            ips(&["127.0.0.1", "192.0.2.10"])
        );
    }

    #[test]
    fn primary_combined_with_other_entries_is_refused_as_validate_kube_proxy_node_port_address_does()
     {
        for v in [
            "primary,10.0.0.0/8",
            "10.0.0.0/8,primary",
            "primary,default-route",
            "primary,primary",
        ] {
            let err = v.parse::<NodePortAddresses>().unwrap_err();
            assert_eq!(
                err.to_string(),
                format!(
                    "invalid value \"{v}\" for --nodeport-addresses: \"primary\" must be the only entry (can't use both 'primary' and CIDRs)"
                )
            );
        }
        // An earlier malformed entry is reported first, as kube's loop does.
        assert!(matches!(
            "bogus,primary".parse::<NodePortAddresses>(),
            Err(Error::BadEntry { .. })
        ));
        let err =
            NodePortAddresses::from_entries(["primary", "192.0.2.0/24"], "primary,192.0.2.0/24")
                .unwrap_err();
        assert!(matches!(err, Error::PrimaryNotAlone { .. }), "{err}");
    }

    #[test]
    fn entries_with_spaces_around_them_are_refused_as_kube_proxys_flag_parsing_does() {
        // pflag's StringSlice keeps " 10.0.0.0/8"; ParseCIDRSloppy then rejects it.
        for (v, entry) in [
            ("10.0.0.0/8, 192.0.2.0/24", " 192.0.2.0/24"),
            (" primary", " primary"),
            ("default-route ", "default-route "),
            ("10.0.0.0/8,\t127.0.0.0/8", "\t127.0.0.0/8"),
        ] {
            let err = v.parse::<NodePortAddresses>().unwrap_err();
            assert_eq!(
                err,
                Error::Spaces {
                    value: v.to_string(),
                    entry: entry.to_string()
                }
            );
            assert!(
                err.to_string().starts_with(&format!(
                    "invalid value \"{v}\" for --nodeport-addresses: \"{entry}\" has spaces"
                )),
                "{err}"
            );
        }
        let err = NodePortAddresses::from_entries([" 10.0.0.0/8"], " 10.0.0.0/8").unwrap_err();
        assert!(matches!(err, Error::Spaces { .. }), "{err}");
    }

    #[test]
    fn every_value_of_reference_004_parses() {
        for v in [
            "0.0.0.0/0",
            "127.0.0.0/8",
            "default-route",
            "127.0.0.1/32,default-route",
            "127.0.0.0/8,192.168.0.0/16",
            "::/0",
            "primary",
        ] {
            let npa: NodePortAddresses = v.parse().unwrap();
            assert_eq!(npa.to_string(), v);
        }
    }

    #[test]
    fn cidrs_matching_no_address_are_reported() {
        let npa: NodePortAddresses = "0.0.0.0/0,203.0.113.0/24,198.51.100.0/24,default-route"
            .parse()
            .unwrap();
        assert_eq!(
            npa.unmatched_cidrs(&facts()),
            vec!["203.0.113.0/24".parse::<IpNet>().unwrap()]
        );
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
            "invalid value \"10.0.0.0/8,nonsense\" for --nodeport-addresses: \"nonsense\" is not a CIDR, \"primary\" or \"default-route\""
        );
        for bad in [
            "10.0.0.0/33",
            "10.0.0.0/8,",
            "default_route",
            "300.0.0.0/8",
            " , ",
        ] {
            assert!(bad.parse::<NodePortAddresses>().is_err(), "{bad}");
        }
    }
}
