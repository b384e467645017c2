//! Dual-stack Services: `ipFamilyPolicy`, `ipFamilies` and `clusterIPs` defaulted, validated and
//! allocated as kube-apiserver does it.
//!
//! Ported in behaviour (and in error texts, word for word) from
//! `pkg/registry/core/service/storage/alloc.go` (`initIPFamilyFields`, `allocClusterIPs`,
//! `updateClusterIPs`, `releaseClusterIPs`, `isMatchingPreferDualStackClusterIPFields`) and from
//! `pkg/apis/core/validation/validation.go` (`ValidateServiceClusterIPsRelatedFields`,
//! `validateUpgradeDowngradeClusterIPs`, `validateUpgradeDowngradeIPFamilies`).
//!
//! - A Service that names no policy is `SingleStack` on create, keeps its policy on update,
//!   and a headless Service without selector is `RequireDualStack` (it may list both families
//!   even on a single-stack cluster).
//! - `PreferDualStack` and `RequireDualStack` get the second family when the cluster serves two
//!   (`RequireDualStack` is refused on a single-stack cluster: "this cluster is not configured
//!   for dual-stack services").
//! - An update that adds the second family (upgrade) allocates its address; one that drops it
//!   (downgrade, which needs `ipFamilyPolicy: SingleStack`) releases it with the write. A
//!   `PreferDualStack` Service whose fields are unchanged is never upgraded or downgraded because
//!   the cluster's families changed.
//!
//! Allocation and release work on the writer's working copy of the allocators, so both families
//! are taken and given back in the transaction that saves the Service.

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::{Service, ServiceSpec};

use super::service::ServiceRanges;
use crate::error::{ApiError, FieldError, GoValue};
use crate::resource::Kind;
use crate::store::Allocators;

/// `ipFamilyPolicy: SingleStack`.
pub const SINGLE_STACK: &str = "SingleStack";
/// `ipFamilyPolicy: PreferDualStack`.
pub const PREFER_DUAL_STACK: &str = "PreferDualStack";
/// `ipFamilyPolicy: RequireDualStack`.
pub const REQUIRE_DUAL_STACK: &str = "RequireDualStack";
/// The `IPv4` family.
pub const IPV4: &str = "IPv4";
/// The `IPv6` family.
pub const IPV6: &str = "IPv6";

const NONE: &str = "None";
const EXTERNAL_NAME: &str = "ExternalName";
const IP_FORMAT_HINT: &str = "must be a valid IP address, (e.g. 10.9.8.7 or 2001:db8::ffff)";

/// The family name of an address.
pub fn family_of(ip: IpAddr) -> &'static str {
    if ip.is_ipv6() { IPV6 } else { IPV4 }
}

/// The family of an address written as text; `unknown` if it is none (kube's `familyOf`).
fn family_of_text(ip: &str) -> &'static str {
    ip.parse::<IpAddr>().map_or("unknown", family_of)
}

fn other_family(family: &str) -> &'static str {
    if family == IPV4 { IPV6 } else { IPV4 }
}

fn spec(svc: &Service) -> &ServiceSpec {
    static EMPTY: std::sync::OnceLock<ServiceSpec> = std::sync::OnceLock::new();
    svc.spec
        .as_ref()
        .unwrap_or_else(|| EMPTY.get_or_init(ServiceSpec::default))
}

fn cluster_ips(svc: &Service) -> &[String] {
    spec(svc).cluster_ips.as_deref().unwrap_or_default()
}

fn families(svc: &Service) -> &[String] {
    spec(svc).ip_families.as_deref().unwrap_or_default()
}

fn policy(svc: &Service) -> Option<&str> {
    spec(svc).ip_family_policy.as_deref()
}

fn is_external_name(svc: &Service) -> bool {
    spec(svc).type_.as_deref() == Some(EXTERNAL_NAME)
}

