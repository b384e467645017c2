//! Router tests without a socket (`tower::ServiceExt::oneshot`): every verb and every error the
//! issue lists, with kube-apiserver's codes, reasons and messages.

use axum::body::Body;
use http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use nodeport_apiserver::{AppState, Config, PortRange};
use serde_json::{Value, json};
use tower::ServiceExt;

async fn server() -> AppState {
    server_with(Config::default()).await
}

async fn server_with(config: Config) -> AppState {
    nodeport_apiserver::in_memory(&config)
        .await
        .expect("server state")
}

struct Reply {
    status: StatusCode,
    body: Value,
    warnings: Vec<String>,
}

async fn call(
    state: &AppState,
    method: Method,
    uri: &str,
    content_type: &str,
    body: Vec<u8>,
) -> Reply {
    let mut req = Request::builder().method(method).uri(uri);
    if !content_type.is_empty() {
        req = req.header("content-type", content_type);
    }
    let response = nodeport_apiserver::router(state.clone())
        .oneshot(req.body(Body::from(body)).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let warnings = response
        .headers()
        .get_all("warning")
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .collect();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let body = serde_json::from_slice(&bytes)
        .unwrap_or(Value::String(String::from_utf8_lossy(&bytes).into()));
    Reply {
        status,
        body,
        warnings,
    }
}

async fn get(state: &AppState, uri: &str) -> Reply {
    call(state, Method::GET, uri, "", vec![]).await
}

async fn post(state: &AppState, uri: &str, body: Value) -> Reply {
    call(
        state,
        Method::POST,
        uri,
        "application/json",
        serde_json::to_vec(&body).unwrap(),
    )
    .await
}

async fn put(state: &AppState, uri: &str, body: Value) -> Reply {
    call(
        state,
        Method::PUT,
        uri,
        "application/json",
        serde_json::to_vec(&body).unwrap(),
    )
    .await
}

async fn patch(state: &AppState, uri: &str, content_type: &str, body: Value) -> Reply {
    call(
        state,
        Method::PATCH,
        uri,
        content_type,
        serde_json::to_vec(&body).unwrap(),
    )
    .await
}

async fn delete(state: &AppState, uri: &str) -> Reply {
    call(state, Method::DELETE, uri, "", vec![]).await
}

const SERVICES: &str = "/api/v1/namespaces/default/services";

fn service(name: &str, spec: Value) -> Value {
    json!({"apiVersion":"v1","kind":"Service","metadata":{"name":name},"spec":spec})
}

fn node_port_svc(name: &str, node_port: Option<u16>) -> Value {
    let mut port = json!({"name":"api","port":9000,"protocol":"TCP","targetPort":9000});
    if let Some(np) = node_port {
        port["nodePort"] = json!(np);
    }
    service(
        name,
        json!({"type":"NodePort","selector":{"app":name},"ports":[port]}),
    )
}

fn node_port_of(v: &Value) -> u16 {
    v["spec"]["ports"][0]["nodePort"]
        .as_u64()
        .expect("nodePort") as u16
}

/// Asserts a 422 Invalid reply with kube-apiserver's exact message.
fn assert_invalid(r: &Reply, message: &str) {
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", r.body);
    assert_eq!(r.body["message"], message);
}

async fn verify_consistent(state: &AppState) {
    let v = state.registry.verify().await.unwrap();
    assert!(v.is_consistent(), "bitmaps differ from Services: {v:?}");
}

#[tokio::test]
async fn discovery_documents_describe_the_served_resources() {
    let s = server().await;
    let api = get(&s, "/api").await;
    assert_eq!(api.body["versions"], json!(["v1"]));
    let v1 = get(&s, "/api/v1").await;
    let names: Vec<&str> = v1.body["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    for n in [
        "services",
        "services/status",
        "endpoints",
        "nodes",
        "namespaces",
    ] {
        assert!(names.contains(&n), "{n} missing from {names:?}");
    }
    let groups = get(&s, "/apis").await;
    assert_eq!(groups.body["groups"][0]["name"], "discovery.k8s.io");
    let slices = get(&s, "/apis/discovery.k8s.io/v1").await;
    assert_eq!(slices.body["resources"][0]["name"], "endpointslices");
    assert_eq!(get(&s, "/version").await.body["major"], "1");
    for p in ["/healthz", "/livez", "/readyz"] {
        let r = get(&s, p).await;
        assert_eq!((r.status, r.body.as_str()), (StatusCode::OK, Some("ok")));
        // `?verbose`: kube-apiserver's list of checks.
        let r = get(&s, &format!("{p}?verbose")).await;
        let text = r.body.as_str().unwrap_or_default();
        assert!(text.starts_with("[+]ping ok\n"), "{text:?}");
        assert!(
            text.ends_with(&format!("{} check passed\n", &p[1..])),
            "{text:?}"
        );
    }
    let root = get(&s, "/openapi/v3").await;
    assert!(root.body["paths"]["api/v1"]["serverRelativeURL"].is_string());
    // Every served group has a document, so kubectl can validate a ServiceCIDR manifest.
    let networking = &root.body["paths"]["apis/networking.k8s.io/v1"]["serverRelativeURL"];
    let doc = get(
        &s,
        networking.as_str().expect("networking.k8s.io/v1 listed"),
    )
    .await;
    assert_eq!(
        doc.body["components"]["schemas"]["io.k8s.api.networking.v1.ServiceCIDR"]["x-kubernetes-group-version-kind"]
            [0]["kind"],
        "ServiceCIDR"
    );
    // Field schemas with descriptions, for `kubectl explain svc.spec.ports`.
    let core_uri = root.body["paths"]["api/v1"]["serverRelativeURL"]
        .as_str()
        .unwrap()
        .to_owned();
    let core = get(&s, &core_uri).await;
    let schemas = &core.body["components"]["schemas"];
    assert_eq!(
        schemas["io.k8s.api.core.v1.Service"]["properties"]["spec"]["allOf"][0]["$ref"],
        "#/components/schemas/io.k8s.api.core.v1.ServiceSpec"
    );
    assert!(
        schemas["io.k8s.api.core.v1.ServicePort"]["properties"]["nodePort"]["description"]
            .as_str()
            .is_some_and(|d| d.contains("NodePort")),
        "{}",
        schemas["io.k8s.api.core.v1.ServicePort"]
    );
}

#[tokio::test]
async fn version_is_one_kubectl_1_32_to_1_34_accept_without_a_skew_warning() {
    let s = server().await;
    let v = get(&s, "/version").await.body;
    assert_eq!(
        (v["major"].as_str(), v["minor"].as_str()),
        (Some("1"), Some("33"))
    );
    assert!(
        v["gitVersion"]
            .as_str()
            .unwrap()
            .starts_with("v1.33.0-nodeport.")
    );
    // Go's architecture names.
    assert!(!v["platform"].as_str().unwrap().contains("x86_64"), "{v}");
}

#[tokio::test]
async fn system_namespaces_and_the_kubernetes_service_exist_from_the_first_start() {
    let s = server().await;
    for ns in ["default", "kube-system", "kube-public"] {
        let r = get(&s, &format!("/api/v1/namespaces/{ns}")).await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.body["status"]["phase"], "Active");
    }
    let k = get(&s, &format!("{SERVICES}/kubernetes")).await;
    assert_eq!(k.body["spec"]["clusterIP"], "10.96.0.1");
    assert_eq!(
        k.body["spec"]["ports"],
        json!([{"name":"https","port":443,"protocol":"TCP","targetPort":6443}])
    );
    verify_consistent(&s).await;
}

#[tokio::test]
async fn create_defaults_and_allocates_like_kube_apiserver() {
    let s = server().await;
    let r = post(
        &s,
        SERVICES,
        service("web", json!({"type":"NodePort","ports":[{"port":80}]})),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    let spec = &r.body["spec"];
    assert_eq!(spec["ports"][0]["protocol"], "TCP");
    assert_eq!(spec["ports"][0]["targetPort"], 80);
    assert_eq!(spec["sessionAffinity"], "None");
    assert_eq!(spec["externalTrafficPolicy"], "Cluster");
    assert_eq!(spec["internalTrafficPolicy"], "Cluster");
    assert_eq!(spec["ipFamilies"], json!(["IPv4"]));
    assert_eq!(spec["ipFamilyPolicy"], "SingleStack");
    assert_eq!(spec["clusterIPs"], json!([spec["clusterIP"].clone()]));
    let np = node_port_of(&r.body);
    assert!(
        (30086..=32767).contains(&np),
        "dynamic pick {np} outside the dynamic band"
    );
    assert!(
        r.body["metadata"]["resourceVersion"]
            .as_str()
            .unwrap()
            .parse::<i64>()
            .unwrap()
            > 0
    );
    assert!(r.body["metadata"]["uid"].is_string());
    verify_consistent(&s).await;
}

#[tokio::test]
async fn tcp_and_udp_entries_of_one_port_share_a_node_port_on_create() {
    // kubernetes#85020: `533:30875/TCP,533:30875/UDP`.
    let s = server().await;
    let r = post(
        &s,
        SERVICES,
        service(
            "dns",
            json!({"type":"NodePort","ports":[
        {"name":"tcp","port":53,"protocol":"TCP"},{"name":"udp","port":53,"protocol":"UDP"}]}),
        ),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert_eq!(
        r.body["spec"]["ports"][0]["nodePort"],
        r.body["spec"]["ports"][1]["nodePort"]
    );
    let r = post(&s, SERVICES, service("multi", json!({"type":"NodePort","ports":[
        {"name":"a","port":80,"nodePort":30400},{"name":"b","port":53,"protocol":"UDP","nodePort":30400}]}))).await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        r.body["message"],
        "Service \"multi\" is invalid: spec.ports[1].nodePort: Invalid value: 30400: provided port is already allocated"
    );
    verify_consistent(&s).await;
}

/// kube-apiserver's `initNodePorts` gives the entries of one port number one nodePort, so TCP
/// and UDP of port 53 may ask for the same static nodePort (kubernetes#20092, #85020); its
/// repair loop counts such a Service's port once (kubernetes#91404).
#[tokio::test]
async fn tcp_and_udp_entries_of_one_port_may_ask_for_one_static_node_port() {
    let s = server().await;
    let dns = |name: &str| {
        service(
            name,
            json!({"type":"NodePort","ports":[
                {"name":"dns","port":53,"protocol":"UDP","nodePort":30053},
                {"name":"dns-tcp","port":53,"protocol":"TCP","nodePort":30053}]}),
        )
    };
    let r = post(&s, SERVICES, dns("dns")).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert_eq!(r.body["spec"]["ports"][0]["nodePort"], 30053);
    assert_eq!(r.body["spec"]["ports"][1]["nodePort"], 30053);
    verify_consistent(&s).await;
    // Held once, by that Service: another one asking for it collides...
    let r = post(&s, SERVICES, dns("dns2")).await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        r.body["message"],
        "Service \"dns2\" is invalid: spec.ports[0].nodePort: Invalid value: 30053: provided port is already allocated"
    );
    // ...until the first is deleted, which frees it once.
    assert_eq!(
        delete(&s, &format!("{SERVICES}/dns")).await.status,
        StatusCode::OK
    );
    let r = post(&s, SERVICES, dns("dns2")).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    verify_consistent(&s).await;
}

