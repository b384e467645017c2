//! The routes the dataplane follows to put its tc programs on the interfaces endpoints are
//! reached through, read over rtnetlink in the calling thread's network namespace (one
//! `RTM_GETROUTE` dump per family, or one route look-up: what `ip route show` and
//! `ip route get` ask, without a process each).

use std::net::IpAddr;

use ipnet::IpNet;
use netlink_packet_core::{
    NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteType,
};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

/// A route look-up or dump failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The rtnetlink socket failed.
    #[error("rtnetlink socket")]
    Socket(#[source] std::io::Error),
    /// A reply could not be decoded.
    #[error("decoding an rtnetlink reply")]
    Decode(#[source] netlink_packet_core::DecodeError),
    /// The kernel refused the request.
    #[error("rtnetlink request")]
    Kernel(#[source] std::io::Error),
}

fn socket() -> Result<Socket, Error> {
    let mut s = Socket::new(NETLINK_ROUTE).map_err(Error::Socket)?;
    s.bind_auto().map_err(Error::Socket)?;
    s.connect(&SocketAddr::new(0, 0)).map_err(Error::Socket)?;
    Ok(s)
}

/// Sends `request` and returns the routes of the reply: every message of a dump, or the one
/// answer of a look-up.
fn exchange(request: RouteMessage, dump: bool) -> Result<Vec<RouteMessage>, Error> {
    let s = socket()?;
    let mut hdr = NetlinkHeader::default();
    hdr.flags = NLM_F_REQUEST | if dump { NLM_F_DUMP } else { 0 };
    hdr.sequence_number = 1;
    let mut packet = NetlinkMessage::new(
        hdr,
        NetlinkPayload::from(RouteNetlinkMessage::GetRoute(request)),
    );
    packet.finalize();
    let mut buf = vec![0; packet.buffer_len()];
    packet.serialize(&mut buf);
    s.send(&buf, 0).map_err(Error::Socket)?;
    let mut out = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = s.recv(&mut &mut buf[..], 0).map_err(Error::Socket)?;
        let mut off = 0;
        while off < n {
            let msg = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&buf[off..n])
                .map_err(Error::Decode)?;
            let len = msg.header.length as usize;
            match msg.payload {
                NetlinkPayload::Done(_) => return Ok(out),
                NetlinkPayload::Error(e) => {
                    return match e.code {
                        None => Ok(out),
                        Some(_) => Err(Error::Kernel(e.to_io())),
                    };
                }
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewRoute(route)) => {
                    out.push(route);
                    if !dump {
                        return Ok(out);
                    }
                }
                _ => {}
            }
            if len == 0 {
                break;
            }
            off += len;
        }
    }
}

fn request(family: AddressFamily) -> RouteMessage {
    let mut msg = RouteMessage::default();
    msg.header.address_family = family;
    msg
}

/// The interface index a route sends through: its output interface, or its first next hop's.
fn output_interface(route: &RouteMessage) -> Option<u32> {
    route.attributes.iter().find_map(|a| match a {
        RouteAttribute::Oif(index) => Some(*index),
        RouteAttribute::MultiPath(hops) => hops.first().map(|h| h.interface_index),
        _ => None,
    })
}

fn interface_name(index: u32) -> Option<String> {
    nix::net::if_::if_indextoname(index)
        .ok()
        .and_then(|name| name.into_string().ok())
}

/// A route's destination (the default route as `/0`), if it is an IP route.
fn destination(route: &RouteMessage) -> Option<IpNet> {
    let len = route.header.destination_prefix_length;
    let addr = route.attributes.iter().find_map(|a| match a {
        RouteAttribute::Destination(RouteAddress::Inet(v4)) => Some(IpAddr::V4(*v4)),
        RouteAttribute::Destination(RouteAddress::Inet6(v6)) => Some(IpAddr::V6(*v6)),
        _ => None,
    });
    let addr = match (addr, route.header.address_family) {
        (Some(addr), _) => addr,
        (None, AddressFamily::Inet) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
        (None, AddressFamily::Inet6) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
        _ => return None,
    };
    IpNet::new(addr, len).ok()
}

/// A route's metric (`RTA_PRIORITY`; absent means 0, as `ip route` shows it).
fn metric(route: &RouteMessage) -> u32 {
    route
        .attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Priority(p) => Some(*p),
            _ => None,
        })
        .unwrap_or(0)
}

