//! Golden and behaviour tests of the nftables backend: render, trace, apply (fake kernel).
//! The tests here use kube-proxy's layout (`--nftables-layout kube-proxy`); the flat
//! layout's are in `flat_tests.rs`, on the same fixtures.
//!
//! Behaviour is asserted with the tracer over the rendered rules, kube-proxy's way (its
//! `nftables/helpers_test.go` packet-flow tests): each test names the Kubernetes behaviour it
//! mirrors.

use std::collections::BTreeSet;

use super::apply::{Applier, FakeKernel};
use super::render::render;
use super::ruleset::{Op, Ruleset, create_all};
use super::tracer::trace;
use crate::config::{EndpointChoice, NftablesLayout, NodeConfig};
use crate::desired::{self, DesiredState, NodeView, StateConfig};
use crate::model::{IpFamily, Protocol};
use crate::nodeaddr::{NodeFacts, NodePortAddresses};
use crate::objects::{self, Cluster};
use crate::trace::{Env, Fate, Packet};

pub(super) const NODE: &str = "node-a";
pub(super) const NODE_IP: &str = "192.0.2.10";
pub(super) const NODE_IP2: &str = "198.51.100.10";
pub(super) const CLIENT: &str = "203.0.113.5";
pub(super) const POD_CIDR: &str = "10.244.0.0/16";

/// A test world: objects from YAML, node `node-a` with two addresses, pod CIDR 10.244/16.
pub(super) struct World {
    pub(super) cluster: Cluster,
    pub(super) facts: NodeFacts,
    pub(super) state: StateConfig,
    pub(super) config: NodeConfig,
}

impl World {
    pub(super) fn new(yaml: &str) -> Self {
        let loaded = objects::load(yaml).expect("fixture parses");
        World {
            cluster: loaded.cluster,
            facts: NodeFacts {
                node_ips: vec![NODE_IP.parse().unwrap()],
                local_ips: vec![NODE_IP.parse().unwrap(), NODE_IP2.parse().unwrap()],
                ..Default::default()
            },
            state: StateConfig {
                families: vec![IpFamily::V4],
                ..Default::default()
            },
            config: NodeConfig {
                cluster_cidrs: vec![POD_CIDR.parse().unwrap()],
                nftables_layout: NftablesLayout::KubeProxy,
                ..Default::default()
            },
        }
    }

    /// The same world in the flat layout.
    pub(super) fn flat(yaml: &str) -> Self {
        let mut w = Self::new(yaml);
        w.config.nftables_layout = NftablesLayout::Flat;
        w
    }

    pub(super) fn desired(&self) -> DesiredState {
        desired::build(
            &self.cluster,
            NodeView::named(NODE),
            &self.facts,
            &self.state,
        )
    }

    pub(super) fn ruleset(&self) -> Ruleset {
        render(&self.desired(), &self.config)
    }

    pub(super) fn env(&self) -> Env {
        Env {
            local_addrs: self.facts.local_ips.clone(),
            ..Env::default()
        }
    }

    pub(super) fn trace(&self, packet: Packet) -> crate::trace::Trace {
        trace(&self.ruleset(), &packet, &self.env())
    }
}

/// A NodePort Service `default/web` (ClusterIP 10.96.0.10:80, NodePort 30080) with three
/// endpoints, one of them on this node, plus extra spec lines.
pub(super) fn web(spec_extra: &str, endpoints: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Service
metadata: {{name: web, namespace: default}}
spec:
  type: NodePort
  clusterIP: 10.96.0.10
  ports: [{{port: 80, targetPort: 8080, nodePort: 30080}}]
{spec_extra}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: web-1, namespace: default, labels: {{kubernetes.io/service-name: web}}}}
addressType: IPv4
ports: [{{port: 8080}}]
endpoints:
{endpoints}
"#
    )
}

pub(super) const THREE_ENDPOINTS: &str = r#"- {addresses: [10.244.1.1], nodeName: node-a}
- {addresses: [10.244.2.1], nodeName: node-b}
- {addresses: [10.244.3.1], nodeName: node-c}"#;

pub(super) fn tcp(src: &str, dst: &str, port: u16) -> Packet {
    Packet::remote(src, dst, Protocol::Tcp, port)
}

#[test]
fn rendered_transaction_matches_the_golden_text() {
    let yaml = web(
        "",
        "- {addresses: [10.244.1.1], nodeName: node-a}\n- {addresses: [10.244.2.1], nodeName: node-b}",
    );
    let text = create_all(&World::new(&yaml).ruleset()).to_nft();
    let golden = include_str!("testdata/web-nodeport.nft");
    assert_eq!(text, golden, "golden mismatch; got:\n{text}");
}

#[test]
fn inline_vmap_form_is_kube_proxys_numgen_vmap() {
    let mut w = World::new(&web("", THREE_ENDPOINTS));
    w.config.endpoint_choice = EndpointChoice::InlineVmap;
    let text = create_all(&w.ruleset()).to_nft();
    assert!(text.contains(
        "add rule ip kube-proxy service-PFISGYVC-default/web/tcp/ numgen random mod 3 vmap { 0 : goto endpoint-"
    ), "{text}");
    // Same behaviour as the cascade.
    let t = trace(&w.ruleset(), &tcp(CLIENT, NODE_IP, 30080), &w.env());
    assert_eq!(t.endpoints().len(), 3);
}

