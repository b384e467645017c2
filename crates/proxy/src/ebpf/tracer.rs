//! A small packet tracer over the rendered maps ([`Rendered`]): what `bpf/nodeport.c` does
//! with the first packet of a connection, in the same order, so that a behaviour test or
//! `nodeport trace` reads the same as in the nftables and iptables modes.
//!
//! A packet from the network meets `np_tc_ingress` (the `external` frontends), a socket of
//! the node meets the cgroup `connect` hooks (the `internal` ones). No frontend: passed
//! untranslated. No endpoints: ICMP port unreachable at tc (`reject`) or drop under a Local
//! policy; `ECONNREFUSED` for a socket either way (a socket meets the source ranges first:
//! one whose source is outside them is passed on untranslated, for tc). Then
//! `loadBalancerSourceRanges` at tc, then the backend: each with probability `1/count`
//! (random), or its share of the Maglev table's slots. tc SNATs to the node when the
//! frontend says so (external traffic under the Cluster policy; a ClusterIP under
//! `--masquerade-all`, or from outside `--cluster-cidr`) or the backend is on another node;
//! sockets are never SNATed.
//! Session affinity repeats an earlier choice: with the kernel's maps, a client's live
//! `np_affinity` entry is read and, when the trace follows the kernel's records, its backend
//! is the one way (else the path is a new client's and the step says where the entry sends
//! it, until its timeout).
//!
//! Each way records its [path](crate::trace::path) as the program's steps, each with the map
//! entry it read: the frontend (`np_services`), the no-endpoint verdict, the source range
//! (`np_src_ranges`), the affinity look-up (the kernel's entry for the client, if any), the
//! backend (`np_backends`, by the random or Maglev choice), the SNAT. With the kernel's maps
//! ([`Rendered::held`]) the entries carry the kernel's service and backend set ids.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use super::maglev;
use super::maps::{
    BackendEntry, FrontendKey, MAGLEV_M, SVC_AFFINITY, SVC_DROP, SVC_MAGLEV, SVC_RANGES,
    SVC_REJECT, SVC_SNAT, SVC_SNAT_OFF_CLUSTER, Scope, ip_proto,
};
use super::render::{FrontendSpec, HeldAffinity, Rendered};
use crate::trace::path::{Step, Walk};
use crate::trace::{Env, Fate, Origin, Packet, Trace};

/// The tc program that decides a packet from the network.
pub const TC_INGRESS: &str = "np_tc_ingress";
/// The cgroup hook that decides a socket's connection (`connect`, `sendmsg` for UDP).
pub const SOCK_CONNECT: &str = "np_connect";

/// Traces `packet` through the frontends and backend sets of `rendered`. A client with a
/// live `np_affinity` entry (maps read from the kernel) is sent to its remembered backend
/// when `env.recorded_affinity` says to follow the kernel's records; otherwise the path is a
/// new client's, and the affinity step says what the entry holds.
pub fn trace(rendered: &Rendered, packet: &Packet, env: &Env) -> Trace {
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
    let program = program(packet);
    let found = rendered
        .services
        .values()
        .find_map(|maps| maps.frontends.get(&key).map(|spec| (maps, spec)));
    let to = format!(
        "{}/{}",
        SocketAddr::new(packet.dst, packet.dport),
        packet.proto.as_lower()
    );
    let walks = match found {
        None => vec![Walk {
            probability: 1.0,
            fate: Fate::Delivered {
                dnat: None,
                masqueraded: false,
                affinity: vec![],
            },
            steps: vec![
                Step::program(
                    program,
                    "frontend",
                    format!("{to}: no frontend, passed on untranslated"),
                )
                .with_elements(vec![format!("np_services {{ {} }}: none", key_text(&key))]),
            ],
        }],
        Some((maps, spec)) => {
            let held = rendered.held.get(&key);
            let id = held.map_or_else(String::new, |f| format!(" {}", f.svc_id));
            let frontend = Step::program(program, "frontend", format!("{to}: frontend{id}"))
                .with_elements(vec![frontend_text(&key, spec, maps, held)]);
            let backends = spec.set.as_ref().and_then(|s| maps.sets.get(s));
            let affinity = Affinity {
                read: held.is_some(),
                entry: held.and_then(|f| rendered.affinity.get(&(f.svc_id, packet.src))),
                follow: env.recorded_affinity,
            };
            decide(
                packet,
                (scope, program),
                spec,
                backends.map(Vec::as_slice),
                (frontend, held),
                affinity,
            )
        }
    };
    Trace::of_walks(packet, walks)
}

