//! `nodeport apiserver` refuses unsafe or broken flags before it opens anything, with one clear
//! line and exit code 64 (the TLS and token paths themselves are tested with kubectl in the
//! apiserver crate's `tls` test), and stops cleanly on SIGTERM.

mod apiserver_support;

use std::process::Command;

fn run(args: &[&str]) -> (Option<i32>, String) {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_nodeport"))
        .arg("apiserver")
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        !dir.path().join("data").exists(),
        "nothing is opened before the flags are checked"
    );
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_non_loopback_bind_address_without_tls_and_tokens_is_refused_with_exit_64() {
    let (code, stderr) = run(&["--bind-address", "192.0.2.10", "--port", "1"]);
    assert_eq!(code, Some(64), "{stderr}");
    assert!(
        stderr.contains(
            "--bind-address 192.0.2.10 is not a loopback address: serving beyond loopback requires --tls-cert-file, --tls-private-key-file, --token-auth-file"
        ),
        "{stderr}"
    );
    let (code, stderr) = run(&[
        "--bind-address",
        "192.0.2.10",
        "--tls-cert-file",
        "/c.pem",
        "--tls-private-key-file",
        "/k.pem",
    ]);
    assert_eq!(code, Some(64), "{stderr}");
    assert!(stderr.contains("requires --token-auth-file"), "{stderr}");
}

#[test]
fn unreadable_certificate_or_token_files_are_refused_with_exit_64() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.pem");
    let missing = missing.to_str().unwrap();
    let (code, stderr) = run(&[
        "--tls-cert-file",
        missing,
        "--tls-private-key-file",
        missing,
    ]);
    assert_eq!(code, Some(64), "{stderr}");
    assert!(
        stderr.contains(&format!("cannot load the TLS certificate {missing}")),
        "{stderr}"
    );
    let (code, stderr) = run(&["--tls-cert-file", missing]);
    assert_eq!(code, Some(64), "{stderr}");
    assert!(
        stderr.contains("--tls-cert-file and --tls-private-key-file must be given together"),
        "{stderr}"
    );
    let tokens = dir.path().join("tokens.csv");
    std::fs::write(&tokens, "only-a-token,user\n").unwrap();
    let (code, stderr) = run(&["--token-auth-file", tokens.to_str().unwrap()]);
    assert_eq!(code, Some(64), "{stderr}");
    assert!(
        stderr.contains("must have at least 3 columns (token, user name, user uid), found 2"),
        "{stderr}"
    );
}

#[test]
fn an_advertise_address_that_is_not_a_reachable_ip_is_refused_with_exit_64() {
    let (code, stderr) = run(&["--advertise-address", "api.example"]);
    assert_eq!(code, Some(64), "{stderr}");
    assert!(
        stderr.contains("--advertise-address \"api.example\" is not an IP address"),
        "{stderr}"
    );
    let (code, stderr) = run(&["--advertise-address", "0.0.0.0"]);
    assert_eq!(code, Some(64), "{stderr}");
    assert!(
        stderr.contains("--advertise-address 0.0.0.0 is not an address others can reach"),
        "{stderr}"
    );
}

#[test]
fn sigterm_ends_open_watches_and_stops_the_server() {
    // kube-apiserver closes watches when it shuts down; a server that waited for its watchers
    // (every node's proxy holds some) would never stop on SIGTERM.
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let mut server = apiserver_support::Server::start(&dir.path().join("data"), &[]);
    let mut watch = std::net::TcpStream::connect(("127.0.0.1", server.port)).unwrap();
    write!(
        watch,
        "GET /api/v1/services?watch=1 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    )
    .unwrap();
    let mut first = [0u8; 64];
    let n = watch.read(&mut first).unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"));
    assert!(
        server.terminate_within(std::time::Duration::from_secs(10)),
        "the server was still running 10 s after SIGTERM with a watch open"
    );
    // The watch ended cleanly: the stream reaches its end.
    watch
        .set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    let mut rest = Vec::new();
    assert!(
        watch.read_to_end(&mut rest).is_ok(),
        "the watch did not end"
    );
}

#[test]
fn an_event_ttl_that_is_not_a_positive_duration_is_refused_with_exit_64() {
    for bad in ["0", "soon", "10x"] {
        let (code, stderr) = run(&["--event-ttl", bad]);
        assert_eq!(code, Some(64), "{bad}: {stderr}");
        assert!(
            stderr.contains(&format!(
                "--event-ttl {bad:?} is not a duration of at least 1s (like 1h, 30m or 90s)"
            )),
            "{stderr}"
        );
    }
}

#[test]
fn an_unknown_or_repeated_authorization_mode_is_refused_with_exit_64() {
    for (value, says) in [
        ("RBAC,Node", "Node"),
        ("RBAC,RBAC", "RBAC"),
        ("", "--authorization-mode"),
    ] {
        let (code, stderr) = run(&["--authorization-mode", value]);
        assert_eq!(code, Some(64), "{value:?}: {stderr}");
        assert!(
            stderr.contains("--authorization-mode") && stderr.contains(says),
            "{value:?}: {stderr}"
        );
    }
}
