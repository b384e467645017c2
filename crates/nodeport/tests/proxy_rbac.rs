//! A real `nodeport proxy` (and `nodeport up`'s in-process proxy) under RBAC with a bearer token
//! whose user may not list or watch everything the proxy depends on: the refusal is logged at
//! error level, `/healthz` is not 200, and the proxy turns healthy once a binding grants what
//! it lacked, without a restart. Issue #16: "our proxy must log a refused list or watch of any
//! resource it depends on loudly, at error level, and report unhealthy, not carry on without it".
//!
//! Everything runs in a network namespace of the test's own (the proxy programs nftables in
//! it): the API server on its loopback (plain HTTP: a request with a token of
//! `--token-auth-file` is that token's user, one without is the local administrator, which is
//! what kubectl is here), etcd too when the test is the etcd one, and the proxy.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use nodeport_testbed::{ChildGuard, Netns, require_tools};

const NODEPORT: &str = env!("CARGO_BIN_EXE_nodeport");
const PROXY_TOKEN: &str = "node-a-proxy-token-0123456789";
const PROXY_USER: &str = "node-a-proxy";

/// `system:node-proxier`'s rules (kube 1.33's bootstrap policy) but for EndpointSlices, bound to
/// the proxy's user: every watch of the proxy but one is allowed.
const WITHOUT_ENDPOINTSLICES: &str = r#"apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: proxier-without-endpointslices}
rules:
- {apiGroups: [""], resources: [endpoints, services], verbs: [list, watch]}
- {apiGroups: [""], resources: [nodes], verbs: [get, list, watch]}
- {apiGroups: [networking.k8s.io], resources: [servicecidrs], verbs: [list, watch]}
- {apiGroups: ["", events.k8s.io], resources: [events], verbs: [create, patch, update]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: node-a-proxy-partial}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: proxier-without-endpointslices}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: node-a-proxy}
"#;

/// What makes the proxy whole: its user bound to the bootstrap `system:node-proxier`.
const NODE_PROXIER: &str = r#"apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: node-a-proxy}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: system:node-proxier}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: node-a-proxy}
"#;

/// The node's namespace, its loopback also holding the Node's InternalIP.
fn node_namespace() -> Netns {
    let node = Netns::new("rbac-node").unwrap();
    node.add_addr("lo", "192.0.2.10/32").unwrap();
    node
}

fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// kubectl inside `node` as the local administrator (plain HTTP, no token).
fn kubectl(node: &Netns, dir: &Path, args: &[&str], stdin: Option<&str>) -> Result<String, String> {
    let kubeconfig = dir.join("admin.kubeconfig");
    if !kubeconfig.exists() {
        std::fs::write(
            &kubeconfig,
            "apiVersion: v1\nkind: Config\nclusters:\n- cluster: {server: \"http://127.0.0.1:6443\"}\n  name: t\ncontexts:\n- context: {cluster: t, user: admin}\n  name: t\ncurrent-context: t\nusers:\n- name: admin\n  user: {}\n",
        )
        .unwrap();
    }
    let mut full = vec![
        "kubectl".to_owned(),
        "--kubeconfig".to_owned(),
        kubeconfig.display().to_string(),
        "--cache-dir".to_owned(),
        dir.join("kube-cache").display().to_string(),
    ];
    full.extend(args.iter().map(|s| (*s).to_owned()));
    let full: Vec<&str> = full.iter().map(String::as_str).collect();
    match stdin {
        Some(text) => node.run_with_stdin(&full, text.as_bytes()),
        None => node.run(&full),
    }
    .map_err(|e| e.to_string())
}

/// `GET http://127.0.0.1:10256/healthz` inside `node`: the status code, if it answered.
fn healthz(node: &Netns) -> Option<u16> {
    let out = node
        .run(&[
            "curl",
            "-s",
            "-m",
            "2",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "http://127.0.0.1:10256/healthz",
        ])
        .ok()?;
    out.trim().parse().ok().filter(|code| *code != 0)
}

