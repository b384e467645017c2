//! `nodeport proxy` and `nodeport render` command lines: bad flags exit 64 naming the flag;
//! render prints the ruleset for a file of objects without touching kernel or server.

use std::process::Command;

fn nodeport(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_nodeport"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn invalid_proxy_flags_exit_64_naming_the_flag() {
    for (args, flag) in [
        (
            vec!["proxy", "--nodeport-addresses", ""],
            "--nodeport-addresses",
        ),
        (
            vec!["proxy", "--nodeport-addresses", "10.0.0.0/33"],
            "--nodeport-addresses",
        ),
        (vec!["proxy", "--cluster-cidr", "banana"], "--cluster-cidr"),
        (vec!["proxy", "--sync-period", "10"], "--sync-period"),
        (vec!["proxy", "--proxy-mode", "userspace"], "--proxy-mode"),
        (
            vec!["render", "-f", "-", "--nodeport-addresses", "x"],
            "--nodeport-addresses",
        ),
    ] {
        let out = nodeport(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{args:?}: {stderr}");
        assert!(stderr.contains(flag), "{args:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
    }
}

#[test]
fn render_prints_kube_proxys_names_for_a_file_of_objects() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("objects.yaml");
    std::fs::write(
        &file,
        r#"apiVersion: v1
kind: Service
metadata: {name: backends, namespace: default}
spec: {type: NodePort, clusterIP: 10.96.109.220, ports: [{port: 80, nodePort: 31384}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: backends-x, namespace: default, labels: {kubernetes.io/service-name: backends}}
addressType: IPv4
ports: [{port: 80}]
endpoints: [{addresses: [10.244.2.14], nodeName: kind-worker2}]
---
apiVersion: v1
kind: ConfigMap
metadata: {name: ignored}
"#,
    )
    .unwrap();
    let out = nodeport(&[
        "render",
        "-f",
        file.to_str().unwrap(),
        "--node-name",
        "kind-worker2",
        "--node-ip",
        "192.168.228.2",
        "--cluster-cidr",
        "10.244.0.0/16",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    // Names as in reference 003.
    for line in [
        "add element ip kube-proxy service-ips { 10.96.109.220 . tcp . 80 : goto service-GZEOLGI7-default/backends/tcp/ }",
        "add element ip kube-proxy service-nodeports { tcp . 31384 : goto external-GZEOLGI7-default/backends/tcp/ }",
        "add rule ip kube-proxy endpoint-LNODCRIZ-default/backends/tcp/__10.244.2.14/80 meta l4proto tcp dnat to 10.244.2.14:80",
        "add element ip kube-proxy nodeport-ips { 192.168.228.2 }",
    ] {
        assert!(text.contains(line), "missing {line:?} in:\n{text}");
    }
    assert!(String::from_utf8_lossy(&out.stderr).contains("skipping v1 ConfigMap"));
}
