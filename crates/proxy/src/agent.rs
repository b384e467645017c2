//! The running proxy: watchers, the rate-limited sync loop, node addresses, health and
//! metrics servers, conntrack clean-up, wired together.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::discovery::v1 as discovery;
use k8s_openapi::api::networking::v1 as networking;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::watcher;
use tokio::sync::Notify;

use crate::backend::{self, Backend};
use crate::config::{NodeConfig, ProxyMode};
use crate::convert;
use crate::desired::{self, DesiredState, NodeView, StateConfig};
use crate::health::{FamilyAddresses, HealthCheck, ProxyHealth, ServiceHealthServers};
use crate::metrics::{Metrics, family_label};
use crate::model::{IpFamily, Node, ServiceName};
use crate::nftables::apply::NftCommand;
use crate::nodeaddr::{NodeFacts, NodePortAddresses};
use crate::objects::Cluster;
use crate::watch::{self, Sink};

/// A proxy failure that stops it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `--proxy-mode ipvs`: IPVS is deprecated upstream (KEP-5495) and only rendered here.
    #[error(
        "--proxy-mode ipvs: programming IPVS is not supported (deprecated upstream, KEP-5495); \
         `nodeport render --proxy-mode ipvs` shows what it would program; use nftables or iptables"
    )]
    IpvsNotProgrammed,
    /// `--proxy-mode ebpf`: loading or attaching the programs failed.
    #[error("--proxy-mode ebpf: starting the eBPF dataplane")]
    Ebpf(#[source] crate::ebpf::dataplane::Error),
    /// A health or metrics address could not be bound.
    #[error("binding {what} on {addr}")]
    Bind {
        /// Which server.
        what: &'static str,
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Everything `nodeport proxy` is configured with (kube-proxy's flag names in the docs).
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// `--hostname-override`: this node's name.
    pub node_name: String,
    /// `--proxy-mode` (default nftables).
    pub mode: ProxyMode,
    /// Rendering configuration (`--masquerade-all`, `--cluster-cidr`, ...).
    pub node: NodeConfig,
    /// `--nodeport-addresses` (default `primary`).
    pub nodeport_addresses: NodePortAddresses,
    /// Families to program (both by default, kube-proxy's dual-stack proxier).
    pub families: Vec<IpFamily>,
    /// `--healthz-bind-address` (default `0.0.0.0:10256`); `None` disables it.
    pub healthz_bind_address: Option<SocketAddr>,
    /// `--metrics-bind-address` (default `127.0.0.1:10249`); `None` disables it.
    pub metrics_bind_address: Option<SocketAddr>,
    /// `--sync-period` (default 30 s): periodic resync; `/healthz` fails after twice this.
    pub sync_period: Duration,
    /// `--min-sync-period` (default 1 s): at most one sync per this interval.
    pub min_sync_period: Duration,
    /// Every how often a periodic sync is full (rewriting every chain) even without drift:
    /// kube-proxy's `FullSyncPeriod`, one hour. Any sync is also full when the nf_tables
    /// generation moved since our last commit (someone else changed the ruleset).
    pub full_sync_period: Duration,
    /// How often the node's interface addresses are dumped (default 1 s).
    pub address_poll_interval: Duration,
    /// The `nft` command.
    pub nft: NftCommand,
    /// The `iptables` tools (iptables mode).
    pub iptables: crate::iptables::apply::IptablesCommand,
    /// The eBPF dataplane's settings (eBPF mode: `--ebpf-*`).
    pub ebpf: crate::ebpf::dataplane::Config,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            node_name: String::new(),
            mode: ProxyMode::default(),
            node: NodeConfig::default(),
            nodeport_addresses: NodePortAddresses::default(),
            families: IpFamily::ALL.to_vec(),
            // kube-proxy's defaults (pkg/proxy/apis/config/v1alpha1/defaults.go).
            healthz_bind_address: Some(SocketAddr::from(([0, 0, 0, 0], 10256))),
            metrics_bind_address: Some(SocketAddr::from(([127, 0, 0, 1], 10249))),
            sync_period: Duration::from_secs(30),
            min_sync_period: Duration::from_secs(1),
            full_sync_period: Duration::from_secs(3600),
            address_poll_interval: Duration::from_secs(1),
            nft: NftCommand::default(),
            iptables: crate::iptables::apply::IptablesCommand::default(),
            ebpf: crate::ebpf::dataplane::Config::default(),
        }
    }
}

