//! Range occupancy: `GET /ranges` (JSON, works with `kubectl get --raw /ranges`) and `/metrics`.
//!
//! `/ranges` shows, for the NodePort range and the ClusterIP range (and, on a dual-stack server,
//! the secondary family's range as `secondaryClusterIPs`), the size and the used and
//! free counts of the whole range and of each band (static: the lower band kept for hand-picked
//! values; dynamic: where automatic picks go first), read from the stored bitmaps:
//!
//! ```json
//! {"nodePorts": {"range": "30000-32767", "size": 2768, "used": 2, "free": 2766,
//!                "static": {"first": "30000", "last": "30085", "size": 86, "used": 1, "free": 85},
//!                "dynamic": {"first": "30086", "last": "32767", "size": 2682, "used": 1, "free": 2681}},
//!  "clusterIPs": {"range": "10.96.0.0/16", ...}}
//! ```
//!
//! `/metrics` exports kube-apiserver's allocator gauges under their names
//! (`kube_apiserver_nodeport_allocator_allocated_ports`, `..._available_ports`,
//! `kube_apiserver_clusterip_allocator_allocated_ips`, `..._available_ips` with label `cidr`), plus
//! per-band gauges (`nodeport_allocator_band_used_ports{band="static|dynamic"}`).

use nodeport_alloc::{Band, Occupancy, ip, port};
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::registry::Registry;
use crate::storage::keys;
use crate::store::decode_range;

fn band(b: &Band) -> Value {
    json!({"first": b.first, "last": b.last, "size": b.size, "used": b.used, "free": b.free})
}

fn occupancy(range: String, o: &Occupancy) -> Value {
    json!({
        "range": range,
        "size": o.size(),
        "used": o.used(),
        "free": o.free(),
        "static": band(&o.static_band),
        "dynamic": band(&o.dynamic_band),
    })
}

/// The stored bitmaps: NodePorts, the primary ClusterIPs and, on a dual-stack server, the
/// secondary family's ClusterIPs.
type Loaded = (port::Allocator, ip::Allocator, Option<ip::Allocator>);

async fn load(registry: &Registry) -> Result<Loaded, ApiError> {
    let prefix = registry.store().prefix();
    let np_key = keys::node_port_range(prefix);
    let ip_key = keys::service_ip_range(prefix);
    let secondary_key = keys::secondary_service_ip_range(prefix);
    let fetched = registry
        .store()
        .backend()
        .get_many(vec![np_key.clone(), ip_key.clone(), secondary_key.clone()])
        .await?;
    let ranges = registry.ranges();
    let mut ports = port::Allocator::new(ranges.node_ports);
    let mut ips = ip::Allocator::new(ranges.cluster_ips).map_err(ApiError::internal)?;
    if let Some(kv) = fetched.kvs.get(&np_key) {
        let snap = decode_range(&kv.value).map_err(ApiError::internal)?;
        ports
            .restore(&snap.range, &snap.data)
            .map_err(ApiError::internal)?;
    }
    if let Some(kv) = fetched.kvs.get(&ip_key) {
        let snap = decode_range(&kv.value).map_err(ApiError::internal)?;
        ips.restore(&snap.range, &snap.data)
            .map_err(ApiError::internal)?;
    }
    let mut secondary = ranges
        .secondary_cluster_ips
        .map(ip::Allocator::new)
        .transpose()
        .map_err(ApiError::internal)?;
    if let (Some(kv), Some(allocator)) = (fetched.kvs.get(&secondary_key), secondary.as_mut()) {
        let snap = decode_range(&kv.value).map_err(ApiError::internal)?;
        allocator
            .restore(&snap.range, &snap.data)
            .map_err(ApiError::internal)?;
    }
    Ok((ports, ips, secondary))
}

/// The `/ranges` document.
pub async fn report(registry: &Registry) -> Result<Value, ApiError> {
    let (ports, ips, secondary) = load(registry).await?;
    let mut doc = json!({
        "nodePorts": occupancy(ports.range().to_string(), &ports.occupancy()),
        "clusterIPs": occupancy(ips.cidr().to_string(), &ips.occupancy()),
    });
    if let Some(secondary) = secondary {
        doc["secondaryClusterIPs"] =
            occupancy(secondary.cidr().to_string(), &secondary.occupancy());
    }
    Ok(doc)
}

