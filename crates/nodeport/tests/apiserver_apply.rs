//! Real kubectl's server-side apply against `nodeport apiserver`, on the embedded store and on
//! etcd: `apply --server-side` after `kubectl create` and after a client-side `kubectl apply`,
//! kube's conflict message, `--force-conflicts`, `--dry-run=server`, `diff --server-side`, and
//! the NodePort bitmap against the Services afterwards.

mod apiserver_support;

use std::path::Path;

use apiserver_support::etcd::{Etcd, etcd_available};
use apiserver_support::{Server, kubectl_available, text};

const WEB: &str = "apiVersion: v1
kind: Service
metadata:
  name: web
  labels: {app: web}
spec:
  type: NodePort
  selector: {app: web}
  ports:
  - port: 80
";

/// Created by a client-side `kubectl apply`, with a nodePort it asked for.
const CSA: &str = "apiVersion: v1
kind: Service
metadata:
  name: csa
spec:
  type: NodePort
  selector: {app: csa}
  ports:
  - port: 80
    nodePort: 30080
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

fn failing(server: &Server, args: &[&str]) -> (i32, String, String) {
    let out = server.kubectl(args);
    let (stdout, stderr) = text(&out);
    assert!(
        !out.status.success(),
        "kubectl {args:?} succeeded:\n{stdout}"
    );
    (out.status.code().unwrap_or(-1), stdout, stderr)
}

fn write(dir: &Path, name: &str, content: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, content).unwrap();
    path.to_str().unwrap().to_owned()
}

fn scenario(server: &Server, dir: &Path) {
    // Apply after create: kubectl-create's fields are shared while the values agree.
    let web = write(dir, "web.yaml", WEB);
    assert_eq!(
        ok(server, &["create", "-f", &web]).trim(),
        "service/web created"
    );
    assert_eq!(
        ok(server, &["apply", "--server-side", "-f", &web]).trim(),
        "service/web serverside-applied"
    );
    let yaml = ok(
        server,
        &["get", "svc", "web", "-o", "yaml", "--show-managed-fields"],
    );
    assert!(
        yaml.contains("manager: kubectl-create") && yaml.contains("operation: Update"),
        "{yaml}"
    );
    assert!(
        yaml.contains("manager: kubectl") && yaml.contains("operation: Apply"),
        "{yaml}"
    );
    let node_port = ok(
        server,
        &[
            "get",
            "svc",
            "web",
            "-o",
            "jsonpath={.spec.ports[0].nodePort}",
        ],
    );

    // A changed targetPort (which kubectl-create set, defaulted) conflicts.
    let changed = write(
        dir,
        "web-8080.yaml",
        &WEB.replace("  - port: 80\n", "  - port: 80\n    targetPort: 8080\n"),
    );
    let (_, _, stderr) = failing(server, &["apply", "--server-side", "-f", &changed]);
    assert!(
        stderr.contains(
            r#"Apply failed with 1 conflict: conflict with "kubectl-create" using v1: .spec.ports[port=80,protocol="TCP"].targetPort"#
        ),
        "{stderr}"
    );
    // diff --server-side shows the change without making it.
    let (code, diff, stderr) = failing(
        server,
        &["diff", "--server-side", "--force-conflicts", "-f", &changed],
    );
    assert_eq!(code, 1, "{diff}\n{stderr}");
    assert!(diff.contains("+    targetPort: 8080"), "{diff}");
    // A server dry run with force changes nothing either.
    assert_eq!(
        ok(
            server,
            &[
                "apply",
                "--server-side",
                "--force-conflicts",
                "--dry-run=server",
                "-f",
                &changed
            ]
        )
        .trim(),
        "service/web serverside-applied (server dry run)"
    );
    assert_eq!(
        ok(
            server,
            &[
                "get",
                "svc",
                "web",
                "-o",
                "jsonpath={.spec.ports[0].targetPort}"
            ]
        ),
        "80"
    );
    assert_eq!(
        ok(
            server,
            &[
                "apply",
                "--server-side",
                "--force-conflicts",
                "-f",
                &changed
            ]
        )
        .trim(),
        "service/web serverside-applied"
    );
    assert_eq!(
        ok(
            server,
            &[
                "get",
                "svc",
                "web",
                "-o",
                "jsonpath={.spec.ports[0].targetPort}"
            ]
        ),
        "8080"
    );
    // The allocated nodePort stayed through every apply.
    assert_eq!(
        ok(
            server,
            &[
                "get",
                "svc",
                "web",
                "-o",
                "jsonpath={.spec.ports[0].nodePort}"
            ]
        ),
        node_port
    );

    // After a client-side apply: the issue's example.
    let csa = write(dir, "csa.yaml", CSA);
    assert_eq!(
        ok(server, &["apply", "-f", &csa]).trim(),
        "service/csa created"
    );
    let moved = write(dir, "csa-30081.yaml", &CSA.replace("30080", "30081"));
    // Another field manager opts out of kube's take-over: the client-side apply's fields
    // conflict as any other manager's.
    let (_, _, stderr) = failing(
        server,
        &[
            "apply",
            "--server-side",
            "--field-manager=flux",
            "-f",
            &moved,
        ],
    );
    assert!(
        stderr.contains(
            r#"Apply failed with 1 conflict: conflict with "kubectl-client-side-apply" using v1: .spec.ports[port=80,protocol="TCP"].nodePort"#
        ),
        "{stderr}"
    );
    // kubectl's own manager takes over, without --force-conflicts, the fields whose live
    // value is still the one in last-applied-configuration (kube's lastAppliedManager), and
    // the annotation follows the applied configuration (lastAppliedUpdater).
    assert_eq!(
        ok(server, &["apply", "--server-side", "-f", &moved]).trim(),
        "service/csa serverside-applied"
    );
    let read: serde_json::Value =
        serde_json::from_str(&ok(server, &["get", "svc", "csa", "-o", "json"])).unwrap();
    assert_eq!(read["spec"]["ports"][0]["nodePort"], 30081, "{read}");
    let annotation =
        read["metadata"]["annotations"]["kubectl.kubernetes.io/last-applied-configuration"]
            .as_str()
            .unwrap_or_else(|| panic!("no annotation: {read}"));
    let last: serde_json::Value = serde_json::from_str(annotation).unwrap();
    assert_eq!(last["spec"]["ports"][0]["nodePort"], 30081, "{annotation}");
    // A field another manager changed since is no longer the client-side apply's: it
    // conflicts with its new owner.
    ok(
        server,
        &[
            "patch",
            "svc",
            "csa",
            "--type=merge",
            "-p",
            r#"{"spec":{"selector":{"app":"other"}}}"#,
        ],
    );
    let (_, _, stderr) = failing(server, &["apply", "--server-side", "-f", &moved]);
    assert!(
        stderr.contains(
            r#"Apply failed with 1 conflict: conflict with "kubectl-patch" using v1: .spec.selector"#
        ),
        "{stderr}"
    );
    // The same configuration applied server-side after a client-side apply.
    let same = write(
        dir,
        "same.yaml",
        &CSA.replace("name: csa", "name: same")
            .replace("30080", "30090"),
    );
    assert_eq!(
        ok(server, &["apply", "-f", &same]).trim(),
        "service/same created"
    );
    assert_eq!(
        ok(server, &["apply", "--server-side", "-f", &same]).trim(),
        "service/same serverside-applied"
    );
    ok(server, &["delete", "-f", &same]);

    // A new object through apply, then gone.
    let api = write(dir, "api.yaml", &WEB.replace("name: web", "name: api"));
    assert_eq!(
        ok(server, &["apply", "--server-side", "-f", &api]).trim(),
        "service/api serverside-applied"
    );
    ok(server, &["delete", "-f", &api]);

    // The bitmap holds exactly web's and csa's ports: 30080 released, 30081 held.
    let (status, ranges) = server.try_http("GET", "/ranges", None).unwrap();
    assert_eq!(status, 200, "{ranges}");
    let ranges: serde_json::Value = serde_json::from_str(&ranges).unwrap();
    assert_eq!(ranges["nodePorts"]["used"], 2, "{ranges}");
}

