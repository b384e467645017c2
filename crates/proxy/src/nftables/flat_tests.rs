//! Behaviour tests of the flat layout (`--nftables-layout flat`), on the fixtures of
//! `tests.rs`: every Kubernetes behaviour the kube-proxy layout's tests check, traced
//! through the flat rules, plus what is the flat layout's own (element-only changes, exact
//! endpoint shares, switching layouts).

use std::collections::BTreeSet;

use super::apply::{Applier, FakeKernel};
use super::names::*;
use super::ruleset::{Op, create_all};
use super::tests::*;
use super::tracer::trace;
use crate::config::NftablesLayout;
use crate::desired::NodeView;
use crate::model::{IpFamily, Protocol, ServiceName};
use crate::nodeaddr::NodePortAddresses;
use crate::objects;
use crate::trace::{Fate, Packet};

fn delivered(to: &str, masqueraded: bool) -> Fate {
    Fate::Delivered {
        dnat: Some(to.parse().unwrap()),
        masqueraded,
        affinity: vec![],
    }
}

#[test]
fn flat_rendered_transaction_matches_the_golden_text() {
    let yaml = web(
        "",
        "- {addresses: [10.244.1.1], nodeName: node-a}\n- {addresses: [10.244.2.1], nodeName: node-b}",
    );
    let text = create_all(&World::flat(&yaml).ruleset()).to_nft();
    if std::env::var_os("NODEPORT_BLESS").is_some() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/src/nftables/testdata/web-nodeport-flat.nft"
        );
        std::fs::write(path, &text).unwrap();
    }
    let golden = include_str!("testdata/web-nodeport-flat.nft");
    assert_eq!(text, golden, "golden mismatch; got:\n{text}");
}

/// The IPv4 table's chains, rules and sets.
fn count(w: &World) -> (usize, usize, usize) {
    let r = w.ruleset();
    let t = r.table(IpFamily::V4).unwrap();
    (
        t.chains().count(),
        t.chains().map(|c| c.rules.len()).sum::<usize>(),
        t.sets().count(),
    )
}

/// `n` copies of `web` (three endpoints), each with its own name, ClusterIP and NodePort, the
/// `i`th with `spec_extra(i)`.
fn numbered_webs(n: usize, spec_extra: &dyn Fn(usize) -> String) -> String {
    (0..n)
        .map(|i| {
            web(&spec_extra(i), THREE_ENDPOINTS)
                .replace("name: web,", &format!("name: web{i},"))
                .replace("name: web-1,", &format!("name: web{i}-1,"))
                .replace("service-name: web}", &format!("service-name: web{i}}}"))
                .replace("10.96.0.10", &format!("10.96.1.{i}"))
                .replace("30080", &format!("{}", 31000 + i))
        })
        .collect::<Vec<_>>()
        .join("---\n")
}

#[test]
fn flat_chains_and_rules_do_not_depend_on_the_number_of_services_or_endpoints() {
    let one = World::flat(&web("", "- {addresses: [10.244.1.1]}"));
    let many = World::flat(&numbered_webs(50, &|_| String::new()));
    assert_eq!(count(&one), count(&many));
    assert!(count(&one).0 < 30, "{:?}", count(&one));
}

#[test]
fn flat_nodeport_from_a_client_reaches_every_endpoint_uniformly_and_is_masqueraded() {
    let w = World::flat(&web("", THREE_ENDPOINTS));
    let t = w.trace(tcp(CLIENT, NODE_IP, 30080));
    assert_eq!(t.endpoints().len(), 3, "{t}");
    for ep in ["10.244.1.1:8080", "10.244.2.1:8080", "10.244.3.1:8080"] {
        assert!((t.probability_of(ep) - 1.0 / 3.0).abs() < 1e-9, "{t}");
    }
    assert!(t.all_masqueraded(true), "{t}");
}

#[test]
fn flat_endpoint_shares_are_exactly_one_nth_up_to_64_and_within_one_percent_above() {
    for n in [1usize, 2, 3, 7, 64, 65, 100] {
        let eps: String = (0..n)
            .map(|i| format!("- {{addresses: [10.244.{}.{}]}}\n", i / 200, i % 200 + 1))
            .collect();
        let w = World::flat(&web("", &eps));
        let t = w.trace(tcp("10.244.9.9", "10.96.0.10", 80));
        assert_eq!(t.endpoints().len(), n, "n={n}");
        for ep in t.endpoints() {
            let rel = t.probability_of(&ep.to_string()) * n as f64;
            if n <= 64 {
                assert!((rel - 1.0).abs() < 1e-9, "n={n}: {ep} {rel}");
            } else {
                assert!((0.99..=1.01).contains(&rel), "n={n}: {ep} {rel}");
            }
        }
    }
}

#[test]
fn flat_clusterip_from_a_pod_is_not_masqueraded_but_from_outside_the_pod_cidr_it_is() {
    let mut w = World::flat(&web("", THREE_ENDPOINTS));
    assert!(
        w.trace(tcp("10.244.9.9", "10.96.0.10", 80))
            .all_masqueraded(false)
    );
    assert!(w.trace(tcp(CLIENT, "10.96.0.10", 80)).all_masqueraded(true));
    w.config.masquerade_all = true;
    assert!(
        w.trace(tcp("10.244.9.9", "10.96.0.10", 80))
            .all_masqueraded(true)
    );
    w.config.masquerade_all = false;
    w.config.cluster_cidrs.clear();
    assert!(
        w.trace(tcp(CLIENT, "10.96.0.10", 80))
            .all_masqueraded(false)
    );
}

#[test]
fn flat_hairpin_traffic_from_an_endpoint_to_its_own_service_is_masqueraded() {
    let w = World::flat(&web("", "- {addresses: [10.244.1.1], nodeName: node-a}"));
    let t = w.trace(tcp("10.244.1.1", "10.96.0.10", 80));
    assert_eq!(t.only(), &delivered("10.244.1.1:8080", true), "{t}");
}

