//! `networking.k8s.io/v1` IPAddress objects through the router (no socket), as kube-apiserver
//! 1.33 writes them: one per allocated ClusterIP, with `spec.parentRef` to its Service, written
//! and removed with the Service's save; user reservations; the verification loop repairing
//! them.

use axum::body::Body;
use http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use nodeport_apiserver::{AppState, Config};
use serde_json::{Value, json};
use tower::ServiceExt;

const SERVICES: &str = "/api/v1/namespaces/default/services";
const ADDRESSES: &str = "/apis/networking.k8s.io/v1/ipaddresses";

async fn call(
    s: &AppState,
    method: Method,
    uri: &str,
    ct: &str,
    body: Value,
) -> (StatusCode, Value) {
    let mut req = Request::builder().method(method).uri(uri);
    if !ct.is_empty() {
        req = req.header("content-type", ct);
    }
    let body = if body.is_null() {
        Body::empty()
    } else {
        Body::from(serde_json::to_vec(&body).unwrap())
    };
    let response = nodeport_apiserver::router(s.clone())
        .oneshot(req.body(body).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

async fn get(s: &AppState, uri: &str) -> (StatusCode, Value) {
    call(s, Method::GET, uri, "", Value::Null).await
}

async fn post(s: &AppState, uri: &str, body: Value) -> (StatusCode, Value) {
    call(s, Method::POST, uri, "application/json", body).await
}

async fn dual() -> AppState {
    let config = Config {
        cluster_ip_range: "10.96.0.0/16".parse().unwrap(),
        secondary_cluster_ip_range: Some("fd00:10:96::/108".parse().unwrap()),
        ..Config::default()
    };
    nodeport_apiserver::in_memory(&config).await.unwrap()
}

fn svc(name: &str, extra: Value) -> Value {
    let mut spec = json!({"ports":[{"port":80}]});
    for (k, v) in extra.as_object().unwrap() {
        spec[k] = v.clone();
    }
    json!({"apiVersion":"v1","kind":"Service","metadata":{"name":name},"spec":spec})
}

/// Every IPAddress: address -> (parent namespace/name, managed-by label).
async fn addresses(s: &AppState) -> Vec<(String, String, String)> {
    let (status, list) = get(s, ADDRESSES).await;
    assert_eq!(status, StatusCode::OK, "{list}");
    assert_eq!(list["kind"], "IPAddressList");
    let mut out: Vec<(String, String, String)> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            let parent = &i["spec"]["parentRef"];
            (
                i["metadata"]["name"].as_str().unwrap().to_owned(),
                format!(
                    "{}/{}/{}",
                    parent["resource"].as_str().unwrap_or(""),
                    parent["namespace"].as_str().unwrap_or(""),
                    parent["name"].as_str().unwrap_or("")
                ),
                i["metadata"]["labels"]["ipaddress.kubernetes.io/managed-by"]
                    .as_str()
                    .unwrap_or("")
                    .to_owned(),
            )
        })
        .collect();
    out.sort();
    out
}

fn ips(v: &Value) -> Vec<String> {
    v["spec"]["clusterIPs"]
        .as_array()
        .map(|a| a.iter().map(|s| s.as_str().unwrap().to_owned()).collect())
        .unwrap_or_default()
}

