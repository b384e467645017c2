//! `render`: desired state → the frontends and backend sets the maps must hold. Pure.
//!
//! Per service port and family, as kube-proxy's nftables mode decides the same traffic:
//!
//! - **internal** frontends (socket hooks): the ClusterIP, with the internal traffic
//!   policy's endpoints; and every NodePort address, external IP and load-balancer IP
//!   reached from the node itself, with the Cluster policy's endpoints (kube-proxy
//!   short-circuits locally originated traffic to external addresses to the cluster chain);
//!   load-balancer IPs carry the source ranges here too: a socket is translated only when
//!   its source is known (bound, or named by `sendmsg`) and inside them, any other is
//!   passed on untranslated for tc to decide on its packets' real source;
//! - **external** frontends (tc): every NodePort address (`--nodeport-addresses`, loopback
//!   excepted: loopback traffic never crosses tc), external IP and load-balancer IP, with
//!   the external traffic policy's endpoints, SNATed to the node under the Cluster policy
//!   (kube-proxy's masquerade); load-balancer IPs carry the source ranges; and the
//!   ClusterIP, for routed traffic, with the internal policy's endpoints (SNATed to remote
//!   backends, so that their replies come back; to every backend under `--masquerade-all`,
//!   or when the source is outside `--cluster-cidr`, as kube-proxy masquerades them).
//!
//! No endpoints at all: reject (ICMP port unreachable; `ECONNREFUSED` for sockets). A Local
//! policy without local endpoints while others exist: drop (sockets: refused too, a socket
//! cannot be dropped). SCTP ports are left out: the programs cannot rewrite SCTP.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;

use super::maps::{
    BackendEntry, FrontendKey, SVC_AFFINITY, SVC_DROP, SVC_MAGLEV, SVC_RANGES, SVC_REJECT,
    SVC_SNAT, SVC_SNAT_OFF_CLUSTER, Scope, ip_proto,
};
use crate::desired::{DesiredState, EndpointTarget, FamilyState, ServicePortState};
use crate::model::{IpFamily, Protocol, ServicePortName};
use crate::nodeaddr::Selection;

/// What render and the proxy's log say of an SCTP service port in eBPF mode.
pub const SCTP_NOT_SERVED: &str = "SCTP: not served in eBPF mode (the programs cannot rewrite \
     SCTP, whose CRC32c checksum is not patched incrementally; use --proxy-mode nftables)";

/// How backends are chosen (`--ebpf-lb-algorithm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Algorithm {
    /// Uniformly at random per new connection (Cilium's default).
    #[default]
    Random,
    /// Maglev consistent hashing over the connection's tuple.
    Maglev,
}

impl Algorithm {
    /// Parses the flag value (`random`, `maglev`).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "random" => Some(Algorithm::Random),
            "maglev" => Some(Algorithm::Maglev),
            _ => None,
        }
    }

    /// The flag value.
    pub fn as_str(self) -> &'static str {
        match self {
            Algorithm::Random => "random",
            Algorithm::Maglev => "maglev",
        }
    }
}

/// What rendering needs besides the desired state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RenderConfig {
    /// Backend choice.
    pub algorithm: Algorithm,
    /// Every local address, for `--nodeport-addresses` selections that match them all.
    pub local_ips: Vec<IpAddr>,
    /// Packets translated at ingress go straight to their next hop (`bpf_fib_lookup`,
    /// `bpf_redirect_neigh`): what a node needs (a reversed reply carries the node's own
    /// source address, which the stack would drop as martian). Off only for program tests
    /// on crafted packets, whose verdicts must not depend on the host's routes.
    pub fib_forward: bool,
    /// `--masquerade-all`: routed traffic to a ClusterIP is SNATed to the node.
    pub masquerade_all: bool,
    /// `--cluster-cidr`: routed traffic to a ClusterIP from outside these is SNATed to the
    /// node (kube-proxy's `ip saddr != <cluster CIDR>` masquerade).
    pub cluster_cidrs: Vec<IpNet>,
}

