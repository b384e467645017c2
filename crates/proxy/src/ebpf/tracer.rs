//! A small packet tracer over the rendered maps ([`Rendered`]): what `bpf/nodeport.c` does
//! with the first packet of a connection, in the same order, so that a behaviour test or
//! `nodeport trace` reads the same as in the nftables and iptables modes.
//!
//! A packet from the network meets `np_tc_ingress` (the `external` frontends), a socket of
//! the node meets the cgroup `connect` hooks (the `internal` ones). No frontend: passed
//! untranslated. No endpoints: ICMP port unreachable at tc (`reject`) or drop under a Local
//! policy; `ECONNREFUSED` for a socket either way. Then `loadBalancerSourceRanges` (tc
//! only), then the backend: each with probability `1/count` (random), or its share of the
//! Maglev table's slots. tc SNATs to the node when the frontend says so (external traffic
//! under the Cluster policy; a ClusterIP under `--masquerade-all`, or from outside
//! `--cluster-cidr`) or the backend is on another node; sockets are never SNATed.
//! Session affinity is not evaluated: it only repeats an earlier choice.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use super::maglev;
use super::maps::{
    BackendEntry, FrontendKey, MAGLEV_M, SVC_MAGLEV, SVC_RANGES, SVC_REJECT, SVC_SNAT,
    SVC_SNAT_OFF_CLUSTER, Scope, ip_proto,
};
use super::render::{FrontendSpec, Rendered};
use crate::trace::{Env, Fate, Origin, Packet, Trace};

/// The tc program that decides a packet from the network.
pub const TC_INGRESS: &str = "np_tc_ingress";
/// The cgroup hook that decides a socket's connection (`connect`, `sendmsg` for UDP).
pub const SOCK_CONNECT: &str = "np_connect";

/// Traces `packet` through the frontends and backend sets of `rendered`.
pub fn trace(rendered: &Rendered, packet: &Packet, _env: &Env) -> Trace {
    let scope = match packet.origin {
        Origin::Remote => Scope::External,
        Origin::Local => Scope::Internal,
    };
    let key = FrontendKey {
        addr: packet.dst,
        port: packet.dport,
        proto: ip_proto(packet.proto),
        scope,
    };
    let found = rendered
        .services
        .values()
        .find_map(|maps| maps.frontends.get(&key).map(|spec| (maps, spec)));
    let fates = match found {
        None => vec![(
            Fate::Delivered {
                dnat: None,
                masqueraded: false,
                affinity: vec![],
            },
            1.0,
        )],
        Some((maps, spec)) => {
            let backends = spec.set.as_ref().and_then(|s| maps.sets.get(s));
            decide(packet, scope, spec, backends.map(Vec::as_slice))
        }
    };
    Trace {
        packet: packet.clone(),
        fates,
    }
}

/// What the program does once the frontend is found.
fn decide(
    packet: &Packet,
    scope: Scope,
    spec: &FrontendSpec,
    backends: Option<&[BackendEntry]>,
) -> Vec<(Fate, f64)> {
    let hook = match scope {
        Scope::External => TC_INGRESS,
        Scope::Internal => SOCK_CONNECT,
    };
    let backends = match backends {
        Some(list) if !list.is_empty() => list,
        // `svc->count == 0`: tc rejects or drops as flagged; a socket is refused either way.
        _ if scope == Scope::Internal || spec.flags & SVC_REJECT != 0 => {
            return vec![(Fate::Rejected(hook.to_string()), 1.0)];
        }
        _ => return vec![(Fate::Dropped(hook.to_string()), 1.0)],
    };
    if scope == Scope::External
        && spec.flags & SVC_RANGES != 0
        && !spec.source_ranges.iter().any(|r| r.contains(&packet.src))
    {
        return vec![(Fate::Dropped(hook.to_string()), 1.0)];
    }
    let shares = shares(spec.flags, backends);
    let mut fates: Vec<(Fate, f64)> = backends
        .iter()
        .zip(shares)
        .filter(|(_, p)| *p > 0.0)
        .map(|(b, p)| {
            let off_cluster = spec.flags & SVC_SNAT_OFF_CLUSTER != 0
                && !spec.cluster_cidrs.iter().any(|c| c.contains(&packet.src));
            let masqueraded =
                scope == Scope::External && (b.remote || spec.flags & SVC_SNAT != 0 || off_cluster);
            let fate = Fate::Delivered {
                dnat: Some(SocketAddr::new(b.addr, b.port)),
                masqueraded,
                affinity: vec![],
            };
            (fate, p)
        })
        .collect();
    fates.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    fates
}

/// Each backend's probability: `1/count` at random, its share of the table under Maglev
/// (the flow hash picks a slot uniformly).
fn shares(flags: u16, backends: &[BackendEntry]) -> Vec<f64> {
    if flags & SVC_MAGLEV == 0 {
        return vec![1.0 / backends.len() as f64; backends.len()];
    }
    // The table is built from `ip:port` names in backend order, as the applier writes it.
    let names: Vec<String> = backends
        .iter()
        .map(|b| SocketAddr::new(b.addr, b.port).to_string())
        .collect();
    let mut slots: BTreeMap<u32, usize> = BTreeMap::new();
    for ordinal in maglev::table(&names) {
        *slots.entry(ordinal).or_default() += 1;
    }
    (1..=backends.len() as u32)
        .map(|o| slots.get(&o).copied().unwrap_or(0) as f64 / MAGLEV_M as f64)
        .collect()
}
