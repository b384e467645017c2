//! UDP conntrack clean-up over ctnetlink (kube-proxy's `pkg/proxy/conntrack/cleanup.go`).
//!
//! UDP has no connection to close: a client that keeps sending to a Service keeps its
//! conntrack entry, still DNATed to an endpoint that is gone, or never DNATed because the
//! Service had no endpoints when the first packet came. After a sync that changed the
//! endpoints of a Service with a UDP port, the proxy dumps the UDP entries of each family and
//! deletes exactly those whose original destination is a UDP service IP (or NodePort) and
//! whose reply source is not one of that port's serving endpoints. Nothing else is touched
//! (kube-proxy regressions #122740 and #139628 came from deleting too much or too little).

use std::collections::HashMap;
use std::net::IpAddr;

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_netfilter::conntrack::{
    ConntrackAttribute, ConntrackMessage, IPTuple, ProtoTuple, Protocol as CtProto, Tuple,
};
use netlink_packet_netfilter::{NetfilterHeader, NetfilterMessage, NetfilterProtoFamily};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};

use crate::desired::FamilyState;
use crate::model::{IpFamily, Protocol};

/// A conntrack failure.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The netlink socket could not be opened or used.
    #[error("ctnetlink socket")]
    Socket(#[source] std::io::Error),
    /// The kernel answered something unreadable.
    #[error("decoding a ctnetlink message")]
    Decode(#[source] netlink_packet_core::DecodeError),
    /// The kernel refused a request.
    #[error("ctnetlink request failed")]
    Kernel(#[source] std::io::Error),
}

/// One conntrack entry, the fields the clean-up looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Flow {
    /// Original direction: source address.
    pub orig_src: IpAddr,
    /// Original direction: destination address (the service IP).
    pub orig_dst: IpAddr,
    /// Original direction: source port.
    pub orig_sport: u16,
    /// Original direction: destination port.
    pub orig_dport: u16,
    /// Reply direction: source address (the endpoint after DNAT).
    pub reply_src: IpAddr,
}

/// The flows to delete: UDP flows to a service IP or NodePort whose reply source is not a
/// serving endpoint of that port. Pure.
pub fn stale_flows(flows: &[Flow], state: &FamilyState) -> Vec<Flow> {
    let mut by_ip: HashMap<(IpAddr, u16), &[IpAddr]> = HashMap::new();
    let mut by_nodeport: HashMap<u16, &[IpAddr]> = HashMap::new();
    for svc in state
        .services
        .values()
        .filter(|s| s.name().protocol == Protocol::Udp)
    {
        let port = svc.port.port;
        for ip in std::iter::once(svc.cluster_ip)
            .chain(svc.load_balancer_ips.iter().copied())
            .chain(svc.external_ips.iter().copied())
        {
            by_ip.insert((ip, port), &svc.serving_ips);
        }
        if let Some(np) = svc.port.node_port {
            by_nodeport.insert(np, &svc.serving_ips);
        }
    }
    flows
        .iter()
        .filter(|f| {
            let by_vip = by_ip
                .get(&(f.orig_dst, f.orig_dport))
                .is_some_and(|serving| serving.binary_search(&f.reply_src).is_err());
            let by_np = by_nodeport
                .get(&f.orig_dport)
                .is_some_and(|serving| serving.binary_search(&f.reply_src).is_err());
            by_vip || by_np
        })
        .copied()
        .collect()
}

fn nf_family(family: IpFamily) -> NetfilterProtoFamily {
    match family {
        IpFamily::V4 => NetfilterProtoFamily::IPv4,
        IpFamily::V6 => NetfilterProtoFamily::IPv6,
    }
}

fn socket() -> Result<Socket, Error> {
    let mut s = Socket::new(NETLINK_NETFILTER).map_err(Error::Socket)?;
    s.bind_auto().map_err(Error::Socket)?;
    s.connect(&SocketAddr::new(0, 0)).map_err(Error::Socket)?;
    Ok(s)
}

fn send(s: &Socket, flags: u16, family: IpFamily, msg: ConntrackMessage) -> Result<(), Error> {
    let mut hdr = NetlinkHeader::default();
    hdr.flags = flags;
    let mut packet = NetlinkMessage::new(
        hdr,
        NetlinkPayload::from(NetfilterMessage::new(
            NetfilterHeader::new(nf_family(family), 0, 0),
            msg,
        )),
    );
    packet.finalize();
    let mut buf = vec![0; packet.buffer_len()];
    packet.serialize(&mut buf);
    s.send(&buf, 0).map_err(Error::Socket)?;
    Ok(())
}

/// Reads messages until the dump is done or the request acknowledged; collects entries.
fn receive(s: &Socket, mut each: impl FnMut(&[ConntrackAttribute])) -> Result<(), Error> {
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = s.recv(&mut &mut buf[..], 0).map_err(Error::Socket)?;
        if parse_replies(&buf[..n], &mut each)? {
            return Ok(());
        }
    }
}

