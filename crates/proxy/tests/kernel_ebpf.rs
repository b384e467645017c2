//! The eBPF dataplane's tc programs run by the kernel on crafted packets
//! (`BPF_PROG_TEST_RUN`, no topology): frontend lookup, DNAT and SNAT with valid IPv4 header
//! and TCP/UDP checksums, reverse translation of replies, the ICMP port unreachable of a
//! Service without endpoints, drops, affinity, Maglev tables and source ranges. Each test
//! loads its own copy of the maps, so the tests run in parallel. They need root (BPF).

use std::net::{IpAddr, SocketAddr};

use aya::programs::TestRun;
use aya::programs::TestRunOptions;
use nodeport_proxy::ebpf::apply::{Applier, Timeouts, monotonic_now_ns};
use nodeport_proxy::ebpf::dataplane::{Config as DataplaneConfig, Dataplane};
use nodeport_proxy::ebpf::maps::{
    BackendEntry, CT_SNAT, FLAG_FIB_FORWARD, Frontend, FrontendKey, MAGLEV_M, SVC_AFFINITY,
    SVC_DROP, SVC_MAGLEV, SVC_RANGES, SVC_REJECT, SVC_SNAT, Scope,
};
use nodeport_proxy::ebpf::programs::{MapSizes, Maps, Programs, TC_EGRESS, TC_INGRESS};
use nodeport_proxy::ebpf::render::RenderConfig;
use nodeport_testbed::server::{Server, ServerConfig};
use nodeport_testbed::{Netns, require_tools, veth};

const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;
const TCP: u8 = 6;
const UDP: u8 = 17;
const SYN: u8 = 0x02;
const ACK: u8 = 0x10;

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test address")
}

/// The programs and their maps, as the tests use them.
struct Loaded {
    programs: Programs,
    maps: Maps,
}

impl std::ops::Deref for Loaded {
    type Target = Maps;
    fn deref(&self) -> &Maps {
        &self.maps
    }
}

impl std::ops::DerefMut for Loaded {
    fn deref_mut(&mut self) -> &mut Maps {
        &mut self.maps
    }
}

/// Small maps for tests.
fn sizes() -> MapSizes {
    MapSizes {
        services: 64,
        backends: 64,
        conntrack: 1024,
        affinity: 64,
        source_ranges: 64,
        maglev: 4,
        sockets: 64,
    }
}

/// Loads the programs with small maps, or `None` when privileged tests are skipped.
fn load(test: &str) -> Option<Loaded> {
    if !require_tools(test, &[]) {
        return None;
    }
    let (programs, maps) =
        Programs::load(&sizes()).expect("the eBPF object loads (root and BPF needed)");
    Some(Loaded { programs, maps })
}

/// A packet to craft or to read back.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Packet {
    src: IpAddr,
    dst: IpAddr,
    proto: u8,
    sport: u16,
    dport: u16,
    tcp_flags: u8,
    payload: Vec<u8>,
}

impl Packet {
    fn new(proto: u8, src: &str, sport: u16, dst: &str, dport: u16) -> Self {
        Packet {
            src: ip(src),
            dst: ip(dst),
            proto,
            sport,
            dport,
            tcp_flags: if proto == TCP { SYN } else { 0 },
            payload: b"hello".to_vec(),
        }
    }

    fn flags(mut self, flags: u8) -> Self {
        self.tcp_flags = flags;
        self
    }
}

const CLIENT_MAC: [u8; 6] = [2, 0, 0, 0, 0, 1];
const NODE_MAC: [u8; 6] = [2, 0, 0, 0, 0, 2];

/// One's complement sum of 16-bit words.
fn sum16(data: &[u8], mut acc: u32) -> u32 {
    for chunk in data.chunks(2) {
        let word = u16::from_be_bytes([chunk[0], *chunk.get(1).unwrap_or(&0)]);
        acc += u32::from(word);
    }
    acc
}

fn fold(mut acc: u32) -> u16 {
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    !(acc as u16)
}

fn addr_octets(a: IpAddr) -> Vec<u8> {
    match a {
        IpAddr::V4(v) => v.octets().to_vec(),
        IpAddr::V6(v) => v.octets().to_vec(),
    }
}

/// The pseudo-header sum of an L4 segment.
fn pseudo(src: IpAddr, dst: IpAddr, proto: u8, len: usize) -> u32 {
    let mut acc = sum16(&addr_octets(src), 0);
    acc = sum16(&addr_octets(dst), acc);
    acc + u32::from(proto) + len as u32
}

/// Ethernet + IPv4/IPv6 + TCP/UDP, every checksum valid.
fn frame(p: &Packet) -> Vec<u8> {
    let mut l4 = Vec::new();
    l4.extend_from_slice(&p.sport.to_be_bytes());
    l4.extend_from_slice(&p.dport.to_be_bytes());
    let csum_at;
    if p.proto == TCP {
        l4.extend_from_slice(&1000u32.to_be_bytes()); // seq
        l4.extend_from_slice(&0u32.to_be_bytes()); // ack
        l4.push(5 << 4);
        l4.push(p.tcp_flags);
        l4.extend_from_slice(&64240u16.to_be_bytes());
        csum_at = 16;
        l4.extend_from_slice(&[0, 0, 0, 0]); // checksum, urgent
    } else {
        l4.extend_from_slice(&((8 + p.payload.len()) as u16).to_be_bytes());
        csum_at = 6;
        l4.extend_from_slice(&[0, 0]);
    }
    l4.extend_from_slice(&p.payload);
    let c = fold(sum16(&l4, pseudo(p.src, p.dst, p.proto, l4.len())));
    l4[csum_at..csum_at + 2].copy_from_slice(&c.to_be_bytes());

    let mut out = Vec::new();
    out.extend_from_slice(&NODE_MAC);
    out.extend_from_slice(&CLIENT_MAC);
    match (p.src, p.dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            out.extend_from_slice(&0x0800u16.to_be_bytes());
            let mut h = vec![0x45, 0];
            h.extend_from_slice(&((20 + l4.len()) as u16).to_be_bytes());
            h.extend_from_slice(&[0x12, 0x34, 0x40, 0, 64, p.proto, 0, 0]);
            h.extend_from_slice(&s.octets());
            h.extend_from_slice(&d.octets());
            let c = fold(sum16(&h, 0));
            h[10..12].copy_from_slice(&c.to_be_bytes());
            out.extend_from_slice(&h);
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            out.extend_from_slice(&0x86ddu16.to_be_bytes());
            out.extend_from_slice(&[0x60, 0, 0, 0]);
            out.extend_from_slice(&(l4.len() as u16).to_be_bytes());
            out.extend_from_slice(&[p.proto, 64]);
            out.extend_from_slice(&s.octets());
            out.extend_from_slice(&d.octets());
        }
        _ => panic!("mixed families"),
    }
    out.extend_from_slice(&l4);
    out
}

/// Reads a TCP/UDP frame back, asserting that every checksum is valid.
#[track_caller]
fn parse(f: &[u8]) -> Packet {
    let ethertype = u16::from_be_bytes([f[12], f[13]]);
    let (src, dst, proto, l4) = match ethertype {
        0x0800 => {
            let h = &f[14..34];
            assert_eq!(fold(sum16(h, 0)), 0, "IPv4 header checksum of {h:02x?}");
            let len = usize::from(u16::from_be_bytes([h[2], h[3]]));
            let s: [u8; 4] = h[12..16].try_into().unwrap();
            let d: [u8; 4] = h[16..20].try_into().unwrap();
            (IpAddr::from(s), IpAddr::from(d), h[9], &f[34..14 + len])
        }
        0x86dd => {
            let h = &f[14..54];
            let len = usize::from(u16::from_be_bytes([h[4], h[5]]));
            let s: [u8; 16] = h[8..24].try_into().unwrap();
            let d: [u8; 16] = h[24..40].try_into().unwrap();
            (IpAddr::from(s), IpAddr::from(d), h[6], &f[54..54 + len])
        }
        other => panic!("ethertype {other:#x}"),
    };
    let udp_no_csum = proto == UDP && l4[6..8] == [0, 0];
    if !udp_no_csum {
        assert_eq!(
            fold(sum16(l4, pseudo(src, dst, proto, l4.len()))),
            0,
            "L4 checksum of {l4:02x?} from {src} to {dst}"
        );
    }
    let header = if proto == TCP { 20 } else { 8 };
    Packet {
        src,
        dst,
        proto,
        sport: u16::from_be_bytes([l4[0], l4[1]]),
        dport: u16::from_be_bytes([l4[2], l4[3]]),
        tcp_flags: if proto == TCP { l4[13] } else { 0 },
        payload: l4[header..].to_vec(),
    }
}

/// Runs a tc program on a frame: its verdict and the frame it leaves.
fn run(progs: &Loaded, name: &'static str, frame: &[u8]) -> (u32, Vec<u8>) {
    run_on(&progs.programs, name, frame)
}

/// [`run`] on programs whose maps are elsewhere.
fn run_on(progs: &Programs, name: &'static str, frame: &[u8]) -> (u32, Vec<u8>) {
    let prog = progs.classifier(name).expect("program loaded");
    let mut out = vec![0u8; 4096];
    let r = prog
        .test_run(TestRunOptions {
            data_in: Some(frame),
            data_out: Some(&mut out),
            ..Default::default()
        })
        .expect("BPF_PROG_TEST_RUN");
    out.truncate(r.data_size_out as usize);
    (r.return_value, out)
}

/// Runs the ingress program and reads the translated packet back.
#[track_caller]
fn ingress(progs: &Loaded, p: &Packet) -> Packet {
    let (verdict, out) = run(progs, TC_INGRESS, &frame(p));
    assert_eq!(verdict, TC_ACT_OK, "verdict for {p:?}");
    parse(&out)
}

/// [`ingress`] on programs whose maps are elsewhere.
#[track_caller]
fn ingress_on(progs: &Programs, p: &Packet) -> Packet {
    let (verdict, out) = run_on(progs, TC_INGRESS, &frame(p));
    assert_eq!(verdict, TC_ACT_OK, "verdict for {p:?}");
    parse(&out)
}

/// A frontend with its backends written as the applier writes them.
fn service(
    progs: &mut Loaded,
    key: FrontendKey,
    svc_id: u32,
    be_set: u32,
    flags: u16,
    backends: &[BackendEntry],
) {
    for (i, be) in backends.iter().enumerate() {
        progs
            .set_backend(be_set, i as u32 + 1, be)
            .expect("backend");
    }
    let fe = Frontend {
        svc_id,
        be_set,
        count: backends.len() as u16,
        flags,
        affinity_timeout: 10800,
    };
    progs.set_frontend(&key, &fe).expect("frontend");
}

fn ext(addr: &str, port: u16, proto: u8) -> FrontendKey {
    FrontendKey {
        addr: ip(addr),
        port,
        proto,
        scope: Scope::External,
    }
}

fn local(addr: &str, port: u16) -> BackendEntry {
    BackendEntry {
        addr: ip(addr),
        port,
        remote: false,
    }
}

fn remote(addr: &str, port: u16) -> BackendEntry {
    BackendEntry {
        remote: true,
        ..local(addr, port)
    }
}

#[test]
fn a_tcp_packet_to_a_nodeport_is_dnated_to_a_local_backend_with_valid_checksums() {
    let Some(mut progs) = load("a_tcp_packet_to_a_nodeport_is_dnated") else {
        return;
    };
    service(
        &mut progs,
        ext("192.168.1.10", 30080, TCP),
        1,
        1,
        0,
        &[local("10.244.1.5", 8080)],
    );
    let syn = Packet::new(TCP, "203.0.113.7", 40000, "192.168.1.10", 30080);
    let out = ingress(&progs, &syn);
    assert_eq!(
        out,
        Packet {
            dst: ip("10.244.1.5"),
            dport: 8080,
            ..syn.clone()
        }
    );
    // Both directions are recorded: the client's packets and the backend's replies.
    let ct = progs.conntrack().unwrap();
    assert_eq!(ct.len(), 1);
    assert_eq!((ct[0].1.daddr, ct[0].1.dport), (ip("10.244.1.5"), 8080));
    let nat = progs.nat().unwrap();
    assert_eq!(nat.len(), 1);
    assert_eq!(
        (
            nat[0].0.saddr,
            nat[0].0.sport,
            nat[0].0.daddr,
            nat[0].0.dport
        ),
        (ip("10.244.1.5"), 8080, ip("203.0.113.7"), 40000)
    );
    // The next packet of the connection follows the entry.
    let ack = syn.clone().flags(ACK);
    assert_eq!(ingress(&progs, &ack).dst, ip("10.244.1.5"));
}

#[test]
fn a_cluster_policy_frontend_snats_even_to_a_local_backend() {
    let Some(mut progs) = load("a_cluster_policy_frontend_snats") else {
        return;
    };
    progs.set_snat_address(ip("192.168.1.10")).unwrap();
    service(
        &mut progs,
        ext("192.168.1.10", 30080, TCP),
        1,
        1,
        SVC_SNAT,
        &[local("10.244.1.5", 8080)],
    );
    let syn = Packet::new(TCP, "203.0.113.7", 40000, "192.168.1.10", 30080);
    let out = ingress(&progs, &syn);
    assert_eq!((out.src, out.dst), (ip("192.168.1.10"), ip("10.244.1.5")));
    let reply = Packet::new(TCP, "10.244.1.5", 8080, "192.168.1.10", out.sport).flags(SYN | ACK);
    let back = ingress(&progs, &reply);
    assert_eq!(
        (back.src, back.sport, back.dst, back.dport),
        (ip("192.168.1.10"), 30080, ip("203.0.113.7"), 40000)
    );
}

#[test]
fn a_local_backends_reply_leaving_the_node_is_translated_back_to_the_nodeport() {
    let Some(mut progs) = load("a_local_backends_reply_is_translated_back") else {
        return;
    };
    service(
        &mut progs,
        ext("192.168.1.10", 30080, TCP),
        1,
        1,
        0,
        &[local("10.244.1.5", 8080)],
    );
    let syn = Packet::new(TCP, "203.0.113.7", 40000, "192.168.1.10", 30080);
    ingress(&progs, &syn);
    let reply = Packet::new(TCP, "10.244.1.5", 8080, "203.0.113.7", 40000).flags(SYN | ACK);
    let (verdict, out) = run(&progs, TC_EGRESS, &frame(&reply));
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(
        parse(&out),
        Packet {
            src: ip("192.168.1.10"),
            sport: 30080,
            ..reply
        }
    );
}

#[test]
fn a_udp_packet_for_a_remote_backend_is_snated_to_the_node_and_its_reply_reversed() {
    let Some(mut progs) = load("a_udp_packet_for_a_remote_backend_is_snated") else {
        return;
    };
    progs.set_snat_address(ip("192.168.1.10")).unwrap();
    service(
        &mut progs,
        ext("198.51.100.200", 53, UDP),
        2,
        5,
        0,
        &[remote("10.244.2.7", 5353)],
    );
    let query = Packet::new(UDP, "203.0.113.7", 40000, "198.51.100.200", 53);
    let out = ingress(&progs, &query);
    assert_eq!(
        (out.src, out.dst, out.dport),
        (ip("192.168.1.10"), ip("10.244.2.7"), 5353)
    );
    assert!(
        out.sport >= 32768,
        "SNAT port {} from the NAT range",
        out.sport
    );
    assert_eq!(out.payload, query.payload);
    let nat = progs.nat().unwrap();
    assert_eq!(nat.len(), 1);
    assert_eq!(nat[0].1.flags & CT_SNAT, CT_SNAT);

    // The backend answers the node; the node answers the client from the service address.
    let answer = Packet::new(UDP, "10.244.2.7", 5353, "192.168.1.10", out.sport);
    let back = ingress(&progs, &answer);
    assert_eq!(
        back,
        Packet {
            src: ip("198.51.100.200"),
            sport: 53,
            dst: ip("203.0.113.7"),
            dport: 40000,
            ..answer
        }
    );
}

#[test]
fn udp_without_a_checksum_keeps_none_after_translation() {
    let Some(mut progs) = load("udp_without_a_checksum_keeps_none") else {
        return;
    };
    service(
        &mut progs,
        ext("192.168.1.10", 30053, UDP),
        1,
        1,
        0,
        &[local("10.244.1.5", 53)],
    );
    let query = Packet::new(UDP, "203.0.113.7", 40000, "192.168.1.10", 30053);
    let mut f = frame(&query);
    f[14 + 20 + 6] = 0;
    f[14 + 20 + 7] = 0;
    let (verdict, out) = run(&progs, TC_INGRESS, &f);
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(&out[14 + 20 + 6..14 + 20 + 8], &[0, 0]);
    assert_eq!(parse(&out).dst, ip("10.244.1.5"));
}

