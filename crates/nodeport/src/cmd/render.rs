//! `nodeport render`: prints the ruleset the proxy would program for a file of objects,
//! touching neither the kernel nor any server.

use std::io::Read;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::PathBuf;

use anyhow::Context;
use nodeport_proxy::config::{NftablesLayout, NodeConfig, ProxyMode};
use nodeport_proxy::desired::{self, NodeView, StateConfig};
use nodeport_proxy::ipnet::IpNet;
use nodeport_proxy::model::IpFamily;
use nodeport_proxy::nodeaddr::{NodeFacts, NodePortAddresses};
use nodeport_proxy::objects;
use nodeport_proxy::{ebpf, iptables, ipvs, nftables};

use super::UsageError;

/// Flags of `nodeport render`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Multi-document YAML of Services, EndpointSlices, ServiceCIDRs and optionally a Node
    /// ("-" reads standard input).
    #[arg(short = 'f', long = "filename")]
    file: PathBuf,
    #[command(flatten)]
    flags: Flags,
}

/// The flags that say what node to render for: shared by `nodeport render` and
/// `nodeport trace`, which traces what `render` would program.
#[derive(Debug, clap::Args)]
pub struct Flags {
    /// Dataplane to render for: nftables (`nft -f` input), iptables (`iptables-restore`
    /// input), ipvs (`ipvsadm -S` lines, ipsets and the companion iptables rules) or ebpf
    /// (the BPF maps' frontends and backends, one line each) [default: nftables; `trace
    /// --rules kernel`: the mode whose rules the node holds].
    #[arg(long, value_name = "MODE")]
    pub proxy_mode: Option<String>,
    /// nftables mode: "flat" (default, what `nodeport proxy` programs by default) or
    /// "kube-proxy" (kube-proxy 1.33's chains and names, to compare with a kube-proxy node).
    #[arg(long, default_value = "flat", value_name = "flat|kube-proxy")]
    nftables_layout: String,
    /// This node's name: endpoints with this nodeName are local; the file's Node of this
    /// name gives the node's addresses (default: the file's only Node; of several, the one
    /// named as this host, else it must be given).
    #[arg(long)]
    node_name: Option<String>,
    /// This node's IPs (repeatable); the first of each family is that family's node IP
    /// (default: the Node's addresses in the file).
    #[arg(long = "node-ip")]
    node_ips: Vec<String>,
    /// Pod CIDRs (comma-separated), for masquerading off-cluster ClusterIP traffic.
    #[arg(long)]
    cluster_cidr: Option<String>,
    /// Which node IPs accept NodePorts: a comma-separated list of CIDRs (127.0.0.0/8 for
    /// localhost NodePorts), "default-route" and "primary", as `nodeport proxy` takes it
    /// [default: primary for nftables, every address (0.0.0.0/0,::/0) for iptables and ipvs].
    #[arg(long)]
    nodeport_addresses: Option<String>,
    /// One of the node's interfaces and its addresses, NAME=IP[,IP...] (repeatable), to
    /// preview which addresses --nodeport-addresses selects (default: the file's Node
    /// annotation nodeport.render/interfaces, else the node IPs as if on one interface).
    /// The loopback interface (127.0.0.1, ::1) is always there.
    #[arg(long = "interface", value_name = "NAME=IP[,IP...]")]
    interfaces: Vec<String>,
    /// An interface (named by --interface) that holds the default route, for
    /// --nodeport-addresses default-route (repeatable; both families) (default: the file's
    /// Node annotation nodeport.render/default-route-interfaces).
    #[arg(long = "default-route-interface", value_name = "NAME")]
    default_route_interfaces: Vec<String>,
    /// iptables mode: NodePorts also answer on 127.0.0.1 when every IPv4 address accepts
    /// them (default true).
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    iptables_localhost_nodeports: Option<bool>,
    /// Masquerade all traffic sent to ClusterIPs.
    #[arg(long)]
    masquerade_all: bool,
    /// Mark bit used to tag packets to masquerade.
    #[arg(long, default_value_t = 14)]
    masquerade_bit: u8,
    /// ebpf mode: how a new connection picks its backend, "random" or "maglev".
    #[arg(long, default_value = "random", value_name = "random|maglev")]
    ebpf_lb_algorithm: String,
}

