//! `nodeport trace`: follows one packet through what the proxy programs and says, in the
//! Service's words, where it goes: its path rule by rule (or map entry by map entry), the
//! Service port, the candidate endpoints with their probability, masquerade and why, and the
//! fate (DNAT, reject, drop, or not a Service).
//!
//! It traces what `render` would program (with `render`'s flags) for the objects of a file
//! (`-f`) or of the API server (`--kubeconfig`/`--master`), with no kernel; with `--rules
//! kernel`, what this node's kernel holds (nftables tables, iptables chains, the ebpf mode's
//! pinned maps); with `--live`, real packets ([`live`]). `--service ns/name` traces every
//! address and port the node serves a Service on, one line each. Exit codes: 0 the packet reaches an
//! endpoint (every served address does, with `--service`), 1 it is dropped, rejected or not
//! for a Service, 3 it could not be traced (or no such Service), 64 bad usage.

use crate::cmd::{out, outln};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use nodeport_proxy::config::ProxyMode;
use nodeport_proxy::model::{IpFamily, Protocol};
use nodeport_proxy::trace::explain::{self, Dataplane, Explanation};
use nodeport_proxy::trace::path::Step;
use nodeport_proxy::trace::recover::Recovered;
use nodeport_proxy::trace::{Env, Origin, Packet, Trace};
use nodeport_proxy::{ebpf, iptables, nftables};
use serde::Serialize;

use super::render::{self, Prepared};
use super::{Exit, UsageError};

mod live;

/// Exit code: the packet is dropped or rejected, or is not for a Service.
const EXIT_NOT_DELIVERED: u8 = 1;
/// Exit code: the packet could not be traced (unreadable input, a mode without tracer, no
/// such Service).
const EXIT_UNTRACEABLE: u8 = 3;
/// `--service`'s outside client when `--from` gives none of the family (TEST-NET-3, RFC 5737;
/// the IPv6 documentation prefix, RFC 3849).
const OUTSIDE_V4: &str = "203.0.113.1";
const OUTSIDE_V6: &str = "2001:db8:ffff::1";

/// Flags of `nodeport trace`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Multi-document YAML of Services, EndpointSlices, ServiceCIDRs and optionally Nodes
    /// ("-" reads standard input): trace what `nodeport render` would program for them.
    /// Without -f, --kubeconfig and --master: the rules this node's kernel holds, named from
    /// the kernel alone (--rules kernel).
    #[arg(
        short = 'f',
        long = "filename",
        conflicts_with_all = ["kubeconfig", "master"]
    )]
    file: Option<PathBuf>,
    /// Read the Services, EndpointSlices, ServiceCIDRs and Nodes from the API server this
    /// kubeconfig names (as `nodeport proxy --kubeconfig`), instead of -f.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// Address of the API server to read the objects from (overrides the kubeconfig's),
    /// instead of -f.
    #[arg(long)]
    master: Option<String>,
    /// Source address of the packet. One of the node's own addresses (--node-ip,
    /// --interface) takes the output path, as a process on the node; any other arrives
    /// from the network (input path). With --service: the outside client external
    /// addresses are traced from [default: 203.0.113.1, or 2001:db8:ffff::1 for IPv6].
    /// With --live: only packets from this address or CIDR [default: any source].
    #[arg(
        long,
        value_name = "ADDR",
        required_unless_present_any = ["service", "live"]
    )]
    from: Option<String>,
    /// Destination: ADDR:PORT/PROTO, e.g. 192.0.2.11:30569/tcp or [2001:db8::1]:80/tcp
    /// (the protocol defaults to tcp). With --live the address may be left out
    /// (:30569/tcp): any address of the node.
    #[arg(
        long,
        value_name = "ADDR:PORT/PROTO",
        required_unless_present = "service",
        conflicts_with = "service"
    )]
    to: Option<String>,
    /// Every address and port this node serves the Service NAMESPACE/NAME on, and what
    /// happens there: its ClusterIPs (from the node itself), its NodePorts on each of the
    /// node's addresses (including those --nodeport-addresses leaves out), its external
    /// and load-balancer IPs (from --from).
    #[arg(long, value_name = "NAMESPACE/NAME")]
    service: Option<String>,
    /// Output format: "human" (one line per step: the path's rules, then the Service,
    /// endpoints, masquerade and fate) or "json" (the schema is in docs/TRACE.md).
    #[arg(
        short = 'o',
        long = "output",
        default_value = "human",
        value_name = "human|json"
    )]
    output: String,
    /// Input path: the interface the packet arrives on [default, with --rules kernel: the
    /// one holding the route back to --from]. No rule the proxy writes matches on it; with
    /// --rules kernel a strict rp_filter on it is checked.
    #[arg(long, value_name = "NAME")]
    in_interface: Option<String>,
    /// Which rules to trace: "render" (what the proxy would program for the objects) or
    /// "kernel" (what this node's kernel holds now: the nftables mode's table read with `nft
    /// -j`, the iptables mode's with iptables-save, the variant detected as the proxy does;
    /// the ebpf mode's pinned maps), named with the objects, or without them (or when the
    /// API server cannot be read) from the kernel alone [default: render with -f,
    /// --kubeconfig or --master, kernel without].
    #[arg(long, value_name = "render|kernel")]
    rules: Option<String>,
    /// Trace real packets: the first packet of each of the next --count new connections to
    /// --to (from --from), as the kernel sees them (nftables trace events, conntrack), each
    /// explained as --rules kernel explains it. nftables and iptables-nft only; in
    /// iptables-legacy the packet of --from/--to is traced through the kernel's rules
    /// instead.
    #[arg(long, conflicts_with = "service")]
    live: bool,
    /// ebpf mode, --rules kernel: where the running proxy pinned its maps (its
    /// --ebpf-pin-root).
    #[arg(long, value_name = "DIR", default_value = super::ebpf::DEFAULT_PIN_ROOT)]
    ebpf_pin_root: PathBuf,
    /// With --live: how many packets to trace.
    #[arg(long, default_value_t = 1, requires = "live", value_name = "N")]
    count: usize,
    /// With --live: how long to wait for them (30s, 500ms, 2m; a number is seconds).
    #[arg(
        long,
        default_value = "30s",
        requires = "live",
        value_name = "DURATION"
    )]
    timeout: String,
    #[command(flatten)]
    render: render::Flags,
}

fn usage(message: impl Into<String>) -> anyhow::Error {
    UsageError(message.into()).into()
}

/// The pinned maps of the ebpf mode could not be read (for `what`: `--rules kernel`,
/// `--live`): exit 3, with every cause.
fn unreadable_pinned_maps(
    what: &str,
    pin_root: &std::path::Path,
    e: nodeport_proxy::ebpf::programs::Error,
) -> anyhow::Error {
    untraceable(format!(
        "{what}: reading the ebpf mode's maps pinned under {}: {}",
        pin_root.display(),
        anyhow::Error::from(e)
            .chain()
            .map(|c| c.to_string())
            .collect::<Vec<_>>()
            .join(": ")
    ))
}

fn untraceable(message: impl Into<String>) -> anyhow::Error {
    Exit {
        code: EXIT_UNTRACEABLE,
        message: Some(message.into()),
    }
    .into()
}

/// Parses `--to`: `ADDR:PORT[/PROTO]`, IPv6 in brackets.
fn parse_to(value: &str) -> anyhow::Result<(SocketAddr, Protocol)> {
    let bad = |why: &str| usage(format!("invalid value {value:?} for --to: {why}"));
    let (addr, proto) = match value.rsplit_once('/') {
        Some((addr, proto)) => (addr, proto),
        None => (value, "tcp"),
    };
    let proto = Protocol::parse(&proto.to_ascii_uppercase())
        .ok_or_else(|| bad("the protocol must be tcp, udp or sctp"))?;
    let addr: SocketAddr = addr
        .parse()
        .map_err(|_| bad("must be ADDR:PORT/PROTO ([ADDR]:PORT/PROTO for IPv6)"))?;
    Ok((addr, proto))
}

/// What `-o json` prints: the explanation and what was traced.
#[derive(Serialize)]
struct Report<'a> {
    /// Where the objects came from: `file` (-f) or `apiserver`.
    source: &'static str,
    /// `render` (what the proxy would program) or `kernel` (what the kernel holds).
    rules: &'static str,
    /// `--proxy-mode`.
    mode: &'static str,
    /// nftables mode: the layout traced.
    #[serde(skip_serializing_if = "Option::is_none")]
    nftables_layout: Option<&'static str>,
    #[serde(flatten)]
    explanation: &'a Explanation,
}

/// What `-o json` prints with `--service`.
#[derive(Serialize)]
struct ServiceReport<'a> {
    /// Where the objects came from: `file` (-f) or `apiserver`.
    source: &'static str,
    /// `render` or `kernel`.
    rules: &'static str,
    /// `--proxy-mode`.
    mode: &'static str,
    /// nftables mode: the layout traced.
    #[serde(skip_serializing_if = "Option::is_none")]
    nftables_layout: Option<&'static str>,
    /// `namespace/name`.
    service: &'a str,
    /// One trace per address and port, as `nodeport trace --to` prints it.
    traces: &'a [Explanation],
}

/// The rules (or maps) a mode renders, ready to be traced.
enum Rendered {
    Nftables(nftables::ruleset::Ruleset),
    Iptables(iptables::ruleset::Ruleset),
    Ebpf(ebpf::render::Rendered),
}

