//! Real kubectl (the machine's, v1.32) against `nodeport apiserver` on a free loopback port,
//! with default flags (`--validate=strict`, client-side apply).

mod apiserver_support;

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::sync::mpsc;
use std::time::Duration;

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

fn ok(server: &Server, args: &[&str]) -> String {
    let out = server.kubectl(args);
    let (stdout, stderr) = text(&out);
    assert!(
        out.status.success(),
        "kubectl {args:?} failed:\n{stdout}\n{stderr}"
    );
    stdout
}

#[test]
fn kubectl_create_get_apply_patch_edit_replace_delete_and_watch_work() {
    if !kubectl_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"), &[]);
    let file = dir.path().join("web.yaml");
    std::fs::write(&file, WEB).unwrap();
    let file = file.to_str().unwrap();

    // A watcher from the start: it must see ADDED, MODIFIED and DELETED.
    let mut watch = server
        .kubectl_command(&["get", "svc", "-w", "--output-watch-events"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (lines_tx, lines_rx) = mpsc::channel();
    let stdout = watch.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = lines_tx.send(line);
        }
    });

    assert_eq!(
        ok(&server, &["create", "-f", file]).trim(),
        "service/web created"
    );
    let table = ok(&server, &["get", "svc"]);
    assert!(table.starts_with("NAME"), "{table}");
    let row = table
        .lines()
        .find(|l| l.starts_with("web "))
        .expect("web row");
    assert!(
        row.contains("NodePort") && row.contains("80:3") && row.contains("/TCP"),
        "{row}"
    );
    let yaml = ok(&server, &["get", "svc", "web", "-o", "yaml"]);
    assert!(
        yaml.contains("nodePort: 3") && yaml.contains("clusterIP: 10.96."),
        "{yaml}"
    );

    // apply twice: the second is unchanged.
    let applied = dir.path().join("api.yaml");
    std::fs::write(&applied, WEB.replace("name: web", "name: api")).unwrap();
    let applied = applied.to_str().unwrap();
    assert_eq!(
        ok(&server, &["apply", "-f", applied]).trim(),
        "service/api created"
    );
    assert_eq!(
        ok(&server, &["apply", "-f", applied]).trim(),
        "service/api unchanged"
    );

    assert_eq!(
        ok(
            &server,
            &[
                "patch",
                "svc",
                "web",
                "-p",
                r#"{"metadata":{"labels":{"patched":"yes"}}}"#
            ]
        )
        .trim(),
        "service/web patched"
    );
    let editor = dir.path().join("editor.sh");
    std::fs::write(
        &editor,
        "#!/bin/sh\nsed -i 's/^  type: NodePort$/  type: ClusterIP/' \"$1\"\n",
    )
    .unwrap();
    std::fs::set_permissions(&editor, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let edited = server
        .kubectl_command(&["edit", "svc", "api"])
        .env("KUBE_EDITOR", &editor)
        .output()
        .unwrap();
    assert!(edited.status.success(), "{:?}", text(&edited));
    let row = ok(&server, &["get", "svc", "api", "--no-headers"]);
    assert!(row.contains("ClusterIP") && row.contains("80/TCP"), "{row}");

    let json = ok(&server, &["get", "svc", "web", "-o", "json"]);
    let replaced = dir.path().join("replace.json");
    std::fs::write(
        &replaced,
        json.replace("\"app\": \"web\"", "\"app\": \"web2\""),
    )
    .unwrap();
    assert_eq!(
        ok(&server, &["replace", "-f", replaced.to_str().unwrap()]).trim(),
        "service/web replaced"
    );
    assert!(ok(&server, &["get", "svc", "web", "-o", "yaml"]).contains("app: web2"));
    let described = ok(&server, &["describe", "svc", "web"]);
    assert!(described.contains("NodePort:"), "{described}");

    assert_eq!(
        ok(&server, &["delete", "svc", "web"]).trim(),
        "service \"web\" deleted"
    );

    let mut seen = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !(seen
        .iter()
        .any(|l: &String| l.starts_with("DELETED") && l.contains("web")))
    {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match lines_rx.recv_timeout(left) {
            Ok(line) => seen.push(line),
            Err(_) => break,
        }
    }
    let _ = watch.kill();
    let _ = watch.wait();
    for event in ["ADDED", "MODIFIED", "DELETED"] {
        assert!(
            seen.iter()
                .any(|l| l.starts_with(event) && l.contains("web")),
            "no {event} in {seen:#?}"
        );
    }
}

