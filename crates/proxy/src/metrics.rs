//! Prometheus metrics with kube-proxy's names (`pkg/proxy/metrics`), served on
//! `--metrics-bind-address` at `/metrics`.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::model::IpFamily;

type Labels = Vec<(String, String)>;

/// Histogram constructor with fixed buckets.
#[derive(Clone)]
pub struct Buckets(Arc<Vec<f64>>);

impl MetricConstructor<Histogram> for Buckets {
    fn new_metric(&self) -> Histogram {
        Histogram::new(self.0.iter().copied())
    }
}

/// kube-proxy's `network_programming_duration_seconds` buckets: 0.25 s, 0.5 s, 1-59 s by
/// 1 s, 60-115 s by 5 s, 120-300 s by 30 s.
fn programming_buckets() -> Vec<f64> {
    let mut b = vec![0.25, 0.5];
    b.extend((1..=59).map(f64::from));
    b.extend((0..12).map(|i| 60.0 + 5.0 * f64::from(i)));
    b.extend((0..7).map(|i| 120.0 + 30.0 * f64::from(i)));
    b
}

/// Every metric the proxy exports.
pub struct Metrics {
    registry: Registry,
    /// Metrics of ours, under the `nodeport` prefix (kube-proxy has no eBPF mode).
    nodeport_registry: Registry,
    /// `kubeproxy_sync_proxy_rules_duration_seconds{ip_family}`.
    pub sync_duration: Family<Labels, Histogram, Buckets>,
    /// `kubeproxy_sync_full_proxy_rules_duration_seconds{ip_family}`.
    pub sync_full_duration: Family<Labels, Histogram, Buckets>,
    /// `kubeproxy_sync_partial_proxy_rules_duration_seconds{ip_family}`.
    pub sync_partial_duration: Family<Labels, Histogram, Buckets>,
    /// `kubeproxy_network_programming_duration_seconds{ip_family}`.
    pub network_programming: Family<Labels, Histogram, Buckets>,
    /// `kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family}`.
    pub last_sync_timestamp: Family<Labels, Gauge<f64, AtomicU64>>,
    /// `kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds{ip_family}`.
    pub last_queued_timestamp: Family<Labels, Gauge<f64, AtomicU64>>,
    /// `kubeproxy_sync_proxy_rules_endpoint_changes_pending`.
    pub endpoint_changes_pending: Gauge,
    /// `kubeproxy_sync_proxy_rules_endpoint_changes_total`.
    pub endpoint_changes_total: Counter,
    /// `kubeproxy_sync_proxy_rules_service_changes_pending`.
    pub service_changes_pending: Gauge,
    /// `kubeproxy_sync_proxy_rules_service_changes_total`.
    pub service_changes_total: Counter,
    /// `kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family,traffic_policy}` (a
    /// gauge in kube-proxy despite the name).
    pub no_local_endpoints: Family<Labels, Gauge>,
    /// `kubeproxy_sync_proxy_rules_nftables_sync_failures_total{ip_family}`.
    pub nftables_sync_failures: Family<Labels, Counter>,
    /// `kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total{ip_family}`.
    pub nftables_cleanup_failures: Family<Labels, Counter>,
    /// `kubeproxy_sync_proxy_rules_nftables_set_full{ip_family,set}` (ours): 1 while the
    /// last sync was refused because this set of the flat layout reached its `size`.
    pub nftables_set_full: Family<Labels, Gauge>,
    /// `kubeproxy_sync_proxy_rules_iptables_restore_failures_total{ip_family}` (iptables mode).
    pub iptables_restore_failures: Family<Labels, Counter>,
    /// `kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total{ip_family}`.
    pub iptables_partial_restore_failures: Family<Labels, Counter>,
    /// `kubeproxy_sync_proxy_rules_iptables_total{ip_family,table}`: rules programmed.
    pub iptables_rules_total: Family<Labels, Gauge>,
    /// `kubeproxy_sync_proxy_rules_iptables_last{ip_family,table}`: rules written by the last
    /// sync.
    pub iptables_rules_last: Family<Labels, Gauge>,
    /// `kubeproxy_conntrack_reconciler_sync_duration_seconds{ip_family}`.
    pub conntrack_duration: Family<Labels, Histogram, Buckets>,
    /// `kubeproxy_conntrack_reconciler_deleted_entries_total{ip_family}`.
    pub conntrack_deleted: Family<Labels, Counter>,
    /// `kubeproxy_proxy_healthz_total{code}`.
    pub healthz_total: Family<Labels, Counter>,
    /// `kubeproxy_proxy_livez_total{code}`.
    pub livez_total: Family<Labels, Counter>,
    /// `nodeport_ebpf_map_entries{map}` (eBPF mode): entries each BPF map holds after the
    /// last sync.
    pub ebpf_map_entries: Family<Labels, Gauge>,
    /// `nodeport_ebpf_map_capacity{map}` (eBPF mode): each BPF map's `max_entries`.
    pub ebpf_map_capacity: Family<Labels, Gauge>,
    /// `nodeport_ebpf_sync_failures_total` (eBPF mode): failed map syncs.
    pub ebpf_sync_failures: Counter,
    /// `nodeport_sync_proxy_rules_resource_version{resource}` (ours): the newest
    /// `resourceVersion` of the `services` and `endpointslices` the watches had delivered when
    /// the last successful sync took its input. A watch delivers one kind's changes in
    /// revision order, so a value at or past the revision of a write means the kernel holds
    /// that write and every earlier one of the kind (the churn soak waits on it).
    pub synced_resource_version: Family<Labels, Gauge>,
}

