//! Dual-stack Services through the router (no socket): `ipFamilyPolicy`, `ipFamilies` and
//! `clusterIPs` defaulted, validated and allocated as kube-apiserver does it
//! (`pkg/registry/core/service/storage/alloc.go`, `pkg/apis/core/validation`), with its texts.

use axum::body::Body;
use http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use nodeport_apiserver::{AppState, Config};
use serde_json::{Value, json};
use tower::ServiceExt;

const SERVICES: &str = "/api/v1/namespaces/default/services";

struct Reply {
    status: StatusCode,
    body: Value,
}

async fn call(state: &AppState, method: Method, uri: &str, ct: &str, body: Value) -> Reply {
    let mut req = Request::builder().method(method).uri(uri);
    if !ct.is_empty() {
        req = req.header("content-type", ct);
    }
    let body = if body.is_null() {
        Body::empty()
    } else {
        Body::from(serde_json::to_vec(&body).unwrap())
    };
    let response = nodeport_apiserver::router(state.clone())
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

async fn post(s: &AppState, body: Value) -> Reply {
    call(s, Method::POST, SERVICES, "application/json", body).await
}

async fn merge_patch(s: &AppState, name: &str, body: Value) -> Reply {
    let uri = format!("{SERVICES}/{name}");
    call(s, Method::PATCH, &uri, "application/merge-patch+json", body).await
}

async fn delete(s: &AppState, name: &str) -> Reply {
    let uri = format!("{SERVICES}/{name}");
    call(s, Method::DELETE, &uri, "", Value::Null).await
}

/// A server whose `--service-cluster-ip-range` is `primary[,secondary]`.
async fn server(primary: &str, secondary: Option<&str>) -> AppState {
    let config = Config {
        cluster_ip_range: primary.parse().unwrap(),
        secondary_cluster_ip_range: secondary.map(|s| s.parse().unwrap()),
        ..Config::default()
    };
    nodeport_apiserver::in_memory(&config).await.unwrap()
}

async fn dual() -> AppState {
    server("10.96.0.0/16", Some("fd00:10:96::/108")).await
}

fn svc(name: &str, extra: Value) -> Value {
    let mut spec = json!({"selector":{"app":name},"ports":[{"port":80}]});
    for (k, v) in extra.as_object().unwrap() {
        spec[k] = v.clone();
    }
    json!({"apiVersion":"v1","kind":"Service","metadata":{"name":name},"spec":spec})
}

fn ips(v: &Value) -> Vec<String> {
    v["spec"]["clusterIPs"]
        .as_array()
        .map(|a| a.iter().map(|s| s.as_str().unwrap().to_owned()).collect())
        .unwrap_or_default()
}

fn assert_invalid(r: &Reply, message: &str) {
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", r.body);
    assert_eq!(r.body["message"], message);
}

async fn assert_consistent(s: &AppState) {
    let v = s.registry.verify().await.unwrap();
    assert!(v.is_consistent(), "bitmaps differ from Services: {v:?}");
}

/// Used addresses in the primary and the secondary bitmap, from `/ranges`.
async fn used(s: &AppState) -> (u64, u64) {
    let r = get(s, "/ranges").await;
    (
        r.body["clusterIPs"]["used"].as_u64().unwrap(),
        r.body["secondaryClusterIPs"]["used"].as_u64().unwrap_or(0),
    )
}

#[tokio::test]
async fn prefer_dual_stack_gets_one_address_per_family_in_the_flags_order() {
    let s = dual().await;
    let r = post(&s, svc("web", json!({"ipFamilyPolicy":"PreferDualStack"}))).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    let got = ips(&r.body);
    assert_eq!(got.len(), 2, "{got:?}");
    assert!(got[0].starts_with("10.96."), "{got:?}");
    assert!(got[1].starts_with("fd00:10:96::"), "{got:?}");
    assert_eq!(r.body["spec"]["clusterIP"], got[0].as_str());
    assert_eq!(r.body["spec"]["ipFamilies"], json!(["IPv4", "IPv6"]));
    assert_eq!(r.body["spec"]["ipFamilyPolicy"], "PreferDualStack");
    // default/kubernetes holds one primary address; web one of each.
    assert_eq!(used(&s).await, (2, 1));
    let ranges = get(&s, "/ranges").await;
    assert_eq!(
        ranges.body["secondaryClusterIPs"]["range"],
        "fd00:10:96::/108"
    );
    let metrics = get(&s, "/metrics").await;
    assert!(
        metrics.body.as_str().unwrap().contains(
            "kube_apiserver_clusterip_allocator_allocated_ips{cidr=\"fd00:10:96::/108\"} 1"
        ),
        "{}",
        metrics.body
    );
    assert_consistent(&s).await;

    // A Service naming no policy stays single-stack in the primary family.
    let r = post(&s, svc("single", json!({}))).await;
    assert_eq!(r.body["spec"]["ipFamilyPolicy"], "SingleStack");
    assert_eq!(r.body["spec"]["ipFamilies"], json!(["IPv4"]));
    assert_eq!(ips(&r.body).len(), 1);
    // Asking for IPv6 alone gives an IPv6 single-stack Service.
    let r = post(&s, svc("six", json!({"ipFamilies":["IPv6"]}))).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert!(ips(&r.body)[0].starts_with("fd00:10:96::"), "{}", r.body);
    assert_eq!(r.body["spec"]["ipFamilies"], json!(["IPv6"]));
    // RequireDualStack with IPv6 first: the secondary family goes second.
    let r = post(
        &s,
        svc(
            "six-four",
            json!({"ipFamilyPolicy":"RequireDualStack","ipFamilies":["IPv6"]}),
        ),
    )
    .await;
    assert_eq!(r.body["spec"]["ipFamilies"], json!(["IPv6", "IPv4"]));
    let got = ips(&r.body);
    assert!(
        got[0].contains(':') && got[1].starts_with("10.96."),
        "{got:?}"
    );
    assert_consistent(&s).await;
}

#[tokio::test]
async fn an_ipv6_primary_range_makes_ipv6_the_default_family_and_of_default_kubernetes() {
    let s = server("fd00:10:96::/108", Some("10.96.0.0/16")).await;
    let k = get(&s, &format!("{SERVICES}/kubernetes")).await;
    assert_eq!(ips(&k.body), vec!["fd00:10:96::1".to_owned()]);
    assert_eq!(k.body["spec"]["ipFamilyPolicy"], "SingleStack");
    assert_eq!(k.body["spec"]["ipFamilies"], json!(["IPv6"]));
    let r = post(&s, svc("web", json!({"ipFamilyPolicy":"PreferDualStack"}))).await;
    assert_eq!(r.body["spec"]["ipFamilies"], json!(["IPv6", "IPv4"]));
    // The default ServiceCIDR holds both CIDRs, primary first.
    let cidr = get(&s, "/apis/networking.k8s.io/v1/servicecidrs/kubernetes").await;
    assert_eq!(
        cidr.body["spec"]["cidrs"],
        json!(["fd00:10:96::/108", "10.96.0.0/16"])
    );
}

#[tokio::test]
async fn require_dual_stack_and_foreign_families_are_refused_on_a_single_stack_server() {
    let s = server("10.96.0.0/16", None).await;
    let r = post(&s, svc("web", json!({"ipFamilyPolicy":"RequireDualStack"}))).await;
    assert_invalid(
        &r,
        "Service \"web\" is invalid: spec.ipFamilyPolicy: Invalid value: \"RequireDualStack\": \
         this cluster is not configured for dual-stack services",
    );
    let r = post(&s, svc("web", json!({"ipFamilies":["IPv6"]}))).await;
    assert_invalid(
        &r,
        "Service \"web\" is invalid: spec.ipFamilies[0]: Invalid value: \"IPv6\": \
         not configured on this cluster",
    );
    let r = post(&s, svc("web", json!({"clusterIP":"fd00::5"}))).await;
    assert_invalid(
        &r,
        "Service \"web\" is invalid: spec.clusterIPs[0]: Invalid value: []string{\"fd00::5\"}: \
         IPv6 is not configured on this cluster",
    );
    // PreferDualStack is accepted and stays single-stack.
    let r = post(&s, svc("web", json!({"ipFamilyPolicy":"PreferDualStack"}))).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert_eq!(r.body["spec"]["ipFamilies"], json!(["IPv4"]));
    assert_eq!(ips(&r.body).len(), 1);
    // A headless Service without selector may list both families even here (kube's special
    // case), and gets no address.
    let headless = json!({"apiVersion":"v1","kind":"Service","metadata":{"name":"hl"},
        "spec":{"clusterIP":"None","ports":[{"port":80}]}});
    let r = post(&s, headless).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert_eq!(r.body["spec"]["ipFamilyPolicy"], "RequireDualStack");
    assert_eq!(r.body["spec"]["ipFamilies"], json!(["IPv4", "IPv6"]));
    assert_eq!(ips(&r.body), vec!["None".to_owned()]);
    assert_consistent(&s).await;
}

#[tokio::test]
async fn family_fields_that_contradict_each_other_are_refused_with_kubes_texts() {
    let s = dual().await;
    let cases = [
        (
            json!({"ipFamilyPolicy":"SingleStack","clusterIPs":["10.96.5.5","fd00:10:96::5"],
                   "clusterIP":"10.96.5.5"}),
            "spec.ipFamilyPolicy: Invalid value: \"SingleStack\": must be 'RequireDualStack' or \
             'PreferDualStack' when multiple cluster IPs are specified",
        ),
        (
            json!({"ipFamilyPolicy":"SingleStack","ipFamilies":["IPv4","IPv6"]}),
            "spec.ipFamilyPolicy: Invalid value: \"SingleStack\": must be 'RequireDualStack' or \
             'PreferDualStack' when multiple IP families are specified",
        ),
        (
            json!({"ipFamilyPolicy":"PreferDualStack","clusterIPs":["10.96.5.5","10.96.5.6"],
                   "clusterIP":"10.96.5.5"}),
            "spec.clusterIPs: Invalid value: []string{\"10.96.5.5\", \"10.96.5.6\"}: may specify \
             no more than one IP for each IP family",
        ),
        (
            json!({"ipFamilies":["IPv4","IPv4"],"ipFamilyPolicy":"PreferDualStack"}),
            "spec.ipFamilies[1]: Duplicate value: \"IPv4\"",
        ),
        (
            json!({"ipFamilies":["IPv5"]}),
            "spec.ipFamilies[0]: Unsupported value: \"IPv5\": supported values: \"IPv4\", \"IPv6\"",
        ),
        (
            json!({"ipFamilyPolicy":"Sometimes"}),
            "spec.ipFamilyPolicy: Unsupported value: \"Sometimes\": supported values: \
             \"PreferDualStack\", \"RequireDualStack\", \"SingleStack\"",
        ),
        (
            json!({"ipFamilies":["IPv6"],"clusterIP":"10.96.5.5"}),
            "spec.clusterIPs[0]: Invalid value: \"10.96.5.5\": expected an IPv6 value as \
             indicated by `ipFamilies[0]`",
        ),
    ];
    for (extra, message) in cases {
        let r = post(&s, svc("web", extra.clone())).await;
        assert_invalid(&r, &format!("Service \"web\" is invalid: {message}"));
    }
    assert_eq!(used(&s).await, (1, 0), "a refused create allocated");
}

#[tokio::test]
async fn requested_addresses_of_both_families_are_taken_together_or_not_at_all() {
    let s = dual().await;
    let both = json!({"ipFamilyPolicy":"RequireDualStack","clusterIP":"10.96.7.7",
                      "clusterIPs":["10.96.7.7","fd00:10:96::7"]});
    let r = post(&s, svc("a", both.clone())).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert_eq!(
        ips(&r.body),
        vec!["10.96.7.7".to_owned(), "fd00:10:96::7".to_owned()]
    );
    // The secondary is taken: the create fails and the free primary it asked for stays free.
    let clash = json!({"ipFamilyPolicy":"RequireDualStack","clusterIP":"10.96.8.8",
                       "clusterIPs":["10.96.8.8","fd00:10:96::7"]});
    let r = post(&s, svc("b", clash)).await;
    assert_invalid(
        &r,
        "Service \"b\" is invalid: spec.clusterIPs: Invalid value: []string{\"10.96.8.8\", \
         \"fd00:10:96::7\"}: failed to allocate IP fd00:10:96::7: provided IP is already allocated",
    );
    assert_eq!(used(&s).await, (2, 1));
    let r = post(&s, svc("c", json!({"clusterIP":"10.96.8.8"}))).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert_consistent(&s).await;
}

#[tokio::test]
async fn a_full_secondary_range_is_kubes_500_and_leaks_no_primary_address() {
    // A /124 has 15 usable addresses.
    let s = server("10.96.0.0/16", Some("fd00::/124")).await;
    for i in 0..15 {
        let r = post(
            &s,
            svc(
                &format!("s{i}"),
                json!({"ipFamilyPolicy":"RequireDualStack"}),
            ),
        )
        .await;
        assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    }
    let r = post(
        &s,
        svc("full", json!({"ipFamilyPolicy":"RequireDualStack"})),
    )
    .await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR, "{}", r.body);
    assert_eq!(
        r.body["message"],
        "Internal error occurred: failed to allocate a serviceIP: range is full"
    );
    assert_eq!(used(&s).await, (16, 15));
    // PreferDualStack does not fall back to one family either: kube allocates every family.
    let r = post(&s, svc("full", json!({"ipFamilyPolicy":"PreferDualStack"}))).await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR, "{}", r.body);
    assert_consistent(&s).await;
}

