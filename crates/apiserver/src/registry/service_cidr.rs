//! `networking.k8s.io/v1` ServiceCIDRs: the default one, `kubernetes`, and those added through
//! the API, with kube's validation, the ServiceCIDR controller's finalizer and `Ready`
//! condition.
//!
//! Since Kubernetes 1.33 kube-apiserver reflects `--service-cluster-ip-range` in a ServiceCIDR
//! named `kubernetes` (the `kubernetes-service-cidr-controller` of
//! `pkg/controlplane/controller/defaultservicecidr`): the first API server to start creates it,
//! then sets its `Ready` condition to `True`. kube-proxy watches ServiceCIDRs and drops traffic to
//! ClusterIPs inside them that no Service holds. Here the object is created, Ready, by the
//! bootstrap write that creates the system namespaces; an existing one is left as it is, as
//! kube-apiserver leaves it (every API server must run with the same range).

use ipnet::IpNet;
use k8s_openapi::api::networking::v1::{ServiceCIDR, ServiceCIDRSpec, ServiceCIDRStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta, Time};

use super::service::ServiceRanges;
use super::validation::{self, NameRule};
use crate::cidr_ranges::{ExtraCidr, ExtraRanges};
use crate::error::{FieldError, GoValue};
use crate::store::Allocators;

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
            // kube-controller-manager's ServiceCIDR controller puts it on every ServiceCIDR,
            // the default one included.
            finalizers: Some(vec![FINALIZER.to_owned()]),
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

/// The reason of the Warning Event kube-apiserver's default ServiceCIDR controller posts when
/// the stored default ServiceCIDR differs from the flags (`syncStatus`, once per process).
pub const INCONSISTENT_REASON: &str = "KubernetesDefaultServiceCIDRInconsistent";

/// The component kube's default ServiceCIDR controller records its Events as (`controllerName`).
pub const CONTROLLER_NAME: &str = "kubernetes-service-cidr-controller";

/// The core/v1 Event kube-apiserver 1.33's default ServiceCIDR controller records when the
/// stored default ServiceCIDR (`stored`, with `uid` at `resource_version`) differs from the
/// flags' CIDRs (`flags`): `eventRecorder.Eventf(serviceCIDR, Warning,
/// "KubernetesDefaultServiceCIDRInconsistent", "The default ServiceCIDR %v does not match the
/// controller flag configurations %s", …)`, as client-go's `record` package builds it: named
/// `<object>.<nanoseconds in hex>`, in `default` (the object is cluster-scoped), count 1, the
/// controller as source and reporting controller.
pub fn inconsistent_event(
    uid: &str,
    resource_version: &str,
    stored: &[String],
    flags: &[String],
    now: std::time::SystemTime,
) -> serde_json::Value {
    let since_epoch = now
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let at = Time(
        k8s_openapi::jiff::Timestamp::from_second(since_epoch.as_secs() as i64)
            .unwrap_or(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
    );
    // Go's `%v` and `%s` of a []string: `[a b]`.
    let go_list = |list: &[String]| format!("[{}]", list.join(" "));
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": format!("{DEFAULT_NAME}.{:x}", since_epoch.as_nanos()),
            "namespace": "default",
        },
        "involvedObject": {
            "kind": "ServiceCIDR",
            "name": DEFAULT_NAME,
            "uid": uid,
            "apiVersion": "networking.k8s.io/v1",
            "resourceVersion": resource_version,
        },
        "reason": INCONSISTENT_REASON,
        "message": format!(
            "The default ServiceCIDR {} does not match the controller flag configurations {}",
            go_list(stored),
            go_list(flags)
        ),
        "source": {"component": CONTROLLER_NAME},
        "firstTimestamp": at,
        "lastTimestamp": at,
        "count": 1,
        "type": "Warning",
        "eventTime": null,
        "reportingComponent": CONTROLLER_NAME,
        "reportingInstance": "",
    })
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