/// kube's `isHeadlessService` of validation: exactly one ClusterIP, `None`.
fn is_headless(svc: &Service) -> bool {
    cluster_ips(svc) == [NONE]
}

fn selectorless(svc: &Service) -> bool {
    spec(svc).selector.as_ref().is_none_or(BTreeMap::is_empty)
}

/// `%#v` of a `[]core.IPFamily`, as kube prints it in field errors.
fn go_families(list: &[String]) -> GoValue<'static> {
    let quoted: Vec<String> = list.iter().map(|f| format!("{f:?}")).collect();
    GoValue::Raw(format!("[]core.IPFamily{{{}}}", quoted.join(", ")))
}

/// The value of `spec.ipFamilyPolicy` in a field error: the policy, or `null`.
fn go_policy(svc: &Service) -> GoValue<'_> {
    match policy(svc) {
        Some(p) => GoValue::Str(p),
        None => GoValue::Raw("null".into()),
    }
}

fn invalid(svc: &Service, errs: Vec<FieldError>) -> ApiError {
    ApiError::invalid(
        Kind::Service.subject(),
        svc.metadata.name.as_deref().unwrap_or(""),
        errs,
    )
}

/// `ValidateServiceClusterIPsRelatedFields`: `clusterIP`/`clusterIPs` agree, each ClusterIP is an
/// address (or a lone `None`), at most one per family, each matching its `ipFamilies` entry;
/// `ipFamilies` hold known, distinct families; `ipFamilyPolicy` is a known policy.
pub fn validate_related_fields(svc: &Service) -> Vec<FieldError> {
    if is_external_name(svc) {
        return Vec::new();
    }
    let mut errs = Vec::new();
    let ips = cluster_ips(svc);
    let cluster_ip = spec(svc).cluster_ip.as_deref().unwrap_or("");
    if !cluster_ip.is_empty() {
        match ips.first() {
            None => errs.push(FieldError::required("spec.clusterIPs", "")),
            Some(first) if first != cluster_ip => errs.push(FieldError::invalid(
                "spec.clusterIPs",
                GoValue::Strings(ips),
                "first value must match `clusterIP`",
            )),
            Some(_) => {}
        }
    } else if !ips.is_empty() {
        errs.push(FieldError::invalid(
            "spec.clusterIPs",
            GoValue::Strings(ips),
            "must be empty when `clusterIP` is not specified",
        ));
    }

    let mut seen = Vec::new();
    for (i, family) in families(svc).iter().enumerate() {
        if family != IPV4 && family != IPV6 {
            errs.push(FieldError::not_supported(
                format!("spec.ipFamilies[{i}]"),
                family,
                &[IPV4, IPV6],
            ));
        }
        if seen.contains(&family) {
            errs.push(FieldError::duplicate(
                format!("spec.ipFamilies[{i}]"),
                GoValue::Str(family),
            ));
        }
        seen.push(family);
    }

    if let Some(p) = policy(svc)
        && !matches!(p, SINGLE_STACK | PREFER_DUAL_STACK | REQUIRE_DUAL_STACK)
    {
        errs.push(FieldError::not_supported(
            "spec.ipFamilyPolicy",
            p,
            &[PREFER_DUAL_STACK, REQUIRE_DUAL_STACK, SINGLE_STACK],
        ));
    }

    let mut has_invalid = false;
    for (i, ip) in ips.iter().enumerate() {
        if i == 0 && ip == NONE {
            if ips.len() > 1 {
                has_invalid = true;
                errs.push(FieldError::invalid(
                    "spec.clusterIPs",
                    GoValue::Strings(ips),
                    "'None' must be the first and only value",
                ));
            }
            continue;
        }
        if ip.parse::<IpAddr>().is_err() {
            has_invalid = true;
            errs.push(FieldError::invalid(
                format!("spec.clusterIPs[{i}]"),
                GoValue::Str(ip),
                IP_FORMAT_HINT,
            ));
        }
    }
    if ips.len() > 2 {
        errs.push(FieldError::invalid(
            "spec.clusterIPs",
            GoValue::Strings(ips),
            "may only hold up to 2 values",
        ));
    }
    if has_invalid {
        return errs;
    }
    if ips.len() > 1 {
        // `IsDualStackIPStrings`: both families present.
        let v6 = ips.iter().filter(|ip| family_of_text(ip) == IPV6).count();
        if v6 == 0 || v6 == ips.len() {
            errs.push(FieldError::invalid(
                "spec.clusterIPs",
                GoValue::Strings(ips),
                "may specify no more than one IP for each IP family",
            ));
        }
    }
    if !is_headless(svc) && !ips.is_empty() {
        for (i, (ip, family)) in ips.iter().zip(families(svc)).enumerate() {
            let actual = family_of_text(ip);
            if family == IPV4 && actual == IPV6 {
                errs.push(FieldError::invalid(
                    format!("spec.clusterIPs[{i}]"),
                    GoValue::Str(ip),
                    format!("expected an IPv4 value as indicated by `ipFamilies[{i}]`"),
                ));
            }
            if family == IPV6 && actual != IPV6 {
                errs.push(FieldError::invalid(
                    format!("spec.clusterIPs[{i}]"),
                    GoValue::Str(ip),
                    format!("expected an IPv6 value as indicated by `ipFamilies[{i}]`"),
                ));
            }
        }
    }
    errs
}

