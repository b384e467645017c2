//! The default `networking.k8s.io/v1` ServiceCIDR, `kubernetes`.
//!
//! Since Kubernetes 1.33 kube-apiserver reflects `--service-cluster-ip-range` in a ServiceCIDR
//! named `kubernetes` (the `kubernetes-service-cidr-controller` of
//! `pkg/controlplane/controller/defaultservicecidr`): the first API server to start creates it,
//! then sets its `Ready` condition to `True`. kube-proxy watches ServiceCIDRs and drops traffic to
//! ClusterIPs inside them that no Service holds. Here the object is created, Ready, by the
//! bootstrap write that creates the system namespaces; an existing one is left as it is, as
//! kube-apiserver leaves it (every API server must run with the same range).

use k8s_openapi::api::networking::v1::{ServiceCIDR, ServiceCIDRSpec, ServiceCIDRStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta, Time};

use super::service::ServiceRanges;

/// The name of the default ServiceCIDR (`DefaultServiceCIDRName`).
pub const DEFAULT_NAME: &str = "kubernetes";

/// The message of its `Ready` condition, as kube-apiserver's controller writes it.
pub const READY_MESSAGE: &str = "Kubernetes default Service CIDR is ready";

/// The default ServiceCIDR for `ranges`, created at `now` with `uid`.
pub fn default_service_cidr(ranges: &ServiceRanges, uid: String, now: Time) -> ServiceCIDR {
    ServiceCIDR {
        metadata: ObjectMeta {
            name: Some(DEFAULT_NAME.to_owned()),
            uid: Some(uid),
            creation_timestamp: Some(now.clone()),
            ..Default::default()
        },
        spec: Some(ServiceCIDRSpec {
            cidrs: Some(flag_cidrs(ranges)),
        }),
        status: Some(ServiceCIDRStatus {
            // The controller applies the condition without a reason.
            conditions: Some(vec![Condition {
                type_: "Ready".to_owned(),
                status: "True".to_owned(),
                last_transition_time: now,
                message: READY_MESSAGE.to_owned(),
                reason: String::new(),
                observed_generation: None,
            }]),
        }),
    }
}

/// The CIDRs a stored ServiceCIDR holds, for comparing with the flags.
pub fn cidrs(cidr: &ServiceCIDR) -> Vec<String> {
    cidr.spec
        .as_ref()
        .and_then(|s| s.cidrs.clone())
        .unwrap_or_default()
}

/// The CIDRs of `--service-cluster-ip-range`, primary first, as the default ServiceCIDR holds them.
pub fn flag_cidrs(ranges: &ServiceRanges) -> Vec<String> {
    std::iter::once(ranges.cluster_ips)
        .chain(ranges.secondary_cluster_ips)
        .map(|net| net.to_string())
        .collect()
}
