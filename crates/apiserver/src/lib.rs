//! Kubernetes-compatible API server where NodePorts and ClusterIPs are allocated as a Service is
//! saved.
//!
//! Layers, bottom up:
//! - [`storage`]: a revisioned key-value contract (etcd v3's), the embedded redb backend and the
//!   etcd backend (several API servers on one etcd);
//! - [`store`]: the single writer that runs every mutation against the latest state and commits
//!   batches of them, with the allocation bitmaps, in one transaction (group commit);
//! - [`registry`]: kube-apiserver's generic store for Services, Endpoints, EndpointSlices, Nodes,
//!   Namespaces, Events, ServiceCIDRs and IPAddresses, with the Service rules (defaulting,
//!   allocation, validation) in [`registry::service`], the dual-stack ones (`ipFamilyPolicy`,
//!   `ipFamilies`, both families' ClusterIPs) in [`registry::ip_families`], ServiceCIDRs (the
//!   default one and added ones) in [`registry::service_cidr`], the two forms of Event in
//!   [`registry::event`], and `kind`/`apiVersion` defaulting in [`registry::gvk`];
//! - [`rest`]: the HTTP API (`router`), discovery, Table output, watch, patch, and protobuf
//!   request bodies turned into JSON ([`rest::protobuf`]);
//! - [`ranges`]: `GET /ranges` (NodePort and ClusterIP occupancy per band) and `/metrics`;
//! - [`tls`] and [`auth`]: serving over TLS and bearer tokens from `--token-auth-file`, which a
//!   non-loopback `--bind-address` requires;
//! - [`authz`]: identities, impersonation, `--authorization-mode` (`AlwaysAllow`, `RBAC`), the
//!   `rbac.authorization.k8s.io/v1` policy with its bootstrap roles, escalation prevention and
//!   the `authorization.k8s.io/v1` access reviews.
//!
//! Differences from kube-apiserver, on purpose:
//! - allocation and the Service write are one transaction, so there is no window in which a
//!   crash or a lost race leaks a port; a verification loop still compares the bitmaps with the
//!   Services (at start and every `--allocation-check-interval`) and frees only leaks, which only
//!   a hand edit of the storage can make;
//! - Events expire `--event-ttl` after the latest time they carry, not through an etcd lease;
//! - a duplicate nodePort inside one update is a 422 `Duplicate value` rather than a 500;
//! - a `dryRun=All` create shows the port and address that would really be allocated instead of
//!   kube-apiserver's placeholders (32769..., the network address);
//! - the namespace controller's work (deleting a Terminating namespace's contents, then the
//!   namespace) runs inside the API server (see [`registry::namespace`]);
//! - server-side apply follows kube's field manager without taking over a client-side apply's
//!   fields through its last-applied annotation (see [`registry::managed_fields`]);
//! - `networking.k8s.io/v1` ServiceCIDRs added through the API give ClusterIPs as in kube 1.33,
//!   but their allocations are recorded in one stored document (`<prefix>/ranges/servicecidrs`,
//!   see [`cidr_ranges`]); the IPAddress objects are written beside the allocations in the same
//!   transaction rather than read by the allocator; the ServiceCIDR controller's work
//!   (finalizer, `Ready`, deletion once unused) runs inside the API server;
//! - responses are JSON (or YAML for objects and lists when asked for), never protobuf; protobuf
//!   request bodies are decoded for the served kinds only;
//! - an etcd outage is logged once when it starts and once when it ends (`storage::outage`), with
//!   503/504 answers meanwhile, not one ERROR line per failed request.

pub mod auth;
pub mod authz;
pub mod cidr_ranges;
pub mod error;
pub mod flags;
pub mod fuzzing;
pub mod ranges;
pub mod registry;
pub mod resource;
pub mod rest;
pub mod storage;
pub mod store;
pub mod tls;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ipnet::IpNet;

pub use ipnet;
pub use nodeport_alloc::PortRange;
pub use rest::{AppState, router};

use crate::registry::Registry;
use crate::registry::service::ServiceRanges;
use crate::storage::Backend;
use crate::storage::etcd::EtcdBackend;
use crate::storage::redb::RedbBackend;
use crate::store::Store;