/// Watch results waiting for the sync loop.
#[derive(Default)]
struct Inputs {
    cluster: Cluster,
    node: Option<Node>,
    local_ips: Vec<IpAddr>,
    /// Addresses of the interfaces holding a default route (`default-route`).
    default_route_ips: Vec<IpAddr>,
    /// Node object or addresses changed.
    node_changed: bool,
    services_synced: bool,
    slices_synced: bool,
    node_synced: bool,
    /// The first interface address dump is done (NodePort addresses depend on it).
    addrs_synced: bool,
    /// When the pending endpoint changes were triggered (network programming latency).
    trigger_times: Vec<SystemTime>,
    /// The newest `resourceVersion` each watch (`services`, `endpointslices`) delivered.
    revisions: BTreeMap<&'static str, u64>,
}

impl Inputs {
    /// Records the `resourceVersion` of an object a watch delivered (a number on etcd and on
    /// our embedded store; anything else is not recorded).
    fn saw(&mut self, resource: &'static str, meta: &ObjectMeta) {
        if let Some(rv) = meta
            .resource_version
            .as_deref()
            .and_then(|v| v.parse().ok())
        {
            let newest = self.revisions.entry(resource).or_insert(0);
            *newest = (*newest).max(rv);
        }
    }
}

/// State shared by the watchers and the sync loop.
struct Shared {
    inputs: Mutex<Inputs>,
    notify: Notify,
    health: Arc<ProxyHealth>,
    metrics: Arc<Metrics>,
    families: Vec<IpFamily>,
}