impl RenderConfig {
    /// The cluster CIDRs of a family.
    pub fn cluster_cidrs_of(&self, family: IpFamily) -> Vec<IpNet> {
        self.cluster_cidrs
            .iter()
            .filter(|net| IpFamily::of(net.addr()) == family)
            .copied()
            .collect()
    }
}

/// A backend set: one service port's endpoints under one policy.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SetKey {
    /// The service port.
    pub port: ServicePortName,
    /// The family.
    pub family: IpFamily,
    /// The Local policy's endpoints (else the Cluster policy's).
    pub local: bool,
}

/// One frontend: where it sends traffic and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrontendSpec {
    /// The service port it belongs to.
    pub service: ServicePortName,
    /// Its backend set; `None` when it has no endpoints.
    pub set: Option<SetKey>,
    /// `SVC_*` flags.
    pub flags: u16,
    /// Session affinity timeout, seconds (0 without affinity).
    pub affinity_timeout: u32,
    /// Admitted sources (`loadBalancerSourceRanges`), empty: any.
    pub source_ranges: Vec<IpNet>,
    /// With `SVC_SNAT_OFF_CLUSTER`: the cluster CIDRs whose sources keep their address.
    pub cluster_cidrs: Vec<IpNet>,
}

/// Everything one service port of one family puts in the maps.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ServiceMaps {
    /// Backend sets, by key.
    pub sets: BTreeMap<SetKey, Vec<BackendEntry>>,
    /// Frontends.
    pub frontends: BTreeMap<FrontendKey, FrontendSpec>,
}

/// The whole rendering: per service port and family.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Rendered {
    /// Service ports, by name and family.
    pub services: BTreeMap<(ServicePortName, IpFamily), ServiceMaps>,
    /// Read from the kernel ([`from_maps`]): each frontend's value as the map holds it (its
    /// service and backend set ids), for the tracer's path. Empty when rendered.
    pub held: BTreeMap<FrontendKey, super::maps::Frontend>,
    /// Read from the kernel (`Maps::held_affinity`): the backend each client was sent to,
    /// by (service id, client address), for the tracer. Empty when rendered.
    pub affinity: BTreeMap<(u32, IpAddr), HeldAffinity>,
}

/// A client's entry in `np_affinity`: the programs send it to `backend` again while the
/// entry has been idle no longer than the frontend's timeout and the backend is still in
/// the frontend's set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeldAffinity {
    /// The backend remembered.
    pub backend: SocketAddr,
    /// How long the entry had been unused when the map was read, nanoseconds.
    pub idle_ns: u64,
}

