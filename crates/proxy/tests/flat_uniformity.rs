//! The flat layout's endpoint choice with real packets: each endpoint of a Service gets its
//! share of new connections, 1/N, checked with a chi-square test.
//!
//! How: in a throwaway namespace holding the flat table (programmed over netlink by the
//! applier), a process sends one UDP datagram per new flow to a ClusterIP, each from its own
//! socket bound to one of 20,000 distinct source addresses (an AnyIP route makes all of
//! 198.18.0.0/16 local) with a kernel-chosen port, so no two flows share a conntrack entry
//! and nothing waits in TIME_WAIT. The DNAT choice of each flow is read back from conntrack
//! (the reply source of each entry is the endpoint chosen). The datagrams leave through a
//! veth towards a second namespace that drops them; the count is all that matters. UDP keeps
//! the run short: no handshake, one packet per connection.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};

use nodeport_proxy::config::{NftablesLayout, NodeConfig};
use nodeport_proxy::desired::{self, NodeView, StateConfig};
use nodeport_proxy::model::IpFamily;
use nodeport_proxy::nftables::apply::{Applier, NftCommand};
use nodeport_proxy::nftables::netlink::NetlinkKernel;
use nodeport_proxy::nodeaddr::NodeFacts;
use nodeport_proxy::objects;
use nodeport_testbed::{Netns, require_privileged, veth};

/// New flows per Service.
const FLOWS: u32 = 20_000;

/// A ClusterIP Service `ns1/svc<n>` at 10.96.0.<n>:80 with `n` endpoints.
fn service(n: usize) -> String {
    let endpoints: String = (0..n)
        .map(|i| format!("- {{addresses: [10.244.{}.{}]}}\n", n, i + 1))
        .collect();
    format!(
        r#"---
apiVersion: v1
kind: Service
metadata: {{name: svc{n}, namespace: ns1}}
spec: {{clusterIP: 10.96.0.{n}, ports: [{{port: 80, protocol: UDP}}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: svc{n}-1, namespace: ns1, labels: {{kubernetes.io/service-name: svc{n}}}}}
addressType: IPv4
ports: [{{port: 8080, protocol: UDP}}]
endpoints:
{endpoints}"#
    )
}

/// The chi-square statistic's critical value at p = 1e-6 for `df` degrees of freedom
/// (the upper tail of the regularized gamma function, solved by bisection; -2 ln 1e-6 for
/// df = 2): a correct dataplane exceeds it once in a million runs.
fn critical(df: usize) -> f64 {
    match df {
        2 => 27.631,
        6 => 38.258,
        99 => 180.792,
        _ => panic!("no critical value for {df} degrees of freedom"),
    }
}

#[test]
fn each_of_3_7_and_100_endpoints_gets_one_nth_of_20000_real_new_connections() {
    if !require_privileged(
        "each_of_3_7_and_100_endpoints_gets_one_nth_of_20000_real_new_connections",
    ) {
        return;
    }
    let node = Netns::new("flatuniform").unwrap();
    let sink = Netns::new("flatsink").unwrap();
    veth(&node, "eth0", &sink, "eth0").unwrap();
    node.add_addr("eth0", "192.0.2.1/24").unwrap();
    sink.add_addr("eth0", "192.0.2.2/24").unwrap();
    node.run(&["ip", "route", "add", "default", "via", "192.0.2.2"])
        .unwrap();
    // AnyIP: every address of 198.18.0.0/16 is local, so a socket may bind any of them.
    node.run(&["ip", "route", "add", "local", "198.18.0.0/16", "dev", "lo"])
        .unwrap();

    let sizes = [3usize, 7, 100];
    let yaml: String = sizes.iter().map(|n| service(*n)).collect();
    let cluster = objects::load(&yaml).unwrap().cluster;
    let facts = NodeFacts {
        node_ips: vec!["192.0.2.1".parse().unwrap()],
        local_ips: vec!["192.0.2.1".parse().unwrap()],
        ..Default::default()
    };
    let state = StateConfig {
        families: vec![IpFamily::V4],
        ..Default::default()
    };
    let config = NodeConfig {
        nftables_layout: NftablesLayout::Flat,
        cluster_cidrs: vec!["10.244.0.0/16".parse().unwrap()],
        ..Default::default()
    };
    let d = desired::build(&cluster, NodeView::named("node-a"), &facts, &state);
    let kernel = NetlinkKernel::in_namespace(
        &std::path::Path::new("/run/netns").join(node.name()),
        NftCommand::in_netns(node.name()),
    )
    .unwrap();
    let mut applier = Applier::new(kernel);
    applier.sync(&d, &config, None).expect("flat ruleset");

    for n in sizes {
        let vip = Ipv4Addr::new(10, 96, 0, n as u8);
        node.enter(|| {
            for i in 0..FLOWS {
                let src = Ipv4Addr::new(198, 18, (i / 250) as u8, (i % 250 + 1) as u8);
                let socket = UdpSocket::bind(SocketAddrV4::new(src, 0)).unwrap();
                socket.send_to(b"x", SocketAddrV4::new(vip, 80)).unwrap();
            }
        })
        .unwrap();
        let listing = node
            .run(&[
                "conntrack",
                "-L",
                "-p",
                "udp",
                "--orig-dst",
                &vip.to_string(),
            ])
            .unwrap();
        // `udp 17 29 src=<client> dst=<vip> sport=.. dport=80 [UNREPLIED] src=<endpoint> ...`
        let mut counts: BTreeMap<String, u32> = BTreeMap::new();
        for line in listing.lines() {
            let endpoint = line
                .split_whitespace()
                .filter_map(|w| w.strip_prefix("src="))
                .nth(1)
                .unwrap_or_else(|| panic!("no reply source in {line:?}"));
            *counts.entry(endpoint.to_string()).or_default() += 1;
        }
        let total: u32 = counts.values().sum();
        assert_eq!(total, FLOWS, "one conntrack entry per flow");
        assert_eq!(counts.len(), n, "every endpoint chosen: {counts:?}");
        let expected = f64::from(FLOWS) / n as f64;
        let chi2: f64 = counts
            .values()
            .map(|c| (f64::from(*c) - expected).powi(2) / expected)
            .sum();
        assert!(
            chi2 < critical(n - 1),
            "N={n}: chi-square {chi2:.1} above the p=1e-6 value {} for {} degrees of freedom: {counts:?}",
            critical(n - 1),
            n - 1
        );
        eprintln!(
            "N={n}: chi-square {chi2:.1} (p=1e-6 bound {})",
            critical(n - 1)
        );
    }
}