/// Starts etcd inside `node` on its loopback (2379, 2380: the namespace's own ports), healthy.
fn etcd_in(node: &Netns, dir: &Path) -> ChildGuard {
    let mut cmd = node.command("etcd");
    cmd.args(["--name", "t", "--data-dir"])
        .arg(dir.join("etcd"))
        .args([
            "--listen-client-urls",
            "http://127.0.0.1:2379",
            "--advertise-client-urls",
            "http://127.0.0.1:2379",
            "--listen-peer-urls",
            "http://127.0.0.1:2380",
            "--initial-advertise-peer-urls",
            "http://127.0.0.1:2380",
            "--initial-cluster",
            "t=http://127.0.0.1:2380",
            "--logger",
            "zap",
            "--log-level",
            "error",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let etcd = node.spawn(&mut cmd).unwrap();
    wait_until("etcd is healthy", Duration::from_secs(20), || {
        node.run(&["curl", "-sf", "-m", "2", "http://127.0.0.1:2379/health"])
            .is_ok_and(|body| body.contains("\"health\":\"true\""))
    });
    etcd
}

/// Waits until the proxy's log holds an error-level refusal of `what`; returns the log.
fn wait_for_refusal(log: &Path, what: &str) -> String {
    let mut text = String::new();
    wait_until(
        &format!("the proxy logs the refused list/watch of {what} at error level"),
        Duration::from_secs(20),
        || {
            text = std::fs::read_to_string(log).unwrap_or_default();
            refusals(&text).iter().any(|line| line.contains(what))
        },
    );
    text
}

/// The error-level lines of a log that report a refused list or watch.
fn refusals(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| l.contains(" ERROR ") && l.contains("refuses to let this proxy list or watch"))
        .collect()
}

/// A token file: the proxy's user and nobody else (kubectl is the local administrator).
fn token_file(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("tokens.csv");
    std::fs::write(&path, format!("{PROXY_TOKEN},{PROXY_USER},10\n")).unwrap();
    path
}

/// The checks while the proxy's user lacks the `refused` watches (and has the `granted` ones),
/// the binding to `system:node-proxier`, and the checks once healthy; `log` is the proxy's
/// stderr.
fn refused_then_granted(node: &Netns, dir: &Path, log: &Path, refused: &[&str], granted: &[&str]) {
    // Unhealthy while a watch is refused, with the refusal at error level, and nothing granted
    // refused.
    let mut text = String::new();
    for what in refused {
        text = wait_for_refusal(log, &format!("\"{what}\""));
    }
    for other in granted {
        assert!(
            !refusals(&text)
                .iter()
                .any(|line| line.contains(&format!("\"{other}\""))),
            "{other} is granted, yet refused:\n{text}"
        );
    }
    wait_until(
        "the proxy's /healthz answers (not 200)",
        Duration::from_secs(20),
        || healthz(node).is_some(),
    );
    let code = healthz(node).unwrap();
    assert_ne!(code, 200, "healthy without EndpointSlices:\n{text}");
    assert_eq!(code, 503, "kube-proxy's unhealthy /healthz is a 503");

    // The binding that was missing: healthy without a restart (the watcher's retry, at most
    // kube-rs's default backoff of 30 s after the last refusal; here a few seconds).
    kubectl(node, dir, &["apply", "-f", "-"], Some(NODE_PROXIER)).unwrap();
    wait_until(
        "the proxy reports healthy once bound to system:node-proxier",
        Duration::from_secs(45),
        || healthz(node) == Some(200),
    );
    // And it follows the cluster: a Service it may now see reaches its rules.
    kubectl(
        node,
        dir,
        &["create", "service", "nodeport", "web", "--tcp", "80:8080"],
        None,
    )
    .unwrap();
    wait_until(
        "the Service's ClusterIP is in the proxy's nftables table",
        Duration::from_secs(20),
        || {
            let ip = kubectl(
                node,
                dir,
                &["get", "service", "web", "-o", "jsonpath={.spec.clusterIP}"],
                None,
            )
            .unwrap_or_default();
            !ip.is_empty()
                && node
                    .run(&["nft", "list", "table", "ip", "kube-proxy"])
                    .is_ok_and(|rules| rules.contains(ip.trim()))
        },
    );
}

/// The whole check against `nodeport apiserver` and `nodeport proxy`, `extra` being the
/// server's store flags.
fn standalone_proxy(node: &Netns, dir: &Path, extra: &[&str]) {
    let tokens = token_file(dir);
    let apiserver_log = dir.join("apiserver.log");
    let mut cmd = node.command(NODEPORT);
    cmd.args(["apiserver", "--port", "6443", "--data-dir"])
        .arg(dir.join("store"))
        .args(["--authorization-mode", "RBAC", "--token-auth-file"])
        .arg(&tokens)
        .args(extra)
        // Everything it logs, for the check below that no token is among it.
        .env("NODEPORT_LOG", "debug")
        .stderr(std::fs::File::create(&apiserver_log).unwrap());
    let _apiserver = node.spawn(&mut cmd).unwrap();
    wait_until("the API server is ready", Duration::from_secs(20), || {
        kubectl(node, dir, &["get", "--raw", "/readyz"], None).is_ok()
    });
    kubectl(
        node,
        dir,
        &["apply", "-f", "-"],
        Some("apiVersion: v1\nkind: Node\nmetadata: {name: node-a}\nstatus: {addresses: [{type: InternalIP, address: 192.0.2.10}]}\n"),
    )
    .unwrap();
    kubectl(
        node,
        dir,
        &["apply", "-f", "-"],
        Some(WITHOUT_ENDPOINTSLICES),
    )
    .unwrap();

    // kube-proxy's kubeconfig: the server and a bearer token.
    let kubeconfig = dir.join("proxy.kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- cluster: {{server: \"http://127.0.0.1:6443\"}}\n  name: t\ncontexts:\n- context: {{cluster: t, user: proxy}}\n  name: t\ncurrent-context: t\nusers:\n- name: proxy\n  user: {{token: {PROXY_TOKEN}}}\n"
        ),
    )
    .unwrap();
    let log = dir.join("proxy.log");
    let mut cmd = node.command(NODEPORT);
    cmd.args(["proxy", "--kubeconfig"])
        .arg(&kubeconfig)
        .args([
            "--hostname-override",
            "node-a",
            "--healthz-bind-address",
            "127.0.0.1:10256",
            "--metrics-bind-address",
            "127.0.0.1:10249",
            "--proxy-mode",
            "nftables",
        ])
        .env("NODEPORT_LOG", "warn")
        .stderr(std::fs::File::create(&log).unwrap());
    let _proxy = node.spawn(&mut cmd).unwrap();
    refused_then_granted(
        node,
        dir,
        &log,
        &["endpointslices"],
        &["services", "node", "servicecidrs"],
    );
    // Least privilege: bound to system:node-proxier, the proxy's token reads Services but
    // cannot create one (kube's 403, word for word).
    let (code, body) = create_service_as_proxy(node);
    assert_eq!(code, "403", "{body}");
    assert!(
        body.contains(&format!(
            "services is forbidden: User \\\"{PROXY_USER}\\\" cannot create resource \\\"services\\\" in API group \\\"\\\" in the namespace \\\"default\\\""
        )),
        "{body}"
    );
    // Tokens of the --token-auth-file are never logged, by the server (at debug level) or
    // by the proxy.
    for file in [&apiserver_log, &log] {
        let text = std::fs::read_to_string(file).unwrap();
        assert!(!text.is_empty(), "{} is empty", file.display());
        assert!(
            !text.contains(PROXY_TOKEN),
            "{} holds the token",
            file.display()
        );
    }
}

