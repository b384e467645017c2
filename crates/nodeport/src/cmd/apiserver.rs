//! `nodeport apiserver`: the Kubernetes-compatible API server (flags named as kube-apiserver's).

use std::net::IpAddr;
use std::path::PathBuf;

use anyhow::Context;
use nodeport_apiserver::{Config, PortRange, ipnet::IpNet};

use super::UsageError;

/// Flags of `nodeport apiserver`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Address to serve on. A non-loopback address needs TLS and token authentication.
    #[arg(long, default_value = "127.0.0.1")]
    bind_address: String,
    /// Port to serve on.
    #[arg(long, default_value_t = 6443)]
    port: u16,
    /// NodePort range, "N-M" (inclusive), "N+offset" or "N".
    #[arg(long, default_value = "30000-32767")]
    service_node_port_range: String,
    /// CIDR ClusterIPs are allocated from; two CIDRs of different families ("v4,v6" or
    /// "v6,v4", the first the primary family) make the cluster dual-stack.
    #[arg(long, default_value = "10.96.0.0/16")]
    service_cluster_ip_range: String,
    /// Directory of the embedded store.
    #[arg(long, default_value = "./nodeport-data")]
    data_dir: PathBuf,
    /// etcd client URLs (comma-separated); when set, the API is stored in etcd, shared by every
    /// API server pointed at it, instead of in --data-dir.
    #[arg(long)]
    etcd_servers: Option<String>,
    /// How often etcd's history is compacted (to the revision of one interval before), like
    /// kube-apiserver's flag: "5m", "300s", "1h"; "0" disables it.
    #[arg(long, default_value = "5m")]
    etcd_compaction_interval: String,
    /// Seconds between checks that the allocation bitmaps equal what the stored Services hold
    /// (leaks are freed); also checked at start.
    #[arg(long, default_value_t = 180)]
    allocation_check_interval: u64,
    /// Key prefix in the store.
    #[arg(long, default_value = "/registry")]
    etcd_prefix: String,
    /// TLS certificate, required with a non-loopback --bind-address.
    #[arg(long)]
    tls_cert_file: Option<PathBuf>,
    /// TLS private key, required with a non-loopback --bind-address.
    #[arg(long)]
    tls_private_key_file: Option<PathBuf>,
    /// Bearer tokens (kube-apiserver's CSV format), required with a non-loopback --bind-address.
    #[arg(long)]
    token_auth_file: Option<PathBuf>,
    /// The address this server is reached at by the rest of the cluster: it becomes an endpoint
    /// of the `kubernetes` Service (default/kubernetes), with --port. If unset, --bind-address
    /// when that is one specific, non-loopback address; otherwise the Service gets no endpoint
    /// from this server.
    #[arg(long)]
    advertise_address: Option<String>,
    /// Read-only requests served at once; more are answered 429 with Retry-After (watches and
    /// health checks are not counted); 0: no limit. As kube-apiserver's flag.
    #[arg(long, default_value_t = 400)]
    max_requests_inflight: usize,
    /// Mutating requests served at once; more are answered 429 with Retry-After; 0: no limit.
    /// As kube-apiserver's flag.
    #[arg(long, default_value_t = 200)]
    max_mutating_requests_inflight: usize,
    /// The longest a request other than a watch may take, body included, before it is answered
    /// 504 ("30s", "1m"). As kube-apiserver's flag.
    #[arg(long, default_value = "1m")]
    request_timeout: String,
    /// How long Events are kept after they were last recorded, like kube-apiserver's flag:
    /// "1h", "30m", "90s".
    #[arg(long, default_value = "1h")]
    event_ttl: String,
    /// Authorizers, in order (kube-apiserver's flag): AlwaysAllow, RBAC, comma-separated.
    /// Default: AlwaysAllow on a loopback --bind-address, RBAC beyond it.
    #[arg(long)]
    authorization_mode: Option<String>,
    /// Over TLS, treat a request without a token as system:anonymous (in
    /// system:unauthenticated), allowed only what RBAC grants it; false answers it 401. Off under
    /// AlwaysAllow, as kube-apiserver.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    anonymous_auth: bool,
}

