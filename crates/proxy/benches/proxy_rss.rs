//! Memory of the real `nodeport proxy` at scale: our API server and the proxy in a throwaway
//! network namespace, 10,000 Services × 10 endpoints created through the API, then the
//! proxy's resident memory (VmRSS, and VmHWM, the peak) once its first sync is done, and again
//! after each of two full resyncs that a hand edit of the table sets off.
//!
//! Run (root): `cargo build --release -p nodeport && cargo bench -p nodeport-proxy --bench
//! proxy_rss -- <path to nodeport> [services]`; the flat layout (the default), or kube-proxy's
//! with `NODEPORT_BENCH_LAYOUT=kube-proxy`.

use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::PostParams;
use nodeport_testbed::Netns;

fn status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap_or(0)
}

fn main() {
    if !nodeport_testbed::require_privileged("proxy_rss bench") {
        return;
    }
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let Some(bin) = args.first().cloned() else {
        eprintln!("usage: proxy_rss <path to the nodeport binary> [services]");
        return;
    };
    let n: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(10_000);
    let ns = Netns::new("rss-node").unwrap();
    let data = tempfile::tempdir().unwrap();
    let _api = ns
        .spawn(
            ns.command(&bin)
                // A /12 of ClusterIPs: the default /16 holds 65,536 Services.
                .args([
                    "apiserver",
                    "--port",
                    "6443",
                    "--service-cluster-ip-range",
                    "10.96.0.0/12",
                    "--data-dir",
                ])
                .arg(data.path().join("store"))
                .env("NODEPORT_LOG", "warn"),
        )
        .unwrap();
    let t = Instant::now();
    ns.enter(|| {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let client = kube::Client::try_from(kube::Config::new("http://127.0.0.1:6443".parse().unwrap())).unwrap();
            // Wait for the server.
            let nodes: kube::Api<Node> = kube::Api::all(client.clone());
            let deadline = Instant::now() + Duration::from_secs(20);
            while nodes.list(&Default::default()).await.is_err() {
                assert!(Instant::now() < deadline, "API server did not come up");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let node: Node = serde_json::from_value(serde_json::json!({
                "metadata": {"name": "node-a"},
                "status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.10"}]}
            }))
            .unwrap();
            nodes.create(&PostParams::default(), &node).await.unwrap();
            let services: kube::Api<Service> = kube::Api::namespaced(client.clone(), "default");
            let slices: kube::Api<EndpointSlice> = kube::Api::namespaced(client.clone(), "default");
            futures::stream::iter(0..n)
                .map(|i| {
                    let (services, slices) = (services.clone(), slices.clone());
                    async move {
                        let svc: Service = serde_json::from_value(serde_json::json!({
                            "metadata": {"name": format!("svc{i}")},
                            "spec": {"ports": [{"name": "http", "port": 80, "targetPort": 8080}]}
                        }))
                        .unwrap();
                        services.create(&PostParams::default(), &svc).await.unwrap();
                        let endpoints: Vec<_> = (0..10)
                            .map(|e| {
                                let a = 0x0A00_0000u32 + (i * 16 + e) as u32;
                                serde_json::json!({
                                    "addresses": [std::net::Ipv4Addr::from(a).to_string()],
                                    "nodeName": format!("node-{}", ["a", "b", "c", "d"][e % 4]),
                                })
                            })
                            .collect();
                        let slice: EndpointSlice = serde_json::from_value(serde_json::json!({
                            "metadata": {"name": format!("svc{i}-abcde"), "labels": {"kubernetes.io/service-name": format!("svc{i}")}},
                            "addressType": "IPv4",
                            "ports": [{"name": "http", "port": 8080}],
                            "endpoints": endpoints,
                        }))
                        .unwrap();
                        slices.create(&PostParams::default(), &slice).await.unwrap();
                    }
                })
                .buffer_unordered(16)
                .collect::<Vec<()>>()
                .await;
        });
    })
    .unwrap();
    println!(
        "created {n} Services and {n} EndpointSlices through the API in {:.1} s",
        t.elapsed().as_secs_f64()
    );

    let layout = match std::env::var("NODEPORT_BENCH_LAYOUT").as_deref() {
        Ok("kube-proxy") => "kube-proxy",
        _ => "flat",
    };
    let t = Instant::now();
    let mut proxy = ns
        .spawn(
            ns.command(&bin)
                .args([
                    "proxy",
                    "--nftables-layout",
                    layout,
                    "--master",
                    "http://127.0.0.1:6443",
                    "--hostname-override",
                    "node-a",
                    "--cluster-cidr",
                    "10.0.0.0/8",
                    "--healthz-bind-address",
                    "127.0.0.1:10256",
                    // Periodic syncs notice drift (below) soon.
                    "--sync-period",
                    "5s",
                ])
                .env("NODEPORT_LOG", "warn"),
        )
        .unwrap();
    let pid = proxy.pid();
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let up = ns
            .run(&["curl", "-sf", "-m", "2", "http://127.0.0.1:10256/livez"])
            .is_ok();
        let programmed = if layout == "flat" {
            // Every ClusterIP is in `cluster-ips`: the first sync (which waits for the
            // initial lists, so it holds every Service) is in.
            ns.run(&[
                "nft",
                "-j",
                "list",
                "set",
                "ip",
                "kube-proxy",
                "cluster-ips",
            ])
            .ok()
            .and_then(|out| serde_json::from_str::<serde_json::Value>(&out).ok())
            .and_then(|v| {
                v["nftables"]
                    .as_array()?
                    .iter()
                    .find_map(|o| o.get("set")?.get("elem")?.as_array().map(|e| e.len()))
            })
            .is_some_and(|elements| elements >= n)
        } else {
            ns.run(&[
                "nft",
                "list",
                "chain",
                "ip",
                "kube-proxy",
                &format!(
                    "service-{}",
                    nodeport_proxy::names::nft_service_port_base(
                        &nodeport_proxy::model::ServicePortName::new(
                            "default",
                            &format!("svc{}", n - 1),
                            "http",
                            nodeport_proxy::model::Protocol::Tcp
                        )
                    )
                ),
            ])
            .is_ok()
        };
        if up && programmed {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the proxy never programmed the last Service"
        );
        assert!(proxy.try_wait().is_none(), "the proxy exited");
        std::thread::sleep(Duration::from_millis(200));
    }
    println!(
        "proxy start to last Service programmed: {:.1} s",
        t.elapsed().as_secs_f64()
    );
    std::thread::sleep(Duration::from_secs(3));
    let report = |when: &str| {
        println!(
            "proxy memory at {n} Services x 10 endpoints, {when}: VmRSS {} MiB (anonymous {} MiB, file-backed {} MiB: the binary's pages), VmHWM (peak) {} MiB, threads {}",
            status_kib(pid, "VmRSS:") / 1024,
            status_kib(pid, "RssAnon:") / 1024,
            status_kib(pid, "RssFile:") / 1024,
            status_kib(pid, "VmHWM:") / 1024,
            status_kib(pid, "Threads:"),
        );
    };
    report("after the first sync");

    // A hand edit: the next periodic sync sees the nf_tables generation move and rewrites
    // everything, a second full sync in the same process. `services` looks the destination up
    // in a set or map (`@…`) in both layouts.
    let dispatch = || {
        ns.run(&["nft", "list", "chain", "ip", "kube-proxy", "services"])
            .unwrap_or_default()
            .contains('@')
    };
    for round in ["second", "third"] {
        ns.run(&["nft", "flush", "chain", "ip", "kube-proxy", "services"])
            .unwrap();
        // No check that it is empty now: at 10,000 Services a flat-layout proxy may notice
        // and repair the drift before a second `nft` has listed the chain.
        let deadline = Instant::now() + Duration::from_secs(120);
        while !dispatch() {
            assert!(Instant::now() < deadline, "the drift was never repaired");
            assert!(proxy.try_wait().is_none(), "the proxy exited");
            std::thread::sleep(Duration::from_millis(200));
        }
        std::thread::sleep(Duration::from_secs(3));
        report(&format!("after a {round} full sync (drift repaired)"));
    }
}