/// The finalizer kube-controller-manager's ServiceCIDR controller puts on every ServiceCIDR
/// (`pkg/controller/servicecidrs`): the object stays while Services hold addresses only it
/// covers.
pub const FINALIZER: &str = "networking.k8s.io/service-cidr-finalizer";
/// The message of the `Ready` condition the ServiceCIDR controller sets on an added one.
pub const ADDED_READY_MESSAGE: &str = "Kubernetes Service CIDR is ready";
/// The reason of the `Ready=False` condition of a ServiceCIDR being deleted while in use.
pub const TERMINATING_REASON: &str = "Terminating";
/// Its message, as the ServiceCIDR controller writes it.
pub const TERMINATING_MESSAGE: &str = "There are still IPAddresses referencing the ServiceCIDR, please remove them or create a new ServiceCIDR";

/// `%#v` of the internal `networking.ServiceCIDRSpec`, as kube prints it in field errors.
fn go_spec(cidrs: &[String]) -> GoValue<'static> {
    GoValue::Raw(format!(
        "networking.ServiceCIDRSpec{{CIDRs:{}}}",
        GoValue::Strings(cidrs)
    ))
}

/// `ValidateServiceCIDR` (`pkg/apis/networking/validation`, kube 1.33): a DNS subdomain name,
/// one or two CIDRs, two only of different families, each valid as `IsValidCIDR` (strict:
/// canonical, no bits beyond the prefix), in that order and with its texts.
pub fn validate(cidr: &ServiceCIDR) -> Vec<FieldError> {
    let mut errs = validation::object_meta(&cidr.metadata, false, NameRule::Dns1123Subdomain);
    let list = cidrs(cidr);
    if list.is_empty() {
        errs.push(FieldError::required(
            "spec.cidrs",
            "at least one CIDR required",
        ));
        return errs;
    }
    if list.len() > 2 {
        errs.push(FieldError::invalid(
            "spec.cidrs",
            go_spec(&list),
            "may only hold up to 2 values",
        ));
        return errs;
    }
    // `netutils.IsDualStackCIDRStrings`: both parse (sloppily) and are of different families;
    // else this one error and nothing more.
    if list.len() == 2 {
        let families: Vec<Option<bool>> = list
            .iter()
            .map(|c| super::net_validation::parse_cidr_sloppy(c).map(|(ip, _)| ip.is_ipv6()))
            .collect();
        let dual = matches!(families.as_slice(), [Some(a), Some(b)] if a != b);
        if !dual {
            errs.push(FieldError::invalid(
                "spec.cidrs",
                go_spec(&list),
                "may specify no more than one IP for each IP family, i.e 192.168.0.0/24 and 2001:db8::/64",
            ));
            return errs;
        }
    }
    // `IsValidCIDR`, strict as for every new field.
    for (i, text) in list.iter().enumerate() {
        for problem in super::net_validation::cidr_problems(text) {
            errs.push(FieldError::invalid(
                format!("spec.cidrs[{i}]"),
                GoValue::Str(text),
                problem,
            ));
        }
    }
    errs
}

/// `ValidateServiceCIDRUpdate`: the CIDRs do not change, except that a single-stack
/// ServiceCIDR may gain a CIDR of the other family after its own (kube 1.33, for the
/// single- to dual-stack upgrade of the default ServiceCIDR: kubernetes/kubernetes#131261,
/// fixed by #131263 in 1.33; the new CIDR passes [`validate`] like any other).
pub fn validate_update(old: &ServiceCIDR, new: &ServiceCIDR) -> Vec<FieldError> {
    let (before, after) = (cidrs(old), cidrs(new));
    if before == after || (before.len() == 1 && after.len() == 2 && after[0] == before[0]) {
        return Vec::new();
    }
    vec![FieldError::invalid(
        "spec.cidrs",
        GoValue::Strings(&after),
        "field is immutable",
    )]
}

/// The CIDRs of a ServiceCIDR that parse, host bits dropped.
pub fn parsed(cidr: &ServiceCIDR) -> Vec<IpNet> {
    cidrs(cidr)
        .iter()
        .filter_map(|c| c.parse::<IpNet>().ok())
        .map(|c| c.trunc())
        .collect()
}

