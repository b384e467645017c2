//! Discovery entries of `rbac.authorization.k8s.io` (its kinds are listed from
//! [`crate::resource::Kind`]) and of `authorization.k8s.io`, whose access reviews are
//! create-only and not stored.

use serde_json::{Value, json};

/// The group of the access reviews.
pub const AUTHORIZATION_GROUP: &str = "authorization.k8s.io";

fn group(name: &str) -> Value {
    json!({
        "name": name,
        "versions": [{"groupVersion": format!("{name}/v1"), "version": "v1"}],
        "preferredVersion": {"groupVersion": format!("{name}/v1"), "version": "v1"},
    })
}

/// `rbac.authorization.k8s.io` in `/apis`.
pub fn rbac_group() -> Value {
    group("rbac.authorization.k8s.io")
}

/// `authorization.k8s.io` in `/apis`.
pub fn authorization_group() -> Value {
    group(AUTHORIZATION_GROUP)
}

/// `/apis/authorization.k8s.io/v1`, or `None` for another group-version.
pub fn authorization_resources(group: &str, version: &str) -> Option<Value> {
    if group != AUTHORIZATION_GROUP || version != "v1" {
        return None;
    }
    let resource = |name: &str, kind: &str| {
        json!({
            "name": name,
            "singularName": "",
            "namespaced": false,
            "kind": kind,
            "verbs": ["create"],
        })
    };
    Some(json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": "authorization.k8s.io/v1",
        "resources": [
            resource("selfsubjectaccessreviews", "SelfSubjectAccessReview"),
            resource("selfsubjectrulesreviews", "SelfSubjectRulesReview"),
            resource("subjectaccessreviews", "SubjectAccessReview"),
        ],
    }))
}