/// Configuration of the API server. CLI flags are parsed in the binary.
#[derive(Debug, Clone)]
pub struct Config {
    /// `--bind-address`: default `127.0.0.1` (plain HTTP is only served on loopback).
    pub bind_address: std::net::IpAddr,
    /// `--port`: default 6443, kube-apiserver's secure port.
    pub port: u16,
    /// `--service-node-port-range`: default `30000-32767`.
    pub node_port_range: PortRange,
    /// `--service-cluster-ip-range`: default `10.96.0.0/16` (kubeadm's is `10.96.0.0/12`; a /16
    /// keeps the ClusterIP bitmap at 8 KiB per write).
    pub cluster_ip_range: IpNet,
    /// The second CIDR of a dual-stack `--service-cluster-ip-range` (`v4,v6` or `v6,v4`), of
    /// the other family; `None` on a single-stack server.
    pub secondary_cluster_ip_range: Option<IpNet>,
    /// `--data-dir`: where the embedded store keeps its file; default `./nodeport-data`.
    pub data_dir: PathBuf,
    /// `--etcd-prefix`: key prefix, default `/registry`.
    pub prefix: String,
    /// REST settings.
    pub rest: rest::Config,
    /// Embedded store settings.
    pub storage: storage::redb::Config,
    /// `--tls-cert-file`: PEM certificate chain; with the key, the API is served over TLS.
    pub tls_cert_file: Option<PathBuf>,
    /// `--tls-private-key-file`: PEM private key of the certificate.
    pub tls_private_key_file: Option<PathBuf>,
    /// `--etcd-servers`: when not empty, the API is stored in etcd instead of `data_dir`.
    pub etcd_servers: Vec<String>,
    /// `--etcd-compaction-interval` (see [`storage::etcd::Config::compaction_interval`]).
    pub etcd_compaction_interval: std::time::Duration,
    /// How often the allocation bitmaps are compared with the stored Services (and leaks freed);
    /// also once at start. Default 3 minutes.
    pub allocation_check_interval: std::time::Duration,
    /// `--token-auth-file`: bearer tokens (kube-apiserver's CSV); when set, every request but the
    /// health checks needs one.
    pub token_auth_file: Option<PathBuf>,
    /// `--advertise-address`: the address this server gives as an endpoint of the `kubernetes`
    /// Service (with `port`), through a lease renewed every `endpoint_lease_renew`. None: this
    /// server adds no endpoint.
    pub advertise_address: Option<std::net::IpAddr>,
    /// How long a lease counts without renewal (kube-apiserver: 15 s).
    pub endpoint_lease_ttl: std::time::Duration,
    /// How often the lease is renewed and the endpoints rewritten (kube-apiserver: 10 s).
    pub endpoint_lease_renew: std::time::Duration,
    /// `--event-ttl`: how long an Event is kept after it was last recorded (kube-apiserver: 1 h).
    pub event_ttl: std::time::Duration,
    /// `--authorization-mode`; `None` for the default: `AlwaysAllow` on a loopback
    /// `--bind-address`, `RBAC` beyond it.
    pub authorization_modes: Option<Vec<authz::Mode>>,
    /// `--anonymous-auth` (default true, as kube-apiserver): over TLS, a request without a token
    /// is `system:anonymous`; kube-apiserver turns it off under `AlwaysAllow`.
    pub anonymous_auth: bool,
}

impl Config {
    /// The authorization modes in effect (see [`Config::authorization_modes`]).
    pub fn effective_authorization_modes(&self) -> Vec<authz::Mode> {
        match &self.authorization_modes {
            Some(modes) => modes.clone(),
            None if self.bind_address.is_loopback() => vec![authz::Mode::AlwaysAllow],
            None => vec![authz::Mode::Rbac],
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            bind_address: std::net::IpAddr::from([127, 0, 0, 1]),
            port: 6443,
            node_port_range: PortRange::default(),
            cluster_ip_range: "10.96.0.0/16".parse().expect("valid CIDR"),
            secondary_cluster_ip_range: None,
            data_dir: PathBuf::from("./nodeport-data"),
            prefix: storage::keys::DEFAULT_PREFIX.to_owned(),
            rest: rest::Config::default(),
            storage: storage::redb::Config::default(),
            tls_cert_file: None,
            tls_private_key_file: None,
            token_auth_file: None,
            etcd_servers: Vec::new(),
            etcd_compaction_interval: std::time::Duration::from_secs(300),
            allocation_check_interval: std::time::Duration::from_secs(180),
            advertise_address: None,
            endpoint_lease_ttl: registry::master_leases::LEASE_TTL,
            endpoint_lease_renew: registry::master_leases::RENEW_INTERVAL,
            event_ttl: registry::event::DEFAULT_TTL,
            authorization_modes: None,
            anonymous_auth: true,
        }
    }
}

