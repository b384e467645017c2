//! Server-side apply and `metadata.managedFields` through the router (no socket): kube's
//! ownership records, merge by list-map keys, pruning, conflicts and their 409, `force`, dry
//! runs, allocation on an apply that creates, allocated values carried over; and a property test
//! over random apply/update/delete sequences by two managers that checks the NodePort bitmap
//! against the stored Services after every step.

use axum::body::Body;
use http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use nodeport_apiserver::{AppState, Config};
use proptest::prelude::*;
use serde_json::{Value, json};
use tower::ServiceExt;

const SERVICES: &str = "/api/v1/namespaces/default/services";
const APPLY: &str = "application/apply-patch+yaml";

async fn server() -> AppState {
    nodeport_apiserver::in_memory(&Config::default())
        .await
        .expect("server state")
}

async fn call(
    s: &AppState,
    method: Method,
    uri: &str,
    ct: &str,
    body: &[u8],
) -> (StatusCode, Value) {
    let mut req = Request::builder()
        .method(method)
        .uri(uri)
        .header("user-agent", "test-client/1.0 (linux)");
    if !ct.is_empty() {
        req = req.header("content-type", ct);
    }
    let response = nodeport_apiserver::router(s.clone())
        .oneshot(req.body(Body::from(body.to_vec())).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

async fn apply(s: &AppState, name: &str, query: &str, config: &str) -> (StatusCode, Value) {
    call(
        s,
        Method::PATCH,
        &format!("{SERVICES}/{name}?{query}"),
        APPLY,
        config.as_bytes(),
    )
    .await
}

fn entry<'a>(object: &'a Value, manager: &str, operation: &str) -> &'a Value {
    object["metadata"]["managedFields"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|e| e["manager"] == manager && e["operation"] == operation)
        .unwrap_or_else(|| panic!("no {operation} entry of {manager} in {object}"))
}

async fn verify_consistent(s: &AppState) {
    let v = s.registry.verify().await.unwrap();
    assert!(v.is_consistent(), "bitmaps differ from Services: {v:?}");
}

const WEB: &str = "apiVersion: v1
kind: Service
metadata:
  name: web
  labels: {app: web}
spec:
  type: NodePort
  selector: {app: web}
  ports:
  - name: http
    port: 80
    targetPort: 8080
";

#[tokio::test]
async fn an_apply_that_creates_allocates_and_records_the_applied_fields_under_the_manager() {
    let s = server().await;
    let (status, svc) = apply(&s, "web", "fieldManager=deployer", WEB).await;
    assert_eq!(status, StatusCode::CREATED, "{svc}");
    let node_port = svc["spec"]["ports"][0]["nodePort"].as_u64().unwrap();
    assert!((30000..=32767).contains(&node_port));
    assert!(svc["spec"]["clusterIP"].as_str().is_some());
    assert_eq!(svc["spec"]["ports"][0]["protocol"], "TCP");
    let applied = entry(&svc, "deployer", "Apply");
    assert_eq!(applied["apiVersion"], "v1");
    assert_eq!(applied["fieldsType"], "FieldsV1");
    assert!(applied["time"].as_str().is_some_and(|t| t.ends_with('Z')));
    // Only what was applied: not the allocated nodePort or clusterIP, not the defaults.
    assert_eq!(
        applied["fieldsV1"],
        json!({
            "f:metadata": {"f:labels": {"f:app": {}}},
            "f:spec": {
                "f:ports": {"k:{\"port\":80,\"protocol\":\"TCP\"}": {
                    ".": {}, "f:name": {}, "f:port": {}, "f:targetPort": {},
                }},
                "f:selector": {},
                "f:type": {},
            },
        })
    );
    // Applying it again changes nothing and answers 200.
    let (status, again) = apply(&s, "web", "fieldManager=deployer", WEB).await;
    assert_eq!(status, StatusCode::OK, "{again}");
    assert_eq!(
        again["metadata"]["resourceVersion"],
        svc["metadata"]["resourceVersion"]
    );
    assert_eq!(again["spec"]["ports"][0]["nodePort"], node_port);
    verify_consistent(&s).await;
}

