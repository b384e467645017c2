//! The kernel's memory for the proxy's nftables table, flat layout against kube-proxy's, for
//! N Services × 10 endpoints (issue #14's "kernel memory" figure).
//!
//! nf_tables charges what a commit allocates (tables, chains, rules, sets, elements) to the
//! memory cgroup of the process that sends the batch. This bench moves itself into a memory
//! cgroup of its own (created under its current one, removed at the end), so that the
//! counter it reads moves only with its own allocations, whatever else the machine runs:
//! cgroup v1's `memory.kmem.usage_in_bytes`, or the `kernel` line of cgroup v2's
//! `memory.stat`. For each layout: a fresh network namespace, the counter, one full sync
//! through netlink, the counter again. The user-space heap is not in the difference: the
//! bench allocates it before the first reading.
//!
//! Run (root): `cargo bench -p nodeport-proxy --bench nft_kernel_memory -- [services]`
//! (default 10,000).

mod support;

use std::path::{Path, PathBuf};

use nodeport_proxy::config::NftablesLayout;
use nodeport_proxy::desired::{self, NodeView};
use nodeport_proxy::nftables::apply::Applier;
use nodeport_testbed::Netns;
use support::{cluster, facts, flat_config, netlink_in, node_config, state_config};

/// A memory cgroup this process runs in until it is dropped.
struct OwnCgroup {
    dir: PathBuf,
    /// Where the process was, to go back before removing `dir`.
    home: PathBuf,
    v1: bool,
}

impl OwnCgroup {
    fn enter() -> Self {
        let own = std::fs::read_to_string("/proc/self/cgroup").expect("/proc/self/cgroup");
        // cgroup v1's memory hierarchy if there is one, else the v2 unified one.
        let (root, path, v1) =
            if let Some(line) = own.lines().find(|l| l.split(':').nth(1) == Some("memory")) {
                let path = line.splitn(3, ':').nth(2).unwrap().to_owned();
                ("/sys/fs/cgroup/memory", path, true)
            } else {
                let line = own
                    .lines()
                    .find(|l| l.starts_with("0::"))
                    .expect("cgroup v2");
                let root = if Path::new("/sys/fs/cgroup/unified").exists() {
                    "/sys/fs/cgroup/unified"
                } else {
                    "/sys/fs/cgroup"
                };
                (root, line[3..].to_owned(), false)
            };
        let home = Path::new(root).join(path.trim_start_matches('/'));
        let dir = home.join(format!("npbench-kmem-{}", std::process::id()));
        std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
        std::fs::write(dir.join("cgroup.procs"), std::process::id().to_string())
            .expect("move into the bench's cgroup");
        OwnCgroup { dir, home, v1 }
    }

    /// Kernel memory charged to the cgroup, bytes.
    fn kernel_bytes(&self) -> u64 {
        if self.v1 {
            let text = std::fs::read_to_string(self.dir.join("memory.kmem.usage_in_bytes"))
                .expect("memory.kmem.usage_in_bytes");
            text.trim().parse().unwrap()
        } else {
            let text = std::fs::read_to_string(self.dir.join("memory.stat")).unwrap();
            text.lines()
                .find_map(|l| l.strip_prefix("kernel "))
                .expect("memory.stat has a kernel line")
                .trim()
                .parse()
                .unwrap()
        }
    }
}

impl Drop for OwnCgroup {
    fn drop(&mut self) {
        let _ = std::fs::write(
            self.home.join("cgroup.procs"),
            std::process::id().to_string(),
        );
        let _ = std::fs::remove_dir(&self.dir);
    }
}

fn mib(bytes: i64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1 << 20) as f64)
}

fn main() {
    if !nodeport_testbed::require_privileged("nft_kernel_memory bench") {
        return;
    }
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(10_000);
    let c = cluster(n);
    let d = desired::build(&c, NodeView::named("node-0"), &facts(), &state_config());
    let cgroup = OwnCgroup::enter();
    println!("== kernel memory of the table, {n} Services x 10 endpoints ==");
    for layout in [NftablesLayout::Flat, NftablesLayout::KubeProxy] {
        let config = match layout {
            NftablesLayout::Flat => flat_config(),
            NftablesLayout::KubeProxy => node_config(Default::default()),
        };
        let ns = Netns::new("bench-kmem").unwrap();
        let mut applier = Applier::new(netlink_in(&ns));
        let before = cgroup.kernel_bytes();
        assert!(applier.sync(&d, &config, None).expect("full sync").full);
        let after = cgroup.kernel_bytes();
        let delta = after as i64 - before as i64;
        println!(
            "{}: {} ({:.0} bytes per Service)",
            layout.as_str(),
            mib(delta),
            delta as f64 / n as f64
        );
        drop(applier);
        drop(ns);
    }
    drop(cgroup);
}
