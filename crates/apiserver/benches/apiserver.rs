//! API server benchmark over real HTTP on loopback, with the on-disk store (every write fsynced):
//! Service creates per second and latency with 1, 8 and 64 concurrent clients, a list of 10,000
//! Services, and 100 watchers receiving every event; `-- rbac`: creates/s with 8 clients
//! authorized by RBAC (1,000 RoleBindings and 100 ClusterRoleBindings to look through) against
//! AlwaysAllow, in the same run; `-- managed`: the CPU time of the field manager alone
//! (`metadata.managedFields` of an update, and a server-side apply) per Service write.
//!
//! `cargo bench -p nodeport-apiserver --bench apiserver` (figures in docs/BENCHMARKS.md).
//! Client and server share the machine's cores, as they would on one node.

use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use nodeport_apiserver::{Config, PortRange};

type HttpClient = Client<HttpConnector, Full<Bytes>>;

fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

fn service(name: &str, node_port: bool) -> String {
    let kind = if node_port { "NodePort" } else { "ClusterIP" };
    format!(
        r#"{{"apiVersion":"v1","kind":"Service","metadata":{{"name":"{name}","labels":{{"app":"bench"}}}},"spec":{{"type":"{kind}","selector":{{"app":"bench"}},"ports":[{{"port":80}}]}}}}"#
    )
}

/// The bearer token the `rbac` section's clients send (a user outside `system:masters`).
const BENCH_TOKEN: &str = "bench-token-0123456789abcdef";

async fn request(client: &HttpClient, method: &str, url: &str, body: String) -> (u16, Bytes) {
    request_as(client, method, url, body, None).await
}

/// A request with `token` as its bearer token, if given.
async fn request_as(
    client: &HttpClient,
    method: &str,
    url: &str,
    body: String,
    token: Option<&str>,
) -> (u16, Bytes) {
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(url)
        .header("content-type", "application/json");
    if let Some(token) = token {
        req = req.header("authorization", format!("Bearer {token}"));
    }
    let req = req.body(Full::new(Bytes::from(body))).unwrap();
    let resp = client.request(req).await.expect("request");
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    (status, body)
}

/// The writer's counters from `/metrics`: (batches, mutations, commit seconds).
async fn writer_counters(base: &str) -> (f64, f64, f64) {
    let (_, body) = request(&client(), "GET", &format!("{base}/metrics"), String::new()).await;
    let text = String::from_utf8_lossy(&body);
    let read = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (
        read("nodeport_apiserver_storage_batches_total "),
        read("nodeport_apiserver_storage_mutations_total "),
        read("nodeport_apiserver_storage_commit_seconds_total "),
    )
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// Creates `total` Services in `namespace` from `clients` concurrent clients.
async fn creates(
    base: &str,
    namespace: &str,
    prefix: &str,
    clients: usize,
    total: usize,
) -> (f64, Duration, Duration) {
    creates_as(base, namespace, prefix, clients, total, None).await
}

/// [`creates`], each request with `token` as its bearer token.
async fn creates_as(
    base: &str,
    namespace: &str,
    prefix: &str,
    clients: usize,
    total: usize,
    token: Option<&'static str>,
) -> (f64, Duration, Duration) {
    let url = format!("{base}/api/v1/namespaces/{namespace}/services");
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let (url, next, prefix) = (url.clone(), next.clone(), prefix.to_owned());
            tokio::spawn(async move {
                let http = client();
                let mut latencies = Vec::new();
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= total {
                        return latencies;
                    }
                    let t = Instant::now();
                    let (status, body) = request_as(
                        &http,
                        "POST",
                        &url,
                        service(&format!("{prefix}-{i}"), true),
                        token,
                    )
                    .await;
                    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
                    latencies.push(t.elapsed());
                }
            })
        })
        .collect();
    let mut latencies = Vec::new();
    for t in tasks {
        latencies.extend(t.await.unwrap());
    }
    let elapsed = start.elapsed();
    latencies.sort();
    (
        total as f64 / elapsed.as_secs_f64(),
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
    )
}