impl Rendered {
    /// Renders the objects as `render` does.
    fn of(prepared: &Prepared) -> anyhow::Result<Self> {
        let Prepared {
            mode,
            algorithm,
            desired,
            facts,
            config,
            ..
        } = prepared;
        Ok(match mode {
            ProxyMode::Nftables => Rendered::Nftables(nftables::render(desired, config)),
            ProxyMode::Iptables => Rendered::Iptables(iptables::render(desired, config)),
            ProxyMode::Ebpf => {
                let render_config = ebpf::render::RenderConfig {
                    algorithm: *algorithm,
                    local_ips: facts.local_ips.clone(),
                    fib_forward: true,
                    masquerade_all: config.masquerade_all,
                    cluster_cidrs: config.cluster_cidrs.clone(),
                };
                Rendered::Ebpf(ebpf::render::render(desired, &render_config))
            }
            ProxyMode::Ipvs => {
                return Err(untraceable(
                    "the ipvs mode cannot be traced: nodeport does not evaluate IPVS (its \
                     companion iptables rules only mark and masquerade)",
                ));
            }
        })
    }

    fn dataplane(&self) -> Dataplane {
        match self {
            Rendered::Nftables(_) => Dataplane::Nftables,
            Rendered::Iptables(_) => Dataplane::Iptables,
            Rendered::Ebpf(_) => Dataplane::Ebpf,
        }
    }

    /// The packet through the mode's tracer.
    fn trace(&self, packet: &Packet, env: &Env) -> Trace {
        match self {
            Rendered::Nftables(ruleset) => nftables::tracer::trace(ruleset, packet, env),
            Rendered::Iptables(ruleset) => match ruleset.family(IpFamily::of(packet.dst)) {
                Some(family) => iptables::tracer::trace(&family.view(), packet, env),
                // No rules of the family: nothing touches the packet.
                None => {
                    iptables::tracer::trace(&iptables::ruleset::TableView::empty(), packet, env)
                }
            },
            Rendered::Ebpf(maps) => ebpf::tracer::trace(maps, packet, env),
        }
    }
}

/// Everything one run traces with.
struct Tracing {
    prepared: Prepared,
    rendered: Rendered,
    /// What the objects came from, for people.
    source: String,
    /// `file` or `apiserver`, for `-o json`.
    origin: &'static str,
    /// `--rules kernel`: what the kernel holds, traced instead of `rendered`.
    kernel: Option<KernelRules>,
    /// `--in-interface`.
    in_interface: Option<String>,
    /// `--rules kernel`: other tables' base chains that can drop packets.
    foreign: Vec<ForeignChain>,
    /// `--rules kernel` without objects: what in the kernel named the Services (the
    /// Services traced with are recovered from the kernel's rules, [`KernelRules::recover`]).
    names_from_kernel: Option<String>,
}

/// A base chain outside the proxy's rules that holds drop or reject rules, or a drop policy
/// (`nft -j list ruleset`: nftables tables and iptables-nft's).
#[derive(Debug, Clone, PartialEq)]
struct ForeignChain {
    /// `ip`, `ip6` or `inet`.
    family: String,
    table: String,
    chain: String,
    /// `prerouting`, `input`, `forward`, `output` or `postrouting`.
    hook: String,
    priority: i64,
    policy_drop: bool,
    /// Drop and reject rules in the chain and the regular chains it jumps to.
    drops: usize,
    /// Its table read back (`nftables::listing`) when every rule of the chain and the chains
    /// it reaches is one the tracer models: then the chain is evaluated for the packet.
    rules: Option<nftables::ruleset::Table>,
}

impl ForeignChain {
    fn describe(&self) -> String {
        let mut what = Vec::new();
        if self.drops > 0 {
            what.push(format!("{} drop or reject rule(s)", self.drops));
        }
        if self.policy_drop {
            what.push("policy drop".to_string());
        }
        format!(
            "table {} {} chain {} (hook {}, priority {}) holds {}: it may drop this packet, \
             outside the proxy's rules (--live shows whether it does)",
            self.family,
            self.table,
            self.chain,
            self.hook,
            self.priority,
            what.join(" and ")
        )
    }
}

/// One way the proxy's rules let a packet through, for another table's chains: its
/// probability, where the DNAT sent it (`None`: untranslated) and whether it ends at a
/// socket of this node (input) or leaves it (forward, postrouting).
struct Branch {
    probability: f64,
    dnat: Option<SocketAddr>,
    to_node: bool,
}

/// The ways the explained packet gets through the proxy's rules.
fn branches(packet: &Packet, e: &Explanation, local: &[IpAddr]) -> Vec<Branch> {
    let mut out: Vec<Branch> = e
        .endpoints
        .iter()
        .map(|c| Branch {
            probability: c.probability,
            dnat: Some(c.endpoint),
            // A pod on this node is forwarded to; only the node's own address is input.
            to_node: local.contains(&c.endpoint.ip()),
        })
        .collect();
    out.extend(
        e.outcomes
            .iter()
            .filter(|o| o.verdict == explain::Verdict::Pass)
            .map(|o| Branch {
                probability: o.probability,
                dnat: None,
                to_node: local.contains(&packet.dst),
            }),
    );
    out
}

impl ForeignChain {
    /// Whether a packet from `origin` on `branch` crosses this chain's hook.
    fn crossed_by(&self, origin: Origin, branch: &Branch) -> bool {
        match (origin, self.hook.as_str()) {
            (Origin::Remote, "prerouting") | (Origin::Local, "output" | "postrouting") => true,
            (_, "input") => branch.to_node,
            (Origin::Remote, "forward" | "postrouting") => !branch.to_node,
            _ => false,
        }
    }

    /// Evaluates the chain for each branch that crosses it: per branch, the share it drops
    /// (or rejects), and whether it rejects; `None` when it cannot be evaluated (rules the
    /// tracer does not model).
    fn evaluate(
        &self,
        packet: &Packet,
        branches: &[Branch],
        env: &Env,
    ) -> Option<(Vec<f64>, bool)> {
        let table = self.rules.as_ref()?;
        // Before the proxy's DNAT (its nat chains at priority -100 of prerouting and
        // output) the packet still has its own destination.
        let before_dnat =
            matches!(self.hook.as_str(), "prerouting" | "output") && self.priority < -100;
        let mut shares = vec![0.0; branches.len()];
        let mut rejects = false;
        for (i, b) in branches.iter().enumerate() {
            if b.probability <= 1e-12 || !self.crossed_by(packet.origin, b) {
                continue;
            }
            let dnat = if before_dnat { None } else { b.dnat };
            let ends = nftables::tracer::evaluate_chain(
                table,
                (&self.chain, self.policy_drop),
                packet,
                dnat,
                env,
            )?;
            shares[i] = ends
                .iter()
                .filter(|(e, _)| *e != nftables::tracer::ChainEnd::Continue)
                .map(|(_, p)| p)
                .sum();
            rejects |= shares[i] > 0.0
                && ends
                    .iter()
                    .any(|(e, _)| *e == nftables::tracer::ChainEnd::Reject);
        }
        Some((shares, rejects))
    }

    /// Where the chain runs on a packet's way, to evaluate chains in the kernel's order.
    fn order(&self, origin: Origin) -> (u8, i64) {
        let hook = match (origin, self.hook.as_str()) {
            (Origin::Remote, "prerouting") | (Origin::Local, "output") => 0,
            (Origin::Remote, "input" | "forward") | (Origin::Local, "postrouting") => 1,
            _ => 2,
        };
        (hook, self.priority)
    }

    /// Applies what the chain does to the ways through the proxy's rules (`branches`, whose
    /// probabilities it lowers by what it drops, for the chains after it) and to the
    /// explanation: its drop becomes the fate (or an `or`), or a note says it drops nothing.
    fn apply(&self, packet: &Packet, e: &mut Explanation, branches: &mut [Branch], env: &Env) {
        // Nothing the proxy lets through crosses it (the proxy drops the packet; which of
        // the two comes first is not evaluated): the note only.
        let crossing = branches
            .iter()
            .any(|b| b.probability > 1e-12 && self.crossed_by(packet.origin, b));
        let evaluated = crossing
            .then(|| self.evaluate(packet, branches, env))
            .flatten();
        let Some((shares, rejects)) = evaluated else {
            e.notes.push(self.describe());
            return;
        };
        let at = format!(
            "table {} {} chain {} (hook {}, priority {})",
            self.family, self.table, self.chain, self.hook, self.priority
        );
        let mut dropped = 0.0;
        let mut toward = Vec::new();
        let mut all_endpoints = true;
        for (b, share) in branches.iter_mut().zip(&shares) {
            if *share <= 0.0 {
                if b.dnat.is_some() && b.probability > 1e-12 {
                    all_endpoints = false;
                }
                continue;
            }
            let lost = b.probability * share;
            dropped += lost;
            b.probability -= lost;
            let verdict = match b.dnat {
                Some(to) => {
                    toward.push(to.to_string());
                    explain::Verdict::Dnat
                }
                None => explain::Verdict::Pass,
            };
            if let Some(o) = e.outcomes.iter_mut().find(|o| o.verdict == verdict) {
                o.probability = (o.probability - lost).max(0.0);
            }
        }
        if dropped <= 1e-12 {
            e.notes.push(format!(
                "{at} holds drop or reject rules; evaluated, none of them drops this packet"
            ));
            return;
        }
        e.outcomes.retain(|o| o.probability > 1e-12);
        let which = if !toward.is_empty() && !all_endpoints {
            format!(" on its way to {}", toward.join(", "))
        } else {
            String::new()
        };
        let verb = if rejects { "reject" } else { "drop" };
        e.outcomes.push(explain::Outcome {
            verdict: if rejects {
                explain::Verdict::Reject
            } else {
                explain::Verdict::Drop
            },
            reason: explain::Reason::OtherTable,
            message: format!(
                "{verb} by table {} {}, not by the proxy's rules: its chain {} (hook {}, \
                 priority {}) {verb}s it{which}",
                self.family, self.table, self.chain, self.hook, self.priority
            ),
            at: Some(format!("{} {} {}", self.family, self.table, self.chain)),
            probability: dropped,
        });
        e.outcomes
            .sort_by(|a, b| b.probability.total_cmp(&a.probability));
    }
}

