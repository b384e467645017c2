//! Golden and behaviour tests of the iptables backend: render, trace, apply (fake kernel).
//!
//! The behaviour tests mirror the nftables ones (same topology, same packets) and
//! kube-proxy's iptables packet-flow tests (`pkg/proxy/iptables/proxier_test.go`); the
//! fates name iptables chains.

use std::collections::BTreeSet;

use super::apply::{Applier, FakeKernel};
use super::names::{KUBE_FIREWALL, KUBE_PROXY_CANARY, ServiceChainNames, endpoint_chain};
use super::render::render;
use super::ruleset::{Line, Ruleset, Table, create_all};
use super::tracer::trace;
use crate::config::NodeConfig;
use crate::desired::{self, DesiredState, NodeView, StateConfig};
use crate::model::{IpFamily, Protocol, ServiceName, ServicePortName};
use crate::nodeaddr::{NodeFacts, NodePortAddresses};
use crate::objects::{self, Cluster};
use crate::trace::{Env, Fate, Packet, Trace};

const NODE: &str = "node-a";
const NODE_IP: &str = "192.0.2.10";
const NODE_IP2: &str = "198.51.100.10";
const CLIENT: &str = "203.0.113.5";
const POD_CIDR: &str = "10.244.0.0/16";

/// A test world: objects from YAML, node `node-a` with two addresses, pod CIDR 10.244/16,
/// NodePorts on every address (the iptables mode's default).
struct World {
    cluster: Cluster,
    facts: NodeFacts,
    state: StateConfig,
    config: NodeConfig,
}

impl World {
    fn new(yaml: &str) -> Self {
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
                nodeport_addresses: "0.0.0.0/0,::/0".parse().unwrap(),
            },
            config: NodeConfig {
                cluster_cidrs: vec![POD_CIDR.parse().unwrap()],
                ..Default::default()
            },
        }
    }

    fn desired(&self) -> DesiredState {
        desired::build(
            &self.cluster,
            NodeView::named(NODE),
            &self.facts,
            &self.state,
        )
    }

    fn ruleset(&self) -> Ruleset {
        render(&self.desired(), &self.config)
    }

    fn env(&self) -> Env {
        Env {
            local_addrs: self.facts.local_ips.clone(),
            ..Env::default()
        }
    }

    fn text(&self) -> String {
        self.ruleset()
            .families
            .iter()
            .map(|f| create_all(f, false).text())
            .collect()
    }

    fn trace(&self, packet: Packet) -> Trace {
        let family = IpFamily::of(packet.dst);
        let view = self.ruleset().family(family).expect("family").view();
        trace(&view, &packet, &self.env())
    }
}

/// A NodePort Service `default/web` (ClusterIP 10.96.0.10:80, NodePort 30080) with
/// endpoints and extra spec lines (the nftables tests' fixture).
fn web(spec_extra: &str, endpoints: &str) -> String {
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

const THREE_ENDPOINTS: &str = r#"- {addresses: [10.244.1.1], nodeName: node-a}
- {addresses: [10.244.2.1], nodeName: node-b}
- {addresses: [10.244.3.1], nodeName: node-c}"#;

fn tcp(src: &str, dst: &str, port: u16) -> Packet {
    Packet::remote(src, dst, Protocol::Tcp, port)
}

fn delivered(to: &str, masqueraded: bool) -> Fate {
    Fate::Delivered {
        dnat: Some(to.parse().unwrap()),
        masqueraded,
        affinity: vec![],
    }
}

fn web_port() -> ServicePortName {
    ServicePortName::new("default", "web", "", Protocol::Tcp)
}

#[test]
fn rendered_restore_matches_the_golden_text() {
    let yaml = web(
        "",
        "- {addresses: [10.244.1.1], nodeName: node-a}\n- {addresses: [10.244.2.1], nodeName: node-b}",
    );
    let text = World::new(&yaml).text();
    let golden = include_str!("testdata/web-nodeport.iptables");
    assert_eq!(text, golden, "golden mismatch; got:\n{text}");
}

#[test]
fn reference_000s_web_service_gets_its_chain_names_and_probabilities() {
    // Reference 000: `default/web`, three endpoints, KUBE-SVC-LOLE4ISW44XBNF3G.
    let w = World::new(&web("", THREE_ENDPOINTS));
    let text = w.text();
    for line in [
        "-A KUBE-NODEPORTS -m comment --comment default/web -m tcp -p tcp --dport 30080 -j KUBE-EXT-LOLE4ISW44XBNF3G",
        "-A KUBE-EXT-LOLE4ISW44XBNF3G -j KUBE-SVC-LOLE4ISW44XBNF3G",
        "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS",
    ] {
        assert!(text.contains(line), "missing {line:?} in:\n{text}");
    }
    let svc = ServiceChainNames::new(&web_port()).cluster;
    let rules: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with(&format!("-A {svc} ")) && l.contains("KUBE-SEP-"))
        .collect();
    assert_eq!(rules.len(), 3, "{text}");
    assert!(
        rules[0].contains("--probability 0.3333333333"),
        "{}",
        rules[0]
    );
    assert!(
        rules[1].contains("--probability 0.5000000000"),
        "{}",
        rules[1]
    );
    assert!(!rules[2].contains("statistic"), "{}", rules[2]);
}

