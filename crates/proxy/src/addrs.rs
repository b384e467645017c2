//! This node's interface addresses and default-route interfaces, from rtnetlink dumps.
//!
//! `--nodeport-addresses` CIDRs select among the addresses and `default-route` among those
//! of the interfaces holding a default route; the proxy dumps both periodically so that an
//! address added or removed on the node, or a default route moved to another interface, is
//! followed without a restart (reference 004, "in case of something like DHCP").

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use futures::{Stream, TryStreamExt};
use netlink_packet_route::address::AddressAttribute;
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
    /// route with a higher metric is not used); multipath ones count every next hop.
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
        // IFA_LOCAL is the address itself on point-to-point links; IFA_ADDRESS otherwise.
        let local = msg.attributes.iter().find_map(|a| match a {
            AddressAttribute::Local(ip) => Some(*ip),
            _ => None,
        });
        let addr = msg.attributes.iter().find_map(|a| match a {
            AddressAttribute::Address(ip) => Some(*ip),
            _ => None,
        });
        if let Some(ip) = local.or(addr) {
            addrs.push((msg.header.index, ip));
        }
    }
    drop(stream);

    let v4 = handle
        .route()
        .get(RouteMessageBuilder::<Ipv4Addr>::new().build())
        .execute();
    let mut default_ifs = default_route_interfaces(v4, IpFamily::V4).await?;
    let v6 = handle
        .route()
        .get(RouteMessageBuilder::<Ipv6Addr>::new().build())
        .execute();
    default_ifs.extend(default_route_interfaces(v6, IpFamily::V6).await?);

    let mut local_ips: Vec<IpAddr> = addrs.iter().map(|(_, ip)| *ip).collect();
    local_ips.sort();
    local_ips.dedup();
    let mut default_route_ips: Vec<IpAddr> = addrs
        .iter()
        .filter(|(index, ip)| default_ifs.contains(&(IpFamily::of(*ip), *index)))
        .map(|(_, ip)| *ip)
        .collect();
    default_route_ips.sort();
    default_route_ips.dedup();
    Ok(NodeAddresses {
        local_ips,
        default_route_ips,
    })
}

/// The `(family, interface index)` pairs of the default routes in a route dump that the
/// kernel uses: those with the lowest metric. A node that got a default route on each of
/// its interfaces (DHCP on both NICs, the backup with a higher metric) sends through the
/// best one only, and only that interface "has the default route" (kube-apiserver's
/// `ChooseHostInterface` also takes the first, best, default route of the routing table).
/// Equal-metric routes all count (multipath, IPv6 next hops listed as separate routes).
async fn default_route_interfaces(
    routes: impl Stream<Item = Result<RouteMessage, rtnetlink::Error>>,
    family: IpFamily,
) -> Result<BTreeSet<(IpFamily, u32)>, Error> {
    futures::pin_mut!(routes);
    let mut best: Option<u32> = None;
    let mut out = BTreeSet::new();
    while let Some(route) = routes.try_next().await.map_err(|source| Error::RouteDump {
        family: family.as_str(),
        source,
    })? {
        let oifs = default_route_oifs(&route);
        if oifs.is_empty() {
            continue;
        }
        let metric = route_metric(&route);
        if best.is_some_and(|b| metric > b) {
            continue;
        }
        if best.is_none_or(|b| metric < b) {
            best = Some(metric);
            out.clear();
        }
        out.extend(oifs.into_iter().map(|index| (family, index)));
    }
    Ok(out)
}

/// A route's metric (`RTA_PRIORITY`; absent means 0, as `ip route` shows it).
fn route_metric(route: &RouteMessage) -> u32 {
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
fn default_route_oifs(route: &RouteMessage) -> Vec<u32> {
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

    fn interfaces(routes: Vec<RouteMessage>) -> Vec<u32> {
        let stream = futures::stream::iter(routes.into_iter().map(Ok));
        futures::executor::block_on(default_route_interfaces(stream, IpFamily::V4))
            .unwrap()
            .into_iter()
            .map(|(_, index)| index)
            .collect()
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