/// The base chains of `nft -j list ruleset` that can drop packets and are not the proxy's
/// (its `kube-proxy` tables, the `KUBE-` chains of iptables-nft) nor a live tracer's.
fn foreign_chains(listing: &str) -> Vec<ForeignChain> {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(listing) else {
        return Vec::new();
    };
    let items = v["nftables"].as_array().cloned().unwrap_or_default();
    let ours = |table: &str, chain: &str| {
        table == nftables::ruleset::TABLE
            || table.starts_with(nftables::netlink::nftrace::TABLE_PREFIX)
            || chain.starts_with("KUBE-")
    };
    // Per (family, table, chain): drop rules, and the chains it jumps to.
    type Key = (String, String, String);
    let mut drops: std::collections::HashMap<Key, usize> = Default::default();
    let mut jumps: std::collections::HashMap<Key, Vec<String>> = Default::default();
    for item in &items {
        let Some(rule) = item.get("rule") else {
            continue;
        };
        let key = (
            rule["family"].as_str().unwrap_or_default().to_string(),
            rule["table"].as_str().unwrap_or_default().to_string(),
            rule["chain"].as_str().unwrap_or_default().to_string(),
        );
        for e in rule["expr"].as_array().into_iter().flatten() {
            let xt_target = e["xt"]["type"] == "target";
            if e.get("drop").is_some()
                || e.get("reject").is_some()
                || (xt_target && matches!(e["xt"]["name"].as_str(), Some("REJECT" | "DROP")))
            {
                *drops.entry(key.clone()).or_default() += 1;
            }
            for verb in ["jump", "goto"] {
                if let Some(target) = e[verb]["target"].as_str() {
                    jumps
                        .entry(key.clone())
                        .or_default()
                        .push(target.to_string());
                }
            }
        }
    }
    let mut out = Vec::new();
    for item in &items {
        let Some(chain) = item.get("chain") else {
            continue;
        };
        let (Some(hook), Some(family), Some(table), Some(name)) = (
            chain["hook"].as_str(),
            chain["family"].as_str(),
            chain["table"].as_str(),
            chain["name"].as_str(),
        ) else {
            continue;
        };
        if ours(table, name) || !matches!(family, "ip" | "ip6" | "inet") {
            continue;
        }
        // The chain and the regular chains it reaches, the proxy's left out.
        let mut seen = std::collections::BTreeSet::new();
        let mut todo = vec![name.to_string()];
        let mut count = 0;
        while let Some(c) = todo.pop() {
            if ours(table, &c) || !seen.insert(c.clone()) {
                continue;
            }
            let key = (family.to_string(), table.to_string(), c);
            count += drops.get(&key).copied().unwrap_or(0);
            todo.extend(jumps.get(&key).into_iter().flatten().cloned());
        }
        let policy_drop = chain["policy"] == "drop";
        // The table read back as the tracer models it, when no rule the chain can reach
        // was left out.
        let rules = (count > 0 || policy_drop)
            .then(|| {
                let own: Vec<serde_json::Value> = items
                    .iter()
                    .filter(|i| {
                        ["chain", "rule", "set", "map"]
                            .iter()
                            .any(|k| i[*k]["family"] == family && i[*k]["table"] == table)
                    })
                    .cloned()
                    .collect();
                let json = serde_json::json!({ "nftables": own }).to_string();
                let as_family = if family == "ip6" {
                    IpFamily::V6
                } else {
                    IpFamily::V4
                };
                nftables::listing::parse(&json, as_family).ok()
            })
            .flatten()
            .filter(|l| {
                // Every chain it can reach, the proxy's (iptables-nft's KUBE- chains in
                // the same table) included: a rule left out anywhere there leaves the
                // verdict unknown.
                let mut reach = std::collections::BTreeSet::new();
                let mut todo = vec![name.to_string()];
                while let Some(c) = todo.pop() {
                    if reach.insert(c.clone()) {
                        let key = (family.to_string(), table.to_string(), c);
                        todo.extend(jumps.get(&key).into_iter().flatten().cloned());
                    }
                }
                l.skipped
                    .iter()
                    .all(|s| s.split_once(": ").is_none_or(|(c, _)| !reach.contains(c)))
            })
            .map(|l| l.table);
        if count > 0 || policy_drop {
            out.push(ForeignChain {
                family: family.to_string(),
                table: table.to_string(),
                chain: name.to_string(),
                hook: hook.to_string(),
                priority: chain["prio"].as_i64().unwrap_or(0),
                policy_drop,
                drops: count,
                rules,
            });
        }
    }
    out
}

/// This network namespace's other tables' drop chains (none when `nft` cannot list them).
fn read_foreign_chains() -> Vec<ForeignChain> {
    std::process::Command::new("nft")
        .args(["-j", "list", "ruleset"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| foreign_chains(&String::from_utf8_lossy(&o.stdout)))
        .unwrap_or_default()
}

/// The hooks `packet` crosses on its way to the endpoints of `e` (or untranslated).
fn hooks_crossed(packet: &Packet, e: &Explanation, local: &[IpAddr]) -> Vec<&'static str> {
    let untranslated = e
        .outcomes
        .iter()
        .any(|o| o.verdict == explain::Verdict::Pass);
    // A pod on this node is forwarded to like any other; only the node's own address is
    // delivered through input.
    let here = e.endpoints.iter().any(|c| local.contains(&c.endpoint.ip()))
        || (untranslated && local.contains(&packet.dst));
    let away = e
        .endpoints
        .iter()
        .any(|c| !local.contains(&c.endpoint.ip()))
        || (untranslated && !local.contains(&packet.dst));
    let mut hooks = Vec::new();
    match packet.origin {
        Origin::Remote => {
            hooks.push("prerouting");
            if here {
                hooks.push("input");
            }
            if away {
                hooks.extend(["forward", "postrouting"]);
            }
        }
        Origin::Local => {
            hooks.extend(["output", "postrouting"]);
            if here {
                hooks.push("input");
            }
        }
    }
    hooks
}

/// `--rules kernel`: what this network namespace's kernel holds, per family.
enum KernelRules {
    /// The iptables tables, read with `iptables-save`.
    Iptables {
        /// The tools read, and why that variant.
        tools: String,
        /// IPv4, IPv6.
        saved: [iptables::save::Saved; 2],
    },
    /// The `kube-proxy` tables, read with `nft -j list table`.
    Nftables {
        /// IPv4, IPv6 (`None`: no such table).
        listed: [Option<nftables::listing::Listed>; 2],
    },
    /// The ebpf mode's pinned maps, read back into what the tracer walks.
    Ebpf {
        /// The pin root read.
        pin_root: PathBuf,
        /// Frontends, backends and source ranges as the kernel holds them, named as
        /// `np_svc_names` names them (or by service id).
        maps: ebpf::render::Rendered,
        /// The maps have `np_svc_names` (a proxy older than it wrote none).
        named_in_kernel: bool,
    },
}

impl KernelRules {
    /// Reads both families' rules of `mode`; `named` (the objects rendered for the ebpf
    /// mode) names the kernel's frontends.
    fn read(mode: ProxyMode, pin_root: &std::path::Path, named: &Rendered) -> anyhow::Result<Self> {
        match (mode, named) {
            (ProxyMode::Iptables, _) => Self::read_iptables(),
            (ProxyMode::Nftables, _) => Ok(KernelRules::Nftables {
                listed: [Self::read_nft(IpFamily::V4)?, Self::read_nft(IpFamily::V6)?],
            }),
            (ProxyMode::Ebpf, Rendered::Ebpf(named)) => {
                let read = || -> Result<_, ebpf::programs::Error> {
                    let maps = ebpf::programs::Maps::open_pinned(pin_root)?;
                    // A proxy older than np_svc_names has none: ports by service id then.
                    let names = match maps.has(ebpf::maps::names::SVC_NAMES) {
                        true => Some(
                            maps.names()?
                                .into_iter()
                                .filter_map(|(id, v)| Some((id, ebpf::maps::decode_svc_name(&v)?)))
                                .collect(),
                        ),
                        false => None,
                    };
                    Ok((
                        maps.frontends()?,
                        maps.backends()?,
                        maps.source_ranges()?,
                        names,
                        maps.held_affinity()?,
                    ))
                };
                let (frontends, backends, ranges, names, affinity) =
                    read().map_err(|e| unreadable_pinned_maps("--rules kernel", pin_root, e))?;
                let mut maps = ebpf::render::from_maps(
                    &frontends,
                    &backends,
                    &ranges,
                    names.as_ref().unwrap_or(&Default::default()),
                    named,
                );
                maps.affinity = affinity;
                Ok(KernelRules::Ebpf {
                    pin_root: pin_root.to_path_buf(),
                    maps,
                    named_in_kernel: names.is_some(),
                })
            }
            (other, _) => Err(untraceable(format!(
                "--rules kernel reads the nftables, iptables and ebpf modes' state; the {} \
                 mode has no tracer",
                other.as_str()
            ))),
        }
    }