#[test]
fn ipv6_nodeports_are_translated_both_ways() {
    let Some(mut progs) = load("ipv6_nodeports_are_translated_both_ways") else {
        return;
    };
    progs.set_snat_address(ip("fd00:1::10")).unwrap();
    service(
        &mut progs,
        ext("fd00:1::10", 30080, TCP),
        3,
        3,
        0,
        &[remote("fd00:244:2::7", 8080)],
    );
    let syn = Packet::new(TCP, "2001:db8::7", 40000, "fd00:1::10", 30080);
    let out = ingress(&progs, &syn);
    assert_eq!(
        (out.src, out.dst, out.dport),
        (ip("fd00:1::10"), ip("fd00:244:2::7"), 8080)
    );
    let reply = Packet::new(TCP, "fd00:244:2::7", 8080, "fd00:1::10", out.sport).flags(SYN | ACK);
    let back = ingress(&progs, &reply);
    assert_eq!(
        (back.src, back.sport, back.dst, back.dport),
        (ip("fd00:1::10"), 30080, ip("2001:db8::7"), 40000)
    );
}

/// Asserts an ICMP (ICMPv6) port unreachable answering `sent`, and returns the quoted bytes.
#[track_caller]
fn assert_port_unreachable(out: &[u8], sent: &Packet) -> Vec<u8> {
    assert_eq!(&out[0..6], &CLIENT_MAC, "sent back to the client's MAC");
    assert_eq!(&out[6..12], &NODE_MAC);
    match sent.src {
        IpAddr::V4(_) => {
            assert_eq!(u16::from_be_bytes([out[12], out[13]]), 0x0800);
            let h = &out[14..34];
            assert_eq!(fold(sum16(h, 0)), 0, "IPv4 header checksum");
            assert_eq!(h[9], 1, "ICMP");
            assert_eq!(
                IpAddr::from(<[u8; 4]>::try_from(&h[12..16]).unwrap()),
                sent.dst
            );
            assert_eq!(
                IpAddr::from(<[u8; 4]>::try_from(&h[16..20]).unwrap()),
                sent.src
            );
            let total = usize::from(u16::from_be_bytes([h[2], h[3]]));
            assert_eq!(out.len(), 14 + total);
            let icmp = &out[34..];
            assert_eq!((icmp[0], icmp[1]), (3, 3), "destination unreachable, port");
            assert_eq!(fold(sum16(icmp, 0)), 0, "ICMP checksum");
            icmp[8..].to_vec()
        }
        IpAddr::V6(_) => {
            assert_eq!(u16::from_be_bytes([out[12], out[13]]), 0x86dd);
            let h = &out[14..54];
            assert_eq!(h[6], 58, "ICMPv6");
            assert_eq!(
                IpAddr::from(<[u8; 16]>::try_from(&h[8..24]).unwrap()),
                sent.dst
            );
            assert_eq!(
                IpAddr::from(<[u8; 16]>::try_from(&h[24..40]).unwrap()),
                sent.src
            );
            let icmp = &out[54..];
            assert_eq!(usize::from(u16::from_be_bytes([h[4], h[5]])), icmp.len());
            assert_eq!((icmp[0], icmp[1]), (1, 4), "destination unreachable, port");
            assert_eq!(
                fold(sum16(icmp, pseudo(sent.dst, sent.src, 58, icmp.len()))),
                0,
                "ICMPv6 checksum"
            );
            icmp[8..].to_vec()
        }
    }
}

#[test]
fn a_service_without_endpoints_answers_tcp_and_udp_with_port_unreachable() {
    let Some(mut progs) = load("a_service_without_endpoints_answers_port_unreachable") else {
        return;
    };
    for proto in [TCP, UDP] {
        service(
            &mut progs,
            ext("192.168.1.10", 30443, proto),
            4,
            4,
            SVC_REJECT,
            &[],
        );
        service(
            &mut progs,
            ext("fd00:1::10", 30443, proto),
            5,
            5,
            SVC_REJECT,
            &[],
        );
        for (src, dst) in [
            ("203.0.113.7", "192.168.1.10"),
            ("2001:db8::7", "fd00:1::10"),
        ] {
            let p = Packet::new(proto, src, 40000, dst, 30443);
            let sent = frame(&p);
            let (verdict, out) = run(&progs, TC_INGRESS, &sent);
            assert_eq!(verdict, TC_ACT_REDIRECT, "sent back out of the interface");
            let quote = assert_port_unreachable(&out, &p);
            // The quote is the offending packet's IP header and first 8 bytes of L4.
            let ip_len = if p.src.is_ipv4() { 20 } else { 40 };
            assert_eq!(quote, sent[14..14 + ip_len + 8].to_vec(), "{p:?}");
        }
    }
    assert!(progs.conntrack().unwrap().is_empty());
}

#[test]
fn a_local_policy_without_local_endpoints_drops() {
    let Some(mut progs) = load("a_local_policy_without_local_endpoints_drops") else {
        return;
    };
    service(
        &mut progs,
        ext("192.168.1.10", 30080, TCP),
        1,
        1,
        SVC_DROP,
        &[],
    );
    let syn = Packet::new(TCP, "203.0.113.7", 40000, "192.168.1.10", 30080);
    assert_eq!(run(&progs, TC_INGRESS, &frame(&syn)).0, TC_ACT_SHOT);
}

#[test]
fn packets_for_no_frontend_pass_untouched() {
    let Some(mut progs) = load("packets_for_no_frontend_pass_untouched") else {
        return;
    };
    service(
        &mut progs,
        ext("192.168.1.10", 30080, TCP),
        1,
        1,
        0,
        &[local("10.244.1.5", 8080)],
    );
    for p in [
        Packet::new(TCP, "203.0.113.7", 40000, "192.168.1.10", 22),
        Packet::new(UDP, "203.0.113.7", 40000, "192.168.1.10", 30080),
        Packet::new(TCP, "203.0.113.7", 40000, "192.168.1.11", 30080),
        Packet::new(TCP, "2001:db8::7", 40000, "fd00:1::10", 30080),
    ] {
        let f = frame(&p);
        assert_eq!(run(&progs, TC_INGRESS, &f), (TC_ACT_OK, f.clone()));
        assert_eq!(run(&progs, TC_EGRESS, &f), (TC_ACT_OK, f));
    }
    assert!(progs.conntrack().unwrap().is_empty());
}

#[test]
fn new_connections_are_spread_over_every_backend() {
    let Some(mut progs) = load("new_connections_are_spread_over_every_backend") else {
        return;
    };
    let backends = [
        local("10.244.1.5", 8080),
        local("10.244.1.6", 8080),
        local("10.244.1.7", 8080),
    ];
    service(
        &mut progs,
        ext("192.168.1.10", 30080, TCP),
        1,
        1,
        0,
        &backends,
    );
    let mut seen = std::collections::BTreeSet::new();
    for sport in 40000..40060 {
        let syn = Packet::new(TCP, "203.0.113.7", sport, "192.168.1.10", 30080);
        seen.insert(ingress(&progs, &syn).dst);
    }
    // Random choice: missing one of three in 60 tries has probability 3·(2/3)^60 ≈ 1e-10.
    assert_eq!(seen.len(), 3, "{seen:?}");
}

#[test]
fn session_affinity_keeps_a_client_on_its_backend_while_the_backend_stays() {
    let Some(mut progs) = load("session_affinity_keeps_a_client_on_its_backend") else {
        return;
    };
    let backends = [
        local("10.244.1.5", 8080),
        local("10.244.1.6", 8080),
        local("10.244.1.7", 8080),
    ];
    service(
        &mut progs,
        ext("192.168.1.10", 30080, TCP),
        9,
        1,
        SVC_AFFINITY,
        &backends,
    );
    let first = ingress(
        &progs,
        &Packet::new(TCP, "203.0.113.7", 40000, "192.168.1.10", 30080),
    );
    for sport in 40001..40030 {
        let syn = Packet::new(TCP, "203.0.113.7", sport, "192.168.1.10", 30080);
        assert_eq!(ingress(&progs, &syn).dst, first.dst, "source port {sport}");
    }
    let (addr, port, _) = progs
        .affinity(9, ip("203.0.113.7"))
        .unwrap()
        .expect("recorded");
    assert_eq!((addr, port), (first.dst, 8080));

    // A new backend set that keeps the backend keeps the client on it; one without it
    // sends the client elsewhere.
    let kept: Vec<BackendEntry> = backends.iter().rev().copied().collect();
    service(
        &mut progs,
        ext("192.168.1.10", 30080, TCP),
        9,
        2,
        SVC_AFFINITY,
        &kept,
    );
    let syn = Packet::new(TCP, "203.0.113.7", 41000, "192.168.1.10", 30080);
    assert_eq!(ingress(&progs, &syn).dst, first.dst);
    let without: Vec<BackendEntry> = backends
        .iter()
        .filter(|b| b.addr != first.dst)
        .copied()
        .collect();
    service(
        &mut progs,
        ext("192.168.1.10", 30080, TCP),
        9,
        3,
        SVC_AFFINITY,
        &without,
    );
    let syn = Packet::new(TCP, "203.0.113.7", 41001, "192.168.1.10", 30080);
    assert_ne!(ingress(&progs, &syn).dst, first.dst);
}

#[test]
fn the_tracer_follows_the_affinity_entry_the_program_wrote_until_its_timeout() {
    use nodeport_proxy::ebpf::render::{Rendered, from_maps};
    use nodeport_proxy::ebpf::tracer;
    use nodeport_proxy::model::Protocol;
    use nodeport_proxy::trace::{Env, Packet as Traced};
    let Some(mut progs) = load("the_tracer_follows_the_affinity_entry") else {
        return;
    };
    // A client of each family sent through tc writes its np_affinity entry (the IPv4 one
    // under its ::ffff: mapped address); `nodeport trace --rules kernel` reads the maps back.
    let cases = [
        (
            "192.0.2.11",
            "192.0.2.101",
            ["10.244.1.2", "10.244.1.3", "10.244.1.4"],
        ),
        (
            "2001:db8::11",
            "2001:db8::101",
            ["fd00:244::2", "fd00:244::3", "fd00:244::4"],
        ),
    ];
    for (i, (node, _, backends)) in cases.iter().enumerate() {
        let list: Vec<BackendEntry> = backends.iter().map(|b| local(b, 80)).collect();
        service(
            &mut progs,
            ext(node, 30080, TCP),
            4 + i as u32,
            1 + i as u32,
            SVC_AFFINITY,
            &list,
        );
    }
    let mut sent = Vec::new();
    for (node, client, _) in &cases {
        let syn = Packet::new(TCP, client, 40000, node, 30080);
        sent.push(SocketAddr::new(ingress(&progs, &syn).dst, 80));
    }
    let mut maps = from_maps(
        &progs.frontends().unwrap(),
        &progs.backends().unwrap(),
        &progs.source_ranges().unwrap(),
        &Default::default(),
        &Rendered::default(),
    );
    maps.affinity = progs.held_affinity().unwrap();
    let following = Env {
        recorded_affinity: true,
        ..Env::default()
    };
    for ((node, client, _), to) in cases.iter().zip(&sent) {
        let packet = Traced::remote(client, node, Protocol::Tcp, 30080);
        // Followed: the remembered backend is the one way.
        let trace = tracer::trace(&maps, &packet, &following);
        assert_eq!(trace.probability_of(&to.to_string()), 1.0, "{trace}");
        // Not followed: a new client's three ways, and the step says where the entry sends
        // this one and until when.
        let trace = tracer::trace(&maps, &packet, &Env::default());
        assert_eq!(trace.endpoints().len(), 3, "{trace}");
        let step = trace.walks[0]
            .steps
            .iter()
            .find(|s| s.chain == "affinity")
            .expect("an affinity step");
        assert!(
            step.verdict.contains(&format!("sends {client} to {to}"))
                && step
                    .verdict
                    .contains("honoured only until the entry has been idle 10800 s"),
            "{}",
            step.verdict
        );
        // Another client has no entry.
        let other = Traced::remote(
            if node.contains(':') {
                "2001:db8::102"
            } else {
                "192.0.2.102"
            },
            node,
            Protocol::Tcp,
            30080,
        );
        assert_eq!(
            tracer::trace(&maps, &other, &following).endpoints().len(),
            3
        );
    }
    // An entry idle beyond the timeout is not followed (the program chooses anew).
    for entry in maps.affinity.values_mut() {
        entry.idle_ns = 10801 * 1_000_000_000;
    }
    let (node, client, _) = cases[0];
    let trace = tracer::trace(
        &maps,
        &Traced::remote(client, node, Protocol::Tcp, 30080),
        &following,
    );
    assert_eq!(trace.endpoints().len(), 3, "{trace}");
}

#[test]
fn maglev_sends_each_flow_to_the_backend_its_table_slot_names() {
    let Some(mut progs) = load("maglev_sends_each_flow_to_the_backend_its_table_slot_names") else {
        return;
    };
    let backends = [local("10.244.1.5", 8080), local("10.244.1.6", 8080)];
    service(
        &mut progs,
        ext("192.168.1.10", 30080, TCP),
        1,
        1,
        SVC_MAGLEV,
        &backends,
    );
    // Every slot names backend 2: every flow goes there, whatever its hash.
    progs.set_maglev(1, &vec![2u32; MAGLEV_M]).unwrap();
    for sport in 40000..40020 {
        let syn = Packet::new(TCP, "203.0.113.7", sport, "192.168.1.10", 30080);
        assert_eq!(ingress(&progs, &syn).dst, ip("10.244.1.6"));
    }
    // A real table: the same new flow hashes to the same slot, so the same backend.
    let names: Vec<String> = backends
        .iter()
        .map(|b| format!("{}:{}", b.addr, b.port))
        .collect();
    service(
        &mut progs,
        ext("192.168.1.10", 30080, TCP),
        1,
        2,
        SVC_MAGLEV,
        &backends,
    );
    progs
        .set_maglev(2, &nodeport_proxy::ebpf::maglev::table(&names))
        .unwrap();
    let mut seen = std::collections::BTreeSet::new();
    for sport in 41000..41060 {
        let syn = Packet::new(TCP, "203.0.113.7", sport, "192.168.1.10", 30080);
        seen.insert(ingress(&progs, &syn).dst);
    }
    assert_eq!(seen.len(), 2, "both backends own slots: {seen:?}");
}

#[test]
fn a_maglev_service_without_its_table_drops_rather_than_guess() {
    let Some(mut progs) = load("a_maglev_service_without_its_table_drops") else {
        return;
    };
    service(
        &mut progs,
        ext("192.168.1.10", 30080, TCP),
        1,
        1,
        SVC_MAGLEV,
        &[local("10.244.1.5", 8080)],
    );
    let syn = Packet::new(TCP, "203.0.113.7", 40000, "192.168.1.10", 30080);
    assert_eq!(run(&progs, TC_INGRESS, &frame(&syn)).0, TC_ACT_SHOT);
}

#[test]
fn load_balancer_source_ranges_admit_only_their_sources() {
    let Some(mut progs) = load("load_balancer_source_ranges_admit_only_their_sources") else {
        return;
    };
    service(
        &mut progs,
        ext("198.51.100.200", 80, TCP),
        6,
        1,
        SVC_RANGES,
        &[local("10.244.1.5", 8080)],
    );
    progs
        .add_source_range(6, "203.0.113.0/24".parse().unwrap())
        .unwrap();
    // Another service's range admits nothing here.
    progs
        .add_source_range(7, "192.0.2.0/24".parse().unwrap())
        .unwrap();
    let inside = Packet::new(TCP, "203.0.113.7", 40000, "198.51.100.200", 80);
    assert_eq!(ingress(&progs, &inside).dst, ip("10.244.1.5"));
    for src in ["203.0.114.7", "192.0.2.7"] {
        let outside = Packet::new(TCP, src, 40000, "198.51.100.200", 80);
        assert_eq!(
            run(&progs, TC_INGRESS, &frame(&outside)).0,
            TC_ACT_SHOT,
            "{src}"
        );
    }
}