/// Whether allocation may use it: not being deleted, and Ready (kube's `isReady`: an object
/// without the condition counts as Ready).
pub fn gives_addresses(cidr: &ServiceCIDR) -> bool {
    cidr.metadata.deletion_timestamp.is_none()
        && cidr
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
            .is_none_or(|c| c.status == "True")
}

fn set_ready(cidr: &mut ServiceCIDR, status: &str, reason: &str, message: &str, now: Time) {
    let conditions = cidr
        .status
        .get_or_insert_with(ServiceCIDRStatus::default)
        .conditions
        .get_or_insert_with(Vec::new);
    conditions.retain(|c| c.type_ != "Ready");
    conditions.push(Condition {
        type_: "Ready".to_owned(),
        status: status.to_owned(),
        last_transition_time: now,
        message: message.to_owned(),
        reason: reason.to_owned(),
        observed_generation: None,
    });
}

/// What the ServiceCIDR controller does to a new ServiceCIDR, done in its create: the
/// finalizer and `Ready=True`; allocation starts using it with the same write.
pub fn on_create(cidr: &mut ServiceCIDR, extra: &mut ExtraRanges, now: Time) {
    let finalizers = cidr.metadata.finalizers.get_or_insert_with(Vec::new);
    if !finalizers.iter().any(|f| f == FINALIZER) {
        finalizers.push(FINALIZER.to_owned());
    }
    set_ready(cidr, "True", "", ADDED_READY_MESSAGE, now);
    track(cidr, extra);
}

/// The single- to dual-stack upgrade kube-apiserver 1.33's default ServiceCIDR controller
/// makes on start (`sync` in `pkg/controlplane/controller/defaultservicecidr`, since
/// kubernetes/kubernetes#131263): when the flags name two CIDRs and the stored default holds
/// one, the flags' first, the default takes both. Any other difference is left alone (the
/// operator reconfigures). Returns whether `cidr` was changed.
pub fn upgrade_default(cidr: &mut ServiceCIDR, ranges: &ServiceRanges) -> bool {
    let (stored, flags) = (cidrs(cidr), flag_cidrs(ranges));
    if !(flags.len() == 2 && stored.len() == 1 && stored[0] == flags[0]) {
        return false;
    }
    cidr.spec.get_or_insert_with(ServiceCIDRSpec::default).cidrs = Some(flags);
    true
}

/// [`track`] for any ServiceCIDR, the default one included (its CIDRs beyond the flags', see
/// [`track_default`]).
pub fn track_any(cidr: &ServiceCIDR, ranges: &ServiceRanges, extra: &mut ExtraRanges) {
    if cidr.metadata.name.as_deref() == Some(DEFAULT_NAME) {
        track_default(cidr, ranges, extra);
    } else {
        track(cidr, extra);
    }
}

/// Keeps the allocation's view of `cidr` (its CIDRs, whether it gives addresses) in step.
pub fn track(cidr: &ServiceCIDR, extra: &mut ExtraRanges) {
    let name = cidr.metadata.name.clone().unwrap_or_default();
    if name == DEFAULT_NAME {
        // The flag's ranges, kept in the bitmaps.
        return;
    }
    extra.service_cidrs.insert(
        name,
        ExtraCidr {
            cidrs: parsed(cidr),
            ready: gives_addresses(cidr),
        },
    );
}

/// The finalizer on a ServiceCIDR that lacks it and is not being deleted (one written
/// before this server put it on the default one), as the ServiceCIDR controller adds it to
/// every ServiceCIDR. Returns whether `cidr` changed.
pub fn ensure_finalizer(cidr: &mut ServiceCIDR) -> bool {
    if cidr.metadata.deletion_timestamp.is_some() {
        return false;
    }
    let finalizers = cidr.metadata.finalizers.get_or_insert_with(Vec::new);
    if finalizers.iter().any(|f| f == FINALIZER) {
        return false;
    }
    finalizers.push(FINALIZER.to_owned());
    true
}