    /// One family's `kube-proxy` table, as `nft -j` lists it.
    fn read_nft(family: IpFamily) -> anyhow::Result<Option<nftables::listing::Listed>> {
        let fam = match family {
            IpFamily::V4 => "ip",
            IpFamily::V6 => "ip6",
        };
        let out = std::process::Command::new("nft")
            .args(["-j", "list", "table", fam, "kube-proxy"])
            .output()
            .map_err(|e| untraceable(format!("running nft: {e}")))?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            // No table of this family: nothing of the proxy's to meet the packet.
            if stderr.contains("No such file or directory") {
                return Ok(None);
            }
            return Err(untraceable(format!(
                "nft -j list table {fam} kube-proxy failed: {}",
                stderr.trim()
            )));
        }
        nftables::listing::parse(&String::from_utf8_lossy(&out.stdout), family)
            .map(Some)
            .map_err(|e| untraceable(format!("reading table {fam} kube-proxy: {e}")))
    }

    /// Both families' tables with the iptables tools of the variant the proxy would pick.
    fn read_iptables() -> anyhow::Result<Self> {
        use iptables::apply::{IptablesCommand, detect_variant};
        let detected = detect_variant(&[]);
        let tools = IptablesCommand {
            prefix: Vec::new(),
            variant: detected.variant,
        };
        let read = |family: IpFamily| -> anyhow::Result<(String, iptables::save::Saved)> {
            let program = tools.tool(family, "save");
            let out = std::process::Command::new(&program)
                .output()
                .map_err(|e| untraceable(format!("running {program}: {e}")))?;
            if !out.status.success() {
                return Err(untraceable(format!(
                    "{program} failed: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                )));
            }
            Ok((
                program,
                iptables::save::parse(&String::from_utf8_lossy(&out.stdout)),
            ))
        };
        let (v4_tool, v4) = read(IpFamily::V4)?;
        let (v6_tool, v6) = read(IpFamily::V6)?;
        Ok(KernelRules::Iptables {
            tools: format!("{v4_tool}, {v6_tool}: {}", detected.reason),
            saved: [v4, v6],
        })
    }

    /// How the rules were read, for the `rules` line.
    fn describe(&self) -> String {
        match self {
            KernelRules::Iptables { tools, .. } => tools.clone(),
            KernelRules::Nftables { .. } => format!(
                "nft -j list table ip/ip6 kube-proxy, the {} layout",
                self.layout().unwrap_or("flat")
            ),
            KernelRules::Ebpf { pin_root, .. } => {
                format!(
                    "the BPF maps pinned under {}",
                    pin_root.join("maps").display()
                )
            }
        }
    }

    /// The nftables layout the kernel's table has.
    fn layout(&self) -> Option<&'static str> {
        let KernelRules::Nftables { listed } = self else {
            return None;
        };
        // The flat layout keeps endpoints in maps; kube-proxy's in chains.
        let flat = listed.iter().flatten().any(|l| {
            l.table
                .sets()
                .any(|s| s.name == nftables::names::SERVICE_ENDPOINTS)
        });
        Some(if flat { "flat" } else { "kube-proxy" })
    }

    /// The packet through the kernel's rules; each rule of its path named by its place in
    /// the kernel's chain (and, nftables, its handle), as the kernel lists it.
    fn trace(&self, packet: &Packet, env: &Env) -> Trace {
        let i = usize::from(IpFamily::of(packet.dst) == IpFamily::V6);
        match self {
            KernelRules::Iptables { saved, .. } => {
                let mut trace = iptables::tracer::trace(&saved[i].view, packet, env);
                placed(&mut trace, |s, index| {
                    let table = match s.table.as_str() {
                        "nat" => iptables::ruleset::Table::Nat,
                        "filter" => iptables::ruleset::Table::Filter,
                        _ => iptables::ruleset::Table::Mangle,
                    };
                    saved[i].place(table, &s.chain, index).map(|p| (p, None))
                });
                trace
            }
            KernelRules::Nftables { listed } => {
                let ruleset = nftables::ruleset::Ruleset {
                    tables: listed[i].iter().map(|l| l.table.clone()).collect(),
                };
                let mut trace = nftables::tracer::trace(&ruleset, packet, env);
                if let Some(l) = &listed[i] {
                    placed(&mut trace, |s, index| l.place(&s.chain, index));
                }
                trace
            }
            KernelRules::Ebpf { maps, .. } => ebpf::tracer::trace(maps, packet, env),
        }
    }

    /// The endpoint the flat layout's session-affinity maps, or the ebpf mode's
    /// `np_affinity`, send this packet's client to, when the kernel recorded one (the other
    /// tracers do not follow affinity); `traced` is the packet traced as a new client's.
    fn remembered(&self, packet: &Packet, env: &Env, traced: &Trace) -> Option<SocketAddr> {
        if let KernelRules::Iptables { .. } = self {
            return None;
        }
        let following = Env {
            recorded_affinity: true,
            ..env.clone()
        };
        let with = self.trace(packet, &following);
        if fates_key(&with) == fates_key(traced) {
            return None;
        }
        match with.fates.as_slice() {
            [(nodeport_proxy::trace::Fate::Delivered { dnat: Some(to), .. }, _)] => Some(*to),
            _ => None,
        }
    }

    /// The Service ports the kernel names, recovered from its rules (or maps) alone.
    fn recover(&self, local_ips: &[IpAddr]) -> Recovered {
        let mut r = Recovered::default();
        match self {
            KernelRules::Iptables { saved, .. } => {
                for (family, s) in IpFamily::ALL.into_iter().zip(saved) {
                    iptables::recover::recover(&s.view, family, &mut r);
                }
            }
            KernelRules::Nftables { listed } => {
                for l in listed.iter().flatten() {
                    nftables::recover::recover(&l.table, &mut r);
                }
            }
            KernelRules::Ebpf { maps, .. } => ebpf::recover::recover(maps, local_ips, &mut r),
        }
        r
    }

    /// Where the kernel's names come from, for the `rules` line.
    fn names_from(&self) -> String {
        match self {
            KernelRules::Iptables { .. } => "the kernel (its rules' comments)".to_string(),
            KernelRules::Nftables { .. } if self.layout() == Some("flat") => {
                "the kernel (its elements' comments)".to_string()
            }
            KernelRules::Nftables { .. } => {
                "the kernel (its chains' names and its elements' comments)".to_string()
            }
            KernelRules::Ebpf {
                named_in_kernel: true,
                ..
            } => "the kernel (its np_svc_names map)".to_string(),
            KernelRules::Ebpf { .. } => "the kernel, whose BPF maps hold no np_svc_names (a \
                 proxy older than it pinned them): ports are named by their service id \
                 (svc-<id>)"
                .to_string(),
        }
    }

    /// Rules of the packet's family that were left out.
    fn skipped(&self, family: IpFamily) -> &[String] {
        let i = usize::from(family == IpFamily::V6);
        match self {
            KernelRules::Iptables { saved, .. } => &saved[i].skipped,
            KernelRules::Nftables { listed } => {
                listed[i].as_ref().map_or(&[][..], |l| &l.skipped[..])
            }
            // Every frontend, backend and range is read.
            KernelRules::Ebpf { .. } => &[],
        }
    }
}

/// Names each rule of `trace`'s walks as the kernel holds it: `place(step, index)` gives the
/// place (from 1) and handle of the rule read as the chain's `index`-th (from 0).
fn placed(trace: &mut Trace, place: impl Fn(&Step, usize) -> Option<(usize, Option<u64>)>) {
    for w in &mut trace.walks {
        for s in &mut w.steps {
            if let Some(index) = s.rule_index
                && let Some((at, handle)) = place(s, index - 1)
            {
                s.rule_index = Some(at);
                s.rule_handle = handle;
            }
        }
    }
}

/// Names what the kernel holds from the kernel alone (`recovered` from its rules): the
/// Services, their endpoints and the settings the rules show replace the (absent) objects'
/// in `prepared`.
fn name_from_kernel(prepared: &mut Prepared, recovered: &Recovered) {
    let node = NodeRoutes::read(recovered, &prepared.facts.local_ips);
    prepared.desired = recovered.into_desired(&|ip| node.on_this_node(ip));
    // The node's own addresses, for what it sends itself (`--service`'s ClusterIPs): those
    // of the node network.
    prepared.facts.node_ips = node.node_addresses.clone();
}

/// Named from the kernel: the proxy's flags the trace was not given, as the kernel's rules
/// show them (`recovered`): `--cluster-cidr` and `--masquerade-all` (the ClusterIP
/// masquerade rules), and `--nodeport-addresses`, said as the addresses the kernel serves
/// NodePorts on. (With objects the flags are `render`'s, the proxy's own, as given: taken
/// from the kernel, a kernel missing its NodePort rules would look like a proxy told to
/// serve no NodePort, not like one whose rules are gone.)
fn follow_kernel(prepared: &mut Prepared, recovered: &Recovered, flags: &render::Flags) {
    if !flags.cluster_cidr_given() && !recovered.cluster_cidrs.is_empty() {
        prepared.config.cluster_cidrs = recovered.cluster_cidrs.iter().copied().collect();
    }
    prepared.config.masquerade_all |= recovered.masquerade_all;
    if !flags.nodeport_addresses_given() {
        for fam in &mut prepared.desired.families {
            if let Some(facts) = recovered.families.get(&fam.family) {
                fam.nodeport_ips = match &facts.nodeport_ips {
                    Some(ips) => nodeport_proxy::nodeaddr::Selection::Ips(ips.clone()),
                    None => nodeport_proxy::nodeaddr::Selection::MatchAll,
                };
            }
        }
        // Per family: the addresses the kernel lists, or every address of the node's.
        let mut served = Vec::new();
        for (family, facts) in &recovered.families {
            match &facts.nodeport_ips {
                Some(ips) => served.extend(ips.iter().map(|ip| ip.to_string())),
                None => served.push(format!("every {} address of its own", family.as_str())),
            }
        }
        prepared.nodeport_addresses = format!(
            "of the proxy (this node's kernel serves NodePorts on {})",
            if served.is_empty() {
                "no address".to_string()
            } else {
                served.join(", ")
            }
        );
    }
}

/// This node's routes and interfaces, read once (`ip -j route`, `ip -j address`): whether
/// an endpoint whose place the kernel's rules do not say is on this node. It is when it is
/// one of the node's addresses, or when the route to it has no gateway and leaves through
/// an interface other than the node network's (the interfaces holding the NodePort
/// addresses the kernel lists, else those holding a default route, else the first
/// interface with a global address): a pod's veth or bridge. An endpoint behind a gateway,
/// or a neighbour on the node network, is on another node.
struct NodeRoutes {
    /// Unicast routes of the main table: destination, whether via a gateway, interface.
    routes: Vec<(ipnet::IpNet, bool, String)>,
    /// The node network's interfaces.
    node_interfaces: std::collections::BTreeSet<String>,
    /// Their addresses (loopback and link-local aside), in the kernel's order.
    node_addresses: Vec<IpAddr>,
    /// The node's own addresses.
    own: Vec<IpAddr>,
}

impl NodeRoutes {
    fn read(recovered: &Recovered, own: &[IpAddr]) -> Self {
        let json = |args: &[&str]| -> Vec<serde_json::Value> {
            std::process::Command::new("ip")
                .args(args)
                .output()
                .ok()
                .filter(|o| o.status.success())
                .and_then(|o| serde_json::from_slice(&o.stdout).ok())
                .unwrap_or_default()
        };
        let mut routes = Vec::new();
        for (family, any) in [("-4", "0.0.0.0/0"), ("-6", "::/0")] {
            for r in json(&[family, "-j", "route", "show", "table", "main"]) {
                if !matches!(r["type"].as_str(), None | Some("unicast")) {
                    continue;
                }
                let (Some(dst), Some(dev)) = (r["dst"].as_str(), r["dev"].as_str()) else {
                    continue;
                };
                let dst = if dst == "default" { any } else { dst };
                let net = dst
                    .parse::<ipnet::IpNet>()
                    .or_else(|_| dst.parse::<IpAddr>().map(ipnet::IpNet::from));
                if let Ok(net) = net {
                    routes.push((net, r.get("gateway").is_some(), dev.to_string()));
                }
            }
        }
        // Interface → its addresses, in the kernel's order.
        let mut addresses: Vec<(String, IpAddr)> = Vec::new();
        for link in json(&["-j", "address", "show"]) {
            let Some(name) = link["ifname"].as_str() else {
                continue;
            };
            for a in link["addr_info"].as_array().into_iter().flatten() {
                if let Some(ip) = a["local"].as_str().and_then(|s| s.parse::<IpAddr>().ok()) {
                    addresses.push((name.to_string(), ip));
                }
            }
        }
        let listed: Vec<IpAddr> = IpFamily::ALL
            .into_iter()
            .filter_map(|f| recovered.nodeport_ips(f))
            .flatten()
            .copied()
            .filter(|ip| !ip.is_loopback())
            .collect();
        let mut node_interfaces: std::collections::BTreeSet<String> = addresses
            .iter()
            .filter(|(_, ip)| listed.contains(ip))
            .map(|(name, _)| name.clone())
            .collect();
        if node_interfaces.is_empty() {
            node_interfaces = routes
                .iter()
                .filter(|(net, _, _)| net.prefix_len() == 0)
                .map(|(_, _, dev)| dev.clone())
                .collect();
        }
        if node_interfaces.is_empty() {
            node_interfaces.extend(
                addresses
                    .iter()
                    .find(|(_, ip)| {
                        !ip.is_loopback()
                            && !matches!(ip, IpAddr::V6(v6) if v6.is_unicast_link_local())
                    })
                    .map(|(name, _)| name.clone()),
            );
        }
        let node_addresses = addresses
            .iter()
            .filter(|(name, ip)| {
                node_interfaces.contains(name)
                    && !ip.is_loopback()
                    && !matches!(ip, IpAddr::V6(v6) if v6.is_unicast_link_local())
            })
            .map(|(_, ip)| *ip)
            .collect();
        NodeRoutes {
            routes,
            node_interfaces,
            node_addresses,
            own: own.to_vec(),
        }
    }

    fn on_this_node(&self, ip: IpAddr) -> bool {
        if self.own.contains(&ip) {
            return true;
        }
        let best = self
            .routes
            .iter()
            .filter(|(net, _, _)| net.contains(&ip))
            .max_by_key(|(net, _, _)| net.prefix_len());
        best.is_some_and(|(_, via_gateway, dev)| {
            !via_gateway && !self.node_interfaces.contains(dev)
        })
    }
}

/// The dataplane whose rules this network namespace holds, for `--rules kernel` without
/// `--proxy-mode`: a `kube-proxy` nftables table, else iptables `KUBE-SERVICES` chains (either
/// variant), else none we can read.
fn detect_mode(pin_root: &std::path::Path) -> anyhow::Result<ProxyMode> {
    let holds = |program: &str, args: &[&str], needle: &str| {
        std::process::Command::new(program)
            .args(args)
            .output()
            .is_ok_and(|o| {
                o.status.success() && String::from_utf8_lossy(&o.stdout).contains(needle)
            })
    };
    for family in ["ip", "ip6"] {
        if holds("nft", &["list", "table", family, "kube-proxy"], "table") {
            return Ok(ProxyMode::Nftables);
        }
    }
    for save in [
        "iptables-nft-save",
        "iptables-legacy-save",
        "ip6tables-nft-save",
        "ip6tables-legacy-save",
    ] {
        if holds(save, &["-t", "nat"], ":KUBE-SERVICES") {
            return Ok(ProxyMode::Iptables);
        }
    }
    let services = pin_root.join("maps").join(ebpf::maps::names::SERVICES);
    if services.exists() {
        return Ok(ProxyMode::Ebpf);
    }
    Err(untraceable(format!(
        "--rules kernel: this node holds no nftables table kube-proxy, no iptables \
         KUBE-SERVICES chain and no BPF maps pinned under {}; give --proxy-mode (and \
         --ebpf-pin-root)",
        pin_root.display()
    )))
}

/// What besides the proxy's rules decides the fate on this node, for `--rules kernel`: a
/// packet from the network DNATed to an endpoint elsewhere must be forwarded
/// (`net.ipv4.ip_forward`, `net.ipv6.conf.all.forwarding`), and every endpoint needs a route.
fn node_notes(packet: &Packet, e: &Explanation, local: &[IpAddr]) -> Vec<String> {
    let mut notes = Vec::new();
    let away: Vec<IpAddr> = e
        .endpoints
        .iter()
        .map(|c| c.endpoint.ip())
        .filter(|ip| !local.contains(ip))
        .collect();
    if packet.origin == Origin::Remote && !away.is_empty() {
        let (key, path) = match IpFamily::of(packet.dst) {
            IpFamily::V4 => ("net.ipv4.ip_forward", "/proc/sys/net/ipv4/ip_forward"),
            IpFamily::V6 => (
                "net.ipv6.conf.all.forwarding",
                "/proc/sys/net/ipv6/conf/all/forwarding",
            ),
        };
        if std::fs::read_to_string(path).is_ok_and(|v| v.trim() == "0") {
            notes.push(format!(
                "{key} is 0: this node does not forward, so the DNATed packet is dropped \
                 before it reaches an endpoint"
            ));
        }
    }
    // Not translated and not for this node: routing decides before the forward hook's rules,
    // and a destination without a route is refused there (ICMP net unreachable).
    let routed = |ip: IpAddr| {
        std::process::Command::new("ip")
            .args(["route", "get", &ip.to_string()])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    // Unless the rules ended it before routing: the tc programs decide every drop and
    // reject before the stack; nftables drops sources outside loadBalancerSourceRanges in
    // filter-prerouting (its rejects and other drops are in input and forward, after routing;
    // iptables' are all in the filter table, after routing too).
    let ended_before_routing = e.outcomes.iter().all(|o| {
        matches!(o.verdict, explain::Verdict::Drop | explain::Verdict::Reject)
            && match e.dataplane {
                Dataplane::Ebpf => true,
                Dataplane::Nftables => o.reason == explain::Reason::SourceRanges,
                Dataplane::Iptables => false,
            }
    });
    if e.endpoints.is_empty()
        && !ended_before_routing
        && !local.contains(&packet.dst)
        && !routed(packet.dst)
    {
        notes.push(format!(
            "no route to {} on this node: routing refuses the packet (ICMP network \
             unreachable) before any forward rule",
            packet.dst
        ));
    }
    // The node's own packet is routed before the output hook's rules translate it: a
    // Service address the node has no route to fails at connect() ("Network is
    // unreachable"), whatever the rules would do (nodes route Service CIDRs, usually by
    // their default route). The eBPF socket programs translate at connect(), before it.
    if packet.origin == Origin::Local
        && e.dataplane != Dataplane::Ebpf
        && !e.endpoints.is_empty()
        && !local.contains(&packet.dst)
        && !routed(packet.dst)
    {
        notes.push(format!(
            "no route to {} on this node: the node's own connection fails at connect() \
             (Network is unreachable) before the output rules translate it",
            packet.dst
        ));
    }
    for ip in away {
        if !routed(ip) {
            notes.push(format!(
                "no route to the endpoint {ip}: a packet DNATed to it goes nowhere"
            ));
        }
    }
    notes
}

/// The interface holding the route to `ip` in this network namespace (`ip route get`).
fn route_interface(ip: IpAddr) -> Option<String> {
    let out = std::process::Command::new("ip")
        .args(["-j", "route", "get", &ip.to_string()])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let routes: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    routes[0]["dev"].as_str().map(str::to_string)
}

/// Strict reverse-path filtering on `iface`: the kernel uses the larger of `all` and the
/// interface's `rp_filter` (1 strict, 2 loose).
fn strict_rp_filter(iface: &str) -> bool {
    let read = |name: &str| {
        std::fs::read_to_string(format!("/proc/sys/net/ipv4/conf/{name}/rp_filter"))
            .ok()
            .and_then(|v| v.trim().parse::<u8>().ok())
            .unwrap_or(0)
    };
    read("all").max(read(iface)) == 1
}

/// Whether the kernel routes 127.0.0.0/8 from the network to local sockets:
/// `net.ipv4.conf.{all,<interface>}.route_localnet`, either on (as the kernel reads it).
fn route_localnet(interface: Option<&str>) -> bool {
    let read = |name: &str| {
        std::fs::read_to_string(format!("/proc/sys/net/ipv4/conf/{name}/route_localnet"))
            .is_ok_and(|v| v.trim() == "1")
    };
    read("all") || interface.is_some_and(read)
}

/// This network namespace's addresses (the node's, when run on the node).
fn local_addresses() -> anyhow::Result<Vec<IpAddr>> {
    let runtime = tokio::runtime::Runtime::new()
        .map_err(|e| untraceable(format!("starting the async runtime: {e}")))?;
    runtime
        .block_on(nodeport_proxy::addrs::local_addresses())
        .map_err(|e| untraceable(format!("reading this node's addresses: {e}")))
}

/// A trace's fates in a form two traces can be compared by (probabilities rounded).
fn fates_key(trace: &Trace) -> Vec<(String, i64)> {
    let mut key: Vec<(String, i64)> = trace
        .fates
        .iter()
        .map(|(f, p)| {
            // Chain names aside: the kernel may hold the other nftables layout.
            let kind = match f {
                nodeport_proxy::trace::Fate::Dropped(_) => "dropped".to_string(),
                nodeport_proxy::trace::Fate::Rejected(_) => "rejected".to_string(),
                // The affinity sets' and maps' names differ between the layouts too.
                nodeport_proxy::trace::Fate::Delivered {
                    dnat, masqueraded, ..
                } => format!("delivered {dnat:?} {masqueraded}"),
            };
            (kind, (p * 1e9).round() as i64)
        })
        .collect();
    key.sort();
    key
}

impl Tracing {
    fn packet(&self, from: IpAddr, to: SocketAddr, proto: Protocol) -> Packet {
        let origin = if self.prepared.facts.local_ips.contains(&from) {
            Origin::Local
        } else {
            Origin::Remote
        };
        Packet {
            src: from,
            dst: to.ip(),
            proto,
            dport: to.port(),
            origin,
        }
    }

    /// [`Self::explain`], failing where the tracer gave the kernel's rules up (a trace
    /// without fates, which only rules read back from the kernel can give).
    fn explain_walked(&self, packet: &Packet) -> anyhow::Result<Explanation> {
        let explanation = self.explain(packet);
        if explanation.outcomes.is_empty() {
            return Err(untraceable(format!(
                "the kernel's rules cannot be walked for {packet}: a jump loop, chains nested \
                 over {} deep, or random (statistic) branches that keep apart and walk on (over \
                 {} rule evaluations per rule)",
                iptables::tracer::MAX_JUMP_DEPTH,
                iptables::tracer::STEPS_PER_RULE
            )));
        }
        Ok(explanation)
    }

    fn explain(&self, packet: &Packet) -> Explanation {
        let p = &self.prepared;
        // A new client's path: what the rules decide (session affinity only repeats an
        // earlier choice; a client the kernel remembers is said in a note below).
        let env = Env {
            local_addrs: p.facts.local_ips.clone(),
            ..Env::default()
        };
        let rendered = self.rendered.trace(packet, &env);
        let trace = match &self.kernel {
            Some(k) => k.trace(packet, &env),
            None => rendered.clone(),
        };
        let ctx = explain::Context {
            dataplane: self.rendered.dataplane(),
            masquerade_all: p.config.masquerade_all,
            cluster_cidrs: &p.config.cluster_cidrs,
            nodeport_addresses: p.nodeport_addresses.clone(),
            local_addrs: &p.facts.local_ips,
            maglev: p.mode == ProxyMode::Ebpf && p.algorithm == ebpf::render::Algorithm::Maglev,
            // What the node holds, for a packet from the network to 127.0.0.0/8.
            route_localnet: (self.kernel.is_some()
                && packet.origin == Origin::Remote
                && packet.dst.is_loopback()
                && packet.dst.is_ipv4())
            .then(|| route_localnet(self.in_interface.as_deref())),
            localhost_nodeports: p.config.localhost_nodeports,
            flat_layout: self.layout() == Some("flat"),
        };
        let mut explanation = explain::explain(&p.desired, &ctx, &trace);
        if packet.origin == Origin::Remote {
            explanation.packet.interface = self.in_interface.clone();
        }
        if self.kernel.is_some() {
            if packet.origin == Origin::Remote {
                let back = route_interface(packet.src);
                if explanation.packet.interface.is_none() {
                    explanation.packet.interface = back
                        .as_ref()
                        .map(|i| format!("{i} (the route back to {})", packet.src));
                }
                if let (Some(iif), Some(back)) = (&self.in_interface, &back)
                    && iif != back
                    && strict_rp_filter(iif)
                {
                    explanation.notes.push(format!(
                        "strict rp_filter on {iif} drops it before any rule: the route back \
                         to {} leaves through {back}",
                        packet.src
                    ));
                }
            }
            let notes = node_notes(packet, &explanation, &p.facts.local_ips);
            explanation.notes.extend(notes);
            let hooks = hooks_crossed(packet, &explanation, &p.facts.local_ips);
            let family = match IpFamily::of(packet.dst) {
                IpFamily::V4 => "ip",
                IpFamily::V6 => "ip6",
            };
            // In the order the kernel runs them, each on what the ones before let through.
            let mut foreign: Vec<&ForeignChain> = self
                .foreign
                .iter()
                .filter(|c| {
                    (c.family == family || c.family == "inet") && hooks.contains(&c.hook.as_str())
                })
                .collect();
            foreign.sort_by_key(|c| c.order(packet.origin));
            let mut ways = branches(packet, &explanation, &p.facts.local_ips);
            for c in foreign {
                c.apply(packet, &mut explanation, &mut ways, &env);
            }
        }
        if let Some(k) = &self.kernel {
            let skipped = k.skipped(IpFamily::of(packet.dst));
            if !skipped.is_empty() {
                explanation.notes.push(format!(
                    "{} rule(s) of the kernel were not evaluated (matches or targets the tracer \
                     does not model), e.g. {}",
                    skipped.len(),
                    skipped[0]
                ));
            }
            if let Some(to) = k.remembered(packet, &env, &trace) {
                explanation.notes.push(format!(
                    "session affinity: the kernel remembers this client and sends it to {to} \
                     until the entry expires (shown is a new client's path)"
                ));
            }
            // Named from the kernel, the objects are the kernel's own: nothing to compare.
            if self.names_from_kernel.is_none() && fates_key(&rendered) != fates_key(&trace) {
                let would = explain::explain(&p.desired, &ctx, &rendered);
                let fate = would
                    .outcomes
                    .first()
                    .map(|o| o.message.clone())
                    .unwrap_or_default();
                explanation.notes.push(format!(
                    "the kernel differs from what the proxy would program for these objects, \
                     which is: {fate} (a sync not yet done or failed, or rules of another tool)"
                ));
            }
        }
        explanation
    }

    fn layout(&self) -> Option<&'static str> {
        if let Some(k) = &self.kernel {
            return k.layout();
        }
        (self.prepared.mode == ProxyMode::Nftables)
            .then_some(self.prepared.config.nftables_layout.as_str())
    }

    /// The `rules` line.
    fn rules_line(&self) -> String {
        let mode = match self.layout() {
            Some(l) => format!("{} ({l} layout)", self.prepared.mode.as_str()),
            None => self.prepared.mode.as_str().to_string(),
        };
        match &self.kernel {
            Some(k) => format!(
                "rules       {}, as this node's kernel holds them ({}); names from {}",
                self.prepared.mode.as_str(),
                k.describe(),
                self.names_from_kernel.as_deref().unwrap_or(&self.source)
            ),
            None => format!(
                "rules       {mode}, as `nodeport render` programs them for {}",
                self.source
            ),
        }
    }

    /// The hint for a `--service` the kernel's names lack.
    fn missing_service_hint(&self) -> &'static str {
        match (&self.kernel, &self.names_from_kernel) {
            (
                Some(KernelRules::Ebpf {
                    named_in_kernel: false,
                    ..
                }),
                Some(_),
            ) => " (these ebpf maps hold no np_svc_names: give -f or --kubeconfig)",
            _ => "",
        }
    }

    /// `render` or `kernel`, for `-o json`.
    fn rules(&self) -> &'static str {
        if self.kernel.is_some() {
            "kernel"
        } else {
            "render"
        }
    }
}