impl Shared {
    fn request_sync(&self) {
        self.health.queued_update();
        let now = unix_now();
        for f in &self.families {
            self.metrics
                .last_queued_timestamp
                .get_or_create(&family_label(*f))
                .set(now);
        }
        self.notify.notify_one();
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

struct Services(Arc<Shared>);
struct Slices(Arc<Shared>);
struct Cidrs(Arc<Shared>);
struct NodeSink(Arc<Shared>, String);

impl Sink<core::Service> for Services {
    type Key = ServiceName;
    fn apply(&self, obj: &core::Service, deleted: bool) -> Option<ServiceName> {
        let key = convert::object_key(&obj.metadata);
        let value = if deleted {
            None
        } else {
            convert::service(obj).map(|(_, v)| v)
        };
        let changed = {
            let mut i = self.0.inputs.lock().expect("inputs");
            i.saw("services", &obj.metadata);
            i.cluster.update_service(key.clone(), value)
        };
        if changed {
            self.0.request_sync();
        }
        Some(key)
    }
    fn remove(&self, keys: Vec<ServiceName>) {
        let mut i = self.0.inputs.lock().expect("inputs");
        for k in keys {
            i.cluster.update_service(k, None);
        }
        drop(i);
        self.0.request_sync();
    }
    fn keys(&self) -> Vec<ServiceName> {
        self.0
            .inputs
            .lock()
            .expect("inputs")
            .cluster
            .services
            .keys()
            .cloned()
            .collect()
    }
    fn synced(&self) {
        self.0.inputs.lock().expect("inputs").services_synced = true;
        self.0.request_sync();
    }
}

impl Sink<discovery::EndpointSlice> for Slices {
    type Key = ServiceName;
    fn apply(&self, obj: &discovery::EndpointSlice, deleted: bool) -> Option<ServiceName> {
        let key = convert::object_key(&obj.metadata);
        let value = if deleted {
            None
        } else {
            convert::endpoint_slice(obj).map(|(_, v)| v)
        };
        let mut i = self.0.inputs.lock().expect("inputs");
        i.saw("endpointslices", &obj.metadata);
        let changed = i.cluster.update_slice(key.clone(), value);
        if changed {
            let t = watch::trigger_time(&obj.metadata).unwrap_or_else(SystemTime::now);
            i.trigger_times.push(t);
            drop(i);
            self.0.request_sync();
        }
        Some(key)
    }
    fn remove(&self, keys: Vec<ServiceName>) {
        let mut i = self.0.inputs.lock().expect("inputs");
        for k in keys {
            i.cluster.update_slice(k, None);
        }
        drop(i);
        self.0.request_sync();
    }
    fn keys(&self) -> Vec<ServiceName> {
        self.0
            .inputs
            .lock()
            .expect("inputs")
            .cluster
            .slices
            .keys()
            .cloned()
            .collect()
    }
    fn synced(&self) {
        self.0.inputs.lock().expect("inputs").slices_synced = true;
        self.0.request_sync();
    }
}

impl Sink<networking::ServiceCIDR> for Cidrs {
    type Key = String;
    fn apply(&self, obj: &networking::ServiceCIDR, deleted: bool) -> Option<String> {
        let (name, value) = convert::service_cidr(obj);
        let changed = self
            .0
            .inputs
            .lock()
            .expect("inputs")
            .cluster
            .update_service_cidr(name.clone(), (!deleted).then_some(value));
        if changed {
            self.0.request_sync();
        }
        Some(name)
    }
    fn remove(&self, keys: Vec<String>) {
        let mut i = self.0.inputs.lock().expect("inputs");
        for k in keys {
            i.cluster.update_service_cidr(k, None);
        }
        drop(i);
        self.0.request_sync();
    }
    fn keys(&self) -> Vec<String> {
        self.0
            .inputs
            .lock()
            .expect("inputs")
            .cluster
            .service_cidrs
            .keys()
            .cloned()
            .collect()
    }
    fn synced(&self) {}
}

impl Sink<core::Node> for NodeSink {
    type Key = String;
    fn apply(&self, obj: &core::Node, deleted: bool) -> Option<String> {
        let node = (!deleted).then(|| convert::node(obj));
        if node.as_ref().is_some_and(|n| n.name != self.1) {
            return None;
        }
        let mut i = self.0.inputs.lock().expect("inputs");
        if i.node != node {
            i.node = node.clone();
            i.node_changed = true;
            drop(i);
            self.0.health.set_node(node);
            self.0.request_sync();
        }
        Some(self.1.clone())
    }
    fn remove(&self, _keys: Vec<String>) {
        let mut i = self.0.inputs.lock().expect("inputs");
        i.node = None;
        i.node_changed = true;
        drop(i);
        self.0.health.set_node(None);
        self.0.request_sync();
    }
    fn keys(&self) -> Vec<String> {
        let i = self.0.inputs.lock().expect("inputs");
        i.node.iter().map(|n| n.name.clone()).collect()
    }
    fn synced(&self) {
        self.0.inputs.lock().expect("inputs").node_synced = true;
        self.0.request_sync();
    }
}

/// What the sync engine keeps between syncs.
struct Engine {
    backend: Box<dyn Backend>,
    desired: Option<DesiredState>,
    config: ProxyConfig,
}

/// `net.ipv4.conf.all.route_localnet`: lets packets with a 127.0.0.0/8 source or
/// destination be routed off the loopback interface, which a localhost NodePort DNATed to a
/// pod needs (kube-proxy sets it for its iptables mode's `localhostNodePorts`).
const ROUTE_LOCALNET: &str = "/proc/sys/net/ipv4/conf/all/route_localnet";

/// Whether `route_localnet` is on in this network namespace (unreadable: taken as off).
fn route_localnet_is_on() -> bool {
    std::fs::read_to_string(ROUTE_LOCALNET).is_ok_and(|v| v.trim() == "1")
}

/// What one sync hands back to the async side.
struct Outcome {
    full: bool,
    cleanup_failed: bool,
    checks: Vec<HealthCheck>,
    health_addresses: Vec<FamilyAddresses>,
    /// Family states to clean conntrack for (UDP endpoint changes).
    conntrack: Vec<desired::FamilyState>,
    trigger_times: Vec<SystemTime>,
    no_local: Vec<(IpFamily, i64, i64)>,
    iptables_rules: Vec<crate::iptables::apply::RuleCount>,
    /// The backend's map fill levels (eBPF mode).
    map_fill: Vec<backend::MapFill>,
    /// [`Inputs::revisions`] as the sync took its input.
    revisions: BTreeMap<&'static str, u64>,
}

impl Engine {
    /// One sync: take the changes, update the desired state, apply. Runs on a blocking
    /// thread (it may wait for `nft`).
    fn sync(&mut self, shared: &Shared, full: bool) -> Result<Outcome, backend::Error> {
        let (changed_ports, conntrack_needed, trigger_times, full, revisions) = {
            let mut i = shared.inputs.lock().expect("inputs");
            let changes = i.cluster.take_changes();
            shared
                .metrics
                .service_changes_total
                .inc_by(changes.service_changes as u64);
            shared
                .metrics
                .endpoint_changes_total
                .inc_by(changes.endpoint_changes as u64);
            let node = i.node.clone().unwrap_or_else(|| Node {
                name: self.config.node_name.clone(),
                ..Default::default()
            });
            let facts = NodeFacts {
                node_ips: node.addresses.clone(),
                local_ips: i.local_ips.clone(),
                default_route_ips: i.default_route_ips.clone(),
            };
            let state_config = StateConfig {
                families: self.config.families.clone(),
                nodeport_addresses: self.config.nodeport_addresses.clone(),
            };
            let view = NodeView {
                name: &self.config.node_name,
                zone: node.zone.as_deref(),
            };
            let mut full = full;
            let changed_ports = match self.desired.as_mut() {
                Some(d) if !full => {
                    if i.node_changed || changes.service_cidrs {
                        // Zones and addresses may change categorization: recompute all.
                        let fresh = desired::build(&i.cluster, view, &facts, &state_config);
                        let ports: BTreeSet<_> = fresh
                            .families
                            .iter()
                            .chain(d.families.iter())
                            .flat_map(|f| f.services.keys().cloned())
                            .collect();
                        *d = fresh;
                        ports
                    } else {
                        d.refresh_node(&i.cluster, &facts, &state_config);
                        d.refresh_services(&i.cluster, view, &changes.services)
                    }
                }
                _ => {
                    self.desired = Some(desired::build(&i.cluster, view, &facts, &state_config));
                    full = true;
                    BTreeSet::new()
                }
            };
            i.node_changed = false;
            let trigger_times = std::mem::take(&mut i.trigger_times);
            (
                changed_ports,
                changes.udp_endpoints_changed,
                trigger_times,
                full,
                i.revisions.clone(),
            )
        };
        let desired = self.desired.as_ref().expect("computed above");
        let report = self.backend.sync(
            desired,
            &self.config.node,
            (!full).then_some(&changed_ports),
        )?;
        // Only once the sync that holds the localnet-check guard is in the kernel: turned on
        // before, a failed sync would leave 127.0.0.0/8 routable from outside, unguarded.
        if self.backend.mode() == ProxyMode::Nftables
            && !self.config.node.route_localnet
            && desired
                .families
                .iter()
                .any(crate::nftables::render::localhost_nodeports)
        {
            // Set once and never reset, as kube-proxy does: another component may rely on it.
            // From now on the guard is rendered whatever --nodeport-addresses selects.
            match std::fs::write(ROUTE_LOCALNET, "1") {
                Ok(()) => {
                    tracing::info!(
                        "set net.ipv4.conf.all.route_localnet=1 for localhost NodePorts \
                         (--nodeport-addresses selects 127.0.0.1); incoming connections to \
                         127.0.0.0/8 are dropped by the localnet-check chain (CVE-2020-8558)"
                    );
                    self.config.node.route_localnet = true;
                }
                Err(e) => tracing::error!(
                    error = %e,
                    "setting net.ipv4.conf.all.route_localnet=1 failed; localhost NodePorts \
                     will not reach pods (retried on the next sync)"
                ),
            }
        }

        let (checks, health_addresses) = crate::health::checks_of(desired);
        let no_local = desired
            .families
            .iter()
            .map(|f| {
                let internal = f
                    .services
                    .values()
                    .filter(|s| s.port.internal_policy_local && s.local_endpoints.is_empty())
                    .count();
                let external = f
                    .services
                    .values()
                    .filter(|s| s.external_policy_local() && s.local_endpoints.is_empty())
                    .count();
                (f.family, internal as i64, external as i64)
            })
            .collect();
        Ok(Outcome {
            full: report.full,
            cleanup_failed: report.cleanup_failed,
            checks,
            health_addresses,
            conntrack: if conntrack_needed {
                desired.families.clone()
            } else {
                Vec::new()
            },
            trigger_times,
            no_local,
            iptables_rules: report.iptables_rules,
            map_fill: self.backend.map_fill(),
            revisions,
        })
    }
}

/// Runs the proxy until `shutdown` completes. Rules are left in place on exit, so that a
/// restarted proxy takes them over without a gap in traffic.
pub async fn run(
    client: kube::Client,
    config: ProxyConfig,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), Error> {
    let backend: Box<dyn Backend> = match config.mode {
        ProxyMode::Nftables => {
            // nf_tables over netlink; `nft` only for the few forms the encoder does not
            // produce.
            let kernel: Box<dyn crate::nftables::apply::Kernel> =
                match crate::nftables::netlink::NetlinkKernel::new(config.nft.clone()) {
                    Ok(k) => Box::new(k),
                    Err(e) => {
                        tracing::warn!(error = %e, "no nf_tables netlink socket; using the nft command");
                        Box::new(config.nft.clone())
                    }
                };
            Box::new(crate::nftables::apply::Applier::new(kernel))
        }
        ProxyMode::Iptables => Box::new(crate::iptables::apply::Applier::new(
            config.iptables.clone(),
        )),
        ProxyMode::Ipvs => return Err(Error::IpvsNotProgrammed),
        ProxyMode::Ebpf => {
            // --masquerade-all and --cluster-cidr mean what they mean in the other modes.
            let mut ebpf = config.ebpf.clone();
            ebpf.render.masquerade_all = config.node.masquerade_all;
            ebpf.render.cluster_cidrs = config.node.cluster_cidrs.clone();
            Box::new(crate::ebpf::dataplane::Dataplane::start(ebpf).map_err(Error::Ebpf)?)
        }
    };
    run_with_backend(client, config, backend, shutdown).await
}

/// [`run`] with a given backend.
pub async fn run_with_backend(
    client: kube::Client,
    config: ProxyConfig,
    backend: Box<dyn Backend>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), Error> {
    let metrics = Arc::new(Metrics::for_mode(backend.mode()));
    let health = Arc::new(ProxyHealth::new(&config.families, config.sync_period * 2));
    let shared = Arc::new(Shared {
        inputs: Mutex::new(Inputs::default()),
        notify: Notify::new(),
        health: health.clone(),
        metrics: metrics.clone(),
        families: config.families.clone(),
    });
    let mut tasks = tokio::task::JoinSet::new();

    // Health and metrics answer on their own tasks, even during a long sync.
    if let Some(addr) = config.healthz_bind_address {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| Error::Bind {
                what: "--healthz-bind-address",
                addr,
                source,
            })?;
        let app = crate::health::router(health.clone(), metrics.clone());
        tasks.spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
    }
    if let Some(addr) = config.metrics_bind_address {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| Error::Bind {
                what: "--metrics-bind-address",
                addr,
                source,
            })?;
        let app = crate::metrics::router(metrics.clone());
        tasks.spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
    }

