//! `nodeport proxy`: the node agent (kube-proxy's flags and `--config` file).

use crate::cmd::outln;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use nodeport_proxy::agent::{self, ProxyConfig};
use nodeport_proxy::config::{
    KubeProxyConfiguration, NftablesLayout, NodeConfig, ProxyMode, parse_go_duration,
};
use nodeport_proxy::iptables::apply::{VariantChoice, resolve_variant};
use nodeport_proxy::kube;
use nodeport_proxy::model::IpFamily;
use nodeport_proxy::nodeaddr::{NodePortAddresses, Selector};

use super::UsageError;

/// Flags of `nodeport proxy`, named as kube-proxy names them. A flag given on the command
/// line wins over the same field of the `--config` file.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Path to a kubeconfig file with the API server's address and credentials.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// Address of the API server (overrides the kubeconfig's).
    #[arg(long)]
    master: Option<String>,
    /// Name of this node (default: the hostname).
    #[arg(long)]
    hostname_override: Option<String>,
    /// Dataplane: nftables (default), iptables, ipvs or ebpf (tc and cgroup socket programs
    /// with BPF maps; see the --ebpf-* flags).
    #[arg(long)]
    proxy_mode: Option<String>,
    /// nftables mode: the table layout. "flat" (default): a fixed set of chains, every
    /// Service and endpoint an element of named sets and maps, so that a change costs
    /// microseconds in the kernel whatever the number of Services. "kube-proxy": kube-proxy
    /// 1.33's per-Service and per-endpoint chains, name for name, to compare a node's rules
    /// with a kube-proxy node's (a change there costs a kernel validation of every chain:
    /// hundreds of milliseconds at 10,000 Services).
    #[arg(long, value_name = "flat|kube-proxy")]
    nftables_layout: Option<String>,
    /// Which node IPs accept NodePorts, a comma-separated list of: CIDRs (the node's
    /// addresses inside them; 0.0.0.0/0 and ::/0 every address, the iptables default;
    /// 127.0.0.0/8 localhost NodePorts), "default-route" (the addresses of the interfaces
    /// holding the default route, followed when it moves) and "primary" (the Node object's
    /// IPs, the nftables default).
    #[arg(long)]
    nodeport_addresses: Option<String>,
    /// iptables mode: NodePorts also answer on 127.0.0.1 when every IPv4 address accepts
    /// them (sets net.ipv4.conf.all.route_localnet=1) (default true).
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    iptables_localhost_nodeports: Option<bool>,
    /// iptables mode: which iptables tools to run: "auto" (default: legacy when only the
    /// legacy tables hold the Kubernetes chains, else nft, as kube-proxy's images decide),
    /// "nft" or "legacy". iptables-nft-restore slows down close to quadratically with
    /// thousands of Services; "legacy" avoids that.
    #[arg(long, value_name = "auto|nft|legacy")]
    iptables_variant: Option<String>,
    /// Pod CIDRs (comma-separated): traffic to ClusterIPs from outside them is masqueraded.
    #[arg(long)]
    cluster_cidr: Option<String>,
    /// Masquerade all traffic sent to ClusterIPs.
    #[arg(long)]
    masquerade_all: bool,
    /// Mark bit used to tag packets to masquerade (default 14).
    #[arg(long)]
    masquerade_bit: Option<u8>,
    /// Address and port of /healthz and /livez (default 0.0.0.0:10256; "" disables).
    #[arg(long)]
    healthz_bind_address: Option<String>,
    /// Address and port of /metrics (default 127.0.0.1:10249; "" disables).
    #[arg(long)]
    metrics_bind_address: Option<String>,
    /// Periodic resync interval, a Go duration (default 30s).
    #[arg(long)]
    sync_period: Option<String>,
    /// Minimum interval between syncs, a Go duration (default 1s).
    #[arg(long)]
    min_sync_period: Option<String>,
    /// A KubeProxyConfiguration file.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Check the flags, the --config file and the kubeconfig (parsed, not contacted; the
    /// token and CA files it names are not read), print the resulting configuration and exit:
    /// 0 when valid, 64 naming the mistake when not.
    #[arg(long)]
    validate: bool,
    #[command(flatten)]
    ebpf: super::ebpf::EbpfArgs,
}

fn usage(message: impl Into<String>) -> anyhow::Error {
    UsageError(message.into()).into()
}