#[tokio::test]
async fn upgrade_adds_the_secondary_and_downgrade_releases_it_with_the_write() {
    let s = dual().await;
    let r = post(&s, svc("web", json!({}))).await;
    let primary = ips(&r.body)[0].clone();
    assert_eq!(used(&s).await, (2, 0));

    // Upgrade: the policy alone asks for it.
    let r = merge_patch(
        &s,
        "web",
        json!({"spec":{"ipFamilyPolicy":"PreferDualStack"}}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let got = ips(&r.body);
    assert_eq!(got[0], primary);
    assert!(got[1].starts_with("fd00:10:96::"), "{got:?}");
    assert_eq!(r.body["spec"]["ipFamilies"], json!(["IPv4", "IPv6"]));
    assert_eq!(used(&s).await, (2, 1));
    assert_consistent(&s).await;

    // Dropping the secondary without SingleStack is refused, in kube's words.
    let r = merge_patch(
        &s,
        "web",
        json!({"spec":{"clusterIPs":[primary.clone()],"ipFamilies":["IPv4"]}}),
    )
    .await;
    assert_invalid(
        &r,
        "Service \"web\" is invalid: [spec.ipFamilyPolicy: Invalid value: \"PreferDualStack\": \
         must be 'SingleStack' to release the secondary cluster IP, spec.ipFamilyPolicy: Invalid \
         value: \"PreferDualStack\": must be 'SingleStack' to release the secondary IP family]",
    );
    // The primary family cannot change.
    let r = merge_patch(
        &s,
        "web",
        json!({"spec":{"ipFamilies":["IPv6","IPv4"],"clusterIPs":null,"clusterIP":null}}),
    )
    .await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", r.body);

    // Downgrade: SingleStack with the fields as they are keeps the primary only.
    let r = merge_patch(&s, "web", json!({"spec":{"ipFamilyPolicy":"SingleStack"}})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(ips(&r.body), vec![primary.clone()]);
    assert_eq!(r.body["spec"]["ipFamilies"], json!(["IPv4"]));
    assert_eq!(used(&s).await, (2, 0));
    assert_consistent(&s).await;
}

#[tokio::test]
async fn type_changes_and_deletes_release_both_families() {
    let s = dual().await;
    let r = post(&s, svc("web", json!({"ipFamilyPolicy":"RequireDualStack"}))).await;
    assert_eq!(ips(&r.body).len(), 2);
    let r = merge_patch(
        &s,
        "web",
        json!({"spec":{"type":"ExternalName","externalName":"example.com"}}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert!(ips(&r.body).is_empty(), "{}", r.body);
    assert!(r.body["spec"]["ipFamilies"].is_null(), "{}", r.body);
    assert_eq!(used(&s).await, (1, 0));
    // And back: ExternalName to ClusterIP allocates again, by the policy given.
    let r = merge_patch(
        &s,
        "web",
        json!({"spec":{"type":"ClusterIP","externalName":null,"ipFamilyPolicy":"PreferDualStack"}}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(ips(&r.body).len(), 2, "{}", r.body);
    assert_eq!(used(&s).await, (2, 1));
    let r = delete(&s, "web").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(used(&s).await, (1, 0));
    assert_consistent(&s).await;
}

#[tokio::test]
async fn an_unchanged_prefer_dual_stack_service_is_left_as_it_is() {
    // A PreferDualStack Service created single-stack (as on a single-stack cluster) is not
    // upgraded by an update that leaves its family fields alone.
    let s = dual().await;
    let r = post(
        &s,
        svc(
            "web",
            json!({"ipFamilyPolicy":"PreferDualStack","ipFamilies":["IPv4","IPv6"]}),
        ),
    )
    .await;
    assert_eq!(ips(&r.body).len(), 2);
    let r = merge_patch(&s, "web", json!({"metadata":{"labels":{"x":"y"}}})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(ips(&r.body).len(), 2);
    assert_eq!(used(&s).await, (2, 1));
}