impl Flags {
    /// Whether `--cluster-cidr` was given (`trace` otherwise reads it from the kernel's
    /// rules when it names from the kernel).
    pub fn cluster_cidr_given(&self) -> bool {
        self.cluster_cidr.is_some()
    }

    /// Whether `--nodeport-addresses` was given (`trace` otherwise says which addresses the
    /// kernel serves NodePorts on when it names from the kernel).
    pub fn nodeport_addresses_given(&self) -> bool {
        self.nodeport_addresses.is_some()
    }
}

fn usage(message: impl Into<String>) -> anyhow::Error {
    UsageError(message.into()).into()
}

/// Annotation of the file's Node standing in for `--interface`: `NAME=IP[,IP...]` entries
/// separated by spaces (`eth0=192.0.2.4 eth1=198.51.100.4,2001:db8::4`). Read by
/// `nodeport render` only; flags win.
pub const INTERFACES_ANNOTATION: &str = "nodeport.render/interfaces";
/// Annotation of the file's Node standing in for `--default-route-interface`: interface
/// names separated by spaces.
pub const DEFAULT_ROUTE_ANNOTATION: &str = "nodeport.render/default-route-interfaces";

/// The render annotations of the Node named `node` in the objects file, split into entries:
/// (interfaces, default-route interfaces). Documents that do not parse were reported by
/// `objects::load` already.
fn node_annotations(text: &str, node: &str) -> (Vec<String>, Vec<String>) {
    use serde::Deserialize;
    let words = |v: &serde_json::Value, key: &str| -> Vec<String> {
        v.get(key)
            .and_then(|a| a.as_str())
            .map(|a| a.split_whitespace().map(str::to_string).collect())
            .unwrap_or_default()
    };
    for doc in yaml_serde::Deserializer::from_str(text) {
        let Ok(value) = serde_json::Value::deserialize(doc) else {
            continue;
        };
        let is_node = value.get("kind").and_then(|k| k.as_str()) == Some("Node");
        let name = value.pointer("/metadata/name").and_then(|n| n.as_str());
        if is_node && name == Some(node) {
            let Some(annotations) = value.pointer("/metadata/annotations") else {
                break;
            };
            return (
                words(annotations, INTERFACES_ANNOTATION),
                words(annotations, DEFAULT_ROUTE_ANNOTATION),
            );
        }
    }
    (Vec::new(), Vec::new())
}

/// Parses `--interface NAME=IP[,IP...]` values (`what` names their source in errors).
fn parse_interfaces(values: &[String], what: &str) -> anyhow::Result<Vec<(String, Vec<IpAddr>)>> {
    values
        .iter()
        .map(|v| {
            let bad = |why: &str| usage(format!("invalid value {v:?} for {what}: {why}"));
            let (name, ips) = v
                .split_once('=')
                .ok_or_else(|| bad("must be NAME=IP[,IP...]"))?;
            if name.is_empty() {
                return Err(bad("empty interface name"));
            }
            let ips = ips
                .split(',')
                .map(|ip| ip.trim().parse::<IpAddr>())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|_| bad("not an IP address"))?;
            Ok((name.to_string(), ips))
        })
        .collect()
}

/// Parses `--cluster-cidr` (shared with `nodeport proxy`).
pub fn parse_cluster_cidrs(value: &str) -> anyhow::Result<Vec<IpNet>> {
    value
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| {
            s.trim().parse::<IpNet>().map(|n| n.trunc()).map_err(|_| {
                usage(format!(
                    "invalid value {s:?} for --cluster-cidr: not a CIDR"
                ))
            })
        })
        .collect()
}

/// What `render` (and `trace`) work on: the desired state of the node the flags describe,
/// with the configuration each backend renders with.
pub struct Prepared {
    /// `--proxy-mode`.
    pub mode: ProxyMode,
    /// `--ebpf-lb-algorithm`.
    pub algorithm: ebpf::render::Algorithm,
    /// The desired state of the file's objects on this node.
    pub desired: desired::DesiredState,
    /// The node's addresses.
    pub facts: NodeFacts,
    /// What the nftables, iptables and IPVS renders take.
    pub config: NodeConfig,
    /// `--nodeport-addresses` as it applies (given or the mode's default).
    pub nodeport_addresses: String,
}

