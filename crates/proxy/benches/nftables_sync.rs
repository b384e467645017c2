//! nftables sync benchmark on the real kernel, in throwaway network namespaces.
//!
//! For 1,000 / 10,000 / 30,000 Services × 10 endpoints it measures, in one run:
//! * the proxy's full sync (render + transaction + kernel), the first sync on an empty table;
//! * the raw `nft -f` load of exactly the same rules (the physical reference);
//! * the same Services in kube-proxy's inline `numgen random mod N vmap { ... }` form;
//! * at 10,000 (and 30,000): one Service's endpoints changed, from the tracker update (what a
//!   watch event does) to the rules being in the kernel, median of several changes.
//!
//! * the flat layout (`--nftables-layout flat`) side by side: raw `nft -f` of its rules, the
//!   full sync, one endpoint change (median of 20), one new Service, a partial sync with
//!   nothing changed and the periodic full resync.
//!
//! Run: `cargo bench -p nodeport-proxy --bench nftables_sync` (root; `-- 1000 10000` to choose
//! sizes; `NODEPORT_BENCH_INLINE=0` skips the slow inline-vmap loads, `NODEPORT_BENCH_NFT=0`
//! the syncs through the `nft` backend, `NODEPORT_BENCH_KUBE_PROXY=0` kube-proxy's layout).

mod support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use nodeport_proxy::config::{EndpointChoice, NodeConfig};
use nodeport_proxy::desired::{self, DesiredState, NodeView};
use nodeport_proxy::model::{IpFamily, Protocol, ServicePortName};
use nodeport_proxy::nftables::apply::{Applier, Kernel};
use nodeport_proxy::nftables::netlink::NetlinkKernel;
use nodeport_proxy::nftables::ruleset::create_all;
use nodeport_proxy::objects::Cluster;
use nodeport_testbed::Netns;
use support::{
    ENDPOINTS, cluster, facts, ip, netlink_in, nft_in, node_config, service, state_config,
};

fn secs(d: Duration) -> String {
    format!("{:.3} s", d.as_secs_f64())
}

/// Loads `text` with `nft -f` into a fresh namespace; returns the wall time of nft alone.
fn raw_load(text: &str) -> Duration {
    let ns = Netns::new("bench-raw").unwrap();
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), text).unwrap();
    let t = Instant::now();
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", ns.name(), "nft", "-f"])
        .arg(file.path())
        .output()
        .unwrap();
    let took = t.elapsed();
    assert!(
        out.status.success(),
        "nft -f failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    took
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap_or(0)
}