/// Decodes the ctnetlink messages of one received datagram, calling `each` with the
/// attributes of every conntrack entry; returns whether the exchange is over (the dump's
/// `NLMSG_DONE`, or the acknowledgement or error that ends a request).
pub(crate) fn parse_replies(
    buf: &[u8],
    each: &mut impl FnMut(&[ConntrackAttribute]),
) -> Result<bool, Error> {
    let mut off = 0;
    while off < buf.len() {
        let msg =
            NetlinkMessage::<NetfilterMessage>::deserialize(&buf[off..]).map_err(Error::Decode)?;
        let len = msg.header.length as usize;
        match msg.payload {
            NetlinkPayload::Done(_) => return Ok(true),
            NetlinkPayload::Error(e) => {
                return match e.code {
                    None => Ok(true),
                    Some(_) => Err(Error::Kernel(e.to_io())),
                };
            }
            NetlinkPayload::InnerMessage(m) => {
                if let netlink_packet_netfilter::NetfilterMessageInner::Conntrack(
                    ConntrackMessage::New(attrs),
                ) = m.inner
                {
                    each(&attrs);
                }
            }
            _ => {}
        }
        if len == 0 {
            break;
        }
        off += len;
    }
    Ok(false)
}

/// The UDP flow an entry's attributes describe, if they hold both tuples.
pub(crate) fn udp_flow(attrs: &[ConntrackAttribute]) -> Option<Flow> {
    let mut orig = None;
    let mut reply = None;
    for a in attrs {
        match a {
            ConntrackAttribute::CtaTupleOrig(t) => orig = Some(tuple_fields(t)),
            ConntrackAttribute::CtaTupleReply(t) => reply = Some(tuple_fields(t)),
            _ => {}
        }
    }
    if let (Some((Some(os), Some(od), Some(17), Some(sp), Some(dp))), Some((Some(rs), ..))) =
        (orig, reply)
    {
        Some(Flow {
            orig_src: os,
            orig_dst: od,
            orig_sport: sp,
            orig_dport: dp,
            reply_src: rs,
        })
    } else {
        None
    }
}

/// Source, destination, protocol number, source port, destination port of a tuple.
type TupleFields = (
    Option<IpAddr>,
    Option<IpAddr>,
    Option<u8>,
    Option<u16>,
    Option<u16>,
);

