//! The official Kubernetes Python client (`pip install kubernetes`, which `scripts/test.sh`
//! installs when missing) against `nodeport apiserver`, on the embedded store and on etcd:
//! `tests/python/clients.py` runs one case per test and fails at the first answer that is not
//! kube-apiserver's.

mod apiserver_support;

use std::path::Path;
use std::process::Command;

use apiserver_support::etcd::{Etcd, etcd_available};
use apiserver_support::{Server, text};

/// Where the server under test keeps its objects.
#[derive(Clone, Copy)]
enum Store {
    Embedded,
    Etcd,
}

/// Runs `clients.py <url> <case>` against a fresh server on `store`; panics with its output on
/// failure.
fn run_case(case: &str, store: Store) {
    let python = Command::new("python3")
        .args(["-c", "import kubernetes"])
        .output()
        .unwrap_or_else(|e| panic!("python3 is required for this test: {e}"));
    assert!(
        python.status.success(),
        "the Python package `kubernetes` is required (pip install kubernetes; scripts/test.sh installs it): {}",
        text(&python).1
    );
    let dir = tempfile::tempdir().unwrap();
    let (_etcd, server) = match store {
        Store::Embedded => (None, Server::start(&dir.path().join("data"), &[])),
        Store::Etcd => {
            if !etcd_available() {
                return;
            }
            let etcd = Etcd::start(&dir.path().join("etcd"));
            let url = etcd.url();
            let server = Server::start(&dir.path().join("data"), &["--etcd-servers", &url]);
            (Some(etcd), server)
        }
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/clients.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg(format!("http://127.0.0.1:{}", server.port))
        .arg(case)
        .output()
        .expect("run python3");
    let (stdout, stderr) = text(&out);
    assert!(
        out.status.success() && stdout.contains(&format!("{case}: ok")),
        "clients.py {case} failed:\n{stdout}\n{stderr}"
    );
}

#[test]
fn python_client_creates_and_replaces_every_kind_built_without_kind_or_api_version() {
    run_case("kinds", Store::Embedded);
}

#[test]
fn python_client_creates_and_replaces_every_kind_built_without_kind_or_api_version_on_etcd() {
    run_case("kinds", Store::Etcd);
}

#[test]
fn python_client_writes_and_selects_events_through_both_apis() {
    run_case("events", Store::Embedded);
}

#[test]
fn python_client_writes_and_selects_events_through_both_apis_on_etcd() {
    run_case("events", Store::Etcd);
}

#[test]
fn python_client_applies_server_side_with_conflicts_and_force() {
    run_case("apply", Store::Embedded);
}

#[test]
fn python_client_applies_server_side_with_conflicts_and_force_on_etcd() {
    run_case("apply", Store::Etcd);
}
