//! nftables versus iptables (and the eBPF dataplane) on the real kernel: first-connection
//! latency through a NodePort and sync time, with 1 to 30,000 Services programmed (the
//! comparison of the Kubernetes blog "NFTables mode for kube-proxy", 2025-02-28).
//!
//! The eBPF mode loads its programs unpinned inside the node's namespace and attaches tc to
//! the node's interfaces (no socket programs: the client is another host); the setup keeps
//! its dataplane until the end, since unpinned programs detach when their owner is dropped
//! (an earlier version dropped it after programming, and its NodePort was then refused by
//! the node's stack).
//!
//! For every size and mode, in throwaway network namespaces:
//!
//! ```text
//!  client 192.0.2.100 ── eth0 192.0.2.10  node (the proxy's rules) ── vpod 10.244.0.1 ── pod 10.244.0.2:8080
//! ```
//!
//! The node holds `n` Services programmed through the backend's applier (the proxy's own
//! sync code, with the kernel interface it uses by default: netlink for nftables,
//! `iptables-restore` for iptables). iptables mode runs twice, once with each variant of the
//! tools: `iptables-legacy` (x_tables, what the Kubernetes blog's iptables figures grew up
//! on) and `iptables-nft` (iptables rules translated into nf_tables, Debian's default); the
//! latter only up to `NODEPORT_BENCH_IPTABLES_NFT_MAX` Services (default 1,000), because its
//! restore is superlinear (a 10,000-Service restore had not finished after 13 minutes).
//! Every Service has a ClusterIP and endpoints (3 by
//! default); the first 2,767 are NodePorts (the default range holds no more) and the rest
//! ClusterIP-only. The measured Service is a NodePort Service whose only endpoint is the
//! pod's server; it sorts last, so it is the last rule iptables walks in `KUBE-SERVICES`'
//! NodePort jump and `KUBE-NODEPORTS` (the worst case; a NodePort packet walks every
//! ClusterIP rule first whatever its position).
//!
//! Measured:
//! * full sync: the first sync into empty tables (render, plan, kernel);
//! * one change: another Service's endpoints changed, the partial sync (median of 5);
//! * resync (printed while programming): a full sync with nothing changed, what the periodic
//!   resync costs;
//! * latency: TCP `connect()` from the client to `192.0.2.10:<NodePort>` until the handshake
//!   completes, a new connection (new conntrack entry, so the first packet walks the rules)
//!   each time. All setups stay up and are measured in interleaved rounds, so that the
//!   machine's load drifts over all of them alike.
//!
//! Run (root): `cargo bench -p nodeport-proxy --bench dataplane_compare` (sizes as arguments,
//! default `1 1000 10000 30000`). `NODEPORT_BENCH_CONNECTIONS` (default 20000),
//! `NODEPORT_BENCH_ENDPOINTS` (default 3), `NODEPORT_BENCH_IPTABLES_NFT_MAX` (default 1000),
//! `NODEPORT_BENCH_CSV` (another output file), `NODEPORT_BENCH_MODES` (a comma-separated subset of
//! `nftables` (flat layout), `nftables-kube-proxy`, `ebpf`, `iptables-legacy`, `iptables-nft`),
//! `NODEPORT_BENCH_KUBE_PROXY_MAX` (default 10,000: kube-proxy's layout above it is skipped),
//! `NODEPORT_BENCH_PHASES` (set: the ebpf mode prints where each full sync's time went, wall
//! and CPU per phase),
//! `NODEPORT_BENCH_THROUGHPUT_MB` (default 512, 0 skips it: after the latency rounds, each
//! setup streams that much from the client to the pod through the NodePort three times and
//! prints the median, generic veth figures). Writes `docs/nft-vs-iptables.csv`, which
//! `docs/plots/nft_vs_iptables.py` turns into `docs/nft-vs-iptables.png`.

mod support;

