//! `nodeport up`: a single-node cluster's networking in one process. The API server on the
//! embedded store, this host registered as a Node (as its kubelet would), and the proxy for this
//! host, all three as library calls on one tokio runtime, so that
//! `kubectl --server http://127.0.0.1:6443 create -f svc.yaml` is all it takes before traffic to
//! a NodePort flows.
//!
//! Logs go to stderr. SIGTERM or SIGINT stops the proxy, then the API server, and leaves the
//! rules in the kernel, as a kube-proxy restart expects: the next start takes them over.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;

use anyhow::Context;
use k8s_openapi::api::core::v1::{Node, NodeAddress, NodeSpec, NodeStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use nodeport_apiserver::{Config as ApiConfig, PortRange, ipnet::IpNet};
use nodeport_proxy::agent::{self, ProxyConfig};
use nodeport_proxy::config::NodeConfig;
use nodeport_proxy::nodeaddr::NodePortAddresses;

use super::UsageError;
use crate::lab::ProxyMode;

/// Flags of `nodeport up`: the API server's and the proxy's, named as theirs are.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Loopback address the API server serves plain HTTP on.
    #[arg(long, default_value = "127.0.0.1")]
    bind_address: IpAddr,
    /// Port the API server serves on.
    #[arg(long, default_value_t = 6443)]
    port: u16,
    /// Directory of the embedded store.
    #[arg(long, default_value = "./nodeport-data")]
    data_dir: PathBuf,
    /// NodePort range, "N-M" (inclusive), "N+offset" or "N".
    #[arg(long, default_value = "30000-32767")]
    service_node_port_range: String,
    /// CIDR ClusterIPs are allocated from; two CIDRs of different families ("v4,v6" or
    /// "v6,v4", the first the primary family) make the cluster dual-stack.
    #[arg(long, default_value = "10.96.0.0/16")]
    service_cluster_ip_range: String,
    /// The proxy's dataplane.
    #[arg(long, value_enum, default_value_t = ProxyMode::Nftables)]
    proxy_mode: ProxyMode,
    /// nftables mode: the table layout, "flat" (default) or "kube-proxy", as `nodeport
    /// proxy --nftables-layout`.
    #[arg(long, default_value = "flat", value_name = "flat|kube-proxy")]
    nftables_layout: String,
    /// This node's name, for its Node object and its proxy [default: the host name].
    #[arg(long)]
    hostname_override: Option<String>,
    /// This node's IP, registered as its InternalIP (the proxy's `primary` NodePort address);
    /// repeated (or comma-separated) for a dual-stack node, one per family, as kubelet's
    /// `--node-ip` [default: the address of the interface with the default route, else the
    /// first non-loopback IPv4 address].
    #[arg(long, value_delimiter = ',')]
    node_ip: Vec<IpAddr>,
    /// Which node IPs accept NodePorts, as `nodeport proxy` takes it: CIDRs, `default-route`
    /// and `primary` (this node's registered IP), comma-separated [default: primary for
    /// nftables, every address for iptables].
    #[arg(long)]
    nodeport_addresses: Option<String>,
    /// Pod CIDRs (comma-separated): traffic to ClusterIPs from outside them is masqueraded.
    #[arg(long, value_delimiter = ',')]
    cluster_cidr: Vec<IpNet>,
    /// Masquerade all traffic sent to ClusterIPs.
    #[arg(long)]
    masquerade_all: bool,
    /// The proxy's health endpoint (`/healthz`, `/livez`).
    #[arg(long, default_value = "0.0.0.0:10256")]
    healthz_bind_address: SocketAddr,
    /// The proxy's metrics endpoint.
    #[arg(long, default_value = "127.0.0.1:10249")]
    metrics_bind_address: SocketAddr,
    /// Authorizers of the API server, in order, as `nodeport apiserver --authorization-mode`:
    /// AlwaysAllow (the default: `up` serves loopback only) or RBAC, comma-separated.
    #[arg(long)]
    authorization_mode: Option<String>,
    /// Bearer tokens of the API server (kube-apiserver's CSV format). Plain HTTP without a
    /// token stays the local administrator; a request with one of these tokens is its user.
    #[arg(long)]
    token_auth_file: Option<PathBuf>,
    /// A file holding the bearer token the in-process proxy sends, one of --token-auth-file's
    /// (kube-proxy's is bound to system:node-proxier by the bootstrap policy when its user is
    /// `system:kube-proxy`). Without it the proxy is the local administrator.
    #[arg(long, requires = "token_auth_file")]
    proxy_token_file: Option<PathBuf>,
    #[command(flatten)]
    ebpf: super::ebpf::EbpfArgs,
}

