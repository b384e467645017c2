//! RBAC with the real kubectl against `nodeport apiserver --authorization-mode RBAC` on loopback
//! (plain HTTP: kubectl is the local administrator, in `system:masters`, and acts as other users
//! with `--as`, kube's impersonation; kubectl sends no bearer token over plain HTTP, so tokens
//! are covered over TLS by the apiserver crate's `tls` tests and the lab). The same checks run
//! over the embedded store and over etcd.
//!
//! The can-i matrix's expected answers are kube's bootstrap policy
//! (`plugin/pkg/auth/authorizer/rbac/bootstrappolicy/policy.go`, the rules listed in its
//! `testdata/cluster-roles.yaml`): each case names the role and rule that decides it.

mod apiserver_support;

use apiserver_support::{Server, kubectl_available, text};

const ALICE: &str = "alice";
const BOB: &str = "bob";
const PROXY: &str = "system:kube-proxy";

/// alice's bearer token in [`tokens`]'s file.
const ALICE_TOKEN: &str = "alice-token-0123456789";

/// A GET with a bearer token and extra headers; `(status, body)`. (kubectl sends no token over
/// plain HTTP, and its `--as` comes from the administrator.)
fn raw(server: &Server, token: &str, headers: &[(&str, &str)], path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", server.port)).unwrap();
    let mut request = format!(
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nAccept: application/json\r\nAuthorization: Bearer {token}\r\n"
    );
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes()).unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP status in {response:?}"));
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

fn tokens(dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join("tokens.csv");
    std::fs::write(
        &path,
        "alice-token-0123456789,alice,1\nproxy-token-0123456789,system:kube-proxy,3\n",
    )
    .unwrap();
    path
}