/// Reads the objects file (`-` for standard input).
pub fn read_file(file: &std::path::Path) -> anyhow::Result<String> {
    if file.as_os_str() == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .context("reading standard input")?;
        Ok(s)
    } else {
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))
    }
}

/// Runs `nodeport render`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let text = read_file(&args.file)?;
    let prepared = prepare(&args.flags, &text, &args.file.display().to_string())?;
    let Prepared {
        mode,
        algorithm,
        desired,
        facts,
        config,
        ..
    } = prepared;
    let local_ips = facts.local_ips;
    match mode {
        ProxyMode::Nftables => {
            let ruleset = nftables::render(&desired, &config);
            super::out!("{}", nftables::ruleset::create_all(&ruleset).to_nft());
        }
        ProxyMode::Iptables => {
            // One `iptables-restore --noflush` input per family, as a first sync sends it.
            let ruleset = iptables::render(&desired, &config);
            for family in &ruleset.families {
                super::outln!(
                    "# {} --noflush ({})",
                    iptables::ruleset::restore_program(family.family),
                    family.family.as_str()
                );
                super::out!("{}", iptables::ruleset::create_all(family, true).text());
            }
        }
        ProxyMode::Ipvs => super::out!("{}", ipvs::render(&desired, &config).text()),
        ProxyMode::Ebpf => {
            // What the maps would hold: one line per frontend.
            let render_config = ebpf::render::RenderConfig {
                algorithm,
                local_ips,
                fib_forward: true,
                masquerade_all: config.masquerade_all,
                cluster_cidrs: config.cluster_cidrs.clone(),
            };
            for line in ebpf::render::render(&desired, &render_config).lines(algorithm) {
                super::outln!("{line}");
            }
        }
    }
    Ok(())
}

