//! Shared topology of the `proxy_*` end-to-end tests: a client and a second client on a LAN
//! with the node, a second LAN reaching the node's second address, three pod namespaces
//! routed through the node, our API server and `nodeport proxy` running inside the node's
//! namespace, objects created with the real kubectl.
//!
//! ```text
//!  client 192.0.2.100 ─┐ lan1                      ┌─ pod1 10.244.1.2 (nodeName node-a)
//!  client2 192.0.2.101 ┼──── eth0 192.0.2.10  node ─┼─ pod2 10.244.2.2 (nodeName node-b)
//!  client 198.51.100.100 ─── eth1 198.51.100.10     └─ pod3 10.244.3.2 (nodeName node-c)
//!                      lan2      apiserver 127.0.0.1:6443, proxy (healthz 127.0.0.1:10256)
//! ```
//!
//! The proxy runs in the [`Mode`] a test asks for.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use nodeport_testbed::server::{Server, ServerConfig};
use nodeport_testbed::{ChildGuard, Lan, Netns, veth};

/// The node's address on lan1 (its Node object's InternalIP).
pub const NODE_IP: &str = "192.0.2.10";
/// The node's address on lan2.
pub const NODE_IP2: &str = "198.51.100.10";
/// The client's address on lan1.
pub const CLIENT_IP: &str = "192.0.2.100";
/// The second client's address.
pub const CLIENT2_IP: &str = "192.0.2.101";
const API: &str = "http://127.0.0.1:6443";
/// The node's IPv6 address on lan1, in a dual-stack cluster (its second InternalIP).
pub const NODE_IP6: &str = "fd00:192:0:2::10";
/// The client's IPv6 address on lan1, in a dual-stack cluster.
pub const CLIENT_IP6: &str = "fd00:192:0:2::100";
/// `--service-cluster-ip-range` of a dual-stack cluster, IPv4 primary.
pub const DUAL_STACK_SERVICE_RANGES: &str = "10.96.0.0/16,fd00:10:96::/108";

/// The families of the cluster a test builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stack {
    /// IPv4 only: the API server's default range, IPv4 addresses everywhere.
    Single,
    /// Dual-stack: the API server with [`DUAL_STACK_SERVICE_RANGES`]; the node, the client
    /// (lan1) and the pods also get IPv6 addresses (`fd00:10:244:<i>::2` for pod i, routed
    /// through the node), and the Node object lists both InternalIPs.
    Dual,
}

/// The proxy mode a test runs in (`--proxy-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `table ip kube-proxy`, in the default (flat) layout.
    Nftables,
    /// `table ip kube-proxy` in kube-proxy's layout (`--nftables-layout kube-proxy`).
    NftablesKubeProxy,
    /// `KUBE-*` chains in iptables' nat and filter tables.
    Iptables,
    /// tc and cgroup socket programs with BPF maps, pinned in a bpffs of the test's own,
    /// the socket programs on a cgroup of the test's own ([`EbpfNode`]).
    Ebpf,
}

impl Mode {
    /// The flag value.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Nftables | Mode::NftablesKubeProxy => "nftables",
            Mode::Iptables => "iptables",
            Mode::Ebpf => "ebpf",
        }
    }

    /// Flags the mode adds to `--proxy-mode`.
    pub fn extra_args(self) -> &'static [&'static str] {
        match self {
            Mode::NftablesKubeProxy => &["--nftables-layout", "kube-proxy"],
            Mode::Nftables | Mode::Iptables | Mode::Ebpf => &[],
        }
    }

    /// The commands the mode needs on the machine.
    pub fn tools(self) -> &'static [&'static str] {
        match self {
            Mode::Nftables | Mode::NftablesKubeProxy => &["nft"],
            Mode::Iptables => &["iptables", "iptables-restore", "iptables-save"],
            Mode::Ebpf => &["bpftool"],
        }
    }
}

/// One node with everything around it; all namespaces and processes go away on drop.
pub struct Cluster {
    pub client: Netns,
    pub client2: Netns,
    pub node: Netns,
    pub pods: Vec<Netns>,
    servers: Vec<Server>,
    apiserver: Option<ChildGuard>,
    pub proxy: Option<ChildGuard>,
    mode: Mode,
    proxy_args: Vec<String>,
    /// eBPF mode: the node's cgroup and pin root (dropped after the proxy and namespaces).
    pub ebpf: Option<EbpfNode>,
    _lans: (Lan, Lan),
    _data: tempfile::TempDir,
}

fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("timed out after {timeout:?} waiting until {what}");
}

