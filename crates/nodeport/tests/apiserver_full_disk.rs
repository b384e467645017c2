//! A full disk under the embedded store, for real: the server's data directory is a 4 MiB tmpfs
//! in a mount namespace of its own (gone with the process, so nothing leaks on the host). Writes
//! fail with a 500 naming the cause, nothing acknowledged is lost, reads and an open watch go on,
//! and once space is freed writes resume without a restart, with the allocation bitmaps still
//! equal to the Services (issue #20).

mod apiserver_support;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use apiserver_support::Server;
use nodeport_apiserver::registry::service::ServiceRanges;
use nodeport_apiserver::storage::redb::{Config, RedbBackend};

const RANGE: &str = "30000-39999";

fn body(name: &str) -> String {
    format!(
        r#"{{"apiVersion":"v1","kind":"Service","metadata":{{"name":"{name}"}},"spec":{{"type":"NodePort","ports":[{{"port":80}}]}}}}"#
    )
}

/// A watch on Services, read on a thread of its own: the names of the ADDED events so far.
fn watch_services(port: u16) -> Arc<Mutex<Vec<String>>> {
    let added = Arc::new(Mutex::new(Vec::new()));
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        stream,
        "GET /api/v1/namespaces/default/services?watch=true&timeoutSeconds=300 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    )
    .unwrap();
    let seen = added.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { return };
            let Ok(event) = serde_json::from_str::<serde_json::Value>(line.trim()) else {
                continue; // headers and chunk sizes
            };
            if event["type"] == "ADDED" {
                let name = event["object"]["metadata"]["name"].as_str().unwrap_or("");
                seen.lock().unwrap().push(name.to_owned());
            }
        }
    });
    added
}

/// Writes zeros to `path` until the file system is full.
fn fill(path: &Path) {
    let mut file = std::fs::File::create(path).unwrap();
    let chunk = vec![0u8; 64 * 1024];
    while file.write_all(&chunk).is_ok() {}
    let _ = file.sync_all();
}

fn create(server: &Server, name: &str) -> (u16, String) {
    server
        .try_http(
            "POST",
            "/api/v1/namespaces/default/services",
            Some(&body(name)),
        )
        .unwrap()
}

#[test]
fn writes_fail_cleanly_on_a_full_disk_and_resume_once_space_is_freed() {
    if !nodeport_testbed::require_tools("full disk", &["unshare", "mount"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mount = dir.path().join("tmpfs");
    std::fs::create_dir(&mount).unwrap();
    let data = mount.join("data");
    let script = r#"mount -t tmpfs -o size=4m nodeport-full-disk "$0" && exec "$@""#;
    let mount_arg = mount.to_str().unwrap();
    let server = Server::start_wrapped(
        &data,
        &["--service-node-port-range", RANGE],
        None,
        &[
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            mount_arg,
        ],
    );
    // The tmpfs as the server sees it, from this (the host's) mount namespace.
    let inside = |p: &Path| -> PathBuf {
        PathBuf::from(format!("/proc/{}/root", server.pid())).join(p.strip_prefix("/").unwrap())
    };
    let added = watch_services(server.port);

    let mut acknowledged = Vec::new();
    for i in 0..20 {
        let name = format!("before-{i}");
        let (code, text) = create(&server, &name);
        assert_eq!(code, 201, "{text}");
        acknowledged.push(name);
    }

    fill(&inside(&mount.join("filler")));
    let mut refused = None;
    for i in 0..5000 {
        let name = format!("full-{i}");
        match create(&server, &name) {
            (201, _) => acknowledged.push(name),
            (code, text) => {
                refused = Some((code, text));
                break;
            }
        }
    }
    let (code, text) = refused.expect("the disk never filled up");
    assert_eq!(code, 500, "{text}");
    assert!(text.contains("No space left on device"), "{text}");
    assert!(text.contains(r#""kind":"Status""#), "{text}");
    // Still full: still refused, and reads go on.
    let (code, _) = create(&server, "still-full");
    assert_eq!(code, 500);
    let (code, list) = server
        .try_http("GET", "/api/v1/namespaces/default/services", None)
        .unwrap();
    assert_eq!(code, 200);
    for name in &acknowledged {
        assert!(list.contains(&format!(r#""name":"{name}""#)), "{name} lost");
    }

    // Space is freed: writes resume, with no restart.
    std::fs::remove_file(inside(&mount.join("filler"))).unwrap();
    for i in 0..3 {
        let name = format!("after-{i}");
        let (code, text) = create(&server, &name);
        assert_eq!(code, 201, "{name} after space was freed: {text}");
        acknowledged.push(name);
    }

    // The watch opened before the disk filled saw every acknowledged create, and nothing else.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let seen = added.lock().unwrap().clone();
        let mut expected = acknowledged.clone();
        expected.push("kubernetes".into());
        let (mut seen_sorted, mut expected_sorted) = (seen.clone(), expected);
        seen_sorted.sort();
        expected_sorted.sort();
        if seen_sorted == expected_sorted {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the watch saw {seen:?}, acknowledged {acknowledged:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // The bitmaps equal the Services: checked on a copy of the file, taken while the server is
    // idle (the copy is opened, and repaired, as after a crash).
    let copy = dir.path().join("copy.redb");
    std::fs::copy(inside(&data.join(nodeport_apiserver::DATA_FILE)), &copy).unwrap();
    let dump = RedbBackend::open(&copy, Config::default()).unwrap().dump();
    let ranges = ServiceRanges {
        node_ports: nodeport_apiserver::PortRange::parse(RANGE).unwrap(),
        cluster_ips: "10.96.0.0/16".parse().unwrap(),
        secondary_cluster_ips: None,
    };
    let report = nodeport_apiserver::registry::verify_dump(&dump, "/registry", &ranges).unwrap();
    assert!(report.is_consistent(), "{report:?}");
    assert_eq!(report.services, acknowledged.len() + 1, "{report:?}");
}