/// A ServiceCIDR marked for deletion: if no Service holds an address only it covers, the
/// controller's work is done at once (`true`: remove it now); otherwise it stops giving
/// addresses and says why in its `Ready` condition, and its finalizer keeps it. The default
/// one likewise: its ranges, the flag's included, give no new address meanwhile, and
/// [`crate::registry::Registry::ensure_default_service_cidr`] creates it again once it is
/// gone, as kube-apiserver's default ServiceCIDR controller does.
pub fn on_delete(cidr: &mut ServiceCIDR, allocs: &mut Allocators, now: Time) -> bool {
    let name = cidr.metadata.name.clone().unwrap_or_default();
    if name == DEFAULT_NAME {
        let flags: Vec<IpNet> = std::iter::once(allocs.ips.cidr())
            .chain(allocs.secondary_ips.as_ref().map(|a| a.cidr()))
            .collect();
        track_default_with(cidr, &flags, &mut allocs.extra);
    } else {
        track(cidr, &mut allocs.extra);
    }
    if !in_use(cidr, allocs) {
        if let Some(f) = cidr.metadata.finalizers.as_mut() {
            f.retain(|f| f != FINALIZER);
        }
        allocs.extra.service_cidrs.remove(&name);
        return true;
    }
    set_ready(cidr, "False", TERMINATING_REASON, TERMINATING_MESSAGE, now);
    false
}

/// Whether Services hold addresses of `cidr` that no other Ready range covers.
pub fn in_use(cidr: &ServiceCIDR, allocs: &mut Allocators) -> bool {
    let name = cidr.metadata.name.clone().unwrap_or_default();
    let mut view = allocs.cluster_ips();
    parsed(cidr)
        .into_iter()
        .any(|net| !view.stranded(net, &name).is_empty())
}

/// Forgets a removed ServiceCIDR.
pub fn on_remove(cidr: &ServiceCIDR, extra: &mut ExtraRanges) {
    if let Some(name) = cidr.metadata.name.as_deref() {
        extra.service_cidrs.remove(name);
    }
}

/// The default ServiceCIDR written by an earlier start with other flags: kube-apiserver 1.33
/// does not rewrite it (all API servers must match it; the operator reconfigures, see the
/// "Kubernetes Default Service CIDR Reconfiguration" task of kubernetes.io), and since it
/// allocates from ServiceCIDR objects only, its CIDRs keep giving addresses and the new flag's
/// give none until a ServiceCIDR names them. Here its CIDRs the flags no longer name are
/// tracked like an added ServiceCIDR, so the addresses Services hold there stay allocated and
/// new ones come from them, and the flag's ranges it does not name are marked as giving no
/// address ([`ExtraRanges::unnamed_flag_ranges`]).
/// A default ServiceCIDR being deleted gives no address at all (kube: its allocator is not
/// Ready), the flag's ranges included.
pub fn track_default(cidr: &ServiceCIDR, ranges: &ServiceRanges, extra: &mut ExtraRanges) {
    let flags: Vec<IpNet> = std::iter::once(ranges.cluster_ips)
        .chain(ranges.secondary_cluster_ips)
        .collect();
    track_default_with(cidr, &flags, extra);
}

/// [`track_default`] with the flag's ranges given.
fn track_default_with(cidr: &ServiceCIDR, flags: &[IpNet], extra: &mut ExtraRanges) {
    let held = parsed(cidr);
    let serving = gives_addresses(cidr);
    extra.unnamed_flag_ranges = flags
        .iter()
        .filter(|f| !serving || !held.contains(f))
        .copied()
        .collect();
    let others: Vec<IpNet> = held.into_iter().filter(|c| !flags.contains(c)).collect();
    if others.is_empty() {
        extra.service_cidrs.remove(DEFAULT_NAME);
    } else {
        extra.service_cidrs.insert(
            DEFAULT_NAME.to_owned(),
            ExtraCidr {
                cidrs: others,
                ready: gives_addresses(cidr),
            },
        );
    }
}