impl Cluster {
    /// Builds the topology, starts the API server, registers Node `node-a` and starts the
    /// proxy in `mode` with `proxy_args` added to the defaults.
    pub fn start(mode: Mode, proxy_args: &[&str]) -> Cluster {
        Self::start_with(mode, proxy_args, Stack::Single)
    }

    /// [`Cluster::start`] for a cluster of one or both families.
    pub fn start_with(mode: Mode, proxy_args: &[&str], stack: Stack) -> Cluster {
        let lan1 = Lan::new("lan1").unwrap();
        let lan2 = Lan::new("lan2").unwrap();
        let node = Netns::new("node").unwrap();
        let client = Netns::new("client").unwrap();
        let client2 = Netns::new("client2").unwrap();
        lan1.attach(&node, "eth0", &format!("{NODE_IP}/24"))
            .unwrap();
        lan2.attach(&node, "eth1", &format!("{NODE_IP2}/24"))
            .unwrap();
        lan1.attach(&client, "eth0", &format!("{CLIENT_IP}/24"))
            .unwrap();
        lan2.attach(&client, "eth1", "198.51.100.100/24").unwrap();
        lan1.attach(&client2, "eth0", &format!("{CLIENT2_IP}/24"))
            .unwrap();
        node.sysctl("net.ipv4.ip_forward", "1").unwrap();
        for c in [&client, &client2] {
            // The load-balancer VIP of the source-range test is routed to the node.
            c.run(&["ip", "route", "add", "192.0.2.200/32", "via", NODE_IP])
                .unwrap();
        }
        let mut pods = Vec::new();
        let mut servers = Vec::new();
        for i in 1..=3 {
            let pod = Netns::new(&format!("pod{i}")).unwrap();
            veth(&node, &format!("vpod{i}"), &pod, "eth0").unwrap();
            node.add_addr(&format!("vpod{i}"), &format!("10.244.{i}.1/24"))
                .unwrap();
            pod.add_addr("eth0", &format!("10.244.{i}.2/24")).unwrap();
            pod.run(&[
                "ip",
                "route",
                "add",
                "default",
                "via",
                &format!("10.244.{i}.1"),
            ])
            .unwrap();
            if stack == Stack::Dual {
                node.add_addr(&format!("vpod{i}"), &format!("fd00:10:244:{i}::1/64"))
                    .unwrap();
                pod.add_addr("eth0", &format!("fd00:10:244:{i}::2/64"))
                    .unwrap();
                pod.run(&[
                    "ip",
                    "-6",
                    "route",
                    "add",
                    "default",
                    "via",
                    &format!("fd00:10:244:{i}::1"),
                ])
                .unwrap();
            }
            servers.push(
                Server::start_in(
                    &pod,
                    ServerConfig::http(&format!("pod{i}"), 8080).with_udp(5353),
                )
                .unwrap(),
            );
            pods.push(pod);
        }
        let mut node_ips = format!("{{type: InternalIP, address: {NODE_IP}}}");
        let mut apiserver_args = Vec::new();
        if stack == Stack::Dual {
            node.add_addr("eth0", &format!("{NODE_IP6}/64")).unwrap();
            client
                .add_addr("eth0", &format!("{CLIENT_IP6}/64"))
                .unwrap();
            node.sysctl("net.ipv6.conf.all.forwarding", "1").unwrap();
            node_ips.push_str(&format!(", {{type: InternalIP, address: \"{NODE_IP6}\"}}"));
            apiserver_args = vec!["--service-cluster-ip-range", DUAL_STACK_SERVICE_RANGES];
        }
        let data = tempfile::tempdir().unwrap();
        let apiserver = node
            .spawn(
                node.command(env!("CARGO_BIN_EXE_nodeport"))
                    .args(["apiserver", "--port", "6443", "--data-dir"])
                    .arg(data.path().join("store"))
                    .args(&apiserver_args)
                    .env("NODEPORT_LOG", "warn"),
            )
            .unwrap();
        let mut cluster = Cluster {
            client,
            client2,
            node,
            pods,
            servers,
            apiserver: Some(apiserver),
            proxy: None,
            mode,
            proxy_args: proxy_args.iter().map(|s| s.to_string()).collect(),
            ebpf: (mode == Mode::Ebpf).then(|| EbpfNode::new(data.path())),
            _lans: (lan1, lan2),
            _data: data,
        };
        wait_until("the API server is ready", Duration::from_secs(20), || {
            cluster.kubectl(&["get", "--raw", "/readyz"]).is_ok()
        });
        cluster
            .apply(&format!(
                "apiVersion: v1\nkind: Node\nmetadata: {{name: node-a}}\nstatus: {{addresses: [{node_ips}]}}\n"
            ))
            .unwrap();
        cluster.start_proxy();
        cluster
    }

