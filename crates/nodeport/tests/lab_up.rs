//! `nodeport up` end to end, inside a throwaway namespace standing in for the host (it
//! programs the kernel of the namespace it runs in): kubectl creates a NodePort Service, a
//! client on the node's network reaches a pod through it, and SIGTERM stops `up` cleanly with
//! the rules left in place.

use std::net::{IpAddr, SocketAddr};
use std::process::Stdio;
use std::time::{Duration, Instant};

use nodeport_testbed::server::{Server, ServerConfig};
use nodeport_testbed::{Lan, Netns, probe, require_tools, veth};

const NODEPORT: &str = env!("CARGO_BIN_EXE_nodeport");

const OBJECTS: &str = r#"
apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: default
spec:
  type: NodePort
  selector:
    app: web
  ports:
  - port: 80
    targetPort: 80
    protocol: TCP
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-abcde
  namespace: default
  labels:
    kubernetes.io/service-name: web
addressType: IPv4
endpoints:
- addresses: ["10.244.0.2"]
  conditions: {ready: true, serving: true, terminating: false}
  nodeName: node-1
ports:
- name: ""
  port: 80
  protocol: TCP
"#;

#[test]
fn up_serves_a_nodeport_created_with_kubectl_and_stops_on_sigterm_leaving_its_rules() {
    if !require_tools(
        "up_serves_a_nodeport_created_with_kubectl",
        &["nft", "kubectl"],
    ) {
        return;
    }
    let work = tempfile::tempdir().unwrap();
    // The "host": on a LAN with a client, a default route (so `up` finds its node IP the way
    // kubelet does), and one pod on a veth.
    let lan = Lan::new("up-lan").unwrap();
    let node = Netns::new("up-node").unwrap();
    let client = Netns::new("up-client").unwrap();
    let pod = Netns::new("up-pod").unwrap();
    lan.attach(&node, "eth0", "192.0.2.10/24").unwrap();
    lan.attach(&client, "eth0", "192.0.2.100/24").unwrap();
    node.run(&["ip", "route", "add", "default", "via", "192.0.2.1"])
        .unwrap();
    veth(&node, "vethweb", &pod, "eth0").unwrap();
    pod.add_addr("eth0", "10.244.0.2/32").unwrap();
    pod.sh("ip route add 10.244.0.1 dev eth0 scope link && ip route add default via 10.244.0.1")
        .unwrap();
    node.add_addr("vethweb", "10.244.0.1/32").unwrap();
    node.run(&["ip", "route", "add", "10.244.0.2/32", "dev", "vethweb"])
        .unwrap();
    node.sysctl("net.ipv4.ip_forward", "1").unwrap();
    let _server = Server::start_in(&pod, ServerConfig::http("web-0", 80)).unwrap();

    let log_path = work.path().join("up.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut cmd = node.command(NODEPORT);
    cmd.args(["up", "--hostname-override", "node-1", "--data-dir"])
        .arg(work.path().join("data"))
        .stdout(Stdio::null())
        .stderr(log);
    let mut up = node.spawn(&mut cmd).unwrap();
    let up_log = || std::fs::read_to_string(&log_path).unwrap_or_default();

    let api: SocketAddr = "127.0.0.1:6443".parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while probe::http_get(&node, None, api, "/readyz", Duration::from_secs(1))
        .map(|a| a.status)
        .unwrap_or(0)
        != 200
    {
        assert!(up.try_wait().is_none(), "up exited:\n{}", up_log());
        assert!(Instant::now() < deadline, "API not ready:\n{}", up_log());
        std::thread::sleep(Duration::from_millis(100));
    }

    let cache = work.path().join("kube-cache");
    let kubectl = |args: &[&str], stdin: Option<&str>| {
        let mut full = vec![
            "kubectl",
            "--server",
            "http://127.0.0.1:6443",
            "--cache-dir",
            cache.to_str().unwrap(),
        ];
        full.extend(args);
        match stdin {
            Some(input) => node.run_with_stdin(&full, input.as_bytes()),
            None => node.run(&full),
        }
        .unwrap_or_else(|e| panic!("kubectl {args:?}: {e}\n{}", up_log()))
    };
    let created = kubectl(&["create", "-f", "-"], Some(OBJECTS));
    assert!(created.contains("service/web created"), "{created}");
    // `up` registered this host as a Node with the default route's address.
    let node_ip = kubectl(
        &[
            "get",
            "node",
            "node-1",
            "-o",
            "jsonpath={.status.addresses[?(@.type==\"InternalIP\")].address}",
        ],
        None,
    );
    assert_eq!(node_ip, "192.0.2.10");
    let port: u16 = kubectl(
        &[
            "get",
            "svc",
            "web",
            "-o",
            "jsonpath={.spec.ports[0].nodePort}",
        ],
        None,
    )
    .parse()
    .unwrap();

    let to = SocketAddr::new(IpAddr::from([192, 0, 2, 10]), port);
    let deadline = Instant::now() + Duration::from_secs(30);
    let answer = loop {
        match probe::http_get(&client, None, to, "/", Duration::from_secs(2)) {
            Ok(answer) => break answer,
            Err(err) => assert!(
                Instant::now() < deadline,
                "{to} never answered: {err}\n{}",
                up_log()
            ),
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(answer.pod, "web-0");
    assert!(answer.body.contains("Welcome to nginx!"));

    let status = up.terminate(Duration::from_secs(20));
    assert!(
        status.is_some_and(|s| s.success()),
        "up did not stop cleanly on SIGTERM ({status:?}):\n{}",
        up_log()
    );
    // The rules stay, as a proxy restart expects, and still carry the NodePort.
    let rules = node
        .run(&["nft", "list", "table", "ip", "kube-proxy"])
        .unwrap();
    assert!(rules.contains(&port.to_string()), "{rules}");
    assert!(
        probe::http_get(&client, None, to, "/", Duration::from_secs(2)).is_ok(),
        "traffic keeps flowing with up stopped"
    );
}

const DUAL_STACK_OBJECTS: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  type: NodePort
  ipFamilyPolicy: RequireDualStack
  selector: {app: web}
  ports: [{port: 80, targetPort: 80, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-v4, namespace: default, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
endpoints: [{addresses: ["10.244.0.2"], nodeName: node-1}]
ports: [{name: "", port: 80, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-v6, namespace: default, labels: {kubernetes.io/service-name: web}}
addressType: IPv6
endpoints: [{addresses: ["fd00:10:244::2"], nodeName: node-1}]
ports: [{name: "", port: 80, protocol: TCP}]
"#;

/// `up` with a dual-stack `--service-cluster-ip-range` and `--node-ip` given once per family:
/// the Node gets both InternalIPs, and a `RequireDualStack` NodePort answers on both.
#[test]
fn up_with_two_node_ips_serves_a_dual_stack_nodeport_on_both_families() {
    if !require_tools(
        "up_with_two_node_ips_serves_a_dual_stack_nodeport_on_both_families",
        &["nft", "kubectl"],
    ) {
        return;
    }
    let work = tempfile::tempdir().unwrap();
    let lan = Lan::new("up6-lan").unwrap();
    let node = Netns::new("up6-node").unwrap();
    let client = Netns::new("up6-client").unwrap();
    let pod = Netns::new("up6-pod").unwrap();
    lan.attach(&node, "eth0", "192.0.2.10/24").unwrap();
    node.add_addr("eth0", "fd00:192::10/64").unwrap();
    lan.attach(&client, "eth0", "192.0.2.100/24").unwrap();
    client.add_addr("eth0", "fd00:192::100/64").unwrap();
    veth(&node, "vethweb", &pod, "eth0").unwrap();
    pod.add_addr("eth0", "10.244.0.2/32").unwrap();
    pod.add_addr("eth0", "fd00:10:244::2/64").unwrap();
    pod.sh(
        "ip route add 10.244.0.1 dev eth0 scope link && ip route add default via 10.244.0.1 \
         && ip -6 route add default via fd00:10:244::1",
    )
    .unwrap();
    node.add_addr("vethweb", "10.244.0.1/32").unwrap();
    node.add_addr("vethweb", "fd00:10:244::1/64").unwrap();
    node.run(&["ip", "route", "add", "10.244.0.2/32", "dev", "vethweb"])
        .unwrap();
    node.sysctl("net.ipv4.ip_forward", "1").unwrap();
    node.sysctl("net.ipv6.conf.all.forwarding", "1").unwrap();
    let _server = Server::start_in(&pod, ServerConfig::http("web-0", 80)).unwrap();

    let log_path = work.path().join("up.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut cmd = node.command(NODEPORT);
    cmd.args([
        "up",
        "--hostname-override",
        "node-1",
        "--service-cluster-ip-range",
        "10.96.0.0/16,fd00:10:96::/108",
        "--node-ip",
        "192.0.2.10",
        "--node-ip",
        "fd00:192::10",
        "--data-dir",
    ])
    .arg(work.path().join("data"))
    .stdout(Stdio::null())
    .stderr(log);
    let mut up = node.spawn(&mut cmd).unwrap();
    let up_log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let api: SocketAddr = "127.0.0.1:6443".parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while probe::http_get(&node, None, api, "/readyz", Duration::from_secs(1))
        .map(|a| a.status)
        .unwrap_or(0)
        != 200
    {
        assert!(up.try_wait().is_none(), "up exited:\n{}", up_log());
        assert!(Instant::now() < deadline, "API not ready:\n{}", up_log());
        std::thread::sleep(Duration::from_millis(100));
    }
    let cache = work.path().join("kube-cache");
    let kubectl = |args: &[&str], stdin: Option<&str>| {
        let mut full = vec![
            "kubectl",
            "--server",
            "http://127.0.0.1:6443",
            "--cache-dir",
            cache.to_str().unwrap(),
        ];
        full.extend(args);
        match stdin {
            Some(input) => node.run_with_stdin(&full, input.as_bytes()),
            None => node.run(&full),
        }
        .unwrap_or_else(|e| panic!("kubectl {args:?}: {e}\n{}", up_log()))
    };
    kubectl(&["create", "-f", "-"], Some(DUAL_STACK_OBJECTS));
    let node_ips = kubectl(
        &[
            "get",
            "node",
            "node-1",
            "-o",
            "jsonpath={.status.addresses[?(@.type==\"InternalIP\")].address}",
        ],
        None,
    );
    assert_eq!(node_ips, "192.0.2.10 fd00:192::10");
    let families = kubectl(
        &["get", "svc", "web", "-o", "jsonpath={.spec.ipFamilies}"],
        None,
    );
    assert_eq!(families, r#"["IPv4","IPv6"]"#);
    let port: u16 = kubectl(
        &[
            "get",
            "svc",
            "web",
            "-o",
            "jsonpath={.spec.ports[0].nodePort}",
        ],
        None,
    )
    .parse()
    .unwrap();
    for ip in ["192.0.2.10", "fd00:192::10"] {
        let to = SocketAddr::new(ip.parse().unwrap(), port);
        let deadline = Instant::now() + Duration::from_secs(30);
        let answer = loop {
            match probe::http_get(&client, None, to, "/", Duration::from_secs(2)) {
                Ok(answer) => break answer,
                Err(err) => assert!(
                    Instant::now() < deadline,
                    "{to} never answered: {err}\n{}",
                    up_log()
                ),
            }
            std::thread::sleep(Duration::from_millis(200));
        };
        assert_eq!(answer.pod, "web-0", "{to}");
    }
    let status = up.terminate(Duration::from_secs(20));
    assert!(
        status.is_some_and(|s| s.success()),
        "up did not stop cleanly on SIGTERM ({status:?}):\n{}",
        up_log()
    );
}