#[test]
fn flat_service_without_endpoints_is_rejected_on_clusterip_and_nodeport() {
    let w = World::flat(&web("", "  []"));
    assert_eq!(
        w.trace(tcp("10.244.9.9", "10.96.0.10", 80)).only(),
        &Fate::Rejected(SERVICE_ENDPOINTS_CHECK.into())
    );
    assert_eq!(
        w.trace(tcp(CLIENT, NODE_IP, 30080)).only(),
        &Fate::Rejected(NODEPORT_ENDPOINTS_CHECK.into())
    );
    let text = create_all(&w.ruleset()).to_nft();
    assert!(
        text.contains(
            "add element ip kube-proxy no-endpoint-services { 10.96.0.10 . tcp . 80 comment \"default/web\" }"
        ),
        "{text}"
    );
}

#[test]
fn flat_etp_local_drops_without_a_local_endpoint_and_keeps_the_client_ip_with_one() {
    let w = World::flat(&web(
        "  externalTrafficPolicy: Local",
        "- {addresses: [10.244.2.1], nodeName: node-b}",
    ));
    assert_eq!(
        w.trace(tcp(CLIENT, NODE_IP, 30080)).only(),
        &Fate::Dropped(NODEPORT_ENDPOINTS_CHECK.into())
    );
    assert_eq!(
        w.trace(tcp("10.244.9.9", "10.96.0.10", 80))
            .endpoints()
            .len(),
        1
    );
    let w = World::flat(&web("  externalTrafficPolicy: Local", THREE_ENDPOINTS));
    let t = w.trace(tcp(CLIENT, NODE_IP, 30080));
    assert_eq!(t.only(), &delivered("10.244.1.1:8080", false), "{t}");
}

#[test]
fn flat_etp_local_short_circuits_pod_and_node_traffic_to_all_endpoints() {
    let w = World::flat(&web(
        "  externalTrafficPolicy: Local",
        "- {addresses: [10.244.2.1], nodeName: node-b}",
    ));
    let pod = w.trace(tcp("10.244.9.9", NODE_IP, 30080));
    assert_eq!(pod.only(), &delivered("10.244.2.1:8080", false), "{pod}");
    let host = w.trace(Packet::local(NODE_IP, NODE_IP, Protocol::Tcp, 30080));
    assert_eq!(host.only(), &delivered("10.244.2.1:8080", true), "{host}");
}

#[test]
fn flat_itp_local_clusterip_reaches_only_local_endpoints_or_is_dropped() {
    let w = World::flat(&web("  internalTrafficPolicy: Local", THREE_ENDPOINTS));
    let t = w.trace(tcp("10.244.9.9", "10.96.0.10", 80));
    assert_eq!(
        t.endpoints(),
        BTreeSet::from(["10.244.1.1:8080".parse().unwrap()]),
        "{t}"
    );
    assert_eq!(w.trace(tcp(CLIENT, NODE_IP, 30080)).endpoints().len(), 3);
    let w = World::flat(&web(
        "  internalTrafficPolicy: Local",
        "- {addresses: [10.244.2.1], nodeName: node-b}",
    ));
    assert_eq!(
        w.trace(tcp("10.244.9.9", "10.96.0.10", 80)).only(),
        &Fate::Dropped(SERVICE_ENDPOINTS_CHECK.into())
    );
}

#[test]
fn flat_session_affinity_records_each_new_client_and_sends_a_known_one_back_per_destination() {
    let w = World::flat(&web(
        "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 600}}",
        THREE_ENDPOINTS,
    ));
    let mut rules = w.ruleset();
    let names = AffinityNames::new(600);
    // A new client is spread as without affinity, and its endpoint is recorded after DNAT.
    for (dst, port, map) in [
        (NODE_IP, 30080, names.nodeport_map),
        ("10.96.0.10", 80, names.dst_map),
    ] {
        let first = trace(&rules, &tcp(CLIENT, dst, port), &following_affinity(&w));
        assert_eq!(first.endpoints().len(), 3, "{first}");
        for (fate, _) in &first.fates {
            let Fate::Delivered { affinity, .. } = fate else {
                panic!("{first}")
            };
            assert_eq!(affinity, &vec![map.to_string()], "{first}");
        }
    }
    // The client known for the ClusterIP goes back to its endpoint there; its NodePort
    // connections are spread until the NodePort entry exists too (each destination keeps
    // its own entry: see the module's notes on kube-proxy's shared affinity).
    let endpoint: std::net::SocketAddr = "10.244.3.1:8080".parse().unwrap();
    let client: std::net::IpAddr = CLIENT.parse().unwrap();
    // An entry of an affinity map, as the kernel records it.
    let remember = |rules: &mut super::ruleset::Ruleset, set, key| {
        let table = rules
            .tables
            .iter_mut()
            .find(|t| t.family == IpFamily::V4)
            .unwrap();
        table.base.elements.push(super::ruleset::Element {
            set,
            key,
            value: None,
            data: Some(endpoint),
            comment: None,
        });
    };
    remember(
        &mut rules,
        names.dst_map,
        super::ruleset::ElemKey::AddrAddrProtoPort(
            client,
            "10.96.0.10".parse().unwrap(),
            Protocol::Tcp,
            80,
        ),
    );
    let known = BTreeSet::from([endpoint]);
    assert_eq!(
        trace(
            &rules,
            &tcp(CLIENT, "10.96.0.10", 80),
            &following_affinity(&w)
        )
        .endpoints(),
        known
    );
    assert_eq!(
        trace(
            &rules,
            &tcp(CLIENT, NODE_IP, 30080),
            &following_affinity(&w)
        )
        .endpoints()
        .len(),
        3
    );
    remember(
        &mut rules,
        names.nodeport_map,
        super::ruleset::ElemKey::AddrProtoPort(client, Protocol::Tcp, 30080),
    );
    let again = trace(
        &rules,
        &tcp(CLIENT, NODE_IP, 30080),
        &following_affinity(&w),
    );
    assert_eq!(again.endpoints(), known, "{again}");
    assert!(again.all_masqueraded(true), "{again}");
    // Another client is not affected.
    let other = trace(
        &rules,
        &tcp("203.0.113.77", NODE_IP, 30080),
        &following_affinity(&w),
    );
    assert_eq!(other.endpoints().len(), 3, "{other}");
    // Without endpoints the port is rejected like any other.
    let w = World::flat(&web("  sessionAffinity: ClientIP", "  []"));
    assert_eq!(
        w.trace(tcp(CLIENT, NODE_IP, 30080)).only(),
        &Fate::Rejected(NODEPORT_ENDPOINTS_CHECK.into())
    );
}

