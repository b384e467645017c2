//! `nodeport apiserver` refuses unsafe or broken security flags before it opens anything, with
//! one clear line and exit code 64 (the TLS and token paths themselves are tested with kubectl in
//! the apiserver crate's `tls` test).

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
