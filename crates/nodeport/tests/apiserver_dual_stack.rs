//! Dual-stack Services with the real kubectl against `nodeport apiserver
//! --service-cluster-ip-range <v4>,<v6>`, and on real etcd with several API servers: both
//! families' ClusterIPs allocated and released in the transaction that saves the Service.

mod apiserver_support;

use std::collections::HashSet;
use std::sync::{Arc, Barrier};

use apiserver_support::etcd::{Etcd, etcd_available, replicas};
use apiserver_support::{Server, kubectl_available, text};
use nodeport_apiserver::registry::{service::ServiceRanges, verify_dump};
use nodeport_apiserver::storage::etcd::{Config as EtcdConfig, EtcdBackend};
use serde_json::Value;

const DUAL: &str = "10.96.0.0/16,fd00:10:96::/108";

const WEB: &str = "apiVersion: v1
kind: Service
metadata:
  name: web
spec:
  type: NodePort
  ipFamilyPolicy: PreferDualStack
  selector: {app: web}
  ports:
  - port: 80
";

fn ok(server: &Server, args: &[&str]) -> String {
    let out = server.kubectl(args);
    let (stdout, stderr) = text(&out);
    assert!(
        out.status.success(),
        "kubectl {args:?} failed:\n{stdout}\n{stderr}"
    );
    stdout
}

fn refused(server: &Server, args: &[&str]) -> String {
    let out = server.kubectl(args);
    let (stdout, stderr) = text(&out);
    assert!(
        !out.status.success(),
        "kubectl {args:?} succeeded:\n{stdout}"
    );
    stderr
}

