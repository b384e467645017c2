//! Health: the proxy's own `/healthz` and `/livez` (kube-proxy's `proxy_health.go`) and one
//! HTTP server per `externalTrafficPolicy: Local` Service on its `healthCheckNodePort`
//! (`service_health.go`), with kube-proxy's bodies byte for byte.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::body::Body;
use axum::http::{Response, StatusCode};

use crate::metrics::Metrics;
use crate::model::{IpFamily, Node, ServiceName};

/// Sync bookkeeping per family, as kube-proxy's `ProxyHealthServer` keeps it.
#[derive(Debug, Clone, Default)]
struct FamilyHealth {
    last_updated: Option<SystemTime>,
    oldest_pending: Option<SystemTime>,
}

/// Whether the proxy keeps its rules up to date.
#[derive(Debug)]
pub struct ProxyHealth {
    families: Mutex<BTreeMap<IpFamily, FamilyHealth>>,
    node: Mutex<Option<Node>>,
    /// A set of the nftables table that is full (`ip service-endpoints`), refusing syncs.
    full_set: Mutex<Option<String>>,
    /// `2 × --sync-period`: a pending update older than this makes the proxy unhealthy.
    timeout: Duration,
    /// Watched resources the API server refuses to list or watch (403): the rules cannot
    /// follow them, so the proxy is unhealthy until access comes back.
    refused: Mutex<std::collections::BTreeSet<&'static str>>,
    /// eBPF mode: the maps at least [`MAP_FULL_PERCENT`] full, which make `/healthz` fail.
    full_maps: Mutex<Vec<String>>,
}

/// eBPF mode: a map this full (percent of `max_entries`) makes `/healthz` fail, so that load
/// balancers stop sending new Services' traffic to a node that may soon be unable to program
/// them. LRU maps (connections, affinity, socket reverse entries) are left out: they evict
/// rather than refuse, and hold stale entries until the collector runs; their fill is in
/// `nodeport_ebpf_map_entries`.
pub const MAP_FULL_PERCENT: u64 = 90;

impl ProxyHealth {
    /// Health for the given families; unhealthy once an update waits longer than `timeout`.
    pub fn new(families: &[IpFamily], timeout: Duration) -> Self {
        ProxyHealth {
            families: Mutex::new(
                families
                    .iter()
                    .map(|f| (*f, FamilyHealth::default()))
                    .collect(),
            ),
            node: Mutex::new(None),
            full_set: Mutex::new(None),
            timeout,
            refused: Mutex::default(),
            full_maps: Mutex::new(Vec::new()),
        }
    }

    /// A sync was requested (kube-proxy's `QueuedUpdate`): starts the clock if not running.
    pub fn queued_update(&self) {
        let now = SystemTime::now();
        for h in self.families.lock().expect("health lock").values_mut() {
            h.oldest_pending.get_or_insert(now);
        }
    }

    /// A sync succeeded (kube-proxy's `Updated`).
    pub fn updated(&self) {
        let now = SystemTime::now();
        for h in self.families.lock().expect("health lock").values_mut() {
            h.last_updated = Some(now);
            h.oldest_pending = None;
        }
    }

    /// Records that syncs are refused because a set is full (`None`: none is).
    pub fn set_full_set(&self, set: Option<String>) {
        *self.full_set.lock().expect("health lock") = set;
    }

    /// Records the Node object, for `nodeEligible`.
    pub fn set_node(&self, node: Option<Node>) {
        *self.node.lock().expect("health lock") = node;
    }

    /// Records whether the API server refuses the list or watch of `what` (403).
    pub fn set_refused(&self, what: &'static str, refused: bool) {
        let mut set = self.refused.lock().expect("health lock");
        if refused {
            set.insert(what);
        } else {
            set.remove(what);
        }
    }

    fn none_refused(&self) -> bool {
        self.refused.lock().expect("health lock").is_empty()
    }

