//! Rendering tests: Services and EndpointSlices → the eBPF maps' frontends and backend sets,
//! and what the tracer finds the programs do with a packet over them.

use super::render::{Algorithm, RenderConfig, render};
use crate::desired::{self, DesiredState, NodeView, StateConfig};
use crate::model::Protocol;
use crate::nodeaddr::NodeFacts;
use crate::objects;
use crate::trace::{Env, Fate, Packet, Trace};

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
    // The socket hooks check the ranges too (kube-proxy's firewall chain drops every source
    // outside them, the node's and pods' included).
    assert!(
        got.contains(&"198.51.100.200:80/TCP internal (default/web:http) → 10.244.1.5:8080 (random, affinity 10800s) from 203.0.113.0/24".to_string()),
        "{got:#?}"
    );
}

#[test]
fn a_socket_outside_load_balancer_source_ranges_is_left_untranslated_and_one_inside_served() {
    let yaml = service_yaml(
        "  type: LoadBalancer\n  loadBalancerSourceRanges: [203.0.113.0/24]\n  ports: [{name: http, port: 80, nodePort: 30080}]\nstatus: {loadBalancer: {ingress: [{ip: 198.51.100.200}]}}",
        &["10.244.1.5@node-a"],
    );
    let outside = Packet::local("192.0.2.10", "198.51.100.200", Protocol::Tcp, 80);
    let trace = traced(&yaml, Algorithm::Random, outside);
    assert_eq!(
        *trace.only(),
        Fate::Delivered {
            dnat: None,
            masqueraded: false,
            affinity: vec![]
        }
    );
    let inside = Packet::local("203.0.113.5", "198.51.100.200", Protocol::Tcp, 80);
    assert_eq!(
        traced(&yaml, Algorithm::Random, inside).probability_of("10.244.1.5:8080"),
        1.0
    );
}

#[test]
fn sctp_ports_are_not_rendered_and_render_says_why() {
    let yaml = service_yaml(
        "  ports: [{name: s, port: 9, protocol: SCTP}]",
        &["10.244.1.5@node-a"],
    );
    let got = lines(&yaml, Algorithm::Random);
    assert_eq!(got.len(), 1, "{got:#?}");
    assert!(
        got[0].contains("SCTP: not served in eBPF mode") && got[0].contains("CRC32c"),
        "{got:#?}"
    );
}

fn traced(yaml: &str, algorithm: Algorithm, packet: Packet) -> Trace {
    let config = RenderConfig {
        algorithm,
        ..Default::default()
    };
    super::tracer::trace(
        &render(&desired_of(yaml), &config),
        &packet,
        &Env::default(),
    )
}

#[test]
fn the_tracer_sends_a_cluster_nodeport_to_every_endpoint_snated_to_the_node() {
    let yaml = service_yaml(
        "  type: NodePort\n  ports: [{name: http, port: 80, nodePort: 30080}]",
        &["10.244.1.5@node-a", "10.244.2.7@node-b"],
    );
    let t = traced(
        &yaml,
        Algorithm::Random,
        Packet::remote("203.0.113.5", "192.0.2.10", Protocol::Tcp, 30080),
    );
    assert_eq!(t.probability_of("10.244.1.5:8080"), 0.5);
    assert_eq!(t.probability_of("10.244.2.7:8080"), 0.5);
    assert!(t.all_masqueraded(true), "{t}");
}

#[test]
fn the_tracer_gives_maglev_backends_their_share_of_the_table() {
    let yaml = service_yaml(
        "  type: NodePort\n  externalTrafficPolicy: Local\n  ports: [{name: http, port: 80, nodePort: 30080}]",
        &[
            "10.244.1.5@node-a",
            "10.244.1.6@node-a",
            "10.244.1.7@node-a",
        ],
    );
    let t = traced(
        &yaml,
        Algorithm::Maglev,
        Packet::remote("203.0.113.5", "192.0.2.10", Protocol::Tcp, 30080),
    );
    let total: f64 = t.fates.iter().map(|(_, p)| p).sum();
    assert!((total - 1.0).abs() < 1e-9, "{t}");
    for ep in ["10.244.1.5:8080", "10.244.1.6:8080", "10.244.1.7:8080"] {
        let p = t.probability_of(ep);
        // 16381 slots over three backends: 5460 or 5461 each.
        assert!((p - 1.0 / 3.0).abs() < 1e-4, "{ep}: {p}");
    }
    // Local backends under the Local policy keep the client's address.
    assert!(t.all_masqueraded(false), "{t}");
}

