//! SIGKILL during 1,000 concurrent creates: every acknowledged Service survives, and the
//! allocation bitmaps equal exactly the ports and addresses the stored Services hold.

mod apiserver_support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use apiserver_support::{Server, http};
use nodeport_apiserver::registry::service::ServiceRanges;
use nodeport_apiserver::storage::redb::{Config, RedbBackend};

const CREATES: usize = 1000;
const CLIENTS: usize = 32;

fn body(name: &str) -> String {
    format!(
        r#"{{"apiVersion":"v1","kind":"Service","metadata":{{"name":"{name}"}},"spec":{{"type":"NodePort","ports":[{{"port":80}}]}}}}"#
    )
}

#[test]
fn acknowledged_creates_survive_sigkill_and_bitmaps_match_the_services() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut server = Server::start(&data, &["--service-node-port-range", "30000-39999"]);
    let port = server.port;

    let next = Arc::new(AtomicUsize::new(0));
    let acknowledged = Arc::new(Mutex::new(Vec::new()));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let next = next.clone();
            let acknowledged = acknowledged.clone();
            std::thread::spawn(move || {
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= CREATES {
                        return;
                    }
                    let name = format!("svc-{i}");
                    match http(
                        port,
                        "POST",
                        "/api/v1/namespaces/default/services",
                        Some(&body(&name)),
                    ) {
                        Ok((201, _)) => acknowledged.lock().unwrap().push(name),
                        Ok((code, text)) => panic!("create {name}: {code} {text}"),
                        // The server was killed under us: this request was never acknowledged.
                        Err(_) => return,
                    }
                }
            })
        })
        .collect();

    // Kill in the middle of the run.
    while acknowledged.lock().unwrap().len() < CREATES / 3 {
        std::thread::sleep(Duration::from_millis(2));
    }
    server.kill();
    for c in clients {
        c.join().unwrap();
    }
    let acknowledged = acknowledged.lock().unwrap().clone();
    assert!(
        acknowledged.len() < CREATES,
        "the kill landed after the run; nothing was tested"
    );

    // Offline: the file holds every acknowledged Service, and the bitmaps equal the Services.
    {
        let backend =
            RedbBackend::open(&data.join(nodeport_apiserver::DATA_FILE), Config::default())
                .unwrap();
        let dump = backend.dump();
        let keys: std::collections::HashSet<&str> = dump.iter().map(|kv| kv.key.as_str()).collect();
        for name in &acknowledged {
            let key = format!("/registry/services/specs/default/{name}");
            assert!(keys.contains(key.as_str()), "acknowledged {name} is lost");
        }
        let ranges = ServiceRanges {
            node_ports: nodeport_apiserver::PortRange::parse("30000-39999").unwrap(),
            cluster_ips: "10.96.0.0/16".parse().unwrap(),
            secondary_cluster_ips: None,
        };
        let report =
            nodeport_apiserver::registry::verify_dump(&dump, "/registry", &ranges).unwrap();
        assert!(report.is_consistent(), "{report:?}");
        assert!(report.services > acknowledged.len(), "{report:?}");
    }

    // Restarted, the server serves them and allocates on.
    let server = Server::start(&data, &["--service-node-port-range", "30000-39999"]);
    for name in &acknowledged {
        let (code, _) = server
            .try_http(
                "GET",
                &format!("/api/v1/namespaces/default/services/{name}"),
                None,
            )
            .unwrap();
        assert_eq!(code, 200, "{name} not served after restart");
    }
    let (code, text) = server
        .try_http(
            "POST",
            "/api/v1/namespaces/default/services",
            Some(&body("after-restart")),
        )
        .unwrap();
    assert_eq!(code, 201, "{text}");
}
