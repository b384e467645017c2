//! Entry points for fuzzing what the proxy reads: its configuration (`KubeProxyConfiguration`,
//! `--nodeport-addresses`), the objects `nodeport render` takes, the kernel's netlink
//! replies and `iptables-save` output. The fuzz targets under `fuzz/` (cargo-fuzz, nightly) and the replay of their
//! corpora in `cargo test` (`tests/fuzz_corpus.rs`, stable) both call these, so that a
//! finding stays a regression test without nightly.
//!
//! Each call must return normally whatever the bytes are; a panic or a hang is a finding.
//! Where the code promises more than not crashing (a value that prints back as itself), the
//! entry point asserts it.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use netlink_packet_core::{NetlinkMessage, NetlinkPayload};
use netlink_packet_route::RouteNetlinkMessage;

use crate::config::{KubeProxyConfiguration, NftablesLayout, NodeConfig, ProxyMode};
use crate::desired::{self, NodeView, StateConfig};
use crate::model::{IpFamily, Protocol};
use crate::nodeaddr::{NodeFacts, NodePortAddresses};
use crate::trace::{Env, Packet};
use crate::{ebpf, iptables, ipvs, nftables, objects};

/// A node with one address of each family and the loopback addresses, for selections.
fn sample_facts() -> NodeFacts {
    let node_ips = vec![
        IpAddr::V4(Ipv4Addr::new(192, 0, 2, 4)),
        IpAddr::V6("2001:db8::4".parse().expect("an address")),
    ];
    let mut local_ips = node_ips.clone();
    local_ips.extend([
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(Ipv6Addr::LOCALHOST),
    ]);
    NodeFacts {
        default_route_ips: node_ips.clone(),
        node_ips,
        local_ips,
    }
}

/// A `--nodeport-addresses` value parsed, printed back and selected from. A value that
/// parses must print as a value that parses to the same selectors.
fn nodeport_addresses(parsed: &NodePortAddresses, given: &str) {
    let printed = parsed.to_string();
    assert_eq!(
        printed.parse::<NodePortAddresses>().as_ref(),
        Ok(parsed),
        "{given:?} parsed, but prints as {printed:?}, which parses differently"
    );
    let facts = sample_facts();
    for family in IpFamily::ALL {
        let _ = parsed.select(family, &facts);
    }
    let _ = parsed.unmatched_cidrs(&facts);
}

/// The proxy's configuration: with `data[0]` even, the rest is a `--nodeport-addresses`
/// flag value; odd, a `KubeProxyConfiguration` file, read as `nodeport proxy --config` reads
/// it (the mode, the layout, the durations and the `nodePortAddresses` list parsed in turn).
/// Returns whether it parsed.
pub fn proxy_config(data: &[u8]) -> bool {
    let Some((&selector, rest)) = data.split_first() else {
        return false;
    };
    // Flags are strings, and the file is read with `read_to_string`: not UTF-8 is refused
    // before any parsing.
    let Ok(text) = std::str::from_utf8(rest) else {
        return false;
    };
    if selector & 1 == 0 {
        let Ok(parsed) = text.parse::<NodePortAddresses>() else {
            return false;
        };
        nodeport_addresses(&parsed, text);
        return true;
    }
    let Ok(file) = KubeProxyConfiguration::parse(text) else {
        return false;
    };
    let _ = file.mode.as_deref().map(ProxyMode::parse);
    let _ = file.nftables_layout().map(NftablesLayout::parse);
    let _ = file.sync_period().map(crate::config::parse_go_duration);
    let _ = file.min_sync_period().map(crate::config::parse_go_duration);
    let _ = (file.masquerade_all(), file.masquerade_bit());
    let _ = file.localhost_node_ports();
    if let Some(list) = &file.node_port_addresses {
        let whole = list.join(",");
        if let Ok(parsed) = NodePortAddresses::from_entries(list.iter().map(String::as_str), &whole)
        {
            nodeport_addresses(&parsed, &whole);
        }
    }
    true
}