#[test]
fn an_established_connection_keeps_its_backend_when_the_service_switches_sets() {
    let Some(mut progs) = load("an_established_connection_keeps_its_backend") else {
        return;
    };
    service(
        &mut progs,
        ext("192.168.1.10", 30080, TCP),
        1,
        1,
        0,
        &[local("10.244.1.5", 8080)],
    );
    let syn = Packet::new(TCP, "203.0.113.7", 40000, "192.168.1.10", 30080);
    assert_eq!(ingress(&progs, &syn).dst, ip("10.244.1.5"));
    service(
        &mut progs,
        ext("192.168.1.10", 30080, TCP),
        1,
        2,
        0,
        &[local("10.244.1.6", 8080)],
    );
    assert_eq!(
        ingress(&progs, &syn.clone().flags(ACK)).dst,
        ip("10.244.1.5")
    );
    let other = Packet::new(TCP, "203.0.113.7", 40001, "192.168.1.10", 30080);
    assert_eq!(ingress(&progs, &other).dst, ip("10.244.1.6"));
}

/// A cgroup v2 directory of this test's own, removed on drop (its processes have exited).
struct TestCgroup(std::path::PathBuf);

impl TestCgroup {
    fn new(test: &str) -> Self {
        // Found, not assumed: this machine's hybrid hierarchy mounts it at
        // /sys/fs/cgroup/unified.
        let root = nodeport_proxy::ebpf::dataplane::cgroup2_mount()
            .unwrap_or_else(|| panic!("{test} needs a cgroup v2 (cgroup2) mount"));
        assert!(
            root.join("cgroup.procs").is_file(),
            "{test}: {} is not a cgroup v2 hierarchy",
            root.display()
        );
        let dir = root.join(format!("nodeport-test-{}-{test}", std::process::id()));
        std::fs::create_dir(&dir).expect("creating a test cgroup");
        TestCgroup(dir)
    }

    /// Runs `script` under `sh` inside this cgroup: the shell moves itself in before it
    /// `exec`s, so every socket the command opens belongs to the cgroup.
    fn run(&self, script: &str) -> std::process::Output {
        let procs = self.0.join("cgroup.procs");
        std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("echo $$ > {} && exec {script}", procs.display()))
            .output()
            .expect("running sh")
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// A one-shot HTTP server on `addr`, answering `body`.
fn http_once(
    addr: &str,
    body: &'static str,
) -> (std::net::SocketAddr, std::thread::JoinHandle<()>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind(addr).expect("binding the backend");
    let local = listener.local_addr().unwrap();
    let handle = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().expect("accept");
        let mut buf = [0u8; 1024];
        let _ = conn.read(&mut buf);
        let _ = write!(
            conn,
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
    });
    (local, handle)
}

fn internal(addr: &str, port: u16, proto: u8) -> FrontendKey {
    FrontendKey {
        scope: Scope::Internal,
        ..ext(addr, port, proto)
    }
}

#[test]
fn a_socket_connecting_to_a_cluster_ip_reaches_a_backend_and_sees_the_service_as_its_peer() {
    let test = "cluster_ip_connect";
    let Some(mut progs) = load(test) else {
        return;
    };
    assert!(require_tools(test, &["curl"]));
    let cgroup = TestCgroup::new(test);
    progs
        .programs
        .attach_cgroup(&cgroup.0)
        .expect("attaching to the test cgroup");
    for (vip, listen) in [("10.96.0.10", "127.0.0.1:0"), ("fd00:96::10", "[::1]:0")] {
        let (backend, server) = http_once(listen, "from the backend");
        service(
            &mut progs,
            internal(vip, 80, TCP),
            1,
            1,
            0,
            &[local(&backend.ip().to_string(), backend.port())],
        );
        let url = if vip.contains(':') {
            format!("http://[{vip}]:80/")
        } else {
            format!("http://{vip}:80/")
        };
        // curl's %{remote_ip} and %{remote_port} come from getpeername().
        let out = cgroup.run(&format!(
            "curl -sS --max-time 5 -w ' %{{remote_ip}} %{{remote_port}}' {url}"
        ));
        server.join().unwrap();
        assert!(
            out.status.success(),
            "curl: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            format!("from the backend {vip} 80")
        );
    }
}

#[test]
fn a_socket_connecting_to_a_cluster_ip_without_endpoints_is_refused() {
    let test = "cluster_ip_without_endpoints";
    let Some(mut progs) = load(test) else {
        return;
    };
    assert!(require_tools(test, &["curl"]));
    let cgroup = TestCgroup::new(test);
    progs
        .programs
        .attach_cgroup(&cgroup.0)
        .expect("attaching to the test cgroup");
    service(
        &mut progs,
        internal("10.96.0.11", 443, TCP),
        2,
        2,
        SVC_REJECT,
        &[],
    );
    // bash's /dev/tcp prints connect()'s error: ECONNREFUSED, what kube-proxy's reject
    // makes a client see.
    let out = cgroup.run("bash -c 'exec 3<>/dev/tcp/10.96.0.11/443'");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("Connection refused"), "{stderr}");
}

#[test]
fn a_udp_socket_connected_to_a_cluster_ip_talks_to_a_backend() {
    let test = "cluster_ip_udp";
    let Some(mut progs) = load(test) else {
        return;
    };
    let cgroup = TestCgroup::new(test);
    progs
        .programs
        .attach_cgroup(&cgroup.0)
        .expect("attaching to the test cgroup");
    let backend = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    backend
        .set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    let port = backend.local_addr().unwrap().port();
    service(
        &mut progs,
        internal("10.96.0.12", 53, UDP),
        3,
        3,
        0,
        &[local("127.0.0.1", port)],
    );
    let server = std::thread::spawn(move || {
        let mut buf = [0u8; 64];
        let (n, from) = backend
            .recv_from(&mut buf)
            .expect("a datagram at the backend");
        backend.send_to(&buf[..n], from).unwrap();
        String::from_utf8_lossy(&buf[..n]).into_owned()
    });
    // bash's /dev/udp connects a UDP socket (the connect4 hook); `head` reads the echoed
    // datagram back in one read.
    let out = cgroup.run(
        "bash -c 'exec 3<>/dev/udp/10.96.0.12/53; printf ping >&3; exec timeout 5 head -c 4 <&3'",
    );
    assert_eq!(server.join().unwrap(), "ping");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "ping");
}

/// A NodePort Service `web` (port 80, NodePort 30080, target 8080) with endpoints given as
/// `ip@node`, on node-a (192.0.2.10).
fn web(endpoints: &[&str]) -> String {
    let eps: Vec<String> = endpoints
        .iter()
        .map(|e| {
            let (ip, node) = e.split_once('@').expect("ip@node");
            format!("- {{addresses: [{ip}], nodeName: {node}}}")
        })
        .collect();
    format!(
        r#"
apiVersion: v1
kind: Service
metadata: {{name: web, namespace: default}}
spec:
  type: NodePort
  clusterIP: 10.96.0.10
  ports: [{{name: http, port: 80, targetPort: 8080, nodePort: 30080}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: web-1, namespace: default, labels: {{kubernetes.io/service-name: web}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}]
endpoints:
{}
"#,
        if eps.is_empty() {
            "  []".to_string()
        } else {
            eps.join("\n")
        }
    )
}

/// The cluster and desired state the applier tests sync from.
struct Cluster {
    cluster: nodeport_proxy::objects::Cluster,
    desired: nodeport_proxy::desired::DesiredState,
}

impl Cluster {
    fn facts() -> nodeport_proxy::nodeaddr::NodeFacts {
        nodeport_proxy::nodeaddr::NodeFacts {
            node_ips: vec![ip("192.0.2.10")],
            local_ips: vec![ip("192.0.2.10")],
            ..Default::default()
        }
    }

    fn new(yaml: &str) -> Self {
        Self::on_node(yaml, Self::facts())
    }

    fn on_node(yaml: &str, facts: nodeport_proxy::nodeaddr::NodeFacts) -> Self {
        let cluster = nodeport_proxy::objects::load(yaml).unwrap().cluster;
        let desired = nodeport_proxy::desired::build(
            &cluster,
            nodeport_proxy::desired::NodeView::named("node-a"),
            &facts,
            &nodeport_proxy::desired::StateConfig::default(),
        );
        Cluster { cluster, desired }
    }

    /// Replaces every object with those of `yaml`; returns the service ports that changed.
    fn update(
        &mut self,
        yaml: &str,
    ) -> std::collections::BTreeSet<nodeport_proxy::model::ServicePortName> {
        use nodeport_proxy::model::ServiceName;
        let fresh = nodeport_proxy::objects::load(yaml).unwrap().cluster;
        let slice = ServiceName::new("default", "web-1");
        self.cluster
            .update_slice(slice.clone(), fresh.slices.get(&slice).cloned());
        let svc = ServiceName::new("default", "web");
        self.cluster
            .update_service(svc.clone(), fresh.services.get(&svc).cloned());
        let changes = self.cluster.take_changes();
        self.desired.refresh_services(
            &self.cluster,
            nodeport_proxy::desired::NodeView::named("node-a"),
            &changes.services,
        )
    }
}

fn applier(test: &str) -> Option<(Programs, Applier)> {
    if !require_tools(test, &[]) {
        return None;
    }
    let (programs, maps) = Programs::load(&sizes()).expect("the eBPF object loads");
    Some((programs, Applier::new(maps, RenderConfig::default())))
}

#[test]
fn the_applier_writes_the_rendered_frontends_and_nodeport_packets_follow_them() {
    let Some((programs, mut applier)) = applier("the_applier_writes_the_rendered_frontends") else {
        return;
    };
    let c = Cluster::new(&web(&["10.244.1.5@node-a", "10.244.2.7@node-b"]));
    let report = applier.sync(&c.desired, None).unwrap();
    assert!(report.full);
    let mut keys: Vec<String> = applier
        .maps()
        .frontends()
        .unwrap()
        .iter()
        .map(|(k, fe)| format!("{}:{} {:?} count {}", k.addr, k.port, k.scope, fe.count))
        .collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            "10.96.0.10:80 External count 2",
            "10.96.0.10:80 Internal count 2",
            "192.0.2.10:30080 External count 2",
            "192.0.2.10:30080 Internal count 2",
        ]
    );
    // Both backends are used.
    let mut seen = std::collections::BTreeSet::new();
    for sport in 40000..40060 {
        let syn = Packet::new(TCP, "203.0.113.7", sport, "192.0.2.10", 30080);
        let (verdict, out) = run_on(&programs, TC_INGRESS, &frame(&syn));
        assert_eq!(verdict, TC_ACT_OK);
        let out = parse(&out);
        // externalTrafficPolicy Cluster: SNATed to the node, local backend or not, as
        // kube-proxy masquerades it.
        assert_eq!(out.src, ip("192.0.2.10"), "{out:?}");
        seen.insert(out.dst);
    }
    assert_eq!(seen.len(), 2);
    // A second full sync of the same state writes nothing.
    let again = applier.sync(&c.desired, None).unwrap();
    assert_eq!((again.services_written, again.map_operations), (0, 0));
}

/// Routed packets to the ClusterIP `10.96.0.10:80` from `src`, one per source port, through
/// an applier rendering with `config`: the sources the local backend saw.
fn clusterip_sources(test: &str, config: RenderConfig, src: &str) -> Option<Vec<IpAddr>> {
    if !require_tools(test, &[]) {
        return None;
    }
    let (programs, maps) = Programs::load(&sizes()).expect("the eBPF object loads");
    let mut applier = Applier::new(maps, config);
    let c = Cluster::new(&web(&["10.244.1.5@node-a"]));
    applier.sync(&c.desired, None).unwrap();
    Some(
        (41000..41004)
            .map(|sport| {
                let syn = Packet::new(TCP, src, sport, "10.96.0.10", 80);
                let (verdict, out) = run_on(&programs, TC_INGRESS, &frame(&syn));
                assert_eq!(verdict, TC_ACT_OK);
                let out = parse(&out);
                assert_eq!((out.dst, out.dport), (ip("10.244.1.5"), 8080), "{out:?}");
                out.src
            })
            .collect(),
    )
}

#[test]
fn routed_clusterip_traffic_from_outside_the_cluster_cidr_is_snated_and_pod_traffic_is_not() {
    // kube-proxy: `ip saddr != <cluster CIDR> ip daddr <ClusterIP> ... mark for masquerade`.
    let test = "routed_clusterip_traffic_from_outside_the_cluster_cidr_is_snated";
    let config = || RenderConfig {
        cluster_cidrs: vec!["10.244.0.0/16".parse().unwrap()],
        ..RenderConfig::default()
    };
    let Some(from_pod) = clusterip_sources(test, config(), "10.244.3.2") else {
        return;
    };
    assert!(
        from_pod.iter().all(|s| *s == ip("10.244.3.2")),
        "{from_pod:?}"
    );
    let off = clusterip_sources(test, config(), "203.0.113.7").unwrap();
    assert!(off.iter().all(|s| *s == ip("192.0.2.10")), "{off:?}");
    // Without --cluster-cidr, nothing is masqueraded to a local backend (kube-proxy too).
    let none = clusterip_sources(test, RenderConfig::default(), "203.0.113.7").unwrap();
    assert!(none.iter().all(|s| *s == ip("203.0.113.7")), "{none:?}");
}

#[test]
fn masquerade_all_snats_routed_clusterip_traffic_even_from_a_pod() {
    let config = RenderConfig {
        masquerade_all: true,
        cluster_cidrs: vec!["10.244.0.0/16".parse().unwrap()],
        ..RenderConfig::default()
    };
    let Some(from_pod) = clusterip_sources(
        "masquerade_all_snats_routed_clusterip_traffic",
        config,
        "10.244.3.2",
    ) else {
        return;
    };
    assert!(
        from_pod.iter().all(|s| *s == ip("192.0.2.10")),
        "{from_pod:?}"
    );
}

#[test]
fn an_endpoint_change_writes_a_fresh_backend_set_and_deletes_the_old_one() {
    let Some((_programs, mut applier)) = applier("an_endpoint_change_writes_a_fresh_set") else {
        return;
    };
    let mut c = Cluster::new(&web(&["10.244.1.5@node-a", "10.244.2.7@node-b"]));
    applier.sync(&c.desired, None).unwrap();
    let before: std::collections::BTreeSet<u32> = applier
        .maps()
        .backends()
        .unwrap()
        .iter()
        .map(|((set, _), _)| *set)
        .collect();
    let changed = c.update(&web(&["10.244.1.5@node-a", "10.244.3.9@node-c"]));
    let report = applier.sync(&c.desired, Some(&changed)).unwrap();
    assert!(!report.full);
    assert_eq!(report.services_written, 1);
    let backends = applier.maps().backends().unwrap();
    let addrs: std::collections::BTreeSet<IpAddr> = backends.iter().map(|(_, b)| b.addr).collect();
    assert_eq!(addrs, [ip("10.244.1.5"), ip("10.244.3.9")].into());
    assert!(
        backends.iter().all(|((set, _), _)| !before.contains(set)),
        "the new set has a fresh id, the old set is gone: {backends:?}"
    );
    for (_, fe) in applier.maps().frontends().unwrap() {
        assert!(
            backends.iter().any(|((set, _), _)| *set == fe.be_set),
            "{fe:?}"
        );
    }
    // The Service goes away: nothing of it stays.
    c.cluster.update_service(
        nodeport_proxy::model::ServiceName::new("default", "web"),
        None,
    );
    let changes = c.cluster.take_changes();
    c.desired.refresh_services(
        &c.cluster,
        nodeport_proxy::desired::NodeView::named("node-a"),
        &changes.services,
    );
    applier.sync(&c.desired, Some(&changed)).unwrap();
    assert!(applier.maps().frontends().unwrap().is_empty());
    assert!(applier.maps().backends().unwrap().is_empty());
}

#[test]
fn a_full_sync_sweeps_entries_the_applier_did_not_write() {
    if !require_tools("a_full_sync_sweeps_entries", &[]) {
        return;
    }
    let c = Cluster::new(&web(&["10.244.1.5@node-a"]));
    // Maps holding a frontend and a set no Service asks for, as an earlier run could leave
    // them; a new applier's first sync is full and sweeps them.
    let stale = FrontendKey {
        addr: ip("10.96.9.9"),
        port: 99,
        proto: TCP,
        scope: Scope::Internal,
    };
    let (programs2, mut maps2) = Programs::load(&sizes()).unwrap();
    drop(programs2);
    maps2
        .set_frontend(
            &stale,
            &Frontend {
                svc_id: 77,
                be_set: 500,
                count: 1,
                flags: 0,
                affinity_timeout: 0,
            },
        )
        .unwrap();
    maps2.set_backend(500, 1, &local("10.244.9.9", 80)).unwrap();
    let mut fresh = Applier::new(maps2, RenderConfig::default());
    fresh.sync(&c.desired, None).unwrap();
    let keys: Vec<FrontendKey> = fresh
        .maps()
        .frontends()
        .unwrap()
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert!(!keys.contains(&stale));
    assert_eq!(keys.len(), 4, "{keys:?}");
    assert!(
        fresh
            .maps()
            .backends()
            .unwrap()
            .iter()
            .all(|(_, b)| b.addr == ip("10.244.1.5"))
    );
}