#[tokio::test]
async fn every_write_records_an_update_entry_under_the_field_manager_or_the_user_agent() {
    let s = server().await;
    let body = serde_json::to_vec(&json!({"apiVersion":"v1","kind":"Service",
        "metadata":{"name":"web"},
        "spec":{"ports":[{"port":80,"targetPort":8080}],"selector":{"app":"web"}}}))
    .unwrap();
    let (status, svc) = call(&s, Method::POST, SERVICES, "application/json", &body).await;
    assert_eq!(status, StatusCode::CREATED, "{svc}");
    // No fieldManager: the User-Agent's product, as kube's managerOrUserAgent.
    let created = entry(&svc, "test-client", "Update");
    assert_eq!(
        created["fieldsV1"]["f:spec"]["f:ports"],
        json!({".": {}, "k:{\"port\":80,\"protocol\":\"TCP\"}": {
            ".": {}, "f:port": {}, "f:protocol": {}, "f:targetPort": {},
        }})
    );
    assert!(created["fieldsV1"]["f:spec"].get("f:clusterIP").is_none());
    let (status, patched) = call(
        &s,
        Method::PATCH,
        &format!("{SERVICES}/web?fieldManager=labeller"),
        "application/merge-patch+json",
        br#"{"metadata":{"labels":{"team":"a"}}}"#,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{patched}");
    assert_eq!(
        entry(&patched, "labeller", "Update")["fieldsV1"],
        json!({"f:metadata": {"f:labels": {".": {}, "f:team": {}}}})
    );
    // The status subresource records `subresource: status`.
    let (status, with_status) = call(
        &s,
        Method::PATCH,
        &format!("{SERVICES}/web/status?fieldManager=lb-controller"),
        "application/merge-patch+json",
        br#"{"status":{"conditions":[{"type":"Ready","status":"True","reason":"Up","message":"","lastTransitionTime":"2026-01-01T00:00:00Z"}]}}"#,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{with_status}");
    let status_entry = entry(&with_status, "lb-controller", "Update");
    assert_eq!(status_entry["subresource"], "status");
    assert!(
        status_entry["fieldsV1"]["f:status"]["f:conditions"]
            .get("k:{\"type\":\"Ready\"}")
            .is_some()
    );
    // A PUT of what was read keeps the others' entries.
    let mut edited = with_status.clone();
    edited["spec"]["sessionAffinity"] = json!("ClientIP");
    let (status, updated) = call(
        &s,
        Method::PUT,
        &format!("{SERVICES}/web?fieldManager=editor"),
        "application/json",
        &serde_json::to_vec(&edited).unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{updated}");
    assert_eq!(
        entry(&updated, "editor", "Update")["fieldsV1"],
        // Defaulting runs before the field manager, as kube's decoder defaults: the
        // `sessionAffinityConfig` that `ClientIP` brings is the editor's too.
        json!({"f:spec": {"f:sessionAffinity": {}, "f:sessionAffinityConfig": {
            ".": {}, "f:clientIP": {".": {}, "f:timeoutSeconds": {}},
        }}})
    );
    entry(&updated, "labeller", "Update");
    entry(&updated, "lb-controller", "Update");
    assert!(
        entry(&updated, "test-client", "Update")["fieldsV1"]["f:spec"]
            .get("f:sessionAffinity")
            .is_none(),
        "the changed field moved to its new manager"
    );
}

/// kube's create handler runs its field manager on the body as sent (`decodeManagedFields`):
/// valid managed fields are kept, less what the create itself sets (taken by the creator, an
/// entry left empty goes); invalid ones count for nothing; `[{}]` resets them.
#[tokio::test]
async fn managed_fields_sent_in_a_create_are_kept_when_valid_and_ignored_when_not() {
    let s = server().await;
    let create = |name: &str, managed: Value| {
        serde_json::to_vec(&json!({"apiVersion":"v1","kind":"Service",
            "metadata":{"name": name, "labels": {"app": "web"}, "managedFields": managed},
            "spec":{"ports":[{"port":80}]}}))
        .unwrap()
    };
    let entry_of = |manager: &str, operation: &str, fields: Value| {
        json!({"manager": manager, "operation": operation, "apiVersion": "v1",
            "time": "2025-01-01T00:00:00Z", "fieldsType": "FieldsV1", "fieldsV1": fields})
    };
    let valid = json!([
        entry_of(
            "gitops",
            "Apply",
            json!({"f:metadata": {"f:labels": {"f:app": {}, "f:gone": {}}}})
        ),
        entry_of("old-editor", "Update", json!({"f:spec": {"f:ports": {}}})),
    ]);
    let (status, svc) = call(
        &s,
        Method::POST,
        SERVICES,
        "application/json",
        &create("kept", valid),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{svc}");
    let gitops = entry(&svc, "gitops", "Apply");
    assert_eq!(
        gitops["fieldsV1"],
        json!({"f:metadata": {"f:labels": {"f:gone": {}}}})
    );
    assert_eq!(gitops["time"], "2025-01-01T00:00:00Z");
    let creator = entry(&svc, "test-client", "Update");
    assert!(
        creator["fieldsV1"]["f:metadata"]["f:labels"]
            .get("f:app")
            .is_some(),
        "{svc}"
    );
    let managers: Vec<&str> = svc["metadata"]["managedFields"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["manager"].as_str().unwrap())
        .collect();
    assert_eq!(
        managers,
        ["gitops", "test-client"],
        "old-editor's only field was taken"
    );

    for (name, managed) in [
        (
            "invalid",
            json!([entry_of(
                "gitops",
                "Bogus",
                json!({"f:metadata": {"f:labels": {"f:gone": {}}}})
            )]),
        ),
        ("reset", json!([{}])),
    ] {
        let (status, svc) = call(
            &s,
            Method::POST,
            SERVICES,
            "application/json",
            &create(name, managed),
        )
        .await;
        assert_eq!(status, StatusCode::CREATED, "{svc}");
        let managed = svc["metadata"]["managedFields"].as_array().unwrap();
        assert_eq!(managed.len(), 1, "{name}: {svc}");
        assert_eq!(managed[0]["manager"], "test-client", "{name}: {svc}");
    }
}

/// kube-apiserver gives the field manager of every subresource its name
/// (`k8s.io/apiserver/pkg/endpoints/installer.go`), `finalize` included, whose strategy resets
/// `status` only: a finalizer added through `/finalize` is an Update entry with `subresource:
/// finalize`; the fields it changes leave their earlier owner.
#[tokio::test]
async fn a_namespace_finalize_records_an_update_entry_with_subresource_finalize() {
    let s = server().await;
    let (status, ns) = call(
        &s,
        Method::POST,
        "/api/v1/namespaces?fieldManager=creator",
        "application/json",
        br#"{"apiVersion":"v1","kind":"Namespace","metadata":{"name":"team","labels":{"team":"a"}},"spec":{"finalizers":["kubernetes"]}}"#,
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{ns}");
    // kube's namespace strategy adds the `kubernetes` finalizer after the field manager ran:
    // a namespace created without it does not own it.
    let (status, bare) = call(
        &s,
        Method::POST,
        "/api/v1/namespaces?fieldManager=creator",
        "application/json",
        br#"{"apiVersion":"v1","kind":"Namespace","metadata":{"name":"bare","labels":{"team":"b"}}}"#,
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{bare}");
    assert_eq!(bare["spec"]["finalizers"], json!(["kubernetes"]));
    // The name label is a decode-time default (kube's `SetDefaults_Namespace`), applied before
    // the field manager runs: the creator owns it, as `kubectl create namespace` shows on kube.
    assert_eq!(
        entry(&bare, "creator", "Update")["fieldsV1"],
        json!({"f:metadata": {"f:labels": {".": {}, "f:kubernetes.io/metadata.name": {}, "f:team": {}}}}),
        "{bare}"
    );
    assert_eq!(
        bare["metadata"]["labels"]["kubernetes.io/metadata.name"],
        "bare"
    );
    let mut body = ns.clone();
    body["spec"]["finalizers"] = json!(["kubernetes", "example.com/hold"]);
    let (status, finalized) = call(
        &s,
        Method::PUT,
        "/api/v1/namespaces/team/finalize?fieldManager=finalizer",
        "application/json",
        &serde_json::to_vec(&body).unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{finalized}");
    let finalize = entry(&finalized, "finalizer", "Update");
    assert_eq!(finalize["subresource"], "finalize", "{finalized}");
    assert_eq!(finalize["apiVersion"], "v1");
    assert_eq!(
        finalize["fieldsV1"],
        json!({"f:spec": {"f:finalizers": {}}}),
        "{finalized}"
    );
    assert!(
        entry(&finalized, "creator", "Update")["fieldsV1"]
            .pointer("/f:spec/f:finalizers")
            .is_none(),
        "{finalized}"
    );
    let (_, read) = call(&s, Method::GET, "/api/v1/namespaces/team", "", b"").await;
    assert_eq!(
        read["metadata"]["managedFields"],
        finalized["metadata"]["managedFields"]
    );
}

#[tokio::test]
async fn a_conflicting_apply_is_kubes_409_and_force_takes_the_field_over() {
    let s = server().await;
    let body = serde_json::to_vec(&json!({"apiVersion":"v1","kind":"Service",
        "metadata":{"name":"web"},
        "spec":{"type":"NodePort","ports":[{"port":80,"nodePort":30080}]}}))
    .unwrap();
    let (status, _) = call(
        &s,
        Method::POST,
        &format!("{SERVICES}?fieldManager=kubectl-client-side-apply"),
        "application/json",
        &body,
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
    let config = "apiVersion: v1
kind: Service
metadata: {name: web}
spec:
  type: NodePort
  ports: [{port: 80, nodePort: 30081}]
";
    let (status, err) = apply(&s, "web", "fieldManager=kubectl", config).await;
    assert_eq!(status, StatusCode::CONFLICT, "{err}");
    assert_eq!(err["reason"], "Conflict");
    assert_eq!(
        err["message"],
        "Apply failed with 1 conflict: conflict with \"kubectl-client-side-apply\" using v1: .spec.ports[port=80,protocol=\"TCP\"].nodePort"
    );
    assert_eq!(
        err["details"]["causes"],
        json!([{
            "reason": "FieldManagerConflict",
            "message": "conflict with \"kubectl-client-side-apply\" using v1",
            "field": ".spec.ports[port=80,protocol=\"TCP\"].nodePort",
        }])
    );
    // A dry run with force shows the result and keeps nothing.
    let (status, preview) = apply(
        &s,
        "web",
        "fieldManager=kubectl&force=true&dryRun=All",
        config,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{preview}");
    assert_eq!(preview["spec"]["ports"][0]["nodePort"], 30081);
    let (_, stored) = call(&s, Method::GET, &format!("{SERVICES}/web"), "", b"").await;
    assert_eq!(stored["spec"]["ports"][0]["nodePort"], 30080);
    verify_consistent(&s).await;
    let (status, forced) = apply(&s, "web", "fieldManager=kubectl&force=true", config).await;
    assert_eq!(status, StatusCode::OK, "{forced}");
    assert_eq!(forced["spec"]["ports"][0]["nodePort"], 30081);
    let csa = entry(&forced, "kubectl-client-side-apply", "Update");
    assert!(
        csa["fieldsV1"]["f:spec"]["f:ports"]["k:{\"port\":80,\"protocol\":\"TCP\"}"]
            .get("f:nodePort")
            .is_none()
    );
    verify_consistent(&s).await;
    let s2 = s.registry.verify().await.unwrap();
    assert_eq!(s2.leaked_ports, Vec::<u16>::new());
}

#[tokio::test]
async fn a_dropped_node_port_is_carried_over_and_a_dropped_port_releases_it() {
    let s = server().await;
    let with_node_port = "apiVersion: v1
kind: Service
metadata: {name: web}
spec:
  type: NodePort
  ports:
  - {name: http, port: 80, nodePort: 30090}
  - {name: https, port: 443, nodePort: 30091}
";
    let (status, _) = apply(&s, "web", "fieldManager=a", with_node_port).await;
    assert_eq!(status, StatusCode::CREATED);
    // The nodePort leaves the applied configuration: pruned from the merge, then carried over
    // from the stored object (patchAllocatedValues), as on kube.
    let without = "apiVersion: v1
kind: Service
metadata: {name: web}
spec:
  type: NodePort
  ports:
  - {name: http, port: 80}
  - {name: https, port: 443, nodePort: 30091}
";
    let (status, svc) = apply(&s, "web", "fieldManager=a", without).await;
    assert_eq!(status, StatusCode::OK, "{svc}");
    assert_eq!(svc["spec"]["ports"][0]["nodePort"], 30090);
    verify_consistent(&s).await;
    // The 443 port leaves: its nodePort is released.
    let one_port = "apiVersion: v1
kind: Service
metadata: {name: web}
spec:
  type: NodePort
  ports:
  - {name: http, port: 80}
";
    let (status, svc) = apply(&s, "web", "fieldManager=a", one_port).await;
    assert_eq!(status, StatusCode::OK, "{svc}");
    assert_eq!(svc["spec"]["ports"].as_array().unwrap().len(), 1);
    verify_consistent(&s).await;
    let (_, ranges) = call(&s, Method::GET, "/ranges", "", b"").await;
    assert_eq!(ranges["nodePorts"]["used"], 1, "{ranges}");
    // ClusterIP drops the nodePorts.
    let cluster_ip = "apiVersion: v1
kind: Service
metadata: {name: web}
spec:
  type: ClusterIP
  ports:
  - {name: http, port: 80}
";
    let (status, svc) = apply(&s, "web", "fieldManager=a", cluster_ip).await;
    assert_eq!(status, StatusCode::OK, "{svc}");
    assert!(svc["spec"]["ports"][0].get("nodePort").is_none(), "{svc}");
    verify_consistent(&s).await;
    let (_, ranges) = call(&s, Method::GET, "/ranges", "", b"").await;
    assert_eq!(ranges["nodePorts"]["used"], 0, "{ranges}");
}

#[tokio::test]
async fn apply_bodies_need_kind_apiversion_name_and_a_field_manager_as_on_kube() {
    let s = server().await;
    let (status, err) = apply(&s, "web", "", WEB).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{err}");
    assert_eq!(
        err["message"],
        "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value: is required for apply patch"
    );
    let (status, err) = apply(&s, "web", "fieldManager=a", "metadata: {name: web}\n").await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{err}");
    assert_eq!(err["message"], "invalid object type: /, Kind=");
    let (status, err) = apply(
        &s,
        "web",
        "fieldManager=a",
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: web}\n",
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{err}");
    assert_eq!(err["message"], "invalid object type: /v1, Kind=Namespace");
    let (status, err) = apply(&s, "other", "fieldManager=a", WEB).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{err}");
    assert_eq!(
        err["message"],
        "the name of the object (web) does not match the name on the URL (other)"
    );
    let (status, err) = call(
        &s,
        Method::PATCH,
        &format!("{SERVICES}/web?force=true"),
        "application/merge-patch+json",
        b"{}",
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{err}");
    // kube's ValidateFieldManager, on every write.
    let long = "m".repeat(129);
    let (status, err) = apply(&s, "web", &format!("fieldManager={long}"), WEB).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{err}");
    assert_eq!(
        err["message"],
        "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Too long: may not be more than 128 bytes"
    );
    let (status, err) = call(
        &s,
        Method::POST,
        &format!("{SERVICES}?fieldManager=a%07b"),
        "application/json",
        b"{}",
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{err}");
    let message = err["message"].as_str().unwrap();
    assert!(
        message.starts_with(
            "CreateOptions.meta.k8s.io \"\" is invalid: fieldManager: Invalid value: "
        ) && message.ends_with(": invalid character U+0007 (at position 1)"),
        "{message}"
    );
    // JSON is YAML: a JSON body applies too.
    let json_body = r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"web"},"spec":{"ports":[{"port":80}]}}"#;
    let (status, svc) = apply(&s, "web", "fieldManager=a", json_body).await;
    assert_eq!(status, StatusCode::CREATED, "{svc}");
    // Apply to /status of a missing object is a 404; to /status of this one, recorded so.
    let (status, _) = call(
        &s,
        Method::PATCH,
        &format!("{SERVICES}/nothing/status?fieldManager=a"),
        APPLY,
        b"apiVersion: v1\nkind: Service\nmetadata: {name: nothing}\n",
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, svc) = call(
        &s,
        Method::PATCH,
        &format!("{SERVICES}/web/status?fieldManager=lb"),
        APPLY,
        b"apiVersion: v1\nkind: Service\nmetadata: {name: web}\nstatus:\n  conditions:\n  - {type: Ready, status: 'True', reason: Up, message: '', lastTransitionTime: '2026-01-01T00:00:00Z'}\n",
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{svc}");
    assert_eq!(svc["status"]["conditions"][0]["type"], "Ready");
    let lb = entry(&svc, "lb", "Apply");
    assert_eq!(lb["subresource"], "status");
    assert_eq!(
        lb["fieldsV1"]["f:status"]["f:conditions"]["k:{\"type\":\"Ready\"}"]["f:status"],
        json!({})
    );
}

/// kube's typed conversion of an applied configuration refuses an undeclared field whatever
/// `fieldValidation` says ("Apply Patch requests already require strict schemas and will error
/// on unknown fields", kubernetes/kubernetes#105916), and nothing is written.
#[tokio::test]
async fn an_applied_field_the_schema_does_not_declare_is_refused_under_every_field_validation() {
    let s = server().await;
    for validation in ["Strict", "Warn", "Ignore"] {
        let (status, err) = apply(
            &s,
            "web",
            &format!("fieldManager=a&fieldValidation={validation}"),
            "apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec:\n  ports:\n  - {port: 80, color: blue}\n",
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{validation}: {err}");
        assert_eq!(
            err["message"],
            "failed to create typed patch object (/v1, Kind=Service): .spec.ports[port=80,protocol=\"TCP\"].color: field not declared in schema",
            "{validation}"
        );
    }
    let (status, _) = call(&s, Method::GET, &format!("{SERVICES}/web"), "", b"").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

/// kube 1.33 serves `application/apply-patch+cbor` only under the alpha `CBORServingAndStorage`
/// gate (off by default; `k8s.io/apiserver/pkg/endpoints/installer.go`), so with default gates
/// a CBOR apply is `negotiation.NewUnsupportedMediaTypeError`'s 415 listing the patch types.
#[tokio::test]
async fn a_cbor_apply_is_kube_1_33s_415_under_default_feature_gates_and_writes_nothing() {
    let s = server().await;
    // {"apiVersion":"v1","kind":"Service","metadata":{"name":"web"}} in CBOR.
    let mut cbor = vec![0xa3, 0x6a];
    cbor.extend_from_slice(b"apiVersion");
    cbor.push(0x62);
    cbor.extend_from_slice(b"v1");
    cbor.push(0x64);
    cbor.extend_from_slice(b"kind");
    cbor.push(0x67);
    cbor.extend_from_slice(b"Service");
    cbor.push(0x68);
    cbor.extend_from_slice(b"metadata");
    cbor.extend_from_slice(&[0xa1, 0x64]);
    cbor.extend_from_slice(b"name");
    cbor.push(0x63);
    cbor.extend_from_slice(b"web");
    let (status, err) = call(
        &s,
        Method::PATCH,
        &format!("{SERVICES}/web?fieldManager=a"),
        "application/apply-patch+cbor",
        &cbor,
    )
    .await;
    assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{err}");
    assert_eq!(err["reason"], "UnsupportedMediaType");
    assert_eq!(
        err["message"],
        "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/strategic-merge-patch+json, application/apply-patch+yaml"
    );
    let (status, _) = call(&s, Method::GET, &format!("{SERVICES}/web"), "", b"").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn every_served_kind_takes_an_apply() {
    let s = server().await;
    let cases = [
        (
            "/api/v1/namespaces/default/endpoints/web",
            "apiVersion: v1\nkind: Endpoints\nmetadata: {name: web}\nsubsets: [{addresses: [{ip: 10.1.0.1}], ports: [{port: 80}]}]\n",
        ),
        (
            "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices/web-1",
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-1}\naddressType: IPv4\nendpoints: [{addresses: [10.1.0.1]}]\n",
        ),
        (
            "/api/v1/nodes/n1",
            "apiVersion: v1\nkind: Node\nmetadata: {name: n1, labels: {zone: a}}\n",
        ),
        (
            "/api/v1/namespaces/team",
            "apiVersion: v1\nkind: Namespace\nmetadata: {name: team, labels: {owner: a}}\n",
        ),
        (
            "/apis/rbac.authorization.k8s.io/v1/clusterroles/reader",
            "apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\nmetadata: {name: reader}\nrules: [{apiGroups: [''], resources: [services], verbs: [get]}]\n",
        ),
        (
            "/apis/events.k8s.io/v1/namespaces/default/events/e1",
            "apiVersion: events.k8s.io/v1\nkind: Event\nmetadata: {name: e1}\neventTime: '2026-01-01T00:00:00.000000Z'\nreportingController: example.com/c\nreportingInstance: i1\naction: Sync\nreason: Synced\ntype: Normal\nregarding: {kind: Service, namespace: default, name: web}\n",
        ),
    ];
    for (uri, config) in cases {
        let (status, object) = call(
            &s,
            Method::PATCH,
            &format!("{uri}?fieldManager=gitops"),
            APPLY,
            config.as_bytes(),
        )
        .await;
        assert_eq!(status, StatusCode::CREATED, "{uri}: {object}");
        entry(&object, "gitops", "Apply");
        let (status, again) = call(
            &s,
            Method::PATCH,
            &format!("{uri}?fieldManager=gitops"),
            APPLY,
            config.as_bytes(),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{uri}: {again}");
    }
}

// ---------------------------------------------------------------------------------------------
// Property: no apply/update/delete sequence of two managers leaks or doubles a NodePort.

#[derive(Debug, Clone)]
enum Step {
    /// Manager `m` applies Service `n` with these ports (port number, optional nodePort offset)
    /// and type NodePort (`node_port`) or ClusterIP; `force` takes conflicting fields.
    Apply {
        m: u8,
        n: u8,
        ports: Vec<(u8, Option<u8>)>,
        node_port: bool,
        force: bool,
    },
    /// Manager `m` merge-patches one port's nodePort of Service `n` (an Update).
    Update { m: u8, n: u8, offset: u8 },
    /// Delete Service `n`.
    Delete { n: u8 },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        5 => (
            0..2u8,
            0..4u8,
            proptest::collection::vec((0..3u8, proptest::option::of(0..6u8)), 1..3),
            any::<bool>(),
            any::<bool>()
        )
            .prop_map(|(m, n, ports, node_port, force)| Step::Apply { m, n, ports, node_port, force }),
        2 => (0..2u8, 0..4u8, 0..6u8).prop_map(|(m, n, offset)| Step::Update { m, n, offset }),
        1 => (0..4u8).prop_map(|n| Step::Delete { n }),
    ]
}

async fn run(steps: Vec<Step>) -> Result<(), TestCaseError> {
    let s = server().await;
    for step in steps {
        match &step {
            Step::Apply {
                m,
                n,
                ports,
                node_port,
                force,
            } => {
                let mut seen = std::collections::BTreeSet::new();
                let ports: Vec<Value> = ports
                    .iter()
                    .filter(|(p, _)| seen.insert(*p))
                    .map(|(p, np)| {
                        let mut port = json!({"name": format!("p{p}"), "port": 80 + u16::from(*p)});
                        if let (Some(np), true) = (np, node_port) {
                            port["nodePort"] = json!(30100 + u16::from(*np));
                        }
                        port
                    })
                    .collect();
                let config = json!({"apiVersion": "v1", "kind": "Service",
                    "metadata": {"name": format!("s{n}")},
                    "spec": {"type": if *node_port { "NodePort" } else { "ClusterIP" }, "ports": ports}});
                let query = format!(
                    "fieldManager=m{m}{}",
                    if *force { "&force=true" } else { "" }
                );
                let (status, body) = apply(&s, &format!("s{n}"), &query, &config.to_string()).await;
                prop_assert!(
                    status.is_success()
                        || status == StatusCode::CONFLICT
                        || status == StatusCode::UNPROCESSABLE_ENTITY,
                    "{step:?}: {status} {body}"
                );
            }
            Step::Update { m, n, offset } => {
                let uri = format!("{SERVICES}/s{n}");
                let (status, svc) = call(&s, Method::GET, &uri, "", b"").await;
                if status != StatusCode::OK || svc["spec"]["type"] != "NodePort" {
                    continue;
                }
                let mut ports = svc["spec"]["ports"].clone();
                ports[0]["nodePort"] = json!(30100 + u16::from(*offset));
                let patch = json!({"spec": {"ports": ports}});
                let (status, body) = call(
                    &s,
                    Method::PATCH,
                    &format!("{uri}?fieldManager=m{m}"),
                    "application/merge-patch+json",
                    patch.to_string().as_bytes(),
                )
                .await;
                prop_assert!(
                    status.is_success() || status == StatusCode::UNPROCESSABLE_ENTITY,
                    "{step:?}: {status} {body}"
                );
            }
            Step::Delete { n } => {
                call(&s, Method::DELETE, &format!("{SERVICES}/s{n}"), "", b"").await;
            }
        }
        let report = s.registry.verify().await.unwrap();
        prop_assert!(report.is_consistent(), "after {step:?}: {report:?}");
        // And no nodePort appears in two Services.
        let (_, list) = call(&s, Method::GET, SERVICES, "", b"").await;
        let mut owners = std::collections::BTreeMap::new();
        for svc in list["items"].as_array().unwrap() {
            let ports: std::collections::BTreeSet<u64> = svc["spec"]["ports"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|p| p["nodePort"].as_u64())
                .collect();
            for port in ports {
                let previous = owners.insert(port, svc["metadata"]["name"].clone());
                prop_assert!(
                    previous.is_none(),
                    "nodePort {port} held twice after {step:?}"
                );
            }
        }
    }
    for n in 0..4 {
        call(&s, Method::DELETE, &format!("{SERVICES}/s{n}"), "", b"").await;
    }
    let (_, ranges) = call(&s, Method::GET, "/ranges", "", b"").await;
    prop_assert_eq!(&ranges["nodePorts"]["used"], &json!(0), "{}", ranges);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn random_applies_updates_and_deletes_by_two_managers_never_leak_or_double_a_node_port(
        steps in proptest::collection::vec(step(), 1..30)
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(run(steps))?;
    }
}

#[test]
fn the_fuzzing_harness_sends_apply_patches_when_bit_six_is_set() {
    let api = nodeport_apiserver::fuzzing::Api::new();
    let seed = |name: &str| {
        std::fs::read(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../fuzz/corpus/api_patch")
                .join(name),
        )
        .unwrap()
    };
    // The fuzzer's Service was created without nodePort 30555 or targetPort 9090: both seeds
    // change fields its creator owns, so only the forced one passes.
    assert_eq!(api.patch(&seed("seed-apply")), 409);
    assert_eq!(api.patch(&seed("seed-apply-force-json")), 200);
    assert_eq!(api.patch(&seed("seed-status-apply")), 200);
    let mut without_kind = seed("seed-apply");
    without_kind.truncate(1);
    without_kind.extend_from_slice(b"metadata: {name: web}\n");
    assert_eq!(api.patch(&without_kind), 400);
}

#[tokio::test]
async fn a_dropped_cluster_ip_and_health_check_node_port_are_carried_over_while_needed() {
    let s = server().await;
    let explicit = "apiVersion: v1
kind: Service
metadata: {name: lb}
spec:
  type: LoadBalancer
  externalTrafficPolicy: Local
  clusterIP: 10.96.0.50
  healthCheckNodePort: 30300
  ports:
  - {name: http, port: 80}
";
    let (status, svc) = apply(&s, "lb", "fieldManager=a", explicit).await;
    assert_eq!(status, StatusCode::CREATED, "{svc}");
    assert_eq!(svc["spec"]["clusterIP"], "10.96.0.50");
    let dropped = "apiVersion: v1
kind: Service
metadata: {name: lb}
spec:
  type: LoadBalancer
  externalTrafficPolicy: Local
  ports:
  - {name: http, port: 80}
";
    let (status, svc) = apply(&s, "lb", "fieldManager=a", dropped).await;
    assert_eq!(status, StatusCode::OK, "{svc}");
    assert_eq!(svc["spec"]["clusterIP"], "10.96.0.50", "{svc}");
    assert_eq!(svc["spec"]["clusterIPs"], json!(["10.96.0.50"]), "{svc}");
    assert_eq!(svc["spec"]["healthCheckNodePort"], 30300, "{svc}");
    verify_consistent(&s).await;
    // Cluster traffic policy: the health check port is no longer needed and is released.
    let (status, svc) = apply(
        &s,
        "lb",
        "fieldManager=a",
        &dropped.replace("Local", "Cluster"),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{svc}");
    assert!(svc["spec"].get("healthCheckNodePort").is_none(), "{svc}");
    verify_consistent(&s).await;
    let (_, ranges) = call(&s, Method::GET, "/ranges", "", b"").await;
    assert_eq!(ranges["nodePorts"]["used"], 1, "{ranges}");
}

/// Every Namespace carries `kubernetes.io/metadata.name` with its own name (kube's
/// `SetDefaults_Namespace`, GA in 1.22, what NetworkPolicy `namespaceSelector`s pick namespaces
/// by): set on create whatever the body says, and put back by an update that drops or changes
/// it.
#[tokio::test]
async fn every_namespace_carries_its_name_label_whatever_a_create_or_update_says() {
    let s = server().await;
    let (status, ns) = call(
        &s,
        Method::POST,
        "/api/v1/namespaces",
        "application/json",
        br#"{"apiVersion":"v1","kind":"Namespace","metadata":{"name":"shop","labels":{"kubernetes.io/metadata.name":"other"}}}"#,
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{ns}");
    assert_eq!(
        ns["metadata"]["labels"]["kubernetes.io/metadata.name"], "shop",
        "{ns}"
    );
    let mut body = ns.clone();
    body["metadata"]["labels"] = json!({"tier": "web"});
    let (status, updated) = call(
        &s,
        Method::PUT,
        "/api/v1/namespaces/shop",
        "application/json",
        &serde_json::to_vec(&body).unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{updated}");
    assert_eq!(
        updated["metadata"]["labels"],
        json!({"kubernetes.io/metadata.name": "shop", "tier": "web"}),
        "{updated}"
    );
}