#[test]
fn nodeport_from_a_client_reaches_every_endpoint_uniformly_and_is_masqueraded() {
    let w = World::new(&web("", THREE_ENDPOINTS));
    let t = w.trace(tcp(CLIENT, NODE_IP, 30080));
    assert_eq!(t.endpoints().len(), 3, "{t}");
    for ep in ["10.244.1.1:8080", "10.244.2.1:8080", "10.244.3.1:8080"] {
        assert!((t.probability_of(ep) - 1.0 / 3.0).abs() < 1e-9, "{t}");
    }
    assert!(t.all_masqueraded(true), "{t}");
    assert!(
        t.to_string()
            .starts_with("from 203.0.113.5 to 192.0.2.10:30080/tcp → DNAT 10.244."),
        "{t}"
    );
}

#[test]
fn clusterip_from_a_pod_is_not_masqueraded_but_from_outside_the_pod_cidr_it_is() {
    let w = World::new(&web("", THREE_ENDPOINTS));
    assert!(
        w.trace(tcp("10.244.9.9", "10.96.0.10", 80))
            .all_masqueraded(false)
    );
    assert!(w.trace(tcp(CLIENT, "10.96.0.10", 80)).all_masqueraded(true));
}

#[test]
fn masquerade_all_masquerades_pod_traffic_to_clusterips() {
    let mut w = World::new(&web("", THREE_ENDPOINTS));
    w.config.masquerade_all = true;
    assert!(
        w.trace(tcp("10.244.9.9", "10.96.0.10", 80))
            .all_masqueraded(true)
    );
}

#[test]
fn without_a_cluster_cidr_clusterip_traffic_is_never_masqueraded() {
    let mut w = World::new(&web("", THREE_ENDPOINTS));
    w.config.cluster_cidrs.clear();
    assert!(
        w.trace(tcp(CLIENT, "10.96.0.10", 80))
            .all_masqueraded(false)
    );
}

#[test]
fn hairpin_traffic_from_an_endpoint_to_its_own_service_is_masqueraded() {
    let w = World::new(&web("", "- {addresses: [10.244.1.1], nodeName: node-a}"));
    let t = w.trace(tcp("10.244.1.1", "10.96.0.10", 80));
    assert_eq!(
        t.only(),
        &Fate::Delivered {
            dnat: Some("10.244.1.1:8080".parse().unwrap()),
            masqueraded: true,
            affinity: vec![]
        }
    );
}

#[test]
fn service_without_endpoints_is_rejected_on_clusterip_and_nodeport() {
    let w = World::new(&web("", "  []"));
    assert_eq!(
        w.trace(tcp("10.244.9.9", "10.96.0.10", 80)).only(),
        &Fate::Rejected("reject-chain".into())
    );
    assert_eq!(
        w.trace(tcp(CLIENT, NODE_IP, 30080)).only(),
        &Fate::Rejected("reject-chain".into())
    );
    let text = create_all(&w.ruleset()).to_nft();
    assert!(text.contains(
        "add element ip kube-proxy no-endpoint-services { 10.96.0.10 . tcp . 80 comment \"default/web\" : goto reject-chain }"
    ), "{text}");
}

#[test]
fn etp_local_nodeport_without_local_endpoint_is_dropped() {
    let w = World::new(&web(
        "  externalTrafficPolicy: Local",
        "- {addresses: [10.244.2.1], nodeName: node-b}",
    ));
    assert_eq!(
        w.trace(tcp(CLIENT, NODE_IP, 30080)).only(),
        &Fate::Dropped("nodeport-endpoints-check".into())
    );
    // The ClusterIP is unaffected by the external policy.
    assert_eq!(
        w.trace(tcp("10.244.9.9", "10.96.0.10", 80))
            .endpoints()
            .len(),
        1
    );
}

#[test]
fn etp_local_nodeport_reaches_only_local_endpoints_and_keeps_the_client_ip() {
    let w = World::new(&web("  externalTrafficPolicy: Local", THREE_ENDPOINTS));
    let t = w.trace(tcp(CLIENT, NODE_IP, 30080));
    assert_eq!(
        t.only(),
        &Fate::Delivered {
            dnat: Some("10.244.1.1:8080".parse().unwrap()),
            masqueraded: false,
            affinity: vec![]
        },
        "{t}"
    );
}

#[test]
fn etp_local_short_circuits_pod_and_node_traffic_to_all_endpoints() {
    let w = World::new(&web(
        "  externalTrafficPolicy: Local",
        "- {addresses: [10.244.2.1], nodeName: node-b}",
    ));
    // From a pod: as if it went out to a load balancer and back, all endpoints, no masquerade.
    let pod = w.trace(tcp("10.244.9.9", NODE_IP, 30080));
    assert_eq!(pod.endpoints().len(), 1, "{pod}");
    assert!(pod.all_masqueraded(false), "{pod}");
    // From the node itself: all endpoints, masqueraded.
    let host = w.trace(Packet::local(NODE_IP, NODE_IP, Protocol::Tcp, 30080));
    assert_eq!(host.endpoints().len(), 1, "{host}");
    assert!(host.all_masqueraded(true), "{host}");
}