#[test]
fn a_full_sync_writes_again_a_service_port_whose_entries_others_deleted() {
    let Some((programs, mut applier)) = applier("a_full_sync_writes_again_a_service_port") else {
        return;
    };
    let c = Cluster::new(&web(&["10.244.1.5@node-a", "10.244.2.7@node-b"]));
    applier.sync(&c.desired, None).unwrap();
    let fronts = applier.maps().frontends().unwrap();
    let (gone, fe) = fronts[0];
    // `bpftool map delete` of a backend and of a frontend.
    applier
        .maps_mut()
        .remove_backend_slot(fe.be_set, 2)
        .unwrap();
    applier.maps_mut().remove_frontend(&gone).unwrap();
    // A partial sync of another change does not look; a full one does.
    let report = applier.sync(&c.desired, None).unwrap();
    assert_eq!(report.services_written, 1, "{report:?}");
    let fronts = applier.maps().frontends().unwrap();
    let backends = applier.maps().backends().unwrap();
    assert_eq!(fronts.len(), 4);
    for (_, fe) in &fronts {
        let ordinals: Vec<u32> = backends
            .iter()
            .filter(|((set, _), _)| *set == fe.be_set)
            .map(|((_, ordinal), _)| *ordinal)
            .collect();
        assert_eq!(ordinals.len(), 2, "{fe:?} names a whole set: {backends:?}");
    }
    assert_eq!(backends.len(), 2, "the damaged set is gone: {backends:?}");
    let syn = Packet::new(TCP, "203.0.113.7", 40000, "192.0.2.10", 30080);
    assert!(parse(&run_on(&programs, TC_INGRESS, &frame(&syn)).1).dst != ip("192.0.2.10"));
    // Nothing left to repair.
    let again = applier.sync(&c.desired, None).unwrap();
    assert_eq!((again.services_written, again.map_operations), (0, 0));
    // A backend alone, found by the resync's look-ups (no walk within the hour).
    let fe = applier.maps().frontends().unwrap()[0].1;
    applier
        .maps_mut()
        .remove_backend_slot(fe.be_set, 1)
        .unwrap();
    let report = applier.sync(&c.desired, None).unwrap();
    assert_eq!(report.services_written, 1, "{report:?}");
    assert_eq!(applier.maps().backends().unwrap().len(), 2);
}

/// `np_svc_names` as the map holds it: service id → name, as text.
fn names_of(maps: &Maps) -> std::collections::BTreeMap<u32, String> {
    maps.names()
        .unwrap()
        .into_iter()
        .map(|(id, v)| {
            let end = v.iter().position(|&c| c == 0).unwrap_or(v.len());
            (id, String::from_utf8_lossy(&v[..end]).into_owned())
        })
        .collect()
}

#[test]
fn service_port_names_go_in_and_out_with_their_frontends_are_taken_over_and_swept_by_the_walk() {
    let Some((_programs, mut applier)) = applier("service_port_names_go_in_and_out") else {
        return;
    };
    let mut c = Cluster::new(&web(&["10.244.1.5@node-a", "10.244.2.7@node-b"]));
    applier.sync(&c.desired, None).unwrap();
    // Under the frontends' service id, written in the same batched sync.
    let id = applier.maps().frontends().unwrap()[0].1.svc_id;
    assert!(
        applier
            .maps()
            .frontends()
            .unwrap()
            .iter()
            .all(|(_, fe)| fe.svc_id == id)
    );
    assert_eq!(
        names_of(applier.maps()),
        [(id, "default/web:http/TCP".to_string())].into()
    );
    assert!(applier.entry_counts().contains(&("np_svc_names", 1)));
    // An endpoint change keeps the name; the Service gone, its name goes with its frontends.
    let changed = c.update(&web(&["10.244.1.5@node-a"]));
    let report = applier.sync(&c.desired, Some(&changed)).unwrap();
    assert_eq!(names_of(applier.maps()).len(), 1, "{report:?}");
    c.cluster.update_service(
        nodeport_proxy::model::ServiceName::new("default", "web"),
        None,
    );
    let changes = c.cluster.take_changes();
    c.desired.refresh_services(
        &c.cluster,
        nodeport_proxy::desired::NodeView::named("node-a"),
        &changes.services,
    );
    applier.sync(&c.desired, Some(&changed)).unwrap();
    assert!(applier.maps().frontends().unwrap().is_empty());
    assert!(names_of(applier.maps()).is_empty());
    assert!(applier.entry_counts().contains(&("np_svc_names", 0)));
    // Back, under a fresh id; then the proxy stops, and others change the names: one
    // rewritten, one added for an id no frontend has.
    let c = Cluster::new(&web(&["10.244.1.5@node-a"]));
    applier.sync(&c.desired, None).unwrap();
    let id = applier.maps().frontends().unwrap()[0].1.svc_id;
    let mut maps = applier.into_maps();
    maps.set_names(&[
        (
            id,
            nodeport_proxy::model::ServicePortName::new(
                "default",
                "other",
                "x",
                nodeport_proxy::model::Protocol::Udp,
            ),
        ),
        (
            id + 50,
            nodeport_proxy::model::ServicePortName::new(
                "default",
                "stray",
                "",
                nodeport_proxy::model::Protocol::Tcp,
            ),
        ),
    ])
    .unwrap();
    // A restarted proxy's first sync walks the maps: it keeps the service id the frontends
    // carry, writes the name again as it should be, and deletes the stray one.
    let mut restarted = Applier::new(maps, RenderConfig::default());
    restarted.sync(&c.desired, None).unwrap();
    assert_eq!(restarted.maps().frontends().unwrap()[0].1.svc_id, id);
    assert_eq!(
        names_of(restarted.maps()),
        [(id, "default/web:http/TCP".to_string())].into()
    );
    // Nothing left to repair.
    let again = restarted.sync(&c.desired, None).unwrap();
    assert_eq!((again.services_written, again.map_operations), (0, 0));
    // A name changed while the proxy runs is repaired by the next walk (after a failed
    // sync: 20 more Services need 80 more frontends, the map holds 64), the port unchanged.
    restarted
        .maps_mut()
        .set_names(&[(
            id,
            nodeport_proxy::model::ServicePortName::new(
                "default",
                "other",
                "",
                nodeport_proxy::model::Protocol::Tcp,
            ),
        )])
        .unwrap();
    let many = Cluster::new(&format!(
        "{}\n---\n{}",
        web(&["10.244.1.5@node-a"]),
        nodeport_services(20, &["10.244.1.5@node-a"])
    ));
    assert!(restarted.sync(&many.desired, None).is_err());
    restarted.sync(&c.desired, None).unwrap();
    assert_eq!(
        names_of(restarted.maps()),
        [(id, "default/web:http/TCP".to_string())].into()
    );
}

#[test]
fn membership_entries_are_written_only_for_sets_the_programs_check_membership_of() {
    let Some((_programs, mut applier)) = applier("membership_entries_are_written_only") else {
        return;
    };
    // TCP without affinity: backends are only read by ordinal.
    let mut c = Cluster::new(&web(&["10.244.1.5@node-a", "10.244.2.7@node-b"]));
    applier.sync(&c.desired, None).unwrap();
    assert!(applier.maps().members().unwrap().is_empty());
    let fill = applier.entry_counts();
    assert!(fill.contains(&("np_members", 0)) && fill.contains(&("np_backends", 2)));
    // UDP: a flow's backend is checked against the current set at every packet.
    let backend: SocketAddr = "10.244.1.5:53".parse().unwrap();
    let changed = c.update(&dns(&[backend]));
    applier.sync(&c.desired, Some(&changed)).unwrap();
    let members = applier.maps().members().unwrap();
    assert_eq!(members.len(), 1, "{members:?}");
    assert_eq!(
        (members[0].0.1, members[0].0.2, members[0].1),
        (backend.ip(), 53, 1)
    );
    assert!(applier.entry_counts().contains(&("np_members", 1)));
    // Back to TCP: the UDP set and its membership go.
    let changed = c.update(&web(&["10.244.1.5@node-a"]));
    applier.sync(&c.desired, Some(&changed)).unwrap();
    assert!(applier.maps().members().unwrap().is_empty());
}

#[test]
fn backend_set_switches_racing_new_connections_never_show_a_half_written_service() {
    let Some((programs, mut applier)) = applier("backend_set_switches_racing_new_connections")
    else {
        return;
    };
    let a = web(&[
        "10.244.1.1@node-b",
        "10.244.1.2@node-b",
        "10.244.1.3@node-b",
    ]);
    let b = web(&["10.244.2.1@node-b", "10.244.2.2@node-b"]);
    let mut c = Cluster::new(&a);
    applier.sync(&c.desired, None).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut failures = Vec::new();
            let mut sent = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) || sent < 2000 {
                let sport = 10000 + (sent % 50000) as u16;
                let mut syn = Packet::new(TCP, "203.0.113.7", sport, "192.0.2.10", 30080);
                // A fresh client each time: no conntrack entry to follow.
                syn.src = IpAddr::from([203, 0, 113, (sent % 250) as u8 + 1]);
                let (verdict, out) = run_on(&programs, TC_INGRESS, &frame(&syn));
                let ok = verdict == TC_ACT_OK && {
                    let p = parse(&out);
                    p.dport == 8080 && p.dst.to_string().starts_with("10.244.")
                };
                if !ok {
                    failures.push((verdict, out));
                }
                sent += 1;
                if sent >= 20000 {
                    break;
                }
            }
            (sent, failures)
        })
    };
    let mut switches = 0;
    while !traffic.is_finished() && switches < 400 {
        let yaml = if switches % 2 == 0 { &b } else { &a };
        let changed = c.update(yaml);
        applier.sync(&c.desired, Some(&changed)).unwrap();
        switches += 1;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (sent, failures) = traffic.join().unwrap();
    assert!(
        switches >= 20,
        "only {switches} switches raced {sent} connections"
    );
    assert!(
        failures.is_empty(),
        "{} of {sent} connections failed: {:?}",
        failures.len(),
        &failures[..failures.len().min(3)]
    );
}

/// client (192.168.50.2, fd00:50::2) ⇄ node (eth0 192.168.50.1 and fd00:50::1, eth1
/// 10.244.1.1 and fd00:244:1::1, forwarding) ⇄ pod (10.244.1.5 and fd00:244:1::5, HTTP on 8080
/// and UDP echo on 5353), with the tc programs on both node interfaces.
struct Topology {
    client: Netns,
    node: Netns,
    _pod: Netns,
    _server: Server,
}

impl Topology {
    fn new(programs: &mut Programs) -> Self {
        let topo = Self::unattached();
        topo.node
            .enter(|| {
                programs.attach_tc("eth0").expect("tc on eth0");
                programs.attach_tc("eth1").expect("tc on eth1");
            })
            .unwrap();
        topo
    }

    /// The namespaces and the pod's server, without programs.
    fn unattached() -> Self {
        let client = Netns::new("ebpf-client").unwrap();
        let node = Netns::new("ebpf-node").unwrap();
        let pod = Netns::new("ebpf-pod").unwrap();
        veth(&client, "eth0", &node, "eth0").unwrap();
        veth(&node, "eth1", &pod, "eth0").unwrap();
        client.add_addr("eth0", "192.168.50.2/24").unwrap();
        node.add_addr("eth0", "192.168.50.1/24").unwrap();
        node.add_addr("eth1", "10.244.1.1/24").unwrap();
        pod.add_addr("eth0", "10.244.1.5/24").unwrap();
        client
            .run(&["ip", "route", "add", "default", "via", "192.168.50.1"])
            .unwrap();
        pod.run(&["ip", "route", "add", "default", "via", "10.244.1.1"])
            .unwrap();
        node.sysctl("net.ipv4.ip_forward", "1").unwrap();
        // IPv6 beside: client fd00:50::2, node fd00:50::1 and fd00:244:1::1, pod fd00:244:1::5.
        client.add_addr("eth0", "fd00:50::2/64").unwrap();
        node.add_addr("eth0", "fd00:50::1/64").unwrap();
        node.add_addr("eth1", "fd00:244:1::1/64").unwrap();
        pod.add_addr("eth0", "fd00:244:1::5/64").unwrap();
        client
            .run(&["ip", "-6", "route", "add", "default", "via", "fd00:50::1"])
            .unwrap();
        pod.run(&[
            "ip",
            "-6",
            "route",
            "add",
            "default",
            "via",
            "fd00:244:1::1",
        ])
        .unwrap();
        node.sysctl("net.ipv6.conf.all.forwarding", "1").unwrap();
        let server =
            Server::start_in(&pod, ServerConfig::http("pod-a", 8080).with_udp(5353)).unwrap();
        Topology {
            client,
            node,
            _pod: pod,
            _server: server,
        }
    }

    /// What the pod saw as the client of `GET /clientip` sent to `url` by the client.
    fn client_ip(&self, url: &str) -> String {
        self.client
            .run(&["curl", "-sS", "--max-time", "5", url])
            .unwrap_or_else(|e| panic!("curl {url}: {e}"))
    }
}

#[test]
fn a_bulk_tcp_stream_through_a_snated_nodeport_arrives_whole() {
    // A veth with TSO hands the node GSO packets of up to 64 KiB: the forwarding lookup must
    // not take their header length for one packet's (it did, failed the MTU check, and sent
    // them up the stack, which dropped them: a SNATed source is the node's own address).
    let test = "a_bulk_tcp_stream_through_a_snated_nodeport_arrives_whole";
    if !require_tools(test, &[]) {
        return;
    }
    let (mut programs, mut maps) = Programs::load(&sizes()).expect("the eBPF object loads");
    let topo = Topology::new(&mut programs);
    maps.set_flags(FLAG_FIB_FORWARD).unwrap();
    maps.set_snat_address(ip("192.168.50.1")).unwrap();
    let sink = BackendEntry {
        addr: ip("10.244.1.5"),
        port: 9000,
        remote: true,
    };
    maps.set_backend(1, 1, &sink).unwrap();
    let fe = Frontend {
        svc_id: 1,
        be_set: 1,
        count: 1,
        flags: 0,
        affinity_timeout: 0,
    };
    maps.set_frontend(&ext("192.168.50.1", 30090, TCP), &fe)
        .unwrap();
    let listener = topo
        ._pod
        .enter(|| std::net::TcpListener::bind(("10.244.1.5", 9000)))
        .unwrap()
        .unwrap();
    let reader = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        conn.set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        let mut n = 0usize;
        let mut buf = vec![0u8; 1 << 16];
        loop {
            match std::io::Read::read(&mut conn, &mut buf) {
                Ok(0) | Err(_) => return n,
                Ok(k) => n += k,
            }
        }
    });
    const BYTES: usize = 32 << 20;
    topo.client
        .enter(|| {
            let to: SocketAddr = "192.168.50.1:30090".parse().unwrap();
            let mut s =
                std::net::TcpStream::connect_timeout(&to, std::time::Duration::from_secs(2))
                    .expect("connect through the NodePort");
            s.set_write_timeout(Some(std::time::Duration::from_secs(10)))
                .unwrap();
            let chunk = vec![0x5au8; 1 << 16];
            for _ in 0..BYTES / chunk.len() {
                std::io::Write::write_all(&mut s, &chunk).expect("the stream keeps going");
            }
            s.shutdown(std::net::Shutdown::Write).unwrap();
        })
        .unwrap();
    assert_eq!(reader.join().unwrap(), BYTES);
}