fn bind_address(flag: &str, value: &str, default_port: u16) -> anyhow::Result<Option<SocketAddr>> {
    if value.is_empty() {
        return Ok(None);
    }
    if let Ok(addr) = value.parse::<SocketAddr>() {
        return Ok(Some(addr));
    }
    if let Ok(ip) = value.parse::<IpAddr>() {
        return Ok(Some(SocketAddr::new(ip, default_port)));
    }
    Err(usage(format!(
        "invalid value {value:?} for {flag}: must be IP:port or IP"
    )))
}

fn duration(flag: &str, value: &str) -> anyhow::Result<Duration> {
    parse_go_duration(value).ok_or_else(|| {
        usage(format!(
            "invalid value {value:?} for {flag}: not a duration (e.g. 30s, 1m0s)"
        ))
    })
}

/// Turns flags and file into the proxy's configuration (and the client's source).
fn configure(args: &Args) -> anyhow::Result<(ProxyConfig, Option<PathBuf>, VariantChoice)> {
    let file = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| {
                usage(format!(
                    "invalid value for --config: reading {}: {e}",
                    path.display()
                ))
            })?;
            KubeProxyConfiguration::parse(&text).map_err(|e| {
                usage(format!(
                    "invalid value for --config: {}: {e}: {}",
                    path.display(),
                    source_text(&e)
                ))
            })?
        }
        None => KubeProxyConfiguration::default(),
    };
    let mode = args
        .proxy_mode
        .clone()
        .or(file.mode.clone())
        .filter(|m| !m.is_empty())
        .unwrap_or_else(|| "nftables".into());
    let mode = ProxyMode::parse(&mode).ok_or_else(|| {
        usage(format!(
            "invalid value {mode:?} for --proxy-mode: must be nftables, iptables, ipvs or ebpf"
        ))
    })?;
    let layout = args
        .nftables_layout
        .clone()
        .or(file.nftables_layout().map(str::to_string))
        .filter(|l| !l.is_empty())
        .unwrap_or_else(|| "flat".into());
    let nftables_layout = NftablesLayout::parse(&layout).ok_or_else(|| {
        usage(format!(
            "invalid value {layout:?} for --nftables-layout: must be flat or kube-proxy"
        ))
    })?;
    let variant = match args.iptables_variant.as_deref() {
        Some(v) => VariantChoice::parse(v).ok_or_else(|| {
            usage(format!(
                "invalid value {v:?} for --iptables-variant: must be auto, nft or legacy"
            ))
        })?,
        None => VariantChoice::Auto,
    };
    if mode == ProxyMode::Ipvs {
        // Stop at once: without IPVS in the kernel there is nothing to program, and IPVS
        // mode is deprecated upstream (KEP-5495) and only rendered here.
        nodeport_proxy::ipvs::apply::check_kernel(std::path::Path::new(
            nodeport_proxy::ipvs::apply::PROC_IP_VS,
        ))
        .map_err(|e| anyhow::anyhow!("--proxy-mode ipvs: {e}"))?;
        return Err(nodeport_proxy::agent::Error::IpvsNotProgrammed.into());
    }
    let nodeport_addresses = match (&args.nodeport_addresses, &file.node_port_addresses) {
        (Some(v), _) => v
            .parse::<NodePortAddresses>()
            .map_err(|e| usage(e.to_string()))?,
        (None, Some(list)) if !list.is_empty() => {
            let whole = list.join(",");
            NodePortAddresses::from_entries(list.iter().map(String::as_str), &whole)
                .map_err(|e| usage(e.to_string()))?
        }
        // kube-proxy's iptables mode defaults to every local address (`-m addrtype
        // --dst-type LOCAL`); only the nftables mode defaults to `primary`.
        _ if mode == ProxyMode::Iptables => "0.0.0.0/0,::/0"
            .parse::<NodePortAddresses>()
            .expect("valid CIDRs"),
        _ => NodePortAddresses::default(),
    };
    let cluster_cidrs = match args.cluster_cidr.as_ref().or(file.cluster_cidr.as_ref()) {
        Some(v) => super::render::parse_cluster_cidrs(v)?,
        None => Vec::new(),
    };
    let masquerade_bit = args.masquerade_bit.or(file.masquerade_bit()).unwrap_or(14);
    if masquerade_bit > 31 {
        return Err(usage(format!(
            "invalid value {masquerade_bit} for --masquerade-bit: must be within 0-31"
        )));
    }
    let node_name = match args
        .hostname_override
        .clone()
        .or(file.hostname_override.clone())
    {
        Some(n) if !n.trim().is_empty() => n.trim().to_lowercase(),
        _ => nodeport_proxy::nix_hostname()
            .context("reading the hostname (set --hostname-override)")?,
    };
    let defaults = ProxyConfig::default();
    let healthz = match args
        .healthz_bind_address
        .as_ref()
        .or(file.healthz_bind_address.as_ref())
    {
        Some(v) => bind_address("--healthz-bind-address", v, 10256)?,
        None => defaults.healthz_bind_address,
    };
    let metrics = match args
        .metrics_bind_address
        .as_ref()
        .or(file.metrics_bind_address.as_ref())
    {
        Some(v) => bind_address("--metrics-bind-address", v, 10249)?,
        None => defaults.metrics_bind_address,
    };
    let sync_period = match args.sync_period.as_deref().or(file.sync_period()) {
        Some(v) => duration("--sync-period", v)?,
        None => defaults.sync_period,
    };
    let min_sync_period = match args.min_sync_period.as_deref().or(file.min_sync_period()) {
        Some(v) => duration("--min-sync-period", v)?,
        None => defaults.min_sync_period,
    };
    if sync_period.is_zero() {
        return Err(usage(
            "invalid value for --sync-period: must be greater than 0",
        ));
    }
    let kubeconfig = args.kubeconfig.clone().or_else(|| {
        file.client_connection
            .as_ref()
            .and_then(|c| c.kubeconfig.clone())
            .map(PathBuf::from)
    });
    let ebpf = if mode == ProxyMode::Ebpf {
        args.ebpf.config(file.ebpf.as_ref())?
    } else {
        ProxyConfig::default().ebpf
    };
    let config = ProxyConfig {
        ebpf,
        node_name,
        node: NodeConfig {
            masquerade_bit,
            masquerade_all: args.masquerade_all || file.masquerade_all().unwrap_or(false),
            cluster_cidrs,
            localhost_nodeports: args
                .iptables_localhost_nodeports
                .or(file.localhost_node_ports())
                .unwrap_or(true),
            nftables_layout,
            ..NodeConfig::default()
        },
        mode,
        nodeport_addresses,
        healthz_bind_address: healthz,
        metrics_bind_address: metrics,
        sync_period,
        min_sync_period,
        ..defaults
    };
    Ok((config, kubeconfig, variant))
}

