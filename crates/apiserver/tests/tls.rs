//! TLS and bearer tokens, checked with the machine's real kubectl: a throwaway CA and server
//! certificate made with rcgen, a kubeconfig with `certificate-authority` and `token`, and the
//! server's 401 `Unauthorized` Status for a missing or wrong token (kube-apiserver's answer).

use std::path::Path;
use std::process::Output;

use nodeport_apiserver::{Config, Security};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};

const TOKEN: &str = "0123456789abcdef-test-token";

/// kubectl, or a loud failure (only `NODEPORT_SKIP_PRIVILEGED=1` skips).
fn kubectl_available() -> bool {
    if std::process::Command::new("kubectl")
        .args(["version", "--client"])
        .output()
        .is_ok_and(|o| o.status.success())
    {
        return true;
    }
    if std::env::var("NODEPORT_SKIP_PRIVILEGED").as_deref() == Ok("1") {
        eprintln!("skipped: kubectl is not installed (NODEPORT_SKIP_PRIVILEGED=1)");
        return false;
    }
    panic!("kubectl is required for this test and was not found on PATH");
}

/// Writes `ca.pem`, `server.pem`, `server-key.pem` (for `localhost` and 127.0.0.1) into `dir`.
fn make_certificates(dir: &Path) {
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "nodeport test CA");
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_key = KeyPair::generate().unwrap();
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca, ca_key);

    let mut server =
        CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap();
    server
        .distinguished_name
        .push(DnType::CommonName, "nodeport-apiserver");
    let server_key = KeyPair::generate().unwrap();
    let server_cert = server.signed_by(&server_key, &issuer).unwrap();

    std::fs::write(dir.join("ca.pem"), ca_cert.pem()).unwrap();
    std::fs::write(dir.join("server.pem"), server_cert.pem()).unwrap();
    std::fs::write(dir.join("server-key.pem"), server_key.serialize_pem()).unwrap();
}

/// A kubeconfig for `https://127.0.0.1:<port>` with the test CA and `token`.
fn kubeconfig(dir: &Path, name: &str, port: u16, token: &str, with_ca: bool) -> String {
    let ca = if with_ca {
        format!(
            "certificate-authority: {}, ",
            dir.join("ca.pem").to_str().unwrap()
        )
    } else {
        String::new()
    };
    let path = dir.join(name);
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- cluster: {{{ca}server: \"https://127.0.0.1:{port}\"}}\n  name: t\ncontexts:\n- context: {{cluster: t, user: u}}\n  name: t\ncurrent-context: t\nusers:\n- name: u\n  user: {{token: \"{token}\"}}\n"
        ),
    )
    .unwrap();
    path.to_str().unwrap().to_owned()
}

async fn kubectl(dir: &Path, config: &str, args: &[&str], stdin: Option<&str>) -> Output {
    use tokio::io::AsyncWriteExt;
    let mut child = tokio::process::Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(config)
        .arg("--cache-dir")
        .arg(dir.join("cache"))
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run kubectl");
    let mut input = child.stdin.take().unwrap();
    if let Some(text) = stdin {
        input.write_all(text.as_bytes()).await.unwrap();
    }
    drop(input);
    child.wait_with_output().await.unwrap()
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_with_a_ca_and_token_works_over_tls_and_a_wrong_token_is_unauthorized() {
    if !kubectl_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    make_certificates(d);
    std::fs::write(
        d.join("tokens.csv"),
        format!("{TOKEN},admin,1,\"system:masters\"\n"),
    )
    .unwrap();
    let config = Config {
        tls_cert_file: Some(d.join("server.pem")),
        tls_private_key_file: Some(d.join("server-key.pem")),
        token_auth_file: Some(d.join("tokens.csv")),
        ..Config::default()
    };
    let security = Security::load(&config).unwrap();
    assert!(security.tls.is_some() && security.tokens.is_some());
    let state = nodeport_apiserver::in_memory(&config).await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(nodeport_apiserver::serve_secured(
        state,
        listener,
        security,
        async move {
            let _ = stopped.await;
        },
    ));

    let good = kubeconfig(d, "good", port, TOKEN, true);
    let out = kubectl(
        d,
        &good,
        &["create", "-f", "-"],
        Some("apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec:\n  type: NodePort\n  ports: [{port: 80}]\n"),
    )
    .await;
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(text(&out).trim(), "service/web created");
    let out = kubectl(d, &good, &["get", "svc"], None).await;
    assert!(out.status.success(), "{}", text(&out));
    let table = text(&out);
    assert!(
        table.lines().any(|l| l.starts_with("kubernetes ")),
        "{table}"
    );
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("web ") && l.contains("80:3")),
        "{table}"
    );

    // A wrong token: kubectl reports kube-apiserver's 401.
    let bad = kubeconfig(d, "bad", port, "not-a-token", true);
    let out = kubectl(d, &bad, &["get", "svc"], None).await;
    assert!(!out.status.success());
    assert!(
        text(&out).contains("You must be logged in to the server (Unauthorized)"),
        "{}",
        text(&out)
    );
    let out = kubectl(d, &bad, &["get", "--raw", "/api/v1/namespaces"], None).await;
    assert!(!out.status.success(), "{}", text(&out));
    // The health checks need no token.
    let out = kubectl(d, &bad, &["get", "--raw", "/readyz"], None).await;
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(text(&out).trim(), "ok");

    // Without the CA, the server's certificate is not trusted.
    let untrusted = kubeconfig(d, "untrusted", port, TOKEN, false);
    let out = kubectl(d, &untrusted, &["get", "svc"], None).await;
    assert!(!out.status.success());
    assert!(
        text(&out).contains("certificate signed by unknown authority"),
        "{}",
        text(&out)
    );

    let _ = stop.send(());
    server.await.unwrap().unwrap();
}

