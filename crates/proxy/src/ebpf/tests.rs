//! Rendering tests: Services and EndpointSlices → the eBPF maps' frontends and backend sets.

use super::render::{Algorithm, RenderConfig, render};
use crate::desired::{self, DesiredState, NodeView, StateConfig};
use crate::nodeaddr::NodeFacts;
use crate::objects;

/// The desired state of `yaml` on node-a (192.0.2.10, 2001:db8::10).
pub(crate) fn desired_of(yaml: &str) -> DesiredState {
    let cluster = objects::load(yaml).expect("test objects").cluster;
    let facts = NodeFacts {
        node_ips: vec![
            "192.0.2.10".parse().unwrap(),
            "2001:db8::10".parse().unwrap(),
        ],
        local_ips: vec![
            "192.0.2.10".parse().unwrap(),
            "2001:db8::10".parse().unwrap(),
        ],
        ..Default::default()
    };
    desired::build(
        &cluster,
        NodeView::named("node-a"),
        &facts,
        &StateConfig::default(),
    )
}

/// A Service `web` with the given spec lines and endpoints (`ip@node`, `!` for not ready).
pub(crate) fn service_yaml(spec: &str, endpoints: &[&str]) -> String {
    let eps: Vec<String> = endpoints
        .iter()
        .map(|e| {
            let (ip, rest) = e.split_once('@').expect("ip@node");
            let ready = !rest.ends_with('!');
            let node = rest.trim_end_matches('!');
            format!("- {{addresses: [{ip}], nodeName: {node}, conditions: {{ready: {ready}}}}}")
        })
        .collect();
    format!(
        r#"
apiVersion: v1
kind: Service
metadata: {{name: web, namespace: default}}
spec:
  clusterIP: 10.96.0.10
{spec}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: web-1, namespace: default, labels: {{kubernetes.io/service-name: web}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}, {{name: dns, port: 5353, protocol: UDP}}]
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

fn lines(yaml: &str, algorithm: Algorithm) -> Vec<String> {
    let config = RenderConfig {
        algorithm,
        ..Default::default()
    };
    render(&desired_of(yaml), &config).lines(algorithm)
}

#[test]
fn a_cluster_ip_gets_a_frontend_per_scope_with_every_ready_endpoint() {
    let yaml = service_yaml(
        "  ports: [{name: dns, port: 53, protocol: UDP}]",
        &[
            "10.244.1.5@node-a",
            "10.244.2.7@node-b",
            "10.244.2.8@node-b!",
        ],
    );
    assert_eq!(
        lines(&yaml, Algorithm::Random),
        [
            "10.96.0.10:53/UDP external (default/web:dns) → 10.244.1.5:5353, 10.244.2.7:5353 (random)",
            "10.96.0.10:53/UDP internal (default/web:dns) → 10.244.1.5:5353, 10.244.2.7:5353 (random)",
        ]
    );
}

#[test]
fn a_nodeport_with_a_local_policy_sends_external_traffic_to_local_endpoints_only() {
    let yaml = service_yaml(
        "  type: NodePort\n  externalTrafficPolicy: Local\n  ports: [{name: http, port: 80, nodePort: 30080}]",
        &["10.244.1.5@node-a", "10.244.2.7@node-b"],
    );
    let got = lines(&yaml, Algorithm::Maglev);
    assert_eq!(
        got,
        [
            "10.96.0.10:80/TCP external (default/web:http) → 10.244.1.5:8080, 10.244.2.7:8080 (maglev)",
            "10.96.0.10:80/TCP internal (default/web:http) → 10.244.1.5:8080, 10.244.2.7:8080 (maglev)",
            "192.0.2.10:30080/TCP external (default/web:http) → 10.244.1.5:8080 (maglev)",
            // From the node itself: short-circuited to every endpoint, as kube-proxy does.
            "192.0.2.10:30080/TCP internal (default/web:http) → 10.244.1.5:8080, 10.244.2.7:8080 (maglev)",
        ]
    );
}

#[test]
fn a_local_policy_without_local_endpoints_drops_external_traffic() {
    let yaml = service_yaml(
        "  type: NodePort\n  externalTrafficPolicy: Local\n  ports: [{name: http, port: 80, nodePort: 30080}]",
        &["10.244.2.7@node-b"],
    );
    let got = lines(&yaml, Algorithm::Random);
    assert!(
        got.contains(
            &"192.0.2.10:30080/TCP external (default/web:http) → drop (no local endpoints)"
                .to_string()
        ),
        "{got:#?}"
    );
}

#[test]
fn a_service_without_endpoints_rejects_everywhere() {
    let yaml = service_yaml(
        "  type: NodePort\n  ports: [{name: http, port: 80, nodePort: 30080}]",
        &[],
    );
    let got = lines(&yaml, Algorithm::Random);
    assert_eq!(got.len(), 4);
    assert!(
        got.iter().all(|l| l.ends_with("→ reject (no endpoints)")),
        "{got:#?}"
    );
}

#[test]
fn load_balancer_ips_carry_source_ranges_and_affinity_its_timeout() {
    let yaml = service_yaml(
        "  type: LoadBalancer\n  sessionAffinity: ClientIP\n  loadBalancerSourceRanges: [203.0.113.0/24]\n  ports: [{name: http, port: 80, nodePort: 30080}]\nstatus: {loadBalancer: {ingress: [{ip: 198.51.100.200}]}}",
        &["10.244.1.5@node-a"],
    );
    let got = lines(&yaml, Algorithm::Random);
    assert!(
        got.contains(&"198.51.100.200:80/TCP external (default/web:http) → 10.244.1.5:8080 (random, affinity 10800s, masquerade) from 203.0.113.0/24".to_string()),
        "{got:#?}"
    );
    // From the node, the load-balancer IP is not filtered (kube-proxy admits the node's own
    // addresses as sources).
    assert!(
        got.contains(&"198.51.100.200:80/TCP internal (default/web:http) → 10.244.1.5:8080 (random, affinity 10800s)".to_string()),
        "{got:#?}"
    );
}

#[test]
fn sctp_ports_are_not_rendered() {
    let yaml = service_yaml(
        "  ports: [{name: s, port: 9, protocol: SCTP}]",
        &["10.244.1.5@node-a"],
    );
    assert!(lines(&yaml, Algorithm::Random).is_empty());
}