fn json(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

fn cluster_ips(server: &Server, name: &str) -> Vec<String> {
    let out = ok(server, &["get", "svc", name, "-o", "json"]);
    json(&out)["spec"]["clusterIPs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn kubectl_creates_reads_upgrades_and_downgrades_a_dual_stack_service() {
    if !kubectl_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(
        &dir.path().join("data"),
        &["--service-cluster-ip-range", DUAL],
    );
    let file = dir.path().join("web.yaml");
    std::fs::write(&file, WEB).unwrap();
    assert_eq!(
        ok(&server, &["create", "-f", file.to_str().unwrap()]).trim(),
        "service/web created"
    );
    let ips = cluster_ips(&server, "web");
    assert_eq!(ips.len(), 2, "{ips:?}");
    assert!(ips[0].starts_with("10.96.") && ips[1].starts_with("fd00:10:96::"));
    let families = ok(
        &server,
        &["get", "svc", "web", "-o", "jsonpath={.spec.ipFamilies}"],
    );
    assert_eq!(families, r#"["IPv4","IPv6"]"#);
    // `kubectl get` shows the primary ClusterIP, as for kube-apiserver.
    let row = ok(&server, &["get", "svc", "web", "--no-headers"]);
    assert!(row.contains(&ips[0]), "{row}");
    let described = ok(&server, &["describe", "svc", "web"]);
    let field = |name: &str| {
        described
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(str::trim)
            .unwrap_or_default()
            .to_owned()
    };
    assert_eq!(field("IP Family Policy:"), "PreferDualStack", "{described}");
    assert_eq!(field("IP Families:"), "IPv4,IPv6", "{described}");
    assert_eq!(
        field("IPs:"),
        format!("{},{}", ips[0], ips[1]),
        "{described}"
    );

    // Downgrade, then upgrade again (a new secondary address).
    ok(
        &server,
        &[
            "patch",
            "svc",
            "web",
            "-p",
            r#"{"spec":{"ipFamilyPolicy":"SingleStack"}}"#,
        ],
    );
    assert_eq!(cluster_ips(&server, "web"), vec![ips[0].clone()]);
    ok(
        &server,
        &[
            "patch",
            "svc",
            "web",
            "-p",
            r#"{"spec":{"ipFamilyPolicy":"RequireDualStack"}}"#,
        ],
    );
    let upgraded = cluster_ips(&server, "web");
    assert_eq!(upgraded.len(), 2);
    assert_eq!(upgraded[0], ips[0]);
    // A downgrade that keeps PreferDualStack is refused with kube's text.
    let err = refused(
        &server,
        &[
            "patch",
            "svc",
            "web",
            "--type",
            "merge",
            "-p",
            &format!(
                r#"{{"spec":{{"ipFamilyPolicy":"PreferDualStack","clusterIPs":["{}"]}}}}"#,
                ips[0]
            ),
        ],
    );
    assert!(
        err.contains(
            "spec.ipFamilyPolicy: Invalid value: \"PreferDualStack\": must be 'SingleStack' to \
             release the secondary cluster IP"
        ),
        "{err}"
    );

    // The secondary bitmap follows: one IPv6 address in use, none once the Service is gone.
    let ranges = ok(&server, &["get", "--raw", "/ranges"]);
    assert_eq!(json(&ranges)["secondaryClusterIPs"]["used"], 1, "{ranges}");
    ok(&server, &["delete", "svc", "web"]);
    let ranges = ok(&server, &["get", "--raw", "/ranges"]);
    assert_eq!(json(&ranges)["secondaryClusterIPs"]["used"], 0, "{ranges}");
    assert_eq!(json(&ranges)["clusterIPs"]["used"], 1, "{ranges}");
}

#[test]
fn kubectl_require_dual_stack_on_a_single_stack_server_gets_kubes_refusal() {
    if !kubectl_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(
        &dir.path().join("data"),
        &["--service-cluster-ip-range", "fd00:10:96::/108"],
    );
    let file = dir.path().join("web.yaml");
    std::fs::write(&file, WEB.replace("PreferDualStack", "RequireDualStack")).unwrap();
    let err = refused(&server, &["create", "-f", file.to_str().unwrap()]);
    assert!(
        err.contains(
            "The Service \"web\" is invalid: spec.ipFamilyPolicy: Invalid value: \
             \"RequireDualStack\": this cluster is not configured for dual-stack services"
        ),
        "{err}"
    );
}

#[test]
fn a_dual_stack_range_of_one_family_twice_or_three_ranges_are_refused_at_start() {
    for (flag, message) in [
        (
            "10.96.0.0/16,10.97.0.0/16",
            "--service-cluster-ip-range[0] and --service-cluster-ip-range[1] must be of different IP family",
        ),
        (
            "10.96.0.0/16,fd00::/108,fd01::/108",
            "--service-cluster-ip-range must not contain more than two entries",
        ),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_nodeport"))
            .args(["apiserver", "--service-cluster-ip-range", flag])
            .output()
            .unwrap();
        let (_, stderr) = text(&out);
        // A usage error (exit status 64, EX_USAGE, as for every bad flag).
        assert_eq!(out.status.code(), Some(64), "{stderr}");
        assert!(stderr.contains(message), "{stderr}");
    }
}

/// Dual-stack Services created at once through three API servers on one etcd: no address of
/// either family given twice, and the stored bitmaps equal what the Services hold.
#[test]
fn three_replicas_on_etcd_create_dual_stack_services_without_doubling_either_family() {
    if !etcd_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(&dir.path().join("etcd"));
    let servers = replicas(
        &etcd,
        dir.path(),
        3,
        &[
            "--service-cluster-ip-range",
            "10.96.0.0/24,fd00:10:96::/120",
        ],
    );
    let ports: Vec<u16> = servers.iter().map(|s| s.port).collect();
    let barrier = Arc::new(Barrier::new(12));
    let threads: Vec<_> = (0..12)
        .map(|t| {
            let (barrier, port) = (barrier.clone(), ports[t % 3]);
            std::thread::spawn(move || {
                barrier.wait();
                for i in 0..10 {
                    let body = format!(
                        r#"{{"apiVersion":"v1","kind":"Service","metadata":{{"name":"s{t}-{i}"}},"spec":{{"ipFamilyPolicy":"RequireDualStack","ports":[{{"port":80}}]}}}}"#
                    );
                    let (status, body) = apiserver_support::http(
                        port,
                        "POST",
                        "/api/v1/namespaces/default/services",
                        Some(&body),
                    )
                    .unwrap();
                    assert_eq!(status, 201, "{body}");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    // Some deletes, to release both families.
    for i in 0..10 {
        let (status, body) = servers[i % 3]
            .try_http(
                "DELETE",
                &format!("/api/v1/namespaces/default/services/s0-{i}"),
                None,
            )
            .unwrap();
        assert_eq!(status, 200, "{body}");
    }
    let (status, body) = servers[1]
        .try_http("GET", "/api/v1/services", None)
        .unwrap();
    assert_eq!(status, 200);
    let items = json(&body)["items"].as_array().unwrap().clone();
    assert_eq!(items.len(), 110 + 1);
    let mut seen = HashSet::new();
    for item in &items {
        for ip in item["spec"]["clusterIPs"].as_array().unwrap() {
            let ip = ip.as_str().unwrap().to_owned();
            assert!(seen.insert(ip.clone()), "{ip} given twice");
        }
    }
    assert_eq!(seen.len(), 110 * 2 + 1);

    let runtime = tokio::runtime::Runtime::new().unwrap();
    let dump = runtime.block_on(async {
        let backend = EtcdBackend::connect(EtcdConfig::new(vec![etcd.url()]), "/registry")
            .await
            .unwrap();
        backend.dump().await.unwrap()
    });
    assert!(
        dump.iter()
            .any(|kv| kv.key == "/registry/ranges/secondaryserviceips"),
        "the secondary bitmap is stored under kube-apiserver's key"
    );
    let ranges = ServiceRanges {
        node_ports: nodeport_apiserver::PortRange::default(),
        cluster_ips: "10.96.0.0/24".parse().unwrap(),
        secondary_cluster_ips: Some("fd00:10:96::/120".parse().unwrap()),
    };
    let report = verify_dump(&dump, "/registry", &ranges).unwrap();
    assert!(report.is_consistent(), "{report:?}");
    assert!(report.secondary_bitmap_revision.is_some());
}

const MORE: &str = "apiVersion: networking.k8s.io/v1
kind: ServiceCIDR
metadata:
  name: more
spec:
  cidrs: [10.97.0.0/28, fd00:10:97::/112]
";

/// kube 1.33's way to grow the ClusterIP space, with kubectl: a second ServiceCIDR added when
/// the first is full lets creates continue; deleting it while a Service uses it waits on its
/// finalizer; `kubectl get servicecidrs` shows kube's columns.
#[test]
fn kubectl_adds_a_service_cidr_when_the_first_is_full_and_its_delete_waits_on_the_finalizer() {
    if !kubectl_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(
        &dir.path().join("data"),
        &["--service-cluster-ip-range", "10.96.0.0/28"],
    );
    for i in 0..13 {
        ok(
            &server,
            &[
                "create",
                "service",
                "clusterip",
                &format!("s{i}"),
                "--tcp=80",
            ],
        );
    }
    let err = refused(
        &server,
        &["create", "service", "clusterip", "full", "--tcp=80"],
    );
    assert!(
        err.contains("failed to allocate a serviceIP: range is full"),
        "{err}"
    );
    let file = dir.path().join("more.yaml");
    std::fs::write(&file, MORE).unwrap();
    assert_eq!(
        ok(&server, &["create", "-f", file.to_str().unwrap()]).trim(),
        "servicecidr.networking.k8s.io/more created"
    );
    let table = ok(&server, &["get", "servicecidrs"]);
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(header, ["NAME", "CIDRS", "AGE"], "{table}");
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("more ") && l.contains("10.97.0.0/28,fd00:10:97::/112")),
        "{table}"
    );
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("kubernetes ") && l.contains("10.96.0.0/28")),
        "{table}"
    );
    ok(
        &server,
        &["create", "service", "clusterip", "full", "--tcp=80"],
    );
    let ip = ok(
        &server,
        &["get", "svc", "full", "-o", "jsonpath={.spec.clusterIP}"],
    );
    assert!(ip.starts_with("10.97.0."), "{ip}");
    // `kubectl get ipaddresses`: kube's columns, one row per ClusterIP with its Service.
    let table = ok(&server, &["get", "ipaddresses"]);
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(header, ["NAME", "PARENTREF"], "{table}");
    assert_eq!(table.lines().count(), 1 + 14 + 1, "{table}");
    let row: Vec<&str> = table
        .lines()
        .find(|l| l.starts_with(&format!("{ip} ")))
        .unwrap_or_else(|| panic!("no row for {ip}: {table}"))
        .split_whitespace()
        .collect();
    assert_eq!(row, [ip.as_str(), "services/default/full"], "{table}");
    assert!(
        table
            .lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>()
                == ["10.96.0.1", "services/default/kubernetes"]),
        "{table}"
    );

    // Deleting the ServiceCIDR in use: accepted, but it stays (finalizer) until `full` goes.
    ok(&server, &["delete", "servicecidr", "more", "--wait=false"]);
    let ready = ok(
        &server,
        &[
            "get",
            "servicecidr",
            "more",
            "-o",
            "jsonpath={.status.conditions[0].reason}",
        ],
    );
    assert_eq!(ready, "Terminating");
    std::thread::sleep(std::time::Duration::from_millis(1500));
    ok(&server, &["get", "servicecidr", "more"]);
    ok(&server, &["delete", "svc", "full"]);
    // `kubectl wait --for=delete` returns once the finalizer is gone and the object with it.
    ok(
        &server,
        &["wait", "--for=delete", "servicecidr/more", "--timeout=20s"],
    );
    let out = server.kubectl(&["get", "servicecidr", "more"]);
    assert!(!out.status.success());
}

/// Three API servers on one etcd add ServiceCIDRs while they create Services: every address
/// once, and each ServiceCIDR's addresses come from its range.
#[test]
fn three_replicas_on_etcd_add_service_cidrs_while_creating_services_without_doubling_an_address() {
    if !etcd_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(&dir.path().join("etcd"));
    let servers = replicas(
        &etcd,
        dir.path(),
        3,
        &["--service-cluster-ip-range", "10.96.0.0/27"],
    );
    let ports: Vec<u16> = servers.iter().map(|s| s.port).collect();
    let barrier = Arc::new(Barrier::new(9));
    let threads: Vec<_> = (0..9)
        .map(|t| {
            let (barrier, port) = (barrier.clone(), ports[t % 3]);
            std::thread::spawn(move || {
                barrier.wait();
                if t < 3 {
                    let body = format!(
                        r#"{{"apiVersion":"networking.k8s.io/v1","kind":"ServiceCIDR","metadata":{{"name":"extra-{t}"}},"spec":{{"cidrs":["10.9{t}.1.0/28"]}}}}"#
                    );
                    let (status, body) = apiserver_support::http(
                        port,
                        "POST",
                        "/apis/networking.k8s.io/v1/servicecidrs",
                        Some(&body),
                    )
                    .unwrap();
                    assert_eq!(status, 201, "{body}");
                    return 0;
                }
                let mut created = 0;
                for i in 0..12 {
                    let body = format!(
                        r#"{{"apiVersion":"v1","kind":"Service","metadata":{{"name":"s{t}-{i}"}},"spec":{{"ports":[{{"port":80}}]}}}}"#
                    );
                    let (status, body) = apiserver_support::http(
                        port,
                        "POST",
                        "/api/v1/namespaces/default/services",
                        Some(&body),
                    )
                    .unwrap();
                    // Early ones may find only the flag's /27 (30 addresses) and fill it.
                    match status {
                        201 => created += 1,
                        500 => assert!(body.contains("range is full"), "{body}"),
                        _ => panic!("{status}: {body}"),
                    }
                }
                created
            })
        })
        .collect();
    let created: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
    let (status, body) = servers[2]
        .try_http("GET", "/api/v1/services", None)
        .unwrap();
    assert_eq!(status, 200);
    let items = json(&body)["items"].as_array().unwrap().clone();
    assert_eq!(items.len(), created + 1);
    let mut seen = HashSet::new();
    for item in &items {
        let ip = item["spec"]["clusterIP"].as_str().unwrap().to_owned();
        assert!(seen.insert(ip.clone()), "{ip} given twice");
    }
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let dump = runtime.block_on(async {
        let backend = EtcdBackend::connect(EtcdConfig::new(vec![etcd.url()]), "/registry")
            .await
            .unwrap();
        backend.dump().await.unwrap()
    });
    let ranges = ServiceRanges {
        node_ports: nodeport_apiserver::PortRange::default(),
        cluster_ips: "10.96.0.0/27".parse().unwrap(),
        secondary_cluster_ips: None,
    };
    let report = verify_dump(&dump, "/registry", &ranges).unwrap();
    assert!(report.is_consistent(), "{report:?}");
}

/// A restart with another `--service-cluster-ip-range`, as kube-apiserver 1.33 handles it: the
/// default ServiceCIDR `kubernetes` is not rewritten (its controller logs the inconsistency;
/// kubernetes.io, "Kubernetes Default Service CIDR Reconfiguration": every API server must
/// match it, the operator reconfigures), and since ClusterIPs come from ServiceCIDRs only
/// (`MetaAllocator`), its range keeps giving addresses and the new flag's gives none until a
/// ServiceCIDR names it, as the reconfiguration task does first. On both stores.
fn restart_with_another_range(dir: &std::path::Path, store: &[&str]) {
    let data = dir.join("data");
    let args = |range: &'static str| {
        let mut all = vec!["--service-cluster-ip-range", range];
        all.extend_from_slice(store);
        all
    };
    let mut server = Server::start(&data, &args("10.96.0.0/28"));
    for i in 0..3 {
        ok(
            &server,
            &[
                "create",
                "service",
                "clusterip",
                &format!("old{i}"),
                "--tcp=80",
            ],
        );
    }
    let old_ip = ok(
        &server,
        &["get", "svc", "old0", "-o", "jsonpath={.spec.clusterIP}"],
    );
    server.terminate();
    drop(server);

    let server = Server::start(&data, &args("10.100.0.0/28,fd00:10:100::/120"));
    let cidrs = ok(
        &server,
        &[
            "get",
            "servicecidr",
            "kubernetes",
            "-o",
            "jsonpath={.spec.cidrs}",
        ],
    );
    assert_eq!(cidrs, r#"["10.96.0.0/28"]"#, "the default is not rewritten");
    // kube's default ServiceCIDR controller reports the mismatch once, as a Warning Event
    // about the ServiceCIDR (`syncStatus`, pkg/controlplane/controller/defaultservicecidr).
    let events = ok(
        &server,
        &[
            "get",
            "events",
            "-n",
            "default",
            "--field-selector",
            "reason=KubernetesDefaultServiceCIDRInconsistent",
            "-o",
            "jsonpath={range .items[*]}{.type}|{.involvedObject.apiVersion}|{.involvedObject.kind}/{.involvedObject.name}|{.source.component}|{.count}|{.message}{\"\\n\"}{end}",
        ],
    );
    assert_eq!(
        events.trim(),
        "Warning|networking.k8s.io/v1|ServiceCIDR/kubernetes|kubernetes-service-cidr-controller|1|The default ServiceCIDR [10.96.0.0/28] does not match the controller flag configurations [10.100.0.0/28 fd00:10:100::/120]"
    );
    // The old range's held address is still taken...
    let err = refused(
        &server,
        &[
            "create",
            "service",
            "clusterip",
            "clash",
            "--tcp=80",
            &format!("--clusterip={old_ip}"),
        ],
    );
    assert!(err.contains("provided IP is already allocated"), "{err}");
    // ...the new flag range is in no ServiceCIDR: nothing comes from it...
    let err = refused(
        &server,
        &[
            "create",
            "service",
            "clusterip",
            "new-range",
            "--tcp=80",
            "--clusterip=10.100.0.5",
        ],
    );
    assert!(
        err.contains(
            "failed to allocate IP 10.100.0.5: the provided network does not match the current range"
        ),
        "{err}"
    );
    // ...and the old range gives its 10 free addresses, no more.
    let mut seen = HashSet::new();
    for i in 0..10 {
        let name = format!("new{i}");
        ok(
            &server,
            &["create", "service", "clusterip", &name, "--tcp=80"],
        );
        let ip = ok(
            &server,
            &["get", "svc", &name, "-o", "jsonpath={.spec.clusterIP}"],
        );
        assert!(ip.starts_with("10.96.0."), "{ip}");
        assert!(seen.insert(ip.clone()), "{ip} twice");
    }
    let err = refused(
        &server,
        &["create", "service", "clusterip", "full", "--tcp=80"],
    );
    assert!(err.contains("range is full"), "{err}");
    // The reconfiguration's first step: a ServiceCIDR for the new ranges. Creates continue
    // there, and dual-stack Services get both families.
    let file = dir.join("new-range.yaml");
    std::fs::write(
        &file,
        "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: new-range}\nspec: {cidrs: [10.100.0.0/28, \"fd00:10:100::/120\"]}\n",
    )
    .unwrap();
    ok(&server, &["create", "-f", file.to_str().unwrap()]);
    ok(
        &server,
        &["create", "service", "clusterip", "full", "--tcp=80"],
    );
    let ip = ok(
        &server,
        &["get", "svc", "full", "-o", "jsonpath={.spec.clusterIP}"],
    );
    assert!(ip.starts_with("10.100.0."), "{ip}");
    let file = dir.join("web.yaml");
    std::fs::write(&file, WEB).unwrap();
    ok(&server, &["create", "-f", file.to_str().unwrap()]);
    let ips = cluster_ips(&server, "web");
    assert!(
        ips.len() == 2 && ips[0].starts_with("10.100.0.") && ips[1].starts_with("fd00:10:100::"),
        "{ips:?}"
    );
}

#[test]
fn a_restart_with_another_range_keeps_the_default_service_cidr_and_allocates_only_from_service_cidrs()
 {
    if !kubectl_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    restart_with_another_range(dir.path(), &[]);
}

#[test]
fn on_etcd_a_restart_with_another_range_keeps_the_default_service_cidr_and_allocates_only_from_service_cidrs()
 {
    if !kubectl_available() || !etcd_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(&dir.path().join("etcd"));
    let url = etcd.url();
    restart_with_another_range(dir.path(), &["--etcd-servers", &url]);
}

/// A single-stack server restarted with a second range of the other family after its own, as
/// kube-apiserver 1.33 handles it (its default ServiceCIDR controller, since
/// kubernetes/kubernetes#131263): the default ServiceCIDR `kubernetes` becomes dual-stack, the
/// earlier Services keep their addresses, and dual-stack Services get both families.
fn single_to_dual_stack_restart(dir: &std::path::Path, store: &[&str]) {
    let data = dir.join("data");
    let args = |range: &'static str| {
        let mut all = vec!["--service-cluster-ip-range", range];
        all.extend_from_slice(store);
        all
    };
    let mut server = Server::start(&data, &args("10.96.0.0/24"));
    ok(
        &server,
        &["create", "service", "clusterip", "old", "--tcp=80"],
    );
    let old_ip = ok(
        &server,
        &["get", "svc", "old", "-o", "jsonpath={.spec.clusterIP}"],
    );
    server.terminate();
    drop(server);

    let mut server = Server::start(&data, &args("10.96.0.0/24,fd00:10:96::/120"));
    let cidrs = ok(
        &server,
        &[
            "get",
            "servicecidr",
            "kubernetes",
            "-o",
            "jsonpath={.spec.cidrs}",
        ],
    );
    assert_eq!(cidrs, r#"["10.96.0.0/24","fd00:10:96::/120"]"#);
    let listed = ok(&server, &["get", "servicecidrs"]);
    assert!(
        listed
            .lines()
            .any(|l| l.starts_with("kubernetes ") && l.contains("10.96.0.0/24,fd00:10:96::/120")),
        "{listed}"
    );
    assert_eq!(
        ok(
            &server,
            &["get", "svc", "old", "-o", "jsonpath={.spec.clusterIP}"]
        ),
        old_ip
    );
    let file = dir.join("web.yaml");
    std::fs::write(&file, WEB.replace("PreferDualStack", "RequireDualStack")).unwrap();
    ok(&server, &["create", "-f", file.to_str().unwrap()]);
    let ips = cluster_ips(&server, "web");
    assert!(
        ips.len() == 2 && ips[0].starts_with("10.96.0.") && ips[1].starts_with("fd00:10:96::"),
        "{ips:?}"
    );
    // Another restart with the same flags changes nothing.
    let before = ok(
        &server,
        &[
            "get",
            "servicecidr",
            "kubernetes",
            "-o",
            "jsonpath={.metadata.resourceVersion}",
        ],
    );
    server.terminate();
    drop(server);
    let server = Server::start(&data, &args("10.96.0.0/24,fd00:10:96::/120"));
    let after = ok(
        &server,
        &[
            "get",
            "servicecidr",
            "kubernetes",
            "-o",
            "jsonpath={.metadata.resourceVersion}",
        ],
    );
    assert_eq!(before, after);
}

#[test]
fn a_single_stack_server_restarted_dual_stack_makes_the_default_service_cidr_dual_stack() {
    if !kubectl_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    single_to_dual_stack_restart(dir.path(), &[]);
}

#[test]
fn on_etcd_a_single_stack_server_restarted_dual_stack_makes_the_default_service_cidr_dual_stack() {
    if !kubectl_available() || !etcd_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(&dir.path().join("etcd"));
    let url = etcd.url();
    single_to_dual_stack_restart(dir.path(), &["--etcd-servers", &url]);
}

/// The default ServiceCIDR as kube 1.33 keeps it: it carries the ServiceCIDR controller's
/// finalizer like every ServiceCIDR; deleted while Services hold addresses only it covers, it
/// stays `Ready=False` (`Terminating`) and gives no new address; once another ServiceCIDR
/// covers them it goes, and kube-apiserver's default ServiceCIDR controller creates it again
/// from the flags.
fn default_service_cidr_deletion(dir: &std::path::Path, store: &[&str]) {
    let mut args = vec!["--service-cluster-ip-range", "10.96.0.0/28"];
    args.extend_from_slice(store);
    let server = Server::start(&dir.join("data"), &args);
    let get = |path: &str| {
        ok(
            &server,
            &[
                "get",
                "servicecidr",
                "kubernetes",
                "-o",
                &format!("jsonpath={path}"),
            ],
        )
    };
    assert_eq!(
        get("{.metadata.finalizers}"),
        r#"["networking.k8s.io/service-cidr-finalizer"]"#
    );
    let uid = get("{.metadata.uid}");
    ok(
        &server,
        &["create", "service", "clusterip", "a", "--tcp=80"],
    );
    ok(
        &server,
        &["delete", "servicecidr", "kubernetes", "--wait=false"],
    );
    let object = json(&ok(
        &server,
        &["get", "servicecidr", "kubernetes", "-o", "json"],
    ));
    assert!(
        object["metadata"]["deletionTimestamp"].is_string(),
        "{object}"
    );
    let ready = &object["status"]["conditions"][0];
    assert_eq!(ready["type"], "Ready", "{object}");
    assert_eq!(ready["status"], "False", "{object}");
    assert_eq!(ready["reason"], "Terminating", "{object}");
    let err = refused(
        &server,
        &["create", "service", "clusterip", "b", "--tcp=80"],
    );
    assert!(err.contains("range is full"), "{err}");
    // Another ServiceCIDR covers its addresses: it goes, and comes back from the flags.
    let file = dir.join("wide.yaml");
    std::fs::write(
        &file,
        "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: wide}\nspec: {cidrs: [10.96.0.0/24]}\n",
    )
    .unwrap();
    ok(&server, &["create", "-f", file.to_str().unwrap()]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let out = server.kubectl(&[
            "get",
            "servicecidr",
            "kubernetes",
            "-o",
            "jsonpath={.metadata.uid} {.metadata.deletionTimestamp}",
        ]);
        let (now, _) = text(&out);
        if out.status.success() && !now.trim().is_empty() && now.trim() != uid {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the default ServiceCIDR was not removed and created again: {now:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    assert_eq!(get("{.spec.cidrs}"), r#"["10.96.0.0/28"]"#);
    assert_eq!(
        get("{.metadata.finalizers}"),
        r#"["networking.k8s.io/service-cidr-finalizer"]"#
    );
    ok(
        &server,
        &["create", "service", "clusterip", "b", "--tcp=80"],
    );
}

#[test]
fn the_default_service_cidr_keeps_its_finalizer_until_another_covers_its_addresses_then_comes_back()
{
    if !kubectl_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    default_service_cidr_deletion(dir.path(), &[]);
}

#[test]
fn on_etcd_the_default_service_cidr_keeps_its_finalizer_until_another_covers_its_addresses() {
    if !kubectl_available() || !etcd_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(&dir.path().join("etcd"));
    let url = etcd.url();
    default_service_cidr_deletion(dir.path(), &["--etcd-servers", &url]);
}

/// A user's IPAddress reserves its address, as in kube 1.33 (the allocator skips an address
/// whose IPAddress exists), in the flag's range and in an added ServiceCIDR alike, until it is
/// deleted; `kubectl get ipaddresses` lists it beside the allocator's.
fn ip_address_reservations(dir: &std::path::Path, store: &[&str]) {
    let mut args = vec!["--service-cluster-ip-range", "10.96.0.0/24"];
    args.extend_from_slice(store);
    let server = Server::start(&dir.join("data"), &args);
    let file = dir.join("reservations.yaml");
    std::fs::write(
        &file,
        "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: more}\nspec: {cidrs: [10.97.0.0/24]}\n---\n\
         apiVersion: networking.k8s.io/v1\nkind: IPAddress\nmetadata: {name: 10.96.0.10}\nspec: {parentRef: {group: \"\", resource: services, namespace: kube-system, name: kube-dns}}\n---\n\
         apiVersion: networking.k8s.io/v1\nkind: IPAddress\nmetadata: {name: 10.97.0.10}\nspec: {parentRef: {group: \"\", resource: services, namespace: default, name: later}}\n",
    )
    .unwrap();
    ok(&server, &["create", "-f", file.to_str().unwrap()]);
    let listed = ok(&server, &["get", "ipaddresses"]);
    assert!(
        listed
            .lines()
            .any(|l| l.starts_with("10.96.0.10 ") && l.contains("services/kube-system/kube-dns")),
        "{listed}"
    );
    for ip in ["10.96.0.10", "10.97.0.10"] {
        let err = refused(
            &server,
            &[
                "create",
                "service",
                "clusterip",
                "taker",
                "--tcp=80",
                &format!("--clusterip={ip}"),
            ],
        );
        assert!(
            err.contains(&format!(
                "failed to allocate IP {ip}: provided IP is already allocated"
            )),
            "{err}"
        );
    }
    ok(&server, &["delete", "ipaddress", "10.97.0.10"]);
    ok(
        &server,
        &[
            "create",
            "service",
            "clusterip",
            "later",
            "--tcp=80",
            "--clusterip=10.97.0.10",
        ],
    );
    let owner = ok(
        &server,
        &[
            "get",
            "ipaddress",
            "10.97.0.10",
            "-o",
            "jsonpath={.spec.parentRef.name} {.metadata.labels.ipaddress\\.kubernetes\\.io/managed-by}",
        ],
    );
    assert_eq!(owner, "later ipallocator.k8s.io");
}

#[test]
fn a_users_ip_address_reserves_its_address_in_the_flags_range_and_an_added_service_cidr() {
    if !kubectl_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    ip_address_reservations(dir.path(), &[]);
}

#[test]
fn on_etcd_a_users_ip_address_reserves_its_address_in_the_flags_range_and_an_added_service_cidr() {
    if !kubectl_available() || !etcd_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(&dir.path().join("etcd"));
    let url = etcd.url();
    ip_address_reservations(dir.path(), &["--etcd-servers", &url]);
}

/// The verification loop (`--allocation-check-interval`, kube's repair loop of the
/// IPAddress allocator) writes again an allocator's IPAddress deleted by hand, and removes one
/// in the allocator's name that no Service holds, in the running server.
fn repair_loop(dir: &std::path::Path, store: &[&str]) {
    let mut args = vec![
        "--service-cluster-ip-range",
        "10.96.0.0/24",
        "--allocation-check-interval",
        "1",
    ];
    args.extend_from_slice(store);
    let server = Server::start(&dir.join("data"), &args);
    ok(
        &server,
        &["create", "service", "clusterip", "web", "--tcp=80"],
    );
    let ip = ok(
        &server,
        &["get", "svc", "web", "-o", "jsonpath={.spec.clusterIP}"],
    );
    ok(&server, &["delete", "ipaddress", &ip]);
    let file = dir.join("stale.yaml");
    std::fs::write(
        &file,
        "apiVersion: networking.k8s.io/v1\nkind: IPAddress\nmetadata: {name: 10.96.0.77, labels: {ipaddress.kubernetes.io/managed-by: ipallocator.k8s.io}}\nspec: {parentRef: {group: \"\", resource: services, namespace: default, name: gone}}\n",
    )
    .unwrap();
    ok(&server, &["create", "-f", file.to_str().unwrap()]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let listed = ok(&server, &["get", "ipaddresses", "-o", "name"]);
        let back = listed
            .lines()
            .any(|l| l == format!("ipaddress.networking.k8s.io/{ip}"));
        let stale = listed.contains("10.96.0.77");
        if back && !stale {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not repaired (missing {ip} back: {back}, stale 10.96.0.77 gone: {}):\n{listed}",
            !stale
        );
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
    // The stale one's address is free again.
    ok(
        &server,
        &[
            "create",
            "service",
            "clusterip",
            "seventy-seven",
            "--tcp=80",
            "--clusterip=10.96.0.77",
        ],
    );
}

#[test]
fn the_verification_loop_repairs_ip_addresses_in_a_running_server() {
    if !kubectl_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    repair_loop(dir.path(), &[]);
}

#[test]
fn on_etcd_the_verification_loop_repairs_ip_addresses_in_a_running_server() {
    if !kubectl_available() || !etcd_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(&dir.path().join("etcd"));
    let url = etcd.url();
    repair_loop(dir.path(), &["--etcd-servers", &url]);
}

/// Each dual-stack create writes the Service and two IPAddress objects: two hundred at once on
/// one replica still commit, the writer keeping every etcd transaction within etcd's default
/// `--max-txn-ops` (128) by moving what does not fit to the next batch.
#[test]
fn two_hundred_concurrent_dual_stack_creates_on_etcd_fit_etcds_operation_limit() {
    if !etcd_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(&dir.path().join("etcd"));
    let servers = replicas(
        &etcd,
        dir.path(),
        1,
        &[
            "--service-cluster-ip-range",
            "10.96.0.0/16,fd00:10:96::/108",
        ],
    );
    let port = servers[0].port;
    let barrier = Arc::new(Barrier::new(200));
    let threads: Vec<_> = (0..200)
        .map(|i| {
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                let body = format!(
                    r#"{{"apiVersion":"v1","kind":"Service","metadata":{{"name":"c{i}"}},"spec":{{"ipFamilyPolicy":"RequireDualStack","ports":[{{"port":80}}]}}}}"#
                );
                barrier.wait();
                apiserver_support::http(
                    port,
                    "POST",
                    "/api/v1/namespaces/default/services",
                    Some(&body),
                )
                .unwrap()
            })
        })
        .collect();
    for t in threads {
        let (status, body) = t.join().unwrap();
        assert_eq!(status, 201, "{body}");
    }
    let (status, body) = servers[0]
        .try_http("GET", "/apis/networking.k8s.io/v1/ipaddresses", None)
        .unwrap();
    assert_eq!(status, 200);
    assert_eq!(json(&body)["items"].as_array().unwrap().len(), 2 * 200 + 1);
}
