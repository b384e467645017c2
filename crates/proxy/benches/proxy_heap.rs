//! Where the proxy's memory goes: the live heap (bytes allocated and not yet freed, counted by
//! the global allocator) after each stage of the nftables pipeline, and the peak during the
//! full sync, for N Services × 10 endpoints.
//!
//! The stages are the ones `nodeport proxy` keeps between syncs: the trackers' objects, the
//! desired state, and the applier's record of what is in the kernel. The kernel is real (a
//! netlink batch into a throwaway network namespace), so the full sync's peak includes the
//! encoded batch. The difference between this live heap and the process's RSS
//! (`--bench proxy_rss`) is the allocator's retention and the binary itself.
//!
//! Run (root): `cargo bench -p nodeport-proxy --bench proxy_heap -- [services]` (default
//! 10,000); the flat layout, or kube-proxy's with `NODEPORT_BENCH_LAYOUT=kube-proxy`.

mod support;

use nodeport_proxy::config::EndpointChoice;
use nodeport_proxy::desired::{self, NodeView};
use nodeport_proxy::nftables::apply::Applier;
use nodeport_testbed::Netns;
use peak_alloc::PeakAlloc;
use support::{
    ENDPOINTS, cluster, facts, flat_config, netlink_in, node_config, service, state_config,
};

#[global_allocator]
static HEAP: PeakAlloc = PeakAlloc;

fn mib(bytes: usize) -> String {
    format!("{:.1} MiB", bytes as f64 / (1 << 20) as f64)
}

fn main() {
    if !nodeport_testbed::require_privileged("proxy_heap bench") {
        return;
    }
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(10_000);
    let ns = Netns::new("bench-heap").unwrap();
    let mut applier = Applier::new(netlink_in(&ns));
    let start = HEAP.current_usage();

    let mut c = cluster(n);
    let objects = HEAP.current_usage();
    let mut d = desired::build(&c, NodeView::named("node-0"), &facts(), &state_config());
    let state = HEAP.current_usage();

    // The flat layout (the default) unless NODEPORT_BENCH_LAYOUT=kube-proxy.
    let config = match std::env::var("NODEPORT_BENCH_LAYOUT").as_deref() {
        Ok("kube-proxy") => node_config(EndpointChoice::Cascade),
        _ => flat_config(),
    };
    HEAP.reset_peak_usage();
    assert!(applier.sync(&d, &config, None).expect("full sync").full);
    let peak = HEAP.peak_usage();
    let applied = HEAP.current_usage();

    // One Service's endpoints change, as a watch event would make them.
    HEAP.reset_peak_usage();
    let (_, _, ek, e) = service(n / 2, 1);
    c.update_slice(ek, Some(e));
    let changes = c.take_changes();
    let changed = d.refresh_services(&c, NodeView::named("node-0"), &changes.services);
    assert!(!applier.sync(&d, &config, Some(&changed)).unwrap().full);
    let change_peak = HEAP.peak_usage();
    let after_change = HEAP.current_usage();

    println!("## Live heap of the nftables pipeline, {n} Services x {ENDPOINTS} endpoints");
    println!();
    println!("| what | live heap | per Service |");
    println!("| --- | --- | --- |");
    let row = |what: &str, bytes: usize| {
        println!("| {what} | {} | {} B |", mib(bytes), bytes / n.max(1));
    };
    row("objects (trackers)", objects - start);
    row("desired state", state - objects);
    row("applied record (after the full sync)", applied - state);
    row("all kept state", applied - start);
    row("peak during the full sync", peak - start);
    row("after one change", after_change - start);
    row("peak during one change", change_peak - start);
    drop(applier);
    drop(ns);
}