use std::io::Write as _;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nix::sched::{CloneFlags, setns};
use nodeport_proxy::backend::Backend;
use nodeport_proxy::config::{NftablesLayout, NodeConfig};
use nodeport_proxy::desired::{self, DesiredState, NodeView, StateConfig};
use nodeport_proxy::iptables::apply::{IptablesCommand, Variant};
use nodeport_proxy::model::{EndpointSlice, IpFamily, Service, ServiceName};
use nodeport_proxy::nftables::apply::NftCommand;
use nodeport_proxy::nftables::netlink::NetlinkKernel;
use nodeport_proxy::nodeaddr::NodeFacts;
use nodeport_proxy::objects::Cluster;
use nodeport_testbed::{Netns, veth};
use support::{endpoint, endpoint_ip, ip, service_objects};

const NODE_IP: &str = "192.0.2.10";
const CLIENT_IP: &str = "192.0.2.100";
const POD_IP: &str = "10.244.0.2";
const POD_PORT: u16 = 8080;
/// The measured Service's NodePort: the top of the default range (the others use the rest).
const MEASURED_NODE_PORT: u16 = 32767;
/// Connections per setup per round.
const ROUND: usize = 100;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Service `i` (ClusterIP in 172.16.0.0/12, endpoints in 10.0.0.0/8 that nothing answers on,
/// a NodePort while the default range lasts), or with `i == n - 1` the measured one.
fn service(
    i: usize,
    n: usize,
    endpoints: usize,
    generation: u32,
) -> (ServiceName, Service, ServiceName, EndpointSlice) {
    let cluster_ip = ip(0xAC10_0000 + i as u32);
    if i + 1 == n {
        let pod = endpoint(POD_IP.parse().unwrap(), 1);
        return service_objects(
            "zz-measured",
            "web",
            cluster_ip,
            Some(MEASURED_NODE_PORT),
            POD_PORT,
            vec![pod],
        );
    }
    let eps = (0..endpoints)
        .map(|e| endpoint(endpoint_ip(i, e, generation), 1))
        .collect();
    service_objects(
        &format!("ns{}", i / 100),
        &format!("svc{i}"),
        cluster_ip,
        Some(30000 + i as u16).filter(|p| *p < MEASURED_NODE_PORT && i < 2767),
        8080,
        eps,
    )
}

fn cluster(n: usize, endpoints: usize) -> Cluster {
    let mut c = Cluster::new();
    for i in 0..n {
        let (sk, s, ek, e) = service(i, n, endpoints, 0);
        c.update_service(sk, Some(s));
        c.update_slice(ek, Some(e));
    }
    c.take_changes();
    c
}

fn facts() -> NodeFacts {
    NodeFacts {
        node_ips: vec![NODE_IP.parse().unwrap()],
        local_ips: vec![NODE_IP.parse().unwrap(), "10.244.0.1".parse().unwrap()],
        ..Default::default()
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// nftables mode, flat layout (the default).
    Nftables,
    /// nftables mode, kube-proxy's layout (a chain per Service port and endpoint).
    NftablesKubeProxy,
    /// The eBPF dataplane (tc programs on the node's interfaces, no socket programs: the
    /// client is another host).
    Ebpf,
    /// iptables mode through `iptables-legacy-restore` (x_tables: one blob per table).
    IptablesLegacy,
    /// iptables mode through `iptables-nft-restore` (the machine's default `iptables`).
    IptablesNft,
}

impl Mode {
    fn as_str(self) -> &'static str {
        match self {
            Mode::Nftables => "nftables",
            Mode::NftablesKubeProxy => "nftables-kube-proxy",
            Mode::Ebpf => "ebpf",
            Mode::IptablesLegacy => "iptables-legacy",
            Mode::IptablesNft => "iptables-nft",
        }
    }
}

/// One node with `n` Services programmed, its client and pod, and what its syncs took.
struct Setup {
    mode: Mode,
    services: usize,
    full_sync: Duration,
    one_change: Duration,
    samples: Vec<Duration>,
    client: Netns,
    /// Kept for the whole run: the eBPF dataplane's programs (not pinned here) detach when
    /// it is dropped, unlike rules already in the kernel.
    _backend: Box<dyn Backend>,
    _node: Netns,
    _pod: Netns,
    stop: Arc<AtomicBool>,
    server: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Setup {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop.
        let _ = self.client.enter(|| {
            TcpStream::connect_timeout(
                &SocketAddr::new(NODE_IP.parse().unwrap(), MEASURED_NODE_PORT),
                Duration::from_millis(200),
            )
        });
        if let Some(t) = self.server.take() {
            let _ = t.join();
        }
    }
}

fn topology() -> (Netns, Netns, Netns) {
    let client = Netns::new("cmp-client").unwrap();
    let node = Netns::new("cmp-node").unwrap();
    let pod = Netns::new("cmp-pod").unwrap();
    veth(&client, "eth0", &node, "eth0").unwrap();
    client.add_addr("eth0", &format!("{CLIENT_IP}/24")).unwrap();
    node.add_addr("eth0", &format!("{NODE_IP}/24")).unwrap();
    veth(&node, "vpod", &pod, "eth0").unwrap();
    node.add_addr("vpod", "10.244.0.1/24").unwrap();
    pod.add_addr("eth0", &format!("{POD_IP}/24")).unwrap();
    pod.run(&["ip", "route", "add", "default", "via", "10.244.0.1"])
        .unwrap();
    node.sysctl("net.ipv4.ip_forward", "1").unwrap();
    (client, node, pod)
}

/// A TCP server in the pod that accepts and closes connections until `stop`.
fn serve(pod: &Netns, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    let listener = pod
        .enter(|| TcpListener::bind((POD_IP, POD_PORT)))
        .unwrap()
        .unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            // Read until the client is done (a latency probe resets at once; a throughput
            // stream ends with its FIN), then close.
            if let Ok(mut conn) = conn {
                let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
                let _ = std::io::copy(&mut conn, &mut std::io::sink());
            }
        }
    })
}