/// Runs `nodeport trace`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let json = match args.output.as_str() {
        "human" => false,
        "json" => true,
        other => {
            return Err(usage(format!(
                "invalid value {other:?} for --output: must be human or json"
            )));
        }
    };
    // --live takes a CIDR too.
    let live_from = match (&args.from, args.live) {
        (Some(v), true) => Some(live::parse_from(v)?),
        _ => None,
    };
    let from = match &args.from {
        Some(v) if !args.live => Some(
            v.parse::<IpAddr>()
                .map_err(|_| usage(format!("invalid value {v:?} for --from: not an IP address")))?,
        ),
        _ => live_from
            .filter(|n| n.prefix_len() == n.max_prefix_len())
            .map(|n| n.addr()),
    };
    let live_to = match (&args.to, args.live) {
        (Some(v), true) => Some(live::parse_to(v)?),
        _ => None,
    };
    let service = match &args.service {
        Some(v) => match v.split_once('/') {
            Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
                Some((ns.to_string(), name.to_string()))
            }
            _ => {
                return Err(usage(format!(
                    "invalid value {v:?} for --service: must be NAMESPACE/NAME"
                )));
            }
        },
        None => None,
    };
    let to = match &args.to {
        Some(v) if !args.live => Some(parse_to(v)?),
        _ => live_to.and_then(|(ip, port, proto)| Some((SocketAddr::new(ip?, port), proto))),
    };
    if let (Some(from), Some((to, _))) = (from, to)
        && IpFamily::of(from) != IpFamily::of(to.ip())
    {
        return Err(usage(format!(
            "--from {from} and --to {} are not of the same IP family",
            to.ip()
        )));
    }
    if let (Some(net), Some((Some(ip), ..))) = (live_from, live_to)
        && IpFamily::of(net.addr()) != IpFamily::of(ip)
    {
        return Err(usage(format!(
            "--from {net} and --to {ip} are not of the same IP family"
        )));
    }
    let mut args = args;
    let has_objects = args.file.is_some() || args.kubeconfig.is_some() || args.master.is_some();
    let kernel_rules = match (args.rules.as_deref(), args.live) {
        // Real packets are explained with what the kernel holds.
        (_, true) | (Some("kernel"), _) => true,
        (Some("render"), _) => false,
        (Some(other), _) => {
            return Err(usage(format!(
                "invalid value {other:?} for --rules: must be render or kernel"
            )));
        }
        (None, _) => !has_objects,
    };
    if !kernel_rules && !has_objects {
        return Err(usage(
            "--rules render traces what the proxy would program for objects: give -f FILE, \
             --kubeconfig or --master (without them, --rules kernel traces what this node's \
             kernel holds, named from the kernel)",
        ));
    }
    if kernel_rules && args.render.proxy_mode.is_none() {
        args.render.proxy_mode = Some(detect_mode(&args.ebpf_pin_root)?.as_str().to_string());
    }
    let objects = match &args.file {
        Some(file) => Some((
            render::read_file(file).map_err(|e| untraceable(format!("{e:#}")))?,
            file.display().to_string(),
            "file",
        )),
        None if has_objects => {
            let server = match (&args.master, &args.kubeconfig) {
                (Some(url), _) => url.clone(),
                (None, Some(path)) => format!("kubeconfig {}", path.display()),
                (None, None) => unreachable!("has_objects: --kubeconfig or --master"),
            };
            match objects_from_api(args.kubeconfig.clone(), args.master.as_deref()) {
                Ok(text) => Some((text, format!("the objects of {server}"), "apiserver")),
                // The kernel's rules need no server: named from the kernel instead.
                Err(e) if kernel_rules && !e.is::<UsageError>() => {
                    eprintln!(
                        "nodeport trace: the objects of {server} cannot be read ({e:#}); \
                         naming what the kernel holds from the kernel alone"
                    );
                    None
                }
                Err(e) => return Err(e),
            }
        }
        None => None,
    };
    let named_by_objects = objects.is_some();
    let (text, source, origin) =
        objects.unwrap_or_else(|| (String::new(), "the kernel".to_string(), "kernel"));
    let prepared = render::prepare(&args.render, &text, &source).map_err(|e| {
        if e.is::<UsageError>() {
            e
        } else {
            untraceable(format!("{e:#}"))
        }
    })?;
    let mut prepared = prepared;
    let mut names_from_kernel = None;
    let kernel = if kernel_rules {
        // The node as it is: its own addresses decide the path and `fib … type local`
        // (and name the ebpf mode's frontends, which are per address).
        prepared.facts.local_ips = local_addresses()?;
        let named = Rendered::of(&prepared)?;
        let k = KernelRules::read(prepared.mode, &args.ebpf_pin_root, &named)?;
        if !named_by_objects {
            let recovered = k.recover(&prepared.facts.local_ips);
            name_from_kernel(&mut prepared, &recovered);
            follow_kernel(&mut prepared, &recovered, &args.render);
            names_from_kernel = Some(k.names_from());
        }
        Some(k)
    } else {
        None
    };
    let rendered = Rendered::of(&prepared)?;
    let prepared_mode = prepared.mode;
    let tracing = Tracing {
        prepared,
        rendered,
        source,
        origin,
        kernel,
        in_interface: args.in_interface.clone(),
        // The ebpf mode forwards what it translates at tc, past netfilter's hooks.
        foreign: if kernel_rules && prepared_mode != ProxyMode::Ebpf {
            read_foreign_chains()
        } else {
            Vec::new()
        },
        names_from_kernel,
    };
    if args.live {
        let (daddr, dport, protocol) = live_to.expect("clap requires --to with --live");
        let selector = nodeport_proxy::nftables::netlink::nftrace::Selector {
            protocol,
            dport,
            daddr,
            from: live_from,
        };
        let timeout = live::parse_duration(&args.timeout)?;
        return live::run(
            &tracing,
            &selector,
            args.count,
            timeout,
            json,
            (from, to),
            &args.ebpf_pin_root,
        );
    }
    let reached = match (service, from, to) {
        (Some((ns, name)), _, _) => trace_service(&tracing, &ns, &name, from, json)?,
        (None, Some(from), Some((to, proto))) => trace_packet(&tracing, from, to, proto, json)?,
        // clap requires --from and --to without --service.
        _ => return Err(usage("--from and --to are required without --service")),
    };
    if reached {
        Ok(())
    } else {
        Err(Exit {
            code: EXIT_NOT_DELIVERED,
            message: None,
        }
        .into())
    }
}