#[test]
fn the_tracer_rejects_without_endpoints_and_drops_a_local_policy_without_local_ones() {
    let none = service_yaml(
        "  type: NodePort\n  ports: [{name: http, port: 80, nodePort: 30080}]",
        &[],
    );
    let p = Packet::remote("203.0.113.5", "192.0.2.10", Protocol::Tcp, 30080);
    assert_eq!(
        *traced(&none, Algorithm::Random, p.clone()).only(),
        Fate::Rejected("np_tc_ingress".into())
    );
    let remote_only = service_yaml(
        "  type: NodePort\n  externalTrafficPolicy: Local\n  ports: [{name: http, port: 80, nodePort: 30080}]",
        &["10.244.2.7@node-b"],
    );
    assert_eq!(
        *traced(&remote_only, Algorithm::Random, p).only(),
        Fate::Dropped("np_tc_ingress".into())
    );
    // From a socket of the node the NodePort is short-circuited to every endpoint, as
    // kube-proxy does, and not SNATed.
    let local = Packet::local("192.0.2.10", "192.0.2.10", Protocol::Tcp, 30080);
    assert!(matches!(
        traced(&remote_only, Algorithm::Random, local).only(),
        Fate::Delivered {
            dnat: Some(_),
            masqueraded: false,
            ..
        }
    ));
}

#[test]
fn the_tracer_drops_sources_outside_load_balancer_source_ranges_and_passes_unknown_ports() {
    let yaml = service_yaml(
        "  type: LoadBalancer\n  loadBalancerSourceRanges: [203.0.113.0/24]\n  ports: [{name: http, port: 80, nodePort: 30080}]\nstatus: {loadBalancer: {ingress: [{ip: 198.51.100.200}]}}",
        &["10.244.1.5@node-a"],
    );
    let outside = Packet::remote("198.51.100.7", "198.51.100.200", Protocol::Tcp, 80);
    assert_eq!(
        *traced(&yaml, Algorithm::Random, outside).only(),
        Fate::Dropped("np_tc_ingress".into())
    );
    let inside = Packet::remote("203.0.113.5", "198.51.100.200", Protocol::Tcp, 80);
    assert_eq!(
        traced(&yaml, Algorithm::Random, inside).probability_of("10.244.1.5:8080"),
        1.0
    );
    let elsewhere = Packet::remote("203.0.113.5", "192.0.2.10", Protocol::Tcp, 22);
    assert_eq!(
        *traced(&yaml, Algorithm::Random, elsewhere).only(),
        Fate::Delivered {
            dnat: None,
            masqueraded: false,
            affinity: vec![]
        }
    );
}

#[test]
fn maps_read_back_trace_as_rendered_and_a_frontend_the_objects_lack_is_named_by_its_id() {
    use super::maps::{Frontend, FrontendKey, SVC_REJECT, Scope};
    let yaml = service_yaml(
        "  type: NodePort\n  ports: [{name: http, port: 80, nodePort: 30080}]",
        &["10.244.1.5@node-a", "10.244.2.7@node-b"],
    );
    let rendered = render(&desired_of(&yaml), &RenderConfig::default());
    // What an applier writes: a service id per frontend, a kernel set id per backend set,
    // backends at ordinals 1..=count.
    let mut frontends = Vec::new();
    // A map: one entry per (set, ordinal).
    let mut backends = std::collections::BTreeMap::new();
    let mut set_ids = std::collections::BTreeMap::new();
    for maps in rendered.services.values() {
        for (key, spec) in &maps.frontends {
            let list = spec.set.as_ref().map(|s| &maps.sets[s]);
            let next = set_ids.len() as u32 + 1;
            let be_set = match &spec.set {
                Some(s) => *set_ids.entry(s.clone()).or_insert(next),
                None => 0,
            };
            if let Some(list) = list {
                for (i, b) in list.iter().enumerate() {
                    backends.insert((be_set, i as u32 + 1), *b);
                }
            }
            frontends.push((
                *key,
                Frontend {
                    svc_id: 1,
                    be_set,
                    count: list.map_or(0, |l| l.len() as u16),
                    flags: spec.flags,
                    affinity_timeout: spec.affinity_timeout,
                },
            ));
        }
    }
    let backends: Vec<_> = backends.into_iter().collect();
    let stray = FrontendKey {
        addr: "192.0.2.10".parse().unwrap(),
        port: 31999,
        proto: 6,
        scope: Scope::External,
    };
    frontends.push((
        stray,
        Frontend {
            svc_id: 99,
            flags: SVC_REJECT,
            ..Default::default()
        },
    ));
    let read = super::render::from_maps(&frontends, &backends, &[], &Default::default(), &rendered);
    for packet in [
        Packet::remote("203.0.113.5", "192.0.2.10", Protocol::Tcp, 30080),
        Packet::local("192.0.2.10", "10.96.0.10", Protocol::Tcp, 80),
    ] {
        let env = Env::default();
        // The same fates; the paths alike but for the kernel's ids in the entries read.
        let (kernel, render) = (
            super::tracer::trace(&read, &packet, &env),
            super::tracer::trace(&rendered, &packet, &env),
        );
        assert_eq!(kernel.fates, render.fates, "{packet}");
        // (The frontend step names the kernel's service id: `frontend 1`.)
        let verdicts = |t: &crate::trace::Trace| -> Vec<Vec<String>> {
            t.walks
                .iter()
                .map(|w| w.steps[1..].iter().map(|s| s.verdict.clone()).collect())
                .collect()
        };
        assert_eq!(verdicts(&kernel), verdicts(&render), "{packet}");
    }
    let named: Vec<String> = read
        .services
        .keys()
        .map(|(n, _)| format!("{}/{}", n.namespace, n.name))
        .collect();
    assert!(named.contains(&"default/web".to_string()), "{named:?}");
    assert!(named.contains(&"/svc-99".to_string()), "{named:?}");
    let t = super::tracer::trace(
        &read,
        &Packet::remote("203.0.113.5", "192.0.2.10", Protocol::Tcp, 31999),
        &Env::default(),
    );
    assert_eq!(t.only(), &Fate::Rejected(super::tracer::TC_INGRESS.into()));
}