#[tokio::test]
async fn requests_without_a_token_get_a_401_status_and_health_checks_do_not_need_one() {
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("t.csv"), format!("{TOKEN},u,1\n")).unwrap();
    let config = Config {
        token_auth_file: Some(dir.path().join("t.csv")),
        ..Config::default()
    };
    let security = Security::load(&config).unwrap();
    let state = nodeport_apiserver::in_memory(&config).await.unwrap();
    // As served over TLS, where a request without a token is not the local administrator;
    // under the loopback default `AlwaysAllow`, anonymous requests are not admitted (kube).
    let gate = std::sync::Arc::new(nodeport_apiserver::authz::Gate {
        tokens: security.tokens.clone(),
        tls: true,
        anonymous_auth: true,
        authorizer: state.authorizer.clone(),
    });
    let app = nodeport_apiserver::router(state).layer(axum::middleware::from_fn_with_state(
        gate,
        nodeport_apiserver::authz::gate,
    ));
    let call = |path: &str, auth: Option<&str>| {
        let mut req = http::Request::get(path);
        if let Some(auth) = auth {
            req = req.header("authorization", auth);
        }
        app.clone()
            .oneshot(req.body(axum::body::Body::empty()).unwrap())
    };
    for (path, auth, code) in [
        ("/api/v1/services", None, 401),
        ("/api/v1/services", Some("Bearer wrong"), 401),
        (
            "/api/v1/services",
            Some(format!("Bearer {TOKEN}").as_str()),
            200,
        ),
        ("/api", Some(format!("bearer {TOKEN}").as_str()), 200),
        ("/version", None, 401),
        ("/healthz", None, 200),
        ("/livez", None, 200),
        ("/readyz", None, 200),
    ] {
        let resp = call(path, auth).await.unwrap();
        assert_eq!(resp.status().as_u16(), code, "{path} {auth:?}");
        if code == 401 {
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            let status: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(
                status,
                serde_json::json!({"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"Unauthorized","reason":"Unauthorized","code":401})
            );
        }
    }
}

#[tokio::test]
async fn under_rbac_a_tls_request_without_a_token_is_anonymous_and_may_read_only_public_info() {
    use http_body_util::BodyExt;
    use nodeport_apiserver::authz::{Gate, Mode};
    use tower::ServiceExt;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("t.csv"),
        format!("{TOKEN},system:kube-proxy,1\n"),
    )
    .unwrap();
    let config = Config {
        token_auth_file: Some(dir.path().join("t.csv")),
        authorization_modes: Some(vec![Mode::Rbac]),
        ..Config::default()
    };
    let security = Security::load(&config).unwrap();
    let state = nodeport_apiserver::in_memory(&config).await.unwrap();
    let app = |anonymous_auth: bool| {
        let gate = std::sync::Arc::new(Gate {
            tokens: security.tokens.clone(),
            tls: true,
            anonymous_auth,
            authorizer: state.authorizer.clone(),
        });
        nodeport_apiserver::router(state.clone()).layer(axum::middleware::from_fn_with_state(
            gate,
            nodeport_apiserver::authz::gate,
        ))
    };
    let call = |anonymous: bool, method: &str, path: &str, token: bool| {
        let mut req = http::Request::builder().method(method).uri(path);
        if token {
            req = req.header("authorization", format!("Bearer {TOKEN}"));
        }
        let body = if method == "POST" {
            r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"evil"},"spec":{"ports":[{"port":80}]}}"#
        } else {
            ""
        };
        let req = req
            .header("content-type", "application/json")
            .body(axum::body::Body::from(body))
            .unwrap();
        let app = app(anonymous);
        async move {
            let resp = app.oneshot(req).await.unwrap();
            let code = resp.status().as_u16();
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            let message = serde_json::from_slice::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v["message"].as_str().map(str::to_owned))
                .unwrap_or_default();
            (code, message)
        }
    };
    // system:public-info-viewer is bound to system:unauthenticated.
    for path in ["/version", "/healthz", "/livez", "/readyz"] {
        assert_eq!(call(true, "GET", path, false).await.0, 200, "{path}");
    }
    assert_eq!(
        call(true, "GET", "/api/v1/services", false).await,
        (
            403,
            r#"services is forbidden: User "system:anonymous" cannot list resource "services" in API group "" at the cluster scope"#.to_owned()
        )
    );
    // Discovery is for authenticated users (system:discovery).
    assert_eq!(
        call(true, "GET", "/apis", false).await,
        (
            403,
            r#"forbidden: User "system:anonymous" cannot get path "/apis""#.to_owned()
        )
    );
    assert_eq!(call(true, "GET", "/apis", true).await.0, 200);
    // The node-proxier token: lists Services, may not create one.
    assert_eq!(call(true, "GET", "/api/v1/services", true).await.0, 200);
    assert_eq!(
        call(true, "POST", "/api/v1/namespaces/default/services", true).await,
        (
            403,
            r#"services is forbidden: User "system:kube-proxy" cannot create resource "services" in API group "" in the namespace "default""#.to_owned()
        )
    );
    // --anonymous-auth=false: a request without a token is a 401, the health checks excepted.
    assert_eq!(call(false, "GET", "/version", false).await.0, 401);
    assert_eq!(call(false, "GET", "/healthz", false).await.0, 200);
}
