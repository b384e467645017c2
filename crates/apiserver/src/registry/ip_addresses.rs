//! `networking.k8s.io/v1` IPAddress objects, as kube-apiserver 1.33's allocator writes them
//! (`pkg/registry/core/service/ipallocator/ipallocator.go`): one per allocated ClusterIP, named
//! by the address, labelled with its family and `ipallocator.k8s.io` as manager, with
//! `spec.parentRef` to the Service; written and removed in the transaction that saves the
//! Service, so `kubectl get ipaddresses` always equals the Services' ClusterIPs.
//!
//! As in kube 1.33 the objects are the truth of allocation: a ClusterIP is allocated by
//! creating its object, which the commit accepts only if no object of that name exists
//! ([`crate::store::Txn::create`], a compare on both stores, across API servers), and released
//! by deleting it. The bitmaps and the added ServiceCIDRs' allocation document
//! ([`crate::cidr_ranges`]) are a cache of the objects kept in the same transactions (kube 1.33
//! dual-writes the legacy bitmap too): they propose a free address, the object's creation
//! decides, and an address a failed creation finds taken is marked in them before the write is
//! run again (the cache is corrected from the objects, never the other way).
//!
//! A user may create one to reserve an address (kube's way to keep an address from the
//! allocator): the address is taken with the write, and given back when that object goes.
//! The verification loop re-creates a missing one and removes a stale one, as kube's repair
//! loop does, and marks in the bitmaps the addresses objects hold that they had free.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::networking::v1::{IPAddress, IPAddressSpec, ParentReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::net_validation;
use super::object::Object;
use super::service;
use super::validation::{self, NameRule};
use crate::error::{FieldError, FieldErrorKind, GoValue};
use crate::resource::Kind;
use crate::store::{Allocators, Txn};

/// The label naming the manager of an IPAddress.
pub const MANAGED_BY_LABEL: &str = "ipaddress.kubernetes.io/managed-by";
/// kube-apiserver's allocator as manager (`ipallocator.k8s.io`).
pub const MANAGED_BY: &str = "ipallocator.k8s.io";
/// The label carrying the address's family.
pub const FAMILY_LABEL: &str = "ipaddress.kubernetes.io/ip-family";

/// The address an IPAddress object names, if its name is one in canonical form.
pub fn address(ip: &IPAddress) -> Option<IpAddr> {
    let name = ip.metadata.name.as_deref()?;
    name.parse::<IpAddr>()
        .ok()
        .filter(|parsed| parsed.to_string() == name)
}

/// Whether the allocator wrote it (else it is a user's reservation).
pub fn managed(ip: &IPAddress) -> bool {
    ip.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(MANAGED_BY_LABEL))
        .is_some_and(|v| v == MANAGED_BY)
}

/// kube's IPAddress validation: the name is an address in canonical form, and
/// `spec.parentRef` names a resource and an object.
pub fn validate(ip: &IPAddress) -> Vec<FieldError> {
    // The name rules are `ValidateIPAddressName` (`IsValidIP`), not a DNS subdomain's: only
    // the common metadata checks and "name or generateName is required" are kept.
    let mut errs: Vec<FieldError> =
        validation::object_meta(&ip.metadata, false, NameRule::Dns1123Subdomain)
            .into_iter()
            .filter(|e| e.field != "metadata.name" || e.kind == FieldErrorKind::Required)
            .collect();
    let name = ip.metadata.name.as_deref().unwrap_or("");
    if !name.is_empty() {
        for problem in net_validation::ip_problems(name) {
            errs.push(FieldError::invalid(
                "metadata.name",
                GoValue::Str(name),
                problem,
            ));
        }
    }
    match ip.spec.as_ref().map(|s| &s.parent_ref) {
        None => errs.push(FieldError::required("spec.parentRef", "")),
        Some(parent) => {
            // `validateIPAddressParentReference`: the group (the core group is empty) a DNS
            // subdomain, resource and name required path segments, the namespace optional.
            let group = parent.group.as_deref().unwrap_or("");
            if !group.is_empty() {
                for problem in validation::dns1123_subdomain(group) {
                    errs.push(FieldError::invalid(
                        "spec.parentRef.group",
                        GoValue::Str(group),
                        problem,
                    ));
                }
            }
            for (field, value, required) in [
                ("resource", parent.resource.as_str(), true),
                ("name", parent.name.as_str(), true),
                (
                    "namespace",
                    parent.namespace.as_deref().unwrap_or(""),
                    false,
                ),
            ] {
                let path = format!("spec.parentRef.{field}");
                if value.is_empty() {
                    if required {
                        errs.push(FieldError::required(path, ""));
                    }
                    continue;
                }
                for problem in path_segment_problems(value) {
                    errs.push(FieldError::invalid(
                        path.clone(),
                        GoValue::Str(value),
                        problem,
                    ));
                }
            }
        }
    }
    errs
}