/// The flat layout at `n` Services: raw load, full sync, changes, resync.
fn bench_flat(n: usize) {
    println!("-- flat layout --");
    let mut c = cluster(n);
    let mut d: DesiredState =
        desired::build(&c, NodeView::named("node-0"), &facts(), &state_config());
    let config = support::flat_config();
    let t = Instant::now();
    let text = create_all(&nodeport_proxy::nftables::render(&d, &config)).to_nft();
    let render = t.elapsed();
    let raw = raw_load(&text);
    println!(
        "flat: render + text {}   raw nft -f of the same rules: {}   ({} commands)",
        secs(render),
        secs(raw),
        text.lines().count()
    );
    drop(text);
    let ns = Netns::new("bench-flat").unwrap();
    let mut applier = Applier::new(Timed {
        inner: netlink_in(&ns),
        applies: Vec::new(),
    });
    let t = Instant::now();
    assert!(applier.sync(&d, &config, None).expect("full sync").full);
    let full = t.elapsed();
    assert_eq!(applier.kernel().inner.fallbacks(), 0, "all over netlink");
    print!("flat: full sync, netlink: {}", secs(full));
    if let Some((encode, kernel)) = applier.kernel().inner.last_timing() {
        print!(
            "   (encoding {}, kernel {}, render and plan {})",
            secs(encode),
            secs(kernel),
            secs(full.saturating_sub(encode + kernel))
        );
    }
    println!();
    applier.kernel_mut().applies.clear();
    one_change(n, &mut c, &mut d, &config, &mut applier, "flat", 20);
    let kernel_ms: Vec<f64> = applier
        .kernel()
        .applies
        .iter()
        .map(|d| d.as_secs_f64() * 1e3)
        .collect();
    let mut sorted = kernel_ms.clone();
    sorted.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!(
        "  of which the kernel transaction (send to acknowledgement): median {:.3} ms",
        sorted[sorted.len() / 2]
    );
    // One new Service: the tracker update of its Service and slice, to the kernel.
    let mut samples = Vec::new();
    for k in 0..5 {
        let (sk, s, ek, e) = service(n + k, 0);
        let t = Instant::now();
        c.update_service(sk, Some(s));
        c.update_slice(ek, Some(e));
        let changes = c.take_changes();
        let changed = d.refresh_services(&c, NodeView::named("node-0"), &changes.services);
        let r = applier
            .sync(&d, &config, Some(&changed))
            .expect("new Service");
        assert!(!r.full);
        samples.push(t.elapsed().as_secs_f64() * 1e3);
    }
    samples.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!(
        "flat: one new Service (event -> rules in kernel): median of 5 {:.2} ms",
        samples[2]
    );
    let mut samples = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        applier.sync(&d, &config, Some(&BTreeSet::new())).unwrap();
        samples.push(t.elapsed().as_secs_f64() * 1e3);
    }
    samples.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!(
        "flat: partial sync with nothing changed: median of 5 {:.3} ms",
        samples[2]
    );
    applier.request_full_sync();
    let t = Instant::now();
    assert!(
        applier
            .sync(&d, &config, Some(&BTreeSet::new()))
            .unwrap()
            .full
    );
    let resync = t.elapsed();
    print!(
        "flat: periodic full resync (repairs any drift) on the loaded table: {}",
        secs(resync)
    );
    if let Some((encode, kernel)) = applier.kernel().inner.last_timing() {
        print!(
            "   (encoding {}, kernel {}, render and plan {})",
            secs(encode),
            secs(kernel),
            secs(resync.saturating_sub(encode + kernel))
        );
    }
    println!();
    println!(
        "bench process RSS with this state: {} MiB",
        rss_kib() / 1024
    );
    affinity_costs(&mut c, &mut d, &config, &mut applier);
    drop(applier);
    drop(ns);
    // What the element comments cost: the same rules without them.
    let bare = NodeConfig {
        flat_comments: false,
        ..config
    };
    let text = create_all(&nodeport_proxy::nftables::render(&d, &bare)).to_nft();
    let raw_bare = raw_load(&text);
    drop(text);
    let ns = Netns::new("bench-flat-bare").unwrap();
    let mut applier = Applier::new(netlink_in(&ns));
    let t = Instant::now();
    assert!(applier.sync(&d, &bare, None).expect("full sync").full);
    println!(
        "flat without element comments: raw nft -f {}   full sync, netlink {}",
        secs(raw_bare),
        secs(t.elapsed())
    );
}

