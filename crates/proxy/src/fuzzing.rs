//! Entry points for fuzzing what the proxy reads: its configuration (`KubeProxyConfiguration`,
//! `--nodeport-addresses`). The fuzz targets under `fuzz/` (cargo-fuzz, nightly) and the
//! replay of their corpora in `cargo test` (`tests/fuzz_corpus.rs`, stable) both call these,
//! so that a finding stays a regression test without nightly.
//!
//! Each call must return normally whatever the bytes are; a panic or a hang is a finding.
//! Where the code promises more than not crashing (a value that prints back as itself), the
//! entry point asserts it.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::config::{KubeProxyConfiguration, NftablesLayout, ProxyMode};
use crate::model::IpFamily;
use crate::nodeaddr::{NodeFacts, NodePortAddresses};

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
