//! Service semantics: defaulting, NodePort and ClusterIP allocation, validation.
//!
//! Mirrors kube-apiserver (`pkg/apis/core/v1/defaults.go`, `pkg/registry/core/service/storage/
//! alloc.go` and `storage.go`, `pkg/apis/core/validation/validation.go`), in its order:
//! defaulting at decode time, then allocation (`BeginCreate`/`BeginUpdate`), then
//! `PrepareForUpdate` (`dropTypeDependentFields`), then validation. So an allocation error is
//! reported instead of, not besides, ordinary validation errors, exactly as kube-apiserver does.
//!
//! Allocation works on the writer's working copy of the allocators ([`crate::store::Txn`]): when
//! validation or the write fails the copy is dropped, which is kube-apiserver's `txn.Revert()`
//! without the window in which a crash leaks; releases of an update take effect only with the
//! write, which is its deferred `Commit()`.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::IpAddr;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::{
    ClientIPConfig, LoadBalancerStatus, Service, ServicePort, ServiceSpec, ServiceStatus,
    SessionAffinityConfig,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use nodeport_alloc::port;

use super::ip_families;
use super::net_validation;
use super::validation::{self, NameRule};
use crate::error::{ApiError, FieldError, GoValue};
use crate::resource::Kind;
use crate::store::Allocators;

const CLUSTER_IP: &str = "ClusterIP";
const NODE_PORT: &str = "NodePort";
const LOAD_BALANCER: &str = "LoadBalancer";
const EXTERNAL_NAME: &str = "ExternalName";
/// kube's default ClientIP affinity timeout (`DefaultClientIPServiceAffinitySeconds`), 3 hours.
pub const DEFAULT_AFFINITY_TIMEOUT: i32 = 10800;
const MAX_AFFINITY_TIMEOUT: i32 = 86400;
const IP_FORMAT_HINT: &str = "must be a valid IP address, (e.g. 10.9.8.7 or 2001:db8::ffff)";

/// The cluster facts Service handling depends on.
#[derive(Debug, Clone)]
pub struct ServiceRanges {
    /// `--service-node-port-range`.
    pub node_ports: nodeport_alloc::PortRange,
    /// `--service-cluster-ip-range`, its first (primary) CIDR.
    pub cluster_ips: IpNet,
    /// The second CIDR of a dual-stack `--service-cluster-ip-range`, of the other family.
    pub secondary_cluster_ips: Option<IpNet>,
}

impl ServiceRanges {
    /// `IPv4` or `IPv6`: the primary family, the one of single-stack Services by default.
    pub fn family(&self) -> &'static str {
        match self.cluster_ips {
            IpNet::V4(_) => "IPv4",
            IpNet::V6(_) => "IPv6",
        }
    }

    /// Whether the cluster serves two families.
    pub fn is_dual_stack(&self) -> bool {
        self.secondary_cluster_ips.is_some()
    }

    /// Whether the cluster serves `family` (`IPv4` or `IPv6`).
    pub fn serves(&self, family: &str) -> bool {
        let name = |net: &IpNet| if net.addr().is_ipv6() { "IPv6" } else { "IPv4" };
        name(&self.cluster_ips) == family
            || self.secondary_cluster_ips.as_ref().map(name) == Some(family)
    }

    /// The ranges the writer's allocators cover.
    pub fn store_ranges(&self) -> crate::store::Ranges {
        crate::store::Ranges {
            node_ports: self.node_ports,
            cluster_ips: self.cluster_ips,
            secondary_cluster_ips: self.secondary_cluster_ips,
        }
    }
}

fn spec_type(svc: &Service) -> &str {
    svc.spec
        .as_ref()
        .and_then(|s| s.type_.as_deref())
        .unwrap_or(CLUSTER_IP)
}

fn spec(svc: &Service) -> &ServiceSpec {
    static EMPTY: std::sync::OnceLock<ServiceSpec> = std::sync::OnceLock::new();
    svc.spec
        .as_ref()
        .unwrap_or_else(|| EMPTY.get_or_init(ServiceSpec::default))
}

fn ports(svc: &Service) -> &[ServicePort] {
    spec(svc).ports.as_deref().unwrap_or(&[])
}

/// Whether the Service gets ClusterIPs (every type but ExternalName).
pub fn needs_cluster_ip(svc: &Service) -> bool {
    spec_type(svc) != EXTERNAL_NAME
}

/// Whether the Service gets NodePorts (NodePort and LoadBalancer).
pub fn needs_node_port(svc: &Service) -> bool {
    matches!(spec_type(svc), NODE_PORT | LOAD_BALANCER)
}

/// `NeedsHealthCheck`: LoadBalancer with `externalTrafficPolicy: Local`.
pub fn needs_health_check(svc: &Service) -> bool {
    spec_type(svc) == LOAD_BALANCER && spec(svc).external_traffic_policy.as_deref() == Some("Local")
}

fn externally_accessible(svc: &Service) -> bool {
    match spec_type(svc) {
        NODE_PORT | LOAD_BALANCER => true,
        CLUSTER_IP => spec(svc)
            .external_ips
            .as_ref()
            .is_some_and(|ips| !ips.is_empty()),
        _ => false,
    }
}