/// One packet: printed step by step. Whether it reaches an endpoint.
fn trace_packet(
    tracing: &Tracing,
    from: IpAddr,
    to: SocketAddr,
    proto: Protocol,
    json: bool,
) -> anyhow::Result<bool> {
    let explanation = tracing.explain_walked(&tracing.packet(from, to, proto))?;
    if json {
        let report = Report {
            source: tracing.origin,
            rules: tracing.rules(),
            mode: tracing.prepared.mode.as_str(),
            nftables_layout: tracing.layout(),
            explanation: &explanation,
        };
        outln!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        outln!("{}", tracing.rules_line());
        out!("{explanation}");
    }
    Ok(explanation.reaches_endpoint())
}

/// Every address and port the node serves `ns/name` on, one trace each: the ClusterIPs
/// from the node itself, NodePorts on each of the node's addresses (loopback and IPv6
/// link-local aside), external and load-balancer IPs from the outside client. Whether
/// every address that serves the Service reaches an endpoint (a NodePort on an address
/// `--nodeport-addresses` leaves out is shown, not counted).
fn trace_service(
    tracing: &Tracing,
    ns: &str,
    name: &str,
    from: Option<IpAddr>,
    json: bool,
) -> anyhow::Result<bool> {
    let p = &tracing.prepared;
    let outside = |family: IpFamily| -> IpAddr {
        match from {
            Some(ip) if IpFamily::of(ip) == family => ip,
            _ => match family {
                IpFamily::V4 => OUTSIDE_V4.parse().expect("an IPv4 address"),
                IpFamily::V6 => OUTSIDE_V6.parse().expect("an IPv6 address"),
            },
        }
    };
    let mut packets = Vec::new();
    for fam in &p.desired.families {
        let node_ip = p
            .facts
            .node_ips
            .iter()
            .chain(&p.facts.local_ips)
            .copied()
            .find(|ip| IpFamily::of(*ip) == fam.family && !ip.is_loopback());
        let node_addrs: Vec<IpAddr> = p
            .facts
            .local_ips
            .iter()
            .copied()
            .filter(|ip| {
                IpFamily::of(*ip) == fam.family
                    && !ip.is_loopback()
                    && !matches!(ip, IpAddr::V6(v6) if v6.is_unicast_link_local())
            })
            .collect();
        for svc in fam.services.values() {
            let port = &svc.port;
            if &*port.name.namespace != ns || &*port.name.name != name {
                continue;
            }
            let proto = port.name.protocol;
            let client = outside(fam.family);
            if let Some(node_ip) = node_ip {
                packets.push((node_ip, SocketAddr::new(svc.cluster_ip, port.port), proto));
            }
            if let Some(node_port) = port.node_port {
                for ip in &node_addrs {
                    packets.push((client, SocketAddr::new(*ip, node_port), proto));
                }
            }
            for ip in svc.external_ips.iter().chain(&svc.load_balancer_ips) {
                packets.push((client, SocketAddr::new(*ip, port.port), proto));
            }
        }
    }
    if packets.is_empty() {
        return Err(untraceable(format!(
            "no Service {ns}/{name} in {} (or it has no ClusterIP){}",
            tracing.source,
            tracing.missing_service_hint()
        )));
    }
    let traces: Vec<Explanation> = packets
        .iter()
        .map(|(from, to, proto)| tracing.explain_walked(&tracing.packet(*from, *to, *proto)))
        .collect::<anyhow::Result<_>>()?;
    let served = |e: &&Explanation| {
        !e.outcomes
            .iter()
            .any(|o| o.reason == explain::Reason::NotNodePortAddress)
    };
    let reached = traces
        .iter()
        .filter(served)
        .all(Explanation::reaches_endpoint);
    let label = format!("{ns}/{name}");
    if json {
        let report = ServiceReport {
            source: tracing.origin,
            rules: tracing.rules(),
            mode: tracing.prepared.mode.as_str(),
            nftables_layout: tracing.layout(),
            service: &label,
            traces: &traces,
        };
        outln!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(reached);
    }
    outln!("{}", tracing.rules_line());
    outln!("service     {label}: every address this node serves it on");
    let width = traces
        .iter()
        .map(|e| format!("{}/{}", e.packet.to, e.packet.protocol).len())
        .max()
        .unwrap_or(0);
    let from_width = traces
        .iter()
        .map(|e| e.packet.from.to_string().len())
        .max()
        .unwrap_or(0);
    for e in &traces {
        let to = format!("{}/{}", e.packet.to, e.packet.protocol);
        let kind = match e.service.as_ref().map(|s| s.frontend) {
            Some(explain::Frontend::ClusterIP) => "ClusterIP",
            Some(explain::Frontend::NodePort) => "NodePort",
            Some(explain::Frontend::ExternalIP) => "external IP",
            Some(explain::Frontend::LoadBalancerIP) => "load-balancer IP",
            None => "-",
        };
        let fate = e.outcomes.first().map(|o| o.message.as_str()).unwrap_or("");
        let masq = match (
            e.endpoints.iter().all(|c| c.masquerade),
            e.endpoints.iter().any(|c| c.masquerade),
        ) {
            _ if e.endpoints.is_empty() => "",
            (true, _) => ", masqueraded",
            (false, true) => ", masqueraded to some",
            (false, false) => ", not masqueraded",
        };
        outln!(
            "{to:<width$}  {kind:<16}  from {:<from_width$}  {fate}{masq}",
            e.packet.from.to_string()
        );
        for note in &e.notes {
            outln!("{:width$}  note: {note}", "");
        }
    }
    Ok(reached)
}