fn usage(message: impl Into<String>) -> anyhow::Error {
    UsageError(message.into()).into()
}

fn api_config(args: &Args) -> anyhow::Result<ApiConfig> {
    if !args.bind_address.is_loopback() {
        return Err(usage(format!(
            "--bind-address {}: `nodeport up` serves plain HTTP on loopback only; use 127.0.0.1 \
             (or run `nodeport apiserver` with TLS flags)",
            args.bind_address
        )));
    }
    let node_port_range = PortRange::parse(&args.service_node_port_range)
        .map_err(|e| usage(format!("--service-node-port-range: {e}")))?;
    let (cluster_ip_range, secondary_cluster_ip_range) =
        super::apiserver::cluster_ip_ranges(&args.service_cluster_ip_range)?;
    let authorization_modes = args
        .authorization_mode
        .as_deref()
        .map(nodeport_apiserver::authz::Mode::parse_list)
        .transpose()
        .map_err(|e| usage(format!("--authorization-mode: {e}")))?;
    let mut config = ApiConfig {
        authorization_modes,
        token_auth_file: args.token_auth_file.clone(),
        bind_address: args.bind_address,
        port: args.port,
        node_port_range,
        cluster_ip_range: cluster_ip_range.trunc(),
        secondary_cluster_ip_range: secondary_cluster_ip_range.map(|net| net.trunc()),
        data_dir: args.data_dir.clone(),
        ..ApiConfig::default()
    };
    config.rest.server_address = format!("{}:{}", args.bind_address, args.port);
    Ok(config)
}

fn proxy_config(args: &Args, node_name: &str) -> anyhow::Result<ProxyConfig> {
    let mode = match args.proxy_mode {
        ProxyMode::Nftables => nodeport_proxy::config::ProxyMode::Nftables,
        ProxyMode::Iptables => nodeport_proxy::config::ProxyMode::Iptables,
        ProxyMode::Ebpf => nodeport_proxy::config::ProxyMode::Ebpf,
        ProxyMode::Ipvs => {
            // IPVS is deprecated upstream (KEP-5495) and only rendered here.
            nodeport_proxy::ipvs::apply::check_kernel(std::path::Path::new(
                nodeport_proxy::ipvs::apply::PROC_IP_VS,
            ))
            .map_err(|e| anyhow::anyhow!("--proxy-mode ipvs: {e}"))?;
            return Err(nodeport_proxy::agent::Error::IpvsNotProgrammed.into());
        }
    };
    let nodeport_addresses: NodePortAddresses = args
        .nodeport_addresses
        .as_deref()
        .unwrap_or(match mode {
            nodeport_proxy::config::ProxyMode::Iptables => "0.0.0.0/0,::/0",
            _ => "primary",
        })
        .parse()
        .map_err(|e| usage(format!("{e}")))?;
    let nftables_layout = nodeport_proxy::config::NftablesLayout::parse(&args.nftables_layout)
        .ok_or_else(|| {
            usage(format!(
                "invalid value {:?} for --nftables-layout: must be flat or kube-proxy",
                args.nftables_layout
            ))
        })?;
    let ebpf = if mode == nodeport_proxy::config::ProxyMode::Ebpf {
        args.ebpf.config(None)?
    } else {
        ProxyConfig::default().ebpf
    };
    Ok(ProxyConfig {
        ebpf,
        node_name: node_name.to_owned(),
        mode,
        node: NodeConfig {
            nftables_layout,
            masquerade_all: args.masquerade_all,
            cluster_cidrs: args.cluster_cidr.iter().map(IpNet::trunc).collect(),
            ..NodeConfig::default()
        },
        nodeport_addresses,
        healthz_bind_address: Some(args.healthz_bind_address),
        metrics_bind_address: Some(args.metrics_bind_address),
        ..ProxyConfig::default()
    })
}