#[test]
fn nodeports_are_served_through_veths_by_the_tc_programs() {
    let test = "nodeports_are_served_through_veths";
    if !require_tools(test, &["curl"]) {
        return;
    }
    let (mut programs, mut maps) = Programs::load(&sizes()).expect("the eBPF object loads");
    let topo = Topology::new(&mut programs);
    maps.set_flags(FLAG_FIB_FORWARD).unwrap();
    maps.set_snat_address(ip("192.168.50.1")).unwrap();
    let pod = BackendEntry {
        addr: ip("10.244.1.5"),
        port: 8080,
        remote: false,
    };
    let fe = |be_set| Frontend {
        svc_id: be_set,
        be_set,
        count: 1,
        flags: 0,
        affinity_timeout: 0,
    };
    // A local backend: DNAT only, the client's address kept; the reply is reversed by the
    // egress program on eth0.
    maps.set_backend(1, 1, &pod).unwrap();
    maps.set_frontend(&ext("192.168.50.1", 30080, TCP), &fe(1))
        .unwrap();
    let seen = topo.client_ip("http://192.168.50.1:30080/clientip");
    assert!(seen.starts_with("192.168.50.2:"), "the pod saw {seen}");
    // A remote backend: SNAT to the node too; the reply comes back to the node (ingress on
    // eth1) and is reversed there.
    maps.set_backend(
        2,
        1,
        &BackendEntry {
            remote: true,
            ..pod
        },
    )
    .unwrap();
    maps.set_frontend(&ext("192.168.50.1", 30081, TCP), &fe(2))
        .unwrap();
    let seen = topo.client_ip("http://192.168.50.1:30081/clientip");
    let port: u16 = seen
        .strip_prefix("192.168.50.1:")
        .unwrap_or_else(|| panic!("the pod saw {seen}, not the node"))
        .trim()
        .parse()
        .unwrap();
    assert!(port >= 32768, "SNAT port {port}");
    // No endpoints: refused by the ICMP port unreachable the program sends back.
    maps.set_frontend(
        &ext("192.168.50.1", 30082, TCP),
        &Frontend {
            flags: SVC_REJECT,
            count: 0,
            ..fe(3)
        },
    )
    .unwrap();
    let out = topo
        .client
        .command("curl")
        .args(["-sS", "--max-time", "5", "http://192.168.50.1:30082/"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(7),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    drop(topo.node);
}

#[test]
fn load_balancer_source_ranges_hold_for_sockets_a_source_inside_is_served_and_one_outside_not() {
    // kube-proxy's firewall chain drops every source outside loadBalancerSourceRanges,
    // processes of the node and pods included. A socket in the dataplane's cgroup (the
    // client namespace's process here, as a pod's) is translated by the socket hooks only
    // when its source is known to be inside the ranges (bound); any other connection is
    // left untranslated, and np_tc_ingress decides on its packets' source.
    let test = "load_balancer_source_ranges_hold_for_sockets";
    if !require_tools(test, &["curl"]) {
        return;
    }
    let (mut programs, mut maps) = Programs::load(&sizes()).expect("the eBPF object loads");
    let topo = Topology::new(&mut programs);
    let cgroup = TestCgroup::new(test);
    programs
        .attach_cgroup(&cgroup.0)
        .expect("attaching to the test cgroup");
    maps.set_flags(FLAG_FIB_FORWARD).unwrap();
    maps.set_snat_address(ip("192.168.50.1")).unwrap();
    maps.set_backend(1, 1, &local("10.244.1.5", 8080)).unwrap();
    // The load-balancer IP's two frontends as render writes them: external (tc, SNATed to
    // the node under the Cluster policy) and internal (sockets), both range-checked.
    for (scope, flags) in [
        (Scope::External, SVC_RANGES | SVC_SNAT),
        (Scope::Internal, SVC_RANGES),
    ] {
        let fe = Frontend {
            svc_id: 5,
            be_set: 1,
            count: 1,
            flags,
            affinity_timeout: 0,
        };
        let key = FrontendKey {
            scope,
            ..ext("203.0.113.10", 80, TCP)
        };
        maps.set_frontend(&key, &fe).unwrap();
    }
    maps.add_source_range(5, "192.168.50.2/32".parse().unwrap())
        .unwrap();
    // 192.168.50.3: a second client address, outside the ranges; unbound connections to the
    // load-balancer IP take it as their source.
    topo.client.add_addr("eth0", "192.168.50.3/24").unwrap();
    topo.client
        .run(&[
            "ip",
            "route",
            "add",
            "203.0.113.10",
            "via",
            "192.168.50.1",
            "src",
            "192.168.50.3",
        ])
        .unwrap();
    let curl = |bind: Option<&str>| {
        let bind = bind.map_or_else(String::new, |a| format!("--interface {a} "));
        cgroup.run(&format!(
            "ip netns exec {} curl -sS --max-time 3 {bind}http://203.0.113.10:80/clientip",
            topo.client.name()
        ))
    };
    // Bound inside the ranges: translated by the socket hook, so the pod sees the client
    // itself (tc would have SNATed it to the node).
    let out = curl(Some("192.168.50.2"));
    assert!(
        out.status.success(),
        "in range, bound: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with("192.168.50.2:"),
        "the pod saw {}",
        String::from_utf8_lossy(&out.stdout)
    );
    // Bound outside the ranges, and unbound with a source outside them: not served (tc drops
    // the SYNs; curl times out).
    for bind in [Some("192.168.50.3"), None] {
        let out = curl(bind);
        assert!(
            !out.status.success(),
            "a source outside the ranges ({bind:?}) was served: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    // Unbound with a source inside the ranges: the socket hook cannot know it and leaves the
    // connection to tc, which serves it (SNATed to the node, as external traffic under the
    // Cluster policy is).
    topo.client
        .run(&[
            "ip",
            "route",
            "replace",
            "203.0.113.10",
            "via",
            "192.168.50.1",
            "src",
            "192.168.50.2",
        ])
        .unwrap();
    let out = curl(None);
    assert!(
        out.status.success(),
        "in range, unbound: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with("192.168.50.1:"),
        "the pod saw {}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// A bpffs of the test's own on a temporary directory of the host's mount namespace (never
/// inside `ip netns exec`, whose private mounts die with it); on drop every pin in it is
/// removed (pinned links detach) and it is unmounted.
struct PinRoot(tempfile::TempDir);

impl PinRoot {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        nodeport_proxy::ebpf::programs::ensure_bpffs(dir.path()).expect("mounting bpffs");
        PinRoot(dir)
    }

    fn path(&self) -> &std::path::Path {
        self.0.path()
    }
}

impl Drop for PinRoot {
    fn drop(&mut self) {
        let _ = nodeport_proxy::ebpf::programs::remove_pins(self.0.path());
        let _ = nix::mount::umount(self.0.path());
    }
}

#[test]
fn a_restarted_dataplane_takes_its_pins_over_and_no_connection_fails() {
    let test = "a_restarted_dataplane_takes_its_pins_over";
    if !require_tools(test, &["curl"]) {
        return;
    }
    let pins = PinRoot::new();
    let topo = Topology::unattached();
    let facts = nodeport_proxy::nodeaddr::NodeFacts {
        node_ips: vec![ip("192.168.50.1")],
        local_ips: vec![ip("192.168.50.1"), ip("10.244.1.1")],
        ..Default::default()
    };
    let c = Cluster::on_node(&web(&["10.244.1.5@node-a"]), facts);
    let config = RenderConfig {
        fib_forward: true,
        ..Default::default()
    };
    let start = |pins: &std::path::Path| {
        let (mut programs, maps) = Programs::load_pinned(&sizes(), pins).expect("loading pinned");
        topo.node
            .enter(|| {
                programs.attach_tc_pinned("eth0", pins).expect("tc on eth0");
                programs.attach_tc_pinned("eth1", pins).expect("tc on eth1");
            })
            .unwrap();
        let mut applier = Applier::new(maps, config.clone());
        applier.sync(&c.desired, None).expect("sync");
        (programs, applier)
    };
    let url = "http://192.168.50.1:30080/clientip";
    let first = start(pins.path());
    // externalTrafficPolicy Cluster: the pod sees the node, as kube-proxy masquerades.
    assert!(topo.client_ip(url).starts_with("192.168.50.1:"));

    let stop = std::sync::atomic::AtomicBool::new(false);
    let (sent, failures) = std::thread::scope(|scope| {
        let traffic = scope.spawn(|| {
            let (mut sent, mut failures) = (0, Vec::new());
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let out = topo
                    .client
                    .command("curl")
                    .args(["-sS", "--max-time", "2", url])
                    .output()
                    .unwrap();
                sent += 1;
                if !out.status.success() {
                    failures.push(String::from_utf8_lossy(&out.stderr).into_owned());
                }
            }
            (sent, failures)
        });
        std::thread::sleep(std::time::Duration::from_millis(300));
        // The process goes away: its pinned links and maps keep serving.
        drop(first);
        std::thread::sleep(std::time::Duration::from_millis(300));
        // A new one takes the pins over: the same maps, its links in place of the old.
        let second = start(pins.path());
        std::thread::sleep(std::time::Duration::from_millis(300));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let result = traffic.join().unwrap();
        // The new process rewrote the Service under fresh set ids and swept the old.
        let frontends = second.1.maps().frontends().unwrap();
        let sets: std::collections::BTreeSet<u32> = second
            .1
            .maps()
            .backends()
            .unwrap()
            .iter()
            .map(|((set, _), _)| *set)
            .collect();
        assert!(frontends.iter().all(|(_, fe)| sets.contains(&fe.be_set)));
        assert_eq!(sets.len(), 1, "{sets:?}");
        result
    });
    assert!(sent >= 5, "only {sent} connections tried");
    assert!(
        failures.is_empty(),
        "{} of {sent} failed: {failures:?}",
        failures.len()
    );
    let links: Vec<String> = std::fs::read_dir(pins.path().join("links"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(links.len(), 4, "{links:?}");
}

#[test]
fn the_collector_expires_idle_connections_and_udp_ones_to_removed_backends() {
    let Some((programs, mut applier)) = applier("the_collector_expires_idle_connections") else {
        return;
    };
    let yaml = |eps: &[&str]| {
        web(eps).replace(
            "ports: [{name: http, port: 80, targetPort: 8080, nodePort: 30080}]",
            "ports: [{name: http, port: 80, targetPort: 8080, nodePort: 30080}, {name: dns, port: 53, protocol: UDP, targetPort: 5353}]",
        )
        .replace("ports: [{name: http, port: 8080}]", "ports: [{name: http, port: 8080}, {name: dns, port: 5353, protocol: UDP}]")
    };
    let mut c = Cluster::new(&yaml(&["10.244.1.5@node-a"]));
    applier.sync(&c.desired, None).unwrap();
    let tcp = Packet::new(TCP, "203.0.113.7", 40000, "10.96.0.10", 80);
    let udp = Packet::new(UDP, "203.0.113.7", 40001, "10.96.0.10", 53);
    assert_eq!(ingress_on(&programs, &tcp).dst, ip("10.244.1.5"));
    assert_eq!(ingress_on(&programs, &udp).dst, ip("10.244.1.5"));
    // The backend answers the TCP connection: it counts as established.
    let reply = Packet::new(TCP, "10.244.1.5", 8080, "203.0.113.7", 40000).flags(SYN | ACK);
    assert_eq!(run_on(&programs, TC_EGRESS, &frame(&reply)).0, TC_ACT_OK);
    let timeouts = Timeouts::default();
    let now = monotonic_now_ns();
    assert_eq!(
        applier.collect(now, &timeouts).unwrap(),
        0,
        "nothing is stale yet"
    );
    assert_eq!(applier.maps().conntrack().unwrap().len(), 2);

    // The endpoint goes away: its UDP flow is dropped at once (as kube-proxy clears UDP
    // conntrack entries), the TCP connection stays until it ends or idles out.
    let changed = c.update(&yaml(&["10.244.1.6@node-a"]));
    applier.sync(&c.desired, Some(&changed)).unwrap();
    assert_eq!(
        applier.collect(now, &timeouts).unwrap(),
        2,
        "the UDP flow, both ways"
    );
    let left: Vec<u8> = applier
        .maps()
        .conntrack()
        .unwrap()
        .iter()
        .map(|(t, _)| t.proto)
        .collect();
    assert_eq!(left, [TCP]);
    // Idle past the established-TCP timeout: gone too.
    let later = now + timeouts.tcp.as_nanos() as u64 + 1;
    assert_eq!(applier.collect(later, &timeouts).unwrap(), 2);
    assert!(applier.maps().conntrack().unwrap().is_empty());
    assert!(applier.maps().nat().unwrap().is_empty());
}

#[test]
fn a_node_dataplane_serves_nodeports_and_cluster_ips_from_desired_state() {
    let test = "a_node_dataplane_serves";
    if !require_tools(test, &["curl"]) {
        return;
    }
    let cgroup = TestCgroup::new(test);
    let pins = PinRoot::new();
    let topo = Topology::unattached();
    let facts = nodeport_proxy::nodeaddr::NodeFacts {
        node_ips: vec![ip("192.168.50.1"), ip("fd00:50::1")],
        local_ips: vec![
            ip("192.168.50.1"),
            ip("10.244.1.1"),
            ip("fd00:50::1"),
            ip("fd00:244:1::1"),
        ],
        ..Default::default()
    };
    let mut c = Cluster::on_node(&web(&["10.244.1.5@node-a"]), facts);
    let config = DataplaneConfig {
        sizes: sizes(),
        render: RenderConfig {
            fib_forward: true,
            ..Default::default()
        },
        pin_root: Some(pins.path().to_path_buf()),
        cgroup_root: Some(cgroup.0.clone()),
        ..Default::default()
    };
    let mut dataplane = topo
        .node
        .enter(|| {
            let mut d = Dataplane::start(config).expect("the dataplane starts");
            d.sync(&c.desired, None).expect("first sync");
            d
        })
        .unwrap();
    // tc went on the interface carrying the NodePort address (--nodeport-addresses primary)
    // and on the one towards the local pod, where the SNATed replies come back.
    assert_eq!(dataplane.interfaces(), ["eth0", "eth1"]);
    // externalTrafficPolicy Cluster: the pod sees the node, as kube-proxy masquerades.
    assert!(
        topo.client_ip("http://192.168.50.1:30080/clientip")
            .starts_with("192.168.50.1:")
    );
    // A process of the node in the dataplane's cgroup reaches the ClusterIP through the
    // socket programs (the shell joins the cgroup before `ip netns exec` remounts /sys).
    let out = cgroup.run(&format!(
        "ip netns exec {} curl -sS --max-time 5 http://10.96.0.10:80/clientip",
        topo.node.name()
    ));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with("10.244.1.1:"),
        "the pod saw {}",
        String::from_utf8_lossy(&out.stdout)
    );
    // A second pod appears behind a new interface: the next sync puts tc there too, and
    // both pods serve the NodePort.
    let pod2 = Netns::new("ebpf-pod2").unwrap();
    veth(&topo.node, "eth2", &pod2, "eth0").unwrap();
    topo.node.add_addr("eth2", "10.244.2.1/24").unwrap();
    pod2.add_addr("eth0", "10.244.2.5/24").unwrap();
    pod2.run(&["ip", "route", "add", "default", "via", "10.244.2.1"])
        .unwrap();
    let _server2 = Server::start_in(&pod2, ServerConfig::http("pod-b", 8080)).unwrap();
    let changed = c.update(&web(&["10.244.1.5@node-a", "10.244.2.5@node-a"]));
    topo.node
        .enter(|| {
            dataplane
                .sync(&c.desired, Some(&changed))
                .expect("second sync")
        })
        .unwrap();
    assert_eq!(dataplane.interfaces(), ["eth0", "eth1", "eth2"]);
    let mut pods = std::collections::BTreeSet::new();
    for _ in 0..40 {
        let out = topo
            .client
            .run(&[
                "curl",
                "-sS",
                "--max-time",
                "5",
                "http://192.168.50.1:30080/hostname",
            ])
            .unwrap();
        pods.insert(out.trim().to_string());
    }
    assert_eq!(pods, ["pod-a".to_string(), "pod-b".to_string()].into());
    let fill = dataplane.fill().unwrap();
    let services = fill.iter().find(|(m, _, _)| *m == "np_services").unwrap();
    assert_eq!((services.1, services.2), (4, sizes().services));
    // One name per service port and family, in a map half the frontends' size.
    let names = fill.iter().find(|(m, _, _)| *m == "np_svc_names").unwrap();
    assert_eq!((names.1, names.2), (1, sizes().services / 2));
    drop(dataplane);
}

#[test]
fn udp_and_ipv6_nodeports_are_served_through_veths() {
    let test = "udp_and_ipv6_nodeports_are_served_through_veths";
    if !require_tools(test, &["curl"]) {
        return;
    }
    let (mut programs, mut maps) = Programs::load(&sizes()).expect("the eBPF object loads");
    let topo = Topology::new(&mut programs);
    maps.set_flags(FLAG_FIB_FORWARD).unwrap();
    maps.set_snat_address(ip("192.168.50.1")).unwrap();
    maps.set_snat_address(ip("fd00:50::1")).unwrap();
    let fe = |be_set| Frontend {
        svc_id: be_set,
        be_set,
        count: 1,
        flags: 0,
        affinity_timeout: 0,
    };
    // UDP to a remote backend: SNATed to the node; the echo comes back to the client (`dd`
    // reads the one datagram in one read).
    maps.set_backend(1, 1, &remote("10.244.1.5", 5353)).unwrap();
    maps.set_frontend(&ext("192.168.50.1", 30053, UDP), &fe(1))
        .unwrap();
    let out = topo
        .client
        .run(&[
            "bash",
            "-c",
            "exec 3<>/dev/udp/192.168.50.1/30053; printf ping >&3; exec timeout 5 dd bs=512 count=1 status=none <&3",
        ])
        .expect("a UDP answer through the NodePort");
    assert!(
        out.starts_with("pod-a 192.168.50.1:"),
        "the pod answered {out:?}"
    );

    // IPv6, a local backend (the client's address kept) and a remote one (SNATed).
    maps.set_backend(2, 1, &local("fd00:244:1::5", 8080))
        .unwrap();
    maps.set_frontend(&ext("fd00:50::1", 30080, TCP), &fe(2))
        .unwrap();
    let seen = topo.client_ip("http://[fd00:50::1]:30080/clientip");
    assert!(seen.contains("fd00:50::2"), "the pod saw {seen}");
    maps.set_backend(3, 1, &remote("fd00:244:1::5", 8080))
        .unwrap();
    maps.set_frontend(&ext("fd00:50::1", 30081, TCP), &fe(3))
        .unwrap();
    let seen = topo.client_ip("http://[fd00:50::1]:30081/clientip");
    assert!(seen.contains("fd00:50::1"), "the pod saw {seen}");
}

#[test]
fn an_unconnected_udp_socket_sends_to_a_cluster_ip_and_sees_answers_from_it() {
    let test = "cluster_ip_udp_sendto";
    let Some(mut progs) = load(test) else {
        return;
    };
    assert!(require_tools(test, &["python3"]));
    let cgroup = TestCgroup::new(test);
    progs
        .programs
        .attach_cgroup(&cgroup.0)
        .expect("attaching to the test cgroup");
    for (vip, listen, family) in [
        ("10.96.0.13", "127.0.0.1:0", "AF_INET"),
        ("fd00:96::13", "[::1]:0", "AF_INET6"),
    ] {
        let backend = std::net::UdpSocket::bind(listen).unwrap();
        backend
            .set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        let addr = backend.local_addr().unwrap();
        service(
            &mut progs,
            internal(vip, 53, UDP),
            4,
            4,
            0,
            &[local(&addr.ip().to_string(), addr.port())],
        );
        let server = std::thread::spawn(move || {
            let mut buf = [0u8; 64];
            let (n, from) = backend
                .recv_from(&mut buf)
                .expect("a datagram at the backend");
            backend.send_to(&buf[..n], from).unwrap();
        });
        // sendto() goes through sendmsg4/6 (to the backend), recvfrom() through
        // recvmsg4/6, which shows the answer as coming from the service address.
        let out = cgroup.run(&format!(
            "python3 -c 'import socket; s = socket.socket(socket.{family}, socket.SOCK_DGRAM); \
             s.settimeout(5); s.sendto(b\"ping\", (\"{vip}\", 53)); d, a = s.recvfrom(512); \
             print(d.decode(), a[0], a[1])'"
        ));
        server.join().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            format!("ping {vip} 53")
        );
    }
}

#[test]
fn a_udp_flow_leaves_a_removed_backend_at_its_next_packet_while_tcp_stays() {
    let Some(mut progs) = load("a_udp_flow_leaves_a_removed_backend") else {
        return;
    };
    for proto in [UDP, TCP] {
        service(
            &mut progs,
            ext("192.168.1.10", 30053, proto),
            1,
            1,
            0,
            &[local("10.244.1.5", 53)],
        );
    }
    let udp = Packet::new(UDP, "203.0.113.7", 40000, "192.168.1.10", 30053);
    let tcp = Packet::new(TCP, "203.0.113.7", 40000, "192.168.1.10", 30053);
    assert_eq!(ingress(&progs, &udp).dst, ip("10.244.1.5"));
    assert_eq!(ingress(&progs, &tcp).dst, ip("10.244.1.5"));
    // The endpoint is replaced (a fresh set without it, as the applier writes it).
    for proto in [UDP, TCP] {
        service(
            &mut progs,
            ext("192.168.1.10", 30053, proto),
            1,
            2,
            0,
            &[local("10.244.1.6", 53)],
        );
    }
    assert_eq!(ingress(&progs, &udp).dst, ip("10.244.1.6"));
    assert_eq!(
        ingress(&progs, &tcp.clone().flags(ACK)).dst,
        ip("10.244.1.5")
    );
}

#[test]
fn a_udp_socket_connected_to_a_removed_backend_is_closed() {
    use std::io::{BufRead, Write};
    let test = "a_udp_socket_connected_to_a_removed_backend";
    let Some(mut progs) = load(test) else {
        return;
    };
    assert!(require_tools(test, &["python3"]));
    let cgroup = TestCgroup::new(test);
    progs
        .programs
        .attach_cgroup(&cgroup.0)
        .expect("attaching to the test cgroup");
    let backend = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    backend
        .set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    let addr = backend.local_addr().unwrap();
    service(
        &mut progs,
        internal("10.96.0.14", 53, UDP),
        5,
        5,
        0,
        &[local("127.0.0.1", addr.port())],
    );
    let server = std::thread::spawn(move || {
        let mut buf = [0u8; 64];
        let (n, from) = backend
            .recv_from(&mut buf)
            .expect("a datagram at the backend");
        backend.send_to(&buf[..n], from).unwrap();
    });
    let script = "import socket, sys\n\
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
        s.connect(('10.96.0.14', 53)); s.send(b'ping'); print(s.recv(64).decode(), flush=True)\n\
        sys.stdin.readline(); s.settimeout(5)\n\
        try:\n    s.recv(64); print('still open')\n\
        except OSError as e:\n    print('closed', e.errno)\n";
    let procs = cgroup.0.join("cgroup.procs");
    let mut child = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "echo $$ > {} && exec python3 -c \"$0\"",
            procs.display()
        ))
        .arg(script)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "ping");
    server.join().unwrap();
    // The backend leaves: its connected sockets are closed.
    let closed = nodeport_proxy::ebpf::sockets::destroy_in_cgroup(&cgroup.0, &[addr].into())
        .expect("SOCK_DIAG destroy");
    assert_eq!(closed, 1);
    writeln!(child.stdin.take().unwrap()).unwrap();
    // ECONNABORTED.
    assert_eq!(lines.next().unwrap().unwrap(), "closed 103");
    child.wait().unwrap();
}

/// A ClusterIP UDP Service `dns` (10.96.0.15:53) with endpoints `ip:port` on node-a.
fn dns(endpoints: &[SocketAddr]) -> String {
    let eps: Vec<String> = endpoints
        .iter()
        .map(|e| format!("- {{addresses: [{}], nodeName: node-a}}", e.ip()))
        .collect();
    let port = endpoints.first().map_or(53, |e| e.port());
    format!(
        r#"
apiVersion: v1
kind: Service
metadata: {{name: web, namespace: default}}
spec:
  clusterIP: 10.96.0.15
  ports: [{{name: dns, port: 53, protocol: UDP}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: web-1, namespace: default, labels: {{kubernetes.io/service-name: web}}}}
addressType: IPv4
ports: [{{name: dns, port: {port}, protocol: UDP}}]
endpoints:
{}
"#,
        if eps.is_empty() {
            "  []".to_string()
        } else {
            eps.join("\n")
        }
    )
}

#[test]
fn the_dataplane_closes_udp_sockets_of_a_backend_that_left_in_every_namespace_of_its_cgroup() {
    use std::io::{BufRead, Write};
    let test = "the_dataplane_closes_udp_sockets";
    if !require_tools(test, &["python3"]) {
        return;
    }
    let cgroup = TestCgroup::new(test);
    // The dataplane runs in a namespace of its own; the client in the test's (the cgroup's
    // processes may live in any namespace, as pods do).
    let node = Netns::new("ebpf-udpclose").unwrap();
    let backend = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    backend
        .set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    let addr = backend.local_addr().unwrap();
    let mut c = Cluster::new(&dns(&[addr]));
    let config = DataplaneConfig {
        sizes: sizes(),
        cgroup_root: Some(cgroup.0.clone()),
        ..Default::default()
    };
    let mut dataplane = node
        .enter(|| {
            let mut d = Dataplane::start(config).expect("the dataplane starts");
            d.sync(&c.desired, None).expect("first sync");
            d
        })
        .unwrap();
    let server = std::thread::spawn(move || {
        let mut buf = [0u8; 64];
        let (n, from) = backend
            .recv_from(&mut buf)
            .expect("a datagram at the backend");
        backend.send_to(&buf[..n], from).unwrap();
    });
    let script = "import socket, sys\n\
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
        s.connect(('10.96.0.15', 53)); s.send(b'ping'); print(s.recv(64).decode(), flush=True)\n\
        sys.stdin.readline(); s.settimeout(5)\n\
        try:\n    s.recv(64); print('still open')\n\
        except OSError as e:\n    print('closed', e.errno)\n";
    let mut child = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "echo $$ > {} && exec python3 -c \"$0\"",
            cgroup.0.join("cgroup.procs").display()
        ))
        .arg(script)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "ping");
    server.join().unwrap();
    // The endpoint is replaced: the sync closes the socket still connected to the old one.
    let moved = SocketAddr::new(ip("127.0.0.2"), addr.port());
    let changed = c.update(&dns(&[moved]));
    node.enter(|| dataplane.sync(&c.desired, Some(&changed)).expect("sync"))
        .unwrap();
    writeln!(child.stdin.take().unwrap()).unwrap();
    assert_eq!(lines.next().unwrap().unwrap(), "closed 103", "ECONNABORTED");
    child.wait().unwrap();
    drop(dataplane);
}