    /// Records the eBPF maps' fill levels after a sync; returns the maps now too full (see
    /// [`MAP_FULL_PERCENT`]).
    pub fn set_map_fill(&self, fill: &[crate::backend::MapFill]) -> Vec<String> {
        let full: Vec<String> = fill
            .iter()
            .filter(|f| {
                !f.lru
                    && f.capacity > 0
                    && f.entries as u64 * 100 >= u64::from(f.capacity) * MAP_FULL_PERCENT
            })
            .map(|f| f.map.to_string())
            .collect();
        *self.full_maps.lock().expect("health lock") = full.clone();
        full
    }

    /// Healthy: no family has an update pending for longer than the timeout, and every watched
    /// resource may be listed and watched.
    pub fn healthy(&self) -> bool {
        self.healthy_at(SystemTime::now())
    }

    fn healthy_at(&self, now: SystemTime) -> bool {
        self.none_refused()
            && self
                .families
                .lock()
                .expect("health lock")
                .values()
                .all(|h| family_healthy(h, now, self.timeout))
    }

    fn node_eligible(&self) -> bool {
        self.node
            .lock()
            .expect("health lock")
            .as_ref()
            .is_some_and(Node::eligible)
    }

    /// The JSON body kube-proxy sends (`json.Marshal(ProxyHealth)`).
    fn body(&self, with_node: bool) -> (bool, String) {
        let now = SystemTime::now();
        let families = self.families.lock().expect("health lock").clone();
        let mut healthy = self.none_refused()
            && families
                .values()
                .all(|h| family_healthy(h, now, self.timeout));
        let eligible = self.node_eligible();
        if with_node {
            healthy &= eligible;
            healthy &= self.full_maps.lock().expect("health lock").is_empty();
        }
        let full_set = self.full_set.lock().expect("health lock").clone();
        healthy &= full_set.is_none();
        let last = families.values().filter_map(|h| h.last_updated).max();
        // On success kube-proxy reports "now" as lastUpdated.
        let last_updated = if healthy { Some(now) } else { last };
        // Field order is Go's struct order (json.Marshal), which serde_json's map would sort.
        let mut body = format!(
            "{{\"lastUpdated\":{},\"currentTime\":{}",
            time_json(last_updated),
            time_json(Some(now))
        );
        if with_node {
            body.push_str(&format!(",\"nodeEligible\":{eligible}"));
        }
        body.push_str(&format!(",\"healthy\":{healthy}"));
        if !families.is_empty() {
            let status: Vec<String> = families
                .iter()
                .map(|(f, h)| {
                    format!(
                        "\"{}\":{{\"lastUpdated\":{},\"healthy\":{}}}",
                        f.as_str(),
                        time_json(h.last_updated),
                        family_healthy(h, now, self.timeout)
                    )
                })
                .collect();
            body.push_str(&format!(",\"status\":{{{}}}", status.join(",")));
        }
        if let Some(set) = full_set {
            // Ours, only while it happens: kube-proxy's body is unchanged otherwise.
            body.push_str(&format!(",\"fullSet\":{}", serde_json::Value::from(set)));
        }
        body.push('}');
        (healthy, body)
    }
}

fn family_healthy(h: &FamilyHealth, now: SystemTime, timeout: Duration) -> bool {
    match h.oldest_pending {
        Some(t) => now.duration_since(t).unwrap_or_default() <= timeout,
        None => true,
    }
}

/// Go's zero `time.Time` marshals as `0001-01-01T00:00:00Z`.
fn time_json(t: Option<SystemTime>) -> String {
    match t.and_then(|t| jiff::Timestamp::try_from(t).ok()) {
        Some(ts) => format!("\"{ts}\""),
        None => "\"0001-01-01T00:00:00Z\"".to_string(),
    }
}

