//! The eBPF maps' keys and values, encoded byte by byte as `bpf/nodeport.h` lays them out.
//!
//! Addresses take 16 bytes in network order, IPv4 as IPv4-mapped IPv6 (`::ffff:a.b.c.d`), so
//! that one set of maps serves both families; ports are in network order (as in the packet);
//! counters, ids and flags in the host's order (the kernel's). Encoding by hand keeps the
//! layout explicit and needs no `unsafe` `Pod` implementations.

use std::net::{IpAddr, Ipv6Addr};

use crate::model::{Protocol, ServicePortName};

/// Names of the maps in the object (and of their pins).
pub mod names {
    /// Frontends: (address, port, protocol, scope) → service.
    pub const SERVICES: &str = "np_services";
    /// Service ids → the service port's name, for `nodeport trace` (the programs never
    /// read it).
    pub const SVC_NAMES: &str = "np_svc_names";
    /// Backends: (backend set, ordinal) → address and port.
    pub const BACKENDS: &str = "np_backends";
    /// Backend set membership: (backend set, address, port) → ordinal.
    pub const MEMBERS: &str = "np_members";
    /// Conntrack, forward direction (LRU).
    pub const CT: &str = "np_ct";
    /// Reverse NAT and SNAT, reply direction (LRU).
    pub const NAT: &str = "np_nat";
    /// Session affinity (LRU).
    pub const AFFINITY: &str = "np_affinity";
    /// `loadBalancerSourceRanges` (LPM trie).
    pub const SOURCE_RANGES: &str = "np_src_ranges";
    /// Maglev lookup tables, one per backend set.
    pub const MAGLEV: &str = "np_maglev";
    /// Node settings (SNAT addresses).
    pub const CONFIG: &str = "np_config";
    /// Socket reverse translation for recvmsg and getpeername (LRU).
    pub const SOCK_REV: &str = "np_sock_rev";
    /// Dataplane flags (`FLAG_*`).
    pub const FLAGS: &str = "np_flags";
    /// Until when the programs report trace events (`CLOCK_MONOTONIC` nanoseconds).
    pub const TRACE_UNTIL: &str = "np_trace_until";
    /// The programs' trace events by tuple (LRU), for `nodeport trace --live`.
    pub const TRACE_LOG: &str = "np_trace_log";
    /// IP fragments: a datagram's ports, remembered from its first fragment (LRU, 8192
    /// entries, Cilium's default; used by the programs only, so not in [`ALL`]).
    pub const FRAGS: &str = "np_frags";

    /// Every map, in the order the metrics list them.
    pub const ALL: [&str; 14] = [
        SERVICES,
        SVC_NAMES,
        BACKENDS,
        MEMBERS,
        CT,
        NAT,
        AFFINITY,
        SOURCE_RANGES,
        MAGLEV,
        CONFIG,
        SOCK_REV,
        FLAGS,
        TRACE_UNTIL,
        TRACE_LOG,
    ];
}

/// Bytes of a name in `np_svc_names` (`NP_SVC_NAME_LEN`), its NUL padding included.
pub const SVC_NAME_LEN: usize = 136;

/// The longest name [`svc_name`] writes before its `/PROTO`: the flat nftables layout's
/// comment budget, so that a port is named alike in both modes.
pub const SVC_NAME_MAX: usize = 128;

/// `struct np_svc_name`: the service port's name, `namespace/name:port/PROTO` (the port's
/// name, `namespace/name/PROTO` when unnamed; shortened to [`SVC_NAME_MAX`] bytes before the
/// protocol as [`short_port_name`](crate::names::short_port_name) does), NUL-padded.
pub fn svc_name(port: &ServicePortName) -> [u8; SVC_NAME_LEN] {
    let proto = match port.protocol {
        Protocol::Tcp => "TCP",
        Protocol::Udp => "UDP",
        Protocol::Sctp => "SCTP",
    };
    let text = format!(
        "{}/{proto}",
        crate::names::short_port_name(port, SVC_NAME_MAX)
    );
    let mut b = [0u8; SVC_NAME_LEN];
    // At most 128 + 5 bytes: always room for the NUL.
    b[..text.len()].copy_from_slice(text.as_bytes());
    b
}