/// `validateUpgradeDowngradeClusterIPs` and `validateUpgradeDowngradeIPFamilies`: the primary
/// ClusterIP and family never change; the secondary may be added, or dropped with
/// `ipFamilyPolicy: SingleStack`.
pub fn validate_upgrade_downgrade(old: &Service, new: &Service) -> Vec<FieldError> {
    let mut errs = Vec::new();
    if is_external_name(old) || is_external_name(new) {
        return errs;
    }
    let (old_headless, new_headless) = (is_headless(old), is_headless(new));
    let (old_ips, new_ips) = (cluster_ips(old), cluster_ips(new));
    let single_stack = policy(new) == Some(SINGLE_STACK);
    if !(old_headless && new_headless) {
        if old_ips.len() == new_ips.len() {
            for (i, (a, b)) in old_ips.iter().zip(new_ips).enumerate() {
                if a != b {
                    errs.push(FieldError::invalid(
                        format!("spec.clusterIPs[{i}]"),
                        GoValue::Strings(new_ips),
                        "may not change once set",
                    ));
                }
            }
        } else if old_ips.len() > new_ips.len() {
            if new_ips.is_empty() {
                errs.push(FieldError::invalid(
                    "spec.clusterIPs[0]",
                    GoValue::Strings(new_ips),
                    "primary clusterIP can not be unset",
                ));
            }
            if let (Some(a), Some(b)) = (old_ips.first(), new_ips.first())
                && a != b
            {
                errs.push(FieldError::invalid(
                    "spec.clusterIPs[0]",
                    GoValue::Strings(new_ips),
                    "may not change once set",
                ));
            }
            if new_ips.len() == 1 && !single_stack {
                errs.push(FieldError::invalid(
                    "spec.ipFamilyPolicy",
                    go_policy(new),
                    "must be set to 'SingleStack' when releasing the secondary clusterIP",
                ));
            }
        } else if let Some(a) = old_ips.first()
            && new_ips.first() != Some(a)
        {
            errs.push(FieldError::invalid(
                "spec.clusterIPs[0]",
                GoValue::Strings(new_ips),
                "may not change once set",
            ));
        }
    }

    // Families: headless Services, and changes to or from headless, may change them.
    if old_headless != new_headless || new_headless {
        return errs;
    }
    let (old_families, new_families) = (families(old), families(new));
    if old_families.len() == new_families.len() {
        for (a, b) in old_families.iter().zip(new_families) {
            if a != b {
                // kube reports every changed entry at index 0.
                errs.push(FieldError::invalid(
                    "spec.ipFamilies[0]",
                    go_families(new_families),
                    "may not change once set",
                ));
            }
        }
    } else if old_families.len() > new_families.len() {
        // kube tests clusterIPs here, not ipFamilies.
        if new_ips.is_empty() {
            errs.push(FieldError::invalid(
                "spec.ipFamilies[0]",
                go_families(new_families),
                "primary ipFamily can not be unset",
            ));
        }
        if let (Some(a), Some(b)) = (old_families.first(), new_families.first())
            && a != b
        {
            errs.push(FieldError::invalid(
                "spec.ipFamilies[0]",
                GoValue::Strings(new_ips),
                "may not change once set",
            ));
        }
        if new_families.len() == 1 && !single_stack {
            errs.push(FieldError::invalid(
                "spec.ipFamilyPolicy",
                go_policy(new),
                "must be set to 'SingleStack' when releasing the secondary ipFamily",
            ));
        }
    } else if let (Some(a), Some(b)) = (old_families.first(), new_families.first())
        && a != b
    {
        errs.push(FieldError::invalid(
            "spec.ipFamilies[0]",
            GoValue::Strings(new_ips),
            "may not change once set",
        ));
    }
    errs
}