#[test]
fn flat_session_affinity_adds_chains_and_rules_per_timeout_not_per_service() {
    let services = |n: usize, timeout: &dyn Fn(usize) -> u32| -> String {
        numbered_webs(n, &|i| sticky(timeout(i)))
    };
    let plain = count(&World::flat(&web("", THREE_ENDPOINTS)));
    let one = count(&World::flat(&services(1, &|_| 600)));
    let fifty = count(&World::flat(&services(50, &|_| 600)));
    assert_eq!(one, fifty, "one timeout: the same chains, rules and sets");
    // One timeout: 6 record rules (3 protocols x destination/NodePort), one rule in each of
    // the two lookup chains; 2 sets and 2 maps. The chains are there without affinity too.
    assert_eq!(one.0, plain.0);
    assert_eq!(one.1, plain.1 + 6 + 2);
    assert_eq!(one.2, plain.2 + 4);
    let two = count(&World::flat(&services(50, &|i| {
        if i % 2 == 0 { 600 } else { 60 }
    })));
    assert_eq!(two.0, one.0);
    assert_eq!(two.1, one.1 + 6 + 2);
    assert_eq!(two.2, one.2 + 4);
}

/// Why IPv6 affinity ports keep kube-proxy's chains (flat module doc, "Session affinity"):
/// nft 1.0.6 encodes an `update @map { key : data }` correctly only when the key fits its one
/// 16-byte register. IPv4's keys do; a client key in IPv6 cannot.
#[test]
fn affinity_map_keys_fit_the_one_register_nft_gives_a_dynset_key() {
    use super::netlink::affinity_update_key_len;
    use super::ruleset::AffinityKey;
    assert_eq!(affinity_update_key_len(IpFamily::V4, AffinityKey::Dst), 16);
    assert_eq!(
        affinity_update_key_len(IpFamily::V4, AffinityKey::NodePort),
        12
    );
    assert!(affinity_update_key_len(IpFamily::V6, AffinityKey::NodePort) > 16);
    assert!(affinity_update_key_len(IpFamily::V6, AffinityKey::Dst) > 16);
}

/// The IPv6 side of the above: an IPv6 affinity port gets kube-proxy's endpoint chains and
/// affinity sets (`update @affinity-… { ip6 saddr }`, a key nft encodes correctly), no
/// affinity map, and still sends its clients to its endpoints.
#[test]
fn flat_ipv6_session_affinity_ports_keep_kube_proxys_endpoint_chains() {
    let yaml = r#"
apiVersion: v1
kind: Service
metadata: {name: web6, namespace: default}
spec: {type: NodePort, clusterIP: "fd00:96::10", clusterIPs: ["fd00:96::10"], ports: [{port: 80, nodePort: 30081}], sessionAffinity: ClientIP}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web6-1, namespace: default, labels: {kubernetes.io/service-name: web6}}
addressType: IPv6
ports: [{port: 80}]
endpoints: [{addresses: ["fd00:244::1"]}, {addresses: ["fd00:244::2"]}]
"#;
    let mut w = World::flat(yaml);
    w.state.families = IpFamily::ALL.to_vec();
    w.facts.node_ips.push("2001:db8::10".parse().unwrap());
    w.facts.local_ips.push("2001:db8::10".parse().unwrap());
    let rules = w.ruleset();
    let text = create_all(&rules).to_nft();
    let ip6 = text
        .lines()
        .filter(|l| l.contains(" ip6 "))
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        ip6.contains("{ ip6 saddr }"),
        "an affinity set per endpoint: {ip6}"
    );
    assert!(
        !ip6.contains("ct original ip6 saddr"),
        "no IPv6 affinity map is filled: {ip6}"
    );
    let t = trace(
        &rules,
        &Packet::remote("2001:db8::99", "2001:db8::10", Protocol::Tcp, 30081),
        &w.env(),
    );
    assert_eq!(t.endpoints().len(), 2, "{t}");
}

#[test]
fn flat_load_balancer_source_ranges_admit_listed_sources_only_and_the_vip_when_the_node_is_in_range()
 {
    let yaml = web(
        "  loadBalancerSourceRanges: [203.0.113.0/25]\nstatus: {loadBalancer: {ingress: [{ip: 198.51.100.200}]}}",
        THREE_ENDPOINTS,
    )
    .replace("type: NodePort", "type: LoadBalancer");
    let w = World::flat(&yaml);
    let allowed = w.trace(tcp("203.0.113.5", "198.51.100.200", 80));
    assert_eq!(allowed.endpoints().len(), 3, "{allowed}");
    let denied = w.trace(tcp("203.0.113.200", "198.51.100.200", 80));
    assert_eq!(
        denied.only(),
        &Fate::Dropped(FIREWALL_CHECK.into()),
        "{denied}"
    );
    assert_eq!(
        w.trace(tcp("203.0.113.200", NODE_IP, 30080))
            .endpoints()
            .len(),
        3
    );
    let w = World::flat(&yaml.replace("203.0.113.0/25", "192.0.2.0/24"));
    let text = create_all(&w.ruleset()).to_nft();
    assert!(
        text.contains(
            "add element ip kube-proxy firewall-allow { 198.51.100.200 . tcp . 80 . 198.51.100.200 comment \"default/web\" }"
        ),
        "{text}"
    );
    assert_eq!(
        w.trace(tcp("198.51.100.200", "198.51.100.200", 80))
            .endpoints()
            .len(),
        3
    );
}