/// Reads `struct np_svc_name`; `None` for a value [`svc_name`] does not write.
pub fn decode_svc_name(b: &[u8]) -> Option<ServicePortName> {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    let text = std::str::from_utf8(&b[..end]).ok()?;
    let (name, proto) = text.rsplit_once('/')?;
    let protocol = Protocol::parse(proto)?;
    crate::trace::recover::parse_port_name(name, protocol)
}

/// Maglev lookup table size (`NP_MAGLEV_M`): Cilium's default, a prime.
pub const MAGLEV_M: usize = 16381;

/// Frontend flag: no endpoints, answer with ICMP port unreachable.
pub const SVC_REJECT: u16 = 0x1;
/// Frontend flag: no endpoints (Local policy), drop.
pub const SVC_DROP: u16 = 0x2;
/// Frontend flag: `sessionAffinity: ClientIP`.
pub const SVC_AFFINITY: u16 = 0x4;
/// Frontend flag: choose through the Maglev table.
pub const SVC_MAGLEV: u16 = 0x8;
/// Frontend flag: `loadBalancerSourceRanges` apply.
pub const SVC_RANGES: u16 = 0x10;
/// Frontend flag: SNAT to the node whatever the backend (external traffic under the Cluster
/// policy, which kube-proxy masquerades; ClusterIPs under `--masquerade-all`).
pub const SVC_SNAT: u16 = 0x20;
/// Frontend flag: SNAT to the node when the source is outside the cluster CIDRs
/// (`--cluster-cidr`: kube-proxy masquerades off-cluster traffic to ClusterIPs).
pub const SVC_SNAT_OFF_CLUSTER: u16 = 0x40;
/// The service id under which `np_src_ranges` holds the cluster CIDRs
/// (`NP_CLUSTER_CIDRS_ID`; frontends' ids start at 1).
pub const CLUSTER_CIDRS_ID: u32 = 0;

/// Dataplane flag: forward packets translated at ingress with `bpf_fib_lookup` and
/// `bpf_redirect_neigh` rather than up the stack.
pub const FLAG_FIB_FORWARD: u32 = 0x1;

/// Backend flag: on another node (SNAT to this node).
pub const BE_REMOTE: u8 = 0x1;

/// Connection flag: the source was rewritten too.
pub const CT_SNAT: u8 = 0x1;
/// Connection flag: TCP FIN or RST seen.
pub const CT_CLOSING: u8 = 0x2;
/// Connection flag: a reply was seen.
pub const CT_REPLY: u8 = 0x4;

/// IP protocol numbers.
pub fn ip_proto(p: Protocol) -> u8 {
    match p {
        Protocol::Tcp => 6,
        Protocol::Udp => 17,
        Protocol::Sctp => 132,
    }
}

/// The 16-byte form of an address (IPv4 mapped).
pub fn addr_bytes(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}

/// The address of a 16-byte form (mapped addresses are IPv4).
pub fn addr_from(b: &[u8]) -> IpAddr {
    let mut o = [0u8; 16];
    o.copy_from_slice(&b[..16]);
    let v6 = Ipv6Addr::from(o);
    match v6.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(v6),
    }
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_ne_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut o = [0u8; 8];
    o.copy_from_slice(&b[at..at + 8]);
    u64::from_ne_bytes(o)
}

fn port_at(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

/// Which traffic a frontend serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Scope {
    /// External traffic arriving on the node's interfaces (tc).
    External,
    /// Traffic from sockets on the node (cgroup hooks).
    Internal,
}

/// `struct np_svc_key`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FrontendKey {
    /// Service address.
    pub addr: IpAddr,
    /// Service port.
    pub port: u16,
    /// IP protocol number.
    pub proto: u8,
    /// Scope.
    pub scope: Scope,
}

impl FrontendKey {
    /// The map key.
    pub fn encode(&self) -> [u8; 20] {
        let mut b = [0u8; 20];
        b[..16].copy_from_slice(&addr_bytes(self.addr));
        b[16..18].copy_from_slice(&self.port.to_be_bytes());
        b[18] = self.proto;
        b[19] = match self.scope {
            Scope::External => 0,
            Scope::Internal => 1,
        };
        b
    }