    /// Stops the proxy and starts it again with `proxy_args` instead of the ones it had.
    pub fn restart_proxy_with(&mut self, proxy_args: &[&str]) {
        if let Some(mut proxy) = self.proxy.take() {
            proxy.kill();
        }
        self.proxy_args = proxy_args.iter().map(|s| s.to_string()).collect();
        self.start_proxy();
    }

    /// Starts (or restarts) the proxy and waits until it reports healthy.
    pub fn start_proxy(&mut self) {
        let mut cmd = self.node.command(env!("CARGO_BIN_EXE_nodeport"));
        cmd.args([
            "proxy",
            "--master",
            API,
            "--hostname-override",
            "node-a",
            "--cluster-cidr",
            "10.244.0.0/16",
            "--healthz-bind-address",
            "127.0.0.1:10256",
            "--metrics-bind-address",
            "127.0.0.1:10249",
            "--proxy-mode",
            self.mode.as_str(),
        ])
        .args(self.mode.extra_args())
        .args(&self.proxy_args)
        .args(self.ebpf.iter().flat_map(EbpfNode::proxy_args))
        .env(
            "NODEPORT_LOG",
            std::env::var("NODEPORT_TEST_PROXY_LOG").unwrap_or_else(|_| "warn".into()),
        );
        self.proxy = Some(self.node.spawn(&mut cmd).unwrap());
        wait_until("the proxy is healthy", Duration::from_secs(20), || {
            self.node_http("127.0.0.1:10256", "/healthz")
                .is_some_and(|(code, _)| code == 200)
        });
    }