/// Everything but the rendering itself: the flags checked, the objects (`text`, read from
/// `source`) turned into this node's desired state.
pub fn prepare(args: &Flags, text: &str, source: &str) -> anyhow::Result<Prepared> {
    let given = args.proxy_mode.as_deref().unwrap_or("nftables");
    let mode = ProxyMode::parse(given).ok_or_else(|| {
        usage(format!(
            "invalid value {given:?} for --proxy-mode: must be nftables, iptables, ipvs or ebpf"
        ))
    })?;
    let algorithm = ebpf::render::Algorithm::parse(&args.ebpf_lb_algorithm).ok_or_else(|| {
        usage(format!(
            "invalid value {:?} for --ebpf-lb-algorithm: must be random or maglev",
            args.ebpf_lb_algorithm
        ))
    })?;
    if args.masquerade_bit > 31 {
        return Err(usage(
            "invalid value for --masquerade-bit: must be within 0-31",
        ));
    }
    let nodeport_addresses: NodePortAddresses = args
        .nodeport_addresses
        .as_deref()
        .unwrap_or(match mode {
            // kube-proxy's defaults: `primary` in nftables mode, every address otherwise.
            ProxyMode::Nftables => "primary",
            ProxyMode::Iptables | ProxyMode::Ipvs => "0.0.0.0/0,::/0",
            // The eBPF mode takes the nftables mode's default.
            ProxyMode::Ebpf => "primary",
        })
        .parse()
        .map_err(|e| usage(format!("{e}")))?;
    let cluster_cidrs = match &args.cluster_cidr {
        Some(v) => parse_cluster_cidrs(v)?,
        None => Vec::new(),
    };
    let mut node_ips = Vec::new();
    for ip in &args.node_ips {
        let ip: IpAddr = ip.parse().map_err(|_| {
            usage(format!(
                "invalid value {ip:?} for --node-ip: not an IP address"
            ))
        })?;
        node_ips.push(ip);
    }

    let loaded = objects::load(text).with_context(|| format!("parsing {source}"))?;
    for w in &loaded.warnings {
        eprintln!("warning: {w}");
    }
    // The Node named --node-name when the file has it (a `kubectl get nodes -o yaml` of a
    // whole cluster), else the file's only Node. With several, this host's name picks one
    // (the proxy's own default, as kube-proxy's --hostname-override); failing that, which
    // node is meant must be said, not guessed (each node's rules differ: its addresses, its
    // local endpoints).
    let mut node_name_flag = args.node_name.clone();
    if node_name_flag.is_none() && loaded.nodes.len() > 1 {
        let host = nodeport_proxy::nix_hostname().unwrap_or_default();
        if loaded.nodes.iter().any(|n| n.name == host) {
            node_name_flag = Some(host);
        } else {
            let names: Vec<&str> = loaded.nodes.iter().map(|n| n.name.as_str()).collect();
            return Err(usage(format!(
                "{source} holds {} Nodes ({}), none named as this host ({host}): give \
                 --node-name to say which node's rules to show",
                names.len(),
                names.join(", ")
            )));
        }
    }
    let named = node_name_flag
        .as_ref()
        .and_then(|n| loaded.nodes.iter().find(|node| node.name == *n));
    let node = named.or(loaded.node.as_ref()).cloned().unwrap_or_default();
    let node_name = node_name_flag.unwrap_or_else(|| node.name.clone());
    if node_ips.is_empty() {
        node_ips = node.addresses.clone();
    }
    // Interfaces from the flags, else from the file's Node annotations, else the node's IPs
    // on one interface. Every node has loopback.
    let (annotated, annotated_default) = node_annotations(text, &node.name);
    let mut interfaces = if args.interfaces.is_empty() {
        parse_interfaces(&annotated, &format!("annotation {INTERFACES_ANNOTATION}"))?
    } else {
        parse_interfaces(&args.interfaces, "--interface")?
    };
    let (default_route_interfaces, default_route_source) =
        if args.default_route_interfaces.is_empty() {
            (
                annotated_default,
                format!("annotation {DEFAULT_ROUTE_ANNOTATION}"),
            )
        } else {
            (
                args.default_route_interfaces.clone(),
                "--default-route-interface".to_string(),
            )
        };
    if interfaces.is_empty() {
        interfaces.push(("eth0".into(), node_ips.clone()));
    }
    if !interfaces.iter().any(|(name, _)| name == "lo") {
        interfaces.push((
            "lo".into(),
            vec![Ipv4Addr::LOCALHOST.into(), Ipv6Addr::LOCALHOST.into()],
        ));
    }
    let mut default_route_ips = Vec::new();
    for name in &default_route_interfaces {
        let (_, ips) = interfaces.iter().find(|(n, _)| n == name).ok_or_else(|| {
            usage(format!(
                "invalid value {name:?} for {default_route_source}: no such interface"
            ))
        })?;
        default_route_ips.extend(ips.iter().copied());
    }
    if nodeport_addresses.uses_default_route() && default_route_ips.is_empty() {
        eprintln!(
            "warning: --nodeport-addresses default-route selects nothing without \
             --default-route-interface (or the Node annotation {DEFAULT_ROUTE_ANNOTATION})"
        );
    }
    let mut local_ips: Vec<IpAddr> = interfaces.into_iter().flat_map(|(_, ips)| ips).collect();
    local_ips.sort();
    local_ips.dedup();
    let facts = NodeFacts {
        node_ips,
        local_ips,
        default_route_ips,
    };
    for cidr in nodeport_addresses.unmatched_cidrs(&facts) {
        eprintln!("warning: --nodeport-addresses {cidr} matches none of the node's addresses");
    }
    let nodeport_addresses_text = nodeport_addresses.to_string();
    let state_config = StateConfig {
        families: IpFamily::ALL.to_vec(),
        nodeport_addresses,
    };
    let view = NodeView {
        name: &node_name,
        zone: node.zone.as_deref(),
    };
    let desired = desired::build(&loaded.cluster, view, &facts, &state_config);
    let nftables_layout = NftablesLayout::parse(&args.nftables_layout).ok_or_else(|| {
        usage(format!(
            "invalid value {:?} for --nftables-layout: must be flat or kube-proxy",
            args.nftables_layout
        ))
    })?;
    let config = NodeConfig {
        nftables_layout,
        masquerade_bit: args.masquerade_bit,
        masquerade_all: args.masquerade_all,
        cluster_cidrs,
        localhost_nodeports: args.iptables_localhost_nodeports.unwrap_or(true),
        ..NodeConfig::default()
    };
    Ok(Prepared {
        mode,
        algorithm,
        desired,
        facts,
        config,
        nodeport_addresses: nodeport_addresses_text,
    })
}