fn json_response(
    code: StatusCode,
    body: String,
    extra: Option<(&'static str, String)>,
) -> Response<Body> {
    let mut b = Response::builder()
        .status(code)
        .header("Content-Type", "application/json")
        .header("X-Content-Type-Options", "nosniff");
    if let Some((k, v)) = extra {
        b = b.header(k, v);
    }
    b.body(Body::from(body)).expect("valid response")
}

/// `/healthz` and `/livez` on `--healthz-bind-address`.
pub fn router(health: Arc<ProxyHealth>, metrics: Arc<Metrics>) -> axum::Router {
    let handler = move |with_node: bool| {
        let health = health.clone();
        let metrics = metrics.clone();
        move || {
            let health = health.clone();
            let metrics = metrics.clone();
            async move {
                let (ok, body) = health.body(with_node);
                let code = if ok {
                    StatusCode::OK
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                };
                let label = vec![("code".to_string(), code.as_u16().to_string())];
                if with_node {
                    metrics.healthz_total.get_or_create(&label).inc();
                } else {
                    metrics.livez_total.get_or_create(&label).inc();
                }
                json_response(code, body, None)
            }
        }
    };
    axum::Router::new()
        .route("/healthz", axum::routing::get(handler(true)))
        .route("/livez", axum::routing::get(handler(false)))
}

/// kube-proxy's service health body: `%q` for namespace and name, tab indentation, no
/// trailing newline.
pub fn service_health_body(service: &ServiceName, local_endpoints: usize, healthy: bool) -> String {
    format!(
        "{{\n\t\"service\": {{\n\t\t\"namespace\": {},\n\t\t\"name\": {}\n\t}},\n\t\"localEndpoints\": {local_endpoints},\n\t\"serviceProxyHealthy\": {healthy}\n}}",
        go_quote(&service.namespace),
        go_quote(&service.name)
    )
}

/// Go's `%q` for the characters Kubernetes names can hold (DNS labels): plain quoting, with
/// `"` and `\` escaped for anything else.
fn go_quote(s: &str) -> String {
    serde_json::Value::from(s).to_string()
}

/// One health-check node port to serve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthCheck {
    /// The Service.
    pub service: ServiceName,
    /// `spec.healthCheckNodePort`.
    pub port: u16,
    /// The family whose NodePort addresses serve this check and whose endpoints it counts.
    pub family: IpFamily,
    /// Ready, non-terminating local endpoint IPs of that family.
    pub local_endpoints: usize,
}

/// Where one family's health-check servers listen: its NodePort addresses, or (empty) every
/// address of the family (`--nodeport-addresses` matching all).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct FamilyAddresses {
    /// The family.
    pub family: IpFamily,
    /// Its addresses; empty: the family's unspecified address.
    pub addresses: Vec<IpAddr>,
}

/// The health checks a desired state asks for, per family, and where each family's are
/// served. Per family as kube-proxy's proxier of each family serves its own; a Service's
/// ports share its health check (the largest count of them).
pub fn checks_of(
    desired: &crate::desired::DesiredState,
) -> (Vec<HealthCheck>, Vec<FamilyAddresses>) {
    let mut checks: Vec<HealthCheck> = Vec::new();
    for fam in &desired.families {
        for svc in fam.services.values() {
            let Some(port) = svc.port.health_check_node_port else {
                continue;
            };
            match checks
                .iter_mut()
                .find(|c| c.port == port && c.family == fam.family)
            {
                Some(c) => c.local_endpoints = c.local_endpoints.max(svc.local_ready_ips),
                None => checks.push(HealthCheck {
                    service: svc.name().service(),
                    port,
                    family: fam.family,
                    local_endpoints: svc.local_ready_ips,
                }),
            }
        }
    }
    let addresses = desired
        .families
        .iter()
        .map(|f| FamilyAddresses {
            family: f.family,
            addresses: match &f.nodeport_ips {
                crate::nodeaddr::Selection::MatchAll => Vec::new(),
                crate::nodeaddr::Selection::Ips(ips) => ips.iter().copied().collect(),
            },
        })
        .collect();
    (checks, addresses)
}

/// What one listener answers for: a port in a family.
type CheckKey = (IpFamily, u16);