    // Watchers.
    let s = shared.clone();
    let c = client.clone();
    let h = health.clone();
    tasks.spawn(async move {
        watch::run(
            kube::Api::<core::Service>::all(c),
            watcher::Config::default(),
            Arc::new(Services(s)),
            "services",
            h,
        )
        .await
    });
    let s = shared.clone();
    let c = client.clone();
    let h = health.clone();
    tasks.spawn(async move {
        watch::run(
            kube::Api::<discovery::EndpointSlice>::all(c),
            watcher::Config::default(),
            Arc::new(Slices(s)),
            "endpointslices",
            h,
        )
        .await
    });
    let s = shared.clone();
    let c = client.clone();
    let node_name = config.node_name.clone();
    let h = health.clone();
    tasks.spawn(async move {
        let cfg = watcher::Config::default().fields(&format!("metadata.name={node_name}"));
        watch::run(
            kube::Api::<core::Node>::all(c),
            cfg,
            Arc::new(NodeSink(s, node_name)),
            "node",
            h,
        )
        .await
    });
    // kube-proxy announces itself with an Event about its Node.
    tasks.spawn(crate::events::post_starting(
        client.clone(),
        config.node_name.clone(),
    ));
    // ServiceCIDRs are optional: an API server that does not serve them (404) leaves the
    // unallocated-ClusterIP drop rule out, as kube-proxy does without ServiceCIDR data.
    let s = shared.clone();
    let c = client.clone();
    let h = health.clone();
    tasks.spawn(async move {
        let api = kube::Api::<networking::ServiceCIDR>::all(c);
        let served = match api.list(&kube::api::ListParams::default().limit(1)).await {
            Ok(_) => true,
            // Served but refused (403) is not "not served": the watcher reports the refusal.
            Err(kube::Error::Api(status)) if status.code == 403 => true,
            Err(e) => {
                tracing::info!(error = %e, "ServiceCIDRs not served; not watching them");
                false
            }
        };
        if served {
            watch::run(
                api,
                watcher::Config::default(),
                Arc::new(Cidrs(s)),
                "servicecidrs",
                h,
            )
            .await
        }
    });

