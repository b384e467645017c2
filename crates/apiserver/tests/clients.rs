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

const CORE_EVENTS: &str = "/api/v1/namespaces/default/events";
const NEW_EVENTS: &str = "/apis/events.k8s.io/v1/namespaces/default/events";

/// A core/v1 Event about the `default/web` Service, as client-go's legacy recorder posts it.
fn legacy_event(name: &str, uid: &str) -> Value {
    json!({"metadata": {"name": name, "namespace": "default"},
        "involvedObject": {"kind": "Service", "namespace": "default", "name": "web", "uid": uid, "apiVersion": "v1"},
        "reason": "Synced", "message": "legacy recorder", "source": {"component": "test-controller"},
        "firstTimestamp": "2026-01-01T00:00:00Z", "lastTimestamp": "2026-01-01T00:00:00Z",
        "count": 1, "type": "Normal"})
}

#[tokio::test]
async fn an_event_is_one_object_in_both_apis_with_kubes_field_names() {
    let s = server().await;
    let (status, created) =
        json_call(&s, Method::POST, CORE_EVENTS, &legacy_event("web.1", "u-1")).await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    assert_eq!(created["involvedObject"]["name"], "web");
    // The same object through events.k8s.io/v1, with that API's names.
    let (status, new) = json_call(
        &s,
        Method::GET,
        &format!("{NEW_EVENTS}/web.1"),
        &Value::Null,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{new}");
    assert_eq!(new["apiVersion"], "events.k8s.io/v1");
    assert_eq!(new["regarding"]["uid"], "u-1");
    assert_eq!(new["note"], "legacy recorder");
    assert_eq!(new["deprecatedSource"]["component"], "test-controller");
    assert_eq!(new["deprecatedCount"], 1);
    assert!(new.get("message").is_none() && new.get("involvedObject").is_none());
    assert_eq!(
        new["metadata"]["resourceVersion"],
        created["metadata"]["resourceVersion"]
    );

    // A new-style event through events.k8s.io/v1, read back through core/v1.
    let body = json!({"metadata": {"name": "web.2"}, "eventTime": "2026-01-01T00:00:00.000001Z",
        "regarding": {"kind": "Service", "namespace": "default", "name": "web", "uid": "u-1"},
        "reason": "Probed", "action": "Probe", "note": "new recorder", "type": "Warning",
        "reportingController": "test-controller", "reportingInstance": "test-1"});
    let (status, created) = json_call(&s, Method::POST, NEW_EVENTS, &body).await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    assert_eq!(created["kind"], "Event");
    assert_eq!(created["note"], "new recorder");
    let (_, core) = json_call(
        &s,
        Method::GET,
        &format!("{CORE_EVENTS}/web.2"),
        &Value::Null,
    )
    .await;
    assert_eq!(core["message"], "new recorder");
    assert_eq!(core["reportingComponent"], "test-controller");
    assert_eq!(core["eventTime"], "2026-01-01T00:00:00.000001Z");

    // Lists of both forms hold both events.
    let (_, list) = json_call(&s, Method::GET, NEW_EVENTS, &Value::Null).await;
    assert_eq!(list["kind"], "EventList");
    assert_eq!(list["apiVersion"], "events.k8s.io/v1");
    assert_eq!(list["items"].as_array().unwrap().len(), 2);
    assert!(list["items"][0].get("regarding").is_some());

    // kubectl's Table of one event through events.k8s.io/v1: kube's event columns.
    let response = nodeport_apiserver::router(s.clone())
        .oneshot(
            Request::get(format!("{NEW_EVENTS}/web.1"))
                .header("accept", "application/json;as=Table;v=v1;g=meta.k8s.io")
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    let table: Value =
        serde_json::from_slice(&response.into_body().collect().await.unwrap().to_bytes()).unwrap();
    let cells = &table["rows"][0]["cells"];
    assert_eq!(
        (&cells[1], &cells[2], &cells[3], &cells[6]),
        (
            &json!("Normal"),
            &json!("Synced"),
            &json!("service/web"),
            &json!("legacy recorder")
        ),
        "{table}"
    );

    // A watch through events.k8s.io/v1 streams the new form.
    let (status, stream) = call(
        &s,
        Method::GET,
        &format!("{NEW_EVENTS}?watch=true&timeoutSeconds=1"),
        "",
        Vec::new(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let lines: Vec<Value> = stream
        .as_str()
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{stream}");
    for line in &lines {
        assert_eq!(line["type"], "ADDED");
        assert_eq!(line["object"]["apiVersion"], "events.k8s.io/v1");
        assert!(line["object"].get("regarding").is_some(), "{line}");
        assert!(line["object"].get("involvedObject").is_none(), "{line}");
    }
}

#[tokio::test]
async fn field_selectors_name_the_involved_object_in_core_and_regarding_in_events_k8s_io() {
    let s = server().await;
    for (name, uid) in [("web.1", "u-1"), ("web.2", "u-2")] {
        let (status, body) =
            json_call(&s, Method::POST, CORE_EVENTS, &legacy_event(name, uid)).await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
    }
    let names = |list: &Value| -> Vec<String> {
        list["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["metadata"]["name"].as_str().unwrap().to_owned())
            .collect()
    };
    // What `kubectl describe svc` asks for.
    let (_, list) = json_call(
        &s,
        Method::GET,
        &format!("{CORE_EVENTS}?fieldSelector=involvedObject.name%3Dweb,involvedObject.namespace%3Ddefault,involvedObject.kind%3DService,involvedObject.uid%3Du-2"),
        &Value::Null,
    )
    .await;
    assert_eq!(names(&list), ["web.2"]);
    let (_, list) = json_call(
        &s,
        Method::GET,
        &format!("{NEW_EVENTS}?fieldSelector=regarding.uid%3Du-1,reason%3DSynced,source%3Dtest-controller"),
        &Value::Null,
    )
    .await;
    assert_eq!(names(&list), ["web.1"]);
    // Each API refuses the other's names, with kube's message.
    let (status, reply) = json_call(
        &s,
        Method::GET,
        &format!("{NEW_EVENTS}?fieldSelector=involvedObject.name%3Dweb"),
        &Value::Null,
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        reply["message"],
        "field label not supported: involvedObject.name"
    );
    let (status, _) = json_call(
        &s,
        Method::GET,
        &format!("{CORE_EVENTS}?fieldSelector=regarding.name%3Dweb"),
        &Value::Null,
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn events_are_validated_as_kube_validates_them_in_each_api() {
    let s = server().await;
    let mut wrong_namespace = legacy_event("web.1", "u-1");
    wrong_namespace["involvedObject"]["namespace"] = json!("other");
    let (status, reply) = json_call(&s, Method::POST, CORE_EVENTS, &wrong_namespace).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{reply}");
    assert_eq!(
        reply["message"],
        "Event \"web.1\" is invalid: involvedObject.namespace: Invalid value: \"other\": does not match event.namespace"
    );
    // events.k8s.io/v1 asks for the new-style fields and refuses the deprecated ones.
    let body = json!({"metadata": {"name": "web.3"}, "regarding": {"kind": "Node", "name": "n"},
        "deprecatedCount": 2});
    let (status, reply) = json_call(&s, Method::POST, NEW_EVENTS, &body).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{reply}");
    assert_eq!(
        reply["message"],
        "Event.events.k8s.io \"web.3\" is invalid: [eventTime: Required value, type: Invalid value: \"\": has invalid value: , count: Invalid value: \"\": needs to be unset]"
    );
    // A core/v1 body sent to events.k8s.io/v1 keeps kube's API version error.
    let mut core_body = legacy_event("web.4", "u-1");
    core_body["apiVersion"] = json!("v1");
    core_body["kind"] = json!("Event");
    let (status, reply) = json_call(&s, Method::POST, NEW_EVENTS, &core_body).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        reply["message"],
        "the API version in the data (v1) does not match the expected API version (events.k8s.io/v1)"
    );
}

#[tokio::test]
async fn events_posted_in_protobuf_by_either_recorder_are_stored() {
    use k8s_pb::api::core::v1 as pb_core;
    use k8s_pb::api::events::v1 as pb_events;
    use k8s_pb::apimachinery::pkg::apis::meta::v1 as pb_meta;
    use prost::Message;
    fn wire(api_version: &str, kind: &str, raw: Vec<u8>) -> Vec<u8> {
        let unknown = k8s_pb::apimachinery::pkg::runtime::Unknown {
            type_meta: Some(k8s_pb::apimachinery::pkg::runtime::TypeMeta {
                api_version: Some(api_version.into()),
                kind: Some(kind.into()),
            }),
            raw: Some(raw),
            content_encoding: Some(String::new()),
            content_type: Some(String::new()),
        };
        let mut body = b"k8s\0".to_vec();
        body.extend(unknown.encode_to_vec());
        body
    }
    let s = server().await;
    let regarding = pb_core::ObjectReference {
        kind: Some("Service".into()),
        namespace: Some("default".into()),
        name: Some("web".into()),
        ..Default::default()
    };
    let meta = |name: &str| pb_meta::ObjectMeta {
        name: Some(name.into()),
        namespace: Some("default".into()),
        ..Default::default()
    };
    let legacy = pb_core::Event {
        metadata: Some(meta("web.1")),
        involved_object: Some(regarding.clone()),
        reason: Some("Synced".into()),
        message: Some("protobuf legacy".into()),
        count: Some(1),
        r#type: Some("Normal".into()),
        first_timestamp: Some(pb_meta::Time {
            seconds: Some(1_767_225_600),
            nanos: Some(0),
        }),
        ..Default::default()
    };
    let (status, body) = call(
        &s,
        Method::POST,
        CORE_EVENTS,
        "application/vnd.kubernetes.protobuf",
        wire("v1", "Event", legacy.encode_to_vec()),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(body["message"], "protobuf legacy");
    let new = pb_events::Event {
        metadata: Some(meta("web.2")),
        event_time: Some(pb_meta::MicroTime {
            seconds: Some(1_767_225_600),
            nanos: Some(5_000),
        }),
        reporting_controller: Some("test-controller".into()),
        reporting_instance: Some("test-1".into()),
        action: Some("Probe".into()),
        reason: Some("Probed".into()),
        regarding: Some(regarding),
        note: Some("protobuf new".into()),
        r#type: Some("Normal".into()),
        ..Default::default()
    };
    let (status, body) = call(
        &s,
        Method::POST,
        NEW_EVENTS,
        "application/vnd.kubernetes.protobuf",
        wire("events.k8s.io/v1", "Event", new.encode_to_vec()),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(body["eventTime"], "2026-01-01T00:00:00.000005Z");
    assert_eq!(body["note"], "protobuf new");
}

#[tokio::test]
async fn events_last_recorded_longer_ago_than_the_ttl_are_deleted() {
    use k8s_openapi::jiff::{SignedDuration, Timestamp};
    let s = server().await;
    let now = Timestamp::now();
    let micro = |t: Timestamp| t.strftime("%Y-%m-%dT%H:%M:%S%.6fZ").to_string();
    // Created now: its TTL counts from its creation.
    let once = legacy_event("web.once", "u-1");
    // Recorded again 90 minutes from now (a series), as a recorder would have updated it.
    let mut again = legacy_event("web.again", "u-1");
    again["series"] =
        json!({"count": 2, "lastObservedTime": micro(now + SignedDuration::from_mins(90))});
    for body in [&once, &again] {
        let (status, reply) = json_call(&s, Method::POST, CORE_EVENTS, body).await;
        assert_eq!(status, StatusCode::CREATED, "{reply}");
    }
    let ttl = std::time::Duration::from_secs(3600);
    assert_eq!(s.registry.expire_events_at(now, ttl).await.unwrap(), 0);
    let two_hours_later = now + SignedDuration::from_hours(2);
    assert_eq!(
        s.registry
            .expire_events_at(two_hours_later, ttl)
            .await
            .unwrap(),
        1
    );
    let (status, _) = json_call(
        &s,
        Method::GET,
        &format!("{CORE_EVENTS}/web.once"),
        &Value::Null,
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _) = json_call(
        &s,
        Method::GET,
        &format!("{CORE_EVENTS}/web.again"),
        &Value::Null,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn recorders_patch_repeated_events_through_either_api() {
    let s = server().await;
    let (status, body) =
        json_call(&s, Method::POST, CORE_EVENTS, &legacy_event("web.1", "u-1")).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    // client-go's legacy recorder: a strategic merge patch of count and lastTimestamp.
    let (status, patched) = call(
        &s,
        Method::PATCH,
        &format!("{CORE_EVENTS}/web.1"),
        "application/strategic-merge-patch+json",
        br#"{"count":2,"lastTimestamp":"2026-01-01T00:01:00Z"}"#.to_vec(),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{patched}");
    assert_eq!(patched["count"], 2);
    // The new recorder: a merge patch of the series, through events.k8s.io/v1.
    let body = json!({"metadata": {"name": "web.2"}, "eventTime": "2026-01-01T00:00:00.000000Z",
        "regarding": {"kind": "Service", "namespace": "default", "name": "web"},
        "reason": "Probed", "action": "Probe", "type": "Normal",
        "reportingController": "test-controller", "reportingInstance": "test-1"});
    let (status, created) = json_call(&s, Method::POST, NEW_EVENTS, &body).await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    let (status, patched) = call(
        &s,
        Method::PATCH,
        &format!("{NEW_EVENTS}/web.2"),
        "application/merge-patch+json",
        br#"{"series":{"count":2,"lastObservedTime":"2026-01-01T00:02:00.000000Z"}}"#.to_vec(),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{patched}");
    assert_eq!(patched["apiVersion"], "events.k8s.io/v1");
    assert_eq!(patched["series"]["count"], 2);
    assert_eq!(patched["regarding"]["name"], "web");
    // A fixed field of a new-style event may not change through events.k8s.io/v1.
    let (status, reply) = call(
        &s,
        Method::PATCH,
        &format!("{NEW_EVENTS}/web.2"),
        "application/merge-patch+json",
        br#"{"reason":"Other"}"#.to_vec(),
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{reply}");
    assert_eq!(
        reply["message"],
        "Event.events.k8s.io \"web.2\" is invalid: reason: Invalid value: \"Other\": field is immutable"
    );
    // kube's list names `reason` twice: the message says it once, the causes twice.
    assert_eq!(reply["details"]["causes"].as_array().unwrap().len(), 2);
}

#[tokio::test]
async fn deleting_a_namespace_deletes_its_events_as_kubes_namespace_controller_does() {
    let s = server().await;
    let (status, body) = json_call(
        &s,
        Method::POST,
        "/api/v1/namespaces",
        &json!({"metadata": {"name": "team"}}),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let mut event = legacy_event("web.1", "u-1");
    event["metadata"]["namespace"] = json!("team");
    event["involvedObject"]["namespace"] = json!("team");
    let (status, body) =
        json_call(&s, Method::POST, "/api/v1/namespaces/team/events", &event).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let (status, _) = json_call(&s, Method::DELETE, "/api/v1/namespaces/team", &Value::Null).await;
    assert_eq!(status, StatusCode::OK);
    for _ in 0..1000 {
        let (status, _) = json_call(&s, Method::GET, "/api/v1/namespaces/team", &Value::Null).await;
        if status == StatusCode::NOT_FOUND {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let (_, list) = json_call(&s, Method::GET, "/api/v1/events", &Value::Null).await;
    assert_eq!(list["items"], json!([]), "{list}");
}

#[tokio::test]
async fn openapi_v3_carries_kubes_list_types_and_map_keys() {
    let s = server().await;
    let (_, core) = json_call(&s, Method::GET, "/openapi/v3/api/v1", &Value::Null).await;
    let schemas = &core["components"]["schemas"];
    let ports = &schemas["io.k8s.api.core.v1.ServiceSpec"]["properties"]["ports"];
    assert_eq!(ports["x-kubernetes-list-type"], "map", "{ports}");
    assert_eq!(
        ports["x-kubernetes-list-map-keys"],
        json!(["port", "protocol"])
    );
    let spec = &schemas["io.k8s.api.core.v1.ServiceSpec"]["properties"];
    for atomic in ["clusterIPs", "ipFamilies", "externalIPs"] {
        assert_eq!(spec[atomic]["x-kubernetes-list-type"], "atomic", "{atomic}");
    }
    assert_eq!(spec["selector"]["x-kubernetes-map-type"], "atomic");
    assert_eq!(
        schemas["io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"]["properties"]["finalizers"]["x-kubernetes-list-type"],
        "set"
    );
    let (_, discovery) = json_call(
        &s,
        Method::GET,
        "/openapi/v3/apis/discovery.k8s.io/v1",
        &Value::Null,
    )
    .await;
    let schemas = &discovery["components"]["schemas"];
    assert_eq!(
        schemas["io.k8s.api.discovery.v1.EndpointSlice"]["properties"]["endpoints"]["x-kubernetes-list-type"],
        "atomic"
    );
    assert_eq!(
        schemas["io.k8s.api.discovery.v1.Endpoint"]["properties"]["addresses"]["x-kubernetes-list-type"],
        "set"
    );
}
