//! Writable `networking.k8s.io/v1` ServiceCIDRs through the router (no socket), as kube 1.33
//! serves them (MultiCIDRServiceAllocator, KEP-1880): kube's validation, the ServiceCIDR
//! controller's finalizer and `Ready` condition, ClusterIPs allocated from every Ready
//! ServiceCIDR, and a ServiceCIDR in use kept until its addresses are gone.

use std::time::{Duration, Instant};

use axum::body::Body;
use http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use nodeport_apiserver::{AppState, Config};
use serde_json::{Value, json};
use tower::ServiceExt;

const SERVICES: &str = "/api/v1/namespaces/default/services";
const CIDRS: &str = "/apis/networking.k8s.io/v1/servicecidrs";

struct Reply {
    status: StatusCode,
    body: Value,
}

async fn call(s: &AppState, method: Method, uri: &str, ct: &str, body: Value) -> Reply {
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
    let body = serde_json::from_slice(&bytes)
        .unwrap_or(Value::String(String::from_utf8_lossy(&bytes).into()));
    Reply { status, body }
}

async fn get(s: &AppState, uri: &str) -> Reply {
    call(s, Method::GET, uri, "", Value::Null).await
}

async fn post(s: &AppState, uri: &str, body: Value) -> Reply {
    call(s, Method::POST, uri, "application/json", body).await
}

async fn delete(s: &AppState, uri: &str) -> Reply {
    call(s, Method::DELETE, uri, "", Value::Null).await
}

/// A server whose flag range is a /28 (14 addresses, the first for `default/kubernetes`).
async fn small_server() -> AppState {
    let config = Config {
        cluster_ip_range: "10.96.0.0/28".parse().unwrap(),
        ..Config::default()
    };
    nodeport_apiserver::in_memory(&config).await.unwrap()
}

fn service_cidr(name: &str, cidrs: &[&str]) -> Value {
    json!({"apiVersion":"networking.k8s.io/v1","kind":"ServiceCIDR",
           "metadata":{"name":name},"spec":{"cidrs":cidrs}})
}

fn svc(name: &str, extra: Value) -> Value {
    let mut spec = json!({"ports":[{"port":80}]});
    for (k, v) in extra.as_object().unwrap() {
        spec[k] = v.clone();
    }
    json!({"apiVersion":"v1","kind":"Service","metadata":{"name":name},"spec":spec})
}