fn allocates_lb_node_ports(svc: &Service) -> bool {
    spec_type(svc) != LOAD_BALANCER || spec(svc).allocate_load_balancer_node_ports != Some(false)
}

fn is_headless(svc: &Service) -> bool {
    spec(svc).cluster_ip.as_deref() == Some("None")
}

fn protocol(p: &ServicePort) -> &str {
    p.protocol.as_deref().unwrap_or("TCP")
}

/// `SetDefaults_Service` plus the registry's status reset: what a Service looks like after
/// decoding.
pub fn set_defaults(svc: &mut Service) {
    let spec = svc.spec.get_or_insert_with(ServiceSpec::default);
    if spec.session_affinity.as_deref().unwrap_or("").is_empty() {
        spec.session_affinity = Some("None".into());
    }
    if spec.session_affinity.as_deref() == Some("None") {
        spec.session_affinity_config = None;
    }
    if spec.session_affinity.as_deref() == Some("ClientIP") {
        let cfg = spec
            .session_affinity_config
            .get_or_insert_with(SessionAffinityConfig::default);
        let client = cfg.client_ip.get_or_insert_with(ClientIPConfig::default);
        client
            .timeout_seconds
            .get_or_insert(DEFAULT_AFFINITY_TIMEOUT);
    }
    if spec.type_.as_deref().unwrap_or("").is_empty() {
        spec.type_ = Some(CLUSTER_IP.into());
    }
    for p in spec.ports.iter_mut().flatten() {
        if p.protocol.as_deref().unwrap_or("").is_empty() {
            p.protocol = Some("TCP".into());
        }
        let unset = match &p.target_port {
            None => true,
            Some(IntOrString::Int(0)) => true,
            Some(IntOrString::String(s)) => s.is_empty(),
            Some(IntOrString::Int(_)) => false,
        };
        if unset {
            p.target_port = Some(IntOrString::Int(p.port));
        }
    }
    let svc_type = spec.type_.clone().unwrap_or_default();
    let accessible = matches!(svc_type.as_str(), NODE_PORT | LOAD_BALANCER)
        || (svc_type == CLUSTER_IP && spec.external_ips.as_ref().is_some_and(|v| !v.is_empty()));
    if accessible
        && spec
            .external_traffic_policy
            .as_deref()
            .unwrap_or("")
            .is_empty()
    {
        spec.external_traffic_policy = Some("Cluster".into());
    }
    if spec.internal_traffic_policy.is_none()
        && matches!(svc_type.as_str(), NODE_PORT | LOAD_BALANCER | CLUSTER_IP)
    {
        spec.internal_traffic_policy = Some("Cluster".into());
    }
    if svc_type == LOAD_BALANCER && spec.allocate_load_balancer_node_ports.is_none() {
        spec.allocate_load_balancer_node_ports = Some(true);
    }
    if svc.status.is_none() {
        svc.status = Some(ServiceStatus {
            load_balancer: Some(LoadBalancerStatus::default()),
            ..ServiceStatus::default()
        });
    }
    // An ingress IP without a mode is a VIP (SetDefaults_Service, LoadBalancerIPMode).
    let ingress = svc
        .status
        .as_mut()
        .and_then(|s| s.load_balancer.as_mut())
        .and_then(|lb| lb.ingress.as_mut());
    for ing in ingress.into_iter().flatten() {
        if ing.ip.as_deref().is_some_and(|ip| !ip.is_empty()) && ing.ip_mode.is_none() {
            ing.ip_mode = Some("VIP".into());
        }
    }
}

/// `normalizeClusterIPs` for a create: `clusterIP` and `clusterIPs[0]` tell the same story.
fn normalize_cluster_ips(spec: &mut ServiceSpec) {
    let ip = spec.cluster_ip.clone().unwrap_or_default();
    let ips = spec.cluster_ips.clone().unwrap_or_default();
    if !ip.is_empty() && ips.is_empty() {
        spec.cluster_ips = Some(vec![ip]);
    } else if ip.is_empty() && !ips.is_empty() {
        spec.cluster_ip = Some(ips[0].clone());
    }
}

/// `normalizeClusterIPs` for an update (after the old values were patched in): a client that
/// changes only `clusterIP` means `clusterIPs` to follow it, and one that clears `clusterIP`
/// with `clusterIPs` untouched means both. Validation then judges the result, so changing the
/// ClusterIP reads as kube-apiserver's "may not change once set" on `clusterIPs[0]`.
fn normalize_cluster_ips_update(old: &ServiceSpec, new: &mut ServiceSpec) {
    let old_ip = old.cluster_ip.as_deref().unwrap_or("");
    let new_ip = new.cluster_ip.clone().unwrap_or_default();
    let old_ips = old.cluster_ips.as_deref().unwrap_or_default();
    if !old_ips.is_empty() && new.cluster_ips.as_ref().is_none_or(Vec::is_empty) && old_ip == new_ip
    {
        new.cluster_ips = old.cluster_ips.clone();
    }
    if old_ip != new_ip {
        let same_ips = new.cluster_ips.as_deref().unwrap_or_default() == old_ips;
        if !old_ip.is_empty() && new_ip.is_empty() {
            if same_ips {
                new.cluster_ips = None;
            }
        } else if same_ips {
            new.cluster_ips = Some(vec![new_ip]);
        }
    }
}

