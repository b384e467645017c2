//! Per-kind hooks for the kinds without allocation: defaulting on create and light validation.

use std::net::IpAddr;

use k8s_openapi::api::core::v1::{Namespace, NamespaceSpec, NamespaceStatus};

use super::object::Object;
use super::validation::{self, NameRule};
use crate::error::{FieldError, GoValue};

/// Empty values a client sent for fields Go declares as non-pointer `omitempty` (an empty
/// string, map or list, a zero port): kube-apiserver decodes them into its structs and never
/// writes them back, so neither is stored or answered here.
pub fn drop_zero_values(object: &mut Object) {
    fn none_if<T>(field: &mut Option<T>, empty: impl Fn(&T) -> bool) {
        if field.as_ref().is_some_and(empty) {
            *field = None;
        }
    }
    let meta = object.metadata_mut();
    none_if(&mut meta.labels, |m| m.is_empty());
    none_if(&mut meta.annotations, |m| m.is_empty());
    none_if(&mut meta.finalizers, |v| v.is_empty());
    none_if(&mut meta.owner_references, |v| v.is_empty());
    none_if(&mut meta.generate_name, |s| s.is_empty());
    if let Object::Service(svc) = object
        && let Some(spec) = svc.spec.as_mut()
    {
        none_if(&mut spec.cluster_ip, |s| s.is_empty());
        none_if(&mut spec.cluster_ips, |v| v.is_empty());
        none_if(&mut spec.external_ips, |v| v.is_empty());
        none_if(&mut spec.external_name, |s| s.is_empty());
        none_if(&mut spec.load_balancer_ip, |s| s.is_empty());
        none_if(&mut spec.load_balancer_source_ranges, |v| v.is_empty());
        none_if(&mut spec.selector, |m| m.is_empty());
        none_if(&mut spec.ip_families, |v| v.is_empty());
        none_if(&mut spec.health_check_node_port, |p| *p == 0);
        none_if(&mut spec.publish_not_ready_addresses, |b| !*b);
        for port in spec.ports.iter_mut().flatten() {
            none_if(&mut port.node_port, |p| *p == 0);
            none_if(&mut port.name, |s| s.is_empty());
        }
    }
}

/// `PrepareForCreate` of each kind's strategy.
pub fn prepare_create(object: &mut Object) {
    drop_zero_values(object);
    match object {
        Object::Service(svc) => {
            svc.status = None;
            super::service::set_defaults(svc);
        }
        Object::Namespace(ns) => {
            default_name_label(ns);
            // The namespace strategy adds the `kubernetes` finalizer and starts it Active.
            let spec = ns.spec.get_or_insert_with(NamespaceSpec::default);
            let finalizers = spec.finalizers.get_or_insert_with(Vec::new);
            if !finalizers.iter().any(|f| f == "kubernetes") {
                finalizers.push("kubernetes".into());
            }
            ns.status = Some(NamespaceStatus {
                phase: Some("Active".into()),
                ..Default::default()
            });
        }
        Object::EndpointSlice(slice) => {
            slice.metadata.generation = Some(1);
        }
        Object::Node(_) | Object::Endpoints(_) | Object::ServiceCidr(_) => {}
        Object::Event(_) => {}
        Object::IpAddress(_) => {}
        Object::Role(_)
        | Object::ClusterRole(_)
        | Object::RoleBinding(_)
        | Object::ClusterRoleBinding(_) => crate::authz::validation::set_defaults(object),
    }
}

/// Decode-time defaults that also apply to updates.
pub fn set_defaults(object: &mut Object) {
    drop_zero_values(object);
    match object {
        Object::Service(svc) => super::service::set_defaults(svc),
        Object::Namespace(ns) => default_name_label(ns),
        _ => {}
    }
    crate::authz::validation::set_defaults(object);
}

/// The label every Namespace carries with its own name, `kubernetes.io/metadata.name` (GA in
/// 1.22, so that a NetworkPolicy's `namespaceSelector` can pick a namespace by name): kube's
/// `SetDefaults_Namespace` sets it on every write, whatever the request says.
fn default_name_label(ns: &mut Namespace) {
    if let Some(name) = ns.metadata.name.clone().filter(|n| !n.is_empty()) {
        ns.metadata
            .labels
            .get_or_insert_with(Default::default)
            .insert("kubernetes.io/metadata.name".to_owned(), name);
    }
}

fn valid_ip(s: &str) -> bool {
    s.parse::<IpAddr>().is_ok()
}