/// A backend that runs inside the node's namespace: the eBPF dataplane attaches to the
/// interfaces and reads the addresses of the namespace it is called in, as `nodeport proxy`
/// runs on its node. Each call enters the node's namespace on this thread and comes back.
struct InNamespace {
    node: std::fs::File,
    home: std::fs::File,
    inner: nodeport_proxy::ebpf::dataplane::Dataplane,
}

impl InNamespace {
    fn start(node: &Netns) -> Self {
        let node = std::fs::File::open(Path::new("/run/netns").join(node.name())).unwrap();
        let home = std::fs::File::open("/proc/thread-self/ns/net").unwrap();
        let enter = |ns: &std::fs::File| setns(ns, CloneFlags::CLONE_NEWNET).expect("setns");
        enter(&node);
        let inner = nodeport_proxy::ebpf::dataplane::Dataplane::start(
            nodeport_proxy::ebpf::dataplane::Config {
                render: nodeport_proxy::ebpf::render::RenderConfig {
                    fib_forward: true,
                    // As the NodeConfig the other modes get.
                    cluster_cidrs: vec!["10.244.0.0/16".parse().unwrap()],
                    ..Default::default()
                },
                ..Default::default()
            },
        );
        enter(&home);
        InNamespace {
            node,
            home,
            inner: inner.expect("load the eBPF dataplane"),
        }
    }
}

impl Backend for InNamespace {
    fn mode(&self) -> nodeport_proxy::config::ProxyMode {
        self.inner.mode()
    }

    fn sync(
        &mut self,
        desired: &DesiredState,
        config: &NodeConfig,
        changed: Option<&std::collections::BTreeSet<nodeport_proxy::model::ServicePortName>>,
    ) -> Result<nodeport_proxy::backend::SyncReport, nodeport_proxy::backend::Error> {
        setns(&self.node, CloneFlags::CLONE_NEWNET).expect("setns");
        let r = if std::env::var_os("NODEPORT_BENCH_PHASES").is_some() {
            // The dataplane's own report, with where its time went.
            let r = self.inner.sync(desired, changed);
            if let Ok(r) = &r
                && r.full
            {
                for p in &r.phases {
                    println!(
                        "    ebpf sync phase {:<32} wall {:>8.1} ms, cpu {:>8.1} ms",
                        p.name,
                        p.wall.as_secs_f64() * 1e3,
                        p.cpu.as_secs_f64() * 1e3
                    );
                }
            }
            r.map(|r| nodeport_proxy::backend::SyncReport {
                full: r.full,
                cleanup_failed: false,
                iptables_rules: Vec::new(),
            })
            .map_err(nodeport_proxy::backend::Error::Ebpf)
        } else {
            Backend::sync(&mut self.inner, desired, config, changed)
        };
        setns(&self.home, CloneFlags::CLONE_NEWNET).expect("setns");
        r
    }