/// `nodeport render`'s input, a multi-document YAML file of Services, EndpointSlices,
/// ServiceCIDRs and Nodes, through to the rendered rules. `data[0]` picks the mode (bits 0
/// and 1: nftables, iptables, IPVS, eBPF), the nftables layout (bit 2: flat or kube-proxy's),
/// `--masquerade-all` (bit 3) and the eBPF backend choice (bit 4: random or Maglev); the node
/// is the file's Node (its addresses are the node's, with loopback). The nftables ruleset is
/// also encoded as the netlink batch the proxy would send. Returns whether the file loaded
/// and was rendered.
pub fn render(data: &[u8]) -> bool {
    let Some((&selector, rest)) = data.split_first() else {
        return false;
    };
    // `render` reads the file with `read_to_string`.
    let Ok(text) = std::str::from_utf8(rest) else {
        return false;
    };
    let Ok(loaded) = objects::load(text) else {
        return false;
    };
    let mode = [
        ProxyMode::Nftables,
        ProxyMode::Iptables,
        ProxyMode::Ipvs,
        ProxyMode::Ebpf,
    ][usize::from(selector & 0x03)];
    let node = loaded.node.clone().unwrap_or_default();
    let mut local_ips = node.addresses.clone();
    local_ips.extend([
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(Ipv6Addr::LOCALHOST),
    ]);
    local_ips.sort();
    local_ips.dedup();
    let facts = NodeFacts {
        node_ips: node.addresses.clone(),
        local_ips,
        default_route_ips: Vec::new(),
    };
    // The mode's default `--nodeport-addresses`, as `render` takes it.
    let nodeport_addresses: NodePortAddresses = match mode {
        ProxyMode::Iptables | ProxyMode::Ipvs => "0.0.0.0/0,::/0",
        ProxyMode::Nftables | ProxyMode::Ebpf => "primary",
    }
    .parse()
    .expect("a valid default");
    let state_config = StateConfig {
        families: IpFamily::ALL.to_vec(),
        nodeport_addresses,
    };
    let view = NodeView {
        name: &node.name,
        zone: node.zone.as_deref(),
    };
    let desired = desired::build(&loaded.cluster, view, &facts, &state_config);
    let config = NodeConfig {
        nftables_layout: if selector & 0x04 == 0 {
            NftablesLayout::Flat
        } else {
            NftablesLayout::KubeProxy
        },
        masquerade_all: selector & 0x08 != 0,
        ..NodeConfig::default()
    };
    match mode {
        ProxyMode::Nftables => {
            let ruleset = nftables::render(&desired, &config);
            let transaction = nftables::ruleset::create_all(&ruleset);
            let _ = transaction.to_nft();
            // What the kernel would receive: forms the encoder does not produce go through
            // `nft -f` instead, which is not an error.
            let _ = nftables::netlink::encode(&transaction, 1);
        }
        ProxyMode::Iptables => {
            for family in &iptables::render(&desired, &config).families {
                let _ = iptables::ruleset::create_all(family, true).text();
            }
        }
        ProxyMode::Ipvs => {
            let _ = ipvs::render(&desired, &config).text();
        }
        ProxyMode::Ebpf => {
            let algorithm = if selector & 0x10 == 0 {
                ebpf::render::Algorithm::Random
            } else {
                ebpf::render::Algorithm::Maglev
            };
            let render_config = ebpf::render::RenderConfig {
                algorithm,
                local_ips: facts.local_ips.clone(),
                fib_forward: true,
                masquerade_all: config.masquerade_all,
                cluster_cidrs: config.cluster_cidrs.clone(),
            };
            let _ = ebpf::render::render(&desired, &render_config).lines(algorithm);
        }
    }
    true
}

/// What the proxy reads back from the kernel. `data[0] % 5` picks the reader, the rest is
/// one received datagram of netlink messages (or, for the last, `nft -j list table` output):
/// 0. an nf_tables dump of chains, sets or tables (`NetlinkKernel::list`), or the ruleset
///    generation;
/// 1. the nf_tables replies to a batch (acknowledgements and errors);
/// 2. an rtnetlink address and route dump (`--nodeport-addresses` CIDRs and
///    `default-route`);
/// 3. a ctnetlink conntrack dump (the UDP clean-up);
/// 4. `nft -j list table` (`nodeport trace --rules kernel`).
///
/// Returns whether the reader accepted the bytes.
pub fn netlink(data: &[u8]) -> bool {
    let Some((&selector, buf)) = data.split_first() else {
        return false;
    };
    match selector % 5 {
        0 => nftables::netlink::walk_replies(buf, &mut |_, _, _, payload| {
            if payload.len() >= 4 {
                let attrs = &payload[4..];
                let _ = nftables::netlink::dumped_chain(attrs);
                let _ = nftables::netlink::dumped_set(attrs);
                let _ = nftables::netlink::dumped_table_is_ours(attrs);
                let _ = nftables::netlink::generation_id(attrs);
            }
            false
        })
        .is_ok(),
        1 => {
            let mut errors = Vec::new();
            let walked = nftables::netlink::walk_replies(buf, &mut |_, seq, errno, _| {
                if errno != 0 {
                    errors.push((seq, std::io::Error::from_raw_os_error(-errno).to_string()));
                }
                false
            });
            walked.is_ok()
        }
        2 => route_dump(buf),
        3 => {
            let mut flows = Vec::new();
            crate::conntrack::parse_replies(buf, &mut |attrs| {
                flows.extend(crate::conntrack::udp_flow(attrs));
            })
            .is_ok()
        }
        _ => {
            let Ok(text) = std::str::from_utf8(buf) else {
                return false;
            };
            IpFamily::ALL
                .into_iter()
                .all(|family| nftables::listing::parse(text, family).is_ok())
        }
    }
}