/// The program that decides `packet`: tc for one from the network, the connect hook of its
/// family for a socket of the node.
fn program(packet: &Packet) -> &'static str {
    match (packet.origin, packet.dst.is_ipv4()) {
        (Origin::Remote, _) => TC_INGRESS,
        (Origin::Local, true) => "np_connect4",
        (Origin::Local, false) => "np_connect6",
    }
}

/// A frontend key as the path shows it: `192.0.2.11:30569 tcp external`.
fn key_text(key: &FrontendKey) -> String {
    let proto = match key.proto {
        6 => "tcp",
        17 => "udp",
        132 => "sctp",
        _ => "?",
    };
    let scope = match key.scope {
        Scope::External => "external",
        Scope::Internal => "internal",
    };
    format!("{} {proto} {scope}", SocketAddr::new(key.addr, key.port))
}

/// A frontend's entry: `np_services { 192.0.2.11:30569 tcp external : svc 3, set 7, 2
/// backends, snat }` (the ids when the kernel's maps were read).
fn frontend_text(
    key: &FrontendKey,
    spec: &FrontendSpec,
    maps: &super::render::ServiceMaps,
    held: Option<&super::maps::Frontend>,
) -> String {
    let mut parts = Vec::new();
    if let Some(f) = held {
        parts.push(format!("svc {}", f.svc_id));
        if f.be_set != 0 {
            parts.push(format!("set {}", f.be_set));
        }
    }
    let count = spec
        .set
        .as_ref()
        .and_then(|s| maps.sets.get(s))
        .map_or(0, Vec::len);
    parts.push(format!("{count} backends"));
    for (bit, name) in [
        (SVC_REJECT, "reject"),
        (SVC_DROP, "drop"),
        (SVC_AFFINITY, "affinity"),
        (SVC_MAGLEV, "maglev"),
        (SVC_RANGES, "ranges"),
        (SVC_SNAT, "snat"),
        (SVC_SNAT_OFF_CLUSTER, "snat-off-cluster"),
    ] {
        if spec.flags & bit != 0 {
            parts.push(name.to_string());
        }
    }
    format!("np_services {{ {} : {} }}", key_text(key), parts.join(", "))
}

/// What `np_affinity` holds for the traced client.
struct Affinity<'a> {
    /// The maps were read from the kernel (else there are no entries to read).
    read: bool,
    /// The client's entry for the frontend's service id.
    entry: Option<&'a HeldAffinity>,
    /// Follow a live entry (else trace a new client and say where the entry sends it).
    follow: bool,
}

