//! What a batched map write saves: the entries of a full sync at `n` Services × 10 endpoints
//! (10 backends and, as in `dataplane_compare`'s cluster, 2.55 frontends per Service on
//! average), written into freshly loaded maps of the default sizes one `bpf()` call per
//! entry (`Batch::per_entry`, what a kernel without the batch commands gets) and in one
//! `BPF_MAP_UPDATE_BATCH` call per map, alternately, then read back whole
//! (`BPF_MAP_LOOKUP_BATCH` against one key walk step and look-up per entry).
//!
//! Then the service ports' names (`np_svc_names`, one per Service), written in one batched
//! call into fresh maps: the time per name, and the map's memory (`bpftool map show`'s
//! memlock) empty and with the names.
//!
//! Run (root): `cargo bench -p nodeport-proxy --bench ebpf_batch [-- SERVICES ROUNDS]`
//! (default 10,000 Services, 3 rounds). Prints the time per entry of each way, wall clock
//! and this thread's CPU time.

use std::time::{Duration, Instant};

use nodeport_proxy::ebpf::batch::Batch;
use nodeport_proxy::ebpf::maps::{self, BackendEntry, Frontend, FrontendKey, Scope};
use nodeport_proxy::ebpf::programs::{MapSizes, Maps, Programs};
use nodeport_proxy::model::{Protocol, ServicePortName};

/// The memory `bpftool map show` gives the map `name` of `maps` (its memlock), in bytes.
fn memlock(maps: &Maps, name: &'static str) -> u64 {
    let id = maps.map_id(name).expect("map id").to_string();
    let out = std::process::Command::new("bpftool")
        .args(["map", "show", "id", &id])
        .output()
        .expect("bpftool");
    let text = String::from_utf8_lossy(&out.stdout);
    // `... max_entries 524288  memlock 8389504B`
    let mut words = text.split_whitespace();
    words
        .find(|w| *w == "memlock")
        .and_then(|_| words.next())
        .and_then(|v| v.trim_end_matches('B').parse().ok())
        .unwrap_or(0)
}

fn cpu() -> Duration {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID)
        .map_or(Duration::ZERO, Duration::from)
}

/// Wall and CPU time of `f`.
fn timed(f: impl FnOnce()) -> (Duration, Duration) {
    let (w, c) = (Instant::now(), cpu());
    f();
    (w.elapsed(), cpu() - c)
}

/// The backends and frontends of `n` Services, as (keys, values) bytes per map.
fn entries(n: u32) -> [(&'static str, Vec<u8>, Vec<u8>); 2] {
    let mut be = (Vec::new(), Vec::new());
    let mut fe = (Vec::new(), Vec::new());
    for i in 0..n {
        for ordinal in 1..=10u32 {
            be.0.extend_from_slice(&maps::backend_key(i + 1, ordinal));
            let addr = std::net::Ipv4Addr::from(0x0a00_0000 + i * 16 + ordinal);
            be.1.extend_from_slice(
                &BackendEntry {
                    addr: addr.into(),
                    port: 8080,
                    remote: true,
                }
                .encode(),
            );
        }
        // ClusterIP (both scopes); the first 2,767 also a NodePort (both scopes), as in
        // `dataplane_compare`.
        let cluster_ip = std::net::Ipv4Addr::from(0xac10_0000 + i);
        let mut keys = vec![(cluster_ip.into(), 80u16)];
        if i < 2767 {
            keys.push(("192.0.2.10".parse().unwrap(), 30000 + i as u16));
        }
        for (addr, port) in keys {
            for scope in [Scope::Internal, Scope::External] {
                fe.0.extend_from_slice(
                    &FrontendKey {
                        addr,
                        port,
                        proto: 6,
                        scope,
                    }
                    .encode(),
                );
                fe.1.extend_from_slice(
                    &Frontend {
                        svc_id: i + 1,
                        be_set: i + 1,
                        count: 10,
                        ..Default::default()
                    }
                    .encode(),
                );
            }
        }
    }
    [
        (maps::names::BACKENDS, be.0, be.1),
        (maps::names::SERVICES, fe.0, fe.1),
    ]
}

fn main() {
    let args: Vec<u32> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let n = args.first().copied().unwrap_or(10_000);
    let rounds = args.get(1).copied().unwrap_or(3);
    let entries = entries(n);
    let total: usize = entries
        .iter()
        .map(|(name, keys, _)| {
            keys.len()
                / if *name == maps::names::BACKENDS {
                    8
                } else {
                    20
                }
        })
        .sum();
    println!("ebpf_batch: {n} Services, {total} entries (backends and frontends), {rounds} rounds");
    for round in 1..=rounds {
        for per_entry in [true, false] {
            // Fresh maps each time, as a first sync finds them.
            let (_programs, m) = Programs::load(&MapSizes::default()).expect("load (root needed)");
            let batch = |name| {
                let b = m.batch(name).expect("map");
                if per_entry { b.per_entry() } else { b }
            };
            let mut write = (Duration::ZERO, Duration::ZERO);
            for (name, keys, values) in &entries {
                let b: Batch<'_> = batch(name);
                let (w, c) = timed(|| b.update(keys, values).expect("write"));
                write = (write.0 + w, write.1 + c);
            }
            let mut read = (Duration::ZERO, Duration::ZERO);
            for (name, keys, _) in &entries {
                let b: Batch<'_> = batch(name);
                let mut got = 0;
                let (w, c) = timed(|| got = b.lookup_all().expect("read").0.len());
                assert_eq!(got, keys.len(), "{name} read back whole");
                read = (read.0 + w, read.1 + c);
            }
            let per = |d: Duration| d.as_secs_f64() * 1e9 / total as f64;
            println!(
                "  round {round} {:<10} write {:>7.1} ms wall {:>6.0} ns/entry, cpu {:>7.1} ms {:>6.0} ns/entry; read {:>7.1} ms wall, cpu {:>7.1} ms",
                if per_entry { "per entry" } else { "batched" },
                write.0.as_secs_f64() * 1e3,
                per(write.0),
                write.1.as_secs_f64() * 1e3,
                per(write.1),
                read.0.as_secs_f64() * 1e3,
                read.1.as_secs_f64() * 1e3,
            );
        }
    }
    // The names: one per Service (a port of one family), batched.
    let names: Vec<(u32, ServicePortName)> = (0..n)
        .map(|i| {
            let name = format!("service-{i}");
            (
                i + 1,
                ServicePortName::new("default", &name, "http", Protocol::Tcp),
            )
        })
        .collect();
    for round in 1..=rounds {
        let (_programs, mut m) = Programs::load(&MapSizes::default()).expect("load (root needed)");
        let empty = memlock(&m, maps::names::SVC_NAMES);
        let (w, c) = timed(|| m.set_names(&names).expect("write names"));
        let full = memlock(&m, maps::names::SVC_NAMES);
        println!(
            "  round {round} names      write {:>7.1} ms wall {:>6.0} ns/name, cpu {:>7.1} ms; np_svc_names memlock {empty} B empty, {full} B with {n} names ({} B per name)",
            w.as_secs_f64() * 1e3,
            w.as_secs_f64() * 1e9 / f64::from(n.max(1)),
            c.as_secs_f64() * 1e3,
            (full - empty) / u64::from(n.max(1)),
        );
    }
}