fn invalid(name: &str, errs: Vec<FieldError>) -> ApiError {
    ApiError::invalid(Kind::Service.subject(), name, errs)
}

fn node_port_error(name: &str, index: usize, node_port: i32, err: &port::Error) -> ApiError {
    invalid(
        name,
        vec![FieldError::invalid(
            format!("spec.ports[{index}].nodePort"),
            GoValue::Int(node_port.into()),
            err.to_string(),
        )],
    )
}

/// Allocates one explicitly requested nodePort; values that are not ports at all are "not in the
/// valid range", as the allocator (not validation) reports them in kube-apiserver.
fn allocate_port(allocs: &mut Allocators, value: i32) -> Result<u16, port::Error> {
    let range = allocs.ports.range();
    match u16::try_from(value) {
        Ok(p) if p != 0 => allocs.ports.allocate(p).map(|()| p),
        _ => Err(port::Error::NotInRange {
            range: range.to_string(),
        }),
    }
}

/// NodePorts on create (`initNodePorts`): one per `port` number, shared by the TCP and UDP
/// entries of that number, static if any entry of the number asks for one.
fn allocate_node_ports_create(svc: &mut Service, allocs: &mut Allocators) -> Result<(), ApiError> {
    let name = svc.metadata.name.clone().unwrap_or_default();
    let allocate_dynamic = allocates_lb_node_ports(svc);
    let ports = svc
        .spec
        .as_mut()
        .and_then(|s| s.ports.as_mut())
        .map(Vec::as_mut_slice)
        .unwrap_or_default();
    let mut by_port_number: HashMap<i32, i32> = HashMap::new();
    for i in 0..ports.len() {
        let requested = ports[i].node_port.unwrap_or(0);
        if !allocate_dynamic && requested == 0 {
            // "Don't allocate new ports, but do respect specific requests."
            continue;
        }
        match by_port_number.get(&ports[i].port).copied() {
            None => {
                // `findRequestedNodePort`: a nodePort asked for by this entry or a later one of
                // the same port number (TCP and UDP of port 53 share it). A failure is reported
                // at this entry, as kube-apiserver reports it, even if a later one asked.
                let wanted = if requested != 0 {
                    Some(requested)
                } else {
                    ports[i..]
                        .iter()
                        .find(|p| p.port == ports[i].port && p.node_port.unwrap_or(0) != 0)
                        .and_then(|p| p.node_port)
                };
                let np = match wanted {
                    Some(np) => {
                        allocate_port(allocs, np).map_err(|e| node_port_error(&name, i, np, &e))?;
                        np
                    }
                    None => i32::from(allocs.ports.allocate_next().map_err(|e| {
                        ApiError::internal(format!("failed to allocate a nodePort: {e}"))
                    })?),
                };
                by_port_number.insert(ports[i].port, np);
                ports[i].node_port = Some(np);
            }
            Some(shared) => {
                if requested == 0 {
                    ports[i].node_port = Some(shared);
                } else if requested != shared {
                    allocate_port(allocs, requested)
                        .map_err(|e| node_port_error(&name, i, requested, &e))?;
                }
            }
        }
    }
    Ok(())
}

fn allocate_health_check(svc: &mut Service, allocs: &mut Allocators) -> Result<(), ApiError> {
    let spec = svc.spec.get_or_insert_with(ServiceSpec::default);
    match spec.health_check_node_port.unwrap_or(0) {
        0 => {
            let np = allocs.ports.allocate_next().map_err(|e| {
                ApiError::internal(format!("failed to allocate a HealthCheck NodePort 0: {e}"))
            })?;
            spec.health_check_node_port = Some(np.into());
        }
        np => {
            allocate_port(allocs, np).map_err(|e| {
                ApiError::internal(format!(
                    "failed to allocate requested HealthCheck NodePort {np}: {e}"
                ))
            })?;
        }
    }
    Ok(())
}

/// `BeginCreate` then `Validate`: allocates what the Service needs, then validates it.
pub fn create(
    svc: &mut Service,
    allocs: &mut Allocators,
    ranges: &ServiceRanges,
) -> Result<(), ApiError> {
    let name = svc.metadata.name.clone().unwrap_or_default();
    if needs_cluster_ip(svc) {
        normalize_cluster_ips(svc.spec.get_or_insert_with(ServiceSpec::default));
        ip_families::init_fields(svc, None, ranges)?;
        ip_families::allocate(svc, allocs)?;
    }
    if needs_node_port(svc) {
        allocate_node_ports_create(svc, allocs)?;
    }
    if needs_health_check(svc) {
        allocate_health_check(svc, allocs)?;
    }
    let errs = validate(svc);
    if !errs.is_empty() {
        return Err(invalid(&name, errs));
    }
    Ok(())
}