/// Runs `nodeport up` until SIGTERM or SIGINT.
pub fn run(args: Args) -> anyhow::Result<()> {
    let config = api_config(&args)?;
    super::raise_open_files_limit();
    let node_name = match &args.hostname_override {
        Some(name) => name.clone(),
        None => nodeport_proxy::nix_hostname().context("read the host name")?,
    };
    let node_ips = node_ips(&args.node_ip)?;
    let mut proxy_config = proxy_config(&args, &node_name)?;
    if proxy_config.mode == nodeport_proxy::config::ProxyMode::Iptables {
        // The same choice of iptables tools as `nodeport proxy --iptables-variant auto`.
        let chosen = nodeport_proxy::iptables::apply::resolve_variant(
            nodeport_proxy::iptables::apply::VariantChoice::Auto,
            &proxy_config.iptables.prefix,
        );
        proxy_config.iptables.variant = chosen.variant;
        tracing::info!(reason = chosen.reason, "iptables tools chosen");
    }
    // A bad token file is a usage error, found before anything is opened.
    let security = nodeport_apiserver::Security::load(&config)
        .map_err(|e| usage(nodeport_apiserver::report(&e)))?;
    let proxy_token = proxy_token(&args, &security)?;
    let runtime = tokio::runtime::Runtime::new().context("start the async runtime")?;
    runtime.block_on(async move {
        let listener = nodeport_apiserver::bind(&config).await?;
        let state = nodeport_apiserver::open(&config).await?;
        let server_url = format!("http://{}:{}", config.bind_address, config.port);
        tracing::info!(
            address = %listener.local_addr()?,
            data_dir = %config.data_dir.display(),
            "serving the Kubernetes API"
        );
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(nodeport_apiserver::serve_secured(
            state,
            listener,
            security,
            async move {
                let _ = stop_rx.await;
            },
        ));

        // The Node is registered as its kubelet would, by the local administrator; the proxy
        // runs as the user of its token, if it has one.
        register_node(client(&server_url, None)?, &node_name, &node_ips).await?;
        let client = client(&server_url, proxy_token.as_deref())?;
        let (proxy_stop_tx, proxy_stop_rx) = tokio::sync::oneshot::channel::<()>();
        let mut proxy = tokio::spawn(agent::run(client, proxy_config, async move {
            let _ = proxy_stop_rx.await;
        }));
        tracing::info!(node = %node_name, ?node_ips, mode = args.proxy_mode.as_str(), "proxy started");

        let proxy_ended = tokio::select! {
            signal = shutdown_signal() => {
                signal?;
                None
            }
            ended = &mut proxy => Some(ended),
        };
        if let Some(ended) = proxy_ended {
            let _ = stop_tx.send(());
            let _ = server.await;
            return match ended {
                Ok(Ok(())) => Err(anyhow::anyhow!("the proxy stopped by itself")),
                Ok(Err(err)) => Err(anyhow::Error::new(err).context("the proxy failed")),
                Err(join) => Err(anyhow::Error::new(join).context("the proxy task")),
            };
        }
        tracing::info!("stopping the proxy (its rules stay in place)");
        let _ = proxy_stop_tx.send(());
        proxy.await.context("proxy task")?.context("proxy")?;
        let _ = stop_tx.send(());
        server.await.context("API server task")??;
        tracing::info!("stopped");
        anyhow::Ok(())
    })
}

/// A client of our own API server: the local administrator, or the user of `token`.
fn client(server: &str, token: Option<&str>) -> anyhow::Result<kube::Client> {
    let mut config = kube::Config::new(server.parse().context("API server URL")?);
    config.auth_info.token = token.map(|t| secrecy::SecretString::from(t.to_owned()));
    kube::Client::try_from(config).context("API client")
}

/// The token of `--proxy-token-file` (surrounding whitespace removed), checked before anything
/// starts: it must be one of `--token-auth-file`'s (an unknown one would make every request of
/// the proxy a 401).
fn proxy_token(
    args: &Args,
    security: &nodeport_apiserver::Security,
) -> anyhow::Result<Option<String>> {
    let Some(path) = &args.proxy_token_file else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(path).map_err(|e| {
        usage(format!(
            "invalid value for --proxy-token-file: reading {}: {e}",
            path.display()
        ))
    })?;
    let known = security
        .tokens
        .as_ref()
        .and_then(|tokens| tokens.authenticate(text.trim()));
    match known {
        Some(user) => {
            tracing::info!(user = %user.name, "the proxy authenticates with --proxy-token-file");
            Ok(Some(text.trim().to_owned()))
        }
        None => Err(usage(format!(
            "--proxy-token-file {}: the token is not one of --token-auth-file's",
            path.display()
        ))),
    }
}

/// Resolves on the first SIGTERM or SIGINT.
async fn shutdown_signal() -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("watch SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("watch SIGINT")?;
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = int.recv() => tracing::info!("SIGINT: shutting down"),
    }
    Ok(())
}

