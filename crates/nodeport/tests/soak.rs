//! The churn soak (issue 20, part 2): three nodes in network namespaces, each with a real
//! `nodeport proxy` of another mode (nftables in the flat layout, iptables, ebpf), two real
//! `nodeport apiserver`s on one real etcd, six pod servers, and a driver that creates, updates
//! and deletes Services and EndpointSlices at random at a steady rate. Every 10 s the driver
//! stops, waits until every proxy reports (`nodeport_sync_proxy_rules_resource_version`) that
//! it has synced the latest write, at most 5 s, and checks:
//!
//! - each node's kernel: `nodeport trace --rules kernel --service` for a sample of Services on
//!   every node, which traces each address and port the node serves the Service on through
//!   the rules the kernel holds and, for every packet, through what the proxy would render
//!   for the objects at that revision; a different fate is a mismatch (the trace's own note
//!   "the kernel differs from what the proxy would program"), as is a rule the tracer could
//!   not evaluate or a trace that fails;
//! - the allocation bitmaps in etcd against the stored Services (`verify_dump`, the API
//!   server's own verification, on an independent read of etcd);
//! - real connections from a client outside the cluster to the NodePort of a sample of
//!   Services on every node, wherever the Service has a ready endpoint for that node
//!   (`externalTrafficPolicy: Local`: on that node): the answer must come from a ready
//!   endpoint;
//! - the RSS of each proxy and API server, sampled for the report (growth after the first five
//!   minutes reported on runs past five minutes; over 10 % fails a run longer than ten).
//!
//! The CI run lasts 60 s. `scripts/soak.sh --duration 30m` runs the same test longer
//! (`NODEPORT_SOAK_SECS`) and writes its figures and RSS samples to `NODEPORT_SOAK_REPORT`;
//! `NODEPORT_SOAK_RATE` (driver steps a second, 10), `NODEPORT_SOAK_SEED` and
//! `NODEPORT_SOAK_COMPACTION` (the API servers' `--etcd-compaction-interval`) vary it.
//!
//! ```text
//!                          lan 192.0.2.0/24, fd00:192:0:2::/64
//!   node1 .11 (nftables)      node2 .12 (iptables)       node3 .13 (ebpf)       client .100
//!   etcd, apiserver A         apiserver B                relay 127.0.0.1:6443
//!   proxy -> A                proxy -> B                 proxy -> relay -> B
//!   pods 10.244.1.2, .3       pods 10.244.2.2, .3        pods 10.244.3.2, .3
//! ```
//!
//! The API servers serve plain HTTP on their node's loopback (TLS and tokens are needed
//! beyond it), so node3's proxy reaches apiserver B through a TCP relay the test runs: a
//! listener on node3's loopback whose connections are opened again inside node2, as a load
//! balancer in front of the API servers would.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nodeport_apiserver::registry::{service::ServiceRanges, verify_dump};
use nodeport_apiserver::storage::etcd::{Config as EtcdConfig, EtcdBackend};
use nodeport_testbed::server::{Server, ServerConfig};
use nodeport_testbed::{ChildGuard, Lan, Netns, probe, require_tools, veth};
use serde_json::{Value, json};

/// The API servers' port on their node's loopback (and the relay's on node3).
const API_PORT: u16 = 6443;
/// The proxies' metrics address (inside each node).
const METRICS: u16 = 10249;
/// The proxies' health address (inside each node).
const HEALTHZ: u16 = 10256;
const CLIENT_IP: &str = "192.0.2.100";
const SERVICE_RANGES: &str = "10.96.0.0/16,fd00:10:96::/108";
/// Pods per node.
const PODS_PER_NODE: usize = 2;
/// The pods' HTTP port (every Service's `http` port targets it).
const POD_PORT: u16 = 8080;
/// How long the driver changes objects between two checkpoints.
const CHURN: Duration = Duration::from_secs(10);
/// How long the proxies get to report the latest revision synced.
const SYNC_DEADLINE: Duration = Duration::from_secs(5);
/// Services the driver keeps between (besides the barrier).
const MIN_SERVICES: usize = 4;
const MAX_SERVICES: usize = 16;
/// Services whose kernel trace is compared per checkpoint (on every node).
const TRACE_SAMPLE: usize = 3;
/// Services whose NodePort is connected to per checkpoint (on every node).
const CONNECT_SAMPLE: usize = 4;
/// The Service and EndpointSlice the driver writes last before each checkpoint: their
/// revisions are the latest of their kinds.
const BARRIER: &str = "soak-barrier";

/// A small deterministic generator (splitmix64), seeded from `NODEPORT_SOAK_SEED` or the clock
/// and printed, so that a failing run can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }
}

// ---------------------------------------------------------------------------------------------
// HTTP inside a namespace

/// One HTTP/1.1 request to `addr` from a socket opened inside `ns`; (status, body).
fn http_in(
    ns: &Netns,
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> Result<(u16, String), String> {
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nAccept: application/json\r\n"
    );
    if let Some(b) = body {
        let _ = write!(
            request,
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        );
    }
    request.push_str("\r\n");
    request.push_str(body.unwrap_or_default());
    let raw = ns
        .enter(move || -> std::io::Result<Vec<u8>> {
            let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
            s.set_read_timeout(Some(Duration::from_secs(30)))?;
            s.write_all(request.as_bytes())?;
            let mut raw = Vec::new();
            s.read_to_end(&mut raw)?;
            Ok(raw)
        })
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("{method} {path} to {addr}: {e}"))?;
    let text = String::from_utf8_lossy(&raw);
    let (head, rest) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("{method} {path}: no HTTP header in {text:?}"))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("{method} {path}: no status in {head:?}"))?;
    let chunked = head
        .lines()
        .any(|l| l.eq_ignore_ascii_case("transfer-encoding: chunked"));
    Ok((
        status,
        if chunked {
            dechunk(rest)
        } else {
            rest.to_owned()
        },
    ))
}

fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || tail.len() < n {
            break;
        }
        out.push_str(&tail[..n]);
        rest = tail[n..].trim_start_matches("\r\n");
    }
    out
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

// ---------------------------------------------------------------------------------------------
// The topology

/// eBPF node: its own cgroup and bpffs pin root, as `proxy_support::EbpfNode` makes them
/// (the cgroup2 hierarchy mounted again on the test's directory, since `ip netns exec`
/// remounts /sys); removed on drop.
struct EbpfNode {
    hierarchy: PathBuf,
    cgroup: PathBuf,
    pin_root: PathBuf,
}