#[test]
fn kubectl_server_side_apply_conflicts_force_dry_run_and_diff_work_on_the_embedded_store() {
    if !kubectl_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"), &[]);
    scenario(&server, dir.path());
}

#[test]
fn kubectl_server_side_apply_conflicts_force_dry_run_and_diff_work_on_etcd() {
    if !kubectl_available() || !etcd_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(&dir.path().join("etcd"));
    let url = etcd.url();
    let server = Server::start(&dir.path().join("data"), &["--etcd-servers", &url]);
    scenario(&server, dir.path());
}

/// Under RBAC an apply is a `patch`, and needs `create` too when the object does not exist
/// (kubectl as the administrator over plain HTTP, acting as `carol` with `--as`).
#[test]
fn kubectl_server_side_apply_under_rbac_needs_patch_and_create_when_it_creates() {
    if !kubectl_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens.csv");
    std::fs::write(&tokens, "carol-token-0123456789,carol,7\n").unwrap();
    let server = Server::start(
        &dir.path().join("data"),
        &[
            "--authorization-mode",
            "RBAC",
            "--token-auth-file",
            tokens.to_str().unwrap(),
        ],
    );
    let web = write(dir.path(), "web.yaml", WEB);
    let as_carol = |args: &[&str]| {
        let mut all = vec!["--as=carol"];
        all.extend_from_slice(args);
        server.kubectl(&all)
    };
    ok(
        &server,
        &[
            "create",
            "role",
            "patcher",
            "--verb=get,patch",
            "--resource=services",
        ],
    );
    ok(
        &server,
        &[
            "create",
            "rolebinding",
            "patcher",
            "--role=patcher",
            "--user=carol",
        ],
    );
    // Only patch: an apply that would create is refused as a create.
    let out = as_carol(&["apply", "--server-side", "-f", &web]);
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}");
    assert!(
        stderr.contains(r#"User "carol" cannot create resource "services" in API group "" in the namespace "default""#),
        "{stderr}"
    );
    assert!(!server.kubectl(&["get", "svc", "web"]).status.success());
    // Once the object exists, patch is enough.
    ok(&server, &["create", "-f", &web]);
    let out = as_carol(&["apply", "--server-side", "-f", &web]);
    assert!(out.status.success(), "{:?}", text(&out));
    // Without patch, no apply at all.
    ok(&server, &["delete", "rolebinding", "patcher"]);
    let out = as_carol(&["apply", "--server-side", "-f", &web]);
    let (_, stderr) = text(&out);
    assert!(
        !out.status.success() && stderr.contains(r#"cannot patch resource "services""#),
        "{stderr}"
    );
    // With create and patch, an apply creates.
    ok(
        &server,
        &[
            "create",
            "role",
            "deployer",
            "--verb=get,patch,create",
            "--resource=services",
        ],
    );
    ok(
        &server,
        &[
            "create",
            "rolebinding",
            "deployer",
            "--role=deployer",
            "--user=carol",
        ],
    );
    let api = write(
        dir.path(),
        "api.yaml",
        &WEB.replace("name: web", "name: api"),
    );
    let out = as_carol(&["apply", "--server-side", "-f", &api]);
    assert!(out.status.success(), "{:?}", text(&out));
}
