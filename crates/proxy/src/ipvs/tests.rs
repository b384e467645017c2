//! Golden tests of the IPVS rendering: what kube-proxy's IPVS mode would program for
//! reference 000's `web` Service and for the cases its rules tell apart.

use super::names::SetId;
use super::render::render;
use super::ruleset::IpvsRuleset;
use crate::config::NodeConfig;
use crate::desired::{self, NodeView, StateConfig};
use crate::model::{IpFamily, Protocol};
use crate::nodeaddr::NodeFacts;
use crate::objects;

/// Reference 000's `kubectl expose deployment web --port=80 --type=NodePort` with three
/// pods, on node `worker2` (192.168.224.4 in the reference; a documentation address here).
fn web(spec_extra: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Service
metadata: {{name: web, namespace: default}}
spec:
  type: NodePort
  clusterIP: 10.96.132.141
  ports: [{{port: 80, protocol: TCP, targetPort: 80, nodePort: 30510}}]
{spec_extra}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: web-x, namespace: default, labels: {{kubernetes.io/service-name: web}}}}
addressType: IPv4
ports: [{{port: 80}}]
endpoints:
- {{addresses: [10.244.1.6], nodeName: worker}}
- {{addresses: [10.244.2.7], nodeName: worker2}}
- {{addresses: [10.244.2.8], nodeName: worker2}}
"#
    )
}

fn rendered(yaml: &str, families: Vec<IpFamily>, nodeport_addresses: &str) -> IpvsRuleset {
    let loaded = objects::load(yaml).unwrap();
    let facts = NodeFacts {
        node_ips: vec!["192.0.2.4".parse().unwrap(), "2001:db8::4".parse().unwrap()],
        local_ips: vec![
            "192.0.2.4".parse().unwrap(),
            "10.244.2.1".parse().unwrap(),
            "2001:db8::4".parse().unwrap(),
        ],
        ..Default::default()
    };
    let state = StateConfig {
        families,
        nodeport_addresses: nodeport_addresses.parse().unwrap(),
    };
    let d = desired::build(&loaded.cluster, NodeView::named("worker2"), &facts, &state);
    let config = NodeConfig {
        cluster_cidrs: vec!["10.244.0.0/16".parse().unwrap()],
        ..Default::default()
    };
    render(&d, &config)
}

#[test]
fn reference_000s_web_service_renders_as_the_golden_text() {
    let text = rendered(&web(""), vec![IpFamily::V4], "0.0.0.0/0").text();
    let golden = include_str!("testdata/web-nodeport.ipvs");
    assert_eq!(text, golden, "golden mismatch; got:\n{text}");
}

#[test]
fn nodeports_get_one_round_robin_masq_virtual_server_per_nodeport_address() {
    let r = rendered(&web(""), vec![IpFamily::V4], "192.0.2.0/24,10.244.0.0/16");
    let text = r.text();
    for line in [
        "-A -t 192.0.2.4:30510 -s rr",
        "-A -t 10.244.2.1:30510 -s rr",
        "-a -t 192.0.2.4:30510 -r 10.244.1.6:80 -m -w 1",
        "-a -t 10.244.2.1:30510 -r 10.244.2.8:80 -m -w 1",
        "-A -t 10.96.132.141:80 -s rr",
        "create KUBE-NODE-PORT-TCP bitmap:port range 0-65535",
        "add KUBE-NODE-PORT-TCP 30510",
        "create KUBE-CLUSTER-IP hash:ip,port family inet hashsize 1024 maxelem 65536",
        "add KUBE-CLUSTER-IP 10.96.132.141,tcp:80",
        // Reference 000's companion rules.
        "-A KUBE-SERVICES -m comment --comment \"Kubernetes service cluster ip + port for masquerade purpose\" -m set --match-set KUBE-CLUSTER-IP dst,dst ! -s 10.244.0.0/16 -j KUBE-MARK-MASQ",
        "-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODE-PORT",
        "-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT",
        "-A KUBE-NODE-PORT -p tcp -m comment --comment \"Kubernetes nodeport TCP port for masquerade purpose\" -m set --match-set KUBE-NODE-PORT-TCP dst -j KUBE-MARK-MASQ",
    ] {
        assert!(text.contains(line), "missing {line:?} in:\n{text}");
    }
    let v4 = r.family(IpFamily::V4).unwrap();
    assert_eq!(
        v4.virtual_servers
            .iter()
            .filter(|v| v.address.port() == 30510)
            .count(),
        2
    );
}

#[test]
fn hairpin_entries_cover_the_local_endpoints_only() {
    let r = rendered(&web(""), vec![IpFamily::V4], "0.0.0.0/0");
    let lb = &r.family(IpFamily::V4).unwrap().set(SetId::LoopBack).entries;
    assert_eq!(
        lb.iter().map(String::as_str).collect::<Vec<_>>(),
        [
            "10.244.2.7,tcp:80,10.244.2.7",
            "10.244.2.8,tcp:80,10.244.2.8"
        ]
    );
}