fn check_port(errs: &mut Vec<FieldError>, path: &str, port: Option<i32>, protocol: Option<&str>) {
    if let Some(p) = port
        && !(1..=65535).contains(&p)
    {
        errs.push(FieldError::invalid(
            format!("{path}.port"),
            GoValue::Int(p.into()),
            "must be between 1 and 65535, inclusive",
        ));
    }
    if let Some(proto) = protocol
        && !matches!(proto, "TCP" | "UDP" | "SCTP")
    {
        errs.push(FieldError::not_supported(
            format!("{path}.protocol"),
            proto,
            &["SCTP", "TCP", "UDP"],
        ));
    }
}

/// Validation of the kinds other than Service.
pub fn validate(object: &Object) -> Vec<FieldError> {
    match object {
        // Through core/v1; `events.k8s.io/v1` adds its own rules (see `super::event`).
        Object::Event(event) => super::event::validate_create(crate::resource::Kind::Event, event),
        Object::Service(svc) => super::service::validate(svc),
        Object::Namespace(ns) => {
            let mut errs = validation::object_meta(&ns.metadata, false, NameRule::Dns1123Label);
            errs.extend(super::namespace::validate_finalizers(ns));
            errs
        }
        Object::Node(node) => {
            validation::object_meta(&node.metadata, false, NameRule::Dns1123Subdomain)
        }
        Object::ServiceCidr(cidr) => super::service_cidr::validate(cidr),
        Object::IpAddress(ip) => super::ip_addresses::validate(ip),
        Object::Role(_)
        | Object::ClusterRole(_)
        | Object::RoleBinding(_)
        | Object::ClusterRoleBinding(_) => crate::authz::validation::validate(object),
        Object::Endpoints(ep) => {
            let mut errs = validation::object_meta(&ep.metadata, true, NameRule::Dns1123Subdomain);
            for (i, subset) in ep.subsets.iter().flatten().enumerate() {
                for (field, list) in [
                    ("addresses", &subset.addresses),
                    ("notReadyAddresses", &subset.not_ready_addresses),
                ] {
                    for (j, addr) in list.iter().flatten().enumerate() {
                        let path = format!("subsets[{i}].{field}[{j}].ip");
                        if !valid_ip(&addr.ip) {
                            errs.push(FieldError::invalid(
                                path,
                                GoValue::Str(&addr.ip),
                                "must be a valid IP address, (e.g. 10.9.8.7 or 2001:db8::ffff)",
                            ));
                        } else if let Ok(ip) = addr.ip.parse::<std::net::IpAddr>() {
                            // kube's validateEndpointAddress: ValidateNonSpecialIP.
                            errs.extend(super::net_validation::special_ip_errors(
                                &path, &addr.ip, ip,
                            ));
                        }
                    }
                }
                for (j, port) in subset.ports.iter().flatten().enumerate() {
                    check_port(
                        &mut errs,
                        &format!("subsets[{i}].ports[{j}]"),
                        Some(port.port),
                        port.protocol.as_deref(),
                    );
                }
            }
            errs
        }
        Object::EndpointSlice(slice) => {
            let mut errs =
                validation::object_meta(&slice.metadata, true, NameRule::Dns1123Subdomain);
            let address_type = slice.address_type.as_str();
            if !matches!(address_type, "IPv4" | "IPv6" | "FQDN") {
                errs.push(FieldError::not_supported(
                    "addressType",
                    address_type,
                    &["FQDN", "IPv4", "IPv6"],
                ));
            }
            for (i, ep) in slice.endpoints.iter().enumerate() {
                if ep.addresses.is_empty() {
                    errs.push(FieldError::required(
                        format!("endpoints[{i}].addresses"),
                        "must contain at least 1 address",
                    ));
                }
                for (j, addr) in ep.addresses.iter().enumerate() {
                    let ok = match address_type {
                        "IPv4" => addr.parse::<std::net::Ipv4Addr>().is_ok(),
                        "IPv6" => addr.parse::<std::net::Ipv6Addr>().is_ok(),
                        _ => validation::dns1123_subdomain(addr).is_empty(),
                    };
                    if !ok {
                        errs.push(FieldError::invalid(
                            format!("endpoints[{i}].addresses[{j}]"),
                            GoValue::Str(addr),
                            format!("must be a valid {address_type} address"),
                        ));
                    } else if let Ok(ip) = addr.parse::<std::net::IpAddr>() {
                        // kube's validateEndpoints: ValidateEndpointIP after the format.
                        errs.extend(super::net_validation::special_ip_errors(
                            &format!("endpoints[{i}].addresses[{j}]"),
                            addr,
                            ip,
                        ));
                    }
                }
            }
            for (i, port) in slice.ports.iter().flatten().enumerate() {
                check_port(
                    &mut errs,
                    &format!("ports[{i}]"),
                    port.port,
                    port.protocol.as_deref(),
                );
            }
            errs
        }
    }
}