    /// Reads a map key.
    pub fn decode(b: &[u8; 20]) -> Self {
        FrontendKey {
            addr: addr_from(b),
            port: port_at(b, 16),
            proto: b[18],
            scope: if b[19] == 0 {
                Scope::External
            } else {
                Scope::Internal
            },
        }
    }
}

/// `struct np_svc_val`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Frontend {
    /// Stable id of the service port (affinity, source ranges).
    pub svc_id: u32,
    /// The backend set in use.
    pub be_set: u32,
    /// Backends at ordinals `1..=count`.
    pub count: u16,
    /// `SVC_*` flags.
    pub flags: u16,
    /// Session affinity timeout, seconds.
    pub affinity_timeout: u32,
}

impl Frontend {
    /// The map value.
    pub fn encode(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[0..4].copy_from_slice(&self.svc_id.to_ne_bytes());
        b[4..8].copy_from_slice(&self.be_set.to_ne_bytes());
        b[8..10].copy_from_slice(&self.count.to_ne_bytes());
        b[10..12].copy_from_slice(&self.flags.to_ne_bytes());
        b[12..16].copy_from_slice(&self.affinity_timeout.to_ne_bytes());
        b
    }

    /// Reads a map value.
    pub fn decode(b: &[u8; 16]) -> Self {
        Frontend {
            svc_id: u32_at(b, 0),
            be_set: u32_at(b, 4),
            count: u16_at(b, 8),
            flags: u16_at(b, 10),
            affinity_timeout: u32_at(b, 12),
        }
    }
}

/// `struct np_be_key`.
pub fn backend_key(be_set: u32, ordinal: u32) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[0..4].copy_from_slice(&be_set.to_ne_bytes());
    b[4..8].copy_from_slice(&ordinal.to_ne_bytes());
    b
}

/// Reads `struct np_be_key`: (backend set, ordinal).
pub fn decode_backend_key(b: &[u8; 8]) -> (u32, u32) {
    (u32_at(b, 0), u32_at(b, 4))
}

/// `struct np_be_val`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BackendEntry {
    /// Endpoint address.
    pub addr: IpAddr,
    /// Endpoint port.
    pub port: u16,
    /// On another node.
    pub remote: bool,
}

impl BackendEntry {
    /// The map value.
    pub fn encode(&self) -> [u8; 20] {
        let mut b = [0u8; 20];
        b[..16].copy_from_slice(&addr_bytes(self.addr));
        b[16..18].copy_from_slice(&self.port.to_be_bytes());
        b[18] = if self.remote { BE_REMOTE } else { 0 };
        b
    }

    /// Reads a map value.
    pub fn decode(b: &[u8; 20]) -> Self {
        BackendEntry {
            addr: addr_from(b),
            port: port_at(b, 16),
            remote: b[18] & BE_REMOTE != 0,
        }
    }
}

/// `struct np_member_key`.
pub fn member_key(be_set: u32, addr: IpAddr, port: u16) -> [u8; 24] {
    let mut b = [0u8; 24];
    b[0..4].copy_from_slice(&be_set.to_ne_bytes());
    b[4..20].copy_from_slice(&addr_bytes(addr));
    b[20..22].copy_from_slice(&port.to_be_bytes());
    b
}

/// Reads `struct np_member_key`'s backend set.
pub fn member_key_set(b: &[u8; 24]) -> u32 {
    u32_at(b, 0)
}

/// A membership entry's key: (backend set, address, port).
pub type MemberKey = (u32, IpAddr, u16);

/// Reads `struct np_member_key`.
pub fn decode_member_key(b: &[u8; 24]) -> MemberKey {
    (u32_at(b, 0), addr_from(&b[4..20]), port_at(b, 20))
}

/// `struct np_ct_key`: a connection's tuple as one direction's packets carry it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Tuple {
    /// Source address.
    pub saddr: IpAddr,
    /// Destination address.
    pub daddr: IpAddr,
    /// Source port.
    pub sport: u16,
    /// Destination port.
    pub dport: u16,
    /// IP protocol number.
    pub proto: u8,
}