/// What the kernel's maps hold (the pinned maps of a running proxy: frontends, backends by
/// (set, ordinal), source ranges by service id, the names by service id) as a [`Rendered`]
/// the tracer walks. Each frontend is named by the same frontend in `named` (what the proxy
/// would program for the objects), else by the name `np_svc_names` holds for its service id
/// (`names`), else `svc-<id>` in no namespace (maps a proxy older than `np_svc_names` wrote).
pub fn from_maps(
    frontends: &[(FrontendKey, super::maps::Frontend)],
    backends: &[((u32, u32), BackendEntry)],
    ranges: &[(u32, IpNet)],
    names: &BTreeMap<u32, ServicePortName>,
    named: &Rendered,
) -> Rendered {
    let by_key: BTreeMap<&FrontendKey, &FrontendSpec> = named
        .services
        .values()
        .flat_map(|m| m.frontends.iter())
        .collect();
    let mut out = Rendered::default();
    for (key, fe) in frontends {
        let protocol = match key.proto {
            17 => Protocol::Udp,
            132 => Protocol::Sctp,
            _ => Protocol::Tcp,
        };
        let family = IpFamily::of(key.addr);
        let service = match (by_key.get(key), names.get(&fe.svc_id)) {
            (Some(spec), _) => spec.service.clone(),
            (None, Some(name)) if name.protocol == protocol => name.clone(),
            _ => ServicePortName::new("", &format!("svc-{}", fe.svc_id), "", protocol),
        };
        // One set per kernel backend set: its name only joins frontend and backends.
        let set = SetKey {
            port: ServicePortName::new("", &format!("be-set-{}", fe.be_set), "", protocol),
            family,
            local: false,
        };
        let mut members: Vec<(u32, BackendEntry)> = backends
            .iter()
            .filter(|((s, ordinal), _)| {
                *s == fe.be_set && (1..=u32::from(fe.count)).contains(ordinal)
            })
            .map(|((_, ordinal), b)| (*ordinal, *b))
            .collect();
        members.sort_by_key(|(ordinal, _)| *ordinal);
        out.held.insert(*key, *fe);
        let maps = out.services.entry((service.clone(), family)).or_default();
        if fe.count > 0 {
            maps.sets
                .insert(set.clone(), members.into_iter().map(|(_, b)| b).collect());
        }
        maps.frontends.insert(
            *key,
            FrontendSpec {
                service,
                set: (fe.count > 0).then_some(set),
                flags: fe.flags,
                affinity_timeout: fe.affinity_timeout,
                source_ranges: ranges
                    .iter()
                    .filter(|(id, _)| *id == fe.svc_id)
                    .map(|(_, net)| *net)
                    .collect(),
                // The cluster CIDRs are kept under service id 0 (see `apply`).
                cluster_cidrs: if fe.flags & SVC_SNAT_OFF_CLUSTER != 0 {
                    ranges
                        .iter()
                        .filter(|(id, _)| *id == 0)
                        .map(|(_, net)| *net)
                        .collect()
                } else {
                    Vec::new()
                },
            },
        );
    }
    out
}

/// Renders every family.
pub fn render(desired: &DesiredState, config: &RenderConfig) -> Rendered {
    let mut out = Rendered::default();
    for fam in &desired.families {
        let ctx = FamilyContext::new(fam, config);
        for (name, svc) in &fam.services {
            out.services.insert(
                (name.clone(), fam.family),
                render_service_in(svc, fam, config, &ctx),
            );
        }
    }
    out
}

/// What every Service of a family renders alike, worked out once per family.
#[derive(Debug, Clone)]
pub struct FamilyContext {
    nodeport_ips: Vec<IpAddr>,
    cluster_cidrs: Vec<IpNet>,
}

impl FamilyContext {
    /// The family's NodePort addresses and cluster CIDRs under `config`.
    pub fn new(fam: &FamilyState, config: &RenderConfig) -> Self {
        FamilyContext {
            nodeport_ips: nodeport_ips(fam, config),
            cluster_cidrs: config.cluster_cidrs_of(fam.family),
        }
    }
}

