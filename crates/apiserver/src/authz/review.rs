//! `authorization.k8s.io/v1` access reviews, answered from the authorizers and not stored:
//! SelfSubjectAccessReview (`kubectl auth can-i`), SelfSubjectRulesReview
//! (`kubectl auth can-i --list`) and SubjectAccessReview (any user's access; RBAC grants its
//! `create` to cluster admins only).

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use serde_json::{Value, json};

use super::{Attributes, Authorizer, UserInfo};
use crate::error::{ApiError, FieldError};
use crate::rest::{AppState, MAX_BODY_BYTES, json_response, protobuf};

/// Which review a handler answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Review {
    SelfAccess,
    SelfRules,
    Access,
}

impl Review {
    fn kind(self) -> &'static str {
        match self {
            Review::SelfAccess => "SelfSubjectAccessReview",
            Review::SelfRules => "SelfSubjectRulesReview",
            Review::Access => "SubjectAccessReview",
        }
    }
}

/// `POST /apis/authorization.k8s.io/v1/selfsubjectaccessreviews`.
pub async fn self_subject_access_review(
    State(state): State<AppState>,
    request: Request,
) -> Response {
    answer(&state, request, Review::SelfAccess).await
}

/// `POST /apis/authorization.k8s.io/v1/selfsubjectrulesreviews`.
pub async fn self_subject_rules_review(
    State(state): State<AppState>,
    request: Request,
) -> Response {
    answer(&state, request, Review::SelfRules).await
}

/// `POST /apis/authorization.k8s.io/v1/subjectaccessreviews`.
pub async fn subject_access_review(State(state): State<AppState>, request: Request) -> Response {
    answer(&state, request, Review::Access).await
}

async fn answer(state: &AppState, request: Request, review: Review) -> Response {
    match run(state, request, review).await {
        Ok(value) => json_response(StatusCode::CREATED, &value),
        Err(err) => err.into_response(),
    }
}

fn invalid(review: Review, errors: Vec<FieldError>) -> ApiError {
    ApiError::invalid(
        crate::error::Subject {
            group: super::discovery::AUTHORIZATION_GROUP,
            resource: "",
            kind: review.kind(),
        },
        "",
        errors,
    )
}

async fn decode(body: Body, content_type: &str) -> Result<Value, ApiError> {
    let bytes = axum::body::to_bytes(body, MAX_BODY_BYTES)
        .await
        .map_err(|e| ApiError::bad_request(format!("failed to read the request body: {e}")))?;
    match content_type {
        protobuf::MEDIA_TYPE => protobuf::decode_review(&bytes).map_err(|e| {
            if e.is_unsupported() {
                ApiError::unsupported_media_type(e.to_string())
            } else {
                ApiError::bad_request(crate::report(&e))
            }
        }),
        "application/yaml" => yaml_serde::from_slice(&bytes).map_err(|e| {
            ApiError::bad_request(format!("error converting YAML to JSON: yaml: {e}"))
        }),
        _ => serde_json::from_slice(&bytes).map_err(|e| {
            ApiError::bad_request(format!("couldn't get version/kind; json parse error: {e}"))
        }),
    }
}

/// The attributes a review's spec asks about, for `user`.
fn spec_attributes(review: Review, spec: &Value, user: UserInfo) -> Result<Attributes, ApiError> {
    let s = |v: &Value, k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
    match (
        spec.get("resourceAttributes"),
        spec.get("nonResourceAttributes"),
    ) {
        (Some(r), None) if r.is_object() => {
            let mut a = Attributes::resource(
                user,
                &s(r, "verb"),
                &s(r, "group"),
                &s(r, "resource"),
                &s(r, "namespace"),
                &s(r, "name"),
            );
            a.subresource = s(r, "subresource");
            a.api_version = s(r, "version");
            Ok(a)
        }
        (None, Some(n)) if n.is_object() => Ok(Attributes {
            user,
            verb: s(n, "verb"),
            resource_request: false,
            path: s(n, "path"),
            ..Attributes::default()
        }),
        _ => Err(invalid(
            review,
            vec![FieldError::invalid(
                "spec.resourceAttributes",
                crate::error::GoValue::Raw("null".into()),
                "exactly one of nonResourceAttributes or resourceAttributes must be specified",
            )],
        )),
    }
}