/// The main table's routes of `routes`: (destination, metric, interface index). Routes
/// without a device (`blackhole`, `unreachable`, `prohibit`) have none: they send nowhere,
/// and shadow shorter prefixes. Routes of other tables (`local`, policy routing's) are left
/// out, as `ip route show` shows the main table.
pub fn main_table(routes: &[RouteMessage]) -> Vec<(IpNet, u32, Option<u32>)> {
    routes
        .iter()
        .filter(|r| {
            let table = r
                .attributes
                .iter()
                .find_map(|a| match a {
                    RouteAttribute::Table(t) => Some(*t),
                    _ => None,
                })
                .unwrap_or(u32::from(r.header.table));
            table == u32::from(RouteHeader::RT_TABLE_MAIN)
        })
        .filter_map(|r| {
            let oif = match r.header.kind {
                RouteType::BlackHole | RouteType::Unreachable | RouteType::Prohibit => None,
                _ => Some(output_interface(r)?),
            };
            Some((destination(r)?, metric(r), oif))
        })
        .collect()
}

/// The main routing tables of both families, for longest-prefix look-ups of many addresses.
#[derive(Debug, Clone, Default)]
pub struct RouteTable {
    /// (IPv4, network, mask, device), addresses as 128-bit numbers (IPv4 mapped), longest
    /// prefix first, then lowest metric, the kernel's choice among equal prefixes.
    rows: Vec<(bool, u128, u128, Option<std::sync::Arc<str>>)>,
}

fn bits(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v4) => u128::from(v4.to_ipv6_mapped()),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

impl RouteTable {
    /// A table of (destination, metric, device) rows; no device: the route sends nowhere.
    pub fn new(routes: impl IntoIterator<Item = (IpNet, u32, Option<String>)>) -> Self {
        let mut rows: Vec<(IpNet, u32, Option<String>)> = routes.into_iter().collect();
        rows.sort_by_key(|(net, metric, _)| (std::cmp::Reverse(net.prefix_len()), *metric));
        RouteTable {
            rows: rows
                .into_iter()
                .map(|(net, _, dev)| {
                    // IPv4 prefixes cover the 96 bits of the mapped form too.
                    let len = match net {
                        IpNet::V4(n) => 96 + u32::from(n.prefix_len()),
                        IpNet::V6(n) => u32::from(n.prefix_len()),
                    };
                    let mask = u128::MAX.checked_shl(128 - len).unwrap_or(0);
                    // The loopback stands for a local address: no device to attach to.
                    let dev = dev
                        .filter(|d| d != "lo")
                        .map(|d| std::sync::Arc::from(d.as_str()));
                    (net.addr().is_ipv4(), bits(net.network()) & mask, mask, dev)
                })
                .collect(),
        }
    }

    /// This network namespace's main tables (one `RTM_GETROUTE` dump per family). A family
    /// whose dump fails is left out (logged).
    pub fn dump() -> Self {
        Self::dump_families(&[AddressFamily::Inet, AddressFamily::Inet6])
    }

    /// The main table of the family of `ip` alone (one dump).
    pub fn dump_for(ip: IpAddr) -> Self {
        Self::dump_families(&[if ip.is_ipv4() {
            AddressFamily::Inet
        } else {
            AddressFamily::Inet6
        }])
    }

    fn dump_families(families: &[AddressFamily]) -> Self {
        let mut rows = Vec::new();
        for family in families {
            match exchange(request(*family), true) {
                Ok(routes) => rows.extend(main_table(&routes).into_iter().filter_map(
                    |(net, metric, index)| match index {
                        Some(index) => Some((net, metric, Some(interface_name(index)?))),
                        None => Some((net, metric, None)),
                    },
                )),
                Err(e) => tracing::warn!(error = %e, ?family, "dumping routes failed"),
            }
        }
        Self::new(rows)
    }

    /// The device of the longest prefix containing `ip`, unless it is the loopback, the
    /// route sends nowhere (`blackhole`), or no route contains it.
    pub fn device(&self, ip: IpAddr) -> Option<&std::sync::Arc<str>> {
        let v4 = ip.is_ipv4();
        let ip = bits(ip);
        self.rows
            .iter()
            .find(|(family, net, mask, _)| *family == v4 && ip & mask == *net)
            .and_then(|(_, _, _, dev)| dev.as_ref())
    }
}

