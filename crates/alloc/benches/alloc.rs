//! Allocator benchmarks: allocate-next + release pairs at several occupancies, and snapshot /
//! restore of the default NodePort range and of /16 and /12 ClusterIP ranges.
//!
//! Run: `cargo bench -p nodeport-alloc --bench alloc -- --warm-up-time 1 --measurement-time 3`.
//! Figures are in `docs/BENCHMARKS.md` (section "Allocators").

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use ipnet::IpNet;
use nodeport_alloc::{PortRange, ip, port};

const SEED: u64 = 0x6e6f_6465_706f_7274;

/// Occupancies at which a pair is measured, in percent.
const OCCUPANCIES: [usize; 4] = [0, 50, 90, 99];

/// A default-range NodePort allocator with `percent` % of its ports taken by dynamic picks,
/// which fill the dynamic band first as in a real cluster.
fn ports_at(percent: usize) -> port::Allocator {
    let mut ports = port::Allocator::with_seed(PortRange::default(), SEED);
    let target = PortRange::default().size() as usize * percent / 100;
    while ports.used() < target {
        ports.allocate_next().expect("range has room");
    }
    ports
}

fn ips_at(cidr: &str, percent: usize) -> ip::Allocator {
    let cidr: IpNet = cidr.parse().expect("valid CIDR");
    let mut ips = ip::Allocator::with_seed(cidr, SEED).expect("usable range");
    let target = ips.free() * percent / 100;
    while ips.used() < target {
        ips.allocate_next().expect("range has room");
    }
    ips
}

/// One allocate-next followed by the release of the same port: the occupancy stays put.
fn port_next_release(c: &mut Criterion) {
    let mut group = c.benchmark_group("port_next_release");
    group.throughput(Throughput::Elements(1));
    for percent in OCCUPANCIES {
        let mut ports = ports_at(percent);
        group.bench_function(BenchmarkId::from_parameter(format!("{percent}%")), |b| {
            b.iter(|| {
                let port = ports.allocate_next().expect("range has room");
                ports.release(black_box(port));
                port
            })
        });
    }
    group.finish();
}

fn ip_next_release(c: &mut Criterion) {
    let mut group = c.benchmark_group("ip_next_release");
    group.throughput(Throughput::Elements(1));
    for (cidr, percent) in [
        ("10.96.0.0/12", 50),
        ("10.96.0.0/12", 99),
        ("fd00::/108", 99),
    ] {
        let mut ips = ips_at(cidr, percent);
        group.bench_function(BenchmarkId::new(cidr, format!("{percent}%")), |b| {
            b.iter(|| {
                let addr = ips.allocate_next().expect("range has room");
                ips.release(black_box(addr));
                addr
            })
        });
    }
    group.finish();
}

/// Snapshot and restore at 50 % occupancy (the bitmap is then about as long as it gets).
fn snapshot_restore(c: &mut Criterion) {
    let mut group = c.benchmark_group("snapshot_restore");

    let mut ports = ports_at(50);
    let saved = ports.snapshot();
    group.bench_function("port 30000-32767 snapshot", |b| b.iter(|| ports.snapshot()));
    group.bench_function("port 30000-32767 restore", |b| {
        b.iter(|| {
            ports
                .restore(&saved.range, black_box(&saved.data))
                .expect("same range")
        })
    });

    for cidr in ["10.96.0.0/16", "10.96.0.0/12"] {
        let mut ips = ips_at(cidr, 50);
        let saved = ips.snapshot();
        group.bench_function(format!("ip {cidr} snapshot"), |b| b.iter(|| ips.snapshot()));
        group.bench_function(format!("ip {cidr} restore"), |b| {
            b.iter(|| {
                ips.restore(&saved.range, black_box(&saved.data))
                    .expect("same range")
            })
        });
    }
    group.finish();
}

criterion_group!(
    benches,
    port_next_release,
    ip_next_release,
    snapshot_restore
);
criterion_main!(benches);