fn status_of(authorizer: &Authorizer, a: &Attributes) -> Value {
    let decision = authorizer.authorize(a);
    let mut status = json!({"allowed": decision.allowed});
    if !decision.reason.is_empty() {
        status["reason"] = json!(decision.reason);
    }
    status
}

async fn run(state: &AppState, request: Request, review: Review) -> Result<Value, ApiError> {
    let (parts, body) = request.into_parts();
    let user = parts
        .extensions
        .get::<UserInfo>()
        .cloned()
        .unwrap_or_else(UserInfo::local_admin);
    let authorizer = parts
        .extensions
        .get::<Authorizer>()
        .cloned()
        .unwrap_or_else(|| state.authorizer.clone());
    let content_type = parts
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            v.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase()
        })
        .unwrap_or_default();
    let mut object = decode(body, &content_type).await?;
    if !object.is_object() {
        return Err(ApiError::bad_request("the body is not an object"));
    }
    object["apiVersion"] = json!("authorization.k8s.io/v1");
    object["kind"] = json!(review.kind());
    if object.get("metadata").is_none_or(Value::is_null) {
        object["metadata"] = json!({});
    }
    let spec = object.get("spec").cloned().unwrap_or(Value::Null);
    let status = match review {
        Review::SelfAccess => status_of(&authorizer, &spec_attributes(review, &spec, user)?),
        Review::Access => {
            let name = spec.get("user").and_then(Value::as_str).unwrap_or("");
            let groups: Vec<String> = spec
                .get("groups")
                .and_then(Value::as_array)
                .map(|g| {
                    g.iter()
                        .filter_map(Value::as_str)
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default();
            if name.is_empty() && groups.is_empty() {
                return Err(invalid(
                    review,
                    vec![FieldError::invalid(
                        "spec.user",
                        crate::error::GoValue::Str(""),
                        "at least one of user or group must be specified",
                    )],
                ));
            }
            let subject = UserInfo {
                name: name.to_owned(),
                uid: spec
                    .get("uid")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_owned(),
                groups,
            };
            status_of(&authorizer, &spec_attributes(review, &spec, subject)?)
        }
        Review::SelfRules => {
            let namespace = spec.get("namespace").and_then(Value::as_str).unwrap_or("");
            rules_status(&authorizer, &user, namespace)
        }
    };
    object["status"] = status;
    Ok(object)
}

/// `SubjectRulesReviewStatus`: the rules RBAC gives the user in `namespace`. Under
/// `AlwaysAllow` (or for `system:masters`) every action is allowed, which the rules given by
/// bindings may not show: the list is then marked incomplete, as kube marks what an authorizer
/// cannot list.
fn rules_status(authorizer: &Authorizer, user: &UserInfo, namespace: &str) -> Value {
    let (rules, errors) = authorizer.policy().read(|p| p.rules_for(user, namespace));
    let mut resource_rules = Vec::new();
    let mut non_resource_rules = Vec::new();
    for r in rules {
        if !r.non_resource_urls.is_empty() {
            non_resource_rules
                .push(json!({"verbs": r.verbs, "nonResourceURLs": r.non_resource_urls}));
        } else {
            let mut rule = json!({"verbs": r.verbs});
            if !r.api_groups.is_empty() {
                rule["apiGroups"] = json!(r.api_groups);
            }
            if !r.resources.is_empty() {
                rule["resources"] = json!(r.resources);
            }
            if !r.resource_names.is_empty() {
                rule["resourceNames"] = json!(r.resource_names);
            }
            resource_rules.push(rule);
        }
    }
    let always_allow = authorizer.modes().contains(&super::Mode::AlwaysAllow);
    let mut status = json!({
        "resourceRules": resource_rules,
        "nonResourceRules": non_resource_rules,
        "incomplete": always_allow || !errors.is_empty(),
    });
    if !errors.is_empty() {
        status["evaluationError"] = json!(errors.join(", "));
    }
    status
}