/// Two entries of one protocol asking for one nodePort. On create kube-apiserver allocates
/// (`BeginCreate`, `initNodePorts`) before it validates, so entries of different port numbers
/// fail on the allocation of the second (`provided port is already allocated`); entries of the
/// same port and protocol pass allocation and fail `ValidateService`, which keys ports by
/// (protocol, port) and nodePorts by (protocol, nodePort): `Duplicate value`. Nothing is kept.
#[tokio::test]
async fn two_ports_of_one_protocol_asking_for_one_node_port_are_refused_as_kube_apiserver_refuses_them()
 {
    let s = server().await;
    let r = post(
        &s,
        SERVICES,
        service(
            "dup",
            json!({"type":"NodePort","ports":[
                {"name":"http","port":80,"nodePort":30400},
                {"name":"alt","port":8080,"nodePort":30400}]}),
        ),
    )
    .await;
    assert_invalid(
        &r,
        "Service \"dup\" is invalid: spec.ports[1].nodePort: Invalid value: 30400: provided port is already allocated",
    );

    let r = post(
        &s,
        SERVICES,
        service(
            "dup",
            json!({"type":"NodePort","ports":[
                {"name":"http","port":80,"nodePort":30400},
                {"name":"again","port":80,"nodePort":30400}]}),
        ),
    )
    .await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", r.body);
    let causes = r.body["details"]["causes"].as_array().unwrap();
    assert_eq!(causes.len(), 2, "{causes:?}");
    assert_eq!(causes[0]["reason"], "FieldValueDuplicate");
    assert_eq!(causes[0]["field"], "spec.ports[1]");
    assert_eq!(
        causes[1],
        json!({"reason":"FieldValueDuplicate","message":"Duplicate value: 30400",
               "field":"spec.ports[1].nodePort"})
    );

    // On update kube-apiserver's `updateNodePorts` answers a 500 `duplicate nodePort: {TCP
    // 30400}`; this server gives validation's 422 instead (a documented deviation: the user
    // gets the field and the reason).
    let r = post(&s, SERVICES, node_port_svc("one", Some(30400))).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    let mut updated = r.body.clone();
    updated["spec"]["ports"] = json!([
        {"name":"http","port":80,"protocol":"TCP","nodePort":30400},
        {"name":"alt","port":8080,"protocol":"TCP","nodePort":30400}]);
    let r = put(&s, &format!("{SERVICES}/one"), updated).await;
    assert_invalid(
        &r,
        "Service \"one\" is invalid: spec.ports[1].nodePort: Duplicate value: 30400",
    );
    verify_consistent(&s).await;
}

/// `initNodePorts` reports a taken nodePort at the entry it is allocating for (`Index(i)`),
/// also when a later entry of the same port number is the one that asked for it.
#[tokio::test]
async fn a_taken_node_port_asked_for_by_a_later_entry_is_reported_at_the_first_entry_of_its_port() {
    let s = server().await;
    let r = post(&s, SERVICES, node_port_svc("holder", Some(30054))).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    let r = post(
        &s,
        SERVICES,
        service(
            "dns",
            json!({"type":"NodePort","ports":[
                {"name":"dns","port":53,"protocol":"UDP"},
                {"name":"dns-tcp","port":53,"protocol":"TCP","nodePort":30054}]}),
        ),
    )
    .await;
    assert_invalid(
        &r,
        "Service \"dns\" is invalid: spec.ports[0].nodePort: Invalid value: 30054: provided port is already allocated",
    );
    verify_consistent(&s).await;
}

#[tokio::test]
async fn minio_collision_gives_kube_apiservers_exact_invalid_status() {
    let s = server().await;
    let r = post(&s, SERVICES, node_port_svc("minio", Some(30009))).await;
    assert_eq!(r.status, StatusCode::CREATED);
    let r = post(&s, SERVICES, node_port_svc("minio2", Some(30009))).await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        r.body,
        json!({"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure",
        "message":"Service \"minio2\" is invalid: spec.ports[0].nodePort: Invalid value: 30009: provided port is already allocated",
        "reason":"Invalid",
        "details":{"name":"minio2","kind":"Service","causes":[{"reason":"FieldValueInvalid",
            "message":"Invalid value: 30009: provided port is already allocated","field":"spec.ports[0].nodePort"}]},
        "code":422})
    );
    // The rejected create left nothing behind: not its ClusterIP, not a port.
    verify_consistent(&s).await;
}

#[tokio::test]
async fn out_of_range_node_port_is_reported_with_the_range() {
    let s = server().await;
    let r = post(&s, SERVICES, node_port_svc("low", Some(80))).await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        r.body["message"],
        "Service \"low\" is invalid: spec.ports[0].nodePort: Invalid value: 80: provided port is not in the valid range. The range of valid ports is 30000-32767"
    );
}

#[tokio::test]
async fn validation_errors_use_kubernetes_field_paths_and_texts() {
    let s = server().await;
    let cases = [
        (
            json!({"ports":[{"port":0,"targetPort":80}]}),
            "spec.ports[0].port: Invalid value: 0: must be between 1 and 65535, inclusive",
        ),
        (
            json!({"ports":[{"port":80,"protocol":"HTTP"}]}),
            "spec.ports[0].protocol: Unsupported value: \"HTTP\": supported values: \"SCTP\", \"TCP\", \"UDP\"",
        ),
        (
            json!({"ports":[{"port":80,"nodePort":30001}]}),
            "spec.ports[0].nodePort: Forbidden: may not be used when `type` is 'ClusterIP'",
        ),
        (
            json!({"ports":[{"port":80},{"port":81}]}),
            "[spec.ports[0].name: Required value, spec.ports[1].name: Required value]",
        ),
        (
            json!({"ports":[{"name":"a","port":80},{"name":"a","port":81}]}),
            "spec.ports[1].name: Duplicate value: \"a\"",
        ),
        (
            json!({"type":"Foo","ports":[{"port":80}]}),
            "spec.type: Unsupported value: \"Foo\": supported values: \"ClusterIP\", \"ExternalName\", \"LoadBalancer\", \"NodePort\"",
        ),
        (json!({}), "spec.ports: Required value"),
    ];
    for (i, (spec, want)) in cases.into_iter().enumerate() {
        let name = format!("bad{i}");
        let r = post(&s, SERVICES, service(&name, spec)).await;
        assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", r.body);
        assert_eq!(r.body["reason"], "Invalid");
        assert_eq!(
            r.body["message"],
            format!("Service \"{name}\" is invalid: {want}")
        );
    }
    verify_consistent(&s).await;
}

#[tokio::test]
async fn exhausted_range_is_a_500_internal_error() {
    let s = server_with(Config {
        node_port_range: PortRange::parse("30000-30001").unwrap(),
        ..Config::default()
    })
    .await;
    for name in ["a", "b"] {
        assert_eq!(
            post(&s, SERVICES, node_port_svc(name, None)).await.status,
            StatusCode::CREATED
        );
    }
    let r = post(&s, SERVICES, node_port_svc("c", None)).await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(r.body["reason"], "InternalError");
    assert_eq!(
        r.body["message"],
        "Internal error occurred: failed to allocate a nodePort: range is full"
    );
    // Deleting a Service frees its port for the next create.
    assert_eq!(
        delete(&s, &format!("{SERVICES}/a")).await.status,
        StatusCode::OK
    );
    assert_eq!(
        post(&s, SERVICES, node_port_svc("c", None)).await.status,
        StatusCode::CREATED
    );
    verify_consistent(&s).await;
}

#[tokio::test]
async fn missing_namespace_and_object_are_404_and_duplicates_409() {
    let s = server().await;
    let r = post(
        &s,
        "/api/v1/namespaces/nope/services",
        service("a", json!({"ports":[{"port":80}]})),
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.body["message"], "namespaces \"nope\" not found");
    let r = get(&s, &format!("{SERVICES}/missing")).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.body["message"], "services \"missing\" not found");
    assert_eq!(
        r.body["details"],
        json!({"name":"missing","kind":"services"})
    );
    let r = get(
        &s,
        "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices/x",
    )
    .await;
    assert_eq!(
        r.body["message"],
        "endpointslices.discovery.k8s.io \"x\" not found"
    );
    post(&s, SERVICES, service("a", json!({"ports":[{"port":80}]}))).await;
    let r = post(&s, SERVICES, service("a", json!({"ports":[{"port":80}]}))).await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert_eq!(r.body["reason"], "AlreadyExists");
    assert_eq!(r.body["message"], "services \"a\" already exists");
    verify_consistent(&s).await;
}

#[tokio::test]
async fn stale_resource_version_on_update_is_a_409_conflict() {
    let s = server().await;
    let created = post(&s, SERVICES, service("a", json!({"ports":[{"port":80}]})))
        .await
        .body;
    let mut first = created.clone();
    first["metadata"]["labels"] = json!({"v":"1"});
    let r = put(&s, &format!("{SERVICES}/a"), first).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let mut stale = created;
    stale["metadata"]["labels"] = json!({"v":"2"});
    let r = put(&s, &format!("{SERVICES}/a"), stale).await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert_eq!(r.body["reason"], "Conflict");
    assert_eq!(
        r.body["message"],
        "Operation cannot be fulfilled on services \"a\": the object has been modified; please apply your changes to the latest version and try again"
    );
}

