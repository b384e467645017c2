//! `deploy/kube-proxy-replacement.yaml`: every object parses with k8s-openapi's types and
//! nothing is lost on the way (k8s-openapi ignores unknown fields, so a misspelt field would
//! vanish silently: the re-serialized object must equal the input); the DaemonSet runs the
//! proxy as kubeadm's kube-proxy addon runs kube-proxy; and the container's command line,
//! with the ConfigMap's files where the pod mounts them, passes `nodeport proxy --validate`;
//! and the ClusterRoleBinding, created with kubectl on our API server, gives the proxy's service
//! account exactly what the bootstrap `system:node-proxier` role allows.

mod apiserver_support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, ServiceAccount};
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use serde::de::DeserializeOwned;

const MANIFEST: &str = "deploy/kube-proxy-replacement.yaml";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The manifest's documents as JSON values, in order.
fn documents() -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(repo().join(MANIFEST)).unwrap();
    yaml_serde::Deserializer::from_str(&text)
        .map(|doc| {
            let value: serde_json::Value = serde::Deserialize::deserialize(doc).unwrap();
            value
        })
        .collect()
}

/// Parses `value` as `T` and checks that serializing it again gives `value` back.
fn typed<T: DeserializeOwned + serde::Serialize>(value: &serde_json::Value) -> T {
    let object: T = serde_json::from_value(value.clone()).unwrap_or_else(|e| {
        panic!("{} does not parse: {e}", value["kind"]);
    });
    let again = serde_json::to_value(&object).unwrap();
    assert_eq!(
        &again, value,
        "{} {} lost or changed fields when parsed (misspelt or misplaced?)",
        value["kind"], value["metadata"]["name"]
    );
    object
}

struct Manifest {
    account: ServiceAccount,
    binding: ClusterRoleBinding,
    config: ConfigMap,
    daemonset: DaemonSet,
}

fn manifest() -> Manifest {
    let docs = documents();
    let mut by_kind: BTreeMap<String, &serde_json::Value> = BTreeMap::new();
    for doc in &docs {
        let kind = doc["kind"].as_str().expect("a kind").to_owned();
        assert!(by_kind.insert(kind.clone(), doc).is_none(), "two {kind}s");
    }
    assert_eq!(
        by_kind.keys().map(String::as_str).collect::<Vec<_>>(),
        [
            "ClusterRoleBinding",
            "ConfigMap",
            "DaemonSet",
            "ServiceAccount"
        ]
    );
    Manifest {
        account: typed(by_kind["ServiceAccount"]),
        binding: typed(by_kind["ClusterRoleBinding"]),
        config: typed(by_kind["ConfigMap"]),
        daemonset: typed(by_kind["DaemonSet"]),
    }
}

#[test]
fn every_object_of_the_manifest_parses_with_k8s_openapi_and_loses_no_field() {
    let m = manifest();
    assert_eq!(m.account.metadata.namespace.as_deref(), Some("kube-system"));
    assert_eq!(m.config.metadata.namespace.as_deref(), Some("kube-system"));
    assert_eq!(
        m.daemonset.metadata.namespace.as_deref(),
        Some("kube-system")
    );
}

#[test]
fn a_misspelt_field_is_caught_by_the_round_trip() {
    // The check above must be able to fail: k8s-openapi drops `hostNetwrk` silently.
    let mut doc = documents()
        .into_iter()
        .find(|d| d["kind"] == "DaemonSet")
        .unwrap();
    doc["spec"]["template"]["spec"]["hostNetwrk"] = serde_json::Value::Bool(true);
    let result = std::panic::catch_unwind(|| typed::<DaemonSet>(&doc));
    assert!(result.is_err(), "the misspelt field went unnoticed");
}

#[test]
fn the_proxy_account_is_bound_to_kube_proxys_cluster_role() {
    let m = manifest();
    assert_eq!(m.binding.role_ref.kind, "ClusterRole");
    assert_eq!(m.binding.role_ref.name, "system:node-proxier");
    let subjects = m.binding.subjects.expect("subjects");
    assert_eq!(subjects.len(), 1);
    assert_eq!(subjects[0].kind, "ServiceAccount");
    assert_eq!(Some(&subjects[0].name), m.account.metadata.name.as_ref());
    assert_eq!(subjects[0].namespace, m.account.metadata.namespace);
}