#[test]
fn itp_local_clusterip_reaches_only_local_endpoints() {
    let w = World::new(&web("  internalTrafficPolicy: Local", THREE_ENDPOINTS));
    let t = w.trace(tcp("10.244.9.9", "10.96.0.10", 80));
    assert_eq!(
        t.endpoints(),
        BTreeSet::from(["10.244.1.1:8080".parse().unwrap()]),
        "{t}"
    );
    // External traffic still uses every endpoint.
    assert_eq!(w.trace(tcp(CLIENT, NODE_IP, 30080)).endpoints().len(), 3);
}

#[test]
fn itp_local_clusterip_without_local_endpoint_is_dropped() {
    let w = World::new(&web(
        "  internalTrafficPolicy: Local",
        "- {addresses: [10.244.2.1], nodeName: node-b}",
    ));
    assert_eq!(
        w.trace(tcp("10.244.9.9", "10.96.0.10", 80)).only(),
        &Fate::Dropped("service-endpoints-check".into())
    );
}

#[test]
fn session_affinity_sends_a_known_client_to_its_endpoint_and_records_new_ones() {
    let mut w = World::new(&web(
        "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 600}}",
        THREE_ENDPOINTS,
    ));
    let rules = w.ruleset();
    let text = create_all(&rules).to_nft();
    assert!(
        text.contains("{ type ipv4_addr ; flags dynamic,timeout ; timeout 600s ; }"),
        "{text}"
    );
    // A new client: any endpoint, and it is recorded in that endpoint's affinity set.
    let first = trace(&rules, &tcp(CLIENT, NODE_IP, 30080), &w.env());
    assert_eq!(first.endpoints().len(), 3);
    for (fate, _) in &first.fates {
        let Fate::Delivered { affinity, .. } = fate else {
            panic!("{first}")
        };
        assert_eq!(affinity.len(), 1, "{first}");
    }
    // A client recorded for 10.244.3.1 always goes there.
    let set = super::names::EndpointNames::new(
        &crate::model::ServicePortName::new("default", "web", "", Protocol::Tcp),
        "10.244.3.1".parse().unwrap(),
        8080,
    )
    .affinity;
    let mut env = w.env();
    env.affinity.push((set, CLIENT.parse().unwrap()));
    let again = trace(&rules, &tcp(CLIENT, NODE_IP, 30080), &env);
    assert_eq!(
        again.endpoints(),
        BTreeSet::from(["10.244.3.1:8080".parse().unwrap()]),
        "{again}"
    );
    w.config.endpoint_choice = EndpointChoice::Cascade;
}

#[test]
fn load_balancer_source_ranges_admit_listed_sources_only() {
    let yaml = web(
        "  loadBalancerSourceRanges: [203.0.113.0/25]\nstatus: {loadBalancer: {ingress: [{ip: 198.51.100.200}]}}",
        THREE_ENDPOINTS,
    )
    .replace("type: NodePort", "type: LoadBalancer");
    let w = World::new(&yaml);
    let allowed = w.trace(tcp("203.0.113.5", "198.51.100.200", 80));
    assert_eq!(allowed.endpoints().len(), 3, "{allowed}");
    let denied = w.trace(tcp("203.0.113.200", "198.51.100.200", 80));
    assert!(
        matches!(denied.only(), Fate::Dropped(c) if c.starts_with("firewall-")),
        "{denied}"
    );
    // NodePorts are not subject to the source ranges (kube-proxy behaviour).
    assert_eq!(
        w.trace(tcp("203.0.113.200", NODE_IP, 30080))
            .endpoints()
            .len(),
        3
    );
}

#[test]
fn load_balancer_vip_is_an_allowed_source_when_a_range_contains_the_node_ip() {
    let yaml = web(
        "  loadBalancerSourceRanges: [192.0.2.0/24]\nstatus: {loadBalancer: {ingress: [{ip: 198.51.100.200}]}}",
        THREE_ENDPOINTS,
    )
    .replace("type: NodePort", "type: LoadBalancer");
    let text = create_all(&World::new(&yaml).ruleset()).to_nft();
    assert!(
        text.contains("ip saddr != { 192.0.2.0/24, 198.51.100.200 } drop"),
        "{text}"
    );
}

#[test]
fn external_ips_and_load_balancer_ips_reach_the_endpoints() {
    let yaml = web(
        "  externalIPs: [198.51.100.77]\nstatus: {loadBalancer: {ingress: [{ip: 198.51.100.200}]}}",
        THREE_ENDPOINTS,
    );
    let w = World::new(&yaml);
    for vip in ["198.51.100.77", "198.51.100.200"] {
        let t = w.trace(tcp(CLIENT, vip, 80));
        assert_eq!(t.endpoints().len(), 3, "{t}");
        assert!(t.all_masqueraded(true), "{t}");
    }
}

#[test]
fn terminating_endpoints_are_used_only_when_no_ready_endpoint_remains() {
    let mixed = r#"- {addresses: [10.244.1.1], nodeName: node-a}
- {addresses: [10.244.2.1], nodeName: node-b, conditions: {ready: false, serving: true, terminating: true}}"#;
    let w = World::new(&web("", mixed));
    assert_eq!(
        w.trace(tcp(CLIENT, NODE_IP, 30080)).endpoints(),
        BTreeSet::from(["10.244.1.1:8080".parse().unwrap()])
    );
    let only_terminating = "- {addresses: [10.244.2.1], nodeName: node-b, conditions: {ready: false, serving: true, terminating: true}}";
    let w = World::new(&web("", only_terminating));
    assert_eq!(
        w.trace(tcp(CLIENT, NODE_IP, 30080)).endpoints(),
        BTreeSet::from(["10.244.2.1:8080".parse().unwrap()])
    );
    let not_serving = "- {addresses: [10.244.2.1], conditions: {ready: false, serving: false, terminating: true}}";
    let w = World::new(&web("", not_serving));
    assert_eq!(
        w.trace(tcp(CLIENT, NODE_IP, 30080)).only(),
        &Fate::Rejected("reject-chain".into())
    );
}