impl Tuple {
    /// The map key.
    pub fn encode(&self) -> [u8; 40] {
        let mut b = [0u8; 40];
        b[..16].copy_from_slice(&addr_bytes(self.saddr));
        b[16..32].copy_from_slice(&addr_bytes(self.daddr));
        b[32..34].copy_from_slice(&self.sport.to_be_bytes());
        b[34..36].copy_from_slice(&self.dport.to_be_bytes());
        b[36] = self.proto;
        b
    }

    /// Reads a map key.
    pub fn decode(b: &[u8; 40]) -> Self {
        Tuple {
            saddr: addr_from(&b[..16]),
            daddr: addr_from(&b[16..32]),
            sport: port_at(b, 32),
            dport: port_at(b, 34),
            proto: b[36],
        }
    }
}

/// `struct np_ct_val`: the translation a direction's packets get.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Translation {
    /// New source address.
    pub saddr: IpAddr,
    /// New destination address.
    pub daddr: IpAddr,
    /// New source port.
    pub sport: u16,
    /// New destination port.
    pub dport: u16,
    /// `CT_*` flags.
    pub flags: u8,
    /// The service port's id.
    pub svc_id: u32,
    /// `bpf_ktime_get_ns()` of the last packet (`CLOCK_MONOTONIC`).
    pub last_seen_ns: u64,
}

impl Translation {
    /// The map value.
    pub fn encode(&self) -> [u8; 56] {
        let mut b = [0u8; 56];
        b[..16].copy_from_slice(&addr_bytes(self.saddr));
        b[16..32].copy_from_slice(&addr_bytes(self.daddr));
        b[32..34].copy_from_slice(&self.sport.to_be_bytes());
        b[34..36].copy_from_slice(&self.dport.to_be_bytes());
        b[36] = self.flags;
        b[40..44].copy_from_slice(&self.svc_id.to_ne_bytes());
        b[48..56].copy_from_slice(&self.last_seen_ns.to_ne_bytes());
        b
    }

    /// Reads a map value.
    pub fn decode(b: &[u8; 56]) -> Self {
        Translation {
            saddr: addr_from(&b[..16]),
            daddr: addr_from(&b[16..32]),
            sport: port_at(b, 32),
            dport: port_at(b, 34),
            flags: b[36],
            svc_id: u32_at(b, 40),
            last_seen_ns: u64_at(b, 48),
        }
    }
}

/// `struct np_aff_key` for a client address.
pub fn affinity_key(svc_id: u32, client: IpAddr) -> [u8; 20] {
    let mut b = [0u8; 20];
    b[0..4].copy_from_slice(&svc_id.to_ne_bytes());
    b[4..20].copy_from_slice(&addr_bytes(client));
    b
}

/// Reads `struct np_aff_val`: the backend remembered and when it was last used.
pub fn decode_affinity(b: &[u8; 32]) -> (IpAddr, u16, u64) {
    (addr_from(&b[..16]), port_at(b, 16), u64_at(b, 24))
}

/// The LPM trie key data of `struct np_range_key` (after `prefixlen`): the service id and
/// the address; the prefix length covers the id's 32 bits plus the range's bits (IPv4 ranges
/// count the 96 bits of the mapped prefix).
pub fn range_key(svc_id: u32, net: ipnet::IpNet) -> (u32, [u8; 20]) {
    let mut b = [0u8; 20];
    b[0..4].copy_from_slice(&svc_id.to_ne_bytes());
    b[4..20].copy_from_slice(&addr_bytes(net.network()));
    let bits = match net {
        ipnet::IpNet::V4(n) => 96 + u32::from(n.prefix_len()),
        ipnet::IpNet::V6(n) => u32::from(n.prefix_len()),
    };
    (32 + bits, b)
}