/// Creates (or updates) this host's Node object, as its kubelet would register it: the proxy
/// reads its node IPs (the `primary` NodePort addresses) from it.
async fn register_node(client: kube::Client, name: &str, ips: &[IpAddr]) -> anyhow::Result<()> {
    use kube::api::{Api, Patch, PatchParams, PostParams};
    let nodes: Api<Node> = Api::all(client);
    let mut addresses: Vec<NodeAddress> = ips
        .iter()
        .map(|ip| NodeAddress {
            type_: "InternalIP".into(),
            address: ip.to_string(),
        })
        .collect();
    addresses.push(NodeAddress {
        type_: "Hostname".into(),
        address: name.into(),
    });
    let status = NodeStatus {
        addresses: Some(addresses),
        ..Default::default()
    };
    let node = Node {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(
                [("kubernetes.io/hostname".to_owned(), name.to_owned())]
                    .into_iter()
                    .collect(),
            ),
            ..Default::default()
        },
        spec: Some(NodeSpec::default()),
        status: Some(status.clone()),
    };
    match nodes.create(&PostParams::default(), &node).await {
        Ok(_) => {}
        Err(kube::Error::Api(status_err)) if status_err.code == 409 => {}
        Err(err) => return Err(err).context(format!("register node {name}")),
    }
    // On a restart the Node exists with the addresses of the last run: bring them up to date.
    let patch = serde_json::json!({ "status": { "addresses": status.addresses } });
    nodes
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .with_context(|| format!("update the addresses of node {name}"))?;
    tracing::info!(node = %name, ?ips, "node registered");
    Ok(())
}

/// The node's InternalIPs from `--node-ip`: one address, or one of each family, as kubelet
/// takes them (`ParseNodeIPArgument` in `k8s.io/component-helpers/node/util`); else the
/// detected one.
fn node_ips(given: &[IpAddr]) -> anyhow::Result<Vec<IpAddr>> {
    match given {
        [] => Ok(vec![detect_node_ip().ok_or_else(|| {
            usage("cannot find this node's IP (no non-loopback IPv4 address); pass --node-ip")
        })?]),
        [one] => Ok(vec![*one]),
        [a, b] if a.is_ipv6() != b.is_ipv6() => Ok(vec![*a, *b]),
        _ => Err(usage(format!(
            "--node-ip {}: must contain either a single IP or a dual-stack pair of IPs",
            given
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(",")
        ))),
    }
}

/// This node's IP as kubelet would pick it without `--node-ip`: the IPv4 address of the
/// interface that carries the default route, else the first non-loopback IPv4 address.
fn detect_node_ip() -> Option<IpAddr> {
    let default_if = std::fs::read_to_string("/proc/net/route")
        .ok()
        .and_then(|routes| default_route_interface(&routes));
    let addrs: Vec<(String, Ipv4Addr)> = nix::ifaddrs::getifaddrs()
        .ok()?
        .filter_map(|ifa| {
            let addr = ifa.address?.as_sockaddr_in()?.ip();
            (!addr.is_loopback()).then_some((ifa.interface_name, addr))
        })
        .collect();
    default_if
        .and_then(|name| addrs.iter().find(|(n, _)| *n == name))
        .or_else(|| addrs.first())
        .map(|(_, ip)| IpAddr::V4(*ip))
}