/// `nodeport trace --live` in the ebpf mode: while the deadline a tracer set lies ahead,
/// `np_tc_ingress` records the decision it takes for each new connection (translated,
/// rejected, dropped for no endpoints or for the source ranges), not for a connection's
/// later packets; before the deadline is set, and after it is withdrawn, nothing.
#[test]
fn while_a_tracer_asks_the_tc_program_reports_each_new_connections_decision() {
    use nodeport_proxy::ebpf::trace_events::{EventKind, TraceEvent, TraceEvents};
    let Some(mut progs) = load("while_a_tracer_asks_the_tc_program_reports") else {
        return;
    };
    service(
        &mut progs,
        ext("192.168.1.10", 30080, TCP),
        1,
        1,
        0,
        &[local("10.244.1.5", 8080)],
    );
    service(
        &mut progs,
        ext("192.168.1.10", 30090, TCP),
        2,
        2,
        SVC_REJECT,
        &[],
    );
    service(
        &mut progs,
        ext("192.168.1.10", 30091, TCP),
        3,
        3,
        SVC_DROP,
        &[],
    );
    service(
        &mut progs,
        ext("198.51.100.200", 80, TCP),
        6,
        4,
        SVC_RANGES,
        &[local("10.244.1.5", 8080)],
    );
    progs
        .add_source_range(6, "203.0.113.0/24".parse().unwrap())
        .unwrap();
    let mut events = TraceEvents::take(&mut progs.maps).unwrap();
    let syn = |sport, dst: &str, dport| Packet::new(TCP, "203.0.113.7", sport, dst, dport);
    // What one packet made the programs record.
    let after = |events: &TraceEvents, send: &dyn Fn()| -> Vec<TraceEvent> {
        let t0 = monotonic_now_ns();
        send();
        events.since(t0)
    };

    let none = after(&events, &|| {
        ingress(&progs, &syn(40000, "192.168.1.10", 30080));
    });
    assert_eq!(none, [], "no tracer asked");

    let deadline = monotonic_now_ns() + 60_000_000_000;
    events.report_until(deadline).unwrap();
    let first = syn(40001, "192.168.1.10", 30080);
    let got = after(&events, &|| {
        ingress(&progs, &first);
    });
    let [e] = got.as_slice() else {
        panic!("one translation: {got:?}")
    };
    assert_eq!(e.kind, EventKind::Dnat);
    assert_eq!(e.svc_id, 1);
    assert_eq!(
        (e.tuple.saddr, e.tuple.sport, e.tuple.daddr, e.tuple.dport),
        (ip("203.0.113.7"), 40001, ip("192.168.1.10"), 30080)
    );
    assert_eq!(e.to, Some("10.244.1.5:8080".parse().unwrap()));
    assert_eq!(e.flags & u16::from(CT_SNAT), 0);
    // The connection's next packet is no new decision.
    let next = after(&events, &|| {
        ingress(&progs, &first.clone().flags(ACK));
    });
    assert_eq!(next, []);

    for (packet, kind, svc) in [
        (syn(40002, "192.168.1.10", 30090), EventKind::Reject, 2),
        (
            syn(40003, "192.168.1.10", 30091),
            EventKind::DropNoEndpoints,
            3,
        ),
        (
            Packet::new(TCP, "192.0.2.7", 40004, "198.51.100.200", 80),
            EventKind::DropSource,
            6,
        ),
    ] {
        let got = after(&events, &|| {
            run(&progs, TC_INGRESS, &frame(&packet));
        });
        let [e] = got.as_slice() else {
            panic!("{kind:?}: {got:?}")
        };
        assert_eq!((e.kind, e.svc_id, e.to), (kind, svc, None), "{packet:?}");
        assert_eq!(e.tuple.sport, packet.sport);
    }

    events.stop(deadline).unwrap();
    let withdrawn = after(&events, &|| {
        ingress(&progs, &syn(40005, "192.168.1.10", 30080));
    });
    assert_eq!(withdrawn, [], "the tracer withdrew its deadline");
}

/// An ICMP (ICMPv6) error from `from` to `to`, of `type_code`, quoting the IP packet of
/// `quoted` (a frame: its Ethernet header is left out), every checksum valid.
fn icmp_error(from: &str, to: &str, type_code: (u8, u8), quoted: &[u8]) -> Vec<u8> {
    let (from, to) = (ip(from), ip(to));
    let mut icmp = vec![type_code.0, type_code.1, 0, 0, 0, 0, 0, 0];
    icmp.extend_from_slice(&quoted[14..]);
    let mut out = Vec::new();
    out.extend_from_slice(&NODE_MAC);
    out.extend_from_slice(&CLIENT_MAC);
    match (from, to) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let c = fold(sum16(&icmp, 0));
            icmp[2..4].copy_from_slice(&c.to_be_bytes());
            out.extend_from_slice(&0x0800u16.to_be_bytes());
            let mut h = vec![0x45, 0xc0];
            h.extend_from_slice(&((20 + icmp.len()) as u16).to_be_bytes());
            h.extend_from_slice(&[0, 0, 0, 0, 64, 1, 0, 0]);
            h.extend_from_slice(&s.octets());
            h.extend_from_slice(&d.octets());
            let c = fold(sum16(&h, 0));
            h[10..12].copy_from_slice(&c.to_be_bytes());
            out.extend_from_slice(&h);
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let c = fold(sum16(&icmp, pseudo(from, to, 58, icmp.len())));
            icmp[2..4].copy_from_slice(&c.to_be_bytes());
            out.extend_from_slice(&0x86ddu16.to_be_bytes());
            out.extend_from_slice(&[0x60, 0, 0, 0]);
            out.extend_from_slice(&(icmp.len() as u16).to_be_bytes());
            out.extend_from_slice(&[58, 64]);
            out.extend_from_slice(&s.octets());
            out.extend_from_slice(&d.octets());
        }
        _ => panic!("mixed families"),
    }
    out.extend_from_slice(&icmp);
    out
}

