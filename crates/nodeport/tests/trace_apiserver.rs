//! `nodeport trace --master`/`--kubeconfig`: the objects read from a real `nodeport apiserver`
//! (created there with the real kubectl) trace exactly as the same objects in a file.

mod apiserver_support;

use std::path::Path;
use std::process::Command;

use apiserver_support::{Server, kubectl_available, text};

/// `nodeport trace` with `source` flags: (stdout without the `rules` line, exit code).
fn trace(source: &[&str], args: &[&str]) -> (String, i32) {
    let out = Command::new(env!("CARGO_BIN_EXE_nodeport"))
        .arg("trace")
        .args(source)
        .args([
            "--node-name",
            "node-a",
            "--node-ip",
            "192.0.2.11",
            "--cluster-cidr",
            "10.244.0.0/16",
        ])
        .args(args)
        .env("NODEPORT_LOG", "error")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.is_empty(), "{args:?}: {stderr}");
    let body: Vec<&str> = stdout
        .lines()
        .filter(|l| !l.starts_with("rules "))
        .collect();
    (body.join("\n"), out.status.code().expect("exited"))
}

#[test]
fn objects_read_from_the_api_server_trace_as_the_same_objects_in_a_file() {
    if !kubectl_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"), &[]);
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/testdata/trace/api-objects.yaml");
    let file = file.to_str().unwrap();
    let out = server.kubectl(&["create", "-f", file]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}");

    let master = format!("http://127.0.0.1:{}", server.port);
    for args in [
        &["--from", "203.0.113.5", "--to", "192.0.2.11:30569/tcp"][..],
        &["--from", "203.0.113.5", "--to", "192.0.2.11:30570/tcp"][..],
        &["--from", "10.244.2.3", "--to", "10.96.0.10:80/tcp"][..],
        &["--service", "default/web"][..],
        &["--service", "default/web", "-o", "json"][..],
    ] {
        let (from_api, api_code) = trace(&["--master", &master], args);
        let (from_file, file_code) = trace(&["-f", file], args);
        let from_api = from_api.replace("\"source\": \"apiserver\"", "\"source\": \"file\"");
        assert_eq!(from_api, from_file, "{args:?}");
        assert_eq!(api_code, file_code, "{args:?}");
        assert!(from_api.contains("default/web") || from_api.contains("default/empty"));
    }
    // The fates themselves, so that agreeing on nothing cannot pass.
    let (out, code) = trace(
        &["--master", &master],
        &["--from", "203.0.113.5", "--to", "192.0.2.11:30569/tcp"],
    );
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("fate        DNAT to one of 10.244.1.5:8080, 10.244.2.7:8080"),
        "{out}"
    );
    let (out, code) = trace(
        &["--master", &master],
        &["--from", "203.0.113.5", "--to", "192.0.2.11:30570/tcp"],
    );
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("reject: default/empty:80/TCP has no endpoints"),
        "{out}"
    );
}

#[test]
fn an_unreachable_api_server_exits_3() {
    // A port nothing listens on: bound, then released.
    let port = apiserver_support::free_port();
    let out = Command::new(env!("CARGO_BIN_EXE_nodeport"))
        .args(["trace", "--master", &format!("http://127.0.0.1:{port}")])
        .args(["--service", "default/web"])
        .env("NODEPORT_LOG", "off")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("listing Services"), "{stderr}");
}
