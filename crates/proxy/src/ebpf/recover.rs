//! What the ebpf mode's maps say of their Service ports, for `nodeport trace --rules kernel`
//! without objects ([`crate::trace::recover`]).
//!
//! The maps hold no names: a frontend carries a service id (`svc_id`, stable per Service
//! port and family), so a port is named `svc-<id>` ([`super::render::from_maps`] read with no
//! objects). The rest is read from the frontends of one id: the node's own addresses are its
//! NodePort (their port), the other addresses its ClusterIP (the one whose tc frontend
//! masquerades only sources outside `--cluster-cidr`, else the first) and its external
//! addresses (load-balancer IPs when they carry source ranges); the backend sets give the
//! endpoints and, by their remote flag, which are on this node; the flags give the no-endpoint
//! verdicts and the policies (an external frontend that does not SNAT is under the Local
//! policy).

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use super::maps::{
    BackendEntry, SVC_DROP, SVC_RANGES, SVC_REJECT, SVC_SNAT, SVC_SNAT_OFF_CLUSTER, Scope,
};
use super::render::{FrontendSpec, Rendered, ServiceMaps};
use crate::trace::recover::{PortFacts, Recovered};

/// Reads what the maps (as [`render::from_maps`](super::render::from_maps) reads them) say of
/// their Service ports into `into`; `local_ips` are this node's addresses.
pub fn recover(maps: &Rendered, local_ips: &[IpAddr], into: &mut Recovered) {
    let mut cidrs = std::collections::BTreeSet::new();
    let mut masquerade_all = false;
    for ((name, family), service) in &maps.services {
        let mut by_addr: BTreeMap<(IpAddr, u16), [Option<&FrontendSpec>; 2]> = BTreeMap::new();
        for (key, spec) in &service.frontends {
            let slot = match key.scope {
                Scope::Internal => 0,
                Scope::External => 1,
            };
            by_addr.entry((key.addr, key.port)).or_default()[slot] = Some(spec);
        }
        let own = |ip: &IpAddr| local_ips.contains(ip) || ip.is_loopback();
        let others: Vec<(IpAddr, u16)> =
            by_addr.keys().filter(|(ip, _)| !own(ip)).copied().collect();
        let cluster = others
            .iter()
            .find(|k| by_addr[*k][1].is_some_and(|s| s.flags & SVC_SNAT_OFF_CLUSTER != 0))
            .or(others.first())
            .copied();
        let f = into.port(*family, name);
        let list = |spec: &FrontendSpec| -> Vec<&BackendEntry> {
            spec.set
                .as_ref()
                .and_then(|s| service.sets.get(s))
                .map(|l| l.iter().collect())
                .unwrap_or_default()
        };
        let places = |f: &mut PortFacts, spec: &FrontendSpec| -> Vec<SocketAddr> {
            let mut out = Vec::new();
            for b in list(spec) {
                let to = SocketAddr::new(b.addr, b.port);
                if b.remote {
                    f.known_remote.insert(to);
                } else {
                    f.known_local.insert(to);
                }
                PortFacts::push_endpoint(&mut out, to);
            }
            out
        };
        let mut cluster_list: Option<Vec<SocketAddr>> = None;
        for (&(ip, port), specs) in &by_addr {
            let [internal, external] = *specs;
            if Some((ip, port)) == cluster {
                f.cluster_ip = Some(ip);
                f.port = Some(port);
                if let Some(spec) = external {
                    cidrs.extend(spec.cluster_cidrs.iter().copied());
                    masquerade_all |= spec.set.is_some() && spec.flags & SVC_SNAT != 0;
                }
                if let Some(spec) = internal {
                    f.no_endpoints |= spec.flags & SVC_REJECT != 0;
                    if spec.flags & SVC_DROP != 0 {
                        f.internal_policy_local = true;
                        f.local_list();
                    } else {
                        let l = places(f, spec);
                        if !l.is_empty() {
                            cluster_list.get_or_insert(l);
                        }
                    }
                }
                continue;
            }
            if own(&ip) {
                f.node_port = Some(port);
            } else {
                f.port = f.port.or(Some(port));
                match external {
                    Some(s) if s.flags & SVC_RANGES != 0 => {
                        f.load_balancer_ips.insert(ip);
                        f.source_ranges.extend(s.source_ranges.iter().copied());
                    }
                    _ => {
                        f.external_ips.insert(ip);
                    }
                }
            }
            // The external frontend follows the external policy; the internal one (the
            // node's own traffic) the Cluster policy's endpoints.
            if let Some(spec) = external {
                f.no_endpoints |= spec.flags & SVC_REJECT != 0;
                if spec.flags & SVC_DROP != 0 {
                    f.external_policy_local = true;
                    f.local_list();
                } else if spec.flags & SVC_SNAT == 0 && spec.set.is_some() {
                    f.external_policy_local = true;
                    for e in places(f, spec) {
                        PortFacts::push_endpoint(f.local_list(), e);
                    }
                } else if spec.set.is_some() {
                    let l = places(f, spec);
                    cluster_list.get_or_insert(l);
                }
            }
            if let Some(spec) = internal
                && spec.set.is_some()
                && f.external_policy_local
            {
                let l = places(f, spec);
                cluster_list = Some(l);
            }
        }
        if let Some(spec) = internal_of(service, cluster) {
            f.session_affinity_seconds =
                (spec.affinity_timeout > 0).then_some(spec.affinity_timeout);
        }
        f.cluster_endpoints = cluster_list.unwrap_or_default();
    }
    into.cluster_cidrs.extend(cidrs);
    into.masquerade_all |= masquerade_all;
    // The node's NodePort addresses: every own address a frontend uses.
    for ((_, family), service) in &maps.services {
        for key in service.frontends.keys() {
            if local_ips.contains(&key.addr) && !key.addr.is_loopback() {
                into.family(*family)
                    .nodeport_ips
                    .get_or_insert_with(Default::default)
                    .insert(key.addr);
            }
        }
    }
}

fn internal_of(service: &ServiceMaps, cluster: Option<(IpAddr, u16)>) -> Option<&FrontendSpec> {
    let (ip, port) = cluster?;
    service
        .frontends
        .iter()
        .find(|(k, _)| k.addr == ip && k.port == port && k.scope == Scope::Internal)
        .map(|(_, s)| s)
}