/// Reads an ICMP (ICMPv6) error back, asserting the outer checksums and the quoted packet's
/// (IP header and UDP checksum): its source, destination, type and code, and the quoted
/// packet.
#[track_caller]
fn read_icmp_error(f: &[u8]) -> (IpAddr, IpAddr, (u8, u8), Packet) {
    let ethertype = u16::from_be_bytes([f[12], f[13]]);
    let (src, dst, icmp) = match ethertype {
        0x0800 => {
            let h = &f[14..34];
            assert_eq!(fold(sum16(h, 0)), 0, "outer IPv4 header checksum");
            assert_eq!(h[9], 1, "ICMP");
            let s: [u8; 4] = h[12..16].try_into().unwrap();
            let d: [u8; 4] = h[16..20].try_into().unwrap();
            let icmp = &f[34..];
            assert_eq!(fold(sum16(icmp, 0)), 0, "ICMP checksum");
            (IpAddr::from(s), IpAddr::from(d), icmp)
        }
        0x86dd => {
            let h = &f[14..54];
            assert_eq!(h[6], 58, "ICMPv6");
            let s: [u8; 16] = h[8..24].try_into().unwrap();
            let d: [u8; 16] = h[24..40].try_into().unwrap();
            let (s, d) = (IpAddr::from(s), IpAddr::from(d));
            let icmp = &f[54..];
            assert_eq!(
                fold(sum16(icmp, pseudo(s, d, 58, icmp.len()))),
                0,
                "ICMPv6 checksum"
            );
            (s, d, icmp)
        }
        other => panic!("ethertype {other:#x}"),
    };
    let mut quoted = f[..14].to_vec();
    quoted.extend_from_slice(&icmp[8..]);
    (src, dst, (icmp[0], icmp[1]), parse(&quoted))
}

#[test]
fn icmp_errors_about_a_snated_udp_flow_reach_each_end_translated_in_both_families() {
    let Some(mut progs) = load("icmp_errors_about_a_snated_udp_flow") else {
        return;
    };
    for (node, vip, backend, client, router, unreachable) in [
        (
            "192.168.1.10",
            "198.51.100.200",
            "10.244.2.7",
            "203.0.113.7",
            "10.244.0.254",
            (3, 3),
        ),
        (
            "fd00:1::10",
            "fd00:1::200",
            "fd00:244:2::7",
            "2001:db8::7",
            "fd00:244::fe",
            (1, 4),
        ),
    ] {
        progs.set_snat_address(ip(node)).unwrap();
        let set = if ip(node).is_ipv4() { 5 } else { 6 };
        service(
            &mut progs,
            ext(vip, 53, UDP),
            set,
            set,
            0,
            &[remote(backend, 5353)],
        );
        let query = Packet::new(UDP, client, 40000, vip, 53);
        let sent = frame(&query);
        let (_, forwarded) = run(&progs, TC_INGRESS, &sent);
        let out = parse(&forwarded);
        assert_eq!((out.src, out.dst), (ip(node), ip(backend)));

        // The backend's stack has no listener: its port unreachable quotes the packet as it
        // arrived (from the node's SNAT port); the client gets it from the service address,
        // quoting its own packet.
        let err = icmp_error(backend, node, unreachable, &forwarded);
        let (verdict, back) = run(&progs, TC_INGRESS, &err);
        assert_eq!(verdict, TC_ACT_OK);
        let (src, dst, kind, quoted) = read_icmp_error(&back);
        assert_eq!((src, dst, kind), (ip(vip), ip(client), unreachable));
        assert_eq!(quoted, query, "the client's own datagram is quoted");

        // A router on the way to the backend keeps its own address.
        let err = icmp_error(router, node, unreachable, &forwarded);
        let (_, back) = run(&progs, TC_INGRESS, &err);
        let (src, dst, _, quoted) = read_icmp_error(&back);
        assert_eq!((src, dst), (ip(router), ip(client)));
        assert_eq!(quoted, query);

        // The other way: the client refuses the backend's answer; the backend hears it from
        // the node, about the answer it sent.
        let answer = Packet::new(UDP, backend, 5353, node, out.sport);
        let (_, reversed) = run(&progs, TC_INGRESS, &frame(&answer));
        let err = icmp_error(client, vip, unreachable, &reversed);
        let (verdict, back) = run(&progs, TC_INGRESS, &err);
        assert_eq!(verdict, TC_ACT_OK);
        let (src, dst, kind, quoted) = read_icmp_error(&back);
        assert_eq!((src, dst, kind), (ip(node), ip(backend), unreachable));
        assert_eq!(quoted, answer, "the backend's own datagram is quoted");
    }
}

#[test]
fn an_icmp_error_about_no_known_connection_passes_untouched() {
    let Some(progs) = load("an_icmp_error_about_no_known_connection") else {
        return;
    };
    let stray = frame(&Packet::new(UDP, "192.168.1.10", 41000, "10.244.2.7", 53));
    let err = icmp_error("10.244.2.7", "192.168.1.10", (3, 3), &stray);
    let (verdict, out) = run(&progs, TC_INGRESS, &err);
    assert_eq!((verdict, out), (TC_ACT_OK, err.clone()));
    let (verdict, out) = run(&progs, TC_EGRESS, &err);
    assert_eq!((verdict, out), (TC_ACT_OK, err));
}

/// The NodePort topology with UDP frontends on the node's addresses of both families:
/// `port` → `backend_port` on the pod, SNATed to the node (`SVC_SNAT`, the Cluster policy)
/// or not (a local backend under the Local policy: the client's address kept).
fn udp_nodeports(test: &str, frontends: &[(u16, u16, u16)]) -> Option<(Programs, Maps, Topology)> {
    if !require_tools(test, &[]) {
        return None;
    }
    let (mut programs, mut maps) = Programs::load(&sizes()).expect("the eBPF object loads");
    let topo = Topology::new(&mut programs);
    maps.set_flags(FLAG_FIB_FORWARD).unwrap();
    maps.set_snat_address(ip("192.168.50.1")).unwrap();
    maps.set_snat_address(ip("fd00:50::1")).unwrap();
    let mut set = 0;
    for (node, pod) in [
        ("192.168.50.1", "10.244.1.5"),
        ("fd00:50::1", "fd00:244:1::5"),
    ] {
        for &(port, backend_port, flags) in frontends {
            set += 1;
            maps.set_backend(set, 1, &local(pod, backend_port)).unwrap();
            let fe = Frontend {
                svc_id: set,
                be_set: set,
                count: 1,
                flags,
                affinity_timeout: 0,
            };
            maps.set_frontend(&ext(node, port, UDP), &fe).unwrap();
        }
    }
    Some((programs, maps, topo))
}

/// A connected UDP socket of the client: sends `payload` to `to`, and what its next receive
/// gives within two seconds.
fn udp_exchange(topo: &Topology, to: &str, payload: &[u8]) -> std::io::Result<Vec<u8>> {
    let to: SocketAddr = to.parse().unwrap();
    topo.client
        .enter(|| {
            let any: SocketAddr = if to.is_ipv4() {
                "0.0.0.0:0".parse().unwrap()
            } else {
                "[::]:0".parse().unwrap()
            };
            let s = std::net::UdpSocket::bind(any)?;
            s.connect(to)?;
            s.set_read_timeout(Some(std::time::Duration::from_secs(2)))?;
            s.send(payload)?;
            let mut buf = vec![0u8; 65536];
            let n = s.recv(&mut buf)?;
            buf.truncate(n);
            Ok(buf)
        })
        .unwrap()
}

/// [`udp_exchange`], tried again (up to three times) while nothing at all comes back: the
/// first IPv6 datagrams after the topology is made can wait for neighbour discovery (the
/// veths' link-local addresses are still tentative) longer than an exchange's two seconds.
fn udp_exchange_settled(topo: &Topology, to: &str, payload: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut r = udp_exchange(topo, to, payload);
    for _ in 0..2 {
        match &r {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                r = udp_exchange(topo, to, payload);
            }
            _ => break,
        }
    }
    r
}

#[test]
fn a_udp_nodeport_whose_backend_has_no_listener_is_refused_at_the_client() {
    // The pod's stack answers with port unreachable, to the node (SNATed) or to the client
    // (its address kept); either way the client's socket, connected to the NodePort, must
    // hear it from there: ECONNREFUSED, as through kube-proxy's NAT.
    let Some((_programs, _maps, topo)) = udp_nodeports(
        "a_udp_nodeport_whose_backend_has_no_listener",
        &[(30053, 5999, SVC_SNAT), (30054, 5999, 0)],
    ) else {
        return;
    };
    for to in [
        "192.168.50.1:30053",
        "192.168.50.1:30054",
        "[fd00:50::1]:30053",
        "[fd00:50::1]:30054",
    ] {
        let r = udp_exchange_settled(&topo, to, b"anyone?");
        assert_eq!(
            r.as_ref().map_err(std::io::Error::kind).err(),
            Some(std::io::ErrorKind::ConnectionRefused),
            "{to}: {r:?}"
        );
    }
}

#[test]
fn a_datagram_too_big_for_the_backends_link_gets_fragmentation_needed_from_the_nodeport() {
    // The node's link to the pod carries 1280 bytes; the client's, 1500. A 1400-byte datagram
    // (DF set: Linux's default path MTU discovery) translated at the node cannot go on: the
    // client must hear "fragmentation needed" (ICMPv6 "packet too big") about its own
    // datagram, from the NodePort address, and lower its path MTU (EMSGSIZE on the socket).
    // (The path MTU is learnt per destination address: one frontend per family.)
    let Some((_programs, _maps, topo)) = udp_nodeports(
        "a_datagram_too_big_for_the_backends_link",
        &[(30053, 5353, SVC_SNAT)],
    ) else {
        return;
    };
    topo.node
        .run(&["ip", "link", "set", "dev", "eth1", "mtu", "1280"])
        .unwrap();
    topo._pod
        .run(&["ip", "link", "set", "dev", "eth0", "mtu", "1280"])
        .unwrap();
    for to in ["192.168.50.1:30053", "[fd00:50::1]:30053"] {
        // A small datagram first: neighbours resolved, the path known to work.
        let small = udp_exchange_settled(&topo, to, b"small");
        assert!(small.is_ok(), "{to}: {small:?}");
        let r = udp_exchange(&topo, to, &[0x5a; 1400]);
        assert_eq!(
            r.as_ref().err().and_then(std::io::Error::raw_os_error),
            Some(libc::EMSGSIZE),
            "{to}: {r:?}"
        );
    }
    let mtu = topo
        .client
        .enter(|| {
            let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
            s.connect("192.168.50.1:30053").unwrap();
            nix::sys::socket::getsockopt(&s, nix::sys::socket::sockopt::IpMtu).unwrap()
        })
        .unwrap();
    assert_eq!(mtu, 1280, "the path MTU the client learnt");
}

/// Splits a frame's IP packet into fragments of at most `chunk` payload bytes (a multiple of
/// 8), as the sender's stack does: IPv4 with the MF flag and offset in its header, IPv6 with
/// a fragment header; every IPv4 header checksum valid.
fn fragments(f: &[u8], id: u32, chunk: usize) -> Vec<Vec<u8>> {
    let v4 = u16::from_be_bytes([f[12], f[13]]) == 0x0800;
    let hlen = if v4 { 20 } else { 40 };
    let header = &f[14..14 + hlen];
    let payload = &f[14 + hlen..];
    let mut out = Vec::new();
    for (i, part) in payload.chunks(chunk).enumerate() {
        let offset = i * chunk;
        let more = offset + part.len() < payload.len();
        let mut frame = f[..14].to_vec();
        let mut h = header.to_vec();
        if v4 {
            h[2..4].copy_from_slice(&((20 + part.len()) as u16).to_be_bytes());
            h[4..6].copy_from_slice(&(id as u16).to_be_bytes());
            let flags = (offset / 8) as u16 | if more { 0x2000 } else { 0 };
            h[6..8].copy_from_slice(&flags.to_be_bytes());
            h[10..12].copy_from_slice(&[0, 0]);
            let c = fold(sum16(&h, 0));
            h[10..12].copy_from_slice(&c.to_be_bytes());
            frame.extend_from_slice(&h);
        } else {
            let next = h[6];
            h[4..6].copy_from_slice(&((8 + part.len()) as u16).to_be_bytes());
            h[6] = 44;
            frame.extend_from_slice(&h);
            frame.extend_from_slice(&[next, 0]);
            let off = (offset as u16) | u16::from(more);
            frame.extend_from_slice(&off.to_be_bytes());
            frame.extend_from_slice(&id.to_be_bytes());
        }
        frame.extend_from_slice(part);
        out.push(frame);
    }
    out
}

/// The source and destination addresses of a frame, and the IPv4 header checksum checked.
#[track_caller]
fn addresses(f: &[u8]) -> (IpAddr, IpAddr) {
    if u16::from_be_bytes([f[12], f[13]]) == 0x0800 {
        let h = &f[14..34];
        assert_eq!(fold(sum16(h, 0)), 0, "IPv4 header checksum");
        let s: [u8; 4] = h[12..16].try_into().unwrap();
        let d: [u8; 4] = h[16..20].try_into().unwrap();
        (IpAddr::from(s), IpAddr::from(d))
    } else {
        let s: [u8; 16] = f[22..38].try_into().unwrap();
        let d: [u8; 16] = f[38..54].try_into().unwrap();
        (IpAddr::from(s), IpAddr::from(d))
    }
}

#[test]
fn the_fragments_of_a_udp_datagram_follow_the_first_ones_translation_in_both_families() {
    let Some(mut progs) = load("the_fragments_of_a_udp_datagram") else {
        return;
    };
    for (node, backend, client, set) in [
        ("192.168.1.10", "10.244.2.7", "203.0.113.7", 1),
        ("fd00:1::10", "fd00:244:2::7", "2001:db8::7", 2),
    ] {
        progs.set_snat_address(ip(node)).unwrap();
        service(
            &mut progs,
            ext(node, 30053, UDP),
            set,
            set,
            SVC_SNAT,
            &[local(backend, 5353)],
        );
        let mut query = Packet::new(UDP, client, 40000, node, 30053);
        query.payload = (0..3000u32).map(|i| (i % 251) as u8).collect();
        let whole = frame(&query);
        let parts = fragments(&whole, 0x4242, 1232);
        assert_eq!(parts.len(), 3);
        // A later fragment before the first: nothing known, not translated.
        let (verdict, early) = run(&progs, TC_INGRESS, &parts[1]);
        assert_eq!((verdict, &early), (TC_ACT_OK, &parts[1]));

        let mut out = Vec::new();
        for part in &parts {
            let (verdict, f) = run(&progs, TC_INGRESS, part);
            assert_eq!(verdict, TC_ACT_OK);
            assert_eq!(
                addresses(&f),
                (ip(node), ip(backend)),
                "every fragment SNATed and DNATed"
            );
            out.push(f);
        }
        // Reassembled, the datagram is the client's with the translated addresses and ports,
        // its UDP checksum (in the first fragment) valid over the whole of it.
        let hlen = if query.src.is_ipv4() { 20 } else { 48 };
        let mut l4 = Vec::new();
        for f in &out {
            l4.extend_from_slice(&f[14 + hlen..]);
        }
        let mut joined = frame(&Packet::new(UDP, node, 0, backend, 0));
        let base = if query.src.is_ipv4() { 34 } else { 54 };
        joined.truncate(base);
        if query.src.is_ipv4() {
            joined[16..18].copy_from_slice(&((20 + l4.len()) as u16).to_be_bytes());
            joined[24..26].copy_from_slice(&[0, 0]);
            let c = fold(sum16(&joined[14..34], 0));
            joined[24..26].copy_from_slice(&c.to_be_bytes());
        } else {
            joined[18..20].copy_from_slice(&(l4.len() as u16).to_be_bytes());
        }
        joined.extend_from_slice(&l4);
        let got = parse(&joined);
        assert_eq!(
            (got.dport, got.payload.clone()),
            (5353, query.payload.clone())
        );
        assert!(got.sport >= 32768, "the SNAT port: {}", got.sport);
    }
}

/// A UDP echo server in the pod on `port` (both families), for datagrams of any size.
fn udp_echo(topo: &Topology, port: u16) -> std::net::UdpSocket {
    let s = topo
        ._pod
        .enter(|| std::net::UdpSocket::bind(("::", port)))
        .unwrap()
        .unwrap();
    let echo = s.try_clone().unwrap();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 65536];
        while let Ok((n, from)) = echo.recv_from(&mut buf) {
            let _ = echo.send_to(&buf[..n], from);
        }
    });
    s
}