/// `patchAllocatedValues`: lets a client resubmit an object without the allocated values.
fn patch_allocated_values(old: &Service, new: &mut Service) {
    let old_needs_np = needs_node_port(old);
    let old_needs_hc = needs_health_check(old);
    let new_needs_np = needs_node_port(new);
    let new_needs_hc = needs_health_check(new);
    let new_allocates = allocates_lb_node_ports(new);
    let old_spec = spec(old).clone();
    let both_need_ip = needs_cluster_ip(old) && needs_cluster_ip(new);
    let used_old: HashSet<i32> = ports(old)
        .iter()
        .filter_map(|p| p.node_port)
        .filter(|n| *n != 0)
        .collect();
    let used_new: HashSet<i32> = ports(new)
        .iter()
        .filter_map(|p| p.node_port)
        .filter(|n| *n != 0)
        .collect();
    let spec = new.spec.get_or_insert_with(ServiceSpec::default);
    if both_need_ip {
        if spec.cluster_ip.as_deref().unwrap_or("").is_empty() {
            spec.cluster_ip = old_spec.cluster_ip.clone();
        }
        if spec.cluster_ips.as_ref().is_none_or(Vec::is_empty) {
            spec.cluster_ips = old_spec.cluster_ips.clone();
        }
        if spec.ip_families.as_ref().is_none_or(Vec::is_empty) {
            spec.ip_families = old_spec.ip_families.clone();
        }
        if spec.ip_family_policy.is_none() {
            spec.ip_family_policy = old_spec.ip_family_policy.clone();
        }
    }
    if old_needs_np && new_needs_np && new_allocates {
        let used: HashSet<i32> = used_old.intersection(&used_new).copied().collect();
        let by_name: HashMap<String, i32> = old_spec
            .ports
            .iter()
            .flatten()
            .map(|p| (p.name.clone().unwrap_or_default(), p.node_port.unwrap_or(0)))
            .collect();
        for p in spec.ports.iter_mut().flatten() {
            if p.node_port.unwrap_or(0) == 0 {
                let old_value = by_name
                    .get(p.name.as_deref().unwrap_or(""))
                    .copied()
                    .unwrap_or(0);
                if old_value != 0 && !used.contains(&old_value) {
                    p.node_port = Some(old_value);
                }
            }
        }
    }
    if old_needs_hc && new_needs_hc && spec.health_check_node_port.unwrap_or(0) == 0 {
        spec.health_check_node_port = old_spec.health_check_node_port;
    }
}

fn node_port_numbers(svc: &Service) -> BTreeSet<i32> {
    ports(svc)
        .iter()
        .filter_map(|p| p.node_port)
        .filter(|n| *n != 0)
        .collect()
}

fn release_port(allocs: &mut Allocators, value: i32) {
    if let Ok(p) = u16::try_from(value) {
        allocs.ports.release(p);
    }
}

/// NodePorts on update (`updateNodePorts`): a per-port diff against the old Service.
fn update_node_ports(
    old: &Service,
    new: &mut Service,
    allocs: &mut Allocators,
) -> Result<(), ApiError> {
    let name = new.metadata.name.clone().unwrap_or_default();
    let old_ports = node_port_numbers(old);
    let allocate_dynamic = allocates_lb_node_ports(new);
    let ports = new
        .spec
        .as_mut()
        .and_then(|s| s.ports.as_mut())
        .map(Vec::as_mut_slice)
        .unwrap_or_default();
    let mut seen: HashSet<(String, i32)> = HashSet::new();
    let mut allocated_here: HashSet<i32> = HashSet::new();
    for (i, p) in ports.iter_mut().enumerate() {
        let np = p.node_port.unwrap_or(0);
        if np == 0 && !allocate_dynamic {
            continue;
        }
        let np = if np != 0 {
            if !old_ports.contains(&np) && !allocated_here.contains(&np) {
                allocate_port(allocs, np).map_err(|e| node_port_error(&name, i, np, &e))?;
                allocated_here.insert(np);
            }
            np
        } else {
            let np =
                i32::from(allocs.ports.allocate_next().map_err(|e| {
                    ApiError::internal(format!("failed to allocate a nodePort: {e}"))
                })?);
            allocated_here.insert(np);
            p.node_port = Some(np);
            np
        };
        // kube-apiserver answers `duplicate nodePort: {TCP 30080}` with a 500 here; validation's
        // wording is what the user needs, so we give that (see the crate docs).
        if !seen.insert((protocol(p).to_owned(), np)) {
            return Err(invalid(
                &name,
                vec![FieldError::duplicate(
                    format!("spec.ports[{i}].nodePort"),
                    GoValue::Int(np.into()),
                )],
            ));
        }
    }
    let kept = node_port_numbers(new);
    for np in old_ports.difference(&kept) {
        release_port(allocs, *np);
    }
    Ok(())
}