#[tokio::test]
async fn update_changes_node_port_and_type_with_allocation_diff() {
    let s = server().await;
    let created = post(&s, SERVICES, node_port_svc("a", None)).await.body;
    let old_np = node_port_of(&created);
    // nodePort is mutable: the new one is allocated, the old one freed.
    let mut changed = created.clone();
    changed["spec"]["ports"][0]["nodePort"] = json!(30050);
    let r = put(&s, &format!("{SERVICES}/a"), changed).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(node_port_of(&r.body), 30050);
    let r2 = post(&s, SERVICES, node_port_svc("b", Some(old_np))).await;
    assert_eq!(
        r2.status,
        StatusCode::CREATED,
        "old port was not freed: {}",
        r2.body
    );
    // NodePort -> ClusterIP as kubectl edit sends it (nodePort still in the body) frees the port.
    let mut to_cluster_ip = r.body.clone();
    to_cluster_ip["spec"]["type"] = json!("ClusterIP");
    let r = put(&s, &format!("{SERVICES}/a"), to_cluster_ip).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert!(r.body["spec"]["ports"][0].get("nodePort").is_none());
    assert!(r.body["spec"].get("externalTrafficPolicy").is_none());
    verify_consistent(&s).await;
    // ClusterIP -> ExternalName frees the ClusterIP; back to NodePort allocates both again.
    let mut ext = r.body.clone();
    ext["spec"]["type"] = json!("ExternalName");
    ext["spec"]["externalName"] = json!("example.com");
    let r = put(&s, &format!("{SERVICES}/a"), ext).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert!(r.body["spec"].get("clusterIP").is_none());
    verify_consistent(&s).await;
    let mut back = r.body.clone();
    back["spec"]["type"] = json!("NodePort");
    back["spec"].as_object_mut().unwrap().remove("externalName");
    let r = put(&s, &format!("{SERVICES}/a"), back).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert!(r.body["spec"]["clusterIP"].is_string());
    assert!(node_port_of(&r.body) >= 30000);
    verify_consistent(&s).await;
}

#[tokio::test]
async fn cluster_ip_may_not_change_once_set() {
    let s = server().await;
    let created = post(&s, SERVICES, service("a", json!({"ports":[{"port":80}]})))
        .await
        .body;
    let mut changed = created;
    changed["spec"]["clusterIP"] = json!("10.96.0.20");
    changed["spec"]["clusterIPs"] = json!(["10.96.0.20"]);
    let r = put(&s, &format!("{SERVICES}/a"), changed).await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        r.body["message"],
        "Service \"a\" is invalid: spec.clusterIPs[0]: Invalid value: []string{\"10.96.0.20\"}: may not change once set"
    );
    verify_consistent(&s).await;
}

#[tokio::test]
async fn changing_only_cluster_ip_is_refused_on_cluster_ips_as_kube_apiserver_normalizes_it() {
    // normalizeClusterIPs: a merge patch of `clusterIP` alone means `clusterIPs` follows it;
    // the refusal then names clusterIPs[0] with the new value, not a mismatch of the two.
    let s = server().await;
    post(&s, SERVICES, service("a", json!({"ports":[{"port":80}]}))).await;
    let r = patch(
        &s,
        &format!("{SERVICES}/a"),
        "application/merge-patch+json",
        json!({"spec":{"clusterIP":"10.96.0.50"}}),
    )
    .await;
    assert_invalid(
        &r,
        "Service \"a\" is invalid: spec.clusterIPs[0]: Invalid value: []string{\"10.96.0.50\"}: may not change once set",
    );
    verify_consistent(&s).await;
}

#[tokio::test]
async fn label_annotation_and_selector_keys_and_values_are_validated_as_apimachinery_does() {
    let s = server().await;
    let mut bad = service("a", json!({"ports":[{"port":80}]}));
    bad["metadata"]["labels"] = json!({"bad key!": "v", "ok": "bad value!"});
    let r = post(&s, SERVICES, bad).await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", r.body);
    let message = r.body["message"].as_str().unwrap();
    assert!(
        message.starts_with("Service \"a\" is invalid: [metadata.labels: Invalid value: \"bad key!\": name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character"),
        "{message}"
    );
    assert!(
        message.contains("metadata.labels: Invalid value: \"bad value!\": a valid label must be an empty string or consist of alphanumeric characters"),
        "{message}"
    );
    let mut bad = service("b", json!({"ports":[{"port":80}]}));
    bad["metadata"]["annotations"] = json!({"a/b/c": "x"});
    let r = post(&s, SERVICES, bad).await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", r.body);
    assert!(
        r.body["message"].as_str().unwrap().contains(
            "metadata.annotations: Invalid value: \"a/b/c\": a qualified name must consist of"
        ),
        "{}",
        r.body
    );
    let r = post(
        &s,
        SERVICES,
        service(
            "c",
            json!({"selector":{"bad key!":"x"},"ports":[{"port":80}]}),
        ),
    )
    .await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", r.body);
    assert!(
        r.body["message"]
            .as_str()
            .unwrap()
            .contains("spec.selector: Invalid value: \"bad key!\""),
        "{}",
        r.body
    );
    // Upper case and prefixes are fine, in annotations upper-case prefixes too.
    let mut good = service("d", json!({"ports":[{"port":80}]}));
    good["metadata"]["labels"] = json!({"app.kubernetes.io/Name": "My_App.1", "empty": ""});
    good["metadata"]["annotations"] = json!({"Example.COM/Key": "anything at all!"});
    let r = post(&s, SERVICES, good).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    verify_consistent(&s).await;
}