#[test]
fn a_udp_datagram_larger_than_the_mtu_crosses_a_nodeport_in_fragments_both_ways() {
    // 3000 bytes over links of 1500: the client's stack sends three fragments, the pod's
    // answers in three; the node translates every one of them (SNATed and not).
    let Some((_programs, _maps, topo)) = udp_nodeports(
        "a_udp_datagram_larger_than_the_mtu",
        &[(30053, 7000, SVC_SNAT), (30054, 7000, 0)],
    ) else {
        return;
    };
    let _echo = udp_echo(&topo, 7000);
    let big: Vec<u8> = (0..3000u32).map(|i| (i % 253) as u8).collect();
    for to in [
        "192.168.50.1:30053",
        "192.168.50.1:30054",
        "[fd00:50::1]:30053",
        "[fd00:50::1]:30054",
    ] {
        // Neighbours first (the first datagram may wait for them longer than two seconds).
        let small = (0..3)
            .map(|_| udp_exchange(&topo, to, b"small"))
            .find(Result::is_ok);
        assert!(small.is_some(), "{to}: no answer to a small datagram");
        let r = udp_exchange(&topo, to, &big);
        assert_eq!(
            r.as_ref().ok(),
            Some(&big),
            "{to}: {:?}",
            r.as_ref().map(Vec::len)
        );
    }
}

/// (key, value) pairs of `np_ct`'s layout: 40-byte keys, 56-byte values, both derived from `i`.
fn ct_entries(range: std::ops::Range<u32>) -> (Vec<u8>, Vec<u8>) {
    let mut keys = Vec::new();
    let mut values = Vec::new();
    for i in range {
        let mut k = [0u8; 40];
        k[..4].copy_from_slice(&i.to_ne_bytes());
        k[36] = TCP;
        keys.extend_from_slice(&k);
        let mut v = [0u8; 56];
        v[..4].copy_from_slice(&i.wrapping_mul(7).to_ne_bytes());
        values.extend_from_slice(&v);
    }
    (keys, values)
}

/// The entries of a batched read, sorted, as (key, value) byte pairs.
fn pairs(batch: &nodeport_proxy::ebpf::batch::Batch<'_>) -> Vec<(Vec<u8>, Vec<u8>)> {
    let (keys, values) = batch.lookup_all().expect("batched read");
    let mut out: Vec<(Vec<u8>, Vec<u8>)> = keys
        .chunks(batch.key_size())
        .zip(values.chunks(batch.value_size()))
        .map(|(k, v)| (k.to_vec(), v.to_vec()))
        .collect();
    out.sort();
    out
}

#[test]
fn batched_writes_reads_and_deletes_do_what_one_entry_at_a_time_does() {
    if !require_tools("batched_writes_reads_and_deletes", &[]) {
        return;
    }
    let sizes = MapSizes {
        conntrack: 32768,
        ..sizes()
    };
    // More entries than one read asks for (8192): the read resumes where the last stopped.
    let (keys, values) = ct_entries(0..20_000);
    let (_p1, batched) = Programs::load(&sizes).expect("the eBPF object loads");
    let (_p2, single) = Programs::load(&sizes).expect("the eBPF object loads");
    let b = batched.batch("np_ct").unwrap();
    let s = single.batch("np_ct").unwrap().per_entry();
    assert_eq!((b.key_size(), b.value_size()), (40, 56));
    b.update(&keys, &values).unwrap();
    s.update(&keys, &values).unwrap();
    let written = pairs(&b);
    assert_eq!(written.len(), 20_000);
    assert_eq!(written, pairs(&s));
    assert_eq!(written, pairs(&b.per_entry()), "read one by one");
    // Deleting keys, some of which the map does not hold (removals are idempotent).
    let (gone, _) = ct_entries(10_000..25_000);
    b.delete(&gone).unwrap();
    s.delete(&gone).unwrap();
    let left = pairs(&b);
    assert_eq!(left.len(), 10_000);
    assert_eq!(left, pairs(&s));
    let (expected_keys, expected_values) = ct_entries(0..10_000);
    let mut expected: Vec<(Vec<u8>, Vec<u8>)> = expected_keys
        .chunks(40)
        .zip(expected_values.chunks(56))
        .map(|(k, v)| (k.to_vec(), v.to_vec()))
        .collect();
    expected.sort();
    assert_eq!(left, expected);
    // Buffers that are not whole entries are refused before any call.
    assert!(matches!(
        b.update(&keys[..41], &values[..56]),
        Err(nodeport_proxy::ebpf::batch::Error::Shape { .. })
    ));
    assert_eq!(pairs(&b).len(), 10_000);
}

#[test]
fn a_batched_write_into_a_full_map_says_how_many_entries_it_wrote() {
    let Some(progs) = load("a_batched_write_into_a_full_map") else {
        return;
    };
    // np_services holds 64 frontends in these tests.
    let mut keys = Vec::new();
    let mut values = Vec::new();
    for i in 0..100u16 {
        keys.extend_from_slice(&ext("192.0.2.10", 30000 + i, TCP).encode());
        values.extend_from_slice(
            &Frontend {
                svc_id: u32::from(i) + 1,
                ..Default::default()
            }
            .encode(),
        );
    }
    for batch in [
        progs.batch("np_services").unwrap(),
        progs.batch("np_services").unwrap().per_entry(),
    ] {
        match batch.update(&keys, &values) {
            Err(nodeport_proxy::ebpf::batch::Error::Call {
                done,
                count,
                source,
                ..
            }) => {
                assert_eq!((done, count), (64, 100));
                assert_eq!(source.raw_os_error(), Some(libc::E2BIG), "{source}");
            }
            other => panic!("a full map: {other:?}"),
        }
        assert_eq!(pairs(&batch).len(), 64);
    }
}

/// A NodePort Service `name` with one endpoint on node-a, and its EndpointSlice `<name>-1`.
fn nodeport_service(name: &str, cluster_ip: &str, node_port: u16, endpoint: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: default}}
spec:
  type: NodePort
  clusterIP: {cluster_ip}
  ports: [{{name: http, port: 80, targetPort: 8080, nodePort: {node_port}}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: {name}-1, namespace: default, labels: {{kubernetes.io/service-name: {name}}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}]
endpoints:
- {{addresses: [{endpoint}], nodeName: node-a}}
"#
    )
}

#[test]
fn a_node_port_another_service_takes_over_in_the_same_sync_keeps_its_frontends() {
    let Some((programs, mut applier)) = applier("a_node_port_another_service_takes_over") else {
        return;
    };
    use nodeport_proxy::model::ServiceName;
    let mut c = Cluster::new(&nodeport_service(
        "z-old",
        "10.96.0.20",
        30080,
        "10.244.1.5",
    ));
    c.cluster.take_changes();
    applier.sync(&c.desired, None).unwrap();
    // One sync sees z-old go and a-new take its NodePort (a-new's frontends are written
    // first: service ports are taken in name order).
    let fresh = nodeport_proxy::objects::load(&nodeport_service(
        "a-new",
        "10.96.0.21",
        30080,
        "10.244.1.6",
    ))
    .unwrap()
    .cluster;
    c.cluster
        .update_service(ServiceName::new("default", "z-old"), None);
    c.cluster
        .update_slice(ServiceName::new("default", "z-old-1"), None);
    let svc = ServiceName::new("default", "a-new");
    c.cluster
        .update_service(svc.clone(), fresh.services.get(&svc).cloned());
    let slice = ServiceName::new("default", "a-new-1");
    c.cluster
        .update_slice(slice.clone(), fresh.slices.get(&slice).cloned());
    let changes = c.cluster.take_changes();
    let changed = c.desired.refresh_services(
        &c.cluster,
        nodeport_proxy::desired::NodeView::named("node-a"),
        &changes.services,
    );
    assert_eq!(changed.len(), 2, "{changed:?}");
    applier.sync(&c.desired, Some(&changed)).unwrap();
    let nodeport: Vec<FrontendKey> = applier
        .maps()
        .frontends()
        .unwrap()
        .into_iter()
        .map(|(k, _)| k)
        .filter(|k| k.port == 30080)
        .collect();
    assert_eq!(
        nodeport.len(),
        2,
        "both scopes of the NodePort: {nodeport:?}"
    );
    let syn = Packet::new(TCP, "203.0.113.7", 40000, "192.0.2.10", 30080);
    let out = parse(&run_on(&programs, TC_INGRESS, &frame(&syn)).1);
    assert_eq!((out.dst, out.dport), (ip("10.244.1.6"), 8080));
}

#[test]
fn routes_read_over_rtnetlink_name_the_devices_ip_route_names() {
    if !require_tools("routes_read_over_rtnetlink", &["ip"]) {
        return;
    }
    use nodeport_proxy::ebpf::routes::{RouteTable, route_interface};
    let a = Netns::new("rt-a").unwrap();
    let b = Netns::new("rt-b").unwrap();
    veth(&a, "eth0", &b, "eth0").unwrap();
    veth(&a, "tun0", &b, "tun0").unwrap();
    a.sh(
        "ip addr add 192.0.2.10/24 dev eth0 && ip link set eth0 up && \
         ip link set tun0 up && ip addr add fd00:50::1/64 dev eth0 nodad && \
         ip route add default via 192.0.2.1 && \
         ip route add 10.244.2.0/24 dev tun0 && \
         ip route add 10.244.3.0/24 dev tun0 metric 200 && \
         ip route add 10.244.3.0/24 dev eth0 metric 100 && \
         ip route add blackhole 10.9.0.0/16 && \
         ip -6 route add fd00:244:2::/64 dev tun0",
    )
    .unwrap();
    let (table, to_pod, to_node, to_nowhere) = a
        .enter(|| {
            (
                RouteTable::dump(),
                route_interface(ip("10.244.2.7")),
                route_interface(ip("192.0.2.10")),
                route_interface(ip("10.9.1.1")),
            )
        })
        .unwrap();
    let dev = |s: &str| table.device(ip(s)).map(|d| d.to_string());
    assert_eq!(dev("10.244.2.7").as_deref(), Some("tun0"));
    assert_eq!(
        dev("10.244.3.7").as_deref(),
        Some("eth0"),
        "the lower metric"
    );
    assert_eq!(
        dev("198.51.100.1").as_deref(),
        Some("eth0"),
        "the default route"
    );
    assert_eq!(dev("192.0.2.77").as_deref(), Some("eth0"));
    assert_eq!(dev("10.9.1.1"), None, "a blackhole names no device");
    assert_eq!(dev("fd00:244:2::5").as_deref(), Some("tun0"));
    assert_eq!(dev("fd00:50::7").as_deref(), Some("eth0"));
    assert_eq!(dev("2001:db8::1"), None, "no IPv6 default route");
    assert_eq!(to_pod.as_deref(), Some("tun0"));
    assert_eq!(to_node, None, "a local address");
    assert_eq!(to_nowhere, None, "a blackhole");
}

#[test]
fn tc_goes_on_the_devices_remote_endpoints_are_routed_through_as_they_appear() {
    if !require_tools("tc_goes_on_the_devices_remote_endpoints", &["ip"]) {
        return;
    }
    let node = Netns::new("ebpf-rt-node").unwrap();
    let peer = Netns::new("ebpf-rt-peer").unwrap();
    for dev in ["eth0", "tun0", "tun1"] {
        veth(&node, dev, &peer, dev).unwrap();
    }
    node.sh(
        "ip addr add 192.0.2.10/24 dev eth0 && ip link set eth0 up && \
         ip link set tun0 up && ip link set tun1 up && \
         ip route add 10.244.9.0/24 dev tun0 && ip route add 10.244.8.0/24 dev tun1",
    )
    .unwrap();
    let facts = nodeport_proxy::nodeaddr::NodeFacts {
        node_ips: vec![ip("192.0.2.10")],
        local_ips: vec![ip("192.0.2.10")],
        ..Default::default()
    };
    let mut c = Cluster::on_node(&web(&["10.244.9.5@node-b"]), facts);
    let mut dataplane = node
        .enter(|| {
            let mut d = Dataplane::start(DataplaneConfig {
                sizes: sizes(),
                ..Default::default()
            })
            .expect("the dataplane starts");
            d.sync(&c.desired, None).expect("first sync");
            d
        })
        .unwrap();
    // The NodePort's interface, and the device the remote endpoint's replies come back on.
    assert_eq!(dataplane.interfaces(), ["eth0", "tun0"]);
    // A partial sync: an endpoint behind another device joins.
    let changed = c.update(&web(&["10.244.9.5@node-b", "10.244.8.5@node-c"]));
    node.enter(|| {
        dataplane
            .sync(&c.desired, Some(&changed))
            .expect("partial sync")
    })
    .unwrap();
    assert_eq!(dataplane.interfaces(), ["eth0", "tun0", "tun1"]);
    drop(dataplane);
}

/// NodePort Services `svc-1` … `svc-<n>` (ports 30081 …), each with `endpoints` (`ip@node`).
fn nodeport_services(n: usize, endpoints: &[&str]) -> String {
    let eps: Vec<String> = endpoints
        .iter()
        .map(|e| {
            let (ip, node) = e.split_once('@').expect("ip@node");
            format!("- {{addresses: [{ip}], nodeName: {node}}}")
        })
        .collect();
    (1..=n)
        .map(|i| {
            format!(
                r#"
apiVersion: v1
kind: Service
metadata: {{name: svc-{i}, namespace: default}}
spec:
  type: NodePort
  clusterIP: 10.96.1.{i}
  ports: [{{name: http, port: 80, targetPort: 8080, nodePort: {port}}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: svc-{i}-1, namespace: default, labels: {{kubernetes.io/service-name: svc-{i}}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}]
endpoints:
{eps}
"#,
                port = 30080 + i,
                eps = eps.join("\n")
            )
        })
        .collect::<Vec<_>>()
        .join("---\n")
}

#[test]
fn between_any_two_batched_writes_every_service_is_whole_for_a_new_connection() {
    let Some((programs, mut applier)) = applier("between_any_two_batched_writes") else {
        return;
    };
    const SERVICES: usize = 3;
    let a = nodeport_services(
        SERVICES,
        &[
            "10.244.1.1@node-b",
            "10.244.1.2@node-b",
            "10.244.1.3@node-b",
        ],
    );
    let b = nodeport_services(SERVICES, &["10.244.2.1@node-b", "10.244.2.2@node-b"]);
    let mut c = Cluster::new(&a);
    c.cluster.take_changes();
    applier.sync(&c.desired, None).unwrap();
    // New connections to every NodePort, from fresh clients: each must reach a backend of
    // the old set or of the new one.
    let mut client = 0u32;
    let mut probe = |step: &'static str, failures: &mut Vec<String>| {
        for i in 1..=SERVICES {
            client += 1;
            let port = 30080 + i as u16;
            let mut syn = Packet::new(TCP, "203.0.113.7", 40000, "192.0.2.10", port);
            syn.src = IpAddr::from([203, 0, (client >> 8) as u8, client as u8]);
            let (verdict, out) = run_on(&programs, TC_INGRESS, &frame(&syn));
            let reached = verdict == TC_ACT_OK && {
                let p = parse(&out);
                p.dport == 8080 && p.dst.to_string().starts_with("10.244.")
            };
            if !reached {
                failures.push(format!("after {step}: NodePort {port}: verdict {verdict}"));
            }
        }
    };
    let mut steps = std::collections::BTreeSet::new();
    let mut failures = Vec::new();
    for round in 0..4 {
        let fresh = nodeport_proxy::objects::load(if round % 2 == 0 { &b } else { &a })
            .unwrap()
            .cluster;
        for (k, v) in fresh.services.iter() {
            c.cluster.update_service(k.clone(), Some(v.clone()));
        }
        for (k, v) in fresh.slices.iter() {
            c.cluster.update_slice(k.clone(), Some(v.clone()));
        }
        let changes = c.cluster.take_changes();
        let changed = c.desired.refresh_services(
            &c.cluster,
            nodeport_proxy::desired::NodeView::named("node-a"),
            &changes.services,
        );
        assert_eq!(changed.len(), SERVICES);
        // Full syncs (every Service's sets in one batched write, their frontends in the
        // next) and partial ones, in turn.
        let which = if round < 2 { None } else { Some(&changed) };
        let report = applier
            .sync_observing(&c.desired, which, &mut |step| {
                steps.insert(step);
                probe(step, &mut failures);
            })
            .unwrap();
        assert_eq!(report.services_written, SERVICES);
    }
    assert!(
        steps.contains("frontends") && steps.contains("backends removed"),
        "{steps:?}"
    );
    assert!(failures.is_empty(), "{failures:?}");
}