#[test]
fn etp_local_nodeports_use_local_endpoints_and_return_before_masquerading() {
    let r = rendered(
        &web("  externalTrafficPolicy: Local"),
        vec![IpFamily::V4],
        "0.0.0.0/0",
    );
    let v4 = r.family(IpFamily::V4).unwrap();
    let vs = v4
        .virtual_server(Protocol::Tcp, "192.0.2.4:30510".parse().unwrap())
        .unwrap();
    assert_eq!(
        vs.reals,
        [
            "10.244.2.7:80".parse().unwrap(),
            "10.244.2.8:80".parse().unwrap()
        ]
    );
    // The ClusterIP keeps every endpoint.
    let cip = v4
        .virtual_server(Protocol::Tcp, "10.96.132.141:80".parse().unwrap())
        .unwrap();
    assert_eq!(cip.reals.len(), 3);
    let text = r.text();
    let ret = text
        .find("--match-set KUBE-NODE-PORT-LOCAL-TCP dst -j RETURN")
        .expect(&text);
    let masq = text
        .find("--match-set KUBE-NODE-PORT-TCP dst -j KUBE-MARK-MASQ")
        .expect(&text);
    assert!(ret < masq, "the Local set must be checked first:\n{text}");
}

#[test]
fn session_affinity_is_ipvs_persistence_and_udp_uses_its_own_sets() {
    let yaml = web("  sessionAffinity: ClientIP")
        .replace(
            "ports: [{port: 80, protocol: TCP, targetPort: 80, nodePort: 30510}]",
            "ports: [{name: dns, port: 53, protocol: UDP, nodePort: 30053}]",
        )
        .replace(
            "ports: [{port: 80}]",
            "ports: [{name: dns, port: 53, protocol: UDP}]",
        );
    let text = rendered(&yaml, vec![IpFamily::V4], "0.0.0.0/0").text();
    assert!(
        text.contains("-A -u 10.96.132.141:53 -s rr -p 10800"),
        "{text}"
    );
    assert!(text.contains("add KUBE-NODE-PORT-UDP 30053"), "{text}");
    assert!(
        text.contains("-A KUBE-NODE-PORT -p udp -m comment --comment \"Kubernetes nodeport UDP port for masquerade purpose\" -m set --match-set KUBE-NODE-PORT-UDP dst -j KUBE-MARK-MASQ"),
        "{text}"
    );
}

#[test]
fn load_balancer_source_ranges_fill_the_firewall_sets() {
    let yaml = web(
        "  loadBalancerSourceRanges: [203.0.113.0/25, 192.0.2.0/24]\nstatus: {loadBalancer: {ingress: [{ip: 198.51.100.200}]}}",
    )
    .replace("type: NodePort", "type: LoadBalancer");
    let text = rendered(&yaml, vec![IpFamily::V4], "0.0.0.0/0").text();
    for line in [
        "add KUBE-LOAD-BALANCER 198.51.100.200,tcp:80",
        "add KUBE-LOAD-BALANCER-FW 198.51.100.200,tcp:80",
        "add KUBE-LOAD-BALANCER-SOURCE-CIDR 198.51.100.200,tcp:80,203.0.113.0/25",
        // The node IP is inside a range: the VIP may be the source (hairpin from the node).
        "add KUBE-LOAD-BALANCER-SOURCE-IP 198.51.100.200,tcp:80,198.51.100.200",
        "-A KUBE-PROXY-FIREWALL -m comment --comment \"Kubernetes service load balancer ip + port for load balancer with sourceRange\" -m set --match-set KUBE-LOAD-BALANCER-FW dst,dst -j KUBE-SOURCE-RANGES-FIREWALL",
        "-A KUBE-SOURCE-RANGES-FIREWALL -j DROP",
        "-A -t 198.51.100.200:80 -s rr",
    ] {
        assert!(text.contains(line), "missing {line:?} in:\n{text}");
    }
}

#[test]
fn ipv6_renders_kube_6_sets_and_bracketed_virtual_servers() {
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
    let r = rendered(yaml, IpFamily::ALL.to_vec(), "0.0.0.0/0,::/0");
    let text = r.family(IpFamily::V6).unwrap().text();
    for line in [
        "-A -t [fd00:96::10]:80 -s rr",
        "-a -t [2001:db8::4]:30081 -r [fd00:244::1]:80 -m -w 1",
        "create KUBE-6-CLUSTER-IP hash:ip,port family inet6 hashsize 1024 maxelem 65536",
        "add KUBE-6-CLUSTER-IP fd00:96::10,tcp:80",
        "-m set --match-set KUBE-6-NODE-PORT-TCP dst -j KUBE-MARK-MASQ",
        "# ip6tables-restore --noflush",
    ] {
        assert!(text.contains(line), "missing {line:?} in:\n{text}");
    }
    assert!(r.family(IpFamily::V4).unwrap().virtual_servers.is_empty());
}