/// The interface the kernel routes `ip` through (`ip route get`), unless it is a local
/// address (a `local` route, through the loopback) or there is no route.
pub fn route_interface(ip: IpAddr) -> Option<String> {
    let mut msg = request(match ip {
        IpAddr::V4(_) => AddressFamily::Inet,
        IpAddr::V6(_) => AddressFamily::Inet6,
    });
    msg.header.destination_prefix_length = if ip.is_ipv4() { 32 } else { 128 };
    msg.attributes
        .push(RouteAttribute::Destination(RouteAddress::from(ip)));
    let route = exchange(msg, false).ok()?.into_iter().next()?;
    if route.header.kind == RouteType::Local {
        return None;
    }
    let name = interface_name(output_interface(&route)?)?;
    (name != "lo").then_some(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(dst: Option<&str>, len: u8, table: u8, oif: Option<u32>) -> RouteMessage {
        let mut r = RouteMessage::default();
        r.header.address_family = AddressFamily::Inet;
        r.header.destination_prefix_length = len;
        r.header.table = table;
        if let Some(dst) = dst {
            r.attributes
                .push(RouteAttribute::Destination(RouteAddress::from(
                    dst.parse::<IpAddr>().unwrap(),
                )));
        }
        if let Some(oif) = oif {
            r.attributes.push(RouteAttribute::Oif(oif));
        }
        r
    }

    #[test]
    fn the_main_tables_routes_are_kept_a_blackhole_without_a_device_the_default_route_as_slash_zero()
     {
        let mut with_metric = route(Some("10.244.3.0"), 24, RouteHeader::RT_TABLE_MAIN, Some(6));
        let mut blackhole = route(Some("10.9.0.0"), 16, RouteHeader::RT_TABLE_MAIN, None);
        blackhole.header.kind = RouteType::BlackHole;
        with_metric.attributes.push(RouteAttribute::Priority(100));
        let routes = [
            route(None, 0, RouteHeader::RT_TABLE_MAIN, Some(2)),
            route(Some("10.244.2.0"), 24, RouteHeader::RT_TABLE_MAIN, Some(5)),
            with_metric,
            // blackhole 10.9.0.0/16: no device.
            blackhole,
            // The local table's routes of the node's own addresses.
            route(Some("192.0.2.10"), 32, 255, Some(1)),
        ];
        assert_eq!(
            main_table(&routes),
            vec![
                ("0.0.0.0/0".parse().unwrap(), 0, Some(2)),
                ("10.244.2.0/24".parse().unwrap(), 0, Some(5)),
                ("10.244.3.0/24".parse().unwrap(), 100, Some(6)),
                ("10.9.0.0/16".parse().unwrap(), 0, None),
            ]
        );
    }

    #[test]
    fn an_address_is_routed_through_the_device_of_its_longest_prefix_the_lowest_metric_first() {
        let table = RouteTable::new(
            [
                ("0.0.0.0/0", 0, "eth0"),
                ("10.244.2.0/24", 0, "flannel.1"),
                ("10.244.2.7/32", 0, "vpod7"),
                ("192.0.2.0/24", 0, "eth0"),
                ("10.9.0.0/16", 200, "backup"),
                ("10.9.0.0/16", 100, "primary"),
                ("127.0.0.0/8", 0, "lo"),
                ("::/0", 0, "eth1"),
                ("fd00:244::/64", 0, "vpods6"),
                ("10.8.0.0/16", 0, ""),
            ]
            .into_iter()
            .map(|(net, metric, dev)| {
                (
                    net.parse().unwrap(),
                    metric,
                    (!dev.is_empty()).then(|| dev.to_string()),
                )
            }),
        );
        let dev = |ip: &str| table.device(ip.parse().unwrap()).map(|d| d.to_string());
        assert_eq!(dev("10.244.2.5").as_deref(), Some("flannel.1"));
        assert_eq!(dev("10.244.2.7").as_deref(), Some("vpod7"));
        assert_eq!(dev("198.51.100.1").as_deref(), Some("eth0"));
        assert_eq!(dev("10.9.1.1").as_deref(), Some("primary"));
        assert_eq!(dev("127.0.0.1"), None);
        assert_eq!(
            dev("10.8.1.1"),
            None,
            "a blackhole shadows the default route"
        );
        assert_eq!(dev("2001:db8::1").as_deref(), Some("eth1"));
        assert_eq!(dev("fd00:244::5").as_deref(), Some("vpods6"));
        // An IPv4 address never matches an IPv6 default route, nor the reverse.
        let v6_only = RouteTable::new([("::/0".parse().unwrap(), 0, Some("eth1".to_string()))]);
        assert_eq!(v6_only.device("192.0.2.1".parse().unwrap()), None);
        let v4_only =
            RouteTable::new([("0.0.0.0/0".parse().unwrap(), 0, Some("eth0".to_string()))]);
        assert_eq!(v4_only.device("2001:db8::1".parse().unwrap()), None);
    }
}