fn tuple_fields(tuple: &[Tuple]) -> TupleFields {
    let (mut src, mut dst, mut proto, mut sport, mut dport) = (None, None, None, None, None);
    for t in tuple {
        match t {
            Tuple::Ip(ips) => {
                for ip in ips {
                    match ip {
                        IPTuple::SourceAddress(a) => src = Some(*a),
                        IPTuple::DestinationAddress(a) => dst = Some(*a),
                        _ => {}
                    }
                }
            }
            Tuple::Proto(ps) => {
                for p in ps {
                    match p {
                        ProtoTuple::Protocol(CtProto::Udp) => proto = Some(17),
                        ProtoTuple::Protocol(CtProto::Tcp) => proto = Some(6),
                        ProtoTuple::Protocol(CtProto::Sctp) => proto = Some(132),
                        ProtoTuple::Protocol(_) => proto = Some(0),
                        ProtoTuple::SourcePort(p) => sport = Some(*p),
                        ProtoTuple::DestinationPort(p) => dport = Some(*p),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    (src, dst, proto, sport, dport)
}

/// A socket on which the kernel is asked for every conntrack entry of a family.
fn dump_request(family: IpFamily) -> Result<Socket, Error> {
    let s = socket()?;
    send(
        &s,
        NLM_F_REQUEST | NLM_F_DUMP,
        family,
        ConntrackMessage::Get(vec![]),
    )?;
    Ok(s)
}

/// Dumps the UDP conntrack entries of a family.
pub fn dump_udp(family: IpFamily) -> Result<Vec<Flow>, Error> {
    let s = dump_request(family)?;
    let mut flows = Vec::new();
    receive(&s, |attrs| flows.extend(udp_flow(attrs)))?;
    Ok(flows)
}

/// Deletes one UDP entry by its original tuple. An entry already gone is not an error.
pub fn delete_udp(flow: &Flow) -> Result<(), Error> {
    let s = socket()?;
    let family = IpFamily::of(flow.orig_dst);
    let tuple = vec![
        Tuple::Ip(vec![
            IPTuple::SourceAddress(flow.orig_src),
            IPTuple::DestinationAddress(flow.orig_dst),
        ]),
        Tuple::Proto(vec![
            ProtoTuple::Protocol(CtProto::Udp),
            ProtoTuple::SourcePort(flow.orig_sport),
            ProtoTuple::DestinationPort(flow.orig_dport),
        ]),
    ];
    send(
        &s,
        NLM_F_REQUEST | NLM_F_ACK,
        family,
        ConntrackMessage::Delete(vec![ConntrackAttribute::CtaTupleOrig(tuple)]),
    )?;
    match receive(&s, |_| {}) {
        Err(Error::Kernel(e)) if e.raw_os_error() == Some(nix::libc::ENOENT) => Ok(()),
        other => other,
    }
}

/// A connection as conntrack holds it, found by its original tuple (`nodeport trace --live`
/// names the endpoint a packet was DNATed to with it: nftrace names rules, not the map
/// element chosen).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Connection {
    /// Reply direction: source address and port (the endpoint after DNAT; the original
    /// destination when not translated).
    pub reply_src: IpAddr,
    /// Reply direction: source port.
    pub reply_sport: u16,
    /// Reply direction: destination address (the original source, or the address it was
    /// masqueraded to).
    pub reply_dst: IpAddr,
    /// The other side has answered (`IPS_SEEN_REPLY`).
    pub seen_reply: bool,
}

/// The conntrack entry whose original tuple is `src:sport → dst:dport` over `protocol`, in
/// this network namespace; `None` when there is none (never confirmed: the packet was
/// dropped, or not yet through the last hook).
pub fn get(
    protocol: Protocol,
    src: IpAddr,
    sport: u16,
    dst: IpAddr,
    dport: u16,
) -> Result<Option<Connection>, Error> {
    let s = socket()?;
    let ct_proto = match protocol {
        Protocol::Tcp => CtProto::Tcp,
        Protocol::Udp => CtProto::Udp,
        Protocol::Sctp => CtProto::Sctp,
    };
    let tuple = vec![
        Tuple::Ip(vec![
            IPTuple::SourceAddress(src),
            IPTuple::DestinationAddress(dst),
        ]),
        Tuple::Proto(vec![
            ProtoTuple::Protocol(ct_proto),
            ProtoTuple::SourcePort(sport),
            ProtoTuple::DestinationPort(dport),
        ]),
    ];
    send(
        &s,
        NLM_F_REQUEST | NLM_F_ACK,
        IpFamily::of(dst),
        ConntrackMessage::Get(vec![ConntrackAttribute::CtaTupleOrig(tuple)]),
    )?;
    let mut found = None;
    let received = receive(&s, |attrs| {
        let mut reply = None;
        let mut seen_reply = false;
        for a in attrs {
            match a {
                ConntrackAttribute::CtaTupleReply(t) => reply = Some(tuple_fields(t)),
                ConntrackAttribute::CtaStatus(status) => {
                    seen_reply =
                        status.contains(netlink_packet_netfilter::conntrack::Status::SeenReply);
                }
                _ => {}
            }
        }
        if let Some((Some(reply_src), Some(reply_dst), _, Some(reply_sport), _)) = reply {
            found = Some(Connection {
                reply_src,
                reply_sport,
                reply_dst,
                seen_reply,
            });
        }
    });
    match received {
        Err(Error::Kernel(e)) if e.raw_os_error() == Some(nix::libc::ENOENT) => Ok(None),
        Err(e) => Err(e),
        Ok(()) => Ok(found),
    }
}

/// A connection as a dump lists it (`nodeport trace --live` in the ebpf mode finds the node's
/// own sockets with it: the connect hook sends them to their backend, where conntrack sees
/// them with their real source).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Entry {
    /// IP protocol number.
    pub protocol: u8,
    /// Original direction: source address.
    pub orig_src: IpAddr,
    /// Original direction: source port.
    pub orig_sport: u16,
    /// Original direction: destination address.
    pub orig_dst: IpAddr,
    /// Original direction: destination port.
    pub orig_dport: u16,
    /// The other side has sent something back (`IPS_SEEN_REPLY`).
    pub seen_reply: bool,
    /// TCP: conntrack's state (`TCP_CONNTRACK_*`: 3 established, 7 time wait, 8 close).
    pub tcp_state: Option<u8>,
}

/// Dumps every conntrack entry of a family.
pub fn dump(family: IpFamily) -> Result<Vec<Entry>, Error> {
    let s = dump_request(family)?;
    let mut entries = Vec::new();
    receive(&s, |attrs| {
        let mut orig = None;
        let mut seen_reply = false;
        let mut tcp_state = None;
        for a in attrs {
            match a {
                ConntrackAttribute::CtaTupleOrig(t) => orig = Some(tuple_fields(t)),
                ConntrackAttribute::CtaStatus(status) => {
                    seen_reply =
                        status.contains(netlink_packet_netfilter::conntrack::Status::SeenReply);
                }
                ConntrackAttribute::CtaProtoInfo(info) => {
                    for i in info {
                        if let netlink_packet_netfilter::conntrack::ProtoInfo::TCP(tcp) = i {
                            for t in tcp {
                                if let netlink_packet_netfilter::conntrack::ProtoInfoTCP::State(
                                    state,
                                ) = t
                                {
                                    tcp_state = Some(*state);
                                }
                            }
                        }
                    }
                }
                _ => {}
            }
        }
        if let Some((Some(src), Some(dst), Some(protocol), Some(sport), Some(dport))) = orig {
            entries.push(Entry {
                protocol,
                orig_src: src,
                orig_sport: sport,
                orig_dst: dst,
                orig_dport: dport,
                seen_reply,
                tcp_state,
            });
        }
    })?;
    Ok(entries)
}

/// Cleans one family: dump, filter, delete. Returns the number of entries deleted.
pub fn clean_family(state: &FamilyState) -> Result<usize, Error> {
    let flows = dump_udp(state.family)?;
    let stale = stale_flows(&flows, state);
    for f in &stale {
        delete_udp(f)?;
    }
    Ok(stale.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::desired::{self, NodeView, StateConfig};
    use crate::nodeaddr::NodeFacts;

    fn state(endpoints: &str) -> FamilyState {
        let yaml = format!(
            r#"
apiVersion: v1
kind: Service
metadata: {{name: dns, namespace: ns}}
spec: {{type: NodePort, clusterIP: 10.96.0.53, ports: [{{port: 53, protocol: UDP, nodePort: 30053}}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: dns-1, namespace: ns, labels: {{kubernetes.io/service-name: dns}}}}
addressType: IPv4
ports: [{{port: 5353, protocol: UDP}}]
endpoints: {endpoints}
"#
        );
        let loaded = crate::objects::load(&yaml).unwrap();
        let d = desired::build(
            &loaded.cluster,
            NodeView::named("n"),
            &NodeFacts::default(),
            &StateConfig {
                families: vec![IpFamily::V4],
                ..Default::default()
            },
        );
        d.families[0].clone()
    }

    fn flow(dst: &str, dport: u16, reply_src: &str) -> Flow {
        Flow {
            orig_src: "203.0.113.5".parse().unwrap(),
            orig_dst: dst.parse().unwrap(),
            orig_sport: 40000,
            orig_dport: dport,
            reply_src: reply_src.parse().unwrap(),
        }
    }

    #[test]
    fn flows_to_a_removed_endpoint_are_stale_and_flows_to_serving_ones_are_kept() {
        let s = state("[{addresses: [10.244.1.1]}]");
        let keep = flow("10.96.0.53", 53, "10.244.1.1");
        let gone = flow("10.96.0.53", 53, "10.244.2.2");
        let np_gone = flow("192.0.2.10", 30053, "10.244.2.2");
        let other = flow("10.96.0.99", 53, "10.244.2.2");
        assert_eq!(
            stale_flows(&[keep, gone, np_gone, other], &s),
            vec![gone, np_gone]
        );
    }

    #[test]
    fn flows_that_were_never_dnated_are_stale_once_endpoints_appear() {
        // Sent while the Service had no endpoints: the reply source is the ClusterIP itself.
        let s = state("[{addresses: [10.244.1.1]}]");
        let blackholed = flow("10.96.0.53", 53, "10.96.0.53");
        assert_eq!(stale_flows(&[blackholed], &s), vec![blackholed]);
    }

    #[test]
    fn terminating_but_serving_endpoints_keep_their_flows() {
        let s = state(
            "[{addresses: [10.244.1.1], conditions: {ready: false, serving: true, terminating: true}}]",
        );
        assert!(stale_flows(&[flow("10.96.0.53", 53, "10.244.1.1")], &s).is_empty());
    }
}
