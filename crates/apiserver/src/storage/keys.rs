//! Storage keys, laid out as kube-apiserver lays them out in etcd under `--etcd-prefix`.
//!
//! | what | key |
//! | --- | --- |
//! | Service | `<prefix>/services/specs/<namespace>/<name>` |
//! | Endpoints | `<prefix>/services/endpoints/<namespace>/<name>` |
//! | EndpointSlice | `<prefix>/endpointslices/<namespace>/<name>` |
//! | Node | `<prefix>/minions/<name>` |
//! | Namespace | `<prefix>/namespaces/<name>` |
//! | NodePort bitmap | `<prefix>/ranges/servicenodeports` |
//! | ClusterIP bitmap | `<prefix>/ranges/serviceips` |
//! | ClusterIP bitmap of the secondary family (dual stack) | `<prefix>/ranges/secondaryserviceips` |
//! | ClusterIPs of the ServiceCIDRs added through the API (ours, see `cidr_ranges`) | `<prefix>/ranges/servicecidrs` |

/// kube-apiserver's default `--etcd-prefix`.
pub const DEFAULT_PREFIX: &str = "/registry";

/// The key of the NodePort allocation bitmap (a `RangeAllocation` JSON document).
pub fn node_port_range(prefix: &str) -> String {
    format!("{prefix}/ranges/servicenodeports")
}

/// The key of the ClusterIP allocation bitmap (a `RangeAllocation` JSON document).
pub fn service_ip_range(prefix: &str) -> String {
    format!("{prefix}/ranges/serviceips")
}

/// The key of the secondary family's ClusterIP bitmap on a dual-stack server, as kube-apiserver
/// names it (`pkg/registry/core/rest/storage_core.go`).
pub fn secondary_service_ip_range(prefix: &str) -> String {
    format!("{prefix}/ranges/secondaryserviceips")
}

/// The key of the allocations of the ServiceCIDRs added through the API (this server's own; see
/// [`crate::cidr_ranges`]).
pub fn service_cidr_ranges(prefix: &str) -> String {
    format!("{prefix}/ranges/servicecidrs")
}