fn start(dir: &std::path::Path, extra: &[&str]) -> Server {
    let tokens = tokens(dir);
    let mut args = vec![
        "--authorization-mode",
        "RBAC",
        "--token-auth-file",
        tokens.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    Server::start(&dir.join("data"), &args)
}

/// kubectl as the administrator, or as `user` (`--as`); `(success, stdout, stderr)`.
fn run(server: &Server, user: Option<&str>, args: &[&str]) -> (bool, String, String) {
    let mut all: Vec<String> = Vec::new();
    if let Some(u) = user {
        all.push(format!("--as={u}"));
    }
    all.extend(args.iter().map(|s| s.to_string()));
    let refs: Vec<&str> = all.iter().map(String::as_str).collect();
    let out = server.kubectl(&refs);
    let (stdout, stderr) = text(&out);
    (out.status.success(), stdout, stderr)
}

fn ok(server: &Server, token: Option<&str>, args: &[&str]) -> String {
    let (success, stdout, stderr) = run(server, token, args);
    assert!(success, "kubectl {args:?} failed:\n{stdout}\n{stderr}");
    stdout
}

fn refused(server: &Server, token: Option<&str>, args: &[&str]) -> String {
    let (success, stdout, stderr) = run(server, token, args);
    assert!(!success, "kubectl {args:?} succeeded:\n{stdout}");
    stderr
}

/// `(user, verb, resource, namespace, expected, why)`: kube's answer and the bootstrap rule.
const CAN_I: &[(&str, &str, &str, &str, bool, &str)] = &[
    // system:node-proxier, bound to user system:kube-proxy.
    (
        "system:kube-proxy",
        "list",
        "services",
        "default",
        true,
        "node-proxier: list,watch services",
    ),
    (
        "system:kube-proxy",
        "watch",
        "services",
        "kube-system",
        true,
        "node-proxier: list,watch services",
    ),
    (
        "system:kube-proxy",
        "get",
        "services",
        "default",
        false,
        "node-proxier has no get on services",
    ),
    (
        "system:kube-proxy",
        "create",
        "services",
        "default",
        false,
        "node-proxier may not write services",
    ),
    (
        "system:kube-proxy",
        "delete",
        "services",
        "default",
        false,
        "node-proxier may not write services",
    ),
    (
        "system:kube-proxy",
        "patch",
        "services/status",
        "default",
        false,
        "node-proxier may not write services/status",
    ),
    (
        "system:kube-proxy",
        "list",
        "endpoints",
        "default",
        true,
        "node-proxier: list,watch endpoints",
    ),
    (
        "system:kube-proxy",
        "update",
        "endpoints",
        "default",
        false,
        "node-proxier may not write endpoints",
    ),
    (
        "system:kube-proxy",
        "list",
        "endpointslices.discovery.k8s.io",
        "default",
        true,
        "node-proxier: list,watch endpointslices",
    ),
    (
        "system:kube-proxy",
        "create",
        "endpointslices.discovery.k8s.io",
        "default",
        false,
        "node-proxier may not write endpointslices",
    ),
    (
        "system:kube-proxy",
        "get",
        "nodes",
        "",
        true,
        "node-proxier: get,list,watch nodes",
    ),
    (
        "system:kube-proxy",
        "watch",
        "nodes",
        "",
        true,
        "node-proxier: get,list,watch nodes",
    ),
    (
        "system:kube-proxy",
        "update",
        "nodes",
        "",
        false,
        "node-proxier may not write nodes",
    ),
    (
        "system:kube-proxy",
        "list",
        "servicecidrs.networking.k8s.io",
        "",
        true,
        "node-proxier: list,watch servicecidrs (1.33)",
    ),
    (
        "system:kube-proxy",
        "create",
        "events",
        "default",
        true,
        "node-proxier: eventsRule create",
    ),
    (
        "system:kube-proxy",
        "delete",
        "events",
        "default",
        false,
        "eventsRule has no delete",
    ),
    (
        "system:kube-proxy",
        "list",
        "namespaces",
        "",
        false,
        "node-proxier has no namespaces",
    ),
    (
        "system:kube-proxy",
        "create",
        "roles.rbac.authorization.k8s.io",
        "default",
        false,
        "node-proxier has no RBAC",
    ),
    (
        "system:kube-proxy",
        "create",
        "selfsubjectaccessreviews.authorization.k8s.io",
        "",
        true,
        "basic-user via system:authenticated",
    ),
    // A user with no binding: only what system:authenticated gets.
    (
        "bob",
        "list",
        "services",
        "default",
        false,
        "no binding: deny by default",
    ),
    (
        "bob",
        "get",
        "nodes",
        "",
        false,
        "no binding: deny by default",
    ),
    (
        "bob",
        "create",
        "selfsubjectrulesreviews.authorization.k8s.io",
        "",
        true,
        "basic-user via system:authenticated",
    ),
    (
        "bob",
        "create",
        "subjectaccessreviews.authorization.k8s.io",
        "",
        false,
        "SubjectAccessReview is not in basic-user",
    ),
    // The local administrator itself (no `--as`), in system:masters.
    ("", "delete", "nodes", "", true, "system:masters"),
    (
        "",
        "escalate",
        "clusterroles.rbac.authorization.k8s.io",
        "",
        true,
        "system:masters",
    ),
    // Impersonating a user gives its name, not its groups: system:apiserver is then nobody.
    (
        "system:apiserver",
        "delete",
        "nodes",
        "",
        false,
        "impersonation carries no groups",
    ),
    // alice: ClusterRole view bound in team-a, edit bound in team-b, admin bound in team-c.
    (
        "alice",
        "list",
        "services",
        "team-a",
        true,
        "view: aggregate-to-view get,list,watch services",
    ),
    (
        "alice",
        "get",
        "services/status",
        "team-a",
        true,
        "view: aggregate-to-view services/status",
    ),
    (
        "alice",
        "create",
        "services",
        "team-a",
        false,
        "view is read-only",
    ),
    (
        "alice",
        "list",
        "endpointslices.discovery.k8s.io",
        "team-a",
        true,
        "view: aggregate-to-view endpointslices",
    ),
    (
        "alice",
        "get",
        "namespaces",
        "team-a",
        true,
        "view: aggregate-to-view namespaces (its own)",
    ),
    (
        "alice",
        "list",
        "services",
        "team-x",
        false,
        "no binding in team-x",
    ),
    (
        "alice",
        "create",
        "services",
        "team-b",
        true,
        "edit: aggregate-to-edit services write",
    ),
    (
        "alice",
        "delete",
        "services",
        "team-b",
        true,
        "edit: aggregate-to-edit services write",
    ),
    (
        "alice",
        "update",
        "endpoints",
        "team-b",
        false,
        "edit may not write endpoints (CVE-2021-25740)",
    ),
    (
        "alice",
        "create",
        "endpointslices.discovery.k8s.io",
        "team-b",
        false,
        "edit may not write endpointslices",
    ),
    (
        "alice",
        "create",
        "rolebindings.rbac.authorization.k8s.io",
        "team-b",
        false,
        "edit has no RBAC",
    ),
    (
        "alice",
        "create",
        "rolebindings.rbac.authorization.k8s.io",
        "team-c",
        true,
        "admin: aggregate-to-admin rolebindings",
    ),
    (
        "alice",
        "list",
        "roles.rbac.authorization.k8s.io",
        "team-c",
        true,
        "admin: aggregate-to-admin roles",
    ),
    (
        "alice",
        "impersonate",
        "serviceaccounts",
        "team-b",
        true,
        "edit: aggregate-to-edit impersonate serviceaccounts",
    ),
    (
        "alice",
        "get",
        "nodes",
        "",
        false,
        "a RoleBinding never reaches cluster-scoped resources",
    ),
];

fn rbac_checks(server: &Server) {
    // The bootstrap policy, as kubectl shows it.
    let roles = ok(server, None, &["get", "clusterroles"]);
    for name in [
        "cluster-admin",
        "admin",
        "edit",
        "view",
        "system:node-proxier",
        "system:discovery",
        "system:basic-user",
        "system:public-info-viewer",
    ] {
        assert!(
            roles
                .lines()
                .any(|l| l.split_whitespace().next() == Some(name)),
            "{name} missing:\n{roles}"
        );
    }
    let bindings = ok(server, None, &["get", "clusterrolebindings", "-o", "wide"]);
    let proxier = bindings
        .lines()
        .find(|l| l.starts_with("system:node-proxier "))
        .expect("node-proxier binding");
    assert!(
        proxier.contains("ClusterRole/system:node-proxier")
            && proxier.contains("system:kube-proxy"),
        "{proxier}"
    );
    // The aggregation filled admin/edit/view.
    let view = ok(server, None, &["get", "clusterrole", "view", "-o", "yaml"]);
    assert!(
        view.contains("endpointslices")
            && view.contains("rbac.authorization.kubernetes.io/autoupdate: \"true\""),
        "{view}"
    );
    let describe = ok(
        server,
        None,
        &["describe", "clusterrole", "system:node-proxier"],
    );
    assert!(
        describe.contains("endpointslices.discovery.k8s.io") && describe.contains("[list watch]"),
        "{describe}"
    );

    // Namespaces and alice's bindings, with kubectl's typed create commands.
    for ns in ["team-a", "team-b", "team-c", "team-x"] {
        ok(server, None, &["create", "namespace", ns]);
    }
    for (ns, role) in [("team-a", "view"), ("team-b", "edit"), ("team-c", "admin")] {
        let created = ok(
            server,
            None,
            &[
                "create",
                "rolebinding",
                "alice",
                "--clusterrole",
                role,
                "--user",
                "alice",
                "-n",
                ns,
            ],
        );
        assert_eq!(
            created.trim(),
            "rolebinding.rbac.authorization.k8s.io/alice created"
        );
    }

    // The can-i matrix, answered through impersonation (`--as`) and SelfSubjectAccessReview.
    assert!(CAN_I.len() >= 30);
    for (user, verb, resource, ns, expected, why) in CAN_I {
        let mut args = vec!["auth", "can-i", verb, resource];
        if !user.is_empty() {
            args.extend(["--as", user]);
        }
        if !ns.is_empty() {
            args.extend(["-n", ns]);
        }
        let (_, stdout, stderr) = run(server, None, &args);
        let answer = stdout.trim();
        assert_eq!(
            answer,
            if *expected { "yes" } else { "no" },
            "can {user} {verb} {resource} in {ns:?}? ({why}) {stderr}"
        );
    }

    // Deny by default, with kube's message.
    let err = refused(server, Some(BOB), &["get", "services"]);
    assert!(
        err.contains(r#"Error from server (Forbidden): services is forbidden: User "bob" cannot list resource "services" in API group "" in the namespace "default""#),
        "{err}"
    );
    // A RoleBinding in one namespace does not reach another.
    ok(
        server,
        None,
        &[
            "create",
            "service",
            "clusterip",
            "web",
            "--tcp",
            "80",
            "-n",
            "team-a",
        ],
    );
    let listed = ok(server, Some(ALICE), &["get", "services", "-n", "team-a"]);
    assert!(listed.contains("web"), "{listed}");
    let err = refused(server, Some(ALICE), &["get", "services", "-n", "team-x"]);
    assert!(
        err.contains(r#"services is forbidden: User "alice" cannot list resource "services" in API group "" in the namespace "team-x""#),
        "{err}"
    );
    let err = refused(
        server,
        Some(ALICE),
        &["delete", "service", "web", "-n", "team-a"],
    );
    assert!(
        err.contains(r#"services "web" is forbidden: User "alice" cannot delete resource "services" in API group "" in the namespace "team-a""#),
        "{err}"
    );

    // Escalation: as admin of team-c alice may write Roles, but not grant what she lacks.
    let err = refused(
        server,
        Some(ALICE),
        &[
            "create",
            "role",
            "nodes-writer",
            "--verb=create",
            "--resource=nodes",
            "-n",
            "team-c",
        ],
    );
    assert!(
        err.contains("roles.rbac.authorization.k8s.io \"nodes-writer\" is forbidden: user \"alice\" (groups=[\"system:authenticated\"]) is attempting to grant RBAC permissions not currently held:\n{APIGroups:[\"\"], Resources:[\"nodes\"], Verbs:[\"create\"]}"),
        "{err}"
    );
    let created = ok(
        server,
        Some(ALICE),
        &[
            "create",
            "role",
            "svc-reader",
            "--verb=get,list",
            "--resource=services",
            "-n",
            "team-c",
        ],
    );
    assert_eq!(
        created.trim(),
        "role.rbac.authorization.k8s.io/svc-reader created"
    );
    // Binding cluster-admin is granting everything: refused.
    let err = refused(
        server,
        Some(ALICE),
        &[
            "create",
            "rolebinding",
            "steal",
            "--clusterrole",
            "cluster-admin",
            "--user",
            "alice",
            "-n",
            "team-c",
        ],
    );
    assert!(
        err.contains("is attempting to grant RBAC permissions not currently held"),
        "{err}"
    );
    // A role alice holds may be bound to bob, who then has it in team-c only.
    ok(
        server,
        Some(ALICE),
        &[
            "create",
            "rolebinding",
            "bob-reads",
            "--role",
            "svc-reader",
            "--user",
            "bob",
            "-n",
            "team-c",
        ],
    );
    ok(server, Some(BOB), &["get", "services", "-n", "team-c"]);
    refused(server, Some(BOB), &["get", "services", "-n", "team-a"]);

    // `bind` and `escalate` (kube's `BindingAuthorized`, `EscalationAllowed`): dave, who holds
    // nothing of `edit`, may bind exactly `edit` in team-b because he may `bind` that
    // ClusterRole there, and may write a Role granting what he lacks because he may `escalate`.
    let file = server.data_dir.with_extension("dave.yaml");
    std::fs::write(
        &file,
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {name: rbac-delegate, namespace: team-b}\nrules:\n- {apiGroups: [rbac.authorization.k8s.io], resources: [rolebindings, roles], verbs: [create]}\n- {apiGroups: [rbac.authorization.k8s.io], resources: [clusterroles], verbs: [bind], resourceNames: [edit]}\n- {apiGroups: [rbac.authorization.k8s.io], resources: [roles], verbs: [escalate]}\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {name: dave-delegates, namespace: team-b}\nroleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: rbac-delegate}\nsubjects:\n- {kind: User, name: dave}\n",
    )
    .unwrap();
    ok(server, None, &["apply", "-f", file.to_str().unwrap()]);
    refused(server, Some("dave"), &["get", "services", "-n", "team-b"]);
    ok(
        server,
        Some("dave"),
        &[
            "create",
            "rolebinding",
            "erin-edits",
            "--clusterrole=edit",
            "--user=erin",
            "-n",
            "team-b",
        ],
    );
    ok(server, Some("erin"), &["get", "services", "-n", "team-b"]);
    // `bind` names edit only: admin is refused, with the escalation message.
    let err = refused(
        server,
        Some("dave"),
        &[
            "create",
            "rolebinding",
            "erin-admins",
            "--clusterrole=admin",
            "--user=erin",
            "-n",
            "team-b",
        ],
    );
    assert!(
        err.contains("is attempting to grant RBAC permissions not currently held"),
        "{err}"
    );
    ok(
        server,
        Some("dave"),
        &[
            "create",
            "role",
            "service-deleter",
            "--verb=delete",
            "--resource=services",
            "-n",
            "team-b",
        ],
    );
    // In another namespace he has neither.
    let err = refused(
        server,
        Some("dave"),
        &[
            "create",
            "role",
            "service-deleter",
            "--verb=delete",
            "--resource=services",
            "-n",
            "team-a",
        ],
    );
    assert!(
        err.contains(r#"User "dave" cannot create resource "roles" in API group "rbac.authorization.k8s.io" in the namespace "team-a""#),
        "{err}"
    );

    // Watches are authorized when they start.
    let (success, _, _) = run(
        server,
        Some(PROXY),
        &["get", "--raw", "/api/v1/services?watch=1&timeoutSeconds=1"],
    );
    assert!(success, "kube-proxy may watch services");
    let err = refused(
        server,
        Some(BOB),
        &["get", "--raw", "/api/v1/services?watch=1&timeoutSeconds=1"],
    );
    assert!(
        err.contains(
            r#"User "bob" cannot watch resource "services" in API group "" at the cluster scope"#
        ),
        "{err}"
    );
    // The node-proxier token reads what a proxy needs and cannot create a Service.
    ok(server, Some(PROXY), &["get", "--raw", "/api/v1/nodes"]);
    let err = refused(
        server,
        Some(PROXY),
        &["create", "service", "clusterip", "evil", "--tcp", "80"],
    );
    assert!(
        err.contains(r#"services is forbidden: User "system:kube-proxy" cannot create resource "services" in API group "" in the namespace "default""#),
        "{err}"
    );

    // kubectl auth can-i --list (SelfSubjectRulesReview).
    let list = ok(server, Some(PROXY), &["auth", "can-i", "--list"]);
    assert!(
        list.lines().any(|l| l.starts_with("endpointslices.discovery.k8s.io") && l.contains("[list watch]")),
        "{list}"
    );

    // Apply, then delete a ClusterRole and a ClusterRoleBinding.
    let file = server.data_dir.with_extension("rbac.yaml");
    std::fs::write(
        &file,
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\nmetadata: {name: svc-watcher}\nrules:\n- {apiGroups: [\"\"], resources: [services], verbs: [watch]}\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata: {name: bob-watches}\nroleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: svc-watcher}\nsubjects:\n- {kind: User, name: bob}\n",
    )
    .unwrap();
    let applied = ok(server, None, &["apply", "-f", file.to_str().unwrap()]);
    assert!(
        applied.contains("clusterrole.rbac.authorization.k8s.io/svc-watcher created")
            && applied.contains("clusterrolebinding.rbac.authorization.k8s.io/bob-watches created"),
        "{applied}"
    );
    ok(
        server,
        Some(BOB),
        &["get", "--raw", "/api/v1/services?watch=1&timeoutSeconds=1"],
    );
    let applied = ok(server, None, &["apply", "-f", file.to_str().unwrap()]);
    assert!(applied.contains("svc-watcher unchanged"), "{applied}");
    ok(server, None, &["delete", "-f", file.to_str().unwrap()]);
    refused(
        server,
        Some(BOB),
        &["get", "--raw", "/api/v1/services?watch=1&timeoutSeconds=1"],
    );

    // SubjectAccessReview: an admin asks about another user; others may not. (No OpenAPI
    // document is served for authorization.k8s.io, so kubectl's schema validation is off.)
    let review = server.data_dir.with_extension("sar.yaml");
    for (verb, allowed) in [("create", "false"), ("list", "true")] {
        std::fs::write(
            &review,
            format!(
                "apiVersion: authorization.k8s.io/v1\nkind: SubjectAccessReview\nspec:\n  user: system:kube-proxy\n  resourceAttributes: {{verb: {verb}, resource: services, namespace: default}}\n"
            ),
        )
        .unwrap();
        let answer = ok(
            server,
            None,
            &[
                "create",
                "--validate=false",
                "-f",
                review.to_str().unwrap(),
                "-o",
                "jsonpath={.status.allowed}",
            ],
        );
        assert_eq!(
            answer.trim(),
            allowed,
            "may system:kube-proxy {verb} services?"
        );
    }
    let err = refused(
        server,
        Some(BOB),
        &["create", "--validate=false", "-f", review.to_str().unwrap()],
    );
    assert!(
        err.contains(r#"User "bob" cannot create resource "subjectaccessreviews" in API group "authorization.k8s.io" at the cluster scope"#),
        "{err}"
    );

    // kubectl's typed create for the cluster-scoped kinds, describe and delete.
    assert_eq!(
        ok(
            server,
            None,
            &[
                "create",
                "clusterrole",
                "node-reader",
                "--verb=get,list",
                "--resource=nodes"
            ]
        )
        .trim(),
        "clusterrole.rbac.authorization.k8s.io/node-reader created"
    );
    assert_eq!(
        ok(
            server,
            None,
            &[
                "create",
                "clusterrolebinding",
                "bob-nodes",
                "--clusterrole=node-reader",
                "--user=bob"
            ]
        )
        .trim(),
        "clusterrolebinding.rbac.authorization.k8s.io/bob-nodes created"
    );
    ok(server, Some(BOB), &["get", "nodes"]);
    let described = ok(
        server,
        None,
        &["describe", "clusterrolebinding", "bob-nodes"],
    );
    assert!(
        described.contains("Kind:  ClusterRole")
            && described.contains("Name:  node-reader")
            && described
                .lines()
                .any(|l| l.trim_start().starts_with("User") && l.contains("bob")),
        "{described}"
    );
    ok(server, None, &["delete", "clusterrolebinding", "bob-nodes"]);
    refused(server, Some(BOB), &["get", "nodes"]);

    // Aggregation follows ClusterRoles created later: one labelled aggregate-to-view is folded
    // into view (kube's ClusterRoleAggregation controller), so view's holders get it.
    // (Asked with alice's token: the authorization filter answers before routing, as kube's,
    // so a resource this server does not serve is a 403 when refused and a 404 when allowed.
    // `kubectl auth can-i` cannot ask: for an unknown resource it sends "widgets.example.com"
    // as a resource name of the core group.)
    let widgets = "/apis/example.com/v1/namespaces/team-a/widgets";
    let alice_lists_widgets = || raw(server, ALICE_TOKEN, &[], widgets).0;
    let file = server.data_dir.with_extension("widgets.yaml");
    std::fs::write(
        &file,
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\nmetadata: {name: widgets-reader}\nrules:\n- {apiGroups: [example.com], resources: [widgets], verbs: [get, list]}\n",
    )
    .unwrap();
    ok(server, None, &["apply", "-f", file.to_str().unwrap()]);
    assert_eq!(alice_lists_widgets(), 403);
    ok(
        server,
        None,
        &[
            "label",
            "clusterrole",
            "widgets-reader",
            "rbac.authorization.k8s.io/aggregate-to-view=true",
        ],
    );
    let mut view = String::new();
    for _ in 0..50 {
        view = ok(server, None, &["get", "clusterrole", "view", "-o", "yaml"]);
        if view.contains("widgets") {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert!(
        view.contains("widgets"),
        "not aggregated into view:\n{view}"
    );
    assert_eq!(alice_lists_widgets(), 404);
    // Deleted, it leaves view again.
    ok(server, None, &["delete", "clusterrole", "widgets-reader"]);
    for _ in 0..50 {
        view = ok(server, None, &["get", "clusterrole", "view", "-o", "yaml"]);
        if !view.contains("widgets") {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert!(!view.contains("widgets"), "still aggregated:\n{view}");
    assert_eq!(alice_lists_widgets(), 403);

    // RBAC kinds are watched like any other (kubectl get -w; an informer of bindings).
    let (success, stdout, stderr) = run(
        server,
        None,
        &[
            "get",
            "--raw",
            "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings?watch=1&timeoutSeconds=1",
        ],
    );
    assert!(
        success && stdout.contains(r#""type":"ADDED""#) && stdout.contains("system:node-proxier"),
        "{stdout}\n{stderr}"
    );

    // Group and ServiceAccount subjects (kubectl --as-group; a service account impersonated
    // without groups is in system:serviceaccounts and system:serviceaccounts:<namespace>, as
    // kube's impersonation filter puts it).
    ok(
        server,
        None,
        &[
            "create",
            "rolebinding",
            "ops-view",
            "--clusterrole=view",
            "--group=ops",
            "-n",
            "team-x",
        ],
    );
    ok(
        server,
        None,
        &[
            "get",
            "services",
            "-n",
            "team-x",
            "--as",
            "carol",
            "--as-group",
            "ops",
        ],
    );
    refused(server, Some("carol"), &["get", "services", "-n", "team-x"]);
    let robot = "system:serviceaccount:team-x:robot";
    ok(
        server,
        None,
        &[
            "create",
            "rolebinding",
            "robot-view",
            "--clusterrole=view",
            "--serviceaccount=team-x:robot",
            "-n",
            "team-a",
        ],
    );
    ok(server, Some(robot), &["get", "services", "-n", "team-a"]);
    refused(
        server,
        Some("system:serviceaccount:team-x:other"),
        &["get", "services", "-n", "team-a"],
    );
    ok(
        server,
        None,
        &[
            "create",
            "rolebinding",
            "team-x-accounts",
            "--clusterrole=view",
            "--group=system:serviceaccounts:team-x",
            "-n",
            "team-b",
        ],
    );
    ok(server, Some(robot), &["get", "services", "-n", "team-b"]);
    refused(
        server,
        Some("system:serviceaccount:team-y:robot"),
        &["get", "services", "-n", "team-b"],
    );

    // Impersonation by a user outside system:masters needs the `impersonate` verb, checked
    // for the user, each group and the uid separately (kube's `WithImpersonation`), with
    // kube's 403 for the first one refused.
    let services = "/api/v1/namespaces/team-c/services";
    let (code, body) = raw(
        server,
        ALICE_TOKEN,
        &[("Impersonate-User", "bob")],
        services,
    );
    assert_eq!(code, 403, "{body}");
    assert!(
        body.contains(r#"users \"bob\" is forbidden: User \"alice\" cannot impersonate resource \"users\" in API group \"\" at the cluster scope"#),
        "{body}"
    );
    let file = server.data_dir.with_extension("impersonate.yaml");
    std::fs::write(
        &file,
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\nmetadata: {name: impersonate-bob}\nrules:\n- {apiGroups: [\"\"], resources: [users], verbs: [impersonate], resourceNames: [bob]}\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata: {name: alice-impersonates-bob}\nroleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: impersonate-bob}\nsubjects:\n- {kind: User, name: alice}\n",
    )
    .unwrap();
    ok(server, None, &["apply", "-f", file.to_str().unwrap()]);
    // Now alice acts as bob, with bob's rights (svc-reader in team-c, nothing in team-a).
    let (code, body) = raw(
        server,
        ALICE_TOKEN,
        &[("Impersonate-User", "bob")],
        services,
    );
    assert_eq!(code, 200, "{body}");
    let (code, body) = raw(
        server,
        ALICE_TOKEN,
        &[("Impersonate-User", "bob")],
        "/api/v1/namespaces/team-a/services",
    );
    assert_eq!(code, 403, "{body}");
    assert!(
        body.contains(r#"User \"bob\" cannot list resource \"services\""#),
        "{body}"
    );
    // Only bob: another user, a group or a uid is still refused.
    let (code, body) = raw(
        server,
        ALICE_TOKEN,
        &[("Impersonate-User", "carol")],
        services,
    );
    assert_eq!(code, 403, "{body}");
    let (code, body) = raw(
        server,
        ALICE_TOKEN,
        &[("Impersonate-User", "bob"), ("Impersonate-Group", "ops")],
        services,
    );
    assert_eq!(code, 403, "{body}");
    assert!(
        body.contains(r#"groups \"ops\" is forbidden: User \"alice\" cannot impersonate resource \"groups\" in API group \"\" at the cluster scope"#),
        "{body}"
    );
    let (code, body) = raw(
        server,
        ALICE_TOKEN,
        &[("Impersonate-User", "bob"), ("Impersonate-Uid", "uid-7")],
        services,
    );
    assert_eq!(code, 403, "{body}");
    assert!(
        body.contains(r#"uids.authentication.k8s.io \"uid-7\" is forbidden: User \"alice\" cannot impersonate resource \"uids\" in API group \"authentication.k8s.io\" at the cluster scope"#),
        "{body}"
    );
    ok(server, None, &["delete", "-f", file.to_str().unwrap()]);

    // Anyone authenticated may read the version; the health checks too.
    ok(server, Some(BOB), &["get", "--raw", "/version"]);
    let err = refused(server, Some(BOB), &["get", "--raw", "/metrics"]);
    assert!(
        err.contains(r#"forbidden: User "bob" cannot get path "/metrics""#),
        "{err}"
    );
}

#[test]
fn rbac_with_kubectl_on_the_embedded_store() {
    if !kubectl_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path(), &[]);
    rbac_checks(&server);
}

#[test]
fn rbac_with_kubectl_on_etcd() {
    if !kubectl_available() {
        return;
    }
    if !apiserver_support::etcd::etcd_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let etcd = apiserver_support::etcd::Etcd::start(&dir.path().join("etcd"));
    let url = etcd.url();
    let server = start(dir.path(), &["--etcd-servers", &url]);
    rbac_checks(&server);
}

#[test]
fn bootstrap_policy_is_reconciled_on_restart_and_autoupdate_false_is_left_alone() {
    if !kubectl_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    reconciliation_checks(dir.path(), &[]);
}

#[test]
fn bootstrap_policy_is_reconciled_on_restart_on_etcd_and_autoupdate_false_is_left_alone() {
    if !kubectl_available() || !apiserver_support::etcd::etcd_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let etcd = apiserver_support::etcd::Etcd::start(&dir.path().join("etcd"));
    let url = etcd.url();
    reconciliation_checks(dir.path(), &["--etcd-servers", &url]);
}

/// Reconciliation of the bootstrap policy on a restart, as kube-apiserver's
/// `EnsureRBACPolicy` post-start hook does it (`reconciliation.ReconcileRoleOptions`): a
/// deleted bootstrap role is created again, rules removed from one are added back while a
/// rule the user added is kept (`Confirm`: the union), and an object annotated
/// `rbac.authorization.kubernetes.io/autoupdate: "false"` is left as the user made it.
/// `extra`: the store's flags, the same on both starts.
fn reconciliation_checks(dir: &std::path::Path, extra: &[&str]) {
    let mut server = start(dir, extra);
    // Remove a rule from node-proxier and add one of our own; delete system:discovery; mark
    // system:basic-user as ours.
    ok(
        &server,
        None,
        &[
            "patch",
            "clusterrole",
            "system:node-proxier",
            "--type=json",
            "-p",
            r#"[{"op":"replace","path":"/rules","value":[{"apiGroups":[""],"resources":["configmaps"],"verbs":["get"]}]}]"#,
        ],
    );
    ok(
        &server,
        None,
        &["delete", "clusterrole", "system:discovery"],
    );
    // Bindings likewise: the node-proxier binding loses its subject and gains one of ours;
    // the discovery binding is deleted.
    ok(
        &server,
        None,
        &[
            "patch",
            "clusterrolebinding",
            "system:node-proxier",
            "--type=json",
            "-p",
            r#"[{"op":"replace","path":"/subjects","value":[{"apiGroup":"rbac.authorization.k8s.io","kind":"User","name":"alice"}]}]"#,
        ],
    );
    ok(
        &server,
        None,
        &["delete", "clusterrolebinding", "system:discovery"],
    );
    ok(
        &server,
        None,
        &[
            "annotate",
            "--overwrite",
            "clusterrole",
            "system:basic-user",
            "rbac.authorization.kubernetes.io/autoupdate=false",
        ],
    );
    ok(
        &server,
        None,
        &[
            "patch",
            "clusterrole",
            "system:basic-user",
            "--type=json",
            "-p",
            r#"[{"op":"replace","path":"/rules","value":[{"apiGroups":[""],"resources":["configmaps"],"verbs":["get"]}]}]"#,
        ],
    );
    // Unbound now: the restart is what gives it back.
    refused(&server, Some(PROXY), &["get", "--raw", "/api/v1/services"]);
    server.terminate();
    let server = start(dir, extra);
    let proxier = ok(
        &server,
        None,
        &["get", "clusterrole", "system:node-proxier", "-o", "yaml"],
    );
    assert!(
        proxier.contains("configmaps") && proxier.contains("endpointslices"),
        "rules restored and the user's kept:\n{proxier}"
    );
    ok(&server, None, &["get", "clusterrole", "system:discovery"]);
    ok(
        &server,
        None,
        &["get", "clusterrolebinding", "system:discovery"],
    );
    let binding = ok(
        &server,
        None,
        &[
            "get",
            "clusterrolebinding",
            "system:node-proxier",
            "-o",
            "jsonpath={.subjects[*].name}",
        ],
    );
    let subjects: Vec<&str> = binding.split_whitespace().collect();
    assert!(
        subjects.contains(&"system:kube-proxy") && subjects.contains(&"alice"),
        "the bootstrap subject restored and the user's kept: {subjects:?}"
    );
    // And the restored binding works: the proxy's user may list Services again. (Not with
    // `auth can-i`: system:basic-user, which grants SelfSubjectAccessReviews, is the one
    // stripped above and left so.)
    ok(&server, Some(PROXY), &["get", "--raw", "/api/v1/services"]);
    let basic = ok(
        &server,
        None,
        &["get", "clusterrole", "system:basic-user", "-o", "yaml"],
    );
    assert!(
        !basic.contains("selfsubjectaccessreviews"),
        "autoupdate=false is left alone:\n{basic}"
    );
}