    // Node addresses and default routes, re-read every --address-poll-interval (1 s) so
    // that DHCP-style address changes and a moved default route are followed within a
    // sync period, without a restart (reference 004).
    let s = shared.clone();
    let interval = config.address_poll_interval;
    let npa = config.nodeport_addresses.clone();
    tasks.spawn(async move {
        loop {
            match crate::addrs::node_addresses().await {
                Ok(found) => {
                    let mut i = s.inputs.lock().expect("inputs");
                    let first = !i.addrs_synced;
                    if first
                        || i.local_ips != found.local_ips
                        || i.default_route_ips != found.default_route_ips
                    {
                        if !first {
                            tracing::info!(
                                addresses = ?found.local_ips,
                                default_route = ?found.default_route_ips,
                                "node addresses changed"
                            );
                        }
                        log_selection(&npa, &found, i.node.as_ref());
                        i.addrs_synced = true;
                        i.local_ips = found.local_ips;
                        i.default_route_ips = found.default_route_ips;
                        i.node_changed = true;
                        drop(i);
                        s.request_sync();
                    }
                }
                Err(e) => tracing::warn!(error = %e, "listing node addresses failed"),
            }
            tokio::time::sleep(interval).await;
        }
    });

    let mut engine_config = config.clone();
    if route_localnet_is_on() {
        // Left on by an earlier run (or someone else): keep the guard from the first sync.
        tracing::info!(
            "net.ipv4.conf.all.route_localnet is 1: the CVE-2020-8558 guard (nftables \
             localnet-check, iptables KUBE-FIREWALL) is kept whatever --nodeport-addresses \
             selects"
        );
        engine_config.node.route_localnet = true;
    }
    let engine = Arc::new(Mutex::new(Engine {
        backend,
        desired: None,
        config: engine_config,
    }));
    let sync_loop = sync_loop(shared.clone(), engine, config);
    tokio::select! {
        () = sync_loop => {}
        () = shutdown => tracing::info!("shutting down; rules stay in place"),
    }
    tasks.abort_all();
    Ok(())
}