#[test]
fn flat_external_ips_and_load_balancer_ips_reach_the_endpoints() {
    let yaml = web(
        "  externalIPs: [198.51.100.77]\nstatus: {loadBalancer: {ingress: [{ip: 198.51.100.200}]}}",
        THREE_ENDPOINTS,
    );
    let w = World::flat(&yaml);
    for vip in ["198.51.100.77", "198.51.100.200"] {
        let t = w.trace(tcp(CLIENT, vip, 80));
        assert_eq!(t.endpoints().len(), 3, "{t}");
        assert!(t.all_masqueraded(true), "{t}");
    }
}

#[test]
fn flat_terminating_endpoints_are_used_only_when_no_ready_endpoint_remains() {
    let mixed = r#"- {addresses: [10.244.1.1], nodeName: node-a}
- {addresses: [10.244.2.1], nodeName: node-b, conditions: {ready: false, serving: true, terminating: true}}"#;
    let w = World::flat(&web("", mixed));
    assert_eq!(
        w.trace(tcp(CLIENT, NODE_IP, 30080)).endpoints(),
        BTreeSet::from(["10.244.1.1:8080".parse().unwrap()])
    );
    let only_terminating = "- {addresses: [10.244.2.1], nodeName: node-b, conditions: {ready: false, serving: true, terminating: true}}";
    let w = World::flat(&web("", only_terminating));
    assert_eq!(
        w.trace(tcp(CLIENT, NODE_IP, 30080)).endpoints(),
        BTreeSet::from(["10.244.2.1:8080".parse().unwrap()])
    );
}

#[test]
fn flat_clusterip_ports_no_service_serves_are_rejected_and_unallocated_clusterips_dropped() {
    let yaml = format!(
        "{}---\napiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {{name: kubernetes}}\nspec: {{cidrs: [10.96.0.0/16]}}\n",
        web("", THREE_ENDPOINTS)
    );
    let w = World::flat(&yaml);
    assert_eq!(
        w.trace(tcp("10.244.9.9", "10.96.0.10", 81)).only(),
        &Fate::Rejected(CLUSTER_IPS_CHECK.into())
    );
    assert_eq!(
        w.trace(tcp("10.244.9.9", "10.96.0.99", 80)).only(),
        &Fate::Dropped(CLUSTER_IPS_CHECK.into())
    );
}

#[test]
fn flat_tcp_udp_and_sctp_ports_are_told_apart() {
    let yaml = r#"
apiVersion: v1
kind: Service
metadata: {name: multi, namespace: ns1}
spec:
  type: NodePort
  clusterIP: 10.96.0.20
  ports:
  - {name: t, port: 53, protocol: TCP, nodePort: 30053}
  - {name: u, port: 53, protocol: UDP, nodePort: 30053}
  - {name: s, port: 53, protocol: SCTP, nodePort: 30054}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: multi-1, namespace: ns1, labels: {kubernetes.io/service-name: multi}}
addressType: IPv4
ports: [{name: t, port: 5353, protocol: TCP}, {name: u, port: 5354, protocol: UDP}, {name: s, port: 5355, protocol: SCTP}]
endpoints: [{addresses: [10.244.1.1]}]
"#;
    let w = World::flat(yaml);
    for (proto, port, want) in [
        (Protocol::Tcp, 30053, "10.244.1.1:5353"),
        (Protocol::Udp, 30053, "10.244.1.1:5354"),
        (Protocol::Sctp, 30054, "10.244.1.1:5355"),
    ] {
        let t = w.trace(Packet::remote(CLIENT, NODE_IP, proto, port));
        assert_eq!(
            t.endpoints(),
            BTreeSet::from([want.parse().unwrap()]),
            "{t}"
        );
        let t = w.trace(Packet::remote("10.244.9.9", "10.96.0.20", proto, 53));
        assert_eq!(
            t.endpoints(),
            BTreeSet::from([want.parse().unwrap()]),
            "{t}"
        );
    }
}

#[test]
fn flat_nodeport_answers_only_on_the_selected_node_addresses() {
    let mut w = World::flat(&web("", THREE_ENDPOINTS));
    assert_eq!(w.trace(tcp(CLIENT, NODE_IP, 30080)).endpoints().len(), 3);
    assert!(w.trace(tcp(CLIENT, NODE_IP2, 30080)).endpoints().is_empty());
    w.state.nodeport_addresses = "198.51.100.0/24".parse::<NodePortAddresses>().unwrap();
    assert_eq!(w.trace(tcp(CLIENT, NODE_IP2, 30080)).endpoints().len(), 3);
    assert!(w.trace(tcp(CLIENT, NODE_IP, 30080)).endpoints().is_empty());
    w.state.nodeport_addresses = "0.0.0.0/0".parse().unwrap();
    let text = create_all(&w.ruleset()).to_nft();
    assert!(!text.contains("nodeport-ips"), "{text}");
    assert_eq!(w.trace(tcp(CLIENT, NODE_IP2, 30080)).endpoints().len(), 3);
    assert_eq!(w.trace(tcp(CLIENT, NODE_IP, 30080)).endpoints().len(), 3);
}

#[test]
fn flat_localhost_nodeports_are_masqueraded_and_127_from_outside_is_dropped() {
    let mut w = World::flat(&web("", THREE_ENDPOINTS));
    w.facts.local_ips.push("127.0.0.1".parse().unwrap());
    w.state.nodeport_addresses = "127.0.0.0/8,198.51.100.0/24".parse().unwrap();
    let t = w.trace(Packet::local(
        "127.0.0.1",
        "127.0.0.1",
        Protocol::Tcp,
        30080,
    ));
    assert_eq!(t.endpoints().len(), 3, "{t}");
    assert!(t.all_masqueraded(true), "{t}");
    let t = w.trace(tcp(CLIENT, "127.0.0.1", 10249));
    assert_eq!(t.only(), &Fate::Dropped(LOCALNET_CHECK.into()), "{t}");
}