    fn needs_full_sync(&self) -> bool {
        Backend::needs_full_sync(&self.inner)
    }

    fn detects_drift(&self) -> bool {
        Backend::detects_drift(&self.inner)
    }
}

fn backend(mode: Mode, node: &Netns) -> Box<dyn Backend> {
    match mode {
        Mode::Ebpf => Box::new(InNamespace::start(node)),
        Mode::Nftables | Mode::NftablesKubeProxy => {
            let nft = NftCommand::in_netns(node.name());
            let kernel = NetlinkKernel::in_namespace(
                &std::path::Path::new("/run/netns").join(node.name()),
                nft,
            )
            .expect("netlink socket in the node namespace");
            Box::new(nodeport_proxy::nftables::apply::Applier::new(kernel))
        }
        Mode::IptablesLegacy | Mode::IptablesNft => {
            let mut tools = IptablesCommand::in_netns(node.name());
            tools.variant = if mode == Mode::IptablesLegacy {
                Variant::Legacy
            } else {
                Variant::Nft
            };
            Box::new(nodeport_proxy::iptables::apply::Applier::new(tools))
        }
    }
}

fn setup(mode: Mode, n: usize, endpoints: usize) -> Setup {
    let (client, node, pod) = topology();
    let stop = Arc::new(AtomicBool::new(false));
    let server = serve(&pod, stop.clone());
    let mut c = cluster(n, endpoints);
    let state = StateConfig {
        families: vec![IpFamily::V4],
        // Each mode's default: the Node's IP (a set lookup) for nftables, every local
        // address (`-m addrtype --dst-type LOCAL`) for iptables.
        nodeport_addresses: match mode {
            Mode::Nftables | Mode::NftablesKubeProxy | Mode::Ebpf => "primary".parse().unwrap(),
            Mode::IptablesLegacy | Mode::IptablesNft => "0.0.0.0/0".parse().unwrap(),
        },
    };
    let view = NodeView::named("node-0");
    let mut d: DesiredState = desired::build(&c, view, &facts(), &state);
    let config = NodeConfig {
        cluster_cidrs: vec!["10.244.0.0/16".parse().unwrap()],
        nftables_layout: if mode == Mode::NftablesKubeProxy {
            NftablesLayout::KubeProxy
        } else {
            NftablesLayout::Flat
        },
        ..Default::default()
    };
    let mut b = backend(mode, &node);
    let t = Instant::now();
    assert!(b.sync(&d, &config, None).expect("full sync").full);
    let full_sync = t.elapsed();

    // One change: Service 0's endpoints move. With `n > 1` that is another Service than the
    // measured one; alone, it is the measured one, its endpoint put back by the last (even)
    // generation.
    let mut changes = Vec::new();
    for generation in 1..=6u32 {
        let (_, _, ek, mut e) = service(0, n, endpoints, generation % 2);
        if n == 1 {
            e.endpoints[0].ip = if generation % 2 == 1 {
                "10.244.0.3".parse().unwrap()
            } else {
                POD_IP.parse().unwrap()
            };
        }
        c.update_slice(ek, Some(e));
        let ch = c.take_changes();
        let touched = d.refresh_services(&c, view, &ch.services);
        let t = Instant::now();
        let r = b.sync(&d, &config, Some(&touched)).expect("partial sync");
        let took = t.elapsed();
        assert!(!r.full, "a partial sync");
        if generation > 1 {
            changes.push(took);
        }
    }
    changes.sort();
    let one_change = changes[changes.len() / 2];
    // The periodic resync: a full sync of what the kernel already holds.
    let t = Instant::now();
    assert!(b.sync(&d, &config, None).expect("resync").full);
    let resync = t.elapsed();
    println!(
        "  {:<15} {:>6} Services: full sync {:>8.3} s, one change {:>8.3} ms, resync {:>8.3} s",
        mode.as_str(),
        n,
        full_sync.as_secs_f64(),
        one_change.as_secs_f64() * 1e3,
        resync.as_secs_f64()
    );
    let _ = std::io::stdout().flush();
    let s = Setup {
        mode,
        services: n,
        full_sync,
        one_change,
        samples: Vec::new(),
        client,
        _backend: b,
        _node: node,
        _pod: pod,
        stop,
        server: Some(server),
    };
    // Warm up: neighbour entries, route caches.
    s.connect(50);
    s
}