#[test]
fn a_terminating_endpoint_without_a_serving_condition_counts_as_serving_as_in_kube_proxy() {
    // kube-proxy reads an unset `serving` as true (endpointslicecache.go), so a controller
    // that sets only `ready` and `terminating` still drains to its terminating pods.
    let unset = "- {addresses: [10.244.2.1], nodeName: node-b, conditions: {ready: false, terminating: true}}";
    let w = World::new(&web("", unset));
    assert_eq!(
        w.trace(tcp(CLIENT, NODE_IP, 30080)).endpoints(),
        BTreeSet::from(["10.244.2.1:8080".parse().unwrap()])
    );
}

#[test]
fn one_endpoint_in_two_slices_takes_the_copy_that_is_not_terminating_as_kube_proxy_does() {
    // A new pod reusing the IP of one still terminating: kube-proxy keeps the running pod's
    // entry, even while it is not ready yet, so no traffic goes to the old one's entry.
    let second_slice = |name: &str, conditions: &str| {
        format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}, namespace: default, labels: {{kubernetes.io/service-name: web}}}}\naddressType: IPv4\nports: [{{port: 8080}}]\nendpoints:\n- {{addresses: [10.244.2.1], nodeName: node-b, conditions: {conditions}}}\n"
        )
    };
    let terminating = "{ready: false, serving: true, terminating: true}";
    let starting = "{ready: false, serving: false, terminating: false}";
    // In either slice order.
    for (first, second) in [(terminating, starting), (starting, terminating)] {
        let yaml = format!(
            "{}{}",
            web(
                "",
                &format!("- {{addresses: [10.244.2.1], nodeName: node-b, conditions: {first}}}")
            ),
            second_slice("web-2", second)
        );
        let w = World::new(&yaml);
        assert_eq!(
            w.trace(tcp(CLIENT, NODE_IP, 30080)).only(),
            &Fate::Rejected("reject-chain".into()),
            "first {first}, then {second}"
        );
    }
    // Between two copies alike, the ready one.
    let yaml = format!(
        "{}{}",
        web(
            "",
            "- {addresses: [10.244.2.1], nodeName: node-b, conditions: {ready: false}}"
        ),
        second_slice("web-2", "{ready: true}")
    );
    assert_eq!(
        World::new(&yaml)
            .trace(tcp(CLIENT, NODE_IP, 30080))
            .endpoints(),
        BTreeSet::from(["10.244.2.1:8080".parse().unwrap()])
    );
}

#[test]
fn clusterip_ports_no_service_serves_are_rejected_and_unallocated_clusterips_dropped() {
    let yaml = format!(
        "{}---\napiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {{name: kubernetes}}\nspec: {{cidrs: [10.96.0.0/16]}}\n",
        web("", THREE_ENDPOINTS)
    );
    let w = World::new(&yaml);
    assert_eq!(
        w.trace(tcp("10.244.9.9", "10.96.0.10", 81)).only(),
        &Fate::Rejected("cluster-ips-check".into())
    );
    assert_eq!(
        w.trace(tcp("10.244.9.9", "10.96.0.99", 80)).only(),
        &Fate::Dropped("cluster-ips-check".into())
    );
}

#[test]
fn tcp_udp_and_sctp_ports_are_told_apart() {
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
    let w = World::new(yaml);
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
    }
}

#[test]
fn nodeport_answers_only_on_the_selected_node_addresses() {
    let mut w = World::new(&web("", THREE_ENDPOINTS));
    // Default `primary`: the Node object's IP, not the second address.
    assert_eq!(w.trace(tcp(CLIENT, NODE_IP, 30080)).endpoints().len(), 3);
    assert_eq!(
        w.trace(tcp(CLIENT, NODE_IP2, 30080)).only(),
        &Fate::Delivered {
            dnat: None,
            masqueraded: false,
            affinity: vec![]
        }
    );
    // A CIDR selecting the second address only.
    w.state.nodeport_addresses = "198.51.100.0/24".parse::<NodePortAddresses>().unwrap();
    assert_eq!(w.trace(tcp(CLIENT, NODE_IP2, 30080)).endpoints().len(), 3);
    assert!(w.trace(tcp(CLIENT, NODE_IP, 30080)).endpoints().is_empty());
    // 0.0.0.0/0: every local address, by `fib daddr type local`.
    w.state.nodeport_addresses = "0.0.0.0/0".parse().unwrap();
    let text = create_all(&w.ruleset()).to_nft();
    assert!(text.contains("add rule ip kube-proxy services fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @service-nodeports"), "{text}");
    assert!(!text.contains("nodeport-ips"), "{text}");
    assert_eq!(w.trace(tcp(CLIENT, NODE_IP2, 30080)).endpoints().len(), 3);
}