/// The folded path of a trace, one `describe` line per step (a choice's candidates' steps
/// after it, indented).
fn path_of(t: &Trace, choosing: crate::trace::path::Choosing) -> String {
    let path = crate::trace::path::fold(&t.walks, choosing);
    let mut text = String::new();
    crate::trace::path::write_lines(&mut text, &path).unwrap();
    text
}

#[test]
fn the_tracers_path_is_the_programs_map_look_ups_with_the_backend_chosen_once() {
    let yaml = service_yaml(
        "  type: LoadBalancer\n  sessionAffinity: ClientIP\n  loadBalancerSourceRanges: [203.0.113.0/24]\n  ports: [{name: http, port: 80, nodePort: 30080}]\nstatus: {loadBalancer: {ingress: [{ip: 198.51.100.200}]}}",
        &["10.244.1.5@node-a", "10.244.2.7@node-b"],
    );
    let t = traced(
        &yaml,
        Algorithm::Random,
        Packet::remote("203.0.113.5", "198.51.100.200", Protocol::Tcp, 80),
    );
    assert_eq!(
        path_of(&t, crate::trace::path::Choosing::Random),
        "path        ebpf np_tc_ingress frontend: 198.51.100.200:80/tcp: frontend; np_services { 198.51.100.200:80 tcp external : 2 backends, affinity, ranges, snat }\n\
         path        ebpf np_tc_ingress source ranges: 203.0.113.5 is in np_src_ranges; np_src_ranges { 203.0.113.0/24 }\n\
         path        ebpf np_tc_ingress affinity: np_affinity holds no backend for 203.0.113.5 (traced as a new client); np_affinity { 203.0.113.5 }: none\n\
         path        ebpf np_tc_ingress backend: random choice, one of 2\n\
         path          50.00% to 10.244.1.5:8080\n\
         path            ebpf np_tc_ingress backend: 10.244.1.5:8080 chosen; np_backends { ordinal 1 : 10.244.1.5:8080 }\n\
         path          50.00% to 10.244.2.7:8080\n\
         path            ebpf np_tc_ingress backend: 10.244.2.7:8080 chosen; np_backends { ordinal 2 : 10.244.2.7:8080 remote }\n\
         path        ebpf np_tc_ingress snat: source 203.0.113.5 becomes this node's address\n"
    );
    // Outside the ranges: the program drops it there.
    let t = traced(
        &yaml,
        Algorithm::Random,
        Packet::remote("192.0.2.99", "198.51.100.200", Protocol::Tcp, 80),
    );
    assert!(
        path_of(&t, crate::trace::path::Choosing::Random).ends_with(
            "path        ebpf np_tc_ingress source ranges: 192.0.2.99 is not in np_src_ranges: drop\n"
        ),
        "{t}"
    );
    // A socket of the node: the connect hook, which never SNATs; Maglev shares.
    let yaml = service_yaml(
        "  ports: [{name: http, port: 80}]",
        &[
            "10.244.1.5@node-a",
            "10.244.2.7@node-b",
            "10.244.3.9@node-c",
        ],
    );
    let t = traced(
        &yaml,
        Algorithm::Maglev,
        Packet::local("192.0.2.10", "10.96.0.10", Protocol::Tcp, 80),
    );
    let text = path_of(&t, crate::trace::path::Choosing::Maglev);
    assert!(
        text.starts_with(
            "path        ebpf np_connect4 frontend: 10.96.0.10:80/tcp: frontend; np_services { 10.96.0.10:80 tcp internal : 3 backends, maglev }\n\
             path        ebpf np_connect4 backend: Maglev table, one of 3\n"
        ),
        "{text}"
    );
    assert!(text.contains(": connect() goes there"), "{text}");
    // Each backend's share of the table, the slot naming its ordinal.
    assert!(
        text.contains("; np_maglev: ordinal 1 in ")
            && text.contains(" of 16381 slots, np_backends { ordinal 1 : "),
        "{text}"
    );
    assert!(!text.contains("snat"), "{text}");
}