#[test]
fn kubectl_create_namespace_and_create_service_send_protobuf_and_work() {
    // kubectl's typed subcommands (`create namespace`, `create service <type>`) send
    // `application/vnd.kubernetes.protobuf` bodies, client-go's default for built-in types.
    if !kubectl_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"), &[]);

    let out = server.kubectl(&["create", "namespace", "team-a", "-v=8"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_eq!(stdout.trim(), "namespace/team-a created");
    assert!(
        stderr.contains("Content-Type: application/vnd.kubernetes.protobuf"),
        "kubectl did not send protobuf, so this test proves nothing:\n{stderr}"
    );
    assert_eq!(
        ok(
            &server,
            &["get", "ns", "team-a", "-o", "jsonpath={.status.phase}"]
        ),
        "Active"
    );

    let in_team_a = |args: &[&str]| {
        let mut all = args.to_vec();
        all.extend(["-n", "team-a"]);
        ok(&server, &all)
    };
    let fields = "jsonpath={.spec.type} {.spec.ports[0].port} {.spec.ports[0].targetPort} \
                  {.spec.ports[0].nodePort} {.spec.selector.app} {.spec.clusterIP}";
    assert_eq!(
        in_team_a(&[
            "create",
            "service",
            "nodeport",
            "smp",
            "--tcp=80:8080",
            "--node-port=30010"
        ])
        .trim(),
        "service/smp created"
    );
    let smp = in_team_a(&["get", "svc", "smp", "-o", fields]);
    let smp: Vec<&str> = smp.split(' ').collect();
    assert_eq!(
        smp[..5],
        ["NodePort", "80", "8080", "30010", "smp"],
        "{smp:?}"
    );
    assert!(smp[5].starts_with("10.96."), "{smp:?}");

    assert_eq!(
        in_team_a(&["create", "service", "clusterip", "cip", "--tcp=80:8080"]).trim(),
        "service/cip created"
    );
    let cip = in_team_a(&["get", "svc", "cip", "-o", fields]);
    let cip: Vec<&str> = cip.split(' ').collect();
    assert_eq!(cip[..5], ["ClusterIP", "80", "8080", "", "cip"], "{cip:?}");
    assert!(cip[5].starts_with("10.96."), "{cip:?}");

    assert_eq!(
        in_team_a(&["create", "service", "loadbalancer", "lb", "--tcp=80:8080"]).trim(),
        "service/lb created"
    );
    assert_eq!(
        in_team_a(&[
            "create",
            "service",
            "externalname",
            "db",
            "--external-name=db.example.com"
        ])
        .trim(),
        "service/db created"
    );
    assert_eq!(
        in_team_a(&[
            "get",
            "svc",
            "db",
            "-o",
            "jsonpath={.spec.type} {.spec.externalName}"
        ]),
        "ExternalName db.example.com"
    );

    // The static nodePort is taken: kube-apiserver's error, through kubectl's wording.
    let out = server.kubectl(&[
        "create",
        "service",
        "nodeport",
        "smp2",
        "--tcp=80:8080",
        "--node-port=30010",
        "-n",
        "team-a",
    ]);
    assert!(!out.status.success());
    assert_eq!(
        text(&out).1.trim(),
        "error: failed to create NodePort service: Service \"smp2\" is invalid: spec.ports[0].nodePort: Invalid value: 30010: provided port is already allocated"
    );
}

#[test]
fn kubectl_minio_scenario_of_the_static_band() {
    // Reference 002 (Kubernetes 1.27 blog): minio asks for 30009 in the static band.
    if !kubectl_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"), &[]);
    let minio = |name: &str| {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\nspec:\n  ports:\n  - name: api\n    nodePort: 30009\n    port: 9000\n    protocol: TCP\n    targetPort: 9000\n  selector:\n    app: minio\n  type: NodePort\n"
        )
    };
    let path = dir.path().join("minio.yaml");
    std::fs::write(&path, minio("minio")).unwrap();
    assert_eq!(
        ok(&server, &["create", "-f", path.to_str().unwrap()]).trim(),
        "service/minio created"
    );

    std::fs::write(&path, minio("minio2")).unwrap();
    let out = server.kubectl(&["create", "-f", path.to_str().unwrap()]);
    assert!(!out.status.success());
    assert_eq!(
        text(&out).1.trim(),
        "The Service \"minio2\" is invalid: spec.ports[0].nodePort: Invalid value: 30009: provided port is already allocated"
    );

    // Dynamic picks stay out of the static band 30000-30085 while the dynamic band has room.
    let many: String = (0..40)
        .map(|i| format!("---\napiVersion: v1\nkind: Service\nmetadata:\n  name: dyn{i}\nspec:\n  type: NodePort\n  ports:\n  - port: 80\n"))
        .collect();
    let many_path = dir.path().join("many.yaml");
    std::fs::write(&many_path, many).unwrap();
    ok(&server, &["create", "-f", many_path.to_str().unwrap()]);
    let ports = ok(
        &server,
        &[
            "get",
            "svc",
            "-o",
            "jsonpath={range .items[*]}{.spec.ports[0].nodePort}{\"\\n\"}{end}",
        ],
    );
    let dynamic: Vec<u16> = ports
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .filter(|p| *p != 30009)
        .collect();
    assert_eq!(dynamic.len(), 40, "{ports}");
    assert!(
        dynamic.iter().all(|p| (30086..=32767).contains(p)),
        "{dynamic:?}"
    );

    // Deleting minio frees 30009 for the next create.
    ok(&server, &["delete", "svc", "minio"]);
    assert_eq!(
        ok(&server, &["create", "-f", path.to_str().unwrap()]).trim(),
        "service/minio2 created"
    );
    let ranges = ok(&server, &["get", "--raw", "/ranges"]);
    assert!(ranges.contains("\"range\":\"30000-32767\""), "{ranges}");
}

#[test]
fn kubectl_gets_the_default_service_cidr_of_the_cluster_ip_range() {
    // kube-apiserver >= 1.33: `kubectl get servicecidrs` shows `kubernetes` with the range of
    // --service-cluster-ip-range, Ready; kube-proxy watches it.
    if !kubectl_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(
        &dir.path().join("data"),
        &["--service-cluster-ip-range", "10.43.0.0/16"],
    );
    let table = ok(&server, &["get", "servicecidrs"]);
    let lines: Vec<Vec<&str>> = table
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(lines.len(), 2, "{table}");
    assert_eq!(lines[0], ["NAME", "CIDRS", "AGE"], "{table}");
    assert_eq!(lines[1][..2], ["kubernetes", "10.43.0.0/16"], "{table}");
    assert_eq!(
        ok(
            &server,
            &[
                "get",
                "servicecidr",
                "kubernetes",
                "-o",
                "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
            ],
        ),
        "True"
    );
    // `get -w` lists and then watches: the header, then the object as ADDED.
    let mut watch = server
        .kubectl_command(&["get", "servicecidrs", "-w", "--output-watch-events"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(watch.stdout.take().unwrap()).lines();
    let header = lines.next().unwrap().unwrap();
    let added = lines.next().unwrap().unwrap();
    let _ = watch.kill();
    let _ = watch.wait();
    assert!(header.starts_with("EVENT"), "{header:?}");
    assert_eq!(
        added.split_whitespace().take(3).collect::<Vec<_>>(),
        ["ADDED", "kubernetes", "10.43.0.0/16"],
        "{added:?}"
    );
    // A manifest passes kubectl's validation (the group is in /openapi/v3) and is stored, as
    // kube-apiserver 1.33 stores it (tests/apiserver_dual_stack.rs covers what it does).
    let manifest = dir.path().join("cidr.yaml");
    std::fs::write(
        &manifest,
        "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: extra}\nspec: {cidrs: [10.44.0.0/16]}\n",
    )
    .unwrap();
    assert_eq!(
        ok(&server, &["create", "-f", manifest.to_str().unwrap()]).trim(),
        "servicecidr.networking.k8s.io/extra created"
    );
    ok(&server, &["get", "servicecidr", "kubernetes"]);
}

#[test]
fn kubectl_explain_describes_the_fields_of_each_served_kind() {
    if !kubectl_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"), &[]);
    let ports = ok(&server, &["explain", "svc.spec.ports"]);
    assert!(ports.contains("FIELD: ports <[]ServicePort>"), "{ports}");
    assert!(ports.contains("nodePort\t<integer>"), "{ports}");
    let slices = ok(&server, &["explain", "endpointslices.endpoints.conditions"]);
    assert!(slices.contains("serving\t<boolean>"), "{slices}");
    let cidrs = ok(&server, &["explain", "servicecidrs.spec"]);
    assert!(cidrs.contains("cidrs\t<[]string>"), "{cidrs}");
}
