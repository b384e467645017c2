//! This node's interface addresses and default-route interfaces, from rtnetlink dumps.
//!
//! `--nodeport-addresses` CIDRs select among the addresses and `default-route` among those
//! of the interfaces holding a default route; the proxy dumps both periodically so that an
//! address added or removed on the node, or a default route moved to another interface, is
//! followed without a restart (reference 004, "in case of something like DHCP").

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use futures::{Stream, TryStreamExt};
use netlink_packet_route::address::{AddressAttribute, AddressMessage};
use netlink_packet_route::route::{RouteAttribute, RouteHeader, RouteMessage, RouteType};
use rtnetlink::RouteMessageBuilder;

use crate::model::IpFamily;

/// An address or route dump failure.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The rtnetlink socket could not be opened.
    #[error("opening an rtnetlink socket")]
    Socket(#[source] std::io::Error),
    /// The address dump failed.
    #[error("dumping interface addresses")]
    Dump(#[source] rtnetlink::Error),
    /// The route dump failed.
    #[error("dumping {family} routes")]
    RouteDump {
        /// `IPv4` or `IPv6`.
        family: &'static str,
        /// Why.
        #[source]
        source: rtnetlink::Error,
    },
}

/// What one dump found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeAddresses {
    /// Every address configured on an interface of this network namespace, sorted.
    pub local_ips: Vec<IpAddr>,
    /// The addresses of the interfaces that hold a default route of the main table, each
    /// family by its own default route (an IPv4 default route on `eth0` selects `eth0`'s
    /// IPv4 addresses only), sorted. Only the lowest-metric default routes count (a backup
    /// route with a higher metric is not used) unless their interfaces have no global
    /// address of the family: then the next default route does (see
    /// [`choose_default_route_ips`]); multipath ones count every next hop.
    pub default_route_ips: Vec<IpAddr>,
}

/// Every address configured on an interface of this network namespace, sorted.
pub async fn local_addresses() -> Result<Vec<IpAddr>, Error> {
    Ok(node_addresses().await?.local_ips)
}

/// Dumps the addresses and the default routes of this network namespace.
pub async fn node_addresses() -> Result<NodeAddresses, Error> {
    let (connection, handle, _) = rtnetlink::new_connection().map_err(Error::Socket)?;
    let task = tokio::spawn(connection);
    let result = dump(&handle).await;
    drop(handle);
    task.abort();
    result
}

async fn dump(handle: &rtnetlink::Handle) -> Result<NodeAddresses, Error> {
    // (interface index, address)
    let mut addrs: Vec<(u32, IpAddr)> = Vec::new();
    let mut stream = handle.address().get().execute();
    while let Some(msg) = stream.try_next().await.map_err(Error::Dump)? {
        addrs.extend(interface_address(&msg));
    }
    drop(stream);

    let v4 = handle
        .route()
        .get(RouteMessageBuilder::<Ipv4Addr>::new().build())
        .execute();
    let v4_routes = default_routes_by_metric(v4, IpFamily::V4).await?;
    let v6 = handle
        .route()
        .get(RouteMessageBuilder::<Ipv6Addr>::new().build())
        .execute();
    let v6_routes = default_routes_by_metric(v6, IpFamily::V6).await?;

    let mut local_ips: Vec<IpAddr> = addrs.iter().map(|(_, ip)| *ip).collect();
    local_ips.sort();
    local_ips.dedup();
    let mut default_route_ips = choose_default_route_ips(IpFamily::V4, &v4_routes, &addrs);
    default_route_ips.extend(choose_default_route_ips(IpFamily::V6, &v6_routes, &addrs));
    default_route_ips.sort();
    default_route_ips.dedup();
    Ok(NodeAddresses {
        local_ips,
        default_route_ips,
    })
}

/// The interface index and the address of an address dump's message: `IFA_LOCAL`, the
/// address itself on point-to-point links, else `IFA_ADDRESS`.
pub(crate) fn interface_address(msg: &AddressMessage) -> Option<(u32, IpAddr)> {
    let local = msg.attributes.iter().find_map(|a| match a {
        AddressAttribute::Local(ip) => Some(*ip),
        _ => None,
    });
    let addr = msg.attributes.iter().find_map(|a| match a {
        AddressAttribute::Address(ip) => Some(*ip),
        _ => None,
    });
    local.or(addr).map(|ip| (msg.header.index, ip))
}

/// The output interfaces of the default routes of one family in a route dump, by metric
/// (lowest, the one the kernel uses, first). Equal-metric routes share an entry
/// (multipath, IPv6 next hops listed as separate routes).
async fn default_routes_by_metric(
    routes: impl Stream<Item = Result<RouteMessage, rtnetlink::Error>>,
    family: IpFamily,
) -> Result<BTreeMap<u32, BTreeSet<u32>>, Error> {
    futures::pin_mut!(routes);
    let mut out: BTreeMap<u32, BTreeSet<u32>> = BTreeMap::new();
    while let Some(route) = routes.try_next().await.map_err(|source| Error::RouteDump {
        family: family.as_str(),
        source,
    })? {
        let oifs = default_route_oifs(&route);
        if !oifs.is_empty() {
            out.entry(route_metric(&route)).or_default().extend(oifs);
        }
    }
    Ok(out)
}