/// `dropTypeDependentFields`: clears what the new type does not use, if the client left it as it was.
fn drop_type_dependent_fields(old: &Service, new: &mut Service) {
    let new_needs_ip = needs_cluster_ip(new);
    let new_needs_np = needs_node_port(new);
    let new_needs_hc = needs_health_check(new);
    let new_accessible = externally_accessible(new);
    let new_type = spec_type(new).to_owned();
    let old_spec = spec(old).clone();
    let same_node_ports = node_port_numbers(new).is_subset(&node_port_numbers(old));
    let spec = new.spec.get_or_insert_with(ServiceSpec::default);
    if needs_cluster_ip(old) && !new_needs_ip {
        if spec.cluster_ips == old_spec.cluster_ips || spec.cluster_ips.is_none() {
            spec.cluster_ip = None;
            spec.cluster_ips = None;
        }
        if spec.ip_families == old_spec.ip_families {
            spec.ip_families = None;
        }
        if spec.ip_family_policy == old_spec.ip_family_policy {
            spec.ip_family_policy = None;
        }
    }
    if needs_node_port(old) && !new_needs_np && same_node_ports {
        for p in spec.ports.iter_mut().flatten() {
            p.node_port = None;
        }
    }
    if needs_health_check(old)
        && !new_needs_hc
        && spec.health_check_node_port == old_spec.health_check_node_port
    {
        spec.health_check_node_port = None;
    }
    if old_spec.type_.as_deref() == Some(LOAD_BALANCER) && new_type != LOAD_BALANCER {
        if spec.allocate_load_balancer_node_ports == old_spec.allocate_load_balancer_node_ports {
            spec.allocate_load_balancer_node_ports = None;
        }
        if spec.load_balancer_class == old_spec.load_balancer_class {
            spec.load_balancer_class = None;
        }
        if let Some(status) = new.status.as_mut() {
            status.load_balancer = Some(LoadBalancerStatus::default());
        }
    }
    let spec = new.spec.get_or_insert_with(ServiceSpec::default);
    if externally_accessible(old)
        && !new_accessible
        && spec.external_traffic_policy == old_spec.external_traffic_policy
    {
        spec.external_traffic_policy = None;
    }
    if new_type == EXTERNAL_NAME && spec.internal_traffic_policy == old_spec.internal_traffic_policy
    {
        spec.internal_traffic_policy = None;
    }
}

/// `BeginUpdate`, `PrepareForUpdate` and `ValidateUpdate`: reallocates for the change from `old`
/// to `new`, then validates.
pub fn update(
    old: &Service,
    new: &mut Service,
    allocs: &mut Allocators,
    ranges: &ServiceRanges,
) -> Result<(), ApiError> {
    let name = new.metadata.name.clone().unwrap_or_default();
    patch_allocated_values(old, new);

    // ClusterIPs (`normalizeClusterIPs`, then `initIPFamilyFields` and `updateClusterIPs`).
    match (needs_cluster_ip(old), needs_cluster_ip(new)) {
        (true, true) => {
            let spec = new.spec.get_or_insert_with(ServiceSpec::default);
            normalize_cluster_ips_update(self::spec(old), spec);
        }
        (false, true) => normalize_cluster_ips(new.spec.get_or_insert_with(ServiceSpec::default)),
        _ => {}
    }
    ip_families::init_fields(new, Some(old), ranges)?;
    ip_families::update(old, new, allocs)?;

    // NodePorts.
    if needs_node_port(new) {
        update_node_ports(old, new, allocs)?;
    } else if needs_node_port(old) {
        for np in node_port_numbers(old) {
            release_port(allocs, np);
        }
    }

    // healthCheckNodePort.
    match (needs_health_check(old), needs_health_check(new)) {
        (false, true) => allocate_health_check(new, allocs)?,
        (true, false) => {
            let hc = spec(old).health_check_node_port.unwrap_or(0);
            // Only free it if no nodePort of the new Service took the same number.
            if hc != 0 && !node_port_numbers(new).contains(&hc) {
                release_port(allocs, hc);
            }
        }
        _ => {}
    }

    drop_type_dependent_fields(old, new);

    let mut errs = validate(new);
    errs.extend(validate_update(old, new));
    if !errs.is_empty() {
        return Err(invalid(&name, errs));
    }
    Ok(())
}

/// Frees everything a deleted Service held (`releaseAllocatedResources`).
pub fn release(svc: &Service, allocs: &mut Allocators) {
    ip_families::release(svc, allocs);
    for np in node_port_numbers(svc) {
        release_port(allocs, np);
    }
    if needs_health_check(svc)
        && let Some(hc) = spec(svc).health_check_node_port
    {
        release_port(allocs, hc);
    }
}

/// The ClusterIPs and NodePorts a stored Service holds (what the bitmaps must contain).
pub fn held(svc: &Service) -> (Vec<IpAddr>, Vec<u16>) {
    let ips = spec(svc)
        .cluster_ips
        .iter()
        .flatten()
        .filter_map(|ip| ip.parse().ok())
        .collect();
    let mut ports: BTreeSet<u16> = node_port_numbers(svc)
        .into_iter()
        .filter_map(|n| u16::try_from(n).ok())
        .collect();
    if needs_health_check(svc)
        && let Some(hc) = spec(svc)
            .health_check_node_port
            .and_then(|n| u16::try_from(n).ok())
    {
        ports.insert(hc);
    }
    (ips, ports.into_iter().collect())
}

/// The `%#v` of kube's internal `core.ServicePort` key used in the duplicate-port message.
fn go_service_port_key(protocol: &str, port: i32) -> String {
    format!(
        "core.ServicePort{{Name:\"\", Protocol:{protocol:?}, AppProtocol:(*string)(nil), Port:{port}, TargetPort:intstr.IntOrString{{Type:0, IntVal:0, StrVal:\"\"}}, NodePort:0}}"
    )
}

fn valid_port_number(p: i32) -> bool {
    (1..=65535).contains(&p)
}