impl EbpfNode {
    fn new(data: &Path) -> Self {
        let hierarchy = data.join("cgroup2");
        std::fs::create_dir(&hierarchy).unwrap();
        nix::mount::mount(
            Some("cgroup2"),
            &hierarchy,
            Some("cgroup2"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
        .expect("the ebpf mode needs cgroup v2: mounting the cgroup2 hierarchy");
        let cgroup = hierarchy.join(format!("nodeport-soak-{}", std::process::id()));
        std::fs::create_dir(&cgroup).expect("creating the node's cgroup");
        let pin_root = data.join("bpf");
        nodeport_proxy::ebpf::programs::ensure_bpffs(&pin_root).expect("mounting bpffs");
        EbpfNode {
            hierarchy,
            cgroup,
            pin_root,
        }
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

/// A TCP relay: a listener on `127.0.0.1:port` in one namespace whose connections are opened
/// again to `127.0.0.1:port` in another. Stops accepting on drop; open connections end with
/// their peers.
struct Relay {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Relay {
    fn start(from: &Netns, to: &Netns, port: u16) -> Relay {
        let listener = from
            .enter(|| TcpListener::bind(loopback(port)))
            .unwrap()
            .expect("the relay's listener");
        listener.set_nonblocking(true).unwrap();
        let target = std::fs::File::open(Path::new("/run/netns").join(to.name()))
            .expect("the relay's target namespace");
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let thread = std::thread::spawn(move || {
            // This thread connects from inside the target namespace; the listener stays in
            // the namespace it was bound in.
            nix::sched::setns(target.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                .expect("entering the relay's target namespace");
            while !stopping.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((inbound, _)) => {
                        let _ = inbound.set_nonblocking(false);
                        let Ok(outbound) = TcpStream::connect(loopback(port)) else {
                            continue;
                        };
                        pipe(&inbound, &outbound);
                        pipe(&outbound, &inbound);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        });
        Relay {
            stop,
            thread: Some(thread),
        }
    }
}

/// Copies `from` to `to` on a thread until `from` ends, then ends `to`'s sending side.
fn pipe(from: &TcpStream, to: &TcpStream) {
    let (Ok(mut from), Ok(mut to)) = (from.try_clone(), to.try_clone()) else {
        return;
    };
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut from, &mut to);
        let _ = to.shutdown(std::net::Shutdown::Write);
        let _ = from.shutdown(std::net::Shutdown::Read);
    });
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One node: its namespace, its proxy's mode and process.
struct Node {
    name: String,
    ip: String,
    mode: &'static str,
    ns: Netns,
}

/// Processes named for the report: (name, guard). Killed in the reverse order of their
/// start on drop (proxies, API servers, etcd), so that none logs the loss of another.
struct Procs(Vec<(String, ChildGuard)>);

impl Drop for Procs {
    fn drop(&mut self) {
        while let Some((_, mut guard)) = self.0.pop() {
            guard.kill();
        }
    }
}

/// Everything the soak runs on; dropped in field order: processes, relay and servers first,
/// then the eBPF node's pins and cgroup, then the namespaces.
struct Cluster {
    procs: Procs,
    relay: Option<Relay>,
    _servers: Vec<Server>,
    ebpf: EbpfNode,
    _pods: Vec<Netns>,
    client: Netns,
    nodes: Vec<Node>,
    _lan: Lan,
    _data: tempfile::TempDir,
}

fn wait_until(what: &str, timeout: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("timed out after {timeout:?} waiting until {what}");
}

/// The pod address of pod `p` (0-based) on node `k` (1-based), and its IPv6 address (listed in
/// the IPv6 slices; no route leads there, no connection is made to it).
fn pod_ip(k: usize, p: usize) -> (String, String) {
    (
        format!("10.244.{k}.{}", p + 2),
        format!("fd00:10:244:{k}::{}", p + 2),
    )
}

impl Cluster {
    fn start() -> Cluster {
        let data = tempfile::tempdir().unwrap();
        let lan = Lan::new("soaklan").unwrap();
        let modes = ["nftables", "iptables", "ebpf"];
        let mut nodes = Vec::new();
        for (i, mode) in modes.iter().enumerate() {
            let k = i + 1;
            let name = format!("node{k}");
            let ns = Netns::new(&name).unwrap();
            let ip = format!("192.0.2.1{k}");
            lan.attach(&ns, "eth0", &format!("{ip}/24")).unwrap();
            ns.add_addr("eth0", &format!("fd00:192:0:2::1{k}/64"))
                .unwrap();
            ns.sysctl("net.ipv4.ip_forward", "1").unwrap();
            ns.sysctl("net.ipv6.conf.all.forwarding", "1").unwrap();
            nodes.push(Node { name, ip, mode, ns });
        }
        for (i, node) in nodes.iter().enumerate() {
            for (j, other) in nodes.iter().enumerate() {
                if i != j {
                    node.ns
                        .run(&[
                            "ip",
                            "route",
                            "add",
                            &format!("10.244.{}.0/24", j + 1),
                            "via",
                            &other.ip,
                        ])
                        .unwrap();
                }
            }
        }
        let client = Netns::new("client").unwrap();
        lan.attach(&client, "eth0", &format!("{CLIENT_IP}/24"))
            .unwrap();
        // Pods in the point-to-point layout of the lab (lab/topology.rs).
        let mut pods = Vec::new();
        let mut servers = Vec::new();
        for (i, node) in nodes.iter().enumerate() {
            let k = i + 1;
            let gateway = format!("10.244.{k}.1");
            for p in 0..PODS_PER_NODE {
                let pod = Netns::new(&format!("pod{k}{p}")).unwrap();
                let host_if = format!("vp{k}{p}");
                veth(&node.ns, &host_if, &pod, "eth0").unwrap();
                let (ip, _) = pod_ip(k, p);
                pod.add_addr("eth0", &format!("{ip}/32")).unwrap();
                pod.run(&[
                    "ip", "route", "add", &gateway, "dev", "eth0", "scope", "link",
                ])
                .unwrap();
                pod.run(&["ip", "route", "add", "default", "via", &gateway])
                    .unwrap();
                node.ns
                    .add_addr(&host_if, &format!("{gateway}/32"))
                    .unwrap();
                node.ns
                    .run(&[
                        "ip",
                        "route",
                        "add",
                        &format!("{ip}/32"),
                        "dev",
                        &host_if,
                        "scope",
                        "link",
                    ])
                    .unwrap();
                servers.push(
                    Server::start_in(
                        &pod,
                        ServerConfig::http(&format!("pod{k}{p}"), POD_PORT).with_udp(5353),
                    )
                    .unwrap(),
                );
                pods.push(pod);
            }
        }
        let ebpf = EbpfNode::new(data.path());
        let mut cluster = Cluster {
            procs: Procs(Vec::new()),
            relay: None,
            _servers: servers,
            ebpf,
            _pods: pods,
            client,
            nodes,
            _lan: lan,
            _data: data,
        };
        cluster.start_control_plane();
        cluster.start_proxies();
        cluster
    }

    /// etcd on node1 (client URLs on its loopback and its LAN address), apiserver A on node1's
    /// loopback, apiserver B on node2's, the relay on node3.
    fn start_control_plane(&mut self) {
        let dir = self._data.path().to_path_buf();
        let node1 = &self.nodes[0].ns;
        let etcd_url = format!("http://{}:2379", self.nodes[0].ip);
        let mut etcd = node1.command("etcd");
        etcd.args(["--name", "soak", "--data-dir"])
            .arg(dir.join("etcd"))
            .args([
                "--listen-client-urls",
                &format!("{etcd_url},http://127.0.0.1:2379"),
                "--advertise-client-urls",
                &etcd_url,
                "--listen-peer-urls",
                "http://127.0.0.1:2380",
                "--initial-advertise-peer-urls",
                "http://127.0.0.1:2380",
                "--initial-cluster",
                "soak=http://127.0.0.1:2380",
                "--logger",
                "zap",
                "--log-level",
                "error",
            ])
            .stdout(std::process::Stdio::null());
        self.procs
            .0
            .push(("etcd".into(), node1.spawn(&mut etcd).unwrap()));
        wait_until("etcd is healthy", Duration::from_secs(20), || {
            http_in(node1, loopback(2379), "GET", "/health", None)
                .is_ok_and(|(code, body)| code == 200 && body.contains("true"))
        });
        for (name, node) in [("apiserver-a", 0), ("apiserver-b", 1)] {
            let ns = &self.nodes[node].ns;
            let mut cmd = ns.command(env!("CARGO_BIN_EXE_nodeport"));
            cmd.args(["apiserver", "--port", &API_PORT.to_string(), "--data-dir"])
                .arg(dir.join(name))
                .args([
                    "--etcd-servers",
                    &etcd_url,
                    "--service-cluster-ip-range",
                    SERVICE_RANGES,
                ])
                .env("NODEPORT_LOG", "warn");
            // `--etcd-compaction-interval` (default 5m): how far back each API server's watch
            // history reaches, and so where its memory levels off under churn.
            if let Ok(interval) = std::env::var("NODEPORT_SOAK_COMPACTION") {
                cmd.args(["--etcd-compaction-interval", &interval]);
            }
            self.procs
                .0
                .push((name.into(), ns.spawn(&mut cmd).unwrap()));
            wait_until(&format!("{name} is ready"), Duration::from_secs(30), || {
                http_in(ns, loopback(API_PORT), "GET", "/readyz", None)
                    .is_ok_and(|(code, _)| code == 200)
            });
        }
        self.relay = Some(Relay::start(&self.nodes[2].ns, &self.nodes[1].ns, API_PORT));
        wait_until(
            "apiserver B answers through the relay on node3",
            Duration::from_secs(10),
            || {
                http_in(
                    &self.nodes[2].ns,
                    loopback(API_PORT),
                    "GET",
                    "/readyz",
                    None,
                )
                .is_ok_and(|(code, _)| code == 200)
            },
        );
        for (i, node) in self.nodes.iter().enumerate() {
            let body = json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": node.name},
                "status": {"addresses": [
                    {"type": "InternalIP", "address": node.ip},
                    {"type": "InternalIP", "address": format!("fd00:192:0:2::1{}", i + 1)},
                ]},
            });
            let (code, text) = http_in(
                &self.nodes[0].ns,
                loopback(API_PORT),
                "POST",
                "/api/v1/nodes",
                Some(&body.to_string()),
            )
            .unwrap();
            assert_eq!(code, 201, "creating Node {}: {text}", node.name);
        }
    }

    fn start_proxies(&mut self) {
        for node in &self.nodes {
            let mut cmd = node.ns.command(env!("CARGO_BIN_EXE_nodeport"));
            cmd.args([
                "proxy",
                "--master",
                &format!("http://127.0.0.1:{API_PORT}"),
                "--hostname-override",
                &node.name,
                "--cluster-cidr",
                "10.244.0.0/16",
                "--healthz-bind-address",
                &format!("127.0.0.1:{HEALTHZ}"),
                "--metrics-bind-address",
                &format!("127.0.0.1:{METRICS}"),
                "--proxy-mode",
                node.mode,
            ])
            .env("NODEPORT_LOG", "warn");
            if node.mode == "ebpf" {
                cmd.arg("--ebpf-pin-root")
                    .arg(&self.ebpf.pin_root)
                    .arg("--ebpf-cgroup-root")
                    .arg(&self.ebpf.cgroup);
            }
            self.procs.0.push((
                format!("proxy-{}", node.mode),
                node.ns.spawn(&mut cmd).unwrap(),
            ));
        }
        for node in &self.nodes {
            wait_until(
                &format!("the {} proxy on {} is healthy", node.mode, node.name),
                Duration::from_secs(30),
                || {
                    http_in(&node.ns, loopback(HEALTHZ), "GET", "/healthz", None)
                        .is_ok_and(|(code, _)| code == 200)
                },
            );
        }
    }

    /// The API server the driver's `n`th write goes to: A and B in turn.
    fn api(&self, n: usize) -> &Netns {
        &self.nodes[n % 2].ns
    }

    /// Every process still running, or the first one that exited.
    fn all_running(&mut self) -> Result<(), String> {
        for (name, guard) in &mut self.procs.0 {
            if let Some(status) = guard.try_wait() {
                return Err(format!("{name} exited: {status}"));
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// The driver's objects

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EndpointState {
    Ready,
    /// `terminating`, still `serving` or not.
    Terminating {
        serving: bool,
    },
    NotReady,
}

#[derive(Debug, Clone)]
struct Endpoint {
    /// Node (1-based) and pod on it (0-based).
    node: usize,
    pod: usize,
    state: EndpointState,
}

/// A Service as the driver wants it, and the last object the API server returned for it
/// (its allocations: ClusterIPs, NodePorts, healthCheckNodePort).
#[derive(Debug, Clone)]
struct Svc {
    name: String,
    kind: &'static str,
    external_local: bool,
    internal_local: bool,
    affinity: bool,
    family_policy: &'static str,
    /// The `p2` TCP port and the `dns` UDP port besides `http`.
    p2: bool,
    dns: bool,
    endpoints: Vec<Endpoint>,
    stored: Option<Value>,
    slices: BTreeMap<&'static str, Value>,
}

impl Svc {
    fn random(name: String, rng: &mut Rng) -> Svc {
        let mut s = Svc {
            name,
            kind: "NodePort",
            external_local: false,
            internal_local: false,
            affinity: false,
            family_policy: rng.pick(&[
                "SingleStack",
                "SingleStack",
                "PreferDualStack",
                "RequireDualStack",
            ]),
            p2: false,
            dns: false,
            endpoints: Vec::new(),
            stored: None,
            slices: BTreeMap::new(),
        };
        s.mutate(rng);
        s.mutate(rng);
        s.endpoints = random_endpoints(rng);
        s
    }

    /// One random change of its spec.
    fn mutate(&mut self, rng: &mut Rng) {
        match rng.below(6) {
            0 => self.kind = rng.pick(&["NodePort", "NodePort", "LoadBalancer", "ClusterIP"]),
            1 => self.external_local = !self.external_local,
            2 => self.internal_local = !self.internal_local,
            3 => self.affinity = !self.affinity,
            4 => self.p2 = !self.p2,
            _ => self.dns = !self.dns,
        }
    }

    fn has_node_ports(&self) -> bool {
        self.kind != "ClusterIP"
    }

    /// The Service object to create or update: the driver's spec with the allocations the
    /// API server made kept (as a client that read the object and changed it does).
    fn body(&self) -> Value {
        let stored = self.stored.as_ref();
        let stored_spec = stored.map(|s| &s["spec"]);
        let kept_node_port = |name: &str| -> Option<Value> {
            stored_spec?["ports"]
                .as_array()?
                .iter()
                .find(|p| p["name"] == name)
                .and_then(|p| p.get("nodePort").cloned())
        };
        let mut ports = vec![("http", 80, POD_PORT, "TCP")];
        if self.p2 {
            ports.push(("p2", 81, 8081, "TCP"));
        }
        if self.dns {
            ports.push(("dns", 53, 5353, "UDP"));
        }
        let ports: Vec<Value> = ports
            .into_iter()
            .map(|(name, port, target, protocol)| {
                let mut p =
                    json!({"name": name, "port": port, "targetPort": target, "protocol": protocol});
                if self.has_node_ports()
                    && let Some(np) = kept_node_port(name)
                {
                    p["nodePort"] = np;
                }
                p
            })
            .collect();
        let mut spec = json!({
            "type": self.kind,
            "ports": ports,
            "sessionAffinity": if self.affinity { "ClientIP" } else { "None" },
            "ipFamilyPolicy": self.family_policy,
            "internalTrafficPolicy": if self.internal_local { "Local" } else { "Cluster" },
        });
        if self.has_node_ports() {
            spec["externalTrafficPolicy"] = json!(if self.external_local {
                "Local"
            } else {
                "Cluster"
            });
            if self.external_local
                && let Some(hc) = stored_spec.and_then(|s| s.get("healthCheckNodePort"))
            {
                spec["healthCheckNodePort"] = hc.clone();
            }
        }
        let mut metadata = json!({"name": self.name, "namespace": "default"});
        if let Some(s) = stored {
            for key in ["clusterIP", "clusterIPs", "ipFamilies"] {
                if let Some(v) = s["spec"].get(key) {
                    spec[key] = v.clone();
                }
            }
            metadata["resourceVersion"] = s["metadata"]["resourceVersion"].clone();
        }
        json!({"apiVersion": "v1", "kind": "Service", "metadata": metadata, "spec": spec})
    }

    /// The families of its slices: IPv4, and IPv6 when dual-stack.
    fn families(&self) -> &'static [&'static str] {
        if self.family_policy == "SingleStack" {
            &["IPv4"]
        } else {
            &["IPv4", "IPv6"]
        }
    }

    fn slice_body(&self, family: &'static str) -> Value {
        let endpoints: Vec<Value> = self
            .endpoints
            .iter()
            .map(|e| {
                let (v4, v6) = pod_ip(e.node, e.pod);
                let (ready, serving, terminating) = match e.state {
                    EndpointState::Ready => (true, true, false),
                    EndpointState::Terminating { serving } => (false, serving, true),
                    EndpointState::NotReady => (false, false, false),
                };
                json!({
                    "addresses": [if family == "IPv4" { v4 } else { v6 }],
                    "nodeName": format!("node{}", e.node),
                    "conditions": {"ready": ready, "serving": serving, "terminating": terminating},
                })
            })
            .collect();
        let mut metadata = json!({
            "name": format!("{}-{}", self.name, family.to_lowercase()),
            "namespace": "default",
            "labels": {"kubernetes.io/service-name": self.name},
        });
        if let Some(stored) = self.slices.get(family) {
            metadata["resourceVersion"] = stored["metadata"]["resourceVersion"].clone();
        }
        json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": metadata,
            "addressType": family,
            "ports": [
                {"name": "http", "port": POD_PORT, "protocol": "TCP"},
                {"name": "p2", "port": 8081, "protocol": "TCP"},
                {"name": "dns", "port": 5353, "protocol": "UDP"},
            ],
            "endpoints": endpoints,
        })
    }

    /// The `http` port's NodePort, once allocated.
    fn http_node_port(&self) -> Option<u16> {
        if !self.has_node_ports() {
            return None;
        }
        self.stored.as_ref()?["spec"]["ports"]
            .as_array()?
            .iter()
            .find(|p| p["name"] == "http")?["nodePort"]
            .as_u64()
            .and_then(|p| u16::try_from(p).ok())
    }

    /// Pods a new connection to the `http` NodePort on `node` may reach, when it must be
    /// answered: the ready endpoints (on that node, with `externalTrafficPolicy: Local`).
    /// `None`: no ready endpoint applies, so nothing is asserted (kube-proxy may fall back
    /// to serving terminating endpoints, or drop or reject).
    fn must_answer(&self, node: usize) -> Option<BTreeSet<String>> {
        let ready: BTreeSet<String> = self
            .endpoints
            .iter()
            .filter(|e| e.state == EndpointState::Ready)
            .filter(|e| !self.external_local || e.node == node)
            .map(|e| format!("pod{}{}", e.node, e.pod))
            .collect();
        (!ready.is_empty()).then_some(ready)
    }
}

fn random_endpoints(rng: &mut Rng) -> Vec<Endpoint> {
    let mut endpoints = Vec::new();
    for node in 1..=3 {
        for pod in 0..PODS_PER_NODE {
            if rng.chance(55) {
                let state = match rng.below(10) {
                    0..=5 => EndpointState::Ready,
                    6 => EndpointState::Terminating { serving: true },
                    7 => EndpointState::Terminating { serving: false },
                    _ => EndpointState::NotReady,
                };
                endpoints.push(Endpoint { node, pod, state });
            }
        }
    }
    endpoints
}

// ---------------------------------------------------------------------------------------------
// The soak

/// What a run counted.
#[derive(Debug, Default)]
struct Tally {
    /// API writes done, by kind.
    operations: BTreeMap<&'static str, u64>,
    checkpoints: u64,
    syncs_waited: u64,
    /// How long each checkpoint waited for every proxy to report the barrier synced.
    sync_waits: Vec<Duration>,
    kernel_traces: u64,
    /// Packets those traces followed (each address and port a node serves a Service on).
    traced_packets: u64,
    bitmap_checks: u64,
    connections: u64,
    /// Every failed check, with its cause.
    mismatches: Vec<String>,
    failed_connections: Vec<String>,
    /// Writes the API server refused or failed.
    failed_operations: Vec<String>,
    /// (seconds since start, process, RSS in KiB).
    rss: Vec<(f64, String, u64)>,
}

struct Soak<'c> {
    cluster: &'c Cluster,
    rng: Rng,
    services: BTreeMap<String, Svc>,
    barrier: Svc,
    next_name: usize,
    writes: usize,
    tally: Tally,
    started: Instant,
}

impl Soak<'_> {
    /// Sends one write through API server A or B in turn; the returned object, or the failure
    /// recorded.
    fn write(
        &mut self,
        what: &'static str,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Option<Value> {
        self.writes += 1;
        let ns = self.cluster.api(self.writes);
        let text = body.map(Value::to_string);
        match http_in(ns, loopback(API_PORT), method, path, text.as_deref()) {
            Ok((code, reply)) if (200..300).contains(&code) => {
                *self.tally.operations.entry(what).or_default() += 1;
                serde_json::from_str(&reply).ok()
            }
            Ok((code, reply)) => {
                self.tally
                    .failed_operations
                    .push(format!("{what}: {method} {path}: {code} {reply}"));
                None
            }
            Err(e) => {
                self.tally.failed_operations.push(format!("{what}: {e}"));
                None
            }
        }
    }

    fn put_service(&mut self, svc: &mut Svc, what: &'static str) -> bool {
        let body = svc.body();
        let reply = if svc.stored.is_some() {
            self.write(
                what,
                "PUT",
                &format!("/api/v1/namespaces/default/services/{}", svc.name),
                Some(&body),
            )
        } else {
            self.write(
                what,
                "POST",
                "/api/v1/namespaces/default/services",
                Some(&body),
            )
        };
        match reply {
            Some(obj) => {
                svc.stored = Some(obj);
                true
            }
            None => false,
        }
    }

    fn put_slices(&mut self, svc: &mut Svc, what: &'static str) {
        for family in svc.families() {
            let body = svc.slice_body(family);
            let reply = if svc.slices.contains_key(family) {
                let name = body["metadata"]["name"].as_str().unwrap().to_owned();
                self.write(
                    what,
                    "PUT",
                    &format!("/apis/discovery.k8s.io/v1/namespaces/default/endpointslices/{name}"),
                    Some(&body),
                )
            } else {
                self.write(
                    what,
                    "POST",
                    "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices",
                    Some(&body),
                )
            };
            if let Some(obj) = reply {
                svc.slices.insert(family, obj);
            }
        }
    }

    /// One random operation.
    fn step(&mut self) {
        let count = self.services.len();
        let roll = self.rng.below(100);
        if count < MIN_SERVICES || (roll < 20 && count < MAX_SERVICES) {
            self.next_name += 1;
            let mut svc = Svc::random(format!("svc-{}", self.next_name), &mut self.rng);
            if self.put_service(&mut svc, "service create") {
                self.put_slices(&mut svc, "endpointslice create");
                self.services.insert(svc.name.clone(), svc);
            }
            return;
        }
        let names: Vec<String> = self.services.keys().cloned().collect();
        let name = names[self.rng.below(names.len())].clone();
        let mut svc = self.services.remove(&name).expect("listed");
        if roll < 35 && count > MIN_SERVICES {
            // Delete: the slices first, as the EndpointSlice controller would after the
            // Service is gone (either order is legal; both are deleted).
            for family in svc.families() {
                self.write(
                    "endpointslice delete",
                    "DELETE",
                    &format!(
                        "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices/{}-{}",
                        svc.name,
                        family.to_lowercase()
                    ),
                    None,
                );
            }
            self.write(
                "service delete",
                "DELETE",
                &format!("/api/v1/namespaces/default/services/{}", svc.name),
                None,
            );
            return;
        }
        if roll < 65 {
            svc.mutate(&mut self.rng);
            self.put_service(&mut svc, "service update");
        } else {
            // Endpoints come, go, become ready or terminating.
            if self.rng.chance(30) {
                svc.endpoints = random_endpoints(&mut self.rng);
            } else if !svc.endpoints.is_empty() {
                let i = self.rng.below(svc.endpoints.len());
                // Ready becomes terminating (serving or not); terminating goes; not ready
                // becomes ready.
                let next = match svc.endpoints[i].state {
                    EndpointState::Ready => Some(EndpointState::Terminating {
                        serving: self.rng.chance(50),
                    }),
                    EndpointState::Terminating { .. } => None,
                    EndpointState::NotReady => Some(EndpointState::Ready),
                };
                match next {
                    Some(state) => svc.endpoints[i].state = state,
                    None => {
                        svc.endpoints.remove(i);
                    }
                }
            } else {
                svc.endpoints = random_endpoints(&mut self.rng);
            }
            self.put_slices(&mut svc, "endpointslice update");
        }
        self.services.insert(name, svc);
    }

    /// Changes the barrier Service and EndpointSlice (a port number each): the revisions of
    /// these writes are the latest of their kinds.
    fn write_barrier(&mut self, n: usize) -> Option<(u64, u64)> {
        let mut barrier = self.barrier.clone();
        let port = 1000 + (n % 1000) as u64;
        let mut body = barrier.body();
        body["spec"]["ports"][0]["port"] = json!(port);
        let path = format!("/api/v1/namespaces/default/services/{BARRIER}");
        let reply = if barrier.stored.is_some() {
            self.write("barrier", "PUT", &path, Some(&body))
        } else {
            self.write(
                "barrier",
                "POST",
                "/api/v1/namespaces/default/services",
                Some(&body),
            )
        }?;
        let service_rv = reply["metadata"]["resourceVersion"]
            .as_str()?
            .parse()
            .ok()?;
        barrier.stored = Some(reply);
        let mut slice = barrier.slice_body("IPv4");
        slice["ports"][0]["port"] = json!(9000 + (n % 1000) as u64);
        let reply = if barrier.slices.contains_key("IPv4") {
            self.write(
                "barrier",
                "PUT",
                &format!(
                    "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices/{BARRIER}-ipv4"
                ),
                Some(&slice),
            )
        } else {
            self.write(
                "barrier",
                "POST",
                "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices",
                Some(&slice),
            )
        }?;
        let slice_rv = reply["metadata"]["resourceVersion"]
            .as_str()?
            .parse()
            .ok()?;
        barrier.slices.insert("IPv4", reply);
        self.barrier = barrier;
        Some((service_rv, slice_rv))
    }

    /// What a proxy reports synced: (services, endpointslices).
    fn synced(node: &Node) -> Option<(u64, u64)> {
        let (_, text) = http_in(&node.ns, loopback(METRICS), "GET", "/metrics", None).ok()?;
        let value = |resource: &str| -> Option<u64> {
            let prefix =
                format!("nodeport_sync_proxy_rules_resource_version{{resource=\"{resource}\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(&prefix)?.trim().parse().ok())
        };
        Some((value("services")?, value("endpointslices")?))
    }

    fn checkpoint(&mut self, n: usize) {
        self.tally.checkpoints += 1;
        let Some((service_rv, slice_rv)) = self.write_barrier(n) else {
            self.tally
                .mismatches
                .push(format!("checkpoint {n}: the barrier could not be written"));
            return;
        };
        let written = Instant::now();
        let deadline = written + SYNC_DEADLINE;
        let mut pending: Vec<&Node> = self.cluster.nodes.iter().collect();
        while !pending.is_empty() && Instant::now() < deadline {
            pending.retain(|node| {
                !Self::synced(node).is_some_and(|(s, e)| s >= service_rv && e >= slice_rv)
            });
            if !pending.is_empty() {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        for node in &pending {
            self.tally.mismatches.push(format!(
                "checkpoint {n}: the {} proxy on {} did not report revision {service_rv} \
                 (services) / {slice_rv} (endpointslices) synced within {SYNC_DEADLINE:?}; it \
                 reports {:?}",
                node.mode,
                node.name,
                Self::synced(node)
            ));
        }
        if pending.is_empty() {
            self.tally.syncs_waited += 1;
            self.tally.sync_waits.push(written.elapsed());
        }
        self.check_kernels(n);
        self.check_bitmaps(n);
        self.check_connections(n);
        self.sample_rss();
        eprintln!(
            "checkpoint {n} at {:.0} s: {} operations, {} Services; synced in {:?}; {} \
             mismatches, {} failed connections, {} failed operations so far",
            self.started.elapsed().as_secs_f64(),
            self.tally.operations.values().sum::<u64>(),
            self.services.len(),
            self.tally.sync_waits.last(),
            self.tally.mismatches.len(),
            self.tally.failed_connections.len(),
            self.tally.failed_operations.len(),
        );
    }

    fn check_kernels(&mut self, n: usize) {
        let mut names: Vec<String> = self.services.keys().cloned().collect();
        let mut sample = Vec::new();
        while sample.len() < TRACE_SAMPLE && !names.is_empty() {
            sample.push(names.remove(self.rng.below(names.len())));
        }
        let pin_root = self.cluster.ebpf.pin_root.clone();
        let results: Vec<(String, u64, Vec<String>)> = std::thread::scope(|scope| {
            let handles: Vec<_> = self
                .cluster
                .nodes
                .iter()
                .map(|node| {
                    let sample = &sample;
                    let pin_root = &pin_root;
                    scope.spawn(move || {
                        let (mut packets, mut problems) = (0, Vec::new());
                        for name in sample {
                            match trace_kernel(node, name, pin_root) {
                                Ok(n) => packets += n,
                                Err(e) => problems.push(e),
                            }
                        }
                        (node.name.clone(), packets, problems)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (node, packets, problems) in results {
            self.tally.kernel_traces += sample.len() as u64;
            self.tally.traced_packets += packets;
            for p in problems {
                self.tally
                    .mismatches
                    .push(format!("checkpoint {n}: {node}: {p}"));
            }
        }
    }

    fn check_bitmaps(&mut self, n: usize) {
        let ranges = ServiceRanges {
            node_ports: nodeport_apiserver::PortRange::parse("30000-32767").unwrap(),
            cluster_ips: "10.96.0.0/16".parse().unwrap(),
            secondary_cluster_ips: Some("fd00:10:96::/108".parse().unwrap()),
        };
        let dump = self.cluster.nodes[0].ns.enter(|| {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                let backend = EtcdBackend::connect(
                    EtcdConfig::new(vec!["http://127.0.0.1:2379".into()]),
                    "/registry",
                )
                .await
                .map_err(|e| e.to_string())?;
                backend.dump().await.map_err(|e| e.to_string())
            })
        });
        self.tally.bitmap_checks += 1;
        let report = match dump {
            Ok(Ok(dump)) => verify_dump(&dump, "/registry", &ranges).map_err(|e| format!("{e:?}")),
            Ok(Err(e)) => Err(e),
            Err(e) => Err(e.to_string()),
        };
        match report {
            Ok(r) if r.is_consistent() => {
                // Every Service of the driver, the barrier and default/kubernetes.
                let want = self.services.len() + 2;
                if r.services != want {
                    self.tally.mismatches.push(format!(
                        "checkpoint {n}: etcd holds {} Services, the driver {want}",
                        r.services
                    ));
                }
            }
            Ok(r) => self.tally.mismatches.push(format!(
                "checkpoint {n}: the bitmaps differ from the Services: {r:?}"
            )),
            Err(e) => self
                .tally
                .mismatches
                .push(format!("checkpoint {n}: reading etcd's bitmaps: {e}")),
        }
    }

    fn check_connections(&mut self, n: usize) {
        let mut candidates: Vec<&Svc> = self
            .services
            .values()
            .filter(|s| s.http_node_port().is_some())
            .collect();
        let mut sample = Vec::new();
        while sample.len() < CONNECT_SAMPLE && !candidates.is_empty() {
            sample.push(candidates.remove(self.rng.below(candidates.len())));
        }
        for svc in sample {
            let port = svc.http_node_port().expect("filtered");
            for (i, node) in self.cluster.nodes.iter().enumerate() {
                let Some(allowed) = svc.must_answer(i + 1) else {
                    continue;
                };
                self.tally.connections += 1;
                let to: SocketAddr = format!("{}:{port}", node.ip).parse().unwrap();
                let outcome =
                    probe::http_get(&self.cluster.client, None, to, "/", Duration::from_secs(2));
                let failure = match outcome {
                    Ok(answer) if allowed.contains(&answer.pod) => None,
                    Ok(answer) => Some(format!(
                        "answered by {}, not one of the ready endpoints {allowed:?}",
                        answer.pod
                    )),
                    Err(e) => Some(e.to_string()),
                };
                if let Some(cause) = failure {
                    self.tally.failed_connections.push(format!(
                        "checkpoint {n}: {CLIENT_IP} -> {to} ({} proxy, default/{} {}, \
                         externalTrafficPolicy {}): {cause}",
                        node.mode,
                        svc.name,
                        svc.kind,
                        if svc.external_local {
                            "Local"
                        } else {
                            "Cluster"
                        },
                    ));
                }
            }
        }
    }

    /// The checks can fail: with the iptables node's `KUBE-SERVICES` chain flushed by hand, a
    /// NodePort Service with a ready endpoint must be reported by the kernel trace on that
    /// node, and its NodePort there must not answer. Returns what was not noticed. (Run
    /// after the soak: the proxy restores the chain on its next periodic sync.)
    fn negative_control(&mut self) -> Option<String> {
        let node = &self.cluster.nodes[1];
        assert_eq!(node.mode, "iptables");
        let Some(svc) = self
            .services
            .values()
            .find(|s| s.http_node_port().is_some() && s.must_answer(2).is_some())
        else {
            // Make one: a NodePort Service with a ready endpoint on every node.
            let mut svc = Svc::random("soak-control".into(), &mut self.rng);
            svc.kind = "NodePort";
            svc.endpoints = (1..=3)
                .map(|node| Endpoint {
                    node,
                    pod: 0,
                    state: EndpointState::Ready,
                })
                .collect();
            assert!(self.put_service(&mut svc, "service create"));
            self.put_slices(&mut svc, "endpointslice create");
            self.services.insert(svc.name.clone(), svc);
            self.checkpoint(0);
            return self.negative_control();
        };
        let (name, port) = (svc.name.clone(), svc.http_node_port().expect("found"));
        let to: SocketAddr = format!("{}:{port}", node.ip).parse().unwrap();
        // The proxy's periodic full resync (every 30 s) may restore the chain between the
        // flush and the checks: then they saw the repaired rules, and the control is done
        // again (a resync twice in a row within seconds does not happen).
        let mut last = None;
        for _ in 0..3 {
            node.ns
                .run(&["iptables", "-t", "nat", "-F", "KUBE-SERVICES"])
                .unwrap();
            let answered =
                probe::http_get(&self.cluster.client, None, to, "/", Duration::from_secs(1))
                    .is_ok();
            let traced = trace_kernel(node, &name, &self.cluster.ebpf.pin_root);
            let still_flushed = node
                .ns
                .run(&["iptables", "-t", "nat", "-S", "KUBE-SERVICES"])
                .unwrap()
                .lines()
                .all(|l| l.starts_with("-N "));
            match (answered, traced) {
                (false, Err(e))
                    if e.contains("the kernel differs from what the proxy would program") =>
                {
                    return None;
                }
                (answered, traced) => {
                    last = Some(format!(
                        "KUBE-SERVICES flushed on {}: default/{name}'s NodePort {to} answered: \
                         {answered}; the kernel trace: {traced:?}",
                        node.name
                    ));
                    if still_flushed {
                        return last;
                    }
                }
            }
        }
        last
    }

    fn sample_rss(&mut self) {
        let at = self.started.elapsed().as_secs_f64();
        for (name, guard) in &self.cluster.procs.0 {
            if name == "etcd" {
                continue;
            }
            if let Some(kib) = rss_kib(guard.pid()) {
                self.tally.rss.push((at, name.clone(), kib));
            }
        }
    }
}

/// `VmRSS` of a process, in KiB.
fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// `nodeport trace --rules kernel --service default/<name>` on `node`: every address and port
/// the node serves the Service on, traced through the kernel's rules and through what the
/// proxy would render for the objects the API server holds now. `Ok`: the packets traced.
/// `Err`: a fate differs, a rule was not evaluated, the trace failed or traced nothing.
fn trace_kernel(node: &Node, name: &str, pin_root: &Path) -> Result<u64, String> {
    let mut cmd = node.ns.command(env!("CARGO_BIN_EXE_nodeport"));
    cmd.args([
        "trace",
        "--rules",
        "kernel",
        "--master",
        &format!("http://127.0.0.1:{API_PORT}"),
        "--node-name",
        &node.name,
        "--cluster-cidr",
        "10.244.0.0/16",
        "--service",
        &format!("default/{name}"),
        "--from",
        CLIENT_IP,
        "-o",
        "json",
    ])
    .env("NODEPORT_LOG", "error");
    if node.mode == "ebpf" {
        cmd.arg("--ebpf-pin-root").arg(pin_root);
    }
    let out = cmd.output().map_err(|e| format!("running trace: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.code() == Some(3) || !stderr.trim().is_empty() {
        return Err(format!(
            "trace of default/{name} failed ({}): {stderr}{stdout}",
            out.status
        ));
    }
    let report: Value = serde_json::from_str(&stdout)
        .map_err(|e| format!("trace of default/{name}: not JSON ({e}): {stdout}"))?;
    let traces = report["traces"].as_array().cloned().unwrap_or_default();
    if traces.is_empty() {
        return Err(format!(
            "{} proxy: the trace of default/{name} followed no packet: {stdout}",
            node.mode
        ));
    }
    let wrong: Vec<String> = traces
        .iter()
        .flat_map(|t| {
            let packet = t["packet"].to_string();
            t["notes"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .filter_map(|n| n.as_str().map(str::to_owned))
                .filter(|n| {
                    n.contains("the kernel differs from what the proxy would program")
                        || n.contains("were not evaluated")
                })
                .map(move |n| format!("{packet}: {n}"))
        })
        .collect();
    if wrong.is_empty() {
        Ok(traces.len() as u64)
    } else {
        Err(format!(
            "{} proxy: the kernel's rules for default/{name} differ from the render: {}",
            node.mode,
            wrong.join("; ")
        ))
    }
}

/// RSS growth after the first five minutes, per process: (name, KiB at 5 min, highest after,
/// percent).
fn rss_growth(rss: &[(f64, String, u64)]) -> Vec<(String, u64, u64, f64)> {
    let names: BTreeSet<&String> = rss.iter().map(|(_, n, _)| n).collect();
    names
        .into_iter()
        .filter_map(|name| {
            let after: Vec<u64> = rss
                .iter()
                .filter(|(t, n, _)| n == name && *t >= 300.0)
                .map(|(_, _, k)| *k)
                .collect();
            let first = *after.first()?;
            let highest = *after.iter().max()?;
            Some((
                name.clone(),
                first,
                highest,
                (highest as f64 - first as f64) * 100.0 / first as f64,
            ))
        })
        .collect()
}

fn report(tally: &Tally, seconds: f64, seed: u64) -> String {
    let mut out = String::new();
    let total: u64 = tally.operations.values().sum();
    let _ = writeln!(
        out,
        "churn soak: {seconds:.0} s, seed {seed}, {total} operations ({:.1}/s)",
        total as f64 / seconds
    );
    for (what, n) in &tally.operations {
        let _ = writeln!(out, "  {what:<22} {n}");
    }
    let _ = writeln!(
        out,
        "checkpoints {}: proxies synced the latest revision {} times; kernel traces {} ({} \
         packets), bitmap checks {}, connections {}",
        tally.checkpoints,
        tally.syncs_waited,
        tally.kernel_traces,
        tally.traced_packets,
        tally.bitmap_checks,
        tally.connections
    );
    let mut waits = tally.sync_waits.clone();
    waits.sort();
    if let (Some(median), Some(max)) = (waits.get(waits.len() / 2), waits.last()) {
        let _ = writeln!(
            out,
            "every proxy reported the latest revision synced after {:.0} ms (median), {:.0} ms \
             (longest)",
            median.as_secs_f64() * 1000.0,
            max.as_secs_f64() * 1000.0
        );
    }
    let _ = writeln!(
        out,
        "mismatches {}, failed connections {}, failed operations {}",
        tally.mismatches.len(),
        tally.failed_connections.len(),
        tally.failed_operations.len()
    );
    for m in tally
        .mismatches
        .iter()
        .chain(&tally.failed_connections)
        .chain(&tally.failed_operations)
    {
        let _ = writeln!(out, "  - {m}");
    }
    let names: BTreeSet<&String> = tally.rss.iter().map(|(_, n, _)| n).collect();
    for name in names {
        let samples: Vec<u64> = tally
            .rss
            .iter()
            .filter(|(_, n, _)| n == name)
            .map(|(_, _, k)| *k)
            .collect();
        let _ = writeln!(
            out,
            "RSS {name:<18} first {:>7} KiB, last {:>7} KiB, highest {:>7} KiB",
            samples.first().unwrap_or(&0),
            samples.last().unwrap_or(&0),
            samples.iter().max().unwrap_or(&0)
        );
    }
    for (name, first, highest, percent) in rss_growth(&tally.rss) {
        let _ = writeln!(
            out,
            "RSS growth after 5 min {name:<18} {first} -> {highest} KiB ({percent:+.1} %)"
        );
    }
    out
}

#[test]
fn a_minute_of_random_service_churn_leaves_every_nodes_kernel_as_rendered_the_bitmaps_equal_and_every_ready_node_port_answering()
 {
    if !require_tools(
        "the churn soak",
        &[
            "nft",
            "iptables",
            "iptables-restore",
            "iptables-save",
            "bpftool",
            "etcd",
        ],
    ) {
        return;
    }
    let seconds: u64 = std::env::var("NODEPORT_SOAK_SECS")
        .ok()
        .map(|s| s.parse().expect("NODEPORT_SOAK_SECS: a number of seconds"))
        .unwrap_or(60);
    let rate: f64 = std::env::var("NODEPORT_SOAK_RATE")
        .ok()
        .map(|s| {
            s.parse()
                .expect("NODEPORT_SOAK_RATE: driver steps per second")
        })
        .unwrap_or(10.0);
    let seed: u64 = std::env::var("NODEPORT_SOAK_SEED")
        .ok()
        .map(|s| s.parse().expect("NODEPORT_SOAK_SEED: a number"))
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("churn soak: {seconds} s at {rate} driver steps/s, seed {seed}");
    let mut cluster = Cluster::start();
    let mut soak = Soak {
        cluster: &cluster,
        rng: Rng(seed),
        services: BTreeMap::new(),
        barrier: Svc {
            name: BARRIER.into(),
            kind: "ClusterIP",
            external_local: false,
            internal_local: false,
            affinity: false,
            family_policy: "SingleStack",
            p2: false,
            dns: false,
            endpoints: vec![Endpoint {
                node: 1,
                pod: 0,
                state: EndpointState::Ready,
            }],
            stored: None,
            slices: BTreeMap::new(),
        },
        next_name: 0,
        writes: 0,
        tally: Tally::default(),
        started: Instant::now(),
    };
    let interval = Duration::from_secs_f64(1.0 / rate);
    let total = Duration::from_secs(seconds);
    let mut n = 0;
    soak.sample_rss();
    while soak.started.elapsed() < total {
        let churn_end = Instant::now() + CHURN;
        let mut next = Instant::now();
        while Instant::now() < churn_end && soak.started.elapsed() < total {
            soak.step();
            next += interval;
            if let Some(wait) = next.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
        }
        n += 1;
        soak.checkpoint(n);
    }
    let elapsed = soak.started.elapsed().as_secs_f64();
    let blind = soak.negative_control();
    let tally = std::mem::take(&mut soak.tally);
    drop(soak);
    let running = cluster.all_running();
    let text = report(&tally, elapsed, seed);
    eprintln!("{text}");
    if let Ok(dir) = std::env::var("NODEPORT_SOAK_REPORT") {
        let dir = PathBuf::from(dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("summary.txt"), &text).unwrap();
        let mut csv = String::from("seconds,process,rss_kib\n");
        for (t, name, kib) in &tally.rss {
            let _ = writeln!(csv, "{t:.1},{name},{kib}");
        }
        std::fs::write(dir.join("rss.csv"), csv).unwrap();
    }
    running.unwrap();
    assert_eq!(blind, None, "the checks are blind");
    assert!(tally.checkpoints > 0, "no checkpoint was reached");
    assert!(
        tally.kernel_traces > 0 && tally.connections > 0,
        "nothing was checked:\n{text}"
    );
    assert!(tally.mismatches.is_empty(), "mismatches:\n{text}");
    assert!(
        tally.failed_connections.is_empty(),
        "failed connections:\n{text}"
    );
    assert!(
        tally.failed_operations.is_empty(),
        "failed operations:\n{text}"
    );
    if seconds > 600 {
        for (name, _, _, percent) in rss_growth(&tally.rss) {
            assert!(
                percent <= 10.0,
                "{name}'s RSS grew {percent:.1} % after the first 5 minutes:\n{text}"
            );
        }
    }
}