fn usage(message: impl Into<String>) -> anyhow::Error {
    UsageError(message.into()).into()
}

/// A duration as `<number><unit>` with unit `s`, `m` or `h` (a bare `0` is zero).
fn duration(text: &str) -> Option<std::time::Duration> {
    if text == "0" {
        return Some(std::time::Duration::ZERO);
    }
    let unit = text.chars().last()?;
    let number: u64 = text[..text.len() - unit.len_utf8()].parse().ok()?;
    let seconds = match unit {
        's' => number,
        'm' => number.checked_mul(60)?,
        'h' => number.checked_mul(3600)?,
        _ => return None,
    };
    Some(std::time::Duration::from_secs(seconds))
}

/// `--service-cluster-ip-range`, as [`nodeport_apiserver::flags::cluster_ip_ranges`] checks
/// it; its error is a usage error.
pub(crate) fn cluster_ip_ranges(text: &str) -> anyhow::Result<(IpNet, Option<IpNet>)> {
    nodeport_apiserver::flags::cluster_ip_ranges(text).map_err(|e| usage(e.to_string()))
}

/// Turns the flags into a [`Config`], or a one-line usage error.
fn config(args: &Args) -> anyhow::Result<Config> {
    let bind_address: IpAddr = args.bind_address.parse().map_err(|_| {
        usage(format!(
            "--bind-address {:?} is not an IP address",
            args.bind_address
        ))
    })?;
    if !bind_address.is_loopback() {
        let missing: Vec<&str> = [
            ("--tls-cert-file", args.tls_cert_file.is_none()),
            (
                "--tls-private-key-file",
                args.tls_private_key_file.is_none(),
            ),
            ("--token-auth-file", args.token_auth_file.is_none()),
        ]
        .into_iter()
        .filter(|(_, missing)| *missing)
        .map(|(flag, _)| flag)
        .collect();
        if !missing.is_empty() {
            return Err(usage(format!(
                "--bind-address {bind_address} is not a loopback address: serving beyond loopback requires {}",
                missing.join(", ")
            )));
        }
    }
    if args.tls_cert_file.is_some() != args.tls_private_key_file.is_some() {
        return Err(usage(
            "--tls-cert-file and --tls-private-key-file must be given together",
        ));
    }
    let etcd_servers: Vec<String> = args
        .etcd_servers
        .as_deref()
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect();
    for url in &etcd_servers {
        if !url.starts_with("http://") {
            return Err(usage(format!(
                "--etcd-servers {url:?}: only http:// client URLs are supported"
            )));
        }
    }
    let etcd_compaction_interval = duration(&args.etcd_compaction_interval).ok_or_else(|| {
        usage(format!(
            "--etcd-compaction-interval {:?} is not a duration (like 5m, 300s, 1h or 0)",
            args.etcd_compaction_interval
        ))
    })?;
    let event_ttl = duration(&args.event_ttl)
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            usage(format!(
                "--event-ttl {:?} is not a duration of at least 1s (like 1h, 30m or 90s)",
                args.event_ttl
            ))
        })?;
    if args.allocation_check_interval == 0 {
        return Err(usage(
            "--allocation-check-interval must be at least 1 second",
        ));
    }
    let node_port_range = PortRange::parse(&args.service_node_port_range)
        .map_err(|e| usage(format!("--service-node-port-range: {e}")))?;
    let (cluster_ip_range, secondary_cluster_ip_range) =
        cluster_ip_ranges(&args.service_cluster_ip_range)?;
    if !args.etcd_prefix.starts_with('/') || args.etcd_prefix.ends_with('/') {
        return Err(usage(format!(
            "--etcd-prefix {:?} must start with '/' and not end with one",
            args.etcd_prefix
        )));
    }
    let advertise_address = match &args.advertise_address {
        Some(text) => {
            let ip: IpAddr = text
                .parse()
                .map_err(|_| usage(format!("--advertise-address {text:?} is not an IP address")))?;
            if ip.is_unspecified() {
                return Err(usage(format!(
                    "--advertise-address {ip} is not an address others can reach"
                )));
            }
            Some(ip)
        }
        // kube-apiserver's default: the bind address, unless it is a wildcard (kube then picks
        // the default route's interface; here the flag must be given) or loopback.
        None => Some(bind_address).filter(|ip| !ip.is_unspecified() && !ip.is_loopback()),
    };
    let authorization_modes = args
        .authorization_mode
        .as_deref()
        .map(nodeport_apiserver::authz::Mode::parse_list)
        .transpose()
        .map_err(|e| usage(format!("--authorization-mode: {e}")))?;
    let mut config = Config {
        authorization_modes,
        anonymous_auth: args.anonymous_auth,
        advertise_address,
        bind_address,
        port: args.port,
        node_port_range,
        cluster_ip_range: cluster_ip_range.trunc(),
        secondary_cluster_ip_range: secondary_cluster_ip_range.map(|net| net.trunc()),
        data_dir: args.data_dir.clone(),
        prefix: args.etcd_prefix.clone(),
        tls_cert_file: args.tls_cert_file.clone(),
        tls_private_key_file: args.tls_private_key_file.clone(),
        token_auth_file: args.token_auth_file.clone(),
        etcd_servers,
        etcd_compaction_interval,
        allocation_check_interval: std::time::Duration::from_secs(args.allocation_check_interval),
        event_ttl,
        ..Config::default()
    };
    config.rest.server_address = format!("{}:{}", bind_address, args.port);
    let request_timeout = duration(&args.request_timeout)
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            usage(format!(
                "--request-timeout {:?} is not a positive duration (like 60s or 1m)",
                args.request_timeout
            ))
        })?;
    config.rest.limits = nodeport_apiserver::rest::limits::Config {
        max_requests_inflight: args.max_requests_inflight,
        max_mutating_requests_inflight: args.max_mutating_requests_inflight,
        request_timeout,
    };
    Ok(config)
}