fn backends(eps: &[EndpointTarget]) -> Vec<BackendEntry> {
    let mut out: Vec<BackendEntry> = eps
        .iter()
        .map(|e| BackendEntry {
            addr: e.ip,
            port: e.port,
            remote: !e.local,
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

/// The NodePort addresses of a family that tc and the socket hooks serve. A selection of
/// every local address (a `0.0.0.0/0` CIDR, or no address of the family to select from)
/// takes this node's addresses of the family except loopback and IPv6 link-local ones:
/// frontends are per address here, and a NodePort on every interface's `fe80::` address
/// would put the tc programs on every interface.
pub fn nodeport_ips(fam: &FamilyState, config: &RenderConfig) -> Vec<IpAddr> {
    match &fam.nodeport_ips {
        Selection::Ips(ips) => ips.iter().copied().collect(),
        Selection::MatchAll => config
            .local_ips
            .iter()
            .copied()
            .filter(|ip| {
                IpFamily::of(*ip) == fam.family
                    && !ip.is_loopback()
                    && !matches!(ip, IpAddr::V6(v6) if v6.is_unicast_link_local())
            })
            .collect(),
    }
}

/// Renders one service port of one family.
pub fn render_service(
    svc: &ServicePortState,
    fam: &FamilyState,
    config: &RenderConfig,
) -> ServiceMaps {
    render_service_in(svc, fam, config, &FamilyContext::new(fam, config))
}

/// [`render_service`] with the family's [`FamilyContext`] worked out already (a full sync
/// renders every Service of a family with one).
pub fn render_service_in(
    svc: &ServicePortState,
    fam: &FamilyState,
    config: &RenderConfig,
    ctx: &FamilyContext,
) -> ServiceMaps {
    let mut out = ServiceMaps::default();
    let port = &svc.port;
    if port.name.protocol == Protocol::Sctp {
        return out;
    }
    let proto = ip_proto(port.name.protocol);
    let mut base_flags = 0;
    if config.algorithm == Algorithm::Maglev {
        base_flags |= SVC_MAGLEV;
    }
    let affinity_timeout = port.session_affinity_seconds.unwrap_or(0);
    if port.session_affinity_seconds.is_some() {
        base_flags |= SVC_AFFINITY;
    }

    let set_for = |local: bool, eps: &[EndpointTarget], out: &mut ServiceMaps| {
        let list = backends(eps);
        if list.is_empty() {
            return None;
        }
        let key = SetKey {
            port: port.name.clone(),
            family: fam.family,
            local,
        };
        out.sets.insert(key.clone(), list);
        Some(key)
    };
    // Internal traffic: the internal policy's endpoints.
    let internal = if !svc.has_internal_endpoints() {
        None
    } else if port.internal_policy_local {
        set_for(true, &svc.local_endpoints, &mut out)
    } else {
        set_for(false, &svc.cluster_endpoints, &mut out)
    };
    let internal_flags = if internal.is_some() {
        base_flags
    } else if svc.has_endpoints {
        base_flags | SVC_DROP
    } else {
        base_flags | SVC_REJECT
    };
    // External traffic: the external policy's endpoints.
    let external = if !svc.has_external_endpoints() {
        None
    } else if svc.external_policy_local() {
        set_for(true, &svc.local_endpoints, &mut out)
    } else {
        set_for(false, &svc.cluster_endpoints, &mut out)
    };
    let external_flags = if external.is_some() && !svc.external_policy_local() {
        // kube-proxy's external chain masquerades unless the policy is Local.
        base_flags | SVC_SNAT
    } else if external.is_some() {
        base_flags
    } else if svc.has_endpoints {
        base_flags | SVC_DROP
    } else {
        base_flags | SVC_REJECT
    };
    // Locally originated traffic to external addresses: the Cluster policy's endpoints.
    let short_circuit = if svc.uses_cluster_chain() {
        set_for(false, &svc.cluster_endpoints, &mut out)
    } else {
        external.clone()
    };
    let short_flags = if short_circuit.is_some() {
        base_flags
    } else {
        external_flags
    };

    let spec = |set: Option<SetKey>, flags: u16, ranges: &[IpNet]| FrontendSpec {
        service: port.name.clone(),
        set,
        flags: if ranges.is_empty() {
            flags
        } else {
            flags | SVC_RANGES
        },
        affinity_timeout,
        source_ranges: ranges.to_vec(),
        cluster_cidrs: Vec::new(),
    };
    let key = |addr: IpAddr, port: u16, scope: Scope| FrontendKey {
        addr,
        port,
        proto,
        scope,
    };
    out.frontends.insert(
        key(svc.cluster_ip, port.port, Scope::Internal),
        spec(internal.clone(), internal_flags, &[]),
    );
    // Routed traffic to the ClusterIP (tc): masqueraded as kube-proxy's ClusterIP rules do,
    // under --masquerade-all, or from outside --cluster-cidr when it is set.
    let mut routed = spec(internal.clone(), internal_flags, &[]);
    if internal.is_some() {
        if config.masquerade_all {
            routed.flags |= SVC_SNAT;
        } else if !ctx.cluster_cidrs.is_empty() {
            routed.flags |= SVC_SNAT_OFF_CLUSTER;
            routed.cluster_cidrs = ctx.cluster_cidrs.clone();
        }
    }
    out.frontends
        .insert(key(svc.cluster_ip, port.port, Scope::External), routed);
    let mut externals: Vec<(IpAddr, u16, &[IpNet])> = Vec::new();
    if let Some(node_port) = port.node_port {
        for ip in &ctx.nodeport_ips {
            externals.push((*ip, node_port, &[]));
        }
    }
    for ip in &svc.external_ips {
        externals.push((*ip, port.port, &[]));
    }
    for ip in &svc.load_balancer_ips {
        externals.push((*ip, port.port, &svc.source_ranges));
    }
    for (ip, p, ranges) in externals {
        // The socket hooks translate a range-checked frontend only for a socket whose
        // source they know to be inside the ranges; others are left to tc (see the C
        // source's np_sock_connect), as kube-proxy's firewall chain checks every source.
        out.frontends.insert(
            key(ip, p, Scope::Internal),
            spec(short_circuit.clone(), short_flags, ranges),
        );
        if !ip.is_loopback() {
            out.frontends.insert(
                key(ip, p, Scope::External),
                spec(external.clone(), external_flags, ranges),
            );
        }
    }
    out
}

fn proto_name(proto: u8) -> &'static str {
    match proto {
        6 => "TCP",
        17 => "UDP",
        132 => "SCTP",
        _ => "?",
    }
}

impl Rendered {
    /// The map contents, one line per entry, readable: frontends
    /// (`10.96.0.10:53/UDP internal → 10.244.1.5:53, 10.244.2.7:53 (random)`), then each
    /// service's source ranges.
    pub fn lines(&self, algorithm: Algorithm) -> Vec<String> {
        let mut out = Vec::new();
        for ((name, family), maps) in &self.services {
            if name.protocol == Protocol::Sctp {
                out.push(format!("{name} ({}) {SCTP_NOT_SERVED}", family.as_str()));
                continue;
            }
            for (key, spec) in &maps.frontends {
                let scope = match key.scope {
                    Scope::Internal => "internal",
                    Scope::External => "external",
                };
                let mut line = format!(
                    "{}/{} {scope} ({name}) → ",
                    SocketAddr::new(key.addr, key.port),
                    proto_name(key.proto)
                );
                match spec.set.as_ref().and_then(|s| maps.sets.get(s)) {
                    Some(list) => {
                        let targets: Vec<String> = list
                            .iter()
                            .map(|b| SocketAddr::new(b.addr, b.port).to_string())
                            .collect();
                        let _ = write!(line, "{} ({}", targets.join(", "), algorithm.as_str());
                        if spec.flags & SVC_AFFINITY != 0 {
                            let _ = write!(line, ", affinity {}s", spec.affinity_timeout);
                        }
                        if spec.flags & SVC_SNAT != 0 {
                            line.push_str(", masquerade");
                        }
                        if spec.flags & SVC_SNAT_OFF_CLUSTER != 0 {
                            let cidrs: Vec<String> =
                                spec.cluster_cidrs.iter().map(|c| c.to_string()).collect();
                            let _ = write!(line, ", masquerade unless from {}", cidrs.join(", "));
                        }
                        line.push(')');
                    }
                    None if spec.flags & SVC_DROP != 0 => {
                        line.push_str("drop (no local endpoints)")
                    }
                    None => line.push_str("reject (no endpoints)"),
                }
                if !spec.source_ranges.is_empty() {
                    let ranges: Vec<String> =
                        spec.source_ranges.iter().map(|r| r.to_string()).collect();
                    let _ = write!(line, " from {}", ranges.join(", "));
                }
                out.push(line);
            }
        }
        out
    }
}