fn bench_size(n: usize, inline: bool) {
    println!("== {n} Services x {ENDPOINTS} endpoints ==");
    bench_flat(n);
    if std::env::var("NODEPORT_BENCH_KUBE_PROXY").as_deref() == Ok("0") {
        return;
    }
    println!("-- kube-proxy layout --");
    let mut c = cluster(n);
    let t = Instant::now();
    let mut d: DesiredState =
        desired::build(&c, NodeView::named("node-0"), &facts(), &state_config());
    let build = t.elapsed();
    let config = node_config(EndpointChoice::Cascade);
    let t = Instant::now();
    let ruleset = nodeport_proxy::nftables::render(&d, &config);
    let text = create_all(&ruleset).to_nft();
    let render = t.elapsed();
    let lines = text.lines().count();
    drop(ruleset);
    println!(
        "desired state: {}   render + transaction text: {}   ({lines} commands)",
        secs(build),
        secs(render)
    );

    // The raw load of the same rules: the physical reference.
    let raw = raw_load(&text);
    drop(text);
    println!("raw nft -f of the rules: {}", secs(raw));

    // The proxy's full sync into an empty table, through `nft -f` (when asked) and netlink.
    if std::env::var("NODEPORT_BENCH_NFT").as_deref() != Ok("0") {
        let ns = Netns::new("bench-sync-nft").unwrap();
        let mut applier = Applier::new(nft_in(&ns));
        let t = Instant::now();
        assert!(applier.sync(&d, &config, None).expect("full sync").full);
        let full = t.elapsed();
        println!(
            "full sync, nft backend: {}   ratio to raw nft -f {:.2}",
            secs(full),
            full.as_secs_f64() / raw.as_secs_f64()
        );
        if n >= 10_000 {
            one_change(n, &mut c, &mut d, &config, &mut applier, "nft", 9);
        }
    }
    let ns = Netns::new("bench-sync").unwrap();
    let kernel = netlink_in(&ns);
    let mut applier = Applier::new(Timed {
        inner: kernel,
        applies: Vec::new(),
    });
    let t = Instant::now();
    let r = applier.sync(&d, &config, None).expect("full sync");
    let full = t.elapsed();
    assert!(r.full);
    assert_eq!(
        applier.kernel().inner.fallbacks(),
        0,
        "everything went over netlink"
    );
    println!(
        "full sync, netlink backend: {}   ratio to raw nft -f {:.2}",
        secs(full),
        full.as_secs_f64() / raw.as_secs_f64()
    );
    if let Some((encode, kernel)) = applier.kernel().inner.last_timing() {
        println!(
            "  of which: netlink encoding {}   kernel (send to acknowledgement) {}   the rest (render, plan) {}",
            secs(encode),
            secs(kernel),
            secs(full.saturating_sub(encode + kernel))
        );
    }

    // The inline form is superlinear: 3 minutes at 10,000 here; not tried beyond.
    if inline && n <= 10_000 {
        let vmap = create_all(&nodeport_proxy::nftables::render(
            &d,
            &node_config(EndpointChoice::InlineVmap),
        ))
        .to_nft();
        let raw_vmap = raw_load(&vmap);
        println!(
            "raw nft -f, kube-proxy's inline numgen vmap form: {}",
            secs(raw_vmap)
        );
    }

    commit_costs(n, &mut applier.kernel_mut().inner);

    if n >= 10_000 {
        applier.kernel_mut().applies.clear();
        one_change(n, &mut c, &mut d, &config, &mut applier, "netlink", 9);
        let applies: Vec<String> = applier
            .kernel()
            .applies
            .iter()
            .map(|d| format!("{:.1}", d.as_secs_f64() * 1e3))
            .collect();
        println!(
            "  kernel transactions of those changes (ms; main, then stale-chain deletion): {}",
            applies.join(" ")
        );
        // No change at all: the periodic partial sync.
        let t = Instant::now();
        applier.sync(&d, &config, Some(&BTreeSet::new())).unwrap();
        println!(
            "sync with nothing changed: {:.1} ms",
            t.elapsed().as_secs_f64() * 1e3
        );
    }
    println!(
        "bench process RSS with this state: {} MiB",
        rss_kib() / 1024
    );
    let _ = applier.kernel_mut().list(IpFamily::V4);
}

/// Median wall time of `f` over `reps` runs.
fn median_ms(reps: usize, mut f: impl FnMut() -> Duration) -> f64 {
    let mut v: Vec<f64> = (0..reps).map(|_| f().as_secs_f64() * 1e3).collect();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// What one commit costs on a table of this size, by kind of operation: the kernel
/// re-validates the whole table (every chain reachable from a base chain) when a transaction
/// adds a rule with a verdict or expression that has a `validate` hook, or a map element that
/// jumps; other transactions should cost the same at any table size.
fn commit_costs(n: usize, kernel: &mut NetlinkKernel) {
    use nodeport_proxy::nftables::ruleset::{
        AddrMatch, ElemKey, Element, Expr, Op, Rule, Transaction, Verdict,
    };
    let f = IpFamily::V4;
    let probe = ip(0xC633_6401); // 198.51.100.1
    let mut run = |ops: Vec<Op>| {
        let mut tx = Transaction::default();
        for op in ops {
            tx.push(f, op);
        }
        let t = Instant::now();
        kernel.apply(&tx).expect("probe transaction");
        t.elapsed()
    };
    let service_chain = format!(
        "service-{}",
        nodeport_proxy::names::nft_service_port_base(&ServicePortName::new(
            "ns0",
            "svc0",
            "http",
            Protocol::Tcp
        ))
    );
    let elem = |set: &'static str, key, value| Element {
        set,
        key,
        value,
        data: None,
        comment: None,
    };
    let addr_key = ElemKey::Addr(probe);
    let svc_key = ElemKey::AddrProtoPort(probe, Protocol::Tcp, 80);
    let mut rows = Vec::new();
    rows.push((
        "add + delete an element of cluster-ips (plain set)",
        median_ms(5, || {
            run(vec![Op::AddElement(elem("cluster-ips", addr_key, None))])
                + run(vec![Op::DeleteElement("cluster-ips", addr_key)])
        }) / 2.0,
    ));
    run(vec![Op::AddChain("bench-probe".into(), None)]);
    rows.push((
        "add a rule without verdict (ip daddr X) to an unreferenced chain",
        median_ms(5, || {
            let t = run(vec![Op::AddRule(
                "bench-probe".into(),
                Rule::new(vec![Expr::Daddr {
                    negate: false,
                    value: AddrMatch::Addr(probe),
                }]),
            )]);
            run(vec![Op::FlushChain("bench-probe".into())]);
            t
        }),
    ));
    rows.push((
        "flush a chain (delete its rules)",
        median_ms(5, || {
            run(vec![Op::AddRule(
                "bench-probe".into(),
                Rule::new(vec![Expr::Daddr {
                    negate: false,
                    value: AddrMatch::Addr(probe),
                }]),
            )]);
            run(vec![Op::FlushChain("bench-probe".into())])
        }),
    ));
    rows.push((
        "add a rule `accept` to an unreferenced chain",
        median_ms(5, || {
            let t = run(vec![Op::AddRule(
                "bench-probe".into(),
                Rule::new(vec![Expr::Verdict(Verdict::Accept)]),
            )]);
            run(vec![Op::FlushChain("bench-probe".into())]);
            t
        }),
    ));
    rows.push((
        "add a service-ips element `goto service-...`",
        median_ms(5, || {
            let t = run(vec![Op::AddElement(elem(
                "service-ips",
                svc_key,
                Some(Verdict::Goto(service_chain.clone())),
            ))]);
            run(vec![Op::DeleteElement("service-ips", svc_key)]);
            t
        }),
    ));
    rows.push((
        "delete a service-ips element",
        median_ms(5, || {
            run(vec![Op::AddElement(elem(
                "service-ips",
                svc_key,
                Some(Verdict::Goto(service_chain.clone())),
            ))]);
            run(vec![Op::DeleteElement("service-ips", svc_key)])
        }),
    ));
    rows.push((
        "add + delete an empty chain",
        median_ms(5, || {
            run(vec![Op::AddChain("bench-probe2".into(), None)])
                + run(vec![Op::DeleteChain("bench-probe2".into())])
        }) / 2.0,
    ));
    run(vec![Op::DeleteChain("bench-probe".into())]);
    println!("commit cost by kind of transaction at {n} Services (median of 5):");
    for (what, ms) in rows {
        println!("  {what}: {ms:.2} ms");
    }
}