#[test]
fn ipv6_services_render_into_the_ip6_table() {
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
    let mut w = World::new(yaml);
    w.state.families = IpFamily::ALL.to_vec();
    w.facts.node_ips.push("2001:db8::10".parse().unwrap());
    w.facts.local_ips.push("2001:db8::10".parse().unwrap());
    let rules = w.ruleset();
    let text = create_all(&rules).to_nft();
    assert!(text.contains("add rule ip6 kube-proxy endpoint-"), "{text}");
    assert!(
        text.contains("meta l4proto tcp dnat to [fd00:244::1]:80"),
        "{text}"
    );
    assert!(text.contains("__fd00.244..1/80"), "{text}");
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

#[test]
fn a_dual_stack_service_external_only_in_ipv4_gets_only_its_local_chain_in_ip6() {
    // kube-proxy builds each family's service port from that family's IPs: with only an IPv4
    // external IP, the port is not externally accessible in IPv6, so with
    // internalTrafficPolicy Local the ip6 table holds the local chain and nothing else.
    let yaml = r#"
apiVersion: v1
kind: Service
metadata: {name: dual, namespace: default}
spec:
  clusterIP: 10.96.0.91
  clusterIPs: [10.96.0.91, "fd00:96::91"]
  externalIPs: [192.0.2.250]
  internalTrafficPolicy: Local
  externalTrafficPolicy: Local
  ports: [{port: 80, targetPort: 8080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: dual-6, namespace: default, labels: {kubernetes.io/service-name: dual}}
addressType: IPv6
ports: [{port: 8080}]
endpoints:
- {addresses: ["fd00:244::1"], nodeName: node-a}
- {addresses: ["fd00:244::2"], nodeName: node-b}
"#;
    let mut w = World::new(yaml);
    w.state.families = IpFamily::ALL.to_vec();
    w.facts.node_ips.push("2001:db8::10".parse().unwrap());
    w.facts.local_ips.push("2001:db8::10".parse().unwrap());
    let text = create_all(&w.ruleset()).to_nft();
    let ip6_chains: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("add chain ip6 kube-proxy ") && l.contains('/'))
        .collect();
    assert_eq!(ip6_chains.len(), 2, "{ip6_chains:#?}");
    assert!(ip6_chains[0].contains(" local-"), "{ip6_chains:#?}");
    assert!(
        ip6_chains[1].contains("__fd00.244..1/8080"),
        "{ip6_chains:#?}"
    );
}

// ---- applying: partial and full syncs against the fake kernel ----

pub(super) fn applier_with(w: &World) -> (Applier<FakeKernel>, DesiredState) {
    let mut a = Applier::new(FakeKernel::default());
    let d = w.desired();
    a.sync(&d, &w.config, None).expect("first sync");
    (a, d)
}

pub(super) fn kernel_trace(a: &Applier<FakeKernel>, w: &World, p: Packet) -> crate::trace::Trace {
    trace(&a.kernel().ruleset(), &p, &w.env())
}

#[test]
fn first_sync_programs_the_same_behaviour_as_the_rendered_rules() {
    let w = World::new(&web("", THREE_ENDPOINTS));
    let (a, _) = applier_with(&w);
    let p = tcp(CLIENT, NODE_IP, 30080);
    assert_eq!(kernel_trace(&a, &w, p.clone()).fates, w.trace(p).fates);
}

#[test]
fn a_sync_without_changes_sends_nothing() {
    let w = World::new(&web("", THREE_ENDPOINTS));
    let (mut a, d) = applier_with(&w);
    let n = a.kernel().history.len();
    let report = a.sync(&d, &w.config, Some(&BTreeSet::new())).unwrap();
    assert_eq!(report.ops, 0);
    assert!(!report.full);
    assert_eq!(
        a.kernel().history.len(),
        n + 1,
        "an empty transaction is still one apply call"
    );
}

#[test]
fn a_partial_sync_touches_only_the_changed_service() {
    let two = format!(
        "{}---\n{}",
        web("", THREE_ENDPOINTS),
        web("", "- {addresses: [10.244.5.5]}")
            .replace("web", "api")
            .replace("10.96.0.10", "10.96.0.11")
            .replace("30080", "30081")
    );
    let mut w = World::new(&two);
    let (mut a, mut d) = applier_with(&w);
    // Remove one endpoint of web.
    let slice = objects::load(&web("", "- {addresses: [10.244.1.1], nodeName: node-a}\n- {addresses: [10.244.2.1], nodeName: node-b}")).unwrap();
    let key = crate::model::ServiceName::new("default", "web-1");
    w.cluster
        .update_slice(key.clone(), slice.cluster.slices.get(&key).cloned());
    let changes = w.cluster.take_changes();
    let touched = d.refresh_services(&w.cluster, NodeView::named(NODE), &changes.services);
    assert_eq!(touched.len(), 1);
    let report = a.sync(&d, &w.config, Some(&touched)).unwrap();
    assert!(!report.full);
    assert_eq!(
        report.deleted_chains, 1,
        "the endpoint chain of 10.244.3.1 is gone"
    );
    let tx = &a.kernel().history[a.kernel().history.len() - 2];
    for (_, op) in &tx.ops {
        let text = format!("{op:?}");
        assert!(
            !text.contains("default/api"),
            "untouched service rewritten: {op:?}"
        );
        assert!(
            !matches!(op, Op::AddElement(_) | Op::DeleteElement(..)),
            "no element changes needed: {op:?}"
        );
    }
    let t = kernel_trace(&a, &w, tcp(CLIENT, NODE_IP, 30080));
    assert_eq!(t.endpoints().len(), 2, "{t}");
    assert_eq!(t.fates, w.trace(tcp(CLIENT, NODE_IP, 30080)).fates);
}

#[test]
fn deleting_a_service_removes_its_elements_and_chains() {
    let mut w = World::new(&web("", THREE_ENDPOINTS));
    let (mut a, mut d) = applier_with(&w);
    w.cluster
        .update_service(crate::model::ServiceName::new("default", "web"), None);
    let changes = w.cluster.take_changes();
    let touched = d.refresh_services(&w.cluster, NodeView::named(NODE), &changes.services);
    let report = a.sync(&d, &w.config, Some(&touched)).unwrap();
    assert_eq!(
        report.deleted_chains, 5,
        "service-, external- and three endpoint- chains"
    );
    let k = &a.kernel().tables[&IpFamily::V4];
    assert!(
        k.chains.keys().all(|c| !c.contains('/')),
        "{:?}",
        k.chains.keys()
    );
    for (name, (_, els)) in &k.sets {
        assert!(
            name == "nodeport-ips" || els.is_empty(),
            "{name} still has {els:?}"
        );
    }
}

#[test]
fn a_chain_waiting_for_deletion_that_is_wanted_again_is_kept_and_not_deleted() {
    // Kernels before 6.2 may refuse to delete a chain right after it was flushed; kube-proxy
    // then keeps it in its stale list, and drops it from there when it is wanted again.
    let mut w = World::new(&web("", THREE_ENDPOINTS));
    let (mut a, mut d) = applier_with(&w);
    let mut sync_to = |w: &mut World, a: &mut Applier<FakeKernel>, endpoints: &str| {
        let slice = objects::load(&web("", endpoints)).unwrap().cluster;
        for (k, v) in slice.slices.iter() {
            w.cluster.update_slice(k.clone(), Some(v.clone()));
        }
        let changes = w.cluster.take_changes();
        let touched = d.refresh_services(&w.cluster, NodeView::named(NODE), &changes.services);
        a.sync(&d, &w.config, Some(&touched)).unwrap()
    };
    a.kernel_mut().refuse_chain_deletes = true;
    let report = sync_to(
        &mut w,
        &mut a,
        "- {addresses: [10.244.1.1], nodeName: node-a}",
    );
    assert!(report.cleanup_failed);
    assert_eq!(a.stale_chains(), 2, "two endpoint chains wait for deletion");
    sync_to(&mut w, &mut a, THREE_ENDPOINTS);
    assert_eq!(a.stale_chains(), 0, "both are wanted again");
    a.kernel_mut().refuse_chain_deletes = false;
    let report = a.sync(&d, &w.config, Some(&BTreeSet::new())).unwrap();
    assert!(!report.cleanup_failed);
    let chains = |r: &Ruleset| {
        let mut c: Vec<(String, Vec<super::ruleset::Rule>)> = r
            .table(IpFamily::V4)
            .expect("an IPv4 table")
            .chains()
            .map(|c| (c.name.clone(), c.rules.clone()))
            .collect();
        c.sort_by(|x, y| x.0.cmp(&y.0));
        c
    };
    assert_eq!(chains(&a.kernel().ruleset()), chains(&w.ruleset()));
}

#[test]
fn a_failed_apply_keeps_the_old_rules_and_the_next_sync_is_full() {
    let mut w = World::new(&web("", THREE_ENDPOINTS));
    let (mut a, mut d) = applier_with(&w);
    let before = a.kernel().tables.clone();
    w.cluster
        .update_service(crate::model::ServiceName::new("default", "web"), None);
    let changes = w.cluster.take_changes();
    let touched = d.refresh_services(&w.cluster, NodeView::named(NODE), &changes.services);
    a.kernel_mut().fail_next = 1;
    assert!(a.sync(&d, &w.config, Some(&touched)).is_err());
    assert_eq!(a.kernel().tables, before);
    assert!(a.needs_full_sync());
    let report = a.sync(&d, &w.config, Some(&BTreeSet::new())).unwrap();
    assert!(report.full);
    assert!(
        a.kernel().tables[&IpFamily::V4]
            .chains
            .keys()
            .all(|c| !c.contains('/'))
    );
}

#[test]
fn start_up_takes_over_an_existing_table_without_deleting_it() {
    let w = World::new(&web("", THREE_ENDPOINTS));
    let (a, d) = applier_with(&w);
    // A new process (empty memory) on the same kernel, which also holds a leftover chain.
    let mut kernel = a.kernel().clone();
    kernel
        .tables
        .get_mut(&IpFamily::V4)
        .unwrap()
        .chains
        .insert("service-OLD-ns/gone/tcp/".into(), (None, vec![]));
    let mut b = Applier::new(kernel);
    let report = b.sync(&d, &w.config, Some(&BTreeSet::new())).unwrap();
    assert!(report.full);
    assert_eq!(report.deleted_chains, 1);
    let tx = &b.kernel().history[b.kernel().history.len() - 2];
    assert!(tx.ops.iter().all(|(_, op)| !matches!(op, Op::DeleteTable)));
    assert!(
        tx.ops
            .iter()
            .any(|(_, op)| matches!(op, Op::FlushChain(c) if c == "filter-input"))
    );
    let t = kernel_trace(&b, &w, tcp(CLIENT, NODE_IP, 30080));
    assert_eq!(t.endpoints().len(), 3);
}

#[test]
fn a_full_resync_repairs_a_rule_deleted_by_hand() {
    let w = World::new(&web("", THREE_ENDPOINTS));
    let (mut a, d) = applier_with(&w);
    let t = a.kernel_mut().tables.get_mut(&IpFamily::V4).unwrap();
    t.chains.get_mut("services").unwrap().1.clear();
    assert!(
        kernel_trace(&a, &w, tcp(CLIENT, NODE_IP, 30080))
            .endpoints()
            .is_empty()
    );
    a.request_full_sync();
    a.sync(&d, &w.config, None).unwrap();
    assert_eq!(
        kernel_trace(&a, &w, tcp(CLIENT, NODE_IP, 30080))
            .endpoints()
            .len(),
        3
    );
}

#[test]
fn two_services_claiming_one_external_ip_do_not_break_the_sync() {
    let one = web("  externalIPs: [198.51.100.77]", THREE_ENDPOINTS);
    let two = one
        .replace("name: web,", "name: web2,")
        .replace("name: web-1,", "name: web2-1,")
        .replace("service-name: web}", "service-name: web2}")
        .replace("10.96.0.10", "10.96.0.12")
        .replace("30080", "30082");
    let w = World::new(&format!("{one}---\n{two}"));
    let (a, _) = applier_with(&w);
    assert_eq!(
        kernel_trace(&a, &w, tcp(CLIENT, "198.51.100.77", 80))
            .endpoints()
            .len(),
        3
    );
}

#[test]
fn switching_nodeport_addresses_to_match_all_in_a_partial_sync_removes_the_set() {
    let mut w = World::new(&web("", THREE_ENDPOINTS));
    let (mut a, mut d) = applier_with(&w);
    w.state.nodeport_addresses = "0.0.0.0/0".parse().unwrap();
    assert!(d.refresh_node(&w.cluster, &w.facts, &w.state));
    a.sync(&d, &w.config, Some(&BTreeSet::new())).unwrap();
    assert!(
        !a.kernel().tables[&IpFamily::V4]
            .sets
            .contains_key("nodeport-ips")
    );
    assert_eq!(
        kernel_trace(&a, &w, tcp(CLIENT, NODE_IP2, 30080))
            .endpoints()
            .len(),
        3
    );
}

#[test]
fn another_tool_committing_to_nftables_is_seen_as_drift_and_our_own_syncs_are_not() {
    let w = World::new(&web("", THREE_ENDPOINTS));
    let (mut a, d) = applier_with(&w);
    assert!(!a.drifted());
    a.sync(&d, &w.config, Some(&BTreeSet::new())).unwrap();
    assert!(!a.drifted(), "our own transactions are not drift");
    a.kernel_mut().generation += 1;
    assert!(a.drifted());
    a.request_full_sync();
    a.sync(&d, &w.config, None).unwrap();
    assert!(!a.drifted());
}

/// Issue #8: `--nodeport-addresses 127.0.0.0/8,...` serves localhost NodePorts, which
/// upstream kube-proxy's nftables mode does not (see `render::localhost_nodeports`).
fn localhost_world() -> World {
    let mut w = World::new(&web("", THREE_ENDPOINTS));
    w.facts.local_ips.push("127.0.0.1".parse().unwrap());
    w.state.nodeport_addresses = "127.0.0.0/8,198.51.100.0/24".parse().unwrap();
    w
}

#[test]
fn localhost_nodeports_render_127_0_0_1_in_nodeport_ips_and_the_localnet_guard() {
    let text = create_all(&localhost_world().ruleset()).to_nft();
    for line in [
        "add chain ip kube-proxy localnet-check",
        // Every packet, not only new connections: kube-proxy's `-A INPUT -j KUBE-FIREWALL`.
        "add rule ip kube-proxy filter-input jump localnet-check",
        // `! --ctstate RELATED,ESTABLISHED,DNAT` in two rules: packets without a conntrack
        // entry, which `ct status` cannot match, then new connections that were not DNATed.
        "add rule ip kube-proxy localnet-check ip daddr 127.0.0.0/8 ip saddr != 127.0.0.0/8 ct state invalid,untracked drop comment \"block incoming localnet connections\"",
        "add rule ip kube-proxy localnet-check ip daddr 127.0.0.0/8 ip saddr != 127.0.0.0/8 ct state ! established,related ct status ! dnat drop comment \"block incoming localnet connections\"",
        "add element ip kube-proxy nodeport-ips { 127.0.0.1 }",
        "add element ip kube-proxy nodeport-ips { 198.51.100.10 }",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in:\n{text}"
        );
    }
    // The guard comes before the NodePort checks of filter-input.
    let first = text
        .lines()
        .find(|l| l.starts_with("add rule ip kube-proxy filter-input"))
        .unwrap();
    assert!(first.ends_with("jump localnet-check"), "{first}");
    // No loopback CIDR, no guard and no 127.0.0.1.
    let w = World::new(&web("", THREE_ENDPOINTS));
    let text = create_all(&w.ruleset()).to_nft();
    assert!(!text.contains("localnet-check"), "{text}");
    assert!(!text.contains("127.0.0.1"), "{text}");
}

