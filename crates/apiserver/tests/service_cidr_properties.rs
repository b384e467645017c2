//! Property test: random creates, updates and deletes of Services across the flag's range and
//! two added, overlapping ServiceCIDRs never give an address twice and never leak one: after
//! every step the stored allocations equal exactly what the Services hold, the IPAddress
//! objects are exactly the Services' ClusterIPs, and once the Services are gone only
//! `default/kubernetes` holds an address.

use axum::body::Body;
use http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use nodeport_apiserver::{AppState, Config};
use proptest::prelude::*;
use serde_json::{Value, json};
use tower::ServiceExt;

const SERVICES: &str = "/api/v1/namespaces/default/services";
const CIDRS: &str = "/apis/networking.k8s.io/v1/servicecidrs";

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

/// One step of a sequence.
#[derive(Debug, Clone)]
enum Step {
    /// Create Service `n`: dynamic, or asking for the `k`-th address of one of the ranges.
    Create {
        n: u8,
        ask: Option<(u8, u8)>,
        dual: bool,
    },
    /// Switch Service `n` to ExternalName (releases) or back to ClusterIP (allocates).
    Flip { n: u8 },
    /// Upgrade Service `n` to dual stack, or downgrade it.
    Stack { n: u8, dual: bool },
    /// Delete Service `n`.
    Delete { n: u8 },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0..12u8, proptest::option::of((0..3u8, 1..15u8)), any::<bool>())
            .prop_map(|(n, ask, dual)| Step::Create { n, ask, dual }),
        1 => (0..12u8).prop_map(|n| Step::Flip { n }),
        1 => (0..12u8, any::<bool>()).prop_map(|(n, dual)| Step::Stack { n, dual }),
        2 => (0..12u8).prop_map(|n| Step::Delete { n }),
    ]
}

/// The flag's ranges are /28s (14 addresses per family); `a` and `b` overlap.
const RANGES: [&str; 3] = ["10.96.0.0/28", "10.97.0.0/28", "10.97.0.0/27"];

fn address(range: u8, k: u8) -> String {
    let base = ["10.96.0", "10.97.0", "10.97.0"][usize::from(range)];
    format!("{base}.{k}")
}

async fn run(steps: Vec<Step>) -> Result<(), TestCaseError> {
    let config = Config {
        cluster_ip_range: RANGES[0].parse().unwrap(),
        secondary_cluster_ip_range: Some("fd00:10:96::/124".parse().unwrap()),
        ..Config::default()
    };
    let s = nodeport_apiserver::in_memory(&config).await.unwrap();
    for (name, cidr) in [("a", RANGES[1]), ("b", RANGES[2])] {
        let body = json!({"apiVersion":"networking.k8s.io/v1","kind":"ServiceCIDR",
            "metadata":{"name":name},"spec":{"cidrs":[cidr]}});
        let (status, _) = call(&s, Method::POST, CIDRS, "application/json", body).await;
        prop_assert_eq!(status, StatusCode::CREATED);
    }
    for step in steps {
        match step {
            Step::Create { n, ask, dual } => {
                let mut spec = json!({"ports":[{"port":80}]});
                if dual {
                    spec["ipFamilyPolicy"] = json!("PreferDualStack");
                }
                if let Some((range, k)) = ask {
                    spec["clusterIP"] = json!(address(range, k));
                }
                let body = json!({"apiVersion":"v1","kind":"Service",
                    "metadata":{"name":format!("s{n}")},"spec":spec});
                let (status, reply) =
                    call(&s, Method::POST, SERVICES, "application/json", body).await;
                // Refusals (taken, full, already exists) are fine; anything else is not.
                prop_assert!(
                    matches!(status.as_u16(), 201 | 409 | 422 | 500),
                    "{} {}",
                    status,
                    reply
                );
                if status == StatusCode::INTERNAL_SERVER_ERROR {
                    prop_assert!(
                        reply["message"]
                            .as_str()
                            .unwrap_or("")
                            .contains("range is full")
                    );
                }
            }
            Step::Flip { n } => {
                let uri = format!("{SERVICES}/s{n}");
                let (status, current) = call(&s, Method::GET, &uri, "", Value::Null).await;
                if status != StatusCode::OK {
                    continue;
                }
                let patch = if current["spec"]["type"] == "ExternalName" {
                    json!({"spec":{"type":"ClusterIP","externalName":null}})
                } else {
                    json!({"spec":{"type":"ExternalName","externalName":"example.com"}})
                };
                let (status, reply) = call(
                    &s,
                    Method::PATCH,
                    &uri,
                    "application/merge-patch+json",
                    patch,
                )
                .await;
                prop_assert!(matches!(status.as_u16(), 200 | 500), "{} {}", status, reply);
            }
            Step::Stack { n, dual } => {
                let uri = format!("{SERVICES}/s{n}");
                let policy = if dual {
                    "RequireDualStack"
                } else {
                    "SingleStack"
                };
                let patch = json!({"spec":{"ipFamilyPolicy":policy}});
                let (status, reply) = call(
                    &s,
                    Method::PATCH,
                    &uri,
                    "application/merge-patch+json",
                    patch,
                )
                .await;
                prop_assert!(
                    matches!(status.as_u16(), 200 | 404 | 422 | 500),
                    "{} {}",
                    status,
                    reply
                );
            }
            Step::Delete { n } => {
                let uri = format!("{SERVICES}/s{n}");
                let (status, _) = call(&s, Method::DELETE, &uri, "", Value::Null).await;
                prop_assert!(matches!(status.as_u16(), 200 | 404));
            }
        }
        // No address twice among the Services, and the allocations equal what they hold.
        let (_, list) = call(&s, Method::GET, SERVICES, "", Value::Null).await;
        let mut seen = std::collections::BTreeSet::new();
        for item in list["items"].as_array().unwrap() {
            for ip in item["spec"]["clusterIPs"].as_array().into_iter().flatten() {
                let ip = ip.as_str().unwrap().to_owned();
                prop_assert!(seen.insert(ip.clone()), "{} given twice", ip);
            }
        }
        let report = s.registry.verify().await.unwrap();
        prop_assert!(report.is_consistent(), "{:?}", report);
        // The IPAddress objects are exactly the Services' ClusterIPs.
        let (_, objects) = call(
            &s,
            Method::GET,
            "/apis/networking.k8s.io/v1/ipaddresses",
            "",
            Value::Null,
        )
        .await;
        let objects: std::collections::BTreeSet<String> = objects["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| o["metadata"]["name"].as_str().unwrap().to_owned())
            .collect();
        prop_assert_eq!(&objects, &seen);
    }
    for n in 0..12 {
        call(
            &s,
            Method::DELETE,
            &format!("{SERVICES}/s{n}"),
            "",
            Value::Null,
        )
        .await;
    }
    let report = s.registry.verify().await.unwrap();
    prop_assert!(report.is_consistent(), "{:?}", report);
    let (_, ranges) = call(&s, Method::GET, "/ranges", "", Value::Null).await;
    prop_assert_eq!(&ranges["clusterIPs"]["used"], &json!(1));
    prop_assert_eq!(&ranges["secondaryClusterIPs"]["used"], &json!(0));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn random_service_writes_across_two_service_cidrs_never_double_or_leak_an_address(
        steps in proptest::collection::vec(step(), 1..40)
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(run(steps))?;
    }
}
