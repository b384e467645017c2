//! The applier's own work in a full sync, without a kernel: rendering every Service port,
//! recording it and encoding the netlink batch, in CPU time of this process (the machine is
//! shared; CPU time is what other load does not inflate). The kernel's share is measured by
//! `nftables_sync` on a real kernel. Then the user-space part of the small syncs, too short for
//! CPU time's 10 ms ticks, in wall time (median of many): a partial sync with nothing changed,
//! and one Service's endpoints changed from the tracker update to the planned transaction.
//!
//! Run: `cargo bench -p nodeport-proxy --bench nftables_plan -- [services ...]` (default
//! 10,000 and 100,000; 10 endpoints each; the flat layout, or kube-proxy's with
//! `NODEPORT_BENCH_LAYOUT=kube-proxy`). No privileges needed.

mod support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use nodeport_proxy::config::EndpointChoice;
use nodeport_proxy::desired::{self, NodeView};
use nodeport_proxy::model::IpFamily;
use nodeport_proxy::nftables::apply::{Applier, Existing, Kernel, KernelError, TransactionSink};
use nodeport_proxy::nftables::ruleset::Transaction;
use support::{cluster, facts, flat_config, node_config, service, state_config};

/// CPU time (user + system) of this process so far.
fn cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat");
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = &stat[stat.rfind(')').expect("stat format") + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    // USER_HZ is 100 on Linux.
    Duration::from_millis(ticks * 10)
}

/// A kernel that takes every transaction and keeps nothing: what is left of a sync is the
/// applier's work and the transaction's construction.
#[derive(Default)]
struct NullKernel {
    ops: usize,
}

struct NullSink<'k>(&'k mut usize);

impl TransactionSink for NullSink<'_> {
    fn add(&mut self, piece: Transaction) -> Result<(), KernelError> {
        *self.0 += piece.len();
        Ok(())
    }

    fn commit(self: Box<Self>) -> Result<(), KernelError> {
        Ok(())
    }
}

impl Kernel for NullKernel {
    fn apply(&mut self, tx: &Transaction) -> Result<(), KernelError> {
        self.ops += tx.len();
        Ok(())
    }

    fn list(&mut self, _family: IpFamily) -> Result<Option<Existing>, KernelError> {
        Ok(None)
    }

    /// Holds nothing: no client was ever sent anywhere.
    fn affinity_entries(
        &mut self,
        _family: IpFamily,
        _map: &str,
        _key: nodeport_proxy::nftables::ruleset::KeyType,
    ) -> Result<
        Vec<(
            nodeport_proxy::nftables::ruleset::ElemKey,
            std::net::SocketAddr,
        )>,
        KernelError,
    > {
        Ok(Vec::new())
    }

    fn batch(&mut self) -> Box<dyn TransactionSink + '_> {
        Box::new(NullSink(&mut self.ops))
    }
}

fn main() {
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let sizes = if sizes.is_empty() {
        vec![10_000, 100_000]
    } else {
        sizes
    };
    let config = match std::env::var("NODEPORT_BENCH_LAYOUT").as_deref() {
        Ok("kube-proxy") => node_config(EndpointChoice::Cascade),
        _ => flat_config(),
    };
    println!(
        "| Services x 10 endpoints | first full sync, CPU | full resync, CPU | operations | partial sync, nothing changed (median of 1,000) | one Service's endpoints changed (median of 200) |"
    );
    println!("| --- | --- | --- | --- | --- | --- |");
    let median = |mut samples: Vec<Duration>| {
        samples.sort();
        samples[samples.len() / 2].as_secs_f64() * 1e6
    };
    for n in sizes {
        let mut c = cluster(n);
        let mut d = desired::build(&c, NodeView::named("node-0"), &facts(), &state_config());
        let mut applier = Applier::new(NullKernel::default());
        let t = cpu();
        assert!(applier.sync(&d, &config, None).expect("full sync").full);
        let first = cpu() - t;
        let ops = applier.kernel().ops;
        applier.request_full_sync();
        let t = cpu();
        applier.sync(&d, &config, None).expect("resync");
        let again = cpu() - t;
        let nothing: Vec<Duration> = (0..1000)
            .map(|_| {
                let t = Instant::now();
                assert!(
                    !applier
                        .sync(&d, &config, Some(&BTreeSet::new()))
                        .unwrap()
                        .full
                );
                t.elapsed()
            })
            .collect();
        let one: Vec<Duration> = (0..200)
            .map(|k| {
                let (_, _, ek, e) = service((k * 7919) % n, k as u32 + 1);
                let t = Instant::now();
                c.update_slice(ek, Some(e));
                let changes = c.take_changes();
                let changed = d.refresh_services(&c, NodeView::named("node-0"), &changes.services);
                assert!(!applier.sync(&d, &config, Some(&changed)).unwrap().full);
                t.elapsed()
            })
            .collect();
        println!(
            "| {n} | {:.3} s | {:.3} s | {ops} | {:.1} µs | {:.1} µs |",
            first.as_secs_f64(),
            again.as_secs_f64(),
            median(nothing),
            median(one)
        );
    }
}