/// Logs what `--nodeport-addresses` selects now that the addresses changed: a CIDR that
/// matches none of them is allowed (reference 004: an address may appear later) but said,
/// as is a `default-route` without a default route.
fn log_selection(
    npa: &NodePortAddresses,
    found: &crate::addrs::NodeAddresses,
    node: Option<&Node>,
) {
    let facts = NodeFacts {
        node_ips: node.map(|n| n.addresses.clone()).unwrap_or_default(),
        local_ips: found.local_ips.clone(),
        default_route_ips: found.default_route_ips.clone(),
    };
    for cidr in npa.unmatched_cidrs(&facts) {
        tracing::info!(
            %cidr,
            "--nodeport-addresses: no node address in this CIDR yet; NodePorts open on it \
             when one appears"
        );
    }
    if npa.uses_default_route() {
        if found.default_route_ips.is_empty() {
            tracing::warn!(
                "--nodeport-addresses default-route: no default route's interface has a \
                 global address (or there is no default route); default-route selects no \
                 address until one does"
            );
        } else {
            tracing::info!(addresses = ?found.default_route_ips, "--nodeport-addresses default-route");
        }
    }
}

/// Reports (or clears, with `None`) a set of the nftables table that is full: in `/healthz`,
/// which then fails, and in `kubeproxy_sync_proxy_rules_nftables_set_full`.
fn report_full_set(shared: &Shared, metrics: &Metrics, full: Option<(IpFamily, String)>) {
    metrics.nftables_set_full.clear();
    match full {
        Some((family, set)) => {
            let mut l = family_label(family);
            l.push(("set".into(), set.clone()));
            metrics.nftables_set_full.get_or_create(&l).set(1);
            tracing::error!(
                family = family.as_str(),
                set,
                "an nftables set is full: syncs are refused, the previous rules stay, until \
                 it has room again"
            );
            let table = crate::nftables::ruleset::nft_family(family);
            shared.health.set_full_set(Some(format!("{table} {set}")));
        }
        None => shared.health.set_full_set(None),
    }
}