/// A kernel that records how long its transactions take.
struct Timed<K> {
    inner: K,
    applies: Vec<Duration>,
}

impl<K: Kernel> Kernel for Timed<K> {
    fn apply(
        &mut self,
        tx: &nodeport_proxy::nftables::ruleset::Transaction,
    ) -> Result<(), nodeport_proxy::nftables::apply::KernelError> {
        let t = Instant::now();
        let r = self.inner.apply(tx);
        self.applies.push(t.elapsed());
        r
    }

    /// The full sync's streamed transaction goes straight to the netlink kernel (its own
    /// timing is `last_timing`); only whole transactions are counted in `applies`.
    fn batch(&mut self) -> Box<dyn nodeport_proxy::nftables::apply::TransactionSink + '_> {
        self.inner.batch()
    }

    fn list(
        &mut self,
        family: IpFamily,
    ) -> Result<
        Option<nodeport_proxy::nftables::apply::Existing>,
        nodeport_proxy::nftables::apply::KernelError,
    > {
        self.inner.list(family)
    }

    fn affinity_entries(
        &mut self,
        family: IpFamily,
        map: &str,
        key: nodeport_proxy::nftables::ruleset::KeyType,
    ) -> Result<
        Vec<(
            nodeport_proxy::nftables::ruleset::ElemKey,
            std::net::SocketAddr,
        )>,
        nodeport_proxy::nftables::apply::KernelError,
    > {
        self.inner.affinity_entries(family, map, key)
    }
}

/// Clients the affinity bench records for one Service.
const AFFINITY_CLIENTS: u32 = 100_000;