/// The `/metrics` text (Prometheus exposition format).
pub async fn metrics(registry: &Registry) -> Result<String, ApiError> {
    let (ports, ips, secondary) = load(registry).await?;
    let po = ports.occupancy();
    let per_cidr: Vec<(String, Occupancy)> = std::iter::once(&ips)
        .chain(secondary.as_ref())
        .map(|a| (format!("{{cidr=\"{}\"}}", a.cidr()), a.occupancy()))
        .collect();
    let mut out = String::new();
    let mut gauge = |name: &str, help: &str, samples: &[(String, usize)]| {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} gauge\n"));
        for (labels, value) in samples {
            out.push_str(&format!("{name}{labels} {value}\n"));
        }
    };
    gauge(
        "kube_apiserver_nodeport_allocator_allocated_ports",
        "Gauge measuring the number of allocated NodePorts for Services",
        &[(String::new(), po.used())],
    );
    gauge(
        "kube_apiserver_nodeport_allocator_available_ports",
        "Gauge measuring the number of available NodePorts for Services",
        &[(String::new(), po.free())],
    );
    gauge(
        "nodeport_allocator_band_used_ports",
        "NodePorts allocated in each band of the range",
        &[
            ("{band=\"static\"}".into(), po.static_band.used),
            ("{band=\"dynamic\"}".into(), po.dynamic_band.used),
        ],
    );
    gauge(
        "kube_apiserver_clusterip_allocator_allocated_ips",
        "Gauge measuring the number of allocated IPs for Services",
        &per_cidr
            .iter()
            .map(|(labels, o)| (labels.clone(), o.used()))
            .collect::<Vec<_>>(),
    );
    gauge(
        "kube_apiserver_clusterip_allocator_available_ips",
        "Gauge measuring the number of available IPs for Services",
        &per_cidr
            .iter()
            .map(|(labels, o)| (labels.clone(), o.free()))
            .collect::<Vec<_>>(),
    );
    let stats = registry.store().stats();
    out.push_str(&format!(
        "# HELP nodeport_apiserver_allocation_differences Differences between the allocation bitmaps and the stored Services at the last check\n# TYPE nodeport_apiserver_allocation_differences gauge\nnodeport_apiserver_allocation_differences {}\n",
        stats.differences.load(std::sync::atomic::Ordering::Relaxed)
    ));
    out.push_str(&format!(
        "# HELP nodeport_apiserver_storage_lost_races_in_a_row_max The most races for the range keys one batch has lost in a row since the start (it fails at 64)\n# TYPE nodeport_apiserver_storage_lost_races_in_a_row_max gauge\nnodeport_apiserver_storage_lost_races_in_a_row_max {}\n",
        stats.most_lost_in_a_row.load(std::sync::atomic::Ordering::Relaxed)
    ));
    let mut counter = |name: &str, help: &str, value: String| {
        out.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}\n"
        ));
    };
    let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    counter(
        "nodeport_apiserver_storage_batches_total",
        "Storage transactions the writer committed (group commit: one per batch of requests)",
        load(&stats.batches).to_string(),
    );
    counter(
        "nodeport_apiserver_storage_mutations_total",
        "Write requests run in committed batches",
        load(&stats.mutations).to_string(),
    );
    counter(
        "nodeport_apiserver_storage_conflicts_total",
        "Batches that lost a compare-and-swap race with another writer and were re-run",
        load(&stats.conflicts).to_string(),
    );
    counter(
        "nodeport_apiserver_storage_conflict_give_ups_total",
        "Write requests that failed (500) because their batch lost the race for the range keys too many times in a row",
        load(&stats.gave_up).to_string(),
    );
    counter(
        "nodeport_apiserver_allocation_verifications_total",
        "Rounds of the check that compares the allocation bitmaps with the stored Services",
        load(&stats.verifications).to_string(),
    );
    counter(
        "nodeport_apiserver_allocation_leaks_repaired_total",
        "Leaked NodePorts and ClusterIPs (allocated, held by no Service) the check freed",
        load(&stats.leaks_repaired).to_string(),
    );
    counter(
        "nodeport_apiserver_storage_commit_seconds_total",
        "Time spent committing batches to storage",
        format!("{:.6}", load(&stats.commit_nanos) as f64 / 1e9),
    );
    counter(
        "nodeport_apiserver_storage_read_seconds_total",
        "Time the writer spent reading the keys of its batches",
        format!("{:.6}", load(&stats.read_nanos) as f64 / 1e9),
    );
    if let Some(outages) = registry.store().backend().outages() {
        counter(
            "nodeport_apiserver_storage_outages_total",
            "Times the storage (etcd) stopped answering",
            outages.outages.to_string(),
        );
        counter(
            "nodeport_apiserver_storage_unavailable_calls_total",
            "Storage calls that failed because the storage did not answer (503/504)",
            outages.failed_calls.to_string(),
        );
        out.push_str(&format!(
            "# HELP nodeport_apiserver_storage_reachable Whether the storage answered the last call\n# TYPE nodeport_apiserver_storage_reachable gauge\nnodeport_apiserver_storage_reachable {}\n",
            u8::from(outages.reachable)
        ));
    }
    Ok(out)
}