/// `isMatchingPreferDualStackClusterIPFields`: an update of a `PreferDualStack` Service that
/// keeps its type, policy, ClusterIPs and families; it is neither upgraded nor downgraded, even
/// if the cluster's families changed since it was created.
fn unchanged_prefer_dual_stack(new: &Service, old: Option<&Service>) -> bool {
    let Some(old) = old else { return false };
    let Some(new_policy) = policy(new) else {
        return false;
    };
    let new_type = spec(new).type_.as_deref().unwrap_or("ClusterIP");
    spec(old).type_.as_deref().unwrap_or("ClusterIP") == new_type
        && matches!(new_type, "ClusterIP" | "NodePort" | "LoadBalancer")
        && new_policy == PREFER_DUAL_STACK
        && policy(old).is_none_or(|p| p == PREFER_DUAL_STACK)
        && cluster_ips(old) == cluster_ips(new)
        && families(old) == families(new)
}

/// `initIPFamilyFields`: defaults `ipFamilyPolicy` and `ipFamilies` from the cluster's
/// families and the Service's ClusterIPs, and refuses what the cluster cannot serve. `old` is
/// the stored Service on an update.
pub fn init_fields(
    svc: &mut Service,
    old: Option<&Service>,
    ranges: &ServiceRanges,
) -> Result<(), ApiError> {
    if is_external_name(svc) || unchanged_prefer_dual_stack(svc, old) {
        return Ok(());
    }
    let headless_selectorless = spec(svc).cluster_ip.as_deref() == Some(NONE) && selectorless(svc);
    {
        let spec = svc.spec.get_or_insert_with(ServiceSpec::default);
        if spec.ip_family_policy.is_none() {
            spec.ip_family_policy = Some(
                match old.and_then(policy) {
                    Some(p) => p,
                    None if headless_selectorless => REQUIRE_DUAL_STACK,
                    None => SINGLE_STACK,
                }
                .to_owned(),
            );
        }
    }
    let errs = validate_related_fields(svc);
    if !errs.is_empty() {
        return Err(invalid(svc, errs));
    }

    let mut errs = Vec::new();
    let single_stack = policy(svc) == Some(SINGLE_STACK);
    if let Some(old) = old {
        if single_stack {
            // Setting SingleStack with the fields as they were is clear intent: keep the
            // primary only.
            let same_ips = cluster_ips(old) == cluster_ips(svc);
            let same_families = families(old) == families(svc);
            let spec = svc.spec.get_or_insert_with(ServiceSpec::default);
            if same_ips && let Some(ips) = spec.cluster_ips.as_mut() {
                ips.truncate(1);
            }
            if same_families && let Some(f) = spec.ip_families.as_mut() {
                f.truncate(1);
            }
        } else {
            if !cluster_ips(svc).is_empty() && cluster_ips(svc).len() < cluster_ips(old).len() {
                errs.push(FieldError::invalid(
                    "spec.ipFamilyPolicy",
                    go_policy(svc),
                    "must be 'SingleStack' to release the secondary cluster IP",
                ));
            }
            if !families(svc).is_empty() && families(svc).len() < families(old).len() {
                errs.push(FieldError::invalid(
                    "spec.ipFamilyPolicy",
                    go_policy(svc),
                    "must be 'SingleStack' to release the secondary IP family",
                ));
            }
        }
    }
    if single_stack {
        if cluster_ips(svc).len() == 2 {
            errs.push(FieldError::invalid(
                "spec.ipFamilyPolicy",
                go_policy(svc),
                "must be 'RequireDualStack' or 'PreferDualStack' when multiple cluster IPs are specified",
            ));
        }
        if families(svc).len() == 2 {
            errs.push(FieldError::invalid(
                "spec.ipFamilyPolicy",
                go_policy(svc),
                "must be 'RequireDualStack' or 'PreferDualStack' when multiple IP families are specified",
            ));
        }
    }
    // Families follow from the ClusterIPs asked for.
    let ips = cluster_ips(svc).to_vec();
    let mut inferred = families(svc).to_vec();
    for (i, ip) in ips.iter().enumerate() {
        if ip == NONE {
            break;
        }
        let family = family_of_text(ip);
        if i >= inferred.len() {
            if ranges.serves(family) {
                inferred.push(family.to_owned());
            } else {
                errs.push(FieldError::invalid(
                    format!("spec.clusterIPs[{i}]"),
                    GoValue::Strings(&ips),
                    format!("{family} is not configured on this cluster"),
                ));
            }
        }
    }
    if !errs.is_empty() {
        return Err(invalid(svc, errs));
    }
    let policy_now = policy(svc).unwrap_or(SINGLE_STACK).to_owned();
    let spec = svc.spec.get_or_insert_with(ServiceSpec::default);
    spec.ip_families = (!inferred.is_empty()).then_some(inferred);

    // Headless without selector: may list both families, even on a single-stack cluster.
    if headless_selectorless {
        let families = spec.ip_families.get_or_insert_with(Vec::new);
        if families.is_empty() {
            families.push(ranges.family().to_owned());
        }
        if families.len() < 2 && policy_now != SINGLE_STACK {
            let other = other_family(&families[0]);
            families.push(other.to_owned());
        }
        return Ok(());
    }

    let mut errs = Vec::new();
    if policy_now == REQUIRE_DUAL_STACK && !ranges.is_dual_stack() {
        errs.push(FieldError::invalid(
            "spec.ipFamilyPolicy",
            GoValue::Str(REQUIRE_DUAL_STACK),
            "this cluster is not configured for dual-stack services",
        ));
    }
    for (i, family) in spec.ip_families.iter().flatten().enumerate() {
        if !ranges.serves(family) {
            errs.push(FieldError::invalid(
                format!("spec.ipFamilies[{i}]"),
                GoValue::Str(family),
                "not configured on this cluster",
            ));
        }
    }
    if !errs.is_empty() {
        return Err(invalid(svc, errs));
    }
    let spec = svc.spec.get_or_insert_with(ServiceSpec::default);
    let families = spec.ip_families.get_or_insert_with(Vec::new);
    if families.is_empty() {
        families.push(ranges.family().to_owned());
    }
    if policy_now != SINGLE_STACK && families.len() == 1 && ranges.is_dual_stack() {
        let other = other_family(&families[0]);
        families.push(other.to_owned());
    }
    Ok(())
}