#[test]
fn the_daemonset_runs_the_proxy_as_kubeadm_runs_kube_proxy() {
    let m = manifest();
    let spec = m.daemonset.spec.unwrap().template.spec.unwrap();
    assert_eq!(spec.service_account_name, m.account.metadata.name);
    assert_eq!(spec.host_network, Some(true));
    assert_eq!(
        spec.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    let tolerations = spec.tolerations.unwrap();
    assert!(
        tolerations
            .iter()
            .any(|t| t.operator.as_deref() == Some("Exists") && t.key.is_none()),
        "tolerates every taint"
    );
    let [container] = &spec.containers[..] else {
        panic!("one container");
    };
    assert_eq!(
        container
            .security_context
            .as_ref()
            .and_then(|s| s.privileged),
        Some(true)
    );
    let node_name = container
        .env
        .as_ref()
        .unwrap()
        .iter()
        .find(|e| e.name == "NODE_NAME")
        .expect("NODE_NAME");
    assert_eq!(
        node_name
            .value_from
            .as_ref()
            .and_then(|v| v.field_ref.as_ref())
            .map(|f| f.field_path.as_str()),
        Some("spec.nodeName")
    );
    let probe = |p: &Option<k8s_openapi::api::core::v1::Probe>| {
        let get = p.as_ref().unwrap().http_get.as_ref().unwrap();
        (get.path.clone().unwrap(), get.port.clone())
    };
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    assert_eq!(
        probe(&container.readiness_probe),
        ("/healthz".to_owned(), IntOrString::Int(10256))
    );
    assert_eq!(
        probe(&container.liveness_probe),
        ("/livez".to_owned(), IntOrString::Int(10256))
    );

    // Each mount and the host path behind it.
    let volumes: BTreeMap<String, String> = spec
        .volumes
        .unwrap()
        .into_iter()
        .map(|v| {
            let source = match (&v.host_path, &v.config_map) {
                (Some(h), _) => h.path.clone(),
                (_, Some(c)) => format!("configmap:{}", c.name),
                _ => panic!("volume {} is neither hostPath nor configMap", v.name),
            };
            (v.name, source)
        })
        .collect();
    let mounts: BTreeMap<String, String> = container
        .volume_mounts
        .as_ref()
        .unwrap()
        .iter()
        .map(|m| (m.mount_path.clone(), volumes[&m.name].clone()))
        .collect();
    let config_name = m.config.metadata.name.clone().unwrap();
    assert_eq!(
        mounts,
        BTreeMap::from([
            ("/lib/modules".to_owned(), "/lib/modules".to_owned()),
            (
                "/run/xtables.lock".to_owned(),
                "/run/xtables.lock".to_owned()
            ),
            ("/sys/fs/bpf".to_owned(), "/sys/fs/bpf".to_owned()),
            ("/sys/fs/cgroup".to_owned(), "/sys/fs/cgroup".to_owned()),
            (
                "/var/lib/nodeport-proxy".to_owned(),
                format!("configmap:{config_name}")
            ),
        ])
    );
}

#[test]
fn the_kubeconfig_points_at_the_control_plane_not_at_the_kubernetes_cluster_ip() {
    let m = manifest();
    let text = &m.config.data.unwrap()["kubeconfig.conf"];
    let kubeconfig: serde_json::Value = yaml_serde::from_str(text).unwrap();
    let server = kubeconfig["clusters"][0]["cluster"]["server"]
        .as_str()
        .unwrap();
    let uri: http::Uri = server.parse().unwrap();
    let host = uri.host().unwrap();
    assert_eq!(uri.scheme_str(), Some("https"));
    assert!(
        !host.starts_with("kubernetes") && !host.ends_with(".svc") && !host.contains(".svc."),
        "{server} is the kubernetes Service, which this proxy programs"
    );
    if let Ok(ip) = host.parse::<std::net::IpAddr>() {
        let cluster_ips: ipnet::IpNet = "10.96.0.0/12".parse().unwrap();
        assert!(!cluster_ips.contains(&ip), "{server} is a ClusterIP");
    }
}

/// The container's command line with `$(NODE_NAME)` expanded as the kubelet does, and the
/// ConfigMap's mount point moved to `dir`, where its files are written.
fn command_line_in(dir: &Path, m: &Manifest) -> Vec<String> {
    let spec = m.daemonset.spec.as_ref().unwrap();
    let container = &spec.template.spec.as_ref().unwrap().containers[0];
    let mount = "/var/lib/nodeport-proxy";
    let moved = |s: &str| s.replace(mount, dir.to_str().unwrap());
    for (name, text) in m.config.data.as_ref().unwrap() {
        std::fs::write(dir.join(name), moved(text)).unwrap();
    }
    let mut line: Vec<String> = container
        .command
        .iter()
        .flatten()
        .chain(container.args.iter().flatten())
        .map(|a| moved(&a.replace("$(NODE_NAME)", "node-a")))
        .collect();
    assert_eq!(line[0], "/usr/bin/nodeport", "the package's binary");
    line.remove(0);
    line
}

fn validate(line: &[String]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_nodeport"))
        .args(line)
        .arg("--validate")
        .output()
        .unwrap()
}

#[test]
fn the_containers_command_line_and_configmap_pass_proxy_validate() {
    let m = manifest();
    let dir = tempfile::tempdir().unwrap();
    let line = command_line_in(dir.path(), &m);
    assert_eq!(line[0], "proxy");
    let out = validate(&line);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{line:?}: {}{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("node:                node-a\n"), "{stdout}");
    assert!(
        stdout.contains("proxy mode:          nftables\n"),
        "{stdout}"
    );
    assert!(
        stdout.contains("API server:          https://control-plane.example:6443 (kubeconfig "),
        "{stdout}"
    );
    assert!(
        stdout.contains("cluster CIDRs:       10.244.0.0/16\n"),
        "{stdout}"
    );
}

#[test]
fn proxy_validate_rejects_a_bad_configmap_with_exit_64() {
    let m = manifest();
    let dir = tempfile::tempdir().unwrap();
    let line = command_line_in(dir.path(), &m);
    let config = dir.path().join("config.conf");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text.replace("mode: nftables", "mode: userspace")).unwrap();
    let out = validate(&line);
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("userspace"));

    std::fs::write(&config, text).unwrap();
    std::fs::write(
        dir.path().join("kubeconfig.conf"),
        "current-context: nowhere\n",
    )
    .unwrap();
    let out = validate(&line);
    assert_eq!(out.status.code(), Some(64));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no context \"nowhere\""),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The manifest's ClusterRoleBinding, created with kubectl on our API server (RBAC's bootstrap