/// `ValidateService`.
pub fn validate(svc: &Service) -> Vec<FieldError> {
    let mut errs = validation::object_meta(&svc.metadata, true, NameRule::Dns1035Label);
    let spec = spec(svc);
    let svc_type = spec_type(svc);
    let ports = ports(svc);

    match svc_type {
        CLUSTER_IP | NODE_PORT | LOAD_BALANCER | EXTERNAL_NAME => {}
        other => errs.push(FieldError::not_supported(
            "spec.type",
            other,
            &[CLUSTER_IP, EXTERNAL_NAME, LOAD_BALANCER, NODE_PORT],
        )),
    }

    if svc_type == EXTERNAL_NAME {
        if !spec.cluster_ip.as_deref().unwrap_or("").is_empty()
            || spec.cluster_ips.as_ref().is_some_and(|v| !v.is_empty())
        {
            errs.push(FieldError::forbidden(
                "spec.clusterIPs",
                "may not be set for ExternalName services",
            ));
        }
        if spec.ip_families.as_ref().is_some_and(|v| !v.is_empty()) {
            errs.push(FieldError::forbidden(
                "spec.ipFamilies",
                "may not be set for ExternalName services",
            ));
        }
        if spec.ip_family_policy.is_some() {
            errs.push(FieldError::forbidden(
                "spec.ipFamilyPolicy",
                "may not be set for ExternalName services",
            ));
        }
        match spec.external_name.as_deref().unwrap_or("") {
            "" => errs.push(FieldError::required("spec.externalName", "")),
            name => {
                for p in validation::dns1123_subdomain(name.trim_end_matches('.')) {
                    errs.push(FieldError::invalid(
                        "spec.externalName",
                        GoValue::Str(name),
                        p,
                    ));
                }
            }
        }
    }

    if ports.is_empty() && !is_headless(svc) && svc_type != EXTERNAL_NAME {
        errs.push(FieldError::required("spec.ports", ""));
    }
    let require_name = ports.len() > 1;
    let mut names = HashSet::new();
    let mut keys = HashSet::new();
    let mut node_ports = HashSet::new();
    for (i, p) in ports.iter().enumerate() {
        let path = format!("spec.ports[{i}]");
        let name = p.name.as_deref().unwrap_or("");
        if name.is_empty() {
            if require_name {
                errs.push(FieldError::required(format!("{path}.name"), ""));
            }
        } else {
            for problem in validation::dns1123_label(name) {
                errs.push(FieldError::invalid(
                    format!("{path}.name"),
                    GoValue::Str(name),
                    problem,
                ));
            }
            if !names.insert(name.to_owned()) {
                errs.push(FieldError::duplicate(
                    format!("{path}.name"),
                    GoValue::Str(name),
                ));
            }
        }
        if !valid_port_number(p.port) {
            errs.push(FieldError::invalid(
                format!("{path}.port"),
                GoValue::Int(p.port.into()),
                "must be between 1 and 65535, inclusive",
            ));
        }
        match p.protocol.as_deref().unwrap_or("") {
            "" => errs.push(FieldError::required(format!("{path}.protocol"), "")),
            "TCP" | "UDP" | "SCTP" => {}
            other => errs.push(FieldError::not_supported(
                format!("{path}.protocol"),
                other,
                &["SCTP", "TCP", "UDP"],
            )),
        }
        match &p.target_port {
            Some(IntOrString::Int(t)) if !valid_port_number(*t) => errs.push(FieldError::invalid(
                format!("{path}.targetPort"),
                GoValue::Int((*t).into()),
                "must be between 1 and 65535, inclusive",
            )),
            Some(IntOrString::String(s)) => {
                for problem in validation::port_name(s) {
                    errs.push(FieldError::invalid(
                        format!("{path}.targetPort"),
                        GoValue::Str(s),
                        problem,
                    ));
                }
            }
            _ => {}
        }
        // validateServicePort: an application protocol is a qualified name.
        if let Some(app) = p.app_protocol.as_deref() {
            for problem in validation::qualified_name(app) {
                errs.push(FieldError::invalid(
                    format!("{path}.appProtocol"),
                    GoValue::Str(app),
                    problem,
                ));
            }
        }
        if !keys.insert((protocol(p).to_owned(), p.port)) {
            errs.push(FieldError::duplicate(
                path.clone(),
                GoValue::Raw(go_service_port_key(protocol(p), p.port)),
            ));
        }
        let np = p.node_port.unwrap_or(0);
        if np != 0 {
            if svc_type == CLUSTER_IP {
                errs.push(FieldError::forbidden(
                    format!("{path}.nodePort"),
                    "may not be used when `type` is 'ClusterIP'",
                ));
            } else if !node_ports.insert((protocol(p).to_owned(), np)) {
                errs.push(FieldError::duplicate(
                    format!("{path}.nodePort"),
                    GoValue::Int(np.into()),
                ));
            }
        }
    }

    // ClusterIPs.
    let cluster_ips = spec.cluster_ips.clone().unwrap_or_default();
    if matches!(svc_type, NODE_PORT | LOAD_BALANCER)
        && cluster_ips.first().map(String::as_str) == Some("None")
    {
        errs.push(FieldError::invalid(
            "spec.clusterIPs[0]",
            GoValue::Str("None"),
            format!("may not be set to 'None' for {svc_type} services"),
        ));
    }
    errs.extend(validation::labels(
        "spec.selector",
        spec.selector.iter().flatten(),
    ));
    for (i, ip) in spec.external_ips.iter().flatten().enumerate() {
        let path = format!("spec.externalIPs[{i}]");
        match ip.parse::<IpAddr>() {
            Err(_) => errs.push(FieldError::invalid(path, GoValue::Str(ip), IP_FORMAT_HINT)),
            // kube: "for historical reasons, this uses ValidateEndpointIP".
            Ok(addr) => errs.extend(net_validation::special_ip_errors(&path, ip, addr)),
        }
    }
    // dual stack <-> clusterIPs <-> ipFamilies
    errs.extend(ip_families::validate_related_fields(svc));

    // Session affinity.
    match spec.session_affinity.as_deref().unwrap_or("") {
        "None" | "" => {}
        "ClientIP" => {
            let timeout = spec
                .session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds)
                .unwrap_or(DEFAULT_AFFINITY_TIMEOUT);
            if timeout <= 0 || timeout > MAX_AFFINITY_TIMEOUT {
                errs.push(FieldError::invalid(
                    "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
                    GoValue::Int(timeout.into()),
                    format!("must be greater than 0 and less than {MAX_AFFINITY_TIMEOUT}"),
                ));
            }
        }
        other => errs.push(FieldError::not_supported(
            "spec.sessionAffinity",
            other,
            &["ClientIP", "None"],
        )),
    }

    // Traffic policies.
    match spec.external_traffic_policy.as_deref() {
        None | Some("") => {
            if externally_accessible(svc) {
                errs.push(FieldError::required("spec.externalTrafficPolicy", ""));
            }
        }
        Some(policy @ ("Cluster" | "Local")) => {
            if !externally_accessible(svc) {
                errs.push(FieldError::invalid(
                    "spec.externalTrafficPolicy",
                    GoValue::Str(policy),
                    "may only be set for externally-accessible services",
                ));
            }
        }
        Some(other) => errs.push(FieldError::not_supported(
            "spec.externalTrafficPolicy",
            other,
            &["Cluster", "Local"],
        )),
    }
    if let Some(policy) = spec.internal_traffic_policy.as_deref()
        && !matches!(policy, "Cluster" | "Local")
    {
        errs.push(FieldError::not_supported(
            "spec.internalTrafficPolicy",
            policy,
            &["Cluster", "Local"],
        ));
    }
    let hc = spec.health_check_node_port.unwrap_or(0);
    if needs_health_check(svc) {
        if hc == 0 {
            errs.push(FieldError::required("spec.healthCheckNodePort", ""));
        } else if !valid_port_number(hc) {
            errs.push(FieldError::invalid(
                "spec.healthCheckNodePort",
                GoValue::Int(hc.into()),
                "must be between 1 and 65535, inclusive",
            ));
        }
    } else if hc != 0 {
        errs.push(FieldError::invalid(
            "spec.healthCheckNodePort",
            GoValue::Int(hc.into()),
            "may only be set when `type` is 'LoadBalancer' and `externalTrafficPolicy` is 'Local'",
        ));
    }

    // LoadBalancer-only fields.
    if svc_type != LOAD_BALANCER {
        if spec.allocate_load_balancer_node_ports.is_some() {
            errs.push(FieldError::forbidden(
                "spec.allocateLoadBalancerNodePorts",
                "may only be used when `type` is 'LoadBalancer'",
            ));
        }
        if spec.load_balancer_class.is_some() {
            errs.push(FieldError::forbidden(
                "spec.loadBalancerClass",
                "may only be used when `type` is 'LoadBalancer'",
            ));
        }
    } else if spec.allocate_load_balancer_node_ports.is_none() {
        // kube-apiserver's path really has no `spec.` here.
        errs.push(FieldError::required("allocateLoadBalancerNodePorts", ""));
    }
    errs.extend(source_ranges_problems(svc));
    errs
}