/// apimachinery's `path.IsValidPathSegmentName`, with its texts.
fn path_segment_problems(name: &str) -> Vec<String> {
    if name == "." || name == ".." {
        return vec![format!("may not be '{name}'")];
    }
    let mut problems = Vec::new();
    for illegal in ["/", "%"] {
        if name.contains(illegal) {
            problems.push(format!("may not contain '{illegal}'"));
        }
    }
    problems
}

/// The object the allocator writes for `ip` of `svc`.
pub fn for_service(ip: IpAddr, svc: &Service) -> IPAddress {
    let family = if ip.is_ipv6() { "IPv6" } else { "IPv4" };
    IPAddress {
        metadata: ObjectMeta {
            name: Some(ip.to_string()),
            uid: Some(super::new_uid()),
            creation_timestamp: Some(super::now()),
            generation: Some(1),
            labels: Some(BTreeMap::from([
                (FAMILY_LABEL.to_owned(), family.to_owned()),
                (MANAGED_BY_LABEL.to_owned(), MANAGED_BY.to_owned()),
            ])),
            ..Default::default()
        },
        spec: Some(IPAddressSpec {
            parent_ref: ParentReference {
                group: Some(String::new()),
                resource: "services".to_owned(),
                namespace: svc.metadata.namespace.clone(),
                name: svc.metadata.name.clone().unwrap_or_default(),
            },
        }),
    }
}

fn held(svc: Option<&Service>) -> BTreeSet<IpAddr> {
    svc.map(|s| service::held(s).0.into_iter().collect())
        .unwrap_or_default()
}

/// Writes the IPAddress objects of a Service's change, from `before` to `after` (`None`: it
/// did not exist, or goes): objects of released addresses are deleted, objects of allocated
/// ones created.
pub fn sync(txn: &mut Txn<'_>, prefix: &str, before: Option<&Service>, after: Option<&Service>) {
    let (old, new) = (held(before), held(after));
    for ip in old.difference(&new) {
        // Only a key the write declared (and so compares) can be deleted; one it did not
        // declare reads as absent and is left to the verification loop.
        let key = Kind::IpAddress.key(prefix, None, &ip.to_string());
        if txn.get(&key).is_some() {
            txn.delete(key);
        }
    }
    if let Some(svc) = after {
        for ip in new.difference(&old) {
            // Created, never overwritten: an existing object holds the address.
            let object = Object::IpAddress(Box::new(for_service(*ip, svc)));
            txn.create(
                Kind::IpAddress.key(prefix, None, &ip.to_string()),
                super::encode_stored(&object),
            );
        }
    }
}

/// A user's IPAddress: its address is taken with the write (`false`: it is already taken).
/// One outside every ServiceCIDR is stored without taking anything, as kube stores it.
pub fn reserve(ip: &IPAddress, allocs: &mut Allocators) -> bool {
    let Some(address) = address(ip) else {
        return true;
    };
    !matches!(
        allocs.cluster_ips().allocate(address),
        Err(nodeport_alloc::ip::Error::Allocated)
    )
}

/// An IPAddress removed: a reservation gives its address back; the allocator's own objects
/// leave the address to the Service that holds it (the verification loop writes the object
/// again).
pub fn on_remove(ip: &IPAddress, allocs: &mut Allocators) {
    if !managed(ip)
        && let Some(address) = address(ip)
    {
        allocs.cluster_ips().release(address);
    }
}

/// `ValidateIPAddressUpdate`: the parent never changes (`ValidateImmutableField`, printed as Go
/// prints the `*networking.ParentReference`).
pub fn validate_update(old: &IPAddress, new: &IPAddress) -> Vec<FieldError> {
    let parent = |ip: &IPAddress| ip.spec.as_ref().map(|s| s.parent_ref.clone());
    let (before, after) = (parent(old), parent(new));
    if before == after {
        return Vec::new();
    }
    let shown = match &after {
        Some(p) => format!(
            "&networking.ParentReference{{Group:{:?}, Resource:{:?}, Namespace:{:?}, Name:{:?}}}",
            p.group.as_deref().unwrap_or(""),
            p.resource,
            p.namespace.as_deref().unwrap_or(""),
            p.name
        ),
        None => "null".to_owned(),
    };
    vec![FieldError::invalid(
        "spec.parentRef",
        GoValue::Raw(shown),
        "field is immutable",
    )]
}