    /// `GET /` from a process in `ns` as one of the node's pods or processes would send it.
    /// In eBPF mode that process (curl) runs in the node's cgroup: the socket programs serve
    /// the processes of `--ebpf-cgroup-root`, whose production default, the cgroup2 root,
    /// holds every pod and process of the node (Cilium's socket LB under its
    /// `--cgroup-root`). The other modes need no cgroup: [`get`].
    pub fn get_in_node_cgroup(&self, ns: &Netns, to: &str, timeout: Duration) -> Reply {
        let Some(ebpf) = &self.ebpf else {
            return get(ns, to, timeout);
        };
        let procs = ebpf.cgroup.join("cgroup.procs");
        let secs = format!("{:.1}", timeout.as_secs_f64());
        let out = ns
            .command("sh")
            .args([
                "-c",
                "echo $$ > \"$0\" && exec curl -s -i --max-time \"$1\" \"http://$2/\"",
            ])
            .arg(&procs)
            .args([&secs, to])
            .output()
            .expect("running curl");
        match out.status.code() {
            Some(0) => {
                match nodeport_testbed::probe::parse_answer(&String::from_utf8_lossy(&out.stdout)) {
                    Some(a) => Reply::Pod {
                        pod: a.pod,
                        client: a.client,
                    },
                    None => Reply::Other(String::from_utf8_lossy(&out.stdout).into_owned()),
                }
            }
            // curl: 7 could not connect (refused), 28 timed out.
            Some(7) => Reply::Refused,
            Some(28) => Reply::Timeout,
            _ => Reply::Other(format!(
                "curl in the node's cgroup: {} {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )),
        }
    }

    /// [`eventually`] with [`Cluster::get_in_node_cgroup`].
    pub fn eventually_in_node_cgroup(
        &self,
        ns: &Netns,
        to: &str,
        what: &str,
        mut want: impl FnMut(&Reply) -> bool,
    ) -> Reply {
        let deadline = Instant::now() + Duration::from_secs(15);
        let mut last = Reply::Other("never tried".into());
        while Instant::now() < deadline {
            last = self.get_in_node_cgroup(ns, to, Duration::from_millis(700));
            if want(&last) {
                return last;
            }
            std::thread::sleep(Duration::from_millis(150));
        }
        panic!("{what}: last reply {last:?}");
    }

    /// Deletes, by hand, the rule that sends service traffic to the services' chains (what
    /// an operator's mistake or another tool might do): `nft flush chain ip kube-proxy
    /// services`, or `iptables -t nat -F KUBE-SERVICES`.
    pub fn break_service_dispatch_by_hand(&self) {
        let cmd: &[&str] = match self.mode {
            Mode::Nftables | Mode::NftablesKubeProxy => {
                &["nft", "flush", "chain", "ip", "kube-proxy", "services"]
            }
            Mode::Iptables => &["iptables", "-t", "nat", "-F", "KUBE-SERVICES"],
            Mode::Ebpf => {
                // Every frontend deleted from the pinned map.
                let map = self.ebpf.as_ref().expect("eBPF mode").services_map();
                let dump = self
                    .node
                    .run(&["bpftool", "-j", "map", "dump", "pinned", &map])
                    .unwrap();
                let entries: Vec<serde_json::Value> = serde_json::from_str(&dump).unwrap();
                for e in entries {
                    let key: Vec<String> = e["key"]
                        .as_array()
                        .expect("bpftool's key bytes")
                        .iter()
                        .map(|b| b.as_str().expect("a hex byte").to_string())
                        .collect();
                    let mut args = vec!["bpftool", "map", "delete", "pinned", &map, "key", "hex"];
                    args.extend(key.iter().map(String::as_str));
                    self.node.run(&args).unwrap();
                }
                return;
            }
        };
        self.node.run(cmd).unwrap();
    }

    /// kubectl against our API server, from inside the node namespace.
    pub fn kubectl(&self, args: &[&str]) -> Result<String, String> {
        let mut full = vec!["kubectl", "--server", API];
        full.extend_from_slice(args);
        self.node.run(&full).map_err(|e| e.to_string())
    }

    /// `kubectl apply -f -`.
    pub fn apply(&self, yaml: &str) -> Result<String, String> {
        self.node
            .run_with_stdin(
                &["kubectl", "--server", API, "apply", "-f", "-"],
                yaml.as_bytes(),
            )
            .map_err(|e| e.to_string())
    }

    /// An HTTP GET inside the node namespace (health, metrics); (status, body).
    pub fn node_http(&self, addr: &str, path: &str) -> Option<(u16, String)> {
        let out = self
            .node
            .run(&[
                "curl",
                "-s",
                "-m",
                "2",
                "-o",
                "-",
                "-w",
                "\n%{http_code}",
                &format!("http://{addr}{path}"),
            ])
            .ok()?;
        let (body, code) = out.rsplit_once('\n')?;
        Some((code.trim().parse().ok()?, body.to_string()))
    }

    /// The ClusterIP of a Service.
    pub fn cluster_ip(&self, name: &str) -> String {
        self.kubectl(&["get", "svc", name, "-o", "jsonpath={.spec.clusterIP}"])
            .unwrap()
    }
}

/// What a request from a client namespace came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// Answered by this pod, which saw this client address.
    Pod { pod: String, client: String },
    /// Connection refused (a reject, or nothing listening).
    Refused,
    /// No answer in time (a drop).
    Timeout,
    /// Anything else.
    Other(String),
}

/// `GET /` from `ns` to `to`, classified.
pub fn get(ns: &Netns, to: &str, timeout: Duration) -> Reply {
    let to: SocketAddr = to.parse().unwrap();
    match nodeport_testbed::probe::http_get(ns, None, to, "/", timeout) {
        Ok(a) => Reply::Pod {
            pod: a.pod,
            client: a.client,
        },
        Err(nodeport_testbed::Error::Io { source, what }) => match source.kind() {
            std::io::ErrorKind::ConnectionRefused => Reply::Refused,
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => Reply::Timeout,
            _ => Reply::Other(format!("{what}: {source}")),
        },
        Err(e) => Reply::Other(e.to_string()),
    }
}

/// Polls `get` until `want` holds (the proxy syncs at most once a second).
pub fn eventually(ns: &Netns, to: &str, what: &str, mut want: impl FnMut(&Reply) -> bool) -> Reply {
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut last = Reply::Other("never tried".into());
    while Instant::now() < deadline {
        last = get(ns, to, Duration::from_millis(700));
        if want(&last) {
            return last;
        }
        std::thread::sleep(Duration::from_millis(150));
    }
    panic!("{what}: last reply {last:?}");
}

/// A NodePort Service plus its EndpointSlice; `endpoints` are pod numbers (1-3) with their
/// node names (pod1 on node-a, this node; pod2 on node-b; pod3 on node-c).
pub fn service_yaml(name: &str, node_port: u16, spec_extra: &str, endpoints: &[u8]) -> String {
    let eps: Vec<String> = endpoints
        .iter()
        .map(|i| {
            let node = ["node-a", "node-b", "node-c"][usize::from(*i) - 1];
            format!("- {{addresses: [10.244.{i}.2], nodeName: {node}}}")
        })
        .collect();
    let eps = if eps.is_empty() {
        "  []".to_string()
    } else {
        eps.join("\n")
    };
    // The UDP port's NodePort is the TCP one + 100 (kube-apiserver allows one number for
    // both protocols; ours does not yet, which does not matter here).
    let udp_node_port = node_port + 100;
    format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: default}}