#[test]
fn the_localnet_guard_stays_while_route_localnet_is_on_without_localhost_nodeports() {
    // A proxy restarted without 127.0.0.0/8 in --nodeport-addresses finds route_localnet=1
    // (never reset, as kube-proxy never resets it): 127.0.0.0/8 stays routable from outside,
    // so the CVE-2020-8558 guard must stay, though 127.0.0.1 no longer serves NodePorts.
    let mut w = World::new(&web("", THREE_ENDPOINTS));
    w.facts.local_ips.push("127.0.0.1".parse().unwrap());
    w.config.route_localnet = true;
    let text = create_all(&w.ruleset()).to_nft();
    assert!(
        text.lines()
            .any(|l| l == "add rule ip kube-proxy filter-input jump localnet-check"),
        "{text}"
    );
    assert!(
        text.contains("add chain ip kube-proxy localnet-check"),
        "{text}"
    );
    assert!(!text.contains("nodeport-ips { 127.0.0.1 }"), "{text}");
    let t = w.trace(tcp(CLIENT, "127.0.0.1", 10249));
    assert_eq!(t.only(), &Fate::Dropped("localnet-check".into()), "{t}");
    // Without route_localnet and without localhost NodePorts: no guard, as before.
    w.config.route_localnet = false;
    assert!(!create_all(&w.ruleset()).to_nft().contains("localnet-check"));
}