#[tokio::test]
async fn each_cluster_ip_has_an_ip_address_object_written_and_removed_with_its_service() {
    let s = dual().await;
    let managed = "ipallocator.k8s.io".to_owned();
    assert_eq!(
        addresses(&s).await,
        vec![(
            "10.96.0.1".into(),
            "services/default/kubernetes".into(),
            managed.clone()
        )]
    );
    let (status, web) = post(
        &s,
        SERVICES,
        svc("web", json!({"ipFamilyPolicy":"RequireDualStack"})),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{web}");
    let held = ips(&web);
    let (_, one) = get(&s, &format!("{ADDRESSES}/{}", held[1])).await;
    assert_eq!(one["kind"], "IPAddress");
    assert_eq!(
        one["metadata"]["labels"]["ipaddress.kubernetes.io/ip-family"],
        "IPv6"
    );
    assert_eq!(
        one["spec"]["parentRef"],
        json!({"group":"","resource":"services","namespace":"default","name":"web"})
    );
    let listed = addresses(&s).await;
    assert_eq!(listed.len(), 3, "{listed:?}");
    for ip in &held {
        assert!(
            listed.contains(&(ip.clone(), "services/default/web".into(), managed.clone())),
            "{ip}: {listed:?}"
        );
    }
    // Downgrade: the secondary's object goes with the write.
    let (status, _) = call(
        &s,
        Method::PATCH,
        &format!("{SERVICES}/web"),
        "application/merge-patch+json",
        json!({"spec":{"ipFamilyPolicy":"SingleStack"}}),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(addresses(&s).await.len(), 2);
    // Delete: gone.
    call(
        &s,
        Method::DELETE,
        &format!("{SERVICES}/web"),
        "",
        Value::Null,
    )
    .await;
    assert_eq!(addresses(&s).await.len(), 1);
    let v = s.registry.verify().await.unwrap();
    assert!(v.is_consistent(), "{v:?}");
}

#[tokio::test]
async fn a_user_ip_address_reserves_its_address_until_it_is_deleted() {
    let s = dual().await;
    let reservation = json!({"apiVersion":"networking.k8s.io/v1","kind":"IPAddress",
        "metadata":{"name":"10.96.0.10"},
        "spec":{"parentRef":{"group":"","resource":"services","namespace":"kube-system","name":"kube-dns"}}});
    let (status, body) = post(&s, ADDRESSES, reservation.clone()).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let (status, body) = post(&s, SERVICES, svc("dns", json!({"clusterIP":"10.96.0.10"}))).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(
        body["message"],
        "Service \"dns\" is invalid: spec.clusterIPs: Invalid value: []string{\"10.96.0.10\"}: \
         failed to allocate IP 10.96.0.10: provided IP is already allocated"
    );
    // A second reservation of it is a conflict; one of a Service's address too.
    let (status, _) = post(&s, ADDRESSES, reservation).await;
    assert_eq!(status, StatusCode::CONFLICT);
    let v = s.registry.verify().await.unwrap();
    assert!(v.is_consistent(), "a reservation is not a leak: {v:?}");
    call(
        &s,
        Method::DELETE,
        &format!("{ADDRESSES}/10.96.0.10"),
        "",
        Value::Null,
    )
    .await;
    let (status, body) = post(&s, SERVICES, svc("dns", json!({"clusterIP":"10.96.0.10"}))).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    // The parent of an IPAddress never changes.
    let (_, mut dns) = get(&s, &format!("{ADDRESSES}/10.96.0.10")).await;
    dns["spec"]["parentRef"]["name"] = json!("other");
    let (status, body) = call(
        &s,
        Method::PUT,
        &format!("{ADDRESSES}/10.96.0.10"),
        "application/json",
        dns,
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(
        body["message"],
        "IPAddress.networking.k8s.io \"10.96.0.10\" is invalid: spec.parentRef: Invalid value: \
         &networking.ParentReference{Group:\"\", Resource:\"services\", Namespace:\"default\", \
         Name:\"other\"}: field is immutable"
    );
    // Validation: the name is an address in canonical form, the parent is named.
    let bad = json!({"apiVersion":"networking.k8s.io/v1","kind":"IPAddress",
        "metadata":{"name":"fd00:10:96:0::5"},"spec":{"parentRef":{"resource":"","name":""}}});
    let (status, body) = post(&s, ADDRESSES, bad).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(
        body["message"],
        "IPAddress.networking.k8s.io \"fd00:10:96:0::5\" is invalid: [metadata.name: Invalid \
         value: \"fd00:10:96:0::5\": must be in canonical form (\"fd00:10:96::5\"), \
         spec.parentRef.resource: Required value, spec.parentRef.name: Required value]"
    );
    // kube 1.33's `ValidateIPAddressName` (apimachinery's `IsValidIP`) and
    // `validateIPAddressParentReference`, text for text.
    for (name, parent, message) in [
        (
            "10.96.0.010",
            json!({"resource":"services","name":"web"}),
            "IPAddress.networking.k8s.io \"10.96.0.010\" is invalid: metadata.name: Invalid \
             value: \"10.96.0.010\": must not have leading 0s",
        ),
        (
            "::ffff:10.96.0.5",
            json!({"resource":"services","name":"web"}),
            "IPAddress.networking.k8s.io \"::ffff:10.96.0.5\" is invalid: metadata.name: \
             Invalid value: \"::ffff:10.96.0.5\": must not be an IPv4-mapped IPv6 address",
        ),
        (
            "web",
            json!({"resource":"services","name":"web"}),
            "IPAddress.networking.k8s.io \"web\" is invalid: metadata.name: Invalid value: \
             \"web\": must be a valid IP address, (e.g. 10.9.8.7 or 2001:db8::ffff)",
        ),
        (
            "10.96.0.11",
            json!({"group":"Core_","resource":"..","name":"a/b%","namespace":"x/y"}),
            "IPAddress.networking.k8s.io \"10.96.0.11\" is invalid: [spec.parentRef.group: \
             Invalid value: \"Core_\": a lowercase RFC 1123 subdomain must consist of lower \
             case alphanumeric characters, '-' or '.', and must start and end with an \
             alphanumeric character (e.g. 'example.com', regex used for validation is \
             '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*'), \
             spec.parentRef.resource: Invalid value: \"..\": may not be '..', \
             spec.parentRef.name: Invalid value: \"a/b%\": may not contain '/', \
             spec.parentRef.name: Invalid value: \"a/b%\": may not contain '%', \
             spec.parentRef.namespace: Invalid value: \"x/y\": may not contain '/']",
        ),
    ] {
        let bad = json!({"apiVersion":"networking.k8s.io/v1","kind":"IPAddress",
            "metadata":{"name":name},"spec":{"parentRef":parent}});
        let (status, body) = post(&s, ADDRESSES, bad).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
        assert_eq!(body["message"], message);
    }
}

#[tokio::test]
async fn the_verification_loop_writes_a_missing_ip_address_again_and_removes_a_stale_one() {
    let s = dual().await;
    let (_, web) = post(&s, SERVICES, svc("web", json!({}))).await;
    let ip = ips(&web)[0].clone();
    // A hand delete of the allocator's object: the address stays with the Service.
    let (status, _) = call(
        &s,
        Method::DELETE,
        &format!("{ADDRESSES}/{ip}"),
        "",
        Value::Null,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = post(&s, SERVICES, svc("clash", json!({"clusterIP":ip}))).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    let report = s.registry.verify().await.unwrap();
    assert_eq!(report.missing_ip_addresses.len(), 1, "{report:?}");
    s.registry.verify_and_repair().await.unwrap();
    let (status, _) = get(&s, &format!("{ADDRESSES}/{ip}")).await;
    assert_eq!(status, StatusCode::OK);
    let v = s.registry.verify().await.unwrap();
    assert!(v.is_consistent(), "{v:?}");

    // An object in the allocator's name for an address no Service holds: stale, removed (and
    // the address it took freed as a leak) within two rounds.
    let stale = json!({"apiVersion":"networking.k8s.io/v1","kind":"IPAddress",
        "metadata":{"name":"10.96.0.77","labels":{"ipaddress.kubernetes.io/managed-by":"ipallocator.k8s.io"}},
        "spec":{"parentRef":{"group":"","resource":"services","namespace":"default","name":"gone"}}});
    let (status, body) = post(&s, ADDRESSES, stale).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let report = s.registry.verify().await.unwrap();
    assert_eq!(
        report.stale_ip_addresses,
        vec!["10.96.0.77".parse::<std::net::IpAddr>().unwrap()]
    );
    s.registry.verify_and_repair().await.unwrap();
    s.registry.verify_and_repair().await.unwrap();
    let (status, _) = get(&s, &format!("{ADDRESSES}/10.96.0.77")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let v = s.registry.verify().await.unwrap();
    assert!(v.is_consistent(), "{v:?}");
}

#[tokio::test]
async fn a_protobuf_ip_address_body_reserves_as_a_json_one_does() {
    use k8s_pb::api::networking::v1::{IPAddress, IPAddressSpec, ParentReference};
    use k8s_pb::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use k8s_pb::apimachinery::pkg::runtime::{TypeMeta, Unknown};
    let s = dual().await;
    let object = IPAddress {
        metadata: Some(ObjectMeta {
            name: Some("fd00:10:96::a".into()),
            ..Default::default()
        }),
        spec: Some(IPAddressSpec {
            parent_ref: Some(ParentReference {
                group: Some(String::new()),
                resource: Some("services".into()),
                namespace: Some("kube-system".into()),
                name: Some("kube-dns".into()),
            }),
        }),
    };
    let unknown = Unknown {
        type_meta: Some(TypeMeta {
            api_version: Some("networking.k8s.io/v1".into()),
            kind: Some("IPAddress".into()),
        }),
        raw: Some(prost::Message::encode_to_vec(&object)),
        ..Default::default()
    };
    let body = [
        b"k8s\0".as_slice(),
        &prost::Message::encode_to_vec(&unknown),
    ]
    .concat();
    let req = Request::builder()
        .method(Method::POST)
        .uri(ADDRESSES)
        .header("content-type", "application/vnd.kubernetes.protobuf")
        .body(Body::from(body))
        .unwrap();
    let response = nodeport_apiserver::router(s.clone())
        .oneshot(req)
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let (_, one) = get(&s, &format!("{ADDRESSES}/fd00:10:96::a")).await;
    assert_eq!(
        one["spec"]["parentRef"],
        json!({"resource":"services","namespace":"kube-system","name":"kube-dns"})
    );
    let (status, body) = post(
        &s,
        SERVICES,
        svc(
            "dns",
            json!({"ipFamilies":["IPv6"],"clusterIP":"fd00:10:96::a"}),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
}

/// kube 1.33 allocates a ClusterIP by creating its IPAddress object, which fails when the
/// object exists: the objects are the truth, the bitmaps a cache written with them. Objects
/// written straight into storage, past this server (the bitmap has their addresses free),
/// still hold their addresses: a create asking for one is kube's 422, dynamic allocation never
/// hands one out, and the bitmap learns them.
#[tokio::test]
async fn ip_address_objects_hold_their_addresses_even_when_the_bitmap_has_them_free() {
    use nodeport_apiserver::storage::{Batch, Op};
    let config = Config {
        cluster_ip_range: "10.96.0.0/29".parse().unwrap(),
        ..Config::default()
    };
    let s = nodeport_apiserver::in_memory(&config).await.unwrap();
    let puts = (2..=5)
        .map(|last| {
            let name = format!("10.96.0.{last}");
            let object = json!({"apiVersion":"networking.k8s.io/v1","kind":"IPAddress",
                "metadata":{"name":name,"uid":format!("00000000-0000-4000-8000-00000000000{last}"),
                    "creationTimestamp":"2026-01-01T00:00:00Z"},
                "spec":{"parentRef":{"group":"","resource":"gateways","namespace":"default","name":"reserved"}}});
            Op::Put {
                key: format!("/registry/ipaddresses/{name}"),
                value: serde_json::to_vec(&object).unwrap().into(),
            }
        })
        .collect();
    s.registry
        .store()
        .backend()
        .commit(Batch {
            compares: Vec::new(),
            groups: vec![puts],
        })
        .await
        .unwrap();

    let (status, err) = post(
        &s,
        SERVICES,
        svc("pinned", json!({"clusterIP":"10.96.0.3"})),
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{err}");
    assert!(
        err["message"]
            .as_str()
            .unwrap()
            .contains("provided IP is already allocated"),
        "{err}"
    );
    let (status, only) = post(&s, SERVICES, svc("only", json!({}))).await;
    assert_eq!(status, StatusCode::CREATED, "{only}");
    assert_eq!(ips(&only), ["10.96.0.6"]);
    let (status, err) = post(&s, SERVICES, svc("none", json!({}))).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{err}");
    assert!(
        err["message"].as_str().unwrap().contains("range is full"),
        "{err}"
    );
    for last in 2..=5 {
        let (status, object) = get(&s, &format!("{ADDRESSES}/10.96.0.{last}")).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(object["spec"]["parentRef"]["name"], "reserved", "{object}");
    }
    let v = s.registry.verify().await.unwrap();
    assert!(v.is_consistent(), "{v:?}");

    // The verification loop brings the cache to the objects without waiting for a collision:
    // an object written past the server for the address `only` gave back is marked.
    let (status, _) = call(
        &s,
        Method::DELETE,
        &format!("{SERVICES}/only"),
        "",
        Value::Null,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let late = json!({"apiVersion":"networking.k8s.io/v1","kind":"IPAddress",
        "metadata":{"name":"10.96.0.6","uid":"00000000-0000-4000-8000-000000000006",
            "creationTimestamp":"2026-01-01T00:00:00Z"},
        "spec":{"parentRef":{"group":"","resource":"gateways","namespace":"default","name":"reserved"}}});
    s.registry
        .store()
        .backend()
        .commit(Batch {
            compares: Vec::new(),
            groups: vec![vec![Op::Put {
                key: "/registry/ipaddresses/10.96.0.6".into(),
                value: serde_json::to_vec(&late).unwrap().into(),
            }]],
        })
        .await
        .unwrap();
    let report = s.registry.verify().await.unwrap();
    assert_eq!(
        report.unmarked_objects,
        ["10.96.0.6".parse::<std::net::IpAddr>().unwrap()]
    );
    s.registry.verify_and_repair().await.unwrap();
    let v = s.registry.verify().await.unwrap();
    assert!(v.is_consistent(), "{v:?}");
    let conflicts = s
        .registry
        .store()
        .stats()
        .conflicts
        .load(std::sync::atomic::Ordering::Relaxed);
    let (status, err) = post(&s, SERVICES, svc("after", json!({}))).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{err}");
    assert!(
        err["message"].as_str().unwrap().contains("range is full"),
        "{err}"
    );
    assert_eq!(
        s.registry
            .store()
            .stats()
            .conflicts
            .load(std::sync::atomic::Ordering::Relaxed),
        conflicts,
        "the cache knew the address: no commit had to fail"
    );
}
