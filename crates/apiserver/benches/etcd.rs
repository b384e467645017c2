//! The etcd backend: Service creates per second over real HTTP with 8 and 64 clients, on 1 and 3
//! API servers sharing one etcd, beside the raw etcd rate of comparable transactions measured in
//! the same run.
//!
//! `cargo bench -p nodeport-apiserver --bench etcd [-- 1x8 1x64 3x8 3x64]` (needs `/usr/bin/etcd`;
//! figures in docs/BENCHMARKS.md; rows named after `--` run alone, `NODEPORT_LOG=debug` shows the
//! API servers' logs). etcd runs on a free loopback port with its data in a temporary directory
//! on the same disk as everything else; the API servers run in this process (each its own
//! writer and etcd client), the clients too, so everything shares the machine's 2 cores.
//!
//! The raw rate: clients that each commit, in a loop, one etcd transaction shaped like a
//! single-Service create (compare the mod revisions of a Service key and two bitmap keys, put a
//! 1 KiB Service and bitmaps of the bench's sizes). Each raw client has its own bitmap keys, so
//! the raw transactions never conflict: an upper bound on what etcd does with that shape.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use etcd_client::{Client, Compare, CompareOp, Txn, TxnOp};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use nodeport_apiserver::{Config, PortRange};
use nodeport_testbed::etcd::Etcd;

type Http = HttpClient<HttpConnector, Full<Bytes>>;

const NODE_PORTS: &str = "20000-59999";

fn http() -> Http {
    HttpClient::builder(TokioExecutor::new()).build_http()
}