/// The `ip_family` label.
pub fn family_label(family: IpFamily) -> Labels {
    vec![("ip_family".to_string(), family.as_str().to_string())]
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric of the nftables mode under the `kubeproxy` prefix.
    pub fn new() -> Self {
        Self::for_mode(crate::config::ProxyMode::Nftables)
    }

    /// Registers the metrics of `mode`, as kube-proxy's `RegisterMetrics(mode)` does: the
    /// common ones plus that mode's failure counters (and rule counts for iptables).
    pub fn for_mode(mode: crate::config::ProxyMode) -> Self {
        let mut registry = Registry::with_prefix("kubeproxy");
        let sync_buckets = Buckets(Arc::new(exponential_buckets(0.001, 2.0, 15).collect()));
        let hist =
            |b: &Buckets| Family::<Labels, Histogram, Buckets>::new_with_constructor(b.clone());
        let m = Metrics {
            sync_duration: hist(&sync_buckets),
            sync_full_duration: hist(&sync_buckets),
            sync_partial_duration: hist(&sync_buckets),
            network_programming: hist(&Buckets(Arc::new(programming_buckets()))),
            last_sync_timestamp: Family::default(),
            last_queued_timestamp: Family::default(),
            endpoint_changes_pending: Gauge::default(),
            endpoint_changes_total: Counter::default(),
            service_changes_pending: Gauge::default(),
            service_changes_total: Counter::default(),
            no_local_endpoints: Family::default(),
            nftables_sync_failures: Family::default(),
            nftables_cleanup_failures: Family::default(),
            nftables_set_full: Family::default(),
            iptables_restore_failures: Family::default(),
            iptables_partial_restore_failures: Family::default(),
            iptables_rules_total: Family::default(),
            iptables_rules_last: Family::default(),
            conntrack_duration: hist(&sync_buckets),
            conntrack_deleted: Family::default(),
            healthz_total: Family::default(),
            livez_total: Family::default(),
            ebpf_map_entries: Family::default(),
            ebpf_map_capacity: Family::default(),
            ebpf_sync_failures: Counter::default(),
            synced_resource_version: Family::default(),
            registry: Registry::default(),
            nodeport_registry: Registry::default(),
        };
        let mut nodeport_registry = Registry::with_prefix("nodeport");
        nodeport_registry.register(
            "sync_proxy_rules_resource_version",
            "The newest resourceVersion of each watched resource the last successful sync included",
            m.synced_resource_version.clone(),
        );
        if mode == crate::config::ProxyMode::Ebpf {
            nodeport_registry.register(
                "ebpf_map_entries",
                "Entries each eBPF map holds after the last sync",
                m.ebpf_map_entries.clone(),
            );
            nodeport_registry.register(
                "ebpf_map_capacity",
                "Maximum entries of each eBPF map",
                m.ebpf_map_capacity.clone(),
            );
            nodeport_registry.register(
                "ebpf_sync_failures",
                "Number of eBPF map sync failures",
                m.ebpf_sync_failures.clone(),
            );
        }
        registry.register(
            "sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds",
            m.sync_duration.clone(),
        );
        registry.register(
            "sync_full_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for full resyncs",
            m.sync_full_duration.clone(),
        );
        registry.register(
            "sync_partial_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for partial resyncs",
            m.sync_partial_duration.clone(),
        );
        registry.register(
            "network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
            m.network_programming.clone(),
        );
        registry.register(
            "sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            m.last_sync_timestamp.clone(),
        );
        registry.register(
            "sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued",
            m.last_queued_timestamp.clone(),
        );
        registry.register(
            "sync_proxy_rules_endpoint_changes_pending",
            "Pending proxy rules Endpoint changes",
            m.endpoint_changes_pending.clone(),
        );
        registry.register(
            "sync_proxy_rules_endpoint_changes",
            "Cumulative proxy rules Endpoint changes",
            m.endpoint_changes_total.clone(),
        );
        registry.register(
            "sync_proxy_rules_service_changes_pending",
            "Pending proxy rules Service changes",
            m.service_changes_pending.clone(),
        );
        registry.register(
            "sync_proxy_rules_service_changes",
            "Cumulative proxy rules Service changes",
            m.service_changes_total.clone(),
        );
        registry.register(
            "sync_proxy_rules_no_local_endpoints_total",
            "Number of services with a Local traffic policy and no endpoints",
            m.no_local_endpoints.clone(),
        );
        if mode == crate::config::ProxyMode::Iptables {
            registry.register(
                "sync_proxy_rules_iptables_restore_failures",
                "Cumulative proxy iptables restore failures",
                m.iptables_restore_failures.clone(),
            );
            registry.register(
                "sync_proxy_rules_iptables_partial_restore_failures",
                "Cumulative proxy iptables partial restore failures",
                m.iptables_partial_restore_failures.clone(),
            );
            registry.register(
                "sync_proxy_rules_iptables_total",
                "Total number of iptables rules owned by kube-proxy",
                m.iptables_rules_total.clone(),
            );
            registry.register(
                "sync_proxy_rules_iptables_last",
                "Number of iptables rules written by kube-proxy in last sync",
                m.iptables_rules_last.clone(),
            );
        } else {
            registry.register(
                "sync_proxy_rules_nftables_sync_failures",
                "Number of nftables sync failures",
                m.nftables_sync_failures.clone(),
            );
            registry.register(
                "sync_proxy_rules_nftables_cleanup_failures",
                "Number of nftables stale chain cleanup failures",
                m.nftables_cleanup_failures.clone(),
            );
            registry.register(
                "sync_proxy_rules_nftables_set_full",
                "1 while a set or map of the nftables table is full and syncs are refused",
                m.nftables_set_full.clone(),
            );
        }
        registry.register(
            "conntrack_reconciler_sync_duration_seconds",
            "ReconcileConntrackFlowsLatency latency in seconds",
            m.conntrack_duration.clone(),
        );
        registry.register(
            "conntrack_reconciler_deleted_entries",
            "Cumulative conntrack flows deleted by conntrack reconciler",
            m.conntrack_deleted.clone(),
        );
        registry.register(
            "proxy_healthz",
            "Cumulative proxy healthz HTTP status",
            m.healthz_total.clone(),
        );
        registry.register(
            "proxy_livez",
            "Cumulative proxy livez HTTP status",
            m.livez_total.clone(),
        );
        Metrics {
            registry,
            nodeport_registry,
            ..m
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        encode_registry(&mut out, &self.registry).expect("writing to a String cannot fail");
        encode_registry(&mut out, &self.nodeport_registry)
            .expect("writing to a String cannot fail");
        encode_eof(&mut out).expect("writing to a String cannot fail");
        out
    }
}

/// The `/metrics` router.
pub fn router(metrics: Arc<Metrics>) -> axum::Router {
    axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let m = metrics.clone();
            async move {
                (
                    [(
                        http::header::CONTENT_TYPE,
                        "text/plain; version=0.0.4; charset=utf-8",
                    )],
                    m.render(),
                )
            }
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_names_are_kube_proxys() {
        let m = Metrics::new();
        m.sync_duration
            .get_or_create(&family_label(IpFamily::V4))
            .observe(0.01);
        m.nftables_sync_failures
            .get_or_create(&family_label(IpFamily::V4))
            .inc();
        m.network_programming
            .get_or_create(&family_label(IpFamily::V4))
            .observe(1.5);
        let mut full = family_label(IpFamily::V4);
        full.push(("set".into(), "service-endpoints".into()));
        m.nftables_set_full.get_or_create(&full).set(1);
        m.last_sync_timestamp
            .get_or_create(&family_label(IpFamily::V4))
            .set(1.0);
        let text = m.render();
        for name in [
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"0.001\",ip_family=\"IPv4\"}",
            "kubeproxy_sync_proxy_rules_nftables_sync_failures_total{ip_family=\"IPv4\"} 1",
            "kubeproxy_network_programming_duration_seconds_count{ip_family=\"IPv4\"} 1",
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=\"IPv4\"} 1",
            "kubeproxy_sync_proxy_rules_endpoint_changes_total 0",
            "kubeproxy_sync_proxy_rules_nftables_set_full{ip_family=\"IPv4\",set=\"service-endpoints\"} 1",
        ] {
            assert!(text.contains(name), "{name} missing from:\n{text}");
        }
    }

    #[test]
    fn iptables_mode_registers_kube_proxys_iptables_metrics_instead_of_nftables_ones() {
        let m = Metrics::for_mode(crate::config::ProxyMode::Iptables);
        m.iptables_restore_failures
            .get_or_create(&family_label(IpFamily::V4))
            .inc();
        let mut l = family_label(IpFamily::V4);
        l.push(("table".into(), "nat".into()));
        m.iptables_rules_total.get_or_create(&l).set(12);
        let text = m.render();
        for name in [
            "kubeproxy_sync_proxy_rules_iptables_restore_failures_total{ip_family=\"IPv4\"} 1",
            "kubeproxy_sync_proxy_rules_iptables_total{ip_family=\"IPv4\",table=\"nat\"} 12",
        ] {
            assert!(text.contains(name), "{name} missing from:\n{text}");
        }
        assert!(!text.contains("nftables"), "{text}");
        assert!(!text.contains("nodeport_ebpf"), "{text}");
    }

    #[test]
    fn ebpf_mode_exports_each_maps_entries_and_capacity_under_the_nodeport_prefix() {
        let m = Metrics::for_mode(crate::config::ProxyMode::Ebpf);
        let l = vec![("map".to_string(), "np_services".to_string())];
        m.ebpf_map_entries.get_or_create(&l).set(7);
        m.ebpf_map_capacity.get_or_create(&l).set(1024);
        m.ebpf_sync_failures.inc();
        m.synced_resource_version
            .get_or_create(&vec![("resource".to_string(), "services".to_string())])
            .set(42);
        let text = m.render();
        for name in [
            "nodeport_sync_proxy_rules_resource_version{resource=\"services\"} 42",
            "nodeport_ebpf_map_entries{map=\"np_services\"} 7",
            "nodeport_ebpf_map_capacity{map=\"np_services\"} 1024",
            "nodeport_ebpf_sync_failures_total 1",
            "kubeproxy_sync_proxy_rules_endpoint_changes_total 0",
        ] {
            assert!(text.contains(name), "{name} missing from:\n{text}");
        }
        assert_eq!(text.matches("# EOF").count(), 1, "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