/// The addresses `default-route` stands for in `family`: those of the interfaces of the
/// best (lowest-metric) default routes that have a usable address of the family, global
/// ones only (no loopback, no link-local). When the best default route's interfaces have
/// none (an IPv6 default route over an interface with only its `fe80::` address), the next
/// default route is tried, and so on: kube-apiserver's `ChooseHostInterface`
/// (`chooseHostInterfaceFromRoute` in k8s.io/apimachinery/pkg/util/net) walks the default
/// routes of a family the same way and stops at the first interface with a global
/// address. A node sending through the best route alone still answers only there; a
/// backup default route is used only when the better ones have nothing to offer.
pub fn choose_default_route_ips(
    family: IpFamily,
    routes_by_metric: &BTreeMap<u32, BTreeSet<u32>>,
    addrs: &[(u32, IpAddr)],
) -> Vec<IpAddr> {
    for oifs in routes_by_metric.values() {
        let mut ips: Vec<IpAddr> = addrs
            .iter()
            .filter(|(index, ip)| {
                IpFamily::of(*ip) == family
                    && oifs.contains(index)
                    && crate::nodeaddr::is_default_route_candidate(ip)
            })
            .map(|(_, ip)| *ip)
            .collect();
        if !ips.is_empty() {
            ips.sort();
            ips.dedup();
            return ips;
        }
    }
    Vec::new()
}

/// A route's metric (`RTA_PRIORITY`; absent means 0, as `ip route` shows it).
pub(crate) fn route_metric(route: &RouteMessage) -> u32 {
    route
        .attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Priority(p) => Some(*p),
            _ => None,
        })
        .unwrap_or(0)
}