/// policy holds `system:node-proxier`), lets the service account read what the proxy watches and
/// nothing more: `kubectl auth can-i` as that account, as kube-apiserver would answer it.
#[test]
fn the_cluster_role_binding_created_with_kubectl_grants_the_proxy_what_kube_proxy_gets() {
    if !apiserver_support::kubectl_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let binding = documents()
        .into_iter()
        .find(|d| d["kind"] == "ClusterRoleBinding")
        .unwrap();
    let file = dir.path().join("binding.json");
    std::fs::write(&file, serde_json::to_vec(&binding).unwrap()).unwrap();
    // RBAC explicitly: on loopback the default is AlwaysAllow (the quick start's).
    let server = apiserver_support::Server::start(
        &dir.path().join("data"),
        &["--authorization-mode", "RBAC"],
    );
    let out = server.kubectl(&["create", "-f", file.to_str().unwrap()]);
    let (stdout, stderr) = apiserver_support::text(&out);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(
        stdout.contains("clusterrolebinding.rbac.authorization.k8s.io/nodeport-proxy created"),
        "{stdout}"
    );
    let account = "system:serviceaccount:kube-system:nodeport-proxy";
    for (verb, resource, expected) in [
        // system:node-proxier (kube 1.33's bootstrap policy): list/watch the Services and
        // EndpointSlices it programs, get the Nodes, write events...
        ("list", "services", "yes"),
        ("watch", "endpointslices.discovery.k8s.io", "yes"),
        ("get", "nodes", "yes"),
        ("create", "events.events.k8s.io", "yes"),
        // ...and nothing that would let a node rewrite the cluster.
        ("create", "services", "no"),
        ("delete", "endpointslices.discovery.k8s.io", "no"),
        ("update", "nodes", "no"),
    ] {
        let out = server.kubectl(&["auth", "can-i", verb, resource, "--as", account]);
        let (stdout, stderr) = apiserver_support::text(&out);
        assert_eq!(
            stdout.trim(),
            expected,
            "can-i {verb} {resource} as {account}: {stderr}"
        );
    }
}