/// The source ranges of `spec.loadBalancerSourceRanges`, or else of the legacy annotation
/// `service.beta.kubernetes.io/load-balancer-source-ranges` (comma separated), as kube's
/// `ValidateService` checks them: only on a LoadBalancer, each a CIDR (space padding allowed,
/// a historical accident kube keeps). kube's path for the field is `spec.LoadBalancerSourceRanges`,
/// capital L included.
fn source_ranges_problems(svc: &Service) -> Vec<FieldError> {
    const FIELD: &str = "spec.LoadBalancerSourceRanges";
    const ANNOTATION: &str = "service.beta.kubernetes.io/load-balancer-source-ranges";
    const CIDR_TEXT: &str = "must be a valid CIDR value, (e.g. 10.9.8.0/24 or 2001:db8::/64)";
    let spec = svc.spec.as_ref().expect("validated Services have a spec");
    let is_lb = spec.type_.as_deref() == Some(LOAD_BALANCER);
    let mut errs = Vec::new();
    let ranges = spec.load_balancer_source_ranges.as_deref().unwrap_or(&[]);
    if !ranges.is_empty() {
        if !is_lb {
            errs.push(FieldError::forbidden(
                FIELD,
                "may only be used when `type` is 'LoadBalancer'",
            ));
        }
        for (i, cidr) in ranges.iter().enumerate() {
            if cidr.trim().parse::<IpNet>().is_err() {
                errs.push(FieldError::invalid(
                    format!("{FIELD}[{i}]"),
                    GoValue::Str(cidr.trim()),
                    CIDR_TEXT,
                ));
            }
        }
    } else if let Some(value) = svc
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION))
    {
        let path = format!("metadata.annotations[{ANNOTATION}]");
        if !is_lb {
            errs.push(FieldError::forbidden(
                path.clone(),
                "may only be used when `type` is 'LoadBalancer'",
            ));
        }
        let value = value.trim();
        if !value.is_empty() {
            for cidr in value.split(',').map(str::trim) {
                if cidr.parse::<IpNet>().is_err() {
                    errs.push(FieldError::invalid(
                        path.clone(),
                        GoValue::Str(cidr),
                        CIDR_TEXT,
                    ));
                }
            }
        }
    }
    errs
}