/// The output interfaces of a route if it is a usable default route of the main table
/// (`default via ... dev X`, `default dev X`, or a multipath default); none otherwise.
pub(crate) fn default_route_oifs(route: &RouteMessage) -> Vec<u32> {
    let table = route
        .attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .unwrap_or(u32::from(route.header.table));
    if route.header.destination_prefix_length != 0
        || table != u32::from(RouteHeader::RT_TABLE_MAIN)
        || route.header.kind != RouteType::Unicast
    {
        return Vec::new();
    }
    let mut out = Vec::new();
    for a in &route.attributes {
        match a {
            RouteAttribute::Oif(index) => out.push(*index),
            RouteAttribute::MultiPath(hops) => out.extend(hops.iter().map(|h| h.interface_index)),
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use netlink_packet_route::route::RouteNextHop;

    use super::*;

    fn route(
        prefix: u8,
        table: u8,
        kind: RouteType,
        attributes: Vec<RouteAttribute>,
    ) -> RouteMessage {
        let mut m = RouteMessage::default();
        m.header.destination_prefix_length = prefix;
        m.header.table = table;
        m.header.kind = kind;
        m.attributes = attributes;
        m
    }

    #[test]
    fn only_unicast_default_routes_of_the_main_table_name_interfaces() {
        let main = RouteHeader::RT_TABLE_MAIN;
        assert_eq!(
            default_route_oifs(&route(
                0,
                main,
                RouteType::Unicast,
                vec![RouteAttribute::Oif(2)]
            )),
            vec![2]
        );
        // Not a default route, another table, an unreachable default: none.
        assert!(
            default_route_oifs(&route(
                24,
                main,
                RouteType::Unicast,
                vec![RouteAttribute::Oif(2)]
            ))
            .is_empty()
        );
        assert!(
            default_route_oifs(&route(
                0,
                100,
                RouteType::Unicast,
                vec![RouteAttribute::Oif(2)]
            ))
            .is_empty()
        );
        assert!(default_route_oifs(&route(0, main, RouteType::Unreachable, vec![])).is_empty());
        // A table id above 255 comes as an attribute.
        assert!(
            default_route_oifs(&route(
                0,
                252,
                RouteType::Unicast,
                vec![RouteAttribute::Table(1000), RouteAttribute::Oif(2)]
            ))
            .is_empty()
        );
        // Multipath: every next hop's interface.
        let hop = |index| {
            let mut h = RouteNextHop::default();
            h.interface_index = index;
            h
        };
        assert_eq!(
            default_route_oifs(&route(
                0,
                main,
                RouteType::Unicast,
                vec![RouteAttribute::MultiPath(vec![hop(3), hop(4)])]
            )),
            vec![3, 4]
        );
    }

    fn with_metric(oif: u32, metric: Option<u32>) -> RouteMessage {
        let mut attributes = vec![RouteAttribute::Oif(oif)];
        attributes.extend(metric.map(RouteAttribute::Priority));
        route(
            0,
            RouteHeader::RT_TABLE_MAIN,
            RouteType::Unicast,
            attributes,
        )
    }

    /// The addresses each test interface `n` has: `192.0.2.n`, `2001:db8::n` and
    /// `fe80::n`.
    fn every_interface_addressed(indexes: &[u32]) -> Vec<(u32, IpAddr)> {
        indexes
            .iter()
            .flat_map(|&i| {
                [
                    format!("192.0.2.{i}"),
                    format!("2001:db8::{i}"),
                    format!("fe80::{i}"),
                ]
                .map(|a| (i, a.parse().unwrap()))
            })
            .collect()
    }

    fn by_metric(routes: Vec<RouteMessage>) -> BTreeMap<u32, BTreeSet<u32>> {
        let stream = futures::stream::iter(routes.into_iter().map(Ok));
        futures::executor::block_on(default_routes_by_metric(stream, IpFamily::V4)).unwrap()
    }

    /// The interfaces whose IPv4 addresses `default-route` selects when every interface
    /// has one.
    fn interfaces(routes: Vec<RouteMessage>) -> Vec<u32> {
        let addrs = every_interface_addressed(&[1, 2, 3, 4, 5]);
        choose_default_route_ips(IpFamily::V4, &by_metric(routes), &addrs)
            .into_iter()
            .map(|ip| {
                addrs
                    .iter()
                    .find(|(_, a)| *a == ip)
                    .map(|(i, _)| *i)
                    .unwrap()
            })
            .collect()
    }

    fn ips(list: &[&str]) -> Vec<IpAddr> {
        list.iter().map(|s| s.parse().unwrap()).collect()
    }

    #[test]
    fn default_route_moves_on_to_the_next_default_route_when_the_best_ones_interface_has_no_address_of_the_family()
     {
        // kube-apiserver's ChooseHostInterface walks the default routes of a family and
        // takes the first interface with a global address of that family.
        let best = with_metric(2, Some(100));
        let backup = with_metric(3, Some(200));
        let worst = with_metric(4, Some(300));
        let routes = by_metric(vec![worst, backup, best]);
        // Interface 2 has only IPv6 addresses; 3 has an IPv4 one; 4 too.
        let mut addrs: Vec<(u32, IpAddr)> = vec![
            (2, "2001:db8::2".parse().unwrap()),
            (2, "fe80::2".parse().unwrap()),
        ];
        addrs.extend(every_interface_addressed(&[3, 4]));
        assert_eq!(
            choose_default_route_ips(IpFamily::V4, &routes, &addrs),
            ips(&["192.0.2.3"])
        );
        // Per family: for IPv6 the best default route's interface has a global address.
        assert_eq!(
            choose_default_route_ips(IpFamily::V6, &routes, &addrs),
            ips(&["2001:db8::2"])
        );
        // A link-local or loopback-range address does not count as one: fe80:: only on
        // interface 2 passes IPv6 on to interface 3; 169.254/16 only on 2 does for IPv4.
        let addrs: Vec<(u32, IpAddr)> = [
            (2, "fe80::2"),
            (2, "169.254.0.2"),
            (2, "127.0.0.2"),
            (3, "198.51.100.3"),
            (3, "2001:db8::3"),
        ]
        .iter()
        .map(|(i, a)| (*i, a.parse().unwrap()))
        .collect();
        assert_eq!(
            choose_default_route_ips(IpFamily::V4, &routes, &addrs),
            ips(&["198.51.100.3"])
        );
        assert_eq!(
            choose_default_route_ips(IpFamily::V6, &routes, &addrs),
            ips(&["2001:db8::3"])
        );
        // No default route's interface has one: nothing.
        assert_eq!(
            choose_default_route_ips(IpFamily::V4, &routes, &[(2, "fe80::2".parse().unwrap())]),
            ips(&[])
        );
        assert_eq!(
            choose_default_route_ips(IpFamily::V4, &BTreeMap::new(), &addrs),
            ips(&[])
        );
    }

    #[test]
    fn only_the_lowest_metric_default_route_names_interfaces() {
        // A backup default route (higher metric) on the private interface is not the
        // default route: the kernel never sends through it while the best one is there.
        let public = with_metric(2, Some(100));
        let backup = with_metric(3, Some(200));
        assert_eq!(interfaces(vec![public.clone(), backup.clone()]), vec![2]);
        assert_eq!(interfaces(vec![backup.clone(), public.clone()]), vec![2]);
        // No metric attribute is metric 0, the best.
        assert_eq!(
            interfaces(vec![backup.clone(), with_metric(4, None)]),
            vec![4]
        );
        // Equal metrics: both interfaces hold the default route.
        assert_eq!(
            interfaces(vec![with_metric(2, Some(100)), with_metric(3, Some(100))]),
            vec![2, 3]
        );
        // Routes that are not default routes do not compete.
        let mut other = with_metric(5, Some(0));
        other.header.destination_prefix_length = 24;
        assert_eq!(interfaces(vec![public, other]), vec![2]);
    }
}