/// The per-Service health-check servers, started and stopped as Services come and go.
///
/// One per family, as kube-proxy runs one proxier (with its own `ServiceHealthServer`) per
/// family: a dual-stack node answers on its IPv4 addresses with the IPv4 endpoints it hosts
/// and on its IPv6 addresses with the IPv6 ones, so that an IPv4 load balancer is told 503 by
/// a node whose IPv4 traffic would be dropped for want of a local IPv4 endpoint, whatever its
/// IPv6 endpoints.
pub struct ServiceHealthServers {
    health: Arc<ProxyHealth>,
    counts: Arc<Mutex<BTreeMap<CheckKey, (ServiceName, usize)>>>,
    servers: BTreeMap<(CheckKey, Vec<IpAddr>), tokio::task::JoinHandle<()>>,
}

/// A listening socket on `bind`; an IPv6 wildcard is IPv6 only, so that it and the IPv4
/// wildcard of the same port can both exist (each family's server counts its own endpoints).
fn listen(bind: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, SockaddrStorage, sockopt};
    let family = if bind.is_ipv6() {
        AddressFamily::Inet6
    } else {
        AddressFamily::Inet
    };
    let fd = socket::socket(
        family,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    socket::setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    if bind.is_ipv6() {
        socket::setsockopt(&fd, sockopt::Ipv6V6Only, &true)?;
    }
    socket::bind(
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        &SockaddrStorage::from(bind),
    )?;
    socket::listen(
        &fd,
        socket::Backlog::new(128).map_err(std::io::Error::from)?,
    )?;
    tokio::net::TcpListener::from_std(std::net::TcpListener::from(fd))
}

impl ServiceHealthServers {
    /// No servers yet.
    pub fn new(health: Arc<ProxyHealth>) -> Self {
        ServiceHealthServers {
            health,
            counts: Arc::new(Mutex::new(BTreeMap::new())),
            servers: BTreeMap::new(),
        }
    }

    /// Ports currently served (in any family).
    pub fn ports(&self) -> Vec<u16> {
        let ports: std::collections::BTreeSet<u16> =
            self.servers.keys().map(|((_, p), _)| *p).collect();
        ports.into_iter().collect()
    }

    /// Makes the servers match `checks`, each listening on its family's `addresses`. Must
    /// run inside a tokio runtime.
    pub fn sync(&mut self, checks: &[HealthCheck], addresses: &[FamilyAddresses]) {
        {
            let mut counts = self.counts.lock().expect("health lock");
            counts.clear();
            for c in checks {
                counts.insert((c.family, c.port), (c.service.clone(), c.local_endpoints));
            }
        }
        let wanted: BTreeMap<(CheckKey, Vec<IpAddr>), ()> = checks
            .iter()
            .map(|c| {
                let addrs = addresses
                    .iter()
                    .find(|a| a.family == c.family)
                    .map(|a| a.addresses.clone())
                    .unwrap_or_default();
                (((c.family, c.port), addrs), ())
            })
            .collect();
        self.servers.retain(|key, handle| {
            let keep = wanted.contains_key(key);
            if !keep {
                handle.abort();
            }
            keep
        });
        for (key, ()) in wanted {
            if self.servers.contains_key(&key) {
                continue;
            }
            let ((family, port), addrs) = key.clone();
            let binds: Vec<SocketAddr> = if addrs.is_empty() {
                let any: IpAddr = match family {
                    IpFamily::V4 => std::net::Ipv4Addr::UNSPECIFIED.into(),
                    IpFamily::V6 => std::net::Ipv6Addr::UNSPECIFIED.into(),
                };
                vec![SocketAddr::new(any, port)]
            } else {
                addrs.iter().map(|ip| SocketAddr::new(*ip, port)).collect()
            };
            let counts = self.counts.clone();
            let health = self.health.clone();
            let handle = tokio::spawn(async move {
                let mut tasks = Vec::new();
                for bind in binds {
                    let listener = match listen(bind) {
                        Ok(l) => l,
                        Err(e) => {
                            // kube-proxy records a FailedToStartServiceHealthcheck event.
                            tracing::warn!(%bind, error = %e, "failed to start service health check server");
                            continue;
                        }
                    };
                    let counts = counts.clone();
                    let health = health.clone();
                    let app = axum::Router::new().fallback(move || {
                        let counts = counts.clone();
                        let health = health.clone();
                        async move {
                            let entry = counts
                                .lock()
                                .expect("health lock")
                                .get(&(family, port))
                                .cloned();
                            let Some((service, n)) = entry else {
                                return Response::builder()
                                    .status(StatusCode::NOT_FOUND)
                                    .body(Body::empty())
                                    .expect("valid response");
                            };
                            let healthy = health.healthy();
                            let code = if n != 0 && healthy {
                                StatusCode::OK
                            } else {
                                StatusCode::SERVICE_UNAVAILABLE
                            };
                            json_response(
                                code,
                                service_health_body(&service, n, healthy),
                                Some(("X-Load-Balancing-Endpoint-Weight", n.to_string())),
                            )
                        }
                    });
                    tasks.push(tokio::spawn(async move {
                        let _ = axum::serve(listener, app).await;
                    }));
                }
                // Keep the listeners' tasks tied to this one: aborting it stops them.
                let _guard = AbortOnDrop(tasks);
                std::future::pending::<()>().await;
            });
            self.servers.insert(key, handle);
        }
    }
}