/// The interface of the IPv4 default route in `/proc/net/route` format.
fn default_route_interface(routes: &str) -> Option<String> {
    routes.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        (fields.len() > 7 && fields[1] == "00000000" && fields[7] == "00000000")
            .then(|| fields[0].to_owned())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_route_interface_is_read_from_proc_net_route() {
        let routes = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
                      eth1\t0002000A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n\
                      eth0\t00000000\t0102000A\t0003\t0\t0\t0\t00000000\t0\t0\t0\n";
        assert_eq!(default_route_interface(routes).as_deref(), Some("eth0"));
        assert_eq!(default_route_interface("Iface\tDestination\n"), None);
    }

    #[test]
    fn a_non_loopback_bind_address_is_a_usage_error_naming_the_flag() {
        use clap::Parser;
        #[derive(Debug, clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: Args,
        }
        let cli = Cli::parse_from(["up", "--bind-address", "192.0.2.10"]);
        let err = api_config(&cli.args).unwrap_err();
        assert!(err.downcast_ref::<UsageError>().is_some());
        assert!(
            err.to_string().starts_with("--bind-address 192.0.2.10:"),
            "{err}"
        );
        let cli = Cli::parse_from([
            "up",
            "--service-cluster-ip-range",
            "10.96.0.0/16,fd00:10:96::/108",
        ]);
        let config = api_config(&cli.args).unwrap();
        assert_eq!(
            config.secondary_cluster_ip_range,
            Some("fd00:10:96::/108".parse().unwrap())
        );
        let cli = Cli::parse_from([
            "up",
            "--service-cluster-ip-range",
            "10.96.0.0/16,10.97.0.0/16",
        ]);
        let err = api_config(&cli.args).unwrap_err();
        assert_eq!(
            err.to_string(),
            "--service-cluster-ip-range[0] and --service-cluster-ip-range[1] must be of different IP family"
        );
        let cli = Cli::parse_from(["up", "--service-node-port-range", "40000-30000"]);
        let err = api_config(&cli.args).unwrap_err();
        assert!(
            err.to_string().starts_with("--service-node-port-range:"),
            "{err}"
        );
    }

    #[test]
    fn a_proxy_token_missing_from_the_token_auth_file_is_a_usage_error_and_a_known_one_is_trimmed()
    {
        use clap::Parser;
        #[derive(Debug, clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: Args,
        }
        let dir = tempfile::tempdir().unwrap();
        let (tokens, known, unknown) = (
            dir.path().join("tokens.csv"),
            dir.path().join("known.token"),
            dir.path().join("unknown.token"),
        );
        std::fs::write(&tokens, "proxy-token-0123456789,system:kube-proxy,3\n").unwrap();
        std::fs::write(&known, "proxy-token-0123456789\n").unwrap();
        std::fs::write(&unknown, "another-token-0123456789\n").unwrap();
        let parse = |token: &std::path::Path| {
            Cli::parse_from([
                "up".as_ref(),
                "--authorization-mode".as_ref(),
                "RBAC".as_ref(),
                "--token-auth-file".as_ref(),
                tokens.as_os_str(),
                "--proxy-token-file".as_ref(),
                token.as_os_str(),
            ])
            .args
        };
        let args = parse(&known);
        let config = api_config(&args).unwrap();
        assert_eq!(
            config.effective_authorization_modes(),
            vec![nodeport_apiserver::authz::Mode::Rbac]
        );
        let security = nodeport_apiserver::Security::load(&config).unwrap();
        assert_eq!(
            proxy_token(&args, &security).unwrap().as_deref(),
            Some("proxy-token-0123456789")
        );
        let args = parse(&unknown);
        let err = proxy_token(&args, &security).unwrap_err();
        assert!(err.downcast_ref::<UsageError>().is_some());
        assert_eq!(
            err.to_string(),
            format!(
                "--proxy-token-file {}: the token is not one of --token-auth-file's",
                unknown.display()
            )
        );
        // Without --token-auth-file the flag is refused by the parser (a token would
        // authenticate no one: every plain-HTTP request is the local administrator).
        assert!(
            Cli::try_parse_from([
                std::ffi::OsStr::new("up"),
                "--proxy-token-file".as_ref(),
                known.as_os_str()
            ])
            .is_err()
        );
    }

    #[test]
    fn node_ip_takes_one_address_per_family_repeated_or_comma_separated() {
        use clap::Parser;
        #[derive(Debug, clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: Args,
        }
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let cli = Cli::parse_from(["up", "--node-ip", "192.0.2.10", "--node-ip", "fd00::10"]);
        assert_eq!(
            node_ips(&cli.args.node_ip).unwrap(),
            vec![ip("192.0.2.10"), ip("fd00::10")]
        );
        let cli = Cli::parse_from(["up", "--node-ip", "fd00::10,192.0.2.10"]);
        assert_eq!(
            node_ips(&cli.args.node_ip).unwrap(),
            vec![ip("fd00::10"), ip("192.0.2.10")]
        );
        let cli = Cli::parse_from(["up", "--node-ip", "192.0.2.10,192.0.2.11"]);
        let err = node_ips(&cli.args.node_ip).unwrap_err();
        assert!(err.downcast_ref::<UsageError>().is_some());
        assert_eq!(
            err.to_string(),
            "--node-ip 192.0.2.10,192.0.2.11: must contain either a single IP or a dual-stack \
             pair of IPs"
        );
    }

    #[test]
    fn an_invalid_nodeport_addresses_value_is_a_usage_error_naming_the_flag_and_value() {
        use clap::Parser;
        #[derive(Debug, clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: Args,
        }
        for value in ["", "default_route", "10.0.0.0/33", "127.0.0.0/8,"] {
            let cli = Cli::parse_from(["up", "--nodeport-addresses", value]);
            let err = proxy_config(&cli.args, "node-a").unwrap_err();
            assert!(err.downcast_ref::<UsageError>().is_some(), "{err}");
            assert!(
                err.to_string().starts_with(&format!(
                    "invalid value \"{value}\" for --nodeport-addresses"
                )),
                "{err}"
            );
        }
        let cli = Cli::parse_from(["up", "--nodeport-addresses", "127.0.0.1/32,default-route"]);
        assert!(proxy_config(&cli.args, "node-a").is_ok());
    }
}