/// Reads an LPM key back into (service id, range).
pub fn decode_range_key(prefixlen: u32, data: &[u8; 20]) -> (u32, ipnet::IpNet) {
    let svc_id = u32_at(data, 0);
    let bits = prefixlen.saturating_sub(32);
    let net = match addr_from(&data[4..20]) {
        IpAddr::V4(v4) => ipnet::IpNet::V4(
            ipnet::Ipv4Net::new(v4, bits.saturating_sub(96).min(32) as u8).expect("bounded"),
        ),
        IpAddr::V6(v6) => {
            ipnet::IpNet::V6(ipnet::Ipv6Net::new(v6, bits.min(128) as u8).expect("bounded"))
        }
    };
    (svc_id, net)
}

/// `struct np_config_val` index of a family's SNAT address.
pub fn config_index(addr: IpAddr) -> u32 {
    match addr {
        IpAddr::V4(_) => 0,
        IpAddr::V6(_) => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_values_read_back_as_written() {
        let k = FrontendKey {
            addr: "10.96.0.10".parse().unwrap(),
            port: 53,
            proto: 17,
            scope: Scope::Internal,
        };
        let b = k.encode();
        assert_eq!(&b[..12], &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]);
        assert_eq!(&b[12..18], &[10, 96, 0, 10, 0, 53]);
        assert_eq!(FrontendKey::decode(&b), k);
        let f = Frontend {
            svc_id: 7,
            be_set: 9,
            count: 3,
            flags: SVC_AFFINITY | SVC_MAGLEV,
            affinity_timeout: 10800,
        };
        assert_eq!(Frontend::decode(&f.encode()), f);
        let be = BackendEntry {
            addr: "fd00::5".parse().unwrap(),
            port: 8080,
            remote: true,
        };
        assert_eq!(BackendEntry::decode(&be.encode()), be);
        let t = Tuple {
            saddr: "192.0.2.1".parse().unwrap(),
            daddr: "198.51.100.7".parse().unwrap(),
            sport: 40000,
            dport: 30080,
            proto: 6,
        };
        assert_eq!(Tuple::decode(&t.encode()), t);
        let tr = Translation {
            saddr: t.saddr,
            daddr: "10.244.1.5".parse().unwrap(),
            sport: 1,
            dport: 2,
            flags: CT_SNAT,
            svc_id: 4,
            last_seen_ns: 1 << 40,
        };
        assert_eq!(Translation::decode(&tr.encode()), tr);
    }

    #[test]
    fn a_service_ports_name_reads_back_and_a_long_one_is_shortened_as_the_flat_layouts_comment() {
        for port in [
            ServicePortName::new("default", "web", "http", Protocol::Tcp),
            ServicePortName::new("kube-system", "dns", "", Protocol::Udp),
        ] {
            let b = svc_name(&port);
            assert_eq!(decode_svc_name(&b), Some(port));
        }
        let b = svc_name(&ServicePortName::new(
            "default",
            "web",
            "http",
            Protocol::Tcp,
        ));
        assert_eq!(&b[..20], b"default/web:http/TCP");
        assert!(b[20..].iter().all(|&c| c == 0));
        // 63 + 63 + 15 bytes: the middle of the name cut, as in the flat layout's comments.
        let long = ServicePortName::new(
            &"n".repeat(63),
            &"a".repeat(63),
            &"p".repeat(15),
            Protocol::Sctp,
        );
        let b = svc_name(&long);
        let read = decode_svc_name(&b).unwrap();
        assert_eq!(
            format!("{read}"),
            crate::nftables::flat::element_comment(&long)
        );
        assert_eq!(read.protocol, Protocol::Sctp);
        assert_eq!(b[SVC_NAME_LEN - 1], 0);
        assert_eq!(decode_svc_name(b"not a name\0"), None);
    }

    #[test]
    fn ipv4_source_ranges_count_the_mapped_prefix_bits() {
        let (len, data) = range_key(3, "203.0.113.0/24".parse().unwrap());
        assert_eq!(len, 32 + 96 + 24);
        assert_eq!(&data[14..20], &[0xff, 0xff, 203, 0, 113, 0]);
        let (len, _) = range_key(3, "2001:db8::/32".parse().unwrap());
        assert_eq!(len, 64);
    }
}