/// Runs `nodeport apiserver` until SIGTERM or SIGINT.
pub fn run(args: Args) -> anyhow::Result<()> {
    let config = config(&args)?;
    super::raise_open_files_limit();
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    // A bad certificate, key or token file is a usage error, found before anything is opened.
    let security = nodeport_apiserver::Security::load(&config)
        .map_err(|e| usage(nodeport_apiserver::report(&e)))?;
    runtime.block_on(async move {
        let listener = nodeport_apiserver::bind(&config).await?;
        let state = nodeport_apiserver::open(&config).await?;
        tracing::info!(
            address = %listener.local_addr()?,
            node_ports = %config.node_port_range,
            cluster_ips = %config.cluster_ip_range,
            secondary_cluster_ips = ?config.secondary_cluster_ip_range,
            storage = if config.etcd_servers.is_empty() {
                format!("redb in {}", config.data_dir.display())
            } else {
                format!("etcd at {}", config.etcd_servers.join(","))
            },
            tls = security.tls.is_some(),
            tokens = security.tokens.as_ref().map_or(0, |t| t.len()),
            authorization = %config
                .effective_authorization_modes()
                .iter()
                .map(|m| m.name())
                .collect::<Vec<_>>()
                .join(","),
            "serving the Kubernetes API"
        );
        let registry = state.registry.clone();
        let (advertised, port, ttl) = (
            config.advertise_address,
            config.port,
            config.endpoint_lease_ttl,
        );
        let shutdown = async move {
            shutdown_signal().await;
            // As kube-apiserver's pre-shutdown hook: leave the kubernetes endpoints while still
            // serving, so clients are sent elsewhere before this server stops answering.
            if let Some(ip) = advertised
                && let Err(err) = registry.leave_kubernetes_endpoints(ip, port, ttl).await
            {
                tracing::warn!(error = %err, "cannot remove this server from the kubernetes endpoints");
            }
        };
        nodeport_apiserver::serve_secured(state, listener, security, shutdown).await?;
        tracing::info!("stopped");
        anyhow::Ok(())
    })
}

async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(err) => {
            tracing::warn!(error = %err, "cannot watch SIGTERM; only SIGINT stops the server");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("shutting down");
}