/// Session affinity in the flat layout on the loaded table: the first affinity Service (its
/// timeout's sets, maps and rules are new), then, with [`AFFINITY_CLIENTS`] clients recorded
/// for it, one of its endpoints removed (the applier reads the map back and deletes that
/// endpoint's entries), against the same change on a Service without affinity.
fn affinity_costs<K: Kernel>(
    c: &mut Cluster,
    d: &mut DesiredState,
    config: &NodeConfig,
    applier: &mut Applier<K>,
) {
    use nodeport_proxy::nftables::names::AffinityNames;
    use nodeport_proxy::nftables::ruleset::{ElemKey, Element, Op, Transaction};
    let sync = |c: &mut Cluster, d: &mut DesiredState, applier: &mut Applier<K>| {
        let changes = c.take_changes();
        let changed = d.refresh_services(c, NodeView::named("node-0"), &changes.services);
        let t = Instant::now();
        let r = applier
            .sync(d, config, Some(&changed))
            .expect("partial sync");
        (t.elapsed(), r)
    };
    let (sk, mut s, ek, e) = service(0, 0);
    let port = std::sync::Arc::make_mut(&mut s.ports[0]);
    port.session_affinity_seconds = Some(10_800);
    let (cluster_ip, svc_port) = (port.cluster_ips[0], port.port);
    c.update_service(sk, Some(s));
    let (first, r) = sync(c, d, applier);
    println!(
        "flat: the first Service with session affinity (new timeout: its sets, maps and rules): {:.2} ms{}",
        first.as_secs_f64() * 1e3,
        if r.full { " (full sync)" } else { "" }
    );
    // Clients recorded as the kernel would, each sent to one of the ten endpoints.
    let map = AffinityNames::new(10_800).dst_map;
    let targets: Vec<std::net::SocketAddr> = e
        .endpoints
        .iter()
        .map(|ep| std::net::SocketAddr::new(ep.ip, e.ports[0].port))
        .collect();
    let mut tx = Transaction::default();
    for k in 0..AFFINITY_CLIENTS {
        tx.push(
            IpFamily::V4,
            Op::AddElement(Element {
                set: map,
                key: ElemKey::AddrAddrProtoPort(
                    ip(0x6400_0000 + k),
                    cluster_ip,
                    Protocol::Tcp,
                    svc_port,
                ),
                value: None,
                data: Some(targets[k as usize % targets.len()]),
                comment: None,
            }),
        );
    }
    applier.kernel_mut().apply(&tx).expect("clients recorded");
    let mut fewer = e.clone();
    // The last endpoint gone.
    fewer.endpoints = fewer.endpoints[..fewer.endpoints.len() - 1].into();
    c.update_slice(ek, Some(fewer));
    let (took, r) = sync(c, d, applier);
    println!(
        "flat: one endpoint of it removed with {AFFINITY_CLIENTS} clients recorded: {:.2} ms ({} entries deleted)",
        took.as_secs_f64() * 1e3,
        r.affinity_deleted
    );
    let (_, _, ek, mut e) = service(1, 0);
    e.endpoints = e.endpoints[..e.endpoints.len() - 1].into();
    c.update_slice(ek, Some(e));
    let (took, _) = sync(c, d, applier);
    println!(
        "flat: the same change on a Service without affinity: {:.2} ms",
        took.as_secs_f64() * 1e3
    );
}

/// One Service's endpoints replaced, from the tracker update (what a watch event does) to
/// the rules being in the kernel.
fn one_change<K: Kernel>(
    n: usize,
    c: &mut Cluster,
    d: &mut DesiredState,
    config: &NodeConfig,
    applier: &mut Applier<K>,
    backend: &str,
    reps: u32,
) {
    let mut samples = Vec::new();
    for k in 0..reps {
        let i = (k as usize * 7919) % n;
        let (_, _, ek, e) = service(i, k + 1 + if backend == "nft" { 20 } else { 0 });
        let t = Instant::now();
        c.update_slice(ek, Some(e));
        let changes = c.take_changes();
        let changed = d.refresh_services(c, NodeView::named("node-0"), &changes.services);
        let r = applier
            .sync(d, config, Some(&changed))
            .expect("partial sync");
        samples.push(t.elapsed());
        assert!(!r.full);
    }
    samples.sort();
    println!(
        "one Service changed (event -> rules in kernel), {backend}: median of {reps} {:.2} ms, min {:.2} ms, max {:.2} ms",
        samples[samples.len() / 2].as_secs_f64() * 1e3,
        samples[0].as_secs_f64() * 1e3,
        samples[samples.len() - 1].as_secs_f64() * 1e3
    );
}

fn main() {
    if !nodeport_testbed::require_privileged("nftables_sync bench") {
        return;
    }
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let sizes = if sizes.is_empty() {
        vec![1_000, 10_000, 30_000]
    } else {
        sizes
    };
    let inline = std::env::var("NODEPORT_BENCH_INLINE").as_deref() != Ok("0");
    println!(
        "nft: {}",
        String::from_utf8_lossy(
            &std::process::Command::new("nft")
                .arg("--version")
                .output()
                .unwrap()
                .stdout
        )
        .trim()
    );
    for n in sizes {
        bench_size(n, inline);
    }
}