async fn sync_loop(shared: Arc<Shared>, engine: Arc<Mutex<Engine>>, config: ProxyConfig) {
    let mut health_servers = ServiceHealthServers::new(shared.health.clone());
    let mut last_start: Option<Instant> = None;
    let mut next_periodic = tokio::time::Instant::now() + config.sync_period;
    let mut next_full = Instant::now() + config.full_sync_period;
    let mut retry_at: Option<tokio::time::Instant> = None;
    let mut backoff = config.min_sync_period.max(Duration::from_millis(500));
    loop {
        let mut periodic = false;
        tokio::select! {
            () = shared.notify.notified() => {}
            () = tokio::time::sleep_until(next_periodic) => periodic = true,
            () = async {
                match retry_at {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            } => retry_at = None,
        }
        {
            let i = shared.inputs.lock().expect("inputs");
            // Nothing reaches the kernel before every input is known: a first sync with a
            // partial view would remove rules a restarted proxy should keep.
            if !(i.services_synced && i.slices_synced && i.node_synced && i.addrs_synced) {
                continue;
            }
        }
        // Rate limit: at most one sync per --min-sync-period.
        if let Some(t) = last_start {
            let earliest = t + config.min_sync_period;
            if Instant::now() < earliest {
                tokio::time::sleep_until(tokio::time::Instant::from_std(earliest)).await;
            }
        }
        last_start = Some(Instant::now());
        if periodic {
            next_periodic = tokio::time::Instant::now() + config.sync_period;
        }
        let due = periodic && Instant::now() >= next_full;
        if due {
            next_full = Instant::now() + config.full_sync_period;
        }
        let started = Instant::now();
        let (e, s) = (engine.clone(), shared.clone());
        let result = tokio::task::spawn_blocking(move || {
            let mut engine = e.lock().expect("engine");
            // Every sync detects drift itself (the nf_tables generation); a kernel interface
            // that cannot tell (the `nft` command) gets a full resync on every period.
            let full = due || (periodic && !engine.backend.detects_drift());
            let partial = !full && !engine.backend.needs_full_sync();
            (partial, engine.sync(&s, full))
        })
        .await;
        let elapsed = started.elapsed().as_secs_f64();
        let metrics = &shared.metrics;
        let (partial, result) = match result {
            Ok((partial, r)) => (partial, Ok(r)),
            Err(join) => (false, Err(join)),
        };
        match result {
            Ok(Ok(outcome)) => {
                backoff = config.min_sync_period.max(Duration::from_millis(500));
                shared.health.updated();
                report_full_set(&shared, metrics, None);
                let now = unix_now();
                for f in &config.families {
                    let l = family_label(*f);
                    metrics.sync_duration.get_or_create(&l).observe(elapsed);
                    if outcome.full {
                        metrics
                            .sync_full_duration
                            .get_or_create(&l)
                            .observe(elapsed);
                    } else {
                        metrics
                            .sync_partial_duration
                            .get_or_create(&l)
                            .observe(elapsed);
                    }
                    metrics.last_sync_timestamp.get_or_create(&l).set(now);
                    for t in &outcome.trigger_times {
                        let d = SystemTime::now().duration_since(*t).unwrap_or_default();
                        metrics
                            .network_programming
                            .get_or_create(&l)
                            .observe(d.as_secs_f64());
                    }
                }
                for rc in &outcome.iptables_rules {
                    let mut l = family_label(rc.family);
                    l.push(("table".into(), rc.table.as_str().into()));
                    metrics
                        .iptables_rules_total
                        .get_or_create(&l)
                        .set(rc.total as i64);
                    metrics
                        .iptables_rules_last
                        .get_or_create(&l)
                        .set(rc.written as i64);
                }
                for (resource, rv) in &outcome.revisions {
                    metrics
                        .synced_resource_version
                        .get_or_create(&vec![("resource".to_string(), (*resource).to_string())])
                        .set(i64::try_from(*rv).unwrap_or(i64::MAX));
                }
                for (f, internal, external) in &outcome.no_local {
                    let mut l = family_label(*f);
                    l.push(("traffic_policy".into(), "internal".into()));
                    metrics.no_local_endpoints.get_or_create(&l).set(*internal);
                    let mut l = family_label(*f);
                    l.push(("traffic_policy".into(), "external".into()));
                    metrics.no_local_endpoints.get_or_create(&l).set(*external);
                }
                if outcome.cleanup_failed {
                    for f in &config.families {
                        metrics
                            .nftables_cleanup_failures
                            .get_or_create(&family_label(*f))
                            .inc();
                    }
                    retry_at = Some(
                        tokio::time::Instant::now() + crate::nftables::apply::STALE_CHAIN_GRACE,
                    );
                }
                for f in &outcome.map_fill {
                    let l = vec![("map".to_string(), f.map.to_string())];
                    metrics
                        .ebpf_map_entries
                        .get_or_create(&l)
                        .set(f.entries as i64);
                    metrics
                        .ebpf_map_capacity
                        .get_or_create(&l)
                        .set(i64::from(f.capacity));
                }
                if !outcome.map_fill.is_empty() {
                    let full = shared.health.set_map_fill(&outcome.map_fill);
                    if !full.is_empty() {
                        tracing::warn!(
                            maps = ?full,
                            percent = crate::health::MAP_FULL_PERCENT,
                            "eBPF maps nearly full; /healthz fails until they empty (raise \
                             the --ebpf-*-map-size flags)"
                        );
                    }
                }
                health_servers.sync(&outcome.checks, &outcome.health_addresses);
                if !outcome.conntrack.is_empty() {
                    let m = shared.metrics.clone();
                    let states = outcome.conntrack;
                    let _ = tokio::task::spawn_blocking(move || {
                        for state in &states {
                            let t = Instant::now();
                            match crate::conntrack::clean_family(state) {
                                Ok(n) => {
                                    let l = family_label(state.family);
                                    m.conntrack_duration
                                        .get_or_create(&l)
                                        .observe(t.elapsed().as_secs_f64());
                                    m.conntrack_deleted.get_or_create(&l).inc_by(n as u64);
                                    if n > 0 {
                                        tracing::info!(
                                            family = state.family.as_str(),
                                            deleted = n,
                                            "cleaned stale UDP conntrack entries"
                                        );
                                    }
                                }
                                Err(e) => tracing::warn!(error = %e, "conntrack clean-up failed"),
                            }
                        }
                    })
                    .await;
                }
                tracing::debug!(full = outcome.full, seconds = elapsed, "synced");
                if outcome.full {
                    // What the full sync built and freed would otherwise stay resident. After
                    // the metrics: returning pages is not part of programming the rules.
                    let _ = tokio::task::spawn_blocking(crate::memory::release_free_memory).await;
                }
            }
            Ok(Err(e)) => {
                for f in &config.families {
                    let l = family_label(*f);
                    match &e {
                        backend::Error::Nftables(_) => {
                            metrics.nftables_sync_failures.get_or_create(&l).inc();
                        }
                        backend::Error::Ebpf(_) => {}
                        backend::Error::Iptables(_) => {
                            metrics.iptables_restore_failures.get_or_create(&l).inc();
                            if partial {
                                metrics
                                    .iptables_partial_restore_failures
                                    .get_or_create(&l)
                                    .inc();
                            }
                        }
                    }
                }
                if let backend::Error::Nftables(
                    crate::nftables::apply::Error::RulesetApplyFailed(
                        crate::nftables::apply::KernelError::SetFull { family, set, .. },
                    ),
                ) = &e
                {
                    report_full_set(&shared, metrics, Some((*family, set.clone())));
                }
                if let backend::Error::Ebpf(_) = &e {
                    metrics.ebpf_sync_failures.inc();
                }
                tracing::error!(error = %e, source = ?std::error::Error::source(&e), retry_in = ?backoff, "sync failed; previous rules stay in place");
                retry_at = Some(tokio::time::Instant::now() + backoff);
                backoff = (backoff * 2).min(config.sync_period);
            }
            Err(join) => {
                tracing::error!(error = %join, "sync task panicked");
                retry_at = Some(tokio::time::Instant::now() + backoff);
            }
        }
        let pending = shared.inputs.lock().expect("inputs").cluster.pending();
        metrics.service_changes_pending.set(pending as i64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(resource_version: Option<&str>) -> ObjectMeta {
        ObjectMeta {
            resource_version: resource_version.map(str::to_owned),
            ..Default::default()
        }
    }

    #[test]
    fn the_newest_resource_version_of_each_watch_is_kept_and_an_opaque_one_is_not_recorded() {
        let mut inputs = Inputs::default();
        inputs.saw("services", &meta(Some("12")));
        // A relist delivers older objects again: the newest stays.
        inputs.saw("services", &meta(Some("7")));
        inputs.saw("endpointslices", &meta(Some("9")));
        inputs.saw("endpointslices", &meta(Some("not-a-number")));
        inputs.saw("endpointslices", &meta(None));
        assert_eq!(
            inputs.revisions,
            BTreeMap::from([("endpointslices", 9), ("services", 12)])
        );
    }
}