/// kube's `ValidateService` checks the source ranges of the field (at the path
/// `spec.LoadBalancerSourceRanges`, capital L, as kube writes it) or, when the field is
/// empty, of the legacy annotation, which only a LoadBalancer may carry.
#[tokio::test]
async fn source_ranges_are_validated_in_the_field_and_in_the_legacy_annotation() {
    let s = server().await;
    let lb = |name: &str, extra: Value| {
        let mut svc = service(name, json!({"type":"LoadBalancer","ports":[{"port":80}]}));
        if let Some(ranges) = extra.get("ranges") {
            svc["spec"]["loadBalancerSourceRanges"] = ranges.clone();
        }
        if let Some(annotation) = extra.get("annotation") {
            svc["metadata"]["annotations"] =
                json!({"service.beta.kubernetes.io/load-balancer-source-ranges": annotation});
        }
        if let Some(t) = extra.get("type") {
            svc["spec"]["type"] = t.clone();
        }
        svc
    };
    let r = post(
        &s,
        SERVICES,
        lb("a", json!({"ranges":["10.0.0.0/8"," nope "]})),
    )
    .await;
    assert_invalid(
        &r,
        "Service \"a\" is invalid: spec.LoadBalancerSourceRanges[1]: Invalid value: \"nope\": must be a valid CIDR value, (e.g. 10.9.8.0/24 or 2001:db8::/64)",
    );
    let r = post(
        &s,
        SERVICES,
        lb("b", json!({"annotation":"10.0.0.0/8, foo"})),
    )
    .await;
    assert_invalid(
        &r,
        "Service \"b\" is invalid: metadata.annotations[service.beta.kubernetes.io/load-balancer-source-ranges]: Invalid value: \"foo\": must be a valid CIDR value, (e.g. 10.9.8.0/24 or 2001:db8::/64)",
    );
    let r = post(
        &s,
        SERVICES,
        lb("c", json!({"annotation":"10.0.0.0/8","type":"NodePort"})),
    )
    .await;
    assert_invalid(
        &r,
        "Service \"c\" is invalid: metadata.annotations[service.beta.kubernetes.io/load-balancer-source-ranges]: Forbidden: may only be used when `type` is 'LoadBalancer'",
    );
    // The field wins over the annotation; good values of either are accepted.
    let r = post(
        &s,
        SERVICES,
        lb("d", json!({"ranges":["10.0.0.0/8"],"annotation":"foo"})),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    let r = post(
        &s,
        SERVICES,
        lb("e", json!({"annotation":" 10.0.0.0/8 ,192.0.2.0/24"})),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
}

/// kube's `ValidateNonSpecialIP` (`ValidateEndpointIP`): a Service may not claim the node's
/// loopback, unspecified or link-local addresses as external IPs, nor may an endpoint be one
/// (otherwise every node's proxy would take over `127.0.0.1:<port>`: CVE-2020-8554's family).
#[tokio::test]
async fn special_addresses_are_refused_as_external_ips_and_endpoints() {
    let s = server().await;
    let r = post(
        &s,
        SERVICES,
        service(
            "lo",
            json!({"externalIPs":["127.0.0.1","192.0.2.7","0.0.0.0"],"ports":[{"port":8099}]}),
        ),
    )
    .await;
    assert_invalid(
        &r,
        "Service \"lo\" is invalid: [spec.externalIPs[0]: Invalid value: \"127.0.0.1\": may not be in the loopback range (127.0.0.0/8, ::1/128), spec.externalIPs[2]: Invalid value: \"0.0.0.0\": may not be unspecified (0.0.0.0)]",
    );
    for (ip, text) in [
        (
            "169.254.169.254",
            "may not be in the link-local range (169.254.0.0/16, fe80::/10)",
        ),
        (
            "224.0.0.1",
            "may not be in the link-local multicast range (224.0.0.0/24, ff02::/10)",
        ),
        (
            "::1",
            "may not be in the loopback range (127.0.0.0/8, ::1/128)",
        ),
    ] {
        let r = post(
            &s,
            SERVICES,
            service("x", json!({"externalIPs":[ip],"ports":[{"port":80}]})),
        )
        .await;
        assert_invalid(
            &r,
            &format!(
                "Service \"x\" is invalid: spec.externalIPs[0]: Invalid value: \"{ip}\": {text}"
            ),
        );
    }
    let r = post(
        &s,
        "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices",
        json!({"apiVersion":"discovery.k8s.io/v1","kind":"EndpointSlice",
        "metadata":{"name":"lo"},"addressType":"IPv4","endpoints":[{"addresses":["127.0.0.1"]}]}),
    )
    .await;
    assert_invalid(
        &r,
        "EndpointSlice.discovery.k8s.io \"lo\" is invalid: endpoints[0].addresses[0]: Invalid value: \"127.0.0.1\": may not be in the loopback range (127.0.0.0/8, ::1/128)",
    );
    let r = post(
        &s,
        "/api/v1/namespaces/default/endpoints",
        json!({"apiVersion":"v1","kind":"Endpoints","metadata":{"name":"lo"},
        "subsets":[{"addresses":[{"ip":"fe80::1"}],"ports":[{"port":80}]}]}),
    )
    .await;
    assert_invalid(
        &r,
        "Endpoints \"lo\" is invalid: subsets[0].addresses[0].ip: Invalid value: \"fe80::1\": may not be in the link-local range (169.254.0.0/16, fe80::/10)",
    );
    // Ordinary addresses stay accepted.
    let r = post(
        &s,
        SERVICES,
        service(
            "ok",
            json!({"externalIPs":["192.0.2.7"],"ports":[{"port":80}]}),
        ),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
}

#[tokio::test]
async fn load_balancer_status_is_validated_and_ip_mode_defaults_to_vip() {
    let s = server().await;
    let lb = service("lb", json!({"type":"LoadBalancer","ports":[{"port":80}]}));
    let created = post(&s, SERVICES, lb).await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    let status_uri = format!("{SERVICES}/lb/status");
    let r = patch(
        &s,
        &status_uri,
        "application/merge-patch+json",
        json!({"status":{"loadBalancer":{"ingress":[{"ip":"not-an-ip"}]}}}),
    )
    .await;
    assert_invalid(
        &r,
        "Service \"lb\" is invalid: status.loadBalancer.ingress[0].ip: Invalid value: \"not-an-ip\": must be a valid IP address, (e.g. 10.9.8.7 or 2001:db8::ffff)",
    );
    let r = patch(
        &s,
        &status_uri,
        "application/merge-patch+json",
        json!({"status":{"loadBalancer":{"ingress":[{"ip":"198.51.100.7"},{"hostname":"10.0.0.1"}]}}}),
    )
    .await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", r.body);
    assert!(
        r.body["message"]
            .as_str()
            .unwrap()
            .contains("status.loadBalancer.ingress[1].hostname: Invalid value: \"10.0.0.1\": must be a DNS name, not an IP address"),
        "{}",
        r.body
    );
    let r = patch(
        &s,
        &status_uri,
        "application/merge-patch+json",
        json!({"status":{"loadBalancer":{"ingress":[{"ip":"198.51.100.7"}]}}}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(
        r.body["status"]["loadBalancer"]["ingress"],
        json!([{"ip":"198.51.100.7","ipMode":"VIP"}])
    );
    // Ingress on a Service that is not a LoadBalancer: forbidden since 1.32.
    post(&s, SERVICES, service("cip", json!({"ports":[{"port":80}]}))).await;
    let r = patch(
        &s,
        &format!("{SERVICES}/cip/status"),
        "application/merge-patch+json",
        json!({"status":{"loadBalancer":{"ingress":[{"ip":"198.51.100.8"}]}}}),
    )
    .await;
    assert_invalid(
        &r,
        "Service \"cip\" is invalid: status.loadBalancer.ingress: Forbidden: may only be used when `spec.type` is 'LoadBalancer'",
    );
}

#[tokio::test]
async fn load_balancer_local_gets_a_health_check_node_port_and_allocation_can_be_disabled() {
    let s = server().await;
    let r = post(
        &s,
        SERVICES,
        service(
            "lb",
            json!({"type":"LoadBalancer","externalTrafficPolicy":"Local","ports":[{"port":80}]}),
        ),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert!(r.body["spec"]["healthCheckNodePort"].as_u64().unwrap() >= 30000);
    assert_eq!(r.body["spec"]["allocateLoadBalancerNodePorts"], true);
    let mut changed = r.body.clone();
    changed["spec"]["healthCheckNodePort"] = json!(30077);
    let r2 = put(&s, &format!("{SERVICES}/lb"), changed).await;
    assert_eq!(r2.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        r2.body["message"],
        "Service \"lb\" is invalid: spec.healthCheckNodePort: Forbidden: field is immutable"
    );
    let r = post(&s, SERVICES, service("lb2", json!({"type":"LoadBalancer","allocateLoadBalancerNodePorts":false,"ports":[{"port":80}]}))).await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert!(r.body["spec"]["ports"][0].get("nodePort").is_none());
    let r = post(
        &s,
        SERVICES,
        service(
            "headless",
            json!({"clusterIP":"None","ports":[{"port":80}]}),
        ),
    )
    .await;
    assert_eq!(r.body["spec"]["clusterIPs"], json!(["None"]));
    verify_consistent(&s).await;
}

#[tokio::test]
async fn dry_run_create_allocates_nothing_and_stores_nothing() {
    let s = server().await;
    let r = post(
        &s,
        &format!("{SERVICES}?dryRun=All"),
        node_port_svc("dry", Some(30009)),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert_eq!(
        get(&s, &format!("{SERVICES}/dry")).await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        post(&s, SERVICES, node_port_svc("real", Some(30009)))
            .await
            .status,
        StatusCode::CREATED
    );
    verify_consistent(&s).await;
}

#[tokio::test]
async fn generate_name_creates_a_unique_name() {
    let s = server().await;
    let body = json!({"apiVersion":"v1","kind":"Service","metadata":{"generateName":"web-"},"spec":{"ports":[{"port":80}]}});
    let a = post(&s, SERVICES, body.clone()).await.body;
    let b = post(&s, SERVICES, body).await.body;
    let (a, b) = (
        a["metadata"]["name"].as_str().unwrap(),
        b["metadata"]["name"].as_str().unwrap(),
    );
    assert!(a.starts_with("web-") && a.len() == 9);
    assert_ne!(a, b);
}

#[tokio::test]
async fn malformed_bodies_are_400_with_the_parser_position_and_large_ones_413() {
    let s = server().await;
    let r = call(
        &s,
        Method::POST,
        SERVICES,
        "application/json",
        b"{\"kind\": ".to_vec(),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(
        r.body["message"]
            .as_str()
            .unwrap()
            .contains("line 1 column"),
        "{}",
        r.body
    );
    let r = call(
        &s,
        Method::POST,
        SERVICES,
        "application/yaml",
        b"kind: Service\n  bad: [".to_vec(),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(
        r.body["message"].as_str().unwrap().contains("line"),
        "{}",
        r.body
    );
    let big = vec![b' '; 3 * 1024 * 1024 + 1];
    let r = call(&s, Method::POST, SERVICES, "application/json", big).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(r.body["reason"], "RequestEntityTooLarge");
}

#[tokio::test]
async fn yaml_bodies_are_accepted() {
    let s = server().await;
    let yaml =
        b"apiVersion: v1\nkind: Service\nmetadata:\n  name: y\nspec:\n  ports:\n  - port: 80\n";
    let r = call(
        &s,
        Method::POST,
        SERVICES,
        "application/yaml",
        yaml.to_vec(),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
}

#[tokio::test]
async fn unknown_fields_follow_field_validation() {
    let s = server().await;
    let body = service("u", json!({"foo":1,"ports":[{"port":80}]}));
    let r = post(
        &s,
        &format!("{SERVICES}?fieldValidation=Strict"),
        body.clone(),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    // transformDecodeError wraps it as any decoding error of a create or update.
    assert_eq!(
        r.body["message"],
        "Service in version \"v1\" cannot be handled as a Service: strict decoding error: unknown field \"spec.foo\""
    );
    let r = post(
        &s,
        &format!("{SERVICES}?fieldValidation=Warn"),
        body.clone(),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert_eq!(r.warnings, vec!["299 - \"unknown field \\\"spec.foo\\\"\""]);
    let r = post(
        &s,
        &format!("{SERVICES}?fieldValidation=Ignore"),
        service("u2", json!({"foo":1,"ports":[{"port":80}]})),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert!(r.warnings.is_empty());
}

#[tokio::test]
async fn list_filters_by_labels_and_fields_and_pages_with_continue() {
    let s = server().await;
    for i in 0..5 {
        let mut svc = service(&format!("s{i}"), json!({"ports":[{"port":80}]}));
        svc["metadata"]["labels"] = json!({"tier": if i % 2 == 0 { "fe" } else { "be" }});
        post(&s, SERVICES, svc).await;
    }
    let r = get(&s, &format!("{SERVICES}?labelSelector=tier%3Dfe")).await;
    assert_eq!(r.body["kind"], "ServiceList");
    assert_eq!(r.body["items"].as_array().unwrap().len(), 3);
    let r = get(&s, &format!("{SERVICES}?fieldSelector=metadata.name%3Ds3")).await;
    assert_eq!(r.body["items"].as_array().unwrap().len(), 1);
    let r = get(
        &s,
        "/api/v1/services?fieldSelector=metadata.namespace%3Ddefault",
    )
    .await;
    assert_eq!(
        r.body["items"].as_array().unwrap().len(),
        6,
        "5 + kubernetes"
    );
    let mut names = Vec::new();
    let mut uri = format!("{SERVICES}?limit=2");
    loop {
        let page = get(&s, &uri).await.body;
        names.extend(
            page["items"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i["metadata"]["name"].as_str().unwrap().to_owned()),
        );
        match page["metadata"]["continue"].as_str() {
            Some(token) => uri = format!("{SERVICES}?limit=2&continue={token}"),
            None => break,
        }
    }
    assert_eq!(names, ["kubernetes", "s0", "s1", "s2", "s3", "s4"]);
    let r = get(&s, &format!("{SERVICES}?fieldSelector=spec.foo%3Dbar")).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn table_output_has_kubectls_columns() {
    let s = server().await;
    post(&s, SERVICES, node_port_svc("web", Some(30510))).await;
    let req = Request::get(format!("{SERVICES}/web"))
        .header(
            "accept",
            "application/json;as=Table;v=v1;g=meta.k8s.io,application/json",
        )
        .body(Body::empty())
        .unwrap();
    let response = nodeport_apiserver::router(s.clone())
        .oneshot(req)
        .await
        .unwrap();
    let body: Value =
        serde_json::from_slice(&response.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(body["kind"], "Table");
    let columns: Vec<&str> = body["columnDefinitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        &columns[..6],
        [
            "Name",
            "Type",
            "Cluster-IP",
            "External-IP",
            "Port(s)",
            "Age"
        ]
    );
    assert_eq!(body["rows"][0]["cells"][4], "9000:30510/TCP");
}

#[tokio::test]
async fn patches_json_merge_and_strategic_apply() {
    let s = server().await;
    let created = post(
        &s,
        SERVICES,
        service(
            "p",
            json!({"type":"NodePort","ports":[{"name":"http","port":80}]}),
        ),
    )
    .await
    .body;
    let np = node_port_of(&created);
    let uri = format!("{SERVICES}/p");
    let r = patch(
        &s,
        &uri,
        "application/merge-patch+json",
        json!({"metadata":{"labels":{"a":"b"}}}),
    )
    .await;
    assert_eq!(r.body["metadata"]["labels"], json!({"a":"b"}));
    let r = patch(
        &s,
        &uri,
        "application/json-patch+json",
        json!([{"op":"add","path":"/metadata/labels/c","value":"d"}]),
    )
    .await;
    assert_eq!(r.body["metadata"]["labels"], json!({"a":"b","c":"d"}));
    // Strategic merge adds 80/UDP next to 80/TCP (Test_ServiceSetPortWithPatch).
    let r = patch(
        &s,
        &uri,
        "application/strategic-merge-patch+json",
        json!({"spec":{
        "$setElementOrder/ports":[{"port":80},{"port":80}],
        "ports":[{"name":"dns","port":80,"protocol":"UDP"}]}}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let ports = r.body["spec"]["ports"].as_array().unwrap();
    assert_eq!(ports.len(), 2);
    assert_eq!(ports[0]["nodePort"], np);
    assert!(ports[1]["nodePort"].as_u64().unwrap() >= 30000);
    // Server-side apply without `fieldManager` is kube's 422 (`ValidatePatchOptions`).
    let r = patch(&s, &uri, "application/apply-patch+yaml", json!({})).await;
    assert_invalid(
        &r,
        "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value: is required for apply patch",
    );
    let r = patch(&s, &uri, "application/x-unknown-patch", json!({})).await;
    assert_eq!(r.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    verify_consistent(&s).await;
}

#[tokio::test]
async fn status_subresource_changes_only_status() {
    let s = server().await;
    let created = post(
        &s,
        SERVICES,
        service("lb", json!({"type":"LoadBalancer","ports":[{"port":80}]})),
    )
    .await
    .body;
    let mut body = created.clone();
    body["status"] = json!({"loadBalancer":{"ingress":[{"ip":"192.0.2.10"}]}});
    body["spec"]["type"] = json!("ClusterIP");
    let r = put(&s, &format!("{SERVICES}/lb/status"), body).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(
        r.body["status"]["loadBalancer"]["ingress"][0]["ip"],
        "192.0.2.10"
    );
    assert_eq!(r.body["spec"]["type"], "LoadBalancer");
    // And a plain update does not change status.
    let mut plain = r.body.clone();
    plain["status"] = json!({});
    let r = put(&s, &format!("{SERVICES}/lb"), plain).await;
    assert_eq!(
        r.body["status"]["loadBalancer"]["ingress"][0]["ip"],
        "192.0.2.10"
    );
}

#[tokio::test]
async fn delete_honours_preconditions_and_returns_the_service() {
    let s = server().await;
    let created = post(&s, SERVICES, node_port_svc("d", None)).await.body;
    let uri = format!("{SERVICES}/d");
    let r = call(
        &s,
        Method::DELETE,
        &uri,
        "application/json",
        serde_json::to_vec(&json!({"preconditions":{"uid":"wrong"}})).unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert!(
        r.body["message"]
            .as_str()
            .unwrap()
            .contains("Precondition failed: UID in precondition: wrong")
    );
    let r = call(
        &s,
        Method::DELETE,
        &uri,
        "application/json",
        serde_json::to_vec(&json!({"preconditions":{"uid":created["metadata"]["uid"]}})).unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.body["kind"], "Service");
    assert_eq!(delete(&s, &uri).await.status, StatusCode::NOT_FOUND);
    verify_consistent(&s).await;
}

#[tokio::test]
async fn deletecollection_removes_what_the_selector_matches() {
    // "should delete a collection of services" (conformance, v1.23).
    let s = server().await;
    for (name, label) in [("a", "x"), ("b", "x"), ("c", "y")] {
        let mut svc = node_port_svc(name, None);
        svc["metadata"]["labels"] = json!({"set": label});
        post(&s, SERVICES, svc).await;
    }
    let r = delete(&s, &format!("{SERVICES}?labelSelector=set%3Dx")).await;
    assert_eq!(r.body["items"].as_array().unwrap().len(), 2);
    let left = get(&s, &format!("{SERVICES}?labelSelector=set")).await;
    assert_eq!(left.body["items"].as_array().unwrap().len(), 1);
    verify_consistent(&s).await;
}

#[tokio::test]
async fn other_kinds_create_list_and_delete() {
    let s = server().await;
    let r = post(
        &s,
        "/api/v1/nodes",
        json!({"apiVersion":"v1","kind":"Node","metadata":{"name":"worker"}}),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    let r = get(&s, "/api/v1/nodes?fieldSelector=metadata.name%3Dworker").await;
    assert_eq!(r.body["items"].as_array().unwrap().len(), 1);
    let r = post(
        &s,
        "/api/v1/namespaces/default/endpoints",
        json!({"apiVersion":"v1","kind":"Endpoints","metadata":{"name":"web"},
        "subsets":[{"addresses":[{"ip":"10.244.1.6"}],"ports":[{"port":80}]}]}),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    let r = post(&s, "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices", json!({"apiVersion":"discovery.k8s.io/v1","kind":"EndpointSlice",
        "metadata":{"name":"web-abc","labels":{"kubernetes.io/service-name":"web"}},"addressType":"IPv4",
        "endpoints":[{"addresses":["10.244.1.6"]}],"ports":[{"port":80,"protocol":"TCP"}]})).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    let r = post(
        &s,
        "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices",
        json!({"apiVersion":"discovery.k8s.io/v1","kind":"EndpointSlice",
        "metadata":{"name":"bad"},"addressType":"IPv4","endpoints":[{"addresses":["not-an-ip"]}]}),
    )
    .await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY);
    let r = post(
        &s,
        "/api/v1/namespaces",
        json!({"apiVersion":"v1","kind":"Namespace","metadata":{"name":"team"}}),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED);
    post(
        &s,
        "/api/v1/namespaces/team/services",
        node_port_svc("t", None),
    )
    .await;
    let r = delete(&s, "/api/v1/namespaces/team").await;
    assert_eq!(r.status, StatusCode::OK);
    wait_gone(&s, "/api/v1/namespaces/team").await;
    assert_eq!(
        get(&s, "/api/v1/namespaces/team/services/t").await.status,
        StatusCode::NOT_FOUND
    );
    let r = delete(&s, "/api/v1/namespaces/default").await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    let r = delete(&s, "/api/v1/namespaces/default/endpoints/web").await;
    assert_eq!(r.body["status"], "Success");
    verify_consistent(&s).await;
}

#[tokio::test]
async fn ranges_endpoint_reports_use_per_band() {
    let s = server().await;
    post(&s, SERVICES, node_port_svc("minio", Some(30009))).await;
    post(&s, SERVICES, node_port_svc("dyn", None)).await;
    let r = get(&s, "/ranges").await;
    let np = &r.body["nodePorts"];
    assert_eq!(np["range"], "30000-32767");
    assert_eq!(np["static"]["used"], 1);
    assert_eq!(np["static"]["last"], "30085");
    assert_eq!(np["dynamic"]["used"], 1);
    assert_eq!(r.body["clusterIPs"]["used"], 3);
    let m = get(&s, "/metrics").await;
    assert!(
        m.body
            .as_str()
            .unwrap()
            .contains("kube_apiserver_nodeport_allocator_allocated_ports 2")
    );
}

#[tokio::test]
async fn unknown_paths_and_verbs_get_status_errors() {
    let s = server().await;
    let r = get(&s, "/api/v1/pods").await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.body["kind"], "Status");
    let r = call(
        &s,
        Method::PUT,
        SERVICES,
        "application/json",
        b"{}".to_vec(),
    )
    .await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
}

/// kube-apiserver >= 1.33 serves `networking.k8s.io/v1` ServiceCIDRs and keeps one named
/// `kubernetes` for `--service-cluster-ip-range`, Ready (its default-ServiceCIDR controller);
/// kube-proxy reads it to drop traffic to unallocated ClusterIPs. (Writes: tests/service_cidrs.rs.)
#[tokio::test]
async fn the_default_service_cidr_mirrors_the_cluster_ip_range() {
    let s = server_with(Config {
        cluster_ip_range: "10.43.0.0/16".parse().unwrap(),
        ..Config::default()
    })
    .await;
    let groups = get(&s, "/apis").await;
    let names: Vec<&str> = groups.body["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["name"].as_str().unwrap())
        .collect();
    assert!(names.contains(&"networking.k8s.io"), "{names:?}");
    let group = get(&s, "/apis/networking.k8s.io").await;
    assert_eq!(group.status, StatusCode::OK);
    assert_eq!(
        group.body["preferredVersion"]["groupVersion"],
        "networking.k8s.io/v1"
    );
    let resources = get(&s, "/apis/networking.k8s.io/v1").await;
    assert_eq!(
        resources.body["resources"][0],
        json!({"name":"servicecidrs","singularName":"servicecidr","namespaced":false,
                "kind":"ServiceCIDR","verbs":["create","delete","deletecollection","get","list",
                "patch","update","watch"]})
    );

    const CIDRS: &str = "/apis/networking.k8s.io/v1/servicecidrs";
    let one = get(&s, &format!("{CIDRS}/kubernetes")).await;
    assert_eq!(one.status, StatusCode::OK, "{}", one.body);
    assert_eq!(one.body["apiVersion"], "networking.k8s.io/v1");
    assert_eq!(one.body["kind"], "ServiceCIDR");
    assert_eq!(one.body["spec"]["cidrs"], json!(["10.43.0.0/16"]));
    let ready = &one.body["status"]["conditions"][0];
    assert_eq!(ready["type"], "Ready");
    assert_eq!(ready["status"], "True");
    assert_eq!(ready["message"], "Kubernetes default Service CIDR is ready");
    assert!(ready["lastTransitionTime"].is_string());
    assert!(one.body["metadata"]["resourceVersion"].is_string());

    let list = get(&s, CIDRS).await;
    assert_eq!(list.body["kind"], "ServiceCIDRList");
    assert_eq!(list.body["items"].as_array().unwrap().len(), 1);
    let missing = get(&s, &format!("{CIDRS}/other")).await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    assert_eq!(
        missing.body["message"],
        "servicecidrs.networking.k8s.io \"other\" not found"
    );
}

/// Waits (up to 10 s) until `uri` answers 404.
async fn wait_gone(state: &AppState, uri: &str) {
    for _ in 0..1000 {
        if get(state, uri).await.status == StatusCode::NOT_FOUND {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("{uri} still exists");
}

fn namespace(name: &str, finalizers: &[&str]) -> Value {
    json!({"apiVersion":"v1","kind":"Namespace","metadata":{"name":name},
           "spec":{"finalizers":finalizers}})
}

#[tokio::test]
async fn deleting_a_namespace_makes_it_terminating_then_removes_its_contents_and_it() {
    // kube-apiserver's namespace REST: the first DELETE answers 200 with the namespace, now with
    // a deletionTimestamp and phase Terminating; the namespace controller empties and removes it.
    let s = server().await;
    assert_eq!(
        post(&s, "/api/v1/namespaces", namespace("team", &[]))
            .await
            .status,
        StatusCode::CREATED
    );
    for i in 0..40 {
        let r = post(
            &s,
            "/api/v1/namespaces/team/services",
            node_port_svc(&format!("s{i}"), None),
        )
        .await;
        assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    }
    let r = delete(&s, "/api/v1/namespaces/team").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["kind"], "Namespace");
    assert_eq!(r.body["status"]["phase"], "Terminating");
    assert!(r.body["metadata"]["deletionTimestamp"].is_string());
    assert_eq!(r.body["spec"]["finalizers"], json!(["kubernetes"]));
    wait_gone(&s, "/api/v1/namespaces/team").await;
    let left = get(&s, "/api/v1/namespaces/team/services").await;
    assert_eq!(left.body["items"], json!([]));
    verify_consistent(&s).await;
}

#[tokio::test]
async fn a_terminating_namespace_refuses_creates_with_namespace_lifecycles_403_until_finalized() {
    // An extra finalizer keeps the namespace Terminating once the controller has removed its own
    // (`kubernetes`) and the contents, as in kube-apiserver.
    let s = server().await;
    let r = post(
        &s,
        "/api/v1/namespaces",
        namespace("held", &["example.com/hold"]),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert_eq!(
        r.body["spec"]["finalizers"],
        json!(["example.com/hold", "kubernetes"])
    );
    let r = post(
        &s,
        "/api/v1/namespaces/held/services",
        node_port_svc("web", None),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert_eq!(
        delete(&s, "/api/v1/namespaces/held").await.status,
        StatusCode::OK
    );
    // The controller deletes the Service and drops its finalizer; the namespace stays.
    wait_gone(&s, "/api/v1/namespaces/held/services/web").await;
    let mut ns = get(&s, "/api/v1/namespaces/held").await.body;
    for _ in 0..1000 {
        if ns["spec"]["finalizers"] == json!(["example.com/hold"]) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        ns = get(&s, "/api/v1/namespaces/held").await.body;
    }
    assert_eq!(
        ns["spec"]["finalizers"],
        json!(["example.com/hold"]),
        "{ns}"
    );
    assert_eq!(ns["status"]["phase"], "Terminating");

    for (uri, body) in [
        (
            "/api/v1/namespaces/held/services",
            node_port_svc("late", None),
        ),
        (
            "/api/v1/namespaces/held/endpoints",
            json!({"apiVersion":"v1","kind":"Endpoints","metadata":{"name":"late"}}),
        ),
    ] {
        let r = post(&s, uri, body).await;
        assert_eq!(r.status, StatusCode::FORBIDDEN, "{}", r.body);
        assert_eq!(r.body["reason"], "Forbidden");
        assert!(
            r.body["message"].as_str().unwrap().ends_with(
                "\"late\" is forbidden: unable to create new content in namespace held because it is being terminated"
            ),
            "{}",
            r.body
        );
        assert_eq!(
            r.body["details"]["causes"][0]["reason"],
            "NamespaceTerminating"
        );
    }
    // Create-on-update (PUT of a missing Service) is a create too.
    let r = put(
        &s,
        "/api/v1/namespaces/held/services/late",
        node_port_svc("late", None),
    )
    .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN, "{}", r.body);

    // A second DELETE while a finalizer is pending answers with the namespace, unchanged.
    let r = delete(&s, "/api/v1/namespaces/held").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(
        r.body["metadata"]["resourceVersion"],
        ns["metadata"]["resourceVersion"]
    );

    // Removing the last finalizer through `finalize` removes the namespace.
    let mut finalized = ns.clone();
    finalized["spec"]["finalizers"] = json!([]);
    let r = put(&s, "/api/v1/namespaces/held/finalize", finalized).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(
        get(&s, "/api/v1/namespaces/held").await.status,
        StatusCode::NOT_FOUND
    );
    verify_consistent(&s).await;
}

#[tokio::test]
async fn namespace_finalizers_need_a_domain_unless_standard_and_change_only_through_finalize() {
    let s = server().await;
    let r = post(&s, "/api/v1/namespaces", namespace("bad", &["hold"])).await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        r.body["message"],
        "Namespace \"bad\" is invalid: spec.finalizers: Invalid value: \"hold\": name is neither a standard finalizer name nor is it fully qualified"
    );
    post(&s, "/api/v1/namespaces", namespace("ok", &[])).await;
    // An ordinary update keeps the finalizers (the namespace strategy's PrepareForUpdate).
    let mut ns = get(&s, "/api/v1/namespaces/ok").await.body;
    ns["spec"]["finalizers"] = json!([]);
    ns["metadata"]["labels"]["team"] = json!("a");
    let r = put(&s, "/api/v1/namespaces/ok", ns).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["spec"]["finalizers"], json!(["kubernetes"]));
    assert_eq!(r.body["metadata"]["labels"]["team"], "a");
    let r = call(
        &s,
        Method::PATCH,
        "/api/v1/namespaces/ok/finalize",
        "application/merge-patch+json",
        b"{}".to_vec(),
    )
    .await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
}

#[tokio::test]
async fn deletecollection_of_three_hundred_services_frees_every_port_and_address() {
    let s = server().await;
    for i in 0..300 {
        let mut svc = node_port_svc(&format!("bulk-{i}"), None);
        svc["metadata"]["labels"] = json!({"set": "bulk"});
        let r = post(&s, SERVICES, svc).await;
        assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    }
    let r = delete(&s, &format!("{SERVICES}?labelSelector=set%3Dbulk")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["items"].as_array().unwrap().len(), 300);
    let left = get(&s, SERVICES).await;
    let names: Vec<&str> = left.body["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["metadata"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["kubernetes"]);
    verify_consistent(&s).await;
    let np = get(&s, "/ranges").await.body;
    assert_eq!(np["nodePorts"]["dynamic"]["used"], 0, "{np}");
}

#[tokio::test]
async fn a_service_with_a_finalizer_is_only_marked_on_delete_and_keeps_its_ports_until_the_last_finalizer_goes()
 {
    // The generic store's `updateForGracefulDeletionAndFinalizers` and `ShouldDeleteDuringUpdate`:
    // a load-balancer controller's `service.kubernetes.io/load-balancer-cleanup` holds the
    // Service (and its node port) until the controller has cleaned up and removed it.
    let s = server().await;
    let mut svc = node_port_svc("held", Some(30555));
    svc["metadata"]["finalizers"] = json!(["service.kubernetes.io/load-balancer-cleanup"]);
    let r = post(&s, SERVICES, svc).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    let uri = format!("{SERVICES}/held");

    let r = delete(&s, &uri).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert!(
        r.body["metadata"]["deletionTimestamp"].is_string(),
        "{}",
        r.body
    );
    assert_eq!(r.body["metadata"]["deletionGracePeriodSeconds"], 0);
    let marked_rv = r.body["metadata"]["resourceVersion"].clone();
    let r = get(&s, &uri).await;
    assert_eq!(r.status, StatusCode::OK, "the Service is still there");
    assert_eq!(r.body["metadata"]["resourceVersion"], marked_rv);
    // Its node port is still taken.
    let r = post(&s, SERVICES, node_port_svc("other", Some(30555))).await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", r.body);
    // A second DELETE changes nothing; no new finalizer may be added now.
    let r = delete(&s, &uri).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["metadata"]["resourceVersion"], marked_rv);
    let r = patch(
        &s,
        &uri,
        "application/merge-patch+json",
        json!({"metadata":{"finalizers":["service.kubernetes.io/load-balancer-cleanup","example.com/more"]}}),
    )
    .await;
    assert_invalid(
        &r,
        "Service \"held\" is invalid: metadata.finalizers: Forbidden: no new finalizers can be added if the object is being deleted, found new finalizers []string{\"example.com/more\"}",
    );
    verify_consistent(&s).await;

    // Removing the last finalizer removes the Service and frees the port.
    let r = patch(
        &s,
        &uri,
        "application/merge-patch+json",
        json!({"metadata":{"finalizers":null}}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(get(&s, &uri).await.status, StatusCode::NOT_FOUND);
    let r = post(&s, SERVICES, node_port_svc("other", Some(30555))).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    verify_consistent(&s).await;
}

#[tokio::test]
async fn finalizer_names_are_qualified_and_fully_qualified_unless_standard() {
    // apimachinery's ValidateFinalizers, then core's validateKubeFinalizerName.
    let s = server().await;
    let mut svc = service("f", json!({"ports":[{"port":80}]}));
    svc["metadata"]["finalizers"] = json!(["bad finalizer"]);
    let r = post(&s, SERVICES, svc).await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", r.body);
    let message = r.body["message"].as_str().unwrap();
    assert!(
        message.starts_with("Service \"f\" is invalid: [metadata.finalizers: Invalid value: \"bad finalizer\": name part must consist of"),
        "{message}"
    );
    assert!(
        message.ends_with("metadata.finalizers[0]: Invalid value: \"bad finalizer\": name is neither a standard finalizer name nor is it fully qualified]"),
        "{message}"
    );
    let mut svc = service("g", json!({"ports":[{"port":80}]}));
    svc["metadata"]["finalizers"] = json!(["hold"]);
    let r = post(&s, SERVICES, svc).await;
    assert_eq!(
        r.body["message"],
        "Service \"g\" is invalid: metadata.finalizers[0]: Invalid value: \"hold\": name is neither a standard finalizer name nor is it fully qualified"
    );
    let mut svc = service("h", json!({"ports":[{"port":80}]}));
    svc["metadata"]["finalizers"] = json!(["orphan", "foregroundDeletion"]);
    let r = post(&s, SERVICES, svc).await;
    assert_eq!(
        r.body["message"],
        "Service \"h\" is invalid: metadata.finalizers: Invalid value: []string{\"orphan\", \"foregroundDeletion\"}: finalizer orphan and foregroundDeletion cannot be both set"
    );
}

#[tokio::test]
async fn a_second_namespace_delete_does_not_bypass_its_metadata_finalizers() {
    let s = server().await;
    let mut ns = namespace("held", &[]);
    ns["metadata"]["finalizers"] = json!(["example.com/hold"]);
    assert_eq!(
        post(&s, "/api/v1/namespaces", ns).await.status,
        StatusCode::CREATED
    );
    assert_eq!(
        delete(&s, "/api/v1/namespaces/held").await.status,
        StatusCode::OK
    );
    // Wait until the namespace controller is done with spec.finalizers.
    for _ in 0..500 {
        let r = get(&s, "/api/v1/namespaces/held").await;
        if r.body["spec"]["finalizers"]
            .as_array()
            .is_none_or(Vec::is_empty)
        {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let r = delete(&s, "/api/v1/namespaces/held").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(
        get(&s, "/api/v1/namespaces/held").await.status,
        StatusCode::OK,
        "the second DELETE removed a namespace its metadata finalizer still holds"
    );
    let r = patch(
        &s,
        "/api/v1/namespaces/held",
        "application/merge-patch+json",
        json!({"metadata":{"finalizers":null}}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    wait_gone(&s, "/api/v1/namespaces/held").await;
}

#[tokio::test]
async fn a_create_through_put_starts_with_no_deletion_timestamp() {
    // BeforeCreate clears it: otherwise the object would look deleted, and the next update
    // would remove it.
    let s = server().await;
    let uri = "/api/v1/namespaces/default/endpoints/x";
    let body = json!({"apiVersion":"v1","kind":"Endpoints",
        "metadata":{"name":"x","deletionTimestamp":"2024-01-01T00:00:00Z"}});
    let r = put(&s, uri, body).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert!(
        r.body["metadata"]["deletionTimestamp"].is_null(),
        "{}",
        r.body
    );
    let r = patch(
        &s,
        uri,
        "application/merge-patch+json",
        json!({"metadata":{"labels":{"a":"b"}}}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(get(&s, uri).await.status, StatusCode::OK);
}

#[tokio::test]
async fn a_delete_that_only_marks_answers_with_the_object_and_moves_its_generation() {
    // The generic store returns the marked object, not a Status (a Status says it is gone),
    // and markAsDeleting bumps the generation.
    let s = server().await;
    let slices = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices";
    let slice = json!({"apiVersion":"discovery.k8s.io/v1","kind":"EndpointSlice",
        "metadata":{"name":"es","finalizers":["example.com/hold"]},"addressType":"IPv4","endpoints":[]});
    let r = post(&s, slices, slice).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    let generation = r.body["metadata"]["generation"].as_i64().unwrap();
    let r = delete(&s, &format!("{slices}/es")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["kind"], "EndpointSlice", "{}", r.body);
    assert!(r.body["metadata"]["deletionTimestamp"].is_string());
    assert_eq!(r.body["metadata"]["generation"], generation + 1);
}

#[tokio::test]
async fn a_namespace_waits_for_content_with_finalizers_and_goes_once_they_are_removed() {
    let s = server().await;
    post(&s, "/api/v1/namespaces", namespace("team", &[])).await;
    let uri = "/api/v1/namespaces/team/services/held";
    let mut svc = service("held", json!({"ports":[{"port":80}]}));
    svc["metadata"]["finalizers"] = json!(["example.com/hold"]);
    let r = post(&s, "/api/v1/namespaces/team/services", svc).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    let r = delete(&s, "/api/v1/namespaces/team").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    // The namespace controller marks the Service; namespace and Service stay while it is held.
    let mut marked = false;
    for _ in 0..500 {
        let r = get(&s, uri).await;
        if r.body["metadata"]["deletionTimestamp"].is_string() {
            marked = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(marked, "the namespace controller never deleted the Service");
    let r = get(&s, "/api/v1/namespaces/team").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["status"]["phase"], "Terminating");
    let r = patch(
        &s,
        uri,
        "application/merge-patch+json",
        json!({"metadata":{"finalizers":[]}}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(get(&s, uri).await.status, StatusCode::NOT_FOUND);
    wait_gone(&s, "/api/v1/namespaces/team").await;
}

#[tokio::test]
async fn a_create_carrying_a_resource_version_is_refused_as_kube_apiservers_storage_refuses_it() {
    // `kubectl get -o yaml` output created again after a delete: etcd3 storage's
    // ErrResourceVersionSetOnCreate, a 500 without a reason (kubectl: "Error from server: ...").
    let s = server().await;
    let mut svc = service("rv", json!({"ports":[{"port":80}]}));
    svc["metadata"]["resourceVersion"] = json!("5");
    let r = post(&s, SERVICES, svc).await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR, "{}", r.body);
    assert!(r.body.get("reason").is_none(), "{}", r.body);
    assert_eq!(
        r.body["message"],
        "resourceVersion should not be set on objects to be created"
    );
    assert_eq!(
        get(&s, &format!("{SERVICES}/rv")).await.status,
        StatusCode::NOT_FOUND
    );
    // etcd3 parses it as a number: "0" passes, and a dry run never gets that far.
    let mut svc = service("rv", json!({"ports":[{"port":80}]}));
    svc["metadata"]["resourceVersion"] = json!("5");
    let r = post(&s, &format!("{SERVICES}?dryRun=All"), svc.clone()).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    svc["metadata"]["resourceVersion"] = json!("0");
    let r = post(&s, SERVICES, svc).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    verify_consistent(&s).await;
}

#[tokio::test]
async fn an_endpoint_slices_address_type_is_immutable() {
    let s = server().await;
    let slices = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices";
    let slice = json!({"apiVersion":"discovery.k8s.io/v1","kind":"EndpointSlice",
        "metadata":{"name":"es"},"addressType":"IPv4","endpoints":[],"ports":[]});
    assert_eq!(post(&s, slices, slice).await.status, StatusCode::CREATED);
    let r = patch(
        &s,
        &format!("{slices}/es"),
        "application/merge-patch+json",
        json!({"addressType":"IPv6"}),
    )
    .await;
    assert_invalid(
        &r,
        "EndpointSlice.discovery.k8s.io \"es\" is invalid: addressType: Invalid value: \"IPv6\": field is immutable",
    );
}

/// `k8s\0` + `runtime.Unknown`, the body client-go's typed clients send
/// (`Content-Type: application/vnd.kubernetes.protobuf`).
fn protobuf_body(api_version: &str, kind: &str, object: &impl prost::Message) -> Vec<u8> {
    use k8s_pb::apimachinery::pkg::runtime::{TypeMeta, Unknown};
    let unknown = Unknown {
        type_meta: Some(TypeMeta {
            api_version: Some(api_version.into()),
            kind: Some(kind.into()),
        }),
        raw: Some(object.encode_to_vec()),
        ..Default::default()
    };
    [
        b"k8s\0".as_slice(),
        &prost::Message::encode_to_vec(&unknown),
    ]
    .concat()
}

/// A NodePort Service as `kubectl create service nodeport <name> --tcp=80:8080` builds it.
fn protobuf_service(name: &str, node_port: i32) -> k8s_pb::api::core::v1::Service {
    use k8s_pb::api::core::v1::{Service, ServicePort, ServiceSpec};
    use k8s_pb::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use k8s_pb::apimachinery::pkg::util::intstr::IntOrString;
    Service {
        metadata: Some(ObjectMeta {
            name: Some(name.into()),
            labels: [("app".to_string(), name.to_string())].into(),
            ..Default::default()
        }),
        spec: Some(ServiceSpec {
            ports: vec![ServicePort {
                name: Some("80-8080".into()),
                protocol: Some("TCP".into()),
                port: Some(80),
                target_port: Some(IntOrString {
                    r#type: Some(0),
                    int_val: Some(8080),
                    str_val: Some(String::new()),
                }),
                node_port: Some(node_port),
                app_protocol: None,
            }],
            selector: [("app".to_string(), name.to_string())].into(),
            cluster_ip: Some(String::new()),
            r#type: Some("NodePort".into()),
            ..Default::default()
        }),
        status: None,
    }
}

const PROTOBUF: &str = "application/vnd.kubernetes.protobuf";

#[tokio::test]
async fn protobuf_bodies_create_update_and_delete_services_as_json_bodies_do() {
    use k8s_pb::apimachinery::pkg::apis::meta::v1::{DeleteOptions, Preconditions};
    let s = server().await;
    let body = protobuf_body("v1", "Service", &protobuf_service("pb", 30080));
    let r = call(&s, Method::POST, SERVICES, PROTOBUF, body).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert_eq!(node_port_of(&r.body), 30080);
    assert_eq!(r.body["spec"]["ports"][0]["targetPort"], 8080);
    assert_eq!(r.body["spec"]["type"], "NodePort");
    let uid = r.body["metadata"]["uid"].as_str().unwrap().to_owned();
    let rv = r.body["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_owned();

    // A second Service asking for the same static port: kube-apiserver's 422.
    let body = protobuf_body("v1", "Service", &protobuf_service("pb2", 30080));
    let r = call(&s, Method::POST, SERVICES, PROTOBUF, body).await;
    assert_invalid(
        &r,
        "Service \"pb2\" is invalid: spec.ports[0].nodePort: Invalid value: 30080: provided port is already allocated",
    );

    // An update (PUT) moves the port; the old one is freed.
    let mut moved = protobuf_service("pb", 30081);
    moved.metadata.as_mut().unwrap().resource_version = Some(rv);
    let body = protobuf_body("v1", "Service", &moved);
    let r = call(&s, Method::PUT, &format!("{SERVICES}/pb"), PROTOBUF, body).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(node_port_of(&r.body), 30081);
    verify_consistent(&s).await;

    // A typed delete carries protobuf DeleteOptions; its preconditions hold.
    let options = |uid: &str| DeleteOptions {
        preconditions: Some(Preconditions {
            uid: Some(uid.into()),
            resource_version: None,
        }),
        ..Default::default()
    };
    let body = protobuf_body("v1", "DeleteOptions", &options("not-the-uid"));
    let r = call(
        &s,
        Method::DELETE,
        &format!("{SERVICES}/pb"),
        PROTOBUF,
        body,
    )
    .await;
    assert_eq!(r.status, StatusCode::CONFLICT, "{}", r.body);
    let body = protobuf_body("v1", "DeleteOptions", &options(&uid));
    let r = call(
        &s,
        Method::DELETE,
        &format!("{SERVICES}/pb"),
        PROTOBUF,
        body,
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    verify_consistent(&s).await;
}

#[tokio::test]
async fn malformed_protobuf_is_400_and_a_kind_not_decoded_from_protobuf_is_415() {
    let s = server().await;
    let r = call(
        &s,
        Method::POST,
        SERVICES,
        PROTOBUF,
        br#"{"kind":"Service"}"#.to_vec(),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.body);
    assert_eq!(r.body["reason"], "BadRequest");
    assert_eq!(
        r.body["message"],
        "provided data does not appear to be a protobuf message, expected prefix [107 56 115 0]"
    );

    let mut body = protobuf_body("v1", "Service", &protobuf_service("cut", 0));
    body.truncate(body.len() - 4);
    let r = call(&s, Method::POST, SERVICES, PROTOBUF, body).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.body);
    assert!(
        r.body["message"]
            .as_str()
            .unwrap()
            .starts_with("failed to decode the protobuf"),
        "{}",
        r.body
    );

    let pod = k8s_pb::api::core::v1::Pod::default();
    let r = call(
        &s,
        Method::POST,
        SERVICES,
        PROTOBUF,
        protobuf_body("v1", "Pod", &pod),
    )
    .await;
    assert_eq!(r.status, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{}", r.body);
    assert_eq!(r.body["reason"], "UnsupportedMediaType");
    assert!(
        r.body["message"]
            .as_str()
            .unwrap()
            .contains("v1 Service, v1 Namespace"),
        "{}",
        r.body
    );

    let r = call(&s, Method::POST, SERVICES, "application/cbor", vec![0xa0]).await;
    assert_eq!(r.status, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{}", r.body);
    assert!(
        r.body["message"]
            .as_str()
            .unwrap()
            .contains("application/vnd.kubernetes.protobuf"),
        "{}",
        r.body
    );
    let r = get(&s, SERVICES).await;
    assert_eq!(r.body["items"].as_array().unwrap().len(), 1, "{}", r.body);
}

#[tokio::test]
async fn a_json_key_given_twice_follows_field_validation_as_kube_apiservers_strict_decoder() {
    let s = server().await;
    let body = |name: &str| {
        format!(
            r#"{{"apiVersion":"v1","kind":"Service","metadata":{{"name":"{name}"}},"spec":{{"ports":[{{"port":80}}],"ports":[{{"port":81}}]}}}}"#
        )
        .into_bytes()
    };
    let r = call(
        &s,
        Method::POST,
        &format!("{SERVICES}?fieldValidation=Strict"),
        "application/json",
        body("d1"),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.body);
    assert_eq!(
        r.body["message"],
        "Service in version \"v1\" cannot be handled as a Service: strict decoding error: duplicate field \"spec.ports\""
    );
    let r = call(
        &s,
        Method::POST,
        &format!("{SERVICES}?fieldValidation=Warn"),
        "application/json",
        body("d2"),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert_eq!(
        r.warnings,
        vec!["299 - \"duplicate field \\\"spec.ports\\\"\""]
    );
    // The later value wins, as in Go's encoding/json.
    assert_eq!(r.body["spec"]["ports"][0]["port"], 81);
    let r = call(
        &s,
        Method::POST,
        &format!("{SERVICES}?fieldValidation=Ignore"),
        "application/json",
        body("d3"),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert!(r.warnings.is_empty());
}

#[tokio::test]
async fn the_kubernetes_service_gets_the_advertised_address_and_leases_expire_or_leave() {
    // kube-apiserver's lease endpoint reconciler, with this server's lease taken at start. Other
    // API servers are played by other registries over the same store.
    let s = server_with(Config {
        advertise_address: Some("192.0.2.10".parse().unwrap()),
        port: 6443,
        ..Config::default()
    })
    .await;
    let endpoints = "/api/v1/namespaces/default/endpoints/kubernetes";
    let ips = |r: &Reply| -> Vec<String> {
        r.body["subsets"][0]["addresses"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|a| a["ip"].as_str().unwrap().to_owned())
            .collect()
    };
    let r = get(&s, endpoints).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(ips(&r), ["192.0.2.10"]);
    assert_eq!(
        r.body["subsets"][0]["ports"],
        json!([{"name":"https","port":6443,"protocol":"TCP"}])
    );
    assert_eq!(
        r.body["metadata"]["labels"]["endpointslice.kubernetes.io/skip-mirror"],
        "true"
    );
    let slice = get(
        &s,
        "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices/kubernetes",
    )
    .await;
    assert_eq!(
        slice.body["endpoints"],
        json!([{"addresses":["192.0.2.10"],"conditions":{"ready":true}}])
    );
    assert_eq!(
        slice.body["metadata"]["labels"],
        json!({"kubernetes.io/service-name":"kubernetes"})
    );
    let replica = || {
        nodeport_apiserver::registry::Registry::new(
            s.registry.store().clone(),
            s.registry.ranges().clone(),
        )
    };
    let ttl = std::time::Duration::from_secs(60);

    // A second server joins, then leaves; a third, of the other family, is not listed.
    let b = replica();
    let b_ip = "192.0.2.11".parse().unwrap();
    b.renew_kubernetes_endpoints(b_ip, 6443, ttl).await.unwrap();
    assert_eq!(ips(&get(&s, endpoints).await), ["192.0.2.10", "192.0.2.11"]);
    replica()
        .renew_kubernetes_endpoints("fd00::12".parse().unwrap(), 6443, ttl)
        .await
        .unwrap();
    assert_eq!(ips(&get(&s, endpoints).await), ["192.0.2.10", "192.0.2.11"]);
    b.leave_kubernetes_endpoints(b_ip, 6443, ttl).await.unwrap();
    assert_eq!(ips(&get(&s, endpoints).await), ["192.0.2.10"]);
    // Having left, it renews no more.
    b.renew_kubernetes_endpoints(b_ip, 6443, ttl).await.unwrap();
    let r = get(&s, endpoints).await;
    assert_eq!(ips(&r), ["192.0.2.10"]);
    let rv = r.body["metadata"]["resourceVersion"].clone();

    // A server that dies stops renewing: once its lease has not moved for the TTL (of the
    // observing server's own clock), it is dropped and its key deleted.
    let a = replica();
    let a_ip = "192.0.2.10".parse().unwrap();
    let short = std::time::Duration::from_millis(50);
    replica()
        .renew_kubernetes_endpoints("192.0.2.13".parse().unwrap(), 6443, ttl)
        .await
        .unwrap();
    a.renew_kubernetes_endpoints(a_ip, 6443, short)
        .await
        .unwrap();
    assert_eq!(ips(&get(&s, endpoints).await), ["192.0.2.10", "192.0.2.13"]);
    tokio::time::sleep(short * 2).await;
    a.renew_kubernetes_endpoints(a_ip, 6443, short)
        .await
        .unwrap();
    let r = get(&s, endpoints).await;
    assert_eq!(ips(&r), ["192.0.2.10"]);
    assert_ne!(
        r.body["metadata"]["resourceVersion"], rv,
        "written twice since"
    );
}

#[tokio::test]
async fn owner_references_and_app_protocols_are_validated_as_apimachinery_does() {
    let s = server().await;
    let mut svc = service(
        "o",
        json!({"ports":[{"port":80,"appProtocol":"bad proto!"}]}),
    );
    svc["metadata"]["ownerReferences"] =
        json!([{"apiVersion":"apps/v1","kind":"Deployment","name":"web","uid":""}]);
    let r = post(&s, SERVICES, svc).await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", r.body);
    let message = r.body["message"].as_str().unwrap();
    assert!(
        message.contains("metadata.ownerReferences.uid: Invalid value: \"\": must not be empty"),
        "{message}"
    );
    assert!(
        message.contains(
            "spec.ports[0].appProtocol: Invalid value: \"bad proto!\": name part must consist of"
        ),
        "{message}"
    );
    // Well-formed ones pass: kube's own appProtocol values are qualified names.
    let mut svc = service(
        "p",
        json!({"ports":[{"port":80,"appProtocol":"kubernetes.io/h2c"}]}),
    );
    svc["metadata"]["ownerReferences"] = json!([{"apiVersion":"apps/v1","kind":"Deployment","name":"web","uid":"9f1c","controller":true}]);
    let r = post(&s, SERVICES, svc).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
}

#[tokio::test]
async fn empty_values_a_client_sends_are_dropped_as_gos_omitempty_drops_them() {
    let s = server().await;
    let r = post(
        &s,
        SERVICES,
        json!({"apiVersion":"v1","kind":"Service",
            "metadata":{"name":"z","labels":{},"annotations":{},"finalizers":[]},
            "spec":{"ports":[{"name":"","port":80,"nodePort":0}],"externalIPs":[],
                "externalName":"","healthCheckNodePort":0,"selector":{},"clusterIP":""}}),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    let meta = r.body["metadata"].as_object().unwrap();
    for key in ["labels", "annotations", "finalizers"] {
        assert!(!meta.contains_key(key), "{key} kept: {}", r.body);
    }
    let spec = r.body["spec"].as_object().unwrap();
    for key in [
        "externalIPs",
        "externalName",
        "healthCheckNodePort",
        "selector",
    ] {
        assert!(!spec.contains_key(key), "{key} kept: {}", r.body);
    }
    let port = r.body["spec"]["ports"][0].as_object().unwrap();
    assert!(
        !port.contains_key("nodePort") && !port.contains_key("name"),
        "{port:?}"
    );
    // An empty clusterIP means "allocate one", as before.
    assert!(
        r.body["spec"]["clusterIP"]
            .as_str()
            .unwrap()
            .starts_with("10.96.")
    );
}

#[tokio::test]
async fn an_object_or_list_asked_for_in_yaml_is_answered_in_yaml() {
    let s = server().await;
    for uri in [format!("{SERVICES}/kubernetes"), SERVICES.to_owned()] {
        let response = nodeport_apiserver::router(s.clone())
            .oneshot(
                Request::builder()
                    .uri(&uri)
                    .header("accept", "application/yaml")
                    .body(Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(response.headers()["content-type"], "application/yaml");
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let value: Value = yaml_serde::from_slice(&bytes).expect("YAML");
        assert!(
            value["metadata"]["resourceVersion"].is_string(),
            "{uri}: {value}"
        );
    }
}