fn cluster_ip(v: &Value) -> String {
    v["spec"]["clusterIP"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

async fn assert_consistent(s: &AppState) {
    let v = s.registry.verify().await.unwrap();
    assert!(v.is_consistent(), "allocations differ from Services: {v:?}");
}

/// Fills the flag's /28: 13 Services beside `default/kubernetes`.
async fn fill_flag_range(s: &AppState) {
    for i in 0..13 {
        let r = post(s, SERVICES, svc(&format!("fill-{i}"), json!({}))).await;
        assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    }
    let r = post(s, SERVICES, svc("one-too-many", json!({}))).await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR, "{}", r.body);
    assert_eq!(
        r.body["message"],
        "Internal error occurred: failed to allocate a serviceIP: range is full"
    );
}

#[tokio::test]
async fn service_cidrs_are_validated_with_kubes_texts() {
    let s = small_server().await;
    let cases = [
        (
            service_cidr("none", &[]),
            "ServiceCIDR.networking.k8s.io \"none\" is invalid: spec.cidrs: Required value: at \
             least one CIDR required",
        ),
        (
            service_cidr("bad", &["10.97.0.0/33"]),
            "ServiceCIDR.networking.k8s.io \"bad\" is invalid: spec.cidrs[0]: Invalid value: \
             \"10.97.0.0/33\": must be a valid CIDR value, (e.g. 10.9.8.0/24 or 2001:db8::/64)",
        ),
        (
            service_cidr("two", &["10.97.0.0/24", "10.98.0.0/24"]),
            "ServiceCIDR.networking.k8s.io \"two\" is invalid: spec.cidrs: Invalid value: \
             networking.ServiceCIDRSpec{CIDRs:[]string{\"10.97.0.0/24\", \"10.98.0.0/24\"}}: may \
             specify no more than one IP for each IP family, i.e 192.168.0.0/24 and 2001:db8::/64",
        ),
        // kube 1.33 checks the families of two CIDRs first (a CIDR that does not parse fails
        // that check), then each CIDR strictly (`IsValidCIDR`).
        (
            service_cidr("two-bad", &["10.97.0.0/33", "fd00::/108"]),
            "ServiceCIDR.networking.k8s.io \"two-bad\" is invalid: spec.cidrs: Invalid value: \
             networking.ServiceCIDRSpec{CIDRs:[]string{\"10.97.0.0/33\", \"fd00::/108\"}}: may \
             specify no more than one IP for each IP family, i.e 192.168.0.0/24 and 2001:db8::/64",
        ),
        (
            service_cidr("host-bits", &["10.97.0.1/24", "fd00:0:0::/108"]),
            "ServiceCIDR.networking.k8s.io \"host-bits\" is invalid: [spec.cidrs[0]: Invalid \
             value: \"10.97.0.1/24\": must not have bits set beyond the prefix length, \
             spec.cidrs[1]: Invalid value: \"fd00:0:0::/108\": must be in canonical form \
             (\"fd00::/108\")]",
        ),
        (
            service_cidr("zeros", &["10.097.0.0/24"]),
            "ServiceCIDR.networking.k8s.io \"zeros\" is invalid: spec.cidrs[0]: Invalid value: \
             \"10.097.0.0/24\": must not have leading 0s in IP or prefix length",
        ),
        (
            service_cidr("three", &["10.97.0.0/24", "fd00::/108", "10.98.0.0/24"]),
            "ServiceCIDR.networking.k8s.io \"three\" is invalid: spec.cidrs: Invalid value: \
             networking.ServiceCIDRSpec{CIDRs:[]string{\"10.97.0.0/24\", \"fd00::/108\", \
             \"10.98.0.0/24\"}}: may only hold up to 2 values",
        ),
    ];
    for (body, message) in cases {
        let r = post(&s, CIDRS, body).await;
        assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", r.body);
        assert_eq!(r.body["message"], message);
    }
    // Overlap with the flag's range is allowed (kube has no overlap rule).
    let r = post(
        &s,
        CIDRS,
        service_cidr("wide", &["10.96.0.0/24", "fd00::/108"]),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
}

#[tokio::test]
async fn a_created_service_cidr_gets_the_controllers_finalizer_and_ready_and_its_cidrs_are_immutable()
 {
    let s = small_server().await;
    let r = post(&s, CIDRS, service_cidr("more", &["10.97.0.0/28"])).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert_eq!(
        r.body["metadata"]["finalizers"],
        json!(["networking.k8s.io/service-cidr-finalizer"])
    );
    let ready = &r.body["status"]["conditions"][0];
    assert_eq!(ready["type"], "Ready");
    assert_eq!(ready["status"], "True");
    assert_eq!(ready["message"], "Kubernetes Service CIDR is ready");
    let mut changed = get(&s, &format!("{CIDRS}/more")).await.body;
    changed["spec"]["cidrs"] = json!(["10.98.0.0/28"]);
    let r = call(
        &s,
        Method::PUT,
        &format!("{CIDRS}/more"),
        "application/json",
        changed,
    )
    .await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", r.body);
    assert_eq!(
        r.body["message"],
        "ServiceCIDR.networking.k8s.io \"more\" is invalid: spec.cidrs: Invalid value: \
         []string{\"10.98.0.0/28\"}: field is immutable"
    );
    // The status subresource is served.
    let r = get(&s, &format!("{CIDRS}/more/status")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
}

/// kube's documented way to grow the ClusterIP space: add a ServiceCIDR when the first is full.
#[tokio::test]
async fn a_second_service_cidr_lets_creates_continue_when_the_first_is_full() {
    let s = small_server().await;
    fill_flag_range(&s).await;
    let r = post(&s, CIDRS, service_cidr("more", &["10.97.0.0/24"])).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    for i in 0..5 {
        let r = post(&s, SERVICES, svc(&format!("more-{i}"), json!({}))).await;
        assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
        assert!(cluster_ip(&r.body).starts_with("10.97.0."), "{}", r.body);
    }
    // An address asked for in the new range (its static band, which dynamic picks leave
    // alone while the dynamic band has room), and one taken there.
    let r = post(&s, SERVICES, svc("fixed", json!({"clusterIP":"10.97.0.5"}))).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    let r = post(&s, SERVICES, svc("again", json!({"clusterIP":"10.97.0.5"}))).await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", r.body);
    assert_eq!(
        r.body["message"],
        "Service \"again\" is invalid: spec.clusterIPs: Invalid value: []string{\"10.97.0.5\"}: \
         failed to allocate IP 10.97.0.5: provided IP is already allocated"
    );
    assert_consistent(&s).await;
    // Deleting a Service of the new range frees its address there.
    let r = delete(&s, &format!("{SERVICES}/fixed")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let r = post(
        &s,
        SERVICES,
        svc("fixed2", json!({"clusterIP":"10.97.0.5"})),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert_consistent(&s).await;
}

/// kube 1.33's allocator of a ServiceCIDR (`NewIPAllocator`) takes any IPv4 size and IPv6
/// down to a /64, without the flag's 20-bit cap; a shorter IPv6 prefix is a valid ServiceCIDR
/// that gives no address.
#[tokio::test]
async fn an_added_service_cidr_larger_than_the_flags_cap_gives_addresses_to_its_end() {
    let config = Config {
        cluster_ip_range: "10.96.0.0/28".parse().unwrap(),
        secondary_cluster_ip_range: Some("fd00:10:96::/124".parse().unwrap()),
        ..Config::default()
    };
    let s = nodeport_apiserver::in_memory(&config).await.unwrap();
    fill_flag_range(&s).await;
    let r = post(
        &s,
        CIDRS,
        service_cidr("huge", &["10.0.0.0/8", "fd00:1::/64"]),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    let r = post(&s, CIDRS, service_cidr("too-wide", &["fd00:2::/48"])).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    for (name, ip) in [
        ("last", "10.255.255.254"),
        ("v6-last", "fd00:1::ffff:ffff:ffff:ffff"),
    ] {
        let family = if ip.contains(':') { "IPv6" } else { "IPv4" };
        let r = post(
            &s,
            SERVICES,
            svc(name, json!({"clusterIP": ip, "ipFamilies": [family]})),
        )
        .await;
        assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
        assert_eq!(cluster_ip(&r.body), ip);
    }
    for i in 0..5 {
        let r = post(&s, SERVICES, svc(&format!("dyn-{i}"), json!({}))).await;
        assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
        assert!(cluster_ip(&r.body).starts_with("10."), "{}", r.body);
    }
    let r = post(
        &s,
        SERVICES,
        svc(
            "in-the-48",
            json!({"clusterIP": "fd00:2::5", "ipFamilies": ["IPv6"]}),
        ),
    )
    .await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", r.body);
    assert_consistent(&s).await;
    // The IPAddress objects name them, as kube's.
    let r = get(&s, "/apis/networking.k8s.io/v1/ipaddresses/10.255.255.254").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["spec"]["parentRef"]["name"], "last");
}

/// kube 1.33 (kubernetes/kubernetes#131261, #131263): a single-stack ServiceCIDR may gain a
/// CIDR of the other family after its own, and nothing else changes; the added CIDR gives
/// addresses in the same write.
#[tokio::test]
async fn a_single_stack_service_cidr_may_gain_the_other_family_and_nothing_else_changes() {
    let config = Config {
        cluster_ip_range: "10.96.0.0/28".parse().unwrap(),
        secondary_cluster_ip_range: Some("fd00:10:96::/124".parse().unwrap()),
        ..Config::default()
    };
    let s = nodeport_apiserver::in_memory(&config).await.unwrap();
    let r = post(&s, CIDRS, service_cidr("more", &["10.97.0.0/28"])).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    let put = |cidrs: Value| {
        let s = s.clone();
        async move {
            let mut changed = get(&s, &format!("{CIDRS}/more")).await.body;
            changed["spec"]["cidrs"] = cidrs;
            call(
                &s,
                Method::PUT,
                &format!("{CIDRS}/more"),
                "application/json",
                changed,
            )
            .await
        }
    };
    let immutable = |cidrs: &str| {
        format!(
            "ServiceCIDR.networking.k8s.io \"more\" is invalid: spec.cidrs: Invalid value: \
             []string{{{cidrs}}}: field is immutable"
        )
    };
    // Its own CIDR changed on the way: refused.
    let r = put(json!(["10.98.0.0/28", "fd00:97::/120"])).await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", r.body);
    assert_eq!(
        r.body["message"],
        immutable(r#""10.98.0.0/28", "fd00:97::/120""#)
    );
    // The other family after its own: accepted, and it gives addresses at once.
    let r = put(json!(["10.97.0.0/28", "fd00:97::/120"])).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let r = post(
        &s,
        SERVICES,
        svc(
            "v6",
            json!({"clusterIP": "fd00:97::5", "ipFamilies": ["IPv6"]}),
        ),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert_consistent(&s).await;
    // Back to one CIDR: refused.
    let r = put(json!(["10.97.0.0/28"])).await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", r.body);
    assert_eq!(r.body["message"], immutable(r#""10.97.0.0/28""#));
}

#[tokio::test]
async fn deleting_a_service_cidr_in_use_waits_on_its_finalizer_until_the_services_are_gone() {
    let s = small_server().await;
    fill_flag_range(&s).await;
    post(&s, CIDRS, service_cidr("more", &["10.97.0.0/28"])).await;
    let r = post(&s, SERVICES, svc("user", json!({}))).await;
    assert!(cluster_ip(&r.body).starts_with("10.97.0."), "{}", r.body);

    let r = delete(&s, &format!("{CIDRS}/more")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert!(
        r.body["metadata"]["deletionTimestamp"].is_string(),
        "{}",
        r.body
    );
    let held = get(&s, &format!("{CIDRS}/more")).await;
    assert_eq!(held.status, StatusCode::OK);
    let ready = &held.body["status"]["conditions"][0];
    assert_eq!(ready["status"], "False");
    assert_eq!(ready["reason"], "Terminating");
    assert_eq!(
        ready["message"],
        "There are still IPAddresses referencing the ServiceCIDR, please remove them or create a \
         new ServiceCIDR"
    );
    // Being deleted, it gives no address any more.
    let r = post(&s, SERVICES, svc("late", json!({}))).await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR, "{}", r.body);
    // Still held a moment later (the controller runs every second).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        get(&s, &format!("{CIDRS}/more")).await.status,
        StatusCode::OK
    );

    let r = delete(&s, &format!("{SERVICES}/user")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let deadline = Instant::now() + Duration::from_secs(10);
    while get(&s, &format!("{CIDRS}/more")).await.status != StatusCode::NOT_FOUND {
        assert!(Instant::now() < deadline, "the ServiceCIDR stayed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_consistent(&s).await;
}

#[tokio::test]
async fn a_service_cidr_whose_addresses_another_covers_or_that_holds_none_goes_at_once() {
    let s = small_server().await;
    fill_flag_range(&s).await;
    post(&s, CIDRS, service_cidr("narrow", &["10.97.0.0/28"])).await;
    let r = post(&s, SERVICES, svc("user", json!({"clusterIP":"10.97.0.5"}))).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    // A wider range covering it: deleting the narrow one strands nothing.
    post(&s, CIDRS, service_cidr("wide", &["10.97.0.0/24"])).await;
    let r = delete(&s, &format!("{CIDRS}/narrow")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(
        get(&s, &format!("{CIDRS}/narrow")).await.status,
        StatusCode::NOT_FOUND
    );
    // The address stays allocated, now under the wide range.
    let r = post(&s, SERVICES, svc("clash", json!({"clusterIP":"10.97.0.5"}))).await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", r.body);
    assert_consistent(&s).await;
    // An unused one goes at once too.
    post(&s, CIDRS, service_cidr("unused", &["10.99.0.0/28"])).await;
    delete(&s, &format!("{CIDRS}/unused")).await;
    assert_eq!(
        get(&s, &format!("{CIDRS}/unused")).await.status,
        StatusCode::NOT_FOUND
    );
}

/// A protobuf body (what client-go sends for a typed create) of `object` as `api_version`/`kind`.
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

#[tokio::test]
async fn a_protobuf_service_cidr_body_creates_and_updates_as_a_json_one_does() {
    use k8s_pb::api::networking::v1::{ServiceCIDR, ServiceCIDRSpec};
    use k8s_pb::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    let s = small_server().await;
    let mut cidr = ServiceCIDR {
        metadata: Some(ObjectMeta {
            name: Some("more".into()),
            ..Default::default()
        }),
        spec: Some(ServiceCIDRSpec {
            cidrs: vec!["10.97.0.0/24".into(), "fd00:10:97::/112".into()],
        }),
        status: None,
    };
    let send = |method: Method, uri: String, body: Vec<u8>| {
        let s = s.clone();
        async move {
            let req = Request::builder()
                .method(method)
                .uri(uri)
                .header("content-type", "application/vnd.kubernetes.protobuf")
                .body(Body::from(body))
                .unwrap();
            let response = nodeport_apiserver::router(s).oneshot(req).await.unwrap();
            let status = response.status();
            let bytes = response.into_body().collect().await.unwrap().to_bytes();
            (status, serde_json::from_slice::<Value>(&bytes).unwrap())
        }
    };
    let body = protobuf_body("networking.k8s.io/v1", "ServiceCIDR", &cidr);
    let (status, created) = send(Method::POST, CIDRS.into(), body).await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    assert_eq!(
        created["spec"]["cidrs"],
        json!(["10.97.0.0/24", "fd00:10:97::/112"])
    );
    assert_eq!(created["status"]["conditions"][0]["type"], "Ready");
    // An update (PUT) through protobuf with other CIDRs is refused as the JSON one is.
    let meta = cidr.metadata.as_mut().unwrap();
    meta.resource_version = created["metadata"]["resourceVersion"]
        .as_str()
        .map(str::to_owned);
    meta.finalizers = vec!["networking.k8s.io/service-cidr-finalizer".into()];
    cidr.spec.as_mut().unwrap().cidrs = vec!["10.98.0.0/24".into()];
    let body = protobuf_body("networking.k8s.io/v1", "ServiceCIDR", &cidr);
    let (status, reply) = send(Method::PUT, format!("{CIDRS}/more"), body).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{reply}");
    assert!(
        reply["message"]
            .as_str()
            .unwrap()
            .ends_with("spec.cidrs: Invalid value: []string{\"10.98.0.0/24\"}: field is immutable"),
        "{reply}"
    );
}