async fn create_namespace(base: &str, name: &str) {
    let (status, _) = request(
        &client(),
        "POST",
        &format!("{base}/api/v1/namespaces"),
        format!(r#"{{"apiVersion":"v1","kind":"Namespace","metadata":{{"name":"{name}"}}}}"#),
    )
    .await;
    assert_eq!(status, 201);
}

#[tokio::main]
async fn main() {
    // `cargo bench` passes `--bench`; any other argument picks sections by name
    // (`creates`, `list`, `rbac`, `watch`), e.g. `cargo bench ... -- watch`.
    let picked: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let run = |section: &str| picked.is_empty() || picked.iter().any(|p| p == section);
    let dir = tempfile::tempdir().unwrap();
    let config = Config {
        // Widened so 25,000 NodePort Services fit.
        node_port_range: PortRange::parse("20000-59999").unwrap(),
        data_dir: dir.path().to_path_buf(),
        ..Config::default()
    };
    let state = nodeport_apiserver::open(&config).await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(nodeport_apiserver::serve(
        state,
        listener,
        std::future::pending(),
    ));

    if run("managed") {
        managed_fields();
    }

    if run("creates") {
        println!("## creates (NodePort Services, fsync per batch, on-disk redb)");
        println!(
            "| clients | creates | creates/s | p50 | p99 | requests per commit | commit time |"
        );
        println!("| --- | --- | --- | --- | --- | --- | --- |");
        for (clients, total) in [(1, 500), (8, 4000), (64, 8000)] {
            let ns = format!("c{clients}");
            create_namespace(&base, &ns).await;
            let before = writer_counters(&base).await;
            let (rate, p50, p99) = creates(&base, &ns, "svc", clients, total).await;
            let after = writer_counters(&base).await;
            let batches = after.0 - before.0;
            println!(
                "| {clients} | {total} | {rate:.0} | {:.2} ms | {:.2} ms | {:.1} | {:.2} ms |",
                p50.as_secs_f64() * 1e3,
                p99.as_secs_f64() * 1e3,
                (after.1 - before.1) / batches,
                (after.2 - before.2) / batches * 1e3,
            );
        }
    }

    let http = client();
    if run("list") {
        create_namespace(&base, "list").await;
        creates(&base, "list", "l", 64, 10_000).await;
        let mut times = Vec::new();
        for _ in 0..5 {
            let t = Instant::now();
            let (status, body) = request(
                &http,
                "GET",
                &format!("{base}/api/v1/namespaces/list/services"),
                String::new(),
            )
            .await;
            assert_eq!(status, 200);
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(v["items"].as_array().unwrap().len(), 10_000);
            times.push(t.elapsed());
        }
        times.sort();
        let mut paged = Vec::new();
        for _ in 0..3 {
            let t = Instant::now();
            let mut url = format!("{base}/api/v1/namespaces/list/services?limit=500");
            let mut count = 0;
            loop {
                let (_, body) = request(&http, "GET", &url, String::new()).await;
                let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
                count += v["items"].as_array().unwrap().len();
                match v["metadata"]["continue"].as_str() {
                    Some(token) => {
                        url = format!(
                            "{base}/api/v1/namespaces/list/services?limit=500&continue={token}"
                        )
                    }
                    None => break,
                }
            }
            assert_eq!(count, 10_000);
            paged.push(t.elapsed());
        }
        paged.sort();
        println!();
        println!("## list of 10,000 Services");
        println!("| request | median |");
        println!("| --- | --- |");
        println!("| one LIST | {:.0} ms |", times[2].as_secs_f64() * 1e3);
        println!(
            "| pages of 500 (limit/continue) | {:.0} ms |",
            paged[1].as_secs_f64() * 1e3
        );
    }

    if run("rbac") {
        rbac(dir.path()).await;
    }
    if !run("watch") {
        return;
    }
    // 100 watchers, each must receive every ADDED event.
    create_namespace(&base, "watch").await;
    let (_, body) = request(
        &http,
        "GET",
        &format!("{base}/api/v1/namespaces/watch/services"),
        String::new(),
    )
    .await;
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let rv = v["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_owned();
    const WATCHERS: usize = 100;
    const EVENTS: usize = 2000;
    let mut watchers = Vec::new();
    for _ in 0..WATCHERS {
        let url =
            format!("{base}/api/v1/namespaces/watch/services?watch=true&resourceVersion={rv}");
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        watchers.push((
            tokio::spawn(async move {
                let http = client();
                let req = hyper::Request::get(url)
                    .body(Full::new(Bytes::new()))
                    .unwrap();
                let resp = http.request(req).await.unwrap();
                let _ = ready_tx.send(());
                let mut body = resp.into_body();
                let mut seen = 0;
                let mut carry = Vec::new();
                while seen < EVENTS {
                    let frame = body.frame().await.unwrap().unwrap();
                    if let Ok(data) = frame.into_data() {
                        carry.extend_from_slice(&data);
                        while let Some(pos) = carry.iter().position(|b| *b == b'\n') {
                            let line: Vec<u8> = carry.drain(..=pos).collect();
                            if line.windows(7).any(|w| w == b"\"ADDED\"") {
                                seen += 1;
                            }
                        }
                    }
                }
                Instant::now()
            }),
            ready_rx,
        ));
    }
    let mut handles = Vec::new();
    for (handle, ready) in watchers {
        ready.await.unwrap();
        handles.push(handle);
    }
    let start = Instant::now();
    let before = writer_counters(&base).await;
    let (rate, _, _) = creates(&base, "watch", "w", 8, EVENTS).await;
    let after = writer_counters(&base).await;
    let writes_done = Instant::now();
    let mut last = writes_done;
    for h in handles {
        last = last.max(h.await.unwrap());
    }
    let delivered = (WATCHERS * EVENTS) as f64 / (last - start).as_secs_f64();
    println!();
    println!("## 100 watchers, {EVENTS} creates (8 clients)");
    println!(
        "| creates/s while watched | events delivered/s (all watchers) | last watcher done after last write | requests per commit | commit time |"
    );
    println!("| --- | --- | --- | --- | --- |");
    let batches = after.0 - before.0;
    println!(
        "| {rate:.0} | {delivered:.0} | {:.0} ms | {:.1} | {:.2} ms |",
        (last - writes_done).as_secs_f64() * 1e3,
        (after.1 - before.1) / batches,
        (after.2 - before.2) / batches * 1e3,
    );
}

/// A server over its own on-disk store in `dir`, with the bench user's token; `modes` are its
/// `--authorization-mode`. Returns its base URL.
async fn token_server(
    dir: &std::path::Path,
    modes: Vec<nodeport_apiserver::authz::Mode>,
) -> (String, nodeport_apiserver::authz::Authorizer) {
    std::fs::create_dir_all(dir).unwrap();
    let tokens = dir.join("tokens.csv");
    std::fs::write(&tokens, format!("{BENCH_TOKEN},bench,1\n")).unwrap();
    let config = Config {
        node_port_range: PortRange::parse("20000-59999").unwrap(),
        data_dir: dir.to_path_buf(),
        token_auth_file: Some(tokens),
        authorization_modes: Some(modes),
        ..Config::default()
    };
    let security = nodeport_apiserver::Security::load(&config).unwrap();
    let state = nodeport_apiserver::open(&config).await.unwrap();
    let authorizer = state.authorizer.clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(nodeport_apiserver::serve_secured(
        state,
        listener,
        security,
        std::future::pending(),
    ));
    (base, authorizer)
}

/// `-- rbac`: 8 clients creating NodePort Services as user `bench` (token, not in
/// `system:masters`), on a server under `AlwaysAllow` and one under `RBAC` whose policy holds
/// 1,000 RoleBindings in the namespace written to and 100 ClusterRoleBindings, none for
/// `bench` but the last RoleBinding (`edit`) looked at; rounds alternate between the servers.
async fn rbac(dir: &std::path::Path) {
    use nodeport_apiserver::authz::Mode;
    let (allow, _) = token_server(&dir.join("allow"), vec![Mode::AlwaysAllow]).await;
    let (rbac, authorizer) = token_server(&dir.join("rbac"), vec![Mode::Rbac]).await;
    let http = client();
    for base in [&allow, &rbac] {
        create_namespace(base, "bench").await;
    }
    // The policy, written by the local administrator (no token).
    let post = |path: String, body: String| {
        let (http, url) = (http.clone(), format!("{rbac}{path}"));
        async move {
            let (status, body) = request(&http, "POST", &url, body).await;
            assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
        }
    };
    for i in 0..1000 {
        post(
            "/apis/rbac.authorization.k8s.io/v1/namespaces/bench/rolebindings".into(),
            format!(
                r#"{{"apiVersion":"rbac.authorization.k8s.io/v1","kind":"RoleBinding","metadata":{{"name":"rb-{i:04}"}},"roleRef":{{"apiGroup":"rbac.authorization.k8s.io","kind":"ClusterRole","name":"view"}},"subjects":[{{"kind":"User","apiGroup":"rbac.authorization.k8s.io","name":"user-{i}"}},{{"kind":"Group","apiGroup":"rbac.authorization.k8s.io","name":"group-{i}"}}]}}"#
            ),
        )
        .await;
    }
    for i in 0..100 {
        post(
            "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings".into(),
            format!(
                r#"{{"apiVersion":"rbac.authorization.k8s.io/v1","kind":"ClusterRoleBinding","metadata":{{"name":"crb-{i:03}"}},"roleRef":{{"apiGroup":"rbac.authorization.k8s.io","kind":"ClusterRole","name":"view"}},"subjects":[{{"kind":"User","apiGroup":"rbac.authorization.k8s.io","name":"cluster-user-{i}"}}]}}"#
            ),
        )
        .await;
    }
    post(
        "/apis/rbac.authorization.k8s.io/v1/namespaces/bench/rolebindings".into(),
        r#"{"apiVersion":"rbac.authorization.k8s.io/v1","kind":"RoleBinding","metadata":{"name":"zz-bench"},"roleRef":{"apiGroup":"rbac.authorization.k8s.io","kind":"ClusterRole","name":"edit"},"subjects":[{"kind":"User","apiGroup":"rbac.authorization.k8s.io","name":"bench"}]}"#.into(),
    )
    .await;
    const ROUNDS: usize = 6;
    const CREATES: usize = 2000;
    println!();
    println!(
        "## creates as a token user, 8 clients: AlwaysAllow vs RBAC (1,000 RoleBindings, 100 ClusterRoleBindings)"
    );
    println!("| round | authorization | creates | creates/s | p50 | p99 |");
    println!("| --- | --- | --- | --- | --- | --- |");
    let mut rates: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    for round in 0..ROUNDS {
        // Alternate which server goes first, so neither always follows the other's fsyncs.
        let mut order = [("AlwaysAllow", &allow, 0), ("RBAC", &rbac, 1)];
        if round % 2 == 1 {
            order.reverse();
        }
        for (name, base, index) in order {
            let (rate, p50, p99) = creates_as(
                base,
                "bench",
                &format!("r{round}"),
                8,
                CREATES,
                Some(BENCH_TOKEN),
            )
            .await;
            rates[index].push(rate);
            println!(
                "| {round} | {name} | {CREATES} | {rate:.0} | {:.2} ms | {:.2} ms |",
                p50.as_secs_f64() * 1e3,
                p99.as_secs_f64() * 1e3
            );
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        (v[v.len() / 2 - 1] + v[v.len() / 2]) / 2.0
    };
    let (allow_median, rbac_median) = (median(&mut rates[0]), median(&mut rates[1]));
    println!(
        "| median | AlwaysAllow {allow_median:.0}/s, RBAC {rbac_median:.0}/s | | RBAC/AlwaysAllow {:.1} % | | |",
        rbac_median / allow_median * 100.0
    );
    // The authorizer alone: the decision each of those creates needed, repeated.
    let user = nodeport_apiserver::authz::UserInfo {
        name: "bench".into(),
        uid: "1".into(),
        groups: vec!["system:authenticated".into()],
    };
    let attributes = nodeport_apiserver::authz::Attributes::of_request(
        user,
        &http::Method::POST,
        "/api/v1/namespaces/bench/services",
        None,
    );
    const DECISIONS: u32 = 20_000;
    let start = Instant::now();
    for _ in 0..DECISIONS {
        assert!(
            authorizer
                .authorize(std::hint::black_box(&attributes))
                .allowed
        );
    }
    let per = start.elapsed() / DECISIONS;
    println!();
    println!(
        "RBAC decision for that create (looks through 100 ClusterRoleBindings and 1,001 RoleBindings): {:.1} µs",
        per.as_secs_f64() * 1e6
    );
}

/// The field manager's own cost per write, without HTTP or storage: the `managedFields` of an
/// update (create, then a label change), and an apply that changes one port of a Service that
/// two managers share.
fn managed_fields() {
    use nodeport_apiserver::registry::managed_fields::{Writer, apply, on_update};
    use nodeport_apiserver::resource::Kind;
    let now = serde_json::json!("2026-01-01T00:00:00Z");
    let writer = |manager| Writer {
        manager,
        subresource: "",
        now: &now,
    };
    let mut svc: serde_json::Value = serde_json::from_str(&service("web", true)).unwrap();
    svc["spec"]["ports"][0]["protocol"] = serde_json::json!("TCP");
    svc["spec"]["ports"][0]["targetPort"] = serde_json::json!(80);
    svc["spec"]["sessionAffinity"] = serde_json::json!("None");
    let mut live = svc.clone();
    live["metadata"]["managedFields"] =
        on_update(Kind::Service, None, &svc, writer("create")).unwrap();
    let mut labelled = live.clone();
    labelled["metadata"]["labels"] = serde_json::json!({"app": "web", "team": "a"});
    let mut config = svc.clone();
    config["spec"]["ports"][0]["targetPort"] = serde_json::json!(9090);
    println!("## field manager (one Service, CPU per call)");
    println!("| call | per call |");
    println!("| --- | --- |");
    let rounds = 20_000;
    let time = |name: &str, f: &dyn Fn()| {
        let t = Instant::now();
        for _ in 0..rounds {
            f();
        }
        println!(
            "| {name} | {:.1} µs |",
            t.elapsed().as_secs_f64() * 1e6 / f64::from(rounds)
        );
    };
    time("managedFields of a create", &|| {
        std::hint::black_box(on_update(Kind::Service, None, &svc, writer("create")));
    });
    time("managedFields of an update", &|| {
        std::hint::black_box(on_update(
            Kind::Service,
            Some(&live),
            &labelled,
            writer("labeller"),
        ));
    });
    time("apply, with force", &|| {
        std::hint::black_box(
            apply(
                Kind::Service,
                Some(&live),
                &config,
                writer("deployer"),
                true,
            )
            .unwrap(),
        );
    });
}
