//! What real clients send (issue 17), through the router without a socket: bodies without
//! `kind` and `apiVersion`, as the official Python client and `curl` users send them.

use axum::body::Body;
use http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use nodeport_apiserver::{AppState, Config};
use serde_json::{Value, json};
use tower::ServiceExt;

async fn server() -> AppState {
    nodeport_apiserver::in_memory(&Config::default())
        .await
        .expect("server state")
}

async fn call(
    state: &AppState,
    method: Method,
    uri: &str,
    content_type: &str,
    body: Vec<u8>,
) -> (StatusCode, Value) {
    let mut req = Request::builder().method(method).uri(uri);
    if !content_type.is_empty() {
        req = req.header("content-type", content_type);
    }
    let response = nodeport_apiserver::router(state.clone())
        .oneshot(req.body(Body::from(body)).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let body = serde_json::from_slice(&bytes)
        .unwrap_or(Value::String(String::from_utf8_lossy(&bytes).into()));
    (status, body)
}

async fn json_call(
    state: &AppState,
    method: Method,
    uri: &str,
    body: &Value,
) -> (StatusCode, Value) {
    call(
        state,
        method,
        uri,
        "application/json",
        serde_json::to_vec(body).unwrap(),
    )
    .await
}

/// One body without `kind` and `apiVersion` for every writable served kind: its collection, the
/// object, and the kind and apiVersion the server must fill in.
fn untyped_bodies() -> Vec<(
    &'static str,
    &'static str,
    Value,
    &'static str,
    &'static str,
)> {
    vec![
        (
            "/api/v1/namespaces",
            "team",
            json!({"metadata": {"name": "team"}}),
            "Namespace",
            "v1",
        ),
        (
            "/api/v1/namespaces/default/services",
            "web",
            json!({"metadata": {"name": "web"}, "spec": {"type": "NodePort", "ports": [{"port": 80}]}}),
            "Service",
            "v1",
        ),
        (
            "/api/v1/namespaces/default/endpoints",
            "web",
            json!({"metadata": {"name": "web"}, "subsets": [{"addresses": [{"ip": "10.0.0.1"}], "ports": [{"port": 80}]}]}),
            "Endpoints",
            "v1",
        ),
        (
            "/api/v1/nodes",
            "worker",
            json!({"metadata": {"name": "worker"}}),
            "Node",
            "v1",
        ),
        (
            "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices",
            "web-1",
            json!({"metadata": {"name": "web-1"}, "addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.1"]}]}),
            "EndpointSlice",
            "discovery.k8s.io/v1",
        ),
    ]
}

#[tokio::test]
async fn creates_and_updates_without_kind_or_api_version_take_them_from_the_url() {
    let s = server().await;
    for (collection, name, body, kind, api_version) in untyped_bodies() {
        let (status, created) = json_call(&s, Method::POST, collection, &body).await;
        assert_eq!(status, StatusCode::CREATED, "{collection}: {created}");
        assert_eq!(
            (created["kind"].as_str(), created["apiVersion"].as_str()),
            (Some(kind), Some(api_version))
        );
        // PUT of the stored object with both fields removed.
        let mut stored = created.clone();
        let map = stored.as_object_mut().unwrap();
        map.remove("kind");
        map.remove("apiVersion");
        stored["metadata"]["labels"] = json!({"updated": "yes"});
        let (status, updated) =
            json_call(&s, Method::PUT, &format!("{collection}/{name}"), &stored).await;
        assert_eq!(status, StatusCode::OK, "{collection}: {updated}");
        assert_eq!(updated["metadata"]["labels"]["updated"], "yes");
        assert_eq!(updated["kind"], kind);
    }
}

#[tokio::test]
async fn yaml_bodies_without_kind_or_api_version_are_defaulted_too() {
    let s = server().await;
    let (status, body) = call(
        &s,
        Method::POST,
        "/api/v1/namespaces/default/services",
        "application/yaml",
        b"metadata:\n  name: y\nspec:\n  ports:\n  - port: 80\n".to_vec(),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(
        (&body["kind"], &body["apiVersion"]),
        (&json!("Service"), &json!("v1"))
    );
    // Only the version given, in YAML, to a grouped resource: kube looks the kind up in core/v1.
    let (status, body) = call(
        &s,
        Method::POST,
        "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices",
        "application/yaml",
        b"apiVersion: v1\nmetadata:\n  name: s\naddressType: IPv4\n".to_vec(),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        body["message"],
        "EndpointSlice in version \"v1\" cannot be handled as a EndpointSlice: no kind \"EndpointSlice\" is registered for version \"v1\" in scheme \"k8s.io/kubernetes/pkg/api/legacyscheme/scheme.go:30\""
    );
}

#[tokio::test]
async fn a_kind_or_version_that_disagrees_with_the_url_keeps_kubes_400_and_message() {
    let s = server().await;
    let services = "/api/v1/namespaces/default/services";
    let cases = [
        (
            json!({"kind": "Namespace", "metadata": {"name": "x"}}),
            "Namespace in version \"v1\" cannot be handled as a Service: converting (v1.Namespace) to (core.Service): unknown conversion",
        ),
        // kube accepts no List body on POST or PUT.
        (
            json!({"kind": "List", "apiVersion": "v1", "items": []}),
            "List in version \"v1\" cannot be handled as a Service: converting (v1.List) to (core.Service): unknown conversion",
        ),
        (
            json!({"kind": "ServiceList", "apiVersion": "v1", "items": []}),
            "ServiceList in version \"v1\" cannot be handled as a Service: converting (v1.ServiceList) to (core.Service): unknown conversion",
        ),
        (
            json!({"kind": "Service", "apiVersion": "apps/v1", "metadata": {"name": "x"}}),
            "Service in version \"v1\" cannot be handled as a Service: no kind \"Service\" is registered for version \"apps/v1\" in scheme \"k8s.io/kubernetes/pkg/api/legacyscheme/scheme.go:30\"",
        ),
        (
            json!({"kind": "service", "metadata": {"name": "x"}}),
            "service in version \"v1\" cannot be handled as a Service: no kind \"service\" is registered for version \"v1\" in scheme \"k8s.io/kubernetes/pkg/api/legacyscheme/scheme.go:30\"",
        ),
        (
            json!({"kind": true}),
            "the object provided is unrecognized (must be of type Service): couldn't get version/kind; json parse error: json: cannot unmarshal bool into Go struct field .kind of type string ({\"kind\":true})",
        ),
    ];
    for (body, message) in cases {
        let (status, reply) = json_call(&s, Method::POST, services, &body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {reply}");
        assert_eq!(reply["reason"], "BadRequest");
        assert_eq!(reply["message"], message, "{body}");
        let (status, reply) =
            json_call(&s, Method::PUT, &format!("{services}/kubernetes"), &body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {reply}");
        assert_eq!(reply["message"], message, "{body}");
    }
}