#[test]
fn flat_ipv6_services_render_into_the_ip6_table() {
    let yaml = r#"
apiVersion: v1
kind: Service
metadata: {name: web6, namespace: default}
spec: {type: NodePort, clusterIP: "fd00:96::10", clusterIPs: ["fd00:96::10"], ports: [{port: 80, nodePort: 30081}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web6-1, namespace: default, labels: {kubernetes.io/service-name: web6}}
addressType: IPv6
ports: [{port: 80}]
endpoints: [{addresses: ["fd00:244::1"]}]
"#;
    let mut w = World::flat(yaml);
    w.state.families = IpFamily::ALL.to_vec();
    w.facts.node_ips.push("2001:db8::10".parse().unwrap());
    w.facts.local_ips.push("2001:db8::10".parse().unwrap());
    let rules = w.ruleset();
    let text = create_all(&rules).to_nft();
    assert!(
        text.contains("add element ip6 kube-proxy service-endpoints { fd00:96::10 . tcp . 80 . 0 comment \"default/web6\" : fd00:244::1 . 80 }"),
        "{text}"
    );
    let t = trace(
        &rules,
        &Packet::remote("2001:db8::99", "2001:db8::10", Protocol::Tcp, 30081),
        &w.env(),
    );
    assert_eq!(
        t.endpoints(),
        BTreeSet::from(["[fd00:244::1]:80".parse().unwrap()]),
        "{t}"
    );
}

// ---- applying ----

fn change_endpoints(
    w: &mut World,
    d: &mut crate::desired::DesiredState,
    endpoints: &str,
) -> BTreeSet<crate::model::ServicePortName> {
    let slice = objects::load(&web("", endpoints)).unwrap().cluster;
    for (k, v) in slice.slices.iter() {
        w.cluster.update_slice(k.clone(), Some(v.clone()));
    }
    let changes = w.cluster.take_changes();
    d.refresh_services(&w.cluster, NodeView::named(NODE), &changes.services)
}

fn only_elements(tx: &super::ruleset::Transaction) {
    for (_, op) in &tx.ops {
        assert!(
            matches!(op, Op::AddElement(_) | Op::DeleteElement(..)),
            "not an element operation: {op:?}"
        );
    }
}

#[test]
fn flat_endpoint_changes_new_services_and_deleted_ones_are_element_operations_only() {
    let mut w = World::flat(&web("", THREE_ENDPOINTS));
    let (mut a, mut d) = applier_with(&w);
    // One endpoint gone, then back, then another added.
    for eps in [
        "- {addresses: [10.244.1.1], nodeName: node-a}\n- {addresses: [10.244.2.1], nodeName: node-b}",
        THREE_ENDPOINTS,
        "- {addresses: [10.244.1.1], nodeName: node-a}\n- {addresses: [10.244.2.1], nodeName: node-b}\n- {addresses: [10.244.3.1], nodeName: node-c}\n- {addresses: [10.244.4.1]}",
    ] {
        let touched = change_endpoints(&mut w, &mut d, eps);
        assert_eq!(touched.len(), 1);
        let r = a.sync(&d, &w.config, Some(&touched)).unwrap();
        assert!(!r.full);
        assert_eq!(r.deleted_chains, 0);
        only_elements(a.kernel().history.last().unwrap());
        let p = tcp(CLIENT, NODE_IP, 30080);
        assert_eq!(kernel_trace(&a, &w, p.clone()).fates, w.trace(p).fates);
    }
    // A new Service, then the first one deleted.
    let api = web("", "- {addresses: [10.244.5.5]}")
        .replace("web", "api")
        .replace("10.96.0.10", "10.96.0.11")
        .replace("30080", "30081");
    let loaded = objects::load(&api).unwrap().cluster;
    let name = ServiceName::new("default", "api");
    w.cluster
        .update_service(name.clone(), loaded.services.get(&name).cloned());
    let key = ServiceName::new("default", "api-1");
    w.cluster
        .update_slice(key.clone(), loaded.slices.get(&key).cloned());
    w.cluster
        .update_service(ServiceName::new("default", "web"), None);
    let changes = w.cluster.take_changes();
    let touched = d.refresh_services(&w.cluster, NodeView::named(NODE), &changes.services);
    a.sync(&d, &w.config, Some(&touched)).unwrap();
    only_elements(a.kernel().history.last().unwrap());
    assert_eq!(
        kernel_trace(&a, &w, tcp(CLIENT, NODE_IP, 30081)).only(),
        &delivered("10.244.5.5:8080", true)
    );
    assert_eq!(
        kernel_trace(&a, &w, tcp("10.244.9.9", "10.96.0.10", 80)).only(),
        &Fate::Delivered {
            dnat: None,
            masqueraded: false,
            affinity: vec![]
        },
        "web's ClusterIP is no longer served"
    );
    // Nothing changed: nothing sent.
    let r = a.sync(&d, &w.config, Some(&BTreeSet::new())).unwrap();
    assert_eq!(r.ops, 0);
}

#[test]
fn switching_layouts_on_restart_takes_over_in_one_transaction_both_ways() {
    let affinity = web("  sessionAffinity: ClientIP", THREE_ENDPOINTS);
    let plain = web("", THREE_ENDPOINTS);
    for start in [NftablesLayout::KubeProxy, NftablesLayout::Flat] {
        for yaml in [&affinity, &plain] {
            let mut w1 = World::new(yaml);
            w1.config.nftables_layout = start;
            let (a, d) = applier_with(&w1);
            let mut w2 = World::new(yaml);
            w2.config.nftables_layout = match start {
                NftablesLayout::Flat => NftablesLayout::KubeProxy,
                NftablesLayout::KubeProxy => NftablesLayout::Flat,
            };
            // A new process with the other layout on the same kernel.
            let mut b = Applier::new(a.kernel().clone());
            let before = b.kernel().history.len();
            let r = b.sync(&d, &w2.config, Some(&BTreeSet::new())).unwrap();
            assert!(r.full);
            // One main transaction (the traffic never sees a half-switched table), then the
            // clean-up of the other layout's chains.
            let main = &b.kernel().history[before];
            assert!(
                main.ops
                    .iter()
                    .all(|(_, op)| !matches!(op, Op::DeleteTable))
            );
            for p in [
                tcp(CLIENT, NODE_IP, 30080),
                tcp("10.244.9.9", "10.96.0.10", 80),
            ] {
                let got = trace(&b.kernel().ruleset(), &p, &w2.env());
                assert_eq!(got.fates, w2.trace(p.clone()).fates, "{start:?}: {got}");
                assert_eq!(got.endpoints().len(), 3, "{got}");
            }
            let kernel: FakeKernel = b.kernel().clone();
            let chains = &kernel.tables[&IpFamily::V4].chains;
            let expected = w2.ruleset();
            let want: BTreeSet<&str> = expected
                .table(IpFamily::V4)
                .unwrap()
                .chains()
                .map(|c| c.name.as_str())
                .collect();
            let have: BTreeSet<&str> = chains.keys().map(String::as_str).collect();
            assert_eq!(have, want, "the old layout's chains are gone");
        }
    }
}

#[test]
fn partial_syncs_size_the_sets_as_a_full_render_of_the_same_state_would() {
    // The applier keeps the sets' bounds as a running sum over the changed ports; after any
    // sequence of changes it must size every set as counting all ports afresh does.
    let mut w = World::flat(&web("", THREE_ENDPOINTS));
    let (mut a, mut d) = applier_with(&w);
    let check = |a: &Applier<FakeKernel>, d: &crate::desired::DesiredState, w: &World| {
        let state = d.family(IpFamily::V4).unwrap();
        for set in super::render::render_base(state, &w.config).sets {
            let have = &a.kernel().tables[&IpFamily::V4].sets[&set.name].0;
            assert_eq!(have.size, set.size, "{}", set.name);
        }
    };
    // 100 endpoints take 12,800 slots per destination: the endpoint maps grow past 4,096.
    let many: String = (0..100)
        .map(|i| format!("- {{addresses: [10.244.7.{}]}}\n", i + 1))
        .collect();
    for eps in [
        many.as_str(),
        THREE_ENDPOINTS,
        "- {addresses: [10.244.1.1]}",
        &many,
    ] {
        let touched = change_endpoints(&mut w, &mut d, eps);
        a.sync(&d, &w.config, Some(&touched)).unwrap();
        check(&a, &d, &w);
    }
    // A Service deleted: its bounds leave the sum.
    w.cluster
        .update_service(ServiceName::new("default", "web"), None);
    let changes = w.cluster.take_changes();
    let touched = d.refresh_services(&w.cluster, NodeView::named(NODE), &changes.services);
    a.sync(&d, &w.config, Some(&touched)).unwrap();
    check(&a, &d, &w);
}

#[test]
fn a_set_that_must_grow_is_recreated_larger_by_a_full_sync_and_stays_filled() {
    let mut w = World::flat(&web("", THREE_ENDPOINTS));
    let (mut a, mut d) = applier_with(&w);
    let size = |a: &Applier<FakeKernel>| {
        a.kernel().tables[&IpFamily::V4].sets[SERVICE_ENDPOINTS]
            .0
            .size
    };
    assert_eq!(size(&a), Some(4096));
    // 100 endpoints take 12,800 slots per destination: the map grows to 32,768.
    let eps: String = (0..100)
        .map(|i| format!("- {{addresses: [10.244.7.{}]}}\n", i + 1))
        .collect();
    let touched = change_endpoints(&mut w, &mut d, &eps);
    let r = a.sync(&d, &w.config, Some(&touched)).unwrap();
    assert!(
        r.full,
        "re-created sets are refilled in one full transaction"
    );
    assert_eq!(size(&a), Some(32_768));
    let p = tcp(CLIENT, NODE_IP, 30080);
    let t = kernel_trace(&a, &w, p.clone());
    assert_eq!(t.endpoints().len(), 100, "{t}");
    assert_eq!(t.fates, w.trace(p).fates);
    // Back to three: the size stays where it is... until the next bucket, here 4,096.
    let touched = change_endpoints(&mut w, &mut d, THREE_ENDPOINTS);
    let r = a.sync(&d, &w.config, Some(&touched)).unwrap();
    assert!(r.full);
    assert_eq!(size(&a), Some(4096));
    assert_eq!(
        kernel_trace(&a, &w, tcp(CLIENT, NODE_IP, 30080))
            .endpoints()
            .len(),
        3
    );
}

#[test]
fn flat_a_refused_transaction_keeps_the_old_rules_and_the_retry_is_a_full_sync() {
    let mut w = World::flat(&web("", THREE_ENDPOINTS));
    let (mut a, mut d) = applier_with(&w);
    let before = a.kernel().tables.clone();
    let touched = change_endpoints(&mut w, &mut d, "- {addresses: [10.244.9.1]}");
    a.kernel_mut().fail_next = 1;
    assert!(a.sync(&d, &w.config, Some(&touched)).is_err());
    assert_eq!(a.kernel().tables, before, "the old rules serve on");
    assert!(a.needs_full_sync());
    let r = a.sync(&d, &w.config, Some(&BTreeSet::new())).unwrap();
    assert!(r.full);
    assert_eq!(
        kernel_trace(&a, &w, tcp(CLIENT, NODE_IP, 30080)).only(),
        &delivered("10.244.9.1:8080", true)
    );
}

/// The world's environment, following the clients recorded in affinity maps.
fn following_affinity(w: &World) -> crate::trace::Env {
    crate::trace::Env {
        recorded_affinity: true,
        ..w.env()
    }
}

/// `web` with session affinity of `timeout` seconds.
fn sticky(timeout: u32) -> String {
    format!(
        "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {{clientIP: {{timeoutSeconds: {timeout}}}}}"
    )
}

/// Plays the kernel recording `client` → `to` in the NodePort affinity map of `timeout`.
fn record(a: &mut Applier<FakeKernel>, timeout: u32, client: &str, to: &str) {
    let map = AffinityNames::new(timeout).nodeport_map;
    let key = super::ruleset::ElemKey::AddrProtoPort(client.parse().unwrap(), Protocol::Tcp, 30080);
    a.kernel_mut()
        .tables
        .get_mut(&IpFamily::V4)
        .unwrap()
        .sets
        .get_mut(map)
        .expect("the map exists")
        .1
        .insert(
            key,
            super::ruleset::Element {
                set: map,
                key,
                value: None,
                data: Some(to.parse().unwrap()),
                comment: None,
            },
        );
}

fn recorded(a: &Applier<FakeKernel>, timeout: u32) -> BTreeSet<(String, String)> {
    let map = AffinityNames::new(timeout).nodeport_map;
    a.kernel().tables[&IpFamily::V4]
        .sets
        .get(map)
        .map(|(_, els)| {
            els.values()
                .map(|e| match e.key {
                    super::ruleset::ElemKey::AddrProtoPort(c, ..) => {
                        (c.to_string(), e.data.unwrap().to_string())
                    }
                    other => panic!("{other:?}"),
                })
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn flat_affinity_entries_of_a_removed_endpoint_go_with_it_and_the_others_stay() {
    let mut w = World::flat(&web(&sticky(600), THREE_ENDPOINTS));
    let (mut a, mut d) = applier_with(&w);
    record(&mut a, 600, "203.0.113.5", "10.244.1.1:8080");
    record(&mut a, 600, "203.0.113.6", "10.244.2.1:8080");
    // The kernel sends the known client back.
    let known = tcp("203.0.113.6", NODE_IP, 30080);
    assert_eq!(
        trace(&a.kernel().ruleset(), &known, &following_affinity(&w)).endpoints(),
        BTreeSet::from(["10.244.2.1:8080".parse().unwrap()])
    );
    // Traced as a new client, it is spread as the rules say.
    assert_eq!(kernel_trace(&a, &w, known).endpoints().len(), 3);
    // An endpoint added makes nothing stale: no map is read back (a read costs the kernel
    // about 10 µs per recorded client).
    let reads = a.kernel().affinity_reads.len();
    let touched = change_endpoints(
        &mut w,
        &mut d,
        &format!("{THREE_ENDPOINTS}\n- {{addresses: [10.244.4.1], nodeName: node-d}}"),
    );
    let r = a.sync(&d, &w.config, Some(&touched)).unwrap();
    assert_eq!((r.full, r.affinity_deleted), (false, 0));
    assert_eq!(a.kernel().affinity_reads.len(), reads);
    let touched = change_endpoints(
        &mut w,
        &mut d,
        "- {addresses: [10.244.2.1], nodeName: node-b}\n- {addresses: [10.244.3.1], nodeName: node-c}",
    );
    let r = a.sync(&d, &w.config, Some(&touched)).unwrap();
    assert!(!r.full);
    assert_eq!(r.affinity_deleted, 1);
    assert_eq!(
        a.kernel().affinity_reads[reads..],
        ["affinity-ips-600", "affinity-nodeports-600"]
    );
    assert_eq!(
        recorded(&a, 600),
        BTreeSet::from([("203.0.113.6".into(), "10.244.2.1:8080".into())])
    );
    // The periodic full resync reads no map (nothing it changes makes an entry stale).
    let reads = a.kernel().affinity_reads.len();
    a.request_full_sync();
    let r = a.sync(&d, &w.config, Some(&BTreeSet::new())).unwrap();
    assert!(r.full);
    assert_eq!(r.affinity_deleted, 0);
    assert_eq!(a.kernel().affinity_reads.len(), reads);
    assert_eq!(recorded(&a, 600).len(), 1);
    // After a failed sync every map is read back, and what is still valid stays.
    a.kernel_mut().fail_next = 1;
    assert!(a.sync(&d, &w.config, Some(&BTreeSet::new())).is_err());
    let r = a.sync(&d, &w.config, Some(&BTreeSet::new())).unwrap();
    assert_eq!(r.affinity_deleted, 0);
    assert_eq!(a.kernel().affinity_reads.len(), reads + 2);
    assert_eq!(recorded(&a, 600).len(), 1);
}

#[test]
fn flat_affinity_switched_on_and_off_with_a_timeout_in_use_is_element_operations_only() {
    // `api` keeps the 600 s timeout in use; `web` switches affinity on and off.
    let api = web(&sticky(600), "- {addresses: [10.244.5.5]}")
        .replace("web", "api")
        .replace("10.96.0.10", "10.96.0.11")
        .replace("30080", "30081");
    let both = |web_extra: &str| format!("{}---\n{api}", web(web_extra, THREE_ENDPOINTS));
    let mut w = World::flat(&both(""));
    let (mut a, mut d) = applier_with(&w);
    for extra in [sticky(600), String::new()] {
        let loaded = objects::load(&both(&extra)).unwrap().cluster;
        let name = ServiceName::new("default", "web");
        w.cluster
            .update_service(name.clone(), loaded.services.get(&name).cloned());
        let changes = w.cluster.take_changes();
        let touched = d.refresh_services(&w.cluster, NodeView::named(NODE), &changes.services);
        if extra.is_empty() {
            // Switched off: the client recorded for it goes.
            record(&mut a, 600, "203.0.113.5", "10.244.1.1:8080");
        }
        let r = a.sync(&d, &w.config, Some(&touched)).unwrap();
        assert!(!r.full);
        only_elements(
            &a.kernel().history[a.kernel().history.len() - 1 - r.affinity_deleted.min(1)],
        );
        if extra.is_empty() {
            assert_eq!(r.affinity_deleted, 1);
            assert!(recorded(&a, 600).is_empty());
        }
        let p = tcp(CLIENT, NODE_IP, 30080);
        assert_eq!(kernel_trace(&a, &w, p.clone()).fates, w.trace(p).fates);
    }
}

/// The folded path's lines, as `nodeport trace` prints them.
fn path_lines(t: &crate::trace::Trace) -> Vec<String> {
    let path = crate::trace::path::fold(&t.walks, crate::trace::path::Choosing::Random);
    let mut text = String::new();
    crate::trace::path::write_lines(&mut text, &path).unwrap();
    text.lines().map(str::to_string).collect()
}

#[test]
fn flat_a_nodeports_path_is_each_rule_it_matched_with_its_elements_and_the_random_choice_once() {
    let w = World::flat(&web("", THREE_ENDPOINTS));
    let t = w.trace(tcp(CLIENT, NODE_IP, 30080));
    let lines = path_lines(&t);
    let at = |prefix: &str| {
        lines
            .iter()
            .position(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("{prefix}: {lines:#?}"))
    };
    // Each hook's chains in the kernel's order, jumps before the chains they run, each
    // regular chain's end and each base chain's policy, as nf_tables' trace events say.
    let order = [
        "path        ip kube-proxy filter-prerouting-pre-dnat rule #1: jump firewall-check",
        "path        ip kube-proxy firewall-check: continue",
        "path        ip kube-proxy filter-prerouting-pre-dnat: continue",
        "path        ip kube-proxy filter-prerouting-pre-dnat: policy accept",
        "path        ip kube-proxy nat-prerouting rule #1: jump services",
        "path        ip kube-proxy services rule #6: jump nodeport-cluster-policy; @nodeport-ips { 192.0.2.10 }, @masquerade-nodeports { tcp . 30080 comment \"default/web\" }",
        "path        ip kube-proxy pick-nodeport-endpoints: random choice, one of 3",
        "path        ip kube-proxy filter-forward: policy accept",
        "path        ip kube-proxy masquerading rule #4: accept",
    ];
    let places: Vec<usize> = order.iter().map(|l| at(l)).collect();
    assert!(places.windows(2).all(|w| w[0] < w[1]), "{lines:#?}");
    // The choice once, each endpoint with its share and the map element that sends it
    // there (three endpoints: the rule `numgen random mod 3 offset 3`, slots 3 to 5).
    assert_eq!(
        lines.iter().filter(|l| l.contains("random choice")).count(),
        1
    );
    for (slot, ip) in [(3, "10.244.1.1"), (4, "10.244.2.1"), (5, "10.244.3.1")] {
        let to = at(&format!("path          33.33% to {ip}:8080"));
        assert_eq!(
            lines[to + 1],
            format!(
                "path            ip kube-proxy pick-nodeport-endpoints rule #4: accept; \
                 @nodeport-endpoints {{ tcp . 30080 . {slot} comment \"default/web\" : {ip} . 8080 }}"
            ),
            "{lines:#?}"
        );
    }
    // Flattened for one endpoint: that walk's steps.
    let path = crate::trace::path::fold(&t.walks, crate::trace::path::Choosing::Random);
    let to: std::net::SocketAddr = "10.244.2.1:8080".parse().unwrap();
    let walk = t
        .walks
        .iter()
        .find(|w| matches!(w.fate, Fate::Delivered { dnat: Some(d), .. } if d == to))
        .unwrap();
    assert_eq!(
        crate::trace::path::Step::flatten(&path, Some(to)),
        walk.steps
    );
}

#[test]
fn flat_a_reject_ends_the_path_at_its_rule() {
    let w = World::flat(&web("", ""));
    let t = w.trace(tcp(CLIENT, NODE_IP, 30080));
    let lines = path_lines(&t);
    assert_eq!(
        lines.last().unwrap(),
        "path        ip kube-proxy nodeport-endpoints-check rule #1: drop; @nodeport-ips { 192.0.2.10 }, @no-endpoint-nodeports { tcp . 30080 comment \"default/web\" }",
        "{lines:#?}"
    );
}

#[test]
fn flat_the_nodes_own_connection_to_its_nodeport_without_endpoints_is_rejected_back_in_through_loopback()
 {
    // Out through output and postrouting untranslated, then in again through loopback:
    // filter-input's no-endpoint check rejects it (traced as passed on before).
    let w = World::flat(&web("", ""));
    let t = w.trace(Packet::local(NODE_IP, NODE_IP, Protocol::Tcp, 30080));
    assert_eq!(
        t.only(),
        &Fate::Rejected(NODEPORT_ENDPOINTS_CHECK.into()),
        "{t}"
    );
    let lines = path_lines(&t);
    assert!(
        lines.iter().any(|l| l.starts_with(
            "path        ip kube-proxy filter-input rule #1: jump nodeport-endpoints-check"
        )),
        "{lines:#?}"
    );
    // Its NAT was done on the way out: no nat chain runs on the way back in.
    let back = lines
        .iter()
        .position(|l| l.contains("filter-prerouting-pre-dnat"))
        .unwrap();
    assert!(
        !lines[back..].iter().any(|l| l.contains(" nat-")),
        "{lines:#?}"
    );
    // With endpoints it is DNATed on the way out, to a pod: nothing comes back in.
    let w = World::flat(&web("", THREE_ENDPOINTS));
    let t = w.trace(Packet::local(NODE_IP, NODE_IP, Protocol::Tcp, 30080));
    assert_eq!(t.endpoints().len(), 3, "{t}");
    assert!(
        !path_lines(&t).iter().any(|l| l.contains("filter-input")),
        "{t}"
    );
}