fn source_text(e: &dyn std::error::Error) -> String {
    e.source().map(|s| s.to_string()).unwrap_or_default()
}

/// The API client for `--kubeconfig`/`--master` (else found as kubectl finds it); shared
/// with `nodeport trace`.
pub(crate) async fn client(
    kubeconfig: Option<PathBuf>,
    master: Option<&str>,
) -> anyhow::Result<kube::Client> {
    let mut config = match (&kubeconfig, master) {
        (Some(path), _) => {
            // Opened here first: kube's own error for a missing file repeats its cause and
            // quotes the path twice.
            std::fs::File::open(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            let kc = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .with_context(|| format!("loading kubeconfig {}", path.display()))?
        }
        (None, Some(url)) => kube::Config::new(
            url.parse()
                .map_err(|_| usage(format!("invalid value {url:?} for --master: not a URL")))?,
        ),
        (None, None) => kube::Config::infer()
            .await
            .context("finding the API server (give --kubeconfig or --master)")?,
    };
    if let (Some(_), Some(url)) = (&kubeconfig, master) {
        config.cluster_url = url
            .parse()
            .map_err(|_| usage(format!("invalid value {url:?} for --master: not a URL")))?;
    }
    kube::Client::try_from(config).context("building the API client")
}

/// Runs `nodeport proxy` until SIGTERM or SIGINT.
pub fn run(args: Args) -> anyhow::Result<()> {
    let (mut config, kubeconfig, variant) = configure(&args)?;
    if args.validate {
        return validate(&config, kubeconfig.as_deref(), args.master.as_deref());
    }
    if config.mode == ProxyMode::Iptables {
        // kube-proxy's images decide once, at start (iptables-wrappers); so do we.
        let chosen = resolve_variant(variant, &config.iptables.prefix);
        config.iptables.variant = chosen.variant;
        tracing::info!(
            iptables_variant = variant.as_str(),
            tools = %config.iptables.tool(IpFamily::V4, "restore"),
            reason = chosen.reason,
            "iptables tools chosen"
        );
    }
    // Before the runtime's threads exist (see the function).
    nodeport_proxy::memory::use_one_arena();
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime.block_on(async move {
        let client = client(kubeconfig, args.master.as_deref()).await?;
        tracing::info!(
            node = %config.node_name,
            mode = config.mode.as_str(),
            nodeport_addresses = %config.nodeport_addresses,
            "starting proxy"
        );
        let loopback = config.nodeport_addresses.selectors.iter().any(|s| {
            matches!(s, Selector::Cidr(net) if net.prefix_len() > 0 && net.contains(&IpAddr::from(Ipv4Addr::LOCALHOST)))
        });
        if loopback && config.mode == ProxyMode::Iptables && !config.node.localhost_nodeports {
            // kube-proxy's wording.
            tracing::error!(
                "--nodeport-addresses includes localhost but --iptables-localhost-nodeports=false was passed"
            );
        }
        let shutdown = async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("installing a SIGTERM handler");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        };
        agent::run(client, config, shutdown)
            .await
            .map_err(anyhow::Error::from)
    })
}