async fn request(client: &Http, method: &str, url: &str, body: String) -> (u16, Bytes) {
    let req = hyper::Request::builder()
        .method(method)
        .uri(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let resp = client.request(req).await.expect("request");
    let status = resp.status().as_u16();
    (status, resp.into_body().collect().await.unwrap().to_bytes())
}

fn service(name: &str) -> String {
    format!(
        r#"{{"apiVersion":"v1","kind":"Service","metadata":{{"name":"{name}","labels":{{"app":"bench"}}}},"spec":{{"type":"NodePort","selector":{{"app":"bench"}},"ports":[{{"port":80}}]}}}}"#
    )
}

/// Creates `total` Services from `clients` clients spread over `bases`; creates per second.
async fn creates(bases: &[String], namespace: &str, clients: usize, total: usize) -> f64 {
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let url = format!(
                "{}/api/v1/namespaces/{namespace}/services",
                bases[c % bases.len()]
            );
            let (next, namespace) = (next.clone(), namespace.to_owned());
            tokio::spawn(async move {
                let client = http();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        return;
                    }
                    let (status, body) =
                        request(&client, "POST", &url, service(&format!("{namespace}-{i}"))).await;
                    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    total as f64 / start.elapsed().as_secs_f64()
}

/// The raw etcd rate of single-Service-shaped transactions from `clients` clients.
async fn raw(client: &Client, clients: usize, total: usize, round: usize) -> f64 {
    let service = vec![b'x'; 1024];
    let ports = vec![b'p'; 6_700];
    let ips = vec![b'i'; 11_000];
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let mut kv = client.kv_client();
            let (next, service, ports, ips) =
                (next.clone(), service.clone(), ports.clone(), ips.clone());
            tokio::spawn(async move {
                let np_key = format!("/raw/{round}/{c}/servicenodeports");
                let ip_key = format!("/raw/{round}/{c}/serviceips");
                let mut revisions = (0, 0);
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        return;
                    }
                    let svc_key = format!("/raw/{round}/services/{i}");
                    let txn = Txn::new()
                        .when(vec![
                            Compare::version(svc_key.as_bytes(), CompareOp::Equal, 0),
                            Compare::mod_revision(np_key.as_bytes(), CompareOp::Equal, revisions.0),
                            Compare::mod_revision(ip_key.as_bytes(), CompareOp::Equal, revisions.1),
                        ])
                        .and_then(vec![
                            TxnOp::put(svc_key.as_bytes(), service.clone(), None),
                            TxnOp::put(np_key.as_bytes(), ports.clone(), None),
                            TxnOp::put(ip_key.as_bytes(), ips.clone(), None),
                        ]);
                    let response = kv.txn(txn).await.expect("raw txn");
                    assert!(response.succeeded(), "raw transactions never conflict");
                    let revision = response.header().unwrap().revision();
                    revisions = (revision, revision);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    total as f64 / start.elapsed().as_secs_f64()
}

/// The raw etcd rate of the same transactions when every client shares the two bitmap keys, as
/// API servers do: read both, compare-and-swap, re-read and retry on a lost race. Successful
/// creates per second.
async fn raw_shared(client: &Client, clients: usize, total: usize, round: usize) -> f64 {
    let service = vec![b'x'; 1024];
    let ports = vec![b'p'; 6_700];
    let ips = vec![b'i'; 11_000];
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let mut kv = client.kv_client();
            let (next, service, ports, ips) =
                (next.clone(), service.clone(), ports.clone(), ips.clone());
            tokio::spawn(async move {
                let np_key = format!("/shared/{round}/servicenodeports");
                let ip_key = format!("/shared/{round}/serviceips");
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        return;
                    }
                    let svc_key = format!("/shared/{round}/services/{i}");
                    loop {
                        // Many clients racing on two keys can make etcd time out: retry.
                        let Ok(read) = kv
                            .txn(Txn::new().and_then(vec![
                                TxnOp::get(np_key.as_bytes(), None),
                                TxnOp::get(ip_key.as_bytes(), None),
                            ]))
                            .await
                        else {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                            continue;
                        };
                        let mut revisions = [0, 0];
                        for (slot, op) in read.op_responses().into_iter().enumerate() {
                            if let etcd_client::TxnOpResponse::Get(get) = op {
                                revisions[slot] =
                                    get.kvs().first().map_or(0, |kv| kv.mod_revision());
                            }
                        }
                        let txn = Txn::new()
                            .when(vec![
                                Compare::version(svc_key.as_bytes(), CompareOp::Equal, 0),
                                Compare::mod_revision(
                                    np_key.as_bytes(),
                                    CompareOp::Equal,
                                    revisions[0],
                                ),
                                Compare::mod_revision(
                                    ip_key.as_bytes(),
                                    CompareOp::Equal,
                                    revisions[1],
                                ),
                            ])
                            .and_then(vec![
                                TxnOp::put(svc_key.as_bytes(), service.clone(), None),
                                TxnOp::put(np_key.as_bytes(), ports.clone(), None),
                                TxnOp::put(ip_key.as_bytes(), ips.clone(), None),
                            ]);
                        match kv.txn(txn).await {
                            Ok(response) if response.succeeded() => break,
                            Ok(_) => {}
                            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                        }
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    total as f64 / start.elapsed().as_secs_f64()
}

/// (transactions tried, requests, lost races, commit seconds, read seconds) summed over the
/// servers' `/metrics`, and the most lost races in a row of any server so far.
async fn counters(bases: &[String]) -> (f64, f64, f64, f64, f64, f64) {
    let client = http();
    let mut sum = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
    for base in bases {
        let (_, body) = request(&client, "GET", &format!("{base}/metrics"), String::new()).await;
        let text = String::from_utf8_lossy(&body);
        let read = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        sum.0 += read("nodeport_apiserver_storage_batches_total ");
        sum.1 += read("nodeport_apiserver_storage_mutations_total ");
        sum.2 += read("nodeport_apiserver_storage_conflicts_total ");
        sum.3 += read("nodeport_apiserver_storage_commit_seconds_total ");
        sum.4 += read("nodeport_apiserver_storage_read_seconds_total ");
        sum.5 = read("nodeport_apiserver_storage_lost_races_in_a_row_max ").max(sum.5);
    }
    sum
}

#[tokio::main]
async fn main() {
    // NODEPORT_LOG=debug shows the API servers' logs.
    if let Ok(filter) = std::env::var("NODEPORT_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .init();
    }
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(&dir.path().join("etcd"));
    let url = etcd.url();
    let client = loop {
        if let Ok(mut c) = Client::connect([url.as_str()], None).await
            && c.status().await.is_ok()
        {
            break c;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };

    let config = Config {
        node_port_range: PortRange::parse(NODE_PORTS).unwrap(),
        etcd_servers: vec![url.clone()],
        ..Config::default()
    };
    let mut bases = Vec::new();
    for _ in 0..3 {
        let state = nodeport_apiserver::open(&config).await.unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        bases.push(format!("http://{}", listener.local_addr().unwrap()));
        tokio::spawn(nodeport_apiserver::serve(
            state,
            listener,
            std::future::pending(),
        ));
    }
    for ns in ["r1c8", "r1c64", "r3c8", "r3c64"] {
        let (status, _) = request(
            &http(),
            "POST",
            &format!("{}/api/v1/namespaces", bases[0]),
            format!(r#"{{"apiVersion":"v1","kind":"Namespace","metadata":{{"name":"{ns}"}}}}"#),
        )
        .await;
        assert_eq!(status, 201);
    }

    println!("## Service creates on etcd beside raw etcd transactions (same run)");
    println!(
        "| API servers | clients | creates/s | raw etcd txns/s, own bitmaps | ratio | raw, shared bitmaps | requests per transaction | lost races per transaction | read, commit ms per transaction | most lost in a row, so far |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    // `-- 3x8` (or any of 1x8, 1x64, 3x8, 3x64) runs only the rows named.
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a.contains('x'))
        .collect();
    let mut round = 0;
    for (replicas, clients, total) in [(1, 8, 2000), (1, 64, 4000), (3, 8, 2000), (3, 64, 4000)] {
        round += 1;
        if !only.is_empty() && !only.contains(&format!("{replicas}x{clients}")) {
            continue;
        }
        let raw_rate = raw(&client, clients, total, round).await;
        let shared_rate = raw_shared(&client, clients, total / 4, round).await;
        let used = &bases[..replicas];
        let before = counters(used).await;
        let rate = creates(used, &format!("r{replicas}c{clients}"), clients, total).await;
        let after = counters(used).await;
        let batches = after.0 - before.0;
        println!(
            "| {replicas} | {clients} | {rate:.0} | {raw_rate:.0} | {:.0} % | {shared_rate:.0} | {:.1} | {:.2} | {:.1}, {:.1} | {} |",
            rate / raw_rate * 100.0,
            (after.1 - before.1) / batches,
            (after.2 - before.2) / batches,
            (after.4 - before.4) / batches * 1e3,
            (after.3 - before.3) / batches * 1e3,
            after.5,
        );
    }
}
