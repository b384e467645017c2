//! `nodeport trace`: follows one packet through what the proxy programs and says, in the
//! Service's words, where it goes: the Service port, the candidate endpoints with their
//! probability, masquerade and why, and the fate (DNAT, reject, drop, or not a Service).
//!
//! Offline (`-f objects.yaml` with `render`'s flags) it traces what `render` would
//! program, with no kernel and no server. Exit codes: 0 the packet reaches an endpoint, 1
//! it is dropped, rejected or not for a Service, 3 it could not be traced, 64 bad usage.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use nodeport_proxy::config::ProxyMode;
use nodeport_proxy::model::{IpFamily, Protocol};
use nodeport_proxy::trace::explain::{self, Dataplane, Explanation};
use nodeport_proxy::trace::{Env, Origin, Packet, Trace};
use nodeport_proxy::{ebpf, iptables, nftables};
use serde::Serialize;

use super::render::{self, Prepared};
use super::{Exit, UsageError};

/// Exit code: the packet is dropped or rejected, or is not for a Service.
const EXIT_NOT_DELIVERED: u8 = 1;
/// Exit code: the packet could not be traced (unreadable input, a mode without tracer).
const EXIT_UNTRACEABLE: u8 = 3;

/// Flags of `nodeport trace`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Multi-document YAML of Services, EndpointSlices, ServiceCIDRs and optionally a Node
    /// ("-" reads standard input): trace what `nodeport render` would program for them.
    #[arg(short = 'f', long = "filename")]
    file: PathBuf,
    /// Source address of the packet. One of the node's own addresses (--node-ip,
    /// --interface) takes the output path, as a process on the node; any other arrives
    /// from the network (input path).
    #[arg(long, value_name = "ADDR")]
    from: String,
    /// Destination: ADDR:PORT/PROTO, e.g. 192.0.2.11:30569/tcp or [2001:db8::1]:80/tcp
    /// (the protocol defaults to tcp).
    #[arg(long, value_name = "ADDR:PORT/PROTO")]
    to: String,
    /// Output format: "human" (one line per step) or "json" (the schema is in
    /// docs/TRACE.md).
    #[arg(
        short = 'o',
        long = "output",
        default_value = "human",
        value_name = "human|json"
    )]
    output: String,
    #[command(flatten)]
    render: render::Flags,
}

fn usage(message: impl Into<String>) -> anyhow::Error {
    UsageError(message.into()).into()
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
    /// `offline`: traced on what `render` would program.
    source: &'static str,
    /// `--proxy-mode`.
    mode: &'static str,
    /// nftables mode: the layout traced.
    #[serde(skip_serializing_if = "Option::is_none")]
    nftables_layout: Option<&'static str>,
    #[serde(flatten)]
    explanation: &'a Explanation,
}

/// Runs `nodeport trace`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let (to, proto) = parse_to(&args.to)?;
    let from: IpAddr = args.from.parse().map_err(|_| {
        usage(format!(
            "invalid value {:?} for --from: not an IP address",
            args.from
        ))
    })?;
    if IpFamily::of(from) != IpFamily::of(to.ip()) {
        return Err(usage(format!(
            "--from {from} and --to {} are not of the same IP family",
            to.ip()
        )));
    }
    let json = match args.output.as_str() {
        "human" => false,
        "json" => true,
        other => {
            return Err(usage(format!(
                "invalid value {other:?} for --output: must be human or json"
            )));
        }
    };
    let text = render::read_file(&args.file).map_err(|e| untraceable(format!("{e:#}")))?;
    let source = args.file.display().to_string();
    let prepared = render::prepare(&args.render, &text, &source).map_err(|e| {
        if e.is::<UsageError>() {
            e
        } else {
            untraceable(format!("{e:#}"))
        }
    })?;
    let origin = if prepared.facts.local_ips.contains(&from) {
        Origin::Local
    } else {
        Origin::Remote
    };
    let packet = Packet {
        src: from,
        dst: to.ip(),
        proto,
        dport: to.port(),
        origin,
    };
    let env = Env {
        local_addrs: prepared.facts.local_ips.clone(),
        affinity: Vec::new(),
    };
    let (dataplane, trace) = trace_offline(&prepared, &packet, &env)?;
    let ctx = explain::Context {
        dataplane,
        masquerade_all: prepared.config.masquerade_all,
        cluster_cidrs: &prepared.config.cluster_cidrs,
        nodeport_addresses: prepared.nodeport_addresses.clone(),
        local_addrs: &prepared.facts.local_ips,
        maglev: prepared.mode == ProxyMode::Ebpf
            && prepared.algorithm == ebpf::render::Algorithm::Maglev,
    };
    let explanation = explain::explain(&prepared.desired, &ctx, &trace);
    let layout =
        (prepared.mode == ProxyMode::Nftables).then_some(prepared.config.nftables_layout.as_str());
    if json {
        let report = Report {
            source: "offline",
            mode: prepared.mode.as_str(),
            nftables_layout: layout,
            explanation: &explanation,
        };
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        let mode = match layout {
            Some(l) => format!("{} ({l} layout)", prepared.mode.as_str()),
            None => prepared.mode.as_str().to_string(),
        };
        println!("rules       {mode}, as `nodeport render` programs them for {source}");
        print!("{explanation}");
    }
    if explanation.reaches_endpoint() {
        Ok(())
    } else {
        Err(Exit {
            code: EXIT_NOT_DELIVERED,
            message: None,
        }
        .into())
    }
}

/// Renders the objects as `render` does and traces the packet through the result.
fn trace_offline(
    prepared: &Prepared,
    packet: &Packet,
    env: &Env,
) -> anyhow::Result<(Dataplane, Trace)> {
    let Prepared {
        mode,
        algorithm,
        desired,
        facts,
        config,
        ..
    } = prepared;
    Ok(match mode {
        ProxyMode::Nftables => {
            let ruleset = nftables::render(desired, config);
            (
                Dataplane::Nftables,
                nftables::tracer::trace(&ruleset, packet, env),
            )
        }
        ProxyMode::Iptables => {
            let ruleset = iptables::render(desired, config);
            let Some(family) = ruleset.family(IpFamily::of(packet.dst)) else {
                return Err(untraceable("no iptables rules for this IP family"));
            };
            (
                Dataplane::Iptables,
                iptables::tracer::trace(&family.view(), packet, env),
            )
        }
        ProxyMode::Ebpf => {
            let render_config = ebpf::render::RenderConfig {
                algorithm: *algorithm,
                local_ips: facts.local_ips.clone(),
                fib_forward: true,
            };
            let rendered = ebpf::render::render(desired, &render_config);
            (Dataplane::Ebpf, ebpf::tracer::trace(&rendered, packet, env))
        }
        ProxyMode::Ipvs => {
            return Err(untraceable(
                "the ipvs mode cannot be traced: nodeport does not evaluate IPVS (its \
                 companion iptables rules only mark and masquerade)",
            ));
        }
    })
}