spec:
  type: NodePort
  selector: {{app: {name}}}
  ports:
  - {{name: http, port: 80, targetPort: 8080, nodePort: {node_port}}}
  - {{name: dns, port: 53, targetPort: 5353, protocol: UDP, nodePort: {udp_node_port}}}
{spec_extra}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: {name}-1, namespace: default, labels: {{kubernetes.io/service-name: {name}}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}, {{name: dns, port: 5353, protocol: UDP}}]
endpoints:
{eps}
"#
    )
}

/// A dual-stack (`RequireDualStack`) NodePort Service on TCP port 80 with one EndpointSlice
/// per family; `endpoints` are pod numbers (1-3) as in [`service_yaml`].
pub fn dual_stack_service_yaml(name: &str, node_port: u16, endpoints: &[u8]) -> String {
    let slice = |family: &str, suffix: u8, address: &dyn Fn(u8) -> String| {
        let eps: Vec<String> = endpoints
            .iter()
            .map(|i| {
                let node = ["node-a", "node-b", "node-c"][usize::from(*i) - 1];
                format!("- {{addresses: [\"{}\"], nodeName: {node}}}", address(*i))
            })
            .collect();
        let eps = if eps.is_empty() {
            "  []".to_string()
        } else {
            eps.join("\n")
        };
        format!(
            r#"---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: {name}-{suffix}, namespace: default, labels: {{kubernetes.io/service-name: {name}}}}}
addressType: {family}
ports: [{{name: http, port: 8080}}]
endpoints:
{eps}
"#
        )
    };
    format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: default}}
spec:
  type: NodePort
  ipFamilyPolicy: RequireDualStack
  selector: {{app: {name}}}
  ports:
  - {{name: http, port: 80, targetPort: 8080, nodePort: {node_port}}}
{}{}"#,
        slice("IPv4", 1, &|i| format!("10.244.{i}.2")),
        slice("IPv6", 2, &|i| format!("fd00:10:244:{i}::2")),
    )
}

/// eBPF mode: the node's own cgroup and its own bpffs pin root, both reachable from inside
/// `ip netns exec` (which remounts /sys, hiding /sys/fs/cgroup): the cgroup2 hierarchy is
/// mounted a second time on the test's temporary directory, and the node's cgroup created
/// in it; the bpffs is mounted there too, in the test's mount namespace (private mounts of
/// `ip netns exec` die with it). On drop: pins removed, cgroup removed, both unmounted.
pub struct EbpfNode {
    /// The cgroup2 hierarchy, mounted again on the test's directory.
    hierarchy: std::path::PathBuf,
    /// The cgroup directory.
    pub cgroup: std::path::PathBuf,
    /// The pin root.
    pub pin_root: std::path::PathBuf,
}

impl EbpfNode {
    fn new(data: &std::path::Path) -> Self {
        let hierarchy = data.join("cgroup2");
        std::fs::create_dir(&hierarchy).unwrap();
        nix::mount::mount(
            Some("cgroup2"),
            &hierarchy,
            Some("cgroup2"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
        .expect("eBPF mode needs cgroup v2: mounting the cgroup2 hierarchy");
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let cgroup = hierarchy.join(format!("nodeport-e2e-{}-{n}", std::process::id()));
        std::fs::create_dir(&cgroup).expect("creating the node's cgroup");
        let pin_root = data.join("bpf");
        nodeport_proxy::ebpf::programs::ensure_bpffs(&pin_root).expect("mounting bpffs");
        EbpfNode {
            hierarchy,
            cgroup,
            pin_root,
        }
    }

    fn proxy_args(&self) -> [String; 4] {
        [
            "--ebpf-pin-root".into(),
            self.pin_root.display().to_string(),
            "--ebpf-cgroup-root".into(),
            self.cgroup.display().to_string(),
        ]
    }

    /// The pinned frontends map.
    pub fn services_map(&self) -> String {
        self.pin_root
            .join("maps")
            .join("np_services")
            .display()
            .to_string()
    }
}

impl Drop for EbpfNode {
    fn drop(&mut self) {
        let _ = nodeport_proxy::ebpf::programs::remove_pins(&self.pin_root);
        let _ = nix::mount::umount2(&self.pin_root, nix::mount::MntFlags::MNT_DETACH);
        let _ = std::fs::remove_dir(&self.cgroup);
        let _ = nix::mount::umount2(&self.hierarchy, nix::mount::MntFlags::MNT_DETACH);
    }
}
