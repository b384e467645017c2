//! `nodeport lab`, and the hidden `nodeport pod-server` the lab starts inside each pod's
//! namespace: pods are processes of their own so that `nodeport lab --keep` can leave them
//! running.

use std::net::IpAddr;

use nodeport_proxy::config::NftablesLayout;

use crate::lab::{self, Config, ProxyMode, interrupt::Interrupt};

/// `--nftables-layout`'s value, with the proxy's own message for a wrong one.
fn parse_layout(s: &str) -> Result<NftablesLayout, String> {
    NftablesLayout::parse(s).ok_or_else(|| "must be flat or kube-proxy".to_owned())
}

/// Flags of `nodeport lab`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Needs root, `ip` (iproute2), `kubectl`, and `nft` (nftables) or \
                        `iptables`/`iptables-restore` for the iptables mode. Everything is created \
                        in network namespaces named nplab-<id>-*, with files in \
                        /run/nodeport/lab/<id>."
)]
pub struct Args {
    /// Dataplane of every node's proxy, passed to `nodeport proxy --proxy-mode`.
    #[arg(long, value_enum, default_value_t = ProxyMode::Nftables)]
    proxy_mode: ProxyMode,
    /// nftables mode: the table layout of every node's proxy, "flat" (default) or
    /// "kube-proxy", passed to `nodeport proxy --nftables-layout`.
    #[arg(long, default_value = "flat", value_name = "flat|kube-proxy", value_parser = parse_layout)]
    nftables_layout: NftablesLayout,
    /// Leave the lab running at the end and print how to enter it, point kubectl at it and
    /// remove it. Kept also when the verdict fails; never after a setup error or a signal.
    #[arg(long)]
    keep: bool,
    /// The cluster's IP families: `ipv4`, or `dual` for an IPv6 address beside every IPv4 one,
    /// a dual-stack API server and a `RequireDualStack` Service; the verdict then needs every
    /// node to answer on the NodePort over both families.
    #[arg(long, value_enum, default_value_t = lab::dual_stack::IpFamily::Ipv4)]
    ip_family: lab::dual_stack::IpFamily,
    /// Remove the lab with this id (one left running by --keep, or by a killed run) and exit.
    #[arg(long, value_name = "ID", conflicts_with_all = ["keep", "proxy_mode"])]
    down: Option<String>,
}

/// Runs `nodeport lab`: exit status 0 when every node IP answered, 1 when not or when the lab
/// could not be built, 128+N after signal N.
pub fn run(args: Args) -> anyhow::Result<()> {
    if let Some(id) = args.down {
        return lab::down(&id);
    }
    let interrupt = Interrupt::install(|signal| {
        eprintln!(
            "nodeport lab: {signal} again, exiting without finishing the teardown; remove what \
             is left with `nodeport lab --down <id>` (the id is on the first line)"
        );
        std::process::exit(130);
    })?;
    let config = Config {
        proxy_mode: args.proxy_mode,
        nftables_layout: args.nftables_layout,
        keep: args.keep,
        ip_family: args.ip_family,
        ..Config::default()
    };
    match lab::run(&config, &interrupt) {
        Ok(verdict) if verdict.passed() => Ok(()),
        Ok(_) => anyhow::bail!("not every node IP answered on the NodePort (see the verdict)"),
        Err(err) => {
            // A Ctrl-C at a terminal also reaches a command the lab was running (kubectl, ip),
            // which then fails: the signal, not that failure, is what happened.
            let signal = match err.downcast::<lab::interrupt::Interrupted>() {
                Ok(signal) => Err(signal),
                Err(err) => interrupt.check().map(|()| err),
            };
            let err = match signal {
                Ok(err) => err,
                Err(signal) => {
                    // The lab has been torn down by now (its guards ran when `run` returned).
                    eprintln!("nodeport lab: {signal}; everything the lab created is removed");
                    std::process::exit(128 + signal.number);
                }
            };
            if let Some(missing) = err.downcast_ref::<lab::preflight::Missing>() {
                eprintln!("nodeport lab: {missing}");
                std::process::exit(1);
            }
            Err(err.context("the lab failed; everything it created is removed"))
        }
    }
}

/// Flags of the hidden `nodeport pod-server`: one "pod" of the lab's deployment.
#[derive(Debug, clap::Args)]
pub struct PodServerArgs {
    /// The pod's name, reported in every answer (`X-Pod-Name`).
    #[arg(long)]
    name: String,
    /// The HTTP port.
    #[arg(long, default_value_t = 80)]
    http: u16,
    /// A UDP echo port, if any.
    #[arg(long)]
    udp: Option<u16>,
    /// The address to listen on: `::` serves both families (the dual-stack lab).
    #[arg(long, default_value = "0.0.0.0")]
    bind: IpAddr,
}

/// Serves like nginx's welcome page until killed (see `nodeport_testbed::server`).
pub fn run_pod_server(args: PodServerArgs) -> anyhow::Result<()> {
    let mut config = nodeport_testbed::server::ServerConfig::http(&args.name, args.http);
    config.bind = args.bind;
    config.udp_port = args.udp;
    let server = nodeport_testbed::server::Server::start(config)?;
    tracing::info!(pod = %args.name, http = args.http, "pod server listening");
    server.wait()
}