/// The Services, EndpointSlices, ServiceCIDRs and Nodes the API server holds, as the text of
/// a `List` that `objects::load` reads like a file (JSON is YAML).
fn objects_from_api(kubeconfig: Option<PathBuf>, master: Option<&str>) -> anyhow::Result<String> {
    use k8s_openapi::api::core::v1 as core;
    use k8s_openapi::api::discovery::v1 as discovery;
    use k8s_openapi::api::networking::v1 as networking;

    let runtime = tokio::runtime::Runtime::new()
        .map_err(|e| untraceable(format!("starting the async runtime: {e}")))?;
    runtime.block_on(async move {
        let client = super::proxy::client(kubeconfig, master)
            .await
            .map_err(|e| {
                if e.is::<UsageError>() {
                    e
                } else {
                    untraceable(format!("{e:#}"))
                }
            })?;
        let lp = kube::api::ListParams::default();
        let failed = |what: &str, e: kube::Error| untraceable(format!("listing {what}: {e}"));
        let mut items: Vec<serde_json::Value> = Vec::new();
        let services = kube::Api::<core::Service>::all(client.clone())
            .list(&lp)
            .await
            .map_err(|e| failed("Services", e))?;
        let slices = kube::Api::<discovery::EndpointSlice>::all(client.clone())
            .list(&lp)
            .await
            .map_err(|e| failed("EndpointSlices", e))?;
        let nodes = kube::Api::<core::Node>::all(client.clone())
            .list(&lp)
            .await
            .map_err(|e| failed("Nodes", e))?;
        for s in services.items {
            items.push(serde_json::to_value(s)?);
        }
        for s in slices.items {
            items.push(serde_json::to_value(s)?);
        }
        for n in nodes.items {
            items.push(serde_json::to_value(n)?);
        }
        // ServiceCIDRs are optional, as for the proxy: a server without them (404) leaves
        // the unallocated-ClusterIP rule out, as kube-proxy does.
        match kube::Api::<networking::ServiceCIDR>::all(client)
            .list(&lp)
            .await
        {
            Ok(cidrs) => {
                for c in cidrs.items {
                    items.push(serde_json::to_value(c)?);
                }
            }
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(e) => return Err(failed("ServiceCIDRs", e)),
        }
        let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items});
        Ok(serde_json::to_string(&list)?)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn other_tables_drop_chains_are_found_through_their_jumps_and_the_proxys_are_left_out() {
        let listing = r#"{"nftables": [
          {"metainfo": {"json_schema_version": 1}},
          {"chain": {"family": "inet", "table": "site", "name": "forward", "hook": "forward", "prio": 0, "policy": "accept"}},
          {"chain": {"family": "inet", "table": "site", "name": "more"}},
          {"chain": {"family": "inet", "table": "site", "name": "input", "hook": "input", "prio": 0, "policy": "drop"}},
          {"chain": {"family": "inet", "table": "site", "name": "output", "hook": "output", "prio": 0, "policy": "accept"}},
          {"chain": {"family": "ip", "table": "filter", "name": "INPUT", "hook": "input", "prio": 0, "policy": "accept"}},
          {"chain": {"family": "ip", "table": "filter", "name": "FORWARD", "hook": "forward", "prio": 0, "policy": "accept"}},
          {"chain": {"family": "ip", "table": "kube-proxy", "name": "filter-input", "hook": "input", "prio": -110, "policy": "accept"}},
          {"chain": {"family": "ip", "table": "nodeport-trace-7", "name": "prerouting", "hook": "prerouting", "prio": -150, "policy": "drop"}},
          {"rule": {"family": "inet", "table": "site", "chain": "forward", "expr": [{"match": {}}, {"drop": null}]}},
          {"rule": {"family": "inet", "table": "site", "chain": "forward", "expr": [{"jump": {"target": "more"}}]}},
          {"rule": {"family": "inet", "table": "site", "chain": "more", "expr": [{"reject": {"type": "tcp reset"}}]}},
          {"rule": {"family": "inet", "table": "site", "chain": "output", "expr": [{"counter": {}}]}},
          {"rule": {"family": "ip", "table": "filter", "chain": "INPUT", "expr": [{"xt": {"type": "target", "name": "REJECT"}}]}},
          {"rule": {"family": "ip", "table": "filter", "chain": "FORWARD", "expr": [{"jump": {"target": "KUBE-FORWARD"}}]}},
          {"rule": {"family": "ip", "table": "filter", "chain": "KUBE-FORWARD", "expr": [{"drop": null}]}},
          {"rule": {"family": "ip", "table": "kube-proxy", "chain": "filter-input", "expr": [{"drop": null}]}}
        ]}"#;
        let found: Vec<(String, usize, bool)> = foreign_chains(listing)
            .into_iter()
            .map(|c| {
                (
                    format!("{} {} {}", c.family, c.table, c.chain),
                    c.drops,
                    c.policy_drop,
                )
            })
            .collect();
        assert_eq!(
            found,
            [
                ("inet site forward".to_string(), 2, false),
                ("inet site input".to_string(), 0, true),
                ("ip filter INPUT".to_string(), 1, false),
            ]
        );
    }
}