/// kube-proxy's `TestOverallIPTablesRules` (proxier_test.go) as objects.
const KUBE_PROXY_OVERALL: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: svc1, namespace: ns1}
spec: {type: ClusterIP, clusterIP: 172.30.0.41, ports: [{name: p80, port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: svc2, namespace: ns2}
spec: {type: LoadBalancer, externalTrafficPolicy: Local, clusterIP: 172.30.0.42, externalIPs: [192.168.99.22], healthCheckNodePort: 30000, ports: [{name: p80, port: 80, nodePort: 3001}]}
status: {loadBalancer: {ingress: [{ip: 1.2.3.4}]}}
---
apiVersion: v1
kind: Service
metadata: {name: svc3, namespace: ns3}
spec: {type: NodePort, clusterIP: 172.30.0.43, ports: [{name: p80, port: 80, nodePort: 3003}]}
---
apiVersion: v1
kind: Service
metadata: {name: svc4, namespace: ns4}
spec: {type: NodePort, clusterIP: 172.30.0.44, externalIPs: [192.168.99.33], ports: [{name: p80, port: 80, targetPort: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: svc5, namespace: ns5}
spec: {type: LoadBalancer, externalTrafficPolicy: Cluster, clusterIP: 172.30.0.45, healthCheckNodePort: 30000, loadBalancerSourceRanges: [203.0.113.0/25], sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 10800}}, ports: [{name: p80, port: 80, nodePort: 3002}]}
status: {loadBalancer: {ingress: [{ip: 5.6.7.8}]}}
---
apiVersion: v1
kind: Service
metadata: {name: svc6, namespace: ns6}
spec: {type: ClusterIP, clusterIP: 172.30.0.46, ports: [{name: p80, port: 80, targetPort: 80}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: svc1-1, namespace: ns1, labels: {kubernetes.io/service-name: svc1}}
addressType: IPv4
ports: [{name: p80, port: 80}]
endpoints: [{addresses: [10.180.0.1]}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: svc2-1, namespace: ns2, labels: {kubernetes.io/service-name: svc2}}
addressType: IPv4
ports: [{name: p80, port: 80}]
endpoints: [{addresses: [10.180.0.2]}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: svc3-1, namespace: ns3, labels: {kubernetes.io/service-name: svc3}}
addressType: IPv4
ports: [{name: p80, port: 80}]
endpoints: [{addresses: [10.180.0.3]}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: svc4-1, namespace: ns4, labels: {kubernetes.io/service-name: svc4}}
addressType: IPv4
ports: [{name: p80, port: 80}]
endpoints: [{addresses: [10.180.0.4]}, {addresses: [10.180.0.5], nodeName: test-node}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: svc5-1, namespace: ns5, labels: {kubernetes.io/service-name: svc5}}
addressType: IPv4
ports: [{name: p80, port: 80}]
endpoints: [{addresses: [10.180.0.3]}]
"#;

/// kube-proxy's expected `iptables-restore` input for [`KUBE_PROXY_OVERALL`], copied from
/// its unit test.
const KUBE_PROXY_OVERALL_EXPECTED: &str = include_str!("testdata/kube-proxy-overall.iptables");

#[test]
fn kube_proxys_overall_iptables_test_vector_is_reproduced_line_for_line() {
    let loaded = objects::load(KUBE_PROXY_OVERALL).unwrap();
    let facts = NodeFacts {
        node_ips: vec!["192.168.0.2".parse().unwrap()],
        local_ips: vec!["192.168.0.2".parse().unwrap()],
        ..Default::default()
    };
    let state = StateConfig {
        families: vec![IpFamily::V4],
        nodeport_addresses: "0.0.0.0/0".parse().unwrap(),
    };
    let d = desired::build(
        &loaded.cluster,
        NodeView::named("test-node"),
        &facts,
        &state,
    );
    let config = NodeConfig {
        cluster_cidrs: vec!["10.0.0.0/8".parse().unwrap()],
        ..Default::default()
    };
    let rules = render(&d, &config);
    let restore = create_all(rules.family(IpFamily::V4).unwrap(), false);
    // Our side: kube-proxy's unit tests inject the mark "0x4000" and an iptables without
    // --random-fully; the jumps from built-in chains are ensured outside the restore there.
    let ours: BTreeSet<String> = restore
        .text()
        .lines()
        .filter(|l| !l.starts_with("-I "))
        .map(|l| {
            l.replace("0x004000", "0x4000")
                .replace("MASQUERADE --random-fully", "MASQUERADE")
        })
        .collect();
    // Their side: nfacct counters exist in their fake, not here (no nfacct rules).
    let theirs: BTreeSet<String> = KUBE_PROXY_OVERALL_EXPECTED
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.contains("localhost_nps_accepted_pkts"))
        .map(|l| l.replace("-m nfacct --nfacct-name ct_state_invalid_dropped_pkts ", ""))
        .collect();
    let missing: Vec<_> = theirs.difference(&ours).collect();
    let extra: Vec<_> = ours.difference(&theirs).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "missing: {missing:#?}\nextra: {extra:#?}"
    );
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
    assert_eq!(t.only(), &delivered("10.244.1.1:8080", true));
}

#[test]
fn service_without_endpoints_is_rejected_on_clusterip_and_nodeport() {
    let w = World::new(&web("", "  []"));
    assert_eq!(
        w.trace(tcp("10.244.9.9", "10.96.0.10", 80)).only(),
        &Fate::Rejected("KUBE-SERVICES".into())
    );
    assert_eq!(
        w.trace(tcp(CLIENT, NODE_IP, 30080)).only(),
        &Fate::Rejected("KUBE-EXTERNAL-SERVICES".into())
    );
    let text = w.text();
    assert!(text.contains(
        "-A KUBE-SERVICES -m comment --comment \"default/web has no endpoints\" -m tcp -p tcp -d 10.96.0.10 --dport 80 -j REJECT"
    ), "{text}");
    assert!(!text.contains(":KUBE-SVC-"), "no nat chains: {text}");
}

#[test]
fn etp_local_nodeport_without_local_endpoint_is_dropped() {
    let w = World::new(&web(
        "  externalTrafficPolicy: Local",
        "- {addresses: [10.244.2.1], nodeName: node-b}",
    ));
    assert_eq!(
        w.trace(tcp(CLIENT, NODE_IP, 30080)).only(),
        &Fate::Dropped("KUBE-EXTERNAL-SERVICES".into())
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
    assert_eq!(t.only(), &delivered("10.244.1.1:8080", false), "{t}");
}

#[test]
fn etp_local_short_circuits_pod_and_node_traffic_to_all_endpoints() {
    let w = World::new(&web(
        "  externalTrafficPolicy: Local",
        "- {addresses: [10.244.2.1], nodeName: node-b}",
    ));
    let pod = w.trace(tcp("10.244.9.9", NODE_IP, 30080));
    assert_eq!(pod.endpoints().len(), 1, "{pod}");
    assert!(pod.all_masqueraded(false), "{pod}");
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
        &Fate::Dropped("KUBE-SERVICES".into())
    );
}

#[test]
fn session_affinity_sends_a_known_client_to_its_endpoint_and_records_new_ones() {
    let w = World::new(&web(
        "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 600}}",
        THREE_ENDPOINTS,
    ));
    let text = w.text();
    let sep = endpoint_chain(&web_port(), "10.244.3.1".parse().unwrap(), 8080);
    assert!(
        text.contains(&format!(
            "-m recent --name {sep} --rcheck --seconds 600 --reap -j {sep}"
        )),
        "{text}"
    );
    let first = w.trace(tcp(CLIENT, NODE_IP, 30080));
    assert_eq!(first.endpoints().len(), 3);
    for (fate, _) in &first.fates {
        let Fate::Delivered { affinity, .. } = fate else {
            panic!("{first}")
        };
        assert_eq!(affinity.len(), 1, "{first}");
    }
    let mut env = w.env();
    env.affinity.push((sep, CLIENT.parse().unwrap()));
    let view = w.ruleset().family(IpFamily::V4).unwrap().view();
    let again = trace(&view, &tcp(CLIENT, NODE_IP, 30080), &env);
    assert_eq!(
        again.endpoints(),
        BTreeSet::from(["10.244.3.1:8080".parse().unwrap()]),
        "{again}"
    );
}

fn lb(extra: &str) -> String {
    web(
        &format!("{extra}\nstatus: {{loadBalancer: {{ingress: [{{ip: 198.51.100.200}}]}}}}"),
        THREE_ENDPOINTS,
    )
    .replace("type: NodePort", "type: LoadBalancer")
}

#[test]
fn load_balancer_source_ranges_admit_listed_sources_only() {
    let w = World::new(&lb("  loadBalancerSourceRanges: [203.0.113.0/25]"));
    let allowed = w.trace(tcp("203.0.113.5", "198.51.100.200", 80));
    assert_eq!(allowed.endpoints().len(), 3, "{allowed}");
    let denied = w.trace(tcp("203.0.113.200", "198.51.100.200", 80));
    assert_eq!(
        denied.only(),
        &Fate::Dropped("KUBE-PROXY-FIREWALL".into()),
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
    let w = World::new(&lb("  loadBalancerSourceRanges: [192.0.2.0/24]"));
    let fw = ServiceChainNames::new(&web_port());
    let text = w.text();
    assert!(
        text.contains(&format!(
            "-A {} -m comment --comment \"default/web loadbalancer IP\" -s 198.51.100.200 -j {}",
            fw.firewall, fw.external
        )),
        "{text}"
    );
}

#[test]
fn external_ips_and_load_balancer_ips_reach_the_endpoints() {
    let w = World::new(&lb("  externalIPs: [198.51.100.77]"));
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
        &Fate::Rejected("KUBE-EXTERNAL-SERVICES".into())
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
    assert!(w.text().contains("-m sctp -p sctp --dport 30054"));
}

#[test]
fn nodeport_answers_on_every_address_by_default_and_only_on_the_selected_ones_otherwise() {
    let mut w = World::new(&web("", THREE_ENDPOINTS));
    for ip in [NODE_IP, NODE_IP2] {
        assert_eq!(w.trace(tcp(CLIENT, ip, 30080)).endpoints().len(), 3);
    }
    // `primary`: the Node object's IP only, one `-d` rule.
    w.state.nodeport_addresses = NodePortAddresses::default();
    assert_eq!(w.trace(tcp(CLIENT, NODE_IP, 30080)).endpoints().len(), 3);
    assert!(w.trace(tcp(CLIENT, NODE_IP2, 30080)).endpoints().is_empty());
    assert!(w.text().contains(
        "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -d 192.0.2.10 -j KUBE-NODEPORTS"
    ));
    // A CIDR selecting the second address only.
    w.state.nodeport_addresses = "198.51.100.0/24".parse().unwrap();
    assert_eq!(w.trace(tcp(CLIENT, NODE_IP2, 30080)).endpoints().len(), 3);
    assert!(w.trace(tcp(CLIENT, NODE_IP, 30080)).endpoints().is_empty());
}

#[test]
fn localhost_nodeports_are_served_with_route_localnet_and_martians_to_127_are_dropped() {
    let mut w = World::new(&web("", THREE_ENDPOINTS));
    let t = w.trace(Packet::local(
        "127.0.0.1",
        "127.0.0.1",
        Protocol::Tcp,
        30080,
    ));
    assert_eq!(t.endpoints().len(), 3, "{t}");
    assert!(t.all_masqueraded(true), "{t}");
    // CVE-2020-8558: from outside, 127/8 is reachable only through a NodePort's DNAT.
    assert_eq!(
        w.trace(tcp(CLIENT, "127.0.0.1", 22)).only(),
        &Fate::Dropped(KUBE_FIREWALL.into())
    );
    // --iptables-localhost-nodeports=false: loopback is excluded from the NodePort jump.
    w.config.localhost_nodeports = false;
    let t = w.trace(Packet::local(
        "127.0.0.1",
        "127.0.0.1",
        Protocol::Tcp,
        30080,
    ));
    assert!(t.endpoints().is_empty(), "{t}");
    assert!(
        w.text()
            .contains("-m addrtype --dst-type LOCAL ! -d 127.0.0.0/8 -j KUBE-NODEPORTS")
    );
    assert!(!w.text().contains("-A KUBE-FIREWALL"));
}

#[test]
fn ipv6_services_render_for_ip6tables() {
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
    let v6 = rules.family(IpFamily::V6).unwrap();
    let text = create_all(v6, false).text();
    assert!(
        text.contains("-j DNAT --to-destination [fd00:244::1]:80"),
        "{text}"
    );
    assert!(text.contains("-s fd00:244::1 -j KUBE-MARK-MASQ"), "{text}");
    assert!(
        text.contains("-m addrtype --dst-type LOCAL ! -d ::1/128 -j KUBE-NODEPORTS"),
        "{text}"
    );
    assert!(!text.contains("127.0.0.0/8"), "{text}");
    let t = trace(
        &v6.view(),
        &Packet::remote("2001:db8::99", "2001:db8::10", Protocol::Tcp, 30081),
        &w.env(),
    );
    assert_eq!(
        t.endpoints(),
        BTreeSet::from(["[fd00:244::1]:80".parse().unwrap()]),
        "{t}"
    );
    // The IPv4 rules do not know the IPv6 service.
    assert!(rules.family(IpFamily::V4).unwrap().services.is_empty());
}

#[test]
fn above_a_thousand_endpoints_per_endpoint_comments_are_left_out() {
    let eps: Vec<String> = (0..1001)
        .map(|i| format!("- {{addresses: [10.244.{}.{}]}}", i / 250, i % 250 + 1))
        .collect();
    let w = World::new(&web("", &eps.join("\n")));
    let text = w.text();
    let sep = endpoint_chain(&web_port(), "10.244.0.1".parse().unwrap(), 8080);
    assert!(
        text.contains(&format!("-A {sep} -s 10.244.0.1 -j KUBE-MARK-MASQ")),
        "no comment in large cluster mode"
    );
    assert!(text.contains("-A KUBE-SERVICES -m comment --comment \"default/web cluster IP\""));
}

// ---- applying: partial and full syncs against the fake kernel ----

fn applier_with(w: &World) -> (Applier<FakeKernel>, DesiredState) {
    let mut a = Applier::new(FakeKernel::default());
    let d = w.desired();
    let r = a.sync(&d, &w.config, None).expect("first sync");
    assert!(r.full);
    (a, d)
}

fn kernel_trace(a: &Applier<FakeKernel>, w: &World, p: Packet) -> Trace {
    trace(&a.kernel().view(IpFamily::V4), &p, &w.env())
}

fn last_restore(a: &Applier<FakeKernel>) -> &super::ruleset::Restore {
    a.kernel().history.last().expect("a restore")
}

fn declared(a: &Applier<FakeKernel>, table: Table) -> Vec<String> {
    last_restore(a)
        .table(table)
        .map(|t| t.declare.clone())
        .unwrap_or_default()
}

#[test]
fn first_sync_programs_the_same_behaviour_as_the_rendered_rules() {
    let w = World::new(&lb("  loadBalancerSourceRanges: [203.0.113.0/25]"));
    let (a, _) = applier_with(&w);
    for p in [
        tcp(CLIENT, NODE_IP, 30080),
        tcp("203.0.113.200", "198.51.100.200", 80),
        tcp("10.244.9.9", "10.96.0.10", 80),
        Packet::local("127.0.0.1", "127.0.0.1", Protocol::Tcp, 30080),
    ] {
        assert_eq!(kernel_trace(&a, &w, p.clone()).fates, w.trace(p).fates);
    }
    // The jumps from built-in chains and the canaries are there.
    let view = a.kernel().view(IpFamily::V4);
    assert_eq!(view.chain(Table::Nat, "PREROUTING").unwrap().len(), 1);
    assert_eq!(view.chain(Table::Filter, "INPUT").unwrap().len(), 4);
    for t in [Table::Filter, Table::Nat, Table::Mangle] {
        assert!(view.chain(t, KUBE_PROXY_CANARY).is_some(), "{t}");
    }
    assert!(
        a.kernel().route_localnet,
        "localhost NodePorts need route_localnet"
    );
}

#[test]
fn a_failed_route_localnet_write_is_logged_and_the_rules_still_sync_as_kube_proxy_does() {
    // kube-proxy (and our nftables mode) only logs a failed route_localnet write:
    // localhost NodePorts then do not reach pods, everything else keeps being synced.
    let w = World::new(&web("", THREE_ENDPOINTS));
    let kernel = FakeKernel {
        route_localnet_fault: Some("read-only file system".to_string()),
        ..FakeKernel::default()
    };
    let mut a = Applier::new(kernel);
    let r = a
        .sync(&w.desired(), &w.config, None)
        .expect("the sync goes on without route_localnet");
    assert!(r.full);
    assert!(!a.kernel().route_localnet);
    assert!(
        a.route_localnet_failure()
            .is_some_and(|f| f.contains("read-only file system")),
        "{:?}",
        a.route_localnet_failure()
    );
    assert_eq!(
        kernel_trace(&a, &w, tcp(CLIENT, NODE_IP, 30080))
            .endpoints()
            .len(),
        3
    );

    // Later changes still reach the kernel (the `?` used to end every sync here).
    let w = World::new(&web("", "- {addresses: [10.244.1.1], nodeName: node-a}"));
    let changed = BTreeSet::from([web_port()]);
    let r = a
        .sync(&w.desired(), &w.config, Some(&changed))
        .expect("a partial sync goes on too");
    assert!(!r.full, "the failure does not force full syncs");
    assert_eq!(
        kernel_trace(&a, &w, tcp(CLIENT, NODE_IP, 30080)).only(),
        &delivered("10.244.1.1:8080", true)
    );

    // Once the write works, it is made and the failure forgotten.
    a.kernel_mut().route_localnet_fault = None;
    a.sync(&w.desired(), &w.config, Some(&BTreeSet::new()))
        .unwrap();
    assert!(a.kernel().route_localnet);
    assert_eq!(a.route_localnet_failure(), None);
}

#[test]
fn a_sync_without_changes_rewrites_only_the_top_level_chains() {
    let w = World::new(&web("", THREE_ENDPOINTS));
    let (mut a, d) = applier_with(&w);
    let r = a.sync(&d, &w.config, Some(&BTreeSet::new())).unwrap();
    assert!(!r.full);
    assert_eq!(r.service_chains_written, 0);
    let nat = declared(&a, Table::Nat);
    assert_eq!(
        nat,
        [
            "KUBE-SERVICES",
            "KUBE-NODEPORTS",
            "KUBE-POSTROUTING",
            "KUBE-MARK-MASQ"
        ]
    );
    assert!(last_restore(&a).table(Table::Mangle).is_none());
}

#[test]
fn a_partial_sync_rewrites_only_the_changed_service_and_deletes_its_stale_chains() {
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
    let slice = objects::load(&web(
        "",
        "- {addresses: [10.244.1.1], nodeName: node-a}\n- {addresses: [10.244.2.1], nodeName: node-b}",
    ))
    .unwrap();
    let key = ServiceName::new("default", "web-1");
    w.cluster
        .update_slice(key.clone(), slice.cluster.slices.get(&key).cloned());
    let changes = w.cluster.take_changes();
    let touched = d.refresh_services(&w.cluster, NodeView::named(NODE), &changes.services);
    let r = a.sync(&d, &w.config, Some(&touched)).unwrap();
    assert!(!r.full);
    assert_eq!(
        r.deleted_chains, 1,
        "the endpoint chain of 10.244.3.1 is gone"
    );
    let gone = endpoint_chain(&web_port(), "10.244.3.1".parse().unwrap(), 8080);
    let nat = last_restore(&a).table(Table::Nat).unwrap();
    assert!(nat.lines.contains(&Line::DeleteChain(gone.clone())));
    let api = ServiceChainNames::new(&ServicePortName::new("default", "api", "", Protocol::Tcp));
    assert!(
        !nat.declare.contains(&api.cluster),
        "untouched service rewritten: {:?}",
        nat.declare
    );
    assert!(
        a.kernel()
            .view(IpFamily::V4)
            .chain(Table::Nat, &gone)
            .is_none()
    );
    let t = kernel_trace(&a, &w, tcp(CLIENT, NODE_IP, 30080));
    assert_eq!(t.endpoints().len(), 2, "{t}");
    assert_eq!(t.fates, w.trace(tcp(CLIENT, NODE_IP, 30080)).fates);
}

#[test]
fn deleting_a_service_deletes_its_chains() {
    let mut w = World::new(&web("", THREE_ENDPOINTS));
    let (mut a, mut d) = applier_with(&w);
    w.cluster
        .update_service(ServiceName::new("default", "web"), None);
    let changes = w.cluster.take_changes();
    let touched = d.refresh_services(&w.cluster, NodeView::named(NODE), &changes.services);
    let r = a.sync(&d, &w.config, Some(&touched)).unwrap();
    assert_eq!(r.deleted_chains, 5, "SVC, EXT and three SEP chains");
    let view = a.kernel().view(IpFamily::V4);
    assert!(
        view.user_chains(Table::Nat)
            .all(|c| !c.starts_with("KUBE-S") || c == "KUBE-SERVICES"),
        "{:?}",
        view.user_chains(Table::Nat).collect::<Vec<_>>()
    );
    assert!(
        kernel_trace(&a, &w, tcp(CLIENT, NODE_IP, 30080))
            .endpoints()
            .is_empty()
    );
}

#[test]
fn a_failed_restore_keeps_the_old_rules_and_the_next_sync_is_full() {
    let mut w = World::new(&web("", THREE_ENDPOINTS));
    let (mut a, mut d) = applier_with(&w);
    let before = a.kernel().tables.clone();
    w.cluster
        .update_service(ServiceName::new("default", "web"), None);
    let changes = w.cluster.take_changes();
    let touched = d.refresh_services(&w.cluster, NodeView::named(NODE), &changes.services);
    a.kernel_mut().fail_next = 1;
    assert!(a.sync(&d, &w.config, Some(&touched)).is_err());
    assert_eq!(a.kernel().tables, before);
    assert!(a.needs_full_sync());
    let r = a.sync(&d, &w.config, Some(&BTreeSet::new())).unwrap();
    assert!(r.full);
    assert_eq!(r.deleted_chains, 5);
}

#[test]
fn start_up_takes_over_existing_chains_without_duplicating_jumps() {
    let w = World::new(&web("", THREE_ENDPOINTS));
    let (a, d) = applier_with(&w);
    // A new process on the same kernel, which also holds a chain of a Service now gone and
    // someone else's rule in PREROUTING.
    let mut kernel = a.kernel().clone();
    let view = kernel.tables.get_mut(&IpFamily::V4).unwrap();
    view.chains
        .insert((Table::Nat, "KUBE-SVC-OLDOLDOLDOLDOLDO".into()), vec![]);
    view.chains
        .get_mut(&(Table::Nat, "PREROUTING".into()))
        .unwrap()
        .push(super::ruleset::Rule::new(
            vec![],
            super::ruleset::Target::Accept,
        ));
    let mut b = Applier::new(kernel);
    let r = b.sync(&d, &w.config, Some(&BTreeSet::new())).unwrap();
    assert!(r.full);
    assert_eq!(r.deleted_chains, 1);
    let view = b.kernel().view(IpFamily::V4);
    assert_eq!(
        view.chain(Table::Nat, "PREROUTING").unwrap().len(),
        2,
        "our jump once, the other rule kept"
    );
    assert!(
        last_restore(&b)
            .tables
            .iter()
            .all(|t| t.lines.iter().all(|l| !matches!(l, Line::Prepend(..))))
    );
    assert_eq!(
        kernel_trace(&b, &w, tcp(CLIENT, NODE_IP, 30080))
            .endpoints()
            .len(),
        3
    );
}

#[test]
fn flushed_tables_are_noticed_by_the_canary_and_rebuilt_with_their_jumps() {
    let w = World::new(&web("", THREE_ENDPOINTS));
    let (mut a, d) = applier_with(&w);
    // firewalld reload: every table flushed, every user chain deleted.
    a.kernel_mut().tables.clear();
    let r = a.sync(&d, &w.config, Some(&BTreeSet::new())).unwrap();
    assert!(r.full, "the missing canary makes the sync full");
    assert_eq!(
        kernel_trace(&a, &w, tcp(CLIENT, NODE_IP, 30080))
            .endpoints()
            .len(),
        3
    );
}

#[test]
fn kubelets_firewall_chain_is_left_alone_when_localhost_nodeports_are_off() {
    let mut w = World::new(&web("", THREE_ENDPOINTS));
    w.state.nodeport_addresses = NodePortAddresses::default();
    let mut kernel = FakeKernel::default();
    let mut view = super::ruleset::TableView::empty();
    let kubelet = super::ruleset::Rule::new(vec![], super::ruleset::Target::Drop);
    view.chains
        .insert((Table::Filter, KUBE_FIREWALL.into()), vec![kubelet.clone()]);
    kernel.tables.insert(IpFamily::V4, view);
    let mut a = Applier::new(kernel);
    a.sync(&w.desired(), &w.config, None).unwrap();
    let view = a.kernel().view(IpFamily::V4);
    assert_eq!(view.chain(Table::Filter, KUBE_FIREWALL).unwrap(), [kubelet]);
    assert!(!a.kernel().route_localnet);
}

#[test]
fn a_loopback_cidr_serves_localhost_nodeports_with_kube_proxys_per_address_jumps() {
    // kube-proxy: `localhostNodePorts` stays on when the NodePort CIDRs contain IPv4
    // loopback; GetNodeIPs returns 127.0.0.1, which gets its own `-d` jump.
    let mut w = World::new(&web("", THREE_ENDPOINTS));
    w.facts.local_ips.push("127.0.0.1".parse().unwrap());
    w.state.nodeport_addresses = "127.0.0.0/8,198.51.100.0/24".parse().unwrap();
    let text = w.text();
    for line in [
        "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -d 127.0.0.1 -j KUBE-NODEPORTS",
        "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -d 198.51.100.10 -j KUBE-NODEPORTS",
        "-A KUBE-FIREWALL -m comment --comment \"block incoming localnet connections\" -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in:\n{text}"
        );
    }
    assert!(!text.contains("-d 192.0.2.10 -j KUBE-NODEPORTS"), "{text}");
    let t = w.trace(Packet::local(
        "127.0.0.1",
        "127.0.0.1",
        Protocol::Tcp,
        30080,
    ));
    assert_eq!(t.endpoints().len(), 3, "{t}");
    assert!(t.all_masqueraded(true), "{t}");
    assert_eq!(
        w.trace(tcp(CLIENT, "127.0.0.1", 22)).only(),
        &Fate::Dropped(KUBE_FIREWALL.into())
    );
    let (a, _) = applier_with(&w);
    assert!(
        a.kernel().route_localnet,
        "localhost NodePorts need route_localnet"
    );

    // --iptables-localhost-nodeports=false wins: no loopback jump, no guard.
    w.config.localhost_nodeports = false;
    let text = w.text();
    assert!(!text.contains("-d 127.0.0.1 -j KUBE-NODEPORTS"), "{text}");
    assert!(!text.contains("-A KUBE-FIREWALL"), "{text}");
    assert!(
        text.contains("-d 198.51.100.10 -j KUBE-NODEPORTS"),
        "{text}"
    );
}

#[test]
fn default_route_renders_one_jump_per_address_of_the_default_route_interface() {
    let mut w = World::new(&web("", THREE_ENDPOINTS));
    w.state.nodeport_addresses = "default-route".parse::<NodePortAddresses>().unwrap();
    w.facts.default_route_ips = vec![NODE_IP2.parse().unwrap()];
    let text = w.text();
    assert!(
        text.contains("-d 198.51.100.10 -j KUBE-NODEPORTS"),
        "{text}"
    );
    assert!(!text.contains("-d 192.0.2.10 -j KUBE-NODEPORTS"), "{text}");
    assert!(!text.contains("--dst-type LOCAL"), "{text}");
    assert!(!text.contains("-A KUBE-FIREWALL"), "{text}");
    assert_eq!(w.trace(tcp(CLIENT, NODE_IP2, 30080)).endpoints().len(), 3);
    assert!(w.trace(tcp(CLIENT, NODE_IP, 30080)).endpoints().is_empty());
}

#[test]
fn a_nodeports_path_is_each_rule_it_matched_and_the_statistic_choice_once() {
    let w = World::new(&web("", THREE_ENDPOINTS));
    let t = w.trace(tcp(CLIENT, NODE_IP, 30080));
    let path = crate::trace::path::fold(&t.walks, crate::trace::path::Choosing::Random);
    let mut text = String::new();
    crate::trace::path::write_lines(&mut text, &path).unwrap();
    assert!(
        text.starts_with(
            "path        ip nat PREROUTING rule #1: jump KUBE-SERVICES\n\
             path        ip nat KUBE-SERVICES rule #"
        ),
        "{text}"
    );
    let choices: Vec<&crate::trace::path::Step> =
        path.iter().filter(|s| s.kind == "choice").collect();
    assert_eq!(choices.len(), 1, "{text}");
    let choice = choices[0];
    assert!(choice.chain.starts_with("KUBE-SVC-"), "{text}");
    // Each endpoint's own `statistic` rule (the first two) or the last, then its KUBE-SEP
    // chain's DNAT.
    let rules: Vec<Option<usize>> = choice
        .candidates
        .iter()
        .map(|c| c.path[0].rule_index)
        .collect();
    assert_eq!(rules.len(), 3, "{text}");
    for c in &choice.candidates {
        assert!(c.path[0].verdict.starts_with("jump KUBE-SEP-"), "{text}");
        let last = c.path.last().unwrap();
        assert!(
            last.chain.starts_with("KUBE-SEP-") && last.verdict == "accept",
            "{text}"
        );
    }
    let mut distinct = rules.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), 3, "{text}");
    assert!(
        text.ends_with("path        ip nat KUBE-POSTROUTING rule #3: accept\n"),
        "{text}"
    );
}

#[test]
fn the_nodes_own_connection_to_its_nodeport_without_endpoints_is_rejected_back_in_through_loopback()
{
    // Out through nat OUTPUT, filter OUTPUT and nat POSTROUTING untranslated, then in again
    // through loopback: filter INPUT's KUBE-EXTERNAL-SERVICES rejects it.
    let w = World::new(&web("", ""));
    let t = w.trace(Packet::local(NODE_IP, NODE_IP, Protocol::Tcp, 30080));
    assert_eq!(
        t.only(),
        &Fate::Rejected("KUBE-EXTERNAL-SERVICES".into()),
        "{t}"
    );
}