/// What the program does once the frontend is found (its step `frontend`; the kernel's
/// backend set id when read from the kernel): one walk per way.
fn decide(
    packet: &Packet,
    (scope, program): (Scope, &'static str),
    spec: &FrontendSpec,
    backends: Option<&[BackendEntry]>,
    (frontend, held): (Step, Option<&super::maps::Frontend>),
    affinity: Affinity<'_>,
) -> Vec<Walk> {
    let be_set = held.map(|f| f.be_set);
    let hook = match scope {
        Scope::External => TC_INGRESS,
        Scope::Internal => SOCK_CONNECT,
    };
    let mut steps = vec![frontend];
    let ends = |steps: Vec<Step>, fate: Fate| {
        vec![Walk {
            probability: 1.0,
            fate,
            steps,
        }]
    };
    // A socket is translated under source ranges only when its source is known and inside
    // them (np_sock_connect): the traced source is taken as the one the socket is bound to.
    if scope == Scope::Internal && spec.flags & SVC_RANGES != 0 {
        let Some(range) = spec.source_ranges.iter().find(|r| r.contains(&packet.src)) else {
            steps.push(Step::program(
                program,
                "source ranges",
                format!(
                    "{} is not in np_src_ranges: passed on untranslated (its packets meet \
                     np_tc_ingress, if on their way, which drops them)",
                    packet.src
                ),
            ));
            return ends(
                steps,
                Fate::Delivered {
                    dnat: None,
                    masqueraded: false,
                    affinity: vec![],
                },
            );
        };
        steps.push(
            Step::program(
                program,
                "source ranges",
                format!(
                    "{} is in np_src_ranges: translated for a socket bound to it (an unbound \
                     socket's source is not known yet: passed on untranslated, for tc)",
                    packet.src
                ),
            )
            .with_elements(vec![range_element(held, range)]),
        );
    }
    let backends = match backends {
        Some(list) if !list.is_empty() => list,
        // `svc->count == 0`: tc rejects or drops as flagged; a socket is refused either way.
        _ if scope == Scope::Internal => {
            steps.push(Step::program(
                program,
                "verdict",
                "connect() refused (ECONNREFUSED)",
            ));
            return ends(steps, Fate::Rejected(hook.to_string()));
        }
        _ if spec.flags & SVC_REJECT != 0 => {
            steps.push(Step::program(
                program,
                "verdict",
                "reject (ICMP port unreachable)",
            ));
            return ends(steps, Fate::Rejected(hook.to_string()));
        }
        _ => {
            steps.push(Step::program(program, "verdict", "drop (no endpoints)"));
            return ends(steps, Fate::Dropped(hook.to_string()));
        }
    };
    if scope == Scope::External && spec.flags & SVC_RANGES != 0 {
        let range = spec.source_ranges.iter().find(|r| r.contains(&packet.src));
        let Some(range) = range else {
            steps.push(Step::program(
                program,
                "source ranges",
                format!("{} is not in np_src_ranges: drop", packet.src),
            ));
            return ends(steps, Fate::Dropped(hook.to_string()));
        };
        steps.push(
            Step::program(
                program,
                "source ranges",
                format!("{} is in np_src_ranges", packet.src),
            )
            .with_elements(vec![range_element(held, range)]),
        );
    }
    // The backend a live affinity entry sends the client to, when followed.
    let mut stuck = None;
    if spec.flags & SVC_AFFINITY != 0 {
        let (step, live) = affinity_step(packet, (scope, program), spec, backends, held, &affinity);
        steps.push(step);
        if affinity.follow {
            stuck = live;
        }
    }
    let shares = match stuck {
        Some(i) => (0..backends.len())
            .map(|j| if j == i { 1.0 } else { 0.0 })
            .collect(),
        None => shares(spec.flags, backends),
    };
    let maglev = spec.flags & SVC_MAGLEV != 0 && stuck.is_none();
    let mut walks: Vec<Walk> = backends
        .iter()
        .zip(shares)
        .enumerate()
        .filter(|(_, (_, p))| *p > 0.0)
        .map(|(i, (b, p))| {
            let off_cluster = spec.flags & SVC_SNAT_OFF_CLUSTER != 0
                && !spec.cluster_cidrs.iter().any(|c| c.contains(&packet.src));
            let masqueraded =
                scope == Scope::External && (b.remote || spec.flags & SVC_SNAT != 0 || off_cluster);
            let to = SocketAddr::new(b.addr, b.port);
            let set = be_set.map_or_else(String::new, |s| format!("set {s}, "));
            let place = if b.remote { " remote" } else { "" };
            let mut own = steps.clone();
            let chosen = match (scope, stuck) {
                (Scope::Internal, _) => format!("{to} chosen: connect() goes there"),
                (Scope::External, Some(_)) => format!("{to} chosen: remembered by np_affinity"),
                (Scope::External, None) => format!("{to} chosen"),
            };
            let mut read = Vec::new();
            if stuck.is_some() {
                // The remembered backend is checked against the current set, by address.
                read.push(format!(
                    "np_members {{ {}{to} }}: ordinal {}",
                    be_set.map_or_else(String::new, |s| format!("set {s}, ")),
                    i + 1
                ));
            }
            if maglev {
                // The flow's hash picks a slot of the set's table, which names the ordinal.
                let slots = (p * MAGLEV_M as f64).round();
                read.push(format!(
                    "np_maglev{}: ordinal {} in {slots} of {MAGLEV_M} slots",
                    be_set.map_or_else(String::new, |s| format!(" {{ set {s} }}")),
                    i + 1
                ));
            }
            read.push(format!(
                "np_backends {{ {set}ordinal {} : {to}{place} }}",
                i + 1
            ));
            own.push(Step::program(program, "backend", chosen).with_elements(read));
            if scope == Scope::External {
                own.push(Step::program(
                    program,
                    "snat",
                    if masqueraded {
                        format!("source {} becomes this node's address", packet.src)
                    } else {
                        "source kept".to_string()
                    },
                ));
            }
            Walk {
                probability: p,
                fate: Fate::Delivered {
                    dnat: Some(to),
                    masqueraded,
                    affinity: vec![],
                },
                steps: own,
            }
        })
        .collect();
    walks.sort_by(|a, b| b.probability.total_cmp(&a.probability));
    walks
}

/// The affinity step: what `np_affinity` holds for the packet's client, and the index in
/// `backends` of the backend a live entry sends it to (`np_affinity_lookup`: idle no longer
/// than the timeout, and the backend still in the frontend's set).
fn affinity_step(
    packet: &Packet,
    (scope, program): (Scope, &'static str),
    spec: &FrontendSpec,
    backends: &[BackendEntry],
    held: Option<&super::maps::Frontend>,
    affinity: &Affinity<'_>,
) -> (Step, Option<usize>) {
    let id = held.map_or_else(String::new, |f| format!("svc {}, ", f.svc_id));
    let client = packet.src;
    let none = |text: String| {
        let element = format!("np_affinity {{ {id}{client} }}: none");
        (
            Step::program(program, "affinity", text).with_elements(vec![element]),
            None,
        )
    };
    if scope == Scope::Internal && affinity.read {
        // np_sock_connect keys a socket's choice by its network namespace's cookie.
        let text = "np_affinity keys a socket by its network namespace, which the trace does \
                    not know (traced as a new client)";
        return (Step::program(program, "affinity", text), None);
    }
    let Some(entry) = affinity.entry.filter(|_| scope == Scope::External) else {
        return none(format!(
            "np_affinity holds no backend for {client} (traced as a new client)"
        ));
    };
    let to = entry.backend;
    let idle = entry.idle_ns / 1_000_000_000;
    let timeout = u64::from(spec.affinity_timeout);
    let element = format!("np_affinity {{ {id}{client} : {to}, idle {idle} s }}");
    let index = backends
        .iter()
        .position(|b| SocketAddr::new(b.addr, b.port) == to);
    let (text, live) = if entry.idle_ns > timeout.saturating_mul(1_000_000_000) {
        (
            format!(
                "np_affinity sent {client} to {to}, but {idle} s ago, beyond the {timeout} s \
                 timeout: chosen anew"
            ),
            None,
        )
    } else if index.is_none() {
        (
            format!(
                "np_affinity sent {client} to {to}, no longer a backend of the set: chosen anew"
            ),
            None,
        )
    } else {
        let left = timeout.saturating_sub(idle);
        let honoured = format!(
            "np_affinity sends {client} to {to} (last used {idle} s ago), honoured only until \
             the entry has been idle {timeout} s: {left} s from now unless used again"
        );
        if affinity.follow {
            (honoured, index)
        } else {
            (format!("{honoured}; traced as a new client"), index)
        }
    };
    (
        Step::program(program, "affinity", text).with_elements(vec![element]),
        live,
    )
}

/// The `np_src_ranges` entry that admitted a source.
fn range_element(held: Option<&super::maps::Frontend>, range: &ipnet::IpNet) -> String {
    match held {
        Some(f) => format!("np_src_ranges {{ svc {}, {range} }}", f.svc_id),
        None => format!("np_src_ranges {{ {range} }}"),
    }
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