impl Drop for ServiceHealthServers {
    fn drop(&mut self) {
        for h in self.servers.values() {
            h.abort();
        }
    }
}

struct AbortOnDrop(Vec<tokio::task::JoinHandle<()>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_nftables_set_makes_healthz_fail_and_names_the_set_until_cleared() {
        let h = ProxyHealth::new(&[IpFamily::V4], Duration::from_secs(60));
        h.updated();
        assert!(
            !h.body(false).1.contains("fullSet"),
            "kube-proxy's body otherwise"
        );
        h.set_full_set(Some("ip service-endpoints".into()));
        let (ok, body) = h.body(false);
        assert!(!ok);
        assert!(
            body.ends_with(",\"fullSet\":\"ip service-endpoints\"}"),
            "{body}"
        );
        h.set_full_set(None);
        assert!(h.body(false).0);
    }

    #[test]
    fn service_health_body_is_kube_proxys_to_the_byte() {
        let body = service_health_body(&ServiceName::new("ns2", "svc2"), 1, true);
        assert_eq!(
            body,
            "{\n\t\"service\": {\n\t\t\"namespace\": \"ns2\",\n\t\t\"name\": \"svc2\"\n\t},\n\t\"localEndpoints\": 1,\n\t\"serviceProxyHealthy\": true\n}"
        );
        // The nmap fingerprint of a real kube-proxy answer is 127 bytes long.
        let nmap = service_health_body(&ServiceName::new("default", "wp-nginx-service"), 1, true);
        assert_eq!(nmap.len(), 127);
    }

    #[test]
    fn a_pending_update_older_than_the_timeout_is_unhealthy() {
        let h = ProxyHealth::new(&[IpFamily::V4], Duration::from_secs(60));
        assert!(h.healthy());
        h.queued_update();
        assert!(h.healthy());
        assert!(!h.healthy_at(SystemTime::now() + Duration::from_secs(61)));
        h.updated();
        assert!(h.healthy_at(SystemTime::now() + Duration::from_secs(61)));
    }

    #[test]
    fn a_refused_watch_makes_the_proxy_unhealthy_until_it_is_allowed_again() {
        let h = ProxyHealth::new(&[IpFamily::V4], Duration::from_secs(60));
        h.set_refused("services", true);
        assert!(!h.healthy());
        assert!(h.body(false).1.contains("\"healthy\":false"));
        h.set_refused("services", false);
        assert!(h.healthy());
    }

    #[test]
    fn healthz_needs_an_eligible_node_and_livez_does_not() {
        let h = ProxyHealth::new(&[IpFamily::V4], Duration::from_secs(60));
        let (ok, body) = h.body(true);
        assert!(!ok, "{body}");
        assert!(body.contains("\"nodeEligible\":false"), "{body}");
        assert!(h.body(false).0);
        h.set_node(Some(Node {
            name: "n".into(),
            ..Default::default()
        }));
        let (ok, body) = h.body(true);
        assert!(ok, "{body}");
        assert!(
            body.contains(
                "\"status\":{\"IPv4\":{\"lastUpdated\":\"0001-01-01T00:00:00Z\",\"healthy\":true}}"
            ),
            "{body}"
        );
    }

    #[test]
    fn healthz_fails_while_a_non_lru_ebpf_map_is_90_percent_full_and_livez_does_not() {
        use crate::backend::MapFill;
        let h = ProxyHealth::new(&[IpFamily::V4], Duration::from_secs(60));
        h.set_node(Some(Node {
            name: "n".into(),
            ..Default::default()
        }));
        let fill = |map, entries, lru| MapFill {
            map,
            entries,
            capacity: 100,
            lru,
        };
        // 89 of 100, and a full LRU map: healthy.
        let full = h.set_map_fill(&[fill("np_services", 89, false), fill("np_ct", 100, true)]);
        assert!(full.is_empty());
        assert!(h.body(true).0);
        // 90 of 100: unhealthy, and said which.
        let full = h.set_map_fill(&[fill("np_services", 90, false), fill("np_ct", 3, true)]);
        assert_eq!(full, vec!["np_services".to_string()]);
        let (ok, body) = h.body(true);
        assert!(!ok, "{body}");
        assert!(body.contains("\"healthy\":false"), "{body}");
        assert!(h.body(false).0, "livez is not about the maps");
        // Emptied again: healthy.
        h.set_map_fill(&[fill("np_services", 10, false)]);
        assert!(h.body(true).0);
    }

    async fn get(port: u16) -> (u16, String) {
        get_at("127.0.0.1".parse().unwrap(), port).await
    }

    async fn get_at(ip: IpAddr, port: u16) -> (u16, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        for _ in 0..50 {
            if let Ok(mut c) = tokio::net::TcpStream::connect((ip, port)).await {
                // Before the server listens, a connect to an ephemeral port can meet itself
                // (TCP simultaneous open) and read back its own request: not an answer.
                if c.local_addr().ok() == c.peer_addr().ok() {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
                c.write_all(b"GET /anything HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    .await
                    .unwrap();
                let mut out = String::new();
                c.read_to_string(&mut out).await.unwrap();
                let code = out[9..12].parse().unwrap();
                let body = out.split("\r\n\r\n").nth(1).unwrap_or_default().to_string();
                return (code, body);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("health check port {ip} {port} never answered");
    }

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    #[tokio::test]
    async fn health_check_node_port_answers_200_with_local_endpoints_and_503_without() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let health = Arc::new(ProxyHealth::new(&[IpFamily::V4], Duration::from_secs(60)));
        let mut servers = ServiceHealthServers::new(health);
        let svc = ServiceName::new("ns2", "svc2");
        let local = [FamilyAddresses {
            family: IpFamily::V4,
            addresses: vec!["127.0.0.1".parse().unwrap()],
        }];
        servers.sync(
            &[HealthCheck {
                service: svc.clone(),
                port,
                family: IpFamily::V4,
                local_endpoints: 1,
            }],
            &local,
        );
        let (code, body) = get(port).await;
        assert_eq!(code, 200);
        assert_eq!(body, service_health_body(&svc, 1, true));
        servers.sync(
            &[HealthCheck {
                service: svc.clone(),
                port,
                family: IpFamily::V4,
                local_endpoints: 0,
            }],
            &local,
        );
        let (code, body) = get(port).await;
        assert_eq!(code, 503);
        assert!(body.contains("\"localEndpoints\": 0"), "{body}");
        servers.sync(&[], &local);
        assert!(servers.ports().is_empty());
    }

    /// A dual-stack Local Service whose node hosts an IPv6 endpoint and no IPv4 one: the
    /// IPv4 check counts 0 (a black-box review found it answering 1 on the IPv4 address,
    /// the IPv6 endpoint's count, while IPv4 NodePort traffic was dropped).
    #[test]
    fn each_familys_check_counts_only_that_familys_local_endpoints() {
        let yaml = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  type: NodePort
  clusterIP: 10.96.0.10
  clusterIPs: [10.96.0.10, "fd00:96::10"]
  ipFamilies: [IPv4, IPv6]
  externalTrafficPolicy: Local
  healthCheckNodePort: 32000
  ports: [{port: 80, targetPort: 8080, nodePort: 30080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-4, namespace: default, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{port: 8080}]
endpoints:
- {addresses: [10.244.2.1], nodeName: node-b}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-6, namespace: default, labels: {kubernetes.io/service-name: web}}
addressType: IPv6
ports: [{port: 8080}]
endpoints:
- {addresses: ["fd00:244::1"], nodeName: node-a}
- {addresses: ["fd00:244::2"], nodeName: node-b}
"#;
        let cluster = crate::objects::load(yaml).expect("fixture parses").cluster;
        let facts = crate::nodeaddr::NodeFacts {
            node_ips: vec![
                "192.0.2.10".parse().unwrap(),
                "2001:db8::10".parse().unwrap(),
            ],
            local_ips: vec![
                "192.0.2.10".parse().unwrap(),
                "2001:db8::10".parse().unwrap(),
            ],
            ..Default::default()
        };
        let state = crate::desired::StateConfig {
            families: IpFamily::ALL.to_vec(),
            ..Default::default()
        };
        let desired = crate::desired::build(
            &cluster,
            crate::desired::NodeView::named("node-a"),
            &facts,
            &state,
        );
        let (checks, addresses) = checks_of(&desired);
        let counts: Vec<(IpFamily, u16, usize)> = checks
            .iter()
            .map(|c| (c.family, c.port, c.local_endpoints))
            .collect();
        assert_eq!(counts, [(IpFamily::V4, 32000, 0), (IpFamily::V6, 32000, 1)]);
        assert_eq!(
            addresses,
            [
                FamilyAddresses {
                    family: IpFamily::V4,
                    addresses: vec!["192.0.2.10".parse().unwrap()],
                },
                FamilyAddresses {
                    family: IpFamily::V6,
                    addresses: vec!["2001:db8::10".parse().unwrap()],
                },
            ]
        );
    }

    /// kube-proxy runs a proxier, and so a service health server, per family: on a
    /// dual-stack node each family's addresses answer with that family's local endpoints
    /// (an IPv4 load balancer must hear 503 from a node without a local IPv4 endpoint, even
    /// if it hosts an IPv6 one). Both with explicit addresses and with every address (the
    /// IPv4 and IPv6 wildcards of one port side by side).
    #[tokio::test]
    async fn a_dual_stack_health_check_counts_each_familys_endpoints_on_its_own_addresses() {
        let health = Arc::new(ProxyHealth::new(
            &[IpFamily::V4, IpFamily::V6],
            Duration::from_secs(60),
        ));
        let svc = ServiceName::new("default", "web");
        let checks = |port| {
            [
                HealthCheck {
                    service: svc.clone(),
                    port,
                    family: IpFamily::V4,
                    local_endpoints: 0,
                },
                HealthCheck {
                    service: svc.clone(),
                    port,
                    family: IpFamily::V6,
                    local_endpoints: 2,
                },
            ]
        };
        let (v4, v6): (IpAddr, IpAddr) = ("127.0.0.1".parse().unwrap(), "::1".parse().unwrap());
        for addresses in [
            [
                FamilyAddresses {
                    family: IpFamily::V4,
                    addresses: vec![v4],
                },
                FamilyAddresses {
                    family: IpFamily::V6,
                    addresses: vec![v6],
                },
            ],
            [
                FamilyAddresses {
                    family: IpFamily::V4,
                    addresses: Vec::new(),
                },
                FamilyAddresses {
                    family: IpFamily::V6,
                    addresses: Vec::new(),
                },
            ],
        ] {
            let port = free_port();
            let mut servers = ServiceHealthServers::new(health.clone());
            servers.sync(&checks(port), &addresses);
            let (code, body) = get_at(v4, port).await;
            assert_eq!(
                (code, body),
                (503, service_health_body(&svc, 0, true)),
                "{addresses:?}"
            );
            let (code, body) = get_at(v6, port).await;
            assert_eq!(
                (code, body),
                (200, service_health_body(&svc, 2, true)),
                "{addresses:?}"
            );
            assert_eq!(servers.ports(), vec![port]);
        }
    }
}