/// Why the server could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The data directory could not be created.
    #[error("cannot create the data directory {path}")]
    DataDir {
        /// The directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The embedded store could not be opened.
    #[error("cannot open the embedded store {path}")]
    OpenStore {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: storage::Error,
    },
    /// The etcd client could not be set up.
    #[error("cannot use etcd")]
    Etcd(#[source] storage::Error),
    /// The first-start objects or the bitmaps could not be written.
    #[error("bootstrap failed")]
    Bootstrap(#[source] error::ApiError),
    /// The ClusterIP range is unusable.
    #[error("invalid --service-cluster-ip-range")]
    ClusterIpRange(#[source] nodeport_alloc::ip::Error),
    /// The two CIDRs of a dual-stack range are of one family (kube-apiserver's text).
    #[error(
        "--service-cluster-ip-range[0] and --service-cluster-ip-range[1] must be of different IP family"
    )]
    SameFamily,
    /// The listening socket could not be bound.
    #[error("cannot listen on {address}")]
    Bind {
        /// The address.
        address: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The HTTP server failed.
    #[error("HTTP server failed")]
    Serve(#[source] std::io::Error),
    /// The TLS certificate or key could not be loaded.
    #[error("invalid TLS settings")]
    Tls(#[source] tls::Error),
    /// Only one of `--tls-cert-file` and `--tls-private-key-file` was given.
    #[error("--tls-cert-file and --tls-private-key-file must be given together")]
    TlsPair,
    /// The token file could not be loaded.
    #[error("invalid --token-auth-file")]
    Tokens(#[source] auth::Error),
}

/// How the API is secured: TLS and bearer tokens, each optional.
#[derive(Clone, Default)]
pub struct Security {
    /// The TLS server configuration, if the API is served over TLS.
    pub tls: Option<Arc<tokio_rustls::rustls::ServerConfig>>,
    /// The tokens of `--token-auth-file` (reloaded when the file changes), if token
    /// authentication is on.
    pub tokens: Option<Arc<auth::TokenSource>>,
    /// `--anonymous-auth`.
    pub anonymous_auth: bool,
}

impl Security {
    /// Loads the certificate, key and token file the configuration names.
    pub fn load(config: &Config) -> Result<Self, Error> {
        let tls = match (&config.tls_cert_file, &config.tls_private_key_file) {
            (Some(cert), Some(key)) => Some(tls::server_config(cert, key).map_err(Error::Tls)?),
            (None, None) => None,
            _ => return Err(Error::TlsPair),
        };
        let tokens = match &config.token_auth_file {
            Some(path) => Some(Arc::new(
                auth::TokenSource::load(path).map_err(Error::Tokens)?,
            )),
            None => None,
        };
        Ok(Security {
            tls,
            tokens,
            anonymous_auth: config.anonymous_auth,
        })
    }
}

/// How often ServiceCIDRs being deleted are checked for Services still using them.
const SERVICE_CIDR_SYNC_PERIOD: std::time::Duration = std::time::Duration::from_secs(1);

/// How long a starting server waits for an unreachable storage before giving up.
const BOOTSTRAP_WAIT_SECONDS: u32 = 60;

/// The name of the embedded store's file inside `--data-dir`.
pub const DATA_FILE: &str = "nodeport.redb";

fn service_ranges(config: &Config) -> Result<ServiceRanges, Error> {
    nodeport_alloc::ip::Allocator::new(config.cluster_ip_range).map_err(Error::ClusterIpRange)?;
    if let Some(secondary) = config.secondary_cluster_ip_range {
        nodeport_alloc::ip::Allocator::new(secondary).map_err(Error::ClusterIpRange)?;
        if secondary.addr().is_ipv6() == config.cluster_ip_range.addr().is_ipv6() {
            return Err(Error::SameFamily);
        }
    }
    Ok(ServiceRanges {
        node_ports: config.node_port_range,
        cluster_ips: config.cluster_ip_range,
        secondary_cluster_ips: config.secondary_cluster_ip_range,
    })
}

async fn state_over(backend: Arc<dyn Backend>, config: &Config) -> Result<AppState, Error> {
    let ranges = service_ranges(config)?;
    let store = Store::start(backend, &config.prefix, ranges.store_ranges());
    let registry = Registry::new(store, ranges);
    // Like kube-apiserver, wait for the storage at start rather than fail: etcd may come up
    // after the API servers.
    let mut waited = 0;
    loop {
        match registry.bootstrap().await {
            Ok(()) => break,
            Err(err) if matches!(err.code(), 503 | 504) && waited < BOOTSTRAP_WAIT_SECONDS => {
                if waited % 5 == 0 {
                    tracing::warn!(error = %err, "storage not reachable yet; retrying");
                }
                waited += 1;
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
            Err(err) => return Err(Error::Bootstrap(err)),
        }
    }
    // kube-apiserver's `rbac/bootstrap-roles` post-start hook: the bootstrap policy, created
    // or reconciled, before the policy cache loads.
    authz::bootstrap::reconcile(&registry)
        .await
        .map_err(Error::Bootstrap)?;
    let policy = authz::cache::PolicyCache::default();
    policy.start(registry.clone()).await;
    match registry.verify_and_repair().await {
        Ok(v) if v.is_consistent() => {
            tracing::info!(
                services = v.services,
                "allocation bitmaps match the stored Services"
            );
        }
        Ok(_) => {}
        Err(err) => tracing::error!(error = %err, "allocation check failed"),
    }
    // kube-controller-manager's namespace controller, for namespaces whose deletion an API server
    // left unfinished: at start and every few minutes (a DELETE starts its own work at once).
    let sweeper = registry.clone();
    let sweep_loop = async move {
        let mut ticker = tokio::time::interval(registry::namespace::SYNC_PERIOD);
        loop {
            ticker.tick().await;
            match sweeper.sweep_terminating_namespaces().await {
                Ok(0) => {}
                Ok(started) => tracing::info!(started, "finishing Terminating namespaces"),
                Err(err) => tracing::debug!(error = %err, "cannot look for Terminating namespaces"),
            }
        }
    };
    tokio::spawn(tracing::Instrument::instrument(
        sweep_loop,
        tracing::info_span!("namespace_sweep"),
    ));
    // kube-controller-manager's ServiceCIDR controller, for ServiceCIDRs being deleted: each
    // goes once no Service holds an address only it covers.
    let cidrs = registry.clone();
    let cidr_loop = async move {
        let mut ticker = tokio::time::interval(SERVICE_CIDR_SYNC_PERIOD);
        loop {
            ticker.tick().await;
            match cidrs.finish_service_cidr_deletions().await {
                Ok(0) => {}
                Ok(removed) => tracing::info!(removed, "ServiceCIDRs no longer in use removed"),
                Err(err) => {
                    tracing::debug!(error = %err, "cannot look for ServiceCIDRs being deleted")
                }
            }
            match cidrs.ensure_default_service_cidr().await {
                Ok(false) => {}
                Ok(true) => tracing::info!("default ServiceCIDR created again"),
                Err(err) => {
                    tracing::debug!(error = %err, "cannot check the default ServiceCIDR")
                }
            }
        }
    };
    tokio::spawn(tracing::Instrument::instrument(
        cidr_loop,
        tracing::info_span!("service_cidr_controller"),
    ));
    let checker = registry.clone();
    let interval = config.allocation_check_interval;
    let check_loop = async move {
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        loop {
            ticker.tick().await;
            if let Err(err) = checker.verify_and_repair().await {
                tracing::warn!(error = %err, "allocation check failed");
            }
        }
    };
    tokio::spawn(tracing::Instrument::instrument(
        check_loop,
        tracing::info_span!("allocation_check"),
    ));
    // Events expire `--event-ttl` after they were last recorded (kube-apiserver: an etcd lease
    // per write); looked for every quarter of the TTL, at least every minute.
    let expirer = registry.clone();
    let ttl = config.event_ttl;
    let expire_loop = async move {
        let every = (ttl / 4).clamp(
            std::time::Duration::from_secs(1),
            std::time::Duration::from_secs(60),
        );
        let mut ticker = tokio::time::interval(every);
        loop {
            ticker.tick().await;
            match expirer.expire_events(ttl).await {
                Ok(0) => {}
                Ok(expired) => tracing::debug!(expired, "expired events deleted"),
                Err(err) => tracing::debug!(error = %err, "cannot expire events"),
            }
        }
    };
    tokio::spawn(tracing::Instrument::instrument(
        expire_loop,
        tracing::info_span!("event_ttl"),
    ));
    if let Some(ip) = config.advertise_address {
        // Renewed at once, so `default/kubernetes` has this server before it serves.
        if let Err(err) = registry
            .renew_kubernetes_endpoints(ip, config.port, config.endpoint_lease_ttl)
            .await
        {
            tracing::warn!(error = %err, "cannot add this server to the kubernetes endpoints yet");
        }
        let renewer = registry.clone();
        let (port, ttl, every) = (
            config.port,
            config.endpoint_lease_ttl,
            config.endpoint_lease_renew,
        );
        let renew_loop = async move {
            let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            loop {
                ticker.tick().await;
                if let Err(err) = renewer.renew_kubernetes_endpoints(ip, port, ttl).await {
                    tracing::warn!(error = %err, "cannot renew this server's kubernetes endpoint");
                }
            }
        };
        tokio::spawn(tracing::Instrument::instrument(
            renew_loop,
            tracing::info_span!("endpoint_reconciler", %ip),
        ));
    }
    let mut state = AppState::new(registry, config.rest.clone());
    state.authorizer = authz::Authorizer::new(config.effective_authorization_modes(), policy);
    Ok(state)
}

/// Opens the store (etcd if `config.etcd_servers` is set, the embedded store in
/// `config.data_dir` if not) and bootstraps it.
pub async fn open(config: &Config) -> Result<AppState, Error> {
    if !config.etcd_servers.is_empty() {
        let backend = EtcdBackend::connect(
            storage::etcd::Config {
                compaction_interval: config.etcd_compaction_interval,
                ..storage::etcd::Config::new(config.etcd_servers.clone())
            },
            &config.prefix,
        )
        .await
        .map_err(Error::Etcd)?;
        return state_over(Arc::new(backend), config).await;
    }
    std::fs::create_dir_all(&config.data_dir).map_err(|source| Error::DataDir {
        path: config.data_dir.clone(),
        source,
    })?;
    let path = config.data_dir.join(DATA_FILE);
    let backend = open_redb(&path, config)?;
    state_over(Arc::new(backend), config).await
}

fn open_redb(path: &Path, config: &Config) -> Result<RedbBackend, Error> {
    let path_buf = path.to_path_buf();
    let backend =
        RedbBackend::open(path, config.storage.clone()).map_err(|source| Error::OpenStore {
            path: path_buf,
            source,
        })?;
    Ok(backend)
}

/// A server state over an in-memory store (tests, benchmarks).
pub async fn in_memory(config: &Config) -> Result<AppState, Error> {
    let backend =
        RedbBackend::in_memory(config.storage.clone()).map_err(|source| Error::OpenStore {
            path: PathBuf::from(":memory:"),
            source,
        })?;
    state_over(Arc::new(backend), config).await
}

/// Serves the API in plain HTTP, without authentication, on `listener` until `shutdown`
/// completes.
pub async fn serve(
    state: AppState,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    serve_secured(state, listener, Security::default(), shutdown).await
}

/// Serves the API on `listener`, over TLS and with token authentication as `security` says,
/// until `shutdown` completes.
pub async fn serve_secured(
    state: AppState,
    listener: tokio::net::TcpListener,
    security: Security,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    // Open watches end when the shutdown begins; the server then drains the rest.
    let trigger = state.shut_down.clone();
    let shutdown = async move {
        shutdown.await;
        let _ = trigger.send(true);
    };
    let app = app(state, &security);
    if let Some(tokens) = &security.tokens {
        tokens.clone().spawn_reloader(auth::RELOAD_INTERVAL);
    }
    match security.tls {
        Some(config) => tls::serve(listener, config, app, shutdown)
            .await
            .map_err(Error::Serve),
        None => axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
            .map_err(Error::Serve),
    }
}

/// The HTTP API behind the request gate (authentication, impersonation, authorization) that
/// `security` and the state's authorizer describe.
pub fn app(state: AppState, security: &Security) -> axum::Router {
    let gate = Arc::new(authz::Gate {
        tokens: security.tokens.clone(),
        tls: security.tls.is_some(),
        anonymous_auth: security.anonymous_auth,
        authorizer: state.authorizer.clone(),
    });
    router(state).layer(axum::middleware::from_fn_with_state(gate, authz::gate))
}

/// Binds `config.bind_address:config.port`.
pub async fn bind(config: &Config) -> Result<tokio::net::TcpListener, Error> {
    let address = SocketAddr::new(config.bind_address, config.port);
    tokio::net::TcpListener::bind(address)
        .await
        .map_err(|source| Error::Bind { address, source })
}

/// Formats an error with its chain of causes, for logs.
pub fn report(err: &(dyn std::error::Error + 'static)) -> String {
    let mut out = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        source = cause.source();
    }
    out
}
