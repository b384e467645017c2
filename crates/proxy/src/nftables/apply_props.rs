//! Property test of the applier's record: after any sequence of partial syncs, the kernel
//! holds exactly what one full sync of the same state writes into an empty one, in both
//! layouts. The generated Services collide on purpose (ClusterIPs, NodePorts and external
//! IPs from small pools, endpoints shared between Services, ports sharing a ClusterIP), so
//! that elements claimed by several Service ports change hands as ports come and go. Every
//! Service is dual-stack, its endpoints in two slices (one per family) with the same host
//! parts, so that the record's IPv4 and IPv6 claims (kept apart) are both exercised.

use proptest::prelude::*;

use super::apply::{Applier, FakeKernel};
use super::tests::World;
use crate::config::NftablesLayout;
use crate::desired::NodeView;
use crate::model::{IpFamily, ServiceName};
use crate::objects;

/// One Service and its EndpointSlice, or its absence.
#[derive(Debug, Clone)]
struct Spec {
    cluster_ip: usize,
    /// Which of the two ports (`a`: 80/TCP, `b`: 81/UDP) exist.
    ports: (bool, bool),
    node_ports: (usize, usize),
    external_ips: Vec<usize>,
    local: bool,
    affinity: bool,
    /// Endpoint address index, on this node or not, ready or terminating.
    endpoints: Vec<(usize, bool, bool)>,
}

fn spec() -> impl Strategy<Value = Option<Spec>> {
    let present = (
        0..3usize,
        prop_oneof![Just((true, false)), Just((false, true)), Just((true, true))],
        (0..3usize, 0..3usize),
        proptest::collection::vec(0..2usize, 0..3),
        any::<bool>(),
        prop::bool::weighted(0.2),
        proptest::collection::vec((0..5usize, any::<bool>(), prop::bool::weighted(0.8)), 0..5),
    )
        .prop_map(
            |(cluster_ip, ports, node_ports, external_ips, local, affinity, endpoints)| Spec {
                cluster_ip,
                ports,
                node_ports,
                external_ips,
                local,
                affinity,
                endpoints,
            },
        );
    prop_oneof![1 => Just(None), 4 => present.prop_map(Some)]
}

fn yaml(name: &str, spec: &Spec) -> String {
    let mut ports = Vec::new();
    if spec.ports.0 {
        ports.push(format!(
            "{{name: a, port: 80, protocol: TCP, targetPort: 8080, nodePort: {}}}",
            30001 + spec.node_ports.0
        ));
    }
    if spec.ports.1 {
        ports.push(format!(
            "{{name: b, port: 81, protocol: UDP, targetPort: 8081, nodePort: {}}}",
            30001 + spec.node_ports.1
        ));
    }
    let external: Vec<String> = spec
        .external_ips
        .iter()
        .flat_map(|i| {
            [
                format!("192.0.2.{}", 101 + i),
                format!("\"2001:db8::{}\"", 101 + i),
            ]
        })
        .collect();
    let endpoints = |prefix: &str| -> String {
        spec.endpoints
            .iter()
            .map(|(ip, here, ready)| {
                format!(
                    "- {{addresses: [\"{prefix}{}\"], nodeName: {}, conditions: {{ready: {ready}, serving: true, terminating: {}}}}}\n",
                    ip + 1,
                    if *here { super::tests::NODE } else { "node-z" },
                    !ready
                )
            })
            .collect()
    };
    let list = |endpoints: String| {
        if endpoints.is_empty() {
            " []".to_string()
        } else {
            format!("\n{endpoints}")
        }
    };
    format!(
        r#"
apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: default}}
spec:
  type: NodePort
  clusterIP: 10.96.0.{cip}
  clusterIPs: [10.96.0.{cip}, "fd00:96::{cip}"]
  ipFamilyPolicy: RequireDualStack
  ports: [{ports}]
  externalIPs: [{external}]
  externalTrafficPolicy: {policy}
  sessionAffinity: {affinity}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: {name}-1, namespace: default, labels: {{kubernetes.io/service-name: {name}}}}}
addressType: IPv4
ports: [{{name: a, port: 8080, protocol: TCP}}, {{name: b, port: 8081, protocol: UDP}}]
endpoints:{v4}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: {name}-2, namespace: default, labels: {{kubernetes.io/service-name: {name}}}}}
addressType: IPv6
ports: [{{name: a, port: 8080, protocol: TCP}}, {{name: b, port: 8081, protocol: UDP}}]
endpoints:{v6}
"#,
        cip = spec.cluster_ip + 1,
        ports = ports.join(", "),
        external = external.join(", "),
        policy = if spec.local { "Local" } else { "Cluster" },
        affinity = if spec.affinity { "ClientIP" } else { "None" },
        v4 = list(endpoints("10.244.0.")),
        v6 = list(endpoints("fd00:244::")),
    )
}

/// Sets Service `s<i>` (and its slice) to `spec` in the world.
fn set(w: &mut World, i: usize, spec: &Option<Spec>) {
    let name = ServiceName::new("default", &format!("s{i}"));
    let slices = [1, 2].map(|k| ServiceName::new("default", &format!("s{i}-{k}")));
    match spec {
        Some(spec) => {
            let loaded = objects::load(&yaml(&name.name, spec))
                .expect("generated objects parse")
                .cluster;
            w.cluster
                .update_service(name.clone(), loaded.services.get(&name).cloned());
            for slice in slices {
                let value = loaded.slices.get(&slice).cloned();
                assert!(value.is_some(), "{slice} generated");
                w.cluster.update_slice(slice, value);
            }
        }
        None => {
            w.cluster.update_service(name, None);
            for slice in slices {
                w.cluster.update_slice(slice, None);
            }
        }
    }
}

fn check(layout: NftablesLayout, start: Vec<Option<Spec>>, steps: Vec<(usize, Option<Spec>)>) {
    let mut w = World::new("");
    w.config.nftables_layout = layout;
    w.state.families = IpFamily::ALL.to_vec();
    for (i, s) in start.iter().enumerate() {
        set(&mut w, i, s);
    }
    w.cluster.take_changes();
    let mut d = w.desired();
    let mut a = Applier::new(FakeKernel::default());
    a.sync(&d, &w.config, None).expect("first sync");
    for state in &d.families {
        assert_eq!(
            state.services.len(),
            d.families[0].services.len(),
            "every port in both families"
        );
    }
    for (step, (i, s)) in steps.iter().enumerate() {
        set(&mut w, *i, s);
        let changes = w.cluster.take_changes();
        let touched = d.refresh_services(
            &w.cluster,
            NodeView::named(super::tests::NODE),
            &changes.services,
        );
        a.sync(&d, &w.config, Some(&touched)).expect("partial sync");
        let mut fresh = Applier::new(FakeKernel::default());
        fresh.sync(&d, &w.config, None).expect("full sync");
        assert_eq!(
            a.kernel().tables,
            fresh.kernel().tables,
            "{layout:?}, after step {step} (Service s{i} set to {s:?})"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn partial_syncs_leave_the_kernel_as_one_full_sync_of_the_same_state_in_the_flat_layout(
        start in proptest::collection::vec(spec(), 4),
        steps in proptest::collection::vec((0..4usize, spec()), 1..12),
    ) {
        check(NftablesLayout::Flat, start, steps);
    }

    #[test]
    fn partial_syncs_leave_the_kernel_as_one_full_sync_of_the_same_state_in_kube_proxys_layout(
        start in proptest::collection::vec(spec(), 4),
        steps in proptest::collection::vec((0..4usize, spec()), 1..12),
    ) {
        check(NftablesLayout::KubeProxy, start, steps);
    }
}