impl Setup {
    /// `count` new TCP connections to the NodePort; handshake times.
    fn connect(&self, count: usize) -> Vec<Duration> {
        let to = SocketAddr::new(NODE_IP.parse().unwrap(), MEASURED_NODE_PORT);
        self.client
            .enter(|| {
                (0..count)
                    .map(|_| {
                        let t = Instant::now();
                        let s = TcpStream::connect_timeout(&to, Duration::from_secs(2))
                            .unwrap_or_else(|e| panic!("connect to {to}: {e}"));
                        let took = t.elapsed();
                        // Close with a reset: no TIME_WAIT piles up in the client.
                        let _ = nix::sys::socket::setsockopt(
                            &s,
                            nix::sys::socket::sockopt::Linger,
                            &nix::libc::linger {
                                l_onoff: 1,
                                l_linger: 0,
                            },
                        );
                        drop(s);
                        took
                    })
                    .collect()
            })
            .unwrap()
    }
}

impl Setup {
    /// Established-connection throughput through the NodePort: `bytes` written by the
    /// client, until the pod has read them all and closed; Gbit/s.
    fn throughput(&self, bytes: usize) -> f64 {
        let to = SocketAddr::new(NODE_IP.parse().unwrap(), MEASURED_NODE_PORT);
        self.client
            .enter(|| {
                use std::io::{Read as _, Write as _};
                let chunk = vec![0x5au8; 64 * 1024];
                let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(2))
                    .unwrap_or_else(|e| panic!("connect to {to}: {e}"));
                let t = Instant::now();
                let mut left = bytes;
                while left > 0 {
                    let n = left.min(chunk.len());
                    s.write_all(&chunk[..n]).expect("write to the pod");
                    left -= n;
                }
                s.shutdown(std::net::Shutdown::Write).unwrap();
                let mut rest = Vec::new();
                let _ = s.read_to_end(&mut rest);
                bytes as f64 * 8.0 / t.elapsed().as_secs_f64() / 1e9
            })
            .unwrap()
    }
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 * p) as usize).min(sorted.len() - 1);
    sorted[i].as_secs_f64() * 1e6
}