/// An rtnetlink datagram of address and route messages, decoded as the `rtnetlink` crate
/// decodes it and read as [`crate::addrs`] reads a dump.
fn route_dump(mut buf: &[u8]) -> bool {
    let mut addrs = Vec::new();
    let mut routes: [BTreeMap<u32, BTreeSet<u32>>; 2] = Default::default();
    let mut decoded = false;
    while !buf.is_empty() {
        let Ok(msg) = NetlinkMessage::<RouteNetlinkMessage>::deserialize(buf) else {
            break;
        };
        decoded = true;
        let len = msg.header.length as usize;
        if let NetlinkPayload::InnerMessage(inner) = msg.payload {
            match inner {
                RouteNetlinkMessage::NewAddress(address) => {
                    addrs.extend(crate::addrs::interface_address(&address));
                }
                RouteNetlinkMessage::NewRoute(route) => {
                    let oifs = crate::addrs::default_route_oifs(&route);
                    if !oifs.is_empty() {
                        let v6 = usize::from(
                            route.header.address_family
                                == netlink_packet_route::AddressFamily::Inet6,
                        );
                        routes[v6]
                            .entry(crate::addrs::route_metric(&route))
                            .or_default()
                            .extend(oifs);
                    }
                }
                _ => {}
            }
        }
        if len == 0 || len > buf.len() {
            break;
        }
        buf = &buf[len..];
    }
    for (family, by_metric) in IpFamily::ALL.into_iter().zip(&routes) {
        let chosen = crate::addrs::choose_default_route_ips(family, by_metric, &addrs);
        for ip in chosen {
            assert!(
                addrs.iter().any(|(_, a)| *a == ip) && IpFamily::of(ip) == family,
                "default-route chose {ip}, not a {family:?} address of the dump"
            );
        }
    }
    decoded
}

/// `iptables-save` output, as the proxy reads it back from the kernel (the tools' output is
/// read as lossy UTF-8). With `data[0]` even, as `nodeport trace --rules kernel` reads it:
/// every table into the chains the tracer walks, then a remote and a local packet of each
/// family traced through them, whose fates must be probabilities summing to 1 (or none, where
/// the tracer gives the walk up). Odd, as the
/// iptables proxy reads one table (`data[0]` bit 1: filter or nat) for its chains and the
/// jumps in built-in chains, and as the `auto` variant detection reads a listing (hint chains,
/// rule count). Returns whether something was read: a chain holding a rule the tracer
/// models, or (odd) a user chain or a jump.
pub fn iptables_save(data: &[u8]) -> bool {
    let Some((&selector, rest)) = data.split_first() else {
        return false;
    };
    let text = String::from_utf8_lossy(rest);
    if selector & 1 == 1 {
        let table = if selector & 2 == 0 {
            iptables::ruleset::Table::Filter
        } else {
            iptables::ruleset::Table::Nat
        };
        let mut existing = iptables::apply::Existing::default();
        iptables::apply::parse_save(table, &text, &mut existing);
        let listing = text.into_owned();
        let _ = iptables::apply::decide_variant(&iptables::apply::VariantListings {
            nft: [listing.clone(), String::new()],
            legacy: [String::new(), listing.clone()],
            nft_all: [listing, String::new()],
        });
        return existing.chains.values().any(|c| !c.is_empty()) || !existing.jumps.is_empty();
    }
    let saved = iptables::save::parse(&text);
    let env = Env {
        local_addrs: vec![
            IpAddr::V4(Ipv4Addr::new(192, 0, 2, 4)),
            IpAddr::V6("2001:db8::4".parse().expect("an address")),
        ],
        affinity: vec![(
            "KUBE-SEP-AFFINITY".to_string(),
            "203.0.113.5".parse().expect("an address"),
        )],
        ..Env::default()
    };
    let packets = [
        Packet::remote("203.0.113.5", "192.0.2.4", Protocol::Tcp, 30080),
        Packet::local("192.0.2.4", "10.96.0.10", Protocol::Udp, 53),
        Packet::remote("2001:db8::5", "2001:db8::4", Protocol::Tcp, 30080),
        Packet::local("2001:db8::4", "fd00:10:96::10", Protocol::Sctp, 80),
    ];
    for packet in &packets {
        let trace = iptables::tracer::trace(&saved.view, packet, &env);
        // A walk the tracer gives up (a jump loop, too many random branches) has no fates.
        // Sums of products of branch weights round: 1 within 1e-6 is 1.
        let total: f64 = trace.fates.iter().map(|(_, p)| p).sum();
        assert!(
            trace.fates.is_empty()
                || (trace
                    .fates
                    .iter()
                    .all(|(_, p)| (0.0..=1.0 + 1e-6).contains(p))
                    && (total - 1.0).abs() < 1e-6),
            "{packet}: fates are not probabilities summing to 1: {:?}",
            trace.fates
        );
    }
    saved.view.chains.values().any(|rules| !rules.is_empty())
}