#[test]
fn localhost_nodeport_from_a_node_process_reaches_every_endpoint_masqueraded() {
    let w = localhost_world();
    let t = w.trace(Packet::local(
        "127.0.0.1",
        "127.0.0.1",
        Protocol::Tcp,
        30080,
    ));
    assert_eq!(t.endpoints().len(), 3, "{t}");
    assert!(t.all_masqueraded(true), "{t}");
    // The other selected address still answers; the unselected one does not.
    assert_eq!(w.trace(tcp(CLIENT, NODE_IP2, 30080)).endpoints().len(), 3);
    assert!(w.trace(tcp(CLIENT, NODE_IP, 30080)).endpoints().is_empty());
}

#[test]
fn a_new_connection_to_127_0_0_1_from_another_host_is_dropped_cve_2020_8558() {
    let w = localhost_world();
    let t = w.trace(tcp(CLIENT, "127.0.0.1", 10249));
    assert_eq!(t.only(), &Fate::Dropped("localnet-check".into()), "{t}");
    // A NodePort reached through 127.0.0.1 from outside is DNATed first: not dropped
    // (kube-proxy's `! --ctstate DNAT`).
    assert_eq!(
        w.trace(tcp(CLIENT, "127.0.0.1", 30080)).endpoints().len(),
        3
    );
}