fn main() {
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let sizes = if sizes.is_empty() {
        vec![1, 1000, 10_000, 30_000]
    } else {
        sizes
    };
    let connections = env_usize("NODEPORT_BENCH_CONNECTIONS", 20_000);
    let endpoints = env_usize("NODEPORT_BENCH_ENDPOINTS", 3);
    // iptables-nft-restore is superlinear in the number of chains: 3 s at 1,000 Services, a
    // 10,000-Service restore was stopped after 13 minutes. Larger sizes only with this raised.
    let nft_backend_max = env_usize("NODEPORT_BENCH_IPTABLES_NFT_MAX", 1000);
    // kube-proxy's nftables layout: a full sync at 30,000 Services takes minutes.
    let kube_proxy_max = env_usize("NODEPORT_BENCH_KUBE_PROXY_MAX", 10_000);
    let modes: Vec<String> = std::env::var("NODEPORT_BENCH_MODES")
        .unwrap_or_else(|_| "nftables,nftables-kube-proxy,ebpf,iptables-legacy,iptables-nft".into())
        .split(',')
        .map(str::to_owned)
        .collect();
    let started = Instant::now();
    println!(
        "nftables vs iptables: {sizes:?} Services x {endpoints} endpoints, {connections} connections each"
    );
    println!("programming (each setup in its own namespaces):");
    let mut setups = Vec::new();
    for &n in &sizes {
        for mode in [
            Mode::Nftables,
            Mode::NftablesKubeProxy,
            Mode::Ebpf,
            Mode::IptablesLegacy,
            Mode::IptablesNft,
        ] {
            if !modes.iter().any(|m| m == mode.as_str()) {
                continue;
            }
            if mode == Mode::NftablesKubeProxy && n > kube_proxy_max {
                println!(
                    "  {:<15} {n:>6} Services: skipped (above NODEPORT_BENCH_KUBE_PROXY_MAX={kube_proxy_max})",
                    mode.as_str()
                );
                continue;
            }
            if mode == Mode::IptablesNft && n > nft_backend_max {
                println!(
                    "  {:<15} {n:>6} Services: skipped (above NODEPORT_BENCH_IPTABLES_NFT_MAX={nft_backend_max})",
                    mode.as_str()
                );
                continue;
            }
            setups.push(setup(mode, n, endpoints));
        }
    }
    let programmed = started.elapsed();
    println!("measuring in interleaved rounds of {ROUND} connections:");
    let rounds = connections.div_ceil(ROUND);
    for round in 0..rounds {
        for s in setups.iter_mut() {
            let more = s.connect(ROUND);
            s.samples.extend(more);
        }
        if (round + 1) % 5 == 0 {
            println!("  round {}/{rounds}", round + 1);
        }
    }
    let total = started.elapsed();
    // Throughput: generic veth figures (one CPU's worth of softirq per direction), the
    // median of three streams per setup.
    let throughput_mb = env_usize("NODEPORT_BENCH_THROUGHPUT_MB", 512);
    if throughput_mb > 0 {
        println!();
        println!(
            "| mode | Services | throughput Gbit/s (median of 3 x {throughput_mb} MiB, veth) |"
        );
        println!("| --- | --- | --- |");
        for s in &setups {
            let mut runs: Vec<f64> = (0..3).map(|_| s.throughput(throughput_mb << 20)).collect();
            runs.sort_by(f64::total_cmp);
            println!("| {} | {} | {:.2} |", s.mode.as_str(), s.services, runs[1]);
        }
    }

    let csv_path = std::env::var("NODEPORT_BENCH_CSV").unwrap_or_else(|_| {
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../docs/nft-vs-iptables.csv"
        )
        .to_string()
    });
    let mut csv = String::from(
        "mode,services,endpoints_per_service,connections,p01_us,p50_us,p90_us,p99_us,full_sync_s,one_change_ms\n",
    );
    println!();
    println!("| mode | Services | p01 µs | p50 µs | p90 µs | p99 µs | full sync | one change |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    let mut by_mode: std::collections::BTreeMap<&str, Vec<(usize, f64)>> = Default::default();
    for s in &mut setups {
        s.samples.sort();
        let (p01, p50, p90, p99) = (
            percentile(&s.samples, 0.01),
            percentile(&s.samples, 0.50),
            percentile(&s.samples, 0.90),
            percentile(&s.samples, 0.99),
        );
        by_mode
            .entry(s.mode.as_str())
            .or_default()
            .push((s.services, p50));
        println!(
            "| {} | {} | {p01:.0} | {p50:.0} | {p90:.0} | {p99:.0} | {:.2} s | {:.2} ms |",
            s.mode.as_str(),
            s.services,
            s.full_sync.as_secs_f64(),
            s.one_change.as_secs_f64() * 1e3
        );
        csv.push_str(&format!(
            "{},{},{endpoints},{},{p01:.1},{p50:.1},{p90:.1},{p99:.1},{:.3},{:.3}\n",
            s.mode.as_str(),
            s.services,
            s.samples.len(),
            s.full_sync.as_secs_f64(),
            s.one_change.as_secs_f64() * 1e3
        ));
    }
    for (mode, points) in &by_mode {
        if let (Some(first), Some(last)) = (points.first(), points.last()) {
            println!(
                "{mode}: p50 at {} Services is {:.2}x the p50 at {}",
                last.0,
                last.1 / first.1,
                first.0
            );
        }
    }
    std::fs::write(&csv_path, csv).expect("writing the CSV");
    println!(
        "programming {:.0} s, measuring {:.0} s, whole run {:.0} s; figures in {csv_path}",
        programmed.as_secs_f64(),
        (total - programmed).as_secs_f64(),
        total.as_secs_f64()
    );
}