/// Takes `ip` (or, if empty, the next free address) from the allocator of `family`: kube's
/// `allocIPs`, with its 500 for a full range and its 422 for an address refused.
fn allocate_one(
    svc: &Service,
    allocs: &mut Allocators,
    family: &str,
    ip: &str,
) -> Result<String, ApiError> {
    // init_fields refuses families the cluster does not serve.
    let mut allocator = allocs.cluster_ips();
    if ip.is_empty() {
        return allocator
            .allocate_next(family == IPV6)
            .map(|ip| ip.to_string())
            .map_err(|e| ApiError::internal(format!("failed to allocate a serviceIP: {e}")));
    }
    let refused = |detail: String| {
        invalid(
            svc,
            vec![FieldError::invalid(
                "spec.clusterIPs",
                GoValue::Strings(cluster_ips(svc)),
                format!("failed to allocate IP {ip}: {detail}"),
            )],
        )
    };
    let parsed: IpAddr = ip
        .parse()
        .map_err(|_| refused(format!("{ip:?} is not an IP address")))?;
    allocator
        .allocate(parsed)
        .map_err(|e| refused(e.to_string()))?;
    Ok(ip.to_owned())
}

/// `allocClusterIPs`: one ClusterIP per family of `ipFamilies`, as asked for or picked; none
/// for a headless Service.
pub fn allocate(svc: &mut Service, allocs: &mut Allocators) -> Result<(), ApiError> {
    if is_external_name(svc) || cluster_ips(svc).first().map(String::as_str) == Some(NONE) {
        return Ok(());
    }
    let families = families(svc).to_vec();
    let mut ips = cluster_ips(svc).to_vec();
    ips.resize(ips.len().max(families.len()), String::new());
    for (i, family) in families.iter().enumerate() {
        ips[i] = allocate_one(svc, allocs, family, &ips[i])?;
    }
    let spec = svc.spec.get_or_insert_with(ServiceSpec::default);
    spec.cluster_ip = ips.first().cloned();
    spec.cluster_ips = (!ips.is_empty()).then_some(ips);
    Ok(())
}