/// POSTs a NodePort Service with the proxy's bearer token; returns the status code and body.
fn create_service_as_proxy(node: &Netns) -> (String, String) {
    let out = node
        .run(&[
            "curl",
            "-s",
            "-w",
            "\n%{http_code}",
            "-H",
            &format!("Authorization: Bearer {PROXY_TOKEN}"),
            "-H",
            "Content-Type: application/json",
            "-d",
            r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"stolen"},"spec":{"type":"NodePort","ports":[{"port":80}]}}"#,
            "http://127.0.0.1:6443/api/v1/namespaces/default/services",
        ])
        .unwrap();
    let (body, code) = out.trim_end().rsplit_once('\n').unwrap();
    (code.to_owned(), body.to_owned())
}

#[test]
fn a_proxy_whose_token_may_not_watch_endpointslices_logs_an_error_and_is_unhealthy_until_bound() {
    if !require_tools(
        "a_proxy_whose_token_may_not_watch_endpointslices",
        &["nft", "kubectl", "curl"],
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let node = node_namespace();
    standalone_proxy(&node, dir.path(), &[]);
}

#[test]
fn on_etcd_a_proxy_whose_token_may_not_watch_endpointslices_is_unhealthy_until_bound() {
    if !require_tools(
        "on_etcd_a_proxy_whose_token_may_not_watch_endpointslices",
        &["nft", "kubectl", "curl", "etcd"],
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let node = node_namespace();
    let _etcd = etcd_in(&node, dir.path());
    standalone_proxy(
        &node,
        dir.path(),
        &["--etcd-servers", "http://127.0.0.1:2379"],
    );
}

/// `nodeport up --proxy-token-file`: the in-process proxy is the token's user, here one that
/// nothing binds yet (without the flag it would be the local administrator, which RBAC never
/// refuses), while the Node is still registered by the local administrator.
#[test]
fn ups_in_process_proxy_runs_as_the_user_of_its_token_and_is_unhealthy_until_that_user_is_bound() {
    if !require_tools(
        "ups_in_process_proxy_runs_as_the_user_of_its_token",
        &["nft", "kubectl", "curl"],
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let node = node_namespace();
    let tokens = token_file(dir);
    let proxy_token = dir.join("proxy.token");
    std::fs::write(&proxy_token, format!("{PROXY_TOKEN}\n")).unwrap();
    let log = dir.join("up.log");
    let mut cmd = node.command(NODEPORT);
    cmd.args([
        "up",
        "--hostname-override",
        "node-a",
        "--node-ip",
        "192.0.2.10",
    ])
    .args(["--healthz-bind-address", "127.0.0.1:10256", "--data-dir"])
    .arg(dir.join("store"))
    .args(["--authorization-mode", "RBAC", "--token-auth-file"])
    .arg(&tokens)
    .arg("--proxy-token-file")
    .arg(&proxy_token)
    .env("NODEPORT_LOG", "warn")
    .stderr(std::fs::File::create(&log).unwrap());
    let _up = node.spawn(&mut cmd).unwrap();
    wait_until("the API server is ready", Duration::from_secs(20), || {
        kubectl(&node, dir, &["get", "--raw", "/readyz"], None).is_ok()
    });
    refused_then_granted(&node, dir, &log, &["services", "endpointslices"], &[]);
    // The Node was registered all the same (by the local administrator, as its kubelet would).
    let addresses = kubectl(
        &node,
        dir,
        &[
            "get",
            "node",
            "node-a",
            "-o",
            "jsonpath={.status.addresses[0].address}",
        ],
        None,
    )
    .unwrap();
    assert_eq!(addresses.trim(), "192.0.2.10");
}