/// `--validate`: [`configure`] accepted the flags and the `--config` file; this checks where
/// the API server is, prints the configuration and returns. The kubeconfig is parsed but the
/// files it names (a pod's service-account token and CA) are not read: they may exist only
/// where the proxy will run.
fn validate(
    config: &ProxyConfig,
    kubeconfig: Option<&std::path::Path>,
    master: Option<&str>,
) -> anyhow::Result<()> {
    let server = match (master, kubeconfig) {
        (Some(url), _) => {
            url.parse::<http::Uri>()
                .map_err(|_| usage(format!("invalid value {url:?} for --master: not a URL")))?;
            format!("{url} (--master)")
        }
        (None, Some(path)) => format!(
            "{} (kubeconfig {})",
            kubeconfig_server(path)?,
            path.display()
        ),
        (None, None) => {
            "not checked: neither --kubeconfig nor --master; found at start as kubectl does \
             ($KUBECONFIG, ~/.kube/config, or in-cluster)"
                .to_owned()
        }
    };
    let cidrs: Vec<String> = config
        .node
        .cluster_cidrs
        .iter()
        .map(ToString::to_string)
        .collect();
    let addr = |a: Option<SocketAddr>| a.map_or_else(|| "off".to_owned(), |a| a.to_string());
    outln!("nodeport proxy: the configuration is valid");
    outln!("  node:                {}", config.node_name);
    outln!("  proxy mode:          {}", config.mode.as_str());
    outln!("  API server:          {server}");
    outln!("  nodeport addresses:  {}", config.nodeport_addresses);
    outln!(
        "  cluster CIDRs:       {}",
        if cidrs.is_empty() {
            "none".to_owned()
        } else {
            cidrs.join(",")
        }
    );
    outln!(
        "  healthz:             {}",
        addr(config.healthz_bind_address)
    );
    outln!(
        "  metrics:             {}",
        addr(config.metrics_bind_address)
    );
    outln!(
        "  sync period:         {:?} (minimum interval {:?})",
        config.sync_period,
        config.min_sync_period
    );
    Ok(())
}

/// The server of a kubeconfig's current context, which must exist and be a URL.
fn kubeconfig_server(path: &std::path::Path) -> anyhow::Result<String> {
    let invalid = |what: String| usage(format!("invalid kubeconfig {}: {what}", path.display()));
    let kc = kube::config::Kubeconfig::read_from(path).map_err(|e| invalid(format!("{e:#}")))?;
    let current = kc
        .current_context
        .as_deref()
        .ok_or_else(|| invalid("no current-context".to_owned()))?;
    let context = kc
        .contexts
        .iter()
        .find(|c| c.name == current)
        .and_then(|c| c.context.as_ref())
        .ok_or_else(|| invalid(format!("no context {current:?}")))?;
    let cluster = kc
        .clusters
        .iter()
        .find(|c| c.name == context.cluster)
        .and_then(|c| c.cluster.as_ref())
        .ok_or_else(|| invalid(format!("no cluster {:?}", context.cluster)))?;
    let server = cluster
        .server
        .as_deref()
        .ok_or_else(|| invalid(format!("cluster {:?} has no server", context.cluster)))?;
    server
        .parse::<http::Uri>()
        .ok()
        .filter(|u| u.scheme().is_some() && u.host().is_some())
        .ok_or_else(|| invalid(format!("server {server:?} is not a URL")))?;
    Ok(server.to_owned())
}