/// `ValidateLoadBalancerStatus`, for writes to the status subresource: ingress only on a
/// LoadBalancer Service (the `AllowServiceLBStatusOnNonLB` gate is off and locked since 1.32),
/// each `ip` an IP with an `ipMode` of `VIP` or `Proxy`, each `hostname` a DNS name.
pub fn validate_status(svc: &Service) -> Vec<FieldError> {
    let mut errs = Vec::new();
    let ingress = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_deref())
        .unwrap_or_default();
    if spec_type(svc) != LOAD_BALANCER && !ingress.is_empty() {
        errs.push(FieldError::forbidden(
            "status.loadBalancer.ingress",
            "may only be used when `spec.type` is 'LoadBalancer'",
        ));
        return errs;
    }
    for (i, ing) in ingress.iter().enumerate() {
        let at = format!("status.loadBalancer.ingress[{i}]");
        let ip = ing.ip.as_deref().unwrap_or("");
        if !ip.is_empty() && ip.parse::<IpAddr>().is_err() {
            errs.push(FieldError::invalid(
                format!("{at}.ip"),
                GoValue::Str(ip),
                IP_FORMAT_HINT,
            ));
        }
        match (ing.ip_mode.as_deref(), ip.is_empty()) {
            (None, false) => errs.push(FieldError::required(
                format!("{at}.ipMode"),
                "must be specified when `ip` is set",
            )),
            (Some(_), true) => errs.push(FieldError::forbidden(
                format!("{at}.ipMode"),
                "may not be specified when `ip` is not set",
            )),
            (Some(mode), false) if !matches!(mode, "VIP" | "Proxy") => errs.push(
                FieldError::not_supported(format!("{at}.ipMode"), mode, &["Proxy", "VIP"]),
            ),
            _ => {}
        }
        let host = ing.hostname.as_deref().unwrap_or("");
        if !host.is_empty() {
            for m in validation::dns1123_subdomain(host) {
                errs.push(FieldError::invalid(
                    format!("{at}.hostname"),
                    GoValue::Str(host),
                    m,
                ));
            }
            if host.parse::<IpAddr>().is_ok() {
                errs.push(FieldError::invalid(
                    format!("{at}.hostname"),
                    GoValue::Str(host),
                    "must be a DNS name, not an IP address",
                ));
            }
        }
    }
    errs
}

/// `ValidateServiceUpdate`: what may not change.
pub fn validate_update(old: &Service, new: &Service) -> Vec<FieldError> {
    let mut errs = ip_families::validate_upgrade_downgrade(old, new);
    if needs_health_check(old)
        && needs_health_check(new)
        && spec(old).health_check_node_port != spec(new).health_check_node_port
    {
        errs.push(FieldError::forbidden(
            "spec.healthCheckNodePort",
            "field is immutable",
        ));
    }
    if spec_type(old) == LOAD_BALANCER
        && spec_type(new) == LOAD_BALANCER
        && spec(old).load_balancer_class.is_some()
        && spec(old).load_balancer_class != spec(new).load_balancer_class
    {
        errs.push(FieldError::invalid(
            "spec.loadBalancerClass",
            GoValue::Str(spec(new).load_balancer_class.as_deref().unwrap_or("")),
            "may not change once set",
        ));
    }
    errs
}

/// The `default/kubernetes` Service as kube-apiserver's bootstrap controller writes it: the first
/// address of the service range, port 443 named `https` to the API server's 6443.
pub fn kubernetes_service(ranges: &ServiceRanges) -> Service {
    let first = first_address(&ranges.cluster_ips).to_string();
    let mut svc = Service {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some("kubernetes".into()),
            namespace: Some("default".into()),
            labels: Some(BTreeMap::from([
                ("component".to_owned(), "apiserver".to_owned()),
                ("provider".to_owned(), "kubernetes".to_owned()),
            ])),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            cluster_ip: Some(first.clone()),
            cluster_ips: Some(vec![first]),
            ports: Some(vec![ServicePort {
                name: Some("https".into()),
                port: 443,
                protocol: Some("TCP".into()),
                target_port: Some(IntOrString::Int(6443)),
                ..Default::default()
            }]),
            type_: Some(CLUSTER_IP.into()),
            ..Default::default()
        }),
        status: None,
    };
    set_defaults(&mut svc);
    svc
}

/// The first usable address of a service range (network + 1).
pub fn first_address(net: &IpNet) -> IpAddr {
    match net {
        IpNet::V4(n) => IpAddr::V4((u32::from(n.network()) + 1).into()),
        IpNet::V6(n) => IpAddr::V6((u128::from(n.network()) + 1).into()),
    }
}