#[test]
fn default_route_fills_nodeport_ips_with_the_default_route_interfaces_addresses() {
    let mut w = World::new(&web("", THREE_ENDPOINTS));
    w.state.nodeport_addresses = "default-route".parse::<NodePortAddresses>().unwrap();
    w.facts.default_route_ips = vec![NODE_IP2.parse().unwrap()];
    let text = create_all(&w.ruleset()).to_nft();
    assert!(
        text.lines()
            .any(|l| l == "add element ip kube-proxy nodeport-ips { 198.51.100.10 }"),
        "{text}"
    );
    assert!(!text.contains("nodeport-ips { 192.0.2.10 }"), "{text}");
    assert_eq!(w.trace(tcp(CLIENT, NODE_IP2, 30080)).endpoints().len(), 3);
    assert!(w.trace(tcp(CLIENT, NODE_IP, 30080)).endpoints().is_empty());
}

#[test]
fn a_nodeports_path_goes_through_the_ports_own_chains_and_chooses_the_endpoint_chain_once() {
    let w = World::new(&web("", THREE_ENDPOINTS));
    let t = w.trace(tcp(CLIENT, NODE_IP, 30080));
    let path = crate::trace::path::fold(&t.walks, crate::trace::path::Choosing::Random);
    let choices: Vec<&crate::trace::path::Step> =
        path.iter().filter(|s| s.kind == "choice").collect();
    assert_eq!(choices.len(), 1, "{path:#?}");
    let choice = choices[0];
    assert!(choice.chain.starts_with("service-"), "{choice:#?}");
    assert_eq!(choice.candidates.len(), 3);
    for c in &choice.candidates {
        let to = c.endpoint.unwrap();
        // Its goto from the Service's chain, then its own chain's DNAT.
        assert!(c.path[0].verdict.starts_with("goto endpoint-"), "{c:#?}");
        let last = c.path.last().unwrap();
        assert!(last.chain.starts_with("endpoint-"), "{c:#?}");
        assert!(
            last.chain
                .ends_with(&format!("__{}/{}", to.ip(), to.port())),
            "{c:#?}"
        );
        assert_eq!(last.verdict, "accept");
        assert!((c.probability - 1.0 / 3.0).abs() < 1e-9);
    }
    // The `services` map's element that sent it to the external chain.
    assert!(
        path.iter().any(|s| s.chain == "services"
            && s.verdict.starts_with("goto external-")
            && s.elements
                .iter()
                .any(|e| e.starts_with("@service-nodeports { tcp . 30080 : goto external-"))),
        "{path:#?}"
    );
}

#[test]
fn the_nodes_own_connection_to_its_nodeport_without_endpoints_is_rejected_back_in_through_loopback()
{
    // Out untranslated, then in again through loopback: filter-input's
    // nodeport-endpoints-check sends it to kube-proxy's reject chain.
    let w = World::new(&web("", ""));
    let t = w.trace(Packet::local(NODE_IP, NODE_IP, Protocol::Tcp, 30080));
    assert_eq!(t.only(), &Fate::Rejected("reject-chain".into()), "{t}");
}