/// `updateClusterIPs`: allocates for a change from ExternalName, releases for a change to it,
/// allocates the secondary on an upgrade and releases it on a downgrade. Releases happen in the
/// working copy, so they take effect only with the write.
pub fn update(old: &Service, new: &mut Service, allocs: &mut Allocators) -> Result<(), ApiError> {
    if unchanged_prefer_dual_stack(new, Some(old)) {
        return Ok(());
    }
    if is_external_name(old) && !is_external_name(new) {
        return allocate(new, allocs);
    }
    if cluster_ips(old).first().map(String::as_str) == Some(NONE) {
        return Ok(());
    }
    if !is_external_name(old) && is_external_name(new) {
        release(old, allocs);
        return Ok(());
    }
    let (old_families, new_families) = (families(old).len(), families(new).len());
    if old_families == 1 && new_families == 2 {
        let family = families(new)[1].clone();
        let mut ips = cluster_ips(new).to_vec();
        if ips.len() < 2 {
            ips.resize(2, String::new());
        }
        ips[1] = allocate_one(new, allocs, &family, &ips[1])?;
        let spec = new.spec.get_or_insert_with(ServiceSpec::default);
        spec.cluster_ips = Some(ips);
    } else if old_families == 2
        && new_families == 1
        && let Some(ip) = cluster_ips(old).get(1).and_then(|ip| ip.parse().ok())
    {
        allocs.release_ip(ip);
    }
    Ok(())
}

/// `releaseClusterIPs`: gives back every ClusterIP of a Service (none for ExternalName or
/// headless ones).
pub fn release(svc: &Service, allocs: &mut Allocators) {
    for ip in cluster_ips(svc) {
        if let Ok(ip) = ip.parse::<IpAddr>() {
            allocs.release_ip(ip);
        }
    }
}
